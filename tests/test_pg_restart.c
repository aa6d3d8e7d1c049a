/*
 * PostgreSQL restarts under a running broker (issue 10 item 1), and
 * refuses writes under it for a while (issue 25): every
 * connection of the store and of the broker comes back without a broker
 * restart, a request while it is down is refused with "PostgreSQL
 * unreachable: <why>" (exit 125), and nothing accepted is lost. Real
 * nats-server, PostgreSQL (stopped and started with pg_ctl -m fast, as
 * `kscore down`/`up` do), broker and agent.
 */
#include <check.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "broker.h"
#include "fixture.h"
#include "stack.h"
#include "store.h"

#define AGENT "pgr"
/* The brief: service resumes within 10 s of PostgreSQL being back. */
#define HEAL_DEADLINE_US (10 * 1000000)

static struct fixture_stack stack;
static char side_dir[PATH_MAX];

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, AGENT, 0) != 0) {
        fprintf(stderr, "cannot start the stack\n");
        fixture_stack_stop(&stack);
        exit(1);
    }
    snprintf(side_dir, sizeof(side_dir), "%.4000s/side", stack.dir);
    mkdir(side_dir, 0777);
    chmod(side_dir, 0777);
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

static void
sleep_ms(long ms)
{
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000L}, NULL);
}

/* A test that failed mid-outage must not take the next ones down too. */
static void
pg_up(void)
{
    ck_assert_int_eq(fixture_pg_resume(&stack.pg), 0);
}

/* ---- the store alone ------------------------------------------------------
 */

static struct store *
open_store(void)
{
    struct store *s = NULL;
    char *err = NULL;
    int rc = store_open(stack.pg.conninfo, &s, &err);
    ck_assert_msg(rc == 0, "store_open: %s", err ? err : "");
    free(err);
    return s;
}

struct tev {
    Ks__Event ev;
    char id[37];
};

static Ks__Event *
mk(struct tev *t, const char *stream)
{
    ks__event__init(&t->ev);
    ks_uuid(t->id);
    t->ev.event_id = t->id;
    t->ev.stream_id = (char *)stream;
    t->ev.type = "Thing";
    t->ev.occurred_at_us = ks_now_us();
    return &t->ev;
}

static int
append1(struct store *s, Ks__Event *ev)
{
    struct store_event se = {ev};
    return store_append(s, ev->stream_id, STORE_ANY, &se, 1, NULL);
}

struct seen {
    int n;
    char ids[16][37];
};

static int
seen_cb(const Ks__RecordedEvent *ev, void *ud)
{
    struct seen *s = ud;
    if (s->n < 16)
        snprintf(s->ids[s->n], 37, "%s", ev->event->event_id);
    s->n++;
    return 0;
}

static int
count_ref(const struct store_command_ref *ref, void *ud)
{
    (void)ref;
    (*(int *)ud)++;
    return 0;
}

/* Reads on from cur until nothing is new; returns what was read. */
static struct seen
drain(struct store *r, struct store_cursor *cur)
{
    struct seen all = {0};
    for (;;) {
        int before = all.n;
        ck_assert_int_eq(store_read_all(r, cur, 100, seen_cb, &all), 0);
        if (all.n == before)
            return all;
    }
}

/* Waits out notifications already sent (the broker's own appends). */
static void
notify_quiet(struct store *l)
{
    while (store_wait_notify(l, 300) == 0)
        ;
}

/*
 * One struct store per kind of use survives the server going away and
 * coming back: append (prepared statements, pipeline), catch-up read,
 * scan, LISTEN. While it is down each call fails at once with KS_EPGDOWN
 * and a reason; once it is back they work again; a restart while they are
 * idle is not even seen by the callers.
 */
