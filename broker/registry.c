/*
 * The agent registry as the broker sees it: a watcher on the KSCORE_AGENTS
 * KV bucket keeps an in-memory map (for the execute path) and the agents
 * projection in PostgreSQL (for `kscore agents`), and provisions each
 * agent's consumer.
 *
 * Consumers: an agent may not use the JetStream API (with it, nats-server
 * 2.9 lets agent A make "agent-A" with filter kscore.cmd.> and read every
 * agent's commands), so the broker makes each one, as evt_agent_consumer
 * says, from what the agent's entry tells: max_concurrent and ack_wait_ms.
 * It does so for every id it has not provisioned yet (at start, for every
 * entry in the bucket: the watcher's initial values), again when the
 * agent's process, max_concurrent or ack wait changes, and every
 * CONSUMER_RECHECK_US anyway, so that a consumer deleted or altered behind
 * its back is put right. evt_consumer_ensure replaces a consumer that
 * delivers anything else than the id's own subject to its deliver subject.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

/* The agents projection is written when an agent appears or changes, and
 * at most every AGENT_STORE_EVERY_US otherwise: heartbeats of 1,000 agents
 * would else be 500 writes a second. */
#define AGENT_STORE_EVERY_US (10 * 1000000)

static bool
info_changed(const Ks__AgentInfo *a, const Ks__AgentInfo *b)
{
    /* An id of a pool is written when it changes, not its running count
     * (agent_needs_store): at 10,000 ids a batch would be 20,000 writes. */
    bool pooled = b->pool && b->pool[0];
    if (a->n_labels != b->n_labels ||
        (!pooled && a->running != b->running) ||
        a->pid != b->pid || strcmp(a->version, b->version) != 0)
        return true;
    for (size_t i = 0; i < a->n_labels; i++)
        if (strcmp(a->labels[i]->name, b->labels[i]->name) != 0 ||
            strcmp(a->labels[i]->value, b->labels[i]->value) != 0)
            return true;
    return false;
}

/* True when the projection should be written for this heartbeat; marks
 * it written. Only the registry thread calls it. */
static bool
agent_needs_store(struct broker *b, const char *key, const Ks__AgentInfo *info)
{
    struct broker__agent *a;
    bool store;
    int64_t now = ks_mono_us();
    /* The ids of a pool are written when they change only: 10,000 ids
     * every AGENT_STORE_EVERY_US would be 1,000 writes a second. */
    bool pooled = info->pool && info->pool[0];

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, key);
    store = !a || !a->info || info_changed(a->info, info) ||
            (!pooled && now - a->stored_mono_us >= AGENT_STORE_EVERY_US);
    if (a && store)
        a->stored_mono_us = now;
    pthread_mutex_unlock(&b->mu);
    return store;
}

static void
drop_labels(Ks__EnvVar ***v, size_t *n)
{
    for (size_t i = 0; i < *n; i++)
        ks__env_var__free_unpacked((*v)[i], NULL);
    free(*v);
    *v = NULL;
    *n = 0;
}

/* A self-declared label named fact.* would read as a fact, and no
 * selector could pick it (fact.* selects facts): the keys are the facts'
 * (the broker signs no label so named). */
static void
drop_fact_labels(Ks__AgentInfo *info)
{
    size_t k = 0, plen = strlen(BROKER_FACT_PREFIX);
    for (size_t i = 0; i < info->n_labels; i++) {
        if (strncmp(info->labels[i]->name, BROKER_FACT_PREFIX, plen) == 0)
            ks__env_var__free_unpacked(info->labels[i], NULL);
        else
            info->labels[k++] = info->labels[i];
    }
    info->n_labels = k;
}

/* 1 when info's attestation is this broker's signature for its id; its
 * text goes to *text (malloc'd) for the cache. */
static bool
attestation_valid(struct broker *b, const Ks__AgentInfo *info, char **text)
{
    struct broker__agent *a;
    size_t len = 0;
    bool hit;

    *text = NULL;
    if (info->labels_signature.len != EVT_SIGNATURE_BYTES ||
        evt_labels_text(info->agent_id, info->labels_enrolled_at_us,
                        info->attested_labels, info->n_attested_labels, text,
                        &len) != 0)
        return false;
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, info->agent_id);
    hit = a && a->attest_text && strcmp(a->attest_text, *text) == 0 &&
          memcmp(a->attest_sig, info->labels_signature.data,
                 EVT_SIGNATURE_BYTES) == 0;
    pthread_mutex_unlock(&b->mu);
    if (hit || evt_verify(b->local_trust, info->labels_key_id, *text, len,
                          info->labels_signature.data,
                          info->labels_signature.len) == 0)
        return true;
    free(*text);
    *text = NULL;
    return false;
}

/* labels_settle's why for an id whose attestation verified before and
 * now does not come (agent_update logs it as an error). */
static const char labels_downgrade[] =
    "this id had a valid label attestation and this entry has none that "
    "verifies: it gets no labels (an enrolled agent's labels are signed or "
    "none)";

/* 1 when an attestation of id verified before (broker__agent.ever_signed). */
static bool
agent_was_signed(struct broker *b, const char *id)
{
    struct broker__agent *a;
    bool was;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, id);
    was = a && a->ever_signed;
    pthread_mutex_unlock(&b->mu);
    return was;
}

/*
 * Decides info's labels, before anything looks at them (settled: what
 * they came from, for agent_update). An agent writes
 * its own entry, so the labels it declares are its own say: with them one
 * agent's credential could take the commands and secrets meant for
 * another group (--select env=prod, label policy rules). What it cannot
 * make up is an attestation: this broker's signature over (its id, its
 * enrolment time, its labels), from `kscore agent enroll` (or from
 * broker_run for the in-process agents). When that verifies with our own
 * key for info's agent_id (the entry's key: entry_problem), info->labels
 * become exactly the attested ones and whatever else it declared is
 * dropped (not shown by `kscore agents`). When it is missing or does not
 * verify, the agent gets no labels at all (still reachable by id) under
 * require_signed_labels (the default), and also when this id's
 * attestation verified before: an enrolled agent that leaves the
 * signature out of its bundle and declares env=dev must not become a dev
 * agent (issue 21). Else, its self-declared labels stand (a single host
 * whose agents were never enrolled, tests). A revoked agent's attestation
 * stays valid as a signature, but its NKey is gone, so it can write no
 * entry to show it in.
 * A relabel of info's subject (kscore agent label: labels.c) newer than
 * its attestation, or for an entry without a valid one, gives it the
 * relabel's labels instead.
 * true when the labels are attested (or a relabel's); *why: NULL, or why
 * not (static text) when that deserves a log line; *verified: the
 * attestation's text (malloc'd, for agent_update's cache) when it
 * verified.
 */
static bool
labels_settle(struct broker *b, Ks__AgentInfo *info, const char **why,
              char **verified, struct broker__settled *settled)
{
    bool require = b->opts && b->opts->require_signed_labels;
    bool was_signed = false, valid;

    *why = NULL;
    *verified = NULL;
    memset(settled, 0, sizeof(*settled));
    valid = info->labels_signature.len && attestation_valid(b, info, verified);
    settled->entry_at_us = valid ? info->labels_enrolled_at_us : 0;
    /* A relabel (labels.c): this broker's later word on the same
     * subject (the id, or the pool's "pool.<pool>/<size>"), newer than
     * the entry's own attestation or standing for a missing one. */
    if (broker__relabel_settle(b, info->agent_id,
                               valid ? info->labels_enrolled_at_us
                                     : INT64_MIN,
                               info, settled)) {
        drop_labels(&info->attested_labels, &info->n_attested_labels);
        return true;
    }
    if (info->labels_signature.len) {
        if (valid) {
            Ks__EnvVar **declared = info->labels;
            size_t n_declared = info->n_labels;
            info->labels = info->attested_labels;
            info->n_labels = info->n_attested_labels;
            info->attested_labels = declared;
            info->n_attested_labels = n_declared;
            drop_labels(&info->attested_labels, &info->n_attested_labels);
            return true;
        }
    }
    if (!require)
        was_signed = agent_was_signed(b, info->agent_id);
    if (was_signed)
        *why = labels_downgrade;
    else if (info->labels_signature.len)
        *why = require ? "its label attestation is not this broker's "
                         "signature over its id and labels: it gets no "
                         "labels (--require-signed-labels)"
                       : "its label attestation is not this broker's "
                         "signature over its id and labels: its "
                         "self-declared labels are used "
                         "(--allow-unsigned-labels)";
    else if (require)
        *why = "it has no label attestation (kscore agent enroll): it gets "
               "no labels (--require-signed-labels)";
    /* Labels under a signature that does not hold mean nothing. */
    drop_labels(&info->attested_labels, &info->n_attested_labels);
    if (require || was_signed)
        drop_labels(&info->labels, &info->n_labels);
    else
        drop_fact_labels(info);
    return false;
}

static void
instance_set(struct broker__instance *in, const Ks__AgentInfo *info,
             int64_t now)
{
    snprintf(in->id, sizeof(in->id), "%s", info->instance_id);
    snprintf(in->host, sizeof(in->host), "%s", info->host);
    in->pid = info->pid;
    in->started_at_us = info->started_at_us;
    in->seen_mono_us = now;
}

/* 1 when a's id is served by two live processes now. Under b->mu. */
static bool
agent_duplicate(const struct broker__agent *a, int64_t now)
{
    return a->dup_mono_us && now - a->dup_mono_us < BROKER_DUP_WINDOW_US &&
           now - a->other.seen_mono_us < BROKER_DUP_WINDOW_US;
}

