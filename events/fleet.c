/* Forgetting an agent: what `kscore agent revoke` does on NATS after the
 * agent's user is gone from nats-server's config. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "kproto.h"

/* Deletes registry key and consumer durable. */
static int
forget(struct evt_conn *c, const char *agent_id, const char *durable,
       char **errmsg)
{
    kvStore *kv = NULL;
    jsErrCode jerr = 0;
    natsStatus s;

    /* The registry entry: a delete marker, which the bucket's History 1
     * keeps alone (no value left behind; a KV purge is a roll-up, which
     * the bucket refuses: evt_setup), and the broker's watcher sees it
     * and drops the agent, so new commands for it are refused as for an
     * unknown agent. */
    s = js_KeyValue(&kv, c->js, EVT_KV_AGENTS);
    if (s == NATS_OK) {
        s = kvStore_Delete(kv, agent_id);
        kvStore_Destroy(kv);
    }
    if (s != NATS_OK && s != NATS_NOT_FOUND) {
        if (errmsg)
            (void)!asprintf(errmsg, "cannot purge %s from %s: %s", agent_id,
                        EVT_KV_AGENTS, nats_GetLastError(NULL));
        return evt_err(s);
    }
    /* Its consumer: commands still queued for it are not delivered to
     * anyone (they end Undeliverable at their deadline, as for any agent
     * that never takes them). */
    s = js_DeleteConsumer(c->js, EVT_STREAM_CMDS, durable, NULL, &jerr);
    if (s == NATS_NOT_FOUND || jerr == JSConsumerNotFoundErr)
        s = NATS_OK;
    if (s != NATS_OK) {
        if (errmsg)
            (void)!asprintf(errmsg, "cannot delete consumer %s: %s", durable,
                        nats_GetLastError(NULL));
        return evt_err(s);
    }
    return 0;
}

int
evt_agent_forget(struct evt_conn *c, const char *agent_id, char **errmsg)
{
    char durable[EVT_AGENT_ID_MAX + 16];

    if (!evt_agent_id_valid(agent_id))
        return KS_EINVAL;
    evt_agent_durable(durable, sizeof(durable), agent_id);
    return forget(c, agent_id, durable, errmsg);
}

int
evt_pool_forget(struct evt_conn *c, const char *pool, char **errmsg)
{
    char durable[EVT_AGENT_ID_MAX + 16], key[EVT_AGENT_ID_MAX + 16];

    if (!evt_agent_id_valid(pool))
        return KS_EINVAL;
    evt_pool_durable(durable, sizeof(durable), pool);
    snprintf(key, sizeof(key), EVT_POOL_KEY_PREFIX "%s", pool);
    return forget(c, key, durable, errmsg);
}
