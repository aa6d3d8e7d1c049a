/*
 * test_store: the store against a real PostgreSQL (a private cluster from
 * tests/fixture_pg.c, started once for the suite and stopped at the end).
 * Each test uses fresh stream and command ids, so tests do not depend on
 * each other's data.
 */
#include <check.h>
#include <dirent.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fixture.h"
#include "store.h"

static struct fixture_pg pg;

static struct store *
open_store(void)
{
    struct store *s = NULL;
    char *err = NULL;
    int rc = store_open(pg.conninfo, &s, &err);
    ck_assert_msg(rc == 0, "store_open: %s", err ? err : "");
    free(err);
    rc = store_migrate(s, &err);
    ck_assert_msg(rc == 0, "store_migrate: %s", err ? err : "");
    free(err);
    return s;
}

/* One event with a fresh id; strings are borrowed (literals, buffers). */
struct tev {
    Ks__Event ev;
    char id[37];
};

static Ks__Event *
mk(struct tev *t, const char *stream, const char *type)
{
    ks__event__init(&t->ev);
    ks_uuid(t->id);
    t->ev.event_id = t->id;
    t->ev.stream_id = (char *)stream;
    t->ev.type = (char *)type;
    t->ev.occurred_at_us = ks_now_us();
    return &t->ev;
}

static int
append1(struct store *s, Ks__Event *ev, int64_t expected, int64_t *v)
{
    struct store_event se = {ev};
    return store_append(s, ev->stream_id, expected, &se, 1, v);
}

/* First column of the first row as text, malloc'd ("" if no row). */
static char *
sql1(struct store *s, const char *sql)
{
    PGresult *res = PQexec(store_pgconn(s), sql);
    char *v;
    ck_assert_msg(PQresultStatus(res) == PGRES_TUPLES_OK, "%s: %s", sql,
                  PQresultErrorMessage(res));
    v = strdup(PQntuples(res) ? PQgetvalue(res, 0, 0) : "");
    PQclear(res);
    return v;
}

static long long
sql_ll(struct store *s, const char *fmt, const char *arg)
{
    char sql[1024];
    snprintf(sql, sizeof(sql), fmt, arg);
    char *v = sql1(s, sql);
    long long n = atoll(v);
    free(v);
    return n;
}

START_TEST(test_migrate_idempotent)
{
    struct store *s = open_store();
    char *err = NULL;
    ck_assert_int_eq(store_migrate(s, &err), 0);
    long long applied =
        sql_ll(s, "SELECT count(*) FROM schema_migrations%s", "");
    ck_assert_int_ge(applied, 2);
    ck_assert_int_eq(store_migrate(s, &err), 0);
    ck_assert_int_eq(
        sql_ll(s, "SELECT count(*) FROM schema_migrations%s", ""), applied);
    ck_assert_int_eq(
        sql_ll(s, "SELECT min(version) FROM schema_migrations%s", ""), 1);
    store_close(s);
    store_close(NULL);
}
END_TEST

START_TEST(test_append_nostream_then_exact)
{
    struct store *s = open_store();
    char stream[64], u[37];
    struct tev a, b;
    int64_t v = -1;

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "test-%s", u);
    ck_assert_int_eq(append1(s, mk(&a, stream, "Thing"), STORE_NO_STREAM, &v),
                     0);
    ck_assert_int_eq(v, 1);
    ck_assert_int_eq(append1(s, mk(&b, stream, "Thing"), 1, &v), 0);
    ck_assert_int_eq(v, 2);
    ck_assert_int_eq(store_stream_version(s, stream, &v), 0);
    ck_assert_int_eq(v, 2);
    ck_assert_int_eq(store_stream_version(s, "test-none", &v), 0);
    ck_assert_int_eq(v, 0);
    ck_assert_int_eq(sql_ll(s,
                            "SELECT (category = 'test')::int FROM streams"
                            " WHERE stream_id = '%s'",
                            stream),
                     1);
    store_close(s);
}
END_TEST

struct collect {
    int n;
    int64_t versions[64];
    char ids[64][37];
    int64_t pos[64];
};

static int
collect_cb(const Ks__RecordedEvent *ev, void *ud)
{
    struct collect *c = ud;
    if (c->n < 64) {
        c->versions[c->n] = ev->version;
        c->pos[c->n] = ev->global_pos;
        snprintf(c->ids[c->n], 37, "%s", ev->event->event_id);
    }
    c->n++;
    return 0;
}

START_TEST(test_conflict_writes_nothing)
{
    struct store *s = open_store();
    char stream[64], u[37];
    struct tev a, b, c;
    int64_t v = 42;
    struct collect col = {0};

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "test-%s", u);
    ck_assert_int_eq(append1(s, mk(&a, stream, "Thing"), STORE_NO_STREAM, &v),
                     0);
    v = 42;
    ck_assert_int_eq(append1(s, mk(&b, stream, "Thing"), 5, &v),
                     KS_ECONFLICT);
    ck_assert_int_eq(v, 42); /* not written on failure */
    ck_assert_int_eq(append1(s, mk(&c, stream, "Thing"), STORE_NO_STREAM, &v),
                     KS_ECONFLICT);
    ck_assert_int_eq(store_read_stream(s, stream, 0, 0, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, 1);
    ck_assert_str_eq(col.ids[0], a.id);
    ck_assert_int_eq(store_stream_version(s, stream, &v), 0);
    ck_assert_int_eq(v, 1);
    /* Exact on a stream that does not exist is a conflict too. */
    ck_assert_int_eq(append1(s, mk(&b, "test-nope-x", "Thing"), 3, &v),
                     KS_ECONFLICT);
    store_close(s);
}
END_TEST

#define RACERS 20

struct racer {
    const char *stream;
    pthread_barrier_t *barrier;
    int64_t version;
    int conflicts;
    int rc;
};

static void *
race(void *arg)
{
    struct racer *r = arg;
    struct store *s = NULL;
    struct tev t;
    int64_t expected = 0;

    r->rc = store_open(pg.conninfo, &s, NULL);
    pthread_barrier_wait(r->barrier);
    if (r->rc < 0)
        return NULL;
    mk(&t, r->stream, "Raced");
    for (;;) {
        int64_t v;
        int rc = append1(s, &t.ev, expected, &v);
        if (rc == 0) {
            r->version = v;
            break;
        }
        if (rc != KS_ECONFLICT) {
            r->rc = rc;
            break;
        }
        r->conflicts++;
        if ((rc = store_stream_version(s, r->stream, &expected)) < 0) {
            r->rc = rc;
            break;
        }
    }
    store_close(s);
    return NULL;
}

START_TEST(test_concurrent_appends)
{
    struct store *s = open_store();
    pthread_t th[RACERS];
    struct racer r[RACERS];
    pthread_barrier_t barrier;
    char stream[64], u[37];
    int seen[RACERS + 1] = {0}, conflicts = 0;
    struct collect col = {0};

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "race-%s", u);
    pthread_barrier_init(&barrier, NULL, RACERS);
    for (int i = 0; i < RACERS; i++) {
        r[i] = (struct racer){.stream = stream, .barrier = &barrier};
        pthread_create(&th[i], NULL, race, &r[i]);
    }
    for (int i = 0; i < RACERS; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < RACERS; i++) {
        ck_assert_int_eq(r[i].rc, 0);
        ck_assert(r[i].version >= 1 && r[i].version <= RACERS);
        ck_assert_int_eq(seen[r[i].version], 0);
        seen[r[i].version] = 1;
        conflicts += r[i].conflicts;
        /* Whoever landed at version k lost every earlier round it was in;
         * all started at NoStream, so it lost at least once unless k==1. */
        if (r[i].version > 1)
            ck_assert_int_ge(r[i].conflicts, 1);
    }
    ck_assert_int_ge(conflicts, RACERS - 1);
    ck_assert_int_eq(store_read_stream(s, stream, 0, 0, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, RACERS);
    for (int i = 0; i < RACERS; i++)
        ck_assert_int_eq(col.versions[i], i + 1);
    pthread_barrier_destroy(&barrier);
    store_close(s);
}
END_TEST

START_TEST(test_duplicate_event_id)
{
    struct store *s = open_store();
    char stream[64], u[37], sql[256];
    struct tev a, b;
    int64_t v = -1;

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "test-%s", u);
    mk(&a, stream, "Thing");
    ck_assert_int_eq(append1(s, &a.ev, STORE_NO_STREAM, &v), 0);
    ck_assert_int_eq(append1(s, mk(&b, stream, "Thing"), 1, &v), 0);
    v = -1;
    /* A redelivery: whatever the expected version, it is a no-op. */
    ck_assert_int_eq(append1(s, &a.ev, STORE_NO_STREAM, &v), KS_EDUPLICATE);
    ck_assert_int_eq(v, 2);
    ck_assert_int_eq(append1(s, &a.ev, STORE_ANY, &v), KS_EDUPLICATE);
    ck_assert_int_eq(append1(s, &a.ev, 2, &v), KS_EDUPLICATE);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE event_id = '%s'", a.id);
    ck_assert_int_eq(sql_ll(s, "%s", sql), 1);
    ck_assert_int_eq(store_stream_version(s, stream, &v), 0);
    ck_assert_int_eq(v, 2);
    /* One recorded, one new: a conflict, nothing written. */
    {
        struct tev c;
        struct store_event two[2] = {{&a.ev}, {mk(&c, stream, "Thing")}};
        ck_assert_int_eq(store_append(s, stream, 2, two, 2, &v),
                         KS_ECONFLICT);
        ck_assert_int_eq(store_stream_version(s, stream, &v), 0);
        ck_assert_int_eq(v, 2);
    }
    store_close(s);
}
END_TEST

START_TEST(test_append_many_duplicates)
{
    struct store *s = open_store();
    enum { STREAMS = 10, PER = 10, N = STREAMS * PER };
    static struct tev evs[N];
    static char streams[STREAMS][64];
    const Ks__Event *batch[N + 10];
    size_t n = 0, dups = 99;
    char u[37];

    for (int i = 0; i < STREAMS; i++) {
        ks_uuid(u);
        snprintf(streams[i], sizeof(streams[i]), "many-%s", u);
    }
    for (int i = 0; i < N; i++)
        mk(&evs[i], streams[i % STREAMS], "Thing");
    /* The first 10 are recorded before the batch. */
    for (int i = 0; i < 10; i++)
        batch[n++] = &evs[i].ev;
    ck_assert_int_eq(store_append_many(s, batch, n, &dups), 0);
    ck_assert_int_eq(dups, 0);
    n = 0;
    for (int i = 0; i < N; i++)
        batch[n++] = &evs[i].ev;
    for (int i = 50; i < 55; i++) /* repeats inside the batch */
        batch[n++] = &evs[i].ev;
    ck_assert_int_eq(store_append_many(s, batch, n, &dups), 0);
    ck_assert_int_eq(dups, 15);
    for (int i = 0; i < STREAMS; i++) {
        int64_t v;
        struct collect col = {0};
        ck_assert_int_eq(store_stream_version(s, streams[i], &v), 0);
        ck_assert_int_eq(v, PER);
        ck_assert_int_eq(
            store_read_stream(s, streams[i], 0, 0, collect_cb, &col), 0);
        ck_assert_int_eq(col.n, PER);
        for (int k = 0; k < PER; k++) {
            ck_assert_int_eq(col.versions[k], k + 1);
            /* input order is version order within a stream */
            ck_assert_str_eq(col.ids[k], evs[k * STREAMS + i].id);
        }
    }
    ck_assert_int_eq(store_append_many(s, batch, n, &dups), 0);
    ck_assert_int_eq(dups, n);
    store_close(s);
}
END_TEST

static const uint8_t out_bytes[] = {0x6f, 0x6b, 0xff, 0xfe, 0x00,
                                    0x65, 0x6e, 0x64, 0x0a};

/* Requested -> Dispatched -> Started -> Completed for a new command. */
static void
run_command(struct store *s, char cid[37], const char *batch_id,
            const char *key, int exit_code)
{
    static char *argv[] = {"/bin/echo", "hello world", ""};
    char stream[64], agent[] = "agent-1";
    struct tev t[4];
    Ks__Command cmd = KS__COMMAND__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
    Ks__Output out = KS__OUTPUT__INIT, err = KS__OUTPUT__INIT;
    int64_t v;

    ks_uuid(cid);
    snprintf(stream, sizeof(stream), "command-%s", cid);
    spec.n_argv = 3;
    spec.argv = argv;
    cmd.command_id = cid;
    cmd.agent_id = agent;
    cmd.spec = &spec;
    cmd.batch_id = (char *)(batch_id ? batch_id : "");
    cmd.operator_ = "alice";
    cmd.issued_at_us = ks_now_us();
    mk(&t[0], stream, "CommandRequested")->command = &cmd;
    t[0].ev.command_id = cid;
    t[0].ev.operator_ = "alice";
    t[0].ev.reason = (char *)(key ? key : "");
    ck_assert_int_eq(append1(s, &t[0].ev, STORE_NO_STREAM, &v), 0);
    mk(&t[1], stream, "CommandDispatched")->attempt = 1;
    t[1].ev.agent_id = agent;
    ck_assert_int_eq(append1(s, &t[1].ev, 1, &v), 0);
    mk(&t[2], stream, "CommandStarted")->attempt = 1;
    t[2].ev.agent_id = agent;
    ck_assert_int_eq(append1(s, &t[2].ev, 2, &v), 0);
    out.data.data = (uint8_t *)out_bytes;
    out.data.len = sizeof(out_bytes);
    out.total_bytes = sizeof(out_bytes);
    err.data.data = (uint8_t *)"oops\n";
    err.data.len = 5;
    err.total_bytes = 70000;
    err.truncated = 1;
    res.status = exit_code == 0 ? KS__COMMAND_STATUS__SUCCEEDED
                                : KS__COMMAND_STATUS__FAILED;
    res.has_exit_code = 1;
    res.exit_code = exit_code;
    res.stdout = &out;
    res.stderr = &err;
    res.started_at_us = ks_now_us() - 1000;
    res.finished_at_us = ks_now_us();
    res.duration_us = 1000;
    res.term_sent_us = -1;
    res.kill_sent_us = -1;
    res.maxrss_kb = 1234;
    res.pid = 4242;
    mk(&t[3], stream, "CommandCompleted")->result = &res;
    t[3].ev.attempt = 1;
    ck_assert_int_eq(append1(s, &t[3].ev, STORE_ANY, &v), 0);
    ck_assert_int_eq(v, 4);

    /* The full result round-trips: compare packed forms. */
    Ks__CommandView *view = NULL;
    ck_assert_int_eq(store_get_command(s, cid, &view), 0);
    ck_assert_ptr_nonnull(view->result);
    size_t la = ks__command_result__get_packed_size(&res);
    size_t lb = ks__command_result__get_packed_size(view->result);
    ck_assert_uint_eq(la, lb);
    uint8_t *pa = malloc(la), *pb = malloc(lb);
    ks__command_result__pack(&res, pa);
    ks__command_result__pack(view->result, pb);
    ck_assert_int_eq(memcmp(pa, pb, la), 0);
    free(pa);
    free(pb);
    ks__command_view__free_unpacked(view, NULL);
}