/*
 * Notes which process info's heartbeat comes from. One id served by two
 * processes (the same bundle on two hosts) shows as heartbeats from two
 * instance ids that interleave: A, then B, then A again while B is live.
 * A restart is a new instance after which the old one is never heard
 * again, so it is never a duplicate. true when this heartbeat starts a
 * duplicate episode (to be logged once). Under b->mu.
 */
static bool
instance_note(struct broker__agent *a, const Ks__AgentInfo *info,
              int64_t now)
{
    bool was = agent_duplicate(a, now);

    if (!info->instance_id[0]) /* an agent from before instance ids */
        return false;
    if (strcmp(a->cur.id, info->instance_id) == 0) {
        instance_set(&a->cur, info, now);
    } else if (strcmp(a->other.id, info->instance_id) == 0 &&
               now - a->cur.seen_mono_us < BROKER_DUP_WINDOW_US) {
        struct broker__instance t = a->cur;
        a->cur = a->other;
        a->other = t;
        instance_set(&a->cur, info, now);
        a->dup_mono_us = now;
    } else {
        a->other = a->cur;
        instance_set(&a->cur, info, now);
    }
    if (!agent_duplicate(a, now)) {
        if (!was)
            a->dup_logged = false;
        return false;
    }
    if (a->dup_logged)
        return false;
    a->dup_logged = true;
    return true;
}

/* The newer of a duplicate's two processes (started later; the instance
 * id breaks a tie). Under b->mu. */
static const struct broker__instance *
instance_newer(const struct broker__agent *a)
{
    if (a->cur.started_at_us != a->other.started_at_us)
        return a->cur.started_at_us > a->other.started_at_us ? &a->cur
                                                             : &a->other;
    return strcmp(a->cur.id, a->other.id) > 0 ? &a->cur : &a->other;
}

int
broker__claim_instance_ok(struct broker *b, const char *agent_id,
                          const char *instance_id, char *why, size_t why_len)
{
    struct broker__agent *a;
    int rc = 0;

    if (!instance_id || !instance_id[0])
        return 0;
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && agent_duplicate(a, ks_mono_us())) {
        const struct broker__instance *n = instance_newer(a);
        const struct broker__instance *o = n == &a->cur ? &a->other : &a->cur;
        if (strcmp(n->id, instance_id) == 0) {
            snprintf(why, why_len,
                     "duplicate agent: another process (host %s, pid %d, "
                     "instance %s, started earlier) serves agent '%s'; this "
                     "one (host %s, pid %d) may not claim: stop one of them",
                     o->host, (int)o->pid, o->id, agent_id, n->host,
                     (int)n->pid);
            rc = KS_EDUPINSTANCE;
        }
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/*
 * true when info, put in the bucket at put_us by the server's clock (the
 * JetStream timestamp of the KV message: kvEntry_Created), is a live
 * heartbeat: a process that heartbeats now. server_us: the newest server
 * time the watch has seen (the beacons and heartbeats of every 2 s), so
 * the broker's own clock never enters. An entry the server stored more
 * than the window ago is not one (an initial value of a new watch, a
 * bucket whose TTL is longer than the window). Nor is one whose own
 * heartbeat time is more than the window off the server's time of its
 * put: a heartbeat written by the agent credential from an old AgentInfo
 * (issue 21: one 867 s old made the live process a duplicate, and it
 * exited). An agent writes its heartbeat_at_us itself, so that is only
 * half of it: a forger who writes the time of now is a live process to
 * the broker, and the falsely refused agent stands aside for as long only
 * (agent/runtime.c claim). An agent whose clock is off by more than the
 * window is never taken for a second process: both then claim, and the
 * claim fence keeps each command to one run. Registry thread.
 */
static bool
heartbeat_live(const Ks__AgentInfo *info, int64_t put_us, int64_t server_us)
{
    int64_t skew = put_us - info->heartbeat_at_us;
    return put_us > 0 && server_us - put_us < BROKER_DUP_WINDOW_US &&
           skew < BROKER_DUP_WINDOW_US && -skew < BROKER_DUP_WINDOW_US;
}

/* One log line per this much time for heartbeats not live (us). */
#define STALE_LOG_EVERY_US (10 * 1000000)

static void
heartbeat_stale(const char *key, const Ks__AgentInfo *info, int64_t put_us)
{
    static _Atomic int64_t logged_us;
    int64_t now = ks_mono_us();
    if (now - logged_us < STALE_LOG_EVERY_US)
        return;
    logged_us = now;
    ks_log(KS_LOG_WARN,
           "an agent's registry entry is no live heartbeat: not counted as "
           "a process of its id (logged once per 10 s)",
           KS_S("module", "registry"), KS_S("agent", key),
           KS_S("instance", info->instance_id),
           KS_D("behind_s", (double)(put_us - info->heartbeat_at_us) / 1e6));
}

/* ---- what a heartbeat lists (AgentInfo.holds) ----------------------------- */

static bool registry_deaf_locked(struct broker *b, int64_t now);

static int
cmp_id16(const void *x, const void *y)
{
    return memcmp(x, y, 16);
}

/*
 * Takes info's list of held commands out of info (the map keeps info
 * without it: a pool's list would else be copied into every id's entry)
 * and makes it a broker__holds with one reference; NULL when info has no
 * complete list from a process that numbers its heartbeats (an older
 * agent, or too many to list), or no memory. The list is the agent's
 * word: sorted here, not trusted to be; an id not 16 bytes voids it.
 */
static struct broker__holds *
holds_take(Ks__AgentInfo *info)
{
    struct broker__holds *h = NULL;
    bool ok = info->holds_complete && info->heartbeat_seq > 0 &&
              info->instance_id[0];

    for (size_t i = 0; ok && i < info->n_holds; i++)
        ok = info->holds[i].len == 16;
    if (ok && (h = malloc(sizeof(*h) + info->n_holds * 16))) {
        h->refs = 1;
        snprintf(h->instance, sizeof(h->instance), "%s", info->instance_id);
        h->seq = info->heartbeat_seq;
        h->n = info->n_holds;
        for (size_t i = 0; i < h->n; i++)
            memcpy(h->ids[i], info->holds[i].data, 16);
        qsort(h->ids, h->n, 16, cmp_id16);
    }
    /* protobuf-c's unpacked repeated bytes: each element and the array
     * malloc'd (system allocator). */
    for (size_t i = 0; i < info->n_holds; i++)
        free(info->holds[i].data);
    free(info->holds);
    info->holds = NULL;
    info->n_holds = 0;
    return h;
}

/* Drops one reference. Under b->mu (or before h is shared). */
static void
holds_unref_locked(struct broker__holds *h)
{
    if (h && --h->refs == 0)
        free(h);
}

int
broker__agent_lists(struct broker *b, const char *agent_id,
                    const uint8_t command[16], char instance[37],
                    uint64_t *seq, int64_t *listed_at_us)
{
    struct broker__agent *a;
    int64_t now = ks_mono_us();
    int rc = -1;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && a->holds && !registry_deaf_locked(b, now) &&
        now - a->seen_mono_us < (int64_t)EVT_AGENT_TTL_MS * 1000) {
        rc = bsearch(command, a->holds->ids, a->holds->n, 16, cmp_id16) != NULL;
        if (rc == 0) {
            memcpy(instance, a->holds->instance, 37);
            *seq = a->holds->seq;
            if (listed_at_us)
                *listed_at_us = ks_now_us() - (now - a->holds_mono_us);
        }
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

bool
broker__instance_silent(struct broker *b, const char *agent_id,
                        const char *instance)
{
    struct broker__agent *a;
    int64_t now = ks_mono_us(), ttl = (int64_t)EVT_AGENT_TTL_MS * 1000;
    bool silent = true;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (registry_deaf_locked(b, now))
        silent = false; /* a deaf view tells no silence (helper-24) */
    else if (a && !strcmp(a->cur.id, instance))
        silent = now - a->cur.seen_mono_us >= ttl;
    else if (a && !strcmp(a->other.id, instance))
        silent = now - a->other.seen_mono_us >= ttl;
    pthread_mutex_unlock(&b->mu);
    return silent;
}

/* Takes info into the registry map (which owns it from here), with its
 * labels decided by labels_settle; heard_mono_us: when the entry was put,
 * on this broker's monotonic clock. watched: info is the watcher's, which
 * sees the entries in order; an entry read from the bucket meanwhile
 * (broker__agent_known) may be newer than what the watcher delivers next,
 * so it says nothing about which process heartbeats (instance_note) or
 * what it holds; nor does one that is no live heartbeat (live:
 * heartbeat_live). holds: info's list (holds_take; one reference, taken;
 * may be NULL). */
/* broker__agent_queue of a (NULL: not known), under b->mu. */
static void
queue_key_locked(const struct broker__agent *a, const char *agent_id,
                 char *key, size_t len, unsigned *slots)
{
    *slots = a && a->info ? a->info->max_concurrent : 0;
    if (a && a->info && a->info->pool && a->info->pool[0])
        snprintf(key, len, "pool:%s", a->info->pool);
    else if (a && a->cur.id[0])
        snprintf(key, len, "proc:%s", a->cur.id);
    else
        snprintf(key, len, "id:%s", agent_id);
}

static void
agent_update(struct broker *b, const char *key, Ks__AgentInfo *info,
             bool labels_signed, const struct broker__settled *settled,
             const char *why, char *verified, bool watched, bool live,
             struct broker__holds *holds, int64_t heard_mono_us)
{
    struct broker__agent *a;
    bool warn = false;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, key);
    if (!a) {
        a = calloc(1, sizeof(*a));
        if (!a || ks_map_put(&b->agents, key, a) != 0) {
            free(a);
            holds_unref_locked(holds);
            pthread_mutex_unlock(&b->mu);
            ks__agent_info__free_unpacked(info, NULL);
            free(verified);
            return;
        }
        a->stored_mono_us = ks_mono_us();
    }
    /* When the entry was put, not when it came: a new watch replays the
     * latest entry of every id, however old (registry_main). */
    if (heard_mono_us > a->seen_mono_us)
        a->seen_mono_us = heard_mono_us;
    bool dup = watched && live && instance_note(a, info, ks_mono_us());
    if (watched && live) {
        /* The latest heartbeat's list, or none (an older agent, too many
         * to list): never an older list standing for a newer heartbeat. */
        holds_unref_locked(a->holds);
        a->holds = holds;
        a->holds_mono_us = heard_mono_us;
        holds = NULL;
    }
    holds_unref_locked(holds);
    struct broker__instance c = a->cur, o = a->other;
    if (a->info)
        ks__agent_info__free_unpacked(a->info, NULL);
    a->info = info;
    a->labels_signed = labels_signed;
    a->ever_signed = a->ever_signed || labels_signed;
    a->entry_at_us = settled->entry_at_us;
    a->relabel_at_us = settled->relabelled ? settled->at_us : 0;
    snprintf(a->relabel_by, sizeof(a->relabel_by), "%s",
             settled->relabelled ? settled->by : "");
    /* What verified, for the next heartbeat to match (cache). */
    if (verified)
        memcpy(a->attest_sig, info->labels_signature.data,
               EVT_SIGNATURE_BYTES);
    free(a->attest_text);
    a->attest_text = verified;
    /* Once per agent (again after it had a valid one), not per
     * heartbeat. */
    warn = why && !a->unsigned_warned;
    a->unsigned_warned = why != NULL;
    /* What it runs now, for admission (admit.c): from a live heartbeat
     * only, never a replayed old entry. */
    char qkey[EVT_AGENT_ID_MAX + 48];
    unsigned slots = 0;
    uint32_t running = info->running;
    uint64_t seq = info->heartbeat_seq;
    if (watched && live)
        queue_key_locked(a, key, qkey, sizeof(qkey), &slots);
    pthread_mutex_unlock(&b->mu);
    if (watched && live)
        broker__admit_agent_running(b, qkey, key, slots, running, seq,
                                    heard_mono_us);
    if (dup) {
        const struct broker__instance *n =
            c.started_at_us > o.started_at_us ||
                    (c.started_at_us == o.started_at_us &&
                     strcmp(c.id, o.id) > 0)
                ? &c
                : &o;
        const struct broker__instance *old = n == &c ? &o : &c;
        ks_log(KS_LOG_ERROR,
               "duplicate agent: two processes serve one id (the newer one's "
               "claims are refused)",
               KS_S("module", "registry"), KS_S("agent", key),
               KS_S("host", old->host), KS_I("pid", old->pid),
               KS_S("instance", old->id), KS_S("newer_host", n->host),
               KS_I("newer_pid", n->pid), KS_S("newer_instance", n->id));
    }
    if (warn && why == labels_downgrade)
        ks_log(KS_LOG_ERROR,
               "refused an enrolled agent's unsigned labels (it keeps none)",
               KS_S("module", "registry"), KS_S("agent", key),
               KS_S("error", why));
    else if (warn)
        ks_log(KS_LOG_WARN, "agent labels not attested",
               KS_S("module", "registry"), KS_S("agent", key),
               KS_S("error", why));
}

/* The projection write failed (PostgreSQL away): the next heartbeat
 * writes again instead of AGENT_STORE_EVERY_US later. */
static void
agent_store_failed(struct broker *b, const char *key)
{
    struct broker__agent *a;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, key);
    if (a)
        a->stored_mono_us = ks_mono_us() - AGENT_STORE_EVERY_US;
    pthread_mutex_unlock(&b->mu);
}

