/*
 * The recorder: pulls from KSCORE_EVENTS (durable pull consumer
 * EVT_RECORDER_DURABLE, explicit ack), appends each event once (unique
 * event_id) in batches, acks only after the commit, then answers the
 * clients waiting for terminal events.
 *
 * Pull, not push: the recorder thread asks for what it will record next
 * (everything ready, up to REC_BATCH, at once: an idle system records each
 * event as it comes, a busy one in batches), and only when it is ready to
 * record. A broker that stops asking (SIGSTOP, a frozen VM, a thread stuck
 * in PostgreSQL) is handed nothing more once its last request is served or
 * expired (REC_FETCH_WAIT_MS), and what it holds comes back to the other
 * brokers after REC_ACK_WAIT_MS. A push consumer shared by a queue group
 * went on handing every other event to a stopped broker until nats-server
 * dropped its connection, each held for the ack wait (10 s) and then
 * possibly handed to it again: one hung broker of two delayed results by
 * up to 60 s (issue 25).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

#define REC_BATCH 1000
#define REC_MAX_ACK_PENDING 20000
/* What a stopped broker's unrecorded messages cost: they go to another
 * broker this long after they were handed out. A broker that holds them
 * while it retries marks them in progress every third of it. */
#define REC_ACK_WAIT_MS 3000
/* How long one pull waits for the first message. Also how long a stopped
 * broker's last request can still be handed messages, and how long a
 * request the consumer's leader held when it died (kill -9 of its node)
 * goes unanswered: nobody tells the puller, the request just expires, so
 * after the election of the recorder's consumer the results waited up to
 * this long (1 s before; test_cluster F02 under load). The cost of a short
 * one: an idle broker asks 4 times a second. */
#define REC_FETCH_WAIT_MS 250
/* After a pull that failed (no connection; nobody serves the consumer
 * while its leader is elected): ask again this soon, so the results wait
 * at most this long once the new leader serves. */
#define REC_PULL_RETRY_MS 100
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

/* Resets the ack wait of the batch in hand: held, not lost (nothing is
 * pulled behind it). */
