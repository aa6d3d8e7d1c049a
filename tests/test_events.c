/*
 * test_events: the events layer's JetStream-as-plain-NATS helpers
 * (events/jetstream.c) and the broker's consumer provisioning
 * (evt_consumer_ensure), pure and against a private nats-server.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "fixture.h"

/* ---- pure ------------------------------------------------------------------ */

START_TEST(puback_parse)
{
    struct evt_puback a;
    char why[200];
    const char *ok = "{\"stream\":\"KSCORE_EVENTS\", \"seq\":42}";
    const char *dup = "{\"stream\":\"S\",\"seq\":7,\"duplicate\":true}";
    const char *err = "{\"error\":{\"code\":503,\"err_code\":10077,"
                      "\"description\":\"maximum messages exceeded\"}}";

    memset(&a, 0, sizeof(a));
    ck_assert_int_eq(evt_puback_parse(ok, strlen(ok), &a, why, sizeof(why)),
                     0);
    ck_assert_str_eq(a.stream, "KSCORE_EVENTS");
    ck_assert_uint_eq(a.seq, 42);
    ck_assert(!a.duplicate);
    ck_assert_int_eq(evt_puback_parse(dup, strlen(dup), &a, NULL, 0), 0);
    ck_assert(a.duplicate);
    ck_assert_uint_eq(a.seq, 7);
    ck_assert_int_eq(evt_puback_parse(err, strlen(err), &a, why, sizeof(why)),
                     KS_ENATS);
    ck_assert_str_eq(why, "maximum messages exceeded (503/10077)");
    /* Anything else is no PubAck. */
    const char *bad[] = {"", "not json", "[]", "{}", "{\"stream\":\"S\"}",
                         "{\"stream\":1,\"seq\":1}",
                         "{\"stream\":\"S\",\"seq\":0}", NULL};
    for (int i = 0; bad[i]; i++)
        ck_assert_msg(evt_puback_parse(bad[i], strlen(bad[i]), &a, why,
                                       sizeof(why)) == KS_EDECODE,
                      "%s", bad[i]);
    ck_assert_int_eq(evt_puback_parse(NULL, 0, NULL, NULL, 0), KS_EDECODE);
}
END_TEST

START_TEST(agent_consumer_shape)
{
    struct evt_agent_consumer ac;

    evt_agent_consumer(&ac, "web-1", 8, 20000);
    ck_assert_str_eq(ac.d.stream, EVT_STREAM_CMDS);
    ck_assert_str_eq(ac.d.durable, "agent-web-1");
    ck_assert_str_eq(ac.d.filter_subject, "kscore.cmd.web-1");
    ck_assert_str_eq(ac.d.deliver_group, "agent-web-1");
    ck_assert_int_eq(ac.d.max_ack_pending, 8);
    ck_assert_int_eq(ac.d.ack_wait_ms, 20000);
    ck_assert_int_eq(ac.d.max_deliver, EVT_AGENT_MAX_DELIVER);
    /* What an agent says is clamped. */
    evt_agent_consumer(&ac, "x", 0, 0);
    ck_assert_int_eq(ac.d.max_ack_pending, 1);
    ck_assert_int_eq(ac.d.ack_wait_ms, EVT_AGENT_ACK_WAIT_DEFAULT_MS);
    evt_agent_consumer(&ac, "x", UINT32_MAX, UINT64_MAX);
    ck_assert_int_eq(ac.d.max_ack_pending, EVT_AGENT_MAX_ACK_PENDING);
    ck_assert_int_eq(ac.d.ack_wait_ms, EVT_AGENT_ACK_WAIT_MAX_MS);
    ck_assert_uint_eq(evt_agent_ack_wait_ms(1), EVT_AGENT_ACK_WAIT_MIN_MS);
    char deliver[64];
    evt_deliver_subject(deliver, sizeof(deliver), ac.d.durable);
    ck_assert_str_eq(deliver, "_KSCORE.deliver.agent-x");
}
END_TEST

/* ---- against nats-server ------------------------------------------------------ */

static struct fixture_nats nats;

static void
nats_up(void)
{
    if (fixture_nats_start(&nats, NULL) != 0)
        exit(1);
}

