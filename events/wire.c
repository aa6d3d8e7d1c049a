/*
 * wire.c: what every string of every kscore message may hold, checked on
 * the wire before protobuf-c decodes it.
 *
 * protobuf-c 1.4.1 hands a string field to C as a NUL-terminated copy, so
 * a NUL inside it (legal on the wire) silently cuts the string: an argv
 * element "abc\0def" would be recorded and signed as "abc\0def" but run as
 * "abc". proto3 also requires string fields to be valid UTF-8 (protobuf
 * language guide, "Scalar Value Types"), and PostgreSQL's text refuses
 * anything else. So the raw bytes of each string field, at any depth, are
 * checked here, where the field's name is still known.
 */
#include <stdio.h>
#include <string.h>

#include "events.h"

/* Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, <= U+10FFFF. */
static bool
utf8_valid(const uint8_t *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = p[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            cp = c & 0x07;
        } else {
            return false;
        }
        if (n - i < len)
            return false;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
            return false;
        i += len;
    }
    return true;
}

/* Reads a varint at *p (< end); 0 or -1 when malformed. */
static int
varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

int
evt_wire_next(const uint8_t **p, const uint8_t *end, struct evt_wire_field *f)
{
    uint64_t tag, n;
    if (*p >= end)
        return 1;
    if (varint(p, end, &tag) || tag >> 3 == 0 || tag >> 3 > UINT32_MAX)
        return KS_EDECODE;
    f->number = (uint32_t)(tag >> 3);
    f->type = (unsigned)(tag & 7);
    f->value = 0;
    f->data = NULL;
    f->len = 0;
    switch (f->type) {
    case 0:
        return varint(p, end, &f->value) ? KS_EDECODE : 0;
    case 1:
    case 5:
        n = f->type == 1 ? 8 : 4;
        break;
    case 2:
        if (varint(p, end, &n))
            return KS_EDECODE;
        break;
    default:
        return KS_EDECODE; /* groups: not in kscore.proto */
    }
    if (n > (uint64_t)(end - *p))
        return KS_EDECODE;
    f->data = *p;
    f->len = (size_t)n;
    *p += n;
    return 0;
}

static int
check(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t len,
      int depth, char *path, size_t path_len, size_t path_cap, char *why,
      size_t why_len)
{
    if (len == 0)
        return 0; /* p may be NULL: no pointer arithmetic on it */
    const uint8_t *end = p + len;

    if (depth > 16)
        return KS_EDECODE;
    for (;;) {
        struct evt_wire_field fl;
        int rc = evt_wire_next(&p, end, &fl);
        if (rc == 1)
            break;
        if (rc)
            return KS_EDECODE; /* malformed: the message is refused */
        if (fl.type != 2)
            continue;
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(d, fl.number);
        if (!f)
            continue;
        size_t at = path_len;
        int w = snprintf(path + at, path_cap - at, "%s%s", at ? "." : "",
                         f->name);
        size_t sub_len =
            w > 0 && (size_t)w < path_cap - at ? at + (size_t)w : at;
        if (f->type == PROTOBUF_C_TYPE_STRING) {
            if (memchr(fl.data, '\0', fl.len)) {
                snprintf(why, why_len,
                         "%s: contains a NUL byte (kscore text never "
                         "does)",
                         path);
                return KS_EINVAL;
            }
            if (!utf8_valid(fl.data, fl.len)) {
                snprintf(why, why_len, "%s: not valid UTF-8", path);
                return KS_EINVAL;
            }
        } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
            rc = check(f->descriptor, fl.data, fl.len, depth + 1, path,
                       sub_len, path_cap, why, why_len);
            if (rc)
                return rc;
        }
        path[at] = '\0';
    }
    return 0;
}

int
evt_check_wire(const ProtobufCMessageDescriptor *desc, const void *data,
               size_t len, char *why, size_t why_len)
{
    char path[256] = "", inner[320] = "";
    int rc = check(desc, data, len, 0, path, 0, sizeof(path), inner,
                   sizeof(inner));
    if (rc == KS_EINVAL && why)
        snprintf(why, why_len, "%s.%s", desc->short_name, inner);
    return rc;
}
