/*
 * floors: the serial primitives one ExecuteCommand is made of, measured in
 * the same run and on the same servers as the scenarios, so the ratio of a
 * command to its floor compares like with like (DESIGN "Performance
 * culture").
 *
 *  nats_rr    core NATS request/reply, responder in-process on its own
 *             connection, send_asap on both (nats.c otherwise waits for its
 *             flusher thread)
 *  js_pub     JetStream sync publish with a Nats-Msg-Id to a scratch file
 *             stream with the KSCORE_EVENTS settings
 *  pg_commit  INSERT of one row into a scratch table, autocommit, with the
 *             server's durability settings (fsync, synchronous_commit)
 *  spawn      posix_spawn + waitpid of /bin/true
 *
 *
 * Two throughput floors, one timed batch each per round (after an untimed
 * warm-up batch), the primitives event_throughput is made of:
 *
 *  js_async_1000   1,000 js_PublishAsync of event_throughput's
 *                  CommandCompleted (same bytes, a Nats-Msg-Id each) on a
 *                  plain connection (no send_asap, nats.c's default
 *                  PublishAsync options) to a scratch stream with the
 *                  KSCORE_EVENTS settings, then js_PublishAsyncComplete:
 *                  from the first publish to the last PubAck
 *  pg_pipeline_1000
 *                  libpq pipeline mode: BEGIN, 1,000 PQsendQueryPrepared
 *                  single-row INSERTs of event-shaped rows (the events
 *                  table's columns and unique keys, the packed event as
 *                  data), COMMIT, PQpipelineSync, all in one round trip
 *                  and one transaction with the server's durability: from
 *                  the first send to the sync's result
 *
 * sum_us is the sum of the four p50s. path_us estimates the serial path of
 * one command from the same p50s: 3 NATS round trips (execute request and
 * reply, claim request and reply, two one-way JetStream deliveries), 3
 * PostgreSQL commits (Requested+Dispatched, Started, the recorder's
 * Completed), 2 JetStream publishes (command, result) and one spawn.
 */
#include <errno.h>
#include <libpq-fe.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "perf_int.h"

#define FLOOR_STREAM "KSCORE_PERF_FLOOR"
#define FLOOR_TABLE "kscore_perf_floor"
#define FLOOR_EVENTS "kscore_perf_floor_events"
#define FLOOR_BATCH 1000

extern char **environ;

