/*
 * `kscore perf` smoke test: every scenario once with tiny counts (--quick)
 * through the real binary on its own private stack, and the JSON keys the
 * SLO report reads (perf/README.md). Correctness only: no timing asserts,
 * the numbers of a --quick run mean nothing.
 */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

/* The number at scenarios.<sc>.<key>, or fails the test. */
static double
num_at(json_t *root, const char *sc, const char *key)
{
    json_t *s = json_object_get(json_object_get(root, "scenarios"), sc);
    json_t *v = json_object_get(s, key);
    ck_assert_msg(s != NULL, "no scenarios.%s", sc);
    ck_assert_msg(json_is_number(v), "scenarios.%s.%s is not a number", sc,
                  key);
    return json_number_value(v);
}

/* Issues 15 and 14's targets, in the order the suite reports them. */
static const char *const target_names[] = {
    "command_latency p50_us / floors path_us",
    "command_latency p99_us / p50_us",
    "event_throughput publish_1000_us / floors js_async_1000_us",
    "event_throughput record_events_per_s / floors pg_pipeline_rows_per_s",
    "batch_exec_10 p50_us / (floors path_us + 10 x spawn_p50_us / cpus)",
    "batch_exec_1000 p50_us / (1000 x spawn_p50_us / cpus + 4000 events",
    "batch_exec_10000 wall_us / (10000 x spawn_p50_us / cpus + 40000 events",
    "batch_exec_10000 targets without exactly one terminal event == 0",
    "batch_exec_10000 nats_rss_peak_mb_max <= 1024",
    "batch_exec_10000 broker_rss_peak_mb_max <= 200",
    "exec_process p50_us / (empty_p50_us + connect_p50_us + ",
    "exec_process p50_ms <= 15",
    "sustained >= 1000 commands/s with p99 <= 100 ms and 0 errors",
    "sustained broker_rss_drift_kb / broker_rss_end_kb",
    "sustained agent_rss_drift_kb / agent_rss_end_kb",
    /* issue 23 */
    "capacity capacity_per_s / (0.5 x cpus / floors spawn_p50) >= 1.0",
    "cpu_per_command_us (children excluded) / floors spawn_p50_us <= 1.0",
    "overload p99_ms of the accepted commands <= 1000",
    "overload lost == 0",
    "batch_exec_10000 succeeded / targets >= 1.0",
    "command_latency (p50_us - spawn_p50_us) / (floors path_us - "
    "spawn_p50_us) <= 1.5",
    "allocations over the SLO suite",
};
#define NTARGETS (sizeof(target_names) / sizeof(target_names[0]))
/* Of those, the targets of the opt-in scenarios batch_exec_1000 and
 * batch_exec_10000, not evaluated in a default run, and the one kscore
 * perf never evaluates (allocations: make profile). */
#define NTARGETS_OPT_IN 7
/* Where the first sustained target is in the list. */
#define SUSTAINED_TARGET 12

/*
 * Every target is there, well formed: evaluated ones with a number value,
 * a limit, a ratio to a positive floor (null floor and ratio for the
 * absolute ones) and a boolean met; the others with a reason. Returns the
 * number of evaluated ones.
 */
static size_t
check_targets(json_t *root)
{
    json_t *t = json_object_get(root, "targets");
    size_t evaluated = 0;

    ck_assert_msg(json_array_size(t) == NTARGETS, "%zu targets, want %zu",
                  json_array_size(t), NTARGETS);
    for (size_t i = 0; i < NTARGETS; i++) {
        json_t *x = json_array_get(t, i);
        const char *name = json_string_value(json_object_get(x, "target"));
        ck_assert_msg(name && strncmp(name, target_names[i],
                                      strlen(target_names[i])) == 0,
                      "target %zu is '%s', want '%s...'", i,
                      name ? name : "(none)", target_names[i]);
        ck_assert(json_is_number(json_object_get(x, "limit")));
        ck_assert(json_is_boolean(json_object_get(x, "met")));
        ck_assert(json_is_boolean(json_object_get(x, "evaluated")));
        if (!json_is_true(json_object_get(x, "evaluated"))) {
            const char *why = json_string_value(json_object_get(x, "reason"));
            ck_assert_msg(why && why[0], "%s: not evaluated, no reason",
                          name);
            continue;
        }
        evaluated++;
        ck_assert_msg(json_is_number(json_object_get(x, "value")), "%s", name);
        json_t *fl = json_object_get(x, "floor"), *r = json_object_get(x, "ratio");
        if (json_is_null(fl)) { /* absolute */
            ck_assert(json_is_null(r));
            continue;
        }
        ck_assert_msg(json_is_number(fl) && json_number_value(fl) > 0,
                      "%s: floor", name);
        ck_assert_msg(json_is_number(r), "%s: ratio", name);
        /* the ratio is value / floor, and met says where it stands */
        double ratio = json_number_value(json_object_get(x, "value")) /
                       json_number_value(fl);
        ck_assert_msg(fabs(ratio - json_number_value(r)) <=
                          1e-6 * fmax(1.0, fabs(ratio)),
                      "%s: ratio %f, value / floor %f", name,
                      json_number_value(r), ratio);
    }
    return evaluated;
}

