/*
 * BatchExecuteCommand: fan-out across agents with exact rate and error
 * control, driven by exactly one broker at a time, continued by another
 * when that broker dies.
 *
 * A batch is a stream "batch-<uuid>" (BatchRequested with its spec and
 * every target's command id, BatchCancelRequested, one BatchTargetEnded
 * per target, BatchCompleted) plus one command per target, each with its
 * own stream. A target is Pending until the scheduler dispatches it (then
 * its command stream starts: CommandRequested + CommandDispatched), and it
 * ends like any command (the recorder, the claim handler, the scanner or a
 * cancel call broker__command_ended, which hands it to this module).
 *
 * One scheduler thread owns the progress of every batch this broker
 * drives: it takes what happened since its last turn (new batches, ended
 * targets, cancels), decides what to dispatch or cancel, records all of it
 * in ONE transaction (store_batch_append), then publishes the commands,
 * the progress messages and the final replies. So a busy batch costs one
 * commit per turn, not one per target.
 *
 * Who drives (the lease, store.h "batch leases"): the transaction of a
 * turn first takes or extends this broker's lease on every batch it
 * touches, and commits only if they are all still this broker's; every
 * BATCH_TICK_MS the scheduler renews its leases (a batch whose lease is
 * gone is dropped: another broker drives it), reads which of its in-flight
 * targets have ended in the record (an end recorded by another broker's
 * recorder never reaches this process otherwise), and adopts open batches
 * whose lease has run out: a dead broker's batches continue on another
 * within BATCH_LEASE_MS + BATCH_TICK_MS. A stopping broker dispatches
 * nothing more and hands its batches over at once (hand_over: releases
 * their leases), so another broker, or this one restarted, continues them
 * without waiting for the leases to run out.
 *
 * Nothing a batch needs lives only in one process: adoption rebuilds it
 * from the record (batch_load): the spec and targets from BatchRequested, the
 * targets' states from the commands projection (a target that ended while
 * nobody drove the batch is counted then, once, and reported with
 * BatchTargetEnded), the cancel from BatchCancelRequested, and where the
 * waiting client listens from the lease row. The driver sends that client
 * a progress message with no target at acceptance (the client learns the
 * batch id) and at every tick (a heartbeat: the batch has a driver).
 *
 * Rate control, exactly, across restarts (in flight = requested and not
 * ended, from the record):
 *   in flight <= max_concurrency;
 *   max_errors E: once MORE than E targets have ended in error (every end
 *   but Succeeded and Cancelled: BatchCounts.errors), nothing more is
 *   dispatched and the pending targets end Cancelled (in-flight ones
 *   finish). E = 0 stops after the first error, as AWS SSM's MaxErrors
 *   and Ansible's max_fail_percentage read it; E given as P% is
 *   floor(P * targets / 100), so "more than E" is "more than P%";
 *   strict: errors + in flight <= E as well before a dispatch, so at most
 *   E + 1 errors ever happen (the one that spends the budget).
 *
 * Pacing (issue 23): besides max_concurrency, a target is dispatched only
 * when its agent's queue has room (admit.c broker__admit_room: less than
 * two rounds of its slots in flight, its wait within half the delivery
 * deadline), so a batch to more hosts than the fleet runs at once never
 * ends Undeliverable because kscore dispatched faster than the agents
 * take up: each target's deadline runs from its own dispatch.
 *
 * An offline target (its agent's heartbeat older than the registry TTL
 * when its turn comes) is not dispatched: it ends Undeliverable at once
 * ("no response", reason "offline since HH:MM:SS UTC") rather than after
 * its delivery deadline.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "broker_int.h"

/* A driver renews every tick; a batch whose driver is silent this long is
 * adopted by any broker. */
#define BATCH_LEASE_MS 6000
#define BATCH_TICK_MS 1000
/* Batches adopted per tick (the rest on the next ones). */
#define BATCH_ADOPT_LIMIT 64

struct btarget {
    char agent_id[EVT_AGENT_ID_MAX + 1];
    char command_id[37];
    /* PENDING: never requested; DISPATCHED: requested, not ended (in
     * flight, whatever its command's own state); then terminal. */
    Ks__CommandStatus status;
    Ks__CommandResult *result; /* owned copy once ended */
    bool ended_unreported;     /* ended, BatchTargetEnded not yet recorded */
    bool reported;             /* batch_load: BatchTargetEnded recorded */
};

struct batch {
    char id[48]; /* "batch-<uuid>" */
    char operator_name[64];
    Ks__BatchRequest *req; /* owned; req->spec is every target's spec */
    struct btarget *t;
    size_t n, next; /* next: no Pending target before it */
    char **agent_ptrs, **cmd_ptrs; /* for BatchSpec */
    unsigned running, ended;
    /* Ended targets by state (BatchCounts); errors: the budget's count. */
    unsigned succeeded, failed, cancelled, timed_out, killed, no_response,
        lost, not_started, errors;
    uint32_t conc, max_err;
    bool has_max_err, strict;
    bool recorded;     /* BatchRequested committed (or in this turn) */
    bool accepted_now; /* BatchRequested is in this turn's plan */
    bool cancel_req;   /* operator cancel: cancel running targets too */
    bool cancel_sent;
    bool done;          /* BatchCompleted is planned */
    bool done_recorded; /* ... and committed: views may say so */
    char *reply_subject;  /* NULL when detached (replied at acceptance) */
    char *accept_subject; /* detached: reply once recorded */
    int64_t start_mono_us;
    /* Waves (BatchSpec.wave_ends: the index after each wave's last
     * target): the wave now (1-based; 0: none started), whether its
     * BatchWaveEnded is planned, when the next may start (epoch us), and
     * a halt (the budget spent at a wave's end). Rebuilt from the
     * BatchWave* events by batch_load. */
    uint32_t *wave_ends;
    size_t n_waves;
    uint64_t wave_pause_ms;
    uint32_t wave;
    bool wave_ended;
    int64_t next_wave_at_us;
    bool halted;
    uint32_t halted_wave;
    char halt_reason[200];
    /* A rerun (BatchSpec.rerun_of, rerun_filter). */
    char rerun_of[48];
    char rerun_filter[16];
};

/* JOB_REMOTE: another broker recorded the end of a target (its notice,
 * notice.c); the scheduler reads it from the record. */
enum job_kind { JOB_NEW, JOB_ENDED, JOB_CANCEL, JOB_REMOTE };

struct job {
    struct job *next;
    enum job_kind kind;
    struct batch *batch;       /* JOB_NEW: owned until applied */
    char batch_id[48];         /* JOB_CANCEL */
    char command_id[37];       /* JOB_ENDED, JOB_REMOTE */
    Ks__CommandResult *result; /* owned copy */
};

struct broker__batches {
    pthread_mutex_t mu;
    pthread_cond_t cond;  /* on CLOCK_MONOTONIC */
    struct ks_map live;   /* batch id -> struct batch *, driven here */
    struct ks_map by_cmd; /* command id -> struct batch *, its targets */
    struct job *head, **tail;
    pthread_t thread;
    bool started, stopping;
    bool handed_over; /* hand_over(): nothing is driven here any more */
    /* "<host>/<pid>/<uuid>": this process in batch_leases.owner. */
    char owner[STORE_BATCH_OWNER_MAX + 1];
    /* For the API threads (cancel, refusals), under api_mu: the scheduler
     * owns b->st_batch. */
    pthread_mutex_t api_mu;
    struct store *st_api;
};

/* ---- helpers ------------------------------------------------------------- */

static Ks__CommandResult *
copy_result(const Ks__CommandResult *r)
{
    uint8_t *buf;
    size_t len;
    Ks__CommandResult *c;
    if (!r)
        return NULL;
    if (kproto_pack(&r->base, &buf, &len))
        return NULL;
    c = ks__command_result__unpack(NULL, len, buf);
    free(buf);
    return c;
}

static void
batch_free(struct batch *bt)
{
    if (!bt)
        return;
    for (size_t i = 0; bt->t && i < bt->n; i++)
        if (bt->t[i].result)
            ks__command_result__free_unpacked(bt->t[i].result, NULL);
    free(bt->t);
    free(bt->agent_ptrs);
    free(bt->cmd_ptrs);
    free(bt->wave_ends);
    if (bt->req)
        ks__batch_request__free_unpacked(bt->req, NULL);
    free(bt->reply_subject);
    free(bt->accept_subject);
    free(bt);
}

/* A batch of n targets with nothing filled in; NULL without memory. */
static struct batch *
batch_alloc(size_t n)
{
    struct batch *bt = calloc(1, sizeof(*bt));
    if (!bt || !(bt->t = calloc(n ? n : 1, sizeof(*bt->t))) ||
        !(bt->agent_ptrs = calloc(n ? n : 1, sizeof(char *))) ||
        !(bt->cmd_ptrs = calloc(n ? n : 1, sizeof(char *)))) {
        batch_free(bt);
        return NULL;
    }
    bt->n = n;
    for (size_t i = 0; i < n; i++) {
        bt->t[i].status = KS__COMMAND_STATUS__PENDING;
        bt->agent_ptrs[i] = bt->t[i].agent_id;
        bt->cmd_ptrs[i] = bt->t[i].command_id;
    }
    return bt;
}

static void
counts_of(const struct batch *bt, Ks__BatchCounts *c)
{
    ks__batch_counts__init(c);
    c->total = (uint32_t)bt->n;
    c->running = bt->running;
    c->succeeded = bt->succeeded;
    c->failed = bt->failed;
    c->cancelled = bt->cancelled;
    c->timed_out = bt->timed_out;
    c->killed = bt->killed;
    c->no_response = bt->no_response;
    c->lost = bt->lost;
    c->not_started = bt->not_started;
    c->errors = bt->errors;
    c->pending = (uint32_t)bt->n - bt->running - bt->ended;
}

static Ks__BatchStatus
final_status(const struct batch *bt)
{
    if (bt->cancel_req)
        return KS__BATCH_STATUS__BATCH_CANCELLED;
    if (bt->succeeded == bt->n)
        return KS__BATCH_STATUS__BATCH_SUCCEEDED;
    if (bt->succeeded == 0)
        return KS__BATCH_STATUS__BATCH_FAILED;
    return KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE;
}

static uint32_t
resolve_amount(const Ks__Amount *a, size_t n, bool at_least_one)
{
    uint64_t v;
    if (!a)
        return (uint32_t)n;
    v = a->percent ? (uint64_t)n * a->value / 100 : a->value;
    if (v > n)
        v = n;
    if (at_least_one && v == 0)
        v = 1;
    return (uint32_t)v;
}

/* The first Pending target at or after bt->next (bt->n: none). Targets
 * leave Pending in index order, but a batch rebuilt from the record is
 * scanned, not trusted. */
static size_t
next_pending(struct batch *bt)
{
    while (bt->next < bt->n &&
           bt->t[bt->next].status != KS__COMMAND_STATUS__PENDING)
        bt->next++;
    return bt->next;
}

/* Counts one end with status st (result r, may be NULL) in c's fields
 * (BatchCounts: each end in one state field; errors as well for every end
 * but Succeeded and Cancelled). */
static void
count_end(Ks__CommandStatus st, const Ks__CommandResult *r, unsigned *ok,
          unsigned *failed, unsigned *cancelled, unsigned *timed_out,
          unsigned *killed, unsigned *no_response, unsigned *lost,
          unsigned *not_started, unsigned *errors)
{
    switch (st) {
    case KS__COMMAND_STATUS__SUCCEEDED:
        ++*ok;
        return;
    case KS__COMMAND_STATUS__CANCELLED:
        ++*cancelled;
        return;
    case KS__COMMAND_STATUS__TIMED_OUT:
        ++*timed_out;
        break;
    case KS__COMMAND_STATUS__UNDELIVERABLE:
        ++*no_response;
        break;
    case KS__COMMAND_STATUS__LOST:
        ++*lost;
        break;
    case KS__COMMAND_STATUS__NOT_STARTED:
        ++*not_started;
        break;
    default:
        if (st == KS__COMMAND_STATUS__FAILED && r && r->signal &&
            !r->has_exit_code)
            ++*killed;
        else
            ++*failed;
        break;
    }
    ++*errors;
}

/*
 * Counts target t as ended with status st (count_end). Once: a
 * target already terminal is left alone (a result reported twice, or seen
 * both in the record and as a job). result is taken (freed if unused).
 * report: BatchTargetEnded is still to be recorded. Caller holds m->mu
 * once the batch is live.
 */
static bool
target_end(struct batch *bt, struct btarget *t, Ks__CommandStatus st,
           bool never_dispatched, Ks__CommandResult *result, bool report)
{
    if (kproto_status_terminal(t->status)) {
        if (result)
            ks__command_result__free_unpacked(result, NULL);
        return false;
    }
    if (t->status != KS__COMMAND_STATUS__PENDING && bt->running)
        bt->running--;
    t->status = st;
    t->result = result;
    t->ended_unreported = report;
    (void)never_dispatched;
    bt->ended++;
    count_end(st, result, &bt->succeeded, &bt->failed, &bt->cancelled,
              &bt->timed_out, &bt->killed, &bt->no_response, &bt->lost,
              &bt->not_started, &bt->errors);
    return true;
}

static struct btarget *
target_of(struct batch *bt, const char *command_id)
{
    for (size_t i = 0; i < bt->n; i++)
        if (strcmp(bt->t[i].command_id, command_id) == 0)
            return &bt->t[i];
    return NULL;
}

/* Makes bt live here: its id and every target's command id find it.
 * Caller holds m->mu. */
static int
batch_register(struct broker__batches *m, struct batch *bt)
{
    int rc = ks_map_put(&m->live, bt->id, bt);
    for (size_t i = 0; rc == 0 && i < bt->n; i++)
        rc = ks_map_put(&m->by_cmd, bt->t[i].command_id, bt);
    return rc;
}

