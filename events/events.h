/*
 * events: kscore's NATS layer. Subjects, JetStream set-up, protobuf bodies
 * on the wire, publish with de-duplication ids, request/reply. Knows no SQL.
 *
 * NATS layout (DESIGN.md "NATS layout"):
 *   KSCORE_CMDS    stream, work-queue, file, subjects kscore.cmd.>,
 *                  at most EVT_CMDS_MAX_BYTES (discard new) and
 *                  EVT_CMDS_MAX_AGE_MS old;
 *                  one durable push consumer per agent ("agent-<id>"),
 *                  filter kscore.cmd.<id>, delivering to
 *                  "_KSCORE.deliver.agent-<id>" (queue group agent-<id>);
 *                  the broker creates and corrects it (evt_agent_consumer,
 *                  evt_consumer_ensure), never the agent;
 *                  Nats-Msg-Id "<command>.<attempt>"
 *   KSCORE_EVENTS  stream, interest retention (an event stays until the
 *                  recorder acks it), at most EVT_EVENTS_MAX_BYTES with
 *                  discard new, at most EVT_EVENTS_PER_SUBJECT per
 *                  subject with discard new per subject (an agent's
 *                  events all come on kscore.evt.<id>.0: its share), file,
 *                  subjects kscore.evt.>, duplicate window 2 min;
 *                  Nats-Msg-Id = event_id
 *   KSCORE_AGENTS  KV bucket (stream KV_KSCORE_AGENTS), key = agent id,
 *                  value = packed Ks__AgentInfo, max age EVT_AGENT_TTL_MS
 *   kscore.api.v1.<method>  core request/reply, queue group kscore-broker
 *
 * An agent speaks JetStream as plain NATS only (no $JS.API request, no
 * nats.c JetStream call): it publishes to a stream subject with a request
 * whose reply (the PubAck) comes to its own inbox (evt_js_publish_as), it
 * receives commands on a core queue subscription to its consumer's deliver
 * subject, and it acks by publishing "+ACK", "+WPI", "-NAK", "+TERM" to a
 * message's reply subject. So its NATS user needs neither "_INBOX.>" (where
 * it could read everybody's replies) nor "$JS.API.>" (where it could make a
 * consumer that delivers every agent's commands):
 * deploy/nats-auth.conf.in.
 *
 * Threads: nats.c calls message handlers on its own delivery threads (one
 * per subscription unless global delivery is used); every handler passed in
 * here is documented with the thread that calls it.
 */
#ifndef KSCORE_EVENTS_H
#define KSCORE_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "kproto.h"

#define EVT_STREAM_CMDS "KSCORE_CMDS"
#define EVT_STREAM_EVENTS "KSCORE_EVENTS"
#define EVT_KV_AGENTS "KSCORE_AGENTS"
#define EVT_BROKER_QUEUE "kscore-broker"
/* The recorder's pull consumer on KSCORE_EVENTS (broker/recorder.c). */
#define EVT_RECORDER_DURABLE "kscore-recorder-pull"
/* The push consumer kscore had before (deliver group kscore-broker): a
 * broker deletes it once the pull consumer exists. */
#define EVT_RECORDER_DURABLE_PUSH "kscore-recorder"

/*
 * API subjects. A request goes to "<subject>.<identity>": the last token
 * names who asks (the NATS user). With the permissions of
 * deploy/nats-auth.conf.in a user may publish only under its own name, so
 * the broker learns the operator from the subject, unforgeably. Without
 * NATS authentication the name is only self-declared ("anonymous").
 */
#define EVT_API_PREFIX "kscore.api.v1."
#define EVT_API_EXECUTE "kscore.api.v1.execute"
/* An ExecuteCommand asked again (the same request, key_may_exist): every
 * broker gets it (no queue group), so one that is stopped or gone cannot
 * swallow it as it can an ask to the group (broker_execute). */
#define EVT_API_EXECUTE_AGAIN "kscore.api.v1.execute-again"
#define EVT_API_CLAIM "kscore.api.v1.claim"
/* A claim asked again (the same claim id): every broker gets it, as
 * EVT_API_EXECUTE_AGAIN. Under the claim subject's prefix, so the AGENTS
 * account reaches it through the same service import
 * (deploy/nats-auth.conf.in); "claim.*" (the first ask) never matches it. */
#define EVT_API_CLAIM_AGAIN "kscore.api.v1.claim.again"
#define EVT_API_GET "kscore.api.v1.get"
#define EVT_API_EVENTS "kscore.api.v1.events"
#define EVT_API_CANCEL "kscore.api.v1.cancel"
#define EVT_API_AGENTS "kscore.api.v1.agents"
#define EVT_API_FOLLOW "kscore.api.v1.follow"
#define EVT_API_BATCH "kscore.api.v1.batch"
#define EVT_API_LIST "kscore.api.v1.list"
#define EVT_API_LOGS "kscore.api.v1.logs"
#define EVT_API_UPLOAD "kscore.api.v1.upload"
#define EVT_API_FETCH "kscore.api.v1.fetch"
#define EVT_API_LABEL "kscore.api.v1.label"

/* Agent heartbeat period and the registry entry's max age (ms). */
#define EVT_HEARTBEAT_MS 2000
#define EVT_AGENT_TTL_MS 10000
/* Duplicate window of KSCORE_EVENTS and KSCORE_CMDS (ms). */
#define EVT_DUPLICATE_WINDOW_MS (2 * 60 * 1000)
/* The longest delivery deadline a command may have (ms):
 * ExecuteRequest/BatchRequest.deliver_within_ms (the broker's field
 * rules). */
#define EVT_DELIVER_WITHIN_MAX_MS 86400000
/*
 * The most KSCORE_CMDS holds (bytes), with discard new: past it a
 * publish is refused (the broker's publish of a command fails: its
 * deadline scanner publishes it again, or ends it Undeliverable), nothing
 * stored is dropped. Each
 * operator's share of it is the broker's (cmds_operator_mib,
 * broker__admit_take). And how long a command waits there at most (ms):
 * just over the longest delivery deadline, after which its agent would
 * refuse it as expired anyway (a work queue keeps a message until it is
 * acked: for good, for an agent that never comes back).
 */
#define EVT_CMDS_MAX_BYTES (INT64_C(1) << 30)
#define EVT_CMDS_MAX_AGE_MS (EVT_DELIVER_WITHIN_MAX_MS + 3600 * 1000)
/* The most KSCORE_EVENTS holds unrecorded (bytes): the stream's max_bytes
 * with discard new (evt_setup). */
#define EVT_EVENTS_MAX_BYTES (INT64_C(1) << 30)
/*
 * The most KSCORE_EVENTS holds unrecorded of one subject (messages), with
 * discard new per subject: a publish past it is refused (its PubAck is an
 * error, "maximum messages per subject exceeded"; an agent keeps the event
 * in its outbox and tries again). nats-server maps every event an agent
 * publishes (kscore.evt.<id>.<command>) to kscore.evt.<id>.0 in the
 * agents' account (deploy/nats-auth.conf.in), so this is each agent id's
 * share:
 * one id that publishes faster than the recorder records holds at most
 * this many (of at most KS_MAX_MESSAGE_BYTES each, 1/8 of
 * EVT_EVENTS_MAX_BYTES), and the others' events still get in, and are
 * recorded after at most this many of its.
 */
#define EVT_EVENTS_PER_SUBJECT 128
/* Longest agent id (bytes, without NUL). */
#define EVT_AGENT_ID_MAX 128
/* Longest identity: the NATS user name that API and inbox subjects carry
 * (bytes, without NUL). */
#define EVT_IDENTITY_MAX 63

/* Options for evt_connect(). Zeroed = defaults. */
struct evt_connect_opts {
    const char *name;  /* connection name shown by the server */
    bool send_asap;    /* natsOptions_SetSendAsap: for latency-critical
                          connections (nats.c otherwise waits for its
                          flusher thread, ~0.85 ms a request here) */
    int timeout_ms;    /* connect timeout; 0: 2000 */
    bool retry_forever; /* reconnect forever once connected (services);
                           the first connect still fails fast */
    bool global_delivery; /* nats.c's shared delivery thread pool instead of
                             one thread per subscription (many agent ids) */
    bool one_server; /* only url's servers, never one the cluster tells of,
                        and no reconnect: a question to one node (a
                        monitoring request answers for the server the
                        connection is on) */
    const char *user, *password, *token, *creds_file;
    /* An NKey seed file (evt_nkey_write_seed): authenticates with the
     * key's signature of the server's nonce (natsOptions_SetNKeyFromSeed);
     * user and password are then not sent. */
    const char *nkey_file;
    const char *tls_ca, *tls_cert, *tls_key;
    const char *identity; /* token in API subjects; NULL: the name in
                             nkey_file, else user, else "anonymous" */
};

