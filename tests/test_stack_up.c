/*
 * test_stack_up: the local stack of `kscore up` is stable. A restart keeps
 * the NATS port, the credentials and the keys, and starts only the parts
 * that are down, so remote agents (and the running parts) are never cut
 * off by it. Real nats-server, PostgreSQL, broker and agent processes.
 */
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "events.h"
#include "fixture.h"
#include "kproto.h"
#include "stack.h"

static char tmpdir[PATH_MAX];
static char home[PATH_MAX + 16];

static void
up_setup(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/kscore-up-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir))
        exit(1);
    snprintf(home, sizeof(home), "%s/home", tmpdir);
    setenv("KSCORE_PG_FAST", "1", 0);
}

static void
up_teardown(void)
{
    struct fixture_out o;
    char cmd[PATH_MAX + 16];
    const char *args[] = {"down", NULL};
    const char *keep = getenv("KSCORE_KEEP_TMP");
    fixture_kscore_home(home, args, &o);
    fixture_out_release(&o);
    if (keep && strcmp(keep, "1") == 0)
        return;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
}

static int
ks(struct fixture_out *o, const char *const args[])
{
    ck_assert_int_eq(fixture_kscore_home(home, args, o), 0);
    return o->status;
}

static void
ks_ok(const char *const args[])
{
    struct fixture_out o;
    int st = ks(&o, args);
    ck_assert_msg(st == 0, "kscore %s: exit %d: %s", args[0], st, o.err);
    fixture_out_release(&o);
}

static char *
slurp(const char *path)
{
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t len = 0;
    ck_assert_msg(f != NULL, "open %s: %s", path, strerror(errno));
    ck_assert_int_eq(getdelim(&buf, &len, '\0', f) >= 0, 1);
    fclose(f);
    return buf;
}

/* The value of NAME='...' in home/env, into buf. */
static void
env_value(const char *name, char *buf, size_t cap)
{
    char path[PATH_MAX + 32], pat[64];
    snprintf(path, sizeof(path), "%s/env", home);
    char *s = slurp(path);
    snprintf(pat, sizeof(pat), "%s='", name);
    char *p = strstr(s, pat);
    ck_assert_msg(p != NULL, "%s not in env", name);
    p += strlen(pat);
    char *q = strchr(p, '\'');
    ck_assert_ptr_nonnull(q);
    snprintf(buf, cap, "%.*s", (int)(q - p), p);
    free(s);
}

static pid_t
pid_of(const char *part)
{
    pid_t pid = 0;
    ck_assert_msg(stack_pidfile_alive(home, part, &pid), "%s is not running",
                  part);
    return pid;
}

/* What a restart must not change: every seed and key file and the
 * server's users. */
static char *
secrets(void)
{
    static const char *const files[] = {"keys/broker.nk", "keys/broker.key",
                                        "keys/broker.pub",
                                        STACK_NATS_AUTH_FILE};
    char *all = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&all, &n);
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        char path[PATH_MAX + 64];
        snprintf(path, sizeof(path), "%s/%s", home, files[i]);
        char *s = slurp(path);
        fprintf(m, "%s\n%s\n", files[i], s);
        free(s);
    }
    fclose(m);
    return all;
}

static void
kill_and_wait(pid_t pid)
{
    ck_assert_int_eq(kill(pid, SIGKILL), 0);
    for (int i = 0; i < 500 && kill(pid, 0) == 0; i++) {
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
}

static void
exec_echo(const char *word)
{
    struct fixture_out o;
    ck_assert_int_eq(ks(&o, (const char *[]){"exec", "--timeout", "20s", "--",
                                             "echo", word, NULL}),
                     0);
    char want[64];
    snprintf(want, sizeof(want), "%s\n", word);
    ck_assert_str_eq(o.out, want);
    fixture_out_release(&o);
}

START_TEST(broker_crash_restarts_the_broker_alone)
{
    char url[256], url2[256];
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    char *before = secrets();
    pid_t nats = pid_of("nats"), agent = pid_of("agent"),
          pg = pid_of("pg"), broker = pid_of("broker");

    kill_and_wait(broker);
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url2, sizeof(url2));
    ck_assert_str_eq(url, url2);
    char *after = secrets();
    ck_assert_str_eq(before, after);
    ck_assert_int_eq(pid_of("nats"), nats);
    ck_assert_int_eq(pid_of("agent"), agent);
    ck_assert_int_eq(pid_of("pg"), pg);
    ck_assert_int_ne(pid_of("broker"), broker);
    exec_echo("broker-back");
    free(before);
    free(after);
}
END_TEST

/* A connection with the stack's broker credential (what an operator
 * error or a stolen broker seed would use). */
static struct evt_conn *
broker_conn(void)
{
    char url[256], seed[PATH_MAX + 64];
    struct evt_conn *c = NULL;
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    ck_assert_int_eq(stack_ident_seed_path(home, STACK_BROKER, "broker", seed,
                                           sizeof(seed)),
                     0);
    struct evt_connect_opts o = {.name = "up-test", .nkey_file = seed,
                                 .timeout_ms = 2000};
    ck_assert_int_eq(evt_connect(url, &o, &c, NULL), 0);
    return c;
}

