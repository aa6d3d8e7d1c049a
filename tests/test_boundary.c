/*
 * The trust boundary with a raw NATS client: what an agent may add to the
 * record, what a claim may do, reply addresses, and every request field's
 * rules (broker/validate.c, events/wire.c). Real nats-server, PostgreSQL,
 * broker and agent; the hostile messages are crafted byte by byte where
 * the protobuf-c API cannot make them (a NUL inside a string).
 */
#include <check.h>
#include <errno.h>
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

#define AGENT "bnd-agent"

static struct fixture_stack stack;
static char side[PATH_MAX];

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, AGENT, 0) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
    snprintf(side, sizeof(side), "%.4000s/side", stack.dir);
    mkdir(side, 0777);
    chmod(side, 0777);
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

static struct evt_conn *
client(const char *identity)
{
    struct evt_connect_opts o = {
        .name = "boundary", .send_asap = true, .identity = identity};
    struct evt_conn *c = NULL;
    ck_assert_int_eq(evt_connect(stack.nats.url, &o, &c, NULL), 0);
    return c;
}

static long
sql_long(const char *sql)
{
    return fixture_sql_long(stack.pg.conninfo, sql);
}

static long
wait_long(const char *sql, long want, int timeout_ms)
{
    return fixture_wait_sql(stack.pg.conninfo, sql, want, timeout_ms);
}

/* Publishes ev as agent `as` would (its own event subject) through
 * JetStream, with Nats-Msg-Id = event_id. */
static void
publish_event(struct evt_conn *c, const char *as, Ks__Event *ev)
{
    char subject[200];
    uint8_t *buf;
    size_t len;
    natsMsg *reply = NULL;
    ck_assert_int_eq(kproto_pack(&ev->base, &buf, &len), 0);
    evt_event_subject(subject, sizeof(subject), as, ev->command_id);
    ck_assert_int_eq(
        evt_request_bytes(c, subject, ev->event_id, buf, len, 3000, &reply),
        0);
    natsMsg_Destroy(reply);
    free(buf);
}

/* A detached command on the stack's agent; its id. */
static void
run_detached(struct evt_conn *c, const char *script, char id[37])
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__ExecuteReply *rep = NULL;
    char *argv[] = {"sh", "-c", (char *)script};
    spec.argv = argv;
    spec.n_argv = 3;
    req.spec = &spec;
    req.agent_id = AGENT;
    req.detach = 1;
    ck_assert_int_eq(broker_execute(c, &req, 5000, &rep), 0);
    ck_assert_msg(rep->error_code == 0, "%s", rep->error);
    snprintf(id, 37, "%s", rep->command_id);
    ks__execute_reply__free_unpacked(rep, NULL);
}

/*
 * Issue 11 input 1: an agent publishes, on its own subject, a
 * CommandRequested for another agent and a CommandDispatched with a past
 * deadline. Nothing is recorded as a command; the reports are kept as
 * ReportRejected on the reporter's stream; the scanner signs nothing.
 */
