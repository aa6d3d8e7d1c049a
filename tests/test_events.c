/*
 * test_events: the events layer's JetStream-as-plain-NATS helpers
 * (events/jetstream.c) and the broker's consumer provisioning
 * (evt_consumer_ensure), pure and against a private nats-server.
 */
#include <check.h>
#include <jansson.h>
#include <pthread.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "fixture.h"
#include "stack.h"

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
static int mon_port; /* nats-server's monitoring endpoint */

static void
nats_up(void)
{
    char extra[64];
    mon_port = stack_free_port();
    snprintf(extra, sizeof(extra), "http: \"127.0.0.1:%d\"\n", mon_port);
    if (mon_port < 0 || fixture_nats_start(&nats, extra) != 0)
        exit(1);
}

/* A number from the server's /subsz (nats-server docs "Monitoring"):
 * num_subscriptions (now) or num_inserts (ever made). */
static long
subsz(const char *key)
{
    char *body = NULL;
    json_t *j;
    long v;

    ck_assert_int_eq(stack_http_get(mon_port, "/subsz", 2000, &body), 0);
    j = json_loads(body, 0, NULL);
    ck_assert_ptr_nonnull(j);
    ck_assert(json_is_integer(json_object_get(j, key)));
    v = (long)json_integer_value(json_object_get(j, key));
    json_decref(j);
    free(body);
    return v;
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
    natsSubscription *keep = NULL;
    jsSubOptions so;

    /* A consumer, so the stream keeps what is published (interest
     * retention) and the duplicate names the stored message's seq. */
    jsSubOptions_Init(&so);
    so.Stream = EVT_STREAM_EVENTS;
    ck_assert_int_eq(js_SubscribeSync(&keep, c->js, "kscore.evt.p.x", NULL,
                                      &so, NULL),
                     NATS_OK);

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
    natsSubscription_Unsubscribe(keep);
    natsSubscription_Destroy(keep);
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
    ck_assert_int_eq(evt_agents_kv(c, 0, &kv), 0);
    ck_assert_int_eq(evt_agent_get(kv, "p", &got), 0);
    ck_assert_uint_eq(got->max_concurrent, 3);
    ck_assert_uint_eq(got->ack_wait_ms, 9000);
    ks__agent_info__free_unpacked(got, NULL);
    kvStore_Destroy(kv);
    evt_close(c);
}
END_TEST

/* What a real delivery's ack subject says: the same NumDelivered as
 * natsMsg_GetMetaData, 1 and then 2 after a Nak. */
