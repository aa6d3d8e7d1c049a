/*
 * Overload (issue 23): a request that cannot start within its delivery
 * deadline is refused at once with KS_EBUSY (`kscore exec` exits 75) and
 * nothing of it is recorded; what was accepted still ends, each command in
 * exactly one terminal event; capacity comes back when the load goes; a
 * batch paces its own targets, so one larger than its fleet can run at
 * once never ends Undeliverable because kscore dispatched too fast
 * (broker/admit.c, docs/operating.md "Overload").
 *
 * Against a real broker, agents and PostgreSQL. No wall-clock speed is
 * asserted: the busy states are made by what the agents hold (a slot held
 * by `sleep`, a table lock that stalls the broker's writes), never by
 * racing the machine.
 */
#include <check.h>
#include <jansson.h>
#include <libpq-fe.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "events.h"
#include "fixture.h"
#include "kproto.h"
#include "stack.h"

static struct fixture_stack stack;

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, NULL, 0) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

static PGconn *
db(void)
{
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));
    return pg;
}

static long
sql_long(PGconn *pg, const char *sql)
{
    PGresult *r = PQexec(pg, sql);
    long v = -1;
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql,
                  PQerrorMessage(pg));
    if (PQntuples(r) == 1)
        v = strtol(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

static void
sleep_ms(int ms)
{
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000L}, NULL);
}

/* Waits (<= timeout_s) until the command's status is want. */
static void
wait_status(PGconn *pg, const char *id, const char *want, int timeout_s)
{
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = '%s'",
             id, want);
    for (int i = 0; i < timeout_s * 10; i++) {
        if (sql_long(pg, sql) == 1)
            return;
        sleep_ms(100);
    }
    ck_abort_msg("command %s never %s", id, want);
}

/* Every command of agent_id is terminal, with exactly one terminal
 * event: waits (<= timeout_s) for the first, then checks the second. */
static void
all_ended_once(PGconn *pg, const char *agent_id, int timeout_s)
{
    static const char term[] = "('CommandCompleted','CommandStartFailed',"
                               "'CommandUndeliverable','CommandLost',"
                               "'CommandCancelled','CommandNotStarted')";
    char sql[768];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE agent_id LIKE '%s' AND "
             "status IN ('Requested','Dispatched','Running')",
             agent_id);
    int i;
    for (i = 0; i < timeout_s * 10 && sql_long(pg, sql) != 0; i++)
        sleep_ms(100);
    ck_assert_msg(sql_long(pg, sql) == 0, "commands of %s still open",
                  agent_id);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands c WHERE c.agent_id LIKE '%s' AND "
             "(SELECT count(*) FROM events e WHERE e.stream_id = 'command-' "
             "|| c.command_id AND e.type IN %s) <> 1",
             agent_id, term);
    ck_assert_int_eq(sql_long(pg, sql), 0);
}

/* `kscore exec --detach` of `sleep N` on agent, willing to wait 10 min
 * for a slot: its command id. */
static void
detach_run(const char *agent, const char *const *cmd, char id[37])
{
    const char *args[16] = {"exec", "--agent", agent, "--detach",
                            "--deliver-within", "10m", "--"};
    size_t n = 7;
    for (size_t i = 0; cmd[i] && n + 1 < sizeof(args) / sizeof(args[0]); i++)
        args[n++] = cmd[i];
    args[n] = NULL;
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exec --detach: %d %s", o.status, o.err);
    snprintf(id, 37, "%.36s", o.out);
    ck_assert_msg(ks_is_uuid(id), "not a command id: %s", o.out);
    fixture_out_release(&o);
}

static void
detach_sleep(const char *agent, const char *secs, char id[37])
{
    const char *cmd[] = {"sleep", secs, NULL};
    detach_run(agent, cmd, id);
}

/* Starts agent id (daemon name) with slots slots, and runs one `sleep
 * secs` on it: what a slot is held for, as the broker measures it. */
static void
agent_with_hold(const char *name, const char *id, const char *slots,
                const char *secs)
{
    const char *extra[] = {"--max-concurrent", slots, NULL};
    const char *args[] = {"exec", "--agent", id, "--", "sleep", secs, NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_agent_spawn(&stack, name, id, extra), 0);
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exec: %d %s", o.status, o.err);
    fixture_out_release(&o);
}

