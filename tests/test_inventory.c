/*
 * An operator's inventory, end to end (issue 24): agents' facts (what
 * each says of its host) beside their signed labels, labels changed
 * without a new enrolment (`kscore agent label`), both in a command's
 * environment, host lists from files (`--agents @FILE`), and the usage
 * errors of selectors and agent ids. A broker with 4 in-process agents
 * (the pool named after this host) and one agent process ("inv").
 */
#include <check.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"
#include "broker.h"
#include "fixture.h"
#include "kproto.h"
#include "stack.h"

static struct fixture_stack stack;
static char host[64];

static void
stack_up(void)
{
    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    host[strcspn(host, ".")] = '\0';
    if (fixture_stack_start(&stack, "inv", 4) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    fixture_stack_stop(&stack);
}

/* Runs kscore args (NULL-terminated) into o; the test fails if it cannot
 * be run at all. */
static void
ks(const char *const args[], struct fixture_out *o)
{
    ck_assert_int_eq(fixture_kscore(&stack, args, o), 0);
}

/* The last JSON line of o's stdout (a batch's summary), or its only one. */
static json_t *
last_json(const struct fixture_out *o)
{
    json_t *j = json_loads(fixture_last_line(o->out), JSON_DISABLE_EOF_CHECK,
                           NULL);
    ck_assert_msg(j != NULL, "no JSON: %s / %s", o->out, o->err);
    return j;
}

/* `kscore agents --json`'s object of id (a new reference), polled until
 * check(it) holds or timeout_ms passes: the last one seen (NULL if the
 * agent was never listed). */
static json_t *
agent_json(const char *id, bool (*check)(json_t *, const void *),
           const void *arg, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    json_t *found = NULL;
    for (;;) {
        struct fixture_out o;
        const char *args[] = {"agents", "--json", NULL};
        ks(args, &o);
        json_decref(found);
        found = NULL;
        for (char *save = NULL, *l = strtok_r(o.out, "\n", &save); l;
             l = strtok_r(NULL, "\n", &save)) {
            json_t *j = json_loads(l, 0, NULL);
            if (j && strcmp(json_string_value(json_object_get(j, "agent_id")),
                            id) == 0) {
                found = j;
                break;
            }
            json_decref(j);
        }
        fixture_out_release(&o);
        if ((found && (!check || check(found, arg))) ||
            ks_mono_us() > deadline)
            return found;
        nanosleep(&(struct timespec){0, 200 * 1000000L}, NULL);
    }
}

/* Whether j's labels has arg ("k=v"). */
static bool
has_label(json_t *j, const void *arg)
{
    const char *kv = arg, *eq = strchr(kv, '=');
    char key[128];
    snprintf(key, sizeof(key), "%.*s", (int)(eq - kv), kv);
    json_t *v = json_object_get(json_object_get(j, "labels"), key);
    return v && strcmp(json_string_value(v), eq + 1) == 0;
}

static bool
lacks_label(json_t *j, const void *arg)
{
    return !json_object_get(json_object_get(j, "labels"), arg);
}

static const char *
jstr(json_t *j, const char *k)
{
    const char *s = json_string_value(json_object_get(j, k));
    return s ? s : "";
}

/* The ids of a batch summary's targets, sorted, comma-joined, in buf. */
static const char *
target_ids(json_t *j, char *buf, size_t len)
{
    json_t *ts = json_object_get(j, "targets");
    const char *ids[64];
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(ts) && n < 64; i++)
        ids[n++] = jstr(json_array_get(ts, i), "agent_id");
    for (size_t i = 1; i < n; i++)
        for (size_t k = i; k > 0 && strcmp(ids[k - 1], ids[k]) > 0; k--) {
            const char *t = ids[k];
            ids[k] = ids[k - 1];
            ids[k - 1] = t;
        }
    buf[0] = '\0';
    for (size_t i = 0; i < n; i++)
        snprintf(buf + strlen(buf), len - strlen(buf), "%s%s", i ? "," : "",
                 ids[i]);
    return buf;
}

/*
 * Usage errors are said before anything is sent, exit 2 (docs/operating.md
 * "Exit codes"): `--select 'env==prod'` was read as the value "=prod" (a batch
 * that matched nothing, or, negated, everything), and an agent id that
 * cannot be one was sent and refused by the broker, exit 125.
 */
