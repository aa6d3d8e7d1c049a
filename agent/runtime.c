/*
 * The agent runtime: consume, check, take a slot, claim, run, report, ack.
 *
 * Threads:
 *  - nats.c delivery thread(s): on_command (check; with a free slot:
 *    claim and submit at once, else queue) and on_cancel;
 *  - starter threads: claim and submit queued messages as slots free up;
 *  - the executor loop thread: job_started (journal), job_done (packs the
 *    result event, queues it, acks the message, passes the slot on);
 *  - the publisher thread: publishes queued events until each has a PubAck;
 *  - the heartbeat thread: KSCORE_AGENTS entries every EVT_HEARTBEAT_MS;
 *  - the keeper thread: keeps held messages in progress, watches contact
 *    with NATS and self-fences.
 *
 * Capacity (K-issue 10.4): a command is claimed only with a free slot. Its
 * JetStream message stays unacked until the command has ended and its
 * result is queued, kept alive with +WPI every ack_wait / 3, so each
 * consumer's max_ack_pending (= max_concurrent) keeps the backlog in
 * JetStream, unclaimed. A process serving several ids has one pool of
 * max_concurrent slots for all of them: a message delivered while the pool
 * is empty waits here, unclaimed (the broker may re-dispatch it meanwhile;
 * the claim fence keeps one run).
 *
 * Lost must be true (10.3, 10.5): the executor loop has a watchdog process
 * that kills every job when this process dies, is stopped or hangs; and
 * when no heartbeat has reached NATS for fence_ms (AGENT_FENCE_MS, 5 s,
 * half the broker's EVT_AGENT_TTL_MS) the keeper kills what runs (the
 * self-fence), so by the time the broker declares these commands Lost they
 * are dead. Either way the result is reported as CommandLost with the
 * reason, never as a normal completion.
 *
 * Results are never lost: each result event is written to
 * <state_dir>/outbox/<event_id> before it is queued and removed after its
 * PubAck; a restarted agent publishes what it finds there first. The
 * Nats-Msg-Id is the event_id, and the recorder appends by unique event_id,
 * so a result published twice is recorded once. The journal (journal.c)
 * tells a restarted agent which commands ran (Lost) and which were claimed
 * but never spawned (claimed again with the journalled claim id).
 *
 * Claims are deterministic (issue 22): a claim is tried with one claim id
 * until a broker answers it, never given up for a new id (the broker
 * grants a repeat of the claim that won), and every command this process
 * holds is listed in its heartbeats (AgentInfo.holds, "claims" below), so
 * the broker can end one it claimed but no longer holds.
 *
 * A graceful stop (agent_drain, agent_stop_graceful) takes no new work and
 * lets what runs finish; agent_stop ends what is left as Lost, the agent
 * stopped, never as a cancel.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "agent_int.h"

#define CLAIM_TIMEOUT_MS 1000 /* a claim is one commit: ~1 ms */
/* Deliveries of a command the record does not have before it is dropped
 * (start_job). */
#define CLAIM_UNRECORDED_TRIES 4
_Static_assert(CLAIM_UNRECORDED_TRIES < EVT_AGENT_MAX_DELIVER,
               "an unrecorded command is dropped before MaxDeliver");
#define PUBLISH_TIMEOUT_MS 2000
/* A heartbeat's wait for the registry stream's PubAck (ms). */
#define HEARTBEAT_TIMEOUT_MS 2000
/* One log line per this much time for a failure that repeats (us). */
#define LOG_EVERY_US (10 * 1000000)
#define AGENT_VERSION "0.1.0"
/* The keeper's period (ms): progress acks, contact, fence. */
#define KEEPER_TICK_MS 200
/* How long an id refused as a duplicate stands aside (us): the broker's
 * window (BROKER_DUP_WINDOW_US), after which a process no longer heard is
 * no longer the other one. */
#define AGENT_ASIDE_US ((int64_t)EVT_AGENT_TTL_MS * 1000)
/* How long the registration (the first heartbeat) is tried again while
 * the registry stream does not answer (ms): register_retrying. */
#define REGISTER_RETRY_MS 30000
/* A heartbeat that failed is tried again this soon (ms). */
#define HEARTBEAT_RETRY_MS 500
/* Threads that claim queued messages (a claim is a round trip). */
#define STARTERS_MAX 32

unsigned
agent_default_max_concurrent(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return (unsigned)(n > 0 ? n : 1) * 4;
}

uint32_t
agent_output_cap(uint32_t spec_cap)
{
    if (spec_cap == 0)
        return EXEC_OUTPUT_CAP_AGENT_DEFAULT;
    return spec_cap < EXEC_OUTPUT_CAP_MAX ? spec_cap : EXEC_OUTPUT_CAP_MAX;
}

/* ---- seen commands (replay guard) ------------------------------------------ */

/*
 * Command ids this process has claimed, newest SEEN_MAX kept (a ring plus a
 * map, the value the attempt + 1). The claim fence in PostgreSQL is the
 * real guarantee; this refuses a replayed message before it costs a claim,
 * and names it a replay. Under a->mu.
 */
#define SEEN_MAX 4096

static uint32_t
seen_attempt_locked(struct agent *a, const char *command_id)
{
    return (uint32_t)(uintptr_t)ks_map_get(&a->seen, command_id);
}

static void
seen_add(struct agent *a, const char *command_id, uint32_t attempt)
{
    pthread_mutex_lock(&a->mu);
    char *slot = a->seen_ring[a->seen_next];
    if (slot[0])
        ks_map_del(&a->seen, slot);
    memcpy(slot, command_id, 37);
    ks_map_put(&a->seen, slot, (void *)(uintptr_t)(attempt + 1));
    a->seen_next = (a->seen_next + 1) % SEEN_MAX;
    pthread_mutex_unlock(&a->mu);
}

/* ---- claims ---------------------------------------------------------------- */

/*
 * The claim j is about to send (struct agent_claim): the one this process
 * already holds for its command (a previous run's, from the journal),
 * else a new one. Either way it is listed in every heartbeat from the
 * next one on: *listed_from gets that heartbeat's number (ClaimRequest.
 * listed_from_seq), taken under the lock heartbeat_once builds the list
 * under, so the list of heartbeat *listed_from and later has it. *prior:
 * it was held before (its id may be recorded already). 0 or -ENOMEM.
 */
static int
claim_take(struct job_ctx *j, char claim_id[37], uint64_t *listed_from,
           bool *prior)
{
    struct agent *a = j->agent;
    struct agent_claim *c;
    int rc = 0;

    pthread_mutex_lock(&a->mu);
    c = ks_map_get(&a->claims, j->command_id);
    *prior = c != NULL;
    if (!c && (c = calloc(1, sizeof(*c)))) {
        ks_uuid(c->claim_id);
        snprintf(c->agent_id, sizeof(c->agent_id), "%s", j->slot->id);
        snprintf(c->operator_name, sizeof(c->operator_name), "%s",
                 j->operator_name);
        if (ks_map_put(&a->claims, j->command_id, c) != 0) {
            free(c);
            c = NULL;
        }
    }
    if (c) {
        c->attempt = j->attempt;
        c->recovered_us = 0; /* held by j now */
        memcpy(claim_id, c->claim_id, 37);
        *listed_from = a->hb_seq + 1;
    } else {
        rc = -ENOMEM;
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

/* The claim of command_id is settled: no longer listed. Any thread. */
static void
claim_drop(struct agent *a, const char *command_id)
{
    pthread_mutex_lock(&a->mu);
    free(ks_map_del(&a->claims, command_id));
    pthread_mutex_unlock(&a->mu);
}

/* true when this process holds a claim of command_id. */
static bool
claim_held(struct agent *a, const char *command_id)
{
    pthread_mutex_lock(&a->mu);
    bool held = ks_map_get(&a->claims, command_id) != NULL;
    pthread_mutex_unlock(&a->mu);
    return held;
}

int
agent__claim_recovered(struct agent *a, const char *command_id,
                       const char *agent_id, uint32_t attempt,
                       const char *operator_name, const char *claim_id)
{
    struct agent_claim *c = calloc(1, sizeof(*c));
    int rc;

    if (!c)
        return -ENOMEM;
    snprintf(c->claim_id, sizeof(c->claim_id), "%s", claim_id);
    snprintf(c->agent_id, sizeof(c->agent_id), "%s", agent_id);
    snprintf(c->operator_name, sizeof(c->operator_name), "%s", operator_name);
    c->attempt = attempt;
    c->recovered_us = ks_mono_us();
    pthread_mutex_lock(&a->mu);
    free(ks_map_del(&a->claims, command_id));
    rc = ks_map_put(&a->claims, command_id, c);
    pthread_mutex_unlock(&a->mu);
    if (rc)
        free(c);
    return rc;
}

struct claims_old {
    struct agent *a;
    int64_t before_us;
    char (*ids)[37];
    size_t n, cap;
};

static void
claim_old_one(const char *key, void *val, void *ud)
{
    struct agent_claim *c = val;
    struct claims_old *o = ud;
    if (!c->recovered_us || c->recovered_us > o->before_us ||
        ks_map_get(&o->a->jobs, key))
        return;
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 8;
        char (*p)[37] = realloc(o->ids, nc * sizeof(*p));
        if (!p)
            return; /* the next tick */
        o->ids = p;
        o->cap = nc;
    }
    memcpy(o->ids[o->n++], key, 37);
}

/*
 * A claim taken up from the journal whose message JetStream has not
 * delivered again within twice the ack wait went elsewhere (another process of
 * the id, or the broker ended the command): it is let go, with its
 * journal file. Nothing is reported for it: if it won, this process may
 * not say how it ended, and the broker ends it (Lost) once no heartbeat of
 * a live process lists it. Keeper thread.
 */
static void
claims_forget_old(struct agent *a, int64_t now)
{
    /* Nak'd at the start, it comes back at once; a message whose nak was
     * lost (or that had no ack subject) comes back after the ack wait. */
    struct claims_old o = {a, now - 2 * (int64_t)a->ack_wait_ms * 1000, NULL,
                           0, 0};

    pthread_mutex_lock(&a->mu);
    ks_map_each(&a->claims, claim_old_one, &o);
    for (size_t i = 0; i < o.n; i++)
        free(ks_map_del(&a->claims, o.ids[i]));
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < o.n; i++) {
        agent__journal_remove(a, o.ids[i]);
        ks_log(KS_LOG_WARN,
               "a claim a previous run left was not delivered again: let go "
               "(if it won, the broker ends the command)",
               KS_S("command_id", o.ids[i]));
    }
    free(o.ids);
}

/* ---- acks ------------------------------------------------------------------ */

/*
 * Acks are publishes to the delivery's reply subject (the JetStream ack
 * protocol: "+ACK", "-NAK", "+WPI", "+TERM"), so a message can be acked
 * after its natsMsg and even its subscription are gone, or by a restarted
 * agent from the journal. Lost while NATS is down, they are sent from
 * nats.c's reconnect buffer; lost for good, JetStream redelivers after the
 * ack wait and the claim fence refuses the second claim.
 */
void
agent__ack(struct agent *a, const char *ack_subject, const char *what)
{
    if (!ack_subject || !ack_subject[0] || !a->nc)
        return;
    natsConnection_Publish(a->nc->nc, ack_subject, what, (int)strlen(what));
}

/* A nak with a redelivery delay (nats-server 2.7.1+). */
static void
nak_delay(struct agent *a, const char *ack_subject, int64_t delay_ms)
{
    char buf[64];
    snprintf(buf, sizeof(buf), "-NAK {\"delay\": %" PRId64 "}",
             delay_ms * 1000000);
    agent__ack(a, ack_subject, buf);
}

/*
 * The redelivery delay of a message the state dir could not journal (full,
 * read-only): 1 s doubling to 8 s by JetStream's delivery count, so that
 * the EVT_AGENT_MAX_DELIVER deliveries of one attempt span some 20 s of a
 * full disk (then the broker re-dispatches: advisory.c) instead of 5.
 */
static int64_t
state_retry_ms(uint64_t delivered)
{
    unsigned shift = delivered > 1 ? (unsigned)(delivered - 1) : 0;
    return shift >= 3 ? 8000 : 1000 << shift;
}

/* ---- outbox --------------------------------------------------------------- */

static void
outbox_path(struct agent *a, const char *event_id, char *buf, size_t len)
{
    snprintf(buf, len, "%s/outbox/%s", a->state_dir, event_id);
}