/*
 * An agent whose one slot is taken, with two more commands waiting behind
 * it (they were willing to wait), each holding the slot about 2 s: a
 * command that must start within 2 s cannot, so it is refused at once
 * (exit 75), naming the agent and the deadline, and nothing is recorded,
 * also with an idempotency key (the key is looked up first: it names
 * nothing); one that gave no deadline is given 250 ms and refused the
 * same way. Once the slot is free again the same command runs. Before
 * admission it was accepted and ended Undeliverable (exit 125) after its
 * deadline.
 */
START_TEST(exec_refused_when_it_cannot_start_in_time)
{
    PGconn *pg = db();
    struct fixture_out o;
    char held[37], q1[37], q2[37];

    agent_with_hold("agent-ov1", "ov1", "1", "2");
    detach_sleep("ov1", "300", held);
    wait_status(pg, held, "Running", 60);
    detach_sleep("ov1", "300", q1);
    detach_sleep("ov1", "300", q2);

    const char *busy[] = {"exec", "--agent", "ov1", "--deliver-within", "2s",
                          "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, busy, &o), 0);
    ck_assert_msg(o.status == 75, "exit %d (want 75, busy): %s", o.status,
                  o.err);
    ck_assert_msg(strstr(o.err, "agent ov1 is busy") &&
                      strstr(o.err, "delivery deadline"),
                  "%s", o.err);
    fixture_out_release(&o);
    const char *no_deadline[] = {"exec", "--agent", "ov1", "--", "true",
                                 NULL};
    ck_assert_int_eq(fixture_kscore(&stack, no_deadline, &o), 0);
    ck_assert_msg(o.status == 75, "exit %d (want 75, busy): %s", o.status,
                  o.err);
    ck_assert_msg(strstr(o.err, "without --deliver-within"), "%s", o.err);
    fixture_out_release(&o);
    const char *busy_key[] = {"exec",  "--agent", "ov1", "--deliver-within",
                              "2s",    "--idempotency-key", "ov-key-1",
                              "--json", "--",     "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, busy_key, &o), 0);
    ck_assert_msg(o.status == 75, "exit %d (want 75, busy): %s", o.status,
                  o.err);
    {
        json_t *j = json_loads(o.out, 0, NULL);
        ck_assert_msg(j != NULL, "%s", o.out);
        ck_assert_str_eq(
            json_string_value(json_object_get(j, "error_code")), "KS_EBUSY");
        ck_assert(json_is_false(json_object_get(j, "recorded")));
        json_decref(j);
    }
    fixture_out_release(&o);
    /* Four commands recorded: the refused ones are not. */
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "agent_id = 'ov1'"),
                     4);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "idempotency_key = 'ov-key-1'"),
                     0);

    /* The load goes: the same request runs. */
    const char *ids[] = {q2, q1, held};
    for (int i = 0; i < 3; i++) {
        const char *args[] = {"cancel", ids[i], NULL};
        ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
        fixture_out_release(&o);
    }
    all_ended_once(pg, "ov1", 60);
    ck_assert_int_eq(fixture_kscore(&stack, busy_key, &o), 0);
    ck_assert_msg(o.status == 0, "after the load: exit %d %s", o.status,
                  o.err);
    fixture_out_release(&o);
    all_ended_once(pg, "ov1", 30);
    PQfinish(pg);
    stack_stop(stack.dir, "agent-ov1", 20000);
}
END_TEST

/* Requests queued in broker_refuses_while_its_queue_stalls: more than the
 * broker's exec workers (BROKER_EXEC_WORKERS, 8). */
#define REQUESTS 12

/*
 * The broker's own queue: PostgreSQL stalls its writes (a transaction
 * holds the events table), so its exec workers wait and requests queue up
 * behind them. Once the oldest has waited past the broker's limit, a new
 * `kscore exec` is refused at once (exit 75, "the broker is busy") rather
 * than waiting for the database; the queued ones are all served once the
 * stall ends, each command ending once. Before admission the exec waited
 * in the queue, unanswered.
 */
