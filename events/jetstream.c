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
 * reply comes to an inbox of the identity (request.c).
 *
 * Every JetStream publish kscore makes goes through evt_js_publish_window,
 * the broker's commands included, so that every PubAck is looked at and
 * what the stream did not take for now is tried again. A stream whose
 * leader is being elected (its node killed: 5-15 s on a 3-node cluster)
 * has no interest on its subjects, and the server answers a publish with
 * "no responders" (nats.c 3.4.1's js_Publish returns NATS_NO_RESPONDERS
 * and does not try again; js_PublishAsync without an error handler drops
 * an error PubAck altogether: src/js.c _handleAsyncReply). A stream
 * without quorum lets the PubAck time out, or answers a 503 error. Each
 * is tried again with the same Nats-Msg-Id, so the stream's
 * de-duplication stores the message once however many tries reached it.
 */
#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    struct evt_js_msg m = {subject, msg_id, data, len, 0, ack_out, why,
                           why_len};

    if (why && why_len)
        why[0] = '\0';
    return evt_js_publish_window(c, identity, &m, 1, timeout_ms);
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

/* A JetStream error PubAck that says "not now" (code 503: JetStream
 * temporarily unavailable, a stream full with discard new, a cluster not
 * ready), as opposed to "never" (a message too large, a wrong subject). */
static bool
puback_busy(const void *data, size_t len)
{
    json_t *j = data && len ? json_loadb(data, len, 0, NULL) : NULL;
    json_t *code = json_object_get(json_object_get(j, "error"), "code");
    bool busy = json_is_integer(code) && json_integer_value(code) == 503;

    json_decref(j);
    return busy;
}

/* Worth another try: nothing, or "not now", came back. */
static bool
try_again(const struct evt_js_msg *m, bool busy)
{
    return m->rc == KS_EUNAVAIL || m->rc == KS_ETIMEDOUT ||
           (m->rc == KS_ENATS && busy);
}

/*
 * One try: publishes msgs[i] for each i with todo[i], on one lease, and
 * collects their answers for up to wait_ms. Sets msgs[i].rc (and busy[i])
 * for each; KS_ETIMEDOUT for none. Returns 0 or the lease's error.
 */
static int
window_try(struct evt_conn *c, const char *identity, struct evt_js_msg *msgs,
           const bool *todo, bool *busy, size_t n, int wait_ms)
{
    struct evt_inbox *ib = NULL;
    const char *base;
    size_t sent = 0, answered = 0, refused = 0, blen;
    char idx[24];
    int rc;

    if ((rc = evt_inbox_take(c, identity, &ib)))
        return rc;
    for (size_t i = 0; i < n; i++) {
        if (!todo[i])
            continue;
        busy[i] = false;
        if (msgs[i].why && msgs[i].why_len)
            msgs[i].why[0] = '\0';
        snprintf(idx, sizeof(idx), "%zu", i);
        msgs[i].rc = evt_inbox_send(ib, msgs[i].subject, idx, msgs[i].msg_id,
                                    msgs[i].data, msgs[i].len);
        if (msgs[i].rc == 0) {
            msgs[i].rc = KS_ETIMEDOUT; /* until its PubAck */
            sent++;
        }
    }
    base = evt_inbox_subject(ib);
    blen = strlen(base);
    int64_t deadline = ks_mono_us() + (int64_t)wait_ms * 1000;
    while (answered + refused < sent) {
        int64_t left_ms = (deadline - ks_mono_us()) / 1000;
        natsMsg *m = NULL;
        if (left_ms <= 0)
            break;
        rc = evt_inbox_next(ib, (int)left_ms, &m);
        if (rc == KS_EUNAVAIL && !natsConnection_IsClosed(c->nc)) {
            /* "No responders" for one of them: which one the status does
             * not say (events/request.c). Each publish gets one answer,
             * so once all are in, those without a PubAck are those. */
            refused++;
            continue;
        }
        if (rc)
            break; /* timed out (or gone): the rest stay KS_ETIMEDOUT */
        const char *subj = natsMsg_GetSubject(m);
        char *end = NULL;
        unsigned long i = subj[blen] == '.' ? strtoul(subj + blen + 1, &end, 10)
                                            : n;
        if (end && *end == '\0' && i < n && todo[i] &&
            msgs[i].rc == KS_ETIMEDOUT) {
            const void *d = natsMsg_GetData(m);
            size_t dl = (size_t)natsMsg_GetDataLength(m);
            answered++;
            msgs[i].rc = evt_puback_parse(d, dl, msgs[i].ack, msgs[i].why,
                                          msgs[i].why_len);
            busy[i] = msgs[i].rc == KS_ENATS && puback_busy(d, dl);
        }
        natsMsg_Destroy(m);
    }
    for (size_t i = 0; i < n && refused; i++)
        if (todo[i] && msgs[i].rc == KS_ETIMEDOUT)
            msgs[i].rc = answered + refused == sent ? KS_EUNAVAIL
                                                    : KS_ETIMEDOUT;
    if (answered + refused == sent)
        evt__inbox_settled(ib);
    evt_inbox_give(ib);
    return 0;
}

