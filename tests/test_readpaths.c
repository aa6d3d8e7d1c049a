/*
 * Read paths and messages an operator meets in the first week (issue 24):
 * `events --follow` starts at now (--since, --from-start), operator and
 * agent streams are readable under the read policy, the progress bar is
 * never glued to other output on a terminal, the confirmation shows the
 * whole command and its targets, `exec` says at once what it waits for,
 * and denials and id limits say what was wrong. The real kscore binary
 * against private servers; terminal behaviour through a pseudo-terminal
 * (fixture_kscore_spawn), checked on what the terminal shows.
 */
#include <check.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "fixture.h"
#include "stack.h"

#define AGENT "rp-a"
#define N_LOCAL 4

static struct fixture_stack stack;
static char host[64];

static void
host_name(void)
{
    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    host[strcspn(host, ".")] = '\0';
}

static void
stack_up(void)
{
    host_name();
    if (fixture_stack_start(&stack, AGENT, N_LOCAL) != 0) {
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

static void
sleep_ms(int ms)
{
    nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L},
              NULL);
}

/* Runs a command on agent to its end (exec --json); its id into id. */
static void
run_to_end(const char *agent, const char *script, char id[40])
{
    const char *args[] = {"exec", "--agent", agent, "--json", "--",
                          "sh",   "-c",      script, NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    json_t *j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j != NULL, "not JSON: %s (%s)", o.out, o.err);
    snprintf(id, 40, "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    fixture_out_release(&o);
}

/* The lines of out (one JSON object each) whose command_id is id. */
static size_t
lines_of(const char *out, const char *id)
{
    size_t n = 0;
    char needle[64];
    snprintf(needle, sizeof(needle), "\"command_id\":\"%s\"", id);
    for (const char *p = out; (p = strstr(p, needle)); p++)
        n++;
    return n;
}

/* Collects what p writes for ms. */
static void
collect(struct fixture_proc *p, int ms)
{
    (void)fixture_proc_expect(p, "\001(nothing)\001", ms);
}

/* ---- events --follow, --since, --from-start ------------------------------ */

/*
 * `events --follow` without an id printed the whole history first. It
 * starts at now: nothing recorded before it shows, and every event of a
 * command run after it does, in order.
 */
START_TEST(events_follow_starts_at_now)
{
    char old[40], probe[40] = "", after[40];
    const char *args[] = {"events", "--follow", "--json", NULL};
    struct fixture_proc p;

    run_to_end(AGENT, "echo before", old);
    ck_assert_int_eq(fixture_kscore_spawn(&stack, args, false, &p), 0);
    /* When it has started is not known from outside: run commands until
     * one shows up (each ends before the next starts). */
    for (int i = 0; i < 40; i++) {
        run_to_end(AGENT, "true", probe);
        char needle[64];
        snprintf(needle, sizeof(needle), "\"command_id\":\"%s\"", probe);
        if (fixture_proc_expect(&p, needle, 500) == 0)
            break;
        probe[0] = '\0';
    }
    ck_assert_msg(probe[0], "the follower showed no new command: %s %s",
                  p.out ? p.out : "", p.err ? p.err : "");
    run_to_end(AGENT, "echo after", after);
    for (int i = 0; i < 75 && lines_of(p.out ? p.out : "", after) < 4; i++)
        collect(&p, 200);
    ck_assert_int_eq(fixture_proc_wait(&p, SIGTERM, 10000), 128 + SIGTERM);
    ck_assert_msg(lines_of(p.out, old) == 0,
                  "history before the follow was printed: %.400s", p.out);
    /* Every event of the command after it, in the order recorded. */
    const char *want[] = {"CommandRequested", "CommandDispatched",
                          "CommandStarted", "CommandCompleted"};
    const char *at = p.out;
    for (size_t i = 0; i < 4; i++) {
        char line[160];
        snprintf(line, sizeof(line), "\"type\":\"%s\"", want[i]);
        const char *hit = NULL;
        for (const char *q = at; (q = strstr(q, line)); q++) {
            const char *eol = strchr(q, '\n');
            const char *bol = q;
            while (bol > p.out && bol[-1] != '\n')
                bol--;
            char *l = strndup(bol, eol ? (size_t)(eol - bol) : strlen(bol));
            bool mine = lines_of(l, after) == 1;
            free(l);
            if (mine) {
                hit = q;
                break;
            }
        }
        ck_assert_msg(hit, "no %s of %s after %zu: %s", want[i], after, i,
                      p.out);
        at = hit;
    }
    fixture_proc_release(&p);
}
END_TEST

/*
 * --since T starts after the last event recorded before T (a duration
 * back or an RFC 3339 time); --from-start at the first event; without
 * --follow they print what is recorded and exit.
 */
START_TEST(events_since_and_from_start)
{
    char a[40], b[40], since[64];
    struct fixture_out o;

    run_to_end(AGENT, "echo a", a);
    /* T after a's end (its events are recorded when exec returns), and
     * b begins after T: one clock, the database's and this host's. */
    sleep_ms(50);
    int64_t t = ks_now_us();
    time_t secs = (time_t)(t / 1000000);
    struct tm tm;
    gmtime_r(&secs, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(since, sizeof(since), "%s.%06ldZ", base, (long)(t % 1000000));
    sleep_ms(50);
    run_to_end(AGENT, "echo b", b);

    const char *s1[] = {"events", "--since", since, "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, s1, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_msg(lines_of(o.out, a) == 0, "a before --since: %s", o.out);
    ck_assert_msg(lines_of(o.out, b) == 4, "b's 4 events: %s", o.out);
    fixture_out_release(&o);

    const char *s2[] = {"events", "--since", "1h", "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, s2, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_msg(lines_of(o.out, a) == 4 && lines_of(o.out, b) == 4, "%s",
                  o.out);
    fixture_out_release(&o);

    const char *s3[] = {"events", "--from-start", "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, s3, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_msg(lines_of(o.out, a) == 4 && lines_of(o.out, b) == 4, "%s",
                  o.out);
    fixture_out_release(&o);

    /* --follow --since: b's events, then it goes on. */
    const char *s4[] = {"events", "--follow", "--since", since, "--json",
                        NULL};
    struct fixture_proc p;
    ck_assert_int_eq(fixture_kscore_spawn(&stack, s4, false, &p), 0);
    char needle[64];
    snprintf(needle, sizeof(needle), "\"command_id\":\"%s\"", b);
    ck_assert_int_eq(fixture_proc_expect(&p, needle, 15000), 0);
    ck_assert_int_eq(fixture_proc_wait(&p, SIGTERM, 10000), 128 + SIGTERM);
    ck_assert_msg(lines_of(p.out, a) == 0, "%s", p.out);
    fixture_proc_release(&p);

    /* Usage: one start, and none with an id. */
    const char *u1[] = {"events", "--since", "1h", "--from-start", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, u1, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
    const char *u2[] = {"events", b, "--since", "1h", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, u2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
    const char *u3[] = {"events", "--since", "yesterday-ish", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, u3, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_ptr_nonnull(strstr(o.err, "bad --since"));
    fixture_out_release(&o);
}
END_TEST

/* ---- what a terminal shows ----------------------------------------------- */

/*
 * The lines a terminal shows after bytes, as a terminal draws them:
 * printable bytes at the cursor (overwriting), \r to column 0, \033[K
 * erases to the end of the line, \n ends the line; other escapes are
 * dropped. Returns a malloc'd array of malloc'd lines, NULL-terminated.
 */
static char **
screen_lines(const char *bytes)
{
    size_t cap = 64, n = 0, col = 0, len = 0;
    char **lines = calloc(cap, sizeof(*lines));
    char cur[4096];
    for (const char *p = bytes; *p; p++) {
        if (*p == '\r') {
            col = 0;
        } else if (*p == '\n') {
            if (n + 2 >= cap)
                lines = realloc(lines, (cap *= 2) * sizeof(*lines));
            lines[n++] = strndup(cur, len);
            len = col = 0;
        } else if (*p == '\033' && p[1] == '[') {
            const char *q = p + 2;
            while (*q && (*q < '@' || *q > '~'))
                q++;
            if (*q == 'K')
                len = col < len ? col : len;
            p = *q ? q : q - 1;
        } else if (col < sizeof(cur) - 1) {
            cur[col++] = *p;
            if (col > len)
                len = col;
        }
    }
    if (len) {
        lines[n++] = strndup(cur, len);
    }
    lines[n] = NULL;
    return lines;
}

static void
screen_free(char **lines)
{
    for (size_t i = 0; lines && lines[i]; i++)
        free(lines[i]);
    free(lines);
}

/* The bar's mark: "] <done>/<total> " after its 20 cells. */
static bool
has_bar(const char *s)
{
    for (const char *b = s; (b = strchr(b, '[')); b++)
        if (strspn(b + 1, "#.") == 20 && b[21] == ']')
            return true;
    return false;
}

/*
 * The progress bar was drawn and then `--stream` lines were written after
 * it on the same line ("[###...] 1/4 ...  2.0/shost-0: line3"). Every line
 * the terminal shows is a stream line, the bar, or kscore's own: never a
 * line with both.
 */
START_TEST(progress_bar_never_glued_to_stream_lines)
{
    char agents[512] = "";
    for (int i = 0; i < N_LOCAL; i++) {
        size_t u = strlen(agents);
        snprintf(agents + u, sizeof(agents) - u, "%s%s-%d", i ? "," : "",
                 host, i);
    }
    const char *args[] = {"batch",
                          "--agents",
                          agents,
                          "--stream",
                          "--",
                          "sh",
                          "-c",
                          "for i in 1 2 3 4 5 6 7 8; do echo line$i; "
                          "sleep 0.4; done",
                          NULL};
    struct fixture_proc p;
    ck_assert_int_eq(fixture_kscore_spawn(&stack, args, true, &p), 0);
    int st = fixture_proc_wait(&p, 0, 60000);
    ck_assert_msg(st == 0, "exit %d: %s", st, p.out);
    /* The bar was shown while lines came (else this proves nothing). */
    ck_assert_msg(has_bar(p.out), "no progress bar drawn: %s", p.out);
    char **lines = screen_lines(p.out);
    size_t streamed = 0;
    for (size_t i = 0; lines[i]; i++) {
        const char *l = lines[i];
        const char *hit = strstr(l, ": line");
        if (!hit)
            continue;
        streamed++;
        ck_assert_msg(strncmp(l, host, strlen(host)) == 0 && !has_bar(l),
                      "glued on the terminal: \"%s\"", l);
    }
    ck_assert_int_eq(streamed, 8 * N_LOCAL);
    screen_free(lines);
    fixture_proc_release(&p);
}
END_TEST

/* Ctrl-C's message was written after the bar, on its line. */
START_TEST(progress_bar_never_glued_to_the_ctrl_c_message)
{
    char agents[256];
    snprintf(agents, sizeof(agents), "%s-0,%s-1", host, host);
    const char *args[] = {"batch", "--agents", agents, "--", "sleep", "30",
                          NULL};
    struct fixture_proc p;
    ck_assert_int_eq(fixture_kscore_spawn(&stack, args, true, &p), 0);
    ck_assert_int_eq(fixture_proc_expect(&p, "] 0/2", 20000), 0);
    ck_assert_int_eq(fixture_proc_write(&p, "\x03"), 0);
    ck_assert_int_eq(fixture_proc_expect(&p, "cancelling", 20000), 0);
    int st = fixture_proc_wait(&p, 0, 60000);
    ck_assert_msg(st == 130, "exit %d: %s", st, p.out);
    char **lines = screen_lines(p.out);
    bool seen = false;
    for (size_t i = 0; lines[i]; i++) {
        if (!strstr(lines[i], "cancelling"))
            continue;
        seen = true;
        ck_assert_msg(strncmp(lines[i], "kscore: cancelling", 18) == 0,
                      "glued on the terminal: \"%s\"", lines[i]);
    }
    ck_assert(seen);
    screen_free(lines);
    fixture_proc_release(&p);
}
END_TEST

/*
 * The confirmation showed `sh ...` and a count: it shows the whole
 * command, quoted as a shell reads it back, and the targets folded.
 */
START_TEST(confirmation_shows_the_command_and_its_targets)
{
    const char *args[] = {"batch", "--all", "--env", "MODE=fast", "--",
                          "sh",    "-c",    "echo \"a b\"; uptime", NULL};
    struct fixture_proc p;
    char set[128];
    ck_assert_int_eq(fixture_kscore_spawn(&stack, args, true, &p), 0);
    ck_assert_int_eq(fixture_proc_expect(&p, "[y/N]", 30000), 0);
    ck_assert_msg(strstr(p.out, "sh -c 'echo \"a b\"; uptime'") != NULL,
                  "no whole command: %s", p.out);
    snprintf(set, sizeof(set), "%s-[0-%d]", host, N_LOCAL - 1);
    ck_assert_msg(strstr(p.out, set) && strstr(p.out, AGENT),
                  "no folded targets %s: %s", set, p.out);
    ck_assert_msg(strstr(p.out, "MODE=fast"), "no env: %s", p.out);
    ck_assert_int_eq(fixture_proc_write(&p, "n\n"), 0);
    ck_assert_int_eq(fixture_proc_wait(&p, 0, 20000), 2);
    ck_assert_ptr_nonnull(strstr(p.out, "not confirmed"));
    fixture_proc_release(&p);
}
END_TEST

/*
 * `batch --detach --json` and `get batch-... --json` of a running batch
 * said "exit_code":4 (some never ran): it has no exit code yet.
 */
START_TEST(running_batch_has_no_exit_code_yet)
{
    char agent0[96];
    struct fixture_out o;
    /* Its target runs until a get has seen it Running: with `sleep 2` a
     * loaded machine could end it before the first get. */
    struct fixture_gate gate;
    fixture_gate_init(&gate, stack.dir, "running-batch");
    snprintf(agent0, sizeof(agent0), "%s-0", host);
    const char *args[] = {"batch", "--agents", agent0, "--detach", "--json",
                          "--",    "sh",       "-c",   gate.sh, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    json_t *j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j, "not JSON: %s", o.out);
    char id[64];
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "batch_id")));
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Running");
    ck_assert_msg(json_is_null(json_object_get(j, "exit_code")), "%s", o.out);
    json_decref(j);
    fixture_out_release(&o);

    const char *get[] = {"get", id, "--json", NULL};
    bool ended = false, running_seen = false;
    for (int i = 0; i < 200 && !ended; i++) {
        ck_assert_int_eq(fixture_kscore(&stack, get, &o), 0);
        ck_assert_int_eq(o.status, 0);
        j = json_loads(o.out, 0, NULL);
        ck_assert_msg(j, "not JSON: %s", o.out);
        const char *st = json_string_value(json_object_get(j, "status"));
        json_t *code = json_object_get(j, "exit_code");
        if (strcmp(st, "Running") == 0) {
            running_seen = true;
            ck_assert_msg(json_is_null(code), "running: %s", o.out);
            fixture_gate_open(&gate);
        } else {
            ended = true;
            ck_assert_int_eq(json_integer_value(code), 0);
        }
        json_decref(j);
        fixture_out_release(&o);
        if (!ended)
            sleep_ms(100);
    }
    ck_assert(running_seen && ended);
}
END_TEST

/*
 * An argument with a newline or an escape sequence was printed raw in
 * quotes (the line broken, or the terminal driven) or as '?': get, list
 * and the confirmation write it as a shell reads it back, $'...'.
 */
START_TEST(control_characters_in_argv_are_quoted)
{
    char id[40];
    struct fixture_out o;
    const char *args[] = {"exec", "--agent", AGENT, "--json", "--",
                          "printf", "%s", "x\ny\033[2J", NULL};
    const char *want = "printf %s $'x\\ny\\x1b[2J'";
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_int_eq(o.status, 0);
    json_t *j = json_loads(o.out, 0, NULL);
    ck_assert_ptr_nonnull(j);
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    fixture_out_release(&o);
    const char *g[] = {"get", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, g, &o), 0);
    ck_assert_msg(strstr(o.out, want), "get: %s", o.out);
    fixture_out_release(&o);
    const char *l[] = {"list", "--agent", AGENT, "--limit", "1", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, l, &o), 0);
    ck_assert_msg(strstr(o.out, want), "list: %s", o.out);
    ck_assert_msg(!strchr(o.out, '\033'), "list: %s", o.out);
    fixture_out_release(&o);
}
END_TEST

/*
 * A waiting exec whose broker died said nothing until it gave up or the
 * broker came back. It says that no broker answers about its recorded
 * command, and when one answers again; the result still comes.
 */
START_TEST(exec_says_when_no_broker_answers_about_its_command)
{
    /* Running when the broker is back (the note comes at the next ask,
     * 5 s after the kill, and the one after, at 10 s, reaches the new
     * broker): it waits at a gate opened then. It was `sleep 16` and a
     * kill 1.5 s after the spawn: a loaded machine could kill the broker
     * before the command was recorded (no note about it), or end it
     * before the broker was back. */
    struct fixture_gate gate;
    char script[sizeof(gate.sh) + 32], running[PATH_MAX + 256];
    fixture_gate_init(&gate, stack.dir, "no-broker");
    snprintf(script, sizeof(script), "%s; echo done", gate.sh);
    snprintf(running, sizeof(running),
             "SELECT count(*) FROM commands WHERE status = 'Running' AND "
             "array_to_string(argv, ' ') LIKE '%%%s%%'",
             gate.path);
    const char *args[] = {"exec", "--agent", AGENT, "--", "sh", "-c",
                          script, NULL};
    struct fixture_proc p;
    ck_assert_int_eq(fixture_kscore_spawn(&stack, args, false, &p), 0);
    ck_assert_int_eq(fixture_wait_sql(stack.pg.conninfo, running, 1, 30000),
                     1);
    fixture_stack_broker_kill(&stack, SIGKILL);
    ck_assert_msg(fixture_proc_expect(&p, "no broker answers about command",
                                      15000) == 0,
                  "no note: %s", p.err ? p.err : "");
    ck_assert_msg(strstr(p.err, "it is recorded and goes on"), "%s", p.err);
    ck_assert_int_eq(fixture_stack_broker_start(&stack, N_LOCAL), 0);
    ck_assert_msg(fixture_proc_expect(&p, "a broker answers again", 20000) ==
                      0,
                  "%s", p.err);
    fixture_gate_open(&gate);
    int st = fixture_proc_wait(&p, 0, 60000);
    ck_assert_msg(st == 0 && strcmp(p.out, "done\n") == 0,
                  "exit %d out '%s' err '%s'", st, p.out ? p.out : "",
                  p.err);
    fixture_proc_release(&p);
}
END_TEST

/* The CLI refuses bad variable names itself now; the broker still does,
 * for a request that does not come through it, with the same rule. */
START_TEST(broker_refuses_bad_env_names_too)
{
    struct evt_conn *c = fixture_client(&stack);
    const char *bad[] = {"A B", "KSCORE_COMMAND_ID", "1X"};
    const char *want[] = {"bad environment variable name 'A B'",
                          "the KSCORE_ prefix is kscore's own",
                          "bad environment variable name '1X'"};
    for (size_t i = 0; i < 3; i++) {
        Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
        Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
        Ks__EnvVar ev = KS__ENV_VAR__INIT, *evp = &ev;
        Ks__ExecuteReply *rep = NULL;
        char *argv[] = {"true"};
        ev.name = (char *)bad[i];
        ev.value = "1";
        spec.argv = argv;
        spec.n_argv = 1;
        spec.env = &evp;
        spec.n_env = 1;
        req.spec = &spec;
        req.agent_id = AGENT;
        req.detach = 1;
        ck_assert_int_eq(broker_execute(c, &req, 5000, &rep), 0);
        ck_assert_int_eq(rep->error_code, KS_EINVAL);
        ck_assert_msg(strstr(rep->error, want[i]), "%s", rep->error);
        ks__execute_reply__free_unpacked(rep, NULL);
    }
    evt_close(c);
}
END_TEST

/* ---- exec says what it waits for ----------------------------------------- */

/* Waits until the broker lists id as offline. */
static void
wait_offline(const char *id)
{
    const char *args[] = {"agents", "--json", NULL};
    char needle[128];
    snprintf(needle, sizeof(needle), "\"agent_id\":\"%s\"", id);
    for (int i = 0; i < 300; i++) {
        struct fixture_out o;
        ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
        for (char *save = NULL, *l = strtok_r(o.out, "\n", &save); l;
             l = strtok_r(NULL, "\n", &save)) {
            json_t *j = json_loads(l, 0, NULL);
            bool off = j && strstr(l, needle) &&
                       json_is_false(json_object_get(j, "online"));
            json_decref(j);
            if (off) {
                fixture_out_release(&o);
                return;
            }
        }
        fixture_out_release(&o);
        sleep_ms(100);
    }
    ck_abort_msg("%s never went offline", id);
}

/*
 * exec to an offline agent waited its whole delivery deadline (30 s)
 * without a word. It says at once that the agent is offline and how long
 * it waits; --json's stdout is unchanged and -q leaves the note out.
 */
START_TEST(exec_says_at_once_it_waits_for_an_offline_agent)
{
    const char *off = "rp-off";
    struct fixture_proc p;
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-off", off, NULL), 0);
    ck_assert_int_eq(stack_stop(stack.dir, "agent-off", 20000), 0);
    wait_offline(off);

    const char *a1[] = {"exec", "--agent", off, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore_spawn(&stack, a1, false, &p), 0);
    /* Long before the 30 s deadline: the note, while it waits. */
    ck_assert_msg(fixture_proc_expect(&p, "is offline", 10000) == 0,
                  "no note: %s", p.err ? p.err : "");
    ck_assert_msg(strstr(p.err, "kscore: agent rp-off is offline (last seen "),
                  "%s", p.err);
    ck_assert_msg(strstr(p.err, "waiting up to 30s"), "%s", p.err);
    /* Ctrl-C cancels it, as the note says. */
    ck_assert_int_eq(fixture_proc_wait(&p, SIGINT, 20000), 130);
    fixture_proc_release(&p);

    /* --json: stdout is the result object alone; -q: no note. */
    const char *a2[] = {"exec", "--agent", off, "--json", "-q",
                        "--deliver-within", "2s", "--", "true", NULL};
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_msg(o.status == 125, "exit %d: %s", o.status, o.err);
    json_t *j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j, "stdout is not one JSON object: %s", o.out);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")),
                     "Undeliverable");
    json_decref(j);
    ck_assert_msg(!strstr(o.err, "is offline"), "-q: %s", o.err);
    fixture_out_release(&o);
    const char *a3[] = {"exec", "--agent", off, "--json", "--deliver-within",
                        "2s", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a3, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "waiting up to 2s"), "%s", o.err);
    j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j, "stdout is not one JSON object: %s", o.out);
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

