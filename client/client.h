/*
 * client: the brokers' API as a client calls it (kscore's operator
 * commands, perf, the tests).
 *
 * Requests go to kscore.api.v1.<method> (core NATS request/reply, queue
 * group kscore-broker: any broker answers) as protobuf (proto/kscore.proto)
 * through events/; ExecuteCommand's wait survives the death of the broker
 * that holds it (broker_execute_hooks). The label selector rules live here
 * too, so that the brokers and the CLI read a selector the same way.
 *
 * Invariant: this library knows NATS (events/) and protobuf (proto/) only.
 * It never touches PostgreSQL (store/) nor serves HTTP, so the operator's
 * `kscore`, which links it, loads neither libpq nor libmicrohttpd. The
 * broker (broker/) depends on it, never the other way round.
 *
 * The names keep the broker_ prefix: they are the broker's API, seen from
 * the other end of the request (broker_call, broker_execute, ...).
 *
 * Threads: every call blocks the calling thread; no callback runs on
 * another thread (broker_exec_hooks run on the caller's thread).
 */
#ifndef KSCORE_CLIENT_H
#define KSCORE_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "events.h"
#include "kproto.h"

/* Default delivery deadline: Dispatched and not claimed by then (ms). */
#define BROKER_DELIVER_WITHIN_DEFAULT_MS 30000
/* Attempts before a command ends Undeliverable. */
#define BROKER_MAX_ATTEMPTS 3
/* How long a broker starting on a JetStream cluster waits for the leaders
 * of the streams and the recorder's consumer before it gives up (ms):
 * `kscore up --cluster` waits longer for the brokers to answer. */
#define BROKER_JS_WAIT_MS 120000

/*
 * Label selectors (kscore batch --select, kscore agents --select;
 * client/select.c). A term is "KEY=VALUES" (the agent has label KEY and
 * its value matches one of VALUES) or "KEY!=VALUES" (it has no label KEY,
 * or its value matches none of them); VALUES is one or more fnmatch(3)
 * globs separated by '|' ("role=web|db", "zone=eu-*"). An agent matches a
 * selector when it matches every term. A KEY "fact.K" is the agent's fact
 * K (AgentInfo.facts: its own word about its host, "fact.os=debian*"),
 * never a label; no label may be named so (BROKER_FACT_PREFIX). The
 * broker resolves batches with these functions; the CLI uses the same
 * ones.
 *
 * broker_select_check: 0 when term is well formed, else KS_EINVAL with
 * why (len bytes): no '=', an empty key, a value that starts with '='
 * ("env==prod": the message suggests "env=prod"), a bare "fact.".
 * broker_select_match: 1 when info matches all n terms (n == 0: every
 * agent), else 0; a malformed term matches nothing.
 */
#define BROKER_FACT_PREFIX "fact."

/*
 * A label as `kscore agent enroll --label` and `kscore agent label` take
 * it: KEY of 1 to BROKER_LABEL_KEY_MAX letters, digits, '_', '.', '-',
 * '/', not starting with "fact."; VALUE (may be NULL: not checked) of at
 * most BROKER_LABEL_VALUE_MAX bytes, no control character, no ','. 0, or
 * KS_EINVAL with why (len bytes) naming the label.
 */
#define BROKER_LABEL_KEY_MAX 63
#define BROKER_LABEL_VALUE_MAX 255
int broker_label_check(const char *key, const char *value, char *why,
                       size_t len);
int broker_select_check(const char *term, char *why, size_t len);
int broker_select_match(const Ks__AgentInfo *info, char *const *terms,
                        size_t n);

/*
 * Sends req on subject and unpacks the reply as reply_desc, waiting up to
 * timeout_ms. On 0, *out (protobuf_c_message_free_unpacked) is the reply;
 * its error_code/error fields carry the broker's refusal, if any. A
 * request nobody served (no responders) is sent again every
 * BROKER_CALL_PAUSE_MS for up to BROKER_CALL_UNAVAIL_MS (within
 * timeout_ms): a cluster node that has just started has no routes yet.
 * Returns KS_ETIMEDOUT, KS_EUNAVAIL (no broker serves the subject),
 * KS_EDECODE, KS_ENATS.
 */
#define BROKER_CALL_UNAVAIL_MS 3000
#define BROKER_CALL_PAUSE_MS 100
int broker_call(struct evt_conn *c, const char *subject,
                const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *reply_desc, int timeout_ms,
                ProtobufCMessage **out);

