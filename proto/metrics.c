/*
 * metrics.c: kscore's metric registry and its Prometheus text exposition.
 *
 * Every metric is a slot in a static array, known at compile time, so an
 * update is one relaxed atomic add on a fixed address: no lookup, no lock,
 * no allocation on the paths that count (the recorder, claims, spawns).
 * Histograms keep one non-cumulative count per bucket; the cumulative
 * `le` series is made at render time. Gauges that are a state rather than
 * a tally (NATS connected, queue depths, agents online) are collected at
 * scrape time by the functions the broker and the agent register.
 */
#include "kproto.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define B KS_METRICS_BROKER
#define A KS_METRICS_AGENT

/* Counters sharing a name are one family with a label (help on the
 * first), as the gauges below. */
static const struct {
    const char *name, *help;
    unsigned roles;
    const char *label;
} counters[KS_C__N] = {
    [KS_C_EVENTS_RECORDED] = {"kscore_events_recorded_total",
                              "Events appended to the record (PostgreSQL).", B},
    [KS_C_CLAIM_CONFLICTS] = {"kscore_claim_conflicts_total",
                              "Claims refused by the claim fence (the "
                              "attempt was claimed or ended already).",
                              B},
    [KS_C_REDISPATCHES] = {"kscore_redispatches_total",
                           "Commands published again (attempt > 1) after "
                           "nobody claimed them in time.",
                           B},
    [KS_C_RECORDER_REDELIVERIES] = {"kscore_recorder_redeliveries_total",
                                    "Events JetStream delivered to the "
                                    "recorder more than once (not acked in "
                                    "time, or a broker restarted).",
                                    B},
    [KS_C_AGENT_REDELIVERIES] = {"kscore_agent_redeliveries_total",
                                 "Command messages JetStream delivered to "
                                 "this agent more than once.",
                                 A},
    [KS_C_AGENT_CLAIMS_LOST] = {"kscore_agent_claims_refused_total",
                                "Claims of this agent the broker refused "
                                "(claimed or ended already).",
                                A},
    [KS_C_JETSTREAM_REPAIRS] = {"kscore_jetstream_repairs_total",
                                "JetStream parts kscore needs (a stream, "
                                "the registry bucket, the recorder's "
                                "consumer) found gone and made again.",
                                B},
    [KS_C_AGENT_STATE_WRITE_ERRORS] = {
        "kscore_agent_state_write_errors_total",
        "Writes to the agent's state dir that failed (full or read-only): "
        "claims refused, events published from memory only.",
        A},
    [KS_C_RECORDER_DB_RETRIES] = {"kscore_recorder_db_retries_total",
                                  "Attempts to record a batch of events "
                                  "that failed because PostgreSQL refused "
                                  "writes (disk full, read-only, ...) or "
                                  "was away; the events wait, unacked, and "
                                  "are retried.",
                                  B},
    [KS_C_CONSUMER_STALLS] = {"kscore_consumer_stalls_total",
                              "Agent consumers found stalled: commands "
                              "waiting for an agent with free slots and "
                              "nothing delivered for seconds (unacked "
                              "messages nobody holds, a leader that does "
                              "not deliver, no leader).",
                              B},
    [KS_C_CONSUMER_STEPDOWNS] = {"kscore_consumer_stepdowns_total",
                                 "Stalled agent consumers whose leader "
                                 "this broker asked to step down.",
                                 B},
    [KS_C_CONSUMER_REMAKES] = {"kscore_consumer_remakes_total",
                               "Stalled agent consumers this broker "
                               "deleted and made again (their messages "
                               "are delivered again; the claim fence keeps "
                               "one run).",
                               B},
    [KS_C_LOST_DELIVERIES] = {"kscore_lost_deliveries_total",
                              "Deliveries repaired because their "
                              "consumer had passed a command's message "
                              "and its agent, with free slots, never took "
                              "it (a delivery lost at a leader change, or "
                              "taken by a process that stopped): the "
                              "consumer made again while the stream holds "
                              "the message, else the command published "
                              "again.",
                              B},
    [KS_C_WRITER_APPENDS] = {"kscore_writer_appends_total",
                             "Appends (dispatch records, claims, results) "
                             "written through the group writer, whatever "
                             "their verdict.",
                             B},
    [KS_C_WRITER_TRANSACTIONS] = {"kscore_writer_transactions_total",
                                  "Transactions the group writer sent; "
                                  "appends per transaction is how much "
                                  "commits are shared.",
                                  B},
    [KS_C_LATE_REPLIES] = {"kscore_nats_late_replies_total",
                           "Replies that came after their requester had "
                           "given up waiting, dropped.",
                           B | A},
    [KS_C_PUBLISH_RETRIES] = {"kscore_publish_retries_total",
                              "JetStream publishes tried again because the "
                              "stream did not take them for now (no "
                              "responders during a leader election, no "
                              "PubAck, a 503 error), same message id.",
                              B | A},
    [KS_C_REPORTS_DROPPED] = {"kscore_annotations_dropped_total",
                              "Annotation rows not written because their "
                              "identity was past its share (1000 at once, "
                              "then 10 a second, per broker): an agent's "
                              "refused or late reports (kind=report), an "
                              "operator's refused requests "
                              "(kind=denial). The log sums them up.",
                              B, "kind=\"report\""},
    [KS_C_DENIALS_DROPPED] = {"kscore_annotations_dropped_total", NULL, B,
                              "kind=\"denial\""},
    [KS_C_REFUSED_BUSY] = {"kscore_refused_busy_total",
                           "Commands refused at once because they could "
                           "not start within their delivery deadline (or "
                           "kscore's own queues were over their limit): "
                           "nothing recorded, the client may retry.",
                           B},
    [KS_C_REQUESTS_REFUSED] = {"kscore_requests_refused_total",
                               "API requests (claims, fetches, operators' "
                               "requests) dropped unanswered because "
                               "their sender had 16384 (or 64 MiB) waiting "
                               "to be served in its turn: one identity "
                               "flooding. The log names it.",
                               B},
};