START_TEST(ack_delivered_live)
{
    struct evt_conn *c = conn();
    natsSubscription *sub = NULL;
    jsSubOptions so;
    natsMsg *m = NULL;

    /* The consumer first: KSCORE_EVENTS keeps an event only while a
     * consumer has yet to ack it (interest retention). */
    jsSubOptions_Init(&so);
    so.Stream = EVT_STREAM_EVENTS;
    so.ManualAck = true;
    ck_assert_int_eq(js_SubscribeSync(&sub, c->js, "kscore.evt.q.y", NULL,
                                      &so, NULL),
                     NATS_OK);
    ck_assert_int_eq(evt_js_publish_as(c, NULL, "kscore.evt.q.y", NULL, "a",
                                       1, 2000, NULL, NULL, 0),
                     0);
    for (uint64_t want = 1; want <= 2; want++) {
        jsMsgMetaData *md = NULL;
        ck_assert_int_eq(natsSubscription_NextMsg(&m, sub, 5000), NATS_OK);
        ck_assert_int_eq(natsMsg_GetMetaData(&md, m), NATS_OK);
        ck_assert_uint_eq(md->NumDelivered, want);
        ck_assert_uint_eq(evt_ack_delivered(natsMsg_GetReply(m)), want);
        jsMsgMetaData_Destroy(md);
        ck_assert_int_eq(want == 1 ? natsMsg_Nak(m, NULL)
                                   : natsMsg_Ack(m, NULL),
                         NATS_OK);
        natsMsg_Destroy(m);
    }
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
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

/* evt_ack_delivered: the number in the v1 and v2 ack subjects, nothing
 * for what nats.c's js_getMetaData would refuse. */
START_TEST(ack_delivered)
{
    ck_assert_uint_eq(evt_ack_delivered("$JS.ACK.KSCORE_EVENTS.kscore-recorder"
                                        ".1.17.17.1764556800000000000.0"),
                      1);
    ck_assert_uint_eq(evt_ack_delivered("$JS.ACK.S.c.3.1.2.17645568.5"), 3);
    ck_assert_uint_eq(evt_ack_delivered("$JS.ACK._.ACCHASH.S.c.12.9.8."
                                        "1764556800000000000.0.RND"),
                      12);
    ck_assert_uint_eq(
        evt_ack_delivered("$JS.ACK.dom.ACCHASH.S.c.2.9.8.17645568.0"), 2);
    const char *bad[] = {"$JS.ACK.S.c.x.1.2.3.4", "$JS.ACK.S.c.1.2.3.4",
                         "$JS.ACK.S.c.1.2.3.4.5.6", "_INBOX.x.y",
                         "$JS.ACK.", "", NULL};
    for (int i = 0; bad[i]; i++)
        ck_assert_msg(evt_ack_delivered(bad[i]) == 0, "%s", bad[i]);
    ck_assert_uint_eq(evt_ack_delivered(NULL), 0);
}
END_TEST

/* kproto_arena: aligned, zeroed by calloc, rewound by a mark and a reset
 * to the same memory (what makes a warm arena allocate nothing), big
 * requests on their own, and protobuf-c decoding into it. */
START_TEST(arena)
{
    struct kproto_arena a = KPROTO_ARENA_INIT;
    struct kproto_arena_mark m;
    void *first, *p, *q, *big;

    first = kproto_arena_alloc(&a, 3);
    ck_assert_ptr_nonnull(first);
    for (int i = 0; i < 1000; i++) {
        p = kproto_arena_alloc(&a, (size_t)(i % 37) + 1);
        ck_assert_ptr_nonnull(p);
        ck_assert_uint_eq((uintptr_t)p % alignof(max_align_t), 0);
    }
    unsigned char *z = kproto_arena_calloc(&a, 100, 7);
    for (int i = 0; i < 700; i++)
        ck_assert_uint_eq(z[i], 0);
    ck_assert_ptr_null(kproto_arena_calloc(&a, SIZE_MAX / 2, 3));

    /* A mark: what comes after is given back, what came before stays. */
    strcpy(kproto_arena_alloc(&a, 16), "kept");
    m = kproto_arena_mark(&a);
    p = kproto_arena_alloc(&a, 200000); /* past the first chunk */
    memset(p, 0xab, 200000);
    big = kproto_arena_alloc(&a, 3 * 1024 * 1024);
    ck_assert_ptr_nonnull(big);
    memset(big, 0xcd, 3 * 1024 * 1024);
    kproto_arena_release(&a, m);
    ck_assert_ptr_eq(kproto_arena_alloc(&a, 200000), p);

    /* A reset: the same requests get the same memory again. */
    kproto_arena_reset(&a);
    ck_assert_ptr_eq(kproto_arena_alloc(&a, 3), first);

    /* Decoded into the arena; gone with its reset. */
    kproto_arena_reset(&a);
    Ks__Event ev = KS__EVENT__INIT;
    ev.event_id = "0b6f0b5e-3f5b-4c1e-9d2a-0d7c8f1e2a3b";
    ev.type = "CommandCompleted";
    ev.agent_id = "web-1";
    uint8_t buf[256];
    size_t len = ks__event__pack(&ev, buf);
    for (int round = 0; round < 3; round++) {
        ProtobufCMessage *out = NULL;
        ck_assert_int_eq(evt_unpack_in(&ks__event__descriptor, buf, len,
                                       kproto_arena_pb(&a), &out),
                         0);
        q = out;
        ck_assert_str_eq(((Ks__Event *)out)->type, "CommandCompleted");
        ck_assert_str_eq(((Ks__Event *)out)->agent_id, "web-1");
        protobuf_c_message_free_unpacked(out, kproto_arena_pb(&a)); /* no-op */
        if (round == 0)
            first = q;
        ck_assert_ptr_eq(q, first);
        kproto_arena_reset(&a);
    }
    ck_assert_int_eq(evt_unpack_in(&ks__event__descriptor, "\xff", 1,
                                   kproto_arena_pb(&a), (ProtobufCMessage **)&q),
                     KS_EDECODE);
    kproto_arena_fini(&a);
    kproto_arena_fini(&a);
    kproto_arena_fini(NULL);
}
END_TEST

static size_t sort_size; /* element size for cmp_bytes */

/* A total order on the first 4 bytes, then the rest. */
static int
cmp_bytes(const void *a, const void *b)
{
    uint32_t x, y;
    memcpy(&x, a, 4);
    memcpy(&y, b, 4);
    if (x != y)
        return x < y ? -1 : 1;
    return memcmp(a, b, sort_size);
}

/*
 * A message the wire check cannot read is refused whole, never left to
 * protobuf-c (events.c unpack_checked). make fuzz found this BatchRequest:
 * its spec holds bytes the check stops at (it refuses a field numbered 0)
 * while protobuf-c reads on, and after the spec comes a progress_subject
 * of broken UTF-8 with NULs that the check never reached. It decoded, and
 * re-packed it never decoded again (a row no reader could read). Before
 * the fix evt_unpack returned 0 here.
 */
static const uint8_t wire_stop_hides_a_string[] = {
    0x0a, 0x20, 0x0a, 0x09, 0x2f, 0x62, 0x69, 0x6e, 0x2f, 0x65, 0x63,
    0x68, 0x6f, 0x20, 0x6b, 0x78, 0xd8, 0x78, 0xd8, 0x20, 0x6b, 0x78,
    0xd8, 0x78, 0xd8, 0x52, 0x0d, 0x78, 0x38, 0x80, 0x00, 0x5b, 0x30,
    0x00, 0x0a, 0x00, 0x1a, 0x00, 0x1a, 0x00, 0x52, 0x0d, 0x78, 0x38,
    0x80, 0x00, 0x5b, 0x30, 0x00, 0x0a, 0x00, 0x1a, 0x00, 0x1a, 0x00};

START_TEST(unreadable_wire_is_refused_whole)
{
    ProtobufCMessage *m = NULL;
    char why[256] = "";

    ck_assert_int_ne(evt_check_wire(&ks__batch_request__descriptor,
                                    wire_stop_hides_a_string,
                                    sizeof(wire_stop_hides_a_string), NULL,
                                    0),
                     0);
    ck_assert_int_eq(evt_unpack(&ks__batch_request__descriptor,
                                wire_stop_hides_a_string,
                                sizeof(wire_stop_hides_a_string), &m),
                     KS_EDECODE);
    ck_assert_ptr_null(m);
    ck_assert_int_ne(evt_unpack_why(&ks__batch_request__descriptor,
                                    wire_stop_hides_a_string,
                                    sizeof(wire_stop_hides_a_string), &m,
                                    why, sizeof(why)),
                     0);
    ck_assert_ptr_null(m);
    ck_assert_int_eq(evt_unpack_reply(&ks__batch_request__descriptor,
                                      wire_stop_hides_a_string,
                                      sizeof(wire_stop_hides_a_string), &m),
                     KS_EDECODE);
    ck_assert_ptr_null(m);
    /* protobuf-c alone takes it: what the check is there for */
    m = protobuf_c_message_unpack(&ks__batch_request__descriptor, NULL,
                                  sizeof(wire_stop_hides_a_string),
                                  wire_stop_hides_a_string);
    ck_assert_ptr_nonnull(m);
    protobuf_c_message_free_unpacked(m, NULL);
}
END_TEST

/* ks_sort sorts as qsort does, for element sizes below and above its swap
 * buffer, sorted, reversed, all-equal and few-valued inputs (the shapes
 * that break a quicksort). */
START_TEST(sort_like_qsort)
{
    const size_t sizes[] = {4, 16, 200};
    const size_t counts[] = {0, 1, 2, 3, 15, 16, 17, 100, 1000, 3001};
    unsigned seed = 7;

    for (size_t si = 0; si < 3; si++)
        for (size_t ci = 0; ci < 10; ci++)
            for (int shape = 0; shape < 5; shape++) {
                size_t size = sizes[si], n = counts[ci];
                unsigned char *a = malloc(n * size + 1), *b = malloc(n * size + 1);
                sort_size = size;
                for (size_t i = 0; i < n; i++) {
                    uint32_t k;
                    switch (shape) {
                    case 0: k = (uint32_t)rand_r(&seed); break;
                    case 1: k = (uint32_t)i; break;
                    case 2: k = (uint32_t)(n - i); break;
                    case 3: k = 5; break;
                    default: k = (uint32_t)rand_r(&seed) % 3; break;
                    }
                    for (size_t j = 0; j < size; j++)
                        a[i * size + j] = (unsigned char)rand_r(&seed);
                    memcpy(a + i * size, &k, 4);
                }
                memcpy(b, a, n * size);
                ks_sort(a, n, size, cmp_bytes);
                qsort(b, n, size, cmp_bytes);
                ck_assert_msg(n == 0 || memcmp(a, b, n * size) == 0,
                              "size %zu n %zu shape %d", size, n, shape);
                free(a);
                free(b);
            }
}
END_TEST

/* ---- requests: reply inboxes (events/request.c) --------------------------- */

/* A responder on its own connection: echoes "echo.>" at once, and answers
 * "slow.>" after the number of ms its body names. Replies go out in
 * parts past EVT_PART_BYTES ("big.>": a reply of the size its body
 * names). */
struct responder {
    struct evt_conn *c;
    natsSubscription *subs[3];
};

static void
on_echo(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *ud)
{
    (void)sub;
    (void)ud;
    natsConnection_Publish(nc, natsMsg_GetReply(m), natsMsg_GetData(m),
                           natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
}

static void
on_slow(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *ud)
{
    (void)sub;
    (void)ud;
    long ms = strtol(natsMsg_GetData(m), NULL, 10);
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000L}, NULL);
    natsConnection_Publish(nc, natsMsg_GetReply(m), natsMsg_GetData(m),
                           natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
}

static void
on_big(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *ud)
{
    struct responder *r = ud;
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    size_t n = (size_t)strtoul(natsMsg_GetData(m), NULL, 10);
    uint8_t *blob = malloc(n);
    (void)nc;
    (void)sub;
    for (size_t i = 0; i < n; i++)
        blob[i] = (uint8_t)(i * 7);
    sc.command.data = blob;
    sc.command.len = n;
    ck_assert_int_eq(evt_publish_reply(r->c, natsMsg_GetReply(m), &sc.base),
                     0);
    free(blob);
    natsMsg_Destroy(m);
}

static void
responder_start(struct responder *r)
{
    struct evt_connect_opts o = {.name = "test-responder", .send_asap = true};
    memset(r, 0, sizeof(*r));
    ck_assert_int_eq(evt_connect(nats.url, &o, &r->c, NULL), 0);
    ck_assert_int_eq(natsConnection_Subscribe(&r->subs[0], r->c->nc, "echo.>",
                                              on_echo, r),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Subscribe(&r->subs[1], r->c->nc, "slow.>",
                                              on_slow, r),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Subscribe(&r->subs[2], r->c->nc, "big.>",
                                              on_big, r),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Flush(r->c->nc), NATS_OK);
}

static void
responder_stop(struct responder *r)
{
    for (int i = 0; i < 3; i++)
        natsSubscription_Unsubscribe(r->subs[i]);
    evt_close(r->c); /* closed first: then no delivery races a destroy */
}

/* One request and its answer, the reply's body checked against ours. */
static int
ask(struct evt_conn *c, const char *identity, const char *subject,
    const char *body, int timeout_ms)
{
    natsMsg *m = NULL;
    int rc = evt_request_bytes_as(c, identity, subject, NULL, body,
                                  strlen(body), timeout_ms, &m);
    if (rc == 0) {
        ck_assert_int_eq(natsMsg_GetDataLength(m), (int)strlen(body));
        ck_assert(memcmp(natsMsg_GetData(m), body, strlen(body)) == 0);
        natsMsg_Destroy(m);
    }
    return rc;
}

struct asker {
    struct evt_conn *c;
    int id, n, failed;
};

static void *
asker_main(void *arg)
{
    struct asker *k = arg;
    char body[64];
    for (int i = 0; i < k->n; i++) {
        snprintf(body, sizeof(body), "%d-%d", k->id, i);
        if (ask(k->c, NULL, "echo.x", body, 5000) != 0)
            k->failed++;
    }
    return NULL;
}

/* Issue 22: one subscription per request let a late reply race the
 * subscription's destruction in nats.c 3.4.1's read thread (nats.c issue
 * 637). Requests now reuse inboxes made once: 100 requests in a row make
 * no subscription, 8 threads asking at once make at most one each, and
 * every reply reaches the request it answers. */
START_TEST(requests_make_no_subscription)
{
    struct responder r;
    struct evt_conn *c = conn();
    pthread_t th[8];
    struct asker k[8];

    responder_start(&r);
    ck_assert_int_eq(ask(c, NULL, "echo.x", "warm", 5000), 0);
    long made = subsz("num_inserts"), now = subsz("num_subscriptions");
    for (int i = 0; i < 100; i++) {
        char body[32];
        snprintf(body, sizeof(body), "n-%d", i);
        ck_assert_int_eq(ask(c, NULL, "echo.x", body, 5000), 0);
    }
    ck_assert_int_eq(subsz("num_inserts"), made);
    ck_assert_int_eq(subsz("num_subscriptions"), now);
    /* A JetStream publish's PubAck comes the same way. */
    ck_assert_int_eq(evt_js_publish_as(c, NULL, "kscore.evt.s.t", "s-1", "a",
                                       1, 2000, NULL, NULL, 0),
                     0);
    ck_assert_int_eq(subsz("num_inserts"), made);

    for (int i = 0; i < 8; i++) {
        k[i] = (struct asker){c, i, 50, 0};
        ck_assert_int_eq(pthread_create(&th[i], NULL, asker_main, &k[i]), 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(k[i].failed, 0);
    }
    ck_assert_int_le(subsz("num_inserts"), made + 7);
    ck_assert_uint_eq(evt_late_replies(c), 0);
    /* An agent id as long as one may be (EVT_AGENT_ID_MAX) gives an
     * identity longer than a user name: its inbox still fits. */
    char longid[8 + EVT_AGENT_ID_MAX + 1];
    snprintf(longid, sizeof(longid), "agent-%0*d", EVT_AGENT_ID_MAX, 7);
    ck_assert_int_eq(ask(c, longid, "echo.x", "long", 5000), 0);
    ck_assert_int_eq(ask(c, "bad.identity", "echo.x", "x", 5000), KS_EINVAL);
    evt_close(c);
    responder_stop(&r);
}
END_TEST

/* A reply that comes after its waiter gave up is dropped and counted, and
 * never taken for the answer to the next request on the same inbox. */
START_TEST(late_reply_is_dropped)
{
    struct responder r;
    struct evt_conn *c = conn();

    responder_start(&r);
    ck_assert_int_eq(ask(c, "agent-late", "echo.x", "warm", 5000), 0);
    /* Answered after 600 ms; we wait 100. */
    ck_assert_int_eq(ask(c, "agent-late", "slow.x", "600", 100),
                     KS_ETIMEDOUT);
    ck_assert_int_eq(ask(c, "agent-late", "echo.x", "next", 5000), 0);
    nanosleep(&(struct timespec){0, 900 * 1000000L}, NULL);
    /* The late one is there now, on the inbox the first request had. */
    ck_assert_int_eq(evt_link_probe(c, 2000), 0);
    for (int i = 0; i < 4; i++) {
        char body[16];
        snprintf(body, sizeof(body), "after-%d", i);
        ck_assert_int_eq(ask(c, "agent-late", "echo.x", body, 5000), 0);
    }
    ck_assert_uint_eq(evt_late_replies(c), 1);
    evt_close(c);
    responder_stop(&r);
}
END_TEST

struct slow_ask {
    struct evt_conn *c;
    int rc;
};

static void *
slow_main(void *arg)
{
    struct slow_ask *s = arg;
    s->rc = ask(s->c, NULL, "slow.y", "800", 5000);
    return NULL;
}

/* "No responders" reaches the request nobody serves, at once, and no
 * other: a request waiting for its reply meanwhile still gets it. */
START_TEST(no_responders_reach_their_waiter)
{
    struct responder r;
    struct evt_conn *c = conn();
    struct slow_ask s = {c, -1};
    pthread_t th;

    responder_start(&r);
    ck_assert_int_eq(pthread_create(&th, NULL, slow_main, &s), 0);
    nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    for (int i = 0; i < 5; i++) {
        int64_t t0 = ks_mono_us();
        ck_assert_int_eq(ask(c, NULL, "nobody.here", "x", 5000), KS_EUNAVAIL);
        ck_assert_int_lt(ks_mono_us() - t0, 4000000);
    }
    pthread_join(th, NULL);
    ck_assert_int_eq(s.rc, 0);
    ck_assert_int_eq(ask(c, NULL, "echo.x", "after", 5000), 0);
    evt_close(c);
    responder_stop(&r);
}
END_TEST

/* A reply larger than one NATS message comes in parts and is put back
 * together on the lease's inbox. */
START_TEST(reply_in_parts)
{
    struct responder r;
    struct evt_conn *c = conn();
    natsMsg *m = NULL;
    ProtobufCMessage *pm = NULL;
    char body[32];
    size_t n = 2 * EVT_PART_BYTES + 12345;

    responder_start(&r);
    snprintf(body, sizeof(body), "%zu", n);
    for (int round = 0; round < 2; round++) {
        ck_assert_int_eq(evt_request_bytes(c, "big.x", NULL, body,
                                           strlen(body), 10000, &m),
                         0);
        ck_assert_int_eq(evt_unpack_reply(&ks__signed_command__descriptor,
                                          natsMsg_GetData(m),
                                          (size_t)natsMsg_GetDataLength(m),
                                          &pm),
                         0);
        Ks__SignedCommand *sc = (Ks__SignedCommand *)pm;
        ck_assert_uint_eq(sc->command.len, n);
        for (size_t i = 0; i < n; i += 4099)
            ck_assert_uint_eq(sc->command.data[i], (uint8_t)(i * 7));
        ks__signed_command__free_unpacked(sc, NULL);
        natsMsg_Destroy(m);
    }
    evt_close(c);
    responder_stop(&r);
}
END_TEST

/* ---- publishes the stream does not take for now ---------------------------- */

struct later {
    struct evt_conn *c;
    int delay_ms;
};

static void *
setup_later(void *arg)
{
    struct later *l = arg;
    nanosleep(&(struct timespec){l->delay_ms / 1000,
                                 (l->delay_ms % 1000) * 1000000L},
              NULL);
    ck_assert_int_eq(evt_setup(l->c, NULL), 0);
    return NULL;
}

static uint64_t
stream_msgs(struct evt_conn *c, const char *stream)
{
    jsStreamInfo *si = NULL;
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, stream, NULL, NULL),
                     NATS_OK);
    uint64_t n = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return n;
}

