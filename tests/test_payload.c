/*
 * What an operator sends besides argv, end to end through the real stack
 * (the kscore binary as broker, agent and client, a private nats-server
 * and PostgreSQL, real child processes): --script FILE, stdin, --run-as
 * USER[:GROUP], and the policy's run_as rule (docs/scripts-and-files.md,
 * docs/security.md "Running as a user").
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <jansson.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <libpq-fe.h>
#include <openssl/evp.h>

#include "broker.h"
#include "events.h"
#include "fixture.h"
#include "store.h"

#define AGENT "pl-agent"

static struct fixture_stack stack;
static char tmpdir[PATH_MAX];
/* A real unprivileged user made for the suite (useradd), with a
 * supplementary group of its own, removed at the end. */
static char tuser[32], tgroup[32];
static bool have_tuser;

static void
run_sh(const char *cmd)
{
    if (system(cmd) != 0)
        fprintf(stderr, "failed: %s\n", cmd);
}

static void
users_up(void)
{
    char cmd[256];
    snprintf(tuser, sizeof(tuser), "kst%ld", (long)getpid());
    snprintf(tgroup, sizeof(tgroup), "kstg%ld", (long)getpid());
    snprintf(cmd, sizeof(cmd),
             "groupadd %s && useradd -M -N -g nogroup -G %s -d /home/%s %s",
             tgroup, tgroup, tuser, tuser);
    have_tuser = system(cmd) == 0;
}

static void
users_down(void)
{
    char cmd[256];
    if (!have_tuser)
        return;
    snprintf(cmd, sizeof(cmd), "userdel %s; groupdel %s", tuser, tgroup);
    run_sh(cmd);
}

static void
stack_up(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kscore-pl-XXXXXX");
    if (!mkdtemp(tmpdir) || chmod(tmpdir, 0755) != 0)
        exit(1);
    users_up();
    /* One agent process, two in-process agents for the batches. */
    if (fixture_stack_start(&stack, AGENT, 2) != 0) {
        fprintf(stderr, "cannot start the stack\n");
        fixture_stack_stop(&stack);
        users_down();
        exit(1);
    }
}

static void
stack_down(void)
{
    char cmd[PATH_MAX + 16];
    fixture_stack_stop(&stack);
    users_down();
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    run_sh(cmd);
}

/* Writes len bytes to tmpdir/name; returns the path (static per call). */
static const char *
put_file(const char *name, const void *data, size_t len)
{
    static char paths[8][PATH_MAX + 64];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, PATH_MAX + 64, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, len, f), len);
    ck_assert_int_eq(fclose(f), 0);
    return p;
}

static void
sha256_hex(const void *data, size_t len, char hex[65])
{
    unsigned char md[32];
    unsigned int n = 0;
    ck_assert_int_eq(EVP_Digest(data, len, md, &n, EVP_sha256(), NULL), 1);
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
}

static json_t *
parse_json(const struct fixture_out *o)
{
    json_error_t err;
    json_t *j = json_loads(o->out, 0, &err);
    ck_assert_msg(j != NULL, "not JSON: %s (stderr %s)", o->out, o->err);
    return j;
}

static const char *
jstr(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    ck_assert_msg(s != NULL, "no string %s", k);
    return s;
}

static long
sql_long(const char *sql)
{
    return fixture_sql_long(stack.pg.conninfo, sql);
}

/* The in-process agent number i: "<host>-i". */
static const char *
local_agent(int i)
{
    static char id[2][96];
    char host[64];
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(id[i], sizeof(id[i]), "%s-%d", host, i);
    return id[i];
}

/* The directory part of path (in place). */
static char *
dir_of(char *path)
{
    char *slash = strrchr(path, '/');
    if (slash)
        *slash = '\0';
    return path;
}

/* ---- --script ------------------------------------------------------------ */