START_TEST(store_survives_restart)
{
    struct store *w = open_store(), *r = open_store(), *sc = open_store(),
                 *l = open_store();
    PGconn *w_conn = store_pgconn(w);
    struct store_cursor cur = {0};
    struct tev e1, e2, e3, e4;
    char stream[64], u[37];
    int n = 0, rc;

    pg_up();
    ks_uuid(u);
    snprintf(stream, sizeof(stream), "pgr-%s", u);
    notify_quiet(l); /* LISTEN issued, nothing pending */
    ck_assert_int_eq(append1(w, mk(&e1, stream)), 0);
    drain(r, &cur);
    notify_quiet(l);

    /* Down: refused at once, with libpq's reason. */
    ck_assert_int_eq(fixture_pg_halt(&stack.pg), 0);
    ck_assert_int_eq(append1(w, mk(&e2, stream)), KS_EPGDOWN);
    ck_assert_msg(strlen(store_last_error(w)) > 0, "no reason");
    fprintf(stderr, "store_survives_restart: down: %s\n", store_last_error(w));
    ck_assert_int_eq(append1(w, &e2.ev), KS_EPGDOWN); /* backing off */
    struct seen none = {0};
    ck_assert_int_eq(store_read_all(r, &cur, 100, seen_cb, &none), KS_EPGDOWN);
    ck_assert_int_eq(store_scan_open(sc, "Running", 0, 10, count_ref, &n),
                     KS_EPGDOWN);
    ck_assert_int_eq(store_wait_notify(l, 2000), KS_EPGDOWN);
    Ks__CommandView *v = NULL;
    ck_assert_int_eq(store_get_command(r, e1.id, &v), KS_EPGDOWN);

    /* Back: each store reconnects (after its backoff) and works. */
    ck_assert_int_eq(fixture_pg_resume(&stack.pg), 0);
    int64_t t0 = ks_mono_us();
    while ((rc = append1(w, &e2.ev)) == KS_EPGDOWN &&
           ks_mono_us() - t0 < HEAL_DEADLINE_US)
        sleep_ms(50);
    ck_assert_int_eq(rc, 0);
    fprintf(stderr, "store_survives_restart: append again after %.2f s\n",
            (ks_mono_us() - t0) / 1e6);
    ck_assert_ptr_eq(store_pgconn(w), w_conn);
    struct seen got = {0};
    while ((rc = store_read_all(r, &cur, 100, seen_cb, &got)) == KS_EPGDOWN &&
           ks_mono_us() - t0 < HEAL_DEADLINE_US)
        sleep_ms(50);
    ck_assert_int_eq(rc, 0);
    while ((rc = store_scan_open(sc, "Running", 0, 10, count_ref, &n)) ==
               KS_EPGDOWN &&
           ks_mono_us() - t0 < HEAL_DEADLINE_US)
        sleep_ms(50);
    ck_assert_int_eq(rc, 0);
    /* The first wait after a reconnection wakes (notifications sent while
     * away are lost); LISTEN is issued again, so the next append wakes it
     * too. */
    while ((rc = store_wait_notify(l, 100)) == KS_EPGDOWN &&
           ks_mono_us() - t0 < HEAL_DEADLINE_US)
        sleep_ms(50);
    ck_assert_int_eq(rc, 0);
    notify_quiet(l);
    ck_assert_int_eq(append1(w, mk(&e3, stream)), 0);
    ck_assert_int_eq(store_wait_notify(l, 5000), 0);
    got = drain(r, &cur);
    /* e2 (if the first read missed it) and e3, each once. */
    int found2 = 0, found3 = 0;
    for (int i = 0; i < got.n && i < 16; i++) {
        found2 += strcmp(got.ids[i], e2.id) == 0;
        found3 += strcmp(got.ids[i], e3.id) == 0;
    }
    ck_assert_int_le(found2, 1);
    ck_assert_int_eq(found3, 1);

    /* A restart while every store is idle: the first call just works. */
    notify_quiet(l);
    ck_assert_int_eq(fixture_pg_restart(&stack.pg), 0);
    ck_assert_int_eq(append1(w, mk(&e4, stream)), 0);
    got = drain(r, &cur);
    ck_assert_int_eq(got.n >= 1, 1);
    ck_assert_int_eq(store_scan_open(sc, "Running", 0, 10, count_ref, &n), 0);
    ck_assert_int_eq(store_get_command(r, e4.id, &v), KS_ENOTFOUND);
    ck_assert_int_eq(store_wait_notify(l, 5000), 0);
    int64_t version = 0;
    ck_assert_int_eq(store_stream_version(r, stream, &version), 0);
    ck_assert_int_eq(version, 4);
    store_close(w);
    store_close(r);
    store_close(sc);
    store_close(l);
}
END_TEST

/* ---- the broker -----------------------------------------------------------
 */

static struct evt_conn *
client(void)
{
    return fixture_client(&stack);
}

/* Submits a detached command; 0 with id_out, or the error. */
static int
submit(struct evt_conn *c, const char *script, char id_out[37])
{
    return fixture_submit(c, AGENT, script, 120000, 0, id_out);
}

/* A fresh connection (one from before an outage would be dead). */
static PGconn *
db(void)
{
    PGconn *pg = NULL;
    for (int i = 0; i < 100; i++) {
        pg = PQconnectdb(stack.pg.conninfo);
        if (PQstatus(pg) == CONNECTION_OK)
            return pg;
        PQfinish(pg);
        sleep_ms(100);
    }
    ck_abort_msg("cannot connect to PostgreSQL");
    return NULL;
}

static long
sql_long(PGconn *pg, const char *sql)
{
    return fixture_pg_long(pg, sql);
}

/* Polls sql until it returns want (deadline timeout_s). */
static long
wait_sql(PGconn *pg, const char *sql, long want, int timeout_s)
{
    long v = -1;
    for (int i = 0; i < timeout_s * 10; i++) {
        if ((v = sql_long(pg, sql)) == want)
            break;
        sleep_ms(100);
    }
    return v;
}

static int
runs_of(const char *id, const char *mark)
{
    char path[PATH_MAX + 80], line[64];
    int n = 0;
    snprintf(path, sizeof(path), "%s/pgr.%s", side_dir, id);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        n += strncmp(line, mark, strlen(mark)) == 0;
    fclose(f);
    return n;
}

/* `kscore exec --json --agent pgr -- echo <word>` into o; the command id
 * (if any) into id. */
static void
exec_json(const char *word, struct fixture_out *o, char id[37])
{
    const char *args[] = {"exec", "--agent", AGENT, "--json",
                          "--",   "echo",    word,  NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, o), 0);
    id[0] = '\0';
    json_t *j = json_loads(o->out, 0, NULL);
    const char *cid =
        j ? json_string_value(json_object_get(j, "command_id")) : NULL;
    if (cid)
        snprintf(id, 37, "%s", cid);
    json_decref(j);
}

/* Runs `exec` until it succeeds or HEAL_DEADLINE_US passes; returns its
 * last status, the seconds it took in *secs. */
