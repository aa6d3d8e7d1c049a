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
    "Runs CMD on many agents. Exit 0 when every target succeeded, 1 when\n"
    "any failed or was cancelled, 125 when kscore failed, 2 on bad usage.\n"
    "Targets (resolved once, when the batch is accepted):\n"
    "  --agents A,B,C         these agents\n"
    "  --select K=V[,K=V]     online agents whose labels match every pair\n"
    "  --all                  every online agent\n"
    "Rate control:\n"
    "  --max-concurrency N|P%  at most N (or P% of the targets, >= 1) at once\n"
    "  --max-errors N|P%       once N targets failed, dispatch no more; the\n"
    "                          rest end Cancelled (in-flight ones finish)\n"
    "  --strict-errors         never more failures than --max-errors\n"
    "Command:\n"
    "  --timeout D  --grace D  --env K=V  --cwd DIR  --deliver-within D\n"
    "  --secret-env NAME       pass $NAME from your environment, sealed to\n"
    "                          each target's own key (repeatable)\n"
    "Output:\n"
    "  --json                  one JSON object per target as it ends, then a\n"
    "                          summary object\n"
    "  --detach                print the batch id and return\n"
    "  --stream                print each target's output as it comes, one\n"
    "                          \"agent: line\" per line (stderr to stderr)\n"
    "Without --detach it waits for the end. Should its broker stop, another\n"
    "broker continues the batch and it follows it there; when no broker\n"
    "answers for 20s it prints how to follow the batch and exits 125.\n"
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

static void
progress_line(struct bstate *st, bool final)
{
    double el = (double)(ks_mono_us() - st->start_us) / 1e6;
    unsigned done = st->counts.succeeded + st->counts.failed +
                    st->counts.cancelled;
    if (!st->tty || st->json)
        return;
    fprintf(stderr,
            "\r\033[K[%u/%zu] running %u, failed %u, cancelled %u, %.1fs, "
            "%.1f/s",
            done, st->total, st->counts.running, st->counts.failed,
            st->counts.cancelled, el, el > 0 ? done / el : 0.0);
    if (final)
        fputc('\n', stderr);
    st->line_shown = !final;
    fflush(stderr);
}

