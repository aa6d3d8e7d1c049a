/* Private to broker/. */
#ifndef KSCORE_BROKER_INT_H
#define KSCORE_BROKER_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "agent.h"
#include "broker.h"
#include "store.h"

/* A client waiting for the terminal event of one command. */
struct broker__waiter {
    char *reply_subject;
    char agent_id[EVT_AGENT_ID_MAX + 1];
    bool live; /* ExecuteRequest.live_output: send recorded output on */
};

/* The state a claim this broker recorded left a command in (Running, by
 * agent_id, attempt) at stream version `version`: the recorder's one
 * round trip path for the command's end (store_append_checked_at). A hint
 * only: the version fences it. */
struct broker__claimed {
    int64_t version;
    uint32_t attempt;
    char agent_id[EVT_AGENT_ID_MAX + 1];
};

/* What the broker knows of one agent (from KSCORE_AGENTS). */
/* One agent process as its heartbeats show it (AgentInfo.instance_id). */
struct broker__instance {
    char id[40];
    char host[64];
    int32_t pid;
    int64_t started_at_us;
    int64_t seen_mono_us;
};

/*
 * What one heartbeat of an agent process listed (AgentInfo.holds, only
 * when holds_complete): the commands it holds, sorted 16-byte ids, with
 * the heartbeat's process and number. A pool's ids share one (refs).
 * Immutable; refs under b->mu (registry.c).
 */
struct broker__holds {
    unsigned refs;
    char instance[37];
    uint64_t seq;
    size_t n;
    uint8_t ids[][16];
};

struct broker__agent {
    Ks__AgentInfo *info;
    /* The latest live heartbeat's list (info has it stripped); NULL: none
     * complete, or an agent from before AgentInfo.holds. */
    struct broker__holds *holds;
    int64_t holds_mono_us;  /* when the heartbeat that listed holds was put */
    int64_t seen_mono_us;
    int64_t stored_mono_us; /* last write of the agents projection */
    bool labels_signed;     /* info->labels are the attested ones */
    /* An attestation of this id verified once since this broker started
     * (or since the id was revoked: agent_forget drops the entry): from
     * then on its entries without a valid one get no labels, whatever
     * require_signed_labels says (labels_settle). */
    bool ever_signed;
    bool unsigned_warned;   /* logged that it has no valid attestation */
    /* The last attestation that verified (its text, malloc'd, and
     * signature): the same one in the next heartbeat needs no Ed25519
     * verification (about 0.2 ms each, at every heartbeat of every
     * agent). */
    char *attest_text;
    uint8_t attest_sig[EVT_SIGNATURE_BYTES];
    /* registry.c labels_settle: the time of the entry's own attestation
     * when it verified (0: none), and the relabel whose labels it has
     * (labels.c; relabel_at_us 0: none): by whom, when. */
    int64_t entry_at_us, relabel_at_us;
    char relabel_by[64];
    /* registry.c: the last two processes that heartbeat this id (cur: the
     * latest), and when their heartbeats last interleaved (0: never). */
    struct broker__instance cur, other;
    int64_t dup_mono_us;
    bool dup_logged;
};

/* Heartbeats of two instances of one id interleaved this recently: the id
 * is `duplicate` (us). */
#define BROKER_DUP_WINDOW_US ((int64_t)EVT_AGENT_TTL_MS * 1000)


/* A client that follows a command's output live through another broker
 * (notice.c). */
struct broker__follower {
    char *subject;  /* where the pieces go */
    bool exec;      /* an exec's inbox (ExecuteReply), else BatchProgress */
    char agent_id[EVT_AGENT_ID_MAX + 1];
    int64_t added_mono_us;
};
/* At most this many are kept (past it all are dropped: a piece that does
 * not reach the client live is read from the record by it). */
#define BROKER_REMOTE_LIVE_MAX 65536

/* Claims and ExecuteCommand are served by this many workers each, every
 * one with its own thread (and a PostgreSQL connection for its reads):
 * each waits for its append's commit, and the appends of all of them in
 * flight share the group writer's commits. Claims reach theirs through
 * a fair queue (fairq.c), ExecuteCommand through the intake (admit.c). */
#define BROKER_CLAIM_WORKERS 16
#define BROKER_EXEC_WORKERS 8
/* How long an ExecuteCommand's record waits for a table lock held
 * elsewhere, tried again after each lock_timeout (broker.c on_execute;
 * ms). */
#define BROKER_LOCKED_WAIT_MS 60000
/* An exec worker's own publish of a command: one try of this long (ms);
 * a stream that does not take it by then (a PubAck takes milliseconds;
 * an election takes seconds) gets it from the publisher (publisher.c). */
#define BROKER_PUBLISH_INLINE_MS 1000
/* How long a lookup of an id the registry view lacks waits for a watch
 * that has not delivered its initial values (ms; registry.c). */
#define BROKER_REG_CATCHUP_WAIT_MS 10000
/* How long the scanner's and the registry's statements wait for a lock
 * (store_set_lock_timeout; ms): each serves every command or agent in
 * turn, so one stream or agents row held by a stalled transaction (a
 * paused broker's) fails alone and is tried again next pass, instead of
 * stopping every deadline or every agent's row behind it. */
#define BROKER_BG_LOCK_TIMEOUT_MS 1000
/* How long a JetStream API request about the registry bucket waits (ms;
 * evt_agents_kv): the registry watch is made again when its node dies,
 * and when that node led the JetStream meta group no request is answered
 * until a new leader is elected; with nats.c's 5 s a request sent just
 * before the election ended waited out its 5 s (F04: a broker deaf to
 * the registry for 10 s and more), asked every 2 s it is answered within
 * 2.5 s of the election. */
#define BROKER_KV_WAIT_MS 2000
/* Workers of each "ask again" subject (execute-again, claim.again). */
#define BROKER_AGAIN_WORKERS 4
/* Connections of the group writer (store.h): the appends of the workers
 * above and of the recorder's single results share its transactions. */
#define BROKER_WRITER_CONNS 1
/* The longest a request may be expected to wait in kscore's own queues
 * (the intake and the claims), and to start at all when it gave no
 * delivery deadline, before it is refused as busy (admit.c; ms). From
 * measurements (perf/BASELINE.md "Overload", an A/B of 250 against 500 at
 * 300 commands/s on this 2-core machine): with 500 the accepted p99 was
 * 0.8-1.5 s, with 250 0.65-0.78 s, what is accepted still ends within
 * 1 s. */
#define BROKER_QUEUE_MAX_MS 250

/* One API subscription: the handler behind the boundary guard (broker.c
 * api_guard: a reply address under the caller's own inbox, else the
 * request is dropped), served in turn per identity by fq's workers (with
 * the worker's own ud, else this ud). */
struct broker__route {
    struct broker *b;
    natsMsgHandler cb;
    void *ud;
    struct broker__fairq *fq;
};
/* The broker's fair queues (broker.c): which requests share one, and so
 * its workers and their turns. */
enum broker__fq {
    BROKER_FQ_EXECUTE,    /* kscore.api.v1.execute: the intake (1) */
    BROKER_FQ_EXEC_AGAIN, /* execute-again: exec_again's workers */
    BROKER_FQ_CLAIM,      /* claim: the claimers */
    BROKER_FQ_CLAIM_AGAIN, /* claim.again: claim_again's workers */
    BROKER_FQ_MISC,       /* get, events, cancel, agents, list, label, logs */
    BROKER_FQ_BLOB,       /* upload and fetch (blob.c) */
    BROKER_FQ_FOLLOW,     /* follow (parked long polls) */
    BROKER_FQ_BATCH,      /* batch */
    BROKER_FQ__N
};
#define BROKER_MAX_ROUTES 48

struct broker__worker {
    struct broker *b;
    struct store *st;
    /* An exec worker: when its command's publish began, 0 while it is
     * not publishing (admission: broker/admit.c stall_note). */
    _Atomic int64_t publishing_us;
    /* Its last request's publish was handed to the publisher (the
     * stream did not take it at once): its time was the stream's, not a
     * sample of kscore's own (admit.c intake_serve). Its own thread. */
    bool publish_handed;
};

