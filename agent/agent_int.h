/*
 * agent_int.h: private declarations of the agent runtime (runtime.c,
 * journal.c). The executor (exec_*.c) has its own exec_int.h.
 */
#ifndef KSCORE_AGENT_INT_H
#define KSCORE_AGENT_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "agent.h"

struct agent_slot {
    struct agent *agent;
    char *id;
    /* "agent-<id>": the NATS identity this id acts as (claims, the
     * inbox of its PubAcks) and its consumer's name. */
    char identity[8 + EVT_AGENT_ID_MAX];
    /* kscore.cmd.<id>, or kscore.cmd.<pool>.<id> */
    char cmd_subject[20 + 2 * EVT_AGENT_ID_MAX];
    /* "$JS.ACK.KSCORE_CMDS.agent-<id>.": every delivery of its consumer
     * has a reply subject under it, and acks go nowhere else. */
    char ack_prefix[40 + EVT_AGENT_ID_MAX];
    /* Core queue subscription to the consumer's deliver subject. */
    natsSubscription *sub, *cancel_sub;
    /* The broker refused a claim of this id: another, older process
     * serves it (KS_EDUPINSTANCE). Until then (mono us) the id takes no
     * deliveries (runtime.c aside_tick); aside: its subscription is
     * unsubscribed now (keeper thread, under sub_mu). */
    _Atomic int64_t aside_until_us;
    bool aside;
    /* The broker's attestation of this id's labels (agent_opts), sent in
     * every heartbeat; has_attest false: none. Labels borrowed. */
    bool has_attest;
    const struct agent_label *attest_labels;
    size_t n_attest_labels;
    int64_t attest_at_us;
    uint8_t attest_sig[EVT_SIGNATURE_BYTES];
    char attest_key_id[EVT_KEY_ID_CHARS + 1];
};

struct outbox_item {
    struct outbox_item *next;
    char event_id[37];
    uint8_t *buf;
    size_t len;
    char subject[16 + EVT_AGENT_ID_MAX + 40];
    char agent_id[EVT_AGENT_ID_MAX + 1]; /* publishes as agent-<id> */
    char command_id[37];                 /* for ks_trace */
};

/*
 * A claim this process has sent or is about to send (runtime.c "claims"),
 * from before its ClaimRequest goes out until the command's end is queued
 * for publishing, or the broker's definite no. Meanwhile the command is in
 * every heartbeat's AgentInfo.holds, and every try of the claim carries
 * the same claim_id: the broker grants a repeat of the claim that won (its
 * event id is recorded), so a claim whose reply was lost is still ours.
 * With a state dir the claim line of the journal is its copy on disk: a
 * restarted agent takes the claim up again (recovered_us) and claims with
 * the same id when JetStream delivers the message again.
 */
struct agent_claim {
    char claim_id[37];
    char agent_id[EVT_AGENT_ID_MAX + 1];
    uint32_t attempt;
    char operator_name[64];
    /* Taken from a previous run's journal and not delivered again yet
     * (mono us; 0: a held message has it). Not delivered within twice the
     * ack wait, it is let go, unreported (runtime.c claims_forget_old). */
    int64_t recovered_us;
};

/* Where a held command message is. */
enum job_state {
    JOB_WAITING,  /* delivered, no free slot yet: unclaimed */
    JOB_STARTING, /* has a slot: check, claim, submit */
    JOB_RUNNING   /* claimed and submitted to the executor */
};

/*
 * One command message this agent holds, from its delivery to its ack. The
 * message stays unacked while the command waits and runs, so the
 * consumer's max_ack_pending keeps the rest in JetStream; the ack subject
 * is kept (not the natsMsg) and every ack, nak, progress is a publish to it.
 */
