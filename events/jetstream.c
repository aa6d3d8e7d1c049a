/*
 * jetstream.c: JetStream spoken as plain NATS, for users that may not use
 * the JetStream API (agents: deploy/nats-auth.conf.in).
 *
 * A publish to a subject a stream takes is stored by the stream, which
 * answers the reply subject with a PubAck, JSON (nats-server docs,
 * "JetStream wire API", Publishing: {"stream": "S", "seq": 7} and
 * "duplicate": true when the Nats-Msg-Id was seen within the duplicate
 * window, or {"error": {"code": 503, "err_code": 10077, "description":
 * "..."}}). nats.c's js_Publish does the same on a "_INBOX.<nuid>" reply
 * subject, which needs the permission to subscribe to "_INBOX.>"; here the
 * reply comes to "_INBOX.<identity>.<uuid>" (request.c).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nats/nats.h>

#include "events.h"
#include "events_int.h"

int
evt_puback_parse(const void *data, size_t len, struct evt_puback *out,
                 char *why, size_t why_len)
{
    json_t *j, *err, *stream, *seq;
    int rc = KS_EDECODE;

    if (!why)
        why_len = 0;
    j = data && len ? json_loadb(data, len, 0, NULL) : NULL;
    if (!json_is_object(j)) {
        if (why_len)
            snprintf(why, why_len, "not a PubAck: '%.*s'",
                     (int)(len > 80 ? 80 : len), data ? (const char *)data
                                                      : "");
        goto out;
    }
    err = json_object_get(j, "error");
    if (err) {
        const char *d = json_string_value(json_object_get(err, "description"));
        if (why_len)
            snprintf(why, why_len, "%s (%lld/%lld)",
                     d ? d : "JetStream error",
                     (long long)json_integer_value(
                         json_object_get(err, "code")),
                     (long long)json_integer_value(
                         json_object_get(err, "err_code")));
        rc = KS_ENATS;
        goto out;
    }
    stream = json_object_get(j, "stream");
    seq = json_object_get(j, "seq");
    /* A duplicate of a message no consumer wanted (interest retention:
     * never stored) is answered with seq 0 by nats-server 2.9.10. */
    if (!json_is_string(stream) || !json_is_integer(seq) ||
        json_integer_value(seq) < 0 ||
        (json_integer_value(seq) == 0 &&
         !json_is_true(json_object_get(j, "duplicate")))) {
        if (why_len)
            snprintf(why, why_len, "not a PubAck: no stream or seq");
        goto out;
    }
    if (out) {
        snprintf(out->stream, sizeof(out->stream), "%s",
                 json_string_value(stream));
        out->seq = (uint64_t)json_integer_value(seq);
        out->duplicate = json_is_true(json_object_get(j, "duplicate"));
    }
    rc = 0;
out:
    json_decref(j);
    return rc;
}

int
evt_js_publish_as(struct evt_conn *c, const char *identity,
                  const char *subject, const char *msg_id, const void *data,
                  size_t len, int timeout_ms, struct evt_puback *ack_out,
                  char *why, size_t why_len)
{
    natsMsg *reply = NULL;
    int rc;

    rc = evt_request_bytes_as(c, identity, subject, msg_id, data, len,
                              timeout_ms, &reply);
    if (rc) {
        if (why && why_len)
            snprintf(why, why_len, "%s", ks_strerror(rc));
        return rc;
    }
    rc = evt_puback_parse(natsMsg_GetData(reply),
                          (size_t)natsMsg_GetDataLength(reply), ack_out, why,
                          why_len);
    natsMsg_Destroy(reply);
    return rc;
}

uint64_t
evt_ack_delivered(const char *reply)
{
    /* After "$JS.ACK.": v1 "<stream>.<consumer>.<delivered>.<sseq>.<cseq>.
     * <tm>.<pending>" (7 tokens); v2 "<domain>.<account hash>.<stream>.
     * <consumer>.<delivered>...", 9 tokens or more. The same rule as
     * nats.c's js_getMetaData, which copies the names for it. */
    const char *tok[9], *p;
    size_t nt = 0;
    const char *want;
    char *end;
    unsigned long long v;

    if (!reply || strncmp(reply, "$JS.ACK.", 8) != 0)
        return 0;
    p = reply + 8;
    tok[nt++] = p;
    while (nt < 9 && (p = strchr(p, '.')) != NULL)
        tok[nt++] = ++p;
    if (nt < 7 || (nt > 7 && nt < 9))
        return 0;
    want = tok[nt == 7 ? 2 : 4];
    if (*want < '0' || *want > '9')
        return 0;
    v = strtoull(want, &end, 10);
    if (*end != '.')
        return 0;
    return (uint64_t)v;
}