START_TEST(test_command_projection)
{
    struct store *s = open_store();
    char cid[37], key[64], sql[256], found[37];
    Ks__CommandView *v = NULL;
    char *hex;

    ks_uuid(key);
    run_command(s, cid, NULL, key, 0);
    ck_assert_int_eq(store_get_command(s, cid, &v), 0);
    ck_assert_str_eq(v->command_id, cid);
    ck_assert_str_eq(v->agent_id, "agent-1");
    ck_assert_int_eq(v->status, KS__COMMAND_STATUS__SUCCEEDED);
    ck_assert_uint_eq(v->n_argv, 3);
    ck_assert_str_eq(v->argv[0], "/bin/echo");
    ck_assert_str_eq(v->argv[1], "hello world");
    ck_assert_str_eq(v->argv[2], "");
    ck_assert_uint_eq(v->attempt, 1);
    ck_assert_int_eq(v->version, 4);
    ck_assert_int_gt(v->requested_at_us, 0);
    ck_assert_str_eq(v->batch_id, "");
    ck_assert(v->result->has_exit_code);
    ck_assert_int_eq(v->result->exit_code, 0);
    ck_assert_uint_eq(v->result->stdout->data.len, sizeof(out_bytes));
    ck_assert_int_eq(
        memcmp(v->result->stdout->data.data, out_bytes, sizeof(out_bytes)),
        0);
    ck_assert(v->result->stderr->truncated);
    ck_assert_uint_eq(v->result->stderr->total_bytes, 70000);
    ks__command_view__free_unpacked(v, NULL);

    /* The bytea column itself is byte-exact. */
    snprintf(sql, sizeof(sql),
             "SELECT encode(stdout, 'hex') || '/' || status || '/' ||"
             " exit_code || '/' || operator FROM commands"
             " WHERE command_id = '%s'",
             cid);
    hex = sql1(s, sql);
    ck_assert_str_eq(hex, "6f6bfffe00656e640a/Succeeded/0/alice");
    free(hex);

    ck_assert_int_eq(store_command_by_key(s, "alice", key, found), 0);
    ck_assert_str_eq(found, cid);
    ck_assert_int_eq(store_command_by_key(s, "alice", "no-such-key", found),
                     KS_ENOTFOUND);
    /* A key is its operator's: another one's lookup finds nothing. */
    ck_assert_int_eq(store_command_by_key(s, "bob", key, found),
                     KS_ENOTFOUND);
    ks_uuid(found);
    ck_assert_int_eq(store_get_command(s, found, &v), KS_ENOTFOUND);

    /* An unknown type is recorded and leaves the projection alone. */
    {
        char stream[64], *before, *after;
        struct tev t;
        int64_t ver;
        snprintf(stream, sizeof(stream), "command-%s", cid);
        snprintf(sql, sizeof(sql),
                 "SELECT md5(t::text) FROM commands t"
                 " WHERE command_id = '%s'",
                 cid);
        before = sql1(s, sql);
        mk(&t, stream, "SomethingFromTheFuture")->command_id = cid;
        ck_assert_int_eq(append1(s, &t.ev, 4, &ver), 0);
        ck_assert_int_eq(ver, 5);
        after = sql1(s, sql);
        ck_assert_str_eq(before, after);
        free(before);
        free(after);
    }
    /* A second command of the same operator with the same idempotency
     * key is refused. */
    {
        char cid2[37], stream[64];
        struct tev t;
        Ks__Command cmd = KS__COMMAND__INIT;
        int64_t ver;
        ks_uuid(cid2);
        snprintf(stream, sizeof(stream), "command-%s", cid2);
        cmd.command_id = cid2;
        cmd.operator_ = "alice";
        mk(&t, stream, "CommandRequested")->command = &cmd;
        t.ev.reason = key;
        ck_assert_int_eq(append1(s, &t.ev, STORE_NO_STREAM, &ver),
                         KS_ECONFLICT);
        ck_assert_int_eq(store_stream_version(s, stream, &ver), 0);
        ck_assert_int_eq(ver, 0);
    }
    /* Another operator's same key is a command of its own (issue 21). */
    {
        char cid3[37], stream[64];
        struct tev t;
        Ks__Command cmd = KS__COMMAND__INIT;
        int64_t ver;
        ks_uuid(cid3);
        snprintf(stream, sizeof(stream), "command-%s", cid3);
        cmd.command_id = cid3;
        cmd.operator_ = "bob";
        mk(&t, stream, "CommandRequested")->command = &cmd;
        t.ev.reason = key;
        ck_assert_int_eq(append1(s, &t.ev, STORE_NO_STREAM, &ver), 0);
        ck_assert_int_eq(store_command_by_key(s, "bob", key, found), 0);
        ck_assert_str_eq(found, cid3);
        ck_assert_int_eq(store_command_by_key(s, "alice", key, found), 0);
        ck_assert_str_eq(found, cid);
    }
    store_close(s);
}
END_TEST

START_TEST(test_read_all_late_commit)
{
    struct store *r = open_store(), *a = open_store(), *b = open_store();
    struct store_cursor cur = {0};
    struct collect col;
    char sa[64], sb[64], u[37];
    struct tev ta, tb;
    uint8_t *data;
    size_t len;
    PGresult *res;

    /* Drain: the cursor is at the end of everything committed so far. */
    do {
        col = (struct collect){0};
        ck_assert_int_eq(store_read_all(r, &cur, 1000, collect_cb, &col), 0);
    } while (col.n > 0);

    ks_uuid(u);
    snprintf(sa, sizeof(sa), "late-%s", u);
    ks_uuid(u);
    snprintf(sb, sizeof(sb), "late-%s", u);
    mk(&ta, sa, "Thing");
    mk(&tb, sb, "Thing");

    /* A: takes its xid and a position first, commits last. */
    PGconn *ca = store_pgconn(a);
    ck_assert_int_eq(kproto_pack(&ta.ev.base, &data, &len), 0);
    {
        const char *vals[3] = {sa, ta.id, (const char *)data};
        int lens[3] = {0, 0, (int)len}, fmts[3] = {0, 0, 1};
        PQclear(PQexec(ca, "BEGIN"));
        res = PQexecParams(ca,
                           "INSERT INTO events (stream_id, version, event_id,"
                           " type, data) VALUES ($1, 1, $2, 'Thing', $3)",
                           3, NULL, vals, lens, fmts, 0);
        ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK, "%s",
                      PQresultErrorMessage(res));
        PQclear(res);
    }
    free(data);
    /* B: a later position, committed first. */
    ck_assert_int_eq(append1(b, &tb.ev, STORE_NO_STREAM, NULL), 0);

    col = (struct collect){0};
    ck_assert_int_eq(store_read_all(r, &cur, 1000, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, 0); /* B must wait for A */

    PQclear(PQexec(ca, "COMMIT"));
    col = (struct collect){0};
    ck_assert_int_eq(store_read_all(r, &cur, 1000, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, 2);
    ck_assert_str_eq(col.ids[0], ta.id);
    ck_assert_str_eq(col.ids[1], tb.id);
    ck_assert_int_lt(col.pos[0], col.pos[1]);
    col = (struct collect){0};
    ck_assert_int_eq(store_read_all(r, &cur, 1000, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, 0);
    store_close(a);
    store_close(b);
    store_close(r);
}
END_TEST

/* ---- catch-up order across powers of ten of the transaction id ---- */

/* The next transaction id to be handed out (assigns none). */
static long long
next_xid(PGconn *c)
{
    PGresult *res = PQexec(
        c, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text");
    ck_assert_msg(PQresultStatus(res) == PGRES_TUPLES_OK, "%s",
                  PQresultErrorMessage(res));
    long long x = atoll(PQgetvalue(res, 0, 0));
    PQclear(res);
    return x;
}

/* Spends transaction ids, one short committed transaction each, until
 * the next one is at least target (about 100,000 a second here). */
static void
burn_xids_to(PGconn *c, long long target)
{
    long long n = target - next_xid(c);
    char sql[256];
    if (n <= 0)
        return;
    snprintf(sql, sizeof(sql),
             "DO $$ BEGIN FOR i IN 1..%lld LOOP"
             " PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$",
             n);
    PGresult *res = PQexec(c, sql);
    ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK, "%s",
                  PQresultErrorMessage(res));
    PQclear(res);
    ck_assert_int_ge(next_xid(c), target);
}

struct ordered {
    size_t n, cap;
    char (*ids)[37];
    uint64_t *tx;
    int64_t *pos;
};

static int
ordered_cb(const Ks__RecordedEvent *ev, void *ud)
{
    struct ordered *o = ud;
    if (o->n == o->cap) {
        o->cap = o->cap ? o->cap * 2 : 256;
        o->ids = realloc(o->ids, o->cap * sizeof(*o->ids));
        o->tx = realloc(o->tx, o->cap * sizeof(*o->tx));
        o->pos = realloc(o->pos, o->cap * sizeof(*o->pos));
        ck_assert(o->ids && o->tx && o->pos);
    }
    snprintf(o->ids[o->n], 37, "%s", ev->event->event_id);
    o->tx[o->n] = ev->tx_id;
    o->pos[o->n] = ev->global_pos;
    o->n++;
    return 0;
}

/* Reads on from cur in pages of 3 until a page is empty. */
static void
read_pages(struct store *r, struct store_cursor *cur, struct ordered *o)
{
    for (;;) {
        size_t before = o->n;
        ck_assert_int_eq(store_read_all(r, cur, 3, ordered_cb, o), 0);
        if (o->n == before)
            return;
    }
}

/* Position of id in o, or -1. */
static long
ordered_find(const struct ordered *o, const char *id)
{
    for (size_t i = 0; i < o->n; i++)
        if (strcmp(o->ids[i], id) == 0)
            return (long)i;
    return -1;
}

/* One crossing of boundary (a power of ten above the next xid). */
static void
xid_order_across(struct store *r, struct store *a, struct store *b,
                 long long boundary)
{
    PGconn *ca = store_pgconn(a), *cb = store_pgconn(b);
    struct store_cursor cur = {0};
    struct ordered seen = {0};
    struct tev early[3], held, mid[2], late[10];
    char stream[64], u[37];

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "xid-%s", u);
    burn_xids_to(cb, boundary - 10);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(append1(b, mk(&early[i], stream, "Thing"), STORE_ANY,
                                 NULL),
                         0);
    /* The held append: its transaction takes an id below the boundary and
     * stays open while later ones commit on both sides of it. */
    PQclear(PQexec(ca, "BEGIN"));
    ck_assert_int_eq(
        append1(a, mk(&held, "xid-held", "Thing"), STORE_ANY, NULL), 0);
    ck_assert_int_eq(PQtransactionStatus(ca), PQTRANS_INTRANS);
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(
            append1(b, mk(&mid[i], stream, "Thing"), STORE_ANY, NULL), 0);
    burn_xids_to(cb, boundary + 2);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(
            append1(b, mk(&late[i], stream, "Thing"), STORE_ANY, NULL), 0);

    /* While it is open: everything before it, nothing from it on. */
    read_pages(r, &cur, &seen);
    for (int i = 0; i < 3; i++)
        ck_assert_int_ge(ordered_find(&seen, early[i].id), 0);
    ck_assert_int_eq(ordered_find(&seen, held.id), -1);
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(ordered_find(&seen, mid[i].id), -1);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(ordered_find(&seen, late[i].id), -1);
    size_t while_open = seen.n;

    PQclear(PQexec(ca, "COMMIT"));
    read_pages(r, &cur, &seen);
    long h = ordered_find(&seen, held.id);
    ck_assert_int_ge(h, (long)while_open);
    ck_assert_uint_lt(seen.tx[h], (uint64_t)boundary);
    long prev = h;
    for (int i = 0; i < 2; i++) {
        long k = ordered_find(&seen, mid[i].id);
        ck_assert_int_gt(k, prev);
        prev = k;
    }
    for (int i = 0; i < 10; i++) {
        long k = ordered_find(&seen, late[i].id);
        ck_assert_int_gt(k, prev);
        ck_assert_uint_ge(seen.tx[k], (uint64_t)boundary);
        prev = k;
    }
    /* Every event of the table exactly once, in (tx_id, global_pos). */
    for (size_t i = 1; i < seen.n; i++)
        ck_assert_msg(seen.tx[i - 1] < seen.tx[i] ||
                          (seen.tx[i - 1] == seen.tx[i] &&
                           seen.pos[i - 1] < seen.pos[i]),
                      "event %zu (%llu, %lld) after (%llu, %lld)", i,
                      (unsigned long long)seen.tx[i], (long long)seen.pos[i],
                      (unsigned long long)seen.tx[i - 1],
                      (long long)seen.pos[i - 1]);
    ck_assert_int_eq((long long)seen.n,
                     sql_ll(r, "SELECT count(*) FROM events%s", ""));
    free(seen.ids);
    free(seen.tx);
    free(seen.pos);
}

/*
 * Issue 10 item 6: the catch-up read sorted tx_id as text, so "1000" came
 * before "999": from a zero cursor in small pages the events below the
 * power of ten were never read, and a cursor walked across it read some
 * twice. Events on both sides of a power of ten, one append held open
 * across it: every event once, in (tx_id, global_pos) order, the held one
 * only after its commit.
 */
START_TEST(test_read_all_xid_order)
{
    struct store *r = open_store(), *a = open_store(), *b = open_store();
    long long boundary = 1000;

    /* Past the next three powers of ten (1,000, 10,000 and 100,000 on a
     * fresh cluster; ids burn at about 100,000 a second). */
    while (boundary < next_xid(store_pgconn(b)) + 50)
        boundary *= 10;
    for (int k = 0; k < 3; k++, boundary *= 10) {
        int64_t t0 = ks_mono_us();
        xid_order_across(r, a, b, boundary);
        printf("xid order across %lld: %.2f s\n", boundary,
               (ks_mono_us() - t0) / 1e6);
    }
    store_close(a);
    store_close(b);
    store_close(r);
}
END_TEST

/* ---- what a reader waits for (issue 25) ---- */

/* Runs sql on c; a failure fails the test. */
static void
exec_ok(PGconn *c, const char *sql)
{
    PGresult *res = PQexec(c, sql);
    ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK ||
                      PQresultStatus(res) == PGRES_TUPLES_OK,
                  "%s: %s", sql, PQresultErrorMessage(res));
    PQclear(res);
}

/* A connection of its own to database db of the fixture's cluster. */
static PGconn *
pq_db(const char *db)
{
    char ci[PATH_MAX + 64];
    snprintf(ci, sizeof(ci), "%s dbname=%s", pg.conninfo, db);
    PGconn *c = PQconnectdb(ci);
    ck_assert_msg(PQstatus(c) == CONNECTION_OK, "%s: %s", ci,
                  PQerrorMessage(c));
    return c;
}

/* Reads from *cur until a page is empty; whether id was among them. */
static bool
read_finds(struct store *r, struct store_cursor *cur, const char *id)
{
    bool found = false;
    struct collect col;
    do {
        col = (struct collect){0};
        ck_assert_int_eq(store_read_all(r, cur, 64, collect_cb, &col), 0);
        for (int i = 0; i < col.n && i < 64; i++)
            found = found || strcmp(col.ids[i], id) == 0;
    } while (col.n > 0);
    return found;
}

/*
 * Issue 25: readers waited below pg_snapshot_xmin, the oldest open
 * transaction of the whole cluster, so one open transaction of another
 * database (25 s: a follower's delivery went from 1 s to 24 s) or of this
 * one that writes no event held every follower back. Both stay open here
 * while an event is appended: the reader gets it at once. An open
 * appender of this database is still waited for, and its event comes
 * first (the order is (tx_id, global_pos)).
 */
