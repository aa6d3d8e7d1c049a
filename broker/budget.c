/*
 * budget.c: how many annotation rows one identity may add to the record.
 *
 * An annotation (ReportRejected, LateResult, an agent's CommandRejected,
 * a lost claim's DuplicateSuppressed, RequestDenied) is a row that records
 * a refusal or a late word: it moves no command. Every junk report of an agent and every refused request of
 * an operator would be one, so one credential could write rows as fast as
 * it can publish (issue 21: 10,000 ReportRejected in 5 s from one agent,
 * 5,000 RequestDenied from an operator not in the policy). Each identity
 * (an agent id, or its pool when the registry says it has one; an
 * operator) has two token buckets here, one of rows and one of bytes.
 * An annotation past either is not written: it is counted
 * (kscore_annotations_dropped_total{kind}) and the log says so once when
 * it starts and then at most every BUDGET_LOG_US, with how many, instead
 * of a line per message. What moves a command (a claim, a result, a
 * request that is granted) never meets a bucket: honest agents and
 * operators, who make annotations rarely, never lose anything to it.
 *
 * The buckets are per broker process (two brokers: twice the rows), in
 * memory, and forgotten once full again.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* Per identity: up to BUDGET_ROWS_BURST rows at once, then
 * BUDGET_ROWS_PER_S; and as many bytes of them (the packed event, which a
 * ReportRejected keeps whole) up to BUDGET_BYTES_BURST, then
 * BUDGET_BYTES_PER_S. */
#define BUDGET_ROWS_BURST 1000.0
#define BUDGET_ROWS_PER_S 10.0
#define BUDGET_BYTES_BURST (64.0 * 1024 * 1024)
#define BUDGET_BYTES_PER_S (64.0 * 1024)
/* Claims that did not win (broker_int.h broker__budget_ask_ok): up to
 * BUDGET_CLAIMS_BURST at once, then BUDGET_CLAIMS_PER_S. */
#define BUDGET_CLAIMS_BURST 1000.0
#define BUDGET_CLAIMS_PER_S 100.0
/* Past its share of claims, an identity's refusals are answered (busy)
 * at most this often; the others are dropped unanswered. */
#define BUDGET_ANSWER_US INT64_C(10000)
/* While an identity is past its share, one log line at most this often. */
#define BUDGET_LOG_US INT64_C(10000000)
/* Identities tracked at once; a new one past this is past its share. */
#define BUDGET_MAX_IDS 65536

struct broker__budget {
    pthread_mutex_t mu;
    struct ks_map ids; /* identity -> struct budget_entry * */
};

struct budget_entry {
    double rows, bytes;
    double claims;            /* lost claims it may still make */
    int64_t claims_logged_us; /* the last line about its refused claims */
    int64_t claims_answered_us; /* the last refusal answered */
    uint64_t claims_refused;  /* since that line */
    int64_t at_us;        /* the buckets' last refill (monotonic) */
    int64_t logged_us;    /* the last line about its drops; 0: none yet */
    uint64_t unlogged;    /* drops since that line */
    uint64_t dropped;     /* drops in all */
    enum broker__annotation kind;
};

static const char *
kind_name(enum broker__annotation k)
{
    return k == BROKER_ANNOTATION_DENIAL ? "RequestDenied" : "report";
}

int
broker__budget_init(struct broker *b)
{
    struct broker__budget *bu = calloc(1, sizeof(*bu));
    if (!bu)
        return -ENOMEM;
    pthread_mutex_init(&bu->mu, NULL);
    b->budget = bu;
    return 0;
}

static void
free_entry(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    free(val);
}

void
broker__budget_free(struct broker *b)
{
    if (!b->budget)
        return;
    ks_map_each(&b->budget->ids, free_entry, NULL);
    ks_map_clear(&b->budget->ids);
    pthread_mutex_destroy(&b->budget->mu);
    free(b->budget);
    b->budget = NULL;
}

static void
refill(struct budget_entry *e, int64_t now)
{
    double s = (double)(now - e->at_us) / 1e6;
    e->rows += s * BUDGET_ROWS_PER_S;
    if (e->rows > BUDGET_ROWS_BURST)
        e->rows = BUDGET_ROWS_BURST;
    e->bytes += s * BUDGET_BYTES_PER_S;
    if (e->bytes > BUDGET_BYTES_BURST)
        e->bytes = BUDGET_BYTES_BURST;
    e->claims += s * BUDGET_CLAIMS_PER_S;
    if (e->claims > BUDGET_CLAIMS_BURST)
        e->claims = BUDGET_CLAIMS_BURST;
    e->at_us = now;
}