/*
 * With no broker, exec waited 20 s without a word. It says at once that
 * no broker answers and how long it waits, then ends as before (125).
 */
START_TEST(exec_says_at_once_that_no_broker_answers)
{
    struct fixture_nats n;
    struct fixture_proc p;
    ck_assert_int_eq(fixture_nats_start(&n, NULL), 0);
    const char *args[] = {"exec", "--nats", n.url, "--agent", "x", "--",
                          "true", NULL};
    ck_assert_int_eq(fixture_kscore_spawn(NULL, args, false, &p), 0);
    ck_assert_msg(fixture_proc_expect(&p, "no broker answers", 5000) == 0,
                  "no note: %s", p.err ? p.err : "");
    ck_assert_msg(strstr(p.err, "waiting up to 20s"), "%s", p.err);
    ck_assert_int_eq(fixture_proc_wait(&p, 0, 60000), 125);
    ck_assert_msg(strstr(p.err, "no broker is serving"), "%s", p.err);
    fixture_proc_release(&p);
    fixture_nats_stop(&n);
}
END_TEST

/* ---- operator and agent streams, denials (a policy) ---------------------- */

static struct fixture_stack sec;

#define SEC_AGENT "rsec"

static void
sec_up(void)
{
    host_name();
    /* alice runs uptime and true on env=dev agents, with LANG only;
     * bob runs anything anywhere but reads only his own; auditor reads
     * everything; devreader reads env=dev agents' records. */
    if (fixture_stack_start_policy(
            &sec, SEC_AGENT, "env=dev", "alice",
            "{\"operators\": {"
            "\"alice\": [{\"agents\": {\"env\": \"dev\"},"
            " \"executables\": [\"uptime\", \"true\"],"
            " \"env\": [\"LANG\"]}],"
            "\"bob\": [{\"agents\": \"*\", \"can\": [\"run\"]}],"
            "\"auditor\": [{\"agents\": \"*\", \"can\": [\"read\"]}],"
            "\"devreader\": [{\"agents\": {\"env\": \"dev\"},"
            " \"can\": [\"read\"]}]}}\n") != 0) {
        fixture_stack_stop(&sec);
        exit(1);
    }
}

