/* kscore batch: one command on many agents, with a live progress line, a
 * summary table and outputs grouped by content (as clubak does). */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_int.h"

static const char batch_usage[] =
    "usage: kscore batch TARGETS [RATE] [OPTIONS] -- CMD [ARG]...\n"
    "       kscore batch TARGETS [RATE] [OPTIONS] --script FILE [--] [ARG]...\n"
    "Runs CMD on many agents. Exit 0 when every target succeeded, 1 when\n"
    "a target ran and failed (failed, killed, timed out, could not start),\n"
    "4 when none failed but some never ran (no response, lost, not\n"
    "started, cancelled), 2 on bad usage, 125 when kscore failed, 69 when\n"
    "the outcome is unknown (the batch may be recorded).\n"
    "Targets (resolved once, when the batch is accepted):\n"
    "  --agents A,B,C         these agents\n"
    "  --select TERM[,TERM]   registered agents whose labels match every\n"
    "                         term: K=V, K!=V, K=V1|V2; values are globs\n"
    "                         (role=web*). With --agents: the listed agents\n"
    "                         that match (the intersection). Repeatable.\n"
    "  --all                  every registered agent\n"
    "  An offline target is not waited for: it ends \"no response\"\n"
    "  (Undeliverable) at once.\n"
    "  --online-only          leave out the agents offline now\n"
    "  --dry-run              list the targets (online or not) and exit 0\n"
    "  --yes                  do not ask (see below)\n"
    "  --confirm-over N       on a terminal, ask before running on --all or\n"
    "                         on more than N targets (default 20, or\n"
    "                         $KSCORE_CONFIRM_OVER); when stdin is not a\n"
    "                         terminal nothing is asked (as salt, ansible);\n"
    "                         declining exits 2, nothing run\n"
    "Rate control:\n"
    "  --max-concurrency N|P%  at most N (or P% of the targets, >= 1) at once\n"
    "  --max-errors N|P%       once MORE than N targets ended in error, start\n"
    "                          no more; the rest end Cancelled (in-flight\n"
    "                          ones finish). 0: stop after the first error.\n"
    "                          P%: N = P% of the targets, rounded down\n"
    "                          (10% of 4 = 0). An error is every end but\n"
    "                          Succeeded and Cancelled: failed, killed,\n"
    "                          timed out, could not start, no response,\n"
    "                          lost, not started.\n"
    "  --strict-errors         start a target only while errors + running\n"
    "                          <= N, so at most N+1 errors ever happen\n"
    "Command:\n"
    "  --timeout D  --grace D  --env K=V  --cwd DIR  --deliver-within D\n"
    "  --secret-env NAME       pass $NAME from your environment, sealed to\n"
    "                          each target's own key (repeatable)\n"
    CLI_PAYLOAD_USAGE
    "  Stdin, when not a terminal, is read first and every target gets the\n"
    "  same bytes (as clush).\n"
    "Output:\n"
    "  --json                  one JSON object per target as it ends, then a\n"
    "                          summary object\n"
    "  --detach                print the batch id and return\n"
    "  --stream                print each target's output as it comes, one\n"
    "                          \"agent: line\" per line (stderr to stderr)\n"
    "Without --detach it waits for the end. Should its broker stop, another\n"
    "broker continues the batch and it follows it there; when no broker\n"
    "answers for 20s it prints how to follow the batch and exits 69.\n"
    CLI_CONN_USAGE;

/* Waiting for a batch: its driver sends a progress message at least every
 * second; when nothing arrived for BATCH_POLL_MS, ask any broker for the
 * batch (kscore get); when none answers for BATCH_GIVE_UP_MS, say how to
 * follow it and give up. No message at all within BATCH_ACCEPT_MS: no
 * broker accepted (recorded) it. */
#define BATCH_POLL_MS 2000
#define BATCH_GIVE_UP_MS 20000
#define BATCH_ACCEPT_MS 30000
/* What batch_wait() returns when it gave up (after saying so). */
#define BATCH_GAVE_UP 1
#define BATCH_DETACHED 2 /* a second Ctrl-C: stopped waiting (said so) */

