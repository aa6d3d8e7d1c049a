/*
 * output.c: command output recorded in pieces (table command_output,
 * migration 4). An agent sends a running command's output as OutputChunk
 * events; the recorder keeps each piece here once (primary key: command,
 * stream, offset), decided against the command's state under its stream's
 * lock, and readers put the bytes back together by offset.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store_int.h"

static Ks__CommandStatus
status_of(const char *name)
{
    for (int st = 1; st <= KS__COMMAND_STATUS__NOT_STARTED; st++)
        if (strcmp(kproto_status_name((Ks__CommandStatus)st), name) == 0)
            return (Ks__CommandStatus)st;
    return KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
}

static void
rollback(struct store *s)
{
    PQclear(PQexec(s->conn, "ROLLBACK"));
}

int
store_append_output(struct store *s, const struct store_output_chunk *chunks,
                    size_t n, store_output_check_fn check, void *ud,
                    enum store_step *verdicts, const char **whys)
{
    PGresult *res;
    int rc;

    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!ks_is_uuid(chunks[i].command_id) ||
            (chunks[i].stream != 1 && chunks[i].stream != 2))
            return KS_EINVAL;
    if ((rc = store__ready(s)))
        return rc;
    res = PQexec(s->conn, "BEGIN");
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        rc = store__pg_error(s, res, NULL);
        PQclear(res);
        return rc;
    }
    PQclear(res);
    for (size_t i = 0; i < n && rc == 0; i++) {
        const struct store_output_chunk *c = &chunks[i];
        struct store_command_state st = {0};
        const char *why = NULL;
        char stream[64], off[24], sno[4];
        snprintf(stream, sizeof(stream), "command-%s", c->command_id);
        const char *p1[1] = {stream};
        /* The stream's row lock: a terminal event of the command (which
         * takes it for update) is not written meanwhile, so the state read
         * is the state the piece is decided against; and another
         * broker's piece of the same command waits, so the overlap
         * check below sees it (pieces of other commands do not wait). */
        res = PQexecParams(s->conn,
                           "SELECT c.status, c.agent_id, c.attempt"
                           " FROM streams st JOIN commands c"
                           "   ON c.command_id = substr(st.stream_id, 9)::uuid"
                           " WHERE st.stream_id = $1 FOR NO KEY UPDATE OF st",
                           1, NULL, p1, NULL, NULL, 0);
        if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            rc = store__pg_error(s, res, NULL);
            PQclear(res);
            break;
        }
        if (PQntuples(res) == 1) {
            st.exists = true;
            st.status = status_of(PQgetvalue(res, 0, 0));
            snprintf(st.agent_id, sizeof(st.agent_id), "%s",
                     PQgetvalue(res, 0, 1));
            st.attempt = (uint32_t)strtoul(PQgetvalue(res, 0, 2), NULL, 10);
        }
        PQclear(res);
        if (!st.exists) {
            why = "no such command";
        } else if (check && check(&st, c, &why, ud) != 0) {
            if (!why)
                why = "refused";
        }
        if (why) {
            verdicts[i] = STORE_STEP_ILLEGAL;
            if (whys)
                whys[i] = why;
            continue;
        }
        snprintf(off, sizeof(off), "%llu", (unsigned long long)c->offset);
        snprintf(sno, sizeof(sno), "%u", c->stream);
        /* Each byte of a stream is kept once: a piece that overlaps one
         * kept at another offset is refused (an agent's own pieces never
         * do; on cf06db5 one agent could store 1 MiB at every one of a
         * running command's 2^30 offsets, issue 21). The pieces kept are
         * disjoint, so only the last one that starts before this one's
         * end can overlap it. */
        {
            char end[24];
            snprintf(end, sizeof(end), "%llu",
                     (unsigned long long)(c->offset + c->len));
            const char *pq[3] = {c->command_id, sno, end};
            res = PQexecParams(s->conn,
                               "SELECT byte_offset, length(data)"
                               " FROM command_output"
                               " WHERE command_id = $1::uuid"
                               "   AND stream = $2::smallint"
                               "   AND byte_offset < $3::bigint"
                               " ORDER BY byte_offset DESC LIMIT 1",
                               3, NULL, pq, NULL, NULL, 0);
            if (PQresultStatus(res) != PGRES_TUPLES_OK) {
                rc = store__pg_error(s, res, NULL);
                PQclear(res);
                break;
            }
            bool overlaps = false;
            if (PQntuples(res) == 1) {
                uint64_t o = strtoull(PQgetvalue(res, 0, 0), NULL, 10);
                uint64_t l = strtoull(PQgetvalue(res, 0, 1), NULL, 10);
                overlaps = o != c->offset && o + l > c->offset;
            }
            PQclear(res);
            if (overlaps) {
                verdicts[i] = STORE_STEP_ILLEGAL;
                if (whys)
                    whys[i] = "output that overlaps output kept before";
                continue;
            }
        }
        const char *p2[4] = {c->command_id, sno, off, (const char *)c->data};
        int lens[4] = {0, 0, 0, (int)c->len};
        int fmts[4] = {0, 0, 0, 1};
        res = PQexecParams(s->conn,
                           "INSERT INTO command_output"
                           " (command_id, stream, byte_offset, data)"
                           " VALUES ($1::uuid, $2::smallint, $3::bigint, $4)"
                           " ON CONFLICT DO NOTHING",
                           4, NULL, p2, lens, fmts, 0);
        if (PQresultStatus(res) != PGRES_COMMAND_OK) {
            rc = store__pg_error(s, res, NULL);
            PQclear(res);
            break;
        }
        verdicts[i] = strcmp(PQcmdTuples(res), "1") == 0
                          ? STORE_STEP_APPLY
                          : STORE_STEP_DUPLICATE;
        PQclear(res);
    }
    if (rc) {
        rollback(s);
        return rc;
    }
    res = PQexec(s->conn, "COMMIT");
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        rc = store__pg_error(s, res, NULL);
    PQclear(res);
    return rc;
}

