/*
 * request.c: request/reply on reply inboxes that live as long as their
 * connection, and only this identity may read.
 *
 * nats.c 3.4.1 answers requests on "_INBOX.<nuid>.<n>" (its response mux,
 * src/conn.c) and has no natsOptions_SetCustomInboxPrefix (3.6), so every
 * user that makes a request must be allowed to subscribe to "_INBOX.>" and
 * can then read everybody's replies. kscore makes its own requests: replies
 * go to "_INBOX.<identity>.<...>", and the server's permissions let each
 * user subscribe to "_INBOX.<its own name>.>" only
 * (deploy/nats-auth.conf.in).
 *
 * No subscription per request. kscore used to subscribe to a fresh inbox
 * for every request and destroy it after; a reply that came late, after a
 * reconnect, could then meet the subscription's destruction in nats.c's
 * read thread, which in 3.4.1 looks a subscription up and locks it without
 * holding a reference (natsConn_processMsg; nats.c issue 637, fixed by
 * retaining the subscription in 3.6.1): the read thread blocked on a freed
 * mutex and the agent never heard anything again (issue 22). Here the
 * subscriptions are made once and destroyed only after the connection is
 * closed, when nats.c's read thread has been joined (natsConnection_Close
 * joins it: src/conn.c _close).
 *
 * Each identity of a connection has a small set of long-lived synchronous
 * subscriptions, "_INBOX.<identity>.<token>.<n>.>" (token: this
 * connection's, n: the subscription's number), lent out one per
 * request (evt_inbox_take). A lease answers to
 * "_INBOX.<identity>.<token>.<n>.<lease>" and anything under it; whatever
 * arrives for an earlier lease (a reply that came after its waiter gave
 * up) is dropped and counted (evt_late_replies), never mistaken for the
 * current one. The waiter waits in its own thread on its own subscription
 * (natsSubscription_NextMsg): no delivery thread is involved, so a handler
 * on nats.c's delivery threads, the shared pool included, may make a
 * request without starving the reply.
 *
 * Why a set and not one wildcard subscription demultiplexed by a thread of
 * ours: the server answers a request that nobody serves with a "no
 * responders" status message (nats-server 2.2+: a 503 status header, no
 * body) on the request's reply subject, and nats.c 3.4.1's
 * natsSubscription_NextMsg turns that message into NATS_NO_RESPONDERS and
 * destroys it (src/sub.c natsSub_nextMsg): on a shared subscription, which
 * request it answered would be lost, and only an asynchronous
 * subscription sees the subject, which on a connection with global
 * delivery runs on the very pool a handler may be blocking. With one
 * lease per subscription, the 503 can only be the lease's own, provided
 * no 503 of an earlier lease is still on its way: the server sends it to
 * the requester while it processes the request (nats-server client.go,
 * processMsgResults: subForReply), so a PING sent after the request comes
 * back after it. A lease given back with a request unanswered (its waiter
 * gave up) is lent again only after such a PING has come back and what
 * was pending on it is dropped.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "events_int.h"

/* Subscriptions per identity and connection: one per request in flight.
 * Past it, a request waits for one to come back. */
#define INBOXES_MAX 1024
/* Past this many, a given-back inbox is proven quiet (a PING) before
 * another is made. */
#define INBOXES_SOFT 16
/* The wait for the PONG that makes given-back inboxes safe to lend again
 * when every one is taken (ms). */
#define CLEAN_FLUSH_MS 2000

/* Longest identity an inbox carries: "agent-<id>" or "pool-<name>". */
#define IDENTITY_MAX (EVT_AGENT_ID_MAX + 8)

/* The inboxes of one identity on one connection. */
struct evt__inboxes {
    char identity[IDENTITY_MAX + 1];
    struct evt_inbox *idle;  /* ready to lend */
    struct evt_inbox *dirty; /* given back with a request unanswered */
    unsigned made;
    struct evt__inboxes *next;
};

