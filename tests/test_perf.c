/*
 * `kscore perf` smoke test: every scenario once with tiny counts (--quick)
 * through the real binary on its own private stack, and the JSON keys the
 * SLO report reads (perf/README.md). Correctness only: no timing asserts,
 * the numbers of a --quick run mean nothing.
 */
#include <check.h>
#include <jansson.h>
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
                          "event_throughput", "batch_exec_10", "sustained",
                          "--rounds",    "1",       "--quick",
                          "--duration",  "2",       "--json",
                          NULL};
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
    /* every scenario keeps its rounds and the spread of each metric */
    json_t *fl = json_object_get(json_object_get(root, "scenarios"), "floors");
    ck_assert_int_eq(json_array_size(json_object_get(fl, "rounds")), 1);
    ck_assert(json_object_get(json_object_get(fl, "spread"), "sum_us"));
    ck_assert(json_array_size(json_object_get(root, "targets")) > 0);
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

    tcase_set_timeout(tc, 180);
    tcase_add_test(tc, test_usage);
    tcase_add_test(tc, test_quick_all);
    tcase_add_test(tc, test_ab_same_binary);
    suite_add_tcase(s, tc);
    sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
