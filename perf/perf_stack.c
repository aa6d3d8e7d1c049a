/*
 * The suite's stack: private nats-server and PostgreSQL through cli/stack.h
 * (the same code as `kscore up` and the test fixtures), and the broker and
 * agent daemons started from a chosen kscore binary, optionally under a
 * wrapper (heaptrack, perf record) for `make profile`.
 */
#include <dirent.h>
#include <libpq-fe.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "perf_int.h"
#include "stack.h"

#define WRAP_MAX_ARGS 24

static int
rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void
perf__rm_tree(const char *dir)
{
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

double
perf__loadavg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "re");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

static bool
pid_alive(pid_t pid)
{
    char path[64], buf[512], *p;
    FILE *f;
    size_t n;

    if (pid <= 0 || kill(pid, 0) == -1)
        return false;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    if (!(f = fopen(path, "re")))
        return false;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] != 'Z';
}

/*
 * The fields of /proc/PID/stat a sample needs (proc(5)): ppid (4), utime,
 * stime, cutime and cstime (14-17, clock ticks). 0 or -errno/KS_EDECODE.
 */
static int
read_stat(pid_t pid, long *ppid, unsigned long long t[4])
{
    char path[64], buf[1024], *p;
    FILE *f;
    size_t n;

    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    if (!(f = fopen(path, "re")))
        return -errno;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* After "(comm)": the state is field 3. */
    p = strrchr(buf, ')');
    if (!p || sscanf(p + 2, "%*c %ld %*d %*d %*d %*d %*u %*u %*u %*u %*u "
                            "%llu %llu %llu %llu",
                     ppid, &t[0], &t[1], &t[2], &t[3]) != 5)
        return KS_EDECODE;
    return 0;
}

static int64_t
ticks_us(unsigned long long ticks)
{
    return (int64_t)(ticks * 1000000ULL /
                     (unsigned long long)sysconf(_SC_CLK_TCK));
}

int
perf__proc_sample(pid_t pid, struct perf_proc *out)
{
    char path[64], buf[1024];
    unsigned long long t[4];
    long ppid;
    int64_t rss = -1;
    FILE *f;
    int rc;

    if ((rc = read_stat(pid, &ppid, t)) < 0)
        return rc;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    if (!(f = fopen(path, "re")))
        return -errno;
    while (fgets(buf, sizeof(buf), f))
        if (strncmp(buf, "VmRSS:", 6) == 0) {
            rss = strtoll(buf + 6, NULL, 10);
            break;
        }
    fclose(f);
    out->cpu_us = ticks_us(t[0] + t[1]);
    out->children_us = ticks_us(t[2] + t[3]);
    out->rss_kb = rss;
    return 0;
}

int64_t
perf__tree_cpu_us(pid_t pid)
{
    unsigned long long t[4];
    long ppid;
    int64_t sum;
    DIR *d;
    struct dirent *e;

    /* The postmaster with the children it reaped (PostgreSQL's ended
     * backends: cutime, cstime), then its live children. */
    if (pid <= 0 || read_stat(pid, &ppid, t) < 0)
        return -1;
    sum = ticks_us(t[0] + t[1] + t[2] + t[3]);
    if (!(d = opendir("/proc")))
        return sum;
    while ((e = readdir(d))) {
        pid_t child = (pid_t)atol(e->d_name);
        if (child > 0 && read_stat(child, &ppid, t) == 0 && ppid == pid)
            sum += ticks_us(t[0] + t[1]);
    }
    closedir(d);
    return sum;
}

