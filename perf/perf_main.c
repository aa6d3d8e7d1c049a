/*
 * `kscore perf`: options, the round runner (plain or A/B), the summary,
 * the SLO targets and the output (table or JSON, perf/README.md).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "perf_int.h"

#define EXIT_USAGE 2
#define EXIT_FAILED 125

static const struct perf_scenario scenarios[] = {
    {"floors", 5, 0, false, false, false, perf__floors_round},
    {"command_latency", 5, 0, true, true, false, perf__latency_round},
    {"exec_process", 5, 0, true, true, false, perf__process_round},
    /* The agent too: the events report for perf-0, and without its
     * heartbeat the scanner ends the waiting commands as Lost (10 s),
     * which turns the 100k run into a LateResult and conflict run. */
    {"event_throughput", 5, 0, true, true, false, perf__events_round},
    {"batch_exec_10", 20, 10, false, true, false, perf__batch10_round},
    {"batch_exec_1000", 3, 1000, false, true, true, perf__batch1000_round},
    /* Its own cluster stack (kscore up --cluster 3) and agent pools. */
    {"batch_exec_10000", 1, 0, false, false, true, perf__batch10000_round},
    {"sustained", 1, 0, true, true, false, perf__sustained_round},
    /* A search over rates, then twice what it found (issue 23). */
    {"capacity", 1, 0, true, true, false, perf__capacity_round},
    {"overload", 1, 0, true, true, false, perf__overload_round},
    {"trace", 3, 0, true, true, false, perf__trace_round},
    {"consumer_cost", 1, 0, false, false, true, perf__consumers_round},
};
#define NSCEN (sizeof(scenarios) / sizeof(scenarios[0]))

static const char usage[] =
    "usage: kscore perf [SCENARIO]... [--rounds N] [--json] [--out FILE]\n"
    "                   [--nats URL --db CONNINFO] [--ab OTHER_KSCORE]\n"
    "                   [--rate N] [--duration SECONDS] [--window SECONDS]\n"
    "                   [--deliver-within MS]\n"
    "                   [--quick]\n"
    "\n"
    "Scenarios (default: all but batch_exec_1000):\n"
    "  floors            NATS request/reply, JetStream publish, PostgreSQL\n"
    "                    commit, posix_spawn: p50s and their sum; 1,000\n"
    "                    async JetStream publishes; 1,000 pipelined inserts\n"
    "  command_latency   100 sequential ExecuteCommand of /bin/true\n"
    "  exec_process      50 whole `kscore exec -- /bin/true` processes;\n"
    "                    its floor: process start, NATS connect, command\n"
    "  event_throughput  1,000 and 100,000 events: async publish, recording\n"
    "  batch_exec_10     one BatchExecuteCommand across 10 local agents\n"
    "  batch_exec_1000   the same across 1,000 local agents (opt-in)\n"
    "  batch_exec_10000  10,000 agent ids in 20 agent pools on a\n"
    "                    3-node cluster stack of its own (opt-in)\n"
    "  sustained         --rate commands/s (1000) for --duration s (60),\n"
    "                    open loop: refused, lost, CPU per command\n"
    "  capacity          the highest rate with p99 <= 100 ms, no error,\n"
    "                    none refused or lost, held for 60 s (a search)\n"
    "  overload          twice that capacity (or --rate) for 30 s: the\n"
    "                    accepted p99, refusals, lost, recovery\n"
    "  trace             where one command's time goes: step stamps of the\n"
    "                    client, broker and agent (KSCORE_TRACE)\n"
    "  consumer_cost     what N agent ids cost nats-server: N durable\n"
    "                    consumers vs one, on 1 node R1 and 3 nodes R3\n"
    "                    (opt-in; KSCORE_PERF_CC_* in perf/README.md)\n"
    "\n"
    "  --rounds N        rounds per scenario (default 5; batch_exec_10 20;\n"
    "                    sustained 1, which reports per --window (10 s))\n"
    "  --json            JSON on stdout instead of the table\n"
    "  --out FILE        JSON to FILE (the table still goes to stdout)\n"
    "  --nats URL, --db CONNINFO   use running servers instead of private ones\n"
    "                    (the broker and agents are always the suite's own)\n"
    "  --ab OTHER        A/B: alternate rounds of this binary's broker and\n"
    "                    OTHER's; a difference is real when it exceeds A's\n"
    "                    round-to-round spread\n"
    "  --deliver-within MS  the delivery deadline of the loads' commands\n"
    "                    (sustained, capacity, overload; default: the\n"
    "                    broker's, 30 s)\n"
    "  --quick           tiny counts: a smoke test, not a measurement\n"
    "\n"
    "Environment: KSCORE_PERF_WRAP / KSCORE_PERF_WRAP_AGENT prefix the broker\n"
    "/ agent command (\"%n\": start number), e.g. \"heaptrack -o /tmp/h.%n\".\n";