START_TEST(test_read_all_passes_other_transactions)
{
    struct store *r = open_store(), *a = open_store(), *w = open_store();
    struct store_cursor cur = {0};
    struct tev t1, held, t2;
    char stream[64], hstream[64], u[37];

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "pass-%s", u);
    ks_uuid(u);
    snprintf(hstream, sizeof(hstream), "pass-%s", u);
    read_finds(r, &cur, "");
    /* A transaction with an id, in another database... */
    PGconn *other = pq_db("postgres");
    exec_ok(other, "BEGIN");
    exec_ok(other, "SELECT pg_current_xact_id()");
    /* ... and one of this database that writes, but no event. */
    PGconn *same = pq_db("kscore");
    exec_ok(same, "CREATE TABLE IF NOT EXISTS reader_bystander (x int)");
    exec_ok(same, "BEGIN");
    exec_ok(same, "INSERT INTO reader_bystander VALUES (1)");
    exec_ok(same, "SELECT count(*) FROM events"); /* reading is no append */

    ck_assert_int_eq(append1(a, mk(&t1, stream, "Thing"), STORE_ANY, NULL),
                     0);
    ck_assert_msg(read_finds(r, &cur, t1.id),
                  "an event committed after two open transactions that "
                  "append nothing was not read while they are open");

    /* An appender that is open is waited for: nothing after it is read
     * until it ends, then its event first. */
    PQclear(PQexec(store_pgconn(w), "BEGIN"));
    ck_assert_int_eq(
        append1(w, mk(&held, hstream, "Thing"), STORE_ANY, NULL), 0);
    ck_assert_int_eq(append1(a, mk(&t2, stream, "Thing"), STORE_ANY, NULL),
                     0);
    ck_assert(!read_finds(r, &cur, t2.id));
    exec_ok(store_pgconn(w), "COMMIT");
    struct collect col = {0};
    ck_assert_int_eq(store_read_all(r, &cur, 64, collect_cb, &col), 0);
    ck_assert_int_eq(col.n, 2);
    ck_assert_str_eq(col.ids[0], held.id);
    ck_assert_str_eq(col.ids[1], t2.id);

    exec_ok(other, "COMMIT");
    exec_ok(same, "ROLLBACK");
    PQfinish(other);
    PQfinish(same);
    store_close(w);
    store_close(a);
    store_close(r);
}
END_TEST

/*
 * The writer's half of the rule (migration 12): a transaction that wrote
 * something else first (so it has an id) and then appends would be passed
 * by readers while open, and its events skipped for good once it commits.
 * Such an append is refused (KS006), by the store's appends and by a
 * plain INSERT; the same INSERT as the transaction's first write is
 * fine (it locks events before it has an id).
 */
START_TEST(test_append_locks_events_first)
{
    struct store *s = open_store();
    struct tev t;
    char stream[64], u[37], sql[512];
    PGconn *c = store_pgconn(s);

    ks_uuid(u);
    snprintf(stream, sizeof(stream), "lock-%s", u);
    exec_ok(c, "CREATE TABLE IF NOT EXISTS reader_bystander (x int)");
    exec_ok(c, "BEGIN");
    exec_ok(c, "INSERT INTO reader_bystander VALUES (2)");
    ck_assert_int_eq(append1(s, mk(&t, stream, "Thing"), STORE_ANY, NULL),
                     KS_EPG);
    ck_assert_str_eq(store_last_sqlstate(s), "KS006");
    exec_ok(c, "ROLLBACK");

    snprintf(sql, sizeof(sql),
             "INSERT INTO events (stream_id, version, event_id, type, data)"
             " VALUES ('%s', 1, '%s', 'Thing', '')",
             stream, t.id);
    exec_ok(c, "BEGIN");
    exec_ok(c, "INSERT INTO reader_bystander VALUES (3)");
    PGresult *res = PQexec(c, sql);
    ck_assert_int_eq(PQresultStatus(res), PGRES_FATAL_ERROR);
    ck_assert_str_eq(PQresultErrorField(res, PG_DIAG_SQLSTATE), "KS006");
    PQclear(res);
    exec_ok(c, "ROLLBACK");

    exec_ok(c, "BEGIN");
    exec_ok(c, sql);
    exec_ok(c, "INSERT INTO reader_bystander VALUES (4)");
    exec_ok(c, "ROLLBACK");
    /* And the store's own appends still work in a transaction. */
    exec_ok(c, "BEGIN");
    ck_assert_int_eq(append1(s, &t.ev, STORE_ANY, NULL), 0);
    exec_ok(c, "INSERT INTO reader_bystander VALUES (5)");
    exec_ok(c, "COMMIT");
    store_close(s);
}
END_TEST

START_TEST(test_wait_notify)
{
    struct store *l = open_store(), *w = open_store();
    char stream[64], u[37];
    struct tev t;

    ck_assert_int_eq(store_wait_notify(l, 10), KS_ETIMEDOUT);
    ks_uuid(u);
    snprintf(stream, sizeof(stream), "test-%s", u);
    ck_assert_int_eq(append1(w, mk(&t, stream, "Thing"), STORE_ANY, NULL), 0);
    int64_t t0 = ks_mono_us();
    ck_assert_int_eq(store_wait_notify(l, 5000), 0);
    ck_assert_int_lt(ks_mono_us() - t0, 1000000);
    ck_assert_int_eq(store_wait_notify(l, 10), KS_ETIMEDOUT);
    store_close(l);
    store_close(w);
}
END_TEST

static const char *digest_sql[] = {
    "SELECT coalesce(md5(string_agg(t::text, ',' ORDER BY command_id)), '')"
    " FROM commands t",
    "SELECT coalesce(md5(string_agg(t::text, ',' ORDER BY batch_id)), '')"
    " FROM batches t",
    "SELECT coalesce(md5(string_agg(t::text, ',' ORDER BY command_id)), '')"
    " FROM batch_targets t",
};
#define N_DIGESTS (sizeof(digest_sql) / sizeof(digest_sql[0]))

/* A replay from events alone rebuilds the projections as they are;
 * returns the events replayed. */
static int64_t
assert_replay_equal(struct store *s)
{
    char *before[N_DIGESTS], *err = NULL;
    int64_t n = 0;

    for (int i = 0; i < (int)N_DIGESTS; i++)
        before[i] = sql1(s, digest_sql[i]);
    ck_assert_msg(store_replay(s, &n, &err) == 0, "replay: %s",
                  err ? err : "");
    for (int i = 0; i < (int)N_DIGESTS; i++) {
        char *after = sql1(s, digest_sql[i]);
        ck_assert_msg(strcmp(before[i], after) == 0, "%s differs", digest_sql[i]);
        free(after);
        free(before[i]);
    }
    free(err);
    return n;
}

START_TEST(test_replay_equality)
{
    struct store *s = open_store(), *other = open_store();
    char cid[37], bid[37], bstream[64], *before[N_DIGESTS], *after[N_DIGESTS], *err = NULL;
    struct tev t;
    int64_t n = 0, v;

    /* A batch of two targets, one succeeded and one failed. */
    ks_uuid(bid);
    snprintf(bstream, sizeof(bstream), "batch-%s", bid);
    mk(&t, bstream, "BatchRequested")->batch_id = bid;
    t.ev.operator_ = "bob";
    ck_assert_int_eq(append1(s, &t.ev, STORE_NO_STREAM, &v), 0);
    run_command(s, cid, bid, NULL, 0);
    run_command(s, cid, bid, NULL, 2);
    run_command(s, cid, NULL, NULL, 0);
    mk(&t, bstream, "BatchCompleted")->batch_id = bid;
    /* How it ended is the row's status (migration 13; "Completed" before,
     * whatever the end), the same after a replay. */
    t.ev.batch_status = KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE;
    ck_assert_int_eq(append1(s, &t.ev, 1, &v), 0);
    {
        char sql[256], *row;
        snprintf(sql, sizeof(sql),
                 "SELECT status||total||succeeded||failed||cancelled||version"
                 " FROM batches WHERE batch_id = '%s'",
                 bid);
        row = sql1(s, sql);
        ck_assert_str_eq(row, "PartialFailure21102");
        free(row);
    }

    for (int i = 0; i < (int)N_DIGESTS; i++)
        before[i] = sql1(s, digest_sql[i]);
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    ck_assert_int_gt(n, 10);
    for (int i = 0; i < (int)N_DIGESTS; i++) {
        after[i] = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after[i]);
        free(after[i]);
    }
    /* Damage the projections; a replay restores them. */
    PQclear(PQexec(store_pgconn(s), "UPDATE commands SET status = 'Bogus';"
                                    "DELETE FROM batch_targets;"
                                    "UPDATE batches SET total = 0"));
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    for (int i = 0; i < (int)N_DIGESTS; i++) {
        after[i] = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after[i]);
        free(after[i]);
    }
    /* Index names survive the swap (a third replay would clash if not). */
    ck_assert_int_eq(
        sql_ll(s,
               "SELECT count(*) FROM pg_indexes WHERE indexname IN"
               " ('commands_pkey', 'commands_open', 'commands_batch',"
               " 'commands_operator_idempotency_key', 'batch_targets_batch')%s",
               ""),
        5);
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    /* Connections that prepared before the swap still append. */
    run_command(other, cid, NULL, NULL, 0);
    run_command(s, cid, NULL, NULL, 0);
    for (int i = 0; i < (int)N_DIGESTS; i++)
        free(before[i]);
    store_close(s);
    store_close(other);
}
END_TEST

/* ---- the batch path's fold against the per-event rules ---- */

/* Events of one scenario; strings live in the struct. */
struct fev {
    Ks__Event ev;
    Ks__Command cmd;
    Ks__CommandResult res;
    Ks__Output out;
    char id[37], stream[64], cid[37], bid[37];
};

static Ks__CommandSpec fold_spec = KS__COMMAND_SPEC__INIT;
static char *fold_argv[] = {"/bin/sh", "-c", "exit 3"};

static Ks__Event *
fmk(struct fev *f, const char *cid, const char *type)
{
    memset(f, 0, sizeof(*f));
    ks__event__init(&f->ev);
    ks_uuid(f->id);
    snprintf(f->cid, sizeof(f->cid), "%s", cid);
    snprintf(f->stream, sizeof(f->stream), "command-%s", cid);
    f->ev.event_id = f->id;
    f->ev.stream_id = f->stream;
    f->ev.type = (char *)type;
    f->ev.command_id = f->cid;
    f->ev.occurred_at_us = ks_now_us();
    return &f->ev;
}

static Ks__Event *
freq(struct fev *f, const char *cid, const char *batch_id, const char *key)
{
    fmk(f, cid, "CommandRequested");
    ks__command__init(&f->cmd);
    fold_spec.n_argv = 3;
    fold_spec.argv = fold_argv;
    f->cmd.command_id = f->cid;
    f->cmd.agent_id = "agent-1";
    f->cmd.spec = &fold_spec;
    f->cmd.operator_ = "carol";
    f->cmd.issued_at_us = f->ev.occurred_at_us;
    f->cmd.not_after_us = f->ev.occurred_at_us + 60000000;
    if (batch_id) {
        snprintf(f->bid, sizeof(f->bid), "%s", batch_id);
        f->cmd.batch_id = f->bid;
    }
    f->ev.command = &f->cmd;
    f->ev.reason = (char *)(key ? key : "");
    return &f->ev;
}

static Ks__Event *
fstatus(struct fev *f, const char *cid, const char *type, uint32_t attempt,
        const char *agent)
{
    fmk(f, cid, type);
    f->ev.attempt = attempt;
    f->ev.agent_id = (char *)(agent ? agent : "");
    if (strcmp(type, "CommandDispatched") == 0)
        f->ev.deliver_by_us = f->ev.occurred_at_us + 30000000;
    return &f->ev;
}

static Ks__Event *
fresult(struct fev *f, const char *cid, const char *type,
        Ks__CommandStatus st, int exit_code, const char *out)
{
    fmk(f, cid, type);
    ks__command_result__init(&f->res);
    ks__output__init(&f->out);
    f->out.data.data = (uint8_t *)out;
    f->out.data.len = strlen(out);
    f->out.total_bytes = strlen(out);
    f->res.stdout = &f->out;
    f->res.status = st;
    f->res.has_exit_code = 1;
    f->res.exit_code = exit_code;
    f->res.started_at_us = f->ev.occurred_at_us - 5000;
    f->res.finished_at_us = f->ev.occurred_at_us - 1;
    f->res.duration_us = 4999;
    f->ev.result = &f->res;
    f->ev.attempt = 1;
    return &f->ev;
}

static char *
row_of(struct store *s, const char *cid)
{
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT status || '/' || version || '/' || attempt || '/' ||"
             " agent_id || '/' || coalesce(encode(stdout, 'escape'), '-')"
             " || '/' || (started_at IS NOT NULL) || '/' ||"
             " (finished_at IS NOT NULL) FROM commands"
             " WHERE command_id = '%s'",
             cid);
    return sql1(s, sql);
}

static void
assert_row(struct store *s, const char *cid, const char *want)
{
    char *got = row_of(s, cid);
    ck_assert_msg(strcmp(got, want) == 0, "%s: got %s, want %s", cid, got,
                  want);
    free(got);
}

static int
many(struct store *s, Ks__Event **evs, size_t n, size_t *dups)
{
    return store_append_many(s, (const Ks__Event *const *)evs, n, dups);
}