static const struct {
    const char *name, *help;
    unsigned roles;
} status_counters[KS_SC__N] = {
    [KS_SC_COMMANDS] = {"kscore_commands_total",
                        "Commands ended in the record, by terminal status.", B},
    [KS_SC_AGENT_COMMANDS] = {"kscore_agent_commands_total",
                              "Commands this agent ended and reported, by "
                              "status.",
                              A},
};

/* Gauges sharing a name are rendered as one family with a label. */
static const struct {
    const char *name, *label, *help;
    unsigned roles;
    bool collected; /* reset to 0 before the collectors run */
} gauges[KS_G__N] = {
    [KS_G_PG_CONNECTIONS] = {"kscore_postgres_connections", "state=\"open\"",
                             "PostgreSQL connections of this process, and "
                             "how many of them are down (reconnecting).",
                             B, false},
    [KS_G_PG_BROKEN] = {"kscore_postgres_connections", "state=\"down\"", NULL,
                        B, false},
    [KS_G_RECORDER_STALLED_REFUSED] = {"kscore_recorder_stalled",
                                       "cause=\"refuses_writes\"",
                                       "1 while the recorder holds events "
                                       "it cannot record (unacked, "
                                       "retried): PostgreSQL refuses writes "
                                       "(the log names the SQLSTATE) or is "
                                       "unreachable. Commands stay Running "
                                       "meanwhile.",
                                       B, false},
    [KS_G_RECORDER_STALLED_DOWN] = {"kscore_recorder_stalled",
                                    "cause=\"unreachable\"", NULL, B,
                                    false},
    [KS_G_AGENTS_ONLINE] = {"kscore_agents_online", NULL,
                            "Agents whose heartbeat is within the liveness "
                            "limit.",
                            B, true},
    [KS_G_NATS_BROKER] = {"kscore_nats_connected", "component=\"broker\"",
                          "NATS connections of this process that are "
                          "connected now.",
                          B, true},
    [KS_G_NATS_AGENT] = {"kscore_nats_connected", "component=\"agent\"", NULL,
                         A, true},
    [KS_G_QUEUE_EVENTS] = {"kscore_queue_depth", "queue=\"events\"",
                           "Messages waiting in JetStream: events not yet "
                           "recorded (KSCORE_EVENTS, consumer "
                           "kscore-recorder-pull) and commands not yet acked by "
                           "their agent (KSCORE_CMDS).",
                           B, true},
    [KS_G_QUEUE_COMMANDS] = {"kscore_queue_depth", "queue=\"commands\"", NULL,
                             B, true},
    [KS_G_RUNNING_CHILDREN] = {"kscore_agent_running_children", NULL,
                               "Commands this agent runs now.", A, true},
    [KS_G_AGENT_SLOTS] = {"kscore_agent_slots", NULL,
                          "Commands this agent may run at once "
                          "(--max-concurrent).",
                          A, true},
};

