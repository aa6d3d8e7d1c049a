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
 *
 * Every append is at the version the scan read, so a claim or a result
 * that lands meanwhile wins and the scanner's append is a conflict, dropped.
 */
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

static int
on_overdue(const struct store_command_ref *ref, void *ud)
{
    struct broker *b = ud;
    char stream[64], evid[37], reason[160];
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
        goto out;
    }
    /* Re-dispatch: a new attempt with a new Nats-Msg-Id, fenced by the
     * version just read. */
    Ks__Event disp;
    broker__event_init(&disp, evid, stream, "CommandDispatched",
                       ref->command_id);
    disp.agent_id = cmd->agent_id;
    disp.attempt = ref->attempt + 1;
    disp.deliver_by_us = now + broker__attempt_window_us(cmd);
    if (disp.deliver_by_us > cmd->not_after_us ||
        disp.attempt == BROKER_MAX_ATTEMPTS)
        disp.deliver_by_us = cmd->not_after_us;
    disp.reason = "not claimed in time: re-published";
    disp.operator_ = cmd->operator_;
    struct store_event se = {&disp};
    if (store_append(b->st_scan, stream, ref->version, &se, 1, NULL) == 0) {
        cmd->attempt = disp.attempt;
        cmd->dispatch_version = (uint64_t)ref->version + 1;
        ks_metric_inc(KS_C_REDISPATCHES);
        char pool[EVT_AGENT_ID_MAX + 1];
        broker__agent_pool(b, cmd->agent_id, pool, sizeof(pool));
        int rc = evt_publish_command(b->nc, b->signer, cmd, pool, 5000);
        if (rc)
            ks_log(KS_LOG_WARN, "re-publish failed",
                   KS_S("module", "scanner"),
                   KS_S("command_id", ref->command_id),
                   KS_S("agent", cmd->agent_id), KS_I("attempt", cmd->attempt),
                   KS_ERR(rc));
    }
out:
    ks__event__free_unpacked(req, NULL);
    return 0;
}

static int
on_running(const struct store_command_ref *ref, void *ud)
{
    struct broker *b = ud;
    struct broker__agent *a;
    int64_t seen_age_us = -1;
    char reason[200];

    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, ref->agent_id);
    if (a)
        seen_age_us = ks_mono_us() - broker__heard_locked(b, a);
    pthread_mutex_unlock(&b->mu);
    if (a && seen_age_us < (int64_t)EVT_AGENT_TTL_MS * 1000)
        return 0;
    /* Silence means something only while this broker could hear: it must
     * have been connected to NATS for a whole TTL, and its registry watch
     * alive and delivering, else the agents it missed were not dead, it
     * was deaf. */
    if (b->connected_since_mono_us == 0 ||
        ks_mono_us() - b->connected_since_mono_us <
            (int64_t)EVT_AGENT_TTL_MS * 1000 ||
        broker__registry_deaf(b))
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
}

static void *
scanner_main(void *arg)
{
    struct broker *b = arg;
    int64_t last_running = 0, last_sweep = ks_mono_us(),
            last_guard = ks_mono_us();

    while (!b->stopping) {
        nanosleep(&(struct timespec){0, SCAN_PERIOD_MS * 1000000L}, NULL);
        if (b->stopping)
            break;
        {
            int64_t now = ks_mono_us(), gap = 0;
            pthread_mutex_lock(&b->mu);
            if (b->scan_tick_mono_us &&
                now - b->scan_tick_mono_us > BROKER_PAUSE_US) {
                gap = now - b->scan_tick_mono_us;
                b->woke_mono_us = now;
            }
            b->scan_tick_mono_us = now;
            pthread_mutex_unlock(&b->mu);
            if (gap)
                ks_log(KS_LOG_WARN,
                       "this broker did not run for a while (paused or "
                       "starved): it judges no agent by silence until its "
                       "registry view is fresh",
                       KS_I("gap_ms", gap / 1000),
                       KS_I("fresh_in_ms", BROKER_WAKE_FRESH_US / 1000));
        }
        store_scan_open(b->st_scan, "Dispatched", ks_now_us(), 200,
                        on_overdue, b);
        if (natsConnection_Status(b->nc->nc) != NATS_CONN_STATUS_CONNECTED)
            b->connected_since_mono_us = 0;
        else if (b->connected_since_mono_us == 0)
            b->connected_since_mono_us = ks_mono_us();
        /* Lost agents need a coarser look: once a second. */
        if (ks_mono_us() - last_running >= 1000000) {
            last_running = ks_mono_us();
            store_scan_open(b->st_scan, "Running", 0, 1000, on_running, b);
        }
        if (ks_mono_us() - last_guard >= GUARD_PERIOD_US) {
            last_guard = ks_mono_us();
            guard_jetstream(b);
        }
        /* Live followers on other brokers of commands that ended there. */
        if (ks_mono_us() - last_sweep >= 10 * INT64_C(1000000)) {
            last_sweep = ks_mono_us();
            broker__remote_live_sweep(b, b->st_scan);
        }
    }
    return NULL;
}

int
broker__scanner_start(struct broker *b)
{
    if (pthread_create(&b->scan_thread, NULL, scanner_main, b) != 0)
        return KS_EINTERNAL;
    b->scan_started = true;
    return 0;
}

void
broker__scanner_stop(struct broker *b)
{
    b->stopping = 1;
    if (b->scan_started)
        pthread_join(b->scan_thread, NULL);
    b->scan_started = false;
}
