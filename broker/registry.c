/*
 * The agent registry as the broker sees it: a watcher on the KSCORE_AGENTS
 * KV bucket keeps an in-memory map (for the execute path) and the agents
 * projection in PostgreSQL (for `kscore agents`).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

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
    }
    if (a->info)
        ks__agent_info__free_unpacked(a->info, NULL);
    a->info = info;
    a->seen_mono_us = ks_mono_us();
    pthread_mutex_unlock(&b->mu);
}

static void *
registry_main(void *arg)
{
    struct broker *b = arg;
    kvWatcher *w = NULL;
    kvWatchOptions wo;

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
                    store_upsert_agent(b->st_reg, info);
                    agent_update(b, kvEntry_Key(e), info);
                } else {
                    ks__agent_info__free_unpacked(info, NULL);
                }
            }
        }
        kvEntry_Destroy(e);
    }
    kvWatcher_Stop(w);
    kvWatcher_Destroy(w);
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