START_TEST(selectors_and_agent_ids_are_checked_first)
{
    struct fixture_out o;
    char why[256];
    const char *a1[] = {"batch", "--select", "env==prod", "--", "true", NULL};
    ks(a1, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.err, "did you mean 'env=prod'"), "%s", o.err);
    fixture_out_release(&o);
    const char *a2[] = {"agents", "--select", "local!==true", NULL};
    ks(a2, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.err, "local!=true"), "%s", o.err);
    fixture_out_release(&o);
    ck_assert_int_ne(broker_select_check("env==prod", why, sizeof(why)), 0);
    ck_assert_int_ne(broker_select_check("fact.=x", why, sizeof(why)), 0);
    ck_assert_int_eq(broker_select_check("env=prod", why, sizeof(why)), 0);
    ck_assert_int_eq(broker_select_check("env=", why, sizeof(why)), 0);

    const char *a3[] = {"exec", "--agent", "no such agent", "--", "true",
                        NULL};
    ks(a3, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.err, "bad agent id 'no such agent'"), "%s", o.err);
    fixture_out_release(&o);
    const char *a4[] = {"batch", "--agents", "inv,web/1", "--", "true", NULL};
    ks(a4, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.err, "bad agent id 'web/1'"), "%s", o.err);
    fixture_out_release(&o);
    const char *a5[] = {"list", "--agent", "inv,a b", NULL};
    ks(a5, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
}
END_TEST

static void
write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "we");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* The ids agents_from_a_file lists (<host>-0, <host>-2, inv), in
 * target_ids' order. */
static void
listed_ids(char *buf, size_t len)
{
    char a[96], b[96];
    snprintf(a, sizeof(a), "%s-0", host);
    snprintf(b, sizeof(b), "%s-2", host);
    if (strcmp("inv", a) < 0)
        snprintf(buf, len, "inv,%s,%s", a, b);
    else if (strcmp("inv", b) < 0)
        snprintf(buf, len, "%s,inv,%s", a, b);
    else
        snprintf(buf, len, "%s,%s,inv", a, b);
}

/* --agents @FILE, as pdsh -w ^FILE or clush --hostfile: one id a line,
 * comments and blank lines skipped, errors by FILE:LINE (issue 24: it was
 * refused as a bad id); @- reads them from stdin, which the command then
 * does not get. */