void
perf__cost_sample(const struct perf_stack *st, struct perf_cost *out)
{
    struct perf_proc pp;
    PGconn *pg;

    out->xid = -1;
    out->nats_cpu_us = st->own_nats && st->nats_pid > 0 &&
                               perf__proc_sample(st->nats_pid, &pp) == 0
                           ? pp.cpu_us
                           : -1;
    out->pg_cpu_us = st->own_pg ? perf__tree_cpu_us(st->pg_pid) : -1;
    out->broker_cpu_us = st->broker_pid > 0 &&
                                 perf__proc_sample(st->broker_pid, &pp) == 0
                             ? pp.cpu_us
                             : -1;
    out->agent_cpu_us = out->children_cpu_us = -1;
    if (st->agent_pid > 0 && perf__proc_sample(st->agent_pid, &pp) == 0) {
        out->agent_cpu_us = pp.cpu_us;
        out->children_cpu_us = pp.children_us;
    }
    pg = PQconnectdb(st->conninfo);
    if (PQstatus(pg) == CONNECTION_OK) {
        PGresult *r = PQexec(pg, "SELECT pg_current_xact_id()::text");
        if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
            out->xid = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        PQclear(r);
    }
    PQfinish(pg);
}

/* Sets <part>_per_<unit> = (b - a) / units on o when both are known;
 * returns the difference, or -1. */
static int64_t
cost_part(json_t *o, const char *part, const char *unit, int64_t a, int64_t b,
          double units)
{
    char key[64];
    if (a < 0 || b < a)
        return -1;
    snprintf(key, sizeof(key), "%s_per_%s", part, unit);
    json_object_set_new(o, key, json_real((double)(b - a) / units));
    return b - a;
}

void
perf__cost_json(json_t *o, const struct perf_cost *a,
                const struct perf_cost *b, double units, const char *unit)
{
    char key[64];

    if (units <= 0)
        return;
    /* Each sample takes an xid of its own: the one that opens the
     * interval is not the stack's. */
    if (a->xid >= 0 && b->xid > a->xid) {
        snprintf(key, sizeof(key), "pg_write_xacts_per_%s", unit);
        json_object_set_new(o, key,
                            json_real((double)(b->xid - a->xid - 1) / units));
    }
    int64_t nats = cost_part(o, "nats_cpu_us", unit, a->nats_cpu_us,
                             b->nats_cpu_us, units);
    int64_t pg = cost_part(o, "pg_cpu_us", unit, a->pg_cpu_us, b->pg_cpu_us,
                           units);
    int64_t brk = cost_part(o, "broker_cpu_us", unit, a->broker_cpu_us,
                            b->broker_cpu_us, units);
    int64_t agt = cost_part(o, "agent_cpu_us", unit, a->agent_cpu_us,
                            b->agent_cpu_us, units);
    cost_part(o, "children_cpu_us", unit, a->children_cpu_us,
              b->children_cpu_us, units);
    /* The stack's whole cost, children excluded (issue 23), only when
     * every part is known (the suite's own servers). */
    if (nats >= 0 && pg >= 0 && brk >= 0 && agt >= 0) {
        snprintf(key, sizeof(key), "cpu_per_%s_us", unit);
        json_object_set_new(
            o, key, json_real((double)(nats + pg + brk + agt) / units));
    }
}

