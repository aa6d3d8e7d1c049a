/* The broker's API as a client calls it: requests, ExecuteCommand's wait,
 * and the helpers that wait for a stack to be ready (kscore up, fixtures). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent.h" /* EXEC_GRACE_DEFAULT_MS: the wait covers the grace */
#include "client.h"

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

int
broker_call(struct evt_conn *c, const char *subject,
            const ProtobufCMessage *req,
            const ProtobufCMessageDescriptor *reply_desc, int timeout_ms,
            ProtobufCMessage **out)
{
    natsMsg *reply = NULL;
    int rc = evt_request(c, subject, req, timeout_ms, &reply);
    if (rc)
        return rc;
    rc = evt_unpack_reply(reply_desc, natsMsg_GetData(reply),
                          (size_t)natsMsg_GetDataLength(reply), out);
    natsMsg_Destroy(reply);
    return rc;
}

int
broker_execute_wait_ms(const Ks__ExecuteRequest *req)
{
    uint64_t t = req->spec ? req->spec->timeout_ms : 0;
    uint64_t g = req->spec && req->spec->grace_ms ? req->spec->grace_ms
                                                  : EXEC_GRACE_DEFAULT_MS;
    uint64_t d = req->deliver_within_ms ? req->deliver_within_ms
                                        : BROKER_DELIVER_WITHIN_DEFAULT_MS;
    uint64_t total;
    if (req->detach)
        return 10000;
    if (t == 0)
        return INT32_MAX; /* no timeout: wait as long as the command runs */
    total = t + 2 * g + d * BROKER_MAX_ATTEMPTS + 10000;
    return total > INT32_MAX ? INT32_MAX : (int)total;
}

/* Silence after which a waiting exec asks again, and after which it gives
 * up when no broker answers at all (ms). */
#define EXEC_REASK_MS 5000
#define EXEC_GIVE_UP_MS 20000

int
broker_execute(struct evt_conn *c, const Ks__ExecuteRequest *req,
               int timeout_ms, Ks__ExecuteReply **out)
{
    return broker_execute_hooks(c, req, timeout_ms, NULL, out);
}