/*
 * What one registry entry may hold. An agent writes its own entry, so its
 * size is the agent's choice: without a bound one agent could put a 1 MiB
 * entry that the broker keeps (until it restarts) and packs into every
 * `kscore agents` reply, which then exceeds the max payload, so listing
 * the agents, and every --secret-env (the CLI reads the keys through that
 * list), fails for everyone. A real entry is a few hundred bytes.
 */
#define AGENT_INFO_MAX_BYTES BROKER_AGENT_INFO_MAX_BYTES
#define AGENT_INFO_MAX_LABELS BROKER_AGENT_INFO_MAX_LABELS

/* NULL when info may be taken for key, else why not (static text). */
static const char *
entry_problem(const char *key, const Ks__AgentInfo *info, size_t packed)
{
    if (!evt_agent_id_valid(info->agent_id) ||
        strcmp(info->agent_id, key) != 0)
        return "its agent_id is not its key";
    /* A pool is named by its ids: "<pool>-..." only, so an agent of
     * another name (another credential) cannot put its entry, and with it
     * the limits of the pool's consumer, into a pool it is not part of. */
    if (info->pool && info->pool[0] &&
        (!evt_agent_id_valid(info->pool) ||
         strncmp(info->agent_id, info->pool, strlen(info->pool)) != 0 ||
         info->agent_id[strlen(info->pool)] != '-'))
        return "its pool is not the start of its agent_id (<pool>-...)";
    /* A pool heartbeats its "pool.<pool>" key only (agent/runtime.c): an
     * id's own key naming a pool is another credential's (agent-<pool>-X,
     * enrolled on its own), which would otherwise route its commands into
     * the pool's consumer and set that consumer's limits. */
    if (info->pool && info->pool[0])
        return "an agent's own entry names a pool (only pool.<pool> may)";
    if (packed > AGENT_INFO_MAX_BYTES)
        return "larger than 8 KiB";
    if (info->n_labels > AGENT_INFO_MAX_LABELS ||
        info->n_attested_labels > AGENT_INFO_MAX_LABELS)
        return "more than 128 labels";
    if (info->n_facts > BROKER_AGENT_INFO_MAX_FACTS)
        return "more than 32 facts";
    return NULL;
}

/* One log line per this much time for refused entries (us). */
#define ENTRY_LOG_EVERY_US (10 * 1000000)

static void
entry_refused(const char *key, const char *why)
{
    static _Atomic int64_t logged_us;
    int64_t now = ks_mono_us();
    if (now - logged_us < ENTRY_LOG_EVERY_US)
        return;
    logged_us = now;
    ks_log(KS_LOG_WARN,
           "ignored an agent's registry entry (logged once per 10 s)",
           KS_S("module", "registry"), KS_S("agent", key),
           KS_S("error", why));
}

/* A consumer is checked again this often though nothing changed (us). */
#define CONSUMER_RECHECK_US (60 * 1000000)
/* One log line per this much time for failures to provision (us). */
#define PROVISION_LOG_EVERY_US (10 * 1000000)

/* What an agent's consumer was last made from. Registry thread only. */
struct provisioned {
    int32_t pid;
    uint32_t max_concurrent;
    uint64_t ack_wait_ms;
    int64_t checked_mono_us;
};

struct provisioner {
    struct ks_map done; /* agent id -> struct provisioned * */
    int64_t err_logged_us;
};

static void
free_provisioned(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

/* Makes agent_id's consumer (or its pool's, when info->pool is set) as
 * its entry says, unless it was made so lately; key: the id, or
 * "pool:<pool>". A failure (JetStream away) is tried again at the next
 * heartbeat. Registry thread. */
static void
provision(struct broker *b, struct provisioner *pv, const char *key,
          const Ks__AgentInfo *info)
{
    struct provisioned *p = ks_map_get(&pv->done, key);
    struct evt_agent_consumer ac;
    enum evt_consumer_change change = EVT_CONSUMER_KEPT;
    int64_t now = ks_mono_us();
    char *err = NULL;

    if (p && p->pid == info->pid &&
        p->max_concurrent == info->max_concurrent &&
        p->ack_wait_ms == info->ack_wait_ms &&
        now - p->checked_mono_us < CONSUMER_RECHECK_US)
        return;
    if (info->pool && info->pool[0])
        evt_pool_consumer(&ac, info->pool, info->max_concurrent,
                          info->ack_wait_ms);
    else
        evt_agent_consumer(&ac, info->agent_id, info->max_concurrent,
                           info->ack_wait_ms);
    if (evt_consumer_ensure(b->nc, &ac.d, &change, &err) != 0) {
        if (now - pv->err_logged_us > PROVISION_LOG_EVERY_US) {
            pv->err_logged_us = now;
            ks_log(KS_LOG_WARN,
                   "cannot provision the agent's consumer (tried again at "
                   "its next heartbeat)",
                   KS_S("module", "registry"), KS_S("agent", info->agent_id),
                   KS_S("error", err ? err : "?"));
        }
        free(err);
        return;
    }
    if (change == EVT_CONSUMER_REPLACED)
        ks_log(KS_LOG_WARN, "consumer delivered something else: replaced",
               KS_S("module", "registry"), KS_S("agent", info->agent_id),
               KS_S("consumer", ac.d.durable),
               KS_S("filter", ac.d.filter_subject));
    if (!p) {
        p = calloc(1, sizeof(*p));
        if (!p || ks_map_put(&pv->done, key, p) != 0) {
            free(p);
            return; /* checked again next time */
        }
    }
    p->pid = info->pid;
    p->max_concurrent = info->max_concurrent;
    p->ack_wait_ms = info->ack_wait_ms;
    p->checked_mono_us = now;
}

/* Drops a purged entry from the map and the provisioner. Registry
 * thread. */
static void
agent_forget(struct broker *b, const char *key)
{
    struct broker__agent *a;

    pthread_mutex_lock(&b->mu);
    a = ks_map_del(&b->agents, key);
    pthread_mutex_unlock(&b->mu);
    if (a) {
        if (a->info)
            ks__agent_info__free_unpacked(a->info, NULL);
        pthread_mutex_lock(&b->mu);
        holds_unref_locked(a->holds);
        pthread_mutex_unlock(&b->mu);
        free(a->attest_text);
        free(a);
        ks_log(KS_LOG_INFO,
               "agent left the registry (revoked): commands for it are "
               "refused",
               KS_S("agent", key));
    }
}

/*
 * The provisioner's own thread. On a JetStream cluster making a consumer
 * is a raft proposal (about 200 ms here) and asking one whose node died
 * waits for its new leader (seconds): done on the registry thread, 50
 * new agents kept it from reading heartbeats for 10 s, long enough for
 * the agents it had seen first to look offline (a batch then ended them
 * Undeliverable). The registry thread only queues what to provision; the
 * latest entry of an id replaces the one queued before.
 */
struct prov_req {
    char pool[EVT_AGENT_ID_MAX + 1]; /* "": the id's own consumer */
    int32_t pid;
    uint32_t max_concurrent;
    uint64_t ack_wait_ms;
    bool forget;
};

struct provq {
    struct broker *b;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    struct ks_map pending; /* agent id -> struct prov_req * */
    bool stop;
    pthread_t thread;
};

static void
provq_push(struct provq *q, const char *id, const Ks__AgentInfo *info)
{
    struct prov_req *r = calloc(1, sizeof(*r));
    char key[8 + EVT_AGENT_ID_MAX];
    if (!r)
        return; /* the next heartbeat queues it again */
    /* The ids of a pool share one consumer: one request for all of them,
     * under a key no agent id can be (':' is not in an id). */
    if (info && info->pool && info->pool[0]) {
        snprintf(key, sizeof(key), "pool:%s", info->pool);
        snprintf(r->pool, sizeof(r->pool), "%s", info->pool);
        id = key;
    }
    if (info) {
        r->pid = info->pid;
        r->max_concurrent = info->max_concurrent;
        r->ack_wait_ms = info->ack_wait_ms;
    } else {
        r->forget = true;
    }
    pthread_mutex_lock(&q->mu);
    void *old = ks_map_get(&q->pending, id);
    if (ks_map_put(&q->pending, id, r) == 0)
        free(old);
    else
        free(r);
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->mu);
}