struct job_ctx {
    struct job_ctx *qnext; /* a->waitq or a->readyq, under a->mu */
    struct agent *agent;
    struct agent_slot *slot;
    char *ack_subject;    /* the delivery's reply subject (malloc'd) */
    Ks__Command *cmd;     /* decoded; freed once submitted */
    enum job_state state; /* under a->mu */
    uint64_t job_id;      /* the executor's, once RUNNING */
    char command_id[37];
    uint32_t attempt;
    char operator_name[64];
    /* Killed by the self-fence (under a->mu): NATS was silent this long. */
    bool fenced;
    int64_t fence_silence_us;
    /* A cancel came before it ran (claimed, not yet submitted): it is
     * cancelled as soon as it is (under a->mu). */
    bool cancel_pending;
    /* An operator's cancel reached it (on_cancel; under a->mu): its end is
     * Cancelled, whereas one killed by agent_stop is not. */
    bool op_cancelled;
    uint64_t delivered; /* JetStream's delivery count of this message */
    /* payload.c: its script file, stdin and user, from the precheck to
     * the end of the hold (job_free). */
    struct agent_payload *payload;
    /* Why it ended before it ran, after the claim (a copy's fetch):
     * the terminal report's reason (malloc'd; job_free frees it). */
    char *end_reason;
    struct agent_out *out; /* output.c, while it runs */
    /* Offset of the journal's room for "spawned <pid>"; -1: none. */
    long spawn_at;
};

/* facts.c: what the agent says of its host (AgentInfo.facts), read once
 * at its start; p[0..n) point into v, whose strings are the fields. */
#define AGENT_N_FACTS 5
struct agent_facts {
    char os[64], kernel[65], arch[65], cpus[24], mem_mb[24];
    Ks__EnvVar v[AGENT_N_FACTS];
    Ks__EnvVar *p[AGENT_N_FACTS];
    size_t n;
};

struct agent {
    struct agent_opts opts;
    struct agent_facts facts;
    char *state_dir;
    char host[64];
    unsigned max_concurrent;
    uint64_t ack_wait_ms, fence_ms, link_timeout_ms;
    struct evt_conn *nc;
    struct exec_loop *loop;
    struct agent_slot *slots;
    size_t n_slots;

    pthread_mutex_t mu;
    /* Spare files (journal.c agent__file_put): names under spare/. */
    pthread_mutex_t spare_mu;
    unsigned long spare_next;           /* (spare_mu) next name */
    unsigned long spares[256];          /* (spare_mu) AGENT_SPARE_MAX */
    size_t nspares;                     /* (spare_mu) */
    struct ks_map jobs;  /* command_id -> struct job_ctx *: held */
    /* Pool mode (opts.pool): id -> struct agent_slot *, and the one
     * subscription to the pool consumer's deliver subject. */
    struct ks_map slot_of;
    natsSubscription *pool_sub;
    char *pool_name; /* opts.pool points here (copied) */
    /* The pool's deliveries stand aside as one (agent_slot.aside_until_us). */
    _Atomic int64_t pool_aside_until_us;
    bool pool_aside;
    /* Taken to unsubscribe or subscribe again the deliver subscriptions
     * (keeper thread, agent_stop): none comes back after closing. */
    pthread_mutex_t sub_mu;
    /* "pool-<pool>": the identity of the pool's inbox (its replies: claims,
     * PubAcks), whatever the connection's credential is named. */
    char pool_identity[8 + EVT_AGENT_ID_MAX];
    /* opts.pool_attestation, copied (labels borrowed), sent in every pool
     * entry; has_pool_attest false: none. */
    bool has_pool_attest;
    struct agent_attestation pool_attest;
    uint8_t pool_attest_sig[EVT_SIGNATURE_BYTES];
    char pool_attest_key_id[EVT_KEY_ID_CHARS + 1];
    unsigned free_slots; /* commands this process may still claim */
    bool claim_inline;   /* claim on the delivery thread (own threads) */
    struct job_ctx *waitq, **waitq_tail;   /* no slot yet, in order */
    struct job_ctx *readyq, **readyq_tail; /* a slot, to be started */
    pthread_cond_t ready_cond;
    unsigned callbacks; /* on_command calls and fetch threads running */
    pthread_cond_t cb_cond;
    struct ks_map seen; /* claimed command ids (replay guard) */
    /* command_id -> struct agent_claim * (runtime.c "claims"), and the
     * number of the last heartbeat built (AgentInfo.heartbeat_seq). Under
     * mu. */
    struct ks_map claims;
    uint64_t hb_seq;
    char (*seen_ring)[37];
    size_t seen_next;
    const struct evt_verifier *trust;
    struct evt_verifier *own_trust; /* from opts->trust_keys */
    struct evt_seal_key *seal_key;  /* secret.c: opens SealedEnv */
    uint8_t seal_pub[EVT_SEAL_KEY_BYTES]; /* AgentInfo.seal_key */
    pthread_cond_t out_cond;
    struct outbox_item *out_head, **out_tail;
    size_t in_flight; /* submitted, result not yet queued */
    pthread_cond_t idle_cond;