START_TEST(broker_refuses_while_its_queue_stalls)
{
    const char *extra[] = {"--max-concurrent", "8", NULL};
    PGconn *pg = db(), *lock = db();
    struct evt_conn *c = NULL;
    struct evt_inbox *ib = NULL;
    char subject[192];
    struct fixture_out o;
    int answered = 0, busy = 0;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-ov2", "ov2", extra),
                     0);
    c = fixture_client(&stack);
    ck_assert_int_eq(evt_inbox_take(c, NULL, &ib), 0);
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_EXECUTE, c->identity);

    PGresult *res = PQexec(lock, "BEGIN; LOCK TABLE events IN ACCESS "
                                 "EXCLUSIVE MODE");
    ck_assert_int_eq(PQresultStatus(res), PGRES_COMMAND_OK);
    PQclear(res);
    /* More detached requests than the broker has exec workers: those
     * take the workers (stalled on the lock), the rest wait in the
     * intake. */
    for (int i = 0; i < REQUESTS; i++) {
        Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
        Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
        char *argv[] = {"true"}, suffix[16];
        uint8_t *buf = NULL;
        size_t len = 0;
        spec.argv = argv;
        spec.n_argv = 1;
        req.spec = &spec;
        req.agent_id = "ov2";
        req.detach = 1;
        snprintf(suffix, sizeof(suffix), "%d", i);
        ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
        ck_assert_int_eq(evt_inbox_send(ib, subject, suffix, NULL, buf, len),
                         0);
        free(buf);
    }
    natsConnection_Flush(c->nc);
    /* Longer than the broker's limit (BROKER_QUEUE_MAX_MS, 250 ms): the
     * oldest queued request has waited at least this long. */
    sleep_ms(2000);
    const char *args[] = {"exec", "--agent", "ov2", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 75, "exit %d (want 75, busy): %s", o.status,
                  o.err);
    ck_assert_msg(strstr(o.err, "the broker is busy"), "%s", o.err);
    fixture_out_release(&o);

    res = PQexec(lock, "COMMIT");
    PQclear(res);
    /* Nothing the intake took is lost: all are accepted and end. */
    while (answered < REQUESTS) {
        natsMsg *m = NULL;
        Ks__ExecuteReply *rep = NULL;
        if (evt_inbox_next(ib, 30000, &m) != 0)
            break;
        if (evt_unpack_reply(&ks__execute_reply__descriptor,
                             natsMsg_GetData(m),
                             (size_t)natsMsg_GetDataLength(m),
                             (ProtobufCMessage **)&rep) == 0) {
            busy += rep->error_code == KS_EBUSY;
            ck_assert_msg(rep->error_code == 0 || rep->error_code == KS_EBUSY,
                          "%s", rep->error);
            ks__execute_reply__free_unpacked(rep, NULL);
        }
        answered++;
        natsMsg_Destroy(m);
    }
    ck_assert_int_eq(answered, REQUESTS);
    ck_assert_int_eq(busy, 0);
    all_ended_once(pg, "ov2", 60);
    char sql[128];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE agent_id = 'ov2' AND "
             "status = 'Succeeded'");
    ck_assert_int_eq(sql_long(pg, sql), REQUESTS);
    evt_inbox_give(ib);
    evt_close(c);
    PQfinish(lock);
    PQfinish(pg);
    stack_stop(stack.dir, "agent-ov2", 20000);
}
END_TEST

/* What `kscore agents --json` says agent_id runs (-1: not listed). */
static long
agent_running(const char *agent_id)
{
    const char *args[] = {"agents", "--json", NULL};
    struct fixture_out o;
    long running = -1;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    for (char *line = o.out; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        json_t *j = json_loads(line, 0, NULL);
        const char *id = json_string_value(json_object_get(j, "agent_id"));
        if (id && strcmp(id, agent_id) == 0)
            running = (long)json_integer_value(json_object_get(j, "running"));
        json_decref(j);
        line = nl ? nl + 1 : NULL;
    }
    fixture_out_release(&o);
    return running;
}

/* Once agent id's heartbeat says it runs nothing (it is sent every 2 s),
 * a command with no deadline of its own is accepted by it: what the
 * broker has not seen end is not a slot taken (why: the case, for the
 * failure's message). */
static void
idle_agent_is_not_busy(const char *id, const char *why)
{
    int i;
    for (i = 0; i < 100 && agent_running(id) != 0; i++)
        sleep_ms(100);
    ck_assert_msg(i < 100, "%s never said it ran nothing", id);
    const char *args[] = {"exec", "--agent", id, "--detach", "--", "true",
                          NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: an agent whose ends %s was "
                                 "refused: %s",
                  o.status, why, o.err);
    fixture_out_release(&o);
}

