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
#include "out_fold.h"

static const char batch_usage[] =
    "usage: kscore batch TARGETS [RATE] [OPTIONS] -- CMD [ARG]...\n"
    "       kscore batch TARGETS [RATE] [OPTIONS] --script FILE [--] [ARG]...\n"
    "       kscore batch --rerun batch-ID [--failed | --not-succeeded] [RATE]\n"
    "                    [OUTPUT]\n"
    "Runs CMD on many agents. Exit 0 when every target succeeded, 1 when\n"
    "a target ran and failed (failed, killed, timed out, could not start),\n"
    "4 when none failed but some never ran (no response, lost, not\n"
    "started, cancelled), 2 on bad usage, 125 when kscore failed, 69 when\n"
    "the outcome is unknown (the batch may be recorded).\n"
    "Targets (resolved once, when the batch is accepted):\n"
    "  --agents A,B,C         these agents\n"
    "  --agents @FILE         the agents listed in FILE, one id a line ('#'\n"
    "                         starts a comment, blank lines skipped; @-:\n"
    "                         stdin, which the command then does not get)\n"
    "  --select TERM[,TERM]   registered agents whose labels match every\n"
    "                         term: K=V, K!=V, K=V1|V2; values are globs\n"
    "                         (role=web*). With --agents: the listed agents\n"
    "                         that match (the intersection). Repeatable.\n"
    "                         fact.K=V matches what the agent says of its\n"
    "                         host (fact.os=debian*, fact.arch=x86_64): its\n"
    "                         own word, not a signed label\n"
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
    "  --max-concurrency N|P%  at most N (or P% of the targets, >= 1) at once;\n"
    "                          whatever N, a target goes out only when its\n"
    "                          agent can take it up soon (--deliver-within\n"
    "                          runs from its own dispatch)\n"
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
    "  --waves N|P%[,N|P%]...  run the targets in waves of these sizes, in\n"
    "                          turn (as Ansible's serial: 1,10%,100% is a\n"
    "                          canary, then 10% of the targets, then the\n"
    "                          rest; the last size repeats); a wave starts\n"
    "                          when the one before has ended. --max-errors\n"
    "                          is checked at each wave's end: spent, the\n"
    "                          batch halts and the rest end Cancelled\n"
    "  --wave-pause D          wait D between two waves\n"
    "Rerun:\n"
    "  --rerun batch-ID        the same command with the same options (RATE\n"
    "                          given here replaces its own) on the targets of\n"
    "                          batch-ID that ended in error (failed, killed,\n"
    "                          timed out, could not start, no response,\n"
    "                          lost, not started): --failed, the default;\n"
    "                          --not-succeeded: every one but Succeeded\n"
    "                          (cancelled too). Recorded as its rerun.\n"
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
    uint32_t wave, waves;    /* BatchProgress: the wave now, of waves */
    int64_t next_wave_at_us; /* between two waves: the next one's start */
};

/* The progress bar on stderr, redrawn in place, on a terminal only:
 * [#####.....] done/total, counts by state, rate, ETA (cli_status_show:
 * other output erases it first and draws it again after). The final call
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
        cli_status_end();
        return;
    }
    unsigned fill = done * 20 / total;
    for (unsigned i = 0; i < 20; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[20] = '\0';
    Ks__BatchCounts shown = *c;
    shown.pending = 0; /* said by done/total */
    shown.total = 0;
    fleet_counts_text(&shown, 0, counts, sizeof(counts));
    char *of = strstr(counts, " of 0 targets");
    if (of)
        *of = '\0';
    else if (strcmp(counts, "0 targets") == 0)
        counts[0] = '\0';
    double rate = el > 0 ? done / el : 0.0;
    char wave[64] = "";
    if (st->waves && st->next_wave_at_us)
        snprintf(wave, sizeof(wave), " wave %u/%u, next in %.0fs", st->wave,
                 st->waves,
                 st->next_wave_at_us > ks_now_us()
                     ? (double)(st->next_wave_at_us - ks_now_us()) / 1e6
                     : 0.0);
    else if (st->waves)
        snprintf(wave, sizeof(wave), " wave %u/%u", st->wave, st->waves);
    if (done && done < total && rate > 0 && !st->waves)
        snprintf(eta, sizeof(eta), " ETA %.0fs", (total - done) / rate);
    char line[512];
    snprintf(line, sizeof(line), "[%s] %u/%u%s %s  %.1f/s%s", bar, done,
             total, wave, counts, rate, eta);
    cli_status_show(line);
}