/* Forgets bt (it stays allocated). Caller holds m->mu. */
static void
batch_unregister(struct broker__batches *m, struct batch *bt)
{
    if (ks_map_get(&m->live, bt->id) == bt)
        ks_map_del(&m->live, bt->id);
    for (size_t i = 0; i < bt->n; i++)
        if (ks_map_get(&m->by_cmd, bt->t[i].command_id) == bt)
            ks_map_del(&m->by_cmd, bt->t[i].command_id);
}

/* Unregisters and frees bt: the scheduler thread only (it alone frees
 * batches, so its pointers stay valid between its own calls). */
static void
batch_drop(struct broker__batches *m, struct batch *bt)
{
    pthread_mutex_lock(&m->mu);
    batch_unregister(m, bt);
    pthread_mutex_unlock(&m->mu);
    batch_free(bt);
}

/* ---- the plan of one turn ------------------------------------------------- */

/* Storage for one event and what it points to. */
struct slot {
    Ks__Event ev;
    char id[37];
    char stream[64];
    Ks__Command cmd;
    Ks__CommandSpec tspec; /* the batch's spec, this target's secrets */
    struct broker__labels labels; /* cmd.labels */
    Ks__CommandResult res;
    Ks__BatchCounts counts;
    Ks__BatchSpec spec;
};

struct plan {
    struct broker *b; /* the registry: who is offline */
    bool no_dispatch; /* the broker is stopping: start nothing new */
    char **strings;   /* plan_string: freed with the plan */
    size_t nstr, capstr;
    struct slot **slots;
    size_t n, cap;
    Ks__Command **publish; /* commands to publish after the commit */
    size_t npub, cappub;
};

static struct slot *
plan_add(struct plan *p)
{
    if (p->n == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 64;
        void *x = realloc(p->slots, nc * sizeof(*p->slots));
        if (!x)
            return NULL;
        p->slots = x;
        p->cap = nc;
    }
    struct slot *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    p->slots[p->n++] = s;
    return s;
}

/* len bytes that live as long as the plan; NULL without memory. */
static char *
plan_string(struct plan *p, size_t len)
{
    if (p->nstr == p->capstr) {
        size_t nc = p->capstr ? p->capstr * 2 : 16;
        void *x = realloc(p->strings, nc * sizeof(*p->strings));
        if (!x)
            return NULL;
        p->strings = x;
        p->capstr = nc;
    }
    char *s = calloc(1, len);
    if (s)
        p->strings[p->nstr++] = s;
    return s;
}

static void
plan_release(struct plan *p)
{
    for (size_t i = 0; i < p->nstr; i++)
        free(p->strings[i]);
    free(p->strings);
    for (size_t i = 0; i < p->n; i++) {
        broker__labels_release(&p->slots[i]->labels);
        free(p->slots[i]);
    }
    free(p->slots);
    free(p->publish);
    memset(p, 0, sizeof(*p));
}

static int
plan_publish(struct plan *p, Ks__Command *cmd)
{
    if (p->npub == p->cappub) {
        size_t nc = p->cappub ? p->cappub * 2 : 64;
        void *x = realloc(p->publish, nc * sizeof(*p->publish));
        if (!x)
            return -ENOMEM;
        p->publish = x;
        p->cappub = nc;
    }
    p->publish[p->npub++] = cmd;
    return 0;
}

/* A batch-stream event. */
static struct slot *
batch_event(struct plan *p, struct batch *bt, const char *type)
{
    struct slot *s = plan_add(p);
    if (!s)
        return NULL;
    snprintf(s->stream, sizeof(s->stream), "%s", bt->id);
    broker__event_init(&s->ev, s->id, s->stream, type, NULL);
    s->ev.batch_id = bt->id;
    s->ev.operator_ = bt->operator_name;
    counts_of(bt, &s->counts);
    s->ev.batch_counts = &s->counts;
    return s;
}

/* CommandRequested + CommandDispatched of one target; its command is then
 * published. */
static int
dispatch_target(struct plan *p, struct batch *bt, struct btarget *t)
{
    struct slot *a = plan_add(p), *d = plan_add(p);
    uint64_t deliver_ms = bt->req->deliver_within_ms
                              ? bt->req->deliver_within_ms
                              : BROKER_DELIVER_WITHIN_DEFAULT_MS;
    char ids[2][37];
    if (!a || !d)
        return -ENOMEM;
    snprintf(a->stream, sizeof(a->stream), "command-%s", t->command_id);
    Ks__Command *cmd = &a->cmd;
    ks__command__init(cmd);
    cmd->command_id = t->command_id;
    cmd->attempt = 1;
    cmd->agent_id = t->agent_id;
    broker__spec_for_agent(bt->req->spec, t->agent_id, &a->tspec);
    cmd->spec = &a->tspec;
    cmd->issued_at_us = ks_now_us();
    cmd->not_after_us = cmd->issued_at_us + (int64_t)deliver_ms * 1000;
    cmd->dispatch_version = 2;
    cmd->batch_id = bt->id;
    cmd->operator_ = bt->operator_name;
    if (p->b) { /* its labels, for the child (KSCORE_LABEL_*) */
        broker__command_labels(p->b, t->agent_id, &a->labels);
        cmd->labels = a->labels.v;
        cmd->n_labels = a->labels.n;
    }
    broker__start_events(&a->ev, &d->ev, ids, a->stream, cmd, NULL);
    memcpy(a->id, ids[0], 37);
    memcpy(d->id, ids[1], 37);
    a->ev.event_id = a->id;
    d->ev.event_id = d->id;
    t->status = KS__COMMAND_STATUS__DISPATCHED;
    bt->running++;
    if (p->b) {
        broker__output_caps_note(p->b, t->command_id, bt->req->spec);
        broker__admit_dispatched(p->b, t->command_id, cmd->operator_,
                                 t->agent_id, cmd->not_after_us,
                                 bt->req->spec->timeout_ms,
                                 broker__cmd_bytes(cmd));
    }
    return plan_publish(p, cmd);
}

/* A never-dispatched target ends with status st (Cancelled, or
 * Undeliverable for an offline agent): its command stream still records
 * that (CommandRequested + CommandCancelled / CommandUndeliverable), so
 * every target is a command with its own history. why must outlive the
 * plan. */
static int
end_pending(struct plan *p, struct batch *bt, struct btarget *t,
            Ks__CommandStatus st, const char *why)
{
    bool undeliverable = st == KS__COMMAND_STATUS__UNDELIVERABLE;
    struct slot *a = plan_add(p), *c = plan_add(p);
    if (!a || !c)
        return -ENOMEM;
    snprintf(a->stream, sizeof(a->stream), "command-%s", t->command_id);
    ks__command__init(&a->cmd);
    a->cmd.command_id = t->command_id;
    a->cmd.agent_id = t->agent_id;
    broker__spec_for_agent(bt->req->spec, t->agent_id, &a->tspec);
    a->cmd.spec = &a->tspec;
    a->cmd.issued_at_us = ks_now_us();
    a->cmd.batch_id = bt->id;
    a->cmd.operator_ = bt->operator_name;
    broker__event_init(&a->ev, a->id, a->stream, "CommandRequested",
                       t->command_id);
    a->ev.agent_id = t->agent_id;
    a->ev.batch_id = bt->id;
    a->ev.command = &a->cmd;
    a->ev.operator_ = bt->operator_name;
    broker__event_init(&c->ev, c->id, a->stream,
                       undeliverable ? "CommandUndeliverable"
                                     : "CommandCancelled",
                       t->command_id);
    c->ev.agent_id = t->agent_id;
    c->ev.batch_id = bt->id;
    ks__command_result__init(&c->res);
    c->res.status = st;
    c->res.cancelled = !undeliverable;
    c->res.term_sent_us = c->res.kill_sent_us = -1;
    c->res.finished_at_us = a->cmd.issued_at_us;
    c->res.reason = (char *)why;
    c->ev.result = &c->res;
    c->ev.reason = (char *)why;
    c->ev.operator_ = bt->operator_name;
    target_end(bt, t, st, true, copy_result(&c->res), true);
    return 0;
}

static int
cancel_pending(struct plan *p, struct batch *bt, struct btarget *t,
               const char *why)
{
    return end_pending(p, bt, t, KS__COMMAND_STATUS__CANCELLED, why);
}

/* A target whose agent is offline: it ends Undeliverable now, the reason
 * saying since when (kept in the plan's strings until it is recorded). */
static int
no_response_pending(struct plan *p, struct batch *bt, struct btarget *t,
                    int64_t heartbeat_at_us)
{
    char *why = plan_string(p, 64);
    struct tm tm;
    time_t secs = (time_t)(heartbeat_at_us / 1000000);
    if (!why)
        return -ENOMEM;
    if (heartbeat_at_us > 0 && gmtime_r(&secs, &tm))
        strftime(why, 64, "offline since %H:%M:%S UTC", &tm);
    else
        snprintf(why, 64, "offline");
    return end_pending(p, bt, t, KS__COMMAND_STATUS__UNDELIVERABLE, why);
}

/* The index after the current wave's last target (no waves: all). */
static size_t
wave_end(const struct batch *bt)
{
    if (!bt->n_waves)
        return bt->n;
    return bt->wave ? bt->wave_ends[bt->wave - 1] : 0;
}

static bool
may_dispatch(struct batch *bt)
{
    if (bt->cancel_req)
        return false;
    /* Waves: only the current one's targets, and none between two. */
    if (bt->n_waves && (bt->wave_ended || next_pending(bt) >= wave_end(bt)))
        return false;
    if (bt->has_max_err && bt->errors > bt->max_err)
        return false;
    if (bt->running >= bt->conc)
        return false;
    if (bt->strict && bt->has_max_err &&
        (uint64_t)bt->running + bt->errors > bt->max_err)
        return false;
    return next_pending(bt) < bt->n;
}

/* A BatchWaveStarted or BatchWaveEnded of bt's current wave. */
static struct slot *
wave_event(struct plan *p, struct batch *bt, const char *type)
{
    struct slot *s = batch_event(p, bt, type);
    if (s)
        s->ev.wave = bt->wave;
    return s;
}

/*
 * The wave's end, once every target of it has ended: the error budget is
 * checked (spent: the batch halts, the rest end Cancelled by plan_batch),
 * and the next wave may start after the pause. Recorded (BatchWaveEnded)
 * so that a broker that adopts the batch knows the wave and the pause.
 */
static int
wave_finish(struct plan *p, struct batch *bt)
{
    struct slot *s = wave_event(p, bt, "BatchWaveEnded");
    if (!s)
        return -ENOMEM;
    bt->wave_ended = true;
    if (bt->has_max_err && bt->errors > bt->max_err && !bt->cancel_req &&
        bt->wave < bt->n_waves) {
        bt->halted = true;
        bt->halted_wave = bt->wave;
        snprintf(bt->halt_reason, sizeof(bt->halt_reason),
                 "halted after wave %u of %zu: %u error(s), more than "
                 "--max-errors %u",
                 bt->wave, bt->n_waves, bt->errors, bt->max_err);
        s->ev.halted = true;
        s->ev.reason = bt->halt_reason;
    } else if (bt->wave < bt->n_waves && !bt->cancel_req) {
        bt->next_wave_at_us = ks_now_us() + (int64_t)bt->wave_pause_ms * 1000;
        s->ev.next_wave_at_us = bt->next_wave_at_us;
    }
    return 0;
}

/* Whether the next wave may start now. */
static bool
wave_due(const struct batch *bt)
{
    return bt->n_waves && (bt->wave == 0 || bt->wave_ended) && !bt->halted &&
           !bt->cancel_req && bt->wave < bt->n_waves &&
           ks_now_us() >= bt->next_wave_at_us;
}

