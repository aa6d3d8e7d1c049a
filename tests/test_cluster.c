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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
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
    /* deploy_files_start_a_cluster's parts */
    stack_stop(h, "dagent", 10000);
    stack_stop(h, "ragent", 10000);
    stack_stop(h, "dbroker-1", 10000);
    stack_stop(h, "dbroker-2", 10000);
    for (int i = 1; i <= 3; i++) {
        char n[16];
        snprintf(n, sizeof(n), "dnats-%d", i);
        stack_stop(h, n, 10000);
    }
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
    char *v = stack_env_get(home, key);
    ck_assert_msg(v != NULL, "no %s in %s/env", key, home);
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
        if (stack_nats_js_info(&nodes[0], &ji) == 0 &&
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

/*
 * An agent that starts while the registry stream has no leader (two of
 * the three nodes down: no quorum; as after a restart of the nodes, until
 * the stream's raft group elects one) keeps trying to register, and does
 * once the nodes are back, instead of exiting at its first heartbeat.
 */
START_TEST(agent_registers_once_the_registry_answers)
{
    up_cluster();
    ck_assert_int_eq(stack_stop(home, "agent", 20000), 0);
    pid_t p2 = node_pid(2), p3 = node_pid(3);
    ck_assert_int_eq(kill(p2, SIGKILL), 0);
    ck_assert_int_eq(kill(p3, SIGKILL), 0);
    for (int i = 0; i < 200 && (kill(p2, 0) == 0 || kill(p3, 0) == 0); i++)
        usleep(10 * 1000);

    char *url = env_get("KSCORE_NATS_URL"), *agent = env_get("KSCORE_AGENT");
    char seed[PATH_MAX + 64], trust[PATH_MAX + 64], state[PATH_MAX + 32];
    const char *bin = getenv("KSCORE_BIN");
    pid_t pid;
    snprintf(seed, sizeof(seed), "%s/keys/agent-%s.nk", home, agent);
    snprintf(trust, sizeof(trust), "%s/keys/broker.pub", home);
    snprintf(state, sizeof(state), "%s/ragent", tmpdir);
    char *argv[] = {(char *)(bin ? bin : "kscore"), "agent", "--id", agent,
                    "--nats", url, "--trust-key", trust, "--state-dir",
                    state, "--config", "/dev/null", NULL};
    setenv("KSCORE_NATS_NKEY", seed, 1);
    ck_assert_int_eq(stack_daemon(home, "ragent", argv, &pid), 0);
    unsetenv("KSCORE_NATS_NKEY");
    /* a few heartbeat timeouts: it is still there, trying */
    sleep(5);
    ck_assert_msg(stack_pidfile_alive(home, "ragent", NULL) == 1,
                  "the agent gave up while the registry had no leader (see "
                  "%s/ragent.log)", home);

    /* the two nodes again (not `up`: it would start its own agent) */
    struct stack_node nodes[3];
    stack_cluster_nodes(home, 3, nodes);
    ck_assert_int_eq(stack_cluster_start(home, 3, nodes,
                                         STACK_NATS_AUTH_INCLUDE, NULL, 0),
                     0);
    double t0 = now_s();
    const char *ex[] = {"exec", "--", "echo", "back", NULL};
    struct fixture_out o;
    int st;
    do {
        ck_assert_int_eq(fixture_kscore_home(home, ex, &o), 0);
        st = o.status;
        if (st == 0)
            ck_assert_str_eq(o.out, "back\n");
        fixture_out_release(&o);
        if (st != 0)
            usleep(500 * 1000);
    } while (st != 0 && now_s() - t0 < 60);
    ck_assert_msg(st == 0, "no exec on the agent 60 s after the nodes came "
                           "back (see %s/ragent.log)", home);
    fprintf(stderr, "test_cluster: the waiting agent served %.1f s after "
                    "the nodes came back\n", now_s() - t0);
    free(url);
    free(agent);
}
END_TEST

/* ---- the files of deploy/cluster, as documented, on loopback ------------ */

/* text with every `from` replaced by `to` (malloc'd; text is freed). */
static char *
subst(char *text, const char *from, const char *to)
{
    size_t fl = strlen(from), tl = strlen(to), n = 0;
    for (const char *p = text; (p = strstr(p, from)); p += fl)
        n++;
    char *out = malloc(strlen(text) + n * tl + 1), *o = out;
    ck_assert_ptr_nonnull(out);
    const char *p = text, *q;
    while ((q = strstr(p, from))) {
        memcpy(o, p, (size_t)(q - p));
        o += q - p;
        memcpy(o, to, tl);
        o += tl;
        p = q + fl;
    }
    strcpy(o, p);
    free(text);
    return out;
}

/* The first line that is not a comment and still names a host value
 * (example.net, /etc/, /var/), or NULL. */
static const char *
host_value_left(const char *t)
{
    for (const char *l = t; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1
                                                          : NULL) {
        const char *p = l;
        size_t len = strcspn(l, "\n");
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p == '#')
            continue;
        if (memmem(l, len, "example.net", 11) || memmem(l, len, "/etc/", 5) ||
            memmem(l, len, "/var/", 5))
            return l;
    }
    return NULL;
}

