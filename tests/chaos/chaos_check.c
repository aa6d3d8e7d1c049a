/*
 * chaos_check: the record's invariants, checked from what really happened
 * (the side-effect files the commands wrote) against what was recorded (the
 * events table, read straight with libpq, and the commands projection).
 *
 *  I1 each accepted command runs at most once (side-effect lines; and at
 *     most one CommandStarted, the claim fence);
 *  I2 each ends in exactly one terminal event, the projection (and
 *     `kscore get`, on a sample) agrees with it, and it tells the truth
 *     (Completed means it ran, Undeliverable/NotStarted/StartFailed mean it
 *     did not);
 *  I3 none is lost: terminal within deliver_within + timeout + grace + the
 *     heartbeat deadline (10 s) of its acceptance (+ CHAOS_SLACK_MS);
 *  I4 every batch ends, once, with counts equal to its targets' states;
 *  I5 each reader saw every event once, in the log's order (tx_id,
 *     global_pos);
 *  I6 after each restart the system served a fresh exec within 10 s.
 */
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <libpq-fe.h>

#include "chaos.h"

#define SHOW_PER_INVARIANT 12

struct cmd {
    char id[37];
    bool in_table, accepted, has_req;
    int batch; /* 1 + index into r->batches, 0 if none */
    char proj[24];
    int runs;
    char pids[96];
    int started;
    int nterm;
    char first[24]; /* status the first terminal event records */
    char terms[400];
    int64_t term_us, req_us, budget_us;
};

struct cmds {
    struct cmd *v;
    size_t n, cap;
    struct ks_map by_id;
};

static struct cmd *
cmd_get(struct cmds *cs, const char *id)
{
    struct cmd *c;
    void *x = ks_map_get(&cs->by_id, id);
    if (x)
        return &cs->v[(size_t)(uintptr_t)x - 1];
    if (cs->n == cs->cap) {
        size_t nc = cs->cap ? cs->cap * 2 : 1024;
        struct cmd *p = realloc(cs->v, nc * sizeof(*p));
        if (!p)
            abort();
        cs->v = p;
        cs->cap = nc;
    }
    c = &cs->v[cs->n++];
    memset(c, 0, sizeof(*c));
    snprintf(c->id, sizeof(c->id), "%s", id);
    ks_map_put(&cs->by_id, id, (void *)(uintptr_t)cs->n);
    return c;
}

/* ---- violations ------------------------------------------------------------ */

static void
viol(struct chaos_run *r, int inv, const char *fmt, ...)
{
    va_list ap;
    if (++r->violations[inv] > SHOW_PER_INVARIANT)
        return;
    if (inv == 0)
        printf("  VIOLATION S: "); /* the scenario's own check */
    else
        printf("  VIOLATION I%d: ", inv);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

static void
viol_tail(struct chaos_run *r)
{
    for (int i = 1; i <= 6; i++)
        if (r->violations[i] > SHOW_PER_INVARIANT)
            printf("  VIOLATION I%d: ... and %u more like these\n", i,
                   r->violations[i] - SHOW_PER_INVARIANT);
}

/* ---- reading the record ------------------------------------------------------ */

static PGresult *
query(PGconn *pg, const char *sql, bool binary)
{
    PGresult *res = PQexecParams(pg, sql, 0, NULL, NULL, NULL, NULL,
                                 binary ? 1 : 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(stderr, "chaos: %s: %s", sql, PQerrorMessage(pg));
        PQclear(res);
        return NULL;
    }
    return res;
}

static Ks__Event *
unpack_event(PGresult *res, int row, int col)
{
    return ks__event__unpack(NULL, (size_t)PQgetlength(res, row, col),
                             (const uint8_t *)PQgetvalue(res, row, col));
}

static const char *
terminal_status(const char *type, const Ks__Event *ev)
{
    if (strcmp(type, "CommandCompleted") == 0)
        return ev && ev->result ? kproto_status_name(ev->result->status)
                                : "Completed(?)";
    if (strcmp(type, "CommandStartFailed") == 0)
        return "StartFailed";
    if (strcmp(type, "CommandUndeliverable") == 0)
        return "Undeliverable";
    if (strcmp(type, "CommandLost") == 0)
        return "Lost";
    if (strcmp(type, "CommandCancelled") == 0)
        return "Cancelled";
    if (strcmp(type, "CommandNotStarted") == 0)
        return "NotStarted";
    return NULL;
}

static bool
status_terminal(const char *s)
{
    static const char *const t[] = {"Succeeded", "Failed",  "TimedOut",
                                    "StartFailed", "Cancelled",
                                    "Undeliverable", "Lost", "NotStarted"};
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        if (strcmp(s, t[i]) == 0)
            return true;
    return false;
}

static int64_t
budget_of(const Ks__Command *c)
{
    int64_t deliver = c->not_after_us > c->issued_at_us
                          ? c->not_after_us - c->issued_at_us
                          : 0;
    uint64_t t = c->spec ? c->spec->timeout_ms : 0;
    uint64_t g = c->spec && c->spec->grace_ms ? c->spec->grace_ms
                                              : CHAOS_DEFAULT_GRACE_MS;
    return deliver + (int64_t)(t + g + CHAOS_HEARTBEAT_DEADLINE_MS +
                               CHAOS_SLACK_MS) *
                         1000;
}

static void
read_side(struct chaos_run *r, struct cmds *cs)
{
    DIR *d = opendir(r->side);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char path[PATH_MAX + 300], line[64];
        if (!ks_is_uuid(de->d_name))
            continue;
        struct cmd *c = cmd_get(cs, de->d_name);
        snprintf(path, sizeof(path), "%s/%s", r->side, de->d_name);
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof(line), f)) {
            line[strcspn(line, "\n")] = '\0';
            size_t l = strlen(c->pids);
            snprintf(c->pids + l, sizeof(c->pids) - l, "%s%s",
                     c->runs ? "," : "", line);
            c->runs++;
        }
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
}

