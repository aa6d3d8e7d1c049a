/*
 * trace: where the time of one command goes, step by step. The broker and
 * the agent process are restarted with KSCORE_TRACE naming a file, this
 * process stamps its own side (ks_trace_open), and 100 sequential
 * ExecuteCommand of /bin/true run on perf-0 as in command_latency. Every
 * process appends "<CLOCK_MONOTONIC us> <step> <command id>" (proto
 * ks_trace.c); per command the gaps between consecutive steps of the
 * serial path are taken, and per gap the p50 and p90 over the commands.
 * The services are restarted without tracing afterwards.
 *
 * The serial path, in order. Off it, and reported apart: the command's
 * record (CommandRequested + CommandDispatched and their commit), which
 * the broker overlaps with the command's publish (a claim that arrives
 * first waits for it, inside broker.claim_in -> broker.claim_recorded),
 * and the broker's PubAck of the command.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "perf_int.h"

static const struct {
    const char *step;
    const char *what; /* what lies between the previous step and this one */
} path[] = {
    {"client.sent", NULL},
    {"broker.execute_in", "request: client to broker (NATS)"},
    {"agent.delivered",
     "checks, record sent, sign, JetStream publish, delivery to the agent"},
    {"agent.verified", "agent: decode + signature check"},
    {"agent.claim_sent", "agent: hold the message, journal, claim request"},
    {"broker.claim_in", "claim: agent to broker (NATS)"},
    {"broker.claim_recorded", "PostgreSQL: CommandStarted at the fence"},
    {"agent.claim_granted", "claim reply: broker to agent (NATS)"},
    {"agent.spawned", "agent: cgroup, pipes, spawn"},
    {"agent.exited", "the child runs and is reaped"},
    {"agent.event_publish", "agent: result event packed and queued"},
    {"recorder.taken", "JetStream publish + delivery to the recorder"},
    {"recorder.recorded",
     "recorder: decode, lock and check, CommandCompleted, commit"},
    {"broker.result_replied", "reply to the waiting client"},
    {"client.replied", "reply: broker to client (NATS)"},
};
#define NPATH (sizeof(path) / sizeof(path[0]))
/* Off the path: [i] from step off[i].from to off[i].to, same command. */
static const struct {
    const char *key, *from, *to;
} off[] = {
    {"dispatch_record", "broker.execute_in", "broker.dispatch_recorded"},
    {"command_puback", "broker.execute_in", "broker.command_published"},
};
#define NOFF (sizeof(off) / sizeof(off[0]))
#define NSTEPS (NPATH + 2 * NOFF)

struct stamp {
    char id[37];
    int step;
    int64_t t;
};

static int
cmp_stamp(const void *a, const void *b)
{
    const struct stamp *x = a, *y = b;
    int c = strcmp(x->id, y->id);
    if (c)
        return c;
    return x->step - y->step;
}

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The path's steps are 0..NPATH-1; NPATH + 2i and NPATH + 2i + 1 are
 * off[i]'s ends. */
static int
step_index(const char *name)
{
    for (size_t i = 0; i < NPATH; i++)
        if (strcmp(path[i].step, name) == 0)
            return (int)i;
    for (size_t i = 0; i < NOFF; i++)
        if (strcmp(off[i].to, name) == 0)
            return (int)(NPATH + 2 * i + 1);
    return -1;
}

/* The stamps of the path in file (the first stamp of a step per command
 * counts); *n. */
static struct stamp *
read_stamps(const char *file, size_t *n)
{
    FILE *f = fopen(file, "r");
    struct stamp *v = NULL;
    size_t len = 0, cap = 0;
    char line[256], name[96], id[64];
    long long t;

    *n = 0;
    if (!f)
        return NULL;
    while (fgets(line, sizeof(line), f)) {
        int k;
        if (sscanf(line, "%lld %95s %63s", &t, name, id) != 3 ||
            strlen(id) != 36 || (k = step_index(name)) < 0)
            continue;
        if (len == cap) {
            size_t nc = cap ? cap * 2 : 4096;
            struct stamp *w = realloc(v, nc * sizeof(*v));
            if (!w)
                break;
            v = w;
            cap = nc;
        }
        memcpy(v[len].id, id, 37);
        v[len].step = k;
        v[len].t = t;
        len++;
    }
    fclose(f);
    /* Stable enough: equal (id, step) keep the smaller time first below. */
    qsort(v, len, sizeof(*v), cmp_stamp);
    *n = len;
    return v;
}

