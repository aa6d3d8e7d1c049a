/*
 * batch_exec_10000: one BatchExecuteCommand of /bin/true to 10,000 agent
 * ids on the cluster stack. A round is a whole deployment, as an operator
 * makes it: `kscore up --cluster 3` in a private KSCORE_HOME (three
 * nats-server nodes with routes, the streams and the registry on 3
 * replicas, two brokers, one PostgreSQL), then PERF_POOLS `kscore agent
 * --bundle` processes, each an agent pool enrolled with `kscore agent
 * enroll pNN --pool-size N` (one consumer and one registry entry for its
 * ids, and a credential that may serve those ids only), then the batch, then the record is checked (every
 * target has exactly one terminal event and at most one CommandStarted)
 * and `kscore down`.
 *
 * Reported: the batch's wall time (request to reply, the reply comes after
 * the last result is recorded), its success counts, the exactly-once
 * check, the peak RSS (VmHWM) of each nats-server node and each broker,
 * and the nats-server consumer count (/jsz). The floor is computed in
 * perf_main.c's targets from the same run's floors: N x spawn_p50 / cpus
 * + 4N events / pg_pipeline_rows_per_s.
 */
#include <dirent.h>
#include <errno.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "perf_int.h"
#include "stack.h"

/* At most 20 agent processes (the bound). */
#define PERF_POOLS 20
#define CLUSTER_NODES 3

/* Runs `kscore ARGS...` with KSCORE_HOME=home, output appended to
 * <home>.log; its exit status, or -1. */
