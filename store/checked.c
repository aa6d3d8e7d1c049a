/*
 * checked.c: store_append_checked(), the append of events that someone
 * other than the broker reports (agents' results), each checked against
 * the record before it is written.
 *
 * One event (not a batch event), first in one round trip and no read
 * (append_assumed): its command is taken to be in the state the report
 * finds when all is well (Running, claimed by its agent at that attempt);
 * it is decided against that in C and written by the group writer's
 * statement (store__write_now: at the version the statement reads, only
 * if the commands row is in the assumed state in the same snapshot), with
 * its verdict: written, recorded before (a redelivery), or not so. A
 * report whose command was not so (a late or misaddressed report, one
 * about no command) costs nothing written and goes the locking way:
 *
 * One transaction, two round trips (checked_locked):
 *   1. BEGIN; lock the streams rows (in stream_id order, the order every
 *      append takes them, so no deadlock), then read each command's state;
 *      read which event_ids are recorded already.
 *   2. (C: the caller's check, then the state machine, per event, in
 *      order, each accepted event moving the state the next one sees)
 *      the append of what remains, rewritten where the verdict says so,
 *      with COMMIT in the same pipeline.
 * While the locks are held no other writer can move these commands, so
 * the verdicts are the truth at commit; the unique indexes of migration 3
 * back this up for any path that forgets. Events with batch events among
 * them go this way from the start.
 *
 * A batch (the recorder's): the same verdicts without the locks while
 * deciding, checked at the append by the streams' versions instead
 * (append_batch, through kscore_record_checked). The writer's statement
 * does the same for a batch (append_assumed takes n events) but cost
 * twice the server CPU per report for 100 reports (perf_store --reports:
 * 75 against 35 us), so a batch stays on the function.
 */
#include "store_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct cstate {
    char stream[8 + 37];
    struct store_command_state st;
    int64_t version; /* the batch path's read: the stream's, 0 if none */
};

static int
cmp_cstate(const void *a, const void *b)
{
    return strcmp(((const struct cstate *)a)->stream,
                  ((const struct cstate *)b)->stream);
}

static struct cstate *
find_state(struct cstate *v, size_t n, const char *stream)
{
    struct cstate key;
    snprintf(key.stream, sizeof(key.stream), "%s", stream);
    return bsearch(&key, v, n, sizeof(*v), cmp_cstate);
}

static Ks__CommandStatus
status_of(const char *name)
{
    for (int st = 1; st <= KS__COMMAND_STATUS__NOT_STARTED; st++)
        if (strcmp(kproto_status_name((Ks__CommandStatus)st), name) == 0)
            return (Ks__CommandStatus)st;
    return KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
}

/* "{a,b,c}": a text-format array literal of simple tokens (UUIDs and
 * command-<uuid> stream ids, checked by the caller: nothing to quote). */
static char *
array_literal(struct kproto_arena *ar, const char *const *items, size_t n)
{
    size_t len = 3;
    for (size_t i = 0; i < n; i++)
        len += strlen(items[i]) + 1;
    char *s = kproto_arena_alloc(ar, len), *p = s;
    if (!s)
        return NULL;
    *p++ = '{';
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(items[i]);
        if (i)
            *p++ = ',';
        memcpy(p, items[i], l);
        p += l;
    }
    *p++ = '}';
    *p = '\0';
    return s;
}

/* Reads pipeline results up to the sync: the lock rows into states (sorted
 * by stream), the recorded ids into recorded[] (flags per event). */
