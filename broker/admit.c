/*
 * Admission: what this broker holds in flight, and whether a new command
 * can start within its delivery deadline (issue 23: overload is refused,
 * not queued for minutes). docs/operating.md "Overload" is the operator's
 * account.
 *
 * Three queues stand between an ExecuteCommand and its start; each one's
 * wait is its length times its measured service time over its servers
 * (Little's law, W = L / throughput):
 *
 *   intake   requests received on kscore.api.v1.execute, not yet taken by
 *            an exec worker, that the workers take before this one: they
 *            serve each operator in turn (fairq.c), so its operator's own
 *            backlog counts whole and another's only as far as round
 *            robin puts it ahead (one request more than its own); their
 *            count x the workers' mean time per request
 *            / BROKER_EXEC_WORKERS. One operator's flood of execs is then
 *            refused busy on its own backlog while the others' execs get
 *            in (issue 21: one FIFO let it take the whole intake);
 *   claims   agents' claims the claim workers answer before the target
 *            agent's (each claimer in its turn: fairq.c): their count x
 *            the claim handler's mean time / BROKER_CLAIM_WORKERS;
 *   agent    commands this broker dispatched to the agent's process (its
 *            pool, or its process's ids: one set of slots) and has not
 *            seen end: beyond its slots (AgentInfo.max_concurrent), each
 *            waits for a slot, which is held for the measured claim-to-end
 *            time: (ahead + 1 - slots) x hold / slots. Ahead is never
 *            more than what the process has not claimed and the slots it
 *            says it has taken (q_ahead: its heartbeats), so an end that
 *            has not reached this broker is not a slot taken; a stall's
 *            backlog (publishes the publisher held) is not counted until
 *            the agent takes it up; without a recent heartbeat, claims
 *            from before the last stall that may have hidden ends are not
 *            counted.
 *
 * A request is refused at once, before anything is recorded, with
 * KS_EBUSY and a line that names the limit and the figures, when
 *   intake + claims > min(its wait, BROKER_QUEUE_MAX_MS): kscore's own
 *     queues; a standing queue there helps nobody and delays everyone
 *     (DESIGN "Capacity": overload is an input), so it stays short
 *     whatever the deadline;
 *   intake + claims + agent > its wait: the command could not start in
 *     time.
 * Its wait is its delivery deadline when the caller gave one
 * (--deliver-within: waiting that long for a busy agent is the caller's
 * choice; later it would end Undeliverable), else BROKER_QUEUE_MAX_MS: a
 * queue kscore builds unasked is a queue that only grows under overload
 * (at twice the capacity it held 30 s of work before this rule, perf
 * overload; the default deadline is for an agent that is away, not busy).
 * The refusal is cheap: the intake (the subscription's own thread) reads
 * four fields of the request from its wire bytes (no unpack, no
 * PostgreSQL) and answers. A request whose idempotency key may name a
 * command already (key_may_exist: an ask again, or the caller's own key)
 * is never refused there: the exec worker looks the key up first (the
 * command it names is attached to), and refuses only a key that names
 * nothing (broker.c on_execute).
 *
 * Nothing accepted is dropped: the intake queue is served to its end,
 * also when the broker stops; every command dispatched is counted until
 * its end is recorded (here or, through notice.c, by another broker), or
 * until long after its deadline (its entry expires: the scanner ends it).
 *
 * Batches pace their targets with the same figures (batch.c): a target is
 * dispatched only while its agent's queue holds less than two rounds of
 * its slots and its wait is within half the delivery deadline, so the
 * deadline runs from a dispatch the agent can take up soon.
 *
 * Threads: every function here may be called from any thread; one mutex
 * guards the figures (never held while calling out, except the registry's
 * b->mu is taken before it, never after).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* Slots assumed for an agent whose heartbeat does not say (older). */
#define ADMIT_SLOTS_UNKNOWN 8
/* Entries kept at most (a bound on memory; past it new ones are not
 * counted, which only makes admission more lenient). */
#define ADMIT_MAX 1000000
/* An entry nobody ended is forgotten this long after its last deadline
 * (the scanner ends such a command; us). */
#define ADMIT_EXPIRE_SLACK_US INT64_C(60000000)
/* Without a command timeout, an entry is forgotten after this (us). */
#define ADMIT_EXPIRE_MAX_US (INT64_C(24) * 3600 * 1000000)
/* Queues kept before idle ones are forgotten, and how many at a time. */
#define ADMIT_QUEUES_MAX 65536
#define ADMIT_IDLE_SWEEP 1024
/* A command's publish without its PubAck for this long waits for the
 * stream (us): under BROKER_QUEUE_MAX_MS, so that the requests queued
 * behind it are the stall's before their age refuses anyone. */
#define ADMIT_PUBACK_SLOW_US INT64_C(150000)
/* Weight of a new sample in the running means. */
#define ADMIT_EWMA 0.2
/* A stage whose workers took nothing for ADMIT_STALLED_MEANS of its mean
 * service times (all of them serve for longer than they do) is stalled,
 * not busy; and after ADMIT_STALLED_MAX_US it is whatever the mean (us). */
#define ADMIT_STALLED_MEANS 2.0
#define ADMIT_STALLED_MAX_US 1000000.0
/* An agent's word on what it runs (its heartbeat's running counts) is
 * taken while this recent: two heartbeats and a second (us). */
#define ADMIT_AGENT_WORD_US (2 * (int64_t)EVT_HEARTBEAT_MS * 1000 + 1000000)

/* One id's last word in its queue (admit_q.ids): the commands its last
 * heartbeat said it ran, that heartbeat's heartbeat_seq (0: none, or an
 * agent that does not number them), and the claims granted here to it
 * that only a later heartbeat counts: later[i] those listed from seq + 1
 * + i (ClaimRequest.listed_from_seq; the last one also all beyond). A
 * claim is counted by the heartbeats from the one that lists it on,
 * whenever the broker answered it: a claim answered late (its handler
 * held up by a lock) is not counted twice, in the heartbeat that says it
 * ended and again as one since. */
#define ADMIT_LATER 4
struct admit_id {
    uint32_t running;
    uint64_t seq;
    uint32_t later[ADMIT_LATER];
};

