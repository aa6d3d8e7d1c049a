/*
 * The agent runtime: consume, check, claim, ack, run, report, heartbeat.
 *
 * Threads:
 *  - nats.c delivery thread(s): on_command (check, precheck, claim, ack,
 *    submit) and on_cancel;
 *  - the executor loop thread: job_done (packs the result event, queues it);
 *  - the publisher thread: publishes queued events until each has a PubAck;
 *  - the heartbeat thread: KSCORE_AGENTS entries every EVT_HEARTBEAT_MS.
 *
 * Results are never lost: each result event is written to
 * <state_dir>/outbox/<event_id> before it is queued and removed after its
 * PubAck; a restarted agent publishes what it finds there first. The
 * Nats-Msg-Id is the event_id, and the recorder appends by unique event_id,
 * so a result published twice is recorded once.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

#define CLAIM_TIMEOUT_MS 1000 /* a claim is one commit: ~1 ms */
/* How long a claim is retried while no broker answers (ms). */
#define CLAIM_RETRY_MS 20000
#define PUBLISH_TIMEOUT_MS 2000
#define AGENT_VERSION "0.1.0"

struct agent_slot {
    struct agent *agent;
    char *id;
    natsSubscription *sub, *cancel_sub;
};

struct outbox_item {
    struct outbox_item *next;
    char event_id[37];
    uint8_t *buf;
    size_t len;
    char subject[16 + EVT_AGENT_ID_MAX + 40];
};

struct job_ctx {
    char operator_name[64];
    struct agent *agent;
    uint64_t job_id;
    struct agent_slot *slot;
    char command_id[37];
    uint32_t attempt;
};

struct agent {
    struct agent_opts opts;
    char *state_dir;
    char host[64];
    unsigned max_concurrent;
    struct evt_conn *nc;
    kvStore *kv;
    struct exec_loop *loop;
    struct agent_slot *slots;
    size_t n_slots;

    pthread_mutex_t mu;
    struct ks_map running;     /* command_id -> struct job_ctx * */
    struct ks_map seen;        /* claimed command ids (replay guard) */
    char (*seen_ring)[37];
    size_t seen_next;
    const struct evt_verifier *trust;
    struct evt_verifier *own_trust; /* from opts->trust_keys */
    pthread_cond_t out_cond;
    struct outbox_item *out_head, **out_tail;
    size_t in_flight;          /* submitted, result not yet queued */
    pthread_cond_t idle_cond;

    pthread_t pub_thread, hb_thread;
    bool pub_started, hb_started;
    volatile int stopping;
};

unsigned
agent_default_max_concurrent(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return (unsigned)(n > 0 ? n : 1) * 4;
}

/* ---- seen commands (replay guard) ------------------------------------------ */

/*
 * Command ids this process has claimed, newest SEEN_MAX kept (a ring plus a
 * map). The claim fence in PostgreSQL is the real guarantee; this refuses a
 * replayed message before it costs a claim, and names it a replay.
 */
#define SEEN_MAX 4096

static bool
seen_check(struct agent *a, const char *command_id)
{
    bool seen;
    pthread_mutex_lock(&a->mu);
    seen = ks_map_get(&a->seen, command_id) != NULL;
    pthread_mutex_unlock(&a->mu);
    return seen;
}

static void
seen_add(struct agent *a, const char *command_id)
{
    pthread_mutex_lock(&a->mu);
    char *slot = a->seen_ring[a->seen_next];
    if (slot[0])
        ks_map_del(&a->seen, slot);
    memcpy(slot, command_id, 37);
    ks_map_put(&a->seen, slot, (void *)1);
    a->seen_next = (a->seen_next + 1) % SEEN_MAX;
    pthread_mutex_unlock(&a->mu);
}

/* ---- running markers (K25) ------------------------------------------------ */

/*
 * <state_dir>/running/<command_id>: written when a claim is granted, removed
 * once the result is queued. A restarted agent finds what it left running
 * when it died: the executor has killed those process groups already
 * (exec_global_init() kills the cgroups of dead agents), so each one is
 * reported CommandLost, and none is ever run again (the claim fence).
 */
static void
marker_path(struct agent *a, const char *command_id, char *buf, size_t len)
{
    snprintf(buf, len, "%s/running/%s", a->state_dir, command_id);
}

