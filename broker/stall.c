/*
 * The consumer guard: a consumer of KSCORE_CMDS that has work for an agent
 * with free slots and delivers nothing is noticed within seconds and
 * repaired, loudly (issue 22: on `kscore up --cluster 3` a consumer whose
 * leader moved kept its agent's slots filled with unacked messages until
 * the ack wait ran out, and the online agent's commands ended
 * Undeliverable while nothing noticed; events/consumer.c says why a
 * consumer stops).
 *
 * Where to look comes from the record, not from JetStream: every
 * GUARD_TICK_US the agents with commands Dispatched (published, not
 * claimed) for over GUARD_WAITING_US (store_scan_waiting). An agent that
 * is offline, or whose slots are all taken (what its heartbeat says it
 * runs or holds: a claim held up in the broker holds its message unacked,
 * test_agent cancel_before_the_spawn_is_cancelled), has nothing to
 * deliver to: not a stall. For the others the consumer
 * itself is asked (evt_consumer_state), and judged over GUARD_STALL_US
 * without a new delivery:
 *  - unacked messages fill its max_ack_pending while the agent runs fewer
 *    than its slots: nobody holds them (acks lost while the consumer had
 *    no leader). Made again: a step-down keeps the replicated state.
 *  - undelivered messages and room to deliver them: its leader does not
 *    deliver. Its leader steps down; still so GUARD_STALL_US later: made
 *    again.
 *  - fewer messages pending and unacked than the stream holds on its
 *    subjects: it skipped some and will never deliver them (also those it
 *    gave up at MaxDeliver, which the work queue keeps). Made again.
 *  - no leader (no answer, or its group says so) for GUARD_NO_LEADER_US:
 *    made again (a new raft group; the meta leader does it).
 *  - gone (for GUARD_STALL_US: a node that has just come back may not know
 *    it yet): made again.
 * One more trouble is not the consumer's stall but a single message's:
 * a delivery the consumer counts as made that its agent never took (lost
 * when the consumer's leader stepped down as it delivered: test_cluster
 * consumer_leader_changes waited 10.1 s for such a command; or taken by a
 * process of the id's queue group that stopped). The consumer holds it
 * unacked for the whole ack wait while it goes on delivering the rest, so
 * none of the rules above sees it, and the scanner re-published it only at
 * its attempt's deadline (a third of the delivery window). The guard
 * repairs it at once (lost_deliveries below) once its delivery is shown
 * and its taking is not: at one look the consumer's last delivery was at or past the
 * stream sequence of the command's message (its PubAck,
 * broker__admit_stored_seq: so each broker judges the commands it
 * published; a dispatch recorded is no message stored while KSCORE_CMDS
 * elects a leader, F02), so the consumer has passed it (it delivers in
 * stream order); and a heartbeat of the agent put GUARD_LIST_US after
 * that look, with free slots, has a complete list (AgentInfo.holds: from
 * before its claim is sent) without it. A delivered command with a free
 * slot is listed within milliseconds. The same rule finds a message the
 * consumer passed without holding it unacked either (F02, test_cluster:
 * after KSCORE_CMDS's leader moved, a consumer's ack floor stood below a
 * message the stream still held while it delivered everything after it,
 * with nothing pending or unacked; the scanner re-published it at 10 s).
 * While the stream still holds the message, the repair is the consumer
 * made again (it delivers that same message: one stream message per
 * command); a message gone (acked by a process that is not its agent's)
 * is published again as a new attempt (broker__redispatch). A delivery
 * that comes twice is taken once: the agent takes the new delivery of a
 * command it runs, refuses an attempt it has seen, and the claim fence
 * keeps one run.
 * Every repair is logged with what was seen, counted
 * (kscore_consumer_stalls_total, _stepdowns_total, _remakes_total), and
 * shown by `kscore agents --json` / `kscore status` for the agents of that
 * consumer (broker__guard_view). Each broker runs a guard, and one of them
 * repairs a given consumer (broker__guard_owner: a rendezvous over the
 * brokers' registry beacons); another does only when the trouble lasts
 * GUARD_BACKUP_US longer (the owner died or does not see it). A repair is
 * told to the other brokers (BROKER_NOTICE_GUARD), which count and show
 * it too; after it each sees a new consumer or a new delivery and starts
 * its count again.
 *
 * A repair delivers what the consumer held again: the agent takes the new
 * delivery of a command it runs (same attempt: its ack subject), a command
 * it ran is refused by the claim fence; nothing runs twice.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

/* The guard's period. */
#define GUARD_TICK_US (500 * INT64_C(1000))
/* A command unclaimed this long makes its agent's consumer a suspect: a
 * claim is milliseconds after the publish. */
