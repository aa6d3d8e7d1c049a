/*
 * History (`kscore list`) and the operator-facing faults of issue 12:
 * filters and order of the history, paging past one NATS message, the
 * read policy per row; `exec` without a stack, `status` / `down` run by
 * another user, the running count per local agent, -h / help everywhere.
 * The real kscore binary against private servers.
 */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "broker.h"
#include "fixture.h"

#define AGENT "hist-a"

static struct fixture_stack stack;
static char host0[96], host1[96];

static void
local_names(void)
{
    char host[64];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(host0, sizeof(host0), "%s-0", host);
    snprintf(host1, sizeof(host1), "%s-1", host);
}

static void
stack_up(void)
{
    local_names();
    if (fixture_stack_start(&stack, AGENT, 2) != 0) {
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

/* Runs kscore against the stack; the exit status is checked by callers. */
static void
ks(const struct fixture_stack *s, const char *const args[],
   struct fixture_out *o)
{
    ck_assert_int_eq(fixture_kscore(s, args, o), 0);
}

/* Runs args (which end with --json) and parses each stdout line; exits
 * non-zero fail the test. */
static json_t *
ks_lines(const struct fixture_stack *s, const char *const args[])
{
    struct fixture_out o;
    json_t *arr = json_array();
    ks(s, args, &o);
    ck_assert_msg(o.status == 0, "kscore %s: exit %d: %s", args[0], o.status,
                  o.err);
    for (char *save = NULL, *line = strtok_r(o.out, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        ck_assert_msg(j != NULL, "not JSON: %s", line);
        json_array_append_new(arr, j);
    }
    fixture_out_release(&o);
    return arr;
}

static const char *
str_of(json_t *arr, size_t i, const char *key)
{
    return json_string_value(json_object_get(json_array_get(arr, i), key));
}

/* Runs a command to its end and returns its id (static buffer). */
static const char *
run(const char *agent, const char *const cmd[])
{
    static char id[40];
    const char *args[24] = {"exec", "--agent", agent, "--json", "--"};
    size_t n = 5;
    for (size_t i = 0; cmd[i] && n < 23; i++)
        args[n++] = cmd[i];
    args[n] = NULL;
    struct fixture_out o;
    ks(&stack, args, &o);
    json_error_t err;
    json_t *j = json_loads(o.out, 0, &err);
    ck_assert_msg(j != NULL, "not JSON: %s (%s)", o.out, o.err);
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    fixture_out_release(&o);
    return id;
}

START_TEST(history_filters_and_order)
{
    char ok_a[40], fail_a[40], ok_0[40], batch[64];
    const char *t[] = {"true", NULL};
    const char *f[] = {"sh", "-c", "exit 3", NULL};
    struct fixture_out o;

    snprintf(ok_a, sizeof(ok_a), "%s", run(AGENT, t));
    snprintf(fail_a, sizeof(fail_a), "%s", run(AGENT, f));
    snprintf(ok_0, sizeof(ok_0), "%s", run(host0, t));
    char targets[256];
    snprintf(targets, sizeof(targets), "%s,%s", AGENT, host0);
    const char *b[] = {"batch", "--agents", targets, "--json", "--", "true",
                       NULL};
    ks(&stack, b, &o);
    ck_assert_msg(o.status == 0, "%s", o.err);
    {
        /* Whatever lines `batch --json` prints, they name the batch. */
        const char *p = strstr(o.out, "\"batch_id\":\"batch-");
        ck_assert_msg(p != NULL, "%s", o.out);
        snprintf(batch, sizeof(batch), "%.42s", p + 12);
    }
    fixture_out_release(&o);
    ck_assert_int_eq(strncmp(batch, "batch-", 6), 0);

    /* Top level, newest first: the batch (not its targets), then the
     * three commands in reverse order. */
    const char *all[] = {"list", "--json", NULL};
    json_t *l = ks_lines(&stack, all);
    ck_assert_int_eq(json_array_size(l), 4);
    ck_assert_str_eq(str_of(l, 0, "id"), batch);
    ck_assert_str_eq(str_of(l, 0, "kind"), "batch");
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(l, 0),
                                                        "total")),
                     2);
    ck_assert_str_eq(str_of(l, 1, "id"), ok_0);
    ck_assert_str_eq(str_of(l, 2, "id"), fail_a);
    ck_assert_str_eq(str_of(l, 3, "id"), ok_a);
    ck_assert_str_eq(str_of(l, 2, "status"), "Failed");
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(l, 2),
                                                        "exit_code")),
                     3);
    for (size_t i = 1; i < 4; i++)
        ck_assert_str_le(str_of(l, i, "requested_at"),
                         str_of(l, i - 1, "requested_at"));
    json_decref(l);

    /* --agent: that agent's commands, the batch's target included. */
    const char *ag[] = {"list", "--agent", AGENT, "--json", NULL};
    l = ks_lines(&stack, ag);
    ck_assert_int_eq(json_array_size(l), 3);
    ck_assert_str_eq(str_of(l, 0, "batch_id"), batch);
    ck_assert_str_eq(str_of(l, 1, "id"), fail_a);
    for (size_t i = 0; i < 3; i++)
        ck_assert_str_eq(str_of(l, i, "agent_id"), AGENT);
    json_decref(l);

    /* --status (any case), --batch, --operator, --limit. */
    const char *st[] = {"list", "--status", "failed", "--json", NULL};
    l = ks_lines(&stack, st);
    ck_assert_int_eq(json_array_size(l), 1);
    ck_assert_str_eq(str_of(l, 0, "id"), fail_a);
    json_decref(l);
    const char *st2[] = {"list", "--status", "Succeeded,Completed", "--json",
                         NULL};
    l = ks_lines(&stack, st2);
    ck_assert_int_eq(json_array_size(l), 3); /* batch, ok_0, ok_a */
    json_decref(l);
    const char *bt[] = {"list", "--batch", batch, "--json", NULL};
    l = ks_lines(&stack, bt);
    ck_assert_int_eq(json_array_size(l), 2);
    ck_assert_str_eq(str_of(l, 0, "batch_id"), batch);
    ck_assert_str_eq(str_of(l, 1, "batch_id"), batch);
    json_decref(l);
    const char *op[] = {"list", "--operator", "nobody-else", "--json", NULL};
    l = ks_lines(&stack, op);
    ck_assert_int_eq(json_array_size(l), 0);
    json_decref(l);
    const char *lim[] = {"list", "--limit", "2", "--json", NULL};
    l = ks_lines(&stack, lim);
    ck_assert_int_eq(json_array_size(l), 2);
    ck_assert_str_eq(str_of(l, 0, "id"), batch);
    json_decref(l);

    /* Time: a duration back from now, and RFC 3339. */
    const char *s1[] = {"list", "--since", "1h", "--json", NULL};
    l = ks_lines(&stack, s1);
    ck_assert_int_eq(json_array_size(l), 4);
    json_decref(l);
    const char *s2[] = {"list", "--until", "1h ago", "--json", NULL};
    l = ks_lines(&stack, s2);
    ck_assert_int_eq(json_array_size(l), 0);
    json_decref(l);
    const char *s3[] = {"list", "--since", "2999-01-01T00:00:00Z", "--json",
                        NULL};
    l = ks_lines(&stack, s3);
    ck_assert_int_eq(json_array_size(l), 0);
    json_decref(l);
    const char *s4[] = {"list", "--since", "2000-01-01T01:00:00+01:00",
                        "--until", "2999-01-01", "--json", NULL};
    l = ks_lines(&stack, s4);
    ck_assert_int_eq(json_array_size(l), 4);
    json_decref(l);

    /* Between two of them: the time of the middle one's request. */
    const char *g[] = {"list", "--agent", AGENT, "--json", NULL};
    l = ks_lines(&stack, g);
    char since[64];
    snprintf(since, sizeof(since), "%s", str_of(l, 1, "requested_at"));
    json_decref(l);
    const char *s5[] = {"list", "--agent", AGENT, "--since", since, "--json",
                        NULL};
    l = ks_lines(&stack, s5);
    ck_assert_int_eq(json_array_size(l), 2); /* fail_a and the target */
    json_decref(l);

    /* The table has a header and one line per item. */
    const char *tab[] = {"list", NULL};
    ks(&stack, tab, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_ptr_nonnull(strstr(o.out, "STATUS"));
    ck_assert_ptr_nonnull(strstr(o.out, fail_a));
    ck_assert_ptr_nonnull(strstr(o.out, "exit 3"));
    fixture_out_release(&o);

    /* Usage errors. */
    const char *bad[][5] = {{"list", "--status", "bogus", NULL},
                            {"list", "--since", "yesterday", NULL},
                            {"list", "--batch", "nope", NULL},
                            {"list", "--limit", "-1", NULL},
                            {"list", "extra", NULL}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ks(&stack, bad[i], &o);
        ck_assert_msg(o.status == 2, "%s %s: exit %d", bad[i][1],
                      bad[i][2] ? bad[i][2] : "", o.status);
        fixture_out_release(&o);
    }
}
END_TEST

