/*
 * Fuzzes the request boundary: evt_unpack_why() (no NUL, valid UTF-8 in
 * any string) then broker_check_request() (every field's rule), for each
 * API request type (the first input byte picks it, the rest is the
 * message). What is accepted is checked again here, independently:
 * strings are NUL-free UTF-8 of bounded length, ids are ids, a subject the
 * broker would publish to is under the caller's own inbox; what is refused
 * says which field.
 */
#include <stdio.h>
#include <string.h>

#include "broker.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define IDENTITY "fuzzop"

static const ProtobufCMessageDescriptor *const descs[] = {
    &ks__execute_request__descriptor, &ks__batch_request__descriptor,
    &ks__claim_request__descriptor,   &ks__get_request__descriptor,
    &ks__cancel_request__descriptor,  &ks__events_request__descriptor,
    &ks__list_request__descriptor,
};

static bool
utf8_ok(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int n = *p < 0x80 ? 1 : (*p >> 5) == 6 ? 2 : (*p >> 4) == 14 ? 3
                : (*p >> 3) == 30                  ? 4
                                                   : 0;
        if (!n)
            return false;
        for (int k = 1; k < n; k++)
            if ((p[k] & 0xC0) != 0x80)
                return false;
        p += n;
    }
    return true;
}

static void
check_strings(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *member = (const char *)m + f->offset;
        size_t n = f->label == PROTOBUF_C_LABEL_REPEATED
                       ? *(const size_t *)((const char *)m +
                                           f->quantifier_offset)
                       : 1;
        for (size_t j = 0; j < n; j++) {
            const void *e = f->label == PROTOBUF_C_LABEL_REPEATED
                                ? (const char *)*(void *const *)member +
                                      j * sizeof(void *)
                                : (const void *)member;
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                const char *s = *(const char *const *)e;
                if (s && (strlen(s) > 131072 || !utf8_ok(s)))
                    fuzz_die("accepted a long or non-UTF-8 string");
            } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
                const ProtobufCMessage *sub =
                    *(const ProtobufCMessage *const *)e;
                if (sub)
                    check_strings(sub);
            }
        }
    }
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ProtobufCMessage *m = NULL;
    char why[512] = "";

    if (size < 1)
        return 0;
    const ProtobufCMessageDescriptor *d =
        descs[data[0] % (sizeof(descs) / sizeof(descs[0]))];
    int rc = evt_unpack_why(d, data + 1, size - 1, &m, why, sizeof(why));
    if (rc == KS_EINVAL) {
        if (m || strncmp(why, d->short_name, strlen(d->short_name)) != 0)
            fuzz_die("a wire refusal that names no field");
        return 0;
    }
    if (rc)
        return 0;
    why[0] = '\0';
    rc = broker_check_request(m, IDENTITY, why, sizeof(why));
    if (rc) {
        if (rc != KS_EINVAL || !why[0] ||
            strncmp(why, d->short_name, strlen(d->short_name)) != 0)
            fuzz_die("a field refusal that names no field");
    } else {
        check_strings(m);
        if (d == &ks__execute_request__descriptor) {
            const Ks__ExecuteRequest *r = (const Ks__ExecuteRequest *)m;
            if (!evt_agent_id_valid(r->agent_id))
                fuzz_die("accepted a bad agent id");
            if (strlen(r->idempotency_key) > 128)
                fuzz_die("accepted a long idempotency key");
            if (r->spec && r->spec->cwd[0] && r->spec->cwd[0] != '/')
                fuzz_die("accepted a relative cwd");
        } else if (d == &ks__batch_request__descriptor) {
            const Ks__BatchRequest *r = (const Ks__BatchRequest *)m;
            if (r->progress_subject[0] &&
                (strncmp(r->progress_subject, "_INBOX." IDENTITY ".",
                         strlen("_INBOX." IDENTITY ".")) != 0 ||
                 strpbrk(r->progress_subject, "*> \t\r\n")))
                fuzz_die("accepted a progress subject outside the inbox");
            for (size_t i = 0; i < r->n_agents; i++)
                if (!evt_agent_id_valid(r->agents[i]))
                    fuzz_die("accepted a bad target id");
        } else if (d == &ks__claim_request__descriptor) {
            const Ks__ClaimRequest *r = (const Ks__ClaimRequest *)m;
            if (!ks_is_uuid(r->command_id) || !ks_is_uuid(r->event_id) ||
                !evt_agent_id_valid(r->agent_id))
                fuzz_die("accepted a claim with bad ids");
        } else if (d == &ks__get_request__descriptor ||
                   d == &ks__cancel_request__descriptor) {
            const char *id = d == &ks__get_request__descriptor
                                 ? ((const Ks__GetRequest *)m)->id
                                 : ((const Ks__CancelRequest *)m)->id;
            if (!ks_is_uuid(id) &&
                !(strncmp(id, "batch-", 6) == 0 && ks_is_uuid(id + 6)))
                fuzz_die("accepted a bad id");
        } else if (d == &ks__list_request__descriptor) {
            const Ks__ListRequest *r = (const Ks__ListRequest *)m;
            if (r->limit > 1000 || r->n_agents > 64 || r->n_statuses > 32)
                fuzz_die("accepted an oversized list request");
            for (size_t i = 0; i < r->n_agents; i++)
                if (!evt_agent_id_valid(r->agents[i]))
                    fuzz_die("accepted a bad agent id in a list request");
        }
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
