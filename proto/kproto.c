#include "kproto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <sys/random.h>
#include <uuid/uuid.h>

const char *
ks_strerror(int err)
{
    switch (err) {
#define KS_ERR_MSG(name, val, msg)                                             \
    case val:                                                                  \
        return msg;
        KS_ERRNO_MAP(KS_ERR_MSG)
#undef KS_ERR_MSG
    case 0:
        return "success";
    }
    if (err < 0 && err > -4096)
        return strerror(-err);
    return "unknown error";
}

const char *
ks_err_name(int err)
{
    switch (err) {
#define KS_ERR_NAME(name, val, msg)                                            \
    case val:                                                                  \
        return "KS_E" #name;
        KS_ERRNO_MAP(KS_ERR_NAME)
#undef KS_ERR_NAME
    case 0:
        return "OK";
    }
    if (err < 0 && err > -4096) {
        const char *n = strerrorname_np(-err);
        return n ? n : "EUNKNOWN";
    }
    return "EUNKNOWN";
}

void
ks__bug(const char *file, int line, const char *expr)
{
    fprintf(stderr, "BUG at %s:%d: %s\n", file, line, expr);
    abort();
}

int64_t
ks_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t
ks_mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void
ks_mono_deadline(struct timespec *out, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, out);
    out->tv_sec += ms / 1000;
    out->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (out->tv_nsec >= 1000000000L) {
        out->tv_sec++;
        out->tv_nsec -= 1000000000L;
    }
}

/*
 * Random bytes from a per-thread buffer refilled by getrandom(2) 4 KiB at a
 * time: libuuid's uuid_generate_random() reseeds and calls getrandom for
 * every id, which the profile showed as ~9% of kscore's CPU.
 */
static atomic_uint fork_gen = 1;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void
after_fork_child(void)
{
    atomic_fetch_add(&fork_gen, 1);
}

static void
fork_register(void)
{
    pthread_atfork(NULL, NULL, after_fork_child);
}

static void
random_bytes(uint8_t *out, size_t n)
{
    static _Thread_local uint8_t pool[4096];
    static _Thread_local size_t left;
    static _Thread_local unsigned gen;
    /* A fork copies the pool: the child would hand out the parent's next
     * ids. The child's atfork handler moves the generation on, and a pool
     * of an older generation is refilled (no syscall per id). */
    pthread_once(&fork_once, fork_register);
    if (gen != atomic_load(&fork_gen)) {
        gen = atomic_load(&fork_gen);
        left = 0;
    }
    if (left < n) {
        size_t got = 0;
        while (got < sizeof(pool)) {
            ssize_t r = getrandom(pool + got, sizeof(pool) - got, 0);
            if (r > 0)
                got += (size_t)r;
            else if (errno != EINTR)
                BUG_ON(1); /* the kernel's CSPRNG failing is not an error */
        }
        left = sizeof(pool);
    }
    memcpy(out, pool + sizeof(pool) - left, n);
    memset(pool + sizeof(pool) - left, 0, n);
    left -= n;
}

void
ks_uuid(char out[37])
{
    uuid_t u;
    random_bytes(u, sizeof(u));
    u[6] = (u[6] & 0x0f) | 0x40; /* version 4 (RFC 4122 4.4) */
    u[8] = (u[8] & 0x3f) | 0x80; /* variant 10 */
    uuid_unparse_lower(u, out);
}

int
ks_is_uuid(const char *s)
{
    uuid_t u;
    return s && strlen(s) == 36 && uuid_parse(s, u) == 0;
}

void
ks_hex(const uint8_t *data, size_t len, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < len; i++) {
        out[2 * i] = digits[data[i] >> 4];
        out[2 * i + 1] = digits[data[i] & 15];
    }
    out[2 * len] = '\0';
}

int
ks_uuid_bin(const char *s, uint8_t out[16])
{
    uuid_t u;
    if (!s || strlen(s) != 36 || uuid_parse(s, u) != 0)
        return KS_EINVAL;
    memcpy(out, u, 16);
    return 0;
}

int
kproto_pack(const ProtobufCMessage *msg, uint8_t **buf_out, size_t *len_out)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return -ENOMEM;
    protobuf_c_message_pack(msg, buf);
    *buf_out = buf;
    *len_out = len;
    return 0;
}

const char *
kproto_batch_status_name(Ks__BatchStatus st)
{
    switch (st) {
    case KS__BATCH_STATUS__BATCH_RUNNING:
        return "Running";
    case KS__BATCH_STATUS__BATCH_SUCCEEDED:
        return "Succeeded";
    case KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE:
        return "PartialFailure";
    case KS__BATCH_STATUS__BATCH_FAILED:
        return "Failed";
    case KS__BATCH_STATUS__BATCH_CANCELLED:
        return "Cancelled";
    default:
        return "Unknown";
    }
}

const char *
kproto_status_name(Ks__CommandStatus st)
{
    switch (st) {
    case KS__COMMAND_STATUS__PENDING:
        return "Pending";
    case KS__COMMAND_STATUS__DISPATCHED:
        return "Dispatched";
    case KS__COMMAND_STATUS__RUNNING:
        return "Running";
    case KS__COMMAND_STATUS__SUCCEEDED:
        return "Succeeded";
    case KS__COMMAND_STATUS__FAILED:
        return "Failed";
    case KS__COMMAND_STATUS__TIMED_OUT:
        return "TimedOut";
    case KS__COMMAND_STATUS__START_FAILED:
        return "StartFailed";
    case KS__COMMAND_STATUS__CANCELLED:
        return "Cancelled";
    case KS__COMMAND_STATUS__UNDELIVERABLE:
        return "Undeliverable";
    case KS__COMMAND_STATUS__LOST:
        return "Lost";
    case KS__COMMAND_STATUS__NOT_STARTED:
        return "NotStarted";
    default:
        return "Unknown";
    }
}

int
kproto_status_terminal(Ks__CommandStatus st)
{
    return st >= KS__COMMAND_STATUS__SUCCEEDED;
}
