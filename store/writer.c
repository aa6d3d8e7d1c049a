/*
 * writer.c: the group writer (store.h "the group writer"). Group commit
 * without a thread of its own: a caller that queues an append and finds a
 * connection free writes, on its own thread, everything queued (its own
 * append first of all when it is alone: no hand-over, no added latency);
 * the callers that queue meanwhile wait, and when the writing one is done
 * the first of them writes what queued during its transaction, and so on.
 * So the appends of every command in flight (dispatch records, claims,
 * results) share commits under load, and an idle system writes each at
 * once.
 *
 * A group of two or more is sent as one libpq pipeline (one implicit
 * transaction, committed at its Sync; libpq docs 34.5 "Pipeline Mode"):
 * per wave, the claims' wait for their records (store__sql_write_wait)
 * and store__sql_write, which gives each append its own verdict. A wave
 * holds at most one append per stream and per command id (the statement
 * touches each row once, and the fold has one row per command), so an
 * append whose stream or command is already in a wave goes into the next
 * one, which runs after it in the same transaction and sees what it wrote.
 * Nearly every group is one wave.
 *
 * One append alone, one that holds a batch event (BatchRequested, ...,
 * which the fold does not project) or one at any version is written by
 * store_append() (store_append_claim()) on the writer's connection, in
 * queue order.
 */
#include "store_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* The packed events of one group, about (one append may pass it). */
#define WRITER_MAX_BYTES (8u << 20)
#define WRITER_MAX_CONNS 16
/* Tries of a whole group that a deadlock or a serialization failure
 * aborted (nothing written), before its appends get the code. */
#define WRITER_RETRIES 3
/* Streams remembered as held by another transaction's row lock, and for
 * how long (us). */
#define WRITER_LOCKED_MAX 8
#define WRITER_LOCKED_US INT64_C(5000000)
/* A stream id as remembered there (a longer one is not matched: only
 * written in groups as before). */
#define WRITER_STREAM_MAX 160

enum witem_state { W_QUEUED, W_SENT, W_DONE };

/* One queued append: lives on its caller's stack for the call. */
struct witem {
    const struct store_write *wr;
    struct store_write_result res;
    int rc;
    enum witem_state state;
    bool solo;         /* holds a batch event, or at any version: alone */
    /* store__write_now's: at the version the statement reads, and the
     * command state it assumes there (NULL: none). */
    bool at_read;
    const struct store_command_state *assumed;
    bool between_done; /* wr->between has run */
    size_t bytes;      /* its packed events */
    unsigned wave;     /* group building */
    pthread_cond_t cond;
    struct witem *next;
};

struct store_writer;

/* One connection, used by one writing caller at a time (or a store's own,
 * for store__write_now: w NULL, nobody waits on it). */
struct store__wconn {
    struct store_writer *w;
    struct store *s;
    bool busy;          /* (w->mu) a caller writes on it */
    struct witem *self; /* the writing caller's own append, if in hand */
    /* The arrays of store__sql_write, reused from group to group. */
    struct store__buf stream, expected, agent, count, evitem, ord;
    struct store__buf ast, aag, aat; /* the states assumed */
    struct witem **batch; /* STORE_WRITER_MAX_APPENDS */
};

/* One queue for every connection: a free connection takes everything
 * queued, so one connection writes while the load is light (no group is
 * split for nothing) and the others join in when it is busy. */
struct store_writer {
    pthread_mutex_t mu;
    pthread_cond_t drained; /* a connection was freed (close waits) */
    struct witem *head, *tail;
    bool stopping;
    unsigned n;
    struct store__wconn c[WRITER_MAX_CONNS];
    /* (mu) Streams an append of which waited past the lock_timeout
     * lately: their appends are written alone for WRITER_LOCKED_US, so
     * that a row another transaction holds fails no group. */
    struct {
        char stream[WRITER_STREAM_MAX];
        int64_t until_us;
    } recent[WRITER_LOCKED_MAX];
};

static const struct store_write_result no_result;

/* ---- queue ---- */

/* Marks items (under the queue's lock) and wakes their callers. */
static void
set_state(struct store__wconn *c, struct witem **it, size_t n,
          enum witem_state st)
{
    if (!c->w) {
        for (size_t i = 0; i < n; i++)
            it[i]->state = st;
        return;
    }
    pthread_mutex_lock(&c->w->mu);
    for (size_t i = 0; i < n; i++) {
        it[i]->state = st;
        pthread_cond_signal(&it[i]->cond);
    }
    pthread_mutex_unlock(&c->w->mu);
}

/*
 * The items are sent: their callers may run their between() now, beside
 * the database's work. The writing caller's own runs here, on its thread
 * (it is busy reading the results after this), but only when nobody waits
 * for the connection: the connection is held until it returns, and a
 * between() that is slow (a publish waiting for its PubAck) must not hold
 * up the next group. Not run, its caller does that work after.
 */
