/*
 * out_stream.c: output as it is written, and whole.
 *
 *  - `kscore exec` prints its command's output live (ExecuteReply.chunks,
 *    which the broker sends as the recorder records each piece) and,
 *    at the end, whatever it has not printed, read from the record
 *    (kscore.api.v1.logs), so what it prints is byte for byte the record
 *    even if a live message was lost. Ctrl-C cancels the command; a
 *    second Ctrl-C stops waiting.
 *  - `kscore logs ID [--follow] [--stdout|--stderr] [--json]`.
 *  - `kscore batch --stream`: each target's lines as "agent: line".
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli_int.h"

/* A logs page asks for this much. */
#define LOGS_PAGE (512 * 1024)
/* Pieces not recorded yet (another broker's recorder) are waited for up
 * to this long before giving up on them. */
#define LOGS_GAP_WAIT_MS 5000

static int write_errno; /* the first failed cli_write_all */

int
cli_write_error(void)
{
    return write_errno;
}

int
cli_write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w == -1) {
            if (errno == EINTR)
                continue;
            if (!write_errno)
                write_errno = errno;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void
sleep_ms(int ms)
{
    nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L},
              NULL);
}

int
cli_logs_page(struct evt_conn *c, const char *command_id, uint64_t out_off,
              uint64_t err_off, bool no_out, bool no_err,
              Ks__LogsReply **out)
{
    Ks__LogsRequest req = KS__LOGS_REQUEST__INIT;
    req.command_id = (char *)command_id;
    req.stdout_offset = out_off;
    req.stderr_offset = err_off;
    req.no_stdout = no_out;
    req.no_stderr = no_err;
    req.max_bytes = LOGS_PAGE;
    return broker_call(c, EVT_API_LOGS, &req.base,
                       &ks__logs_reply__descriptor, 10000,
                       (ProtobufCMessage **)out);
}

int
cli_output_range(struct evt_conn *c, const char *command_id, int stream,
                 uint64_t from, uint64_t to, int fd, struct cli_bytes *acc)
{
    int64_t stalled_since = 0;
    while (from < to) {
        Ks__LogsReply *r = NULL;
        int rc = cli_logs_page(c, command_id, stream == 1 ? from : 0,
                               stream == 2 ? from : 0, stream != 1,
                               stream != 2, &r);
        if (rc)
            return rc;
        if (r->error_code) {
            rc = r->error_code;
            cli_err("logs: %s", r->error);
            ks__logs_reply__free_unpacked(r, NULL);
            return rc;
        }
        ProtobufCBinaryData *d = stream == 1 ? &r->stdout : &r->stderr;
        size_t n = d->len;
        if (n > to - from)
            n = (size_t)(to - from);
        if (n) {
            stalled_since = 0;
            if (fd >= 0)
                cli_write_all(fd, d->data, n);
            if (acc) {
                uint8_t *p = realloc(acc->data, acc->len + n + 1);
                if (!p) {
                    ks__logs_reply__free_unpacked(r, NULL);
                    return -ENOMEM;
                }
                memcpy(p + acc->len, d->data, n);
                acc->data = p;
                acc->len += n;
            }
            from += n;
        } else {
            int64_t now = ks_mono_us();
            if (!stalled_since)
                stalled_since = now;
            if (now - stalled_since > (int64_t)LOGS_GAP_WAIT_MS * 1000) {
                ks__logs_reply__free_unpacked(r, NULL);
                return KS_ETIMEDOUT;
            }
            sleep_ms(50);
        }
        ks__logs_reply__free_unpacked(r, NULL);
    }
    return 0;
}

/* ---- exec ---------------------------------------------------------------- */

static volatile sig_atomic_t exec_sigints;

static void
on_sigint(int sig)
{
    (void)sig;
    exec_sigints++;
}