START_TEST(agent_cannot_inject_a_command)
{
    struct evt_conn *c = client("agent-" AGENT);
    char cid[37], e1[37], e2[37], stream[64], sql[512], marker[PATH_MAX + 64];
    char script[PATH_MAX + 128];
    Ks__Event req = KS__EVENT__INIT, disp = KS__EVENT__INIT;
    Ks__Command cmd = KS__COMMAND__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;

    ks_uuid(cid);
    ks_uuid(e1);
    ks_uuid(e2);
    snprintf(stream, sizeof(stream), "command-%s", cid);
    snprintf(marker, sizeof(marker), "%s/injected", side);
    snprintf(script, sizeof(script), "touch %s", marker);
    char *argv[] = {"sh", "-c", script};
    spec.argv = argv;
    spec.n_argv = 3;
    cmd.command_id = cid;
    cmd.agent_id = AGENT; /* any agent: here the stack's own */
    cmd.spec = &spec;
    cmd.operator_ = "root";
    cmd.issued_at_us = ks_now_us() - 60000000;
    cmd.not_after_us = ks_now_us() + 60000000;
    req.event_id = e1;
    req.stream_id = stream;
    req.type = "CommandRequested";
    req.command_id = cid;
    req.agent_id = AGENT;
    req.command = &cmd;
    req.occurred_at_us = ks_now_us();
    disp = req;
    disp.event_id = e2;
    disp.type = "CommandDispatched";
    disp.command = NULL;
    disp.attempt = 1;
    disp.deliver_by_us = ks_now_us() - 1000000; /* overdue: re-dispatch */
    publish_event(c, AGENT, &req);
    publish_event(c, AGENT, &disp);

    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'agent-%s' AND "
             "type = 'ReportRejected' AND event_id IN ('%s', '%s')",
             AGENT, e1, e2);
    ck_assert_int_eq(wait_long(sql, 2, 10000), 2);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s'", cid);
    ck_assert_int_eq(sql_long(sql), 0);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM streams WHERE stream_id = '%s'", stream);
    ck_assert_int_eq(sql_long(sql), 0);
    /* Give the scanner several periods: nothing is signed or run. */
    nanosleep(&(struct timespec){1, 500000000L}, NULL);
    ck_assert_int_ne(access(marker, F_OK), 0);
    evt_close(c);
}
END_TEST

/*
 * Issue 11 input 3: another agent reports a result for a command running
 * on the stack's agent. Refused (ReportRejected, with the reason); the real
 * result is the one recorded.
 */
START_TEST(another_agent_cannot_report_a_result)
{
    struct evt_conn *op = client("root");
    struct evt_conn *evil = client("agent-evil");
    char id[37], eid[37], stream[64], sql[512];
    Ks__Event ev = KS__EVENT__INIT;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
    Ks__Output out = KS__OUTPUT__INIT;

    /* Running until the forgery is refused: a `sleep 1` could end
     * before wait_long saw it Running, on a loaded machine. */
    struct fixture_gate gate;
    char script[sizeof(gate.sh) + 32];
    fixture_gate_init(&gate, side, "report");
    snprintf(script, sizeof(script), "%s; echo real", gate.sh);
    run_detached(op, script, id);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Running'",
             id);
    ck_assert_int_eq(wait_long(sql, 1, 10000), 1);
    ks_uuid(eid);
    snprintf(stream, sizeof(stream), "command-%s", id);
    out.data.data = (uint8_t *)"FORGED";
    out.data.len = 6;
    r.status = KS__COMMAND_STATUS__SUCCEEDED;
    r.has_exit_code = 1;
    r.stdout = &out;
    ev.event_id = eid;
    ev.stream_id = stream;
    ev.type = "CommandCompleted";
    ev.command_id = id;
    ev.agent_id = "evil";
    ev.attempt = 1;
    ev.result = &r;
    ev.occurred_at_us = ks_now_us();
    publish_event(evil, "evil", &ev);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE event_id = '%s' AND type = "
             "'ReportRejected'",
             eid);
    ck_assert_int_eq(wait_long(sql, 1, 10000), 1);
    fixture_gate_open(&gate);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded' AND agent_id = '%s' AND "
             "stdout = convert_to(E'real\\n', 'UTF8')",
             id, AGENT);
    ck_assert_int_eq(wait_long(sql, 1, 15000), 1);
    evt_close(evil);
    evt_close(op);
}
END_TEST

/* Claims command id (Dispatched at version 2, attempt 1, for AGENT) as c
 * with a start failure of status st whose stdout is "FORGED"; the reply
 * (the caller frees it). */