static void
set_sent(struct store__wconn *c, struct witem **it, size_t n)
{
    bool alone;

    if (!c->w)
        return; /* store__write_now: no caller waits */
    pthread_mutex_lock(&c->w->mu);
    for (size_t i = 0; i < n; i++) {
        it[i]->state = W_SENT;
        pthread_cond_signal(&it[i]->cond);
    }
    alone = c->w->head == NULL;
    pthread_mutex_unlock(&c->w->mu);
    for (size_t i = 0; alone && i < n; i++)
        if (it[i] == c->self && it[i]->wr->between &&
            !it[i]->between_done) {
            it[i]->between_done = true;
            it[i]->wr->between(it[i]->wr->ud);
        }
}

/* The group's code for one append, with what the connection says. */
static void
fail_item(struct store *s, struct witem *it, int rc)
{
    it->rc = rc;
    it->res.version = 0;
    it->res.in_doubt = store_in_doubt(s);
    snprintf(it->res.sqlstate, sizeof(it->res.sqlstate), "%s",
             store_last_sqlstate(s));
    snprintf(it->res.error, sizeof(it->res.error), "%s",
             store_last_error(s));
}

/* 1 when s's last failure was a wait past the session's lock_timeout
 * (55P03 lock_not_available; store.c WRITER_SESSION). */
static bool
lock_timed_out(struct store *s, int rc)
{
    return rc == KS_EPGREFUSED &&
           strcmp(store_last_sqlstate(s), "55P03") == 0;
}

/* it's append waited past the lock_timeout: noted for the writer's next
 * WRITER_LOCKED_US (stream_locked). */
static void
note_locked(struct store__wconn *c, const struct witem *it)
{
    const char *id = it->wr->stream_id;
    if (!c->w)
        return;
    pthread_mutex_lock(&c->w->mu);
    size_t k = 0;
    for (size_t i = 0; i < WRITER_LOCKED_MAX; i++) {
        if (strcmp(c->w->recent[i].stream, id) == 0) {
            k = i;
            break;
        }
        if (c->w->recent[i].until_us < c->w->recent[k].until_us)
            k = i;
    }
    snprintf(c->w->recent[k].stream, sizeof(c->w->recent[k].stream), "%s",
             id);
    c->w->recent[k].until_us = ks_mono_us() + WRITER_LOCKED_US;
    pthread_mutex_unlock(&c->w->mu);
}

/* A stream noted by note_locked within WRITER_LOCKED_US (w->mu held). */
static bool
recent_locked(const struct store_writer *w, const char *stream)
{
    int64_t now = ks_mono_us();
    for (size_t i = 0; i < WRITER_LOCKED_MAX; i++)
        if (w->recent[i].until_us > now &&
            strcmp(w->recent[i].stream, stream) == 0)
            return true;
    return false;
}

/* The result of an append that fails at once because its stream was
 * found locked lately. */
static void
locked_result(struct witem *it)
{
    it->rc = KS_EPGREFUSED;
    it->res = no_result;
    snprintf(it->res.sqlstate, sizeof(it->res.sqlstate), "55P03");
    snprintf(it->res.error, sizeof(it->res.error),
             "lock_not_available: another transaction holds its stream's "
             "row (an append of it waited past the lock_timeout lately)");
}

/* Ends a queued append that way (w->mu held). */
static void
locked_now(struct witem *it)
{
    locked_result(it);
    it->state = W_DONE;
    pthread_cond_signal(&it->cond);
}

/* it's stream was found locked lately: it fails at once (locked_result)
 * instead of waiting out the lock_timeout again, also later in the same
 * flush. */
static bool
stream_locked(struct store__wconn *c, const struct witem *it)
{
    if (!c->w)
        return false; /* store__write_now: no lock_timeout there */
    pthread_mutex_lock(&c->w->mu);
    bool locked = recent_locked(c->w, it->wr->stream_id);
    pthread_mutex_unlock(&c->w->mu);
    return locked;
}

/* ---- one group ---- */

/* Open addressing over the keys (streams, command ids) of a group: the
 * last wave each is in. */
struct wkey {
    const char *key;
    unsigned wave;
};

static uint64_t
key_hash(const char *k)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *k; k++)
        h = (h ^ (uint8_t)*k) * 1099511628211ull;
    return h;
}

static struct wkey *
key_slot(struct wkey *t, size_t mask, const char *k)
{
    size_t i = key_hash(k) & mask;
    while (t[i].key && strcmp(t[i].key, k) != 0)
        i = (i + 1) & mask;
    return &t[i];
}

/*
 * Puts each append in the first wave after every earlier append of its
 * stream or of a command it names. Returns the number of waves (>= 1), or
 * -ENOMEM.
 */
