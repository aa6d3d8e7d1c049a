/*
 * chaos_load: what the scenarios do to the stack. Submitter threads (the
 * client API, detached, with an idempotency key so a retry after a fault is
 * the same command), batches, two readers of the whole log (I5), and the
 * recovery probe (I6: a fresh `kscore exec` that succeeds).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "chaos.h"
#include "stack.h"
#include "store.h"

/* ---- readers (I5) --------------------------------------------------------- */

static void
reader_add(struct chaos_reader *rd, int64_t pos, uint64_t tx)
{
    pthread_mutex_lock(&rd->mu);
    if (rd->n == rd->cap) {
        size_t nc = rd->cap ? rd->cap * 2 : 4096;
        int64_t *p = realloc(rd->pos, nc * sizeof(*p));
        uint64_t *t = p ? realloc(rd->tx, nc * sizeof(*t)) : NULL;
        if (p)
            rd->pos = p;
        if (!p || !t) {
            pthread_mutex_unlock(&rd->mu);
            return;
        }
        rd->tx = t;
        rd->cap = nc;
    }
    rd->pos[rd->n] = pos;
    rd->tx[rd->n++] = tx;
    pthread_mutex_unlock(&rd->mu);
}

/* Follows every stream through the broker, as `kscore events --follow`
 * does, but keeps its cursor across failures (the CLI exits on the first
 * one): a resilient reader is what I5 is about. */
static void *
api_reader_main(void *arg)
{
    struct chaos_reader *rd = arg;
    struct chaos_run *r = rd->run;
    struct evt_connect_opts o = {.name = "chaos-reader",
                                 .send_asap = true,
                                 .retry_forever = true,
                                 .nkey_file = chaos_nkey(r)};
    struct evt_conn *c = NULL;
    Ks__EventsRequest req = KS__EVENTS_REQUEST__INIT;

    while (!rd->stop && evt_connect(r->st.nats.url, &o, &c, NULL) != 0)
        chaos_sleep_ms(200);
    req.stream_id = "";
    req.wait_ms = 1000;
    req.limit = 1000;
    while (!rd->stop) {
        Ks__EventsReply *rep = NULL;
        int rc = broker_call(c, EVT_API_FOLLOW, &req.base,
                             &ks__events_reply__descriptor, 6000,
                             (ProtobufCMessage **)&rep);
        if (rc || rep->error_code) {
            rd->errors++;
            if (rep)
                ks__events_reply__free_unpacked(rep, NULL);
            chaos_sleep_ms(200);
            continue;
        }
        for (size_t i = 0; i < rep->n_events; i++)
            reader_add(rd, rep->events[i]->global_pos, rep->events[i]->tx_id);
        req.cursor_tx_id = rep->cursor_tx_id;
        req.cursor_pos = rep->cursor_pos;
        ks__events_reply__free_unpacked(rep, NULL);
    }
    evt_close(c);
    return NULL;
}

static int
store_reader_cb(const Ks__RecordedEvent *ev, void *ud)
{
    reader_add(ud, ev->global_pos, ev->tx_id);
    return 0;
}

static void
quiet_notice(void *arg, const char *message)
{
    (void)arg;
    (void)message;
}

/* Reads the log straight from PostgreSQL with store_read_all(), the
 * catch-up read every reader of the record builds on. */
static void *
store_reader_main(void *arg)
{
    struct chaos_reader *rd = arg;
    struct chaos_run *r = rd->run;
    struct store *st = NULL;
    struct store_cursor cur = {0};

    while (!rd->stop && store_open(r->st.pg.conninfo, &st, NULL) != 0) {
        rd->errors++;
        chaos_sleep_ms(200);
    }
    /* The FATAL a restart sends to this idle (LISTENing) session is
     * expected: the read that follows fails and is retried. */
    if (st)
        PQsetNoticeProcessor(store_pgconn(st), quiet_notice, NULL);
    while (!rd->stop) {
        size_t before = rd->n;
        int rc = store_read_all(st, &cur, 1000, store_reader_cb, rd);
        if (rc) {
            rd->errors++;
            chaos_sleep_ms(200);
            continue;
        }
        if (rd->n == before && store_wait_notify(st, 500) == KS_EPG) {
            rd->errors++;
            chaos_sleep_ms(200);
        }
    }
    store_close(st);
    return NULL;
}

