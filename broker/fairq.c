/*
 * fairq.c: requests served in turn per identity (broker_int.h "fair
 * queues").
 *
 * Every API request of the broker (an agent's claim or fetch, an
 * operator's get, exec, upload...) names its sender in its subject's last
 * token, which nats-server lets only that identity publish on (broker.c
 * api_guard). Before this queue each subscription's requests waited in
 * one FIFO (nats.c's pending list of the subscription), so whoever sent
 * the most held everyone else: an agent's credential flooding claims of
 * made-up commands faster than the broker could refuse them (about
 * 100,000 a second per core) delayed every other agent's claims, and the
 * admission then refused operators' commands busy (issue 21).
 *
 * Here each identity has a queue of its own, bounded (per_identity
 * items and per_identity_bytes bytes); a request whose identity's queue
 * is full is refused at once (given to refuse: the broker drops it
 * unanswered, broker.c route_refuse), counted
 * (kscore_requests_refused_total) and logged at most every FAIRQ_LOG_US
 * per queue with how many: its sender asks again later (an agent's claim
 * and fetch after their timeout; a CLI request times out). The workers
 * serve the identities with something queued in turn (round robin: one
 * request of each, then the next round), and at most busy_max requests
 * of one identity at once, so one identity's slow requests never take
 * every worker. A request of an identity that sends rarely is served
 * after at most one request of each other identity with something
 * queued, whatever one of them sends.
 *
 * What the push costs (the subscription's own thread, for every message
 * of a flood): one mutex, a hash lookup, a copy of three words; no
 * decoding, no reply. An identity with nothing queued or in service is
 * forgotten.
 *
 * Threads: push and ahead from any thread; serve runs on the queue's
 * workers; stop from one thread, after the last push.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* One line about dropped requests at most this often per queue. */
#define FAIRQ_LOG_US INT64_C(10000000)
/* Identities with something queued at once; a new one past this is
 * dropped as if its queue were full. */
#define FAIRQ_MAX_IDS 65536

struct fq_item {
    void *ctx, *item;
    size_t bytes;
};

struct fq_ident {
    struct fq_ident *next_ready;
    bool ready;    /* in the ready list */
    unsigned busy; /* its requests being served now */
    size_t head, len, cap;
    size_t bytes; /* of the queued items */
    struct fq_item *ring;
    char id[];
};

struct fq_worker {
    struct broker__fairq *q;
    void *ud;
    pthread_t th;
    bool started;
};

struct broker__fairq {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    struct ks_map ids; /* identity -> struct fq_ident * */
    /* Identities with something queued and fewer than busy_max in
     * service, in the order they are served next. */
    struct fq_ident *ready_head, *ready_tail;
    size_t queued;
    bool stopping;
    unsigned busy_max;
    struct broker__fairq_opts o;
    /* Refusals since the last line, and whose was the last. */
    uint64_t unlogged;
    int64_t logged_us;
    char last_dropped[16 + EVT_AGENT_ID_MAX];
    unsigned nworkers;
    struct fq_worker w[];
};

static void
ready_push(struct broker__fairq *q, struct fq_ident *e)
{
    e->ready = true;
    e->next_ready = NULL;
    if (q->ready_tail)
        q->ready_tail->next_ready = e;
    else
        q->ready_head = e;
    q->ready_tail = e;
}

static struct fq_ident *
ready_pop(struct broker__fairq *q)
{
    struct fq_ident *e = q->ready_head;
    if (e) {
        q->ready_head = e->next_ready;
        if (!q->ready_head)
            q->ready_tail = NULL;
        e->ready = false;
    }
    return e;
}

/* e again in turn when it may be, forgotten when it is idle. Under mu. */
static void
ident_settle(struct broker__fairq *q, struct fq_ident *e)
{
    if (e->len && !e->ready && e->busy < q->busy_max) {
        ready_push(q, e);
        pthread_cond_signal(&q->cond);
    } else if (!e->len && !e->busy && !e->ready) {
        ks_map_del(&q->ids, e->id);
        free(e->ring);
        free(e);
    }
}

static void *
worker_main(void *arg)
{
    struct fq_worker *w = arg;
    struct broker__fairq *q = w->q;

    pthread_mutex_lock(&q->mu);
    for (;;) {
        struct fq_ident *e = ready_pop(q);
        if (!e) {
            if (q->stopping && q->queued == 0)
                break;
            pthread_cond_wait(&q->cond, &q->mu);
            continue;
        }
        struct fq_item it = e->ring[e->head];
        e->head = (e->head + 1) % e->cap;
        e->len--;
        e->bytes -= it.bytes;
        e->busy++;
        q->queued--;
        /* Its next request waits for the next round. */
        ident_settle(q, e);
        pthread_mutex_unlock(&q->mu);
        q->o.serve(w->ud, it.ctx, it.item);
        pthread_mutex_lock(&q->mu);
        e->busy--;
        ident_settle(q, e);
    }
    /* The others may be waiting for the last ones served. */
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

int
broker__fairq_start(const struct broker__fairq_opts *o,
                    struct broker__fairq **out)
{
    BUG_ON(!o->workers || !o->per_identity || !o->per_identity_bytes ||
           !o->serve || !o->refuse);
    struct broker__fairq *q =
        calloc(1, sizeof(*q) + o->workers * sizeof(q->w[0]));
    int rc = 0;

    if (!q)
        return -ENOMEM;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cond, NULL);
    q->o = *o;
    q->busy_max = o->workers > 1 ? o->workers / 2 : 1;
    q->nworkers = o->workers;
    for (unsigned i = 0; i < o->workers && rc == 0; i++) {
        q->w[i].q = q;
        q->w[i].ud = o->worker_ud ? o->worker_ud[i] : NULL;
        if (pthread_create(&q->w[i].th, NULL, worker_main, &q->w[i]) != 0)
            rc = -EAGAIN;
        else
            q->w[i].started = true;
    }
    if (rc) {
        broker__fairq_stop(q);
        return rc;
    }
    *out = q;
    return 0;
}

