/*
 * command_latency: sequential ExecuteCommand of /bin/true through the
 * broker and the `kscore agent` process (agent perf-0).
 *
 * sustained: ExecuteCommand at a fixed rate across perf-0..9, open loop:
 * a pacer releases request i at t0 + i/rate and one of SUS_WORKERS client
 * threads sends it (broker_execute on one shared connection). Latency is
 * measured from the scheduled time, so a request that waited for a free
 * worker is counted in full (no coordinated omission). Per window of
 * scheduled time: p50/p99 and errors; the broker's and the agent
 * process's CPU (/proc/PID/stat utime+stime) and RSS (VmRSS).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "perf_int.h"

static void
true_spec(Ks__CommandSpec *spec, char **argv)
{
    ks__command_spec__init(spec);
    argv[0] = "/bin/true";
    spec->argv = argv;
    spec->n_argv = 1;
    spec->timeout_ms = 10000;
}

/* 0 if the reply says /bin/true ran and exited 0. */
static int
reply_ok(const Ks__ExecuteReply *r)
{
    if (r->error_code)
        return r->error_code < 0 ? r->error_code : KS_EINTERNAL;
    if (!r->result || r->result->status != KS__COMMAND_STATUS__SUCCEEDED)
        return KS_EINTERNAL;
    return 0;
}

int
perf__latency_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int warm = ctx->o->quick ? 2 : 10, n = ctx->o->quick ? 10 : 100;
    int64_t *lat = calloc((size_t)n, sizeof(*lat));
    struct evt_conn *c = NULL;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1];
    int rc, errors = 0, first_err = 0;
    json_t *o;

    (void)round;
    if (!lat)
        return -ENOMEM;
    if ((rc = perf__connect(ctx->st, "kscore-perf-latency", &c)))
        goto out;
    true_spec(&spec, argv);
    req.spec = &spec;
    req.agent_id = PERF_AGENT_PREFIX "0";
    struct perf_cost k0 = {-1, -1, -1, -1}, k1 = k0;
    for (int i = -warm; i < n && !perf__interrupted; i++) {
        if (i == 0)
            perf__cost_sample(ctx->st, &k0);
        Ks__ExecuteReply *rep = NULL;
        int64_t t0 = ks_mono_us();
        rc = broker_execute(c, &req, 30000, &rep);
        int64_t dt = ks_mono_us() - t0;
        if (rc == 0)
            rc = reply_ok(rep);
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        if (rc) {
            if (!first_err)
                first_err = rc;
            errors++;
        }
        if (i >= 0)
            lat[i] = dt;
    }
    perf__cost_sample(ctx->st, &k1);
    rc = 0;
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }
    if (errors > n / 2) {
        fprintf(stderr, "kscore perf: command_latency: %d of %d failed (%s)\n",
                errors, n + warm, ks_strerror(first_err));
        rc = first_err ? first_err : KS_EINTERNAL;
        goto out;
    }
    o = json_object();
    perf__lat_json(o, lat, (size_t)n);
    int64_t p50 = json_integer_value(json_object_get(o, "p50_us"));
    int64_t p99 = json_integer_value(json_object_get(o, "p99_us"));
    if (ctx->floor_sum_us > 0)
        json_object_set_new(o, "ratio_to_floor",
                            json_real((double)p50 / ctx->floor_sum_us));
    json_object_set_new(o, "p99_over_p50",
                        json_real(p50 ? (double)p99 / (double)p50 : 0));
    json_object_set_new(o, "calls", json_integer(n));
    json_object_set_new(o, "errors", json_integer(errors));
    perf__cost_json(o, &k0, &k1, n, "command");
    *out = o;
out:
    evt_close(c);
    free(lat);
    return rc;
}

/* ---- sustained ---------------------------------------------------------- */

/* Client threads: enough for rate x the worst latency we expect, so the
 * client is never what holds the rate back: 1,000/s at the 100 ms p99 of
 * the target is 100 in flight. */
#define SUS_WORKERS 128

