/*
 * consumer_cost: what N agent ids cost nats-server (issue 14) with one
 * durable push consumer per id, as the broker makes them
 * (evt_agent_consumer + evt_consumer_ensure), against ONE consumer that
 * serves all N ids, shaped as an agent pool's consumer (evt_pool_consumer
 * on the integrator's branch: "pool-<pool>", filter kscore.cmd.<pool>.*),
 * the design that replaces it.
 *
 * Every step (a design, a node count and replicas, an N) runs on servers
 * of its own, started for it in the run's directory and stopped after, so
 * one step's consumers never weigh on the next, and a work-queue stream
 * (KSCORE_CMDS refuses overlapping filters) can hold either design:
 *
 *   1. nats-server (one node, R1; or three nodes with routes on loopback,
 *      R3: every stream and consumer a raft group), monitoring on
 *      loopback; evt_setup_replicas makes KSCORE_CMDS as the broker does
 *   2. base sample: VmRSS and utime+stime of every node (/proc)
 *   3. create: per-id, N x evt_consumer_ensure of evt_agent_consumer(id)
 *      (the broker's path: a consumer info that misses, then the create);
 *      one, a single consumer "pool-cc" (filter kscore.cmd.cc.*, deliver
 *      subject _KSCORE.deliver.pool-cc, group pool-cc, max_ack_pending
 *      the process's max_concurrent, ack wait and max deliver as an
 *      agent's), built here by hand so that this file builds with and
 *      without evt_pool_consumer
 *   4. a subscriber connection (nats.c's shared delivery pool) takes a
 *      queue subscription per consumer, as agents do
 *   5. idle --idle seconds (30): CPU and RSS of every node over it
 *   6. the server's own view: /jsz (consumers, memory, store, API calls)
 *      and /varz (mem, subscriptions) of every node
 *   7. publish N small messages, one per id (kscore.cmd.<id>, or
 *      kscore.cmd.cc.<id> to the pool), async with
 *      a Nats-Msg-Id each; deliver_ms is from before the first publish to
 *      the N-th delivery in the subscriber (each acked "+ACK" as an agent)
 *
 * The counts come from the environment, so the option set of `kscore perf`
 * stays as it is: KSCORE_PERF_CC_R1 (default "100,1000,10000"),
 * KSCORE_PERF_CC_R3 ("100,500,1000"; "" skips the cluster),
 * KSCORE_PERF_CC_IDLE_S (30). A list stops after a step whose creation
 * took more than KSCORE_PERF_CC_STOP_S (120 s); the R3 per-id cost is
 * then extrapolated to 10,000 ids linearly from the two largest steps.
 */
#include <errno.h>
#include <ftw.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"
#include "perf_int.h"
#include "stack.h"

#define CC_MAX_NODES 3
#define CC_MAX_STEPS 8
#define CC_ID_PREFIX "cc-"
#define CC_POOL_NAME "cc"
#define CC_POOL "pool-" CC_POOL_NAME
#define CC_EXTRAPOLATE_N 10000
/* A step's creation is cut off here (reported as partial): a guard, not
 * a measurement. */
#define CC_CREATE_CAP_S 600
#define CC_DELIVER_WAIT_S 180

struct cc_node {
    char dir[PATH_MAX];
    pid_t pid;
    int port, route_port, mon_port;
};

struct cc_servers {
    unsigned n;
    struct cc_node node[CC_MAX_NODES];
    char *urls; /* malloc'd, comma-separated */
};



/* A free port none of taken[0..n) has. */
static int
fresh_port(const int *taken, size_t n)
{
    for (int tries = 0; tries < 50; tries++) {
        int p = stack_free_port();
        bool dup = false;
        if (p <= 0)
            return p;
        for (size_t i = 0; i < n; i++)
            dup = dup || taken[i] == p;
        if (!dup)
            return p;
    }
    return KS_EUNAVAIL;
}