START_TEST(agents_from_a_file)
{
    char dir[] = "/tmp/kscore-inv-XXXXXX", hosts[PATH_MAX], bad[PATH_MAX],
         none[PATH_MAX], text[512], want[PATH_MAX + 64], got[256];
    struct fixture_out o;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(hosts, sizeof(hosts), "%s/hosts.txt", dir);
    snprintf(text, sizeof(text),
             "# the web tier\n\n  %s-0   # first\n%s-2\n\t\ninv\n%s-0\n",
             host, host, host);
    write_file(hosts, text);
    char arg[PATH_MAX + 2];
    snprintf(arg, sizeof(arg), "@%s", hosts);
    const char *a1[] = {"batch", "--agents", arg, "--json", "--", "sh",
                        "-c", "echo $KSCORE_AGENT_ID", NULL};
    ks(a1, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    json_t *j = last_json(&o);
    listed_ids(want, sizeof(want));
    ck_assert_str_eq(target_ids(j, got, sizeof(got)), want);
    json_decref(j);
    fixture_out_release(&o);

    snprintf(bad, sizeof(bad), "%s/bad.txt", dir);
    write_file(bad, "inv\n# ok so far\nweb 1\n");
    snprintf(arg, sizeof(arg), "@%s", bad);
    const char *a2[] = {"batch", "--agents", arg, "--", "true", NULL};
    ks(a2, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    snprintf(want, sizeof(want), "%s:3: bad agent id 'web 1'", bad);
    ck_assert_msg(strstr(o.err, want), "no '%s' in %s", want, o.err);
    fixture_out_release(&o);

    snprintf(none, sizeof(none), "%s/none.txt", dir);
    write_file(none, "# nobody yet\n\n");
    snprintf(arg, sizeof(arg), "@%s", none);
    ks(a2, &o);
    ck_assert_msg(o.status == 2 && strstr(o.err, "no agent id in it"),
                  "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
    snprintf(arg, sizeof(arg), "@%s/missing.txt", dir);
    ks(a2, &o);
    ck_assert_msg(o.status == 2 && strstr(o.err, "cannot read it"),
                  "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);

    /* @-: the ids come on stdin; cat (the command) reads nothing. */
    const char *a3[] = {"batch", "--agents", "@-", "--json", "--", "cat",
                        NULL};
    ck_assert_int_eq(fixture_kscore_stdin(&stack, hosts, a3, &o), 0);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    j = last_json(&o);
    listed_ids(want, sizeof(want));
    ck_assert_str_eq(target_ids(j, got, sizeof(got)), want);
    json_decref(j);
    ck_assert_msg(!strstr(o.out, "web tier"), "the command got stdin: %s",
                  o.out);
    fixture_out_release(&o);
    snprintf(text, sizeof(text), "rm -rf %s", dir);
    ck_assert_int_eq(system(text), 0);
}
END_TEST

/* os-release's "ID-VERSION_ID", as facts.c reads it. */
static void
os_fact(char *out, size_t len)
{
    FILE *f = fopen("/etc/os-release", "re");
    char line[256], id[64] = "", ver[64] = "";
    if (!f)
        f = fopen("/usr/lib/os-release", "re");
    ck_assert_ptr_nonnull(f);
    while (fgets(line, sizeof(line), f)) {
        char *v = strchr(line, '='), *dst;
        if (!v)
            continue;
        *v++ = '\0';
        dst = strcmp(line, "ID") == 0           ? id
              : strcmp(line, "VERSION_ID") == 0 ? ver
                                                : NULL;
        if (!dst)
            continue;
        v[strcspn(v, "\n")] = '\0';
        if (*v == '"' || *v == '\'') {
            v++;
            v[strcspn(v, "\"'")] = '\0';
        }
        snprintf(dst, 64, "%s", v);
    }
    fclose(f);
    snprintf(out, len, "%s%s%s", id, ver[0] ? "-" : "", ver);
}

/*
 * Every agent reports facts of its host (fact.os, fact.kernel, fact.arch,
 * fact.cpus, fact.mem_mb), selectable with --select fact.K=V but never
 * mixed into its labels (which the broker signs): `kscore agents` shows
 * them apart, --json in "facts". A policy cannot grant by one.
 */
START_TEST(facts_are_reported_apart_from_labels)
{
    char os[160], id0[96], sel[256], why[256];
    struct utsname u;
    struct fixture_out o;
    ck_assert_int_eq(uname(&u), 0);
    os_fact(os, sizeof(os));
    snprintf(id0, sizeof(id0), "%s-0", host);
    json_t *a = agent_json(id0, NULL, NULL, 10000);
    ck_assert_ptr_nonnull(a);
    json_t *f = json_object_get(a, "facts");
    ck_assert_msg(json_is_object(f), "no facts");
    ck_assert_str_eq(jstr(f, "os"), os);
    ck_assert_str_eq(jstr(f, "arch"), u.machine);
    ck_assert_str_eq(jstr(f, "kernel"), u.release);
    ck_assert_int_eq(atol(jstr(f, "cpus")), sysconf(_SC_NPROCESSORS_ONLN));
    ck_assert_int_gt(atol(jstr(f, "mem_mb")), 0);
    /* Its labels are its signed ones only. */
    ck_assert_str_eq(jstr(json_object_get(a, "labels"), "local"), "true");
    ck_assert_int_eq(json_object_size(json_object_get(a, "labels")), 1);
    json_decref(a);

    /* Selectable: all five agents share this host's facts. */
    snprintf(sel, sizeof(sel), "fact.arch=%s,fact.os=%.*s*", u.machine, 3,
             os);
    const char *a1[] = {"batch", "--select", sel, "--dry-run", "--json",
                        NULL};
    ks(a1, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    int lines = 0;
    for (const char *p = o.out; *p; p++)
        lines += *p == '\n';
    ck_assert_int_eq(lines, 5);
    fixture_out_release(&o);
    const char *a2[] = {"batch", "--select", "fact.os=no-such-os*", "--",
                        "true", NULL};
    ks(a2, &o);
    ck_assert_msg(o.status == 125 && strstr(o.err, "matched no agent"),
                  "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
    /* A fact is no label: `local` is one, fact.local none. */
    const char *a3[] = {"agents", "--select", "fact.local=true", NULL};
    ks(a3, &o);
    ck_assert_msg(o.status == 0 && !strstr(o.out, id0), "%s", o.out);
    fixture_out_release(&o);
    /* The table shows them apart, the facts marked as the agent's word. */
    const char *a4[] = {"agents", NULL};
    ks(a4, &o);
    ck_assert_msg(strstr(o.out, "FACTS (the agent's own word)") &&
                      strstr(o.out, "fact.arch="),
                  "%s", o.out);
    fixture_out_release(&o);
    /* What the agent says of itself never grants anything. */
    const char *pol = "{\"operators\": {\"x\": [{\"agents\": "
                      "{\"fact.os\": \"debian-12\"}}]}}";
    ck_assert_int_ne(
        broker_policy_check_text("p.json", pol, strlen(pol), NULL), 0);
    (void)why;
}
END_TEST

/* KSCORE_LABEL_<KEY>, KSCORE_FACT_<KEY>: a command knows where it runs. */
START_TEST(labels_and_facts_reach_the_command)
{
    char id0[96], name[AGENT_INVENTORY_NAME_MAX], want[256];
    struct utsname u;
    struct fixture_out o;
    ck_assert_int_eq(uname(&u), 0);
    snprintf(id0, sizeof(id0), "%s-0", host);
    const char *a1[] = {"exec", "--agent", id0, "--", "env", NULL};
    ks(a1, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.out, "\nKSCORE_LABEL_LOCAL=true\n"), "%s", o.out);
    snprintf(want, sizeof(want), "\nKSCORE_FACT_ARCH=%s\n", u.machine);
    ck_assert_msg(strstr(o.out, want), "no %s in %s", want, o.out);
    ck_assert_msg(strstr(o.out, "\nKSCORE_FACT_CPUS="), "%s", o.out);
    fixture_out_release(&o);
    /* The mapping of a key to a variable name. */
    agent_inventory_name("KSCORE_LABEL_", "app.kubernetes.io/name", name,
                         sizeof(name));
    ck_assert_str_eq(name, "KSCORE_LABEL_APP_KUBERNETES_IO_NAME");
    agent_inventory_name("KSCORE_FACT_", "mem_mb", name, sizeof(name));
    ck_assert_str_eq(name, "KSCORE_FACT_MEM_MB");
}
END_TEST

static int
relabels_recorded(const char *stream)
{
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = '%s'"
             " AND type = 'AgentLabelsChanged'",
             stream);
    return (int)fixture_sql_long(stack.pg.conninfo, sql);
}

/*
 * Labels change without a new enrolment (issue 24: revoke, which kills
 * what the agent runs, enroll, a new bundle, a restart): the broker signs
 * the pool's new labels, records the change, and every id of the pool
 * has them at its next heartbeat; a command running meanwhile goes on;
 * the next commands get them in their environment; a broker that starts
 * again keeps them (they are in the record, newer than the attestation
 * it signs its own agents with).
 */
START_TEST(labels_change_without_revocation)
{
    char id0[96], id1[96], pool[96], stream[96], running[40];
    struct fixture_out o;
    snprintf(id0, sizeof(id0), "%s-0", host);
    snprintf(id1, sizeof(id1), "%s-1", host);
    snprintf(pool, sizeof(pool), "pool-%s", host);
    snprintf(stream, sizeof(stream), "pool-%s", host);

    /* Something runs on the pool while it is relabelled. */
    const char *a0[] = {"exec", "--agent", id1, "--detach", "--", "sleep",
                        "3", NULL};
    ks(a0, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    snprintf(running, sizeof(running), "%.36s", o.out);
    fixture_out_release(&o);

    const char *a1[] = {"agent", "label", pool, "env=prod",
                        "app.kubernetes.io/name=web", "--json", NULL};
    ks(a1, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    json_t *j = last_json(&o);
    ck_assert(json_is_true(json_object_get(j, "changed")));
    ck_assert(json_is_true(json_object_get(j, "applied")));
    ck_assert_str_eq(jstr(json_object_get(j, "labels"), "env"), "prod");
    ck_assert_str_eq(jstr(json_object_get(j, "labels"), "local"), "true");
    ck_assert_int_eq(json_object_size(json_object_get(j, "previous")), 1);
    json_decref(j);
    fixture_out_release(&o);

    json_t *a = agent_json(id0, has_label, "env=prod", 10000);
    ck_assert_msg(a && has_label(a, "env=prod") &&
                      json_is_true(json_object_get(a, "labels_signed")) &&
                      jstr(a, "labels_by")[0] && jstr(a, "labels_at")[0],
                  "%s", a ? json_dumps(a, 0) : "(none)");
    json_decref(a);
    /* Selected by it; its commands see it. */
    const char *a2[] = {"batch", "--select", "env=prod", "--json", "--",
                        "sh", "-c",
                        "echo $KSCORE_LABEL_ENV "
                        "$KSCORE_LABEL_APP_KUBERNETES_IO_NAME",
                        NULL};
    ks(a2, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    j = last_json(&o);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total")), 4);
    json_decref(j);
    ck_assert_msg(strstr(o.out, "\"stdout\":\"prod web\\n\""), "%s", o.out);
    fixture_out_release(&o);
    /* The command that ran meanwhile was not touched. */
    const char *g[] = {"get", running, "--json", NULL};
    for (int i = 0; i < 100; i++) {
        ks(g, &o);
        j = json_loads(o.out, 0, NULL);
        fixture_out_release(&o);
        if (j && strcmp(jstr(j, "status"), "Running") != 0 &&
            strcmp(jstr(j, "status"), "Dispatched") != 0)
            break;
        json_decref(j);
        j = NULL;
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    }
    ck_assert_ptr_nonnull(j);
    ck_assert_str_eq(jstr(j, "status"), "Succeeded");
    json_decref(j);

    /* Recorded once, with who asked; the same change again records
     * nothing. */
    ck_assert_int_eq(relabels_recorded(stream), 1);
    const char *ev[] = {"events", stream, "--json", NULL};
    ks(ev, &o);
    ck_assert_msg(strstr(o.out, "\"type\":\"AgentLabelsChanged\"") &&
                      strstr(o.out, "\"operator\":") &&
                      strstr(o.out, "\"previous_labels\":{\"local\":\"true\"}"),
                  "%s", o.out);
    fixture_out_release(&o);
    const char *a3[] = {"agent", "label", pool, "env=prod", "--json", NULL};
    ks(a3, &o);
    ck_assert_msg(o.status == 0 && strstr(o.out, "\"changed\":false"),
                  "exit %d: %s%s", o.status, o.out, o.err);
    fixture_out_release(&o);
    ck_assert_int_eq(relabels_recorded(stream), 1);

    /* Refused: an id of the pool (its labels are the pool's), a fact's
     * key, and what is no change. */
    const char *b1[] = {"agent", "label", id0, "env=dev", NULL};
    ks(b1, &o);
    ck_assert_msg(o.status == 125 && strstr(o.err, "kscore agent label pool-"),
                  "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
    const char *b2[] = {"agent", "label", pool, "fact.os=lies", NULL};
    ks(b2, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
    const char *b3[] = {"agent", "label", pool, "env", NULL};
    ks(b3, &o);
    ck_assert_msg(o.status == 2, "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);

    /* A broker that starts again has them from the record. */
    fixture_stack_broker_kill(&stack, SIGKILL);
    ck_assert_int_eq(fixture_stack_broker_start(&stack, 4), 0);
    a = agent_json(id0, NULL, NULL, 10000);
    ck_assert_msg(a && has_label(a, "env=prod") &&
                      has_label(a, "app.kubernetes.io/name=web") &&
                      json_is_true(json_object_get(a, "labels_signed")),
                  "%s", a ? json_dumps(a, 0) : "(none)");
    json_decref(a);

    /* KEY- removes; an agent of its own (never enrolled) as well. */
    const char *a4[] = {"agent", "label", pool, "env-",
                        "app.kubernetes.io/name-", NULL};
    ks(a4, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    fixture_out_release(&o);
    a = agent_json(id0, lacks_label, "env", 10000);
    ck_assert_msg(a && lacks_label(a, "env") && has_label(a, "local=true"),
                  "%s", a ? json_dumps(a, 0) : "(none)");
    json_decref(a);
    const char *a5[] = {"agent", "label", "inv", "role=db", NULL};
    ks(a5, &o);
    ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
    ck_assert_msg(strstr(o.out, "inv: role=db (was no labels)"), "%s",
                  o.out);
    fixture_out_release(&o);
    a = agent_json("inv", has_label, "role=db", 10000);
    ck_assert_msg(a && json_is_true(json_object_get(a, "labels_signed")),
                  "%s", a ? json_dumps(a, 0) : "(none)");
    json_decref(a);
    ck_assert_int_eq(relabels_recorded("agent-inv"), 1);
}
END_TEST

int
main(void)
{
    Suite *s = suite_create("inventory");
    TCase *tc = tcase_create("inventory");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, selectors_and_agent_ids_are_checked_first);
    tcase_add_test(tc, agents_from_a_file);
    tcase_add_test(tc, facts_are_reported_apart_from_labels);
    tcase_add_test(tc, labels_and_facts_reach_the_command);
    tcase_add_test(tc, labels_change_without_revocation);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
