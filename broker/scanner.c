/*
 * The deadline scanner: makes every accepted command reach a terminal state,
 * from PostgreSQL alone (so it works the same after a broker restart).
 *
 *  - Dispatched past its attempt's deadline: re-published with attempt + 1
 *    (new Nats-Msg-Id "<id>.<attempt>"), until the command's delivery
 *    deadline; then CommandUndeliverable. The delivery window is split
 *    evenly over BROKER_MAX_ATTEMPTS, so a dead agent costs exactly the
 *    delivery deadline (K27), never more.
 *  - Running on an agent whose heartbeat is older than EVT_AGENT_TTL_MS:
 *    CommandLost.
 *  - Running on an agent that heartbeats, but no process of it holds it
 *    (AgentInfo.holds; "Running, but its claimer does not hold it"
 *    below): CommandLost.
 *  - kscore copy's files past their keep, and unfinished uploads, are
 *    deleted a few at a time (broker__blob_expire).
 *
 * Every append is at the version the scan read, so a claim or a result
 * that lands meanwhile wins and the scanner's append is a conflict, dropped.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

#define SCAN_PERIOD_MS 100

static int
first_event(const Ks__RecordedEvent *ev, void *ud)
{
    Ks__Event **out = ud;
    uint8_t *buf;
    size_t len;
    if (!ev->event || kproto_pack(&ev->event->base, &buf, &len) != 0)
        return 1;
    *out = ks__event__unpack(NULL, len, buf);
    free(buf);
    return 1; /* one is enough */
}

/* The CommandRequested event of a command (the command as accepted). */
static int
read_requested(struct store *st, const char *stream, Ks__Event **out)
{
    Ks__Event *ev = NULL;
    int rc = store_read_stream(st, stream, 0, 1, first_event, &ev);
    if (rc < 0)
        return rc;
    if (!ev || !ev->command || strcmp(ev->type, "CommandRequested") != 0) {
        if (ev)
            ks__event__free_unpacked(ev, NULL);
        return KS_ENOTFOUND;
    }
    *out = ev;
    return 0;
}

/* Appends a terminal status event and answers the waiting client. */
static void
end_command(struct broker *b, const struct store_command_ref *ref,
            const char *type, Ks__CommandStatus status, const char *reason,
            const char *operator_name)
{
    char stream[64], evid[37];
    Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
    Ks__Event ev;

    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    res.status = status;
    res.reason = (char *)reason;
    res.term_sent_us = res.kill_sent_us = -1;
    broker__event_init(&ev, evid, stream, type, ref->command_id);
    ev.agent_id = (char *)ref->agent_id;
    ev.attempt = ref->attempt;
    ev.reason = (char *)reason;
    ev.operator_ = (char *)operator_name;
    ev.result = &res;
    struct store_event se = {&ev};
    if (store_append(b->st_scan, stream, ref->version, &se, 1, NULL) == 0)
        broker__command_ended(b, ref->command_id, &res);
}

/* Appends attempt ref->attempt + 1 of cmd (its CommandRequested's
 * command) at ref->version, and publishes it (see broker__redispatch). */
static int
redispatch(struct broker *b, struct store *st,
           const struct store_command_ref *ref, Ks__Command *cmd,
           const char *reason)
{
    char stream[64], evid[37];
    int64_t now = ks_now_us();
    Ks__Event disp;

    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    broker__event_init(&disp, evid, stream, "CommandDispatched",
                       ref->command_id);
    disp.agent_id = cmd->agent_id;
    disp.attempt = ref->attempt + 1;
    disp.deliver_by_us = now + broker__attempt_window_us(cmd);
    if (disp.deliver_by_us > cmd->not_after_us ||
        disp.attempt == BROKER_MAX_ATTEMPTS)
        disp.deliver_by_us = cmd->not_after_us;
    disp.reason = (char *)reason;
    disp.operator_ = cmd->operator_;
    struct store_event se = {&disp};
    int rc = store_append(st, stream, ref->version, &se, 1, NULL);
    if (rc)
        return rc;
    cmd->attempt = disp.attempt;
    cmd->dispatch_version = (uint64_t)ref->version + 1;
    ks_metric_inc(KS_C_REDISPATCHES);
    char pool[EVT_AGENT_ID_MAX + 1];
    broker__agent_pool(b, cmd->agent_id, pool, sizeof(pool));
    uint64_t seq = 0;
    int prc = evt_publish_command(b->nc, b->signer, cmd, pool, 5000, &seq);
    if (prc == 0)
        broker__admit_stored(b, ref->command_id, seq);
    if (prc)
        ks_log(KS_LOG_WARN, "re-publish failed", KS_S("module", "scanner"),
               KS_S("command_id", ref->command_id),
               KS_S("agent", cmd->agent_id), KS_I("attempt", cmd->attempt),
               KS_ERR(prc));
    return 0;
}

