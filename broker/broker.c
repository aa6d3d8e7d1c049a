/* The broker: start-up, the API handlers, shutdown. */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker_int.h"

/* b->up.ended (broker_int.h): a command's end recorded here reaches its
 * waiter, its live followers, its batch, or, when none of them is here,
 * the broker that has them (notice.c). */
static void
command_ended(struct broker *b, const char *command_id,
              const Ks__CommandResult *result)
{
    broker__admit_ended(b, command_id);
    broker__output_caps_forget(b, command_id);
    bool here = broker__reply_waiter(b, command_id, result, 0, NULL);
    here = broker__live_end(b, command_id) || here;
    broker__remote_live_end(b, command_id);
    here = broker__batch_target_ended(b, command_id, result) || here;
    /* Nobody here for it: the broker that waits for it (another exec's,
     * a batch's driver) hears of it at once (notice.c). */
    if (!here)
        broker__notice_ended(b, command_id);
}

/* The waiter for command_id (if any is still here) gets its result from
 * the record. */
static void
answer_waiter(struct broker *b, const char *command_id)
{
    Ks__CommandView *v = NULL;
    bool waits;

    pthread_mutex_lock(&b->mu);
    waits = ks_map_get(&b->waiters, command_id) != NULL;
    pthread_mutex_unlock(&b->mu);
    if (!waits)
        return;
    if (store_get_command(b->st_notice, command_id, &v) != 0)
        return; /* the client asks again and is answered then */
    if (kproto_status_terminal(v->status)) {
        Ks__CommandResult empty = KS__COMMAND_RESULT__INIT;
        Ks__CommandResult *res = v->result ? v->result : &empty;
        res->status = v->status;
        /* Output that travelled in pieces is put back, as get does. */
        if (broker__fill_output(b->st_notice, command_id, res) == 0)
            broker__reply_waiter(b, command_id, res, 0, NULL);
    }
    ks__command_view__free_unpacked(v, NULL);
}

/* b->up.remote_ended (broker_int.h), on notice.c's delivery thread:
 * another broker recorded command_id's end; whatever waits for it here
 * hears of it now. */
static void
remote_ended(struct broker *b, const char *command_id)
{
    broker__admit_ended(b, command_id);
    broker__output_caps_forget(b, command_id);
    broker__live_end(b, command_id);
    broker__remote_live_end(b, command_id);
    broker__batch_remote_end(b, command_id);
    answer_waiter(b, command_id);
}

/* The command's publish, overlapping its record (on_execute). rc: 1 not
 * run, else evt_publish_command's; later: not taken at once, so the
 * publisher's (publisher.c) once recorded. */
struct dispatch_pub {
    struct broker *b;
    struct broker__worker *wk;
    const Ks__Command *cmd;
    char pool[EVT_AGENT_ID_MAX + 1];
    int rc;
    bool later;
    uint64_t seq; /* KSCORE_CMDS stream sequence, on rc 0 */
};

/* Publishes dp's command with one try of up to BROKER_PUBLISH_INLINE_MS,
 * or none while the publisher has commands the stream did not take (it
 * would not take this one either: an election). Either way the worker is
 * not held for the election's length. */
static void
publish_now(struct dispatch_pub *dp)
{
    if (broker__publisher_busy(dp->b)) {
        dp->rc = KS_EUNAVAIL;
        dp->later = dp->wk->publish_handed = true;
        return;
    }
    atomic_store(&dp->wk->publishing_us, ks_mono_us());
    dp->rc = evt_publish_command(dp->b->nc, dp->b->signer, dp->cmd, dp->pool,
                                 BROKER_PUBLISH_INLINE_MS, &dp->seq);
    atomic_store(&dp->wk->publishing_us, 0);
    dp->later = dp->rc != 0 && dp->rc != KS_ETOOBIG;
    /* Even a first try that timed out (no second one: not counted as a
     * JetStream retry) waited for the stream, not for kscore. */
    if (dp->later)
        dp->wk->publish_handed = true;
    if (dp->rc == 0)
        ks_trace("broker.command_published", dp->cmd->command_id);
}

static void
publish_between(void *ud)
{
    publish_now(ud);
}

static void
reply_execute_error(struct broker *b, natsMsg *msg, int code, const char *fmt,
                    ...) __attribute__((format(printf, 4, 5)));
static void
reply_execute_error(struct broker *b, natsMsg *msg, int code, const char *fmt,
                    ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
    r.error_code = code;
    r.error = text;
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
}

/* ---- ExecuteCommand ---------------------------------------------------- */

/*
 * A request whose idempotency key names an existing command: answer with
 * that command instead of running again (its result when it has ended;
 * else wait for it like the first caller). Returns 0 when answered.
 */
static bool
same_argv(const Ks__CommandView *v, const Ks__CommandSpec *spec)
{
    if (v->n_argv != spec->n_argv)
        return false;
    for (size_t i = 0; i < v->n_argv; i++)
        if (strcmp(v->argv[i], spec->argv[i]) != 0)
            return false;
    return true;
}

/* Whether two payloads (script, stdin) are the same bytes: by SHA-256,
 * which the broker checked against the bytes of each. */
static bool
same_payload(const Ks__Payload *a, const Ks__Payload *b)
{
    if (!a || !b)
        return a == b;
    return a->sha256.len == b->sha256.len &&
           memcmp(a->sha256.data, b->sha256.data, a->sha256.len) == 0;
}

/* store_read_stream's callback: ud is the spec asked for; clears it (sets
 * *(const void **)ud to NULL) when the recorded command's script, stdin
 * or user differ from it. */
static int
same_recorded(const Ks__RecordedEvent *rev, void *ud)
{
    const Ks__CommandSpec **want = ud;
    const Ks__Event *ev = rev->event;
    if (!*want || !ev || !ev->command || !ev->command->spec)
        return 0;
    const Ks__CommandSpec *got = ev->command->spec;
    if (!same_payload(got->script, (*want)->script) ||
        !same_payload(got->input, (*want)->input) ||
        strcmp(got->run_as, (*want)->run_as) != 0)
        *want = NULL;
    return 0;
}

/* Whether the command recorded as command_id runs what spec asks beyond
 * argv (the projection keeps argv only: its CommandRequested the rest). */
static bool
same_spec_beyond_argv(struct store *st, const char *command_id,
                      const Ks__CommandSpec *spec)
{
    char stream[64];
    const Ks__CommandSpec *want = spec;
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    if (store_read_stream(st, stream, 0, 1, same_recorded, &want) != 0)
        return true; /* unreadable: argv decided, as before */
    return want != NULL;
}

static int
attach_existing(struct broker *b, struct store *st, natsMsg *msg,
                const char *command_id, bool detach,
                const Ks__CommandSpec *argv)
{
    Ks__CommandView *v = NULL;
    Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
    Ks__CommandResult empty = KS__COMMAND_RESULT__INIT;
    struct broker__waiter *w = NULL;
    int rc;

    if (!detach) {
        w = calloc(1, sizeof(*w));
        if (!w || !(w->reply_subject = strdup(natsMsg_GetReply(msg)))) {
            free(w);
            return -ENOMEM;
        }
        pthread_mutex_lock(&b->mu);
        /* One waiter per command: a second concurrent caller with the same
         * key is answered when it polls again; rare enough. */
        if (ks_map_get(&b->waiters, command_id)) {
            pthread_mutex_unlock(&b->mu);
            free(w->reply_subject);
            free(w);
            w = NULL;
        } else {
            ks_map_put(&b->waiters, command_id, w);
            pthread_mutex_unlock(&b->mu);
        }
    }
    /* Read after registering: an end recorded in between is not missed. */
    rc = store_get_command(st, command_id, &v);
    if (rc) {
        if (w) {
            pthread_mutex_lock(&b->mu);
            ks_map_del(&b->waiters, command_id);
            pthread_mutex_unlock(&b->mu);
            free(w->reply_subject);
            free(w);
        }
        return rc;
    }
    if (w)
        snprintf(w->agent_id, sizeof(w->agent_id), "%s", v->agent_id);
    if (argv && (!same_argv(v, argv) ||
                 !same_spec_beyond_argv(st, command_id, argv))) {
        /* The key names another command: say so, run nothing. */
        if (w) {
            pthread_mutex_lock(&b->mu);
            ks_map_del(&b->waiters, command_id);
            pthread_mutex_unlock(&b->mu);
            free(w->reply_subject);
            free(w);
        }
        r.error_code = KS_ECONFLICT;
        r.error = "idempotency key already used for a different command";
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
        ks__command_view__free_unpacked(v, NULL);
        return 0;
    }
    if (kproto_status_terminal(v->status)) {
        Ks__CommandResult *res = v->result ? v->result : &empty;
        res->status = v->status;
        if (w)
            broker__reply_waiter(b, command_id, res, 0, NULL);
        else {
            r.command_id = (char *)command_id;
            r.agent_id = v->agent_id;
            r.result = res;
            broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
        }
    } else {
        /* Still running: its id, at once, whether this broker waits for
         * it now or another does. A client that asked again because its
         * broker went silent learns that someone waits again. */
        r.command_id = (char *)command_id;
        r.agent_id = v->agent_id;
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    }
    ks__command_view__free_unpacked(v, NULL);
    return 0;
}

/* A refused request whose idempotency key names a command of its
 * operator's joins that command (attach_existing). 0 when it did (the
 * request is answered), else non-zero. */
static int
join_by_key(struct broker *b, struct store *st, natsMsg *msg,
            const Ks__ExecuteRequest *req)
{
    char winner[37];
    if (store_command_by_key(st, broker__operator_of(msg),
                             req->idempotency_key, winner) != 0)
        return -1;
    return attach_existing(b, st, msg, winner, req->detach, req->spec);
}