/* What d says its id runs or will by the heartbeats to come. */
static uint64_t
id_word(const struct admit_id *d)
{
    uint64_t w = d->running;
    for (int i = 0; i < ADMIT_LATER; i++)
        w += d->later[i];
    return w;
}

/* One agent process's queue (its pool, or its process's ids). */
struct admit_q {
    unsigned inflight; /* dispatched here, not seen ended */
    unsigned claimed;  /* of inflight, those seen claimed here */
    /* Of inflight not claimed here, those a stall held: their publish
     * went to the publisher (broker__admit_held), and the stall sends
     * them at once when it ends. Like the intake's, that backlog is not
     * counted against the agent's slots until the agent takes it up
     * (then its word counts it). */
    unsigned unclaimed_held;
    /* Of claimed, those claimed in the generation since the last stall
     * that may have hidden ends (broker__admit.gen; q_sync): counted when
     * the agent's word is not at hand; one claimed before may have ended
     * unseen. */
    unsigned claimed_now;
    uint64_t gen; /* the broker__admit.gen claimed_now counts in */
    /* What the agent process says it runs (broker__admit_agent_running):
     * each id's last heartbeat's count and the claims granted here to it
     * since (agent id -> struct admit_id *), their sum, and when one was
     * last heard (ks_mono_us; 0: never). The slots it has free, whatever
     * this broker has not seen end. */
    struct ks_map ids;
    uint64_t word;
    int64_t word_us;
    unsigned slots;    /* AgentInfo.max_concurrent, last seen */
    double hold_us;    /* mean claim-to-end time of its commands, 0: none */
    char key[EVT_AGENT_ID_MAX + 48];
};

/* One command this broker dispatched (exec or batch target), or one
 * the record had open at the broker's start (no queue: q NULL). */
struct admit_cmd {
    struct admit_cmd *prev, *next; /* in dispatch order */
    struct admit_q *q;
    int64_t claimed_mono_us; /* 0: not seen claimed */
    uint64_t claim_gen;      /* broker__admit.gen when claimed */
    bool held;               /* a stall held its publish (in unclaimed_held
                                while not claimed) */
    bool claim_counted;      /* in q->claimed */
    uint64_t stored_seq;     /* its message's stream sequence (PubAck);
                                0: none seen */
    int64_t expires_mono_us;
    uint64_t bytes; /* counted in its operator's share (struct admit_op) */
    bool loaded;    /* from the record at the start (broker__admit_load) */
    char id[37];
    char op[EVT_IDENTITY_MAX + 1];
};

/* An operator's commands not ended: the bytes they hold
 * (broker__cmd_bytes each). */
struct admit_op {
    uint64_t bytes;
};

struct broker__admit {
    pthread_mutex_t mu;
    struct ks_map cmds;   /* command id -> struct admit_cmd * */
    struct ks_map queues; /* queue key -> struct admit_q * */
    struct ks_map ops;    /* operator -> struct admit_op * */
    size_t nloaded;       /* entries with loaded set */
    struct admit_cmd *head, *tail;
    size_t n;
    double exec_us, claim_us; /* mean handler times, 0: none yet */
    int64_t claim_done_mono_us; /* the last claim answered */
    /* The intake: requests (natsMsg *) queued per operator, served in
     * turn by the exec workers (b->executors) with `handler` (fairq.c);
     * NULL once stopped. */
    struct broker__fairq *intake;
    natsMsgHandler handler;
    /* When a JetStream stall was last seen going on or over
     * (stall_note): the requests queued then are marked in the intake as
     * the stall's. */
    int64_t stall_noted_us;
    /* A generation of the agents' queues, one more each time stall_note
     * sees ends that may not have reached this broker as they happened
     * (a JetStream stall, the recorder's pull or append failing, a
     * pause), and when (gen_us, ks_mono_us): a command claimed before
     * may have ended unseen (q->claimed_now), and a hold measured
     * across it is the stall's. */
    uint64_t gen;
    int64_t gen_us;
    int64_t busy_logged_us, share_logged_us;
};

static int64_t
max64(int64_t x, int64_t y)
{
    return x > y ? x : y;
}

static double
ewma(double mean, double x)
{
    return mean > 0 ? mean + ADMIT_EWMA * (x - mean) : x;
}

/*
 * Since when this process has run without a pause (SIGSTOP, a frozen VM,
 * starved: the pause watch, scanner.c), ks_mono_us; now while a pause is
 * going on or just ended unseen. A time measured across a pause is the
 * pause's, not this broker's pace or queue: it stays out of the means and
 * the ages. A broker stopped for 30 s while one exec and one claim
 * handler ran put 30 s in each mean (6 s at ADMIT_EWMA), and the time
 * since it last answered a claim was 30 s when it was continued: it then
 * refused as busy the execs that found a request or a few claims queued
 * ahead ("about 753 ms", "about 3006 ms", "about 30043 ms" for queues of
 * milliseconds; test_record a_hung_broker_of_two_delays_nothing). The
 * tick is read first: the watch stores the pause before its next tick,
 * so a fresh tick comes with the pause seen, and an old one is a pause
 * the watch has not seen yet.
 */
static int64_t
running_since(struct broker *b, int64_t now)
{
    int64_t tick = atomic_load(&b->tick_mono_us);
    if (tick && now - tick > BROKER_PAUSE_US)
        return now;
    return atomic_load(&b->paused_mono_us);
}

/*
 * The last time (ks_mono_us; 0: never) the results' way to this broker
 * was seen failing: the recorder's pull failed (no connection, its
 * consumer electing a leader) or its append did (recorder.c); now while
 * PostgreSQL refuses it. Ends that happened then reach this broker only
 * after it: its in-flight counts and hold times are the stall's, not the
 * agents' (test_cluster F02: a recorder consumer led by the killed node
 * held the ends of 90 commands an agent had run, and its execs were
 * refused as busy on 64 slots). A recorder that is only slow (a lock, a
 * saturated machine) fails nothing: what the agents say they run bounds
 * the count then (broker__admit_agent_running), never a guess from the
 * recorder's pace, which would excuse a real overload.
 */
static int64_t
results_stall_us(struct broker *b, int64_t now)
{
    if (atomic_load(&b->rec_stalled))
        return now;
    return atomic_load(&b->rec_trouble_us);
}

