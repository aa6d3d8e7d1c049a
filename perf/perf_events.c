/*
 * event_throughput: CommandCompleted events (as an agent reports them: a
 * result with a small stdout, on the agent's event subject
 * evt_event_subject()) published asynchronously to KSCORE_EVENTS
 * (js_PublishAsync, then js_PublishAsyncComplete: every PubAck awaited),
 * and recorded in PostgreSQL by the broker's recorder, end to end: from the
 * first publish until the events table holds them all (a look every 2 ms:
 * max(global_pos) first, then an exact count). A burst of 1,000 and a sustained run of 100,000 per round.
 *
 * The publishing connection does not set send_asap: for a stream of
 * asynchronous publishes nats.c's flusher batches the writes, which is what
 * a throughput path wants (a latency path sets it).
 */
#include <errno.h>
#include <libpq-fe.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "perf_int.h"
#include "store.h"

#define MAX_POS "SELECT coalesce(max(global_pos), 0) FROM events"

struct evbatch {
    size_t n;
    char (*ids)[37];  /* event ids */
    char (*cmds)[37]; /* command ids */
};

static atomic_int pub_errors;

static void
on_pub_err(jsCtx *js, jsPubAckErr *pae, void *closure)
{
    (void)js;
    (void)pae;
    (void)closure;
    atomic_fetch_add(&pub_errors, 1);
}

size_t
perf__completed_pack(const char *event_id, const char *command_id,
                     uint8_t *buf)
{
    static const char out_text[] = "hello from kscore perf\n";
    Ks__Event ev = KS__EVENT__INIT;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
    Ks__Output so = KS__OUTPUT__INIT, se = KS__OUTPUT__INIT;
    char stream[48];
    int64_t now_us = ks_now_us();

    so.data.data = (uint8_t *)out_text;
    so.data.len = sizeof(out_text) - 1;
    so.total_bytes = so.data.len;
    r.status = KS__COMMAND_STATUS__SUCCEEDED;
    r.has_exit_code = 1;
    r.exit_code = 0;
    r.stdout = &so;
    r.stderr = &se;
    r.started_at_us = now_us - 900;
    r.finished_at_us = now_us;
    r.duration_us = 900;
    r.term_sent_us = r.kill_sent_us = -1;
    r.utime_us = 310;
    r.stime_us = 420;
    r.maxrss_kb = 1480;
    r.pid = 4242;
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    ev.type = "CommandCompleted";
    ev.agent_id = PERF_AGENT_PREFIX "0";
    ev.attempt = 1;
    ev.result = &r;
    ev.stream_id = stream;
    ev.event_id = (char *)event_id;
    ev.command_id = (char *)command_id;
    ev.occurred_at_us = now_us;
    return protobuf_c_message_pack(&ev.base, buf);
}

/* Publishes n realistic CommandCompleted events; *ms_out: first publish to
 * the last PubAck. *t0_out: monotonic time of the first publish. */
static int
publish(struct perf_stack *st, struct evbatch *b, double *ms_out,
        int64_t *t0_out)
{
    struct evt_connect_opts co = {.name = "kscore-perf-events"};
    struct evt_conn *c = NULL;
    jsCtx *js = NULL;
    jsOptions jo;
    jsPubOptions po;
    char subject[16 + EVT_AGENT_ID_MAX + 40];
    uint8_t buf[PERF_EVENT_BUF];
    int64_t t0;
    int rc;

    if ((rc = evt_connect(st->nats_url, &co, &c, NULL)))
        return rc;
    jsOptions_Init(&jo);
    jo.PublishAsync.MaxPending = 20000;
    jo.PublishAsync.ErrHandler = on_pub_err;
    jo.PublishAsync.StallWait = 5000;
    if ((rc = evt_err(natsConnection_JetStream(&js, c->nc, &jo))))
        goto out;
    atomic_store(&pub_errors, 0);

    t0 = ks_mono_us();
    for (size_t i = 0; i < b->n && !perf__interrupted; i++) {
        size_t len = perf__completed_pack(b->ids[i], b->cmds[i], buf);
        evt_event_subject(subject, sizeof(subject), PERF_AGENT_PREFIX "0",
                          b->cmds[i]);
        jsPubOptions_Init(&po);
        po.MsgId = b->ids[i];
        if ((rc = evt_err(js_PublishAsync(js, subject, buf, (int)len, &po))))
            goto out;
    }
    jsPubOptions_Init(&po);
    po.MaxWait = 60000;
    rc = evt_err(js_PublishAsyncComplete(js, &po));
    *ms_out = (double)(ks_mono_us() - t0) / 1000.0;
    *t0_out = t0;
    if (rc == 0 && atomic_load(&pub_errors))
        rc = KS_ENATS;
out:
    jsCtx_Destroy(js);
    evt_close(c);
    return rc;
}