static void
on_execute(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker__worker *wk = ud;
    struct broker *b = wk->b;
    struct store *st = wk->st;
    Ks__ExecuteRequest *req = NULL;
    char why[512], command_id[37], stream[64], ev_ids[2][37];
    struct broker__waiter *w = NULL;
    struct broker__labels labels = {0};
    int64_t t_in = ks_mono_us();
    int rc;

    (void)nc;
    (void)sub;
    rc = broker__unpack_request(msg, &ks__execute_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        reply_execute_error(b, msg, rc, "%s", why);
        goto out;
    }
    if ((rc = broker__validate_spec(req->spec, why, sizeof(why)))) {
        reply_execute_error(b, msg, rc, "%s", why);
        goto out;
    }
    if (!evt_agent_id_valid(req->agent_id)) {
        reply_execute_error(b, msg, KS_EINVAL,
                            "bad agent id '%s' (letters, digits, _ and -)",
                            req->agent_id);
        goto out;
    }
    int known = broker__agent_lookup(b, req->agent_id);
    if (known < 0) {
        reply_execute_error(b, msg, KS_EUNAVAIL,
                            "cannot tell whether agent '%s' has registered: "
                            "the agent registry did not answer (%s); nothing "
                            "was recorded, try again",
                            req->agent_id, ks_strerror(known));
        goto out;
    }
    if (!known) {
        reply_execute_error(b, msg, KS_ENOAGENT,
                            "unknown agent '%s': no agent with this id has "
                            "registered (see kscore agents)",
                            req->agent_id);
        goto out;
    }
    if (req->spec->copy) {
        reply_execute_error(b, msg, KS_EINVAL,
                            "ExecuteRequest.spec.copy: not allowed: a copy "
                            "is a batch (kscore copy, kscore.api.v1.batch)");
        goto out;
    }
    if (broker__spec_special(req->spec)) {
        /* Never to an agent that would ignore --run-as or --script. */
        Ks__AgentInfo *info = broker__agent_info(b, req->agent_id);
        rc = broker__check_features(req->spec, info, req->agent_id, why,
                                    sizeof(why));
        if (info)
            ks__agent_info__free_unpacked(info, NULL);
        if (rc) {
            reply_execute_error(b, msg, rc, "%s", why);
            goto out;
        }
    }
    /* Secret variables: sealed to this agent, and to it only. */
    if ((rc = broker__check_sealed_targets(req->spec, &req->agent_id, 1,
                                           true, why, sizeof(why)))) {
        reply_execute_error(b, msg, rc, "%s", why);
        goto out;
    }

    /* An idempotency key already used is found by the append below: the
     * unique index on commands (operator, idempotency_key) refuses the
     * second CommandRequested of the same operator (KS_ECONFLICT) and the
     * request joins that operator's command that has it; another
     * operator's same key is a command of its own (issue 21: keys were
     * global, so one operator could squat another's). Looking the key up first cost every execute one more
     * PostgreSQL round trip (every `kscore exec` sends a key). */

    if (b->policy) {
        Ks__AgentInfo *info = broker__agent_info(b, req->agent_id);
        const char *op = broker__operator_of(msg);
        rc = broker__policy_check(b->policy, op, info, req->spec,
                                  why, sizeof(why));
        if (info)
            ks__agent_info__free_unpacked(info, NULL);
        if (rc) {
            broker__record_denied(b, st, op, req->agent_id,
                                  req->spec, why);
            reply_execute_error(b, msg, rc, "%s", why);
            goto out;
        }
    }

    /* Admission (admit.c): the intake refused at once what could not
     * start in time, except a request whose key may name a command
     * already: that key is looked up first (its command is joined), and
     * only a key that names nothing is refused. */
    if (req->key_may_exist && req->idempotency_key[0] &&
        broker__admit_check(b, broker__operator_of(msg), req->agent_id,
                            req->deliver_within_ms, why,
                            sizeof(why)) == KS_EBUSY) {
        if (join_by_key(b, st, msg, req) != 0)
            reply_execute_error(b, msg, KS_EBUSY, "%s", why);
        goto out;
    }

    ks_uuid(command_id);
    ks_trace_at("broker.execute_in", command_id, t_in);
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    uint64_t deliver_ms = req->deliver_within_ms
                              ? req->deliver_within_ms
                              : BROKER_DELIVER_WITHIN_DEFAULT_MS;

    Ks__Command cmd = KS__COMMAND__INIT;
    cmd.command_id = command_id;
    cmd.attempt = 1;
    cmd.agent_id = req->agent_id;
    cmd.spec = req->spec;
    cmd.issued_at_us = ks_now_us();
    cmd.not_after_us = cmd.issued_at_us + (int64_t)deliver_ms * 1000;
    cmd.dispatch_version = 2;
    cmd.operator_ = (char *)broker__operator_of(msg);
    cmd.batch_id = "";
    /* Its labels, for the child (KSCORE_LABEL_*). */
    broker__command_labels(b, req->agent_id, &labels);
    cmd.labels = labels.v;
    cmd.n_labels = labels.n;

    /* Refuse what cannot be published before recording anything (K21). */
    if (protobuf_c_message_get_packed_size(&cmd.base) > KS_MAX_MESSAGE_BYTES) {
        reply_execute_error(b, msg, KS_ETOOBIG,
                            "command too large: %zu bytes packed, the NATS "
                            "max payload is %d",
                            protobuf_c_message_get_packed_size(&cmd.base),
                            KS_MAX_MESSAGE_BYTES);
        goto out;
    }

    /* Its operator's share of the commands stream (admit.c): counted
     * from here until its end, or refused before anything is recorded. */
    uint64_t cmd_bytes = broker__cmd_bytes(&cmd);
    if ((rc = broker__admit_take(b, command_id, cmd.operator_, cmd_bytes,
                                 cmd.not_after_us, why, sizeof(why)))) {
        /* An ask again of a command accepted before joins it. */
        if (!req->idempotency_key[0] || join_by_key(b, st, msg, req) != 0)
            reply_execute_error(b, msg, rc, "%s", why);
        goto out;
    }

    broker__output_caps_note(b, command_id, req->spec);

    Ks__Event req_ev, disp_ev;
    broker__start_events(&req_ev, &disp_ev, ev_ids, stream, &cmd,
                         req->idempotency_key);
    struct store_event evs[2] = {{&req_ev}, {&disp_ev}};

    /* Register before publishing: the result can arrive at once. */
    if (!req->detach) {
        w = calloc(1, sizeof(*w));
        if (!w || !(w->reply_subject = strdup(natsMsg_GetReply(msg)))) {
            free(w);
            w = NULL;
            broker__admit_ended(b, command_id);
            reply_execute_error(b, msg, -ENOMEM, "out of memory");
            goto out;
        }
        snprintf(w->agent_id, sizeof(w->agent_id), "%s", req->agent_id);
        w->live = req->live_output;
        pthread_mutex_lock(&b->mu);
        ks_map_put(&b->waiters, command_id, w);
        pthread_mutex_unlock(&b->mu);
        /* Pieces recorded by another broker come to this client too;
         * told before the command goes out, so before its first piece. */
        if (w->live)
            broker__notice_follow(b, command_id, true, w->reply_subject,
                                  req->agent_id);
    }

    /*
     * The command goes out while its record commits: publish_between runs
     * once the append is sent. Safe because only a recorded command can be
     * claimed (kscore_claim waits for a record being committed, and finds
     * none if it failed), and an agent runs only what it claimed. A key
     * that may name a command already (the caller's own, or a request
     * asked again: ExecuteRequest.key_may_exist; or one this broker has
     * seen) records first and publishes only a new command, so a used key
     * never sends a message that can never be claimed.
     */
    struct dispatch_pub dp = {.b = b, .wk = wk, .cmd = &cmd, .rc = 1};
    broker__agent_pool(b, cmd.agent_id, dp.pool, sizeof(dp.pool));
    bool overlap = !req->idempotency_key[0] ||
                   (!req->key_may_exist &&
                    !broker__key_seen(b, cmd.operator_,
                                      req->idempotency_key));
    /* In flight from before its publish: its claim, even its end, may
     * come before the append returns. */
    broker__admit_dispatched(b, command_id, cmd.operator_, cmd.agent_id,
                             cmd.not_after_us, req->spec->timeout_ms,
                             cmd_bytes);
    struct store_write wr = {.stream_id = stream,
                             .expected_version = STORE_NO_STREAM,
                             .events = evs,
                             .n = 2,
                             .between = overlap ? publish_between : NULL,
                             .ud = &dp};
    struct store_write_result wres;
    rc = store_writer_append(b->writer, &wr, &wres);
    /* A new stream's append waits for a lock only while a transaction
     * holds the whole events table (a LOCK, a migration): the database
     * stalls for every writer, and the request waits for it as for a slow
     * commit (up to BROKER_LOCKED_WAIT_MS) instead of failing after the
     * writer's lock_timeout (store.c WRITER_SESSION), which is there so
     * that one stream's row held elsewhere holds up no other append. */
    for (int64_t t0 = ks_mono_us();
         rc == KS_EPGREFUSED && strcmp(wres.sqlstate, "55P03") == 0 &&
         ks_mono_us() - t0 < (int64_t)BROKER_LOCKED_WAIT_MS * 1000 &&
         !b->stopping;) {
        if (dp.rc != 1)
            wr.between = NULL; /* published already */
        /* (the writer fails a stream found locked at once for a while) */
        nanosleep(&(struct timespec){0, 250 * 1000000L}, NULL);
        rc = store_writer_append(b->writer, &wr, &wres);
    }
    ks_trace("broker.dispatch_recorded", command_id);
    if (rc) {
        broker__admit_ended(b, command_id);
        broker__output_caps_forget(b, command_id);
    }
    if (rc == KS_ECONFLICT && req->idempotency_key[0]) {
        /* Lost a race on the same idempotency key: join the winner. */
        char winner[37];
        if (w) {
            pthread_mutex_lock(&b->mu);
            ks_map_del(&b->waiters, command_id);
            pthread_mutex_unlock(&b->mu);
            free(w->reply_subject);
            free(w);
            w = NULL;
        }
        if (store_command_by_key(st, cmd.operator_, req->idempotency_key,
                                 winner) == 0 &&
            attach_existing(b, st, msg, winner, req->detach, req->spec) == 0)
            goto out;
    }
    if (rc) {
        bool doubt = wres.in_doubt;
        bool sick = store_db_sick(rc) || rc == KS_EPG;
        broker__write_error(&wres, rc, why, sizeof(why));
        if (w) {
            pthread_mutex_lock(&b->mu);
            ks_map_del(&b->waiters, command_id);
            pthread_mutex_unlock(&b->mu);
            free(w->reply_subject);
            free(w);
            w = NULL;
        }
        /*
         * A client is told "recorded" or "not recorded" truthfully (issue
         * 25). This append failed, but the key may name a command all the
         * same: this very append, if its commit's answer was lost, or an
         * earlier ask of the same request (a client asks again after 5 s
         * of silence, which a recorder stalled by the database causes).
         * Reads still work while PostgreSQL refuses writes: join it.
         */
        int krc = KS_ENOTFOUND;
        if ((doubt || sick) && req->idempotency_key[0]) {
            char winner[37];
            krc = store_command_by_key(st, cmd.operator_,
                                       req->idempotency_key, winner);
            if (krc == 0 &&
                attach_existing(b, st, msg, winner, req->detach, req->spec) ==
                    0)
                goto out;
        }
        if (doubt) {
            /* Sent whole, its answer lost: it may have committed (and
             * run: the command went out while its record committed). */
            reply_execute_error(
                b, msg, KS_EINDOUBT,
                "the outcome is unknown: %s, after the command %s was sent "
                "to be recorded; it may be recorded and run: look it up "
                "with `kscore get %s`",
                why, command_id, command_id);
        } else if (sick && req->key_may_exist && krc != KS_ENOTFOUND) {
            /* Not this ask, but an earlier one with the key may have
             * recorded it, and the key could not be looked up. */
            reply_execute_error(
                b, msg, KS_EINDOUBT,
                "the outcome is unknown: %s; an earlier request with the "
                "idempotency key %s may have recorded the command (asking "
                "again with the same key is safe)",
                why, req->idempotency_key);
        } else if (store_db_sick(rc)) {
            /* The server answered the error: rolled back, nothing ran. */
            reply_execute_error(b, msg, rc,
                                "%s; the command was not recorded", why);
        } else {
            reply_execute_error(b, msg, rc, "cannot record the command: %s",
                                why);
        }
        goto out;
    }
    if (dp.rc == 1)
        publish_now(&dp);
    rc = dp.rc;
    if (rc == 0) {
        broker__admit_stored(b, command_id, dp.seq);
        ks_log(KS_LOG_DEBUG, "command dispatched",
               KS_S("command_id", command_id), KS_S("agent", cmd.agent_id),
               KS_I("attempt", cmd.attempt),
               KS_S("operator", cmd.operator_));
    } else if (dp.later && broker__publish_later(b, &cmd, dp.pool,
                                                 disp_ev.deliver_by_us) ==
                               0) {
        broker__admit_held(b, command_id);
        ks_log(KS_LOG_DEBUG, "publish handed to the publisher",
               KS_S("command_id", command_id), KS_S("agent", cmd.agent_id),
               KS_ERR(rc));
    } else {
        /* Recorded as Dispatched: the deadline scanner re-publishes it or
         * ends it Undeliverable, so the client still gets a terminal
         * state. */
        ks_log(KS_LOG_WARN, "publish failed; the scanner retries",
               KS_S("command_id", command_id), KS_S("agent", cmd.agent_id),
               KS_I("attempt", cmd.attempt), KS_ERR(rc));
    }
    if (req->detach || req->live_output) {
        /* Detached: the answer. Live: the command's id, first (the
         * client can cancel it or follow it should it stop waiting). */
        Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
        int64_t seen_us = 0;
        r.command_id = command_id;
        r.agent_id = req->agent_id;
        /* What the client waits for: an offline agent is waited for up
         * to the delivery deadline, and the client says so at once. */
        if (broker__agent_presence(b, req->agent_id, &seen_us) == 0) {
            r.agent_offline = true;
            r.agent_last_seen_us = seen_us;
        }
        r.deliver_within_ms = deliver_ms;
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    }
out:
    broker__labels_release(&labels);
    if (req)
        ks__execute_request__free_unpacked(req, NULL);
    natsMsg_Destroy(msg);
}