static void
servers_stop(struct cc_servers *s)
{
    for (unsigned i = 0; i < s->n; i++) {
        if (!s->node[i].dir[0])
            continue;
        stack_nats_stop(s->node[i].dir);
        perf__rm_tree(s->node[i].dir);
        s->node[i].dir[0] = '\0';
    }
    free(s->urls);
    s->urls = NULL;
}

/* n nodes (1: a plain server; 3: a cluster) in <run dir>/cc-<label>-<i>. */
static int
servers_start(struct perf_ctx *ctx, const char *label, unsigned n,
              struct cc_servers *s)
{
    int taken[3 * CC_MAX_NODES];
    size_t nt = 0, ul = 0;
    int rc = 0;

    memset(s, 0, sizeof(*s));
    s->n = n;
    for (unsigned i = 0; i < n; i++) {
        struct cc_node *nd = &s->node[i];
        if (snprintf(nd->dir, sizeof(nd->dir), "%.3900s/cc-%s-%u",
                     ctx->st->dir, label, i + 1) >= (int)sizeof(nd->dir))
            return KS_EINVAL;
        if ((nd->port = fresh_port(taken, nt)) <= 0)
            return KS_EUNAVAIL;
        taken[nt++] = nd->port;
        if ((nd->route_port = fresh_port(taken, nt)) <= 0)
            return KS_EUNAVAIL;
        taken[nt++] = nd->route_port;
        if ((nd->mon_port = fresh_port(taken, nt)) <= 0)
            return KS_EUNAVAIL;
        taken[nt++] = nd->mon_port;
    }
    if (!(s->urls = calloc(n, 40)))
        return -ENOMEM;
    for (unsigned i = 0; i < n && rc == 0; i++) {
        struct cc_node *nd = &s->node[i];
        char extra[1024], routes[256] = "", name[64], *url = NULL;
        size_t rl = 0;
        for (unsigned j = 0; j < n; j++)
            if (j != i)
                rl += (size_t)snprintf(routes + rl, sizeof(routes) - rl,
                                       "%s\"nats-route://127.0.0.1:%d\"",
                                       rl ? ", " : "", s->node[j].route_port);
        if (n > 1)
            snprintf(extra, sizeof(extra),
                     "http: \"127.0.0.1:%d\"\ncluster {\n  name: kscore-cc\n"
                     "  listen: \"127.0.0.1:%d\"\n  routes: [%s]\n}\n",
                     nd->mon_port, nd->route_port, routes);
        else
            snprintf(extra, sizeof(extra), "http: \"127.0.0.1:%d\"\n",
                     nd->mon_port);
        snprintf(name, sizeof(name), "cc-%s-%u", label, i + 1);
        perf__rm_tree(nd->dir);
        rc = stack_nats_start_named(nd->dir, "127.0.0.1", nd->port, name,
                                    NULL, extra, &url, &nd->pid);
        if (rc == 0)
            ul += (size_t)snprintf(s->urls + ul, (size_t)n * 40 - ul, "%s%s",
                                   ul ? "," : "", url);
        else
            fprintf(stderr, "kscore perf: consumer_cost: nats-server: %s "
                            "(see %s/nats.log)\n",
                    ks_strerror(rc), nd->dir);
        free(url);
    }
    if (rc == 0 && n > 1) {
        struct stack_node sn[CC_MAX_NODES];
        memset(sn, 0, sizeof(sn));
        for (unsigned i = 0; i < n; i++) {
            sn[i].mon_port = s->node[i].mon_port;
            sn[i].running = true;
        }
        rc = stack_cluster_wait_leader(sn, n, 60000, NULL, 0);
        if (rc)
            fprintf(stderr, "kscore perf: consumer_cost: no meta leader\n");
    }
    return rc;
}

struct cc_sample {
    int64_t cpu_us[CC_MAX_NODES];
    int64_t rss_kb[CC_MAX_NODES];
};

