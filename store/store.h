/*
 * store: kscore's system of record in PostgreSQL. Knows no NATS.
 *
 * Tables (migrations in store/migrations.c, applied in one transaction at
 * broker start and recorded in schema_migrations):
 *   streams(stream_id PK, category, version)
 *   events(global_pos identity PK, tx_id xid8, stream_id, version,
 *          event_id uuid UNIQUE, type, data bytea (a packed Ks__Event),
 *          recorded_at, UNIQUE(stream_id, version))     append-only
 *   commands, agents, batches, batch_targets            projections
 *   batch_leases (the broker driving each open batch; not a projection)
 *
 * Invariants:
 *  - An append checks the expected version with
 *    UPDATE streams SET version = version + n WHERE version = expected;
 *    zero rows is a conflict, returned as KS_ECONFLICT, never swallowed.
 *  - Projections are updated in the same transaction as the append, so they
 *    never disagree with events; store_replay() rebuilds them from events.
 *  - Readers catch up by (tx_id, global_pos) below a bound, never by
 *    global_pos alone (a sequence value is handed out before commit, so a
 *    later position can commit first; PostgreSQL docs 9.27 "Transaction ID
 *    and Snapshot"). The bound is the lowest id of an open transaction
 *    that may still append, else the next id: an appender locks events
 *    (ROW EXCLUSIVE) before it has an id (migration 12; kscore_events_lock
 *    and a statement trigger that fails any other order with KS006), so a
 *    reader that looks at pg_locks after its snapshot knows which open ids
 *    to wait for and passes every other one: a long transaction of another
 *    database, or of this one that appends nothing, no longer holds the
 *    readers back (before, the bound was pg_snapshot_xmin, the oldest open
 *    id of the whole cluster: a 25 s transaction anywhere delayed every
 *    follower by 25 s). Events are still read once each, in the same
 *    order.
 *
 * Projections (the rules of kscore_project() in migrations.c, applied in
 * the append's transaction: per event by store_append() and
 * store_replay(), folded per command by store_append_many(), which writes
 * each commands row once per call; both give the same rows, which replay
 * equality checks):
 *   CommandRequested  inserts commands (status Pending; argv, agent_id,
 *                     batch_id, operator from event.command); the
 *                     idempotency key travels in Ks__Event.reason and is
 *                     UNIQUE: a second command with it is KS_ECONFLICT. With
 *                     a batch_id it adds a batch_targets row, batches.total++.
 *   CommandDispatched Dispatched, attempt, agent_id, dispatched_at
 *   CommandStarted    Running, attempt, started_at
 *   CommandCompleted / CommandStartFailed   status from result.status,
 *                     exit_code only if has_exit_code, output as bytea;
 *                     column result = the packed CommandResult without the
 *                     output bytes (kept once, in stdout/stderr), put back
 *                     together by store_get_command().
 *   CommandUndeliverable / CommandLost / CommandCancelled   that status (and
 *                     the result, if the event carries one)
 *   CommandCancelRequested / CommandRejected / DuplicateSuppressed   version
 *   BatchRequested    batches row (Running, operator, requested_at)
 *   BatchCompleted / BatchCancelled   batches.status (how it ended:
 *                     Succeeded, PartialFailure, Failed, Cancelled;
 *                     migration 13), finished_at
 *   any other type    recorded; no projection changes.
 * A terminal status is final: later status events only move the row's
 * version (the first result is still recorded). Batch counters (succeeded,
 * failed = every other terminal status, cancelled) move when a target
 * first becomes terminal. commands.version (CommandView.version) is the
 * version of the last event applied to the row: the stream's version as
 * long as only the types above are appended to a command stream.
 *
 * Appends do not NOTIFY (migration 7: PostgreSQL serializes the commits of
 * notifying transactions, fsync included); store_wait_notify() is woken by
 * the appends of its own process.
 *
 * Threads: a struct store is one libpq connection; use it from one thread at
 * a time. Open one per thread.
 *
 * Reconnection (one mechanism, inside the store, for every caller): a call
 * that finds the connection lost (libpq's CONNECTION_BAD, a SQLSTATE of
 * class 08, or 57P01/57P02/57P03, the server shutting down or starting)
 * fails with KS_EPGDOWN and marks the connection broken. Every call first
 * makes the connection ready: it notices a server that went away while the
 * connection was idle (a non-blocking read), leaves a half-finished pipeline
 * or failed transaction, and reconnects a broken connection: at once the
 * first time, then no sooner than 100 ms, 200 ms, ... 2 s after the last
 * failed attempt (calls in between fail at once with KS_EPGDOWN, no
 * connect). A reconnection sets the session up again and prepares the ks_*
 * statements again on first use (a store that has waited in
 * store_wait_notify is woken once: a reader must re-read). store_last_error()
 * says why. Every call below that names KS_EPG may return KS_EPGDOWN
 * as well. A call that fails with KS_EPGDOWN mid-way may or may not have
 * committed (a lost commit reply): appends are idempotent by event_id, so
 * retry them (KS_EDUPLICATE then says it had committed).
 *
 * Sick database (one classification, in store__pg_error, for every
 * caller): a server that is reachable but refuses writes for a while, for
 * reasons that have nothing to do with what was written, fails a call with
 * KS_EPGREFUSED, never KS_EPG. The SQLSTATEs (PostgreSQL 15 docs, Appendix
 * A "PostgreSQL Error Codes"): class 53 insufficient resources (53100
 * disk_full, 53200 out_of_memory, 53300 too_many_connections), 25006
 * read_only_sql_transaction (default_transaction_read_only, a standby),
 * 40001 serialization_failure, 40P01 deadlock_detected, 55P03
 * lock_not_available, 57014 query_canceled (statement_timeout) and class
 * 58 system error (58030 io_error). Class 08 and 57P01-57P03 are
 * KS_EPGDOWN (above). A call that fails with KS_EPGREFUSED wrote nothing
 * (the server answered the error: its transaction was rolled back); the
 * caller waits and retries, as for KS_EPGDOWN, and never takes the event
 * for a bad one. KS_EPG is left for what the statement itself causes (a
 * constraint, a value refused) and for errors not listed here.
 * store_last_sqlstate() names the SQLSTATE, store_last_error() the
 * server's message.
 */