static int
assign_waves(struct store *s, struct witem **it, size_t n)
{
    size_t nkeys = 0, slots = 16;
    unsigned waves = 1;

    for (size_t i = 0; i < n; i++)
        nkeys += 1 + it[i]->wr->n;
    while (slots < 2 * nkeys)
        slots *= 2;
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    struct wkey *t = kproto_arena_calloc(&s->scratch, slots, sizeof(*t));
    if (!t)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const struct store_write *wr = it[i]->wr;
        unsigned w = 1;
        struct wkey *k = key_slot(t, slots - 1, wr->stream_id);
        if (k->key && k->wave >= w)
            w = k->wave + 1;
        for (size_t e = 0; e < wr->n; e++) {
            const char *cid = store__command_id(wr->events[e].event);
            if (!cid)
                continue;
            k = key_slot(t, slots - 1, cid);
            if (k->key && k->wave >= w)
                w = k->wave + 1;
        }
        it[i]->wave = w;
        if (w > waves)
            waves = w;
        k = key_slot(t, slots - 1, wr->stream_id);
        k->key = wr->stream_id;
        k->wave = w;
        for (size_t e = 0; e < wr->n; e++) {
            const char *cid = store__command_id(wr->events[e].event);
            if (!cid)
                continue;
            k = key_slot(t, slots - 1, cid);
            k->key = cid;
            k->wave = w;
        }
    }
    kproto_arena_release(&s->scratch, mark);
    return (int)waves;
}

/*
 * Sends the statements of wave w: the claims' wait for their records
 * (when it has claims), then the appends (store__sql_write).
 */
static int
send_wave(struct store__wconn *c, struct witem **it, size_t n, unsigned w)
{
    struct store *s = c->s;
    struct store__params p = {0};
    size_t na = 0, ne = 0, nclaims = 0, sent = 0;
    int rc;

    for (size_t i = 0; i < n; i++)
        if (it[i]->wave == w) {
            na++;
            ne += it[i]->wr->n;
            nclaims += it[i]->wr->claim_agent != NULL;
        }
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    const Ks__Event **evs = kproto_arena_alloc(&s->scratch, ne * sizeof(*evs));
    bool *skip = kproto_arena_calloc(&s->scratch, ne, sizeof(*skip));
    if (!evs || !skip) {
        rc = -ENOMEM;
        goto out;
    }
    if (nclaims) {
        if ((rc = store__arr_begin(&c->agent, STORE__OID_TEXT, nclaims)) < 0)
            goto out;
        for (size_t i = 0; i < n; i++) {
            const struct store_write *wr = it[i]->wr;
            if (it[i]->wave == w && wr->claim_agent &&
                (rc = store__arr_put(&c->agent, wr->stream_id,
                                     strlen(wr->stream_id))) < 0)
                goto out;
        }
        store__p_bin(&p, c->agent.p, c->agent.len);
        if (!PQsendQueryPrepared(s->conn, "ks_write_wait", p.n, p.val, p.len,
                                 p.fmt, 0)) {
            rc = store__pg_error(s, NULL, NULL);
            goto out;
        }
        p.n = 0;
    }
    if ((rc = store__arr_begin(&c->stream, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->expected, STORE__OID_INT8, na)) < 0 ||
        (rc = store__arr_begin(&c->agent, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->count, STORE__OID_INT4, na)) < 0 ||
        (rc = store__arr_begin(&c->ast, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->aag, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->aat, STORE__OID_INT4, na)) < 0 ||
        (rc = store__arr_begin(&c->evitem, STORE__OID_INT4, ne)) < 0 ||
        (rc = store__arr_begin(&c->ord, STORE__OID_INT4, ne)) < 0 ||
        (rc = store__arr_begin(&s->ids, STORE__OID_UUID, ne)) < 0 ||
        (rc = store__arr_begin(&s->types, STORE__OID_TEXT, ne)) < 0 ||
        (rc = store__arr_begin(&s->data, STORE__OID_BYTEA, ne)) < 0)
        goto out;
    na = 0;
    for (size_t i = 0; i < n; i++) {
        const struct store_write *wr = it[i]->wr;
        if (it[i]->wave != w)
            continue;
        const struct store_command_state *as = it[i]->assumed;
        na++;
        if ((rc = store__arr_put(&c->stream, wr->stream_id,
                                 strlen(wr->stream_id))) < 0 ||
            (rc = it[i]->at_read
                      ? store__arr_put_null(&c->expected)
                      : store__arr_put_i64(&c->expected,
                                           wr->expected_version)) < 0 ||
            (rc = wr->claim_agent
                      ? store__arr_put(&c->agent, wr->claim_agent,
                                       strlen(wr->claim_agent))
                      : store__arr_put_null(&c->agent)) < 0 ||
            (rc = store__arr_put_i32(&c->count, (int32_t)wr->n)) < 0)
            goto out;
        if (as) {
            const char *st = kproto_status_name(as->status);
            if ((rc = store__arr_put(&c->ast, st, strlen(st))) < 0 ||
                (rc = store__arr_put(&c->aag, as->agent_id,
                                     strlen(as->agent_id))) < 0 ||
                (rc = store__arr_put_i32(&c->aat, (int32_t)as->attempt)) < 0)
                goto out;
        } else if ((rc = store__arr_put_null(&c->ast)) < 0 ||
                   (rc = store__arr_put_null(&c->aag)) < 0 ||
                   (rc = store__arr_put_null(&c->aat)) < 0) {
            goto out;
        }
        for (size_t e = 0; e < wr->n; e++) {
            const Ks__Event *ev = wr->events[e].event;
            evs[sent++] = ev;
            /* The writer decides the versions: the expected one's next
             * (the statement adds the expected or the version read). */
            if ((rc = store__arr_put_i32(&c->evitem, (int32_t)na)) < 0 ||
                (rc = store__arr_put_i32(&c->ord, (int32_t)e + 1)) < 0 ||
                (rc = store__arr_put_uuid(&s->ids, ev->event_id)) < 0 ||
                (rc = store__arr_put(&s->types, ev->type,
                                     strlen(ev->type))) < 0 ||
                (rc = store__put_packed_event(&s->data, ev)) < 0)
                goto out;
        }
    }
    /* The projections: one summary row per command (store/fold.c). */
    rc = store__fold_batch(s, evs, ne, skip, &sent);
    if (rc != 0) {
        /* 1 (order-dependent batch events) cannot happen: solo. */
        rc = rc > 0 ? KS_EINVAL : rc;
        goto out;
    }
    store__p_bin(&p, c->stream.p, c->stream.len);
    store__p_bin(&p, c->expected.p, c->expected.len);
    store__p_bin(&p, c->agent.p, c->agent.len);
    store__p_bin(&p, c->count.p, c->count.len);
    store__p_bin(&p, s->ids.p, s->ids.len);
    store__p_bin(&p, s->types.p, s->types.len);
    store__p_bin(&p, s->data.p, s->data.len);
    store__p_bin(&p, c->evitem.p, c->evitem.len);
    store__p_bin(&p, c->ord.p, c->ord.len);
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        store__p_bin(&p, s->fold[i].p, s->fold[i].len);
    store__p_bin(&p, c->ast.p, c->ast.len);
    store__p_bin(&p, c->aag.p, c->aag.len);
    store__p_bin(&p, c->aat.p, c->aat.len);
    if (!PQsendQueryPrepared(s->conn, "ks_write", p.n, p.val, p.len, p.fmt,
                             0))
        rc = store__pg_error(s, NULL, NULL);
out:
    kproto_arena_release(&s->scratch, mark);
    return rc;
}