/*
 * What the lower parts of the broker (the recorder, the scanner, a cancel,
 * the notices of other brokers) tell the upper ones (the waiting execs,
 * the live followers, the batches: broker.c, batch.c) without calling up
 * into them: broker_run sets these before any thread starts; each runs
 * on its caller's thread.
 */
struct broker__up {
    /* A terminal event of command_id was recorded here (recorder, claim
     * handler, scanner, cancel); result may be NULL (then only its status
     * is known to be terminal). */
    void (*ended)(struct broker *b, const char *command_id,
                  const Ks__CommandResult *result);
    /* Another broker recorded command_id's end (notice.c). */
    void (*remote_ended)(struct broker *b, const char *command_id);
    /* Another broker recorded a cancel of batch_id (notice.c). */
    void (*remote_batch_cancel)(struct broker *b, const char *batch_id);
};

struct broker {
    const struct broker_opts *opts;
    struct broker__up up;
    struct evt_conn *nc;
    kvStore *kv;

    struct store *st_setup, *st_misc, *st_rec, *st_reg, *st_scan,
        *st_follow;
    /* The dispatch records, claims and the recorder's single results are
     * written through it (store.h "the group writer"). */
    struct store_writer *writer;
    natsSubscription *sub_rec;
    pthread_mutex_t misc_mu;    /* st_misc: get, events, cancel */

    pthread_mutex_t mu;         /* waiters, agents, recorder queue */
    struct ks_map waiters;      /* command_id -> struct broker__waiter * */
    struct ks_map live;         /* command_id -> subject (batch live output) */
    /* command_id -> struct broker__out_caps * (output.c): the caps of the
     * commands that may still send output; and when a piece past one was
     * last logged (mono us). */
    struct ks_map out_caps;
    int64_t out_caps_logged_us;
    struct ks_map claimed;      /* command_id -> struct broker__claimed * */
    struct ks_map keys_seen;    /* idempotency keys executed here (set) */
    struct ks_map agents;       /* agent_id -> struct broker__agent * */
    /* (mu) The brokers heard in the registry: beacon id -> int64_t *
     * (mono us, last heard), and this broker's own beacon id
     * (registry.c; broker__guard_owner). */
    struct ks_map brokers;
    char beacon_id[37];
    int64_t reg_watch_mono_us;  /* (mu) when the registry last (re)started
                                   its watch (registry.c) */
    /* (mu) When that watch had delivered its initial values (the latest
     * entry of every id, each dated by its put: registry_main), 0 before:
     * no one is judged offline until then. */
    int64_t reg_caught_up_mono_us;
    /* A registry watch of this process has delivered its initial values
     * once: the view holds every id registered before this start (a watch
     * made again later keeps the ids it had: broker__agent_lookup waits
     * only for the first). */
    atomic_bool reg_loaded;
    /* (mu) Whether the bucket took this broker's last beacon (its PubAck
     * came), and since when it has without a failure: no heartbeat lands
     * while it takes none, so no agent's silence counts from before then
     * (broker__heard_locked). */
    bool reg_beacon_ok;
    int64_t reg_up_mono_us;
    /* (mu) How long the bucket took no beacon before reg_up_mono_us (from
     * the first beacon it failed); INT64_MAX / 4 until it came back after
     * a failure seen by this broker (at the start nobody knows how long
     * heartbeats were lost). */
    int64_t reg_outage_us;
    /* (mu) when the registry watch last delivered an entry: with agents
     * heartbeating every EVT_HEARTBEAT_MS, a longer silence is a dead
     * watch (a cluster node gone, the bucket without a leader), not dead
     * agents (broker__registry_deaf). */
    int64_t reg_entry_mono_us;
    /* (mu) when the view was last whole: an entry of a watch past its
     * initial values, or the end of them. A new watch's replay leaves it
     * where the dead watch left it (registry.c view_instant_locked). */
    int64_t reg_fresh_mono_us;
    /* The pause watch's last tick (scanner.c pause_main, every 100 ms;
     * atomic), and (mu) when it last found it had not run for over
     * BROKER_PAUSE_US: a broker that was paused (SIGSTOP, a frozen VM,
     * starved) holds heartbeat times that are stale only because it did
     * not read, and judges nobody by silence until its registry view is
     * fresh again: the registry thread sets woke_mono_us back to 0 once
     * its watch has delivered this broker's own beacon put after the wake
     * and BROKER_WAKE_FRESH_US has passed (broker__registry_deaf). */
    _Atomic int64_t tick_mono_us;
    int64_t woke_mono_us;
    /* (atomic) when the pause watch last found a pause, never set back:
     * a time measured across it is the pause's (admit.c paused_since). */
    _Atomic int64_t paused_mono_us;

    pthread_t rec_thread, reg_thread, scan_thread, pause_thread;
    bool rec_started, reg_started, scan_started, pause_started;
    /* Parked long polls of kscore.api.v1.follow, served by the follow
     * thread with st_follow (broker.c on_follow). */
    pthread_mutex_t follow_mu;
    pthread_cond_t follow_cond;
    struct broker__long_poll *followers;
    pthread_t follow_thread;
    bool follow_started;
    volatile int stopping;

    struct agent *local;
    int64_t started_mono_us;
    int64_t connected_since_mono_us; /* scanner: 0 while NATS is down */
    /* scanner.c: Running commands no heartbeat of their claimer lists any
     * more (command id -> struct scan_unlisted *), waiting for the
     * recorder to take what the event stream held when that was seen.
     * Scanner thread only. */
    struct ks_map unlisted;
    /* scanner.c: the claim (claiming process, first heartbeat that must
     * list it) of each Running command on a heartbeating agent, read once
     * from its stream: a claim never changes (command id -> struct
     * scan_claim *). Scanner thread only. */
    struct ks_map scan_claims;
    struct broker__worker claimers[BROKER_CLAIM_WORKERS];
    struct broker__worker executors[BROKER_EXEC_WORKERS];
    /* kscore.api.v1.execute-again: every broker gets each ask (a client
     * asks again there when an ask went unanswered), served by one of
     * BROKER_AGAIN_WORKERS here (a queue group of this broker's own,
     * again_queue): one ask that waits (a claim held up by a row lock)
     * holds up no other. */
    struct broker__worker exec_again[BROKER_AGAIN_WORKERS];
    /* kscore.api.v1.claim.again: likewise. */
    struct broker__worker claim_again[BROKER_AGAIN_WORKERS];
    char again_queue[64]; /* "kscore-again-<instance_id>" */
    struct evt_signer *signer;     /* signs every command dispatched */
    struct broker__policy *policy; /* NULL: no policy file */
    natsSubscription *sub_advisory;
    struct evt_verifier *local_trust; /* in-process agents trust signer */

    struct broker__route routes[BROKER_MAX_ROUTES];
    int n_routes;
    /* Every route's subscription; and the fair queues they feed. */
    natsSubscription *route_subs[BROKER_MAX_ROUTES];
    struct broker__fairq *fq[BROKER_FQ__N];
    int64_t bad_reply_logged_us; /* rate limit of that log line */
    /* The NATS link answered nothing for BROKER_LINK_TIMEOUT_MS while
     * nats.c said CONNECTED (broker.c link_dead): the broker stops. */
    struct evt_link_watch *link_watch;
    atomic_bool link_dead;
    /* recorder.c: results cannot be recorded now (PostgreSQL refuses
     * writes or is unreachable). The agents' queues then look fuller than
     * they are (what ended is not recorded yet), so admit.c refuses no
     * request as busy meanwhile: the worker's append says the real cause. */
    atomic_bool rec_stalled;
    /* recorder.c (ks_mono_us, atomic): when its pull or its append last
     * failed (0: never). Ends wait meanwhile: admit.c results_stall_us. */
    _Atomic int64_t rec_trouble_us;
    /* registry.c: dead registry watches being destroyed off the registry
     * thread (watch_let_go); broker__registry_stop waits for them. */
    atomic_int reg_reaping;

    struct broker__guard *guard;     /* stall.c */
    struct broker__publisher *publisher; /* publisher.c */
    struct broker__batches *batches; /* batch.c */
    struct broker__admit *admit;     /* admit.c: in flight, the intake */
    struct store *st_batch;

