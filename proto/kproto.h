/*
 * kproto: the bottom of kscore. The wire messages generated from
 * proto/kscore.proto (C names Ks__*), the one error table every module
 * returns codes from, and small helpers every module needs (clocks, ids).
 *
 * Invariants:
 *  - Fallible functions in kscore return 0 or a negative code: -errno for
 *    system errors, KS_E* (all <= -1000) for kscore's own.
 *  - Nothing here allocates except kproto_pack(), ks_map, kproto_arena
 *    and the log line (ks_log_format_line).
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
    X(PGDOWN, -1016, "PostgreSQL unreachable")                                 \
    X(DUPINSTANCE, -1017, "another agent process serves this id")            \
    X(PGREFUSED, -1018, "PostgreSQL refuses writes")                           \
    X(INDOUBT, -1019, "outcome unknown")                                       \
    X(BUSY, -1020, "busy: cannot start in time, try again later")

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
/* CLOCK_MONOTONIC now plus ms (>= 0) into *out: a deadline for
 * pthread_cond_timedwait on a condition made with that clock. */
struct timespec;
void ks_mono_deadline(struct timespec *out, int64_t ms);

/* Random (v4) UUID, lower-case text, into out[37] (NUL-terminated). */
void ks_uuid(char out[37]);
/* 1 if s is a UUID in canonical text form, else 0. */
int ks_is_uuid(const char *s);
/* The 16 bytes of the UUID text s into out (RFC 4122 byte order, as
 * PostgreSQL's uuid): 0, or KS_EINVAL when s is not one (out untouched). */
int ks_uuid_bin(const char *s, uint8_t out[16]);

/*
 * Pack a protobuf message into a new malloc'd buffer of *len_out bytes.
 * Returns 0, or -ENOMEM. The caller frees *buf_out.
 */
int kproto_pack(const ProtobufCMessage *msg, uint8_t **buf_out,
                size_t *len_out);

/*
 * kproto_arena: memory for one unit of work (a decoded message, a batch),
 * taken by bumping a pointer and given back all at once, so a hot path
 * that decodes message after message stops calling malloc and free for
 * every field. Chunks of 4 KiB doubling to 1 MiB, filled in order; a
 * request above 512 KiB gets a chunk of its own.
 *
 *   static _Thread_local struct kproto_arena ar; (or KPROTO_ARENA_INIT)
 *   evt_unpack_in(desc, data, len, kproto_arena_pb(&ar), &m);
 *   ... use m, kproto_arena_calloc(&ar, n, sizeof(x)) ...
 *   kproto_arena_reset(&ar);        m and everything else is gone
 *   kproto_arena_fini(&ar);         when the thread is done with it
 *
 * Ownership: everything allocated belongs to the arena until the next
 * reset, the release of a mark taken before it, or fini; nothing in it is
 * freed alone (free() on it is a bug; protobuf_c_message_free_unpacked
 * with kproto_arena_pb() is a no-op). Thread use: none inside; one thread
 * at a time (a per-thread or per-connection arena). A zeroed struct is an
 * empty arena.
 *
 * Rewinding keeps the regular chunks (up to 4 MiB past a reset) for the
 * next round: a thread whose rounds do not grow allocates nothing more.
 * Nested users (a function that borrows a caller's arena) take a mark and
 * release it: memory taken since the mark is given back, what the caller
 * took before stays.
 */
struct kproto_arena_chunk;
struct kproto_arena {
    struct kproto_arena_chunk *first; /* regular chunks, in fill order */
    struct kproto_arena_chunk *cur;   /* the one being filled, or NULL */
    struct kproto_arena_chunk *big;   /* own chunks, newest first */
    size_t used;                      /* bytes of cur taken */
    ProtobufCAllocator pb;            /* set by kproto_arena_pb() */
};
#define KPROTO_ARENA_INIT {0}
struct kproto_arena_mark {
    struct kproto_arena_chunk *cur, *big;
    size_t used;
};
/* size bytes aligned for any type (size 0 counts as 1), or NULL when out
 * of memory. */
void *kproto_arena_alloc(struct kproto_arena *a, size_t size);
/* n * size zeroed bytes; NULL on overflow or when out of memory. */
void *kproto_arena_calloc(struct kproto_arena *a, size_t n, size_t size);
/* A copy of s, or NULL. */
char *kproto_arena_strdup(struct kproto_arena *a, const char *s);
/* A protobuf-c allocator into a (protobuf_c_message_unpack): alloc from
 * the arena, free a no-op. Valid as long as a. */
ProtobufCAllocator *kproto_arena_pb(struct kproto_arena *a);
/* Where the arena stands now; kproto_arena_release(a, m) gives back
 * everything allocated after it (marks taken after m are void then). */
