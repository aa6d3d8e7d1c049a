/*
 * consumer.c: what a JetStream consumer is doing, and the two repairs of
 * one that stopped delivering (the broker's consumer guard,
 * broker/stall.c). The broker's connection only: every call here is the
 * JetStream API.
 *
 * Why a consumer stops (nats-server 2.9, seen on `kscore up --cluster 3`):
 * an ack sent while the consumer's raft group has no leader reaches
 * nobody (only the leader subscribes to the ack subject,
 * consumer.go setLeader), so the message stays unacked for its whole ack
 * wait, and with max_ack_pending = the agent's slots the consumer
 * delivers nothing more meanwhile; a leader whose own stream replica lags
 * delivers nothing it has not stored (nats-server#3299); a group without
 * quorum has no leader at all. A step-down moves the leader and keeps the
 * consumer's replicated state (it helps the second, not the first); only
 * making the consumer again clears unacked messages nobody holds.
 */
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "events.h"
#include "events_int.h"

/* A JetStream API call's failure (s, and the error code of its reply) as
 * kscore's: KS_ENOTFOUND when the stream is gone or the reply's code is
 * missing (what the call asked for is not there), KS_EUNAVAIL for 10008
 * (a member of the raft group answers that it has no leader: an
 * election, or no quorum), else KS_ENATS or nats.c's status. */
static int
api_rc(natsStatus s, jsErrCode jerr, jsErrCode missing)
{
    if (s == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr ||
        (missing && jerr == missing))
        return KS_ENOTFOUND;
    return jerr == JSClusterNotAvailErr ? KS_EUNAVAIL
           : s == NATS_OK             ? KS_ENATS
                                      : evt_err(s);
}

int
evt_consumer_state(struct evt_conn *c, const char *stream, const char *durable,
                   int timeout_ms, struct evt_consumer_state *out)
{
    jsConsumerInfo *ci = NULL;
    jsErrCode jerr = 0;
    jsOptions jo;
    natsStatus s;

    jsOptions_Init(&jo);
    jo.Wait = timeout_ms;
    s = js_GetConsumerInfo(&ci, c->js, stream, durable, &jo, &jerr);
    if (s != NATS_OK || !ci) {
        jsConsumerInfo_Destroy(ci);
        return api_rc(s, jerr, JSConsumerNotFoundErr);
    }
    memset(out, 0, sizeof(*out));
    out->created_ns = ci->Created;
    out->delivered = ci->Delivered.Consumer;
    out->delivered_stream_seq = ci->Delivered.Stream;
    out->delivered_at_ns = ci->Delivered.Last;
    out->ack_floor = ci->AckFloor.Consumer;
    out->pending = ci->NumPending;
    out->ack_pending = ci->NumAckPending;
    out->max_ack_pending = ci->Config ? ci->Config->MaxAckPending : 0;
    out->push_bound = ci->PushBound;
    if (ci->Cluster && ci->Cluster->Leader)
        snprintf(out->leader, sizeof(out->leader), "%s", ci->Cluster->Leader);
    jsConsumerInfo_Destroy(ci);
    return 0;
}

int
evt_stream_stored(struct evt_conn *c, const char *stream, const char *filter,
                  int timeout_ms, uint64_t *count_out)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    jsOptions jo;
    natsStatus s;
    uint64_t n = 0;

    jsOptions_Init(&jo);
    jo.Wait = timeout_ms;
    jo.Stream.Info.SubjectsFilter = filter;
    s = js_GetStreamInfo(&si, c->js, stream, &jo, &jerr);
    if (s != NATS_OK || !si) {
        jsStreamInfo_Destroy(si);
        return api_rc(s, jerr, 0);
    }
    if (si->State.Subjects)
        for (int i = 0; i < si->State.Subjects->Count; i++)
            n += si->State.Subjects->List[i].Msgs;
    jsStreamInfo_Destroy(si);
    *count_out = n;
    return 0;
}

int
evt_stream_holds(struct evt_conn *c, const char *stream, uint64_t seq,
                 int timeout_ms)
{
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    jsOptions jo;
    natsStatus s;

    jsOptions_Init(&jo);
    jo.Wait = timeout_ms;
    s = js_GetMsg(&m, c->js, stream, seq, &jo, &jerr);
    natsMsg_Destroy(m);
    return s == NATS_OK ? 0 : api_rc(s, jerr, JSNoMessageFoundErr);
}

/* The JetStream API's error in a reply, as "<description> (<code>/
 * <err_code>)" into why; true when there is one. */
static bool
api_error(const json_t *j, char *why, size_t len)
{
    json_t *err = json_object_get(j, "error");
    if (!err)
        return false;
    const char *d = json_string_value(json_object_get(err, "description"));
    snprintf(why, len, "%s (%lld/%lld)", d ? d : "JetStream error",
             (long long)json_integer_value(json_object_get(err, "code")),
             (long long)json_integer_value(json_object_get(err, "err_code")));
    return true;
}

