/* Private to broker/. */
#ifndef KSCORE_BROKER_INT_H
#define KSCORE_BROKER_INT_H

#include <pthread.h>
#include <stdbool.h>

#include "agent.h"
#include "broker.h"
#include "store.h"

/* A client waiting for the terminal event of one command. */
struct broker__waiter {
    char *reply_subject;
    char agent_id[EVT_AGENT_ID_MAX + 1];
};

/* What the broker knows of one agent (from KSCORE_AGENTS). */
struct broker__agent {
    Ks__AgentInfo *info;
    int64_t seen_mono_us;
    int64_t stored_mono_us; /* last write of the agents projection */
};

/* Claims and ExecuteCommand are served by this many queue subscriptions
 * each, every one with its own thread and PostgreSQL connection: each is
 * one commit, and a fan-out or a steady rate brings many at once. */
#define BROKER_CLAIM_WORKERS 4
#define BROKER_EXEC_WORKERS 3

struct broker__worker {
    struct broker *b;
    struct store *st;
    natsSubscription *sub;
};

struct broker {
    const struct broker_opts *opts;
    struct evt_conn *nc;
    kvStore *kv;

    struct store *st_setup, *st_misc, *st_rec, *st_reg, *st_scan,
        *st_follow;
    natsSubscription *sub_misc, *sub_events,
        *sub_cancel, *sub_agents, *sub_follow, *sub_rec;
    pthread_mutex_t misc_mu;    /* st_misc: get, events, cancel */

    pthread_mutex_t mu;         /* waiters, agents, recorder queue */
    struct ks_map waiters;      /* command_id -> struct broker__waiter * */
    struct ks_map agents;       /* agent_id -> struct broker__agent * */

    pthread_cond_t rec_cond;    /* recorder queue not empty / stopping */
    natsMsg **rec_q;
    size_t rec_len, rec_cap;

    pthread_t rec_thread, reg_thread, scan_thread;
    bool rec_started, reg_started, scan_started;
    volatile int stopping;

    struct agent *local;
    int64_t started_mono_us;
    int64_t connected_since_mono_us; /* scanner: 0 while NATS is down */
    struct broker__worker claimers[BROKER_CLAIM_WORKERS];
    struct broker__worker executors[BROKER_EXEC_WORKERS];
    struct evt_signer *signer;     /* signs every command dispatched */
    struct broker__policy *policy; /* NULL: no policy file */
    natsSubscription *sub_advisory;
    struct evt_verifier *local_trust; /* in-process agents trust signer */

    struct broker__batches *batches; /* batch.c */
    natsSubscription *sub_batch;
    struct store *st_batch;
};

/* Fills the envelope of a new event: fresh event_id, stream, type, time. */
void broker__event_init(Ks__Event *ev, char event_id[37], char *stream_id,
                        const char *type, const char *command_id);

/* Replies to the client waiting for command_id, if any, with result. */
void broker__reply_waiter(struct broker *b, const char *command_id,
                          const Ks__CommandResult *result, int error_code,
                          const char *error);

/*
 * A terminal event of command_id has been recorded (any thread: recorder,
 * claim handler, scanner, cancel): answers the waiting client and tells the
 * command's batch, if any. result may be NULL (then only its status is
 * known to be terminal).
 */
void broker__command_ended(struct broker *b, const char *command_id,
                           const Ks__CommandResult *result);

/* Fills the two events that start a command: CommandRequested (v1, with
 * cmd) and CommandDispatched (v2, attempt 1, first attempt's deadline).
 * stream and ids are caller storage. */
void broker__start_events(Ks__Event *req_ev, Ks__Event *disp_ev,
                          char ids[2][37], char *stream, Ks__Command *cmd,
                          const char *idempotency_key);

/* 1 if subject is method's, with or without the operator token. */
int broker__is_method(const char *subject, const char *method);
/* The operator a request came from: the subject's last token (events.h
 * "API subjects"); static or the message's storage. */
const char *broker__operator_of(natsMsg *msg);

/* The operator policy (policy.c). NULL policy: everything allowed. */
struct broker__policy;
int broker__policy_load(const char *path, struct broker__policy **out,
                        char **errmsg);
void broker__policy_free(struct broker__policy *p);
/* 0, or KS_EDENIED with one line in why. agent and argv0 NULL: a read. */
int broker__policy_check(const struct broker__policy *p, const char *op,
                         const Ks__AgentInfo *agent, const char *argv0,
                         char *why, size_t len);
/* Records RequestDenied on stream operator-<op>. */
void broker__record_denied(struct broker *b, struct store *st, const char *op,
                           const char *agent_id, const Ks__CommandSpec *spec,
                           const char *why);
/* A copy of the registry's info on agent_id, or NULL (free with
 * ks__agent_info__free_unpacked). Any thread. */
Ks__AgentInfo *broker__agent_info(struct broker *b, const char *agent_id);

/* Checks a command spec; KS_EINVAL with one line in why. */
int broker__validate_spec(const Ks__CommandSpec *spec, char *why,
                          size_t len);

/* Cancels one command: ends it (CommandCancelled at the version read) if
 * no agent claimed it yet, else records CommandCancelRequested and tells
 * its agent. Uses st. 0, KS_ENOTFOUND, KS_EPG. Terminal: 0, nothing. */
int broker__cancel_command(struct broker *b, struct store *st,
                           const char *command_id, const char *operator_name);

/* Batch scheduler (batch.c). */
int broker__batch_start(struct broker *b, char **errmsg);
void broker__batch_stop(struct broker *b);
/* The API handler of kscore.api.v1.batch (its own delivery thread). */
void broker__on_batch(natsConnection *nc, natsSubscription *sub,
                      natsMsg *msg, void *ud);
/* Called by broker__command_ended: 1 if the command belongs to a batch
 * driven here (then the batch thread takes it from here; the driver of
 * any other batch reads the end from the record). */
int broker__batch_target_ended(struct broker *b, const char *command_id,
                               const Ks__CommandResult *result);
/* Cancels an open batch, whatever broker drives it (or none yet): records
 * BatchCancelRequested by operator_name; its driver acts on it. Any
 * thread. 0, KS_ENOTFOUND (no open batch with this id) or KS_EPG. */
int broker__batch_cancel(struct broker *b, const char *batch_id,
                         const char *operator_name);
/* Fills reply with the state of a batch (live, else from its stream). */
int broker__batch_view(struct broker *b, struct store *st,
                       const char *batch_id, Ks__BatchReply **out);

int broker__recorder_start(struct broker *b, char **errmsg);
void broker__recorder_stop(struct broker *b);

/* Records JetStream's max-deliveries advisories (advisory.c). */
int broker__advisory_start(struct broker *b, char **errmsg);

int broker__scanner_start(struct broker *b);
void broker__scanner_stop(struct broker *b);
/* Each attempt's share of a command's delivery window (us). */
int64_t broker__attempt_window_us(const Ks__Command *cmd);

int broker__registry_start(struct broker *b, char **errmsg);
void broker__registry_stop(struct broker *b);
/* Fills an AgentsReply from the registry (sorted by id). Any thread.
 * Free with broker__agents_reply_free(). */
int broker__agents_list(struct broker *b, Ks__AgentsReply *out);
void broker__agents_reply_free(Ks__AgentsReply *r);

/* 1 if the agent id has registered (any time), else 0. Any thread. */
int broker__agent_known(struct broker *b, const char *agent_id);

#endif
