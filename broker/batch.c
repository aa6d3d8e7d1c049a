/*
 * BatchExecuteCommand: fan-out across agents with exact rate and error
 * control.
 *
 * A batch is a stream "batch-<uuid>" (BatchRequested, one BatchTargetEnded
 * per target, BatchCompleted) plus one command per target, each with its
 * own stream. A target is Pending until the scheduler dispatches it (then
 * its command stream starts: CommandRequested + CommandDispatched), and it
 * ends like any command (the recorder, the claim handler, the scanner or a
 * cancel call broker__command_ended, which hands it to this module).
 *
 * One scheduler thread owns every batch's progress: it takes what happened
 * since its last turn (new batches, ended targets, cancels), decides what to
 * dispatch or cancel, records all of it in ONE transaction
 * (store_append_many), then publishes the commands, the progress messages
 * and the final replies. So a busy batch costs one commit per turn, not one
 * per target.
 *
 * Rate control, exactly:
 *   in flight <= max_concurrency;
 *   max_errors E: once E targets have failed, nothing more is dispatched and
 *   the pending targets end Cancelled (in-flight ones finish);
 *   strict: in flight <= E - failed as well, so failures never exceed E.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

struct btarget {
    char agent_id[EVT_AGENT_ID_MAX + 1];
    char command_id[37];
    Ks__CommandStatus status; /* PENDING, DISPATCHED, then terminal */
    Ks__CommandResult *result; /* owned copy once ended */
    bool ended_unreported;     /* ended, BatchTargetEnded not yet recorded */
};

struct batch {
    char id[48]; /* "batch-<uuid>" */
    char operator_name[64];
    Ks__BatchRequest *req; /* owned; req->spec is every target's spec */
    struct btarget *t;
    size_t n, next; /* next: first never-dispatched target */
    char **agent_ptrs, **cmd_ptrs; /* for BatchSpec */
    unsigned running, succeeded, failed, cancelled;
    uint32_t conc, max_err;
    bool has_max_err, strict;
    bool recorded;   /* BatchRequested committed */
    bool cancel_req; /* operator cancel: cancel running targets too */
    bool cancel_sent;
    bool done;
    char *reply_subject; /* NULL when detached (replied at acceptance) */
    char *accept_subject; /* detached: reply once recorded */
    int64_t start_mono_us;
};

enum job_kind { JOB_NEW, JOB_ENDED, JOB_CANCEL };

struct job {
    struct job *next;
    enum job_kind kind;
    struct batch *batch;
    char command_id[37];
    Ks__CommandResult *result; /* owned copy */
};

struct broker__batches {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    struct ks_map live;   /* batch id -> struct batch * */
    struct ks_map by_cmd; /* command id -> struct batch * */
    struct job *head, **tail;
    pthread_t thread;
    bool started, stopping;
};

/* ---- helpers ------------------------------------------------------------- */

static Ks__CommandResult *
copy_result(const Ks__CommandResult *r)
{
    uint8_t *buf;
    size_t len;
    Ks__CommandResult *c;
    if (!r)
        return NULL;
    if (kproto_pack(&r->base, &buf, &len))
        return NULL;
    c = ks__command_result__unpack(NULL, len, buf);
    free(buf);
    return c;
}

static void
batch_free(struct batch *bt)
{
    if (!bt)
        return;
    for (size_t i = 0; i < bt->n; i++)
        if (bt->t[i].result)
            ks__command_result__free_unpacked(bt->t[i].result, NULL);
    free(bt->t);
    free(bt->agent_ptrs);
    free(bt->cmd_ptrs);
    if (bt->req)
        ks__batch_request__free_unpacked(bt->req, NULL);
    free(bt->reply_subject);
    free(bt->accept_subject);
    free(bt);
}

static void
counts_of(const struct batch *bt, Ks__BatchCounts *c)
{
    ks__batch_counts__init(c);
    c->total = (uint32_t)bt->n;
    c->running = bt->running;
    c->succeeded = bt->succeeded;
    c->failed = bt->failed;
    c->cancelled = bt->cancelled;
    c->pending = (uint32_t)bt->n - bt->running - bt->succeeded - bt->failed -
                 bt->cancelled;
}

static Ks__BatchStatus
final_status(const struct batch *bt)
{
    if (bt->cancel_req)
        return KS__BATCH_STATUS__BATCH_CANCELLED;
    if (bt->failed == 0 && bt->cancelled == 0)
        return KS__BATCH_STATUS__BATCH_SUCCEEDED;
    if (bt->succeeded == 0)
        return KS__BATCH_STATUS__BATCH_FAILED;
    return KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE;
}