static void
marker_write(struct agent *a, const char *command_id, const char *agent_id,
             uint32_t attempt, const char *operator_name)
{
    char path[4200];
    FILE *f;
    if (!a->state_dir)
        return;
    marker_path(a, command_id, path, sizeof(path));
    f = fopen(path, "we");
    if (f) {
        fprintf(f, "%s %u %s\n", agent_id, attempt,
                operator_name && operator_name[0] ? operator_name : "-");
        fclose(f);
    }
}

static void
marker_remove(struct agent *a, const char *command_id)
{
    char path[4200];
    if (!a->state_dir)
        return;
    marker_path(a, command_id, path, sizeof(path));
    unlink(path);
}

static int queue_event(struct agent *a, const Ks__Event *ev);

/* Reports what a previous run of this agent left running as Lost. */
static void
markers_recover(struct agent *a)
{
    char dir[4200];
    DIR *d;
    struct dirent *de;
    snprintf(dir, sizeof(dir), "%s/running", a->state_dir);
    d = opendir(dir);
    if (!d)
        return;
    while ((de = readdir(d))) {
        char path[4500], agent_id[EVT_AGENT_ID_MAX + 1], op[64];
        unsigned attempt = 0;
        if (!ks_is_uuid(de->d_name))
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        int n = fscanf(f, "%128s %u %63s", agent_id, &attempt, op);
        fclose(f);
        if (n == 3) {
            Ks__Event ev = KS__EVENT__INIT;
            Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
            char event_id[37], stream[64], command_id[37];
            memcpy(command_id, de->d_name, 36);
            command_id[36] = '\0';
            ks_uuid(event_id);
            snprintf(stream, sizeof(stream), "command-%s", command_id);
            r.status = KS__COMMAND_STATUS__LOST;
            r.term_sent_us = r.kill_sent_us = -1;
            r.reason = "the agent died while it ran; the restarted agent "
                       "sent its leftover processes SIGKILL (cgroup.kill)";
            ev.event_id = event_id;
            ev.stream_id = stream;
            ev.type = "CommandLost";
            ev.occurred_at_us = ks_now_us();
            ev.command_id = command_id;
            ev.agent_id = agent_id;
            ev.attempt = attempt;
            ev.operator_ = strcmp(op, "-") ? op : "";
            ev.reason = r.reason;
            ev.result = &r;
            queue_event(a, &ev);
        }
        unlink(path);
    }
    closedir(d);
}

/* ---- outbox --------------------------------------------------------------- */

static void
outbox_path(struct agent *a, const char *event_id, char *buf, size_t len)
{
    snprintf(buf, len, "%s/outbox/%s", a->state_dir, event_id);
}

static void
outbox_push(struct agent *a, struct outbox_item *it)
{
    pthread_mutex_lock(&a->mu);
    it->next = NULL;
    *a->out_tail = it;
    a->out_tail = &it->next;
    pthread_cond_signal(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
}

/* Packs ev, saves it under the state dir (if any), queues it. */
static int
queue_event(struct agent *a, const Ks__Event *ev)
{
    struct outbox_item *it = calloc(1, sizeof(*it));
    int rc;

    if (!it)
        return -ENOMEM;
    rc = kproto_pack(&ev->base, &it->buf, &it->len);
    if (rc) {
        free(it);
        return rc;
    }
    snprintf(it->event_id, sizeof(it->event_id), "%s", ev->event_id);
    evt_event_subject(it->subject, sizeof(it->subject), ev->agent_id,
                      ev->command_id);
    if (a->state_dir) {
        char path[4096], tmp[4200];
        int fd;
        outbox_path(a, it->event_id, path, sizeof(path));
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd >= 0) {
            ssize_t w = write(fd, it->buf, it->len);
            /* No fsync: the file outlives a crash of the agent process
             * (the page cache is the kernel's), which is what it is for;
             * a crash of the whole machine also loses JetStream's unsynced
             * data, and the command then ends Lost. An fdatasync here cost
             * 1-3 ms on every command. */
            if (w == (ssize_t)it->len) {
                close(fd);
                rename(tmp, path);
            } else {
                close(fd);
                unlink(tmp);
            }
        }
    }
    outbox_push(a, it);
    return 0;
}

