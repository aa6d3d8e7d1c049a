/*
 * The recorder: consumes KSCORE_EVENTS (durable push consumer
 * kscore-recorder, explicit ack), appends each event once (unique event_id)
 * in batches, acks only after the commit, then answers the clients waiting
 * for terminal events.
 *
 * The nats.c delivery thread only queues the message; the recorder thread
 * takes whatever has queued (up to REC_BATCH) into one transaction, so an
 * idle system records each event at once and a busy one in batches.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

#define REC_BATCH 1000
#define REC_MAX_ACK_PENDING 20000
#define REC_ACK_WAIT_MS 10000
/* A failed append is retried after 100 ms, doubling to 2 s. */
#define REC_BACKOFF_MIN_MS 100
#define REC_BACKOFF_MAX_MS 2000
/* While retrying, the held messages are marked in progress this often (a
 * fraction of the ack wait). */
#define REC_IN_PROGRESS_US ((int64_t)REC_ACK_WAIT_MS * 1000 / 3)

/* The recorder thread's memory for one batch (the decoded events, the
 * batch's arrays), given back at once at the end of record_batch: no
 * malloc per field of every event. */
static _Thread_local struct kproto_arena rec_arena;

static void
on_event_msg(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
             void *ud)
{
    struct broker *b = ud;
    uint64_t delivered = evt_ack_delivered(natsMsg_GetReply(msg));
    (void)nc;
    (void)sub;
    /* Every delivery of the consumer has its ack subject; anything else on
     * its deliver subject (a status message: nats.c passes on all but its
     * own 100s; a stray publish) is no event, and changes nothing. */
    if (delivered == 0) {
        natsMsg_Destroy(msg);
        return;
    }
    if (delivered > 1)
        ks_metric_inc(KS_C_RECORDER_REDELIVERIES);
    pthread_mutex_lock(&b->mu);
    if (b->rec_len == b->rec_cap) {
        size_t ncap = b->rec_cap ? b->rec_cap * 2 : 1024;
        natsMsg **q = realloc(b->rec_q, ncap * sizeof(*q));
        if (!q) {
            /* Not acked: JetStream redelivers after the ack wait. */
            pthread_mutex_unlock(&b->mu);
            natsMsg_Destroy(msg);
            return;
        }
        b->rec_q = q;
        b->rec_cap = ncap;
    }
    b->rec_q[b->rec_len++] = msg;
    pthread_cond_signal(&b->rec_cond);
    pthread_mutex_unlock(&b->mu);
}

/* Sleeps ms, in slices, returning early once the broker stops. */
static void
rec_sleep(struct broker *b, int64_t ms)
{
    while (ms > 0 && !b->stopping) {
        int64_t step = ms < 100 ? ms : 100;
        nanosleep(&(struct timespec){0, step * 1000000L}, NULL);
        ms -= step;
    }
}

/* Resets the ack wait of the batch in hand and of what is queued behind
 * it: they are held, not lost. */
static void
keep_in_progress(struct broker *b, natsMsg **msgs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (msgs[i])
            natsMsg_InProgress(msgs[i], NULL);
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->rec_len; i++)
        natsMsg_InProgress(b->rec_q[i], NULL);
    pthread_mutex_unlock(&b->mu);
}

/*
 * Who may report what (the trust model in DESIGN.md): an agent's event is
 * a claim about a command addressed to that agent, nothing more. The
 * sender is ev->agent_id, which the recorder has matched with the subject
 * NATS let it publish on. Pure; the recorder thread, under the lock of
 * store_append_checked().
 */
/* 0 (unset) to the year 9999, in us since the epoch. */
static bool
time_ok(int64_t us)
{
    return us >= 0 && us <= INT64_C(253402300799999999);
}

