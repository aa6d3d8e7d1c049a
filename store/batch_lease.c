/*
 * batch_lease.c: which broker drives each open batch (store.h "batch
 * leases"; table batch_leases, migration 2), and the reads a broker needs
 * to rebuild a batch from the record.
 *
 * The fence: a driver's writes go through store_batch_append(), which runs
 * store_append_many() inside an explicit transaction whose first statement
 * extends the driver's leases, so the events commit only together with the
 * proof that the writer still drives every batch they touch. The lease
 * rows stay locked until the commit, so a broker taking a batch over waits
 * for (or skips) it and then sees the new lease.
 */
#include "store_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Arrays of ids here are one per target or batch: far above a message. */
#define ARR_CAP (64u * 1024 * 1024)

static const char fence_sql[] =
    "WITH l AS (\n"
    "  INSERT INTO batch_leases AS l (batch_id, owner, lease_until,\n"
    "    reply_subject, progress_subject)\n"
    "  SELECT u.id, $1, CASE WHEN u.ended THEN 'infinity'::timestamptz\n"
    "                   ELSE now() + $2::bigint * interval '1 millisecond'"
    " END,\n"
    "    nullif(u.r, ''), nullif(u.p, '')\n"
    "  FROM unnest($3::text[], $4::text[], $5::text[], $6::bool[])\n"
    "    AS u(id, r, p, ended)\n"
    "  ORDER BY u.id\n"
    "  ON CONFLICT (batch_id) DO UPDATE SET lease_until = excluded.lease_until\n"
    "  WHERE l.owner = excluded.owner AND l.lease_until <> 'infinity'\n"
    "  RETURNING 1\n"
    ")\n"
    "SELECT (SELECT count(*) FROM l),\n"
    "  EXISTS (SELECT 1 FROM events WHERE event_id = $7::uuid)";

static const char renew_sql[] =
    "UPDATE batch_leases\n"
    "  SET lease_until = now() + $2::bigint * interval '1 millisecond'\n"
    "WHERE owner = $1 AND batch_id = ANY ($3::text[])\n"
    "  AND lease_until <> 'infinity'\n"
    "RETURNING batch_id, coalesce(reply_subject, ''),\n"
    "  coalesce(progress_subject, ''), cancel_requested";

/* Oldest first; SKIP LOCKED: two brokers adopting at once split the work
 * instead of waiting for each other (and never take the same batch). */
static const char adopt_sql[] =
    "WITH c AS (\n"
    "  SELECT l.batch_id FROM batch_leases l\n"
    "  JOIN batches b ON b.batch_id = l.batch_id\n"
    "  WHERE l.lease_until < now() AND b.status = 'Running'\n"
    "  ORDER BY l.lease_until, l.batch_id LIMIT $3\n"
    "  FOR UPDATE OF l SKIP LOCKED\n"
    ")\n"
    "UPDATE batch_leases l SET owner = $1,\n"
    "  lease_until = now() + $2::bigint * interval '1 millisecond'\n"
    "FROM c WHERE l.batch_id = c.batch_id\n"
    "RETURNING l.batch_id, coalesce(l.reply_subject, ''),\n"
    "  coalesce(l.progress_subject, ''), l.cancel_requested";

/* Open leases have a finite lease_until: the index finds them. */
static const char release_sql[] =
    "UPDATE batch_leases SET lease_until = '-infinity'\n"
    "WHERE owner = $1 AND lease_until > '-infinity'\n"
    "  AND lease_until < 'infinity'\n"
    "  AND ($2::text[] IS NULL OR batch_id = ANY ($2::text[]))";

/* Terminal or not is decided in C (kproto_status_terminal), the one
 * definition. */
static const char states_sql[] =
    "SELECT command_id::text, status, attempt FROM commands\n"
    "WHERE command_id = ANY ($1::uuid[])";

static int
owner_ok(const char *owner)
{
    return owner && owner[0] && strlen(owner) <= STORE_BATCH_OWNER_MAX;
}

static int
text_array(struct store__buf *b, const char *const *v, size_t n)
{
    int rc = store__arr_begin(b, STORE__OID_TEXT, n);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        const char *s = v[i] ? v[i] : "";
        rc = store__arr_put(b, s, strlen(s));
    }
    return rc;
}