struct prov_item {
    char id[8 + EVT_AGENT_ID_MAX];
    struct prov_req *r;
};

struct prov_take {
    struct prov_item *items;
    size_t n;
};

static void
take_one(const char *key, void *val, void *ud)
{
    struct prov_take *t = ud;
    snprintf(t->items[t->n].id, sizeof(t->items[t->n].id), "%s", key);
    t->items[t->n++].r = val;
}

static void *
provq_main(void *arg)
{
    struct provq *q = arg;
    struct provisioner pv = {KS_MAP_INIT, 0};

    pthread_mutex_lock(&q->mu);
    while (!q->stop) {
        if (q->pending.count == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 250 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&q->cond, &q->mu, &ts);
            continue;
        }
        struct prov_take t = {calloc(q->pending.count, sizeof(*t.items)), 0};
        if (!t.items) {
            pthread_mutex_unlock(&q->mu);
            nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
            pthread_mutex_lock(&q->mu);
            continue;
        }
        ks_map_each(&q->pending, take_one, &t);
        ks_map_clear(&q->pending);
        pthread_mutex_unlock(&q->mu);
        for (size_t i = 0; i < t.n; i++) {
            struct prov_req *r = t.items[i].r;
            if (r->forget) {
                free(ks_map_del(&pv.done, t.items[i].id));
            } else if (!q->stop) {
                Ks__AgentInfo info = KS__AGENT_INFO__INIT;
                info.agent_id = t.items[i].id;
                info.pid = r->pid;
                info.max_concurrent = r->max_concurrent;
                info.ack_wait_ms = r->ack_wait_ms;
                info.pool = r->pool;
                provision(q->b, &pv, t.items[i].id, &info);
            }
            free(r);
        }
        free(t.items);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    ks_map_each(&pv.done, free_provisioned, NULL);
    ks_map_clear(&pv.done);
    return NULL;
}

struct pool_members {
    const char *pool;
    char **ids;
    size_t n, cap;
};

static void
pool_member(const char *key, void *val, void *ud)
{
    struct pool_members *pm = ud;
    const struct broker__agent *a = val;
    if (!a->info || !a->info->pool || strcmp(a->info->pool, pm->pool) != 0)
        return;
    if (pm->n == pm->cap) {
        size_t nc = pm->cap ? pm->cap * 2 : 64;
        char **x = realloc(pm->ids, nc * sizeof(*x));
        if (!x)
            return;
        pm->ids = x;
        pm->cap = nc;
    }
    if ((pm->ids[pm->n] = strdup(key)))
        pm->n++;
}

/* `kscore agent revoke pool-<pool>` purged the pool's entry: every id of
 * the pool is forgotten, as a revoked agent is. Registry thread. */
static void
pool_forget(struct broker *b, const char *pool)
{
    struct pool_members pm = {.pool = pool};

    pthread_mutex_lock(&b->mu);
    ks_map_each(&b->agents, pool_member, &pm);
    pthread_mutex_unlock(&b->mu);
    for (size_t i = 0; i < pm.n; i++) {
        agent_forget(b, pm.ids[i]);
        free(pm.ids[i]);
    }
    free(pm.ids);
    if (pm.n)
        ks_log(KS_LOG_INFO, "agent pool forgotten (revoked)",
               KS_S("module", "registry"), KS_S("pool", pool),
               KS_I("ids", pm.n));
}

/* NULL when info may be taken as the entry of pool key ("pool.<pool>"),
 * else why not (static text). */
static const char *
pool_problem(const char *key, const Ks__AgentInfo *info, size_t packed)
{
    const char *pool = key + strlen(EVT_POOL_KEY_PREFIX);

    if (!info->pool || strcmp(info->pool, pool) != 0 ||
        !evt_agent_id_valid(pool))
        return "its pool is not its key";
    if (packed > BROKER_POOL_INFO_MAX_BYTES)
        return "a pool entry larger than 256 KiB";
    if (info->n_labels > AGENT_INFO_MAX_LABELS)
        return "more than 128 labels";
    if (info->n_facts > BROKER_AGENT_INFO_MAX_FACTS)
        return "more than 32 facts";
    if (info->pool_size == 0 || info->pool_size > BROKER_POOL_MAX ||
        info->n_pool_ids > info->pool_size)
        return "its pool_size is 0, over the limit, or below its ids";
    /* Only <pool>-0 .. <pool>-<size-1>: not another agent's id that
     * happens to start with "<pool>-" (px-a-0 of pool px-a, or an
     * enrolled px-web), and no more than the signed size. */
    for (size_t i = 0; i < info->n_pool_ids; i++) {
        const char *id = info->pool_ids[i];
        if (!evt_agent_id_valid(id) ||
            evt_pool_index(pool, id, info->pool_size) < 0)
            return "an id of the pool is not <pool>-<n>, n below its size";
    }
    return NULL;
}

/*
 * A pool's entry (evt_pool_put): one heartbeat for every id it lists.
 * Each id gets its own entry in the broker's map (as if it had written
 * one: addressable, claimable and listed on its own), made from the
 * pool's with its agent_id, and the pool's consumer is provisioned once.
 * Only the pool's own credential (deploy/nats-auth.conf.in) or the
 * broker's can write its "pool." key. Takes info. Registry thread.
 */
static void
pool_seen(struct broker *b, struct provq *q, const char *key,
          Ks__AgentInfo *info, size_t packed, bool live, int64_t heard_mono_us)
{
    const char *bad = pool_problem(key, info, packed);
    uint8_t *tmpl = NULL;
    size_t tlen = 0;

    if (bad) {
        entry_refused(key, bad);
        ks__agent_info__free_unpacked(info, NULL);
        return;
    }
    /* A pool's labels as an agent's: what this broker signed for it
     * (over "pool.<pool>/<size>": `kscore agent enroll --pool-size`, or a
     * broker's own local pool). */
    char *own_id0 = info->agent_id, *verified = NULL,
         attest_id[sizeof(EVT_POOL_KEY_PREFIX) + EVT_AGENT_ID_MAX + 12];
    const char *why = NULL;
    struct broker__settled settled;
    evt_pool_attest_id(attest_id, sizeof(attest_id), info->pool,
                       info->pool_size);
    info->agent_id = attest_id;
    bool sig = labels_settle(b, info, &why, &verified, &settled);
    info->agent_id = own_id0;
    free(verified);
    /* The pool's name and size are this broker's word, or nothing: an
     * unsigned entry could name any size, and with it any number of ids
     * for the broker to keep. */
    if (!sig) {
        entry_refused(key, "a pool without this broker's signature over its "
                           "name and size (kscore agent enroll NAME "
                           "--pool-size N; a broker signs its own local pool)");
        ks__agent_info__free_unpacked(info, NULL);
        return;
    }
    provq_push(q, key, info);
    /* One list for the pool's ids: each id's entry refers to it. */
    struct broker__holds *holds = holds_take(info);
    /* The template of each id's entry: a shallow copy of the pool's
     * without its lists and without the whole pool's running count (not
     * one id's). */
    char **ids = info->pool_ids;
    size_t n = info->n_pool_ids;
    const uint32_t *per_id = info->pool_running;
    size_t n_per_id = info->n_pool_running;
    Ks__AgentInfo t = *info;
    t.pool_ids = NULL;
    t.n_pool_ids = 0;
    t.pool_running = NULL;
    t.n_pool_running = 0;
    t.running = 0;
    t.agent_id = (char *)"";
    int rc = kproto_pack(&t.base, &tmpl, &tlen);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        Ks__AgentInfo *m = ks__agent_info__unpack(NULL, tlen, tmpl);
        char *id = m ? strdup(ids[i]) : NULL;
        if (!id) {
            if (m)
                ks__agent_info__free_unpacked(m, NULL);
            break;
        }
        m->agent_id = id; /* "" unpacked is protobuf-c's static default */
        if (n_per_id == n)
            m->running = per_id[i];
        bool unstored = agent_needs_store(b, id, m) &&
                        store_upsert_agent(b->st_reg, m) != 0;
        if (holds) {
            pthread_mutex_lock(&b->mu);
            holds->refs++;
            pthread_mutex_unlock(&b->mu);
        }
        agent_update(b, ids[i], m, sig, &settled, NULL, NULL, true, live,
                     holds, heard_mono_us);
        if (unstored)
            agent_store_failed(b, ids[i]);
    }
    pthread_mutex_lock(&b->mu);
    holds_unref_locked(holds);
    pthread_mutex_unlock(&b->mu);
    free(tmpl);
    ks__agent_info__free_unpacked(info, NULL);
}

