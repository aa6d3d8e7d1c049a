/*
 * append.c: the write side. One append is one libpq pipeline, so one round
 * trip and one commit: kscore_append(...) (version check + insert +
 * NOTIFY) followed by one kscore_project(...) per event, all in the
 * implicit transaction that ends at the pipeline's Sync (PostgreSQL docs
 * 55.2.4 "Pipelining"; libpq docs 34.5 "Pipeline Mode"). If any statement
 * fails, the rest are skipped and everything is rolled back.
 */
#include "store_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const struct {
    const char *type;
    enum store__proj_kind kind;
    Ks__CommandStatus status;
} event_types[] = {
    {"CommandRequested", STORE__PROJ_REQUESTED, KS__COMMAND_STATUS__PENDING},
    {"CommandDispatched", STORE__PROJ_STATUS, KS__COMMAND_STATUS__DISPATCHED},
    {"CommandStarted", STORE__PROJ_STATUS, KS__COMMAND_STATUS__RUNNING},
    {"CommandCompleted", STORE__PROJ_RESULT, KS__COMMAND_STATUS__STATUS_UNSPECIFIED},
    {"CommandStartFailed", STORE__PROJ_RESULT, KS__COMMAND_STATUS__START_FAILED},
    {"CommandUndeliverable", STORE__PROJ_STATUS, KS__COMMAND_STATUS__UNDELIVERABLE},
    {"CommandLost", STORE__PROJ_STATUS, KS__COMMAND_STATUS__LOST},
    {"CommandCancelled", STORE__PROJ_STATUS, KS__COMMAND_STATUS__CANCELLED},
    {"CommandNotStarted", STORE__PROJ_STATUS, KS__COMMAND_STATUS__NOT_STARTED},
    {"LateResult", STORE__PROJ_VERSION, 0},
    {"ReportRejected", STORE__PROJ_VERSION, 0},
    {"CommandCancelRequested", STORE__PROJ_VERSION, 0},
    {"CommandRejected", STORE__PROJ_VERSION, 0},
    {"DuplicateSuppressed", STORE__PROJ_VERSION, 0},
    {"BatchRequested", STORE__PROJ_BATCH, 0},
    {"BatchCompleted", STORE__PROJ_BATCH, 0},
    {"BatchCancelled", STORE__PROJ_BATCH, 0},
};

static enum store__proj_kind
classify(const char *type, Ks__CommandStatus *status)
{
    for (size_t i = 0; i < sizeof(event_types) / sizeof(event_types[0]); i++)
        if (strcmp(type, event_types[i].type) == 0) {
            *status = event_types[i].status;
            return event_types[i].kind;
        }
    /* Any other event of a command (CommandDeliveryExhausted, and types
     * added later) still moves the row's version with its stream, so an
     * append at view->version stays a correct expected version. */
    *status = 0;
    return strncmp(type, "Command", 7) == 0 ? STORE__PROJ_VERSION
                                            : STORE__PROJ_NONE;
}

static const char *
nz(const char *s)
{
    return s && *s ? s : NULL;
}

const char *
store__command_id(const Ks__Event *ev)
{
    if (nz(ev->command_id))
        return ev->command_id;
    if (ev->command && nz(ev->command->command_id))
        return ev->command->command_id;
    if (strncmp(ev->stream_id, "command-", 8) == 0)
        return ev->stream_id + 8;
    return NULL;
}

const char *
store__batch_id(const Ks__Event *ev)
{
    if (nz(ev->batch_id))
        return ev->batch_id;
    if (ev->command && nz(ev->command->batch_id))
        return ev->command->batch_id;
    if (strncmp(ev->stream_id, "batch-", 6) == 0 && ev->stream_id[6])
        return ev->stream_id + 6;
    return NULL;
}

/* Checks what the append needs before anything is sent. */
int
store__validate(const Ks__Event *ev)
{
    Ks__CommandStatus st;
    enum store__proj_kind kind;

    if (!ev || !ks_is_uuid(ev->event_id) || !nz(ev->stream_id) ||
        !nz(ev->type))
        return KS_EINVAL;
    kind = classify(ev->type, &st);
    if (kind == STORE__PROJ_NONE)
        return 0;
    if (kind == STORE__PROJ_BATCH)
        return store__batch_id(ev) ? 0 : KS_EINVAL;
    return ks_is_uuid(store__command_id(ev)) ? 0 : KS_EINVAL;
}

