/*
 * command.c: what the API handlers and the batch driver share about one
 * command: its spec checked, the two events that start it, a cancel, and
 * whether a caller may read its record. Calls only down (reply.c,
 * policy.c, the registry, the scanner's deadline rule); a command's end
 * goes up through b->up (broker_int.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

int
broker__validate_spec(const Ks__CommandSpec *spec, char *why, size_t len)
{
    if (!spec || spec->n_argv == 0 || !spec->argv[0][0]) {
        snprintf(why, len, "empty argv: give the command after --");
        return KS_EINVAL;
    }
    for (size_t i = 0; i < spec->n_env; i++) {
        const char *n = spec->env[i]->name;
        if (broker_env_name_ok(n))
            continue;
        if (strncmp(n, "KSCORE_", 7) == 0)
            snprintf(why, len,
                     "environment variable '%.64s': the KSCORE_ prefix is "
                     "kscore's own",
                     n);
        else
            snprintf(why, len,
                     "bad environment variable name '%.64s' (letters, digits "
                     "and _, not starting with a digit)",
                     n);
        return KS_EINVAL;
    }
    if (spec->stdout_cap_bytes > EXEC_OUTPUT_CAP_MAX ||
        spec->stderr_cap_bytes > EXEC_OUTPUT_CAP_MAX) {
        snprintf(why, len, "output cap above the maximum of %d bytes",
                 EXEC_OUTPUT_CAP_MAX);
        return KS_EINVAL;
    }
    return 0;
}

void
broker__start_events(Ks__Event *req_ev, Ks__Event *disp_ev, char ids[2][37],
                     char *stream, Ks__Command *cmd,
                     const char *idempotency_key)
{
    broker__event_init(req_ev, ids[0], stream, "CommandRequested",
                       cmd->command_id);
    req_ev->agent_id = cmd->agent_id;
    req_ev->batch_id = cmd->batch_id;
    req_ev->command = cmd;
    req_ev->reason = (char *)(idempotency_key ? idempotency_key : "");
    req_ev->operator_ = cmd->operator_;
    broker__event_init(disp_ev, ids[1], stream, "CommandDispatched",
                       cmd->command_id);
    disp_ev->agent_id = cmd->agent_id;
    disp_ev->batch_id = cmd->batch_id;
    disp_ev->attempt = 1;
    disp_ev->occurred_at_us = req_ev->occurred_at_us;
    disp_ev->operator_ = cmd->operator_;
    disp_ev->deliver_by_us =
        cmd->issued_at_us + broker__attempt_window_us(cmd);
}

/*
 * Whether the caller of msg may read the records of stream_id (a command,
 * a batch, an operator's or an agent's stream; "" for every stream). Only
 * with a policy loaded (none: everyone reads everything). 0, or
 * KS_EDENIED with why; the denial is recorded on the operator's stream.
 * Uses st (the caller's thread's connection).
 */
int
broker__may_read(struct broker *b, struct store *st, natsMsg *msg,
                 const char *stream_id, char *why, size_t len)
{
    const char *op = broker__operator_of(msg);
    char owner[128] = "";
    Ks__AgentInfo *info = NULL;
    bool every = false;
    int rc;

    if (!b->policy)
        return 0;
    if (!stream_id[0]) {
        every = true;
    } else if (strncmp(stream_id, "command-", 8) == 0 &&
               ks_is_uuid(stream_id + 8)) {
        Ks__CommandView *v = NULL;
        int grc = store_get_command(st, stream_id + 8, &v);
        if (grc == KS_ENOTFOUND)
            return 0; /* nothing to read, nothing to hide */
        if (grc == 0) {
            snprintf(owner, sizeof(owner), "%s", v->operator_);
            info = broker__agent_info(b, v->agent_id);
            if (!info) {
                /* An agent gone from the registry: its id still names it
                 * for the message; only rules on "*" can match. */
                info = calloc(1, sizeof(*info));
                if (info) {
                    ks__agent_info__init(info);
                    info->agent_id = strdup(v->agent_id);
                }
            }
            ks__command_view__free_unpacked(v, NULL);
        }
    } else if (broker__is_batch_id(stream_id)) {
        store_batch_operator(st, stream_id, owner, sizeof(owner));
    } else if (strncmp(stream_id, "operator-", 9) == 0) {
        snprintf(owner, sizeof(owner), "%s", stream_id + 9);
    } else if (strncmp(stream_id, "agent-", 6) == 0) {
        info = broker__agent_info(b, stream_id + 6);
    }
    rc = broker__policy_check_read(b->policy, op, owner[0] ? owner : NULL,
                                   info, every, why, len);
    if (info)
        ks__agent_info__free_unpacked(info, NULL);
    if (rc)
        broker__record_denied(b, st, op, NULL, NULL, why);
    return rc;
}