#define GUARD_WAITING_US (2000 * INT64_C(1000))
/* A suspect with no new delivery for this long is stalled. */
#define GUARD_STALL_US (1500 * INT64_C(1000))
/* A consumer without a leader this long is made again: elections take
 * seconds, and a group without quorum has none for good. */
#define GUARD_NO_LEADER_US (10 * INT64_C(1000000))
/* Each JetStream question waits this long (ms). */
#define GUARD_ASK_MS 1000
/* Suspects looked at per tick at most, and each consumer at most this
 * often (two looks judge a stall): a busy fleet's agents have commands
 * waiting all the time, and each look is a request to the consumer's
 * leader. */
#define GUARD_SUSPECTS_MAX 64
#define GUARD_LOOK_EVERY_US (750 * INT64_C(1000))
/* An agent counts as there when its consumer has a subscriber
 * (push_bound) or its last heartbeat came this recently: two heartbeats
 * and a second. Positive evidence only, so a registry watch restarted a
 * moment ago (deaf to silence, broker__registry_deaf) still tells who is
 * there. */
#define GUARD_HEARD_US ((2 * EVT_HEARTBEAT_MS + 1000) * INT64_C(1000))
/* Lost deliveries (lost_deliveries): a heartbeat put this long after a
 * look at which the consumer had passed a command's message, with free
 * slots, lists it if its agent took it. Suspects start GUARD_WAITING_US after
 * the dispatch and heartbeats come every EVT_HEARTBEAT_MS: a lost
 * delivery is published again 3 to 5 s after it went out, instead of at
 * its attempt's deadline (10 s of the default 30 s window). */
#define GUARD_LIST_US (500 * INT64_C(1000))
/* The look lost deliveries are judged from is kept this long (a new one
 * taken then): long enough for a heartbeat put GUARD_LIST_US after it to
 * come (heartbeats come every EVT_HEARTBEAT_MS). Taken at every look
 * (750 ms apart), it wanted a heartbeat in the 0.25 s between 0.5 s after
 * one look and the next: test_agent a_lost_delivery_is_delivered_again
 * waited for the scanner (10.1 s) 1 run in 5. */
#define GUARD_PASSED_KEEP_US                                                 \
    ((EVT_HEARTBEAT_MS + 500) * INT64_C(1000) + GUARD_LIST_US)
/* Commands of one id re-published per look at most. */
#define GUARD_LOST_MAX 32
/* Ids of one pool whose commands wait, kept per suspect (a pool consumer
 * serves many): the lost deliveries of the first ones are looked for. */
#define GUARD_SUSPECT_IDS 4
/* A broker that is not a consumer's owner (broker__guard_owner) repairs
 * it only when it has been stalled this much longer: the owner died, or
 * does not see it. */
#define GUARD_BACKUP_US (3000 * INT64_C(1000))

/* What the guard knows of one consumer. */
struct guarded {
    char durable[8 + EVT_AGENT_ID_MAX];
    bool seen;              /* a first state is in hand */
    int64_t created_ns;     /* of the consumer last seen */
    uint64_t delivered;     /* its deliveries then */
    int64_t quiet_since_us; /* mono: no new delivery since */
    int kind;               /* enum stall_kind of the last look */
    int64_t looked_us;      /* mono of the last look */
    int64_t stepped_down_us;    /* mono of the last step-down, 0: none */
    /* the last look that answered: the stream sequence its consumer
     * had delivered up to, when (mono), and which consumer it was */
    uint64_t passed_seq;
    int64_t passed_us;
    int64_t passed_created_ns;
    bool suspect;           /* a suspect at this tick */
    /* what `kscore agents` shows (under g->mu) */
    char stall[200];        /* "" unless stalled now */
    int64_t stalled_since_us; /* epoch */
    uint32_t repairs;
    char last_repair[200];
    int64_t repaired_at_us; /* epoch */
    int64_t noticed_us;     /* mono: another broker's last repair notice */
};

struct broker__guard {
    struct broker *b;
    struct store *st;
    pthread_t thread;
    bool started;
    natsSubscription *sub; /* the other brokers' repairs */
    pthread_mutex_t mu; /* consumers */
    struct ks_map consumers; /* durable -> struct guarded * */
};

