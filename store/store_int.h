/*
 * store_int.h: private to the sources of the store folder.
 */
#ifndef KSCORE_STORE_INT_H
#define KSCORE_STORE_INT_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"

/* SQLSTATEs raised by the SQL functions of migrations.c. */
#define STORE__SQLSTATE_CONFLICT "KS001"
#define STORE__SQLSTATE_RECORDED "KS002" /* DETAIL: the stream's version */
/* kscore_record_many(): some events are recorded; DETAIL: their ids. */
#define STORE__SQLSTATE_FRESH "KS003"
/* kscore_claim(): the claimer is not the command's agent. */
#define STORE__SQLSTATE_NOT_YOURS "KS004"
/* A claim of a command stream that is not recorded (migration 6). */
#define STORE__SQLSTATE_NOT_RECORDED "KS005"
/* An events insert by a transaction that had an id before it locked
 * events (migration 12). */
#define STORE__SQLSTATE_UNLOCKED "KS006"
/*
 * The FROM clause of every statement that begins an appending transaction
 * (or may): it locks events before the transaction has an id (migration
 * 11, the reading rule in store.h). A function in FROM runs before the
 * target list and before any row of a join is locked; it returns at once
 * when an earlier statement of the transaction took the lock.
 */
#define STORE__LOCKED " FROM kscore_events_lock()"
/* An explicit transaction that appends: BEGIN, then the lock (one round
 * trip, for store__exec). */
#define STORE__BEGIN_APPENDING "BEGIN; SELECT kscore_events_lock()"

/* Type OIDs (src/include/catalog/pg_type.dat; fixed for built-in types). */
#define STORE__OID_BOOL 16
#define STORE__OID_BYTEA 17
#define STORE__OID_INT8 20
#define STORE__OID_INT4 23
#define STORE__OID_TEXT 25
#define STORE__OID_UUID 2950

struct store__migration {
    int version;
    const char *name;
    const char *sql;
};
extern const struct store__migration store__migrations[];
extern const size_t store__n_migrations;
/* The group writer's statements (migrations.c, where the projection rules
 * are): the claims' wait for their records, then the appends. */
extern const char store__sql_write_wait[];
extern const char store__sql_write[];

/*
 * A growable byte buffer with a hard cap: grows to at most cap bytes, then
 * fails with KS_ETOOBIG.
 */
struct store__buf {
    uint8_t *p;
    size_t len, cap_alloc, cap;
};
int store__buf_reserve(struct store__buf *b, size_t more);
int store__buf_put(struct store__buf *b, const void *p, size_t len);
int store__buf_put_be32(struct store__buf *b, uint32_t v);
void store__buf_release(struct store__buf *b);

/*
 * One-dimensional array parameters in PostgreSQL's binary format
 * (array_recv, src/backend/utils/adt/arrayfuncs.c): ndim, has-null flag,
 * element type OID, then length and lower bound, then each element as a
 * length-prefixed value (-1 for NULL).
 */
int store__arr_begin(struct store__buf *b, uint32_t elem_oid, size_t n);
int store__arr_put(struct store__buf *b, const void *p, size_t len);
int store__arr_put_uuid(struct store__buf *b, const char *uuid_text);
int store__arr_put_null(struct store__buf *b);
int store__arr_put_i32(struct store__buf *b, int32_t v);
int store__arr_put_i64(struct store__buf *b, int64_t v);

struct store__wconn; /* store/writer.c */

/* Parameters of one statement. Values are borrowed until it is sent. */
#define STORE__MAX_PARAMS 48
struct store__params {
    int n;
    const char *val[STORE__MAX_PARAMS];
    int len[STORE__MAX_PARAMS];
    int fmt[STORE__MAX_PARAMS];
    char num[STORE__MAX_PARAMS][24]; /* text of numeric params */
};
void store__p_text(struct store__params *p, const char *s); /* NULL: NULL */
void store__p_text_or_null(struct store__params *p, const char *s); /* "": NULL */
void store__p_i64(struct store__params *p, int64_t v);
void store__p_bool(struct store__params *p, bool v);
void store__p_bin(struct store__params *p, const void *data, size_t len);
void store__p_null(struct store__params *p);

/* Parameter arrays of kscore_record_many() after the four event arrays. */
#define STORE__FOLD_COLS 36