static void
outbox_load(struct agent *a)
{
    char dir[4096];
    DIR *d;
    struct dirent *de;

    snprintf(dir, sizeof(dir), "%s/outbox", a->state_dir);
    d = opendir(dir);
    if (!d)
        return;
    while ((de = readdir(d))) {
        char path[4400];
        struct stat st;
        if (!ks_is_uuid(de->d_name))
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        if (fstat(fd, &st) == 0 && st.st_size > 0 &&
            st.st_size <= KS_MAX_MESSAGE_BYTES) {
            struct outbox_item *it = calloc(1, sizeof(*it));
            Ks__Event *ev = NULL;
            if (it && (it->buf = malloc((size_t)st.st_size)) &&
                read(fd, it->buf, (size_t)st.st_size) == st.st_size &&
                (ev = ks__event__unpack(NULL, (size_t)st.st_size, it->buf))) {
                it->len = (size_t)st.st_size;
                memcpy(it->event_id, de->d_name, 36);
                it->event_id[36] = '\0';
                evt_event_subject(it->subject, sizeof(it->subject),
                                  ev->agent_id, ev->command_id);
                ks__event__free_unpacked(ev, NULL);
                outbox_push(a, it);
                it = NULL;
            }
            if (it) {
                free(it->buf);
                free(it);
            }
        }
        close(fd);
    }
    closedir(d);
}

static void *
publisher_main(void *arg)
{
    struct agent *a = arg;
    int backoff_ms = 50;

    for (;;) {
        struct outbox_item *it;
        pthread_mutex_lock(&a->mu);
        while (!a->out_head && !(a->stopping && a->in_flight == 0))
            pthread_cond_wait(&a->out_cond, &a->mu);
        it = a->out_head;
        if (!it) {
            pthread_mutex_unlock(&a->mu);
            break;
        }
        pthread_mutex_unlock(&a->mu);

        jsPubOptions po;
        jsPubAck *pa = NULL;
        jsErrCode jerr = 0;
        jsPubOptions_Init(&po);
        po.MsgId = it->event_id;
        po.MaxWait = PUBLISH_TIMEOUT_MS;
        natsStatus s = js_Publish(&pa, a->nc->js, it->subject, it->buf,
                                  (int)it->len, &po, &jerr);
        jsPubAck_Destroy(pa);
        if (s != NATS_OK) {
            /* NATS down or restarting: keep it and try again. At stop we
             * give up after the current try; the file stays in the outbox
             * for the next start. */
            if (a->stopping && a->state_dir) {
                pthread_mutex_lock(&a->mu);
                a->out_head = it->next;
                if (!a->out_head)
                    a->out_tail = &a->out_head;
                pthread_mutex_unlock(&a->mu);
                free(it->buf);
                free(it);
                continue;
            }
            nanosleep(&(struct timespec){0, backoff_ms * 1000000L}, NULL);
            if (backoff_ms < 1000)
                backoff_ms *= 2;
            continue;
        }
        backoff_ms = 50;
        if (a->state_dir) {
            char path[4096];
            outbox_path(a, it->event_id, path, sizeof(path));
            unlink(path);
        }
        pthread_mutex_lock(&a->mu);
        a->out_head = it->next;
        if (!a->out_head)
            a->out_tail = &a->out_head;
        pthread_mutex_unlock(&a->mu);
        free(it->buf);
        free(it);
    }
    return NULL;
}

/* ---- results --------------------------------------------------------------- */