/* `kscore status` exit code and whether its text names `word`. */
static int
status_says(const char *word, bool *said)
{
    struct fixture_out o;
    int st = ks(&o, (const char *[]){"status", NULL});
    *said = o.out && strstr(o.out, word) != NULL;
    fixture_out_release(&o);
    return st;
}

/*
 * The JetStream parts the brokers stand on are checked, not assumed: with
 * the broker stopped, a deleted events stream makes `kscore status` fail
 * naming it (on cf06db5 status said everything ran while nothing was
 * recorded); a running broker makes a deleted recorder consumer again
 * (issue 21), and commands are recorded again.
 */
START_TEST(status_fails_while_a_stream_is_gone_and_the_broker_remakes_it)
{
    bool said;
    ks_ok((const char *[]){"up", NULL});
    ck_assert_int_eq(status_says("MISSING", &said), 0);
    ck_assert(!said);

    kill_and_wait(pid_of("broker"));
    struct evt_conn *c = broker_conn();
    ck_assert_int_eq(js_DeleteStream(c->js, EVT_STREAM_EVENTS, NULL, NULL),
                     NATS_OK);
    ck_assert_int_eq(status_says("KSCORE_EVENTS", &said), 1);
    ck_assert_msg(said, "status does not name the missing stream");

    ks_ok((const char *[]){"up", NULL});
    ck_assert_int_eq(status_says("MISSING", &said), 0);
    exec_echo("stream-back");

    /* The running broker notices a deleted consumer and makes it again. */
    ck_assert_int_eq(js_DeleteConsumer(c->js, EVT_STREAM_EVENTS,
                                       EVT_RECORDER_DURABLE, NULL, NULL),
                     NATS_OK);
    unsigned missing = 1;
    for (int i = 0; i < 300 && missing; i++) {
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
        ck_assert_int_eq(evt_parts_missing(c, 2000, &missing), 0);
    }
    ck_assert_msg(missing == 0, "the recorder's consumer was not made again");
    exec_echo("consumer-back");
    evt_close(c);
}
END_TEST

START_TEST(nats_crash_comes_back_on_its_port)
{
    char url[256], url2[256];
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    char *before = secrets();
    pid_t nats = pid_of("nats"), agent = pid_of("agent"),
          broker = pid_of("broker");

    kill_and_wait(nats);
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url2, sizeof(url2));
    ck_assert_str_eq(url, url2);
    char *after = secrets();
    ck_assert_str_eq(before, after);
    ck_assert_int_ne(pid_of("nats"), nats);
    /* The broker and the agent reconnected by themselves. */
    ck_assert_int_eq(pid_of("agent"), agent);
    ck_assert_int_eq(pid_of("broker"), broker);
    exec_echo("nats-back");
    free(before);
    free(after);
}
END_TEST

/* `kscore up` right after PostgreSQL was killed: the postmaster may still
 * be a zombie (its parent, init, reaps when it will) and its backends still
 * on their way out; up once took the stale postmaster.pid for a running
 * server, "reloaded" it and failed. */
START_TEST(pg_crash_restarts_postgres_alone)
{
    ks_ok((const char *[]){"up", NULL});
    pid_t nats = pid_of("nats"), agent = pid_of("agent"),
          broker = pid_of("broker"), pg = pid_of("pg");

    ck_assert_int_eq(kill(pg, SIGKILL), 0);
    /* Dead as `up` sees it (gone or a zombie), not necessarily reaped. */
    for (int i = 0; i < 500 && stack_pidfile_alive(home, "pg", NULL); i++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    ks_ok((const char *[]){"up", NULL});
    ck_assert_int_ne(pid_of("pg"), pg);
    ck_assert_int_eq(pid_of("nats"), nats);
    ck_assert_int_eq(pid_of("agent"), agent);
    ck_assert_int_eq(pid_of("broker"), broker);
    exec_echo("pg-back");
}
END_TEST

START_TEST(down_up_keeps_the_port_or_says_it_moved)
{
    char url[256], url2[256], url3[256];
    struct fixture_out o;
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    char *before = secrets();

    ks_ok((const char *[]){"down", NULL});
    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url2, sizeof(url2));
    ck_assert_str_eq(url, url2);
    char *after = secrets();
    ck_assert_str_eq(before, after);

    /* Someone else took the port while the stack was down. */
    ks_ok((const char *[]){"down", NULL});
    int port = atoi(strrchr(url, ':') + 1);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1; /* past the TIME_WAIT sockets of the stopped server */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    ck_assert_int_eq(listen(fd, 1), 0);
    ck_assert_int_eq(ks(&o, (const char *[]){"up", NULL}), 0);
    ck_assert_msg(strstr(o.err, "is taken") != NULL, "%s", o.err);
    fixture_out_release(&o);
    close(fd);
    env_value("KSCORE_NATS_URL", url3, sizeof(url3));
    ck_assert_str_ne(url, url3);
    exec_echo("moved");
    free(before);
    free(after);
}
END_TEST