/* ---- I4: batches --------------------------------------------------------------- */

struct bstate {
    Ks__BatchSpec *spec; /* from BatchRequested (owned by ev) */
    Ks__Event *req_ev;
    int64_t req_us;
    int nend;
    char end_types[96];
    Ks__BatchCounts end_counts;
    bool has_end_counts;
};

static void
check_batches(struct chaos_run *r, PGconn *pg, struct cmds *cs)
{
    if (r->nbatches == 0)
        return;
    PGresult *ev = query(pg,
                         "SELECT stream_id, type, ((extract(epoch FROM "
                         "recorded_at) * 1000000)::bigint)::text, data "
                         "FROM events WHERE stream_id LIKE 'batch-%' "
                         "ORDER BY global_pos",
                         true);
    PGresult *bp = query(pg,
                         "SELECT batch_id, status, total, succeeded, failed, "
                         "cancelled FROM batches",
                         false);
    struct bstate bs[CHAOS_MAX_BATCHES];
    memset(bs, 0, sizeof(bs));
    for (int i = 0; ev && i < PQntuples(ev); i++) {
        const char *stream = PQgetvalue(ev, i, 0), *type = PQgetvalue(ev, i, 1);
        for (unsigned b = 0; b < r->nbatches; b++) {
            if (strcmp(stream, r->batches[b].id) != 0)
                continue;
            if (strcmp(type, "BatchRequested") == 0 && !bs[b].req_ev) {
                bs[b].req_ev = unpack_event(ev, i, 3);
                bs[b].spec = bs[b].req_ev ? bs[b].req_ev->batch : NULL;
                bs[b].req_us = atoll(PQgetvalue(ev, i, 2));
            } else if (strcmp(type, "BatchCompleted") == 0 ||
                       strcmp(type, "BatchCancelled") == 0) {
                Ks__Event *e = unpack_event(ev, i, 3);
                size_t l = strlen(bs[b].end_types);
                snprintf(bs[b].end_types + l, sizeof(bs[b].end_types) - l,
                         "%s%s", bs[b].nend ? "," : "", type);
                if (bs[b].nend == 0 && e && e->batch_counts) {
                    bs[b].end_counts = *e->batch_counts;
                    bs[b].has_end_counts = true;
                }
                bs[b].nend++;
                if (e)
                    ks__event__free_unpacked(e, NULL);
            }
        }
    }
    for (unsigned b = 0; b < r->nbatches; b++) {
        const char *bid = r->batches[b].id;
        struct bstate *s = &bs[b];
        if (!s->spec) {
            viol(r, 4, "batch %s accepted but no BatchRequested recorded",
                 bid);
            continue;
        }
        unsigned ok = 0, bad = 0, cn = 0, open = 0, never = 0;
        for (size_t t = 0; t < s->spec->n_command_ids; t++) {
            struct cmd *c = cmd_get(cs, s->spec->command_ids[t]);
            c->batch = (int)b + 1;
            c->accepted = true;
            if (!c->has_req) {
                /* never dispatched: judged by the batch's deadline */
                unsigned rounds = (r->batches[b].targets + r->batches[b].conc -
                                   1) / (r->batches[b].conc ? r->batches[b].conc : 1);
                c->req_us = s->req_us;
                c->budget_us = (int64_t)rounds *
                               (int64_t)(r->deliver_ms + r->timeout_ms +
                                         (r->grace_ms ? r->grace_ms
                                                      : CHAOS_DEFAULT_GRACE_MS) +
                                         CHAOS_HEARTBEAT_DEADLINE_MS +
                                         CHAOS_SLACK_MS) *
                               1000;
                never++;
            }
            const char *st = c->in_table ? c->proj : "";
            if (strcmp(st, "Succeeded") == 0)
                ok++;
            else if (strcmp(st, "Cancelled") == 0)
                cn++;
            else if (status_terminal(st))
                bad++;
            else
                open++;
        }
        if (s->nend == 0)
            viol(r, 4,
                 "batch %s never ended: %zu targets, %u succeeded, %u "
                 "failed, %u cancelled, %u not terminal (%u never "
                 "dispatched)",
                 bid, s->spec->n_command_ids, ok, bad, cn, open, never);
        else if (s->nend > 1)
            viol(r, 4, "batch %s ended %d times (%s)", bid, s->nend,
                 s->end_types);
        else if (open)
            viol(r, 4, "batch %s ended with %u targets not terminal", bid,
                 open);
        for (int i = 0; bp && i < PQntuples(bp); i++) {
            if (strcmp(PQgetvalue(bp, i, 0), bid) != 0)
                continue;
            const char *pst = PQgetvalue(bp, i, 1);
            unsigned pok = (unsigned)atoi(PQgetvalue(bp, i, 3));
            unsigned pbad = (unsigned)atoi(PQgetvalue(bp, i, 4));
            unsigned pcn = (unsigned)atoi(PQgetvalue(bp, i, 5));
            if (s->nend && strcmp(pst, "Running") == 0)
                viol(r, 4, "batch %s ended but its projection says Running",
                     bid);
            if (pok != ok || pbad != bad || pcn != cn)
                viol(r, 4,
                     "batch %s counts %u/%u/%u (succeeded/failed/cancelled) "
                     "but its targets are %u/%u/%u",
                     bid, pok, pbad, pcn, ok, bad, cn);
        }
        if (s->has_end_counts) {
            const Ks__BatchCounts *e = &s->end_counts;
            /* BatchCounts.failed is only Failed; every other end but
             * Succeeded and Cancelled (TimedOut, killed, Undeliverable,
             * Lost, NotStarted) is in its own count, and all of them in
             * errors. */
            if (e->total != s->spec->n_command_ids || e->succeeded != ok ||
                e->errors + e->cancelled != bad + cn)
                viol(r, 4,
                     "batch %s recorded end counts total %u, %u succeeded, "
                     "%u errors+cancelled; its targets: %zu, %u, %u",
                     bid, e->total, e->succeeded, e->errors + e->cancelled,
                     s->spec->n_command_ids, ok, bad + cn);
        }
    }
    for (unsigned b = 0; b < r->nbatches; b++)
        if (bs[b].req_ev)
            ks__event__free_unpacked(bs[b].req_ev, NULL);
    PQclear(ev);
    PQclear(bp);
}