static int
exec_until_ok(const char *word, char id[37], double *secs)
{
    struct fixture_out o;
    int64_t t0 = ks_mono_us();
    int status;
    for (;;) {
        exec_json(word, &o, id);
        status = o.status;
        if (status != 0 && ks_mono_us() - t0 < HEAL_DEADLINE_US)
            fprintf(stderr, "  exec while healing: %d %s", status, o.err);
        fixture_out_release(&o);
        if (status == 0 || ks_mono_us() - t0 >= HEAL_DEADLINE_US)
            break;
        sleep_ms(100);
    }
    *secs = (ks_mono_us() - t0) / 1e6;
    return status;
}

/*
 * (a) exec works, PostgreSQL restarts (fast), exec works again within 10 s
 * without a broker restart; while it is down, exec is refused with
 * "PostgreSQL unreachable: <why>" and exit 125, get likewise, and a
 * follower is not thrown out.
 */
START_TEST(exec_heals_after_restart)
{
    struct fixture_out o;
    char before[37], id[37];
    double secs;

    pg_up();
    exec_json("before", &o, before);
    ck_assert_msg(o.status == 0, "exec: %d %s", o.status, o.err);
    fixture_out_release(&o);
    ck_assert(ks_is_uuid(before));

    ck_assert_int_eq(fixture_pg_restart(&stack.pg), 0);
    ck_assert_int_eq(exec_until_ok("after", id, &secs), 0);
    fprintf(stderr,
            "exec_heals_after_restart: exec after a restart: "
            "%.2f s\n",
            secs);

    ck_assert_int_eq(fixture_pg_halt(&stack.pg), 0);
    const char *args[] = {"exec", "--agent", AGENT, "--",
                          "echo", "during",  NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    fprintf(stderr, "exec_heals_after_restart: while down: %s", o.err);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "PostgreSQL unreachable: ") != NULL,
                  "stderr: %s", o.err);
    ck_assert_str_eq(o.out, "");
    fixture_out_release(&o);
    const char *gargs[] = {"get", before, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, gargs, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "PostgreSQL unreachable: ") != NULL,
                  "stderr: %s", o.err);
    fixture_out_release(&o);
    /* A follower gets an empty page, not an error: it just waits on. */
    struct evt_conn *c = client();
    Ks__EventsRequest er = KS__EVENTS_REQUEST__INIT;
    Ks__EventsReply *rep = NULL;
    er.stream_id = "";
    er.wait_ms = 1000;
    er.cursor_tx_id = UINT64_MAX / 2; /* at the end: nothing to read */
    ck_assert_int_eq(broker_call(c, EVT_API_FOLLOW, &er.base,
                                 &ks__events_reply__descriptor, 10000,
                                 (ProtobufCMessage **)&rep),
                     0);
    ck_assert_msg(rep->error_code == 0, "follow: %s", rep->error);
    ck_assert_uint_eq(rep->n_events, 0);
    ks__events_reply__free_unpacked(rep, NULL);
    evt_close(c);

    ck_assert_int_eq(fixture_pg_resume(&stack.pg), 0);
    ck_assert_int_eq(exec_until_ok("back", id, &secs), 0);
    fprintf(stderr,
            "exec_heals_after_restart: exec after an outage: "
            "%.2f s\n",
            secs);
    /* Nothing of the refused one was recorded. */
    PGconn *pg = db();
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE argv = "
                                  "'{echo,during}'"),
                     0);
    PQfinish(pg);
}
END_TEST

/* Lines of broker.log from byte offset from on that contain needle. */
static int
log_lines(long from, const char *needle, long *end)
{
    char path[PATH_MAX + 16], line[1024];
    int n = 0;
    snprintf(path, sizeof(path), "%s/broker.log", stack.dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    fseek(f, from, SEEK_SET);
    while (fgets(line, sizeof(line), f))
        n += strstr(line, needle) != NULL;
    if (end)
        *end = ftell(f);
    fclose(f);
    return n;
}

/*
 * (b) A command running on the agent while PostgreSQL is down ends while it
 * is down: its result waits in JetStream, unacked, and is recorded exactly
 * once when PostgreSQL is back. The recorder says so in two lines, not
 * five a second.
 */
START_TEST(running_command_recorded_once)
{
    struct evt_conn *c = client();
    char id[37], script[5 * PATH_MAX], sql[256];
    long log_at = 0;
    /* The command ends once PostgreSQL is down: with a `sleep 3` a loaded
     * machine could end it before the halt, and its result was recorded
     * at once. */
    struct fixture_gate gate;
    fixture_gate_init(&gate, side_dir, "halted");

    pg_up();
    log_lines(0, "", &log_at);
    snprintf(script, sizeof(script),
             "echo run >> %s/pgr.$KSCORE_COMMAND_ID; %s; echo done;"
             " echo fin >> %s/pgr.$KSCORE_COMMAND_ID",
             side_dir, gate.sh, side_dir);
    ck_assert_int_eq(submit(c, script, id), 0);
    PGconn *pg = db();
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Running'",
             id);
    ck_assert_int_eq(wait_sql(pg, sql, 1, 20), 1);
    PQfinish(pg);

    ck_assert_int_eq(fixture_pg_halt(&stack.pg), 0);
    fixture_gate_open(&gate);
    for (int i = 0; i < 200 && runs_of(id, "fin") == 0; i++)
        sleep_ms(100);
    ck_assert_int_eq(runs_of(id, "fin"), 1);
    sleep_ms(3000); /* the recorder fails, backs off, retries */
    ck_assert_int_eq(fixture_pg_resume(&stack.pg), 0);

    pg = db();
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded' AND stdout = 'done\n'::bytea",
             id);
    ck_assert_int_eq(wait_sql(pg, sql, 1, 30), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'command-%s' "
             "AND type = 'CommandCompleted'",
             id);
    ck_assert_int_eq(sql_long(pg, sql), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'command-%s' "
             "AND type = 'CommandStarted'",
             id);
    ck_assert_int_eq(sql_long(pg, sql), 1);
    ck_assert_int_eq(runs_of(id, "run"), 1);
    PQfinish(pg);
    /* One line when the outage starts, one when it ends. */
    ck_assert_int_eq(log_lines(log_at, "msg=\"cannot record;", NULL), 1);
    ck_assert_int_eq(log_lines(log_at, "msg=\"recording again\"", NULL), 1);
    ck_assert_int_le(log_lines(log_at, "module=recorder", NULL), 2);
    evt_close(c);
}
END_TEST