static void
sample(const struct cc_servers *s, struct cc_sample *out)
{
    memset(out, 0, sizeof(*out));
    for (unsigned i = 0; i < s->n; i++) {
        struct perf_proc p = {.cpu_us = 0, .rss_kb = -1};
        perf__proc_sample(s->node[i].pid, &p);
        out->cpu_us[i] = p.cpu_us;
        out->rss_kb[i] = p.rss_kb;
    }
}

/* Per node: the RSS of b, and the CPU seconds between a and b; and their
 * sums over the nodes. */
static void
put_sample(json_t *o, const char *what, const struct cc_servers *s,
           const struct cc_sample *a, const struct cc_sample *b)
{
    json_t *rss = json_array(), *cpu = json_array();
    int64_t rsum = 0, csum = 0;
    char key[64];
    for (unsigned i = 0; i < s->n; i++) {
        json_array_append_new(rss, json_integer(b->rss_kb[i]));
        rsum += b->rss_kb[i];
        if (a) {
            json_array_append_new(
                cpu, json_real((double)(b->cpu_us[i] - a->cpu_us[i]) / 1e6));
            csum += b->cpu_us[i] - a->cpu_us[i];
        }
    }
    snprintf(key, sizeof(key), "rss_%s_kb", what);
    json_object_set_new(o, key, json_integer(rsum));
    snprintf(key, sizeof(key), "rss_%s_kb_nodes", what);
    json_object_set_new(o, key, rss);
    if (a) {
        snprintf(key, sizeof(key), "cpu_%s_s", what);
        json_object_set_new(o, key, json_real((double)csum / 1e6));
        snprintf(key, sizeof(key), "cpu_%s_s_nodes", what);
        json_object_set_new(o, key, cpu);
    } else {
        json_decref(cpu);
    }
}

/* /jsz and /varz of every node: what the server says it holds. */
static json_t *
server_view(const struct cc_servers *s)
{
    json_t *arr = json_array();
    for (unsigned i = 0; i < s->n; i++) {
        json_t *o = json_object(), *j;
        char *body = NULL;
        if (stack_http_get(s->node[i].mon_port, "/jsz", 10000, &body) == 0 &&
            (j = json_loads(body, 0, NULL))) {
            json_t *api = json_object_get(j, "api");
            json_object_set(o, "consumers", json_object_get(j, "consumers"));
            json_object_set(o, "streams", json_object_get(j, "streams"));
            json_object_set(o, "js_memory", json_object_get(j, "memory"));
            json_object_set(o, "js_store", json_object_get(j, "storage"));
            json_object_set(o, "api_total", json_object_get(api, "total"));
            json_object_set(o, "api_errors", json_object_get(api, "errors"));
            json_decref(j);
        }
        free(body);
        body = NULL;
        if (stack_http_get(s->node[i].mon_port, "/varz", 10000, &body) == 0 &&
            (j = json_loads(body, 0, NULL))) {
            json_object_set(o, "mem", json_object_get(j, "mem"));
            json_object_set(o, "cpu_pct", json_object_get(j, "cpu"));
            json_object_set(o, "subscriptions",
                            json_object_get(j, "subscriptions"));
            json_object_set(o, "version", json_object_get(j, "version"));
            json_decref(j);
        }
        free(body);
        json_array_append_new(arr, o);
    }
    return arr;
}

/* The subscriber: counts deliveries, acks each as an agent does. */
struct cc_sub {
    atomic_long delivered;
    long want;
    _Atomic int64_t done_us; /* ks_mono_us of the want-th delivery */
};

static void
on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct cc_sub *cs = ud;
    const char *reply = natsMsg_GetReply(msg);
    (void)sub;
    if (reply)
        natsConnection_Publish(nc, reply, "+ACK", 4);
    /* No redelivery within the wait: each is acked at once, ack wait
     * is 30 s. */
    long n = atomic_fetch_add(&cs->delivered, 1) + 1;
    if (n == cs->want)
        atomic_store(&cs->done_us, ks_mono_us());
    natsMsg_Destroy(msg);
}

static void
cc_id(char *buf, size_t len, int i)
{
    snprintf(buf, len, CC_ID_PREFIX "%05d", i);
}

