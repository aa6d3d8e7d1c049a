/*
 * notice.c: what one broker records, the broker that waits for it hears at
 * once.
 *
 * Several brokers share the work (the NATS queue group kscore-broker): the
 * exec that waits for a command, the batch that counts it and the client
 * that follows a batch's output live are in the memory of the broker that
 * took the request (or holds the batch's lease), while the recorder's
 * durable consumer hands the command's end to any broker. The broker that
 * records an end it has nobody for here publishes a notice on core NATS,
 * BROKER_NOTICE_ENDED "<command_id>": every broker hears it, and the one
 * that has a waiter for the command reads the result from the record and
 * answers, the one whose batch has the target counts it (batch.c), at
 * once rather than at the client's re-ask (5 s) or the batch's next tick.
 *
 * Cost: no notice when the recording broker had the waiter, the live
 * follower or the batch itself (the usual case on one broker); the notice
 * carries no result, only the sender's instance id (so a broker skips its
 * own), and only the broker that holds the command reads the record: a
 * batch of N targets costs N reads at its driver, as its tick did, not N
 * per broker. A lost notice costs what it cost before: the client asks
 * again, the batch's tick reads the end.
 *
 * A batch cancel recorded by another broker than the batch's driver is
 * passed on the same way (BROKER_NOTICE_CANCEL "<batch_id>").
 *
 * Only the broker's credential may publish under _KSCORE.broker.
 * (deploy/nats-auth.conf.in: an operator publishes only its API subjects,
 * an agent only its own claim, events, registry key and acks).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

static void
publish_notice(struct broker *b, const char *prefix, const char *id)
{
    char subject[128];
    if (!b->nc || !b->notice_on)
        return;
    snprintf(subject, sizeof(subject), "%s%s", prefix, id);
    /* Core NATS, fire and forget: a lost notice costs the old delay. */
    natsConnection_Publish(b->nc->nc, subject, b->instance_id,
                           (int)strlen(b->instance_id));
}

void
broker__notice_ended(struct broker *b, const char *command_id)
{
    publish_notice(b, BROKER_NOTICE_ENDED, command_id);
}

void
broker__notice_batch_cancel(struct broker *b, const char *batch_id)
{
    publish_notice(b, BROKER_NOTICE_CANCEL, batch_id);
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

static void
on_notice(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker *b = ud;
    const char *subj = natsMsg_GetSubject(msg);
    const char *data = natsMsg_GetData(msg);
    int len = natsMsg_GetDataLength(msg);
    size_t ne = strlen(BROKER_NOTICE_ENDED), nc_ = strlen(BROKER_NOTICE_CANCEL);

    (void)nc;
    (void)sub;
    /* Its own notice: it had nobody for the command. */
    if (len == (int)strlen(b->instance_id) &&
        memcmp(data, b->instance_id, (size_t)len) == 0)
        goto out;
    if (strncmp(subj, BROKER_NOTICE_ENDED, ne) == 0 &&
        ks_is_uuid(subj + ne)) {
        const char *id = subj + ne;
        ks_trace("broker.end_notice", id);
        broker__live_end(b, id);
        broker__batch_remote_end(b, id);
        answer_waiter(b, id);
    } else if (strncmp(subj, BROKER_NOTICE_CANCEL, nc_) == 0 &&
               strncmp(subj + nc_, "batch-", 6) == 0 &&
               ks_is_uuid(subj + nc_ + 6)) {
        broker__batch_remote_cancel(b, subj + nc_);
    }
out:
    natsMsg_Destroy(msg);
}

int
broker__notice_start(struct broker *b, char **errmsg)
{
    char *why = NULL;
    char subject[64];
    int rc;

    ks_uuid(b->instance_id);
    rc = store_open(b->opts->db_conninfo, &b->st_notice, &why);
    if (rc) {
        if (errmsg && asprintf(errmsg, "cannot connect to PostgreSQL: %s",
                               why ? why : ks_strerror(rc)) < 0)
            *errmsg = NULL;
        free(why);
        return rc;
    }
    /* Every broker hears every notice: not a queue group. */
    snprintf(subject, sizeof(subject), "%s>", BROKER_NOTICE_PREFIX);
    natsStatus s = natsConnection_Subscribe(&b->sub_notice, b->nc->nc,
                                            subject, on_notice, b);
    if (s == NATS_OK)
        s = natsSubscription_SetPendingLimits(b->sub_notice, -1, -1);
    if (s != NATS_OK) {
        if (errmsg && asprintf(errmsg, "subscribe %s: %s", subject,
                               natsStatus_GetText(s)) < 0)
            *errmsg = NULL;
        return KS_ENATS;
    }
    b->notice_on = true;
    return 0;
}