/* Decides one batch's turn into p. Caller holds the module lock. */
static int
plan_batch(struct plan *p, struct batch *bt)
{
    int rc = 0;

    if (!bt->recorded) {
        struct slot *s = batch_event(p, bt, "BatchRequested");
        if (!s)
            return -ENOMEM;
        Ks__BatchSpec *sp = &s->spec;
        ks__batch_spec__init(sp);
        sp->spec = bt->req->spec;
        sp->n_agents = bt->n;
        sp->agents = bt->agent_ptrs;
        sp->n_command_ids = bt->n;
        sp->command_ids = bt->cmd_ptrs;
        sp->max_concurrency = bt->conc;
        sp->max_errors = bt->max_err;
        sp->has_max_errors = bt->has_max_err;
        sp->strict_errors = bt->strict;
        sp->deliver_within_ms = bt->req->deliver_within_ms;
        sp->wave_ends = bt->wave_ends;
        sp->n_wave_ends = bt->n_waves;
        sp->wave_pause_ms = bt->wave_pause_ms;
        sp->rerun_of = bt->rerun_of;
        sp->rerun_filter = bt->rerun_filter;
        s->ev.batch = sp;
        bt->recorded = true;
        bt->accepted_now = true;
        if (bt->rerun_of[0]) {
            /* The link both ways: the original's record names its rerun
             * (one transaction with the rerun's own). */
            struct slot *o = plan_add(p);
            if (!o)
                return -ENOMEM;
            snprintf(o->stream, sizeof(o->stream), "%s", bt->rerun_of);
            broker__event_init(&o->ev, o->id, o->stream,
                               "BatchRerunRequested", NULL);
            o->ev.batch_id = o->stream;
            o->ev.operator_ = bt->operator_name;
            o->ev.rerun_batch_id = bt->id;
            o->ev.reason = bt->rerun_filter;
        }
    }
    for (;;) {
        if (!p->no_dispatch && wave_due(bt)) {
            bt->wave++;
            bt->wave_ended = false;
            bt->next_wave_at_us = 0;
            if (!wave_event(p, bt, "BatchWaveStarted"))
                return -ENOMEM;
        }
        /* Paced: a target goes out only when its agent's queue takes it
         * now (admit.c), so its delivery deadline runs from a dispatch its
         * agent can take up soon; the rest wait here, Pending, for the
         * next turns (each end brings one) instead of in JetStream, where
         * the deadlines of a batch larger than its fleet can run at once
         * would run out. A target whose agent has no room is passed over
         * for later ones of its wave; its queue is noted as full for the
         * rest of the turn. */
        struct ks_map full = KS_MAP_INIT;
        size_t end = wave_end(bt);
        for (size_t i = next_pending(bt); rc == 0 && !p->no_dispatch &&
                                          i < end && may_dispatch(bt);
             i++) {
            struct btarget *t = &bt->t[i];
            int64_t hb = 0;
            char key[EVT_AGENT_ID_MAX + 48];
            unsigned slots = 0;
            if (t->status != KS__COMMAND_STATUS__PENDING)
                continue;
            if (p->b) {
                broker__agent_queue(p->b, t->agent_id, key, sizeof(key),
                                    &slots);
                if (ks_map_get(&full, key))
                    continue;
            }
            if (p->b &&
                broker__agent_presence(p->b, t->agent_id, &hb) == 0) {
                rc = no_response_pending(p, bt, t, hb);
                continue;
            }
            if (p->b && !broker__admit_room(p->b, key, slots,
                                            bt->req->deliver_within_ms,
                                            bt->req->spec->timeout_ms)) {
                if (ks_map_put(&full, key, bt) != 0)
                    rc = -ENOMEM;
                continue;
            }
            rc = dispatch_target(p, bt, t);
        }
        ks_map_clear(&full);
        if (rc == 0 && next_pending(bt) < bt->n &&
            (bt->cancel_req || (bt->has_max_err && bt->errors > bt->max_err))) {
            const char *why = bt->cancel_req
                                  ? "batch cancelled before this target ran"
                                  : "batch error budget spent before this "
                                    "target ran";
            char *w = bt->n_waves && !bt->cancel_req ? plan_string(p, 96)
                                                     : NULL;
            if (w) {
                snprintf(w, 96,
                         "batch halted in wave %u of %zu (error budget "
                         "spent) before this target ran",
                         bt->wave, bt->n_waves);
                why = w;
            }
            while (rc == 0 && next_pending(bt) < bt->n)
                rc = cancel_pending(p, bt, &bt->t[bt->next], why);
        }
        for (size_t i = 0; rc == 0 && i < bt->n; i++) {
            struct btarget *t = &bt->t[i];
            if (!t->ended_unreported || t->reported)
                continue;
            struct slot *s = batch_event(p, bt, "BatchTargetEnded");
            if (!s)
                return -ENOMEM;
            s->ev.command_id = t->command_id;
            s->ev.agent_id = t->agent_id;
            s->ev.target_status = t->status;
            t->reported = true; /* planned: once in this turn */
        }
        /* The wave has ended when every target up to its last has. */
        if (rc || !bt->n_waves || !bt->wave || bt->wave_ended ||
            bt->running || next_pending(bt) < wave_end(bt))
            break;
        if ((rc = wave_finish(p, bt)) || !wave_due(bt) || p->no_dispatch)
            break;
    }
    if (rc == 0 && !bt->done && next_pending(bt) == bt->n &&
        bt->running == 0) {
        struct slot *s = batch_event(p, bt, "BatchCompleted");
        if (!s)
            return -ENOMEM;
        s->ev.batch_status = final_status(bt);
        bt->done = true;
    }
    return rc;
}

/* ---- replies and progress -------------------------------------------------- */

static void
fill_reply(const struct batch *bt, Ks__BatchReply *r, Ks__BatchCounts *c,
           Ks__BatchTarget **tv, Ks__BatchTarget *ts, Ks__CommandResult *rs)
{
    ks__batch_reply__init(r);
    counts_of(bt, c);
    r->batch_id = (char *)bt->id;
    /* Not before the commit: a reader must not see an end the record
     * does not have yet. */
    r->status = bt->done_recorded ? final_status(bt)
                                  : KS__BATCH_STATUS__BATCH_RUNNING;
    r->counts = c;
    r->elapsed_us = ks_mono_us() - bt->start_mono_us;
    r->max_concurrency = bt->conc;
    r->max_errors = bt->has_max_err ? bt->max_err : 0;
    r->has_max_errors = bt->has_max_err;
    r->wave_ends = bt->wave_ends;
    r->n_wave_ends = bt->n_waves;
    r->wave = bt->wave;
    r->next_wave_at_us = bt->wave_ended ? bt->next_wave_at_us : 0;
    r->halted = bt->halted;
    r->halted_wave = bt->halted_wave;
    r->halt_reason = (char *)bt->halt_reason;
    r->wave_pause_ms = bt->wave_pause_ms;
    r->rerun_of = (char *)bt->rerun_of;
    r->rerun_filter = (char *)bt->rerun_filter;
    for (size_t i = 0; tv && i < bt->n; i++) {
        ks__batch_target__init(&ts[i]);
        ts[i].agent_id = (char *)bt->t[i].agent_id;
        ts[i].command_id = (char *)bt->t[i].command_id;
        ts[i].status = bt->t[i].status;
        if (bt->t[i].result) {
            /* No output here: a big batch would not fit in one message.
             * Progress messages and `kscore get` carry it. */
            rs[i] = *bt->t[i].result;
            rs[i].stdout = NULL;
            rs[i].stderr = NULL;
            ts[i].result = &rs[i];
        }
        tv[i] = &ts[i];
    }
    r->targets = tv;
    r->n_targets = tv ? bt->n : 0;
}

static void
send_reply(struct broker *b, struct batch *bt, const char *subject)
{
    Ks__BatchReply r;
    Ks__BatchCounts c;
    Ks__BatchTarget **tv = calloc(bt->n, sizeof(*tv));
    Ks__BatchTarget *ts = calloc(bt->n, sizeof(*ts));
    Ks__CommandResult *rs = calloc(bt->n, sizeof(*rs));
    fill_reply(bt, &r, &c, tv && ts && rs ? tv : NULL, ts, rs);
    while (r.n_targets > 0 &&
           protobuf_c_message_get_packed_size(&r.base) > KS_MAX_MESSAGE_BYTES)
        r.n_targets /= 2; /* the client reads the rest with kscore get */
    evt_publish_msg(b->nc, subject, &r.base);
    free(tv);
    free(ts);
    free(rs);
}

/* A progress message: t ended, or (t NULL) the batch is recorded, which
 * tells a waiting client its id (to follow it should its broker die). */
static void
send_progress(struct broker *b, struct batch *bt, struct btarget *t)
{
    Ks__BatchProgress pr = KS__BATCH_PROGRESS__INIT;
    Ks__BatchTarget tg = KS__BATCH_TARGET__INIT;
    Ks__BatchCounts c;
    if (!bt->req->progress_subject[0])
        return;
    if (!t && bt->req->live_output)
        for (size_t i = 0; i < bt->n; i++)
            if (!kproto_status_terminal(bt->t[i].status))
                broker__live_add(b, bt->t[i].command_id,
                                 bt->req->progress_subject);
    counts_of(bt, &c);
    if (t) {
        tg.agent_id = t->agent_id;
        tg.command_id = t->command_id;
        tg.status = t->status;
        tg.result = t->result;
        pr.target = &tg;
    }
    pr.batch_id = bt->id;
    pr.counts = &c;
    pr.elapsed_us = ks_mono_us() - bt->start_mono_us;
    pr.wave = bt->wave;
    pr.waves = (uint32_t)bt->n_waves;
    pr.next_wave_at_us = bt->wave_ended ? bt->next_wave_at_us : 0;
    if (evt_publish_msg(b->nc, bt->req->progress_subject, &pr.base) ==
        KS_ETOOBIG) {
        tg.result = NULL; /* the client fetches it with kscore get */
        evt_publish_msg(b->nc, bt->req->progress_subject, &pr.base);
    }
}

/* ---- the scheduler thread ------------------------------------------------- */

/* Applies one job; returns the batch it touched, or NULL. Caller holds
 * m->mu. */
static struct batch *
apply_job(struct broker__batches *m, struct job *j)
{
    struct batch *bt;
    struct btarget *t;

    switch (j->kind) {
    case JOB_NEW:
        if (m->handed_over)
            return NULL; /* refused: freed with the job, after the reply */
        bt = j->batch;
        j->batch = NULL;
        if (batch_register(m, bt) != 0) {
            /* Out of memory: the client never hears of it; tell it. */
            batch_unregister(m, bt);
            j->batch = bt; /* freed with the job, after the reply */
            return NULL;
        }
        return bt;
    case JOB_CANCEL:
        bt = ks_map_get(&m->live, j->batch_id);
        if (bt)
            bt->cancel_req = true;
        return bt;
    case JOB_ENDED:
        bt = ks_map_get(&m->by_cmd, j->command_id);
        if (!bt || !(t = target_of(bt, j->command_id)))
            return NULL;
        target_end(bt, t,
                   j->result ? j->result->status : KS__COMMAND_STATUS__FAILED,
                   false, j->result, true);
        j->result = NULL;
        return bt;
    case JOB_REMOTE:
        return NULL; /* read from the record by remote_ends */
    }
    return NULL;
}

static void
reply_error_to(struct broker *b, const char *subject, int code,
               const char *text, const char *batch_id)
{
    Ks__BatchReply r = KS__BATCH_REPLY__INIT;
    if (!subject)
        return;
    r.error_code = code;
    r.error = (char *)text;
    if (batch_id)
        r.batch_id = (char *)batch_id;
    evt_publish_msg(b->nc, subject, &r.base);
}

/*
 * A turn's plan that could not be recorded: the batches in memory are
 * ahead of the record, so they are dropped. A batch whose BatchRequested
 * was in the plan never existed: its client is told. The others are
 * released, so that at the next tick this broker (or any) rebuilds them
 * from the record; when the lease was lost, the new driver has them.
 */
static void
abandon(struct broker *b, struct batch **touched, size_t nt, int why)
{
    struct broker__batches *m = b->batches;
    const char **ids = calloc(nt ? nt : 1, sizeof(*ids));
    char (*keep)[48] = calloc(nt ? nt : 1, sizeof(*keep));
    size_t k = 0;
    char text[240];

    for (size_t i = 0; i < nt; i++) {
        struct batch *bt = touched[i];
        if (bt->accepted_now) {
            if (why == KS_EINDOUBT)
                snprintf(text, sizeof(text),
                         "the outcome is unknown: the batch %s may be "
                         "recorded (its commit's answer was lost)",
                         bt->id);
            else
                snprintf(text, sizeof(text),
                         "cannot record the batch: %s; it was not recorded",
                         ks_strerror(why));
            /* Unknown: the id, to look the batch up by. */
            reply_error_to(b, bt->reply_subject, why, text,
                           why == KS_EINDOUBT ? bt->id : NULL);
            reply_error_to(b, bt->accept_subject, why, text,
                           why == KS_EINDOUBT ? bt->id : NULL);
        } else if (ids && keep) {
            snprintf(keep[k], sizeof(keep[k]), "%s", bt->id);
            ids[k] = keep[k];
            k++;
        }
        ks_log(KS_LOG_WARN,
               bt->accepted_now       ? "batch refused"
               : why == KS_ECONFLICT ? "batch left: another broker drives it"
                                     : "batch left to be rebuilt from the "
                                       "record",
               KS_S("module", "batch"), KS_S("batch_id", bt->id),
               KS_ERR(why));
        batch_drop(m, bt);
    }
    if (k && !b->stopping)
        store_batch_release(b->st_batch, m->owner, ids, k);
    free(ids);
    free(keep);
}