static char *
slurp(const char *path)
{
    FILE *f = fopen(path, "re");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    char *buf = malloc(1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void
spill(const char *path, const char *text)
{
    FILE *f = fopen(path, "we");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/*
 * The documented files for real hosts (deploy/cluster/nats-1..3.conf,
 * broker-1..2.conf) start a working cluster: rendered with only the
 * host-specific values replaced (addresses by loopback ports, /etc and
 * /var paths by this test's; the TLS material from the stack's CA), three
 * nats-server and two brokers run from them, an agent registers over TLS
 * and one exec runs.
 */
START_TEST(deploy_files_start_a_cluster)
{
    const char *src = getenv("KSCORE_SOURCE_DIR");
    const char *bin = getenv("KSCORE_BIN");
    char path[PATH_MAX + 512], tls[4400], cmd[6 * PATH_MAX];
    struct stack_node nodes[3];
    int port[3], route[3], mon[3];
    struct fixture_out o;

    ck_assert_msg(src != NULL, "KSCORE_SOURCE_DIR");
    /* The stack's identities, keys, users file and PostgreSQL, from a
     * plain `kscore up`; its own nats-server, broker and agent stop. */
    const char *up[] = {"up", NULL};
    ks_ok(up, &o);
    fixture_out_release(&o);
    ck_assert_int_eq(stack_stop(home, "agent", 20000), 0);
    ck_assert_int_eq(stack_stop(home, "broker", 20000), 0);
    ck_assert_int_eq(stack_nats_stop(home), 0);
    char *db = env_get("KSCORE_DB"), *agent = env_get("KSCORE_AGENT");
    char *op_seed = env_get("KSCORE_NATS_NKEY");

    /* TLS: the stack's CA; a server certificate for the client port and a
     * route certificate good for both ends of a route (serverAuth and
     * clientAuth: with verify, each node checks the other's). */
    const char *names[] = {"127.0.0.1", "localhost"};
    ck_assert_int_eq(stack_tls_server_ensure(home, names, 2), 0);
    struct stack_tls_paths tp;
    stack_tls_paths(home, &tp);
    snprintf(tls, sizeof(tls), "%s", tp.dir);
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n"
             "extendedKeyUsage=serverAuth,clientAuth\\n' > route.ext && "
             "openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 "
             "-nodes -keyout route.key -subj /CN=localhost -out route.csr "
             "2>/dev/null && openssl x509 -req -in route.csr -CA '%s' -CAkey "
             "'%s' -CAcreateserial -days 2 -extfile route.ext -out route.pem "
             "2>/dev/null",
             tls, tp.ca_cert, tp.ca_key);
    ck_assert_int_eq(system(cmd), 0);

    for (int i = 0; i < 3; i++) {
        port[i] = stack_free_port();
        route[i] = stack_free_port();
        mon[i] = stack_free_port();
        ck_assert(port[i] > 0 && route[i] > 0 && mon[i] > 0);
    }
    for (int i = 0; i < 3; i++) {
        char dir[PATH_MAX + 32], v[4500], from[128];
        struct stack_node *nd = &nodes[i];
        memset(nd, 0, sizeof(*nd));
        snprintf(dir, sizeof(dir), "%s/node-%d", tmpdir, i + 1);
        ck_assert_int_eq(stack_mkdirs(dir, 0700), 0);
        ck_assert_int_eq(stack_nats_auth_write(dir, home), 0);
        snprintf(path, sizeof(path), "%s/deploy/cluster/nats-%d.conf", src,
                 i + 1);
        char *t = slurp(path);
        snprintf(v, sizeof(v), "\"127.0.0.1:%d\"", port[i]);
        t = subst(t, "\"0.0.0.0:4222\"", v);
        snprintf(v, sizeof(v), "\"127.0.0.1:%d\"", route[i]);
        t = subst(t, "\"0.0.0.0:6222\"", v);
        snprintf(v, sizeof(v), "\"127.0.0.1:%d\"", mon[i]);
        t = subst(t, "\"127.0.0.1:8222\"", v);
        for (int j = 0; j < 3; j++) {
            snprintf(from, sizeof(from), "nats-route://nats-%d.example.net:6222",
                     j + 1);
            snprintf(v, sizeof(v), "nats-route://localhost:%d", route[j]);
            t = subst(t, from, v);
        }
        t = subst(t, "/etc/nats/server.pem", tp.server_cert);
        t = subst(t, "/etc/nats/server.key", tp.server_key);
        t = subst(t, "/etc/nats/ca.pem", tp.ca_cert);
        snprintf(v, sizeof(v), "%s/route.pem", tls);
        t = subst(t, "/etc/nats/route.pem", v);
        snprintf(v, sizeof(v), "%s/route.key", tls);
        t = subst(t, "/etc/nats/route.key", v);
        snprintf(v, sizeof(v), "%s/jetstream", dir);
        t = subst(t, "/var/lib/nats/jetstream", v);
        ck_assert_msg(!host_value_left(t), "a host value left in "
                      "nats-%d.conf: %.80s", i + 1, host_value_left(t));
        snprintf(path, sizeof(path), "%s/nats.conf", dir);
        spill(path, t);
        free(t);
        char *argv[] = {"/usr/sbin/nats-server", "-c", path, NULL};
        char name[16];
        snprintf(name, sizeof(name), "dnats-%d", i + 1);
        ck_assert_int_eq(stack_daemon(home, name, argv, &nd->pid), 0);
        nd->index = i + 1;
        snprintf(nd->name, sizeof(nd->name), "nats-%d", i + 1);
        nd->port = port[i];
        nd->mon_port = mon[i];
        nd->running = true;
    }
    char leader[64] = "";
    ck_assert_msg(stack_cluster_wait_leader(nodes, 3, 60000, leader,
                                            sizeof(leader)) == 0,
                  "no meta leader (see %s/dnats-*.log)", home);
    fprintf(stderr, "test_cluster: deploy files: meta leader %s\n", leader);

    /* the brokers, from broker-1.conf and broker-2.conf */
    char url[256], ca[4400], nk[PATH_MAX + 64], sk[PATH_MAX + 64];
    snprintf(url, sizeof(url), "tls://localhost:%d,tls://localhost:%d,"
             "tls://localhost:%d", port[0], port[1], port[2]);
    snprintf(ca, sizeof(ca), "%s", tp.ca_cert);
    snprintf(nk, sizeof(nk), "%s/keys/broker.nk", home);
    snprintf(sk, sizeof(sk), "%s/keys/broker.key", home);
    unsetenv("KSCORE_NATS_NKEY");
    unsetenv("KSCORE_NATS_URL");
    for (int i = 0; i < 2; i++) {
        char v[PATH_MAX + 256], state[PATH_MAX + 32], name[16];
        snprintf(path, sizeof(path), "%s/deploy/cluster/broker-%d.conf", src,
                 i + 1);
        char *t = slurp(path);
        t = subst(t, "tls://nats-1.example.net:4222,tls://nats-2.example.net:"
                     "4222,tls://nats-3.example.net:4222",
                  url);
        t = subst(t, "/etc/kscore/broker.nk", nk);
        t = subst(t, "/etc/kscore/ca.pem", ca);
        t = subst(t, "/etc/kscore/broker.key", sk);
        char *dl = strstr(t, "\ndb = ");
        ck_assert_ptr_nonnull(dl);
        dl[strcspn(dl + 1, "\n") + 1] = '\0'; /* cut the line ... */
        char *rest = strdup(dl + strlen(dl) + 1);
        snprintf(v, sizeof(v), "db = %s\n%s", db, rest);
        free(rest);
        dl[1] = '\0'; /* ... and write it again with this db */
        char *t2 = malloc(strlen(t) + strlen(v) + 1);
        strcpy(t2, t);
        strcat(t2, v);
        free(t);
        t = t2;
        ck_assert_msg(!host_value_left(t), "a host value left in "
                      "broker-%d.conf: %.80s", i + 1, host_value_left(t));
        snprintf(path, sizeof(path), "%s/broker-%d.conf", tmpdir, i + 1);
        spill(path, t);
        free(t);
        snprintf(state, sizeof(state), "%s/bstate-%d", tmpdir, i + 1);
        snprintf(name, sizeof(name), "dbroker-%d", i + 1);
        char *argv[] = {(char *)(bin ? bin : "kscore"), "broker", "--config",
                        path, "--state-dir", state, NULL};
        pid_t pid;
        ck_assert_int_eq(stack_daemon(home, name, argv, &pid), 0);
    }

    /* the agent of the stack over TLS, with its own credential */
    {
        char aseed[PATH_MAX + 64], trust[PATH_MAX + 64], state[PATH_MAX + 32];
        pid_t pid;
        snprintf(aseed, sizeof(aseed), "%s/keys/agent-%s.nk", home, agent);
        snprintf(trust, sizeof(trust), "%s/keys/broker.pub", home);
        snprintf(state, sizeof(state), "%s/dagent", tmpdir);
        char *argv[] = {(char *)(bin ? bin : "kscore"), "agent", "--id", agent,
                        "--nats", url, "--tls-ca", ca, "--trust-key", trust,
                        "--state-dir", state, "--config", "/dev/null", NULL};
        setenv("KSCORE_NATS_NKEY", aseed, 1);
        ck_assert_int_eq(stack_daemon(home, "dagent", argv, &pid), 0);
        unsetenv("KSCORE_NATS_NKEY");
    }

    /* one exec through them, as the operator */
    const char *ex[] = {"exec", "--nats", url, "--tls-ca", ca, "--nkey",
                        op_seed, "--agent", agent, "--", "echo", "deployed",
                        NULL};
    double t0 = now_s();
    int st = -1;
    do {
        ck_assert_int_eq(fixture_kscore_home(home, ex, &o), 0);
        st = o.status;
        if (st == 0)
            ck_assert_str_eq(o.out, "deployed\n");
        else if (now_s() - t0 > 60)
            ck_abort_msg("exec: exit %d: %s%s (logs in %s)", st, o.out, o.err,
                         home);
        fixture_out_release(&o);
        if (st != 0)
            usleep(500 * 1000);
    } while (st != 0);
    fprintf(stderr, "test_cluster: deploy files: exec ok %.1f s after the "
                    "brokers started\n", now_s() - t0);
    struct stack_stream_state ss[STACK_STREAMS];
    ck_assert_int_eq(stack_cluster_streams(nodes, 3, ss), 0);
    for (int k = 0; k < STACK_STREAMS; k++)
        ck_assert_int_eq(ss[k].replicas, 2); /* replicas = 3 */
    free(db);
    free(agent);
    free(op_seed);
}
END_TEST


/*
 * A route carries every message of every account, and a server trusts
 * what its peers send (any account, any subject, JetStream's API
 * included). On the code before, the local cluster's route ports (on
 * loopback, so open to every user of the host) asked nothing: a process
 * without any credential that spoke the route protocol there was sent
 * the stack's messages (found by the issue 21 review: it read a
 * message of account KSCORE). Now a node takes a route only with the
 * routes' password, in the owner's keys/ (route.secret, 0600).
 */
START_TEST(a_local_user_cannot_join_the_routes)
{
    up_cluster();
    struct stack_node nodes[3];
    ck_assert_int_eq(stack_cluster_nodes(home, 3, nodes), 0);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)nodes[0].route_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {0, 200 * 1000};
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    /* A route's CONNECT and INFO (nats-server's route protocol), then
     * interest in everything of account KSCORE. */
    static const char hello[] =
        "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":"
        "false,\"name\":\"intruder\",\"cluster\":\"kscore\","
        "\"headers\":true}\r\n"
        "INFO {\"server_id\":\"NINTRUDERXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
        "XXXXXXXXXXX\",\"name\":\"intruder\",\"cluster\":\"kscore\"}\r\n"
        "RS+ KSCORE >\r\nPING\r\n";
    ck_assert_int_eq(write(fd, hello, sizeof(hello) - 1),
                     (ssize_t)(sizeof(hello) - 1));
    /* A message of the stack's account, published on node 1. */
    struct evt_conn *c = broker_conn();
    char got[65536];
    size_t have = 0;
    for (int i = 0; i < 15; i++) {
        ck_assert_int_eq(natsConnection_PublishString(c->nc, "secret.probe",
                                                      "for the stack only"),
                         NATS_OK);
        natsConnection_Flush(c->nc);
        ssize_t r = read(fd, got + have, sizeof(got) - 1 - have);
        if (r == 0)
            break; /* the node hung up */
        if (r > 0)
            have += (size_t)r;
        if (have >= sizeof(got) - 1)
            break;
    }
    got[have] = '\0';
    close(fd);
    evt_close(c);
    ck_assert_msg(!strstr(got, "secret.probe"),
                  "a process without the routes' password read the "
                  "stack's message: %.300s",
                  got);
    ck_assert_msg(!strstr(got, "RS+"), "the node took the intruder as a "
                                       "route: %.200s", got);
    /* The password is the owner's alone; the stack still works. */
    char path[PATH_MAX + 64];
    struct stat st;
    snprintf(path, sizeof(path), "%s/keys/" STACK_ROUTE_SECRET, home);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 077, 0);
    check_status();
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
    tcase_add_test(tc, deploy_files_start_a_cluster);
    tcase_add_test(tc, agent_registers_once_the_registry_answers);
    tcase_add_test(tc, a_local_user_cannot_join_the_routes);
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
