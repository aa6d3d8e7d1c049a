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
 * passed on the same way (BROKER_NOTICE_CANCEL "<batch_id>"), and so is a
 * relabel (BROKER_NOTICE_RELABEL "<stream>": every broker reads the
 * relabels again, labels.c).
 *
 * Live output: a client following a command live (an exec, a batch with
 * --stream) is announced once by the broker it talks to
 * (BROKER_NOTICE_FOLLOW: where the pieces go); any broker that records a
 * piece of that command sends it there itself, as the follower's broker
 * would. The announcement goes out before the command is published, so it
 * is there before its first piece. The entry goes when the command's end
 * is recorded here or noticed, else the scanner's sweep finds the command
 * ended in the record (broker__remote_live_sweep); a piece that does not
 * reach the client live is read from the record by it (cli/out_stream.c).
 * A broker that starts while a command runs has not heard of its follower:
 * the pieces it records reach that client that way, at its next live piece
 * or its end.
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
publish_notice(struct broker *b, const char *prefix, const char *id,
               const char *data, int len)
{
    char subject[128];
    if (!b->nc || !b->notice_on)
        return;
    snprintf(subject, sizeof(subject), "%s%s", prefix, id);
    /* Core NATS, fire and forget: a lost notice costs the old delay. */
    natsConnection_Publish(b->nc->nc, subject, data, len);
}

static void
follower_free(struct broker__follower *f)
{
    if (f) {
        free(f->subject);
        free(f);
    }
}

static void
free_follower(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    follower_free(val);
}

void
broker__notice_follow(struct broker *b, const char *command_id, bool exec,
                      const char *subject, const char *agent_id)
{
    char data[512];
    int n = snprintf(data, sizeof(data), "%s\n%c\n%s\n%s", b->instance_id,
                     exec ? 'e' : 'b', agent_id, subject);
    if (n > 0 && n < (int)sizeof(data))
        publish_notice(b, BROKER_NOTICE_FOLLOW, command_id, data, n);
}

/* Another broker's follower of command_id (payload after the sender's
 * id): kept until the command ends. */
static void
follow_add(struct broker *b, const char *command_id, const char *p,
           const char *end)
{
    const char *nl1, *nl2;
    if (end - p < 4 || (p[0] != 'e' && p[0] != 'b') || p[1] != '\n')
        return;
    nl1 = p + 2;
    nl2 = memchr(nl1, '\n', (size_t)(end - nl1));
    if (!nl2 || nl2 - nl1 > EVT_AGENT_ID_MAX || nl2 + 1 >= end)
        return;
    struct broker__follower *f = calloc(1, sizeof(*f)), *old;
    if (!f || !(f->subject = strndup(nl2 + 1, (size_t)(end - nl2 - 1)))) {
        free(f);
        return;
    }
    f->exec = p[0] == 'e';
    memcpy(f->agent_id, nl1, (size_t)(nl2 - nl1));
    f->added_mono_us = ks_mono_us();
    pthread_mutex_lock(&b->mu);
    if (b->remote_live.count >= BROKER_REMOTE_LIVE_MAX) {
        ks_map_each(&b->remote_live, free_follower, NULL);
        ks_map_clear(&b->remote_live);
    }
    old = ks_map_del(&b->remote_live, command_id);
    if (ks_map_put(&b->remote_live, command_id, f) != 0) {
        follower_free(f);
        f = NULL;
    }
    pthread_mutex_unlock(&b->mu);
    follower_free(old);
}

bool
broker__remote_forward(struct broker *b, const Ks__Event *ev)
{
    char *subject = NULL;
    char agent[EVT_AGENT_ID_MAX + 1] = "";
    bool exec = false;

    pthread_mutex_lock(&b->mu);
    struct broker__follower *f = ks_map_get(&b->remote_live, ev->command_id);
    if (f) {
        subject = strdup(f->subject);
        exec = f->exec;
        snprintf(agent, sizeof(agent), "%s", f->agent_id);
    }
    pthread_mutex_unlock(&b->mu);
    if (!subject)
        return false;
    broker__live_send(b, subject, exec, agent, ev);
    free(subject);
    return true;
}

void
broker__remote_live_end(struct broker *b, const char *command_id)
{
    pthread_mutex_lock(&b->mu);
    struct broker__follower *f = ks_map_del(&b->remote_live, command_id);
    pthread_mutex_unlock(&b->mu);
    follower_free(f);
}

void
broker__remote_live_free(struct broker *b)
{
    pthread_mutex_lock(&b->mu);
    ks_map_each(&b->remote_live, free_follower, NULL);
    ks_map_clear(&b->remote_live);
    pthread_mutex_unlock(&b->mu);
}

