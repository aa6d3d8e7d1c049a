/*
 * BatchExecuteCommand end to end: `kscore batch` against a broker with 10
 * in-process agents (and agent processes where a test needs to stop one).
 */
#include <check.h>
#include <dirent.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "fixture.h"
#include "stack.h"

static struct fixture_stack stack;

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, NULL, 10) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

/* Runs kscore batch --json ARGS; returns the summary (last line). */
static json_t *
batch_json(const char *const args[], struct fixture_out *o)
{
    const char *full[64] = {"batch", "--json"};
    size_t n = 2;
    for (size_t i = 0; args[i] && n < 63; i++)
        full[n++] = args[i];
    full[n] = NULL;
    ck_assert_int_eq(fixture_kscore(&stack, full, o), 0);
    char *last = NULL;
    for (char *p = o->out; *p;) {
        char *nl = strchr(p, '\n');
        if (!nl)
            break;
        if (nl[1])
            last = nl + 1;
        p = nl + 1;
    }
    if (!last)
        last = o->out;
    json_t *j = json_loads(last, JSON_DISABLE_EOF_CHECK, NULL);
    ck_assert_msg(j != NULL, "no JSON summary: %s / %s", o->out, o->err);
    return j;
}

static int
count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static long
jint(json_t *j, const char *k)
{
    return (long)json_integer_value(json_object_get(j, k));
}

