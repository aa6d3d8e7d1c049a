/*
 * The open-loop load of sustained, capacity and overload (perf/README.md):
 * ExecuteCommand of /bin/true at a fixed rate, round-robin on perf-0..9
 * (the `kscore agent` process).
 *
 * Open loop, as a fleet's many clients are: request i is published at
 * t0 + i/rate whatever became of the earlier ones, on one connection with
 * one wildcard reply subscription (no thread per request, so the client
 * never caps what is in flight and the broker sees the whole offered rate:
 * its queue, or its refusals, are what is measured). Latency counts from
 * the scheduled time. Each request behaves as `kscore exec` does
 * (client.c broker_execute_hooks): a key of its own, asked again with
 * key_may_exist after EXEC_REASK_MS of silence, a refusal of a later ask
 * ignored once the command's id came back.
 *
 * After the last request the round waits until every request has its
 * answer (at most LOAD_DRAIN_S), then checks the record: every command of
 * the round (by its idempotency key) must have exactly one terminal event;
 * those with none are `lost`. Meanwhile a probe asks for one command every
 * PROBE_EVERY_MS from the end of the load: `recovery_ms` is when the first
 * one came back succeeded (capacity is back).
 *
 * CPU per command (perf__cost_json, unit "command"): utime + stime
 * (/proc/PID/stat) of nats-server, of PostgreSQL (the postmaster, its live
 * backends and those it reaped), of the broker and of the agent process
 * over the round (load and drain), divided by the commands recorded; the
 * commands' own processes are not in it (a process's utime/stime excludes
 * its children), and are reported apart (`children_cpu_us_per_command`:
 * the agent's cutime + cstime).
 */
#include <errno.h>
#include <libpq-fe.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "perf_int.h"

/* As client.c: silence after which a waiting exec asks again. */
#define EXEC_REASK_US INT64_C(5000000)
/* The longest wait for the answers after the last request (s). */
#define LOAD_DRAIN_S 120
#define PROBE_EVERY_MS 100
/* capacity: what a rate must hold (issue 23). */
#define CAP_P99_US 100000
#define CAP_TRIAL_S 15
#define CAP_CONFIRM_S 60
#define CAP_MAX_TRIALS 12
/* Confirmations tried, each 15% below the last that did not hold. */
#define CAP_CONFIRM_TRIES 6

enum rq_state { RQ_UNSENT, RQ_SENT, RQ_ACCEPTED, RQ_DONE };

struct rq {
    int64_t due_us, done_us, asked_us, heard_us;
    int err;        /* 0: succeeded */
    uint8_t state;  /* enum rq_state */
    uint8_t asks;
    bool refused;   /* KS_EBUSY on its first ask: not recorded */
    bool by_agent;  /* ... because of its agent's slots (else kscore's
                       own queues) */
    bool accepted;  /* the broker named its command */
};

struct load {
    const struct perf_ctx *ctx;
    struct load_opts {
        double rate;
        int dur_s, win_s;
        uint64_t deliver_ms; /* 0: the broker's default */
    } o;
    struct evt_conn *c;
    struct evt_inbox *ib; /* request i's replies: "<its subject>.<i>" */
    char subject[192];
    char run[16]; /* idempotency keys: perf-<run>-<i> */
    struct rq *r;
    size_t n, ndone, oldest; /* oldest: no request before it is open */
    char first_error[256];
};

/* Ends request r. */
static void
rq_end(struct load *L, struct rq *r, int err, int64_t now)
{
    r->err = err;
    r->state = RQ_DONE;
    r->done_us = now;
    L->ndone++;
}