#ifndef KSCORE_STORE_H
#define KSCORE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kproto.h"

struct store;

/* Expected versions for store_append(). n >= 1 means exactly n. */
#define STORE_ANY (-1)
#define STORE_NO_STREAM 0

/*
 * Connects with a libpq conninfo string (or URI). Returns 0, or KS_EUNAVAIL
 * with *errmsg (malloc'd, may be NULL) saying why. Does not migrate.
 */
int store_open(const char *conninfo, struct store **out, char **errmsg);
/* Accepts NULL. */
void store_close(struct store *s);

/*
 * Bounds how long a statement on s waits for a row or table lock held by
 * another transaction (PostgreSQL's lock_timeout, in ms, 1..600000; 0:
 * wait for good, the default). A statement that waited so fails with
 * KS_EPGREFUSED (SQLSTATE 55P03 lock_not_available) and wrote nothing.
 * Kept across reconnects. For a connection that serves many streams in
 * turn (the broker's scanner), so that one stream held by a stalled
 * transaction (a paused process) does not stop the others. Returns 0,
 * KS_EINVAL for ms out of range, or what the SET returned.
 */
int store_set_lock_timeout(struct store *s, int ms);

/*
 * Whether the last call that failed with KS_EPGDOWN may have committed:
 * its transaction's end (the pipeline's Sync, or COMMIT) was sent and the
 * answer was lost. False after any other failure (the server said the
 * transaction failed, or nothing was sent). Valid until the next call on
 * s. Accepts NULL (false).
 */
bool store_in_doubt(struct store *s);
/* rc says PostgreSQL is away or refuses writes for a while (KS_EPGDOWN,
 * KS_EPGREFUSED, KS_EUNAVAIL): wait and retry; it says nothing about what
 * was written. */
bool store_db_sick(int rc);

/*
 * Applies the numbered migrations not yet applied, in one transaction,
 * under an advisory lock (several brokers may start at once). Returns 0 or
 * KS_EPG with *errmsg.
 */
int store_migrate(struct store *s, char **errmsg);

/* One event to append. Borrowed. */
struct store_event {
    const Ks__Event *event; /* event_id, stream_id, type must be set */
};

/*
 * Appends n (>= 1) events to one stream in one transaction at
 * expected_version (STORE_ANY, STORE_NO_STREAM or exactly n), and updates
 * the projections those events touch. Every event's stream_id must equal
 * stream_id.
 *
 * One round trip: a libpq pipeline of kscore_append() and one
 * kscore_project() per event, committed at its Sync.
 *
 * Returns:
 *   0              appended; *version_out (may be NULL) = the last version.
 *   KS_EDUPLICATE  every event_id was already recorded (a redelivery): a
 *                  no-op; *version_out = the stream's current version.
 *   KS_ECONFLICT   the stream is not at expected_version, or a projection
 *                  refused the event (a command id or idempotency key
 *                  already used); nothing written.
 *   KS_EINVAL      an event lacks event_id (UUID), stream_id or type, a
 *                  command event has no UUID command id, an event_id
 *                  repeats within the call; nothing sent.
 *   KS_ETOOBIG     a packed event is larger than KS_MAX_MESSAGE_BYTES.
 *   KS_EPG         other database error; nothing written.
 * A batch where some event_ids are recorded and some not is KS_ECONFLICT.
 */
int store_append(struct store *s, const char *stream_id,
                 int64_t expected_version, const struct store_event *events,
                 size_t n, int64_t *version_out);

/*
 * store_append() that calls between(ud) once, on the calling thread, after
 * the append and its COMMIT are sent and before their results are read:
 * the caller's work overlaps the database's. between must not use s. It is
 * not called when nothing could be sent (then the return code says why);
 * when it is called the append may still fail (the return code).
 */
int store_append_overlap(struct store *s, const char *stream_id,
                         int64_t expected_version,
                         const struct store_event *events, size_t n,
                         int64_t *version_out, void (*between)(void *ud),
                         void *ud);

/*
 * The claim's append: as store_append of one event on a command stream
 * ("command-<uuid>") at expected_version, only if the command is
 * addressed to agent_id (else KS_EDENIED, nothing written). One round
 * trip (kscore_claim() in migrations 3 and 6). A command whose record is
 * being committed is waited for; one that is not recorded (its record
 * failed, or has not reached the database yet) is KS_ENOTFOUND.
 */
int store_append_claim(struct store *s, const char *stream_id,
                       int64_t expected_version, const char *agent_id,
                       const struct store_event *event, int64_t *version_out);

/*
 * Appends events for many streams in one transaction (the recorder's batch
 * path), each with STORE_ANY, in input order within each stream. Events
 * already recorded (by event_id), or repeated within the call, are skipped
 * and counted in *dup_out (may be NULL).
 *
 * One round trip: the events of each command are folded in C into one
 * write of its commands row (store/fold.c, kscore_record_many()). A call
 * holding events recorded before (a redelivery) costs one more round trip
 * per attempt that finds them; a BatchCompleted/BatchCancelled followed in
 * the same call by an event creating that batch's row takes the per-event
 * path (kscore_project() per event), as the order then matters. Returns 0,
 * KS_ECONFLICT (an event a projection refuses, see store_append: nothing
 * written; append one by one to find it), KS_EINVAL / KS_ETOOBIG (as
 * store_append, nothing sent) or KS_EPG (nothing written).
 */