struct evt_conn {
    natsConnection *nc;
    jsCtx *js;
    char identity[EVT_IDENTITY_MAX + 1]; /* a valid subject token */
    void *nkey; /* EVP_PKEY of the NKey seed: signs each (re)connect's nonce */
    /* Connect attempts given up in the signature handler because the
     * signature began with a zero byte (events.c sign_nonce). */
    _Atomic unsigned zero_sigs;
    /* Its reply inboxes (events/request.c, events_int.h). */
    struct evt__mux *mux;
    /* JetStream publishes a stream did not take for now (evt_js_stall). */
    _Atomic int js_retrying;
    _Atomic uint64_t js_retries;
    _Atomic int64_t js_retry_end_us;
};

/* How many NKey signatures, over all connections of this process, began
 * with a zero byte and were given up (a new nonce tried instead): nats.c
 * 3.4.1 sends such a signature as none (src/util.c _base64Encode returns
 * an empty string when src[0] == 0), and the server refuses the connect.
 * About one in 256. For tests and the logs. */
unsigned evt_nkey_zero_signatures(void);

/* Longest reply subject of an inbox (evt_inbox_subject), with its NUL. */
#define EVT_INBOX_MAX 256

/*
 * Connects to url (comma-separated list allowed). Returns 0, or
 * KS_EUNAVAIL with *errmsg (malloc'd, may be NULL) naming the url and the
 * cause. The caller frees with evt_close().
 */
int evt_connect(const char *url, const struct evt_connect_opts *opts,
                struct evt_conn **out, char **errmsg);
/* Flushes, closes, frees. Accepts NULL. */
void evt_close(struct evt_conn *c);

/* natsStatus -> kscore code (0, KS_ETIMEDOUT, KS_EUNAVAIL, KS_ENATS). */
int evt_err(natsStatus s);

/*
 * Creates or updates the streams and the KV bucket (idempotent). Returns 0
 * or KS_ENATS with *errmsg.
 */
int evt_setup(struct evt_conn *c, char **errmsg);
/*
 * As evt_setup, with `replicas` copies of each stream and of the KV bucket
 * (a JetStream cluster: at most its node count; < 1 is 1). Existing ones
 * are scaled to it. With replicas > 1 a failure is tried again for up to
 * 30 s (a new cluster's meta leader election).
 */
int evt_setup_replicas(struct evt_conn *c, int replicas, char **errmsg);
/* evt_setup_replicas trying again for up to wait_ms (ms, >= 0) instead of
 * 30 s, each stream request waiting at most wait_ms too when that is under
 * nats.c's 5 s, so that a caller waiting longer can say how it goes
 * meanwhile. */
int evt_setup_wait(struct evt_conn *c, int replicas, int wait_ms,
                   char **errmsg);

/*
 * Which of kscore's JetStream parts are gone: the streams KSCORE_CMDS,
 * KSCORE_EVENTS and KV_KSCORE_AGENTS (the registry bucket) and the
 * recorder's consumer on KSCORE_EVENTS. Sets bit i of *missing_out for
 * evt_part_names[i] that the server says does not exist (JetStream error
 * 10059 stream not found / 10014 consumer not found); a part the server
 * did not answer for within timeout_ms (ms, >= 1) is not counted as
 * missing. Returns 0 (asked every part) or KS_ETIMEDOUT / KS_EUNAVAIL /
 * KS_ENATS for the first part it could not ask. Any thread; c is the
 * broker's connection.
 */
#define EVT_PARTS 4
extern const char *const evt_part_names[EVT_PARTS];
int evt_parts_missing(struct evt_conn *c, int timeout_ms,
                      unsigned *missing_out);

/* 1 if id is a valid agent id: [A-Za-z0-9_-], 1..EVT_AGENT_ID_MAX. */
int evt_agent_id_valid(const char *id);

/*
 * The subject of an agent's event: "kscore.evt.<agent_id>.<command_id>", so
 * NATS permissions can let each agent publish only its own events
 * ("kscore.evt.<id>.>"); the recorder checks the event's agent_id against
 * the subject. buf >= 16 + EVT_AGENT_ID_MAX + 37.
 */
void evt_event_subject(char *buf, size_t len, const char *agent_id,
                       const char *command_id);
/* 1 if an event of agent_id about command_id may come on subject: its
 * evt_event_subject, or "kscore.evt.<agent_id>.0", which nats-server makes
 * of it in the agents' account (deploy/nats-auth.conf.in: the subject is
 * the sender's share of the stream). Else 0. */
int evt_event_subject_ok(const char *subject, const char *agent_id,
                         const char *command_id);
/*
 * The agent ids that hold EVT_EVENTS_PER_SUBJECT unrecorded events now
 * (their publishes are refused until the recorder takes some): from the
 * stream's per-subject counts of kscore.evt.<id>.0. On 0, *ids_out
 * (malloc'd, each malloc'd; free with evt_strv_free) and *n_out. Any
 * thread. 0 or KS_ENATS.
 */
int evt_events_agents_at_share(struct evt_conn *c, int timeout_ms,
                               char ***ids_out, size_t *n_out);
/* Frees n strings and their array (accepts NULL). */
void evt_strv_free(char **v, size_t n);
/* The agent id token of an event subject ("kscore.evt.<agent_id>.<...>")
 * into buf (>= EVT_AGENT_ID_MAX + 1);
 * "" when subject is no such thing or the token is no valid agent id.
 * Returns buf. */
char *evt_event_subject_agent(const char *subject, char *buf, size_t len);

/*
 * The subject a command for agent_id is published on, into buf
 * (>= 16 + 2 * EVT_AGENT_ID_MAX): "kscore.cmd.<agent_id>" when pool is NULL
 * or "" (the id has its own consumer, evt_agent_consumer), else
 * "kscore.cmd.<pool>.<agent_id>" (the id is served by an agent pool: one
 * process serving many ids through one consumer, evt_pool_consumer). Both
 * are under the KSCORE_CMDS subject "kscore.cmd.>"; the id stays the last
 * token, so every id of a pool is still addressed on its own.
 */
void evt_cmd_subject(char *buf, size_t len, const char *pool,
                     const char *agent_id);
/* Durable consumer name of an agent: "agent-<id>". It is also the agent's
 * NATS identity (user, API token, inbox "_INBOX.agent-<id>."). */
void evt_agent_durable(char *buf, size_t len, const char *agent_id);
/* Durable consumer name of an agent pool: "pool-<pool>". */
void evt_pool_durable(char *buf, size_t len, const char *pool);
/* Deliver subject of a push consumer: "_KSCORE.deliver.<durable>". */
void evt_deliver_subject(char *buf, size_t len, const char *durable);

/* ---- NKeys: who connects to NATS (events/nkey.c) ------------------------ */

/*
 * NATS NKeys made with OpenSSL: Ed25519 keys in the text form nats-server
 * and nats.c use (github.com/nats-io/nkeys): base32 (RFC 4648, no padding)
 * of prefix byte(s) + 32 key bytes + CRC-16/XMODEM little-endian. A user's
 * public key starts with 'U' (EVT_NKEY_PUBLIC_CHARS chars) and goes into
 * nats-server's config (`users = [{nkey: "U..."}]`); its seed starts with
 * "SU" (EVT_NKEY_SEED_CHARS chars) and is the secret: whoever holds it
 * connects as that user. The server only ever sees the public key and a
 * signature of its nonce.
 */
#define EVT_NKEY_PUBLIC_CHARS 56
#define EVT_NKEY_SEED_CHARS 58

/* Text forms of a raw Ed25519 public key / seed (32 bytes). Pure. */
void evt_nkey_encode_public(const uint8_t raw[32],
                            char out[EVT_NKEY_PUBLIC_CHARS + 1]);
void evt_nkey_encode_seed(const uint8_t seed[32],
                          char out[EVT_NKEY_SEED_CHARS + 1]);