struct bstate {
    pthread_mutex_t mu;
    char batch_id[48]; /* from the first progress message; "" until then */
    int64_t heard_mono_us; /* last progress message */
    bool json, tty;
    int64_t start_us;
    size_t total;
    Ks__BatchCounts counts;
    /* results by command id, as progress arrives */
    struct ks_map results; /* command_id -> Ks__BatchTarget * */
    bool line_shown;
};

/* The progress bar on stderr, redrawn in place, on a terminal only:
 * [#####.....] done/total, counts by state, rate, ETA. The final call
 * erases it (the summary says the rest). */
static void
progress_line(struct bstate *st, bool final)
{
    const Ks__BatchCounts *c = &st->counts;
    double el = (double)(ks_mono_us() - st->start_us) / 1e6;
    unsigned total = st->total ? (unsigned)st->total : c->total;
    unsigned done = total >= c->pending + c->running
                        ? total - c->pending - c->running
                        : 0;
    char bar[21], counts[256], eta[32] = "";
    if (!st->tty || st->json || total == 0)
        return;
    if (final) {
        if (st->line_shown)
            fputs("\r\033[K", stderr);
        st->line_shown = false;
        fflush(stderr);
        return;
    }
    unsigned fill = done * 20 / total;
    for (unsigned i = 0; i < 20; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[20] = '\0';
    Ks__BatchCounts shown = *c;
    shown.pending = 0; /* said by done/total */
    shown.total = 0;
    fleet_counts_text(&shown, counts, sizeof(counts));
    char *of = strstr(counts, " of 0 targets");
    if (of)
        *of = '\0';
    else if (strcmp(counts, "0 targets") == 0)
        counts[0] = '\0';
    double rate = el > 0 ? done / el : 0.0;
    if (done && done < total && rate > 0)
        snprintf(eta, sizeof(eta), " ETA %.0fs", (total - done) / rate);
    fprintf(stderr, "\r\033[K[%s] %u/%u %s  %.1f/s%s", bar, done, total,
            counts, rate, eta);
    st->line_shown = true;
    fflush(stderr);
}

static void
on_progress(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct bstate *st = ud;
    ProtobufCMessage *pm = NULL;
    (void)nc;
    (void)sub;
    if (evt_unpack(&ks__batch_progress__descriptor, natsMsg_GetData(msg),
                   (size_t)natsMsg_GetDataLength(msg), &pm) == 0) {
        Ks__BatchProgress *p = (Ks__BatchProgress *)pm;
        if (p->n_chunks) {
            cli_stream_batch_piece(p); /* --stream */
            ks__batch_progress__free_unpacked(p, NULL);
            natsMsg_Destroy(msg);
            return;
        }
        pthread_mutex_lock(&st->mu);
        if (!st->batch_id[0] && p->batch_id &&
            strncmp(p->batch_id, "batch-", 6) == 0 &&
            ks_is_uuid(p->batch_id + 6))
            snprintf(st->batch_id, sizeof(st->batch_id), "%s", p->batch_id);
        st->heard_mono_us = ks_mono_us();
        if (p->counts) {
            st->counts = *p->counts;
            st->total = p->counts->total;
        }
        if (p->target && !ks_map_get(&st->results, p->target->command_id)) {
            if (st->json) {
                if (st->line_shown)
                    fputs("\r\033[K", stderr);
                cli_print_json(fleet_target_json(p->batch_id, p->target));
                fflush(stdout);
            }
            /* Keep the target: unlink it from the message we free. */
            Ks__BatchTarget *t = p->target;
            p->target = NULL;
            ks_map_put(&st->results, t->command_id, t);
        }
        progress_line(st, false);
        pthread_mutex_unlock(&st->mu);
        ks__batch_progress__free_unpacked(p, NULL);
    }
    natsMsg_Destroy(msg);
}

static void
free_target(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    ks__batch_target__free_unpacked(val, NULL);
}

/* Parses "N" or "P%". */
static int
parse_amount(const char *s, Ks__Amount *a)
{
    char *end;
    unsigned long v;
    ks__amount__init(a);
    if (!s[0] || s[0] < '0' || s[0] > '9')
        return -1;
    errno = 0;
    v = strtoul(s, &end, 10);
    if (errno || end == s)
        return -1;
    if (*end == '%' && end[1] == '\0') {
        if (v > 100)
            return -1;
        a->percent = 1;
    } else if (*end) {
        return -1;
    }
    a->value = (uint32_t)v;
    return 0;
}

/* Splits "a,b,c" in place into out (capacity cap); returns the count. */
static size_t
split_commas(char *s, char **out, size_t cap)
{
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(s, ",", &save); t && n < cap;
         t = strtok_r(NULL, ",", &save))
        if (t[0])
            out[n++] = t;
    return n;
}