/* ---- claim -------------------------------------------------------------- */

/*
 * A claim whose event is recorded already (KS_EDUPLICATE) is granted
 * again only while its command is still in the state that claim put it
 * in: Running for CommandStarted (StartFailed for a start failure, which
 * changes nothing). 1 when it is, 0 with why (the status it ended in)
 * when not, or the store's error.
 */
static int
claim_repeat_open(struct store *st, const Ks__ClaimRequest *req, char *why,
                  size_t len)
{
    Ks__CommandView *v = NULL;
    Ks__CommandStatus want = req->start_failure
                                 ? KS__COMMAND_STATUS__START_FAILED
                                 : KS__COMMAND_STATUS__RUNNING;
    int open, rc;

    /* Cannot tell: the agent is answered with the store's error and
     * claims again. */
    if ((rc = store_get_command(st, req->command_id, &v)) != 0)
        return rc == KS_ENOTFOUND ? KS_EINTERNAL : rc;
    open = v->status == want;
    if (!open)
        snprintf(why, len,
                 "already claimed: this claim won, but the command has "
                 "ended since (%s)",
                 kproto_status_name(v->status));
    ks__command_view__free_unpacked(v, NULL);
    return open;
}

static void
on_claim(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker__worker *cl = ud;
    struct broker *b = cl->b;
    Ks__ClaimRequest *req = NULL;
    Ks__ClaimReply r = KS__CLAIM_REPLY__INIT;
    char stream[64], dup_id[37], why[600];
    int64_t t_in = ks_mono_us();
    int rc;

    (void)nc;
    (void)sub;
    /* An agent's share of claims that do not win (budget.c): past it,
     * answered busy before anything else is done (the agent asks again
     * later). The broker's own in-process agents have none. */
    char ident[16 + EVT_AGENT_ID_MAX] = "";
    {
        /* The claimer NATS vouches for, agent-<id> (each id of a pool
         * its own: as its share of the events stream), without the
         * registry's lock: this runs for every message of a flood. */
        const char *who = broker__operator_of(msg);
        if (strncmp(who, "agent-", 6) == 0)
            snprintf(ident, sizeof(ident), "%s", who);
    }
    bool answer = true;
    if (ident[0] && !broker__budget_ask_ok(b, ident, &answer)) {
        if (!answer) {
            natsMsg_Destroy(msg);
            return;
        }
        r.error_code = KS_EBUSY;
        r.error = "busy: this agent's claims that did not win are past its "
                  "share (1000, then 100 a second): try again later";
        goto reply;
    }
    rc = broker__unpack_request(msg, &ks__claim_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        r.error_code = rc;
        r.error = why;
        goto reply;
    }
    /* Who claims is what NATS vouches for: the API subject's last token,
     * which the permissions let only agent-<id> use (or the broker, for
     * its in-process agents). A field of the message proves nothing. */
    {
        const char *who = broker__operator_of(msg);
        char want[EVT_AGENT_ID_MAX + 8];
        snprintf(want, sizeof(want), "agent-%s", req->agent_id);
        if (strcmp(who, want) != 0 && strcmp(who, "broker") != 0) {
            snprintf(why, sizeof(why),
                     "denied: '%s' may not claim for agent '%s' (only "
                     "agent-%s may)",
                     who, req->agent_id, req->agent_id);
            r.error_code = KS_EDENIED;
            r.error = why;
            goto reply;
        }
    }
    /* The newer of two processes serving one id claims nothing: the
     * older one takes the message (registry.c instance_note). */
    if ((rc = broker__claim_instance_ok(b, req->agent_id, req->instance_id,
                                        why, sizeof(why)))) {
        r.error_code = rc;
        r.error = why;
        goto reply;
    }
    snprintf(stream, sizeof(stream), "command-%s", req->command_id);
    ks_trace("broker.claim_in", req->command_id);

    Ks__Event ev;
    ks__event__init(&ev);
    ev.event_id = req->event_id;
    ev.stream_id = stream;
    ev.command_id = req->command_id;
    ev.agent_id = req->agent_id;
    ev.attempt = req->attempt;
    ev.occurred_at_us = ks_now_us();
    /* Not req->operator: an agent's word; the record names the operator
     * on CommandRequested (and the projection keeps it). */
    ev.operator_ = "";
    if (req->start_failure) {
        ev.type = "CommandStartFailed";
        ev.result = req->start_failure;
        /* A claim may only end a Dispatched command as StartFailed (the
         * state machine's rule): never with another status or output. */
        struct store_command_state dispatched = {
            .exists = true, .status = KS__COMMAND_STATUS__DISPATCHED};
        Ks__CommandStatus next;
        const char *why;
        if (store_command_step(&dispatched, &ev, &next, &why) !=
            STORE_STEP_APPLY) {
            r.error_code = KS_EINVAL;
            r.error = "bad ClaimRequest: start_failure must have status "
                      "StartFailed";
            goto reply;
        }
        /* Nothing ran, so nothing was written: an agent's claim may not
         * put output (or an exit status) in the record under the name of
         * a command that never started (issue 21: a claim's StartFailed
         * carried forged stdout). */
        const Ks__CommandResult *sf = req->start_failure;
        if ((sf->stdout && (sf->stdout->data.len || sf->stdout->total_bytes ||
                            sf->stdout->chunked_bytes)) ||
            (sf->stderr && (sf->stderr->data.len || sf->stderr->total_bytes ||
                            sf->stderr->chunked_bytes)) ||
            sf->has_exit_code || sf->signal) {
            r.error_code = KS_EINVAL;
            r.error = "bad ClaimRequest: a start failure carries no output, "
                      "exit code or signal (nothing ran)";
            goto reply;
        }
    } else {
        ev.type = "CommandStarted";
        /* Which process claims, and from which of its heartbeats on it
         * lists the command: what the scanner ends a Running command by
         * once that process's heartbeats no longer list it. */
        ev.instance_id = req->instance_id;
        ev.listed_from_seq = req->listed_from_seq;
    }
    struct store_event se = {&ev};
    /* Fast path: nothing happened since this attempt was dispatched. The
     * claim's reply goes out only after the commit that holds it (the
     * writer returns once its transaction's end is known). */
    struct store_write wr = {.stream_id = stream,
                             .expected_version =
                                 (int64_t)req->expected_version,
                             .events = &se,
                             .n = 1,
                             .claim_agent = req->agent_id};
    struct store_write_result wres;
    int64_t claimed_at = 0;
    rc = store_writer_append(b->writer, &wr, &wres);
    claimed_at = wres.version;
    ks_trace("broker.claim_recorded", req->command_id);
    /* Slow path: a newer attempt was dispatched (the agent had a backlog,
     * or a broker restarted), or other events landed. Any attempt's message
     * may still claim while the command is Dispatched: the fence is the
     * version read here, so still only one claim can ever win. */
    for (int tries = 0; rc == KS_ECONFLICT && tries < 3; tries++) {
        Ks__CommandView *v = NULL;
        if (store_get_command(cl->st, req->command_id, &v) != 0)
            break;
        bool mine = strcmp(v->agent_id, req->agent_id) == 0;
        bool open = v->status == KS__COMMAND_STATUS__DISPATCHED;
        int64_t at = v->version;
        ks__command_view__free_unpacked(v, NULL);
        if (!mine)
            rc = KS_EDENIED; /* not this agent's: no trace on its stream */
        if (!mine || !open)
            break;
        wr.expected_version = at;
        rc = store_writer_append(b->writer, &wr, &wres);
        claimed_at = wres.version;
    }
    int open = rc == KS_EDUPLICATE
                   ? claim_repeat_open(cl->st, req, why, sizeof(why))
                   : 1;
    if (open < 0) {
        r.error_code = open;
        r.error = (char *)broker__store_error(cl->st, open, why, sizeof(why));
    } else if (!open) {
        /* The claim that won, asked again after the command ended (the
         * broker ended it: its claimer's heartbeats stopped listing it):
         * too late to run it. */
        r.error_code = KS_ECLAIMED;
        r.error = why;
    } else if (rc == 0 || rc == KS_EDUPLICATE) {
        /* A duplicate is this same claim retried (its reply was lost, or
         * its claimer restarted and claims again with the journalled
         * claim id): still ours while the command runs. */
        r.granted = 1;
        if (req->start_failure && rc == 0)
            broker__command_ended(b, req->command_id, req->start_failure);
        else if (rc == 0 && claimed_at > 0)
            broker__claimed_put(b, req->command_id, req->agent_id,
                                req->attempt, claimed_at);
    } else if (rc == KS_ECONFLICT) {
        Ks__Event d;
        char identity[16 + EVT_AGENT_ID_MAX];
        ks_metric_inc(KS_C_CLAIM_CONFLICTS);
        broker__event_init(&d, dup_id, stream, "DuplicateSuppressed",
                           req->command_id);
        d.agent_id = req->agent_id;
        d.attempt = req->attempt;
        d.reason = "claim lost: the command was already claimed, "
                   "re-dispatched or ended";
        struct store_event de = {&d};
        /* An annotation the agent causes at will (a claim of its own
         * ended command, again and again): within its share only
         * (budget.c). */
        broker__report_identity(b, req->agent_id, identity,
                                sizeof(identity));
        if (broker__budget_take(b, identity, ks__event__get_packed_size(&d),
                                BROKER_ANNOTATION_REPORT)) {
            struct store_write dw = {.stream_id = stream,
                                     .expected_version = STORE_ANY,
                                     .events = &de,
                                     .n = 1};
            store_writer_append(b->writer, &dw, NULL);
        }
        r.error_code = KS_ECLAIMED;
        r.error = "already claimed";
    } else if (rc == KS_EDENIED) {
        r.error_code = rc;
        r.error = "denied: the command is not addressed to this agent";
    } else {
        /* The agent hands the message back and claims again later. */
        r.error_code = rc;
        r.error = (char *)broker__write_error(&wres, rc, why, sizeof(why));
    }
reply:
    /* What the agent made up or lost (not a store that failed, nor a
     * refusal of the share itself) takes from its share. */
    if (ident[0] && !r.granted && r.error_code != KS_EBUSY &&
        (r.error_code == KS_ECLAIMED || r.error_code == KS_ENOTFOUND ||
         r.error_code == KS_EDENIED || r.error_code == KS_EDUPINSTANCE ||
         r.error_code == KS_EINVAL || r.error_code == KS_EDECODE ||
         r.error_code == KS_ETOOBIG))
        broker__budget_ask_failed(b, ident);
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    /* The claim stage's pace, and the start of the slot's hold. */
    broker__admit_claim_done(b, req ? req->command_id : NULL,
                             req ? req->agent_id : NULL,
                             req ? req->listed_from_seq : 0,
                             r.granted && !(req && req->start_failure),
                             ks_mono_us() - t_in);
    if (req)
        ks__claim_request__free_unpacked(req, NULL);
    natsMsg_Destroy(msg);
}

