/*
 * batch_exec_10 / batch_exec_1000: one BatchExecuteCommand of /bin/true
 * across the broker's local agents <host>-0..N-1 (`kscore broker
 * --local-agents N`, label local=true), named explicitly so that agents
 * left in the registry by an earlier broker start are never targets. A
 * round is one batch: wall time from the request to the reply, which the
 * broker sends after the last target's result is recorded.
 *
 * When no broker serves kscore.api.v1.batch (no responders) the scenario
 * is skipped, not failed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf_int.h"

static int
batch_round(struct perf_ctx *ctx, unsigned n, json_t **out)
{
    Ks__BatchRequest req = KS__BATCH_REQUEST__INIT;
    Ks__BatchReply *rep = NULL;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"/bin/true"};
    char **ids = calloc(n, sizeof(*ids));
    struct evt_conn *c = NULL;
    int64_t t0, dt;
    int rc;

    if (!ids)
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++)
        if (asprintf(&ids[i], "%s-%u", ctx->st->host, i) < 0) {
            ids[i] = NULL;
            rc = -ENOMEM;
            goto out;
        }
    if ((rc = perf__connect(ctx->st, "kscore-perf-batch", &c)))
        goto out;
    spec.argv = argv;
    spec.n_argv = 1;
    spec.timeout_ms = 10000;
    req.spec = &spec;
    req.agents = ids;
    req.n_agents = n;
    struct perf_cost k0, k1;
    perf__cost_sample(ctx->st, &k0);
    t0 = ks_mono_us();
    rc = broker_batch(c, &req, 120000, &rep);
    dt = ks_mono_us() - t0;
    perf__cost_sample(ctx->st, &k1);
    if (rc == KS_EUNAVAIL) {
        *out = json_pack("{s:s}", "skipped",
                         "batch not available: no broker serves "
                         EVT_API_BATCH);
        rc = PERF_SKIPPED;
        goto out;
    }
    if (rc == 0 && rep->error_code) {
        fprintf(stderr, "kscore perf: batch refused: %s (%s)\n", rep->error,
                ks_err_name(rep->error_code));
        rc = rep->error_code < 0 ? rep->error_code : KS_EINTERNAL;
    }
    if (rc) {
        fprintf(stderr, "kscore perf: batch of %u: %s\n", n, ks_strerror(rc));
        goto out;
    }
    unsigned ok = rep->counts ? rep->counts->succeeded : 0;
    *out = json_pack("{s:f,s:f,s:i,s:i,s:i}", "wall_ms", (double)dt / 1000.0,
                     "broker_elapsed_ms", (double)rep->elapsed_us / 1000.0,
                     "targets", (int)n, "succeeded", (int)ok, "not_succeeded",
                     (int)(n - ok));
    perf__cost_json(*out, &k0, &k1, n, "target");
    if (ok != n)
        fprintf(stderr, "kscore perf: batch of %u: %u did not succeed\n", n,
                n - ok);
out:
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    for (unsigned i = 0; i < n; i++)
        free(ids[i]);
    free(ids);
    return rc;
}

int
perf__batch10_round(struct perf_ctx *ctx, int round, json_t **out)
{
    (void)round;
    return batch_round(ctx, 10, out);
}

int
perf__batch1000_round(struct perf_ctx *ctx, int round, json_t **out)
{
    (void)round;
    return batch_round(ctx, 1000, out);
}