static void
keep_in_progress(struct broker *b, natsMsg **msgs, size_t n)
{
    (void)b;
    for (size_t i = 0; i < n; i++)
        if (msgs[i])
            natsMsg_InProgress(msgs[i], NULL);
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
        int rc = store_append_checked(b->st_rec, one, 1, broker__admit_bounded,
                                      b, &verdicts[i], NULL);
        if (store_db_sick(rc))
            return rc;
        if (rc == 0)
            continue;
        broker__store_error(b->st_rec, rc, why, sizeof(why));
        char identity[16 + EVT_AGENT_ID_MAX];
        broker__report_identity(b, evs[i]->agent_id, identity,
                                sizeof(identity));
        if (!broker__budget_take(b, identity, 0, BROKER_ANNOTATION_REPORT)) {
            verdicts[i] = STORE_STEP_DROPPED;
            continue;
        }
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
    int64_t since_us, logged_us, noticed_us;
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
    atomic_store(&b->rec_stalled, true);
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
    if (said_now || changed ||
        now - sl->noticed_us >= REC_STALL_LOG_US) {
        /* The clients waiting for results are told at once, and again
         * while it lasts (a waiter that came since hears it too). */
        char text[700];
        snprintf(text, sizeof(text),
                 "waits: its result cannot be recorded now: %s; it is "
                 "recorded once PostgreSQL %s",
                 broker__store_error(b->st_rec, rc, why, sizeof(why)),
                 rc == KS_EPGREFUSED ? "takes writes again" : "is back");
        broker__waiters_notice(b, text);
        sl->noticed_us = now;
    }
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
stall_end(struct broker *b, struct rec_stall *sl)
{
    if (sl->gauge != KS_G__N)
        ks_metric_gauge_add(sl->gauge, -1);
    atomic_store(&b->rec_stalled, false);
    if (sl->noticed_us)
        broker__waiters_notice(b, "goes on: PostgreSQL takes writes again, "
                                  "its result is recorded as it comes");
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
        /* The subject is what NATS permissions vouch for: an agent may only
         * publish under its own id, so an event claiming another agent (or
         * another command) is refused. */
        if (rc || !ks_is_uuid(ev->event_id) || !ks_is_uuid(ev->command_id) ||
            !evt_agent_id_valid(ev->agent_id) || !ev->type[0] ||
            !evt_event_subject_ok(natsMsg_GetSubject(msgs[i]), ev->agent_id,
                                  ev->command_id)) {
            /* A message that can never be recorded: drop it for good
             * rather than redeliver it forever. Said once per message
             * within its sender's share of annotations, then summed up
             * (budget.c): a flood of junk is not a flood of lines. */
            char identity[16 + EVT_AGENT_ID_MAX];
            broker__report_identity(
                b, evt_event_subject_agent(natsMsg_GetSubject(msgs[i]),
                                           want, sizeof(want)),
                identity, sizeof(identity));
            if (broker__budget_take(b, identity, 0,
                                    BROKER_ANNOTATION_REPORT))
                ks_log(KS_LOG_WARN, "dropping an undecodable or "
                                    "misaddressed event",
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
            rc = store_writer_checked_at(b->writer, evs[0], &known,
                                         h->version, broker__admit_bounded, b,
                                         NULL);
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
                                      broker__admit_bounded, b, verdicts,
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
        atomic_store(&b->rec_trouble_us, ks_mono_us());
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
    stall_end(b, &stall);
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
                 verdicts[i] != STORE_STEP_DUPLICATE &&
                 verdicts[i] != STORE_STEP_DROPPED) /* budget.c says */
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

/* At most one "cannot pull" line per this long while it lasts. */
#define REC_PULL_LOG_US INT64_C(10000000)

static void *
recorder_main(void *arg)
{
    struct broker *b = arg;
    int64_t logged = 0;

    while (!b->stopping) {
        natsMsgList list = {0};
        int64_t t0 = ks_mono_us();
        int rc = evt_fetch(b->sub_rec, REC_BATCH, REC_FETCH_WAIT_MS, &list);
        if (rc == 0) {
            for (int i = 0; i < list.Count; i++)
                if (evt_ack_delivered(natsMsg_GetReply(list.Msgs[i])) > 1)
                    ks_metric_inc(KS_C_RECORDER_REDELIVERIES);
            /* record_batch acks and destroys each message. */
            record_batch(b, list.Msgs, (size_t)list.Count);
            list.Count = 0;
            natsMsgList_Destroy(&list);
            logged = 0;
            continue;
        }
        if (rc == KS_ETIMEDOUT) {
            /* Answered at once (the other brokers' requests were first in
             * line for what is there): a moment, not a spin. */
            if (ks_mono_us() - t0 < REC_FETCH_WAIT_MS * 1000 / 2)
                rec_sleep(b, 10);
            continue;
        }
        /* No connection (nats.c reconnects) or no consumer (the scanner's
         * guard makes it again): ask again soon. The ends wait meanwhile
         * (admission: admit.c results_stall_us). */
        atomic_store(&b->rec_trouble_us, ks_mono_us());
        if (!logged || ks_mono_us() - logged >= REC_PULL_LOG_US) {
            logged = ks_mono_us();
            ks_log(KS_LOG_WARN, "recorder cannot pull; asking again",
                   KS_S("module", "recorder"), KS_ERR(rc));
        }
        rec_sleep(b, REC_PULL_RETRY_MS);
    }
    kproto_arena_fini(&rec_arena);
    return NULL;
}

/* The recorder's consumer, as every broker makes it. */
static const struct evt_durable rec_durable = {
    .stream = EVT_STREAM_EVENTS,
    .durable = EVT_RECORDER_DURABLE,
    .filter_subject = "kscore.evt.>",
    .max_ack_pending = REC_MAX_ACK_PENDING,
    /* Redelivery of what a dead or stopped broker had pulled, unrecorded. */
    .ack_wait_ms = REC_ACK_WAIT_MS,
    .pull = true,
};

int
broker__recorder_ensure(struct broker *b, char **errmsg)
{
    int rc = evt_consumer_ensure(b->nc, &rec_durable, NULL, errmsg);
    if (rc)
        return rc;
    /*
     * The push consumer of an older kscore goes once this one exists, never
     * before: KSCORE_EVENTS keeps a message while some consumer has not
     * acked it (interest retention), and nats-server removes what no
     * consumer is left to want when one is deleted (server/consumer.go,
     * stopWithFlags), so replacing the consumer in place would drop every
     * event not yet recorded. The new one delivers everything stored.
     */
    rc = evt_consumer_delete(b->nc, EVT_STREAM_EVENTS,
                             EVT_RECORDER_DURABLE_PUSH);
    if (rc == 0)
        ks_log(KS_LOG_INFO, "the push consumer of an older kscore is "
                            "replaced by the pull consumer",
               KS_S("module", "recorder"),
               KS_S("deleted", EVT_RECORDER_DURABLE_PUSH),
               KS_S("consumer", EVT_RECORDER_DURABLE));
    else if (rc != KS_ENOTFOUND)
        ks_log(KS_LOG_WARN, "cannot delete the push consumer of an older "
                            "kscore; events are recorded, kept until it goes",
               KS_S("module", "recorder"),
               KS_S("consumer", EVT_RECORDER_DURABLE_PUSH), KS_ERR(rc));
    return 0;
}

int
broker__recorder_start(struct broker *b, char **errmsg)
{
    int rc = broker__recorder_ensure(b, errmsg);
    if (rc == 0)
        rc = evt_durable_subscribe(b->nc, &rec_durable, NULL, NULL,
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
    /* The thread's pull ends within REC_FETCH_WAIT_MS; what it pulled but
     * did not record is never acked: another broker (or the next start)
     * gets it after the ack wait. */
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_mutex_unlock(&b->mu);
    if (b->rec_started)
        pthread_join(b->rec_thread, NULL);
    b->rec_started = false;
    if (b->sub_rec) {
        natsSubscription_Unsubscribe(b->sub_rec);
        natsSubscription_Destroy(b->sub_rec);
        b->sub_rec = NULL;
    }
}