/* Whether a time measured from since_us to now spans a pause. */
static bool
paused_since(struct broker *b, int64_t since_us, int64_t now)
{
    return running_since(b, now) >= since_us;
}

/* ---- entries ------------------------------------------------------------- */

/* q's claimed_now from the last stall on (under mu): a stall since it
 * was last looked at makes every claim before it an old one. */
static void
q_sync(struct broker__admit *a, struct admit_q *q)
{
    if (q->gen != a->gen) {
        q->claimed_now = 0;
        q->gen = a->gen;
    }
}

/* c, claimed, counts as claimed in its q (under mu). */
static void
q_count_claim(struct broker__admit *a, struct admit_cmd *c)
{
    struct admit_q *q = c->q;
    q->claimed++;
    if (c->held && q->unclaimed_held)
        q->unclaimed_held--;
    q_sync(a, q);
    q->claimed_now++;
    c->claim_gen = a->gen;
    c->claim_counted = true;
}

/* c joins q (under mu). */
static void
q_join(struct broker__admit *a, struct admit_cmd *c, struct admit_q *q)
{
    c->q = q;
    q->inflight++;
    if (c->held)
        q->unclaimed_held++;
    if (c->claimed_mono_us) /* its claim came first */
        q_count_claim(a, c);
}

/* c leaves its q (under mu). */
static void
q_leave(struct broker__admit *a, struct admit_cmd *c)
{
    struct admit_q *q = c->q;
    if (!q)
        return;
    if (q->inflight)
        q->inflight--;
    q_sync(a, q);
    if (c->claim_counted) {
        if (q->claimed)
            q->claimed--;
        if (c->claim_gen == q->gen && q->claimed_now)
            q->claimed_now--;
    } else if (c->held && q->unclaimed_held) {
        q->unclaimed_held--;
    }
    c->claim_counted = false;
    c->q = NULL;
}

static void
unlink_cmd(struct broker__admit *a, struct admit_cmd *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        a->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        a->tail = c->prev;
    ks_map_del(&a->cmds, c->id);
    a->n--;
    if (c->loaded)
        a->nloaded--;
    q_leave(a, c);
    if (c->bytes) {
        struct admit_op *o = ks_map_get(&a->ops, c->op);
        if (o && o->bytes > c->bytes) {
            o->bytes -= c->bytes;
        } else if (o) {
            ks_map_del(&a->ops, c->op);
            free(o);
        }
    }
    free(c);
}

/* Adds command_id's entry at the tail (under mu): queue q (NULL: none
 * yet), counted in op's share with bytes; expires at expires_mono_us.
 * NULL when it cannot be kept (ADMIT_MAX, memory), or is kept already. */
static struct admit_cmd *
add_cmd(struct broker__admit *a, const char *command_id, struct admit_q *q,
        const char *op, uint64_t bytes, int64_t expires_mono_us)
{
    struct admit_op *o = NULL;
    if (a->n >= ADMIT_MAX || ks_map_get(&a->cmds, command_id))
        return NULL;
    struct admit_cmd *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    snprintf(c->id, sizeof(c->id), "%s", command_id);
    snprintf(c->op, sizeof(c->op), "%s", op ? op : "");
    c->expires_mono_us = expires_mono_us;
    if (bytes && !(o = ks_map_get(&a->ops, c->op))) {
        if (!(o = calloc(1, sizeof(*o))) || ks_map_put(&a->ops, c->op, o)) {
            free(o);
            o = NULL;
        }
    }
    if (ks_map_put(&a->cmds, c->id, c) != 0) {
        if (o && o->bytes == 0) {
            ks_map_del(&a->ops, c->op);
            free(o);
        }
        free(c);
        return NULL;
    }
    if (o) {
        c->bytes = bytes;
        o->bytes += bytes;
    }
    if (q)
        q_join(a, c, q);
    c->prev = a->tail;
    if (a->tail)
        a->tail->next = c;
    else
        a->head = c;
    a->tail = c;
    a->n++;
    return c;
}

/* When an entry of a command whose last deadline is deadline_us (epoch)
 * and whose spec's timeout is timeout_ms (0: none) is forgotten: its last
 * attempt's deadline, then the longest it may run. */
static int64_t
expiry(int64_t now_mono, int64_t deadline_us, uint64_t timeout_ms)
{
    int64_t left = deadline_us - ks_now_us();
    int64_t window = left > 0 ? left : 0;
    return now_mono + window * BROKER_MAX_ATTEMPTS +
           (timeout_ms ? (int64_t)timeout_ms * 1000 + ADMIT_EXPIRE_SLACK_US
                       : ADMIT_EXPIRE_MAX_US);
}

/* Forgets entries past their expiry, oldest first (under mu). */
static void
expire(struct broker__admit *a, int64_t now)
{
    while (a->head && a->head->expires_mono_us <= now)
        unlink_cmd(a, a->head);
}

static void
collect_idle(const char *key, void *val, void *ud)
{
    struct admit_q *q = val, **idle = ud;
    (void)key;
    if (q->inflight == 0) {
        for (size_t i = 0; i < ADMIT_IDLE_SWEEP; i++)
            if (!idle[i]) {
                idle[i] = q;
                break;
            }
    }
}

