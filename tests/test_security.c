/*
 * Security against a real nats-server started with the permissions of
 * deploy/nats-auth.conf.in: signed commands only, each agent confined to its
 * own work, operators confined to the API, a policy that denies, and every
 * refusal recorded.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "events.h"
#include "fixture.h"
#include "stack.h"
#include "store.h"

#define AGENT "sec"
#define OPERATOR "alice"

static struct fixture_stack stack;
static char side[PATH_MAX + 16];
static char policy_path[PATH_MAX + 16];
static char tmpdir[PATH_MAX];

static void
stack_up(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kscore-sec-XXXXXX");
    if (!mkdtemp(tmpdir))
        exit(1);
    snprintf(side, sizeof(side), "%s/side", tmpdir);
    mkdir(side, 0777);
    snprintf(policy_path, sizeof(policy_path), "%s/policy.json", tmpdir);
    FILE *f = fopen(policy_path, "w");
    /* alice: sh, echo and true on env=dev agents; nothing else anywhere. */
    fprintf(f, "{\"operators\": {\"" OPERATOR "\": [{\"agents\": "
               "{\"env\": \"dev\"}, \"executables\": [\"sh\", \"echo\", "
               "\"true\"]}]}}\n");
    fclose(f);
    if (fixture_stack_start_secure(&stack, AGENT, "env=dev", OPERATOR,
                                   policy_path) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
}

/* Connects with an NKey seed file of the stack's registry. */
static struct evt_conn *
connect_as(const char *seed_file)
{
    struct evt_connect_opts o = {.name = "sec-test",
                                 .nkey_file = seed_file,
                                 .timeout_ms = 2000};
    struct evt_conn *c = NULL;
    ck_assert_int_eq(evt_connect(stack.nats.url, &o, &c, NULL), 0);
    return c;
}

static long
sql_long(const char *sql)
{
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    PGresult *r = PQexec(pg, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql,
                  PQerrorMessage(pg));
    long v = atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    PQfinish(pg);
    return v;
}

static uint64_t
cmds_in_stream(struct evt_conn *c)
{
    jsStreamInfo *si = NULL;
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, EVT_STREAM_CMDS, NULL, NULL),
                     NATS_OK);
    uint64_t n = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return n;
}

/* A SignedCommand for AGENT running `sh -c "echo run >> side/<id>"`. */
static void
craft(const struct evt_signer *signer, const char *command_id,
      const char *agent_id, int64_t not_after_us, uint8_t **buf,
      size_t *len)
{
    char script[PATH_MAX + 128];
    char *argv[] = {"sh", "-c", script};
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__Command cmd = KS__COMMAND__INIT;
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    uint8_t sig[EVT_SIGNATURE_BYTES], *inner;
    size_t inner_len;

    snprintf(script, sizeof(script), "echo run >> %s/%s", side, command_id);
    spec.argv = argv;
    spec.n_argv = 3;
    cmd.command_id = (char *)command_id;
    cmd.attempt = 1;
    cmd.agent_id = (char *)agent_id;
    cmd.spec = &spec;
    cmd.issued_at_us = ks_now_us();
    cmd.not_after_us = not_after_us;
    cmd.dispatch_version = 2;
    ck_assert_int_eq(kproto_pack(&cmd.base, &inner, &inner_len), 0);
    sc.command.data = inner;
    sc.command.len = inner_len;
    if (signer) {
        ck_assert_int_eq(evt_sign(signer, inner, inner_len, sig), 0);
        sc.signature.data = sig;
        sc.signature.len = sizeof(sig);
        sc.key_id = (char *)evt_signer_key_id(signer);
    }
    ck_assert_int_eq(kproto_pack(&sc.base, buf, len), 0);
    free(inner);
}

struct reason_find {
    const char *command_id;
    char *reason;
    size_t len;
};

static int
find_reason(const Ks__RecordedEvent *ev, void *ud)
{
    struct reason_find *rf = ud;
    if (ev->event && strcmp(ev->event->command_id, rf->command_id) == 0 &&
        strcmp(ev->event->type, "CommandRejected") == 0)
        snprintf(rf->reason, rf->len, "%s", ev->event->reason);
    return 0;
}