static Ks__ClaimReply *
claim_with_forged_output(struct evt_conn *c, const char *id,
                         Ks__CommandStatus st)
{
    Ks__ClaimRequest cr = KS__CLAIM_REQUEST__INIT;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
    Ks__Output out = KS__OUTPUT__INIT;
    Ks__ClaimReply *rep = NULL;
    char eid[37];

    ks_uuid(eid);
    out.data.data = (uint8_t *)"FORGED";
    out.data.len = 6;
    out.total_bytes = 6;
    r.status = st;
    r.has_exit_code = st == KS__COMMAND_STATUS__SUCCEEDED;
    r.start_stage = st == KS__COMMAND_STATUS__START_FAILED ? "exec" : "";
    r.stdout = &out;
    cr.command_id = (char *)id;
    cr.attempt = 1;
    cr.agent_id = AGENT;
    cr.event_id = eid;
    cr.expected_version = 2;
    cr.start_failure = &r;
    ck_assert_int_eq(broker_call(c, EVT_API_CLAIM, &cr.base,
                                 &ks__claim_reply__descriptor, 5000,
                                 (ProtobufCMessage **)&rep),
                     0);
    ck_assert(!rep->granted);
    return rep;
}

/* The command ended Succeeded on its own agent, without the forgery. */
static void
assert_not_forged(const char *id)
{
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded' AND coalesce(stdout, '') <> "
             "'FORGED'::bytea",
             id);
    ck_assert_int_eq(wait_long(sql, 1, 15000), 1);
}

/*
 * Issue 11 input 2: a claim whose start_failure says Succeeded (with
 * output) is refused, and the command runs for real.
 */
START_TEST(claim_cannot_forge_a_result)
{
    struct evt_conn *op = client("root");
    char id[37];

    /* A command that cannot be claimed by its agent for a while: to an
     * agent id that is known but whose consumer is this test (none). */
    run_detached(op, "sleep 2", id);
    Ks__ClaimReply *rep =
        claim_with_forged_output(op, id, KS__COMMAND_STATUS__SUCCEEDED);
    ck_assert_int_ne(rep->error_code, 0);
    ks__claim_reply__free_unpacked(rep, NULL);
    assert_not_forged(id);
    evt_close(op);
}
END_TEST

/*
 * A claim's start failure says nothing ran, so it carries no output, exit
 * code or signal: on cf06db5 the addressed agent's credential could put
 * forged stdout in the record as a StartFailed command's (issue 21).
 * Refused before anything is appended, whatever the race with the real
 * agent; the command ends without it.
 */
START_TEST(a_claims_start_failure_carries_no_output)
{
    struct evt_conn *op = client("root");
    struct evt_conn *ag = client("agent-" AGENT);
    char id[37], sql[512];

    run_detached(op, "sleep 1", id);
    Ks__ClaimReply *rep =
        claim_with_forged_output(ag, id, KS__COMMAND_STATUS__START_FAILED);
    ck_assert_int_eq(rep->error_code, KS_EINVAL);
    ck_assert_msg(strstr(rep->error, "no output"), "%s", rep->error);
    ks__claim_reply__free_unpacked(rep, NULL);
    assert_not_forged(id);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'command-%s' AND "
             "type = 'CommandStartFailed'", id);
    ck_assert_int_eq(sql_long(sql), 0);
    evt_close(ag);
    evt_close(op);
}
END_TEST

static int
claim_as(const char *identity, const char *command_id, const char *agent_id,
         uint64_t version, char *err, size_t err_len)
{
    struct evt_conn *c = client(identity);
    Ks__ClaimRequest cr = KS__CLAIM_REQUEST__INIT;
    Ks__ClaimReply *rep = NULL;
    char eid[37];
    int rc;
    ks_uuid(eid);
    cr.command_id = (char *)command_id;
    cr.attempt = 1;
    cr.agent_id = (char *)agent_id;
    cr.event_id = eid;
    cr.expected_version = version;
    ck_assert_int_eq(broker_call(c, EVT_API_CLAIM, &cr.base,
                                 &ks__claim_reply__descriptor, 5000,
                                 (ProtobufCMessage **)&rep),
                     0);
    rc = rep->granted ? 0 : rep->error_code;
    snprintf(err, err_len, "%s", rep->error);
    ks__claim_reply__free_unpacked(rep, NULL);
    evt_close(c);
    return rc;
}