/* The number at scenarios.<sc>.<key>, or NaN when it is not there. */
static double
num_or_nan(json_t *root, const char *sc, const char *key)
{
    json_t *v = json_object_get(
        json_object_get(json_object_get(root, "scenarios"), sc), key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static json_t *
run_perf(const char *const args[], struct fixture_out *o)
{
    json_error_t err;
    json_t *root;

    ck_assert_int_eq(fixture_kscore(NULL, args, o), 0);
    ck_assert_msg(o->status == 0, "kscore perf exited %d: %s", o->status,
                  o->err);
    root = json_loads(o->out, 0, &err);
    ck_assert_msg(root != NULL, "not JSON (%s): %.200s", err.text, o->out);
    return root;
}

START_TEST(test_quick_all)
{
    const char *args[] = {"perf",        "floors",  "command_latency",
                          "event_throughput", "batch_exec_10",
                          "exec_process", "sustained", "capacity",
                          "overload",    "--rounds", "1",       "--quick",
                          "--duration",  "2",       "--rate",  "10",
                          "--json",      NULL};
    struct fixture_out o;
    json_t *root = run_perf(args, &o);

    ck_assert(json_is_true(json_object_get(root, "ok")));
    ck_assert(json_is_true(json_object_get(root, "quick")));
    ck_assert_str_eq(json_string_value(json_object_get(root, "pg_fsync")),
                     "on");
    ck_assert(num_at(root, "floors", "sum_us") > 0);
    ck_assert(num_at(root, "floors", "nats_rr_p50_us") > 0);
    ck_assert(num_at(root, "floors", "js_pub_p50_us") > 0);
    ck_assert(num_at(root, "floors", "pg_commit_p50_us") > 0);
    ck_assert(num_at(root, "floors", "spawn_p50_us") > 0);
    ck_assert(num_at(root, "command_latency", "p50_us") > 0);
    num_at(root, "command_latency", "p95_us");
    num_at(root, "command_latency", "p99_us");
    ck_assert(num_at(root, "command_latency", "ratio_to_floor") > 0);
    ck_assert_int_eq((int)num_at(root, "command_latency", "errors"), 0);
    ck_assert(num_at(root, "event_throughput", "publish_1000_ms") > 0);
    ck_assert(num_at(root, "event_throughput", "record_events_per_s") > 0);
    ck_assert(num_at(root, "event_throughput",
                     "record_100k_events_per_s") > 0);
    json_t *b = json_object_get(json_object_get(root, "scenarios"),
                                "batch_exec_10");
    ck_assert(b != NULL);
    if (!json_object_get(b, "skipped")) { /* batch API not served: skip */
        ck_assert(num_at(root, "batch_exec_10", "p50_ms") > 0);
        ck_assert_int_eq((int)num_at(root, "batch_exec_10", "succeeded"), 10);
    }
    ck_assert(num_at(root, "sustained", "sent") > 0);
    num_at(root, "sustained", "broker_rss_end_kb");
    num_at(root, "sustained", "broker_cpu_pct");
    ck_assert_int_eq((int)num_at(root, "sustained", "errors"), 0);
    /* issue 23: the open loop's refusals, losses, CPU per command (every
     * part known: the servers are the suite's own) and the accepted p99 */
    num_at(root, "sustained", "refused");
    ck_assert_int_eq((int)num_at(root, "sustained", "lost"), 0);
    ck_assert(num_at(root, "sustained", "cpu_per_command_us") > 0);
    num_at(root, "sustained", "pg_cpu_us_per_command");
    num_at(root, "sustained", "nats_cpu_us_per_command");
    num_at(root, "sustained", "broker_cpu_us_per_command");
    num_at(root, "sustained", "agent_cpu_us_per_command");
    num_at(root, "sustained", "children_cpu_us_per_command");
    num_at(root, "sustained", "p99_us");
    ck_assert(num_at(root, "sustained", "recorded") > 0);
    /* capacity: a search, each trial listed; overload at twice it (or
     * --rate when nothing held under a loaded machine) */
    num_at(root, "capacity", "capacity_per_s");
    json_t *cap = json_object_get(json_object_get(root, "scenarios"),
                                  "capacity");
    json_t *trials = json_object_get(json_array_get(json_object_get(cap,
                                                                    "rounds"),
                                                    0),
                                     "trials");
    ck_assert_uint_ge(json_array_size(trials), 1);
    ck_assert(json_is_boolean(
        json_object_get(json_array_get(trials, 0), "held")));
    num_at(root, "overload", "rate_per_s");
    num_at(root, "overload", "refused");
    ck_assert_int_eq((int)num_at(root, "overload", "lost"), 0);
    /* every scenario keeps its rounds and the spread of each metric */
    json_t *fl = json_object_get(json_object_get(root, "scenarios"), "floors");
    ck_assert_int_eq(json_array_size(json_object_get(fl, "rounds")), 1);
    ck_assert(json_object_get(json_object_get(fl, "spread"), "sum_us"));
    /* the throughput floors of issue 15 */
    ck_assert(num_at(root, "floors", "js_async_1000_us") > 0);
    ck_assert(num_at(root, "floors", "pg_pipeline_1000_us") > 0);
    ck_assert(num_at(root, "floors", "pg_pipeline_rows_per_s") > 0);
    /* the whole `kscore exec` process and the parts of its floor */
    ck_assert(num_at(root, "exec_process", "p50_us") > 0);
    num_at(root, "exec_process", "p95_us");
    num_at(root, "exec_process", "p99_us");
    ck_assert(num_at(root, "exec_process", "empty_p50_us") > 0);
    ck_assert(num_at(root, "exec_process", "version_p50_us") > 0);
    ck_assert(num_at(root, "exec_process", "connect_p50_us") > 0);
    ck_assert(num_at(root, "exec_process", "command_p50_us") > 0);
    ck_assert_int_eq((int)num_at(root, "exec_process", "errors"), 0);
    ck_assert(json_integer_value(json_object_get(root, "cpus")) >= 1);
    /* every scenario ran, so every target is evaluated (the batch one
     * only when the batch API is served; overload's when something was
     * accepted at all) */
    size_t ev = check_targets(root);
    bool overload_p99 = !isnan(num_or_nan(root, "overload", "p99_us"));
    size_t want = NTARGETS - NTARGETS_OPT_IN - (overload_p99 ? 0 : 1);
    ck_assert_uint_ge(ev, want - 1);
    if (!json_object_get(b, "skipped"))
        ck_assert_uint_eq(ev, want);
    /* sustained at --quick's 20/s for 2 s misses, and says which parts */
    json_t *sus =
        json_array_get(json_object_get(root, "targets"), SUSTAINED_TARGET);
    ck_assert_msg(strncmp(json_string_value(json_object_get(sus, "target")),
                          "sustained >=", 12) == 0,
                  "target %d is not sustained's", SUSTAINED_TARGET);
    ck_assert(json_is_false(json_object_get(sus, "met")));
    const char *failed = json_string_value(json_object_get(sus, "failed"));
    ck_assert_msg(failed && strstr(failed, "rate 10/s < 1000/s") &&
                      strstr(failed, "duration 2 s < 60 s"),
                  "failed: %s", failed ? failed : "(none)");
    json_decref(root);
    fixture_out_release(&o);
}
END_TEST

START_TEST(test_ab_same_binary)
{
    const char *bin = getenv("KSCORE_BIN");
    const char *args[] = {"perf", "command_latency", "--rounds", "2",
                          "--quick", "--json", "--ab", bin, NULL};
    struct fixture_out o;
    json_t *root;

    ck_assert(bin != NULL);
    root = run_perf(args, &o);
    json_t *cl = json_object_get(json_object_get(root, "scenarios"),
                                 "command_latency");
    json_t *d = json_object_get(json_object_get(cl, "diff"), "p50_us");
    ck_assert_msg(d != NULL, "no diff.p50_us");
    ck_assert(json_is_number(json_object_get(d, "a_spread")));
    ck_assert(json_is_boolean(json_object_get(d, "real")));
    ck_assert_int_eq(
        json_array_size(json_object_get(json_object_get(cl, "b"), "rounds")),
        2);
    ck_assert_int_eq(json_array_size(json_object_get(cl, "rounds")), 2);
    /* command_latency brings floors; the targets of the scenarios that did
     * not run are listed, not evaluated, with the reason */
    ck_assert_uint_eq(check_targets(root), 3);
    json_t *et = json_array_get(json_object_get(root, "targets"), 2);
    ck_assert(json_is_false(json_object_get(et, "evaluated")));
    ck_assert_str_eq(json_string_value(json_object_get(et, "reason")),
                     "event_throughput did not run");
    json_decref(root);
    fixture_out_release(&o);
}
END_TEST

/* consumer_cost (issue 14) with --quick's tiny counts: every step made
 * its consumers, the servers saw them, and every message came through. */
START_TEST(test_consumer_cost_quick)
{
    const char *args[] = {"perf", "consumer_cost", "--quick", "--json", NULL};
    static const struct {
        int nodes, n;
        const char *design;
    } want[] = {{1, 5, "per-id"}, {1, 5, "one"}, {1, 20, "per-id"},
                {1, 20, "one"},   {3, 5, "per-id"}, {3, 5, "one"}};
    struct fixture_out o;
    json_t *root, *round, *steps;

    unsetenv("KSCORE_PERF_CC_R1");
    unsetenv("KSCORE_PERF_CC_R3");
    unsetenv("KSCORE_PERF_CC_IDLE_S");
    unsetenv("KSCORE_PERF_CC_STOP_S");
    root = run_perf(args, &o);
    ck_assert(json_is_true(json_object_get(root, "ok")));
    round = json_array_get(
        json_object_get(json_object_get(json_object_get(root, "scenarios"),
                                        "consumer_cost"),
                        "rounds"),
        0);
    steps = json_object_get(round, "steps");
    ck_assert_uint_eq(json_array_size(steps), 6);
    for (size_t i = 0; i < 6; i++) {
        json_t *s = json_array_get(steps, i);
        bool one = strcmp(want[i].design, "one") == 0;
        json_t *view = json_object_get(s, "server");
        ck_assert_msg(!json_object_get(s, "error"), "step %zu: %s", i,
                      json_string_value(json_object_get(s, "error")));
        ck_assert_str_eq(json_string_value(json_object_get(s, "design")),
                         want[i].design);
        ck_assert_int_eq(json_integer_value(json_object_get(s, "nodes")),
                         want[i].nodes);
        ck_assert_int_eq(json_integer_value(json_object_get(s, "n")),
                         want[i].n);
        ck_assert_int_eq(
            json_integer_value(json_object_get(s, "consumers_made")),
            one ? 1 : want[i].n);
        ck_assert_int_eq(json_integer_value(json_object_get(s, "delivered")),
                         want[i].n);
        ck_assert(json_is_number(json_object_get(s, "deliver_ms")));
        ck_assert(json_number_value(json_object_get(s, "create_p50_ms")) > 0);
        ck_assert(json_integer_value(json_object_get(s, "rss_idle_kb")) > 0);
        ck_assert(json_is_number(json_object_get(s, "cpu_idle_s")));
        ck_assert_uint_eq(
            json_array_size(json_object_get(s, "rss_idle_kb_nodes")),
            (size_t)want[i].nodes);
        /* every node holds a replica of each consumer (R = nodes) */
        ck_assert_uint_eq(json_array_size(view), (size_t)want[i].nodes);
        for (size_t k = 0; k < json_array_size(view); k++)
            ck_assert_int_eq(json_integer_value(json_object_get(
                                 json_array_get(view, k), "consumers")),
                             one ? 1 : want[i].n);
    }
    ck_assert(json_is_number(json_object_get(round, "r1_rss_kb_per_consumer")));
    ck_assert(json_is_object(json_object_get(round, "r3_extrapolated")));
    json_decref(root);
    fixture_out_release(&o);
}
END_TEST

START_TEST(test_usage)
{
    const char *args[] = {"perf", "no_such_scenario", NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(NULL, args, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert(strstr(o.err, "unknown scenario") != NULL);
    fixture_out_release(&o);
}
END_TEST

int
main(void)
{
    Suite *s = suite_create("perf");
    TCase *tc = tcase_create("smoke");
    SRunner *sr;
    int failed;

    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_usage);
    tcase_add_test(tc, test_quick_all);
    tcase_add_test(tc, test_ab_same_binary);
    tcase_add_test(tc, test_consumer_cost_quick);
    suite_add_tcase(s, tc);
    sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