int
chaos_readers_start(struct chaos_run *r)
{
    static const char *const names[2] = {"api", "store"};
    void *(*const mains[2])(void *) = {api_reader_main, store_reader_main};
    for (int i = 0; i < 2; i++) {
        struct chaos_reader *rd = &r->readers[i];
        rd->name = names[i];
        rd->run = r;
        pthread_mutex_init(&rd->mu, NULL);
        if (pthread_create(&rd->thread, NULL, mains[i], rd) != 0)
            return -errno;
        rd->started = true;
    }
    return 0;
}

void
chaos_readers_stop(struct chaos_run *r)
{
    for (int i = 0; i < 2; i++) {
        struct chaos_reader *rd = &r->readers[i];
        rd->stop = 1;
        if (rd->started)
            pthread_join(rd->thread, NULL);
        rd->started = false;
    }
}

/* ---- the stack -------------------------------------------------------------- */

int
chaos_stack_up(struct chaos_run *r, unsigned local_agents)
{
    int rc = fixture_stack_start(&r->st, NULL, local_agents);
    r->stack_up = true;
    if (rc) {
        fprintf(stderr, "chaos: the stack did not start: %s (see %s)\n",
                ks_strerror(rc), r->st.dir);
        return rc;
    }
    snprintf(r->side, sizeof(r->side), "%.4000s/side", r->st.dir);
    if (mkdir(r->side, 0777) == -1 && errno != EEXIST)
        return -errno;
    chmod(r->side, 0777);
    return chaos_readers_start(r);
}

void
chaos_stack_down(struct chaos_run *r)
{
    chaos_readers_stop(r);
    if (!r->stack_up)
        return;
    if (r->cluster) {
        chaos_cluster_down(r);
        return;
    }
    /* Whatever a scenario paused must run again to hear its SIGTERM. */
    fixture_stack_nats_kill(&r->st, SIGCONT);
    for (unsigned i = 0; i < CHAOS_MAX_AGENTS; i++) {
        char name[32];
        snprintf(name, sizeof(name), "agent-%u", i);
        fixture_stack_signal(&r->st, name, SIGCONT);
    }
    fixture_stack_signal(&r->st, "agent-fleet", SIGCONT);
    if (getenv("KSCORE_KEEP_TMP"))
        printf("  kept: %s (logs), %s (nats), %s (pg)\n", r->st.dir,
               r->st.nats.dir, r->st.pg.dir);
    fixture_stack_stop(&r->st);
    r->stack_up = false;
    for (unsigned i = 0; i < r->nmounts; i++)
        umount2(r->mounts[i], MNT_DETACH);
    r->nmounts = 0;
}

int
chaos_mount_small(struct chaos_run *r, const char *path, int size_mb)
{
    char opts[32];
    if (r->nmounts >= sizeof(r->mounts) / sizeof(r->mounts[0]))
        return -ENOSPC;
    if (mkdir(path, 0700) == -1 && errno != EEXIST)
        return -errno;
    snprintf(opts, sizeof(opts), "size=%dm", size_mb);
    if (mount("tmpfs", path, "tmpfs", 0, opts) == -1) {
        chaos_log(r, "cannot mount a tmpfs at %s: %s", path, strerror(errno));
        return KS_EUNAVAIL;
    }
    snprintf(r->mounts[r->nmounts++], sizeof(r->mounts[0]), "%s", path);
    return 0;
}