int
broker_execute_hooks(struct evt_conn *c, const Ks__ExecuteRequest *req,
                     int timeout_ms, const struct broker_exec_hooks *h,
                     Ks__ExecuteReply **out)
{
    Ks__ExecuteRequest r = *req;
    natsSubscription *sub = NULL;
    char inbox[EVT_INBOX_MAX], subject[192], key[48], id[37] = "";
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    if (req->detach)
        return broker_call(c, EVT_API_EXECUTE, &req->base,
                           &ks__execute_reply__descriptor, timeout_ms,
                           (ProtobufCMessage **)out);
    /*
     * A waiting exec must not hang with its broker: the broker that holds
     * its waiter may die. The request names its command with an
     * idempotency key (a fresh one unless the caller gave one), and after
     * EXEC_REASK_MS of silence the same request goes out again on the same
     * inbox: the broker that still waits for the command answers at once
     * that it does (a reply without a result), another broker attaches
     * this inbox to the command (or answers with its end), and no answer
     * at all for EXEC_GIVE_UP_MS ends the wait with KS_EUNAVAIL.
     */
    if (!r.idempotency_key || !r.idempotency_key[0]) {
        char u[37];
        ks_uuid(u);
        snprintf(key, sizeof(key), "exec-%s", u);
        r.idempotency_key = key;
    } else {
        r.key_may_exist = 1; /* the caller's key: it may name a command */
    }
    if ((rc = evt_inbox(c, inbox, sizeof(inbox))) ||
        (rc = evt_err(natsConnection_SubscribeSync(&sub, c->nc, inbox))) ||
        (rc = evt_err(natsSubscription_SetPendingLimits(sub, -1, -1))) ||
        (rc = kproto_pack(&r.base, &buf, &len)))
        goto out;
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_EXECUTE, c->identity);
    int64_t start = ks_mono_us(), heard = start, asked = start;
    unsigned asks = 1;
    if ((rc = evt_err(natsConnection_PublishRequest(c->nc, subject, inbox, buf,
                                                    (int)len))))
        goto out;
    for (;;) {
        natsMsg *m = NULL;
        natsStatus st = natsSubscription_NextMsg(&m, sub, h ? 100 : 1000);
        int64_t now = ks_mono_us();
        if (st == NATS_OK && !natsMsg_IsNoResponders(m) &&
            (rc = evt_join_parts(sub, m, 5000, &m)))
            goto out;
        if (st == NATS_OK && !natsMsg_IsNoResponders(m)) {
            Ks__ExecuteReply *rep = NULL;
            rc = evt_unpack_reply(&ks__execute_reply__descriptor,
                                  natsMsg_GetData(m),
                                  (size_t)natsMsg_GetDataLength(m),
                                  (ProtobufCMessage **)&rep);
            natsMsg_Destroy(m);
            if (rc)
                goto out;
            if (rep->error_code && id[0]) {
                /* The command is recorded (its id came back): a refusal
                 * of a later ask (the database refusing writes, say) is
                 * about that ask, not the command. The broker that waits
                 * for it still answers with its end. */
                ks__execute_reply__free_unpacked(rep, NULL);
                continue;
            }
            if (rep->error_code && asks > 1 &&
                rep->error_code != KS_EINDOUBT &&
                (rep->error_code == KS_EPGDOWN ||
                 rep->error_code == KS_EPGREFUSED ||
                 rep->error_code == KS_EPG)) {
                /* A later ask was refused, but the first one was never
                 * answered: it may have recorded the command. */
                char *t = NULL;
                if (asprintf(&t,
                             "the outcome is unknown: %s; an earlier request "
                             "with the idempotency key %s may have recorded "
                             "the command (asking again with the same key "
                             "is safe)",
                             rep->error, r.idempotency_key) >= 0) {
                    free(rep->error);
                    rep->error = t;
                }
                rep->error_code = KS_EINDOUBT;
            }
            if (rep->error_code || rep->result) {
                if (ks_trace_on()) {
                    ks_trace_at("client.sent", rep->command_id, start);
                    ks_trace_at("client.replied", rep->command_id, now);
                }
                *out = rep;
                goto out;
            }
            /* Still running, and someone waits for it: keep waiting. */
            snprintf(id, sizeof(id), "%s", rep->command_id);
            if (h && h->live)
                h->live(rep, h->ud);
            ks__execute_reply__free_unpacked(rep, NULL);
            heard = now;
        } else {
            natsMsg_Destroy(m);
            if (st != NATS_OK && st != NATS_TIMEOUT &&
                st != NATS_NO_RESPONDERS) {
                rc = evt_err(st);
                goto out;
            }
        }
        if (h && h->tick && (rc = h->tick(h->ud)))
            goto out;
        if (timeout_ms != INT32_MAX &&
            now - start >= (int64_t)timeout_ms * 1000) {
            rc = KS_ETIMEDOUT;
            goto out;
        }
        if (now - heard >= (int64_t)EXEC_GIVE_UP_MS * 1000) {
            if (id[0]) {
                /* Recorded, its end not heard of: not "not accepted". */
                Ks__ExecuteReply *rep = malloc(sizeof(*rep));
                if (!rep) {
                    rc = -ENOMEM;
                    goto out;
                }
                ks__execute_reply__init(rep);
                rep->error_code = KS_EINDOUBT;
                rep->command_id = strdup(id);
                rep->agent_id = strdup(r.agent_id ? r.agent_id : "");
                rep->error = strdup("no broker answers; the command is "
                                    "recorded and goes on");
                if (!rep->command_id || !rep->agent_id || !rep->error) {
                    ks__execute_reply__free_unpacked(rep, NULL);
                    rc = -ENOMEM;
                    goto out;
                }
                *out = rep;
                rc = 0;
                goto out;
            }
            rc = KS_EUNAVAIL;
            goto out;
        }
        if (now - heard >= (int64_t)EXEC_REASK_MS * 1000 &&
            now - asked >= (int64_t)EXEC_REASK_MS * 1000) {
            asked = now;
            if (!r.key_may_exist) {
                /* Asked again: the key may name a command by now (at
                 * another broker too), which must not be published
                 * again under a new id. */
                r.key_may_exist = 1;
                free(buf);
                buf = NULL;
                if ((rc = kproto_pack(&r.base, &buf, &len)))
                    goto out;
            }
            if ((rc = evt_err(natsConnection_PublishRequest(
                     c->nc, subject, inbox, buf, (int)len))))
                goto out;
            asks++;
        }
    }
out:
    if (sub) {
        natsSubscription_Unsubscribe(sub);
        natsSubscription_Destroy(sub);
    }
    free(buf);
    return rc;
}

int
broker_batch(struct evt_conn *c, const Ks__BatchRequest *req, int timeout_ms,
             Ks__BatchReply **out)
{
    return broker_call(c, EVT_API_BATCH, &req->base,
                       &ks__batch_reply__descriptor, timeout_ms,
                       (ProtobufCMessage **)out);
}