/* Seconds. Short for appends and claims, long for commands. */
static const double buckets[] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1,      2.5,   5,      10,    30,   60,    300,  900, 3600};
#define NBUCKETS (sizeof(buckets) / sizeof(buckets[0]))

static const struct {
    const char *name, *help;
    unsigned roles;
} histograms[KS_H__N] = {
    [KS_H_RECORD_LATENCY] = {"kscore_record_latency_seconds",
                             "From an event's occurrence (its occurred_at, "
                             "on the clock of the host that made it) to its "
                             "commit in PostgreSQL.",
                             B},
    [KS_H_APPEND] = {"kscore_append_duration_seconds",
                     "One append to PostgreSQL (round trip and commit).", B},
    [KS_H_COMMAND_DURATION] = {"kscore_command_duration_seconds",
                               "Run time of the commands ended in the record "
                               "(spawn to the end of the process group).",
                               B},
    [KS_H_AGENT_COMMAND] = {"kscore_agent_command_duration_seconds",
                            "Run time of the commands this agent ran.", A},
    [KS_H_AGENT_CLAIM] = {"kscore_agent_claim_duration_seconds",
                          "A claim's round trip to the broker (the claim "
                          "fence in PostgreSQL).",
                          A},
};

#define NSTATUS 16
_Static_assert(KS__COMMAND_STATUS__NOT_STARTED < NSTATUS,
               "a slot per CommandStatus");

struct hist {
    _Atomic uint64_t bucket[NBUCKETS + 1]; /* the last: +Inf only */
    _Atomic uint64_t count;
    _Atomic uint64_t sum_us;
};

static _Atomic uint64_t g_counter[KS_C__N];
static _Atomic uint64_t g_status[KS_SC__N][NSTATUS];
static _Atomic int64_t g_gauge[KS_G__N];
static struct hist g_hist[KS_H__N];

#define MAX_COLLECTORS 64
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    ks_metrics_collect_fn fn;
    void *ctx;
} g_coll[MAX_COLLECTORS];
static size_t g_ncoll;

void
ks_metric_inc(enum ks_counter c)
{
    atomic_fetch_add_explicit(&g_counter[c], 1, memory_order_relaxed);
}

uint64_t
ks_metric_counter_value(enum ks_counter c)
{
    return atomic_load_explicit(&g_counter[c], memory_order_relaxed);
}

void
ks_metric_status_inc(enum ks_status_counter c, Ks__CommandStatus st)
{
    if ((unsigned)st < NSTATUS)
        atomic_fetch_add_explicit(&g_status[c][st], 1, memory_order_relaxed);
}

void
ks_metric_gauge_add(enum ks_gauge g, int64_t delta)
{
    atomic_fetch_add_explicit(&g_gauge[g], delta, memory_order_relaxed);
}