int
broker__admit_report(const struct store_command_state *st,
                     const Ks__Event *ev, const char **why, void *ud)
{
    static const char *const agent_types[] = {
        "CommandCompleted", "CommandStartFailed", "CommandLost",
        "CommandNotStarted", "CommandRejected",
    };
    bool known = false;

    (void)ud;
    if (strcmp(ev->type, "OutputChunk") == 0) {
        /* A piece reaches the events only when refused (output.c): kept
         * as ReportRejected, with the reason it was refused. */
        *why = ev->reason[0] ? ev->reason : "output refused";
        return KS_EDENIED;
    }
    for (size_t i = 0; i < sizeof(agent_types) / sizeof(agent_types[0]); i++)
        known = known || strcmp(ev->type, agent_types[i]) == 0;
    if (!known) {
        *why = "an agent may not report this type of event";
        return KS_EDENIED;
    }
    if (st->exists && strcmp(st->agent_id, ev->agent_id) != 0) {
        *why = "the command is addressed to another agent";
        return KS_EDENIED;
    }
    /* Times the record can hold (PostgreSQL's timestamptz, through
     * kscore_ts): a report with one it cannot must not reach the append,
     * where it would fail for the whole batch. */
    {
        const Ks__CommandResult *r = ev->result;
        if (!time_ok(ev->occurred_at_us) || !time_ok(ev->deliver_by_us) ||
            (r && (!time_ok(r->started_at_us) || !time_ok(r->finished_at_us) ||
                   r->duration_us < 0 || r->term_sent_us < -1 ||
                   r->kill_sent_us < -1))) {
            *why = "a time in the report is out of range";
            return KS_EDENIED;
        }
    }
    /* An agent ends only what it claimed (a start failure found before
     * the claim goes through the claim itself): a report about a command
     * that is not Running is an end without a claim, or (terminal) late,
     * which the state machine names. Found by fuzz_decide_report. */
    if (st->exists && store_event_is_terminal(ev->type) &&
        !kproto_status_terminal(st->status)) {
        if (st->status != KS__COMMAND_STATUS__RUNNING) {
            *why = "the command was never claimed";
            return KS_EDENIED;
        }
        if (ev->attempt != st->attempt) {
            *why = "not the attempt the record says was claimed";
            return KS_EDENIED;
        }
    }
    return 0;
}

enum store_step
broker_decide_report(const struct store_command_state *st,
                     const Ks__Event *ev, const char **why)
{
    Ks__CommandStatus next;
    if (broker__admit_report(st, ev, why, NULL) != 0)
        return STORE_STEP_ILLEGAL;
    return store_command_step(st, ev, &next, why);
}

/*
 * A batch that fails for a reason of its own (a constraint, a value the
 * database refuses) would fail forever and stop recording for every
 * agent. Records each event alone instead; an event that still fails is
 * kept as a bare ReportRejected naming why (its payload dropped). Returns
 * 0 when every event is recorded (as itself or as that annotation), or a
 * sick database's code (store_db_sick: away, or refusing writes) when one
 * of them failed for the database's sake: the caller keeps the whole batch
 * unacked and retries it (events recorded here are duplicates then,
 * skipped by event_id). A bare annotation that cannot be written either
 * says the database is what fails (it carries nothing of the report's):
 * KS_EPGREFUSED, never given up on. Nothing is acked unrecorded.
 */
static int
record_one_by_one(struct broker *b, Ks__Event **evs, size_t nev,
                  enum store_step *verdicts)
{
    for (size_t i = 0; i < nev; i++) {
        const Ks__Event *one[1] = {evs[i]};
        char why[512], reason[700];
        int rc = store_append_checked(b->st_rec, one, 1, broker__admit_report,
                                      b, &verdicts[i], NULL);
        if (store_db_sick(rc))
            return rc;
        if (rc == 0)
            continue;
        broker__store_error(b->st_rec, rc, why, sizeof(why));
        snprintf(reason, sizeof(reason), "%s: could not be recorded (%s)",
                 evs[i]->type, why);
        Ks__Event bare;
        ks__event__init(&bare);
        bare.event_id = evs[i]->event_id;
        bare.stream_id = evs[i]->stream_id;
        bare.type = "ReportRejected";
        bare.command_id = evs[i]->command_id;
        bare.agent_id = evs[i]->agent_id;
        bare.attempt = evs[i]->attempt;
        bare.occurred_at_us = ks_now_us();
        bare.reason = reason;
        one[0] = &bare;
        enum store_step v;
        rc = store_append_checked(b->st_rec, one, 1, NULL, NULL, &v, NULL);
        if (store_db_sick(rc))
            return rc;
        if (rc) {
            char bwhy[512];
            ks_log(KS_LOG_WARN,
                   "cannot record a report nor its annotation; kept "
                   "unacked, retrying",
                   KS_S("module", "recorder"), KS_S("type", evs[i]->type),
                   KS_S("command_id", evs[i]->command_id),
                   KS_S("agent", evs[i]->agent_id), KS_S("reason", why),
                   KS_S("annotation_error",
                        broker__store_error(b->st_rec, rc, bwhy,
                                            sizeof(bwhy))));
            return KS_EPGREFUSED;
        }
        verdicts[i] = STORE_STEP_ILLEGAL;
        ks_log(KS_LOG_WARN, "report kept as a bare ReportRejected",
               KS_S("module", "recorder"), KS_S("type", evs[i]->type),
               KS_S("command_id", evs[i]->command_id),
               KS_S("agent", evs[i]->agent_id), KS_S("reason", why));
    }
    return 0;
}

