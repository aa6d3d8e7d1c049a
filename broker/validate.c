/*
 * validate.c: the rules every request field must meet before the broker
 * records or does anything (the README's "Request fields" table is this
 * table). The wire check (events/wire.c) has already refused a NUL or
 * invalid UTF-8 in any string; these are the per-field rules: lengths,
 * counts, ranges, ids, and anything that becomes a subject.
 *
 * The walk visits every field of the request and of the messages inside
 * it, so a field without a rule of its own still meets the defaults (a
 * string at most DEFAULT_MAX_BYTES, a repeated field at most
 * DEFAULT_MAX_COUNT elements). Pure; any thread.
 */
#include <stdio.h>
#include <string.h>

#include "broker_int.h"

#define DEFAULT_MAX_BYTES 4096
#define DEFAULT_MAX_COUNT 4096

enum rule_kind {
    R_BYTES,      /* string length in [lo, hi] bytes */
    R_COUNT,      /* repeated: element count in [lo, hi] */
    R_RANGE,      /* integer in [lo, hi] */
    R_UUID,       /* a UUID in text form, or "" when lo == 0 */
    R_AGENT_ID,   /* evt_agent_id_valid() */
    R_ENV_NAME,   /* a POSIX name, not KSCORE_* */
    R_LABEL_KEY,  /* letters, digits, '_', '-', '.', '/' */
    R_ABS_PATH,   /* "" or an absolute path */
    R_ID,         /* a command id or batch-<uuid> */
    R_STREAM_ID,  /* "" or <category>-<id> of printable ASCII */
    R_INBOX,      /* "" or "_INBOX.<identity>." + subject tokens */
};

struct rule {
    const char *msg;   /* message short name */
    const char *field; /* field name */
    enum rule_kind kind;
    uint64_t lo, hi;
    const char *says;  /* the rule in words, for the error */
};

/* Keep in step with README.md "Request fields". */
static const struct rule rules[] = {
    {"ExecuteRequest", "agent_id", R_AGENT_ID, 0, 0,
     "1-128 letters, digits, _ and -"},
    {"ExecuteRequest", "idempotency_key", R_BYTES, 0, 128,
     "at most 128 bytes"},
    {"ExecuteRequest", "deliver_within_ms", R_RANGE, 0, 86400000,
     "at most 24 h (86400000 ms)"},
    {"CommandSpec", "argv", R_COUNT, 1, 4096, "1 to 4096 elements"},
    {"CommandSpec", "argv", R_BYTES, 0, 131072,
     "each at most 128 KiB (the kernel's MAX_ARG_STRLEN)"},
    {"CommandSpec", "env", R_COUNT, 0, 1024, "at most 1024 variables"},
    {"CommandSpec", "cwd", R_ABS_PATH, 0, 4095,
     "empty or an absolute path of at most 4095 bytes"},
    {"CommandSpec", "timeout_ms", R_RANGE, 0, 2592000000ULL,
     "at most 30 days (2592000000 ms)"},
    {"CommandSpec", "grace_ms", R_RANGE, 0, 3600000,
     "at most 1 h (3600000 ms)"},
    {"CommandSpec", "stdout_cap_bytes", R_RANGE, 0, EXEC_OUTPUT_CAP_MAX,
     "at most the output cap maximum"},
    {"CommandSpec", "stderr_cap_bytes", R_RANGE, 0, EXEC_OUTPUT_CAP_MAX,
     "at most the output cap maximum"},
    {"EnvVar", "name", R_BYTES, 1, 256, "1 to 256 bytes"},
    {"EnvVar", "value", R_BYTES, 0, 131072, "at most 128 KiB"},
    {"BatchRequest", "agents", R_COUNT, 0, 100000,
     "at most 100000 agents"},
    {"BatchRequest", "agents", R_AGENT_ID, 0, 0,
     "each 1-128 letters, digits, _ and -"},
    {"BatchRequest", "select", R_COUNT, 0, 64, "at most 64 label pairs"},
    {"BatchRequest", "deliver_within_ms", R_RANGE, 0, 86400000,
     "at most 24 h (86400000 ms)"},
    {"BatchRequest", "progress_subject", R_INBOX, 0, 0,
     "empty or a subject under the caller's own inbox "
     "(_INBOX.<identity>.)"},
    {"Amount", "value", R_RANGE, 0, 1000000, "at most 1000000"},
    {"ClaimRequest", "command_id", R_UUID, 1, 0, "a UUID"},
    {"ClaimRequest", "event_id", R_UUID, 1, 0, "a UUID"},
    {"ClaimRequest", "agent_id", R_AGENT_ID, 0, 0,
     "1-128 letters, digits, _ and -"},
    {"ClaimRequest", "attempt", R_RANGE, 1, 1000, "1 to 1000"},
    {"ClaimRequest", "expected_version", R_RANGE, 1, (1ULL << 62),
     "a stream version (1 to 2^62)"},
    {"GetRequest", "id", R_ID, 0, 0, "a command id (UUID) or batch-<uuid>"},
    {"CancelRequest", "id", R_ID, 0, 0,
     "a command id (UUID) or batch-<uuid>"},
    {"EventsRequest", "stream_id", R_STREAM_ID, 0, 200,
     "empty or <category>-<id>, at most 200 bytes"},
    {"EventsRequest", "after_version", R_RANGE, 0, (1ULL << 62),
     "0 to 2^62"},
    {"EventsRequest", "limit", R_RANGE, 0, 10000, "at most 10000"},
    {"EventsRequest", "wait_ms", R_RANGE, 0, 5000, "at most 5000 ms"},
};