static void
free_id(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

static void
q_free(struct admit_q *q)
{
    ks_map_each(&q->ids, free_id, NULL);
    ks_map_clear(&q->ids);
    free(q);
}

/* Forgets queues with nothing in flight when there are too many (agent
 * processes come and go: each start is a new process). Under mu. */
static void
sweep_queues(struct broker__admit *a)
{
    struct admit_q *idle[ADMIT_IDLE_SWEEP] = {0};
    if (a->queues.count < ADMIT_QUEUES_MAX)
        return;
    ks_map_each(&a->queues, collect_idle, idle);
    for (size_t i = 0; i < ADMIT_IDLE_SWEEP && idle[i]; i++) {
        ks_map_del(&a->queues, idle[i]->key);
        q_free(idle[i]);
    }
}

/* The queue named key, made when new, its slots set; NULL on ENOMEM.
 * Under mu. */
static struct admit_q *
queue_get(struct broker__admit *a, const char *key, unsigned slots)
{
    struct admit_q *q = ks_map_get(&a->queues, key);
    if (!q) {
        sweep_queues(a);
        q = calloc(1, sizeof(*q));
        if (!q || ks_map_put(&a->queues, key, q) != 0) {
            free(q);
            return NULL;
        }
        snprintf(q->key, sizeof(q->key), "%s", key);
    }
    q->slots = slots ? slots : ADMIT_SLOTS_UNKNOWN;
    return q;
}

/* The queue of agent_id (registry: its pool, else its process). Takes
 * b->mu, then a->mu: returns with a->mu held, NULL or not. */
static struct admit_q *
queue_of(struct broker *b, const char *agent_id)
{
    struct broker__admit *a = b->admit;
    char key[EVT_AGENT_ID_MAX + 48];
    unsigned slots = 0;

    broker__agent_queue(b, agent_id, key, sizeof(key), &slots);
    pthread_mutex_lock(&a->mu);
    return queue_get(a, key, slots);
}

void
broker__admit_dispatched(struct broker *b, const char *command_id,
                         const char *operator_name, const char *agent_id,
                         int64_t not_after_us, uint64_t timeout_ms,
                         uint64_t bytes)
{
    struct broker__admit *a = b->admit;
    int64_t now = ks_mono_us();
    if (!a)
        return;
    struct admit_q *q = queue_of(b, agent_id);
    struct admit_cmd *c = ks_map_get(&a->cmds, command_id);
    if (c && !c->q && q) {
        /* Taken (broker__admit_take): now in its agent's queue. */
        q_join(a, c, q);
        c->expires_mono_us = expiry(now, not_after_us, timeout_ms);
    } else if (q && !c) {
        add_cmd(a, command_id, q, operator_name, bytes,
                expiry(now, not_after_us, timeout_ms));
    }
    pthread_mutex_unlock(&a->mu);
}

/* Each operator's share (BROKER_CMDS_OPERATOR_BYTES unless the broker's
 * options say). */
static uint64_t
share_of(struct broker *b)
{
    return b->opts->cmds_operator_bytes ? b->opts->cmds_operator_bytes
                                        : BROKER_CMDS_OPERATOR_BYTES;
}

#define MIB(n) ((double)(n) / (1024.0 * 1024.0))

int
broker__admit_take(struct broker *b, const char *command_id,
                   const char *operator_name, uint64_t bytes,
                   int64_t not_after_us, char *why, size_t len)
{
    struct broker__admit *a = b->admit;
    uint64_t share = share_of(b), held = 0;
    int64_t now = ks_mono_us();
    int rc = 0;
    bool log = false;

    if (!a)
        return 0;
    pthread_mutex_lock(&a->mu);
    expire(a, now);
    struct admit_op *o = ks_map_get(&a->ops, operator_name);
    held = o ? o->bytes : 0;
    if (held + bytes > share) {
        rc = KS_EBUSY;
        log = now - a->share_logged_us > 10000000;
        if (log)
            a->share_logged_us = now;
    } else {
        /* Its deadline and timeout are set when it is dispatched; until
         * then, its deadline and the longest any command may run. */
        add_cmd(a, command_id, NULL, operator_name, bytes,
                expiry(now, not_after_us, 0));
    }
    pthread_mutex_unlock(&a->mu);
    if (!rc)
        return 0;
    snprintf(why, len,
             "operator '%s' has %.1f MiB of commands that have not ended "
             "(their requests, as they wait in the commands stream), and "
             "this one of %.2f MiB would pass its share of %.1f MiB "
             "(cmds_operator_mib in the broker's config); nothing was "
             "recorded, try again when some of them have ended",
             operator_name, MIB(held), MIB(bytes), MIB(share));
    ks_metric_inc(KS_C_REFUSED_BUSY);
    if (log)
        ks_log(KS_LOG_WARN,
               "refusing an operator's commands: past its share of the "
               "commands stream (logged once per 10 s)",
               KS_S("operator", operator_name),
               KS_I("held_bytes", (int64_t)held),
               KS_I("request_bytes", (int64_t)bytes),
               KS_I("share_bytes", (int64_t)share));
    return rc;
}

uint64_t
broker__cmd_bytes(const Ks__Command *cmd)
{
    return protobuf_c_message_get_packed_size(&cmd->base) +
           BROKER_CMD_MSG_OVERHEAD;
}

static int
load_one(const struct store_open_request *r, void *ud)
{
    struct broker__admit *a = ud;
    int64_t now = ks_mono_us();
    pthread_mutex_lock(&a->mu);
    struct admit_cmd *c =
        add_cmd(a, r->command_id, NULL, r->operator_name,
                r->request_bytes + BROKER_CMD_MSG_OVERHEAD,
                expiry(now, r->deliver_by_us ? r->deliver_by_us : ks_now_us(),
                       0));
    if (c) {
        c->loaded = true;
        a->nloaded++;
    }
    pthread_mutex_unlock(&a->mu);
    return 0;
}

static int
sweep_one(const struct store_command_row *row, void *ud)
{
    broker__admit_ended(ud, row->command_id);
    return 0;
}

void
broker__admit_sweep(struct broker *b, struct store *st)
{
    struct broker__admit *a = b->admit;
    enum { CHUNK = 500 };
    char(*ids)[37] = NULL;
    size_t n = 0;

    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    if (a->nloaded && (ids = malloc(a->nloaded * sizeof(*ids))))
        for (struct admit_cmd *c = a->head; c && n < a->nloaded; c = c->next)
            if (c->loaded)
                memcpy(ids[n++], c->id, 37);
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < n; i += CHUNK) {
        const char *chunk[CHUNK];
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        for (size_t j = 0; j < k; j++)
            chunk[j] = ids[i + j];
        if (store_command_states(st, chunk, k, 1, sweep_one, b) != 0)
            break;
    }
    free(ids);
}

int
broker__admit_load(struct broker *b, struct store *st)
{
    if (!b->admit)
        return 0;
    return store_open_requests(st, load_one, b->admit);
}

/* agent_id's word in q, made when new; NULL on ENOMEM (under mu). */
static struct admit_id *
q_id(struct admit_q *q, const char *agent_id)
{
    struct admit_id *d = ks_map_get(&q->ids, agent_id);
    if (!d && (d = calloc(1, sizeof(*d))) &&
        ks_map_put(&q->ids, agent_id, d) != 0) {
        free(d);
        d = NULL;
    }
    return d;
}