/* Runs `kscore args...`; returns its status, stdout in out (may be NULL). */
static int
kscore_status(const char *const args[], char *out, size_t len)
{
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    int status = o.status;
    if (status != 0)
        fprintf(stderr, "kscore %s: %d: %s\n", args[0], status, o.err);
    if (out)
        snprintf(out, len, "%s", o.out);
    fixture_out_release(&o);
    return status;
}

/*
 * (c) After a restart every path works again on the same broker: exec
 * (execute workers, claims, recorder), get, events, events --follow (the
 * LISTEN connection), cancel, batch (the batch scheduler's connection),
 * the agents projection (the registry's connection).
 */
START_TEST(everything_after_restart)
{
    char id[37], out[4096], sql[256], cancel_id[37];
    double secs;
    struct evt_conn *c = client();

    pg_up();
    ck_assert_int_eq(fixture_pg_restart(&stack.pg), 0);
    int64_t resumed_us = ks_now_us();
    ck_assert_int_eq(exec_until_ok("again", id, &secs), 0);

    const char *get[] = {"get", id, NULL};
    ck_assert_int_eq(kscore_status(get, out, sizeof(out)), 0);
    ck_assert_msg(strstr(out, "Succeeded") != NULL, "get: %s", out);
    const char *events[] = {"events", id, NULL};
    ck_assert_int_eq(kscore_status(events, out, sizeof(out)), 0);
    ck_assert_msg(strstr(out, "CommandCompleted") != NULL, "events: %s", out);
    const char *follow[] = {"events", "--follow", id, NULL};
    ck_assert_int_eq(kscore_status(follow, out, sizeof(out)), 0);
    ck_assert_msg(strstr(out, "CommandCompleted") != NULL, "follow: %s", out);
    /* All streams, from the start, through the follow connection. */
    Ks__EventsRequest er = KS__EVENTS_REQUEST__INIT;
    Ks__EventsReply *rep = NULL;
    er.stream_id = "";
    er.wait_ms = 1000;
    ck_assert_int_eq(broker_call(c, EVT_API_FOLLOW, &er.base,
                                 &ks__events_reply__descriptor, 10000,
                                 (ProtobufCMessage **)&rep),
                     0);
    ck_assert_msg(rep->error_code == 0, "follow: %s", rep->error);
    ck_assert_uint_gt(rep->n_events, 0);
    ks__events_reply__free_unpacked(rep, NULL);

    const char *batch[] = {"batch", "--agents", AGENT, "--",
                           "echo",  "batched",  NULL};
    ck_assert_int_eq(kscore_status(batch, out, sizeof(out)), 0);

    ck_assert_int_eq(submit(c, "exec sleep 120", cancel_id), 0);
    PGconn *pg = db();
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Running'",
             cancel_id);
    ck_assert_int_eq(wait_sql(pg, sql, 1, 20), 1);
    const char *cancel[] = {"cancel", cancel_id, NULL};
    ck_assert_int_eq(kscore_status(cancel, NULL, 0), 0);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Cancelled'",
             cancel_id);
    ck_assert_int_eq(wait_sql(pg, sql, 1, 30), 1);

    /* The registry writes the agents projection again (at most every
     * 10 s per agent, so give it a few heartbeats). */
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM agents WHERE agent_id = '" AGENT
             "' AND last_seen > kscore_ts(%lld)",
             (long long)resumed_us);
    ck_assert_int_eq(wait_sql(pg, sql, 1, 40), 1);
    PQfinish(pg);
    evt_close(c);
}
END_TEST


/* ---- a database that refuses writes (issue 25) ----------------------------
 */

/* Runs sql on pg (no rows wanted); a failure fails the test. */
static void
sql_exec(PGconn *pg, const char *sql)
{
    PGresult *r = PQexec(pg, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK ||
                      PQresultStatus(r) == PGRES_TUPLES_OK,
                  "%s: %s", sql, PQerrorMessage(pg));
    PQclear(r);
}

/*
 * Makes every new session of the database read-only (ALTER DATABASE, as
 * its owner: the role kscore may) or writable again, and ends the
 * sessions of the role but adm's own, so that the broker's reconnect and
 * take the setting (a session reads it when it starts).
 */
static void
set_read_only(PGconn *adm, bool on)
{
    char sql[256];
    PGresult *r = PQexec(adm, "SELECT current_database()");
    ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    snprintf(sql, sizeof(sql),
             "ALTER DATABASE \"%s\" %s default_transaction_read_only%s",
             PQgetvalue(r, 0, 0), on ? "SET" : "RESET", on ? " = on" : "");
    PQclear(r);
    sql_exec(adm, sql);
    sql_exec(adm, "SELECT count(pg_terminate_backend(pid))"
                  " FROM pg_stat_activity"
                  " WHERE datname = current_database()"
                  "   AND usename = current_user"
                  "   AND backend_type = 'client backend'"
                  "   AND pid <> pg_backend_pid()");
}