    /* Contact with NATS: the last heartbeat a PubAck confirmed (mono us). */
    _Atomic int64_t last_contact_us;
    atomic_bool fenced; /* silent for longer than fence_ms */
    char instance_id[37];   /* AgentInfo.instance_id: this process */
    int64_t started_at_us;  /* AgentInfo.started_at_us */
    atomic_int fatal;       /* enum agent_fatal */
    struct evt_link_watch *link_watch; /* AGENT_FATAL_LINK */
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cond; /* CLOCK_MONOTONIC */
    bool hb_wake;           /* under hb_mu: heartbeat now */
    /* Rate limits of log lines (mono us; their own threads). */
    int64_t pub_err_logged_us, hb_err_logged_us;
    _Atomic int64_t foreign_logged_us;
    _Atomic int64_t replay_logged_us; /* a claimed command delivered again */
    /* A lost exit status, a state dir that takes no more writes. */
    _Atomic int64_t status_lost_logged_us, journal_err_logged_us,
        outbox_err_logged_us, claim_err_logged_us;

    pthread_t pub_thread, hb_thread, keeper_thread;
    pthread_t *starters;
    size_t n_starters;
    bool pub_started, hb_started, keeper_started;
    /* output.c: running commands' output, the flusher thread */
    pthread_mutex_t out_mu;
    pthread_cond_t out_flush_cond;
    struct agent_out *out_list;
    pthread_t out_thread;
    bool out_started, out_stopping;
    char *run_dir;         /* payload.c: this run's private files */
    atomic_int draining;   /* agent_drain: take no new work, finish */
    atomic_int closing;    /* agent_stop: take no new work */
    /* agent_stop is killing what still runs: those end Lost (the agent
     * stopped), not Cancelled. */
    atomic_bool stop_killing;
    int64_t drain_ms;      /* agent_drain's timeout, for the reason */
    volatile int stopping; /* agent_stop: the executor is done */
};

/* runtime.c */

/* true at most once per 10 s for the clock *last (a log line that a flood
 * of failures must not repeat). Any thread. */
bool agent__log_due(_Atomic int64_t *last);

/* Packs ev, saves it in the outbox (if a state dir), queues it. */
int agent__queue_event(struct agent *a, const Ks__Event *ev);
/* agent__queue_event, saved in the outbox only if persist. */
int agent__queue_event_opt(struct agent *a, const Ks__Event *ev, bool persist);

/* output.c: a running command's output as pieces (OutputChunk). */
struct agent_out;
/* Starts following j's output (j->out); -ENOMEM: only its end is sent. */
int agent__out_new(struct job_ctx *j);
/* exec_output_fn of a job (ud: its job_ctx). */
void agent__out_piece(uint64_t job_id, int stream, const char *data,
                      size_t len, void *ud);
/* At the end (before the terminal report is queued): sends what is left
 * as pieces if any were sent or the output is too large to travel in the
 * result, and then empties out/err's data and sets chunked_bytes. */
void agent__out_finish(struct job_ctx *j, const struct exec_result *x,
                       Ks__Output *out, Ks__Output *err);
int agent__out_start(struct agent *a);
void agent__out_stop(struct agent *a);
/* Publishes an ack payload ("+ACK", "-NAK", "+WPI", "+TERM") to a held
 * message's ack subject. */
void agent__ack(struct agent *a, const char *ack_subject, const char *what);

/*
 * secret.c: the agent's X25519 key and the command's secret variables
 * (`kscore exec --secret-env`, events.h "sealed values").
 *
 * agent__secret_init: the key in <state_dir>/seal.key (made on the first
 * start, mode 0600); without a state dir a new key for this process run
 * (what was sealed to the previous run's key cannot be opened: those
 * commands end StartFailed). Sets a->seal_key, a->seal_pub. 0, or an
 * error with *errmsg (malloc'd).
 */
int agent__secret_init(struct agent *a, char **errmsg);
void agent__secret_release(struct agent *a);

/* The values of one command's secret variables; wiped when freed. */
struct agent_secrets;

/*
 * Opens cmd's sealed variables (cmd->spec->sealed_env: each sealed to
 * agent_id, in a command of cmd->operator_) into env[*env_len] onwards
 * (room for n_sealed_env more) and advances *env_len; the values live in
 * *out until agent__secrets_free. Before the spawn, on the thread that
 * spawns. 0, or -EBADMSG with why (why_len bytes, names the variable) when
 * one cannot be opened (another agent's, another key's, or changed): the
 * command must not run. -ENOMEM.
 */