static void
sec_down(void)
{
    fixture_stack_stop(&sec);
}

static int
as(const char *name, const char *const args[], struct fixture_out *o)
{
    ck_assert_int_eq(fixture_kscore_as(&sec, name, args, o), 0);
    return o->status;
}

/*
 * A denial said "(with these environment variables)" when none were
 * given. It names the variables only when they are what was refused,
 * and then exactly those.
 */
START_TEST(denial_names_only_the_variables_refused)
{
    char agent0[96];
    struct fixture_out o;
    snprintf(agent0, sizeof(agent0), "%s-0", host);

    const char *a1[] = {"exec", "--agent", agent0, "--", "uptime", NULL};
    ck_assert_int_eq(as("alice", a1, &o), 125);
    ck_assert_msg(strstr(o.err, "denied: operator 'alice' may not run "
                                "'uptime' as 'root' on agent"),
                  "%s", o.err);
    ck_assert_msg(!strstr(o.err, "environment"), "%s", o.err);
    fixture_out_release(&o);

    const char *a2[] = {"exec",   "--agent", SEC_AGENT, "--env", "FOO=1",
                        "--env",  "LANG=C",  "--",      "uptime", NULL};
    ck_assert_int_eq(as("alice", a2, &o), 125);
    ck_assert_msg(strstr(o.err, "but not with the environment variable(s) "
                                "FOO:"),
                  "%s", o.err);
    ck_assert_msg(!strstr(o.err, "LANG"), "LANG is allowed: %s", o.err);
    fixture_out_release(&o);

    const char *a3[] = {"exec", "--agent", SEC_AGENT, "--env", "LANG=C",
                        "--",   "true",    NULL};
    ck_assert_int_eq(as("alice", a3, &o), 0);
    fixture_out_release(&o);
}
END_TEST

