/*
 * fold.c: the recorder's batch path, set-based. Instead of one
 * kscore_project() call per event (a plpgsql call and two to four
 * statements on commands, each rewriting the row and its indexes), the
 * events of one batch are grouped by command here, in input order, and
 * folded into one summary per command; kscore_record_many() (migrations.c)
 * then appends the events and writes each commands row once: an insert in
 * its final state when the batch holds its CommandRequested, else one
 * update. One statement, one round trip.
 *
 * The summary is what kscore_project() would do to the row over the
 * command's events, written so that it does not depend on the row's prior
 * state, which only the server knows (FOLD_EXPRS in migrations.c combines
 * the two):
 *   st, st_first, st_change  the last, the first effective status and
 *                            whether it ever changed between effective
 *                            events; effective = up to and including the
 *                            first terminal status of the batch (a row
 *                            already terminal ignores them all)
 *   att, agent               the last non-zero attempt, non-empty agent of
 *                            the effective status events
 *   disp, deliver            occurred_at of the last effective Dispatched,
 *                            the last non-zero deliver_by of those
 *   run, started_after       occurred_at of the last effective Running; the
 *                            first result.started_at after it
 *   started_any              the first result.started_at of the batch
 *   fin                      finished_at of the effective terminal event
 *   res...                   the first result of the batch
 *   last                     the last event applied (the row's version)
 * Events before a CommandRequested of the same command are dropped: either
 * the row did not exist (kscore_project() skips them) or it did, and the
 * insert fails the whole batch with KS_ECONFLICT either way.
 */
#include "store_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <uuid/uuid.h>

/* The summary arrays, in kscore_record_many()'s parameter order. */
enum fold_col {
    FC_ID, FC_LAST, FC_REQ, FC_AGENT0, FC_ARGV, FC_ARGV_LO, FC_ARGV_HI,
    FC_BATCH, FC_IDEM, FC_OPER, FC_REQ_AT, FC_REQ_DELIVER, FC_ST,
    FC_ST_FIRST, FC_ST_CHANGE, FC_ATT, FC_AGENT, FC_DISP, FC_DELIVER, FC_RUN,
    FC_STARTED_AFTER, FC_STARTED_ANY, FC_FIN, FC_RES, FC_EXIT, FC_SIGNAL,
    FC_TIMED_OUT, FC_STDOUT, FC_STDERR, FC_STDOUT_TOTAL, FC_STDERR_TOTAL,
    FC_STDOUT_TRUNC, FC_STDERR_TRUNC, FC_DURATION, FC_STAGE, FC_ERRNO,
    FC_N
};
_Static_assert(FC_N == STORE__FOLD_COLS, "store_int.h STORE__FOLD_COLS");

static const uint32_t col_oid[FC_N] = {
    [FC_ID] = STORE__OID_UUID,          [FC_LAST] = STORE__OID_INT4,
    [FC_REQ] = STORE__OID_BOOL,         [FC_AGENT0] = STORE__OID_TEXT,
    [FC_ARGV] = STORE__OID_TEXT,        [FC_ARGV_LO] = STORE__OID_INT4,
    [FC_ARGV_HI] = STORE__OID_INT4,     [FC_BATCH] = STORE__OID_TEXT,
    [FC_IDEM] = STORE__OID_TEXT,        [FC_OPER] = STORE__OID_TEXT,
    [FC_REQ_AT] = STORE__OID_INT8,      [FC_REQ_DELIVER] = STORE__OID_INT8,
    [FC_ST] = STORE__OID_TEXT,          [FC_ST_FIRST] = STORE__OID_TEXT,
    [FC_ST_CHANGE] = STORE__OID_BOOL,   [FC_ATT] = STORE__OID_INT4,
    [FC_AGENT] = STORE__OID_TEXT,       [FC_DISP] = STORE__OID_INT8,
    [FC_DELIVER] = STORE__OID_INT8,     [FC_RUN] = STORE__OID_INT8,
    [FC_STARTED_AFTER] = STORE__OID_INT8, [FC_STARTED_ANY] = STORE__OID_INT8,
    [FC_FIN] = STORE__OID_INT8,         [FC_RES] = STORE__OID_BYTEA,
    [FC_EXIT] = STORE__OID_INT4,        [FC_SIGNAL] = STORE__OID_INT4,
    [FC_TIMED_OUT] = STORE__OID_BOOL,   [FC_STDOUT] = STORE__OID_BYTEA,
    [FC_STDERR] = STORE__OID_BYTEA,     [FC_STDOUT_TOTAL] = STORE__OID_INT8,
    [FC_STDERR_TOTAL] = STORE__OID_INT8, [FC_STDOUT_TRUNC] = STORE__OID_BOOL,
    [FC_STDERR_TRUNC] = STORE__OID_BOOL, [FC_DURATION] = STORE__OID_INT8,
    [FC_STAGE] = STORE__OID_TEXT,       [FC_ERRNO] = STORE__OID_INT4,
};