void
cli_live_init(struct cli_live *lv, struct evt_conn *c, bool print, bool quiet)
{
    memset(lv, 0, sizeof(*lv));
    lv->c = c;
    lv->print = print;
    lv->quiet = quiet;
}

void
cli_live_catch_sigint(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

/* The first reply says where the command went: an offline agent is
 * waited for up to the delivery deadline, said at once. */
static void
say_target(const struct cli_live *lv, const Ks__ExecuteReply *rep)
{
    char seen[128] = "never seen";
    if (lv->quiet || !rep->agent_offline)
        return;
    if (rep->agent_last_seen_us > 0) {
        char ago[32];
        cli_ago(ago, sizeof(ago), ks_now_us() - rep->agent_last_seen_us);
        snprintf(seen, sizeof(seen), "last seen %s, %s",
                 cli_time(rep->agent_last_seen_us), ago);
    }
    cli_err("agent %s is offline (%s): waiting up to %gs for it to take "
            "command %s (Ctrl-C cancels it)",
            rep->agent_id, seen, (double)rep->deliver_within_ms / 1000.0,
            rep->command_id);
}

static void
silence_cb(bool silent, int give_up_ms, const char *command_id, void *ud)
{
    struct cli_live *lv = ud;
    char url[256] = "";
    if (lv->quiet)
        return;
    if (!silent) {
        cli_err("a broker answers again: waiting for command %s", command_id);
        return;
    }
    if (natsConnection_GetConnectedUrl(lv->c->nc, url, sizeof(url)) != NATS_OK)
        url[0] = '\0';
    if (command_id)
        cli_err("no broker answers about command %s (it is recorded and "
                "goes on): asking again for up to %ds",
                command_id, (give_up_ms + 999) / 1000);
    else
        cli_err("no broker answers on %s%s%s: waiting up to %ds for one",
                EVT_API_EXECUTE, url[0] ? " at " : "", url,
                (give_up_ms + 999) / 1000);
}

static void
live_cb(const Ks__ExecuteReply *rep, void *ud)
{
    struct cli_live *lv = ud;
    if (!lv->command_id[0] && ks_is_uuid(rep->command_id)) {
        snprintf(lv->command_id, sizeof(lv->command_id), "%s",
                 rep->command_id);
        say_target(lv, rep);
    }
    /* Said at once, on stderr, --json or not: the operator learns why the
     * wait goes on (a database refusing writes), and that it ends. */
    if (rep->notice && rep->notice[0])
        cli_err("command %s %s", lv->command_id, rep->notice);
    if (!lv->print)
        return;
    for (size_t i = 0; i < rep->n_chunks; i++) {
        const Ks__OutputChunk *ch = rep->chunks[i];
        if (ch->stream != 1 && ch->stream != 2)
            continue;
        int s = (int)ch->stream - 1;
        uint64_t end = ch->offset + ch->data.len;
        if (end <= lv->off[s])
            continue; /* printed already */
        if (ch->offset > lv->off[s]) {
            /* A live message was lost: the record has it. */
            if (cli_output_range(lv->c, lv->command_id, s + 1, lv->off[s],
                                 ch->offset, s + 1, NULL) != 0)
                continue;
            lv->off[s] = ch->offset;
        }
        size_t skip = (size_t)(lv->off[s] - ch->offset);
        cli_write_all(s + 1, ch->data.data + skip, ch->data.len - skip);
        lv->off[s] = end;
    }
}

static int
tick_cb(void *ud)
{
    struct cli_live *lv = ud;
    int n = exec_sigints;
    if (n >= 2 && lv->command_id[0]) {
        cli_err("detached: command %s goes on; follow it with: kscore logs "
                "--follow %s",
                lv->command_id, lv->command_id);
        return -EINTR;
    }
    if (n >= 2) {
        cli_err("interrupted");
        return -EINTR;
    }
    if (n >= 1 && !lv->cancel_sent && lv->command_id[0]) {
        Ks__CancelRequest req = KS__CANCEL_REQUEST__INIT;
        Ks__CancelReply *rep = NULL;
        lv->cancel_sent = true;
        req.id = lv->command_id;
        int rc = broker_call(lv->c, EVT_API_CANCEL, &req.base,
                             &ks__cancel_reply__descriptor, 10000,
                             (ProtobufCMessage **)&rep);
        if (rc || rep->error_code)
            cli_err("cannot cancel %s: %s", lv->command_id,
                    rc ? ks_strerror(rc) : rep->error);
        else
            cli_err("cancelling %s (TERM, grace, KILL); Ctrl-C again to "
                    "stop waiting",
                    lv->command_id);
        if (rep)
            ks__cancel_reply__free_unpacked(rep, NULL);
    }
    return 0;
}

void
cli_live_hooks(struct cli_live *lv, struct broker_exec_hooks *h)
{
    h->live = live_cb;
    h->tick = tick_cb;
    h->silence = silence_cb;
    h->ud = lv;
}

int
cli_sigints(void)
{
    return exec_sigints;
}

bool
cli_live_interrupted(const struct cli_live *lv)
{
    (void)lv;
    return exec_sigints > 0;
}

int
cli_live_finish(struct cli_live *lv, const char *command_id,
                Ks__CommandResult *r)
{
    int rc = 0;
    if (!r)
        return 0;
    Ks__Output *os[2] = {r->stdout, r->stderr};
    for (int s = 0; s < 2; s++) {
        Ks__Output *o = os[s];
        if (!o)
            continue;
        if (lv->print) {
            if (o->chunked_bytes && !o->data.len) {
                if (lv->off[s] < o->chunked_bytes)
                    rc = rc ? rc
                            : cli_output_range(lv->c, command_id, s + 1,
                                               lv->off[s], o->chunked_bytes,
                                               s + 1, NULL);
            } else if (lv->off[s] < o->data.len) {
                cli_write_all(s + 1, o->data.data + lv->off[s],
                         o->data.len - (size_t)lv->off[s]);
            }
        } else if (o->chunked_bytes && !o->data.len) {
            /* --json: the whole output in the object. */
            struct cli_bytes acc = {0};
            int frc = cli_output_range(lv->c, command_id, s + 1, 0,
                                       o->chunked_bytes, -1, &acc);
            o->data.data = acc.data;
            o->data.len = acc.len;
            rc = rc ? rc : frc;
        }
    }
    if (rc)
        cli_err("output of %s: %s (kscore logs %s)", command_id,
                ks_strerror(rc), command_id);
    return rc;
}

/* ---- logs ---------------------------------------------------------------- */

static const char logs_usage[] =
    "usage: kscore logs ID [--follow] [--stdout|--stderr] [--json]\n"
    "The output of a command, running or finished: stdout to stdout,\n"
    "stderr to stderr, byte for byte.\n"
    "  --follow   keep printing as the command writes; ends when it ends\n"
    "  --stdout   only stdout      --stderr   only stderr\n"
    "  --json     one object at the end: command_id, status, stdout,\n"
    "             stderr (text or null), *_base64, *_total_bytes,\n"
    "             *_truncated\n" CLI_CONN_USAGE;

static void
json_bytes(json_t *o, const char *name, const struct cli_bytes *b, bool want)
{
    char key[64];
    if (!want)
        return;
    json_t *tmp = json_object();
    Ks__Output out = KS__OUTPUT__INIT;
    out.data.data = b->data;
    out.data.len = b->len;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
    r.stdout = &out;
    json_t *full = cli_result_json(&r);
    snprintf(key, sizeof(key), "%s", name);
    json_object_set(o, key, json_object_get(full, "stdout"));
    snprintf(key, sizeof(key), "%s_base64", name);
    json_object_set(o, key, json_object_get(full, "stdout_base64"));
    json_decref(full);
    json_decref(tmp);
}

int
cmd_logs(int argc, char **argv)
{
    static const struct option lo[] = {
        {"follow", no_argument, 0, 'f'}, {"stdout", no_argument, 0, 'o'},
        {"stderr", no_argument, 0, 'e'}, {"json", no_argument, 0, 'j'},
        CLI_CONN_LONGOPTS,               {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    bool follow = false, only_out = false, only_err = false, json = false;
    struct cli_bytes acc[2] = {{0}, {0}};
    uint64_t off[2] = {0, 0};
    Ks__LogsReply *last = NULL;
    int opt, rc = CLI_EXIT_USAGE;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (opt) {
        case 'f':
            follow = true;
            break;
        case 'o':
            only_out = true;
            break;
        case 'e':
            only_err = true;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            fputs(logs_usage, stdout);
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            cli_err("see kscore logs --help");
            goto out;
        }
    }
    if (optind != argc - 1) {
        cli_err("expected one id: usage: kscore logs ID [--follow] "
                "[--stdout|--stderr] [--json]");
        goto out;
    }
    if (!ks_is_uuid(argv[optind])) {
        cli_err("'%s' is not a command id (a UUID)%s", argv[optind],
                strncmp(argv[optind], "batch-", 6) == 0
                    ? ": a batch's outputs are in kscore get"
                    : "");
        goto out;
    }
    if (only_out && only_err) {
        cli_err("--stdout and --stderr: give one (neither: both)");
        goto out;
    }
    const char *id = argv[optind];
    if ((rc = cli_connect(&cc, &c)))
        goto out;
    for (;;) {
        Ks__LogsReply *r = NULL;
        int crc = cli_logs_page(c, id, off[0], off[1], only_err, only_out,
                                &r);
        if (crc) {
            cli_err("logs: %s", crc == KS_EUNAVAIL
                                    ? "no broker is serving it (is "
                                      "`kscore broker` running?)"
                                    : ks_strerror(crc));
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        if (r->error_code) {
            cli_err("%s", r->error);
            ks__logs_reply__free_unpacked(r, NULL);
            rc = r->error_code == KS_EINVAL ? CLI_EXIT_USAGE
                                            : CLI_EXIT_KSCORE;
            goto out;
        }
        ProtobufCBinaryData *ds[2] = {&r->stdout, &r->stderr};
        bool got = false;
        for (int s = 0; s < 2; s++) {
            if (!ds[s]->len)
                continue;
            got = true;
            if (json) {
                uint8_t *p = realloc(acc[s].data, acc[s].len + ds[s]->len);
                if (!p) {
                    rc = CLI_EXIT_KSCORE;
                    ks__logs_reply__free_unpacked(r, NULL);
                    goto out;
                }
                memcpy(p + acc[s].len, ds[s]->data, ds[s]->len);
                acc[s].data = p;
                acc[s].len += ds[s]->len;
            } else {
                cli_write_all(s + 1, ds[s]->data, ds[s]->len);
            }
        }
        off[0] = r->stdout_next;
        off[1] = r->stderr_next;
        bool ended = kproto_status_terminal(r->status);
        if (r->ended || (ended && !got) || (!follow && !got)) {
            if (ended && !r->ended && !got)
                cli_err("output of %s is not all recorded", id);
            if (last)
                ks__logs_reply__free_unpacked(last, NULL);
            last = r;
            break;
        }
        ks__logs_reply__free_unpacked(r, NULL);
        if (!got)
            sleep_ms(100);
    }
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "command_id", json_string(id));
        json_object_set_new(o, "agent_id", json_string(last->agent_id));
        json_object_set_new(o, "status",
                            json_string(kproto_status_name(last->status)));
        json_bytes(o, "stdout", &acc[0], !only_err);
        json_bytes(o, "stderr", &acc[1], !only_out);
        const Ks__CommandResult *res = last->result;
        if (res && res->stdout && !only_err) {
            json_object_set_new(o, "stdout_total_bytes",
                                json_integer((json_int_t)res->stdout->total_bytes));
            json_object_set_new(o, "stdout_truncated",
                                json_boolean(res->stdout->truncated));
        }
        if (res && res->stderr && !only_out) {
            json_object_set_new(o, "stderr_total_bytes",
                                json_integer((json_int_t)res->stderr->total_bytes));
            json_object_set_new(o, "stderr_truncated",
                                json_boolean(res->stderr->truncated));
        }
        cli_print_json(o);
    }
    rc = 0;
out:
    if (last)
        ks__logs_reply__free_unpacked(last, NULL);
    free(acc[0].data);
    free(acc[1].data);
    evt_close(c);
    cli_conn_release(&cc);
    return rc;
}

/* ---- batch --stream ------------------------------------------------------ */

/* One target's stream: bytes after the last newline wait for the rest of
 * their line. */
struct line_buf {
    uint64_t off;
    char *p;
    size_t len;
    char agent[EVT_AGENT_ID_MAX + 1];
};

static struct ks_map stream_bufs; /* "<command_id>/<stream>" -> line_buf */

static void
emit_lines(struct line_buf *lb, int fd, bool all)
{
    size_t start = 0;
    bool hidden = false;
    for (size_t i = 0; i < lb->len; i++) {
        if (lb->p[i] != '\n')
            continue;
        if (!hidden) /* the progress bar: off its line first */
            cli_status_hide(fd);
        hidden = true;
        dprintf(fd, "%s: %.*s\n", lb->agent, (int)(i - start),
                lb->p + start);
        start = i + 1;
    }
    if (all && start < lb->len) {
        if (!hidden)
            cli_status_hide(fd);
        hidden = true;
        dprintf(fd, "%s: %.*s\n", lb->agent, (int)(lb->len - start),
                lb->p + start);
        start = lb->len;
    }
    if (hidden)
        cli_status_redraw();
    memmove(lb->p, lb->p + start, lb->len - start);
    lb->len -= start;
}

void
cli_stream_batch_piece(const Ks__BatchProgress *p)
{
    if (!p->target || !p->target->command_id)
        return;
    for (size_t i = 0; i < p->n_chunks; i++) {
        const Ks__OutputChunk *ch = p->chunks[i];
        char key[64];
        if (ch->stream != 1 && ch->stream != 2)
            continue;
        snprintf(key, sizeof(key), "%s/%u", p->target->command_id,
                 ch->stream);
        struct line_buf *lb = ks_map_get(&stream_bufs, key);
        if (!lb) {
            lb = calloc(1, sizeof(*lb));
            if (!lb || ks_map_put(&stream_bufs, key, lb) != 0) {
                free(lb);
                continue;
            }
            snprintf(lb->agent, sizeof(lb->agent), "%s",
                     p->target->agent_id);
        }
        uint64_t end = ch->offset + ch->data.len;
        if (end <= lb->off)
            continue;
        size_t skip = ch->offset < lb->off ? (size_t)(lb->off - ch->offset)
                                           : 0;
        size_t n = ch->data.len - skip;
        char *np = realloc(lb->p, lb->len + n);
        if (!np)
            continue;
        lb->p = np;
        memcpy(lb->p + lb->len, ch->data.data + skip, n);
        lb->len += n;
        lb->off = end;
        emit_lines(lb, (int)ch->stream, false);
    }
}

static void
flush_one(const char *key, void *val, void *ud)
{
    struct line_buf *lb = val;
    (void)ud;
    const char *slash = strrchr(key, '/');
    emit_lines(lb, slash && slash[1] == '2' ? 2 : 1, true);
    free(lb->p);
    free(lb);
}

void
cli_stream_batch_end(void)
{
    ks_map_each(&stream_bufs, flush_one, NULL);
    ks_map_clear(&stream_bufs);
}
