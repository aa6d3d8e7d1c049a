/*
 * replay.c: rebuilds the event-sourced projections (commands, batches,
 * batch_targets) from events alone, in one transaction:
 *
 *  1. LOCK events IN EXCLUSIVE MODE: appends wait, reads go on.
 *  2. Fresh tables kscore_replay.<name> (LIKE <name> INCLUDING ALL).
 *  3. search_path = kscore_replay, <schema>: the same kscore_project() the
 *     live path runs now writes the fresh tables; every event, in
 *     global_pos order (for one stream that is its version order, and rows
 *     of different streams only meet in commutative counters).
 *  4. Swap: drop the live tables, move the fresh ones into the schema,
 *     give their indexes the old names, drop kscore_replay.
 *
 * agents is not rebuilt: it is fed by heartbeats (store_upsert_agent), not
 * by events, and is left as it is.
 */
#include "store_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPLAY_FETCH_ROWS 2000

static const char swap_sql[] =
    "DO $do$\n"
    "DECLARE\n"
    "  sch text := %s;\n"
    "  r record;\n"
    "  renames text[] := '{}';\n"
    "BEGIN\n"
    "  FOR r IN\n"
    "    SELECT ni.relname AS new_name, oi.relname AS old_name\n"
    "    FROM pg_index nx\n"
    "    JOIN pg_class ni ON ni.oid = nx.indexrelid\n"
    "    JOIN pg_class nt ON nt.oid = nx.indrelid\n"
    "    JOIN pg_namespace nn ON nn.oid = nt.relnamespace\n"
    "     AND nn.nspname = 'kscore_replay'\n"
    "    JOIN pg_namespace onn ON onn.nspname = sch\n"
    "    JOIN pg_class ot ON ot.relname = nt.relname\n"
    "     AND ot.relnamespace = onn.oid\n"
    "    JOIN pg_index ox ON ox.indrelid = ot.oid\n"
    "    JOIN pg_class oi ON oi.oid = ox.indexrelid\n"
    "    WHERE regexp_replace(pg_get_indexdef(nx.indexrelid),\n"
    "                         '^.* ON [^ ]+ ', '')\n"
    "        = regexp_replace(pg_get_indexdef(ox.indexrelid),\n"
    "                         '^.* ON [^ ]+ ', '')\n"
    "  LOOP\n"
    "    IF r.new_name <> r.old_name THEN\n"
    "      renames := renames || ARRAY[r.new_name::text, r.old_name::text];\n"
    "    END IF;\n"
    "  END LOOP;\n"
    "  EXECUTE format('DROP TABLE %%1$I.commands, %%1$I.batches,'\n"
    "                 ' %%1$I.batch_targets', sch);\n"
    "  EXECUTE format('ALTER TABLE kscore_replay.commands SET SCHEMA %%I',\n"
    "                 sch);\n"
    "  EXECUTE format('ALTER TABLE kscore_replay.batches SET SCHEMA %%I',\n"
    "                 sch);\n"
    "  EXECUTE format('ALTER TABLE kscore_replay.batch_targets'\n"
    "                 ' SET SCHEMA %%I', sch);\n"
    "  FOR i IN 1 .. coalesce(array_length(renames, 1), 0) / 2 LOOP\n"
    "    EXECUTE format('ALTER INDEX %%I.%%I RENAME TO %%I', sch,\n"
    "                   renames[2 * i - 1], renames[2 * i]);\n"
    "  END LOOP;\n"
    "  DROP SCHEMA kscore_replay;\n"
    "END $do$";

/* Applies one FETCHed batch of events through one pipeline. */
static int
apply_rows(struct store *s, const PGresult *res)
{
    int rows = PQntuples(res), rc = 0;

    if (!PQenterPipelineMode(s->conn))
        return store__read_error(s, NULL);
    for (int i = 0; i < rows && rc == 0; i++) {
        int len = PQgetlength(res, i, 0);
        Ks__Event *ev;
        if (len > KS_MAX_MESSAGE_BYTES) {
            rc = KS_ETOOBIG;
            break;
        }
        ev = ks__event__unpack(NULL, (size_t)len,
                               (const uint8_t *)PQgetvalue(res, i, 0));
        if (!ev) {
            rc = KS_EDECODE;
            break;
        }
        /* Events recorded before a field was required are skipped, as
         * the live path would have refused them. */
        if (ev->event_id && ev->type && ev->stream_id) {
            int r = store__send_project(s, ev, true);
            if (r < 0)
                rc = r;
        }
        ks__event__free_unpacked(ev, NULL);
    }
    if (!PQpipelineSync(s->conn)) {
        int lost = store__read_error(s, NULL);
        s->broken = true; /* a pipeline without its sync */
        rc = rc ? rc : lost;
    } else {
        int frc = store__pipeline_finish(s, NULL, NULL);
        if (rc == 0)
            rc = frc;
    }
    if (!PQexitPipelineMode(s->conn)) {
        s->broken = true; /* results left unread: start afresh */
        if (rc == 0)
            rc = KS_EPG;
    }
    return rc;
}