/* One more claim granted here to agent_id in q, listed by its
 * heartbeats from listed_seq on (0: not said), under mu: it runs one more
 * than its last heartbeat said, unless that heartbeat counted it (an id
 * of q not heard yet: one more than nothing). */
static void
q_claimed(struct admit_q *q, const char *agent_id, uint64_t listed_seq)
{
    struct admit_id *d = agent_id ? q_id(q, agent_id) : NULL;
    if (!d)
        return;
    uint64_t i = 0;
    if (d->seq && listed_seq) {
        if (listed_seq <= d->seq)
            return; /* in the last heartbeat's count already */
        i = listed_seq - d->seq - 1;
        if (i >= ADMIT_LATER)
            i = ADMIT_LATER - 1;
    }
    d->later[i]++;
    q->word++;
}

void
broker__admit_agent_running(struct broker *b, const char *key,
                            const char *agent_id, unsigned slots,
                            uint32_t running, uint64_t heartbeat_seq,
                            int64_t heard_mono_us)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    struct admit_q *q = queue_get(a, key, slots);
    if (q) {
        struct admit_id *d = q_id(q, agent_id);
        /* The same heartbeat again (a new registry watch replays the
         * latest entry of each id): nothing new, and the claims since
         * still count. */
        if (d && heartbeat_seq && heartbeat_seq == d->seq)
            d = NULL;
        if (d) {
            q->word -= id_word(d);
            /* The claims this heartbeat counts leave later[]; a process
             * that numbers from 1 again (restarted), or none, starts
             * afresh. */
            uint64_t shift = heartbeat_seq > d->seq && d->seq
                                 ? heartbeat_seq - d->seq
                                 : ADMIT_LATER;
            for (int i = 0; i < ADMIT_LATER; i++)
                d->later[i] = (uint64_t)i + shift < ADMIT_LATER
                                  ? d->later[i + shift]
                                  : 0;
            d->running = running;
            d->seq = heartbeat_seq;
            q->word += id_word(d);
            /* as of when it was put, not when it came */
            if (heard_mono_us > q->word_us)
                q->word_us = heard_mono_us;
        }
    }
    pthread_mutex_unlock(&a->mu);
}

void
broker__admit_claim_done(struct broker *b, const char *command_id,
                         const char *agent_id, uint64_t listed_seq,
                         bool granted, int64_t handler_us)
{
    struct broker__admit *a = b->admit;
    int64_t now = ks_mono_us();
    if (!a)
        return;
    bool paused = paused_since(b, now - handler_us, now);
    pthread_mutex_lock(&a->mu);
    if (!paused)
        a->claim_us = ewma(a->claim_us, (double)handler_us);
    a->claim_done_mono_us = now;
    struct admit_cmd *c =
        granted && command_id ? ks_map_get(&a->cmds, command_id) : NULL;
    if (c && !c->claimed_mono_us) {
        c->claimed_mono_us = now;
        if (c->q) {
            q_count_claim(a, c);
            q_claimed(c->q, agent_id, listed_seq);
        }
    }
    pthread_mutex_unlock(&a->mu);
}

void
broker__admit_stored(struct broker *b, const char *command_id, uint64_t seq)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    struct admit_cmd *c = ks_map_get(&a->cmds, command_id);
    if (c)
        c->stored_seq = seq;
    pthread_mutex_unlock(&a->mu);
}

uint64_t
broker__admit_stored_seq(struct broker *b, const char *command_id)
{
    struct broker__admit *a = b->admit;
    uint64_t seq = 0;
    if (!a)
        return 0;
    pthread_mutex_lock(&a->mu);
    struct admit_cmd *c = ks_map_get(&a->cmds, command_id);
    if (c)
        seq = c->stored_seq;
    pthread_mutex_unlock(&a->mu);
    return seq;
}

void
broker__admit_ended(struct broker *b, const char *command_id)
{
    struct broker__admit *a = b->admit;
    int64_t now = ks_mono_us();
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    struct admit_cmd *c = ks_map_get(&a->cmds, command_id);
    if (c) {
        /* A hold measured across a stall is the stall's: the end came
         * late, not the slot. (paused_since, evt_js_stall and
         * results_stall_us read atomics only: no lock taken under mu.) */
        int retrying = 0;
        int64_t stall = evt_js_stall(b->nc, &retrying, NULL);
        if (retrying > 0)
            stall = now;
        stall = max64(max64(stall, a->gen_us), results_stall_us(b, now));
        if (c->claimed_mono_us && c->q && c->claimed_mono_us > stall &&
            !paused_since(b, c->claimed_mono_us, now))
            c->q->hold_us =
                ewma(c->q->hold_us, (double)(now - c->claimed_mono_us));
        unlink_cmd(a, c);
    }
    pthread_mutex_unlock(&a->mu);
}

/* ---- the waits ----------------------------------------------------------- */

/* Claims the claim workers answer before one of agent_id's (NULL: of an
 * agent with none waiting): they serve each claimer in turn (fairq.c),
 * so a claimer's own backlog counts whole and another's only as far as
 * round robin puts it ahead. A flood of one agent's claims is no wait
 * for another's. */
static int64_t
claims_pending(struct broker *b, const char *agent_id)
{
    char who[16 + EVT_AGENT_ID_MAX] = "";
    if (agent_id)
        snprintf(who, sizeof(who), "agent-%s", agent_id);
    return (int64_t)broker__fairq_ahead(b->fq[BROKER_FQ_CLAIM], who, NULL);
}

/*
 * Notes a JetStream stall on the broker's connection (evt_js_stall: the
 * commands' publishes tried again while KSCORE_CMDS elects a leader, by
 * the publisher, publisher.c, or a worker's one try). Every request in the intake while a stall goes
 * on, or when one has ended since the last note, waits for the stream,
 * not for kscore: the stall's, never counted as kscore's own queue (else
 * each election refused every command for its length and its drain:
 * 91 of 200 execs of test_cluster's F02 exited 69 or 75). So is every
 * request in it when this process runs again after a pause
 * (running_since): those that came while it did not run, read at once
 * when it is continued, are the pause's (a broker stopped 30 s refused
 * a new exec behind three of them, "about 260 ms", as they drained:
 * test_record a_hung_broker_of_two_delays_nothing). Under mu.
 */