/* Notes a broker's beacon (its id). Registry thread. */
static void
beacon_heard(struct broker *b, const char *id, int64_t heard_mono_us)
{
    pthread_mutex_lock(&b->mu);
    int64_t *at = ks_map_get(&b->brokers, id);
    if (!at && (at = calloc(1, sizeof(*at))) &&
        ks_map_put(&b->brokers, id, at) != 0) {
        free(at);
        at = NULL;
    }
    if (at && heard_mono_us > *at)
        *at = heard_mono_us;
    pthread_mutex_unlock(&b->mu);
}

/* FNV-1a of a then b: the rendezvous score of broker a for name b. */
static uint64_t
rendezvous(const char *a, const char *name)
{
    uint64_t h = 1469598103934665603ULL;
    for (const char *p = a; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    h = (h ^ '/') * 1099511628211ULL;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    return h;
}

struct owner_pick {
    const char *name;
    const char *self;
    int64_t now;
    bool other_wins;
};

static void
owner_one(const char *key, void *val, void *ud)
{
    struct owner_pick *o = ud;
    const int64_t *at = val;
    if (strcmp(key, o->self) != 0 &&
        o->now - *at < (int64_t)EVT_AGENT_TTL_MS * 1000 &&
        rendezvous(key, o->name) > rendezvous(o->self, o->name))
        o->other_wins = true;
}

static bool registry_deaf_locked(struct broker *b, int64_t now);

/*
 * The instant a registry view is judged at, under b->mu (mono us): now
 * while it is fresh; while it is deaf (registry_deaf_locked), when it was
 * last whole (reg_fresh_mono_us: not the middle of a new watch's replay),
 * for a view that has missed what came since judges an age by now as if
 * every agent had stopped when it stopped hearing. *stale_us: how long
 * before now that is (0 when fresh); may be NULL.
 */
static int64_t
view_instant_locked(struct broker *b, int64_t now, int64_t *stale_us)
{
    int64_t at = now;
    if (registry_deaf_locked(b, now) && b->reg_fresh_mono_us &&
        b->reg_fresh_mono_us < now)
        at = b->reg_fresh_mono_us;
    if (stale_us)
        *stale_us = now - at;
    return at;
}

bool
broker__guard_owner(struct broker *b, const char *name)
{
    pthread_mutex_lock(&b->mu);
    struct owner_pick o = {name, b->beacon_id, ks_mono_us(), false};
    /* A registry view that is not fresh (a watch made again after a node
     * died, a bucket without a leader, a pause) has missed the other
     * brokers' recent beacons, not lost the brokers: judged against now,
     * every broker took itself for the owner, and each repaired the same
     * stall (test_cluster a_consumer_stalled_by_a_lost_ack_is_repaired:
     * "repaired 2 times"). Such a view is judged as of its last entry,
     * so deaf brokers agree on the owner as the others do; an owner that
     * died meanwhile is covered by the backups (stall.c). */
    bool deaf = registry_deaf_locked(b, o.now);
    if (deaf && b->reg_entry_mono_us)
        o.now = b->reg_entry_mono_us;
    /* Deaf since its start (its first watch on a node that is down): it
     * has heard no broker at all, so it owns nothing (helper-24). */
    bool unheard = deaf && !b->reg_entry_mono_us;
    if (!unheard)
        ks_map_each(&b->brokers, owner_one, &o);
    pthread_mutex_unlock(&b->mu);
    return !unheard && !o.other_wins;
}

/* A watch that has delivered nothing for this long, not even this
 * broker's own beacon, is dead (see registry_main): two beacons missed
 * and half a second, a moment after broker__registry_deaf says so. */
#define REGISTRY_SILENT_US ((2 * EVT_HEARTBEAT_MS + 500) * INT64_C(1000))
/* How long the beacon waits for the bucket's PubAck, and how soon it is
 * tried again while the bucket takes none (ms). */
#define BEACON_TIMEOUT_MS 1000
#define BEACON_RETRY_MS 250
/* A new watch that has not delivered its initial values this long after
 * it was made delivers nothing (registry_main). */
#define REGISTRY_CATCHUP_US (3000 * INT64_C(1000))

/*
 * A dead watch is destroyed on a thread of its own: nats.c deletes the
 * watch's consumer as it unsubscribes (natsSubscription_Unsubscribe ->
 * jsSub_deleteConsumer in 3.4.1, a JetStream API request with the
 * context's 5 s wait), and a watch is dead because its consumer's node
 * is, so the delete waits out its timeout. On the registry thread that
 * wait held up the new watch, the beacons and with them the end of
 * deafness: a broker told nobody offline for 10 s and more after a node
 * died (F04, test_cluster registry_watch_node_dies). The server removes
 * the ephemeral consumer by itself once inactive.
 */
static void *
reap_watch(void *arg)
{
    void **a = arg;
    struct broker *b = a[0];
    kvWatcher_Destroy(a[1]);
    free(a);
    atomic_fetch_sub(&b->reg_reaping, 1);
    return NULL;
}

static void
watch_let_go(struct broker *b, kvWatcher *w)
{
    pthread_attr_t attr;
    pthread_t t;
    void **a = malloc(2 * sizeof(*a));

    if (!a) {
        kvWatcher_Destroy(w);
        return;
    }
    a[0] = b;
    a[1] = w;
    atomic_fetch_add(&b->reg_reaping, 1);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, reap_watch, a) != 0)
        reap_watch(a); /* here, then */
    pthread_attr_destroy(&attr);
}

/*
 * How registry entries are dated on this broker's monotonic clock. An
 * entry carries its put as the server's time (kvEntry_Created: the stream
 * leader's wall clock); the broker needs it on its own clock, to judge
 * silences.
 * - The reference is this broker's own beacon: its PubAck says which
 *   revision is its own and when it came back (mono), and the watch then
 *   delivers that revision with its server time. Every other entry is
 *   dated ref_mono + (put_us - ref_put_us), never later than it arrived.
 *   The pair is renewed with each beacon (every EVT_HEARTBEAT_MS), so a
 *   step of the server's clock or a leader on another node with another
 *   clock is followed within a beacon.
 * - Until the first beacon comes through, an entry newer than any seen is
 *   taken as put when it came. That rule alone dated the last heartbeat of
 *   an agent that stopped while the watch was dead at the new watch's
 *   initial values, a whole outage late (F04: olddb online 14.7 s after it
 *   stopped, issue 22); a reference taken before the outage dates it when
 *   it was put.
 * The registry thread's alone.
 */
#define CLOCK_ACKS 8
struct server_clock {
    int64_t newest_us, newest_mono; /* newest server time seen, and when */
    int64_t ref_put_us, ref_mono;   /* own beacon: put (server), mono */
    struct {
        uint64_t seq;
        int64_t mono;
    } acked[CLOCK_ACKS]; /* own beacons acknowledged, not seen yet */
    unsigned next;
};

/* This broker's beacon got revision seq, put between sent and acked
 * (mono us): the midpoint is its time, within half a round trip. */
static void
clock_acked(struct server_clock *c, uint64_t seq, int64_t sent,
            int64_t acked)
{
    c->acked[c->next % CLOCK_ACKS].seq = seq;
    c->acked[c->next % CLOCK_ACKS].mono = sent + (acked - sent) / 2;
    c->next++;
}

/* An entry put at put_us (server us) came at arrived (mono us); own: it
 * is this broker's beacon, at revision rev. When it was put, mono us. */
static int64_t
clock_heard(struct server_clock *c, bool own, uint64_t rev, int64_t put_us,
            int64_t arrived)
{
    if (own) {
        for (unsigned k = 0; k < CLOCK_ACKS; k++) {
            if (c->acked[k].seq == rev && rev) {
                c->ref_put_us = put_us;
                c->ref_mono = c->acked[k].mono;
                c->acked[k].seq = 0;
                break;
            }
        }
    }
    if (put_us > c->newest_us) {
        c->newest_us = put_us;
        c->newest_mono = arrived;
    }
    int64_t heard = c->ref_mono
                        ? c->ref_mono + (put_us - c->ref_put_us)
                        : c->newest_mono - (c->newest_us - put_us);
    return heard < arrived ? heard : arrived;
}