    /* notice.c: ends and batch cancels recorded by another broker. */
    natsSubscription *sub_notice;
    struct store *st_notice; /* its delivery thread's reads */
    /* blob.c: kscore copy's uploads and fetches, on a store connection of
     * their own (opened at the first), one at a time under blob_mu. */
    struct store *st_blob;
    pthread_mutex_t blob_mu;
    uint64_t *blob_fetched; /* (blob_mu) the parts fetched lately */
    char instance_id[37];    /* this process in its notices */
    bool notice_on;          /* subscribed: publish notices too */
    /* (mu) command_id -> struct broker__follower *: clients following a
     * command live through another broker (its follow notice): a piece
     * recorded here goes to them directly. */
    struct ks_map remote_live;
    /* labels.c: (mu) the newest relabel of each subject, as the record
     * has them; when they were last read; dirty: read them again (another
     * broker's notice). */
    struct ks_map relabels;
    int64_t relabels_loaded_mono_us;
    atomic_bool relabels_dirty;
    /* budget.c: annotation rows per identity. */
    struct broker__budget *budget;
};

/* What labels_settle (registry.c) decided an entry's labels came from. */
struct broker__settled {
    int64_t entry_at_us; /* its own attestation's time, when valid; 0 */
    bool relabelled;     /* a relabel's (labels.c): */
    char by[64];         /* its operator */
    int64_t at_us;       /* its time */
};

/*
 * labels.c: relabels (kscore agent label) and a command's labels.
 *
 * broker__relabels_load: reads the newest relabel of every subject from
 * the record into b->relabels (replacing them; one not signed by this
 * broker's key is left out and logged). 0 or a store error (kept as it
 * was). Before the registry thread starts, then on that thread.
 * broker__relabels_due: whether to load again (another broker recorded
 * one: BROKER_NOTICE_RELABEL; or BROKER_RELABEL_RELOAD_US have passed).
 * broker__relabels_free: teardown.
 *
 * broker__relabel_settle: when subject (an agent id, or
 * "pool.<pool>/<size>") has a relabel at least as new as entry_at_us
 * (INT64_MIN: the entry has no valid attestation), replaces info's
 * labels by a copy of its labels, fills out's relabelled, by, at_us and
 * returns true. Any thread.
 *
 * broker__command_labels: agent_id's labels as the registry has them,
 * sorted by name, copied into out (none: n 0); release with
 * broker__labels_release. For Command.labels.
 *
 * broker__handle_label: kscore.api.v1.label (on_misc, with st).
 */
#define BROKER_RELABEL_RELOAD_US (60 * INT64_C(1000000))
struct broker__labels {
    Ks__EnvVar **v;
    size_t n;
};
int broker__relabels_load(struct broker *b, struct store *st);
bool broker__relabels_due(struct broker *b);
void broker__relabels_free(struct broker *b);
bool broker__relabel_settle(struct broker *b, const char *subject,
                            int64_t entry_at_us, Ks__AgentInfo *info,
                            struct broker__settled *out);
void broker__command_labels(struct broker *b, const char *agent_id,
                            struct broker__labels *out);
void broker__labels_release(struct broker__labels *l);
void broker__handle_label(struct broker *b, struct store *st, natsMsg *msg);
/* The time a broker signs its in-process agents' labels as of (the
 * epoch, 1 us): every relabel of them is newer. */
#define BROKER_LOCAL_ATTEST_AT_US 1

/* Fills the envelope of a new event: fresh event_id, stream, type, time. */
void broker__event_init(Ks__Event *ev, char event_id[37], char *stream_id,
                        const char *type, const char *command_id);

/*
 * What a client is told of a store error rc on st, into buf:
 * "PostgreSQL unreachable: <why>" (KS_EPGDOWN), "PostgreSQL refuses writes
 * (SQLSTATE <s>): <why>" (KS_EPGREFUSED), "PostgreSQL error: <why>"
 * (KS_EPG), else ks_strerror(rc). Returns buf.
 */
const char *broker__store_error(struct store *st, int rc, char *buf,
                                size_t len);
/* The same for an append the group writer failed (its result). */
const char *broker__write_error(const struct store_write_result *res, int rc,
                                char *buf, size_t len);

/* Sends m to subject (a client's inbox; nothing when empty), in parts
 * when larger than one NATS message. A failure is logged. */
void broker__reply_msg(struct broker *b, const char *subject,
                       const ProtobufCMessage *m);

/* Answers msg with an empty reply of type d (every kscore reply has
 * error_code and error as fields 1 and 2) carrying code and text. */
void broker__reply_error(struct broker *b, natsMsg *msg,
                         const ProtobufCMessageDescriptor *d, int code,
                         const char *text);

/* Notes the state a granted claim left command_id in (any thread; takes
 * mu). At most BROKER_CLAIMED_MAX are kept: past it the hints are dropped
 * (a missing hint only costs the recorder its checked path). */
#define BROKER_CLAIMED_MAX 65536
void broker__claimed_put(struct broker *b, const char *command_id,
                         const char *agent_id, uint32_t attempt,
                         int64_t version);
/* true if this broker was asked by operator_ to execute with idempotency
 * key `key` before (of the last BROKER_KEYS_SEEN_MAX; then forgotten), and
 * notes it. Keys are per operator (store_command_by_key). Any thread;
 * takes mu. */
#define BROKER_KEYS_SEEN_MAX 65536
bool broker__key_seen(struct broker *b, const char *operator_,
                      const char *key);
/* Removes and returns command_id's hint (the caller frees it), or NULL. */
struct broker__claimed *broker__claimed_take(struct broker *b,
                                             const char *command_id);

/* Frees what waiters.c holds (the waiters, claim hints, keys seen). */
void broker__waiters_release(struct broker *b);

/* Tells every client waiting on this broker for a result something it must
 * know now (ExecuteReply.notice: text, e.g. why the result cannot come;
 * the recorder's stall, recorder.c). A reply with no result: the clients
 * keep waiting. Any thread; takes b->mu. */
void broker__waiters_notice(struct broker *b, const char *text);
/* Replies to the client waiting for command_id, if any, with result.
 * true if one waited here. */
bool broker__reply_waiter(struct broker *b, const char *command_id,
                          const Ks__CommandResult *result, int error_code,
                          const char *error);

/*
 * A terminal event of command_id has been recorded (any thread: recorder,
 * claim handler, scanner, cancel): answers the waiting client and tells the
 * command's batch, if any (b->up.ended, broker.c). result may be NULL
 * (then only its status is known to be terminal).
 */
static inline void
broker__command_ended(struct broker *b, const char *command_id,
                      const Ks__CommandResult *result)
{
    b->up.ended(b, command_id, result);
}

/* Fills the two events that start a command: CommandRequested (v1, with
 * cmd) and CommandDispatched (v2, attempt 1, first attempt's deadline).
 * stream and ids are caller storage. */
void broker__start_events(Ks__Event *req_ev, Ks__Event *disp_ev,
                          char ids[2][37], char *stream, Ks__Command *cmd,
                          const char *idempotency_key);

/* 1 if id is "batch-<uuid>". */
int broker__is_batch_id(const char *id);
/* 1 if subject is method's, with or without the operator token. */
int broker__is_method(const char *subject, const char *method);
/* The operator a request came from: the subject's last token (events.h
 * "API subjects"); static or the message's storage. */
const char *broker__operator_of(natsMsg *msg);

/* The operator policy (policy.c). NULL policy: everything allowed. */
struct broker__policy;
/* Reads path once (broker_policy_read), its SHA-256 into hex, and parses
 * those bytes: so hex names exactly what *out holds. 0, -errno (missing,
 * unreadable), KS_ETOOBIG, KS_EINVAL (not a policy; an empty path), with
 * *errmsg. */
int broker__policy_load(const char *path, struct broker__policy **out,
                        char hex[BROKER_POLICY_DIGEST_HEX], char **errmsg);
void broker__policy_free(struct broker__policy *p);
/* Logs which policy the broker loaded (path NULL: none) and, with a
 * state_dir, writes BROKER_POLICY_NOTE there (broker.h); a note that
 * cannot be written is logged, not fatal: the policy is enforced all the
 * same, and status then says it cannot tell. */
void broker__policy_note(const char *state_dir, const char *path,
                         const char *hex);
