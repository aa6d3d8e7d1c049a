/*
 * output.c: command output in pieces. The recorder keeps the OutputChunk
 * events of running commands in table command_output (not as events),
 * each admitted like any report of an agent (only about a command the
 * record addresses to that agent, only for the attempt it claimed, only
 * while it runs); refused pieces are kept as ReportRejected annotations
 * without their bytes. Recorded pieces go on at once to whoever follows
 * the command live (an exec with live_output, a batch with live_output).
 * Readers (kscore.api.v1.logs, get, events) put the output back together.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* Largest logs reply page (bytes of output, both streams). */
#define LOGS_PAGE_DEFAULT (512 * 1024)
#define LOGS_PAGE_MAX (900 * 1024)
/* get and events put outputs back whole up to this much (both streams);
 * past it they say chunked_bytes and `kscore logs` pages through. */
#define BROKER_WHOLE_OUTPUT_MAX ((uint64_t)512 * 1024 * 1024)

/* Commands whose caps are kept at most; past it all are forgotten (each
 * is read again from the record when its next piece comes). */
#define OUTPUT_CAPS_MAX 65536

/* Why a piece past its command's cap is refused (compared by address). */
static const char past_cap[] =
    "output past the command's own cap (stdout_cap_bytes / "
    "stderr_cap_bytes of its request)";

/* A command's caps: bytes of stdout, of stderr. */
struct broker__out_caps {
    uint32_t cap[2];
};