/* ---- I5: readers ------------------------------------------------------------------ */

/* The first place a reader left the log's order, for the post-mortem:
 * what it read (global_pos:tx_id) and what the log holds there. */
static void
dump_step(const struct chaos_reader *rd, size_t i, PGresult *log, size_t j,
          size_t total)
{
    printf("    reader %s read:", rd->name);
    for (size_t k = i > 4 ? i - 4 : 0; k < rd->n && k < i + 5; k++)
        printf(" %s%lld:%llu", k == i ? "*" : "", (long long)rd->pos[k],
               (unsigned long long)rd->tx[k]);
    printf("\n    the log holds:");
    for (size_t k = j > 2 ? j - 2 : 0; k < total && k < j + 7; k++)
        printf(" %s%s:%s", k == j ? "*" : "", PQgetvalue(log, (int)k, 0),
               PQgetvalue(log, (int)k, 3));
    printf("\n");
}

static void
check_readers(struct chaos_run *r, PGconn *pg, char *line, size_t len)
{
    PGresult *res = query(pg,
                          "SELECT global_pos, stream_id, type, tx_id::text AS tx FROM events "
                          "ORDER BY tx_id, global_pos",
                          false);
    size_t total = res ? (size_t)PQntuples(res) : 0, off = 0;
    line[0] = '\0';
    for (int k = 0; res && k < 2; k++) {
        struct chaos_reader *rd = &r->readers[k];
        size_t n = rd->n, missing = 0, dup = 0, order = 0;
        /* Every event once, in this order: the reader's sequence is a
         * prefix of the log's (events after it stopped may follow). */
        size_t i = 0, j = 0;
        struct ks_map seen = KS_MAP_INIT;
        for (; i < n; i++) {
            char key[32];
            snprintf(key, sizeof(key), "%lld", (long long)rd->pos[i]);
            if (ks_map_get(&seen, key)) {
                if (dup++ < 3)
                    viol(r, 5, "reader %s saw event %lld twice", rd->name,
                         (long long)rd->pos[i]);
                continue;
            }
            ks_map_put(&seen, key, (void *)1);
            if (j < total && atoll(PQgetvalue(res, (int)j, 0)) == rd->pos[i]) {
                j++;
                continue;
            }
            /* Out of step: the log's next one(s) were skipped, or this one
             * came early. */
            if (missing + order == 0)
                dump_step(rd, i, res, j, total);
            size_t f = j;
            while (f < total && atoll(PQgetvalue(res, (int)f, 0)) != rd->pos[i])
                f++;
            if (f < total) {
                for (size_t m = j; m < f; m++)
                    if (missing++ < 3)
                        viol(r, 5,
                             "reader %s skipped event %s (%s %s), saw %lld "
                             "after it",
                             rd->name, PQgetvalue(res, (int)m, 0),
                             PQgetvalue(res, (int)m, 1),
                             PQgetvalue(res, (int)m, 2),
                             (long long)rd->pos[i]);
                j = f + 1;
            } else if (order++ < 3) {
                viol(r, 5, "reader %s saw event %lld out of the log's order",
                     rd->name, (long long)rd->pos[i]);
            }
        }
        ks_map_clear(&seen);
        if (j < total) {
            viol(r, 5, "reader %s stopped at %zu of %zu events (%ld read "
                 "errors)",
                 rd->name, j, total, (long)rd->errors);
            missing += total - j;
        }
        off += (size_t)snprintf(line + off, len - off,
                                "%s%s %zu/%zu%s%s", k ? ", " : "", rd->name,
                                n - dup, total,
                                missing || dup || order ? " BROKEN" : " ok",
                                rd->errors ? "" : "");
        if (rd->errors && off < len)
            off += (size_t)snprintf(line + off, len - off,
                                    " (%ld retried reads)", (long)rd->errors);
        /* count violations beyond the shown ones */
        if (missing > 3)
            r->violations[5] += (unsigned)(missing - 3);
        if (dup > 3)
            r->violations[5] += (unsigned)(dup - 3);
    }
    PQclear(res);
}

