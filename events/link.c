/*
 * link.c: is anything getting through? nats.c says CONNECTED as long as
 * its socket is not known to be broken, which is not the same: a server
 * that stopped (SIGSTOP, a frozen VM) answers nothing and nats.c notices
 * only after its ping interval (2 min) and two pings out; a read thread
 * that hangs (nats.c issue 637, issue 22) never notices, and every write
 * then fails with EPIPE while the status stays CONNECTED. Only an answer
 * from the server proves the link: a message on one of the connection's
 * inboxes (a reply, a PubAck, a "no responders": request.c), or the PONG
 * to a PING.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "events.h"
#include "events_int.h"

int64_t
evt_link_answered_us(const struct evt_conn *c)
{
    return c && c->mux ? atomic_load(&c->mux->answered_us) : 0;
}

int
evt_link_probe(struct evt_conn *c, int timeout_ms)
{
    int64_t t0 = ks_mono_us();
    natsStatus st = natsConnection_FlushTimeout(c->nc, timeout_ms);

    if (st != NATS_OK)
        return evt_err(st);
    /* The PONG came after everything written before the PING: any "no
     * responders" for a request given back before t0 is in (request.c). */
    pthread_mutex_lock(&c->mux->mu);
    if (t0 > c->mux->flushed_us)
        c->mux->flushed_us = t0;
    pthread_mutex_unlock(&c->mux->mu);
    atomic_store(&c->mux->answered_us, ks_mono_us());
    return 0;
}

struct evt_link_watch {
    struct evt_conn *c;
    int64_t timeout_us;
    void (*dead)(void *ud, int64_t silent_us);
    void *ud;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    bool stop;
};

static void *
watch_main(void *arg)
{
    struct evt_link_watch *w = arg;
    int64_t connected_since = 0;
    bool said = false;

    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec ts;
        ks_mono_deadline(&ts, EVT_LINK_PROBE_MS);
        while (!w->stop &&
               pthread_cond_timedwait(&w->cond, &w->mu, &ts) != ETIMEDOUT)
            ;
        if (w->stop)
            break;
        pthread_mutex_unlock(&w->mu);

        int64_t now = ks_mono_us();
        if (natsConnection_Status(w->c->nc) != NATS_CONN_STATUS_CONNECTED) {
            /* nats.c knows: it reconnects by itself, forever. */
            connected_since = 0;
            pthread_mutex_lock(&w->mu);
            continue;
        }
        if (!connected_since)
            connected_since = now;
        /* A busy link answers anyway: no PING then. */
        if (now - evt_link_answered_us(w->c) >=
            (int64_t)EVT_LINK_PROBE_MS * 1000)
            (void)evt_link_probe(w->c, 2 * EVT_LINK_PROBE_MS);
        now = ks_mono_us();
        int64_t since = evt_link_answered_us(w->c);
        if (since < connected_since)
            since = connected_since;
        if (!said && now - since > w->timeout_us) {
            said = true;
            w->dead(w->ud, now - since);
        }
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int
evt_link_watch_start(struct evt_conn *c, int timeout_ms,
                     void (*dead)(void *ud, int64_t silent_us), void *ud,
                     struct evt_link_watch **out)
{
    struct evt_link_watch *w = calloc(1, sizeof(*w));
    pthread_condattr_t ca;

    if (!w)
        return -ENOMEM;
    w->c = c;
    w->timeout_us = (int64_t)timeout_ms * 1000;
    w->dead = dead;
    w->ud = ud;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cond, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&w->thread, NULL, watch_main, w) != 0) {
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return KS_EINTERNAL;
    }
    *out = w;
    return 0;
}

void
evt_link_watch_stop(struct evt_link_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