int store_append_many(struct store *s, const Ks__Event *const *events,
                      size_t n, size_t *dup_out);

/*
 * The commands projection row. Returns 0 with *out (free with
 * ks__command_view__free_unpacked(*out, NULL)), KS_ENOTFOUND, or KS_EPG.
 */
int store_get_command(struct store *s, const char *command_id,
                      Ks__CommandView **out);

/*
 * Current version of a stream: 0 if it does not exist. Returns 0 or KS_EPG.
 */
int store_stream_version(struct store *s, const char *stream_id,
                         int64_t *version_out);

/*
 * Reads events of one stream with version > after_version, in order, at most
 * limit (0: all). Each is passed to cb (on the calling thread), which returns
 * 0 to continue or non-zero to stop (returned as is). The event is borrowed.
 */
typedef int (*store_event_fn)(const Ks__RecordedEvent *ev, void *ud);
int store_read_stream(struct store *s, const char *stream_id,
                      int64_t after_version, uint32_t limit, store_event_fn cb,
                      void *ud);

/*
 * The newest AgentLabelsChanged event (a relabel: `kscore agent label`,
 * broker/labels.c) of stream_id, or of every stream that has one
 * (stream_id NULL or ""), passed to cb as store_read_stream does (in
 * stream id order). Returns 0, cb's non-zero value or a store error.
 */
int store_read_relabels(struct store *s, const char *stream_id,
                        store_event_fn cb, void *ud);

/*
 * Catch-up read of all streams. The cursor is (tx_id, global_pos), compared
 * and ordered as numbers (xid8, bigint), never as text; reads only events
 * whose tx_id is below the reading rule's bound (the header: the lowest id
 * of an open appender of this database, else the next id), so no late
 * commit is ever skipped and every event is read once, and no open
 * transaction that appends nothing delays it. Two statements (the bound,
 * then the read). Start with a zeroed cursor; it is
 * advanced past each event passed to cb (also the one whose cb stopped
 * the read). Returns 0, cb's non-zero value, KS_EDECODE / KS_ETOOBIG (a row
 * that is not a Ks__Event of at most KS_MAX_MESSAGE_BYTES) or KS_EPG.
 */
struct store_cursor {
    uint64_t tx_id;
    int64_t global_pos;
};
int store_read_all(struct store *s, struct store_cursor *cursor,
                   uint32_t limit, store_event_fn cb, void *ud);

/*
 * A cursor for store_read_all that starts at a point in time instead of at
 * the first event (kscore events --follow, --since), found without reading
 * the history before it.
 *
 * since_us == 0: now. The cursor is just below the oldest transaction
 * still open (pg_snapshot_xmin - 1): a read from it returns every event
 * committed after this call, and none committed before it but the few of
 * transactions that began after the oldest one still open.
 *
 * since_us > 0 (epoch us): just after the last event, in read order, that
 * was recorded before since_us (recorded_at, the time its transaction
 * began) and lies below xmin; zeroed (the first event) when there is none.
 * The lookup walks events_tx_pos backwards from xmin: it costs what the
 * read from the cursor costs, never the history before since_us. A
 * transaction that began before since_us but wrote after one that began
 * later may hide that one's events: within one transaction's length of
 * since_us, the cut is that approximate.
 *
 * Either way, no transaction open at the call is skipped. Returns 0 with
 * *out, KS_EPGDOWN or KS_EPG.
 */
int store_cursor_at(struct store *s, int64_t since_us,
                    struct store_cursor *out);

/*
 * Blocks until an append commits in this process (through any struct
 * store) or timeout_ms passes. Commits since the previous call on s count
 * (from the first call on), and so does a reconnection of s. Appends of
 * other processes (other brokers) wake nothing: a reader that must see
 * them passes a short timeout (100 ms) and re-reads after it. Returns 0
 * (woken), KS_ETIMEDOUT, or KS_EPGDOWN (the server is away: checked
 * first). Only a wake-up: callers always re-read with store_read_all().
 */
int store_wait_notify(struct store *s, int timeout_ms);

/*
 * Rebuilds every projection from events alone into fresh tables and swaps
 * them in, in one transaction. *events_out (may be NULL) = events replayed.
 * Returns 0 or KS_EPG. Appends wait while it runs (events is locked
 * EXCLUSIVE); reads go on against the old tables until the swap. agents is
 * not an event projection (heartbeats feed it) and is kept as it is.
 */
int store_replay(struct store *s, int64_t *events_out, char **errmsg);

/* One command not ended yet, and the bytes its operator asked for. */
struct store_open_request {
    char command_id[37];
    const char *operator_name; /* valid during the callback */
    uint64_t request_bytes;    /* its CommandRequested event's data */
    int64_t deliver_by_us;     /* 0: none */
};
typedef int (*store_open_request_fn)(const struct store_open_request *r,
                                     void *ud);
/*
 * Every command not ended (Pending, Dispatched, Running: the partial index
 * commands_open), each with its operator and the size of its request as
 * recorded (the packed event of its CommandRequested, bytes): what the
 * broker's share of each operator's commands counts at its start
 * (broker/admit.c). cb runs on the calling thread; non-zero stops and is
 * returned. Returns 0 or KS_EPG.
 */
int store_open_requests(struct store *s, store_open_request_fn cb, void *ud);

/* One open command, as the deadline scanner sees it. */
struct store_command_ref {
    char command_id[37];
    char agent_id[129];
    uint32_t attempt;
    int64_t version;          /* stream version: the expected version of the
                                 scanner's next append */
    int64_t deliver_by_us;    /* 0: none */
    int64_t dispatched_at_us;
    int64_t started_at_us;
};
typedef int (*store_command_ref_fn)(const struct store_command_ref *ref,
                                    void *ud);