/* The status a CommandCompleted without one stands for. */
Ks__CommandStatus
store__result_status(const Ks__CommandResult *r, Ks__CommandStatus dflt)
{
    if (r->status != KS__COMMAND_STATUS__STATUS_UNSPECIFIED)
        return r->status;
    if (dflt != KS__COMMAND_STATUS__STATUS_UNSPECIFIED)
        return dflt;
    if (r->cancelled)
        return KS__COMMAND_STATUS__CANCELLED;
    if (r->timed_out)
        return KS__COMMAND_STATUS__TIMED_OUT;
    return r->has_exit_code && r->exit_code == 0
               ? KS__COMMAND_STATUS__SUCCEEDED
               : KS__COMMAND_STATUS__FAILED;
}

/*
 * The result column: the packed CommandResult without the output bytes,
 * which live once, in the stdout/stderr columns; store_get_command() puts
 * them back.
 */
int
store__pack_result(struct store__buf *b, const Ks__CommandResult *r)
{
    Ks__CommandResult copy = *r;
    Ks__Output out, err;
    size_t len;
    int rc;

    if (copy.stdout) {
        out = *copy.stdout;
        out.data.data = NULL;
        out.data.len = 0;
        copy.stdout = &out;
    }
    if (copy.stderr) {
        err = *copy.stderr;
        err.data.data = NULL;
        err.data.len = 0;
        copy.stderr = &err;
    }
    b->len = 0;
    len = ks__command_result__get_packed_size(&copy);
    if ((rc = store__buf_reserve(b, len)) < 0)
        return rc;
    b->len = ks__command_result__pack(&copy, b->p);
    return 0;
}

static void
p_output(struct store__params *p, const Ks__Output *o)
{
    if (o)
        store__p_bin(p, o->data.data, o->data.len);
    else
        store__p_null(p);
}

void
store__note_recorded(const Ks__Event *const *evs, size_t n, const bool *skip,
                      int64_t t0_us)
{
    int64_t now = ks_now_us();

    store__wake();
    ks_metric_observe_us(KS_H_APPEND, ks_mono_us() - t0_us);
    for (size_t i = 0; i < n; i++) {
        const Ks__Event *ev = evs[i];
        Ks__CommandStatus st = 0;
        if (skip && skip[i])
            continue;
        ks_metric_inc(KS_C_EVENTS_RECORDED);
        if (ev->occurred_at_us > 0)
            ks_metric_observe_us(KS_H_RECORD_LATENCY,
                                 now - ev->occurred_at_us);
        if (!store_event_is_terminal(ev->type))
            continue;
        classify(ev->type, &st);
        if (ev->result) {
            st = store__result_status(ev->result, st);
            if (ev->result->duration_us > 0)
                ks_metric_observe_us(KS_H_COMMAND_DURATION,
                                     ev->result->duration_us);
        }
        ks_metric_status_inc(KS_SC_COMMANDS, st);
    }
}

enum store__proj_kind
store__proj_kind(const Ks__Event *ev, Ks__CommandStatus *status)
{
    enum store__proj_kind kind = classify(ev->type, status);

    if (kind == STORE__PROJ_RESULT && !ev->result)
        kind = *status ? STORE__PROJ_STATUS : STORE__PROJ_VERSION;
    /* A status event that carries a result (CommandCancelled) keeps it. */
    if (kind == STORE__PROJ_STATUS && ev->result)
        kind = STORE__PROJ_RESULT;
    return kind;
}