/* Asks any broker for the batch. 0 with *out (a BatchReply), or a code:
 * no broker answered, or it could not say. */
static int
batch_get(struct evt_conn *c, const char *batch_id, Ks__BatchReply **out)
{
    Ks__GetRequest g = KS__GET_REQUEST__INIT;
    Ks__GetReply *r = NULL;
    int rc;

    g.id = (char *)batch_id;
    rc = broker_call(c, EVT_API_GET, &g.base, &ks__get_reply__descriptor,
                     BATCH_POLL_MS, (ProtobufCMessage **)&r);
    if (rc)
        return rc;
    if (r->error_code || !r->batch) {
        rc = r->error_code ? r->error_code : KS_EDECODE;
    } else {
        *out = r->batch;
        r->batch = NULL;
    }
    ks__get_reply__free_unpacked(r, NULL);
    return rc;
}

/*
 * Sends the batch request and waits for its end, from whichever broker
 * can say: the reply from the broker driving it (the one that took the
 * request, or one that took the batch over and answers the same inbox),
 * or, every BATCH_POLL_MS without news, a get of the batch from any
 * broker. Returns 0 with *out (the reply, maybe an error reply),
 * BATCH_GAVE_UP after telling the operator how to follow the batch, or a
 * negative code (KS_EUNAVAIL: no broker serves batches).
 */
static int
batch_wait(struct evt_conn *c, const Ks__BatchRequest *req,
           struct bstate *st, Ks__BatchReply **out)
{
    natsSubscription *rsub = NULL;
    char ib[EVT_INBOX_MAX];
    natsMsg *msg = NULL;
    char subject[192], id[48];
    uint8_t *buf = NULL;
    size_t len = 0;
    int64_t t0 = ks_mono_us(), answered = t0, asked = t0;
    bool silent_said = false, cancel_sent = false;
    int rc;