int
evt_consumer_stepdown(struct evt_conn *c, const char *stream,
                      const char *durable, int timeout_ms, char *why,
                      size_t why_len)
{
    char subj[64 + 2 * EVT_AGENT_ID_MAX];
    natsMsg *m = NULL;
    char dummy[8];
    int rc;

    if (!why) {
        why = dummy;
        why_len = sizeof(dummy);
    }
    why[0] = '\0';
    /* nats-server 2.9 jetstream_api.go jsConsumerLeaderStepDownRequest:
     * only the leader acts and answers {"success": true}; a member of a
     * leaderless group answers 10008; nobody answers when the leader is
     * gone unnoticed. */
    if (snprintf(subj, sizeof(subj), "$JS.API.CONSUMER.LEADER.STEPDOWN.%s.%s",
                 stream, durable) >= (int)sizeof(subj))
        return KS_ETOOBIG;
    rc = evt_request_bytes(c, subj, NULL, "", 0, timeout_ms, &m);
    if (rc) {
        snprintf(why, why_len, "%s", ks_strerror(rc));
        return rc;
    }
    json_t *j = json_loadb(natsMsg_GetData(m),
                           (size_t)natsMsg_GetDataLength(m), 0, NULL);
    natsMsg_Destroy(m);
    if (!json_is_object(j)) {
        json_decref(j);
        snprintf(why, why_len, "not a JetStream API reply");
        return KS_EDECODE;
    }
    rc = api_error(j, why, why_len)                      ? KS_ENATS
         : json_is_true(json_object_get(j, "success"))   ? 0
                                                         : KS_EDECODE;
    if (rc == KS_EDECODE)
        snprintf(why, why_len, "no success in the reply");
    json_decref(j);
    return rc;
}

/* Tries of a remake whose delete has not taken yet, and the pause
 * before each again (ms). */
#define REMAKE_TRIES 8
#define REMAKE_PAUSE_MS 250

/* Whether now is still the consumer old was: the same creation time, or
 * the old one's delivery state (its consumer and stream sequences and its
 * unacked count) with no delivery since. The time of the last delivery
 * is each node's own (the leader's delivery, a follower's apply, 0 in a
 * consumer object built from the old one's files), so "no delivery
 * since" is a last delivery under a second after the old one's: the guard
 * remakes only a consumer that delivered nothing for longer than that,
 * and a consumer made anew redelivers what it holds after the remake. */
#define STILL_OLD_DELIVERY_NS INT64_C(1000000000)
static bool
still_old(const struct evt_consumer_state *old,
          const struct evt_consumer_state *now)
{
    if (now->created_ns == old->created_ns)
        return true;
    return old->delivered > 0 && now->delivered == old->delivered &&
           now->delivered_stream_seq == old->delivered_stream_seq &&
           now->ack_pending == old->ack_pending &&
           now->delivered_at_ns < old->delivered_at_ns + STILL_OLD_DELIVERY_NS;
}

int
evt_consumer_remake(struct evt_conn *c, const struct evt_durable *d,
                    char **errmsg)
{
    /*
     * On a cluster a consumer's delete is answered before every node has
     * let go of it: its info, asked at once, can still come from the old
     * consumer's group, and evt_consumer_ensure then keeps it ("as
     * asked"). That remake did nothing while it said it had (test_cluster
     * a_consumer_stalled_by_a_lost_ack_is_repaired under make soak: the
     * consumer after it still showed "last delivery #2, stream sequence 2,
     * 1 unacked", and the guard had to repair it a second time). So the
     * consumer made is checked against the old one's creation time, and
     * while it is the old one the delete and the create are tried again.
     * A consumer made anew by someone else meanwhile (another broker's
     * repair) has another creation time, and is kept.
     *
     * A create answered "created" is checked too: a node that has not
     * applied the delete yet takes the new consumer's assignment as an
     * update of the old one it still has, state and all, and may lead it
     * (make soak, the same test: the remake's create said created, and the
     * consumer's new leader, elected that moment, still held "last
     * delivery #2, stream sequence 2, 1 unacked"; the guard repaired it a
     * second time 3.6 s later). So the state is compared too, not only
     * the creation time (still_old).
     */
    struct evt_consumer_state old = {0};
    bool known = evt_consumer_state(c, d->stream, d->durable, 1000, &old) ==
                     0 &&
                 old.created_ns != 0;
    for (int tries = 1;; tries++) {
        int rc = evt_consumer_delete(c, d->stream, d->durable);
        /* Gone already (another broker's repair, or its deletion was what
         * went wrong): made below all the same. */
        if (rc && rc != KS_ENOTFOUND) {
            if (errmsg && asprintf(errmsg, "consumer %s (delete): %s",
                                   d->durable, nats_GetLastError(NULL)) < 0)
                *errmsg = NULL;
            return rc;
        }
        /* created, replaced or kept: each is checked below */
        if ((rc = evt_consumer_ensure(c, d, NULL, errmsg)))
            return rc;
        struct evt_consumer_state now = {0};
        if (!known ||
            evt_consumer_state(c, d->stream, d->durable, 1000, &now) != 0 ||
            !still_old(&old, &now))
            return 0; /* (one made anew, by us or another, or cannot tell) */
        if (tries == REMAKE_TRIES) {
            if (errmsg &&
                asprintf(errmsg,
                         "consumer %s: still the old one (made at %lld ns) "
                         "after %d deletes",
                         d->durable, (long long)old.created_ns, tries) < 0)
                *errmsg = NULL;
            return KS_EUNAVAIL;
        }
        nanosleep(&(struct timespec){0, REMAKE_PAUSE_MS * 1000000L}, NULL);
    }
}