/* Publishes, as the stack's agent, a report about a command that does
 * not exist: kept as a ReportRejected on stream agent-<id>. */
static void
agent_annotation(void)
{
    struct evt_connect_opts co = {.name = "rp", .send_asap = true,
                                  .nkey_file = sec.agent_seed};
    struct evt_conn *c = NULL;
    Ks__Event ev = KS__EVENT__INIT;
    Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
    char cid[37], eid[37], stream[64], subject[256];
    uint8_t *buf;
    size_t len;
    natsMsg *reply = NULL;

    ck_assert_int_eq(evt_connect(sec.nats.url, &co, &c, NULL), 0);
    ks_uuid(cid);
    ks_uuid(eid);
    snprintf(stream, sizeof(stream), "command-%s", cid);
    res.status = KS__COMMAND_STATUS__SUCCEEDED;
    ev.event_id = eid;
    ev.stream_id = stream;
    ev.type = "CommandCompleted";
    ev.command_id = cid;
    ev.agent_id = SEC_AGENT;
    ev.attempt = 1;
    ev.result = &res;
    ev.occurred_at_us = ks_now_us();
    ck_assert_int_eq(kproto_pack(&ev.base, &buf, &len), 0);
    evt_event_subject(subject, sizeof(subject), SEC_AGENT, cid);
    ck_assert_int_eq(
        evt_request_bytes(c, subject, eid, buf, len, 5000, &reply), 0);
    natsMsg_Destroy(reply);
    free(buf);
    evt_close(c);
}