/* Publishes as an attacker with publish rights (the broker user) and waits
 * for the agent's CommandRejected; returns its reason (static buffer). */
static const char *
publish_and_reject(const uint8_t *buf, size_t len, const char *command_id)
{
    static char reason[256];
    struct evt_conn *c = connect_as(stack.broker_seed);
    jsPubAck *pa = NULL;
    char sql[512];
    char subject[64];
    evt_cmd_subject(subject, sizeof(subject), AGENT);
    ck_assert_int_eq(js_Publish(&pa, c->js, subject, buf, (int)len, NULL,
                                NULL),
                     NATS_OK);
    jsPubAck_Destroy(pa);
    evt_close(c);
    reason[0] = '\0';
    /* A refusal of a message naming no recorded command is kept on the
     * agent's own stream (a forged id never creates a command stream); of
     * a recorded one (a replay), on the command's. */
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id IN ('agent-" AGENT
             "', 'command-%s') AND type = 'CommandRejected' AND "
             "position(convert_to('%s', 'UTF8') in data) > 0",
             command_id, command_id);
    for (int i = 0; i < 100 && sql_long(sql) == 0; i++)
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    ck_assert_int_eq(sql_long(sql), 1);
    struct store *st = NULL;
    struct reason_find rf = {command_id, reason, sizeof(reason)};
    ck_assert_int_eq(store_open(stack.pg.conninfo, &st, NULL), 0);
    char cstream[64];
    snprintf(cstream, sizeof(cstream), "command-%s", command_id);
    ck_assert_int_eq(store_read_stream(st, "agent-" AGENT, 0, 0, find_reason,
                                       &rf),
                     0);
    ck_assert_int_eq(store_read_stream(st, cstream, 0, 0, find_reason, &rf),
                     0);
    store_close(st);
    return reason;
}

static int
ran(const char *command_id)
{
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/%s", side, command_id);
    return access(path, F_OK) == 0;
}

START_TEST(refused_commands_never_run)
{
    struct evt_signer *real = NULL, *rogue = NULL;
    char rogue_key[PATH_MAX + 16], rogue_pub[PATH_MAX + 16], id[37];
    uint8_t *buf;
    size_t len;
    int64_t later = ks_now_us() + 60 * 1000000LL;

    ck_assert_int_eq(evt_signer_load(stack.signing_key, &real), 0);
    snprintf(rogue_key, sizeof(rogue_key), "%s/rogue.key", tmpdir);
    snprintf(rogue_pub, sizeof(rogue_pub), "%s/rogue.pub", tmpdir);
    ck_assert_int_eq(evt_keygen(rogue_key, rogue_pub), 0);
    ck_assert_int_eq(evt_signer_load(rogue_key, &rogue), 0);

    ks_uuid(id);
    craft(NULL, id, AGENT, later, &buf, &len);
    ck_assert_str_eq(publish_and_reject(buf, len, id), "missing signature");
    free(buf);
    ck_assert(!ran(id));

    ks_uuid(id);
    craft(rogue, id, AGENT, later, &buf, &len);
    ck_assert_str_eq(publish_and_reject(buf, len, id), "bad signature");
    free(buf);
    ck_assert(!ran(id));

    ks_uuid(id);
    craft(real, id, "someone-else", later, &buf, &len);
    ck_assert_str_eq(publish_and_reject(buf, len, id),
                     "addressed to another agent");
    free(buf);
    ck_assert(!ran(id));

    ks_uuid(id);
    craft(real, id, AGENT, ks_now_us() - 1000000, &buf, &len);
    ck_assert_str_eq(publish_and_reject(buf, len, id),
                     "expired: past its not-after time");
    free(buf);
    ck_assert(!ran(id));

    /* Replay: a real command runs once; the same id signed again (as a
     * captured message would be) is refused and does not run again. */
    char script[PATH_MAX + 64];
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side);
    const char *args[] = {"exec", "--agent", AGENT, "--json", "--", "sh",
                          "-c", script, NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exec: %s", o.err);
    char *p = strstr(o.out, "\"command_id\":\"");
    ck_assert_ptr_nonnull(p);
    snprintf(id, sizeof(id), "%.36s", p + 14);
    fixture_out_release(&o);
    ck_assert(ran(id));
    craft(real, id, AGENT, later, &buf, &len);
    const char *why = publish_and_reject(buf, len, id);
    ck_assert_msg(strncmp(why, "replay", 6) == 0, "reason %s", why);
    free(buf);
    char path[PATH_MAX + 64], line[16];
    snprintf(path, sizeof(path), "%s/%s", side, id);
    FILE *f = fopen(path, "r");
    int lines = 0;
    while (f && fgets(line, sizeof(line), f))
        lines++;
    if (f)
        fclose(f);
    ck_assert_int_eq(lines, 1);
    evt_signer_free(real);
    evt_signer_free(rogue);
}
END_TEST