static uint32_t
resolve_amount(const Ks__Amount *a, size_t n, bool at_least_one)
{
    uint64_t v;
    if (!a)
        return (uint32_t)n;
    v = a->percent ? (uint64_t)n * a->value / 100 : a->value;
    if (v > n)
        v = n;
    if (at_least_one && v == 0)
        v = 1;
    return (uint32_t)v;
}

/* ---- the plan of one turn ------------------------------------------------- */

/* Storage for one event and what it points to. */
struct slot {
    Ks__Event ev;
    char id[37];
    char stream[64];
    Ks__Command cmd;
    Ks__CommandResult res;
    Ks__BatchCounts counts;
    Ks__BatchSpec spec;
};

struct plan {
    struct slot **slots;
    size_t n, cap;
    Ks__Command **publish; /* commands to publish after the commit */
    size_t npub, cappub;
};

static struct slot *
plan_add(struct plan *p)
{
    if (p->n == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 64;
        void *x = realloc(p->slots, nc * sizeof(*p->slots));
        if (!x)
            return NULL;
        p->slots = x;
        p->cap = nc;
    }
    struct slot *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    p->slots[p->n++] = s;
    return s;
}

static void
plan_release(struct plan *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->slots[i]);
    free(p->slots);
    free(p->publish);
    memset(p, 0, sizeof(*p));
}

static int
plan_publish(struct plan *p, Ks__Command *cmd)
{
    if (p->npub == p->cappub) {
        size_t nc = p->cappub ? p->cappub * 2 : 64;
        void *x = realloc(p->publish, nc * sizeof(*p->publish));
        if (!x)
            return -ENOMEM;
        p->publish = x;
        p->cappub = nc;
    }
    p->publish[p->npub++] = cmd;
    return 0;
}

/* A batch-stream event. */
static struct slot *
batch_event(struct plan *p, struct batch *bt, const char *type)
{
    struct slot *s = plan_add(p);
    if (!s)
        return NULL;
    snprintf(s->stream, sizeof(s->stream), "%s", bt->id);
    broker__event_init(&s->ev, s->id, s->stream, type, NULL);
    s->ev.batch_id = bt->id;
    s->ev.operator_ = bt->operator_name;
    counts_of(bt, &s->counts);
    s->ev.batch_counts = &s->counts;
    return s;
}

/* CommandRequested + CommandDispatched of one target; its command is then
 * published. */
static int
dispatch_target(struct plan *p, struct batch *bt, struct btarget *t)
{
    struct slot *a = plan_add(p), *d = plan_add(p);
    uint64_t deliver_ms = bt->req->deliver_within_ms
                              ? bt->req->deliver_within_ms
                              : BROKER_DELIVER_WITHIN_DEFAULT_MS;
    char ids[2][37];
    if (!a || !d)
        return -ENOMEM;
    snprintf(a->stream, sizeof(a->stream), "command-%s", t->command_id);
    Ks__Command *cmd = &a->cmd;
    ks__command__init(cmd);
    cmd->command_id = t->command_id;
    cmd->attempt = 1;
    cmd->agent_id = t->agent_id;
    cmd->spec = bt->req->spec;
    cmd->issued_at_us = ks_now_us();
    cmd->not_after_us = cmd->issued_at_us + (int64_t)deliver_ms * 1000;
    cmd->dispatch_version = 2;
    cmd->batch_id = bt->id;
    cmd->operator_ = bt->operator_name;
    broker__start_events(&a->ev, &d->ev, ids, a->stream, cmd, NULL);
    memcpy(a->id, ids[0], 37);
    memcpy(d->id, ids[1], 37);
    a->ev.event_id = a->id;
    d->ev.event_id = d->id;
    t->status = KS__COMMAND_STATUS__DISPATCHED;
    bt->running++;
    return plan_publish(p, cmd);
}

/* A never-dispatched target ends Cancelled: its command stream still
 * records that (CommandRequested + CommandCancelled), so every target is a
 * command with its own history. */
