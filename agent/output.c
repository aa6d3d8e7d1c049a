/*
 * output.c: a running command's output, sent as it is written.
 *
 * The executor hands each piece it reads to agent__out_piece (on its loop
 * thread), which only appends it to the job's pending bytes. The flusher
 * thread sends pending bytes as OutputChunk events (through the outbox,
 * in order with the command's terminal report, which the publisher sends
 * after them) once the command has run AGENT_OUT_DELAY_US, or at once when
 * AGENT_OUT_PIECE bytes are pending. So a short command whose output fits
 * in its result never sends a piece: its result carries the output, as
 * before (no extra event, no extra round trip). At the end
 * (agent__out_finish), a command that has sent pieces, or whose output
 * is too large for one message, sends the rest as pieces (so followers
 * get every byte live) and its result says how many bytes the pieces hold
 * (Output.chunked_bytes); the result still carries the output when it
 * fits, so readers need not fetch it, and else has no data.
 *
 * Locks: a->out_mu (the list of jobs, the flusher's wake-up) before an
 * agent_out's mu, before a->mu (taken inside agent__queue_event).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent_int.h"

/* Pieces start after this much run time... */
#define AGENT_OUT_DELAY_US 50000
/* ...or once this much is pending; also the largest piece. */
#define AGENT_OUT_PIECE (256 * 1024)
/* The flusher's tick while output is pending. */
#define AGENT_OUT_TICK_MS 10
/* A result carries its output inline up to this much (both streams). */
#define AGENT_OUT_INLINE_MAX (768 * 1024)

struct agent_out {
    struct agent_out *next; /* a->out_list, under a->out_mu */
    struct job_ctx *job;
    pthread_mutex_t mu;
    int64_t t0;       /* mono us at submit */
    bool chunking;    /* pieces have been queued */
    uint64_t sent[2]; /* bytes of each stream queued as pieces */
    char *pend[2];
    size_t pend_len[2], pend_alloc[2];
};

/* Queues one OutputChunk event of j. Under o->mu. */
static int
queue_piece(struct job_ctx *j, int stream, uint64_t offset, const char *data,
            size_t len)
{
    Ks__Event ev = KS__EVENT__INIT;
    Ks__OutputChunk c = KS__OUTPUT_CHUNK__INIT;
    char event_id[37], sid[64];

    ks_uuid(event_id);
    snprintf(sid, sizeof(sid), "command-%s", j->command_id);
    ev.event_id = event_id;
    ev.stream_id = sid;
    ev.type = "OutputChunk";
    ev.occurred_at_us = ks_now_us();
    ev.command_id = j->command_id;
    ev.agent_id = j->slot->id;
    ev.attempt = j->attempt;
    ev.operator_ = j->operator_name;
    c.stream = (uint32_t)stream;
    c.offset = offset;
    c.data.data = (uint8_t *)data;
    c.data.len = len;
    ev.chunk = &c;
    /* Not kept on disk: a crash of the agent ends the command Lost, and
     * the pieces recorded so far are what it printed. */
    return agent__queue_event_opt(j->agent, &ev, false);
}

/* Sends what is pending of o. Under o->mu. */
static void
flush_locked(struct agent_out *o)
{
    for (int s = 0; s < 2; s++) {
        size_t at = 0;
        while (at < o->pend_len[s]) {
            size_t n = o->pend_len[s] - at;
            if (n > AGENT_OUT_PIECE)
                n = AGENT_OUT_PIECE;
            if (queue_piece(o->job, s + 1, o->sent[s], o->pend[s] + at, n))
                ks_log(KS_LOG_WARN, "cannot queue output",
                       KS_S("command_id", o->job->command_id));
            o->sent[s] += n;
            at += n;
            o->chunking = true;
        }
        o->pend_len[s] = 0;
    }
}

void
agent__out_piece(uint64_t job_id, int stream, const char *data, size_t len,
                 void *ud)
{
    struct job_ctx *j = ud;
    struct agent_out *o = j->out;
    bool wake = false;

    (void)job_id;
    if (!o || stream < 1 || stream > 2)
        return;
    int s = stream - 1;
    pthread_mutex_lock(&o->mu);
    if (o->pend_alloc[s] < o->pend_len[s] + len) {
        size_t want = o->pend_alloc[s] ? o->pend_alloc[s] * 2 : 4096;
        while (want < o->pend_len[s] + len)
            want *= 2;
        char *p = realloc(o->pend[s], want);
        if (!p) {
            /* Never lost: the executor keeps the bytes, and the end
             * sends whatever was not sent. */
            pthread_mutex_unlock(&o->mu);
            return;
        }
        o->pend[s] = p;
        o->pend_alloc[s] = want;
    }
    wake = o->pend_len[0] + o->pend_len[1] == 0 ||
           o->pend_len[s] + len >= AGENT_OUT_PIECE;
    memcpy(o->pend[s] + o->pend_len[s], data, len);
    o->pend_len[s] += len;
    pthread_mutex_unlock(&o->mu);
    if (wake) {
        struct agent *a = j->agent;
        pthread_mutex_lock(&a->out_mu);
        pthread_cond_signal(&a->out_flush_cond);
        pthread_mutex_unlock(&a->out_mu);
    }
}

