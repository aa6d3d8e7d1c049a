/*
 * chaos: kscore's fault-injection suite. Each scenario starts a private
 * stack (nats-server, PostgreSQL, a broker, agents), puts load on it, breaks
 * one part for real (kill -9, SIGSTOP, a restart), lets it heal, and then
 * checks the record's invariants I1..I6 (chaos_check.c, README.md).
 *
 *   chaos [--short] [--seed N] [--scenario NAME[,NAME...]] [--keep] [--list]
 *
 * Every random choice (kill points, delays, durations) comes from the seed,
 * drawn before anything timing-dependent happens, so a failure can be
 * replayed with the same seed and scenario. Exit status: 0 when every
 * scenario passed, 1 when one failed, 2 on usage errors.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "chaos.h"
#include "stack.h"

volatile sig_atomic_t chaos_interrupted;

/* ---- small helpers ------------------------------------------------------------ */

void
chaos_sleep_ms(int64_t ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR && !chaos_interrupted)
        ;
}

double
chaos_since_s(int64_t mono_us)
{
    return (double)(ks_mono_us() - mono_us) / 1e6;
}

void
chaos_log(struct chaos_run *r, const char *fmt, ...)
{
    va_list ap;
    printf("  [%6.1fs] ", chaos_since_s(r->t0_mono));
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
}

void
chaos_fail(struct chaos_run *r, const char *fmt, ...)
{
    va_list ap;
    char *slot = r->nfails < sizeof(r->fails) / sizeof(r->fails[0])
                     ? r->fails[r->nfails++]
                     : NULL;
    char line[sizeof(r->fails[0])];
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (slot)
        snprintf(slot, sizeof(r->fails[0]), "%s", line);
    chaos_log(r, "CHECK FAILED: %s", line);
}

static uint64_t
splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

uint64_t
chaos_rand(struct chaos_run *r, uint64_t lo, uint64_t hi)
{
    if (hi <= lo)
        return lo;
    return lo + splitmix(&r->rng) % (hi - lo + 1);
}

double
chaos_randf(struct chaos_run *r, double lo, double hi)
{
    double u = (double)(splitmix(&r->rng) >> 11) / (double)(1ULL << 53);
    return lo + (hi - lo) * u;
}

static long
sql_long(struct chaos_run *r, const char *sql)
{
    PGconn *pg = PQconnectdb(r->st.pg.conninfo);
    long v = -1;
    if (PQstatus(pg) == CONNECTION_OK) {
        PGresult *res = PQexec(pg, sql);
        if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
            !PQgetisnull(res, 0, 0))
            v = atol(PQgetvalue(res, 0, 0));
        PQclear(res);
    }
    PQfinish(pg);
    return v;
}

/* ---- building blocks of the scenarios ----------------------------------------- */

/* One agent process "agent-fleet" serving <prefix>0..<prefix>n-1, which
 * become r->agents. */
static int
fleet_up(struct chaos_run *r, const char *prefix, unsigned n)
{
    const char *ids[CHAOS_MAX_AGENTS];
    for (unsigned i = 0; i < n && i < CHAOS_MAX_AGENTS; i++) {
        snprintf(r->agents[i], sizeof(r->agents[i]), "%s%u", prefix, i);
        ids[i] = r->agents[i];
    }
    r->nagents = n;
    snprintf(r->probe_agent, sizeof(r->probe_agent), "%s", r->agents[0]);
    return chaos_agent_spawn(r, "agent-fleet", ids, n, 32);
}

/* The in-process agents of `kscore broker --local-agents n`. */
static void
local_agents(struct chaos_run *r, unsigned n)
{
    char host[64];
    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    host[strcspn(host, ".")] = '\0';
    for (unsigned i = 0; i < n && i < CHAOS_MAX_AGENTS; i++)
        snprintf(r->agents[i], sizeof(r->agents[i]), "%.50s-%u", host, i);
    r->nagents = n;
    snprintf(r->probe_agent, sizeof(r->probe_agent), "%s", r->agents[0]);
}

/* The scenario's one agent id (also the probe's). */
static void
single_agent(struct chaos_run *r, const char *id)
{
    snprintf(r->agents[0], sizeof(r->agents[0]), "%s", id);
    r->nagents = 1;
    snprintf(r->probe_agent, sizeof(r->probe_agent), "%s", id);
}

/* Waits (at most 20 s) until n commands run on agent. */
static void
wait_running(struct chaos_run *r, const char *agent, long n)
{
    int64_t until = ks_mono_us() + 20 * 1000000LL;
    while (!chaos_interrupted && ks_mono_us() < until &&
           chaos_count_status(r, "Running", agent) < n)
        chaos_sleep_ms(50);
}

/* A scenario that needs a tmpfs, on a host that cannot mount one: skipped,
 * saying so (rc is KS_EUNAVAIL). */
static int
skip_no_tmpfs(struct chaos_run *r, int rc)
{
    snprintf(r->skipped, sizeof(r->skipped),
             "no tmpfs can be mounted here (needs root and CAP_SYS_ADMIN)");
    return rc;
}

static void
set_spec(struct chaos_run *r, uint64_t deliver_ms, uint64_t timeout_ms,
         uint64_t grace_ms)
{
    r->deliver_ms = deliver_ms;
    r->timeout_ms = timeout_ms;
    r->grace_ms = grace_ms;
}

/* kill -9 the broker, keep it down for down_ms, start it again, probe. */
static void
broker_kill_restart(struct chaos_run *r, unsigned local, int64_t down_ms)
{
    fixture_stack_broker_kill(&r->st, SIGKILL);
    chaos_log(r, "broker killed (kill -9); down for %lld ms",
              (long long)down_ms);
    chaos_sleep_ms(down_ms);
    int64_t t0 = ks_mono_us();
    int rc = fixture_stack_broker_start(&r->st, local);
    chaos_log(r, "broker restarted: %s (%.1f s)", rc ? ks_strerror(rc) : "ready",
              chaos_since_s(t0));
    chaos_probe(r, "broker restart", r->probe_agent, t0);
}

/* ---- 1. broker kill -9 in the middle of 200 commands ----------------------------- */

static int
broker_kill_common(struct chaos_run *r, bool local)
{
    size_t n = r->short_mode ? 60 : 200;
    int rc;

    set_spec(r, r->short_mode ? 10000 : 15000, r->short_mode ? 10000 : 20000,
             1000);
    r->rate = r->short_mode ? 30 : 40;
    long kill_at = (long)chaos_rand(r, n / 4, n * 7 / 10);
    int64_t extra_ms = (int64_t)chaos_rand(r, 0, 300);
    int64_t down_ms = (int64_t)chaos_rand(r, 0, 1500);

    if ((rc = chaos_stack_up(r, local ? 10 : 0)))
        return rc;
    if (local) {
        local_agents(r, 10);
        /* The in-process agents share one slot pool (the broker process's
         * capacity), and after a kill -9 their backlog is handed back:
         * a probe behind it would measure the queue, not the control
         * plane. I6 is probed on an agent process of its own, idle. */
        static const char *const probe_ids[] = {"probe"};
        if ((rc = chaos_agent_spawn(r, "agent-probe", probe_ids, 1, 4)))
            return rc;
        snprintf(r->probe_agent, sizeof(r->probe_agent), "probe");
    } else if ((rc = fleet_up(r, "f", 10)))
        return rc;
    chaos_subs_prepare(r, n, 0.2, 1.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands at %.0f/s over %u %s agents; kill -9 the broker "
             "at %ld accepted +%lld ms, down %lld ms",
             n, r->rate, r->nagents, local ? "in-process" : "process",
             kill_at, (long long)extra_ms, (long long)down_ms);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, kill_at);
    chaos_sleep_ms(extra_ms);
    chaos_log(r, "%ld accepted, %ld running", (long)r->accepted,
              chaos_count_status(r, "Running", NULL));
    broker_kill_restart(r, local ? 10 : 0, down_ms);
    return 0;
}