static void
turn(struct broker *b, struct batch **touched, size_t nt)
{
    struct broker__batches *m = b->batches;
    struct plan p = {.b = b, .no_dispatch = b->stopping};
    int rc = 0;

    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < nt && rc == 0; i++)
        rc = plan_batch(&p, touched[i]);
    pthread_mutex_unlock(&m->mu);
    if (rc) {
        ks_log(KS_LOG_ERROR, "batch turn cannot be planned",
               KS_S("module", "batch"), KS_I("batches", nt), KS_ERR(rc));
        plan_release(&p);
        abandon(b, touched, nt, rc);
        return;
    }

    if (p.n) {
        Ks__Event **evs = calloc(p.n, sizeof(*evs));
        struct store_batch_lease *ls = calloc(nt, sizeof(*ls));
        size_t dups = 0;
        int64_t backoff_ms = 100, since = 0;
        char why[512];
        /* An attempt lost the answer to its commit: the turn may be
         * recorded, whatever the last attempt says. */
        bool doubt = false;
        /* Set by the first attempt; a broker stopping before it records
         * nothing and publishes nothing. */
        rc = evs && ls ? KS_ESTOPPED : -ENOMEM;
        for (size_t i = 0; evs && i < p.n; i++)
            evs[i] = &p.slots[i]->ev;
        for (size_t i = 0; ls && i < nt; i++) {
            ls[i].batch_id = touched[i]->id;
            ls[i].reply_subject = touched[i]->reply_subject;
            ls[i].progress_subject = touched[i]->req->progress_subject;
            ls[i].ended = touched[i]->done;
        }
        /* The turn is decided (targets marked dispatched): it must be
         * recorded, under the lease, before anything is published. While
         * PostgreSQL is unreachable or refuses writes, wait for it
         * (backoff to 2 s, one line when it starts, one when it ends);
         * other errors give up after 50; a lease lost or a refused event
         * will not change. */
        for (int tries = 0; evs && ls && tries < 50 && !b->stopping;) {
            rc = store_batch_append(b->st_batch, m->owner, BATCH_LEASE_MS,
                                    ls, nt, (const Ks__Event *const *)evs,
                                    p.n, &dups);
            if (ks_trace_on())
                for (size_t i = 0; i < nt; i++)
                    ks_trace("batch.turn_recorded", touched[i]->id);
            if (rc == 0 || rc == KS_ECONFLICT || rc == KS_EINVAL ||
                rc == KS_ETOOBIG)
                break;
            if (since == 0) {
                since = ks_mono_us();
                ks_log(KS_LOG_WARN, "cannot record a batch turn, retrying",
                       KS_S("module", "batch"), KS_I("events", p.n),
                       KS_S("error", broker__store_error(b->st_batch, rc, why,
                                                         sizeof(why))));
            }
            doubt = doubt || store_in_doubt(b->st_batch);
            /* A sick database (away, or refusing writes: disk full,
             * read-only) is waited for, as long as it lasts. */
            if (!store_db_sick(rc))
                tries++;
            for (int64_t ms = backoff_ms; ms > 0 && !b->stopping; ms -= 100)
                nanosleep(&(struct timespec){0, (ms < 100 ? ms : 100) *
                                                    1000000L},
                          NULL);
            backoff_ms = backoff_ms < 1000 ? backoff_ms * 2 : 2000;
        }
        if (since && rc == 0)
            ks_log(KS_LOG_INFO, "batch turn recorded again",
                   KS_S("module", "batch"),
                   KS_D("after_s", (double)(ks_mono_us() - since) / 1e6));
        free(evs);
        free(ls);
        if (rc) {
            plan_release(&p);
            abandon(b, touched, nt,
                    doubt && rc != KS_ECONFLICT ? KS_EINDOUBT : rc);
            return;
        }
    }
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < nt; i++)
        touched[i]->done_recorded = touched[i]->done;
    pthread_mutex_unlock(&m->mu);
    /* Unrecorded commands are never published: no claim could win. All
     * of the turn's commands at once: one round trip, not one each. */
    if (p.npub) {
        /* Each id through its pool's consumer, or its own. */
        char (*pools)[EVT_AGENT_ID_MAX + 1] = calloc(p.npub, sizeof(*pools));
        const char **pool_of = calloc(p.npub, sizeof(*pool_of));
        for (size_t i = 0; pools && pool_of && i < p.npub; i++) {
            broker__agent_pool(b, p.publish[i]->agent_id, pools[i],
                               sizeof(pools[i]));
            pool_of[i] = pools[i];
        }
        uint64_t *seqs = calloc(p.npub, sizeof(*seqs));
        int failed = evt_publish_commands(
            b->nc, b->signer, p.publish, pools && pool_of ? pool_of : NULL,
            p.npub, EVT_PUBLISH_RETRY_MS, seqs, NULL);
        free(pool_of);
        free(pools);
        if (ks_trace_on())
            for (size_t i = 0; i < p.npub; i++)
                ks_trace("batch.command_published",
                         p.publish[i]->command_id);
        /* Each stored one at its sequence (0: not stored, or no memory
         * to be told: the scanner's deadline sees to a lost delivery). */
        for (size_t i = 0; seqs && i < p.npub; i++)
            if (seqs[i])
                broker__admit_stored(b, p.publish[i]->command_id, seqs[i]);
        free(seqs);
        if (failed)
            ks_log(KS_LOG_WARN,
                   "some commands were not published; the scanner retries "
                   "them",
                   KS_S("module", "batch"), KS_I("commands", p.npub),
                   KS_I("failed", failed));
    }
    plan_release(&p);

    for (size_t i = 0; i < nt; i++) {
        struct batch *bt = touched[i];
        if (bt->accept_subject) {
            send_reply(b, bt, bt->accept_subject);
            free(bt->accept_subject);
            bt->accept_subject = NULL;
        }
        if (bt->accepted_now) {
            bt->accepted_now = false;
            send_progress(b, bt, NULL);
        }
        if (bt->cancel_req && !bt->cancel_sent) {
            bt->cancel_sent = true;
            for (size_t k = 0; k < bt->n; k++)
                if (bt->t[k].status == KS__COMMAND_STATUS__DISPATCHED)
                    broker__cancel_command(b, b->st_batch,
                                           bt->t[k].command_id,
                                           bt->operator_name, NULL);
        }
        for (size_t k = 0; k < bt->n; k++)
            if (bt->t[k].ended_unreported) {
                bt->t[k].ended_unreported = false;
                send_progress(b, bt, &bt->t[k]);
            }
        if (bt->done) {
            if (bt->reply_subject)
                send_reply(b, bt, bt->reply_subject);
            ks_trace("batch.replied", bt->id);
            batch_drop(m, bt);
        }
    }
}

/* ---- rebuilding a batch from the record ----------------------------------- */

struct load {
    const struct store_batch_held *held;
    struct batch *bt;
    struct ks_map idx; /* command id -> target index + 1 */
    bool ended, cancel;
    int rc;
};

/* The batch as BatchRequested recorded it (rec: its recorded event). */
static int
load_requested(struct load *l, const Ks__RecordedEvent *rec)
{
    const Ks__Event *e = rec->event;
    const Ks__BatchSpec *sp = e->batch;
    Ks__BatchRequest req = KS__BATCH_REQUEST__INIT;
    uint8_t *buf = NULL;
    size_t len = 0, n = sp ? sp->n_agents : 0;
    struct batch *bt;

    if (l->bt || !sp || !sp->spec || n == 0 || sp->n_command_ids != n)
        return KS_EDECODE;
    if (!(bt = l->bt = batch_alloc(n)))
        return -ENOMEM;
    snprintf(bt->id, sizeof(bt->id), "%s", l->held->batch_id);
    snprintf(bt->operator_name, sizeof(bt->operator_name), "%s",
             e->operator_ ? e->operator_ : "");
    for (size_t i = 0; i < n; i++) {
        if (!evt_agent_id_valid(sp->agents[i]) ||
            !ks_is_uuid(sp->command_ids[i]))
            return KS_EDECODE;
        snprintf(bt->t[i].agent_id, sizeof(bt->t[i].agent_id), "%s",
                 sp->agents[i]);
        snprintf(bt->t[i].command_id, sizeof(bt->t[i].command_id), "%s",
                 sp->command_ids[i]);
        if (ks_map_put(&l->idx, bt->t[i].command_id, (void *)(i + 1)))
            return -ENOMEM;
    }
    bt->conc = sp->max_concurrency ? sp->max_concurrency : (uint32_t)n;
    bt->max_err = sp->max_errors;
    bt->has_max_err = sp->has_max_errors;
    bt->strict = sp->strict_errors;
    bt->recorded = true;
    if (sp->n_wave_ends) {
        /* Ascending, the last one the target count: else no waves. */
        bool ok = sp->wave_ends[sp->n_wave_ends - 1] == n;
        for (size_t i = 0; ok && i < sp->n_wave_ends; i++)
            ok = sp->wave_ends[i] > (i ? sp->wave_ends[i - 1] : 0);
        if (!ok)
            return KS_EDECODE;
        if (!(bt->wave_ends = calloc(sp->n_wave_ends, sizeof(uint32_t))))
            return -ENOMEM;
        memcpy(bt->wave_ends, sp->wave_ends,
               sp->n_wave_ends * sizeof(uint32_t));
        bt->n_waves = sp->n_wave_ends;
        bt->wave_pause_ms = sp->wave_pause_ms;
    }
    snprintf(bt->rerun_of, sizeof(bt->rerun_of), "%s", sp->rerun_of);
    snprintf(bt->rerun_filter, sizeof(bt->rerun_filter), "%s",
             sp->rerun_filter);
    /* The request as the scheduler uses it: spec, delivery window, and
     * where the waiting client listens (the lease row). Packed and
     * unpacked, so that it is owned like an API request. */
    req.spec = sp->spec;
    req.deliver_within_ms = sp->deliver_within_ms;
    req.progress_subject = (char *)l->held->progress_subject;
    if (kproto_pack(&req.base, &buf, &len))
        return -ENOMEM;
    bt->req = ks__batch_request__unpack(NULL, len, buf);
    free(buf);
    if (!bt->req)
        return -ENOMEM;
    if (l->held->reply_subject[0] &&
        !(bt->reply_subject = strdup(l->held->reply_subject)))
        return -ENOMEM;
    /* Its age, on this host's monotonic clock. */
    bt->start_mono_us = ks_mono_us() - (ks_now_us() - rec->recorded_at_us);
    return 0;
}

static int
load_event(const Ks__RecordedEvent *rec, void *ud)
{
    struct load *l = ud;
    const Ks__Event *e = rec->event;

    if (!e || !e->type)
        return 0;
    if (strcmp(e->type, "BatchRequested") == 0) {
        return l->rc = load_requested(l, rec);
    } else if (strcmp(e->type, "BatchTargetEnded") == 0 && l->bt) {
        uintptr_t i = (uintptr_t)ks_map_get(&l->idx, e->command_id);
        if (i)
            l->bt->t[i - 1].reported = true;
    } else if (strcmp(e->type, "BatchCancelRequested") == 0) {
        l->cancel = true;
    } else if (strcmp(e->type, "BatchWaveStarted") == 0 && l->bt &&
               e->wave >= 1 && e->wave <= l->bt->n_waves) {
        /* The wave a new driver continues (its targets' states are read
         * from the record). */
        l->bt->wave = e->wave;
        l->bt->wave_ended = false;
        l->bt->next_wave_at_us = 0;
    } else if (strcmp(e->type, "BatchWaveEnded") == 0 && l->bt &&
               e->wave == l->bt->wave) {
        l->bt->wave_ended = true;
        l->bt->next_wave_at_us = e->next_wave_at_us;
        if (e->halted) {
            l->bt->halted = true;
            l->bt->halted_wave = e->wave;
            snprintf(l->bt->halt_reason, sizeof(l->bt->halt_reason), "%s",
                     e->reason);
        }
    } else if (strcmp(e->type, "BatchCompleted") == 0 ||
               strcmp(e->type, "BatchCancelled") == 0) {
        l->ended = true;
    }
    return 0;
}

/* A target's state in the record, before it is applied to the batch. */
struct seen {
    size_t i;
    Ks__CommandStatus status;
    uint32_t attempt;
    Ks__CommandResult *result; /* owned */
};

struct seen_acc {
    struct ks_map *idx;
    struct seen *v;
    size_t n;
};

static int
collect_state(const struct store_command_row *c, void *ud)
{
    struct seen_acc *a = ud;
    uintptr_t i = (uintptr_t)ks_map_get(a->idx, c->command_id);
    if (!i)
        return 0;
    a->v[a->n].i = i - 1;
    a->v[a->n].status = c->status;
    a->v[a->n].attempt = c->attempt;
    a->n++;
    return 0;
}

/*
 * The result of an ended command, from the commands projection (NULL when
 * it cannot be read: the status is what counts). Its status is the
 * projection's: the first terminal one.
 */
static Ks__CommandResult *
read_result(struct store *st, const char *command_id, Ks__CommandStatus s)
{
    Ks__CommandView *v = NULL;
    Ks__CommandResult *r = NULL;
    if (store_get_command(st, command_id, &v) == 0 && v->result) {
        r = v->result;
        v->result = NULL;
        r->status = s;
    }
    if (v)
        ks__command_view__free_unpacked(v, NULL);
    return r;
}

/*
 * Rebuilds an open batch that this broker now holds the lease of, from the
 * record, and makes it live here. 0 with *out, KS_ENOTFOUND (no such
 * batch, or it has ended), KS_EDECODE (a BatchRequested kscore cannot
 * drive), KS_EPG, -ENOMEM.
 */
static int
batch_load(struct broker *b, const struct store_batch_held *held,
           struct batch **out)
{
    struct broker__batches *m = b->batches;
    struct store *st = b->st_batch;
    struct load l = {.held = held, .idx = KS_MAP_INIT};
    struct seen_acc acc = {.idx = &l.idx};
    struct batch *bt;
    bool live = false;
    int rc;

    rc = store_read_stream(st, held->batch_id, 0, 0, load_event, &l);
    if (rc == 0 && !l.bt)
        rc = KS_ENOTFOUND;
    if (rc == 0 && l.ended)
        rc = KS_ENOTFOUND;
    if (rc)
        goto out;
    bt = l.bt;
    if (l.cancel || held->cancel_requested)
        bt->cancel_req = true;

    /* Live before the targets are read: an end recorded from now on
     * reaches it as a job, one recorded before is in the read below (and
     * one seen both ways counts once: target_end). */
    pthread_mutex_lock(&m->mu);
    rc = ks_map_get(&m->live, bt->id) ? KS_ECONFLICT : batch_register(m, bt);
    pthread_mutex_unlock(&m->mu);
    if (rc)
        goto out;
    live = true;

    if (!(acc.v = calloc(bt->n, sizeof(*acc.v)))) {
        rc = -ENOMEM;
        goto out;
    }
    rc = store_command_states(st, (const char *const *)bt->cmd_ptrs, bt->n,
                              0, collect_state, &acc);
    if (rc)
        goto out;
    /* What ended unseen by any driver is reported now, with its result. */
    for (size_t k = 0; k < acc.n; k++) {
        struct seen *s = &acc.v[k];
        /* A Failed one's result too: killed or failed (count_end). */
        if (kproto_status_terminal(s->status) &&
            (!bt->t[s->i].reported ||
             s->status == KS__COMMAND_STATUS__FAILED))
            s->result = read_result(st, bt->t[s->i].command_id, s->status);
    }
    pthread_mutex_lock(&m->mu);
    for (size_t k = 0; k < acc.n; k++) {
        struct seen *s = &acc.v[k];
        struct btarget *t = &bt->t[s->i];
        if (t->status != KS__COMMAND_STATUS__PENDING)
            continue; /* a job got there first */
        if (kproto_status_terminal(s->status)) {
            target_end(bt, t, s->status, s->attempt == 0, s->result,
                       !t->reported);
        } else {
            t->status = KS__COMMAND_STATUS__DISPATCHED;
            bt->running++;
            if (s->result)
                ks__command_result__free_unpacked(s->result, NULL);
        }
        s->result = NULL;
    }
    /* A cancel that reached the previous driver may not have reached
     * every running target. */
    bt->cancel_sent = false;
    pthread_mutex_unlock(&m->mu);
    *out = bt;
    l.bt = NULL;
out:
    if (l.bt) {
        if (live) {
            pthread_mutex_lock(&m->mu);
            batch_unregister(m, l.bt);
            pthread_mutex_unlock(&m->mu);
        }
        batch_free(l.bt);
    }
    for (size_t k = 0; acc.v && k < acc.n; k++)
        if (acc.v[k].result)
            ks__command_result__free_unpacked(acc.v[k].result, NULL);
    free(acc.v);
    ks_map_clear(&l.idx);
    return rc;
}