int
broker__redispatch(struct broker *b, struct store *st,
                   const struct store_command_ref *ref, const char *reason)
{
    char stream[64];
    Ks__Event *req = NULL;

    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    int rc = read_requested(st, stream, &req);
    if (rc)
        return rc;
    if (ref->attempt >= BROKER_MAX_ATTEMPTS ||
        ks_now_us() >= req->command->not_after_us)
        rc = KS_ECONFLICT; /* the scanner's to end at its deadline */
    else
        rc = redispatch(b, st, ref, req->command, reason);
    ks__event__free_unpacked(req, NULL);
    return rc;
}

static int
on_overdue(const struct store_command_ref *ref, void *ud)
{
    struct broker *b = ud;
    char stream[64], reason[160];
    Ks__Event *req = NULL;
    int64_t now = ks_now_us();

    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    if (read_requested(b->st_scan, stream, &req) != 0)
        return 0;
    Ks__Command *cmd = req->command;
    if (ref->attempt >= BROKER_MAX_ATTEMPTS || now >= cmd->not_after_us) {
        snprintf(reason, sizeof(reason),
                 "no agent claimed it within %.1f s (%u attempt%s)",
                 (double)(cmd->not_after_us - cmd->issued_at_us) / 1e6,
                 ref->attempt, ref->attempt == 1 ? "" : "s");
        end_command(b, ref, "CommandUndeliverable",
                    KS__COMMAND_STATUS__UNDELIVERABLE, reason,
                    cmd->operator_);
    } else {
        /* A new attempt with a new Nats-Msg-Id, fenced by the version
         * just read. */
        (void)redispatch(b, b->st_scan, ref, cmd,
                         "not claimed in time: re-published");
    }
    ks__event__free_unpacked(req, NULL);
    return 0;
}

/* ---- Running, but its claimer does not hold it ----------------------------- */

/*
 * A command is listed in every heartbeat of the agent process that claimed
 * it, from before its claim is sent until its end is in the event stream
 * (AgentInfo.holds). So a live heartbeat of that process, sent after the
 * claim (heartbeat_seq >= the claim's listed_from_seq), that does not list
 * it says the process does not run it and has no end of it to report:
 * its claim's reply was lost and it forgot the claim, or it restarted
 * without the state dir that would have told it. Such a command never ends
 * by itself, so the scanner ends it Lost, once the recorder has taken
 * everything the event stream held when that heartbeat was seen (an end
 * published just before it may still be on its way to the record: the
 * recorder consumer's ack floor, not a clock, says when it is there). A
 * heartbeat of another process of the id that does not list it counts
 * once the claimer has been silent for EVT_AGENT_TTL_MS (a restart: its
 * watchdog killed what it ran).
 */

/* What the Running scan keeps of a command between passes: forgotten by
 * the first pass that no longer finds it so (unlisted_sweep). First in
 * each such entry. */
struct scan_entry {
    uint64_t pass; /* the last pass that still found it so */
};

struct scan_unlisted {
    struct scan_entry e;
    uint64_t need_seq; /* the event stream's last sequence when seen */
    char why[300];     /* the reason it ends with */
};

/* The claim of a command as its CommandStarted recorded it. */
struct claim_of {
    char instance[37];
    uint64_t listed_from;
};

/* b->scan_claims: read once per Running command (its stream, up to 256
 * events, unpacked), not once a pass: every second, for each command its
 * agent does not list, before (an agent from before AgentInfo.holds, or
 * one that never lists it: 84% of the broker's allocation calls over
 * kscore perf's event_throughput, heaptrack). */
struct scan_claim {
    struct scan_entry e;
    struct claim_of c;
};

static int
claim_event(const Ks__RecordedEvent *rev, void *ud)
{
    struct claim_of *c = ud;
    const Ks__Event *ev = rev->event;
    if (ev && strcmp(ev->type, "CommandStarted") == 0) {
        snprintf(c->instance, sizeof(c->instance), "%s", ev->instance_id);
        c->listed_from = ev->listed_from_seq;
        return 1; /* a command has one claim: the rest is not unpacked */
    }
    return 0;
}

