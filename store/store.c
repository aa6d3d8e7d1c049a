/*
 * store.c: connection, migrations, errors, parameter helpers and the read
 * side (commands, streams, catch-up, notifications, agents).
 */
#include "store_int.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uuid/uuid.h>

/* ---- buffers ---- */

int
store__buf_reserve(struct store__buf *b, size_t more)
{
    size_t want, cap;
    uint8_t *p;

    if (more > b->cap || b->len > b->cap - more)
        return KS_ETOOBIG;
    want = b->len + more;
    if (want <= b->cap_alloc)
        return 0;
    cap = b->cap_alloc ? b->cap_alloc : 256;
    while (cap < want)
        cap *= 2;
    if (cap > b->cap)
        cap = b->cap;
    p = realloc(b->p, cap);
    if (!p)
        return -ENOMEM;
    b->p = p;
    b->cap_alloc = cap;
    return 0;
}

int
store__buf_put(struct store__buf *b, const void *p, size_t len)
{
    int rc = store__buf_reserve(b, len);
    if (rc < 0)
        return rc;
    if (len)
        memcpy(b->p + b->len, p, len);
    b->len += len;
    return 0;
}

int
store__buf_put_be32(struct store__buf *b, uint32_t v)
{
    uint8_t x[4] = {v >> 24, v >> 16, v >> 8, v};
    return store__buf_put(b, x, 4);
}

void
store__buf_release(struct store__buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap_alloc = 0;
}

int
store__arr_begin(struct store__buf *b, uint32_t elem_oid, size_t n)
{
    int rc;
    b->len = 0;
    if (n > INT32_MAX)
        return KS_ETOOBIG;
    if ((rc = store__buf_put_be32(b, 1)) < 0 ||       /* ndim */
        (rc = store__buf_put_be32(b, 0)) < 0 ||       /* has nulls */
        (rc = store__buf_put_be32(b, elem_oid)) < 0 || /* element type */
        (rc = store__buf_put_be32(b, (uint32_t)n)) < 0 ||
        (rc = store__buf_put_be32(b, 1)) < 0) /* lower bound */
        return rc;
    return 0;
}

int
store__arr_put(struct store__buf *b, const void *p, size_t len)
{
    int rc;
    if (len > INT32_MAX)
        return KS_ETOOBIG;
    if ((rc = store__buf_put_be32(b, (uint32_t)len)) < 0)
        return rc;
    return store__buf_put(b, p, len);
}

int
store__arr_put_null(struct store__buf *b)
{
    return store__buf_put_be32(b, UINT32_MAX); /* length -1 */
}

int
store__arr_put_i32(struct store__buf *b, int32_t v)
{
    int rc = store__buf_put_be32(b, 4);
    return rc ? rc : store__buf_put_be32(b, (uint32_t)v);
}

int
store__arr_put_i64(struct store__buf *b, int64_t v)
{
    int rc = store__buf_put_be32(b, 8);
    if (rc == 0)
        rc = store__buf_put_be32(b, (uint32_t)((uint64_t)v >> 32));
    return rc ? rc : store__buf_put_be32(b, (uint32_t)v);
}

int
store__arr_put_uuid(struct store__buf *b, const char *text)
{
    uuid_t u;
    if (!text || uuid_parse(text, u) != 0)
        return KS_EINVAL;
    return store__arr_put(b, u, sizeof(u));
}

/* ---- parameters ---- */

void
store__p_text(struct store__params *p, const char *s)
{
    BUG_ON(p->n >= STORE__MAX_PARAMS);
    p->val[p->n] = s;
    p->len[p->n] = 0;
    p->fmt[p->n] = 0;
    p->n++;
}

void
store__p_text_or_null(struct store__params *p, const char *s)
{
    store__p_text(p, s && *s ? s : NULL);
}

void
store__p_null(struct store__params *p)
{
    store__p_text(p, NULL);
}

void
store__p_i64(struct store__params *p, int64_t v)
{
    BUG_ON(p->n >= STORE__MAX_PARAMS);
    snprintf(p->num[p->n], sizeof(p->num[p->n]), "%lld", (long long)v);
    store__p_text(p, p->num[p->n]);
}

void
store__p_bool(struct store__params *p, bool v)
{
    store__p_text(p, v ? "t" : "f");
}

void
store__p_bin(struct store__params *p, const void *data, size_t len)
{
    BUG_ON(p->n >= STORE__MAX_PARAMS);
    BUG_ON(len > INT32_MAX);
    /* libpq sends a NULL pointer as SQL NULL; an empty value needs "". */
    p->val[p->n] = data ? (const char *)data : "";
    p->len[p->n] = (int)len;
    p->fmt[p->n] = 1;
    p->n++;
}

int64_t
store__rd_i64(const char *p)
{
    const uint8_t *u = (const uint8_t *)p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | u[i];
    return (int64_t)v;
}