/* At most one "stalled" line per this long while the stall lasts. */
#define REC_STALL_LOG_US INT64_C(10000000)

/*
 * The recorder's stall, seen by the operator: the gauge
 * kscore_recorder_stalled{cause} while it lasts, a counter of the
 * attempts, and, after the line at its start ("cannot record; ...", which
 * names the SQLSTATE too), one line at most every REC_STALL_LOG_US while
 * it lasts. Recorder thread.
 */
struct rec_stall {
    enum ks_gauge gauge; /* KS_G__N: not stalled */
    int64_t since_us, logged_us;
};

static void
stall_note(struct broker *b, struct rec_stall *sl, int rc, size_t nev,
           bool said_now)
{
    enum ks_gauge g = rc == KS_EPGREFUSED ? KS_G_RECORDER_STALLED_REFUSED
                                          : KS_G_RECORDER_STALLED_DOWN;
    int64_t now = ks_mono_us();
    char why[512];

    /* The cause changed (unreachable, then refusing writes): say so,
     * but not more than once a second should it flap. */
    bool changed = sl->gauge != KS_G__N && sl->gauge != g &&
                   now - sl->logged_us >= 1000000;

    ks_metric_inc(KS_C_RECORDER_DB_RETRIES);
    if (sl->gauge != g) {
        if (sl->gauge != KS_G__N)
            ks_metric_gauge_add(sl->gauge, -1);
        ks_metric_gauge_add(g, 1);
        sl->gauge = g;
    }
    if (!sl->since_us)
        sl->since_us = now;
    if (said_now) /* the "cannot record" line names it */
        sl->logged_us = now;
    if (said_now ||
        (!changed && sl->logged_us && now - sl->logged_us < REC_STALL_LOG_US))
        return;
    sl->logged_us = now;
    ks_log(KS_LOG_ERROR,
           rc == KS_EPGREFUSED
               ? "recorder still stalled: PostgreSQL refuses writes; results "
                 "wait unacked, commands stay Running until it takes them"
               : "recorder still stalled: PostgreSQL unreachable; results "
                 "wait unacked, commands stay Running until it is back",
           KS_S("module", "recorder"), KS_I("events", nev),
           KS_S("cause", rc == KS_EPGREFUSED ? "refuses_writes"
                                             : "unreachable"),
           KS_S("sqlstate", store_last_sqlstate(b->st_rec)),
           KS_S("error", broker__store_error(b->st_rec, rc, why,
                                             sizeof(why))),
           KS_D("for_s", (double)(now - sl->since_us) / 1e6));
}

static void
stall_end(struct rec_stall *sl)
{
    if (sl->gauge != KS_G__N)
        ks_metric_gauge_add(sl->gauge, -1);
    sl->gauge = KS_G__N;
}

