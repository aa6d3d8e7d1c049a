/*
 * command_latency: sequential ExecuteCommand of /bin/true through the
 * broker and the `kscore agent` process (agent perf-0).
 *
 * sustained: ExecuteCommand at a fixed rate across perf-0..9, open loop:
 * each request is sent at its scheduled time whatever the earlier ones
 * are doing (core NATS publish with its own reply subject under one
 * wildcard inbox subscription), so a slow reply never lowers the offered
 * rate and is counted in full (no coordinated omission). Per window of
 * send time: p50/p99 of the replies and errors; the broker's and the
 * agent process's CPU (/proc/PID/stat utime+stime) and RSS (VmRSS).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
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
    for (int i = -warm; i < n && !perf__interrupted; i++) {
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
    *out = o;
out:
    evt_close(c);
    free(lat);
    return rc;
}

/* ---- sustained ---------------------------------------------------------- */

struct sus {
    size_t n;
    int64_t *sent_us;        /* monotonic send time, 0: not sent */
    _Atomic int64_t *got_us; /* monotonic reply time, 0: none yet */
    _Atomic int *err;        /* reply error code (0: succeeded) */
    atomic_size_t replied;
    size_t prefix_len;       /* of the reply subjects "<inbox>.<seq>" */
};

static void
on_reply(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct sus *s = ud;
    const char *subj = natsMsg_GetSubject(msg);
    ProtobufCMessage *m = NULL;
    int64_t now = ks_mono_us();
    char *end = NULL;
    size_t seq;
    int rc;

    (void)nc;
    (void)sub;
    if (strlen(subj) <= s->prefix_len)
        goto out;
    seq = strtoul(subj + s->prefix_len, &end, 10);
    if (*end || seq >= s->n || atomic_load(&s->got_us[seq]))
        goto out;
    rc = evt_unpack(&ks__execute_reply__descriptor, natsMsg_GetData(msg),
                    (size_t)natsMsg_GetDataLength(msg), &m);
    if (rc == 0)
        rc = reply_ok((Ks__ExecuteReply *)m);
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    atomic_store(&s->err[seq], rc ? rc : 0);
    atomic_store(&s->got_us[seq], now);
    atomic_fetch_add(&s->replied, 1);
out:
    natsMsg_Destroy(msg);
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

/* Latencies of requests sent in [from, to): window stats into w. */
static json_t *
window_json(struct sus *s, int64_t from, int64_t to, int64_t *scratch)
{
    json_t *o = json_object();
    size_t k = 0, errors = 0, sent = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (!s->sent_us[i] || s->sent_us[i] < from || s->sent_us[i] >= to)
            continue;
        sent++;
        int64_t got = atomic_load(&s->got_us[i]);
        if (!got || atomic_load(&s->err[i]))
            errors++;
        else
            scratch[k++] = got - s->sent_us[i];
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

int
perf__sustained_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const struct perf_opts *op = ctx->o;
    double rate = op->rate > 0 ? op->rate : 200;
    int dur_s = op->duration_s > 0 ? op->duration_s : 60;
    int win_s = op->window_s > 0 ? op->window_s : 10;
    struct evt_conn *c = NULL;
    natsSubscription *sub = NULL;
    struct sus s = {0};
    struct window *w = NULL;
    int nwin, rc;
    char inbox_prefix[128], reply[160], *argv[1];
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    int64_t *scratch = NULL, t0, interval_us;
    json_t *o = NULL, *wins;
    natsInbox *inbox = NULL;

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
    s.sent_us = calloc(s.n, sizeof(*s.sent_us));
    s.got_us = calloc(s.n, sizeof(*s.got_us));
    s.err = calloc(s.n, sizeof(*s.err));
    scratch = calloc(s.n, sizeof(*scratch));
    w = calloc((size_t)nwin + 1, sizeof(*w));
    if (!s.sent_us || !s.got_us || !s.err || !scratch || !w) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = perf__connect(ctx->st, "kscore-perf-sustained", &c)))
        goto out;
    /* A few sequential calls first: every agent warm. */
    true_spec(&spec, argv);
    req.spec = &spec;
    for (int i = 0; i < PERF_AGENTS; i++) {
        char id[32];
        Ks__ExecuteReply *rep = NULL;
        snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%d", i);
        req.agent_id = id;
        if (broker_execute(c, &req, 30000, &rep) == 0)
            ks__execute_reply__free_unpacked(rep, NULL);
    }
    if ((rc = evt_err(natsInbox_Create(&inbox))))
        goto out;
    snprintf(inbox_prefix, sizeof(inbox_prefix), "%s.", (char *)inbox);
    s.prefix_len = strlen(inbox_prefix);
    snprintf(reply, sizeof(reply), "%s*", inbox_prefix);
    if ((rc = evt_err(natsConnection_Subscribe(&sub, c->nc, reply, on_reply,
                                               &s))))
        goto out;
    natsSubscription_SetPendingLimits(sub, -1, -1);
    natsConnection_Flush(c->nc);

    t0 = ks_mono_us();
    sample(ctx->st, &w[0]);
    int next_win = 1;
    for (size_t i = 0; i < s.n && !perf__interrupted; i++) {
        char id[32];
        uint8_t buf[512];
        size_t len;
        int64_t due = t0 + (int64_t)i * interval_us;
        if (next_win <= nwin &&
            ks_mono_us() >= t0 + (int64_t)next_win * win_s * 1000000) {
            sample(ctx->st, &w[next_win]);
            next_win++;
        }
        sleep_until_us(due);
        snprintf(id, sizeof(id), PERF_AGENT_PREFIX "%zu", i % PERF_AGENTS);
        snprintf(reply, sizeof(reply), "%s%zu", inbox_prefix, i);
        req.agent_id = id;
        len = protobuf_c_message_pack(&req.base, buf);
        s.sent_us[i] = ks_mono_us();
        rc = evt_err(natsConnection_PublishRequest(c->nc, EVT_API_EXECUTE,
                                                   reply, buf, (int)len));
        if (rc) {
            atomic_store(&s.err[i], rc);
            atomic_store(&s.got_us[i], s.sent_us[i]);
            atomic_fetch_add(&s.replied, 1);
        }
    }
    /* The last window ends when its last request is sent. */
    while (next_win <= nwin && !perf__interrupted) {
        int64_t end = t0 + (int64_t)next_win * win_s * 1000000;
        if (ks_mono_us() < end)
            sleep_until_us(end);
        sample(ctx->st, &w[next_win]);
        next_win++;
    }
    /* Replies still due: up to 30 s more. */
    for (int i = 0; i < 3000 && !perf__interrupted &&
                    atomic_load(&s.replied) < s.n;
         i++)
        perf__sleep_ms(10);
    /* Drained: no callback runs once s is freed. */
    natsSubscription_Drain(sub);
    natsSubscription_WaitForDrainCompletion(sub, 5000);
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }

    o = json_object();
    wins = json_array();
    size_t errors = 0, k = 0;
    for (size_t i = 0; i < s.n; i++) {
        int64_t got = atomic_load(&s.got_us[i]);
        if (!got || atomic_load(&s.err[i]))
            errors++;
        else
            scratch[k++] = got - s.sent_us[i];
    }
    if (k)
        perf__lat_json(o, scratch, k);
    double worst_p99 = 0;
    for (int i = 0; i < nwin; i++) {
        int64_t from = t0 + (int64_t)i * win_s * 1000000;
        json_t *wj = window_json(&s, from, from + (int64_t)win_s * 1000000,
                                 scratch);
        int64_t wall = w[i + 1].start_us - w[i].start_us;
        json_object_set_new(wj, "t_end_s", json_integer((i + 1) * win_s));
        json_object_set_new(wj, "broker_cpu_pct",
                            json_real(cpu_pct(&w[i].broker, &w[i + 1].broker,
                                              wall)));
        json_object_set_new(wj, "agent_cpu_pct",
                            json_real(cpu_pct(&w[i].agent, &w[i + 1].agent,
                                              wall)));
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
    json_object_set_new(o, "offered_per_s",
                        json_real(wall > 0 ? (double)s.n * 1e6 / (double)wall
                                           : 0));
    json_object_set_new(o, "sent", json_integer((json_int_t)s.n));
    json_object_set_new(o, "errors", json_integer((json_int_t)errors));
    json_object_set_new(o, "worst_window_p99_us", json_real(worst_p99));
    json_object_set_new(o, "broker_cpu_pct",
                        json_real(cpu_pct(&w[0].broker, &w[nwin].broker,
                                          wall)));
    json_object_set_new(o, "agent_cpu_pct",
                        json_real(cpu_pct(&w[0].agent, &w[nwin].agent, wall)));
    json_object_set_new(o, "broker_rss_start_kb",
                        json_integer(w[0].broker.rss_kb));
    json_object_set_new(o, "broker_rss_end_kb",
                        json_integer(w[nwin].broker.rss_kb));
    /* Drift after the first window: start-up growth is not a leak. */
    json_object_set_new(o, "broker_rss_drift_kb",
                        json_integer(w[nwin].broker.rss_kb -
                                     w[nwin > 1 ? 1 : 0].broker.rss_kb));
    json_object_set_new(o, "agent_rss_start_kb",
                        json_integer(w[0].agent.rss_kb));
    json_object_set_new(o, "agent_rss_end_kb",
                        json_integer(w[nwin].agent.rss_kb));
    json_object_set_new(o, "agent_rss_drift_kb",
                        json_integer(w[nwin].agent.rss_kb -
                                     w[nwin > 1 ? 1 : 0].agent.rss_kb));
    json_object_set_new(o, "windows", wins);
    *out = o;
    rc = 0;
out:
    natsSubscription_Destroy(sub);
    natsInbox_Destroy(inbox);
    evt_close(c);
    free(s.sent_us);
    free((void *)s.got_us);
    free((void *)s.err);
    free(scratch);
    free(w);
    return rc;
}
