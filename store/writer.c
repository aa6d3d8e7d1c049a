/*
 * writer.c: the group writer (store.h "the group writer"). Callers queue
 * appends and wait; one thread per connection takes whatever has queued
 * and writes it in one transaction through kscore_write() (migration 10),
 * which gives each append its own verdict. So the appends of every
 * command in flight (dispatch records, claims, results) share commits
 * under load, and an idle writer sends at once.
 *
 * A group is sent as one libpq pipeline (one implicit transaction,
 * committed at its Sync; libpq docs 34.5 "Pipeline Mode"): one
 * kscore_write() per wave. A wave holds at most one append per stream and
 * per command id (the function's statements touch each row once, and the
 * fold has one row per command), so an append whose stream or command is
 * already in a wave goes into the next one, which runs after it in the
 * same transaction and sees what it wrote. Nearly every group is one wave.
 *
 * An append holding a batch event (BatchRequested, BatchCompleted, ...),
 * which the fold does not project, is written alone by store_append() on
 * the writer's connection, in queue order.
 */
#include "store_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The packed events of one group, about (one append may pass it). */
#define WRITER_MAX_BYTES (8u << 20)
#define WRITER_MAX_CONNS 16
/* Tries of a whole group that a deadlock or a serialization failure
 * aborted (nothing written), before its appends get the code. */
#define WRITER_RETRIES 3

enum witem_state { W_QUEUED, W_SENT, W_DONE };

/* One queued append: lives on its caller's stack for the call. */
struct witem {
    const struct store_write *wr;
    struct store_write_result res;
    int rc;
    enum witem_state state;
    bool solo;     /* holds a batch event: written alone */
    size_t bytes;  /* its packed events */
    unsigned wave; /* group building */
    pthread_cond_t cond;
    struct witem *next;
};

struct wconn {
    struct store *s;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t work; /* queued, or stopping */
    struct witem *head, *tail;
    bool stopping;
    /* The item arrays of kscore_write(), reused from group to group. */
    struct store__buf stream, expected, agent, first, count, evitem;
    struct witem **batch; /* STORE_WRITER_MAX_APPENDS */
};

struct store_writer {
    unsigned n;
    struct wconn c[WRITER_MAX_CONNS];
};

static const struct store_write_result no_result;

/* ---- queue ---- */

/* Marks items (under c->mu) and wakes their callers. */
static void
set_state(struct wconn *c, struct witem **it, size_t n,
          enum witem_state st)
{
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n; i++) {
        it[i]->state = st;
        pthread_cond_signal(&it[i]->cond);
    }
    pthread_mutex_unlock(&c->mu);
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