static bool
label_key_ok(const char *s)
{
    if (!*s)
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
              (*s >= '0' && *s <= '9') || *s == '_' || *s == '-' ||
              *s == '.' || *s == '/'))
            return false;
    return true;
}

static bool
env_name_ok(const char *n)
{
    bool ok = (n[0] >= 'A' && n[0] <= 'Z') || (n[0] >= 'a' && n[0] <= 'z') ||
              n[0] == '_';
    for (const char *c = n; ok && *c; c++)
        ok = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') ||
             (*c >= '0' && *c <= '9') || *c == '_';
    return ok && strncmp(n, "KSCORE_", 7) != 0;
}

/* A subject token: no wildcard, separator or whitespace. */
static bool
subject_ok(const char *s)
{
    if (!*s || *s == '.')
        return false;
    for (const char *p = s; *p; p++) {
        if (*p == '*' || *p == '>' || *p == ' ' || *p == '\t' ||
            *p == '\r' || *p == '\n' || (unsigned char)*p < 0x20 ||
            (unsigned char)*p >= 0x7f)
            return false;
        if (*p == '.' && (p[1] == '.' || p[1] == '\0'))
            return false;
    }
    return true;
}

bool
broker__inbox_of(const char *subject, const char *identity)
{
    size_t n = strlen(identity);
    return subject && strncmp(subject, "_INBOX.", 7) == 0 &&
           strncmp(subject + 7, identity, n) == 0 && subject[7 + n] == '.' &&
           subject[8 + n] != '\0' && subject_ok(subject);
}

static int
check_string(const struct rule *r, const char *v, const char *identity,
             char *why, size_t len, const char *where)
{
    size_t n = strlen(v);
    bool ok = true;

    switch (r->kind) {
    case R_BYTES:
        ok = n >= r->lo && n <= r->hi;
        break;
    case R_UUID:
        ok = (r->lo == 0 && n == 0) || ks_is_uuid(v);
        break;
    case R_AGENT_ID:
        ok = evt_agent_id_valid(v);
        break;
    case R_ENV_NAME:
        ok = env_name_ok(v);
        break;
    case R_LABEL_KEY:
        ok = label_key_ok(v);
        break;
    case R_ABS_PATH:
        ok = n <= r->hi && (n == 0 || v[0] == '/');
        break;
    case R_ID:
        ok = ks_is_uuid(v) || (strncmp(v, "batch-", 6) == 0 &&
                               ks_is_uuid(v + 6));
        break;
    case R_STREAM_ID:
        ok = n <= r->hi && (n == 0 || (strchr(v, '-') && subject_ok(v)));
        break;
    case R_INBOX:
        ok = n == 0 || broker__inbox_of(v, identity);
        break;
    default:
        return 0;
    }
    if (ok)
        return 0;
    snprintf(why, len, "%s: '%.48s%s' is not allowed: %s", where, v,
             n > 48 ? "..." : "", r->says);
    return KS_EINVAL;
}

/* Rules across fields of one message. */
static int
check_whole(const ProtobufCMessage *m, const char *path, char *why,
            size_t len)
{
    if (m->descriptor == &ks__amount__descriptor) {
        const Ks__Amount *a = (const Ks__Amount *)m;
        if (a->percent && a->value > 100) {
            snprintf(why, len, "%s.value: %u%% is not allowed: a "
                     "percentage is at most 100", path, a->value);
            return KS_EINVAL;
        }
    }
    return 0;
}