/* One step: a design (pool: one consumer for all) on nodes x replicas
 * with n ids. Appends its object to steps. *create_s: its creation. */
static int
step(struct perf_ctx *ctx, unsigned nodes, int n, bool pool, int idle_s,
     json_t *steps, double *create_s)
{
    struct cc_servers srv = {0};
    struct evt_connect_opts co = {.name = "kscore-perf-cc"};
    struct evt_connect_opts so = {.name = "kscore-perf-cc-sub",
                                  .global_delivery = true};
    struct evt_conn *c = NULL, *sc = NULL;
    natsSubscription **subs = NULL;
    jsCtx *js = NULL;
    struct cc_sample s0, s1, s2, s3, s4;
    struct cc_sub cs = {0};
    int64_t *lat = NULL, t0, t1;
    json_t *o = json_object();
    char label[48], *err = NULL;
    int made = 0, errors = 0, nsubs = pool ? 1 : n, rc;
    unsigned maxc = agent_default_max_concurrent();
    double la0 = perf__loadavg();

    *create_s = 0;
    snprintf(label, sizeof(label), "%s-r%u-%d", pool ? "one" : "per-id", nodes,
             n);
    fprintf(stderr, "  consumer_cost: %u node%s R%u, %s, N=%d (load %.2f)\n",
            nodes, nodes > 1 ? "s" : "", nodes, pool ? "one consumer" : "per id",
            n, la0);
    json_object_set_new(o, "nodes", json_integer(nodes));
    json_object_set_new(o, "replicas", json_integer(nodes));
    json_object_set_new(o, "design", json_string(pool ? "one" : "per-id"));
    json_object_set_new(o, "n", json_integer(n));
    json_object_set_new(o, "load_start", json_real(la0));
    json_array_append_new(steps, o);

    if (!(lat = calloc((size_t)(n > 0 ? n : 1), sizeof(*lat))) ||
        !(subs = calloc((size_t)nsubs, sizeof(*subs)))) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = servers_start(ctx, label, nodes, &srv)))
        goto out;
    if ((rc = evt_connect(srv.urls, &co, &c, &err)) ||
        (rc = evt_setup_replicas(c, (int)nodes, &err))) {
        fprintf(stderr, "kscore perf: consumer_cost: %s\n",
                err ? err : ks_strerror(rc));
        goto out;
    }
    perf__sleep_ms(1000); /* the streams' groups settle */
    sample(&srv, &s0);
    put_sample(o, "base", &srv, NULL, &s0);

    /* create */
    t0 = ks_mono_us();
    for (int i = 0; i < (pool ? 1 : n) && !perf__interrupted; i++) {
        struct evt_agent_consumer ac;
        struct evt_durable pd = {
            .stream = EVT_STREAM_CMDS,
            .durable = CC_POOL,
            .filter_subject = "kscore.cmd." CC_POOL_NAME ".*",
            .deliver_group = CC_POOL,
            .max_ack_pending = maxc,
            .ack_wait_ms = (int64_t)evt_agent_ack_wait_ms(0),
            .max_deliver = EVT_AGENT_MAX_DELIVER};
        char id[32];
        enum evt_consumer_change chg;
        cc_id(id, sizeof(id), i);
        evt_agent_consumer(&ac, id, maxc, 0);
        int64_t a = ks_mono_us();
        free(err);
        err = NULL;
        int r = evt_consumer_ensure(c, pool ? &pd : &ac.d, &chg, &err);
        lat[made] = ks_mono_us() - a;
        if (r == 0) {
            made++;
        } else if (++errors <= 3) {
            fprintf(stderr, "kscore perf: consumer_cost: %s\n",
                    err ? err : ks_strerror(r));
        }
        if (errors > 20 || ks_mono_us() - t0 > (int64_t)CC_CREATE_CAP_S * 1000000)
            break;
    }
    t1 = ks_mono_us();
    sample(&srv, &s1);
    *create_s = (double)(t1 - t0) / 1e6;
    json_object_set_new(o, "consumers_made", json_integer(made));
    json_object_set_new(o, "create_errors", json_integer(errors));
    json_object_set_new(o, "create_s", json_real(*create_s));
    if (made) {
        perf__sort(lat, (size_t)made);
        json_object_set_new(o, "create_p50_ms",
                            json_real((double)perf__pct(lat, (size_t)made, 50) /
                                      1000.0));
        json_object_set_new(o, "create_p99_ms",
                            json_real((double)perf__pct(lat, (size_t)made, 99) /
                                      1000.0));
        json_object_set_new(o, "create_max_ms",
                            json_real((double)lat[made - 1] / 1000.0));
    }
    put_sample(o, "created", &srv, &s0, &s1);
    json_object_set_new(o, "load_created", json_real(perf__loadavg()));
    if (made < (pool ? 1 : n)) {
        json_object_set_new(o, "partial", json_true());
        rc = 0;
        goto out; /* no idle or delivery of a half-made set */
    }

    /* subscribe, as the agents would be */
    if ((rc = evt_connect(srv.urls, &so, &sc, &err))) {
        fprintf(stderr, "kscore perf: consumer_cost: %s\n",
                err ? err : ks_strerror(rc));
        goto out;
    }
    cs.want = n;
    for (int i = 0; i < nsubs && rc == 0; i++) {
        char id[32], durable[64], deliver[128];
        cc_id(id, sizeof(id), i);
        if (pool)
            snprintf(durable, sizeof(durable), "%s", CC_POOL);
        else
            evt_agent_durable(durable, sizeof(durable), id);
        evt_deliver_subject(deliver, sizeof(deliver), durable);
        rc = evt_err(natsConnection_QueueSubscribe(&subs[i], sc->nc, deliver,
                                                   durable, on_msg, &cs));
        if (rc == 0)
            rc = evt_err(natsSubscription_SetPendingLimits(subs[i], -1, -1));
    }
    if (rc == 0)
        rc = evt_err(natsConnection_FlushTimeout(sc->nc, 30000));
    if (rc)
        goto out;

    /* idle */
    sample(&srv, &s2);
    perf__sleep_ms(idle_s * 1000);
    sample(&srv, &s3);
    json_object_set_new(o, "idle_s", json_integer(idle_s));
    put_sample(o, "idle", &srv, &s2, &s3);
    json_object_set_new(o, "load_idle", json_real(perf__loadavg()));
    json_object_set_new(o, "server", server_view(&srv));

    /* publish one message per id, until all are delivered */
    {
        jsOptions jo;
        jsPubOptions po;
        uint8_t body[64];
        char subj[64], id[32], mid[96];
        int64_t deadline;
        memset(body, 'c', sizeof(body));
        jsOptions_Init(&jo);
        jo.PublishAsync.StallWait = 60000;
        if ((rc = evt_err(natsConnection_JetStream(&js, c->nc, &jo))))
            goto out;
        t0 = ks_mono_us();
        for (int i = 0; i < n && rc == 0; i++) {
            cc_id(id, sizeof(id), i);
            /* evt_cmd_subject's subjects, spelled out: its signature
             * differs between branches (pools) */
            if (pool)
                snprintf(subj, sizeof(subj), "kscore.cmd." CC_POOL_NAME ".%s",
                         id);
            else
                snprintf(subj, sizeof(subj), "kscore.cmd.%s", id);
            snprintf(mid, sizeof(mid), "%s.%d", label, i);
            jsPubOptions_Init(&po);
            po.MsgId = mid;
            rc = evt_err(js_PublishAsync(js, subj, body, (int)sizeof(body),
                                         &po));
        }
        jsPubOptions_Init(&po);
        po.MaxWait = 120000;
        if (rc == 0)
            rc = evt_err(js_PublishAsyncComplete(js, &po));
        t1 = ks_mono_us();
        if (rc) {
            fprintf(stderr, "kscore perf: consumer_cost: publish: %s\n",
                    ks_strerror(rc));
            goto out;
        }
        deadline = t0 + (int64_t)CC_DELIVER_WAIT_S * 1000000;
        while (atomic_load(&cs.delivered) < n && ks_mono_us() < deadline &&
               !perf__interrupted)
            perf__sleep_ms(2);
        sample(&srv, &s4);
        json_object_set_new(o, "publish_ms", json_real((double)(t1 - t0) / 1e3));
        json_object_set_new(o, "delivered",
                            json_integer(atomic_load(&cs.delivered)));
        if (atomic_load(&cs.delivered) >= n)
            json_object_set_new(
                o, "deliver_ms",
                json_real((double)(atomic_load(&cs.done_us) - t0) / 1e3));
        put_sample(o, "deliver", &srv, &s3, &s4);
        json_object_set_new(o, "load_end", json_real(perf__loadavg()));
    }