int
chaos_agent_spawn(struct chaos_run *r, const char *name,
                  const char *const *ids, unsigned n, unsigned max_concurrent)
{
    return chaos_agent_spawn_via(r, name, ids, n, max_concurrent, NULL);
}

int
chaos_agent_spawn_via(struct chaos_run *r, const char *name,
                      const char *const *ids, unsigned n,
                      unsigned max_concurrent, const char *const launcher[])
{
    const char *extra[64];
    char mc[16];
    size_t k = 0;
    int64_t since = ks_now_us() - 1000000;
    int rc;

    snprintf(mc, sizeof(mc), "%u", max_concurrent);
    for (unsigned i = 1; i < n && k < 60; i++) {
        extra[k++] = "--id";
        extra[k++] = ids[i];
    }
    if (max_concurrent) {
        extra[k++] = "--max-concurrent";
        extra[k++] = mc;
    }
    extra[k] = NULL;
    rc = fixture_agent_spawn_via(&r->st, name, ids[0], extra, launcher);
    for (unsigned i = 1; rc == 0 && i < n; i++)
        rc = fixture_stack_wait_agent(&r->st, ids[i], since, 30000);
    if (rc)
        fprintf(stderr, "chaos: agent %s did not start: %s (see %s/%s.log)\n",
                name, ks_strerror(rc), r->st.dir, name);
    return rc;
}

/* ---- submissions ------------------------------------------------------------ */

void
chaos_script(const struct chaos_run *r, double sleep_s, char *buf, size_t len)
{
    if (sleep_s > 0)
        snprintf(buf, len, "echo $$ >> %s/$KSCORE_COMMAND_ID; sleep %.2f",
                 r->side, sleep_s);
    else
        snprintf(buf, len, "echo $$ >> %s/$KSCORE_COMMAND_ID", r->side);
}

void
chaos_subs_prepare(struct chaos_run *r, size_t n, double sleep_lo,
                   double sleep_hi)
{
    r->subs = calloc(n, sizeof(*r->subs));
    r->nsubs = r->subs ? n : 0;
    for (size_t i = 0; i < r->nsubs; i++) {
        struct chaos_sub *s = &r->subs[i];
        snprintf(s->agent, sizeof(s->agent), "%s",
                 r->agents[i % r->nagents]);
        snprintf(s->key, sizeof(s->key), "chaos-%s-%llu-%zu", r->sc->name,
                 (unsigned long long)r->seed, i);
        s->sleep_s = sleep_hi > sleep_lo ? chaos_randf(r, sleep_lo, sleep_hi)
                                         : sleep_lo;
    }
}

/* Submits one command until accepted or past the retry budget. */
static void
submit_one(struct chaos_run *r, struct evt_conn *c, struct chaos_sub *s)
{
    char script[PATH_MAX + 128];
    char *argv[] = {"sh", "-c", script};
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    /* A client retries with the same key for a while; a fault costs it
     * at most a restart, so 30 s is generous. */
    int64_t give_up = ks_mono_us() + 30 * 1000000LL;

    chaos_script(r, s->sleep_s, script, sizeof(script));
    spec.argv = argv;
    spec.n_argv = 3;
    spec.timeout_ms = r->timeout_ms;
    spec.grace_ms = r->grace_ms;
    req.spec = &spec;
    req.agent_id = s->agent;
    req.idempotency_key = s->key;
    req.deliver_within_ms = r->deliver_ms;
    req.detach = 1;
    while (!chaos_interrupted) {
        Ks__ExecuteReply *rep = NULL;
        int rc = broker_execute(c, &req, 3000, &rep);
        s->attempts++;
        if (rc == 0 && rep->error_code == 0 && rep->command_id[0]) {
            snprintf(s->id, sizeof(s->id), "%s", rep->command_id);
            s->accept_us = ks_now_us();
            ks__execute_reply__free_unpacked(rep, NULL);
            r->accepted++;
            return;
        }
        s->last_err = rc ? rc : rep->error_code;
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        if (ks_mono_us() > give_up)
            return;
        chaos_sleep_ms(rc == KS_ETIMEDOUT ? 50 : 200);
    }
}