/*
 * Issue 11 input 2, who claims: only the agent the command is addressed
 * to, as NATS vouches (the subject's identity), may claim it; an operator,
 * another agent naming itself, or another agent naming the right agent are
 * all refused, and the command still runs on its own agent, once.
 */
START_TEST(only_the_addressed_agent_may_claim)
{
    struct evt_conn *op = client("root");
    char id[37], err[256], sql[512], marker[PATH_MAX + 64];
    char script[PATH_MAX + 128];

    snprintf(marker, sizeof(marker), "%s/claimed", side);
    snprintf(script, sizeof(script), "sleep 1; echo x >> %s", marker);
    run_detached(op, script, id);
    /* The claims race the real agent's: whatever their order, none of
     * these may win. */
    ck_assert_int_eq(claim_as("root", id, AGENT, 2, err, sizeof(err)),
                     KS_EDENIED);
    ck_assert_msg(strstr(err, "only agent-" AGENT), "%s", err);
    ck_assert_int_eq(claim_as("agent-evil", id, AGENT, 2, err, sizeof(err)),
                     KS_EDENIED);
    int rc = claim_as("agent-evil", id, "evil", 2, err, sizeof(err));
    ck_assert_msg(rc == KS_EDENIED, "rc %d: %s", rc, err);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded' AND agent_id = '%s'",
             id, AGENT);
    ck_assert_int_eq(wait_long(sql, 1, 15000), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'command-%s' "
             "AND type = 'CommandStarted' AND position(convert_to('evil', "
             "'UTF8') in data) > 0",
             id);
    ck_assert_int_eq(sql_long(sql), 0);
    FILE *f = fopen(marker, "r");
    int lines = 0;
    char line[16];
    while (f && fgets(line, sizeof(line), f))
        lines++;
    if (f)
        fclose(f);
    ck_assert_int_eq(lines, 1);
    evt_close(op);
}
END_TEST

/*
 * A client may publish to a stream subject (an agent to its own) with a
 * reply address of its choosing, and the server sends the stream's PubAck
 * there from inside: aimed at the JetStream API, {"stream":..,"seq":N}
 * would purge the stream or delete message N. The streams refuse both.
 * Found by a security review.
 */
START_TEST(puback_cannot_purge_or_delete)
{
    struct evt_conn *c = client("agent-" AGENT);
    struct evt_conn *admin = client("broker");
    jsStreamInfo *si = NULL;
    char subject[128], cid[37];
    static const char *const targets[] = {
        "$JS.API.STREAM.PURGE.KSCORE_EVENTS",
        "$JS.API.STREAM.PURGE.KSCORE_CMDS",
        "$JS.API.STREAM.MSG.DELETE.KSCORE_EVENTS",
        NULL};

    ck_assert_int_eq(js_GetStreamInfo(&si, admin->js, EVT_STREAM_EVENTS,
                                      NULL, NULL),
                     NATS_OK);
    uint64_t before = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    for (int i = 0; targets[i]; i++) {
        ks_uuid(cid);
        evt_event_subject(subject, sizeof(subject), AGENT, cid);
        ck_assert_int_eq(natsConnection_PublishRequestString(
                             c->nc, subject, targets[i], "x"),
                         NATS_OK);
    }
    natsConnection_Flush(c->nc);
    nanosleep(&(struct timespec){0, 500 * 1000000L}, NULL);
    ck_assert_int_eq(js_GetStreamInfo(&si, admin->js, EVT_STREAM_EVENTS,
                                      NULL, NULL),
                     NATS_OK);
    /* Ours were stored (the recorder then acks them away: interest
     * retention), and the stream can be neither purged nor have a
     * message deleted through the API. */
    ck_assert_uint_ge(si->State.LastSeq, before + 3);
    ck_assert(si->Config->DenyPurge && si->Config->DenyDelete);
    jsStreamInfo_Destroy(si);
    ck_assert_int_eq(js_GetStreamInfo(&si, admin->js, EVT_STREAM_CMDS, NULL,
                                      NULL),
                     NATS_OK);
    ck_assert(si->Config->DenyPurge && si->Config->DenyDelete);
    jsStreamInfo_Destroy(si);
    evt_close(admin);
    evt_close(c);
}
END_TEST