/* `kscore status --json` for home, parsed. */
static json_t *
status_json(void)
{
    struct fixture_out o;
    ks(&o, (const char *[]){"status", "--json", NULL});
    json_t *j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j != NULL, "status --json: %s / %s", o.out, o.err);
    fixture_out_release(&o);
    return j;
}

/* The agent id's entry in j["agents"], or NULL. */
static json_t *
agent_in(json_t *j, const char *id)
{
    json_t *arr = json_object_get(j, "agents"), *a;
    size_t i;
    json_array_foreach(arr, i, a)
    {
        if (strcmp(json_string_value(json_object_get(a, "agent_id")), id) == 0)
            return a;
    }
    return NULL;
}

START_TEST(status_reports_remote_agents)
{
    struct stack_identity sid;
    char seed[PATH_MAX + 64], trust[PATH_MAX + 32], state[PATH_MAX + 32],
        url[256], exe[PATH_MAX];
    pid_t pid;

    ks_ok((const char *[]){"up", NULL});
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    /* An agent of another host: its own identity, its own process, the
     * stack's NATS over TCP. */
    ck_assert_int_eq(stack_ident_add(home, STACK_AGENT, "agent-far-1", &sid),
                     0);
    ck_assert_int_eq(stack_nats_auth_write(home, home), 0);
    ck_assert_int_eq(stack_nats_reload(home, 5000), 0);
    ck_assert_int_eq(stack_ident_seed_path(home, STACK_AGENT, "agent-far-1",
                                           seed, sizeof(seed)),
                     0);
    snprintf(trust, sizeof(trust), "%s/keys/broker.pub", home);
    snprintf(state, sizeof(state), "%s/far-1", tmpdir);
    snprintf(exe, sizeof(exe), "%s",
             getenv("KSCORE_BIN") ? getenv("KSCORE_BIN") : "kscore");
    char *argv[] = {exe,     "agent",        "--id",      "far-1",
                    "--nats", url,           "--nkey",    seed,
                    "--trust-key", trust,    "--state-dir", state,
                    "--label", "site=far",   "--max-concurrent", "3",
                    "--config", "/dev/null", NULL};
    ck_assert_int_eq(stack_daemon(tmpdir, "far", argv, &pid), 0);

    json_t *j = NULL, *a = NULL;
    for (int i = 0; i < 150; i++) {
        json_decref(j);
        j = status_json();
        a = agent_in(j, "far-1");
        if (a && json_is_true(json_object_get(a, "online")))
            break;
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
    ck_assert_msg(a != NULL, "far-1 not in status: %s",
                  json_dumps(j, 0));
    ck_assert(json_is_true(json_object_get(a, "online")));
    ck_assert(json_is_false(json_object_get(a, "local")));
    ck_assert_str_eq(json_string_value(json_object_get(a, "version")),
                     "0.1.0");
    ck_assert_int_eq(json_integer_value(json_object_get(a, "running")), 0);
    ck_assert_int_eq(json_integer_value(json_object_get(a, "max_concurrent")),
                     3);
    ck_assert_str_eq(json_string_value(json_object_get(
                         json_object_get(a, "labels"), "site")),
                     "far");
    ck_assert_int_gt(strlen(json_string_value(json_object_get(a, "last_seen"))),
                     0);
    /* the local agent is there too, and says it is local */
    char local[128];
    env_value("KSCORE_AGENT", local, sizeof(local));
    json_t *l = agent_in(j, local);
    ck_assert_ptr_nonnull(l);
    ck_assert(json_is_true(json_object_get(l, "local")));
    ck_assert(json_is_true(json_object_get(l, "online")));
    ck_assert(json_is_true(json_object_get(j, "running")));
    json_decref(j);

    /* Text: one row per agent. */
    struct fixture_out o;
    ck_assert_int_eq(ks(&o, (const char *[]){"status", NULL}), 0);
    ck_assert_ptr_nonnull(strstr(o.out, "far-1"));
    ck_assert_ptr_nonnull(strstr(o.out, "online"));
    ck_assert_ptr_nonnull(strstr(o.out, "0/3"));
    fixture_out_release(&o);

    /* It dies: it is reported offline, with when it was last seen. */
    ck_assert_int_eq(kill(pid, SIGKILL), 0);
    j = NULL;
    for (int i = 0; i < 300; i++) {
        json_decref(j);
        j = status_json();
        a = agent_in(j, "far-1");
        if (a && json_is_false(json_object_get(a, "online")))
            break;
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
    ck_assert_msg(a && json_is_false(json_object_get(a, "online")),
                  "far-1 still online: %s", json_dumps(j, 0));
    ck_assert_int_ge(json_integer_value(json_object_get(a, "last_seen_ago_ms")),
                     1000);
    json_decref(j);
    stack_stop(tmpdir, "far", 5000);
}
END_TEST

/* agent id's labels in status --json once it is online (waits up to 30 s
 * for that), as "k=v,..." into buf ("" for none). */
static void
online_labels(const char *id, char *buf, size_t cap)
{
    json_t *j = NULL, *a = NULL;
    for (int i = 0; i < 300; i++) {
        json_decref(j);
        j = status_json();
        a = agent_in(j, id);
        if (a && json_is_true(json_object_get(a, "online")))
            break;
        nanosleep(&(struct timespec){0, 100000000}, NULL);
    }
    ck_assert_msg(a && json_is_true(json_object_get(a, "online")),
                  "%s not online: %s", id, json_dumps(j, 0));
    const char *k;
    json_t *v;
    size_t at = 0;
    buf[0] = '\0';
    json_object_foreach(json_object_get(a, "labels"), k, v)
    {
        at += (size_t)snprintf(buf + at, cap - at, "%s%s=%s", at ? "," : "",
                               k, json_string_value(v));
        if (at >= cap)
            break;
    }
    json_decref(j);
}

/*
 * Issue 21, tried again: a loopback stack started its broker with
 * --allow-unsigned-labels, so whoever held an enrolled agent's bundle
 * (env=dev) could take the signature lines out, declare env=prod and get
 * prod's batches and secrets: at once when the broker had not seen the
 * signed entry yet, or after any broker restart (it remembered signed
 * ids in memory only). A stack with enrolled agents takes signed labels
 * only: the running broker is restarted so by the enrolment, and every
 * later `up` starts it so.
 */
START_TEST(an_enrolled_bundle_without_its_signature_gets_no_labels)
{
    char bundle[PATH_MAX + 32], stripped[PATH_MAX + 32], state[PATH_MAX + 32],
        exe[PATH_MAX], labels[256];
    pid_t pid;

    ks_ok((const char *[]){"up", NULL});
    snprintf(bundle, sizeof(bundle), "%s/ee.bundle", tmpdir);
    snprintf(stripped, sizeof(stripped), "%s/ee-stripped.bundle", tmpdir);
    snprintf(state, sizeof(state), "%s/ee-state", tmpdir);
    ks_ok((const char *[]){"agent", "enroll", "ee", "--label", "env=dev",
                           "--out", bundle, NULL});
    ck_assert_int_eq(
        fixture_bundle_strip_labels(bundle, stripped, "env=dev", "env=prod"),
        0);
    snprintf(exe, sizeof(exe), "%s",
             getenv("KSCORE_BIN") ? getenv("KSCORE_BIN") : "kscore");
    char *argv[] = {exe,           "agent", "--bundle", stripped,
                    "--state-dir", state,   "--config", "/dev/null",
                    NULL};
    ck_assert_int_eq(stack_daemon(tmpdir, "ee", argv, &pid), 0);
    online_labels("ee", labels, sizeof(labels));
    ck_assert_msg(labels[0] == '\0', "the stripped bundle got labels %s",
                  labels);
    /* Nor after a broker restart, or a later `up`. */
    kill_and_wait(pid_of("broker"));
    ks_ok((const char *[]){"up", NULL});
    online_labels("ee", labels, sizeof(labels));
    ck_assert_msg(labels[0] == '\0',
                  "the stripped bundle got labels %s after a restart",
                  labels);
    stack_stop(tmpdir, "ee", 5000);
}
END_TEST

/* ---- kscore-stack.service -------------------------------------------------
 * The control host's unit runs `kscore up $KSCORE_UP_ARGS` (start and
 * reload) and `kscore down` (stop). Here: exactly those command lines,
 * read from the unit the build configured (deploy/kscore-stack.service),
 * with the arguments the package ships in /etc/default/kscore-stack, the
 * binary of this build for the installed path and a temporary home for
 * /var/lib/kscore/stack; no TTY, and JOURNAL_STREAM set as systemd sets it. */

#define UNIT_ARGS_MAX 32

/* The words of the unit's KEY= line, $KSCORE_UP_ARGS split on blanks as
 * systemd splits an unbraced variable that is a word of its own; the
 * binary is dropped (the fixture runs this build's). */
static void
unit_command(const char *unit_text, const char *key, const char *up_args,
             char store[1024], const char *argv[UNIT_ARGS_MAX])
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\n%s=", key);
    const char *p = strstr(unit_text, pat);
    ck_assert_msg(p != NULL, "no %s= in the unit", key);
    p += strlen(pat);
    size_t len = strcspn(p, "\n"), n = 0, used = 0;
    char line[512];
    ck_assert_uint_lt(len, sizeof(line));
    memcpy(line, p, len);
    line[len] = '\0';
    char *save = NULL;
    for (char *w = strtok_r(line, " \t", &save); w;
         w = strtok_r(NULL, " \t", &save)) {
        if (n == 0 && used == 0 && argv[0] == NULL) {
            const char *b = strrchr(w, '/');
            ck_assert_msg(w[0] == '/' && b && strcmp(b, "/kscore") == 0,
                          "%s= runs %s, not an absolute kscore", key, w);
            argv[0] = "";
            continue;
        }
        char words[512];
        snprintf(words, sizeof(words), "%s",
                 strcmp(w, "$KSCORE_UP_ARGS") == 0 ? up_args : w);
        ck_assert_msg(strchr(words, '$') == NULL, "%s=: unknown %s", key,
                      words);
        char *s2 = NULL;
        for (char *a = strtok_r(words, " \t", &s2); a;
             a = strtok_r(NULL, " \t", &s2)) {
            size_t al = strlen(a) + 1;
            ck_assert_uint_lt(n, UNIT_ARGS_MAX - 1);
            ck_assert_uint_le(used + al, 1024);
            memcpy(store + used, a, al);
            argv[n++] = store + used;
            used += al;
        }
    }
    argv[n] = NULL;
}

/* KSCORE_UP_ARGS="..." of the shipped /etc/default/kscore-stack. */
static void
shipped_up_args(char *buf, size_t cap)
{
    const char *src = getenv("KSCORE_SOURCE_DIR");
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/deploy/etc/default/kscore-stack",
             src && *src ? src : ".");
    char *s = slurp(path);
    char *p = strstr(s, "\nKSCORE_UP_ARGS=\"");
    ck_assert_msg(p != NULL, "no KSCORE_UP_ARGS=\"...\" line in %s", path);
    p += strlen("\nKSCORE_UP_ARGS=\"");
    char *q = strchr(p, '"');
    ck_assert_ptr_nonnull(q);
    snprintf(buf, cap, "%.*s", (int)(q - p), p);
    free(s);
}