static void *
registry_main(void *arg)
{
    struct broker *b = arg;
    kvWatcher *w = NULL;
    kvWatchOptions wo;
    struct provq *q = calloc(1, sizeof(*q));

    int64_t last_entry = ks_mono_us();
    /* Entries dated on this broker's clock; a registry that was away
     * meanwhile leaves the reference as it was. */
    struct server_clock clock = {0};
    int64_t watch_at = 0;   /* mono: when the watch was made */
    bool caught_up = false; /* it delivered its initial values */
    bool warned = false;

    if (!q) {
        ks_log(KS_LOG_ERROR, "out of memory: no agent registry",
               KS_S("module", "registry"));
        return NULL;
    }
    q->b = b;
    if (b->opts && b->opts->require_signed_labels)
        ks_log(KS_LOG_INFO,
               "agent labels: signed ones only (kscore agent enroll; "
               "--require-signed-labels, the default)",
               KS_S("module", "registry"));
    else
        ks_log(KS_LOG_WARN,
               "agent labels: an agent never enrolled keeps the labels it "
               "declares (--allow-unsigned-labels)",
               KS_S("module", "registry"));
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cond, NULL);
    if (pthread_create(&q->thread, NULL, provq_main, q) != 0) {
        ks_log(KS_LOG_ERROR, "cannot start the provisioner",
               KS_S("module", "registry"));
        free(q);
        return NULL;
    }

    /* This broker's beacon in the registry ("_broker.<uuid>", expiring
     * with the bucket's TTL): its own entries keep coming through a live
     * watch whether or not any agent heartbeats, so a watch that delivers
     * nothing is deaf (broker__registry_deaf), not a fleet that died. Its
     * PubAck says whether the bucket takes puts: while it does not (no
     * leader, no quorum, this broker cut off), nobody's heartbeat lands,
     * and from when it does again every agent gets a whole TTL before its
     * silence counts (broker__heard_locked). */
    char beacon[64 + sizeof(EVT_KV_AGENTS)], bid[37];
    int64_t beacon_at = 0;
    bool beacon_ok = false, beacon_seen = false;
    int64_t first_fail_us = 0; /* the first beacon failed since the last ok */
    /* After a pause (scanner.c pause_main): the wake being answered, and
     * the stream sequence of the first beacon put after it. The watch
     * delivers the bucket's stream in order, so once it delivers that
     * sequence every heartbeat put before it is in this broker's view,
     * and silences say something again. */
    int64_t woke_answered = 0;
    uint64_t woke_seq = 0;
    bool woke_seen = false; /* that beacon came through the watch */
    ks_uuid(bid);
    pthread_mutex_lock(&b->mu);
    memcpy(b->beacon_id, bid, sizeof(bid));
    pthread_mutex_unlock(&b->mu);
    snprintf(beacon, sizeof(beacon), "$KV.%s." BROKER_BEACON_PREFIX "%s",
             EVT_KV_AGENTS, bid);

    kvWatchOptions_Init(&wo);
    while (!b->stopping) {
        kvEntry *e = NULL;
        natsStatus s;
        /* Every heartbeat period; every BEACON_RETRY_MS while the bucket
         * takes none, so that when it takes puts again is known within
         * that. */
        pthread_mutex_lock(&b->mu);
        int64_t woke = b->woke_mono_us;
        pthread_mutex_unlock(&b->mu);
        if (woke != woke_answered) {
            woke_seq = 0; /* a new wake: at once, a beacon of its own */
            woke_seen = false;
        }
        if ((woke && !woke_seq && !woke_seen &&
             ks_mono_us() - beacon_at >= BEACON_RETRY_MS * INT64_C(1000)) ||
            ks_mono_us() - beacon_at >=
                (beacon_ok ? EVT_HEARTBEAT_MS : BEACON_RETRY_MS) *
                    INT64_C(1000)) {
            struct evt_puback ack = {0};
            beacon_at = ks_mono_us();
            bool ok = evt_js_publish_as(b->nc, NULL, beacon, NULL, "1", 1,
                                        BEACON_TIMEOUT_MS, &ack, NULL,
                                        0) == 0;
            if (ok && ack.seq)
                clock_acked(&clock, ack.seq, beacon_at, ks_mono_us());
            if (woke != woke_answered || (!woke_seq && !woke_seen)) {
                woke_answered = woke;
                if (woke && ok && ack.seq)
                    woke_seq = ack.seq;
            }
            if (!ok && beacon_ok)
                first_fail_us = beacon_at;
            pthread_mutex_lock(&b->mu);
            if (ok && !beacon_ok) {
                b->reg_up_mono_us = ks_mono_us();
                b->reg_outage_us = first_fail_us
                                       ? b->reg_up_mono_us - first_fail_us
                                       : INT64_MAX / 4;
            }
            b->reg_beacon_ok = ok;
            pthread_mutex_unlock(&b->mu);
            if (ok != beacon_ok && (ok || beacon_seen))
                ks_log(ok ? KS_LOG_INFO : KS_LOG_WARN,
                       ok ? "the agent registry takes heartbeats again: "
                            "silences count from now"
                          : "the agent registry takes no heartbeat (its "
                            "bucket has no leader?): nobody is judged by "
                            "silence meanwhile",
                       KS_S("module", "registry"));
            beacon_seen = beacon_seen || ok;
            beacon_ok = ok;
        }
        /* On a JetStream cluster the watcher's consumer lives on one
         * node; when that node dies or the bucket's leader moves, the
         * watch ends or goes silent. The beacon and every agent heartbeat
         * every 2 s, so a silence of REGISTRY_SILENT_US is a dead watch:
         * it is made again (the initial values replay every entry;
         * provisioning is idempotent). */
        if (w && ks_mono_us() - last_entry > REGISTRY_SILENT_US) {
            ks_log(KS_LOG_WARN, "agent registry watch silent: watching again",
                   KS_S("module", "registry"));
            watch_let_go(b, w);
            w = NULL;
        }
        /* A new watch is an R1 ephemeral consumer that nats-server 2.9
         * may place on a node that is down (it did, for the 10 s of F04):
         * it then delivers not even its initial values, with no error. */
        if (w && !caught_up &&
            ks_mono_us() - watch_at > REGISTRY_CATCHUP_US) {
            ks_log(KS_LOG_WARN,
                   "agent registry watch delivers nothing (its consumer on "
                   "a node that is down?): watching again",
                   KS_S("module", "registry"));
            watch_let_go(b, w);
            w = NULL;
        }
        if (!w) {
            if (kvStore_WatchAll(&w, b->kv, &wo) != NATS_OK) {
                if (!warned)
                    ks_log(KS_LOG_ERROR, "cannot watch the agent registry",
                           KS_S("module", "registry"),
                           KS_S("bucket", EVT_KV_AGENTS),
                           KS_S("error", nats_GetLastError(NULL)));
                warned = true;
                w = NULL;
                nanosleep(&(struct timespec){0, 500 * 1000000L}, NULL);
                continue;
            }
            warned = false;
            last_entry = watch_at = ks_mono_us();
            caught_up = false;
            pthread_mutex_lock(&b->mu);
            b->reg_watch_mono_us = last_entry;
            b->reg_caught_up_mono_us = 0;
            pthread_mutex_unlock(&b->mu);
        }
        /* Relabels recorded by another broker (its notice), or every
         * BROKER_RELABEL_RELOAD_US: the next heartbeat of each agent
         * takes them (labels.c). */
        if (broker__relabels_due(b) && broker__relabels_load(b, b->st_reg))
            atomic_store(&b->relabels_dirty, true);
        s = kvWatcher_Next(&e, w, 250);
        if (s == NATS_TIMEOUT)
            continue;
        if (s != NATS_OK) {
            ks_log(KS_LOG_WARN, "agent registry watch ended: watching again",
                   KS_S("module", "registry"),
                   KS_S("error", natsStatus_GetText(s)));
            watch_let_go(b, w);
            w = NULL;
            nanosleep(&(struct timespec){0, 250 * 1000000L}, NULL);
            continue;
        }
        last_entry = ks_mono_us();
        pthread_mutex_lock(&b->mu);
        b->reg_entry_mono_us = last_entry;
        if (caught_up || !e)
            b->reg_fresh_mono_us = last_entry;
        int64_t fresh_after = -1;
        if (e && woke_seq && kvEntry_Revision(e) >= woke_seq) {
            woke_seq = 0;
            woke_seen = true;
        }
        /* Fresh: the beacon put after the wake seen, and agents paused
         * along with this broker (its --local-agents, a frozen host)
         * given BROKER_WAKE_FRESH_US to heartbeat again. */
        if (woke_seen && b->woke_mono_us == woke_answered &&
            last_entry - woke_answered >= BROKER_WAKE_FRESH_US) {
            fresh_after = last_entry - woke_answered;
            b->woke_mono_us = 0;
            woke_answered = 0;
            woke_seen = false;
        }
        /* End of the initial values: the latest entry of every id is in
         * (nats.c kvWatcher_Next returns a NULL entry once). */
        if (!e) {
            b->reg_caught_up_mono_us = last_entry;
            atomic_store(&b->reg_loaded, true);
            caught_up = true;
        }
        pthread_mutex_unlock(&b->mu);
        if (fresh_after >= 0)
            ks_log(KS_LOG_INFO,
                   "registry view fresh again after the pause (its own "
                   "beacon put since seen): silences count again",
                   KS_S("module", "registry"),
                   KS_I("after_ms", fresh_after / 1000));
        if (!e)
            continue;
        /* The server's clock, as the watch sees it (ns in nats.c 3.4.1:
         * the JetStream timestamp of the message). */
        int64_t put_us = kvEntry_Created(e) / 1000;
        bool own = strncmp(kvEntry_Key(e), BROKER_BEACON_PREFIX,
                           strlen(BROKER_BEACON_PREFIX)) == 0 &&
                   strcmp(kvEntry_Key(e) + strlen(BROKER_BEACON_PREFIX),
                          bid) == 0;
        int64_t heard = clock_heard(&clock, own, kvEntry_Revision(e), put_us,
                                    last_entry);
        int64_t server_us = clock.newest_us;
        /* A put the bucket took after this broker's first failed beacon
         * (anyone's: an agent's heartbeat, another broker's beacon) says
         * it takes puts again, from then: this broker's own next beacon
         * comes up to a beacon timeout and a re-watch later, and each
         * second of that was counted as outage, forgiven to every agent
         * heard before it (broker__heard_locked: F04's stopped agent stayed
         * online 18 s on after an election of 6 s). Initial values of a new
         * watch are older than the failure and change nothing. */
        if (!beacon_ok && first_fail_us && heard > first_fail_us) {
            pthread_mutex_lock(&b->mu);
            b->reg_up_mono_us = heard;
            b->reg_outage_us = heard - first_fail_us;
            b->reg_beacon_ok = true;
            pthread_mutex_unlock(&b->mu);
            beacon_ok = true;
            beacon_at = ks_mono_us(); /* the next beacon in its period */
            ks_log(KS_LOG_INFO,
                   "the agent registry takes heartbeats again (a put it "
                   "took): silences count from then",
                   KS_S("module", "registry"), KS_S("key", kvEntry_Key(e)),
                   KS_I("outage_ms", (heard - first_fail_us) / 1000));
        }
        if (strncmp(kvEntry_Key(e), BROKER_BEACON_PREFIX,
                    strlen(BROKER_BEACON_PREFIX)) == 0) {
            /* a broker's beacon: who serves (broker__guard_owner) */
            beacon_heard(b, kvEntry_Key(e) + strlen(BROKER_BEACON_PREFIX),
                         heard);
            kvEntry_Destroy(e);
            continue;
        }
        if (kvEntry_Operation(e) == kvOp_Put &&
            strncmp(kvEntry_Key(e), EVT_POOL_KEY_PREFIX,
                    strlen(EVT_POOL_KEY_PREFIX)) == 0) {
            ProtobufCMessage *m = NULL;
            if (evt_unpack(&ks__agent_info__descriptor, kvEntry_Value(e),
                           (size_t)kvEntry_ValueLen(e), &m) == 0)
                pool_seen(b, q, kvEntry_Key(e), (Ks__AgentInfo *)m,
                          (size_t)kvEntry_ValueLen(e),
                          heartbeat_live((Ks__AgentInfo *)m, put_us,
                                         server_us),
                          heard);
        } else if (kvEntry_Operation(e) == kvOp_Put) {
            ProtobufCMessage *m = NULL;
            if (evt_unpack(&ks__agent_info__descriptor, kvEntry_Value(e),
                           (size_t)kvEntry_ValueLen(e), &m) == 0) {
                Ks__AgentInfo *info = (Ks__AgentInfo *)m;
                const char *bad = entry_problem(
                    kvEntry_Key(e), info, (size_t)kvEntry_ValueLen(e));
                if (bad)
                    entry_refused(kvEntry_Key(e), bad);
                if (!bad) {
                    const char *why = NULL;
                    char *verified = NULL;
                    struct broker__settled settled;
                    bool sig =
                        labels_settle(b, info, &why, &verified, &settled);
                    bool unstored =
                        agent_needs_store(b, kvEntry_Key(e), info) &&
                        store_upsert_agent(b->st_reg, info) != 0;
                    /* Before agent_update takes info. */
                    provq_push(q, kvEntry_Key(e), info);
                    bool live = heartbeat_live(info, put_us, server_us);
                    if (!live)
                        heartbeat_stale(kvEntry_Key(e), info, put_us);
                    struct broker__holds *holds = holds_take(info);
                    agent_update(b, kvEntry_Key(e), info, sig, &settled,
                                 why, verified, true, live, holds, heard);
                    if (unstored)
                        agent_store_failed(b, kvEntry_Key(e));
                } else {
                    ks__agent_info__free_unpacked(info, NULL);
                }
            }
        } else if (kvEntry_Operation(e) == kvOp_Delete ||
                   kvEntry_Operation(e) == kvOp_Purge) {
            /* `kscore agent revoke` (evt_agent_forget): the agent is
             * forgotten, so commands for it are refused as for an agent
             * that never registered. */
            if (strncmp(kvEntry_Key(e), EVT_POOL_KEY_PREFIX,
                        strlen(EVT_POOL_KEY_PREFIX)) == 0)
                pool_forget(b, kvEntry_Key(e) + strlen(EVT_POOL_KEY_PREFIX));
            else
                agent_forget(b, kvEntry_Key(e));
            provq_push(q, kvEntry_Key(e), NULL);
        }
        kvEntry_Destroy(e);
    }
    if (w)
        kvWatcher_Stop(w);
    kvWatcher_Destroy(w);
    pthread_mutex_lock(&q->mu);
    q->stop = true;
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    ks_map_each(&q->pending, free_provisioned, NULL);
    ks_map_clear(&q->pending);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cond);
    free(q);
    return NULL;
}

