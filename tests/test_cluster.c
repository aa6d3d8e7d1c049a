/*
 * test_cluster: `kscore up --cluster 3`. Three nats-server nodes with
 * routes, the streams and the agent registry on 3 replicas, two brokers.
 * A batch survives kill -9 of one node (the clients have every node's url)
 * and of one broker (the other adopts the batch's lease), every target
 * ends exactly once in PostgreSQL, and `kscore up` starts again only what
 * died. Real processes throughout.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "events.h"
#include "fixture.h"
#include "kproto.h"
#include "stack.h"

#define FLEET 50 /* agent ids of the batch, served by one process */

static char tmpdir[PATH_MAX];
static char home[PATH_MAX + 16];

/* Every test's stack lives under this root (made by main), so main can
 * stop what a failed test left running: Check's forked test ends at a
 * failed assertion without its teardown. */
static char root[PATH_MAX - 64];

static void
cl_setup(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "%s/t-XXXXXX", root);
    if (!mkdtemp(tmpdir))
        exit(1);
    snprintf(home, sizeof(home), "%s/home", tmpdir);
    setenv("KSCORE_PG_FAST", "1", 0);
}

/* Stops the fleet and the stack of one test's home. */
static void
stack_down(const char *h)
{
    struct fixture_out o;
    const char *args[] = {"down", NULL};
    stack_stop(h, "fleet", 10000);
    if (fixture_kscore_home(h, args, &o) == 0)
        fixture_out_release(&o);
}

static void
cl_teardown(void)
{
    stack_down(home);
}

static double
now_s(void)
{
    return (double)ks_mono_us() / 1e6;
}

static void
ks_ok(const char *const args[], struct fixture_out *o)
{
    ck_assert_int_eq(fixture_kscore_home(home, args, o), 0);
    ck_assert_msg(o->status == 0, "kscore %s: exit %d: %s%s", args[0],
                  o->status, o->out, o->err);
}

/* A value of home's env file (malloc'd). */
static char *
env_get(const char *key)
{
    char path[PATH_MAX + 32], line[4096];
    size_t kl = strlen(key);
    char *v = NULL;
    snprintf(path, sizeof(path), "%s/env", home);
    FILE *f = fopen(path, "re");
    ck_assert_msg(f != NULL, "no %s", path);
    while (!v && fgets(line, sizeof(line), f))
        if (strncmp(line, key, kl) == 0 && line[kl] == '=') {
            char *s = line + kl + 1;
            s += *s == '\'';
            s[strcspn(s, "'\n")] = '\0';
            v = strdup(s);
        }
    fclose(f);
    ck_assert_msg(v != NULL, "no %s in %s", key, path);
    return v;
}

/* `kscore up --cluster 3`; the time it took. */
static double
up_cluster(void)
{
    struct fixture_out o;
    const char *args[] = {"up", "--cluster", "3", NULL};
    double t0 = now_s();
    ks_ok(args, &o);
    fixture_out_release(&o);
    return now_s() - t0;
}

/* A connection with the broker's credential (it may ask JetStream). */
static struct evt_conn *
broker_conn(void)
{
    char seed[PATH_MAX + 64], *url = env_get("KSCORE_NATS_URL"), *err = NULL;
    struct evt_conn *c = NULL;
    snprintf(seed, sizeof(seed), "%s/keys/broker.nk", home);
    struct evt_connect_opts o = {.name = "test-cluster", .nkey_file = seed};
    int rc = evt_connect(url, &o, &c, &err);
    ck_assert_msg(rc == 0, "connect %s: %s", url, err ? err : "");
    free(url);
    return c;
}

/* The stream's replica count; its leader into leader. */
static int
stream_replicas(struct evt_conn *c, const char *name, char *leader,
                size_t len)
{
    jsStreamInfo *si = NULL;
    natsStatus s = NATS_TIMEOUT;
    /* a node that has just come back may not know the stream's leader */
    for (int i = 0; i < 50 && s != NATS_OK; i++) {
        s = js_GetStreamInfo(&si, c->js, name, NULL, NULL);
        if (s != NATS_OK)
            usleep(200 * 1000);
    }
    ck_assert_msg(s == NATS_OK, "stream info %s: %s", name,
                  natsStatus_GetText(s));
    int r = (int)si->Config->Replicas;
    ck_assert_msg(si->Cluster != NULL, "%s: no cluster info", name);
    ck_assert_int_eq(si->Cluster->ReplicasLen, r - 1);
    if (leader)
        snprintf(leader, len, "%s", si->Cluster->Leader ? si->Cluster->Leader
                                                        : "");
    jsStreamInfo_Destroy(si);
    return r;
}