int32_t
store__rd_i32(const char *p)
{
    const uint8_t *u = (const uint8_t *)p;
    return (int32_t)((uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 |
                     (uint32_t)u[2] << 8 | u[3]);
}

/* ---- errors ---- */

static void
set_errmsg(char **errmsg, const char *msg)
{
    if (!errmsg)
        return;
    free(*errmsg);
    *errmsg = msg ? strdup(msg) : NULL;
}

/* Keeps msg as store_last_error(): one line, whitespace runs (libpq's
 * continuation lines) made one space. */
static void
keep_error(struct store *s, const char *msg)
{
    size_t j = 0;
    bool gap = false;

    for (const char *p = msg ? msg : ""; *p; p++) {
        if (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') {
            gap = j > 0;
            continue;
        }
        if (j + 2 >= sizeof(s->err))
            break;
        if (gap)
            s->err[j++] = ' ';
        gap = false;
        s->err[j++] = *p;
    }
    s->err[j] = '\0';
}

/*
 * SQLSTATEs that mean the connection is gone or going: class 08
 * (connection exception) and the server shutting down or not yet up
 * (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now).
 */
static bool
lost_state(const char *state)
{
    return state && (strncmp(state, "08", 2) == 0 ||
                     strcmp(state, "57P01") == 0 ||
                     strcmp(state, "57P02") == 0 ||
                     strcmp(state, "57P03") == 0);
}

/*
 * SQLSTATEs that mean the database refuses writes for a while, whatever
 * was written: it is sick, not the statement (store.h "Sick database").
 * PostgreSQL 15 docs, Appendix A "PostgreSQL Error Codes": class 53
 * insufficient resources (53100 disk_full, 53200 out_of_memory, 53300
 * too_many_connections, 53400 configuration_limit_exceeded), 25006
 * read_only_sql_transaction, 40001 serialization_failure, 40P01
 * deadlock_detected, 55P03 lock_not_available, 57014 query_canceled
 * (statement_timeout too) and class 58 system error (58000, 58030
 * io_error). Class 08 and 57P01-57P03 are a lost connection (lost_state),
 * tested first.
 */
static bool
refused_state(const char *state)
{
    static const char *const exact[] = {"25006", "40001", "40P01", "55P03",
                                        "57014"};
    if (!state)
        return false;
    if (strncmp(state, "53", 2) == 0 || strncmp(state, "58", 2) == 0)
        return true;
    for (size_t i = 0; i < sizeof(exact) / sizeof(exact[0]); i++)
        if (strcmp(state, exact[i]) == 0)
            return true;
    return false;
}

int
store__pg_error(struct store *s, const PGresult *res, char **errmsg)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *primary =
        res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;
    const char *msg = res ? PQresultErrorMessage(res) : NULL;
    int rc = KS_EPG;

    if (!msg || !*msg)
        msg = PQerrorMessage(s->conn);
    set_errmsg(errmsg, msg);
    snprintf(s->sqlstate, sizeof(s->sqlstate), "%s", state ? state : "");
    if (s->broken || lost_state(state) ||
        PQstatus(s->conn) == CONNECTION_BAD) {
        /* The first message says why (the server's FATAL, say); what
         * follows ("server closed the connection") says less. */
        if (!s->broken)
            keep_error(s, primary && *primary ? primary : msg);
        s->broken = true;
        return KS_EPGDOWN;
    }
    keep_error(s, primary && *primary ? primary : msg);
    if (refused_state(state))
        rc = KS_EPGREFUSED;
    else if (state && strcmp(state, STORE__SQLSTATE_CONFLICT) == 0)
        rc = KS_ECONFLICT;
    else if (state && strcmp(state, STORE__SQLSTATE_NOT_YOURS) == 0)
        rc = KS_EDENIED;
    else if (state && strcmp(state, STORE__SQLSTATE_NOT_RECORDED) == 0)
        rc = KS_ENOTFOUND;
    else if (state && (strcmp(state, STORE__SQLSTATE_RECORDED) == 0 ||
                       strcmp(state, STORE__SQLSTATE_FRESH) == 0))
        rc = KS_EDUPLICATE;
    else if (state && strcmp(state, "23505") == 0) {
        const char *c = PQresultErrorField(res, PG_DIAG_CONSTRAINT_NAME);
        rc = c && strcmp(c, "events_event_id_key") == 0 ? KS_EDUPLICATE
                                                        : KS_ECONFLICT;
    }
    return rc;
}

int
store__read_error(struct store *s, const PGresult *res)
{
    return store__keep_sick(store__pg_error(s, res, NULL));
}

int
store__keep_sick(int rc)
{
    return rc == KS_EPGDOWN || rc == KS_EPGREFUSED ? rc : KS_EPG;
}

const char *
store_last_error(struct store *s)
{
    return s ? s->err : "";
}

const char *
store_last_sqlstate(struct store *s)
{
    return s ? s->sqlstate : "";
}

const char *
store_sqlstate_name(const char *sqlstate)
{
    /* PostgreSQL 15 docs, Appendix A, the codes refused_state() takes. */
    static const struct {
        const char *code, *name;
    } names[] = {
        {"53000", "insufficient_resources"},
        {"53100", "disk_full"},
        {"53200", "out_of_memory"},
        {"53300", "too_many_connections"},
        {"53400", "configuration_limit_exceeded"},
        {"25006", "read_only_sql_transaction"},
        {"40001", "serialization_failure"},
        {"40P01", "deadlock_detected"},
        {"55P03", "lock_not_available"},
        {"57014", "query_canceled"},
        {"58000", "system_error"},
        {"58030", "io_error"},
    };
    for (size_t i = 0; sqlstate && i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(sqlstate, names[i].code) == 0)
            return names[i].name;
    return "";
}

bool
store_in_doubt(struct store *s)
{
    return s && s->in_doubt;
}

bool
store_db_sick(int rc)
{
    return rc == KS_EPGDOWN || rc == KS_EPGREFUSED || rc == KS_EUNAVAIL;
}