/* JetStream waits of the scanner's look at the recorder (ms). */
#define SCAN_JS_WAIT_MS 1000

/*
 * What JetStream says of the recorder into *seq: the event stream's last
 * sequence (0: empty), or with floor the recorder consumer's ack floor,
 * up to which every event is recorded (or refused, and that recorded;
 * nats-server 2.9 consumer.go processAckMsg: with nothing pending it is
 * the last delivered). false when JetStream does not answer.
 */
static bool
recorder_seq(struct broker *b, bool floor, uint64_t *seq)
{
    jsOptions o;
    natsStatus s;

    jsOptions_Init(&o);
    o.Wait = SCAN_JS_WAIT_MS;
    if (floor) {
        jsConsumerInfo *ci = NULL;
        s = js_GetConsumerInfo(&ci, b->nc->js, EVT_STREAM_EVENTS,
                               EVT_RECORDER_DURABLE, &o, NULL);
        if (s == NATS_OK)
            *seq = ci->AckFloor.Stream;
        jsConsumerInfo_Destroy(ci);
    } else {
        jsStreamInfo *si = NULL;
        s = js_GetStreamInfo(&si, b->nc->js, EVT_STREAM_EVENTS, &o, NULL);
        if (s == NATS_OK)
            *seq = si->State.LastSeq;
        jsStreamInfo_Destroy(si);
    }
    return s == NATS_OK;
}

/* What one pass of the Running scan knows (scanner thread). */
struct running_pass {
    struct broker *b;
    uint64_t pass;
    bool have_floor; /* floor read (once per pass) */
    uint64_t floor;  /* recorder_seq's ack floor */
};

/*
 * 1 when ref, Running on an agent that heartbeats, is held by no process
 * that could still end it (above), with why; 0 when it is held or this
 * broker cannot tell. *known: it was found so before (b->unlisted: its
 * claim, which never changes, is not read again).
 */
/* ref's claim (b->scan_claims, read once), or NULL when it cannot be read
 * now (tried again next pass). Marked seen by pass. */
static const struct claim_of *
claim_of_running(struct broker *b, const struct store_command_ref *ref,
                 uint64_t pass)
{
    struct scan_claim *sc = ks_map_get(&b->scan_claims, ref->command_id);
    if (!sc) {
        char stream[64];
        struct claim_of c = {"", 0};
        snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
        /* Running in the projection: its CommandStarted is committed. */
        if (store_read_stream(b->st_scan, stream, 0, 256, claim_event, &c) <
                0 ||
            !(sc = calloc(1, sizeof(*sc))))
            return NULL;
        sc->c = c;
        if (ks_map_put(&b->scan_claims, ref->command_id, sc) != 0) {
            free(sc);
            return NULL;
        }
    }
    sc->e.pass = pass;
    return &sc->c;
}

static int
claimer_let_go(struct broker *b, const struct store_command_ref *ref,
               uint64_t pass, char *why, size_t len, bool *known)
{
    uint8_t id[16];
    char inst[37];
    uint64_t seq = 0;
    const struct claim_of *cl;

    *known = false;
    if (ks_uuid_bin(ref->command_id, id) != 0 ||
        broker__agent_lists(b, ref->agent_id, id, inst, &seq, NULL) != 0)
        return 0;
    if (ks_map_get(&b->unlisted, ref->command_id)) {
        *known = true;
        return 1;
    }
    if (!(cl = claim_of_running(b, ref, pass)) || !cl->instance[0] ||
        !cl->listed_from)
        return 0; /* an agent from before AgentInfo.holds */
    struct claim_of c = *cl;
    if (strcmp(c.instance, inst) == 0) {
        if (seq < c.listed_from)
            return 0; /* that heartbeat was made before the claim */
        snprintf(why, len,
                 "agent %s does not run it: its heartbeat %" PRIu64
                 " (process %.8s), sent after its claim, does not list it "
                 "(the claim's reply was lost and the agent let it go)",
                 ref->agent_id, seq, inst);
        return 1;
    }
    /* Another process of the id: the claimer must be gone, heard by a
     * broker that could hear it all along. */
    if (b->connected_since_mono_us == 0 ||
        ks_mono_us() - b->connected_since_mono_us <
            (int64_t)EVT_AGENT_TTL_MS * 1000 ||
        !broker__instance_silent(b, ref->agent_id, c.instance))
        return 0;
    snprintf(why, len,
             "agent %s does not run it: the process that claimed it (%.8s) "
             "is gone (silent for %d s) and the one serving the id now "
             "(%.8s) does not list it",
             ref->agent_id, c.instance, EVT_AGENT_TTL_MS / 1000, inst);
    return 1;
}