/* One `kscore exec` run on its own thread. */
struct exec_job {
    pthread_t th;
    char word[32], script[5 * PATH_MAX];
    struct fixture_out o;
};

static void *
exec_job_main(void *arg)
{
    struct exec_job *j = arg;
    const char *args[] = {"exec", "--agent", AGENT, "--", "sh",
                          "-c",   j->script, j->word, NULL};
    if (fixture_kscore(&stack, args, &j->o) != 0)
        j->o.status = -1;
    return NULL;
}

static void
exec_job_start(struct exec_job *j, const char *word, const char *script)
{
    snprintf(j->word, sizeof(j->word), "%s", word);
    snprintf(j->script, sizeof(j->script), "%s", script);
    ck_assert_int_eq(pthread_create(&j->th, NULL, exec_job_main, j), 0);
}

/* Commands recorded with word as their last argument. */
static long
recorded_with(PGconn *pg, const char *word)
{
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands"
             " WHERE argv[array_length(argv, 1)] = '%s'",
             word);
    return sql_long(pg, sql);
}

#define RO_DETACHED 4
#define RO_WAITING 4
#define RO_DURING 2
#define RO_TAG "rotag"

/*
 * PostgreSQL refuses writes (default_transaction_read_only, SQLSTATE
 * 25006, as a full disk refuses with 53100) while commands finish: their
 * results wait in JetStream, unacked, and are recorded once writes are
 * taken again; every command ends with exactly one terminal event, none
 * stays Running; an exec that waits for its result is never told "not
 * recorded" for a command that is, and one asked during the fault is told
 * "not recorded" (125) only if it is not. The broker names the SQLSTATE.
 * Before the fix the recorder gave the results up and acked them (the
 * commands stayed Running) and the waiting execs, asking again after 5 s
 * of silence, were told "cannot record the command" (125).
 */