static int
sc_broker_kill(struct chaos_run *r)
{
    return broker_kill_common(r, false);
}

static int
sc_broker_kill_local(struct chaos_run *r)
{
    return broker_kill_common(r, true);
}

/* ---- 2. agent kill -9 while it runs 20 commands ------------------------------------ */

static int
agent_kill_common(struct chaos_run *r, int64_t down_ms)
{
    size_t n = r->short_mode ? 10 : 20;
    const char *ids[] = {"ak"};
    int rc;

    set_spec(r, 30000, 30000, 1000);
    r->rate = 0;
    long kill_running = (long)chaos_rand(r, 1, n);
    int64_t extra_ms = (int64_t)chaos_rand(r, 0, 1500);

    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    single_agent(r, "ak");
    if ((rc = chaos_agent_spawn(r, "agent-0", ids, 1, 32)))
        return rc;
    chaos_subs_prepare(r, n, 2.0, 10.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands (sleep 2-10 s) on agent ak; kill -9 it once %ld "
             "run, +%lld ms; restart it %lld s later",
             n, kill_running, (long long)extra_ms,
             (long long)(down_ms / 1000));
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    int64_t until = ks_mono_us() + 20 * 1000000LL;
    long running = 0;
    while (!chaos_interrupted && ks_mono_us() < until &&
           (running = chaos_count_status(r, "Running", "ak")) < kill_running)
        chaos_sleep_ms(50);
    chaos_sleep_ms(extra_ms);
    running = chaos_count_status(r, "Running", "ak");
    fixture_stack_signal(&r->st, "agent-0", SIGKILL);
    chaos_log(r, "agent killed (kill -9) with %ld Running, %ld Dispatched",
              running, chaos_count_status(r, "Dispatched", "ak"));
    chaos_sleep_ms(down_ms);
    int64_t t0 = ks_mono_us();
    rc = chaos_agent_spawn(r, "agent-0", ids, 1, 32);
    chaos_log(r, "agent restarted: %s", rc ? ks_strerror(rc) : "heartbeating");
    chaos_probe(r, "agent restart", "ak", t0);
    return 0;
}

static int
sc_agent_kill_5s(struct chaos_run *r)
{
    return agent_kill_common(r, 5000);
}

static int
sc_agent_kill_15s(struct chaos_run *r)
{
    return agent_kill_common(r, 15000);
}

/* ---- 3. nats-server stopped for 5 s ------------------------------------------------- */

static int
nats_common(struct chaos_run *r, bool kill_it)
{
    size_t n = r->short_mode ? 60 : 200;
    int rc;

    set_spec(r, r->short_mode ? 15000 : 20000, r->short_mode ? 10000 : 20000,
             1000);
    r->rate = r->short_mode ? 12 : 25;
    long at = (long)chaos_rand(r, n / 5, n / 2);
    int64_t extra_ms = (int64_t)chaos_rand(r, 0, 300);

    if ((rc = chaos_stack_up(r, 0)) || (rc = fleet_up(r, "n", 4)))
        return rc;
    chaos_subs_prepare(r, n, 0.2, 1.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands at %.0f/s over 4 agents; %s nats-server for 5 s "
             "at %ld accepted +%lld ms",
             n, r->rate, kill_it ? "kill -9 (then restart on the same port)"
                                 : "SIGSTOP (then SIGCONT)",
             at, (long long)extra_ms);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, at);
    chaos_sleep_ms(extra_ms);
    long running = chaos_count_status(r, "Running", NULL);
    int64_t t0;
    if (kill_it) {
        fixture_stack_nats_kill(&r->st, SIGKILL);
        chaos_log(r, "nats-server killed (kill -9), %ld running", running);
        chaos_sleep_ms(5000);
        t0 = ks_mono_us();
        rc = fixture_stack_nats_start(&r->st);
        chaos_log(r, "nats-server restarted: %s",
                  rc ? ks_strerror(rc) : "listening");
        chaos_probe(r, "nats-server restart", r->probe_agent, t0);
    } else {
        fixture_stack_nats_kill(&r->st, SIGSTOP);
        chaos_log(r, "nats-server stopped (SIGSTOP), %ld running", running);
        chaos_sleep_ms(5000);
        fixture_stack_nats_kill(&r->st, SIGCONT);
        t0 = ks_mono_us();
        chaos_log(r, "nats-server continued (SIGCONT)");
        chaos_probe(r, "nats-server SIGCONT", r->probe_agent, t0);
    }
    return 0;
}

static int
sc_nats_pause(struct chaos_run *r)
{
    return nats_common(r, false);
}

static int
sc_nats_kill(struct chaos_run *r)
{
    return nats_common(r, true);
}

/* ---- 4. PostgreSQL restart in the middle of 100 submissions ------------------------- */

/* The PostgreSQL scenarios' setting: n submissions at 15/s (20 full) over
 * nagents agents p0, p1, ... of one process, commands of min_s..max_s;
 * *at_out: after how many accepted the fault comes (a quarter to 60 %). */
static int
pg_scenario_up(struct chaos_run *r, size_t n, unsigned nagents, double min_s,
               double max_s, long *at_out)
{
    int rc;
    set_spec(r, r->short_mode ? 15000 : 20000, r->short_mode ? 10000 : 20000,
             1000);
    r->rate = r->short_mode ? 15 : 20;
    *at_out = (long)chaos_rand(r, n / 4, n * 6 / 10);
    if ((rc = chaos_stack_up(r, 0)) || (rc = fleet_up(r, "p", nagents)))
        return rc;
    chaos_subs_prepare(r, n, min_s, max_s);
    return 0;
}

static int
sc_pg_restart(struct chaos_run *r)
{
    size_t n = r->short_mode ? 50 : 100;
    int rc;

    long at;
    if ((rc = pg_scenario_up(r, n, 2, 0.2, 0.6, &at)))
        return rc;
    int64_t extra_ms = (int64_t)chaos_rand(r, 0, 300);
    snprintf(r->note, sizeof(r->note),
             "%zu submissions at %.0f/s over 2 agents; PostgreSQL restart "
             "-m fast at %ld accepted +%lld ms",
             n, r->rate, at, (long long)extra_ms);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, at);
    chaos_sleep_ms(extra_ms);
    int64_t t0 = ks_mono_us();
    rc = fixture_pg_restart(&r->st.pg);
    chaos_log(r, "PostgreSQL restarted (-m fast): %s (%.1f s)",
              rc ? ks_strerror(rc) : "accepting connections",
              chaos_since_s(t0));
    chaos_probe(r, "PostgreSQL restart", r->probe_agent, t0);
    return 0;
}

/* ---- 4b. PostgreSQL refuses writes for 8-12 s in the middle of 100 submissions ------- */

/*
 * Makes every new session of the database read-only (as its owner, the
 * role kscore may: ALTER DATABASE ... SET default_transaction_read_only),
 * or writable again, and ends the role's other sessions so the broker's
 * reconnect and take it. The database's answer is 25006, as a full disk's
 * is 53100: up, reachable, refusing writes (issue 25). 0, or -1 with the
 * error logged.
 */