/* Ends ref as Lost for why (NULL: the one it was first found with) once
 * the recorder has taken what the event stream held when its claimer was
 * first found to let it go. */
static void
end_let_go(struct running_pass *rp, const struct store_command_ref *ref,
           const char *why)
{
    struct broker *b = rp->b;
    struct scan_unlisted *u = ks_map_get(&b->unlisted, ref->command_id);

    if (!u) {
        uint64_t last;
        if (!recorder_seq(b, false, &last) || !(u = calloc(1, sizeof(*u))))
            return;
        u->need_seq = last;
        snprintf(u->why, sizeof(u->why), "%s", why);
        if (ks_map_put(&b->unlisted, ref->command_id, u) != 0) {
            free(u);
            return;
        }
    }
    u->e.pass = rp->pass;
    if (!rp->have_floor)
        rp->have_floor = recorder_seq(b, true, &rp->floor);
    if (!rp->have_floor || rp->floor < u->need_seq)
        return; /* an end may still be on its way: next pass */
    char stream[64];
    Ks__Event *req = NULL;
    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    read_requested(b->st_scan, stream, &req);
    ks_log(KS_LOG_WARN, "a running command is held by no agent process: Lost",
           KS_S("module", "scanner"), KS_S("command_id", ref->command_id),
           KS_S("agent", ref->agent_id), KS_S("reason", u->why));
    end_command(b, ref, "CommandLost", KS__COMMAND_STATUS__LOST, u->why,
                req ? req->command->operator_ : "");
    if (req)
        ks__event__free_unpacked(req, NULL);
    free(ks_map_del(&b->unlisted, ref->command_id));
}

struct sweep {
    uint64_t pass;
    char (*gone)[37];
    size_t n, cap;
};

static void
sweep_one(const char *key, void *val, void *ud)
{
    struct sweep *sw = ud;
    const struct scan_entry *e = val;
    if (e->pass == sw->pass)
        return;
    if (sw->n == sw->cap) {
        size_t nc = sw->cap ? sw->cap * 2 : 16;
        char (*p)[37] = realloc(sw->gone, nc * sizeof(*p));
        if (!p)
            return;
        sw->gone = p;
        sw->cap = nc;
    }
    snprintf(sw->gone[sw->n++], 37, "%s", key);
}

/* Forgets what the pass did not find so (m: struct scan_entry values). */
static void
sweep_map(struct ks_map *m, uint64_t pass)
{
    struct sweep sw = {pass, NULL, 0, 0};
    ks_map_each(m, sweep_one, &sw);
    for (size_t i = 0; i < sw.n; i++)
        free(ks_map_del(m, sw.gone[i]));
    free(sw.gone);
}

/* Forgets the commands this pass no longer found let go (ended, or
 * listed again), and the claims of those it no longer found Running on a
 * heartbeating agent. */
static void
unlisted_sweep(struct broker *b, uint64_t pass)
{
    sweep_map(&b->unlisted, pass);
    sweep_map(&b->scan_claims, pass);
}

static int
on_running(const struct store_command_ref *ref, void *ud)
{
    struct running_pass *rp = ud;
    struct broker *b = rp->b;
    struct broker__agent *a;
    int64_t seen_age_us = -1;
    char reason[300];

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, ref->agent_id);
    if (a)
        seen_age_us = ks_mono_us() - broker__heard_locked(b, a);
    pthread_mutex_unlock(&b->mu);
    if (a && seen_age_us < (int64_t)EVT_AGENT_TTL_MS * 1000) {
        /* It heartbeats: does the process that claimed this hold it? */
        bool known;
        if (claimer_let_go(b, ref, rp->pass, reason, sizeof(reason),
                           &known))
            end_let_go(rp, ref, known ? NULL : reason);
        return 0;
    }
    /* Silence means something only while this broker could hear: it must
     * have been connected to NATS for a whole TTL, and its registry watch
     * alive and delivering, else the agents it missed were not dead, it
     * was deaf. */
    if (b->connected_since_mono_us == 0 ||
        ks_mono_us() - b->connected_since_mono_us <
            (int64_t)EVT_AGENT_TTL_MS * 1000 ||
        !broker__silent_past(b, ref->agent_id,
                             (int64_t)EVT_AGENT_TTL_MS * 1000))
        return 0;
    /* A command claimed a moment ago by an agent that then died is Lost
     * too, but give the claim's first heartbeat a chance. */
    if (ks_now_us() - ref->started_at_us < (int64_t)EVT_AGENT_TTL_MS * 1000)
        return 0;
    snprintf(reason, sizeof(reason),
             "agent %s stopped heartbeating (none for %d s)", ref->agent_id,
             EVT_AGENT_TTL_MS / 1000);
    char stream[64];
    Ks__Event *req = NULL;
    snprintf(stream, sizeof(stream), "command-%s", ref->command_id);
    read_requested(b->st_scan, stream, &req);
    end_command(b, ref, "CommandLost", KS__COMMAND_STATUS__LOST, reason,
                req ? req->command->operator_ : "");
    if (req)
        ks__event__free_unpacked(req, NULL);
    return 0;
}