    /* The reply comes to this operator's own inbox (evt_inbox): the only
     * reply address the broker answers. */
    if (evt_inbox(c, ib, sizeof(ib)) != 0 ||
        natsConnection_SubscribeSync(&rsub, c->nc, ib) != NATS_OK ||
        (rc = kproto_pack(&req->base, &buf, &len)) != 0) {
        rc = KS_ENATS;
        goto out;
    }
    /* NATS refuses a message over its max payload with a bare error:
     * say why (the caller names the limit), as exec does. */
    if (len > KS_MAX_MESSAGE_BYTES) {
        rc = KS_ETOOBIG;
        goto out;
    }
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_BATCH, c->identity);
    if (natsConnection_PublishRequest(c->nc, subject, ib, buf, (int)len) !=
        NATS_OK) {
        rc = KS_ENATS;
        goto out;
    }
    natsConnection_Flush(c->nc);
    for (;;) {
        natsStatus s = natsSubscription_NextMsg(&msg, rsub, 500);
        int64_t now = ks_mono_us();
        if (s == NATS_OK) {
            if (natsMsg_IsNoResponders(msg)) {
                rc = KS_EUNAVAIL;
                goto out;
            }
            rc = evt_unpack(&ks__batch_reply__descriptor,
                            natsMsg_GetData(msg),
                            (size_t)natsMsg_GetDataLength(msg),
                            (ProtobufCMessage **)out);
            goto out;
        }
        if (s != NATS_TIMEOUT) {
            rc = evt_err(s);
            goto out;
        }
        pthread_mutex_lock(&st->mu);
        snprintf(id, sizeof(id), "%s", st->batch_id);
        if (st->heard_mono_us > answered)
            answered = st->heard_mono_us; /* a broker drives it */
        pthread_mutex_unlock(&st->mu);
        /* Ctrl-C as on exec (ssh, clush, salt users press it): the first
         * cancels the batch (not started targets end Cancelled, running
         * ones get TERM, grace, KILL) and waits for its end and summary;
         * the second stops waiting and says how to follow it. Without
         * this, SIGINT killed the client silently and the batch ran on. */
        int ints = cli_sigints();
        if (ints >= 2) {
            if (id[0])
                cli_err("detached: %s goes on; follow it with: kscore get "
                        "%s",
                        id, id);
            else
                cli_err("interrupted");
            rc = BATCH_DETACHED;
            goto out;
        }
        if (ints == 1 && !cancel_sent && id[0]) {
            Ks__CancelRequest creq = KS__CANCEL_REQUEST__INIT;
            Ks__CancelReply *crep = NULL;
            cancel_sent = true;
            creq.id = id;
            int crc = broker_call(c, EVT_API_CANCEL, &creq.base,
                                  &ks__cancel_reply__descriptor, 10000,
                                  (ProtobufCMessage **)&crep);
            if (crc || crep->error_code)
                cli_err("cannot cancel %s: %s", id,
                        crc ? ks_strerror(crc) : crep->error);
            else
                cli_err("cancelling %s (TERM, grace, KILL on each running "
                        "target); Ctrl-C again to stop waiting",
                        id);
            if (crep)
                ks__cancel_reply__free_unpacked(crep, NULL);
        }
        if (!id[0]) {
            /* The id comes once the batch is recorded: until then there
             * is nothing to follow. */
            if (now - t0 >= (int64_t)BATCH_ACCEPT_MS * 1000) {
                rc = KS_ETIMEDOUT;
                goto out;
            }
            continue;
        }
        if (now - asked < (int64_t)BATCH_POLL_MS * 1000 ||
            now - answered < (int64_t)BATCH_POLL_MS * 1000)
            continue;
        asked = now;
        Ks__BatchReply *rep = NULL;
        rc = batch_get(c, id, &rep);
        now = ks_mono_us();
        if (rc == 0) {
            answered = now;
            if (silent_said) {
                cli_err("a broker answers again: following %s", id);
                silent_said = false;
            }
            if (rep->status != KS__BATCH_STATUS__BATCH_RUNNING &&
                rep->status != KS__BATCH_STATUS__BATCH_STATUS_UNSPECIFIED) {
                *out = rep; /* ended, recorded by whichever broker */
                goto out;
            }
            ks__batch_reply__free_unpacked(rep, NULL);
            continue;
        }
        if (!silent_said) {
            cli_err("no broker answers (%s); %s goes on when one does, "
                    "waiting up to %ds",
                    ks_strerror(rc), id, BATCH_GIVE_UP_MS / 1000);
            silent_said = true;
        }
        if (now - answered >= (int64_t)BATCH_GIVE_UP_MS * 1000) {
            cli_err("no broker answered for %ds; the batch is recorded and "
                    "a broker continues it when one runs. Follow it with: "
                    "kscore get %s",
                    BATCH_GIVE_UP_MS / 1000, id);
            rc = BATCH_GAVE_UP;
            goto out;
        }
    }
out:
    natsMsg_Destroy(msg);
    if (rsub) {
        natsSubscription_Unsubscribe(rsub);
        natsSubscription_Destroy(rsub);
    }
    free(buf);
    return rc;
}