struct kproto_arena_mark kproto_arena_mark(const struct kproto_arena *a);
void kproto_arena_release(struct kproto_arena *a, struct kproto_arena_mark m);
/* Gives back everything; keeps up to 4 MiB of chunks for reuse. */
void kproto_arena_reset(struct kproto_arena *a);
/* Frees every chunk; a is empty (and usable) again. NULL is a no-op. */
void kproto_arena_fini(struct kproto_arena *a);

/*
 * qsort(3) that never allocates (glibc's mallocs a copy of any array above
 * 1 KiB): an introsort, O(n log n). Not stable: where equal elements must
 * keep an order, cmp must decide it (e.g. by index).
 */
void ks_sort(void *base, size_t n, size_t size,
             int (*cmp)(const void *, const void *));

/*
 * Largest message kscore accepts from the network (bytes): the default NATS
 * max_payload (1 MiB, nats-server docs "Limits"), which also bounds
 * results. Decoders refuse larger inputs with KS_ETOOBIG before allocating.
 */
#define KS_MAX_MESSAGE_BYTES (1024 * 1024)

/*
 * What travels inside one command besides argv (docs/scripts-and-files.md
 * "Scripts and stdin"): a script (CommandSpec.script) and stdin
 * (CommandSpec.input),
 * each checked by the CLI before anything is sent and by the broker
 * before anything is recorded. Both together stay below one NATS message,
 * with room for argv and the rest; larger data goes by kscore copy.
 */
#define KS_SCRIPT_MAX_BYTES (512 * 1024)
#define KS_INPUT_MAX_BYTES (256 * 1024)
/*
 * kscore copy: each file travels in parts of KS_BLOB_PART_BYTES (an
 * upload request or a fetch reply holds one, well within one NATS
 * message), at most KS_COPY_MAX_BYTES per file and KS_COPY_MAX_FILES files
 * per copy.
 */
#define KS_BLOB_PART_BYTES (512 * 1024)
#define KS_COPY_MAX_BYTES (256ULL * 1024 * 1024)
#define KS_COPY_MAX_FILES 64
#define KS_SHA256_BYTES 32
/* The parts of a file of size bytes (none for an empty one), and the
 * length of part i (the last one shorter). */
static inline uint32_t
ks_blob_parts(uint64_t size)
{
    return (uint32_t)((size + KS_BLOB_PART_BYTES - 1) / KS_BLOB_PART_BYTES);
}
static inline size_t
ks_blob_part_len(uint64_t size, uint32_t i)
{
    uint64_t at = (uint64_t)i * KS_BLOB_PART_BYTES;
    uint64_t left = size > at ? size - at : 0;
    return left < KS_BLOB_PART_BYTES ? (size_t)left : KS_BLOB_PART_BYTES;
}

/* Lower-case hex of len bytes into out (2 * len + 1 bytes, with NUL). */
void ks_hex(const uint8_t *data, size_t len, char *out);

/* Status names as the CLI and JSON print them ("Succeeded", ...). */
const char *kproto_status_name(Ks__CommandStatus st);
/* A batch's, as the CLI, JSON and the batches projection (migration 13)
 * name them: "Running", "Succeeded", "PartialFailure", "Failed",
 * "Cancelled"; "Unknown" for any other value. */
const char *kproto_batch_status_name(Ks__BatchStatus st);
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
/* FNV-1a of the n bytes at p, going on from h (KS_FNV1A_INIT to
 * start): ks_map's hash, and the broker's memories of what it saw. */
#define KS_FNV1A_INIT 1469598103934665603ULL
uint64_t ks_fnv1a(uint64_t h, const void *p, size_t n);

/* ---- metrics (proto/metrics.c) -------------------------------------------
 * The one registry of kscore's Prometheus metrics, process-wide, so every
 * module counts without knowing who serves them (events/ has the HTTP
 * endpoint: evt_metrics_serve). Updates are relaxed atomic adds, no lock:
 * cheap enough for the hot paths. Names, help and buckets are in one table
 * (metrics.c); docs/metrics.md lists them.
 */
enum ks_metric_role { KS_METRICS_BROKER = 1, KS_METRICS_AGENT = 2 };