/* One answer to request <inbox>.<i> (takes m). */
static void
on_reply(struct load *L, natsMsg *m)
{
    const char *subj = natsMsg_GetSubject(m), *dot = strrchr(subj, '.');
    Ks__ExecuteReply *rep = NULL;
    int64_t now = ks_mono_us();
    char *end = NULL;
    size_t i = dot ? (size_t)strtoull(dot + 1, &end, 10) : L->n;
    int rc = 0;

    if (i >= L->n || !end || *end) {
        natsMsg_Destroy(m);
        return;
    }
    rc = evt_unpack_reply(&ks__execute_reply__descriptor, natsMsg_GetData(m),
                          (size_t)natsMsg_GetDataLength(m),
                          (ProtobufCMessage **)&rep);
    struct rq *r = &L->r[i];
    if (r->state == RQ_DONE) {
        /* answered already */
    } else if (rc) {
        rq_end(L, r, rc, now);
    } else if (rep->error_code) {
        if (r->state != RQ_ACCEPTED) {
            int e = rep->error_code;
            /* As client.c: a later ask refused while the first was never
             * answered may have recorded it (the first may still wait in
             * the broker's queue). */
            if (r->asks > 1 && (e == KS_EBUSY || e == KS_EPG ||
                                e == KS_EPGDOWN || e == KS_EPGREFUSED))
                e = KS_EINDOUBT;
            r->refused = e == KS_EBUSY;
            r->by_agent = r->refused && rep->error &&
                          strncmp(rep->error, "agent ", 6) == 0;
            if (!L->first_error[0] && !r->refused)
                snprintf(L->first_error, sizeof(L->first_error), "%s: %s",
                         ks_err_name(e), rep->error ? rep->error : "");
            rq_end(L, r, e, now);
        }
    } else if (rep->result) {
        r->accepted = true;
        rq_end(L, r,
               rep->result->status == KS__COMMAND_STATUS__SUCCEEDED
                   ? 0
                   : KS_EINTERNAL,
               now);
        if (r->err && !L->first_error[0])
            snprintf(L->first_error, sizeof(L->first_error),
                     "command ended %s: %s",
                     kproto_status_name(rep->result->status),
                     rep->result->reason ? rep->result->reason : "");
    } else {
        /* Recorded, still running: someone waits for it. */
        r->accepted = true;
        r->state = RQ_ACCEPTED;
        r->heard_us = now;
    }
    if (rep)
        ks__execute_reply__free_unpacked(rep, NULL);
    natsMsg_Destroy(m);
}

/* Publishes request i (again, with key_may_exist, when asked before). */
static int
ask(struct load *L, size_t i, bool again)
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1], id[32], key[48], suffix[24];
    uint8_t buf[512];
    size_t len;

    perf__true_spec(&spec, argv);
    snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%zu", i % PERF_AGENTS);
    snprintf(key, sizeof(key), "perf-%s-%zu", L->run, i);
    snprintf(suffix, sizeof(suffix), "%zu", i);
    req.spec = &spec;
    req.agent_id = id;
    req.idempotency_key = key;
    req.key_may_exist = again;
    req.deliver_within_ms = L->o.deliver_ms;
    len = protobuf_c_message_get_packed_size(&req.base);
    if (len > sizeof(buf))
        return KS_ETOOBIG;
    protobuf_c_message_pack(&req.base, buf);
    return evt_inbox_send(L->ib, L->subject, suffix, NULL, buf, len);
}

/* Asks again every request silent for EXEC_REASK_US (as the client). */
static void
reask(struct load *L, int64_t now)
{
    while (L->oldest < L->n && L->r[L->oldest].state == RQ_DONE)
        L->oldest++;
    for (size_t i = L->oldest; i < L->n; i++) {
        struct rq *r = &L->r[i];
        if (r->state == RQ_UNSENT)
            break;
        int64_t last = r->heard_us > r->asked_us ? r->heard_us : r->asked_us;
        if (r->state == RQ_DONE || now - last < EXEC_REASK_US)
            continue;
        r->asked_us = now;
        if (r->asks < 255)
            r->asks++;
        ask(L, i, true);
    }
}

/* Takes the answers that come until mono time until (one thread sends
 * and reads: the inbox's lease is the caller's alone). */
static void
pump(struct load *L, int64_t until)
{
    for (;;) {
        int64_t left = until - ks_mono_us();
        natsMsg *m = NULL;
        if (left <= 0)
            return;
        int rc = evt_inbox_next(L->ib, (int)((left + 999) / 1000), &m);
        if (rc == 0)
            on_reply(L, m);
        else if (rc != KS_EUNAVAIL) /* "no responders": asked again */
            return;
    }
}