static void
on_echo(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    (void)sub;
    (void)ud;
    natsConnection_Publish(nc, natsMsg_GetReply(msg), natsMsg_GetData(msg),
                           natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
}

static int
floor_nats(struct perf_ctx *ctx, int n, int64_t *lat)
{
    struct evt_conn *srv = NULL, *cli = NULL;
    natsSubscription *sub = NULL;
    char subject[64], id[37];
    uint8_t body[64] = {0};
    int rc;

    ks_uuid(id);
    snprintf(subject, sizeof(subject), "_KSCORE.perf.echo.%s", id);
    if ((rc = perf__connect(ctx->st, "kscore-perf-echo", &srv)) ||
        (rc = perf__connect(ctx->st, "kscore-perf-req", &cli)))
        goto out;
    rc = evt_err(natsConnection_Subscribe(&sub, srv->nc, subject, on_echo,
                                          NULL));
    if (rc == 0)
        rc = evt_err(natsConnection_Flush(srv->nc));
    for (int i = -20; rc == 0 && i < n; i++) { /* 20 warm-up requests */
        natsMsg *reply = NULL;
        int64_t t0 = ks_mono_us();
        rc = evt_err(natsConnection_Request(&reply, cli->nc, subject, body,
                                            (int)sizeof(body), 2000));
        if (i >= 0)
            lat[i] = ks_mono_us() - t0;
        natsMsg_Destroy(reply);
    }
out:
    natsSubscription_Destroy(sub);
    evt_close(cli);
    evt_close(srv);
    return rc;
}

static int
floor_js(struct perf_ctx *ctx, int n, int64_t *lat)
{
    struct evt_conn *c = NULL;
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    uint8_t body[200];
    int rc;

    memset(body, 'x', sizeof(body));
    if ((rc = perf__connect(ctx->st, "kscore-perf-js", &c)))
        return rc;
    jsStreamConfig_Init(&sc);
    sc.Name = FLOOR_STREAM;
    sc.Subjects = (const char *[]){"kscore.perf.floor.>"};
    sc.SubjectsLen = 1;
    sc.Storage = js_FileStorage;
    sc.Duplicates = (int64_t)EVT_DUPLICATE_WINDOW_MS * 1000000;
    js_DeleteStream(c->js, FLOOR_STREAM, NULL, NULL);
    rc = evt_err(js_AddStream(&si, c->js, &sc, NULL, &jerr));
    jsStreamInfo_Destroy(si);
    for (int i = -20; rc == 0 && i < n; i++) {
        jsPubOptions po;
        jsPubAck *pa = NULL;
        char id[37];
        ks_uuid(id);
        jsPubOptions_Init(&po);
        po.MsgId = id;
        po.MaxWait = 5000;
        int64_t t0 = ks_mono_us();
        rc = evt_err(js_Publish(&pa, c->js, "kscore.perf.floor.x", body,
                                (int)sizeof(body), &po, &jerr));
        if (i >= 0)
            lat[i] = ks_mono_us() - t0;
        jsPubAck_Destroy(pa);
    }
    js_DeleteStream(c->js, FLOOR_STREAM, NULL, NULL);
    evt_close(c);
    return rc;
}

static int
pg_ok(PGconn *pg, PGresult *r, const char *what)
{
    ExecStatusType st = PQresultStatus(r);
    int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
    if (!ok)
        fprintf(stderr, "kscore perf: %s: %s", what, PQerrorMessage(pg));
    PQclear(r);
    return ok ? 0 : KS_EPG;
}

static int
floor_pg(struct perf_ctx *ctx, int n, int64_t *lat)
{
    PGconn *pg = PQconnectdb(ctx->st->conninfo);
    char body[100];
    int rc;

    memset(body, 'x', sizeof(body));
    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: PostgreSQL: %s", PQerrorMessage(pg));
        rc = KS_EUNAVAIL;
        goto out;
    }
    if ((rc = pg_ok(pg,
                    PQexec(pg, "CREATE TABLE IF NOT EXISTS " FLOOR_TABLE
                               " (id bigint GENERATED ALWAYS AS IDENTITY "
                               "PRIMARY KEY, v bytea)"),
                    "create scratch table")))
        goto out;
    for (int i = -20; rc == 0 && i < n; i++) {
        const char *vals[1] = {body};
        int lens[1] = {(int)sizeof(body)}, fmts[1] = {1};
        int64_t t0 = ks_mono_us();
        rc = pg_ok(pg,
                   PQexecParams(pg, "INSERT INTO " FLOOR_TABLE
                                    " (v) VALUES ($1)",
                                1, NULL, vals, lens, fmts, 0),
                   "insert");
        if (i >= 0)
            lat[i] = ks_mono_us() - t0;
    }
    pg_ok(pg, PQexec(pg, "DROP TABLE IF EXISTS " FLOOR_TABLE), "drop");
out:
    PQfinish(pg);
    return rc;
}

static atomic_int async_errors;

static void
on_async_err(jsCtx *js, jsPubAckErr *pae, void *closure)
{
    (void)js;
    (void)pae;
    (void)closure;
    atomic_fetch_add(&async_errors, 1);
}

/* One batch of n async publishes; *us: first publish to the last PubAck. */
static int
js_async_batch(jsCtx *js, int n, int64_t *us)
{
    uint8_t buf[PERF_EVENT_BUF];
    char subject[80], ids[2][37];
    jsPubOptions po;
    int64_t t0 = ks_mono_us();
    int rc = 0;

    atomic_store(&async_errors, 0);
    for (int i = 0; i < n && rc == 0; i++) {
        ks_uuid(ids[0]);
        ks_uuid(ids[1]);
        size_t len = perf__completed_pack(ids[0], ids[1], buf);
        /* as long as an agent's event subject */
        snprintf(subject, sizeof(subject), "kscore.perf.floor.perf-0.%s",
                 ids[1]);
        jsPubOptions_Init(&po);
        po.MsgId = ids[0];
        rc = evt_err(js_PublishAsync(js, subject, buf, (int)len, &po));
    }
    jsPubOptions_Init(&po);
    po.MaxWait = 30000;
    if (rc == 0)
        rc = evt_err(js_PublishAsyncComplete(js, &po));
    *us = ks_mono_us() - t0;
    if (rc == 0 && atomic_load(&async_errors))
        rc = KS_ENATS;
    return rc;
}