/* ---- the periodic work: leases, remote ends, adoption --------------------- */

struct touched {
    struct batch **v;
    size_t n, cap;
};

static void
touch(struct touched *t, struct batch *bt)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i] == bt)
            return;
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 16;
        void *x = realloc(t->v, nc * sizeof(*t->v));
        if (!x)
            return; /* the next tick or job touches it again */
        t->v = x;
        t->cap = nc;
    }
    t->v[t->n++] = bt;
}

/* Live batches in a snapshot: the scheduler thread alone frees them, so
 * the pointers outlive the lock. */
struct snapshot {
    bool all; /* also batches not recorded yet */
    struct batch **v;
    bool *held;
    size_t n, cap;
    int rc;
};

static void
snap_one(const char *key, void *val, void *ud)
{
    struct snapshot *s = ud;
    struct batch *bt = val;
    (void)key;
    if ((!bt->recorded && !s->all) || s->rc)
        return; /* its lease row comes with its first commit */
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 16;
        void *x = realloc(s->v, nc * sizeof(*s->v));
        if (!x) {
            s->rc = -ENOMEM;
            return;
        }
        s->v = x;
        s->cap = nc;
    }
    s->v[s->n++] = bt;
}

struct renew_ctx {
    struct broker__batches *m;
    struct snapshot *snap;
    struct touched *touched;
};

static int
on_renewed(const struct store_batch_held *h, void *ud)
{
    struct renew_ctx *c = ud;
    for (size_t i = 0; i < c->snap->n; i++) {
        struct batch *bt = c->snap->v[i];
        if (strcmp(bt->id, h->batch_id) != 0)
            continue;
        c->snap->held[i] = true;
        if (h->cancel_requested && !bt->cancel_req) {
            /* `kscore cancel` reached another broker, whose cancel notice
             * has not come (yet, or at all): said, so that a notice that
             * never comes shows (test_batch cancel_through_either_broker). */
            pthread_mutex_lock(&c->m->mu);
            bt->cancel_req = true;
            pthread_mutex_unlock(&c->m->mu);
            ks_log(KS_LOG_INFO,
                   "batch cancel found at the lease renewal (its notice has "
                   "not come)",
                   KS_S("module", "batch"), KS_S("batch", bt->id));
            touch(c->touched, bt);
        }
        break;
    }
    return 0;
}

static void
renew_leases(struct broker *b, struct snapshot *snap, struct touched *tt)
{
    struct broker__batches *m = b->batches;
    const char **ids = calloc(snap->n ? snap->n : 1, sizeof(*ids));
    struct renew_ctx c = {m, snap, tt};
    int rc;

    if (!ids || !(snap->held = calloc(snap->n ? snap->n : 1, 1))) {
        free(ids);
        return;
    }
    for (size_t i = 0; i < snap->n; i++)
        ids[i] = snap->v[i]->id;
    rc = store_batch_renew(b->st_batch, m->owner, BATCH_LEASE_MS, ids,
                           snap->n, on_renewed, &c);
    free(ids);
    if (rc)
        return; /* nothing known: keep them, try again next tick */
    for (size_t i = 0; i < snap->n; i++) {
        if (snap->held[i]) {
            /* A heartbeat to the waiting client: the batch has a driver
             * (and its id, should the first message have been lost). */
            send_progress(b, snap->v[i], NULL);
            continue;
        }
        ks_log(KS_LOG_WARN, "batch lease lost; another broker drives it",
               KS_S("module", "batch"), KS_S("batch_id", snap->v[i]->id));
        for (size_t k = 0; k < tt->n; k++)
            if (tt->v[k] == snap->v[i])
                tt->v[k] = tt->v[--tt->n];
        batch_drop(m, snap->v[i]);
        snap->v[i] = NULL;
    }
}

struct ended_ctx {
    struct broker *b;
    struct touched *touched;
};

static int
on_remote_end(const struct store_command_row *c, void *ud)
{
    struct ended_ctx *x = ud;
    struct broker__batches *m = x->b->batches;
    Ks__CommandResult *r = read_result(x->b->st_batch, c->command_id,
                                       c->status);
    pthread_mutex_lock(&m->mu);
    struct batch *bt = ks_map_get(&m->by_cmd, c->command_id);
    struct btarget *t = bt ? target_of(bt, c->command_id) : NULL;
    if (t && target_end(bt, t, c->status, c->attempt == 0, r, true))
        touch(x->touched, bt);
    else if (!t && r)
        ks__command_result__free_unpacked(r, NULL);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

/* Targets in flight whose end is in the record: ended through another
 * broker (its recorder, claim handler or scanner), or while this one
 * could not hear of it. */
static void
poll_ends(struct broker *b, struct snapshot *snap, struct touched *tt)
{
    const char **ids = NULL;
    size_t n = 0, cap = 0;
    struct ended_ctx x = {b, tt};

    for (size_t i = 0; i < snap->n; i++) {
        struct batch *bt = snap->v[i];
        for (size_t k = 0; bt && k < bt->n; k++) {
            if (bt->t[k].status != KS__COMMAND_STATUS__DISPATCHED)
                continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 64;
                void *p = realloc(ids, nc * sizeof(*ids));
                if (!p)
                    goto out;
                ids = p;
                cap = nc;
            }
            ids[n++] = bt->t[k].command_id;
        }
    }
    if (n)
        store_command_states(b->st_batch, ids, n, 1, on_remote_end, &x);
out:
    free(ids);
}

/* Leases taken over, copied out of the result for batch_load. */
struct adopted {
    char batch_id[48];
    char *reply, *progress;
    bool cancel;
};

struct adopt_acc {
    struct adopted *v;
    size_t n;
};

static int
on_adopted(const struct store_batch_held *h, void *ud)
{
    struct adopt_acc *a = ud;
    struct adopted *x = &a->v[a->n];
    if (a->n >= BATCH_ADOPT_LIMIT || strlen(h->batch_id) >= sizeof(x->batch_id))
        return 0;
    snprintf(x->batch_id, sizeof(x->batch_id), "%s", h->batch_id);
    x->reply = strdup(h->reply_subject);
    x->progress = strdup(h->progress_subject);
    x->cancel = h->cancel_requested;
    a->n++;
    return 0;
}

static void
adopt(struct broker *b, struct touched *tt)
{
    struct broker__batches *m = b->batches;
    struct adopt_acc a = {calloc(BATCH_ADOPT_LIMIT, sizeof(*a.v)), 0};

    if (!a.v)
        return;
    if (store_batch_adopt(b->st_batch, m->owner, BATCH_LEASE_MS,
                          BATCH_ADOPT_LIMIT, on_adopted, &a) == 0) {
        for (size_t i = 0; i < a.n; i++) {
            struct adopted *x = &a.v[i];
            struct store_batch_held h = {x->batch_id, x->reply ? x->reply : "",
                                         x->progress ? x->progress : "",
                                         x->cancel};
            struct batch *bt = NULL;
            pthread_mutex_lock(&m->mu);
            bool here = ks_map_get(&m->live, x->batch_id) != NULL;
            pthread_mutex_unlock(&m->mu);
            if (here)
                continue; /* this broker's own lease, renewed late */
            int rc = batch_load(b, &h, &bt);
            if (rc == 0) {
                ks_log(KS_LOG_INFO, "batch adopted", KS_S("module", "batch"),
                       KS_S("batch_id", bt->id), KS_I("running", bt->running),
                       KS_I("ended", bt->ended), KS_I("targets", bt->n));
                touch(tt, bt);
            } else {
                /* Its lease runs out and the next adoption tries again. */
                ks_log(KS_LOG_WARN, "cannot adopt a batch",
                       KS_S("module", "batch"), KS_S("batch_id", x->batch_id),
                       KS_ERR(rc));
            }
        }
    }
    for (size_t i = 0; i < a.n; i++) {
        free(a.v[i].reply);
        free(a.v[i].progress);
    }
    free(a.v);
}

/*
 * Targets whose end another broker recorded and noticed (JOB_REMOTE, the
 * n ids): each still in flight here is read from the record now, not at
 * the next tick (poll_ends then skips it: it has ended here). One read per
 * target, at this broker only.
 */
static void
remote_ends(struct broker *b, const char *const *ids, size_t n,
            struct touched *tt)
{
    struct broker__batches *m = b->batches;

    for (size_t i = 0; i < n; i++) {
        Ks__CommandView *v = NULL;
        pthread_mutex_lock(&m->mu);
        struct batch *bt = ks_map_get(&m->by_cmd, ids[i]);
        struct btarget *t = bt ? target_of(bt, ids[i]) : NULL;
        bool in_flight = t && t->status == KS__COMMAND_STATUS__DISPATCHED;
        pthread_mutex_unlock(&m->mu);
        if (!in_flight || store_get_command(b->st_batch, ids[i], &v) != 0)
            continue; /* a failed read: the tick reads it again */
        if (kproto_status_terminal(v->status)) {
            Ks__CommandResult *r = v->result;
            v->result = NULL;
            if (r)
                r->status = v->status;
            pthread_mutex_lock(&m->mu);
            bt = ks_map_get(&m->by_cmd, ids[i]);
            t = bt ? target_of(bt, ids[i]) : NULL;
            if (t && target_end(bt, t, v->status, false, r, true))
                touch(tt, bt);
            else if (!t && r)
                ks__command_result__free_unpacked(r, NULL);
            pthread_mutex_unlock(&m->mu);
        }
        ks__command_view__free_unpacked(v, NULL);
    }
}

static void
maintain(struct broker *b)
{
    struct broker__batches *m = b->batches;
    struct snapshot snap = {0};
    struct touched tt = {0};

    pthread_mutex_lock(&m->mu);
    ks_map_each(&m->live, snap_one, &snap);
    pthread_mutex_unlock(&m->mu);
    if (snap.rc == 0 && snap.n) {
        renew_leases(b, &snap, &tt);
        poll_ends(b, &snap, &tt);
        /* A wave whose pause is over starts (the scheduler alone writes
         * these fields); and a batch with targets waiting for room
         * (paced: admit.c had none for them at its last turn) tries
         * again. Only its own targets' ends brought it a turn, so one
         * that had none running waited for good while other batches'
         * ends freed the agents' queues (make chaos cluster_node_kill
         * and cluster_broker_kill: 5 batches of 200 on one pool of 64
         * slots, the fifth never dispatched, I4). */
        for (size_t i = 0; i < snap.n; i++)
            if (snap.v[i] && !snap.v[i]->done &&
                ((snap.v[i]->wave_ended && wave_due(snap.v[i])) ||
                 may_dispatch(snap.v[i])))
                touch(&tt, snap.v[i]);
    }
    if (!b->stopping)
        adopt(b, &tt);
    if (tt.n)
        turn(b, tt.v, tt.n);
    free(snap.v);
    free(snap.held);
    free(tt.v);
}

/* Frees a list of jobs; a new batch still in one never started: its
 * client is told why (code, text). */
static void
free_jobs(struct broker *b, struct job *j, int code, const char *text)
{
    while (j) {
        struct job *next = j->next;
        if (j->batch) {
            reply_error_to(b, j->batch->reply_subject, code, text, NULL);
            reply_error_to(b, j->batch->accept_subject, code, text, NULL);
            batch_free(j->batch);
        }
        if (j->result)
            ks__command_result__free_unpacked(j->result, NULL);
        free(j);
        j = next;
    }
}

/*
 * The broker is stopping (its in-process agents first): dispatch nothing
 * more onto it. Every batch driven here is dropped and its lease released,
 * so the broker that takes over (another one, or this one restarted)
 * continues it from the record at once; ends recorded meanwhile are read
 * there. New batches are refused from now on.
 */
static void
hand_over(struct broker *b)
{
    struct broker__batches *m = b->batches;
    struct snapshot snap = {.all = true};

    pthread_mutex_lock(&m->mu);
    m->handed_over = true;
    ks_map_each(&m->live, snap_one, &snap);
    pthread_mutex_unlock(&m->mu);
    for (size_t i = 0; i < snap.n; i++) {
        struct batch *bt = snap.v[i];
        if (!bt->recorded) { /* never recorded: it does not exist */
            reply_error_to(b, bt->reply_subject, KS_ESTOPPED,
                           "the broker is stopping", NULL);
            reply_error_to(b, bt->accept_subject, KS_ESTOPPED,
                           "the broker is stopping", NULL);
        }
        batch_drop(m, bt);
    }
    if (snap.n)
        ks_log(KS_LOG_INFO, "stopping: batches left to the next broker",
               KS_S("module", "batch"), KS_I("batches", snap.n));
    store_batch_release(b->st_batch, m->owner, NULL, 0);
    free(snap.v);
}