/* 0, or KS_EDENIED with one line in why. agent and spec NULL: a read.
 * A rule with "executables" allows argv[0] in it, and only the variables
 * it lists in "env" (env and sealed_env). */
int broker__policy_check(const struct broker__policy *p, const char *op,
                         const Ks__AgentInfo *agent,
                         const Ks__CommandSpec *spec, char *why, size_t len);
/* Whether op may upload files for kscore copy (kscore.api.v1.upload):
 * only an operator the policy lets copy to some agent (a "run" rule
 * without "executables" that grants root: see policy.c), so that storage
 * goes to no one who could not use it. 0, or KS_EDENIED with why. */
int broker__policy_check_upload(const struct broker__policy *p,
                                const char *op, char *why, size_t len);
/* Whether op may read a record: its own (owner == op), or one about an
 * agent a "read" rule of op matches; every_agent: all records at once
 * (needs a read rule on agents "*"). agent may be NULL (unknown agent:
 * only rules on "*" match). 0, or KS_EDENIED with one line in why. */
int broker__policy_check_read(const struct broker__policy *p, const char *op,
                              const char *owner, const Ks__AgentInfo *agent,
                              bool every_agent, char *why, size_t len);
/* Whether op may change an agent's labels from before's to after's
 * (kscore agent label): a rule that lists "label" in "can" and whose
 * "agents" match both. 0, or KS_EDENIED with why. */
int broker__policy_check_label(const struct broker__policy *p, const char *op,
                               const Ks__AgentInfo *before,
                               const Ks__AgentInfo *after, char *why,
                               size_t len);
/* Whether op may act on (cancel) a batch requested by owner: its own, or
 * with a "run" rule on agents "*". 0, or KS_EDENIED with why. */
int broker__policy_check_batch(const struct broker__policy *p,
                               const char *op, const char *owner, char *why,
                               size_t len);
/* Records RequestDenied on stream operator-<op>. */
void broker__record_denied(struct broker *b, struct store *st, const char *op,
                           const char *agent_id, const Ks__CommandSpec *spec,
                           const char *why);
/* A copy of the registry's info on agent_id, or NULL (free with
 * ks__agent_info__free_unpacked). Any thread. */
Ks__AgentInfo *broker__agent_info(struct broker *b, const char *agent_id);
/* The pool agent_id's commands are published through (AgentInfo.pool, as
 * the registry last saw it) into buf (>= EVT_AGENT_ID_MAX + 1); "" when it
 * has none or is unknown (then its own subject: evt_cmd_subject). Any
 * thread. */
void broker__agent_pool(struct broker *b, const char *agent_id, char *buf,
                        size_t len);
/* As broker__agent_pool; 1 if the registry has an entry for agent_id, 0
 * if not. */
int broker__agent_pool_known(struct broker *b, const char *agent_id,
                             char *buf, size_t len);
/*
 * true when this broker cannot tell a silent agent from a deaf registry:
 * its registry watch (re)started and has not delivered its initial values
 * yet, or has delivered nothing, not even this broker's own beacon, for
 * more than 2 x EVT_HEARTBEAT_MS (a cluster node died under it), or the
 * bucket did not take this broker's last beacon (no leader, no quorum).
 * Each agent's last heartbeat is dated by its put in the bucket (server
 * time, on this broker's monotonic clock), so an agent that stopped while
 * the watch was dead is silent since then once the new watch has its
 * initial values (F04), and a silence counts only from when the bucket
 * took puts again (broker__heard_locked).
 * Then nobody is judged offline or Lost by silence: the delivery deadline
 * decides. Any thread.
 */
bool broker__registry_deaf(struct broker *b);
/* Whether agent_id is silent for at least age_us (us, > 0), or unknown
 * (never heard, or forgotten by `kscore agent revoke`), in a registry
 * view that is not deaf (broker__registry_deaf): the age and
 * the deafness judged together, under one hold of b->mu at one instant,
 * so that a thread held up between two looks never judges an old age
 * with a view that became fresh meanwhile. Any thread; takes b->mu. */
bool broker__silent_past(struct broker *b, const char *agent_id,
                         int64_t age_us);
/* When agent a was last heard, for judging its silence, under b->mu: its
 * last heartbeat's put, or when the registry bucket last began taking
 * puts again, whichever is later (a silence while no heartbeat could land
 * says nothing of the agent). Mono us. */
static inline int64_t
broker__heard_locked(const struct broker *b, const struct broker__agent *a)
{
    if (a->seen_mono_us >= b->reg_up_mono_us)
        return a->seen_mono_us;
    /* Heard before the bucket came back: its silence counts without the
     * outage (an agent that stopped before it is not forgiven the whole
     * silence again by a one-beacon hiccup: F04 showed a stopped agent
     * online 20 s on), never from later than the bucket's return. */
    int64_t shifted = a->seen_mono_us + b->reg_outage_us;
    return shifted < b->reg_up_mono_us ? shifted : b->reg_up_mono_us;
}
/* A pause-watch tick later than this after the last one is a pause. */
#define BROKER_PAUSE_US INT64_C(1000000)
/* After a pause, nobody is judged by silence for at least this long, and
 * until the registry view has caught up (registry.c): agents paused along
 * with the broker (its --local-agents, a frozen host) heartbeat twice
 * meanwhile, so what is silent then really is. */
#define BROKER_WAKE_FRESH_US (3 * (int64_t)EVT_HEARTBEAT_MS * 1000)
/* Registry keys of the brokers' beacons (registry.c): no agent id has a
 * dot, and "_broker." is no pool key. */
#define BROKER_BEACON_PREFIX "_broker."
/* The consumer an agent id's commands come through, as the registry's
 * provisioner makes it from the id's entry (its own "agent-<id>", or its
 * pool's "pool-<pool>"), and the slots of what serves it: the commands
 * its process runs or holds, whichever its heartbeat says more of (its
 * running count; its holds list, AgentInfo.holds: claims sent, ends not
 * in the stream yet; a pool's: every entry's summed), and its
 * max_concurrent. */
struct broker__consumer_of {
    struct evt_agent_consumer ac;
    int64_t heard_us; /* mono: when its last heartbeat came */
    uint32_t running, max_concurrent; /* running: runs or holds */
};
/* 0 with *out, or KS_ENOTFOUND (not in the registry). Takes b->mu. */
int broker__consumer_of(struct broker *b, const char *agent_id,
                        struct broker__consumer_of *out);

/* Makes the streams and the registry bucket (evt_setup_replicas), opens
 * the bucket (b->kv) and makes the recorder's consumer, and on a cluster
 * (replicas > 1) waits for each until JetStream answers through its
 * leader, up to BROKER_JS_WAIT_MS, logging what it waits for every
 * BROKER_JS_SAY_US (jsready.c). 0, or the last step's code with *errmsg. */
#define BROKER_JS_SAY_US (5 * INT64_C(1000000))
int broker__jetstream_ready(struct broker *b, char **errmsg);
/* Runs fn until it succeeds; on a cluster, while it fails as JetStream
 * does in an election (KS_ENATS, KS_EUNAVAIL, KS_ETIMEDOUT), again every
 * 250 ms for up to BROKER_JS_WAIT_MS, logging what (a part's name) and
 * fn's *why every BROKER_JS_SAY_US. 0, or fn's last code with *errmsg.
 * A leader elected a moment ago can still change (the nodes that come
 * back rejoin): what subscribes after the ready check waits the same. */
int broker__js_wait(struct broker *b, const char *what,
                    int (*fn)(struct broker *b, char **why), char **errmsg);

/* Whether this broker is the one to repair consumer name: of the
 * brokers heard in the registry within EVT_AGENT_TTL_MS (their beacons),
 * this one has the highest rendezvous score for name (itself always
 * counts). Every broker gets the same answer from the same beacons, so
 * one repairs and the others stand by. A broker whose registry view is
 * not fresh (broker__registry_deaf) judges the beacons' ages as of its
 * view's last entry, not now, so it agrees with the others. Takes
 * b->mu. */
bool broker__guard_owner(struct broker *b, const char *name);