/*
 * One report the database cannot hold (a time out of range) must not stop
 * recording for everyone: it is refused, and the next command runs.
 * Found by a security review.
 */
/*
 * What an agent publishes to its event subjects is stored only until it
 * is recorded: KSCORE_EVENTS has interest retention, and a byte limit
 * with discard new for what waits unrecorded. On cf06db5 (limits
 * retention, 24 h, no byte limit) 100 MB of one agent's reports stayed
 * stored for a day after they were recorded (issue 21); here 8 MB of junk
 * reports are recorded as rejected and leave the stream.
 */
START_TEST(an_agents_flood_is_not_kept)
{
    struct evt_conn *agent = client("agent-" AGENT);
    struct evt_conn *admin = client("broker");
    static char junk[16 * 1024];
    char subject[200], cid[37];
    jsStreamInfo *si = NULL;

    memset(junk, 'j', sizeof(junk));
    for (int i = 0; i < 500; i++) {
        ks_uuid(cid);
        evt_event_subject(subject, sizeof(subject), AGENT, cid);
        ck_assert_int_eq(natsConnection_Publish(agent->nc, subject, junk,
                                                (int)sizeof(junk)),
                         NATS_OK);
    }
    ck_assert_int_eq(natsConnection_Flush(agent->nc), NATS_OK);
    uint64_t msgs = 1, bytes = 0;
    for (int i = 0; i < 300 && msgs; i++) {
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
        ck_assert_int_eq(js_GetStreamInfo(&si, admin->js, EVT_STREAM_EVENTS,
                                          NULL, NULL),
                         NATS_OK);
        msgs = si->State.Msgs;
        bytes = si->State.Bytes;
        ck_assert(si->Config->Retention == js_InterestPolicy);
        ck_assert(si->Config->Discard == js_DiscardNew);
        ck_assert_int_eq(si->Config->MaxBytes, EVT_EVENTS_MAX_BYTES);
        jsStreamInfo_Destroy(si);
    }
    ck_assert_msg(msgs == 0, "%llu messages (%llu bytes) stay stored",
                  (unsigned long long)msgs, (unsigned long long)bytes);
    evt_close(admin);
    evt_close(agent);
}
END_TEST

START_TEST(a_poisoned_report_does_not_stop_the_recorder)
{
    struct evt_conn *op = client("root");
    struct evt_conn *agent = client("agent-" AGENT);
    char id[37], eid[37], stream[64], sql[512];
    Ks__Event ev = KS__EVENT__INIT;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;

    /* Running until the poisoned report is refused: a `sleep 2` could
     * end before wait_long saw it Running, on a loaded machine. */
    struct fixture_gate gate;
    fixture_gate_init(&gate, side, "poison");
    run_detached(op, gate.sh, id);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Running'",
             id);
    ck_assert_int_eq(wait_long(sql, 1, 10000), 1);
    ks_uuid(eid);
    snprintf(stream, sizeof(stream), "command-%s", id);
    r.status = KS__COMMAND_STATUS__SUCCEEDED;
    r.has_exit_code = 1;
    r.finished_at_us = INT64_C(-9000000000000000000);
    ev.event_id = eid;
    ev.stream_id = stream;
    ev.type = "CommandCompleted";
    ev.command_id = id;
    ev.agent_id = AGENT;
    ev.attempt = 1;
    ev.result = &r;
    ev.occurred_at_us = ks_now_us();
    publish_event(agent, AGENT, &ev);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE event_id = '%s' AND type = "
             "'ReportRejected'",
             eid);
    ck_assert_int_eq(wait_long(sql, 1, 10000), 1);
    /* The real end is recorded, and a new command runs. */
    fixture_gate_open(&gate);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded'",
             id);
    ck_assert_int_eq(wait_long(sql, 1, 15000), 1);
    char id2[37];
    run_detached(op, "true", id2);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Succeeded'",
             id2);
    ck_assert_int_eq(wait_long(sql, 1, 10000), 1);
    evt_close(agent);
    evt_close(op);
}
END_TEST