int
store__send_project(struct store *s, const Ks__Event *ev, bool replay)
{
    struct store__params p = {0};
    Ks__CommandStatus st = 0;
    enum store__proj_kind kind = store__proj_kind(ev, &st);
    const Ks__Command *cmd = ev->command;
    const Ks__CommandResult *r = ev->result;
    int rc;

    if (kind == STORE__PROJ_NONE)
        return 0;

    store__p_text(&p, ev->event_id);                              /* 1 */
    store__p_bool(&p, replay);                                    /* 2 */
    store__p_text(&p, ev->type);                                  /* 3 */
    store__p_text(&p, kind == STORE__PROJ_BATCH ? NULL : store__command_id(ev)); /* 4 */
    if (kind == STORE__PROJ_REQUESTED && cmd && nz(cmd->agent_id))
        store__p_text(&p, cmd->agent_id); /* 5 */
    else
        store__p_text_or_null(&p, ev->agent_id);
    store__p_i64(&p, ev->attempt); /* 6 */
    store__p_i64(&p, ev->occurred_at_us ? ev->occurred_at_us
                     : cmd             ? cmd->issued_at_us
                                       : 0); /* 7 */
    store__p_text(&p, store__batch_id(ev));      /* 8 */
    store__p_text_or_null(&p, nz(ev->operator_) ? ev->operator_
                              : cmd             ? cmd->operator_
                                                : NULL); /* 9 */
    if (kind == STORE__PROJ_REQUESTED && cmd && cmd->spec) {     /* 10 */
        const Ks__CommandSpec *spec = cmd->spec;
        if ((rc = store__arr_begin(&s->argv, STORE__OID_TEXT, spec->n_argv)) <
            0)
            return rc;
        for (size_t i = 0; i < spec->n_argv; i++)
            if ((rc = store__arr_put(&s->argv, spec->argv[i],
                                     strlen(spec->argv[i]))) < 0)
                return rc;
        store__p_bin(&p, s->argv.p, s->argv.len);
    } else {
        store__p_null(&p);
    }
    /* 11: the idempotency key travels in CommandRequested.reason. */
    store__p_text_or_null(&p, kind == STORE__PROJ_REQUESTED ? ev->reason : NULL);
    if (kind == STORE__PROJ_STATUS) /* 12 */
        store__p_text(&p, kproto_status_name(st));
    else if (kind == STORE__PROJ_BATCH && ev->batch_status &&
             ev->batch_status != KS__BATCH_STATUS__BATCH_RUNNING &&
             strcmp(ev->type, "BatchCompleted") == 0)
        /* How it ended (migration 13). */
        store__p_text(&p, kproto_batch_status_name(ev->batch_status));
    else if (kind == STORE__PROJ_RESULT)
        store__p_text(&p, kproto_status_name(store__result_status(r, st)));
    else
        store__p_null(&p);
    if (kind == STORE__PROJ_RESULT) {
        if (r->has_exit_code) /* 13 */
            store__p_i64(&p, r->exit_code);
        else
            store__p_null(&p);
        store__p_i64(&p, r->signal);    /* 14 */
        store__p_bool(&p, r->timed_out); /* 15 */
        p_output(&p, r->stdout);         /* 16 */
        p_output(&p, r->stderr);         /* 17 */
        if (r->stdout)                   /* 18 */
            store__p_i64(&p, (int64_t)r->stdout->total_bytes);
        else
            store__p_null(&p);
        if (r->stderr) /* 19 */
            store__p_i64(&p, (int64_t)r->stderr->total_bytes);
        else
            store__p_null(&p);
        if (r->stdout) /* 20 */
            store__p_bool(&p, r->stdout->truncated);
        else
            store__p_null(&p);
        if (r->stderr) /* 21 */
            store__p_bool(&p, r->stderr->truncated);
        else
            store__p_null(&p);
        store__p_i64(&p, r->duration_us);             /* 22 */
        store__p_text_or_null(&p, r->start_stage);    /* 23 */
        store__p_i64(&p, r->start_errno);             /* 24 */
        store__p_i64(&p, r->started_at_us);           /* 25 */
        store__p_i64(&p, r->finished_at_us);          /* 26 */
        if ((rc = store__pack_result(&s->result, r)) < 0)
            return rc;
        store__p_bin(&p, s->result.p, s->result.len); /* 27 */
    } else {
        while (p.n < 27)
            store__p_null(&p);
    }
    /* 28: the delivery deadline (Requested carries it in the command). */
    if (ev->deliver_by_us)
        store__p_i64(&p, ev->deliver_by_us);
    else if (kind == STORE__PROJ_REQUESTED && cmd && cmd->not_after_us)
        store__p_i64(&p, cmd->not_after_us);
    else
        store__p_null(&p);
    if (!PQsendQueryPrepared(s->conn, "ks_project", p.n, p.val, p.len, p.fmt,
                             0))
        return store__pg_error(s, NULL, NULL);
    return 1;
}

int
store__pipeline_read(struct store *s, store__result_fn on_result, void *ud,
                     char **detail_out)
{
    int rc = 0, nulls = 0;

    /* The pipeline is sent: until an error result says the transaction
     * failed, a connection lost now may have lost the reply to a commit
     * (a FATAL result too: conservatively, it may have come at the
     * commit). */
    s->in_doubt = true;
    for (;;) {
        PGresult *res = PQgetResult(s->conn);
        if (!res) {
            /* One NULL ends each query's results; two in a row mean
             * nothing is pending, yet no sync came (the connection was
             * lost, or reset under us): never wait for it. */
            if (PQstatus(s->conn) == CONNECTION_BAD || ++nulls > 1) {
                int lost = store__pg_error(s, NULL, NULL);
                s->broken = true; /* its pipeline state is unknown */
                if (rc == 0 || lost == KS_EPGDOWN)
                    rc = lost;
                break;
            }
            continue; /* the end of one query's results */
        }
        nulls = 0;
        switch (PQresultStatus(res)) {
        case PGRES_PIPELINE_SYNC:
            PQclear(res);
            s->in_doubt = false; /* the end of the transaction was read */
            return rc;
        case PGRES_TUPLES_OK:
        case PGRES_COMMAND_OK:
        case PGRES_PIPELINE_ABORTED:
            if (on_result)
                on_result(res, ud);
            break;
        default:
            if (on_result)
                on_result(res, ud);
            if (rc == 0) {
                const char *d =
                    PQresultErrorField(res, PG_DIAG_MESSAGE_DETAIL);
                rc = store__pg_error(s, res, NULL);
                if (rc != KS_EPGDOWN)
                    s->in_doubt = false; /* it failed: rolled back */
                if (detail_out && d)
                    *detail_out = strdup(d);
            }
            break;
        }
        PQclear(res);
    }
    return rc;
}