static void
on_signal(int sig)
{
    (void)sig;
    perf__interrupted = 1;
}

static const struct perf_scenario *
find(const char *name)
{
    for (size_t i = 0; i < NSCEN; i++)
        if (strcmp(scenarios[i].name, name) == 0)
            return &scenarios[i];
    return NULL;
}

static int
parse_int(const char *s, int min, int *out)
{
    char *end = NULL;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    /* "60s" is accepted as 60 */
    if (errno || end == s || (*end && strcmp(end, "s") != 0) || v < min ||
        v > 1000000)
        return -1;
    *out = (int)v;
    return 0;
}

/* Runs one round of sc with binary bin; stores it in rounds. */
static int
one_round(struct perf_ctx *ctx, const struct perf_scenario *sc, int r,
          int total, const char *bin, bool restart, const char *tag,
          json_t *rounds)
{
    json_t *res = NULL;
    int rc;

    if (sc->services &&
        (rc = perf__services(ctx->st, bin, sc->local_agents, sc->agent,
                             restart)))
        return rc;
    rc = sc->round(ctx, r, &res);
    if (rc < 0) {
        fprintf(stderr, "kscore perf: %s round %d%s failed: %s\n", sc->name,
                r + 1, tag, ks_strerror(rc));
        return rc;
    }
    if (rc == PERF_SKIPPED) {
        fprintf(stderr, "kscore perf: %s: %s\n", sc->name,
                json_string_value(json_object_get(res, "skipped")));
        json_array_append_new(rounds, res);
        return PERF_SKIPPED;
    }
    /* One short progress line: the headline metrics of the round. */
    static const char *const heads[] = {"sum_us",     "p50_us",
                                        "p99_us",     "publish_1000_ms",
                                        "record_events_per_s", "wall_ms"};
    fprintf(stderr, "  %s %d/%d%s:", sc->name, r + 1, total, tag);
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        json_t *v = json_object_get(res, heads[i]);
        if (v)
            fprintf(stderr, " %s=%.6g", heads[i], json_number_value(v));
    }
    fputc('\n', stderr);
    json_array_append_new(rounds, res);
    return 0;
}

/* batch: the round values are single batches; add their percentiles. */
static void
batch_percentiles(json_t *sum, json_t *rounds)
{
    size_t n = json_array_size(rounds), k = 0;
    int64_t *v = n ? calloc(n, sizeof(*v)) : NULL;
    if (!v)
        return;
    for (size_t i = 0; i < n; i++) {
        json_t *w = json_object_get(json_array_get(rounds, i), "wall_ms");
        if (w)
            v[k++] = (int64_t)(json_number_value(w) * 1000.0);
    }
    if (k) {
        perf__sort(v, k);
        json_object_set_new(sum, "p50_ms",
                            json_real((double)perf__pct(v, k, 50) / 1000.0));
        json_object_set_new(sum, "p95_ms",
                            json_real((double)perf__pct(v, k, 95) / 1000.0));
        json_object_set_new(sum, "max_ms",
                            json_real((double)v[k - 1] / 1000.0));
    }
    free(v);
}

static json_t *
summary_of(const struct perf_scenario *sc, json_t *rounds, bool skipped)
{
    json_t *sum;
    if (skipped) {
        sum = json_object();
        json_object_set(sum, "skipped",
                        json_object_get(json_array_get(rounds, 0), "skipped"));
    } else {
        sum = perf__summarize(rounds);
        if (strncmp(sc->name, "batch_exec", 10) == 0)
            batch_percentiles(sum, rounds);
    }
    json_object_set_new(sum, "round_count",
                        json_integer((json_int_t)json_array_size(rounds)));
    json_object_set(sum, "rounds", rounds);
    return sum;
}

/*
 * A/B: for every numeric metric of A's summary, B - A against A's
 * round-to-round spread (max - min of A's rounds). Real only when the
 * difference is larger than that spread.
 */
static json_t *
ab_diff(json_t *a, json_t *b)
{
    json_t *d = json_object(), *spread = json_object_get(a, "spread");
    const char *key;
    json_t *va;
    json_object_foreach(a, key, va)
    {
        json_t *vb = json_object_get(b, key), *sp;
        if (!json_is_number(va) || !json_is_number(vb) ||
            strcmp(key, "round_count") == 0)
            continue;
        sp = json_object_get(spread, key);
        double x = json_number_value(va), y = json_number_value(vb);
        double asp = sp ? json_number_value(json_array_get(sp, 1)) -
                              json_number_value(json_array_get(sp, 0))
                        : 0;
        json_object_set_new(
            d, key,
            json_pack("{s:f,s:f,s:f,s:f,s:f,s:b}", "a", x, "b", y, "diff",
                      y - x, "diff_pct", x != 0 ? 100.0 * (y - x) / x : 0.0,
                      "a_spread", asp, "real", fabs(y - x) > asp));
    }
    return d;
}