START_TEST(test_append_many_fold)
{
    struct store *s = open_store();
    enum { C = 10 };
    char cid[C][37], bid[37], bstream[64], key[37];
    static struct fev e[64];
    Ks__Event *b[64];
    size_t n = 0, k = 0, dups = 99;

    for (int i = 0; i < C; i++)
        ks_uuid(cid[i]);
    ks_uuid(bid);
    ks_uuid(key);
    snprintf(bstream, sizeof(bstream), "batch-%s", bid);

    /* Batch 1: several events of one command in order, a batch, dups. */
    fmk(&e[k], cid[0], "BatchRequested");
    snprintf(e[k].stream, sizeof(e[k].stream), "%s", bstream);
    snprintf(e[k].bid, sizeof(e[k].bid), "%s", bid);
    e[k].ev.batch_id = e[k].bid;
    e[k].ev.command_id = "";
    e[k].ev.operator_ = "carol";
    b[n++] = &e[k++].ev;
    /* 0: the whole lifecycle, in the batch, with a key. */
    b[n++] = freq(&e[k++], cid[0], bid, key);
    b[n++] = fstatus(&e[k++], cid[0], "CommandDispatched", 1, "agent-1");
    b[n++] = fstatus(&e[k++], cid[0], "CommandStarted", 1, "agent-1");
    b[n++] = fresult(&e[k++], cid[0], "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "zero");
    b[n] = b[n - 2]; /* a repeat inside the batch */
    n++;
    /* 1: a terminal status is final; the first result is kept. */
    b[n++] = freq(&e[k++], cid[1], bid, NULL);
    b[n++] = fstatus(&e[k++], cid[1], "CommandDispatched", 1, "agent-1");
    b[n++] = fresult(&e[k++], cid[1], "CommandCompleted",
                     KS__COMMAND_STATUS__FAILED, 3, "first");
    b[n++] = fstatus(&e[k++], cid[1], "CommandStarted", 2, "agent-9");
    /* A later terminal report is an annotation (a second terminal event
     * of a stream is refused: test_one_terminal_event). */
    b[n++] = fmk(&e[k++], cid[1], "LateResult");
    b[n++] = fmk(&e[k++], cid[1], "ReportRejected");
    /* 2: re-dispatched, back to Running with a new attempt and agent. */
    b[n++] = freq(&e[k++], cid[2], bid, NULL);
    b[n++] = fstatus(&e[k++], cid[2], "CommandDispatched", 1, "agent-1");
    b[n++] = fmk(&e[k++], cid[2], "CommandRejected");
    b[n++] = fstatus(&e[k++], cid[2], "CommandDispatched", 2, "agent-2");
    b[n++] = fstatus(&e[k++], cid[2], "CommandStarted", 2, NULL);
    /* 3: events before its Requested are no-ops; version-only events. */
    b[n++] = fstatus(&e[k++], cid[3], "CommandDispatched", 7, "agent-7");
    b[n++] = freq(&e[k++], cid[3], NULL, NULL);
    b[n++] = fmk(&e[k++], cid[3], "CommandCancelRequested");
    b[n++] = fmk(&e[k++], cid[3], "SomethingFromTheFuture");
    /* 4: no Requested ever: nothing. */
    b[n++] = fstatus(&e[k++], cid[4], "CommandStarted", 1, "agent-1");
    /* 5, 6: requested now, moved along by the next batches. */
    b[n++] = freq(&e[k++], cid[5], bid, NULL);
    b[n++] = freq(&e[k++], cid[6], NULL, NULL);
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    ck_assert_uint_eq(dups, 1);

    assert_row(s, cid[0], "Succeeded/4/1/agent-1/zero/true/true");
    assert_row(s, cid[1], "Failed/6/1/agent-1/first/true/true");
    assert_row(s, cid[2], "Running/5/2/agent-2/-/true/false");
    assert_row(s, cid[3], "Pending/3/0/agent-1/-/false/false");
    assert_row(s, cid[4], "");
    assert_row(s, cid[5], "Pending/1/0/agent-1/-/false/false");
    {
        char id[37];
        ck_assert_int_eq(store_command_by_key(s, "carol", key, id), 0);
        ck_assert_str_eq(id, cid[0]);
    }

    /* Batch 2: updates of rows requested before, a redelivery mixed in
     * (recorded events are skipped and counted), a terminal status. */
    n = 0;
    b[n++] = &e[2].ev; /* recorded: cid[0]'s Dispatched */
    b[n++] = fstatus(&e[k++], cid[5], "CommandDispatched", 1, "agent-5");
    b[n++] = fstatus(&e[k++], cid[5], "CommandStarted", 1, NULL);
    b[n++] = &e[1].ev; /* recorded: cid[0]'s Requested */
    b[n++] = fresult(&e[k++], cid[5], "CommandStartFailed",
                     KS__COMMAND_STATUS__START_FAILED, 0, "nope");
    b[n++] = fstatus(&e[k++], cid[6], "CommandDispatched", 1, "agent-6");
    b[n++] = fstatus(&e[k++], cid[2], "CommandUndeliverable", 0, NULL);
    b[n++] = fmk(&e[k++], cid[1], "CommandRejected");
    b[n++] = fmk(&e[k++], cid[6], "CommandCancelRequested");
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    ck_assert_uint_eq(dups, 2);
    assert_row(s, cid[5], "StartFailed/4/1/agent-5/nope/true/true");
    assert_row(s, cid[6], "Dispatched/3/1/agent-6/-/false/false");
    assert_row(s, cid[2], "Undeliverable/6/2/agent-2/-/true/true");
    assert_row(s, cid[1], "Failed/7/1/agent-1/first/true/true");

    /* Batch 3: the batch completes; an annotation of a final command. */
    n = 0;
    fmk(&e[k], cid[0], "BatchCompleted");
    snprintf(e[k].stream, sizeof(e[k].stream), "%s", bstream);
    snprintf(e[k].bid, sizeof(e[k].bid), "%s", bid);
    e[k].ev.batch_id = e[k].bid;
    e[k].ev.command_id = "";
    b[n++] = &e[k++].ev;
    b[n++] = fmk(&e[k++], cid[5], "CommandRejected");
    b[n++] = fresult(&e[k++], cid[6], "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "six");
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    ck_assert_uint_eq(dups, 0);
    assert_row(s, cid[5], "StartFailed/5/1/agent-5/nope/true/true");
    assert_row(s, cid[6], "Succeeded/4/1/agent-6/six/true/true");
    {
        char sql[256], *row;
        snprintf(sql, sizeof(sql),
                 "SELECT status||total||succeeded||failed||cancelled||version"
                 " FROM batches WHERE batch_id = '%s'",
                 bid);
        row = sql1(s, sql);
        /* 0 Succeeded, 1 Failed, 2 Undeliverable, 5 StartFailed; the
         * batch stream is at version 2 */
        ck_assert_str_eq(row, "Completed41302");
        free(row);
        snprintf(sql, sizeof(sql),
                 "SELECT string_agg(status, ',' ORDER BY status)"
                 " FROM batch_targets WHERE batch_id = '%s'",
                 bid);
        row = sql1(s, sql);
        ck_assert_str_eq(row, "Failed,StartFailed,Succeeded,Undeliverable");
        free(row);
    }
    /* Everything recorded already: a no-op. */
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    ck_assert_uint_eq(dups, n);

    /* The per-event rules (replay) give the same projections. */
    assert_replay_equal(s);
    store_close(s);
}
END_TEST

/* Counts events of a stream of one type. */
static long long
count_type(struct store *s, const char *stream, const char *type)
{
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = '%s'"
             " AND type = '%s'",
             stream, type);
    char *v = sql1(s, sql);
    long long n = atoll(v);
    free(v);
    return n;
}

/* Requested, Dispatched and Started on agent-1: a running command. */
static void
running_command(struct store *s, const char *cid)
{
    static struct fev e[3];
    Ks__Event *b[3];
    b[0] = freq(&e[0], cid, NULL, NULL);
    b[1] = fstatus(&e[1], cid, "CommandDispatched", 1, "agent-1");
    b[2] = fstatus(&e[2], cid, "CommandStarted", 1, "agent-1");
    ck_assert_int_eq(many(s, b, 3, NULL), 0);
}

/* The database refuses a second terminal event and a second claim of a
 * stream, on every append path. */
START_TEST(test_one_terminal_event)
{
    struct store *s = open_store();
    static struct fev e[4];
    char cid[37];
    ks_uuid(cid);
    running_command(s, cid);
    struct store_event one = {fresult(&e[0], cid, "CommandCompleted",
                                      KS__COMMAND_STATUS__SUCCEEDED, 0, "x")};
    ck_assert_int_eq(store_append(s, e[0].stream, STORE_ANY, &one, 1, NULL),
                     0);
    struct store_event two = {fstatus(&e[1], cid, "CommandLost", 1, NULL)};
    ck_assert_int_eq(store_append(s, e[1].stream, STORE_ANY, &two, 1, NULL),
                     KS_ECONFLICT);
    Ks__Event *b[1] = {fstatus(&e[2], cid, "CommandUndeliverable", 1, NULL)};
    ck_assert_int_eq(many(s, b, 1, NULL), KS_ECONFLICT);
    struct store_event start = {fstatus(&e[3], cid, "CommandStarted", 2,
                                        "agent-1")};
    ck_assert_int_eq(
        store_append(s, e[3].stream, STORE_ANY, &start, 1, NULL),
        KS_ECONFLICT);
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandLost"), 0);
    store_close(s);
}
END_TEST

/* The state machine, table-driven: every (state, event) pair a command can
 * meet, and what it does. */
START_TEST(test_command_machine)
{
    static const struct {
        bool exists;
        Ks__CommandStatus st;
        const char *type;
        Ks__CommandStatus result; /* 0: no result */
        enum store_step want;
        Ks__CommandStatus next;
    } cases[] = {
#define P KS__COMMAND_STATUS__PENDING
#define D KS__COMMAND_STATUS__DISPATCHED
#define R KS__COMMAND_STATUS__RUNNING
#define OK KS__COMMAND_STATUS__SUCCEEDED
#define FL KS__COMMAND_STATUS__FAILED
#define LO KS__COMMAND_STATUS__LOST
#define NS KS__COMMAND_STATUS__NOT_STARTED
#define SF KS__COMMAND_STATUS__START_FAILED
#define UD KS__COMMAND_STATUS__UNDELIVERABLE
#define CN KS__COMMAND_STATUS__CANCELLED
        {false, 0, "CommandRequested", 0, STORE_STEP_APPLY, P},
        {true, P, "CommandRequested", 0, STORE_STEP_ILLEGAL, P},
        {true, P, "CommandDispatched", 0, STORE_STEP_APPLY, D},
        {true, D, "CommandDispatched", 0, STORE_STEP_APPLY, D},
        {true, R, "CommandDispatched", 0, STORE_STEP_ILLEGAL, R},
        {true, D, "CommandStarted", 0, STORE_STEP_APPLY, R},
        {true, R, "CommandStarted", 0, STORE_STEP_ILLEGAL, R},
        {true, P, "CommandStarted", 0, STORE_STEP_ILLEGAL, P},
        {true, R, "CommandCompleted", OK, STORE_STEP_APPLY, OK},
        {true, R, "CommandCompleted", FL, STORE_STEP_APPLY, FL},
        {true, R, "CommandCompleted", LO, STORE_STEP_ILLEGAL, R},
        {true, R, "CommandCompleted", R, STORE_STEP_ILLEGAL, R},
        {true, D, "CommandCompleted", OK, STORE_STEP_ILLEGAL, D},
        {true, D, "CommandStartFailed", SF, STORE_STEP_APPLY, SF},
        {true, D, "CommandStartFailed", OK, STORE_STEP_ILLEGAL, D},
        {true, R, "CommandStartFailed", SF, STORE_STEP_APPLY, SF},
        {true, R, "CommandLost", 0, STORE_STEP_APPLY, LO},
        {true, R, "CommandLost", LO, STORE_STEP_APPLY, LO},
        {true, D, "CommandLost", 0, STORE_STEP_ILLEGAL, D},
        {true, R, "CommandNotStarted", NS, STORE_STEP_APPLY, NS},
        {true, D, "CommandUndeliverable", 0, STORE_STEP_APPLY, UD},
        {true, R, "CommandUndeliverable", 0, STORE_STEP_ILLEGAL, R},
        {true, D, "CommandCancelled", 0, STORE_STEP_APPLY, CN},
        {true, R, "CommandCancelled", 0, STORE_STEP_ILLEGAL, R},
        {true, LO, "CommandLost", 0, STORE_STEP_LATE, LO},
        {true, LO, "CommandCompleted", OK, STORE_STEP_LATE, LO},
        {true, OK, "CommandLost", 0, STORE_STEP_LATE, OK},
        {true, UD, "CommandStartFailed", SF, STORE_STEP_LATE, UD},
        {true, OK, "CommandStarted", 0, STORE_STEP_ILLEGAL, OK},
        {true, OK, "CommandDispatched", 0, STORE_STEP_ILLEGAL, OK},
        {true, OK, "CommandRejected", 0, STORE_STEP_APPLY, OK},
        {true, R, "DuplicateSuppressed", 0, STORE_STEP_APPLY, R},
        {false, 0, "CommandRejected", 0, STORE_STEP_APPLY, 0},
        {false, 0, "CommandCompleted", OK, STORE_STEP_ILLEGAL, 0},
        {false, 0, "CommandCancelRequested", 0, STORE_STEP_ILLEGAL, 0},
#undef P
#undef D
#undef R
#undef OK
#undef FL
#undef LO
#undef NS
#undef SF
#undef UD
#undef CN
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct store_command_state st = {.exists = cases[i].exists,
                                         .status = cases[i].st};
        Ks__Event ev = KS__EVENT__INIT;
        Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
        Ks__CommandStatus next = 99;
        const char *why = NULL;
        ev.type = (char *)cases[i].type;
        if (cases[i].result) {
            r.status = cases[i].result;
            ev.result = &r;
        }
        enum store_step got = store_command_step(&st, &ev, &next, &why);
        ck_assert_msg(got == cases[i].want, "case %zu (%s): verdict %d, "
                      "want %d (%s)", i, cases[i].type, got, cases[i].want,
                      why ? why : "");
        if (got == STORE_STEP_APPLY)
            ck_assert_msg(next == cases[i].next, "case %zu: next %d want %d",
                          i, next, cases[i].next);
        else
            ck_assert_msg(why && *why, "case %zu: no reason", i);
    }
}
END_TEST

static int
only_agent_1(const struct store_command_state *st, const Ks__Event *ev,
             const char **why, void *ud)
{
    (void)ud;
    if (st->exists && strcmp(ev->agent_id, st->agent_id) != 0) {
        *why = "addressed to another agent";
        return KS_EDENIED;
    }
    return 0;
}

/* Reports decided against the record: applied, late, refused, repeated. */
START_TEST(test_append_checked)
{
    struct store *s = open_store();
    static struct fev e[8];
    const Ks__Event *b[8];
    enum store_step v[8];
    char cid[37], ghost[37], sql[256];
    size_t dups = 99;

    ks_uuid(cid);
    ks_uuid(ghost);
    running_command(s, cid);
    /* A forged result from another agent, then the real one, then a late
     * Lost (an agent restarted after the scanner ended it), then a
     * report about a command that does not exist. */
    b[0] = fresult(&e[0], cid, "CommandCompleted",
                   KS__COMMAND_STATUS__SUCCEEDED, 0, "FORGED");
    e[0].ev.agent_id = "agent-2";
    b[1] = fresult(&e[1], cid, "CommandCompleted",
                   KS__COMMAND_STATUS__FAILED, 3, "real");
    e[1].ev.agent_id = "agent-1";
    b[2] = fstatus(&e[2], cid, "CommandLost", 1, "agent-1");
    b[3] = fresult(&e[3], ghost, "CommandCompleted",
                   KS__COMMAND_STATUS__SUCCEEDED, 0, "ghost");
    e[3].ev.agent_id = "agent-1";
    /* The message's own stream is ignored: derived from the command id. */
    e[1].ev.stream_id = "command-00000000-0000-0000-0000-000000000000";
    ck_assert_int_eq(
        store_append_checked(s, b, 4, only_agent_1, NULL, v, &dups), 0);
    ck_assert_int_eq(v[0], STORE_STEP_ILLEGAL);
    ck_assert_int_eq(v[1], STORE_STEP_APPLY);
    ck_assert_int_eq(v[2], STORE_STEP_LATE);
    ck_assert_int_eq(v[3], STORE_STEP_ILLEGAL);
    ck_assert_uint_eq(dups, 0);
    assert_row(s, cid, "Failed/6/1/agent-1/real/true/true");
    ck_assert_int_eq(count_type(s, e[0].stream, "ReportRejected"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "LateResult"), 1);
    ck_assert_int_eq(count_type(s, "agent-agent-1", "ReportRejected"), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM streams WHERE stream_id = 'command-%s'",
             ghost);
    ck_assert_int_eq(sql_ll(s, "%s", sql), 0);
    ck_assert_int_eq(sql_ll(s, "SELECT count(*) FROM streams WHERE "
                               "stream_id = 'command-00000000-0000-0000-"
                               "0000-000000000000'%s",
                            ""),
                     0);
    /* The same reports again: all recorded, nothing new. */
    ck_assert_int_eq(
        store_append_checked(s, b, 4, only_agent_1, NULL, v, &dups), 0);
    ck_assert_uint_eq(dups, 4);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(v[i], STORE_STEP_DUPLICATE);
    /* One call holding two ends of one command: the second is late. */
    char c2[37];
    ks_uuid(c2);
    running_command(s, c2);
    b[0] = fstatus(&e[4], c2, "CommandLost", 1, "agent-1");
    b[1] = fresult(&e[5], c2, "CommandCompleted",
                   KS__COMMAND_STATUS__SUCCEEDED, 0, "y");
    e[5].ev.agent_id = "agent-1";
    ck_assert_int_eq(store_append_checked(s, b, 2, NULL, NULL, v, NULL), 0);
    ck_assert_int_eq(v[0], STORE_STEP_APPLY);
    ck_assert_int_eq(v[1], STORE_STEP_LATE);
    assert_row(s, c2, "Lost/5/1/agent-1/-/true/true");
    store_close(s);
}
END_TEST

/* What a check judged an annotation (the broker charges those to the
 * reporter's share of annotation rows, broker/budget.c): their event ids. */
struct charged {
    char ids[32][37];
    int n;
};

static int
charge_annotations(const struct store_command_state *st, const Ks__Event *ev,
                   const char **why, void *ud)
{
    struct charged *c = ud;
    Ks__CommandStatus next;
    const char *w2 = NULL;
    int rc = only_agent_1(st, ev, why, NULL);
    if ((rc != 0 || store_command_step(st, ev, &next, &w2) !=
                        STORE_STEP_APPLY) &&
        c->n < 32)
        snprintf(c->ids[c->n++], sizeof(c->ids[0]), "%s", ev->event_id);
    return rc;
}

static bool
was_charged(const struct charged *c, const char *id)
{
    for (int i = 0; i < c->n; i++)
        if (strcmp(c->ids[i], id) == 0)
            return true;
    return false;
}

/* One batch of reports that holds every case at once: a redelivery, a
 * repeat within the batch, a forged report before the real one, a late
 * end, a report about no command, a command with one report recorded
 * before and one new. Each gets its own verdict, one command's conflict
 * writes nothing wrong for the others, and each annotation is judged so. */
START_TEST(test_append_checked_mixed_batch)
{
    struct store *s = open_store();
    static struct fev e[12];
    const Ks__Event *b[12];
    enum store_step v[12];
    char a[37], bb[37], c[37], d[37], x[37], ghost[37];
    struct charged ch = {.n = 0};
    size_t dups = 99;

    ks_uuid(a);
    ks_uuid(bb);
    ks_uuid(c);
    ks_uuid(d);
    ks_uuid(x);
    ks_uuid(ghost);
    running_command(s, a);
    running_command(s, bb);
    running_command(s, c);
    running_command(s, d);
    running_command(s, x);
    /* Recorded before: a's end, d's end, x's end. */
    b[0] = fresult(&e[0], a, "CommandCompleted", KS__COMMAND_STATUS__SUCCEEDED,
                   0, "a");
    e[0].ev.agent_id = "agent-1";
    b[1] = fresult(&e[1], d, "CommandCompleted", KS__COMMAND_STATUS__SUCCEEDED,
                   0, "d");
    e[1].ev.agent_id = "agent-1";
    b[2] = fresult(&e[2], x, "CommandCompleted", KS__COMMAND_STATUS__SUCCEEDED,
                   0, "x");
    e[2].ev.agent_id = "agent-1";
    ck_assert_int_eq(store_append_checked(s, b, 3, NULL, NULL, v, &dups), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(v[i], STORE_STEP_APPLY);

    size_t n = 0;
    b[n++] = &e[0].ev; /* 0: a redelivered */
    b[n++] = fresult(&e[3], bb, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "b"); /* 1 */
    e[3].ev.agent_id = "agent-1";
    b[n++] = &e[3].ev; /* 2: repeated in the batch */
    b[n++] = fresult(&e[4], c, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "FORGED"); /* 3 */
    e[4].ev.agent_id = "agent-2";
    b[n++] = fresult(&e[5], c, "CommandCompleted", KS__COMMAND_STATUS__FAILED,
                     2, "c"); /* 4: the real one */
    e[5].ev.agent_id = "agent-1";
    b[n++] = fstatus(&e[6], d, "CommandLost", 1, "agent-1"); /* 5: late */
    b[n++] = fresult(&e[7], ghost, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "g"); /* 6 */
    e[7].ev.agent_id = "agent-1";
    b[n++] = &e[2].ev;                                       /* 7: x again */
    b[n++] = fstatus(&e[8], x, "CommandLost", 1, "agent-1"); /* 8: late */
    ck_assert_int_eq(
        store_append_checked(s, b, n, charge_annotations, &ch, v, &dups), 0);
    ck_assert_int_eq(v[0], STORE_STEP_DUPLICATE);
    ck_assert_int_eq(v[1], STORE_STEP_APPLY);
    ck_assert_int_eq(v[2], STORE_STEP_DUPLICATE);
    ck_assert_int_eq(v[3], STORE_STEP_ILLEGAL);
    ck_assert_int_eq(v[4], STORE_STEP_APPLY);
    ck_assert_int_eq(v[5], STORE_STEP_LATE);
    ck_assert_int_eq(v[6], STORE_STEP_ILLEGAL);
    ck_assert_int_eq(v[7], STORE_STEP_DUPLICATE);
    ck_assert_int_eq(v[8], STORE_STEP_LATE);
    ck_assert_uint_eq(dups, 3);
    /* The annotations were judged so (a redelivery may be too, against
     * the state read before its KS003: the broker's budget remembers an
     * event id it charged, broker/budget.c). */
    ck_assert(was_charged(&ch, e[4].id));
    ck_assert(was_charged(&ch, e[6].id));
    ck_assert(was_charged(&ch, e[8].id));
    assert_row(s, a, "Succeeded/4/1/agent-1/a/true/true");
    assert_row(s, bb, "Succeeded/4/1/agent-1/b/true/true");
    assert_row(s, c, "Failed/5/1/agent-1/c/true/true");
    assert_row(s, d, "Succeeded/5/1/agent-1/d/true/true");
    assert_row(s, x, "Succeeded/5/1/agent-1/x/true/true");
    const char *cids[5] = {a, bb, c, d, x};
    for (int i = 0; i < 5; i++) {
        char stream[64];
        snprintf(stream, sizeof(stream), "command-%s", cids[i]);
        ck_assert_int_eq(count_type(s, stream, "CommandCompleted"), 1);
    }
    ck_assert_int_eq(count_type(s, e[4].stream, "ReportRejected"), 1);
    ck_assert_int_eq(count_type(s, e[6].stream, "LateResult"), 1);
    ck_assert_int_eq(count_type(s, e[8].stream, "LateResult"), 1);
    assert_replay_equal(s);
    store_close(s);
}
END_TEST

/* One report a call (the recorder's single results: the state assumed,
 * then read when it is not so), each case: applied, redelivered, forged,
 * late, about no command; one terminal event each, nothing else moved. */
START_TEST(test_append_checked_one_by_one)
{
    struct store *s = open_store();
    static struct fev e[6];
    enum store_step v;
    char a[37], c[37], ghost[37];
    size_t dups = 99;

    ks_uuid(a);
    ks_uuid(c);
    ks_uuid(ghost);
    running_command(s, a);
    running_command(s, c);
    const Ks__Event *one[1];
    /* 0: a's end, as assumed. */
    one[0] = fresult(&e[0], a, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "a");
    e[0].ev.agent_id = "agent-1";
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_APPLY);
    ck_assert_uint_eq(dups, 0);
    /* 0 again: a redelivery. */
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_DUPLICATE);
    ck_assert_uint_eq(dups, 1);
    /* 1: c's end from another agent (assumed its own: not so). */
    one[0] = fresult(&e[1], c, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "FORGED");
    e[1].ev.agent_id = "agent-2";
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_ILLEGAL);
    /* 2: a's loss after its end: late. */
    one[0] = fstatus(&e[2], a, "CommandLost", 1, "agent-1");
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_LATE);
    /* 3: about no command. */
    one[0] = fresult(&e[3], ghost, "CommandCompleted",
                     KS__COMMAND_STATUS__SUCCEEDED, 0, "g");
    e[3].ev.agent_id = "agent-1";
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_ILLEGAL);
    ck_assert_int_eq(sql_ll(s, "SELECT count(*) FROM streams WHERE"
                               " stream_id = 'command-%s'", ghost), 0);
    /* 4: c's real end. */
    one[0] = fresult(&e[4], c, "CommandCompleted", KS__COMMAND_STATUS__FAILED,
                     2, "c");
    e[4].ev.agent_id = "agent-1";
    ck_assert_int_eq(store_append_checked(s, one, 1, only_agent_1, NULL, &v,
                                          &dups), 0);
    ck_assert_int_eq(v, STORE_STEP_APPLY);
    assert_row(s, a, "Succeeded/5/1/agent-1/a/true/true");
    assert_row(s, c, "Failed/5/1/agent-1/c/true/true");
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "LateResult"), 1);
    ck_assert_int_eq(count_type(s, e[1].stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, e[1].stream, "ReportRejected"), 1);
    assert_replay_equal(s);
    store_close(s);
}
END_TEST

