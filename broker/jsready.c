/*
 * jsready.c: what a broker needs of JetStream before it serves, waited
 * for.
 *
 * On a cluster every stream and consumer is a raft group that elects its
 * own leader, seconds after the meta leader and often after the nodes
 * answer clients: after `kscore down` and `up` with a fleet (a consumer
 * per agent id) the recorder's consumer could still have none when the
 * brokers started, and both exited at once on "JetStream system
 * temporarily unavailable" (issue 22). A broker on a cluster (replicas >
 * 1) now waits for each part, up to BROKER_JS_WAIT_MS, saying every
 * BROKER_JS_SAY_US what it waits for, as agents wait for the registry
 * (agent/runtime.c register_retrying). A single server answers at once or
 * not at all: one try, as before.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

/* One try of each step here, and each request of it, waits this long at
 * most (ms). */
#define JS_TRY_MS 3000

static int
step_setup(struct broker *b, char **why)
{
    int replicas = b->opts->replicas ? (int)b->opts->replicas : 1;
    return evt_setup_wait(b->nc, replicas, JS_TRY_MS, why);
}

static int
step_kv(struct broker *b, char **why)
{
    int rc;
    if (b->kv)
        return 0;
    if ((rc = evt_agents_kv(b->nc, BROKER_KV_WAIT_MS, &b->kv)) && why &&
        asprintf(why, "open KV %s: %s", EVT_KV_AGENTS, ks_strerror(rc)) < 0)
        *why = NULL;
    return rc;
}

/* The recorder's consumer made as asked, and answering through a leader:
 * its subscription (broker__recorder_start) looks it up. */
static int
step_recorder(struct broker *b, char **why)
{
    struct evt_consumer_state cs;
    int rc = broker__recorder_ensure(b, why);
    if (rc)
        return rc;
    rc = evt_consumer_state(b->nc, EVT_STREAM_EVENTS, EVT_RECORDER_DURABLE,
                            JS_TRY_MS, &cs);
    if (rc && why &&
        asprintf(why, "consumer %s: %s", EVT_RECORDER_DURABLE,
                 rc == KS_EUNAVAIL ? "no leader yet" : ks_strerror(rc)) < 0)
        *why = NULL;
    return rc;
}

int
broker__js_wait(struct broker *b, const char *what,
                int (*fn)(struct broker *b, char **why), char **errmsg)
{
    bool wait = b->opts->replicas > 1;
    int64_t t0 = ks_mono_us(), said = 0;
    int rc;

    for (;;) {
        char *why = NULL;
        rc = fn(b, &why);
        int64_t now = ks_mono_us();
        /* JetStream's answers of an election: not ready, no leader, no
         * answer; anything else is no wait's to cure. */
        bool transient = rc == KS_ENATS || rc == KS_EUNAVAIL ||
                         rc == KS_ETIMEDOUT;
        if (rc == 0 || !wait || !transient || b->stopping ||
            now - t0 >= (int64_t)BROKER_JS_WAIT_MS * 1000) {
            if (rc && errmsg &&
                asprintf(errmsg, "%s%s: %s",
                         wait && transient ? "after waiting for JetStream: "
                                           : "",
                         what, why ? why : ks_strerror(rc)) < 0)
                *errmsg = NULL;
            free(why);
            break;
        }
        if (!said || now - said >= BROKER_JS_SAY_US) {
            said = now;
            ks_log(KS_LOG_WARN,
                   "waiting for JetStream (a cluster elects its leaders)",
                   KS_S("part", what),
                   KS_S("error", why ? why : ks_strerror(rc)),
                   KS_I("waited_ms", (now - t0) / 1000),
                   KS_I("limit_ms", BROKER_JS_WAIT_MS));
        }
        free(why);
        nanosleep(&(struct timespec){0, 250 * 1000000L}, NULL);
    }
    if (rc == 0 && said)
        ks_log(KS_LOG_INFO, "JetStream ready", KS_S("part", what),
               KS_I("waited_ms", (ks_mono_us() - t0) / 1000));
    return rc;
}

int
broker__jetstream_ready(struct broker *b, char **errmsg)
{
    int rc;
    if ((rc = broker__js_wait(b, "the streams and the registry bucket",
                              step_setup, errmsg)) ||
        (rc = broker__js_wait(b, "the registry bucket", step_kv, errmsg)))
        return rc;
    return broker__js_wait(b, "the recorder's consumer", step_recorder,
                           errmsg);
}