int
evt_js_publish_window(struct evt_conn *c, const char *identity,
                      struct evt_js_msg *msgs, size_t n, int timeout_ms)
{
    bool todo[EVT_JS_WINDOW_MAX], busy[EVT_JS_WINDOW_MAX];
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    int pause_ms = 50, rc = 0;
    size_t left = 0;
    bool retrying = false;

    if (n == 0 || n > EVT_JS_WINDOW_MAX)
        return KS_EINVAL;
    for (size_t i = 0; i < n; i++) {
        todo[i] = msgs[i].len <= KS_MAX_MESSAGE_BYTES;
        msgs[i].rc = todo[i] ? KS_ETIMEDOUT : KS_ETOOBIG;
        left += todo[i];
    }
    for (unsigned tries = 1; left; tries++) {
        int64_t now = ks_mono_us(), wait_ms = (deadline - now) / 1000;
        int64_t try_ms =
            tries == 1 ? EVT_PUBLISH_TRY_MS : EVT_PUBLISH_RETRY_TRY_MS;
        if (wait_ms > try_ms)
            wait_ms = try_ms;
        if (wait_ms < 1)
            wait_ms = 1;
        if (tries > 1) {
            ks_metric_inc(KS_C_PUBLISH_RETRIES);
            atomic_fetch_add(&c->js_retries, 1);
            if (!retrying)
                atomic_fetch_add(&c->js_retrying, 1);
            retrying = true;
        }
        if ((rc = window_try(c, identity, msgs, todo, busy, n, (int)wait_ms))) {
            for (size_t i = 0; i < n; i++)
                if (todo[i])
                    msgs[i].rc = rc;
            break;
        }
        left = 0;
        for (size_t i = 0; i < n; i++) {
            todo[i] = todo[i] && try_again(&msgs[i], busy[i]);
            left += todo[i];
        }
        /* A connection closed for good answers nothing any more. */
        if (!left || natsConnection_IsClosed(c->nc))
            break;
        now = ks_mono_us();
        if (now + (int64_t)pause_ms * 1000 >= deadline)
            break;
        nanosleep(&(struct timespec){pause_ms / 1000,
                                     (long)(pause_ms % 1000) * 1000000L},
                  NULL);
        pause_ms = pause_ms * 2 > EVT_PUBLISH_PAUSE_MAX_MS
                       ? EVT_PUBLISH_PAUSE_MAX_MS
                       : pause_ms * 2;
    }
    if (retrying) {
        /* The end first: who sees none retrying sees when it ended. */
        atomic_store(&c->js_retry_end_us, ks_mono_us());
        atomic_fetch_sub(&c->js_retrying, 1);
    }
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].rc && msgs[i].why && msgs[i].why_len && !msgs[i].why[0])
            snprintf(msgs[i].why, msgs[i].why_len, "%s",
                     ks_strerror(msgs[i].rc));
    }
    for (size_t i = 0; i < n; i++)
        if (msgs[i].rc)
            return msgs[i].rc;
    return 0;
}

int64_t
evt_js_stall(struct evt_conn *c, int *retrying_out, uint64_t *retries_out)
{
    if (retrying_out)
        *retrying_out = atomic_load(&c->js_retrying);
    if (retries_out)
        *retries_out = atomic_load(&c->js_retries);
    return atomic_load(&c->js_retry_end_us);
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
