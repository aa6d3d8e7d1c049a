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

#include "broker_int.h"

/* The agents projection is written when an agent appears or changes, and
 * at most every AGENT_STORE_EVERY_US otherwise: heartbeats of 1,000 agents
 * would else be 500 writes a second. */
#define AGENT_STORE_EVERY_US (10 * 1000000)

static bool
info_changed(const Ks__AgentInfo *a, const Ks__AgentInfo *b)
{
    if (a->n_labels != b->n_labels || a->running != b->running ||
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

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, key);
    store = !a || !a->info || info_changed(a->info, info) ||
            now - a->stored_mono_us >= AGENT_STORE_EVERY_US;
    if (a && store)
        a->stored_mono_us = now;
    pthread_mutex_unlock(&b->mu);
    return store;
}

/* Takes info into the registry map (which owns it from here). */
static void
agent_update(struct broker *b, const char *key, Ks__AgentInfo *info)
{
    struct broker__agent *a;

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, key);
    if (!a) {
        a = calloc(1, sizeof(*a));
        if (!a || ks_map_put(&b->agents, key, a) != 0) {
            free(a);
            pthread_mutex_unlock(&b->mu);
            ks__agent_info__free_unpacked(info, NULL);
            return;
        }
        a->stored_mono_us = ks_mono_us();
    }
    a->seen_mono_us = ks_mono_us();
    if (a->info)
        ks__agent_info__free_unpacked(a->info, NULL);
    a->info = info;
    pthread_mutex_unlock(&b->mu);
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

/* Makes agent_id's consumer as its entry says, unless it was made so
 * lately. A failure (JetStream away) is tried again at the next
 * heartbeat. Registry thread. */
static void
provision(struct broker *b, struct provisioner *pv, const Ks__AgentInfo *info)
{
    struct provisioned *p = ks_map_get(&pv->done, info->agent_id);
    struct evt_agent_consumer ac;
    enum evt_consumer_change change = EVT_CONSUMER_KEPT;
    int64_t now = ks_mono_us();
    char *err = NULL;

    if (p && p->pid == info->pid &&
        p->max_concurrent == info->max_concurrent &&
        p->ack_wait_ms == info->ack_wait_ms &&
        now - p->checked_mono_us < CONSUMER_RECHECK_US)
        return;
    evt_agent_consumer(&ac, info->agent_id, info->max_concurrent,
                       info->ack_wait_ms);
    if (evt_consumer_ensure(b->nc, &ac.d, &change, &err) != 0) {
        if (now - pv->err_logged_us > PROVISION_LOG_EVERY_US) {
            pv->err_logged_us = now;
            fprintf(stderr,
                    "kscore broker: cannot provision the consumer of agent "
                    "%s: %s (tried again at its next heartbeat)\n",
                    info->agent_id, err ? err : "?");
        }
        free(err);
        return;
    }
    if (change == EVT_CONSUMER_REPLACED)
        fprintf(stderr,
                "kscore broker: consumer %s delivered something else than "
                "%s: replaced\n",
                ac.d.durable, ac.d.filter_subject);
    if (!p) {
        p = calloc(1, sizeof(*p));
        if (!p || ks_map_put(&pv->done, info->agent_id, p) != 0) {
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
agent_forget(struct broker *b, struct provisioner *pv, const char *key)
{
    struct broker__agent *a;

    pthread_mutex_lock(&b->mu);
    a = ks_map_del(&b->agents, key);
    pthread_mutex_unlock(&b->mu);
    if (a) {
        if (a->info)
            ks__agent_info__free_unpacked(a->info, NULL);
        free(a);
        fprintf(stderr,
                "kscore broker: agent %s left the registry (revoked): "
                "commands for it are refused\n",
                key);
    }
    free(ks_map_del(&pv->done, key));
}

static void *
registry_main(void *arg)
{
    struct broker *b = arg;
    kvWatcher *w = NULL;
    kvWatchOptions wo;
    struct provisioner pv = {KS_MAP_INIT, 0};

    kvWatchOptions_Init(&wo);
    if (kvStore_WatchAll(&w, b->kv, &wo) != NATS_OK) {
        fprintf(stderr, "kscore broker: cannot watch %s: %s\n",
                EVT_KV_AGENTS, nats_GetLastError(NULL));
        return NULL;
    }
    while (!b->stopping) {
        kvEntry *e = NULL;
        natsStatus s = kvWatcher_Next(&e, w, 250);
        if (s == NATS_TIMEOUT)
            continue;
        if (s != NATS_OK)
            break;
        if (!e) /* end of the initial values */
            continue;
        if (kvEntry_Operation(e) == kvOp_Put) {
            ProtobufCMessage *m = NULL;
            if (evt_unpack(&ks__agent_info__descriptor, kvEntry_Value(e),
                           (size_t)kvEntry_ValueLen(e), &m) == 0) {
                Ks__AgentInfo *info = (Ks__AgentInfo *)m;
                if (evt_agent_id_valid(info->agent_id) &&
                    strcmp(info->agent_id, kvEntry_Key(e)) == 0) {
                    bool unstored =
                        agent_needs_store(b, kvEntry_Key(e), info) &&
                        store_upsert_agent(b->st_reg, info) != 0;
                    /* Before agent_update takes info. */
                    provision(b, &pv, info);
                    agent_update(b, kvEntry_Key(e), info);
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
            agent_forget(b, &pv, kvEntry_Key(e));
        }
        kvEntry_Destroy(e);
    }
    kvWatcher_Stop(w);
    kvWatcher_Destroy(w);
    ks_map_each(&pv.done, free_provisioned, NULL);
    ks_map_clear(&pv.done);
    return NULL;
}

int
broker__registry_start(struct broker *b, char **errmsg)
{
    (void)errmsg;
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
    free(a);
}

void
broker__registry_stop(struct broker *b)
{
    b->stopping = 1;
    if (b->reg_started)
        pthread_join(b->reg_thread, NULL);
    b->reg_started = false;
    ks_map_each(&b->agents, free_agent, NULL);
    ks_map_clear(&b->agents);
}

int
broker__agent_known(struct broker *b, const char *agent_id)
{
    Ks__AgentInfo *info = NULL;
    int known;

    pthread_mutex_lock(&b->mu);
    known = ks_map_get(&b->agents, agent_id) != NULL;
    pthread_mutex_unlock(&b->mu);
    if (known)
        return 1;
    /* The watcher may not have caught up (broker just started, agent just
     * registered): ask the bucket itself. */
    if (evt_agent_get(b->kv, agent_id, &info) == 0) {
        agent_update(b, agent_id, info);
        return 1;
    }
    return 0;
}

struct list_acc {
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
    (void)key;
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
    st->online =
        acc->now_mono - a->seen_mono_us < (int64_t)EVT_AGENT_TTL_MS * 1000;
    acc->v[acc->n++] = st;
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
    struct list_acc acc = {0};
    pthread_mutex_lock(&b->mu);
    acc.v = calloc(b->agents.count + 1, sizeof(*acc.v));
    acc.now_mono = ks_mono_us();
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
        free(r->agents[i]);
    }
    free(r->agents);
    r->agents = NULL;
    r->n_agents = 0;
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