/* identity's entry, made when new; NULL past FAIRQ_MAX_IDS or without
 * memory. Under mu. */
static struct fq_ident *
ident_get(struct broker__fairq *q, const char *identity)
{
    struct fq_ident *e = ks_map_get(&q->ids, identity);
    if (e || q->ids.count >= FAIRQ_MAX_IDS)
        return e;
    size_t n = strlen(identity) + 1;
    if (!(e = calloc(1, sizeof(*e) + n)))
        return NULL;
    memcpy(e->id, identity, n);
    if (ks_map_put(&q->ids, identity, e) != 0) {
        free(e);
        return NULL;
    }
    return e;
}

/* Room for one more in e's ring (grows by doubling up to per_identity).
 * Under mu. */
static bool
ident_room(struct broker__fairq *q, struct fq_ident *e)
{
    if (e->len < e->cap)
        return true;
    if (e->cap >= q->o.per_identity)
        return false;
    size_t cap = e->cap ? e->cap * 2 : 4;
    if (cap > q->o.per_identity)
        cap = q->o.per_identity;
    struct fq_item *r = malloc(cap * sizeof(*r));
    if (!r)
        return false;
    for (size_t i = 0; i < e->len; i++)
        r[i] = e->ring[(e->head + i) % e->cap];
    free(e->ring);
    e->ring = r;
    e->head = 0;
    e->cap = cap;
    return true;
}

int
broker__fairq_push(struct broker__fairq *q, const char *identity, void *ctx,
                   void *item, size_t bytes)
{
    uint64_t say = 0;
    char who[sizeof(q->last_dropped)];
    int64_t now;

    pthread_mutex_lock(&q->mu);
    struct fq_ident *e = ident_get(q, identity);
    /* One item always fits an empty queue, whatever its size. */
    if (e && (!e->len || e->bytes + bytes <= q->o.per_identity_bytes) &&
        ident_room(q, e)) {
        e->ring[(e->head + e->len) % e->cap] =
            (struct fq_item){ctx, item, bytes};
        e->len++;
        e->bytes += bytes;
        q->queued++;
        ident_settle(q, e);
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    if (e)
        ident_settle(q, e); /* a new one without memory goes again */
    q->unlogged++;
    snprintf(q->last_dropped, sizeof(q->last_dropped), "%s", identity);
    now = ks_mono_us();
    if (q->logged_us == 0 || now - q->logged_us >= FAIRQ_LOG_US) {
        say = q->unlogged;
        q->unlogged = 0;
        q->logged_us = now;
        memcpy(who, q->last_dropped, sizeof(who));
    }
    pthread_mutex_unlock(&q->mu);
    q->o.refuse(ctx, item);
    ks_metric_inc(KS_C_REQUESTS_REFUSED);
    if (say)
        ks_log(KS_LOG_WARN,
               "requests refused unserved (dropped): their sender's queue "
               "is full (it sends faster than it is served in its turn; "
               "one line every 10 s while it lasts)",
               KS_S("module", "fairq"), KS_S("queue", q->o.name),
               KS_S("identity", who), KS_I("refused", say),
               KS_I("per_identity", q->o.per_identity),
               KS_I("per_identity_bytes", q->o.per_identity_bytes));
    return KS_EBUSY;
}

struct ahead {
    const char *identity;
    size_t mine;
    size_t sum;
};

static void
ahead_one(const char *key, void *val, void *ud)
{
    struct ahead *a = ud;
    const struct fq_ident *e = val;
    if (strcmp(key, a->identity) != 0)
        a->sum += e->len < a->mine + 1 ? e->len : a->mine + 1;
}

size_t
broker__fairq_ahead(struct broker__fairq *q, const char *identity)
{
    struct ahead a = {identity, 0, 0};
    if (!q)
        return 0;
    pthread_mutex_lock(&q->mu);
    const struct fq_ident *e = ks_map_get(&q->ids, identity);
    a.mine = e ? e->len : 0;
    ks_map_each(&q->ids, ahead_one, &a);
    pthread_mutex_unlock(&q->mu);
    return a.mine + a.sum;
}

void
broker__fairq_stop(struct broker__fairq *q)
{
    if (!q)
        return;
    pthread_mutex_lock(&q->mu);
    q->stopping = true;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mu);
    for (unsigned i = 0; i < q->nworkers; i++)
        if (q->w[i].started)
            pthread_join(q->w[i].th, NULL);
    /* Served to the end: nothing is left but a start that failed. */
    struct fq_ident *e;
    while ((e = ready_pop(q)) != NULL) {
        for (size_t i = 0; i < e->len; i++)
            q->o.refuse(e->ring[(e->head + i) % e->cap].ctx,
                        e->ring[(e->head + i) % e->cap].item);
        e->len = 0;
        ident_settle(q, e);
    }
    ks_map_clear(&q->ids);
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->mu);
    free(q);
}