static int
kscore_run(const char *bin, const char *home, const char *const *args)
{
    char log[PATH_MAX + 16];
    const char *argv[16];
    size_t n = 0;
    pid_t pid;
    int status;

    snprintf(log, sizeof(log), "%s.log", home);
    argv[n++] = bin;
    for (size_t i = 0; args[i] && n < 15; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        FILE *f = freopen(log, "a", stdout);
        if (f)
            dup2(fileno(stdout), 2);
        setenv("KSCORE_HOME", home, 1);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    if (waitpid(pid, &status, 0) != pid)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The pid in <dir>/<name>.pid when it runs, else 0. */
static pid_t
pid_of(const char *dir, const char *name)
{
    pid_t pid = 0;
    return stack_pidfile_alive(dir, name, &pid) == 1 ? pid : 0;
}

/* Ids of pool k: p<k>-0 .. p<k>-<per-1> (as `--pool-size` names them). */
static void
pool_name(char *buf, size_t len, unsigned k)
{
    snprintf(buf, len, "p%02u", k);
}

/* CPU time (us) of pid; -1 when gone. */
static int64_t
cpu_us_of(pid_t pid)
{
    struct perf_proc pp;
    return pid > 0 && perf__proc_sample(pid, &pp) == 0 ? pp.cpu_us : -1;
}

/* CPU seconds of each part of the stack, for the per-command cost model
 * of deploy/SCALING.md: nats (all nodes), postgres, brokers, agents. */
struct stack_cpu {
    int64_t nats, pg, brokers, agents;
};

static void
stack_cpu(const char *home, unsigned pools, struct stack_cpu *out)
{
    struct stack_node nodes[CLUSTER_NODES];
    memset(out, 0, sizeof(*out));
    if (stack_cluster_nodes(home, CLUSTER_NODES, nodes) == 0)
        for (unsigned i = 0; i < CLUSTER_NODES; i++)
            out->nats += cpu_us_of(nodes[i].pid);
    out->pg = perf__tree_cpu_us(pid_of(home, "pg"));
    out->brokers = cpu_us_of(pid_of(home, "broker-1")) +
                   cpu_us_of(pid_of(home, "broker-2"));
    for (unsigned k = 0; k < pools; k++) {
        char pool[16], name[32];
        pool_name(pool, sizeof(pool), k);
        snprintf(name, sizeof(name), "pool-%s", pool);
        /* The agent and its children (the watchdog; the commands' own
         * processes are reaped and counted in its cutime, not here). */
        out->agents += cpu_us_of(pid_of(home, name));
    }
}

/* Enrols pool k (`kscore agent enroll pNN --pool-size per`: its own
 * credential, which may serve its ids only) and starts `kscore agent
 * --bundle` for it, for each of the pools. */
static int
pools_start(const char *bin, const char *home, unsigned pools, unsigned per)
{
    int rc = 0;

    for (unsigned k = 0; rc == 0 && k < pools; k++) {
        char pool[16], name[32], size[16], state[PATH_MAX + 4200],
            bundle[PATH_MAX + 4200];
        pid_t pid;
        pool_name(pool, sizeof(pool), k);
        snprintf(name, sizeof(name), "pool-%s", pool);
        snprintf(size, sizeof(size), "%u", per);
        snprintf(state, sizeof(state), "%s/%s", home, name);
        snprintf(bundle, sizeof(bundle), "%s/%s.bundle", home, name);
        const char *enroll[] = {"agent", "enroll", pool, "--pool-size", size,
                                "--out", bundle, NULL};
        if (kscore_run(bin, home, enroll) != 0) {
            fprintf(stderr, "kscore perf: kscore agent enroll %s failed (see "
                            "%s.log)\n", pool, home);
            return KS_EINTERNAL;
        }
        char *argv[] = {(char *)bin,       "agent",        "--bundle",
                        bundle,            "--state-dir",  state,
                        "--max-concurrent", "64",          "--config",
                        "/dev/null",       "--log-level",  "warn",
                        NULL};
        rc = stack_daemon(home, name, argv, &pid);
    }
    return rc;
}

static void
pools_stop(const char *home, unsigned pools)
{
    for (unsigned k = 0; k < pools; k++) {
        char pool[16], name[32];
        pool_name(pool, sizeof(pool), k);
        snprintf(name, sizeof(name), "pool-%s", pool);
        stack_stop(home, name, 10000);
    }
}

/* Online ids of the pools, as the broker lists them. */
static long
online_count(struct evt_conn *c)
{
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    Ks__AgentsReply *rep = NULL;
    long n = 0;

    if (broker_call(c, EVT_API_AGENTS, &req.base,
                    &ks__agents_reply__descriptor, 10000,
                    (ProtobufCMessage **)&rep) != 0)
        return -1;
    for (size_t i = 0; i < rep->n_agents; i++) {
        const Ks__AgentStatus *a = rep->agents[i];
        if (a->online && a->info && a->info->pool && a->info->pool[0] == 'p')
            n++;
    }
    ks__agents_reply__free_unpacked(rep, NULL);
    return n;
}

/* The record's view of the batch: targets, targets without exactly one
 * terminal event, targets started more than once. */
static void
record_check(const char *db, const char *batch, long *targets, long *not_one,
             long *twice, long *events, long *events_bytes)
{
    static const char term[] = "('CommandCompleted','CommandStartFailed',"
                               "'CommandUndeliverable','CommandLost',"
                               "'CommandCancelled','CommandNotStarted')";
    char sql[1024];
    PGconn *pg = PQconnectdb(db);

    *targets = *not_one = *twice = *events = *events_bytes = -1;
    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: %s", PQerrorMessage(pg));
        PQfinish(pg);
        return;
    }
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets WHERE batch_id = '%s'", batch);
    *targets = perf__sql_long(pg, sql);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets t WHERE t.batch_id = '%s' "
             "AND (SELECT count(*) FROM events e WHERE e.stream_id = "
             "'command-' || t.command_id AND e.type IN %s) <> 1",
             batch, term);
    *not_one = perf__sql_long(pg, sql);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM batch_targets t WHERE t.batch_id = '%s' "
             "AND (SELECT count(*) FROM events e WHERE e.stream_id = "
             "'command-' || t.command_id AND e.type = 'CommandStarted') > 1",
             batch);
    *twice = perf__sql_long(pg, sql);
    /* What the record costs on disk, for deploy/SCALING.md: the events
     * table with its indexes and TOAST. */
    *events = perf__sql_long(pg, "SELECT count(*) FROM events");
    *events_bytes = perf__sql_long(pg, "SELECT pg_total_relation_size('events')");
    PQfinish(pg);
}

/* The reasons of the targets that did not succeed, as the reply has them
 * (the targets that fit in one message), with their counts: {"Undeliverable:
 * offline since ...": n, ...}; at most 8 distinct, the rest as "other". */
static json_t *
why_not_succeeded(const Ks__BatchReply *rep)
{
    json_t *o = json_object();
    for (size_t i = 0; i < rep->n_targets; i++) {
        const Ks__BatchTarget *t = rep->targets[i];
        if (t->status == KS__COMMAND_STATUS__SUCCEEDED)
            continue;
        char key[96];
        /* The reason's words, not its times and ids: they group. */
        const char *why = t->result && t->result->reason && t->result->reason[0]
                              ? t->result->reason
                              : "(no reason)";
        size_t n = strcspn(why, "0123456789(");
        snprintf(key, sizeof(key), "%s: %.*s", kproto_status_name(t->status),
                 (int)(n > 60 ? 60 : n), why);
        json_t *c = json_object_get(o, key);
        if (!c && json_object_size(o) >= 8) {
            snprintf(key, sizeof(key), "other");
            c = json_object_get(o, key);
        }
        json_object_set_new(o, key,
                            json_integer(c ? json_integer_value(c) + 1 : 1));
    }
    return o;
}