struct evt_inbox {
    struct evt_conn *c;
    struct evt__inboxes *set;
    natsSubscription *sub; /* "<base>>" */
    char subject[EVT_INBOX_MAX];
    size_t base_len; /* "_INBOX.<identity>.<token>.<n>." */
    size_t len;      /* strlen(subject) */
    uint64_t lease;
    unsigned pubs, answers;
    bool settled;     /* every publish of the lease is answered */
    int64_t given_us; /* ks_mono_us when given back dirty */
    struct evt_inbox *next;
};

int
evt__mux_init(struct evt_conn *c)
{
    char u[37];
    size_t j = 0;

    c->mux = calloc(1, sizeof(*c->mux));
    if (!c->mux)
        return -ENOMEM;
    pthread_mutex_init(&c->mux->mu, NULL);
    pthread_cond_init(&c->mux->cond, NULL);
    /* 12 hex digits of a random UUID: this connection's inboxes. */
    ks_uuid(u);
    for (size_t i = 0; u[i] && j < sizeof(c->mux->token) - 1; i++)
        if (u[i] != '-')
            c->mux->token[j++] = u[i];
    c->mux->token[j] = '\0';
    return 0;
}

void
evt__mux_free(struct evt_conn *c)
{
    struct evt__mux *m = c->mux;

    if (!m)
        return;
    /* The connection is closed: its read thread is gone (nats.c _close
     * joins it), so nothing can deliver to these any more. */
    while (m->sets) {
        struct evt__inboxes *s = m->sets;
        struct evt_inbox *lists[2] = {s->idle, s->dirty};
        m->sets = s->next;
        for (int k = 0; k < 2; k++)
            while (lists[k]) {
                struct evt_inbox *ib = lists[k];
                lists[k] = ib->next;
                natsSubscription_Destroy(ib->sub);
                free(ib);
            }
        free(s);
    }
    pthread_cond_destroy(&m->cond);
    pthread_mutex_destroy(&m->mu);
    free(m);
    c->mux = NULL;
}

static void
note_answer(struct evt__mux *m)
{
    atomic_store(&m->answered_us, ks_mono_us());
}

static void
note_late(struct evt__mux *m)
{
    atomic_fetch_add(&m->late, 1);
    ks_metric_inc(KS_C_LATE_REPLIES);
}

uint64_t
evt_late_replies(const struct evt_conn *c)
{
    return c && c->mux ? atomic_load(&c->mux->late) : 0;
}

/* Under m->mu. NULL: -ENOMEM. */
static struct evt__inboxes *
set_of(struct evt__mux *m, const char *identity)
{
    struct evt__inboxes *s;

    for (s = m->sets; s; s = s->next)
        if (strcmp(s->identity, identity) == 0)
            return s;
    if (!(s = calloc(1, sizeof(*s))))
        return NULL;
    snprintf(s->identity, sizeof(s->identity), "%s", identity);
    s->next = m->sets;
    m->sets = s;
    return s;
}

/* Drops what is pending on ib, a given-back inbox now ours: replies to
 * earlier leases, and the "no responders" of one whose waiter gave up. */
static void
drain(struct evt_inbox *ib)
{
    for (;;) {
        natsMsg *msg = NULL;
        natsStatus st = natsSubscription_NextMsg(&msg, ib->sub, 0);
        if (st != NATS_OK && st != NATS_NO_RESPONDERS)
            return;
        natsMsg_Destroy(msg);
        note_late(ib->c->mux);
    }
}

/* A new subscription for set (its number n). */
static int
inbox_new(struct evt_conn *c, struct evt__inboxes *set, unsigned n,
          struct evt_inbox **out)
{
    struct evt_inbox *ib = calloc(1, sizeof(*ib));
    char wild[EVT_INBOX_MAX + 2];
    natsStatus st;
    int len;