static int
read_locks(struct store *s, struct cstate *states, size_t nstates,
           const struct store__id_ref *refs, size_t n, bool *recorded)
{
    int rc = 0, query = 0;

    for (;;) {
        PGresult *res = PQgetResult(s->conn);
        if (!res) {
            if (PQstatus(s->conn) == CONNECTION_BAD) {
                if (rc == 0)
                    rc = store__pg_error(s, NULL, NULL);
                return rc;
            }
            query++;
            continue;
        }
        ExecStatusType est = PQresultStatus(res);
        if (est == PGRES_PIPELINE_SYNC) {
            PQclear(res);
            return rc;
        }
        if (est == PGRES_TUPLES_OK && query == 2) {
            for (int r = 0; r < PQntuples(res); r++) {
                struct cstate *c =
                    find_state(states, nstates, PQgetvalue(res, r, 0));
                if (!c || PQgetisnull(res, r, 1))
                    continue;
                c->st.exists = true;
                c->st.status = status_of(PQgetvalue(res, r, 1));
                snprintf(c->st.agent_id, sizeof(c->st.agent_id), "%s",
                         PQgetvalue(res, r, 2));
                c->st.attempt = (uint32_t)strtoul(PQgetvalue(res, r, 3),
                                                  NULL, 10);
            }
        } else if (est == PGRES_TUPLES_OK && query == 3) {
            for (int r = 0; r < PQntuples(res); r++) {
                const char *id = PQgetvalue(res, r, 0);
                /* refs is sorted by id (case-insensitive): find the first
                 * of this id; its repeats are marked anyway. */
                size_t lo = 0, hi = n;
                while (lo < hi) {
                    size_t mid = lo + (hi - lo) / 2;
                    if (strcasecmp(refs[mid].id, id) < 0)
                        lo = mid + 1;
                    else
                        hi = mid;
                }
                if (lo < n && strcasecmp(refs[lo].id, id) == 0)
                    recorded[refs[lo].idx] = true;
            }
        } else if (est != PGRES_COMMAND_OK && est != PGRES_TUPLES_OK &&
                   rc == 0) {
            rc = store__pg_error(s, res, NULL);
        }
        PQclear(res);
    }
}

/*
 * The verdicts, in order; each accepted event moves the state the next one
 * of the same command sees. Fills out[] with what to append (copies[i],
 * rewritten where the verdict says so) and returns how many; *dups_out:
 * the events recorded already or repeated.
 */
static size_t
decide(const Ks__Event *const *events, size_t n, store_check_fn check,
       void *ud, struct cstate *states, size_t nstates, const bool *recorded,
       const bool *repeat, Ks__Event *copies, char (*agent_streams)[8 + 130],
       char (*reasons)[256], enum store_step *verdicts,
       const Ks__Event **out, size_t *dups_out)
{
    size_t nout = 0, dups = 0;

    for (size_t i = 0; i < n; i++) {
        const Ks__Event *ev = events[i];
        struct cstate *c;
        const char *why = NULL;
        Ks__CommandStatus next;
        enum store_step v;

        if (recorded[i] || repeat[i]) {
            verdicts[i] = STORE_STEP_DUPLICATE;
            dups++;
            continue;
        }
        copies[i] = *ev;
        {
            char key[8 + 37];
            snprintf(key, sizeof(key), "command-%s", store__command_id(ev));
            c = find_state(states, nstates, key);
        }
        BUG_ON(!c);
        copies[i].stream_id = c->stream;
        v = STORE_STEP_APPLY;
        if (check) {
            int crc = check(&c->st, ev, &why, ud);
            if (crc == STORE_CHECK_DROP) {
                verdicts[i] = STORE_STEP_DROPPED; /* kept nowhere */
                continue;
            }
            if (crc != 0)
                v = STORE_STEP_ILLEGAL;
        }
        if (v == STORE_STEP_APPLY)
            v = store_command_step(&c->st, ev, &next, &why);
        verdicts[i] = v;
        if (v == STORE_STEP_APPLY && !c->st.exists) {
            /* An annotation about no command (an agent refusing a forged
             * message): kept on the reporter's own stream, so a forged id
             * never creates a command stream. */
            if (!ev->agent_id || !ev->agent_id[0]) {
                verdicts[i] = STORE_STEP_DUPLICATE; /* nowhere to keep it */
                continue;
            }
            snprintf(agent_streams[i], sizeof(agent_streams[i]),
                     "agent-%.128s", ev->agent_id);
            copies[i].stream_id = agent_streams[i];
        } else if (v == STORE_STEP_APPLY) {
            if (store_event_is_terminal(ev->type) ||
                strcmp(ev->type, "CommandStarted") == 0 ||
                strcmp(ev->type, "CommandDispatched") == 0)
                c->st.status = next;
        } else {
            /* Kept as an annotation: what was reported, and why it does
             * not count. */
            snprintf(reasons[i], sizeof(reasons[i]), "%s: %s%s%s",
                     ev->type, why ? why : "refused",
                     c->st.exists ? " (it is " : "",
                     c->st.exists ? kproto_status_name(c->st.status) : "");
            if (c->st.exists)
                strncat(reasons[i], ")",
                        sizeof(reasons[i]) - strlen(reasons[i]) - 1);
            copies[i].type = v == STORE_STEP_LATE ? "LateResult"
                                                  : "ReportRejected";
            copies[i].reason = reasons[i];
            if (!c->st.exists) {
                /* No such command: on the reporter's own stream, so a
                 * forged id cannot create a command stream. */
                if (!ev->agent_id || !ev->agent_id[0]) {
                    verdicts[i] = STORE_STEP_DUPLICATE; /* nothing to keep */
                    continue;
                }
                snprintf(agent_streams[i], sizeof(agent_streams[i]),
                         "agent-%.128s", ev->agent_id);
                copies[i].stream_id = agent_streams[i];
            }
        }
        out[nout++] = &copies[i];
    }
    *dups_out = dups;
    return nout;
}