out:
    if (rc)
        json_object_set_new(o, "error", json_string(err ? err : ks_strerror(rc)));
    for (int i = 0; subs && i < nsubs; i++)
        natsSubscription_Destroy(subs[i]);
    jsCtx_Destroy(js);
    evt_close(sc);
    evt_close(c);
    servers_stop(&srv);
    free(subs);
    free(lat);
    free(err);
    return rc;
}

/* A comma-separated list of counts from env var (or dflt). */
static size_t
counts(const char *var, const char *dflt, int *out)
{
    const char *v = getenv(var);
    size_t k = 0;
    if (!v)
        v = dflt;
    while (*v && k < CC_MAX_STEPS) {
        char *end = NULL;
        long x = strtol(v, &end, 10);
        if (end == v)
            break;
        if (x > 0 && x <= 1000000)
            out[k++] = (int)x;
        v = *end == ',' ? end + 1 : end;
    }
    return k;
}

static double
num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : 0;
}

/* The per-id steps of nodes: per-consumer slopes between the two largest
 * complete steps, and the cost of CC_EXTRAPOLATE_N ids from them. */
static void
extrapolate(json_t *res, json_t *steps, unsigned nodes, const char *prefix)
{
    json_t *a = NULL, *b = NULL, *s, *x;
    size_t i;
    char key[96];
    json_array_foreach(steps, i, s)
    {
        if ((unsigned)num(s, "nodes") != nodes ||
            strcmp(json_string_value(json_object_get(s, "design")), "per-id") ||
            json_object_get(s, "partial") || json_object_get(s, "error"))
            continue;
        a = b;
        b = s;
    }
    if (!b)
        return;
    double nb = num(b, "n"), na = a ? num(a, "n") : 0;
    double rss_b = num(b, "rss_idle_kb");
    double rss_a = a ? num(a, "rss_idle_kb") : num(b, "rss_base_kb");
    double idle_b = num(b, "cpu_idle_s"), idle_a = a ? num(a, "cpu_idle_s") : 0;
    double per_rss = (rss_b - rss_a) / (nb - na);
    double per_create = num(b, "create_s") / nb;
    double per_idle = (idle_b - idle_a) / (nb - na);
    x = json_object();
    json_object_set_new(x, "from_n", json_pack("[f,f]", na, nb));
    json_object_set_new(x, "rss_kb_per_consumer", json_real(per_rss));
    json_object_set_new(x, "create_ms_per_consumer", json_real(per_create * 1e3));
    json_object_set_new(x, "idle_cpu_s_per_consumer", json_real(per_idle));
    json_object_set_new(x, "n", json_integer(CC_EXTRAPOLATE_N));
    json_object_set_new(x, "rss_idle_kb",
                        json_real(rss_b + per_rss * (CC_EXTRAPOLATE_N - nb)));
    json_object_set_new(x, "create_s", json_real(per_create * CC_EXTRAPOLATE_N));
    json_object_set_new(x, "cpu_idle_s",
                        json_real(idle_b + per_idle * (CC_EXTRAPOLATE_N - nb)));
    snprintf(key, sizeof(key), "%s_extrapolated", prefix);
    json_object_set_new(res, key, x);
    /* headline numbers (the summary keeps numeric keys only) */
    snprintf(key, sizeof(key), "%s_rss_kb_per_consumer", prefix);
    json_object_set_new(res, key, json_real(per_rss));
    snprintf(key, sizeof(key), "%s_create_ms_per_consumer", prefix);
    json_object_set_new(res, key, json_real(per_create * 1e3));
    snprintf(key, sizeof(key), "%s_max_n", prefix);
    json_object_set_new(res, key, json_integer((json_int_t)nb));
}

