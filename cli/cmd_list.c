/* kscore list: the history of commands and batches, newest first. */
#include <ctype.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "cli_int.h"

static const char list_usage[] =
    "usage: kscore list [--agent ID]... [--operator NAME] [--status S[,S]]...\n"
    "                   [--since T] [--until T] [--batch ID] [--limit N]\n"
    "                   [--json]\n"
    "Commands and batches, newest first. Without --agent and --batch: the\n"
    "commands that are not part of a batch, and the batches (one line each);\n"
    "--agent ID (repeatable, or A,B): the commands on those agents, batch\n"
    "targets included; --batch batch-<uuid>: that batch's targets.\n"
    "  --operator NAME   requested by NAME\n"
    "  --status S        any of: Pending, Dispatched, Running, Succeeded,\n"
    "                    Failed, TimedOut, StartFailed, Cancelled,\n"
    "                    Undeliverable, Lost, NotStarted; batches: Running,\n"
    "                    Succeeded, PartialFailure, Failed, Cancelled, and\n"
    "                    Completed for any that ended but Cancelled (case\n"
    "                    does not matter; `open` means\n"
    "                    Pending,Dispatched,Running)\n"
    "  --since T, --until T   requested at or after T / before T: a duration\n"
    "                    back from now (90s, 1h, `2h ago`) or an RFC 3339\n"
    "                    time (2026-12-01T08:00:00Z, +01:00 offsets,\n"
    "                    or a date: 2026-12-01, UTC midnight)\n"
    "  --limit N         at most N items (default 50; 0: all)\n"
    "  --json            one JSON object per line (as `events --json`)\n"
    "Exit 0 (also when nothing matches), 2 usage, 125 kscore failed.\n";

static const char *const known_status[] = {
    "Pending",   "Dispatched",  "Running",   "Succeeded",
    "Failed",    "TimedOut",    "StartFailed", "Cancelled",
    "Undeliverable", "Lost",    "NotStarted", "Completed",
    "PartialFailure",
};
#define N_KNOWN (sizeof(known_status) / sizeof(known_status[0]))

/* Parses T (see list_usage) into microseconds since the epoch. 0 or -1. */
int
cli_parse_time(const char *s, int64_t now_us, int64_t *us_out)
{
    char buf[64];
    uint64_t ms;
    size_t n = strlen(s);

    if (n == 0 || n >= sizeof(buf))
        return -1;
    memcpy(buf, s, n + 1);
    /* "1h ago", "1h": a duration back from now. */
    if (n > 4 && strcmp(buf + n - 4, " ago") == 0)
        buf[n - 4] = '\0';
    if (cli_parse_duration(buf, &ms) == 0) {
        *us_out = now_us - (int64_t)ms * 1000;
        return 0;
    }
    /* RFC 3339: YYYY-MM-DD[(T| )hh:mm:ss[.frac](Z|±hh:mm)], or a date. */
    struct tm tm = {0};
    const char *r = strptime(s, "%Y-%m-%d", &tm);
    long frac_us = 0, off_s = 0;
    if (!r)
        return -1;
    if (*r == 'T' || *r == 't' || *r == ' ') {
        r = strptime(r + 1, "%H:%M:%S", &tm);
        if (!r)
            return -1;
        if (*r == '.') {
            long scale = 100000;
            for (r++; isdigit((unsigned char)*r); r++, scale /= 10)
                frac_us += (*r - '0') * scale;
        }
        if (*r == 'Z' || *r == 'z') {
            r++;
        } else if (*r == '+' || *r == '-') {
            int hh, mm;
            if (sscanf(r + 1, "%2d:%2d", &hh, &mm) != 2)
                return -1;
            off_s = (hh * 3600L + mm * 60L) * (*r == '-' ? -1 : 1);
            r += 6;
        } else {
            return -1;
        }
    }
    if (*r)
        return -1;
    time_t t = timegm(&tm);
    if (t == (time_t)-1)
        return -1;
    *us_out = ((int64_t)t - off_s) * 1000000 + frac_us;
    return 0;
}