/*
 * What the broker stands on in JetStream, looked at every
 * GUARD_PERIOD_US: a stream, the registry bucket or the recorder's
 * consumer that is gone (deleted by someone holding a broker's credential,
 * or lost with a node's store) is made again at once, loudly. Without it a
 * deleted recorder consumer stopped all recording while `kscore status`
 * said everything ran (issue 21). A part the server does not answer for
 * is left alone: that is an election or an outage, not a deletion.
 */
#define GUARD_PERIOD_US (5 * INT64_C(1000000))
#define GUARD_TIMEOUT_MS 500

/*
 * Agents whose share of the events stream is full (EVT_EVENTS_PER_SUBJECT
 * unrecorded events): nats-server refuses their publishes and only the
 * agent hears of it, so say here who they are, once per guard period
 * while it lasts. An agent that floods reports stays there; one whose
 * events wait for a stalled recorder gets there too.
 */
static void
note_agents_at_share(struct broker *b)
{
    char **ids = NULL, list[512] = "";
    size_t n = 0, used = 0;

    if (evt_events_agents_at_share(b->nc, GUARD_TIMEOUT_MS, &ids, &n) != 0 ||
        n == 0) {
        evt_strv_free(ids, n);
        return;
    }
    for (size_t i = 0; i < n && used + 2 < sizeof(list); i++) {
        int w = snprintf(list + used, sizeof(list) - used, "%s%s",
                         i ? "," : "", ids[i]);
        if (w < 0 || (size_t)w >= sizeof(list) - used)
            break;
        used += (size_t)w;
    }
    ks_log(KS_LOG_WARN,
           "agents at their share of the events stream: nats-server "
           "refuses their reports until the recorder takes what they have "
           "waiting (an agent that floods, or a recorder that is behind)",
           KS_S("module", "scanner"), KS_I("agents", n),
           KS_S("agent_ids", list), KS_I("share", EVT_EVENTS_PER_SUBJECT));
    evt_strv_free(ids, n);
}

static void
guard_jetstream(struct broker *b)
{
    unsigned missing = 0;
    char *err = NULL;
    int rc;

    if (natsConnection_Status(b->nc->nc) != NATS_CONN_STATUS_CONNECTED)
        return;
    evt_parts_missing(b->nc, GUARD_TIMEOUT_MS, &missing);
    for (int i = 0; i < EVT_PARTS; i++)
        if (missing & (1u << i))
            ks_log(KS_LOG_ERROR, "a JetStream part kscore needs is gone: "
                                 "making it again",
                   KS_S("part", evt_part_names[i]));
    if (missing & 7u) {
        rc = evt_setup_replicas(
            b->nc, b->opts->replicas ? (int)b->opts->replicas : 1, &err);
        if (rc)
            ks_log(KS_LOG_ERROR, "cannot make the streams again",
                   KS_S("error", err ? err : ks_strerror(rc)));
        free(err);
        err = NULL;
    }
    if (missing & 0xau) { /* the events stream or the consumer itself */
        rc = broker__recorder_ensure(b, &err);
        if (rc)
            ks_log(KS_LOG_ERROR, "cannot make the recorder's consumer again",
                   KS_S("error", err ? err : ks_strerror(rc)));
        free(err);
    }
    for (int i = 0; i < EVT_PARTS; i++)
        if (missing & (1u << i))
            ks_metric_inc(KS_C_JETSTREAM_REPAIRS);
    note_agents_at_share(b);
}