/* The publisher (publisher.c): commands recorded whose publish the
 * stream did not take at once (its leader elected), tried again on a
 * thread of its own, a window at a time, oldest first, each until 0.5 s
 * before its attempt's deadline (deliver_by_us, epoch us; then the
 * scanner's) or before the stream's duplicate window from now ends,
 * whichever is first; one the stream refuses for good (an error PubAck
 * other than 503, too large) at once. Whatever it gives up stays
 * Dispatched: the scanner's. _start: 0, -ENOMEM or KS_EINTERNAL. _stop
 * (after the exec workers stopped): what is queued is tried once more
 * (the window being published is cut at PUBLISHER_WINDOW_MS), then
 * dropped; its thread joined. _free (after every thread that may ask
 * _busy: the batches, admission): stops it if need be and frees it.
 * _busy: anything queued or being published (the exec workers then queue
 * theirs behind it). _later: queues a copy of cmd (the caller keeps cmd);
 * 0, -ENOMEM, kproto_pack's error, KS_EUNAVAIL (stopping, or no
 * publisher). Any thread. */
struct broker__publisher;
int broker__publisher_start(struct broker *b);
void broker__publisher_stop(struct broker *b);
void broker__publisher_free(struct broker *b);
bool broker__publisher_busy(struct broker *b);
int broker__publish_later(struct broker *b, const Ks__Command *cmd,
                          const char *pool, int64_t deliver_by_us);

/* The consumer guard (stall.c): notices a consumer of KSCORE_CMDS that
 * has work for an agent with free slots and delivers nothing, and repairs
 * it. Its own thread and PostgreSQL connection. */
struct broker__guard;
int broker__guard_start(struct broker *b, char **errmsg);
void broker__guard_stop(struct broker *b);
/* What the guard last saw of consumer durable, into st's consumer_*
 * fields (nothing when it saw nothing wrong). Any thread; takes the
 * guard's own lock only. */
void broker__guard_view(struct broker *b, const char *durable,
                        Ks__AgentStatus *st);

/* Whether agent_id is online (heartbeat younger than EVT_AGENT_TTL_MS):
 * 1, 0 (offline; *heartbeat_at_us its last heartbeat, epoch us), or -1
 * (not in the registry). Takes b->mu. */
int broker__agent_presence(struct broker *b, const char *agent_id,
                           int64_t *heartbeat_at_us);
/*
 * Whether the latest live heartbeat of agent_id lists command (16 bytes,
 * AgentInfo.holds): 1 it does; 0 it is a complete list without it, with
 * its process (instance[37]), number (*seq) and, when listed_at_us is not
 * NULL, when that heartbeat was put (epoch us, on this broker's clock:
 * registry.c dates entries through its beacon); -1 this broker cannot
 * tell (no complete list, the id silent for EVT_AGENT_TTL_MS, or a deaf
 * registry: broker__registry_deaf). Takes b->mu.
 */
int broker__agent_lists(struct broker *b, const char *agent_id,
                        const uint8_t command[16], char instance[37],
                        uint64_t *seq, int64_t *listed_at_us);
/* true when this broker has heard no heartbeat of process instance of
 * agent_id for EVT_AGENT_TTL_MS (or never, among the last two it heard);
 * false while its registry view is deaf (broker__registry_deaf). The
 * caller makes sure the broker could hear all along (its connection and
 * watch up for a TTL). Takes b->mu. */
bool broker__instance_silent(struct broker *b, const char *agent_id,
                             const char *instance);

/* May the process instance_id claim for agent_id? 0 yes (also for no
 * instance id), KS_EDUPINSTANCE with why (naming the other process) when
 * it is the newer of two processes serving the id (registry.c). */
int broker__claim_instance_ok(struct broker *b, const char *agent_id,
                              const char *instance_id, char *why,
                              size_t why_len);

/* Unpacks an API request (evt_unpack_why: no NUL, valid UTF-8) and checks
 * its fields (broker_check_request) for the caller msg names. 0 with
 * *out (caller frees), or the code with why (len bytes) saying what was
 * wrong, naming the field. */
int broker__unpack_request(natsMsg *msg, const ProtobufCMessageDescriptor *d,
                           ProtobufCMessage **out, char *why, size_t len);
/* 1 if subject is "_INBOX.<identity>.<token>[...]": a reply address only
 * that identity may read (deploy/nats-auth.conf.in). */
bool broker__inbox_of(const char *subject, const char *identity);
/* 1 if subject is "_R_.<token>[...]": the reply nats-server makes for a
 * request that crossed a service import (an agent's claim from account
 * AGENTS, deploy/nats-auth.conf.in); it leads back to the requester's own
 * reply in its own account, and no client may publish with such a reply
 * (nats-server 2.9 client.go isReservedReply). */
bool broker__service_reply(const char *subject);

/*
 * Secret variables (validate.c; the per-field and ordering rules are in
 * broker_check_request): every target in agent_ids has its values in
 * sp->sealed_env, and with exact nothing else is there. 0 or KS_EINVAL
 * with why.
 */
int broker__check_sealed_targets(const Ks__CommandSpec *sp,
                                 char *const *agent_ids, size_t n_agents,
                                 bool exact, char *why, size_t len);
/*
 * *out = *sp with sealed_env narrowed to agent_id's values (borrowed from
 * sp, which must have passed broker_check_request): what a target's
 * Command carries.
 */
void broker__spec_for_agent(const Ks__CommandSpec *sp, const char *agent_id,
                            Ks__CommandSpec *out);

/* Checks a command spec; KS_EINVAL with one line in why. */
/*
 * 0 if the agent (info: its registry entry, may be NULL) lists every
 * feature spec needs (a script, stdin, run_as, a copy: AgentInfo.features),
 * else KS_EINVAL with why naming the agent and what it cannot run: an
 * older agent would ignore the field (and run as itself, or run argv).
 */
/* blob.c: kscore.api.v1.upload and kscore.api.v1.fetch (ud: the broker). */
void broker__on_blob(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                     void *ud);
/*
 * A copy (sp->copy) of operator op names only files op uploaded whole
 * (complete, of the size it says; another operator's are as if not
 * there): 0, or KS_EINVAL with why naming the file, or a store error.
 * Each file is marked used (kept copy_keep from now; while the batch is
 * open, the batch keeps it). Nothing to check without a copy. Takes
 * blob_mu.
 */
int broker__check_copy_files(struct broker *b, const Ks__CommandSpec *sp,
                             const char *op, char *why, size_t len);
/*
 * The scanner's clean-up of kscore copy's files (store_blob_expire, a few
 * short transactions on st): files nobody uploaded or copied for
 * copy_keep that no open batch names, parts of uploads not finished
 * within copy_upload_keep. Returns the wait (us) before the next call: 0
 * when more is due, else up to 10 s (a quarter of the shorter keep).
 * Scanner thread.
 */
int64_t broker__blob_expire(struct broker *b, struct store *st);

/* true when sp needs more of its agent than argv (see below). */
static inline bool
broker__spec_special(const Ks__CommandSpec *sp)
{
    return sp && (sp->script || (sp->input && sp->input->data.len) ||
                  sp->run_as[0] || sp->copy);
}
int broker__check_features(const Ks__CommandSpec *sp,
                           const Ks__AgentInfo *info, const char *agent_id,
                           char *why, size_t len);
int broker__validate_spec(const Ks__CommandSpec *spec, char *why,
                          size_t len);

/* What broker__cancel_command did (CancelReply.outcome, .status). */
struct broker__cancel_outcome {
    const char *outcome; /* "cancelled", "requested" or "ended" (static) */
    Ks__CommandStatus status;
};
/* Cancels one command: ends it (CommandCancelled at the version read) if
 * no agent claimed it yet, else records CommandCancelRequested and tells
 * its agent. Uses st. 0, KS_ENOTFOUND, KS_EPG. Terminal: 0, nothing done.
 * *out (may be NULL) says which, on 0. */
int broker__cancel_command(struct broker *b, struct store *st,
                           const char *command_id, const char *operator_name,
                           struct broker__cancel_outcome *out);