void
ks_metric_observe_us(enum ks_histogram h, int64_t us)
{
    struct hist *x = &g_hist[h];
    double s;
    size_t i = 0;

    if (us < 0)
        us = 0;
    s = (double)us / 1e6;
    while (i < NBUCKETS && s > buckets[i])
        i++;
    atomic_fetch_add_explicit(&x->bucket[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->sum_us, (uint64_t)us, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->count, 1, memory_order_relaxed);
}

int
ks_metrics_collector_add(ks_metrics_collect_fn fn, void *ctx)
{
    int rc = -ENOSPC;
    pthread_mutex_lock(&g_lock);
    if (g_ncoll < MAX_COLLECTORS) {
        g_coll[g_ncoll].fn = fn;
        g_coll[g_ncoll++].ctx = ctx;
        rc = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

void
ks_metrics_collector_remove(ks_metrics_collect_fn fn, void *ctx)
{
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_ncoll; i++) {
        if (g_coll[i].fn == fn && g_coll[i].ctx == ctx) {
            g_coll[i] = g_coll[--g_ncoll];
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
}

/* ---- text exposition ---------------------------------------------------- */

struct buf {
    char *p;
    size_t len, cap;
    int err;
};

__attribute__((format(printf, 2, 3))) static void
put(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (b->err)
        return;
    for (;;) {
        va_start(ap, fmt);
        n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->err = -EINVAL;
            return;
        }
        if ((size_t)n < b->cap - b->len)
            break;
        size_t cap = b->cap * 2 + (size_t)n;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->err = -ENOMEM;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    b->len += (size_t)n;
}

static void
head(struct buf *b, const char *name, const char *help, const char *type)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label set "{k="v"}" with one more pair, or without any. */
static void
sample(struct buf *b, const char *name, const char *suffix, const char *labels,
       const char *extra, const char *value)
{
    bool any = (labels && labels[0]) || (extra && extra[0]);
    put(b, "%s%s%s%s%s%s%s %s\n", name, suffix, any ? "{" : "",
        labels ? labels : "",
        labels && labels[0] && extra && extra[0] ? "," : "", extra ? extra : "",
        any ? "}" : "", value);
}

static void
fmt_le(char *buf, size_t len, double v)
{
    snprintf(buf, len, "le=\"%g\"", v);
}

int
ks_metrics_render(unsigned roles, char **out, size_t *len)
{
    struct buf b = {.cap = 8192};
    char v[64], le[48];

    *out = NULL;
    *len = 0;
    b.p = malloc(b.cap);
    if (!b.p)
        return -ENOMEM;
    b.p[0] = '\0';

    /* The collected gauges: what the registered collectors see now. One
     * scrape at a time, so a collector's view is never half-summed. */
    pthread_mutex_lock(&g_lock);
    for (int g = 0; g < KS_G__N; g++)
        if (gauges[g].collected)
            atomic_store_explicit(&g_gauge[g], 0, memory_order_relaxed);
    for (size_t i = 0; i < g_ncoll; i++)
        g_coll[i].fn(g_coll[i].ctx);

    const char *family = NULL, *help = NULL;
    for (int c = 0; c < KS_C__N; c++) {
        if (counters[c].help)
            help = counters[c].help;
        if (!(counters[c].roles & roles))
            continue;
        if (!family || strcmp(family, counters[c].name) != 0)
            head(&b, counters[c].name, help, "counter");
        family = counters[c].name;
        snprintf(v, sizeof(v), "%llu",
                 (unsigned long long)atomic_load(&g_counter[c]));
        sample(&b, counters[c].name, "", counters[c].label, NULL, v);
    }
    for (int c = 0; c < KS_SC__N; c++) {
        if (!(status_counters[c].roles & roles))
            continue;
        head(&b, status_counters[c].name, status_counters[c].help, "counter");
        /* Every terminal status, zeros included, so rate() sees each
         * series from its start. */
        for (int st = 0; st <= KS__COMMAND_STATUS__NOT_STARTED; st++) {
            if (!kproto_status_terminal((Ks__CommandStatus)st))
                continue;
            char lab[64];
            snprintf(lab, sizeof(lab), "status=\"%s\"",
                     kproto_status_name((Ks__CommandStatus)st));
            snprintf(v, sizeof(v), "%llu",
                     (unsigned long long)atomic_load(&g_status[c][st]));
            sample(&b, status_counters[c].name, "", lab, NULL, v);
        }
    }
    family = NULL;
    help = NULL;
    for (int g = 0; g < KS_G__N; g++) {
        /* A family's help is on its first entry; its head goes before the
         * first entry this process shows. */
        if (gauges[g].help)
            help = gauges[g].help;
        if (!(gauges[g].roles & roles))
            continue;
        if (!family || strcmp(family, gauges[g].name) != 0)
            head(&b, gauges[g].name, help, "gauge");
        family = gauges[g].name;
        snprintf(v, sizeof(v), "%lld", (long long)atomic_load(&g_gauge[g]));
        sample(&b, gauges[g].name, "", gauges[g].label, NULL, v);
    }
    pthread_mutex_unlock(&g_lock);

    for (int h = 0; h < KS_H__N; h++) {
        struct hist *x = &g_hist[h];
        uint64_t cum = 0;
        if (!(histograms[h].roles & roles))
            continue;
        head(&b, histograms[h].name, histograms[h].help, "histogram");
        for (size_t i = 0; i <= NBUCKETS; i++) {
            cum += atomic_load_explicit(&x->bucket[i], memory_order_relaxed);
            if (i < NBUCKETS)
                fmt_le(le, sizeof(le), buckets[i]);
            else
                snprintf(le, sizeof(le), "le=\"+Inf\"");
            snprintf(v, sizeof(v), "%llu", (unsigned long long)cum);
            sample(&b, histograms[h].name, "_bucket", NULL, le, v);
        }
        /* _count is the +Inf bucket, as the format requires, even while
         * an observation is half-added. */
        snprintf(v, sizeof(v), "%.6f", (double)atomic_load(&x->sum_us) / 1e6);
        sample(&b, histograms[h].name, "_sum", NULL, NULL, v);
        snprintf(v, sizeof(v), "%llu", (unsigned long long)cum);
        sample(&b, histograms[h].name, "_count", NULL, NULL, v);
    }
    if (b.err) {
        free(b.p);
        return b.err;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