/* Back to 32 raw bytes: 0, or KS_EINVAL (length, alphabet, prefix, CRC). */
int evt_nkey_decode_public(const char *text, uint8_t raw_out[32]);
int evt_nkey_decode_seed(const char *text, uint8_t seed_out[32]);
/* The public key of a seed (Ed25519 derivation). 0, KS_EINVAL. */
int evt_nkey_public_of_seed(const char *seed_text,
                            char pub_out[EVT_NKEY_PUBLIC_CHARS + 1]);
/* A new user key pair (OpenSSL's random source). 0 or KS_EINTERNAL. */
int evt_nkey_generate(char seed_out[EVT_NKEY_SEED_CHARS + 1],
                      char pub_out[EVT_NKEY_PUBLIC_CHARS + 1]);

/* 1 if name can be an identity: [A-Za-z0-9_-], 1..EVT_IDENTITY_MAX. */
int evt_identity_valid(const char *name);

/*
 * A seed file: comment lines naming the identity ("# kscore NATS identity:
 * NAME") and the public key, then the seed on its own line, which is what
 * nats.c reads from a seed file (the first line starting with "SU").
 * evt_nkey_write_seed creates path with mode 0600 and never replaces a
 * file: 0, -EEXIST, -errno, KS_EINVAL (bad identity or seed).
 * evt_nkey_read_seed reads one back: the seed, its public key, and the
 * identity ("" when the file names none, e.g. a seed from `nk -gen user`).
 * 0, -errno, KS_EINVAL (no valid seed in the file).
 */
int evt_nkey_write_seed(const char *path, const char *identity,
                        const char *seed_text);
int evt_nkey_read_seed(const char *path,
                       char seed_out[EVT_NKEY_SEED_CHARS + 1],
                       char pub_out[EVT_NKEY_PUBLIC_CHARS + 1],
                       char identity_out[EVT_IDENTITY_MAX + 1]);

/* ---- signed commands (Ed25519 via OpenSSL libcrypto) -------------------- */

/* A private key that signs commands (the broker's). */
struct evt_signer;
/* The public keys an agent trusts. */
struct evt_verifier;

#define EVT_SIGNATURE_BYTES 64
#define EVT_KEY_ID_CHARS 16

/*
 * Writes a new Ed25519 key pair: the private key as PKCS#8 PEM to
 * priv_path (mode 0600) and the public key as SubjectPublicKeyInfo PEM to
 * pub_path (0644). Refuses to overwrite (-EEXIST). 0, -errno, KS_EINTERNAL.
 */
int evt_keygen(const char *priv_path, const char *pub_path);

/* Loads a private key (PEM). 0, -errno, KS_EINVAL (not an Ed25519 key). */
int evt_signer_load(const char *priv_path, struct evt_signer **out);
void evt_signer_free(struct evt_signer *s);
/* The signer's public key id (EVT_KEY_ID_CHARS hex chars, NUL-ended). */
const char *evt_signer_key_id(const struct evt_signer *s);

/* Signs data: sig gets EVT_SIGNATURE_BYTES bytes. 0 or KS_EINTERNAL. */
int evt_sign(const struct evt_signer *s, const void *data, size_t len,
             uint8_t sig[EVT_SIGNATURE_BYTES]);

/* An empty verifier; add keys with evt_verifier_add_file/_signer. */
int evt_verifier_new(struct evt_verifier **out);
void evt_verifier_free(struct evt_verifier *v);
/* Trusts the public key in a PEM file (public or private key). */
int evt_verifier_add_file(struct evt_verifier *v, const char *path);
/* Trusts the public half of a signer (in-process agents). */
int evt_verifier_add_signer(struct evt_verifier *v,
                            const struct evt_signer *s);
/* Number of trusted keys. */
size_t evt_verifier_count(const struct evt_verifier *v);

/*
 * Checks sig over data with the trusted key named key_id (any trusted key
 * when key_id is empty). 0 if valid; KS_EREJECTED if not. Any thread.
 */
int evt_verify(const struct evt_verifier *v, const char *key_id,
               const void *data, size_t len, const uint8_t *sig,
               size_t sig_len);

/*
 * Label attestations: the broker's signature over an agent's labels, so an
 * agent cannot give itself labels (which pick the targets of --select and
 * of policy rules, and so who gets which commands and secrets). `kscore
 * agent enroll` signs (agent id, enrolment time, labels) with the broker's
 * key and puts it in the bundle; the agent sends it in its registry entry
 * (AgentInfo attested_labels..labels_key_id); the broker verifies it with
 * its own key and then uses exactly those labels (broker/registry.c).
 *
 * The signed text is canonical and unambiguous: a fixed first line (so it
 * is never the packed Command a command signature covers), then
 * "agent LEN:ID", "enrolled_at_us N" and one "label LEN:KEY LEN:VALUE" per
 * label sorted by key then value (byte order), each line ending '\n'. The
 * lengths keep a '=' or a newline in a key or value from moving the
 * boundary between two labels.
 *
 * evt_labels_text: the text (malloc'd, NUL-ended; *len without the NUL).
 * 0 or -ENOMEM. evt_labels_sign: sig over it (0 or KS_EINTERNAL).
 * evt_labels_verify: 0 when sig is a trusted key's (key_id as in
 * evt_verify) over the text of exactly these fields, else KS_EREJECTED.
 * Any thread.
 */
#define EVT_LABELS_ATTEST_HEADER "kscore agent labels v1\n"
int evt_labels_text(const char *agent_id, int64_t enrolled_at_us,
                    Ks__EnvVar *const *labels, size_t n, char **out,
                    size_t *len);
int evt_labels_sign(const struct evt_signer *s, const char *agent_id,
                    int64_t enrolled_at_us, Ks__EnvVar *const *labels,
                    size_t n, uint8_t sig[EVT_SIGNATURE_BYTES]);
int evt_labels_verify(const struct evt_verifier *v, const char *key_id,
                      const char *agent_id, int64_t enrolled_at_us,
                      Ks__EnvVar *const *labels, size_t n, const uint8_t *sig,
                      size_t sig_len);

/* ---- sealed values (X25519, HKDF-SHA256, ChaCha20-Poly1305; seal.c) ------ */

/*
 * A sealed box: anyone with an agent's X25519 public key can seal a value
 * that only the holder of the private key can open, and nobody can change
 * it unnoticed. kscore uses it for `kscore exec --secret-env`: the CLI
 * seals, the broker records and signs the ciphertext, the agent opens it
 * just before the spawn. Every primitive is OpenSSL's (libcrypto 3).
 *
 * Format (EVT_SEAL_OVERHEAD bytes more than the value):
 *   version   1 byte, EVT_SEAL_VERSION
 *   epk       32 bytes, a fresh X25519 public key (one per seal)
 *   nonce     12 bytes, random
 *   ct        the value encrypted with ChaCha20 (RFC 8439), same length
 *   tag       16 bytes, Poly1305 over (version || aad) and ct
 * key = HKDF-SHA256 (RFC 5869) with IKM = X25519(esk, recipient) (RFC
 * 7748), no salt, info = "kscore seal v1" || epk || recipient public key,
 * 32 bytes. An all-zero shared secret (a low-order point) is refused.
 *
 * aad is bound to the box: opening with other aad fails. Callers put in
 * it what the value is for (evt_seal_env: agent, operator, name), so a
 * box cannot be moved to another use that the same key would open.
 *
 * Thread safety: a key is read-only once made; every function may be
 * called from any thread.
 */
#define EVT_SEAL_VERSION 1
#define EVT_SEAL_KEY_BYTES 32
#define EVT_SEAL_OVERHEAD (1 + 32 + 12 + 16)
/* Longest value evt_seal_env seals: as an env value (MAX_ARG_STRLEN). */
#define EVT_SEAL_ENV_VALUE_MAX (128 * 1024)

/* An X25519 private key (an agent's). */
struct evt_seal_key;

/* A new random key, in memory only. 0, -ENOMEM, KS_EINTERNAL. */
int evt_seal_key_new(struct evt_seal_key **out);
/*
 * The key in path (PKCS#8 PEM), made first when the file does not exist
 * (mode 0600, created beside it and linked into place, so two processes
 * starting at once end with the same key). Refuses a file that group or
 * others may read or write (KS_EINVAL, *errmsg says so: a private key),
 * one that is not an X25519 key (KS_EINVAL), -errno. *errmsg (may be
 * NULL) is malloc'd.
 */
int evt_seal_key_open(const char *path, struct evt_seal_key **out,
                      char **errmsg);