static void
stall_note(struct broker *b, struct broker__admit *a, int64_t now)
{
    int retrying = 0;
    int64_t ended = evt_js_stall(b->nc, &retrying, NULL);
    /* Commands the stream did not take wait in the publisher. */
    if (retrying == 0 && broker__publisher_busy(b))
        retrying = 1;
    int64_t ran = running_since(b, now);
    /* Ends that may not have reached this broker as they happened: a
     * JetStream stall (a node that led the commands stream often led the
     * recorder's consumer too, whose pulls then just expire: test_cluster
     * F02), the recorder failing, a pause. Only claims are discounted by
     * it, and only while the agent's word is not at hand (q_ahead). */
    if (retrying > 0 || ended > a->gen_us || ran > a->gen_us ||
        results_stall_us(b, now) > a->gen_us) {
        a->gen++;
        a->gen_us = now;
    }
    /* A PubAck takes milliseconds; one that has not come for longer is a
     * stream that does not take the publish now (its leader dead: a
     * worker's one try waits up to BROKER_PUBLISH_INLINE_MS). */
    for (int i = 0; i < BROKER_EXEC_WORKERS && retrying == 0; i++) {
        int64_t since = atomic_load(&b->executors[i].publishing_us);
        if (since && now - since > ADMIT_PUBACK_SLOW_US)
            retrying = 1;
    }
    if (retrying > 0 || ended > a->stall_noted_us ||
        ran > a->stall_noted_us) {
        broker__fairq_mark(a->intake);
        a->stall_noted_us = now;
    }
}

/* What the intake's workers take before a new request of operator
 * (NULL: one with nothing queued) into *w. Under mu. */
static void
intake_ahead(struct broker__admit *a, const char *operator_name,
             struct broker__fairq_wait *w)
{
    broker__fairq_ahead(a->intake, operator_name, w);
}

/* kscore's own queues: the intake ahead of the request (w) and the
 * claims (us). Under mu. A stalled stage (PostgreSQL blocked, say)
 * finishes nothing, so its mean time says nothing new: the operator's
 * own oldest waiting request has waited at least its age, and a request
 * ahead that no worker took since it came at least the time since one
 * was taken (a flood's oldest requests wait long while the workers take
 * others: that is their operator's wait, not this one's); claims pending
 * beyond one per worker at least the time since one was last answered.
 * Requests a JetStream stall held (stall_note: marked) are not counted,
 * nor their wait; no age counts from before ran (running_since: the time
 * this process did not run is no queue of its own). */
static int64_t
own_wait_us(struct broker__admit *a, const struct broker__fairq_wait *w,
            int64_t claims, int64_t ran, int64_t now)
{
    size_t own = w->n - w->marked;
    double in = (double)own * a->exec_us / BROKER_EXEC_WORKERS;
    double cl = (double)claims * a->claim_us / BROKER_CLAIM_WORKERS;
    /* The ages, once none of the stall's is ahead (before that it waits
     * for the stall); a wait since the last of the stall's was taken is
     * the stall's. */
    if (own && !w->marked) {
        int64_t since = w->own_us ? max64(w->own_us, w->mark_taken_us) : 0;
        since = since ? max64(since, ran) : 0;
        if (since && (double)(now - since) > in)
            in = (double)(now - since);
        /* A gap between takes shorter than a stalled stage's is the
         * workers' pace (two cores saturated by a flood: each request
         * served in hundreds of ms, and no worker taking one for 295 ms
         * refused the next operator's one exec, though one request was
         * ahead of it: test_security an_operators_exec_flood_waits_its_
         * turn); the mean already says it. */
        double stalled = ADMIT_STALLED_MEANS * a->exec_us;
        if (stalled > ADMIT_STALLED_MAX_US)
            stalled = ADMIT_STALLED_MAX_US;
        since = max64(max64(w->oldest_us, ran),
                      max64(w->taken_us, w->mark_taken_us));
        if ((double)(now - since) > in && (double)(now - since) > stalled)
            in = (double)(now - since);
    }
    if (claims > BROKER_CLAIM_WORKERS && a->claim_done_mono_us) {
        int64_t since = max64(a->claim_done_mono_us, ran);
        if ((double)(now - since) > cl)
            cl = (double)(now - since);
    }
    return (int64_t)(in + cl);
}

/*
 * The commands ahead of a new one in q (under mu), as far as this broker
 * dispatched them: the slots the agent's process says it has taken (its
 * heartbeats, and the claims granted here they do not count yet), and
 * what it has not claimed yet, but for a stall's backlog (unclaimed_held).
 * A command whose end this broker has not seen may have ended long ago
 * (its end waits for the event stream or the recorder: an election, a
 * stream that refuses it, a lock). Without a recent word (the registry
 * away): what was claimed here since the last stall that may have hidden
 * ends.
 */
static unsigned
q_ahead(struct broker__admit *a, struct admit_q *q, int64_t now)
{
    unsigned unclaimed = q->inflight - q->claimed - q->unclaimed_held;
    q_sync(a, q);
    if (q->word_us && now - q->word_us <= ADMIT_AGENT_WORD_US) {
        uint64_t w = q->word + unclaimed;
        return w < q->inflight ? (unsigned)w : q->inflight;
    }
    return unclaimed + q->claimed_now;
}

void
broker__admit_held(struct broker *b, const char *command_id)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    struct admit_cmd *c = ks_map_get(&a->cmds, command_id);
    if (c && !c->held) {
        c->held = true;
        if (c->q && !c->claim_counted)
            c->q->unclaimed_held++;
    }
    pthread_mutex_unlock(&a->mu);
}

/* The wait for one of q's slots with n commands ahead (us). Under mu. */
static int64_t
agent_wait_us(const struct admit_q *q, unsigned n)
{
    if (n + 1 <= q->slots || q->hold_us <= 0)
        return 0;
    return (int64_t)((double)(n + 1 - q->slots) * q->hold_us / q->slots);
}