/* ---- get / events / cancel ---------------------------------------------- */

/* Appends each LateResult's result of a command's stream to the view
 * (store_read_stream's callback; ud: the view). */
static int
collect_late(const Ks__RecordedEvent *rev, void *ud)
{
    Ks__CommandView *v = ud;
    const Ks__Event *ev = rev->event;
    uint8_t *buf;
    size_t len;
    if (!ev || !ev->result || strcmp(ev->type, "LateResult") != 0)
        return 0;
    if (kproto_pack(&ev->result->base, &buf, &len))
        return -ENOMEM;
    Ks__CommandResult *copy = ks__command_result__unpack(NULL, len, buf);
    free(buf);
    Ks__CommandResult **p =
        copy ? realloc(v->late_results,
                       (v->n_late_results + 1) * sizeof(*p))
             : NULL;
    if (!p) {
        if (copy)
            ks__command_result__free_unpacked(copy, NULL);
        return -ENOMEM;
    }
    v->late_results = p;
    v->late_results[v->n_late_results++] = copy;
    return 0;
}

static void
handle_get(struct broker *b, natsMsg *msg)
{
    Ks__GetRequest *req = NULL;
    Ks__GetReply r = KS__GET_REPLY__INIT;
    Ks__CommandView *view = NULL;
    char why[600];
    int rc;

    Ks__BatchReply *batch = NULL;
    rc = broker__unpack_request(msg, &ks__get_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        broker__reply_error(b, msg, r.base.descriptor, rc, why);
        return;
    }
    {
        char sid[64];
        snprintf(sid, sizeof(sid), "%s%s",
                 broker__is_batch_id(req->id) ? "" : "command-", req->id);
        if (broker__may_read(b, b->st_misc, msg, sid, why, sizeof(why)) !=
            0) {
            r.error_code = KS_EDENIED;
            r.error = why;
            broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
            ks__get_request__free_unpacked(req, NULL);
            return;
        }
    }
    if (broker__is_batch_id(req->id))
        rc = broker__batch_view(b, b->st_misc, req->id, &batch);
    else if (rc == 0 && !ks_is_uuid(req->id))
        rc = KS_EINVAL;
    else if (rc == 0)
        rc = store_get_command(b->st_misc, req->id, &view);
    /* The whole output, also what travelled in pieces; a reply larger
     * than one NATS message goes in parts (evt_publish_reply). */
    if (rc == 0 && view)
        rc = broker__fill_output(b->st_misc, req->id, view->result);
    /* What an agent reported after the end: `get` of a Lost command shows
     * that it did in fact succeed (issue 25). */
    if (rc == 0 && view && kproto_status_terminal(view->status)) {
        char sid[64];
        snprintf(sid, sizeof(sid), "command-%s", req->id);
        rc = store_read_stream(b->st_misc, sid, 0, 1000, collect_late, view);
    }
    if (rc) {
        r.error_code = rc;
        r.error = rc == KS_ENOTFOUND ? "no command or batch with this id"
                  : rc == KS_EINVAL
                      ? "not a command id (a UUID) nor a batch id "
                        "(batch-<uuid>)"
                      : (char *)broker__store_error(b->st_misc, rc, why,
                                                    sizeof(why));
    }
    r.command = view;
    r.batch = batch;
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    if (batch)
        ks__batch_reply__free_unpacked(batch, NULL);
    if (view)
        ks__command_view__free_unpacked(view, NULL);
    if (req)
        ks__get_request__free_unpacked(req, NULL);
}

struct events_acc {
    Ks__RecordedEvent **evs;
    uint64_t *tx_ids;
    size_t n, cap;
};

static int
collect_event(const Ks__RecordedEvent *ev, void *ud)
{
    struct events_acc *a = ud;
    uint8_t *buf;
    size_t len;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        void *p = realloc(a->evs, nc * sizeof(*a->evs));
        if (!p)
            return -ENOMEM;
        a->evs = p;
        p = realloc(a->tx_ids, nc * sizeof(*a->tx_ids));
        if (!p)
            return -ENOMEM;
        a->tx_ids = p;
        a->cap = nc;
    }
    /* The store lends the event; keep a copy for the reply. */
    if (kproto_pack(&ev->base, &buf, &len))
        return -ENOMEM;
    a->evs[a->n] = ks__recorded_event__unpack(NULL, len, buf);
    free(buf);
    if (!a->evs[a->n])
        return -ENOMEM;
    a->tx_ids[a->n] = ev->tx_id;
    a->n++;
    return 0;
}

/*
 * One read of what req asks (one stream after a version, or all streams
 * after a cursor, or from its start: then req's cursor is set to where it
 * starts, the first time that can be found) with st. Replies to msg and
 * returns true when there is something to say: events, an error, or
 * (final) nothing; returns false, replying nothing, when nothing is new
 * or PostgreSQL is down and the caller may wait (a follower).
 */