static void
rollback(struct store *s)
{
    if (PQpipelineStatus(s->conn) != PQ_PIPELINE_OFF)
        PQexitPipelineMode(s->conn);
    if (PQstatus(s->conn) == CONNECTION_OK)
        PQclear(PQexec(s->conn, "ROLLBACK"));
}

/* True if one of the events projects onto a batch (the per-event path). */
static bool
any_batch_event(const Ks__Event *const *events, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        Ks__CommandStatus st;
        if (store__proj_kind(events[i], &st) == STORE__PROJ_BATCH)
            return true;
    }
    return false;
}

/*
 * The commands of events[0..n), each once, sorted by stream (the states
 * array, n entries of caller storage); returns how many, or KS_EINVAL (an
 * event without a UUID event id, command id or type).
 */
static int
command_states(const Ks__Event *const *events, size_t n, struct cstate *states)
{
    size_t nstates = 0, w = 0;

    for (size_t i = 0; i < n; i++) {
        const char *cid = store__command_id(events[i]);
        if (!ks_is_uuid(events[i]->event_id) || !events[i]->type ||
            !events[i]->type[0] || !cid || !ks_is_uuid(cid))
            return KS_EINVAL;
        /* The stream is the command's, derived from its id: never taken
         * from the message. */
        snprintf(states[nstates].stream, sizeof(states[nstates].stream),
                 "command-%s", cid);
        memset(&states[nstates].st, 0, sizeof(states[nstates].st));
        nstates++;
    }
    ks_sort(states, nstates, sizeof(*states), cmp_cstate);
    for (size_t i = 0; i < nstates; i++)
        if (w == 0 || strcmp(states[w - 1].stream, states[i].stream))
            states[w++] = states[i];
    return (int)w;
}

/* The index in states of the command of ev. */
static size_t
state_of(struct cstate *states, size_t nstates, const Ks__Event *ev)
{
    char key[8 + 37];
    snprintf(key, sizeof(key), "command-%s", store__command_id(ev));
    struct cstate *c = find_state(states, nstates, key);
    BUG_ON(!c);
    return (size_t)(c - states);
}

/* The batch path's read: each command's state and its stream's version,
 * in one plain SELECT (one snapshot: a state and its version belong
 * together). */
static int
read_states(struct store *s, struct cstate *states, size_t nstates,
            const char *streams_lit)
{
    const char *p1[1] = {streams_lit};
    PGresult *res = PQexecParams(
        s->conn,
        "SELECT st.stream_id, st.version, c.status, c.agent_id, c.attempt"
        " FROM streams st LEFT JOIN commands c"
        "   ON c.command_id = substr(st.stream_id, 9)::uuid"
        " WHERE st.stream_id = ANY ($1::text[])",
        1, NULL, p1, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        int rc = store__read_error(s, res);
        PQclear(res);
        return rc;
    }
    for (int r = 0; r < PQntuples(res); r++) {
        struct cstate *c = find_state(states, nstates, PQgetvalue(res, r, 0));
        if (!c)
            continue;
        c->version = strtoll(PQgetvalue(res, r, 1), NULL, 10);
        if (PQgetisnull(res, r, 2))
            continue;
        c->st.exists = true;
        c->st.status = status_of(PQgetvalue(res, r, 2));
        snprintf(c->st.agent_id, sizeof(c->st.agent_id), "%s",
                 PQgetvalue(res, r, 3));
        c->st.attempt = (uint32_t)strtoul(PQgetvalue(res, r, 4), NULL, 10);
    }
    PQclear(res);
    return 0;
}