/*
 * Commands in `status` ("Dispatched", "Running", ...) whose deliver_by is
 * before due_before_us (0: all of them), oldest deadline first, at most
 * limit (0: 1000). cb runs on the calling thread; non-zero stops and is
 * returned. Returns 0 or KS_EPG.
 */
int store_scan_open(struct store *s, const char *status,
                    int64_t due_before_us, uint32_t limit,
                    store_command_ref_fn cb, void *ud);

/*
 * The commands of agent_id Dispatched (published, not claimed) whose last
 * dispatch is before dispatched_before_us (epoch us), the longest waiting
 * first, at most limit (0: 1000): what the broker's consumer guard
 * re-publishes when their delivery was lost. cb runs on the calling
 * thread; non-zero stops and is returned. Returns 0 or KS_EPG.
 */
int store_scan_dispatched(struct store *s, const char *agent_id,
                          int64_t dispatched_before_us, uint32_t limit,
                          store_command_ref_fn cb, void *ud);

/* Agents with commands published to them and not claimed since before
 * some time (store_scan_waiting). */
struct store_waiting {
    char agent_id[129];
    uint32_t commands;            /* how many wait so */
    int64_t oldest_dispatched_us; /* the earliest dispatch among them */
};
typedef int (*store_waiting_fn)(const struct store_waiting *w, void *ud);

/*
 * One call of cb per agent that has commands Dispatched (published, not
 * claimed) since before dispatched_before_us (epoch us), the longest
 * waiting first, at most limit agents (0: 1000). The broker's consumer
 * guard looks at those agents' consumers. cb runs on the calling thread;
 * non-zero stops and is returned. Returns 0 or KS_EPG.
 */
int store_scan_waiting(struct store *s, int64_t dispatched_before_us,
                       uint32_t limit, store_waiting_fn cb, void *ud);

/*
 * Agent registry projection (fed by the broker from KSCORE_AGENTS): insert
 * or replace the row, online = true, last_seen = heartbeat_at_us, labels
 * as a jsonb object. Returns 0, KS_EINVAL (no agent_id) or KS_EPG.
 */
int store_upsert_agent(struct store *s, const Ks__AgentInfo *info);

/*
 * The command of operator whose CommandRequested carried idempotency_key
 * (in Ks__Event.reason): a key is unique per operator (commands.operator,
 * '' for NULL), so another operator's same key is never found. Returns 0
 * with id_out (UUID text), KS_ENOTFOUND or KS_EPG.
 */
int store_command_by_key(struct store *s, const char *operator_,
                         const char *idempotency_key, char id_out[37]);

/*
 * The operator who requested batch batch_id ("batch-<uuid>"), into buf
 * (len bytes). 0, KS_ENOTFOUND, or a store error.
 */
int store_batch_operator(struct store *s, const char *batch_id, char *buf,
                         size_t len);

/*
 * History (`kscore list`): commands and batches, newest first (requested
 * at, then id, descending; ids compare bytewise). Without agents and
 * batch_id: the commands that are not batch targets, and the batches; with
 * agents: the commands on any of them, batch targets included (no batch
 * rows); with batch_id: that batch's targets. Every filter given must
 * hold: operator, statuses (any of, as stored: "Succeeded", "Running",
 * ...; a batch's are "Running", "Succeeded", "PartialFailure", "Failed",
 * "Cancelled", and "Completed" picks every ended one but Cancelled),
 * requested in
 * [since_us, until_us). The page starts after the cursor (cursor_at_us 0:
 * at the newest) and holds at most limit items (0: STORE_LIST_DEFAULT).
 * cb gets each item, borrowed for the call (argv: at most 32 elements of
 * at most 256 bytes, argv_truncated otherwise); non-zero stops and is
 * returned. 0 or a store error.
 */
#define STORE_LIST_DEFAULT 50
struct store_list_query {
    const char *const *agents;
    size_t n_agents;
    const char *operator_;          /* NULL or "": any */
    const char *const *statuses;
    size_t n_statuses;
    int64_t since_us, until_us;     /* 0: unbounded */
    const char *batch_id;           /* NULL or "": none */
    uint32_t limit;
    int64_t cursor_at_us;           /* the last item of the previous page */
    const char *cursor_id;
};
typedef int (*store_list_fn)(const Ks__ListItem *item, void *ud);
int store_list(struct store *s, const struct store_list_query *q,
               store_list_fn cb, void *ud);

/* ---- The command state machine (store/machine.c) ----------------------
 *
 * Every command moves Requested -> Dispatched (one or more attempts) ->
 * Started (the claim) -> exactly one terminal event, or ends before its
 * claim (Undeliverable, Cancelled, StartFailed from a failed precheck):
 *
 *   event                 may follow            ends in
 *   CommandRequested      (no command)          -
 *   CommandDispatched     Pending, Dispatched   -
 *   CommandStarted        Dispatched            -
 *   CommandStartFailed    Dispatched, Running   StartFailed
 *   CommandCompleted      Running               Succeeded, Failed,
 *                                               TimedOut, Cancelled
 *   CommandLost           Running               Lost
 *   CommandNotStarted     Running               NotStarted
 *   CommandUndeliverable  Pending, Dispatched   Undeliverable
 *   CommandCancelled      Pending, Dispatched   Cancelled
 *   anything else         any (the command must exist; CommandRejected
 *                         may name no command)   - (an annotation)
 *
 * A terminal event of a command that has ended is late: it is recorded as
 * a LateResult annotation (the report kept, the state unchanged), never as
 * a second terminal event; any other step the table does not allow is
 * refused (recorded as ReportRejected by store_append_checked). The
 * database enforces the core of it on every path: unique indexes allow one
 * terminal event and one CommandStarted per stream (migration 3).
 */