static void
sleep_until_us(int64_t mono_us)
{
    struct timespec ts = {(time_t)(mono_us / 1000000),
                          (long)(mono_us % 1000000) * 1000};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* ---- the record -------------------------------------------------------- */

/* Commands of the run recorded, with no terminal event, and with another
 * count of them than one; -1 each when the record cannot be read. */
static void
record_check(const struct perf_stack *st, const char *run, long *recorded,
             long *lost, long *not_one)
{
    static const char term[] = "('CommandCompleted','CommandStartFailed',"
                               "'CommandUndeliverable','CommandLost',"
                               "'CommandCancelled','CommandNotStarted')";
    char sql[1024];
    PGconn *pg = PQconnectdb(st->conninfo);

    *recorded = *lost = *not_one = -1;
    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: %s", PQerrorMessage(pg));
        PQfinish(pg);
        return;
    }
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE idempotency_key LIKE "
             "'perf-%s-%%'",
             run);
    *recorded = perf__sql_long(pg, sql);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FILTER (WHERE n = 0), count(*) FILTER (WHERE "
             "n <> 1) FROM (SELECT (SELECT count(*) FROM events e WHERE "
             "e.stream_id = 'command-' || c.command_id AND e.type IN %s) n "
             "FROM commands c WHERE c.idempotency_key LIKE 'perf-%s-%%') x",
             term, run);
    PGresult *r = PQexec(pg, sql);
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1) {
        *lost = strtol(PQgetvalue(r, 0, 0), NULL, 10);
        *not_one = strtol(PQgetvalue(r, 0, 1), NULL, 10);
    }
    PQclear(r);
    PQfinish(pg);
}

/* ---- the probe: when capacity is back ---------------------------------- */

struct probe {
    const struct perf_stack *st;
    int64_t from_us;
    _Atomic int64_t back_us; /* 0 until a probe succeeded */
    atomic_bool stop;
};

static void *
probe_main(void *arg)
{
    struct probe *p = arg;
    struct evt_conn *c = NULL;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1], id[32];

    if (perf__connect(p->st, "kscore-perf-probe", &c))
        return NULL;
    perf__true_spec(&spec, argv);
    req.spec = &spec;
    req.agent_id = id;
    for (unsigned k = 0; !atomic_load(&p->stop) && !perf__interrupted; k++) {
        Ks__ExecuteReply *rep = NULL;
        snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%u", k % PERF_AGENTS);
        int64_t t = ks_mono_us();
        if (broker_execute(c, &req, 30000, &rep) == 0 && !rep->error_code &&
            rep->result &&
            rep->result->status == KS__COMMAND_STATUS__SUCCEEDED) {
            atomic_store(&p->back_us, ks_mono_us());
            ks__execute_reply__free_unpacked(rep, NULL);
            break;
        }
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        int64_t left = t + PROBE_EVERY_MS * 1000 - ks_mono_us();
        if (left > 0)
            perf__sleep_ms((int)(left / 1000));
    }
    evt_close(c);
    return NULL;
}

/* ---- one load ---------------------------------------------------------- */

struct window {
    int64_t start_us;
    struct perf_proc broker, agent;
};

static void
sample(const struct perf_stack *st, struct window *w)
{
    w->start_us = ks_mono_us();
    memset(&w->broker, 0, sizeof(w->broker));
    memset(&w->agent, 0, sizeof(w->agent));
    if (st->broker_pid > 0)
        perf__proc_sample(st->broker_pid, &w->broker);
    if (st->agent_pid > 0)
        perf__proc_sample(st->agent_pid, &w->agent);
}

static double
cpu_pct(const struct perf_proc *a, const struct perf_proc *b, int64_t wall)
{
    return wall > 0 ? 100.0 * (double)(b->cpu_us - a->cpu_us) / (double)wall
                    : 0;
}

/* Requests scheduled in [from, to): counts and the latencies of those
 * that succeeded. */
static json_t *
window_json(struct load *L, int64_t from, int64_t to, int64_t *scratch)
{
    json_t *o = json_object();
    size_t k = 0, errors = 0, refused = 0, by_agent = 0, sent = 0;
    for (size_t i = 0; i < L->n; i++) {
        const struct rq *r = &L->r[i];
        if (r->due_us < from || r->due_us >= to || r->state == RQ_UNSENT)
            continue;
        sent++;
        if (r->refused) {
            refused++;
            by_agent += r->by_agent;
        } else if (r->state != RQ_DONE || r->err)
            errors++;
        else
            scratch[k++] = r->done_us - r->due_us;
    }
    json_object_set_new(o, "sent", json_integer((json_int_t)sent));
    json_object_set_new(o, "refused", json_integer((json_int_t)refused));
    json_object_set_new(o, "refused_agent_busy",
                        json_integer((json_int_t)by_agent));
    json_object_set_new(o, "errors", json_integer((json_int_t)errors));
    if (k) {
        perf__sort(scratch, k);
        json_object_set_new(o, "p50_us",
                            json_integer(perf__pct(scratch, k, 50)));
        json_object_set_new(o, "p99_us",
                            json_integer(perf__pct(scratch, k, 99)));
        json_object_set_new(o, "max_us", json_integer(scratch[k - 1]));
    }
    return o;
}