/* Adds each of a comma-separated list of statuses, as stored. */
static int
add_statuses(const char *arg, const char **out, size_t *n, size_t cap)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", arg);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t;
         t = strtok_r(NULL, ",", &save)) {
        if (strcasecmp(t, "open") == 0) {
            if (add_statuses("Pending,Dispatched,Running", out, n, cap))
                return -1;
            continue;
        }
        size_t k;
        for (k = 0; k < N_KNOWN && strcasecmp(t, known_status[k]) != 0; k++)
            ;
        if (k == N_KNOWN) {
            cli_err("unknown status '%s' for --status (see kscore list "
                    "--help)",
                    t);
            return -1;
        }
        if (*n >= cap) {
            cli_err("too many --status values");
            return -1;
        }
        out[(*n)++] = known_status[k];
    }
    return 0;
}

static json_t *
item_json(const Ks__ListItem *it)
{
    json_t *o = json_object(), *argv = json_array();
    for (size_t i = 0; i < it->n_argv; i++)
        json_array_append_new(argv, json_string(it->argv[i]));
    json_object_set_new(o, "id", json_string(it->id));
    json_object_set_new(o, "kind", json_string(it->is_batch ? "batch"
                                                            : "command"));
    json_object_set_new(o, "status", json_string(it->status));
    json_object_set_new(o, "operator", json_string(it->operator_));
    if (!it->is_batch) {
        json_object_set_new(o, "agent_id", json_string(it->agent_id));
        json_object_set_new(o, "batch_id",
                            it->batch_id[0] ? json_string(it->batch_id)
                                            : json_null());
        json_object_set_new(o, "exit_code",
                            it->has_exit_code ? json_integer(it->exit_code)
                                              : json_null());
        json_object_set_new(o, "signal", it->signal
                                             ? json_integer(it->signal)
                                             : json_null());
        json_object_set_new(o, "timed_out", json_boolean(it->timed_out));
    } else {
        json_object_set_new(o, "total", json_integer(it->total));
        json_object_set_new(o, "succeeded", json_integer(it->succeeded));
        json_object_set_new(o, "failed", json_integer(it->failed));
        json_object_set_new(o, "cancelled", json_integer(it->cancelled));
    }
    json_object_set_new(o, "argv", argv);
    json_object_set_new(o, "argv_truncated",
                        json_boolean(it->argv_truncated));
    json_object_set_new(o, "requested_at",
                        json_string(cli_time(it->requested_at_us)));
    json_object_set_new(o, "finished_at",
                        it->finished_at_us
                            ? json_string(cli_time(it->finished_at_us))
                            : json_null());
    return o;
}

static void
print_item(const Ks__ListItem *it)
{
    char outcome[48] = "", cmd[256] = "", when[32];
    size_t used = 0;

    if (it->is_batch)
        snprintf(outcome, sizeof(outcome), "%u/%u ok", it->succeeded,
                 it->total);
    else if (it->timed_out)
        snprintf(outcome, sizeof(outcome), "timeout");
    else if (it->signal)
        snprintf(outcome, sizeof(outcome), "sig %d", it->signal);
    else if (it->has_exit_code)
        snprintf(outcome, sizeof(outcome), "exit %d", it->exit_code);
    cli_shell_join(it->argv, it->n_argv, cmd, sizeof(cmd));
    used = strlen(cmd);
    if (it->argv_truncated && used < sizeof(cmd))
        snprintf(cmd + used, sizeof(cmd) - used, " ...");
    cli_printable(cmd); /* another operator's argv, maybe */
    /* Seconds are enough on a line; --json has microseconds. */
    snprintf(when, sizeof(when), "%.19sZ", cli_time(it->requested_at_us));
    printf("%-42s %-16s %-12s %-14s %-10s %-20s %s\n", it->id,
           it->is_batch ? "-" : it->agent_id, it->operator_, it->status,
           outcome, when, cmd);
}