int
cli_batch_init(struct cli_batch *bt, int argc, char **argv)
{
    memset(bt, 0, sizeof(*bt));
    ks__batch_request__init(&bt->req);
    bt->confirm_over = 20;
    bt->cap = (size_t)argc * 4 + 4;
    /* Room for every id of every comma list: --agents t-1,...,t-50 is one
     * argument (split_commas drops what does not fit). */
    for (int i = 1; i < argc; i++)
        for (const char *p = argv[i]; *p; p++)
            bt->cap += *p == ',';
    bt->agents = calloc(bt->cap, sizeof(*bt->agents));
    bt->terms = calloc(bt->cap, sizeof(*bt->terms));
    if (!bt->agents || !bt->terms) {
        cli_err("out of memory");
        return CLI_EXIT_KSCORE;
    }
    bt->req.agents = bt->agents;
    bt->req.selector = bt->terms;
    const char *env_over = getenv("KSCORE_CONFIRM_OVER");
    if (env_over && env_over[0]) {
        char *end;
        bt->confirm_over = strtol(env_over, &end, 10);
        if (*end || bt->confirm_over < 0) {
            cli_err("bad KSCORE_CONFIRM_OVER '%s' (a count >= 0)", env_over);
            return CLI_EXIT_USAGE;
        }
    }
    return 0;
}

void
cli_batch_release(struct cli_batch *bt)
{
    free(bt->agents);
    free(bt->terms);
    bt->agents = bt->terms = NULL;
}

int
cli_batch_opt(struct cli_batch *bt, int opt, char *arg)
{
    Ks__BatchRequest *req = &bt->req;

    switch (opt) {
    case 'a':
        req->n_agents += split_commas(arg, bt->agents + req->n_agents,
                                      bt->cap - req->n_agents);
        return 1;
    case 's': {
        char *pairs[64];
        char why[256];
        size_t np = split_commas(arg, pairs, 64);
        for (size_t i = 0; i < np && req->n_selector < bt->cap; i++) {
            if (broker_select_check(pairs[i], why, sizeof(why))) {
                cli_err("--select: %s", why);
                return -1;
            }
            bt->terms[req->n_selector++] = pairs[i];
        }
        return 1;
    }
    case 'A':
        req->all = 1;
        return 1;
    case 'O':
        req->online_only = 1;
        return 1;
    case 'n':
        req->dry_run = 1;
        return 1;
    case 'y':
        bt->yes = true;
        return 1;
    case 'C': {
        char *end;
        bt->confirm_over = strtol(arg, &end, 10);
        if (*end || !arg[0] || bt->confirm_over < 0) {
            cli_err("bad --confirm-over '%s' (a count >= 0)", arg);
            return -1;
        }
        return 1;
    }
    case 'T':
        req->live_output = 1; /* cli/out_stream.c prints the pieces */
        return 1;
    case 'c':
        if (parse_amount(arg, &bt->conc) || bt->conc.value == 0) {
            cli_err("bad --max-concurrency '%s' (N >= 1, or P%%)", arg);
            return -1;
        }
        req->max_concurrency = &bt->conc;
        return 1;
    case 'E':
        if (parse_amount(arg, &bt->errs)) {
            cli_err("bad --max-errors '%s' (N, or P%%)", arg);
            return -1;
        }
        bt->errs_arg = arg;
        req->max_errors = &bt->errs;
        return 1;
    case 'S':
        req->strict_errors = 1;
        return 1;
    case 'j':
        bt->json = true;
        return 1;
    case 'D':
        req->detach = 1;
        return 1;
    }
    return 0;
}

