/*
 * perf_store: what the store's two write paths cost on a private
 * PostgreSQL (stack_pg_start in a temporary directory, durability on:
 * fsync and synchronous_commit as PostgreSQL ships them; --fast turns them
 * off like the test fixture does).
 *
 *  latency     store_append of CommandRequested + CommandDispatched to a
 *              new command stream at STORE_NO_STREAM (what the broker's
 *              execute path writes), RUNS times: p50/p95/p99.
 *  throughput  store_append_many of COMMANDS commands x 4 lifecycle events
 *              (Requested, Dispatched, Started, Completed) in batches of
 *              BATCH like the recorder, ROUNDS rounds of fresh commands:
 *              events/s per round, the median and the spread (min-max).
 *              Each round also measures, under the same machine load, the
 *              floor: the same number of pipelined single-row INSERTs
 *              (id, 150 bytes) into a plain table, one transaction per
 *              batch, and append_many of the same events with a type no
 *              projection knows (the append alone).
 *              --spread puts one command's four events in four successive
 *              batches (batch k: Requested of group k, Dispatched of group
 *              k-1, ...), the default keeps them in one batch.
 *  reports     (--reports, instead of throughput) what the recorder does
 *              with agents' results: COMMANDS commands made Running first
 *              (Requested, Dispatched, Started through append_many, not
 *              timed), then their CommandCompleted reports through
 *              store_append_checked() in batches of BATCH, as the
 *              recorder's batch path: events/s, backend and client CPU
 *              and WAL bytes per event, and the same round's floor.
 *
 * Usage: perf_store [--fast] [--json] [--spread] [--reports] [--rounds N]
 *                   [--runs N] [--commands N] [--batch N]
 */
#include <errno.h>
#include <ftw.h>
#include <libpq-fe.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "stack.h"
#include "store.h"

struct opts {
    int fast, json, spread, reports;
    int rounds, runs, commands, batch;
};

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int
cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int64_t
pct(const int64_t *sorted, int n, int p)
{
    int i = (int)((int64_t)n * p / 100);
    return sorted[i < n ? i : n - 1];
}

static int
rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

/* CPU time of a process (utime + stime) in microseconds, or -1. */
static int64_t
proc_cpu_us(int pid)
{
    char path[64];
    unsigned long long ut = 0, st = 0;
    FILE *f;
    int ok;

    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    if (!(f = fopen(path, "r")))
        return -1;
    /* Fields 14 and 15 (proc(5)); the command in field 2 has no spaces
     * for a postgres backend's "(postgres)". */
    ok = fscanf(f,
                "%*d %*s %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu"
                " %llu",
                &ut, &st) == 2;
    fclose(f);
    return ok ? (int64_t)((ut + st) * 1000000ull /
                          (unsigned long long)sysconf(_SC_CLK_TCK))
              : -1;
}

static int64_t
self_cpu_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* One command's four lifecycle events and what they point at. */
struct cmd_evs {
    char cid[37], stream[64];
    char ids[4][37];
    Ks__Event ev[4];
    Ks__Command cmd;
};

static char *bench_argv[] = {"/bin/true"};
static Ks__CommandSpec bench_spec = KS__COMMAND_SPEC__INIT;
static Ks__CommandResult bench_res = KS__COMMAND_RESULT__INIT;
static Ks__Output bench_out = KS__OUTPUT__INIT;
static const char *const lifecycle[4] = {"CommandRequested",
                                         "CommandDispatched", "CommandStarted",
                                         "CommandCompleted"};

static void
fill_command(struct cmd_evs *c)
{
    int64_t now = ks_now_us();

    ks_uuid(c->cid);
    snprintf(c->stream, sizeof(c->stream), "command-%s", c->cid);
    ks__command__init(&c->cmd);
    c->cmd.command_id = c->cid;
    c->cmd.agent_id = "agent-1";
    c->cmd.spec = &bench_spec;
    c->cmd.issued_at_us = now;
    c->cmd.not_after_us = now + 60000000;
    for (int k = 0; k < 4; k++) {
        Ks__Event *ev = &c->ev[k];
        ks__event__init(ev);
        ks_uuid(c->ids[k]);
        ev->event_id = c->ids[k];
        ev->stream_id = c->stream;
        ev->type = (char *)lifecycle[k];
        ev->command_id = c->cid;
        ev->occurred_at_us = now + k;
        ev->agent_id = "agent-1";
        if (k > 0)
            ev->attempt = 1;
    }
    c->ev[0].command = &c->cmd;
    c->ev[1].deliver_by_us = now + 30000000;
    c->ev[3].result = &bench_res;
}