/* Followers older than this are checked against the record by the sweep,
 * at most SWEEP_MAX a pass, SWEEP_CHUNK ids a query. */
#define SWEEP_AGE_US (30 * INT64_C(1000000))
#define SWEEP_MAX 20000
#define SWEEP_CHUNK 1000

struct sweep {
    char (*ids)[37];
    size_t n;
    int64_t before;
};

static void
sweep_old(const char *key, void *val, void *ud)
{
    struct sweep *s = ud;
    const struct broker__follower *f = val;
    if (s->n < SWEEP_MAX && f->added_mono_us < s->before)
        snprintf(s->ids[s->n++], sizeof(s->ids[0]), "%s", key);
}

static int
sweep_ended(const struct store_command_row *c, void *ud)
{
    broker__remote_live_end(ud, c->command_id);
    return 0;
}

void
broker__remote_live_sweep(struct broker *b, struct store *st)
{
    struct sweep s = {NULL, 0, ks_mono_us() - SWEEP_AGE_US};
    const char **ptrs = NULL;

    pthread_mutex_lock(&b->mu);
    bool any = b->remote_live.count > 0;
    pthread_mutex_unlock(&b->mu);
    if (!any)
        return;
    s.ids = calloc(SWEEP_MAX, sizeof(*s.ids));
    ptrs = calloc(SWEEP_CHUNK, sizeof(*ptrs));
    if (s.ids && ptrs) {
        pthread_mutex_lock(&b->mu);
        ks_map_each(&b->remote_live, sweep_old, &s);
        pthread_mutex_unlock(&b->mu);
        /* The followers' brokers recorded these ends themselves: one
         * query a chunk finds which have ended. */
        for (size_t at = 0; at < s.n && !b->stopping; at += SWEEP_CHUNK) {
            size_t k = s.n - at < SWEEP_CHUNK ? s.n - at : SWEEP_CHUNK;
            for (size_t i = 0; i < k; i++)
                ptrs[i] = s.ids[at + i];
            if (store_command_states(st, ptrs, k, 1, sweep_ended, b) != 0)
                break;
        }
    }
    free(s.ids);
    free(ptrs);
}

void
broker__notice_ended(struct broker *b, const char *command_id)
{
    publish_notice(b, BROKER_NOTICE_ENDED, command_id, b->instance_id,
                   (int)strlen(b->instance_id));
}

void
broker__notice_batch_cancel(struct broker *b, const char *batch_id)
{
    publish_notice(b, BROKER_NOTICE_CANCEL, batch_id, b->instance_id,
                   (int)strlen(b->instance_id));
}

void
broker__notice_relabel(struct broker *b, const char *stream)
{
    publish_notice(b, BROKER_NOTICE_RELABEL, stream, b->instance_id,
                   (int)strlen(b->instance_id));
}

static void
on_notice(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker *b = ud;
    const char *subj = natsMsg_GetSubject(msg);
    const char *data = natsMsg_GetData(msg);
    int len = natsMsg_GetDataLength(msg);
    size_t ne = strlen(BROKER_NOTICE_ENDED), nc_ = strlen(BROKER_NOTICE_CANCEL),
           nf = strlen(BROKER_NOTICE_FOLLOW), ni = strlen(b->instance_id);

    (void)nc;
    (void)sub;
    /* The sender's instance id, then (a follow notice) "\n" and more. */
    if (!data || len < (int)ni || (len > (int)ni && data[ni] != '\n'))
        goto out;
    /* Its own notice: it had nobody for the command. */
    if (memcmp(data, b->instance_id, ni) == 0)
        goto out;
    if (strncmp(subj, BROKER_NOTICE_ENDED, ne) == 0 &&
        ks_is_uuid(subj + ne)) {
        const char *id = subj + ne;
        ks_trace("broker.end_notice", id);
        b->up.remote_ended(b, id);
    } else if (strncmp(subj, BROKER_NOTICE_FOLLOW, nf) == 0 &&
               ks_is_uuid(subj + nf) && len > (int)ni) {
        follow_add(b, subj + nf, data + ni + 1, data + len);
    } else if (strncmp(subj, BROKER_NOTICE_CANCEL, nc_) == 0 &&
               strncmp(subj + nc_, "batch-", 6) == 0 &&
               ks_is_uuid(subj + nc_ + 6)) {
        b->up.remote_batch_cancel(b, subj + nc_);
    } else if (strncmp(subj, BROKER_NOTICE_RELABEL,
                       strlen(BROKER_NOTICE_RELABEL)) == 0) {
        /* The registry thread reads them again (labels.c). */
        atomic_store(&b->relabels_dirty, true);
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