static json_t *
target_json(const char *batch_id, const Ks__BatchTarget *t)
{
    json_t *o = cli_result_json(t->result);
    json_object_set_new(o, "batch_id", json_string(batch_id));
    json_object_set_new(o, "agent_id", json_string(t->agent_id));
    json_object_set_new(o, "command_id", json_string(t->command_id));
    json_object_set_new(o, "status",
                        json_string(kproto_status_name(t->status)));
    return o;
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
                cli_print_json(target_json(p->batch_id, p->target));
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

static const char *
first_line(const Ks__BatchTarget *t, char *buf, size_t len)
{
    const Ks__Output *o = t->result ? t->result->stdout : NULL;
    size_t n = 0;
    if (!o || !o->data.len) {
        o = t->result ? t->result->stderr : NULL;
        if (!o || !o->data.len)
            return "";
    }
    while (n < o->data.len && n + 1 < len && o->data.data[n] != '\n') {
        unsigned char ch = o->data.data[n];
        buf[n] = ch >= 0x20 && ch != 0x7f ? (char)ch : '?';
        n++;
    }
    buf[n] = '\0';
    return buf;
}

static int
cmp_targets_by_output(const void *x, const void *y)
{
    const Ks__BatchTarget *a = *(Ks__BatchTarget *const *)x;
    const Ks__BatchTarget *b = *(Ks__BatchTarget *const *)y;
    const Ks__Output *oa = a->result ? a->result->stdout : NULL;
    const Ks__Output *ob = b->result ? b->result->stdout : NULL;
    size_t la = oa ? oa->data.len : 0, lb = ob ? ob->data.len : 0;
    int c;
    if (la != lb)
        return la < lb ? -1 : 1;
    c = la ? memcmp(oa->data.data, ob->data.data, la) : 0;
    return c ? c : strcmp(a->agent_id, b->agent_id);
}

static bool
same_output(const Ks__BatchTarget *a, const Ks__BatchTarget *b)
{
    const Ks__Output *oa = a->result ? a->result->stdout : NULL;
    const Ks__Output *ob = b->result ? b->result->stdout : NULL;
    size_t la = oa ? oa->data.len : 0, lb = ob ? ob->data.len : 0;
    return la == lb && (!la || memcmp(oa->data.data, ob->data.data, la) == 0);
}

static void
print_summary(const Ks__BatchReply *rep, Ks__BatchTarget **full, size_t n)
{
    char line[160];
    printf("%-24s %-13s %5s %10s  %s\n", "AGENT", "STATUS", "EXIT",
           "DURATION", "OUTPUT");
    for (size_t i = 0; i < n; i++) {
        const Ks__BatchTarget *t = full[i];
        const Ks__CommandResult *r = t->result;
        char exit_s[16] = "-", dur[24] = "-";
        if (r && r->has_exit_code)
            snprintf(exit_s, sizeof(exit_s), "%d", r->exit_code);
        else if (r && r->signal)
            snprintf(exit_s, sizeof(exit_s), "sig%d", r->signal);
        if (r && r->duration_us)
            snprintf(dur, sizeof(dur), "%.1fms",
                     (double)r->duration_us / 1000.0);
        printf("%-24s %-13s %5s %10s  %s\n", t->agent_id,
               kproto_status_name(t->status), exit_s, dur,
               first_line(t, line, sizeof(line)));
    }
    /* Identical outputs, grouped with the agents that produced them. */
    Ks__BatchTarget **sorted = malloc(n * sizeof(*sorted));
    if (!sorted)
        return;
    memcpy(sorted, full, n * sizeof(*sorted));
    qsort(sorted, n, sizeof(*sorted), cmp_targets_by_output);
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && same_output(sorted[i], sorted[j]))
            j++;
        const Ks__Output *o =
            sorted[i]->result ? sorted[i]->result->stdout : NULL;
        printf("---------------\n");
        for (size_t k = i; k < j; k++)
            printf("%s%s", k > i ? "," : "", sorted[k]->agent_id);
        printf(" (%zu)\n---------------\n", j - i);
        if (o && o->data.len) {
            fflush(stdout);
            fwrite(o->data.data, 1, o->data.len, stdout);
            if (o->data.data[o->data.len - 1] != '\n')
                fputc('\n', stdout);
        } else {
            printf("(no output)\n");
        }
        i = j;
    }
    free(sorted);
    printf("%s: %s (%u succeeded, %u failed, %u cancelled of %u) in %.2fs\n",
           rep->batch_id, rep->status == KS__BATCH_STATUS__BATCH_SUCCEEDED
                              ? "Succeeded"
                          : rep->status ==
                                  KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE
                              ? "PartialFailure"
                          : rep->status == KS__BATCH_STATUS__BATCH_FAILED
                              ? "Failed"
                              : "Cancelled",
           rep->counts ? rep->counts->succeeded : 0,
           rep->counts ? rep->counts->failed : 0,
           rep->counts ? rep->counts->cancelled : 0,
           rep->counts ? rep->counts->total : 0,
           (double)rep->elapsed_us / 1e6);
}

static const char *
batch_status_name(Ks__BatchStatus s)
{
    switch (s) {
    case KS__BATCH_STATUS__BATCH_RUNNING:
        return "Running";
    case KS__BATCH_STATUS__BATCH_SUCCEEDED:
        return "Succeeded";
    case KS__BATCH_STATUS__BATCH_PARTIAL_FAILURE:
        return "PartialFailure";
    case KS__BATCH_STATUS__BATCH_FAILED:
        return "Failed";
    case KS__BATCH_STATUS__BATCH_CANCELLED:
        return "Cancelled";
    default:
        return "Unknown";
    }
}