enum ks_counter {
    KS_C_EVENTS_RECORDED,    /* kscore_events_recorded_total (store) */
    KS_C_CLAIM_CONFLICTS,    /* kscore_claim_conflicts_total: claims lost */
    KS_C_REDISPATCHES,       /* kscore_redispatches_total: attempt > 1 */
    KS_C_RECORDER_REDELIVERIES, /* kscore_recorder_redeliveries_total */
    KS_C_AGENT_REDELIVERIES, /* kscore_agent_redeliveries_total */
    KS_C_AGENT_CLAIMS_LOST,  /* kscore_agent_claims_refused_total */
    KS_C_JETSTREAM_REPAIRS,  /* kscore_jetstream_repairs_total */
    /* kscore_agent_state_write_errors_total: journal, outbox */
    KS_C_AGENT_STATE_WRITE_ERRORS,
    KS_C_RECORDER_DB_RETRIES, /* kscore_recorder_db_retries_total */
    /* The consumer guard (broker/stall.c): stalls noticed, and its two
     * repairs. */
    KS_C_CONSUMER_STALLS,    /* kscore_consumer_stalls_total */
    KS_C_CONSUMER_STEPDOWNS, /* kscore_consumer_stepdowns_total */
    KS_C_CONSUMER_REMAKES,   /* kscore_consumer_remakes_total */
    KS_C_LOST_DELIVERIES,    /* kscore_lost_deliveries_total */
    /* The group writer (store/writer.c): appends written through it, and
     * the transactions they took (their ratio: appends per commit). */
    KS_C_WRITER_APPENDS,      /* kscore_writer_appends_total */
    KS_C_WRITER_TRANSACTIONS, /* kscore_writer_transactions_total */
    KS_C_LATE_REPLIES,       /* kscore_nats_late_replies_total */
    KS_C_PUBLISH_RETRIES,    /* kscore_publish_retries_total */
    /* kscore_annotations_dropped_total{kind="report"|"denial"}: not
     * written, the identity past its share (broker/budget.c) */
    KS_C_REPORTS_DROPPED,
    KS_C_DENIALS_DROPPED,
    KS_C_REFUSED_BUSY,       /* kscore_refused_busy_total: KS_EBUSY */
    /* kscore_requests_refused_total: API requests refused busy unserved,
     * their identity's queue full (broker/fairq.c) */
    KS_C_REQUESTS_REFUSED,
    KS_C__N
};
/* Counters labelled {status="Succeeded"...}, indexed by Ks__CommandStatus. */
enum ks_status_counter {
    KS_SC_COMMANDS,       /* kscore_commands_total: terminal events recorded */
    KS_SC_AGENT_COMMANDS, /* kscore_agent_commands_total: results reported */
    KS_SC__N
};
enum ks_gauge {
    KS_G_PG_CONNECTIONS,    /* store connections open */
    KS_G_PG_BROKEN,         /* ... of which down (reconnecting) */
    /* kscore_recorder_stalled{cause}: 1 while the recorder holds events
     * it cannot record, PostgreSQL refusing writes or away. */
    KS_G_RECORDER_STALLED_REFUSED,
    KS_G_RECORDER_STALLED_DOWN,
    /* Collected at scrape time (ks_metrics_collector_add), summed over
     * the collectors of the process: */
    KS_G_AGENTS_ONLINE,     /* kscore_agents_online */
    KS_G_NATS_BROKER,       /* kscore_nats_connected{component="broker"} */
    KS_G_NATS_AGENT,        /* kscore_nats_connected{component="agent"} */
    KS_G_QUEUE_EVENTS,      /* kscore_queue_depth{queue="events"} */
    KS_G_QUEUE_COMMANDS,    /* kscore_queue_depth{queue="commands"} */
    KS_G_RUNNING_CHILDREN,  /* kscore_agent_running_children */
    KS_G_AGENT_SLOTS,       /* kscore_agent_slots */
    KS_G__N
};
enum ks_histogram {
    KS_H_RECORD_LATENCY,  /* kscore_record_latency_seconds: occurred -> commit */
    KS_H_APPEND,          /* kscore_append_duration_seconds: one append */
    KS_H_COMMAND_DURATION,/* kscore_command_duration_seconds (record) */
    KS_H_AGENT_COMMAND,   /* kscore_agent_command_duration_seconds */
    KS_H_AGENT_CLAIM,     /* kscore_agent_claim_duration_seconds */
    KS_H__N
};

void ks_metric_inc(enum ks_counter c);
void ks_metric_status_inc(enum ks_status_counter c, Ks__CommandStatus st);
void ks_metric_gauge_add(enum ks_gauge g, int64_t delta);
/* A sample of us microseconds (negative counts as 0). */
void ks_metric_observe_us(enum ks_histogram h, int64_t us);
uint64_t ks_metric_counter_value(enum ks_counter c);

/*
 * A function run at each scrape, before the text is made: it adds what it
 * sees now to the collected gauges (ks_metric_gauge_add), which start every
 * scrape at 0. Add/remove: any thread; fn runs on the scraping thread,
 * never after remove() returned.
 */
typedef void (*ks_metrics_collect_fn)(void *ctx);
int ks_metrics_collector_add(ks_metrics_collect_fn fn, void *ctx);
void ks_metrics_collector_remove(ks_metrics_collect_fn fn, void *ctx);