/*
 * `kscore events operator-alice` was refused as "not a command id, nor a
 * stream id" while the README says refusals are recorded there. The
 * operator and agent streams are readable, under the read policy: one's
 * own stream; others' with a "read" rule on "*"; an agent's with a
 * "read" rule that matches it.
 */
START_TEST(operator_and_agent_streams_are_readable)
{
    struct fixture_out o;
    char agent0[96];
    snprintf(agent0, sizeof(agent0), "%s-0", host);

    /* A refusal of alice's, recorded on operator-alice. */
    const char *deny[] = {"exec", "--agent", agent0, "--", "id", NULL};
    ck_assert_int_eq(as("alice", deny, &o), 125);
    fixture_out_release(&o);

    const char *mine[] = {"events", "operator-alice", "--json", NULL};
    ck_assert_int_eq(as("alice", mine, &o), 0);
    ck_assert_msg(strstr(o.out, "\"type\":\"RequestDenied\"") &&
                      strstr(o.out, "may not run 'id'"),
                  "%s %s", o.out, o.err);
    fixture_out_release(&o);
    const char *human[] = {"events", "operator-alice", NULL};
    ck_assert_int_eq(as("alice", human, &o), 0);
    ck_assert_msg(strstr(o.out, "RequestDenied"), "%s", o.out);
    fixture_out_release(&o);

    ck_assert_int_eq(as("auditor", mine, &o), 0);
    ck_assert_ptr_nonnull(strstr(o.out, "RequestDenied"));
    fixture_out_release(&o);
    ck_assert_int_eq(as("bob", mine, &o), 125);
    ck_assert_msg(strstr(o.err, "denied"), "%s", o.err);
    fixture_out_release(&o);

    /* bob's own stream is his to read: that refusal is there. */
    const char *bobs[] = {"events", "operator-bob", NULL};
    ck_assert_int_eq(as("bob", bobs, &o), 0);
    ck_assert_msg(strstr(o.out, "RequestDenied") &&
                      strstr(o.out, "may not read"),
                  "%s", o.out);
    fixture_out_release(&o);
    /* An empty stream of one's own: exit 0, said so. */
    const char *empty[] = {"events", "operator-devreader", NULL};
    ck_assert_int_eq(as("devreader", empty, &o), 0);
    ck_assert_msg(strstr(o.err, "no events recorded on operator-devreader"),
                  "%s", o.err);
    fixture_out_release(&o);

    /* An agent's stream: what it reported about no command of its own. */
    agent_annotation();
    const char *ag[] = {"events", "agent-" SEC_AGENT, "--json", NULL};
    bool seen = false;
    for (int i = 0; i < 100 && !seen; i++) {
        ck_assert_int_eq(as("devreader", ag, &o), 0);
        seen = strstr(o.out, "ReportRejected") != NULL;
        fixture_out_release(&o);
        if (!seen)
            sleep_ms(100);
    }
    ck_assert(seen);
    ck_assert_int_eq(as("auditor", ag, &o), 0);
    ck_assert_ptr_nonnull(strstr(o.out, "ReportRejected"));
    fixture_out_release(&o);
    ck_assert_int_eq(as("bob", ag, &o), 125);
    fixture_out_release(&o);

    /* Still refused: what names no stream. */
    const char *bad[] = {"events", "alice", NULL};
    ck_assert_int_eq(as("alice", bad, &o), 2);
    ck_assert_msg(strstr(o.err, "operator-<name>"), "%s", o.err);
    fixture_out_release(&o);
}
END_TEST