/* One bigint from sql ($1 = arg when the query has a parameter); -1 on
 * error. */
static int64_t
pg_int(PGconn *pg, const char *sql, int nparams, int64_t arg)
{
    char a[32];
    const char *vals[1] = {a};
    int64_t v = -1;
    snprintf(a, sizeof(a), "%lld", (long long)arg);
    PGresult *r = PQexecParams(pg, sql, nparams, NULL, vals, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
        v = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

/* Waits until n events after global_pos from are recorded; returns the
 * monotonic time it saw them, or a negative code. */
static int64_t
wait_recorded(PGconn *pg, int64_t from, size_t n, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    while (ks_mono_us() < deadline && !perf__interrupted) {
        /* Appends no longer NOTIFY: look every 2 ms. */
        nanosleep(&(struct timespec){0, 2000000L}, NULL);
        int64_t now = ks_mono_us();
        int64_t max = pg_int(pg, MAX_POS, 0, 0);
        if (max < 0)
            return KS_EPG;
        /* Positions can have gaps (a rolled back append): count exactly
         * once max says there may be enough. */
        if (max - from >= (int64_t)n &&
            pg_int(pg, "SELECT count(*) FROM events WHERE global_pos > $1", 1,
                   from) >= (int64_t)n)
            return now;
    }
    return perf__interrupted ? -EINTR : KS_ETIMEDOUT;
}

/*
 * The commands the events report on, made Running on the reporting agent
 * first (not timed): the recorder decides each report against its command
 * (store_append_checked), so a report about no command would measure the
 * refusal path instead of the real one.
 */
static int
make_running(struct perf_stack *st, const struct evbatch *b)
{
    enum { CHUNK = 300 };
    static char *argv[] = {"/bin/true"};
    struct store *s = NULL;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    int rc = store_open(st->conninfo, &s, NULL);
    if (rc)
        return rc;
    spec.argv = argv;
    spec.n_argv = 1;
    for (size_t at = 0; rc == 0 && at < b->n; at += CHUNK) {
        size_t k = b->n - at < CHUNK ? b->n - at : CHUNK;
        static Ks__Event ev[3 * CHUNK];
        static Ks__Command cmd[CHUNK];
        static const Ks__Event *evs[3 * CHUNK];
        static char ids[3 * CHUNK][37], streams[CHUNK][48];
        int64_t now = ks_now_us();
        for (size_t i = 0; i < k; i++) {
            const char *cid = b->cmds[at + i];
            snprintf(streams[i], sizeof(streams[i]), "command-%s", cid);
            ks__command__init(&cmd[i]);
            cmd[i].command_id = (char *)cid;
            cmd[i].agent_id = PERF_AGENT_PREFIX "0";
            cmd[i].spec = &spec;
            cmd[i].issued_at_us = now;
            cmd[i].not_after_us = now + 3600000000LL;
            static const char *const types[3] = {
                "CommandRequested", "CommandDispatched", "CommandStarted"};
            for (int t = 0; t < 3; t++) {
                Ks__Event *e = &ev[3 * i + t];
                ks__event__init(e);
                ks_uuid(ids[3 * i + t]);
                e->event_id = ids[3 * i + t];
                e->stream_id = streams[i];
                e->type = (char *)types[t];
                e->command_id = (char *)cid;
                e->agent_id = PERF_AGENT_PREFIX "0";
                e->attempt = t ? 1 : 0;
                e->occurred_at_us = now;
                if (t == 0)
                    e->command = &cmd[i];
                evs[3 * i + t] = e;
            }
        }
        rc = store_append_many(s, evs, 3 * k, NULL);
    }
    store_close(s);
    return rc;
}

static int
run_batch(struct perf_ctx *ctx, size_t n, const char *name, json_t *o)
{
    struct evbatch b = {n, calloc(n, 37), calloc(n, 37)};
    PGconn *pg = PQconnectdb(ctx->st->conninfo);
    double pub_ms = 0;
    int64_t t0 = 0, from, done;
    char key[64];
    int rc = 0;

    if (!b.ids || !b.cmds) {
        rc = -ENOMEM;
        goto out;
    }
    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: PostgreSQL: %s", PQerrorMessage(pg));
        rc = KS_EUNAVAIL;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        ks_uuid(b.ids[i]);
        ks_uuid(b.cmds[i]);
    }
    if ((rc = make_running(ctx->st, &b))) {
        fprintf(stderr, "kscore perf: event_throughput: making %zu commands "
                        "Running: %s\n",
                n, ks_strerror(rc));
        goto out;
    }
    from = pg_int(pg, MAX_POS, 0, 0);
    if (from < 0) {
        rc = KS_EPG;
        goto out;
    }
    struct perf_cost k0, k1;
    perf__cost_sample(ctx->st, &k0);
    if ((rc = publish(ctx->st, &b, &pub_ms, &t0))) {
        fprintf(stderr, "kscore perf: event_throughput publish: %s\n",
                ks_strerror(rc));
        goto out;
    }
    /* Generous: at 1,000 events/s a 100k run still finishes. */
    done = wait_recorded(pg, from, n, 30000 + (int)n);
    if (done < 0) {
        rc = (int)done;
        fprintf(stderr, "kscore perf: event_throughput: recording %zu "
                        "events: %s\n",
                n, ks_strerror(rc));
        goto out;
    }
    perf__cost_sample(ctx->st, &k1);
    double rec_s = (double)(done - t0) / 1e6;
    snprintf(key, sizeof(key), "publish_%s_ms", name);
    json_object_set_new(o, key, json_real(pub_ms));
    snprintf(key, sizeof(key), "publish_%s_events_per_s", name);
    json_object_set_new(o, key, json_real((double)n / (pub_ms / 1000.0)));
    snprintf(key, sizeof(key), "record_%s_ms", name);
    json_object_set_new(o, key, json_real(rec_s * 1000.0));
    snprintf(key, sizeof(key), "record_%s_events_per_s", name);
    json_object_set_new(o, key, json_real((double)n / rec_s));
    if (strcmp(name, "1000") == 0) {
        /* The burst's cost per event (the round's first batch). */
        json_t *c = json_object();
        perf__cost_json(c, &k0, &k1, (double)n, "event");
        json_object_update(o, c);
        json_decref(c);
    }
out:
    PQfinish(pg);
    free(b.ids);
    free(b.cmds);
    return rc;
}

int
perf__events_round(struct perf_ctx *ctx, int round, json_t **out)
{
    size_t burst = ctx->o->quick ? 100 : 1000;
    size_t sustained = ctx->o->quick ? 2000 : 100000;
    json_t *o = json_object();
    int rc;

    (void)round;
    if ((rc = run_batch(ctx, burst, "1000", o)) ||
        (rc = run_batch(ctx, sustained, "100k", o))) {
        json_decref(o);
        return rc;
    }
    /* The names the SLO report uses. */
    json_object_set(o, "record_events_per_s",
                    json_object_get(o, "record_1000_events_per_s"));
    json_object_set_new(o, "burst_events", json_integer((json_int_t)burst));
    json_object_set_new(o, "sustained_events",
                        json_integer((json_int_t)sustained));
    *out = o;
    return 0;
}