/* Reconnection backoff (store.h "Reconnection"). */
#define STORE__BACKOFF_MIN_US 100000
#define STORE__BACKOFF_MAX_US 2000000

struct store {
    PGconn *conn;   /* the same object for the store's life (PQreset) */
    bool prepared;  /* the ks_* statements exist on this connection */
    bool listening; /* store_wait_notify called: a reconnection wakes it */
    uint64_t seen_gen; /* store__wake generation its last wait saw */
    bool broken;    /* lost: reconnect before the next statement */
    bool counted;     /* in KS_G_PG_CONNECTIONS (store_open succeeded) */
    bool writer_session; /* store__writer_session: kept across reconnects */
    bool generic_plans;  /* store__generic_plans: kept across reconnects */
    int lock_timeout_ms; /* store_set_lock_timeout (0: none); kept so */
    bool metric_down; /* counted in KS_G_PG_BROKEN */
    bool notify_pending; /* reconnected while listening: wake the waiter */
    int64_t retry_at_us; /* ks_mono_us: no reconnect attempt before */
    int64_t backoff_us;  /* the wait after the next failed attempt */
    char err[512];       /* store_last_error() */
    /* store_append_checked(): the append's pipeline ends the transaction
     * (store__send_commit), and says that it did. */
    bool commit_in_pipeline, commit_sent;
    /* store_in_doubt(): the current call lost the connection after its
     * commit (or the pipeline's Sync) was sent. Cleared by store__ready. */
    bool in_doubt;
    char sqlstate[6]; /* store_last_sqlstate(): of the last error, or "" */
    struct store__buf ids, streams, types, data, argv, result;
    struct store__buf fold[STORE__FOLD_COLS];
    /* A call's own arrays (checked.c, fold.c, append.c): taken after a
     * kproto_arena_mark, given back by its release; reused, so a warm
     * connection's appends allocate nothing for them. */
    struct kproto_arena scratch;
    /* store__write_now's arrays (store/writer.c), made at its first use. */
    struct store__wconn *direct;
};

/*
 * Translates a failed PGresult (or, with res NULL, the connection's error)
 * into a KS_E* code, once: KS001 -> KS_ECONFLICT, KS002 -> KS_EDUPLICATE,
 * 23505 on events_event_id_key -> KS_EDUPLICATE, other 23505 (stream
 * version, command id, idempotency key) -> KS_ECONFLICT, a lost connection
 * (CONNECTION_BAD, SQLSTATE 08xxx, 57P01-57P03) -> KS_EPGDOWN and the
 * connection marked broken (the next call reconnects), a database that
 * refuses writes for a while (store.h "Sick database") -> KS_EPGREFUSED,
 * the rest KS_EPG.
 * KS003 -> KS_EDUPLICATE as well (its DETAIL lists the recorded ids).
 * The message goes to store_last_error(); *errmsg (may be NULL) gets a
 * malloc'd copy.
 */
int store__pg_error(struct store *s, const PGresult *res, char **errmsg);
/* store__pg_error for a read: KS_EPGDOWN, KS_EPGREFUSED or KS_EPG. */
int store__read_error(struct store *s, const PGresult *res);
/* rc if KS_EPGDOWN or KS_EPGREFUSED (a sick database: the caller waits
 * and retries), else KS_EPG. */
int store__keep_sick(int rc);

/*
 * Makes s->conn ready for a statement; every public call starts with it
 * (store.h "Reconnection"). 0, or KS_EPGDOWN (store_last_error says why).
 */
int store__ready(struct store *s);

/* Prepares the ks_* statements once per connection. 0, KS_EPG or
 * KS_EPGDOWN. */
int store__prepare(struct store *s, char **errmsg);

/*
 * Makes s a group writer's connection, now and after each reconnection:
 * application_name 'kscore writer' (pg_stat_activity tells it from the
 * others), and every statement planned once, for any parameters
 * (plan_cache_mode = force_generic_plan): the writer's statement is large,
 * and re-planning it for each group's arrays (the plan cache keeps custom
 * plans while it sees their sizes) cost more than running it. It reaches
 * every table by an index on an array (= ANY), so a generic plan is the
 * plan it needs. 0 or a code.
 */