/* A key from its 32 raw bytes (RFC 7748; known-answer tests). */
int evt_seal_key_from_raw(const uint8_t priv[EVT_SEAL_KEY_BYTES],
                          struct evt_seal_key **out);
/* Accepts NULL. */
void evt_seal_key_free(struct evt_seal_key *k);
/* The public half, to publish (AgentInfo.seal_key). */
void evt_seal_key_public(const struct evt_seal_key *k,
                         uint8_t pub[EVT_SEAL_KEY_BYTES]);

/*
 * Seals pt (pt_len bytes, at most KS_MAX_MESSAGE_BYTES) to the public key
 * pub with aad (aad_len bytes, may be 0). On 0, *out (malloc'd) holds
 * pt_len + EVT_SEAL_OVERHEAD bytes. KS_EINVAL (pub is not a usable X25519
 * key), KS_ETOOBIG, -ENOMEM, KS_EINTERNAL.
 */
int evt_seal(const uint8_t pub[EVT_SEAL_KEY_BYTES], const void *aad,
             size_t aad_len, const void *pt, size_t pt_len, uint8_t **out,
             size_t *out_len);
/*
 * Opens a box sealed to k with the same aad. On 0, *out (free it with
 * evt_seal_wipe_free, which clears it first) holds *out_len bytes and a
 * NUL after them. KS_EREJECTED when it does not open: another key, other
 * aad, a changed byte, a short or unknown-version box. -ENOMEM,
 * KS_EINTERNAL.
 */
int evt_unseal(const struct evt_seal_key *k, const void *aad, size_t aad_len,
               const void *box, size_t box_len, uint8_t **out,
               size_t *out_len);
/* Clears len bytes of p (OPENSSL_cleanse), then frees it. Accepts NULL. */
void evt_seal_wipe_free(void *p, size_t len);

/*
 * A secret environment variable (SealedEnv): the value sealed to pub with
 * aad = "kscore sealed env v1" then agent_id, operator and name, each as a
 * 2-byte big-endian length and its bytes. So a box opens only for that
 * agent id (one process serving several ids has one key), in a command of
 * that operator (the broker records the operator from the NATS subject,
 * which the operator cannot forge, and signs it into the command), as
 * that name. It can still be replayed into another command of the same
 * operator to the same agent under the same name: that operator had the
 * value anyway. The CLI cannot bind the command id: the broker assigns it
 * after the seal. value: a C string of at most EVT_SEAL_ENV_VALUE_MAX
 * bytes. Returns as evt_seal, KS_EINVAL for a bad argument.
 */
int evt_seal_env(const uint8_t pub[EVT_SEAL_KEY_BYTES], const char *agent_id,
                 const char *operator_name, const char *name,
                 const char *value, uint8_t **out, size_t *out_len);
/*
 * Opens what evt_seal_env sealed. On 0, *value_out is the NUL-terminated
 * value (evt_seal_wipe_free(v, strlen(v))). KS_EREJECTED as evt_unseal,
 * and for a value with a NUL byte or longer than EVT_SEAL_ENV_VALUE_MAX.
 */
int evt_unseal_env(const struct evt_seal_key *k, const char *agent_id,
                   const char *operator_name, const char *name,
                   const void *box, size_t box_len, char **value_out);

/*
 * Publishes a command on KSCORE_CMDS, on evt_cmd_subject(pool,
 * cmd->agent_id) (pool: the id's AgentInfo.pool as the broker's registry
 * knows it; NULL or "": none), as a SignedCommand (signed by signer) with
 * Nats-Msg-Id "<command_id>.<attempt>" and waits for the PubAck: through
 * evt_js_publish_window on c's own inbox, so tried again within
 * timeout_ms (the whole budget, ms: EVT_PUBLISH_RETRY_MS to outlast a
 * stream leader's election) while the stream does not take it for now.
 * seq_out (may be NULL): on 0, the stream sequence the message is stored
 * at (a duplicate's PubAck names the first copy's: nats-server 2.9
 * answers a Nats-Msg-Id seen in the duplicate window with the sequence it
 * stored it at), else 0.
 * Returns 0, KS_ETOOBIG (packed size over KS_MAX_MESSAGE_BYTES; nothing
 * published), KS_ETIMEDOUT, KS_EUNAVAIL, KS_ENATS.
 */
int evt_publish_command(struct evt_conn *c, const struct evt_signer *signer,
                        const Ks__Command *cmd, const char *pool,
                        int timeout_ms, uint64_t *seq_out);
/*
 * The same for n commands at once, EVT_JS_WINDOW_MAX to a window
 * (evt_js_publish_window: one round trip each, every PubAck looked at,
 * what the stream did not take tried again), all within timeout_ms.
 * pools: NULL, or n entries (each NULL, "" or the pool of cmds[i]'s agent,
 * as for evt_publish_command). seqs_out: NULL, or n entries, each set to
 * the stream sequence cmds[i] is stored at, 0 for one not stored.
 * rcs_out: NULL, or n entries, each 0 (stored) or why cmds[i] was not:
 * KS_ETOOBIG (never sent), KS_ETIMEDOUT or KS_EUNAVAIL (not taken for
 * now), KS_ENATS (an error PubAck: not a 503 one, or a 503 one at the
 * end of timeout_ms).
 * Returns how many were not stored: refused, unanswered within
 * timeout_ms, or never sent (a command too large). 0: all stored. Any
 * thread.
 */
int evt_publish_commands(struct evt_conn *c, const struct evt_signer *signer,
                         Ks__Command *const *cmds, const char *const *pools,
                         size_t n, int timeout_ms, uint64_t *seqs_out,
                         int *rcs_out);

/*
 * Publishes an event to evt_event_subject(agent_id, command_id) on
 * KSCORE_EVENTS with Nats-Msg-Id = event_id and waits for the PubAck, as
 * evt_publish_command (tried again within timeout_ms). A duplicate PubAck
 * counts as success. Returns 0, KS_ETOOBIG, KS_ETIMEDOUT, KS_EUNAVAIL,
 * KS_ENATS.
 */
int evt_publish_event(struct evt_conn *c, const Ks__Event *ev, int timeout_ms);

/*
 * Packs msg and sends it as a core request to subject (API subjects get
 * ".<identity>" appended); waits timeout_ms for one reply. On 0, *reply_out is the reply (natsMsg_Destroy it).
 * Returns KS_ETIMEDOUT, KS_EUNAVAIL (no responders: nobody serves subject),
 * KS_ENATS, -ENOMEM.
 */
int evt_request(struct evt_conn *c, const char *subject,
                const ProtobufCMessage *msg, int timeout_ms,
                natsMsg **reply_out);

/*
 * Packs msg and publishes it on subject (core NATS; replies to requests).
 * Returns 0, KS_ETOOBIG, KS_ENATS, -ENOMEM.
 */
int evt_publish_msg(struct evt_conn *c, const char *subject,
                    const ProtobufCMessage *msg);

/*
 * Replies larger than one NATS message. evt_publish_reply sends a message
 * that packs to more than EVT_PART_BYTES as consecutive parts of at most
 * EVT_PART_BYTES, each with the headers Ks-Parts (how many) and Ks-Part
 * (1-based index); the requester (evt_request*, which waits on its own
 * inbox) puts them back together into one message. At most
 * EVT_REPLY_MAX_BYTES in all (KS_ETOOBIG).
 */
#define EVT_PART_BYTES (KS_MAX_MESSAGE_BYTES - 4096)
#define EVT_REPLY_MAX_BYTES ((size_t)1 << 30)
#define EVT_HDR_PARTS "Ks-Parts"
#define EVT_HDR_PART "Ks-Part"
/* Publishes a reply to a request (evt_request*, broker_execute) on its
 * reply subject: as evt_publish_msg, in parts past EVT_PART_BYTES. 0,
 * KS_ETOOBIG (past EVT_REPLY_MAX_BYTES), KS_ENATS, -ENOMEM. */
int evt_publish_reply(struct evt_conn *c, const char *subject,
                      const ProtobufCMessage *msg);
/* evt_unpack for a reply that may have come in parts: up to
 * EVT_REPLY_MAX_BYTES. */
int evt_unpack_reply(const ProtobufCMessageDescriptor *desc, const void *data,
                     size_t len, ProtobufCMessage **out);