START_TEST(script_runs_by_its_interpreter_with_args_and_goes_away)
{
    static const char script[] =
        "#!/bin/sh\n"
        "echo \"argc=$# 1=$1 2=$2\"\n"
        "echo \"$0\"\n"
        "stat -c '%a %U' \"$0\" \"$(dirname \"$0\")\"\n";
    const char *path = put_file("show.sh", script, sizeof(script) - 1);
    struct fixture_out o;
    const char *args[] = {"exec",   "--agent", AGENT, "--json", "--script",
                          path,     "one",     "two words",       NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    json_t *j = parse_json(&o);
    char out[1024];
    snprintf(out, sizeof(out), "%s", jstr(j, "stdout"));
    /* $1.. are the arguments after the file; $0 its private copy, named
     * as the file, in a 0700 directory, the file 0500, both root's (the
     * agent's user). */
    ck_assert_msg(strncmp(out, "argc=2 1=one 2=two words\n", 25) == 0, "%s",
                  out);
    char *line2 = strchr(out, '\n') + 1;
    char *end2 = strchr(line2, '\n');
    *end2 = '\0';
    ck_assert_msg(strstr(line2, "/kscore-agent-") && strstr(line2, "/show.sh"),
                  "%s", line2);
    ck_assert_msg(strstr(end2 + 1, "500 root\n700 root\n") == end2 + 1, "%s",
                  end2 + 1);
    /* Removed once it ended: the file and its directory. */
    struct stat st;
    ck_assert_int_eq(stat(line2, &st), -1);
    ck_assert_int_eq(stat(dir_of(line2), &st), -1);
    ck_assert_int_eq(errno, ENOENT);
    json_decref(j);
    fixture_out_release(&o);
}
END_TEST

START_TEST(script_without_shebang_runs_by_sh_and_a_shebang_argument_counts)
{
    static const char plain[] = "echo \"plain $1\"\n";
    const char *p1 = put_file("plain", plain, sizeof(plain) - 1);
    struct fixture_out o;
    const char *a1[] = {"exec", "--agent", AGENT, "--script", p1, "--",
                        "-x", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_str_eq(o.out, "plain -x\n");
    fixture_out_release(&o);

    /* "#!/bin/sh -e": the interpreter's own argument: false stops it. */
    static const char strict[] = "#!/bin/sh -e\nfalse\necho not reached\n";
    const char *p2 = put_file("strict.sh", strict, sizeof(strict) - 1);
    const char *a2[] = {"exec", "--agent", AGENT, "--script", p2, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 1);
    ck_assert_str_eq(o.out, "");
    fixture_out_release(&o);
}
END_TEST

/* The issue's case: a 200 KB script cannot travel as `sh -c "$(cat s)"`
 * (E2BIG, exit 126); as --script it runs. Past the cap it is refused
 * before anything is sent or recorded. */
START_TEST(a_large_script_runs_and_one_past_the_cap_is_refused)
{
    size_t n = 300 * 1024;
    char *big = malloc(n + 64);
    memcpy(big, "#!/bin/sh\n#", 11);
    memset(big + 11, 'x', n - 11);
    strcpy(big + n, "\necho big done\n");
    const char *p = put_file("big.sh", big, strlen(big));
    struct fixture_out o;
    const char *a1[] = {"exec", "--agent", AGENT, "--script", p, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_str_eq(o.out, "big done\n");
    fixture_out_release(&o);
    free(big);

    n = 600 * 1024;
    big = malloc(n);
    memset(big, '#', n);
    p = put_file("huge.sh", big, n);
    free(big);
    long before = sql_long("SELECT count(*) FROM commands");
    const char *a2[] = {"exec", "--agent", AGENT, "--script", p, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_msg(strstr(o.err, "larger than 512 KiB"), "%s", o.err);
    ck_assert_msg(strstr(o.err, "nothing was sent"), "%s", o.err);
    ck_assert_int_eq(sql_long("SELECT count(*) FROM commands"), before);
    fixture_out_release(&o);
}
END_TEST

/* The record keeps the script's checksum and size; get and events show
 * them, never the bytes. */
START_TEST(script_checksum_is_in_the_record_and_shown)
{
    static const char script[] = "#!/bin/sh\necho recorded\n";
    char hex[65];
    sha256_hex(script, sizeof(script) - 1, hex);
    const char *p = put_file("rec.sh", script, sizeof(script) - 1);
    struct fixture_out o;
    const char *a1[] = {"exec",   "--agent", AGENT, "--json",
                        "--script", p,       "arg", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    json_t *j = parse_json(&o);
    char id[40];
    snprintf(id, sizeof(id), "%s", jstr(j, "command_id"));
    json_decref(j);
    fixture_out_release(&o);

    const char *g[] = {"get", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, g, &o), 0);
    ck_assert_int_eq(o.status, 0);
    char want[160];
    snprintf(want, sizeof(want), "script    rec.sh (%zu bytes, sha256 %s)",
             sizeof(script) - 1, hex);
    ck_assert_msg(strstr(o.out, want), "%s", o.out);
    ck_assert_msg(strstr(o.out, "rec.sh arg"), "argv: %s", o.out);
    ck_assert_msg(!strstr(o.out, "echo recorded"), "%s", o.out);
    fixture_out_release(&o);

    const char *gj[] = {"get", id, "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, gj, &o), 0);
    j = parse_json(&o);
    json_t *s = json_object_get(j, "script");
    ck_assert_ptr_nonnull(s);
    ck_assert_str_eq(jstr(s, "sha256"), hex);
    ck_assert_str_eq(jstr(s, "name"), "rec.sh");
    ck_assert_int_eq(json_integer_value(json_object_get(s, "bytes")),
                     (json_int_t)(sizeof(script) - 1));
    json_decref(j);
    fixture_out_release(&o);

    const char *e[] = {"events", id, "--json", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, e, &o), 0);
    ck_assert_msg(strstr(o.out, hex), "%s", o.out);
    ck_assert_msg(!strstr(o.out, "echo recorded"), "%s", o.out);
    fixture_out_release(&o);
    /* The bytes themselves are in the record (the signed command). */
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT (position('echo recorded'::bytea in data) > 0)::int FROM "
             "events WHERE stream_id = 'command-%s' AND version = 1",
             id);
    ck_assert_int_eq(sql_long(sql), 1);
}
END_TEST

/* An idempotency key names one command: the same key with the same
 * script joins it, with other script bytes (the same name and arguments)
 * or another user it is refused, as another argv is. */
START_TEST(an_idempotency_key_names_one_script)
{
    struct fixture_out o;
    char key[64];
    snprintf(key, sizeof(key), "pl-key-%ld", (long)getpid());
    const char *p = put_file("idem.sh", "echo one\n", 9);
    const char *a[] = {"exec", "--agent", AGENT, "--idempotency-key", key,
                       "--script", p, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(o.out, "one\n");
    fixture_out_release(&o);
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(o.out, "one\n");
    fixture_out_release(&o);
    put_file("idem.sh", "echo two\n", 9);
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "already used for a different command"),
                  "%s", o.err);
    fixture_out_release(&o);
    put_file("idem.sh", "echo one\n", 9);
    const char *b[] = {"exec", "--agent", AGENT, "--idempotency-key", key,
                       "--run-as", "nobody", "--script", p, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, b, &o), 0);
    ck_assert_int_eq(o.status, 125);
    fixture_out_release(&o);
}
END_TEST

/* Reads the script's own path it wrote to tmpdir/name; waits for it. */
static void
wait_path(const char *name, char *out, size_t len)
{
    char p[PATH_MAX + 64];
    snprintf(p, sizeof(p), "%s/%s", tmpdir, name);
    for (int i = 0; i < 200; i++) {
        FILE *f = fopen(p, "r");
        if (f) {
            bool got = fgets(out, (int)len, f) != NULL;
            fclose(f);
            if (got && strchr(out, '\n')) {
                out[strcspn(out, "\n")] = '\0';
                return;
            }
        }
        usleep(50 * 1000);
    }
    ck_abort_msg("the script never wrote %s", p);
}

static bool
gone_within(const char *path, int ms)
{
    struct stat st;
    for (int i = 0; i < ms / 50; i++) {
        if (stat(path, &st) == -1 && errno == ENOENT)
            return true;
        usleep(50 * 1000);
    }
    return false;
}

START_TEST(script_file_goes_after_a_timeout_and_after_a_cancel)
{
    char script[PATH_MAX + 128], path[PATH_MAX];
    struct fixture_out o;
    snprintf(script, sizeof(script),
             "#!/bin/sh\necho \"$0\" > %s/to.path\nexec sleep 30\n", tmpdir);
    const char *p = put_file("to.sh", script, strlen(script));
    const char *a1[] = {"exec",   "--agent", AGENT, "--timeout", "1s",
                        "--script", p,       NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_int_eq(o.status, 124);
    fixture_out_release(&o);
    wait_path("to.path", path, sizeof(path));
    ck_assert_msg(gone_within(dir_of(path), 5000), "%s stays", path);

    snprintf(script, sizeof(script),
             "#!/bin/sh\necho \"$0\" > %s/cx.path\nexec sleep 30\n", tmpdir);
    p = put_file("cx.sh", script, strlen(script));
    const char *a2[] = {"exec", "--agent", AGENT, "--detach", "--script", p,
                        NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 0);
    char id[40];
    snprintf(id, sizeof(id), "%.36s", o.out);
    fixture_out_release(&o);
    wait_path("cx.path", path, sizeof(path));
    const char *c[] = {"cancel", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, c, &o), 0);
    fixture_out_release(&o);
    ck_assert_msg(gone_within(dir_of(path), 10000), "%s stays", path);
}
END_TEST

/* kill -9 of the agent: its watchdog kills the script, and the restarted
 * agent removes what the dead one left (its run dir, noted in its state
 * dir). */
START_TEST(a_restarted_agent_removes_what_the_last_run_left)
{
    char script[PATH_MAX + 128], path[PATH_MAX];
    struct fixture_out o;
    snprintf(script, sizeof(script),
             "#!/bin/sh\necho \"$0\" > %s/rs.path\nexec sleep 60\n", tmpdir);
    const char *p = put_file("rs.sh", script, strlen(script));
    const char *a[] = {"exec", "--agent", AGENT, "--detach", "--script", p,
                       NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
    wait_path("rs.path", path, sizeof(path));
    char run_dir[PATH_MAX];
    snprintf(run_dir, sizeof(run_dir), "%s", path);
    dir_of(dir_of(run_dir));
    fixture_stack_agent_kill(&stack, SIGKILL);
    struct stat st;
    ck_assert_int_eq(stat(run_dir, &st), 0); /* left behind */
    ck_assert_int_eq(fixture_stack_agent_start(&stack, NULL), 0);
    ck_assert_msg(gone_within(run_dir, 10000), "%s stays", run_dir);
}
END_TEST

/* ---- stdin ---------------------------------------------------------------- */

START_TEST(stdin_reaches_the_command_byte_for_byte)
{
    struct fixture_out o;
    const char *in = put_file("hello.in", "hello\n", 6);
    const char *a1[] = {"exec", "--agent", AGENT, "--", "cat", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a1, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    ck_assert_str_eq(o.out, "hello\n");
    fixture_out_release(&o);

    /* Binary, NUL included, larger than a pipe's buffer (64 KiB): the
     * agent writes it as the child reads. */
    size_t n = 200 * 1024;
    unsigned char *bin = malloc(n);
    for (size_t i = 0; i < n; i++)
        bin[i] = (unsigned char)(i * 7);
    char hex[65];
    sha256_hex(bin, n, hex);
    in = put_file("bin.in", bin, n);
    free(bin);
    const char *a2[] = {"exec", "--agent", AGENT, "--", "sha256sum", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a2, &o), 0);
    ck_assert_msg(o.status == 0, "%s", o.err);
    ck_assert_msg(strncmp(o.out, hex, 64) == 0, "%s vs %s", o.out, hex);
    fixture_out_release(&o);

    /* A command that reads a little and exits, and one that reads
     * nothing: both end at once (the agent's write meets EPIPE). */
    const char *a3[] = {"exec", "--agent", AGENT, "--", "head", "-c", "3",
                        NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a3, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_uint_eq(o.out_len, 3);
    fixture_out_release(&o);
    const char *a4[] = {"exec", "--agent", AGENT, "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a4, &o), 0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
}
END_TEST

/* K22 holds: without stdin the child reads /dev/null (EOF at once); so it
 * does with --no-stdin whatever kscore's stdin is. --stdin-file reads a
 * file. */
START_TEST(no_stdin_is_dev_null_and_stdin_file_is_read)
{
    struct fixture_out o;
    const char *a1[] = {"exec", "--agent", AGENT, "--timeout", "5s", "--",
                        "sh", "-c", "read x; echo \"rc=$?\"", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(o.out, "rc=1\n");
    fixture_out_release(&o);

    const char *in = put_file("ignored.in", "ignored\n", 8);
    const char *a2[] = {"exec", "--agent", AGENT, "--no-stdin", "--", "cat",
                        NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a2, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(o.out, "");
    fixture_out_release(&o);

    const char *f = put_file("file.in", "from a file\n", 12);
    const char *a3[] = {"exec", "--agent", AGENT, "--stdin-file", f, "--",
                        "cat", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a3, &o), 0);
    ck_assert_int_eq(o.status, 0);
    ck_assert_str_eq(o.out, "from a file\n");
    fixture_out_release(&o);
}
END_TEST

START_TEST(stdin_past_the_cap_is_refused_before_anything_is_recorded)
{
    struct fixture_out o;
    size_t n = 256 * 1024 + 1;
    char *big = malloc(n);
    memset(big, 'y', n);
    const char *in = put_file("big.in", big, n);
    free(big);
    long before = sql_long("SELECT count(*) FROM commands");
    const char *a1[] = {"exec", "--agent", AGENT, "--", "cat", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a1, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_msg(strstr(o.err, "stdin is larger than 256 KiB"), "%s",
                  o.err);
    fixture_out_release(&o);
    const char *a2[] = {"batch", "--agents", AGENT, "--", "cat", NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a2, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
    ck_assert_int_eq(sql_long("SELECT count(*) FROM commands"), before);
}
END_TEST

/* As clush: a batch gives every target the same bytes. The record keeps
 * their size and checksum (and, as argv, the bytes). */
START_TEST(batch_broadcasts_stdin_to_every_target)
{
    struct fixture_out o;
    const char *in = put_file("fleet.in", "to all\n", 7);
    char hex[65];
    sha256_hex("to all\n", 7, hex);
    char agents[256];
    snprintf(agents, sizeof(agents), "%s,%s,%s", AGENT, local_agent(0),
             local_agent(1));
    const char *a[] = {"batch", "--agents", agents, "--json", "--", "cat",
                       NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, in, a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    /* One JSON line per target, then the summary. */
    int seen = 0;
    for (char *line = strtok(o.out, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *j = json_loads(line, 0, NULL);
        ck_assert_ptr_nonnull(j);
        json_t *out = json_object_get(j, "stdout");
        if (out) {
            ck_assert_str_eq(json_string_value(out), "to all\n");
            seen++;
        }
        json_decref(j);
    }
    ck_assert_int_eq(seen, 3);
    fixture_out_release(&o);
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events e JOIN commands c ON e.stream_id = "
             "'command-' || c.command_id AND e.version = 1 WHERE "
             "c.batch_id IS NOT NULL AND c.batch_id <> '' AND "
             "position('\\x%s'::bytea in e.data) > 0",
             hex);
    ck_assert_int_eq(sql_long(sql), 3);
}
END_TEST

/* ---- --run-as ------------------------------------------------------------- */

START_TEST(run_as_nobody_drops_every_privilege)
{
    struct fixture_out o;
    const char *a[] = {"exec", "--agent", AGENT, "--run-as", "nobody", "--",
                       "sh", "-c",
                       "id -u; id -g; id -G; echo \"$HOME $USER $LOGNAME\"; "
                       "grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status",
                       NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_str_eq(o.out, "65534\n65534\n65534\n"
                            "/nonexistent nobody nobody\n"
                            "CapPrm:\t0000000000000000\n"
                            "CapEff:\t0000000000000000\n"
                            "CapAmb:\t0000000000000000\n");
    fixture_out_release(&o);
}
END_TEST

START_TEST(run_as_user_and_group_with_a_script_it_owns)
{
    if (!have_tuser) {
        fprintf(stderr, "useradd failed: skipped\n");
        return;
    }
    struct fixture_out o;
    struct passwd *pw = getpwnam(tuser);
    struct group *gr = getgrnam(tgroup);
    ck_assert_ptr_nonnull(pw);
    ck_assert_ptr_nonnull(gr);
    uid_t uid = pw->pw_uid;
    gid_t gid = gr->gr_gid;
    static const char script[] =
        "#!/bin/sh\nid -u; id -g; id -G\n"
        "stat -c '%a %U' \"$0\" \"$(dirname \"$0\")\"\necho \"$HOME\"\n";
    const char *p = put_file("who.sh", script, sizeof(script) - 1);
    char spec[80], want[512];
    /* USER alone: its primary group (nogroup) and its groups. */
    const char *a1[] = {"exec", "--agent", AGENT, "--run-as", tuser,
                        "--script", p, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    snprintf(want, sizeof(want),
             "%u\n65534\n65534 %u\n500 %s\n700 %s\n/home/%s\n",
             (unsigned)uid, (unsigned)gid, tuser, tuser, tuser);
    ck_assert_str_eq(o.out, want);
    fixture_out_release(&o);
    /* USER:GROUP: that group is the primary one. */
    snprintf(spec, sizeof(spec), "%s:%s", tuser, tgroup);
    const char *a2[] = {"exec", "--agent", AGENT, "--run-as", spec, "--",
                        "id", "-g", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    snprintf(want, sizeof(want), "%u\n", (unsigned)gid);
    ck_assert_str_eq(o.out, want);
    fixture_out_release(&o);
}
END_TEST

START_TEST(an_unknown_user_or_an_unreachable_cwd_is_a_start_failure)
{
    struct fixture_out o;
    const char *a1[] = {"exec",   "--agent", AGENT, "--json", "--run-as",
                        "no-such-user-kst", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_int_eq(o.status, 126);
    json_t *j = parse_json(&o);
    ck_assert_str_eq(jstr(j, "status"), "StartFailed");
    ck_assert_str_eq(jstr(j, "start_stage"), "user");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "start_errno")),
                     ENOENT);
    ck_assert_msg(strstr(jstr(j, "reason"), "no user 'no-such-user-kst'"),
                  "%s", jstr(j, "reason"));
    json_decref(j);
    fixture_out_release(&o);

    const char *a2[] = {"exec", "--agent", AGENT, "--run-as",
                        "no-such-user-kst", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 126);
    ck_assert_msg(strstr(o.err, "no user 'no-such-user-kst' on this agent"),
                  "%s", o.err);
    fixture_out_release(&o);

    /* A 0700 directory of root's (not /root, whose mode is the machine's:
     * `kscore up` under it adds o+x): nobody cannot enter it. */
    char closed[] = "/tmp/kscore-payload-user-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(closed));
    const char *a3[] = {"exec",    "--agent", AGENT,  "--json", "--run-as",
                        "nobody",  "--cwd",   closed, "--",    "true",
                        NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a3, &o), 0);
    rmdir(closed);
    ck_assert_int_eq(o.status, 126);
    j = parse_json(&o);
    ck_assert_str_eq(jstr(j, "start_stage"), "chdir");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "start_errno")),
                     EACCES);
    json_decref(j);
    fixture_out_release(&o);

    /* A malformed name never reaches the broker. */
    const char *a4[] = {"exec", "--agent", AGENT, "--run-as", "a b", "--",
                        "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a4, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
}
END_TEST

/* ---- kscore copy ----------------------------------------------------------- */

/* Random-ish bytes of n, into tmpdir/name; its sha256 in hex. */
static const char *
put_random(const char *name, size_t n, char hex[65])
{
    uint8_t *b = fixture_bytes(n, (uint32_t)n);
    sha256_hex(b, n, hex);
    const char *p = put_file(name, b, n);
    free(b);
    return p;
}

/* Runs kscore with args against st, which must exit 0. */
static void
run_ok(struct fixture_stack *st, const char *const args[])
{
    struct fixture_out o;
    ck_assert_int_eq(fixture_kscore(st, args, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    fixture_out_release(&o);
}

/* 1 if the files at a and b hold the same bytes. */
static int
same_bytes(const char *a, const char *b)
{
    char cmd[2 * PATH_MAX + 256];
    snprintf(cmd, sizeof(cmd), "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

/* Names in dir other than . and .. (temporaries left behind show here). */
static int
entries(const char *dir)
{
    char cmd[PATH_MAX + 64];
    snprintf(cmd, sizeof(cmd), "ls -A '%s' | wc -l", dir);
    FILE *f = popen(cmd, "r");
    int n = -1;
    if (f) {
        if (fscanf(f, "%d", &n) != 1)
            n = -1;
        pclose(f);
    }
    return n;
}

/* Three agents, one file in three parts (1.3 MB), a mode and an owner:
 * each target writes it whole, and nothing else stays in the directory.
 * The upload is stored once, and a second copy sends nothing. */
START_TEST(copy_writes_a_file_on_every_target_atomically)
{
    char hex[65], dest_dir[PATH_MAX + 16], dest[PATH_MAX + 32], agents[256];
    const char *src = put_random("app.bin", 1300 * 1000, hex);
    snprintf(dest_dir, sizeof(dest_dir), "%s/dest1", tmpdir);
    ck_assert_int_eq(mkdir(dest_dir, 0755), 0);
    snprintf(dest, sizeof(dest), "%s/app.bin", dest_dir);
    snprintf(agents, sizeof(agents), "%s,%s,%s", AGENT, local_agent(0),
             local_agent(1));
    struct fixture_out o;
    const char *a[] = {"copy", "--agents", agents, src, "--to", dest,
                       "--mode", "0640", "--owner", "nobody:nogroup", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    ck_assert_msg(strstr(o.out, "3 succeeded"), "%s", o.out);
    fixture_out_release(&o);
    ck_assert(same_bytes(src, dest));
    struct stat st;
    ck_assert_int_eq(stat(dest, &st), 0);
    ck_assert_int_eq(st.st_mode & 07777, 0640);
    ck_assert_int_eq(st.st_uid, 65534);
    ck_assert_int_eq(st.st_gid, 65534);
    ck_assert_int_eq(entries(dest_dir), 1);
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM blob_parts WHERE sha256 = '\\x%s'", hex);
    ck_assert_int_eq(sql_long(sql), 3);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM blob_files WHERE sha256 = '\\x%s'", hex);
    ck_assert_int_eq(sql_long(sql), 1);

    /* Again, to a directory (trailing /): nothing uploaded anew, the file
     * replaced (a new inode: renamed over), its mode and owner kept. */
    ino_t before = st.st_ino;
    snprintf(dest, sizeof(dest), "%s/", dest_dir);
    const char *b[] = {"copy", "--agents", AGENT, src, "--to", dest, NULL};
    run_ok(&stack, b);
    snprintf(dest, sizeof(dest), "%s/app.bin", dest_dir);
    ck_assert_int_eq(stat(dest, &st), 0);
    ck_assert(st.st_ino != before);
    ck_assert_int_eq(st.st_mode & 07777, 0640);
    ck_assert_int_eq(st.st_uid, 65534);
    ck_assert_int_eq(entries(dest_dir), 1);
    ck_assert_int_eq(sql_long(sql), 1);
}
END_TEST

/* Several files into an existing directory (no trailing /); the record
 * names each with its size and checksum; get of the batch groups them. */
START_TEST(copy_several_files_is_recorded_file_by_file)
{
    char h1[65], h2[65], dest_dir[PATH_MAX + 16];
    const char *f1 = put_random("one.conf", 10, h1);
    const char *f2 = put_random("two.conf", 0, h2);
    snprintf(dest_dir, sizeof(dest_dir), "%s/dest2", tmpdir);
    ck_assert_int_eq(mkdir(dest_dir, 0755), 0);
    struct fixture_out o;
    const char *a[] = {"copy", "--agents", AGENT, "--json", f1, f2, "--to",
                       dest_dir, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    char *cid = strstr(o.out, "\"command_id\":\"");
    ck_assert_ptr_nonnull(cid);
    char id[40];
    snprintf(id, sizeof(id), "%.36s", cid + 14);
    fixture_out_release(&o);
    char p[PATH_MAX + 48];
    snprintf(p, sizeof(p), "%s/one.conf", dest_dir);
    ck_assert(same_bytes(f1, p));
    snprintf(p, sizeof(p), "%s/two.conf", dest_dir);
    ck_assert(same_bytes(f2, p));
    ck_assert_int_eq(entries(dest_dir), 2);

    const char *e[] = {"events", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, e, &o), 0);
    char want[200];
    snprintf(want, sizeof(want), "file      one.conf (10 bytes, sha256 %s)",
             h1);
    ck_assert_msg(strstr(o.out, want), "%s", o.out);
    snprintf(want, sizeof(want), "file      two.conf (0 bytes, sha256 %s)",
             h2);
    ck_assert_msg(strstr(o.out, want), "%s", o.out);
    fixture_out_release(&o);
}
END_TEST

/* What cannot be done says why, per target, and changes nothing. */
START_TEST(copy_failures_are_clear_and_leave_nothing)
{
    char hex[65], missing[PATH_MAX + 32];
    const char *src = put_random("x.conf", 100, hex);
    snprintf(missing, sizeof(missing), "%s/no-such-dir/x.conf", tmpdir);
    struct fixture_out o;
    const char *a1[] = {"copy", "--agents", AGENT, src, "--to", missing,
                        NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a1, &o), 0);
    ck_assert_int_eq(o.status, 1);
    ck_assert_msg(strstr(o.out, "cannot open the directory"), "%s", o.out);
    fixture_out_release(&o);

    /* An owner the agent does not know: the copy never starts. */
    char dest[PATH_MAX + 16];
    snprintf(dest, sizeof(dest), "%s/x-dest.conf", tmpdir);
    const char *a2[] = {"copy", "--agents", AGENT, "--json", src, "--to",
                        dest, "--owner", "no-such-user-kst", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a2, &o), 0);
    ck_assert_int_eq(o.status, 1);
    ck_assert_msg(strstr(o.out, "\"start_stage\":\"owner\""), "%s", o.out);
    fixture_out_release(&o);
    struct stat st;
    ck_assert_int_eq(stat(dest, &st), -1);

    /* Past the cap (a sparse file): refused before anything is sent. */
    char big[PATH_MAX + 16];
    snprintf(big, sizeof(big), "%s/huge.bin", tmpdir);
    FILE *f = fopen(big, "w");
    ck_assert_int_eq(ftruncate(fileno(f), (off_t)(256LL << 20) + 1), 0);
    fclose(f);
    long before = sql_long("SELECT count(*) FROM commands");
    const char *a3[] = {"copy", "--agents", AGENT, big, "--to", dest, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a3, &o), 0);
    ck_assert_int_eq(o.status, 2);
    ck_assert_msg(strstr(o.err, "larger than 256 MiB"), "%s", o.err);
    fixture_out_release(&o);
    ck_assert_int_eq(sql_long("SELECT count(*) FROM commands"), before);
    unlink(big);

    /* A relative --to, no files. */
    const char *a4[] = {"copy", "--agents", AGENT, src, "--to", "rel", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a4, &o), 0);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
}
END_TEST

/* Part `part` of the file sum of copy id, asked for as identity for agent
 * (attempt 1) on c: the broker's answer (the caller frees it). */
static Ks__FetchReply *
fetch_as(struct evt_conn *c, const char *identity, const char *id,
         const char *agent, uint8_t sum[32], uint32_t part)
{
    Ks__FetchRequest req = KS__FETCH_REQUEST__INIT;
    req.command_id = (char *)id;
    req.attempt = 1;
    req.agent_id = (char *)agent;
    req.sha256.data = sum;
    req.sha256.len = 32;
    req.part = part;
    natsMsg *m = NULL;
    ck_assert_int_eq(evt_request_as(c, identity, EVT_API_FETCH, &req.base,
                                    5000, &m),
                     0);
    ProtobufCMessage *pm = NULL;
    ck_assert_int_eq(evt_unpack(&ks__fetch_reply__descriptor,
                                natsMsg_GetData(m),
                                (size_t)natsMsg_GetDataLength(m), &pm),
                     0);
    natsMsg_Destroy(m);
    return (Ks__FetchReply *)pm;
}

/* The fetch API serves a part only to the command's own agent, while the
 * copy runs: not to another id, not after its end. */
START_TEST(only_the_copys_agent_fetches_while_it_runs)
{
    char hex[65], dest[PATH_MAX + 16];
    const char *src = put_random("f.conf", 100, hex);
    snprintf(dest, sizeof(dest), "%s/f.conf", tmpdir);
    struct fixture_out o;
    const char *a[] = {"copy", "--agents", AGENT, "--json", src, "--to",
                       dest, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_int_eq(o.status, 0);
    char *cid = strstr(o.out, "\"command_id\":\"");
    ck_assert_ptr_nonnull(cid);
    char id[40];
    snprintf(id, sizeof(id), "%.36s", cid + 14);
    fixture_out_release(&o);

    uint8_t sum[32];
    for (int i = 0; i < 32; i++)
        sscanf(hex + 2 * i, "%2hhx", &sum[i]);
    struct evt_conn *c = fixture_client(&stack);
    const char *who[][2] = {{"agent-other", "other"}, {"agent-" AGENT, AGENT}};
    for (int k = 0; k < 2; k++) {
        Ks__FetchReply *rep = fetch_as(c, who[k][0], id, who[k][1], sum, 0);
        ck_assert_int_eq(rep->error_code, KS_EDENIED);
        ck_assert_uint_eq(rep->data.len, 0);
        ks__fetch_reply__free_unpacked(rep, NULL);
    }
    evt_close(c);
}
END_TEST

/* The first column of sql's first row into out ("" when none). */
static void
sql_text_at(const char *conninfo, const char *sql, char *out, size_t len)
{
    PGconn *pg = PQconnectdb(conninfo);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));
    PGresult *r = PQexec(pg, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql,
                  PQerrorMessage(pg));
    snprintf(out, len, "%s", PQntuples(r) ? PQgetvalue(r, 0, 0) : "");
    PQclear(r);
    PQfinish(pg);
}

/* A session that holds blob_parts locked (no part can be read) until
 * parts_unlock: a fetch waits in the broker, the copy stays in it. */
static PGconn *
parts_lock(void)
{
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));
    PGresult *r = PQexec(pg, "BEGIN; LOCK TABLE blob_parts IN ACCESS "
                             "EXCLUSIVE MODE");
    ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
    PQclear(r);
    return pg;
}

static void
parts_unlock(PGconn *pg)
{
    PQclear(PQexec(pg, "COMMIT"));
    PQfinish(pg);
}

/* `kscore copy --detach` of src to dest on AGENT, once src is stored:
 * its command's id, once it runs (claimed: the agent is fetching). */
static void
copy_detached_running(const char *src, const char *dest, char id[40])
{
    struct fixture_out o;
    char sql[256], batch[64];
    const char *a[] = {"copy", "--agents", AGENT, "--detach", src, "--to",
                       dest, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    snprintf(batch, sizeof(batch), "%.42s", o.out);
    fixture_out_release(&o);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE batch_id = '%s' AND "
             "status = 'Running'",
             batch);
    ck_assert_int_eq(fixture_wait_sql(stack.pg.conninfo, sql, 1, 30000), 1);
    snprintf(sql, sizeof(sql),
             "SELECT command_id FROM commands WHERE batch_id = '%s'", batch);
    sql_text_at(stack.pg.conninfo, sql, id, 40);
}

/* A file "<stem>.bin" of n random bytes, stored (copied once to
 * <tmpdir>/<stem>-first.bin), then copied again to dest
 * (<tmpdir>/<stem>-dest.bin) with the parts locked: the copy runs, its
 * first fetch held in the broker. Its sha256 in hex, the command's id in
 * id; the source's path returned. The lock in *lock (parts_unlock). */
static const char *
copy_held_running(const char *stem, size_t n, char hex[65], char *dest,
                  size_t dest_len, char id[40], PGconn **lock)
{
    char name[64], first[PATH_MAX + 32];
    snprintf(name, sizeof(name), "%s.bin", stem);
    const char *src = put_random(name, n, hex);
    snprintf(first, sizeof(first), "%s/%s-first.bin", tmpdir, stem);
    snprintf(dest, dest_len, "%s/%s-dest.bin", tmpdir, stem);
    const char *up[] = {"copy", "--agents", AGENT, src, "--to", first, NULL};
    run_ok(&stack, up);
    *lock = parts_lock();
    copy_detached_running(src, dest, id);
    return src;
}

/* The agent's private directory of command id (its run dir, noted in its
 * state dir, then the id). */
static void
spool_of(const char *id, char *out, size_t len)
{
    char note[PATH_MAX + 64], run_dir[PATH_MAX] = "";
    snprintf(note, sizeof(note), "%s/agent-%s/run-dir", stack.dir, AGENT);
    FILE *f = fopen(note, "r");
    ck_assert_ptr_nonnull(f);
    ck_assert_ptr_nonnull(fgets(run_dir, sizeof(run_dir), f));
    fclose(f);
    run_dir[strcspn(run_dir, "\n")] = '\0';
    snprintf(out, len, "%s/%s", run_dir, id);
}

/* A count of events of command id whose bytes hold text. */
static long
events_saying(const char *id, const char *type, const char *text)
{
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = 'command-%s' AND "
             "type = '%s' AND position(convert_to($q$%s$q$, 'UTF8') in data) "
             "> 0",
             id, type, text);
    return sql_long(sql);
}

/* A cancel while the agent fetches: the wait for a part ends at once, the
 * command ends Cancelled (said why), and neither the destination nor the
 * agent's spool keeps anything. The fetch is held in the broker by a lock
 * on the parts, so the cancel comes during it, never after. */
START_TEST(a_copy_cancelled_while_it_fetches_leaves_nothing)
{
    char hex[65], dest[PATH_MAX + 32], id[40], spool[PATH_MAX + 64],
        sql[160];
    struct fixture_out o;
    PGconn *lock;
    const char *src = copy_held_running("cx", 3 * 512 * 1024 + 7, hex, dest,
                                        sizeof(dest), id, &lock);
    spool_of(id, spool, sizeof(spool));
    const char *c[] = {"cancel", id, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, c, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    fixture_out_release(&o);
    /* Ended while the broker still cannot answer the part. */
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'Cancelled'",
             id);
    long ended = fixture_wait_sql(stack.pg.conninfo, sql, 1, 30000);
    parts_unlock(lock);
    ck_assert_int_eq(ended, 1);
    ck_assert_int_eq(events_saying(id, "CommandCompleted",
                                   "cancelled while fetching 'cx.bin'"),
                     1);
    struct stat st;
    ck_assert_int_eq(stat(dest, &st), -1);
    ck_assert_msg(gone_within(spool, 5000), "%s stays", spool);
    /* The file is whole in the store still: a copy now succeeds. */
    const char *again[] = {"copy", "--agents", AGENT, src, "--to", dest,
                           NULL};
    run_ok(&stack, again);
    ck_assert(same_bytes(src, dest));
}
END_TEST

/* The answers to a burst of fetches, by their index in the reply
 * subject: the error code, or 1 for a part served whole. */
#define REFETCHES 3000
struct refetch {
    pthread_mutex_t mu;
    int n;
    int code[REFETCHES];
    size_t want_len;
};

static void
on_refetch(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct refetch *r = ud;
    const char *dot = strrchr(natsMsg_GetSubject(msg), '.');
    int i = dot ? atoi(dot + 1) : -1;
    Ks__FetchReply *rep = ks__fetch_reply__unpack(
        NULL, (size_t)natsMsg_GetDataLength(msg),
        (const uint8_t *)natsMsg_GetData(msg));
    (void)nc;
    (void)sub;
    pthread_mutex_lock(&r->mu);
    if (rep && i >= 0 && i < REFETCHES) {
        r->code[i] = rep->error_code ? rep->error_code
                     : rep->data.len == r->want_len ? 1
                                                    : KS_EINTERNAL;
        r->n++;
    }
    pthread_mutex_unlock(&r->mu);
    if (rep)
        ks__fetch_reply__free_unpacked(rep, NULL);
    natsMsg_Destroy(msg);
}

/*
 * Issue 21: an agent may fetch the parts of a copy it runs, each a read of
 * PostgreSQL by the thread of everyone's uploads and fetches; only fetches
 * that failed were charged to its share, so one that asked for its own
 * copy's part again and again was served without end. A part asked for
 * again is charged now (broker/blob.c fetched_again): past the share it
 * is answered busy without the store. The agent is stopped meanwhile, so
 * the copy stays Running (until its heartbeats are missed) and only the
 * test's fetches (as the agent, at once) are made; the answers are read
 * in the order they were asked (one sender is served in order).
 */
START_TEST(a_copys_agent_fetching_parts_again_is_charged)
{
    char hex[65], dest[PATH_MAX + 32], id[40];
    const size_t size = 100;
    PGconn *lock;
    copy_held_running("rf", size, hex, dest, sizeof(dest), id, &lock);
    ck_assert_int_eq(fixture_stack_signal_tree(&stack, "agent", SIGSTOP), 0);
    parts_unlock(lock);

    uint8_t sum[32];
    for (int i = 0; i < 32; i++)
        sscanf(hex + 2 * i, "%2hhx", &sum[i]);
    static struct refetch r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    r.want_len = size;
    struct evt_conn *c = fixture_client(&stack);
    natsSubscription *sub = NULL;
    ck_assert_int_eq(natsConnection_Subscribe(&sub, c->nc,
                                              "_INBOX.agent-" AGENT ".rf.>",
                                              on_refetch, &r),
                     NATS_OK);
    natsSubscription_SetPendingLimits(sub, -1, -1);
    natsConnection_Flush(c->nc);
    Ks__FetchRequest req = KS__FETCH_REQUEST__INIT;
    req.command_id = id;
    req.attempt = 1;
    req.agent_id = AGENT;
    req.sha256.data = sum;
    req.sha256.len = 32;
    uint8_t *buf;
    size_t len;
    ck_assert_int_eq(kproto_pack(&req.base, &buf, &len), 0);
    for (int i = 0; i < REFETCHES; i++) {
        char reply[96];
        snprintf(reply, sizeof(reply), "_INBOX.agent-" AGENT ".rf.%d", i);
        ck_assert_int_eq(natsConnection_PublishRequest(
                             c->nc, EVT_API_FETCH ".agent-" AGENT, reply, buf,
                             (int)len),
                         NATS_OK);
    }
    free(buf);
    natsConnection_Flush(c->nc);
    /* Past the share at most 100 refusals a second are answered, the
     * others dropped (budget.c): until all are answered or one is busy
     * (the answers come in the order asked: all served before it came). */
    for (int t = 0;; t++) {
        pthread_mutex_lock(&r.mu);
        int got = r.n, busy = 0;
        for (int i = 0; i < REFETCHES && !busy; i++)
            busy = r.code[i] == KS_EBUSY;
        pthread_mutex_unlock(&r.mu);
        if (got == REFETCHES || busy || t == 600)
            break;
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    }
    natsSubscription_Destroy(sub);
    evt_close(c);
    /* Before any check: the next cases need the agent. */
    ck_assert_int_eq(fixture_stack_signal_tree(&stack, "agent", SIGCONT), 0);
    /* In the order asked: served, then (past the share) busy. Before,
     * all were served while the copy ran, and refused once it ended. */
    int served = 0;
    while (served < REFETCHES && r.code[served] == 1)
        served++;
    ck_assert_msg(served < REFETCHES,
                  "%d fetches of the same part served, none answered busy",
                  served);
    ck_assert_msg(r.code[served] == KS_EBUSY,
                  "after %d fetches of the same part served, one answered "
                  "%d, not busy",
                  served, r.code[served]);
    ck_assert_msg(served >= 900, "busy after only %d", served);
    /* The agent's own copy goes on and ends. */
    char sql[160];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status NOT IN ('Dispatched', 'Running')",
             id);
    ck_assert_int_eq(fixture_wait_sql(stack.pg.conninfo, sql, 1, 60000), 1);
}
END_TEST

/* 1 if a line of the agent's log holds a and b within ms. */
static int
agent_log_says(const char *a, const char *b, int ms)
{
    char path[PATH_MAX + 32], line[4096];
    snprintf(path, sizeof(path), "%s/agent.log", stack.dir);
    for (int i = 0; i < ms / 50; i++) {
        FILE *f = fopen(path, "re");
        int found = 0;
        while (f && !found && fgets(line, sizeof(line), f))
            found = strstr(line, a) && strstr(line, b);
        if (f)
            fclose(f);
        if (found)
            return 1;
        usleep(50 * 1000);
    }
    return 0;
}

/* PostgreSQL goes away during a fetch: the broker refuses each part
 * (PostgreSQL unreachable), the agent tries it again for a few seconds,
 * then ends the copy StartFailed, stage fetch, with the part, the tries
 * and the last refusal; recorded once PostgreSQL is back. Last of the
 * case: PostgreSQL restarts. */
START_TEST(a_fetch_that_keeps_failing_ends_the_copy_with_its_reason)
{
    char hex[65], dest[PATH_MAX + 32], id[40], sql[200];
    PGconn *lock;
    copy_held_running("fx", 4 * 512 * 1024, hex, dest, sizeof(dest), id,
                      &lock);
    ck_assert_int_eq(fixture_pg_halt(&stack.pg), 0);
    PQfinish(lock); /* its session ended with the server */
    int said = agent_log_says("a copy's fetch failed", id, 60000);
    ck_assert_int_eq(fixture_pg_resume(&stack.pg), 0);
    ck_assert_msg(said, "the agent never gave up the fetch");
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE command_id = '%s' AND "
             "status = 'StartFailed' AND start_stage = 'fetch'",
             id);
    ck_assert_int_eq(fixture_wait_sql(stack.pg.conninfo, sql, 1, 60000), 1);
    ck_assert_int_eq(events_saying(id, "CommandStartFailed",
                                   "of 'fx.bin' after 5 tries"),
                     1);
    ck_assert_int_eq(events_saying(id, "CommandStartFailed",
                                   "PostgreSQL"),
                     1);
    struct stat st;
    ck_assert_int_eq(stat(dest, &st), -1);
}
END_TEST

/* ---- what kscore copy keeps, and for how long ---------------------------- */

#define XAGENT "px-agent"
static struct fixture_stack xstack;

/* A stack whose broker keeps files 5 s after their last use and the parts
 * of an unfinished upload 1 s; the case's files in a tmpdir of its own. */
static void
expiry_up(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kscore-plx-XXXXXX");
    if (!mkdtemp(tmpdir) || chmod(tmpdir, 0755) != 0)
        exit(1);
    setenv("KSCORE_COPY_KEEP", "5s", 1);
    setenv("KSCORE_COPY_UPLOAD_KEEP", "1s", 1);
    int rc = fixture_stack_start(&xstack, XAGENT, 0);
    unsetenv("KSCORE_COPY_KEEP");
    unsetenv("KSCORE_COPY_UPLOAD_KEEP");
    if (rc != 0) {
        fprintf(stderr, "cannot start the stack\n");
        fixture_stack_stop(&xstack);
        exit(1);
    }
}

static void
expiry_down(void)
{
    char cmd[PATH_MAX + 16];
    fixture_stack_stop(&xstack);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    run_sh(cmd);
}

static long
xsql(const char *fmt, const char *arg)
{
    char sql[512];
    snprintf(sql, sizeof(sql), fmt, arg);
    return fixture_sql_long(xstack.pg.conninfo, sql);
}

static long
xwait(const char *fmt, const char *arg, long want)
{
    char sql[512];
    snprintf(sql, sizeof(sql), fmt, arg);
    return fixture_wait_sql(xstack.pg.conninfo, sql, want, 60000);
}

#define FILE_ROWS "SELECT count(*) FROM blob_files WHERE sha256 = '\\x%s'"
#define PART_ROWS "SELECT count(*) FROM blob_parts WHERE sha256 = '\\x%s'"
#define HELD                                                                   \
    "SELECT coalesce((SELECT bytes FROM blob_usage WHERE operator = '%s'), 0)"

/* The parts of an upload never finished go once copy_upload_keep has
 * passed (40 parts: more than one round of the clean-up), and the
 * operator's bytes with them. */
START_TEST(an_unfinished_upload_goes_away)
{
    const size_t n = 21 * 512 * 1024 - 3;
    char hex[65];
    const char *path = put_random("unfinished.bin", n, hex);
    (void)path;
    uint8_t *b = malloc(n);
    FILE *f = fopen(path, "r");
    ck_assert_uint_eq(fread(b, 1, n, f), n);
    fclose(f);
    struct evt_conn *c = fixture_client(&xstack);
    ck_assert_int_eq(fixture_upload(c, "opx", b, n, 20, NULL, NULL, 0), 0);
    evt_close(c);
    free(b);
    /* Each part was stored when its upload returned 0; parts written
     * over copy_upload_keep (1 s) ago may be gone already (a loaded
     * machine took longer than that for the 20: the case saw 17 left), so
     * what is held is what is left, part for part, and then nothing. */
    long left = xsql(PART_ROWS, hex);
    ck_assert_int_le(left, 20);
    ck_assert_int_le(xsql(HELD, "opx"), 20L * 512 * 1024);
    ck_assert_int_eq(xwait(PART_ROWS, hex, 0), 0);
    ck_assert_int_eq(xsql(HELD, "opx"), 0);
    ck_assert_int_eq(xsql(HELD, "*"),
                     fixture_sql_long(xstack.pg.conninfo,
                                      "SELECT coalesce(sum(octet_length("
                                      "data)), 0) FROM blob_parts"));
}
END_TEST

/* A file is kept while it is used: a copy again soon after uploads
 * nothing (no part is written again), and it goes copy_keep after its
 * last use; a file an open batch names stays past that (an unused one
 * uploaded with it goes meanwhile), and goes when the batch ends. */
START_TEST(a_file_goes_after_its_last_use_and_not_while_a_copy_names_it)
{
    char hex[65], dest[PATH_MAX + 40], dir[PATH_MAX + 32];
    const char *src = put_random("kept.bin", 700 * 1024, hex);
    snprintf(dir, sizeof(dir), "%s/kept", tmpdir);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    snprintf(dest, sizeof(dest), "%s/", dir);
    struct fixture_out o;
    const char *a[] = {"copy", "--agents", XAGENT, src, "--to", dest, NULL};
    run_ok(&xstack, a);
    long ver = xsql("SELECT max(ver) FROM blob_parts WHERE sha256 = '\\x%s'",
                    hex);
    run_ok(&xstack, a);
    ck_assert_int_eq(
        xsql("SELECT max(ver) FROM blob_parts WHERE sha256 = '\\x%s'", hex),
        ver);
    ck_assert_int_eq(xsql(FILE_ROWS, hex), 1);
    /* Unused from now: it goes, parts and bytes with it. */
    ck_assert_int_eq(xwait(FILE_ROWS, hex, 0), 0);
    ck_assert_int_eq(xwait(PART_ROWS, hex, 0), 0);
    ck_assert_int_eq(xsql(HELD, "*"), 0);

    /* An agent that will never claim: the batch stays open. */
    ck_assert_int_eq(fixture_agent_spawn(&xstack, "px-dead", "px-dead", NULL),
                     0);
    ck_assert_int_eq(fixture_stack_signal(&xstack, "px-dead", SIGKILL), 0);
    char hexg[65], hexh[65], batch[64];
    const char *g = put_random("named.bin", 600 * 1024, hexg);
    const char *b[] = {"copy", "--agents", "px-dead", "--detach",
                       "--deliver-within", "5m", g, "--to", dest, NULL};
    ck_assert_int_eq(fixture_kscore(&xstack, b, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    snprintf(batch, sizeof(batch), "%.42s", o.out);
    fixture_out_release(&o);
    /* Uploaded after the batch was accepted: due no sooner than g. */
    const size_t hn = 300 * 1024;
    const char *h = put_random("unnamed.bin", hn, hexh);
    uint8_t *hb = malloc(hn);
    FILE *f = fopen(h, "r");
    ck_assert_uint_eq(fread(hb, 1, hn, f), hn);
    fclose(f);
    struct evt_conn *c = fixture_client(&xstack);
    bool complete = false;
    ck_assert_int_eq(fixture_upload(c, "opx", hb, hn, UINT32_MAX, &complete,
                                    NULL, 0),
                     0);
    ck_assert(complete);
    evt_close(c);
    free(hb);
    ck_assert_int_eq(xwait(FILE_ROWS, hexh, 0), 0);
    /* The clean-up has passed g's keep too: the open batch holds it. */
    ck_assert_int_eq(xsql("SELECT count(*) FROM batches WHERE batch_id = "
                          "'%s' AND status = 'Running'",
                          batch),
                     1);
    ck_assert_int_eq(xsql(FILE_ROWS, hexg), 1);
    const char *cx[] = {"cancel", batch, NULL};
    ck_assert_int_eq(fixture_kscore(&xstack, cx, &o), 0);
    fixture_out_release(&o);
    ck_assert_int_eq(xwait(FILE_ROWS, hexg, 0), 0);
    ck_assert_int_eq(xwait(PART_ROWS, hexg, 0), 0);
}
END_TEST

/* ---- the policy's run_as --------------------------------------------------- */

static struct fixture_stack sstack;
static char spolicy[PATH_MAX + 32];

static void
secure_up(void)
{
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "/tmp/kscore-plp-XXXXXX");
    if (!mkdtemp(dir))
        exit(1);
    snprintf(spolicy, sizeof(spolicy), "%s/policy.json", dir);
    FILE *f = fopen(spolicy, "w");
    /* alice: id and sh as nobody only; nothing as root, no script (an
     * executables list cannot vouch for one). */
    fprintf(f, "{\"operators\": {\"alice\": [{\"agents\": \"*\", "
               "\"executables\": [\"id\", \"sh\"], \"run_as\": "
               "[\"nobody\"]}], \"bob\": [{\"agents\": \"*\"}]}}\n");
    fclose(f);
    if (fixture_stack_start_secure(&sstack, "plp", NULL, "alice",
                                   spolicy) != 0) {
        fixture_stack_stop(&sstack);
        exit(1);
    }
}

static void
secure_down(void)
{
    char cmd[PATH_MAX + 64];
    fixture_stack_stop(&sstack);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir_of(spolicy));
    run_sh(cmd);
}

START_TEST(the_policy_decides_who_runs_as_whom)
{
    struct fixture_out o;
    const char *ok[] = {"exec", "--agent", "plp", "--run-as", "nobody", "--",
                        "id", "-u", NULL};
    ck_assert_int_eq(fixture_kscore(&sstack, ok, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_str_eq(o.out, "65534\n");
    fixture_out_release(&o);

    /* Without --run-as it would run as root, which the rule does not
     * list. */
    const char *root[] = {"exec", "--agent", "plp", "--", "id", "-u", NULL};
    ck_assert_int_eq(fixture_kscore(&sstack, root, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "denied") && strstr(o.err, "as 'root'"),
                  "%s", o.err);
    fixture_out_release(&o);

    const char *other[] = {"exec", "--agent", "plp", "--run-as", "daemon",
                           "--", "id", "-u", NULL};
    ck_assert_int_eq(fixture_kscore(&sstack, other, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "as 'daemon'"), "%s", o.err);
    fixture_out_release(&o);

    /* A script named like an allowed executable is still a script. */
    static const char script[] = "id -u\n";
    char path[PATH_MAX + 32];
    snprintf(path, sizeof(path), "%s/id", dir_of(strdup(spolicy)));
    FILE *f = fopen(path, "w");
    fputs(script, f);
    fclose(f);
    const char *s[] = {"exec",   "--agent", "plp", "--run-as", "nobody",
                       "--script", path,    NULL};
    ck_assert_int_eq(fixture_kscore(&sstack, s, &o), 0);
    ck_assert_int_eq(o.status, 125);
    ck_assert_msg(strstr(o.err, "may not run the script"), "%s", o.err);
    fixture_out_release(&o);
    unlink(path);
}
END_TEST

/* Under NATS permissions: the agent fetches as itself (its own
 * kscore.api.v1.fetch.agent-<id>, imported into the brokers' account);
 * a copy writes as root, so alice's rule (executables) does not grant
 * it (nor its upload), bob's ("*", no run_as: root) does. */
START_TEST(copy_under_permissions_and_policy)
{
    char dir[PATH_MAX + 64], src[PATH_MAX + 96], dest[PATH_MAX + 96];
    snprintf(dir, sizeof(dir), "%s", spolicy);
    dir_of(dir);
    snprintf(src, sizeof(src), "%s/src.conf", dir);
    snprintf(dest, sizeof(dest), "%s/dest.conf", dir);
    FILE *f = fopen(src, "w");
    fputs("secure copy\n", f);
    fclose(f);
    struct fixture_out o;
    const char *a[] = {"copy", "--agents", "plp", src, "--to", dest, NULL};
    ck_assert_int_eq(fixture_kscore(&sstack, a, &o), 0);
    ck_assert_int_eq(o.status, 125);
    /* Refused at the upload, before anything is stored. */
    ck_assert_msg(strstr(o.err, "may not upload files for kscore copy"),
                  "%s", o.err);
    fixture_out_release(&o);
    ck_assert_int_eq(fixture_kscore_as(&sstack, "bob", a, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s %s", o.status, o.out, o.err);
    fixture_out_release(&o);
    ck_assert(same_bytes(src, dest));
}
END_TEST

/* ---- the field rules (broker_check_request, pure) -------------------------- */

static int
check_exec(const Ks__CommandSpec *spec, char *why, size_t len)
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    req.spec = (Ks__CommandSpec *)spec;
    req.agent_id = "a";
    why[0] = '\0';
    return broker_check_request(&req.base, "op", why, len);
}

START_TEST(field_rules_of_scripts_stdin_users_and_copies)
{
    char *argv[] = {"s.sh"};
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__Payload pl = KS__PAYLOAD__INIT;
    uint8_t sum[32];
    char why[600];
    unsigned int n;
    static uint8_t big[600 * 1024];

    spec.argv = argv;
    spec.n_argv = 1;
    EVP_Digest("echo\n", 5, sum, &n, EVP_sha256(), NULL);
    pl.data.data = (uint8_t *)"echo\n";
    pl.data.len = 5;
    pl.sha256.data = sum;
    pl.sha256.len = 32;
    spec.script = &pl;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), 0);
    /* A checksum that is not the bytes', a short one, too many bytes. */
    pl.data.data = (uint8_t *)"echx\n";
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    ck_assert_msg(strstr(why, "spec.script.sha256"), "%s", why);
    pl.sha256.len = 31;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    pl.sha256.len = 32;
    EVP_Digest(big, sizeof(big), sum, &n, EVP_sha256(), NULL);
    pl.data.data = big;
    pl.data.len = sizeof(big);
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    /* Stdin: 256 KiB at most. */
    spec.script = NULL;
    spec.input = &pl;
    pl.data.len = 256 * 1024 + 1;
    EVP_Digest(big, pl.data.len, sum, &n, EVP_sha256(), NULL);
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    ck_assert_msg(strstr(why, "stdin is at most 256 KiB"), "%s", why);
    pl.data.len = 256 * 1024;
    EVP_Digest(big, pl.data.len, sum, &n, EVP_sha256(), NULL);
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), 0);
    spec.input = NULL;

    /* Users. */
    const char *good[] = {"deploy", "www-data:www-data", "a.b_c", "Svc1"};
    const char *bad[] = {"a b", "-x", "deploy:", ":g", "a:b:c", "x/y",
                         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        spec.run_as = (char *)good[i];
        ck_assert_msg(check_exec(&spec, why, sizeof(why)) == 0, "%s: %s",
                      good[i], why);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        spec.run_as = (char *)bad[i];
        ck_assert_msg(check_exec(&spec, why, sizeof(why)) == KS_EINVAL,
                      "%s allowed", bad[i]);
    }
    spec.run_as = "";

    /* Copies. */
    Ks__CopySpec cp = KS__COPY_SPEC__INIT;
    Ks__CopyFile f = KS__COPY_FILE__INIT, *fp = &f;
    f.name = "app.conf";
    f.sha256.data = sum;
    f.sha256.len = 32;
    cp.files = &fp;
    cp.n_files = 1;
    cp.path = "/etc/app/";
    spec.copy = &cp;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), 0);
    const char *names[] = {"../x", "a/b", ".", ".."};
    for (size_t i = 0; i < 4; i++) {
        f.name = (char *)names[i];
        ck_assert_msg(check_exec(&spec, why, sizeof(why)) == KS_EINVAL,
                      "%s allowed", names[i]);
    }
    f.name = "app.conf";
    cp.path = "etc/app";
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    cp.path = "/etc/app";
    cp.mode = 010000;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    cp.mode = 0640;
    f.size = (256ULL << 20) + 1;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    f.size = 10;
    spec.run_as = "deploy"; /* a copy writes as the agent's user */
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);
    spec.run_as = "";
    cp.n_files = 0;
    ck_assert_int_eq(check_exec(&spec, why, sizeof(why)), KS_EINVAL);

    /* An upload part larger than a part. */
    Ks__UploadRequest up = KS__UPLOAD_REQUEST__INIT;
    up.sha256.data = sum;
    up.sha256.len = 32;
    up.size = sizeof(big);
    up.data.data = big;
    up.data.len = 512 * 1024 + 1;
    ck_assert_int_eq(broker_check_request(&up.base, "op", why, sizeof(why)),
                     KS_EINVAL);
    up.data.len = 512 * 1024;
    ck_assert_int_eq(broker_check_request(&up.base, "op", why, sizeof(why)),
                     0);
}
END_TEST

