/*
 * command_latency: sequential ExecuteCommand of /bin/true through the
 * broker and the `kscore agent` process (agent perf-0).
 * (sustained, capacity and overload: perf_load.c.)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf_int.h"

void
perf__true_spec(Ks__CommandSpec *spec, char **argv)
{
    ks__command_spec__init(spec);
    argv[0] = "/bin/true";
    spec->argv = argv;
    spec->n_argv = 1;
    spec->timeout_ms = 10000;
}

/* 0 if the reply says /bin/true ran and exited 0. */
static int
reply_ok(const Ks__ExecuteReply *r)
{
    if (r->error_code)
        return r->error_code < 0 ? r->error_code : KS_EINTERNAL;
    if (!r->result || r->result->status != KS__COMMAND_STATUS__SUCCEEDED)
        return KS_EINTERNAL;
    return 0;
}

int
perf__latency_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int warm = ctx->o->quick ? 2 : 10, n = ctx->o->quick ? 10 : 100;
    int64_t *lat = calloc((size_t)n, sizeof(*lat));
    struct evt_conn *c = NULL;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec;
    char *argv[1];
    int rc, errors = 0, first_err = 0;
    json_t *o;

    (void)round;
    if (!lat)
        return -ENOMEM;
    if ((rc = perf__connect(ctx->st, "kscore-perf-latency", &c)))
        goto out;
    perf__true_spec(&spec, argv);
    req.spec = &spec;
    req.agent_id = PERF_AGENT_PREFIX "0";
    struct perf_cost k0 = PERF_COST_UNKNOWN, k1 = k0;
    for (int i = -warm; i < n && !perf__interrupted; i++) {
        if (i == 0)
            perf__cost_sample(ctx->st, &k0);
        Ks__ExecuteReply *rep = NULL;
        int64_t t0 = ks_mono_us();
        rc = broker_execute(c, &req, 30000, &rep);
        int64_t dt = ks_mono_us() - t0;
        if (rc == 0)
            rc = reply_ok(rep);
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        if (rc) {
            if (!first_err)
                first_err = rc;
            errors++;
        }
        if (i >= 0)
            lat[i] = dt;
    }
    perf__cost_sample(ctx->st, &k1);
    rc = 0;
    if (perf__interrupted) {
        rc = -EINTR;
        goto out;
    }
    if (errors > n / 2) {
        fprintf(stderr, "kscore perf: command_latency: %d of %d failed (%s)\n",
                errors, n + warm, ks_strerror(first_err));
        rc = first_err ? first_err : KS_EINTERNAL;
        goto out;
    }
    o = json_object();
    perf__lat_json(o, lat, (size_t)n);
    int64_t p50 = json_integer_value(json_object_get(o, "p50_us"));
    int64_t p99 = json_integer_value(json_object_get(o, "p99_us"));
    if (ctx->floor_sum_us > 0)
        json_object_set_new(o, "ratio_to_floor",
                            json_real((double)p50 / ctx->floor_sum_us));
    json_object_set_new(o, "p99_over_p50",
                        json_real(p50 ? (double)p99 / (double)p50 : 0));
    json_object_set_new(o, "calls", json_integer(n));
    json_object_set_new(o, "errors", json_integer(errors));
    perf__cost_json(o, &k0, &k1, n, "command");
    *out = o;
out:
    evt_close(c);
    free(lat);
    return rc;
}