static int
cancel_pending(struct plan *p, struct batch *bt, struct btarget *t,
               const char *why)
{
    struct slot *a = plan_add(p), *c = plan_add(p);
    if (!a || !c)
        return -ENOMEM;
    snprintf(a->stream, sizeof(a->stream), "command-%s", t->command_id);
    ks__command__init(&a->cmd);
    a->cmd.command_id = t->command_id;
    a->cmd.agent_id = t->agent_id;
    a->cmd.spec = bt->req->spec;
    a->cmd.issued_at_us = ks_now_us();
    a->cmd.batch_id = bt->id;
    a->cmd.operator_ = bt->operator_name;
    broker__event_init(&a->ev, a->id, a->stream, "CommandRequested",
                       t->command_id);
    a->ev.agent_id = t->agent_id;
    a->ev.batch_id = bt->id;
    a->ev.command = &a->cmd;
    a->ev.operator_ = bt->operator_name;
    broker__event_init(&c->ev, c->id, a->stream, "CommandCancelled",
                       t->command_id);
    c->ev.agent_id = t->agent_id;
    c->ev.batch_id = bt->id;
    ks__command_result__init(&c->res);
    c->res.status = KS__COMMAND_STATUS__CANCELLED;
    c->res.cancelled = 1;
    c->res.term_sent_us = c->res.kill_sent_us = -1;
    c->res.reason = (char *)why;
    c->ev.result = &c->res;
    c->ev.reason = (char *)why;
    c->ev.operator_ = bt->operator_name;
    t->status = KS__COMMAND_STATUS__CANCELLED;
    t->result = copy_result(&c->res);
    t->ended_unreported = true;
    bt->cancelled++;
    return 0;
}

static bool
may_dispatch(const struct batch *bt)
{
    if (bt->cancel_req)
        return false;
    if (bt->has_max_err && bt->failed >= bt->max_err)
        return false;
    if (bt->running >= bt->conc)
        return false;
    if (bt->strict && bt->has_max_err &&
        bt->running >= bt->max_err - bt->failed)
        return false;
    return bt->next < bt->n;
}

/* Decides one batch's turn into p. Caller holds the module lock. */
static int
plan_batch(struct plan *p, struct batch *bt)
{
    int rc = 0;

    if (!bt->recorded) {
        struct slot *s = batch_event(p, bt, "BatchRequested");
        if (!s)
            return -ENOMEM;
        Ks__BatchSpec *sp = &s->spec;
        ks__batch_spec__init(sp);
        sp->spec = bt->req->spec;
        sp->n_agents = bt->n;
        sp->agents = bt->agent_ptrs;
        sp->n_command_ids = bt->n;
        sp->command_ids = bt->cmd_ptrs;
        sp->max_concurrency = bt->conc;
        sp->max_errors = bt->max_err;
        sp->has_max_errors = bt->has_max_err;
        sp->strict_errors = bt->strict;
        sp->deliver_within_ms = bt->req->deliver_within_ms;
        s->ev.batch = sp;
        bt->recorded = true;
    }
    while (rc == 0 && may_dispatch(bt))
        rc = dispatch_target(p, bt, &bt->t[bt->next++]);
    if (rc == 0 && bt->next < bt->n &&
        (bt->cancel_req || (bt->has_max_err && bt->failed >= bt->max_err))) {
        const char *why = bt->cancel_req
                              ? "batch cancelled before this target ran"
                              : "batch error budget spent before this target "
                                "ran";
        while (rc == 0 && bt->next < bt->n)
            rc = cancel_pending(p, bt, &bt->t[bt->next++], why);
    }
    for (size_t i = 0; rc == 0 && i < bt->n; i++) {
        struct btarget *t = &bt->t[i];
        if (!t->ended_unreported)
            continue;
        struct slot *s = batch_event(p, bt, "BatchTargetEnded");
        if (!s)
            return -ENOMEM;
        s->ev.command_id = t->command_id;
        s->ev.agent_id = t->agent_id;
        s->ev.target_status = t->status;
    }
    if (rc == 0 && !bt->done && bt->next == bt->n && bt->running == 0) {
        struct slot *s = batch_event(p, bt, "BatchCompleted");
        if (!s)
            return -ENOMEM;
        s->ev.batch_status = final_status(bt);
        bt->done = true;
    }
    return rc;
}

/* ---- replies and progress -------------------------------------------------- */

static void
fill_reply(const struct batch *bt, Ks__BatchReply *r, Ks__BatchCounts *c,
           Ks__BatchTarget **tv, Ks__BatchTarget *ts, Ks__CommandResult *rs)
{
    ks__batch_reply__init(r);
    counts_of(bt, c);
    r->batch_id = (char *)bt->id;
    r->status = bt->done ? final_status(bt) : KS__BATCH_STATUS__BATCH_RUNNING;
    r->counts = c;
    r->elapsed_us = ks_mono_us() - bt->start_mono_us;
    r->max_concurrency = bt->conc;
    r->max_errors = bt->has_max_err ? bt->max_err : 0;
    for (size_t i = 0; tv && i < bt->n; i++) {
        ks__batch_target__init(&ts[i]);
        ts[i].agent_id = (char *)bt->t[i].agent_id;
        ts[i].command_id = (char *)bt->t[i].command_id;
        ts[i].status = bt->t[i].status;
        if (bt->t[i].result) {
            /* No output here: a big batch would not fit in one message.
             * Progress messages and `kscore get` carry it. */
            rs[i] = *bt->t[i].result;
            rs[i].stdout = NULL;
            rs[i].stderr = NULL;
            ts[i].result = &rs[i];
        }
        tv[i] = &ts[i];
    }
    r->targets = tv;
    r->n_targets = tv ? bt->n : 0;
}