static int
measure_latency(struct store *s, const struct opts *o, int64_t lat[3])
{
    int64_t *v = malloc((size_t)o->runs * sizeof(*v));
    struct cmd_evs c;
    int rc = 0;

    if (!v)
        return -ENOMEM;
    for (int i = -20; i < o->runs; i++) { /* 20 warm-up appends */
        struct store_event se[2];
        fill_command(&c);
        se[0].event = &c.ev[0];
        se[1].event = &c.ev[1];
        int64_t t0 = ks_mono_us();
        rc = store_append(s, c.stream, STORE_NO_STREAM, se, 2, NULL);
        int64_t us = ks_mono_us() - t0;
        if (rc < 0) {
            fprintf(stderr, "perf_store: store_append: %s\n",
                    ks_strerror(rc));
            goto out;
        }
        if (i >= 0)
            v[i] = us;
    }
    qsort(v, (size_t)o->runs, sizeof(*v), cmp_i64);
    lat[0] = pct(v, o->runs, 50);
    lat[1] = pct(v, o->runs, 95);
    lat[2] = pct(v, o->runs, 99);
out:
    free(v);
    return rc;
}

/* One round: fresh commands, all their events through append_many. */
struct round {
    double floor_eps;   /* pipelined single-row inserts per second */
    double opaque_eps;  /* append_many without projections */
    double eps;         /* events per second, wall clock */
    double server_us;   /* backend CPU per event */
    double client_us;   /* this process's CPU per event */
    double wal_bytes;   /* WAL written per event (--reports) */
};

/* The server's WAL insert position in bytes, or -1. */
static int64_t
wal_lsn(struct store *s)
{
    PGresult *res = PQexec(store_pgconn(s),
                           "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(),"
                           " '0/0')::bigint");
    int64_t v = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1
                    ? strtoll(PQgetvalue(res, 0, 0), NULL, 10)
                    : -1;
    PQclear(res);
    return v;
}

/* Pipelined single-row inserts, a transaction per batch: rows/s. */
static int
measure_floor(struct store *s, const struct opts *o, int rows, double *out)
{
    PGconn *c = store_pgconn(s);
    static char payload[150];
    static int64_t next_id;
    int64_t t0 = ks_mono_us(), us;
    int rc = 0;

    memset(payload, 'x', sizeof(payload));
    for (int off = 0; off < rows && rc == 0; off += o->batch) {
        int len = rows - off < o->batch ? rows - off : o->batch;
        if (!PQenterPipelineMode(c))
            return KS_EPG;
        PQsendQueryParams(c, "BEGIN", 0, NULL, NULL, NULL, NULL, 0);
        for (int i = 0; i < len; i++) {
            char id[24];
            const char *vals[2] = {id, payload};
            int lens[2] = {0, sizeof(payload)}, fmts[2] = {0, 1};
            snprintf(id, sizeof(id), "%lld", (long long)++next_id);
            PQsendQueryParams(c,
                              "INSERT INTO perf_floor (id, v) VALUES ($1, $2)",
                              2, NULL, vals, lens, fmts, 0);
        }
        PQsendQueryParams(c, "COMMIT", 0, NULL, NULL, NULL, NULL, 0);
        PQpipelineSync(c);
        for (;;) {
            PGresult *res = PQgetResult(c);
            if (!res)
                continue;
            ExecStatusType st = PQresultStatus(res);
            if (st == PGRES_FATAL_ERROR)
                rc = KS_EPG;
            PQclear(res);
            if (st == PGRES_PIPELINE_SYNC)
                break;
        }
        PQexitPipelineMode(c);
    }
    us = ks_mono_us() - t0;
    *out = (double)rows * 1e6 / (double)us;
    return rc;
}

/* append_many of events no projection knows: the append alone. */
static int
measure_opaque(struct store *s, const struct opts *o, struct cmd_evs *cmds,
               const Ks__Event **order, int n, double *out)
{
    int64_t t0, us;
    int rc = 0;

    for (int i = 0; i < n / 4; i++) {
        fill_command(&cmds[i]);
        for (int k = 0; k < 4; k++) {
            cmds[i].ev[k].type = "PerfOpaque";
            order[i * 4 + k] = &cmds[i].ev[k];
        }
    }
    t0 = ks_mono_us();
    for (int off = 0; off < n && rc == 0; off += o->batch) {
        size_t len = (size_t)(n - off < o->batch ? n - off : o->batch);
        rc = store_append_many(s, order + off, len, NULL);
    }
    us = ks_mono_us() - t0;
    *out = (double)n * 1e6 / (double)us;
    return rc;
}