struct fold_row {
    uint8_t key[16];
    const char *cid;
    int32_t last;                /* 1-based ordinal among the sent events */
    const Ks__Event *req;        /* its CommandRequested in this batch */
    Ks__CommandStatus st, st_first;
    bool st_change, closed;
    uint32_t att;
    const char *agent;
    bool disp_set, run_set;
    int64_t disp, deliver, run, started_after, started_any, fin;
    const Ks__CommandResult *res;
};

struct fold {
    struct fold_row *rows;
    size_t n, cap;
    int32_t *slot; /* open addressing: row index or -1 */
    size_t mask;
};

static uint64_t
key_hash(const uint8_t k[16])
{
    uint64_t h;
    memcpy(&h, k, sizeof(h)); /* v4 UUIDs: the bytes are random already */
    return h * 0x9e3779b97f4a7c15ull;
}

/* The row of key (the newest, if a command is requested twice) or NULL. */
static struct fold_row *
fold_find(struct fold *f, const uint8_t key[16], size_t *slot_out)
{
    size_t i = key_hash(key) & f->mask;

    while (f->slot[i] >= 0) {
        if (memcmp(f->rows[f->slot[i]].key, key, 16) == 0) {
            *slot_out = i;
            return &f->rows[f->slot[i]];
        }
        i = (i + 1) & f->mask;
    }
    *slot_out = i;
    return NULL;
}

static struct fold_row *
fold_add(struct fold *f, const uint8_t key[16], const char *cid, size_t slot)
{
    struct fold_row *r = &f->rows[f->n];

    BUG_ON(f->n >= f->cap);
    memset(r, 0, sizeof(*r));
    memcpy(r->key, key, 16);
    r->cid = cid;
    f->slot[slot] = (int32_t)f->n++;
    return r;
}

static int64_t
occurred_at(const Ks__Event *ev)
{
    if (ev->occurred_at_us)
        return ev->occurred_at_us;
    return ev->command ? ev->command->issued_at_us : 0;
}