int
broker__admit_check(struct broker *b, const char *operator_name,
                    const char *agent_id, uint64_t deliver_ms, char *why,
                    size_t len)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return 0;
    /* How long this command may wait to start: what its deadline says
     * when the caller gave one, else what kscore queues unasked. */
    int64_t own_max_us = (int64_t)BROKER_QUEUE_MAX_MS * 1000;
    int64_t start_max_us = deliver_ms ? (int64_t)deliver_ms * 1000
                                      : own_max_us;
    int64_t claims = claims_pending(b, agent_id), now = ks_mono_us(),
            ran = running_since(b, now);
    int rc = 0;

    if (own_max_us > start_max_us)
        own_max_us = start_max_us;
    struct admit_q *q = queue_of(b, agent_id);
    struct broker__fairq_wait w;
    expire(a, now);
    stall_note(b, a, now);
    intake_ahead(a, operator_name, &w);
    int64_t own = own_wait_us(a, &w, claims, ran, now);
    /* Ahead of it at the agent: what was dispatched since the last stall
     * (the stall's backlog drains by itself, as its intake's does) */
    unsigned ahead = q ? q_ahead(a, q, now) : 0;
    int64_t agent = q ? agent_wait_us(q, ahead) : 0;
    if (own > own_max_us) {
        rc = KS_EBUSY;
        snprintf(why, len,
                 "the broker is busy: %zu requests wait to be recorded "
                 "before this one (%zu of them from operator '%s') and "
                 "%lld claims to be answered, about %lld ms before this one "
                 "could start, over its limit of %lld ms; nothing was "
                 "recorded, try again later",
                 w.n, w.own_n, operator_name, (long long)claims,
                 (long long)(own / 1000), (long long)(own_max_us / 1000));
    } else if (q && own + agent > start_max_us) {
        rc = KS_EBUSY;
        snprintf(why, len,
                 "agent %s is busy: %u commands in flight on its %u slots, "
                 "each held about %.0f ms: this one could start in about "
                 "%.2f s, %s %.2f s; nothing was recorded, try again later "
                 "(or give a longer --deliver-within)",
                 agent_id, ahead, q->slots, q->hold_us / 1000.0,
                 (double)(own + agent) / 1e6,
                 deliver_ms ? "after its delivery deadline of"
                            : "over the wait a command is given without "
                              "--deliver-within,",
                 (double)start_max_us / 1e6);
    }
    bool log = rc && now - a->busy_logged_us > 10000000;
    if (log)
        a->busy_logged_us = now;
    pthread_mutex_unlock(&a->mu);
    if (rc)
        ks_metric_inc(KS_C_REFUSED_BUSY);
    if (log)
        ks_log(KS_LOG_WARN, "refusing commands: busy (logged once per 10 s)",
               KS_S("agent", agent_id), KS_S("why", why));
    return rc;
}

bool
broker__admit_room(struct broker *b, const char *key, unsigned slots,
                   uint64_t deliver_ms, uint64_t timeout_ms)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return true;
    int64_t deadline_us =
        (int64_t)(deliver_ms ? deliver_ms : BROKER_DELIVER_WITHIN_DEFAULT_MS) *
        1000;
    int64_t own_max_us = (int64_t)BROKER_QUEUE_MAX_MS * 1000;
    int64_t claims = claims_pending(b, NULL), now = ks_mono_us(),
            ran = running_since(b, now);
    pthread_mutex_lock(&a->mu);
    struct admit_q *q = queue_get(a, key, slots);
    bool room = true;
    stall_note(b, a, now);
    if (q) {
        /* A batch's targets do not pass the intake: its wait as an
         * operator with nothing queued there sees (as the claims). */
        struct broker__fairq_wait w;
        intake_ahead(a, NULL, &w);
        int64_t own = own_wait_us(a, &w, claims, ran, now);
        /* Two rounds of slots at most: the agent never waits for the
         * next one, and no target waits long. Before any end was seen
         * (the hold unknown) one round, unless the command's timeout
         * bounds the hold within half the deadline. */
        bool bounded = q->hold_us > 0 ||
                       (timeout_ms &&
                        (int64_t)timeout_ms * 1000 <= deadline_us / 2);
        unsigned cap = bounded ? 2 * q->slots : q->slots;
        /* Every command not ended counts here, a stall's backlog too: a
         * batch dispatches no faster than its agents take up. */
        room = q->inflight < cap && own <= own_max_us &&
               own + agent_wait_us(q, q->inflight) <= deadline_us / 2;
    }
    pthread_mutex_unlock(&a->mu);
    return room;
}

/* ---- the intake ---------------------------------------------------------- */

/* The fields admission needs, read from an ExecuteRequest's wire bytes
 * (proto/kscore.proto: agent_id 2, deliver_within_ms 4, key_may_exist 6)
 * without unpacking it: the spec (field 1) may be a 512 KiB script. */
struct peek {
    char agent_id[EVT_AGENT_ID_MAX + 1];
    uint64_t deliver_ms;
    bool key_may_exist;
};

/* 0 with *pk, or KS_EDECODE (the worker then says what is wrong). */
static int
peek_execute(const uint8_t *p, size_t n, struct peek *pk)
{
    const uint8_t *end = n ? p + n : p;
    struct evt_wire_field f;
    int rc;

    memset(pk, 0, sizeof(*pk));
    if (n == 0)
        return 0;
    while ((rc = evt_wire_next(&p, end, &f)) == 0) {
        if (f.number == 2 && f.type == 2)
            snprintf(pk->agent_id, sizeof(pk->agent_id), "%.*s",
                     (int)(f.len < sizeof(pk->agent_id)
                               ? f.len
                               : sizeof(pk->agent_id) - 1),
                     (const char *)f.data);
        else if (f.number == 4 && f.type == 0)
            pk->deliver_ms = f.value;
        else if (f.number == 6 && f.type == 0)
            pk->key_may_exist = f.value != 0;
    }
    return rc == 1 ? 0 : KS_EDECODE;
}

/*
 * 1 when the policy denies the execute request in msg: such a request is
 * not refused as busy, which would tell its operator to try again (exit
 * 75) what will never be allowed; it goes on to a worker, which denies it
 * (and records the denial within the operator's share, budget.c). Unpacks
 * the request: only asked once the request would be refused.
 */