static void
outbox_push(struct agent *a, struct outbox_item *it)
{
    pthread_mutex_lock(&a->mu);
    it->next = NULL;
    *a->out_tail = it;
    a->out_tail = &it->next;
    pthread_cond_signal(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
}

int
agent__queue_event(struct agent *a, const Ks__Event *ev)
{
    return agent__queue_event_opt(a, ev, true);
}

int
agent__queue_event_opt(struct agent *a, const Ks__Event *ev, bool persist)
{
    struct outbox_item *it = calloc(1, sizeof(*it));
    int rc;

    if (!it)
        return -ENOMEM;
    rc = kproto_pack(&ev->base, &it->buf, &it->len);
    if (rc) {
        free(it);
        return rc;
    }
    snprintf(it->event_id, sizeof(it->event_id), "%s", ev->event_id);
    snprintf(it->agent_id, sizeof(it->agent_id), "%s", ev->agent_id);
    snprintf(it->command_id, sizeof(it->command_id), "%s", ev->command_id);
    evt_event_subject(it->subject, sizeof(it->subject), ev->agent_id,
                      ev->command_id);
    if (a->state_dir && persist) {
        char path[4096];
        outbox_path(a, it->event_id, path, sizeof(path));
        /* No fsync: the file outlives a crash of the agent process (the
         * page cache is the kernel's), which is what it is for; a crash of
         * the whole machine also loses JetStream's unsynced data, and the
         * command then ends Lost. An fdatasync here cost 1-3 ms on every
         * command. Written whole, then renamed into place (a spare file:
         * agent__file_put). A state dir that takes no more (full,
         * read-only) does not hold the event back: it goes out from
         * memory, and only a crash before its PubAck would lose it. */
        rc = agent__file_put(a, path, it->buf, it->len);
        if (rc) {
            ks_metric_inc(KS_C_AGENT_STATE_WRITE_ERRORS);
            if (agent__log_due(&a->outbox_err_logged_us))
                ks_log(KS_LOG_ERROR,
                       "cannot save an event in the outbox: it is published "
                       "from memory only",
                       KS_S("module", "outbox"), KS_S("type", ev->type),
                       KS_S("command_id", it->command_id),
                       KS_S("error", strerror(-rc)),
                       KS_S("state_dir", a->state_dir));
        }
    }
    ks_trace("agent.event_queued", it->command_id);
    outbox_push(a, it);
    return 0;
}

static void
outbox_load(struct agent *a)
{
    char dir[4096];
    DIR *d;
    struct dirent *de;

    snprintf(dir, sizeof(dir), "%s/outbox", a->state_dir);
    d = opendir(dir);
    if (!d)
        return;
    while ((de = readdir(d))) {
        char path[4400];
        struct stat st;
        if (!ks_is_uuid(de->d_name))
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        if (fstat(fd, &st) == 0 && st.st_size > 0 &&
            st.st_size <= KS_MAX_MESSAGE_BYTES) {
            struct outbox_item *it = calloc(1, sizeof(*it));
            Ks__Event *ev = NULL;
            if (it && (it->buf = malloc((size_t)st.st_size)) &&
                read(fd, it->buf, (size_t)st.st_size) == st.st_size &&
                (ev = ks__event__unpack(NULL, (size_t)st.st_size, it->buf))) {
                it->len = (size_t)st.st_size;
                memcpy(it->event_id, de->d_name, 36);
                it->event_id[36] = '\0';
                evt_event_subject(it->subject, sizeof(it->subject),
                                  ev->agent_id, ev->command_id);
                snprintf(it->agent_id, sizeof(it->agent_id), "%s",
                         ev->agent_id);
                ks__event__free_unpacked(ev, NULL);
                outbox_push(a, it);
                it = NULL;
            }
            if (it) {
                free(it->buf);
                free(it);
            }
        }
        close(fd);
    }
    closedir(d);
}

/* Takes it, the outbox's head, off the outbox and frees it. Publisher
 * thread (the only one that removes items). */
static void
outbox_pop(struct agent *a, struct outbox_item *it)
{
    pthread_mutex_lock(&a->mu);
    a->out_head = it->next;
    if (!a->out_head)
        a->out_tail = &a->out_head;
    pthread_mutex_unlock(&a->mu);
    free(it->buf);
    free(it);
}

/* Events published per round trip: up to this many outbox items go out
 * at once (evt_js_publish_window). One at a time, a pool of 500 ids
 * spent seconds waiting for PubAcks one by one (a replicated stream's
 * PubAck takes milliseconds). */
#define PUB_WINDOW 64
/* A window the stream did not take is tried again after 50 ms, doubling
 * to this. It is also how late results go out once KSCORE_EVENTS has a
 * leader again after an election (1 s before: a post-election burst's
 * results waited for it, test_cluster F02). While NATS is gone, a window
 * 4 times a second costs nothing worth saving. */
#define PUB_BACKOFF_MAX_MS 250

/* The first items of the outbox that can go out together: one identity
 * (in a pool, the process's own: its credential is the pool's), and no
 * two events of one command, so a command's events are stored in the
 * order they were queued. Under a->mu. */
static size_t
window_take(struct agent *a, struct outbox_item **win, size_t max)
{
    size_t n = 0;
    bool pooled = a->opts.pool != NULL;

    for (struct outbox_item *it = a->out_head; it && n < max; it = it->next) {
        bool clash = false;
        for (size_t k = 0; k < n && !clash; k++)
            clash = strcmp(win[k]->command_id, it->command_id) == 0 ||
                    (!pooled && strcmp(win[k]->agent_id, it->agent_id) != 0);
        if (clash)
            break;
        win[n++] = it;
    }
    return n;
}

static void *
publisher_main(void *arg)
{
    struct agent *a = arg;
    int backoff_ms = 50, stop_tries = 0;
    struct outbox_item *win[PUB_WINDOW];
    struct evt_js_msg msgs[PUB_WINDOW];

    for (;;) {
        size_t n;
        pthread_mutex_lock(&a->mu);
        while (!a->out_head && !(a->stopping && a->in_flight == 0))
            pthread_cond_wait(&a->out_cond, &a->mu);
        if (!a->out_head) {
            pthread_mutex_unlock(&a->mu);
            break;
        }
        n = window_take(a, win, PUB_WINDOW);
        pthread_mutex_unlock(&a->mu);

        /* Publishes to the stream's subject whose PubAcks come back to
         * this id's own inbox (no JetStream API: events.h). A duplicate
         * PubAck is a success: the stream has it. */
        char ident[8 + EVT_AGENT_ID_MAX];
        evt_agent_durable(ident, sizeof(ident), win[0]->agent_id);
        for (size_t i = 0; i < n; i++) {
            ks_trace("agent.event_publish", win[i]->command_id);
            msgs[i] = (struct evt_js_msg){.subject = win[i]->subject,
                                          .msg_id = win[i]->event_id,
                                          .data = win[i]->buf,
                                          .len = win[i]->len};
        }
        int rc = evt_js_publish_window(a->nc,
                                       a->opts.pool ? a->pool_identity : ident,
                                       msgs, n, PUBLISH_TIMEOUT_MS);
        /* The stream has the leading ones that succeeded: they leave the
         * outbox. From the first failure on, all stay (one that did get
         * in is a duplicate next time, which is a success). */
        size_t done = 0;
        while (done < n && msgs[done].rc == 0)
            done++;
        for (size_t i = 0; i < done; i++) {
            struct outbox_item *it = win[i];
            ks_trace("agent.event_acked", it->command_id);
            if (a->state_dir) {
                char path[4096];
                outbox_path(a, it->event_id, path, sizeof(path));
                agent__file_drop(a, path);
            }
            outbox_pop(a, it);
        }
        if (rc == 0) {
            backoff_ms = 50;
            continue;
        }
        struct outbox_item *it = win[done];
        rc = msgs[done].rc;
        {
            int64_t now = ks_mono_us();
            if (now - a->pub_err_logged_us > LOG_EVERY_US) {
                a->pub_err_logged_us = now;
                ks_log(KS_LOG_WARN,
                       "the event stream did not take an event (kept, tried "
                       "again)",
                       KS_S("stream", EVT_STREAM_EVENTS),
                       KS_S("event_id", it->event_id),
                       KS_S("agent", it->agent_id), KS_ERR(rc));
            }
        }
        /* NATS down or restarting: keep it and try again. At stop we give
         * up after the current try; the file stays in the outbox for the
         * next start. Without a state dir there is no file: a few more
         * tries, then it is lost, said so, rather than an agent that never
         * exits (a revoked agent's connection never comes back). */
        if (a->stopping && !a->state_dir && ++stop_tries > 5) {
            ks_log(KS_LOG_WARN,
                   "stopping: an event could not be reported and there is "
                   "no state dir to keep it (lost)",
                   KS_S("event_id", it->event_id),
                   KS_S("agent", it->agent_id), KS_ERR(rc));
        }
        if (a->stopping && (a->state_dir || stop_tries > 5)) {
            outbox_pop(a, it);
            continue;
        }
        /* tv_nsec must stay below 1 s: at 1600 ms nanosleep failed with
         * EINVAL at once and this loop spun a CPU for as long as NATS was
         * gone. */
        nanosleep(&(struct timespec){backoff_ms / 1000,
                                     (long)(backoff_ms % 1000) * 1000000L},
                  NULL);
        backoff_ms = backoff_ms * 2 > PUB_BACKOFF_MAX_MS ? PUB_BACKOFF_MAX_MS
                                                        : backoff_ms * 2;
    }
    return NULL;
}


/* ---- held messages ------------------------------------------------------------ */

static void
job_free(struct job_ctx *j)
{
    if (!j)
        return;
    agent__payload_free(j->payload); /* its private files, whatever the end */
    free(j->end_reason);
    free(j->ack_subject);
    if (j->cmd)
        ks__command__free_unpacked(j->cmd, NULL);
    free(j);
}

/*
 * The end of a held message: out of the map, its slot to the oldest
 * waiting message (or back to the pool), then the ack payload `what` (NULL:
 * none). The slot passes on before the ack, so the message JetStream sends
 * for the ack finds it taken only if one already waits here. Any thread.
 */
static void
job_release(struct job_ctx *j, const char *what)
{
    struct agent *a = j->agent;

    pthread_mutex_lock(&a->mu);
    if (ks_map_get(&a->jobs, j->command_id) == j)
        ks_map_del(&a->jobs, j->command_id);
    if (j->state != JOB_WAITING) {
        struct job_ctx *next = a->waitq;
        if (next && !atomic_load(&a->closing) &&
            !atomic_load(&a->draining)) {
            a->waitq = next->qnext;
            if (!a->waitq)
                a->waitq_tail = &a->waitq;
            next->state = JOB_STARTING;
            next->qnext = NULL;
            *a->readyq_tail = next;
            a->readyq_tail = &next->qnext;
            pthread_cond_signal(&a->ready_cond);
        } else {
            a->free_slots++;
        }
    }
    pthread_mutex_unlock(&a->mu);
    if (what)
        agent__ack(a, j->ack_subject, what);
    job_free(j);
}

/* Queues a command event of j: type, result r (may be NULL), reason. */
/* Metrics of a command this agent ends (proto/metrics.c). */
static void
note_end(const char *type, const Ks__CommandResult *r)
{
    Ks__CommandStatus st = r ? r->status : 0;
    if (strcmp(type, "CommandStartFailed") == 0)
        st = KS__COMMAND_STATUS__START_FAILED;
    else if (strcmp(type, "CommandLost") == 0)
        st = KS__COMMAND_STATUS__LOST;
    else if (strcmp(type, "CommandNotStarted") == 0)
        st = KS__COMMAND_STATUS__NOT_STARTED;
    else if (strcmp(type, "CommandCompleted") != 0)
        return;
    else if (!st && r)
        st = r->cancelled   ? KS__COMMAND_STATUS__CANCELLED
             : r->timed_out ? KS__COMMAND_STATUS__TIMED_OUT
             : r->has_exit_code && r->exit_code == 0
                 ? KS__COMMAND_STATUS__SUCCEEDED
                 : KS__COMMAND_STATUS__FAILED;
    ks_metric_status_inc(KS_SC_AGENT_COMMANDS, st);
    if (r && r->duration_us > 0)
        ks_metric_observe_us(KS_H_AGENT_COMMAND, r->duration_us);
}

static void
report(struct job_ctx *j, const char *type, Ks__CommandResult *r,
       const char *reason)
{
    Ks__Event ev = KS__EVENT__INIT;
    char event_id[37], stream[64];

    ks_uuid(event_id);
    snprintf(stream, sizeof(stream), "command-%s", j->command_id);
    ev.event_id = event_id;
    ev.stream_id = stream;
    ev.type = (char *)type;
    ev.occurred_at_us = ks_now_us();
    ev.command_id = j->command_id;
    ev.agent_id = j->slot->id;
    ev.attempt = j->attempt;
    ev.operator_ = j->operator_name;
    ev.reason = (char *)reason;
    ev.result = r;
    note_end(type, r);
    if (agent__queue_event(j->agent, &ev) != 0)
        ks_log(KS_LOG_ERROR, "cannot queue an event", KS_S("type", type),
               KS_S("command_id", j->command_id), KS_S("agent", j->slot->id),
               KS_I("attempt", j->attempt));
}

/* ---- results --------------------------------------------------------------- */

static void
fill_result(Ks__CommandResult *r, Ks__Output *o, Ks__Output *e,
            const struct exec_result *x)
{
    ks__command_result__init(r);
    ks__output__init(o);
    ks__output__init(e);
    o->data.data = (uint8_t *)x->out.data;
    o->data.len = x->out.len;
    o->total_bytes = x->out.total;
    o->truncated = x->out.truncated;
    e->data.data = (uint8_t *)x->err.data;
    e->data.len = x->err.len;
    e->total_bytes = x->err.total;
    e->truncated = x->err.truncated;
    r->stdout = o;
    r->stderr = e;
    r->started_at_us = x->started_at_us;
    r->finished_at_us = x->finished_at_us;
    r->duration_us = x->duration_us;
    r->term_sent_us = x->term_sent_us;
    r->kill_sent_us = x->kill_sent_us;
    r->utime_us = x->utime_us;
    r->stime_us = x->stime_us;
    r->maxrss_kb = x->maxrss_kb;
    r->signalled = x->signalled;
    r->survivors = x->survivors;
    r->pid = x->pid;
    r->timed_out = x->timed_out;
    r->cancelled = x->cancelled;
    switch (x->outcome) {
    case EXEC_EXITED:
        r->has_exit_code = 1;
        r->exit_code = x->exit_code;
        r->status = x->exit_code == 0 ? KS__COMMAND_STATUS__SUCCEEDED
                                      : KS__COMMAND_STATUS__FAILED;
        break;
    case EXEC_SIGNALED:
        r->signal = x->signal;
        r->core_dumped = x->core_dumped;
        r->status = KS__COMMAND_STATUS__FAILED;
        break;
    case EXEC_STATUS_LOST:
        /* It ran, but how it ended is unknown: neither success nor a
         * failure of its own (job_done gives the reason). */
        r->status = KS__COMMAND_STATUS__LOST;
        break;
    case EXEC_START_FAILED:
        r->status = KS__COMMAND_STATUS__START_FAILED;
        r->start_stage = (char *)(x->start_stage ? x->start_stage : "");
        r->start_errno = x->start_errno;
        break;
    }
    /* The kill protocol's reason wins over how the child ended. */
    if (x->outcome != EXEC_START_FAILED) {
        if (x->cancelled)
            r->status = KS__COMMAND_STATUS__CANCELLED;
        else if (x->timed_out)
            r->status = KS__COMMAND_STATUS__TIMED_OUT;
    }
}

static void
job_started(uint64_t job_id, pid_t pid, void *ud)
{
    struct job_ctx *j = ud;

    (void)job_id;
    ks_trace("agent.spawned", j->command_id);
    /* Its pid, over the mark written before the submit (the restart's
     * Lost report names it). */
    (void)agent__journal_spawned(j->agent, j, pid); /* logged, counted */
}

static void
job_done(uint64_t job_id, struct exec_result *x, void *ud)
{
    struct job_ctx *j = ud;
    struct agent *a = j->agent;
    Ks__CommandResult r;
    Ks__Output o, e;
    const char *type;
    char reason[200] = "";
    bool fenced, stopped;
    int64_t silence_us;

    (void)job_id;
    ks_trace("agent.exited", j->command_id);
    pthread_mutex_lock(&a->mu);
    fenced = j->fenced;
    silence_us = j->fence_silence_us;
    /* Cancelled by agent_stop (a copy's fetch given up at closing, or
     * the executor's stop), not by an operator: the agent stopped. */
    stopped = (atomic_load(&a->stop_killing) || atomic_load(&a->closing)) &&
              !j->op_cancelled && x->cancelled;
    pthread_mutex_unlock(&a->mu);
    fill_result(&r, &o, &e, x);
    ks_log(KS_LOG_DEBUG, "command finished", KS_S("command_id", j->command_id),
           KS_S("agent", j->slot->id), KS_I("attempt", j->attempt),
           KS_S("outcome", x->outcome == EXEC_EXITED       ? "exited"
                           : x->outcome == EXEC_SIGNALED   ? "signaled"
                           : x->outcome == EXEC_STATUS_LOST ? "status_lost"
                                                           : "start_failed"),
           KS_I("exit_code", x->exit_code), KS_I("signal", x->signal));
    agent__out_finish(j, x, &o, &e);
    /* Its private files (a script, stdin, a copy's parts) go before its
     * end is reported: whoever reads the end may count on them gone
     * (test_payload saw the script still there after exec returned). */
    agent__payload_free(j->payload);
    j->payload = NULL;
    type = x->outcome == EXEC_START_FAILED ? "CommandStartFailed"
                                           : "CommandCompleted";
    /* Killed because nobody could vouch for it any more: the record is
     * told so, never a normal completion. */
    if (x->watchdog_killed && x->outcome != EXEC_START_FAILED) {
        type = "CommandLost";
        r.status = KS__COMMAND_STATUS__LOST;
        snprintf(reason, sizeof(reason),
                 "killed by the agent's watchdog: the agent was stopped or "
                 "hung for %.1f s",
                 (double)x->watchdog_silence_ms / 1000);
    } else if (fenced && x->outcome != EXEC_START_FAILED) {
        type = "CommandLost";
        r.status = KS__COMMAND_STATUS__LOST;
        snprintf(reason, sizeof(reason),
                 "agent lost contact with NATS for %.1f s: its processes "
                 "were killed (self-fence)",
                 (double)silence_us / 1e6);
    } else if (x->outcome == EXEC_STATUS_LOST &&
               r.status == KS__COMMAND_STATUS__LOST) {
        type = "CommandLost";
        snprintf(reason, sizeof(reason),
                 "the command ran but its exit status was lost (wait: %s): "
                 "something else reaped it",
                 strerror(x->wait_errno));
        if (agent__log_due(&a->status_lost_logged_us))
            ks_log(KS_LOG_ERROR,
                   "a command's exit status was lost: reported Lost (does "
                   "something reap the agent's children?)",
                   KS_S("command_id", j->command_id),
                   KS_S("error", strerror(x->wait_errno)));
    } else if (fenced && x->killed) {
        /* Killed by the fence before the executor spawned it. */
        type = "CommandNotStarted";
        r.status = KS__COMMAND_STATUS__NOT_STARTED;
        snprintf(reason, sizeof(reason),
                 "agent lost contact with NATS for %.1f s before it could "
                 "spawn the command (self-fence)",
                 (double)silence_us / 1e6);
    } else if (stopped && x->outcome == EXEC_START_FAILED) {
        /* Queued in the executor when the agent stopped: never spawned. */
        type = "CommandNotStarted";
        r = (Ks__CommandResult)KS__COMMAND_RESULT__INIT;
        r.status = KS__COMMAND_STATUS__NOT_STARTED;
        r.term_sent_us = r.kill_sent_us = -1;
        snprintf(reason, sizeof(reason),
                 "the agent stopped before it spawned the command");
    } else if (x->outcome == EXEC_START_FAILED && x->cancelled) {
        /* Cancelled after its claim, before the executor spawned it (the
         * cancel came before the claim's reply, or with it: two brokers,
         * two paths): the executor calls that a start failure, but
         * nothing failed to start; it was cancelled and never ran. */
        type = "CommandCompleted";
        r.status = KS__COMMAND_STATUS__CANCELLED;
        r.cancelled = 1;
        r.start_stage = (char *)"";
        r.start_errno = 0;
        /* (a copy's fetch says where it was) */
        snprintf(reason, sizeof(reason), "%s",
                 j->end_reason ? j->end_reason
                               : "cancelled before it was spawned: it never "
                                 "ran");
    } else if (stopped) {
        /* Nobody cancelled it: the agent was stopped (SIGTERM) and its
         * drain timeout passed, or it stopped without one. The kill
         * protocol ended it (TERM, grace, KILL to its group). */
        type = "CommandLost";
        r.status = KS__COMMAND_STATUS__LOST;
        r.cancelled = 0;
        snprintf(reason, sizeof(reason),
                 "the agent stopped while the command ran (drain timeout "
                 "%.0f s): its processes were stopped (TERM, then KILL "
                 "after the grace)",
                 (double)a->drain_ms / 1000);
    }
    if (!reason[0] && j->end_reason)
        snprintf(reason, sizeof(reason), "%s", j->end_reason);
    if (reason[0])
        r.reason = reason;
    report(j, type, &r, reason[0] ? reason : NULL);
    agent__journal_remove(a, j->command_id);
    /* Its end is queued (the outbox is listed until its PubAck). */
    claim_drop(a, j->command_id);
    exec_result_release(x);
    pthread_mutex_lock(&a->mu);
    a->in_flight--;
    pthread_cond_broadcast(&a->idle_cond);
    pthread_cond_signal(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
    /* The result is in the outbox: JetStream may forget the message. */
    job_release(j, "+ACK");
}

/* ---- commands -------------------------------------------------------------- */

static void
reject(struct agent_slot *slot, const char *command_id, uint32_t attempt,
       const char *reason)
{
    Ks__Event ev = KS__EVENT__INIT;
    char event_id[37], stream[64];
    ks_uuid(event_id);
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    ev.event_id = event_id;
    ev.stream_id = stream;
    ev.type = "CommandRejected";
    ev.occurred_at_us = ks_now_us();
    ev.command_id = (char *)command_id;
    ev.agent_id = slot->id;
    ev.attempt = attempt;
    ev.reason = (char *)reason;
    agent__queue_event(slot->agent, &ev);
}

/* Whether a claim's reply is the broker's last word on it. A failure of
 * its store is not (the claim's commit is in doubt): the claim is tried
 * again, with the same claim id. */
static bool
claim_answered(const Ks__ClaimReply *rep)
{
    if (rep->granted)
        return true;
    switch (rep->error_code) {
    case KS_ECLAIMED:
    case KS_ENOTFOUND:
    case KS_EDENIED:
    case KS_EDUPINSTANCE:
    case KS_EINVAL:
    case KS_EDECODE:
    case KS_ETOOBIG:
        return true;
    default:
        return false;
    }
}

/* Between two tries of a claim (ms): 50 doubling to 1 s. */
#define CLAIM_PAUSE_MIN_MS 50
#define CLAIM_PAUSE_MAX_MS 1000

/*
 * Claims the command through the broker with the claim event event_id,
 * listed in this process's heartbeats from number listed_from on. Tried
 * with the same event_id until the broker answers (claim_answered): a
 * claim whose reply was lost, or whose broker restarted or could not
 * reach its store, may have won, and the broker grants a repeat of the
 * claim that won (broker.c on_claim). 1 granted, 0 lost, a negative code
 * the broker answered with, or KS_ESTOPPED: agent_stop came first and
 * the claim's fate is unknown.
 */
static int
claim(struct agent *a, struct agent_slot *slot, const Ks__Command *cmd,
      Ks__CommandResult *start_failure, const char *event_id,
      uint64_t listed_from)
{
    Ks__ClaimRequest req = KS__CLAIM_REQUEST__INIT;
    Ks__ClaimReply *rep = NULL;
    natsMsg *m = NULL;
    int rc = 0;

    /* The broker takes the claimer from the subject (and replies to its
     * inbox): agent-<id>, which the NATS permissions grant this id's user
     * (deploy/nats-auth.conf.in). One process may serve several ids. */
    const char *claimer = slot->identity;
    req.command_id = cmd->command_id;
    req.attempt = cmd->attempt;
    req.agent_id = slot->id;
    req.event_id = (char *)event_id;
    req.expected_version = cmd->dispatch_version;
    req.start_failure = start_failure;
    req.operator_ = cmd->operator_;
    req.instance_id = a->instance_id;
    req.listed_from_seq = listed_from;
    /* The first ask goes to the brokers' queue group, which may hand it to
     * a stopped broker (nats-server keeps one in the group while it has
     * messages to hand it); every ask again goes to all of them
     * (EVT_API_CLAIM_AGAIN), and the first answer counts: the claim fence
     * lets one append of the claim win, and a repeat of it is granted as
     * ours. */
    int pause_ms = CLAIM_PAUSE_MIN_MS;
    ks_trace("agent.claim_sent", cmd->command_id);
    /* In a pool the claim still names agent-<id> (its subject: the
     * broker's check, and the pool's NATS permissions list each of its
     * ids), but the reply comes to the pool's own inbox, the one inbox
     * its credential may read. */
    char pool_subject[sizeof(EVT_API_CLAIM_AGAIN) + 16 + EVT_AGENT_ID_MAX];
    uint8_t *pool_req = NULL;
    size_t pool_req_len = 0;
    if (a->opts.pool && (rc = kproto_pack(&req.base, &pool_req,
                                          &pool_req_len)))
        return rc;
    for (bool again = false;; again = true) {
        if (atomic_load(&a->closing)) {
            rc = KS_ESTOPPED;
            break;
        }
        int64_t t0 = ks_mono_us();
        const char *api = again ? EVT_API_CLAIM_AGAIN : EVT_API_CLAIM;
        if (pool_req) {
            snprintf(pool_subject, sizeof(pool_subject), "%s.%s", api,
                     claimer);
            rc = evt_request_bytes_as(a->nc, a->pool_identity, pool_subject,
                                      NULL,
                                      pool_req, pool_req_len,
                                      CLAIM_TIMEOUT_MS, &m);
        } else {
            rc = evt_request_as(a->nc, claimer, api, &req.base,
                                CLAIM_TIMEOUT_MS, &m);
        }
        if (rc == 0) {
            ProtobufCMessage *pm = NULL;
            ks_metric_observe_us(KS_H_AGENT_CLAIM, ks_mono_us() - t0);
            rc = evt_unpack(&ks__claim_reply__descriptor, natsMsg_GetData(m),
                            (size_t)natsMsg_GetDataLength(m), &pm);
            natsMsg_Destroy(m);
            m = NULL;
            rep = (Ks__ClaimReply *)pm;
            if (rc == 0 && claim_answered(rep))
                break;
            if (rc == 0)
                rc = rep->error_code;
            if (rep)
                ks__claim_reply__free_unpacked(rep, NULL);
            rep = NULL;
        }
        /* No broker (restarting: "no responders"), no reply in time, or
         * its store failed: the claim may have won, so it is not given up
         * and never made again under another id. */
        if (agent__log_due(&a->claim_err_logged_us))
            ks_log(KS_LOG_WARN,
                   "a claim has no answer yet: tried again with the same "
                   "claim id",
                   KS_S("command_id", cmd->command_id),
                   KS_S("agent", slot->id), KS_S("claim_id", event_id),
                   KS_ERR(rc));
        nanosleep(&(struct timespec){pause_ms / 1000,
                                     (long)(pause_ms % 1000) * 1000000L},
                  NULL);
        pause_ms = pause_ms * 2 > CLAIM_PAUSE_MAX_MS ? CLAIM_PAUSE_MAX_MS
                                                     : pause_ms * 2;
    }
    free(pool_req);
    if (rc)
        return rc;
    ks_trace("agent.claim_granted", cmd->command_id);
    if (!rep->granted && rep->error_code == KS_EDUPINSTANCE) {
        /* Another, older process serves this id, as the broker sees it:
         * this one must not run its commands while that one is live. It
         * stands aside (aside_tick) instead of stopping for good: the
         * broker's word may come from a forged registry entry (issue 21),
         * and when the other process is gone this one serves again. */
        _Atomic int64_t *until = a->opts.pool ? &a->pool_aside_until_us
                                              : &slot->aside_until_us;
        int64_t now = ks_mono_us();
        if (atomic_exchange(until, now + AGENT_ASIDE_US) <= now)
            ks_log(KS_LOG_ERROR,
                   "another agent process serves this id: this one stands "
                   "aside (no deliveries) and claims again in 10 s",
                   KS_S("agent", slot->id), KS_S("instance", a->instance_id),
                   KS_S("error", rep->error));
    }
    rc = rep->granted ? 1 : (rep->error_code == KS_ECLAIMED ? 0
                                                            : rep->error_code);
    if (rc == 0)
        ks_metric_inc(KS_C_AGENT_CLAIMS_LOST);
    ks__claim_reply__free_unpacked(rep, NULL);
    return rc;
}

static void heartbeat_poke(struct agent *a);

static int subscribe_deliver(struct agent *a, natsSubscription **sub,
                             const char *deliver, const char *group,
                             natsMsgHandler cb, void *ud, char **errmsg);
static void on_command(natsConnection *nc, natsSubscription *sub,
                       natsMsg *msg, void *ud);
static void on_pool_command(natsConnection *nc, natsSubscription *sub,
                            natsMsg *msg, void *ud);

/*
 * One deliver subscription (a slot's, or the pool's: slot NULL) standing
 * aside while *until (mono us) is ahead, and back after. Aside, JetStream
 * gives the id's messages to the other process of its queue group, not to
 * this one to hand back (each hand-back costs one of its
 * EVT_AGENT_MAX_DELIVER deliveries); back, the next claim asks the broker
 * again. Commands already running go on. Keeper thread.
 */
static void
aside_one(struct agent *a, struct agent_slot *slot, natsSubscription **sub,
          bool *aside, _Atomic int64_t *until, int64_t now)
{
    bool want = atomic_load(until) > now;
    const char *name = slot ? slot->id : a->pool_name;

    if (want == *aside)
        return;
    pthread_mutex_lock(&a->sub_mu);
    if (atomic_load(&a->closing) || atomic_load(&a->draining)) {
        pthread_mutex_unlock(&a->sub_mu);
        return;
    }
    if (want) {
        natsSubscription_Unsubscribe(*sub);
        *aside = true;
    } else {
        char durable[8 + EVT_AGENT_ID_MAX], deliver[32 + EVT_AGENT_ID_MAX];
        natsSubscription *fresh = NULL;
        char *err = NULL;
        if (slot)
            snprintf(durable, sizeof(durable), "%s", slot->identity);
        else
            evt_pool_durable(durable, sizeof(durable), a->pool_name);
        evt_deliver_subject(deliver, sizeof(deliver), durable);
        if (subscribe_deliver(a, &fresh, deliver, durable,
                              slot ? on_command : on_pool_command,
                              slot ? (void *)slot : (void *)a, &err) == 0) {
            natsSubscription_Destroy(*sub);
            *sub = fresh;
            *aside = false;
        } else {
            ks_log(KS_LOG_WARN, "cannot take deliveries again (tried again)",
                   KS_S("agent", name), KS_S("error", err ? err : "?"));
        }
        free(err);
    }
    pthread_mutex_unlock(&a->sub_mu);
    if (want)
        ks_log(KS_LOG_WARN, "standing aside: no deliveries for this id",
               KS_S("agent", name));
    else if (!*aside)
        ks_log(KS_LOG_INFO, "taking deliveries again for this id",
               KS_S("agent", name));
}

static void
aside_tick(struct agent *a, int64_t now)
{
    if (a->pool_sub) {
        aside_one(a, NULL, &a->pool_sub, &a->pool_aside,
                  &a->pool_aside_until_us, now);
        return;
    }
    for (size_t i = 0; i < a->n_slots; i++)
        if (a->slots[i].sub)
            aside_one(a, &a->slots[i], &a->slots[i].sub, &a->slots[i].aside,
                      &a->slots[i].aside_until_us, now);
}

/*
 * Fenced, yet a claim just went through: NATS may be back before the next
 * heartbeat says so. Asks for one and waits for it (up to a heartbeat
 * period). true if heartbeats reach NATS again.
 */
static bool
contact_regained(struct agent *a)
{
    int64_t asked = ks_mono_us();

    heartbeat_poke(a);
    while (ks_mono_us() - asked < (int64_t)EVT_HEARTBEAT_MS * 1000 &&
           !atomic_load(&a->closing)) {
        if (atomic_load(&a->last_contact_us) >= asked)
            return true;
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
    return false;
}

/*
 * After the claim: a copy's files (payload.c), then the spawn. A fetch
 * that fails ends the command StartFailed (stage fetch) with the reason;
 * one given up for a cancel ends it Cancelled, for the agent's stop
 * NotStarted (job_done). spec is what start_job made; cmd stays the
 * caller's. Starter, delivery or fetch thread.
 */
static void
spawn_claimed(struct job_ctx *j, const Ks__Command *cmd,
              const struct exec_spec *spec)
{
    struct agent *a = j->agent;
    char why[512] = "";
    uint64_t job_id = 0;
    int rc;

    const char *claimed_stage = "spawn";
    rc = agent__payload_fetch(a, j, cmd, why, sizeof(why));
    if (rc) {
        claimed_stage = "fetch";
        j->end_reason = strdup(why);
        if (rc != -ECANCELED)
            ks_log(KS_LOG_WARN,
                   "a copy's fetch failed: the command ends StartFailed",
                   KS_S("command_id", j->command_id),
                   KS_S("agent", j->slot->id), KS_S("reason", why));
    } else {
        /* Its output as it is written (output.c); without, only the end. */
        agent__out_new(j);
    }
    /* Journalled as spawned before the executor may spawn it: from here a
     * restart calls it Lost, never "claimed, not spawned" (which it claims
     * again and runs). Written after the spawn, the mark lost a race with
     * the child: kill -9 of the agent once its child had run and before
     * the loop thread wrote the mark ran the command twice (test_record
     * k25_agent_dies_mid_run, a loaded make test: "run" twice). A crash
     * before the spawn now reports Lost for a command that did not run:
     * never twice is what matters. job_started writes the pid. */
    if (rc == 0)
        (void)agent__journal_spawned(a, j, 0); /* logged, counted */
    /* Held across the submit, so job_done (which takes mu) cannot free j
     * before it has its job id. */
    pthread_mutex_lock(&a->mu);
    j->state = JOB_RUNNING;
    a->in_flight++;
    /* A cancel that came while the claim was out: never spawned. */
    if (rc == 0 && j->cancel_pending)
        rc = -ECANCELED;
    if (rc == 0)
        rc = exec_submit_out(a->loop, spec, job_started,
                             j->out ? agent__out_piece : NULL, job_done, j,
                             &job_id);
    if (rc == 0)
        j->job_id = job_id;
    pthread_mutex_unlock(&a->mu);
    if (rc) {
        /* Claimed but not started: report it, so it still ends (a
         * cancel's as Cancelled: job_done). */
        struct exec_result x = {0};
        x.outcome = EXEC_START_FAILED;
        x.start_stage = claimed_stage;
        /* A kscore code (a broker's refusal) is no errno: the reason
         * says what it was. */
        x.start_errno = rc > -1000 ? -rc : EIO;
        /* A cancel's is Cancelled (job_done). */
        x.cancelled = rc == -ECANCELED;
        x.term_sent_us = x.kill_sent_us = -1;
        job_done(0, &x, j);
    }
}

/* What a fetch thread takes over from start_job. */
struct fetch_apart {
    struct job_ctx *j;
    Ks__Command *cmd;
    struct exec_spec spec;
    const char **argv;
    struct exec_env *env;
    struct agent_secrets *secrets;
};

static void *
fetch_main(void *arg)
{
    struct fetch_apart *f = arg;
    struct agent *a = f->j->agent;

    spawn_claimed(f->j, f->cmd, &f->spec);
    agent__secrets_free(f->secrets);
    free(f->argv);
    free(f->env);
    ks__command__free_unpacked(f->cmd, NULL);
    free(f);
    /* Counted as a callback: agent_stop waits for it before the executor
     * goes. Nothing of a is touched after this. */
    pthread_mutex_lock(&a->mu);
    a->callbacks--;
    pthread_cond_broadcast(&a->cb_cond);
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/*
 * Runs spawn_claimed on a detached thread of its own, which takes *cmd,
 * *argv, *env and *secrets (NULLed) and a copy of *spec. 0, or an error
 * (nothing taken: the caller runs it itself). One thread per copy being
 * fetched, at most max_concurrent (each holds a slot).
 */
static int
fetch_apart(struct job_ctx *j, Ks__Command **cmd, const struct exec_spec *spec,
            const char ***argv, struct exec_env **env,
            struct agent_secrets **secrets)
{
    struct agent *a = j->agent;
    struct fetch_apart *f = calloc(1, sizeof(*f));
    pthread_attr_t attr;
    pthread_t t;
    int rc;

    if (!f)
        return -ENOMEM;
    *f = (struct fetch_apart){j, *cmd, *spec, *argv, *env, *secrets};
    pthread_mutex_lock(&a->mu);
    a->callbacks++;
    pthread_mutex_unlock(&a->mu);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &attr, fetch_main, f);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        pthread_mutex_lock(&a->mu);
        a->callbacks--;
        pthread_cond_broadcast(&a->cb_cond);
        pthread_mutex_unlock(&a->mu);
        free(f);
        return -rc;
    }
    *cmd = NULL;
    *argv = NULL;
    *env = NULL;
    *secrets = NULL;
    return 0;
}

/*
 * Starts a held message that has a slot (state JOB_STARTING): precheck,
 * claim, submit (spawn_claimed; a copy's on a fetch thread). Every path
 * ends the hold (job_release) or hands it to the executor (job_done ends
 * it). Delivery or starter thread.
 */
static void
start_job(struct job_ctx *j)
{
    struct agent *a = j->agent;
    struct agent_slot *slot = j->slot;
    Ks__Command *cmd = j->cmd;
    const char **argv = NULL;
    struct exec_env *env = NULL;
    struct exec_spec spec = {0};
    const char *stage = NULL;
    char claim_id[37], secret_why[256] = "", *inventory = NULL;
    struct agent_secrets *secrets = NULL;
    int rc;

    j->cmd = NULL; /* ours now; exec_submit copies what it keeps */
    /* A claim this process holds already (a previous run's, from the
     * journal) may have won: it is claimed again as it was, never given
     * up for a new one, expired or not. */
    bool prior = claim_held(a, j->command_id);
    if (atomic_load(&a->closing) || atomic_load(&a->draining)) {
        /* Stopping: someone else (or our next start) takes it at once.
         * A claim held before stays journalled for the next start. */
        if (!prior)
            agent__journal_remove(a, j->command_id);
        job_release(j, "-NAK");
        goto out;
    }
    if (!prior && ks_now_us() >= cmd->not_after_us) {
        /* It waited here past its deadline: the broker ends it
         * Undeliverable; claiming it now would only be refused. */
        reject(slot, j->command_id, j->attempt,
               "expired while waiting for a free slot");
        agent__journal_remove(a, j->command_id);
        job_release(j, "+TERM");
        goto out;
    }
    argv = calloc(cmd->spec->n_argv + 1, sizeof(*argv));
    env = calloc(cmd->spec->n_env + cmd->spec->n_sealed_env + cmd->n_labels +
                     a->facts.n + 2,
                 sizeof(*env));
    if (!argv || !env) {
        agent__journal_remove(a, j->command_id);
        job_release(j, "-NAK");
        goto out;
    }
    for (size_t i = 0; i < cmd->spec->n_argv; i++)
        argv[i] = cmd->spec->argv[i];
    /* KSCORE_AGENT_ID first, so the command's own env may override it. */
    env[0].name = "KSCORE_AGENT_ID";
    env[0].value = slot->id;
    for (size_t i = 0; i < cmd->spec->n_env; i++) {
        env[i + 1].name = cmd->spec->env[i]->name;
        env[i + 1].value = cmd->spec->env[i]->value;
    }
    spec.argv = argv;
    spec.env = env;
    spec.env_len = cmd->spec->n_env + 1;
    /* KSCORE_LABEL_*, KSCORE_FACT_* (facts.c). */
    if (agent__inventory_env(a, cmd, env, &spec.env_len, &inventory) != 0) {
        agent__journal_remove(a, j->command_id);
        job_release(j, "-NAK");
        goto out;
    }
    spec.cwd = cmd->spec->cwd;
    spec.command_id = cmd->command_id;
    spec.timeout_ms = cmd->spec->timeout_ms;
    spec.grace_ms = cmd->spec->grace_ms;
    /* Output past one NATS message travels in pieces (output.c). */
    spec.stdout_cap_bytes = agent_output_cap(cmd->spec->stdout_cap_bytes);
    spec.stderr_cap_bytes = agent_output_cap(cmd->spec->stderr_cap_bytes);

    /* Secret variables (secret.c): a command whose values cannot be
     * opened never runs, and ends StartFailed through the claim. */
    rc = agent__secrets_open(a, slot->id, cmd, env, &spec.env_len, &secrets,
                             secret_why, sizeof(secret_why));
    if (rc)
        stage = "secret";
    else /* script, stdin, user (payload.c) */
        rc = agent__payload_prepare(a, cmd, &spec, &j->payload, &stage,
                                    secret_why, sizeof(secret_why));
    if (rc == 0)
        rc = exec_precheck(&spec, &stage);
    Ks__CommandResult start_failure = KS__COMMAND_RESULT__INIT;
    bool start_failed = rc != 0;
    if (start_failed) {
        start_failure.status = KS__COMMAND_STATUS__START_FAILED;
        start_failure.start_stage = (char *)stage;
        start_failure.start_errno = -rc;
        start_failure.reason = secret_why;
        start_failure.started_at_us = start_failure.finished_at_us =
            ks_now_us();
        start_failure.term_sent_us = start_failure.kill_sent_us = -1;
    }
    if (start_failed && !prior) {
        /* Nothing is listed or journalled: if this claim wins, the
         * command has ended. */
        ks_uuid(claim_id);
        rc = claim(a, slot, cmd, &start_failure, claim_id, 0);
        agent__journal_remove(a, j->command_id);
        if (rc >= 0) {
            job_release(j, "+ACK");
        } else {
            nak_delay(a, j->ack_subject, 1000);
            job_release(j, NULL);
        }
        goto out;
    }
    /* Listed in the heartbeats from now on, with the claim id every try
     * of this claim carries (claim_take). */
    uint64_t listed_from = 0;
    if (claim_take(j, claim_id, &listed_from, &prior) != 0) {
        nak_delay(a, j->ack_subject, 1000);
        job_release(j, NULL);
        goto out;
    }
    /* Journal first: a crash from here on is "claimed, never spawned", and
     * the claim id is on disk before the claim is sent, so a restart
     * claims with it again. A claim the journal cannot hold is not made:
     * a crash would leave a command that never ends (the restart would
     * not know it). The message goes back to JetStream, for us later or a
     * peer of the id. */
    if (agent__journal_hold(a, j, claim_id) != 0) {
        if (!prior) {
            claim_drop(a, j->command_id);
            agent__journal_remove(a, j->command_id);
        }
        nak_delay(a, j->ack_subject, state_retry_ms(j->delivered));
        job_release(j, NULL);
        goto out;
    }
    rc = claim(a, slot, cmd, NULL, claim_id, listed_from);
    if (rc == KS_ESTOPPED) {
        /* Stopping with the claim unanswered: it may have won. With a
         * state dir the journal keeps it, and the next start claims with
         * the same id; without, nobody can, and the broker ends it
         * (Lost) if it won, once no live process's heartbeat lists it.
         * The message goes back to JetStream either way. */
        if (!a->state_dir)
            claim_drop(a, j->command_id);
        agent__ack(a, j->ack_subject, "-NAK");
        job_release(j, NULL);
        goto out;
    }
    if (rc != 1)
        claim_drop(a, j->command_id); /* not ours */
    if (rc == KS_ENOTFOUND) {
        /* Not recorded: the broker publishes a command while its record
         * commits, and this claim outran the commit (try again soon), or
         * the record failed and it never will be: dropped at delivery
         * CLAIM_UNRECORDED_TRIES, after 20, 100 and 500 ms (a record
         * commits in milliseconds; below the consumer's MaxDeliver, whose
         * advisory would name a command that does not exist). Counted in
         * deliveries, not by the broker's clock. */
        static const int64_t again_ms[] = {20, 100, 500};
        agent__journal_remove(a, j->command_id);
        if (j->delivered < CLAIM_UNRECORDED_TRIES) {
            nak_delay(a, j->ack_subject, again_ms[j->delivered - 1]);
            job_release(j, NULL);
        } else {
            ks_log(KS_LOG_WARN,
                   "dropping a command the record does not have (its "
                   "record failed)",
                   KS_S("command_id", j->command_id), KS_S("agent", slot->id),
                   KS_I("attempt", j->attempt));
            job_release(j, "+TERM");
        }
        goto out;
    }
    if (rc <= 0) {
        agent__journal_remove(a, j->command_id);
        if (rc < 0) {
            /* No broker: hand it back for a redelivery in a second. */
            nak_delay(a, j->ack_subject, 1000);
            job_release(j, NULL);
        } else {
            /* Lost the claim: someone else runs it, or it ended. */
            job_release(j, "+ACK");
        }
        goto out;
    }
    seen_add(a, j->command_id, j->attempt);
    if (start_failed) {
        /* A previous run's claim, claimed again, and now it cannot start:
         * ours to end. */
        report(j, "CommandStartFailed", &start_failure,
               secret_why[0] ? secret_why : NULL);
        agent__journal_remove(a, j->command_id);
        claim_drop(a, j->command_id);
        job_release(j, "+ACK");
        goto out;
    }
    if (atomic_load(&a->fenced) && !contact_regained(a)) {
        /* Claimed, but NATS has gone silent: a command started now could
         * be declared Lost while it runs. It provably never started. */
        Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
        r.status = KS__COMMAND_STATUS__NOT_STARTED;
        r.term_sent_us = r.kill_sent_us = -1;
        r.reason = "agent lost contact with NATS right after it claimed the "
                   "command: not spawned (self-fence)";
        report(j, "CommandNotStarted", &r, r.reason);
        agent__journal_remove(a, j->command_id);
        claim_drop(a, j->command_id);
        job_release(j, "+ACK");
        goto out;
    }
    /* A copy's files are fetched on a thread of their own (fetch_apart):
     * a download must not hold up the other commands this thread would
     * take (the delivery thread of an id or of a whole pool, or a
     * starter). */
    if (j->payload && agent__payload_fetches(j->payload) &&
        fetch_apart(j, &cmd, &spec, &argv, &env, &secrets) == 0)
        goto out;
    spawn_claimed(j, cmd, &spec);
out:
    agent__secrets_free(secrets); /* exec_submit copied what it keeps */
    free(inventory);
    free(argv);
    free(env);
    ks__command__free_unpacked(cmd, NULL);
}

static void *
starter_main(void *arg)
{
    struct agent *a = arg;

    pthread_mutex_lock(&a->mu);
    for (;;) {
        struct job_ctx *j;
        while (!a->readyq && !atomic_load(&a->closing))
            pthread_cond_wait(&a->ready_cond, &a->mu);
        j = a->readyq;
        if (!j)
            break;
        a->readyq = j->qnext;
        if (!a->readyq)
            a->readyq_tail = &a->readyq;
        j->qnext = NULL;
        pthread_mutex_unlock(&a->mu);
        start_job(j); /* closing: naks it */
        pthread_mutex_lock(&a->mu);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

bool
agent__log_due(_Atomic int64_t *last)
{
    int64_t now = ks_mono_us(), prev = atomic_load(last);
    return now - prev > LOG_EVERY_US &&
           atomic_compare_exchange_strong(last, &prev, now);
}

static void
on_command(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct agent_slot *slot = ud;
    struct agent *a = slot->agent;
    Ks__Command *cmd = NULL;
    const char *reason = NULL, *reply = natsMsg_GetReply(msg);
    struct job_ctx *j = NULL, *held;
    char cmd_id[37];
    bool start_now = false;
    uint32_t seen;
    int rc;

    int64_t t_in = ks_mono_us();

    (void)nc;
    (void)sub;
    pthread_mutex_lock(&a->mu);
    a->callbacks++;
    pthread_mutex_unlock(&a->mu);
    if (atomic_load(&a->closing))
        goto out; /* not acked: redelivered after the ack wait */
    if (atomic_load(&a->draining)) {
        /* Taking no more work: back to JetStream at once, for another
         * process of the id or for after the restart. */
        if (reply && !strncmp(reply, slot->ack_prefix,
                              strlen(slot->ack_prefix)))
            agent__ack(a, reply, "-NAK");
        goto out;
    }
    /* Every delivery of this id's consumer comes with a reply subject
     * under its ack prefix; anything else on the deliver subject is not
     * JetStream's, and acks go nowhere else. */
    if (!reply || strncmp(reply, slot->ack_prefix, strlen(slot->ack_prefix)))
        goto out;
    uint64_t delivered = 1;
    {
        jsMsgMetaData *md = NULL;
        if (natsMsg_GetMetaData(&md, msg) == NATS_OK) {
            if (md->NumDelivered > 1)
                ks_metric_inc(KS_C_AGENT_REDELIVERIES);
            delivered = md->NumDelivered;
            jsMsgMetaData_Destroy(md);
        }
    }
    /* A push delivery keeps the subject it was stored under. Another
     * subject means the consumer is not the one the broker makes (its
     * filter is wrong: registry.c replaces it). Not ours to run, refuse or
     * ack: left alone, it goes back to the stream when the consumer is
     * replaced. */
    if (strcmp(natsMsg_GetSubject(msg), slot->cmd_subject) != 0) {
        if (agent__log_due(&a->foreign_logged_us)) {
            ks_log(KS_LOG_WARN,
                   "the consumer delivered a message that is not ours: left "
                   "unacked (the broker replaces a consumer with a wrong "
                   "filter)",
                   KS_S("agent", slot->id), KS_S("consumer", slot->identity),
                   KS_S("subject", natsMsg_GetSubject(msg)));
        }
        goto out;
    }
    rc = agent_decode_command(a->trust, slot->id, ks_now_us(),
                              natsMsg_GetData(msg),
                              (size_t)natsMsg_GetDataLength(msg), &cmd,
                              &reason, cmd_id);
    if (rc) {
        /* Never run; said so in the record when there is a command id. */
        if (cmd_id[0])
            reject(slot, cmd_id, 0,
                   rc == KS_EREJECTED ? reason : "undecodable command");
        agent__ack(a, reply, "+TERM");
        goto out;
    }
    ks_trace_at("agent.delivered", cmd->command_id, t_in);
    ks_trace("agent.verified", cmd->command_id);
    pthread_mutex_lock(&a->mu);
    held = ks_map_get(&a->jobs, cmd->command_id);
    if (held) {
        bool same = held->attempt == cmd->attempt;
        char *s = same && reply ? strdup(reply) : NULL;
        if (s) {
            /* JetStream redelivered a message we hold (NATS was away for
             * longer than the ack wait): ack through the newest delivery. */
            free(held->ack_subject);
            held->ack_subject = s;
        }
        pthread_mutex_unlock(&a->mu);
        /* Another attempt of a command we hold (the broker re-dispatched it
         * while it waited here): one message is enough. */
        if (!same)
            agent__ack(a, reply, "+ACK");
        goto out;
    }
    seen = seen_attempt_locked(a, cmd->command_id);
    if (seen) {
        pthread_mutex_unlock(&a->mu);
        if (seen == cmd->attempt + 1)
            reject(slot, cmd->command_id, cmd->attempt,
                   "replay: this agent has already claimed this command");
        /* else a re-dispatch that lost the race against our own claim */
        if (agent__log_due(&a->replay_logged_us))
            ks_log(KS_LOG_INFO,
                   "a delivery of a command this process claimed before: "
                   "refused (+TERM)",
                   KS_S("agent", slot->id),
                   KS_S("command_id", cmd->command_id),
                   KS_I("attempt", cmd->attempt),
                   KS_I("delivery", delivered));
        agent__ack(a, reply, "+TERM");
        goto out;
    }
    j = calloc(1, sizeof(*j));
    if (!j || !(j->ack_subject = strdup(reply))) {
        pthread_mutex_unlock(&a->mu);
        free(j);
        j = NULL;
        goto out; /* not acked: redelivered */
    }
    j->agent = a;
    j->slot = slot;
    j->delivered = delivered;
    j->attempt = cmd->attempt;
    snprintf(j->command_id, sizeof(j->command_id), "%s", cmd->command_id);
    snprintf(j->operator_name, sizeof(j->operator_name), "%s",
             cmd->operator_);
    j->cmd = cmd;
    cmd = NULL;
    if (ks_map_put(&a->jobs, j->command_id, j) != 0) {
        pthread_mutex_unlock(&a->mu);
        job_free(j);
        goto out;
    }
    if (a->free_slots) {
        a->free_slots--;
        j->state = JOB_STARTING;
        if (a->claim_inline) {
            start_now = true;
        } else {
            /* nats.c's shared delivery pool also delivers the claim's
             * reply: a pool thread blocked in a claim could wait for its
             * own reply (and would hold up cancels). A starter claims. */
            *a->readyq_tail = j;
            a->readyq_tail = &j->qnext;
            pthread_cond_signal(&a->ready_cond);
        }
    } else {
        /* No slot: it waits here, unclaimed. Journaled before it can be
         * taken off the queue, so a restart hands it back to JetStream;
         * a claim a previous run left for it keeps its entry as it is
         * (its claim line is what the next start needs). */
        j->state = JOB_WAITING;
        if (!ks_map_get(&a->claims, j->command_id) &&
            agent__journal_hold(a, j, NULL) != 0) {
            /* A restart would not hand it back: JetStream keeps it. */
            pthread_mutex_unlock(&a->mu);
            agent__journal_remove(a, j->command_id);
            nak_delay(a, j->ack_subject, state_retry_ms(j->delivered));
            job_release(j, NULL);
            j = NULL;
            goto out;
        }
        *a->waitq_tail = j;
        a->waitq_tail = &j->qnext;
    }
    pthread_mutex_unlock(&a->mu);
    if (start_now)
        start_job(j);
out:
    if (cmd)
        ks__command__free_unpacked(cmd, NULL);
    natsMsg_Destroy(msg);
    pthread_mutex_lock(&a->mu);
    a->callbacks--;
    pthread_cond_broadcast(&a->cb_cond);
    pthread_mutex_unlock(&a->mu);
}

/* A delivery of the pool's consumer: the id is the subject's last token
 * (kscore.cmd.<pool>.<id>), and on_command checks the rest as for an id's
 * own consumer. An id this process does not serve (another process of the
 * pool name serves other ids: a misconfiguration) is given back at once
 * (-NAK), for JetStream to deliver again, maybe to the right one. nats.c
 * delivery thread. */
static void
on_pool_command(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                void *ud)
{
    struct agent *a = ud;
    const char *subj = natsMsg_GetSubject(msg), *dot = strrchr(subj, '.');
    struct agent_slot *slot = dot ? ks_map_get(&a->slot_of, dot + 1) : NULL;

    if (slot) {
        on_command(nc, sub, msg, slot);
        return;
    }
    const char *reply = natsMsg_GetReply(msg);
    /* Only JetStream's deliveries carry an ack subject: anything else on
     * the deliver subject (a status message such as nats-server's "409
     * Leadership Change", which 2.9 sends to pull requests only, or a
     * stray publish) is not a command and changes nothing. */
    bool delivery = reply && strncmp(reply, "$JS.ACK.", 8) == 0;
    pthread_mutex_lock(&a->mu);
    a->callbacks++;
    pthread_mutex_unlock(&a->mu);
    if (delivery && !atomic_load(&a->closing))
        agent__ack(a, reply, "-NAK");
    if (delivery && agent__log_due(&a->foreign_logged_us)) {
        ks_log(KS_LOG_WARN,
               "the pool delivered a command for an id this process does not "
               "serve: given back (do two processes of one pool serve "
               "different ids?)",
               KS_S("pool", a->opts.pool), KS_S("subject", subj));
    }
    natsMsg_Destroy(msg);
    pthread_mutex_lock(&a->mu);
    a->callbacks--;
    pthread_cond_broadcast(&a->cb_cond);
    pthread_mutex_unlock(&a->mu);
}

static void
on_cancel(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct agent_slot *slot = ud;
    struct agent *a = slot->agent;
    ProtobufCMessage *pm = NULL;
    struct job_ctx *job;
    uint64_t job_id = 0;

    (void)nc;
    (void)sub;
    if (evt_unpack(&ks__cancel_command__descriptor, natsMsg_GetData(msg),
                   (size_t)natsMsg_GetDataLength(msg), &pm) == 0) {
        Ks__CancelCommand *cc = (Ks__CancelCommand *)pm;
        pthread_mutex_lock(&a->mu);
        job = ks_map_get(&a->jobs, cc->command_id);
        if (job)
            job->op_cancelled = true;
        if (job && job->state == JOB_RUNNING)
            job_id = job->job_id;
        else if (job)
            /* Claimed (the record says Running) but not yet spawned: a
             * cancel dropped here let the command run to its end. */
            job->cancel_pending = true;
        pthread_mutex_unlock(&a->mu);
        if (job_id)
            exec_cancel(a->loop, job_id);
        ks__cancel_command__free_unpacked(cc, NULL);
    }
    natsMsg_Destroy(msg);
}

/* ---- heartbeat --------------------------------------------------------------- */

struct slot_counts {
    const struct agent_slot *slots;
    size_t n;
    uint32_t *running; /* per slot */
};

static void
count_slot_job(const char *key, void *val, void *ud)
{
    const struct job_ctx *j = val;
    struct slot_counts *sc = ud;
    (void)key;
    if (j->state != JOB_WAITING && j->slot >= sc->slots &&
        j->slot < sc->slots + sc->n)
        sc->running[j->slot - sc->slots]++;
}

/* The slots each id's commands take (claiming, starting or running), in
 * one pass over the held jobs (under a->mu): running[i] for a->slots[i].
 * The broker's admission takes it as the agent's word on its free slots
 * (broker/admit.c): a command being claimed or started (its copies
 * fetched) holds its slot as much as one that runs. */
static void
slots_running(struct agent *a, uint32_t *running)
{
    struct slot_counts sc = {a->slots, a->n_slots, running};
    memset(running, 0, a->n_slots * sizeof(*running));
    pthread_mutex_lock(&a->mu);
    ks_map_each(&a->jobs, count_slot_job, &sc);
    pthread_mutex_unlock(&a->mu);
}

/* ---- holds: what this process lists in its heartbeats ----------------------- */

/*
 * AgentInfo.holds (proto/kscore.proto): every command with a claim in
 * a->claims (sent or about to be: claim_take lists it first), and every
 * command with an event in the outbox (its end, until the PubAck). A
 * command leaves the claims only once its end is queued, so a command
 * this process claimed is listed until the event stream has its end: a
 * heartbeat that does not list it tells the broker this process does not
 * run it. At most AGENT_HOLDS_MAX ids in an id's own entry (8 KiB in all:
 * BROKER_AGENT_INFO_MAX_BYTES), AGENT_POOL_HOLDS_MAX in a pool's; more
 * is "not complete", and the broker judges by silence alone.
 */
#define AGENT_HOLDS_MAX 128
#define AGENT_POOL_HOLDS_MAX 8192
#define AGENT_ENTRY_MAX_BYTES 8192
#define AGENT_POOL_ENTRY_MAX_BYTES (256 * 1024)

struct holds {
    uint8_t (*ids)[16];
    size_t n, cap, max;
    bool complete;
};

static void
holds_add(struct holds *h, const char *command_id)
{
    if (!h->complete)
        return;
    if (h->n == h->max) {
        h->complete = false;
        return;
    }
    if (h->n == h->cap) {
        size_t nc = h->cap ? h->cap * 2 : 16;
        uint8_t (*p)[16] = realloc(h->ids, nc * sizeof(*p));
        if (!p) {
            h->complete = false;
            return;
        }
        h->ids = p;
        h->cap = nc;
    }
    if (ks_uuid_bin(command_id, h->ids[h->n]) == 0)
        h->n++;
}

struct holds_walk {
    const char *agent_id; /* NULL: every id's (a pool) */
    struct holds *h;
};

static void
holds_claim(const char *key, void *val, void *ud)
{
    const struct agent_claim *c = val;
    struct holds_walk *w = ud;
    if (!w->agent_id || strcmp(c->agent_id, w->agent_id) == 0)
        holds_add(w->h, key);
}

static int
cmp_id16(const void *x, const void *y)
{
    return memcmp(x, y, 16);
}

/*
 * The next heartbeat's number and what it lists: h[i] for a->slots[i],
 * or h[0] alone for a pool (n 1). One lock for all, the one claim_take
 * lists a claim under. h[i].ids malloc'd, sorted, without repeats.
 */
static uint64_t
holds_collect(struct agent *a, struct holds *h, size_t n, size_t max)
{
    uint64_t seq;

    pthread_mutex_lock(&a->mu);
    seq = ++a->hb_seq;
    for (size_t i = 0; i < n; i++) {
        struct holds_walk w = {n == 1 && a->opts.pool ? NULL
                                                      : a->slots[i].id,
                               &h[i]};
        h[i] = (struct holds){.max = max, .complete = true};
        ks_map_each(&a->claims, holds_claim, &w);
        /* A long outbox (NATS away) makes the list not complete soon:
         * no need to walk the rest. */
        for (struct outbox_item *it = a->out_head; it && h[i].complete;
             it = it->next)
            if (!w.agent_id || strcmp(it->agent_id, w.agent_id) == 0)
                holds_add(&h[i], it->command_id);
    }
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        qsort(h[i].ids, h[i].n, 16, cmp_id16);
        for (size_t j = 0; j < h[i].n; j++)
            if (k == 0 || memcmp(h[i].ids[k - 1], h[i].ids[j], 16) != 0)
                memmove(h[i].ids[k++], h[i].ids[j], 16);
        h[i].n = k;
    }
    return seq;
}

/* Puts h into info (the binary data borrows h; bin: room for h->n). A
 * list that would make the entry larger than max_bytes is left out (not
 * complete). */
static void
holds_put(Ks__AgentInfo *info, const struct holds *h, ProtobufCBinaryData *bin,
          size_t max_bytes)
{
    for (size_t i = 0; i < h->n; i++)
        bin[i] = (ProtobufCBinaryData){16, h->ids[i]};
    info->holds = bin;
    info->n_holds = h->complete ? h->n : 0;
    info->holds_complete = h->complete;
    if (protobuf_c_message_get_packed_size(&info->base) > max_bytes) {
        info->n_holds = 0;
        info->holds_complete = false;
    }
}

/* labels as the registry entry's EnvVars: *v_out and *p_out (malloc'd;
 * the strings stay the labels'). 0 or -ENOMEM (both NULL). */
static int
labels_proto(const struct agent_label *labels, size_t n, Ks__EnvVar **v_out,
             Ks__EnvVar ***p_out)
{
    Ks__EnvVar *v = calloc(n + 1, sizeof(*v));
    Ks__EnvVar **p = calloc(n + 1, sizeof(*p));

    *v_out = NULL;
    *p_out = NULL;
    if (!v || !p) {
        free(v);
        free(p);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        ks__env_var__init(&v[i]);
        v[i].name = (char *)labels[i].key;
        v[i].value = (char *)labels[i].value;
        p[i] = &v[i];
    }
    *v_out = v;
    *p_out = p;
    return 0;
}

/* The broker's signature over labels (n of them, made by labels_proto),
 * passed on in info as is: the broker believes those labels, not ours.
 * labels NULL clears it. */
static void
attest_put(Ks__AgentInfo *info, Ks__EnvVar **labels, size_t n, int64_t at_us,
           const uint8_t *sig, const char *key_id)
{
    info->attested_labels = labels;
    info->n_attested_labels = labels ? n : 0;
    info->labels_enrolled_at_us = labels ? at_us : 0;
    info->labels_signature.data = labels ? (uint8_t *)sig : NULL;
    info->labels_signature.len = labels ? EVT_SIGNATURE_BYTES : 0;
    info->labels_key_id = (char *)(labels ? key_id : "");
}

/*
 * What a heartbeat's outcome says to the self-fence (keeper_main); t0:
 * when the put began (ks_mono_us). Stored in the registry: the broker
 * hears us. Refused by the server for want of the registry itself (no
 * responders: the bucket has no leader, or its JetStream error, such as
 * 503 without quorum): nobody hears anybody's heartbeat then, the
 * brokers' own beacons included, so no broker judges us by silence
 * (broker__registry_deaf) and there is nothing to fence against. Without
 * this, losing the cluster node that led the registry fenced every agent
 * for the 5-15 s of the bucket's new election, and commands claimed then
 * ended NotStarted.
 *
 * But only an answer from the server says so. KS_ENATS or KS_EUNAVAIL on
 * a connection nats.c calls CONNECTED may also be a write that failed:
 * the deaf agent of issue 22 (its read thread hung in nats.c, every write
 * failing with EPIPE, the status still CONNECTED) counted those as
 * contact, lifted its fence and ran commands it could never report. So
 * the server must have answered since t0: the put's "no responders" or
 * error PubAck, or else the PONG to a PING sent now.
 */
static void
heard(struct agent *a, int rc, int64_t t0)
{
    if (rc == 0) {
        atomic_store(&a->last_contact_us, ks_mono_us());
        return;
    }
    if (rc != KS_EUNAVAIL && rc != KS_ENATS && rc != KS_ETIMEDOUT)
        return;
    /*
     * An agent's put reaches JetStream through its account's service
     * import (deploy/nats-auth.conf.in), and the server answers no
     * "no responders" across an import (nats-server 2.9 client.go: the
     * import's own subscription counts as delivered): a registry without a
     * leader looks like a timeout. A server that still answers a PING at
     * once is there and is what says nobody serves the registry, as the
     * "no responders" did; a partition from it fails the PING too.
     */
    if (evt_link_answered_us(a->nc) < t0 &&
        natsConnection_Status(a->nc->nc) == NATS_CONN_STATUS_CONNECTED)
        (void)evt_link_probe(a->nc, 1000);
    if (evt_link_answered_us(a->nc) >= t0)
        atomic_store(&a->last_contact_us, ks_mono_us());
}

/*
 * Writes every id's registry entry: a publish to $KV.KSCORE_AGENTS.<id>
 * whose PubAck comes back to agent-<id>'s own inbox (evt_agent_put). The
 * PubAck is what the self-fence counts as contact: JetStream has the
 * heartbeat, so the broker's liveness check sees it. 0 if every id's was
 * acknowledged, else the first error. A pool writes one entry for all its
 * ids instead (evt_pool_put), with each id's running count.
 */
static int
heartbeat_once(struct agent *a)
{
    Ks__AgentInfo info = KS__AGENT_INFO__INIT;
    Ks__EnvVar *lv = NULL, **lp = NULL;
    uint32_t *per_slot = NULL;
    bool pooled = a->opts.pool && a->opts.pool[0];
    size_t n_holds = pooled ? 1 : a->n_slots;
    struct holds *holds = calloc(n_holds ? n_holds : 1, sizeof(*holds));
    ProtobufCBinaryData *bin = NULL;
    int rc;

    if (!holds) {
        rc = -ENOMEM;
        goto out;
    }
    info.heartbeat_seq = holds_collect(
        a, holds, n_holds, pooled ? AGENT_POOL_HOLDS_MAX : AGENT_HOLDS_MAX);
    size_t most = 0;
    for (size_t i = 0; i < n_holds; i++)
        most = holds[i].n > most ? holds[i].n : most;
    if (!(bin = calloc(most ? most : 1, sizeof(*bin)))) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = labels_proto(a->opts.labels, a->opts.n_labels, &lv, &lp)))
        goto out;
    info.labels = lp;
    info.n_labels = a->opts.n_labels;
    info.version = AGENT_VERSION;
    info.host = a->host;
    /* The slots taken (claiming, starting, running: slots_running),
     * which is what the broker's admission reads it as. */
    pthread_mutex_lock(&a->mu);
    info.running = a->max_concurrent >= a->free_slots
                       ? (uint32_t)(a->max_concurrent - a->free_slots)
                       : 0;
    pthread_mutex_unlock(&a->mu);
    info.max_concurrent = a->max_concurrent;
    info.heartbeat_at_us = ks_now_us();
    info.pid = (int32_t)getpid();
    info.seal_key.data = a->seal_pub;
    info.seal_key.len = sizeof(a->seal_pub);
    /* The broker gives this id's consumer the ack wait we keep alive. */
    info.ack_wait_ms = a->ack_wait_ms;
    /* Which process: the broker tells two processes serving one id. */
    info.instance_id = a->instance_id;
    info.started_at_us = a->started_at_us;
    info.features = (char **)agent_features;
    info.n_features = AGENT_N_FEATURES;
    info.facts = a->facts.p;
    info.n_facts = a->facts.n;
    if (a->opts.pool && a->opts.pool[0]) {
        /* One entry for the whole pool: the broker takes it as every
         * listed id's heartbeat. */
        char **ids = calloc(a->n_slots ? a->n_slots : 1, sizeof(*ids));
        if (!ids) {
            rc = -ENOMEM;
            goto out;
        }
        for (size_t i = 0; i < a->n_slots; i++)
            ids[i] = a->slots[i].id;
        info.agent_id = (char *)"";
        info.pool = (char *)a->opts.pool;
        info.pool_size = a->opts.pool_size ? a->opts.pool_size
                                           : (uint32_t)a->n_slots;
        info.pool_ids = ids;
        info.n_pool_ids = a->n_slots;
        /* Each id's own running count, as single ids report it. */
        if ((per_slot = calloc(a->n_slots ? a->n_slots : 1,
                               sizeof(*per_slot)))) {
            slots_running(a, per_slot);
            info.pool_running = per_slot;
            info.n_pool_running = a->n_slots;
        }
        /* The broker's signature over the pool's labels (its key
         * "pool.<pool>"). */
        Ks__EnvVar *pav = NULL, **pap = NULL;
        if (a->has_pool_attest &&
            labels_proto(a->pool_attest.labels, a->pool_attest.n_labels, &pav,
                         &pap) == 0)
            attest_put(&info, pap, a->pool_attest.n_labels,
                       a->pool_attest.enrolled_at_us, a->pool_attest_sig,
                       a->pool_attest_key_id);
        holds_put(&info, &holds[0], bin, AGENT_POOL_ENTRY_MAX_BYTES);
        int64_t t0 = ks_mono_us();
        rc = evt_pool_put(a->nc, a->pool_identity, &info,
                          HEARTBEAT_TIMEOUT_MS);
        free(ids);
        free(pav);
        free(pap);
        heard(a, rc, t0);
        goto out;
    }
    if (a->n_slots > 1 && (per_slot = calloc(a->n_slots, sizeof(*per_slot))))
        slots_running(a, per_slot);
    for (size_t i = 0; i < a->n_slots; i++) {
        const struct agent_slot *sl = &a->slots[i];
        Ks__EnvVar *av = NULL, **ap = NULL;
        int one;
        info.agent_id = a->slots[i].id;
        /* This id's own attestation, or none. */
        attest_put(&info, NULL, 0, 0, NULL, NULL);
        if (sl->has_attest &&
            labels_proto(sl->attest_labels, sl->n_attest_labels, &av, &ap) ==
                0)
            attest_put(&info, ap, sl->n_attest_labels, sl->attest_at_us,
                       sl->attest_sig, sl->attest_key_id);
        /* One process may serve several ids (--local-agents): each id
         * reports the commands it runs, not the whole process's. */
        if (per_slot)
            info.running = per_slot[i];
        holds_put(&info, &holds[i], bin, AGENT_ENTRY_MAX_BYTES);
        int64_t t0 = ks_mono_us();
        one = evt_agent_put(a->nc, a->slots[i].identity, &info,
                            HEARTBEAT_TIMEOUT_MS);
        free(av);
        free(ap);
        heard(a, one, t0);
        if (one && !rc)
            rc = one;
    }
out:
    free(lv);
    free(lp);
    free(per_slot);
    for (size_t i = 0; holds && i < n_holds; i++)
        free(holds[i].ids);
    free(holds);
    free(bin);
    return rc;
}

/* Asks the heartbeat thread for a heartbeat now. */
static void
heartbeat_poke(struct agent *a)
{
    pthread_mutex_lock(&a->hb_mu);
    a->hb_wake = true;
    pthread_cond_signal(&a->hb_cond);
    pthread_mutex_unlock(&a->hb_mu);
}

static void *
heartbeat_main(void *arg)
{
    struct agent *a = arg;

    while (!a->stopping) {
        bool ok = heartbeat_once(a) == 0;
        int64_t wait_us = (int64_t)(ok ? EVT_HEARTBEAT_MS
                                       : HEARTBEAT_RETRY_MS) * 1000;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        wait_us += ts.tv_nsec / 1000;
        ts.tv_sec += wait_us / 1000000;
        ts.tv_nsec = (wait_us % 1000000) * 1000;
        pthread_mutex_lock(&a->hb_mu);
        while (!a->hb_wake && !a->stopping &&
               pthread_cond_timedwait(&a->hb_cond, &a->hb_mu, &ts) == 0)
            ;
        a->hb_wake = false;
        pthread_mutex_unlock(&a->hb_mu);
    }
    return NULL;
}

/*
 * The first heartbeat (the registration), tried again with backoff for up
 * to REGISTER_RETRY_MS while it times out or finds no stream: on a
 * JetStream cluster that has just started, or started again, the
 * registry stream's raft group elects its leader some seconds after the
 * meta leader and after the brokers answer, and until then a put gets no
 * responders, no PubAck, or a JetStream error. Failing at the first one left `kscore up
 * --cluster` waiting for a heartbeat that never came.
 */
static int
register_retrying(struct agent *a)
{
    int64_t deadline = ks_mono_us() + (int64_t)REGISTER_RETRY_MS * 1000;
    int delay_ms = 250, rc, tries = 1;

    /* KS_ENATS too: a stream without quorum answers the put with a
     * JetStream error (503) instead of staying silent. */
    while ((rc = heartbeat_once(a)) == KS_EUNAVAIL || rc == KS_ETIMEDOUT ||
           rc == KS_ENATS) {
        if (ks_mono_us() + (int64_t)delay_ms * 1000 >= deadline)
            break;
        if (tries == 1)
            ks_log(KS_LOG_WARN, "registry not answering yet: trying again",
                   KS_S("kv", EVT_KV_AGENTS), KS_S("error", ks_strerror(rc)));
        struct timespec ts = {delay_ms / 1000,
                              (long)(delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        delay_ms = delay_ms * 2 > 2000 ? 2000 : delay_ms * 2;
        tries++;
    }
    if (rc == 0 && tries > 1)
        ks_log(KS_LOG_INFO, "registered", KS_I("tries", tries));
    return rc;
}

/* ---- keeper: progress acks, contact, self-fence -------------------------- */

struct collect {
    struct agent *a;
    uint64_t *ids;
    size_t n, cap;
    int64_t silence_us;
};

static void
progress_one(const char *key, void *val, void *ud)
{
    struct job_ctx *j = val;
    (void)key;
    agent__ack(ud, j->ack_subject, "+WPI");
}

static void
fence_one(const char *key, void *val, void *ud)
{
    struct job_ctx *j = val;
    struct collect *c = ud;
    (void)key;
    if (j->state != JOB_RUNNING || j->fenced)
        return;
    if (c->n == c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 16;
        uint64_t *p = realloc(c->ids, nc * sizeof(*p));
        if (!p)
            return; /* the next tick tries again */
        c->ids = p;
        c->cap = nc;
    }
    j->fenced = true;
    j->fence_silence_us = c->silence_us;
    c->ids[c->n++] = j->job_id;
}

/* Kills every running command not yet fenced. */
static void
fence_running(struct agent *a, int64_t silence_us)
{
    struct collect c = {a, NULL, 0, 0, silence_us};

    pthread_mutex_lock(&a->mu);
    ks_map_each(&a->jobs, fence_one, &c);
    pthread_mutex_unlock(&a->mu);
    if (c.n)
        ks_log(KS_LOG_WARN,
               "no heartbeat reached NATS: killing the running commands "
               "(self-fence)",
               KS_D("silent_s", (double)silence_us / 1e6),
               KS_I("commands", c.n));
    for (size_t i = 0; i < c.n; i++)
        exec_kill(a->loop, c.ids[i]);
    free(c.ids);
}

static void *
keeper_main(void *arg)
{
    struct agent *a = arg;
    int64_t wpi_us = (int64_t)a->ack_wait_ms * 1000 / 3;
    int64_t last_tick = ks_mono_us(), next_wpi = last_tick + wpi_us;
    int64_t judge_after = 0, next_forget = last_tick + 1000000;
    natsConnStatus prev = NATS_CONN_STATUS_CONNECTED;

    while (!atomic_load(&a->closing)) {
        nanosleep(&(struct timespec){0, KEEPER_TICK_MS * 1000000L}, NULL);
        int64_t now = ks_mono_us();
        if (now - last_tick > 1000000) {
            /* This process did not run for a while (stopped, swapped, a
             * frozen VM or cgroup). If it was silent so long that a broker
             * may have declared its commands Lost (EVT_AGENT_TTL_MS, less
             * a second for the broker's own delays), they must not run on
             * as if nothing happened: fence at once, before any heartbeat
             * lifts it (on cf06db5 a child frozen 13 s with its agent ran
             * to its end after the broker had recorded it Lost, issue 25).
             * A shorter pause: heartbeat, then judge. */
            int64_t was_silent = now - atomic_load(&a->last_contact_us);
            if (was_silent > ((int64_t)EVT_AGENT_TTL_MS - 1000) * 1000) {
                ks_log(KS_LOG_WARN,
                       "this agent did not run for a while and was silent "
                       "past the brokers' limit: its commands may be "
                       "recorded Lost, so it stops them",
                       KS_D("paused_s", (double)(now - last_tick) / 1e6),
                       KS_D("silent_s", (double)was_silent / 1e6));
                atomic_store(&a->fenced, true);
                fence_running(a, was_silent);
            }
            heartbeat_poke(a);
            judge_after = now + 2000000;
        }
        last_tick = now;
        aside_tick(a, now);
        natsConnStatus st = natsConnection_Status(a->nc->nc);
        if (st == NATS_CONN_STATUS_CONNECTED && prev != st)
            heartbeat_poke(a); /* back: say so now, not in 2 s */
        prev = st;
        if (now >= next_wpi) {
            pthread_mutex_lock(&a->mu);
            ks_map_each(&a->jobs, progress_one, a);
            pthread_mutex_unlock(&a->mu);
            next_wpi = now + wpi_us;
        }
        if (now >= next_forget) {
            claims_forget_old(a, now);
            next_forget = now + 1000000;
        }
        int64_t silence = now - atomic_load(&a->last_contact_us);
        if (silence > (int64_t)a->fence_ms * 1000 && now >= judge_after) {
            if (!atomic_exchange(&a->fenced, true))
                ks_log(KS_LOG_WARN,
                       "no heartbeat reached NATS: self-fenced",
                       KS_D("silent_s", (double)silence / 1e6),
                       KS_I("fence_ms", a->fence_ms));
            fence_running(a, silence);
            /* Closed for good (a revoked credential: nats.c gives up
             * after an authorization violation): fenced, nothing more
             * to do or report. The process exits (agent_fatal). */
            if (natsConnection_IsClosed(a->nc->nc) &&
                atomic_exchange(&a->fatal, AGENT_FATAL_REVOKED) == 0)
                ks_log(KS_LOG_ERROR,
                       "NATS closed the connection for good (revoked "
                       "credential?): the agent stops",
                       KS_S("agent", a->slots[0].id),
                       KS_I("exit_code", AGENT_EXIT_CONFIG));
        } else if (silence <= (int64_t)a->fence_ms * 1000 &&
                   atomic_exchange(&a->fenced, false)) {
            ks_log(KS_LOG_INFO, "heartbeats reach NATS again");
        }
    }
    return NULL;
}

/* The link answered nothing for link_timeout_ms while nats.c said
 * CONNECTED (evt_link_watch, its thread): fenced already, the process
 * stops for its supervisor to start a new one (agent_fatal). */
static void
link_dead(void *ud, int64_t silent_us)
{
    struct agent *a = ud;

    atomic_store(&a->fenced, true);
    fence_running(a, silent_us);
    if (atomic_exchange(&a->fatal, AGENT_FATAL_LINK) == 0)
        ks_log(KS_LOG_ERROR,
               "the NATS link answers nothing though nats.c says it is "
               "connected: the agent stops, to be started again",
               KS_S("agent", a->slots[0].id),
               KS_D("silent_s", (double)silent_us / 1e6),
               KS_I("link_timeout_ms", (int64_t)a->link_timeout_ms),
               KS_I("exit_code", AGENT_EXIT_LINK));
}

/* ---- start / stop ------------------------------------------------------------ */

/* At each metrics scrape: what this agent sees now (proto/metrics.c). */
static void
agent_collect(void *ctx)
{
    struct agent *a = ctx;
    evt_metrics_nats_state(a->nc, KS_G_NATS_AGENT);
    if (a->loop)
        ks_metric_gauge_add(KS_G_RUNNING_CHILDREN,
                            (int64_t)exec_loop_running(a->loop));
    ks_metric_gauge_add(KS_G_AGENT_SLOTS, (int64_t)a->max_concurrent);
}

/* A core queue subscription to a consumer's deliver subject, in queue
 * group `group` (the processes serving one id or pool share its
 * messages). Held messages are few (max_ack_pending): never drop one.
 * 0 or KS_ENATS with *errmsg. */
static int
subscribe_deliver(struct agent *a, natsSubscription **sub, const char *deliver,
                  const char *group, natsMsgHandler cb, void *ud,
                  char **errmsg)
{
    natsStatus st =
        natsConnection_QueueSubscribe(sub, a->nc->nc, deliver, group, cb, ud);
    if (st == NATS_OK)
        st = natsSubscription_SetPendingLimits(*sub, -1, -1);
    if (st == NATS_OK)
        return 0;
    if (errmsg && asprintf(errmsg, "subscribe %s: %s", deliver,
                           natsStatus_GetText(st)) < 0)
        *errmsg = NULL;
    return KS_ENATS;
}

int
agent_start(const struct agent_opts *opts, struct agent **out, char **errmsg)
{
    struct agent *a = NULL;
    struct evt_connect_opts co = opts->nats;
    pthread_condattr_t ca;
    int rc = 0;

    for (size_t i = 0; i < opts->n_ids; i++)
        if (!evt_agent_id_valid(opts->ids[i])) {
            if (errmsg && asprintf(errmsg,
                                   "bad agent id '%s' (1-%d of letters, "
                                   "digits, _ and -)",
                                   opts->ids[i] ? opts->ids[i] : "",
                                   EVT_AGENT_ID_MAX) < 0)
                *errmsg = NULL;
            return KS_EINVAL;
        }
    if (opts->n_ids == 0)
        return KS_EINVAL;
    if (opts->pool && opts->pool[0] && !evt_agent_id_valid(opts->pool)) {
        if (errmsg && asprintf(errmsg, "bad pool name '%s' (letters, digits, "
                                       "'-' and '_')",
                               opts->pool) < 0)
            *errmsg = NULL;
        return KS_EINVAL;
    }
    a = calloc(1, sizeof(*a));
    if (!a)
        return -ENOMEM;
    a->opts = *opts;
    a->opts.pool = NULL;
    if (opts->pool && opts->pool[0] &&
        !(a->opts.pool = a->pool_name = strdup(opts->pool))) {
        free(a);
        return -ENOMEM;
    }
    if (a->pool_name)
        evt_pool_durable(a->pool_identity, sizeof(a->pool_identity),
                         a->pool_name);
    a->opts.pool_attestation = NULL;
    if (a->pool_name && opts->pool_attestation &&
        opts->pool_attestation->sig) {
        a->has_pool_attest = true;
        a->pool_attest = *opts->pool_attestation;
        memcpy(a->pool_attest_sig, opts->pool_attestation->sig,
               EVT_SIGNATURE_BYTES);
        snprintf(a->pool_attest_key_id, sizeof(a->pool_attest_key_id), "%s",
                 opts->pool_attestation->key_id
                     ? opts->pool_attestation->key_id
                     : "");
    }
    a->jobs = (struct ks_map)KS_MAP_INIT;
    a->slot_of = (struct ks_map)KS_MAP_INIT;
    a->seen = (struct ks_map)KS_MAP_INIT;
    a->claims = (struct ks_map)KS_MAP_INIT;
    a->out_tail = &a->out_head;
    a->waitq_tail = &a->waitq;
    a->readyq_tail = &a->readyq;
    pthread_mutex_init(&a->mu, NULL);
    pthread_mutex_init(&a->sub_mu, NULL);
    pthread_mutex_init(&a->out_mu, NULL);
    pthread_cond_init(&a->out_flush_cond, NULL);
    pthread_mutex_init(&a->hb_mu, NULL);
    pthread_cond_init(&a->out_cond, NULL);
    pthread_cond_init(&a->idle_cond, NULL);
    pthread_cond_init(&a->ready_cond, NULL);
    pthread_cond_init(&a->cb_cond, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->hb_cond, &ca);
    pthread_condattr_destroy(&ca);
    atomic_store(&a->last_contact_us, ks_mono_us());
    gethostname(a->host, sizeof(a->host));
    agent__facts_read(&a->facts);
    ks_uuid(a->instance_id);
    a->started_at_us = ks_now_us();
    a->host[sizeof(a->host) - 1] = '\0';
    a->max_concurrent = opts->max_concurrent ? opts->max_concurrent
                                             : agent_default_max_concurrent();
    a->free_slots = a->max_concurrent;
    /* As the broker will make the consumer (AgentInfo.ack_wait_ms). */
    a->ack_wait_ms = evt_agent_ack_wait_ms(opts->ack_wait_ms);
    a->fence_ms = opts->fence_ms ? opts->fence_ms : AGENT_FENCE_MS;
    a->link_timeout_ms = opts->link_timeout_ms ? opts->link_timeout_ms
                                               : AGENT_LINK_TIMEOUT_MS;
    if (opts->state_dir) {
        char dir[4096];
        a->state_dir = strdup(opts->state_dir);
        snprintf(dir, sizeof(dir), "%s/outbox", opts->state_dir);
        mkdir(opts->state_dir, 0700);
        mkdir(dir, 0700);
        snprintf(dir, sizeof(dir), "%s/running", opts->state_dir);
        mkdir(dir, 0700);
    }
    agent__spare_init(a);
    if ((rc = agent__secret_init(a, errmsg)) ||
        (rc = agent__payload_init(a, errmsg)))
        goto fail;
    a->seen_ring = calloc(SEEN_MAX, sizeof(*a->seen_ring));
    if (!a->seen_ring) {
        rc = -ENOMEM;
        goto fail;
    }
    a->trust = opts->trust;
    if (opts->n_trust_keys) {
        rc = evt_verifier_new(&a->own_trust);
        for (size_t i = 0; rc == 0 && i < opts->n_trust_keys; i++) {
            rc = evt_verifier_add_file(a->own_trust, opts->trust_keys[i]);
            if (rc && errmsg &&
                asprintf(errmsg, "trusted key %s: %s", opts->trust_keys[i],
                         rc == KS_EINVAL ? "not an Ed25519 key (PEM)"
                                         : ks_strerror(rc)) < 0)
                *errmsg = NULL;
        }
        if (rc)
            goto fail;
        if (!a->trust)
            a->trust = a->own_trust;
    }
    if (!a->trust || evt_verifier_count(a->trust) == 0) {
        rc = KS_EINVAL;
        if (errmsg && asprintf(errmsg, "no trusted key: give --trust-key FILE "
                                       "(the broker's public key)") < 0)
            *errmsg = NULL;
        goto fail;
    }
    exec_global_init();
    struct exec_loop_opts lo = {
        .max_concurrent = a->max_concurrent,
        .watchdog_ms = opts->watchdog_ms ? opts->watchdog_ms
                                         : AGENT_WATCHDOG_MS,
    };
    rc = exec_loop_start(&lo, &a->loop);
    if (rc)
        goto fail;
    co.name = "kscore-agent";
    co.send_asap = true;
    co.retry_forever = true;
    co.global_delivery = opts->n_ids > 8;
    a->claim_inline = !co.global_delivery;
    /* Many ids share nats.c's delivery pool; a claim blocks its thread for
     * a round trip, so give the pool a few (nats.h
     * nats_SetMessageDeliveryPoolSize; process-wide, grows only). */
    if (co.global_delivery)
        nats_SetMessageDeliveryPoolSize(8);
    rc = evt_connect(opts->nats_url, &co, &a->nc, errmsg);
    if (rc)
        goto fail;
    a->slots = calloc(opts->n_ids, sizeof(*a->slots));
    if (!a->slots) {
        rc = -ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < opts->n_ids; i++) {
        struct agent_slot *s = &a->slots[i];
        s->agent = a;
        s->id = strdup(opts->ids[i]);
        a->n_slots = i + 1;
        if (!s->id) {
            rc = -ENOMEM;
            goto fail;
        }
        evt_agent_durable(s->identity, sizeof(s->identity), s->id);
        evt_cmd_subject(s->cmd_subject, sizeof(s->cmd_subject), opts->pool,
                        s->id);
        if (opts->pool && opts->pool[0]) {
            char durable[8 + EVT_AGENT_ID_MAX];
            uint32_t size = opts->pool_size ? opts->pool_size
                                            : (uint32_t)opts->n_ids;
            if (evt_pool_index(opts->pool, s->id, size) < 0) {
                rc = KS_EINVAL;
                if (errmsg &&
                    asprintf(errmsg,
                             "agent id %s is not in pool %s (its ids are "
                             "%s-0 .. %s-%u)",
                             s->id, opts->pool, opts->pool, opts->pool,
                             size - 1) < 0)
                    *errmsg = NULL;
                goto fail;
            }
            evt_pool_durable(durable, sizeof(durable), opts->pool);
            snprintf(s->ack_prefix, sizeof(s->ack_prefix), "$JS.ACK.%s.%s.",
                     EVT_STREAM_CMDS, durable);
            if (ks_map_put(&a->slot_of, s->id, s) != 0) {
                rc = -ENOMEM;
                goto fail;
            }
        } else {
            snprintf(s->ack_prefix, sizeof(s->ack_prefix), "$JS.ACK.%s.%s.",
                     EVT_STREAM_CMDS, s->identity);
        }
        if (opts->attestations && opts->attestations[i].sig) {
            const struct agent_attestation *at = &opts->attestations[i];
            s->has_attest = true;
            s->attest_labels = at->labels;
            s->n_attest_labels = at->n_labels;
            s->attest_at_us = at->enrolled_at_us;
            memcpy(s->attest_sig, at->sig, EVT_SIGNATURE_BYTES);
            snprintf(s->attest_key_id, sizeof(s->attest_key_id), "%s",
                     at->key_id ? at->key_id : "");
        }
    }
    /*
     * Registered (every id) before anything else: the broker creates the
     * streams, and it makes each id's consumer when it sees the id here
     * (broker/registry.c), so the consumer is on its way while we recover.
     * An agent never calls the JetStream API, so this is also where it
     * learns that there is no registry bucket: no stream answers.
     */
    /* What a previous run left, before the first heartbeat: that one
     * already lists the claims it takes up again (AgentInfo.holds), so no
     * broker ends those commands meanwhile. */
    if (a->state_dir) {
        outbox_load(a);
        /* After exec_global_init() killed the cgroups of dead agents. */
        agent__journal_recover(a);
    }
    rc = register_retrying(a);
    if (rc) {
        if (errmsg &&
            asprintf(errmsg, "cannot register in KV bucket %s: %s%s",
                     EVT_KV_AGENTS, ks_strerror(rc),
                     rc == KS_EUNAVAIL ? " (is a broker running on this "
                                         "NATS?)"
                                       : "") < 0)
            *errmsg = NULL;
        goto fail;
    }
    if (pthread_create(&a->pub_thread, NULL, publisher_main, a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    if (agent__out_start(a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    a->pub_started = true;
    a->n_starters = a->max_concurrent < STARTERS_MAX ? a->max_concurrent
                                                     : STARTERS_MAX;
    a->starters = calloc(a->n_starters, sizeof(*a->starters));
    if (!a->starters) {
        rc = -ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < a->n_starters; i++)
        if (pthread_create(&a->starters[i], NULL, starter_main, a) != 0) {
            a->n_starters = i;
            rc = KS_EINTERNAL;
            goto fail;
        }

    if (opts->pool && opts->pool[0]) {
        /* One queue subscription for the pool's consumer: processes of
         * one pool share its messages, as those of one id do. */
        char durable[8 + EVT_AGENT_ID_MAX], deliver[32 + EVT_AGENT_ID_MAX];
        evt_pool_durable(durable, sizeof(durable), opts->pool);
        evt_deliver_subject(deliver, sizeof(deliver), durable);
        if ((rc = subscribe_deliver(a, &a->pool_sub, deliver, durable,
                                    on_pool_command, a, errmsg)))
            goto fail;
    }
    for (size_t i = 0; i < a->n_slots; i++) {
        struct agent_slot *s = &a->slots[i];
        char deliver[32 + EVT_AGENT_ID_MAX], csubj[32 + EVT_AGENT_ID_MAX];
        /* The consumer agent-<id> (the broker's: evt_agent_consumer)
         * pushes to its deliver subject in queue group agent-<id>, so the
         * processes serving one id share its messages. A core
         * subscription: nats.c's JetStream subscribe would look the
         * consumer up through the JetStream API. */
        evt_deliver_subject(deliver, sizeof(deliver), s->identity);
        /* In a pool, the pool's subscription delivers. */
        if (!a->pool_sub &&
            (rc = subscribe_deliver(a, &s->sub, deliver, s->identity,
                                    on_command, s, errmsg)))
            goto fail;
        snprintf(csubj, sizeof(csubj), "kscore.cancel.%s", s->id);
        if (natsConnection_Subscribe(&s->cancel_sub, a->nc->nc, csubj,
                                     on_cancel, s) != NATS_OK) {
            rc = KS_ENATS;
            goto fail;
        }
    }
    /* The subscriptions are the server's before agent_start returns. */
    natsConnection_Flush(a->nc->nc);
    /* Its metrics whole before its first heartbeat: once the registry
     * has it, a scrape may come (test_metrics read no kscore_agent_slots
     * from a scrape between the registration and this, when it came
     * last). */
    ks_metrics_collector_add(agent_collect, a);
    if (pthread_create(&a->hb_thread, NULL, heartbeat_main, a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    a->hb_started = true;
    if (pthread_create(&a->keeper_thread, NULL, keeper_main, a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    a->keeper_started = true;
    if ((rc = evt_link_watch_start(a->nc, (int)a->link_timeout_ms, link_dead,
                                   a, &a->link_watch)))
        goto fail;
    *out = a;
    return 0;
fail:
    agent_stop(a);
    return rc;
}

pid_t
agent_watchdog_pid(struct agent *a)
{
    return a && a->loop ? exec_loop_watchdog_pid(a->loop) : 0;
}

/* Hands every message waiting for a slot back to JetStream (-NAK). */
static void
waitq_give_back(struct agent *a)
{
    struct job_ctx *waiting;

    pthread_mutex_lock(&a->mu);
    waiting = a->waitq;
    a->waitq = NULL;
    a->waitq_tail = &a->waitq;
    pthread_mutex_unlock(&a->mu);
    while (waiting) {
        struct job_ctx *j = waiting;
        waiting = j->qnext;
        if (!claim_held(a, j->command_id))
            agent__journal_remove(a, j->command_id);
        job_release(j, "-NAK");
    }
}

void
agent_drain(struct agent *a, uint64_t timeout_ms)
{
    if (!a || atomic_exchange(&a->draining, 1))
        return;
    a->drain_ms = (int64_t)timeout_ms;
    pthread_mutex_lock(&a->sub_mu);
    if (a->pool_sub)
        natsSubscription_Unsubscribe(a->pool_sub);
    for (size_t i = 0; i < a->n_slots; i++)
        if (a->slots[i].sub)
            natsSubscription_Unsubscribe(a->slots[i].sub);
    pthread_mutex_unlock(&a->sub_mu);
    /* The starters hand back what is ready and not yet claimed
     * (start_job); on_command hands back what is delivered meanwhile. */
    waitq_give_back(a);
    ks_log(KS_LOG_INFO,
           "draining: no new work; the running commands may finish",
           KS_S("agent", a->slots[0].id),
           KS_D("drain_timeout_s", (double)timeout_ms / 1000),
           KS_I("busy", agent_busy(a)));
}

static void
count_busy(const char *key, void *val, void *ud)
{
    const struct job_ctx *j = val;
    (void)key;
    if (j->state != JOB_WAITING)
        ++*(unsigned *)ud;
}

unsigned
agent_busy(struct agent *a)
{
    unsigned n = 0;

    if (!a)
        return 0;
    pthread_mutex_lock(&a->mu);
    ks_map_each(&a->jobs, count_busy, &n);
    for (struct outbox_item *it = a->out_head; it; it = it->next)
        n++;
    pthread_mutex_unlock(&a->mu);
    return n;
}

int
agent_stop_graceful(struct agent *a, uint64_t timeout_ms,
                    const sigset_t *stop_now)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    int sig = 0;
    unsigned busy;

    if (!a)
        return 0;
    agent_drain(a, timeout_ms);
    while ((busy = agent_busy(a)) && ks_mono_us() < deadline) {
        struct timespec tick = {0, 100 * 1000000L};
        if (stop_now && (sig = sigtimedwait(stop_now, NULL, &tick)) > 0)
            break;
        if (!stop_now)
            nanosleep(&tick, NULL);
        sig = 0;
    }
    if (busy)
        ks_log(KS_LOG_WARN,
               sig > 0 ? "stopping now (a second signal): what still runs is "
                         "stopped and reported Lost (the agent stopped)"
                       : "the drain timeout passed: what still runs is "
                         "stopped and reported Lost (the agent stopped)",
               KS_S("agent", a->slots ? a->slots[0].id : ""),
               KS_I("busy", busy),
               KS_D("drain_timeout_s", (double)timeout_ms / 1000));
    else
        ks_log(KS_LOG_INFO, "drained: nothing runs any more",
               KS_S("agent", a->slots ? a->slots[0].id : ""));
    agent_stop(a);
    return sig > 0 ? sig : 0;
}

static void
free_claim(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
agent_stop(struct agent *a)
{
    if (!a)
        return;
    ks_metrics_collector_remove(agent_collect, a);
    evt_link_watch_stop(a->link_watch);
    a->link_watch = NULL;
    /* No new work: no deliveries, no new claims. */
    atomic_store(&a->closing, 1);
    /* After closing, under sub_mu: aside_tick subscribes nothing again. */
    pthread_mutex_lock(&a->sub_mu);
    if (a->pool_sub)
        natsSubscription_Unsubscribe(a->pool_sub);
    for (size_t i = 0; i < a->n_slots; i++) {
        if (a->slots[i].sub)
            natsSubscription_Unsubscribe(a->slots[i].sub);
        if (a->slots[i].cancel_sub)
            natsSubscription_Unsubscribe(a->slots[i].cancel_sub);
    }
    pthread_mutex_unlock(&a->sub_mu);
    pthread_mutex_lock(&a->mu);
    while (a->callbacks)
        pthread_cond_wait(&a->cb_cond, &a->mu);
    pthread_cond_broadcast(&a->ready_cond);
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < a->n_starters; i++)
        pthread_join(a->starters[i], NULL); /* they nak what is ready */
    /* A starter may have handed a copy to a fetch thread after the wait
     * above: it sees closing and ends soon (spawn_claimed). */
    pthread_mutex_lock(&a->mu);
    while (a->callbacks)
        pthread_cond_wait(&a->cb_cond, &a->mu);
    pthread_mutex_unlock(&a->mu);
    if (a->keeper_started)
        pthread_join(a->keeper_thread, NULL);
    /* What never got a slot goes back to JetStream for whoever is next. */
    waitq_give_back(a);
    /* Stops what still runs (the kill protocol: TERM, grace, KILL); every
     * job's callback has run on return, and reports the agent stopped
     * (job_done), not a cancel. */
    atomic_store(&a->stop_killing, true);
    exec_loop_free(a->loop);
    a->loop = NULL;
    agent__out_stop(a);
    pthread_mutex_lock(&a->mu);
    a->stopping = 1;
    pthread_cond_broadcast(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
    pthread_mutex_lock(&a->hb_mu);
    pthread_cond_broadcast(&a->hb_cond);
    pthread_mutex_unlock(&a->hb_mu);
    if (a->pub_started)
        pthread_join(a->pub_thread, NULL);
    if (a->hb_started)
        pthread_join(a->hb_thread, NULL);
    free(a->starters);
    while (a->out_head) {
        struct outbox_item *it = a->out_head;
        a->out_head = it->next;
        free(it->buf);
        free(it);
    }
    evt_close(a->nc);
    /* Destroyed once the connection is closed and its read thread
     * joined: a message being delivered meanwhile could otherwise meet
     * the destruction (nats.c 3.4.1, issue 637). */
    natsSubscription_Destroy(a->pool_sub);
    for (size_t i = 0; i < a->n_slots; i++) {
        natsSubscription_Destroy(a->slots[i].sub);
        natsSubscription_Destroy(a->slots[i].cancel_sub);
        free(a->slots[i].id);
    }
    free(a->slots);
    ks_map_clear(&a->jobs);
    ks_map_clear(&a->seen);
    ks_map_each(&a->claims, free_claim, NULL);
    ks_map_clear(&a->claims);
    ks_map_clear(&a->slot_of);
    free(a->pool_name);
    free(a->seen_ring);
    evt_verifier_free(a->own_trust);
    agent__secret_release(a);
    agent__payload_release(a);
    pthread_mutex_destroy(&a->mu);
    pthread_mutex_destroy(&a->sub_mu);
    pthread_mutex_destroy(&a->spare_mu);
    pthread_mutex_destroy(&a->hb_mu);
    pthread_mutex_destroy(&a->out_mu);
    pthread_cond_destroy(&a->out_flush_cond);
    pthread_cond_destroy(&a->out_cond);
    pthread_cond_destroy(&a->idle_cond);
    pthread_cond_destroy(&a->ready_cond);
    pthread_cond_destroy(&a->cb_cond);
    pthread_cond_destroy(&a->hb_cond);
    free(a->state_dir);
    free(a);
}

enum agent_fatal
agent_fatal(struct agent *a)
{
    return a ? (enum agent_fatal)atomic_load(&a->fatal) : AGENT_FATAL_NONE;
}

const char *
agent_instance_id(struct agent *a)
{
    return a ? a->instance_id : "";
}