/* Folds one command event (ordinal ord among the sent events) into f. */
static int
fold_event(struct fold *f, const Ks__Event *ev, int32_t ord)
{
    Ks__CommandStatus st = 0;
    enum store__proj_kind kind = store__proj_kind(ev, &st);
    const Ks__CommandResult *r = ev->result;
    const char *cid = store__command_id(ev);
    struct fold_row *row;
    uint8_t key[16];
    size_t slot;

    if (uuid_parse(cid, key) != 0)
        return KS_EINVAL;
    row = fold_find(f, key, &slot);
    if (kind == STORE__PROJ_REQUESTED) {
        /* A second one is a row of its own: its insert conflicts. */
        if (!row || row->req)
            row = fold_add(f, key, cid, slot);
        else
            memset(&row->st, 0,
                   sizeof(*row) - offsetof(struct fold_row, st));
        row->req = ev;
        row->last = ord;
        return 0;
    }
    if (!row)
        row = fold_add(f, key, cid, slot);
    row->last = ord;
    if (kind == STORE__PROJ_RESULT)
        st = store__result_status(r, st);
    else if (kind != STORE__PROJ_STATUS)
        st = 0;
    bool running_now = false;
    if (st && !row->closed) {
        if (!row->st_first)
            row->st_first = st;
        else if (st != row->st)
            row->st_change = true;
        row->st = st;
        if (ev->attempt)
            row->att = ev->attempt;
        if (ev->agent_id && *ev->agent_id)
            row->agent = ev->agent_id;
        if (st == KS__COMMAND_STATUS__DISPATCHED) {
            row->disp_set = true;
            row->disp = occurred_at(ev);
            if (ev->deliver_by_us)
                row->deliver = ev->deliver_by_us;
        }
        if (st == KS__COMMAND_STATUS__RUNNING) {
            row->run_set = true;
            row->run = occurred_at(ev);
            row->started_after = 0;
            running_now = true;
        }
        if (kproto_status_terminal(st)) {
            row->closed = true;
            row->fin = kind == STORE__PROJ_RESULT && r->finished_at_us
                           ? r->finished_at_us
                           : occurred_at(ev);
        }
    }
    if (kind == STORE__PROJ_RESULT) {
        if (r->started_at_us) {
            if (!row->started_any)
                row->started_any = r->started_at_us;
            if (row->run_set && !running_now && !row->started_after)
                row->started_after = r->started_at_us;
        }
        if (!row->res)
            row->res = r;
    }
    return 0;
}

/* ---- binary array elements (array_recv's format, see store_int.h) ---- */

/* 0 is "none": NULL. */
static int
put_i64_or_null(struct store__buf *b, int64_t v)
{
    return v ? store__arr_put_i64(b, v) : store__arr_put_null(b);
}

static int
put_bool(struct store__buf *b, bool v)
{
    uint8_t x = v;
    return store__arr_put(b, &x, 1);
}

/* NULL and "" are NULL. */
static int
put_text(struct store__buf *b, const char *s)
{
    return s && *s ? store__arr_put(b, s, strlen(s)) : store__arr_put_null(b);
}

static int
put_status(struct store__buf *b, Ks__CommandStatus st)
{
    return st ? put_text(b, kproto_status_name(st)) : store__arr_put_null(b);
}

static int
put_output(struct store__buf *b, const Ks__Output *o)
{
    if (!o)
        return store__arr_put_null(b);
    return store__arr_put(b, o->data.data, o->data.len);
}

/* The Requested columns of a row (NULLs for an update). */
static int
put_requested(struct store *s, const struct fold_row *row, int32_t *argv_n)
{
    struct store__buf *c = s->fold;
    const Ks__Event *ev = row->req;
    const Ks__Command *cmd = ev ? ev->command : NULL;
    const char *agent0 = NULL, *oper = NULL;
    int64_t deliver = 0;
    int32_t lo = 1;
    int rc;

    if (!ev) {
        for (int i = FC_AGENT0; i <= FC_REQ_DELIVER; i++)
            if (i != FC_ARGV && (rc = store__arr_put_null(&c[i])) < 0)
                return rc;
        return 0;
    }
    if (cmd && cmd->agent_id && *cmd->agent_id)
        agent0 = cmd->agent_id;
    else
        agent0 = ev->agent_id;
    if (ev->operator_ && *ev->operator_)
        oper = ev->operator_;
    else if (cmd)
        oper = cmd->operator_;
    if (ev->deliver_by_us)
        deliver = ev->deliver_by_us;
    else if (cmd && cmd->not_after_us)
        deliver = cmd->not_after_us;
    lo = *argv_n + 1;
    if (cmd && cmd->spec)
        for (size_t i = 0; i < cmd->spec->n_argv; i++) {
            const char *a = cmd->spec->argv[i];
            if ((rc = store__arr_put(&c[FC_ARGV], a, strlen(a))) < 0)
                return rc;
            ++*argv_n;
        }
    if ((rc = put_text(&c[FC_AGENT0], agent0)) < 0 ||
        (rc = store__arr_put_i32(&c[FC_ARGV_LO], lo)) < 0 ||
        (rc = store__arr_put_i32(&c[FC_ARGV_HI], *argv_n)) < 0 ||
        (rc = put_text(&c[FC_BATCH], store__batch_id(ev))) < 0 ||
        (rc = put_text(&c[FC_IDEM], ev->reason)) < 0 ||
        (rc = put_text(&c[FC_OPER], oper)) < 0 ||
        (rc = store__arr_put_i64(&c[FC_REQ_AT], occurred_at(ev))) < 0 ||
        (rc = put_i64_or_null(&c[FC_REQ_DELIVER], deliver)) < 0)
        return rc;
    return 0;
}