/* Runs sql (no parameters) and expects no rows; 0 or a code. */
static int
exec_cmd(struct store *s, const char *sql)
{
    return store__exec(s, sql, NULL);
}

/* Commits the transaction this file opened: KS_EPG unless it committed
 * (COMMIT of a failed transaction answers ROLLBACK; a connection reset
 * meanwhile leaves no transaction to commit). */
static int
commit(struct store *s)
{
    int rc = 0;
    if (PQtransactionStatus(s->conn) != PQTRANS_INTRANS)
        return KS_EPG;
    PGresult *res = PQexec(s->conn, "COMMIT");
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        rc = store__pg_error(s, res, NULL);
    if (rc == KS_EPGDOWN)
        s->in_doubt = true; /* the answer to COMMIT was lost */
    else if (rc == 0 && strcmp(PQcmdStatus(res), "COMMIT") != 0)
        rc = KS_EPG;
    PQclear(res);
    if (rc == 0)
        store__wake();
    return rc;
}

static void
rollback(struct store *s)
{
    if (PQstatus(s->conn) == CONNECTION_OK &&
        PQtransactionStatus(s->conn) != PQTRANS_IDLE)
        PQclear(PQexec(s->conn, "ROLLBACK"));
}

int
store_batch_append(struct store *s, const char *owner, int lease_ms,
                   const struct store_batch_lease *leases, size_t n_leases,
                   const Ks__Event *const *events, size_t n, size_t *dup_out)
{
    struct store__buf ids = {.cap = ARR_CAP}, rep = {.cap = ARR_CAP},
                      prog = {.cap = ARR_CAP}, ended = {.cap = ARR_CAP};
    struct store__params p = {0};
    PGresult *res = NULL;
    bool in_tx = false;
    int rc;

    BUG_ON(!s || (n_leases && !leases) || (n && !events));
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (!owner_ok(owner) || n == 0 || lease_ms <= 0 || !events[0] ||
        !events[0]->event_id || !ks_is_uuid(events[0]->event_id))
        return KS_EINVAL;
    if ((rc = store__arr_begin(&ids, STORE__OID_TEXT, n_leases)) < 0 ||
        (rc = store__arr_begin(&rep, STORE__OID_TEXT, n_leases)) < 0 ||
        (rc = store__arr_begin(&prog, STORE__OID_TEXT, n_leases)) < 0 ||
        (rc = store__arr_begin(&ended, STORE__OID_BOOL, n_leases)) < 0)
        goto out;
    for (size_t i = 0; i < n_leases; i++) {
        const struct store_batch_lease *l = &leases[i];
        const char *r = l->reply_subject ? l->reply_subject : "";
        const char *pr = l->progress_subject ? l->progress_subject : "";
        uint8_t e = l->ended ? 1 : 0;
        if (!l->batch_id || !l->batch_id[0]) {
            rc = KS_EINVAL;
            goto out;
        }
        if ((rc = store__arr_put(&ids, l->batch_id, strlen(l->batch_id))) <
                0 ||
            (rc = store__arr_put(&rep, r, strlen(r))) < 0 ||
            (rc = store__arr_put(&prog, pr, strlen(pr))) < 0 ||
            (rc = store__arr_put(&ended, &e, 1)) < 0)
            goto out;
    }
    /* Outside the transaction: a statement prepared in one that rolls
     * back need not survive it. */
    if ((rc = store__prepare(s, NULL)) < 0)
        goto out;
    if ((rc = exec_cmd(s, STORE__BEGIN_APPENDING)) < 0)
        goto out;
    in_tx = true;
    store__p_text(&p, owner);
    store__p_i64(&p, lease_ms);
    store__p_bin(&p, ids.p, ids.len);
    store__p_bin(&p, rep.p, rep.len);
    store__p_bin(&p, prog.p, prog.len);
    store__p_bin(&p, ended.p, ended.len);
    store__p_text(&p, events[0]->event_id);
    res = PQexecParams(s->conn, fence_sql, p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        rc = store__pg_error(s, res, NULL);
        if (rc == 0)
            rc = KS_EPG;
        goto out;
    }
    long long held = atoll(PQgetvalue(res, 0, 0));
    bool recorded = PQgetvalue(res, 0, 1)[0] == 't';
    if (recorded) {
        /* A call whose commit succeeded but whose answer was lost: the
         * events commit together, so the first one stands for all. */
        if ((rc = commit(s)) == 0 && dup_out)
            *dup_out = n;
        in_tx = false;
        goto out;
    }
    if (held != (long long)n_leases) {
        rc = KS_ECONFLICT;
        goto out;
    }
    if ((rc = store_append_many(s, events, n, dup_out)) < 0)
        goto out;
    rc = commit(s);
    in_tx = false;
out:
    PQclear(res);
    if (in_tx)
        rollback(s);
    store__buf_release(&ids);
    store__buf_release(&rep);
    store__buf_release(&prog);
    store__buf_release(&ended);
    return rc;
}