struct store_command_state {
    bool exists;               /* the command has been requested */
    Ks__CommandStatus status;  /* its status in the commands projection */
    char agent_id[129];        /* the agent it is addressed to */
    uint32_t attempt;          /* the attempt dispatched or claimed */
};

enum store_step {
    STORE_STEP_APPLY,     /* a step of the machine, or an annotation */
    STORE_STEP_LATE,      /* a terminal event after the end: LateResult */
    STORE_STEP_ILLEGAL,   /* not allowed here: ReportRejected */
    STORE_STEP_DUPLICATE, /* recorded before (same event_id): skipped */
    /* an annotation the caller's check chose not to keep (STORE_CHECK_DROP:
     * its sender is past its share of annotation rows): nothing written */
    STORE_STEP_DROPPED,
};

/*
 * What ev (its type, and for a terminal one its result's status) does to
 * a command in state st. Pure; any thread. Returns the verdict; on
 * STORE_STEP_APPLY *next_out is the command's status after it (unchanged
 * for an annotation); otherwise *why is a static phrase saying why.
 */
enum store_step store_command_step(const struct store_command_state *st,
                                   const Ks__Event *ev,
                                   Ks__CommandStatus *next_out,
                                   const char **why);

/* 1 if an event of this type ends a command (the table above). */
int store_event_is_terminal(const char *type);

/*
 * A caller's own rule for a reported event (the broker's: who may report
 * what), run under the lock before the state machine. Returns 0 to let the
 * machine decide, STORE_CHECK_DROP to refuse it and keep nothing (verdict
 * STORE_STEP_DROPPED: no annotation row; the broker's bound on annotation
 * rows per identity), any other non-zero value to refuse with *why
 * (static) saying why. It may run more than once for one event (a batch
 * decided again after a conflict).
 */
#define STORE_CHECK_DROP 1
typedef int (*store_check_fn)(const struct store_command_state *st,
                              const Ks__Event *ev, const char **why,
                              void *ud);

/*
 * Appends events that others report about existing commands (agents'
 * results), each decided against the record of its command (command-<id>,
 * derived from each event's command id; the event's own stream_id is
 * ignored): check (may be NULL) and store_command_step() per event in
 * input order, and each event appended as it is (APPLY), as a LateResult
 * (LATE) or as a ReportRejected (ILLEGAL), with an event about a command
 * that does not exist kept on the stream agent-<agent_id> instead (so a
 * forged id never creates a command stream), with the reason in
 * Event.reason. Events recorded before are skipped (DUPLICATE).
 * verdicts[i] (n entries, caller storage) says what became of events[i].
 * One event: first in one round trip, its command taken to be Running,
 * claimed by the report's agent at that attempt, and written only if its
 * commands row is so; if not, decided in a transaction that locks its
 * stream and reads its state (two round trips), as a call with batch
 * events is. Several: decided against states read without locks (or
 * assumed as for one) and appended only at the versions read, again
 * when a stream moved (store/checked.c). check may so be called more than
 * once for an event, with the state assumed and then with the one read.
 * Returns 0 (all decided and written), KS_EINVAL (an event lacks a UUID
 * event_id or command id, or a type; nothing written) or a store error
 * (KS_EPG ...; verdicts undefined, and an event written in the first
 * round trip stays written: retry the call, which finds it DUPLICATE).
 */
int store_append_checked(struct store *s, const Ks__Event *const *events,
                         size_t n, store_check_fn check, void *ud,
                         enum store_step *verdicts, size_t *dup_out);

/*
 * The one-event case of store_append_checked() when the caller knows the
 * command's state at a version of its stream (the broker recorded the
 * claim that put it there): decides ev against known in C (check, then
 * store_command_step()) and, when the verdict is APPLY, appends it at
 * expected version `version` of command-<ev->command_id> in one round trip
 * (append, projection and COMMIT in one pipeline). The expected version is
 * the fence: the stream is still at `version` only if nothing was
 * appended since, so the state is still `known`, and a hint that is wrong
 * or stale costs a conflict, never a wrong record.
 * Returns 0 (recorded: verdict APPLY), KS_EDUPLICATE (the event was
 * recorded before), KS_ECONFLICT (nothing written: the stream moved on,
 * or the verdict is not APPLY; decide it with store_append_checked()),
 * KS_EINVAL (no UUID event or command id) or a store error (nothing
 * written).
 */
int store_append_checked_at(struct store *s, const Ks__Event *ev,
                            const struct store_command_state *known,
                            int64_t version, store_check_fn check, void *ud);

/* ---- the group writer (store/writer.c) ----------------------------------
 *
 * Appends of many threads written together. A writer has n connections,
 * and one queue, and no thread of its own: a caller that finds a
 * connection free writes, on its own thread, every append queued (its own
 * alone when nobody else waits: an idle writer adds no latency, as
 * EventStoreDB's single writer flushes when its queue is empty); callers
 * that queue meanwhile wait, and the first of them writes, in one
 * transaction, what queued during the last (at most
 * STORE_WRITER_MAX_APPENDS appends and about 8 MiB of events), so commits
 * per append fall far below one under load. Two or more appends are one
 * statement (store__sql_write in migrations.c; a second one in the same
 * transaction for an append of a stream or command already in the first),
 * set-based, each append with its own verdict, so one append's conflict
 * never fails the others; one append alone is store_append()'s (cheaper
 * for one: test_store's test_writer_bench). More connections write side
 * by side only when one is busy; each splits the groups, and a group's
 * fixed cost is a large part of an append's, so one connection is the
 * default to measure against.
 *
 * Every guarantee of store_append() and store_append_claim() holds for
 * each append as if it were alone: the same return codes, the same
 * expected-version fence (two appends of one stream in one group are
 * decided in queue order), the same projection rows (kscore replay
 * rebuilds them), one commit that holds all of it or none. An append
 * returns only once its transaction's end is known.
 *
 * When the group's transaction fails as a whole, every append in it has
 * the group's code: a sick database (KS_EPGDOWN, KS_EPGREFUSED: nothing
 * written, unless in_doubt), after two more tries for a deadlock or a
 * serialization failure. Any other failure (a unique violation no check
 * foresaw) is the appends': they are then written one at a time, each
 * getting its own code.
 */