static int
measure_round(struct store *s, const struct opts *o, struct cmd_evs *cmds,
              const Ks__Event **order, struct round *out)
{
    int backend = PQbackendPID(store_pgconn(s));
    int ncmd = o->commands, group = o->batch / 4, n = 0, rc = 0;
    int groups = (ncmd + group - 1) / group;
    int64_t srv0, cli0, t0, us;

    if ((rc = measure_floor(s, o, ncmd * 4, &out->floor_eps)) < 0 ||
        (rc = measure_opaque(s, o, cmds, order, ncmd * 4,
                             &out->opaque_eps)) < 0) {
        fprintf(stderr, "perf_store: floor: %s\n", ks_strerror(rc));
        return rc;
    }

    for (int i = 0; i < ncmd; i++)
        fill_command(&cmds[i]);
    if (!o->spread) {
        for (int g = 0; g < groups; g++)
            for (int k = 0; k < 4; k++)
                for (int i = g * group; i < ncmd && i < (g + 1) * group; i++)
                    order[n++] = &cmds[i].ev[k];
    } else {
        for (int t = 0; t < groups + 3; t++)
            for (int k = 0; k < 4; k++) {
                int g = t - k;
                if (g < 0 || g >= groups)
                    continue;
                for (int i = g * group; i < ncmd && i < (g + 1) * group; i++)
                    order[n++] = &cmds[i].ev[k];
            }
    }
    srv0 = proc_cpu_us(backend);
    cli0 = self_cpu_us();
    t0 = ks_mono_us();
    for (int off = 0; off < n; off += o->batch) {
        size_t len = (size_t)(n - off < o->batch ? n - off : o->batch);
        size_t dups = 0;
        rc = store_append_many(s, order + off, len, &dups);
        if (rc < 0 || dups != 0) {
            fprintf(stderr, "perf_store: store_append_many: %s (dups %zu)\n",
                    ks_strerror(rc), dups);
            return rc < 0 ? rc : KS_EINTERNAL;
        }
    }
    us = ks_mono_us() - t0;
    out->eps = (double)n * 1e6 / (double)us;
    out->server_us = (double)(proc_cpu_us(backend) - srv0) / n;
    out->client_us = (double)(self_cpu_us() - cli0) / n;
    return 0;
}

/* One round of --reports: the CommandCompleted of fresh Running
 * commands through store_append_checked, as the recorder writes them. */
static int
measure_reports(struct store *s, const struct opts *o, struct cmd_evs *cmds,
                const Ks__Event **order, struct round *out)
{
    int backend = PQbackendPID(store_pgconn(s));
    int ncmd = o->commands, n = 0, rc = 0;
    int64_t srv0, cli0, t0, us;
    enum store_step *verdicts = calloc((size_t)o->batch, sizeof(*verdicts));

    if (!verdicts)
        return -ENOMEM;
    if ((rc = measure_floor(s, o, ncmd, &out->floor_eps)) < 0) {
        fprintf(stderr, "perf_store: floor: %s\n", ks_strerror(rc));
        goto out;
    }
    out->opaque_eps = 0;
    for (int i = 0; i < ncmd; i++)
        fill_command(&cmds[i]);
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < ncmd; i++)
            order[n++] = &cmds[i].ev[k];
    for (int off = 0; off < n && rc == 0; off += o->batch) {
        size_t len = (size_t)(n - off < o->batch ? n - off : o->batch);
        rc = store_append_many(s, order + off, len, NULL);
    }
    if (rc < 0) {
        fprintf(stderr, "perf_store: making Running: %s\n", ks_strerror(rc));
        goto out;
    }
    for (int i = 0; i < ncmd; i++)
        order[i] = &cmds[i].ev[3];
    int64_t wal0 = wal_lsn(s);
    srv0 = proc_cpu_us(backend);
    cli0 = self_cpu_us();
    t0 = ks_mono_us();
    for (int off = 0; off < ncmd; off += o->batch) {
        size_t len = (size_t)(ncmd - off < o->batch ? ncmd - off : o->batch);
        size_t dups = 0;
        rc = store_append_checked(s, order + off, len, NULL, NULL, verdicts,
                                  &dups);
        for (size_t i = 0; rc == 0 && i < len; i++)
            if (verdicts[i] != STORE_STEP_APPLY)
                rc = KS_EINTERNAL;
        if (rc < 0 || dups != 0) {
            fprintf(stderr, "perf_store: store_append_checked: %s (dups %zu)\n",
                    ks_strerror(rc), dups);
            rc = rc < 0 ? rc : KS_EINTERNAL;
            goto out;
        }
    }
    us = ks_mono_us() - t0;
    out->eps = (double)ncmd * 1e6 / (double)us;
    out->server_us = (double)(proc_cpu_us(backend) - srv0) / ncmd;
    out->client_us = (double)(self_cpu_us() - cli0) / ncmd;
    out->wal_bytes = (double)(wal_lsn(s) - wal0) / ncmd;