/* The first result's columns (NULLs without one). */
static int
put_result(struct store *s, const Ks__CommandResult *r)
{
    struct store__buf *c = s->fold;
    int rc;

    if (!r) {
        for (int i = FC_RES; i <= FC_ERRNO; i++)
            if ((rc = store__arr_put_null(&c[i])) < 0)
                return rc;
        return 0;
    }
    if ((rc = store__pack_result(&s->result, r)) < 0 ||
        (rc = store__arr_put(&c[FC_RES], s->result.p, s->result.len)) < 0 ||
        (rc = r->has_exit_code ? store__arr_put_i32(&c[FC_EXIT], r->exit_code)
                               : store__arr_put_null(&c[FC_EXIT])) < 0 ||
        (rc = store__arr_put_i32(&c[FC_SIGNAL], r->signal)) < 0 ||
        (rc = put_bool(&c[FC_TIMED_OUT], r->timed_out)) < 0 ||
        (rc = put_output(&c[FC_STDOUT], r->stdout)) < 0 ||
        (rc = put_output(&c[FC_STDERR], r->stderr)) < 0 ||
        (rc = r->stdout ? store__arr_put_i64(&c[FC_STDOUT_TOTAL],
                                  (int64_t)r->stdout->total_bytes)
                        : store__arr_put_null(&c[FC_STDOUT_TOTAL])) < 0 ||
        (rc = r->stderr ? store__arr_put_i64(&c[FC_STDERR_TOTAL],
                                  (int64_t)r->stderr->total_bytes)
                        : store__arr_put_null(&c[FC_STDERR_TOTAL])) < 0 ||
        (rc = r->stdout ? put_bool(&c[FC_STDOUT_TRUNC], r->stdout->truncated)
                        : store__arr_put_null(&c[FC_STDOUT_TRUNC])) < 0 ||
        (rc = r->stderr ? put_bool(&c[FC_STDERR_TRUNC], r->stderr->truncated)
                        : store__arr_put_null(&c[FC_STDERR_TRUNC])) < 0 ||
        (rc = store__arr_put_i64(&c[FC_DURATION], r->duration_us)) < 0 ||
        (rc = put_text(&c[FC_STAGE], r->start_stage)) < 0 ||
        (rc = store__arr_put_i32(&c[FC_ERRNO], r->start_errno)) < 0)
        return rc;
    return 0;
}

static int
put_row(struct store *s, const struct fold_row *row, int32_t *argv_n)
{
    struct store__buf *c = s->fold;
    int rc;

    if ((rc = store__arr_put_uuid(&c[FC_ID], row->cid)) < 0 ||
        (rc = store__arr_put_i32(&c[FC_LAST], row->last)) < 0 ||
        (rc = put_bool(&c[FC_REQ], row->req != NULL)) < 0 ||
        (rc = put_requested(s, row, argv_n)) < 0 ||
        (rc = put_status(&c[FC_ST], row->st)) < 0 ||
        (rc = put_status(&c[FC_ST_FIRST], row->st_first)) < 0 ||
        (rc = put_bool(&c[FC_ST_CHANGE], row->st_change)) < 0 ||
        (rc = store__arr_put_i32(&c[FC_ATT], (int32_t)row->att)) < 0 ||
        (rc = put_text(&c[FC_AGENT], row->agent)) < 0 ||
        (rc = row->disp_set ? store__arr_put_i64(&c[FC_DISP], row->disp)
                            : store__arr_put_null(&c[FC_DISP])) < 0 ||
        (rc = put_i64_or_null(&c[FC_DELIVER], row->deliver)) < 0 ||
        (rc = row->run_set ? store__arr_put_i64(&c[FC_RUN], row->run)
                           : store__arr_put_null(&c[FC_RUN])) < 0 ||
        (rc = put_i64_or_null(&c[FC_STARTED_AFTER], row->started_after)) <
            0 ||
        (rc = put_i64_or_null(&c[FC_STARTED_ANY], row->started_any)) < 0 ||
        (rc = row->closed ? store__arr_put_i64(&c[FC_FIN], row->fin)
                          : store__arr_put_null(&c[FC_FIN])) < 0 ||
        (rc = put_result(s, row->res)) < 0)
        return rc;
    return 0;
}

