/*
 * waiters.c: what this broker holds in memory for requests in flight,
 * under b->mu: the exec waiting for each command (answered by
 * broker__reply_waiter), the state a granted claim left a command in (the
 * recorder's hint) and the idempotency keys asked here. Calls only down
 * (reply.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

bool
broker__reply_waiter(struct broker *b, const char *command_id,
                     const Ks__CommandResult *result, int error_code,
                     const char *error)
{
    struct broker__waiter *w;

    pthread_mutex_lock(&b->mu);
    w = ks_map_del(&b->waiters, command_id);
    pthread_mutex_unlock(&b->mu);
    if (!w)
        return false;
    Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
    r.command_id = (char *)command_id;
    r.agent_id = w->agent_id;
    r.result = (Ks__CommandResult *)result;
    r.error_code = error_code;
    r.error = (char *)(error ? error : "");
    broker__reply_msg(b, w->reply_subject, &r.base);
    ks_trace("broker.result_replied", command_id);
    free(w->reply_subject);
    free(w);
    return true;
}

struct notice_ctx {
    struct broker *b;
    const char *text;
};

static void
notice_one(const char *command_id, void *val, void *ud)
{
    struct notice_ctx *n = ud;
    struct broker__waiter *w = val;
    Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
    r.command_id = (char *)command_id;
    r.agent_id = w->agent_id;
    r.notice = (char *)n->text;
    broker__reply_msg(n->b, w->reply_subject, &r.base);
}

void
broker__waiters_notice(struct broker *b, const char *text)
{
    struct notice_ctx n = {b, text ? text : ""};
    pthread_mutex_lock(&b->mu);
    ks_map_each(&b->waiters, notice_one, &n);
    pthread_mutex_unlock(&b->mu);
}

static void
free_value(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
broker__claimed_put(struct broker *b, const char *command_id,
                    const char *agent_id, uint32_t attempt, int64_t version)
{
    struct broker__claimed *c = malloc(sizeof(*c)), *old;

    if (!c)
        return;
    c->version = version;
    c->attempt = attempt;
    snprintf(c->agent_id, sizeof(c->agent_id), "%s", agent_id);
    pthread_mutex_lock(&b->mu);
    if (b->claimed.count >= BROKER_CLAIMED_MAX) {
        /* Commands whose end never came here (another broker recorded
         * it, or the agent died): forget them all, cheaply. */
        ks_map_each(&b->claimed, free_value, NULL);
        ks_map_clear(&b->claimed);
    }
    old = ks_map_del(&b->claimed, command_id);
    if (ks_map_put(&b->claimed, command_id, c) != 0)
        free(c);
    pthread_mutex_unlock(&b->mu);
    free(old);
}

bool
broker__key_seen(struct broker *b, const char *operator_, const char *key)
{
    /* The operator's key: a NATS subject token has no newline. */
    char k[EVT_IDENTITY_MAX + 2 + 256];
    bool seen;

    if (snprintf(k, sizeof(k), "%s\n%s", operator_, key) >= (int)sizeof(k))
        return true; /* not noted: the append finds out (no overlap) */
    key = k;
    pthread_mutex_lock(&b->mu);
    seen = ks_map_get(&b->keys_seen, key) != NULL;
    if (!seen) {
        if (b->keys_seen.count >= BROKER_KEYS_SEEN_MAX)
            ks_map_clear(&b->keys_seen);
        ks_map_put(&b->keys_seen, key, (void *)1);
    }
    pthread_mutex_unlock(&b->mu);
    return seen;
}

struct broker__claimed *
broker__claimed_take(struct broker *b, const char *command_id)
{
    struct broker__claimed *c;

    pthread_mutex_lock(&b->mu);
    c = ks_map_del(&b->claimed, command_id);
    pthread_mutex_unlock(&b->mu);
    return c;
}

static void
free_waiter(const char *key, void *val, void *ud)
{
    struct broker__waiter *w = val;
    (void)key;
    (void)ud;
    free(w->reply_subject);
    free(w);
}

void
broker__waiters_release(struct broker *b)
{
    ks_map_each(&b->waiters, free_waiter, NULL);
    ks_map_clear(&b->waiters);
    ks_map_each(&b->claimed, free_value, NULL);
    ks_map_clear(&b->claimed);
    ks_map_clear(&b->keys_seen);
}