static void *
scheduler_main(void *arg)
{
    struct broker *b = arg;
    struct broker__batches *m = b->batches;
    int64_t next_tick = ks_mono_us(); /* adopt at start */

    for (;;) {
        struct job *jobs;
        struct touched tt = {0};
        pthread_mutex_lock(&m->mu);
        while (!m->head && !m->stopping && ks_mono_us() < next_tick) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t wait_us = next_tick - ks_mono_us();
            if (wait_us <= 0)
                break;
            ts.tv_sec += wait_us / 1000000;
            ts.tv_nsec += (wait_us % 1000000) * 1000;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&m->cond, &m->mu, &ts);
        }
        if (!m->head && m->stopping) {
            pthread_mutex_unlock(&m->mu);
            break;
        }
        jobs = m->head;
        m->head = NULL;
        m->tail = &m->head;
        size_t nremote = 0;
        for (struct job *j = jobs; j; j = j->next) {
            struct batch *bt = apply_job(m, j);
            if (bt && !bt->done)
                touch(&tt, bt);
            nremote += j->kind == JOB_REMOTE;
        }
        pthread_mutex_unlock(&m->mu);
        if (nremote) {
            const char **ids = malloc(nremote * sizeof(*ids));
            size_t k = 0;
            for (struct job *j = jobs; ids && j; j = j->next)
                if (j->kind == JOB_REMOTE)
                    ids[k++] = j->command_id;
            if (ids)
                remote_ends(b, ids, k, &tt);
            free(ids);
        }
        if (tt.n)
            turn(b, tt.v, tt.n);
        free(tt.v);
        free_jobs(b, jobs, m->handed_over ? KS_ESTOPPED : -ENOMEM,
                  m->handed_over ? "the broker is stopping"
                                 : "out of memory");
        if (b->stopping && !m->handed_over)
            hand_over(b);
        if (ks_mono_us() >= next_tick) {
            if (!m->stopping && !m->handed_over)
                maintain(b);
            next_tick = ks_mono_us() + (int64_t)BATCH_TICK_MS * 1000;
        }
    }
    return NULL;
}

static void
push_job(struct broker__batches *m, struct job *j)
{
    j->next = NULL;
    *m->tail = j;
    m->tail = &j->next;
    pthread_cond_signal(&m->cond);
}

int
broker__batch_target_ended(struct broker *b, const char *command_id,
                           const Ks__CommandResult *result)
{
    struct broker__batches *m = b->batches;
    struct job *j;

    if (!m)
        return 0;
    pthread_mutex_lock(&m->mu);
    if (m->stopping || !ks_map_get(&m->by_cmd, command_id)) {
        /* Not a target of a batch driven here: its driver reads the end
         * from the record (poll_ends). */
        pthread_mutex_unlock(&m->mu);
        return 0;
    }
    j = calloc(1, sizeof(*j));
    if (j) {
        j->kind = JOB_ENDED;
        snprintf(j->command_id, sizeof(j->command_id), "%s", command_id);
        j->result = copy_result(result);
        push_job(m, j);
    }
    pthread_mutex_unlock(&m->mu);
    return 1;
}

int
broker__batch_remote_end(struct broker *b, const char *command_id)
{
    struct broker__batches *m = b->batches;
    struct job *j;
    int here = 0;

    if (!m)
        return 0;
    j = calloc(1, sizeof(*j));
    if (!j)
        return 0; /* the tick reads it */
    j->kind = JOB_REMOTE;
    snprintf(j->command_id, sizeof(j->command_id), "%s", command_id);
    pthread_mutex_lock(&m->mu);
    if (!m->stopping && !m->handed_over &&
        ks_map_get(&m->by_cmd, command_id)) {
        push_job(m, j);
        j = NULL;
        here = 1;
    }
    pthread_mutex_unlock(&m->mu);
    free(j);
    return here;
}

void
broker__batch_remote_cancel(struct broker *b, const char *batch_id)
{
    struct broker__batches *m = b->batches;
    struct job *j;

    if (!m || !(j = calloc(1, sizeof(*j))))
        return;
    j->kind = JOB_CANCEL;
    snprintf(j->batch_id, sizeof(j->batch_id), "%s", batch_id);
    pthread_mutex_lock(&m->mu);
    bool here = !m->stopping && ks_map_get(&m->live, batch_id);
    if (here) {
        push_job(m, j);
        j = NULL;
    }
    pthread_mutex_unlock(&m->mu);
    free(j);
    /* Cancels are few: each notice is said (whether it came before the
     * lease renewal found the cancel, or after; driving: the batch runs
     * here still). */
    ks_log(KS_LOG_INFO, "batch cancel notice", KS_S("module", "batch"),
           KS_S("batch", batch_id), KS_I("driving", here));
}

int
broker__batch_cancel(struct broker *b, const char *batch_id,
                     const char *operator_name)
{
    struct broker__batches *m = b->batches;
    char evid[37], stream[48];
    Ks__Event ev;
    int rc;

    /* Recorded first, whoever drives the batch: its driver (here, or
     * another broker at its next renewal, or the one that adopts it)
     * cancels from the record. */
    snprintf(stream, sizeof(stream), "%s", batch_id);
    broker__event_init(&ev, evid, stream, "BatchCancelRequested", NULL);
    ev.batch_id = stream;
    ev.operator_ = (char *)(operator_name ? operator_name : "");
    ev.reason = "cancel requested";
    pthread_mutex_lock(&m->api_mu);
    rc = m->st_api ? store_batch_request_cancel(m->st_api, &ev) : KS_ESTOPPED;
    pthread_mutex_unlock(&m->api_mu);
    if (rc)
        return rc;
    /* Driven here: at once, not at the next renewal; driven by another
     * broker: that one hears of it at once (notice.c). */
    struct job *j = calloc(1, sizeof(*j));
    bool here = false;
    if (!j)
        return 0;
    j->kind = JOB_CANCEL;
    snprintf(j->batch_id, sizeof(j->batch_id), "%s", batch_id);
    pthread_mutex_lock(&m->mu);
    if (ks_map_get(&m->live, batch_id)) {
        push_job(m, j);
        j = NULL;
        here = true;
    }
    pthread_mutex_unlock(&m->mu);
    free(j);
    if (!here)
        broker__notice_batch_cancel(b, batch_id);
    return 0;
}

/* ---- the API handler ----------------------------------------------------- */

struct resolve {
    struct broker *b;
    const Ks__BatchRequest *req;
    char **terms; /* selector terms (request_terms) */
    size_t n_terms;
    char **ids;
    size_t n, cap;
    struct ks_map seen;
    int64_t now_mono;
    bool deaf; /* broker__registry_deaf: nobody is left out as offline */
};

static int
add_target(struct resolve *r, const char *id)
{
    if (ks_map_get(&r->seen, id))
        return 0;
    if (r->n == r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 16;
        void *x = realloc(r->ids, nc * sizeof(*r->ids));
        if (!x)
            return -ENOMEM;
        r->ids = x;
        r->cap = nc;
    }
    if (!(r->ids[r->n] = strdup(id)))
        return -ENOMEM;
    r->n++;
    return ks_map_put(&r->seen, id, (void *)1);
}

/* Every selector term of the request: the terms (BatchRequest.selector)
 * and the older exact pairs (select, as "K=V"). NULL-free array of n. */
static char **
request_terms(const Ks__BatchRequest *req, size_t *n)
{
    size_t k = req->n_selector + req->n_select;
    char **v = calloc(k ? k : 1, sizeof(*v));
    *n = 0;
    if (!v)
        return NULL;
    for (size_t i = 0; i < req->n_selector; i++)
        v[(*n)++] = strdup(req->selector[i]);
    for (size_t i = 0; i < req->n_select; i++) {
        char *t = NULL;
        if (asprintf(&t, "%s=%s", req->select[i]->name,
                     req->select[i]->value) < 0)
            t = NULL;
        v[(*n)++] = t;
    }
    for (size_t i = 0; i < *n; i++)
        if (!v[i]) {
            for (size_t j = 0; j < *n; j++)
                free(v[j]);
            free(v);
            return NULL;
        }
    return v;
}

/* Registered agents matching --all / --select (online or not: an offline
 * one ends "no response"; online_only leaves it out), sorted below. */
static void
collect_matching(const char *key, void *val, void *ud)
{
    struct resolve *r = ud;
    struct broker__agent *a = val;
    if (r->req->online_only && !r->deaf &&
        r->now_mono - broker__heard_locked(r->b, a) >=
            (int64_t)EVT_AGENT_TTL_MS * 1000)
        return;
    if (!broker_select_match(a->info, r->terms, r->n_terms))
        return;
    add_target(r, key);
}

static int
cmp_str(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

static void
reply_batch_error(struct broker *b, natsMsg *msg, int code, const char *text)
{
    Ks__BatchReply r = KS__BATCH_REPLY__INIT;
    r.error_code = code;
    r.error = (char *)text;
    const char *subj = natsMsg_GetReply(msg);
    if (subj)
        evt_publish_msg(b->nc, subj, &r.base);
}

/* --dry-run: the resolved targets, each with its online state; nothing
 * recorded. */
static void
reply_dry_run(struct broker *b, natsMsg *msg, const struct resolve *r)
{
    Ks__BatchReply rep = KS__BATCH_REPLY__INIT;
    Ks__BatchCounts c = KS__BATCH_COUNTS__INIT;
    Ks__BatchTarget *ts = calloc(r->n, sizeof(*ts));
    Ks__BatchTarget **tv = calloc(r->n, sizeof(*tv));
    const char *subj = natsMsg_GetReply(msg);
    if (!ts || !tv) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < r->n; i++) {
        int64_t hb = 0;
        ks__batch_target__init(&ts[i]);
        ts[i].agent_id = r->ids[i];
        ts[i].command_id = "";
        ts[i].status = KS__COMMAND_STATUS__PENDING;
        ts[i].online = broker__agent_presence(b, r->ids[i], &hb) == 1;
        ts[i].last_seen_us = hb;
        tv[i] = &ts[i];
    }
    c.total = c.pending = (uint32_t)r->n;
    rep.counts = &c;
    rep.targets = tv;
    rep.n_targets = r->n;
    rep.status = KS__BATCH_STATUS__BATCH_STATUS_UNSPECIFIED;
    rep.max_concurrency = resolve_amount(r->req->max_concurrency, r->n, true);
    rep.max_errors = resolve_amount(r->req->max_errors, r->n, false);
    rep.has_max_errors = r->req->max_errors != NULL;
    if (subj) /* in parts when a fleet's list is larger than one message */
        evt_publish_reply(b->nc, subj, &rep.base);
out:
    free(ts);
    free(tv);
}

/*
 * The index after each wave's last target, for n targets in waves of the
 * sizes w (nw >= 1): each a count or a percentage of n rounded down, at
 * least 1, as Ansible's serial reads them; the last size repeats until
 * every target has had its turn. 0 with *out (malloc'd, *n_out entries,
 * ascending, the last n) or -ENOMEM.
 */
static int
resolve_waves(Ks__Amount *const *w, size_t nw, size_t n, uint32_t **out,
              size_t *n_out)
{
    uint32_t *ends = NULL;
    size_t k = 0, done = 0, cap = 0;

    while (done < n) {
        const Ks__Amount *a = w[k < nw ? k : nw - 1];
        uint64_t size = a->percent ? (uint64_t)n * a->value / 100 : a->value;
        if (size == 0)
            size = 1;
        done = size >= n - done ? n : done + (size_t)size;
        if (k == cap) {
            size_t nc = cap ? cap * 2 : 8;
            uint32_t *x = realloc(ends, nc * sizeof(*x));
            if (!x) {
                free(ends);
                return -ENOMEM;
            }
            ends = x;
            cap = nc;
        }
        ends[k++] = (uint32_t)done;
    }
    *out = ends;
    *n_out = k;
    return 0;
}

/* ---- kscore batch --rerun ------------------------------------------------ */

/* The original batch as its stream has it. */
struct rerun_src {
    Ks__Event *requested; /* its BatchRequested, owned */
    bool ended;
    int rc;
};

static int
rerun_read(const Ks__RecordedEvent *rec, void *ud)
{
    struct rerun_src *o = ud;
    const Ks__Event *e = rec->event;
    uint8_t *buf = NULL;
    size_t len = 0;

    if (!e || !e->type)
        return 0;
    if (strcmp(e->type, "BatchRequested") == 0 && e->batch && !o->requested) {
        if (kproto_pack(&e->base, &buf, &len) != 0 ||
            !(o->requested = ks__event__unpack(NULL, len, buf))) {
            free(buf);
            return o->rc = -ENOMEM;
        }
        free(buf);
    } else if (strcmp(e->type, "BatchCompleted") == 0 ||
               strcmp(e->type, "BatchCancelled") == 0) {
        o->ended = true;
    }
    return 0;
}

struct rerun_pick {
    struct ks_map want; /* command id -> agent index + 1, picked */
    const Ks__BatchSpec *sp;
    bool not_succeeded;
};

static int
rerun_state(const struct store_command_row *c, void *ud)
{
    struct rerun_pick *pk = ud;
    /* --failed: the ends the error budget counts (every one but
     * Succeeded and Cancelled); --not-succeeded: Cancelled as well. */
    bool pick = c->status != KS__COMMAND_STATUS__SUCCEEDED &&
                (pk->not_succeeded ||
                 c->status != KS__COMMAND_STATUS__CANCELLED);
    if (!pick)
        ks_map_del(&pk->want, c->command_id);
    return 0;
}

/* A count as an Amount of the request (owned by it, freed with it). */
static Ks__Amount *
amount_of(uint32_t v)
{
    Ks__Amount *a = malloc(sizeof(*a));
    if (a) {
        ks__amount__init(a);
        a->value = v;
    }
    return a;
}

/*
 * kscore batch --rerun: fills req (its targets must be empty) from the
 * batch req->rerun_of: its spec, and its options where req gives none
 * (max_concurrency, max_errors and the waves as the counts it resolved
 * them to, strict, the delivery window, the pause), and adds to r the
 * targets that did not succeed (see rerun_state). The original must have
 * ended, be readable by op, and, when its command has secret variables
 * (sealed for its operator), be op's own. 0 or a code with why.
 */