/* The recorder's one round trip path: a report decided against the state
 * a claim left, appended at the claim's version, or refused to the checked
 * path when the stream moved on or the verdict is not APPLY. */
START_TEST(test_append_checked_at)
{
    struct store *s = open_store();
    static struct fev e[6];
    char cid[37], c2[37];
    struct store_command_state known = {
        .exists = true, .status = KS__COMMAND_STATUS__RUNNING, .attempt = 1};
    snprintf(known.agent_id, sizeof(known.agent_id), "agent-1");

    ks_uuid(cid);
    running_command(s, cid); /* Requested, Dispatched, Started: v3 */
    Ks__Event *forged = fresult(&e[0], cid, "CommandCompleted",
                                KS__COMMAND_STATUS__SUCCEEDED, 0, "FORGED");
    forged->agent_id = "agent-2";
    ck_assert_int_eq(store_append_checked_at(s, forged, &known, 3,
                                             only_agent_1, NULL),
                     KS_ECONFLICT);
    /* A wrong stream in the message is ignored: the command's own. */
    Ks__Event *ok = fresult(&e[1], cid, "CommandCompleted",
                            KS__COMMAND_STATUS__FAILED, 3, "real");
    ok->agent_id = "agent-1";
    ok->attempt = 1;
    ok->stream_id = "command-00000000-0000-0000-0000-000000000000";
    ck_assert_int_eq(store_append_checked_at(s, ok, &known, 3, only_agent_1,
                                             NULL),
                     0);
    assert_row(s, cid, "Failed/4/1/agent-1/real/true/true");
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "ReportRejected"), 0);
    /* Again (a redelivery): recorded once. */
    ck_assert_int_eq(store_append_checked_at(s, ok, &known, 3, only_agent_1,
                                             NULL),
                     KS_EDUPLICATE);
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 1);
    /* A stale hint: the stream moved on (a cancel, say); nothing written. */
    ks_uuid(c2);
    running_command(s, c2);
    Ks__Event *other = fstatus(&e[2], c2, "CommandLost", 1, "agent-1");
    struct store_event se = {other};
    ck_assert_int_eq(store_append(s, e[2].stream, STORE_ANY, &se, 1, NULL),
                     0);
    Ks__Event *late = fresult(&e[3], c2, "CommandCompleted",
                              KS__COMMAND_STATUS__SUCCEEDED, 0, "late");
    late->agent_id = "agent-1";
    late->attempt = 1;
    ck_assert_int_eq(store_append_checked_at(s, late, &known, 3,
                                             only_agent_1, NULL),
                     KS_ECONFLICT);
    ck_assert_int_eq(count_type(s, e[2].stream, "CommandCompleted"), 0);
    assert_row(s, c2, "Lost/4/1/agent-1/-/true/true");
    store_close(s);
}
END_TEST

struct claim_arg {
    const char *stream;
    struct tev ev;
    int rc;
    int64_t version;
    volatile int done;
};

static void *
claim_thread(void *p)
{
    struct claim_arg *c = p;
    struct store *s = open_store();
    struct store_event se = {&c->ev.ev};
    c->rc = store_append_claim(s, c->stream, 2, "agent-1", &se, &c->version);
    c->done = 1;
    store_close(s);
    return NULL;
}

/* The broker publishes a command while its record commits: a claim that
 * arrives first waits for the record, and claims nothing when the record
 * fails or never comes. */
START_TEST(test_claim_waits_for_record)
{
    struct store *a = open_store();
    PGconn *ca = store_pgconn(a);
    char cid[37], stream[64], sql[512];
    PGresult *res;

    for (int outcome = 0; outcome < 2; outcome++) {
        struct claim_arg c = {.stream = stream};
        pthread_t t;
        ks_uuid(cid);
        snprintf(stream, sizeof(stream), "command-%s", cid);
        /* The record of a dispatched command, not yet committed. */
        snprintf(sql, sizeof(sql),
                 "BEGIN; INSERT INTO streams VALUES ('%s', 'command', 2);"
                 " INSERT INTO commands (command_id, agent_id, status,"
                 " attempt, version) VALUES ('%s', 'agent-1', 'Dispatched',"
                 " 1, 2)",
                 stream, cid);
        res = PQexec(ca, sql);
        ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK, "%s",
                      PQresultErrorMessage(res));
        PQclear(res);
        mk(&c.ev, stream, "CommandStarted");
        c.ev.ev.command_id = cid;
        c.ev.ev.agent_id = "agent-1";
        c.ev.ev.attempt = 1;
        ck_assert_int_eq(pthread_create(&t, NULL, claim_thread, &c), 0);
        usleep(300 * 1000);
        ck_assert_msg(!c.done, "the claim did not wait for the record");
        PQclear(PQexec(ca, outcome == 0 ? "COMMIT" : "ROLLBACK"));
        pthread_join(t, NULL);
        if (outcome == 0) {
            ck_assert_int_eq(c.rc, 0);
            ck_assert_int_eq(c.version, 3);
            ck_assert_int_eq(count_type(a, stream, "CommandStarted"), 1);
            /* A record made by hand, not by events: gone again, so
             * replay tests see only what events made. */
            snprintf(sql, sizeof(sql),
                     "DELETE FROM events WHERE stream_id = '%s';"
                     " DELETE FROM streams WHERE stream_id = '%s';"
                     " DELETE FROM commands WHERE command_id = '%s'",
                     stream, stream, cid);
            res = PQexec(ca, sql);
            ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK, "%s",
                          PQresultErrorMessage(res));
            PQclear(res);
        } else {
            ck_assert_int_eq(c.rc, KS_ENOTFOUND);
            snprintf(sql, sizeof(sql),
                     "SELECT count(*) FROM streams WHERE stream_id = '%s'",
                     stream);
            ck_assert_int_eq(sql_ll(a, "%s", sql), 0);
        }
    }
    /* No record at all: nothing to claim, no trace left. */
    {
        struct claim_arg c = {.stream = stream};
        ks_uuid(cid);
        snprintf(stream, sizeof(stream), "command-%s", cid);
        mk(&c.ev, stream, "CommandStarted");
        c.ev.ev.command_id = cid;
        c.ev.ev.agent_id = "agent-1";
        claim_thread(&c);
        ck_assert_int_eq(c.rc, KS_ENOTFOUND);
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM streams WHERE stream_id = '%s'",
                 stream);
        ck_assert_int_eq(sql_ll(a, "%s", sql), 0);
    }
    store_close(a);
}
END_TEST

struct checked_call {
    const Ks__Event *const *evs;
    size_t n;
    enum store_step *v;
    int rc;
};

static void *
checked_thread(void *arg)
{
    struct checked_call *c = arg;
    struct store *s = open_store();
    c->rc = store_append_checked(s, c->evs, c->n, only_agent_1, NULL, c->v,
                                 NULL);
    store_close(s);
    return NULL;
}

/* ---- the group writer (store/writer.c) ---- */

static struct store_writer *
open_writer(void)
{
    struct store_writer *w = NULL;
    char *err = NULL;
    int rc = store_writer_open(pg.conninfo, 1, &w, &err);
    ck_assert_msg(rc == 0, "store_writer_open: %s", err ? err : "");
    free(err);
    return w;
}

/* One append through the writer, on a thread of its own or not. */
struct wcall {
    struct store_writer *w;
    struct fev e[2];
    struct store_event se[2];
    struct store_write wr;
    /* checked_at instead of an append */
    bool checked;
    struct store_command_state known;
    int64_t at;
    int rc;
    struct store_write_result res;
    bool done;
};