static int
floor_js_async(struct perf_ctx *ctx, int n, int64_t *us)
{
    struct evt_connect_opts co = {.name = "kscore-perf-js-async"};
    struct evt_conn *c = NULL;
    jsCtx *js = NULL;
    jsOptions jo;
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    char *errmsg = NULL;
    int64_t warm;
    int rc;

    if ((rc = evt_connect(ctx->st->nats_url, &co, &c, &errmsg))) {
        fprintf(stderr, "kscore perf: %s\n",
                errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return rc;
    }
    /* KSCORE_EVENTS's settings (events/events.c) but DenyDelete and
     * DenyPurge, which do not touch the publish path. */
    jsStreamConfig_Init(&sc);
    sc.Name = FLOOR_STREAM;
    sc.Subjects = (const char *[]){"kscore.perf.floor.>"};
    sc.SubjectsLen = 1;
    sc.Retention = js_LimitsPolicy;
    sc.Storage = js_FileStorage;
    sc.Duplicates = (int64_t)EVT_DUPLICATE_WINDOW_MS * 1000000;
    sc.MaxAge = INT64_C(24) * 3600 * 1000 * 1000000;
    sc.MaxMsgSize = KS_MAX_MESSAGE_BYTES;
    js_DeleteStream(c->js, FLOOR_STREAM, NULL, NULL);
    rc = evt_err(js_AddStream(&si, c->js, &sc, NULL, &jerr));
    jsStreamInfo_Destroy(si);
    jsOptions_Init(&jo);
    jo.PublishAsync.ErrHandler = on_async_err; /* else nats.c defaults */
    if (rc == 0)
        rc = evt_err(natsConnection_JetStream(&js, c->nc, &jo));
    if (rc == 0)
        rc = js_async_batch(js, n / 10 ? n / 10 : 1, &warm);
    if (rc == 0)
        rc = js_async_batch(js, n, us);
    jsCtx_Destroy(js);
    js_DeleteStream(c->js, FLOOR_STREAM, NULL, NULL);
    evt_close(c);
    return rc;
}

/* Reads every result of a pipeline up to and including its sync. */
static int
pipeline_results(PGconn *pg)
{
    int rc = 0;
    for (;;) {
        PGresult *r = PQgetResult(pg);
        if (!r) {
            if (PQstatus(pg) != CONNECTION_OK)
                return KS_EPG;
            continue; /* end of one query's results */
        }
        ExecStatusType st = PQresultStatus(r);
        PQclear(r);
        if (st == PGRES_PIPELINE_SYNC)
            return rc;
        if (st == PGRES_FATAL_ERROR || st == PGRES_PIPELINE_ABORTED) {
            if (rc == 0)
                fprintf(stderr, "kscore perf: pipeline: %s",
                        PQerrorMessage(pg));
            rc = KS_EPG;
        }
    }
}

/* BEGIN, n INSERTs, COMMIT, sync; *us: first send to the sync's result. */
static int
pg_pipeline_batch(PGconn *pg, int n, int64_t *us)
{
    uint8_t data[PERF_EVENT_BUF];
    char eid[37], cid[37], stream[48];
    const char *vals[4];
    int lens[4] = {0, 0, 0, 0}, fmts[4] = {0, 0, 0, 1}, rc = 0;
    int64_t t0 = ks_mono_us();

    if (PQenterPipelineMode(pg) != 1)
        return KS_EPG;
    PQsendQueryParams(pg, "BEGIN", 0, NULL, NULL, NULL, NULL, 0);
    for (int i = 0; i < n; i++) {
        ks_uuid(eid);
        ks_uuid(cid);
        snprintf(stream, sizeof(stream), "command-%s", cid);
        lens[3] = (int)perf__completed_pack(eid, cid, data);
        vals[0] = stream;
        vals[1] = eid;
        vals[2] = "CommandCompleted";
        vals[3] = (const char *)data;
        if (PQsendQueryPrepared(pg, "ins", 4, vals, lens, fmts, 0) != 1) {
            rc = KS_EPG;
            break;
        }
    }
    PQsendQueryParams(pg, "COMMIT", 0, NULL, NULL, NULL, NULL, 0);
    if (PQpipelineSync(pg) != 1)
        rc = KS_EPG;
    int rr = pipeline_results(pg);
    *us = ks_mono_us() - t0;
    if (PQexitPipelineMode(pg) != 1 && rc == 0)
        rc = KS_EPG;
    if (rc)
        fprintf(stderr, "kscore perf: pipeline: %s", PQerrorMessage(pg));
    return rc ? rc : rr;
}

static void
quiet(void *arg, const char *msg)
{
    (void)arg;
    (void)msg;
}

static int
floor_pg_pipeline(struct perf_ctx *ctx, int n, int64_t *us)
{
    PGconn *pg = PQconnectdb(ctx->st->conninfo);
    int64_t warm;
    int rc;

    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "kscore perf: PostgreSQL: %s", PQerrorMessage(pg));
        rc = KS_EUNAVAIL;
        goto out;
    }
    PQsetNoticeProcessor(pg, quiet, NULL); /* "does not exist, skipping" */
    /* The events table's shape (store/migrations.c): its columns, its
     * identity key and its two unique keys. */
    pg_ok(pg, PQexec(pg, "DROP TABLE IF EXISTS " FLOOR_EVENTS), "drop");
    if ((rc = pg_ok(pg,
                    PQexec(pg,
                           "CREATE TABLE " FLOOR_EVENTS " ("
                           "global_pos bigint GENERATED ALWAYS AS IDENTITY "
                           "PRIMARY KEY, "
                           "tx_id xid8 NOT NULL DEFAULT pg_current_xact_id(), "
                           "stream_id text NOT NULL, version bigint NOT NULL, "
                           "event_id uuid NOT NULL, type text NOT NULL, "
                           "data bytea NOT NULL, "
                           "recorded_at timestamptz NOT NULL DEFAULT now(), "
                           "UNIQUE (event_id), UNIQUE (stream_id, version))"),
                    "create scratch events table")) ||
        (rc = pg_ok(pg,
                    PQprepare(pg, "ins",
                              "INSERT INTO " FLOOR_EVENTS " (stream_id, "
                              "version, event_id, type, data) "
                              "VALUES ($1, 4, $2, $3, $4)", /* 4th event */
                              4, NULL),
                    "prepare")))
        goto out;
    rc = pg_pipeline_batch(pg, n / 10 ? n / 10 : 1, &warm);
    if (rc == 0)
        rc = pg_pipeline_batch(pg, n, us);
    pg_ok(pg, PQexec(pg, "DROP TABLE IF EXISTS " FLOOR_EVENTS), "drop");