static int
rerun_prepare(struct broker *b, struct store *st, natsMsg *msg,
              Ks__BatchRequest *req, struct resolve *r, char *why,
              size_t len)
{
    struct rerun_src o = {0};
    struct rerun_pick pk = {.want = KS_MAP_INIT,
                            .not_succeeded = req->rerun_not_succeeded};
    const char *op = broker__operator_of(msg);
    uint8_t *buf = NULL;
    size_t blen = 0;
    int rc;

    if (!broker__is_batch_id(req->rerun_of)) {
        snprintf(why, len, "bad --rerun '%s': expected batch-<uuid>",
                 req->rerun_of);
        return KS_EINVAL;
    }
    if (req->n_agents || req->n_select || req->n_selector || req->all) {
        snprintf(why, len,
                 "--rerun takes no targets: they are those of %s that did "
                 "not succeed",
                 req->rerun_of);
        return KS_EINVAL;
    }
    if ((rc = broker__may_read(b, st, msg, req->rerun_of, why, len)))
        return rc;
    rc = store_read_stream(st, req->rerun_of, 0, 0, rerun_read, &o);
    if (rc == 0)
        rc = o.rc;
    if (rc) {
        broker__store_error(st, rc, why, len);
        goto out;
    }
    if (!o.requested) {
        rc = KS_ENOTFOUND;
        snprintf(why, len, "no batch %s", req->rerun_of);
        goto out;
    }
    if (!o.ended) {
        rc = KS_EINVAL;
        snprintf(why, len,
                 "%s is still running: rerun it once it has ended (kscore "
                 "get %s)",
                 req->rerun_of, req->rerun_of);
        goto out;
    }
    const Ks__BatchSpec *sp = o.requested->batch;
    if (!sp->spec || sp->n_agents != sp->n_command_ids) {
        rc = KS_EDECODE;
        snprintf(why, len, "%s: its record cannot be rerun", req->rerun_of);
        goto out;
    }
    /* Secret values are sealed for the operator who asked (events/seal.c):
     * another operator's rerun could not open them. */
    if (sp->spec->n_sealed_env && strcmp(op, o.requested->operator_) != 0) {
        rc = KS_EINVAL;
        snprintf(why, len,
                 "%s has secret variables sealed for operator '%s': only "
                 "'%s' can rerun it (or run a new batch)",
                 req->rerun_of, o.requested->operator_,
                 o.requested->operator_);
        goto out;
    }
    for (size_t i = 0; i < sp->n_agents; i++)
        if ((rc = ks_map_put(&pk.want, sp->command_ids[i], (void *)(i + 1))))
            goto out;
    rc = store_command_states(st, (const char *const *)sp->command_ids,
                              sp->n_command_ids, 1, rerun_state, &pk);
    if (rc) {
        broker__store_error(st, rc, why, len);
        goto out;
    }
    /* In the original's order; each still known (not revoked since), as
     * --agents would have it. */
    why[0] = '\0';
    for (size_t i = 0; rc == 0 && i < sp->n_agents; i++) {
        if (!ks_map_get(&pk.want, sp->command_ids[i]))
            continue;
        if (!broker__agent_known(b, sp->agents[i])) {
            size_t used = strlen(why);
            snprintf(why + used, len - used, "%s%s",
                     used ? ", " : "unknown agent(s) (revoked since?): ",
                     sp->agents[i]);
            continue;
        }
        rc = add_target(r, sp->agents[i]);
    }
    if (rc == 0 && why[0])
        rc = KS_ENOAGENT;
    if (rc)
        goto out;
    if (r->n == 0) {
        rc = KS_ENOAGENT;
        snprintf(why, len, "no targets: no target of %s %s", req->rerun_of,
                 req->rerun_not_succeeded ? "ended other than Succeeded"
                                          : "ended in error (--not-succeeded "
                                            "takes the cancelled ones too)");
        goto out;
    }
    /* Its command, exactly: the spec as recorded (script, stdin, files,
     * run-as and secret boxes included). */
    if ((rc = kproto_pack(&sp->spec->base, &buf, &blen)) != 0)
        goto out;
    Ks__CommandSpec *spec = ks__command_spec__unpack(NULL, blen, buf);
    free(buf);
    if (!spec) {
        rc = -ENOMEM;
        goto out;
    }
    if (req->spec)
        ks__command_spec__free_unpacked(req->spec, NULL);
    req->spec = spec;
    /* Its options, unless given again. */
    if (!req->max_concurrency && sp->max_concurrency < sp->n_agents &&
        !(req->max_concurrency = amount_of(sp->max_concurrency)))
        rc = -ENOMEM;
    if (rc == 0 && !req->max_errors && sp->has_max_errors &&
        !(req->max_errors = amount_of(sp->max_errors)))
        rc = -ENOMEM;
    req->strict_errors = req->strict_errors || sp->strict_errors;
    if (!req->deliver_within_ms)
        req->deliver_within_ms = sp->deliver_within_ms;
    if (rc == 0 && !req->n_waves && sp->n_wave_ends) {
        /* The original's wave sizes, in turn (the last repeats). */
        req->waves = calloc(sp->n_wave_ends, sizeof(*req->waves));
        for (size_t i = 0; req->waves && i < sp->n_wave_ends; i++) {
            uint32_t size = sp->wave_ends[i] - (i ? sp->wave_ends[i - 1] : 0);
            if (!(req->waves[i] = amount_of(size)))
                break;
            req->n_waves++;
        }
        if (req->n_waves != sp->n_wave_ends)
            rc = -ENOMEM;
        if (!req->wave_pause_ms)
            req->wave_pause_ms = sp->wave_pause_ms;
    }
out:
    if (o.requested)
        ks__event__free_unpacked(o.requested, NULL);
    ks_map_clear(&pk.want);
    if (rc == -ENOMEM)
        snprintf(why, len, "out of memory");
    return rc;
}