static void
free_caps(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
broker__output_caps_note(struct broker *b, const char *command_id,
                         const Ks__CommandSpec *spec)
{
    struct broker__out_caps *c = malloc(sizeof(*c)), *old;
    if (!c)
        return;
    c->cap[0] = agent_output_cap(spec->stdout_cap_bytes);
    c->cap[1] = agent_output_cap(spec->stderr_cap_bytes);
    pthread_mutex_lock(&b->mu);
    if (b->out_caps.count >= OUTPUT_CAPS_MAX) {
        ks_map_each(&b->out_caps, free_caps, NULL);
        ks_map_clear(&b->out_caps);
    }
    old = ks_map_del(&b->out_caps, command_id);
    if (ks_map_put(&b->out_caps, command_id, c) != 0) {
        free(c);
    }
    pthread_mutex_unlock(&b->mu);
    free(old);
}

void
broker__output_caps_forget(struct broker *b, const char *command_id)
{
    pthread_mutex_lock(&b->mu);
    void *old = ks_map_del(&b->out_caps, command_id);
    pthread_mutex_unlock(&b->mu);
    free(old);
}

void
broker__output_caps_free(struct broker *b)
{
    ks_map_each(&b->out_caps, free_caps, NULL);
    ks_map_clear(&b->out_caps);
}

/* The cap of stream (1, 2) of command_id, 0 when not known here. */
static uint32_t
caps_get(struct broker *b, const char *command_id, uint32_t stream)
{
    uint32_t cap = 0;
    pthread_mutex_lock(&b->mu);
    const struct broker__out_caps *c = ks_map_get(&b->out_caps, command_id);
    if (c && (stream == 1 || stream == 2))
        cap = c->cap[stream - 1];
    pthread_mutex_unlock(&b->mu);
    return cap;
}

/* store_read_stream's callback: the command's first event, its
 * request. */
static int
note_requested(const Ks__RecordedEvent *re, void *ud)
{
    struct broker *b = ud;
    const Ks__Event *ev = re->event;
    if (ev && ev->command && ev->command->spec &&
        strcmp(ev->type, "CommandRequested") == 0)
        broker__output_caps_note(b, ev->command->command_id,
                                 ev->command->spec);
    return 1; /* the first only */
}

int
broker__admit_output(const struct store_command_state *st,
                     const struct store_output_chunk *c, const char **why,
                     void *ud)
{
    struct broker *b = ud;
    if (strcmp(st->agent_id, c->agent_id) != 0) {
        *why = "output for a command addressed to another agent";
        return KS_EDENIED;
    }
    if (st->status != KS__COMMAND_STATUS__RUNNING) {
        *why = kproto_status_terminal(st->status)
                   ? "output for a command that has ended"
                   : "output for a command that was never claimed";
        return KS_EDENIED;
    }
    if (c->attempt != st->attempt) {
        *why = "output of another attempt than the one claimed";
        return KS_EDENIED;
    }
    /* No byte past the largest cap a command may have. */
    if (c->offset > (uint64_t)EXEC_OUTPUT_CAP_MAX ||
        c->len > KS_MAX_MESSAGE_BYTES ||
        c->offset + c->len > (uint64_t)EXEC_OUTPUT_CAP_MAX) {
        *why = "output offset out of range";
        return KS_EDENIED;
    }
    /* And none past the command's own cap: its agent keeps no more. */
    uint32_t cap = b ? caps_get(b, c->command_id, c->stream) : 0;
    if (cap && (c->offset > cap || c->offset + c->len > cap)) {
        *why = past_cap;
        return KS_EDENIED;
    }
    return 0;
}

int
broker__record_pieces(struct broker *b, Ks__Event **evs, size_t n,
                      enum store_step *verdicts, const char **whys)
{
    struct store_output_chunk *cs = calloc(n ? n : 1, sizeof(*cs));
    int rc;

    if (!cs)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        cs[i].command_id = evs[i]->command_id;
        cs[i].agent_id = evs[i]->agent_id;
        cs[i].attempt = evs[i]->attempt;
        cs[i].stream = evs[i]->chunk->stream;
        cs[i].offset = evs[i]->chunk->offset;
        cs[i].data = evs[i]->chunk->data.data;
        cs[i].len = evs[i]->chunk->data.len;
        whys[i] = NULL;
        /* A command recorded by another broker, or before this one
         * started: its caps from its request. */
        if (ks_is_uuid(cs[i].command_id) &&
            !caps_get(b, cs[i].command_id, 1)) {
            char stream[64];
            snprintf(stream, sizeof(stream), "command-%s",
                     cs[i].command_id);
            store_read_stream(b->st_rec, stream, 0, 1, note_requested, b);
        }
    }
    rc = store_append_output(b->st_rec, cs, n, broker__admit_output, b,
                             verdicts, whys);
    if (rc == KS_EINVAL) {
        /* A bad stream number: decide one by one, refusing the bad. */
        rc = 0;
        for (size_t i = 0; i < n && rc == 0; i++) {
            if (cs[i].stream != 1 && cs[i].stream != 2) {
                verdicts[i] = STORE_STEP_ILLEGAL;
                whys[i] = "output of an unknown stream";
                continue;
            }
            rc = store_append_output(b->st_rec, &cs[i], 1,
                                     broker__admit_output, b, &verdicts[i],
                                     &whys[i]);
        }
    }
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (verdicts[i] != STORE_STEP_ILLEGAL || whys[i] != past_cap)
            continue;
        int64_t now = ks_mono_us();
        pthread_mutex_lock(&b->mu);
        bool log = now - b->out_caps_logged_us > 10000000;
        if (log)
            b->out_caps_logged_us = now;
        pthread_mutex_unlock(&b->mu);
        if (log)
            ks_log(KS_LOG_WARN,
                   "output past its command's cap refused (logged once per "
                   "10 s)",
                   KS_S("agent", cs[i].agent_id),
                   KS_S("command_id", cs[i].command_id),
                   KS_I("stream", cs[i].stream),
                   KS_I("offset", (int64_t)cs[i].offset),
                   KS_I("bytes", (int64_t)cs[i].len),
                   KS_I("cap", caps_get(b, cs[i].command_id,
                                        cs[i].stream)));
        break;
    }
    free(cs);
    return rc;
}