int
store__exec(struct store *s, const char *sql, char **errmsg)
{
    PGresult *res = PQexec(s->conn, sql);
    int rc = 0;
    ExecStatusType st = PQresultStatus(res);

    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
        rc = store__pg_error(s, res, errmsg);
    /* A COMMIT whose answer was lost may have committed. */
    if (rc == KS_EPGDOWN && strcmp(sql, "COMMIT") == 0)
        s->in_doubt = true;
    PQclear(res);
    return rc;
}

/* ---- the connection ---- */

/*
 * libpq's notice receiver. A server going away while the connection is
 * idle sends its reason (FATAL 57P01 "terminating connection due to
 * administrator command") before closing; libpq hands an error that
 * arrives outside a query here, as a notice. Keep it as the reason rather
 * than print it; print the others as libpq's default receiver does.
 */
static void
on_notice(void *arg, const PGresult *res)
{
    struct store *s = arg;
    const char *sev = PQresultErrorField(res, PG_DIAG_SEVERITY_NONLOCALIZED);
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    const char *primary = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);

    if (lost_state(state) ||
        (sev && (strcmp(sev, "FATAL") == 0 || strcmp(sev, "PANIC") == 0))) {
        keep_error(s, primary ? primary : PQresultErrorMessage(res));
        s->broken = true;
        return;
    }
    /* A notice or warning PostgreSQL sends (not an error of ours). */
    ks_log(sev && strcmp(sev, "WARNING") == 0 ? KS_LOG_WARN : KS_LOG_INFO,
           primary ? primary : "PostgreSQL notice", KS_S("module", "store"),
           KS_S("pg_severity", sev ? sev : ""),
           KS_S("sqlstate", state ? state : ""));
}

/*
 * A group writer's connection (store__writer_session). lock_timeout: an
 * append that waits longer for a row lock (a claim held up by another
 * transaction on its command's stream, or a paused process's transaction)
 * fails with 55P03 lock_not_available, KS_EPGREFUSED, and its caller tries
 * again, instead of holding up every append of the broker queued behind
 * it on the writer's connection (store/writer.c splits a group that waited
 * so, and writes the others). Normal waits (a claim for the commit of its
 * command's record) take milliseconds.
 */
#define WRITER_SESSION                                                        \
    "SET plan_cache_mode = force_generic_plan;"                               \
    " SET lock_timeout = '2s';"                                               \
    " SET application_name = 'kscore writer'"

#define GENERIC_PLANS "SET plan_cache_mode = force_generic_plan"

/* SET lock_timeout to s->lock_timeout_ms (store_set_lock_timeout). */
static int
set_lock_timeout(struct store *s, char **errmsg)
{
    char sql[64];
    snprintf(sql, sizeof(sql), "SET lock_timeout = %d", s->lock_timeout_ms);
    return store__exec(s, sql, errmsg);
}

/* The session every connection gets, after each (re)connection. */
static int
session_setup(struct store *s, char **errmsg)
{
    /* Projections hold timestamps; the session time zone only shows. */
    int rc = store__exec(s,
                         "SET TIME ZONE 'UTC';"
                         " SET client_min_messages = warning",
                         errmsg);
    if (rc == 0 && s->writer_session)
        rc = store__exec(s, WRITER_SESSION, errmsg);
    else if (rc == 0 && s->generic_plans)
        rc = store__exec(s, GENERIC_PLANS, errmsg);
    if (rc == 0 && s->lock_timeout_ms > 0)
        rc = set_lock_timeout(s, errmsg);
    return rc;
}

int
store_set_lock_timeout(struct store *s, int ms)
{
    if (!s || ms < 0 || ms > 600000)
        return KS_EINVAL;
    s->lock_timeout_ms = ms;
    return set_lock_timeout(s, NULL);
}

int
store__generic_plans(struct store *s)
{
    s->generic_plans = true;
    return store__exec(s, GENERIC_PLANS, NULL);
}

int
store__writer_session(struct store *s)
{
    s->writer_session = true;
    return store__exec(s, WRITER_SESSION, NULL);
}

/* A new session on s->conn, or KS_EPGDOWN and the next attempt's time. */
static int
reconnect(struct store *s)
{
    if (ks_mono_us() < s->retry_at_us)
        return KS_EPGDOWN; /* backing off: fail at once, no connect */
    /* PQreset keeps the PGconn (and its options and notice receiver). */
    PQreset(s->conn);
    if (PQstatus(s->conn) == CONNECTION_OK) {
        s->broken = false;
        if (session_setup(s, NULL) == 0) {
            s->prepared = false;
            s->notify_pending = s->listening;
            s->backoff_us = 0;
            s->retry_at_us = 0;
            return 0;
        }
    } else {
        keep_error(s, PQerrorMessage(s->conn));
    }
    s->broken = true;
    s->backoff_us = s->backoff_us ? s->backoff_us * 2 : STORE__BACKOFF_MIN_US;
    if (s->backoff_us > STORE__BACKOFF_MAX_US)
        s->backoff_us = STORE__BACKOFF_MAX_US;
    s->retry_at_us = ks_mono_us() + s->backoff_us;
    return KS_EPGDOWN;
}