static void *
wcall_run(void *arg)
{
    struct wcall *c = arg;
    if (c->checked)
        c->rc = store_writer_checked_at(c->w, &c->e[0].ev, &c->known, c->at,
                                        NULL, NULL, &c->res);
    else
        c->rc = store_writer_append(c->w, &c->wr, &c->res);
    __atomic_store_n(&c->done, true, __ATOMIC_RELEASE);
    return NULL;
}

/* A command's record as on_execute writes it: Requested + Dispatched to
 * agent-1, at no stream. */
static void
w_dispatch(struct wcall *c, struct store_writer *w, const char *cid,
           const char *key, const char *oper)
{
    memset(c, 0, sizeof(*c));
    c->w = w;
    freq(&c->e[0], cid, NULL, key);
    if (oper) {
        c->e[0].cmd.operator_ = (char *)oper;
        c->e[0].ev.operator_ = (char *)oper;
    }
    fstatus(&c->e[1], cid, "CommandDispatched", 1, "agent-1");
    c->se[0].event = &c->e[0].ev;
    c->se[1].event = &c->e[1].ev;
    c->wr.stream_id = c->e[0].stream;
    c->wr.expected_version = STORE_NO_STREAM;
    c->wr.events = c->se;
    c->wr.n = 2;
}

/* A claim (CommandStarted by agent) at version `at`. */
static void
w_claim(struct wcall *c, struct store_writer *w, const char *cid,
        const char *agent, int64_t at)
{
    memset(c, 0, sizeof(*c));
    c->w = w;
    fstatus(&c->e[0], cid, "CommandStarted", 1, agent);
    c->se[0].event = &c->e[0].ev;
    c->wr.stream_id = c->e[0].stream;
    c->wr.expected_version = at;
    c->wr.events = c->se;
    c->wr.n = 1;
    c->wr.claim_agent = agent;
}

/* An agent's result, decided against Running on agent-1 at `at`. */
static void
w_result(struct wcall *c, struct store_writer *w, const char *cid,
         int64_t at, int exit_code)
{
    memset(c, 0, sizeof(*c));
    c->w = w;
    fresult(&c->e[0], cid, "CommandCompleted",
            exit_code ? KS__COMMAND_STATUS__FAILED
                      : KS__COMMAND_STATUS__SUCCEEDED,
            exit_code, exit_code ? "bad\n" : "good\n");
    c->e[0].ev.agent_id = "agent-1";
    c->checked = true;
    c->known.exists = true;
    c->known.status = KS__COMMAND_STATUS__RUNNING;
    snprintf(c->known.agent_id, sizeof(c->known.agent_id), "agent-1");
    c->known.attempt = 1;
    c->at = at;
}

/* Opaque event on a stream of its own kind at STORE_ANY. */
static void
w_opaque(struct wcall *c, struct store_writer *w, const char *stream)
{
    memset(c, 0, sizeof(*c));
    c->w = w;
    ks__event__init(&c->e[0].ev);
    ks_uuid(c->e[0].id);
    snprintf(c->e[0].stream, sizeof(c->e[0].stream), "%s", stream);
    c->e[0].ev.event_id = c->e[0].id;
    c->e[0].ev.stream_id = c->e[0].stream;
    c->e[0].ev.type = "Opaque";
    c->se[0].event = &c->e[0].ev;
    c->wr.stream_id = c->e[0].stream;
    c->wr.expected_version = STORE_ANY;
    c->wr.events = c->se;
    c->wr.n = 1;
}

/* Each append alone: the codes store_append / store_append_claim give,
 * and the rows they make. */
START_TEST(test_writer_verdicts_alone)
{
    struct store *s = open_store();
    struct store_writer *w = open_writer();
    struct wcall c, d;
    char cid[37], other[37], stream[64];

    ks_uuid(cid);
    snprintf(stream, sizeof(stream), "command-%s", cid);
    w_dispatch(&c, w, cid, NULL, NULL);
    wcall_run(&c);
    ck_assert_int_eq(c.rc, 0);
    ck_assert_int_eq(c.res.version, 2);
    assert_row(s, cid, "Dispatched/2/1/agent-1/-/false/false");
    /* The same record again (a lost commit answer, asked again). */
    wcall_run(&c);
    ck_assert_int_eq(c.rc, KS_EDUPLICATE);
    ck_assert_int_eq(c.res.version, 2);
    /* Claims: another agent's, an unrecorded command, a wrong version. */
    w_claim(&d, w, cid, "agent-2", 2);
    wcall_run(&d);
    ck_assert_int_eq(d.rc, KS_EDENIED);
    ks_uuid(other);
    w_claim(&d, w, other, "agent-1", 2);
    wcall_run(&d);
    ck_assert_int_eq(d.rc, KS_ENOTFOUND);
    ck_assert_int_eq(
        sql_ll(s, "SELECT count(*) FROM streams WHERE stream_id = 'command-%s'",
               other),
        0);
    w_claim(&d, w, cid, "agent-1", 3);
    wcall_run(&d);
    ck_assert_int_eq(d.rc, KS_ECONFLICT);
    w_claim(&d, w, cid, "agent-1", 2);
    wcall_run(&d);
    ck_assert_int_eq(d.rc, 0);
    ck_assert_int_eq(d.res.version, 3);
    assert_row(s, cid, "Running/3/1/agent-1/-/true/false");
    wcall_run(&d); /* the claim retried: still its own */
    ck_assert_int_eq(d.rc, KS_EDUPLICATE);
    ck_assert_int_eq(d.res.version, 3);
    w_claim(&d, w, cid, "agent-1", 2); /* a second claim: lost */
    wcall_run(&d);
    ck_assert_int_eq(d.rc, KS_ECONFLICT);
    /* The result at the claim's version, then a late one. */
    w_result(&c, w, cid, 3, 0);
    wcall_run(&c);
    ck_assert_int_eq(c.rc, 0);
    ck_assert_int_eq(c.res.version, 4);
    assert_row(s, cid, "Succeeded/4/1/agent-1/good\n/true/true");
    w_result(&c, w, cid, 3, 1);
    wcall_run(&c);
    ck_assert_int_eq(c.rc, KS_ECONFLICT);
    ck_assert_int_eq(count_type(s, stream, "CommandCompleted"), 1);
    ck_assert_int_eq(count_type(s, stream, "CommandStarted"), 1);
    /* Checked on the caller's thread: nothing queued. */
    w_claim(&d, w, cid, "agent-1", 2);
    d.wr.stream_id = "operator-x";
    wcall_run(&d);
    ck_assert_int_eq(d.rc, KS_EINVAL);
    store_writer_close(w);
    store_close(s);
}
END_TEST

/* The backend pid of the writer's connection waiting for a lock (0: none
 * yet). */
static long
waiting_writer(struct store *s)
{
    return sql_ll(s,
                  "SELECT coalesce(max(pid), 0) FROM pg_stat_activity"
                  " WHERE wait_event_type = 'Lock'"
                  " AND application_name = 'kscore writer'%s",
                  "");
}

/*
 * Holds the streams row of stream in an open transaction of its own
 * connection, so that the writer's next transaction that moves it waits:
 * the appends queued meanwhile all go into the transaction after it.
 */
static PGconn *
hold_stream(const char *stream)
{
    PGconn *h = PQconnectdb(pg.conninfo);
    char sql[256];
    ck_assert_int_eq(PQstatus(h), CONNECTION_OK);
    snprintf(sql, sizeof(sql),
             "BEGIN; SELECT 1 FROM streams WHERE stream_id = '%s' FOR UPDATE",
             stream);
    exec_ok(h, sql);
    return h;
}

/* Starts c on a thread once the writer waits behind the held stream. */
static void
start_queued(pthread_t *t, struct wcall *c)
{
    ck_assert_int_eq(pthread_create(t, NULL, wcall_run, c), 0);
}

static void
wait_queued(uint64_t appends)
{
    for (int i = 0; i < 1000 &&
                    ks_metric_counter_value(KS_C_WRITER_APPENDS) < appends;
         i++)
        usleep(5000);
    /* Counted once in the queue (and the writer, held, takes the queue
     * only after the test lets it go). */
    ck_assert_uint_ge(ks_metric_counter_value(KS_C_WRITER_APPENDS), appends);
}

/* First: an append that waits behind the held stream. Returns its
 * thread. */
static void
block_writer(struct store *s, struct store_writer *w, struct wcall *first,
             const char *held_stream, pthread_t *t)
{
    w_opaque(first, w, held_stream);
    first->wr.expected_version = 1;
    start_queued(t, first);
    for (int i = 0; i < 1000 && !waiting_writer(s); i++)
        usleep(5000);
    ck_assert_msg(waiting_writer(s), "the writer never waited");
}

/*
 * Many appends queued while the writer waits, so they share one
 * transaction: conflicts inside it (two claims of one command, two results
 * of one command, two dispatches with one idempotency key, a claim of a
 * command requested in the same transaction) each get their own verdict,
 * and none fails the others.
 */
START_TEST(test_writer_group_verdicts)
{
    enum { NCMD = 12, NCALL = 64 };
    struct store *s = open_store();
    struct store_writer *w = open_writer();
    static struct wcall pre[NCMD + 4], calls[NCALL], first;
    pthread_t th[NCALL], t0;
    char cids[NCMD][37], held[64], fresh[37], unrec[37], misc[64], key[40];
    size_t nc = 0;

    /* Set-up, one at a time: NCMD dispatched commands, one of them claimed
     * and one running (for the results). */
    for (int i = 0; i < NCMD; i++) {
        ks_uuid(cids[i]);
        w_dispatch(&pre[i], w, cids[i], NULL, NULL);
        wcall_run(&pre[i]);
        ck_assert_int_eq(pre[i].rc, 0);
    }
    w_claim(&pre[NCMD], w, cids[0], "agent-1", 2); /* claimed: retried below */
    wcall_run(&pre[NCMD]);
    ck_assert_int_eq(pre[NCMD].rc, 0);
    w_claim(&pre[NCMD + 1], w, cids[1], "agent-1", 2); /* running */
    wcall_run(&pre[NCMD + 1]);
    ck_assert_int_eq(pre[NCMD + 1].rc, 0);
    ks_uuid(held);
    memmove(held + 5, held, 37);
    memcpy(held, "held-", 5);
    w_opaque(&pre[NCMD + 2], w, held);
    wcall_run(&pre[NCMD + 2]);
    ck_assert_int_eq(pre[NCMD + 2].rc, 0);

    PGconn *h = hold_stream(held);
    uint64_t tx0 = ks_metric_counter_value(KS_C_WRITER_TRANSACTIONS);
    uint64_t ap0 = ks_metric_counter_value(KS_C_WRITER_APPENDS);
    block_writer(s, w, &first, held, &t0);

    /* The retried claim of cids[0] (its event recorded): a duplicate. */
    calls[nc] = pre[NCMD];
    calls[nc++].done = false;
    /* Two results of cids[1] at the claim's version: one wins. */
    w_result(&calls[nc++], w, cids[1], 3, 0);
    w_result(&calls[nc++], w, cids[1], 3, 1);
    /* cids[2..NCMD): claims; on cids[2..5] two rival claims each. */
    for (int i = 2; i < NCMD; i++) {
        w_claim(&calls[nc++], w, cids[i], "agent-1", 2);
        if (i < 6)
            w_claim(&calls[nc++], w, cids[i], "agent-1", 2);
    }
    size_t rivals_end = nc;
    /* Another agent's claim of a dispatched command (cids[2]'s). */
    w_claim(&calls[nc++], w, cids[2], "agent-2", 2);
    size_t denied = nc - 1;
    /* A claim of a command never recorded. */
    ks_uuid(unrec);
    w_claim(&calls[nc++], w, unrec, "agent-1", 2);
    size_t notfound = nc - 1;
    /* A command dispatched and claimed in this same transaction. */
    ks_uuid(fresh);
    w_dispatch(&calls[nc++], w, fresh, NULL, NULL);
    size_t fresh_disp = nc - 1;
    w_claim(&calls[nc++], w, fresh, "agent-1", 2);
    size_t fresh_claim = nc - 1;
    /* Two dispatches with one idempotency key of one operator, and the
     * same key of another operator. */
    snprintf(key, sizeof(key), "key-%d", (int)getpid());
    {
        char c1[37], c2[37], c3[37];
        ks_uuid(c1);
        ks_uuid(c2);
        ks_uuid(c3);
        w_dispatch(&calls[nc++], w, c1, key, "carol");
        w_dispatch(&calls[nc++], w, c2, key, "carol");
        w_dispatch(&calls[nc++], w, c3, key, "dave");
    }
    size_t keys_end = nc;
    /* A stale expected version. */
    w_claim(&calls[nc++], w, cids[NCMD - 1], "agent-1", 7);
    size_t stale = nc - 1;
    ck_assert_uint_le(nc, NCALL);

    /* Everything but the claim of the fresh command, then that claim: it
     * is queued after its command's record (threads started one after
     * the other may queue in any order). */
    for (size_t i = 0; i < nc; i++)
        if (i != fresh_claim)
            start_queued(&th[i], &calls[i]);
    wait_queued(ap0 + nc);
    start_queued(&th[fresh_claim], &calls[fresh_claim]);
    wait_queued(ap0 + 1 + nc);
    for (size_t i = 0; i < nc; i++)
        ck_assert_msg(!calls[i].done, "call %zu finished before the release",
                      i);
    exec_ok(h, "COMMIT");
    PQfinish(h);
    pthread_join(t0, NULL);
    ck_assert_int_eq(first.rc, 0);
    for (size_t i = 0; i < nc; i++)
        pthread_join(th[i], NULL);
    /* One transaction for the waiting append, one for all the rest: no
     * append failed the group (that would have written them one by
     * one). */
    ck_assert_uint_eq(ks_metric_counter_value(KS_C_WRITER_TRANSACTIONS),
                      tx0 + 2);

    ck_assert_int_eq(calls[0].rc, KS_EDUPLICATE);
    ck_assert_int_eq(calls[0].res.version, 3);
    ck_assert_msg((calls[1].rc == 0) != (calls[2].rc == 0),
                  "two results: %d %d", calls[1].rc, calls[2].rc);
    ck_assert_int_eq(calls[1].rc + calls[2].rc, KS_ECONFLICT);
    {
        char stream[64];
        snprintf(stream, sizeof(stream), "command-%s", cids[1]);
        ck_assert_int_eq(count_type(s, stream, "CommandCompleted"), 1);
        assert_row(s, cids[1],
                   calls[1].rc == 0 ? "Succeeded/4/1/agent-1/good\n/true/true"
                                    : "Failed/4/1/agent-1/bad\n/true/true");
    }
    /* Claims: one per command, the rival lost. */
    for (int i = 2; i < NCMD; i++) {
        char stream[64];
        int won = 0, lost = 0;
        snprintf(stream, sizeof(stream), "command-%s", cids[i]);
        for (size_t k = 3; k < rivals_end; k++)
            if (strcmp(calls[k].e[0].cid, cids[i]) == 0) {
                won += calls[k].rc == 0;
                lost += calls[k].rc == KS_ECONFLICT;
                if (calls[k].rc == 0)
                    ck_assert_int_eq(calls[k].res.version, 3);
            }
        ck_assert_int_eq(won, 1);
        ck_assert_int_eq(lost, i < 6 ? 1 : 0);
        ck_assert_int_eq(count_type(s, stream, "CommandStarted"), 1);
        assert_row(s, cids[i], "Running/3/1/agent-1/-/true/false");
    }
    ck_assert_int_eq(calls[denied].rc, KS_EDENIED);
    ck_assert_int_eq(calls[notfound].rc, KS_ENOTFOUND);
    ck_assert_int_eq(
        sql_ll(s, "SELECT count(*) FROM streams WHERE stream_id = 'command-%s'",
               unrec),
        0);
    ck_assert_int_eq(calls[fresh_disp].rc, 0);
    ck_assert_int_eq(calls[fresh_claim].rc, 0);
    ck_assert_int_eq(calls[fresh_claim].res.version, 3);
    assert_row(s, fresh, "Running/3/1/agent-1/-/true/false");
    {
        int won = 0;
        for (size_t k = keys_end - 3; k < keys_end - 1; k++) {
            won += calls[k].rc == 0;
            ck_assert(calls[k].rc == 0 || calls[k].rc == KS_ECONFLICT);
        }
        ck_assert_int_eq(won, 1);
        ck_assert_int_eq(calls[keys_end - 1].rc, 0); /* another operator */
        ck_assert_int_eq(
            sql_ll(s,
                   "SELECT count(*) FROM commands WHERE idempotency_key = '%s'",
                   key),
            2);
    }
    ck_assert_int_eq(calls[stale].rc, KS_ECONFLICT);
    /* Appends at any version (numbered by the server: each written
     * alone), several at once on one stream: each its own version. */
    ks_uuid(misc + 5);
    memcpy(misc, "misc-", 5);
    for (int i = 0; i < 5; i++) {
        w_opaque(&calls[i], w, misc);
        start_queued(&th[i], &calls[i]);
    }
    {
        bool seen[6] = {0};
        for (int k = 0; k < 5; k++) {
            pthread_join(th[k], NULL);
            ck_assert_int_eq(calls[k].rc, 0);
            ck_assert(calls[k].res.version >= 1 && calls[k].res.version <= 5);
            ck_assert(!seen[calls[k].res.version]);
            seen[calls[k].res.version] = true;
        }
        ck_assert_int_eq(
            sql_ll(s, "SELECT version FROM streams WHERE stream_id = '%s'",
                   misc),
            5);
    }
    /* Every stream's version is its last event's; replay agrees. */
    ck_assert_int_eq(
        sql_ll(s,
               "SELECT count(*) FROM streams st WHERE st.version > 0 AND"
               " st.version <> (SELECT max(version) FROM events e"
               " WHERE e.stream_id = st.stream_id)%s",
               ""),
        0);
    assert_replay_equal(s);
    store_writer_close(w);
    store_close(s);
}
END_TEST