/* Calls cb for each row (batch_id, reply, progress, cancel_requested). */
static int
each_held(PGresult *res, store_batch_held_fn cb, void *ud)
{
    for (int i = 0; i < PQntuples(res); i++) {
        struct store_batch_held h = {
            .batch_id = PQgetvalue(res, i, 0),
            .reply_subject = PQgetvalue(res, i, 1),
            .progress_subject = PQgetvalue(res, i, 2),
            .cancel_requested = PQgetvalue(res, i, 3)[0] == 't',
        };
        int rc = cb ? cb(&h, ud) : 0;
        if (rc)
            return rc;
    }
    return 0;
}

int
store_batch_renew(struct store *s, const char *owner, int lease_ms,
                  const char *const *batch_ids, size_t n,
                  store_batch_held_fn cb, void *ud)
{
    struct store__buf ids = {.cap = ARR_CAP};
    struct store__params p = {0};
    PGresult *res = NULL;
    int rc;

    BUG_ON(!s || (n && !batch_ids));
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (!owner_ok(owner) || lease_ms <= 0)
        return KS_EINVAL;
    if (n == 0)
        return 0;
    if ((rc = text_array(&ids, batch_ids, n)) < 0)
        goto out;
    store__p_text(&p, owner);
    store__p_i64(&p, lease_ms);
    store__p_bin(&p, ids.p, ids.len);
    res = PQexecParams(s->conn, renew_sql, p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        store__pg_error(s, res, NULL);
        rc = KS_EPG;
        goto out;
    }
    rc = each_held(res, cb, ud);
out:
    PQclear(res);
    store__buf_release(&ids);
    return rc;
}

int
store_batch_adopt(struct store *s, const char *owner, int lease_ms,
                  uint32_t limit, store_batch_held_fn cb, void *ud)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    BUG_ON(!s);
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (!owner_ok(owner) || lease_ms <= 0 || limit == 0 || limit > 1000)
        return KS_EINVAL;
    store__p_text(&p, owner);
    store__p_i64(&p, lease_ms);
    store__p_i64(&p, limit);
    res = PQexecParams(s->conn, adopt_sql, p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        store__pg_error(s, res, NULL);
        PQclear(res);
        return KS_EPG;
    }
    rc = each_held(res, cb, ud);
    PQclear(res);
    return rc;
}

int
store_batch_release(struct store *s, const char *owner,
                    const char *const *batch_ids, size_t n)
{
    struct store__buf ids = {.cap = ARR_CAP};
    struct store__params p = {0};
    PGresult *res = NULL;
    int rc = 0;

    BUG_ON(!s);
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (!owner_ok(owner))
        return KS_EINVAL;
    if (batch_ids && n == 0)
        return 0;
    store__p_text(&p, owner);
    if (batch_ids) {
        if ((rc = text_array(&ids, batch_ids, n)) < 0)
            goto out;
        store__p_bin(&p, ids.p, ids.len);
    } else {
        store__p_null(&p);
    }
    res = PQexecParams(s->conn, release_sql, p.n, NULL, p.val, p.len, p.fmt,
                       0);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        store__pg_error(s, res, NULL);
        rc = KS_EPG;
    }
out:
    PQclear(res);
    store__buf_release(&ids);
    return rc;
}