static int
pg_read_only(struct chaos_run *r, bool on)
{
    PGconn *pg = PQconnectdb(r->st.pg.conninfo);
    char sql[256];
    int rc = -1;

    if (PQstatus(pg) != CONNECTION_OK)
        goto out;
    PGresult *res = PQexec(pg, "SET default_transaction_read_only = off;"
                               " SELECT current_database()");
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        PQclear(res);
        goto out;
    }
    snprintf(sql, sizeof(sql),
             "ALTER DATABASE \"%s\" %s default_transaction_read_only%s",
             PQgetvalue(res, 0, 0), on ? "SET" : "RESET", on ? " = on" : "");
    PQclear(res);
    res = PQexec(pg, sql);
    bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    PQclear(res);
    if (!ok)
        goto out;
    res = PQexec(pg, "SELECT count(pg_terminate_backend(pid))"
                     " FROM pg_stat_activity"
                     " WHERE datname = current_database()"
                     "   AND usename = current_user"
                     "   AND backend_type = 'client backend'"
                     "   AND pid <> pg_backend_pid()");
    ok = PQresultStatus(res) == PGRES_TUPLES_OK;
    PQclear(res);
    rc = ok ? 0 : -1;
out:
    if (rc)
        chaos_log(r, "cannot make PostgreSQL %s: %s",
                  on ? "read-only" : "writable", PQerrorMessage(pg));
    PQfinish(pg);
    return rc;
}

static int
sc_pg_readonly(struct chaos_run *r)
{
    size_t n = r->short_mode ? 50 : 100;
    int rc;

    long at;
    /* Long enough that many end while writes are refused. */
    if ((rc = pg_scenario_up(r, n, 2, 0.5, 3.0, &at)))
        return rc;
    int64_t fault_ms = (int64_t)chaos_rand(r, 8000, 12000);
    snprintf(r->note, sizeof(r->note),
             "%zu submissions at %.0f/s over 2 agents; PostgreSQL refuses "
             "writes (read-only, 25006) for %lld ms from %ld accepted",
             n, r->rate, (long long)fault_ms, at);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, at);
    if ((rc = pg_read_only(r, true)))
        return rc;
    chaos_log(r, "PostgreSQL refuses writes; %ld accepted, %ld running",
              (long)r->accepted, chaos_count_status(r, "Running", NULL));
    chaos_sleep_ms(fault_ms);
    int64_t t0 = ks_mono_us();
    chaos_log(r, "%ld running while writes are refused; taking writes again",
              chaos_count_status(r, "Running", NULL));
    if ((rc = pg_read_only(r, false)))
        return rc;
    chaos_probe(r, "PostgreSQL takes writes again", r->probe_agent, t0);
    return 0;
}

/* ---- 4c. the events table's disk full (fleet case F06) -------------------------------- */

/* Asks for a new command while the disk is full until one is refused:
 * a few appends still find room (dead rows of failed appends that pruning
 * gives back), and are recorded, truthfully. */
#define PG_FULL_ASKS 20

/*
 * New requests while the record refuses writes: a refused one is refused
 * at once (the reply's time, in-process: one failed commit, no process
 * start), naming SQLSTATE 53100 disk_full, and `kscore exec` exits 125
 * saying "not recorded" (69, outcome unknown, is truthful too). Every ask
 * is a side-effect command: one that is accepted counts like any other.
 * A failed check is the scenario's own violation.
 */
static void
pg_full_refusal(struct chaos_run *r)
{
    struct evt_connect_opts o = {.name = "chaos-refusal", .send_asap = true,
                                 .nkey_file = chaos_nkey(r)};
    struct evt_conn *c = NULL;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char script[PATH_MAX + 128];
    char *argv[] = {"sh", "-c", script};
    double s = -1;
    int asked = 0, rc;

    chaos_script(r, 0, script, sizeof(script));
    spec.argv = argv;
    spec.n_argv = 3;
    req.agent_id = r->agents[0];
    req.spec = &spec;
    req.detach = 1;
    /* Its agent's slots are full of the scenario's sleeps: with no
     * deadline of its own the request would be refused as busy before
     * the record is asked (admit.c), and this asks the record. */
    req.deliver_within_ms = 600000;
    if ((rc = evt_connect(r->st.nats.url, &o, &c, NULL))) {
        chaos_fail(r, "cannot connect: %s", ks_strerror(rc));
        return;
    }
    for (; asked < PG_FULL_ASKS; asked++) {
        Ks__ExecuteReply *rep = NULL;
        int64_t t0 = ks_mono_us();
        rc = broker_execute(c, &req, 10000, &rep);
        s = chaos_since_s(t0);
        if (rc) {
            chaos_fail(r, "a request while the disk is full: %s",
                       ks_strerror(rc));
            break;
        }
        if (!rep->error_code) {
            ks__execute_reply__free_unpacked(rep, NULL);
            continue; /* it found room: recorded, and it runs */
        }
        if (!strstr(rep->error, "53100") || !strstr(rep->error, "disk_full"))
            chaos_fail(r, "the refusal names no disk_full (53100): %s",
                       rep->error);
        else if (s > 1.0)
            chaos_fail(r, "refused after %.2f s, not at once", s);
        else
            chaos_log(r, "ask %d refused in %.3f s: %s", asked + 1, s,
                      rep->error);
        ks__execute_reply__free_unpacked(rep, NULL);
        break;
    }
    evt_close(c);
    if (asked == PG_FULL_ASKS)
        chaos_fail(r, "%d requests while the disk is full, none refused",
                   PG_FULL_ASKS);

    /* Detached: one that finds room is not waited for (its end waits for
     * the space). */
    const char *args[] = {"exec", "--detach", "--deliver-within", "10m",
                          "--agent", r->agents[0], "--", "sh", "-c", script,
                          NULL};
    struct fixture_out out = {0};
    for (asked = 0; asked < PG_FULL_ASKS; asked++) {
        fixture_out_release(&out);
        if (fixture_kscore(&r->st, args, &out) != 0 || out.status != 0)
            break;
    }
    if (asked == PG_FULL_ASKS)
        chaos_fail(r, "%d kscore exec while the disk is full, none refused",
                   PG_FULL_ASKS);
    else if (!(out.status == 125 && strstr(out.err, "not recorded")) &&
             out.status != 69)
        chaos_fail(r, "kscore exec while the disk is full: exit %d: %s",
                   out.status, out.err);
    else
        chaos_log(r, "kscore exec exits %d", out.status);
    fixture_out_release(&out);
}

/*
 * Fleet case F06 (Sentry's primary refusing writes): the events table on a
 * 32 MiB tmpfs tablespace, filled while 50 execs and a batch of 20 run;
 * the space stays gone (15 s short, 2 minutes full), then is freed. New
 * requests are refused at once naming 53100 disk_full; the results the
 * agents publish meanwhile wait (never given up on at the consumer's max
 * deliveries) and are recorded after, each command once. I3's deadlines
 * count the fault's time as not passed: nothing can end in a record that
 * takes no writes.
 */