/* A progress message (on the batch's inbox, "<lease>.p"); takes msg. */
static void
on_progress(struct bstate *st, natsMsg *msg)
{
    ProtobufCMessage *pm = NULL;
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
        st->wave = p->wave;
        st->waves = p->waves;
        st->next_wave_at_us = p->next_wave_at_us;
        if (p->counts) {
            st->counts = *p->counts;
            st->total = p->counts->total;
        }
        if (p->target && !ks_map_get(&st->results, p->target->command_id)) {
            if (st->json) {
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

/* Progress comes to the batch's inbox lease under this suffix. */
#define PROGRESS_SUFFIX "p"

/* 1 if msg came to the lease's progress subject. */
static bool
is_progress(struct evt_inbox *ib, natsMsg *msg)
{
    const char *base = evt_inbox_subject(ib), *subj = natsMsg_GetSubject(msg);
    size_t n = strlen(base);
    return strncmp(subj, base, n) == 0 && subj[n] == '.' &&
           strcmp(subj + n + 1, PROGRESS_SUFFIX) == 0;
}

/*
 * Sends the batch request and waits for its end, from whichever broker
 * can say: the reply from the broker driving it (the one that took the
 * request, or one that took the batch over and answers the same inbox),
 * or, every BATCH_POLL_MS without news, a get of the batch from any
 * broker. Progress on ib (its PROGRESS_SUFFIX) is shown as it comes.
 * Returns 0 with *out (the reply, maybe an error reply), BATCH_GAVE_UP
 * after telling the operator how to follow the batch, or a negative code
 * (KS_EUNAVAIL: no broker serves batches).
 */
static int
batch_wait(struct evt_conn *c, struct evt_inbox *ib,
           const Ks__BatchRequest *req, struct bstate *st,
           Ks__BatchReply **out)
{
    natsMsg *msg = NULL;
    char subject[192], id[48];
    uint8_t *buf = NULL;
    size_t len = 0;
    int64_t t0 = ks_mono_us(), answered = t0, asked = t0;
    bool silent_said = false, cancel_sent = false;
    int rc;

    /* The reply comes to this operator's own inbox (evt_inbox_take): the
     * only reply address the broker answers. */
    if ((rc = kproto_pack(&req->base, &buf, &len)) != 0)
        goto out;
    /* NATS refuses a message over its max payload with a bare error:
     * say why (the caller names the limit), as exec does. */
    if (len > KS_MAX_MESSAGE_BYTES) {
        rc = KS_ETOOBIG;
        goto out;
    }
    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_BATCH, c->identity);
    if ((rc = evt_inbox_send(ib, subject, NULL, NULL, buf, len)) != 0)
        goto out;
    for (;;) {
        int nrc = evt_inbox_next(ib, 500, &msg);
        int64_t now = ks_mono_us();
        if (nrc == 0 && is_progress(ib, msg)) {
            on_progress(st, msg);
            msg = NULL;
        } else if (nrc == 0) {
            rc = evt_unpack(&ks__batch_reply__descriptor,
                            natsMsg_GetData(msg),
                            (size_t)natsMsg_GetDataLength(msg),
                            (ProtobufCMessage **)out);
            goto out;
        } else if (nrc != KS_ETIMEDOUT) {
            /* KS_EUNAVAIL: no responders, no broker serves batches. */
            rc = nrc;
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
    free(buf);
    return rc;
}

/* The longest target list the confirmation prints (bytes of the folded
 * node set); a longer one is cut, and --dry-run lists every target. */
#define CONFIRM_TARGETS_MAX 400

/*
 * Asks on the terminal before a run on many targets, showing what the
 * operator is about to do: the whole command as a shell would read it
 * back, what travels with it (script, stdin, user, files), and the
 * targets as a folded node set (web[1-3,7]). true on y or Y.
 */
static bool
confirmed(const Ks__BatchReply *rep, const Ks__CommandSpec *spec,
          size_t offline)
{
    char answer[16] = "", *cmd = NULL, *set = NULL;
    const char **ids = calloc(rep->n_targets + 1, sizeof(*ids));
    size_t need = 1;

    for (size_t i = 0; i < spec->n_argv; i++)
        need += 4 * strlen(spec->argv[i]) + 4; /* cli_shell_join */
    cmd = malloc(need);
    if (cmd)
        cli_shell_join(spec->argv, spec->n_argv, cmd, need);
    for (size_t i = 0; ids && i < rep->n_targets; i++)
        ids[i] = rep->targets[i]->agent_id;
    if (ids)
        set = fold_nodeset(ids, rep->n_targets);
    if (set && strlen(set) > CONFIRM_TARGETS_MAX)
        strcpy(set + CONFIRM_TARGETS_MAX - 40,
               "... (--dry-run lists every target)");
    fprintf(stderr, "About to run on %zu agent%s: %s\n", rep->n_targets,
            rep->n_targets == 1 ? "" : "s", set ? set : "?");
    if (offline)
        fprintf(stderr, "  %zu offline: they end \"no response\"\n", offline);
    fprintf(stderr, "  command   %s\n", cmd ? cmd : spec->argv[0]);
    for (size_t i = 0; i < spec->n_env; i++) {
        /* NAME=VALUE as one shell word: a value's control bytes escaped */
        char *kv = NULL, *q = NULL;
        if (asprintf(&kv, "%s=%s", spec->env[i]->name,
                     spec->env[i]->value) >= 0 &&
            (q = malloc(4 * strlen(kv) + 5)))
            cli_shell_join(&kv, 1, q, 4 * strlen(kv) + 5);
        fprintf(stderr, "  env       %s\n", q ? q : spec->env[i]->name);
        free(kv);
        free(q);
    }
    cli_payload_print(stderr, spec, "  ");
    fputs("Run it? [y/N] ", stderr);
    fflush(stderr);
    free(cmd);
    free(set);
    free(ids);
    return fgets(answer, sizeof(answer), stdin) &&
           (answer[0] == 'y' || answer[0] == 'Y');
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
    bt->agents_cap = bt->cap;
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
    for (size_t i = 0; i < bt->n_owned; i++)
        free(bt->owned[i]);
    free(bt->owned);
    free(bt->agents);
    free(bt->terms);
    free(bt->waves);
    free(bt->wavep);
    bt->agents = bt->terms = bt->owned = NULL;
    bt->waves = NULL;
    bt->wavep = NULL;
}

/* One target id of --agents: checked (a usage error, exit 2, as
 * docs/operating.md "Exit codes" says,
 * where the broker would refuse it with 125) and added.
 * where: "" or "FILE:LINE: " for the message. 0 or -1 after printing. */
static int
add_agent(struct cli_batch *bt, char *id, const char *where)
{
    if (!evt_agent_id_valid(id)) {
        cli_err("%sbad agent id '%s' (letters, digits, _ and -, up to %d)",
                where[0] ? where : "--agents: ", id, EVT_AGENT_ID_MAX);
        return -1;
    }
    if (bt->req.n_agents == bt->agents_cap) {
        size_t nc = bt->agents_cap ? bt->agents_cap * 2 : 64;
        char **x = realloc(bt->agents, nc * sizeof(*x));
        if (!x) {
            cli_err("out of memory");
            return -1;
        }
        bt->agents = x;
        bt->agents_cap = nc;
    }
    bt->agents[bt->req.n_agents++] = id;
    bt->req.agents = bt->agents;
    return 0;
}

/* At most this many ids in an --agents file (a fleet). */
#define AGENTS_FILE_MAX 100000

/*
 * --agents @FILE: one id per line; '#' starts a comment (to the end of
 * the line), blank lines and the blanks around an id are skipped, as
 * pdsh -w ^FILE, clush --hostfile and Ansible inventories read them.
 * "@-" reads the ids from stdin (which the command then does not get).
 * 0, or -1 after printing what is wrong with FILE:LINE.
 */
static int
add_agents_file(struct cli_batch *bt, const char *path)
{
    bool is_stdin = strcmp(path, "-") == 0;
    const char *name = is_stdin ? "stdin" : path;
    FILE *f = is_stdin ? stdin : fopen(path, "re");
    char *line = NULL, where[PATH_MAX + 32];
    size_t cap = 0, lineno = 0, n = 0;
    ssize_t len;
    int rc = 0;

    if (!f) {
        cli_err("--agents @%s: cannot read it: %s", path, strerror(errno));
        return -1;
    }
    if (is_stdin) {
        if (bt->agents_stdin) {
            cli_err("--agents @-: stdin is read once");
            return -1;
        }
        bt->agents_stdin = true;
    }
    while (rc == 0 && (len = getline(&line, &cap, f)) != -1) {
        lineno++;
        char *p = line, *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        while (*p == ' ' || *p == '\t')
            p++;
        size_t k = strlen(p);
        while (k && (p[k - 1] == '\n' || p[k - 1] == '\r' ||
                     p[k - 1] == ' ' || p[k - 1] == '\t'))
            p[--k] = '\0';
        if (!k)
            continue;
        snprintf(where, sizeof(where), "%s:%zu: ", name, lineno);
        if (++n > AGENTS_FILE_MAX) {
            cli_err("%smore than %d agent ids", where, AGENTS_FILE_MAX);
            rc = -1;
            break;
        }
        char *id = strdup(p);
        if (!id || (bt->n_owned == bt->owned_cap &&
                    !(bt->owned = realloc(bt->owned,
                                          (bt->owned_cap = bt->owned_cap
                                                               ? bt->owned_cap * 2
                                                               : 64) *
                                              sizeof(*bt->owned))))) {
            free(id);
            cli_err("out of memory");
            rc = -1;
            break;
        }
        bt->owned[bt->n_owned++] = id;
        rc = add_agent(bt, id, where);
    }
    if (rc == 0 && ferror(f)) {
        cli_err("--agents @%s: cannot read it: %s", path, strerror(errno));
        rc = -1;
    }
    if (rc == 0 && n == 0) {
        cli_err("--agents @%s: no agent id in it", path);
        rc = -1;
    }
    free(line);
    if (!is_stdin)
        fclose(f);
    return rc;
}

/* --waves N|P%,...: each wave's size. 0 or -1 after printing. */
static int
parse_waves(struct cli_batch *bt, char *arg)
{
    size_t n = 1;
    for (const char *p = arg; *p; p++)
        n += *p == ',';
    if (n > CLI_WAVES_MAX) {
        cli_err("bad --waves '%s': at most %d waves (the last size repeats)",
                arg, CLI_WAVES_MAX);
        return -1;
    }
    free(bt->waves);
    free(bt->wavep);
    bt->waves = calloc(n, sizeof(*bt->waves));
    bt->wavep = calloc(n, sizeof(*bt->wavep));
    if (!bt->waves || !bt->wavep) {
        cli_err("out of memory");
        return -1;
    }
    size_t k = 0;
    for (char *save = NULL, *t = strtok_r(arg, ",", &save); t;
         t = strtok_r(NULL, ",", &save)) {
        if (parse_amount(t, &bt->waves[k]) || bt->waves[k].value == 0) {
            cli_err("bad --waves size '%s': N >= 1, or P%% (1-100), as "
                    "--waves 1,10%%,100%%",
                    t);
            return -1;
        }
        bt->wavep[k] = &bt->waves[k];
        k++;
    }
    if (k == 0) {
        cli_err("bad --waves '': N or P%%, comma-separated");
        return -1;
    }
    bt->req.waves = bt->wavep;
    bt->req.n_waves = k;
    return 0;
}

int
cli_batch_opt(struct cli_batch *bt, int opt, char *arg)
{
    Ks__BatchRequest *req = &bt->req;

    switch (opt) {
    case 'a': {
        if (arg[0] == '@')
            return add_agents_file(bt, arg + 1) ? -1 : 1;
        size_t cap = 1;
        for (const char *p = arg; *p; p++)
            cap += *p == ',';
        char **ids = calloc(cap, sizeof(*ids));
        size_t n = ids ? split_commas(arg, ids, cap) : 0;
        int rc = ids ? 1 : -1;
        for (size_t i = 0; rc == 1 && i < n; i++)
            if (add_agent(bt, ids[i], "") != 0)
                rc = -1;
        free(ids);
        return rc;
    }
    case 'W':
        return parse_waves(bt, arg) ? -1 : 1;
    case 'P': {
        uint64_t ms;
        if (cli_parse_duration(arg, &ms) || ms > CLI_WAVE_PAUSE_MAX_MS) {
            cli_err("bad --wave-pause '%s' (a duration: 30s, 5m; at most "
                    "24h)",
                    arg);
            return -1;
        }
        req->wave_pause_ms = ms;
        return 1;
    }
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
cli_batch_check_rate(const struct cli_batch *bt)
{
    const Ks__BatchRequest *req = &bt->req;

    if (req->strict_errors && !req->max_errors && !req->rerun_of[0]) {
        cli_err("--strict-errors needs --max-errors");
        return -1;
    }
    if (req->wave_pause_ms && !req->n_waves && !req->rerun_of[0]) {
        cli_err("--wave-pause needs --waves");
        return -1;
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
    return cli_batch_check_rate(bt);
}

int
cmd_batch(int argc, char **argv)
{
    static const struct option lo[] = {
        CLI_BATCH_LONGOPTS,
        CLI_SPEC_LONGOPTS,
        CLI_PAYLOAD_LONGOPTS,
        {"secret-env", required_argument, 0, 'X'},
        {"rerun", required_argument, 0, 'R'},
        {"failed", no_argument, 0, 'F'},
        {"not-succeeded", no_argument, 0, 'N'},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct cli_batch bt;
    struct cli_spec cs = {0};
    struct cli_conn cc = {0};
    struct cli_secrets sec = {0};
    struct cli_payload pl = {0};
    const char *command_opt = NULL; /* one of the command's options */
    bool failed = false;
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
        if (taken && !command_opt)
            command_opt = argv[optind - 1 - (optarg == argv[optind - 1])];
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
            command_opt = "--secret-env";
            break;
        case 'R':
            bt.req.rerun_of = optarg;
            break;
        case 'F':
            failed = true;
            break;
        case 'N':
            bt.req.rerun_not_succeeded = 1;
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
    if ((failed || bt.req.rerun_not_succeeded) && !bt.req.rerun_of[0]) {
        cli_err("--failed and --not-succeeded go with --rerun batch-ID");
        goto out;
    }
    if (failed && bt.req.rerun_not_succeeded) {
        cli_err("--failed or --not-succeeded: give one");
        goto out;
    }
    if (bt.req.rerun_of[0]) {
        /* The original's command and targets, as recorded. */
        if (strncmp(bt.req.rerun_of, "batch-", 6) != 0 ||
            !ks_is_uuid(bt.req.rerun_of + 6)) {
            cli_err("bad --rerun '%s': expected batch-<uuid>",
                    bt.req.rerun_of);
            goto out;
        }
        if (command_opt || optind < argc) {
            cli_err("--rerun runs %s's own command with its options: %s "
                    "is not taken (only targets' rate, --waves and output "
                    "options are)",
                    bt.req.rerun_of,
                    command_opt ? command_opt : "a command");
            goto out;
        }
        if (bt.req.n_agents || bt.req.n_selector || bt.req.all) {
            cli_err("--rerun takes no targets: they are those of %s that "
                    "did not succeed",
                    bt.req.rerun_of);
            goto out;
        }
        if (cli_batch_check_rate(&bt) != 0)
            goto out;
        rc = cli_batch_run(&bt, &cc, NULL, NULL, NULL, NULL);
        goto out;
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
    /* --agents @-: stdin held the ids, the command gets none (unless
     * --stdin-file). */
    if (bt.agents_stdin && !pl.stdin_path)
        pl.no_stdin = true;
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
    struct evt_inbox *ib = NULL;
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
        if ((req.all || rep->n_targets > (size_t)confirm_over) &&
            !confirmed(rep, spec, offline)) {
            cli_err("not confirmed: nothing run");
            rc = CLI_EXIT_USAGE;
            goto out;
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
         * it (evt_inbox_take), and the broker publishes progress nowhere
         * else. The reply comes to the same lease. */
        if (evt_inbox_take(c, NULL, &ib) != 0) {
            cli_err("cannot subscribe to progress");
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        snprintf(inbox, sizeof(inbox), "%s.%s", evt_inbox_subject(ib),
                 PROGRESS_SUFFIX);
        req.progress_subject = inbox;
        cli_live_catch_sigint();
    }
    if (req.detach)
        rc = broker_batch(c, &req, 30000, &rep);
    else
        rc = batch_wait(c, ib, &req, &st, &rep);
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
    if (ib) {
        /* What the server sent before the PONG is in the lease: shown
         * here, before the loop below looks for what is missing, so no
         * target is printed twice. */
        natsMsg *pm = NULL;
        evt_link_probe(c, 2000);
        while (evt_inbox_next(ib, 1, &pm) == 0) {
            if (is_progress(ib, pm))
                on_progress(&st, pm);
            else
                natsMsg_Destroy(pm);
        }
        evt_inbox_give(ib);
        ib = NULL;
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
    evt_inbox_give(ib);
    ks_map_each(&st.results, free_target, NULL);
    ks_map_clear(&st.results);
    if (rep)
        ks__batch_reply__free_unpacked(rep, NULL);
    evt_close(c);
    pthread_mutex_destroy(&st.mu);
    return rc;
}