/*
 * Reply inboxes (events/request.c). Every request kscore makes gets its
 * replies on "_INBOX.<identity>.<...>", and the server's permissions let a
 * user subscribe to "_INBOX.<its name>.>" only, so nobody reads another
 * user's replies (nats.c 3.4.1's own requests use "_INBOX.<nuid>", which
 * would need "_INBOX.>" for everyone).
 *
 * The inboxes live as long as the connection: kscore makes no subscription
 * per request (a subscription destroyed while a late reply came in could
 * hang nats.c 3.4.1's read thread for good: nats.c issue 637). Each
 * identity of a connection has a few synchronous subscriptions, each lent
 * to one waiter at a time (a lease): the lease's subject
 * evt_inbox_subject() and anything under it ("<subject>.<suffix>") reach
 * it; a reply for an earlier lease of the same subscription (its waiter
 * gave up) is dropped and counted (evt_late_replies). No delivery thread
 * is involved: a handler on nats.c's delivery threads may wait for a
 * reply.
 *
 * evt_inbox_take: lends an inbox of identity (NULL: the connection's;
 * letters, digits, _ and -, at most EVT_AGENT_ID_MAX + 8 of them, or
 * KS_EINVAL) to the caller, which alone uses it
 * until evt_inbox_give. Waits only when INBOXES_MAX (1024) of this
 * identity are lent. 0, KS_EINVAL, -ENOMEM, or as evt_err when a
 * subscription cannot be made. Any thread.
 * evt_inbox_subject: the lease's reply subject (valid until give).
 * evt_inbox_send: publishes data (len bytes, <= KS_MAX_MESSAGE_BYTES) to
 * subject with the reply "<lease subject>[.<reply_suffix>]" (suffix NULL
 * or ""; a valid subject token or tokens) and the header Nats-Msg-Id =
 * msg_id when not NULL. 0, KS_ETOOBIG, or as evt_err.
 * evt_inbox_next: the next message for the lease within timeout_ms (ms,
 * > 0): 0 with *out (natsMsg_Destroy it; its subject says which suffix),
 * KS_EUNAVAIL for the server's "no responders" to one of the lease's
 * publishes (nobody serves its subject) or a connection gone,
 * KS_ETIMEDOUT.
 * evt_inbox_give: gives the inbox back (accepts NULL). One whose publish
 * is still unanswered is lent again only after a PING has come back
 * (evt_link_probe), so that no late "no responders" meets the next waiter.
 */
struct evt_inbox;
int evt_inbox_take(struct evt_conn *c, const char *identity,
                   struct evt_inbox **out);
const char *evt_inbox_subject(const struct evt_inbox *ib);
int evt_inbox_send(struct evt_inbox *ib, const char *subject,
                   const char *reply_suffix, const char *msg_id,
                   const void *data, size_t len);
int evt_inbox_next(struct evt_inbox *ib, int timeout_ms, natsMsg **out);
void evt_inbox_give(struct evt_inbox *ib);
/*
 * Takes the parts that follow first (a message with Ks-Parts n > 1) from
 * ib, each within timeout_ms, and returns in *out one message with the
 * whole data (first is consumed either way). A message without the
 * header is returned as is. 0, KS_ETIMEDOUT, KS_EDECODE (parts out of
 * order), KS_ETOOBIG, -ENOMEM.
 */
int evt_join_parts(struct evt_inbox *ib, natsMsg *first, int timeout_ms,
                   natsMsg **out);
/* Replies dropped because their waiter had given up, since connect. */
uint64_t evt_late_replies(const struct evt_conn *c);

/*
 * The link's liveness. nats.c may say CONNECTED while nothing gets
 * through (writes failing, a server that stopped, a read thread that
 * hangs): only an answer from the server proves the link.
 * evt_link_probe: a PING and its PONG (natsConnection_FlushTimeout) within
 * timeout_ms; 0 or as evt_err (KS_ETIMEDOUT, KS_EUNAVAIL). Any thread.
 * evt_link_answered_us: when the server last answered on c (ks_mono_us: a
 * message on one of its inboxes, a "no responders", a probe's PONG); 0:
 * never.
 */
int evt_link_probe(struct evt_conn *c, int timeout_ms);
int64_t evt_link_answered_us(const struct evt_conn *c);

/*
 * A watch of c's link (events/link.c): a thread that, while nats.c says
 * CONNECTED, sends a PING every EVT_LINK_PROBE_MS unless something else
 * was answered within that time, and calls dead(ud, silent_us) once when
 * nats.c has said CONNECTED for more than timeout_ms (ms) with no answer
 * from the server in that time: a link nats.c will not repair (a server
 * stopped or cut off without a reset, a read thread that hangs). While
 * nats.c says it is not connected it reconnects by itself, and the watch
 * only waits. dead runs on the watch's thread; it must not stop the watch.
 * 0 with *out, -ENOMEM, KS_EINTERNAL. evt_link_watch_stop joins the thread
 * and frees (accepts NULL); c must outlive the watch.
 */
#define EVT_LINK_PROBE_MS 1000
struct evt_link_watch;
int evt_link_watch_start(struct evt_conn *c, int timeout_ms,
                         void (*dead)(void *ud, int64_t silent_us), void *ud,
                         struct evt_link_watch **out);
void evt_link_watch_stop(struct evt_link_watch *w);

/*
 * evt_request under another identity than the connection's: API subjects
 * get ".<identity>" and the reply comes to an inbox of identity.
 * For a connection that acts for several ids (an agent process serving
 * several agent ids claims as "agent-<id>" for each): the server's
 * permissions must allow that user both subjects. identity NULL: the
 * connection's. Returns as evt_request.
 */
int evt_request_as(struct evt_conn *c, const char *identity,
                   const char *subject, const ProtobufCMessage *msg,
                   int timeout_ms, natsMsg **reply_out);
/*
 * Request/reply on a lent inbox (evt_inbox_take). evt_request_bytes:
 * publishes data (len bytes, at most KS_MAX_MESSAGE_BYTES) to subject,
 * with the header Nats-Msg-Id = msg_id when msg_id is not NULL (a
 * JetStream publish whose PubAck is the reply); waits up to timeout_ms
 * for the reply, put together from its parts if it came in parts. On 0,
 * *reply_out is the reply (natsMsg_Destroy it). KS_EUNAVAIL when the
 * server says no one serves subject (no responders) or the connection is
 * down, KS_ETIMEDOUT, KS_ETOOBIG, KS_ENATS, -ENOMEM. Any thread, delivery
 * threads included (it waits in the calling thread).
 */
int evt_request_bytes(struct evt_conn *c, const char *subject,
                      const char *msg_id, const void *data, size_t len,
                      int timeout_ms, natsMsg **reply_out);
/* evt_request_bytes with the reply on an inbox of identity (NULL: the
 * connection's), as evt_request_as. */
int evt_request_bytes_as(struct evt_conn *c, const char *identity,
                         const char *subject, const char *msg_id,
                         const void *data, size_t len, int timeout_ms,
                         natsMsg **reply_out);

/* ---- JetStream as plain NATS (events/jetstream.c) ----------------------- */

/* A stream's acknowledgement of a publish (nats-server docs, "JetStream
 * wire API": {"stream": "...", "seq": n, "duplicate": true?}). */
struct evt_puback {
    char stream[64];
    uint64_t seq;
    bool duplicate; /* the Nats-Msg-Id was in the duplicate window */
};

/*
 * Parses the reply to a publish on a stream subject. 0 with *out (may be
 * NULL) for a PubAck; KS_ENATS for the server's refusal
 * {"error": {"code": 503, "err_code": 10077, "description": "..."}}, with
 * why (why_len bytes, may be NULL) "<description> (<code>/<err_code>)";
 * KS_EDECODE for anything else (not JSON, no stream or seq). Pure.
 */
int evt_puback_parse(const void *data, size_t len, struct evt_puback *out,
                     char *why, size_t why_len);

/*
 * How many times JetStream has delivered a message (1 the first time),
 * read from its ack reply subject ("$JS.ACK...", natsMsg_GetReply); 0 when
 * reply is NULL or not one. What natsMsg_GetMetaData says as NumDelivered,
 * without the three allocations it makes per message. Pure.
 */
uint64_t evt_ack_delivered(const char *reply);

/*
 * How long a JetStream publish is tried again while the stream does not
 * take it for now (ms): a stream leader's election after its node died,
 * measured at up to 15 s on `kscore up --cluster 3` (docs/cluster.md),
 * with room to spare. What waits for a command's publish (the broker's
 * dispatch) gives it this much.
 */
