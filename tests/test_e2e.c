/*
 * End to end: the real kscore binary as broker, agent and client, against a
 * private nats-server and PostgreSQL, running real child processes.
 */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "store.h"

#define AGENT "e2e-agent"

static struct fixture_stack stack;

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, AGENT, 0) != 0) {
        fprintf(stderr, "cannot start the stack\n");
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

static json_t *
run_json(const char *const args[], struct fixture_out *o)
{
    json_error_t err;
    ck_assert_int_eq(fixture_kscore(&stack, args, o), 0);
    json_t *j = json_loads(o->out, 0, &err);
    ck_assert_msg(j != NULL, "not JSON: %s (stderr %s)", o->out, o->err);
    return j;
}

struct types_acc {
    char types[8][32];
    int64_t versions[8];
    int n;
};

static int
collect(const Ks__RecordedEvent *ev, void *ud)
{
    struct types_acc *a = ud;
    if (a->n < 8) {
        snprintf(a->types[a->n], sizeof(a->types[a->n]), "%s",
                 ev->event->type);
        a->versions[a->n] = ev->version;
        a->n++;
    }
    return 0;
}

START_TEST(exec_output_exit_code_and_events)
{
    struct fixture_out o;
    const char *args[] = {"exec",      "--agent", AGENT,
                          "--",        "sh",      "-c",
                          "echo out; echo err >&2; exit 3", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_str_eq(o.out, "out\n");
    ck_assert_str_eq(o.err, "err\n");
    ck_assert_int_eq(o.status, 3);
    fixture_out_release(&o);

    const char *jargs[] = {"exec",      "--agent", AGENT,  "--json",
                           "--",        "sh",      "-c",
                           "echo out; echo err >&2; exit 3", NULL};
    json_t *j = run_json(jargs, &o);
    ck_assert_int_eq(o.status, 3);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Failed");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "exit_code")), 3);
    ck_assert(json_is_null(json_object_get(j, "signal")));
    ck_assert(json_is_false(json_object_get(j, "timed_out")));
    ck_assert_str_eq(json_string_value(json_object_get(j, "stdout")), "out\n");
    ck_assert_str_eq(json_string_value(json_object_get(j, "stderr")), "err\n");
    ck_assert_str_eq(json_string_value(json_object_get(j, "stdout_base64")),
                     "b3V0Cg==");
    ck_assert_str_eq(json_string_value(json_object_get(j, "agent_id")), AGENT);
    ck_assert(json_is_string(json_object_get(j, "started_at")));
    ck_assert(json_is_string(json_object_get(j, "finished_at")));
    ck_assert(json_is_number(json_object_get(j, "duration_ms")));
    const char *id = json_string_value(json_object_get(j, "command_id"));
    ck_assert(id && ks_is_uuid(id));

    /* The record in PostgreSQL: versions 1..4, in order. */
    struct store *st = NULL;
    char stream[64];
    struct types_acc acc = {0};
    ck_assert_int_eq(store_open(stack.pg.conninfo, &st, NULL), 0);
    snprintf(stream, sizeof(stream), "command-%s", id);
    ck_assert_int_eq(store_read_stream(st, stream, 0, 0, collect, &acc), 0);
    ck_assert_int_eq(acc.n, 4);
    ck_assert_str_eq(acc.types[0], "CommandRequested");
    ck_assert_str_eq(acc.types[1], "CommandDispatched");
    ck_assert_str_eq(acc.types[2], "CommandStarted");
    ck_assert_str_eq(acc.types[3], "CommandCompleted");
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(acc.versions[i], i + 1);
    Ks__CommandView *v = NULL;
    ck_assert_int_eq(store_get_command(st, id, &v), 0);
    ck_assert_int_eq(v->status, KS__COMMAND_STATUS__FAILED);
    ks__command_view__free_unpacked(v, NULL);
    store_close(st);

    /* kscore events shows the same four. */
    fixture_out_release(&o);
    const char *eargs[] = {"events", id, "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, eargs, &o), 0);
    ck_assert_int_eq(o.status, 0);
    int lines = 0;
    for (char *p = o.out; (p = strchr(p, '\n')); p++)
        lines++;
    ck_assert_int_eq(lines, 4);
    ck_assert_ptr_nonnull(strstr(o.out, "\"version\":4"));
    ck_assert_ptr_nonnull(strstr(o.out, "CommandCompleted"));
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

START_TEST(exec_timeout_sends_term_to_group)
{
    struct fixture_out o;
    const char *args[] = {"exec",   "--agent", AGENT,   "--timeout", "1s",
                          "--grace", "1s",     "--json", "--",       "sleep",
                          "30",     NULL};
    json_t *j = run_json(args, &o);
    ck_assert_int_eq(o.status, 124);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "TimedOut");
    ck_assert(json_is_true(json_object_get(j, "timed_out")));
    ck_assert_int_eq(json_integer_value(json_object_get(j, "signal")),
                     SIGTERM);
    ck_assert(json_is_null(json_object_get(j, "exit_code")));
    double ms = json_number_value(json_object_get(j, "duration_ms"));
    ck_assert_msg(ms > 900 && ms < 1400, "duration %.1f ms", ms);
    ck_assert_msg(o.seconds < 3.0, "client took %.2f s", o.seconds);
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

START_TEST(binary_output_round_trips)
{
    struct fixture_out o;
    const char *args[] = {
        "exec", "--agent", AGENT, "--json", "--", "sh", "-c",
        "printf 'ok\\377\\376\\000end\\n'; printf '\\300\\200' >&2; exit 3",
        NULL};
    json_t *j = run_json(args, &o);
    ck_assert_int_eq(o.status, 3);
    ck_assert(json_is_null(json_object_get(j, "stdout")));
    /* 6f 6b ff fe 00 65 6e 64 0a and c0 80 */
    ck_assert_str_eq(json_string_value(json_object_get(j, "stdout_base64")),
                     "b2v//gBlbmQK");
    ck_assert_str_eq(json_string_value(json_object_get(j, "stderr_base64")),
                     "wIA=");
    char id[40];
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    fixture_out_release(&o);

    const char *gargs[] = {"get", id, "--json", NULL};
    j = run_json(gargs, &o);
    ck_assert_str_eq(json_string_value(json_object_get(j, "stdout_base64")),
                     "b2v//gBlbmQK");
    ck_assert_str_eq(json_string_value(json_object_get(j, "stderr_base64")),
                     "wIA=");
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Failed");
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

static void
expect_failure(const char *const args[], int status, const char *needle)
{
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == status, "exit %d, want %d; stderr: %s",
                  o.status, status, o.err);
    ck_assert_msg(strstr(o.err, needle) != NULL, "stderr lacks '%s': %s",
                  needle, o.err);
    /* one clear line */
    ck_assert_msg(strchr(o.err, '\n') == o.err + strlen(o.err) - 1,
                  "more than one line: %s", o.err);
    ck_assert_msg(o.seconds < 10.0, "took %.2f s", o.seconds);
    fixture_out_release(&o);
}

START_TEST(bad_inputs_are_refused_clearly)
{
    expect_failure((const char *const[]){"exec", "--agent", "no-such-agent",
                                         "--", "true", NULL},
                   125, "unknown agent 'no-such-agent'");
    expect_failure((const char *const[]){"exec", "--agent", AGENT, "--",
                                         NULL},
                   2, "no command given");
    expect_failure((const char *const[]){"exec", "--agent", AGENT,
                                         "--timeout", "soon", "--", "true",
                                         NULL},
                   2, "bad duration 'soon'");
    expect_failure((const char *const[]){"exec", "--agent", AGENT, "true",
                                         NULL},
                   2, "missing --");
    /* A usage error, said before anything is sent (docs/operating.md
     * "Exit codes":
     * 2; issue 24: it was the broker's refusal, 125). */
    expect_failure((const char *const[]){"exec", "--agent", "bad.id", "--",
                                         "true", NULL},
                   2, "bad agent id 'bad.id'");
    expect_failure((const char *const[]){"exec", "--nats",
                                         "nats://127.0.0.1:1", "--agent",
                                         AGENT, "--", "true", NULL},
                   125, "cannot connect to NATS at nats://127.0.0.1:1");
    /* Bad variable names are usage errors, said before anything is sent
     * (the broker refuses them too: a request that is not kscore's). */
    expect_failure((const char *const[]){"exec", "--agent", AGENT, "--env",
                                         "A B=1", "--", "true", NULL},
                   2, "bad --env name 'A B'");
    expect_failure((const char *const[]){"exec", "--agent", AGENT, "--env",
                                         "KSCORE_COMMAND_ID=x", "--", "true",
                                         NULL},
                   2, "not KSCORE_*");
    expect_failure((const char *const[]){"cancel", "nosuch", NULL}, 2,
                   "not a command id");
    /* An idempotency key names one command: another one is refused. */
    struct fixture_out o;
    const char *k1[] = {"exec", "--agent", AGENT, "--idempotency-key",
                        "e2e-key", "--", "echo", "first", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, k1, &o), 0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
    ck_assert_int_eq(fixture_kscore(&stack, k1, &o), 0);
    ck_assert_str_eq(o.out, "first\n"); /* the first result, not a rerun */
    fixture_out_release(&o);
    expect_failure((const char *const[]){"exec", "--agent", AGENT,
                                         "--idempotency-key", "e2e-key", "--",
                                         "echo", "second", NULL},
                   125, "idempotency key already used");
    expect_failure((const char *const[]){"broker", "--nats", stack.nats.url,
                                         "--db",
                                         "host=/nonexistent-kscore port=1 "
                                         "dbname=kscore connect_timeout=2",
                                         NULL},
                   125, "broker:");
}
END_TEST

/* Runs cmd with sh; what it writes on stdout (it redirects what else it
 * wants there) into got (cap bytes, NUL-terminated, the rest read and
 * dropped). Returns the status as pclose(3) gives it. */
static int
sh_capture(const char *cmd, char *got, size_t cap)
{
    FILE *p = popen(cmd, "r");
    char sink[4096];
    size_t n = 0, r;
    ck_assert_ptr_nonnull(p);
    while (n + 1 < cap && (r = fread(got + n, 1, cap - 1 - n, p)) > 0)
        n += r;
    got[n] = '\0';
    while (fread(sink, 1, sizeof(sink), p) > 0)
        ;
    return pclose(p);
}

/*
 * A reader that goes away: `kscore exec -- seq 1 200000 | head -2` dies of
 * SIGPIPE, as cat and ssh do (the shell sees 141 and prints nothing); on
 * cf06db5 it exited 125 "cannot write the output: Broken pipe" (issue 24).
 */
START_TEST(exec_into_a_closed_pipe_dies_of_sigpipe)
{
    char cmd[8192], got[4096];
    snprintf(cmd, sizeof(cmd),
             "KSCORE_HOME=/nonexistent-kscore-home KSCORE_NATS_URL='%s' "
             "bash -c '\"%s\" exec --agent %s -- seq 1 200000 | head -2 "
             ">/dev/null; echo \"${PIPESTATUS[0]}\"' 2>&1",
             stack.nats.url, getenv("KSCORE_BIN"), AGENT);
    ck_assert_int_eq(sh_capture(cmd, got, sizeof(got)), 0);
    ck_assert_msg(strcmp(got, "141\n") == 0,
                  "exec into a closed pipe: %s", got);
}
END_TEST

/*
 * `kscore exec` loads what an operator's request needs and nothing only
 * the daemons use (issue 23: 31 shared libraries, 7x the CPU of an empty
 * C program): no libpq and its LDAP, Kerberos and GnuTLS chain, no
 * libmicrohttpd, no inih. ld.so says what it loads (LD_DEBUG=files,
 * ld.so(8)), dlopen()s included; on 9d94e2b kscore loaded every one.
 */
START_TEST(exec_loads_nothing_only_the_daemons_use)
{
    static const char *const daemons_only[] = {
        "libpq.so", "libmicrohttpd.so", "libinih.so", "libldap",
        "libgnutls.so", "libkrb5.so", "libsasl2.so"};
    static char got[1 << 20];
    char cmd[8192];
    /* ld.so writes on stderr: into the pipe, and kscore's stdout away. */
    snprintf(cmd, sizeof(cmd),
             "LD_DEBUG=files KSCORE_HOME=/nonexistent-kscore-home "
             "KSCORE_NATS_URL='%s' '%s' exec --agent %s -- true "
             "2>&1 >/dev/null",
             stack.nats.url, getenv("KSCORE_BIN"), AGENT);
    int st = sh_capture(cmd, got, sizeof(got));
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "kscore exec -- true: status %d", st);
    /* The output is ld.so's: it names what kscore does need. */
    ck_assert_msg(strstr(got, "libnats.so"), "no LD_DEBUG output: %.400s",
                  got);
    for (size_t i = 0; i < sizeof(daemons_only) / sizeof(daemons_only[0]);
         i++)
        ck_assert_msg(!strstr(got, daemons_only[i]),
                      "kscore exec loaded %s", daemons_only[i]);
}
END_TEST

START_TEST(start_failure_is_not_an_exit_code)
{
    struct fixture_out o;
    const char *args[] = {"exec", "--agent", AGENT, "--json", "--cwd",
                          "/nonexistent-3016", "--", "ls", NULL};
    json_t *j = run_json(args, &o);
    ck_assert_int_eq(o.status, 126);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "StartFailed");
    ck_assert_str_eq(json_string_value(json_object_get(j, "start_stage")),
                     "chdir");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "start_errno")),
                     ENOENT);
    ck_assert(json_is_null(json_object_get(j, "exit_code")));
    char id[40];
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    fixture_out_release(&o);

    /* No CommandStarted: the precheck failed before the claim. */
    const char *eargs[] = {"events", id, "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, eargs, &o), 0);
    ck_assert_ptr_null(strstr(o.out, "CommandStarted"));
    ck_assert_ptr_nonnull(strstr(o.out, "CommandStartFailed"));
    fixture_out_release(&o);

    const char *nargs[] = {"exec", "--agent", AGENT, "--",
                           "/nonexistent/cmd", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, nargs, &o), 0);
    ck_assert_int_eq(o.status, 127);
    ck_assert_ptr_nonnull(strstr(o.err, "cannot start /nonexistent/cmd"));
    fixture_out_release(&o);
}
END_TEST

static Suite *
e2e_suite(void)
{
    Suite *s = suite_create("e2e");
    TCase *tc = tcase_create("exec");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, exec_output_exit_code_and_events);
    tcase_add_test(tc, exec_timeout_sends_term_to_group);
    tcase_add_test(tc, binary_output_round_trips);
    tcase_add_test(tc, bad_inputs_are_refused_clearly);
    tcase_add_test(tc, start_failure_is_not_an_exit_code);
    tcase_add_test(tc, exec_into_a_closed_pipe_dies_of_sigpipe);
    tcase_add_test(tc, exec_loads_nothing_only_the_daemons_use);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(e2e_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