/*
 * The batch path (n > 1): no transaction and no row lock while deciding.
 * First without reading (see the assumption below): one round trip. Else
 * round trip 1 reads each command's state and its stream's version in one
 * plain SELECT (one snapshot: a state and its version belong together);
 * round trip 2 appends what the verdicts say through kscore_record_checked()
 * in one implicit transaction, which bumps each command stream only at the
 * version read, under the row lock the bump takes: if one moved meanwhile
 * (KS001, or a second terminal event refused by events_one_terminal), read
 * and decide again. So the verdicts are the truth at commit, as under the
 * locks of the one-event path, without a lock pass over every stream row
 * before the append (and without the stale read a FOR UPDATE join gives
 * when it waits: the joined commands row is not re-read). Recorded event
 * ids are not looked up first either: the insert finds them (KS003, with
 * their ids), they become duplicates and the batch is decided again. Both
 * retries are rare: a concurrent writer on one of the commands, a
 * redelivery. Returns 1 if the events need the locking path after all.
 */
static int
append_batch(struct store *s, const Ks__Event *const *events, size_t n,
             store_check_fn check, void *ud, enum store_step *verdicts,
             struct cstate *states, size_t nstates, const char *streams_lit,
             const struct store__id_ref *refs, bool *recorded,
             const bool *repeat, Ks__Event *copies,
             char (*agent_streams)[8 + 130], char (*reasons)[256],
             const Ks__Event **out, size_t *dups_out, int64_t t0)
{
    const char **vstreams = calloc(nstates, sizeof(*vstreams));
    int64_t *vexp = calloc(nstates, sizeof(*vexp));
    struct store__assumed *assumed = calloc(nstates, sizeof(*assumed));
    bool assume = true;
    int rc = KS_ECONFLICT;

    if (!vstreams || !vexp || !assumed) {
        rc = -ENOMEM;
        goto out;
    }
    for (int attempt = 0; attempt < 8; attempt++) {
        size_t nout, nv = 0, na = 0, dups = 0;
        char *detail = NULL;

        for (size_t i = 0; i < nstates; i++) {
            memset(&states[i].st, 0, sizeof(states[i].st));
            states[i].version = 0;
        }
        if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
            goto out;
        /*
         * First, without reading: assume each command is in the state its
         * agent's first report in the batch finds when all is well
         * (Running, claimed by that agent at that attempt), decide against
         * that, and let kscore_record_checked() check it under the
         * streams' locks. One round trip instead of two; when a command is
         * not so (a late or a misaddressed report, a redelivery), read.
         */
        for (size_t i = 0; assume && i < n; i++) {
            const Ks__Event *ev = events[i];
            struct cstate *c;
            char key[8 + 37];
            if (recorded[i] || repeat[i])
                continue;
            snprintf(key, sizeof(key), "command-%s", store__command_id(ev));
            c = find_state(states, nstates, key);
            if (!c || !ev->agent_id || !ev->agent_id[0] ||
                strlen(ev->agent_id) >= sizeof(c->st.agent_id)) {
                assume = false;
                break;
            }
            if (c->st.exists)
                continue; /* assumed at its command's first report */
            c->st.exists = true;
            c->st.status = KS__COMMAND_STATUS__RUNNING;
            snprintf(c->st.agent_id, sizeof(c->st.agent_id), "%s",
                     ev->agent_id);
            c->st.attempt = ev->attempt;
            assumed[na].command_id = c->stream + 8;
            assumed[na].status = kproto_status_name(c->st.status);
            assumed[na].agent_id = c->st.agent_id;
            assumed[na].attempt = c->st.attempt;
            na++;
        }
        if (!assume) {
            na = 0;
            for (size_t i = 0; i < nstates; i++)
                memset(&states[i].st, 0, sizeof(states[i].st));
        }
        if (!assume && (rc = read_states(s, states, nstates, streams_lit)))
            goto out;

        nout = decide(events, n, check, ud, states, nstates, recorded, repeat,
                      copies, agent_streams, reasons, verdicts, out, &dups);
        /* Every command stream read is bumped at its version; one that
         * was absent gets none (as under the locks: no row to hold). */
        for (size_t i = 0; i < nstates; i++)
            if (states[i].version > 0) {
                vstreams[nv] = states[i].stream;
                vexp[nv++] = states[i].version;
            }
        if (nout == 0 && na == 0) {
            *dups_out = dups;
            rc = 0;
            goto out;
        }
        if (nout == 0) {
            assume = false; /* nothing to check it with: read */
            continue;
        }
        rc = store__record_checked(s, out, nout, vstreams, vexp, nv, assumed,
                                   na, &detail);
        assume = false; /* after a conflict: read */
        if (rc == 0) {
            store__note_recorded(out, nout, NULL, t0);
            *dups_out = dups;
        } else if (rc == KS_EDUPLICATE) {
            size_t m =
                detail ? store__mark_recorded(refs, n, detail, recorded) : 0;
            rc = m ? KS_ECONFLICT : KS_EPG; /* none of ours: give up */
        }
        free(detail);
        if (rc != KS_ECONFLICT)
            goto out;
    }
out:
    free(vstreams);
    free(vexp);
    free(assumed);
    return rc;
}

