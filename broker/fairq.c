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
 * of a flood): one mutex, a hash lookup, a clock read and a copy of five
 * words; no decoding, no reply. An identity with nothing queued or in
 * service is forgotten.
 *
 * The exec intake (admit.c) is one too: its admission judges a request
 * by what round robin serves before it (broker__fairq_ahead), so one
 * operator's flood of execs is refused busy on its own backlog, not on
 * everyone's. Each item carries its push order and time for that, and
 * a mark (broker__fairq_mark) sets apart what was queued before it
 * (a JetStream stall's requests).
 *
 * Threads: push, ahead and mark from any thread; serve runs on the
 * queue's workers; stop from one thread, after the last push.
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
    uint64_t seq;  /* 1, 2, ... in the order pushed */
    int64_t in_us; /* when pushed (ks_mono_us) */
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
    /* The last item's seq; the last one pushed before the last mark;
     * when a worker last took an item, and a marked one (ks_mono_us, 0:
     * never). */
    uint64_t pushed, mark_seq;
    int64_t taken_us, mark_taken_us;
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
        q->taken_us = ks_mono_us();
        if (it.seq <= q->mark_seq)
            q->mark_taken_us = q->taken_us;
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
    q->busy_max = o->busy_max ? o->busy_max
                  : o->workers > 1 ? o->workers / 2
                                   : 1;
    if (q->busy_max > o->workers)
        q->busy_max = o->workers;
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
            (struct fq_item){ctx, item, bytes, ++q->pushed, ks_mono_us()};
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
               "requests refused unserved (dropped; the exec intake's "
               "answered busy): their sender's queue "
               "is full (it sends faster than it is served in its turn; "
               "one line every 10 s while it lasts)",
               KS_S("module", "fairq"), KS_S("queue", q->o.name),
               KS_S("identity", who), KS_I("refused", say),
               KS_I("per_identity", q->o.per_identity),
               KS_I("per_identity_bytes", q->o.per_identity_bytes));
    return KS_EBUSY;
}

/* e's i-th queued item (0: the next one served). Under mu. */
static const struct fq_item *
ident_at(const struct fq_ident *e, size_t i)
{
    return &e->ring[(e->head + i) % e->cap];
}

/* How many of e's queued items were pushed before the last mark: a
 * prefix, as seq grows along the ring. Under mu. */
static size_t
ident_marked(const struct broker__fairq *q, const struct fq_ident *e)
{
    size_t lo = 0, hi = e->len;
    if (!e->len || ident_at(e, 0)->seq > q->mark_seq)
        return 0;
    if (ident_at(e, e->len - 1)->seq <= q->mark_seq)
        return e->len;
    while (lo < hi) { /* the first one after the mark */
        size_t mid = lo + (hi - lo) / 2;
        if (ident_at(e, mid)->seq <= q->mark_seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

struct ahead {
    const struct broker__fairq *q;
    const char *identity;
    size_t mine;
    struct broker__fairq_wait w;
};

static void
ahead_one(const char *key, void *val, void *ud)
{
    struct ahead *a = ud;
    const struct fq_ident *e = val;
    bool own = a->identity && strcmp(key, a->identity) == 0;
    /* Round robin serves each other identity's first mine + 1 before the
     * new one's turn. */
    size_t k = own || e->len < a->mine + 1 ? e->len : a->mine + 1;
    if (!k)
        return;
    size_t marked = ident_marked(a->q, e);
    a->w.n += k;
    a->w.marked += marked < k ? marked : k;
    int64_t in = ident_at(e, 0)->in_us;
    if (!a->w.oldest_us || in < a->w.oldest_us)
        a->w.oldest_us = in;
    if (own) {
        a->w.own_us = in;
        a->w.own_n = k;
    }
}

size_t
broker__fairq_ahead(struct broker__fairq *q, const char *identity,
                    struct broker__fairq_wait *out)
{
    struct ahead a = {.q = q, .identity = identity};
    if (q) {
        pthread_mutex_lock(&q->mu);
        const struct fq_ident *e =
            identity ? ks_map_get(&q->ids, identity) : NULL;
        a.mine = e ? e->len : 0;
        ks_map_each(&q->ids, ahead_one, &a);
        a.w.taken_us = q->taken_us;
        a.w.mark_taken_us = q->mark_taken_us;
        pthread_mutex_unlock(&q->mu);
    }
    if (out)
        *out = a.w;
    return a.w.n;
}

void
broker__fairq_mark(struct broker__fairq *q)
{
    if (!q)
        return;
    pthread_mutex_lock(&q->mu);
    q->mark_seq = q->pushed;
    pthread_mutex_unlock(&q->mu);
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