static void
set_proc(json_t *o, const char *who, const struct window *first,
         const struct window *after_first, const struct window *last,
         int64_t wall, bool broker)
{
    const struct perf_proc *a = broker ? &first->broker : &first->agent;
    const struct perf_proc *m = broker ? &after_first->broker
                                       : &after_first->agent;
    const struct perf_proc *z = broker ? &last->broker : &last->agent;
    char key[64];
    snprintf(key, sizeof(key), "%s_cpu_pct", who);
    json_object_set_new(o, key, json_real(cpu_pct(a, z, wall)));
    snprintf(key, sizeof(key), "%s_rss_start_kb", who);
    json_object_set_new(o, key, json_integer(a->rss_kb));
    snprintf(key, sizeof(key), "%s_rss_end_kb", who);
    json_object_set_new(o, key, json_integer(z->rss_kb));
    /* Drift after the first window: start-up growth is not a leak. */
    snprintf(key, sizeof(key), "%s_rss_drift_kb", who);
    json_object_set_new(o, key, json_integer(z->rss_kb - m->rss_kb));
}

/* Every agent answers before the clock starts. */
static void
warm_up(struct evt_conn *c)
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1], id[32];
    perf__true_spec(&spec, argv);
    req.spec = &spec;
    req.agent_id = id;
    for (int i = 0; i < PERF_AGENTS; i++) {
        Ks__ExecuteReply *rep = NULL;
        snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%d", i);
        if (broker_execute(c, &req, 30000, &rep) == 0)
            ks__execute_reply__free_unpacked(rep, NULL);
    }
}

/*
 * One open-loop load of lo->rate commands/s for lo->dur_s seconds. On 0,
 * *out holds its figures (perf/README.md "sustained").
 */
