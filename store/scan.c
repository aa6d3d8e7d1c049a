/* Queries for the broker's deadline scanner. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store_int.h"

/* The columns scan_refs reads, in its order. */
#define COMMAND_REF_COLUMNS                                                   \
    "SELECT command_id::text, agent_id, attempt, version,"                    \
    " coalesce(kscore_us(deliver_by), 0),"                                    \
    " coalesce(kscore_us(dispatched_at), 0),"                                 \
    " coalesce(kscore_us(started_at), 0)"

/*
 * Runs sql (COMMAND_REF_COLUMNS and the rest) with $1 text, $2 an epoch us
 * value and $3 the limit (0: 1000), and gives each row to cb as a
 * store_command_ref. 0, cb's non-zero, or the store's error.
 */
static int
scan_refs(struct store *s, const char *sql, const char *text, int64_t us,
          uint32_t limit, store_command_ref_fn cb, void *ud)
{
    char at[24], lim[16];
    const char *params[3] = {text, at, lim};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)) < 0)
        return rc;
    snprintf(at, sizeof(at), "%lld", (long long)us);
    snprintf(lim, sizeof(lim), "%u", limit ? limit : 1000);
    res = PQexecParams(s->conn, sql, 3, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    for (int i = 0; i < PQntuples(res) && rc == 0; i++) {
        struct store_command_ref ref = {0};
        snprintf(ref.command_id, sizeof(ref.command_id), "%s",
                 PQgetvalue(res, i, 0));
        snprintf(ref.agent_id, sizeof(ref.agent_id), "%s",
                 PQgetvalue(res, i, 1));
        ref.attempt = (uint32_t)strtoul(PQgetvalue(res, i, 2), NULL, 10);
        ref.version = strtoll(PQgetvalue(res, i, 3), NULL, 10);
        ref.deliver_by_us = strtoll(PQgetvalue(res, i, 4), NULL, 10);
        ref.dispatched_at_us = strtoll(PQgetvalue(res, i, 5), NULL, 10);
        ref.started_at_us = strtoll(PQgetvalue(res, i, 6), NULL, 10);
        rc = cb(&ref, ud);
    }
    PQclear(res);
    return rc;
}

int
store_scan_open(struct store *s, const char *status, int64_t due_before_us,
                uint32_t limit, store_command_ref_fn cb, void *ud)
{
    /* due_before_us = 0: every command in that status. */
    return scan_refs(
        s,
        COMMAND_REF_COLUMNS
        " FROM commands WHERE status = $1"
        " AND ($2::bigint = 0 OR deliver_by < kscore_ts($2::bigint))"
        " ORDER BY deliver_by NULLS LAST LIMIT $3::int",
        status, due_before_us, limit, cb, ud);
}

int
store_scan_dispatched(struct store *s, const char *agent_id,
                      int64_t dispatched_before_us, uint32_t limit,
                      store_command_ref_fn cb, void *ud)
{
    /* commands_open (status, deliver_by) narrows it to the open ones. */
    return scan_refs(
        s,
        COMMAND_REF_COLUMNS
        " FROM commands WHERE status = 'Dispatched' AND agent_id = $1"
        " AND dispatched_at < kscore_ts($2::bigint)"
        " ORDER BY dispatched_at LIMIT $3::int",
        agent_id, dispatched_before_us, limit, cb, ud);
}

int
store_scan_waiting(struct store *s, int64_t dispatched_before_us,
                   uint32_t limit, store_waiting_fn cb, void *ud)
{
    char before[24], lim[16];
    const char *params[2] = {before, lim};
    PGresult *res;
    int rc = 0;

    if ((rc = store__ready(s)) < 0)
        return rc;
    snprintf(before, sizeof(before), "%lld", (long long)dispatched_before_us);
    snprintf(lim, sizeof(lim), "%u", limit ? limit : 1000);
    /* commands_open (status, deliver_by) narrows it to the open ones. */
    res = PQexecParams(
        s->conn,
        "SELECT agent_id, count(*), kscore_us(min(dispatched_at))"
        " FROM commands WHERE status = 'Dispatched'"
        " AND dispatched_at < kscore_ts($1::bigint)"
        " GROUP BY agent_id ORDER BY 3 LIMIT $2::int",
        2, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    for (int i = 0; i < PQntuples(res) && rc == 0; i++) {
        struct store_waiting w = {0};
        snprintf(w.agent_id, sizeof(w.agent_id), "%s", PQgetvalue(res, i, 0));
        w.commands = (uint32_t)strtoul(PQgetvalue(res, i, 1), NULL, 10);
        w.oldest_dispatched_us = strtoll(PQgetvalue(res, i, 2), NULL, 10);
        rc = cb(&w, ud);
    }
    PQclear(res);
    return rc;
}

int
store_open_requests(struct store *s, store_open_request_fn cb, void *ud)
{
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)) < 0)
        return rc;
    /* length() of a bytea reads its size, not its (toasted) bytes. */
    res = PQexec(
        s->conn,
        "SELECT c.command_id::text, c.operator,"
        " coalesce((SELECT length(e.data) FROM events e"
        "   WHERE e.stream_id = 'command-' || c.command_id::text"
        "     AND e.type = 'CommandRequested' LIMIT 1), 0),"
        " coalesce(kscore_us(c.deliver_by), 0)"
        " FROM commands c"
        " WHERE c.status IN ('Pending', 'Dispatched', 'Running')");
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    for (int i = 0; i < PQntuples(res) && rc == 0; i++) {
        struct store_open_request r = {0};
        snprintf(r.command_id, sizeof(r.command_id), "%s",
                 PQgetvalue(res, i, 0));
        r.operator_name = PQgetvalue(res, i, 1);
        r.request_bytes = strtoull(PQgetvalue(res, i, 2), NULL, 10);
        r.deliver_by_us = strtoll(PQgetvalue(res, i, 3), NULL, 10);
        rc = cb(&r, ud);
    }
    PQclear(res);
    return rc;
}