/* The writer's idle connection ended (it reconnects at its next
 * append). */
static void
end_writer_session(struct store *s)
{
    ck_assert_int_ge(
        sql_ll(s,
               "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
               " WHERE application_name = 'kscore writer'"
               " AND state = 'idle'%s",
               ""),
        1);
    usleep(100 * 1000);
}

static void
set_read_only(struct store *s, bool on)
{
    char sql[256], *db = sql1(s, "SELECT current_database()");
    snprintf(sql, sizeof(sql),
             "ALTER DATABASE \"%s\" %s default_transaction_read_only%s", db,
             on ? "SET" : "RESET", on ? " = on" : "");
    free(db);
    exec_ok(store_pgconn(s), sql);
}

/*
 * The database refuses a group mid-way (its statement canceled while it
 * waits, SQLSTATE 57014, as statement_timeout does): every append of the
 * group is told so (KS_EPGREFUSED, not in doubt) and nothing of it is
 * written, and the same appends asked again are. So is a database that
 * refuses writes (read-only, 25006). A connection lost while a group's
 * transaction is open leaves its appends in doubt instead (their commit's
 * answer can never come), and the writer reconnects for the next.
 */
START_TEST(test_writer_sick_mid_group)
{
    enum { N = 8 };
    struct store *s = open_store();
    struct store_writer *w = open_writer();
    static struct wcall calls[N + 1], first, pre[2];
    pthread_t th[N + 1], t0;
    char held[2][64], cid[N][37];

    for (int i = 0; i < 2; i++) {
        ks_uuid(held[i] + 5);
        memcpy(held[i], "held-", 5);
        w_opaque(&pre[i], w, held[i]);
        wcall_run(&pre[i]);
        ck_assert_int_eq(pre[i].rc, 0);
    }
    /* The first append waits for held[0]; the group queued behind it
     * holds an append of held[1], where it waits in turn, mid-way. */
    PGconn *h0 = hold_stream(held[0]), *h1 = hold_stream(held[1]);
    uint64_t ap0 = ks_metric_counter_value(KS_C_WRITER_APPENDS);
    block_writer(s, w, &first, held[0], &t0);
    for (int i = 0; i < N; i++) {
        ks_uuid(cid[i]);
        w_dispatch(&calls[i], w, cid[i], NULL, NULL);
        start_queued(&th[i], &calls[i]);
    }
    w_opaque(&calls[N], w, held[1]);
    calls[N].wr.expected_version = 1;
    start_queued(&th[N], &calls[N]);
    wait_queued(ap0 + 2 + N);
    exec_ok(h0, "COMMIT");
    pthread_join(t0, NULL);
    ck_assert_int_eq(first.rc, 0);
    for (int i = 0; i < 1000 && !waiting_writer(s); i++)
        usleep(5000);
    {
        char sql[128];
        snprintf(sql, sizeof(sql), "SELECT pg_cancel_backend(%ld)",
                 waiting_writer(s));
        exec_ok(store_pgconn(s), sql);
    }
    for (int i = 0; i <= N; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(calls[i].rc, KS_EPGREFUSED);
        ck_assert(!calls[i].res.in_doubt);
        ck_assert_str_eq(calls[i].res.sqlstate, "57014");
        ck_assert(calls[i].res.error[0]);
    }
    exec_ok(h1, "COMMIT");
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(
            sql_ll(s,
                   "SELECT count(*) FROM streams WHERE stream_id ="
                   " 'command-%s'",
                   cid[i]),
            0);
    for (int i = 0; i <= N; i++) {
        wcall_run(&calls[i]);
        ck_assert_int_eq(calls[i].rc, 0);
        if (i < N)
            assert_row(s, cid[i], "Dispatched/2/1/agent-1/-/false/false");
    }

    /* Read-only: the writer's new session refuses, then takes writes. */
    set_read_only(s, true);
    end_writer_session(s);
    for (int i = 0; i < N; i++) {
        ks_uuid(cid[i]);
        w_dispatch(&calls[i], w, cid[i], NULL, NULL);
        start_queued(&th[i], &calls[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(calls[i].rc, KS_EPGREFUSED);
        ck_assert_str_eq(calls[i].res.sqlstate, "25006");
        ck_assert(!calls[i].res.in_doubt);
    }
    set_read_only(s, false);
    end_writer_session(s);
    for (int i = 0; i < N; i++) {
        ck_assert_int_eq(
            sql_ll(s,
                   "SELECT count(*) FROM events WHERE stream_id ="
                   " 'command-%s'",
                   cid[i]),
            0);
        wcall_run(&calls[i]);
        ck_assert_int_eq(calls[i].rc, 0);
    }

    /* Killed mid-transaction: in doubt, nothing written, and on. */
    h0 = PQconnectdb(pg.conninfo);
    {
        char sql[256];
        snprintf(sql, sizeof(sql),
                 "BEGIN; SELECT 1 FROM streams WHERE stream_id = '%s'"
                 " FOR UPDATE",
                 held[0]);
        exec_ok(h0, sql);
    }
    w_opaque(&first, w, held[0]);
    first.wr.expected_version = 2;
    start_queued(&t0, &first);
    for (int i = 0; i < 1000 && !waiting_writer(s); i++)
        usleep(5000);
    {
        char sql[128];
        snprintf(sql, sizeof(sql), "SELECT pg_terminate_backend(%ld)",
                 waiting_writer(s));
        exec_ok(store_pgconn(s), sql);
    }
    pthread_join(t0, NULL);
    ck_assert_int_eq(first.rc, KS_EPGDOWN);
    ck_assert(first.res.in_doubt);
    exec_ok(h0, "COMMIT");
    PQfinish(h0);
    PQfinish(h1);
    ck_assert_int_eq(
        sql_ll(s, "SELECT version FROM streams WHERE stream_id = '%s'",
               held[0]),
        2);
    wcall_run(&first); /* asked again: written now */
    ck_assert_int_eq(first.rc, 0);
    ck_assert_int_eq(first.res.version, 3);
    store_writer_close(w);
    store_close(s);
}
END_TEST

/*
 * A batch of reports that meets a writer holding one of its commands: the
 * batch waits for it and is decided against what it committed (here: the
 * command ended meanwhile, so its result is late), never against the state
 * before. The batch path decides without locks first and checks at the
 * append; the locking path once re-read the joined commands row stale.
 * (The writer's events are real ones: replay must rebuild the same.)
 */
START_TEST(test_append_checked_meets_a_writer)
{
    struct store *s = open_store();
    static struct fev e[2];
    const Ks__Event *b[2];
    enum store_step v[2] = {99, 99};
    char c1[37], c2[37], sql[512];
    pthread_t t;

    ks_uuid(c1);
    ks_uuid(c2);
    running_command(s, c1);
    running_command(s, c2);
    b[0] = fresult(&e[0], c1, "CommandCompleted",
                   KS__COMMAND_STATUS__SUCCEEDED, 0, "one");
    e[0].ev.agent_id = "agent-1";
    b[1] = fresult(&e[1], c2, "CommandCompleted",
                   KS__COMMAND_STATUS__SUCCEEDED, 0, "two");
    e[1].ev.agent_id = "agent-1";
    /* The writer: an append that ends c1 (the scanner's CommandLost),
     * its transaction held open. */
    struct store *w = open_store();
    static struct fev lost;
    struct store_event le = {fstatus(&lost, c1, "CommandLost", 1, "agent-1")};
    exec_ok(store_pgconn(w), "BEGIN");
    ck_assert_int_eq(store_append(w, lost.stream, STORE_ANY, &le, 1, NULL),
                     0);
    struct checked_call call = {b, 2, v, 99};
    ck_assert_int_eq(pthread_create(&t, NULL, checked_thread, &call), 0);
    /* Until the batch waits on the writer's lock. */
    for (int i = 0; i < 500; i++) {
        if (sql_ll(s, "SELECT count(*) FROM pg_locks WHERE NOT granted%s",
                   "") > 0)
            break;
        usleep(10000);
    }
    exec_ok(store_pgconn(w), "COMMIT");
    pthread_join(t, NULL);
    store_close(w);
    ck_assert_int_eq(call.rc, 0);
    ck_assert_int_eq(v[0], STORE_STEP_LATE);
    ck_assert_int_eq(v[1], STORE_STEP_APPLY);
    ck_assert_int_eq(count_type(s, e[0].stream, "LateResult"), 1);
    ck_assert_int_eq(count_type(s, e[0].stream, "CommandCompleted"), 0);
    ck_assert_int_eq(count_type(s, e[1].stream, "CommandCompleted"), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s'"
             " AND status = 'Lost'",
             c1);
    ck_assert_int_eq(sql_ll(s, "%s", sql), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s'"
             " AND status = 'Succeeded'",
             c2);
    ck_assert_int_eq(sql_ll(s, "%s", sql), 1);
    store_close(s);
}
END_TEST

START_TEST(test_append_many_refused)
{
    struct store *s = open_store();
    static struct fev e[8];
    Ks__Event *b[8];
    char c1[37], c2[37], key[37], stream[64];
    size_t n = 0, dups;
    int64_t v;

    ks_uuid(c1);
    ks_uuid(c2);
    ks_uuid(key);
    /* Two commands with one idempotency key: refused, nothing written. */
    b[n++] = freq(&e[0], c1, NULL, key);
    b[n++] = fstatus(&e[1], c1, "CommandDispatched", 1, "agent-1");
    b[n++] = freq(&e[2], c2, NULL, key);
    ck_assert_int_eq(many(s, b, n, &dups), KS_ECONFLICT);
    snprintf(stream, sizeof(stream), "command-%s", c1);
    ck_assert_int_eq(store_stream_version(s, stream, &v), 0);
    ck_assert_int_eq(v, 0);
    assert_row(s, c1, "");
    /* Without the second: recorded. */
    ck_assert_int_eq(many(s, b, 2, &dups), 0);
    assert_row(s, c1, "Dispatched/2/1/agent-1/-/false/false");
    /* A second CommandRequested of a command: refused, in one batch or
     * against a row recorded before. */
    n = 0;
    b[n++] = freq(&e[3], c2, NULL, NULL);
    b[n++] = freq(&e[4], c2, NULL, NULL);
    ck_assert_int_eq(many(s, b, n, &dups), KS_ECONFLICT);
    assert_row(s, c2, "");
    n = 0;
    b[n++] = fstatus(&e[5], c1, "CommandStarted", 1, NULL);
    b[n++] = freq(&e[6], c1, NULL, NULL);
    ck_assert_int_eq(many(s, b, n, &dups), KS_ECONFLICT);
    assert_row(s, c1, "Dispatched/2/1/agent-1/-/false/false");
    store_close(s);
}
END_TEST

START_TEST(test_append_many_batch_order)
{
    struct store *s = open_store();
    static struct fev e[4];
    Ks__Event *b[4];
    char c1[37], bid[37], sql[256], *row;
    size_t n = 0, dups;

    /* A batch completed before its command is requested, in one call:
     * the completion finds no row, as event by event. */
    ks_uuid(c1);
    ks_uuid(bid);
    fmk(&e[0], c1, "BatchCompleted");
    snprintf(e[0].stream, sizeof(e[0].stream), "batch-%s", bid);
    snprintf(e[0].bid, sizeof(e[0].bid), "%s", bid);
    e[0].ev.batch_id = e[0].bid;
    e[0].ev.command_id = "";
    b[n++] = &e[0].ev;
    b[n++] = freq(&e[1], c1, bid, NULL);
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    snprintf(sql, sizeof(sql),
             "SELECT status || total FROM batches WHERE batch_id = '%s'", bid);
    row = sql1(s, sql);
    ck_assert_str_eq(row, "Running1");
    free(row);
    assert_replay_equal(s);
    store_close(s);
}
END_TEST

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---- the writer against one connection per thread (a measurement) ---- */

struct wbench {
    struct store_writer *w; /* NULL: store_append on a connection each */
    int commands;
    int64_t us;
};

static void *
wbench_thread(void *arg)
{
    struct wbench *b = arg;
    struct store *s = b->w ? NULL : open_store();
    struct wcall c;
    int64_t t0 = ks_mono_us();

    for (int i = 0; i < b->commands; i++) {
        char cid[37];
        ks_uuid(cid);
        w_dispatch(&c, b->w, cid, NULL, NULL);
        if (s)
            c.rc = store_append(s, c.wr.stream_id, STORE_NO_STREAM, c.se, 2,
                                NULL);
        else
            wcall_run(&c);
        ck_assert_msg(c.rc == 0, "%s: %s", ks_err_name(c.rc), c.res.error);
        w_claim(&c, b->w, cid, "agent-1", 2);
        if (s)
            c.rc = store_append_claim(s, c.wr.stream_id, 2, "agent-1", c.se,
                                      NULL);
        else
            wcall_run(&c);
        ck_assert_msg(c.rc == 0, "%s: %s", ks_err_name(c.rc), c.res.error);
        w_result(&c, b->w, cid, 3, 0);
        if (s)
            c.rc = store_append_checked_at(s, &c.e[0].ev, &c.known, 3, NULL,
                                           NULL);
        else
            wcall_run(&c);
        ck_assert_msg(c.rc == 0, "%s: %s", ks_err_name(c.rc), c.res.error);
    }
    b->us = ks_mono_us() - t0;
    store_close(s);
    return NULL;
}

/* CPU (us) of the suite's PostgreSQL: the postmaster with what it
 * reaped, and its live backends. */
static int64_t
pg_cpu_us(void)
{
    unsigned long long t[4] = {0}, sum = 0;
    char path[64], buf[1024], *p;
    long tck = sysconf(_SC_CLK_TCK);
    struct dirent *e;
    DIR *d = opendir("/proc");

    while (d && (e = readdir(d))) {
        long pid = atol(e->d_name), ppid = 0;
        FILE *f;
        size_t n;
        if (pid <= 0)
            continue;
        snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
        if (!(f = fopen(path, "re")))
            continue;
        n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        if (!(p = strrchr(buf, ')')) ||
            sscanf(p + 2, "%*c %ld %*d %*d %*d %*d %*u %*u %*u %*u %*u"
                          " %llu %llu %llu %llu",
                   &ppid, &t[0], &t[1], &t[2], &t[3]) != 5)
            continue;
        if (pid == pg.pid)
            sum += t[0] + t[1] + t[2] + t[3];
        else if (ppid == pg.pid)
            sum += t[0] + t[1];
    }
    if (d)
        closedir(d);
    return (int64_t)(sum * 1000000ULL / (unsigned long long)tck);
}

/* Not an assertion: prints what this machine does. */
START_TEST(test_writer_bench)
{
    enum { MAXT = 64 };
    int THREADS = getenv("WTW_THREADS") ? atoi(getenv("WTW_THREADS")) : 16;
    int PER = 640 / THREADS;
    static struct wbench b[MAXT];
    pthread_t th[MAXT];

    store_close(open_store()); /* migrated */
    /* A connection each, then writers of 1, 2 and 4 connections. */
    unsigned conns[16] = {0, 1, 2, 4, 0, 1, 2, 4};
    size_t nmodes = 8;
    if (getenv("WTW_MODES")) {
        char *m = getenv("WTW_MODES");
        for (nmodes = 0; *m && nmodes < 16; nmodes++) {
            conns[nmodes] = (unsigned)strtoul(m, &m, 10);
            if (*m == ',')
                m++;
        }
    }
    for (size_t mode = 0; mode < nmodes; mode++) {
        struct store_writer *w = NULL;
        if (conns[mode]) {
            char *err = NULL;
            ck_assert_int_eq(store_writer_open(pg.conninfo, conns[mode], &w,
                                               &err), 0);
        }
        uint64_t tx0 = ks_metric_counter_value(KS_C_WRITER_TRANSACTIONS);
        int64_t t0 = ks_mono_us(), cpu0 = pg_cpu_us();
        for (int i = 0; i < THREADS; i++) {
            b[i] = (struct wbench){.w = w, .commands = PER};
            ck_assert_int_eq(pthread_create(&th[i], NULL, wbench_thread,
                                            &b[i]), 0);
        }
        for (int i = 0; i < THREADS; i++)
            pthread_join(th[i], NULL);
        int64_t us = ks_mono_us() - t0, cpu = pg_cpu_us() - cpu0;
        uint64_t tx = ks_metric_counter_value(KS_C_WRITER_TRANSACTIONS) - tx0;
        printf("bench %s (%u): %d threads x %d commands (dispatch, claim,"
               " result) in %.0f ms = %.0f commands/s, PostgreSQL %.0f us of"
               " CPU a command%s",
               w ? "writer" : "a connection each", conns[mode], THREADS, PER,
               us / 1000.0,
               THREADS * PER * 1e6 / us, (double)cpu / (THREADS * PER),
               w ? "" : "\n");
        if (w)
            printf(", %.1f appends per transaction\n",
                   tx ? 3.0 * THREADS * PER / tx : 0);
        store_writer_close(w);
    }
}
END_TEST

/* Not an assertion: prints what this machine does (see the report). */
START_TEST(test_bench)
{
    struct store *s = open_store();
    enum { LAT = 400, BATCH = 1000, ROUNDS = 5 };
    static int64_t lat[LAT];
    static struct tev evs[BATCH];
    static char streams[BATCH / 4][64];
    const Ks__Event *batch[BATCH];
    char stream[64], u[37];

    for (int i = 0; i < LAT; i++) {
        struct tev t;
        ks_uuid(u);
        snprintf(stream, sizeof(stream), "bench-%s", u);
        mk(&t, stream, "Thing");
        int64_t t0 = ks_mono_us();
        ck_assert_int_eq(append1(s, &t.ev, STORE_NO_STREAM, NULL), 0);
        lat[i] = ks_mono_us() - t0;
    }
    qsort(lat, LAT, sizeof(lat[0]), cmp_i64);
    printf("bench store_append (1 event, new stream, fsync %s): p50 %.3f ms"
           " p95 %.3f ms p99 %.3f ms\n",
           getenv("KSCORE_PG_FAST") &&
                   strcmp(getenv("KSCORE_PG_FAST"), "1") == 0
               ? "off"
               : "on",
           lat[LAT / 2] / 1000.0, lat[LAT * 95 / 100] / 1000.0,
           lat[LAT * 99 / 100] / 1000.0);

    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < BATCH / 4; i++) {
            ks_uuid(u);
            snprintf(streams[i], sizeof(streams[i]), "command-%s", u);
        }
        /* Realistic mix: lifecycle events of 250 commands. */
        static Ks__Command cmds[BATCH / 4];
        static Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
        static char *argv[] = {"/bin/true"};
        static Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
        static Ks__Output out = KS__OUTPUT__INIT;
        static const char *types[] = {"CommandRequested", "CommandDispatched",
                                      "CommandStarted", "CommandCompleted"};
        spec.n_argv = 1;
        spec.argv = argv;
        out.data.data = (uint8_t *)"hello\n";
        out.data.len = 6;
        res.stdout = &out;
        res.has_exit_code = 1;
        res.status = KS__COMMAND_STATUS__SUCCEEDED;
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < BATCH / 4; i++) {
                struct tev *t = &evs[k * (BATCH / 4) + i];
                mk(t, streams[i], types[k]);
                t->ev.command_id = streams[i] + 8;
                t->ev.attempt = 1;
                if (k == 0) {
                    ks__command__init(&cmds[i]);
                    cmds[i].command_id = streams[i] + 8;
                    cmds[i].agent_id = "agent-1";
                    cmds[i].spec = &spec;
                    t->ev.command = &cmds[i];
                }
                if (k == 3)
                    t->ev.result = &res;
                batch[k * (BATCH / 4) + i] = &t->ev;
            }
        size_t dups;
        int64_t t0 = ks_mono_us();
        ck_assert_int_eq(store_append_many(s, batch, BATCH, &dups), 0);
        int64_t us = ks_mono_us() - t0;
        ck_assert_uint_eq(dups, 0);
        printf("bench store_append_many round %d: %d events (250 commands x"
               " 4 lifecycle events) in %.1f ms = %.0f events/s\n",
               round, BATCH, us / 1000.0, BATCH * 1e6 / us);
        /* The same, unknown types only (no projection work). */
        for (int i = 0; i < BATCH; i++) {
            ks_uuid(evs[i].id);
            evs[i].ev.type = "Opaque";
        }
        t0 = ks_mono_us();
        ck_assert_int_eq(store_append_many(s, batch, BATCH, &dups), 0);
        us = ks_mono_us() - t0;
        printf("bench store_append_many round %d: %d events, no projection"
               " in %.1f ms = %.0f events/s\n",
               round, BATCH, us / 1000.0, BATCH * 1e6 / us);
    }
    store_close(s);
}
END_TEST