static int
sc_pg_full(struct chaos_run *r)
{
    size_t n = 50;
    unsigned nagents = 20;
    int rc;

    long at;
    if ((rc = pg_scenario_up(r, n, nagents, 1.0, 4.0, &at)))
        return rc;
    int64_t fault_ms = r->short_mode ? 15000 : 120000;
    rc = fixture_pg_small_disk(&r->st.pg, 32);
    if (rc == KS_EUNAVAIL)
        return skip_no_tmpfs(r, rc);
    if (rc)
        return KS_EUNAVAIL;
    snprintf(r->note, sizeof(r->note),
             "%zu submissions at %.0f/s over %u agents and a batch of %u; "
             "the events table's disk (a 32 MiB tmpfs) full for %lld ms "
             "from %ld accepted",
             n, r->rate, nagents, nagents, (long long)fault_ms, at);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    const char *ids[CHAOS_MAX_AGENTS];
    for (unsigned i = 0; i < r->nagents; i++)
        ids[i] = r->agents[i];
    if ((rc = chaos_batch_submit(r, ids, r->nagents, 5, 2.0)))
        chaos_log(r, "the batch was refused: %s", ks_strerror(rc));
    chaos_wait_accepted(r, at);
    int64_t t0 = ks_mono_us();
    if (fixture_pg_fill_disk(&r->st.pg) != 0)
        return KS_EUNAVAIL;
    chaos_log(r, "the disk is full (%.1f s to fill); %ld accepted, %ld "
                 "running",
              chaos_since_s(t0), (long)r->accepted,
              chaos_count_status(r, "Running", NULL));
    pg_full_refusal(r);
    chaos_sleep_ms(fault_ms - (ks_mono_us() - t0) / 1000);
    chaos_log(r, "%ld running while the disk is full; freeing it",
              chaos_count_status(r, "Running", NULL));
    if (fixture_pg_free_disk(&r->st.pg) != 0)
        chaos_fail(r, "cannot free the disk");
    r->refused_us = ks_mono_us() - t0;
    chaos_probe(r, "the disk is free", r->probe_agent, ks_mono_us());
    return 0;
}

/* ---- 4d. an agent's state dir full, then a crash ------------------------------------- */

/*
 * The agent's state dir (journal, outbox) on a 2 MiB tmpfs, filled while 4
 * or more of its commands run; 3 s later kill -9 the agent (issue 25: its
 * journal knew 2 of 6 running commands, the other 4 stayed Running for
 * 12-15 min); free the space and start it again (same state dir) 2 s
 * after. Claims it cannot journal are refused meanwhile; every command
 * ends once, within I3.
 */
static int
sc_agent_disk_full(struct chaos_run *r)
{
    size_t n = r->short_mode ? 16 : 40;
    const char *ids[] = {"adf"};
    char state[PATH_MAX + 32], fill[PATH_MAX + 48];
    int rc;

    set_spec(r, 30000, 30000, 1000);
    r->rate = 4;
    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    single_agent(r, "adf");
    snprintf(state, sizeof(state), "%s/state-agent-0", r->st.dir);
    snprintf(fill, sizeof(fill), "%s/fill", state);
    rc = chaos_mount_small(r, state, 2);
    if (rc == KS_EUNAVAIL)
        return skip_no_tmpfs(r, rc);
    if (rc || (rc = chaos_agent_spawn(r, "agent-0", ids, 1, 8)))
        return rc;
    chaos_subs_prepare(r, n, 2.0, 6.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands (sleep 2-6 s) at %.0f/s on agent adf (8 slots); "
             "its state dir (a 2 MiB tmpfs) fills once 4 run, kill -9 the "
             "agent 3 s later, free it and restart the agent 2 s after",
             n, r->rate);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    wait_running(r, "adf", 4);
    /* Fill: write until the disk says no more. */
    FILE *f = fopen(fill, "w");
    static char block[64 * 1024];
    size_t written = 0;
    while (f && fwrite(block, 1, sizeof(block), f) == sizeof(block))
        written += sizeof(block);
    if (f)
        fclose(f); /* ENOSPC: the last block did not fit */
    chaos_log(r, "state dir full (%zu KiB written); %ld running",
              written / 1024, chaos_count_status(r, "Running", "adf"));
    chaos_sleep_ms(3000);
    fixture_stack_signal(&r->st, "agent-0", SIGKILL);
    chaos_log(r, "agent killed (kill -9) with its state dir full; %ld "
                 "running in the record",
              chaos_count_status(r, "Running", "adf"));
    unlink(fill);
    chaos_sleep_ms(2000);
    int64_t t0 = ks_mono_us();
    if ((rc = chaos_agent_spawn(r, "agent-0", ids, 1, 8)))
        return rc;
    chaos_log(r, "agent restarted (the space is back)");
    chaos_serving_again(r, "agent restart", "adf", t0);
    return 0;
}

/* ---- 4e. an agent started with SIGCHLD ignored and TERM blocked ---------------------- */

/* The launcher (this binary, --exec-odd-signals): the state a careless
 * parent leaves. */
static int
odd_signals_exec(char **argv)
{
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    signal(SIGCHLD, SIG_IGN);
    sigprocmask(SIG_BLOCK, &term, NULL);
    execv(argv[0], argv);
    fprintf(stderr, "chaos: exec %s: %s\n", argv[0], strerror(errno));
    return 127;
}

/*
 * The agent started by a parent that ignores SIGCHLD (the kernel then
 * reaps children itself: waitid fails with ECHILD) and blocks TERM (issue
 * 25: no result for 12 minutes, the agent spinning in waitid, deaf to
 * TERM). Commands run, some past their timeout (the kill protocol); half
 * way the agent gets TERM and must stop within 20 s; it is started the
 * same way again. Every command ends once, within I3.
 */
static int
sc_agent_sigchld_ignored(struct chaos_run *r)
{
    size_t n = r->short_mode ? 24 : 80;
    const char *ids[] = {"sig"};
    char self[PATH_MAX];
    int rc;

    ssize_t l = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (l <= 0)
        return -errno;
    self[l] = '\0';
    const char *launcher[] = {self, "--exec-odd-signals", NULL};
    /* Commands of 0.5-4 s with a 3 s timeout: some end by the kill
     * protocol. */
    set_spec(r, 30000, 3000, 1000);
    r->rate = 6;
    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    single_agent(r, "sig");
    if ((rc = chaos_agent_spawn_via(r, "agent-0", ids, 1, 8, launcher)))
        return rc;
    chaos_subs_prepare(r, n, 0.5, 4.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands (sleep 0.5-4 s, timeout 3 s) at %.0f/s on agent "
             "sig, started with SIGCHLD ignored and TERM blocked; TERM it "
             "half way, start it the same way again",
             n, r->rate);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, (long)n / 2);
    int64_t t0 = ks_mono_us();
    fixture_stack_signal(&r->st, "agent-0", SIGTERM);
    while (!chaos_interrupted && chaos_since_s(t0) < 20 &&
           stack_pidfile_alive(r->st.dir, "agent-0", NULL))
        chaos_sleep_ms(100);
    if (stack_pidfile_alive(r->st.dir, "agent-0", NULL)) {
        chaos_fail(r, "the agent did not stop within 20 s of SIGTERM (its "
                      "parent blocked TERM)");
        fixture_stack_signal(&r->st, "agent-0", SIGKILL);
    } else {
        chaos_log(r, "the agent stopped %.1f s after SIGTERM",
                  chaos_since_s(t0));
    }
    chaos_sleep_ms(1000);
    t0 = ks_mono_us();
    if ((rc = chaos_agent_spawn_via(r, "agent-0", ids, 1, 8, launcher)))
        return rc;
    chaos_serving_again(r, "agent restart", "sig", t0);
    return 0;
}

/* ---- 5. broker kill -9 in the middle of a batch over 10 agents ------------------------ */