int agent__secrets_open(struct agent *a, const char *agent_id,
                        const Ks__Command *cmd, struct exec_env *env,
                        size_t *env_len, struct agent_secrets **out,
                        char *why, size_t why_len);
/* Wipes and frees the values. Accepts NULL. */
void agent__secrets_free(struct agent_secrets *s);

/*
 * facts.c. agent__facts_read: the host's facts into f (one it cannot read
 * is left out); at start. agent__inventory_env: cmd's labels
 * (Command.labels) as KSCORE_LABEL_<KEY> and a's facts as
 * KSCORE_FACT_<KEY> (agent_inventory_name) into env[*env_len] onwards
 * (room for cmd->n_labels + a->facts.n more), advancing *env_len; a name
 * already added is not added again (the first key in order stands). The
 * names live in *names_out (free it after the spawn). 0 or -ENOMEM.
 */
void agent__facts_read(struct agent_facts *f);
int agent__inventory_env(const struct agent *a, const Ks__Command *cmd,
                         struct exec_env *env, size_t *env_len,
                         char **names_out);

/*
 * payload.c: a command's script, stdin and user (CommandSpec.script,
 * .input, .run_as), made ready for the executor before the claim.
 *
 * agent__payload_init: removes what the last run of this state dir left
 * in its private run dir (noted in <state_dir>/run-dir); this run's
 * (a->run_dir: $TMPDIR/kscore-agent-XXXXXX, 0711) is made and noted at
 * its first use (under a->mu). 0 (errmsg is for a failure to come).
 * agent__payload_release removes it (agent_stop).
 *
 * agent__payload_prepare: checks the payloads' SHA-256, looks the user up,
 * writes the script to <run dir>/<command id>/<name> (0700 directory, 0500
 * file, the user's) and points spec at them (stdin_data, user, argv: the
 * script's path, after /bin/sh when it has no "#!", then argv[1..]). What
 * spec points at lives in *out until agent__payload_free, which also
 * removes the directory. Nothing to do: 0 and *out NULL. On failure
 * -errno (-EBADMSG: a checksum, -ENOENT: no such user or group) with
 * *stage ("input", "user", "script") and why: the command must not run.
 * Before the claim, on the thread that starts the job.
 */
struct agent_payload;
int agent__payload_init(struct agent *a, char **errmsg);
void agent__payload_release(struct agent *a);
int agent__payload_prepare(struct agent *a, const Ks__Command *cmd,
                           struct exec_spec *spec, struct agent_payload **out,
                           const char **stage, char *why, size_t len);
/* Removes the command's private directory and frees. Accepts NULL. */
void agent__payload_free(struct agent_payload *p);
/*
 * After the claim: a copy's files, fetched from the broker into the
 * command's private directory and checked against their SHA-256 (copy.c).
 * 0 (also for any other command), or -ECANCELED (the command was
 * cancelled, or the agent stops), -EBADMSG (a checksum), a NATS or
 * broker error after the retries, with why. Blocks the calling
 * thread for the download: runtime.c runs it on a thread of its own
 * (agent__payload_fetches says when there is one).
 */
int agent__payload_fetch(struct agent *a, struct job_ctx *j,
                         const Ks__Command *cmd, char *why, size_t len);
/* true when p has files to fetch after the claim (a copy). */
bool agent__payload_fetches(const struct agent_payload *p);

/*
 * copy.c: kscore copy's fetch and writer (the writer is this binary
 * re-executed with agent__copy_env set).
 * agent__copy_argv: the writer's argv for cp, its files in spool, owner
 * (NULL: keep) as uid:gid; free with agent__copy_argv_free.
 * agent__copy_fetch: each file of cmd's copy into spool/<i> (see
 * agent__payload_fetch).
 */
extern const char agent__copy_env[];
int agent__copy_argv(const Ks__CopySpec *cp, const char *spool,
                     const struct exec_user *owner, char ***argv_out);
void agent__copy_argv_free(char **argv);
int agent__copy_fetch(struct agent *a, struct job_ctx *j,
                      const Ks__Command *cmd, const char *spool, char *why,
                      size_t len);
/* SHA-256 of len bytes (OpenSSL). 0 or KS_EINTERNAL. */
int agent__payload_sha256(const void *data, size_t len,
                          uint8_t out[KS_SHA256_BYTES]);