/* ---- the table ---------------------------------------------------------------------- */

struct tally {
    long submitted, accepted, recorded, ran[3], lost, twice, open;
    long by_status[12];
};

static const char *const status_names[] = {
    "Succeeded", "Failed",    "TimedOut", "StartFailed", "Cancelled",
    "Undeliverable", "Lost",  "NotStarted", NULL};

static void
kscore_get_sample(struct chaos_run *r, struct cmds *cs)
{
    /* `kscore get` reads the projection through the broker: a few
     * commands, the first with a terminal event. */
    int done = 0;
    for (size_t i = 0; i < cs->n && done < 3; i++) {
        struct cmd *c = &cs->v[i];
        if (!c->nterm)
            continue;
        struct fixture_out o;
        const char *args[] = {"get", c->id, "--json", NULL};
        if (fixture_kscore(&r->st, args, &o) != 0)
            continue;
        done++;
        json_t *j = json_loads(o.out, JSON_DISABLE_EOF_CHECK, NULL);
        const char *st = j ? json_string_value(json_object_get(j, "status"))
                           : NULL;
        if (o.status != 0 || !st)
            viol(r, 2, "kscore get %s failed (exit %d): %.200s", c->id,
                 o.status, o.err);
        else if (strcmp(st, c->first) != 0)
            viol(r, 2, "kscore get %s says %s, its terminal event %s", c->id,
                 st, c->first);
        json_decref(j);
        fixture_out_release(&o);
    }
}

