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

int
broker__admit_output(const struct store_command_state *st,
                     const struct store_output_chunk *c, const char **why,
                     void *ud)
{
    (void)ud;
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