static void
record_batch(struct broker *b, natsMsg **msgs, size_t n)
{
    struct kproto_arena *ar = &rec_arena;
    Ks__Event **evs = kproto_arena_calloc(ar, n, sizeof(*evs));
    Ks__Event **pcs = kproto_arena_calloc(ar, n, sizeof(*pcs));
    size_t nev = 0, npc = 0, dups = 0;
    bool pieces_done = false;
    int rc;

    enum store_step *verdicts = kproto_arena_calloc(ar, n, sizeof(*verdicts));
    enum store_step *pverdicts = kproto_arena_calloc(ar, n, sizeof(*pverdicts));
    const char **pwhys = kproto_arena_calloc(ar, n, sizeof(*pwhys));
    char (*preasons)[200] = kproto_arena_calloc(ar, n, sizeof(*preasons));
    /* A refused piece is recorded as a shallow copy (no bytes, the
     * reason), borrowing from its original. */
    Ks__Event *pcopies = kproto_arena_calloc(ar, n, sizeof(*pcopies));
    if (!evs || !verdicts || !pcs || !pverdicts || !pwhys || !preasons ||
        !pcopies) {
        kproto_arena_reset(ar);
        return; /* not acked: redelivered */
    }
    for (size_t i = 0; i < n; i++) {
        ProtobufCMessage *m = NULL;
        rc = evt_unpack_in(&ks__event__descriptor, natsMsg_GetData(msgs[i]),
                           (size_t)natsMsg_GetDataLength(msgs[i]),
                           kproto_arena_pb(ar), &m);
        Ks__Event *ev = (Ks__Event *)m;
        char want[16 + EVT_AGENT_ID_MAX + 40];
        if (rc == 0)
            evt_event_subject(want, sizeof(want), ev->agent_id,
                              ev->command_id);
        /* The subject is what NATS permissions vouch for: an agent may only
         * publish under its own id, so an event claiming another agent (or
         * another command) is refused. */
        if (rc || !ks_is_uuid(ev->event_id) || !ks_is_uuid(ev->command_id) ||
            !evt_agent_id_valid(ev->agent_id) || !ev->type[0] ||
            strcmp(want, natsMsg_GetSubject(msgs[i])) != 0) {
            /* A message that can never be recorded: drop it for good
             * rather than redeliver it forever. */
            ks_log(KS_LOG_WARN, "dropping an undecodable or misaddressed "
                                "event",
                   KS_S("module", "recorder"),
                   KS_S("subject", natsMsg_GetSubject(msgs[i])));
            natsMsg_Term(msgs[i], NULL);
            natsMsg_Destroy(msgs[i]);
            msgs[i] = NULL;
            continue;
        }
        /* Output pieces go to their own table, before the events of the
         * batch: an agent sends a command's pieces before its end. */
        if (strcmp(ev->type, "OutputChunk") == 0 && ev->chunk)
            pcs[npc++] = ev;
        else
            evs[nev++] = ev;
        ks_trace("recorder.taken", ev->command_id);
    }
    /* Until it is recorded nothing is acked: JetStream keeps it. While
     * PostgreSQL is away, retry with backoff, tell JetStream the messages
     * are in progress (else each ack wait would redeliver them), and say so
     * once when the failures start and once when they end. */
    int64_t backoff_ms = REC_BACKOFF_MIN_MS, failing_since = 0,
            touched = 0;
    unsigned failures = 0;
    char why[512];
    struct rec_stall stall = {.gauge = KS_G__N};
    /* One end of a command this broker saw claimed: decided against the
     * state the claim left, appended at the claim's version, in one round
     * trip; anything else (the stream moved on, no hint, an annotation)
     * goes the checked way below. */
    bool decided = false;
    if (nev == 1 && npc == 0) {
        struct broker__claimed *h = broker__claimed_take(b,
                                                         evs[0]->command_id);
        if (h) {
            struct store_command_state known = {
                .exists = true,
                .status = KS__COMMAND_STATUS__RUNNING,
                .attempt = h->attempt,
            };
            snprintf(known.agent_id, sizeof(known.agent_id), "%s",
                     h->agent_id);
            rc = store_append_checked_at(b->st_rec, evs[0], &known,
                                         h->version, broker__admit_report,
                                         b);
            free(h);
            if (rc == 0 || rc == KS_EDUPLICATE) {
                verdicts[0] = rc == 0 ? STORE_STEP_APPLY
                                      : STORE_STEP_DUPLICATE;
                decided = true;
                rc = 0;
            }
        }
    }
    for (; !decided;) {
        /* Each event is decided against the record under its stream's
         * lock: one terminal event per command, reports only from the
         * command's own agent (store_append_checked,
         * broker__admit_report). */
        rc = 0;
        if (!pieces_done && npc) {
            rc = broker__record_pieces(b, pcs, npc, pverdicts, pwhys);
            if (rc == 0) {
                pieces_done = true;
                /* Refused pieces: kept as ReportRejected (with the
                 * reason, without the bytes) through the events. */
                for (size_t i = 0; i < npc; i++) {
                    if (pverdicts[i] != STORE_STEP_ILLEGAL)
                        continue;
                    snprintf(preasons[i], sizeof(preasons[i]),
                             "%s (stream %u, offset %llu, %zu bytes)",
                             pwhys[i] ? pwhys[i] : "output refused",
                             pcs[i]->chunk->stream,
                             (unsigned long long)pcs[i]->chunk->offset,
                             pcs[i]->chunk->data.len);
                    pcopies[i] = *pcs[i];
                    pcopies[i].reason = preasons[i];
                    pcopies[i].chunk = NULL;
                    evs[nev++] = &pcopies[i];
                }
            }
        }
        if (rc == 0 && nev)
            rc = store_append_checked(b->st_rec,
                                      (const Ks__Event *const *)evs, nev,
                                      broker__admit_report, b, verdicts,
                                      &dups);
        if (rc == 0 || b->stopping)
            break;
        /* A sick database (away, or refusing writes: disk full,
         * read-only...) says nothing about the events: wait for it. Only
         * an error of the events' own is worth the search one by one. */
        if (!store_db_sick(rc) && failures >= 2) {
            rc = record_one_by_one(b, evs, nev, verdicts);
            if (rc == 0)
                break;
        }
        if (failures++ == 0) {
            failing_since = touched = ks_mono_us();
            ks_log(store_db_sick(rc) ? KS_LOG_ERROR : KS_LOG_WARN,
                   "cannot record; retrying until it succeeds, unacked",
                   KS_S("module", "recorder"), KS_I("events", nev),
                   KS_S("cause", rc == KS_EPGREFUSED ? "refuses_writes"
                                 : store_db_sick(rc) ? "unreachable"
                                                     : "error"),
                   KS_S("sqlstate", store_last_sqlstate(b->st_rec)),
                   KS_S("error", broker__store_error(b->st_rec, rc, why,
                                                     sizeof(why))));
        }
        if (store_db_sick(rc))
            stall_note(b, &stall, rc, nev, failures == 1);
        if (ks_mono_us() - touched >= REC_IN_PROGRESS_US) {
            touched = ks_mono_us();
            keep_in_progress(b, msgs, n);
        }
        rec_sleep(b, backoff_ms);
        backoff_ms = backoff_ms * 2 < REC_BACKOFF_MAX_MS ? backoff_ms * 2
                                                         : REC_BACKOFF_MAX_MS;
    }
    stall_end(&stall);
    if (failures && rc == 0)
        ks_log(KS_LOG_INFO, "recording again", KS_S("module", "recorder"),
               KS_D("after_s", (double)(ks_mono_us() - failing_since) / 1e6),
               KS_I("failed_attempts", failures));
    if (rc == 0 && ks_trace_on())
        for (size_t i = 0; i < nev; i++)
            ks_trace("recorder.recorded", evs[i]->command_id);
    for (size_t i = 0; i < n; i++) {
        if (!msgs[i])
            continue;
        if (rc == 0)
            natsMsg_Ack(msgs[i], NULL);
        natsMsg_Destroy(msgs[i]);
    }
    for (size_t i = 0; i < npc; i++)
        if (rc == 0 && pverdicts[i] == STORE_STEP_APPLY)
            broker__live_forward(b, pcs[i]);
    for (size_t i = 0; i < nev; i++) {
        if (rc == 0 && verdicts[i] == STORE_STEP_APPLY &&
            store_event_is_terminal(evs[i]->type))
        {
            ks_log(KS_LOG_DEBUG, "command ended", KS_S("module", "recorder"),
                   KS_S("command_id", evs[i]->command_id),
                   KS_S("agent", evs[i]->agent_id),
                   KS_S("type", evs[i]->type),
                   KS_S("status", evs[i]->result ? kproto_status_name(
                                                       evs[i]->result->status)
                                                 : ""));
            broker__command_ended(b, evs[i]->command_id, evs[i]->result);
        }
        else if (rc == 0 && verdicts[i] != STORE_STEP_APPLY &&
                 verdicts[i] != STORE_STEP_DUPLICATE)
            ks_log(KS_LOG_INFO, "report kept as an annotation",
                   KS_S("module", "recorder"), KS_S("type", evs[i]->type),
                   KS_S("command_id", evs[i]->command_id),
                   KS_S("agent", evs[i]->agent_id),
                   KS_S("kept_as", verdicts[i] == STORE_STEP_LATE
                                       ? "LateResult"
                                       : "ReportRejected"));
    }
    /* The events, the refused pieces' copies (borrowing from them) and
     * the arrays, all at once. */
    kproto_arena_reset(ar);
}

