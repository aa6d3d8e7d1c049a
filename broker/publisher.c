/*
 * publisher.c: the commands whose publish the stream does not take now,
 * published again off the exec workers.
 *
 * An exec worker records a command and publishes it (broker.c
 * on_execute). A PubAck takes milliseconds; while KSCORE_CMDS elects a
 * leader (its node killed: 5-15 s on a 3-node cluster) it does not come,
 * and a publish tried again for the election's length held its worker
 * that long. With BROKER_EXEC_WORKERS held so, every request that came
 * meanwhile waited in the intake until the election was over and was
 * recorded only then, seconds late (test_cluster F02 under make soak: an
 * exec sent 0.2 s before the fault recorded 11.8 s later, 3.5 s after
 * the election ended). Here one thread tries them again instead, a
 * window at a time (evt_publish_commands: one round trip for up to
 * EVT_JS_WINDOW_MAX), oldest first, each with its own Nats-Msg-Id (so the
 * stream stores each once however many tries reach it), until its
 * attempt's deadline is near: past it the deadline scanner publishes a
 * new attempt, and a late copy of the old one would be a second message
 * for one command. The workers go on recording meanwhile; while anything
 * waits here they queue behind it rather than try first (they would wait
 * for the same stream).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "broker_int.h"

/* A command stops being tried this long before its attempt's deadline,
 * when the scanner may publish the next attempt, or before the stream's
 * duplicate window since its first try ends (a copy stored with its
 * PubAck lost would be stored again after it) (us). */
#define PUBLISHER_MARGIN_US (500 * 1000)
/* One window's budget at most (ms): the stop flag is looked at between
 * windows. */
#define PUBLISHER_WINDOW_MS (2 * EVT_PUBLISH_TRY_MS)

struct pub_item {
    struct pub_item *next;
    Ks__Command *cmd; /* own copy */
    char pool[EVT_AGENT_ID_MAX + 1];
    int64_t until_us; /* epoch us: tried until then */
    int64_t queued_mono_us;
};

struct broker__publisher {
    struct broker *b;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct pub_item *head, *tail; /* (mu) oldest first */
    bool stop;                    /* (mu) */
    bool started;
    pthread_t thread;
    /* Queued or being published: the workers queue behind them. */
    atomic_size_t waiting;
};

static void
item_free(struct pub_item *it)
{
    if (it->cmd)
        ks__command__free_unpacked(it->cmd, NULL);
    free(it);
}

/* Puts what failed back at the front, oldest first (under mu). */
static void
requeue_front(struct broker__publisher *p, struct pub_item *first,
              struct pub_item *last)
{
    if (!first)
        return;
    last->next = p->head;
    p->head = first;
    if (!p->tail)
        p->tail = last;
}

static void
give_up(struct broker *b, struct pub_item *it, const char *why)
{
    ks_log(KS_LOG_WARN, "publish not taken in time; the scanner retries",
           KS_S("command_id", it->cmd->command_id),
           KS_S("agent", it->cmd->agent_id), KS_I("attempt", it->cmd->attempt),
           KS_S("why", why),
           KS_I("queued_ms", (ks_mono_us() - it->queued_mono_us) / 1000));
}

/* One window: publishes up to EVT_JS_WINDOW_MAX of the oldest within the
 * earliest one's time left. Returns false once stopping and empty. */