struct store_writer;
#define STORE_WRITER_MAX_APPENDS 512

/*
 * Opens n_conns (1..16) connections with conninfo and starts their
 * threads. 0, or KS_EUNAVAIL / KS_EINVAL with *errmsg (malloc'd, may be
 * NULL). Does not migrate (store_migrate() first).
 */
int store_writer_open(const char *conninfo, unsigned n_conns,
                      struct store_writer **out, char **errmsg);
/* Writes what is queued, stops the threads, closes. Appends asked for
 * after it began return KS_ESTOPPED. Accepts NULL. */
void store_writer_close(struct store_writer *w);

/* One append (borrowed for the call). */
struct store_write {
    const char *stream_id;
    int64_t expected_version; /* STORE_ANY, STORE_NO_STREAM or exactly n */
    const struct store_event *events; /* n >= 1, on stream_id */
    size_t n;
    /* NULL, or the claim's agent: store_append_claim()'s rules (the
     * stream must be "command-<uuid>"; KS_EDENIED, KS_ENOTFOUND). */
    const char *claim_agent;
    /* NULL, or called at most once, on the calling thread, once the
     * transaction holding the append is sent, as store_append_overlap()'s:
     * its work overlaps the commit. Not called when nothing was sent, when
     * the append's end came before the caller saw it sent, or when the
     * caller writes the group itself while others wait for the
     * connection (it would hold them up): then the caller does that work
     * after. */
    void (*between)(void *ud);
    void *ud;
};

/* What the writer says of one append besides its code. */
struct store_write_result {
    int64_t version;  /* 0: the stream's version after it (KS_EDUPLICATE:
                         its version now) */
    bool in_doubt;    /* store_in_doubt() of the append's transaction */
    char sqlstate[6]; /* store_last_sqlstate() of its failure, or "" */
    char error[256];  /* store_last_error() of its failure, or "" */
};

/*
 * Queues wr on w and waits for its verdict: the codes of store_append()
 * (and of store_append_claim() with claim_agent), KS_EINVAL / KS_ETOOBIG
 * (checked on the calling thread, nothing queued), or KS_ESTOPPED (the
 * writer is closing). *res (may be NULL) says more. Any thread; many at
 * once (that is the point).
 */
int store_writer_append(struct store_writer *w, const struct store_write *wr,
                        struct store_write_result *res);

/*
 * store_append_checked_at() through the writer: ev decided against known
 * in C, appended at `version` of command-<ev->command_id> only if the
 * verdict is APPLY. Same codes; *res (may be NULL) as above.
 */
int store_writer_checked_at(struct store_writer *w, const Ks__Event *ev,
                            const struct store_command_state *known,
                            int64_t version, store_check_fn check, void *ud,
                            struct store_write_result *res);


/* ---- output pieces (store/output.c, table command_output) -------------
 *
 * A running command's output, recorded in pieces as its agent sends them
 * (OutputChunk events, not kept in table events): each piece once, by
 * (command, stream, byte offset); the terminal event's
 * Output.chunked_bytes says how many bytes of each stream the pieces hold.
 */
struct store_output_chunk {
    const char *command_id; /* UUID text */
    const char *agent_id;   /* the sender (from its subject) */
    uint32_t attempt;
    uint32_t stream;        /* 1 stdout, 2 stderr */
    uint64_t offset;
    const uint8_t *data;
    size_t len;
};
/* The caller's rule for a piece, under its stream's lock (the broker's:
 * only the command's own agent, for the attempt it claimed). 0 or non-zero
 * with *why (static). */
typedef int (*store_output_check_fn)(const struct store_command_state *st,
                                     const struct store_output_chunk *c,
                                     const char **why, void *ud);
/*
 * Records pieces in one transaction, each decided by check (may be NULL)
 * against its command's state: verdicts[i] is STORE_STEP_APPLY (kept),
 * STORE_STEP_DUPLICATE (that offset was kept before) or STORE_STEP_ILLEGAL
 * (refused; whys[i], if whys is not NULL, says why; also for a command that
 * does not exist, and for a piece that overlaps one kept at another offset
 * of the same stream: each byte is kept once). Pieces of one command are
 * decided one at a time across connections (its stream row, locked).
 * 0, KS_EINVAL (a bad command id or stream; nothing written) or a store
 * error (nothing written: retry).
 */
int store_append_output(struct store *s, const struct store_output_chunk *chunks,
                        size_t n, store_output_check_fn check, void *ud,
                        enum store_step *verdicts, const char **whys);