/* One `kscore agent` process serving t-1..t-FLEET (the broker's
 * credential: one identity may serve many ids only with that). */
static void
fleet_start(void)
{
    char *url = env_get("KSCORE_NATS_URL");
    char seed[PATH_MAX + 64], trust[PATH_MAX + 64], state[PATH_MAX + 64];
    const char *bin = getenv("KSCORE_BIN");
    char *argv[16 + 2 * FLEET], ids[FLEET][16];
    size_t n = 0;
    pid_t pid;
    snprintf(seed, sizeof(seed), "%s/keys/broker.nk", home);
    snprintf(trust, sizeof(trust), "%s/keys/broker.pub", home);
    snprintf(state, sizeof(state), "%s/fleet", tmpdir);
    argv[n++] = (char *)(bin ? bin : "kscore");
    argv[n++] = "agent";
    for (int i = 0; i < FLEET; i++) {
        snprintf(ids[i], sizeof(ids[i]), "t-%d", i + 1);
        argv[n++] = "--id";
        argv[n++] = ids[i];
    }
    argv[n++] = "--nats";
    argv[n++] = url;
    argv[n++] = "--trust-key";
    argv[n++] = trust;
    argv[n++] = "--state-dir";
    argv[n++] = state;
    argv[n++] = "--max-concurrent";
    argv[n++] = "64";
    argv[n++] = "--config";
    argv[n++] = "/dev/null";
    argv[n] = NULL;
    setenv("KSCORE_NATS_NKEY", seed, 1);
    ck_assert_int_eq(stack_daemon(home, "fleet", argv, &pid), 0);
    unsetenv("KSCORE_NATS_NKEY");
    free(url);
}

/* Waits until every fleet id is online in the registry. */
static void
fleet_wait(void)
{
    const char *args[] = {"agents", "--json", NULL};
    double t0 = now_s();
    int online = 0;
    while (now_s() - t0 < 60) {
        struct fixture_out o;
        ck_assert_int_eq(fixture_kscore_home(home, args, &o), 0);
        online = 0;
        for (char *p = o.out; (p = strstr(p, "\"agent_id\":\"t-")); p++) {
            char *e = strchr(p, '\n');
            if (e && memmem(p, (size_t)(e - p), "\"online\":true", 13))
                online++;
        }
        fixture_out_release(&o);
        if (online >= FLEET)
            break;
        usleep(300 * 1000);
    }
    ck_assert_msg(online >= FLEET, "%d of %d fleet ids online", online,
                  FLEET);
    /* and every id's consumer made (a raft group each on a cluster) */
    struct stack_node nodes[3];
    int consumers = 0;
    stack_cluster_nodes(home, 3, nodes);
    while (now_s() - t0 < 90) {
        struct stack_js_info ji;
        if (stack_nats_js_info(nodes[0].mon_port, &ji) == 0 &&
            (consumers = ji.consumers) >= FLEET + 1)
            break;
        usleep(250 * 1000);
    }
    ck_assert_msg(consumers >= FLEET + 1, "%d consumers", consumers);
    fprintf(stderr, "test_cluster: %d fleet ids online in %.1f s\n", FLEET,
            now_s() - t0);
}

/* A detached batch of `sleep 0.2` on the fleet; its id (static). */
static const char *
batch_start(unsigned conc)
{
    static char id[64];
    char agents[FLEET * 8] = "", concs[16];
    size_t l = 0;
    for (int i = 0; i < FLEET; i++)
        l += (size_t)snprintf(agents + l, sizeof(agents) - l, "%st-%d",
                              i ? "," : "", i + 1);
    snprintf(concs, sizeof(concs), "%u", conc);
    const char *args[] = {"batch", "--agents", agents, "--max-concurrency",
                          concs, "--yes", "--detach", "--", "sleep", "0.2",
                          NULL};
    struct fixture_out o;
    ks_ok(args, &o);
    snprintf(id, sizeof(id), "%.*s", (int)strcspn(o.out, "\n"), o.out);
    fixture_out_release(&o);
    ck_assert_msg(strncmp(id, "batch-", 6) == 0, "batch id '%s'", id);
    return id;
}