    if (!ib)
        return -ENOMEM;
    ib->c = c;
    ib->set = set;
    len = snprintf(ib->subject, sizeof(ib->subject), "_INBOX.%s.%s.%u.",
                   set->identity, c->mux->token, n);
    /* Room for a lease (16 hex digits) and a suffix. */
    if (len < 0 || (size_t)len + 16 + 24 >= sizeof(ib->subject)) {
        free(ib);
        return KS_ETOOBIG;
    }
    ib->base_len = (size_t)len;
    snprintf(wild, sizeof(wild), "%s>", ib->subject);
    st = natsConnection_SubscribeSync(&ib->sub, c->nc, wild);
    /* A reply may come in parts (evt_publish_reply): no limit on pending
     * bytes here, the parts are bounded by EVT_REPLY_MAX_BYTES. */
    if (st == NATS_OK)
        st = natsSubscription_SetPendingLimits(ib->sub, -1, -1);
    if (st != NATS_OK) {
        /* Never used: no message can be on its way to it. */
        natsSubscription_Destroy(ib->sub);
        free(ib);
        return evt_err(st);
    }
    *out = ib;
    return 0;
}

int
evt_inbox_take(struct evt_conn *c, const char *identity,
               struct evt_inbox **out)
{
    struct evt__mux *m = c->mux;
    struct evt__inboxes *set;
    struct evt_inbox *ib = NULL;
    bool probed = false;
    int rc = 0;

    if (!identity)
        identity = c->identity;
    /* An agent id's identity, "agent-<id>", may be longer than a user
     * name (evt_identity_valid). */
    if (!evt__token_ok(identity, IDENTITY_MAX))
        return KS_EINVAL;
    pthread_mutex_lock(&m->mu);
    if (!(set = set_of(m, identity))) {
        pthread_mutex_unlock(&m->mu);
        return -ENOMEM;
    }
    for (;;) {
        /* A given-back inbox a PING has proven quiet since, first: what
         * is pending on it is freed now, not when every other is busy. */
        struct evt_inbox **pp = &set->dirty;
        while (*pp && (*pp)->given_us >= m->flushed_us)
            pp = &(*pp)->next;
        if (*pp) {
            ib = *pp;
            *pp = ib->next;
            pthread_mutex_unlock(&m->mu);
            drain(ib);
            pthread_mutex_lock(&m->mu);
            break;
        }
        if (set->idle) {
            ib = set->idle;
            set->idle = ib->next;
            break;
        }
        /* Given back ones first, if a PING proves them quiet: then a
         * link that times requests out does not leave a new subscription
         * behind each. */
        if (set->dirty && !probed && set->made >= INBOXES_SOFT) {
            probed = true;
            pthread_mutex_unlock(&m->mu);
            (void)evt_link_probe(c, CLEAN_FLUSH_MS);
            pthread_mutex_lock(&m->mu);
            continue;
        }
        if (set->made < INBOXES_MAX) {
            unsigned n = set->made++;
            pthread_mutex_unlock(&m->mu);
            rc = inbox_new(c, set, n, &ib);
            pthread_mutex_lock(&m->mu);
            if (rc)
                set->made--;
            break;
        }
        if (set->dirty) {
            pthread_mutex_unlock(&m->mu);
            rc = evt_link_probe(c, CLEAN_FLUSH_MS);
            pthread_mutex_lock(&m->mu);
            if (rc)
                break;
            continue;
        }
        pthread_cond_wait(&m->cond, &m->mu);
    }
    pthread_mutex_unlock(&m->mu);
    if (rc)
        return rc;
    ib->lease++;
    ib->pubs = ib->answers = 0;
    ib->settled = false;
    ib->next = NULL;
    snprintf(ib->subject + ib->base_len, sizeof(ib->subject) - ib->base_len,
             "%llx", (unsigned long long)ib->lease);
    ib->len = strlen(ib->subject);
    *out = ib;
    return 0;
}

const char *
evt_inbox_subject(const struct evt_inbox *ib)
{
    return ib->subject;
}