START_TEST(results_wait_while_pg_refuses_writes)
{
    struct evt_conn *c = client();
    char ids[RO_DETACHED][37], sql[512], word[32];
    struct exec_job waiting[RO_WAITING], during[RO_DURING];
    long log_at = 0;
    /* The commands wait at a gate opened once writes are refused, and
     * mark their end in ro-ends: with `sleep 4` a loaded machine could
     * end the first ones before the last were Running, or before the
     * fault. */
    struct fixture_gate gate;
    char ends[PATH_MAX + 16], sh_detached[5 * PATH_MAX],
        sh_waiting[5 * PATH_MAX];
    fixture_gate_init(&gate, side_dir, "read-only");
    snprintf(ends, sizeof(ends), "%s/ro-ends", side_dir);
    unlink(ends);
    snprintf(sh_detached, sizeof(sh_detached),
             "%s; echo x >> %s; echo done # " RO_TAG, gate.sh, ends);
    snprintf(sh_waiting, sizeof(sh_waiting), "%s; echo x >> %s; echo \"$0\"",
             gate.sh, ends);

    pg_up();
    log_lines(0, "", &log_at);
    memset(waiting, 0, sizeof(waiting));
    memset(during, 0, sizeof(during));
    for (int i = 0; i < RO_DETACHED; i++)
        ck_assert_int_eq(submit(c, sh_detached, ids[i]), 0);
    for (int i = 0; i < RO_WAITING; i++) {
        snprintf(word, sizeof(word), RO_TAG "-wait-%d", i);
        exec_job_start(&waiting[i], word, sh_waiting);
    }
    PGconn *adm = db();
    /* Every command recorded and Running before the fault. */
    ck_assert_int_eq(
        wait_sql(adm,
                 "SELECT count(*) FROM commands WHERE status = 'Running'"
                 " AND array_to_string(argv, ' ') LIKE '%" RO_TAG "%'",
                 RO_DETACHED + RO_WAITING, 60),
        RO_DETACHED + RO_WAITING);

    set_read_only(adm, true);
    for (int i = 0; i < RO_DURING; i++) {
        snprintf(word, sizeof(word), RO_TAG "-during-%d", i);
        exec_job_start(&during[i], word, "echo \"$0\"");
    }
    /* The commands end during the fault, and the fault outlasts an
     * exec's re-ask (5 s of silence) after their ends: their ends reach
     * the recorder while writes are refused. */
    fixture_gate_open(&gate);
    for (int i = 0; i < 600 && fixture_file_lines(ends) <
                                   RO_DETACHED + RO_WAITING;
         i++)
        sleep_ms(100);
    ck_assert_int_eq(fixture_file_lines(ends), RO_DETACHED + RO_WAITING);
    sleep_ms(7000);
    PGconn *ro = db(); /* a session of the fault: reads work */
    ck_assert_int_eq(
        sql_long(ro, "SELECT count(*) FROM commands WHERE status = 'Running'"
                     " AND array_to_string(argv, ' ') LIKE '%" RO_TAG "%'"),
        RO_DETACHED + RO_WAITING);
    PQfinish(ro);
    set_read_only(adm, false);
    PQfinish(adm);

    PGconn *pg = db();
    /* Every command of the test ends, once; none stays Running (before
     * the fix the recorder dropped their ends: checked before the waiting
     * execs are joined, which would then wait for ever). */
    ck_assert_msg(
        wait_sql(pg,
                 "SELECT count(*) FROM commands WHERE status <> 'Succeeded'"
                 " AND array_to_string(argv, ' ') LIKE '%" RO_TAG "%'",
                 0, 60) == 0,
        "commands of the test not Succeeded 60 s after the fault: %ld "
        "(Running: %ld)",
        sql_long(pg, "SELECT count(*) FROM commands WHERE status <> "
                     "'Succeeded' AND array_to_string(argv, ' ') LIKE '%"
                     RO_TAG "%'"),
        sql_long(pg, "SELECT count(*) FROM commands WHERE status = "
                     "'Running' AND array_to_string(argv, ' ') LIKE '%"
                     RO_TAG "%'"));
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands c WHERE"
             " array_to_string(c.argv, ' ') LIKE '%%" RO_TAG "%%' AND"
             " (SELECT count(*) FROM events e"
             "  WHERE e.stream_id = 'command-' || c.command_id::text AND"
             "  e.type IN ('CommandCompleted', 'CommandStartFailed',"
             "   'CommandUndeliverable', 'CommandLost', 'CommandCancelled',"
             "   'CommandNotStarted')) <> 1");
    ck_assert_int_eq(sql_long(pg, sql), 0);
    for (int i = 0; i < RO_DETACHED; i++) {
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM commands WHERE command_id = '%s'"
                 " AND status = 'Succeeded' AND stdout = 'done\n'::bytea",
                 ids[i]);
        ck_assert_int_eq(sql_long(pg, sql), 1);
    }
    for (int i = 0; i < RO_WAITING; i++)
        pthread_join(waiting[i].th, NULL);
    for (int i = 0; i < RO_DURING; i++)
        pthread_join(during[i].th, NULL);
    /* Nobody told "not recorded" (125) of a command that is recorded. */
    for (int i = 0; i < RO_WAITING; i++) {
        struct fixture_out *o = &waiting[i].o;
        fprintf(stderr, "  waiting exec %d: %d %s", i, o->status, o->err);
        ck_assert_int_eq(recorded_with(pg, waiting[i].word), 1);
        ck_assert_msg(o->status == 0, "exec %s (recorded): exit %d: %s",
                      waiting[i].word, o->status, o->err);
        ck_assert_msg(strstr(o->out, waiting[i].word) != NULL, "stdout: %s",
                      o->out);
        /* Told at once why it waited (issue 25), and that it went on. */
        ck_assert_msg(strstr(o->err, "cannot be recorded now") != NULL &&
                          strstr(o->err, "25006") != NULL &&
                          strstr(o->err, "takes writes again") != NULL,
                      "stderr: %s", o->err);
    }
    for (int i = 0; i < RO_DURING; i++) {
        struct fixture_out *o = &during[i].o;
        long n = recorded_with(pg, during[i].word);
        fprintf(stderr, "  exec during the fault %d: %d, recorded %ld: %s",
                i, o->status, n, o->err);
        ck_assert_msg(o->status == 0 || o->status == 125 || o->status == 69,
                      "exit %d: %s", o->status, o->err);
        if (o->status == 125) {
            ck_assert_int_eq(n, 0);
            ck_assert_msg(strstr(o->err, "not recorded") != NULL, "%s",
                          o->err);
        }
        if (o->status == 69)
            ck_assert_msg(strstr(o->err, "kscore get ") != NULL ||
                              strstr(o->err, "idempotency") != NULL,
                          "%s", o->err);
    }
    PQfinish(pg);
    /* The operator sees the cause: the SQLSTATE and the server's words. */
    ck_assert_int_ge(log_lines(log_at, "cause=refuses_writes", NULL), 1);
    ck_assert_int_ge(log_lines(log_at, "sqlstate=25006", NULL), 1);
    for (int i = 0; i < RO_WAITING; i++)
        fixture_out_release(&waiting[i].o);
    for (int i = 0; i < RO_DURING; i++)
        fixture_out_release(&during[i].o);
    evt_close(c);
}
END_TEST

/* ---- followers and long transactions elsewhere (issue 25) ---------------- */

/* A connection of its own to database dbname of the stack's cluster. */
static PGconn *
db_named(const char *dbname)
{
    char ci[PATH_MAX + 64];
    snprintf(ci, sizeof(ci), "%s dbname=%s", stack.pg.conninfo, dbname);
    PGconn *pg = PQconnectdb(ci);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));
    return pg;
}

/* One follow call of every stream from *cur (cur moves on); whether the
 * end of command_id (empty: anything) was among its events. */
static bool
follow_once(struct evt_conn *c, uint64_t *tx, int64_t *pos,
            const char *command_id, uint32_t wait_ms)
{
    Ks__EventsRequest er = KS__EVENTS_REQUEST__INIT;
    Ks__EventsReply *rep = NULL;
    bool found = false;
    er.stream_id = "";
    er.cursor_tx_id = *tx;
    er.cursor_pos = *pos;
    er.limit = 1000;
    er.wait_ms = wait_ms;
    ck_assert_int_eq(broker_call(c, EVT_API_FOLLOW, &er.base,
                                 &ks__events_reply__descriptor, 10000,
                                 (ProtobufCMessage **)&rep),
                     0);
    ck_assert_msg(rep->error_code == 0, "follow: %s", rep->error);
    for (size_t i = 0; i < rep->n_events; i++) {
        const Ks__Event *ev = rep->events[i]->event;
        if (ev && strcmp(ev->type, "CommandCompleted") == 0 &&
            (!command_id[0] || strcmp(ev->command_id, command_id) == 0))
            found = true;
    }
    *tx = rep->cursor_tx_id;
    *pos = rep->cursor_pos;
    ks__events_reply__free_unpacked(rep, NULL);
    return found;
}