static void
nats_down(void)
{
    fixture_nats_stop(&nats);
}

static struct evt_conn *
conn(void)
{
    struct evt_conn *c = NULL;
    struct evt_connect_opts o = {.name = "test-events", .send_asap = true};
    ck_assert_int_eq(evt_connect(nats.url, &o, &c, NULL), 0);
    ck_assert_int_eq(evt_setup(c, NULL), 0);
    return c;
}

/* A PubAck without the JetStream API: on the caller's own inbox, a
 * duplicate Nats-Msg-Id a success that says so, no stream "no
 * responders". */
START_TEST(js_publish_as_plain_nats)
{
    struct evt_conn *c = conn();
    struct evt_puback a;
    char why[200];

    ck_assert_int_eq(evt_js_publish_as(c, "agent-p", "kscore.evt.p.x",
                                       "id-1", "a", 1, 2000, &a, why,
                                       sizeof(why)),
                     0);
    ck_assert_str_eq(a.stream, EVT_STREAM_EVENTS);
    ck_assert(!a.duplicate);
    uint64_t seq = a.seq;
    ck_assert_int_eq(evt_js_publish_as(c, "agent-p", "kscore.evt.p.x",
                                       "id-1", "a", 1, 2000, &a, why,
                                       sizeof(why)),
                     0);
    ck_assert(a.duplicate);
    ck_assert_uint_eq(a.seq, seq);
    ck_assert_int_eq(evt_js_publish_as(c, NULL, "kscore.nostream.x", NULL,
                                       "a", 1, 2000, &a, why, sizeof(why)),
                     KS_EUNAVAIL);
    /* A registry entry the broker's KV reader sees. */
    Ks__AgentInfo info = KS__AGENT_INFO__INIT, *got = NULL;
    kvStore *kv = NULL;
    info.agent_id = "p";
    info.version = "t";
    info.host = "h";
    info.max_concurrent = 3;
    info.ack_wait_ms = 9000;
    ck_assert_int_eq(evt_agent_put(c, "agent-p", &info, 2000), 0);
    ck_assert_int_eq(evt_agents_kv(c, &kv), 0);
    ck_assert_int_eq(evt_agent_get(kv, "p", &got), 0);
    ck_assert_uint_eq(got->max_concurrent, 3);
    ck_assert_uint_eq(got->ack_wait_ms, 9000);
    ks__agent_info__free_unpacked(got, NULL);
    kvStore_Destroy(kv);
    evt_close(c);
}
END_TEST

static jsConsumerInfo *
info_of(struct evt_conn *c, const char *durable)
{
    jsConsumerInfo *ci = NULL;
    ck_assert_int_eq(js_GetConsumerInfo(&ci, c->js, EVT_STREAM_CMDS, durable,
                                        NULL, NULL),
                     NATS_OK);
    return ci;
}

/* Created, kept, updated in place for limits, replaced for anything that
 * changes what it delivers where. */