out:
    free(verdicts);
    return rc;
}

static int
parse(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.rounds = 5, .runs = 1000, .commands = 25000,
                       .batch = 1000};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int *num = NULL;
        if (strcmp(a, "--fast") == 0)
            o->fast = 1;
        else if (strcmp(a, "--json") == 0)
            o->json = 1;
        else if (strcmp(a, "--spread") == 0)
            o->spread = 1;
        else if (strcmp(a, "--reports") == 0)
            o->reports = 1;
        else if (strcmp(a, "--rounds") == 0)
            num = &o->rounds;
        else if (strcmp(a, "--runs") == 0)
            num = &o->runs;
        else if (strcmp(a, "--commands") == 0)
            num = &o->commands;
        else if (strcmp(a, "--batch") == 0)
            num = &o->batch;
        else
            return -EINVAL;
        if (num) {
            if (++i >= argc || (*num = atoi(argv[i])) <= 0)
                return -EINVAL;
        }
    }
    /* A round of the 4 events of a command needs 4; reports one. */
    return o->batch >= (o->reports ? 1 : 4) ? 0 : -EINVAL;
}

int
main(int argc, char **argv)
{
    struct opts o;
    char dir[PATH_MAX], *conninfo = NULL, *err = NULL;
    const char *tmp = getenv("TMPDIR");
    struct store *s = NULL;
    struct cmd_evs *cmds = NULL;
    const Ks__Event **order = NULL;
    struct round *rounds = NULL;
    double *eps = NULL;
    int64_t lat[3];
    pid_t pid;
    int rc;

    if (parse(argc, argv, &o) < 0) {
        fprintf(stderr,
                "usage: perf_store [--fast] [--json] [--spread] [--reports]"
                " [--rounds N]"
                " [--runs N] [--commands N] [--batch N]\n");
        return 2;
    }
    bench_spec.n_argv = 1;
    bench_spec.argv = bench_argv;
    bench_out.data.data = (uint8_t *)"hello\n";
    bench_out.data.len = 6;
    bench_out.total_bytes = 6;
    bench_res.stdout = &bench_out;
    bench_res.has_exit_code = 1;
    bench_res.status = KS__COMMAND_STATUS__SUCCEEDED;
    bench_res.duration_us = 1000;

    /* stack_pg_start reads KSCORE_PG_FAST; say it either way. */
    setenv("KSCORE_PG_FAST", o.fast ? "1" : "0", 1);
    snprintf(dir, sizeof(dir), "%s/kscore-perf-store-XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror("perf_store: mkdtemp");
        return 1;
    }
    rc = stack_pg_start(dir, 0, &conninfo, &pid);
    if (rc < 0) {
        fprintf(stderr, "perf_store: PostgreSQL: %s (see %s/pg.log)\n",
                ks_strerror(rc), dir);
        return 1;
    }
    if ((rc = store_open(conninfo, &s, &err)) < 0 ||
        (rc = store_migrate(s, &err)) < 0) {
        fprintf(stderr, "perf_store: %s: %s\n", ks_strerror(rc),
                err ? err : "");
        goto out;
    }
    {
        PGresult *res = PQexec(store_pgconn(s),
                               "CREATE TABLE IF NOT EXISTS perf_floor"
                               " (id bigint PRIMARY KEY, v bytea)");
        int ok = PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
        if (!ok) {
            rc = KS_EPG;
            goto out;
        }
    }
    cmds = calloc((size_t)o.commands, sizeof(*cmds));
    order = calloc((size_t)o.commands * 4, sizeof(*order));
    eps = calloc((size_t)o.rounds, sizeof(*eps));
    rounds = calloc((size_t)o.rounds, sizeof(*rounds));
    if (!cmds || !order || !eps || !rounds) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = measure_latency(s, &o, lat)) < 0)
        goto out;
    if (!o.json)
        printf("store_append (2 events, new stream, durability %s): p50 %.3f"
               " ms  p95 %.3f ms  p99 %.3f ms  (%d appends)\n",
               o.fast ? "off" : "on", lat[0] / 1000.0, lat[1] / 1000.0,
               lat[2] / 1000.0, o.runs);
    for (int r = 0; r < o.rounds; r++) {
        if ((rc = o.reports
                      ? measure_reports(s, &o, cmds, order, &rounds[r])
                      : measure_round(s, &o, cmds, order, &rounds[r])) < 0)
            goto out;
        eps[r] = rounds[r].eps;
        if (!o.json && o.reports)
            printf("store_append_checked round %d: %d reports (batches of"
                   " %d): %.0f events/s; CPU per event: server %.1f us,"
                   " client %.1f us; WAL %.0f bytes an event; same round:"
                   " floor %.0f inserts/s\n",
                   r, o.commands, o.batch, eps[r], rounds[r].server_us,
                   rounds[r].client_us, rounds[r].wal_bytes,
                   rounds[r].floor_eps);
        else if (!o.json)
            printf("store_append_many round %d: %d events (%d commands x 4,"
                   " batches of %d%s): %.0f events/s; CPU per event:"
                   " server %.1f us, client %.1f us; same round: floor"
                   " %.0f inserts/s, append only %.0f events/s\n",
                   r, o.commands * 4, o.commands, o.batch,
                   o.spread ? ", spread" : "", eps[r], rounds[r].server_us,
                   rounds[r].client_us, rounds[r].floor_eps,
                   rounds[r].opaque_eps);
    }
    {
        double *sorted = malloc((size_t)o.rounds * sizeof(*sorted));
        if (!sorted) {
            rc = -ENOMEM;
            goto out;
        }
        memcpy(sorted, eps, (size_t)o.rounds * sizeof(*sorted));
        qsort(sorted, (size_t)o.rounds, sizeof(*sorted), cmp_dbl);
        double med = sorted[o.rounds / 2], lo = sorted[0],
               hi = sorted[o.rounds - 1];
        if (o.json) {
            printf("{\"durability\": %s, \"layout\": \"%s\","
                   " \"append_2ev_ms\": {\"p50\": %.3f, \"p95\": %.3f,"
                   " \"p99\": %.3f, \"runs\": %d},"
                   " \"append_many_eps\": {\"rounds\": [",
                   o.fast ? "false" : "true",
                   o.spread ? "spread" : "grouped", lat[0] / 1000.0,
                   lat[1] / 1000.0, lat[2] / 1000.0, o.runs);
            for (int r = 0; r < o.rounds; r++)
                printf("%s%.0f", r ? ", " : "", eps[r]);
            printf("], \"server_cpu_us_per_event\": [");
            for (int r = 0; r < o.rounds; r++)
                printf("%s%.1f", r ? ", " : "", rounds[r].server_us);
            printf("], \"client_cpu_us_per_event\": [");
            for (int r = 0; r < o.rounds; r++)
                printf("%s%.1f", r ? ", " : "", rounds[r].client_us);
            printf("], \"floor_inserts_per_s\": [");
            for (int r = 0; r < o.rounds; r++)
                printf("%s%.0f", r ? ", " : "", rounds[r].floor_eps);
            printf("], \"append_only_eps\": [");
            for (int r = 0; r < o.rounds; r++)
                printf("%s%.0f", r ? ", " : "", rounds[r].opaque_eps);
            printf("], \"median\": %.0f, \"min\": %.0f, \"max\": %.0f,"
                   " \"events\": %d, \"batch\": %d}}\n",
                   med, lo, hi, o.commands * 4, o.batch);
        } else {
            printf("store_append_many: median %.0f events/s, spread %.0f -"
                   " %.0f (%.1f%%)\n",
                   med, lo, hi, med > 0 ? (hi - lo) * 100.0 / med : 0.0);
        }
        free(sorted);
    }
out:
    store_close(s);
    free(err);
    free(cmds);
    free(order);
    free(eps);
    free(rounds);
    stack_pg_stop(dir);
    if (!getenv("KSCORE_KEEP_TMP"))
        nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(conninfo);
    return rc < 0 ? 1 : 0;
}