int
evt_js_publish_window(struct evt_conn *c, const char *identity,
                      struct evt_js_msg *msgs, size_t n, int timeout_ms)
{
    natsSubscription *sub = NULL;
    char inbox[EVT_INBOX_MAX], reply[EVT_INBOX_MAX + 8], wild[EVT_INBOX_MAX + 4];
    size_t left = 0, ilen;
    natsStatus st;
    int rc = 0;

    if (n == 0 || n > EVT_JS_WINDOW_MAX)
        return KS_EINVAL;
    for (size_t i = 0; i < n; i++)
        msgs[i].rc = KS_ETIMEDOUT;
    if ((rc = evt__inbox_of(identity ? identity : c->identity, inbox,
                            sizeof(inbox))))
        goto fail;
    ilen = strlen(inbox);
    snprintf(wild, sizeof(wild), "%s.*", inbox);
    st = natsConnection_SubscribeSync(&sub, c->nc, wild);
    if (st == NATS_OK)
        st = natsSubscription_SetPendingLimits(sub, -1, -1);
    if (st != NATS_OK) {
        rc = evt_err(st);
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        natsMsg *m = NULL;
        if (msgs[i].len > KS_MAX_MESSAGE_BYTES) {
            msgs[i].rc = KS_ETOOBIG;
            continue;
        }
        snprintf(reply, sizeof(reply), "%s.%zu", inbox, i);
        st = natsMsg_Create(&m, msgs[i].subject, reply, msgs[i].data,
                            (int)msgs[i].len);
        /* JetStream's de-duplication id (nats-server docs "JetStream
         * model deep dive", Message Deduplication). */
        if (st == NATS_OK && msgs[i].msg_id)
            st = natsMsgHeader_Set(m, "Nats-Msg-Id", msgs[i].msg_id);
        if (st == NATS_OK)
            st = natsConnection_PublishMsg(c->nc, m);
        natsMsg_Destroy(m);
        if (st != NATS_OK)
            msgs[i].rc = evt_err(st);
        else
            left++;
    }
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    while (left > 0) {
        int64_t wait_ms = (deadline - ks_mono_us()) / 1000;
        natsMsg *m = NULL;
        if (wait_ms <= 0)
            break;
        st = natsSubscription_NextMsg(&m, sub, wait_ms);
        if (st != NATS_OK)
            break; /* timed out (or closed): the rest stay KS_ETIMEDOUT */
        const char *subj = natsMsg_GetSubject(m);
        char *end = NULL;
        unsigned long i = strlen(subj) > ilen + 1
                              ? strtoul(subj + ilen + 1, &end, 10)
                              : n;
        if (end && *end == '\0' && i < n && msgs[i].rc == KS_ETIMEDOUT) {
            left--;
            if (natsMsg_IsNoResponders(m))
                msgs[i].rc = KS_EUNAVAIL;
            else
                msgs[i].rc = evt_puback_parse(
                    natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m),
                    NULL, NULL, 0);
        }
        natsMsg_Destroy(m);
    }
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    for (size_t i = 0; i < n; i++)
        if (msgs[i].rc)
            return msgs[i].rc;
    return 0;
fail:
    for (size_t i = 0; i < n; i++)
        msgs[i].rc = rc;
    return rc;
}

/* ---- scrape-time gauges (events.h) ---------------------------------------- */

void
evt_metrics_nats_state(struct evt_conn *c, enum ks_gauge g)
{
    if (c && c->nc &&
        natsConnection_Status(c->nc) == NATS_CONN_STATUS_CONNECTED)
        ks_metric_gauge_add(g, 1);
}

void
evt_metrics_queue_depths(struct evt_conn *c, int timeout_ms)
{
    jsOptions o;
    jsConsumerInfo *ci = NULL;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;

    if (!c || !c->js ||
        natsConnection_Status(c->nc) != NATS_CONN_STATUS_CONNECTED)
        return;
    jsOptions_Init(&o);
    o.Wait = timeout_ms;
    if (js_GetConsumerInfo(&ci, c->js, EVT_STREAM_EVENTS, EVT_RECORDER_DURABLE,
                           &o, &jerr) == NATS_OK &&
        ci) {
        ks_metric_gauge_add(
            KS_G_QUEUE_EVENTS,
            (int64_t)(ci->NumPending + (uint64_t)ci->NumAckPending));
        jsConsumerInfo_Destroy(ci);
    }
    if (js_GetStreamInfo(&si, c->js, EVT_STREAM_CMDS, &o, &jerr) == NATS_OK &&
        si) {
        ks_metric_gauge_add(KS_G_QUEUE_COMMANDS, (int64_t)si->State.Msgs);
        jsStreamInfo_Destroy(si);
    }
}