/* store__pipeline_finish's reader: the first result's first value. */
struct first_value {
    int64_t *out;
    bool seen;
};

static void
take_first(const PGresult *res, void *ud)
{
    struct first_value *f = ud;
    ExecStatusType st = PQresultStatus(res);

    if (!f->seen && f->out &&
        (st == PGRES_TUPLES_OK || st == PGRES_COMMAND_OK) &&
        PQntuples(res) == 1 && !PQgetisnull(res, 0, 0))
        *f->out = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    f->seen = true;
}

int
store__pipeline_finish(struct store *s, int64_t *first_out, char **detail_out)
{
    struct first_value f = {first_out, false};
    return store__pipeline_read(s, take_first, &f, detail_out);
}

void
store__send_commit(struct store *s)
{
    if (!s->commit_in_pipeline || s->commit_sent)
        return;
    if (PQsendQueryParams(s->conn, "COMMIT", 0, NULL, NULL, NULL, NULL, 0))
        s->commit_sent = true;
}

/* Ends pipeline mode; a connection that cannot leave it (results left
 * unread) is started afresh by the next call (store__ready). */
void
store__pipeline_end(struct store *s)
{
    if (PQpipelineStatus(s->conn) != PQ_PIPELINE_OFF &&
        !PQexitPipelineMode(s->conn))
        s->broken = true;
}


static int
cmp_id_ref(const void *a, const void *b)
{
    const struct store__id_ref *x = a, *y = b;
    int c = strcasecmp(x->id, y->id);
    /* Among equal ids the first in the input sorts first. */
    return c ? c : (x->idx < y->idx ? -1 : x->idx > y->idx);
}

/*
 * Sorts refs (n entries) by event_id, the first in the input first among
 * equal ids, and marks skip[i] for every event whose event_id appeared
 * earlier in the input. Returns the number marked.
 */
size_t
store__mark_repeats(const Ks__Event *const *events, size_t n,
                    struct store__id_ref *refs,
             bool *skip)
{
    size_t repeats = 0;

    for (size_t i = 0; i < n; i++) {
        refs[i].id = events[i]->event_id;
        refs[i].idx = i;
    }
    ks_sort(refs, n, sizeof(*refs), cmp_id_ref);
    for (size_t i = 1; i < n; i++)
        if (strcasecmp(refs[i].id, refs[i - 1].id) == 0) {
            skip[refs[i].idx] = true;
            repeats++;
        }
    return repeats;
}

/*
 * Marks skip[] for the first event of each id in list (KS003's DETAIL:
 * ids, comma-separated) through refs sorted by store__mark_repeats(). Returns the
 * number newly marked; tokens that are no id of the input are ignored.
 */
size_t
store__mark_recorded(const struct store__id_ref *refs, size_t n,
                     const char *list, bool *skip)
{
    size_t marked = 0;

    while (*list) {
        size_t len = strcspn(list, ","), lo = 0, hi = n;
        char id[37];
        if (len == 36) {
            memcpy(id, list, 36);
            id[36] = '\0';
            while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (strcasecmp(refs[mid].id, id) < 0)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo < n && strcasecmp(refs[lo].id, id) == 0 &&
                !skip[refs[lo].idx]) {
                skip[refs[lo].idx] = true;
                marked++;
            }
        }
        list += len;
        if (*list == ',')
            list++;
    }
    return marked;
}

/* Appends the packed event as one element of the bytea[] in b. */
int
store__put_packed_event(struct store__buf *b, const Ks__Event *ev)
{
    size_t len = ks__event__get_packed_size(ev);
    int rc;

    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if ((rc = store__buf_put_be32(b, (uint32_t)len)) < 0 ||
        (rc = store__buf_reserve(b, len)) < 0)
        return rc;
    /* Packed straight into the parameter buffer: no intermediate copy. */
    b->len += ks__event__pack(ev, b->p + b->len);
    return 0;
}