static void
fill_result(Ks__CommandResult *r, Ks__Output *o, Ks__Output *e,
            const struct exec_result *x)
{
    ks__command_result__init(r);
    ks__output__init(o);
    ks__output__init(e);
    o->data.data = (uint8_t *)x->out.data;
    o->data.len = x->out.len;
    o->total_bytes = x->out.total;
    o->truncated = x->out.truncated;
    e->data.data = (uint8_t *)x->err.data;
    e->data.len = x->err.len;
    e->total_bytes = x->err.total;
    e->truncated = x->err.truncated;
    r->stdout = o;
    r->stderr = e;
    r->started_at_us = x->started_at_us;
    r->finished_at_us = x->finished_at_us;
    r->duration_us = x->duration_us;
    r->term_sent_us = x->term_sent_us;
    r->kill_sent_us = x->kill_sent_us;
    r->utime_us = x->utime_us;
    r->stime_us = x->stime_us;
    r->maxrss_kb = x->maxrss_kb;
    r->signalled = x->signalled;
    r->survivors = x->survivors;
    r->pid = x->pid;
    r->timed_out = x->timed_out;
    r->cancelled = x->cancelled;
    switch (x->outcome) {
    case EXEC_EXITED:
        r->has_exit_code = 1;
        r->exit_code = x->exit_code;
        r->status = x->exit_code == 0 ? KS__COMMAND_STATUS__SUCCEEDED
                                      : KS__COMMAND_STATUS__FAILED;
        break;
    case EXEC_SIGNALED:
        r->signal = x->signal;
        r->core_dumped = x->core_dumped;
        r->status = KS__COMMAND_STATUS__FAILED;
        break;
    case EXEC_START_FAILED:
        r->status = KS__COMMAND_STATUS__START_FAILED;
        r->start_stage = (char *)(x->start_stage ? x->start_stage : "");
        r->start_errno = x->start_errno;
        break;
    }
    /* The kill protocol's reason wins over how the child ended. */
    if (x->outcome != EXEC_START_FAILED) {
        if (x->cancelled)
            r->status = KS__COMMAND_STATUS__CANCELLED;
        else if (x->timed_out)
            r->status = KS__COMMAND_STATUS__TIMED_OUT;
    }
}