/* `kscore exec --detach` (deliver within 10 min) on agent of a command
 * that sleeps 1 s and then makes <stack>/marked-<n>: its id. */
static void
detach_marked(const char *agent, int n, char id[37])
{
    char script[PATH_MAX + 64];
    snprintf(script, sizeof(script), "sleep 1; touch %s/marked-%d",
             stack.dir, n);
    const char *cmd[] = {"sh", "-c", script, NULL};
    detach_run(agent, cmd, id);
}

/* Waits (<= 60 s) for <stack>/marked-<n>: command n's child has ended. */
static void
wait_marked(int n)
{
    char path[PATH_MAX + 32];
    snprintf(path, sizeof(path), "%s/marked-%d", stack.dir, n);
    for (int i = 0; i < 600 && access(path, F_OK) != 0; i++)
        sleep_ms(100);
    ck_assert_msg(access(path, F_OK) == 0, "%s never made", path);
}

/*
 * An agent is not busy because its ends wait for the record. Its two
 * slots held about 1 s each (measured); four commands have run and ended
 * on it, but the recorder cannot take their ends: the first two's stream
 * rows are locked by another transaction (a stalled record: a lock, a
 * slow disk; in a cluster, the recorder's consumer electing a leader,
 * test_cluster F02). The recorder fails nothing, it waits; the agent's
 * heartbeat says its slots are free, so a command with no deadline of its
 * own is accepted, not refused as "busy: 4 commands in flight on its 2
 * slots" (it was: exit 75). When the lock goes, every command ends, each
 * once.
 */
START_TEST(ends_the_record_waits_for_are_not_in_flight)
{
    PGconn *pg = db(), *lock = db();
    char x[4][37], sql[512];

    agent_with_hold("agent-ov3", "ov3", "2", "1");
    detach_marked("ov3", 0, x[0]);
    detach_marked("ov3", 1, x[1]);
    wait_status(pg, x[0], "Running", 60);
    wait_status(pg, x[1], "Running", 60);
    /* Their ends cannot be recorded: their streams' rows are held. */
    snprintf(sql, sizeof(sql),
             "BEGIN; SELECT 1 FROM streams WHERE stream_id IN "
             "('command-%s', 'command-%s') FOR UPDATE",
             x[0], x[1]);
    PGresult *res = PQexec(lock, sql);
    ck_assert_msg(PQresultStatus(res) == PGRES_TUPLES_OK, "%s",
                  PQerrorMessage(lock));
    PQclear(res);
    /* Two more take the slots the first two leave, and end too. */
    detach_marked("ov3", 2, x[2]);
    detach_marked("ov3", 3, x[3]);
    for (int i = 0; i < 4; i++)
        wait_marked(i);
    idle_agent_is_not_busy("ov3", "wait for the record");

    res = PQexec(lock, "COMMIT");
    PQclear(res);
    all_ended_once(pg, "ov3", 60);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "agent_id = 'ov3' AND status = "
                                  "'Succeeded'"),
                     6);
    PQfinish(lock);
    PQfinish(pg);
    stack_stop(stack.dir, "agent-ov3", 20000);
}
END_TEST

/* Sets KSCORE_EVENTS's max_bytes (its discard policy is new: a publish
 * past it is refused); *was (may be NULL): what it was. */
static void
events_max_bytes(struct evt_conn *c, int64_t bytes, int64_t *was)
{
    jsStreamInfo *si = NULL, *up = NULL;
    jsErrCode jerr = 0;
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, EVT_STREAM_EVENTS, NULL,
                                      &jerr),
                     NATS_OK);
    if (was)
        *was = si->Config->MaxBytes;
    si->Config->MaxBytes = bytes;
    natsStatus s = js_UpdateStream(&up, c->js, si->Config, NULL, &jerr);
    ck_assert_msg(s == NATS_OK, "stream update: %s (%d)",
                  natsStatus_GetText(s), (int)jerr);
    jsStreamInfo_Destroy(up);
    jsStreamInfo_Destroy(si);
}

/*
 * An agent is not busy because the event stream refuses its ends: its
 * word on what it runs bounds what the broker counts. KSCORE_EVENTS takes
 * no more (its max_bytes: in a cluster, its leader's election does the
 * same), so the ends of four commands that ran and ended on an agent of
 * two slots wait in the agent's outbox, and the broker, which records
 * them, sees none of them end; nothing fails on the broker's side to
 * tell it (its recorder's pulls come back empty). The agent's heartbeat
 * says it runs nothing, so a command with no deadline of its own is
 * accepted (it was refused: "busy: 4 commands in flight on its 2
 * slots", exit 75). When the stream takes them again, every command
 * ends, each once.
 */