/*
 * The Prometheus text exposition (format 0.0.4) of the metrics of roles
 * (KS_METRICS_* mask): HELP and TYPE once per name, then its samples.
 * Runs the collectors first. *out (malloc'd, NUL-terminated) and *len.
 */
int ks_metrics_render(unsigned roles, char **out, size_t *len);

/*
 * ks_trace: a step of one command, stamped for `kscore perf trace`. Off
 * (one branch) unless the environment variable KSCORE_TRACE names a file
 * when the process first stamps; then appends "<CLOCK_MONOTONIC us> <step>
 * <command_id>\n" to it with one write(2) (O_APPEND: the lines of the
 * client, the broker and the agent processes never interleave). step: a
 * static name such as "broker.recorded"; command_id may be NULL or "".
 * Thread-safe; errors are ignored (a trace is never worth a failure).
 * ks_trace_on: 1 when tracing is on. The steps and what lies between them:
 * perf/README.md "trace".
 */
void ks_trace(const char *step, const char *command_id);
/* The same with a stamp taken earlier (ks_mono_us()), for a step whose
 * command id is known only later. */
void ks_trace_at(const char *step, const char *command_id, int64_t mono_us);
int ks_trace_on(void);
/* Stamps of this process go to path from now on (NULL: tracing off),
 * whatever KSCORE_TRACE said. 0 or -errno of open(2). */
int ks_trace_open(const char *path);

/*
 * ks_log: the daemons' logs (broker, agent, watchdog). One line per event,
 * written with one write(2) to stderr (so lines of concurrent threads never
 * interleave): an RFC 3339 UTC time with milliseconds, a level, the message
 * and key=value fields, as text (logfmt: `time=... level=info msg="..."
 * command_id=... agent=...`, a value quoted when it holds a space, a quote,
 * '=', a backslash or a control byte, or is empty) or as JSON (one object
 * per line: "time", "level", "msg", then the fields; numbers as numbers).
 * No color. When stderr is the journal (JOURNAL_STREAM set) the text
 * format leaves the time out: journald stamps every line itself.
 *
 *   ks_log(KS_LOG_WARN, "cannot record", KS_S("command_id", id),
 *          KS_I("attempt", n), KS_ERR(rc));
 *
 * Settings are process-wide (ks_log_setup; default text, info) and are
 * meant to be set once at start, before threads.
 */
enum ks_log_level { KS_LOG_DEBUG, KS_LOG_INFO, KS_LOG_WARN, KS_LOG_ERROR };
enum ks_log_format { KS_LOG_TEXT, KS_LOG_JSON };

struct ks_log_field {
    const char *key; /* NULL ends the list */
    const char *s;   /* kind 's' (NULL prints as empty) */
    long long i;     /* kind 'i' */
    double d;        /* kind 'd' */
    char kind;
};
#define KS_S(k, v) ((struct ks_log_field){(k), (v), 0, 0, 's'})
#define KS_I(k, v) ((struct ks_log_field){(k), NULL, (long long)(v), 0, 'i'})
#define KS_D(k, v) ((struct ks_log_field){(k), NULL, 0, (double)(v), 'd'})
/* error="<ks_strerror(rc)>" */
#define KS_ERR(rc) KS_S("error", ks_strerror(rc))
#define KS_LOG_END ((struct ks_log_field){NULL, NULL, 0, 0, 0})

#define ks_log(level, ...) ks__log((level), __VA_ARGS__, KS_LOG_END)
void ks__log(enum ks_log_level level, const char *msg, ...);

/* Sets the format and the lowest level written; component, when not NULL
 * (a static string such as "broker"), is added to every line as
 * service=...; a part of a service says module=... in its fields. */
void ks_log_setup(enum ks_log_format format, enum ks_log_level min,
                  const char *component);
/* The current settings. */
enum ks_log_format ks_log_format_get(void);
enum ks_log_level ks_log_level_get(void);
/* 1 when a line of this level would be written. */
int ks_log_enabled(enum ks_log_level level);
/* "debug", "info", "warn", "error" (also "warning") -> level; "text",
 * "json" -> format. 0 or KS_EINVAL. */
int ks_log_level_parse(const char *s, enum ks_log_level *out);
int ks_log_format_parse(const char *s, enum ks_log_format *out);
const char *ks_log_level_name(enum ks_log_level level);
const char *ks_log_format_name(enum ks_log_format format);
/*
 * One line (not written), ending in '\n', malloc'd (NULL on ENOMEM): what
 * ks__log writes for an event at now_us (epoch us); with_time 0 leaves the
 * time out. A value longer than 64 KiB is cut there. For tests and
 * ks__log.
 */
char *ks_log_format_line(enum ks_log_format format, int64_t now_us,
                         int with_time, enum ks_log_level level,
                         const char *component, const char *msg,
                         const struct ks_log_field *fields, size_t n_fields);

#endif