static void *
recorder_main(void *arg)
{
    struct broker *b = arg;
    natsMsg **batch = malloc(REC_BATCH * sizeof(*batch));
    if (!batch)
        return NULL;
    for (;;) {
        size_t n;
        pthread_mutex_lock(&b->mu);
        while (b->rec_len == 0 && !b->stopping)
            pthread_cond_wait(&b->rec_cond, &b->mu);
        if (b->rec_len == 0 && b->stopping) {
            pthread_mutex_unlock(&b->mu);
            break;
        }
        n = b->rec_len < REC_BATCH ? b->rec_len : REC_BATCH;
        memcpy(batch, b->rec_q, n * sizeof(*batch));
        memmove(b->rec_q, b->rec_q + n, (b->rec_len - n) * sizeof(*batch));
        b->rec_len -= n;
        pthread_mutex_unlock(&b->mu);
        record_batch(b, batch, n);
    }
    free(batch);
    kproto_arena_fini(&rec_arena);
    return NULL;
}

/* The recorder's consumer, as every broker makes it. */
static const struct evt_durable rec_durable = {
    .stream = EVT_STREAM_EVENTS,
    .durable = EVT_RECORDER_DURABLE,
    .filter_subject = "kscore.evt.>",
    .deliver_group = EVT_BROKER_QUEUE,
    .max_ack_pending = REC_MAX_ACK_PENDING,
    /* Redelivery of what a dead broker had queued, unrecorded. */
    .ack_wait_ms = REC_ACK_WAIT_MS,
};