/*
 * More than one NATS message of history: 160 commands of 40 arguments of
 * 300 bytes (each listed as 32 arguments of 256 bytes: about 8 KiB), 1.3
 * MiB in all. One request of 1000 is cut to fit (more, with a cursor), and
 * `list --limit 0` pages through every one, once, in order.
 */
/* list and get show argv as a shell reads it back: quoted where a word
 * holds a space, a quote or is empty, so words can be told apart. */
START_TEST(list_and_get_quote_argv)
{
    const char *c[] = {"printf", "[%s]\\n", "a b", "it's", "", "x=1", NULL};
    const char *want = "printf '[%s]\\n' 'a b' 'it'\\''s' '' x=1";
    char id[40];
    struct fixture_out o;

    snprintf(id, sizeof(id), "%s", run(AGENT, c));
    const char *g[] = {"get", id, NULL};
    ks(&stack, g, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_msg(strstr(o.out, want) != NULL, "get: %s", o.out);
    fixture_out_release(&o);
    const char *l[] = {"list", "--agent", AGENT, "--limit", "1", NULL};
    ks(&stack, l, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_msg(strstr(o.out, id) && strstr(o.out, want), "list: %s",
                  o.out);
    fixture_out_release(&o);
}
END_TEST

START_TEST(history_pages_past_one_message)
{
    enum { N = 160, ARGS = 40 };
    struct evt_conn *c = fixture_client(&stack);
    char arg[301];
    char *argv[ARGS + 1];
    memset(arg, 'x', 300);
    arg[300] = '\0';
    argv[0] = "true";
    for (int i = 1; i < ARGS; i++)
        argv[i] = arg;
    argv[ARGS] = NULL;
    for (int i = 0; i < N; i++) {
        Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
        Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
        Ks__ExecuteReply *rep = NULL;
        spec.argv = argv;
        spec.n_argv = ARGS;
        req.spec = &spec;
        req.agent_id = host1;
        req.detach = true;
        /* 160 at once to one agent of 8 slots: they queue, and each may
         * wait its turn (without a window of its own, admission refuses
         * what could not start within the default: busy) */
        req.deliver_within_ms = 120000;
        ck_assert_int_eq(broker_execute(c, &req, 10000, &rep), 0);
        ck_assert_msg(rep->error_code == 0, "%s", rep->error);
        ks__execute_reply__free_unpacked(rep, NULL);
    }

    Ks__ListRequest lr = KS__LIST_REQUEST__INIT;
    Ks__ListReply *page = NULL;
    char *agents[] = {host1};
    lr.agents = agents;
    lr.n_agents = 1;
    lr.limit = 1000;
    ck_assert_int_eq(broker_call(c, EVT_API_LIST, &lr.base,
                                 &ks__list_reply__descriptor, 10000,
                                 (ProtobufCMessage **)&page),
                     0);
    ck_assert_int_eq(page->error_code, 0);
    ck_assert_msg(page->n_items > 0 && page->n_items < N,
                  "one page held %zu items", page->n_items);
    ck_assert(page->more);
    ck_assert(page->items[0]->argv_truncated);
    ck_assert_int_eq(page->items[0]->n_argv, 32);
    ck_assert_int_eq(strlen(page->items[0]->argv[1]), 256);
    ks__list_reply__free_unpacked(page, NULL);
    evt_close(c);

    const char *args[] = {"list", "--agent", host1, "--limit", "0", "--json",
                          NULL};
    json_t *l = ks_lines(&stack, args);
    ck_assert_int_eq(json_array_size(l), N);
    for (size_t i = 1; i < N; i++) {
        ck_assert_str_ne(str_of(l, i, "id"), str_of(l, i - 1, "id"));
        ck_assert_str_le(str_of(l, i, "requested_at"),
                         str_of(l, i - 1, "requested_at"));
    }
    json_decref(l);
}
END_TEST

/* ---- the read policy, row by row ---------------------------------------- */

static struct fixture_stack sec;
static char sec_tmp[PATH_MAX];
static char bob_seed[PATH_MAX + 64];

#define SEC_AGENT "hsec"

static void
sec_up(void)
{
    char policy[PATH_MAX + 16];
    const char *t = getenv("TMPDIR");
    local_names();
    snprintf(sec_tmp, sizeof(sec_tmp), "%s/kscore-hist-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(sec_tmp))
        exit(1);
    snprintf(policy, sizeof(policy), "%s/policy.json", sec_tmp);
    FILE *f = fopen(policy, "w");
    /* alice runs anywhere and reads only her own; bob reads env=dev
     * agents' records; eve is not in the policy. */
    fprintf(f, "{\"operators\": {"
               "\"alice\": [{\"agents\": \"*\", \"can\": [\"run\"]}],"
               "\"bob\": [{\"agents\": {\"env\": \"dev\"}, \"can\": "
               "[\"read\"]}]}}\n");
    fclose(f);
    if (fixture_stack_start_secure(&sec, SEC_AGENT, "env=dev", "alice",
                                   policy) != 0) {
        fixture_stack_stop(&sec);
        exit(1);
    }
}

static void
sec_down(void)
{
    char cmd[PATH_MAX + 16];
    fixture_stack_stop(&sec);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", sec_tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", sec_tmp);
}

/* Runs args as operator name (its seed in the stack's registry). */
static json_t *
sec_lines_as(const char *name, const char *const args[], int *status)
{
    struct fixture_out o;
    json_t *arr = json_array();

    ck_assert_int_eq(fixture_kscore_as(&sec, name, args, &o), 0);
    *status = o.status;
    for (char *save = NULL, *line = strtok_r(o.out, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        ck_assert_msg(j != NULL, "not JSON: %s", line);
        json_array_append_new(arr, j);
    }
    fixture_out_release(&o);
    return arr;
}

START_TEST(history_shows_only_what_the_policy_lets_read)
{
    struct fixture_out o;
    int st;
    (void)bob_seed;
    /* alice runs on the env=dev agent and on the in-process one. */
    const char *r1[] = {"exec", "--agent", SEC_AGENT, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&sec, r1, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    fixture_out_release(&o);
    const char *r2[] = {"exec", "--agent", host0, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&sec, r2, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    fixture_out_release(&o);

    const char *args[] = {"list", "--json", NULL};
    json_t *l = sec_lines_as("alice", args, &st);
    ck_assert_int_eq(st, 0);
    ck_assert_int_eq(json_array_size(l), 2); /* her own, everywhere */
    json_decref(l);
    l = sec_lines_as("bob", args, &st);
    ck_assert_int_eq(st, 0);
    ck_assert_int_eq(json_array_size(l), 1); /* env=dev only */
    ck_assert_str_eq(str_of(l, 0, "agent_id"), SEC_AGENT);
    json_decref(l);
    l = sec_lines_as("eve", args, &st);
    ck_assert_int_eq(st, 125); /* not in the policy: denied */
    ck_assert_int_eq(json_array_size(l), 0);
    json_decref(l);
}
END_TEST

/* ---- without a stack ----------------------------------------------------- */

START_TEST(exec_without_a_stack_is_125)
{
    struct fixture_out o;
    char home[PATH_MAX];
    const char *t = getenv("TMPDIR");
    snprintf(home, sizeof(home), "%s/kscore-nohome-XXXXXX",
             t && *t ? t : "/tmp");
    ck_assert_ptr_nonnull(mkdtemp(home));
    const char *args[] = {"exec", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore_home(home, args, &o), 0);
    ck_assert_msg(o.status == 125, "exit %d: %s", o.status, o.err);
    ck_assert_ptr_nonnull(strstr(o.err, "kscore up"));
    fixture_out_release(&o);
    /* Given a url but no agent: that is a usage error. */
    const char *args2[] = {"exec", "--nats", "nats://127.0.0.1:1", "--",
                           "true", NULL};
    ck_assert_int_eq(fixture_kscore_home(home, args2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
    rmdir(home);
}
END_TEST

static const char *const subcommands[] = {
    "up",     "down",   "status", "broker", "agent",  "exec",
    "get",    "events", "cancel", "agents", "replay", "batch",
    "keygen", "operator", "perf", "list",   NULL};

START_TEST(every_subcommand_answers_help)
{
    for (size_t i = 0; subcommands[i]; i++) {
        const char *flags[] = {"-h", "--help"};
        char usage[64];
        snprintf(usage, sizeof(usage), "usage: kscore %s", subcommands[i]);
        for (size_t k = 0; k < 2; k++) {
            struct fixture_out o;
            const char *args[] = {subcommands[i], flags[k], NULL};
            ck_assert_int_eq(fixture_kscore_home("/nonexistent", args, &o),
                             0);
            ck_assert_msg(o.status == 0, "%s %s: exit %d: %s",
                          subcommands[i], flags[k], o.status, o.err);
            ck_assert_msg(strstr(o.out, usage) == o.out, "%s %s: %s",
                          subcommands[i], flags[k], o.out);
            fixture_out_release(&o);
        }
        /* kscore help CMD is CMD --help. */
        struct fixture_out a, b;
        const char *h1[] = {"help", subcommands[i], NULL};
        const char *h2[] = {subcommands[i], "--help", NULL};
        ck_assert_int_eq(fixture_kscore_home("/nonexistent", h1, &a), 0);
        ck_assert_int_eq(fixture_kscore_home("/nonexistent", h2, &b), 0);
        ck_assert_int_eq(a.status, 0);
        ck_assert_str_eq(a.out, b.out);
        fixture_out_release(&a);
        fixture_out_release(&b);
    }
    /* -h after `--` belongs to the command. */
    struct fixture_out o;
    const char *args[] = {"exec", "--nats", "nats://127.0.0.1:1", "--agent",
                          "x", "--", "ls", "-h", NULL};
    ck_assert_int_eq(fixture_kscore_home("/nonexistent", args, &o), 0);
    ck_assert_int_eq(o.status, 125); /* tried to connect: not help */
    fixture_out_release(&o);
    const char *unk[] = {"help", "nosuch", NULL};
    ck_assert_int_eq(fixture_kscore_home("/nonexistent", unk, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
}
END_TEST

/* ---- a local stack (`kscore up`) seen by another user -------------------- */

static char up_tmp[PATH_MAX], up_home[PATH_MAX + 16];

static int
ks_home(struct fixture_out *o, const char *const args[])
{
    ck_assert_int_eq(fixture_kscore_home(up_home, args, o), 0);
    return o->status;
}

/* Runs kscore ARGS as user nobody (setpriv); its exit status, output in
 * buf. */
static int
as_nobody(const char *args, char *buf, size_t cap)
{
    char cmd[PATH_MAX * 3];
    const char *bin = getenv("KSCORE_BIN");
    snprintf(cmd, sizeof(cmd),
             "setpriv --reuid=nobody --regid=nogroup --clear-groups env -i "
             "KSCORE_HOME='%s' '%s' %s 2>&1",
             up_home, bin, args);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t n = fread(buf, 1, cap - 1, p);
    buf[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

START_TEST(local_stack_seen_by_another_user)
{
    struct fixture_out o;
    char buf[8192];
    const char *t = getenv("TMPDIR");

    (void)t;
    ck_assert_msg(getenv("KSCORE_BIN"), "KSCORE_BIN is not set");
    ck_assert(up_tmp[0]);
    const char *up[] = {"up", "--local-agents", "2", NULL};
    ck_assert_msg(ks_home(&o, up) == 0, "up: %s", o.err);
    fixture_out_release(&o);
    /* nobody may look in, not signal */
    chmod(up_tmp, 0755);
    chmod(up_home, 0755);

    if (getuid() == 0) {
        int st = as_nobody("status", buf, sizeof(buf));
        ck_assert_msg(st == 0, "status as nobody: exit %d: %s", st, buf);
        ck_assert_msg(strstr(buf, "stopped") == NULL, "%s", buf);
        st = as_nobody("down", buf, sizeof(buf));
        ck_assert_msg(st == 125, "down as nobody: exit %d: %s", st, buf);
        ck_assert_ptr_nonnull(strstr(buf, "not permitted"));
        ck_assert_ptr_null(strstr(buf, "is stopped"));
        const char *status[] = {"status", NULL};
        ck_assert_msg(ks_home(&o, status) == 0, "%s", o.out);
        fixture_out_release(&o);
    }

    /* One local agent runs a command; only its running count is 1. */
    char host[64], a0[96], a1[96];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(a0, sizeof(a0), "%s-0", host);
    snprintf(a1, sizeof(a1), "%s-1", host);
    /* It runs until the test has seen it counted: with `sleep 6` a
     * loaded machine could end it before a heartbeat reported it and
     * `kscore agents` read that. */
    struct fixture_gate gate;
    fixture_gate_init(&gate, up_tmp, "counted");
    const char *run[] = {"exec", "--agent", a1, "--detach", "--", "sh",
                         "-c", gate.sh, NULL};
    ck_assert_msg(ks_home(&o, run) == 0, "%s", o.err);
    fixture_out_release(&o);
    bool seen = false;
    for (int i = 0; i < 150 && !seen; i++) {
        const char *ag[] = {"agents", "--json", NULL};
        ck_assert_int_eq(ks_home(&o, ag), 0);
        long r0 = -1, r1 = -1;
        for (char *save = NULL, *line = strtok_r(o.out, "\n", &save); line;
             line = strtok_r(NULL, "\n", &save)) {
            json_error_t err;
            json_t *j = json_loads(line, 0, &err);
            const char *id =
                json_string_value(json_object_get(j, "agent_id"));
            long r = (long)json_integer_value(json_object_get(j, "running"));
            if (id && strcmp(id, a0) == 0)
                r0 = r;
            if (id && strcmp(id, a1) == 0)
                r1 = r;
            json_decref(j);
        }
        fixture_out_release(&o);
        if (r1 == 1) {
            ck_assert_msg(r0 == 0, "%s runs nothing but reports %ld", a0, r0);
            seen = true;
        } else {
            usleep(200000);
        }
    }
    fixture_gate_open(&gate);
    ck_assert_msg(seen, "%s never reported its running command", a1);

    const char *down[] = {"down", NULL};
    ck_assert_msg(ks_home(&o, down) == 0, "%s", o.err);
    fixture_out_release(&o);
    /* No stack: exec cannot reach anything (125, not a usage error). */
    const char *ex[] = {"exec", "--", "true", NULL};
    ck_assert_int_eq(ks_home(&o, ex), 125);
    fixture_out_release(&o);
}
END_TEST

/* In the runner's process, so a failed test leaves no stack running. */
static void
up_dir_make(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(up_tmp, sizeof(up_tmp), "%s/kscore-histup-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(up_tmp))
        exit(1);
    snprintf(up_home, sizeof(up_home), "%s/home", up_tmp);
}

static void
up_dir_remove(void)
{
    struct fixture_out o;
    char cmd[PATH_MAX + 16];
    const char *down[] = {"down", NULL};
    if (fixture_kscore_home(up_home, down, &o) == 0)
        fixture_out_release(&o);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", up_tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", up_tmp);
}

static Suite *
history_suite(void)
{
    Suite *s = suite_create("history");
    TCase *tc = tcase_create("history");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, history_filters_and_order);
    tcase_add_test(tc, history_pages_past_one_message);
    tcase_add_test(tc, list_and_get_quote_argv);
    suite_add_tcase(s, tc);

    tc = tcase_create("policy");
    tcase_add_unchecked_fixture(tc, sec_up, sec_down);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, history_shows_only_what_the_policy_lets_read);
    suite_add_tcase(s, tc);

    tc = tcase_create("cli");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, exec_without_a_stack_is_125);
    tcase_add_test(tc, every_subcommand_answers_help);
    suite_add_tcase(s, tc);

    tc = tcase_create("localstack");
    tcase_add_unchecked_fixture(tc, up_dir_make, up_dir_remove);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, local_stack_seen_by_another_user);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(history_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