static void
log_drops(const char *identity, struct budget_entry *e, int64_t now,
          bool first)
{
    ks_log(KS_LOG_WARN,
           first ? "an identity is past its share of annotation rows: "
                   "its refused reports or requests are counted, not "
                   "recorded (one line every 10 s while it lasts)"
                 : "annotation rows not recorded (past the identity's "
                   "share)",
           KS_S("module", "budget"), KS_S("identity", identity),
           KS_S("kind", kind_name(e->kind)), KS_I("dropped", e->unlogged),
           KS_I("dropped_total", e->dropped),
           KS_D("rows_per_s", BUDGET_ROWS_PER_S),
           KS_I("burst_rows", (long long)BUDGET_ROWS_BURST));
    e->unlogged = 0;
    e->logged_us = now;
}

/* identity's entry, made whole when new; NULL past BUDGET_MAX_IDS (or no
 * memory). Under bu->mu. */
static struct budget_entry *
entry_get(struct broker__budget *bu, const char *identity, int64_t now)
{
    struct budget_entry *e = ks_map_get(&bu->ids, identity);
    if (!e && bu->ids.count < BUDGET_MAX_IDS &&
        (e = calloc(1, sizeof(*e))) != NULL) {
        e->rows = BUDGET_ROWS_BURST;
        e->bytes = BUDGET_BYTES_BURST;
        e->claims = BUDGET_CLAIMS_BURST;
        e->at_us = now;
        if (ks_map_put(&bu->ids, identity, e) != 0) {
            free(e);
            e = NULL;
        }
    }
    return e;
}

static void
log_claims(const char *identity, struct budget_entry *e, int64_t now,
           bool first)
{
    ks_log(KS_LOG_WARN,
           first ? "an identity is past its share of claims that do not "
                   "win and fetches refused: they are answered busy "
                   "without the store (one line every 10 s while it lasts)"
                 : "claims and fetches answered busy (past the identity's "
                   "share of claims that do not win and fetches refused)",
           KS_S("module", "budget"), KS_S("identity", identity),
           KS_I("refused", e->claims_refused),
           KS_D("lost_claims_per_s", BUDGET_CLAIMS_PER_S),
           KS_I("burst", (long long)BUDGET_CLAIMS_BURST));
    e->claims_refused = 0;
    e->claims_logged_us = now;
}

bool
broker__budget_ask_ok(struct broker *b, const char *identity, bool *answer)
{
    struct broker__budget *bu = b->budget;
    int64_t now = ks_mono_us();
    bool ok;

    if (!bu)
        return true;
    pthread_mutex_lock(&bu->mu);
    struct budget_entry *e = ks_map_get(&bu->ids, identity);
    if (!e) {
        /* Nothing lost yet (or forgotten, whole again). */
        pthread_mutex_unlock(&bu->mu);
        return true;
    }
    refill(e, now);
    ok = e->claims >= 1.0;
    if (!ok) {
        bool first = e->claims_logged_us == 0;
        *answer = now - e->claims_answered_us >= BUDGET_ANSWER_US;
        if (*answer)
            e->claims_answered_us = now;
        e->claims_refused++;
        if (first || now - e->claims_logged_us >= BUDGET_LOG_US)
            log_claims(identity, e, now, first);
    }
    pthread_mutex_unlock(&bu->mu);
    return ok;
}

void
broker__budget_ask_failed(struct broker *b, const char *identity)
{
    struct broker__budget *bu = b->budget;
    int64_t now = ks_mono_us();

    if (!bu)
        return;
    pthread_mutex_lock(&bu->mu);
    struct budget_entry *e = entry_get(bu, identity, now);
    if (e) {
        refill(e, now);
        e->claims = e->claims >= 1.0 ? e->claims - 1.0 : 0.0;
    }
    pthread_mutex_unlock(&bu->mu);
}

bool
broker__budget_take(struct broker *b, const char *identity, size_t bytes,
                    enum broker__annotation kind)
{
    struct broker__budget *bu = b->budget;
    int64_t now = ks_mono_us();
    bool ok;

    if (!bu)
        return true;
    pthread_mutex_lock(&bu->mu);
    struct budget_entry *e = entry_get(bu, identity, now);
    if (!e) {
        /* Too many identities at once (or no memory): no row. */
        pthread_mutex_unlock(&bu->mu);
        ks_metric_inc(kind == BROKER_ANNOTATION_DENIAL
                          ? KS_C_DENIALS_DROPPED
                          : KS_C_REPORTS_DROPPED);
        return false;
    }
    refill(e, now);
    e->kind = kind;
    ok = e->rows >= 1.0 && e->bytes >= (double)bytes;
    if (ok) {
        e->rows -= 1.0;
        e->bytes -= (double)bytes;
    } else {
        e->dropped++;
        e->unlogged++;
        if (e->logged_us == 0 || now - e->logged_us >= BUDGET_LOG_US)
            log_drops(identity, e, now, e->dropped == 1);
    }
    pthread_mutex_unlock(&bu->mu);
    if (!ok)
        ks_metric_inc(kind == BROKER_ANNOTATION_DENIAL ? KS_C_DENIALS_DROPPED
                                                       : KS_C_REPORTS_DROPPED);
    return ok;
}