static void
run_unit_command(const char *key, const char *const argv[])
{
    struct fixture_out o;
    int st = ks(&o, argv);
    ck_assert_msg(st == 0, "%s=kscore %s: exit %d: %s", key, argv[0], st,
                  o.err);
    fixture_out_release(&o);
}

START_TEST(stack_unit_commands_start_reload_and_stop_the_stack)
{
    static const char *const parts[] = {"nats", "pg", "broker", "agent"};
    const char *bin = getenv("KSCORE_BIN");
    char unit[PATH_MAX], up_args[256];
    char start_s[1024], reload_s[1024], stop_s[1024];
    const char *start[UNIT_ARGS_MAX] = {0}, *reload[UNIT_ARGS_MAX] = {0},
               *stop[UNIT_ARGS_MAX] = {0};

    ck_assert_msg(bin && strlen(bin) > strlen("/cli/kscore") &&
                      strcmp(bin + strlen(bin) - strlen("/cli/kscore"),
                             "/cli/kscore") == 0,
                  "KSCORE_BIN (%s) is not <build>/cli/kscore",
                  bin ? bin : "unset");
    snprintf(unit, sizeof(unit), "%.*s/deploy/kscore-stack.service",
             (int)(strlen(bin) - strlen("/cli/kscore")), bin);
    char *text = slurp(unit);
    ck_assert_ptr_nonnull(strstr(text, "\nType=oneshot\n"));
    ck_assert_ptr_nonnull(strstr(text, "\nRemainAfterExit=yes\n"));
    ck_assert_ptr_nonnull(
        strstr(text, "\nEnvironment=KSCORE_HOME=/var/lib/kscore/stack\n"));
    shipped_up_args(up_args, sizeof(up_args));
    unit_command(text, "ExecStart", up_args, start_s, start);
    unit_command(text, "ExecReload", up_args, reload_s, reload);
    unit_command(text, "ExecStop", up_args, stop_s, stop);
    free(text);
    ck_assert_str_eq(start[0], "up");
    ck_assert_str_eq(stop[0], "down");

    /* As systemd runs it: stderr is the journal (the daemons' is their
     * log file, so they see it is not), stdin /dev/null. */
    setenv("JOURNAL_STREAM", "8:123456", 1);
    setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef", 1);

    run_unit_command("ExecStart", start);
    pid_t pids[4];
    for (size_t i = 0; i < 4; i++)
        pids[i] = pid_of(parts[i]);
    exec_echo("unit-up");

    /* The watch's reload of a whole stack changes nothing. */
    run_unit_command("ExecReload", reload);
    for (size_t i = 0; i < 4; i++)
        ck_assert_int_eq(pid_of(parts[i]), pids[i]);

    /* A dead broker: the reload brings it (and nothing else) back. */
    kill_and_wait(pids[2]);
    run_unit_command("ExecReload", reload);
    ck_assert_int_ne(pid_of("broker"), pids[2]);
    ck_assert_int_eq(pid_of("nats"), pids[0]);
    ck_assert_int_eq(pid_of("pg"), pids[1]);
    ck_assert_int_eq(pid_of("agent"), pids[3]);
    exec_echo("unit-reloaded");

    /* The daemons log to their files, not to the unit's journal. */
    char logp[PATH_MAX + 32];
    struct stat lst;
    snprintf(logp, sizeof(logp), "%s/broker.log", home);
    ck_assert_int_eq(stat(logp, &lst), 0);
    ck_assert_int_gt(lst.st_size, 0);

    run_unit_command("ExecStop", stop);
    for (size_t i = 0; i < 4; i++)
        ck_assert_msg(!stack_pidfile_alive(home, parts[i], NULL),
                      "%s still runs after ExecStop", parts[i]);
    for (size_t i = 0; i < 4; i++)
        ck_assert_msg(!stack_pid_alive(pids[i]) || i == 2,
                      "%s (pid %d) still runs after ExecStop", parts[i],
                      (int)pids[i]);
    unsetenv("JOURNAL_STREAM");
    unsetenv("INVOCATION_ID");
}
END_TEST