/* The raw bytes of an ExecuteRequest for argv, with byte `at` of the
 * packed message replaced by `with` (to put a NUL or bad UTF-8 inside a
 * string, which the protobuf-c API cannot). */
static uint8_t *
crafted(const char *arg1, int at_in_arg, uint8_t with, size_t *len)
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"echo", (char *)arg1};
    uint8_t *buf;
    spec.argv = argv;
    spec.n_argv = 2;
    req.spec = &spec;
    req.agent_id = AGENT;
    ck_assert_int_eq(kproto_pack(&req.base, &buf, len), 0);
    uint8_t *p = memmem(buf, *len, arg1, strlen(arg1));
    ck_assert_ptr_nonnull(p);
    p[at_in_arg] = with;
    return buf;
}

static char *
execute_error(struct evt_conn *c, const uint8_t *buf, size_t len)
{
    char subject[128];
    natsMsg *m = NULL;
    ProtobufCMessage *pm = NULL;
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_EXECUTE,
             c->identity);
    ck_assert_int_eq(evt_request_bytes(c, subject, NULL, buf, len, 5000, &m),
                     0);
    ck_assert_int_eq(evt_unpack(&ks__execute_reply__descriptor,
                                natsMsg_GetData(m),
                                (size_t)natsMsg_GetDataLength(m), &pm),
                     0);
    natsMsg_Destroy(m);
    Ks__ExecuteReply *r = (Ks__ExecuteReply *)pm;
    ck_assert_int_eq(r->error_code, KS_EINVAL);
    ck_assert_str_eq(r->command_id, "");
    char *e = strdup(r->error);
    ks__execute_reply__free_unpacked(r, NULL);
    return e;
}

/*
 * Issue 11 input 7 and its kind: NUL, invalid UTF-8, oversized and out of
 * range fields are refused before anything is recorded, with an error that
 * names the field and the rule.
 */
START_TEST(bad_fields_are_refused_by_name)
{
    struct evt_conn *c = client("root");
    long before = sql_long("SELECT count(*) FROM events");
    size_t len;
    uint8_t *buf;
    char *e;

    buf = crafted("abcXdef", 3, 0x00, &len);
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.spec.argv") && strstr(e, "NUL"),
                  "%s", e);
    free(e);
    free(buf);
    buf = crafted("abcXdef", 3, 0xff, &len);
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.spec.argv") &&
                      strstr(e, "UTF-8"),
                  "%s", e);
    free(e);
    free(buf);

    /* A 10 KB idempotency key, a relative cwd, a timeout past 30 days, an
     * env value with a NUL. */
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"true"};
    char *key = malloc(10240 + 1);
    memset(key, 'k', 10240);
    key[10240] = '\0';
    spec.argv = argv;
    spec.n_argv = 1;
    req.spec = &spec;
    req.agent_id = AGENT;
    req.idempotency_key = key;
    ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.idempotency_key") &&
                      strstr(e, "128"),
                  "%s", e);
    free(e);
    free(buf);
    free(key);
    req.idempotency_key = "";
    spec.cwd = "tmp";
    ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.spec.cwd"), "%s", e);
    free(e);
    free(buf);
    spec.cwd = "";
    spec.timeout_ms = 2592000001ULL;
    ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.spec.timeout_ms") &&
                      strstr(e, "30 days"),
                  "%s", e);
    free(e);
    free(buf);
    spec.timeout_ms = 0;
    Ks__EnvVar ev = KS__ENV_VAR__INIT, *evp = &ev;
    ev.name = "TOKEN";
    ev.value = "secXret";
    spec.env = &evp;
    spec.n_env = 1;
    ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
    uint8_t *p = memmem(buf, len, "secXret", 7);
    p[3] = 0;
    e = execute_error(c, buf, len);
    ck_assert_msg(strstr(e, "ExecuteRequest.spec.env.value") &&
                      strstr(e, "NUL"),
                  "%s", e);
    free(e);
    free(buf);
    /* Nothing was recorded for any of them. */
    ck_assert_int_eq(sql_long("SELECT count(*) FROM events"), before);
    evt_close(c);
}
END_TEST