START_TEST(consumer_ensure_corrects)
{
    struct evt_conn *c = conn();
    struct evt_agent_consumer ac;
    enum evt_consumer_change ch = -1;
    jsConsumerInfo *ci;
    char *err = NULL;

    evt_agent_consumer(&ac, "e1", 4, 10000);
    js_DeleteConsumer(c->js, EVT_STREAM_CMDS, "agent-e1", NULL, NULL);
    ck_assert_int_eq(evt_consumer_ensure(c, &ac.d, &ch, &err), 0);
    ck_assert_int_eq(ch, EVT_CONSUMER_CREATED);
    ck_assert_int_eq(evt_consumer_ensure(c, &ac.d, &ch, &err), 0);
    ck_assert_int_eq(ch, EVT_CONSUMER_KEPT);
    ci = info_of(c, "agent-e1");
    ck_assert_str_eq(ci->Config->FilterSubject, "kscore.cmd.e1");
    ck_assert_str_eq(ci->Config->DeliverSubject, "_KSCORE.deliver.agent-e1");
    ck_assert_str_eq(ci->Config->DeliverGroup, "agent-e1");
    ck_assert_int_eq(ci->Config->MaxAckPending, 4);
    ck_assert_int_eq(ci->Config->AckWait, INT64_C(10000) * 1000000);
    ck_assert_int_eq(ci->Config->MaxDeliver, EVT_AGENT_MAX_DELIVER);
    jsConsumerInfo_Destroy(ci);

    evt_agent_consumer(&ac, "e1", 9, 20000);
    ck_assert_int_eq(evt_consumer_ensure(c, &ac.d, &ch, &err), 0);
    ck_assert_int_eq(ch, EVT_CONSUMER_UPDATED);
    ci = info_of(c, "agent-e1");
    ck_assert_int_eq(ci->Config->MaxAckPending, 9);
    ck_assert_int_eq(ci->Config->AckWait, INT64_C(20000) * 1000000);
    jsConsumerInfo_Destroy(ci);

    /* Someone made agent-e1 deliver another agent's subject, or every
     * agent's (the work queue allows one consumer on kscore.cmd.> only
     * while it is alone, so the other one goes first). */
    const char *wrong[] = {"kscore.cmd.e2", "kscore.cmd.>", NULL};
    for (int i = 0; wrong[i]; i++) {
        jsConsumerConfig cc;
        ci = NULL;
        js_DeleteConsumer(c->js, EVT_STREAM_CMDS, "agent-e1", NULL, NULL);
        jsConsumerConfig_Init(&cc);
        cc.Durable = "agent-e1";
        cc.DeliverSubject = "_KSCORE.deliver.agent-e1";
        cc.DeliverGroup = "agent-e1";
        cc.FilterSubject = wrong[i];
        cc.AckPolicy = js_AckExplicit;
        ck_assert_int_eq(js_AddConsumer(&ci, c->js, EVT_STREAM_CMDS, &cc,
                                        NULL, NULL),
                         NATS_OK);
        jsConsumerInfo_Destroy(ci);
        ck_assert_int_eq(evt_consumer_ensure(c, &ac.d, &ch, &err), 0);
        ck_assert_int_eq(ch, EVT_CONSUMER_REPLACED);
        ci = info_of(c, "agent-e1");
        ck_assert_str_eq(ci->Config->FilterSubject, "kscore.cmd.e1");
        jsConsumerInfo_Destroy(ci);
    }
    /* Delivered elsewhere, or with flow control the agent never answers. */
    {
        jsConsumerConfig cc;
        ci = NULL;
        js_DeleteConsumer(c->js, EVT_STREAM_CMDS, "agent-e1", NULL, NULL);
        jsConsumerConfig_Init(&cc);
        cc.Durable = "agent-e1";
        cc.DeliverSubject = "_KSCORE.deliver.elsewhere";
        cc.FilterSubject = "kscore.cmd.e1";
        cc.AckPolicy = js_AckExplicit;
        cc.HeadersOnly = true;
        ck_assert_int_eq(js_AddConsumer(&ci, c->js, EVT_STREAM_CMDS, &cc,
                                        NULL, NULL),
                         NATS_OK);
        jsConsumerInfo_Destroy(ci);
        ck_assert_int_eq(evt_consumer_ensure(c, &ac.d, &ch, &err), 0);
        ck_assert_int_eq(ch, EVT_CONSUMER_REPLACED);
        ci = info_of(c, "agent-e1");
        ck_assert_str_eq(ci->Config->DeliverSubject,
                         "_KSCORE.deliver.agent-e1");
        ck_assert_str_eq(ci->Config->DeliverGroup, "agent-e1");
        ck_assert(!ci->Config->HeadersOnly);
        jsConsumerInfo_Destroy(ci);
    }
    free(err);
    evt_close(c);
}
END_TEST

static Suite *
events_suite(void)
{
    Suite *s = suite_create("events");
    TCase *pure = tcase_create("pure");
    tcase_add_test(pure, puback_parse);
    tcase_add_test(pure, agent_consumer_shape);
    suite_add_tcase(s, pure);
    TCase *tc = tcase_create("nats");
    tcase_add_unchecked_fixture(tc, nats_up, nats_down);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, js_publish_as_plain_nats);
    tcase_add_test(tc, consumer_ensure_corrects);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(events_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