/* One suspect of this tick: the consumer as the provisioner makes it. */
struct suspect {
    struct broker__consumer_of co;
    char agent_id[EVT_AGENT_ID_MAX + 1];
    uint32_t waiting;
    int64_t oldest_us;
    /* the ids with commands waiting (agent_id first), up to
     * GUARD_SUSPECT_IDS */
    char ids[GUARD_SUSPECT_IDS][EVT_AGENT_ID_MAX + 1];
    size_t n_ids;
};

/* One more id of x's with commands waiting. */
static void
suspect_id(struct suspect *x, const char *agent_id)
{
    if (x->n_ids < GUARD_SUSPECT_IDS)
        snprintf(x->ids[x->n_ids++], sizeof(x->ids[0]), "%s", agent_id);
}

struct suspects {
    struct broker *b;
    struct suspect v[GUARD_SUSPECTS_MAX];
    size_t n;
    /* This tick's pools already judged (pool durable -> its suspect in v,
     * or &not_suspect): a pool's slots are the sum over its ids
     * (broker__consumer_of walks every agent), so judged once a tick, not
     * once per id with commands waiting. That was up to 256 walks of the
     * whole registry a tick under b->mu: in batch_exec_10000 (10,000 ids
     * in 20 pools) pool_running and its strcmp were 10% of the machine's
     * CPU (perf record -a). */
    struct ks_map pools;
};

static char not_suspect;

static int
on_waiting(const struct store_waiting *w, void *ud)
{
    struct suspects *s = ud;
    struct suspect *x = &s->v[s->n];
    char pool[EVT_AGENT_ID_MAX + 1], pool_durable[8 + EVT_AGENT_ID_MAX];

    broker__agent_pool(s->b, w->agent_id, pool, sizeof(pool));
    if (pool[0]) {
        evt_pool_durable(pool_durable, sizeof(pool_durable), pool);
        void *seen = ks_map_get(&s->pools, pool_durable);
        if (seen == &not_suspect)
            return 0;
        if (seen) {
            ((struct suspect *)seen)->waiting += w->commands;
            suspect_id(seen, w->agent_id);
            return 0;
        }
    }
    if (broker__consumer_of(s->b, w->agent_id, &x->co) != 0 ||
        ks_mono_us() - x->co.heard_us >= (int64_t)EVT_AGENT_TTL_MS * 1000 ||
        x->co.running >= x->co.max_concurrent) {
        if (pool[0]) /* -ENOMEM: judged again, no harm */
            (void)ks_map_put(&s->pools, pool_durable, &not_suspect);
        return 0; /* nobody to deliver to, or no slot to deliver into */
    }
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->v[i].co.ac.durable, x->co.ac.durable) == 0) {
            s->v[i].waiting += w->commands; /* another id of its pool */
            suspect_id(&s->v[i], w->agent_id);
            return 0;
        }
    if (pool[0])
        (void)ks_map_put(&s->pools, pool_durable, x);
    snprintf(x->agent_id, sizeof(x->agent_id), "%s", w->agent_id);
    x->n_ids = 0;
    suspect_id(x, w->agent_id);
    x->waiting = w->commands;
    x->oldest_us = w->oldest_dispatched_us;
    return ++s->n == GUARD_SUSPECTS_MAX;
}