#define EVT_PUBLISH_RETRY_MS 20000
/* One try's wait for its PubAcks (ms); a PubAck takes milliseconds. */
#define EVT_PUBLISH_TRY_MS 2000
/* The wait of each try after one that failed (ms). During an election a
 * try may get no answer at all (no PubAck, no "no responders"), so it
 * waits its whole wait, and the try under way when the new leader takes
 * over ends only then. With 2 s tries that added up to 2 s to a
 * publish past the election (test_cluster F02: an exec 1.1 s over the
 * election and 2 s). A try again has the same Nats-Msg-Id: a PubAck that
 * was merely slow makes the next one a duplicate, which the stream
 * drops and acks. */
#define EVT_PUBLISH_RETRY_TRY_MS 500

/*
 * Publishes data (len bytes) to a stream's subject and waits for the
 * stream's PubAck, which comes back on an inbox of identity (NULL: the
 * connection's), with the header Nats-Msg-Id = msg_id when not NULL: as
 * evt_js_publish_window for one message, so tried again within
 * timeout_ms when the stream does not take it for now. A duplicate is a
 * success (the stream has the message). No $JS.API subject is used, so a
 * user that may only publish to the subject and read its own inbox can do
 * it. Returns 0 with *ack_out (may be NULL); KS_ENATS when the stream
 * refused it (why, up to why_len bytes, may be NULL, says why:
 * evt_puback_parse); KS_EUNAVAIL when no stream takes the subject ("no
 * responders") or the connection is down; KS_ETIMEDOUT (also what a
 * publish the permissions refuse looks like: the server drops it);
 * KS_EDECODE (a reply that is no PubAck); KS_ETOOBIG; -ENOMEM. Any
 * thread; waits in the calling thread.
 */
int evt_js_publish_as(struct evt_conn *c, const char *identity,
                      const char *subject, const char *msg_id,
                      const void *data, size_t len, int timeout_ms,
                      struct evt_puback *ack_out, char *why, size_t why_len);

/* One message of evt_js_publish_window. */
struct evt_js_msg {
    const char *subject;
    const char *msg_id; /* Nats-Msg-Id, may be NULL */
    const void *data;
    size_t len;
    int rc; /* out: as evt_js_publish_as */
    struct evt_puback *ack; /* out, may be NULL: its PubAck */
    char *why;              /* out, may be NULL: why it failed */
    size_t why_len;
};

/*
 * Publishes n messages (1 <= n <= EVT_JS_WINDOW_MAX) to stream subjects
 * and waits for their PubAcks: all are published with replies on one
 * inbox lease of identity (NULL: the connection's), "<lease>.<i>", then
 * the PubAcks are collected, so n publishes cost one round trip, not n.
 * Every PubAck is looked at: an error is that message's failure, never
 * taken for a success. What the stream did not take for now ("no
 * responders": no stream leader; no PubAck within EVT_PUBLISH_TRY_MS; an
 * error PubAck with code 503) is published again, with the same msg_id,
 * with a growing pause (50 ms to EVT_PUBLISH_PAUSE_MAX_MS), until
 * timeout_ms (ms, the whole
 * budget) has passed: the stream's de-duplication (within
 * EVT_DUPLICATE_WINDOW_MS) keeps one copy of a message that more than one
 * try reached, so a message without a msg_id may be stored twice. Each
 * msgs[i].rc is set (0, KS_ENATS, KS_EUNAVAIL, KS_ETIMEDOUT, KS_EDECODE,
 * KS_ETOOBIG), and ack / why when given. Returns 0 when every rc is 0,
 * else the first failing rc. The stream may store them in any order:
 * callers that need an order put one message of a kind in a window. Any
 * thread; waits in the calling thread.
 */
#define EVT_JS_WINDOW_MAX 256
/* The longest pause between two tries (ms). A try during an election
 * costs the server one "no responders"; a pause is what a publish may
 * still wait once the new leader takes it (a cap of 1 s added up to 1 s
 * to every command of test_cluster's F02 past the election). */
#define EVT_PUBLISH_PAUSE_MAX_MS 250
int evt_js_publish_window(struct evt_conn *c, const char *identity,
                          struct evt_js_msg *msgs, size_t n, int timeout_ms);

/*
 * The publishes on c that a stream did not take for now and that are
 * tried again (evt_js_publish_window, evt_js_publish_as: a stream leader's
 * election, a stream without quorum). *retrying_out (may be NULL): how
 * many are being tried again now; *retries_out (may be NULL): the tries
 * again since connect. Returns when the last such publish ended, taken or
 * given up (ks_mono_us; 0: none yet). For a caller that must tell a wait
 * for JetStream from a queue of its own (the broker's admission). Any
 * thread.
 */
int64_t evt_js_stall(struct evt_conn *c, int *retrying_out,
                     uint64_t *retries_out);

/*
 * Unpacks data (len bytes) as desc. Refuses more than KS_MAX_MESSAGE_BYTES
 * with KS_ETOOBIG before allocating; KS_EDECODE if malformed. On 0, *out is
 * owned by the caller (protobuf_c_message_free_unpacked).
 */
int evt_unpack(const ProtobufCMessageDescriptor *desc, const void *data,
               size_t len, ProtobufCMessage **out);
/*
 * As evt_unpack, and every string field at any depth must be valid UTF-8
 * without a NUL byte (events/wire.c: protobuf-c would cut a string at its
 * NUL and run something other than what was recorded); otherwise
 * KS_EINVAL with why (why_len bytes, may be NULL) naming the field and the
 * rule, e.g. "ExecuteRequest.spec.argv: contains a NUL byte". evt_unpack
 * applies the same check and calls a failure KS_EDECODE.
 */
int evt_unpack_why(const ProtobufCMessageDescriptor *desc, const void *data,
                   size_t len, ProtobufCMessage **out, char *why,
                   size_t why_len);
/*
 * evt_unpack with the memory from alloc (NULL: malloc), e.g. an arena's
 * (kproto_arena_pb): *out then lives as long as the arena's round and is
 * never freed alone. The same checks and codes as evt_unpack.
 */
int evt_unpack_in(const ProtobufCMessageDescriptor *desc, const void *data,
                  size_t len, ProtobufCAllocator *alloc,
                  ProtobufCMessage **out);
/* The check alone: 0, KS_EINVAL (why as above) or KS_EDECODE. Pure. */
int evt_check_wire(const ProtobufCMessageDescriptor *desc, const void *data,
                   size_t len, char *why, size_t why_len);

/*
 * One field of a protobuf message on the wire (protobuf.dev "Encoding":
 * a varint key, field number << 3 | wire type). number >= 1; type 0
 * (varint: value), 1 (8 bytes), 2 (length-delimited), 5 (4 bytes): data
 * and len are the field's bytes for 1, 2 and 5 (they point into the
 * message).
 */
struct evt_wire_field {
    uint32_t number;
    unsigned type;
    uint64_t value;
    const uint8_t *data;
    size_t len;
};
/*
 * Reads the top-level field at *p (end: the message's end) into *f and
 * moves *p past it, without decoding anything else (a field a reader does
 * not need costs nothing, however long). 0; 1 at the end (*p == end);
 * KS_EDECODE when malformed or a group (not in kscore.proto). Pure.
 */
int evt_wire_next(const uint8_t **p, const uint8_t *end,
                  struct evt_wire_field *f);

/* A durable push consumer, created (or updated) explicitly and then bound,
 * so that unsubscribing never deletes it: nats.c deletes a consumer that
 * js_Subscribe itself created when the subscription is unsubscribed or
 * drained, durable or not (nats.c src/js.c, jsSub_deleteConsumer). Its
 * deliver subject is evt_deliver_subject(durable), its ack policy
 * explicit, its deliver policy "all". */
struct evt_durable {
    const char *stream;
    const char *durable;          /* consumer name */
    const char *filter_subject;
    const char *deliver_group;    /* NULL: not a queue consumer */
    int64_t max_ack_pending;
    int64_t ack_wait_ms;
    int64_t max_deliver;          /* 0: unlimited */
    /* A pull consumer (no deliver subject, no group): its messages go only
     * to whoever asks for them (evt_durable_subscribe, evt_fetch). */
    bool pull;
};