/*
 * Files for kscore copy (store/blob.c, migrations 10, 11, 14), named by
 * their SHA-256, in parts of KS_BLOB_PART_BYTES numbered from 0. Each
 * part is charged to the operator who wrote it for as long as it is kept
 * (complete file or not), and the bounds are checked in the same
 * transaction as the write, against sums no other writer is changing, on
 * any connection of any broker: parallel uploads cannot pass them. Each
 * call is one short transaction (a part, or a few).
 *  store_blob_put: writes one part from operator_ (again, replacing it,
 *   until the file is complete; never after: then 0 and nothing written),
 *   if the operator's parts stay within bounds->operator_bytes and
 *   everyone's within bounds->total_bytes. 0, KS_ETOOBIG with
 *   *refusal_out (nothing written), or a store error.
 *  store_blob_room: whether a file of size bytes from operator_ would fit
 *   now (its parts already there count once): 0 or KS_ETOOBIG with
 *   *refusal_out. Advisory (a way to refuse before anything is sent):
 *   store_blob_put decides.
 *  store_blob_complete: 1 with *size_out (may be NULL) when the file is
 *   complete (checked and marked) and operator_ owns it (uploaded it, or
 *   sent it whole again: store_blob_prove), and marks it used now (kept
 *   files_unused_us of store_blob_expire from now); 2 with *size_out when
 *   it is complete but not operator_'s (a file is stored once, but
 *   named only by who showed it has it); 0 when not stored, or a store
 *   error.
 *  store_blob_prove: part (len bytes of data) of a complete file of n
 *   parts, sent by operator_, who does not own it, answered as a new
 *   upload's part would be (so that it tells nothing of what others
 *   stored): before the commit 0; at the commit (commit true) 1 when
 *   operator_ has sent every part, each the same bytes as the stored one
 *   (it owns the file from now on; n = 0: at once), -EBADMSG when one
 *   was not (or the file is gone: send it again), 0 when parts are
 *   missing; or a store error. bad: the part is not the file's whatever
 *   its bytes (the upload says another size than the stored file's).
 *   Nothing is written but the note of which
 *   parts operator_ sent (charged to nobody; kept copy_upload_keep at
 *   most, by store_blob_expire).
 *  store_blob_read: one part, *data_out (malloc'd) and *len_out, and its
 *   version *ver_out (may be NULL; another each time the part is
 *   written). 0, KS_ENOTFOUND, KS_ETOOBIG or a store error.
 *  store_blob_mark_complete: records that the parts make the file of that
 *   SHA-256 and size (the caller read them back and checked them),
 *   uploaded by operator_, if they are still the parts read: vers[i] is
 *   the version of part i (n = ks_blob_parts(size)). Parts past n are
 *   dropped. 1 (complete and operator_'s, now or before), 0 (a part was
 *   written since or by another operator, or the file is complete and
 *   not operator_'s: nothing marked) or a store error.
 *  store_blob_drop: forgets the parts of a file that is not complete (its
 *   check failed, or its upload was refused) that operator_ wrote (NULL:
 *   anyone), a few per transaction. 0 or a store error.
 *  store_blob_expire: one round of the broker's clean-up, at most limit
 *   (> 0) of each: deletes complete files not used (uploaded, or named by
 *   a copy accepted) for files_unused_us that no open batch names, and
 *   the parts of files not complete that were written more than
 *   parts_unwritten_us ago (a file deleted here: its parts, in later
 *   rounds), and notes of store_blob_prove as old. *files_out and
 *   *parts_out: how many (notes count as parts); fewer than limit of
 *   both: nothing more is due. 0 or a store error.
 */
struct store_blob_bounds {
    uint64_t operator_bytes; /* one operator's parts, in bytes */
    uint64_t total_bytes;    /* every operator's together */
};
enum store_blob_over {
    STORE_BLOB_OVER_OPERATOR = 1, /* bounds->operator_bytes */
    STORE_BLOB_OVER_TOTAL,        /* bounds->total_bytes */
};
struct store_blob_refusal {
    enum store_blob_over bound;
    uint64_t used_bytes; /* held against that bound now */
};
int store_blob_put(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                   uint32_t part, const void *data, size_t len,
                   const char *operator_,
                   const struct store_blob_bounds *bounds,
                   struct store_blob_refusal *refusal_out);
int store_blob_room(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                    uint64_t size, const char *operator_,
                    const struct store_blob_bounds *bounds,
                    struct store_blob_refusal *refusal_out);
int store_blob_complete(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                        const char *operator_, uint64_t *size_out);
int store_blob_prove(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                     uint32_t part, const void *data, size_t len, uint32_t n,
                     bool commit, bool bad, const char *operator_);
int store_blob_read(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                    uint32_t part, uint8_t **data_out, size_t *len_out,
                    uint64_t *ver_out);
int store_blob_mark_complete(struct store *s,
                             const uint8_t sha256[KS_SHA256_BYTES],
                             uint64_t size, const char *operator_,
                             const uint64_t *vers, uint32_t n);
int store_blob_drop(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                    const char *operator_);
int store_blob_expire(struct store *s, int64_t files_unused_us,
                      int64_t parts_unwritten_us, unsigned limit,
                      unsigned *files_out, unsigned *parts_out);

/*
 * Up to max bytes of one stream of a command's recorded pieces from
 * offset, as far as they follow on without a gap: *data_out (malloc'd, or
 * NULL when nothing) and *len_out. 0, KS_EINVAL, KS_EPG.
 */
int store_read_output(struct store *s, const char *command_id, uint32_t stream,
                      uint64_t offset, size_t max, uint8_t **data_out,
                      size_t *len_out);

/*
 * The message of the last error on this connection (libpq's or the
 * server's, one line; "" if none), for "PostgreSQL unreachable: <why>".
 * Valid until the next call on s.
 */
const char *store_last_error(struct store *s);
/* The SQLSTATE of the last error PostgreSQL sent ("" when the last error
 * had none: a lost connection). Valid until the next call on s. */
const char *store_last_sqlstate(struct store *s);
/* The condition name of a SQLSTATE of a sick database (store.h "Sick
 * database"; PostgreSQL 15 docs Appendix A): "disk_full" for 53100,
 * "read_only_sql_transaction" for 25006, ...; "" for any other. Pure. */
