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
        if (!kv && evt_agents_kv(c, 0, &kv) != 0)
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
    int64_t start = ks_mono_us();
    int rc;
    /* No responders reached nobody, so asking again is safe: a node that
     * has just started takes clients before its routes to the other nodes
     * are up, and a request sent there meanwhile has no responders though
     * brokers serve on the others (test_cluster registry_watch_node_dies:
     * kscore agents as a killed node came back). */
    for (;;) {
        int64_t spent_ms = (ks_mono_us() - start) / 1000;
        rc = evt_request(c, subject, req, timeout_ms - (int)spent_ms, &reply);
        spent_ms = (ks_mono_us() - start) / 1000;
        if (rc != KS_EUNAVAIL || natsConnection_IsClosed(c->nc) ||
            spent_ms + BROKER_CALL_PAUSE_MS >= timeout_ms ||
            spent_ms + BROKER_CALL_PAUSE_MS > BROKER_CALL_UNAVAIL_MS)
            break;
        nanosleep(&(struct timespec){0, BROKER_CALL_PAUSE_MS * 1000000L},
                  NULL);
    }
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

/* An ask that a live broker answers at once (a live request's id, any ask
 * again) and that went unanswered this long is asked again: the broker it
 * reached may be stopped (ms). An answer takes a commit, milliseconds; the
 * margin is for a loaded database, where asking more would add load. */
#define EXEC_UNANSWERED_MS 2000

int
broker_execute(struct evt_conn *c, const Ks__ExecuteRequest *req,
               int timeout_ms, Ks__ExecuteReply **out)
{
    return broker_execute_hooks(c, req, timeout_ms, NULL, out);
}

/* How many times c's connection has reconnected (nats.c's statistics,
 * into st, made once per wait); 0 when it cannot tell. */
static uint64_t
conn_reconnects(struct evt_conn *c, natsStatistics *st)
{
    uint64_t n = 0;
    if (st && natsConnection_GetStats(c->nc, st) == NATS_OK)
        natsStatistics_GetCounts(st, NULL, NULL, NULL, NULL, &n);
    return n;
}