int
cli_batch_check(const struct cli_batch *bt)
{
    const Ks__BatchRequest *req = &bt->req;

    if (!req->n_agents && !req->n_selector && !req->all) {
        cli_err("no targets: give --agents A,B, --select K=V or --all");
        return -1;
    }
    if (req->all && (req->n_agents || req->n_selector)) {
        cli_err("--all takes no --agents or --select (use --select alone "
                "to filter every agent, or both --agents and --select for "
                "the listed agents that match)");
        return -1;
    }
    if (req->strict_errors && !req->max_errors) {
        cli_err("--strict-errors needs --max-errors");
        return -1;
    }
    return 0;
}

int
cmd_batch(int argc, char **argv)
{
    static const struct option lo[] = {
        CLI_BATCH_LONGOPTS,
        CLI_SPEC_LONGOPTS,
        CLI_PAYLOAD_LONGOPTS,
        {"secret-env", required_argument, 0, 'X'},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct cli_batch bt;
    struct cli_spec cs = {0};
    struct cli_conn cc = {0};
    struct cli_secrets sec = {0};
    struct cli_payload pl = {0};
    int opt, rc;

    if ((rc = cli_batch_init(&bt, argc, argv)))
        goto out;
    rc = CLI_EXIT_USAGE;
    if (cli_spec_init(&cs, bt.cap) != 0) {
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    optind = 1;
    while ((opt = getopt_long(argc, argv, "+", lo, NULL)) != -1) {
        int taken = cli_spec_opt(&cs, opt, optarg);
        if (!taken)
            taken = cli_payload_opt(&pl, opt, optarg);
        if (!taken)
            taken = cli_batch_opt(&bt, opt, optarg);
        if (taken < 0)
            goto out;
        if (taken)
            continue;
        switch (opt) {
        case 'X':
            if (cli_secret_opt(&sec, optarg) < 0)
                goto out;
            break;
        case 'h':
            fputs(batch_usage, stdout);
            rc = 0;
            goto out;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            cli_err("see kscore batch --help");
            goto out;
        }
    }
    if (bt.req.dry_run) {
        /* Only the targets: no command needed. */
        if (optind < argc && strcmp(argv[optind - 1], "--") == 0)
            cli_spec_argv(&cs, argc, argv, optind, "batch");
    } else if (cli_payload_argv(&pl, &cs, argc, argv, optind, "batch") != 0 ||
               cli_secrets_check(&sec, &cs.spec) != 0) {
        goto out;
    }
    if (cli_batch_check(&bt) != 0)
        goto out;
    if (!cs.spec.n_argv) {
        static char *true_argv[] = {"true"};
        cs.spec.argv = true_argv; /* a dry run: any valid spec */
        cs.spec.n_argv = 1;
    }
    /* The script and stdin (broadcast to every target, as clush does),
     * read whole before anything is sent; not for a dry run. */
    if (!bt.req.dry_run && (rc = cli_payload_load(&pl, &cs.spec, true)))
        goto out;
    bt.req.deliver_within_ms = cs.deliver_within_ms;
    rc = cli_batch_run(&bt, &cc, &cs.spec, &sec, NULL, NULL);
out:
    cli_batch_release(&bt);
    cli_secrets_release(&sec);
    cli_payload_release(&pl);
    cli_spec_release(&cs);
    cli_conn_release(&cc);
    return rc;
}

int
cli_batch_run(struct cli_batch *bt, struct cli_conn *cc,
              Ks__CommandSpec *spec, struct cli_secrets *sec,
              int (*prepare)(void *ud, struct evt_conn *c), void *ud)
{
    Ks__BatchRequest req = bt->req;
    struct evt_conn *c = NULL;
    natsSubscription *psub = NULL;
    Ks__BatchReply *rep = NULL;
    struct bstate st = {.results = KS_MAP_INIT, .json = bt->json};
    struct fleet_results fr = {0};
    char inbox[EVT_INBOX_MAX] = "", budget[256] = "";
    const char *errs_arg = bt->errs_arg;
    Ks__Amount errs = bt->errs;
    bool yes = bt->yes;
    long confirm_over = bt->confirm_over;
    int rc;

    pthread_mutex_init(&st.mu, NULL);
    req.spec = spec;
    if ((rc = cli_connect(cc, &c)))
        goto out;

    /* The targets first, when they are to be listed or counted: a dry
     * run, or a confirmation on a terminal. */
    bool ask = !yes && !req.dry_run && isatty(0) && isatty(2) &&
               (req.all || req.n_selector ||
                req.n_agents > (size_t)confirm_over);
    if (req.dry_run || ask) {
        Ks__BatchRequest dr = req;
        dr.dry_run = 1;
        dr.detach = 0;
        dr.progress_subject = "";
        rc = broker_batch(c, &dr, 30000, &rep);
        if (rc || rep->error_code) {
            cli_err("batch: %s", rc ? ks_strerror(rc) : rep->error);
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        size_t offline = 0;
        for (size_t i = 0; i < rep->n_targets; i++)
            offline += !rep->targets[i]->online;
        if (req.dry_run) {
            if (st.json) {
                for (size_t i = 0; i < rep->n_targets; i++) {
                    const Ks__BatchTarget *t = rep->targets[i];
                    json_t *o = json_object();
                    json_object_set_new(o, "agent_id",
                                        json_string(t->agent_id));
                    json_object_set_new(o, "online", json_boolean(t->online));
                    json_object_set_new(
                        o, "last_seen",
                        t->last_seen_us ? json_string(cli_time(t->last_seen_us))
                                        : json_null());
                    cli_print_json(o);
                }
            } else {
                printf("%-24s %-8s %s\n", "AGENT", "STATE", "LAST SEEN");
                for (size_t i = 0; i < rep->n_targets; i++) {
                    const Ks__BatchTarget *t = rep->targets[i];
                    printf("%-24s %-8s %s\n", t->agent_id,
                           t->online ? "online" : "offline",
                           t->last_seen_us ? cli_time(t->last_seen_us) : "-");
                }
                printf("%zu target(s), %zu offline: dry run, nothing run\n",
                       rep->n_targets, offline);
            }
            rc = 0;
            goto out;
        }
        if (req.all || rep->n_targets > (size_t)confirm_over) {
            char answer[16] = "";
            fprintf(stderr, "Run `%s%s` on %zu agent(s)", spec->argv[0],
                    spec->n_argv > 1 ? " ..." : "", rep->n_targets);
            if (offline)
                fprintf(stderr, " (%zu offline: they end \"no response\")",
                        offline);
            fputs("? [y/N] ", stderr);
            fflush(stderr);
            if (!fgets(answer, sizeof(answer), stdin) ||
                (answer[0] != 'y' && answer[0] != 'Y')) {
                cli_err("not confirmed: nothing run");
                rc = CLI_EXIT_USAGE;
                goto out;
            }
        }
        ks__batch_reply__free_unpacked(rep, NULL);
        rep = NULL;
    }

    /* What must be there before the request (kscore copy: the files). */
    if (prepare && (rc = prepare(ud, c)))
        goto out;
    /* Each target's value sealed to its own key (cli/cmd_secret.c). */
    if (sec && cli_secrets_seal(sec, c, req.agents, req.n_agents,
                                req.selector, req.n_selector, req.all,
                                spec)) {
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    st.tty = isatty(2);
    st.start_us = ks_mono_us();
    if (!req.detach) {
        /* Under this operator's own inbox prefix: nobody else may read
         * it (evt_inbox), and the broker publishes progress nowhere
         * else. */
        if (evt_inbox(c, inbox, sizeof(inbox)) != 0 ||
            natsConnection_Subscribe(&psub, c->nc, inbox, on_progress, &st) !=
                NATS_OK ||
            natsSubscription_SetPendingLimits(psub, -1, -1) != NATS_OK) {
            cli_err("cannot subscribe to progress");
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        natsConnection_Flush(c->nc);
        req.progress_subject = inbox;
        cli_live_catch_sigint();
    }
    if (req.detach)
        rc = broker_batch(c, &req, 30000, &rep);
    else
        rc = batch_wait(c, &req, &st, &rep);
    if (rc == BATCH_GAVE_UP) {
        /* Recorded, its end not heard of: not "not accepted" (125). */
        rc = CLI_EXIT_UNKNOWN;
        goto out;
    }
    if (rc == BATCH_DETACHED) {
        rc = 130;
        goto out;
    }
    if (rc == KS_ETIMEDOUT && !req.detach) {
        cli_err("no broker accepted the batch within %ds",
                BATCH_ACCEPT_MS / 1000);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (rc) {
        if (rc == KS_EUNAVAIL)
            cli_err("no broker is serving %s (is `kscore broker` running?)",
                    EVT_API_BATCH);
        else if (rc == KS_ETOOBIG)
            cli_err_too_large();
        else
            cli_err("batch: %s", ks_strerror(rc));
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (rep->error_code == KS_EINDOUBT) {
        rc = cli_outcome_unknown("batch", rep->error, rep->batch_id, NULL);
        goto out;
    }
    if (rep->error_code) {
        cli_err("%s", rep->error);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (req.detach) {
        if (st.json)
            cli_print_json(cli_batch_json(rep));
        else
            printf("%s\n", rep->batch_id);
        rc = 0;
        goto out;
    }
    /* Let the last progress messages land, then fill any gap from the
     * record (core NATS progress is best effort). */
    natsConnection_Flush(c->nc);
    if (psub) {
        /* Drain, not unsubscribe: a progress callback still running (its
         * message came in just before the reply) would print its target
         * while the loop below, not finding it yet, prints it again.
         * Once drained no callback runs and st.results is complete. */
        if (natsSubscription_DrainTimeout(psub, 2000) == NATS_OK)
            natsSubscription_WaitForDrainCompletion(psub, 3000);
        else
            natsSubscription_Unsubscribe(psub);
        natsSubscription_Destroy(psub);
        psub = NULL;
    }
    if (req.live_output)
        cli_stream_batch_end();
    st.total = rep->n_targets;
    if (fleet_results_load(&fr, c, rep, &st.results, st.json) != 0) {
        cli_err("out of memory");
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    pthread_mutex_lock(&st.mu);
    if (rep->counts)
        st.counts = *rep->counts;
    progress_line(&st, true);
    pthread_mutex_unlock(&st.mu);
    if (errs_arg) {
        const Ks__BatchCounts *bc = rep->counts;
        size_t used = (size_t)snprintf(
            budget, sizeof(budget),
            "error budget: --max-errors %s = %u of %zu target(s)%s: stop "
            "after more than %u error(s)%s; %u error(s)",
            errs_arg, rep->max_errors, rep->n_targets,
            errs.percent ? ", rounded down" : "", rep->max_errors,
            req.strict_errors ? " (strict)" : "", bc ? bc->errors : 0);
        if (bc && bc->errors > rep->max_errors && used < sizeof(budget))
            snprintf(budget + used, sizeof(budget) - used,
                     bc->cancelled ? ": spent, %u target(s) not started "
                                     "(Cancelled)"
                                   : ": spent",
                     bc->cancelled);
    }
    if (st.json) {
        json_t *o = cli_batch_json(rep);
        if (errs_arg)
            json_object_set_new(o, "max_errors_percent",
                                errs.percent ? json_integer(errs.value)
                                             : json_null());
        cli_print_json(o);
    } else {
        fleet_print(stdout, rep, fr.full, fr.n);
        fleet_summary(stdout, rep, budget);
    }
    rc = fleet_exit_code(rep->counts);
    if (!req.detach && cli_sigints() > 0)
        rc = 130; /* cancelled by Ctrl-C, as exec */
out:
    fleet_results_release(&fr);
    if (psub) {
        natsSubscription_Unsubscribe(psub);
        natsSubscription_Destroy(psub);
    }
    ks_map_each(&st.results, free_target, NULL);
    ks_map_clear(&st.results);
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    pthread_mutex_destroy(&st.mu);
    return rc;
}