/* Writes "<pid>\n" + what followed the first line of path. */
static void
repoint_pidfile(const char *path, pid_t pid)
{
    char *s = slurp(path);
    char *rest = strchr(s, '\n');
    FILE *f = fopen(path, "we");
    ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
    fprintf(f, "%d\n%s", (int)pid, rest ? rest + 1 : "");
    ck_assert_int_eq(fclose(f), 0);
    free(s);
}

/* Power loss, then a reboot: no `down` ran, so every pid file is still
 * there, and the new boot gave some of those pids to other processes.
 * `up` (the unit's ExecStart at boot) must start every part, not take
 * the stranger for nats-server or PostgreSQL (nor SIGHUP it through
 * pg_ctl reload), and `down` must never signal it. */
START_TEST(pid_files_of_another_boot_are_forgotten)
{
    static const char *const parts[] = {"agent", "broker", "nats"};
    char path[PATH_MAX + 64];
    ks_ok((const char *[]){"up", NULL});
    pid_t pg = pid_of("pg");
    for (size_t i = 0; i < 3; i++)
        kill_and_wait(pid_of(parts[i]));
    ck_assert_int_eq(kill(pg, SIGKILL), 0);
    /* Gone, as after a reboot (not a zombie init has yet to reap). */
    for (int i = 0; i < 1000 && kill(pg, 0) == 0; i++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }

    /* The stranger: a process of the new boot with an old part's pid. */
    pid_t stranger = fork();
    ck_assert_int_ge(stranger, 0);
    if (stranger == 0) {
        /* gone with this test's process, however it ends */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execl("/bin/sleep", "sleep", "600", (char *)NULL);
        _exit(127);
    }
    snprintf(path, sizeof(path), "%s/nats.pid", home);
    repoint_pidfile(path, stranger);
    snprintf(path, sizeof(path), "%s/pg.pid", home);
    repoint_pidfile(path, stranger);
    snprintf(path, sizeof(path), "%s/pg/postmaster.pid", home);
    repoint_pidfile(path, stranger);
    snprintf(path, sizeof(path), "%s/pg.port", home);
    char *port = slurp(path);
    snprintf(path, sizeof(path), "%s/pgsock/.s.PGSQL.%d.lock", home,
             atoi(port));
    free(port);
    repoint_pidfile(path, stranger);
    snprintf(path, sizeof(path), "%s/boot_id", home);
    FILE *f = fopen(path, "we");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "00000000-0000-4000-8000-000000000000\n");
    ck_assert_int_eq(fclose(f), 0);

    ks_ok((const char *[]){"up", NULL});
    ck_assert_int_ne(pid_of("nats"), stranger);
    ck_assert_int_ne(pid_of("pg"), stranger);
    exec_echo("rebooted");
    ck_assert_int_eq(waitpid(stranger, NULL, WNOHANG), 0);

    /* The same with `down` (e.g. `systemctl stop` of a unit that ran). */
    ks_ok((const char *[]){"down", NULL});
    snprintf(path, sizeof(path), "%s/broker.pid", home);
    f = fopen(path, "we");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "%d\n", (int)stranger);
    ck_assert_int_eq(fclose(f), 0);
    snprintf(path, sizeof(path), "%s/boot_id", home);
    f = fopen(path, "we");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "00000000-0000-4000-8000-000000000000\n");
    ck_assert_int_eq(fclose(f), 0);
    ks_ok((const char *[]){"down", NULL});
    ck_assert_int_eq(waitpid(stranger, NULL, WNOHANG), 0);
    kill(stranger, SIGKILL);
    waitpid(stranger, NULL, 0);
}
END_TEST