static void
send_reply(struct broker *b, struct batch *bt, const char *subject)
{
    Ks__BatchReply r;
    Ks__BatchCounts c;
    Ks__BatchTarget **tv = calloc(bt->n, sizeof(*tv));
    Ks__BatchTarget *ts = calloc(bt->n, sizeof(*ts));
    Ks__CommandResult *rs = calloc(bt->n, sizeof(*rs));
    fill_reply(bt, &r, &c, tv && ts && rs ? tv : NULL, ts, rs);
    while (r.n_targets > 0 &&
           protobuf_c_message_get_packed_size(&r.base) > KS_MAX_MESSAGE_BYTES)
        r.n_targets /= 2; /* the client reads the rest with kscore get */
    evt_publish_msg(b->nc, subject, &r.base);
    free(tv);
    free(ts);
    free(rs);
}

static void
send_progress(struct broker *b, struct batch *bt, struct btarget *t)
{
    Ks__BatchProgress pr = KS__BATCH_PROGRESS__INIT;
    Ks__BatchTarget tg = KS__BATCH_TARGET__INIT;
    Ks__BatchCounts c;
    if (!bt->req->progress_subject[0])
        return;
    counts_of(bt, &c);
    tg.agent_id = t->agent_id;
    tg.command_id = t->command_id;
    tg.status = t->status;
    tg.result = t->result;
    pr.batch_id = bt->id;
    pr.target = &tg;
    pr.counts = &c;
    pr.elapsed_us = ks_mono_us() - bt->start_mono_us;
    if (evt_publish_msg(b->nc, bt->req->progress_subject, &pr.base) ==
        KS_ETOOBIG) {
        tg.result = NULL; /* the client fetches it with kscore get */
        evt_publish_msg(b->nc, bt->req->progress_subject, &pr.base);
    }
}

/* ---- the scheduler thread ------------------------------------------------- */

static void
apply_job(struct broker__batches *m, struct job *j)
{
    struct batch *bt = j->batch;
    switch (j->kind) {
    case JOB_NEW:
        break;
    case JOB_CANCEL:
        bt->cancel_req = true;
        break;
    case JOB_ENDED:
        for (size_t i = 0; i < bt->n; i++) {
            struct btarget *t = &bt->t[i];
            if (strcmp(t->command_id, j->command_id) != 0)
                continue;
            if (kproto_status_terminal(t->status))
                break; /* reported twice (a replay of a result): once */
            Ks__CommandStatus st = j->result
                                       ? j->result->status
                                       : KS__COMMAND_STATUS__FAILED;
            t->status = st;
            t->result = j->result;
            j->result = NULL;
            t->ended_unreported = true;
            if (bt->running)
                bt->running--;
            if (st == KS__COMMAND_STATUS__SUCCEEDED)
                bt->succeeded++;
            else
                bt->failed++;
            ks_map_del(&m->by_cmd, t->command_id);
            break;
        }
        break;
    }
}