static int
load_run(const struct perf_ctx *ctx, const struct load_opts *lo,
         json_t **out)
{
    struct load L = {.ctx = ctx, .o = *lo};
    struct window *w = NULL;
    struct perf_cost cpu0, cpu1;
    struct probe pr = {.st = ctx->st};
    pthread_t probe_th;
    bool probing = false;
    int64_t *scratch = NULL, t0, interval_us, load_end;
    int nwin, rc;
    json_t *o, *wins;

    if (L.o.win_s > L.o.dur_s)
        L.o.win_s = L.o.dur_s;
    nwin = (L.o.dur_s + L.o.win_s - 1) / L.o.win_s;
    L.n = (size_t)(L.o.rate * L.o.dur_s + 0.5);
    if (L.n == 0)
        return KS_EINVAL;
    interval_us = (int64_t)(1e6 / L.o.rate);
    L.r = calloc(L.n, sizeof(*L.r));
    scratch = calloc(L.n, sizeof(*scratch));
    w = calloc((size_t)nwin + 1, sizeof(*w));
    if (!L.r || !scratch || !w) {
        rc = -ENOMEM;
        goto out;
    }
    {
        char u[37];
        ks_uuid(u);
        snprintf(L.run, sizeof(L.run), "%.8s", u);
    }
    if ((rc = perf__connect(ctx->st, "kscore-perf-load", &L.c)))
        goto out;
    warm_up(L.c);
    snprintf(L.subject, sizeof(L.subject), "%s.%s", EVT_API_EXECUTE,
             L.c->identity);
    if ((rc = evt_inbox_take(L.c, NULL, &L.ib)))
        goto out;

    t0 = ks_mono_us() + 1000;
    for (size_t i = 0; i < L.n; i++)
        L.r[i].due_us = t0 + (int64_t)i * interval_us;
    perf__cost_sample(ctx->st, &cpu0);
    sample(ctx->st, &w[0]);
    int next_win = 1;
    int64_t next_scan = t0 + 100000;
    for (size_t i = 0; i < L.n && !perf__interrupted; i++) {
        int64_t now = ks_mono_us();
        if (next_win <= nwin &&
            now >= t0 + (int64_t)next_win * L.o.win_s * 1000000) {
            sample(ctx->st, &w[next_win]);
            next_win++;
        }
        if (now >= next_scan) {
            reask(&L, now);
            next_scan = now + 100000;
        }
        pump(&L, L.r[i].due_us);
        sleep_until_us(L.r[i].due_us);
        L.r[i].state = RQ_SENT;
        L.r[i].asks = 1;
        L.r[i].asked_us = ks_mono_us();
        if ((rc = ask(&L, i, false)))
            rq_end(&L, &L.r[i], rc, ks_mono_us());
    }
    load_end = ks_mono_us();
    pr.from_us = load_end;
    probing = pthread_create(&probe_th, NULL, probe_main, &pr) == 0;
    while (next_win <= nwin && !perf__interrupted) {
        int64_t at = t0 + (int64_t)next_win * L.o.win_s * 1000000;
        pump(&L, at);
        sleep_until_us(at);
        sample(ctx->st, &w[next_win]);
        next_win++;
    }
    /* The answers, each request asked again as a client would. */
    while (L.ndone < L.n && !perf__interrupted &&
           ks_mono_us() - load_end <= (int64_t)LOAD_DRAIN_S * 1000000) {
        reask(&L, ks_mono_us());
        pump(&L, ks_mono_us() + 100000);
    }
    int64_t drained = ks_mono_us();
    perf__cost_sample(ctx->st, &cpu1);
    /* Give the probe its chance when the drain was instant. */
    while (probing && !atomic_load(&pr.back_us) && !perf__interrupted &&
           ks_mono_us() - load_end < 10 * INT64_C(1000000))
        perf__sleep_ms(20);
    atomic_store(&pr.stop, true);
    if (probing)
        pthread_join(probe_th, NULL);
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }

    /* No answer by now: counted as errors (no reply). */
    size_t refused = 0, by_agent = 0, errors = 0, accepted = 0, k = 0,
           no_reply = 0,
           indoubt = 0;
    int64_t *ref = calloc(L.n, sizeof(*ref));
    size_t nref = 0;
    for (size_t i = 0; i < L.n; i++) {
        const struct rq *r = &L.r[i];
        if (r->accepted)
            accepted++;
        if (r->refused) {
            refused++;
            by_agent += r->by_agent;
            if (ref)
                ref[nref++] = r->done_us - r->due_us;
        } else if (r->state != RQ_DONE) {
            errors++;
            no_reply++;
        } else if (r->err) {
            errors++;
            indoubt += r->err == KS_EINDOUBT;
        } else {
            scratch[k++] = r->done_us - r->due_us;
        }
    }
    long recorded, lost, not_one;
    record_check(ctx->st, L.run, &recorded, &lost, &not_one);

    o = json_object();
    if (k)
        perf__lat_json(o, scratch, k);
    if (nref) {
        perf__sort(ref, nref);
        json_object_set_new(o, "refused_p99_us",
                            json_integer(perf__pct(ref, nref, 99)));
    }
    free(ref);
    wins = json_array();
    double worst_p99 = 0;
    for (int i = 0; i < nwin; i++) {
        int64_t from = t0 + (int64_t)i * L.o.win_s * 1000000;
        json_t *wj = window_json(&L, from,
                                 from + (int64_t)L.o.win_s * 1000000, scratch);
        int64_t wall = w[i + 1].start_us - w[i].start_us;
        json_object_set_new(wj, "t_end_s", json_integer((i + 1) * L.o.win_s));
        json_object_set_new(
            wj, "broker_cpu_pct",
            json_real(cpu_pct(&w[i].broker, &w[i + 1].broker, wall)));
        json_object_set_new(
            wj, "agent_cpu_pct",
            json_real(cpu_pct(&w[i].agent, &w[i + 1].agent, wall)));
        json_object_set_new(wj, "broker_rss_kb",
                            json_integer(w[i + 1].broker.rss_kb));
        json_object_set_new(wj, "agent_rss_kb",
                            json_integer(w[i + 1].agent.rss_kb));
        json_t *p99 = json_object_get(wj, "p99_us");
        if (p99 && json_number_value(p99) > worst_p99)
            worst_p99 = json_number_value(p99);
        json_array_append_new(wins, wj);
    }
    int64_t wall = w[nwin].start_us - w[0].start_us;
    json_object_set_new(o, "rate_per_s", json_real(L.o.rate));
    json_object_set_new(o, "duration_s", json_integer(L.o.dur_s));
    json_object_set_new(o, "sent", json_integer((json_int_t)L.n));
    json_object_set_new(o, "succeeded", json_integer((json_int_t)k));
    json_object_set_new(o, "accepted", json_integer((json_int_t)accepted));
    json_object_set_new(o, "refused", json_integer((json_int_t)refused));
    json_object_set_new(o, "refused_agent_busy",
                        json_integer((json_int_t)by_agent));
    json_object_set_new(o, "errors", json_integer((json_int_t)errors));
    json_object_set_new(o, "no_reply", json_integer((json_int_t)no_reply));
    json_object_set_new(o, "in_doubt", json_integer((json_int_t)indoubt));
    json_object_set_new(o, "recorded", json_integer(recorded));
    json_object_set_new(o, "lost", json_integer(lost));
    json_object_set_new(o, "not_exactly_one_terminal", json_integer(not_one));
    json_object_set_new(o, "drain_s",
                        json_real((double)(drained - load_end) / 1e6));
    int64_t back = atomic_load(&pr.back_us);
    if (back)
        json_object_set_new(
            o, "recovery_ms", json_real((double)(back - pr.from_us) / 1000.0));
    else
        json_object_set_new(o, "recovery_ms", json_null());
    if (L.first_error[0])
        json_object_set_new(o, "first_error", json_string(L.first_error));
    json_object_set_new(o, "worst_window_p99_us", json_real(worst_p99));
    /* Per command recorded: what ran of the load. */
    perf__cost_json(o, &cpu0, &cpu1, (double)recorded, "command");
    set_proc(o, "broker", &w[0], &w[nwin > 1 ? 1 : 0], &w[nwin], wall, true);
    set_proc(o, "agent", &w[0], &w[nwin > 1 ? 1 : 0], &w[nwin], wall, false);
    json_object_set_new(o, "windows", wins);
    *out = o;
    rc = 0;