/* The longest stretch without a new terminal event of a batch target,
 * from the fault (r->fault_us) to the last such event (after), and before
 * the fault (before), from the events' recorded_at (the database's clock;
 * the same host's). A gap that starts at the fault counts from the fault. */
static void
progress_gap(struct chaos_run *r, PGconn *pg)
{
    char sql[1400];
    PGresult *res;
    double fault = (double)r->fault_us / 1e6;

    r->gap_s = r->gap_before_s = -1;
    if (!r->fault_us || !r->nbatches)
        return;
    snprintf(sql, sizeof(sql),
             "WITH t AS (SELECT extract(epoch FROM e.recorded_at)::float8 AS "
             "s FROM events e JOIN batch_targets b ON e.stream_id = "
             "'command-' || b.command_id WHERE e.type IN "
             "('CommandCompleted','CommandStartFailed','CommandUndeliverable',"
             "'CommandLost','CommandCancelled','CommandNotStarted')), "
             "w AS (SELECT s, lag(s) OVER (ORDER BY s) AS p FROM t) "
             "SELECT coalesce(max(s - greatest(coalesce(p, %.6f), %.6f)) "
             "FILTER (WHERE s > %.6f), -1), coalesce(max(s - p) FILTER "
             "(WHERE s <= %.6f), -1) FROM w",
             fault, fault, fault, fault);
    res = PQexec(pg, sql);
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1) {
        r->gap_s = atof(PQgetvalue(res, 0, 0));
        r->gap_before_s = atof(PQgetvalue(res, 0, 1));
    } else {
        fprintf(stderr, "chaos: progress gap: %s", PQerrorMessage(pg));
    }
    PQclear(res);
}