START_TEST(batch_over_10_local_agents)
{
    struct fixture_out o;
    const char *args[] = {"--select", "local=true", "--", "sh", "-c",
                          "echo from $KSCORE_AGENT_ID", NULL};
    json_t *j = batch_json(args, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Succeeded");
    ck_assert_int_eq(jint(j, "total"), 10);
    ck_assert_int_eq(jint(j, "succeeded"), 10);
    /* one JSON line per target, then the summary */
    ck_assert_int_eq(count_lines(o.out), 11);
    char host[64], want[96];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    for (int i = 0; i < 10; i++) {
        snprintf(want, sizeof(want), "\"stdout\":\"from %s-%d\\n\"", host, i);
        ck_assert_msg(strstr(o.out, want), "missing %s in %s", want, o.out);
    }
    json_decref(j);
    fixture_out_release(&o);

    /* The table and the grouped outputs. */
    const char *targs[] = {"batch", "--select", "local=true", "--", "echo",
                           "same", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, targs, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_ptr_nonnull(strstr(o.out, "AGENT"));
    ck_assert_ptr_nonnull(strstr(o.out, " (10)\n---------------\nsame\n"));
    fixture_out_release(&o);
}
END_TEST

START_TEST(select_without_match_is_an_error)
{
    struct fixture_out o;
    const char *args[] = {"batch", "--select", "role=nothing", "--", "true",
                          NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_ptr_nonnull(strstr(o.err, "matched no online agent"));
    fixture_out_release(&o);
    const char *args2[] = {"batch", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
}
END_TEST

/* Odd-numbered local agents fail: 5 of 10. */
#define FAIL_ODD "case $KSCORE_AGENT_ID in *[13579]) exit 1;; esac; sleep 0.1"

START_TEST(max_errors_stops_dispatching)
{
    struct fixture_out o;
    const char *args[] = {"--select", "local=true", "--max-concurrency", "2",
                          "--max-errors", "2", "--", "sh", "-c", FAIL_ODD,
                          NULL};
    json_t *j = batch_json(args, &o);
    ck_assert_int_eq(o.status, 1);
    long failed = jint(j, "failed"), cancelled = jint(j, "cancelled");
    long succeeded = jint(j, "succeeded");
    /* No more than the budget plus what was in flight when it was spent. */
    ck_assert_int_le(failed, 2 + 2 - 1);
    ck_assert_int_ge(failed, 2);
    ck_assert_int_gt(cancelled, 0);
    ck_assert_int_eq(failed + cancelled + succeeded, 10);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "PartialFailure");
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

START_TEST(strict_errors_never_exceed_budget)
{
    struct fixture_out o;
    const char *args[] = {"--select",      "local=true", "--max-errors", "2",
                          "--strict-errors", "--",       "sh",           "-c",
                          FAIL_ODD,        NULL};
    json_t *j = batch_json(args, &o);
    ck_assert_int_eq(o.status, 1);
    ck_assert_int_le(jint(j, "failed"), 2);
    ck_assert_int_eq(jint(j, "failed") + jint(j, "cancelled") +
                         jint(j, "succeeded"),
                     10);
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

/* --max-concurrency 3 never has more than 3 targets running at once, read
 * from the events' times: [CommandRequested, terminal] per target. */
START_TEST(max_concurrency_holds)
{
    struct fixture_out o;
    const char *args[] = {"--select", "local=true", "--max-concurrency", "3",
                          "--", "sleep", "0.2", NULL};
    json_t *j = batch_json(args, &o);
    ck_assert_int_eq(o.status, 0);
    char sql[512];
    snprintf(sql, sizeof(sql),
             "WITH iv AS (SELECT e.stream_id,"
             " min(e.recorded_at) FILTER (WHERE e.type='CommandRequested') s,"
             " max(e.recorded_at) FILTER (WHERE e.type='CommandCompleted') f"
             " FROM events e JOIN commands c ON e.stream_id = 'command-' ||"
             " c.command_id WHERE c.batch_id = '%s' GROUP BY e.stream_id)"
             " SELECT max((SELECT count(*) FROM iv b WHERE b.s <= a.s AND"
             " b.f > a.s)), count(*) FROM iv a",
             json_string_value(json_object_get(j, "batch_id")));
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    PGresult *r = PQexec(pg, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s",
                  PQerrorMessage(pg));
    ck_assert_int_eq(atoi(PQgetvalue(r, 0, 1)), 10);
    int peak = atoi(PQgetvalue(r, 0, 0));
    ck_assert_msg(peak >= 2 && peak <= 3, "peak concurrency %d", peak);
    PQclear(r);
    PQfinish(pg);
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

static int
sleeps_left(const char *needle)
{
    DIR *d = opendir("/proc");
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d))) {
        char path[300], buf[256];
        snprintf(path, sizeof(path), "/proc/%s/cmdline", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        size_t len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        for (size_t i = 0; i < len; i++)
            if (!buf[i])
                buf[i] = ' ';
        buf[len] = '\0';
        if (strstr(buf, needle) && strncmp(buf, "sleep", 5) == 0)
            n++;
    }
    if (d)
        closedir(d);
    return n;
}

START_TEST(cancel_in_the_middle)
{
    struct fixture_out o;
    const char *args[] = {"batch",  "--select", "local=true",
                          "--max-concurrency", "2", "--detach", "--",
                          "sleep",  "3517",     NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_int_eq(o.status, 0);
    char id[64];
    snprintf(id, sizeof(id), "%.*s", (int)strcspn(o.out, "\n"), o.out);
    fixture_out_release(&o);
    ck_assert_msg(strncmp(id, "batch-", 6) == 0, "id %s", id);
    nanosleep(&(struct timespec){1, 0}, NULL);
    ck_assert_int_eq(sleeps_left("3517"), 2);
    const char *cargs[] = {"cancel", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, cargs, &o), 0);
    ck_assert_msg(o.status == 0, "cancel: %s", o.err);
    fixture_out_release(&o);
    /* The batch ends Cancelled, every target terminal. */
    const char *gargs[] = {"get", id, "--json", NULL};
    json_t *j = NULL;
    for (int i = 0; i < 100; i++) {
        ck_assert_int_eq(fixture_kscore(&stack, gargs, &o), 0);
        j = json_loads(o.out, 0, NULL);
        fixture_out_release(&o);
        if (j && strcmp(json_string_value(json_object_get(j, "status")),
                        "Running") != 0)
            break;
        json_decref(j);
        j = NULL;
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    }
    ck_assert_ptr_nonnull(j);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Cancelled");
    ck_assert_int_eq(jint(j, "cancelled") + jint(j, "failed"), 10);
    ck_assert_int_eq(jint(j, "pending") + jint(j, "running"), 0);
    json_decref(j);
    ck_assert_int_eq(sleeps_left("3517"), 0);
}
END_TEST

/* K27: one dead agent costs the batch its delivery deadline, no more. */
START_TEST(k27_dead_agent_costs_its_deadline)
{
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-a", "k27a", NULL), 0);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-b", "k27b", NULL), 0);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-c", "k27c", NULL), 0);
    stack_stop(stack.dir, "agent-b", 20000);
    struct fixture_out o;
    const char *args[] = {"batch", "--agents", "k27a,k27b,k27c",
                          "--max-concurrency", "1", "--deliver-within", "5s",
                          "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_int_eq(o.status, 1);
    ck_assert_msg(o.seconds > 4.5 && o.seconds < 7.0, "took %.2f s",
                  o.seconds);
    ck_assert_ptr_nonnull(strstr(o.out, "k27b"));
    ck_assert_ptr_nonnull(strstr(o.out, "Undeliverable"));
    ck_assert_ptr_nonnull(strstr(o.out, "PartialFailure"));
    /* a and c succeeded */
    char *a = strstr(o.out, "k27a "), *c = strstr(o.out, "k27c ");
    ck_assert(a && c);
    ck_assert_ptr_nonnull(strstr(a, "Succeeded"));
    ck_assert(strstr(a, "Succeeded") < strstr(a, "\n"));
    ck_assert(strstr(c, "Succeeded") < strstr(c, "\n"));
    fixture_out_release(&o);
    stack_stop(stack.dir, "agent-a", 20000);
    stack_stop(stack.dir, "agent-c", 20000);
}
END_TEST

static Suite *
batch_suite(void)
{
    Suite *s = suite_create("batch");
    TCase *tc = tcase_create("batch");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, batch_over_10_local_agents);
    tcase_add_test(tc, select_without_match_is_an_error);
    tcase_add_test(tc, max_errors_stops_dispatching);
    tcase_add_test(tc, strict_errors_never_exceed_budget);
    tcase_add_test(tc, max_concurrency_holds);
    tcase_add_test(tc, cancel_in_the_middle);
    tcase_add_test(tc, k27_dead_agent_costs_its_deadline);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(batch_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