/* ---- admission and the exec intake (admit.c) ---- */
/*
 * Starts the exec workers (one per b->executors[i], with its store
 * connection), which take requests from the intake, each operator's in
 * turn and its own in arrival order (a fair queue, fairq.c, named
 * "intake"), and run handler(NULL, NULL, msg, &b->executors[i]) on each
 * (it destroys the message). 0, -ENOMEM or KS_EINTERNAL (then call
 * broker__admit_stop).
 */
int broker__admit_start(struct broker *b, natsMsgHandler handler);
/* Serves what the intake still holds and joins the workers (call after
 * the execute subscription is drained); the figures stay until
 * broker__admit_free, when no other thread uses them. Both accept a
 * broker whose admission never started. */
void broker__admit_stop(struct broker *b);
void broker__admit_free(struct broker *b);
/* The execute subscription's callback (ud: the broker): refuses at once
 * (KS_EBUSY) a request that cannot start in time, or one past its
 * operator's bound in the intake (BROKER_FAIRQ_PER_IDENTITY requests and
 * _BYTES), else queues it for the workers in its operator's turn. */
void broker__intake_push(natsConnection *nc, natsSubscription *sub,
                         natsMsg *msg, void *ud);
/* 0 when a command of operator_name for agent_id with delivery deadline
 * deliver_ms (0: none given) can start in time (the intake counted as
 * far as its workers take others' requests before this operator's next),
 * else KS_EBUSY with why (len bytes) naming the limit and the figures
 * (admit.c's rule). Any thread. */
int broker__admit_check(struct broker *b, const char *operator_name,
                        const char *agent_id, uint64_t deliver_ms,
                        char *why, size_t len);
/* Batch pacing: true when the queue named key (broker__agent_queue, with
 * its slots) takes one more command now (less than two rounds of its
 * slots in flight, one while its hold is unknown and the command's
 * timeout_ms (0: none) does not bound it; its wait within half of
 * deliver_ms; kscore's own queues within BROKER_QUEUE_MAX_MS). */
bool broker__admit_room(struct broker *b, const char *key, unsigned slots,
                        uint64_t deliver_ms, uint64_t timeout_ms);
/* command_id was dispatched here to agent_id (its first deadline
 * not_after_us, epoch; its spec's timeout, 0: none): in flight until its
 * end is noted (broker__admit_ended) or long past both. A command not
 * taken before (a batch's target) is counted in operator_name's share
 * with bytes (broker__cmd_bytes; never refused here). */
void broker__admit_dispatched(struct broker *b, const char *command_id,
                              const char *operator_name,
                              const char *agent_id, int64_t not_after_us,
                              uint64_t timeout_ms, uint64_t bytes);
/*
 * Each operator's share of the commands stream (issue 21: one operator
 * put 269 MB in KSCORE_CMDS for an offline agent). The commands of
 * operator_name not ended yet that this broker counts (those dispatched
 * here, and those the record had open at its start: broker__admit_load,
 * broker__admit_sweep)
 * hold broker__cmd_bytes() each; 0 when this one's bytes still fit within
 * the share (b->opts->cmds_operator_bytes, 0: BROKER_CMDS_OPERATOR_BYTES),
 * and then command_id is counted from now until its end is noted
 * (broker__admit_ended; not_after_us: its deadline, epoch, bounds how
 * long an entry nobody ends is kept); else KS_EBUSY with why (len bytes)
 * naming the share and the figures, logged at most once per 10 s, and
 * nothing counted. Any thread. Several brokers each count their own, so
 * an operator holds at most a share per broker.
 */
int broker__admit_take(struct broker *b, const char *command_id,
                       const char *operator_name, uint64_t bytes,
                       int64_t not_after_us, char *why, size_t len);
/* What cmd holds of its operator's share: its packed size and
 * BROKER_CMD_MSG_OVERHEAD. */
uint64_t broker__cmd_bytes(const Ks__Command *cmd);
/* Counts the commands the record has open (store_open_requests on st) in
 * their operators' shares: call once at start, before the API is served.
 * 0 or KS_EPG. */
int broker__admit_load(struct broker *b, struct store *st);
/* Of the commands counted by broker__admit_load, those the record has
 * ended since are no longer counted (their end may have been recorded
 * by another broker that told nobody). The scanner calls it now and
 * then, with st. */
void broker__admit_sweep(struct broker *b, struct store *st);
/* A claim was answered (handler_us: the time its handler took); granted:
 * command_id started (its slot's hold is timed from now) on agent_id,
 * whose heartbeats list it from listed_seq on (0: not said). */
void broker__admit_claim_done(struct broker *b, const char *command_id,
                              const char *agent_id, uint64_t listed_seq,
                              bool granted, int64_t handler_us);
/* command_id's publish was handed to the publisher (a stall: the stream
 * did not take it at once): until its agent claims it, it is the stall's
 * backlog, not counted against the agent's slots (admit.c q_ahead). */
void broker__admit_held(struct broker *b, const char *command_id);
/* A live heartbeat of agent_id (registry.c, registry thread): its
 * process's queue key (broker__agent_queue) and slots, the commands it
 * said it runs (AgentInfo.running, or its pool_running: the slots its
 * commands take, claiming, starting or running) and its heartbeat_seq
 * (0: not numbered), put at heard_mono_us (ks_mono_us). The agent's word bounds what admission
 * counts ahead in that queue: a command whose end has not reached this
 * broker may be long over. A claim (broker__admit_claim_done) is counted
 * with it until the heartbeat that lists it (its listed_seq,
 * ClaimRequest.listed_from_seq) comes. */
void broker__admit_agent_running(struct broker *b, const char *key,
                                 const char *agent_id, unsigned slots,
                                 uint32_t running, uint64_t heartbeat_seq,
                                 int64_t heard_mono_us);
/* command_id ended (here or noticed from another broker). */
void broker__admit_ended(struct broker *b, const char *command_id);
/* command_id's message, as dispatched by this broker (counted:
 * broker__admit_dispatched), is in KSCORE_CMDS now at stream sequence seq:
 * its PubAck came (its latest attempt's, when published again). */
void broker__admit_stored(struct broker *b, const char *command_id,
                          uint64_t seq);
/* The KSCORE_CMDS stream sequence of command_id's latest message
 * published by this broker (broker__admit_stored); 0: not known (not
 * published by this broker, not stored yet, or ended). The consumer guard
 * judges a delivery lost by it (stall.c): a consumer whose last delivery
 * is at or past it has passed the message. A dispatch recorded is not
 * yet a message stored while KSCORE_CMDS elects a leader. */
uint64_t broker__admit_stored_seq(struct broker *b, const char *command_id);
/* The queue agent_id's commands wait in (registry.c): "pool:<pool>",
 * "proc:<instance>" (its process's ids share its slots) or "id:<id>",
 * into key (len bytes), and its slots (AgentInfo.max_concurrent; 0 when
 * unknown). Takes b->mu. */
void broker__agent_queue(struct broker *b, const char *agent_id, char *key,
                         size_t len, unsigned *slots);

/* Batch scheduler (batch.c). */
int broker__batch_start(struct broker *b, char **errmsg);
void broker__batch_stop(struct broker *b);
/* kscore.api.v1.list (history.c): called by on_misc under misc_mu, after
 * the operator was found in the policy. */
void broker__handle_list(struct broker *b, natsMsg *msg);

/* The API handler of kscore.api.v1.batch (its own delivery thread). */
void broker__on_batch(natsConnection *nc, natsSubscription *sub,
                      natsMsg *msg, void *ud);
/* Called by broker__command_ended: 1 if the command belongs to a batch
 * driven here (then the batch thread takes it from here; the driver of
 * any other batch reads the end from the record). */
int broker__batch_target_ended(struct broker *b, const char *command_id,
                               const Ks__CommandResult *result);
/* Called on another broker's end notice (notice.c): 1 if command_id is
 * a target in flight of a batch driven here (the scheduler then reads its
 * end from the record at once, with the others noticed meanwhile). */
int broker__batch_remote_end(struct broker *b, const char *command_id);
/* Another broker recorded a cancel of batch_id: acts on it at once if
 * driven here. */
void broker__batch_remote_cancel(struct broker *b, const char *batch_id);
/* Cancels an open batch, whatever broker drives it (or none yet): records
 * BatchCancelRequested by operator_name; its driver acts on it. Any
 * thread. 0, KS_ENOTFOUND (no open batch with this id) or KS_EPG. */