static void *
submitter_main(void *arg)
{
    struct chaos_run *r = arg;
    struct evt_connect_opts o = {.name = "chaos-submit",
                                 .send_asap = true,
                                 .retry_forever = true,
                                 .nkey_file = chaos_nkey(r)};
    struct evt_conn *c = NULL;
    int64_t give_up = ks_mono_us() + 30 * 1000000LL;

    while (evt_connect(r->st.nats.url, &o, &c, NULL) != 0) {
        if (ks_mono_us() > give_up || chaos_interrupted)
            break;
        chaos_sleep_ms(200);
    }
    for (;;) {
        size_t i;
        pthread_mutex_lock(&r->mu);
        i = r->next++;
        pthread_mutex_unlock(&r->mu);
        if (i >= r->nsubs)
            break;
        if (r->rate > 0) {
            int64_t at = r->submit_start_mono + (int64_t)((double)i / r->rate * 1e6);
            int64_t now = ks_mono_us();
            if (at > now)
                chaos_sleep_ms((at - now) / 1000);
        }
        if (c)
            submit_one(r, c, &r->subs[i]);
        r->finished++;
    }
    evt_close(c);
    return NULL;
}

int
chaos_submit_start(struct chaos_run *r)
{
    r->submit_start_mono = ks_mono_us();
    for (unsigned i = 0; i < CHAOS_SUBMITTERS; i++) {
        if (pthread_create(&r->submitters[i], NULL, submitter_main, r) != 0)
            return -errno;
        r->nsubmitters++;
    }
    return 0;
}

void
chaos_submit_join(struct chaos_run *r)
{
    for (unsigned i = 0; i < r->nsubmitters; i++)
        pthread_join(r->submitters[i], NULL);
    r->nsubmitters = 0;
}

void
chaos_wait_accepted(struct chaos_run *r, long n)
{
    while (!chaos_interrupted && r->accepted < n &&
           r->finished < (long)r->nsubs)
        chaos_sleep_ms(5);
}

/* ---- batches ------------------------------------------------------------------ */

int
chaos_batch_submit(struct chaos_run *r, const char *const *agents,
                   unsigned n, unsigned conc, double sleep_s)
{
    struct evt_connect_opts o = {.name = "chaos-batch",
                                 .send_asap = true,
                                 .nkey_file = chaos_nkey(r)};
    struct evt_conn *c = NULL;
    Ks__BatchRequest req = KS__BATCH_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__Amount mc = KS__AMOUNT__INIT;
    Ks__BatchReply *rep = NULL;
    char script[PATH_MAX + 128];
    char *argv[] = {"sh", "-c", script};
    int rc;

    if (r->nbatches >= CHAOS_MAX_BATCHES)
        return -ENOSPC;
    if ((rc = evt_connect(r->st.nats.url, &o, &c, NULL)))
        return rc;
    chaos_script(r, sleep_s, script, sizeof(script));
    spec.argv = argv;
    spec.n_argv = 3;
    spec.timeout_ms = r->timeout_ms;
    spec.grace_ms = r->grace_ms;
    mc.value = conc;
    req.spec = &spec;
    req.agents = (char **)agents;
    req.n_agents = n;
    req.max_concurrency = &mc;
    req.deliver_within_ms = r->deliver_ms;
    req.detach = 1;
    rc = broker_batch(c, &req, 5000, &rep);
    if (rc == 0 && rep->error_code)
        rc = rep->error_code;
    if (rc == 0) {
        struct chaos_batch *b = &r->batches[r->nbatches++];
        snprintf(b->id, sizeof(b->id), "%s", rep->batch_id);
        b->targets = n;
        b->conc = conc;
        b->accept_us = ks_now_us();
    } else {
        r->batch_errors++;
    }
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    return rc;
}