int
chaos_check(struct chaos_run *r)
{
    struct cmds cs = {0};
    struct tally t = {0};
    char readers_line[512] = "";
    PGconn *pg = PQconnectdb(r->st.pg.conninfo);

    printf("  -- checks\n");
    if (PQstatus(pg) != CONNECTION_OK) {
        viol(r, 6, "PostgreSQL unreachable at the end: %s",
             PQerrorMessage(pg));
        PQfinish(pg);
        pg = NULL;
    }

    /* What the projection says. */
    PGresult *res = pg ? query(pg, "SELECT command_id::text, status FROM "
                                   "commands",
                               false)
                       : NULL;
    for (int i = 0; res && i < PQntuples(res); i++) {
        struct cmd *c = cmd_get(&cs, PQgetvalue(res, i, 0));
        c->in_table = true;
        snprintf(c->proj, sizeof(c->proj), "%s", PQgetvalue(res, i, 1));
    }
    PQclear(res);

    /* What the events say. */
    res = pg ? query(pg,
                     "SELECT stream_id, type, ((extract(epoch FROM "
                     "recorded_at) * 1000000)::bigint)::text, data FROM "
                     "events WHERE stream_id LIKE 'command-%' AND type IN "
                     "('CommandRequested','CommandStarted','CommandCompleted',"
                     "'CommandStartFailed','CommandUndeliverable',"
                     "'CommandLost','CommandCancelled','CommandNotStarted') "
                     "ORDER BY global_pos",
                     true)
             : NULL;
    for (int i = 0; res && i < PQntuples(res); i++) {
        const char *type = PQgetvalue(res, i, 1);
        int64_t at = atoll(PQgetvalue(res, i, 2));
        struct cmd *c = cmd_get(&cs, PQgetvalue(res, i, 0) + 8);
        if (strcmp(type, "CommandRequested") == 0) {
            Ks__Event *ev = unpack_event(res, i, 3);
            if (!c->has_req) {
                c->has_req = true;
                c->req_us = at;
                c->budget_us = ev && ev->command ? budget_of(ev->command) : 0;
            }
            if (ev)
                ks__event__free_unpacked(ev, NULL);
        } else if (strcmp(type, "CommandStarted") == 0) {
            c->started++;
        } else {
            Ks__Event *ev = unpack_event(res, i, 3);
            const char *st = terminal_status(type, ev);
            size_t l = strlen(c->terms);
            const char *why = ev && ev->reason[0] ? ev->reason
                              : ev && ev->result && ev->result->reason[0]
                                  ? ev->result->reason
                                  : "";
            snprintf(c->terms + l, sizeof(c->terms) - l, "%s%s(%s%s%.60s)",
                     c->nterm ? ", " : "", type + 7, st, why[0] ? ": " : "",
                     why);
            if (c->nterm++ == 0) {
                snprintf(c->first, sizeof(c->first), "%s", st);
                c->term_us = at;
            }
            if (ev)
                ks__event__free_unpacked(ev, NULL);
        }
    }
    PQclear(res);

    /* What the client was told, and what really ran. */
    for (size_t i = 0; i < r->nsubs; i++)
        if (r->subs[i].id[0])
            cmd_get(&cs, r->subs[i].id)->accepted = true;
    read_side(r, &cs);
    if (pg)
        check_batches(r, pg, &cs);

    t.submitted = (long)r->nsubs;
    t.accepted = r->accepted;
    for (unsigned b = 0; b < r->nbatches; b++) {
        t.submitted += r->batches[b].targets;
        t.accepted += r->batches[b].targets;
    }
    t.submitted += r->batch_errors;

    int64_t now = ks_now_us();
    for (size_t i = 0; i < cs.n; i++) {
        struct cmd *c = &cs.v[i];
        t.recorded += c->in_table;
        t.ran[c->runs > 2 ? 2 : c->runs]++;
        /* I1 */
        if (c->runs > 1)
            viol(r, 1, "command %s ran %d times (pids %s); record: %s", c->id,
                 c->runs, c->pids, c->nterm ? c->terms : c->proj);
        if (c->started > 1)
            viol(r, 1, "command %s claimed %d times (CommandStarted)", c->id,
                 c->started);
        if (!c->in_table && !c->has_req) {
            /* I3: the client was told it was accepted; the record has no
             * trace of it. */
            if (c->accepted && !c->batch) {
                viol(r, 3, "command %s accepted but not recorded (ran %d)",
                     c->id, c->runs);
                t.lost++;
            } else if (c->batch) {
                viol(r, 3, "batch target %s of %s never recorded (ran %d)",
                     c->id, r->batches[c->batch - 1].id, c->runs);
                t.lost++;
            } else if (c->runs) {
                viol(r, 1, "command %s ran (pids %s) but the record has no "
                     "trace of it", c->id, c->pids);
            }
            continue;
        }
        /* I2 */
        if (c->nterm > 1) {
            viol(r, 2, "command %s recorded twice: %s (ran %d)", c->id,
                 c->terms, c->runs);
            t.twice++;
        }
        if (c->nterm && r->forbid_lost && strcmp(c->first, "Lost") == 0)
            viol(r, 2, "command %s recorded Lost though its agent was alive "
                 "and heard: %s (ran %d)", c->id, c->terms, c->runs);
        if (c->nterm) {
            for (int k = 0; status_names[k]; k++)
                if (strcmp(c->first, status_names[k]) == 0)
                    t.by_status[k]++;
            if (!c->in_table || strcmp(c->proj, c->first) != 0)
                viol(r, 2, "command %s: projection says %s, its terminal "
                     "event %s",
                     c->id, c->in_table ? c->proj : "(no row)", c->first);
            bool ran_says = strcmp(c->first, "Succeeded") == 0 ||
                            strcmp(c->first, "Failed") == 0 ||
                            strcmp(c->first, "TimedOut") == 0;
            bool not_ran_says = strcmp(c->first, "Undeliverable") == 0 ||
                                strcmp(c->first, "NotStarted") == 0 ||
                                strcmp(c->first, "StartFailed") == 0;
            if (ran_says && c->runs == 0)
                viol(r, 2, "command %s recorded %s but never ran", c->id,
                     c->first);
            if (not_ran_says && c->runs > 0)
                viol(r, 2, "command %s recorded %s but ran (pids %s)", c->id,
                     c->first, c->pids);
        } else {
            t.open++;
            if (c->in_table && status_terminal(c->proj))
                viol(r, 2, "command %s: projection says %s, no terminal "
                     "event recorded", c->id, c->proj);
        }
        /* I3 (no end can be recorded while the record refuses writes) */
        int64_t due = c->req_us + c->budget_us + r->refused_us;
        if (!c->nterm) {
            t.lost++;
            viol(r, 3, "command %s%s%s not terminal %.0f s after acceptance "
                 "(deadline %.0f s): %s, ran %d",
                 c->id, c->batch ? " of " : "",
                 c->batch ? r->batches[c->batch - 1].id : "",
                 (double)(now - c->req_us) / 1e6, (double)c->budget_us / 1e6,
                 c->in_table ? c->proj : "no row", c->runs);
        } else if (c->term_us > due) {
            t.lost++;
            viol(r, 3, "command %s terminal (%s) %.1f s after acceptance, "
                 "past its deadline of %.0f s",
                 c->id, c->first, (double)(c->term_us - c->req_us) / 1e6,
                 (double)c->budget_us / 1e6);
        }
    }
    if (pg) {
        kscore_get_sample(r, &cs);
        check_readers(r, pg, readers_line, sizeof(readers_line));
    }
    /* I6 */
    for (unsigned i = 0; i < r->nrec; i++) {
        if (r->rec[i].seconds < 0)
            viol(r, 6, "no fresh exec succeeded after %s (probed for %d s)",
                 r->rec[i].what, r->short_mode ? 40 : 60);
        else if (r->rec[i].seconds > CHAOS_RECOVER_LIMIT_S)
            viol(r, 6, "serving again took %.1f s after %s (limit %.0f s)",
                 r->rec[i].seconds, r->rec[i].what, CHAOS_RECOVER_LIMIT_S);
    }
    /* The scenario's own checks. */
    for (unsigned i = 0; i < r->nfails; i++)
        viol(r, 0, "%s", r->fails[i]);
    viol_tail(r);

    /* The table. */
    char terms[512] = "";
    size_t off = 0;
    for (int k = 0; status_names[k]; k++)
        if (t.by_status[k])
            off += (size_t)snprintf(terms + off, sizeof(terms) - off,
                                    "%s%s %ld", off ? ", " : "",
                                    status_names[k], t.by_status[k]);
    char rec[256] = "-";
    off = 0;
    for (unsigned i = 0; i < r->nrec; i++) {
        if (r->rec[i].seconds >= 0)
            off += (size_t)snprintf(rec + off, sizeof(rec) - off, "%s%.1f (%s)",
                                    i ? ", " : "", r->rec[i].seconds,
                                    r->rec[i].what);
        else
            off += (size_t)snprintf(rec + off, sizeof(rec) - off,
                                    "%snever (%s)", i ? ", " : "",
                                    r->rec[i].what);
    }
    printf("  | %-23s | %-44s |\n", "", r->sc->name);
    printf("  |-------------------------|----------------------------------------------|\n");
#define ROW(k, fmt, ...)                                                       \
    do {                                                                       \
        char v_[256];                                                          \
        snprintf(v_, sizeof(v_), fmt, __VA_ARGS__);                            \
        printf("  | %-23s | %-44s |\n", k, v_);                                \
    } while (0)
    ROW("submitted", "%ld", t.submitted);
    ROW("accepted", "%ld", t.accepted);
    ROW("recorded (incl. probes)", "%ld", t.recorded);
    ROW("ran 0 / 1 / 2+", "%ld / %ld / %ld", t.ran[0], t.ran[1], t.ran[2]);
    ROW("terminal", "%s", terms[0] ? terms : "-");
    ROW("not terminal", "%ld", t.open);
    ROW("lost (past deadline)", "%ld", t.lost);
    ROW("recorded twice", "%ld", t.twice);
    ROW("seconds to recover", "%s", rec);
    ROW("readers (I5)", "%s", readers_line[0] ? readers_line : "-");
    if (r->nbatches)
        ROW("batches", "%u (+%u refused)", r->nbatches, r->batch_errors);
    progress_gap(r, pg);
    if (r->gap_s >= 0)
        ROW("progress gap (s)", "%.1f after the fault%s (before: %.1f)",
            r->gap_s, r->gap_s > CHAOS_GAP_TARGET_S ? ", over 10 s" : "",
            r->gap_before_s);
#undef ROW
    r->stats.submitted = t.submitted;
    r->stats.accepted = t.accepted;
    r->stats.recorded = t.recorded;
    r->stats.ran0 = t.ran[0];
    r->stats.ran1 = t.ran[1];
    r->stats.ran2 = t.ran[2];
    r->stats.lost = t.lost;
    r->stats.twice = t.twice;
    r->stats.gap_s = r->gap_s;

    ks_map_clear(&cs.by_id);
    free(cs.v);
    PQfinish(pg);
    for (int i = 0; i <= 6; i++)
        if (r->violations[i])
            return 1;
    return 0;
}
