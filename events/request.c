/*
 * request.c: request/reply on replies only this identity may read.
 *
 * nats.c 3.4.1 answers requests on "_INBOX.<nuid>.<n>" (its response mux,
 * src/conn.c) and has no natsOptions_SetCustomInboxPrefix (3.6), so every
 * user that makes a request must be allowed to subscribe to "_INBOX.>" and
 * can then read everybody's replies. kscore makes its own requests: replies
 * go to "_INBOX.<identity>.<uuid>", and the server's permissions let each
 * user subscribe to "_INBOX.<its own name>.>" only
 * (deploy/nats-auth.conf.in).
 *
 * Each request subscribes (synchronously) to its own reply subject before
 * it publishes, and waits on it in the calling thread: on one connection
 * the server sees the SUB before the request, and a "no responders"
 * status (nats-server 2.2+, a 503 status message) comes back on that very
 * subscription, where natsSubscription_NextMsg reports it as
 * NATS_NO_RESPONDERS. No delivery thread is involved, so a handler on
 * nats.c's shared delivery pool may make a request without starving the
 * reply (a callback-driven mux could deadlock there), and no reply is
 * ever routed by a token. The price is a SUB and an UNSUB line per
 * request on the same write.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "events_int.h"

int
evt__inbox_of(const char *identity, char *buf, size_t len)
{
    char id[37];
    ks_uuid(id);
    /* UUIDs are subject-safe (hex and '-'). */
    int n = snprintf(buf, len, "_INBOX.%s.%s", identity, id);
    return n > 0 && (size_t)n < len ? 0 : KS_ETOOBIG;
}

int
evt_inbox(const struct evt_conn *c, char *buf, size_t len)
{
    return evt__inbox_of(c->identity, buf, len);
}

static int request_as(struct evt_conn *c, const char *identity,
                      const char *subject, const char *msg_id,
                      const void *data, size_t len, int timeout_ms,
                      natsMsg **reply_out);

int
evt_request_bytes(struct evt_conn *c, const char *subject, const char *msg_id,
                  const void *data, size_t len, int timeout_ms,
                  natsMsg **reply_out)
{
    return request_as(c, c->identity, subject, msg_id, data, len, timeout_ms,
                      reply_out);
}

int
evt_request_bytes_as(struct evt_conn *c, const char *identity,
                     const char *subject, const char *msg_id,
                     const void *data, size_t len, int timeout_ms,
                     natsMsg **reply_out)
{
    return request_as(c, identity ? identity : c->identity, subject, msg_id,
                      data, len, timeout_ms, reply_out);
}

int
evt_request_as(struct evt_conn *c, const char *identity, const char *subject,
               const ProtobufCMessage *msg, int timeout_ms,
               natsMsg **reply_out)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    char full[256];
    int rc;

    if (!identity)
        identity = c->identity;
    if (protobuf_c_message_get_packed_size(msg) > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if ((rc = kproto_pack(msg, &buf, &len)))
        return rc;
    if (strncmp(subject, EVT_API_PREFIX, strlen(EVT_API_PREFIX)) == 0) {
        snprintf(full, sizeof(full), "%s.%s", subject, identity);
        subject = full;
    }
    rc = request_as(c, identity, subject, NULL, buf, len, timeout_ms,
                    reply_out);
    free(buf);
    return rc;
}

static int
request_as(struct evt_conn *c, const char *identity, const char *subject,
           const char *msg_id, const void *data, size_t len, int timeout_ms,
           natsMsg **reply_out)
{
    natsSubscription *sub = NULL;
    natsMsg *req = NULL, *reply = NULL;
    char inbox[EVT_INBOX_MAX];
    natsStatus st;
    int rc;

    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if ((rc = evt__inbox_of(identity, inbox, sizeof(inbox))))
        return rc;
    st = natsConnection_SubscribeSync(&sub, c->nc, inbox);
    /* A reply may come in parts (evt_publish_reply): no limit on pending
     * bytes here, the parts are bounded by EVT_REPLY_MAX_BYTES. */
    if (st == NATS_OK)
        st = natsSubscription_SetPendingLimits(sub, -1, -1);
    if (st == NATS_OK)
        st = natsMsg_Create(&req, subject, inbox, data, (int)len);
    /* JetStream's de-duplication id (nats-server docs "JetStream model
     * deep dive", Message Deduplication). */
    if (st == NATS_OK && msg_id)
        st = natsMsgHeader_Set(req, "Nats-Msg-Id", msg_id);
    if (st == NATS_OK)
        st = natsConnection_PublishMsg(c->nc, req);
    if (st == NATS_OK)
        st = natsSubscription_NextMsg(&reply, sub, timeout_ms);
    natsMsg_Destroy(req);
    if (st != NATS_OK) {
        natsSubscription_Destroy(sub);
        natsMsg_Destroy(reply);
        /* NATS_NO_RESPONDERS: nobody serves subject (KS_EUNAVAIL). */
        return evt_err(st);
    }
    rc = evt_join_parts(sub, reply, timeout_ms, reply_out);
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    return rc;
}

static size_t
hdr_num(natsMsg *m, const char *name)
{
    const char *v = NULL;
    if (natsMsgHeader_Get(m, name, &v) != NATS_OK || !v)
        return 0;
    char *end;
    unsigned long long n = strtoull(v, &end, 10);
    return *end ? 0 : (size_t)n;
}

int
evt_join_parts(natsSubscription *sub, natsMsg *first, int timeout_ms,
               natsMsg **out)
{
    size_t n = hdr_num(first, EVT_HDR_PARTS), len = 0;
    char *buf = NULL;
    natsMsg *m = first, *joined = NULL;
    int rc = 0;

    if (n <= 1) {
        *out = first;
        return 0;
    }
    if (n > EVT_REPLY_MAX_BYTES / EVT_PART_BYTES + 1) {
        natsMsg_Destroy(first);
        return KS_ETOOBIG;
    }
    if (!(buf = malloc(n * EVT_PART_BYTES))) {
        natsMsg_Destroy(first);
        return -ENOMEM;
    }
    for (size_t i = 1; i <= n; i++) {
        if (i > 1) {
            natsStatus st = natsSubscription_NextMsg(&m, sub, timeout_ms);
            if (st != NATS_OK) {
                rc = evt_err(st);
                m = NULL;
                break;
            }
        }
        size_t dl = (size_t)natsMsg_GetDataLength(m);
        if (hdr_num(m, EVT_HDR_PART) != i ||
            hdr_num(m, EVT_HDR_PARTS) != n || dl > EVT_PART_BYTES) {
            rc = KS_EDECODE;
            break;
        }
        memcpy(buf + len, natsMsg_GetData(m), dl);
        len += dl;
        natsMsg_Destroy(m);
        m = NULL;
    }
    natsMsg_Destroy(m);
    if (rc == 0 &&
        natsMsg_Create(&joined, natsSubscription_GetSubject(sub), NULL, buf,
                       (int)len) != NATS_OK)
        rc = -ENOMEM;
    free(buf);
    if (rc == 0)
        *out = joined;
    return rc;
}