/* ---- the stack's operator policy (`up --policy`, issue 21) ----------------
 *
 * The policy lets only alice (not this login's operator, which `up` made),
 * so an exec of ours is denied while it is loaded. Its bytes' SHA-256,
 * from sha256sum(1), is what status must name. */
#define POLICY_TEXT "{\"operators\": {\"alice\": [{\"agents\": \"*\"}]}}\n"
#define POLICY_SHA256                                                      \
    "47d743f740676514d0e6108c8bf3f55d326a61eec988155a543c21a684eb043d"

static void
write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "we");
    ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_int_eq(chmod(path, mode), 0);
}

static void
policy_path(char *buf, size_t len)
{
    snprintf(buf, len, "%s/policy-alice.json", tmpdir);
}

/* An exec of this login's operator: denied (125, "not in the policy"). */
static void
exec_denied(void)
{
    struct fixture_out o;
    int st = ks(&o, (const char *[]){"exec", "--timeout", "20s", "--", "echo",
                                     "no", NULL});
    ck_assert_msg(st == 125 && strstr(o.err, "not in the policy"),
                  "exec outside the policy: exit %d: %s%s", st, o.out, o.err);
    fixture_out_release(&o);
}

START_TEST(policy_outlives_down_and_a_broker_restart)
{
    char pol[PATH_MAX + 32], bad[PATH_MAX + 32];
    struct fixture_out o;

    /* A bad file is a usage error naming what is wrong, before anything
     * starts. */
    snprintf(bad, sizeof(bad), "%s/bad.json", tmpdir);
    write_file(bad, "{\"operators\": {\"bob\": {}}}\n", 0600);
    ck_assert_int_eq(ks(&o, (const char *[]){"up", "--policy", bad, NULL}), 2);
    ck_assert_msg(strstr(o.err, bad) && strstr(o.err, "bob"), "%s", o.err);
    fixture_out_release(&o);
    ck_assert(!stack_pidfile_alive(home, "nats", NULL));
    ck_assert(!stack_pidfile_alive(home, "broker", NULL));

    policy_path(pol, sizeof(pol));
    write_file(pol, POLICY_TEXT, 0600);
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    exec_denied();

    /* The restart of the finding: down, then up without the flag. */
    ks_ok((const char *[]){"down", NULL});
    ks_ok((const char *[]){"up", NULL});
    exec_denied();

    /* A broker that died, started again by up (the unit's reload). */
    kill_and_wait(pid_of("broker"));
    ks_ok((const char *[]){"up", NULL});
    exec_denied();

    /* An edit of the original (one that would let us in) changes nothing
     * until up --policy again: the stack runs its copy. */
    char mine[512];
    struct passwd *pw = getpwuid(getuid());
    ck_assert_ptr_nonnull(pw);
    snprintf(mine, sizeof(mine),
             "{\"operators\": {\"%s\": [{\"agents\": \"*\"}]}}\n",
             pw->pw_name);
    write_file(pol, mine, 0600);
    kill_and_wait(pid_of("broker"));
    ks_ok((const char *[]){"up", NULL});
    exec_denied();
    write_file(pol, POLICY_TEXT, 0600);
}
END_TEST