int
agent__out_new(struct job_ctx *j)
{
    struct agent *a = j->agent;
    struct agent_out *o = calloc(1, sizeof(*o));

    if (!o)
        return -ENOMEM;
    pthread_mutex_init(&o->mu, NULL);
    o->job = j;
    o->t0 = ks_mono_us();
    j->out = o;
    pthread_mutex_lock(&a->out_mu);
    o->next = a->out_list;
    a->out_list = o;
    pthread_mutex_unlock(&a->out_mu);
    return 0;
}

static void
out_free(struct agent_out *o)
{
    if (!o)
        return;
    free(o->pend[0]);
    free(o->pend[1]);
    pthread_mutex_destroy(&o->mu);
    free(o);
}

void
agent__out_finish(struct job_ctx *j, const struct exec_result *x,
                  Ks__Output *out, Ks__Output *err)
{
    struct agent *a = j->agent;
    struct agent_out *o = j->out;
    Ks__Output *outs[2] = {out, err};
    const struct exec_output *xs[2] = {&x->out, &x->err};

    if (!o)
        return; /* inline, as fill_result set it */
    pthread_mutex_lock(&a->out_mu);
    for (struct agent_out **p = &a->out_list; *p; p = &(*p)->next)
        if (*p == o) {
            *p = o->next;
            break;
        }
    pthread_mutex_lock(&o->mu);
    bool fits = x->out.len + x->err.len <= AGENT_OUT_INLINE_MAX;
    if (fits && !o->chunking) {
        /* A short command: its result carries it all, no piece. */
    } else {
        /* The executor's buffers hold every byte kept: send what the
         * flusher has not. */
        for (int s = 0; s < 2; s++) {
            size_t len = xs[s]->len;
            for (size_t at = o->sent[s]; at < len;) {
                size_t n = len - at < AGENT_OUT_PIECE ? len - at
                                                      : AGENT_OUT_PIECE;
                if (queue_piece(j, s + 1, at, xs[s]->data + at, n))
                    ks_log(KS_LOG_WARN, "cannot queue output",
                           KS_S("command_id", j->command_id));
                at += n;
            }
            /* What fits stays in the result too: readers need not
             * fetch it; live followers have had every byte. */
            if (!fits) {
                outs[s]->data.data = NULL;
                outs[s]->data.len = 0;
            }
            outs[s]->chunked_bytes = len;
        }
    }
    pthread_mutex_unlock(&o->mu);
    pthread_mutex_unlock(&a->out_mu);
    j->out = NULL;
    out_free(o);
}

static void *
flusher_main(void *arg)
{
    struct agent *a = arg;

    pthread_mutex_lock(&a->out_mu);
    while (!a->out_stopping) {
        bool pending = false;
        int64_t now = ks_mono_us();
        for (struct agent_out *o = a->out_list; o; o = o->next) {
            pthread_mutex_lock(&o->mu);
            size_t n = o->pend_len[0] + o->pend_len[1];
            if (n && (now - o->t0 >= AGENT_OUT_DELAY_US || o->chunking ||
                      o->pend_len[0] >= AGENT_OUT_PIECE ||
                      o->pend_len[1] >= AGENT_OUT_PIECE))
                flush_locked(o);
            pending = pending || o->pend_len[0] + o->pend_len[1] > 0;
            pthread_mutex_unlock(&o->mu);
        }
        if (pending) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += AGENT_OUT_TICK_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&a->out_flush_cond, &a->out_mu, &ts);
        } else {
            pthread_cond_wait(&a->out_flush_cond, &a->out_mu);
        }
    }
    pthread_mutex_unlock(&a->out_mu);
    return NULL;
}

int
agent__out_start(struct agent *a)
{
    if (pthread_create(&a->out_thread, NULL, flusher_main, a) != 0)
        return -EAGAIN;
    a->out_started = true;
    return 0;
}

void
agent__out_stop(struct agent *a)
{
    if (!a->out_started)
        return;
    pthread_mutex_lock(&a->out_mu);
    a->out_stopping = true;
    pthread_cond_signal(&a->out_flush_cond);
    pthread_mutex_unlock(&a->out_mu);
    pthread_join(a->out_thread, NULL);
    a->out_started = false;
}