int store__writer_session(struct store *s);
/*
 * Only the writer session's plan_cache_mode on s (store__write_now on a
 * connection that is not a writer's): no lock_timeout, so what else s
 * does waits for locks as before. 0 or a code.
 */
int store__generic_plans(struct store *s);

/* Runs sql (no parameters, several statements allowed). 0 or a code. */
int store__exec(struct store *s, const char *sql, char **errmsg);

/* What an event does to the projections (store.h "Projections"). */
enum store__proj_kind {
    STORE__PROJ_NONE,      /* unknown type: recorded, no projection */
    STORE__PROJ_REQUESTED, /* inserts the commands row (and batch target) */
    STORE__PROJ_STATUS,    /* a new status */
    STORE__PROJ_RESULT,    /* a new status from a CommandResult */
    STORE__PROJ_VERSION,   /* known, changes only the row's version */
    STORE__PROJ_BATCH,     /* the batches row */
};

/*
 * The kind of ev, after the rules that depend on its fields (a
 * CommandCompleted without a result only moves the version, a status event
 * with one records it). *status = the type's own status (0 if none).
 */
enum store__proj_kind store__proj_kind(const Ks__Event *ev,
                                       Ks__CommandStatus *status);
/* The status a result stands for (dflt: the type's own, or 0). */
Ks__CommandStatus store__result_status(const Ks__CommandResult *r,
                                       Ks__CommandStatus dflt);
/* The command / batch an event is about, or NULL. Borrowed from ev. */
const char *store__command_id(const Ks__Event *ev);
/* An append committed in this process: wakes store_wait_notify(). */
void store__wake(void);
const char *store__batch_id(const Ks__Event *ev);
/* The result column: r packed without its output bytes, into b. */
int store__pack_result(struct store__buf *b, const Ks__CommandResult *r);

/*
 * Folds the command events of events[i] with !skip[i] (store/fold.c) into
 * the s->fold arrays, kscore_record_many()'s c_* parameters. Returns 0
 * with *sent_out = the number of events not skipped, 1 if the call must
 * take the per-event path instead (its batch events depend on the order
 * of the others), or a negative code (KS_EINVAL, KS_ETOOBIG, -ENOMEM).
 */
int store__fold_batch(struct store *s, const Ks__Event *const *events,
                      size_t n, const bool *skip, size_t *sent_out);

/* A command's state assumed, not read (store__record_checked). */
struct store__assumed {
    const char *command_id, *status, *agent_id;
    uint32_t attempt;
};

/*
 * store_append_checked()'s batch: appends events[0..n) (all new, no
 * repeats, no batch events) with their projections in one implicit
 * transaction through kscore_record_checked(), bumping each stream in
 * vstreams[0..nv) only at vexpected[i] (streams not listed: at any
 * version), and only if each command in assumed[0..na) is in that state
 * once its stream is held. Returns 0; KS_ECONFLICT when a listed stream
 * moved or an assumed state is not the command's (read and decide again);
 * KS_EDUPLICATE when some events are recorded already, *detail_out
 * (malloc'd, may stay NULL) listing their ids; 1 when the events need the
 * per-event path (batch events); or another code.
 */
int store__record_checked(struct store *s, const Ks__Event *const *events,
                          size_t n, const char *const *vstreams,
                          const int64_t *vexpected, size_t nv,
                          const struct store__assumed *assumed, size_t na,
                          char **detail_out);

/*
 * Adds one kscore_project(...) call for ev to the open pipeline (replay:
 * apply whatever its tx_id). Returns 1 if a call was queued, 0 if the
 * event type has no projection, or a negative code.
 */
int store__send_project(struct store *s, const Ks__Event *ev, bool replay);

/*
 * Reads the results of a pipeline up to and including its sync. Returns
 * the first error translated (store__pg_error) or 0; *first_out (may be
 * NULL) receives the first query's first value as int64 when it is
 * non-NULL; *detail_out (may be NULL) the DETAIL of the first error.
 */
/* store__pipeline_finish with each result but the sync (rows, command
 * results, errors, aborted ones) passed to on_result(res, ud) (may be
 * NULL), in order, borrowed for the call. */
typedef void (*store__result_fn)(const PGresult *res, void *ud);
int store__pipeline_read(struct store *s, store__result_fn on_result,
                         void *ud, char **detail_out);