/*
 * After a unique violation on event_id (a redelivery racing the first
 * delivery past the in-function check): KS_EDUPLICATE with the stream's
 * version if every event is recorded now, else KS_ECONFLICT.
 */
static int
recheck_recorded(struct store *s, const char *stream_id, int64_t *version_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    store__p_bin(&p, s->ids.p, s->ids.len);
    store__p_text(&p, stream_id);
    res = PQexecParams(
        s->conn,
        "SELECT (SELECT count(*) FROM events WHERE event_id = ANY ($1::uuid[]))"
        " = (SELECT count(DISTINCT x) FROM unnest($1::uuid[]) x),"
        " coalesce((SELECT version FROM streams WHERE stream_id = $2), 0)",
        p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
    } else if (strcmp(PQgetvalue(res, 0, 0), "t") == 0) {
        *version_out = strtoll(PQgetvalue(res, 0, 1), NULL, 10);
        rc = KS_EDUPLICATE;
    } else {
        rc = KS_ECONFLICT;
    }
    PQclear(res);
    return rc;
}

static int append_impl(struct store *s, const char *stream_id,
                       int64_t expected_version,
                       const struct store_event *events, size_t n,
                       int64_t *version_out, const char *claim_agent,
                       void (*between)(void *), void *ud);

int
store_append(struct store *s, const char *stream_id,
             int64_t expected_version, const struct store_event *events,
             size_t n, int64_t *version_out)
{
    return append_impl(s, stream_id, expected_version, events, n,
                       version_out, NULL, NULL, NULL);
}

int
store_append_overlap(struct store *s, const char *stream_id,
                     int64_t expected_version, const struct store_event *events,
                     size_t n, int64_t *version_out, void (*between)(void *ud),
                     void *ud)
{
    return append_impl(s, stream_id, expected_version, events, n,
                       version_out, NULL, between, ud);
}

int
store_append_claim(struct store *s, const char *stream_id,
                   int64_t expected_version, const char *agent_id,
                   const struct store_event *event, int64_t *version_out)
{
    BUG_ON(!agent_id);
    if (strncmp(stream_id, "command-", 8) != 0 || !ks_is_uuid(stream_id + 8))
        return KS_EINVAL;
    return append_impl(s, stream_id, expected_version, event, 1,
                       version_out, agent_id, NULL, NULL);
}

