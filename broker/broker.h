/*
 * broker: kscore's control service. Its client API (what the CLI calls)
 * is client/client.h, included here.
 *
 * The broker (broker_run) serves the API on kscore.api.v1.<method> (core
 * request/reply, queue group kscore-broker), records every step as an event
 * in PostgreSQL (store/), dispatches commands on KSCORE_CMDS, records the
 * agents' events from KSCORE_EVENTS and replies to ExecuteCommand once the
 * terminal event is recorded.
 *
 * ExecuteCommand (DESIGN.md "ExecuteCommand, step by step"):
 *  1. validate; unknown agent -> KS_ENOAGENT, nothing recorded;
 *  2. one transaction: CommandRequested (v1) + CommandDispatched (v2) on
 *     stream command-<uuid> (the outbox: the deadline scanner re-publishes
 *     a Dispatched command nobody claimed), then publish on KSCORE_CMDS;
 *  3. the agent claims on kscore.api.v1.claim: CommandStarted appended at
 *     expected version Command.dispatch_version; exactly one claim wins;
 *  4. the agent publishes CommandCompleted to KSCORE_EVENTS; the recorder
 *     appends it (once, by event_id), acks after the commit, and the reply
 *     goes out.
 *
 * Threads: each API subscription is served on its own nats.c delivery
 * thread with its own PostgreSQL connection; the recorder and the deadline
 * scanner have one thread each.
 */
#ifndef KSCORE_BROKER_H
#define KSCORE_BROKER_H

#include <stdbool.h>
#include <stdint.h>

#include "client.h"
#include "events.h"
#include "kproto.h"
#include "store.h"

struct broker_opts {
    const char *nats_url;
    const char *db_conninfo;
    unsigned local_agents;        /* in-process agents <host>-0..N-1 */
    const char *state_dir;        /* for local agents; NULL: no disk buffer */
    struct evt_connect_opts nats; /* credentials / TLS */
    const char *signing_key;      /* Ed25519 private key (PEM): required */
    const char *policy_file;      /* operator policy (JSON); NULL: none */
    /* An agent without a valid label attestation (signed by this broker's
     * key: kscore agent enroll) gets no labels at all, so --select and
     * label policy rules never match it; false: its self-declared labels
     * count (a single host). An attested agent gets exactly its attested
     * labels either way. */
    bool require_signed_labels;
    unsigned replicas; /* copies of each stream and the KV bucket on a
                          JetStream cluster (evt_setup_replicas); 0: 1 */
    /* kscore copy's files (broker/blob.c; docs/scripts-and-files.md); 0: the
     * BROKER_COPY_* default. The bytes of uploads one operator may hold
     * (its unfinished uploads and its files) and all operators together;
     * how long a file nobody uploaded or copied is kept, and the parts of
     * an upload that was not finished. */
    uint64_t copy_operator_bytes, copy_total_bytes;
    uint64_t copy_keep_ms, copy_upload_keep_ms;
    /* The bytes of one operator's commands not ended yet (their requests,
     * as they wait in KSCORE_CMDS) past which its next command is refused
     * busy (broker/admit.c broker__admit_take); 0:
     * BROKER_CMDS_OPERATOR_BYTES. */
    uint64_t cmds_operator_bytes;
    /* At SIGTERM/SIGINT the in-process agents drain first
     * (agent_stop_graceful): no new claims, the running commands may
     * finish for up to this long (ms) while the broker serves on; a
     * second signal cuts it short. 0: stop them at once. `kscore broker
     * --drain-timeout`, default AGENT_DRAIN_TIMEOUT_MS. */
    uint64_t drain_timeout_ms;
};

#define BROKER_COPY_OPERATOR_BYTES (UINT64_C(1) << 30) /* 1 GiB */
#define BROKER_COPY_TOTAL_BYTES (UINT64_C(8) << 30)    /* 8 GiB */
#define BROKER_COPY_KEEP_MS (UINT64_C(24) * 3600 * 1000)
#define BROKER_COPY_UPLOAD_KEEP_MS (UINT64_C(3600) * 1000)
/* One operator's share of the commands stream by default (config
 * cmds_operator_mib): 64 commands of the largest size, thousands of
 * ordinary ones. KSCORE_CMDS itself holds at most EVT_CMDS_MAX_BYTES. */
#define BROKER_CMDS_OPERATOR_BYTES (UINT64_C(64) << 20) /* 64 MiB */
/* What one command holds of its operator's share: its packed Command and
 * this much for the signature, subject and headers of its message. */
#define BROKER_CMD_MSG_OVERHEAD 512

/*
 * How long the broker's NATS link may answer nothing while nats.c says it
 * is connected before the broker stops (ms): no reply, no PubAck, no PONG
 * to the PINGs it sends every EVT_LINK_PROBE_MS (evt_link_watch). A
 * server stopped or cut off without a reset, or a read thread that hangs
 * in nats.c (issue 22), is a link nats.c will not repair; a broker that
 * can neither hear nor publish must not keep holding batches and waiting
 * clients, and a new process has a new connection.
 */