static int
sc_batch_broker_kill(struct chaos_run *r)
{
    unsigned nb = r->short_mode ? 2 : 3;
    unsigned conc[CHAOS_MAX_BATCHES];
    double sleep_s[CHAOS_MAX_BATCHES];
    int rc;

    /* Each batch runs in a few rounds of 1-2 s, so the kill lands in the
     * middle of one; a stuck batch costs its rounds' deadlines (I4). */
    if (r->short_mode)
        set_spec(r, 5000, 5000, 1000);
    else
        set_spec(r, 10000, 10000, 1000);
    for (unsigned i = 0; i < nb; i++) {
        conc[i] = (unsigned)(r->short_mode ? 5 : chaos_rand(r, 2, 5));
        sleep_s[i] = chaos_randf(r, 1.0, 2.0);
    }
    long kill_ended = (long)chaos_rand(r, 1, nb * 10 / 2);
    int64_t extra_ms = (int64_t)chaos_rand(r, 0, 500);
    int64_t down_ms = (int64_t)chaos_rand(r, 0, 1500);

    if ((rc = chaos_stack_up(r, 0)) || (rc = fleet_up(r, "f", 10)))
        return rc;
    const char *ids[CHAOS_MAX_AGENTS];
    for (unsigned i = 0; i < r->nagents; i++)
        ids[i] = r->agents[i];
    size_t off = (size_t)snprintf(r->note, sizeof(r->note),
                                  "%u batches over 10 agents (concurrency",
                                  nb);
    for (unsigned i = 0; i < nb; i++)
        off += (size_t)snprintf(r->note + off, sizeof(r->note) - off, " %u",
                                conc[i]);
    snprintf(r->note + off, sizeof(r->note) - off,
             "); kill -9 the broker once %ld targets succeeded, +%lld ms; "
             "down %lld ms",
             kill_ended, (long long)extra_ms, (long long)down_ms);
    chaos_log(r, "%s", r->note);
    for (unsigned i = 0; i < nb; i++) {
        rc = chaos_batch_submit(r, ids, r->nagents, conc[i], sleep_s[i]);
        if (rc)
            chaos_log(r, "batch %u refused: %s", i, ks_strerror(rc));
    }
    int64_t until = ks_mono_us() + 30 * 1000000LL;
    while (!chaos_interrupted && ks_mono_us() < until &&
           sql_long(r, "SELECT count(*) FROM commands WHERE batch_id IS NOT "
                       "NULL AND status = 'Succeeded'") < kill_ended)
        chaos_sleep_ms(50);
    chaos_sleep_ms(extra_ms);
    chaos_log(r, "%ld targets running, %ld succeeded",
              chaos_count_status(r, "Running", NULL),
              chaos_count_status(r, "Succeeded", NULL));
    broker_kill_restart(r, 0, down_ms);
    return 0;
}

/* ---- 5b. pauses: the broker, or a whole agent host, frozen ---------------------------- */

/*
 * SIGSTOP the broker past an agent's TTL while its agents run commands,
 * then SIGCONT: no agent was silent, so no command may end Lost
 * (forbid_lost), and every command ends once.
 */
static int
sc_broker_pause(struct chaos_run *r)
{
    size_t n = r->short_mode ? 40 : 120;
    int rc;

    set_spec(r, 30000, 30000, 1000);
    r->rate = r->short_mode ? 8 : 12;
    r->forbid_lost = true;
    int64_t pause_ms = (int64_t)chaos_rand(r, 12000, 16000);
    if ((rc = chaos_stack_up(r, 0)) || (rc = fleet_up(r, "bp", 4)))
        return rc;
    chaos_subs_prepare(r, n, 2.0, 8.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands (sleep 2-8 s) at %.0f/s over 4 agents; SIGSTOP "
             "the broker for %lld ms once a third are accepted",
             n, r->rate, (long long)pause_ms);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_wait_accepted(r, (long)n / 3);
    chaos_log(r, "%ld accepted, %ld running: broker stopped", (long)r->accepted,
              chaos_count_status(r, "Running", NULL));
    fixture_stack_broker_kill(&r->st, SIGSTOP);
    chaos_sleep_ms(pause_ms);
    fixture_stack_broker_kill(&r->st, SIGCONT);
    int64_t t0 = ks_mono_us();
    chaos_log(r, "broker continued (SIGCONT)");
    chaos_probe(r, "broker SIGCONT", r->probe_agent, t0);
    return 0;
}

/*
 * A whole agent host frozen (the agent, its watchdog and its commands
 * stopped together, as a paused VM) past the brokers' TTL, then thawed:
 * its running commands are recorded Lost, and the agent stops them at
 * SIGCONT; each command ends once, nothing runs twice.
 */
static int
sc_host_freeze(struct chaos_run *r)
{
    size_t n = r->short_mode ? 12 : 30;
    const char *ids[] = {"hf"};
    int rc;

    set_spec(r, 30000, 40000, 1000);
    r->rate = 0;
    int64_t freeze_ms = (int64_t)chaos_rand(r, 12000, 15000);
    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    single_agent(r, "hf");
    if ((rc = chaos_agent_spawn(r, "agent-0", ids, 1, 8)))
        return rc;
    chaos_subs_prepare(r, n, 4.0, 20.0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands (sleep 4-20 s) on agent hf (8 slots); freeze the "
             "agent, its watchdog and its commands for %lld ms once 4 run",
             n, (long long)freeze_ms);
    chaos_log(r, "%s", r->note);
    if ((rc = chaos_submit_start(r)))
        return rc;
    wait_running(r, "hf", 4);
    chaos_log(r, "%ld running: host frozen",
              chaos_count_status(r, "Running", "hf"));
    fixture_stack_signal_tree(&r->st, "agent-0", SIGSTOP);
    chaos_sleep_ms(freeze_ms);
    fixture_stack_signal_tree(&r->st, "agent-0", SIGCONT);
    int64_t t0 = ks_mono_us();
    chaos_log(r, "host thawed (SIGCONT): %ld Lost",
              chaos_count_status(r, "Lost", "hf"));
    chaos_serving_again(r, "host thaw", "hf", t0);
    return 0;
}

/* ---- 6. bursts: 5,000 to one agent; 2,000 queued while it is stopped ------------------- */

static int
sc_burst(struct chaos_run *r)
{
    size_t n = r->short_mode ? 1000 : 5000;
    const char *ids[] = {"burst"};
    int rc;

    set_spec(r, r->short_mode ? 60000 : 120000, r->short_mode ? 10000 : 20000,
             1000);
    r->rate = 0;
    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    snprintf(r->agents[0], sizeof(r->agents[0]), "burst");
    r->nagents = 1;
    if ((rc = chaos_agent_spawn(r, "agent-0", ids, 1, 0)))
        return rc;
    chaos_subs_prepare(r, n, 0, 0);
    snprintf(r->note, sizeof(r->note),
             "%zu commands as fast as %d clients can submit, to one agent", n,
             CHAOS_SUBMITTERS);
    chaos_log(r, "%s", r->note);
    int64_t t0 = ks_mono_us();
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_submit_join(r);
    chaos_log(r, "%ld of %zu accepted in %.1f s", (long)r->accepted, n,
              chaos_since_s(t0));
    return 0;
}

