/*
 * validate.c: the rules every request field must meet before the broker
 * records or does anything (docs/security.md "Untrusted input": its table
 * is this table). The wire check (events/wire.c) has already refused a NUL or
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

#include <openssl/evp.h>

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
    R_BLOB,       /* bytes: length in [lo, hi] */
    R_USER,       /* "" or USER[:GROUP] (user_spec_ok) */
    R_BASE_NAME,  /* a file name: no '/', not "." or ".." */
};

struct rule {
    const char *msg;   /* message short name */
    const char *field; /* field name */
    enum rule_kind kind;
    uint64_t lo, hi;
    const char *says;  /* the rule in words, for the error */
};

/* Keep in step with docs/security.md "Untrusted input". */
static const struct rule rules[] = {
    {"ExecuteRequest", "agent_id", R_AGENT_ID, 0, 0,
     "1-128 letters, digits, _ and -"},
    {"ExecuteRequest", "idempotency_key", R_BYTES, 0, 128,
     "at most 128 bytes"},
    {"ExecuteRequest", "deliver_within_ms", R_RANGE, 0,
     EVT_DELIVER_WITHIN_MAX_MS,
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
    {"CommandSpec", "sealed_env", R_COUNT, 0, 100000,
     "at most 100000 sealed values (each variable once per target)"},
    {"EnvVar", "name", R_BYTES, 1, 256, "1 to 256 bytes"},
    {"EnvVar", "value", R_BYTES, 0, 131072, "at most 128 KiB"},
    {"SealedEnv", "name", R_BYTES, 1, 256, "1 to 256 bytes"},
    {"SealedEnv", "name", R_ENV_NAME, 0, 0,
     "a POSIX name (letters, digits, _; not a digit first), not KSCORE_*"},
    {"SealedEnv", "agent_id", R_AGENT_ID, 0, 0,
     "1-128 letters, digits, _ and -"},
    {"SealedEnv", "sealed", R_BLOB, EVT_SEAL_OVERHEAD,
     EVT_SEAL_ENV_VALUE_MAX + EVT_SEAL_OVERHEAD,
     "a sealed box (events/seal.c) of a value of at most 128 KiB"},
    {"CommandSpec", "run_as", R_USER, 0, 0,
     "empty or USER[:GROUP]: names of letters, digits, _, . and - (not "
     "first), at most 32 bytes each"},
    {"Payload", "data", R_BLOB, 0, KS_SCRIPT_MAX_BYTES,
     "at most 512 KiB (a script; stdin at most 256 KiB)"},
    {"Payload", "sha256", R_BLOB, KS_SHA256_BYTES, KS_SHA256_BYTES,
     "32 bytes (a SHA-256)"},
    {"Payload", "name", R_BYTES, 0, 255, "at most 255 bytes"},
    {"CopySpec", "files", R_COUNT, 1, KS_COPY_MAX_FILES,
     "1 to 64 files"},
    {"CopySpec", "path", R_BYTES, 1, 4095,
     "an absolute path of at most 4095 bytes"},
    {"CopySpec", "path", R_ABS_PATH, 0, 4095,
     "an absolute path of at most 4095 bytes"},
    {"CopySpec", "mode", R_RANGE, 0, 07777, "permission bits (0 to 07777)"},
    {"CopySpec", "owner", R_USER, 0, 0,
     "empty or USER[:GROUP]: names of letters, digits, _, . and - (not "
     "first), at most 32 bytes each"},
    {"CopyFile", "name", R_BYTES, 1, 255, "1 to 255 bytes"},
    {"CopyFile", "name", R_BASE_NAME, 0, 0,
     "a file name: no '/', not . or .."},
    {"CopyFile", "sha256", R_BLOB, KS_SHA256_BYTES, KS_SHA256_BYTES,
     "32 bytes (a SHA-256)"},
    {"CopyFile", "size", R_RANGE, 0, KS_COPY_MAX_BYTES,
     "at most 256 MiB"},
    {"UploadRequest", "sha256", R_BLOB, KS_SHA256_BYTES, KS_SHA256_BYTES,
     "32 bytes (a SHA-256)"},
    {"UploadRequest", "size", R_RANGE, 0, KS_COPY_MAX_BYTES,
     "at most 256 MiB"},
    {"UploadRequest", "part", R_RANGE, 0,
     KS_COPY_MAX_BYTES / KS_BLOB_PART_BYTES, "a part of at most 256 MiB"},
    {"UploadRequest", "data", R_BLOB, 0, KS_BLOB_PART_BYTES,
     "at most 512 KiB (one part)"},
    {"FetchRequest", "command_id", R_UUID, 1, 0, "a UUID"},
    {"FetchRequest", "agent_id", R_AGENT_ID, 0, 0,
     "1-128 letters, digits, _ and -"},
    {"FetchRequest", "attempt", R_RANGE, 1, 1000, "1 to 1000"},
    {"FetchRequest", "sha256", R_BLOB, KS_SHA256_BYTES, KS_SHA256_BYTES,
     "32 bytes (a SHA-256)"},
    {"FetchRequest", "part", R_RANGE, 0,
     KS_COPY_MAX_BYTES / KS_BLOB_PART_BYTES, "a part of at most 256 MiB"},
    {"BatchRequest", "agents", R_COUNT, 0, 100000,
     "at most 100000 agents"},
    {"BatchRequest", "agents", R_AGENT_ID, 0, 0,
     "each 1-128 letters, digits, _ and -"},
    {"BatchRequest", "select", R_COUNT, 0, 64, "at most 64 label pairs"},
    {"BatchRequest", "selector", R_COUNT, 0, 64,
     "at most 64 selector terms"},
    {"BatchRequest", "selector", R_BYTES, 3, 1024,
     "each 3 to 1024 bytes"},
    {"BatchRequest", "deliver_within_ms", R_RANGE, 0,
     EVT_DELIVER_WITHIN_MAX_MS,
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
    {"EventsRequest", "start_at_us", R_RANGE, 0, (1ULL << 62),
     "0 or a time in microseconds since the epoch"},
    {"ListRequest", "agents", R_COUNT, 0, 64, "at most 64 agents"},
    {"ListRequest", "agents", R_AGENT_ID, 0, 0,
     "each 1-128 letters, digits, _ and -"},
    {"ListRequest", "statuses", R_COUNT, 0, 32, "at most 32 statuses"},
    {"ListRequest", "statuses", R_BYTES, 1, 32, "1 to 32 bytes"},
    {"ListRequest", "operator", R_BYTES, 0, 128, "at most 128 bytes"},
    {"ListRequest", "limit", R_RANGE, 0, 1000, "at most 1000"},
    {"ListRequest", "batch_id", R_STREAM_ID, 0, 200,
     "empty or batch-<uuid>"},
    {"ListRequest", "cursor_id", R_BYTES, 0, 200, "at most 200 bytes"},
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
broker__service_reply(const char *subject)
{
    return subject && strncmp(subject, "_R_.", 4) == 0 && subject[4] &&
           subject_ok(subject);
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
        ok = broker_env_name_ok(v);
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
    case R_USER:
        ok = n == 0 || broker_user_spec_ok(v);
        break;
    case R_BASE_NAME:
        ok = !strchr(v, '/') && strcmp(v, ".") && strcmp(v, "..");
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

/* Order of sealed values: by agent id, then name. */
static int
sealed_cmp(const Ks__SealedEnv *a, const Ks__SealedEnv *b)
{
    int c = strcmp(a->agent_id, b->agent_id);
    return c ? c : strcmp(a->name, b->name);
}

/*
 * CommandSpec.sealed_env as a whole: sorted by agent id, then name, each
 * name once per agent (so a target's values are one run, found by binary
 * search: broker__spec_for_agent); every agent has the same names; none
 * is also a plain env name; env + sealed names at most 1024 per agent.
 */
static int
check_sealed(const Ks__CommandSpec *sp, const char *path, char *why,
             size_t len)
{
    size_t first_run = 0; /* length of the first agent's run, once known */
    size_t run_start = 0;
    size_t n = sp->n_sealed_env;

    for (size_t i = 0; i < n; i++) {
        const Ks__SealedEnv *e = sp->sealed_env[i];
        if (i > 0 && sealed_cmp(sp->sealed_env[i - 1], e) >= 0) {
            snprintf(why, len,
                     "%s.sealed_env[%zu]: not allowed: sorted by agent id, "
                     "then name, each name once per agent",
                     path, i);
            return KS_EINVAL;
        }
        if (i > 0 &&
            strcmp(sp->sealed_env[i - 1]->agent_id, e->agent_id) != 0) {
            if (first_run == 0)
                first_run = i;
            else if (i - run_start != first_run)
                goto lacks;
            run_start = i;
        }
        if (first_run == 0) {
            /* The first agent's names (the others repeat them). */
            for (size_t k = 0; k < sp->n_env; k++)
                if (strcmp(sp->env[k]->name, e->name) == 0) {
                    snprintf(why, len,
                             "%s.sealed_env[%zu]: '%.64s' is not allowed: "
                             "it is also a plain env variable",
                             path, i, e->name);
                    return KS_EINVAL;
                }
            if (sp->n_env + i + 1 > 1024) {
                snprintf(why, len,
                         "%s.sealed_env: not allowed: at most 1024 "
                         "variables (env and secret) per command",
                         path);
                return KS_EINVAL;
            }
            continue;
        }
        size_t at = i - run_start;
        if (at >= first_run ||
            strcmp(sp->sealed_env[at]->name, e->name) != 0) {
            snprintf(why, len,
                     "%s.sealed_env[%zu]: '%.64s' for agent '%.64s' is not "
                     "allowed: every agent gets the same secret variables",
                     path, i, e->name, e->agent_id);
            return KS_EINVAL;
        }
    }
    if (first_run && n - run_start != first_run)
        goto lacks;
    return 0;
lacks:
    snprintf(why, len,
             "%s.sealed_env: not allowed: every agent gets the same secret "
             "variables (one lacks some)",
             path);
    return KS_EINVAL;
}

/* A payload's sha256 is that of its data (the agent checks it again). */
static int
check_payload(const Ks__Payload *p, const char *path, size_t max,
              const char *what, char *why, size_t len)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;

    if (p->data.len > max) {
        snprintf(why, len, "%s.data: %zu bytes: %s at most %zu KiB", path,
                 p->data.len, what, max / 1024);
        return KS_EINVAL;
    }
    if (EVP_Digest(p->data.data, p->data.len, md, &n, EVP_sha256(), NULL) !=
            1 ||
        p->sha256.len != n || memcmp(md, p->sha256.data, n) != 0) {
        snprintf(why, len, "%s.sha256: not allowed: it is not the SHA-256 "
                 "of data", path);
        return KS_EINVAL;
    }
    return 0;
}

/* CommandSpec: secret values, script and stdin, what goes with a copy. */
static int
check_spec(const Ks__CommandSpec *sp, const char *path, char *why, size_t len)
{
    char sub[352];
    int rc;

    if ((rc = check_sealed(sp, path, why, len)))
        return rc;
    snprintf(sub, sizeof(sub), "%s.script", path);
    if (sp->script && (rc = check_payload(sp->script, sub,
                                          KS_SCRIPT_MAX_BYTES, "a script is",
                                          why, len)))
        return rc;
    snprintf(sub, sizeof(sub), "%s.input", path);
    if (sp->input && (rc = check_payload(sp->input, sub, KS_INPUT_MAX_BYTES,
                                         "stdin is", why, len)))
        return rc;
    if (sp->copy && (sp->script || sp->input || sp->run_as[0])) {
        snprintf(why, len, "%s.copy: not allowed with a script, stdin or "
                 "run_as (a copy writes files as the agent's user and "
                 "gives them copy.owner)", path);
        return KS_EINVAL;
    }
    return 0;
}

/* Rules across fields of one message. */
static int
check_whole(const ProtobufCMessage *m, const char *path, char *why,
            size_t len)
{
    if (m->descriptor == &ks__command_spec__descriptor)
        return check_spec((const Ks__CommandSpec *)m, path, why, len);
    if (m->descriptor == &ks__sealed_env__descriptor) {
        const Ks__SealedEnv *e = (const Ks__SealedEnv *)m;
        if (e->sealed.len && e->sealed.data[0] != EVT_SEAL_VERSION) {
            snprintf(why, len, "%s.sealed: version %u is not allowed: "
                     "version %d (events/seal.c)", path,
                     e->sealed.data[0], EVT_SEAL_VERSION);
            return KS_EINVAL;
        }
    }
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
                                    : f->type == PROTOBUF_C_TYPE_BYTES
                                        ? sizeof(ProtobufCBinaryData)
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
            case PROTOBUF_C_TYPE_BYTES: {
                const ProtobufCBinaryData *bd = elem;
                for (size_t k = 0; k < nmine; k++)
                    if (mine[k]->kind == R_BLOB &&
                        (bd->len < mine[k]->lo || bd->len > mine[k]->hi)) {
                        snprintf(why, len, "%s: %zu bytes: %s", ewhere,
                                 bd->len, mine[k]->says);
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

/* The run of agent_id's values in a sorted sealed_env: *first, *n. */
static void
sealed_run(const Ks__CommandSpec *sp, const char *agent_id, size_t *first,
           size_t *n)
{
    size_t lo = 0, hi = sp->n_sealed_env;
    while (lo < hi) { /* first entry with agent_id >= agent_id */
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(sp->sealed_env[mid]->agent_id, agent_id) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *first = lo;
    while (hi < sp->n_sealed_env &&
           strcmp(sp->sealed_env[hi]->agent_id, agent_id) == 0)
        hi++;
    *n = hi - lo;
}

int
broker__check_sealed_targets(const Ks__CommandSpec *sp,
                             char *const *agent_ids, size_t n_agents,
                             bool exact, char *why, size_t len)
{
    size_t covered = 0, first, n;

    if (!sp || sp->n_sealed_env == 0)
        return 0;
    for (size_t i = 0; i < n_agents; i++) {
        sealed_run(sp, agent_ids[i], &first, &n);
        if (n == 0 && !(exact && n_agents == 1)) {
            snprintf(why, len,
                     "no secret values sealed to target agent '%.128s': "
                     "every target needs its own (kscore --secret-env "
                     "seals them; try again if the agent has just joined)",
                     agent_ids[i]);
            return KS_EINVAL;
        }
        covered += n;
    }
    if (exact && covered != sp->n_sealed_env) {
        const char *other = "";
        for (size_t i = 0; i < sp->n_sealed_env && !other[0]; i++) {
            bool target = false;
            for (size_t k = 0; k < n_agents && !target; k++)
                target = strcmp(sp->sealed_env[i]->agent_id,
                                agent_ids[k]) == 0;
            if (!target)
                other = sp->sealed_env[i]->agent_id;
        }
        snprintf(why, len,
                 "secret values sealed to another agent ('%.128s') than "
                 "the target: not allowed",
                 other);
        return KS_EINVAL;
    }
    return 0;
}

void
broker__spec_for_agent(const Ks__CommandSpec *sp, const char *agent_id,
                       Ks__CommandSpec *out)
{
    size_t first = 0, n = 0;

    *out = *sp;
    if (sp->n_sealed_env)
        sealed_run(sp, agent_id, &first, &n);
    out->sealed_env = n ? sp->sealed_env + first : NULL;
    out->n_sealed_env = n;
}

/* What spec needs of its agent beyond argv (agent.h AGENT_FEATURES). */
static size_t
spec_needs(const Ks__CommandSpec *sp, const char *need[4])
{
    size_t n = 0;
    if (sp->script)
        need[n++] = "script";
    if (sp->input && sp->input->data.len)
        need[n++] = "input";
    if (sp->run_as[0])
        need[n++] = "run_as";
    if (sp->copy)
        need[n++] = "copy";
    return n;
}

int
broker__check_features(const Ks__CommandSpec *sp, const Ks__AgentInfo *info,
                       const char *agent_id, char *why, size_t len)
{
    static const char *const flag[] = {"--script", "stdin", "--run-as",
                                       "kscore copy"};
    static const char *const name[] = {"script", "input", "run_as", "copy"};
    const char *need[4];
    size_t n = sp ? spec_needs(sp, need) : 0;

    for (size_t i = 0; i < n; i++) {
        bool has = false;
        for (size_t k = 0; info && k < info->n_features && !has; k++)
            has = strcmp(info->features[k], need[i]) == 0;
        if (has)
            continue;
        for (size_t k = 0; k < 4; k++)
            if (strcmp(name[k], need[i]) == 0)
                snprintf(why, len,
                         "agent '%.128s' (version %.32s) cannot run %s: it "
                         "is older than this broker (upgrade it)",
                         agent_id,
                         info && info->version[0] ? info->version : "unknown",
                         flag[k]);
        return KS_EINVAL;
    }
    return 0;
}