/* Issue 22, F02: while no stream takes a subject (KSCORE_CMDS's leader
 * being elected after its node died), nats-server answers a publish "no
 * responders", and nats.c 3.4.1's js_Publish gave up at once. A command
 * publish is tried again with the same Nats-Msg-Id until the stream takes
 * it, and lands once. */
START_TEST(command_publish_outlasts_no_stream)
{
    struct evt_conn *c = conn(), *admin = conn();
    Ks__Command cmd = KS__COMMAND__INIT;
    struct later l = {admin, 1500};
    pthread_t th;

    cmd.command_id = "7d3f0b5e-3f5b-4c1e-9d2a-0d7c8f1e2a3b";
    cmd.agent_id = "retry-1";
    cmd.attempt = 1;
    ck_assert_int_eq(js_DeleteStream(admin->js, EVT_STREAM_CMDS, NULL, NULL),
                     NATS_OK);
    uint64_t retries = ks_metric_counter_value(KS_C_PUBLISH_RETRIES);
    ck_assert_int_eq(pthread_create(&th, NULL, setup_later, &l), 0);
    int64_t t0 = ks_mono_us();
    uint64_t seq = 0, seq2 = 0;
    ck_assert_int_eq(evt_publish_command(c, NULL, &cmd, NULL,
                                         EVT_PUBLISH_RETRY_MS, &seq),
                     0);
    ck_assert_uint_gt(seq, 0); /* where the stream stored it */
    int64_t took_us = ks_mono_us() - t0;
    pthread_join(th, NULL);
    ck_assert_int_ge(took_us, 1000000); /* it did wait for the stream */
    ck_assert_uint_gt(ks_metric_counter_value(KS_C_PUBLISH_RETRIES), retries);
    ck_assert_uint_eq(stream_msgs(admin, EVT_STREAM_CMDS), 1);
    /* Again under the same id: the stream keeps one, and its duplicate
     * PubAck names the first copy's sequence (the guard's lost-delivery
     * rule compares it with a consumer's). */
    ck_assert_int_eq(evt_publish_command(c, NULL, &cmd, NULL, 5000, &seq2),
                     0);
    ck_assert_uint_eq(seq2, seq);
    ck_assert_uint_eq(stream_msgs(admin, EVT_STREAM_CMDS), 1);
    /* With a budget too short for the stream to come back: said so. */
    ck_assert_int_eq(js_DeleteStream(admin->js, EVT_STREAM_CMDS, NULL, NULL),
                     NATS_OK);
    ck_assert_int_eq(evt_publish_command(c, NULL, &cmd, NULL, 300, &seq),
                     KS_EUNAVAIL);
    ck_assert_uint_eq(seq, 0);
    ck_assert_int_eq(evt_setup(admin, NULL), 0);
    evt_close(c);
    evt_close(admin);
}
END_TEST