#define BROKER_LINK_TIMEOUT_MS 30000

/*
 * Runs a broker until SIGINT or SIGTERM (then drains its in-process agents
 * first: drain_timeout_ms). Loads the signing key, applies migrations,
 * sets up the streams, serves. Returns 0 after a clean stop, or a negative
 * code with *errmsg (malloc'd) when it cannot start (NATS or PostgreSQL
 * unreachable), or KS_EUNAVAIL when it stopped because its NATS link
 * answered nothing for BROKER_LINK_TIMEOUT_MS (its supervisor is to start
 * it again).
 */
int broker_run(const struct broker_opts *opts, char **errmsg);

/* ---- the boundary's decisions (pure: no I/O; fuzzed, tests/fuzz) ------ */

/*
 * The field rules of every request (broker/validate.c, the table of
 * docs/security.md "Untrusted input"): walks m and every message inside
 * it; 0, or
 * KS_EINVAL with why (len bytes) naming the field and the rule. identity
 * is the caller's (the API subject's last token): a subject a request
 * names (BatchRequest.progress_subject) must be under its own inbox
 * "_INBOX.<identity>.". Any thread.
 */
int broker_check_request(const ProtobufCMessage *m, const char *identity,
                         char *why, size_t len);

/*
 * What the record does with an agent's event ev (its sender is
 * ev->agent_id, as the subject vouched) about a command in state st: the
 * broker's rule (only the types an agent may report, only about commands
 * addressed to it, only for the attempt it claimed), then the command
 * state machine (store_command_step). STORE_STEP_APPLY, or LATE / ILLEGAL
 * with *why (static) saying why. This is the decision the recorder takes
 * under the stream's lock (store_append_checked). Any thread.
 */
enum store_step broker_decide_report(const struct store_command_state *st,
                                     const Ks__Event *ev, const char **why);

/*
 * What one agent's registry entry may hold (AgentInfo, packed; labels):
 * the broker ignores an entry past either bound (an agent writes its own
 * entry, and every `kscore agents` reply carries all of them), and
 * `kscore agent` refuses labels that could not fit.
 */
#define BROKER_AGENT_INFO_MAX_BYTES 8192
#define BROKER_AGENT_INFO_MAX_LABELS 128
/* Wave sizes a batch request may give (BatchRequest.waves; the last
 * repeats). */
#define BROKER_WAVES_MAX 1000
/* Facts an entry may hold (AgentInfo.facts; an agent sends 5). */
#define BROKER_AGENT_INFO_MAX_FACTS 32
/* Largest registry entry of an agent pool (its list of ids: about 20,000
 * ids of 10 characters); beyond it the entry is refused and logged. */
#define BROKER_POOL_INFO_MAX_BYTES (256 * 1024)
/* Most ids one pool may have (its signed size). */
#define BROKER_POOL_MAX 100000

/* ---- the operator policy file (broker/policy.c) ------------------------
 *
 * A broker given a policy file (--policy, KSCORE_POLICY, policy = in its
 * config) that it cannot read or parse does not start: broker_run returns
 * the error. Only no setting at all means "no policy".
 *
 * At start the broker logs the file and the SHA-256 of the bytes it
 * loaded, and with a state_dir writes <state_dir>/broker-policy:
 *   pid=<its pid>
 *   sha256=<hex, or "none" without a policy>
 *   file=<path, or empty>
 * so that `kscore status` says what the running broker (that pid) loaded,
 * not only what the file on disk holds now. */
#define BROKER_POLICY_MAX_BYTES (1024 * 1024)
#define BROKER_POLICY_DIGEST_HEX 65 /* 64 hex digits and a NUL */
#define BROKER_POLICY_NOTE "broker-policy"

/* The bytes of path (a regular file, at most BROKER_POLICY_MAX_BYTES),
 * read once: *buf_out (malloc'd, NUL-terminated) and *len_out. 0, -errno,
 * KS_EINVAL (not a regular file), KS_ETOOBIG, with *errmsg (malloc'd,
 * naming path) when errmsg is not NULL. */
int broker_policy_read(const char *path, char **buf_out, size_t *len_out,
                       char **errmsg);
/* The SHA-256 of buf (len bytes) as 64 lowercase hex digits. 0 or
 * KS_EINTERNAL. */
int broker_policy_digest(const char *buf, size_t len,
                         char hex[BROKER_POLICY_DIGEST_HEX]);
/* Whether buf is a policy the broker loads (name: where it came from, for
 * the message). 0, or KS_EINVAL with *errmsg ("bad policy: <name>:...")
 * naming what is wrong. */
int broker_policy_check_text(const char *name, const char *buf, size_t len,
                             char **errmsg);

#endif