/*
 * The first way (the top of this file). Returns 0 with verdicts[i] set for
 * the events of the commands it settled and left[i] set for the others
 * (not repeats: the caller decides them under the locks), or a store error
 * (nothing of this call written). *dups_out: the settled events recorded
 * before or repeated in the call.
 */
static int
append_assumed(struct store *s, const Ks__Event *const *events, size_t n,
               store_check_fn check, void *ud, enum store_step *verdicts,
               bool *left, size_t *dups_out)
{
    struct kproto_arena *ar = &s->scratch;
    struct kproto_arena_mark mark = kproto_arena_mark(ar);
    struct cstate *states = kproto_arena_calloc(ar, n, sizeof(*states));
    struct store_command_state *assumed =
        kproto_arena_calloc(ar, n, sizeof(*assumed));
    bool *bad = kproto_arena_calloc(ar, n, sizeof(*bad));
    bool *repeat = kproto_arena_calloc(ar, n, sizeof(*repeat));
    bool *skip = kproto_arena_calloc(ar, n, sizeof(*skip));
    struct store__id_ref *refs = kproto_arena_calloc(ar, n, sizeof(*refs));
    Ks__Event *copies = kproto_arena_calloc(ar, n, sizeof(*copies));
    char (*agent_streams)[8 + 130] =
        kproto_arena_calloc(ar, n, sizeof(*agent_streams));
    char (*reasons)[256] = kproto_arena_calloc(ar, n, sizeof(*reasons));
    const Ks__Event **out = kproto_arena_calloc(ar, n, sizeof(*out));
    size_t *cnt = kproto_arena_calloc(ar, n + 1, sizeof(*cnt));
    size_t *req_of = kproto_arena_calloc(ar, n, sizeof(*req_of));
    struct store_event *se = kproto_arena_calloc(ar, n, sizeof(*se));
    struct store__wreq *reqs = kproto_arena_calloc(ar, n, sizeof(*reqs));
    size_t nstates, nout, nreq = 0, dd = 0, dups = 0;
    int rc;

    if (!states || !assumed || !bad || !repeat || !skip || !refs ||
        !copies || !agent_streams || !reasons || !out || !cnt || !req_of ||
        !se || !reqs) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = command_states(events, n, states)) < 0)
        goto out;
    nstates = (size_t)rc;
    rc = 0;
    store__mark_repeats(events, n, refs, repeat);
    /* Each command as its agent's first report here finds it when all is
     * well; a command that cannot be assumed so is decided under the
     * locks. */
    for (size_t i = 0; i < n; i++) {
        const Ks__Event *ev = events[i];
        size_t k;
        if (repeat[i])
            continue;
        k = state_of(states, nstates, ev);
        if (states[k].st.exists || bad[k])
            continue;
        if (!ev->agent_id || !ev->agent_id[0] ||
            strlen(ev->agent_id) >= sizeof(states[k].st.agent_id)) {
            bad[k] = true;
            continue;
        }
        states[k].st.exists = true;
        states[k].st.status = KS__COMMAND_STATUS__RUNNING;
        snprintf(states[k].st.agent_id, sizeof(states[k].st.agent_id), "%s",
                 ev->agent_id);
        states[k].st.attempt = ev->attempt;
        assumed[k] = states[k].st; /* decide() moves states[k].st on */
    }
    for (size_t i = 0; i < n; i++) {
        left[i] = !repeat[i] && bad[state_of(states, nstates, events[i])];
        skip[i] = repeat[i] || left[i];
    }
    nout = decide(events, n, check, ud, states, nstates, skip, repeat, copies,
                  agent_streams, reasons, verdicts, out, &dd);
    /* One append per command: its events in input order (every copy is on
     * its command's stream: the command exists, as assumed). */
    for (size_t o = 0; o < nout; o++)
        cnt[state_of(states, nstates, out[o]) + 1]++;
    for (size_t k = 0; k < nstates; k++)
        cnt[k + 1] += cnt[k]; /* cnt[k]: where command k's events start */
    for (size_t o = 0; o < nout; o++) {
        size_t k = state_of(states, nstates, out[o]);
        if (req_of[k] == 0) {
            struct store__wreq *r = &reqs[nreq++];
            r->wr.stream_id = states[k].stream;
            r->wr.expected_version = STORE_ANY; /* at_read instead */
            r->wr.events = &se[cnt[k]];
            r->at_read = true;
            r->assumed = &assumed[k];
            req_of[k] = nreq; /* 1-based */
        }
        se[cnt[k] + reqs[req_of[k] - 1].wr.n++].event = out[o];
    }
    if (nreq && (rc = store__write_now(s, reqs, nreq)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++) {
        struct store__wreq *r;
        size_t k;
        if (skip[i]) {
            dups += repeat[i];
            continue;
        }
        k = state_of(states, nstates, events[i]);
        r = req_of[k] ? &reqs[req_of[k] - 1] : NULL;
        if (!r || r->rc == 0) {
            /* Written as decided (or nothing of it to write: dropped). */
            continue;
        }
        if (r->rc == KS_EDUPLICATE && verdicts[i] != STORE_STEP_DROPPED) {
            verdicts[i] = STORE_STEP_DUPLICATE;
            dups++;
            continue;
        }
        /* Not as assumed (or partly recorded): the command's reports are
         * decided again, under the locks, against what it is. */
        left[i] = true;
    }
    *dups_out = dups;
out:
    kproto_arena_release(ar, mark);
    return rc;
}