static bool
events_try(struct broker *b, struct store *st, natsMsg *msg,
           Ks__EventsRequest *req, bool final)
{
    Ks__EventsReply r = KS__EVENTS_REPLY__INIT;
    struct events_acc acc = {0};
    struct store_cursor cur = {0};
    char why[600];
    int rc = 0;

    uint32_t limit = req->limit && req->limit < 1000 ? req->limit : 1000;
    if (!req->stream_id[0] && !req->cursor_tx_id && !req->cursor_pos &&
        (req->start_now || req->start_at_us)) {
        /* Where to start, once per request (a parked follower keeps it):
         * never from the first event, which a start asks not to read. */
        rc = store_cursor_at(st, req->start_now ? 0 : req->start_at_us, &cur);
        if (rc == 0) {
            req->cursor_tx_id = cur.tx_id;
            req->cursor_pos = cur.global_pos;
            req->start_now = false;
            req->start_at_us = 0;
        }
    }
    cur.tx_id = req->cursor_tx_id;
    cur.global_pos = req->cursor_pos;
    /* Without its start, nothing is read: a follower waits, as below. */
    if (rc == 0 && req->stream_id[0])
        rc = store_read_stream(st, req->stream_id, req->after_version, limit,
                               collect_event, &acc);
    else if (rc == 0)
        rc = store_read_all(st, &cur, limit, collect_event, &acc);
    /* A follower outlives a PostgreSQL restart: it waits (the store backs
     * off its reconnects) and at its deadline gets an empty reply that
     * keeps the cursor where it was. */
    if (rc == KS_EPGDOWN && req->wait_ms)
        rc = 0;
    if (rc == 0 && acc.n == 0 && !final) {
        free(acc.evs);
        free(acc.tx_ids);
        return false;
    }
    if (rc) {
        r.error_code = rc;
        r.error = (char *)broker__store_error(st, rc, why, sizeof(why));
    }
    /* One command's events: with the whole output of its end, also what
     * travelled in pieces (the reply may go in parts). */
    bool whole = false;
    if (rc == 0 && req->stream_id[0])
        for (size_t i = 0; i < acc.n && rc == 0; i++) {
            Ks__Event *e = acc.evs[i]->event;
            if (e && e->result &&
                ((e->result->stdout && e->result->stdout->chunked_bytes) ||
                 (e->result->stderr && e->result->stderr->chunked_bytes))) {
                rc = broker__fill_output(st, e->command_id, e->result);
                whole = true;
            }
        }
    if (rc) {
        r.error_code = rc;
        r.error = (char *)broker__store_error(st, rc, why, sizeof(why));
    }
    r.events = acc.evs;
    r.n_events = acc.n;
    r.cursor_tx_id = cur.tx_id;
    r.cursor_pos = cur.global_pos;
    /* Keep the reply under the max payload: drop the tail (the cursor then
     * points at the last event kept), the client pages on. */
    while (!whole && r.n_events > 1 &&
           protobuf_c_message_get_packed_size(&r.base) > KS_MAX_MESSAGE_BYTES)
        r.n_events /= 2;
    if (r.n_events < acc.n && !req->stream_id[0]) {
        /* The cursor must not skip what was dropped: resume just after the
         * last event kept. */
        r.cursor_pos = acc.evs[r.n_events - 1]->global_pos;
        r.cursor_tx_id = acc.tx_ids[r.n_events - 1];
    }
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    for (size_t i = 0; i < acc.n; i++)
        ks__recorded_event__free_unpacked(acc.evs[i], NULL);
    free(acc.evs);
    free(acc.tx_ids);
    return true;
}

/* Unpacks an EventsRequest and checks that its caller may read it; replies
 * the refusal itself and returns NULL when not. */
static Ks__EventsRequest *
events_request(struct broker *b, struct store *st, natsMsg *msg)
{
    Ks__EventsRequest *req = NULL;
    Ks__EventsReply r = KS__EVENTS_REPLY__INIT;
    char why[600];
    int rc = broker__unpack_request(msg, &ks__events_request__descriptor,
                                    (ProtobufCMessage **)&req, why,
                                    sizeof(why));
    if (rc) {
        broker__reply_error(b, msg, r.base.descriptor, rc, why);
        return NULL;
    }
    if (broker__may_read(b, st, msg, req->stream_id, why, sizeof(why)) !=
        0) {
        r.error_code = KS_EDENIED;
        r.error = why;
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
        ks__events_request__free_unpacked(req, NULL);
        return NULL;
    }
    return req;
}

static void
handle_events(struct broker *b, natsMsg *msg)
{
    Ks__EventsRequest *req = events_request(b, b->st_misc, msg);
    if (req) {
        req->wait_ms = 0;
        events_try(b, b->st_misc, msg, req, true);
        ks__events_request__free_unpacked(req, NULL);
    }
}

/*
 * Followers (kscore.api.v1.follow: a long poll of up to FOLLOW_MAX_WAIT_MS)
 * are parked, not served on the delivery thread: on cf06db5 each one held
 * the follow subscription's only thread for up to 5 s, so 20 requests of
 * one operator stopped every follower for ~100 s (issue 21). The
 * subscription's thread only queues a request; the follow thread reads
 * for each parked one when this broker appended (a NOTIFY), every
 * FOLLOW_REREAD_US for other brokers' appends, and answers it at its
 * deadline. One identity may have at most FOLLOW_PER_IDENTITY parked;
 * beyond that its requests are answered at once (nothing new), so it
 * spends its own time, not others'.
 */
#define FOLLOW_MAX_WAIT_MS 5000
#define FOLLOW_REREAD_US INT64_C(250000)
#define FOLLOW_PER_IDENTITY 8

struct broker__long_poll {
    natsMsg *msg;
    Ks__EventsRequest *req; /* NULL until the follow thread checked it */
    int64_t deadline_mono_us, read_mono_us;
    char identity[EVT_IDENTITY_MAX + 1];
    struct broker__long_poll *next;
};

static void
long_poll_free(struct broker__long_poll *f)
{
    if (f->req)
        ks__events_request__free_unpacked(f->req, NULL);
    natsMsg_Destroy(f->msg);
    free(f);
}

static void
on_follow(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker *b = ud;
    struct broker__long_poll *f;
    const char *id = broker__operator_of(msg);
    unsigned mine = 0;
    (void)nc;
    (void)sub;

    pthread_mutex_lock(&b->follow_mu);
    for (f = b->followers; f; f = f->next)
        mine += strcmp(f->identity, id) == 0;
    pthread_mutex_unlock(&b->follow_mu);
    f = calloc(1, sizeof(*f));
    if (!f || mine >= FOLLOW_PER_IDENTITY || b->stopping) {
        /* Answered now, with nothing new and the cursor it sent (no
         * query: an over-limit caller costs nobody else anything); the
         * client asks again. */
        Ks__EventsRequest *req = NULL;
        Ks__EventsReply r = KS__EVENTS_REPLY__INIT;
        char why[200];
        if (broker__unpack_request(msg, &ks__events_request__descriptor,
                                   (ProtobufCMessage **)&req, why,
                                   sizeof(why)) == 0) {
            r.cursor_tx_id = req->cursor_tx_id;
            r.cursor_pos = req->cursor_pos;
            broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
            ks__events_request__free_unpacked(req, NULL);
        } else {
            broker__reply_error(b, msg, r.base.descriptor, KS_EINVAL, why);
        }
        free(f);
        natsMsg_Destroy(msg);
        return;
    }
    f->msg = msg;
    snprintf(f->identity, sizeof(f->identity), "%s", id);
    f->deadline_mono_us = ks_mono_us() + (int64_t)FOLLOW_MAX_WAIT_MS * 1000;
    pthread_mutex_lock(&b->follow_mu);
    f->next = b->followers;
    b->followers = f;
    pthread_cond_signal(&b->follow_cond);
    pthread_mutex_unlock(&b->follow_mu);
}

/* One pass over the parked followers: reads for the new ones, for all
 * after a NOTIFY (notified), for the rest every FOLLOW_REREAD_US; answers
 * and drops those with something to say or past their deadline. */
static void
follow_pass(struct broker *b, bool notified)
{
    struct broker__long_poll *list, *keep = NULL, *f, *next;

    pthread_mutex_lock(&b->follow_mu);
    list = b->followers;
    b->followers = NULL;
    pthread_mutex_unlock(&b->follow_mu);
    for (f = list; f; f = next) {
        int64_t now = ks_mono_us();
        bool done = false;
        next = f->next;
        if (!f->req) {
            f->req = events_request(b, b->st_follow, f->msg);
            if (!f->req) {
                long_poll_free(f);
                continue;
            }
            uint32_t w = f->req->wait_ms < FOLLOW_MAX_WAIT_MS
                             ? f->req->wait_ms
                             : FOLLOW_MAX_WAIT_MS;
            f->deadline_mono_us = now + (int64_t)w * 1000;
            f->read_mono_us = 0;
        }
        bool last = now >= f->deadline_mono_us || b->stopping;
        if (last || notified || f->read_mono_us == 0 ||
            now - f->read_mono_us >= FOLLOW_REREAD_US) {
            f->read_mono_us = now;
            done = events_try(b, b->st_follow, f->msg, f->req, last);
        }
        if (done) {
            long_poll_free(f);
        } else {
            f->next = keep;
            keep = f;
        }
    }
    if (keep) {
        pthread_mutex_lock(&b->follow_mu);
        for (f = keep; f; f = next) {
            next = f->next;
            f->next = b->followers;
            b->followers = f;
        }
        pthread_mutex_unlock(&b->follow_mu);
    }
}

static void *
follow_main(void *arg)
{
    struct broker *b = arg;

    while (!b->stopping) {
        pthread_mutex_lock(&b->follow_mu);
        while (!b->followers && !b->stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&b->follow_cond, &b->follow_mu, &ts);
        }
        bool fresh = false;
        for (struct broker__long_poll *f = b->followers; f; f = f->next)
            fresh = fresh || !f->req;
        pthread_mutex_unlock(&b->follow_mu);
        if (b->stopping)
            break;
        follow_pass(b, false);
        /* Woken by this broker's appends (a NOTIFY), or after a short
         * while to take new followers and read for other brokers'. */
        if (!fresh) {
            int rc = store_wait_notify(b->st_follow, 50);
            if (rc == 0)
                follow_pass(b, true);
        }
    }
    /* Stopping: everyone parked gets its answer now. */
    follow_pass(b, true);
    return NULL;
}

int
broker__follow_start(struct broker *b)
{
    if (pthread_create(&b->follow_thread, NULL, follow_main, b) != 0)
        return KS_EINTERNAL;
    b->follow_started = true;
    return 0;
}

void
broker__follow_stop(struct broker *b)
{
    if (!b->follow_started)
        return;
    pthread_mutex_lock(&b->follow_mu);
    b->stopping = 1;
    pthread_cond_broadcast(&b->follow_cond);
    pthread_mutex_unlock(&b->follow_mu);
    pthread_join(b->follow_thread, NULL);
    b->follow_started = false;
    for (struct broker__long_poll *f = b->followers, *n; f; f = n) {
        n = f->next;
        long_poll_free(f);
    }
    b->followers = NULL;
}