int
broker_execute_hooks(struct evt_conn *c, const Ks__ExecuteRequest *req,
                     int timeout_ms, const struct broker_exec_hooks *h,
                     Ks__ExecuteReply **out)
{
    Ks__ExecuteRequest r = *req;
    struct evt_inbox *ib = NULL;
    char subject[192], again[192], key[48], id[37] = "";
    natsStatistics *stats = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    if (req->detach)
        return broker_call(c, EVT_API_EXECUTE, &req->base,
                           &ks__execute_reply__descriptor, timeout_ms,
                           (ProtobufCMessage **)out);
    /*
     * A waiting exec must not hang with its broker: the broker that holds
     * its waiter may die or stop. The request names its command with an
     * idempotency key (a fresh one unless the caller gave one), and after
     * BROKER_EXEC_REASK_MS of silence the same request goes out again on the
     * same inbox: the broker that still waits for the command answers at once
     * that it does (a reply without a result), another broker attaches
     * this inbox to the command and says so at once (or answers with its
     * end), and no answer at all for BROKER_EXEC_GIVE_UP_MS ends the wait
     * with KS_EUNAVAIL.
     *
     * The first ask goes to the brokers' queue group, which hands it to one
     * broker at random, also to one that is stopped (SIGSTOP, a frozen
     * VM): nats-server keeps a stopped client in the group as long as it
     * has messages to hand it (a delivery counts as the client's activity,
     * so it is never pinged; server/client.go flushClients), and half the
     * asks of two brokers went there. So every ask again goes to all the
     * brokers (EVT_API_EXECUTE_AGAIN): whichever live broker holds or
     * finds the command answers. An ask that a live broker answers at once
     * (a live request: its id comes first; any ask again) is asked again
     * after EXEC_UNANSWERED_MS without an answer.
     *
     * A reply sent while this client's connection was down is lost (core
     * NATS: the node it was on died, test_cluster F02 waited 17.6 s for a
     * result recorded 1.7 s before the kill, under load). So once the
     * connection is back (its reconnect count moved), the ask goes out
     * again at once instead of after BROKER_EXEC_REASK_MS of silence.
     */
    if (!r.idempotency_key || !r.idempotency_key[0]) {
        char u[37];
        ks_uuid(u);
        snprintf(key, sizeof(key), "exec-%s", u);
        r.idempotency_key = key;
    } else {
        r.key_may_exist = 1; /* the caller's key: it may name a command */
    }
    /* One inbox lease for every ask and every answer (events.h). */
    if ((rc = evt_inbox_take(c, NULL, &ib)) ||
        (rc = kproto_pack(&r.base, &buf, &len)))
        goto out;
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_EXECUTE, c->identity);
    snprintf(again, sizeof(again), "%s.%s", EVT_API_EXECUTE_AGAIN,
             c->identity);
    int64_t start = ks_mono_us(), heard = start, asked = start;
    bool answered = false; /* the last ask was answered */
    if (natsStatistics_Create(&stats) != NATS_OK)
        stats = NULL; /* no early ask at a reconnect: the silences' do */
    uint64_t reconnects = conn_reconnects(c, stats);
    unsigned asks = 1;
    bool silent = false; /* said so through h->silence */
    /* The first ask can fail as the node this client is on dies (test_cluster
     * F02 under make soak: exit 125 "execute: NATS error", 0.2 s after
     * the kill): asked again once the connection is back, or at the first
     * silence, with the same key. Only a closed connection ends it, or
     * what no ask again can mend (a request too large: nothing sent). */
    if ((rc = evt_inbox_send(ib, subject, NULL, NULL, buf, len))) {
        if (natsConnection_IsClosed(c->nc) ||
            (rc != KS_EUNAVAIL && rc != KS_ENATS && rc != KS_ETIMEDOUT))
            goto out;
        rc = 0;
        asked = start - (int64_t)BROKER_EXEC_REASK_MS * 1000;
    }
    for (;;) {
        natsMsg *m = NULL;
        int nrc = evt_inbox_next(ib, h ? 100 : 1000, &m);
        int64_t now = ks_mono_us();
        if (nrc == 0 && (rc = evt_join_parts(ib, m, 5000, &m)))
            goto out;
        if (nrc == 0) {
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
                 rep->error_code == KS_EPG || rep->error_code == KS_EBUSY)) {
                /* A later ask was refused, but the first one was never
                 * answered: it may have recorded the command (a busy
                 * broker refuses an ask again only when the key names
                 * nothing yet, but the first ask may still wait in its
                 * queue). */
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
            if (silent && h && h->silence)
                h->silence(false, 0, id, h->ud);
            silent = false;
            if (h && h->live)
                h->live(rep, h->ud);
            ks__execute_reply__free_unpacked(rep, NULL);
            heard = now;
            answered = true;
        } else if (nrc != KS_ETIMEDOUT && nrc != KS_EUNAVAIL &&
                   natsConnection_IsClosed(c->nc)) {
            rc = nrc;
            goto out;
        } else if (nrc != KS_ETIMEDOUT && nrc != KS_EUNAVAIL) {
            /* The inbox's subscription said something else (nats.c
             * while its connection is lost and made again): no answer
             * lost with it is lost for good, the ask goes out again. */
            nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
        } else if (nrc == KS_EUNAVAIL && natsConnection_IsClosed(c->nc)) {
            rc = nrc;
            goto out;
        }
        if (!silent && h && h->silence &&
            (nrc == KS_EUNAVAIL ||
             now - heard >= 2 * (int64_t)BROKER_EXEC_REASK_MS * 1000)) {
            /* Nobody serves the API, or nobody answered an ask again:
             * say so now, not at the end of the wait. */
            int64_t left =
                (int64_t)BROKER_EXEC_GIVE_UP_MS - (now - heard) / 1000;
            silent = true;
            h->silence(true, left > 0 ? (int)left : 0, id[0] ? id : NULL,
                       h->ud);
        }
        if (h && h->tick && (rc = h->tick(h->ud)))
            goto out;
        if (timeout_ms != INT32_MAX &&
            now - start >= (int64_t)timeout_ms * 1000) {
            rc = KS_ETIMEDOUT;
            goto out;
        }
        if (now - heard >= (int64_t)BROKER_EXEC_GIVE_UP_MS * 1000) {
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
        bool unanswered = !answered && (asks > 1 || r.live_output) &&
                          now - asked >= (int64_t)EXEC_UNANSWERED_MS * 1000;
        int64_t reask_us = (int64_t)BROKER_EXEC_REASK_MS * 1000;
        uint64_t rn = conn_reconnects(c, stats);
        bool back = rn != reconnects &&
                    natsConnection_Status(c->nc) == NATS_CONN_STATUS_CONNECTED;
        if (back)
            reconnects = rn;
        if (unanswered || back ||
            (now - heard >= reask_us && now - asked >= reask_us)) {
            asked = now;
            answered = false;
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
            if ((rc = evt_inbox_send(ib, again, NULL, NULL, buf, len))) {
                /* While nats.c reconnects (its node killed: test_cluster
                 * F02 under make soak, exit 125 "lost the connection"),
                 * a send can fail: the ask goes out again once it is
                 * back (above), or at the next silence. Only a closed
                 * connection ends the wait. */
                if (natsConnection_IsClosed(c->nc))
                    goto out;
                rc = 0;
                continue;
            }
            asks++;
        }
    }
out:
    natsStatistics_Destroy(stats);
    evt_inbox_give(ib);
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