int
store__checked_at_decide(const Ks__Event *ev,
                         const struct store_command_state *known,
                         int64_t version, store_check_fn check, void *ud,
                         Ks__Event *copy, char stream[8 + 37])
{
    const char *cid, *why = NULL;
    Ks__CommandStatus next;

    BUG_ON(!ev || !known);
    cid = store__command_id(ev);
    if (!ks_is_uuid(ev->event_id) || !cid || !ks_is_uuid(cid) ||
        !ev->type || !ev->type[0])
        return KS_EINVAL;
    if (version < 1 || !known->exists)
        return KS_ECONFLICT;
    if (check && check(known, ev, &why, ud) != 0)
        return KS_ECONFLICT; /* an annotation: the checked path words it */
    if (store_command_step(known, ev, &next, &why) != STORE_STEP_APPLY)
        return KS_ECONFLICT;
    snprintf(stream, 8 + 37, "command-%s", cid);
    /* The stream is the command's, derived from its id: never taken from
     * the message. */
    *copy = *ev;
    copy->stream_id = stream;
    return 0;
}

int
store_append_checked_at(struct store *s, const Ks__Event *ev,
                        const struct store_command_state *known,
                        int64_t version, store_check_fn check, void *ud)
{
    Ks__Event copy;
    char stream[8 + 37];
    int rc;

    BUG_ON(!s);
    if ((rc = store__checked_at_decide(ev, known, version, check, ud, &copy,
                                       stream)))
        return rc;
    struct store_event se = {&copy};
    return store_append(s, stream, version, &se, 1, NULL);
}