static json_t *
analyse(const char *file, int *commands_out)
{
    size_t n = 0, ncmd = 0;
    struct stamp *v = read_stamps(file, &n);
    int64_t *gaps[NPATH] = {0}, *total = NULL, *offs[NOFF] = {0};
    size_t noff[NOFF] = {0};
    json_t *steps = json_array(), *o = json_object();

    for (size_t i = 0; i < NPATH; i++)
        gaps[i] = calloc(n ? n : 1, sizeof(int64_t));
    for (size_t i = 0; i < NOFF; i++)
        offs[i] = calloc(n ? n : 1, sizeof(int64_t));
    total = calloc(n ? n : 1, sizeof(int64_t));
    for (size_t i = 0; i < n;) {
        size_t j = i;
        int64_t at[NSTEPS];
        bool have[NSTEPS] = {0}, all = true;
        while (j < n && strcmp(v[j].id, v[i].id) == 0) {
            if (!have[v[j].step] || v[j].t < at[v[j].step])
                at[v[j].step] = v[j].t;
            have[v[j].step] = true;
            j++;
        }
        for (size_t k = 0; k < NPATH; k++)
            all = all && have[k];
        for (size_t k = 0; k < NOFF; k++) {
            int from = step_index(off[k].from), to = (int)(NPATH + 2 * k + 1);
            if (from >= 0 && have[from] && have[to] && offs[k])
                offs[k][noff[k]++] = at[to] - at[from];
        }
        if (all && gaps[0] && total) {
            for (size_t k = 1; k < NPATH; k++)
                gaps[k][ncmd] = at[k] - at[k - 1];
            total[ncmd] = at[NPATH - 1] - at[0];
            ncmd++;
        }
        i = j;
    }
    for (size_t k = 1; k < NPATH && ncmd; k++) {
        char key[96];
        qsort(gaps[k], ncmd, sizeof(int64_t), cmp_i64);
        /* Flat too, so the summary takes the median over rounds. */
        snprintf(key, sizeof(key), "%s_p50_us", path[k].step);
        json_object_set_new(o, key, json_integer(perf__pct(gaps[k], ncmd, 50)));
        json_array_append_new(
            steps,
            json_pack("{s:s,s:s,s:s,s:I,s:I}", "from", path[k - 1].step, "to",
                      path[k].step, "what", path[k].what, "p50_us",
                      (json_int_t)perf__pct(gaps[k], ncmd, 50), "p90_us",
                      (json_int_t)perf__pct(gaps[k], ncmd, 90)));
    }
    if (ncmd) {
        qsort(total, ncmd, sizeof(int64_t), cmp_i64);
        json_object_set_new(o, "total_p50_us",
                            json_integer(perf__pct(total, ncmd, 50)));
        json_object_set_new(o, "total_p90_us",
                            json_integer(perf__pct(total, ncmd, 90)));
    }
    for (size_t k = 0; k < NOFF; k++) {
        char key[64];
        if (!noff[k])
            continue;
        qsort(offs[k], noff[k], sizeof(int64_t), cmp_i64);
        snprintf(key, sizeof(key), "off_path_%s_p50_us", off[k].key);
        json_object_set_new(o, key,
                            json_integer(perf__pct(offs[k], noff[k], 50)));
    }
    json_object_set_new(o, "commands", json_integer((json_int_t)ncmd));
    json_object_set_new(o, "steps", steps);
    for (size_t i = 0; i < NPATH; i++)
        free(gaps[i]);
    for (size_t i = 0; i < NOFF; i++)
        free(offs[i]);
    free(total);
    free(v);
    *commands_out = (int)ncmd;
    return o;
}

int
perf__trace_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int warm = ctx->o->quick ? 2 : 10, n = ctx->o->quick ? 10 : 100;
    struct evt_conn *c = NULL;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char file[PATH_MAX + 32], bin[PATH_MAX], *argv[1] = {"/bin/true"};
    int rc, errors = 0, ncmd = 0;

    snprintf(file, sizeof(file), "%s/trace-%d.log", ctx->st->dir, round);
    snprintf(bin, sizeof(bin), "%s", ctx->st->bin);
    unlink(file);
    /* The services read KSCORE_TRACE when they first stamp: restart them
     * with it, and without it at the end. */
    setenv("KSCORE_TRACE", file, 1);
    rc = perf__services(ctx->st, bin, ctx->st->local_agents, true, true);
    unsetenv("KSCORE_TRACE");
    if (rc)
        goto out;
    if ((rc = ks_trace_open(file)) || (rc = perf__connect(ctx->st,
                                                          "kscore-perf-trace",
                                                          &c)))
        goto out;
    ks__command_spec__init(&spec);
    spec.argv = argv;
    spec.n_argv = 1;
    spec.timeout_ms = 10000;
    req.spec = &spec;
    req.agent_id = PERF_AGENT_PREFIX "0";
    for (int i = -warm; i < n && !perf__interrupted; i++) {
        Ks__ExecuteReply *rep = NULL;
        if (i == 0) {
            /* Warm-up stamps do not count. */
            ks_trace_open(NULL);
            if (truncate(file, 0) != 0 || (rc = ks_trace_open(file)))
                goto out;
        }
        int r = broker_execute(c, &req, 30000, &rep);
        if (r == 0 && (rep->error_code || !rep->result ||
                       rep->result->status != KS__COMMAND_STATUS__SUCCEEDED))
            r = KS_EINTERNAL;
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        if (r)
            errors++;
    }
    ks_trace_open(NULL);
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }
    /* The agent's last stamps (its PubAck) may trail the reply. */
    perf__sleep_ms(200);
    *out = analyse(file, &ncmd);
    json_object_set_new(*out, "errors", json_integer(errors));
    if (ncmd == 0) {
        /* A binary without stamps (an older kscore in an A/B). */
        json_decref(*out);
        *out = json_pack("{s:s}", "skipped",
                         "no traced commands: this binary does not stamp");
        rc = PERF_SKIPPED;
    }
out:
    ks_trace_open(NULL);
    evt_close(c);
    {
        int r2 = perf__services(ctx->st, bin, ctx->st->local_agents, true,
                                true);
        if (rc == 0 || rc == PERF_SKIPPED)
            rc = r2 ? r2 : rc;
    }
    return rc;
}