out:
    evt_inbox_give(L.ib);
    evt_close(L.c);
    free(L.r);
    free(scratch);
    free(w);
    return rc;
}

/* ---- the scenarios ----------------------------------------------------- */

int
perf__sustained_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const struct perf_opts *op = ctx->o;
    struct load_opts lo = {
        .rate = op->rate > 0 ? op->rate : (op->quick ? 20 : 1000),
        .dur_s = op->duration_s > 0 ? op->duration_s : (op->quick ? 3 : 60),
        .win_s = op->window_s > 0 ? op->window_s : (op->quick ? 1 : 10),
        .deliver_ms = op->deliver_ms,
    };
    (void)round;
    return load_run(ctx, &lo, out);
}

/* A rate holds: p99 <= 100 ms, no error, no refusal, nothing lost. */
static bool
held(json_t *o)
{
    json_t *p99 = json_object_get(o, "p99_us");
    return p99 && json_number_value(p99) <= CAP_P99_US &&
           json_integer_value(json_object_get(o, "errors")) == 0 &&
           json_integer_value(json_object_get(o, "refused")) == 0 &&
           json_integer_value(json_object_get(o, "lost")) == 0;
}

static int
trial(struct perf_ctx *ctx, double rate, int dur_s, json_t *trials,
      json_t **out)
{
    struct load_opts lo = {.rate = rate, .dur_s = dur_s, .win_s = dur_s,
                           .deliver_ms = ctx->o->deliver_ms};
    json_t *o = NULL;
    int rc = load_run(ctx, &lo, &o);
    if (rc)
        return rc;
    bool ok = held(o);
    json_t *p99 = json_object_get(o, "p99_us");
    fprintf(stderr, "    %.0f/s for %d s: p99 %.1f ms, %lld errors, %lld "
                    "refused, %lld lost: %s\n",
            rate, dur_s, p99 ? json_number_value(p99) / 1000.0 : NAN,
            (long long)json_integer_value(json_object_get(o, "errors")),
            (long long)json_integer_value(json_object_get(o, "refused")),
            (long long)json_integer_value(json_object_get(o, "lost")),
            ok ? "held" : "not held");
    json_array_append_new(
        trials, json_pack("{s:f,s:i,s:O,s:O,s:O,s:O,s:b}", "rate", rate,
                          "duration_s", dur_s, "p99_us",
                          p99 ? p99 : json_null(), "errors",
                          json_object_get(o, "errors"), "refused",
                          json_object_get(o, "refused"), "lost",
                          json_object_get(o, "lost"), "held", ok));
    /* Between trials the stack settles: the next starts from idle. */
    perf__sleep_ms(2000);
    *out = o;
    return 0;
}