/* The locking way (the top of this file). */
static int
checked_locked(struct store *s, const Ks__Event *const *events, size_t n,
               store_check_fn check, void *ud, enum store_step *verdicts,
               size_t *dup_out)
{
    struct cstate *states = NULL;
    const char **streams = NULL, **ids = NULL;
    bool *recorded = NULL, *repeat = NULL;
    struct store__id_ref *refs = NULL;
    Ks__Event *copies = NULL;
    const Ks__Event **out = NULL;
    char *streams_lit = NULL, *ids_lit = NULL;
    char (*agent_streams)[8 + 130] = NULL;
    char (*reasons)[256] = NULL;
    size_t nstates = 0, nout = 0, dups = 0;
    int64_t t0 = ks_mono_us();
    int rc = 0;

    BUG_ON(!s || (n && (!events || !verdicts)));
    struct kproto_arena *ar = &s->scratch;
    struct kproto_arena_mark mark = kproto_arena_mark(ar);
    if (n == 0)
        goto done;
    states = kproto_arena_calloc(ar, n, sizeof(*states));
    streams = kproto_arena_calloc(ar, n, sizeof(*streams));
    ids = kproto_arena_calloc(ar, n, sizeof(*ids));
    recorded = kproto_arena_calloc(ar, n, sizeof(*recorded));
    repeat = kproto_arena_calloc(ar, n, sizeof(*repeat));
    refs = kproto_arena_calloc(ar, n, sizeof(*refs));
    copies = kproto_arena_calloc(ar, n, sizeof(*copies));
    out = kproto_arena_calloc(ar, n, sizeof(*out));
    agent_streams = kproto_arena_calloc(ar, n, sizeof(*agent_streams));
    reasons = kproto_arena_calloc(ar, n, sizeof(*reasons));
    if (!states || !streams || !ids || !recorded || !repeat || !refs ||
        !copies || !out || !agent_streams || !reasons) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = command_states(events, n, states)) < 0)
        goto out;
    nstates = (size_t)rc;
    rc = 0;
    for (size_t i = 0; i < n; i++)
        ids[i] = events[i]->event_id;
    /* Repeats within the call, in O(n log n); refs stays sorted by id for
     * matching the recorded ids below. */
    store__mark_repeats(events, n, refs, repeat);
    for (size_t i = 0; i < nstates; i++)
        streams[i] = states[i].stream;
    if (!(streams_lit = array_literal(ar, streams, nstates)) ||
        !(ids_lit = array_literal(ar, ids, n))) {
        rc = -ENOMEM;
        goto out;
    }
    if (n > 1 && !any_batch_event(events, n)) {
        rc = append_batch(s, events, n, check, ud, verdicts, states, nstates,
                          streams_lit, refs, recorded, repeat, copies,
                          agent_streams, reasons, out, &dups, t0);
        if (rc == 0)
            goto done;
        if (rc != 1)
            goto out;
        memset(recorded, 0, n * sizeof(*recorded));
        rc = 0;
    }

    /* Round trip 1: BEGIN, lock and read the states, the recorded ids. */
    if ((rc = store__ready(s)) < 0 || (rc = store__prepare(s, NULL)) < 0)
        goto out;
    if (!PQenterPipelineMode(s->conn)) {
        rc = store__pg_error(s, NULL, NULL);
        goto out;
    }
    {
        const char *p1[1] = {streams_lit}, *p2[1] = {ids_lit};
        if (!PQsendQueryParams(s->conn, "BEGIN", 0, NULL, NULL, NULL, NULL,
                               0) ||
            /* The locks first, the states in a statement of their own:
             * its snapshot is taken once the locks are held, so it sees
             * what a writer that held one committed. (Read in the same
             * statement, a row lock that waited re-reads the streams row
             * but not the joined commands row: a stale state.) */
            /* Events first, before the row locks give the transaction
             * its id (STORE__LOCKED). */
            !PQsendQueryParams(s->conn,
                               "SELECT 1" STORE__LOCKED ", streams"
                               " WHERE stream_id = ANY ($1::text[])"
                               " ORDER BY stream_id FOR UPDATE OF streams",
                               1, NULL, p1, NULL, NULL, 0) ||
            !PQsendQueryParams(
                s->conn,
                "SELECT st.stream_id, c.status, c.agent_id, c.attempt"
                " FROM streams st LEFT JOIN commands c"
                "   ON c.command_id = substr(st.stream_id, 9)::uuid"
                " WHERE st.stream_id = ANY ($1::text[])",
                1, NULL, p1, NULL, NULL, 0) ||
            !PQsendQueryParams(s->conn,
                               "SELECT event_id::text FROM events"
                               " WHERE event_id = ANY ($1::uuid[])",
                               1, NULL, p2, NULL, NULL, 0) ||
            !PQpipelineSync(s->conn)) {
            rc = store__pg_error(s, NULL, NULL);
            rollback(s);
            goto out;
        }
    }
    rc = read_locks(s, states, nstates, refs, n, recorded);
    if (PQpipelineStatus(s->conn) != PQ_PIPELINE_OFF)
        PQexitPipelineMode(s->conn);
    if (rc) {
        rollback(s);
        goto out;
    }

    nout = decide(events, n, check, ud, states, nstates, recorded, repeat,
                  copies, agent_streams, reasons, verdicts, out, &dups);

    /* Round trip 2: the append, COMMIT in its pipeline. */
    s->commit_in_pipeline = true;
    s->commit_sent = false;
    if (nout == 1) {
        struct store_event se = {out[0]};
        rc = store_append(s, out[0]->stream_id, STORE_ANY, &se, 1, NULL);
    } else if (nout > 1) {
        size_t d = 0;
        rc = store_append_many(s, out, nout, &d);
    }
    s->commit_in_pipeline = false;
    if (rc == 0 && !s->commit_sent)
        rc = store__exec(s, "COMMIT", NULL);
    if (rc)
        rollback(s);
    else if (nout)
        store__note_recorded(out, nout, NULL, t0);