/*
 * A reply address is where the broker publishes, and the broker may
 * publish anywhere: a request whose reply address is not under the
 * caller's own inbox is dropped unanswered. Here the address is the
 * JetStream API call that deletes the command stream.
 */
START_TEST(reply_address_must_be_the_callers_inbox)
{
    struct evt_conn *c = client("root");
    Ks__GetRequest g = KS__GET_REQUEST__INIT;
    uint8_t *buf;
    size_t len;
    char id[37], subject[128];
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;

    ks_uuid(id);
    g.id = id;
    ck_assert_int_eq(kproto_pack(&g.base, &buf, &len), 0);
    snprintf(subject, sizeof(subject), "%s.root", EVT_API_GET);
    ck_assert_int_eq(natsConnection_PublishRequest(
                         c->nc, subject, "$JS.API.STREAM.DELETE.KSCORE_CMDS",
                         buf, (int)len),
                     NATS_OK);
    /* Another user's inbox: dropped too. */
    ck_assert_int_eq(natsConnection_PublishRequest(c->nc, subject,
                                                   "_INBOX.alice.x.1", buf,
                                                   (int)len),
                     NATS_OK);
    natsConnection_Flush(c->nc);
    free(buf);
    nanosleep(&(struct timespec){0, 500 * 1000000L}, NULL);
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, EVT_STREAM_CMDS, NULL,
                                      &jerr),
                     NATS_OK);
    jsStreamInfo_Destroy(si);
    /* A batch's progress subject is a subject the broker publishes to:
     * only under the caller's inbox. */
    Ks__BatchRequest br = KS__BATCH_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__BatchReply *rep = NULL;
    char *argv[] = {"true"}, *agents[] = {AGENT};
    spec.argv = argv;
    spec.n_argv = 1;
    br.spec = &spec;
    br.agents = agents;
    br.n_agents = 1;
    br.detach = 1;
    br.progress_subject = "$JS.API.STREAM.DELETE.KSCORE_EVENTS";
    ck_assert_int_eq(broker_call(c, EVT_API_BATCH, &br.base,
                                 &ks__batch_reply__descriptor, 5000,
                                 (ProtobufCMessage **)&rep),
                     0);
    ck_assert_int_eq(rep->error_code, KS_EINVAL);
    ck_assert_msg(strstr(rep->error, "progress_subject"), "%s", rep->error);
    ks__batch_reply__free_unpacked(rep, NULL);
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, EVT_STREAM_EVENTS, NULL,
                                      &jerr),
                     NATS_OK);
    jsStreamInfo_Destroy(si);
    evt_close(c);
}
END_TEST

static Suite *
boundary_suite(void)
{
    Suite *s = suite_create("boundary");
    TCase *tc = tcase_create("raw");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, agent_cannot_inject_a_command);
    tcase_add_test(tc, another_agent_cannot_report_a_result);
    tcase_add_test(tc, claim_cannot_forge_a_result);
    tcase_add_test(tc, a_claims_start_failure_carries_no_output);
    tcase_add_test(tc, only_the_addressed_agent_may_claim);
    tcase_add_test(tc, bad_fields_are_refused_by_name);
    tcase_add_test(tc, reply_address_must_be_the_callers_inbox);
    tcase_add_test(tc, puback_cannot_purge_or_delete);
    tcase_add_test(tc, a_poisoned_report_does_not_stop_the_recorder);
    tcase_add_test(tc, an_agents_flood_is_not_kept);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(boundary_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