struct sweep {
    int64_t now;
    char gone[64][16 + EVT_AGENT_ID_MAX];
    size_t ngone;
};

static void
sweep_one(const char *key, void *val, void *ud)
{
    struct sweep *sw = ud;
    struct budget_entry *e = val;
    refill(e, sw->now);
    if (e->unlogged && sw->now - e->logged_us >= BUDGET_LOG_US)
        log_drops(key, e, sw->now, false);
    if (e->claims_refused && sw->now - e->claims_logged_us >= BUDGET_LOG_US)
        log_claims(key, e, sw->now, false);
    /* Full again and nothing left to say: forget it (a later annotation
     * starts it full, the same thing). */
    if (!e->unlogged && !e->claims_refused && e->rows >= BUDGET_ROWS_BURST &&
        e->bytes >= BUDGET_BYTES_BURST && e->claims >= BUDGET_CLAIMS_BURST &&
        sw->ngone < 64)
        snprintf(sw->gone[sw->ngone++], sizeof(sw->gone[0]), "%s", key);
}

void
broker__budget_sweep(struct broker *b)
{
    struct broker__budget *bu = b->budget;
    if (!bu)
        return;
    pthread_mutex_lock(&bu->mu);
    static _Thread_local struct sweep sw;
    do {
        sw.now = ks_mono_us();
        sw.ngone = 0;
        ks_map_each(&bu->ids, sweep_one, &sw);
        for (size_t i = 0; i < sw.ngone; i++)
            free(ks_map_del(&bu->ids, sw.gone[i]));
    } while (sw.ngone == 64);
    pthread_mutex_unlock(&bu->mu);
}

void
broker__report_identity(struct broker *b, const char *agent_id, char *buf,
                        size_t len)
{
    char pool[EVT_AGENT_ID_MAX + 1];
    int known = broker__agent_pool_known(b, agent_id, pool, sizeof(pool));
    if (known && pool[0])
        snprintf(buf, len, "pool-%s", pool);
    else if (known)
        snprintf(buf, len, "agent-%s", agent_id);
    else
        /* No entry in the registry: an id nothing vouches for here yet
         * (a pool's ids are known through the pool's entry). They share
         * one share, so a credential that serves many ids gets no more
         * rows by using ids the registry does not list. */
        snprintf(buf, len, "unregistered");
}

/* 1 if ev, reported about a command in state st, would be recorded as an
 * annotation (it moves no command): refused by admit, not a step of the
 * machine, or a step that changes nothing (CommandRejected). */
static bool
is_annotation(const struct store_command_state *st, const Ks__Event *ev,
              int admit_rc)
{
    Ks__CommandStatus next;
    const char *why = NULL;
    if (admit_rc != 0)
        return true;
    if (store_command_step(st, ev, &next, &why) != STORE_STEP_APPLY)
        return true;
    return !store_event_is_terminal(ev->type);
}

/*
 * The store may decide one event more than once (a batch decided against
 * the state an honest report finds, then against the state it reads; a
 * batch retried while PostgreSQL is away): the share is taken once per
 * event, and the later decisions repeat the first. The recorder thread's
 * memory of the last events it charged, by a hash of the event id (a
 * collision only charges an event again).
 */
#define MEMO_SLOTS 8192
static _Thread_local struct {
    uint64_t hash[MEMO_SLOTS];
    bool kept[MEMO_SLOTS];
} memo;

static uint64_t
id_hash(const char *s)
{
    /* never 0, the empty slot */
    return ks_fnv1a(KS_FNV1A_INIT, s, strlen(s)) | 1;
}

int
broker__admit_bounded(const struct store_command_state *st,
                      const Ks__Event *ev, const char **why, void *ud)
{
    struct broker *b = ud;
    int rc = broker__admit_report(st, ev, why, NULL);
    if (!is_annotation(st, ev, rc))
        return rc;
    uint64_t h = id_hash(ev->event_id ? ev->event_id : "");
    size_t slot = h & (MEMO_SLOTS - 1);
    if (memo.hash[slot] != h) {
        char identity[16 + EVT_AGENT_ID_MAX];
        broker__report_identity(b, ev->agent_id, identity, sizeof(identity));
        memo.hash[slot] = h;
        memo.kept[slot] = broker__budget_take(
            b, identity, ks__event__get_packed_size(ev),
            BROKER_ANNOTATION_REPORT);
    }
    return memo.kept[slot] ? rc : STORE_CHECK_DROP;
}