static int
sc_queued_stopped(struct chaos_run *r)
{
    size_t n = r->short_mode ? 500 : 2000;
    const char *ids[] = {"q"};
    int rc;

    set_spec(r, r->short_mode ? 60000 : 120000, r->short_mode ? 10000 : 20000,
             1000);
    r->rate = 0;
    int64_t stop_ms = (int64_t)chaos_rand(r, 3000, 6000);
    if ((rc = chaos_stack_up(r, 0)))
        return rc;
    snprintf(r->agents[0], sizeof(r->agents[0]), "q");
    r->nagents = 1;
    if ((rc = chaos_agent_spawn(r, "agent-0", ids, 1, 0)))
        return rc;
    chaos_subs_prepare(r, n, 0, 0);
    snprintf(r->note, sizeof(r->note),
             "agent q stopped (SIGSTOP); %zu commands queued to it; SIGCONT "
             "%lld ms after the stop (or once all are submitted)",
             n, (long long)stop_ms);
    chaos_log(r, "%s", r->note);
    fixture_stack_signal(&r->st, "agent-0", SIGSTOP);
    int64_t t_stop = ks_mono_us();
    if ((rc = chaos_submit_start(r)))
        return rc;
    chaos_submit_join(r);
    chaos_log(r, "%ld of %zu accepted", (long)r->accepted, n);
    chaos_sleep_ms(stop_ms - (ks_mono_us() - t_stop) / 1000);
    fixture_stack_signal(&r->st, "agent-0", SIGCONT);
    int64_t t0 = ks_mono_us();
    chaos_log(r, "agent continued (SIGCONT) after %.1f s",
              chaos_since_s(t_stop));
    /* Serving again: its first claim after SIGCONT (a probe would queue
     * behind the backlog, which is not a fault). */
    double s = -1;
    while (!chaos_interrupted && chaos_since_s(t0) < 30) {
        if (sql_long(r, "SELECT count(*) FROM events WHERE type = "
                        "'CommandStarted'") > 0) {
            s = chaos_since_s(t0);
            break;
        }
        chaos_sleep_ms(50);
    }
    chaos_add_recovery(r, "agent SIGCONT (first claim)", s);
    return 0;
}

/* ---- 7. the cluster stack (kscore up --cluster 3): a node or a broker dies ---------- */

/* Agent ids of the cluster scenarios: full 5 batches over 200 ids (1,000
 * targets), short 4 over 50 (200): every target of a batch is another
 * agent id, and each id costs the cluster a replicated consumer. */
#define CLUSTER_IDS_MAX 200

struct cluster_load {
    char ids[CLUSTER_IDS_MAX][16];
    const char *idp[CLUSTER_IDS_MAX];
    unsigned n, nb, conc;
    long total, kill_at;
    int64_t down_ms;
};

static int
cluster_setup(struct chaos_run *r, struct cluster_load *l)
{
    l->n = r->short_mode ? 50 : CLUSTER_IDS_MAX;
    l->nb = r->short_mode ? 4 : 5;
    l->conc = r->short_mode ? 25 : 50;
    l->total = (long)l->n * l->nb;
    /* deliver-within long enough to outlast an election and a restart */
    set_spec(r, 30000, 10000, 1000);
    l->kill_at = (long)chaos_rand(r, (uint64_t)l->total / 5,
                                  (uint64_t)l->total * 3 / 5);
    l->down_ms = (int64_t)chaos_rand(r, 1000, r->short_mode ? 3000 : 5000);
    for (unsigned i = 0; i < l->n; i++) {
        snprintf(l->ids[i], sizeof(l->ids[i]), "c-%u", i);
        l->idp[i] = l->ids[i];
    }
    return chaos_cluster_up(r, l->ids, l->n);
}

/* Submits the batches (`sh -c 'echo $$ >> side'`, as /bin/true with a
 * side effect) and waits until kill_at targets succeeded. */
static void
cluster_load_to_kill_point(struct chaos_run *r, struct cluster_load *l)
{
    for (unsigned i = 0; i < l->nb; i++) {
        int rc = chaos_batch_submit(r, l->idp, l->n, l->conc, 0);
        if (rc)
            chaos_log(r, "batch %u refused: %s", i, ks_strerror(rc));
    }
    int64_t until = ks_mono_us() + 60 * 1000000LL;
    while (!chaos_interrupted && ks_mono_us() < until &&
           sql_long(r, "SELECT count(*) FROM commands WHERE batch_id IS NOT "
                       "NULL AND status = 'Succeeded'") < l->kill_at)
        chaos_sleep_ms(20);
    chaos_log(r, "%ld targets running, %ld succeeded",
              chaos_count_status(r, "Running", NULL),
              chaos_count_status(r, "Succeeded", NULL));
}

static void
wait_pid_gone(pid_t pid)
{
    for (int i = 0; i < 500 && kill(pid, 0) == 0; i++)
        chaos_sleep_ms(10);
}

/* `kscore up` after down_ms; the recovery probe. */
static void
cluster_restart(struct chaos_run *r, const char *what, int64_t down_ms)
{
    chaos_sleep_ms(down_ms);
    int64_t t0 = ks_mono_us();
    int rc = chaos_cluster_restart(r);
    chaos_log(r, "kscore up: %s (%.1f s)", rc ? "failed" : "restarted it",
              chaos_since_s(t0));
    chaos_probe(r, what, r->probe_agent, t0);
}

/* The broker that drives the first batch ("broker-1" or "-2" into name):
 * its lease's owner is "<host>/<pid>/<uuid>". Its pid, or <= 0 when the
 * owner is unknown (name is then broker-1). */
static long
lease_owner(struct chaos_run *r, char *name, size_t len)
{
    char sql[256];
    snprintf(name, len, "broker-1");
    snprintf(sql, sizeof(sql),
             "SELECT split_part(owner, '/', 2)::int FROM batch_leases WHERE "
             "batch_id = '%s' AND owner <> ''",
             r->nbatches ? r->batches[0].id : "");
    long owner = sql_long(r, sql);
    for (int i = 1; i <= 2; i++) {
        char n[16];
        pid_t p = 0;
        snprintf(n, sizeof(n), "broker-%d", i);
        if (stack_pidfile_alive(r->st.dir, n, &p) && p == (pid_t)owner)
            snprintf(name, len, "%s", n);
    }
    return owner;
}

static int
sc_cluster_node_kill(struct chaos_run *r)
{
    struct cluster_load *l = calloc(1, sizeof(*l));
    int rc;
    if (!l)
        return -ENOMEM;
    int victim = (int)chaos_rand(r, 1, 3);
    if ((rc = cluster_setup(r, l)))
        goto out;
    snprintf(r->note, sizeof(r->note),
             "%u batches of %u targets (concurrency %u) on 3 nodes, 2 "
             "brokers; kill -9 nats-%d once %ld targets succeeded; `kscore "
             "up` %lld ms later",
             l->nb, l->n, l->conc, victim, l->kill_at,
             (long long)l->down_ms);
    chaos_log(r, "%s", r->note);
    cluster_load_to_kill_point(r, l);
    char dir[PATH_MAX + 32];
    pid_t pid = 0;
    snprintf(dir, sizeof(dir), "%.4000s/nats-%d", r->st.dir, victim);
    if (stack_pidfile_alive(dir, "nats", &pid)) {
        kill(pid, SIGKILL);
        r->fault_us = ks_now_us();
        wait_pid_gone(pid);
        chaos_log(r, "nats-%d killed (kill -9, pid %d)", victim, (int)pid);
    }
    cluster_restart(r, "nats node restart", l->down_ms);
out:
    free(l);
    return rc;
}

static int
sc_cluster_broker_kill(struct chaos_run *r)
{
    struct cluster_load *l = calloc(1, sizeof(*l));
    int rc;
    if (!l)
        return -ENOMEM;
    if ((rc = cluster_setup(r, l)))
        goto out;
    snprintf(r->note, sizeof(r->note),
             "%u batches of %u targets (concurrency %u) on 3 nodes, 2 "
             "brokers; kill -9 the broker that drives the first batch once "
             "%ld targets succeeded; `kscore up` %lld ms later",
             l->nb, l->n, l->conc, l->kill_at, (long long)l->down_ms);
    chaos_log(r, "%s", r->note);
    cluster_load_to_kill_point(r, l);
    char name[16];
    long owner = lease_owner(r, name, sizeof(name));
    fixture_stack_signal(&r->st, name, SIGKILL);
    r->fault_us = ks_now_us();
    chaos_log(r, "%s killed (kill -9; lease owner pid %ld)", name, owner);
    cluster_restart(r, "broker restart", l->down_ms);
out:
    free(l);
    return rc;
}