static struct guarded *
guarded_get(struct broker__guard *g, const char *durable)
{
    pthread_mutex_lock(&g->mu);
    struct guarded *c = ks_map_get(&g->consumers, durable);
    if (!c && (c = calloc(1, sizeof(*c)))) {
        snprintf(c->durable, sizeof(c->durable), "%s", durable);
        if (ks_map_put(&g->consumers, c->durable, c) != 0) {
            free(c);
            c = NULL;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return c;
}

/* The stall shown for c (what, since when), or cleared (what NULL). */
static void
show_stall(struct broker__guard *g, struct guarded *c, const char *what)
{
    pthread_mutex_lock(&g->mu);
    if (!what) {
        c->stall[0] = '\0';
        c->stalled_since_us = 0;
    } else {
        if (!c->stall[0])
            c->stalled_since_us = ks_now_us();
        snprintf(c->stall, sizeof(c->stall), "%s", what);
    }
    pthread_mutex_unlock(&g->mu);
}

/* A repair of c, by this broker (tell: the others hear of it) or
 * another: counted and shown. */
static void
note_repair(struct broker__guard *g, struct guarded *c, const char *done,
            int64_t at_us, bool tell)
{
    pthread_mutex_lock(&g->mu);
    c->repairs++;
    snprintf(c->last_repair, sizeof(c->last_repair), "%s", done);
    c->repaired_at_us = at_us;
    pthread_mutex_unlock(&g->mu);
    if (tell) {
        char subject[sizeof(BROKER_NOTICE_GUARD) + sizeof(c->durable)],
            data[sizeof(g->b->instance_id) + 24 + sizeof(c->last_repair)];
        int n = snprintf(data, sizeof(data), "%s\n%lld\n%s",
                         g->b->instance_id, (long long)at_us, done);
        snprintf(subject, sizeof(subject), "%s%s", BROKER_NOTICE_GUARD,
                 c->durable);
        /* Core NATS, fire and forget: a lost one costs the others' view. */
        natsConnection_Publish(g->b->nc->nc, subject, data,
                               n < (int)sizeof(data) ? n
                                                     : (int)sizeof(data) - 1);
    }
}

/* Another broker's repair (BROKER_NOTICE_GUARD): its delivery thread. */
static void
on_repair_notice(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                 void *ud)
{
    struct broker__guard *g = ud;
    const char *subj = natsMsg_GetSubject(msg);
    size_t ni = strlen(g->b->instance_id);
    char data[512];
    int len = natsMsg_GetDataLength(msg);

    (void)nc;
    (void)sub;
    if (len > 0 && len < (int)sizeof(data)) {
        memcpy(data, natsMsg_GetData(msg), (size_t)len);
        data[len] = '\0';
        char *at = strchr(data, '\n'), *what = at ? strchr(at + 1, '\n') : NULL;
        const char *durable = subj + strlen(BROKER_NOTICE_GUARD);
        if (what && (size_t)(at - data) == ni &&
            memcmp(data, g->b->instance_id, ni) != 0 &&
            strlen(durable) < sizeof(((struct guarded *)0)->durable)) {
            struct guarded *c = guarded_get(g, durable);
            if (c) {
                pthread_mutex_lock(&g->mu);
                c->noticed_us = ks_mono_us();
                pthread_mutex_unlock(&g->mu);
                note_repair(g, c, what + 1, strtoll(at + 1, NULL, 10),
                            false);
                show_stall(g, c, NULL); /* repaired: our next look says */
            }
        }
    }
    natsMsg_Destroy(msg);
}

/* What is wrong with a consumer (look). */
enum stall_kind {
    STALL_NONE,
    STALL_GONE,        /* no such consumer */
    STALL_NO_LEADER,   /* nobody answers for it, or its group says so */
    STALL_UNACKED,     /* unacked messages nobody holds fill its slots */
    STALL_UNDELIVERED, /* work, room, and no delivery */
    STALL_SKIPPED      /* fewer pending + unacked than stored */
};

/* Makes c's consumer again (x->co.ac, as the provisioner would). */
static void
remake(struct broker__guard *g, struct guarded *c, const struct suspect *x,
       const char *why)
{
    char *err = NULL, done[200];
    int rc = evt_consumer_remake(g->b->nc, &x->co.ac.d, &err);

    ks_metric_inc(KS_C_CONSUMER_STALLS);
    if (rc == 0)
        ks_metric_inc(KS_C_CONSUMER_REMAKES);
    ks_log(rc ? KS_LOG_ERROR : KS_LOG_WARN,
           rc ? "agent consumer stalled: cannot make it again (tried again)"
              : "agent consumer stalled: made it again (what it held is "
                "delivered again; the claim fence keeps one run)",
           KS_S("module", "guard"), KS_S("consumer", c->durable),
           KS_S("agent", x->agent_id), KS_S("why", why),
           KS_I("commands_waiting", x->waiting),
           KS_I("waiting_ms", (ks_now_us() - x->oldest_us) / 1000),
           KS_S("error", rc ? (err ? err : ks_strerror(rc)) : ""));
    free(err);
    if (rc) {
        /* (a remake blocks this thread for seconds: the next try waits
         * a whole stall window, not the next look) */
        c->quiet_since_us = ks_mono_us();
        return;
    }
    snprintf(done, sizeof(done), "made it again: %s", why);
    note_repair(g, c, done, ks_now_us(), true);
    c->seen = false; /* a new consumer: its own count from now */
    c->stepped_down_us = 0;
    c->kind = 0;
}

/* Asks c's leader to step down; on a single server (no clustering) or
 * when it refuses, makes it again instead. */
static void
step_down(struct broker__guard *g, struct guarded *c, const struct suspect *x,
          const char *why)
{
    char err[256], done[200];
    int rc = evt_consumer_stepdown(g->b->nc, EVT_STREAM_CMDS, c->durable,
                                   GUARD_ASK_MS, err, sizeof(err));
    if (rc) {
        ks_log(KS_LOG_WARN,
               "agent consumer stalled: its leader did not step down",
               KS_S("module", "guard"), KS_S("consumer", c->durable),
               KS_S("error", err));
        remake(g, c, x, why);
        return;
    }
    ks_metric_inc(KS_C_CONSUMER_STALLS);
    ks_metric_inc(KS_C_CONSUMER_STEPDOWNS);
    ks_log(KS_LOG_WARN,
           "agent consumer stalled: its leader stepped down (made again if "
           "the next one does not deliver either)",
           KS_S("module", "guard"), KS_S("consumer", c->durable),
           KS_S("agent", x->agent_id), KS_S("why", why),
           KS_I("commands_waiting", x->waiting),
           KS_I("waiting_ms", (ks_now_us() - x->oldest_us) / 1000));
    snprintf(done, sizeof(done), "stepped its leader down: %s", why);
    note_repair(g, c, done, ks_now_us(), true);
    c->stepped_down_us = ks_mono_us();
    c->quiet_since_us = c->stepped_down_us; /* the new leader's turn */
}


/* Classifies a consumer that answered and delivered nothing since the
 * last look; why (len bytes) says what was seen. */
static enum stall_kind
classify(struct broker__guard *g, const struct suspect *x,
         const struct evt_consumer_state *cs, char *why, size_t len)
{
    uint64_t stored = 0;

    if (cs->max_ack_pending > 0 && cs->ack_pending >= cs->max_ack_pending) {
        snprintf(why, len,
                 "%lld unacked messages fill its %lld slots while the agent "
                 "runs %u of %u (its last delivery #%llu, stream sequence "
                 "%llu; leader %s)",
                 (long long)cs->ack_pending, (long long)cs->max_ack_pending,
                 x->co.running, x->co.max_concurrent,
                 (unsigned long long)cs->delivered,
                 (unsigned long long)cs->delivered_stream_seq,
                 cs->leader[0] ? cs->leader : "-");
        return STALL_UNACKED;
    }
    if (cs->pending > 0) {
        snprintf(why, len,
                 "%llu messages undelivered with room for %lld more (leader "
                 "%s%s)",
                 (unsigned long long)cs->pending,
                 (long long)(cs->max_ack_pending - cs->ack_pending),
                 cs->leader[0] ? cs->leader : "-",
                 cs->push_bound ? "" : ", no subscriber seen");
        return STALL_UNDELIVERED;
    }
    if (evt_stream_stored(g->b->nc, EVT_STREAM_CMDS,
                          x->co.ac.d.filter_subject, GUARD_ASK_MS,
                          &stored) == 0 &&
        stored > cs->pending + (uint64_t)cs->ack_pending) {
        snprintf(why, len,
                 "the stream holds %llu messages for it, it has %llu "
                 "undelivered and %lld unacked",
                 (unsigned long long)stored, (unsigned long long)cs->pending,
                 (long long)cs->ack_pending);
        return STALL_SKIPPED;
    }
    return STALL_NONE;
}

/*
 * Whether c's consumer is still as it was judged stalled, asked again just
 * before a repair: another broker (the owner, or a backup whose turn came
 * at the same time) may have repaired it a moment ago, and two repairs of
 * one stall redeliver twice and are counted twice ("repaired 2 times",
 * test_cluster a_consumer_stalled_by_a_lost_ack_is_repaired). Not as
 * judged: another broker's repair notice came since the count began, or
 * the consumer is a new one, delivered, or (for a stall of a consumer
 * that answered) is gone or leaderless now (another broker's remake
 * between its delete and its create, or its new group electing): it is
 * then looked at afresh. A question that times out changes nothing.
 */
static bool
still_as_judged(struct broker__guard *g, struct guarded *c)
{
    struct evt_consumer_state cs;
    pthread_mutex_lock(&g->mu);
    bool noticed = c->noticed_us && c->noticed_us >= c->quiet_since_us;
    pthread_mutex_unlock(&g->mu);
    int rc = noticed ? 0
                     : evt_consumer_state(g->b->nc, EVT_STREAM_CMDS,
                                          c->durable, GUARD_ASK_MS, &cs);
    bool answered_before =
        c->kind != STALL_GONE && c->kind != STALL_NO_LEADER;
    bool changed =
        noticed ||
        (rc == 0 && (!answered_before || !c->seen ||
                     cs.created_ns != c->created_ns ||
                     cs.delivered != c->delivered)) ||
        (answered_before && (rc == KS_ENOTFOUND || rc == KS_EUNAVAIL));
    if (!changed)
        return true;
    ks_log(KS_LOG_INFO,
           "agent consumer changed since it was judged stalled (repaired by "
           "another broker, or delivering): looked at afresh",
           KS_S("module", "guard"), KS_S("consumer", c->durable),
           KS_S("seen", noticed ? "another broker's repair notice"
                        : rc == 0 ? "a new consumer or a delivery"
                                  : ks_strerror(rc)));
    c->seen = false;
    c->kind = 0;
    c->stepped_down_us = 0;
    c->quiet_since_us = ks_mono_us();
    show_stall(g, c, NULL);
    return false;
}

/* ---- lost deliveries ------------------------------------------------------ */

struct lost_scan {
    struct broker__guard *g;
    struct guarded *c;
    const struct suspect *x;
    const struct evt_consumer_state *cs;
    uint64_t passed_seq;     /* the consumer had passed messages up to it */
    int64_t listed_after_us; /* epoch: a heartbeat put since can tell */
    unsigned sent;
    bool remade; /* the consumer was made again: it delivers them all */
};

/* One command of the suspect's, delivered (its message at or below the
 * stream sequence its consumer had delivered up to at a look), that a
 * heartbeat put since ls->listed_after_us does not list: while the
 * stream still holds its message (held unacked by someone else, or
 * skipped), the consumer is made again, which delivers that same message
 * (one stream message per command, as F02 wants); once it is gone (acked
 * by a process that is not its agent's), it is published again as a new
 * attempt (store_scan_dispatched callback, the guard's thread). */
static int
on_lost(const struct store_command_ref *ref, void *ud)
{
    struct lost_scan *ls = ud;
    struct broker *b = ls->g->b;
    uint8_t id[16];
    char inst[37], done[200];
    uint64_t seq = 0;
    int64_t listed_at = 0;

    uint64_t stored = broker__admit_stored_seq(b, ref->command_id);
    if (!stored || stored > ls->passed_seq)
        return 0; /* not this broker's, not stored, or not passed yet */
    if (ks_uuid_bin(ref->command_id, id) != 0 ||
        broker__agent_lists(b, ref->agent_id, id, inst, &seq,
                            &listed_at) != 0 ||
        listed_at < ls->listed_after_us)
        return 0; /* listed, or no heartbeat that can tell yet */
    double waited = (double)(ks_now_us() - ref->dispatched_at_us) / 1e6;
    int held = evt_stream_holds(b->nc, EVT_STREAM_CMDS, stored, GUARD_ASK_MS);
    if (held == 0) {
        char why[200];
        snprintf(why, sizeof(why),
                 "it passed command %s (stream sequence %llu, %.1f s ago) "
                 "and its agent with %u of %u slots taken never took it "
                 "(a delivery lost)",
                 ref->command_id, (unsigned long long)stored, waited,
                 ls->x->co.running, ls->x->co.max_concurrent);
        ks_metric_inc(KS_C_LOST_DELIVERIES);
        remake(ls->g, ls->c, ls->x, why);
        ls->remade = true;
        return 1;
    }
    if (held != KS_ENOTFOUND)
        return 0; /* cannot tell now: the next look */
    int rc = broker__redispatch(
        b, ls->g->st, ref,
        "delivered by its consumer but never taken by its agent, which "
        "had free slots (a delivery lost): re-published");
    if (rc)
        return 0; /* claimed or ended meanwhile, or the scanner's now */
    ks_metric_inc(KS_C_LOST_DELIVERIES);
    ls->sent++;
    ks_log(KS_LOG_WARN,
           "a command's delivery was lost: its consumer delivered it, its "
           "agent with free slots never took it; published again as a new "
           "attempt",
           KS_S("module", "guard"), KS_S("consumer", ls->c->durable),
           KS_S("agent", ref->agent_id), KS_S("command_id", ref->command_id),
           KS_I("attempt", ref->attempt + 1), KS_D("waited_s", waited),
           KS_I("unacked", ls->cs->ack_pending),
           KS_I("agent_running", ls->x->co.running),
           KS_I("agent_slots", ls->x->co.max_concurrent),
           KS_I("heartbeat_seq", seq));
    snprintf(done, sizeof(done),
             "published command %s again: delivered, never taken (%.1f s)",
             ref->command_id, waited);
    note_repair(ls->g, ls->c, done, ks_now_us(), false);
    return ls->sent >= GUARD_LOST_MAX;
}

/*
 * The commands of suspect x whose delivery was lost (the header says
 * when), published again: c's previous look (passed_seq, passed_us) had
 * its consumer past their messages. Only while the consumer (its state
 * cs, just asked) is the one of that look (not made again since: a new
 * consumer delivers everything again), has someone to deliver to, and the
 * agent was heard recently with a free slot: otherwise a command waits
 * for a slot, for the consumer, or for its agent, and the rules above or
 * the scanner's deadline see to it. Each broker judges the commands it
 * published (it knows their messages' sequences), whoever owns the
 * consumer; a re-publish is fenced by the version read (one lands).
 */
static void
lost_deliveries(struct broker__guard *g, struct guarded *c,
                const struct suspect *x, const struct evt_consumer_state *cs)
{
    int64_t now = ks_mono_us();
    if (!c->passed_seq || c->passed_created_ns != cs->created_ns ||
        !cs->push_bound || x->co.running >= x->co.max_concurrent ||
        now - x->co.heard_us > GUARD_HEARD_US)
        return;
    int64_t passed_at = ks_now_us() - (now - c->passed_us);
    struct lost_scan ls = {g, c, x, cs, c->passed_seq,
                           passed_at + GUARD_LIST_US, 0, false};
    for (size_t i = 0; i < x->n_ids && ls.sent < GUARD_LOST_MAX && !ls.remade;
         i++)
        if (store_scan_dispatched(g->st, x->ids[i], passed_at,
                                  GUARD_LOST_MAX, on_lost, &ls) < 0)
            return;
}

/* Looks at one suspect, and repairs it when it is stalled. */
static void
look(struct broker__guard *g, const struct suspect *x)
{
    struct guarded *c = guarded_get(g, x->co.ac.durable);
    struct evt_consumer_state cs;
    enum stall_kind kind;
    char why[200];
    int64_t now = ks_mono_us();
    int rc;

    if (!c)
        return;
    c->suspect = true;
    if (now - c->looked_us < GUARD_LOOK_EVERY_US)
        return;
    c->looked_us = now;
    rc = evt_consumer_state(g->b->nc, EVT_STREAM_CMDS, c->durable,
                            GUARD_ASK_MS, &cs);
    if (rc == 0) {
        lost_deliveries(g, c, x, &cs);
        if (!c->passed_seq || c->passed_created_ns != cs.created_ns ||
            now - c->passed_us >= GUARD_PASSED_KEEP_US) {
            c->passed_seq = cs.delivered_stream_seq;
            c->passed_us = now;
            c->passed_created_ns = cs.created_ns;
        }
    } else {
        c->passed_seq = 0;
    }
    if (rc == 0 && c->seen && cs.created_ns == c->created_ns &&
        cs.delivered == c->delivered) {
        kind = classify(g, x, &cs, why, sizeof(why));
        /* nobody there to deliver to: no stall of the consumer's */
        if (!cs.push_bound && now - x->co.heard_us > GUARD_HEARD_US)
            kind = STALL_NONE;
    } else if (rc == 0) {
        /* Delivering (or new): the count starts again. */
        c->seen = true;
        c->created_ns = cs.created_ns;
        c->delivered = cs.delivered;
        kind = STALL_NONE;
    } else if (rc == KS_ENOTFOUND) {
        kind = STALL_GONE;
        snprintf(why, sizeof(why), "it is gone");
    } else {
        kind = STALL_NO_LEADER;
        snprintf(why, sizeof(why), "no leader answers for it (%s)",
                 ks_strerror(rc));
    }
    if (kind == STALL_NONE) {
        c->quiet_since_us = now;
        show_stall(g, c, NULL);
        return;
    }
    if ((int)kind != c->kind) {
        /* Judged over a whole window of the same trouble (a consumer
         * looks gone or leaderless for a moment after a node restarts). */
        c->kind = kind;
        if (kind == STALL_GONE || kind == STALL_NO_LEADER)
            c->quiet_since_us = now;
    }
    size_t l = strlen(why);
    snprintf(why + l, sizeof(why) - l, "; nothing delivered for %.1f s",
             (double)(now - c->quiet_since_us) / 1e6);
    show_stall(g, c, why);
    /* One broker repairs (broker__guard_owner); another only when the
     * trouble outlasts the owner's turn by GUARD_BACKUP_US. */
    int64_t wait = (kind == STALL_NO_LEADER ? GUARD_NO_LEADER_US
                                            : GUARD_STALL_US) +
                   (broker__guard_owner(g->b, c->durable) ? 0
                                                          : GUARD_BACKUP_US);
    if (now - c->quiet_since_us < wait || !still_as_judged(g, c))
        return;
    if (kind == STALL_UNDELIVERED && !c->stepped_down_us)
        step_down(g, c, x, why);
    else
        remake(g, c, x, why);
}

static void
forget_one(const char *key, void *val, void *ud)
{
    struct guarded *c = val;
    (void)key;
    (void)ud;
    if (!c->suspect) {
        /* Nothing waits for it now: what it went through stays shown
         * (repairs); its count starts again when it is a suspect again. */
        c->seen = false;
        c->stepped_down_us = 0;
        c->passed_seq = 0;
        c->kind = 0;
        c->stall[0] = '\0';
        c->stalled_since_us = 0;
    }
    c->suspect = false;
}

static void *
guard_main(void *arg)
{
    struct broker__guard *g = arg;
    struct broker *b = g->b;
    struct suspects *s = calloc(1, sizeof(*s));

    if (!s)
        return NULL;
    s->b = b;
    while (!b->stopping) {
        for (int64_t t = 0; t < GUARD_TICK_US && !b->stopping;
             t += 100 * 1000)
            nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
        if (b->stopping)
            break;
        if (natsConnection_Status(b->nc->nc) != NATS_CONN_STATUS_CONNECTED)
            continue;
        s->n = 0;
        ks_map_clear(&s->pools);
        if (store_scan_waiting(g->st, ks_now_us() - GUARD_WAITING_US,
                               4 * GUARD_SUSPECTS_MAX, on_waiting, s) < 0)
            continue;
        for (size_t i = 0; i < s->n && !b->stopping; i++)
            look(g, &s->v[i]);
        pthread_mutex_lock(&g->mu);
        ks_map_each(&g->consumers, forget_one, NULL);
        pthread_mutex_unlock(&g->mu);
    }
    ks_map_clear(&s->pools);
    free(s);
    return NULL;
}

int
broker__guard_start(struct broker *b, char **errmsg)
{
    struct broker__guard *g = calloc(1, sizeof(*g));
    char *why = NULL;
    int rc;

    if (!g)
        return -ENOMEM;
    g->b = b;
    pthread_mutex_init(&g->mu, NULL);
    if ((rc = store_open(b->opts->db_conninfo, &g->st, &why))) {
        if (errmsg && asprintf(errmsg, "cannot connect to PostgreSQL: %s",
                               why ? why : ks_strerror(rc)) < 0)
            *errmsg = NULL;
        free(why);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return rc;
    }
    b->guard = g;
    char subject[64];
    snprintf(subject, sizeof(subject), "%s*", BROKER_NOTICE_GUARD);
    natsStatus s = natsConnection_Subscribe(&g->sub, b->nc->nc, subject,
                                            on_repair_notice, g);
    if (s != NATS_OK) {
        if (errmsg && asprintf(errmsg, "subscribe %s: %s", subject,
                               natsStatus_GetText(s)) < 0)
            *errmsg = NULL;
        return KS_ENATS;
    }
    if (pthread_create(&g->thread, NULL, guard_main, g) != 0)
        return KS_EINTERNAL;
    g->started = true;
    return 0;
}

static void
free_guarded(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
broker__guard_stop(struct broker *b)
{
    struct broker__guard *g = b->guard;
    if (!g)
        return;
    b->stopping = 1;
    if (g->sub) {
        /* no notice handler runs once the map is freed */
        natsSubscription_Drain(g->sub);
        natsSubscription_WaitForDrainCompletion(g->sub, 5000);
        natsSubscription_Destroy(g->sub);
    }
    if (g->started)
        pthread_join(g->thread, NULL);
    store_close(g->st);
    ks_map_each(&g->consumers, free_guarded, NULL);
    ks_map_clear(&g->consumers);
    pthread_mutex_destroy(&g->mu);
    free(g);
    b->guard = NULL;
}

void
broker__guard_view(struct broker *b, const char *durable, Ks__AgentStatus *st)
{
    struct broker__guard *g = b->guard;
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    const struct guarded *c = ks_map_get(&g->consumers, durable);
    if (c && (c->stall[0] || c->repairs)) {
        char *name = strdup(durable), *stall = strdup(c->stall),
             *last = strdup(c->last_repair);
        if (name && stall && last) {
            /* broker__agents_reply_free frees them */
            st->consumer = name;
            st->consumer_stall = stall;
            st->consumer_stalled_since_us = c->stalled_since_us;
            st->consumer_repairs = c->repairs;
            st->consumer_last_repair = last;
            st->consumer_repaired_at_us = c->repaired_at_us;
        } else {
            free(name);
            free(stall);
            free(last);
        }
    }
    pthread_mutex_unlock(&g->mu);
}