/* ---- probes (I6) ------------------------------------------------------------ */

void
chaos_add_recovery(struct chaos_run *r, const char *what, double s)
{
    if (r->nrec >= CHAOS_MAX_RECOVERIES)
        return;
    snprintf(r->rec[r->nrec].what, sizeof(r->rec[r->nrec].what), "%s", what);
    r->rec[r->nrec].seconds = s;
    r->nrec++;
}

double
chaos_probe(struct chaos_run *r, const char *what, const char *agent,
            int64_t t0_mono)
{
    char script[PATH_MAX + 128];
    double window = r->short_mode ? 40.0 : 60.0, s = -1;
    int tries = 0;

    chaos_script(r, 0, script, sizeof(script));
    const char *args[] = {"exec",  "--agent",  agent,    "--deliver-within",
                          "5s",    "--timeout", "10s",   "--grace",
                          "1s",    "--",       "sh",     "-c",
                          script,  NULL};
    while (!chaos_interrupted && chaos_since_s(t0_mono) < window) {
        struct fixture_out o;
        tries++;
        if (fixture_kscore(&r->st, args, &o) == 0 && o.status == 0) {
            fixture_out_release(&o);
            s = chaos_since_s(t0_mono);
            break;
        }
        fixture_out_release(&o);
        chaos_sleep_ms(200);
    }
    chaos_log(r, "probe after %s: %s (%d tries)", what,
              s >= 0 ? "served" : "NOT served", tries);
    chaos_add_recovery(r, what, s);
    return s;
}

/* ---- waiting ---------------------------------------------------------------- */

static PGconn *
db(struct chaos_run *r)
{
    PGconn *pg = PQconnectdb(r->st.pg.conninfo);
    if (PQstatus(pg) != CONNECTION_OK) {
        PQfinish(pg);
        return NULL;
    }
    return pg;
}

static long
sql_long(PGconn *pg, const char *sql)
{
    PGresult *res = PQexec(pg, sql);
    long v = -1;
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
        !PQgetisnull(res, 0, 0))
        v = atol(PQgetvalue(res, 0, 0));
    PQclear(res);
    return v;
}

long
chaos_count_status(struct chaos_run *r, const char *status, const char *agent)
{
    PGconn *pg = db(r);
    char sql[512];
    long v;
    if (!pg)
        return -1;
    if (agent)
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM commands WHERE status = '%s' AND "
                 "agent_id = '%s'",
                 status, agent);
    else
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM commands WHERE status = '%s'", status);
    v = sql_long(pg, sql);
    PQfinish(pg);
    return v;
}

static int64_t
item_budget_us(const struct chaos_run *r)
{
    uint64_t g = r->grace_ms ? r->grace_ms : CHAOS_DEFAULT_GRACE_MS;
    return (int64_t)(r->deliver_ms + r->timeout_ms + g +
                     CHAOS_HEARTBEAT_DEADLINE_MS + CHAOS_SLACK_MS) *
           1000;
}

/* The wall-clock time by which everything submitted so far must be
 * terminal (I3, I4): the last acceptance plus its budget. */
static int64_t
settle_deadline_us(const struct chaos_run *r)
{
    int64_t last = 0, d;
    for (size_t i = 0; i < r->nsubs; i++)
        if (r->subs[i].accept_us > last)
            last = r->subs[i].accept_us;
    d = (last ? last : ks_now_us()) + item_budget_us(r) + r->refused_us;
    for (unsigned i = 0; i < r->nbatches; i++) {
        const struct chaos_batch *b = &r->batches[i];
        unsigned rounds = (b->targets + b->conc - 1) / (b->conc ? b->conc : 1);
        int64_t bd = b->accept_us + (int64_t)rounds * item_budget_us(r) +
                     r->refused_us;
        if (bd > d)
            d = bd;
    }
    return d;
}