int
perf__connect(const struct perf_stack *st, const char *name,
              struct evt_conn **out)
{
    struct evt_connect_opts o = {.name = name, .send_asap = true};
    char *errmsg = NULL;
    int rc = evt_connect(st->nats_url, &o, out, &errmsg);
    if (rc) {
        fprintf(stderr, "kscore perf: %s\n",
                errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
    }
    return rc;
}

long
perf__sql_long(PGconn *pg, const char *sql)
{
    PGresult *r = PQexec(pg, sql);
    long v = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
        v = strtol(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

/* The durability the numbers were measured with, for the report. */
static int
pg_settings(struct perf_stack *st)
{
    PGconn *pg = PQconnectdb(st->conninfo);
    PGresult *r = NULL;
    int rc = 0;

    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: PostgreSQL: %s", PQerrorMessage(pg));
        rc = KS_EUNAVAIL;
        goto out;
    }
    r = PQexec(pg, "SELECT current_setting('fsync'), "
                   "current_setting('synchronous_commit')");
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        fprintf(stderr, "kscore perf: PostgreSQL: %s", PQerrorMessage(pg));
        rc = KS_EPG;
        goto out;
    }
    snprintf(st->pg_fsync, sizeof(st->pg_fsync), "%s", PQgetvalue(r, 0, 0));
    snprintf(st->pg_sync_commit, sizeof(st->pg_sync_commit), "%s",
             PQgetvalue(r, 0, 1));
out:
    PQclear(r);
    PQfinish(pg);
    return rc;
}

int
perf__stack_start(struct perf_stack *st, const struct perf_opts *o)
{
    const char *tmp = getenv("TMPDIR");
    int rc;

    memset(st, 0, sizeof(*st));
    snprintf(st->dir, sizeof(st->dir), "%s/kscore-perf-XXXXXX",
             tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(st->dir)) {
        rc = -errno;
        st->dir[0] = '\0';
        fprintf(stderr, "kscore perf: mkdtemp: %s\n", strerror(-rc));
        return rc;
    }
    /* Commands are signed (DESIGN "Security"): a key pair for this run,
     * passed through the environment so that an --ab binary from before
     * the flags existed starts the same way. */
    char priv[PATH_MAX + 16], pub[PATH_MAX + 16];
    snprintf(priv, sizeof(priv), "%s/broker.key", st->dir);
    snprintf(pub, sizeof(pub), "%s/broker.pub", st->dir);
    if ((rc = evt_keygen(priv, pub))) {
        fprintf(stderr, "kscore perf: signing key: %s\n", ks_strerror(rc));
        return rc;
    }
    setenv("KSCORE_SIGNING_KEY", priv, 1);
    setenv("KSCORE_TRUST_KEY", pub, 1);
    gethostname(st->host, sizeof(st->host));
    st->host[sizeof(st->host) - 1] = '\0';
    st->host[strcspn(st->host, ".")] = '\0';

    if (o->nats_url) {
        if (!(st->nats_url = strdup(o->nats_url)))
            return -ENOMEM;
    } else {
        rc = stack_nats_start(st->dir, 0, NULL, &st->nats_url, &st->nats_pid);
        if (rc) {
            fprintf(stderr, "kscore perf: nats-server: %s (see %s/nats.log)\n",
                    ks_strerror(rc), st->dir);
            return rc;
        }
        st->own_nats = true;
    }
    if (o->db) {
        if (!(st->conninfo = strdup(o->db)))
            return -ENOMEM;
    } else {
        /* The SLOs are about a durable system: never fsync=off here. */
        unsetenv("KSCORE_PG_FAST");
        rc = stack_pg_start(st->dir, 0, &st->conninfo, &st->pg_pid);
        if (rc) {
            fprintf(stderr, "kscore perf: PostgreSQL: %s (see %s/pg.log)\n",
                    ks_strerror(rc), st->dir);
            return rc;
        }
        st->own_pg = true;
    }
    return pg_settings(st);
}

/* The path of prog: as is with a '/', else the first match on PATH. */
static int
which(const char *prog, char *out, size_t len)
{
    const char *path = getenv("PATH");
    if (strchr(prog, '/')) {
        snprintf(out, len, "%s", prog);
        return 0;
    }
    for (const char *p = path ? path : "/usr/bin:/bin"; *p;) {
        size_t n = strcspn(p, ":");
        snprintf(out, len, "%.*s/%s", (int)n, p, prog);
        if (access(out, X_OK) == 0)
            return 0;
        p += n + (p[n] == ':');
    }
    return -ENOENT;
}

/*
 * Splits the wrapper in env var `var` into argv (strings in *store,
 * malloc'd; "%n" replaced by start). Returns the count or -errno.
 */
static int
wrap_argv(const char *var, unsigned start, char **argv, size_t max,
          char **store)
{
    const char *w = getenv(var);
    char *s, *save = NULL, num[16];
    int n = 0;

    *store = NULL;
    if (!w || !w[0])
        return 0;
    snprintf(num, sizeof(num), "%u", start);
    /* Room for every "%n" to grow into the number. */
    s = malloc(strlen(w) * (strlen(num) + 1) + PATH_MAX + 1);
    if (!s)
        return -ENOMEM;
    *store = s;
    for (const char *r = w; *r; r++) {
        if (r[0] == '%' && r[1] == 'n') {
            s = stpcpy(s, num);
            r++;
        } else {
            *s++ = *r;
        }
    }
    *s = '\0';
    for (char *t = strtok_r(*store, " ", &save); t && (size_t)n < max;
         t = strtok_r(NULL, " ", &save))
        argv[n++] = t;
    return n;
}

/* The kscore process in the daemon's session: the daemon itself, or the
 * wrapper's child whose executable is bin. 0 if not (yet) there. */
static pid_t
real_pid(pid_t daemon, const char *bin)
{
    char want[PATH_MAX], path[64], exe[PATH_MAX + 16], buf[512];
    DIR *d;
    struct dirent *de;
    pid_t found = 0;

    if (!realpath(bin, want))
        snprintf(want, sizeof(want), "%s", bin);
    snprintf(path, sizeof(path), "/proc/%d/exe", (int)daemon);
    ssize_t n = readlink(path, exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        if (strncmp(exe, want, strlen(want)) == 0)
            return daemon;
    }
    if (!(d = opendir("/proc")))
        return 0;
    while (!found && (de = readdir(d))) {
        pid_t pid = (pid_t)atoi(de->d_name);
        int sid = 0;
        FILE *f;
        if (pid <= 0 || pid == daemon)
            continue;
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        if (!(f = fopen(path, "re")))
            continue;
        n = (ssize_t)fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n > 0 ? n : 0] = '\0';
        char *p = strrchr(buf, ')');
        /* state ppid pgrp session */
        if (!p || sscanf(p + 2, "%*c %*d %*d %d", &sid) != 1 ||
            sid != daemon)
            continue;
        snprintf(path, sizeof(path), "/proc/%d/exe", (int)pid);
        n = readlink(path, exe, sizeof(exe) - 1);
        if (n <= 0)
            continue;
        exe[n] = '\0';
        if (strncmp(exe, want, strlen(want)) == 0)
            found = pid;
    }
    closedir(d);
    return found ? found : daemon;
}