/*
 * `operator list --json` and `agent list --json` printed one JSON array
 * where every other list (list, agents, events) prints one object a line:
 * `| jq .name` failed on them. One object a line.
 */
START_TEST(identity_lists_are_one_object_a_line)
{
    struct fixture_out o;
    const char *const lists[][5] = {
        {"operator", "list", "--all", "--json", NULL},
        {"agent", "list", "--json", NULL, NULL}};
    for (size_t k = 0; k < 2; k++) {
        ck_assert_int_eq(fixture_kscore_home(sec.dir, lists[k], &o), 0);
        ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
        size_t n = 0;
        for (char *save = NULL, *l = strtok_r(o.out, "\n", &save); l;
             l = strtok_r(NULL, "\n", &save), n++) {
            json_t *j = json_loads(l, 0, NULL);
            ck_assert_msg(json_is_object(j), "%s: not an object a line: %s",
                          lists[k][0], l);
            json_decref(j);
        }
        /* operator list --all: broker, alice, agent-rsec; agent list:
         * rsec */
        ck_assert_uint_ge(n, k == 0 ? 3 : 1);
        fixture_out_release(&o);
    }
    /* The table has a header, as the other tables. */
    const char *human[] = {"operator", "list", NULL};
    ck_assert_int_eq(fixture_kscore_home(sec.dir, human, &o), 0);
    ck_assert_msg(strncmp(o.out, "NAME", 4) == 0 && strstr(o.out, "alice"),
                  "%s", o.out);
    fixture_out_release(&o);
}
END_TEST