static void
turn(struct broker *b, struct batch **touched, size_t nt)
{
    struct broker__batches *m = b->batches;
    struct plan p = {0};
    int rc = 0;

    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < nt && rc == 0; i++) {
        rc = plan_batch(&p, touched[i]);
        /* Register new commands before they can end. */
        for (size_t k = 0; k < touched[i]->n; k++)
            if (touched[i]->t[k].status == KS__COMMAND_STATUS__DISPATCHED)
                ks_map_put(&m->by_cmd, touched[i]->t[k].command_id,
                           touched[i]);
    }
    pthread_mutex_unlock(&m->mu);
    if (rc) {
        fprintf(stderr, "kscore batch: cannot plan: %s\n", ks_strerror(rc));
        plan_release(&p);
        return;
    }

    if (p.n) {
        Ks__Event **evs = calloc(p.n, sizeof(*evs));
        size_t dups = 0;
        int64_t backoff_ms = 100, since = 0;
        char why[512];
        for (size_t i = 0; evs && i < p.n; i++)
            evs[i] = &p.slots[i]->ev;
        rc = evs ? KS_EINTERNAL : -ENOMEM; /* set by the first attempt */
        /* The turn is decided (targets marked dispatched): it must be
         * recorded before anything is published. While PostgreSQL is
         * unreachable, wait for it (backoff to 2 s, one line when it
         * starts, one when it ends); other errors give up after 50. */
        for (int tries = 0; evs && tries < 50 && !b->stopping;) {
            rc = store_append_many(b->st_batch, (const Ks__Event *const *)evs,
                                   p.n, &dups);
            if (rc == 0)
                break;
            if (since == 0) {
                since = ks_mono_us();
                fprintf(stderr,
                        "kscore batch: cannot record a turn (%s), "
                        "retrying\n",
                        broker__store_error(b->st_batch, rc, why,
                                            sizeof(why)));
            }
            if (rc != KS_EPGDOWN)
                tries++;
            for (int64_t ms = backoff_ms; ms > 0 && !b->stopping; ms -= 100)
                nanosleep(&(struct timespec){0, (ms < 100 ? ms : 100) *
                                                    1000000L},
                          NULL);
            backoff_ms = backoff_ms < 1000 ? backoff_ms * 2 : 2000;
        }
        if (since && rc == 0)
            fprintf(stderr, "kscore batch: recorded after %.1f s\n",
                    (double)(ks_mono_us() - since) / 1e6);
        free(evs);
    }
    /* Unrecorded commands are never published: no claim could win. */
    for (size_t i = 0; rc == 0 && i < p.npub; i++) {
        int prc = evt_publish_command(b->nc, b->signer, p.publish[i], 5000);
        if (prc)
            fprintf(stderr, "kscore batch: publish %s: %s (scanner retries)\n",
                    p.publish[i]->command_id, ks_strerror(prc));
    }
    plan_release(&p);

    for (size_t i = 0; i < nt; i++) {
        struct batch *bt = touched[i];
        if (bt->accept_subject) {
            send_reply(b, bt, bt->accept_subject);
            free(bt->accept_subject);
            bt->accept_subject = NULL;
        }
        if (bt->cancel_req && !bt->cancel_sent) {
            bt->cancel_sent = true;
            for (size_t k = 0; k < bt->n; k++)
                if (bt->t[k].status == KS__COMMAND_STATUS__DISPATCHED)
                    broker__cancel_command(b, b->st_batch,
                                           bt->t[k].command_id,
                                           bt->operator_name, NULL);
        }
        for (size_t k = 0; k < bt->n; k++)
            if (bt->t[k].ended_unreported) {
                bt->t[k].ended_unreported = false;
                send_progress(b, bt, &bt->t[k]);
            }
        if (bt->done) {
            if (bt->reply_subject)
                send_reply(b, bt, bt->reply_subject);
            pthread_mutex_lock(&m->mu);
            ks_map_del(&m->live, bt->id);
            pthread_mutex_unlock(&m->mu);
            batch_free(bt);
        }
    }
}

static void *
scheduler_main(void *arg)
{
    struct broker *b = arg;
    struct broker__batches *m = b->batches;

    for (;;) {
        struct job *jobs;
        pthread_mutex_lock(&m->mu);
        while (!m->head && !m->stopping)
            pthread_cond_wait(&m->cond, &m->mu);
        if (!m->head && m->stopping) {
            pthread_mutex_unlock(&m->mu);
            break;
        }
        jobs = m->head;
        m->head = NULL;
        m->tail = &m->head;
        size_t nj = 0;
        for (struct job *j = jobs; j; j = j->next) {
            apply_job(m, j);
            nj++;
        }
        pthread_mutex_unlock(&m->mu);

        /* The batches this turn touches, each once. */
        struct batch **touched = calloc(nj, sizeof(*touched));
        size_t nt = 0;
        for (struct job *j = jobs; touched && j; j = j->next) {
            bool seen = false;
            for (size_t i = 0; i < nt && !seen; i++)
                seen = touched[i] == j->batch;
            if (!seen && !j->batch->done)
                touched[nt++] = j->batch;
        }
        if (touched)
            turn(b, touched, nt);
        free(touched);
        while (jobs) {
            struct job *next = jobs->next;
            if (jobs->result)
                ks__command_result__free_unpacked(jobs->result, NULL);
            free(jobs);
            jobs = next;
        }
    }
    return NULL;
}

static void
push_job(struct broker__batches *m, struct job *j)
{
    j->next = NULL;
    *m->tail = j;
    m->tail = &j->next;
    pthread_cond_signal(&m->cond);
}

int
broker__batch_target_ended(struct broker *b, const char *command_id,
                           const Ks__CommandResult *result)
{
    struct broker__batches *m = b->batches;
    struct batch *bt;
    struct job *j;

    if (!m)
        return 0;
    pthread_mutex_lock(&m->mu);
    bt = ks_map_get(&m->by_cmd, command_id);
    if (!bt) {
        pthread_mutex_unlock(&m->mu);
        return 0;
    }
    j = calloc(1, sizeof(*j));
    if (j) {
        j->kind = JOB_ENDED;
        j->batch = bt;
        snprintf(j->command_id, sizeof(j->command_id), "%s", command_id);
        j->result = copy_result(result);
        push_job(m, j);
    }
    pthread_mutex_unlock(&m->mu);
    return 1;
}