static void
handle_cancel(struct broker *b, natsMsg *msg)
{
    Ks__CancelRequest *req = NULL;
    Ks__CancelReply r = KS__CANCEL_REPLY__INIT;
    char store_why[600];
    int rc;

    char bad[512];
    rc = broker__unpack_request(msg, &ks__cancel_request__descriptor,
                                (ProtobufCMessage **)&req, bad, sizeof(bad));
    if (rc) {
        broker__reply_error(b, msg, r.base.descriptor, rc, bad);
        return;
    }
    if (broker__is_batch_id(req->id) && b->policy) {
        char owner[128] = "", why[256];
        const char *op = broker__operator_of(msg);
        store_batch_operator(b->st_misc, req->id, owner, sizeof(owner));
        if (broker__policy_check_batch(b->policy, op,
                                       owner[0] ? owner : NULL, why,
                                       sizeof(why)) != 0) {
            broker__record_denied(b, b->st_misc, op, NULL, NULL, why);
            broker__reply_error(b, msg, r.base.descriptor, KS_EDENIED, why);
            ks__cancel_request__free_unpacked(req, NULL);
            return;
        }
    }
    if (broker__is_batch_id(req->id)) {
        rc = broker__batch_cancel(b, req->id, broker__operator_of(msg));
        if (rc == 0)
            r.outcome = "requested";
        if (rc == KS_ENOTFOUND) {
            /* Not open: ended (say how, as for a command: docs/operating.md
             * "Exit codes", exit 1), or never was. */
            Ks__BatchReply *bv = NULL;
            if (broker__batch_view(b, b->st_misc, req->id, &bv) == 0 && bv &&
                bv->status != KS__BATCH_STATUS__BATCH_RUNNING &&
                bv->status != KS__BATCH_STATUS__BATCH_STATUS_UNSPECIFIED) {
                r.outcome = "ended";
                r.batch_status = bv->status;
            } else {
                r.error_code = rc;
                r.error = "no batch with this id";
            }
            if (bv)
                ks__batch_reply__free_unpacked(bv, NULL);
            rc = 0;
        }
    } else if (rc == 0 && !ks_is_uuid(req->id)) {
        rc = KS_EINVAL;
    } else if (rc == 0) {
        Ks__CommandView *v = NULL;
        char why[256];
        const char *op = broker__operator_of(msg);
        if (b->policy && store_get_command(b->st_misc, req->id, &v) == 0) {
            Ks__AgentInfo *info = broker__agent_info(b, v->agent_id);
            /* Whoever may act on the agent may cancel on it. */
            int prc = broker__policy_check(b->policy, op,
                                           info ? info
                                                : &(Ks__AgentInfo)
                                                      KS__AGENT_INFO__INIT,
                                           NULL, why, sizeof(why));
            if (info)
                ks__agent_info__free_unpacked(info, NULL);
            ks__command_view__free_unpacked(v, NULL);
            if (prc) {
                broker__record_denied(b, b->st_misc, op, NULL, NULL, why);
                r.error_code = prc;
                r.error = why;
                broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
                ks__cancel_request__free_unpacked(req, NULL);
                return;
            }
        }
        struct broker__cancel_outcome co;
        rc = broker__cancel_command(b, b->st_misc, req->id, op, &co);
        if (rc == 0) {
            r.outcome = (char *)co.outcome;
            r.status = co.status;
        }
    }
    if (rc) {
        r.error_code = rc;
        r.error = rc == KS_ENOTFOUND ? "no command with this id"
                  : rc == KS_EINVAL
                      ? "not a command or batch id"
                      : (char *)broker__store_error(b->st_misc, rc, store_why,
                                                    sizeof(store_why));
    }
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    if (req)
        ks__cancel_request__free_unpacked(req, NULL);
}

static void
handle_agents(struct broker *b, natsMsg *msg)
{
    Ks__AgentsReply r = KS__AGENTS_REPLY__INIT;
    int rc = broker__agents_list(b, &r);
    if (rc) {
        r.error_code = rc;
        r.error = (char *)ks_strerror(rc);
    }
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    broker__agents_reply_free(&r);
}

/* get, events and cancel: three subscriptions, one shared store connection,
 * so they are serialised by a lock. */
static void
on_misc(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    const char *subj = natsMsg_GetSubject(msg);
    (void)nc;
    (void)sub;
    struct broker *b = ud;
    char why[256];
    pthread_mutex_lock(&b->misc_mu);
    if (broker__policy_check(b->policy, broker__operator_of(msg), NULL, NULL,
                             why, sizeof(why)) != 0) {
        /* Not in the policy: every reply type has error_code/error as
         * fields 1 and 2, so one GetReply serves them all. */
        Ks__GetReply r = KS__GET_REPLY__INIT;
        r.error_code = KS_EDENIED;
        r.error = why;
        broker__record_denied(b, b->st_misc, broker__operator_of(msg), NULL,
                              NULL, why);
        broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    } else if (broker__is_method(subj, EVT_API_GET))
        handle_get(ud, msg);
    else if (broker__is_method(subj, EVT_API_EVENTS))
        handle_events(ud, msg);
    else if (broker__is_method(subj, EVT_API_CANCEL))
        handle_cancel(ud, msg);
    else if (broker__is_method(subj, EVT_API_AGENTS))
        handle_agents(ud, msg);
    else if (broker__is_method(subj, EVT_API_LIST))
        broker__handle_list(ud, msg);
    else if (broker__is_method(subj, EVT_API_LOGS))
        broker__handle_logs(ud, msg);
    else if (broker__is_method(subj, EVT_API_LABEL))
        broker__handle_label(ud, b->st_misc, msg);
    pthread_mutex_unlock(&b->misc_mu);
    natsMsg_Destroy(msg);
}

/* ---- start / stop ------------------------------------------------------- */

/*
 * The NATS link answered nothing for BROKER_LINK_TIMEOUT_MS while nats.c
 * said CONNECTED (evt_link_watch, its thread): a broker that can neither
 * hear requests and events nor publish must not keep holding work (the
 * batches it drives, the waiters of its clients). It stops, as on
 * SIGTERM, and broker_run returns KS_EUNAVAIL: `kscore broker` exits
 * non-zero and its supervisor starts it again (systemd: Restart=
 * on-failure); meanwhile another broker adopts its batches and clients
 * ask again (docs/guarantees.md "When an agent fails").
 */
static void
link_dead(void *ud, int64_t silent_us)
{
    struct broker *b = ud;

    ks_log(KS_LOG_ERROR,
           "the NATS link answers nothing though nats.c says it is "
           "connected: the broker stops, to be started again",
           KS_D("silent_s", (double)silent_us / 1e6),
           KS_I("link_timeout_ms", BROKER_LINK_TIMEOUT_MS));
    atomic_store(&b->link_dead, true);
    kill(getpid(), SIGTERM); /* to broker_run's sigwait */
}

static int
open_store(struct broker *b, struct store **out, char **errmsg)
{
    char *why = NULL;
    int rc = store_open(b->opts->db_conninfo, out, &why);
    if (rc && errmsg &&
        asprintf(errmsg, "cannot connect to PostgreSQL (%s): %s",
                 b->opts->db_conninfo, why ? why : ks_strerror(rc)) < 0)
        *errmsg = NULL;
    free(why);
    return rc;
}

/* The group writer (store.h): the appends of every handler and of the
 * recorder, in shared transactions. */
static int
open_writer(struct broker *b, char **errmsg)
{
    char *why = NULL;
    int rc = store_writer_open(b->opts->db_conninfo, BROKER_WRITER_CONNS,
                               &b->writer, &why);
    if (rc && errmsg &&
        asprintf(errmsg, "cannot connect to PostgreSQL (%s): %s",
                 b->opts->db_conninfo, why ? why : ks_strerror(rc)) < 0)
        *errmsg = NULL;
    free(why);
    return rc;
}

/* Serves "<subject>.<operator>" (see events.h "API subjects"). */
/*
 * The boundary of every API request: the reply address must be under the
 * caller's own inbox (_INBOX.<identity>.), the only replies the server
 * lets that identity read. Anything else is dropped unanswered: the broker
 * may publish anywhere, so a reply address of the caller's choosing would
 * let any operator make the broker publish to another user's inbox, to
 * kscore.cmd.>, or to the JetStream API ($JS.API.STREAM.DELETE...).
 * A request from the AGENTS account (deploy/nats-auth.conf.in: an agent's
 * claim, through its service import) arrives with a reply the server made,
 * "_R_.<...>", which leads back into AGENTS only; clients cannot name such
 * a reply themselves (nats-server client.go isReservedReply refuses it).
 */
static void
api_guard(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker__route *r = ud;
    const char *reply = natsMsg_GetReply(msg);
    const char *id = broker__operator_of(msg);
    bool ok = broker__inbox_of(reply, id) || broker__service_reply(reply);

    /* An id of an agent pool is answered on its pool's inbox
     * (_INBOX.pool-<pool>.), the one its process reads: the pool as the
     * registry knows it for that id, so no other pool's inbox. */
    if (!ok && strncmp(id, "agent-", 6) == 0) {
        char pool[EVT_AGENT_ID_MAX + 1], pid[EVT_AGENT_ID_MAX + 8];
        broker__agent_pool(r->b, id + 6, pool, sizeof(pool));
        if (pool[0]) {
            snprintf(pid, sizeof(pid), "pool-%s", pool);
            ok = broker__inbox_of(reply, pid);
        }
    }
    if (!ok) {
        int64_t now = ks_mono_us();
        if (now - r->b->bad_reply_logged_us > 10000000) {
            r->b->bad_reply_logged_us = now;
            char shown[81];
            snprintf(shown, sizeof(shown), "%s", reply ? reply : "");
            ks_log(KS_LOG_WARN,
                   "dropped a request: its reply address is not under the "
                   "caller's inbox (logged once per 10 s)",
                   KS_S("subject", natsMsg_GetSubject(msg)),
                   KS_S("operator", id), KS_S("reply", shown));
        }
        natsMsg_Destroy(msg);
        return;
    }
    (void)nc;
    (void)sub;
    /* Served in its sender's turn (fairq.c): one identity's flood waits
     * in its own queue, and past its bound is dropped here. */
    broker__fairq_push(r->fq, id, r, msg,
                       (size_t)natsMsg_GetDataLength(msg));
}