int
perf__consumers_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int r1[CC_MAX_STEPS], r3[CC_MAX_STEPS], idle_s = 30, rc = 0;
    double stop_s = 120;
    const char *e;
    size_t n1, n3;
    json_t *res = json_object(), *steps = json_array();
    bool quick = ctx->o->quick;

    (void)round;
    n1 = counts("KSCORE_PERF_CC_R1", quick ? "5,20" : "100,1000,10000", r1);
    n3 = counts("KSCORE_PERF_CC_R3", quick ? "5" : "100,500,1000", r3);
    if ((e = getenv("KSCORE_PERF_CC_IDLE_S")) && *e)
        idle_s = atoi(e) >= 0 ? atoi(e) : 0;
    else if (quick)
        idle_s = 1;
    if ((e = getenv("KSCORE_PERF_CC_STOP_S")) && *e)
        stop_s = atof(e);
    json_object_set_new(res, "steps", steps);
    json_object_set_new(res, "load_start", json_real(perf__loadavg()));
    json_object_set_new(res, "max_concurrent",
                        json_integer(agent_default_max_concurrent()));

    e = getenv("KSCORE_PERF_CC_DESIGNS");
    bool want_per_id = !e || !*e || strstr(e, "per-id");
    bool want_one = !e || !*e || strstr(e, "one");
    for (unsigned pass = 0; pass < 2 && rc == 0; pass++) {
        unsigned nodes = pass ? 3 : 1;
        const int *ns = pass ? r3 : r1;
        size_t k = pass ? n3 : n1;
        for (size_t i = 0; i < k && rc == 0 && !perf__interrupted; i++) {
            double cs = 0, cs_pool = 0;
            if (want_per_id)
                rc = step(ctx, nodes, ns[i], false, idle_s, steps, &cs);
            if (want_one && rc == 0 && !perf__interrupted)
                rc = step(ctx, nodes, ns[i], true, idle_s, steps, &cs_pool);
            if (rc == 0 && cs > stop_s && i + 1 < k) {
                fprintf(stderr,
                        "  consumer_cost: creating %d took %.0f s > %.0f s: "
                        "no larger step on %u node%s\n",
                        ns[i], cs, stop_s, nodes, nodes > 1 ? "s" : "");
                json_object_set_new(res, pass ? "r3_stopped_after"
                                              : "r1_stopped_after",
                                    json_integer(ns[i]));
                break;
            }
        }
    }
    if (rc == 0 && perf__interrupted)
        rc = -EINTR;
    extrapolate(res, steps, 1, "r1");
    extrapolate(res, steps, 3, "r3");
    json_object_set_new(res, "load_end", json_real(perf__loadavg()));
    if (rc) {
        json_decref(res);
        return rc;
    }
    *out = res;
    return 0;
}