/* A node and the broker driving the first batch die together (kill -9),
 * and at the same moment the other broker restarts (SIGTERM, as a rolling
 * restart would): for a while no broker runs and the streams have two
 * nodes. `kscore up` starts all three again. */
static int
sc_cluster_node_broker_kill(struct chaos_run *r)
{
    struct cluster_load *l = calloc(1, sizeof(*l));
    int rc;
    if (!l)
        return -ENOMEM;
    int victim = (int)chaos_rand(r, 1, 3);
    if ((rc = cluster_setup(r, l)))
        goto out;
    l->down_ms = (int64_t)chaos_rand(r, 0, 1000);
    snprintf(r->note, sizeof(r->note),
             "%u batches of %u targets (concurrency %u) on 3 nodes, 2 "
             "brokers; once %ld targets succeeded kill -9 nats-%d and the "
             "broker driving the first batch, SIGTERM the other broker; "
             "`kscore up` %lld ms after it stopped",
             l->nb, l->n, l->conc, l->kill_at, victim,
             (long long)l->down_ms);
    chaos_log(r, "%s", r->note);
    cluster_load_to_kill_point(r, l);
    char name[16], other[16], dir[PATH_MAX + 32];
    long owner = lease_owner(r, name, sizeof(name));
    pid_t npid = 0, opid = 0;
    snprintf(other, sizeof(other), "broker-%d",
             strcmp(name, "broker-1") == 0 ? 2 : 1);
    snprintf(dir, sizeof(dir), "%.4000s/nats-%d", r->st.dir, victim);
    stack_pidfile_alive(dir, "nats", &npid);
    stack_pidfile_alive(r->st.dir, other, &opid);
    if (npid > 0)
        kill(npid, SIGKILL);
    fixture_stack_signal(&r->st, name, SIGKILL);
    if (opid > 0)
        kill(opid, SIGTERM);
    r->fault_us = ks_now_us();
    chaos_log(r, "nats-%d (pid %d) and %s (lease owner pid %ld) killed "
                 "(kill -9); %s (pid %d) stopping (SIGTERM)",
              victim, (int)npid, name, owner, other, (int)opid);
    if (npid > 0)
        wait_pid_gone(npid);
    if (opid > 0) {
        /* a broker stops within its grace; up only starts what is down */
        for (int i = 0; i < 3000 && kill(opid, 0) == 0; i++)
            chaos_sleep_ms(10);
        chaos_log(r, "%s stopped %.1f s after the SIGTERM", other,
                  (double)(ks_now_us() - r->fault_us) / 1e6);
    }
    cluster_restart(r, "node + broker restart", l->down_ms);
out:
    free(l);
    return rc;
}

/* ---- the runner ------------------------------------------------------------------- */

static const struct chaos_scenario scenarios[] = {
    {"broker-kill", "kill -9 the broker in the middle of 200 commands over 10 "
                    "agent processes, restart it", sc_broker_kill},
    {"broker-kill-local", "the same with 10 in-process agents (--local-agents"
                          " 10), which die with the broker", sc_broker_kill_local},
    {"agent-kill-5s", "kill -9 an agent running 20 commands, restart it 5 s "
                      "later", sc_agent_kill_5s},
    {"agent-kill-15s", "the same, restarted 15 s later (past the heartbeat "
                       "deadline)", sc_agent_kill_15s},
    {"nats-pause", "SIGSTOP nats-server for 5 s during runs and submissions",
     sc_nats_pause},
    {"nats-kill", "kill -9 nats-server, restart it on the same port 5 s "
                  "later", sc_nats_kill},
    {"pg-restart", "restart PostgreSQL (-m fast) in the middle of 100 "
                   "submissions", sc_pg_restart},
    {"pg-readonly", "PostgreSQL refuses writes (read-only) for 8-12 s in "
                    "the middle of 100 submissions", sc_pg_readonly},
    {"batch-broker-kill", "kill -9 the broker in the middle of batches over "
                          "10 agents, restart it", sc_batch_broker_kill},
    {"pg-full", "the events table's disk full (fleet case F06) while 50 "
                "execs and a batch of 20 run, then freed", sc_pg_full},
    {"agent-disk-full", "an agent's state dir fills while it runs "
                        "commands, then kill -9, free, restart",
     sc_agent_disk_full},
    {"agent-sigchld-ignored", "an agent started with SIGCHLD ignored and "
                              "TERM blocked: TERM it half way, restart",
     sc_agent_sigchld_ignored},
    {"broker-pause", "SIGSTOP the broker for 12-16 s while 4 agents run "
                     "commands: no command may end Lost", sc_broker_pause},
    {"host-freeze", "freeze an agent, its watchdog and its commands together "
                    "for 12-15 s (a paused VM), then thaw", sc_host_freeze},
    {"burst", "5,000 commands to one agent at once", sc_burst},
    {"queued-stopped", "2,000 commands queued to a stopped agent (SIGSTOP, "
                       "SIGCONT a few seconds later)", sc_queued_stopped},
    {"cluster_node_kill", "kscore up --cluster 3: kill -9 one nats-server "
                          "node in the middle of 1,000 batch targets, "
                          "restart it", sc_cluster_node_kill},
    {"cluster_broker_kill", "kscore up --cluster 3: kill -9 the broker "
                            "driving a batch of 1,000 targets, the other "
                            "continues", sc_cluster_broker_kill},
    {"cluster_node_broker_kill", "kscore up --cluster 3: kill -9 a node and "
                                 "the broker driving the batches together "
                                 "while the other broker restarts",
     sc_cluster_node_broker_kill},
};
#define NSCENARIOS (sizeof(scenarios) / sizeof(scenarios[0]))

struct outcome {
    const char *name;
    const char *result; /* PASS, FAIL, ERROR, SKIPPED */
    struct chaos_stats stats;
    unsigned viol[7];
    double worst_recover; /* < -1.5: none measured; -1: never */
    double gap;           /* progress gap after the fault; < 0: none */
    double seconds;
};

static uint64_t
name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void
run_one(const struct chaos_scenario *sc, uint64_t seed, bool short_mode,
        struct outcome *out)
{
    struct chaos_run *r = calloc(1, sizeof(*r));
    int rc;

    out->name = sc->name;
    out->worst_recover = -2;
    if (!r) {
        out->result = "ERROR";
        return;
    }
    r->sc = sc;
    r->seed = seed;
    r->rng = seed ^ name_hash(sc->name);
    r->short_mode = short_mode;
    r->t0_mono = ks_mono_us();
    r->gap_s = r->gap_before_s = r->stats.gap_s = -1;
    pthread_mutex_init(&r->mu, NULL);
    printf("\n== %s (seed %llu%s): %s\n", sc->name, (unsigned long long)seed,
           short_mode ? ", short" : "", sc->what);
    fflush(stdout);