int
store__ready(struct store *s)
{
    /* The server went away while we were idle (it said so, then closed):
     * find out now, not from the statement about to be sent. A
     * non-blocking read, then PQisBusy to parse it (PQconsumeInput only
     * reads): its FATAL reaches on_notice. Notifications stay queued. */
    s->in_doubt = false; /* a new call: says nothing of the last one's */
    if (!s->broken && PQstatus(s->conn) == CONNECTION_OK &&
        PQconsumeInput(s->conn))
        (void)PQisBusy(s->conn);
    if (!s->broken && PQstatus(s->conn) != CONNECTION_OK) {
        keep_error(s, PQerrorMessage(s->conn));
        s->broken = true;
    }
    /* What an earlier call left behind: a pipeline with results unread
     * (start afresh) or a failed transaction (roll it back). */
    if (!s->broken && PQpipelineStatus(s->conn) != PQ_PIPELINE_OFF &&
        !PQexitPipelineMode(s->conn))
        s->broken = true;
    if (!s->broken) {
        switch (PQtransactionStatus(s->conn)) {
        case PQTRANS_INERROR:
            if (store__exec(s, "ROLLBACK", NULL) < 0)
                s->broken = true;
            break;
        case PQTRANS_ACTIVE:
        case PQTRANS_UNKNOWN:
            s->broken = true;
            break;
        default:
            break;
        }
    }
    int rc = s->broken ? reconnect(s) : 0;
    /* Down or back: the gauge moves on the change only. */
    if (s->broken != s->metric_down) {
        s->metric_down = s->broken;
        ks_metric_gauge_add(KS_G_PG_BROKEN, s->broken ? 1 : -1);
    }
    return rc;
}

/* ---- connection and migrations ---- */

int
store_open(const char *conninfo, struct store **out, char **errmsg)
{
    /* connect_timeout first, so the caller's own (in conninfo) wins: a
     * reconnection never blocks a thread for long on a dead host. */
    const char *const keys[] = {"connect_timeout", "dbname", NULL};
    const char *const vals[] = {"5", conninfo, NULL};
    struct store *s = calloc(1, sizeof(*s));
    int rc;

    if (!s)
        return -ENOMEM;
    s->conn = PQconnectdbParams(keys, vals, 1);
    if (!s->conn || PQstatus(s->conn) != CONNECTION_OK) {
        set_errmsg(errmsg, s->conn ? PQerrorMessage(s->conn)
                                   : "out of memory");
        rc = KS_EUNAVAIL;
        goto fail;
    }
    PQsetNoticeReceiver(s->conn, on_notice, s);
    rc = session_setup(s, errmsg);
    if (rc < 0)
        goto fail;
    s->ids.cap = s->streams.cap = s->types.cap = SIZE_MAX / 2;
    /* The bytea[] of one append_many call is one protocol message. */
    s->data.cap = 256u * 1024 * 1024;
    s->argv.cap = KS_MAX_MESSAGE_BYTES;
    s->result.cap = KS_MAX_MESSAGE_BYTES;
    /* Like data: one array of a batch (outputs, argv) is one message. */
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        s->fold[i].cap = 256u * 1024 * 1024;
    s->counted = true;
    ks_metric_gauge_add(KS_G_PG_CONNECTIONS, 1);
    *out = s;
    return 0;
fail:
    store_close(s);
    return rc;
}

void
store_close(struct store *s)
{
    if (!s)
        return;
    if (s->counted) {
        ks_metric_gauge_add(KS_G_PG_CONNECTIONS, -1);
        if (s->metric_down)
            ks_metric_gauge_add(KS_G_PG_BROKEN, -1);
    }
    PQfinish(s->conn);
    store__buf_release(&s->ids);
    store__buf_release(&s->streams);
    store__buf_release(&s->types);
    store__buf_release(&s->data);
    store__buf_release(&s->argv);
    store__buf_release(&s->result);
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        store__buf_release(&s->fold[i]);
    kproto_arena_fini(&s->scratch);
    store__direct_free(s->direct);
    free(s);
}

void *
store_pgconn(struct store *s)
{
    return s->conn;
}

int
store_migrate(struct store *s, char **errmsg)
{
    char sql[256];
    PGresult *res = NULL;
    int rc;

    if ((rc = store__ready(s)) < 0) {
        set_errmsg(errmsg, s->err);
        return rc;
    }
    rc = store__exec(s,
                     "BEGIN;"
                     /* "kscore" in ASCII: one lock id for every broker. */
                     "SELECT pg_advisory_xact_lock(107115099111114101);"
                     "CREATE TABLE IF NOT EXISTS schema_migrations ("
                     "  version int PRIMARY KEY,"
                     "  name text NOT NULL,"
                     "  applied_at timestamptz NOT NULL DEFAULT now())",
                     errmsg);
    if (rc < 0)
        goto out;
    for (size_t i = 0; i < store__n_migrations; i++) {
        const struct store__migration *m = &store__migrations[i];
        snprintf(sql, sizeof(sql),
                 "SELECT 1 FROM schema_migrations WHERE version = %d",
                 m->version);
        res = PQexec(s->conn, sql);
        if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            rc = store__pg_error(s, res, errmsg);
            goto out;
        }
        if (PQntuples(res) == 0) {
            const char *params[2];
            char v[16];
            if ((rc = store__exec(s, m->sql, errmsg)) < 0)
                goto out;
            snprintf(v, sizeof(v), "%d", m->version);
            params[0] = v;
            params[1] = m->name;
            PQclear(res);
            res = PQexecParams(s->conn,
                               "INSERT INTO schema_migrations (version, name)"
                               " VALUES ($1, $2)",
                               2, NULL, params, NULL, NULL, 0);
            if (PQresultStatus(res) != PGRES_COMMAND_OK) {
                rc = store__pg_error(s, res, errmsg);
                goto out;
            }
        }
        PQclear(res);
        res = NULL;
    }
    rc = store__exec(s, "COMMIT", errmsg);
    if (rc == 0)
        s->prepared = false; /* the functions may be new */
