/*
 * reply.c: what every part of the broker builds its answers and records
 * from: a new event's envelope, a request unpacked and checked, an error
 * or a piece of live output sent to a client, a store error in words.
 * The bottom of the broker: it calls no other file of it but validate.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

void
broker__event_init(Ks__Event *ev, char event_id[37], char *stream_id,
                   const char *type, const char *command_id)
{
    ks__event__init(ev);
    ks_uuid(event_id);
    ev->event_id = event_id;
    ev->stream_id = stream_id;
    ev->type = (char *)type;
    ev->occurred_at_us = ks_now_us();
    ev->command_id = (char *)(command_id ? command_id : "");
}

void
broker__reply_msg(struct broker *b, const char *subject,
                  const ProtobufCMessage *m)
{
    if (!subject || !subject[0])
        return;
    /* In parts when larger than one NATS message (the requester puts
     * them back together). */
    int rc = evt_publish_reply(b->nc, subject, m);
    if (rc)
        ks_log(KS_LOG_WARN, "cannot reply", KS_S("subject", subject),
               KS_ERR(rc));
}

/* What a client is told of a store error (broker__store_error). */
static const char *
store_error_text(int rc, const char *sqlstate, const char *why, char *buf,
                 size_t len)
{
    if (rc == KS_EPGDOWN)
        snprintf(buf, len, "PostgreSQL unreachable: %s",
                 why[0] ? why : "no connection");
    else if (rc == KS_EPGREFUSED) {
        const char *name = store_sqlstate_name(sqlstate);
        snprintf(buf, len, "PostgreSQL refuses writes (SQLSTATE %s%s%s): %s",
                 sqlstate, name[0] ? " " : "", name, why);
    }
    else if (rc == KS_EPG && why[0])
        snprintf(buf, len, "PostgreSQL error: %s", why);
    else
        snprintf(buf, len, "%s", ks_strerror(rc));
    return buf;
}

const char *
broker__store_error(struct store *st, int rc, char *buf, size_t len)
{
    return store_error_text(rc, store_last_sqlstate(st), store_last_error(st),
                            buf, len);
}

const char *
broker__write_error(const struct store_write_result *res, int rc, char *buf,
                    size_t len)
{
    return store_error_text(rc, res->sqlstate, res->error, buf, len);
}

void
broker__reply_error(struct broker *b, natsMsg *msg,
                    const ProtobufCMessageDescriptor *d, int code,
                    const char *text)
{
    /* Every kscore reply carries error_code (1) and error (2): set them
     * through the descriptor, so one function answers for every method. */
    const ProtobufCFieldDescriptor *fc =
        protobuf_c_message_descriptor_get_field(d, 1);
    const ProtobufCFieldDescriptor *ft =
        protobuf_c_message_descriptor_get_field(d, 2);
    ProtobufCMessage *m = calloc(1, d->sizeof_message);
    BUG_ON(!fc || !ft || strcmp(fc->name, "error_code") != 0 ||
           strcmp(ft->name, "error") != 0);
    if (!m)
        return;
    d->message_init(m);
    *(int32_t *)((char *)m + fc->offset) = code;
    *(const char **)((char *)m + ft->offset) = text ? text : "";
    broker__reply_msg(b, natsMsg_GetReply(msg), m);
    free(m);
}

int
broker__is_method(const char *subject, const char *method)
{
    size_t n = strlen(method);
    return strncmp(subject, method, n) == 0 &&
           (subject[n] == '\0' || subject[n] == '.');
}

const char *
broker__operator_of(natsMsg *msg)
{
    const char *subj = natsMsg_GetSubject(msg);
    const char *dot = strrchr(subj, '.');
    /* "kscore.api.v1.<method>.<operator>": 5 tokens; a claim asked again
     * has one more, "kscore.api.v1.claim.again.<agent>" (an operator may
     * publish 5 tokens only, an agent this subject under its own name
     * only: deploy/nats-auth.conf.in). */
    int dots = 0, want = 4;
    for (const char *p = subj; *p; p++)
        dots += *p == '.';
    if (strncmp(subj, EVT_API_CLAIM_AGAIN ".",
                sizeof(EVT_API_CLAIM_AGAIN)) == 0)
        want = 5;
    return dots == want && dot ? dot + 1 : "anonymous";
}

int
broker__is_batch_id(const char *id)
{
    return strncmp(id, "batch-", 6) == 0 && ks_is_uuid(id + 6);
}

int
broker__unpack_request(natsMsg *msg, const ProtobufCMessageDescriptor *desc,
                       ProtobufCMessage **out, char *why, size_t len)
{
    ProtobufCMessage *m = NULL;
    int rc;

    why[0] = '\0';
    rc = evt_unpack_why(desc, natsMsg_GetData(msg),
                        (size_t)natsMsg_GetDataLength(msg), &m, why, len);
    if (rc == 0)
        rc = broker_check_request(m, broker__operator_of(msg), why, len);
    if (rc && !why[0])
        snprintf(why, len, "bad %s: %s", desc->short_name, ks_strerror(rc));
    if (rc) {
        if (m)
            protobuf_c_message_free_unpacked(m, NULL);
        return rc;
    }
    *out = m;
    return 0;
}

void
broker__live_send(struct broker *b, const char *subject, bool exec,
                  const char *agent_id, const Ks__Event *ev)
{
    Ks__OutputChunk *cs[1] = {ev->chunk};
    if (exec) {
        Ks__ExecuteReply r = KS__EXECUTE_REPLY__INIT;
        r.command_id = ev->command_id;
        r.agent_id = (char *)agent_id;
        r.chunks = cs;
        r.n_chunks = 1;
        evt_publish_msg(b->nc, subject, &r.base);
    } else {
        Ks__BatchProgress pr = KS__BATCH_PROGRESS__INIT;
        Ks__BatchTarget tg = KS__BATCH_TARGET__INIT;
        tg.agent_id = ev->agent_id;
        tg.command_id = ev->command_id;
        pr.batch_id = ev->batch_id;
        pr.target = &tg;
        pr.chunks = cs;
        pr.n_chunks = 1;
        evt_publish_msg(b->nc, subject, &pr.base);
    }
}
