/*
 * test_store: the store against a real PostgreSQL (a private cluster from
 * tests/fixture_pg.c, started once for the suite and stopped at the end).
 * Each test uses fresh stream and command ids, so tests do not depend on
 * each other's data.
 */
#include <check.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    ck_assert_int_eq(store_migrate(s, &err), 0);
    ck_assert_int_eq(
        sql_ll(s, "SELECT count(*) FROM schema_migrations%s", ""), 2);
    ck_assert_int_eq(
        sql_ll(s, "SELECT max(version) FROM schema_migrations%s", ""), 2);
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

    ck_assert_int_eq(store_command_by_key(s, key, found), 0);
    ck_assert_str_eq(found, cid);
    ck_assert_int_eq(store_command_by_key(s, "no-such-key", found),
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
    /* A second command with the same idempotency key is refused. */
    {
        char cid2[37], stream[64];
        struct tev t;
        Ks__Command cmd = KS__COMMAND__INIT;
        int64_t ver;
        ks_uuid(cid2);
        snprintf(stream, sizeof(stream), "command-%s", cid2);
        cmd.command_id = cid2;
        mk(&t, stream, "CommandRequested")->command = &cmd;
        t.ev.reason = key;
        ck_assert_int_eq(append1(s, &t.ev, STORE_NO_STREAM, &ver),
                         KS_ECONFLICT);
        ck_assert_int_eq(store_stream_version(s, stream, &ver), 0);
        ck_assert_int_eq(ver, 0);
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

START_TEST(test_replay_equality)
{
    struct store *s = open_store(), *other = open_store();
    char cid[37], bid[37], bstream[64], *before[3], *after[3], *err = NULL;
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
    ck_assert_int_eq(append1(s, &t.ev, 1, &v), 0);
    {
        char sql[256], *row;
        snprintf(sql, sizeof(sql),
                 "SELECT status||total||succeeded||failed||cancelled||version"
                 " FROM batches WHERE batch_id = '%s'",
                 bid);
        row = sql1(s, sql);
        ck_assert_str_eq(row, "Completed21102");
        free(row);
    }

    for (int i = 0; i < 3; i++)
        before[i] = sql1(s, digest_sql[i]);
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    ck_assert_int_gt(n, 10);
    for (int i = 0; i < 3; i++) {
        after[i] = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after[i]);
        free(after[i]);
    }
    /* Damage the projections; a replay restores them. */
    PQclear(PQexec(store_pgconn(s), "UPDATE commands SET status = 'Bogus';"
                                    "DELETE FROM batch_targets;"
                                    "UPDATE batches SET total = 0"));
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    for (int i = 0; i < 3; i++) {
        after[i] = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after[i]);
        free(after[i]);
    }
    /* Index names survive the swap (a third replay would clash if not). */
    ck_assert_int_eq(
        sql_ll(s,
               "SELECT count(*) FROM pg_indexes WHERE indexname IN"
               " ('commands_pkey', 'commands_open', 'commands_batch',"
               " 'commands_idempotency_key_key', 'batch_targets_batch')%s",
               ""),
        5);
    ck_assert_int_eq(store_replay(s, &n, &err), 0);
    /* Connections that prepared before the swap still append. */
    run_command(other, cid, NULL, NULL, 0);
    run_command(s, cid, NULL, NULL, 0);
    for (int i = 0; i < 3; i++)
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
    char cid[C][37], bid[37], bstream[64], key[37], *before[3], *err = NULL;
    static struct fev e[64];
    Ks__Event *b[64];
    size_t n = 0, k = 0, dups = 99;
    int64_t replayed;

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
    b[n++] = fresult(&e[k++], cid[1], "CommandCancelled",
                     KS__COMMAND_STATUS__CANCELLED, 9, "second");
    b[n++] = fstatus(&e[k++], cid[1], "CommandLost", 0, NULL);
    /* 2: re-dispatched, back to Running with a new attempt and agent. */
    b[n++] = freq(&e[k++], cid[2], bid, NULL);
    b[n++] = fstatus(&e[k++], cid[2], "CommandDispatched", 1, "agent-1");
    b[n++] = fstatus(&e[k++], cid[2], "CommandStarted", 1, "agent-1");
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
        ck_assert_int_eq(store_command_by_key(s, key, id), 0);
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
    b[n++] = fstatus(&e[k++], cid[1], "CommandStarted", 3, "agent-3");
    b[n++] = fmk(&e[k++], cid[6], "CommandCompleted"); /* no result */
    ck_assert_int_eq(many(s, b, n, &dups), 0);
    ck_assert_uint_eq(dups, 2);
    assert_row(s, cid[5], "StartFailed/4/1/agent-5/nope/true/true");
    assert_row(s, cid[6], "Dispatched/3/1/agent-6/-/false/false");
    assert_row(s, cid[2], "Undeliverable/6/2/agent-2/-/true/true");
    assert_row(s, cid[1], "Failed/7/1/agent-1/first/true/true");

    /* Batch 3: the batch completes; a late start of a final command. */
    n = 0;
    fmk(&e[k], cid[0], "BatchCompleted");
    snprintf(e[k].stream, sizeof(e[k].stream), "%s", bstream);
    snprintf(e[k].bid, sizeof(e[k].bid), "%s", bid);
    e[k].ev.batch_id = e[k].bid;
    e[k].ev.command_id = "";
    b[n++] = &e[k++].ev;
    b[n++] = fstatus(&e[k++], cid[5], "CommandStarted", 2, "agent-x");
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
    for (int i = 0; i < 3; i++)
        before[i] = sql1(s, digest_sql[i]);
    ck_assert_int_eq(store_replay(s, &replayed, &err), 0);
    for (int i = 0; i < 3; i++) {
        char *after = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after);
        free(after);
        free(before[i]);
    }
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
    char c1[37], bid[37], *before[3], *err = NULL, sql[256], *row;
    size_t n = 0, dups;
    int64_t replayed;

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
    for (int i = 0; i < 3; i++)
        before[i] = sql1(s, digest_sql[i]);
    ck_assert_int_eq(store_replay(s, &replayed, &err), 0);
    for (int i = 0; i < 3; i++) {
        char *after = sql1(s, digest_sql[i]);
        ck_assert_str_eq(before[i], after);
        free(after);
        free(before[i]);
    }
    store_close(s);
}
END_TEST

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

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
    tcase_add_test(tc, test_wait_notify);
    tcase_add_test(tc, test_replay_equality);
    tcase_add_test(tc, test_append_many_fold);
    tcase_add_test(tc, test_append_many_refused);
    tcase_add_test(tc, test_append_many_batch_order);
    tcase_add_test(tc, test_bench);
    suite_add_tcase(su, tc);
    sr = srunner_create(su);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    fixture_pg_stop(&pg);
    return failed ? 1 : 0;
}