int
store_batch_request_cancel(struct store *s, const Ks__Event *ev)
{
    const char *params[1];
    PGresult *res = NULL;
    bool in_tx = false;
    int rc;

    BUG_ON(!s || !ev);
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (!ev->event_id || !ks_is_uuid(ev->event_id) || !ev->stream_id ||
        !ev->stream_id[0] || !ev->type || !ev->type[0])
        return KS_EINVAL;
    params[0] = ev->stream_id;
    if ((rc = store__prepare(s, NULL)) < 0)
        return rc;
    if ((rc = exec_cmd(s, STORE__BEGIN_APPENDING)) < 0)
        return rc;
    in_tx = true;
    /* Locks the row: the batch cannot end between this check and the
     * commit, so an open batch's driver (or adopter) sees the request. */
    res = PQexecParams(s->conn,
                       "SELECT 1 FROM batches WHERE batch_id = $1"
                       " AND status = 'Running' FOR UPDATE",
                       1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__pg_error(s, res, NULL);
        goto out;
    }
    if (PQntuples(res) == 0) {
        rc = KS_ENOTFOUND;
        goto out;
    }
    PQclear(res);
    res = NULL;
    struct store_event se = {ev};
    if ((rc = store_append(s, ev->stream_id, STORE_ANY, &se, 1, NULL)) < 0)
        goto out;
    res = PQexecParams(s->conn,
                       "INSERT INTO batch_leases (batch_id, owner,"
                       " lease_until, cancel_requested)"
                       " VALUES ($1, '', '-infinity', true)"
                       " ON CONFLICT (batch_id) DO UPDATE"
                       " SET cancel_requested = true",
                       1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        rc = store__pg_error(s, res, NULL);
        goto out;
    }
    rc = commit(s);
    in_tx = false;
out:
    PQclear(res);
    if (in_tx)
        rollback(s);
    return rc;
}

static Ks__CommandStatus
status_of(const char *name)
{
    for (int st = 0; st <= 64; st++)
        if (strcmp(kproto_status_name((Ks__CommandStatus)st), name) == 0)
            return (Ks__CommandStatus)st;
    return KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
}

int
store_command_states(struct store *s, const char *const *command_ids,
                     size_t n, int terminal_only, store_command_state_fn cb,
                     void *ud)
{
    struct store__buf ids = {.cap = ARR_CAP};
    struct store__params p = {0};
    PGresult *res = NULL;
    int rc;

    BUG_ON(!s || (n && !command_ids));
    /* A lost connection heals here, as in every store call. */
    if ((rc = store__ready(s)) < 0)
        return rc;
    if (n == 0)
        return 0;
    if ((rc = store__arr_begin(&ids, STORE__OID_UUID, n)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++)
        if ((rc = store__arr_put_uuid(&ids, command_ids[i])) < 0)
            goto out;
    store__p_bin(&p, ids.p, ids.len);
    res = PQexecParams(s->conn, states_sql, p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        store__pg_error(s, res, NULL);
        rc = KS_EPG;
        goto out;
    }
    for (int i = 0; i < PQntuples(res) && rc == 0; i++) {
        struct store_command_row c = {
            .command_id = PQgetvalue(res, i, 0),
            .status = status_of(PQgetvalue(res, i, 1)),
            .attempt = (uint32_t)strtoul(PQgetvalue(res, i, 2), NULL, 10),
        };
        if (terminal_only && !kproto_status_terminal(c.status))
            continue;
        rc = cb ? cb(&c, ud) : 0;
    }
out:
    PQclear(res);
    store__buf_release(&ids);
    return rc;
}

int
store_batch_leases_held(struct store *s, store_batch_lease_fn cb, void *ud)
{
    PGresult *res;
    int rc;

    BUG_ON(!s || !cb);
    if ((rc = store__ready(s)) < 0)
        return rc;
    res = PQexec(s->conn,
                 "SELECT owner, batch_id FROM batch_leases "
                 "WHERE owner <> '' AND lease_until > now() "
                 "AND lease_until <> 'infinity' ORDER BY owner, batch_id");
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        store__pg_error(s, res, NULL);
        PQclear(res);
        return KS_EPG;
    }
    for (int i = 0; i < PQntuples(res); i++)
        cb(PQgetvalue(res, i, 0), PQgetvalue(res, i, 1), ud);
    PQclear(res);
    return 0;
}