out:
    PQclear(res);
    if (rc < 0 && PQtransactionStatus(s->conn) != PQTRANS_IDLE)
        PQclear(PQexec(s->conn, "ROLLBACK"));
    return rc == KS_EPGDOWN ? rc : rc < 0 ? KS_EPG : 0;
}

static const struct {
    const char *name;
    const char *sql;
} statements[] = {
    {"ks_append", "SELECT kscore_append($1, $2, $3, $4, $5)" STORE__LOCKED},
    {"ks_append_many",
     "SELECT kscore_append_many($1, $2, $3, $4)" STORE__LOCKED},
    {"ks_claim",
     "SELECT kscore_claim($1, $2, $3, $4, $5, $6)" STORE__LOCKED},
    {"ks_record_many",
     "SELECT kscore_record_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,"
     " $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24,"
     " $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37, $38,"
     " $39, $40)" STORE__LOCKED},
    {"ks_record_checked",
     "SELECT kscore_record_checked($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,"
     " $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24,"
     " $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37, $38,"
     " $39, $40, $41, $42, $43, $44, $45, $46)" STORE__LOCKED},
    {"ks_write_wait", store__sql_write_wait},
    {"ks_write", store__sql_write},
    /* The group writer's first statement (store/writer.c): a CALL
     * answers no rows, which the writer does not take for a wave. */
    {"ks_lock", "CALL kscore_events_locked()"},
    {"ks_project",
     "SELECT kscore_project($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11,"
     " $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24,"
     " $25, $26, $27, $28)"},
};

int
store__prepare(struct store *s, char **errmsg)
{
    if (s->prepared)
        return 0;
    /* After a reset the old names may or may not exist. */
    PQclear(PQexec(s->conn, "DEALLOCATE ALL"));
    for (size_t i = 0; i < sizeof(statements) / sizeof(statements[0]); i++) {
        PGresult *res =
            PQprepare(s->conn, statements[i].name, statements[i].sql, 0, NULL);
        if (PQresultStatus(res) != PGRES_COMMAND_OK) {
            int rc = store__pg_error(s, res, errmsg);
            PQclear(res);
            return store__keep_sick(rc);
        }
        PQclear(res);
    }
    s->prepared = true;
    return 0;
}

/* ---- reads ---- */

int
store_stream_version(struct store *s, const char *stream_id,
                     int64_t *version_out)
{
    const char *params[1] = {stream_id};
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    res = PQexecParams(s->conn,
                       "SELECT version FROM streams WHERE stream_id = $1", 1,
                       NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        goto out;
    }
    *version_out = PQntuples(res) ? strtoll(PQgetvalue(res, 0, 0), NULL, 10)
                                  : 0;
out:
    PQclear(res);
    return rc;
}