void
evt_inbox_give(struct evt_inbox *ib)
{
    struct evt__mux *m;
    bool clean;

    if (!ib)
        return;
    m = ib->c->mux;
    /* One request answered (a reply, its parts, or a "no responders"):
     * nothing more can come for it but replies, which the next lease
     * tells apart. */
    clean = ib->settled || ib->pubs == 0 || (ib->pubs == 1 && ib->answers);
    pthread_mutex_lock(&m->mu);
    if (clean) {
        ib->next = ib->set->idle;
        ib->set->idle = ib;
    } else {
        ib->given_us = ks_mono_us();
        ib->next = ib->set->dirty;
        ib->set->dirty = ib;
    }
    pthread_cond_signal(&m->cond);
    pthread_mutex_unlock(&m->mu);
}

void
evt__inbox_settled(struct evt_inbox *ib)
{
    ib->settled = true;
}

int
evt_inbox_send(struct evt_inbox *ib, const char *subject,
               const char *reply_suffix, const char *msg_id, const void *data,
               size_t len)
{
    char reply[EVT_INBOX_MAX + 32];
    natsMsg *req = NULL;
    natsStatus st;

    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if (reply_suffix && reply_suffix[0])
        snprintf(reply, sizeof(reply), "%s.%s", ib->subject, reply_suffix);
    else
        snprintf(reply, sizeof(reply), "%s", ib->subject);
    st = natsMsg_Create(&req, subject, reply, data, (int)len);
    /* JetStream's de-duplication id (nats-server docs "JetStream model
     * deep dive", Message Deduplication). */
    if (st == NATS_OK && msg_id)
        st = natsMsgHeader_Set(req, "Nats-Msg-Id", msg_id);
    if (st == NATS_OK)
        st = natsConnection_PublishMsg(ib->c->nc, req);
    natsMsg_Destroy(req);
    /* Counted even when it failed: a publish that reported an error may
     * still have gone out. */
    ib->pubs++;
    return evt_err(st);
}

int
evt_inbox_next(struct evt_inbox *ib, int timeout_ms, natsMsg **out)
{
    struct evt__mux *m = ib->c->mux;
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;

    for (;;) {
        int64_t wait_ms = (deadline - ks_mono_us() + 999) / 1000;
        natsMsg *msg = NULL;
        natsStatus st;

        if (wait_ms <= 0)
            return KS_ETIMEDOUT;
        st = natsSubscription_NextMsg(&msg, ib->sub, wait_ms);
        if (st == NATS_NO_RESPONDERS) {
            /* This lease's own: see the head of the file. */
            note_answer(m);
            ib->answers++;
            return KS_EUNAVAIL;
        }
        if (st != NATS_OK)
            return evt_err(st);
        note_answer(m);
        const char *subj = natsMsg_GetSubject(msg);
        if (strncmp(subj, ib->subject, ib->len) == 0 &&
            (subj[ib->len] == '\0' || subj[ib->len] == '.')) {
            ib->answers++;
            *out = msg;
            return 0;
        }
        /* For an earlier lease whose waiter gave up. */
        natsMsg_Destroy(msg);
        note_late(m);
    }
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
    struct evt_inbox *ib = NULL;
    natsMsg *reply = NULL;
    int rc;

    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if ((rc = evt_inbox_take(c, identity, &ib)))
        return rc;
    /* On one connection the server has the SUB (made once, long ago)
     * before the request. NATS_NO_RESPONDERS: nobody serves subject
     * (KS_EUNAVAIL). */
    if ((rc = evt_inbox_send(ib, subject, NULL, msg_id, data, len)) == 0 &&
        (rc = evt_inbox_next(ib, timeout_ms, &reply)) == 0)
        rc = evt_join_parts(ib, reply, timeout_ms, reply_out);
    evt_inbox_give(ib);
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
evt_join_parts(struct evt_inbox *ib, natsMsg *first, int timeout_ms,
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
        if (i > 1 && (rc = evt_inbox_next(ib, timeout_ms, &m))) {
            m = NULL;
            break;
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
    if (rc == 0 && natsMsg_Create(&joined, ib->subject, NULL, buf,
                                  (int)len) != NATS_OK)
        rc = -ENOMEM;
    free(buf);
    if (rc == 0)
        *out = joined;
    return rc;
}