/* A fair queue's worker serves a request of route ctx. */
static void
route_serve(void *worker_ud, void *ctx, void *item)
{
    struct broker__route *r = ctx;
    r->cb(r->b->nc->nc, NULL, item, worker_ud ? worker_ud : r->ud);
}

/*
 * A request its sender's queue has no room for: dropped unanswered (its
 * sender asks again after its timeout). Not answered busy: a reply to
 * each message of a flood doubled what nats-server and this connection
 * carry for it, and other agents' claims then waited behind the replies
 * (test_security an_agents_claim_flood_waits_its_turn timed out that
 * way on 2 cores; dropped, its execs ran).
 */
static void
route_refuse(void *ctx, void *item)
{
    (void)ctx;
    natsMsg_Destroy(item);
}

/* Starts fair queue which with n workers (uds: theirs, or NULL). */
static int
fq_start(struct broker *b, enum broker__fq which, const char *name,
         unsigned n, struct broker__worker *uds, char **errmsg)
{
    void *ud[BROKER_CLAIM_WORKERS];
    BUG_ON(n > BROKER_CLAIM_WORKERS);
    for (unsigned i = 0; uds && i < n; i++)
        ud[i] = &uds[i];
    struct broker__fairq_opts o = {.name = name,
                                   .workers = n,
                                   .worker_ud = uds ? ud : NULL,
                                   .per_identity = BROKER_FAIRQ_PER_IDENTITY,
                                   .per_identity_bytes =
                                       BROKER_FAIRQ_PER_IDENTITY_BYTES,
                                   .serve = route_serve,
                                   .refuse = route_refuse};
    int rc = broker__fairq_start(&o, &b->fq[which]);
    if (rc && errmsg &&
        asprintf(errmsg, "%s workers: %s", name, ks_strerror(rc)) < 0)
        *errmsg = NULL;
    return rc;
}

/* The fair queues every API subscription feeds: claims and the asks
 * again with a worker (and store connection) each as before, every other
 * kind with one worker (they were one thread each, and the misc kinds
 * share st_misc under misc_mu). */
static int
fq_start_all(struct broker *b, char **errmsg)
{
    int rc;
    if ((rc = fq_start(b, BROKER_FQ_EXECUTE, "execute", 1, NULL, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_EXEC_AGAIN, "execute-again",
                       BROKER_AGAIN_WORKERS, b->exec_again, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_CLAIM, "claim", BROKER_CLAIM_WORKERS,
                       b->claimers, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_CLAIM_AGAIN, "claim-again",
                       BROKER_AGAIN_WORKERS, b->claim_again, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_MISC, "api", 1, NULL, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_BLOB, "upload-fetch", 1, NULL,
                       errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_FOLLOW, "follow", 1, NULL, errmsg)) ||
        (rc = fq_start(b, BROKER_FQ_BATCH, "batch", 1, NULL, errmsg)))
        return rc;
    return 0;
}

/* Subscribes cb (behind api_guard, served by fair queue which) to
 * "<subject>.*", in the brokers' queue group, or in this broker's own
 * (again: every broker gets each ask again). ud: cb's when the queue's
 * workers have none. */
static int
subscribe_fq(struct broker *b, const char *subject, enum broker__fq which,
             bool again, natsMsgHandler cb, void *ud, char **errmsg)
{
    char full[128];
    BUG_ON(b->n_routes >= BROKER_MAX_ROUTES);
    natsSubscription **sub = &b->route_subs[b->n_routes];
    struct broker__route *route = &b->routes[b->n_routes++];
    route->b = b;
    route->cb = cb;
    route->ud = ud;
    route->fq = b->fq[which];
    if (again && !b->again_queue[0])
        snprintf(b->again_queue, sizeof(b->again_queue), "kscore-again-%s",
                 b->instance_id);
    snprintf(full, sizeof(full), "%s.*", subject);
    natsStatus s = natsConnection_QueueSubscribe(
        sub, b->nc->nc, full, again ? b->again_queue : EVT_BROKER_QUEUE,
        api_guard, route);
    /* Unbounded here: its thread only sorts each request into its
     * sender's bounded queue. */
    if (s == NATS_OK)
        s = natsSubscription_SetPendingLimits(*sub, -1, -1);
    if (s != NATS_OK) {
        if (errmsg && asprintf(errmsg, "subscribe %s: %s", full,
                               natsStatus_GetText(s)) < 0)
            *errmsg = NULL;
        return KS_ENATS;
    }
    return 0;
}

static int
subscribe(struct broker *b, const char *subject, enum broker__fq which,
          natsMsgHandler cb, char **errmsg)
{
    return subscribe_fq(b, subject, which, false, cb, b, errmsg);
}