static void
job_done(uint64_t job_id, struct exec_result *x, void *ud)
{
    struct job_ctx *j = ud;
    struct agent *a = j->agent;
    Ks__CommandResult r;
    Ks__Output o, e;
    Ks__Event ev = KS__EVENT__INIT;
    char event_id[37], stream[64];

    (void)job_id;
    fill_result(&r, &o, &e, x);
    ks_uuid(event_id);
    snprintf(stream, sizeof(stream), "command-%s", j->command_id);
    ev.event_id = event_id;
    ev.stream_id = stream;
    ev.type = x->outcome == EXEC_START_FAILED ? "CommandStartFailed"
                                              : "CommandCompleted";
    ev.occurred_at_us = ks_now_us();
    ev.command_id = j->command_id;
    ev.agent_id = j->slot->id;
    ev.attempt = j->attempt;
    ev.operator_ = j->operator_name;
    ev.result = &r;
    if (queue_event(a, &ev) != 0)
        fprintf(stderr, "kscore agent: cannot queue result of %s\n",
                j->command_id);
    else
        marker_remove(a, j->command_id);
    exec_result_release(x);
    pthread_mutex_lock(&a->mu);
    ks_map_del(&a->running, j->command_id);
    a->in_flight--;
    pthread_cond_broadcast(&a->idle_cond);
    pthread_cond_signal(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
    free(j);
}

/* ---- commands -------------------------------------------------------------- */

static void
reject(struct agent_slot *slot, const char *command_id, uint32_t attempt,
       const char *reason)
{
    Ks__Event ev = KS__EVENT__INIT;
    char event_id[37], stream[64];
    ks_uuid(event_id);
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    ev.event_id = event_id;
    ev.stream_id = stream;
    ev.type = "CommandRejected";
    ev.occurred_at_us = ks_now_us();
    ev.command_id = (char *)command_id;
    ev.agent_id = slot->id;
    ev.attempt = attempt;
    ev.reason = (char *)reason;
    queue_event(slot->agent, &ev);
}

/* Claims the command through the broker. 1 granted, 0 lost, <0 error. */
static int
claim(struct agent *a, struct agent_slot *slot, const Ks__Command *cmd,
      Ks__CommandResult *start_failure)
{
    Ks__ClaimRequest req = KS__CLAIM_REQUEST__INIT;
    Ks__ClaimReply *rep = NULL;
    ProtobufCMessage *pm = NULL;
    natsMsg *m = NULL;
    char event_id[37];
    int rc = 0;

    /* The broker takes the claimer from the subject (and replies to its
     * inbox): agent-<id>, which the NATS permissions grant this id's user
     * (deploy/nats-auth.conf.in). One process may serve several ids. */
    char claimer[EVT_AGENT_ID_MAX + 8];
    snprintf(claimer, sizeof(claimer), "agent-%s", slot->id);
    ks_uuid(event_id);
    req.command_id = cmd->command_id;
    req.attempt = cmd->attempt;
    req.agent_id = slot->id;
    req.event_id = event_id;
    req.expected_version = cmd->dispatch_version;
    req.start_failure = start_failure;
    req.operator_ = cmd->operator_;
    /* Retried with the same event_id: a claim whose reply was lost is
     * recognised by the broker as ours (KS_EDUPLICATE -> granted). A broker
     * restarting answers "no responders" at once: wait for it rather than
     * leave the message unacked for a whole ack wait. */
    int64_t give_up = ks_mono_us() + (int64_t)CLAIM_RETRY_MS * 1000;
    int pause_ms = 50;
    for (;;) {
        rc = evt_request_as(a->nc, claimer, EVT_API_CLAIM, &req.base,
                            CLAIM_TIMEOUT_MS, &m);
        if (rc == 0 || a->stopping || ks_mono_us() >= give_up)
            break;
        nanosleep(&(struct timespec){0, pause_ms * 1000000L}, NULL);
        if (pause_ms < 500)
            pause_ms *= 2;
    }
    if (rc)
        return rc;
    rc = evt_unpack(&ks__claim_reply__descriptor, natsMsg_GetData(m),
                    (size_t)natsMsg_GetDataLength(m), &pm);
    natsMsg_Destroy(m);
    if (rc)
        return rc;
    rep = (Ks__ClaimReply *)pm;
    rc = rep->granted ? 1 : (rep->error_code == KS_ECLAIMED ? 0
                                                            : rep->error_code);
    ks__claim_reply__free_unpacked(rep, NULL);
    return rc;
}

static void
on_command(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct agent_slot *slot = ud;
    struct agent *a = slot->agent;
    Ks__Command *cmd = NULL;
    const char *reason = NULL;
    char cmd_id[37];
    const char **argv = NULL;
    struct exec_env *env = NULL;
    struct exec_spec spec = {0};
    const char *stage = NULL;
    int rc;

    (void)nc;
    (void)sub;
    rc = agent_decode_command(a->trust, slot->id, ks_now_us(),
                              natsMsg_GetData(msg),
                              (size_t)natsMsg_GetDataLength(msg), &cmd,
                              &reason, cmd_id);
    if (rc) {
        /* Never run; said so in the record when there is a command id. */
        if (cmd_id[0])
            reject(slot, cmd_id, 0,
                   rc == KS_EREJECTED ? reason : "undecodable command");
        natsMsg_Term(msg, NULL);
        goto out;
    }
    if (seen_check(a, cmd->command_id)) {
        reject(slot, cmd->command_id, cmd->attempt,
               "replay: this agent has already claimed this command");
        natsMsg_Term(msg, NULL);
        goto out;
    }
    argv = calloc(cmd->spec->n_argv + 1, sizeof(*argv));
    env = calloc(cmd->spec->n_env + 2, sizeof(*env));
    if (!argv || !env)
        goto out; /* not acked: redelivered */
    for (size_t i = 0; i < cmd->spec->n_argv; i++)
        argv[i] = cmd->spec->argv[i];
    /* KSCORE_AGENT_ID first, so the command's own env may override it. */
    env[0].name = "KSCORE_AGENT_ID";
    env[0].value = slot->id;
    for (size_t i = 0; i < cmd->spec->n_env; i++) {
        env[i + 1].name = cmd->spec->env[i]->name;
        env[i + 1].value = cmd->spec->env[i]->value;
    }
    spec.argv = argv;
    spec.env = env;
    spec.env_len = cmd->spec->n_env + 1;
    spec.cwd = cmd->spec->cwd;
    spec.command_id = cmd->command_id;
    spec.timeout_ms = cmd->spec->timeout_ms;
    spec.grace_ms = cmd->spec->grace_ms;
    /* Both streams together must fit in one NATS message. */
    spec.stdout_cap_bytes = cmd->spec->stdout_cap_bytes
                                ? cmd->spec->stdout_cap_bytes
                                : EXEC_OUTPUT_CAP_MAX;
    spec.stderr_cap_bytes = cmd->spec->stderr_cap_bytes
                                ? cmd->spec->stderr_cap_bytes
                                : EXEC_OUTPUT_CAP_MAX;

    rc = exec_precheck(&spec, &stage);
    if (rc) {
        Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
        r.status = KS__COMMAND_STATUS__START_FAILED;
        r.start_stage = (char *)stage;
        r.start_errno = -rc;
        r.started_at_us = r.finished_at_us = ks_now_us();
        r.term_sent_us = r.kill_sent_us = -1;
        rc = claim(a, slot, cmd, &r);
        if (rc >= 0)
            natsMsg_Ack(msg, NULL);
        goto out;
    }
    rc = claim(a, slot, cmd, NULL);
    if (rc < 0) {
        /* No broker: hand it back for a redelivery in a second. */
        natsMsg_NakWithDelay(msg, 1000, NULL);
        goto out;
    }
    natsMsg_Ack(msg, NULL);
    if (rc == 0)
        goto out; /* lost the claim: someone else runs it, or it ended */
    seen_add(a, cmd->command_id);
    marker_write(a, cmd->command_id, slot->id, cmd->attempt, cmd->operator_);

    struct job_ctx *j = calloc(1, sizeof(*j));
    uint64_t job_id = 0;
    if (!j)
        goto out;
    j->agent = a;
    j->slot = slot;
    j->attempt = cmd->attempt;
    snprintf(j->command_id, sizeof(j->command_id), "%s", cmd->command_id);
    snprintf(j->operator_name, sizeof(j->operator_name), "%s",
             cmd->operator_);
    /* Held across the submit, so job_done (which takes mu) cannot free j
     * before it is in the map with its job id. */
    pthread_mutex_lock(&a->mu);
    a->in_flight++;
    rc = exec_submit(a->loop, &spec, job_done, j, &job_id);
    if (rc == 0) {
        j->job_id = job_id;
        ks_map_put(&a->running, j->command_id, j);
    }
    pthread_mutex_unlock(&a->mu);
    if (rc) {
        /* Claimed but not started: report it, so it still ends. */
        struct exec_result x = {0};
        x.outcome = EXEC_START_FAILED;
        x.start_stage = "spawn";
        x.start_errno = -rc;
        x.term_sent_us = x.kill_sent_us = -1;
        job_done(0, &x, j);
    }
out:
    free(argv);
    free(env);
    if (cmd)
        ks__command__free_unpacked(cmd, NULL);
    natsMsg_Destroy(msg);
}

static void
on_cancel(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct agent_slot *slot = ud;
    struct agent *a = slot->agent;
    ProtobufCMessage *pm = NULL;
    struct job_ctx *job;
    uint64_t job_id = 0;

    (void)nc;
    (void)sub;
    if (evt_unpack(&ks__cancel_command__descriptor, natsMsg_GetData(msg),
                   (size_t)natsMsg_GetDataLength(msg), &pm) == 0) {
        Ks__CancelCommand *cc = (Ks__CancelCommand *)pm;
        pthread_mutex_lock(&a->mu);
        job = ks_map_get(&a->running, cc->command_id);
        if (job)
            job_id = job->job_id;
        pthread_mutex_unlock(&a->mu);
        if (job_id)
            exec_cancel(a->loop, job_id);
        ks__cancel_command__free_unpacked(cc, NULL);
    }
    natsMsg_Destroy(msg);
}

/* ---- heartbeat --------------------------------------------------------------- */

static void
heartbeat_once(struct agent *a)
{
    Ks__AgentInfo info = KS__AGENT_INFO__INIT;
    Ks__EnvVar *lv = calloc(a->opts.n_labels + 1, sizeof(*lv));
    Ks__EnvVar **lp = calloc(a->opts.n_labels + 1, sizeof(*lp));

    if (!lv || !lp)
        goto out;
    for (size_t i = 0; i < a->opts.n_labels; i++) {
        ks__env_var__init(&lv[i]);
        lv[i].name = (char *)a->opts.labels[i].key;
        lv[i].value = (char *)a->opts.labels[i].value;
        lp[i] = &lv[i];
    }
    info.labels = lp;
    info.n_labels = a->opts.n_labels;
    info.version = AGENT_VERSION;
    info.host = a->host;
    info.running = exec_loop_running(a->loop);
    info.max_concurrent = a->max_concurrent;
    info.heartbeat_at_us = ks_now_us();
    info.pid = (int32_t)getpid();
    for (size_t i = 0; i < a->n_slots; i++) {
        info.agent_id = a->slots[i].id;
        evt_agent_put(a->nc, a->kv, &info);
    }
out:
    free(lv);
    free(lp);
}

static void *
heartbeat_main(void *arg)
{
    struct agent *a = arg;
    while (!a->stopping) {
        heartbeat_once(a);
        for (int i = 0; i < EVT_HEARTBEAT_MS / 50 && !a->stopping; i++)
            nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    }
    return NULL;
}

/* ---- start / stop ------------------------------------------------------------ */

int
agent_start(const struct agent_opts *opts, struct agent **out, char **errmsg)
{
    struct agent *a = NULL;
    struct evt_connect_opts co = opts->nats;
    int rc = 0;

    for (size_t i = 0; i < opts->n_ids; i++)
        if (!evt_agent_id_valid(opts->ids[i])) {
            if (errmsg && asprintf(errmsg,
                                   "bad agent id '%s' (1-%d of letters, "
                                   "digits, _ and -)",
                                   opts->ids[i] ? opts->ids[i] : "",
                                   EVT_AGENT_ID_MAX) < 0)
                *errmsg = NULL;
            return KS_EINVAL;
        }
    if (opts->n_ids == 0)
        return KS_EINVAL;
    a = calloc(1, sizeof(*a));
    if (!a)
        return -ENOMEM;
    a->opts = *opts;
    a->running = (struct ks_map)KS_MAP_INIT;
    a->seen = (struct ks_map)KS_MAP_INIT;
    a->out_tail = &a->out_head;
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->out_cond, NULL);
    pthread_cond_init(&a->idle_cond, NULL);
    gethostname(a->host, sizeof(a->host));
    a->host[sizeof(a->host) - 1] = '\0';
    a->max_concurrent = opts->max_concurrent ? opts->max_concurrent
                                             : agent_default_max_concurrent();
    if (opts->state_dir) {
        char dir[4096];
        a->state_dir = strdup(opts->state_dir);
        snprintf(dir, sizeof(dir), "%s/outbox", opts->state_dir);
        mkdir(opts->state_dir, 0700);
        mkdir(dir, 0700);
        snprintf(dir, sizeof(dir), "%s/running", opts->state_dir);
        mkdir(dir, 0700);
    }
    a->seen_ring = calloc(SEEN_MAX, sizeof(*a->seen_ring));
    if (!a->seen_ring) {
        rc = -ENOMEM;
        goto fail;
    }
    a->trust = opts->trust;
    if (opts->n_trust_keys) {
        rc = evt_verifier_new(&a->own_trust);
        for (size_t i = 0; rc == 0 && i < opts->n_trust_keys; i++) {
            rc = evt_verifier_add_file(a->own_trust, opts->trust_keys[i]);
            if (rc && errmsg &&
                asprintf(errmsg, "trusted key %s: %s", opts->trust_keys[i],
                         rc == KS_EINVAL ? "not an Ed25519 key (PEM)"
                                         : ks_strerror(rc)) < 0)
                *errmsg = NULL;
        }
        if (rc)
            goto fail;
        if (!a->trust)
            a->trust = a->own_trust;
    }
    if (!a->trust || evt_verifier_count(a->trust) == 0) {
        rc = KS_EINVAL;
        if (errmsg && asprintf(errmsg, "no trusted key: give --trust-key FILE "
                                       "(the broker's public key)") < 0)
            *errmsg = NULL;
        goto fail;
    }
    exec_global_init();
    rc = exec_loop_new(a->max_concurrent, &a->loop);
    if (rc)
        goto fail;
    co.name = "kscore-agent";
    co.send_asap = true;
    co.retry_forever = true;
    co.global_delivery = opts->n_ids > 8;
    /* Many ids share nats.c's delivery pool; a claim blocks its thread for
     * a round trip, so give the pool a few (nats.h
     * nats_SetMessageDeliveryPoolSize; process-wide, grows only). */
    if (co.global_delivery)
        nats_SetMessageDeliveryPoolSize(8);
    rc = evt_connect(opts->nats_url, &co, &a->nc, errmsg);
    if (rc)
        goto fail;
    /* The broker creates the streams; an agent may only use them. */
    rc = evt_agents_kv(a->nc, &a->kv);
    if (rc) {
        if (errmsg && asprintf(errmsg, "KV bucket %s: %s (is a broker "
                                       "running on this NATS?)",
                               EVT_KV_AGENTS, ks_strerror(rc)) < 0)
            *errmsg = NULL;
        goto fail;
    }
    if (a->state_dir) {
        outbox_load(a);
        markers_recover(a); /* after exec_global_init killed the groups */
    }
    if (pthread_create(&a->pub_thread, NULL, publisher_main, a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    a->pub_started = true;

    a->slots = calloc(opts->n_ids, sizeof(*a->slots));
    if (!a->slots) {
        rc = -ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < opts->n_ids; i++) {
        struct agent_slot *s = &a->slots[i];
        char durable[16 + EVT_AGENT_ID_MAX], subject[16 + EVT_AGENT_ID_MAX],
            csubj[32 + EVT_AGENT_ID_MAX];
        s->agent = a;
        s->id = strdup(opts->ids[i]);
        a->n_slots = i + 1;
        if (!s->id) {
            rc = -ENOMEM;
            goto fail;
        }
        evt_agent_durable(durable, sizeof(durable), s->id);
        evt_cmd_subject(subject, sizeof(subject), s->id);
        struct evt_durable d = {
            .stream = EVT_STREAM_CMDS,
            .durable = durable,
            .filter_subject = subject,
            /* Processes serving the same id share its messages. */
            .deliver_group = durable,
            .max_ack_pending = a->max_concurrent,
            .ack_wait_ms = opts->ack_wait_ms ? (int64_t)opts->ack_wait_ms
                                             : 30000,
            .max_deliver = 5,
        };
        rc = evt_durable_subscribe(a->nc, &d, on_command, s, &s->sub, errmsg);
        if (rc)
            goto fail;
        snprintf(csubj, sizeof(csubj), "kscore.cancel.%s", s->id);
        if (natsConnection_Subscribe(&s->cancel_sub, a->nc->nc, csubj,
                                     on_cancel, s) != NATS_OK) {
            rc = KS_ENATS;
            goto fail;
        }
    }
    natsConnection_Flush(a->nc->nc);
    /* Registered (every id) before agent_start returns. */
    heartbeat_once(a);
    if (pthread_create(&a->hb_thread, NULL, heartbeat_main, a) != 0) {
        rc = KS_EINTERNAL;
        goto fail;
    }
    a->hb_started = true;
    *out = a;
    return 0;
fail:
    agent_stop(a);
    return rc;
}

void
agent_stop(struct agent *a)
{
    if (!a)
        return;
    for (size_t i = 0; i < a->n_slots; i++) {
        if (a->slots[i].sub)
            natsSubscription_Unsubscribe(a->slots[i].sub);
        if (a->slots[i].cancel_sub)
            natsSubscription_Unsubscribe(a->slots[i].cancel_sub);
    }
    /* Cancels what still runs; every job's callback has run on return. */
    exec_loop_free(a->loop);
    a->loop = NULL;
    pthread_mutex_lock(&a->mu);
    a->stopping = 1;
    pthread_cond_broadcast(&a->out_cond);
    pthread_mutex_unlock(&a->mu);
    if (a->pub_started)
        pthread_join(a->pub_thread, NULL);
    if (a->hb_started)
        pthread_join(a->hb_thread, NULL);
    for (size_t i = 0; i < a->n_slots; i++) {
        natsSubscription_Destroy(a->slots[i].sub);
        natsSubscription_Destroy(a->slots[i].cancel_sub);
        free(a->slots[i].id);
    }
    free(a->slots);
    while (a->out_head) {
        struct outbox_item *it = a->out_head;
        a->out_head = it->next;
        free(it->buf);
        free(it);
    }
    kvStore_Destroy(a->kv);
    evt_close(a->nc);
    ks_map_clear(&a->running);
    ks_map_clear(&a->seen);
    free(a->seen_ring);
    evt_verifier_free(a->own_trust);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->out_cond);
    pthread_cond_destroy(&a->idle_cond);
    free(a->state_dir);
    free(a);
}