/* What evt_consumer_ensure did. */
enum evt_consumer_change {
    EVT_CONSUMER_KEPT = 0, /* it was as asked */
    EVT_CONSUMER_CREATED,  /* it did not exist */
    EVT_CONSUMER_UPDATED,  /* limits (ack wait, max deliver, max ack
                              pending) changed in place */
    EVT_CONSUMER_REPLACED  /* it delivered something else (filter, deliver
                              subject or group, ack or deliver policy,
                              headers only, flow control, heartbeats, rate
                              limit, back-off): deleted and created anew */
};

/*
 * Makes the consumer d exactly as asked (nats.c JetStream API on c: the
 * broker's connection, never an agent's). A consumer of that name that
 * delivers anything else (another filter, deliver subject or group, ...)
 * is deleted and created anew, never updated in place: a consumer that
 * delivers another agent's subject must not survive, and nats-server 2.9
 * refuses to change a filter in place. Deleting loses only its delivery
 * state: on a work-queue stream the messages stay until acked, and the new
 * consumer delivers them again (the claim fence keeps one run). A consumer
 * that differs only in its limits is updated. *change_out (may be NULL)
 * says which, on 0. Returns 0 or KS_ENATS with *errmsg (malloc'd, may be
 * NULL). Any thread.
 */
int evt_consumer_ensure(struct evt_conn *c, const struct evt_durable *d,
                        enum evt_consumer_change *change_out, char **errmsg);

/*
 * Creates or updates the consumer (evt_consumer_ensure), then subscribes to
 * its deliver subject with manual acks and no pending limits. cb runs on
 * the subscription's nats.c delivery thread (or the shared pool when
 * global delivery is on), owns the message and acks it. A pull consumer
 * (d->pull; cb and ud NULL) is bound instead, and read with evt_fetch from
 * one thread at a time. Bound either way, never created by nats.c:
 * unsubscribing or destroying *sub_out never deletes the consumer.
 * Returns 0 or KS_ENATS with *errmsg.
 */
int evt_durable_subscribe(struct evt_conn *c, const struct evt_durable *d,
                          natsMsgHandler cb, void *ud,
                          natsSubscription **sub_out, char **errmsg);

/* ---- a consumer's health, and its repairs (events/consumer.c) ------------
 * The JetStream API on the broker's connection (never an agent's).
 */

/* What a consumer's leader says of it (consumer info). */
struct evt_consumer_state {
    int64_t created_ns;      /* when it was made (epoch ns): a new value is
                                a new consumer (remade) */
    uint64_t delivered;      /* deliveries so far, redeliveries included
                                (its consumer sequence) */
    uint64_t delivered_stream_seq; /* stream sequence of the last message
                                      it delivered: it delivers in stream
                                      order, so every message on its
                                      filter at or below it was delivered
                                      (or skipped for good), 0: none */
    int64_t delivered_at_ns; /* the last delivery (epoch ns), 0: none */
    uint64_t ack_floor;      /* consumer sequence of the ack floor */
    uint64_t pending;        /* stored on its filter, not yet delivered */
    int64_t ack_pending;     /* delivered, not acked yet */
    int64_t max_ack_pending; /* its limit (the agent's slots) */
    bool push_bound;         /* someone subscribes to its deliver subject */
    char leader[64];         /* its leader node, "" single server */
};

/*
 * The state of consumer durable on stream, asked within timeout_ms (>= 1).
 * 0 with *out; KS_ENOTFOUND (no such consumer or stream); KS_EUNAVAIL (its
 * raft group has no leader: JetStream error 10008, or no responders);
 * KS_ETIMEDOUT (nobody answered: a leader gone unnoticed yet); KS_ENATS.
 * Any thread.
 */
int evt_consumer_state(struct evt_conn *c, const char *stream,
                       const char *durable, int timeout_ms,
                       struct evt_consumer_state *out);

/*
 * How many messages stream holds on the subjects filter (a subject, with
 * wildcards) matches, asked within timeout_ms (stream info with
 * subjects_filter, nats-server 2.8+). On a work-queue stream, what is
 * stored is what no consumer has acked: a consumer whose pending +
 * ack_pending is below it has skipped messages it will never deliver.
 * 0 with *count_out; KS_ENOTFOUND, KS_EUNAVAIL, KS_ETIMEDOUT, KS_ENATS.
 */
int evt_stream_stored(struct evt_conn *c, const char *stream,
                      const char *filter, int timeout_ms,
                      uint64_t *count_out);

/*
 * Whether stream still holds the message at sequence seq (>= 1), asked
 * within timeout_ms ($JS.API.STREAM.MSG.GET, nats.c js_GetMsg). On a
 * work-queue stream a message is held until a consumer acks it. 0: held;
 * KS_ENOTFOUND: not held (acked, deleted, or no such stream);
 * KS_EUNAVAIL (no leader), KS_ETIMEDOUT, KS_ENATS. Any thread.
 */
int evt_stream_holds(struct evt_conn *c, const char *stream, uint64_t seq,
                     int timeout_ms);

/*
 * Asks the leader of consumer durable to step down
 * ($JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.<durable>, nats-server docs
 * "JetStream wire API"): another member becomes leader with the same
 * replicated state (deliveries, acks, unacked messages). 0 when the leader
 * said success; KS_ENATS with why (why_len bytes, may be NULL: the API's
 * error, e.g. 10008 no leader, or "clustering support required" on a
 * single server); KS_ETIMEDOUT / KS_EUNAVAIL (no leader answered);
 * KS_EDECODE. Any thread; waits in the calling thread.
 */
int evt_consumer_stepdown(struct evt_conn *c, const char *stream,
                          const char *durable, int timeout_ms, char *why,
                          size_t why_len);

/*
 * Deletes consumer d and makes it again as asked (evt_consumer_ensure): its
 * delivery state is gone, unacked messages nobody holds with it. On a
 * work-queue stream (KSCORE_CMDS) the messages stay until acked, and the
 * new consumer delivers every one again (the claim fence keeps one run; an
 * agent holding a message takes the new delivery's ack subject). A
 * consumer already gone is just made. On a cluster a delete is answered
 * before every node lets go of the consumer (and a node that still has
 * it takes the create as an update, keeping its state), so the consumer
 * made is checked against the old one (evt_consumer_state: its creation
 * time, or its sequences and unacked count with no delivery since: so
 * call it for a consumer that delivered nothing for a second or more), and
 * while it is still the old one the delete and the create are tried
 * again, every 250 ms up to 8 times (then KS_EUNAVAIL); one made anew by
 * someone else meanwhile is kept. Blocks up to about 2 s plus its API
 * requests. 0, or KS_ENATS / KS_EUNAVAIL / as evt_err with *errmsg
 * (malloc'd, may be NULL). Any thread.
 */
int evt_consumer_remake(struct evt_conn *c, const struct evt_durable *d,
                        char **errmsg);

/*
 * Deletes the consumer durable of stream (nats.c JetStream API on c: the
 * broker's connection). 0, KS_ENOTFOUND (no such consumer), or KS_ENATS.
 * Any thread.
 */
int evt_consumer_delete(struct evt_conn *c, const char *stream,
                        const char *durable);

/*
 * One pull of at most batch messages (1..EVT_FETCH_MAX) from sub (a pull
 * consumer's evt_durable_subscribe), waiting at most wait_ms (>= 1) for the first: as
 * soon as any are there it returns with everything the consumer had ready
 * then, up to batch. That is nats-server's one-shot request (no_wait with
 * an expiry: "wait for expires but return as soon as we have any
 * messages", server/consumer.go processNextMsgReq, 2.9): it never waits
 * for a full batch, so one message is handed over at once, and a puller
 * that stops asking (stopped, paused, gone) is handed nothing more once its
 * request has been served or has expired. nats.c 3.4.1's
 * natsSubscription_Fetch does wait for a full batch after an empty first
 * try, which would hold a lone message for the whole wait.
 *
 * Returns 0 with out filled (out->Count >= 1; the caller acks and destroys
 * each message, then frees out->Msgs, or natsMsgList_Destroy for both),
 * KS_ETIMEDOUT (nothing came; also at once when other pullers' requests
 * already wait for more than the consumer has: the server's 408 "Requests
 * Pending", so wait a moment before asking again), KS_EUNAVAIL (no
 * connection, or nobody serves the consumer: gone, or its stream), or
 * KS_ENATS. The calling thread; the subscription's messages are not
 * delivered anywhere else.
 */