int
store_read_output(struct store *s, const char *command_id, uint32_t stream,
                  uint64_t offset, size_t max, uint8_t **data_out,
                  size_t *len_out)
{
    char sno[4], off[24], lim[24];
    PGresult *res;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    *data_out = NULL;
    *len_out = 0;
    if (!ks_is_uuid(command_id) || (stream != 1 && stream != 2))
        return KS_EINVAL;
    if ((rc = store__ready(s)))
        return rc;
    snprintf(sno, sizeof(sno), "%u", stream);
    snprintf(off, sizeof(off), "%llu", (unsigned long long)offset);
    snprintf(lim, sizeof(lim), "%zu", max);
    const char *p[4] = {command_id, sno, off, lim};
    /* The pieces that overlap [offset, offset + max), in order; only
     * what follows on without a gap is returned. */
    res = PQexecParams(s->conn,
                       "SELECT byte_offset, data FROM command_output"
                       " WHERE command_id = $1::uuid AND stream = $2::smallint"
                       "   AND byte_offset < $3::bigint + $4::bigint"
                       "   AND byte_offset + length(data) > $3::bigint"
                       " ORDER BY byte_offset",
                       4, NULL, p, NULL, NULL, 1);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    if (PQntuples(res) > 0 && !(buf = malloc(max ? max : 1))) {
        PQclear(res);
        return -ENOMEM;
    }
    for (int r = 0; r < PQntuples(res) && len < max; r++) {
        uint64_t at = (uint64_t)store__rd_i64(PQgetvalue(res, r, 0));
        const uint8_t *d = (const uint8_t *)PQgetvalue(res, r, 1);
        size_t dl = (size_t)PQgetlength(res, r, 1);
        uint64_t want = offset + len;
        if (at > want)
            break; /* a gap: not recorded (yet) */
        size_t skip = (size_t)(want - at);
        if (skip >= dl)
            continue;
        size_t take = dl - skip;
        if (take > max - len)
            take = max - len;
        memcpy(buf + len, d + skip, take);
        len += take;
    }
    PQclear(res);
    *data_out = buf;
    *len_out = len;
    return 0;
}