Suite *
payload_suite(void)
{
    Suite *s = suite_create("payload");
    TCase *tc = tcase_create("payload");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, script_runs_by_its_interpreter_with_args_and_goes_away);
    tcase_add_test(
        tc, script_without_shebang_runs_by_sh_and_a_shebang_argument_counts);
    tcase_add_test(tc, a_large_script_runs_and_one_past_the_cap_is_refused);
    tcase_add_test(tc, script_checksum_is_in_the_record_and_shown);
    tcase_add_test(tc, script_file_goes_after_a_timeout_and_after_a_cancel);
    tcase_add_test(tc, an_idempotency_key_names_one_script);
    tcase_add_test(tc, stdin_reaches_the_command_byte_for_byte);
    tcase_add_test(tc, no_stdin_is_dev_null_and_stdin_file_is_read);
    tcase_add_test(tc,
                   stdin_past_the_cap_is_refused_before_anything_is_recorded);
    tcase_add_test(tc, batch_broadcasts_stdin_to_every_target);
    tcase_add_test(tc, run_as_nobody_drops_every_privilege);
    tcase_add_test(tc, run_as_user_and_group_with_a_script_it_owns);
    tcase_add_test(tc,
                   an_unknown_user_or_an_unreachable_cwd_is_a_start_failure);
    tcase_add_test(tc, copy_writes_a_file_on_every_target_atomically);
    tcase_add_test(tc, copy_several_files_is_recorded_file_by_file);
    tcase_add_test(tc, copy_failures_are_clear_and_leave_nothing);
    tcase_add_test(tc, only_the_copys_agent_fetches_while_it_runs);
    tcase_add_test(tc, a_restarted_agent_removes_what_the_last_run_left);
    tcase_add_test(tc, a_copy_cancelled_while_it_fetches_leaves_nothing);
    tcase_add_test(tc, a_copys_agent_fetching_parts_again_is_charged);
    /* Last: it stops PostgreSQL for a while. */
    tcase_add_test(tc,
                   a_fetch_that_keeps_failing_ends_the_copy_with_its_reason);
    suite_add_tcase(s, tc);

    TCase *tx = tcase_create("expiry");
    tcase_add_unchecked_fixture(tx, expiry_up, expiry_down);
    tcase_set_timeout(tx, 180);
    tcase_add_test(tx, an_unfinished_upload_goes_away);
    tcase_add_test(
        tx, a_file_goes_after_its_last_use_and_not_while_a_copy_names_it);
    suite_add_tcase(s, tx);

    TCase *tr = tcase_create("rules");
    tcase_add_test(tr, field_rules_of_scripts_stdin_users_and_copies);
    suite_add_tcase(s, tr);

    TCase *tp = tcase_create("policy");
    tcase_add_unchecked_fixture(tp, secure_up, secure_down);
    tcase_set_timeout(tp, 120);
    tcase_add_test(tp, the_policy_decides_who_runs_as_whom);
    tcase_add_test(tp, copy_under_permissions_and_policy);
    suite_add_tcase(s, tp);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(payload_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
