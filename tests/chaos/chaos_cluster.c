/*
 * chaos_cluster: the cluster stack of `kscore up --cluster 3` (three
 * nats-server nodes, replicas 3, two brokers) for the cluster scenarios.
 * The stack is the real command's, in a private KSCORE_HOME; the suite's
 * clients use its operator, the fleet process the broker's credential
 * (one NATS identity may serve many agent ids only with that one).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chaos.h"
#include "stack.h"

static int
kscore_up(struct chaos_run *r)
{
    const char *args[] = {"up", "--cluster", "3", NULL};
    struct fixture_out o;
    int64_t t0 = ks_mono_us();
    int rc = fixture_kscore_home(r->st.dir, args, &o);
    if (rc == 0 && o.status != 0) {
        fprintf(stderr, "chaos: kscore up --cluster 3: exit %d: %s\n",
                o.status, o.err);
        rc = o.status;
    }
    if (rc == 0)
        chaos_log(r, "kscore up --cluster 3: %.1f s", chaos_since_s(t0));
    fixture_out_release(&o);
    return rc;
}

int
chaos_cluster_up(struct chaos_run *r, char (*ids)[16], unsigned n)
{
    const char *t = getenv("TMPDIR");
    struct fixture_stack *s = &r->st;
    char *url, *db, *nkey;
    int rc;

    snprintf(s->dir, sizeof(s->dir), "%s/chaos-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(s->dir))
        return -errno;
    r->cluster = true;
    r->stack_up = true;
    setenv("KSCORE_PG_FAST", "1", 0);
    if ((rc = kscore_up(r)))
        return rc < 0 ? rc : KS_EUNAVAIL;
    url = stack_env_get(s->dir, "KSCORE_NATS_URL");
    db = stack_env_get(s->dir, "KSCORE_DB");
    nkey = stack_env_get(s->dir, "KSCORE_NATS_NKEY");
    if (!url || !db || !nkey) {
        free(url);
        free(db);
        free(nkey);
        return KS_EUNAVAIL;
    }
    s->nats.url = url;
    s->pg.conninfo = db;
    s->secure = true;
    snprintf(s->operator_seed, sizeof(s->operator_seed), "%s", nkey);
    free(nkey);
    snprintf(s->broker_seed, sizeof(s->broker_seed), "%s/keys/broker.nk",
             s->dir);
    snprintf(s->trust_key, sizeof(s->trust_key), "%s/keys/broker.pub",
             s->dir);
    snprintf(r->side, sizeof(r->side), "%.4000s/side", s->dir);
    if (mkdir(r->side, 0777) == -1 && errno != EEXIST)
        return -errno;
    chmod(r->side, 0777);

    /* the fleet: one process, every id */
    const char *bin = getenv("KSCORE_BIN");
    char state[PATH_MAX + 32], nmax[16];
    char **argv = calloc(2 * (size_t)n + 16, sizeof(*argv));
    size_t k = 0;
    pid_t pid;
    if (!argv)
        return -ENOMEM;
    snprintf(state, sizeof(state), "%s/state-fleet", s->dir);
    snprintf(nmax, sizeof(nmax), "%d", 64);
    argv[k++] = (char *)(bin && bin[0] ? bin : KSCORE_BIN_DEFAULT);
    argv[k++] = "agent";
    for (unsigned i = 0; i < n; i++) {
        argv[k++] = "--id";
        argv[k++] = ids[i];
    }
    argv[k++] = "--nats";
    argv[k++] = s->nats.url;
    argv[k++] = "--trust-key";
    argv[k++] = s->trust_key;
    argv[k++] = "--state-dir";
    argv[k++] = state;
    argv[k++] = "--max-concurrent";
    argv[k++] = nmax;
    argv[k++] = "--config";
    argv[k++] = "/dev/null";
    argv[k] = NULL;
    setenv("KSCORE_NATS_NKEY", s->broker_seed, 1);
    rc = stack_daemon(s->dir, "agent-fleet", argv, &pid);
    unsetenv("KSCORE_NATS_NKEY");
    free(argv);
    if (rc)
        return rc;
    int64_t t0 = ks_mono_us(), since = ks_now_us() - 1000000;
    for (unsigned i = 0; rc == 0 && i < n; i++)
        rc = fixture_stack_wait_agent(s, ids[i], since, 120000);
    if (rc) {
        fprintf(stderr, "chaos: the fleet did not register: %s (see "
                        "%s/agent-fleet.log)\n",
                ks_strerror(rc), s->dir);
        return rc;
    }
    chaos_log(r, "fleet of %u agent ids registered in %.1f s", n,
              chaos_since_s(t0));
    /* Ready when the brokers have made every id's consumer (on a cluster
     * each is a raft group: about 0.2 s apiece), as the node counts them
     * (/jsz: every consumer, the recorder's and the registry watchers'
     * too). */
    struct stack_node nodes[3];
    stack_cluster_nodes(s->dir, 3, nodes);
    int consumers = 0;
    while (!chaos_interrupted && chaos_since_s(t0) < 300) {
        struct stack_js_info ji;
        if (stack_nats_js_info(&nodes[0], &ji) == 0 &&
            (consumers = ji.consumers) >= (int)n + 1)
            break;
        chaos_sleep_ms(250);
    }
    chaos_log(r, "%d consumers (the fleet's %u + others) after %.1f s",
              consumers, n, chaos_since_s(t0));
    snprintf(r->probe_agent, sizeof(r->probe_agent), "%s", ids[0]);
    return chaos_readers_start(r);
}

int
chaos_cluster_restart(struct chaos_run *r)
{
    return kscore_up(r);
}

void
chaos_cluster_down(struct chaos_run *r)
{
    const char *args[] = {"down", NULL};
    struct fixture_out o;
    if (!r->st.dir[0])
        return;
    stack_stop(r->st.dir, "agent-fleet", 20000);
    if (fixture_kscore_home(r->st.dir, args, &o) == 0)
        fixture_out_release(&o);
    if (getenv("KSCORE_KEEP_TMP") || r->setup_failed) {
        printf("  kept: %s (KSCORE_HOME of the cluster stack)\n", r->st.dir);
    } else {
        char cmd[PATH_MAX + 32];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", r->st.dir);
        if (system(cmd) != 0)
            fprintf(stderr, "chaos: cannot remove %s\n", r->st.dir);
    }
    free(r->st.nats.url);
    free(r->st.pg.conninfo);
    r->st.nats.url = NULL;
    r->st.pg.conninfo = NULL;
    r->st.dir[0] = '\0';
    r->stack_up = false;
}