/* Waits until n targets of batch are terminal (from the projection). */
static void
wait_targets_done(const char *db, const char *batch, long n)
{
    char sql[512];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets WHERE batch_id = '%s' AND "
             "status NOT IN ('Pending','Dispatched','Running')",
             batch);
    double t0 = now_s();
    long v = 0;
    while (now_s() - t0 < 60 && (v = fixture_sql_long(db, sql)) < n)
        usleep(100 * 1000);
    (void)v;
}

/* The targets' states, one line. */
static void
print_statuses(const char *db, const char *batch)
{
    char sql[512];
    fprintf(stderr, "test_cluster: %s:", batch);
    static const char *const sts[] = {"Succeeded", "Failed", "Lost",
                                      "Undeliverable", "NotStarted",
                                      "Cancelled", "StartFailed", "TimedOut"};
    for (size_t i = 0; i < sizeof(sts) / sizeof(sts[0]); i++) {
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM batch_targets WHERE batch_id = '%s' "
                 "AND status = '%s'",
                 batch, sts[i]);
        long n = fixture_sql_long(db, sql);
        if (n > 0)
            fprintf(stderr, " %s %ld", sts[i], n);
    }
    fprintf(stderr, "\n");
}

/* The record of the batch: it ended once, every target has exactly one
 * terminal event and at most one start. Returns how many succeeded. */
static long
check_batch_record(const char *db, const char *batch)
{
    char sql[1024];
    const char *term = "('CommandCompleted','CommandStartFailed',"
                       "'CommandUndeliverable','CommandLost',"
                       "'CommandCancelled','CommandNotStarted')";

    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM events WHERE stream_id = '%s' AND type "
             "IN ('BatchCompleted','BatchCancelled')",
             batch);
    ck_assert_int_eq(fixture_wait_sql(db, sql, 1, 60000), 1);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets WHERE batch_id = '%s'",
             batch);
    ck_assert_int_eq(fixture_sql_long(db, sql), FLEET);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets t WHERE t.batch_id = '%s' "
             "AND (SELECT count(*) FROM events e WHERE e.stream_id = "
             "'command-' || t.command_id AND e.type IN %s) <> 1",
             batch, term);
    ck_assert_msg(fixture_sql_long(db, sql) == 0,
                  "targets of %s without exactly one terminal event", batch);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets t WHERE t.batch_id = '%s' "
             "AND (SELECT count(*) FROM events e WHERE e.stream_id = "
             "'command-' || t.command_id AND e.type = 'CommandStarted') > 1",
             batch);
    ck_assert_int_eq(fixture_sql_long(db, sql), 0);
    print_statuses(db, batch);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets WHERE batch_id = '%s' AND "
             "status = 'Succeeded'",
             batch);
    return fixture_sql_long(db, sql);
}

static pid_t
node_pid(int i)
{
    char dir[PATH_MAX + 32];
    pid_t pid = 0;
    snprintf(dir, sizeof(dir), "%s/nats-%d", home, i);
    ck_assert_int_eq(stack_pidfile_alive(dir, "nats", &pid), 1);
    return pid;
}

static void
print_rss(const char *when)
{
    fprintf(stderr, "test_cluster: RSS %s:", when);
    for (int i = 1; i <= 3; i++) {
        char dir[PATH_MAX + 32];
        pid_t pid = 0;
        snprintf(dir, sizeof(dir), "%s/nats-%d", home, i);
        if (stack_pidfile_alive(dir, "nats", &pid))
            fprintf(stderr, " nats-%d %ld kB", i, stack_rss_kb(pid));
    }
    for (int i = 1; i <= 2; i++) {
        char name[16];
        pid_t pid = 0;
        snprintf(name, sizeof(name), "broker-%d", i);
        if (stack_pidfile_alive(home, name, &pid))
            fprintf(stderr, " %s %ld kB", name, stack_rss_kb(pid));
    }
    fprintf(stderr, "\n");
}