/*
 * capacity: the highest rate that holds (p99 <= 100 ms, 0 errors, none
 * refused or lost) for CAP_CONFIRM_S. Search trials of CAP_TRIAL_S: double
 * from the start rate while it holds (halve while it does not), then
 * bisect (geometric mean) until the bounds are within 15%; then the best
 * rate is confirmed over CAP_CONFIRM_S, 15% lower each time it does not
 * hold (at most CAP_CONFIRM_TRIES times; 0 when none held).
 */
int
perf__capacity_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const struct perf_opts *op = ctx->o;
    int trial_s = op->quick ? 2 : CAP_TRIAL_S;
    int confirm_s = op->duration_s > 0 ? op->duration_s
                                       : (op->quick ? 3 : CAP_CONFIRM_S);
    double r = op->rate > 0 ? op->rate : (op->quick ? 10 : 50);
    double lo = 0, hi = 0;
    json_t *trials = json_array(), *o = NULL, *best = NULL;
    int n = 0, rc = 0;

    (void)round;
    while (n < CAP_MAX_TRIALS && !perf__interrupted) {
        if ((rc = trial(ctx, r, trial_s, trials, &o)))
            goto out;
        n++;
        bool ok = held(o);
        json_decref(o);
        o = NULL;
        if (ok)
            lo = r;
        else
            hi = r;
        if (hi == 0)
            r = r * 2;
        else if (lo == 0)
            r = r / 2;
        else if (hi / lo > 1.15)
            r = sqrt(lo * hi);
        else
            break;
        if (r < 1 || r > 20000 || (op->quick && n >= 3))
            break;
    }
    /* Confirm over the full length. */
    for (int k = 0; lo >= 1 && k < CAP_CONFIRM_TRIES && !perf__interrupted;
         k++) {
        if ((rc = trial(ctx, lo, confirm_s, trials, &o)))
            goto out;
        if (held(o)) {
            best = o;
            o = NULL;
            break;
        }
        json_decref(o);
        o = NULL;
        lo *= 0.85;
    }
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }
    *out = json_object();
    json_object_set_new(*out, "capacity_per_s", json_real(best ? lo : 0));
    json_object_set_new(*out, "confirm_s", json_integer(confirm_s));
    json_object_set_new(*out, "trials_run",
                        json_integer((json_int_t)json_array_size(trials)));
    if (best) {
        static const char *const keep[] = {
            "p50_us",
            "p99_us",
            "cpu_per_command_us",
            "nats_cpu_us_per_command",
            "pg_cpu_us_per_command",
            "broker_cpu_us_per_command",
            "agent_cpu_us_per_command",
            "children_cpu_us_per_command",
            "pg_write_xacts_per_command"};
        for (size_t i = 0; i < sizeof(keep) / sizeof(keep[0]); i++) {
            json_t *v = json_object_get(best, keep[i]);
            if (v && json_is_number(v))
                json_object_set(*out, keep[i], v);
        }
    }
    json_object_set(*out, "trials", trials);
out:
    json_decref(best);
    json_decref(o);
    json_decref(trials);
    return rc;
}

/*
 * overload: twice the capacity this run measured (or --rate) for 30 s
 * (--duration): what is accepted must still run soon (p99 of the accepted
 * ones), the rest is refused at once, nothing accepted is lost, and
 * capacity is back soon after (recovery_ms).
 */
int
perf__overload_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const struct perf_opts *op = ctx->o;
    double cap = ctx->capacity_per_s;
    struct load_opts lo = {
        .rate = cap > 0 ? 2 * cap : op->rate,
        .dur_s = op->duration_s > 0 ? op->duration_s : (op->quick ? 3 : 30),
        .win_s = op->window_s > 0 ? op->window_s : (op->quick ? 1 : 5),
        .deliver_ms = op->deliver_ms,
    };
    (void)round;
    if (!(lo.rate > 0)) {
        *out = json_pack("{s:s}", "skipped",
                         "no capacity measured in this run and no --rate");
        return PERF_SKIPPED;
    }
    int rc = load_run(ctx, &lo, out);
    if (rc == 0)
        json_object_set_new(*out, "capacity_per_s", json_real(cap));
    return rc;
}
