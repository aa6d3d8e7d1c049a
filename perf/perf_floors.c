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
 * sum_us is the sum of the four p50s. path_us estimates the serial path of
 * one command from the same p50s: 3 NATS round trips (execute request and
 * reply, claim request and reply, two one-way JetStream deliveries), 3
 * PostgreSQL commits (Requested+Dispatched, Started, the recorder's
 * Completed), 2 JetStream publishes (command, result) and one spawn.
 */
#include <errno.h>
#include <libpq-fe.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "perf_int.h"

#define FLOOR_STREAM "KSCORE_PERF_FLOOR"
#define FLOOR_TABLE "kscore_perf_floor"

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