static double
num(json_t *root, const char *sc, const char *key)
{
    json_t *v = json_object_get(
        json_object_get(json_object_get(root, "scenarios"), sc), key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* Why a scenario's numbers are not there: NULL when they are. */
static const char *
absent(json_t *root, const char *sc, char *buf, size_t len)
{
    json_t *s = json_object_get(json_object_get(root, "scenarios"), sc);
    if (!s)
        snprintf(buf, len, "%s did not run", sc);
    else if (json_object_get(s, "skipped"))
        snprintf(buf, len, "%s skipped: %s", sc,
                 json_string_value(json_object_get(s, "skipped")));
    else
        return NULL;
    return buf;
}

/*
 * Appends one target. A ratio target compares value / floor with limit
 * (floor > 0); an absolute one (isnan(floor) on purpose, ratio_target
 * false) compares value with limit, and has "floor" and "ratio" null.
 * Not evaluated (with "reason") when why is set or a number is missing.
 */
static json_t *
target(json_t *arr, const char *what, bool ratio_target, double value,
       double floor, double limit, bool le, const char *why)
{
    json_t *o = json_object();
    json_object_set_new(o, "target", json_string(what));
    json_object_set_new(o, "limit", json_real(limit));
    if (!why && (isnan(value) || (ratio_target && !(floor > 0))))
        why = isnan(value) ? "no value" : "no floor";
    if (why) {
        json_object_set_new(o, "evaluated", json_false());
        json_object_set_new(o, "reason", json_string(why));
        json_object_set_new(o, "value", json_null());
        json_object_set_new(o, "floor", json_null());
        json_object_set_new(o, "ratio", json_null());
        json_object_set_new(o, "met", json_false());
        json_array_append_new(arr, o);
        return o;
    }
    double x = ratio_target ? value / floor : value;
    json_object_set_new(o, "evaluated", json_true());
    json_object_set_new(o, "value", json_real(value));
    json_object_set_new(o, "floor",
                        ratio_target ? json_real(floor) : json_null());
    json_object_set_new(o, "ratio", ratio_target ? json_real(x) : json_null());
    json_object_set_new(o, "met", json_boolean(le ? x <= limit : x >= limit));
    json_array_append_new(arr, o);
    return o;
}

/*
 * Issue 23's table (capacity at the floor), after issue 15's and 14's:
 * perf/README.md "Targets". fl: why the floors are absent, or NULL.
 */
static void
issue23_targets(json_t *root, json_t *t, const char *fl)
{
    char b2[256];
    const char *why;
    double cpus = json_number_value(json_object_get(root, "cpus"));
    double spawn = num(root, "floors", "spawn_p50_us");
    double c = cpus > 0 ? cpus : 1;

    /* Spawning alone on half the CPUs: 0.5 x cpus / spawn_p50. */
    why = absent(root, "capacity", b2, sizeof(b2));
    target(t,
           "capacity capacity_per_s / (0.5 x cpus / floors spawn_p50) >= 1.0",
           true, num(root, "capacity", "capacity_per_s"),
           0.5 * c * 1e6 / spawn, 1.0, false, why ? why : fl);
    /* At the capacity found (its confirming trial), else sustained's. */
    {
        bool cap = !absent(root, "capacity", b2, sizeof(b2)) &&
                   !isnan(num(root, "capacity", "cpu_per_command_us"));
        const char *sc = cap ? "capacity" : "sustained";
        why = absent(root, sc, b2, sizeof(b2));
        json_t *x = target(t,
                           "cpu_per_command_us (children excluded) / floors "
                           "spawn_p50_us <= 1.0",
                           true, num(root, sc, "cpu_per_command_us"), spawn,
                           1.0, true, why ? why : fl);
        json_object_set_new(x, "source", json_string(sc));
    }
    why = absent(root, "overload", b2, sizeof(b2));
    target(t, "overload p99_ms of the accepted commands <= 1000", false,
           num(root, "overload", "p99_us") / 1000.0, NAN, 1000, true, why);
    target(t, "overload lost == 0", false, num(root, "overload", "lost"), NAN,
           0, true, why);
    why = absent(root, "batch_exec_10000", b2, sizeof(b2));
    target(t, "batch_exec_10000 succeeded / targets >= 1.0", true,
           num(root, "batch_exec_10000", "succeeded"),
           num(root, "batch_exec_10000", "targets"), 1.0, false, why);
    /* What is not the child, against the path's part that is not. */
    why = absent(root, "command_latency", b2, sizeof(b2));
    target(t,
           "command_latency (p50_us - spawn_p50_us) / (floors path_us - "
           "spawn_p50_us) <= 1.5",
           true, num(root, "command_latency", "p50_us") - spawn,
           num(root, "floors", "path_us") - spawn, 1.5, true,
           why ? why : fl);
    target(t, "allocations over the SLO suite: kscore's own <= 5 MB, all <= "
              "33 MB (make profile)",
           false, NAN, NAN, 5e6, true,
           "measured by `make profile` (perf/profile.sh, heaptrack), not by "
           "kscore perf");
}

/*
 * The targets of issues 15, 14 and 23, each a ratio to a floor measured
 * in the same run (perf/README.md "Targets" defines each), plus the
 * absolute ones.
 */
static json_t *
targets(json_t *root)
{
    json_t *t = json_array();
    char b1[256], b2[256];
    const char *fl = absent(root, "floors", b1, sizeof(b1)), *why;
    double path = num(root, "floors", "path_us");
    double cpus = json_number_value(json_object_get(root, "cpus"));
    double p50 = num(root, "command_latency", "p50_us");

    why = absent(root, "command_latency", b2, sizeof(b2));
    target(t, "command_latency p50_us / floors path_us <= 1.3", true, p50,
           path, 1.3, true, why ? why : fl);
    target(t, "command_latency p99_us / p50_us <= 2.0", true,
           num(root, "command_latency", "p99_us"), p50, 2.0, true, why);

    why = absent(root, "event_throughput", b2, sizeof(b2));
    target(t,
           "event_throughput publish_1000_us / floors js_async_1000_us <= 1.3",
           true, num(root, "event_throughput", "publish_1000_ms") * 1000.0,
           num(root, "floors", "js_async_1000_us"), 1.3, true,
           why ? why : fl);
    target(t,
           "event_throughput record_events_per_s / floors "
           "pg_pipeline_rows_per_s >= 0.6",
           true, num(root, "event_throughput", "record_events_per_s"),
           num(root, "floors", "pg_pipeline_rows_per_s"), 0.6, false,
           why ? why : fl);

    why = absent(root, "batch_exec_10", b2, sizeof(b2));
    target(t,
           "batch_exec_10 p50_us / (floors path_us + 10 x spawn_p50_us / "
           "cpus) <= 1.5",
           true, num(root, "batch_exec_10", "p50_ms") * 1000.0,
           path + 10.0 * num(root, "floors", "spawn_p50_us") /
                      (cpus > 0 ? cpus : 1),
           1.5, true, why ? why : fl);

    /* The batch floors of issue 14: N spawns on the cpus, and 4 events a
     * command (requested, dispatched, started, completed) at the
     * recording floor. */
    {
        double spawn = num(root, "floors", "spawn_p50_us");
        double rows = num(root, "floors", "pg_pipeline_rows_per_s");
        double c = cpus > 0 ? cpus : 1;
        why = absent(root, "batch_exec_1000", b2, sizeof(b2));
        target(t,
               "batch_exec_1000 p50_us / (1000 x spawn_p50_us / cpus + "
               "4000 events / floors pg_pipeline_rows_per_s) <= 1.5",
               true, num(root, "batch_exec_1000", "p50_ms") * 1000.0,
               1000.0 * spawn / c + 4000.0 / rows * 1e6, 1.5, true,
               why ? why : fl);
        why = absent(root, "batch_exec_10000", b2, sizeof(b2));
        target(t,
               "batch_exec_10000 wall_us / (10000 x spawn_p50_us / cpus + "
               "40000 events / floors pg_pipeline_rows_per_s) <= 1.5",
               true, num(root, "batch_exec_10000", "wall_ms") * 1000.0,
               10000.0 * spawn / c + 40000.0 / rows * 1e6, 1.5, true,
               why ? why : fl);
        target(t, "batch_exec_10000 targets without exactly one terminal "
                  "event == 0",
               false, num(root, "batch_exec_10000", "not_exactly_one_terminal"),
               NAN, 0, true, why);
        target(t, "batch_exec_10000 nats_rss_peak_mb_max <= 1024", false,
               num(root, "batch_exec_10000", "nats_rss_peak_mb_max"), NAN,
               1024, true, why);
        target(t, "batch_exec_10000 broker_rss_peak_mb_max <= 200", false,
               num(root, "batch_exec_10000", "broker_rss_peak_mb_max"), NAN,
               200, true, why);
    }

    /* exec_process's floor (issue 23): an empty C program's start, a
     * connect and a command: its own empty and connect p50s, and
     * command_latency's p50 when it ran (else the 20 calls of its own). */
    why = absent(root, "exec_process", b2, sizeof(b2));
    {
        bool cl = !isnan(p50);
        double cmd = cl ? p50 : num(root, "exec_process", "command_p50_us");
        double floor = num(root, "exec_process", "empty_p50_us") +
                       num(root, "exec_process", "connect_p50_us") + cmd;
        target(
            t,
            cl ? "exec_process p50_us / (empty_p50_us + connect_p50_us + "
                 "command_latency p50_us) <= 1.2"
               : "exec_process p50_us / (empty_p50_us + connect_p50_us + "
                 "exec_process command_p50_us) <= 1.2",
            true, num(root, "exec_process", "p50_us"), floor, 1.2, true, why);
        target(t, "exec_process p50_ms <= 15", false,
               num(root, "exec_process", "p50_us") / 1000.0, NAN, 15, true,
               why);
    }

    /* sustained: the rate held with p99 <= 100 ms and no error for 60 s. */
    why = absent(root, "sustained", b2, sizeof(b2));
    {
        double rate = num(root, "sustained", "rate_per_s");
        double p99 = num(root, "sustained", "p99_us");
        double errs = num(root, "sustained", "errors");
        double dur = num(root, "sustained", "duration_s");
        json_t *x = target(t,
                           "sustained >= 1000 commands/s with p99 <= 100 ms "
                           "and 0 errors over 60 s, 10 agents",
                           false, rate, NAN, 1000, false, why);
        if (json_is_true(json_object_get(x, "evaluated"))) {
            char failed[256] = "";
            size_t k = 0;
            if (rate < 1000)
                k += (size_t)snprintf(failed + k, sizeof(failed) - k,
                                      "%srate %.0f/s < 1000/s",
                                      k ? "; " : "", rate);
            if (isnan(p99) || p99 > 100000)
                k += (size_t)snprintf(failed + k, sizeof(failed) - k,
                                      "%sp99 %.1f ms > 100 ms",
                                      k ? "; " : "", p99 / 1000.0);
            if (isnan(errs) || errs != 0)
                k += (size_t)snprintf(failed + k, sizeof(failed) - k,
                                      "%s%.0f errors", k ? "; " : "", errs);
            if (isnan(dur) || dur < 60)
                k += (size_t)snprintf(failed + k, sizeof(failed) - k,
                                      "%sduration %.0f s < 60 s",
                                      k ? "; " : "", dur);
            json_object_set_new(x, "p99_us", json_real(p99));
            json_object_set_new(x, "errors", json_real(errs));
            json_object_set_new(x, "duration_s", json_real(dur));
            json_object_set_new(x, "met", json_boolean(k == 0));
            if (k)
                json_object_set_new(x, "failed", json_string(failed));
        }
        /* "No drift": under 5% of the end RSS after the first window. */
        target(t, "sustained broker_rss_drift_kb / broker_rss_end_kb <= 0.05",
               true, num(root, "sustained", "broker_rss_drift_kb"),
               num(root, "sustained", "broker_rss_end_kb"), 0.05, true, why);
        target(t, "sustained agent_rss_drift_kb / agent_rss_end_kb <= 0.05",
               true, num(root, "sustained", "agent_rss_drift_kb"),
               num(root, "sustained", "agent_rss_end_kb"), 0.05, true, why);
    }
    issue23_targets(root, t, fl);
    return t;
}

static void
print_value(FILE *f, json_t *v)
{
    double x = json_number_value(v);
    if (json_is_integer(v) || (fabs(x) >= 1000 && x == floor(x)))
        fprintf(f, "%12.0f", x);
    else
        fprintf(f, "%12.2f", x);
}

static void
print_table(FILE *f, json_t *root, bool ab)
{
    json_t *scs = json_object_get(root, "scenarios"), *sc;
    const char *name;

    fprintf(f, "kscore perf on %s (%lld cpus, load %.2f -> %.2f), PostgreSQL "
               "fsync=%s synchronous_commit=%s%s\n",
            json_string_value(json_object_get(root, "host")),
            (long long)json_integer_value(json_object_get(root, "cpus")),
            json_number_value(json_object_get(root, "loadavg_start")),
            json_number_value(json_object_get(root, "loadavg_end")),
            json_string_value(json_object_get(root, "pg_fsync")),
            json_string_value(json_object_get(root, "pg_synchronous_commit")),
            json_is_true(json_object_get(root, "quick")) ? " (QUICK: not a "
                                                           "measurement)"
                                                         : "");
    json_object_foreach(scs, name, sc)
    {
        json_t *rounds = json_object_get(sc, "rounds");
        json_t *spread = json_object_get(sc, "spread");
        json_t *diff = json_object_get(sc, "diff");
        const char *key;
        json_t *v;
        fprintf(f, "\n%s (%zu rounds%s)\n", name, json_array_size(rounds),
                ab ? " of A" : "");
        if (json_object_get(sc, "skipped")) {
            fprintf(f, "  skipped: %s\n",
                    json_string_value(json_object_get(sc, "skipped")));
            continue;
        }
        if (ab)
            fprintf(f, "  %-28s %12s %25s %12s %12s %8s  %s\n", "metric",
                    "A median", "A spread (min - max)", "B median", "B - A",
                    "B-A %", "real?");
        else
            fprintf(f, "  %-28s %12s %25s  %s\n", "metric", "median",
                    "spread (min - max)", "rounds");
        json_object_foreach(sc, key, v)
        {
            json_t *sp = json_object_get(spread, key);
            if (!json_is_number(v) || strcmp(key, "round_count") == 0)
                continue;
            fprintf(f, "  %-28s ", key);
            print_value(f, v);
            if (sp) {
                fputc(' ', f);
                print_value(f, json_array_get(sp, 0));
                fputs(" -", f);
                print_value(f, json_array_get(sp, 1));
            } else {
                fprintf(f, " %25s", "");
            }
            if (ab) {
                json_t *d = json_object_get(diff, key);
                if (d) {
                    fputc(' ', f);
                    print_value(f, json_object_get(d, "b"));
                    fputc(' ', f);
                    print_value(f, json_object_get(d, "diff"));
                    fprintf(f, " %7.1f%%  %s", json_number_value(json_object_get(d, "diff_pct")),
                            json_is_true(json_object_get(d, "real"))
                                ? "REAL"
                                : "noise");
                }
            } else {
                fputs(" ", f);
                for (size_t i = 0; i < json_array_size(rounds) && i < 20;
                     i++) {
                    json_t *rv = json_object_get(json_array_get(rounds, i),
                                                 key);
                    if (!rv)
                        break;
                    double x = json_number_value(rv);
                    fprintf(f, x == floor(x) ? " %.0f" : " %.3g", x);
                }
            }
            fputc('\n', f);
        }
        if (strcmp(name, "consumer_cost") == 0)
            perf__consumers_table(f, json_array_get(rounds, 0));
        json_t *trials = json_object_get(json_array_get(rounds, 0), "trials");
        if (trials) {
            size_t i;
            json_t *x;
            fprintf(f, "  trials of round 1:  %8s %6s %10s %8s %8s %6s  %s\n",
                    "rate", "dur_s", "p99_us", "errors", "refused", "lost",
                    "held");
            json_array_foreach(trials, i, x)
            fprintf(f, "  %19s %8.1f %6lld %10.0f %8lld %8lld %6lld  %s\n", "",
                    json_number_value(json_object_get(x, "rate")),
                    (long long)json_integer_value(
                        json_object_get(x, "duration_s")),
                    json_number_value(json_object_get(x, "p99_us")),
                    (long long)json_integer_value(json_object_get(x, "errors")),
                    (long long)json_integer_value(
                        json_object_get(x, "refused")),
                    (long long)json_integer_value(json_object_get(x, "lost")),
                    json_is_true(json_object_get(x, "held")) ? "yes" : "no");
        }
        json_t *wins = json_object_get(json_array_get(rounds, 0), "windows");
        if (wins) {
            size_t i;
            json_t *w;
            fprintf(f, "  windows of round 1: %6s %6s %7s %6s %10s %10s %8s "
                       "%8s %12s %12s\n",
                    "t_end", "sent", "refused", "errors", "p50_us", "p99_us",
                    "brk_cpu", "agt_cpu", "brk_rss_kb", "agt_rss_kb");
            json_array_foreach(wins, i, w)
            {
                fprintf(f,
                        "  %19s %6lld %6lld %7lld %6lld %10lld %10lld %7.1f%% "
                        "%7.1f%% %12lld %12lld\n",
                        "",
                        (long long)json_integer_value(
                            json_object_get(w, "t_end_s")),
                        (long long)json_integer_value(json_object_get(w, "sent")),
                        (long long)json_integer_value(
                            json_object_get(w, "refused")),
                        (long long)json_integer_value(
                            json_object_get(w, "errors")),
                        (long long)json_integer_value(
                            json_object_get(w, "p50_us")),
                        (long long)json_integer_value(
                            json_object_get(w, "p99_us")),
                        json_number_value(json_object_get(w, "broker_cpu_pct")),
                        json_number_value(json_object_get(w, "agent_cpu_pct")),
                        (long long)json_integer_value(
                            json_object_get(w, "broker_rss_kb")),
                        (long long)json_integer_value(
                            json_object_get(w, "agent_rss_kb")));
            }
        }
    }
    json_t *t = json_object_get(root, "targets"), *x;
    size_t i;
    if (json_array_size(t))
        fprintf(f, "\ntargets%s\n", ab ? " (A)" : "");
    if (json_array_size(t))
        fprintf(f, "  %-4s %-98s %12s %12s %8s %8s\n", "", "target", "value",
                "floor", "ratio", "limit");
    json_array_foreach(t, i, x)
    {
        json_t *fv = json_object_get(x, "floor");
        if (!json_is_true(json_object_get(x, "evaluated"))) {
            fprintf(f, "  %-4s %-98s not evaluated: %s\n", "n/a",
                    json_string_value(json_object_get(x, "target")),
                    json_string_value(json_object_get(x, "reason")));
            continue;
        }
        fprintf(f, "  %-4s %-98s %12.2f ",
                json_is_true(json_object_get(x, "met")) ? "met" : "MISS",
                json_string_value(json_object_get(x, "target")),
                json_number_value(json_object_get(x, "value")));
        if (json_is_number(fv))
            fprintf(f, "%12.2f %8.3f", json_number_value(fv),
                    json_number_value(json_object_get(x, "ratio")));
        else
            fprintf(f, "%12s %8s", "-", "-");
        fprintf(f, " %8.2f", json_number_value(json_object_get(x, "limit")));
        if (json_object_get(x, "failed"))
            fprintf(f, "  (%s)",
                    json_string_value(json_object_get(x, "failed")));
        fputc('\n', f);
    }
}


static int
run_scenario(struct perf_ctx *ctx, const struct perf_scenario *sc,
             json_t *scs)
{
    const struct perf_opts *o = ctx->o;
    int nr = o->rounds ? o->rounds : (o->quick ? 1 : sc->default_rounds);
    json_t *ra = json_array(), *rb = o->bin_b ? json_array() : NULL;
    json_t *sum = NULL;
    bool skipped = false;
    int rc = 0;

    fprintf(stderr, "kscore perf: %s, %d round%s%s\n", sc->name, nr,
            nr == 1 ? "" : "s", o->bin_b ? " each of A and B" : "");
    for (int r = 0; r < nr && !perf__interrupted; r++) {
        /* A/B: ABAB..., each round's broker and agent started afresh
         * from its binary, on the same servers. */
        rc = one_round(ctx, sc, r, nr, o->bin_a, o->bin_b != NULL,
                       o->bin_b ? " A" : "", ra);
        if (rc == 0 && o->bin_b)
            rc = one_round(ctx, sc, r, nr, o->bin_b, true, " B", rb);
        if (rc == PERF_SKIPPED) {
            skipped = true;
            rc = 0;
            break;
        }
        if (rc)
            break;
    }
    if (rc == 0 && perf__interrupted)
        rc = -EINTR;
    if (rc == 0) {
        sum = summary_of(sc, ra, skipped);
        if (rb && !skipped) {
            json_t *sb = summary_of(sc, rb, false);
            json_object_set_new(sum, "diff", ab_diff(sum, sb));
            json_object_set_new(sum, "b", sb);
        }
        if (strcmp(sc->name, "floors") == 0) {
            json_t *v = json_object_get(sum, "sum_us");
            ctx->floor_sum_us = v ? json_number_value(v) : 0;
        }
        if (strcmp(sc->name, "capacity") == 0) {
            json_t *v = json_object_get(sum, "capacity_per_s");
            ctx->capacity_per_s = v ? json_number_value(v) : 0;
        }
        json_object_set_new(scs, sc->name, sum);
    }
    json_decref(ra);
    json_decref(rb);
    return rc;
}

int
perf_main(int argc, char **argv, const char *kscore_bin)
{
    static const struct option lo[] = {
        {"rounds", required_argument, 0, 'r'},
        {"json", no_argument, 0, 'j'},
        {"out", required_argument, 0, 'o'},
        {"nats", required_argument, 0, 'n'},
        {"db", required_argument, 0, 'd'},
        {"ab", required_argument, 0, 'a'},
        {"rate", required_argument, 0, 'R'},
        {"duration", required_argument, 0, 'D'},
        {"window", required_argument, 0, 'W'},
        {"deliver-within", required_argument, 0, 'T'},
        {"quick", no_argument, 0, 'q'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct perf_opts o = {0};
    struct perf_stack st = {0};
    struct perf_ctx ctx = {.o = &o, .st = &st};
    bool want[NSCEN] = {0}, any = false;
    struct sigaction sa = {0}, old_int, old_term, old_pipe;
    char bin_b[PATH_MAX];
    json_t *root = NULL, *scs;
    int opt, rc = 0, ret = EXIT_FAILED;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'r':
            if (parse_int(optarg, 1, &o.rounds))
                goto bad;
            break;
        case 'j':
            o.json = true;
            break;
        case 'o':
            o.out_path = optarg;
            break;
        case 'n':
            o.nats_url = optarg;
            break;
        case 'd':
            o.db = optarg;
            break;
        case 'a':
            o.bin_b = optarg;
            break;
        case 'R':
            o.rate = strtod(optarg, NULL);
            if (!(o.rate > 0 && o.rate <= 100000))
                goto bad;
            break;
        case 'D':
            if (parse_int(optarg, 1, &o.duration_s))
                goto bad;
            break;
        case 'W':
            if (parse_int(optarg, 1, &o.window_s))
                goto bad;
            break;
        case 'T': {
            int ms;
            if (parse_int(optarg, 1, &ms))
                goto bad;
            o.deliver_ms = (uint64_t)ms;
            break;
        }
        case 'q':
            o.quick = true;
            break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            fputs(usage, stderr);
            return EXIT_USAGE;
        }
    }
    for (int i = optind; i < argc; i++) {
        const struct perf_scenario *sc = find(argv[i]);
        if (strcmp(argv[i], "all") == 0) {
            for (size_t k = 0; k < NSCEN; k++)
                want[k] = want[k] || !scenarios[k].opt_in;
            any = true;
            continue;
        }
        if (!sc) {
            fprintf(stderr, "kscore perf: unknown scenario '%s'\n%s", argv[i],
                    usage);
            return EXIT_USAGE;
        }
        want[sc - scenarios] = true;
        any = true;
    }
    if (!any)
        for (size_t k = 0; k < NSCEN; k++)
            want[k] = !scenarios[k].opt_in;
    /* Overload is twice this run's capacity (unless --rate says). */
    if (want[find("overload") - scenarios] && !(o.rate > 0))
        want[find("capacity") - scenarios] = true;
    /* The ratios to the floors need this run's floors. */
    if (want[1] || want[find("event_throughput") - scenarios] ||
        want[find("batch_exec_10") - scenarios] ||
        want[find("capacity") - scenarios])
        want[0] = true;
    if ((o.nats_url == NULL) != (o.db == NULL)) {
        fprintf(stderr, "kscore perf: --nats and --db go together\n");
        return EXIT_USAGE;
    }
    if (!realpath(kscore_bin, o.bin_a)) {
        fprintf(stderr, "kscore perf: %s: %s\n", kscore_bin, strerror(errno));
        return EXIT_FAILED;
    }
    if (o.bin_b) {
        if (!realpath(o.bin_b, bin_b) || access(bin_b, X_OK) != 0) {
            fprintf(stderr, "kscore perf: --ab %s: not an executable\n",
                    o.bin_b);
            return EXIT_USAGE;
        }
        o.bin_b = bin_b;
    }

    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, &old_pipe);
    perf__interrupted = 0;

    root = json_object();
    scs = json_object();
    json_object_set_new(root, "scenarios", scs);
    if ((rc = perf__stack_start(&st, &o)))
        goto out;
    {
        char host[256] = "";
        gethostname(host, sizeof(host) - 1);
        json_object_set_new(root, "host", json_string(host));
        json_object_set_new(root, "cpus",
                            json_integer(sysconf(_SC_NPROCESSORS_ONLN)));
        json_object_set_new(root, "started_at_us", json_integer(ks_now_us()));
        json_object_set_new(root, "loadavg_start", json_real(perf__loadavg()));
        json_object_set_new(root, "binary_a", json_string(o.bin_a));
        if (o.bin_b)
            json_object_set_new(root, "binary_b", json_string(o.bin_b));
        json_object_set_new(root, "private_servers",
                            json_boolean(st.own_nats && st.own_pg));
        json_object_set_new(root, "quick", json_boolean(o.quick));
        json_object_set_new(root, "pg_fsync", json_string(st.pg_fsync));
        json_object_set_new(root, "pg_synchronous_commit",
                            json_string(st.pg_sync_commit));
    }
    for (size_t k = 0; k < NSCEN && !perf__interrupted; k++) {
        if (!want[k])
            continue;
        if ((rc = run_scenario(&ctx, &scenarios[k], scs)))
            break;
    }
    json_object_set_new(root, "finished_at_us", json_integer(ks_now_us()));
    json_object_set_new(root, "loadavg_end", json_real(perf__loadavg()));
    json_object_set_new(root, "targets", targets(root));
    if (rc == 0)
        ret = 0;
out:
    perf__stack_stop(&st, ret != 0);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGPIPE, &old_pipe, NULL);
    if (!root)
        return ret;
    json_object_set_new(root, "ok", json_boolean(ret == 0));
    if (o.out_path) {
        if (json_dump_file(root, o.out_path, JSON_INDENT(1)) != 0) {
            fprintf(stderr, "kscore perf: cannot write %s\n", o.out_path);
            ret = EXIT_FAILED;
        }
    }
    if (o.json && !o.out_path) {
        json_dumpf(root, stdout, JSON_INDENT(1));
        fputc('\n', stdout);
    } else if (rc == 0) {
        print_table(stdout, root, o.bin_b != NULL);
    }
    json_decref(root);
    return ret;
bad:
    fprintf(stderr, "kscore perf: bad option value '%s'\n%s", optarg, usage);
    return EXIT_USAGE;
}