static int
append_impl(struct store *s, const char *stream_id, int64_t expected_version,
            const struct store_event *events, size_t n, int64_t *version_out,
            const char *claim_agent, void (*between)(void *), void *ud)
{
    const Ks__Event **evs = NULL;
    struct store__params p = {0};
    struct store__id_ref *refs = NULL;
    char *detail = NULL;
    int64_t version = -1, t0 = ks_mono_us();
    bool *skip = NULL;
    int rc;

    BUG_ON(!s || !stream_id || !events || n == 0);
    if (expected_version < STORE_ANY)
        return KS_EINVAL;
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    evs = kproto_arena_alloc(&s->scratch, n * sizeof(*evs));
    skip = kproto_arena_calloc(&s->scratch, n, sizeof(*skip));
    refs = kproto_arena_alloc(&s->scratch, n * sizeof(*refs));
    if (!evs || !skip || !refs) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        evs[i] = events[i].event;
        if ((rc = store__validate(evs[i])) < 0)
            goto out;
        if (strcmp(evs[i]->stream_id, stream_id) != 0) {
            rc = KS_EINVAL;
            goto out;
        }
    }
    if (store__mark_repeats((const Ks__Event *const *)evs, n, refs, skip) != 0) {
        rc = KS_EINVAL;
        goto out;
    }
    if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
        goto out;
    if ((rc = store__arr_begin(&s->ids, STORE__OID_UUID, n)) < 0 ||
        (rc = store__arr_begin(&s->types, STORE__OID_TEXT, n)) < 0 ||
        (rc = store__arr_begin(&s->data, STORE__OID_BYTEA, n)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++)
        if ((rc = store__arr_put_uuid(&s->ids, evs[i]->event_id)) < 0 ||
            (rc = store__arr_put(&s->types, evs[i]->type,
                                 strlen(evs[i]->type))) < 0 ||
            (rc = store__put_packed_event(&s->data, evs[i])) < 0)
            goto out;
    store__p_text(&p, stream_id);
    store__p_i64(&p, expected_version);
    store__p_bin(&p, s->ids.p, s->ids.len);
    store__p_bin(&p, s->types.p, s->types.len);
    store__p_bin(&p, s->data.p, s->data.len);

    if (!PQenterPipelineMode(s->conn)) {
        rc = store__pg_error(s, NULL, NULL);
        goto out;
    }
    if (claim_agent)
        store__p_text(&p, claim_agent);
    rc = PQsendQueryPrepared(s->conn, claim_agent ? "ks_claim" : "ks_append",
                             p.n, p.val, p.len, p.fmt, 0)
             ? 0
             : store__pg_error(s, NULL, NULL);
    for (size_t i = 0; i < n && rc == 0; i++) {
        int r = store__send_project(s, evs[i], false);
        if (r < 0)
            rc = r;
    }
    store__send_commit(s);
    if (!PQpipelineSync(s->conn)) {
        int lost = store__pg_error(s, NULL, NULL);
        store__pipeline_end(s);
        s->broken = true; /* a pipeline without its sync */
        s->in_doubt = true; /* the sync may have gone out in part */
        rc = store__keep_sick(lost);
        goto out;
    }
    if (between && rc == 0) {
        /* Sent: the server works while the caller does. */
        PQflush(s->conn);
        between(ud);
    }
    {
        int frc = store__pipeline_finish(s, &version, &detail);
        if (rc == 0)
            rc = frc;
    }
    store__pipeline_end(s);
    if (rc == KS_EDUPLICATE) {
        if (detail) {
            version = strtoll(detail, NULL, 10);
        } else {
            rc = recheck_recorded(s, stream_id, &version);
            if (rc != KS_EDUPLICATE)
                goto out;
        }
        if (version_out)
            *version_out = version;
        goto out;
    }
    if (rc == 0 && version_out)
        *version_out = version;
    if (rc == 0 && !s->commit_in_pipeline)
        store__note_recorded(evs, n, skip, t0);
out:
    free(detail);
    kproto_arena_release(&s->scratch, mark);
    return rc;
}

/*
 * Fills the four parallel arrays of an append (event ids, streams, types,
 * packed events) with the events not marked in skip (skip NULL: all);
 * count is how many that is. Adds them to p as $1..$4.
 */
static int
put_event_arrays(struct store *s, const Ks__Event *const *events, size_t n,
                 const bool *skip, size_t count, struct store__params *p)
{
    int rc;

    if ((rc = store__arr_begin(&s->ids, STORE__OID_UUID, count)) < 0 ||
        (rc = store__arr_begin(&s->streams, STORE__OID_TEXT, count)) < 0 ||
        (rc = store__arr_begin(&s->types, STORE__OID_TEXT, count)) < 0 ||
        (rc = store__arr_begin(&s->data, STORE__OID_BYTEA, count)) < 0)
        return rc;
    for (size_t i = 0; i < n; i++) {
        const Ks__Event *ev = events[i];
        if (skip && skip[i])
            continue;
        if ((rc = store__arr_put_uuid(&s->ids, ev->event_id)) < 0 ||
            (rc = store__arr_put(&s->streams, ev->stream_id,
                                 strlen(ev->stream_id))) < 0 ||
            (rc = store__arr_put(&s->types, ev->type, strlen(ev->type))) <
                0 ||
            (rc = store__put_packed_event(&s->data, ev)) < 0)
            return rc;
    }
    store__p_bin(p, s->ids.p, s->ids.len);
    store__p_bin(p, s->streams.p, s->streams.len);
    store__p_bin(p, s->types.p, s->types.len);
    store__p_bin(p, s->data.p, s->data.len);
    return 0;
}

/*
 * The rest of an append pipeline whose first statement was sent with
 * result rc: one kscore_project() per event not skipped (only batch events
 * when batch_only), the sync, the results, leaving pipeline mode.
 */
static int
project_and_finish(struct store *s, const Ks__Event *const *events, size_t n,
                   const bool *skip, bool batch_only, int rc,
                   int64_t *first_out, char **detail_out)
{
    for (size_t i = 0; i < n && rc == 0; i++) {
        Ks__CommandStatus st;
        if (skip[i] || (batch_only && store__proj_kind(events[i], &st) !=
                                          STORE__PROJ_BATCH))
            continue;
        int r = store__send_project(s, events[i], false);
        if (r < 0)
            rc = r;
    }
    store__send_commit(s);
    if (!PQpipelineSync(s->conn)) {
        int lost = store__pg_error(s, NULL, NULL);
        store__pipeline_end(s);
        s->broken = true; /* a pipeline without its sync */
        s->in_doubt = true; /* the sync may have gone out in part */
        return store__keep_sick(lost);
    }
    int frc = store__pipeline_finish(s, first_out, detail_out);
    if (rc == 0)
        rc = frc;
    store__pipeline_end(s);
    return rc;
}