static bool
policy_denies(struct broker *b, natsMsg *msg, const char *agent_id)
{
    Ks__ExecuteRequest *req = NULL;
    char why[512];
    if (!b->policy ||
        broker__unpack_request(msg, &ks__execute_request__descriptor,
                               (ProtobufCMessage **)&req, why,
                               sizeof(why)) != 0)
        return false;
    Ks__AgentInfo *info = broker__agent_info(b, agent_id);
    int rc = req->spec ? broker__policy_check(b->policy,
                                              broker__operator_of(msg), info,
                                              req->spec, why, sizeof(why))
                       : 0;
    if (info)
        ks__agent_info__free_unpacked(info, NULL);
    ks__execute_request__free_unpacked(req, NULL);
    return rc != 0;
}

void
broker__intake_push(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                    void *ud)
{
    struct broker *b = ud;
    struct broker__admit *a = b->admit;
    const char *op = broker__operator_of(msg);
    struct peek pk;
    char why[512];
    (void)nc;
    (void)sub;

    /* Refused at once, on this thread, before any work: the worker would
     * only find the same (a malformed request goes on: the worker says
     * what is wrong with it). Not while the recorder cannot record: the
     * queues look full with ends not recorded, and the worker's append
     * names the database's refusal, the cause an operator can act on
     * (chaos pg-full: "busy" was said instead of disk_full). */
    if (!atomic_load(&b->rec_stalled) &&
        peek_execute((const uint8_t *)natsMsg_GetData(msg),
                     (size_t)natsMsg_GetDataLength(msg), &pk) == 0 &&
        !pk.key_may_exist && pk.agent_id[0] &&
        broker__admit_check(b, op, pk.agent_id, pk.deliver_ms, why,
                            sizeof(why)) == KS_EBUSY &&
        !policy_denies(b, msg, pk.agent_id)) {
        Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
        r.error_code = KS_EBUSY;
        r.error = why;
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
        natsMsg_Destroy(msg);
        return;
    }
    /* In its operator's turn; past the operator's bound (requests the
     * rule lets through unseen: an idempotency key that may name a
     * command) refused at once (intake_refuse). */
    if (broker__fairq_push(a->intake, op, b, msg,
                           (size_t)natsMsg_GetDataLength(msg)) != 0)
        return;
    /* A stall going on holds this one too. */
    pthread_mutex_lock(&a->mu);
    stall_note(b, a, ks_mono_us());
    pthread_mutex_unlock(&a->mu);
}

/* An exec worker serves one request of the intake (fairq.c: ctx the
 * broker, item the natsMsg). */
static void
intake_serve(void *worker_ud, void *ctx, void *item)
{
    struct broker__worker *wk = worker_ud;
    struct broker__admit *a = ((struct broker *)ctx)->admit;
    uint64_t r0 = 0, r1 = 0;
    int stalled = 0;

    evt_js_stall(wk->b->nc, NULL, &r0);
    wk->publish_handed = false;
    int64_t t0 = ks_mono_us();
    a->handler(NULL, NULL, item, wk); /* destroys the message */
    int64_t t1 = ks_mono_us();
    evt_js_stall(wk->b->nc, &stalled, &r1);
    /* A request that waited for a stream (its publish tried again), or
     * for this process to run again, says nothing of kscore's own time
     * per request. */
    if (r1 == r0 && !stalled && !wk->publish_handed &&
        !paused_since(wk->b, t0, t1)) {
        pthread_mutex_lock(&a->mu);
        a->exec_us = ewma(a->exec_us, (double)(t1 - t0));
        pthread_mutex_unlock(&a->mu);
    }
}

/* A request past its operator's bound in the intake: answered busy at
 * once, naming the bound. */
static void
intake_refuse(void *ctx, void *item)
{
    struct broker *b = ctx;
    natsMsg *msg = item;
    char why[512];
    snprintf(why, sizeof(why),
             "the broker is busy: operator '%s' has its most requests "
             "waiting to be recorded (%d, or %d MiB); nothing was "
             "recorded, try again later",
             broker__operator_of(msg), BROKER_FAIRQ_PER_IDENTITY,
             BROKER_FAIRQ_PER_IDENTITY_BYTES / (1024 * 1024));
    broker__reply_error(b, msg, &ks__execute_reply__descriptor, KS_EBUSY,
                        why);
    ks_metric_inc(KS_C_REFUSED_BUSY);
    natsMsg_Destroy(msg);
}

int
broker__admit_start(struct broker *b, natsMsgHandler handler)
{
    struct broker__admit *a = calloc(1, sizeof(*a));
    void *ud[BROKER_EXEC_WORKERS];
    if (!a)
        return -ENOMEM;
    pthread_mutex_init(&a->mu, NULL);
    a->handler = handler;
    b->admit = a;
    for (int i = 0; i < BROKER_EXEC_WORKERS; i++)
        ud[i] = &b->executors[i];
    /* Every worker may serve one operator's requests (one operator alone
     * is served as fast as before): another operator's request is still
     * next in turn when a worker comes free. */
    struct broker__fairq_opts o = {
        .name = "intake",
        .workers = BROKER_EXEC_WORKERS,
        .worker_ud = ud,
        .per_identity = BROKER_FAIRQ_PER_IDENTITY,
        .per_identity_bytes = BROKER_FAIRQ_PER_IDENTITY_BYTES,
        .busy_max = BROKER_EXEC_WORKERS,
        .serve = intake_serve,
        .refuse = intake_refuse};
    int rc = broker__fairq_start(&o, &a->intake);
    return rc == -ENOMEM ? rc : rc ? KS_EINTERNAL : 0;
}

static void
free_q(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

static void
free_queue(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    q_free(val);
}

void
broker__admit_stop(struct broker *b)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return;
    /* The workers serve what the intake holds, then end; admission
     * meanwhile (an ask again, a batch) sees no intake. */
    pthread_mutex_lock(&a->mu);
    struct broker__fairq *q = a->intake;
    a->intake = NULL;
    pthread_mutex_unlock(&a->mu);
    broker__fairq_stop(q);
}

void
broker__admit_free(struct broker *b)
{
    struct broker__admit *a = b->admit;
    if (!a)
        return;
    broker__admit_stop(b);
    while (a->head)
        unlink_cmd(a, a->head);
    ks_map_clear(&a->cmds);
    ks_map_each(&a->queues, free_queue, NULL);
    ks_map_clear(&a->queues);
    ks_map_each(&a->ops, free_q, NULL);
    ks_map_clear(&a->ops);
    pthread_mutex_destroy(&a->mu);
    free(a);
    b->admit = NULL;
}