/* ---- without a stack ----------------------------------------------------- */

/* Runs kscore without any stack (a usage error never reaches one). */
static int
ks_nostack(const char *const args[], struct fixture_out *o)
{
    ck_assert_int_eq(fixture_kscore_home("/nonexistent-kscore-home", args, o),
                     0);
    return o->status;
}

/*
 * `exec --env BAD-NAME=1` and `--cwd rel` went to the broker and came
 * back as 125 naming a protobuf field (ExecuteRequest.spec.cwd). They are
 * usage errors, said before anything is sent: 2, naming the flag.
 */
START_TEST(bad_env_and_cwd_are_usage_errors)
{
    struct fixture_out o;
    const char *const cases[][8] = {
        {"exec", "--agent", "a", "--env", "BAD-NAME=1", "--", "true", NULL},
        {"exec", "--agent", "a", "--env", "KSCORE_X=1", "--", "true", NULL},
        {"exec", "--agent", "a", "--cwd", "rel", "--", "true", NULL},
        {"batch", "--all", "--cwd", "", "--", "true", NULL, NULL},
        {"batch", "--all", "--env", "1X=2", "--", "true", NULL, NULL},
    };
    const char *want[] = {"bad --env name 'BAD-NAME'",
                          "bad --env name 'KSCORE_X'", "bad --cwd 'rel'",
                          "bad --cwd ''", "bad --env name '1X'"};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        ck_assert_int_eq(ks_nostack(cases[i], &o), 2);
        ck_assert_msg(strstr(o.err, want[i]), "%s: %s", want[i], o.err);
        fixture_out_release(&o);
    }
}
END_TEST