struct sus {
    size_t n;
    int64_t *due_us;  /* monotonic scheduled time */
    int64_t *got_us;  /* monotonic reply time, 0: none */
    int *err;         /* 0: succeeded */
    struct evt_conn *c;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    size_t released;  /* requests the pacer has released */
    size_t next;      /* next request a worker takes */
    bool done;
};

static void *
sus_worker(void *arg)
{
    struct sus *s = arg;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1], id[32];

    true_spec(&spec, argv);
    req.spec = &spec;
    req.agent_id = id;
    for (;;) {
        size_t i;
        pthread_mutex_lock(&s->mu);
        while (s->next >= s->released && !s->done)
            pthread_cond_wait(&s->cond, &s->mu);
        if (s->next >= s->released) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        i = s->next++;
        pthread_mutex_unlock(&s->mu);

        Ks__ExecuteReply *rep = NULL;
        snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%zu", i % PERF_AGENTS);
        int rc = broker_execute(s->c, &req, 30000, &rep);
        int64_t now = ks_mono_us();
        if (rc == 0)
            rc = reply_ok(rep);
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        s->err[i] = rc;
        s->got_us[i] = now; /* each slot has one writer; joined before read */
    }
    return NULL;
}

static void
sleep_until_us(int64_t mono_us)
{
    struct timespec ts = {(time_t)(mono_us / 1000000),
                          (long)(mono_us % 1000000) * 1000};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

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

/* Requests scheduled in [from, to): counts and latencies. */
static json_t *
window_json(struct sus *s, int64_t from, int64_t to, int64_t *scratch)
{
    json_t *o = json_object();
    size_t k = 0, errors = 0, sent = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->due_us[i] < from || s->due_us[i] >= to)
            continue;
        sent++;
        if (!s->got_us[i] || s->err[i])
            errors++;
        else
            scratch[k++] = s->got_us[i] - s->due_us[i];
    }
    json_object_set_new(o, "sent", json_integer((json_int_t)sent));
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