int broker__batch_cancel(struct broker *b, const char *batch_id,
                         const char *operator_name);
/* Fills reply with the state of a batch (live, else from its stream). */
int broker__batch_view(struct broker *b, struct store *st,
                       const char *batch_id, Ks__BatchReply **out);

/* The recorder's rule for agents' reports (store_check_fn): only the
 * types an agent may report, only about commands addressed to it, only for
 * the attempt it claimed. 0, or KS_EDENIED with *why. Pure; any thread. */
int broker__admit_report(const struct store_command_state *st,
                         const Ks__Event *ev, const char **why, void *ud);

/* ---- fair queues per identity (fairq.c) ----
 * A queue of requests served in turn per identity: each identity (the
 * API subject's last token: agent-<id>, an operator's name) has its own
 * bounded FIFO; `workers` threads serve the identities with something
 * queued round robin, one request of each in a round, at most
 * busy_max (default max(1, workers / 2)) of one identity at once. A push past an identity's
 * bound is refused at once (refuse: the broker drops it unanswered;
 * counted in kscore_requests_refused_total, one log line per 10 s per
 * queue). Every API subscription of the broker feeds
 * one (broker.c api_guard), so one identity's flood of any request never
 * holds another identity's requests for more than one request per
 * round of each identity with something queued. */
struct broker__fairq;
/* Serves item on a worker thread; worker_ud: that worker's
 * (broker__fairq_opts.worker_ud), ctx: what push was given. Owns item. */
typedef void (*broker__fairq_serve_fn)(void *worker_ud, void *ctx,
                                       void *item);
struct broker__fairq_opts {
    const char *name;     /* in the log line: "claim", "api"... */
    unsigned workers;     /* threads, >= 1 */
    void *const *worker_ud; /* `workers` entries, or NULL (each NULL) */
    size_t per_identity;  /* items queued per identity, >= 1 */
    size_t per_identity_bytes; /* and their bytes (one always fits) */
    /* Requests of one identity served at once, 1..workers; 0: the
     * default, max(1, workers / 2) (a slow identity leaves workers to
     * the others). */
    unsigned busy_max;
    broker__fairq_serve_fn serve;
    /* Answers and releases an item that is not served (its identity's
     * queue full), on the pushing thread. */
    void (*refuse)(void *ctx, void *item);
};
/* Requests queued per identity in the broker's API queues, and their
 * bytes: far more than an honest client has in flight (an agent claims at
 * most its slots at once, a CLI sends one request at a time; scripts that
 * send thousands at once and wait for every answer, as test_security's
 * bounded-rows cases do, are served), little memory per flooder (a
 * request is a few hundred bytes, an upload's part 512 KiB). */
#define BROKER_FAIRQ_PER_IDENTITY 16384
#define BROKER_FAIRQ_PER_IDENTITY_BYTES (64 * 1024 * 1024)
/* Starts the workers. 0, -ENOMEM or -EAGAIN (no thread); *out is freed
 * by broker__fairq_stop. */
int broker__fairq_start(const struct broker__fairq_opts *o,
                        struct broker__fairq **out);
/* Queues item (and ctx; bytes: its size) for identity (a string,
 * copied). 0, or KS_EBUSY: identity's queue is full (or too many
 * identities): item was given to refuse, counted and summed up in the
 * log. Any thread; never blocks for longer than a mutex (and refuse). */
int broker__fairq_push(struct broker__fairq *q, const char *identity,
                       void *ctx, void *item, size_t bytes);
/* What is served before a request identity would push now. */
struct broker__fairq_wait {
    /* Requests queued ahead of it: identity's own, and of each other
     * identity as many as round robin serves first (at most one more
     * than identity's own). */
    size_t n;
    size_t marked; /* of those, pushed before the last broker__fairq_mark */
    size_t own_n;  /* of those, identity's own */
    /* When the oldest of the n was pushed, and identity's own oldest
     * queued one (ks_mono_us; 0: none). */
    int64_t oldest_us, own_us;
    /* When a worker last took a request, and one pushed before a mark
     * (ks_mono_us; 0: never). */
    int64_t taken_us, mark_taken_us;
};
/* How many requests the workers serve before a new one of identity
 * would be (broker__fairq_wait.n; identity NULL: one with nothing
 * queued), and when out is not NULL the rest of *out. NULL q: 0, *out
 * zeroed. Any thread. */
size_t broker__fairq_ahead(struct broker__fairq *q, const char *identity,
                           struct broker__fairq_wait *out);
/* Marks every request queued now: broker__fairq_ahead counts them apart
 * (admit.c: those a JetStream stall held). NULL q: nothing. Any thread. */
void broker__fairq_mark(struct broker__fairq *q);
/* Serves everything queued, joins the workers and frees q (NULL: none).
 * After the last push. */
void broker__fairq_stop(struct broker__fairq *q);

/* ---- annotation rows per identity (budget.c) ----
 * Each identity (agent-<id>, pool-<pool>, operator-<name>, or
 * "unregistered": every agent id the registry has no entry for) may add
 * 1000 annotation rows at once, then 10 a second, and 64 MiB of them,
 * then 64 KiB a second, per broker; past that an annotation is not
 * written, only counted and summed up in the log. */
enum broker__annotation {
    BROKER_ANNOTATION_REPORT, /* ReportRejected, LateResult, CommandRejected */
    BROKER_ANNOTATION_DENIAL, /* RequestDenied */
};
/* 0 or -ENOMEM; broker__budget_free (accepts an unset one) releases. */
int broker__budget_init(struct broker *b);
void broker__budget_free(struct broker *b);
/* true: identity may add one annotation row of `bytes` bytes (taken from
 * its share); false: past its share, do not write it (counted in
 * kscore_annotations_dropped_total, logged in summary). Any thread. */
bool broker__budget_take(struct broker *b, const char *identity,
                         size_t bytes, enum broker__annotation kind);
/*
 * Claims that do not win, per claimer (agent-<id>, each id of a pool its
 * own, as the claim's subject names it). A claim
 * costs an append and a read of PostgreSQL, in the claim workers' queues
 * that every agent's claims share, and an agent may send as many as it
 * can publish: one agent's credential sending claims of made-up commands
 * held every other agent's claims and, through the admission's estimate
 * of the claims queue, every operator's commands (refused busy, exit 75)
 * for minutes (issue 21, tried again); fetches of made-up copies held
 * the one thread of everyone's uploads and fetches (blob.c) likewise.
 * Each identity may fail 1000 claims and fetches at once, then 100 a
 * second, per broker; past that they are answered KS_EBUSY at once,
 * without PostgreSQL, at most 100 a second, the others dropped
 * unanswered (an agent asks again, later: agent/runtime.c
 * claim_answered), and the log says so at most every 10 s. A claim that
 * wins or a fetch served never takes from the share.
 */
/* true: identity may claim or fetch now; false: past its share of
 * failed ones (logged in summary), and *answer says whether to answer
 * this refusal (busy) or drop it unanswered: at most 100 a second are
 * answered, so a flood past its share costs no reply per message (the
 * flood's replies held the others' claims behind them). Any thread. */
bool broker__budget_ask_ok(struct broker *b, const char *identity,
                           bool *answer);
/* A claim of identity did not win (refused, lost, not its command), or
 * its fetch was refused or asked again for a part it had fetched lately
 * (blob.c fetched_again): taken from its share. Any thread. */
void broker__budget_ask_failed(struct broker *b, const char *identity);
/* Scanner tick: the summary lines of identities still past their share,
 * and forgets the identities whose share is whole again. */
void broker__budget_sweep(struct broker *b);
/* The identity whose share an agent id's annotations use, into buf
 * (>= 16 + EVT_AGENT_ID_MAX): "pool-<pool>" for an id of a pool,
 * "agent-<id>" for another id the registry knows, else "unregistered".
 * Any thread; takes mu. */
void broker__report_identity(struct broker *b, const char *agent_id,
                             char *buf, size_t len);
/* broker__admit_report with the budget (store_check_fn, ud: the broker):
 * a report that would be kept as an annotation while its identity is past
 * its share is STORE_CHECK_DROP. Recorder thread. */