static void
free_live(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

static void
broker_teardown(struct broker *b)
{
    natsSubscription **subs[BROKER_MAX_ROUTES + 2];
    size_t nsubs = 0;

    /* Every API subscription: each feeds a fair queue whose handlers use
     * the writer and the store connections closed below. */
    for (int i = 0; i < b->n_routes; i++)
        subs[nsubs++] = &b->route_subs[i];
    subs[nsubs++] = &b->sub_advisory;
    subs[nsubs++] = &b->sub_notice;

    b->stopping = 1;
    agent_stop(b->local);
    b->local = NULL;
    /* Drain: stop taking requests, let the handlers in progress finish
     * (they use the store connections closed below). */
    for (size_t i = 0; i < nsubs; i++)
        if (*subs[i])
            natsSubscription_Drain(*subs[i]);
    for (size_t i = 0; i < nsubs; i++)
        if (*subs[i]) {
            natsSubscription_WaitForDrainCompletion(*subs[i], 10000);
            natsSubscription_Destroy(*subs[i]);
            *subs[i] = NULL;
        }
    /* What the subscriptions queued is served, then the queues end. */
    for (int i = 0; i < BROKER_FQ__N; i++) {
        broker__fairq_stop(b->fq[i]);
        b->fq[i] = NULL;
    }
    /* What the intake took in is served before anything below stops. */
    broker__admit_stop(b);
    /* What the workers handed over is tried once more. */
    broker__publisher_stop(b);
    broker__follow_stop(b);
    broker__scanner_stop(b);
    broker__guard_stop(b);
    broker__batch_stop(b);
    broker__registry_stop(b);
    broker__recorder_stop(b);
    /* Its last users (the handlers, the recorder) are gone: what it holds
     * is written, and each caller had its answer. */
    store_writer_close(b->writer);
    b->writer = NULL;
    kvStore_Destroy(b->kv);
    evt_close(b->nc);
    store_close(b->st_setup);
    for (int i = 0; i < BROKER_EXEC_WORKERS; i++)
        store_close(b->executors[i].st);
    for (int i = 0; i < BROKER_AGAIN_WORKERS; i++) {
        store_close(b->exec_again[i].st);
        store_close(b->claim_again[i].st);
    }
    store_close(b->st_misc);
    for (int i = 0; i < BROKER_CLAIM_WORKERS; i++)
        store_close(b->claimers[i].st);
    store_close(b->st_rec);
    store_close(b->st_reg);
    store_close(b->st_scan);
    store_close(b->st_follow);
    store_close(b->st_batch);
    store_close(b->st_notice);
    store_close(b->st_blob);
    broker__admit_free(b);
    broker__publisher_free(b);
    evt_signer_free(b->signer);
    broker__policy_free(b->policy);
    evt_verifier_free(b->local_trust);
    broker__waiters_release(b);
    ks_map_each(&b->live, free_live, NULL);
    ks_map_clear(&b->live);
    broker__output_caps_free(b);
    broker__remote_live_free(b);
    broker__budget_free(b);
    pthread_mutex_destroy(&b->mu);
    pthread_mutex_destroy(&b->misc_mu);
    free(b->blob_fetched);
    pthread_mutex_destroy(&b->blob_mu);
    pthread_mutex_destroy(&b->follow_mu);
    pthread_cond_destroy(&b->follow_cond);
}

/* At each metrics scrape: what the broker sees now (proto/metrics.c). */
static void
broker_collect(void *ctx)
{
    struct broker *b = ctx;
    ks_metric_gauge_add(KS_G_AGENTS_ONLINE, broker__agents_online(b));
    evt_metrics_nats_state(b->nc, KS_G_NATS_BROKER);
    evt_metrics_queue_depths(b->nc, 1000);
}

int
broker_run(const struct broker_opts *opts, char **errmsg)
{
    struct broker b = {.opts = opts,
                       .started_mono_us = ks_mono_us(),
                       .waiters = KS_MAP_INIT,
                       .agents = KS_MAP_INIT,
                       .relabels = KS_MAP_INIT,
                       .up = {command_ended, remote_ended,
                              broker__batch_remote_cancel}};
    struct evt_connect_opts co = opts->nats;
    char policy_hex[BROKER_POLICY_DIGEST_HEX] = "";
    sigset_t set;
    int rc, sig = 0;

    /* Every thread started from here on inherits this mask, so SIGINT and
     * SIGTERM reach only sigwait() below. */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    pthread_mutex_init(&b.mu, NULL);
    pthread_mutex_init(&b.misc_mu, NULL);
    pthread_mutex_init(&b.blob_mu, NULL);
    pthread_mutex_init(&b.follow_mu, NULL);
    pthread_cond_init(&b.follow_cond, NULL);
    if ((rc = broker__budget_init(&b)))
        goto out;

    if (!opts->signing_key || !opts->signing_key[0]) {
        rc = KS_EINVAL;
        if (errmsg && asprintf(errmsg, "no signing key: give --signing-key "
                                       "FILE (make one with kscore keygen)") <
                          0)
            *errmsg = NULL;
        goto out;
    }
    /* Fails closed: a policy asked for and not loaded is no start. */
    if (opts->policy_file &&
        (rc = broker__policy_load(opts->policy_file, &b.policy, policy_hex,
                                  errmsg)))
        goto out;
    broker__policy_note(opts->state_dir, opts->policy_file, policy_hex);
    if ((rc = evt_signer_load(opts->signing_key, &b.signer)) ||
        (rc = evt_verifier_new(&b.local_trust)) ||
        (rc = evt_verifier_add_signer(b.local_trust, b.signer))) {
        if (errmsg && asprintf(errmsg, "signing key %s: %s",
                               opts->signing_key, ks_strerror(rc)) < 0)
            *errmsg = NULL;
        goto out;
    }
    co.name = "kscore-broker";
    co.send_asap = true;
    co.retry_forever = true;
    rc = evt_connect(opts->nats_url, &co, &b.nc, errmsg);
    if (rc)
        goto out;
    if ((rc = open_store(&b, &b.st_setup, errmsg)))
        goto out;
    if ((rc = store_migrate(b.st_setup, errmsg)))
        goto out;
    if ((rc = open_writer(&b, errmsg)))
        goto out;
    for (int i = 0; i < BROKER_EXEC_WORKERS; i++) {
        b.executors[i].b = &b;
        if ((rc = open_store(&b, &b.executors[i].st, errmsg)))
            goto out;
    }
    for (int i = 0; i < BROKER_AGAIN_WORKERS; i++) {
        b.exec_again[i].b = &b;
        b.claim_again[i].b = &b;
        if ((rc = open_store(&b, &b.exec_again[i].st, errmsg)) ||
            (rc = open_store(&b, &b.claim_again[i].st, errmsg)))
            goto out;
    }
    for (int i = 0; i < BROKER_CLAIM_WORKERS; i++) {
        b.claimers[i].b = &b;
        if ((rc = open_store(&b, &b.claimers[i].st, errmsg)))
            goto out;
    }
    if ((rc = open_store(&b, &b.st_misc, errmsg)) ||
        (rc = open_store(&b, &b.st_rec, errmsg)) ||
        (rc = open_store(&b, &b.st_reg, errmsg)) ||
        (rc = open_store(&b, &b.st_scan, errmsg)) ||
        (rc = open_store(&b, &b.st_follow, errmsg)) ||
        (rc = open_store(&b, &b.st_batch, errmsg)) ||
        (rc = store_set_lock_timeout(b.st_scan, BROKER_BG_LOCK_TIMEOUT_MS)) ||
        (rc = store_set_lock_timeout(b.st_reg, BROKER_BG_LOCK_TIMEOUT_MS)))
        goto out;
    if ((rc = broker__jetstream_ready(&b, errmsg)))
        goto out;
    /* Before admission and the batches, which ask whether it is busy. */
    if ((rc = broker__publisher_start(&b)))
        goto out;
    /* Before the batches: they pace their targets by its figures. */
    if ((rc = broker__admit_start(&b, on_execute))) {
        if (errmsg && asprintf(errmsg, "exec workers: %s",
                               ks_strerror(rc)) < 0)
            *errmsg = NULL;
        goto out;
    }
    /* The commands the record has open count in their operators' shares
     * of the commands stream (a restart forgets nothing of them). */
    if ((rc = broker__admit_load(&b, b.st_misc))) {
        if (errmsg && asprintf(errmsg, "open commands: %s",
                               ks_strerror(rc)) < 0)
            *errmsg = NULL;
        goto out;
    }
    if ((rc = broker__registry_start(&b, errmsg)) ||
        (rc = broker__batch_start(&b, errmsg)) ||
        (rc = broker__notice_start(&b, errmsg)) ||
        (rc = broker__js_wait(&b, "the recorder's subscription",
                              broker__recorder_start, errmsg)))
        goto out;
    /* In-process agents first: once the API answers, they are there. */
    if (opts->local_agents > 0) {
        char host[64], **ids;
        /* static: the agent borrows its labels for its whole life */
        static const struct agent_label lab = {"local", "true"};
        struct agent_opts ao = {0};
        struct agent_attestation *att;
        uint8_t(*sigs)[EVT_SIGNATURE_BYTES];
        gethostname(host, sizeof(host));
        host[sizeof(host) - 1] = '\0';
        for (char *p = host; *p; p++)
            if (*p == '.') {
                *p = '\0';
                break;
            }
        ids = calloc(opts->local_agents, sizeof(*ids));
        for (unsigned i = 0; ids && i < opts->local_agents; i++)
            if (asprintf(&ids[i], "%s-%u", host, i) < 0)
                ids[i] = NULL;
        ao.nats_url = opts->nats_url;
        ao.nats = opts->nats;
        ao.ids = (const char *const *)ids;
        ao.n_ids = opts->local_agents;
        /* Several local ids are one pool, "<host>": one consumer and one
         * registry entry for all of them (agent_opts.pool). */
        if (opts->local_agents > 1)
            ao.pool = host;
        ao.labels = &lab;
        ao.n_labels = 1;
        ao.state_dir = opts->state_dir;
        ao.trust = b.local_trust;
        /* Their label is ours to give: attested like an enrolled agent's,
         * so they keep it under --require-signed-labels. */
        att = calloc(opts->local_agents, sizeof(*att));
        sigs = calloc(opts->local_agents, sizeof(*sigs));
        if (att && sigs && ids) {
            Ks__EnvVar lv = KS__ENV_VAR__INIT, *lp = &lv;
            /* Signed as of the epoch, not of this start: any relabel of
             * them (kscore agent label, labels.c) is newer and so
             * outlives this broker's restarts. */
            int64_t now = BROKER_LOCAL_ATTEST_AT_US;
            lv.name = (char *)lab.key;
            lv.value = (char *)lab.value;
            if (ao.pool) {
                /* The pool's entry carries one attestation, over its
                 * name and size ("pool.<host>/<N>"). */
                char key[sizeof(EVT_POOL_KEY_PREFIX) + sizeof(host) + 12];
                evt_pool_attest_id(key, sizeof(key), host,
                                   opts->local_agents);
                ao.pool_size = opts->local_agents;
                if (evt_labels_sign(b.signer, key, now, &lp, 1, sigs[0]) == 0) {
                    att[0] = (struct agent_attestation){
                        &lab, 1, now, sigs[0], evt_signer_key_id(b.signer)};
                    ao.pool_attestation = &att[0];
                }
            } else {
                for (unsigned i = 0; i < opts->local_agents; i++)
                    if (ids[i] && evt_labels_sign(b.signer, ids[i], now, &lp,
                                                  1, sigs[i]) == 0)
                        att[i] = (struct agent_attestation){
                            &lab, 1, now, sigs[i],
                            evt_signer_key_id(b.signer)};
                ao.attestations = att;
            }
        }
        rc = agent_start(&ao, &b.local, errmsg);
        free(att);
        free(sigs);
        for (unsigned i = 0; ids && i < opts->local_agents; i++)
            free(ids[i]);
        free(ids);
        if (rc)
            goto out;
    }
    if ((rc = broker__follow_start(&b)))
        goto out;
    if ((rc = fq_start_all(&b, errmsg)) ||
        (rc = subscribe(&b, EVT_API_EXECUTE, BROKER_FQ_EXECUTE,
                        broker__intake_push, errmsg)) ||
        (rc = subscribe_fq(&b, EVT_API_EXECUTE_AGAIN, BROKER_FQ_EXEC_AGAIN,
                           true, on_execute, NULL, errmsg)) ||
        (rc = subscribe_fq(&b, EVT_API_CLAIM, BROKER_FQ_CLAIM, false,
                           on_claim, NULL, errmsg)) ||
        (rc = subscribe_fq(&b, EVT_API_CLAIM_AGAIN, BROKER_FQ_CLAIM_AGAIN,
                           true, on_claim, NULL, errmsg)) ||
        (rc = subscribe(&b, EVT_API_GET, BROKER_FQ_MISC, on_misc, errmsg)) ||
        (rc = subscribe(&b, EVT_API_EVENTS, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_CANCEL, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_AGENTS, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_LIST, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_LABEL, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_LOGS, BROKER_FQ_MISC, on_misc,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_UPLOAD, BROKER_FQ_BLOB, broker__on_blob,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_FETCH, BROKER_FQ_BLOB, broker__on_blob,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_FOLLOW, BROKER_FQ_FOLLOW, on_follow,
                        errmsg)) ||
        (rc = subscribe(&b, EVT_API_BATCH, BROKER_FQ_BATCH, broker__on_batch,
                        errmsg)) ||
        (rc = broker__advisory_start(&b, errmsg)))
        goto out;
    natsConnection_Flush(b.nc->nc);
    if ((rc = broker__scanner_start(&b)) ||
        (rc = broker__guard_start(&b, errmsg)))
        goto out;

    if ((rc = evt_link_watch_start(b.nc, BROKER_LINK_TIMEOUT_MS, link_dead,
                                   &b, &b.link_watch)))
        goto out;
    ks_metrics_collector_add(broker_collect, &b);
    ks_log(KS_LOG_INFO, "serving", KS_S("nats", opts->nats_url),
           KS_I("local_agents", opts->local_agents));
    /* A signal; or the in-process agents' own connection answers nothing
     * (agent_fatal: they stay fenced), which a broker process restarted
     * by its supervisor cures as it does for its own link. */
    for (;;) {
        struct timespec tick = {0, 250 * 1000000L};
        sig = sigtimedwait(&set, NULL, &tick);
        if (sig > 0)
            break;
        if (b.local && agent_fatal(b.local) == AGENT_FATAL_LINK) {
            atomic_store(&b.link_dead, true);
            break;
        }
    }
    if (atomic_load(&b.link_dead)) {
        rc = KS_EUNAVAIL;
        if (errmsg && asprintf(errmsg,
                               "the NATS link (the broker's, or its "
                               "in-process agents') answered nothing for "
                               "%d s though nats.c said it was connected: "
                               "stopped, to be started again",
                               BROKER_LINK_TIMEOUT_MS / 1000) < 0)
            *errmsg = NULL;
    } else {
        ks_log(KS_LOG_INFO, "stopping", KS_S("signal", strsignal(sig)));
        /* The in-process agents drain while everything else serves on
         * (their results are recorded, their claims answered); a second
         * signal cuts the drain short. */
        if (b.local) {
            agent_stop_graceful(b.local, opts->drain_timeout_ms, &set);
            b.local = NULL;
        }
    }
out:
    evt_link_watch_stop(b.link_watch);
    ks_metrics_collector_remove(broker_collect, &b);
    broker_teardown(&b);
    return rc;
}
