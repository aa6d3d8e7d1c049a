/*
 * kproto: the bottom of kscore. The wire messages generated from
 * proto/kscore.proto (C names Ks__*), the one error table every module
 * returns codes from, and small helpers every module needs (clocks, ids).
 *
 * Invariants:
 *  - Fallible functions in kscore return 0 or a negative code: -errno for
 *    system errors, KS_E* (all <= -1000) for kscore's own.
 *  - Nothing here allocates except kproto_pack() / kproto_uuid().
 */
#ifndef KSCORE_KPROTO_H
#define KSCORE_KPROTO_H

#include <stddef.h>
#include <stdint.h>

#include "kscore.pb-c.h"

/*
 * The error table: X(NAME, value, message). Project errors start at -1000 so
 * they never collide with -errno.
 */
#define KS_ERRNO_MAP(X)                                                        \
    X(CONFLICT, -1000, "expected version conflict")                            \
    X(DUPLICATE, -1001, "already recorded")                                    \
    X(TOOBIG, -1002, "too large")                                              \
    X(DECODE, -1003, "cannot decode message")                                  \
    X(TIMEDOUT, -1004, "timed out")                                            \
    X(NATS, -1005, "NATS error")                                               \
    X(PG, -1006, "PostgreSQL error")                                           \
    X(INVAL, -1007, "invalid argument")                                        \
    X(NOTFOUND, -1008, "not found")                                            \
    X(UNAVAIL, -1009, "service unavailable")                                   \
    X(NOAGENT, -1010, "unknown agent")                                         \
    X(REJECTED, -1011, "rejected")                                             \
    X(CLAIMED, -1012, "already claimed")                                       \
    X(STOPPED, -1013, "shutting down")                                         \
    X(INTERNAL, -1014, "internal error")                                       \
    X(DENIED, -1015, "denied by policy")                                       \
    X(PGDOWN, -1016, "PostgreSQL unreachable")

enum ks_err {
#define KS_ERR_ENUM(name, val, msg) KS_E##name = (val),
    KS_ERRNO_MAP(KS_ERR_ENUM)
#undef KS_ERR_ENUM
};

/* Message for any code (-errno or KS_E*); never NULL, static storage. */
const char *ks_strerror(int err);
/* "KS_ECONFLICT", "ENOENT", ...; never NULL, static storage. */
const char *ks_err_name(int err);

/* Programmer errors abort; they are never error codes. */
#define BUG_ON(cond)                                                           \
    do {                                                                       \
        if (cond)                                                              \
            ks__bug(__FILE__, __LINE__, #cond);                                \
    } while (0)
_Noreturn void ks__bug(const char *file, int line, const char *expr);

/* Microseconds since the Unix epoch (CLOCK_REALTIME). */
int64_t ks_now_us(void);
/* Microseconds on CLOCK_MONOTONIC (arbitrary origin). */
int64_t ks_mono_us(void);

/* Random (v4) UUID, lower-case text, into out[37] (NUL-terminated). */
void ks_uuid(char out[37]);
/* 1 if s is a UUID in canonical text form, else 0. */
int ks_is_uuid(const char *s);

/*
 * Pack a protobuf message into a new malloc'd buffer of *len_out bytes.
 * Returns 0, or -ENOMEM. The caller frees *buf_out.
 */
int kproto_pack(const ProtobufCMessage *msg, uint8_t **buf_out,
                size_t *len_out);

/*
 * Largest message kscore accepts from the network (bytes): the default NATS
 * max_payload (1 MiB, nats-server docs "Limits"), which also bounds
 * results. Decoders refuse larger inputs with KS_ETOOBIG before allocating.
 */
#define KS_MAX_MESSAGE_BYTES (1024 * 1024)

/* Status names as the CLI and JSON print them ("Succeeded", ...). */
const char *kproto_status_name(Ks__CommandStatus st);
/* 1 if the status is terminal. */
int kproto_status_terminal(Ks__CommandStatus st);

/*
 * ks_map: a string-keyed hash map of void * values (open hashing, grows by
 * doubling). Not thread-safe: callers lock. Keys are copied.
 */
struct ks_map_entry;
struct ks_map {
    struct ks_map_entry **buckets;
    size_t nbuckets, count;
};
#define KS_MAP_INIT {NULL, 0, 0}
/* Sets key to val (replacing). 0 or -ENOMEM. */
int ks_map_put(struct ks_map *m, const char *key, void *val);
/* The value, or NULL. */
void *ks_map_get(const struct ks_map *m, const char *key);
/* Removes key and returns its value, or NULL. */
void *ks_map_del(struct ks_map *m, const char *key);
/* Calls fn for every entry (order unspecified); fn must not modify m. */
void ks_map_each(const struct ks_map *m,
                 void (*fn)(const char *key, void *val, void *ud), void *ud);
/* Frees the entries (not the values). */
void ks_map_clear(struct ks_map *m);

#endif
