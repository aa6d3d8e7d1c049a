/* Private to events/. */
#ifndef KSCORE_EVENTS_INT_H
#define KSCORE_EVENTS_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "events.h"

/* Packs cmd into a SignedCommand (signed by s; unsigned when s is NULL)
 * in a new buffer. 0, KS_ETOOBIG, -ENOMEM, KS_EINTERNAL. */
int evt__sign_command(const struct evt_signer *s, const Ks__Command *cmd,
                      uint8_t **buf_out, size_t *len_out);

/* 1 if s is 1..max of [A-Za-z0-9_-]: a subject token that names someone
 * (agent ids, identities). s may be NULL (0). */
int evt__token_ok(const char *s, size_t max);

/* A connection's reply inboxes (request.c). */
struct evt__inboxes;
struct evt__mux {
    pthread_mutex_t mu;
    pthread_cond_t cond;         /* an inbox was given back */
    struct evt__inboxes *sets;   /* one per identity */
    char token[13];              /* in every inbox subject of the conn */
    int64_t flushed_us;          /* when the last PING that came back
                                    left (ks_mono_us; under mu) */
    _Atomic int64_t answered_us; /* when the server last answered: a
                                    message on an inbox, or a PONG */
    _Atomic uint64_t late;       /* replies dropped: their waiter was gone */
};
/* Makes c->mux (evt_connect). 0 or -ENOMEM. */
int evt__mux_init(struct evt_conn *c);
/* Frees c->mux and every inbox subscription: only once c->nc is closed
 * (evt_close). Accepts c->mux NULL. */
void evt__mux_free(struct evt_conn *c);
/* Says that every publish made with ib's lease has had its answer (a
 * PubAck or a "no responders"): given back, it is lent again at once. */
void evt__inbox_settled(struct evt_inbox *ib);

#endif