done:
    if (rc == 0 && dup_out)
        *dup_out = dups;
out:
    kproto_arena_release(ar, mark);
    return rc;
}

int
store_append_checked(struct store *s, const Ks__Event *const *events,
                     size_t n, store_check_fn check, void *ud,
                     enum store_step *verdicts, size_t *dup_out)
{
    size_t dups = 0, nleft = 0, ldups = 0;
    int rc;

    BUG_ON(!s || (n && (!events || !verdicts)));
    if (n == 0) {
        if (dup_out)
            *dup_out = 0;
        return 0;
    }
    /* A batch: append_batch's one set-based function call costs half the
     * server CPU per report of the writer's statement for 100 reports
     * (perf_store --reports, issue 23); one report alone is cheaper this
     * way (a quarter less, one round trip instead of two). */
    if (n > 1 || any_batch_event(events, n))
        return checked_locked(s, events, n, check, ud, verdicts, dup_out);
    struct kproto_arena *ar = &s->scratch;
    struct kproto_arena_mark mark = kproto_arena_mark(ar);
    bool *left = kproto_arena_calloc(ar, n, sizeof(*left));
    const Ks__Event **sub = kproto_arena_calloc(ar, n, sizeof(*sub));
    enum store_step *subv = kproto_arena_calloc(ar, n, sizeof(*subv));
    if (!left || !sub || !subv) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = append_assumed(s, events, n, check, ud, verdicts, left,
                             &dups)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++)
        if (left[i])
            sub[nleft++] = events[i];
    if (nleft) {
        /* What the first way wrote stays written: a failure here leaves
         * those events recorded, and a retry of the call finds them so. */
        if ((rc = checked_locked(s, sub, nleft, check, ud, subv, &ldups)) < 0)
            goto out;
        for (size_t i = 0, j = 0; i < n; i++)
            if (left[i])
                verdicts[i] = subv[j++];
        dups += ldups;
    }
    if (dup_out)
        *dup_out = dups;
out:
    kproto_arena_release(ar, mark);
    return rc;
}