/* The finding as a new operator met it: KSCORE_POLICY when the stack
 * first came up, and after a restart without it every operator was
 * root. */
START_TEST(policy_from_the_environment_outlives_a_restart)
{
    char pol[PATH_MAX + 32];

    policy_path(pol, sizeof(pol));
    write_file(pol, POLICY_TEXT, 0600);
    setenv("KSCORE_POLICY", pol, 1);
    ks_ok((const char *[]){"up", NULL});
    unsetenv("KSCORE_POLICY");
    exec_denied();
    ks_ok((const char *[]){"down", NULL});
    ks_ok((const char *[]){"up", NULL});
    exec_denied();
}
END_TEST

START_TEST(status_names_the_loaded_policy)
{
    char pol[PATH_MAX + 32], logp[PATH_MAX + 32];
    struct fixture_out o;

    policy_path(pol, sizeof(pol));
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    /* The same policy again (the unit's KSCORE_UP_ARGS at each reload):
     * the broker that runs with it stays. */
    pid_t broker = pid_of("broker");
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    ck_assert_int_eq(pid_of("broker"), broker);
    ck_assert_int_eq(ks(&o, (const char *[]){"up", "--policy", pol,
                                             "--no-policy", NULL}),
                     2);
    fixture_out_release(&o);
    json_t *j = status_json();
    json_t *p = json_object_get(j, "policy");
    ck_assert_msg(json_is_object(p), "no policy in status --json");
    ck_assert(json_is_true(json_object_get(p, "configured")));
    ck_assert_str_eq(json_string_value(json_object_get(p, "sha256")),
                     POLICY_SHA256);
    ck_assert(json_is_null(json_object_get(p, "error")));
    /* What the running broker says it loaded, not only the file. */
    ck_assert_str_eq(json_string_value(json_object_get(
                         json_object_get(p, "loaded"), "broker")),
                     POLICY_SHA256);
    json_decref(j);

    ks(&o, (const char *[]){"status", NULL});
    ck_assert_msg(strstr(o.out, "policy: ") &&
                      strstr(o.out, "sha256 " POLICY_SHA256) &&
                      strstr(o.out, "broker loaded it"),
                  "%s", o.out);
    fixture_out_release(&o);

    snprintf(logp, sizeof(logp), "%s/broker.log", home);
    char *log = slurp(logp);
    ck_assert_msg(strstr(log, "policy loaded") &&
                      strstr(log, "sha256=" POLICY_SHA256),
                  "the broker's log names no policy");
    free(log);
}
END_TEST