/* The verdict of store__sql_write for one append (row r of res). */
static void
take_verdict(struct witem *it, const PGresult *res, int r)
{
    static const int codes[] = {0, KS_EDUPLICATE, KS_ECONFLICT, KS_EDENIED,
                                KS_ENOTFOUND};
    long code = strtol(PQgetvalue(res, r, 0), NULL, 10);

    it->res = no_result;
    it->rc = code >= 0 && code < 5 ? codes[code] : KS_EPG;
    if (!PQgetisnull(res, r, 1))
        it->res.version = strtoll(PQgetvalue(res, r, 1), NULL, 10);
}

/* read_group's reader: the rows of each wave in turn. */
struct verdicts {
    struct witem **it;
    size_t n;
    unsigned wave;
    bool short_; /* a wave with fewer rows than appends: cannot be */
};

static void
take_wave(const PGresult *res, void *ud)
{
    struct verdicts *v = ud;
    int r = 0;

    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        return; /* the claims' wait, or a failure: the reader's */
    v->wave++;
    for (size_t i = 0; i < v->n; i++)
        if (v->it[i]->wave == v->wave && r < PQntuples(res))
            take_verdict(v->it[i], res, r++);
        else if (v->it[i]->wave == v->wave)
            v->short_ = true;
}

/*
 * Reads the group's results up to its sync: each wave's rows, in wave
 * order, are the verdicts of its appends in queue order. Returns 0 (every
 * append has its verdict) or the group's failure.
 */
static int
read_group(struct store__wconn *c, struct witem **it, size_t n)
{
    struct verdicts v = {it, n, 0, false};
    int rc = store__pipeline_read(c->s, take_wave, &v, NULL);
    return rc == 0 && v.short_ ? KS_EPG : rc;
}

/* Metrics and wake-ups of what one group wrote. */
static void
note_written(struct store *s, struct witem **it, size_t n, int64_t t0)
{
    for (size_t i = 0; i < n; i++) {
        const struct store_write *wr = it[i]->wr;
        if (it[i]->rc != 0)
            continue;
        struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
        const Ks__Event **evs =
            kproto_arena_alloc(&s->scratch, wr->n * sizeof(*evs));
        for (size_t e = 0; evs && e < wr->n; e++)
            evs[e] = wr->events[e].event;
        if (evs)
            store__note_recorded(evs, wr->n, NULL, t0);
        kproto_arena_release(&s->scratch, mark);
    }
}

