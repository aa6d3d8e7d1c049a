/*
 * request.c: request/reply on replies only this identity may read.
 *
 * nats.c 3.4.1 answers requests on "_INBOX.<nuid>.<n>" (its response mux,
 * src/conn.c) and has no natsOptions_SetCustomInboxPrefix (3.6), so every
 * user that makes a request must be allowed to subscribe to "_INBOX.>" and
 * can then read everybody's replies. kscore makes its own requests: replies
 * go to "_INBOX.<identity>.<conn>.<seq>" through one wildcard subscription
 * per connection, and the server's permissions let each user subscribe to
 * "_INBOX.<its own name>.>" only (deploy/nats-auth.conf.in).
 *
 * A request registers a waiter under its sequence number before it
 * publishes; the subscription's delivery thread hands the reply over and
 * signals it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "events.h"

struct waiter {
    struct waiter *next;
    uint64_t seq;
    natsMsg *reply;
    pthread_cond_t cond;
};

struct evt__mux {
    pthread_mutex_t mu;
    natsSubscription *sub;
    char prefix[EVT_INBOX_MAX]; /* "_INBOX.<identity>.<conn>." */
    uint64_t seq;
    struct waiter *waiters; /* few at a time: a list */
};

static void
on_reply(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct evt__mux *m = ud;
    const char *subj = natsMsg_GetSubject(msg);
    size_t plen = strlen(m->prefix);
    uint64_t seq;
    char *end;

    (void)nc;
    (void)sub;
    if (strncmp(subj, m->prefix, plen) != 0) {
        natsMsg_Destroy(msg);
        return;
    }
    seq = strtoull(subj + plen, &end, 10);
    pthread_mutex_lock(&m->mu);
    for (struct waiter *w = m->waiters; w; w = w->next)
        if (w->seq == seq && *end == '\0' && !w->reply) {
            w->reply = msg;
            msg = NULL;
            pthread_cond_signal(&w->cond);
            break;
        }
    pthread_mutex_unlock(&m->mu);
    natsMsg_Destroy(msg); /* late (timed out) or unknown: dropped */
}

int
evt_inbox(const struct evt_conn *c, char *buf, size_t len)
{
    char id[37];
    ks_uuid(id);
    /* UUIDs are subject-safe (hex and '-'). */
    int n = snprintf(buf, len, "_INBOX.%s.%s", c->identity, id);
    return n > 0 && (size_t)n < len ? 0 : KS_ETOOBIG;
}

/* The connection's mux, made on first use. */
static int
mux_get(struct evt_conn *c, struct evt__mux **out)
{
    static pthread_mutex_t make_mu = PTHREAD_MUTEX_INITIALIZER;
    struct evt__mux *m;
    char conn_id[37], subject[EVT_INBOX_MAX + 2];
    int rc = 0;

    pthread_mutex_lock(&make_mu);
    if ((m = c->mux))
        goto out;
    m = calloc(1, sizeof(*m));
    if (!m) {
        rc = -ENOMEM;
        goto out;
    }
    pthread_mutex_init(&m->mu, NULL);
    ks_uuid(conn_id);
    snprintf(m->prefix, sizeof(m->prefix), "_INBOX.%s.%.8s.", c->identity,
             conn_id);
    snprintf(subject, sizeof(subject), "%s*", m->prefix);
    rc = evt_err(natsConnection_Subscribe(&m->sub, c->nc, subject, on_reply,
                                          m));
    if (rc) {
        pthread_mutex_destroy(&m->mu);
        free(m);
        m = NULL;
        goto out;
    }
    /* The SUB must reach the server before the first request's reply can
     * be routed to it; on one connection it does (protocol order), but a
     * flush also surfaces a permission error now rather than as a
     * timeout. */
    natsConnection_FlushTimeout(c->nc, 2000);
    c->mux = m;
out:
    pthread_mutex_unlock(&make_mu);
    if (m)
        *out = m;
    return rc;
}

void
evt__mux_free(struct evt_conn *c)
{
    struct evt__mux *m = c->mux;
    if (!m)
        return;
    natsSubscription_Unsubscribe(m->sub);
    natsSubscription_Destroy(m->sub);
    pthread_mutex_destroy(&m->mu);
    free(m);
    c->mux = NULL;
}

int
evt_request_bytes(struct evt_conn *c, const char *subject, const char *msg_id,
                  const void *data, size_t len, int timeout_ms,
                  natsMsg **reply_out)
{
    struct evt__mux *m;
    struct waiter w = {0};
    char reply[EVT_INBOX_MAX + 24];
    struct timespec until;
    natsMsg *req = NULL;
    int rc;

    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if ((rc = mux_get(c, &m)))
        return rc;
    pthread_cond_init(&w.cond, NULL);
    pthread_mutex_lock(&m->mu);
    w.seq = ++m->seq;
    w.next = m->waiters;
    m->waiters = &w;
    pthread_mutex_unlock(&m->mu);
    snprintf(reply, sizeof(reply), "%s%llu", m->prefix,
             (unsigned long long)w.seq);
    rc = evt_err(natsMsg_Create(&req, subject, reply, data, (int)len));
    /* JetStream's de-duplication id (nats-server docs "JetStream model
     * deep dive", Message Deduplication). */
    if (rc == 0 && msg_id)
        rc = evt_err(natsMsgHeader_Set(req, "Nats-Msg-Id", msg_id));
    if (rc == 0)
        rc = evt_err(natsConnection_PublishMsg(c->nc, req));
    natsMsg_Destroy(req);
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&m->mu);
    while (rc == 0 && !w.reply)
        if (pthread_cond_timedwait(&w.cond, &m->mu, &until) == ETIMEDOUT &&
            !w.reply)
            rc = KS_ETIMEDOUT;
    for (struct waiter **p = &m->waiters; *p; p = &(*p)->next)
        if (*p == &w) {
            *p = w.next;
            break;
        }
    pthread_mutex_unlock(&m->mu);
    pthread_cond_destroy(&w.cond);
    if (rc == 0 && natsMsg_IsNoResponders(w.reply)) {
        /* The server's own answer (status 503): nobody serves subject. */
        natsMsg_Destroy(w.reply);
        return KS_EUNAVAIL;
    }
    if (rc) {
        natsMsg_Destroy(w.reply);
        return rc;
    }
    *reply_out = w.reply;
    return 0;
}