/*
 * `get --help` printed one line (not that a batch id is taken, nor the
 * exit codes, nor the connection flags); `cancel --help` had no
 * connection flags; `logs nope` printed its usage instead of what was
 * wrong.
 */
START_TEST(help_and_id_errors_say_what_is_taken)
{
    struct fixture_out o;
    const char *g[] = {"get", "--help", NULL};
    ck_assert_int_eq(ks_nostack(g, &o), 0);
    ck_assert_msg(strstr(o.out, "batch-<uuid>") && strstr(o.out, "Exit 0") &&
                      strstr(o.out, "--nats URL") &&
                      strstr(o.out, "null while the batch runs"),
                  "%s", o.out);
    fixture_out_release(&o);
    const char *c[] = {"cancel", "--help", NULL};
    ck_assert_int_eq(ks_nostack(c, &o), 0);
    ck_assert_msg(strstr(o.out, "--nats URL") && strstr(o.out, "outcome"),
                  "%s", o.out);
    fixture_out_release(&o);
    const char *l[] = {"logs", "batch-1", NULL};
    ck_assert_int_eq(ks_nostack(l, &o), 2);
    ck_assert_msg(strstr(o.err, "'batch-1' is not a command id") &&
                      strstr(o.err, "kscore get"),
                  "%s", o.err);
    fixture_out_release(&o);
}
END_TEST

/* An id of 58 characters was refused with "(at most 57)": the limit and
 * its reason are said, and a pool name's limit is its own (58). */
START_TEST(enroll_names_the_id_limit)
{
    char id[80], home[PATH_MAX];
    struct fixture_out o;
    const char *t = getenv("TMPDIR");
    snprintf(home, sizeof(home), "%s/kscore-rp-home-XXXXXX",
             t && *t ? t : "/tmp");
    ck_assert_ptr_nonnull(mkdtemp(home));
    memset(id, 'a', 58);
    id[58] = '\0';
    const char *a1[] = {"agent", "enroll", id, NULL};
    ck_assert_int_eq(fixture_kscore_home(home, a1, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_msg(strstr(o.err, "too long: 1 to 57 letters, digits, _ and -"),
                  "%s", o.err);
    ck_assert_msg(strstr(o.err, "agent-<id> is at most 63"), "%s", o.err);
    fixture_out_release(&o);
    /* 57 passes the check (and stops later: there is no stack). */
    id[57] = '\0';
    ck_assert_int_eq(fixture_kscore_home(home, a1, &o), 0);
    ck_assert_msg(!strstr(o.err, "too long"), "%s", o.err);
    fixture_out_release(&o);
    memset(id, 'p', 59);
    id[59] = '\0';
    const char *a2[] = {"agent", "enroll", id, "--pool-size", "2", NULL};
    ck_assert_int_eq(fixture_kscore_home(home, a2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_msg(strstr(o.err, "too long: 1 to 58"), "%s", o.err);
    fixture_out_release(&o);
    rmdir(home);
}
END_TEST

static Suite *
readpaths_suite(void)
{
    Suite *s = suite_create("readpaths");
    TCase *tc = tcase_create("stack");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, events_follow_starts_at_now);
    tcase_add_test(tc, events_since_and_from_start);
    tcase_add_test(tc, progress_bar_never_glued_to_stream_lines);
    tcase_add_test(tc, progress_bar_never_glued_to_the_ctrl_c_message);
    tcase_add_test(tc, confirmation_shows_the_command_and_its_targets);
    tcase_add_test(tc, running_batch_has_no_exit_code_yet);
    tcase_add_test(tc, broker_refuses_bad_env_names_too);
    tcase_add_test(tc, exec_says_at_once_it_waits_for_an_offline_agent);
    tcase_add_test(tc, exec_says_at_once_that_no_broker_answers);
    tcase_add_test(tc, control_characters_in_argv_are_quoted);
    /* Last: it kills and restarts the broker. */
    tcase_add_test(tc, exec_says_when_no_broker_answers_about_its_command);
    suite_add_tcase(s, tc);

    tc = tcase_create("policy");
    tcase_add_unchecked_fixture(tc, sec_up, sec_down);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, denial_names_only_the_variables_refused);
    tcase_add_test(tc, operator_and_agent_streams_are_readable);
    tcase_add_test(tc, identity_lists_are_one_object_a_line);
    suite_add_tcase(s, tc);

    tc = tcase_create("cli");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, enroll_names_the_id_limit);
    tcase_add_test(tc, bad_env_and_cwd_are_usage_errors);
    tcase_add_test(tc, help_and_id_errors_say_what_is_taken);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(readpaths_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