/*
 * The per-event path: kscore_append_many() (which skips what is recorded)
 * and one kscore_project() per event. Taken only when batch events depend
 * on the order of the others (store__fold_batch). *dups_out = the events
 * skipped, repeats included.
 */
static int
append_each(struct store *s, const Ks__Event *const *events, size_t n,
            const bool *skip, int64_t *dups_out)
{
    int rc = 0;

    /*
     * A concurrent writer can record one of these event_ids between the
     * function's check and its insert (unique violation): the retry then
     * sees it recorded and skips it.
     */
    for (int attempt = 0; attempt < 3; attempt++) {
        struct store__params p = {0};
        if ((rc = put_event_arrays(s, events, n, NULL, n, &p)) < 0)
            return rc;
        if (!PQenterPipelineMode(s->conn))
            return store__pg_error(s, NULL, NULL);
        rc = PQsendQueryPrepared(s->conn, "ks_append_many", p.n, p.val, p.len,
                                 p.fmt, 0)
                 ? 0
                 : store__pg_error(s, NULL, NULL);
        rc = project_and_finish(s, events, n, skip, false, rc, dups_out,
                                NULL);
        if (rc != KS_EDUPLICATE)
            break;
    }
    return rc == KS_EDUPLICATE ? KS_EPG : rc;
}

/*
 * One kscore_record_many() of the events not skipped, with the fold that
 * store__fold_batch() left in s->fold, and kscore_project() for their
 * batch events, in one pipeline. KS_EDUPLICATE: some were recorded,
 * *detail_out (malloc'd, may stay NULL) lists them (KS003).
 */
static int
record_many(struct store *s, const Ks__Event *const *events, size_t n,
            const bool *skip, size_t sent, char **detail_out)
{
    struct store__params p = {0};
    int rc;

    if ((rc = put_event_arrays(s, events, n, skip, sent, &p)) < 0)
        return rc;
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        store__p_bin(&p, s->fold[i].p, s->fold[i].len);

    if (!PQenterPipelineMode(s->conn))
        return store__pg_error(s, NULL, NULL);
    rc = PQsendQueryPrepared(s->conn, "ks_record_many", p.n, p.val, p.len,
                             p.fmt, 0)
             ? 0
             : store__pg_error(s, NULL, NULL);
    return project_and_finish(s, events, n, skip, true, rc, NULL,
                              detail_out);
}

int
store_append_many(struct store *s, const Ks__Event *const *events, size_t n,
                  size_t *dup_out)
{
    struct store__id_ref *refs = NULL;
    size_t dups = 0, sent = 0;
    bool *skip = NULL;
    int64_t t0 = ks_mono_us();
    int rc = 0;

    BUG_ON(!s || (n && !events));
    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    if (n == 0)
        goto done;
    skip = kproto_arena_calloc(&s->scratch, n, sizeof(*skip));
    refs = kproto_arena_alloc(&s->scratch, n * sizeof(*refs));
    if (!skip || !refs) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if ((rc = store__validate(events[i])) < 0)
            goto out;
    dups = store__mark_repeats(events, n, refs, skip);
    if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
        goto out;
    /*
     * The fold assumes every event it is given is new. If some were
     * recorded (a redelivery), the function refuses the whole call before
     * writing (KS003) and names them: fold again without them. A
     * concurrent first delivery racing past its check (a unique violation)
     * is found the same way on the next attempt.
     */
    for (int attempt = 0;; attempt++) {
        char *detail = NULL;
        if (attempt == 8) {
            rc = KS_EPG;
            goto out;
        }
        rc = store__fold_batch(s, events, n, skip, &sent);
        if (rc == 1) {
            int64_t skipped = 0;
            if ((rc = append_each(s, events, n, skip, &skipped)) < 0)
                goto out;
            dups = (size_t)skipped;
            break;
        }
        if (rc < 0)
            goto out;
        if (sent == 0)
            break;
        rc = record_many(s, events, n, skip, sent, &detail);
        if (rc == KS_EDUPLICATE && detail)
            dups += store__mark_recorded(refs, n, detail, skip);
        free(detail);
        if (rc != KS_EDUPLICATE)
            break;
    }
    if (rc < 0)
        goto out;
    if (!s->commit_in_pipeline)
        store__note_recorded(events, n, skip, t0);
done:
    if (dup_out)
        *dup_out = dups;
out:
    kproto_arena_release(&s->scratch, mark);
    return rc;
}