int
broker__batch_cancel(struct broker *b, const char *batch_id)
{
    struct broker__batches *m = b->batches;
    struct batch *bt;
    struct job *j = calloc(1, sizeof(*j));
    if (!j)
        return -ENOMEM;
    pthread_mutex_lock(&m->mu);
    bt = ks_map_get(&m->live, batch_id);
    if (!bt) {
        pthread_mutex_unlock(&m->mu);
        free(j);
        return KS_ENOTFOUND;
    }
    j->kind = JOB_CANCEL;
    j->batch = bt;
    push_job(m, j);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

/* ---- the API handler ----------------------------------------------------- */

struct resolve {
    struct broker *b;
    const Ks__BatchRequest *req;
    char **ids;
    size_t n, cap;
    struct ks_map seen;
    int64_t now_mono;
};

static int
add_target(struct resolve *r, const char *id)
{
    if (ks_map_get(&r->seen, id))
        return 0;
    if (r->n == r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 16;
        void *x = realloc(r->ids, nc * sizeof(*r->ids));
        if (!x)
            return -ENOMEM;
        r->ids = x;
        r->cap = nc;
    }
    if (!(r->ids[r->n] = strdup(id)))
        return -ENOMEM;
    r->n++;
    return ks_map_put(&r->seen, id, (void *)1);
}

static bool
labels_match(const Ks__AgentInfo *info, const Ks__BatchRequest *req)
{
    for (size_t i = 0; i < req->n_select; i++) {
        bool found = false;
        for (size_t k = 0; k < info->n_labels && !found; k++)
            found = strcmp(info->labels[k]->name, req->select[i]->name) ==
                        0 &&
                    strcmp(info->labels[k]->value, req->select[i]->value) ==
                        0;
        if (!found)
            return false;
    }
    return true;
}

/* Online agents matching --all / --select, collected sorted below. */
static void
collect_online(const char *key, void *val, void *ud)
{
    struct resolve *r = ud;
    struct broker__agent *a = val;
    if (r->now_mono - a->seen_mono_us >= (int64_t)EVT_AGENT_TTL_MS * 1000)
        return;
    if (!r->req->all && !labels_match(a->info, r->req))
        return;
    add_target(r, key);
}

static int
cmp_str(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

static void
reply_batch_error(struct broker *b, natsMsg *msg, int code, const char *text)
{
    Ks__BatchReply r = KS__BATCH_REPLY__INIT;
    r.error_code = code;
    r.error = (char *)text;
    const char *subj = natsMsg_GetReply(msg);
    if (subj)
        evt_publish_msg(b->nc, subj, &r.base);
}

void
broker__on_batch(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                 void *ud)
{
    struct broker *b = ud;
    struct broker__batches *m = b->batches;
    Ks__BatchRequest *req = NULL;
    struct resolve r = {.b = b, .seen = KS_MAP_INIT};
    struct batch *bt = NULL;
    char why[512], uuid[37];
    int rc;

    (void)nc;
    (void)sub;
    rc = broker__unpack_request(msg, &ks__batch_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    r.req = req;
    if ((rc = broker__validate_spec(req->spec, why, sizeof(why)))) {
        reply_batch_error(b, msg, rc, why);
        goto out;
    }
    if (req->n_agents == 0 && req->n_select == 0 && !req->all) {
        reply_batch_error(b, msg, KS_EINVAL,
                          "no targets: give --agents, --select or --all");
        goto out;
    }
    /* Explicit ids first, in the order given; each must be known. */
    why[0] = '\0';
    for (size_t i = 0; i < req->n_agents; i++) {
        const char *id = req->agents[i];
        if (!evt_agent_id_valid(id) || !broker__agent_known(b, id)) {
            size_t used = strlen(why);
            snprintf(why + used, sizeof(why) - used, "%s%s",
                     used ? ", " : "unknown agent(s): ", id);
            continue;
        }
        add_target(&r, id);
    }
    if (why[0]) {
        reply_batch_error(b, msg, KS_ENOAGENT, why);
        goto out;
    }
    if (req->all || req->n_select) {
        size_t first = r.n;
        pthread_mutex_lock(&b->mu);
        r.now_mono = ks_mono_us();
        ks_map_each(&b->agents, collect_online, &r);
        pthread_mutex_unlock(&b->mu);
        qsort(r.ids + first, r.n - first, sizeof(*r.ids), cmp_str);
    }
    if (b->policy) {
        /* Every target must be allowed: a batch is all or nothing. */
        const char *op = broker__operator_of(msg);
        for (size_t i = 0; i < r.n; i++) {
            Ks__AgentInfo *info = broker__agent_info(b, r.ids[i]);
            rc = broker__policy_check(b->policy, op, info, req->spec->argv[0],
                                      why, sizeof(why));
            if (info)
                ks__agent_info__free_unpacked(info, NULL);
            if (rc) {
                broker__record_denied(b, b->st_batch, op, r.ids[i], req->spec,
                                      why);
                reply_batch_error(b, msg, rc, why);
                goto out;
            }
        }
    }
    if (r.n == 0) {
        reply_batch_error(b, msg, KS_ENOAGENT,
                          req->all ? "no targets: no agent is online"
                                   : "no targets: the selector matched no "
                                     "online agent");
        goto out;
    }

    bt = calloc(1, sizeof(*bt));
    if (!bt || !(bt->t = calloc(r.n, sizeof(*bt->t))) ||
        !(bt->agent_ptrs = calloc(r.n, sizeof(char *))) ||
        !(bt->cmd_ptrs = calloc(r.n, sizeof(char *)))) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    ks_uuid(uuid);
    snprintf(bt->id, sizeof(bt->id), "batch-%s", uuid);
    bt->n = r.n;
    for (size_t i = 0; i < r.n; i++) {
        snprintf(bt->t[i].agent_id, sizeof(bt->t[i].agent_id), "%s",
                 r.ids[i]);
        ks_uuid(bt->t[i].command_id);
        bt->t[i].status = KS__COMMAND_STATUS__PENDING;
        bt->agent_ptrs[i] = bt->t[i].agent_id;
        bt->cmd_ptrs[i] = bt->t[i].command_id;
    }
    bt->conc = resolve_amount(req->max_concurrency, r.n, true);
    bt->has_max_err = req->max_errors != NULL;
    bt->max_err = resolve_amount(req->max_errors, r.n, false);
    bt->strict = req->strict_errors;
    bt->start_mono_us = ks_mono_us();
    snprintf(bt->operator_name, sizeof(bt->operator_name), "%s",
             broker__operator_of(msg));
    const char *reply = natsMsg_GetReply(msg);
    if (reply) {
        if (req->detach)
            bt->accept_subject = strdup(reply);
        else
            bt->reply_subject = strdup(reply);
    }
    bt->req = req;
    req = NULL;

    struct job *j = calloc(1, sizeof(*j));
    if (!j) {
        reply_batch_error(b, msg, -ENOMEM, "out of memory");
        goto out;
    }
    j->kind = JOB_NEW;
    j->batch = bt;
    pthread_mutex_lock(&m->mu);
    ks_map_put(&m->live, bt->id, bt);
    push_job(m, j);
    pthread_mutex_unlock(&m->mu);
    bt = NULL;
out:
    batch_free(bt);
    for (size_t i = 0; i < r.n; i++)
        free(r.ids[i]);
    free(r.ids);
    ks_map_clear(&r.seen);
    if (req)
        ks__batch_request__free_unpacked(req, NULL);
    natsMsg_Destroy(msg);
}

/* ---- view ------------------------------------------------------------------ */

struct view_acc {
    Ks__BatchReply *r;
    int rc;
};

static int
view_event(const Ks__RecordedEvent *rec, void *ud)
{
    struct view_acc *v = ud;
    const Ks__Event *e = rec->event;
    Ks__BatchReply *r = v->r;

    if (strcmp(e->type, "BatchRequested") == 0 && e->batch) {
        const Ks__BatchSpec *sp = e->batch;
        r->n_targets = sp->n_agents;
        r->targets = calloc(sp->n_agents ? sp->n_agents : 1,
                            sizeof(*r->targets));
        if (!r->targets)
            return v->rc = -ENOMEM;
        for (size_t i = 0; i < sp->n_agents; i++) {
            Ks__BatchTarget *t = calloc(1, sizeof(*t));
            if (!t)
                return v->rc = -ENOMEM;
            ks__batch_target__init(t);
            t->agent_id = strdup(sp->agents[i]);
            t->command_id =
                strdup(i < sp->n_command_ids ? sp->command_ids[i] : "");
            t->status = KS__COMMAND_STATUS__PENDING;
            r->targets[i] = t;
        }
        r->max_concurrency = sp->max_concurrency;
        r->max_errors = sp->has_max_errors ? sp->max_errors : 0;
        r->status = KS__BATCH_STATUS__BATCH_RUNNING;
        r->elapsed_us = -rec->recorded_at_us; /* completed below */
    } else if (strcmp(e->type, "BatchTargetEnded") == 0) {
        for (size_t i = 0; i < r->n_targets; i++)
            if (strcmp(r->targets[i]->command_id, e->command_id) == 0)
                r->targets[i]->status = e->target_status;
    } else if (strcmp(e->type, "BatchCompleted") == 0) {
        r->status = e->batch_status;
        r->elapsed_us += rec->recorded_at_us;
    }
    if (e->batch_counts) {
        if (!r->counts) {
            r->counts = calloc(1, sizeof(*r->counts));
            if (!r->counts)
                return v->rc = -ENOMEM;
            ks__batch_counts__init(r->counts);
        }
        r->counts->total = e->batch_counts->total;
        r->counts->pending = e->batch_counts->pending;
        r->counts->running = e->batch_counts->running;
        r->counts->succeeded = e->batch_counts->succeeded;
        r->counts->failed = e->batch_counts->failed;
        r->counts->cancelled = e->batch_counts->cancelled;
    }
    return 0;
}

int
broker__batch_view(struct broker *b, struct store *st, const char *batch_id,
                   Ks__BatchReply **out)
{
    struct broker__batches *m = b->batches;
    struct batch *bt;
    Ks__BatchReply *r;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = 0;

    /* Live: from memory, under the lock (the scheduler mutates it). */
    pthread_mutex_lock(&m->mu);
    bt = ks_map_get(&m->live, batch_id);
    if (bt) {
        Ks__BatchReply tmp;
        Ks__BatchCounts c;
        Ks__BatchTarget **tv = calloc(bt->n, sizeof(*tv));
        Ks__BatchTarget *ts = calloc(bt->n, sizeof(*ts));
        Ks__CommandResult *rs = calloc(bt->n, sizeof(*rs));
        if (tv && ts && rs) {
            fill_reply(bt, &tmp, &c, tv, ts, rs);
            rc = kproto_pack(&tmp.base, &buf, &len);
        } else {
            rc = -ENOMEM;
        }
        free(tv);
        free(ts);
        free(rs);
    }
    pthread_mutex_unlock(&m->mu);
    if (bt) {
        if (rc)
            return rc;
        *out = ks__batch_reply__unpack(NULL, len, buf);
        free(buf);
        return *out ? 0 : -ENOMEM;
    }

    /* Ended (or served by another broker): fold its stream. */
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    ks__batch_reply__init(r);
    struct view_acc acc = {r, 0};
    rc = store_read_stream(st, batch_id, 0, 0, view_event, &acc);
    if (rc == 0)
        rc = acc.rc;
    if (rc == 0 && !r->targets)
        rc = KS_ENOTFOUND;
    if (rc == 0) {
        r->batch_id = strdup(batch_id);
        if (r->status == KS__BATCH_STATUS__BATCH_RUNNING)
            r->elapsed_us = 0;
    }
    /* Normalise ownership: repack so protobuf-c's free_unpacked owns it. */
    if (rc == 0 && kproto_pack(&r->base, &buf, &len) == 0) {
        *out = ks__batch_reply__unpack(NULL, len, buf);
        free(buf);
        if (!*out)
            rc = -ENOMEM;
    } else if (rc == 0) {
        rc = -ENOMEM;
    }
    /* free the hand-built one */
    for (size_t i = 0; i < r->n_targets && r->targets; i++) {
        if (!r->targets[i])
            continue;
        free(r->targets[i]->agent_id);
        free(r->targets[i]->command_id);
        free(r->targets[i]);
    }
    free(r->targets);
    free(r->counts);
    free(r->batch_id);
    free(r);
    return rc;
}

/* ---- start / stop ------------------------------------------------------------ */

int
broker__batch_start(struct broker *b, char **errmsg)
{
    struct broker__batches *m = calloc(1, sizeof(*m));
    (void)errmsg;
    if (!m)
        return -ENOMEM;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cond, NULL);
    m->live = (struct ks_map)KS_MAP_INIT;
    m->by_cmd = (struct ks_map)KS_MAP_INIT;
    m->tail = &m->head;
    b->batches = m;
    if (pthread_create(&m->thread, NULL, scheduler_main, b) != 0)
        return KS_EINTERNAL;
    m->started = true;
    return 0;
}

static void
free_live(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    batch_free(val);
}

void
broker__batch_stop(struct broker *b)
{
    struct broker__batches *m = b->batches;
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->stopping = true;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->mu);
    if (m->started)
        pthread_join(m->thread, NULL);
    while (m->head) {
        struct job *j = m->head;
        m->head = j->next;
        if (j->result)
            ks__command_result__free_unpacked(j->result, NULL);
        free(j);
    }
    ks_map_each(&m->live, free_live, NULL);
    ks_map_clear(&m->live);
    ks_map_clear(&m->by_cmd);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cond);
    free(m);
    b->batches = NULL;
}