/*
 * One try of a group: 0 when every append has its verdict (the
 * transaction committed whatever was written), else the code the whole
 * group failed with (nothing written, unless the connection's in_doubt).
 */
static int
group_once(struct store__wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    int64_t t0 = ks_mono_us();
    int rc, waves;

    if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
        return rc;
    if ((waves = assign_waves(s, it, n)) < 0)
        return waves;
    if (!PQenterPipelineMode(s->conn))
        return store__pg_error(s, NULL, NULL);
    /* Events locked before the first write gives the transaction its id
     * (migration 12, the readers' rule in store.h); it answers no rows, so
     * it is no wave. */
    if (!PQsendQueryPrepared(s->conn, "ks_lock", 0, NULL, NULL, NULL, 0)) {
        int lost = store__pg_error(s, NULL, NULL);
        store__pipeline_end(s);
        s->broken = true;
        return lost;
    }
    for (int w = 1; w <= waves; w++)
        if ((rc = send_wave(c, it, n, (unsigned)w)) < 0) {
            /* Part of the group is sent: never sync it. A connection
             * without its sync is dropped (the server rolls back). */
            store__pipeline_end(s);
            s->broken = true;
            return rc;
        }
    if (!PQpipelineSync(s->conn)) {
        int lost = store__pg_error(s, NULL, NULL);
        store__pipeline_end(s);
        s->broken = true;
        s->in_doubt = true; /* the sync may have gone out in part */
        return store__keep_sick(lost);
    }
    PQflush(s->conn);
    set_sent(c, it, n);
    if (c->w)
        ks_metric_inc(KS_C_WRITER_TRANSACTIONS);
    rc = read_group(c, it, n);
    store__pipeline_end(s);
    if (rc == 0)
        note_written(s, it, n, t0);
    return rc;
}

static bool
retryable(struct store *s, int rc)
{
    const char *st = store_last_sqlstate(s);
    return rc == KS_EPGREFUSED &&
           (strcmp(st, "40P01") == 0 || strcmp(st, "40001") == 0);
}

/*
 * Appends that came back a conflict: was it a redelivery racing its first
 * delivery (every event recorded, by the writer whose lock it waited
 * for)? Then it is a duplicate, with its stream's version, as
 * store_append says. One read, only when a group had conflicts; if it
 * fails, the conflicts stand (true as well: nothing of theirs written).
 */
static void
recheck_conflicts(struct store__wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    struct store__params p = {0};
    size_t ne = 0;
    PGresult *res;

    for (size_t i = 0; i < n; i++)
        if (it[i]->rc == KS_ECONFLICT)
            ne += it[i]->wr->n;
    if (ne == 0 || store__arr_begin(&c->evitem, STORE__OID_UUID, ne) < 0)
        return;
    for (size_t i = 0; i < n; i++)
        for (size_t e = 0; it[i]->rc == KS_ECONFLICT && e < it[i]->wr->n; e++)
            if (store__arr_put_uuid(&c->evitem,
                                    it[i]->wr->events[e].event->event_id) < 0)
                return;
    store__p_bin(&p, c->evitem.p, c->evitem.len);
    res = PQexecParams(s->conn,
                       "SELECT e.event_id::text, coalesce((SELECT st.version"
                       " FROM streams st WHERE st.stream_id = e.stream_id), 0)"
                       " FROM events e WHERE e.event_id = ANY ($1::uuid[])",
                       p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        store__read_error(s, res);
        PQclear(res);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        size_t found = 0;
        int64_t version = 0;
        if (it[i]->rc != KS_ECONFLICT)
            continue;
        for (size_t e = 0; e < it[i]->wr->n; e++)
            for (int r = 0; r < PQntuples(res); r++)
                if (strcasecmp(PQgetvalue(res, r, 0),
                               it[i]->wr->events[e].event->event_id) == 0) {
                    found++;
                    version = strtoll(PQgetvalue(res, r, 1), NULL, 10);
                    break;
                }
        if (found == it[i]->wr->n) {
            it[i]->rc = KS_EDUPLICATE;
            it[i]->res.version = version;
        }
    }
    PQclear(res);
}

/* The group of n > 1 failed because one of its appends waited past the
 * lock_timeout (55P03): the others need not fail with it. */
static bool
lock_waited(struct store *s, int rc, size_t n)
{
    return n > 1 && lock_timed_out(s, rc);
}