int
store__record_checked(struct store *s, const Ks__Event *const *events,
                      size_t n, const char *const *vstreams,
                      const int64_t *vexpected, size_t nv,
                      const struct store__assumed *assumed, size_t na,
                      char **detail_out)
{
    struct store__buf vs = {.cap = KS_MAX_MESSAGE_BYTES},
                      vv = {.cap = KS_MAX_MESSAGE_BYTES},
                      ac = {.cap = KS_MAX_MESSAGE_BYTES},
                      as = {.cap = KS_MAX_MESSAGE_BYTES},
                      aa = {.cap = KS_MAX_MESSAGE_BYTES},
                      an = {.cap = KS_MAX_MESSAGE_BYTES};
    struct store__params p = {0};
    bool *skip = NULL;
    size_t sent = 0;
    int rc;

    BUG_ON(!s || !events || n == 0);
    for (size_t i = 0; i < n; i++) {
        Ks__CommandStatus st;
        if ((rc = store__validate(events[i])) < 0)
            return rc;
        /* Batch events are projected one by one after the set-based part
         * (record_many): not this path's. */
        if (store__proj_kind(events[i], &st) == STORE__PROJ_BATCH)
            return 1;
    }
    if (!(skip = calloc(n, sizeof(*skip))))
        return -ENOMEM;
    if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
        goto out;
    rc = store__fold_batch(s, events, n, skip, &sent);
    if (rc != 0)
        goto out; /* 1: the caller takes the other path */
    if ((rc = put_event_arrays(s, events, n, NULL, n, &p)) < 0 ||
        (rc = store__arr_begin(&vs, STORE__OID_TEXT, nv)) < 0 ||
        (rc = store__arr_begin(&vv, STORE__OID_INT8, nv)) < 0)
        goto out;
    for (size_t i = 0; i < nv; i++)
        if ((rc = store__arr_put(&vs, vstreams[i], strlen(vstreams[i]))) < 0 ||
            (rc = store__arr_put_i64(&vv, vexpected[i])) < 0)
            goto out;
    if ((rc = store__arr_begin(&ac, STORE__OID_UUID, na)) < 0 ||
        (rc = store__arr_begin(&as, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&aa, STORE__OID_TEXT, na)) < 0 ||
        (rc = store__arr_begin(&an, STORE__OID_INT4, na)) < 0)
        goto out;
    for (size_t i = 0; i < na; i++) {
        if ((rc = store__arr_put_uuid(&ac, assumed[i].command_id)) < 0 ||
            (rc = store__arr_put(&as, assumed[i].status,
                                 strlen(assumed[i].status))) < 0 ||
            (rc = store__arr_put(&aa, assumed[i].agent_id,
                                 strlen(assumed[i].agent_id))) < 0 ||
            (rc = store__arr_put_i32(&an, (int32_t)assumed[i].attempt)) < 0)
            goto out;
    }
    store__p_bin(&p, vs.p, vs.len);
    store__p_bin(&p, vv.p, vv.len);
    store__p_bin(&p, ac.p, ac.len);
    store__p_bin(&p, as.p, as.len);
    store__p_bin(&p, aa.p, aa.len);
    store__p_bin(&p, an.p, an.len);
    for (int i = 0; i < STORE__FOLD_COLS; i++)
        store__p_bin(&p, s->fold[i].p, s->fold[i].len);
    /* One implicit transaction, committed at the pipeline's sync. */
    if (!PQenterPipelineMode(s->conn)) {
        rc = store__pg_error(s, NULL, NULL);
        goto out;
    }
    rc = PQsendQueryPrepared(s->conn, "ks_record_checked", p.n, p.val, p.len,
                             p.fmt, 0)
             ? 0
             : store__pg_error(s, NULL, NULL);
    if (!PQpipelineSync(s->conn)) {
        int lost = store__pg_error(s, NULL, NULL);
        store__pipeline_end(s);
        s->broken = true; /* a pipeline without its sync */
        s->in_doubt = true; /* the sync may have gone out in part */
        rc = store__keep_sick(lost);
        goto out;
    }
    {
        int frc = store__pipeline_finish(s, NULL, detail_out);
        if (rc == 0)
            rc = frc;
    }
    store__pipeline_end(s);
out:
    free(skip);
    store__buf_release(&vs);
    store__buf_release(&vv);
    store__buf_release(&ac);
    store__buf_release(&as);
    store__buf_release(&aa);
    store__buf_release(&an);
    return rc;
}