static void
mb(FILE *f, json_t *s, const char *key)
{
    json_t *v = json_object_get(s, key);
    if (json_is_number(v))
        fprintf(f, " %8.1f", json_number_value(v) / 1024.0);
    else
        fprintf(f, " %8s", "-");
}

static void
val(FILE *f, json_t *s, const char *key, int width, int prec)
{
    json_t *v = json_object_get(s, key);
    if (json_is_number(v))
        fprintf(f, " %*.*f", width, prec, json_number_value(v));
    else
        fprintf(f, " %*s", width, "-");
}

void
perf__consumers_table(FILE *f, json_t *round)
{
    json_t *steps = json_object_get(round, "steps"), *s;
    size_t i;
    if (!steps)
        return;
    fprintf(f, "  steps of round 1: rss_* MiB summed over the nodes (rss_max1: "
               "the largest node after idle), cpu_mk / cpu_idl: CPU s summed "
               "over the nodes while creating / over the idle time, jsz_c: "
               "consumers on the largest node (/jsz), publish / deliver: ms "
               "for N messages, load: 1-min average at the step's start\n");
    fprintf(f, "  %-5s %-6s %6s %8s %8s %8s %8s %8s %8s %8s %7s %7s %7s %9s "
               "%9s %5s\n",
            "nodes", "design", "N", "create_s", "p50_ms", "p99_ms", "rss_base",
            "rss_made", "rss_idle", "rss_max1", "cpu_mk", "cpu_idl", "jsz_c",
            "publish", "deliver", "load");
    json_array_foreach(steps, i, s)
    {
        json_t *nodes = json_object_get(s, "rss_idle_kb_nodes"), *x;
        json_t *view = json_object_get(s, "server");
        double maxn = -1;
        long long jc = 0;
        size_t k;
        json_array_foreach(nodes, k, x)
            if (json_number_value(x) > maxn)
                maxn = json_number_value(x);
        /* a replicated consumer is counted on every node that holds one of
         * its replicas: the largest node's count */
        json_array_foreach(view, k, x)
            if (json_integer_value(json_object_get(x, "consumers")) > jc)
                jc = json_integer_value(json_object_get(x, "consumers"));
        fprintf(f, "  %-5lld %-6s %6lld",
                (long long)json_integer_value(json_object_get(s, "nodes")),
                json_string_value(json_object_get(s, "design")),
                (long long)json_integer_value(json_object_get(s, "n")));
        val(f, s, "create_s", 8, 2);
        val(f, s, "create_p50_ms", 8, 2);
        val(f, s, "create_p99_ms", 8, 2);
        mb(f, s, "rss_base_kb");
        mb(f, s, "rss_created_kb");
        mb(f, s, "rss_idle_kb");
        if (maxn >= 0)
            fprintf(f, " %8.1f", maxn / 1024.0);
        else
            fprintf(f, " %8s", "-");
        val(f, s, "cpu_created_s", 7, 2);
        val(f, s, "cpu_idle_s", 7, 2);
        if (view)
            fprintf(f, " %7lld", jc);
        else
            fprintf(f, " %7s", "-");
        val(f, s, "publish_ms", 9, 1);
        val(f, s, "deliver_ms", 9, 1);
        val(f, s, "load_start", 5, 2);
        if (json_object_get(s, "partial"))
            fputs("  PARTIAL", f);
        if (json_object_get(s, "error"))
            fprintf(f, "  error: %s",
                    json_string_value(json_object_get(s, "error")));
        fputc('\n', f);
    }
    for (int p = 0; p < 2; p++) {
        json_t *x = json_object_get(round, p ? "r3_extrapolated"
                                             : "r1_extrapolated");
        if (!x)
            continue;
        fprintf(f,
                "  per-id R%d, slope from N=%.0f..%.0f: %.1f KiB RSS, %.2f ms "
                "to create, %.5f CPU s per %d s idle, per consumer; "
                "%d ids: RSS %.0f MiB, create %.0f s, idle CPU %.1f s per "
                "%d s\n",
                p ? 3 : 1,
                json_number_value(json_array_get(json_object_get(x, "from_n"), 0)),
                json_number_value(json_array_get(json_object_get(x, "from_n"), 1)),
                num(x, "rss_kb_per_consumer"), num(x, "create_ms_per_consumer"),
                num(x, "idle_cpu_s_per_consumer"),
                (int)num(json_array_get(steps, 0), "idle_s"),
                CC_EXTRAPOLATE_N, num(x, "rss_idle_kb") / 1024.0,
                num(x, "create_s"), num(x, "cpu_idle_s"),
                (int)num(json_array_get(steps, 0), "idle_s"));
    }
}