START_TEST(operator_cannot_publish_commands)
{
    struct evt_conn *admin = connect_as(stack.broker_seed);
    uint64_t before = cmds_in_stream(admin);
    struct evt_conn *op = connect_as(stack.operator_seed);
    jsPubAck *pa = NULL;
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = 1000;
    natsStatus s = js_Publish(&pa, op->js, "kscore.cmd." AGENT, "x", 1, &po,
                              NULL);
    ck_assert_int_ne(s, NATS_OK);
    jsPubAck_Destroy(pa);
    /* Nor another operator's API name. */
    natsMsg *reply = NULL;
    s = natsConnection_RequestString(&reply, op->nc,
                                     "kscore.api.v1.get.broker", "x", 500);
    ck_assert_int_ne(s, NATS_OK);
    natsMsg_Destroy(reply);
    evt_close(op);
    ck_assert_int_eq(cmds_in_stream(admin), before);
    evt_close(admin);
}
END_TEST

/* Subscribes as c to subject; 1 if the server refused it (the refusal is
 * an -ERR that arrives before the PONG of the flush). */
static int
sub_refused(struct evt_conn *c, const char *subject)
{
    natsSubscription *sub = NULL;
    const char *txt = NULL;
    ck_assert_int_eq(natsConnection_SubscribeSync(&sub, c->nc, subject),
                     NATS_OK);
    natsConnection_FlushTimeout(c->nc, 2000);
    natsStatus s = natsConnection_GetLastError(c->nc, &txt);
    natsSubscription_Destroy(sub);
    return s == NATS_NOT_PERMITTED;
}

START_TEST(operator_reads_only_its_own_inbox)
{
    /* A second operator, added to the registry and reloaded as
     * `kscore operator add` does. */
    struct stack_identity bob;
    char bob_seed[PATH_MAX + 64];
    ck_assert_int_eq(stack_ident_add(stack.dir, STACK_OPERATOR, "bob", &bob),
                     0);
    ck_assert_int_eq(fixture_stack_nats_reauth(&stack), 0);
    stack_ident_seed_path(stack.dir, STACK_OPERATOR, "bob", bob_seed,
                          sizeof(bob_seed));

    const char *refused[] = {"_INBOX.bob.>", "_INBOX.>", "_INBOX.*.x",
                             "_INBOX.bob.x.1", ">"};
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        struct evt_conn *alice = connect_as(stack.operator_seed);
        ck_assert_msg(sub_refused(alice, refused[i]),
                      "alice may subscribe to %s", refused[i]);
        evt_close(alice);
    }
    struct evt_conn *alice = connect_as(stack.operator_seed);
    ck_assert_str_eq(alice->identity, OPERATOR);
    ck_assert(!sub_refused(alice, "_INBOX." OPERATOR ".>"));
    evt_close(alice);

    /* bob's replies do not reach alice even when published (by the
     * broker) to his inbox: she cannot hold the subscription. */
    struct evt_conn *b = connect_as(bob_seed);
    ck_assert_str_eq(b->identity, "bob");
    ck_assert(!sub_refused(b, "_INBOX.bob.>"));
    evt_close(b);

    /* And bob calls the API under his own name: the broker hears "bob"
     * (and the policy, which lists only alice, denies him). */
    const char *args[] = {"agents", "--json", NULL};
    struct fixture_out o;
    char *env_seed = strdup(stack.operator_seed);
    snprintf(stack.operator_seed, sizeof(stack.operator_seed), "%s",
             bob_seed);
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    snprintf(stack.operator_seed, sizeof(stack.operator_seed), "%s",
             env_seed);
    free(env_seed);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "operator 'bob' is not in the policy"), "%s",
                  o.err);
    fixture_out_release(&o);
}
END_TEST