int
perf__batch10000_round(struct perf_ctx *ctx, int round, json_t **out)
{
    const char *bin = ctx->o->bin_a;
    unsigned n = ctx->o->quick ? 200 : 10000;
    unsigned pools = ctx->o->quick ? 2 : PERF_POOLS, per = n / pools;
    char home[PATH_MAX + 32], seed[PATH_MAX + 64], batch[64] = "";
    char *urls = NULL, *db = NULL, **ids = NULL;
    struct evt_conn *c = NULL;
    Ks__BatchReply *rep = NULL;
    int64_t t0, online_us = 0, dt = 0;
    long targets = -1, not_one = -1, twice = -1, online = 0, events = -1,
         events_bytes = -1;
    struct stack_cpu cpu0, cpu1;
    int rc;

    snprintf(home, sizeof(home), "%s/cluster-%d", ctx->st->dir, round);
    {
        const char *up[] = {"up", "--cluster", "3", NULL};
        int64_t u0 = ks_mono_us();
        if (kscore_run(bin, home, up) != 0) {
            fprintf(stderr, "kscore perf: kscore up --cluster 3 failed (see "
                            "%s.log)\n", home);
            rc = KS_EINTERNAL;
            goto down; /* what did start must not outlive the run */
        }
        fprintf(stderr, "  cluster up in %.1f s\n",
                (double)(ks_mono_us() - u0) / 1e6);
    }
    urls = stack_env_get(home, "KSCORE_NATS_URL");
    db = stack_env_get(home, "KSCORE_DB");
    if (!urls || !db) {
        fprintf(stderr, "kscore perf: no KSCORE_NATS_URL/KSCORE_DB in "
                        "%s/env\n", home);
        rc = KS_EINTERNAL;
        goto down;
    }
    t0 = ks_mono_us();
    if ((rc = pools_start(bin, home, pools, per)))
        goto down;
    snprintf(seed, sizeof(seed), "%s/keys/broker.nk", home);
    {
        struct evt_connect_opts co = {.name = "kscore-perf-cluster",
                                      .send_asap = true,
                                      .nkey_file = seed};
        char *err = NULL;
        if ((rc = evt_connect(urls, &co, &c, &err))) {
            fprintf(stderr, "kscore perf: %s\n", err ? err : ks_strerror(rc));
            free(err);
            goto down;
        }
    }
    /* Every id online (its pool's entry seen by the broker that answers;
     * both brokers watch the same registry). */
    while (!perf__interrupted && (online = online_count(c)) < (long)n &&
           ks_mono_us() - t0 < 180 * INT64_C(1000000))
        nanosleep(&(struct timespec){0, 250 * 1000000L}, NULL);
    online_us = ks_mono_us() - t0;
    fprintf(stderr, "  %ld of %u ids online in %.1f s (%u agent processes)\n",
            online, n, (double)online_us / 1e6, pools);
    if (online < (long)n) {
        rc = KS_ETIMEDOUT;
        goto down;
    }
    /* The pools' consumers exist before the batch (provisioned on the
     * first entry; on a cluster each is a raft group of its own). */
    nanosleep(&(struct timespec){1, 0}, NULL);

    ids = calloc(n, sizeof(*ids));
    for (unsigned i = 0; ids && i < n; i++) {
        char pool[16];
        pool_name(pool, sizeof(pool), i / per);
        if (asprintf(&ids[i], "%s-%u", pool, i % per) < 0)
            ids[i] = NULL;
    }
    {
        Ks__BatchRequest req = KS__BATCH_REQUEST__INIT;
        Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
        char *argv[] = {"/bin/true"};
        spec.argv = argv;
        spec.n_argv = 1;
        spec.timeout_ms = 60000;
        req.spec = &spec;
        req.agents = ids;
        req.n_agents = n;
        stack_cpu(home, pools, &cpu0);
        t0 = ks_mono_us();
        rc = broker_batch(c, &req, 900000, &rep);
        dt = ks_mono_us() - t0;
        stack_cpu(home, pools, &cpu1);
    }
    if (rc == 0 && rep->error_code) {
        fprintf(stderr, "kscore perf: batch refused: %s\n", rep->error);
        rc = KS_EINTERNAL;
    }
    if (rc) {
        fprintf(stderr, "kscore perf: batch of %u: %s\n", n, ks_strerror(rc));
        goto down;
    }
    snprintf(batch, sizeof(batch), "%s", rep->batch_id);
    record_check(db, batch, &targets, &not_one, &twice, &events,
                 &events_bytes);

    json_t *o = json_object();
    unsigned ok = rep->counts ? rep->counts->succeeded : 0;
    json_object_set_new(o, "wall_ms", json_real((double)dt / 1000.0));
    json_object_set_new(o, "targets", json_integer(n));
    json_object_set_new(o, "agent_processes", json_integer(pools));
    json_object_set_new(o, "succeeded", json_integer(ok));
    json_object_set_new(o, "not_succeeded", json_integer((long)n - ok));
    /* The targets' terminal states by kind (BatchCounts: each end once). */
    if (rep->counts) {
        const Ks__BatchCounts *k = rep->counts;
        json_object_set_new(o, "ended_failed", json_integer(k->failed));
        json_object_set_new(o, "ended_cancelled", json_integer(k->cancelled));
        json_object_set_new(o, "ended_timed_out", json_integer(k->timed_out));
        json_object_set_new(o, "ended_killed", json_integer(k->killed));
        json_object_set_new(o, "ended_no_response",
                            json_integer(k->no_response));
        json_object_set_new(o, "ended_lost", json_integer(k->lost));
        json_object_set_new(o, "ended_not_started",
                            json_integer(k->not_started));
        json_object_set_new(o, "not_ended",
                            json_integer(k->pending + k->running));
    }
    json_object_set_new(o, "why_not_succeeded", why_not_succeeded(rep));
    json_object_set_new(o, "online_s", json_real((double)online_us / 1e6));
    json_object_set_new(o, "recorded_targets", json_integer(targets));
    json_object_set_new(o, "not_exactly_one_terminal", json_integer(not_one));
    json_object_set_new(o, "started_twice", json_integer(twice));
    /* CPU seconds each part spent on the batch (request to reply). */
    json_object_set_new(o, "cpu_nats_s",
                        json_real((double)(cpu1.nats - cpu0.nats) / 1e6));
    json_object_set_new(o, "cpu_postgres_s",
                        json_real((double)(cpu1.pg - cpu0.pg) / 1e6));
    json_object_set_new(o, "cpu_brokers_s",
                        json_real((double)(cpu1.brokers - cpu0.brokers) / 1e6));
    json_object_set_new(o, "cpu_agents_s",
                        json_real((double)(cpu1.agents - cpu0.agents) / 1e6));
    json_object_set_new(o, "events_in_record", json_integer(events));
    json_object_set_new(o, "events_table_bytes", json_integer(events_bytes));
    json_object_set_new(o, "recorded_once",
                        json_boolean(targets == (long)n && not_one == 0 &&
                                     twice == 0));
    {
        struct stack_node nodes[CLUSTER_NODES];
        long max_node = 0, max_broker = 0;
        int consumers = -1;
        if (stack_cluster_nodes(home, CLUSTER_NODES, nodes) == 0)
            for (unsigned i = 0; i < CLUSTER_NODES; i++) {
                char key[32];
                long kb = nodes[i].pid > 0 ? stack_rss_peak_kb(nodes[i].pid) : -1;
                struct stack_js_info ji;
                snprintf(key, sizeof(key), "nats_%u_rss_peak_mb", i + 1);
                json_object_set_new(o, key, json_real((double)kb / 1024.0));
                if (kb > max_node)
                    max_node = kb;
                if (nodes[i].running &&
                    stack_nats_js_info(&nodes[i], &ji) == 0 &&
                    ji.consumers > consumers)
                    consumers = ji.consumers;
            }
        for (int i = 1; i <= 2; i++) {
            char name[16], key[32];
            snprintf(name, sizeof(name), "broker-%d", i);
            long kb = stack_rss_peak_kb(pid_of(home, name));
            snprintf(key, sizeof(key), "broker_%d_rss_peak_mb", i);
            json_object_set_new(o, key, json_real((double)kb / 1024.0));
            if (kb > max_broker)
                max_broker = kb;
        }
        json_object_set_new(o, "nats_rss_peak_mb_max",
                            json_real((double)max_node / 1024.0));
        json_object_set_new(o, "broker_rss_peak_mb_max",
                            json_real((double)max_broker / 1024.0));
        json_object_set_new(o, "nats_consumers", json_integer(consumers));
    }
    *out = o;
    if (ok != n)
        fprintf(stderr, "kscore perf: batch of %u: %u did not succeed\n", n,
                n - ok);
down:
    pools_stop(home, pools);
    {
        const char *down[] = {"down", NULL};
        kscore_run(bin, home, down);
    }
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    for (unsigned i = 0; ids && i < n; i++)
        free(ids[i]);
    free(ids);
    free(urls);
    free(db);
    return rc;
}