void
broker__on_batch(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                 void *ud)
{
    struct broker *b = ud;
    struct broker__batches *m = b->batches;
    Ks__BatchRequest *req = NULL;
    struct resolve r = {.b = b, .seen = KS_MAP_INIT};
    struct batch *bt = NULL;
    char why[512], uuid[37];
    int rc;

    (void)nc;
    (void)sub;
    rc = broker__unpack_request(msg, &ks__batch_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    r.req = req;
    if (req->rerun_of[0]) {
        /* The original's command and targets (the request has none). */
        pthread_mutex_lock(&m->api_mu);
        rc = m->st_api ? rerun_prepare(b, m->st_api, msg, req, &r, why,
                                       sizeof(why))
                       : KS_ESTOPPED;
        pthread_mutex_unlock(&m->api_mu);
        if (rc) {
            reply_batch_error(b, msg, rc,
                              rc == KS_ESTOPPED ? "the broker is stopping"
                                                : why);
            goto out;
        }
    }
    if ((rc = broker__validate_spec(req->spec, why, sizeof(why)))) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    if (req->n_waves > BROKER_WAVES_MAX) {
        reply_batch_error(b, msg, KS_EINVAL, "too many waves");
        goto out;
    }
    for (size_t i = 0; i < req->n_waves; i++)
        if (!req->waves[i] || req->waves[i]->value == 0 ||
            (req->waves[i]->percent && req->waves[i]->value > 100)) {
            reply_batch_error(b, msg, KS_EINVAL,
                              "bad wave size: N >= 1, or P% (1-100)");
            goto out;
        }
    if (req->wave_pause_ms && !req->n_waves) {
        reply_batch_error(b, msg, KS_EINVAL, "a wave pause needs waves");
        goto out;
    }
    if (strlen(req->progress_subject) > 255) {
        /* It is kept in the batch's lease row for whoever drives it. */
        reply_batch_error(b, msg, KS_EINVAL, "progress subject too long");
        goto out;
    }
    if (req->n_agents == 0 && req->n_select == 0 && req->n_selector == 0 &&
        !req->all && !req->rerun_of[0]) {
        reply_batch_error(b, msg, KS_EINVAL,
                          "no targets: give --agents, --select or --all");
        goto out;
    }
    if (req->all && (req->n_agents || req->n_select || req->n_selector)) {
        reply_batch_error(b, msg, KS_EINVAL,
                          "--all takes no --agents or --select");
        goto out;
    }
    for (size_t i = 0; i < req->n_selector; i++)
        if ((rc = broker_select_check(req->selector[i], why, sizeof(why)))) {
            reply_batch_error(b, msg, rc, why);
            goto out;
        }
    if (!(r.terms = request_terms(req, &r.n_terms))) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    /* Explicit ids first, in the order given; each must be known. With a
     * selector: those of them that match it (the intersection). */
    why[0] = '\0';
    for (size_t i = 0; i < req->n_agents; i++) {
        const char *id = req->agents[i];
        if (!evt_agent_id_valid(id) || !broker__agent_known(b, id)) {
            size_t used = strlen(why);
            snprintf(why + used, sizeof(why) - used, "%s%s",
                     used ? ", " : "unknown agent(s): ", id);
            continue;
        }
        if (r.n_terms || req->online_only) {
            Ks__AgentInfo *info = broker__agent_info(b, id);
            bool keep = broker_select_match(info, r.terms, r.n_terms) &&
                        (!req->online_only ||
                         broker__agent_presence(b, id, NULL) == 1);
            if (info)
                ks__agent_info__free_unpacked(info, NULL);
            if (!keep)
                continue;
        }
        add_target(&r, id);
    }
    if (why[0]) {
        reply_batch_error(b, msg, KS_ENOAGENT, why);
        goto out;
    }
    if (req->n_agents == 0 && !req->rerun_of[0]) {
        r.deaf = broker__registry_deaf(b);
        pthread_mutex_lock(&b->mu);
        r.now_mono = ks_mono_us();
        ks_map_each(&b->agents, collect_matching, &r);
        pthread_mutex_unlock(&b->mu);
        qsort(r.ids, r.n, sizeof(*r.ids), cmp_str);
    }
    if (b->policy) {
        /* Every target must be allowed: a batch is all or nothing. */
        const char *op = broker__operator_of(msg);
        for (size_t i = 0; i < r.n; i++) {
            Ks__AgentInfo *info = broker__agent_info(b, r.ids[i]);
            rc = broker__policy_check(b->policy, op, info, req->spec,
                                      why, sizeof(why));
            if (info)
                ks__agent_info__free_unpacked(info, NULL);
            if (rc) {
                pthread_mutex_lock(&m->api_mu);
                broker__record_denied(b, m->st_api, op, r.ids[i], req->spec,
                                      why);
                pthread_mutex_unlock(&m->api_mu);
                reply_batch_error(b, msg, rc, why);
                goto out;
            }
        }
    }
    /* A copy's files are stored whole before anything is recorded. */
    if (!req->dry_run &&
        (rc = broker__check_copy_files(b, req->spec,
                                       broker__operator_of(msg), why,
                                       sizeof(why)))) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    if (broker__spec_special(req->spec) && !req->dry_run) {
        /* Every target must run it as asked: an older agent would ignore
         * --run-as or --script. */
        for (size_t i = 0; i < r.n; i++) {
            Ks__AgentInfo *info = broker__agent_info(b, r.ids[i]);
            rc = broker__check_features(req->spec, info, r.ids[i], why,
                                        sizeof(why));
            if (info)
                ks__agent_info__free_unpacked(info, NULL);
            if (rc) {
                reply_batch_error(b, msg, rc, why);
                goto out;
            }
        }
    }
    if (req->dry_run && r.n) {
        reply_dry_run(b, msg, &r);
        goto out;
    }
    /* Secret variables: sealed to every target (extra ones are left
     * out of each target's command). */
    if (r.n && (rc = broker__check_sealed_targets(req->spec, r.ids, r.n,
                                                  false, why, sizeof(why)))) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    if (r.n == 0) {
        reply_batch_error(
            b, msg, KS_ENOAGENT,
            req->n_agents ? "no targets: none of the agents matches the "
                            "selector"
            : req->all    ? (req->online_only ? "no targets: no agent is online"
                                              : "no targets: no agent is "
                                                "registered")
            : req->online_only
                ? "no targets: the selector matched no online agent"
                : "no targets: the selector matched no agent");
        goto out;
    }

    if (!(bt = batch_alloc(r.n))) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    ks_uuid(uuid);
    snprintf(bt->id, sizeof(bt->id), "batch-%s", uuid);
    for (size_t i = 0; i < r.n; i++) {
        snprintf(bt->t[i].agent_id, sizeof(bt->t[i].agent_id), "%s",
                 r.ids[i]);
        ks_uuid(bt->t[i].command_id);
    }
    bt->conc = resolve_amount(req->max_concurrency, r.n, true);
    bt->has_max_err = req->max_errors != NULL;
    bt->max_err = resolve_amount(req->max_errors, r.n, false);
    bt->strict = req->strict_errors;
    if (req->n_waves &&
        resolve_waves(req->waves, req->n_waves, r.n, &bt->wave_ends,
                      &bt->n_waves) != 0) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    bt->wave_pause_ms = req->wave_pause_ms;
    if (req->rerun_of[0]) {
        snprintf(bt->rerun_of, sizeof(bt->rerun_of), "%s", req->rerun_of);
        snprintf(bt->rerun_filter, sizeof(bt->rerun_filter), "%s",
                 req->rerun_not_succeeded ? "not-succeeded" : "failed");
    }
    bt->start_mono_us = ks_mono_us();
    snprintf(bt->operator_name, sizeof(bt->operator_name), "%s",
             broker__operator_of(msg));
    const char *reply = natsMsg_GetReply(msg);
    if (reply) {
        if (req->detach)
            bt->accept_subject = strdup(reply);
        else
            bt->reply_subject = strdup(reply);
    }
    bt->req = req;
    req = NULL;

    struct job *j = calloc(1, sizeof(*j));
    if (!j) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    /* Live once the scheduler takes it (apply_job). */
    j->kind = JOB_NEW;
    j->batch = bt;
    pthread_mutex_lock(&m->mu);
    push_job(m, j);
    pthread_mutex_unlock(&m->mu);
    bt = NULL;
out:
    batch_free(bt);
    for (size_t i = 0; i < r.n; i++)
        free(r.ids[i]);
    free(r.ids);
    for (size_t i = 0; i < r.n_terms; i++)
        free(r.terms[i]);
    free(r.terms);
    ks_map_clear(&r.seen);
    if (req)
        ks__batch_request__free_unpacked(req, NULL);
    natsMsg_Destroy(msg);
}

/* ---- view ------------------------------------------------------------------ */

struct view_acc {
    Ks__BatchReply *r;
    int rc;
};

static int
view_event(const Ks__RecordedEvent *rec, void *ud)
{
    struct view_acc *v = ud;
    const Ks__Event *e = rec->event;
    Ks__BatchReply *r = v->r;

    if (strcmp(e->type, "BatchRequested") == 0 && e->batch) {
        const Ks__BatchSpec *sp = e->batch;
        r->n_targets = sp->n_agents;
        r->targets = calloc(sp->n_agents ? sp->n_agents : 1,
                            sizeof(*r->targets));
        if (!r->targets)
            return v->rc = -ENOMEM;
        for (size_t i = 0; i < sp->n_agents; i++) {
            Ks__BatchTarget *t = calloc(1, sizeof(*t));
            if (!t)
                return v->rc = -ENOMEM;
            ks__batch_target__init(t);
            t->agent_id = strdup(sp->agents[i]);
            t->command_id =
                strdup(i < sp->n_command_ids ? sp->command_ids[i] : "");
            t->status = KS__COMMAND_STATUS__PENDING;
            r->targets[i] = t;
        }
        r->max_concurrency = sp->max_concurrency;
        r->max_errors = sp->has_max_errors ? sp->max_errors : 0;
        r->has_max_errors = sp->has_max_errors;
        r->status = KS__BATCH_STATUS__BATCH_RUNNING;
        r->elapsed_us = -rec->recorded_at_us; /* completed below */
        if (sp->n_wave_ends) {
            r->wave_ends = calloc(sp->n_wave_ends, sizeof(uint32_t));
            if (!r->wave_ends)
                return v->rc = -ENOMEM;
            memcpy(r->wave_ends, sp->wave_ends,
                   sp->n_wave_ends * sizeof(uint32_t));
            r->n_wave_ends = sp->n_wave_ends;
        }
        r->wave_pause_ms = sp->wave_pause_ms;
        if (sp->rerun_of[0] && (!(r->rerun_of = strdup(sp->rerun_of)) ||
                                !(r->rerun_filter = strdup(sp->rerun_filter))))
            return v->rc = -ENOMEM;
    } else if (strcmp(e->type, "BatchWaveStarted") == 0) {
        r->wave = e->wave;
        r->next_wave_at_us = 0;
    } else if (strcmp(e->type, "BatchWaveEnded") == 0) {
        r->next_wave_at_us = e->next_wave_at_us;
        if (e->halted) {
            r->halted = true;
            r->halted_wave = e->wave;
            if (r->halt_reason != protobuf_c_empty_string)
                free(r->halt_reason);
            if (!(r->halt_reason = strdup(e->reason)))
                return v->rc = -ENOMEM;
        }
    } else if (strcmp(e->type, "BatchRerunRequested") == 0 &&
               e->rerun_batch_id[0]) {
        char **x = realloc(r->reruns, (r->n_reruns + 1) * sizeof(*x));
        if (!x)
            return v->rc = -ENOMEM;
        r->reruns = x;
        if (!(r->reruns[r->n_reruns] = strdup(e->rerun_batch_id)))
            return v->rc = -ENOMEM;
        r->n_reruns++;
    } else if (strcmp(e->type, "BatchTargetEnded") == 0) {
        for (size_t i = 0; i < r->n_targets; i++)
            if (strcmp(r->targets[i]->command_id, e->command_id) == 0)
                r->targets[i]->status = e->target_status;
    } else if (strcmp(e->type, "BatchCompleted") == 0) {
        r->status = e->batch_status;
        r->elapsed_us += rec->recorded_at_us;
        r->next_wave_at_us = 0;
    }
    if (e->batch_counts) {
        if (!r->counts) {
            r->counts = calloc(1, sizeof(*r->counts));
            if (!r->counts)
                return v->rc = -ENOMEM;
            ks__batch_counts__init(r->counts);
        }
        const Ks__BatchCounts *ec = e->batch_counts;
        r->counts->total = ec->total;
        r->counts->pending = ec->pending;
        r->counts->running = ec->running;
        r->counts->succeeded = ec->succeeded;
        r->counts->failed = ec->failed;
        r->counts->cancelled = ec->cancelled;
        r->counts->timed_out = ec->timed_out;
        r->counts->killed = ec->killed;
        r->counts->no_response = ec->no_response;
        r->counts->lost = ec->lost;
        r->counts->not_started = ec->not_started;
        r->counts->errors = ec->errors;
    }
    return 0;
}

struct overlay {
    Ks__BatchReply *r;
    struct ks_map idx; /* command id -> target index + 1 */
    uint32_t *attempt;
};

static int
overlay_state(const struct store_command_row *c, void *ud)
{
    struct overlay *o = ud;
    uintptr_t i = (uintptr_t)ks_map_get(&o->idx, c->command_id);
    if (i) {
        o->r->targets[i - 1]->status = c->status;
        o->attempt[i - 1] = c->attempt;
    }
    return 0;
}

/*
 * An open batch read from its stream (driven by another broker, or by
 * none while one takes it over) knows only the targets whose end its
 * driver reported: the states and counts come from the commands
 * projection instead, so a target that ended meanwhile never shows
 * Pending. Targets never requested stay Pending; in flight ones show
 * their command's state.
 */
static int
view_overlay(struct store *st, Ks__BatchReply *r, bool in_flight_only)
{
    struct overlay o = {.r = r, .idx = KS_MAP_INIT};
    const char **ids = calloc(r->n_targets ? r->n_targets : 1, sizeof(*ids));
    size_t n = 0;
    int rc = 0;

    o.attempt = calloc(r->n_targets ? r->n_targets : 1, sizeof(*o.attempt));
    if (!ids || !o.attempt || !r->counts)
        rc = -ENOMEM;
    for (size_t i = 0; rc == 0 && i < r->n_targets; i++) {
        if (in_flight_only &&
            r->targets[i]->status != KS__COMMAND_STATUS__DISPATCHED)
            continue;
        ids[n] = r->targets[i]->command_id;
        rc = ks_map_put(&o.idx, ids[n++], (void *)(i + 1));
    }
    if (rc == 0 && n)
        rc = store_command_states(st, ids, n, 0, overlay_state, &o);
    if (rc == 0 && !in_flight_only) {
        Ks__BatchCounts *c = r->counts;
        c->total = (uint32_t)r->n_targets;
        unsigned ok = 0, failed = 0, cancelled = 0, to = 0, killed = 0,
                 nr = 0, lost = 0, ns = 0, errors = 0;
        c->pending = c->running = 0;
        for (size_t i = 0; i < r->n_targets; i++) {
            Ks__CommandStatus s = r->targets[i]->status;
            if (s == KS__COMMAND_STATUS__PENDING)
                c->pending++;
            else if (!kproto_status_terminal(s))
                c->running++;
            else /* no result here: a kill counts as failed */
                count_end(s, NULL, &ok, &failed, &cancelled, &to, &killed,
                          &nr, &lost, &ns, &errors);
        }
        c->succeeded = ok;
        c->failed = failed;
        c->cancelled = cancelled;
        c->timed_out = to;
        c->killed = killed;
        c->no_response = nr;
        c->lost = lost;
        c->not_started = ns;
        c->errors = errors;
    }
    ks_map_clear(&o.idx);
    free(o.attempt);
    free(ids);
    return rc;
}

int
broker__batch_view(struct broker *b, struct store *st, const char *batch_id,
                   Ks__BatchReply **out)
{
    struct broker__batches *m = b->batches;
    struct batch *bt;
    Ks__BatchReply *r;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = 0;

    /* Live: from memory, under the lock (the scheduler mutates it). */
    pthread_mutex_lock(&m->mu);
    bt = ks_map_get(&m->live, batch_id);
    if (bt) {
        Ks__BatchReply tmp;
        Ks__BatchCounts c;
        Ks__BatchTarget **tv = calloc(bt->n, sizeof(*tv));
        Ks__BatchTarget *ts = calloc(bt->n, sizeof(*ts));
        Ks__CommandResult *rs = calloc(bt->n, sizeof(*rs));
        if (tv && ts && rs) {
            fill_reply(bt, &tmp, &c, tv, ts, rs);
            rc = kproto_pack(&tmp.base, &buf, &len);
        } else {
            rc = -ENOMEM;
        }
        free(tv);
        free(ts);
        free(rs);
    }
    pthread_mutex_unlock(&m->mu);
    if (bt) {
        if (rc)
            return rc;
        *out = ks__batch_reply__unpack(NULL, len, buf);
        free(buf);
        if (!*out)
            return -ENOMEM;
        /* In memory an in-flight target is only "dispatched": its own
         * state (Dispatched, or Running once claimed) is its command's
         * (issue 24: `kscore get` showed Dispatched where its summary
         * said running). Unread, it stays as it was. */
        view_overlay(st, *out, true);
        return 0;
    }

    /* Ended (or served by another broker): fold its stream. */
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    ks__batch_reply__init(r);
    struct view_acc acc = {r, 0};
    rc = store_read_stream(st, batch_id, 0, 0, view_event, &acc);
    if (rc == 0)
        rc = acc.rc;
    if (rc == 0 && !r->targets)
        rc = KS_ENOTFOUND;
    if (rc == 0) {
        r->batch_id = strdup(batch_id);
        if (r->status == KS__BATCH_STATUS__BATCH_RUNNING)
            r->elapsed_us = 0;
    }
    if (rc == 0 && r->status == KS__BATCH_STATUS__BATCH_RUNNING)
        rc = view_overlay(st, r, false);
    /* Normalise ownership: repack so protobuf-c's free_unpacked owns it. */
    if (rc == 0 && kproto_pack(&r->base, &buf, &len) == 0) {
        *out = ks__batch_reply__unpack(NULL, len, buf);
        free(buf);
        if (!*out)
            rc = -ENOMEM;
    } else if (rc == 0) {
        rc = -ENOMEM;
    }
    /* free the hand-built one */
    for (size_t i = 0; i < r->n_targets && r->targets; i++) {
        if (!r->targets[i])
            continue;
        free(r->targets[i]->agent_id);
        free(r->targets[i]->command_id);
        free(r->targets[i]);
    }
    free(r->targets);
    free(r->counts);
    free(r->wave_ends);
    for (size_t i = 0; i < r->n_reruns; i++)
        free(r->reruns[i]);
    free(r->reruns);
    if (r->rerun_of != protobuf_c_empty_string)
        free(r->rerun_of);
    if (r->rerun_filter != protobuf_c_empty_string)
        free(r->rerun_filter);
    if (r->halt_reason != protobuf_c_empty_string)
        free(r->halt_reason);
    /* Only ours: unset, it is protobuf-c's static empty string (freeing
     * it crashed the broker on `kscore get` or `cancel` of an unknown
     * batch id). */
    if (r->batch_id != protobuf_c_empty_string)
        free(r->batch_id);
    free(r);
    return rc;
}

/* ---- start / stop ------------------------------------------------------------ */

int
broker__batch_start(struct broker *b, char **errmsg)
{
    struct broker__batches *m = calloc(1, sizeof(*m));
    pthread_condattr_t ca;
    char host[64], uuid[37];
    char *why = NULL;
    int rc;

    if (!m)
        return -ENOMEM;
    rc = store_open(b->opts->db_conninfo, &m->st_api, &why);
    if (rc) {
        if (errmsg && asprintf(errmsg, "cannot connect to PostgreSQL: %s",
                               why ? why : ks_strerror(rc)) < 0)
            *errmsg = NULL;
        free(why);
        free(m);
        return rc;
    }
    pthread_mutex_init(&m->mu, NULL);
    pthread_mutex_init(&m->api_mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&m->cond, &ca);
    pthread_condattr_destroy(&ca);
    m->live = (struct ks_map)KS_MAP_INIT;
    m->by_cmd = (struct ks_map)KS_MAP_INIT;
    m->tail = &m->head;
    /* Names this process to an operator reading batch_leases, and is new
     * at every start: a restarted broker is another driver. */
    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    ks_uuid(uuid);
    snprintf(m->owner, sizeof(m->owner), "%s/%ld/%s", host, (long)getpid(),
             uuid);
    b->batches = m;
    if (pthread_create(&m->thread, NULL, scheduler_main, b) != 0)
        return KS_EINTERNAL;
    m->started = true;
    return 0;
}

static void
free_live(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    batch_free(val);
}

/*
 * Stops the scheduler and frees what it drove. The module's own struct
 * stays allocated, stopped: broker_teardown stops the recorder after this,
 * and its thread may still call broker__batch_target_ended (which then
 * does nothing); freeing it here would race that call. The process exits
 * after teardown.
 */
void
broker__batch_stop(struct broker *b)
{
    struct broker__batches *m = b->batches;
    struct job *jobs;
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->stopping = true;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->mu);
    if (m->started)
        pthread_join(m->thread, NULL);
    m->started = false;
    /* What this broker drove, any broker may take over now rather than
     * when the leases run out. */
    if (b->st_batch)
        store_batch_release(b->st_batch, m->owner, NULL, 0);
    pthread_mutex_lock(&m->mu);
    jobs = m->head;
    m->head = NULL;
    m->tail = &m->head;
    ks_map_each(&m->live, free_live, NULL);
    ks_map_clear(&m->live);
    ks_map_clear(&m->by_cmd);
    pthread_mutex_unlock(&m->mu);
    free_jobs(b, jobs, KS_ESTOPPED, "the broker is stopping");
    pthread_mutex_lock(&m->api_mu);
    store_close(m->st_api);
    m->st_api = NULL;
    pthread_mutex_unlock(&m->api_mu);
}