/*
 * ExecuteCommand: waits for the terminal result. timeout_ms should cover
 * the command's timeout + grace + delivery deadline; see
 * broker_execute_wait_ms().
 *
 * The reply says truthfully whether the command is recorded (issue 25):
 * error_code KS_EINDOUBT means the outcome is unknown (the broker lost the
 * answer to the record's commit, an earlier ask with the same idempotency
 * key may have recorded it, or the command is recorded and no broker
 * answers for its end); command_id then names it when known ("" when only
 * the key does: asking again with the same key is safe). KS_EBUSY: the
 * broker refused it because it could not start within its delivery
 * deadline (the error names the limit and the figure); not recorded,
 * asking again later is safe. Any other error_code: not recorded. A refusal of a later ask (asked again after
 * silence) once the command's id came back is not the command's: it is
 * not returned, the wait goes on.
 */
int broker_execute(struct evt_conn *c, const Ks__ExecuteRequest *req,
                   int timeout_ms, Ks__ExecuteReply **out);

/*
 * BatchExecuteCommand: waits for the end of the batch (or, with detach, its
 * acceptance). Progress goes to req->progress_subject if set.
 */
int broker_batch(struct evt_conn *c, const Ks__BatchRequest *req,
                 int timeout_ms, Ks__BatchReply **out);

/*
 * Waits (<= timeout_ms) until a broker serves the API at url: it answers a
 * get of an unknown id. opts: credentials (copied). 0 or KS_ETIMEDOUT.
 */
int broker_wait_ready(const char *url, const struct evt_connect_opts *opts,
                      int timeout_ms);

/*
 * Waits (<= timeout_ms) until agent_id has heartbeated at or after since_us
 * (epoch us) in KSCORE_AGENTS. opts must be allowed to read the bucket.
 * 0, KS_ETIMEDOUT, or KS_EUNAVAIL (NATS unreachable).
 */
int broker_wait_agent(const char *url, const struct evt_connect_opts *opts,
                      const char *agent_id, int64_t since_us, int timeout_ms);

/*
 * broker_execute with live output and a say while it waits: live (may be
 * NULL) gets each reply that carries no result (the command's id, then
 * pieces of its output as they are recorded: ExecuteReply.chunks; set
 * req->live_output); tick (may be NULL) runs at least every 100 ms and a
 * non-zero return ends the wait with that code. silence (may be NULL)
 * says when no broker answers: silent true once when it starts (at the
 * first "no responders", at once, or after 2 x BROKER_EXEC_REASK_MS
 * without any answer to an ask), with give_up_ms, how much longer the
 * wait lasts without an answer, and command_id the command's id when it
 * is recorded (else NULL); silent false when a broker answers again.
 */
struct broker_exec_hooks {
    void (*live)(const Ks__ExecuteReply *rep, void *ud);
    int (*tick)(void *ud);
    void *ud;
    void (*silence)(bool silent, int give_up_ms, const char *command_id,
                    void *ud);
};
/* Silence after which a waiting exec asks again, and after which it gives
 * up when no broker answers at all (ms). */
#define BROKER_EXEC_REASK_MS 5000
#define BROKER_EXEC_GIVE_UP_MS 20000
int broker_execute_hooks(struct evt_conn *c, const Ks__ExecuteRequest *req,
                         int timeout_ms, const struct broker_exec_hooks *h,
                         Ks__ExecuteReply **out);

/* How long a client should wait for an ExecuteCommand reply (ms). */
int broker_execute_wait_ms(const Ks__ExecuteRequest *req);

/* true for "USER" or "USER:GROUP" of names useradd(8) takes (letters,
 * digits, _, . and -, not - first, 1-32 bytes each): the form of
 * CommandSpec.run_as and CopySpec.owner, read the same way by the CLI and
 * the brokers (client/select.c). Any thread. */
bool broker_user_spec_ok(const char *s);

/* true for the name of a variable a command may be given (--env,
 * --secret-env; CommandSpec.env and sealed_env): a POSIX name (letters,
 * digits, _; not a digit first) of 1-256 bytes, not KSCORE_* (kscore's
 * own: KSCORE_COMMAND_ID is how a command knows itself). The CLI and the
 * brokers read it the same way (client/select.c). Any thread. */
bool broker_env_name_ok(const char *name);

#endif