/*
 * Looks up "USER" or "USER:GROUP" (getpwnam_r, getgrnam_r, getgrouplist):
 * u filled, its groups, name and home in *groups, *name, *home (malloc'd,
 * the caller frees). 0, or -ENOENT (no such user or group) / -errno with
 * why. May block on NSS.
 */
int agent__user_lookup(const char *spec, struct exec_user *u, gid_t **groups,
                       char **name, char **home, char *why, size_t len);

/*
 * journal.c: <state_dir>/running/<command_id>, one file per held message.
 *
 *   line 1   "<agent_id> <attempt> <operator|-> <ack subject|->"  held
 *   "claim <event_id>"                                  before the claim
 *   "pending" padded to JOURNAL_SPAWN_FIELD, written with the claim line,
 *   overwritten in place by "spawned <pid>" (same width) after the spawn
 *   succeeded
 *
 * The file is written whole (agent__file_put: a spare, then renamed over
 * it), so a file read after a crash holds whole lines; the spawn rewrites
 * bytes the file already holds, so it needs no new block of a full file
 * system (tmpfs, ext4; a copy-on-write file system may still refuse it:
 * logged). No fsync: the file must outlive the agent process, not the
 * machine (a crashed machine loses JetStream's unsynced data too).
 *
 * agent__journal_hold: writes j's file (with claim_event_id: claimed, room
 * for the spawn; sets j->spawn_at). 0, or -errno (the state dir is full
 * or read-only): then the caller must not claim, and hands the message
 * back to JetStream; the failure is logged (one line per 10 s) and counted
 * (kscore_agent_state_write_errors_total).
 * agent__journal_spawned: "spawned <pid>" into that room. 0 or -errno
 * (logged and counted; the command runs on).
 * Any thread; under a->mu or not.
 */
#define JOURNAL_SPAWN_FIELD 24
int agent__journal_hold(struct agent *a, struct job_ctx *j,
                        const char *claim_event_id);
int agent__journal_spawned(struct agent *a, const struct job_ctx *j,
                           pid_t pid);
void agent__journal_remove(struct agent *a, const char *command_id);
/*
 * At start, after connecting and before the first heartbeat: what a
 * previous run left. Spawned: CommandLost (its watchdog killed it, and
 * exec_global_init() killed its cgroups). Claimed, never spawned: the
 * claim is taken up again (agent__claim_recovered; the file stays) and
 * the message nak'd, so JetStream redelivers it at once and it is claimed
 * with the same claim id: it runs if the claim won, or wins now. Held,
 * never claimed: nak'd. Each message is acked or nak'd through its saved
 * ack subject, so the consumer's max_ack_pending is free again now, not
 * after the ack wait.
 */
void agent__journal_recover(struct agent *a);

/* Queues the end of a command the agent holds no job for (a journal
 * entry, a claim given up): an event of type with a result of status,
 * reason (also the event's), and pid (0: none). Any thread. */
void agent__report_end(struct agent *a, const char *command_id,
                       const char *agent_id, uint32_t attempt,
                       const char *operator_name, const char *type,
                       Ks__CommandStatus status, const char *reason, long pid);

/* runtime.c: takes up a claim a previous run journalled (claimed, never
 * spawned) for command_id of agent_id. 0 or -ENOMEM. */
int agent__claim_recovered(struct agent *a, const char *command_id,
                           const char *agent_id, uint32_t attempt,
                           const char *operator_name, const char *claim_id);

/*
 * Files of the state dir (journal entries, outbox events) are recycled,
 * not created and deleted: ext4 finds a free inode slowly while many were
 * freed a moment ago (ext4_create -> recently_deleted() was a third of
 * the agent's CPU samples at one command after another). A dropped file
 * is renamed into <state>/spare (at most AGENT_SPARE_MAX kept) and the
 * next put writes into a spare and renames it into place.
 *
 * agent__file_put: path (in the state dir) holds exactly data[0..len)
 * afterwards, atomically (written, then renamed over path). 0 or -errno.
 * agent__file_drop: path is gone (a spare now, or unlinked).
 * agent__spare_init: at start, after the state dir exists: adopts the
 * spares a previous run left (the rest are unlinked).
 * Any thread; they take a->spare_mu.
 */
#define AGENT_SPARE_MAX 256
int agent__file_put(struct agent *a, const char *path, const void *data,
                    size_t len);
void agent__file_drop(struct agent *a, const char *path);
void agent__spare_init(struct agent *a);

#endif