json_t *
cli_batch_json(const Ks__BatchReply *rep)
{
    json_t *o = json_object();
    json_object_set_new(o, "batch_id", json_string(rep->batch_id));
    json_object_set_new(o, "status",
                        json_string(batch_status_name(rep->status)));
    json_object_set_new(o, "total",
                        json_integer(rep->counts ? rep->counts->total : 0));
    json_object_set_new(
        o, "succeeded", json_integer(rep->counts ? rep->counts->succeeded : 0));
    json_object_set_new(o, "failed",
                        json_integer(rep->counts ? rep->counts->failed : 0));
    json_object_set_new(
        o, "cancelled", json_integer(rep->counts ? rep->counts->cancelled : 0));
    json_object_set_new(o, "running",
                        json_integer(rep->counts ? rep->counts->running : 0));
    json_object_set_new(o, "pending",
                        json_integer(rep->counts ? rep->counts->pending : 0));
    json_object_set_new(o, "elapsed_ms",
                        json_real((double)rep->elapsed_us / 1000.0));
    json_object_set_new(o, "max_concurrency",
                        json_integer(rep->max_concurrency));
    json_object_set_new(o, "max_errors", json_integer(rep->max_errors));
    json_t *targets = json_array();
    for (size_t i = 0; i < rep->n_targets; i++) {
        json_t *t = json_object();
        json_object_set_new(t, "agent_id",
                            json_string(rep->targets[i]->agent_id));
        json_object_set_new(t, "command_id",
                            json_string(rep->targets[i]->command_id));
        json_object_set_new(
            t, "status",
            json_string(kproto_status_name(rep->targets[i]->status)));
        json_array_append_new(targets, t);
    }
    json_object_set_new(o, "targets", targets);
    return o;
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
    bool silent_said = false;
    int rc;

    /* The reply comes to this operator's own inbox (evt_inbox): the only
     * reply address the broker answers. */
    if (evt_inbox(c, ib, sizeof(ib)) != 0 ||
        natsConnection_SubscribeSync(&rsub, c->nc, ib) != NATS_OK ||
        (rc = kproto_pack(&req->base, &buf, &len)) != 0) {
        rc = KS_ENATS;
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
cmd_batch(int argc, char **argv)
{
    static const struct option lo[] = {
        {"agents", required_argument, 0, 'a'},
        {"select", required_argument, 0, 's'},
        {"all", no_argument, 0, 'A'},
        {"max-concurrency", required_argument, 0, 'c'},
        {"max-errors", required_argument, 0, 'E'},
        {"strict-errors", no_argument, 0, 'S'},
        CLI_SPEC_LONGOPTS,
        {"secret-env", required_argument, 0, 'X'},
        {"json", no_argument, 0, 'j'},
        {"detach", no_argument, 0, 'D'},
        {"stream", no_argument, 0, 'T'},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    Ks__BatchRequest req = KS__BATCH_REQUEST__INIT;
    struct cli_spec cs = {0};
    Ks__Amount conc, errs;
    size_t cap = (size_t)argc * 4 + 4;
    char **agents = calloc(cap, sizeof(*agents));
    Ks__EnvVar *sel = calloc(cap, sizeof(*sel)), **selp = calloc(cap, sizeof(*selp));
    struct cli_conn cc = {0};
    struct cli_secrets sec = {0};
    struct evt_conn *c = NULL;
    natsSubscription *psub = NULL;
    Ks__BatchReply *rep = NULL;
    struct bstate st = {.results = KS_MAP_INIT};
    char inbox[EVT_INBOX_MAX] = "";
    int opt, rc = CLI_EXIT_USAGE;

    pthread_mutex_init(&st.mu, NULL);
    if (!agents || !sel || !selp || cli_spec_init(&cs, cap) != 0) {
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    optind = 1;
    while ((opt = getopt_long(argc, argv, "+", lo, NULL)) != -1) {
        int taken = cli_spec_opt(&cs, opt, optarg);
        if (taken < 0)
            goto out;
        if (taken)
            continue;
        switch (opt) {
        case 'a':
            req.n_agents += split_commas(optarg, agents + req.n_agents,
                                         cap - req.n_agents);
            break;
        case 's': {
            char *pairs[64];
            size_t np = split_commas(optarg, pairs, 64);
            for (size_t i = 0; i < np && req.n_select < cap; i++) {
                char *eq = strchr(pairs[i], '=');
                if (!eq || eq == pairs[i]) {
                    cli_err("bad --select '%s': expected KEY=VALUE[,...]",
                            pairs[i]);
                    goto out;
                }
                *eq = '\0';
                ks__env_var__init(&sel[req.n_select]);
                sel[req.n_select].name = pairs[i];
                sel[req.n_select].value = eq + 1;
                selp[req.n_select] = &sel[req.n_select];
                req.n_select++;
            }
            break;
        }
        case 'A':
            req.all = 1;
            break;
        case 'T':
            req.live_output = 1; /* cli/out_stream.c prints the pieces */
            break;
        case 'X':
            if (cli_secret_opt(&sec, optarg) < 0)
                goto out;
            break;
        case 'c':
            if (parse_amount(optarg, &conc) || conc.value == 0) {
                cli_err("bad --max-concurrency '%s' (N >= 1, or P%%)",
                        optarg);
                goto out;
            }
            req.max_concurrency = &conc;
            break;
        case 'E':
            if (parse_amount(optarg, &errs)) {
                cli_err("bad --max-errors '%s' (N, or P%%)", optarg);
                goto out;
            }
            req.max_errors = &errs;
            break;
        case 'S':
            req.strict_errors = 1;
            break;
        case 'j':
            st.json = true;
            break;
        case 'D':
            req.detach = 1;
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
    if (cli_spec_argv(&cs, argc, argv, optind, "batch") != 0 ||
        cli_secrets_check(&sec, &cs.spec) != 0)
        goto out;
    if (!req.n_agents && !req.n_select && !req.all) {
        cli_err("no targets: give --agents A,B, --select K=V or --all");
        goto out;
    }
    req.spec = &cs.spec;
    req.deliver_within_ms = cs.deliver_within_ms;
    req.agents = agents;
    req.select = selp;

    if ((rc = cli_connect(&cc, &c)))
        goto out;
    /* Each target's value sealed to its own key (cli/cmd_secret.c). */
    if (cli_secrets_seal(&sec, c, req.agents, req.n_agents, req.select,
                         req.n_select, req.all, &cs.spec)) {
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
    }
    if (req.detach)
        rc = broker_batch(c, &req, 30000, &rep);
    else
        rc = batch_wait(c, &req, &st, &rep);
    if (rc == BATCH_GAVE_UP) {
        rc = CLI_EXIT_KSCORE;
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
        else
            cli_err("batch: %s", ks_strerror(rc));
        rc = CLI_EXIT_KSCORE;
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
    Ks__BatchTarget **full = calloc(rep->n_targets + 1, sizeof(*full));
    Ks__GetReply **fetched = calloc(rep->n_targets + 1, sizeof(*fetched));
    for (size_t i = 0; full && fetched && i < rep->n_targets; i++) {
        Ks__BatchTarget *t = ks_map_get(&st.results,
                                        rep->targets[i]->command_id);
        if (!t) {
            Ks__GetRequest g = KS__GET_REQUEST__INIT;
            g.id = rep->targets[i]->command_id;
            t = rep->targets[i];
            if (broker_call(c, EVT_API_GET, &g.base,
                            &ks__get_reply__descriptor, 5000,
                            (ProtobufCMessage **)&fetched[i]) == 0 &&
                fetched[i]->command && fetched[i]->command->result) {
                /* Swap in the full result; swapped back before freeing. */
                Ks__CommandResult *mine = t->result;
                t->result = fetched[i]->command->result;
                fetched[i]->command->result = mine;
            }
            if (st.json)
                cli_print_json(target_json(rep->batch_id, t));
        }
        full[i] = t;
    }
    pthread_mutex_lock(&st.mu);
    if (rep->counts)
        st.counts = *rep->counts;
    progress_line(&st, true);
    pthread_mutex_unlock(&st.mu);
    if (st.json)
        cli_print_json(cli_batch_json(rep));
    else if (full)
        print_summary(rep, full, rep->n_targets);
    for (size_t i = 0; fetched && i < rep->n_targets; i++)
        if (fetched[i]) {
            if (fetched[i]->command) {
                Ks__CommandResult *full_r = rep->targets[i]->result;
                rep->targets[i]->result = fetched[i]->command->result;
                fetched[i]->command->result = full_r;
            }
            ks__get_reply__free_unpacked(fetched[i], NULL);
        }
    free(full);
    free(fetched);
    rc = rep->status == KS__BATCH_STATUS__BATCH_SUCCEEDED ? 0 : 1;
out:
    if (psub) {
        natsSubscription_Unsubscribe(psub);
        natsSubscription_Destroy(psub);
    }
    ks_map_each(&st.results, free_target, NULL);
    ks_map_clear(&st.results);
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    free(agents);
    free(sel);
    free(selp);
    cli_secrets_release(&sec);
    cli_spec_release(&cs);
    cli_conn_release(&cc);
    return rc;
}