/* Issue 22: a batch's commands went out with js_PublishAsync, whose error
 * PubAcks nats.c 3.4.1 drops without an error handler: the batch took
 * refused commands for published. Every PubAck is looked at now: a
 * refusal is counted as not published. */
START_TEST(batch_publish_sees_refusals)
{
    struct evt_conn *c = conn();
    jsStreamInfo *si = NULL, *nsi = NULL;
    Ks__Command cmds[5], *pc[5];
    char ids[5][37];

    /* The stream refuses anything over 64 bytes (JetStream error 10054,
     * code 400: not a "not now"). */
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, EVT_STREAM_CMDS, NULL,
                                      NULL),
                     NATS_OK);
    si->Config->MaxMsgSize = 64;
    ck_assert_int_eq(js_UpdateStream(&nsi, c->js, si->Config, NULL, NULL),
                     NATS_OK);
    jsStreamInfo_Destroy(nsi);
    jsStreamInfo_Destroy(si);
    for (int i = 0; i < 5; i++) {
        ks__command__init(&cmds[i]);
        ks_uuid(ids[i]);
        cmds[i].command_id = ids[i];
        cmds[i].agent_id = "refused-1";
        cmds[i].attempt = 1;
        pc[i] = &cmds[i];
    }
    uint64_t before = stream_msgs(c, EVT_STREAM_CMDS), seqs[5];
    int rcs[5];
    uint64_t r0 = 0, r1 = 0;
    memset(seqs, 0xff, sizeof(seqs));
    evt_js_stall(c, NULL, &r0);
    ck_assert_int_eq(evt_publish_commands(c, NULL, pc, NULL, 5, 3000, seqs,
                                          rcs),
                     5);
    ck_assert_uint_eq(stream_msgs(c, EVT_STREAM_CMDS), before);
    for (int i = 0; i < 5; i++) {
        ck_assert_uint_eq(seqs[i], 0); /* none stored */
        /* an error PubAck, said once: not tried again to the end */
        ck_assert_int_eq(rcs[i], KS_ENATS);
    }
    evt_js_stall(c, NULL, &r1);
    ck_assert_uint_eq(r1, r0);
    /* Back as evt_setup makes it: all five go out, each at its own
     * sequence, in order (one window). */
    ck_assert_int_eq(evt_setup(c, NULL), 0);
    ck_assert_int_eq(evt_publish_commands(c, NULL, pc, NULL, 5, 3000, seqs,
                                          rcs),
                     0);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(rcs[i], 0);
    ck_assert_uint_eq(stream_msgs(c, EVT_STREAM_CMDS), before + 5);
    for (int i = 0; i < 5; i++)
        ck_assert_uint_gt(seqs[i], i ? seqs[i - 1] : 0);
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
    tcase_add_test(pure, ack_delivered);
    tcase_add_test(pure, arena);
    tcase_add_test(pure, sort_like_qsort);
    tcase_add_test(pure, unreadable_wire_is_refused_whole);
    suite_add_tcase(s, pure);
    TCase *tc = tcase_create("nats");
    tcase_add_unchecked_fixture(tc, nats_up, nats_down);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, js_publish_as_plain_nats);
    tcase_add_test(tc, consumer_ensure_corrects);
    tcase_add_test(tc, ack_delivered_live);
    tcase_add_test(tc, requests_make_no_subscription);
    tcase_add_test(tc, late_reply_is_dropped);
    tcase_add_test(tc, no_responders_reach_their_waiter);
    tcase_add_test(tc, reply_in_parts);
    tcase_add_test(tc, command_publish_outlasts_no_stream);
    tcase_add_test(tc, batch_publish_sees_refusals);
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