/*
 * A follower (kscore.api.v1.follow, what `kscore events --follow` reads)
 * gets a command's end while a transaction of another database, and one of
 * this database that writes no event, stay open. On 9d94e2b it waited
 * until they ended (below pg_snapshot_xmin, the oldest open transaction of
 * the whole cluster: a 25 s transaction delayed delivery by 24 s).
 */
START_TEST(a_long_transaction_elsewhere_delays_no_follower)
{
    struct evt_conn *c = client();
    uint64_t tx = 0;
    int64_t pos = 0;
    char id[37];

    pg_up();
    /* To the end of what is there. */
    for (int i = 0; i < 100; i++) {
        uint64_t t0 = tx;
        int64_t p0 = pos;
        follow_once(c, &tx, &pos, "", 0);
        if (tx == t0 && pos == p0)
            break;
    }
    PGconn *other = db_named("postgres"), *same = db();
    sql_exec(other, "BEGIN");
    sql_exec(other, "SELECT pg_current_xact_id()");
    sql_exec(same, "CREATE TABLE IF NOT EXISTS follow_bystander (x int)");
    sql_exec(same, "BEGIN");
    sql_exec(same, "INSERT INTO follow_bystander VALUES (1)");

    ck_assert_int_eq(submit(c, "echo followed", id), 0);
    bool found = false;
    int64_t until = ks_mono_us() + 30 * 1000000LL;
    while (!found && ks_mono_us() < until)
        found = follow_once(c, &tx, &pos, id, 1000);
    ck_assert_int_eq(PQtransactionStatus(other), PQTRANS_INTRANS);
    ck_assert_int_eq(PQtransactionStatus(same), PQTRANS_INTRANS);
    sql_exec(other, "COMMIT");
    sql_exec(same, "ROLLBACK");
    PQfinish(other);
    PQfinish(same);
    ck_assert_msg(found, "the follower did not get the command's end in 30 s "
                         "while two transactions that append nothing were "
                         "open");
    evt_close(c);
}
END_TEST

/* ---- a full disk under events (issue 25, fleet case F06) ---------------- */

/* Together at most the agent's slots (8 here). */
#define DF_DETACHED 5
#define DF_WAITING 3
#define DF_TAG "dftag"
/* Asks for a new command while the disk is full until one is refused: a
 * few still fit in the last page of events. */
#define DF_ASKS 40

/* Lines in the side-effect file of a command of this test. */
static long
df_runs(const char *id)
{
    char path[PATH_MAX + 300];
    snprintf(path, sizeof(path), "%s/df.%s", side_dir, id);
    return fixture_file_lines(path);
}

/*
 * PostgreSQL up, its events table on a full disk (a 32 MiB tmpfs
 * tablespace, filled: SQLSTATE 53100 disk_full), while commands run and
 * end, and new ones are asked for: a new request is refused at once, the
 * answer naming 53100 disk_full, exit 125 and "not recorded" (or 69 when
 * it cannot know); a waiting exec is told at once why it waits; the
 * results wait in JetStream and are recorded once the space is back, each
 * command with exactly one terminal event, none run twice. Fleet case F06
 * (Sentry 2015-07-23). Before issue 25's fixes the recorder acked the
 * results it could not write (commands stayed Running for good); before
 * this test's, a waiting exec said nothing and the refusal named no
 * condition.
 */