int store__pipeline_finish(struct store *s, int64_t *first_out,
                           char **detail_out);

/* Queues COMMIT in the open pipeline when store_append_checked() asked
 * for it (s->commit_in_pipeline) and it is not queued yet. */
void store__send_commit(struct store *s);

/* An event id and its index in a call's input (store__mark_repeats). */
struct store__id_ref {
    const char *id;
    size_t idx;
};

/* Marks flags[] (through refs, sorted by id by store__mark_repeats) for
 * the first event of each id in list (KS003's DETAIL: ids, comma-
 * separated); tokens that are no id of the input are ignored. Returns how
 * many were newly marked. */
size_t store__mark_recorded(const struct store__id_ref *refs, size_t n,
                            const char *list, bool *flags);

/*
 * Sorts refs (n entries, caller storage) by event_id, the first in the
 * input first among equal ids, and marks skip[i] for every event whose
 * event_id appeared earlier in the input. Returns the number marked.
 * O(n log n).
 */
size_t store__mark_repeats(const Ks__Event *const *events, size_t n,
                           struct store__id_ref *refs, bool *skip);

/* Checks what an append of ev needs before anything is sent: a UUID
 * event_id, a stream and a type, and the command or batch id its
 * projection keys on. 0 or KS_EINVAL. */
int store__validate(const Ks__Event *ev);
/* Appends ev packed as one element of the bytea[] in b (KS_ETOOBIG past
 * KS_MAX_MESSAGE_BYTES). */
int store__put_packed_event(struct store__buf *b, const Ks__Event *ev);
/* Leaves pipeline mode; a connection that cannot (results unread) is
 * marked broken, started afresh by the next call. */
void store__pipeline_end(struct store *s);

/*
 * store_append_checked_at()'s decision, before any append: 0 with *copy
 * = ev on stream command-<its command id> (stream, caller storage), to be
 * appended at `version`; KS_EINVAL (no UUID event or command id, no type)
 * or KS_ECONFLICT (no known state, or its verdict is not APPLY).
 */
int store__checked_at_decide(const Ks__Event *ev,
                             const struct store_command_state *known,
                             int64_t version, store_check_fn check, void *ud,
                             Ks__Event *copy, char stream[8 + 37]);

/*
 * One append of store__write_now: a store_write, and what only the store's
 * own callers ask for.
 */
struct store__wreq {
    struct store_write wr; /* between is not called */
    /* At the version the statement reads (0 if the stream has none),
     * instead of wr.expected_version, and with assumed (may be NULL, else
     * on a command-<uuid> stream): only if the commands row is in that
     * state (status, agent, attempt) in the same snapshot. */
    bool at_read;
    const struct store_command_state *assumed;
    int rc;                        /* out: its code */
    struct store_write_result res; /* out */
};

/*
 * The group writer's statement (store__sql_write) on s itself, for the
 * store's own callers: reqs[0..n) (n >= 1; validated by the caller, no batch events, at most one append per stream
 * and per command, or later ones go in later statements of the same
 * transaction) in one transaction, one round trip, each with its own code
 * in reqs[i].rc: 0, KS_EDUPLICATE (all its events recorded before),
 * KS_ECONFLICT (its stream moved, some of its events are recorded, or the
 * command is not in the state assumed: nothing of it written). Returns 0
 * when every append has its code, or the transaction's failure (nothing
 * written: every rc is it): a sick database's code, or KS_EPG when it
 * failed three times. The connection plans as a writer's
 * (store__generic_plans) from the first call.
 */
int store__write_now(struct store *s, struct store__wreq *reqs, size_t n);
/* Frees what store__write_now made for a store (store_close). */
void store__direct_free(struct store__wconn *c);

/* Big-endian readers for binary result columns. */
int64_t store__rd_i64(const char *p);
int32_t store__rd_i32(const char *p);

/*
 * Metrics of events just committed (those not marked in skip, which may be
 * NULL): events recorded, record latency, terminal statuses and run
 * times, and the append's duration since t0_us (ks_mono_us). Not for an
 * append whose COMMIT is still to come (commit_in_pipeline).
 */
void store__note_recorded(const Ks__Event *const *evs, size_t n,
                          const bool *skip, int64_t t0_us);

#endif
