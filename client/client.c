/* Client helpers that wait for a stack to be ready (kscore up, fixtures). */
#include <time.h>

#include "broker.h"

int
broker_wait_ready(const char *url, const struct evt_connect_opts *opts,
                  int timeout_ms)
{
    struct evt_connect_opts o = *opts;
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    char id[37];

    o.send_asap = true;
    ks_uuid(id);
    while (ks_mono_us() < deadline) {
        struct evt_conn *c = NULL;
        if (evt_connect(url, &o, &c, NULL) == 0) {
            Ks__GetRequest req = KS__GET_REQUEST__INIT;
            ProtobufCMessage *rep = NULL;
            req.id = id;
            /* Any reply (here "not found") means the API is served. */
            int rc = broker_call(c, EVT_API_GET, &req.base,
                                 &ks__get_reply__descriptor, 1000, &rep);
            if (rep)
                protobuf_c_message_free_unpacked(rep, NULL);
            evt_close(c);
            if (rc == 0)
                return 0;
        }
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    }
    return KS_ETIMEDOUT;
}

int
broker_wait_agent(const char *url, const struct evt_connect_opts *opts,
                  const char *agent_id, int64_t since_us, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    struct evt_conn *c = NULL;
    kvStore *kv = NULL;
    int rc = KS_ETIMEDOUT;

    if (evt_connect(url, opts, &c, NULL) != 0)
        return KS_EUNAVAIL;
    while (ks_mono_us() < deadline) {
        Ks__AgentInfo *info = NULL;
        if (!kv && evt_agents_kv(c, &kv) != 0)
            kv = NULL;
        if (kv && evt_agent_get(kv, agent_id, &info) == 0) {
            int fresh = info->heartbeat_at_us >= since_us;
            ks__agent_info__free_unpacked(info, NULL);
            if (fresh) {
                rc = 0;
                break;
            }
        }
        nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    }
    kvStore_Destroy(kv);
    evt_close(c);
    return rc;
}