static int
start_daemon(struct perf_stack *st, const char *name, const char *wrap_var,
             char **args, pid_t *daemon_out)
{
    char *argv[WRAP_MAX_ARGS + 64], *store = NULL, prog[PATH_MAX];
    int n = wrap_argv(wrap_var, st->starts, argv, WRAP_MAX_ARGS, &store);
    int rc;

    if (n < 0)
        return n;
    if (n > 0) {
        if (which(argv[0], prog, sizeof(prog)) != 0) {
            fprintf(stderr, "kscore perf: %s: %s not found on PATH\n",
                    wrap_var, argv[0]);
            free(store);
            return -ENOENT;
        }
        argv[0] = prog;
    }
    for (size_t i = 0; args[i] && n < WRAP_MAX_ARGS + 62; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    rc = stack_daemon(st->dir, name, argv, daemon_out);
    free(store);
    return rc;
}

/* Waits until the broker answers a Get (any reply means it serves). */
static int
wait_broker(struct perf_stack *st, pid_t daemon, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    struct evt_conn *c = NULL;
    char id[37];
    int rc = KS_ETIMEDOUT;

    ks_uuid(id);
    while (ks_mono_us() < deadline && !perf__interrupted) {
        if (waitpid(daemon, NULL, WNOHANG) == daemon) {
            rc = KS_EUNAVAIL; /* it exited: its log says why */
            break;
        }
        if (!c && perf__connect(st, "kscore-perf-wait", &c) != 0)
            c = NULL;
        if (c) {
            Ks__GetRequest req = KS__GET_REQUEST__INIT;
            ProtobufCMessage *rep = NULL;
            req.id = id;
            rc = broker_call(c, EVT_API_GET, &req.base,
                             &ks__get_reply__descriptor, 1000, &rep);
            if (rep)
                protobuf_c_message_free_unpacked(rep, NULL);
            if (rc == 0)
                break;
        }
        perf__sleep_ms(100);
    }
    evt_close(c);
    return rc == 0 || rc == KS_EUNAVAIL ? rc : KS_ETIMEDOUT;
}

/*
 * Waits until the broker lists n agents named <prefix><i> (i < n) online
 * with a heartbeat at or after since_us (not left over from an earlier
 * start).
 */
static int
wait_agents(struct perf_stack *st, const char *prefix, unsigned n,
            int64_t since_us, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    size_t plen = strlen(prefix);
    struct evt_conn *c = NULL;
    int rc = KS_ETIMEDOUT;

    if (perf__connect(st, "kscore-perf-wait", &c) != 0)
        return KS_EUNAVAIL;
    while (ks_mono_us() < deadline && !perf__interrupted) {
        Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
        Ks__AgentsReply *rep = NULL;
        unsigned seen = 0;
        if (broker_call(c, EVT_API_AGENTS, &req.base,
                        &ks__agents_reply__descriptor, 5000,
                        (ProtobufCMessage **)&rep) == 0) {
            for (size_t i = 0; i < rep->n_agents; i++) {
                const Ks__AgentStatus *a = rep->agents[i];
                const char *id = a->info ? a->info->agent_id : "";
                char *end = NULL;
                if (!a->online || strncmp(id, prefix, plen) != 0 ||
                    a->info->heartbeat_at_us < since_us)
                    continue;
                unsigned long k = strtoul(id + plen, &end, 10);
                if (end != id + plen && !*end && k < n)
                    seen++;
            }
            protobuf_c_message_free_unpacked(&rep->base, NULL);
        }
        if (seen >= n) {
            rc = 0;
            break;
        }
        perf__sleep_ms(100);
    }
    evt_close(c);
    return rc;
}

/* Stops one daemon: its kscore process first (TERM: it flushes and exits,
 * and a wrapper such as heaptrack then writes its data), then the daemon. */
static void
stop_one(struct perf_stack *st, const char *name, pid_t daemon, pid_t real)
{
    if (daemon > 0)
        waitpid(daemon, NULL, WNOHANG); /* one that died early: reaped */
    if (!stack_pidfile_alive(st->dir, name, &daemon))
        return;
    if (real > 0 && real != daemon) {
        kill(real, SIGTERM);
        for (int i = 0; i < 1000 && pid_alive(real); i++)
            perf__sleep_ms(20);
        /* The wrapper finishes on its own (heaptrack compresses). */
        for (int i = 0; i < 6000 && pid_alive(daemon); i++) {
            waitpid(daemon, NULL, WNOHANG);
            nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
        }
    }
    stack_stop(st->dir, name, 20000);
}

void
perf__services_stop(struct perf_stack *st)
{
    if (!st->dir[0])
        return;
    stop_one(st, "agent", st->agent_daemon, st->agent_pid);
    stop_one(st, "broker", st->broker_daemon, st->broker_pid);
    st->agent_pid = st->broker_pid = 0;
    st->agent_daemon = st->broker_daemon = 0;
    st->agent_up = false;
    st->bin[0] = '\0';
}

/*
 * The executable that runs bin's broker and agent: the daemon half beside
 * it (kscore-daemon: kscore runs it for `kscore broker` and `kscore
 * agent`, cli_int.h), so that a KSCORE_PERF_WRAP tool (valgrind,
 * heaptrack) wraps the daemon itself, not a kscore that replaces itself
 * with it, and real_pid() finds it; bin itself when there is none beside
 * it (an older kscore that was one binary, or an installed kscore, whose
 * daemon half is under libexec: that one runs, but a wrapper sees only
 * kscore).
 */
static void
services_bin(const char *bin, char *out, size_t len)
{
    const char *slash = strrchr(bin, '/');
    snprintf(out, len, "%.*s/kscore-daemon",
             slash ? (int)(slash - bin) : 1, slash ? bin : ".");
    if (access(out, X_OK) != 0)
        snprintf(out, len, "%s", bin);
}

static int
start_agent(struct perf_stack *st, const char *bin_)
{
    char bin[PATH_MAX];
    services_bin(bin_, bin, sizeof(bin));
    char *args[12 + 2 * PERF_AGENTS], ids[PERF_AGENTS][32], state[PATH_MAX + 32];
    int64_t since = ks_now_us() - 500000;
    pid_t daemon;
    size_t n = 0;
    int rc;

    snprintf(state, sizeof(state), "%s/agent-%u", st->dir, st->starts);
    args[n++] = (char *)bin;
    args[n++] = "agent";
    for (int i = 0; i < PERF_AGENTS; i++) {
        snprintf(ids[i], sizeof(ids[i]), PERF_AGENT_PREFIX "%d", i);
        args[n++] = "--id";
        args[n++] = ids[i];
    }
    args[n++] = "--label";
    args[n++] = "perf=true";
    args[n++] = "--nats";
    args[n++] = st->nats_url;
    args[n++] = "--state-dir";
    args[n++] = state;
    args[n] = NULL;
    rc = start_daemon(st, "agent", "KSCORE_PERF_WRAP_AGENT", args, &daemon);
    if (rc == 0)
        st->agent_daemon = daemon;
    if (rc == 0)
        rc = wait_agents(st, PERF_AGENT_PREFIX, PERF_AGENTS, since, 60000);
    if (rc) {
        fprintf(stderr, "kscore perf: agent did not start: %s (see %s/agent.log)\n",
                ks_strerror(rc), st->dir);
        return rc;
    }
    st->agent_pid = real_pid(daemon, bin);
    st->agent_up = true;
    return 0;
}

int
perf__services(struct perf_stack *st, const char *bin, unsigned local_agents,
               bool agent, bool restart)
{
    char nla[16], state[PATH_MAX + 32], prefix[80];
    int64_t since;
    pid_t daemon;
    int rc;

    char svc[PATH_MAX];

    if (!restart && strcmp(st->bin, bin) == 0 &&
        st->local_agents == local_agents && st->broker_pid > 0 &&
        pid_alive(st->broker_pid)) {
        if (agent && !st->agent_up)
            return start_agent(st, bin);
        return 0;
    }
    services_bin(bin, svc, sizeof(svc));
    perf__services_stop(st);
    st->starts++;
    snprintf(nla, sizeof(nla), "%u", local_agents);
    snprintf(state, sizeof(state), "%s/local-%u", st->dir, st->starts);
    char *args[] = {svc,              "broker", "--nats",       st->nats_url,
                    "--db",           st->conninfo, "--local-agents", nla,
                    "--state-dir",    state,   NULL};
    since = ks_now_us() - 500000;
    rc = start_daemon(st, "broker", "KSCORE_PERF_WRAP", args, &daemon);
    if (rc == 0)
        st->broker_daemon = daemon;
    if (rc == 0)
        rc = wait_broker(st, daemon, 60000);
    if (rc == 0 && local_agents > 0) {
        snprintf(prefix, sizeof(prefix), "%s-", st->host);
        /* 1,000 durable consumers take a while to create (~1 ms each). */
        rc = wait_agents(st, prefix, local_agents, since,
                         60000 + (int)local_agents * 50);
    }
    if (rc) {
        fprintf(stderr, "kscore perf: broker did not start: %s (see %s/broker.log)\n",
                ks_strerror(rc), st->dir);
        return rc;
    }
    st->broker_pid = real_pid(daemon, svc);
    snprintf(st->bin, sizeof(st->bin), "%s", bin);
    st->local_agents = local_agents;
    if (agent)
        return start_agent(st, bin);
    return 0;
}

void
perf__stack_stop(struct perf_stack *st, bool keep)
{
    const char *keep_env = getenv("KSCORE_KEEP_TMP");
    if (!st->dir[0])
        return;
    perf__services_stop(st);
    if (st->own_nats)
        stack_nats_stop(st->dir);
    if (st->own_pg)
        stack_pg_stop(st->dir);
    if (keep || (keep_env && strcmp(keep_env, "1") == 0))
        fprintf(stderr, "kscore perf: kept %s\n", st->dir);
    else
        perf__rm_tree(st->dir);
    free(st->nats_url);
    free(st->conninfo);
    st->nats_url = st->conninfo = NULL;
    st->dir[0] = '\0';
}