int
broker__cancel_command(struct broker *b, struct store *st,
                       const char *command_id, const char *operator_name,
                       struct broker__cancel_outcome *out)
{
    Ks__CommandView *view = NULL;
    char stream[64], evid[37], subject[32 + EVT_AGENT_ID_MAX];
    struct broker__cancel_outcome res_out = {"ended", 0};
    int rc = 0;

    snprintf(stream, sizeof(stream), "command-%s", command_id);
    /* Each try reads the state and acts at that version; a conflict means
     * the command moved (claimed, ended): read again. */
    for (int tries = 0;; tries++) {
        if (view)
            ks__command_view__free_unpacked(view, NULL);
        view = NULL;
        rc = store_get_command(st, command_id, &view);
        if (rc)
            break;
        res_out.status = view->status;
        if (kproto_status_terminal(view->status)) {
            res_out.outcome = "ended"; /* nothing to cancel; not an error */
            break;
        }
        if (tries == 8) {
            rc = KS_ECONFLICT;
            break;
        }
        if (view->status == KS__COMMAND_STATUS__RUNNING) {
            Ks__CancelCommand cc = KS__CANCEL_COMMAND__INIT;
            Ks__Event ev;
            broker__event_init(&ev, evid, stream, "CommandCancelRequested",
                               command_id);
            ev.agent_id = view->agent_id;
            ev.reason = "cancel requested";
            ev.operator_ = (char *)operator_name;
            struct store_event se = {&ev};
            rc = store_append(st, stream, STORE_ANY, &se, 1, NULL);
            if (rc)
                break;
            cc.command_id = (char *)command_id;
            snprintf(subject, sizeof(subject), "kscore.cancel.%s",
                     view->agent_id);
            rc = evt_publish_msg(b->nc, subject, &cc.base);
            res_out.outcome = "requested";
            break;
        }
        /* Not claimed yet: end it here, at the version we read, so a claim
         * arriving later loses. */
        Ks__Event ev;
        Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
        res.status = KS__COMMAND_STATUS__CANCELLED;
        res.cancelled = 1;
        res.term_sent_us = res.kill_sent_us = -1;
        res.reason = "cancelled before an agent claimed it";
        broker__event_init(&ev, evid, stream, "CommandCancelled", command_id);
        ev.agent_id = view->agent_id;
        ev.batch_id = view->batch_id;
        ev.result = &res;
        ev.reason = res.reason;
        ev.operator_ = (char *)operator_name;
        struct store_event se = {&ev};
        rc = store_append(st, stream, view->version, &se, 1, NULL);
        if (rc == 0) {
            res_out.outcome = "cancelled";
            res_out.status = KS__COMMAND_STATUS__CANCELLED;
            broker__command_ended(b, command_id, &res);
            break;
        }
        if (rc != KS_ECONFLICT)
            break;
    }
    if (view)
        ks__command_view__free_unpacked(view, NULL);
    if (rc == 0 && out)
        *out = res_out;
    return rc;
}

int64_t
broker__attempt_window_us(const Ks__Command *cmd)
{
    int64_t whole = cmd->not_after_us - cmd->issued_at_us;
    return whole > 0 ? whole / BROKER_MAX_ATTEMPTS : 0;
}