    rc = sc->run(r);
    if (rc && r->skipped[0]) {
        chaos_log(r, "skipped: %s", r->skipped);
        chaos_submit_join(r);
        chaos_readers_stop(r);
    } else if (rc) {
        r->setup_failed = true;
        chaos_log(r, "setup failed: %s", ks_strerror(rc));
        chaos_submit_join(r);
        chaos_readers_stop(r);
    } else {
        chaos_wait_settled(r);
        rc = chaos_check(r);
    }
    chaos_stack_down(r);
    out->result = r->skipped[0]      ? "SKIPPED"
                  : r->setup_failed ? "ERROR"
                  : rc              ? "FAIL"
                                    : "PASS";
    if (chaos_interrupted && !r->setup_failed)
        out->result = "INTERRUPTED";
    out->stats = r->stats;
    out->gap = r->stats.gap_s;
    memcpy(out->viol, r->violations, sizeof(out->viol));
    for (unsigned i = 0; i < r->nrec; i++) {
        double s = r->rec[i].seconds < 0 ? -1 : r->rec[i].seconds;
        if (out->worst_recover < -1.5 || s < 0 ||
            (out->worst_recover >= 0 && s > out->worst_recover))
            out->worst_recover = s;
    }
    out->seconds = chaos_since_s(r->t0_mono);
    printf("RESULT %s: %s (%.0f s)", sc->name, out->result, out->seconds);
    if (r->skipped[0])
        printf("  (%s)", r->skipped);
    else if (strcmp(out->result, "PASS") != 0)
        printf("  replay: make chaos SCENARIO=%s SEED=%llu%s", sc->name,
               (unsigned long long)seed, short_mode ? " CHAOS_SCALE=short" : "");
    printf("\n");
    fflush(stdout);
    free(r->subs);
    for (int i = 0; i < 2; i++) {
        free(r->readers[i].pos);
        free(r->readers[i].tx);
    }
    free(r);
}

static void
on_signal(int sig)
{
    (void)sig;
    if (chaos_interrupted)
        _exit(130);
    chaos_interrupted = 1;
}

static void
usage(FILE *f)
{
    fprintf(f,
            "usage: chaos [--short] [--seed N] [--scenario NAME[,NAME...]] "
            "[--keep] [--list]\n"
            "  --short     smaller counts (CI; about 6-8 minutes)\n"
            "  --seed N    the seed of every random choice (default: from "
            "the clock)\n"
            "  --scenario  run only these (default: all)\n"
            "  --keep      keep each stack's directory and logs "
            "(KSCORE_KEEP_TMP=1)\n"
            "  --list      list the scenarios\n");
}

int
main(int argc, char **argv)
{
    /* Not a run: the launcher of agent-sigchld-ignored. */
    if (argc > 2 && strcmp(argv[1], "--exec-odd-signals") == 0)
        return odd_signals_exec(argv + 2);
    static const struct option lo[] = {{"short", no_argument, 0, 's'},
                                       {"seed", required_argument, 0, 'S'},
                                       {"scenario", required_argument, 0, 'c'},
                                       {"keep", no_argument, 0, 'k'},
                                       {"list", no_argument, 0, 'l'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    bool short_mode = false, have_seed = false;
    uint64_t seed = 0;
    const char *only = NULL;
    int opt;

    setvbuf(stdout, NULL, _IOLBF, 0);
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 's':
            short_mode = true;
            break;
        case 'S': {
            char *end;
            errno = 0;
            seed = strtoull(optarg, &end, 10);
            if (errno || *end || !*optarg) {
                fprintf(stderr, "chaos: bad seed '%s'\n", optarg);
                return 2;
            }
            have_seed = true;
            break;
        }
        case 'c':
            only = optarg[0] && strcmp(optarg, "all") != 0 ? optarg : NULL;
            break;
        case 'k':
            setenv("KSCORE_KEEP_TMP", "1", 1);
            break;
        case 'l':
            for (size_t i = 0; i < NSCENARIOS; i++)
                printf("%-24s %s\n", scenarios[i].name, scenarios[i].what);
            return 0;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc) {
        usage(stderr);
        return 2;
    }
    if (!have_seed)
        seed = (uint64_t)ks_now_us() % 1000000000ULL;

    /* Which scenarios. */
    bool want[NSCENARIOS];
    for (size_t i = 0; i < NSCENARIOS; i++)
        want[i] = only == NULL;
    if (only) {
        char *copy = strdup(only), *save = NULL;
        for (char *t = strtok_r(copy, ",", &save); t;
             t = strtok_r(NULL, ",", &save)) {
            size_t i = 0;
            while (i < NSCENARIOS && strcmp(scenarios[i].name, t) != 0)
                i++;
            if (i == NSCENARIOS) {
                fprintf(stderr, "chaos: no scenario '%s' (see --list)\n", t);
                free(copy);
                return 2;
            }
            want[i] = true;
        }
        free(copy);
    }

    /* A private TMPDIR: every stack of the run lives under it (and it
     * stays out of the way of anything else cleaning /tmp/kscore-*). */
    const char *tmp = getenv("TMPDIR");
    char base[PATH_MAX];
    snprintf(base, sizeof(base), "%s/chaos-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(base)) {
        fprintf(stderr, "chaos: mkdtemp %s: %s\n", base, strerror(errno));
        return 1;
    }
    chmod(base, 0711); /* PostgreSQL runs as postgres and must reach in */
    setenv("TMPDIR", base, 1);

    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    printf("chaos: seed %llu%s (replay: make chaos SEED=%llu%s "
           "[SCENARIO=name])\n",
           (unsigned long long)seed, short_mode ? ", short" : "",
           (unsigned long long)seed, short_mode ? " CHAOS_SCALE=short" : "");
    struct outcome outs[NSCENARIOS];
    size_t nout = 0;
    int64_t t0 = ks_mono_us();
    for (size_t i = 0; i < NSCENARIOS && !chaos_interrupted; i++) {
        if (!want[i])
            continue;
        memset(&outs[nout], 0, sizeof(outs[nout]));
        run_one(&scenarios[i], seed, short_mode, &outs[nout++]);
    }

    int failed = chaos_interrupted ? 1 : 0;
    printf("\n== SUMMARY (seed %llu%s, %.0f s)\n", (unsigned long long)seed,
           short_mode ? ", short" : "", chaos_since_s(t0));
    printf("| %-24s | %-6s | %9s | %8s | %-13s | %4s | %5s | %9s | %5s | "
           "%-24s |\n",
           "scenario", "result", "submitted", "accepted", "ran 0/1/2+",
           "lost", "twice", "recover s", "gap s", "violations");
    printf("|--------------------------|--------|-----------|----------|------"
           "---------|------|-------|-----------|-------|-------------------"
           "-------|\n");
    for (size_t i = 0; i < nout; i++) {
        struct outcome *o = &outs[i];
        char ran[32], rec[16], v[64] = "";
        size_t off = 0;
        snprintf(ran, sizeof(ran), "%ld/%ld/%ld", o->stats.ran0,
                 o->stats.ran1, o->stats.ran2);
        if (o->worst_recover < -1.5)
            snprintf(rec, sizeof(rec), "-");
        else if (o->worst_recover < 0)
            snprintf(rec, sizeof(rec), "never");
        else
            snprintf(rec, sizeof(rec), "%.1f", o->worst_recover);
        if (o->viol[0])
            off += (size_t)snprintf(v + off, sizeof(v) - off, "S x%u",
                                    o->viol[0]);
        for (int k = 1; k <= 6; k++)
            if (o->viol[k])
                off += (size_t)snprintf(v + off, sizeof(v) - off, "%sI%d x%u",
                                        off ? ", " : "", k, o->viol[k]);
        char gap[16] = "-";
        if (o->gap >= 0)
            snprintf(gap, sizeof(gap), "%.1f", o->gap);
        printf("| %-24s | %-6s | %9ld | %8ld | %-13s | %4ld | %5ld | %9s | "
               "%5s | %-24s |\n",
               o->name, o->result, o->stats.submitted, o->stats.accepted, ran,
               o->stats.lost, o->stats.twice, rec, gap, v[0] ? v : "-");
        if (strcmp(o->result, "PASS") != 0 &&
            strcmp(o->result, "SKIPPED") != 0)
            failed = 1;
    }
    for (size_t i = 0; i < nout; i++)
        printf("%s: %s\n", outs[i].name, outs[i].result);
    rmdir(base); /* empty unless --keep */
    return failed;
}