START_TEST(a_full_disk_refuses_at_once_and_records_after)
{
    struct evt_conn *c = client();
    char ids[DF_DETACHED][37], word[32], script[5 * PATH_MAX], sql[768];
    struct exec_job waiting[DF_WAITING];
    long log_at = 0;

    pg_up();
    int rc = fixture_pg_small_disk(&stack.pg, 32);
    if (rc == KS_EUNAVAIL) {
        fprintf(stderr, "a_full_disk_refuses_at_once_and_records_after: "
                        "SKIPPED: no tmpfs can be mounted here\n");
        evt_close(c);
        return;
    }
    ck_assert_int_eq(rc, 0);
    log_lines(0, "", &log_at);
    memset(waiting, 0, sizeof(waiting));
    /* The commands end once the disk is full (a gate), and mark it in
     * df.<id>: with `sleep 4` a loaded machine could end the first ones
     * before the last were Running, or before the disk was filled, and
     * their results were recorded at once. */
    struct fixture_gate gate;
    char ends[PATH_MAX + 16];
    fixture_gate_init(&gate, side_dir, "disk-full");
    snprintf(ends, sizeof(ends), "%s/df-ends", side_dir);
    unlink(ends);
    snprintf(script, sizeof(script),
             "%s; echo $$ >> %s/df.$KSCORE_COMMAND_ID; echo x >> %s; "
             "echo done # " DF_TAG,
             gate.sh, side_dir, ends);
    for (int i = 0; i < DF_DETACHED; i++)
        ck_assert_int_eq(submit(c, script, ids[i]), 0);
    snprintf(script, sizeof(script),
             "%s; echo $$ >> %s/df.$KSCORE_COMMAND_ID; echo x >> %s; "
             "echo \"$0\"",
             gate.sh, side_dir, ends);
    for (int i = 0; i < DF_WAITING; i++) {
        snprintf(word, sizeof(word), DF_TAG "-wait-%d", i);
        exec_job_start(&waiting[i], word, script);
    }
    PGconn *adm = db();
    ck_assert_int_eq(
        wait_sql(adm,
                 "SELECT count(*) FROM commands WHERE status = 'Running'"
                 " AND array_to_string(argv, ' ') LIKE '%" DF_TAG "%'",
                 DF_DETACHED + DF_WAITING, 60),
        DF_DETACHED + DF_WAITING);
    ck_assert_int_eq(fixture_pg_fill_disk(&stack.pg), 0);
    fixture_gate_open(&gate);

    /* A new request is refused at once, and says why. */
    struct fixture_out o = {0};
    double secs = 0;
    int asked = 0;
    for (; asked < DF_ASKS; asked++) {
        snprintf(word, sizeof(word), DF_TAG "-new-%d", asked);
        const char *args[] = {"exec", "--agent", AGENT, "--", "echo", word,
                              NULL};
        fixture_out_release(&o);
        int64_t t0 = ks_mono_us();
        ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
        secs = (double)(ks_mono_us() - t0) / 1e6;
        if (o.status != 0)
            break;
    }
    fprintf(stderr, "  full disk: ask %d refused after %.2f s: exit %d: %s",
            asked, secs, o.status, o.err);
    ck_assert_int_lt(asked, DF_ASKS);
    ck_assert_msg(o.status == 125 || o.status == 69, "exit %d", o.status);
    ck_assert_msg(strstr(o.err, "53100") && strstr(o.err, "disk_full"),
                  "%s", o.err);
    if (o.status == 125) {
        ck_assert_msg(strstr(o.err, "not recorded") != NULL, "%s", o.err);
        ck_assert_int_eq(recorded_with(adm, word), 0);
    }
    /* At once: not after a delivery deadline or a timeout (seconds, not
     * a speed target: the refusal is one failed commit). */
    ck_assert_msg(secs < 3.0, "refused after %.2f s", secs);
    fixture_out_release(&o);

    /* The commands end meanwhile (past the gate); their results wait,
     * unrecorded. */
    for (int i = 0; i < 600 && fixture_file_lines(ends) <
                                   DF_DETACHED + DF_WAITING;
         i++)
        sleep_ms(100);
    ck_assert_int_eq(fixture_file_lines(ends), DF_DETACHED + DF_WAITING);
    sleep_ms(8000);
    ck_assert_int_eq(
        sql_long(adm, "SELECT count(*) FROM commands WHERE status = 'Running'"
                      " AND array_to_string(argv, ' ') LIKE '%" DF_TAG "%'"),
        DF_DETACHED + DF_WAITING);
    ck_assert_int_eq(fixture_pg_free_disk(&stack.pg), 0);

    /* Then every one ends, once, Succeeded; none ran twice. */
    ck_assert_msg(
        wait_sql(adm,
                 "SELECT count(*) FROM commands WHERE status <> 'Succeeded'"
                 " AND array_to_string(argv, ' ') LIKE '%" DF_TAG "-wait%'"
                 " OR (status <> 'Succeeded' AND array_to_string(argv, ' ')"
                 "     LIKE '%# " DF_TAG "')",
                 0, 60) == 0,
        "commands of the test not Succeeded 60 s after the space is back");
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands c WHERE"
             " array_to_string(c.argv, ' ') LIKE '%%" DF_TAG "%%' AND"
             " (SELECT count(*) FROM events e"
             "  WHERE e.stream_id = 'command-' || c.command_id::text AND"
             "  e.type IN ('CommandCompleted', 'CommandStartFailed',"
             "   'CommandUndeliverable', 'CommandLost', 'CommandCancelled',"
             "   'CommandNotStarted')) <> 1");
    ck_assert_int_eq(sql_long(adm, sql), 0);
    for (int i = 0; i < DF_DETACHED; i++)
        ck_assert_int_eq(df_runs(ids[i]), 1);
    for (int i = 0; i < DF_WAITING; i++) {
        struct fixture_out *w = &waiting[i].o;
        pthread_join(waiting[i].th, NULL);
        fprintf(stderr, "  waiting exec %d: %d %s", i, w->status, w->err);
        ck_assert_int_eq(w->status, 0);
        ck_assert_msg(strstr(w->out, waiting[i].word) != NULL, "%s", w->out);
        ck_assert_msg(strstr(w->err, "cannot be recorded now") &&
                          strstr(w->err, "53100 disk_full"),
                      "stderr: %s", w->err);
        fixture_out_release(w);
    }
    PQfinish(adm);
    ck_assert_int_ge(log_lines(log_at, "sqlstate=53100", NULL), 1);
    fixture_pg_small_disk_undo(&stack.pg);
    evt_close(c);
}
END_TEST

static Suite *
pg_restart_suite(void)
{
    Suite *s = suite_create("pg_restart");
    TCase *tc = tcase_create("restart");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, store_survives_restart);
    tcase_add_test(tc, exec_heals_after_restart);
    tcase_add_test(tc, running_command_recorded_once);
    tcase_add_test(tc, everything_after_restart);
    tcase_add_test(tc, results_wait_while_pg_refuses_writes);
    tcase_add_test(tc, a_long_transaction_elsewhere_delays_no_follower);
    suite_add_tcase(s, tc);
    /* Its own stack (CK_RUN_CASE=full runs it alone): a tablespace on a
     * tmpfs under events. */
    TCase *full = tcase_create("full");
    tcase_add_unchecked_fixture(full, stack_up, stack_down);
    tcase_set_timeout(full, 240);
    tcase_add_test(full, a_full_disk_refuses_at_once_and_records_after);
    suite_add_tcase(s, full);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(pg_restart_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