/* Calls cb for each row (global_pos, version, recorded_us, data[, tx]). */
static int
deliver_events(PGresult *res, struct store_cursor *cursor, store_event_fn cb,
               void *ud)
{
    int rows = PQntuples(res);

    for (int i = 0; i < rows; i++) {
        Ks__RecordedEvent rec = KS__RECORDED_EVENT__INIT;
        int len = PQgetlength(res, i, 3);
        int rc;

        if (len > KS_MAX_MESSAGE_BYTES)
            return KS_ETOOBIG;
        rec.global_pos = store__rd_i64(PQgetvalue(res, i, 0));
        rec.version = store__rd_i64(PQgetvalue(res, i, 1));
        rec.recorded_at_us = store__rd_i64(PQgetvalue(res, i, 2));
        rec.event = ks__event__unpack(
            NULL, (size_t)len, (const uint8_t *)PQgetvalue(res, i, 3));
        if (!rec.event)
            return KS_EDECODE;
        if (cursor) {
            cursor->tx_id = strtoull(PQgetvalue(res, i, 4), NULL, 10);
            cursor->global_pos = rec.global_pos;
            rec.tx_id = cursor->tx_id; /* a reader resumes after it */
        }
        rc = cb(&rec, ud);
        ks__event__free_unpacked(rec.event, NULL);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Runs one events query (binary results) and hands its rows to cb. */
static int
query_events(struct store *s, const char *sql,
             const struct store__params *p, struct store_cursor *cursor,
             store_event_fn cb, void *ud)
{
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    res = PQexecParams(s->conn, sql, p->n, NULL, p->val, p->len, p->fmt, 1);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    rc = deliver_events(res, cursor, cb, ud);
    PQclear(res);
    return rc;
}

int
store_read_stream(struct store *s, const char *stream_id,
                  int64_t after_version, uint32_t limit, store_event_fn cb,
                  void *ud)
{
    struct store__params p = {0};

    store__p_text(&p, stream_id);
    store__p_i64(&p, after_version);
    if (limit)
        store__p_i64(&p, limit);
    else
        store__p_null(&p);
    return query_events(s,
                        "SELECT global_pos, version, kscore_us(recorded_at),"
                        " data FROM events"
                        " WHERE stream_id = $1 AND version > $2"
                        " ORDER BY version LIMIT $3",
                        &p, NULL, cb, ud);
}

/*
 * The reading rule's bound (store.h "Readers"): the lowest id of a
 * transaction that may still add events below it. Everything below the
 * bound is final: no event with a lower tx_id can commit later.
 *
 * Only appenders can: a transaction that holds a lock on events other than
 * ACCESS SHARE, which every appender takes before it has an id (migration
 * 11). So the bound is the lowest open id of such a transaction, from this
 * statement's snapshot, or the snapshot's xmax (the next id) when none is
 * open; open transactions of other databases, or of this one that append
 * nothing, are passed by. Why it holds: an appender X with id x below the
 * xmax had x before this snapshot; if it is still open when the read
 * (the next statement, a later snapshot) runs, it was open all along, and
 * held its lock on events since before x: pg_locks, read after the
 * snapshot, shows the lock, and its own ExclusiveLock on x (each
 * transaction's on its id, PostgreSQL docs 28.1 and pg_locks). An
 * appender that has the lock but whose id pg_locks does not show yet (the
 * moment between the two, in AssignTransactionId) makes the bound the
 * snapshot's xmin, the cluster-wide rule, for this read. Subtransaction
 * ids show too: they come after their top-level id, which the events
 * carry (pg_current_xact_id), so the lowest is the one. Prepared
 * transactions keep their locks and ids under one virtualtransaction as
 * well. Read as text: xid8 has no binary form libpq would hand over.
 */
static const char read_bound_sql[] =
    "WITH s AS (SELECT pg_current_snapshot() AS snap),\n"
    "w AS (\n"
    "  SELECT t.transactionid FROM pg_locks l\n"
    "  LEFT JOIN pg_locks t ON t.locktype = 'transactionid'\n"
    "    AND t.mode = 'ExclusiveLock' AND t.granted\n"
    "    AND t.virtualtransaction = l.virtualtransaction\n"
    "  WHERE l.locktype = 'relation' AND l.granted\n"
    "    AND l.database = (SELECT oid FROM pg_database\n"
    "                      WHERE datname = current_database())\n"
    "    AND l.relation = 'events'::regclass\n"
    "    AND l.mode <> 'AccessShareLock')\n"
    "SELECT (CASE WHEN EXISTS (SELECT 1 FROM w WHERE w.transactionid IS NULL)\n"
    "  THEN pg_snapshot_xmin(s.snap)\n"
    "  ELSE coalesce((SELECT min(x) FROM pg_snapshot_xip(s.snap) AS x\n"
    "                 WHERE x::xid IN (SELECT w.transactionid FROM w)),\n"
    "                pg_snapshot_xmax(s.snap)) END)::text\n"
    "FROM s";

int
store_read_relabels(struct store *s, const char *stream_id, store_event_fn cb,
                    void *ud)
{
    struct store__params p = {0};

    store__p_text(&p, stream_id ? stream_id : "");
    /* The partial index events_relabels (migration 13) holds only these. */
    return query_events(s,
                        "SELECT DISTINCT ON (stream_id) global_pos, version,"
                        " kscore_us(recorded_at), data FROM events"
                        " WHERE type = 'AgentLabelsChanged'"
                        "   AND ($1 = '' OR stream_id = $1)"
                        " ORDER BY stream_id, version DESC",
                        &p, NULL, cb, ud);
}

int
store_read_all(struct store *s, struct store_cursor *cursor, uint32_t limit,
               store_event_fn cb, void *ud)
{
    struct store__params p = {0};
    char bound[24];
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    /* Its own statement, before the read: the read's snapshot must be
     * taken after the locks were looked at. */
    res = PQexecParams(s->conn, read_bound_sql, 0, NULL, NULL, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    snprintf(bound, sizeof(bound), "%s", PQgetvalue(res, 0, 0));
    PQclear(res);

    store__p_i64(&p, (int64_t)cursor->tx_id);
    store__p_i64(&p, cursor->global_pos);
    if (limit)
        store__p_i64(&p, limit);
    else
        store__p_null(&p);
    store__p_text(&p, bound);
    /*
     * Order and compare as xid8 (a number), never as text: in ORDER BY a
     * bare name means an output column first (PostgreSQL docs 7.5), so
     * "tx_id::text" (whose output name is tx_id) once sorted "1000" before
     * "999", and a cursor compared as a number then skipped or repeated
     * events. The text copy for the cursor is named tx_text, and the sort
     * keys are qualified. The row comparison walks events_tx_pos.
     */
    return query_events(
        s,
        "SELECT e.global_pos, e.version, kscore_us(e.recorded_at), e.data,"
        " e.tx_id::text AS tx_text FROM events e"
        " WHERE e.tx_id < $4::text::xid8"
        "   AND (e.tx_id, e.global_pos) > ($1::text::xid8, $2::bigint)"
        " ORDER BY e.tx_id, e.global_pos LIMIT $3",
        &p, cursor, cb, ud);
}

int
store_cursor_at(struct store *s, int64_t since_us, struct store_cursor *out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    store__p_i64(&p, since_us);
    /*
     * xid8 has no arithmetic: through bigint (an xid8 is epoch << 32 |
     * xid, far below 2^63). Without since_us, xmin - 1 with the largest
     * position: every event of xmin or later is after it. With since_us,
     * the backward walk of events_tx_pos below xmin stops at the first
     * row recorded before it (ORDER BY ... DESC LIMIT 1 on the index's
     * columns; the qualified names, as in store_read_all).
     */
    res = PQexecParams(
        s->conn,
        "WITH x AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)"
        " SELECT (x.xmin::text::bigint - 1)::text, NULL::bigint FROM x"
        "  WHERE $1::bigint = 0"
        " UNION ALL"
        " (SELECT e.tx_id::text, e.global_pos FROM events e, x"
        "   WHERE $1::bigint <> 0 AND e.tx_id < x.xmin"
        "     AND e.recorded_at < kscore_ts($1::bigint)"
        "   ORDER BY e.tx_id DESC, e.global_pos DESC LIMIT 1)",
        p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    memset(out, 0, sizeof(*out));
    if (PQntuples(res) == 1) {
        out->tx_id = strtoull(PQgetvalue(res, 0, 0), NULL, 10);
        out->global_pos = PQgetisnull(res, 0, 1)
                              ? INT64_MAX
                              : strtoll(PQgetvalue(res, 0, 1), NULL, 10);
    }
    PQclear(res);
    return 0;
}

/* Appends committed by this process (store__wake): what store_wait_notify
 * waits for. A generation number, so a waiter misses no wake-up between
 * two calls. */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond;
static pthread_once_t wake_once = PTHREAD_ONCE_INIT;
static uint64_t wake_gen;

static void
wake_init(void)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&wake_cond, &a);
    pthread_condattr_destroy(&a);
}

void
store__wake(void)
{
    pthread_once(&wake_once, wake_init);
    pthread_mutex_lock(&wake_mu);
    wake_gen++;
    pthread_cond_broadcast(&wake_cond);
    pthread_mutex_unlock(&wake_mu);
}

int
store_wait_notify(struct store *s, int timeout_ms)
{
    struct timespec until;
    int rc, woke = 0;

    if ((rc = store__ready(s)) < 0)
        return rc;
    pthread_once(&wake_once, wake_init);
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&wake_mu);
    if (!s->listening) {
        /* From the first call on: what commits after it. */
        s->listening = true;
        s->seen_gen = wake_gen;
    }
    if (s->notify_pending) {
        /* Reconnected: whatever happened meanwhile, re-read. */
        s->notify_pending = false;
        woke = 1;
    }
    while (!woke && wake_gen == s->seen_gen) {
        int r = pthread_cond_timedwait(&wake_cond, &wake_mu, &until);
        if (r == ETIMEDOUT)
            break;
    }
    if (wake_gen != s->seen_gen) {
        s->seen_gen = wake_gen;
        woke = 1;
    }
    pthread_mutex_unlock(&wake_mu);
    return woke ? 0 : KS_ETIMEDOUT;
}

/* ---- commands ---- */

static char *
dup_col(const PGresult *res, int col)
{
    int len = PQgetlength(res, 0, col);
    char *p = malloc((size_t)len + 1);
    if (!p)
        return NULL;
    memcpy(p, PQgetvalue(res, 0, col), (size_t)len);
    p[len] = '\0';
    return p;
}

/* text[] in binary format (array_send) into view->argv. */
static int
decode_argv(const char *p, int len, Ks__CommandView *v)
{
    const char *end = p + len;
    int32_t ndim, n;

    if (len < 12)
        return KS_EDECODE;
    ndim = store__rd_i32(p);
    if (ndim == 0)
        return 0;
    if (ndim != 1 || len < 20)
        return KS_EDECODE;
    n = store__rd_i32(p + 12);
    p += 20;
    if (n < 0 || n > len / 4)
        return KS_EDECODE;
    v->argv = calloc((size_t)n ? (size_t)n : 1, sizeof(char *));
    if (!v->argv)
        return -ENOMEM;
    for (int32_t i = 0; i < n; i++) {
        int32_t el;
        if (end - p < 4)
            return KS_EDECODE;
        el = store__rd_i32(p);
        p += 4;
        if (el < 0 || end - p < el)
            return KS_EDECODE;
        v->argv[i] = malloc((size_t)el + 1);
        if (!v->argv[i])
            return -ENOMEM;
        memcpy(v->argv[i], p, (size_t)el);
        v->argv[i][el] = '\0';
        v->n_argv = (size_t)i + 1;
        p += el;
    }
    return 0;
}

/* Puts a bytea column back into the Output the packed result left empty. */
static int
fill_output(const PGresult *res, int col, Ks__Output **o)
{
    int len;

    if (PQgetisnull(res, 0, col))
        return 0;
    len = PQgetlength(res, 0, col);
    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if (!*o) {
        *o = malloc(sizeof(**o));
        if (!*o)
            return -ENOMEM;
        ks__output__init(*o);
    }
    if (len == 0)
        return 0;
    (*o)->data.data = malloc((size_t)len);
    if (!(*o)->data.data)
        return -ENOMEM;
    memcpy((*o)->data.data, PQgetvalue(res, 0, col), (size_t)len);
    (*o)->data.len = (size_t)len;
    return 0;
}

static Ks__CommandStatus
status_from_name(const char *name)
{
    for (int st = 0; st <= KS__COMMAND_STATUS__NOT_STARTED; st++)
        if (strcmp(kproto_status_name((Ks__CommandStatus)st), name) == 0)
            return (Ks__CommandStatus)st;
    return KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
}

int
store_get_command(struct store *s, const char *command_id,
                  Ks__CommandView **out)
{
    const char *params[1] = {command_id};
    Ks__CommandView *v = NULL;
    PGresult *res;
    char *status = NULL;
    int rc = 0;

    if (!ks_is_uuid(command_id))
        return KS_ENOTFOUND;
    if ((rc = store__ready(s)) < 0)
        return rc;
    res = PQexecParams(
        s->conn,
        "SELECT command_id::text, agent_id, status, argv, attempt,"
        " coalesce(kscore_us(requested_at), 0), result, stdout, stderr,"
        " coalesce(batch_id, ''), version, operator"
        " FROM commands WHERE command_id = $1",
        1, NULL, params, NULL, NULL, 1);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        goto out;
    }
    if (PQntuples(res) == 0) {
        rc = KS_ENOTFOUND;
        goto out;
    }
    v = malloc(sizeof(*v));
    if (!v) {
        rc = -ENOMEM;
        goto out;
    }
    ks__command_view__init(v);
    if (!(v->command_id = dup_col(res, 0)) ||
        !(v->agent_id = dup_col(res, 1)) || !(status = dup_col(res, 2)) ||
        !(v->batch_id = dup_col(res, 9)) ||
        !(v->operator_ = dup_col(res, 11))) {
        rc = -ENOMEM;
        goto out;
    }
    v->status = status_from_name(status);
    if ((rc = decode_argv(PQgetvalue(res, 0, 3), PQgetlength(res, 0, 3), v)) <
        0)
        goto out;
    v->attempt = (uint32_t)store__rd_i32(PQgetvalue(res, 0, 4));
    v->requested_at_us = store__rd_i64(PQgetvalue(res, 0, 5));
    v->version = store__rd_i64(PQgetvalue(res, 0, 10));
    if (!PQgetisnull(res, 0, 6)) {
        int len = PQgetlength(res, 0, 6);
        if (len > KS_MAX_MESSAGE_BYTES) {
            rc = KS_ETOOBIG;
            goto out;
        }
        v->result = ks__command_result__unpack(
            NULL, (size_t)len, (const uint8_t *)PQgetvalue(res, 0, 6));
        if (!v->result) {
            rc = KS_EDECODE;
            goto out;
        }
        if ((rc = fill_output(res, 7, &v->result->stdout)) < 0 ||
            (rc = fill_output(res, 8, &v->result->stderr)) < 0)
            goto out;
    }
    *out = v;
    v = NULL;
out:
    if (v)
        ks__command_view__free_unpacked(v, NULL);
    free(status);
    PQclear(res);
    return rc;
}