static int
walk(const ProtobufCMessage *m, const char *identity, char *path,
     size_t path_len, size_t path_cap, char *why, size_t len, int depth)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    int wrc;

    if (depth > 8)
        return KS_EINVAL;
    if ((wrc = check_whole(m, path, why, len)))
        return wrc;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *member = (const char *)m + f->offset;
        bool repeated = f->label == PROTOBUF_C_LABEL_REPEATED;
        size_t count = repeated ? *(const size_t *)((const char *)m +
                                                    f->quantifier_offset)
                                : 1;
        const struct rule *mine[4];
        size_t nmine = 0;
        bool has_bytes = false, has_count = false;
        char where[320];
        int rc;

        snprintf(where, sizeof(where), "%s%s%s", path, path_len ? "." : "",
                 f->name);
        for (size_t k = 0; k < sizeof(rules) / sizeof(rules[0]); k++)
            if (strcmp(rules[k].msg, d->short_name) == 0 &&
                strcmp(rules[k].field, f->name) == 0 && nmine < 4) {
                mine[nmine++] = &rules[k];
                has_bytes |= rules[k].kind != R_COUNT &&
                             rules[k].kind != R_RANGE;
                has_count |= rules[k].kind == R_COUNT;
            }
        if (repeated && !has_count && count > DEFAULT_MAX_COUNT) {
            snprintf(why, len, "%s: %zu elements, at most %d", where, count,
                     DEFAULT_MAX_COUNT);
            return KS_EINVAL;
        }
        for (size_t k = 0; k < nmine; k++)
            if (mine[k]->kind == R_COUNT &&
                (count < mine[k]->lo || count > mine[k]->hi)) {
                snprintf(why, len, "%s: %zu elements: %s", where, count,
                         mine[k]->says);
                return KS_EINVAL;
            }
        for (size_t j = 0; j < count; j++) {
            const void *elem =
                repeated ? (const char *)*(void *const *)member +
                               j * (f->type == PROTOBUF_C_TYPE_STRING ||
                                            f->type == PROTOBUF_C_TYPE_MESSAGE
                                        ? sizeof(void *)
                                    : f->type == PROTOBUF_C_TYPE_UINT64 ||
                                            f->type == PROTOBUF_C_TYPE_INT64
                                        ? 8
                                        : 4)
                         : (const void *)member;
            char ewhere[352];
            if (repeated)
                snprintf(ewhere, sizeof(ewhere), "%s[%zu]", where, j);
            else
                snprintf(ewhere, sizeof(ewhere), "%s", where);
            switch (f->type) {
            case PROTOBUF_C_TYPE_STRING: {
                const char *v = *(const char *const *)elem;
                if (!v)
                    break;
                if (!has_bytes && strlen(v) > DEFAULT_MAX_BYTES) {
                    snprintf(why, len, "%s: %zu bytes, at most %d", ewhere,
                             strlen(v), DEFAULT_MAX_BYTES);
                    return KS_EINVAL;
                }
                for (size_t k = 0; k < nmine; k++)
                    if ((rc = check_string(mine[k], v, identity, why, len,
                                           ewhere)))
                        return rc;
                break;
            }
            case PROTOBUF_C_TYPE_UINT32:
            case PROTOBUF_C_TYPE_INT32:
            case PROTOBUF_C_TYPE_UINT64:
            case PROTOBUF_C_TYPE_INT64: {
                int64_t sv = 0;
                uint64_t uv = 0;
                bool neg = false;
                if (f->type == PROTOBUF_C_TYPE_UINT32)
                    uv = *(const uint32_t *)elem;
                else if (f->type == PROTOBUF_C_TYPE_UINT64)
                    uv = *(const uint64_t *)elem;
                else {
                    sv = f->type == PROTOBUF_C_TYPE_INT32
                             ? *(const int32_t *)elem
                             : *(const int64_t *)elem;
                    neg = sv < 0;
                    uv = neg ? 0 : (uint64_t)sv;
                }
                for (size_t k = 0; k < nmine; k++)
                    if (mine[k]->kind == R_RANGE &&
                        (neg || uv < mine[k]->lo || uv > mine[k]->hi)) {
                        snprintf(why, len, "%s: %s%llu is out of range: %s",
                                 ewhere, neg ? "-" : "",
                                 neg ? (unsigned long long)-(sv + 1) + 1
                                     : (unsigned long long)uv,
                                 mine[k]->says);
                        return KS_EINVAL;
                    }
                break;
            }
            case PROTOBUF_C_TYPE_MESSAGE: {
                const ProtobufCMessage *sub =
                    *(const ProtobufCMessage *const *)elem;
                if (sub && (rc = walk(sub, identity, ewhere, strlen(ewhere),
                                      sizeof(ewhere), why, len, depth + 1)))
                    return rc;
                break;
            }
            default:
                break;
            }
        }
    }
    (void)path_cap;
    return 0;
}

int
broker_check_request(const ProtobufCMessage *m, const char *identity,
                      char *why, size_t len)
{
    char path[320];
    snprintf(path, sizeof(path), "%s", m->descriptor->short_name);
    return walk(m, identity ? identity : "", path, strlen(path),
                sizeof(path), why, len, 0);
}