int
broker__registry_start(struct broker *b, char **errmsg)
{
    /* The relabels before any entry: an id relabelled (so signed) is
     * never served with unsigned labels, not even for a heartbeat. */
    int rc = broker__relabels_load(b, b->st_reg);
    if (rc) {
        if (errmsg && asprintf(errmsg, "cannot read the agents' relabels: %s",
                               ks_strerror(rc)) < 0)
            *errmsg = NULL;
        return rc;
    }
    if (pthread_create(&b->reg_thread, NULL, registry_main, b) != 0)
        return KS_EINTERNAL;
    b->reg_started = true;
    return 0;
}

static void
free_agent(const char *key, void *val, void *ud)
{
    struct broker__agent *a = val;
    (void)key;
    (void)ud;
    if (a->info)
        ks__agent_info__free_unpacked(a->info, NULL);
    holds_unref_locked(a->holds); /* registry stopped: no other user */
    free(a->attest_text);
    free(a);
}

void
broker__registry_stop(struct broker *b)
{
    b->stopping = 1;
    if (b->reg_started)
        pthread_join(b->reg_thread, NULL);
    /* Dead watches still being destroyed use the connection: at most
     * their consumer delete's wait (reap_watch). */
    for (int i = 0; i < 100 && atomic_load(&b->reg_reaping) > 0; i++)
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    b->reg_started = false;
    ks_map_each(&b->agents, free_agent, NULL);
    ks_map_clear(&b->agents);
    ks_map_each(&b->brokers, free_provisioned, NULL); /* free() each */
    ks_map_clear(&b->brokers);
    broker__relabels_free(b);
}

/* Whether agent_id is in the registry view now (takes b->mu). */
static bool
in_view(struct broker *b, const char *agent_id)
{
    pthread_mutex_lock(&b->mu);
    bool known = ks_map_get(&b->agents, agent_id) != NULL;
    pthread_mutex_unlock(&b->mu);
    return known;
}

int
broker__agent_lookup(struct broker *b, const char *agent_id)
{
    Ks__AgentInfo *info = NULL;

    if (in_view(b, agent_id))
        return 1;
    /* Before the first watch delivered its initial values (this broker
     * just started) the view has not every id: waited for a while, as a
     * request would be for a slow append (a broker restarted under make
     * soak's load answered "unknown agent" for an id in the bucket:
     * test_security an_operator_cannot_fill_the_commands_stream). Only
     * the first: a watch made again later keeps the ids it had, and a
     * batch naming many unknown ids must not wait this long for each. */
    for (int64_t t0 = ks_mono_us();
         !atomic_load(&b->reg_loaded) && !b->stopping &&
         ks_mono_us() - t0 < (int64_t)BROKER_REG_CATCHUP_WAIT_MS * 1000;)
        nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    if (in_view(b, agent_id))
        return 1;
    /* The watcher may still not have it (agent just registered): ask the
     * bucket itself. */
    int grc = evt_agent_get(b->kv, agent_id, &info);
    if (grc != 0 && grc != KS_ENOTFOUND)
        return grc; /* cannot tell: not "unknown" */
    if (grc == 0 && info->pool && info->pool[0]) {
        /* An id of a pool (its pool's entry): only that entry, as the
         * watcher takes it (the broker's signature over the pool's name
         * and size), makes it known, and the watch has it on its way.
         * Taken as an id's own entry it was refused ("names a pool"), and
         * a pool's id that had just registered was "unknown" (test_security
         * pool_credential_serves_only_its_ids under make soak). */
        ks__agent_info__free_unpacked(info, NULL);
        for (int64_t t0 = ks_mono_us();
             !b->stopping && ks_mono_us() - t0 < (int64_t)EVT_HEARTBEAT_MS * 1000;
             nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL))
            if (in_view(b, agent_id))
                return 1;
        /* (not there after a heartbeat's time: a pool the watcher
         * refused, or one it does not have yet) */
        return in_view(b, agent_id) ? 1 : 0;
    }
    if (grc == 0) {
        /* The same rules as the watcher's: else an entry it refused (an
         * agent_id not its key, a huge one) would come in this way. */
        const char *bad = entry_problem(
            agent_id, info, protobuf_c_message_get_packed_size(&info->base));
        if (bad) {
            entry_refused(agent_id, bad);
            ks__agent_info__free_unpacked(info, NULL);
            return 0;
        }
        const char *why = NULL;
        char *verified = NULL;
        struct broker__settled settled;
        bool sig = labels_settle(b, info, &why, &verified, &settled);
        holds_unref_locked(holds_take(info)); /* not shared yet */
        agent_update(b, agent_id, info, sig, &settled, why, verified, false,
                     false, NULL, ks_mono_us());
        return 1;
    }
    return 0;
}

int
broker__agent_known(struct broker *b, const char *agent_id)
{
    return broker__agent_lookup(b, agent_id) > 0;
}

struct list_acc {
    struct broker *b;
    Ks__AgentStatus **v;
    size_t n;
    int64_t now_mono;
};