/* A group, with its retries; every append has its code on return. */
static void
write_group(struct store__wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    int rc = group_once(c, it, n);

    for (int t = 1; rc && retryable(s, rc) && t < WRITER_RETRIES; t++)
        rc = group_once(c, it, n);
    if (rc == 0) {
        recheck_conflicts(c, it, n);
        return;
    }
    if ((store_db_sick(rc) && !lock_waited(s, rc, n)) || rc == -ENOMEM) {
        for (size_t i = 0; i < n; i++)
            fail_item(s, it[i], rc);
        return;
    }
    /*
     * Not the database's health: something about one of the appends that
     * the statement's checks did not foresee (a unique violation: another
     * writer raced one past its checks), or one append waited past the
     * session's lock_timeout for a row another transaction holds (store.c
     * WRITER_SESSION). Each alone, then, so only its own append fails;
     * twice, since a race lost once is decided by the checks the second
     * time.
     */
    for (size_t i = 0; i < n; i++) {
        if (stream_locked(c, it[i])) {
            locked_result(it[i]);
            continue;
        }
        int r = group_once(c, &it[i], 1);
        for (int t = 1; r && !store_db_sick(r) && r != -ENOMEM && t < 2; t++)
            r = group_once(c, &it[i], 1);
        for (int t = 1; r && retryable(s, r) && t < WRITER_RETRIES; t++)
            r = group_once(c, &it[i], 1);
        if (r && lock_timed_out(s, r))
            note_locked(c, it[i]);
        if (r)
            fail_item(s, it[i], r);
        else
            recheck_conflicts(c, &it[i], 1);
    }
}

/*
 * A group as one transaction, whatever it holds (store__write_now): tried
 * again when it failed for a reason of its own (a deadlock, or a race that
 * the statement's checks decide on the next try), never split.
 */
static int
write_whole(struct store__wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    int rc = group_once(c, it, n);

    for (int t = 1; rc && t < WRITER_RETRIES &&
                    (retryable(s, rc) || (!store_db_sick(rc) && rc != -ENOMEM));
         t++)
        rc = group_once(c, it, n);
    if (rc == 0)
        recheck_conflicts(c, it, n);
    return rc;
}

/* store_append_overlap's between: the append is sent. */
struct solo_sent {
    struct store__wconn *c;
    struct witem *it;
};

static void
solo_sent(void *ud)
{
    struct solo_sent *ss = ud;
    set_sent(ss->c, &ss->it, 1);
}

/*
 * One append alone, by store_append() (or store_append_claim()): one that
 * holds a batch event or is at any version, and any append that finds
 * the writer idle. The set-based statement costs more than the per-event
 * functions for one append (it sets up every part of the statement, the
 * projections included, whatever the append needs: test_writer_bench
 * with one thread), and a lone append has nobody to share its commit with.
 */
static void
write_solo(struct store__wconn *c, struct witem *it)
{
    const struct store_write *wr = it->wr;
    struct store *s = c->s;
    struct solo_sent ss = {c, it};

    it->res = no_result;
    if (stream_locked(c, it)) {
        locked_result(it);
        return;
    }
    ks_metric_inc(KS_C_WRITER_TRANSACTIONS);
    if (wr->claim_agent) {
        set_sent(c, &it, 1); /* before: a claim's has nothing to overlap */
        it->rc = store_append_claim(s, wr->stream_id, wr->expected_version,
                                    wr->claim_agent, wr->events,
                                    &it->res.version);
    } else {
        it->rc = store_append_overlap(s, wr->stream_id, wr->expected_version,
                                      wr->events, wr->n, &it->res.version,
                                      solo_sent, &ss);
    }
    if (it->rc && lock_timed_out(s, it->rc))
        note_locked(c, it);
    if (it->rc && it->rc != KS_EDUPLICATE) {
        int64_t v = it->res.version;
        fail_item(s, it, it->rc);
        it->res.version = v;
    }
}

static void
flush(struct store__wconn *c, struct witem **it, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && !it[j]->solo)
            j++;
        if (j - i >= 2) {
            write_group(c, it + i, j - i);
        } else {
            j = i + 1;
            write_solo(c, it[i]);
        }
        set_state(c, it + i, j - i, W_DONE);
        i = j;
    }
}

/*
 * With w->mu held and c taken: writes what is queued, as many groups as
 * it takes to reach self if self is queued (at most one when self is
 * NULL), then frees c and hands the queue to the next waiting caller.
 * Returns with w->mu held.
 */