out:
    PQfinish(pg);
    return rc;
}

static int
floor_spawn(int n, int64_t *lat)
{
    char *argv[] = {"/bin/true", NULL};
    for (int i = -10; i < n; i++) {
        pid_t pid;
        int st, rc;
        int64_t t0 = ks_mono_us();
        if ((rc = posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ)))
            return -rc;
        while (waitpid(pid, &st, 0) == -1)
            if (errno != EINTR)
                return -errno;
        if (i >= 0)
            lat[i] = ks_mono_us() - t0;
    }
    return 0;
}

/* Adds <name>_p50_us and <name>_p99_us; returns the p50. */
static int64_t
put(json_t *o, const char *name, int64_t *lat, int n)
{
    char key[64];
    perf__sort(lat, (size_t)n);
    int64_t p50 = perf__pct(lat, (size_t)n, 50);
    snprintf(key, sizeof(key), "%s_p50_us", name);
    json_object_set_new(o, key, json_integer(p50));
    snprintf(key, sizeof(key), "%s_p99_us", name);
    json_object_set_new(o, key, json_integer(perf__pct(lat, (size_t)n, 99)));
    return p50;
}

int
perf__floors_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int n = ctx->o->quick ? 20 : 1000, rc;
    int64_t *lat = calloc((size_t)n, sizeof(*lat));
    json_t *o = json_object();
    int64_t rr, js, pg, sp;

    (void)round;
    if (!lat) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = floor_nats(ctx, n, lat)))
        goto out;
    rr = put(o, "nats_rr", lat, n);
    if ((rc = floor_js(ctx, n / 2, lat)))
        goto out;
    js = put(o, "js_pub", lat, n / 2);
    if ((rc = floor_pg(ctx, n / 2, lat)))
        goto out;
    pg = put(o, "pg_commit", lat, n / 2);
    if ((rc = floor_spawn(n / 2, lat)))
        goto out;
    sp = put(o, "spawn", lat, n / 2);
    {
        int64_t js_us = 0, pg_us = 0;
        /* --quick: event_throughput's burst is 100, so is this */
        if ((rc = floor_js_async(ctx, ctx->o->quick ? 100 : FLOOR_BATCH,
                                 &js_us)))
            goto out;
        json_object_set_new(o, "js_async_1000_us", json_integer(js_us));
        {
            uint8_t buf[PERF_EVENT_BUF];
            char a[37], b[37];
            ks_uuid(a);
            ks_uuid(b);
            json_object_set_new(
                o, "event_bytes",
                json_integer((json_int_t)perf__completed_pack(a, b, buf)));
        }
        if ((rc = floor_pg_pipeline(ctx, FLOOR_BATCH, &pg_us)))
            goto out;
        json_object_set_new(o, "pg_pipeline_1000_us", json_integer(pg_us));
        json_object_set_new(
            o, "pg_pipeline_rows_per_s",
            json_real(pg_us > 0 ? FLOOR_BATCH * 1e6 / (double)pg_us : 0));
    }
    json_object_set_new(o, "sum_us", json_integer(rr + js + pg + sp));
    json_object_set_new(o, "path_us",
                        json_integer(3 * rr + 3 * pg + 2 * js + sp));
    json_object_set_new(o, "samples", json_integer(n / 2));
out:
    free(lat);
    if (rc) {
        json_decref(o);
        return rc;
    }
    *out = o;
    return 0;
}