/* status --json: three nodes, one meta leader, two brokers. */
static void
check_status(void)
{
    struct fixture_out o;
    const char *args[] = {"status", "--json", NULL};
    json_t *j, *nodes, *brokers;
    int leaders = 0;
    ks_ok(args, &o);
    j = json_loads(o.out, 0, NULL);
    ck_assert_msg(j != NULL, "status --json: %s", o.out);
    nodes = json_object_get(j, "nodes");
    brokers = json_object_get(j, "brokers");
    ck_assert_int_eq(json_array_size(nodes), 3);
    ck_assert_int_eq(json_array_size(brokers), 2);
    for (size_t i = 0; i < 3; i++) {
        json_t *n = json_array_get(nodes, i);
        const char *role =
            json_string_value(json_object_get(n, "jetstream_role"));
        char want[16];
        snprintf(want, sizeof(want), "nats-%zu", i + 1);
        ck_assert_str_eq(json_string_value(json_object_get(n, "state")),
                         "running");
        ck_assert_str_eq(
            json_string_value(json_object_get(n, "server_name")), want);
        ck_assert_msg(role && (strcmp(role, "leader") == 0 ||
                               strcmp(role, "follower") == 0),
                      "role %s", role ? role : "null");
        leaders += strcmp(role, "leader") == 0;
    }
    ck_assert_int_eq(leaders, 1);
    for (size_t i = 0; i < 2; i++)
        ck_assert_str_eq(json_string_value(json_object_get(
                             json_array_get(brokers, i), "state")),
                         "running");
    json_decref(j);
    fixture_out_release(&o);
}

/* The broker that holds the batch's lease dies mid-batch. */
static void
broker_kill_mid_batch(const char *db)
{

    /* The broker that holds the batch's lease dies: the other adopts the
     * batch when the lease runs out and finishes it. */
    const char *batch = batch_start(5);
    char sql[512], owner[32] = "";
    snprintf(sql, sizeof(sql),
             "SELECT split_part(owner, '/', 2)::int FROM batch_leases "
             "WHERE batch_id = '%s' AND owner <> ''",
             batch);
    long opid = -1;
    for (int i = 0; i < 30 && opid <= 0; i++) {
        usleep(100 * 1000);
        opid = fixture_sql_long(db, sql);
    }
    wait_targets_done(db, batch, 8);
    int victim = 0;
    for (int i = 1; i <= 2; i++) {
        char name[16];
        pid_t p = 0;
        snprintf(name, sizeof(name), "broker-%d", i);
        if (stack_pidfile_alive(home, name, &p) && p == (pid_t)opid)
            victim = i;
    }
    if (!victim)
        victim = 1; /* the lease owner unknown: kill one all the same */
    snprintf(owner, sizeof(owner), "broker-%d", victim);
    fprintf(stderr, "test_cluster: kill -9 %s (lease owner pid %ld)\n", owner,
            opid);
    pid_t bp = 0;
    ck_assert_int_eq(stack_pidfile_alive(home, owner, &bp), 1);
    ck_assert_int_eq(kill(bp, SIGKILL), 0);
    double t0 = now_s();
    ck_assert_int_eq(check_batch_record(db, batch), FLEET);
    fprintf(stderr, "test_cluster: batch ended %.1f s after the broker kill\n",
            now_s() - t0);

    /* up starts that broker alone */
    up_cluster();
    pid_t nb = 0;
    ck_assert_int_eq(stack_pidfile_alive(home, owner, &nb), 1);
    ck_assert_int_ne(nb, bp);
    check_status();
}