void
broker__live_forward(struct broker *b, const Ks__Event *ev)
{
    char *subject = NULL;
    bool exec = false;
    struct broker__waiter *w;
    char agent[EVT_AGENT_ID_MAX + 1] = "";

    pthread_mutex_lock(&b->mu);
    w = ks_map_get(&b->waiters, ev->command_id);
    if (w && w->live) {
        subject = strdup(w->reply_subject);
        snprintf(agent, sizeof(agent), "%s", w->agent_id);
        exec = true;
    } else {
        const char *s = ks_map_get(&b->live, ev->command_id);
        if (s)
            subject = strdup(s);
    }
    pthread_mutex_unlock(&b->mu);
    if (!subject) {
        /* Perhaps followed through another broker (notice.c). */
        broker__remote_forward(b, ev);
        return;
    }
    broker__live_send(b, subject, exec, agent, ev);
    free(subject);
}

void
broker__live_add(struct broker *b, const char *command_id,
                 const char *subject)
{
    char *s = strdup(subject), *old;
    bool added;
    if (!s)
        return;
    pthread_mutex_lock(&b->mu);
    old = ks_map_del(&b->live, command_id);
    added = ks_map_put(&b->live, command_id, s) == 0;
    pthread_mutex_unlock(&b->mu);
    /* New here (it is added again at every tick): the pieces another
     * broker records come here too. */
    if (added && (!old || strcmp(old, subject) != 0))
        broker__notice_follow(b, command_id, false, subject, "");
    if (!added)
        free(s);
    free(old);
}

bool
broker__live_end(struct broker *b, const char *command_id)
{
    pthread_mutex_lock(&b->mu);
    char *s = ks_map_del(&b->live, command_id);
    pthread_mutex_unlock(&b->mu);
    bool had = s != NULL;
    free(s);
    return had;
}

/* Reads one whole stream: max bytes from 0 (what chunked_bytes says). */
static int
read_whole(struct store *st, const char *command_id, uint32_t stream,
           uint64_t want, Ks__Output *o)
{
    uint8_t *data = NULL;
    size_t len = 0;
    int rc = store_read_output(st, command_id, stream, 0, (size_t)want, &data,
                               &len);
    if (rc)
        return rc;
    if (len < want) {
        /* A piece not recorded yet (another broker's recorder): what
         * there is, and say nothing more than the record holds. */
    }
    free(o->data.data);
    o->data.data = data;
    o->data.len = len;
    return 0;
}

int
broker__fill_output(struct store *st, const char *command_id,
                    Ks__CommandResult *r)
{
    int rc = 0;
    if (!r)
        return 0;
    uint64_t total = (r->stdout ? r->stdout->chunked_bytes : 0) +
                     (r->stderr ? r->stderr->chunked_bytes : 0);
    if (total > BROKER_WHOLE_OUTPUT_MAX)
        return 0; /* too large for one reply: chunked_bytes says, logs pages */
    if (r->stdout && r->stdout->chunked_bytes && !r->stdout->data.len)
        rc = read_whole(st, command_id, 1, r->stdout->chunked_bytes,
                        r->stdout);
    if (rc == 0 && r->stderr && r->stderr->chunked_bytes &&
        !r->stderr->data.len)
        rc = read_whole(st, command_id, 2, r->stderr->chunked_bytes,
                        r->stderr);
    return rc;
}

/* Bytes of one stream from off: inline data of a result, or pieces. */
static int
read_range(struct store *st, const char *command_id, uint32_t stream,
           const Ks__Output *o, bool ended, uint64_t off, size_t max,
           ProtobufCBinaryData *out, uint64_t *next)
{
    *next = off;
    out->data = NULL;
    out->len = 0;
    if (ended && o && (o->data.len || !o->chunked_bytes)) {
        /* Short output: all of it is in the result. */
        if (off < o->data.len) {
            size_t n = o->data.len - (size_t)off;
            if (n > max)
                n = max;
            out->data = malloc(n ? n : 1);
            if (!out->data)
                return -ENOMEM;
            memcpy(out->data, o->data.data + off, n);
            out->len = n;
            *next = off + n;
        }
        return 0;
    }
    uint8_t *d = NULL;
    size_t len = 0;
    int rc = store_read_output(st, command_id, stream, off, max, &d, &len);
    if (rc)
        return rc;
    out->data = d;
    out->len = len;
    *next = off + len;
    return 0;
}