START_TEST(ends_the_stream_refuses_are_not_in_flight)
{
    PGconn *pg = db();
    struct evt_conn *c = fixture_client(&stack);
    char x[4][37];
    int64_t was = 0;

    agent_with_hold("agent-ov4", "ov4", "2", "1");
    events_max_bytes(c, 1, &was);
    for (int i = 0; i < 4; i++)
        detach_marked("ov4", 10 + i, x[i]);
    for (int i = 0; i < 4; i++)
        wait_marked(10 + i);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "agent_id = 'ov4' AND status = 'Running'"),
                     4);
    idle_agent_is_not_busy("ov4", "the stream refuses");

    events_max_bytes(c, was, NULL);
    all_ended_once(pg, "ov4", 60);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "agent_id = 'ov4' AND status = "
                                  "'Succeeded'"),
                     6);
    evt_close(c);
    PQfinish(pg);
    stack_stop(stack.dir, "agent-ov4", 20000);
}
END_TEST

/* The fleet of batch_paces_a_fleet_smaller_than_it: 2,000 ids in the
 * broker's own pool (its local agents: one process, 8 slots). */
#define PACE_IDS 2000
static struct fixture_stack fleet;

static void
fleet_up(void)
{
    if (fixture_stack_start(&fleet, NULL, PACE_IDS) != 0) {
        fixture_stack_stop(&fleet);
        exit(1);
    }
}

static void
fleet_down(void)
{
    fixture_stack_stop(&fleet);
}

/*
 * A batch to 2,000 ids of one agent process that runs 8 commands at a
 * time (the broker's local agents), each target to be claimed within 2 s
 * of its dispatch: many times more than the process can start in 2 s.
 * The broker dispatches a target only when the process can take it up,
 * so every one succeeds, each in one terminal event. Before pacing, all
 * 2,000 went out at once and those queued longest ended Undeliverable.
 */
START_TEST(batch_paces_a_fleet_smaller_than_it)
{
    struct fixture_out o;
    PGconn *pg = PQconnectdb(fleet.pg.conninfo);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));

    const char *args[] = {"batch",   "--select", "local=true",
                          "--deliver-within", "2s", "--yes", "--json",
                          "--",      "true",     NULL};
    ck_assert_int_eq(fixture_kscore(&fleet, args, &o), 0);
    ck_assert_msg(o.status == 0, "batch exit %d: %.400s", o.status, o.err);
    /* The summary is the last line. */
    char *last = o.out, *nl;
    while ((nl = strchr(last, '\n')) && nl[1])
        last = nl + 1;
    json_t *j = json_loads(last, JSON_DISABLE_EOF_CHECK, NULL);
    ck_assert_msg(j != NULL, "no summary: %.300s", last);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total")),
                     PACE_IDS);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "succeeded")),
                     PACE_IDS);
    json_decref(j);
    fixture_out_release(&o);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands c WHERE "
                                  "(SELECT count(*) FROM events e WHERE "
                                  "e.stream_id = 'command-' || c.command_id "
                                  "AND e.type IN ('CommandCompleted',"
                                  "'CommandStartFailed','CommandUndeliverable',"
                                  "'CommandLost','CommandCancelled',"
                                  "'CommandNotStarted')) <> 1"),
                     0);
    PQfinish(pg);
}
END_TEST

static Suite *
overload_suite(void)
{
    Suite *s = suite_create("overload");
    TCase *tc = tcase_create("overload");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, exec_refused_when_it_cannot_start_in_time);
    tcase_add_test(tc, broker_refuses_while_its_queue_stalls);
    tcase_add_test(tc, ends_the_record_waits_for_are_not_in_flight);
    tcase_add_test(tc, ends_the_stream_refuses_are_not_in_flight);
    suite_add_tcase(s, tc);
    /* A stack of its own: a broker with 2,000 local agents. */
    tc = tcase_create("pace");
    tcase_add_unchecked_fixture(tc, fleet_up, fleet_down);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, batch_paces_a_fleet_smaller_than_it);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(overload_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