static void
lead(struct store_writer *w, struct store__wconn *c, struct witem *self)
{
    do {
        size_t n = 0, bytes = 0;
        while (w->head && n < STORE_WRITER_MAX_APPENDS &&
               (n == 0 || bytes + w->head->bytes <= WRITER_MAX_BYTES)) {
            struct witem *it = w->head;
            w->head = it->next;
            if (!w->head)
                w->tail = NULL;
            /* A stream held by another transaction's lock lately: its
             * append fails at once (its caller tries again later), so
             * that it neither waits out the lock_timeout again nor makes
             * a group wait and fail. After WRITER_LOCKED_US one goes to
             * the database again. Before, a claim asked again every 2 s
             * kept the one connection waiting all the time, and every
             * other append came too late for its asker (test_agent
             * claim_whose_reply_is_lost_runs_once, 3 soak runs in 6). */
            if (recent_locked(w, it->wr->stream_id)) {
                locked_now(it);
                continue;
            }
            bytes += it->bytes;
            c->batch[n++] = it;
        }
        pthread_mutex_unlock(&w->mu);
        c->self = self;
        flush(c, c->batch, n);
        c->self = NULL;
        pthread_mutex_lock(&w->mu);
    } while (self && self->state == W_QUEUED && w->head);
    c->busy = false;
    /* The first caller still queued writes next (it waits on its own
     * condition); close() may be waiting for the connections. */
    if (w->head)
        pthread_cond_signal(&w->head->cond);
    pthread_cond_broadcast(&w->drained);
}

static struct store__wconn *
free_conn(struct store_writer *w)
{
    for (unsigned i = 0; i < w->n; i++)
        if (!w->c[i].busy)
            return &w->c[i];
    return NULL;
}

/* ---- API ---- */

/* The arrays of store__sql_write a connection keeps. */
#define WCONN_BUFS 9
static void
wconn_bufs(struct store__wconn *c, struct store__buf *b[WCONN_BUFS])
{
    struct store__buf *all[WCONN_BUFS] = {
        &c->stream, &c->expected, &c->agent, &c->count, &c->evitem,
        &c->ord,    &c->ast,      &c->aag,   &c->aat};
    memcpy(b, all, sizeof(all));
}

/* The arrays' caps (a store__buf grows up to its cap). */
static void
wconn_init(struct store__wconn *c)
{
    struct store__buf *b[WCONN_BUFS];
    wconn_bufs(c, b);
    for (size_t i = 0; i < WCONN_BUFS; i++)
        b[i]->cap = KS_MAX_MESSAGE_BYTES;
}

static void
wconn_bufs_release(struct store__wconn *c)
{
    struct store__buf *b[WCONN_BUFS];
    wconn_bufs(c, b);
    for (size_t i = 0; i < WCONN_BUFS; i++)
        store__buf_release(b[i]);
}

static void
wconn_release(struct store__wconn *c)
{
    store_close(c->s);
    c->s = NULL;
    wconn_bufs_release(c);
    free(c->batch);
    c->batch = NULL;
}

/* ---- a store's own group (store__write_now) ---- */

void
store__direct_free(struct store__wconn *c)
{
    if (!c)
        return;
    wconn_bufs_release(c);
    free(c);
}

int
store__write_now(struct store *s, struct store__wreq *reqs, size_t n)
{
    struct store__wconn *c = s->direct;
    int rc;

    BUG_ON(n == 0);
    if (!c) {
        if (!(c = calloc(1, sizeof(*c))))
            return -ENOMEM;
        wconn_init(c);
        c->s = s;
        s->direct = c;
    }
    if (!s->generic_plans &&
        ((rc = store__ready(s)) < 0 || (rc = store__generic_plans(s)) < 0))
        return rc;
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    struct witem *its = kproto_arena_calloc(&s->scratch, n, sizeof(*its));
    struct witem **items = kproto_arena_calloc(&s->scratch, n, sizeof(*items));
    if (!its || !items) {
        kproto_arena_release(&s->scratch, mark);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        its[i].wr = &reqs[i].wr;
        its[i].at_read = reqs[i].at_read;
        its[i].assumed = reqs[i].assumed;
        its[i].state = W_QUEUED;
        items[i] = &its[i];
    }
    rc = write_whole(c, items, n);
    for (size_t i = 0; i < n; i++) {
        reqs[i].rc = rc ? rc : its[i].rc;
        reqs[i].res = rc ? no_result : its[i].res;
    }
    kproto_arena_release(&s->scratch, mark);
    return rc;
}

int
store_writer_open(const char *conninfo, unsigned n_conns,
                  struct store_writer **out, char **errmsg)
{
    struct store_writer *w;
    int rc = 0;

    if (n_conns < 1 || n_conns > WRITER_MAX_CONNS)
        return KS_EINVAL;
    if (!(w = calloc(1, sizeof(*w))))
        return -ENOMEM;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->drained, NULL);
    for (unsigned i = 0; i < n_conns; i++) {
        struct store__wconn *c = &w->c[i];
        c->w = w;
        w->n = i + 1;
        if ((rc = store_open(conninfo, &c->s, errmsg)) < 0)
            break;
        if ((rc = store__writer_session(c->s)) < 0)
            break;
        wconn_init(c);
        if (!(c->batch = calloc(STORE_WRITER_MAX_APPENDS,
                                sizeof(*c->batch)))) {
            rc = -ENOMEM;
            break;
        }
    }
    if (rc < 0) {
        store_writer_close(w);
        return rc;
    }
    *out = w;
    return 0;
}