void
broker__handle_logs(struct broker *b, natsMsg *msg)
{
    Ks__LogsRequest *req = NULL;
    Ks__LogsReply r = KS__LOGS_REPLY__INIT;
    Ks__CommandView *v = NULL;
    char why[600], sid[64];
    int rc;

    rc = broker__unpack_request(msg, &ks__logs_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        broker__reply_error(b, msg, r.base.descriptor, rc, why);
        return;
    }
    if (!ks_is_uuid(req->command_id)) {
        broker__reply_error(b, msg, r.base.descriptor, KS_EINVAL,
                            "not a command id (a UUID)");
        goto out;
    }
    snprintf(sid, sizeof(sid), "command-%s", req->command_id);
    if (broker__may_read(b, b->st_misc, msg, sid, why, sizeof(why)) != 0) {
        broker__reply_error(b, msg, r.base.descriptor, KS_EDENIED, why);
        goto out;
    }
    rc = store_get_command(b->st_misc, req->command_id, &v);
    if (rc) {
        broker__reply_error(
            b, msg, r.base.descriptor, rc,
            rc == KS_ENOTFOUND
                ? "no command with this id"
                : broker__store_error(b->st_misc, rc, why, sizeof(why)));
        goto out;
    }
    bool ended = kproto_status_terminal(v->status);
    size_t max = req->max_bytes ? req->max_bytes : LOGS_PAGE_DEFAULT;
    if (max > LOGS_PAGE_MAX)
        max = LOGS_PAGE_MAX;
    const Ks__Output *o = v->result ? v->result->stdout : NULL;
    const Ks__Output *e = v->result ? v->result->stderr : NULL;
    r.stdout_next = req->stdout_offset;
    r.stderr_next = req->stderr_offset;
    if (!req->no_stdout)
        rc = read_range(b->st_misc, req->command_id, 1, o, ended,
                        req->stdout_offset, max, &r.stdout, &r.stdout_next);
    if (rc == 0 && !req->no_stderr)
        rc = read_range(b->st_misc, req->command_id, 2, e, ended,
                        req->stderr_offset, max - r.stdout.len, &r.stderr,
                        &r.stderr_next);
    if (rc) {
        r.error_code = rc;
        r.error = (char *)broker__store_error(b->st_misc, rc, why,
                                              sizeof(why));
    }
    r.status = v->status;
    r.agent_id = v->agent_id;
    if (ended) {
        /* Ended, and nothing more to read of what was asked. */
        uint64_t out_end = o ? (o->data.len ? o->data.len : o->chunked_bytes)
                             : 0;
        uint64_t err_end = e ? (e->data.len ? e->data.len : e->chunked_bytes)
                             : 0;
        r.ended = (req->no_stdout || r.stdout_next >= out_end) &&
                  (req->no_stderr || r.stderr_next >= err_end);
        if (v->result) {
            /* The result without its bytes (they are what pages carry). */
            if (v->result->stdout) {
                free(v->result->stdout->data.data);
                v->result->stdout->data.data = NULL;
                v->result->stdout->data.len = 0;
            }
            if (v->result->stderr) {
                free(v->result->stderr->data.data);
                v->result->stderr->data.data = NULL;
                v->result->stderr->data.len = 0;
            }
            v->result->status = v->status;
            r.result = v->result;
        }
    }
    evt_publish_reply(b->nc, natsMsg_GetReply(msg), &r.base);
    free(r.stdout.data);
    free(r.stderr.data);
out:
    if (v)
        ks__command_view__free_unpacked(v, NULL);
    if (req)
        ks__logs_request__free_unpacked(req, NULL);
}