START_TEST(agent_cannot_take_another_agents_commands)
{
    struct evt_conn *c = connect_as(stack.agent_seed);
    jsConsumerInfo *ci = NULL;
    jsConsumerConfig cc;
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = 1000;
    jsConsumerConfig_Init(&cc);
    cc.Durable = "agent-other";
    cc.FilterSubject = "kscore.cmd.other";
    cc.AckPolicy = js_AckExplicit;
    /* Cannot create a consumer on another agent's subject... */
    ck_assert_int_ne(js_AddConsumer(&ci, c->js, EVT_STREAM_CMDS, &cc, &jo,
                                    NULL),
                     NATS_OK);
    jsConsumerInfo_Destroy(ci);
    ci = NULL;
    /* ...nor read another agent's consumer, nor a pull of its messages. */
    char local[96], host[64];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(local, sizeof(local), "agent-%s-0", host);
    ck_assert_int_ne(js_GetConsumerInfo(&ci, c->js, EVT_STREAM_CMDS, local,
                                        &jo, NULL),
                     NATS_OK);
    jsConsumerInfo_Destroy(ci);
    natsMsg *reply = NULL;
    char next[160];
    snprintf(next, sizeof(next), "$JS.API.CONSUMER.MSG.NEXT.%s.%s",
             EVT_STREAM_CMDS, local);
    ck_assert_int_ne(natsConnection_RequestString(&reply, c->nc, next, "1",
                                                  500),
                     NATS_OK);
    natsMsg_Destroy(reply);
    evt_close(c);
}
END_TEST

START_TEST(policy_denies_and_records)
{
    struct fixture_out o;
    long before = sql_long("SELECT count(*) FROM events WHERE type = "
                           "'RequestDenied' AND stream_id = 'operator-" OPERATOR
                           "'");
    /* An executable outside the policy. */
    const char *a1[] = {"exec", "--agent", AGENT, "--", "ls", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_ptr_nonnull(strstr(o.err, "denied"));
    fixture_out_release(&o);
    /* An agent without the env=dev label (the in-process one). */
    char host[64], local[96];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(local, sizeof(local), "%s-0", host);
    const char *a2[] = {"exec", "--agent", local, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_ptr_nonnull(strstr(o.err, "denied"));
    fixture_out_release(&o);
    /* Allowed: sh on env=dev. */
    const char *a3[] = {"exec", "--agent", AGENT, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a3, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    fixture_out_release(&o);
    ck_assert_int_eq(sql_long("SELECT count(*) FROM events WHERE type = "
                              "'RequestDenied' AND stream_id = 'operator-" OPERATOR
                              "'"),
                     before + 2);
    /* Every event of the allowed command names its operator. */
    ck_assert_int_eq(
        sql_long("SELECT count(*) FROM events e JOIN commands c ON "
                 "e.stream_id = 'command-' || c.command_id WHERE c.operator "
                 "<> '" OPERATOR "'"),
        0);
}
END_TEST

static Suite *
security_suite(void)
{
    Suite *s = suite_create("security");
    TCase *tc = tcase_create("secure-stack");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, operator_cannot_publish_commands);
    tcase_add_test(tc, agent_cannot_take_another_agents_commands);
    tcase_add_test(tc, operator_reads_only_its_own_inbox);
    tcase_add_test(tc, refused_commands_never_run);
    tcase_add_test(tc, policy_denies_and_records);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(security_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
