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
    while (p < end) {
        uint64_t tag, n;
        if (varint(&p, end, &tag))
            return KS_EDECODE; /* protobuf-c says why: malformed */
        switch (tag & 7) {
        case 0:
            if (varint(&p, end, &n))
                return KS_EDECODE;
            continue;
        case 1:
            if ((size_t)(end - p) < 8)
                return KS_EDECODE;
            p += 8;
            continue;
        case 5:
            if ((size_t)(end - p) < 4)
                return KS_EDECODE;
            p += 4;
            continue;
        case 2:
            break;
        default:
            return KS_EDECODE; /* groups: not in kscore.proto */
        }
        if (varint(&p, end, &n) || n > (uint64_t)(end - p))
            return KS_EDECODE;
        const ProtobufCFieldDescriptor *f =
            tag >> 3 <= UINT32_MAX
                ? protobuf_c_message_descriptor_get_field(d,
                                                          (unsigned)(tag >> 3))
                : NULL;
        if (f) {
            size_t at = path_len;
            int w = snprintf(path + at, path_cap - at, "%s%s",
                             at ? "." : "", f->name);
            size_t sub_len = w > 0 && (size_t)w < path_cap - at
                                 ? at + (size_t)w
                                 : at;
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                if (memchr(p, '\0', (size_t)n)) {
                    snprintf(why, why_len,
                             "%s: contains a NUL byte (kscore text never "
                             "does)",
                             path);
                    return KS_EINVAL;
                }
                if (!utf8_valid(p, (size_t)n)) {
                    snprintf(why, why_len, "%s: not valid UTF-8", path);
                    return KS_EINVAL;
                }
            } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
                int rc = check(f->descriptor, p, (size_t)n, depth + 1, path,
                               sub_len, path_cap, why, why_len);
                if (rc)
                    return rc;
            }
            path[at] = '\0';
        }
        p += n;
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