int
cmd_list(int argc, char **argv)
{
    static const struct option lo[] = {
        {"agent", required_argument, 0, 'a'},
        {"operator", required_argument, 0, 'o'},
        {"status", required_argument, 0, 's'},
        {"since", required_argument, 0, 'S'},
        {"until", required_argument, 0, 'U'},
        {"batch", required_argument, 0, 'b'},
        {"limit", required_argument, 0, 'l'},
        {"json", no_argument, 0, 'j'},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__ListRequest req = KS__LIST_REQUEST__INIT;
    char *agents[64];
    const char *statuses[32];
    char agent_buf[4096], cursor_id[200] = "";
    size_t n_agents = 0, n_statuses = 0, agent_used = 0;
    unsigned long limit = 50, shown = 0;
    int64_t now = ks_now_us();
    bool json = false, header = false;
    int opt, rc;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end = NULL;
        switch (opt) {
        case 'a': {
            size_t n = strlen(optarg);
            if (agent_used + n + 1 > sizeof(agent_buf)) {
                cli_err("too many --agent values");
                return CLI_EXIT_USAGE;
            }
            char *copy = memcpy(agent_buf + agent_used, optarg, n + 1);
            agent_used += n + 1;
            for (char *save = NULL, *t = strtok_r(copy, ",", &save); t;
                 t = strtok_r(NULL, ",", &save)) {
                if (n_agents >= 64) {
                    cli_err("at most 64 agents for --agent");
                    return CLI_EXIT_USAGE;
                }
                if (!evt_agent_id_valid(t)) {
                    cli_err("bad agent id '%s' for --agent (letters, digits, "
                            "_ and -, up to %d)",
                            t, EVT_AGENT_ID_MAX);
                    return CLI_EXIT_USAGE;
                }
                agents[n_agents++] = t;
            }
            break;
        }
        case 'o':
            req.operator_ = optarg;
            break;
        case 's':
            if (add_statuses(optarg, statuses, &n_statuses, 32))
                return CLI_EXIT_USAGE;
            break;
        case 'S':
        case 'U':
            if (cli_parse_time(optarg, now, opt == 'S' ? &req.since_us
                                                       : &req.until_us)) {
                cli_err("bad time '%s' for --%s (a duration back from now: "
                        "1h, `30m ago`; or RFC 3339: 2026-12-01T08:00:00Z)",
                        optarg, opt == 'S' ? "since" : "until");
                return CLI_EXIT_USAGE;
            }
            break;
        case 'b':
            if (strncmp(optarg, "batch-", 6) != 0 || !ks_is_uuid(optarg + 6)) {
                cli_err("bad --batch '%s': expected batch-<uuid>", optarg);
                return CLI_EXIT_USAGE;
            }
            req.batch_id = optarg;
            break;
        case 'l':
            limit = strtoul(optarg, &end, 10);
            if (!optarg[0] || *end || optarg[0] == '-') {
                cli_err("bad --limit '%s': expected a count (0: all)",
                        optarg);
                return CLI_EXIT_USAGE;
            }
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            fputs(list_usage, stdout);
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            fputs(list_usage, stderr);
            return CLI_EXIT_USAGE;
        }
    }
    if (optind != argc) {
        cli_err("unexpected argument '%s' (see kscore list --help)",
                argv[optind]);
        return CLI_EXIT_USAGE;
    }
    if ((rc = cli_connect(&cc, &c)))
        return rc;
    req.agents = agents;
    req.n_agents = n_agents;
    req.statuses = (char **)statuses;
    req.n_statuses = n_statuses;
    for (;;) {
        Ks__ListReply *rep = NULL;
        unsigned long left = limit ? limit - shown : 1000;
        req.limit = (uint32_t)(left < 1000 ? left : 1000);
        rc = broker_call(c, EVT_API_LIST, &req.base,
                         &ks__list_reply__descriptor, 10000,
                         (ProtobufCMessage **)&rep);
        if (rc || rep->error_code) {
            cli_err("list: %s", rc ? ks_strerror(rc) : rep->error);
            if (rep)
                ks__list_reply__free_unpacked(rep, NULL);
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        if (!json && !header) {
            printf("%-42s %-16s %-12s %-14s %-10s %-20s %s\n", "ID", "AGENT",
                   "OPERATOR", "STATUS", "OUTCOME", "REQUESTED", "COMMAND");
            header = true;
        }
        for (size_t i = 0; i < rep->n_items && (!limit || shown < limit);
             i++, shown++) {
            if (json)
                cli_print_json(item_json(rep->items[i]));
            else
                print_item(rep->items[i]);
        }
        bool more = rep->more && (!limit || shown < limit);
        req.cursor_at_us = rep->cursor_at_us;
        snprintf(cursor_id, sizeof(cursor_id), "%s", rep->cursor_id);
        req.cursor_id = cursor_id;
        ks__list_reply__free_unpacked(rep, NULL);
        if (fflush(stdout) != 0 || ferror(stdout))
            break;
        if (!more)
            break;
    }
    rc = 0;
out:
    evt_close(c);
    cli_conn_release(&cc);
    return rc;
}