START_TEST(node_kill_then_broker_kill)
{
    double up_s = up_cluster();
    fprintf(stderr, "test_cluster: up --cluster 3 took %.2f s\n", up_s);
    check_status();

    struct evt_conn *c = broker_conn();
    char leader[64] = "";
    ck_assert_int_eq(stream_replicas(c, EVT_STREAM_CMDS, leader,
                                     sizeof(leader)), 3);
    ck_assert_int_eq(stream_replicas(c, EVT_STREAM_EVENTS, NULL, 0), 3);
    ck_assert_int_eq(stream_replicas(c, "KV_" EVT_KV_AGENTS, NULL, 0), 3);

    /* exec on the local agent, connected with every node's url */
    struct fixture_out o;
    const char *ex[] = {"exec", "--", "echo", "hi", NULL};
    ks_ok(ex, &o);
    ck_assert_str_eq(o.out, "hi\n");
    fixture_out_release(&o);

    fleet_start();
    fleet_wait();
    print_rss("idle");
    char *db = env_get("KSCORE_DB");

    /* kill -9 the node that leads KSCORE_CMDS (the worst one to lose)
     * while the batch runs */
    const char *batch = batch_start(5);
    int victim = atoi(leader + 5);
    ck_assert_msg(victim >= 1 && victim <= 3, "leader '%s'", leader);
    wait_targets_done(db, batch, 8);
    pid_t old = node_pid(victim);
    ck_assert_int_eq(kill(old, SIGKILL), 0);
    fprintf(stderr, "test_cluster: killed nats-%d (pid %d) mid-batch\n",
            victim, (int)old);
    double t0 = now_s();
    long ok = check_batch_record(db, batch);
    fprintf(stderr,
            "test_cluster: batch ended %.1f s after the kill: %ld of %d "
            "succeeded, every target ended once\n",
            now_s() - t0, ok, FLEET);
    print_rss("after the batch (2 nodes)");

    /* `up` starts that node alone, on its port; the others keep their
     * pids */
    pid_t others[4] = {0};
    for (int i = 1; i <= 3; i++)
        if (i != victim)
            others[i] = node_pid(i);
    char bpid[2][16];
    for (int i = 0; i < 2; i++) {
        char name[16];
        pid_t p = 0;
        snprintf(name, sizeof(name), "broker-%d", i + 1);
        ck_assert_int_eq(stack_pidfile_alive(home, name, &p), 1);
        snprintf(bpid[i], sizeof(bpid[i]), "%d", (int)p);
    }
    char *url_before = env_get("KSCORE_NATS_URL");
    double up2 = up_cluster();
    fprintf(stderr, "test_cluster: up restarted nats-%d in %.2f s\n", victim,
            up2);
    for (int i = 1; i <= 3; i++)
        if (i != victim)
            ck_assert_int_eq(node_pid(i), others[i]);
    ck_assert_int_ne(node_pid(victim), old);
    for (int i = 0; i < 2; i++) {
        char name[16];
        pid_t p = 0;
        snprintf(name, sizeof(name), "broker-%d", i + 1);
        ck_assert_int_eq(stack_pidfile_alive(home, name, &p), 1);
        ck_assert_int_eq(p, atoi(bpid[i]));
    }
    char *url_after = env_get("KSCORE_NATS_URL");
    ck_assert_str_eq(url_before, url_after);
    check_status();
    ck_assert_int_eq(stream_replicas(c, EVT_STREAM_EVENTS, NULL, 0), 3);

    /* and a small batch works on the healed cluster */
    const char *b2 = batch_start(50);
    ck_assert_int_eq(check_batch_record(db, b2), FLEET);
    print_rss("after the second batch");

    /* then one broker dies in the middle of a third */
    broker_kill_mid_batch(db);
    evt_close(c);
    free(url_before);
    free(url_after);
    free(db);
}
END_TEST


static Suite *
cluster_suite(void)
{
    Suite *s = suite_create("cluster");
    TCase *tc = tcase_create("cluster");
    tcase_add_checked_fixture(tc, cl_setup, cl_teardown);
    tcase_set_timeout(tc, 180);
    tcase_add_test(tc, node_kill_then_broker_kill);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    const char *t = getenv("TMPDIR"), *keep = getenv("KSCORE_KEEP_TMP");
    char cmd[PATH_MAX + 64];
    snprintf(root, sizeof(root), "%s/kscore-cluster-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(root))
        return 1;
    SRunner *sr = srunner_create(cluster_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    /* whatever a test left running (a failed one skips its teardown) */
    DIR *d = opendir(root);
    for (struct dirent *de; d && (de = readdir(d));) {
        char h[PATH_MAX + 300];
        if (de->d_name[0] == '.')
            continue;
        snprintf(h, sizeof(h), "%s/%s/home", root, de->d_name);
        stack_down(h);
    }
    if (d)
        closedir(d);
    if (keep && strcmp(keep, "1") == 0) {
        fprintf(stderr, "test_cluster: kept %s\n", root);
    } else {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", root);
    }
    return failed ? 1 : 0;
}