static bool
publish_window(struct broker__publisher *p)
{
    struct broker *b = p->b;
    struct pub_item *win[EVT_JS_WINDOW_MAX];
    Ks__Command *cmds[EVT_JS_WINDOW_MAX];
    const char *pools[EVT_JS_WINDOW_MAX];
    uint64_t seqs[EVT_JS_WINDOW_MAX];
    int rcs[EVT_JS_WINDOW_MAX];
    size_t n = 0;
    bool stop;

    pthread_mutex_lock(&p->mu);
    while (!p->head && !p->stop)
        pthread_cond_wait(&p->cv, &p->mu);
    stop = p->stop;
    while (p->head && n < EVT_JS_WINDOW_MAX) {
        win[n++] = p->head;
        p->head = p->head->next;
    }
    if (!p->head)
        p->tail = NULL;
    pthread_mutex_unlock(&p->mu);
    if (n == 0)
        return false;

    int64_t now = ks_now_us(), budget_us = INT64_MAX;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t left = win[i]->until_us - now;
        if (left <= 0) {
            give_up(b, win[i], "its attempt's deadline is near");
            atomic_fetch_sub(&p->waiting, 1);
            item_free(win[i]);
            continue;
        }
        if (left < budget_us)
            budget_us = left;
        win[k++] = win[i];
    }
    if (k == 0)
        return true;
    if (budget_us > (int64_t)PUBLISHER_WINDOW_MS * 1000)
        budget_us = (int64_t)PUBLISHER_WINDOW_MS * 1000;
    /* Stopping: one try each; what the stream does not take then stays
     * Dispatched for the scanner (this broker's next start, or another). */
    if (stop && budget_us > (int64_t)EVT_PUBLISH_TRY_MS * 1000)
        budget_us = (int64_t)EVT_PUBLISH_TRY_MS * 1000;
    for (size_t i = 0; i < k; i++) {
        cmds[i] = win[i]->cmd;
        pools[i] = win[i]->pool;
    }
    int64_t t0 = ks_mono_us();
    evt_publish_commands(b->nc, b->signer, cmds, pools, k,
                         budget_us / 1000 > 0 ? (int)(budget_us / 1000) : 1,
                         seqs, rcs);
    /* An error PubAck before the budget ran out is the stream's "never"
     * (a 503 "not now" is tried again to the end of it). */
    bool early = ks_mono_us() - t0 < budget_us - 100 * 1000;

    pthread_mutex_lock(&p->mu);
    stop = p->stop;
    pthread_mutex_unlock(&p->mu);
    struct pub_item *again = NULL, *again_tail = NULL;
    now = ks_now_us();
    for (size_t i = 0; i < k; i++) {
        struct pub_item *it = win[i];
        bool never = rcs[i] == KS_ETOOBIG || rcs[i] == KS_EINVAL ||
                     (rcs[i] == KS_ENATS && early);
        if (seqs[i]) {
            broker__admit_stored(b, it->cmd->command_id, seqs[i]);
            ks_trace("broker.command_published", it->cmd->command_id);
            ks_log(KS_LOG_INFO, "published after the stream took it again",
                   KS_S("command_id", it->cmd->command_id),
                   KS_S("agent", it->cmd->agent_id),
                   KS_I("waited_ms",
                        (ks_mono_us() - it->queued_mono_us) / 1000));
        } else if (!stop && !never && it->until_us > now) {
            it->next = NULL;
            if (again_tail)
                again_tail->next = it;
            else
                again = it;
            again_tail = it;
            continue;
        } else {
            give_up(b, it, stop    ? "the broker stops"
                           : never ? ks_strerror(rcs[i])
                                   : "the stream did not take it");
        }
        atomic_fetch_sub(&p->waiting, 1);
        item_free(it);
    }
    if (again) {
        pthread_mutex_lock(&p->mu);
        requeue_front(p, again, again_tail);
        pthread_mutex_unlock(&p->mu);
        /* The stream still does not take them: a pause, not a spin. */
        nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    }
    return true;
}

static void *
publisher_main(void *ud)
{
    struct broker__publisher *p = ud;
    while (publish_window(p))
        ;
    return NULL;
}

int
broker__publisher_start(struct broker *b)
{
    struct broker__publisher *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->b = b;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    atomic_init(&p->waiting, 0);
    if (pthread_create(&p->thread, NULL, publisher_main, p) != 0) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return KS_EINTERNAL;
    }
    p->started = true;
    b->publisher = p;
    return 0;
}

void
broker__publisher_stop(struct broker *b)
{
    struct broker__publisher *p = b->publisher;
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started)
        pthread_join(p->thread, NULL);
    p->started = false;
    pthread_mutex_lock(&p->mu);
    for (struct pub_item *it = p->head, *nx; it; it = nx) {
        nx = it->next;
        item_free(it);
    }
    p->head = p->tail = NULL;
    atomic_store(&p->waiting, 0);
    pthread_mutex_unlock(&p->mu);
}

void
broker__publisher_free(struct broker *b)
{
    struct broker__publisher *p = b->publisher;
    if (!p)
        return;
    broker__publisher_stop(b);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    b->publisher = NULL;
}

bool
broker__publisher_busy(struct broker *b)
{
    struct broker__publisher *p = b->publisher;
    return p && atomic_load(&p->waiting) > 0;
}

int
broker__publish_later(struct broker *b, const Ks__Command *cmd,
                      const char *pool, int64_t deliver_by_us)
{
    struct broker__publisher *p = b->publisher;
    struct pub_item *it;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    if (!p)
        return KS_EUNAVAIL;
    if (!(it = calloc(1, sizeof(*it))))
        return -ENOMEM;
    if ((rc = kproto_pack(&cmd->base, &buf, &len))) {
        free(it);
        return rc;
    }
    it->cmd = ks__command__unpack(NULL, len, buf);
    free(buf);
    if (!it->cmd) {
        free(it);
        return -ENOMEM;
    }
    snprintf(it->pool, sizeof(it->pool), "%s", pool ? pool : "");
    it->until_us = deliver_by_us - PUBLISHER_MARGIN_US;
    /* (its first try was just now) */
    int64_t dup_end = ks_now_us() +
                      (int64_t)EVT_DUPLICATE_WINDOW_MS * 1000 -
                      PUBLISHER_MARGIN_US;
    if (it->until_us > dup_end)
        it->until_us = dup_end;
    it->queued_mono_us = ks_mono_us();
    pthread_mutex_lock(&p->mu);
    if (p->stop) {
        pthread_mutex_unlock(&p->mu);
        item_free(it);
        return KS_EUNAVAIL;
    }
    atomic_fetch_add(&p->waiting, 1);
    if (p->tail)
        p->tail->next = it;
    else
        p->head = it;
    p->tail = it;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}