int
broker__recorder_ensure(struct broker *b, char **errmsg)
{
    return evt_consumer_ensure(b->nc, &rec_durable, NULL, errmsg);
}

int
broker__recorder_start(struct broker *b, char **errmsg)
{
    int rc = evt_durable_subscribe(b->nc, &rec_durable, on_event_msg, b,
                                   &b->sub_rec, errmsg);
    if (rc)
        return rc;
    if (pthread_create(&b->rec_thread, NULL, recorder_main, b) != 0)
        return -EAGAIN;
    b->rec_started = true;
    return 0;
}

void
broker__recorder_stop(struct broker *b)
{
    if (b->sub_rec) {
        /* Drain, so no delivery callback runs once the queue is freed.
         * What is queued but not recorded is never acked: redelivered. */
        natsSubscription_Drain(b->sub_rec);
        natsSubscription_WaitForDrainCompletion(b->sub_rec, 10000);
        natsSubscription_Destroy(b->sub_rec);
        b->sub_rec = NULL;
    }
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_cond_broadcast(&b->rec_cond);
    pthread_mutex_unlock(&b->mu);
    if (b->rec_started)
        pthread_join(b->rec_thread, NULL);
    b->rec_started = false;
    for (size_t i = 0; i < b->rec_len; i++)
        natsMsg_Destroy(b->rec_q[i]);
    free(b->rec_q);
    b->rec_q = NULL;
    b->rec_len = b->rec_cap = 0;
}