START_TEST(a_policy_that_cannot_load_stops_the_broker)
{
    char copy[PATH_MAX + 32], pol[PATH_MAX + 32];
    struct fixture_out o;

    policy_path(pol, sizeof(pol));
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    snprintf(copy, sizeof(copy), "%s/policy.json", home);

    /* The stack's copy turned into something that is no policy. */
    kill_and_wait(pid_of("broker"));
    write_file(copy, "{\"operators\": ", 0600);
    ck_assert_int_eq(ks(&o, (const char *[]){"up", NULL}), 125);
    ck_assert_msg(strstr(o.err, "policy cannot be loaded"), "%s", o.err);
    fixture_out_release(&o);
    ck_assert(!stack_pidfile_alive(home, "broker", NULL));
    ks(&o, (const char *[]){"status", NULL});
    ck_assert_msg(strstr(o.out, "CANNOT BE LOADED"), "%s", o.out);
    fixture_out_release(&o);

    /* Gone altogether: never "no policy". */
    ck_assert_int_eq(unlink(copy), 0);
    ck_assert_int_eq(ks(&o, (const char *[]){"up", NULL}), 125);
    ck_assert_msg(strstr(o.err, "No such file"), "%s", o.err);
    fixture_out_release(&o);
    ck_assert(!stack_pidfile_alive(home, "broker", NULL));

    /* The broker itself, given a policy it cannot parse, does not serve. */
    char url[256], db[512];
    env_value("KSCORE_NATS_URL", url, sizeof(url));
    env_value("KSCORE_DB", db, sizeof(db));
    write_file(copy, "[]\n", 0600);
    char key[PATH_MAX + 32];
    snprintf(key, sizeof(key), "%s/keys/broker.key", home);
    ck_assert_int_eq(ks(&o, (const char *[]){"broker", "--nats", url, "--db",
                                             db, "--signing-key", key,
                                             "--config", "/dev/null",
                                             "--policy", copy, NULL}),
                     125);
    ck_assert_msg(strstr(o.err, "bad policy") && strstr(o.err, copy), "%s",
                  o.err);
    fixture_out_release(&o);

    /* up --policy again repairs it. */
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    exec_denied();
}
END_TEST

START_TEST(no_policy_clears_it)
{
    char pol[PATH_MAX + 32];
    struct fixture_out o;

    policy_path(pol, sizeof(pol));
    ks_ok((const char *[]){"up", "--policy", pol, NULL});
    exec_denied();
    pid_t broker = pid_of("broker");

    /* On a running stack: its broker starts again without one. */
    ks_ok((const char *[]){"up", "--no-policy", NULL});
    ck_assert_int_ne(pid_of("broker"), broker);
    exec_echo("no-policy");
    ks(&o, (const char *[]){"status", NULL});
    ck_assert_msg(
        strstr(o.out, "policy: none (every operator may run anything)"), "%s",
        o.out);
    fixture_out_release(&o);

    ks_ok((const char *[]){"down", NULL});
    ks_ok((const char *[]){"up", NULL});
    exec_echo("still-none");
    json_t *j = status_json();
    json_t *p = json_object_get(j, "policy");
    ck_assert(json_is_false(json_object_get(p, "configured")));
    ck_assert(json_is_null(json_object_get(p, "sha256")));
    json_decref(j);
}
END_TEST

static Suite *
stack_up_suite(void)
{
    Suite *s = suite_create("stack_up");
    TCase *tc = tcase_create("up");
    tcase_add_unchecked_fixture(tc, up_setup, up_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, broker_crash_restarts_the_broker_alone);
    tcase_add_test(tc, status_fails_while_a_stream_is_gone_and_the_broker_remakes_it);
    tcase_add_test(tc, nats_crash_comes_back_on_its_port);
    tcase_add_test(tc, pg_crash_restarts_postgres_alone);
    tcase_add_test(tc, down_up_keeps_the_port_or_says_it_moved);
    tcase_add_test(tc, status_reports_remote_agents);
    tcase_add_test(tc, stack_unit_commands_start_reload_and_stop_the_stack);
    tcase_add_test(tc, pid_files_of_another_boot_are_forgotten);
    suite_add_tcase(s, tc);
    /* A home of its own: its agents are enrolled. */
    tc = tcase_create("enrolled");
    tcase_add_unchecked_fixture(tc, up_setup, up_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, an_enrolled_bundle_without_its_signature_gets_no_labels);
    suite_add_tcase(s, tc);
    /* A home of its own each: these change the stack's policy. */
    tc = tcase_create("policy-env");
    tcase_add_unchecked_fixture(tc, up_setup, up_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, policy_from_the_environment_outlives_a_restart);
    suite_add_tcase(s, tc);
    tc = tcase_create("policy");
    tcase_add_unchecked_fixture(tc, up_setup, up_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, policy_outlives_down_and_a_broker_restart);
    tcase_add_test(tc, status_names_the_loaded_policy);
    tcase_add_test(tc, a_policy_that_cannot_load_stops_the_broker);
    tcase_add_test(tc, no_policy_clears_it);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(stack_up_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