void
chaos_wait_settled(struct chaos_run *r)
{
    PGconn *pg = NULL;
    char sql[4096];
    int64_t deadline;
    long open = -1, running_batches = 0;

    /* Submissions end first (each has its own retry budget). */
    chaos_submit_join(r);
    deadline = settle_deadline_us(r);
    if (deadline > ks_now_us())
        chaos_log(r, "waiting for every command to end (at most %.0f s)",
                  (double)(deadline - ks_now_us()) / 1e6);
    else
        chaos_log(r, "the last deadline has passed already: one look");
    size_t len = (size_t)snprintf(sql, sizeof(sql),
                                  "SELECT count(*) FROM batches WHERE "
                                  "status = 'Running' AND batch_id IN (''");
    for (unsigned i = 0; i < r->nbatches && len < sizeof(sql) - 64; i++)
        len += (size_t)snprintf(sql + len, sizeof(sql) - len, ",'%s'",
                                r->batches[i].id);
    snprintf(sql + len, sizeof(sql) - len, ")");
    for (bool first = true;
         !chaos_interrupted && (first || ks_now_us() < deadline);
         first = false) {
        if (!pg && !(pg = db(r))) {
            chaos_sleep_ms(250);
            continue;
        }
        open = sql_long(pg, "SELECT count(*) FROM commands WHERE status IN "
                            "('Pending','Dispatched','Running')");
        running_batches = sql_long(pg, sql);
        if (open < 0 || running_batches < 0) {
            PQfinish(pg);
            pg = NULL;
        } else if (open == 0 && running_batches == 0) {
            break;
        }
        chaos_sleep_ms(250);
    }
    PQfinish(pg);
    chaos_log(r, "%s: %ld commands open, %ld batches running",
              open == 0 && running_batches == 0 ? "settled" : "deadline passed",
              open, running_batches);
    /* A second terminal event (a late result, an outbox replay) comes
     * after the first: give it the time to show. */
    chaos_sleep_ms(r->short_mode ? 3000 : 5000);

    /* The readers catch up with what is there now. */
    if ((pg = db(r))) {
        long total = sql_long(pg, "SELECT count(*) FROM events");
        int64_t until = ks_mono_us() + 15 * 1000000LL;
        for (;;) {
            bool behind = false;
            for (int i = 0; i < 2; i++)
                behind |= (long)r->readers[i].n < total;
            if (!behind || ks_mono_us() > until)
                break;
            chaos_sleep_ms(100);
        }
        PQfinish(pg);
    }
    chaos_readers_stop(r);
}

/* ---- serving again with a backlog (I6) --------------------------------------- */

double
chaos_serving_again(struct chaos_run *r, const char *what, const char *agent,
                    int64_t t0_mono)
{
    double window = r->short_mode ? 40.0 : 60.0, s = -1;
    double t0_wall_s =
        (double)(ks_now_us() - (ks_mono_us() - t0_mono)) / 1e6;
    char sql[512], label[48];
    PGconn *pg = db(r);

    if (!pg)
        return chaos_probe(r, what, agent, t0_mono);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM commands WHERE agent_id = '%s' AND "
             "started_at > to_timestamp(%.6f)",
             agent, t0_wall_s);
    while (!chaos_interrupted && chaos_since_s(t0_mono) < window) {
        if (sql_long(pg, sql) > 0) {
            s = chaos_since_s(t0_mono);
            break;
        }
        long waiting = sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                    "status IN ('Pending', 'Dispatched')");
        if (waiting == 0) { /* no backlog: a fresh exec says it */
            PQfinish(pg);
            return chaos_probe(r, what, agent, t0_mono);
        }
        chaos_sleep_ms(50);
    }
    PQfinish(pg);
    snprintf(label, sizeof(label), "%.30s (first claim)", what);
    chaos_log(r, "after %s: %s", what,
              s >= 0 ? "its backlog runs again" : "NOT served");
    chaos_add_recovery(r, label, s);
    return s;
}