/* Rows of events read so far by every session (pg_stat_user_tables), as
 * (sequential, through an index): after s's own pending counts are in
 * (pg_stat_force_next_flush: flushed when s's backend goes idle). */
static void
events_rows_read(struct store *s, long long *seq, long long *idx)
{
    PGconn *c = store_pgconn(s);
    PQclear(PQexec(c, "SELECT pg_stat_force_next_flush()"));
    PGresult *res = PQexec(
        c, "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)"
           " FROM pg_stat_user_tables WHERE relname = 'events'");
    ck_assert_msg(PQresultStatus(res) == PGRES_TUPLES_OK, "%s",
                  PQresultErrorMessage(res));
    *seq = atoll(PQgetvalue(res, 0, 0));
    *idx = atoll(PQgetvalue(res, 0, 1));
    PQclear(res);
}

/*
 * Where `events --follow` starts (store_cursor_at): at now, or after the
 * last event recorded before a time, found without reading the history
 * before it, and never past a transaction still open.
 */
START_TEST(test_cursor_at)
{
    struct store *r = open_store(), *a = open_store(), *b = open_store();
    struct store_cursor cur, zero = {0};
    struct ordered seen = {0};
    struct tev old_one, recent[3], held, later, last;
    char stream[64], u[37];
    uint8_t *data;
    size_t len;
    long long seq0, idx0, seq1, idx1;
    PGresult *res;

    /* A history of 20,000 events recorded two hours ago. */
    ck_assert_int_eq(kproto_pack(&mk(&old_one, "hist", "Thing")->base, &data,
                                 &len),
                     0);
    {
        const char *vals[1] = {(const char *)data};
        int lens[1] = {(int)len}, fmts[1] = {1};
        res = PQexecParams(
            store_pgconn(b),
            "INSERT INTO events (stream_id, version, event_id, type, data,"
            " recorded_at) SELECT 'hist-' || g, 1, gen_random_uuid(),"
            " 'Thing', $1, now() - interval '2 hours'"
            " FROM generate_series(1, 20000) g",
            1, NULL, vals, lens, fmts, 0);
        ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK, "%s",
                      PQresultErrorMessage(res));
        PQclear(res);
    }
    free(data);
    ks_uuid(u);
    snprintf(stream, sizeof(stream), "at-%s", u);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(
            append1(b, mk(&recent[i], stream, "Thing"), STORE_ANY, NULL), 0);
    /* Held open across the start: its event must not be skipped. */
    PQclear(PQexec(store_pgconn(a), "BEGIN"));
    ck_assert_int_eq(append1(a, mk(&held, "at-held", "Thing"), STORE_ANY,
                             NULL),
                     0);
    ck_assert_int_eq(append1(b, mk(&later, stream, "Thing"), STORE_ANY, NULL),
                     0);

    /* The counters see what a query reads: a scan of the history. */
    events_rows_read(r, &seq0, &idx0);
    PQclear(PQexec(store_pgconn(r),
                   "SELECT count(*) FROM events WHERE data = ''"));
    events_rows_read(r, &seq1, &idx1);
    ck_assert_int_ge(seq1 - seq0 + idx1 - idx0, 20000);

    /* Now: nothing of the history is read to find it. */
    events_rows_read(r, &seq0, &idx0);
    ck_assert_int_eq(store_cursor_at(r, 0, &cur), 0);
    events_rows_read(r, &seq1, &idx1);
    ck_assert_int_eq(seq1 - seq0, 0);
    ck_assert_int_eq(idx1 - idx0, 0);
    ck_assert(cur.tx_id != 0);
    PQclear(PQexec(store_pgconn(a), "COMMIT"));
    ck_assert_int_eq(append1(b, mk(&last, stream, "Thing"), STORE_ANY, NULL),
                     0);
    events_rows_read(r, &seq0, &idx0);
    read_pages(r, &cur, &seen);
    events_rows_read(r, &seq1, &idx1);
    ck_assert_int_eq(seq1 - seq0, 0);
    ck_assert_int_lt(idx1 - idx0, 100); /* what it returned, not 20,000 */
    ck_assert_int_eq(ordered_find(&seen, old_one.id), -1);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(ordered_find(&seen, recent[i].id), -1);
    ck_assert_int_ge(ordered_find(&seen, held.id), 0);
    ck_assert_int_ge(ordered_find(&seen, last.id), 0);
    ck_assert_int_lt(seen.n, 20);

    /* An hour ago: after the history, found by walking back from the
     * end, not through the history. */
    events_rows_read(r, &seq0, &idx0);
    ck_assert_int_eq(store_cursor_at(r, ks_now_us() - 3600 * INT64_C(1000000),
                                     &cur),
                     0);
    events_rows_read(r, &seq1, &idx1);
    ck_assert_int_eq(seq1 - seq0, 0);
    ck_assert_int_lt(idx1 - idx0, 100);
    free(seen.ids);
    free(seen.tx);
    free(seen.pos);
    seen = (struct ordered){0};
    read_pages(r, &cur, &seen);
    ck_assert_int_eq(ordered_find(&seen, old_one.id), -1);
    for (int i = 0; i < 3; i++)
        ck_assert_int_ge(ordered_find(&seen, recent[i].id), 0);
    ck_assert_int_ge(ordered_find(&seen, held.id), 0);
    ck_assert_int_ge(ordered_find(&seen, later.id), 0);
    ck_assert_int_ge(ordered_find(&seen, last.id), 0);
    ck_assert_int_lt(seen.n, 20);

    /* Before anything was recorded: the first event. */
    ck_assert_int_eq(store_cursor_at(r, INT64_C(1000000), &cur), 0);
    ck_assert(cur.tx_id == zero.tx_id && cur.global_pos == zero.global_pos);
    free(seen.ids);
    free(seen.tx);
    free(seen.pos);
    store_close(a);
    store_close(b);
    store_close(r);
}
END_TEST

int
main(void)
{
    Suite *su = suite_create("store");
    TCase *tc = tcase_create("pg");
    SRunner *sr;
    int failed, rc;

    rc = fixture_pg_start(&pg);
    if (rc < 0) {
        fprintf(stderr, "cannot start PostgreSQL: %s\n", ks_strerror(rc));
        return 1;
    }
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_migrate_idempotent);
    tcase_add_test(tc, test_append_nostream_then_exact);
    tcase_add_test(tc, test_conflict_writes_nothing);
    tcase_add_test(tc, test_concurrent_appends);
    tcase_add_test(tc, test_duplicate_event_id);
    tcase_add_test(tc, test_append_many_duplicates);
    tcase_add_test(tc, test_command_projection);
    tcase_add_test(tc, test_read_all_late_commit);
    tcase_add_test(tc, test_read_all_xid_order);
    tcase_add_test(tc, test_read_all_passes_other_transactions);
    tcase_add_test(tc, test_append_locks_events_first);
    tcase_add_test(tc, test_wait_notify);
    tcase_add_test(tc, test_writer_verdicts_alone);
    tcase_add_test(tc, test_writer_group_verdicts);
    tcase_add_test(tc, test_writer_sick_mid_group);
    tcase_add_test(tc, test_replay_equality);
    tcase_add_test(tc, test_append_many_fold);
    tcase_add_test(tc, test_append_many_refused);
    tcase_add_test(tc, test_one_terminal_event);
    tcase_add_test(tc, test_command_machine);
    tcase_add_test(tc, test_append_checked);
    tcase_add_test(tc, test_append_checked_mixed_batch);
    tcase_add_test(tc, test_append_checked_one_by_one);
    tcase_add_test(tc, test_append_checked_meets_a_writer);
    tcase_add_test(tc, test_append_checked_at);
    tcase_add_test(tc, test_claim_waits_for_record);
    tcase_add_test(tc, test_append_many_batch_order);
    tcase_add_test(tc, test_bench);
    tcase_add_test(tc, test_cursor_at);
    suite_add_tcase(su, tc);
    /* Measurements alone: CK_RUN_CASE=bench. */
    tc = tcase_create("bench");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_writer_bench);
    suite_add_tcase(su, tc);
    sr = srunner_create(su);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    fixture_pg_stop(&pg);
    return failed ? 1 : 0;
}