int broker__admit_bounded(const struct store_command_state *st,
                          const Ks__Event *ev, const char **why, void *ud);

/* ---- output in pieces (output.c) ---- */
/* The rule for an agent's output piece (store_output_check_fn). */
int broker__admit_output(const struct store_command_state *st,
                         const struct store_output_chunk *c,
                         const char **why, void *ud);
/* Records the OutputChunk events evs (recorder thread, st_rec); verdicts
 * and whys (n each, caller storage) say what became of each. 0 or a store
 * error (nothing recorded: retry). */
int broker__record_pieces(struct broker *b, Ks__Event **evs, size_t n,
                          enum store_step *verdicts, const char **whys);
/* Sends one recorded piece of output (ev->chunk) to a live follower's
 * subject: as an ExecuteReply part (exec) or a BatchProgress. Any
 * thread. */
void broker__live_send(struct broker *b, const char *subject, bool exec,
                       const char *agent_id, const Ks__Event *ev);
/* Sends a recorded piece to whoever follows its command live. */
void broker__live_forward(struct broker *b, const Ks__Event *ev);
/* Batch live output: pieces of command_id go to subject as BatchProgress
 * until broker__live_end (called when the command ends). */
void broker__live_add(struct broker *b, const char *command_id,
                      const char *subject);
/* true if command_id had a batch live follower here. */
bool broker__live_end(struct broker *b, const char *command_id);
/*
 * Each command's own output caps (issue 21: its agent could store output
 * up to EXEC_OUTPUT_CAP_MAX whatever the command's cap): a piece past the
 * cap its spec gives (agent_output_cap) is refused by
 * broker__admit_output. Noted when this broker records the command
 * (command_id, with its spec), else read from its CommandRequested when
 * its first piece comes; forgotten at its end. Any thread (b->mu).
 */
void broker__output_caps_note(struct broker *b, const char *command_id,
                              const Ks__CommandSpec *spec);
void broker__output_caps_forget(struct broker *b, const char *command_id);
void broker__output_caps_free(struct broker *b);
/* Puts back the bytes of r's outputs that travelled in pieces (reads
 * them with st). 0 or a store error. */
int broker__fill_output(struct store *st, const char *command_id,
                        Ks__CommandResult *r);
/* kscore.api.v1.logs (under misc_mu, st_misc). */
void broker__handle_logs(struct broker *b, natsMsg *msg);
/* Whether the caller of msg may read stream_id (the read policy); a
 * refusal is recorded. 0 or KS_EDENIED with why. */
int broker__may_read(struct broker *b, struct store *st, natsMsg *msg,
                     const char *stream_id, char *why, size_t len);

/*
 * Notices between brokers (notice.c), core NATS, only the broker's
 * credential may publish them: BROKER_NOTICE_ENDED<command_id> (a terminal
 * event was recorded by a broker that had nobody waiting for it),
 * BROKER_NOTICE_CANCEL<batch_id> (a batch cancel recorded by a broker that
 * does not drive the batch). Payload: the sender's instance_id.
 */
#define BROKER_NOTICE_PREFIX "_KSCORE.broker."
#define BROKER_NOTICE_ENDED BROKER_NOTICE_PREFIX "ended."
#define BROKER_NOTICE_CANCEL BROKER_NOTICE_PREFIX "cancel."
/* BROKER_NOTICE_RELABEL<stream>: a relabel was recorded on stream
 * ("agent-<id>", "pool-<pool>"): read the relabels again (labels.c). */
#define BROKER_NOTICE_RELABEL BROKER_NOTICE_PREFIX "relabel."
/* BROKER_NOTICE_FOLLOW<command_id>: a client follows the command live
 * through the sender; payload "<instance_id>\n<e|b>\n<agent_id>\n<subject>"
 * (e: an exec's inbox, b: a batch's progress subject). */
#define BROKER_NOTICE_FOLLOW BROKER_NOTICE_PREFIX "follow."
/* BROKER_NOTICE_GUARD<consumer>: the sender's consumer guard repaired it
 * (stall.c); payload "<instance_id>\n<epoch us>\n<what it did>". */
#define BROKER_NOTICE_GUARD BROKER_NOTICE_PREFIX "guard."
/* Opens st_notice and subscribes (every broker, not a queue group). */
int broker__notice_start(struct broker *b, char **errmsg);
void broker__notice_ended(struct broker *b, const char *command_id);
void broker__notice_batch_cancel(struct broker *b, const char *batch_id);
void broker__notice_relabel(struct broker *b, const char *stream);
/* Tells the other brokers that subject follows command_id live here, so
 * the pieces they record go to it too. */
void broker__notice_follow(struct broker *b, const char *command_id,
                           bool exec, const char *subject,
                           const char *agent_id);
/* Sends a recorded piece to a client following it through another
 * broker; false if there is none. */
bool broker__remote_forward(struct broker *b, const Ks__Event *ev);
/* Forgets command_id's remote follower (its end was recorded here or
 * noticed). */
void broker__remote_live_end(struct broker *b, const char *command_id);
/* Frees them all (teardown). */
void broker__remote_live_free(struct broker *b);
/* Forgets the remote followers of commands that have ended (their end
 * recorded by the follower's broker, which sends no notice): reads the
 * older ones' states with st. The scanner thread, now and then. */
void broker__remote_live_sweep(struct broker *b, struct store *st);

int broker__recorder_start(struct broker *b, char **errmsg);
/* The follow thread (broker.c): start before kscore.api.v1.follow is
 * subscribed, stop after it is drained (it answers whoever is parked). */
int broker__follow_start(struct broker *b);
void broker__follow_stop(struct broker *b);
/* Makes the recorder's consumer again as broker__recorder_start made it
 * (evt_consumer_ensure): the running subscription reads its deliver
 * subject, so deliveries resume. 0 or KS_ENATS with *errmsg. Any thread. */
int broker__recorder_ensure(struct broker *b, char **errmsg);
void broker__recorder_stop(struct broker *b);

/* Records JetStream's max-deliveries advisories (advisory.c). */
int broker__advisory_start(struct broker *b, char **errmsg);

int broker__scanner_start(struct broker *b);
void broker__scanner_stop(struct broker *b);
/* Each attempt's share of a command's delivery window (us). */
int64_t broker__attempt_window_us(const Ks__Command *cmd);
/*
 * Publishes command ref (Dispatched, as a scan of st read it) again, as
 * attempt ref->attempt + 1 with its own Nats-Msg-Id: appends its
 * CommandDispatched (reason: why, in the record) at ref->version, so a
 * claim or an end that landed since wins, then publishes it. Any
 * attempt's message may claim while the command is Dispatched, so the
 * earlier one still runs it if it comes; nothing runs twice (the claim
 * fence). st: the calling thread's connection. 0; KS_ECONFLICT (the
 * record moved on, or the command is on its last attempt or past its
 * delivery deadline: the scanner ends it); KS_ENOTFOUND; a store error.
 * A failed publish is logged only: the attempt's deadline re-publishes.
 * scanner.c.
 */
int broker__redispatch(struct broker *b, struct store *st,
                       const struct store_command_ref *ref,
                       const char *reason);

int broker__registry_start(struct broker *b, char **errmsg);
void broker__registry_stop(struct broker *b);
/* Fills an AgentsReply from the registry (sorted by id). Any thread.
 * Free with broker__agents_reply_free(). */
int broker__agents_list(struct broker *b, Ks__AgentsReply *out);
/* Agents whose last heartbeat is within EVT_AGENT_TTL_MS (metrics). */
int broker__agents_online(struct broker *b);
void broker__agents_reply_free(Ks__AgentsReply *r);

/* Whether the agent id has registered (any time): 1, 0 (no entry), or
 * the error of a bucket that did not answer (cannot tell: KS_ETIMEDOUT,
 * KS_EUNAVAIL, ...). On a miss it waits up to BROKER_REG_CATCHUP_WAIT_MS
 * for this process's first registry watch to deliver its initial values
 * (reg_loaded), then asks the bucket. Any thread; may block that long plus a KV get. */
int broker__agent_lookup(struct broker *b, const char *agent_id);
/* broker__agent_lookup(...) > 0. */
int broker__agent_known(struct broker *b, const char *agent_id);

#endif