/*
 * The pause watch: a thread that does nothing but tick every
 * PAUSE_TICK_MS, so that a late tick means this process did not run
 * (SIGSTOP, a frozen VM, starved of CPU), never that a thread was busy.
 * The scanner's own loop used to be the clock, and a slow query in it
 * (a 1 s lock timeout, a loaded PostgreSQL) read as a pause: the broker
 * then judged nobody by silence for 6 s (test_cluster
 * registry_watch_node_dies, 1 run in 20). A wake lasts until the
 * registry view is fresh again (registry.c: this broker's own beacon put
 * after the wake seen through its watch, and BROKER_WAKE_FRESH_US for the
 * agents paused with it).
 */
#define PAUSE_TICK_MS 100

static void *
pause_main(void *arg)
{
    struct broker *b = arg;

    while (!b->stopping) {
        nanosleep(&(struct timespec){0, PAUSE_TICK_MS * 1000000L}, NULL);
        /* The tick is atomic, so waiting for b->mu never reads as a
         * pause; after a pause the wake is set before the tick is new, so
         * no thread sees a fresh tick without the wake (helper-24). */
        int64_t now = ks_mono_us(), last = atomic_load(&b->tick_mono_us),
                gap = 0;
        if (last && now - last > BROKER_PAUSE_US) {
            gap = now - last;
            pthread_mutex_lock(&b->mu);
            b->woke_mono_us = now;
            pthread_mutex_unlock(&b->mu);
            atomic_store(&b->paused_mono_us, now);
        }
        atomic_store(&b->tick_mono_us, now);
        if (gap)
            ks_log(KS_LOG_WARN,
                   "this broker did not run for a while (paused or "
                   "starved): it judges no agent by silence until its "
                   "registry view is fresh (its own next beacon seen)",
                   KS_I("gap_ms", gap / 1000));
    }
    return NULL;
}

static void *
scanner_main(void *arg)
{
    struct broker *b = arg;
    int64_t last_running = 0, last_sweep = ks_mono_us(),
            last_guard = ks_mono_us(), next_expire = 0;
    uint64_t pass = 0;

    while (!b->stopping) {
        nanosleep(&(struct timespec){0, SCAN_PERIOD_MS * 1000000L}, NULL);
        if (b->stopping)
            break;
        store_scan_open(b->st_scan, "Dispatched", ks_now_us(), 200,
                        on_overdue, b);
        if (natsConnection_Status(b->nc->nc) != NATS_CONN_STATUS_CONNECTED)
            b->connected_since_mono_us = 0;
        else if (b->connected_since_mono_us == 0)
            b->connected_since_mono_us = ks_mono_us();
        /* Lost agents need a coarser look: once a second. */
        if (ks_mono_us() - last_running >= 1000000) {
            struct running_pass rp = {b, ++pass, false, 0};
            last_running = ks_mono_us();
            if (store_scan_open(b->st_scan, "Running", 0, 1000, on_running,
                                &rp) == 0)
                unlisted_sweep(b, pass);
        }
        if (ks_mono_us() - last_guard >= GUARD_PERIOD_US) {
            last_guard = ks_mono_us();
            guard_jetstream(b);
        }
        /* Live followers on other brokers of commands that ended there. */
        if (ks_mono_us() - last_sweep >= 10 * INT64_C(1000000)) {
            last_sweep = ks_mono_us();
            broker__remote_live_sweep(b, b->st_scan);
            broker__admit_sweep(b, b->st_scan);
        }
        if (ks_mono_us() >= next_expire)
            next_expire = ks_mono_us() + broker__blob_expire(b, b->st_scan);
        broker__budget_sweep(b);
    }
    return NULL;
}

int
broker__scanner_start(struct broker *b)
{
    if (pthread_create(&b->pause_thread, NULL, pause_main, b) != 0)
        return KS_EINTERNAL;
    b->pause_started = true;
    if (pthread_create(&b->scan_thread, NULL, scanner_main, b) != 0)
        return KS_EINTERNAL;
    b->scan_started = true;
    return 0;
}

static void
free_unlisted(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
broker__scanner_stop(struct broker *b)
{
    b->stopping = 1;
    if (b->scan_started)
        pthread_join(b->scan_thread, NULL);
    b->scan_started = false;
    if (b->pause_started)
        pthread_join(b->pause_thread, NULL);
    b->pause_started = false;
    ks_map_each(&b->unlisted, free_unlisted, NULL);
    ks_map_clear(&b->unlisted);
}