static void
add_status(const char *key, void *val, void *ud)
{
    struct list_acc *acc = ud;
    struct broker__agent *a = val;
    Ks__AgentStatus *st = calloc(1, sizeof(*st));
    uint8_t *buf = NULL;
    size_t len = 0;
    if (!st)
        return;
    ks__agent_status__init(st);
    /* A copy, so the reply does not borrow from the locked map. */
    if (kproto_pack(&a->info->base, &buf, &len) == 0) {
        st->info = ks__agent_info__unpack(NULL, len, buf);
        free(buf);
    }
    if (!st->info) {
        free(st);
        return;
    }
    st->last_seen_us = a->info->heartbeat_at_us;
    st->labels_signed = a->labels_signed;
    if (a->relabel_at_us) {
        st->labels_by = strdup(a->relabel_by);
        st->labels_at_us = a->relabel_at_us;
    }
    st->online = acc->now_mono - broker__heard_locked(acc->b, a) <
                 (int64_t)EVT_AGENT_TTL_MS * 1000;
    if (agent_duplicate(a, acc->now_mono)) {
        st->duplicate = true;
        st->duplicate_host = strdup(a->other.host);
        st->duplicate_pid = a->other.pid;
    }
    {
        char durable[8 + EVT_AGENT_ID_MAX];
        if (a->info->pool && a->info->pool[0])
            evt_pool_durable(durable, sizeof(durable), a->info->pool);
        else
            evt_agent_durable(durable, sizeof(durable), key);
        broker__guard_view(acc->b, durable, st);
    }
    acc->v[acc->n++] = st;
}

static void
count_online(const char *key, void *val, void *ud)
{
    struct list_acc *acc = ud;
    struct broker__agent *a = val;
    (void)key;
    if (acc->now_mono - broker__heard_locked(acc->b, a) <
        (int64_t)EVT_AGENT_TTL_MS * 1000)
        acc->n++;
}

int
broker__agents_online(struct broker *b)
{
    struct list_acc acc = {.b = b};
    pthread_mutex_lock(&b->mu);
    acc.now_mono = view_instant_locked(b, ks_mono_us(), NULL);
    ks_map_each(&b->agents, count_online, &acc);
    pthread_mutex_unlock(&b->mu);
    return (int)acc.n;
}

static int
cmp_status(const void *x, const void *y)
{
    const Ks__AgentStatus *a = *(Ks__AgentStatus *const *)x;
    const Ks__AgentStatus *b = *(Ks__AgentStatus *const *)y;
    return strcmp(a->info->agent_id, b->info->agent_id);
}

int
broker__agents_list(struct broker *b, Ks__AgentsReply *out)
{
    struct list_acc acc = {.b = b};
    pthread_mutex_lock(&b->mu);
    acc.v = calloc(b->agents.count + 1, sizeof(*acc.v));
    /* A deaf view's online is as of its last entry, and says so: an
     * agent whose heartbeats this broker cannot hear meanwhile is not
     * shown offline for it (nor one that stopped meanwhile online for
     * long: its last heartbeat is dated when it was put once the watch
     * is back). */
    int64_t stale_us = 0;
    acc.now_mono = view_instant_locked(b, ks_mono_us(), &stale_us);
    out->view_stale_ms = stale_us / 1000;
    if (acc.v)
        ks_map_each(&b->agents, add_status, &acc);
    pthread_mutex_unlock(&b->mu);
    if (!acc.v)
        return -ENOMEM;
    qsort(acc.v, acc.n, sizeof(*acc.v), cmp_status);
    out->agents = acc.v;
    out->n_agents = acc.n;
    return 0;
}

void
broker__agents_reply_free(Ks__AgentsReply *r)
{
    for (size_t i = 0; i < r->n_agents; i++) {
        ks__agent_info__free_unpacked(r->agents[i]->info, NULL);
        Ks__AgentStatus *st = r->agents[i];
        char *strs[] = {st->duplicate_host, st->consumer, st->consumer_stall,
                        st->consumer_last_repair, st->labels_by};
        for (size_t k = 0; k < sizeof(strs) / sizeof(strs[0]); k++)
            if (strs[k] != protobuf_c_empty_string)
                free(strs[k]);
        free(r->agents[i]);
    }
    free(r->agents);
    r->agents = NULL;
    r->n_agents = 0;
}

struct pool_slots {
    const char *pool;
    uint32_t running, held;
};

static void
pool_running(const char *key, void *val, void *ud)
{
    struct pool_slots *ps = ud;
    const struct broker__agent *a = val;
    (void)key;
    if (a->info && a->info->pool && strcmp(a->info->pool, ps->pool) == 0) {
        ps->running += a->info->running;
        ps->held += a->holds ? (uint32_t)a->holds->n : 0;
    }
}

int
broker__consumer_of(struct broker *b, const char *agent_id,
                    struct broker__consumer_of *out)
{
    struct broker__agent *a;
    int rc = KS_ENOTFOUND;

    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && a->info) {
        const Ks__AgentInfo *in = a->info;
        /* As provision() makes it, from the same entry. */
        if (in->pool && in->pool[0]) {
            struct pool_slots ps = {in->pool, 0, 0};
            evt_pool_consumer(&out->ac, in->pool, in->max_concurrent,
                              in->ack_wait_ms);
            ks_map_each(&b->agents, pool_running, &ps);
            out->running = ps.running > ps.held ? ps.running : ps.held;
        } else {
            uint32_t held = a->holds ? (uint32_t)a->holds->n : 0;
            evt_agent_consumer(&out->ac, agent_id, in->max_concurrent,
                               in->ack_wait_ms);
            out->running = in->running > held ? in->running : held;
        }
        out->max_concurrent = in->max_concurrent;
        out->heard_us = broker__heard_locked(b, a);
        rc = 0;
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

void
broker__agent_pool(struct broker *b, const char *agent_id, char *buf,
                   size_t len)
{
    struct broker__agent *a;

    buf[0] = '\0';
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && a->info && a->info->pool)
        snprintf(buf, len, "%s", a->info->pool);
    pthread_mutex_unlock(&b->mu);
}

void
broker__agent_queue(struct broker *b, const char *agent_id, char *key,
                     size_t len, unsigned *slots)
{
    pthread_mutex_lock(&b->mu);
    queue_key_locked(ks_map_get(&b->agents, agent_id), agent_id, key, len,
                     slots);
    pthread_mutex_unlock(&b->mu);
}

int
broker__agent_pool_known(struct broker *b, const char *agent_id, char *buf,
                         size_t len)
{
    struct broker__agent *a;
    int known;

    buf[0] = '\0';
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    known = a != NULL;
    if (a && a->info && a->info->pool)
        snprintf(buf, len, "%s", a->info->pool);
    pthread_mutex_unlock(&b->mu);
    return known;
}

Ks__AgentInfo *
broker__agent_info(struct broker *b, const char *agent_id)
{
    struct broker__agent *a;
    Ks__AgentInfo *copy = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && a->info && kproto_pack(&a->info->base, &buf, &len) != 0)
        buf = NULL;
    pthread_mutex_unlock(&b->mu);
    if (buf) {
        copy = ks__agent_info__unpack(NULL, len, buf);
        free(buf);
    }
    return copy;
}

/* broker__registry_deaf under b->mu. */
static bool
registry_deaf_locked(struct broker *b, int64_t now)
{
    return !b->reg_caught_up_mono_us || !b->reg_beacon_ok ||
           now - b->reg_entry_mono_us > 2 * (int64_t)EVT_HEARTBEAT_MS * 1000 ||
           /* paused: whichever thread asks first after a SIGCONT, the
            * pause watch's tick is old (broker_int.h tick_mono_us) */
           (atomic_load(&b->tick_mono_us) &&
            now - atomic_load(&b->tick_mono_us) > BROKER_PAUSE_US) ||
           /* woke, and its own beacon put since not seen yet */
           b->woke_mono_us != 0;
}

bool
broker__registry_deaf(struct broker *b)
{
    pthread_mutex_lock(&b->mu);
    bool deaf = registry_deaf_locked(b, ks_mono_us());
    pthread_mutex_unlock(&b->mu);
    return deaf;
}

bool
broker__silent_past(struct broker *b, const char *agent_id, int64_t age_us)
{
    pthread_mutex_lock(&b->mu);
    int64_t now = ks_mono_us();
    struct broker__agent *a = ks_map_get(&b->agents, agent_id);
    /* unknown: never heard, or forgotten (`kscore agent revoke`) */
    bool silent = !registry_deaf_locked(b, now) &&
                  (!a || now - broker__heard_locked(b, a) >= age_us);
    pthread_mutex_unlock(&b->mu);
    return silent;
}

int
broker__agent_presence(struct broker *b, const char *agent_id,
                       int64_t *heartbeat_at_us)
{
    struct broker__agent *a;
    int rc = -1;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    /* A watch that is dead, or new and not caught up with the heartbeats
     * (a cluster node died under it), may not have seen every heartbeat:
     * a stale entry then says nothing, the delivery deadline decides. */
    if (a && registry_deaf_locked(b, ks_mono_us()) &&
        ks_mono_us() - broker__heard_locked(b, a) >=
            (int64_t)EVT_AGENT_TTL_MS * 1000) {
        if (heartbeat_at_us)
            *heartbeat_at_us = a->info ? a->info->heartbeat_at_us : 0;
    } else if (a) {
        rc = ks_mono_us() - broker__heard_locked(b, a) <
             (int64_t)EVT_AGENT_TTL_MS * 1000;
        if (heartbeat_at_us)
            *heartbeat_at_us = a->info ? a->info->heartbeat_at_us : 0;
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}