int
store_command_by_key(struct store *s, const char *operator_,
                     const char *idempotency_key, char id_out[37])
{
    const char *params[2] = {operator_ ? operator_ : "", idempotency_key};
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    res = PQexecParams(
        s->conn,
        "SELECT command_id::text FROM commands"
        " WHERE operator = $1 AND idempotency_key = $2",
        2, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
    } else if (PQntuples(res) == 0) {
        rc = KS_ENOTFOUND;
    } else {
        snprintf(id_out, 37, "%s", PQgetvalue(res, 0, 0));
    }
    PQclear(res);
    return rc;
}

int
store_batch_operator(struct store *s, const char *batch_id, char *buf,
                     size_t len)
{
    const char *params[1] = {batch_id};
    PGresult *res;
    int rc = store__ready(s);

    if (rc)
        return rc;
    res = PQexecParams(s->conn,
                       "SELECT operator FROM batches WHERE batch_id = $1", 1,
                       NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        rc = store__read_error(s, res);
    else if (PQntuples(res) == 0)
        rc = KS_ENOTFOUND;
    else
        snprintf(buf, len, "%s", PQgetvalue(res, 0, 0));
    PQclear(res);
    return rc;
}

/* ---- agents ---- */

int
store_upsert_agent(struct store *s, const Ks__AgentInfo *info)
{
    struct store__buf keys = {.cap = KS_MAX_MESSAGE_BYTES},
                      vals = {.cap = KS_MAX_MESSAGE_BYTES};
    struct store__params p = {0};
    PGresult *res = NULL;
    int rc;

    if (!info || !info->agent_id || !*info->agent_id)
        return KS_EINVAL;
    if ((rc = store__arr_begin(&keys, STORE__OID_TEXT, info->n_labels)) < 0 ||
        (rc = store__arr_begin(&vals, STORE__OID_TEXT, info->n_labels)) < 0)
        goto out;
    for (size_t i = 0; i < info->n_labels; i++) {
        const Ks__EnvVar *l = info->labels[i];
        const char *k = l && l->name ? l->name : "";
        const char *val = l && l->value ? l->value : "";
        if ((rc = store__arr_put(&keys, k, strlen(k))) < 0 ||
            (rc = store__arr_put(&vals, val, strlen(val))) < 0)
            goto out;
    }
    store__p_text(&p, info->agent_id);
    store__p_bin(&p, keys.p, keys.len);
    store__p_bin(&p, vals.p, vals.len);
    store__p_text(&p, info->version ? info->version : "");
    store__p_text(&p, info->host ? info->host : "");
    store__p_i64(&p, info->heartbeat_at_us);
    store__p_i64(&p, info->running);
    store__p_i64(&p, info->max_concurrent);
    store__p_i64(&p, info->pid);
    if ((rc = store__ready(s)) < 0)
        goto out;
    res = PQexecParams(
        s->conn,
        "INSERT INTO agents AS a (agent_id, labels, version, host, online,"
        "  last_seen, running, max_concurrent, pid)"
        " VALUES ($1, jsonb_object($2::text[], $3::text[]), $4, $5, true,"
        "  kscore_ts($6), $7, $8, $9)"
        " ON CONFLICT (agent_id) DO UPDATE SET labels = excluded.labels,"
        "  version = excluded.version, host = excluded.host, online = true,"
        "  last_seen = excluded.last_seen, running = excluded.running,"
        "  max_concurrent = excluded.max_concurrent, pid = excluded.pid",
        p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        rc = store__read_error(s, res);
out:
    PQclear(res);
    store__buf_release(&keys);
    store__buf_release(&vals);
    return rc;
}