int
store_replay(struct store *s, int64_t *events_out, char **errmsg)
{
    char *schema_lit = NULL, *schema_id = NULL, *sql = NULL;
    PGresult *res = NULL;
    int64_t count = 0;
    int rc;

    if ((rc = store__ready(s)) < 0) {
        if (errmsg) {
            free(*errmsg);
            *errmsg = strdup(store_last_error(s));
        }
        return rc;
    }
    if ((rc = store__prepare(s, errmsg)) < 0)
        return rc;
    if ((rc = store__exec(s,
                          "BEGIN;"
                          "LOCK TABLE events IN EXCLUSIVE MODE;"
                          "DROP SCHEMA IF EXISTS kscore_replay CASCADE;"
                          "CREATE SCHEMA kscore_replay",
                          errmsg)) < 0)
        goto out;
    res = PQexec(s->conn, "SELECT current_schema()");
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1 ||
        PQgetisnull(res, 0, 0)) {
        rc = store__pg_error(s, res, errmsg);
        goto out;
    }
    schema_lit = PQescapeLiteral(s->conn, PQgetvalue(res, 0, 0),
                                 (size_t)PQgetlength(res, 0, 0));
    schema_id = PQescapeIdentifier(s->conn, PQgetvalue(res, 0, 0),
                                   (size_t)PQgetlength(res, 0, 0));
    PQclear(res);
    res = NULL;
    if (!schema_lit || !schema_id) {
        rc = KS_EPG;
        goto out;
    }
    if (asprintf(&sql,
                 "CREATE TABLE kscore_replay.commands"
                 " (LIKE %1$s.commands INCLUDING ALL);"
                 "CREATE TABLE kscore_replay.batches"
                 " (LIKE %1$s.batches INCLUDING ALL);"
                 "CREATE TABLE kscore_replay.batch_targets"
                 " (LIKE %1$s.batch_targets INCLUDING ALL);"
                 "SET LOCAL search_path = kscore_replay, %1$s;"
                 "DECLARE ks_replay NO SCROLL CURSOR FOR"
                 " SELECT data FROM %1$s.events ORDER BY global_pos",
                 schema_id) == -1) {
        sql = NULL;
        rc = KS_EPG;
        goto out;
    }
    if ((rc = store__exec(s, sql, errmsg)) < 0)
        goto out;
    for (;;) {
        char fetch[64];
        snprintf(fetch, sizeof(fetch), "FETCH %d FROM ks_replay",
                 REPLAY_FETCH_ROWS);
        res = PQexecParams(s->conn, fetch, 0, NULL, NULL, NULL, NULL, 1);
        if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            rc = store__pg_error(s, res, errmsg);
            goto out;
        }
        if (PQntuples(res) == 0)
            break;
        count += PQntuples(res);
        if ((rc = apply_rows(s, res)) < 0)
            goto out;
        PQclear(res);
        res = NULL;
    }
    PQclear(res);
    res = NULL;
    free(sql);
    if (asprintf(&sql, "CLOSE ks_replay; SET LOCAL search_path = %s",
                 schema_id) == -1) {
        sql = NULL;
        rc = KS_EPG;
        goto out;
    }
    if ((rc = store__exec(s, sql, errmsg)) < 0)
        goto out;
    free(sql);
    if (asprintf(&sql, swap_sql, schema_lit) == -1) {
        sql = NULL;
        rc = KS_EPG;
        goto out;
    }
    if ((rc = store__exec(s, sql, errmsg)) < 0 ||
        (rc = store__exec(s, "COMMIT", errmsg)) < 0)
        goto out;
    if (events_out)
        *events_out = count;
out:
    PQclear(res);
    if (rc < 0 && PQtransactionStatus(s->conn) != PQTRANS_IDLE)
        PQclear(PQexec(s->conn, "ROLLBACK"));
    PQfreemem(schema_lit);
    PQfreemem(schema_id);
    free(sql);
    return rc == KS_EPGDOWN ? rc : rc < 0 ? KS_EPG : 0;
}