int
perf__sustained_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const struct perf_opts *op = ctx->o;
    double rate = op->rate > 0 ? op->rate : 1000; /* issue 15's target */
    int dur_s = op->duration_s > 0 ? op->duration_s : 60;
    int win_s = op->window_s > 0 ? op->window_s : 10;
    pthread_t th[SUS_WORKERS];
    int nth = 0, nwin, rc, first_err = 0;
    struct sus s = {0};
    struct window *w = NULL;
    int64_t *scratch = NULL, t0, interval_us;
    json_t *o, *wins;
    size_t errors = 0, k = 0;

    (void)round;
    if (op->quick) {
        rate = op->rate > 0 ? op->rate : 20;
        dur_s = op->duration_s > 0 ? op->duration_s : 3;
        win_s = op->window_s > 0 ? op->window_s : 1;
    }
    if (win_s > dur_s)
        win_s = dur_s;
    nwin = (dur_s + win_s - 1) / win_s;
    s.n = (size_t)(rate * dur_s + 0.5);
    if (s.n == 0)
        return KS_EINVAL;
    interval_us = (int64_t)(1e6 / rate);
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cond, NULL);
    s.due_us = calloc(s.n, sizeof(*s.due_us));
    s.got_us = calloc(s.n, sizeof(*s.got_us));
    s.err = calloc(s.n, sizeof(*s.err));
    scratch = calloc(s.n, sizeof(*scratch));
    w = calloc((size_t)nwin + 1, sizeof(*w));
    if (!s.due_us || !s.got_us || !s.err || !scratch || !w) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = perf__connect(ctx->st, "kscore-perf-sustained", &s.c)))
        goto out;
    /* Every agent warm before the clock starts. */
    {
        Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
        Ks__CommandSpec spec;
        char *argv[1], id[32];
        true_spec(&spec, argv);
        req.spec = &spec;
        req.agent_id = id;
        for (int i = 0; i < PERF_AGENTS; i++) {
            Ks__ExecuteReply *rep = NULL;
            snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%d", i);
            if (broker_execute(s.c, &req, 30000, &rep) == 0)
                ks__execute_reply__free_unpacked(rep, NULL);
        }
    }
    for (; nth < SUS_WORKERS; nth++)
        if (pthread_create(&th[nth], NULL, sus_worker, &s) != 0)
            break;

    struct perf_cost k0, k1;
    perf__cost_sample(ctx->st, &k0);
    t0 = ks_mono_us() + 1000;
    for (size_t i = 0; i < s.n; i++)
        s.due_us[i] = t0 + (int64_t)i * interval_us;
    sample(ctx->st, &w[0]);
    int next_win = 1;
    for (size_t i = 0; i < s.n && !perf__interrupted; i++) {
        if (next_win <= nwin &&
            ks_mono_us() >= t0 + (int64_t)next_win * win_s * 1000000) {
            sample(ctx->st, &w[next_win]);
            next_win++;
        }
        sleep_until_us(s.due_us[i]);
        pthread_mutex_lock(&s.mu);
        s.released = i + 1;
        pthread_cond_signal(&s.cond);
        pthread_mutex_unlock(&s.mu);
    }
    while (next_win <= nwin && !perf__interrupted) {
        sleep_until_us(t0 + (int64_t)next_win * win_s * 1000000);
        sample(ctx->st, &w[next_win]);
        next_win++;
    }
    pthread_mutex_lock(&s.mu);
    s.done = true;
    pthread_cond_broadcast(&s.cond);
    pthread_mutex_unlock(&s.mu);
    for (int i = 0; i < nth; i++)
        pthread_join(th[i], NULL);
    nth = 0;
    perf__cost_sample(ctx->st, &k1);
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }

    o = json_object();
    for (size_t i = 0; i < s.n; i++) {
        int e = s.got_us[i] ? s.err[i] : KS_ETIMEDOUT;
        if (e) {
            errors++;
            if (!first_err)
                first_err = e;
        } else {
            scratch[k++] = s.got_us[i] - s.due_us[i];
        }
    }
    if (k)
        perf__lat_json(o, scratch, k);
    wins = json_array();
    double worst_p99 = 0;
    for (int i = 0; i < nwin; i++) {
        int64_t from = t0 + (int64_t)i * win_s * 1000000;
        json_t *wj = window_json(&s, from, from + (int64_t)win_s * 1000000,
                                 scratch);
        int64_t wall = w[i + 1].start_us - w[i].start_us;
        json_object_set_new(wj, "t_end_s", json_integer((i + 1) * win_s));
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
    json_object_set_new(o, "rate_per_s", json_real(rate));
    json_object_set_new(o, "duration_s", json_integer(dur_s));
    json_object_set_new(o, "sent", json_integer((json_int_t)s.n));
    json_object_set_new(o, "errors", json_integer((json_int_t)errors));
    if (first_err)
        json_object_set_new(o, "first_error",
                            json_string(ks_err_name(first_err)));
    json_object_set_new(o, "worst_window_p99_us", json_real(worst_p99));
    /* From the first request to the last reply: every command's cost. */
    perf__cost_json(o, &k0, &k1, (double)s.n, "command");
    set_proc(o, "broker", &w[0], &w[nwin > 1 ? 1 : 0], &w[nwin], wall, true);
    set_proc(o, "agent", &w[0], &w[nwin > 1 ? 1 : 0], &w[nwin], wall, false);
    json_object_set_new(o, "windows", wins);
    *out = o;
    rc = 0;
out:
    if (nth) {
        pthread_mutex_lock(&s.mu);
        s.done = true;
        s.released = s.next; /* nothing more to send */
        pthread_cond_broadcast(&s.cond);
        pthread_mutex_unlock(&s.mu);
        for (int i = 0; i < nth; i++)
            pthread_join(th[i], NULL);
    }
    evt_close(s.c);
    pthread_mutex_destroy(&s.mu);
    pthread_cond_destroy(&s.cond);
    free(s.due_us);
    free(s.got_us);
    free(s.err);
    free(scratch);
    free(w);
    return rc;
}