void
store_writer_close(struct store_writer *w)
{
    if (!w)
        return;
    /* New appends are refused; those queued are written by their callers,
     * who are waiting for them. */
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    for (;;) {
        bool busy = w->head != NULL;
        for (unsigned i = 0; i < w->n; i++)
            busy = busy || w->c[i].busy;
        if (!busy)
            break;
        pthread_cond_wait(&w->drained, &w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    for (unsigned i = 0; i < w->n; i++)
        wconn_release(&w->c[i]);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->drained);
    free(w);
}

/* The caller's checks, before anything is queued (store_append's). */
static int
check_write(const struct store_write *wr, bool *solo, size_t *bytes)
{
    if (!wr->stream_id || !wr->stream_id[0] || !wr->events || wr->n == 0 ||
        wr->expected_version < STORE_ANY)
        return KS_EINVAL;
    if (wr->claim_agent && (strncmp(wr->stream_id, "command-", 8) != 0 ||
                            !ks_is_uuid(wr->stream_id + 8)))
        return KS_EINVAL;
    *solo = false;
    *bytes = 0;
    for (size_t i = 0; i < wr->n; i++) {
        const Ks__Event *ev = wr->events[i].event;
        Ks__CommandStatus st;
        int rc = store__validate(ev);
        size_t len;
        if (rc < 0)
            return rc;
        if (strcmp(ev->stream_id, wr->stream_id) != 0)
            return KS_EINVAL;
        if (store__proj_kind(ev, &st) == STORE__PROJ_BATCH)
            *solo = true;
        /* At any version: the server numbers it (store_append). */
        if (wr->expected_version == STORE_ANY)
            *solo = true;
        len = ks__event__get_packed_size(ev);
        if (len > KS_MAX_MESSAGE_BYTES)
            return KS_ETOOBIG;
        *bytes += len;
    }
    /* An event_id twice in one append: refused, as by store_append. */
    if (wr->n > 1) {
        const Ks__Event **evs = malloc(wr->n * sizeof(*evs));
        struct store__id_ref *refs = malloc(wr->n * sizeof(*refs));
        bool *rep = calloc(wr->n, sizeof(*rep));
        size_t k = 0;
        if (evs && refs && rep) {
            for (size_t i = 0; i < wr->n; i++)
                evs[i] = wr->events[i].event;
            k = store__mark_repeats(evs, wr->n, refs, rep);
        }
        free(evs);
        free(refs);
        free(rep);
        if (!evs || !refs || !rep)
            return -ENOMEM;
        if (k)
            return KS_EINVAL;
    }
    return 0;
}

int
store_writer_append(struct store_writer *w, const struct store_write *wr,
                    struct store_write_result *res)
{
    struct witem it = {.wr = wr, .state = W_QUEUED};
    int rc;

    BUG_ON(!w || !wr);
    if ((rc = check_write(wr, &it.solo, &it.bytes)) < 0) {
        if (res)
            *res = no_result;
        return rc;
    }
    pthread_cond_init(&it.cond, NULL);
    pthread_mutex_lock(&w->mu);
    if (w->stopping) {
        pthread_mutex_unlock(&w->mu);
        pthread_cond_destroy(&it.cond);
        if (res)
            *res = no_result;
        return KS_ESTOPPED;
    }
    if (w->tail)
        w->tail->next = &it;
    else
        w->head = &it;
    w->tail = &it;
    ks_metric_inc(KS_C_WRITER_APPENDS); /* counted once queued */
    for (;;) {
        struct store__wconn *c;
        if (it.state == W_DONE)
            break;
        if (it.state == W_QUEUED && (c = free_conn(w))) {
            /* Nobody writes on c: write what is queued, here. */
            c->busy = true;
            lead(w, c, &it);
            continue;
        }
        if (it.state == W_SENT && wr->between && !it.between_done) {
            it.between_done = true;
            pthread_mutex_unlock(&w->mu);
            wr->between(wr->ud);
            pthread_mutex_lock(&w->mu);
            continue;
        }
        pthread_cond_wait(&it.cond, &w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    pthread_cond_destroy(&it.cond);
    if (res)
        *res = it.res;
    return it.rc;
}

int
store_writer_checked_at(struct store_writer *w, const Ks__Event *ev,
                        const struct store_command_state *known,
                        int64_t version, store_check_fn check, void *ud,
                        struct store_write_result *res)
{
    Ks__Event copy;
    char stream[8 + 37];
    int rc = store__checked_at_decide(ev, known, version, check, ud, &copy,
                                      stream);

    if (rc) {
        if (res)
            *res = no_result;
        return rc;
    }
    struct store_event se = {&copy};
    struct store_write wr = {.stream_id = stream,
                             .expected_version = version,
                             .events = &se,
                             .n = 1};
    return store_writer_append(w, &wr, res);
}