/* Sends kscore_write() for the appends of wave w. */
static int
send_wave(struct wconn *c, struct witem **it, size_t n, unsigned w)
{
    struct store *s = c->s;
    struct store__params p = {0};
    size_t na = 0, ne = 0, sent = 0;
    int rc;

    for (size_t i = 0; i < n; i++)
        if (it[i]->wave == w) {
            na++;
            ne += it[i]->wr->n;
        }
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    const Ks__Event **evs = kproto_arena_alloc(&s->scratch, ne * sizeof(*evs));
    bool *skip = kproto_arena_calloc(&s->scratch, ne, sizeof(*skip));
    if (!evs || !skip) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = store__arr_begin(&c->stream, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->expected, STORE__OID_INT8, na)) < 0 ||
        (rc = store__arr_begin(&c->agent, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&c->first, STORE__OID_INT4, na)) < 0 ||
        (rc = store__arr_begin(&c->count, STORE__OID_INT4, na)) < 0 ||
        (rc = store__arr_begin(&c->evitem, STORE__OID_INT4, ne)) < 0 ||
        (rc = store__arr_begin(&s->ids, STORE__OID_UUID, ne)) < 0 ||
        (rc = store__arr_begin(&s->types, STORE__OID_TEXT, ne)) < 0 ||
        (rc = store__arr_begin(&s->data, STORE__OID_BYTEA, ne)) < 0)
        goto out;
    na = 0;
    for (size_t i = 0; i < n; i++) {
        const struct store_write *wr = it[i]->wr;
        if (it[i]->wave != w)
            continue;
        na++;
        if ((rc = store__arr_put(&c->stream, wr->stream_id,
                                 strlen(wr->stream_id))) < 0 ||
            (rc = store__arr_put_i64(&c->expected, wr->expected_version)) <
                0 ||
            (rc = wr->claim_agent
                      ? store__arr_put(&c->agent, wr->claim_agent,
                                       strlen(wr->claim_agent))
                      : store__arr_put_null(&c->agent)) < 0 ||
            (rc = store__arr_put_i32(&c->first, (int32_t)sent + 1)) < 0 ||
            (rc = store__arr_put_i32(&c->count, (int32_t)wr->n)) < 0)
            goto out;
        for (size_t e = 0; e < wr->n; e++) {
            const Ks__Event *ev = wr->events[e].event;
            evs[sent++] = ev;
            if ((rc = store__arr_put_i32(&c->evitem, (int32_t)na)) < 0 ||
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
    store__p_bin(&p, c->first.p, c->first.len);
    store__p_bin(&p, c->count.p, c->count.len);
    store__p_bin(&p, s->ids.p, s->ids.len);
    store__p_bin(&p, s->types.p, s->types.len);
    store__p_bin(&p, s->data.p, s->data.len);
    store__p_bin(&p, c->evitem.p, c->evitem.len);
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        store__p_bin(&p, s->fold[i].p, s->fold[i].len);
    if (!PQsendQueryPrepared(s->conn, "ks_write", p.n, p.val, p.len, p.fmt,
                             0))
        rc = store__pg_error(s, NULL, NULL);
out:
    kproto_arena_release(&s->scratch, mark);
    return rc;
}

/* The verdict of kscore_write() for one append (row r of res). */
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

/*
 * Reads the group's results up to its sync: each wave's rows, in wave
 * order, are the verdicts of its appends in queue order. Returns 0 (every
 * append has its verdict) or the group's failure.
 */
static int
read_group(struct wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    unsigned wave = 1;
    int rc = 0, nulls = 0;

    /* Sent: a connection lost from here on may have lost a commit's
     * answer, until a result says the transaction failed. */
    s->in_doubt = true;
    for (;;) {
        PGresult *res = PQgetResult(s->conn);
        if (!res) {
            if (PQstatus(s->conn) == CONNECTION_BAD || ++nulls > 1) {
                int lost = store__pg_error(s, NULL, NULL);
                s->broken = true;
                if (rc == 0 || lost == KS_EPGDOWN)
                    rc = lost;
                return rc;
            }
            continue;
        }
        nulls = 0;
        switch (PQresultStatus(res)) {
        case PGRES_PIPELINE_SYNC:
            PQclear(res);
            s->in_doubt = false;
            return rc;
        case PGRES_TUPLES_OK:
            if (rc == 0) {
                int r = 0;
                for (size_t i = 0; i < n; i++)
                    if (it[i]->wave == wave && r < PQntuples(res))
                        take_verdict(it[i], res, r++);
                if (r != PQntuples(res))
                    rc = KS_EPG; /* cannot be: a verdict per append */
            }
            wave++;
            break;
        case PGRES_PIPELINE_ABORTED:
            break;
        default:
            if (rc == 0) {
                rc = store__pg_error(s, res, NULL);
                if (rc != KS_EPGDOWN)
                    s->in_doubt = false; /* the server said: rolled back */
            }
            break;
        }
        PQclear(res);
    }
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
group_once(struct wconn *c, struct witem **it, size_t n)
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
    /* Each caller's between() runs now, beside the database's work. */
    set_state(c, it, n, W_SENT);
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

/* A group, with its retries; every append has its code on return. */
static void
write_group(struct wconn *c, struct witem **it, size_t n)
{
    struct store *s = c->s;
    int rc = group_once(c, it, n);

    for (int t = 1; rc && retryable(s, rc) && t < WRITER_RETRIES; t++)
        rc = group_once(c, it, n);
    if (rc == 0)
        return;
    if (store_db_sick(rc) || rc == -ENOMEM) {
        for (size_t i = 0; i < n; i++)
            fail_item(s, it[i], rc);
        return;
    }
    /*
     * Not the database's health: something about one of the appends that
     * the statement's checks did not foresee (a unique violation: another
     * writer raced one past its checks). Each alone, then, so only its
     * own append fails; twice, since a race lost once is decided by the
     * checks the second time.
     */
    for (size_t i = 0; i < n; i++) {
        int r = group_once(c, &it[i], 1);
        for (int t = 1; r && !store_db_sick(r) && r != -ENOMEM && t < 2; t++)
            r = group_once(c, &it[i], 1);
        for (int t = 1; r && retryable(s, r) && t < WRITER_RETRIES; t++)
            r = group_once(c, &it[i], 1);
        if (r)
            fail_item(s, it[i], r);
    }
}

/* An append that holds a batch event: store_append() alone. */
static void
write_solo(struct wconn *c, struct witem *it)
{
    const struct store_write *wr = it->wr;
    struct store *s = c->s;

    set_state(c, &it, 1, W_SENT);
    it->res = no_result;
    it->rc = wr->claim_agent
                 ? store_append_claim(s, wr->stream_id, wr->expected_version,
                                      wr->claim_agent, wr->events,
                                      &it->res.version)
                 : store_append(s, wr->stream_id, wr->expected_version,
                                wr->events, wr->n, &it->res.version);
    if (it->rc && it->rc != KS_EDUPLICATE) {
        int64_t v = it->res.version;
        fail_item(s, it, it->rc);
        it->res.version = v;
    }
}

static void
flush(struct wconn *c, struct witem **it, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t j = i;
        if (it[i]->solo) {
            write_solo(c, it[i]);
            j = i + 1;
        } else {
            while (j < n && !it[j]->solo)
                j++;
            write_group(c, it + i, j - i);
        }
        set_state(c, it + i, j - i, W_DONE);
        i = j;
    }
}

static void *
wconn_main(void *arg)
{
    struct wconn *c = arg;

    for (;;) {
        size_t n = 0, bytes = 0;
        pthread_mutex_lock(&c->mu);
        while (!c->head && !c->stopping)
            pthread_cond_wait(&c->work, &c->mu);
        if (!c->head) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        /* Everything that queued meanwhile, within the caps. */
        while (c->head && n < STORE_WRITER_MAX_APPENDS &&
               (n == 0 || bytes + c->head->bytes <= WRITER_MAX_BYTES)) {
            struct witem *it = c->head;
            c->head = it->next;
            if (!c->head)
                c->tail = NULL;
            bytes += it->bytes;
            c->batch[n++] = it;
        }
        pthread_mutex_unlock(&c->mu);
        flush(c, c->batch, n);
    }
    return NULL;
}

/* ---- API ---- */

static void
wconn_release(struct wconn *c)
{
    if (c->started) {
        pthread_mutex_lock(&c->mu);
        c->stopping = true;
        pthread_cond_broadcast(&c->work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
        c->started = false;
    }
    if (c->s) {
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->work);
    }
    store_close(c->s);
    c->s = NULL;
    store__buf_release(&c->stream);
    store__buf_release(&c->expected);
    store__buf_release(&c->agent);
    store__buf_release(&c->first);
    store__buf_release(&c->count);
    store__buf_release(&c->evitem);
    free(c->batch);
    c->batch = NULL;
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
    for (unsigned i = 0; i < n_conns; i++) {
        struct wconn *c = &w->c[i];
        if ((rc = store_open(conninfo, &c->s, errmsg)) < 0)
            break;
        w->n = i + 1;
        pthread_mutex_init(&c->mu, NULL);
        pthread_cond_init(&c->work, NULL);
        c->stream.cap = c->agent.cap = KS_MAX_MESSAGE_BYTES;
        c->expected.cap = c->first.cap = c->count.cap = KS_MAX_MESSAGE_BYTES;
        c->evitem.cap = KS_MAX_MESSAGE_BYTES;
        if (!(c->batch = calloc(STORE_WRITER_MAX_APPENDS,
                                sizeof(*c->batch)))) {
            rc = -ENOMEM;
            break;
        }
        if (pthread_create(&c->thread, NULL, wconn_main, c) != 0) {
            rc = -EAGAIN;
            break;
        }
        c->started = true;
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
    for (unsigned i = 0; i < w->n; i++)
        wconn_release(&w->c[i]);
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
    struct wconn *c;
    bool between_done = false;
    int rc;

    BUG_ON(!w || !wr);
    if ((rc = check_write(wr, &it.solo, &it.bytes)) < 0) {
        if (res)
            *res = no_result;
        return rc;
    }
    c = &w->c[key_hash(wr->stream_id) % w->n];
    pthread_cond_init(&it.cond, NULL);
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        pthread_cond_destroy(&it.cond);
        if (res)
            *res = no_result;
        return KS_ESTOPPED;
    }
    ks_metric_inc(KS_C_WRITER_APPENDS);
    if (c->tail)
        c->tail->next = &it;
    else
        c->head = &it;
    c->tail = &it;
    pthread_cond_signal(&c->work);
    for (;;) {
        if (it.state == W_DONE)
            break;
        if (it.state == W_SENT && wr->between && !between_done) {
            pthread_mutex_unlock(&c->mu);
            wr->between(wr->ud);
            between_done = true;
            pthread_mutex_lock(&c->mu);
            continue;
        }
        pthread_cond_wait(&it.cond, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
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