#define EVT_FETCH_MAX 10000
int evt_fetch(natsSubscription *sub, int batch, int wait_ms,
              natsMsgList *out);

/* ---- agent consumers ------------------------------------------------------ */

/* JetStream gives up on a command message after this many deliveries
 * (broker/advisory.c records it). */
#define EVT_AGENT_MAX_DELIVER 5
/* An agent consumer's ack wait when the agent names none (ms), and the
 * range an agent may choose (AgentInfo.ack_wait_ms). */
#define EVT_AGENT_ACK_WAIT_DEFAULT_MS 30000
#define EVT_AGENT_ACK_WAIT_MIN_MS 100
#define EVT_AGENT_ACK_WAIT_MAX_MS (24 * 3600 * 1000)
/* Largest max_ack_pending an agent's max_concurrent gives its consumer. */
#define EVT_AGENT_MAX_ACK_PENDING 100000

/* ack_wait_ms as an agent consumer will have it: 0 is the default, else
 * clamped to [EVT_AGENT_ACK_WAIT_MIN_MS, EVT_AGENT_ACK_WAIT_MAX_MS]. The
 * agent keeps its messages alive by this value, the broker makes the
 * consumer with it. Pure. */
uint64_t evt_agent_ack_wait_ms(uint64_t ack_wait_ms);

/* The consumer of one agent id, with the storage of its strings. */
struct evt_agent_consumer {
    char durable[8 + EVT_AGENT_ID_MAX];
    char filter[20 + 2 * EVT_AGENT_ID_MAX];
    struct evt_durable d;
};

/*
 * The consumer the broker provisions for agent_id (valid, see
 * evt_agent_id_valid): "agent-<id>" on KSCORE_CMDS, filter exactly
 * "kscore.cmd.<id>", deliver subject "_KSCORE.deliver.agent-<id>", deliver
 * group "agent-<id>" (processes of one id share the messages), explicit
 * ack, max_ack_pending = max_concurrent (clamped to
 * [1, EVT_AGENT_MAX_ACK_PENDING]: a command message stays unacked while it
 * waits for a slot and runs, so this keeps the backlog in JetStream), ack
 * wait evt_agent_ack_wait_ms(ack_wait_ms), max deliver
 * EVT_AGENT_MAX_DELIVER. Pure.
 */
void evt_agent_consumer(struct evt_agent_consumer *out, const char *agent_id,
                        uint32_t max_concurrent, uint64_t ack_wait_ms);

/*
 * The consumer the broker provisions for an agent pool (AgentInfo.pool: a
 * process, or several alike, serving many agent ids; valid as
 * evt_agent_id_valid): "pool-<pool>" on KSCORE_CMDS, filter
 * "kscore.cmd.<pool>.*" (each id's own subject, evt_cmd_subject), deliver
 * subject "_KSCORE.deliver.pool-<pool>", deliver group "pool-<pool>",
 * max_ack_pending = max_concurrent of the process (clamped as above), ack
 * wait and max deliver as evt_agent_consumer. One consumer for the pool
 * instead of one per id: nats-server keeps state, and on a cluster a raft
 * group, per consumer (deploy/SCALING.md has the measured cost). Pure.
 */
void evt_pool_consumer(struct evt_agent_consumer *out, const char *pool,
                       uint32_t max_concurrent, uint64_t ack_wait_ms);

/*
 * Writes the registry entry of one agent (key = info->agent_id) as a plain
 * publish to "$KV.KSCORE_AGENTS.<id>" (the subject nats.c's kvStore_Put
 * uses: nats-server docs, ADR-8 "JetStream based Key-Value Stores") and
 * waits for the bucket stream's PubAck on identity's inbox
 * (evt_js_publish_as; NULL: the connection's). An agent may only publish
 * its own key. 0: JetStream has it. Returns as evt_js_publish_as.
 */
int evt_agent_put(struct evt_conn *c, const char *identity,
                  const Ks__AgentInfo *info, int timeout_ms);
/*
 * Writes an agent pool's registry entry: key "pool.<info->pool>" (a valid
 * token), info->pool_ids the ids the pool serves, info->agent_id empty.
 * The broker takes it as a heartbeat of every id listed (broker/registry.c),
 * so a process serving many ids writes one entry every EVT_HEARTBEAT_MS,
 * not one per id. Returns as evt_agent_put; KS_EINVAL for a bad pool name.
 */
int evt_pool_put(struct evt_conn *c, const char *identity,
                 const Ks__AgentInfo *info, int timeout_ms);
/* The registry key prefix of pool entries ("pool." + pool name): a dot is
 * in no agent id, so the two never meet. */
#define EVT_POOL_KEY_PREFIX "pool."
/* The id a pool's labels attestation is signed over: "pool.<pool>/<size>"
 * (no agent id has a dot or a slash), so the signature also fixes how
 * many ids the pool may have. buf >= sizeof(EVT_POOL_KEY_PREFIX) +
 * EVT_AGENT_ID_MAX + 12. */
void evt_pool_attest_id(char *buf, size_t len, const char *pool,
                        uint32_t size);
/* n when id is "<pool>-<n>" in canonical decimal (no sign, no leading
 * zero) with n < size, else -1. Pure. */
long evt_pool_index(const char *pool, const char *id, uint32_t size);
/* Opens the KSCORE_AGENTS bucket (created by evt_setup; nats.c
 * JetStream API: the broker and clients with its rights, never agents).
 * wait_ms (> 0) bounds each JetStream API request made through *kv_out
 * (a watch's consumer create, a get), through a JetStream context of its
 * own; 0: the connection's (nats.c's default, 5 s). */
int evt_agents_kv(struct evt_conn *c, int wait_ms, kvStore **kv_out);
/*
 * Reads one agent's entry. 0 with *out (ks__agent_info__free_unpacked),
 * KS_ENOTFOUND, KS_ENATS.
 */
int evt_agent_get(kvStore *kv, const char *agent_id, Ks__AgentInfo **out);


/* ---- token files (events/token.c) -------------------------------------- */
#define EVT_TOKEN_MIN 16
#define EVT_TOKEN_MAX 256
/*
 * The token of a token file (a metrics bearer token, the local cluster's
 * route password): its first line, 16..256 of [A-Za-z0-9-._~+/=], into
 * buf (>= EVT_TOKEN_MAX + 1). The file must be a regular file that only
 * its owner may read or write (mode 0600 or less: a secret). 0, -errno
 * (cannot open), KS_EINVAL (not such a file or no token) with *errmsg
 * (malloc'd, may be NULL).
 */
int evt_token_file_read(const char *path, char *buf, size_t len,
                        char **errmsg);
/* A new token file at path (mode 0600, never replacing one): 64 hex
 * digits of 32 random bytes (OpenSSL). 0, -errno (-EEXIST) or
 * KS_EINTERNAL. */
int evt_token_file_make(const char *path);

/* ---- scrape-time gauges (events/jetstream.c) ----------------------------
 * For a ks_metrics_collect_fn of the broker or the agent; the endpoint
 * that serves them is the daemon's (cli/metrics_http.c).
 */
/*
 * Adds whether c is connected now to the collected gauge g
 * (KS_G_NATS_BROKER or KS_G_NATS_AGENT): for a ks_metrics_collect_fn.
 */
void evt_metrics_nats_state(struct evt_conn *c, enum ks_gauge g);
/*
 * Adds the JetStream queue depths (KS_G_QUEUE_*: the recorder consumer's
 * pending + unacked events, the commands stream's messages) as c (the
 * broker's rights) sees them now; nothing when JetStream does not answer
 * within timeout_ms.
 */
void evt_metrics_queue_depths(struct evt_conn *c, int timeout_ms);

/*
 * Forgets an agent (`kscore agent revoke`, events/fleet.c): deletes its
 * registry entry, which makes the broker drop it (commands to it are then
 * refused as for an unknown agent), and deletes its consumer. c needs the
 * broker's rights (JetStream API). Run it after the agent's NATS user is
 * gone, so that it cannot put its entry back. 0, KS_EINVAL, or as evt_err
 * with *errmsg (malloc'd, may be NULL).
 */
int evt_agent_forget(struct evt_conn *c, const char *agent_id, char **errmsg);
/* The same for an agent pool: deletes its registry entry
 * ("pool.<pool>"; the broker drops every id of the pool) and deletes its
 * consumer "pool-<pool>". */
int evt_pool_forget(struct evt_conn *c, const char *pool, char **errmsg);

#endif