/*
 * A BatchCompleted / BatchCancelled is applied after the set-based part,
 * so it would find a batches row that a later event of the call creates
 * (a CommandRequested of that batch, a BatchRequested), where the event
 * order finds none. True if the call holds such a pair.
 */
static bool
batch_order_matters(const Ks__Event *const *events, size_t n,
                    const bool *skip)
{
    for (size_t i = 0; i < n; i++) {
        Ks__CommandStatus st;
        const char *bid;
        if (skip[i] ||
            store__proj_kind(events[i], &st) != STORE__PROJ_BATCH ||
            strcmp(events[i]->type, "BatchRequested") == 0)
            continue;
        bid = store__batch_id(events[i]);
        for (size_t j = i + 1; j < n; j++) {
            enum store__proj_kind k;
            const char *b2;
            if (skip[j])
                continue;
            k = store__proj_kind(events[j], &st);
            if (k != STORE__PROJ_REQUESTED && k != STORE__PROJ_BATCH)
                continue;
            if (k == STORE__PROJ_BATCH &&
                strcmp(events[j]->type, "BatchRequested") != 0)
                continue;
            b2 = store__batch_id(events[j]);
            if (b2 && strcmp(b2, bid) == 0)
                return true;
        }
    }
    return false;
}

int
store__fold_batch(struct store *s, const Ks__Event *const *events, size_t n,
                  const bool *skip, size_t *sent_out)
{
    struct fold f = {0};
    size_t sent = 0, slots = 16;
    int32_t argv_n = 0;
    int rc;

    struct kproto_arena_mark mark = kproto_arena_mark(&s->scratch);
    if (batch_order_matters(events, n, skip))
        return 1;
    while (slots < 2 * n)
        slots *= 2;
    f.cap = n;
    f.rows = kproto_arena_alloc(&s->scratch, n * sizeof(*f.rows));
    f.slot = kproto_arena_alloc(&s->scratch, slots * sizeof(*f.slot));
    if (!f.rows || !f.slot) {
        rc = -ENOMEM;
        goto out;
    }
    memset(f.slot, 0xff, slots * sizeof(*f.slot));
    f.mask = slots - 1;
    for (size_t i = 0; i < n; i++) {
        Ks__CommandStatus st;
        enum store__proj_kind kind;
        if (skip[i])
            continue;
        sent++;
        kind = store__proj_kind(events[i], &st);
        if (kind == STORE__PROJ_NONE || kind == STORE__PROJ_BATCH)
            continue;
        if ((rc = fold_event(&f, events[i], (int32_t)sent)) < 0)
            goto out;
    }
    for (int i = 0; i < FC_N; i++) {
        size_t len = i == FC_ARGV ? 0 : f.n;
        if ((rc = store__arr_begin(&s->fold[i], col_oid[i], len)) < 0)
            goto out;
    }
    for (size_t i = 0; i < f.n; i++)
        if ((rc = put_row(s, &f.rows[i], &argv_n)) < 0)
            goto out;
    /* The argv array's length is known only now (array header word 4). */
    {
        uint8_t *p = s->fold[FC_ARGV].p + 12;
        p[0] = (uint8_t)(argv_n >> 24);
        p[1] = (uint8_t)(argv_n >> 16);
        p[2] = (uint8_t)(argv_n >> 8);
        p[3] = (uint8_t)argv_n;
    }
    *sent_out = sent;
    rc = 0;
out:
    kproto_arena_release(&s->scratch, mark);
    return rc;
}