const char *store_sqlstate_name(const char *sqlstate);

/* ---- batch leases (store/batch_lease.c, table batch_leases) -----------
 *
 * One broker drives an open batch at a time: the one whose owner string is
 * in the batch's lease row and whose lease_until has not passed. The
 * driver extends the lease with every write (store_batch_append) and on a
 * timer (store_batch_renew); when it dies, its leases run out and another
 * broker takes the batches over (store_batch_adopt) and rebuilds them from
 * the record. Times are the database's clock (now()), so brokers' clocks
 * need not agree. owner: any text naming one broker process (at most
 * STORE_BATCH_OWNER_MAX bytes); "" is nobody.
 */
#define STORE_BATCH_OWNER_MAX 200

/* One batch of a store_batch_append() call. Borrowed. */
struct store_batch_lease {
    const char *batch_id;         /* "batch-<uuid>" */
    const char *reply_subject;    /* NULL or "": none. Kept from the */
    const char *progress_subject; /* call that creates the row only.  */
    int ended; /* 1: this call records the batch's end (lease closed) */
};

/*
 * Appends events as store_append_many() does, in one transaction that
 * first takes or extends owner's lease (lease_ms from the database's now)
 * on every batch of leases (creating the row of a batch never leased),
 * and commits only if all of them are owner's. A batch with ended set
 * keeps the row, closed (lease_until 'infinity'): nobody takes it again.
 *
 * Returns 0 (*dup_out, may be NULL: events skipped as recorded; an append
 * that committed before, whose answer was lost, is found again and
 * counted as duplicates), KS_ECONFLICT (a lease is another broker's or
 * closed, or a projection refused an event: nothing written), KS_EINVAL /
 * KS_ETOOBIG / KS_EPG as store_append_many() (nothing written).
 */
int store_batch_append(struct store *s, const char *owner, int lease_ms,
                       const struct store_batch_lease *leases,
                       size_t n_leases, const Ks__Event *const *events,
                       size_t n, size_t *dup_out);

/* Calls cb(owner, batch_id, ud) for every batch whose lease is held now
 * (lease_until in the future, not closed), ordered by owner: which broker
 * drives which batch (`kscore status` on a cluster). cb's strings are
 * borrowed. 0 or KS_EPG. */
typedef void (*store_batch_lease_fn)(const char *owner, const char *batch_id,
                                     void *ud);
int store_batch_leases_held(struct store *s, store_batch_lease_fn cb,
                            void *ud);

/* A lease as read back by store_batch_renew / store_batch_adopt. The
 * strings are borrowed for the callback. */
struct store_batch_held {
    const char *batch_id;
    const char *reply_subject;    /* "" if none */
    const char *progress_subject; /* "" if none */
    int cancel_requested;         /* 1: store_batch_request_cancel() */
};
typedef int (*store_batch_held_fn)(const struct store_batch_held *h,
                                   void *ud);

/*
 * Extends owner's open leases on the n batch_ids by lease_ms; cb (calling
 * thread) for each one still owner's. A batch not passed to cb is no
 * longer owner's. Returns 0, cb's non-zero value, KS_ETOOBIG or KS_EPG
 * (then nothing is known: do not drop anything).
 */
int store_batch_renew(struct store *s, const char *owner, int lease_ms,
                      const char *const *batch_ids, size_t n,
                      store_batch_held_fn cb, void *ud);

/*
 * Takes over at most limit (1..1000) open batches (batches.status
 * 'Running') whose lease has run out, for lease_ms: cb (calling thread)
 * for each one taken. Brokers adopting at once never take the same batch
 * (SKIP LOCKED). Returns 0, cb's non-zero value (the takeovers stand) or
 * KS_EPG.
 */
int store_batch_adopt(struct store *s, const char *owner, int lease_ms,
                      uint32_t limit, store_batch_held_fn cb, void *ud);

/*
 * Ends owner's open leases now, on the n batch_ids (batch_ids NULL: on
 * every batch), so any broker may adopt them at once (a clean stop, or a
 * driver that must rebuild a batch from the record). Returns 0 or KS_EPG.
 */
int store_batch_release(struct store *s, const char *owner,
                        const char *const *batch_ids, size_t n);

/*
 * `kscore cancel` of a batch this broker does not drive: if the batch is
 * open, appends ev (type BatchCancelRequested, stream = the batch id) to
 * its stream and flags its lease (cancel_requested), in one transaction;
 * the driver sees the flag when it renews, and a broker rebuilding the
 * batch sees the event. Returns 0, KS_ENOTFOUND (no open batch with this
 * id), KS_EINVAL (ev lacks ids) or KS_EPG.
 */
int store_batch_request_cancel(struct store *s, const Ks__Event *ev);

/* A command as store_command_states() reads it from the commands
 * projection. Borrowed for the callback. */
struct store_command_row {
    const char *command_id;
    Ks__CommandStatus status;
    uint32_t attempt; /* 0: never dispatched */
};
typedef int (*store_command_state_fn)(const struct store_command_row *c,
                                      void *ud);

/*
 * The commands among the n command_ids (UUID text) that exist, with their
 * status (only the terminal ones when terminal_only), in no order; cb on
 * the calling thread. Returns 0, cb's non-zero value, KS_EINVAL (not a
 * UUID), KS_ETOOBIG or KS_EPG.
 */
int store_command_states(struct store *s, const char *const *command_ids,
                         size_t n, int terminal_only,
                         store_command_state_fn cb, void *ud);

/* The raw PGconn, for callers that need an escape hatch (tests). The
 * pointer stays the same across reconnections. */
struct pg_conn;
void *store_pgconn(struct store *s);

#endif
