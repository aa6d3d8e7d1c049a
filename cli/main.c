/* kscore: the operator binary. Thin over the broker client API. */
#include <errno.h>
#include <stdarg.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "agent.h"
#include "cli_int.h"

static const char usage[] =
    "usage: kscore COMMAND [OPTIONS]\n"
    "\n"
    "Local stack:\n"
    "  up [--local-agents N]   start nats-server, PostgreSQL, a broker and an\n"
    "                          agent under $KSCORE_HOME\n"
    "     [--listen ADDR [--tls-name NAME]... [--mtls]]\n"
    "                          NATS on ADDR for other hosts, TLS-only\n"
    "  down                    stop everything `up` started\n"
    "  status [--json]         each part: pid, address, state\n"
    "\n"
    "Commands:\n"
    "  exec [--agent ID] [--timeout D] [--grace D] [--env K=V]... [--cwd DIR]\n"
    "       [--run-as USER[:GROUP]] [--json] -- CMD [ARG]...\n"
    "                          run CMD on one agent (its stdin: kscore's,\n"
    "                          when not a terminal, or --stdin-file FILE)\n"
    "  exec [OPTIONS] --script FILE [ARG]...   run a local script there\n"
    "  batch TARGETS [RATE] [--json] [--detach] -- CMD [ARG]...\n"
    "                          run CMD on many agents (--agents, --select,\n"
    "                          --all; --max-concurrency, --max-errors)\n"
    "  copy TARGETS [RATE] SRC... --to PATH [--mode M] [--owner U[:G]]\n"
    "                          write files on many agents, atomically\n"
    "  get ID [--json]         a command's or batch's state and result\n"
    "  logs ID [--follow] [--stdout|--stderr] [--json]\n"
    "                          a command's output, running or finished\n"
    "  events ID [--json]      a command's events, in order\n"
    "  events --follow [ID]    events as they are recorded\n"
    "  cancel ID               cancel a command (TERM, grace, KILL)\n"
    "  list [--agent ID] [--status S] [--since T] [--batch ID] [--json]\n"
    "                          history: commands and batches, newest first\n"
    "  agents [--select T] [--json]  the agents: id, online, last seen, running\n"
    "  replay [--db CONNINFO]  rebuild every projection from the events\n"
    "  perf [SCENARIO]... [--json]   the SLO suite on a private stack\n"
    "\n"
    "Services:\n"
    "  broker --nats URL --db CONNINFO --signing-key FILE [--local-agents N]\n"
    "  agent --id ID --trust-key FILE [--label K=V]... [--nats URL]\n"
    "  agent --bundle FILE     an enrolled agent (kscore agent enroll)\n"
    "  keygen [--out DIR]      an Ed25519 key pair for signing commands\n"
    "\n"
    "Identities (the local stack's NATS users):\n"
    "  operator add NAME       a new operator: its NKey seed file (0600)\n"
    "  operator list [--json]  the operators (--all: broker and agents too)\n"
    "  operator remove NAME    the operator can no longer connect\n"
    "  agent enroll ID [--label K=V]... [--out FILE] [--nats-url URL]...\n"
    "                          a remote agent's identity and bundle file\n"
    "  agent revoke ID         the agent can no longer connect\n"
    "  agent list [--json]     the agent identities\n"
    "\n"
    "Every client command takes --nats URL (or $KSCORE_NATS_URL) and\n"
    "--nkey FILE (or $KSCORE_NATS_NKEY); without them the local stack and\n"
    "this login's operator are used. `kscore COMMAND --help` for details.\n"
    "Durations: 500ms, 10s, 2m, 1h (a plain number is seconds).\n";

static bool err_as_log;

void
cli_err_as_log(void)
{
    err_as_log = true;
}

void
cli_err(const char *fmt, ...)
{
    char buf[2048], *w = buf;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    /* One line, always: libpq and nats.c messages carry newlines/tabs. */
    for (const char *r = buf; *r; r++) {
        if (*r == '\n' || *r == '\t' || *r == '\r') {
            if (w > buf && w[-1] != ' ')
                *w++ = ' ';
            continue;
        }
        *w++ = *r;
    }
    while (w > buf && w[-1] == ' ')
        w--;
    *w = '\0';
    if (err_as_log)
        ks_log(KS_LOG_ERROR, buf);
    else
        fprintf(stderr, "kscore: %s\n", buf);
}

const char *
cli_home(void)
{
    static char buf[4096];
    const char *h = getenv("KSCORE_HOME");
    if (h && h[0])
        return h;
    h = getenv("HOME");
    snprintf(buf, sizeof(buf), "%s/.local/state/kscore", h ? h : "/tmp");
    return buf;
}

char *
cli_env_get(const char *key)
{
    char path[4200], line[4096];
    size_t klen = strlen(key);
    char *val = NULL;
    FILE *f;

    snprintf(path, sizeof(path), "%s/env", cli_home());
    f = fopen(path, "re");
    if (!f)
        return NULL;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            char *v = line + klen + 1;
            v[strcspn(v, "\n")] = '\0';
            /* values are written single-quoted */
            if (v[0] == '\'' && strlen(v) >= 2 && v[strlen(v) - 1] == '\'') {
                v[strlen(v) - 1] = '\0';
                v++;
            }
            val = strdup(v);
            break;
        }
    }
    fclose(f);
    return val;
}

int
cli_conn_opt(struct cli_conn *cc, int opt, const char *arg)
{
    switch (opt) {
    case CLI_OPT_NATS:
        cc->nats_url = arg;
        return 1;
    case CLI_OPT_NATS + 1:
        cc->opts.user = arg;
        return 1;
    case CLI_OPT_NATS + 2:
        cc->opts.password = arg;
        return 1;
    case CLI_OPT_NATS + 3:
        cc->opts.creds_file = arg;
        return 1;
    case CLI_OPT_NATS + 4:
        cc->opts.token = arg;
        return 1;
    case CLI_OPT_NATS + 5:
        cc->opts.tls_ca = arg;
        return 1;
    case CLI_OPT_NATS + 6:
        cc->opts.tls_cert = arg;
        return 1;
    case CLI_OPT_NATS + 7:
        cc->opts.tls_key = arg;
        return 1;
    case CLI_OPT_NATS + 8:
        cc->opts.nkey_file = arg;
        return 1;
    }
    return 0;
}

static void
env_default(const char **field, const char *name)
{
    const char *v = getenv(name);
    if (!*field && v && v[0])
        *field = v;
}

void
cli_conn_env(struct cli_conn *cc)
{
    env_default(&cc->nats_url, "KSCORE_NATS_URL");
    env_default(&cc->opts.user, "KSCORE_NATS_USER");
    env_default(&cc->opts.password, "KSCORE_NATS_PASSWORD");
    env_default(&cc->opts.creds_file, "KSCORE_NATS_CREDS");
    env_default(&cc->opts.token, "KSCORE_NATS_TOKEN");
    env_default(&cc->opts.tls_ca, "KSCORE_NATS_TLS_CA");
    env_default(&cc->opts.tls_cert, "KSCORE_NATS_TLS_CERT");
    env_default(&cc->opts.tls_key, "KSCORE_NATS_TLS_KEY");
    env_default(&cc->opts.nkey_file, "KSCORE_NATS_NKEY");
}

void
cli_conn_release(struct cli_conn *cc)
{
    for (size_t i = 0; i < sizeof(cc->owned) / sizeof(cc->owned[0]); i++) {
        free(cc->owned[i]);
        cc->owned[i] = NULL;
    }
}

int
cli_connect(struct cli_conn *cc, struct evt_conn **out)
{
    char *errmsg = NULL;
    const char *url;
    int rc;

    cli_conn_env(cc);
    url = cc->nats_url;
    {
        /* The local stack: its url, and this login's seed file, from
         * $KSCORE_HOME/env. Its credential goes only to its own url, and
         * only when no other credential was given. */
        char *env_url = cli_env_get("KSCORE_NATS_URL");
        bool local = !url || !url[0] || (env_url && strcmp(env_url, url) == 0);
        bool given = cc->opts.nkey_file || cc->opts.user ||
                     cc->opts.creds_file || cc->opts.token;
        if (!url || !url[0])
            url = env_url;
        cc->owned[0] = env_url;
        if (local && !given &&
            (cc->owned[1] = cli_env_get("KSCORE_NATS_NKEY")))
            cc->opts.nkey_file = cc->owned[1];
        /* `kscore up --listen`: the stack's CA (and, with --mtls, this
         * login's client certificate), unless TLS files were given. */
        if (local && !cc->opts.tls_ca &&
            (cc->owned[2] = cli_env_get("KSCORE_NATS_TLS_CA")))
            cc->opts.tls_ca = cc->owned[2];
        if (local && !cc->opts.tls_cert &&
            (cc->owned[3] = cli_env_get("KSCORE_NATS_TLS_CERT")) &&
            (cc->owned[4] = cli_env_get("KSCORE_NATS_TLS_KEY"))) {
            cc->opts.tls_cert = cc->owned[3];
            cc->opts.tls_key = cc->owned[4];
        }
    }
    if (!url || !url[0]) {
        cli_err("no NATS url: give --nats URL, set KSCORE_NATS_URL, or start "
                "the local stack with `kscore up` (looked in %s/env)",
                cli_home());
        return CLI_EXIT_KSCORE;
    }
    cc->opts.send_asap = true;
    cc->opts.name = "kscore-cli";
    rc = evt_connect(url, &cc->opts, out, &errmsg);
    if (rc) {
        cli_err("%s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return CLI_EXIT_KSCORE;
    }
    return 0;
}

int
cli_spec_init(struct cli_spec *cs, size_t cap)
{
    memset(cs, 0, sizeof(*cs));
    ks__command_spec__init(&cs->spec);
    cs->envs = calloc(cap + 1, sizeof(*cs->envs));
    cs->envp = calloc(cap + 1, sizeof(*cs->envp));
    cs->cap = cap;
    cs->spec.env = cs->envp;
    return cs->envs && cs->envp ? 0 : -ENOMEM;
}

void
cli_spec_release(struct cli_spec *cs)
{
    free(cs->envs);
    free(cs->envp);
    cs->envs = NULL;
    cs->envp = NULL;
}

int
cli_spec_argv(struct cli_spec *cs, int argc, char **argv, int optind,
              const char *name)
{
    if (optind >= argc || strcmp(argv[optind - 1], "--") != 0) {
        if (optind < argc)
            cli_err("missing -- before the command: kscore %s [OPTIONS] -- "
                    "%s ...",
                    name, argv[optind]);
        else
            cli_err("no command given: kscore %s [OPTIONS] -- CMD [ARG]...",
                    name);
        return -1;
    }
    if (!argv[optind][0]) {
        cli_err("empty command name");
        return -1;
    }
    cs->spec.argv = argv + optind;
    cs->spec.n_argv = (size_t)(argc - optind);
    return 0;
}

static int
duration_opt(const char *name, const char *arg, uint64_t *ms)
{
    if (cli_parse_duration(arg, ms) == 0)
        return 1;
    cli_err("bad duration '%s' for --%s (use 500ms, 10s, 2m, 1h)", arg, name);
    return -1;
}

int
cli_spec_opt(struct cli_spec *cs, int opt, char *arg)
{
    switch (opt) {
    case CLI_OPT_SPEC:
        return duration_opt("timeout", arg, &cs->spec.timeout_ms);
    case CLI_OPT_SPEC + 1:
        return duration_opt("grace", arg, &cs->spec.grace_ms);
    case CLI_OPT_SPEC + 2: {
        char *eq = strchr(arg, '=');
        if (!eq || eq == arg || cs->spec.n_env >= cs->cap) {
            cli_err("bad --env '%s': expected NAME=VALUE", arg);
            return -1;
        }
        *eq = '\0';
        Ks__EnvVar *ev = &cs->envs[cs->spec.n_env];
        ks__env_var__init(ev);
        ev->name = arg;
        ev->value = eq + 1;
        cs->envp[cs->spec.n_env++] = ev;
        return 1;
    }
    case CLI_OPT_SPEC + 3:
        cs->spec.cwd = arg;
        return 1;
    case CLI_OPT_SPEC + 4:
        return duration_opt("deliver-within", arg, &cs->deliver_within_ms);
    case CLI_OPT_SPEC + 5: {
        /* Bytes kept per stream: N, NK, NM, NG (powers of 1024). */
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(arg, &end, 10);
        unsigned long long mul = 1;
        if (end && (*end == 'k' || *end == 'K'))
            mul = 1024, end++;
        else if (end && (*end == 'm' || *end == 'M'))
            mul = 1024 * 1024, end++;
        else if (end && (*end == 'g' || *end == 'G'))
            mul = 1024 * 1024 * 1024, end++;
        if (errno || end == arg || *end || arg[0] == '-' || v == 0 ||
            v > EXEC_OUTPUT_CAP_MAX / mul) {
            cli_err("bad --max-output '%s': bytes per stream, 1 to 1G "
                    "(K, M, G suffixes)",
                    arg);
            return -1;
        }
        cs->spec.stdout_cap_bytes = cs->spec.stderr_cap_bytes =
            (uint32_t)(v * mul);
        return 1;
    }
    }
    return 0;
}

int
cli_parse_duration(const char *s, uint64_t *ms_out)
{
    char *end = NULL;
    double v;

    if (!s || !s[0])
        return -1;
    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || v < 0 || v != v)
        return -1;
    if (!*end || strcmp(end, "s") == 0)
        v *= 1000;
    else if (strcmp(end, "ms") == 0)
        ;
    else if (strcmp(end, "m") == 0)
        v *= 60 * 1000;
    else if (strcmp(end, "h") == 0)
        v *= 3600 * 1000;
    else
        return -1;
    if (v > 365.0 * 24 * 3600 * 1000)
        return -1;
    *ms_out = (uint64_t)(v + 0.5);
    return 0;
}

const char *
cli_time(int64_t us)
{
    static char buf[64];
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    char base[32];

    if (us <= 0)
        return "";
    gmtime_r(&t, &tm);
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf, sizeof(buf), "%s.%06ldZ", base, (long)(us % 1000000));
    return buf;
}

int
cli_outcome_unknown(const char *what, const char *error,
                    const char *command_id, const char *key)
{
    cli_err("%s", error);
    if (command_id && command_id[0])
        cli_err("the outcome is unknown (not \"not recorded\"): look %s %s "
                "up with `kscore get %s`",
                what, command_id, command_id);
    else if (key && key[0])
        cli_err("the outcome is unknown: the %s may be recorded (and run); "
                "asking again with --idempotency-key %s is safe",
                what, key);
    else
        cli_err("the outcome is unknown: the %s may be recorded (and run); "
                "look for it with `kscore list`",
                what);
    return CLI_EXIT_UNKNOWN;
}

int
cli_exit_status(const Ks__CommandResult *r)
{
    if (!r)
        return CLI_EXIT_KSCORE;
    if (r->status == KS__COMMAND_STATUS__START_FAILED)
        return r->start_errno == ENOENT && strcmp(r->start_stage, "exec") == 0
                   ? CLI_EXIT_NOT_FOUND
                   : CLI_EXIT_CANNOT_RUN;
    if (r->timed_out)
        return CLI_EXIT_TIMEDOUT;
    if (r->signal > 0)
        return 128 + r->signal;
    if (r->has_exit_code)
        return r->exit_code;
    return CLI_EXIT_KSCORE; /* Undeliverable, Lost, Cancelled, Rejected */
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
} commands[] = {
    {"up", cmd_up},         {"down", cmd_down},     {"status", cmd_status},
    {"broker", cmd_broker}, {"agent", cmd_agent},   {"exec", cmd_exec},
    {"get", cmd_get},       {"events", cmd_events}, {"cancel", cmd_cancel},
    {"agents", cmd_agents}, {"replay", cmd_replay}, {"batch", cmd_batch},
    {"keygen", cmd_keygen}, {"operator", cmd_operator},
    {"perf", cmd_perf},
    {"list", cmd_list},
    {"logs", cmd_logs},
    {"copy", cmd_copy},
};

/* The subcommand named name, or -1. */
static int
find_command(const char *name)
{
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (strcmp(name, commands[i].name) == 0)
            return (int)i;
    return -1;
}

int
main(int argc, char **argv)
{
    /* `kscore help CMD`: that command's own help. */
    if (argc >= 3 && strcmp(argv[1], "help") == 0) {
        int k = find_command(argv[2]);
        char *hargv[] = {argv[2], "--help", NULL};
        if (k < 0) {
            cli_err("unknown command '%s' (see kscore --help)", argv[2]);
            return CLI_EXIT_USAGE;
        }
        return commands[k].fn(2, hargv);
    }
    /* -h is --help on every subcommand (their getopt tables are long
     * options only); the command after `--` keeps its own -h. */
    for (int i = 2; i < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "-h") == 0)
            argv[i] = "--help";
    if (argc < 2 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("kscore 0.1.0\n");
        return 0;
    }
    int k = find_command(argv[1]);
    if (k >= 0 && (commands[k].fn == cmd_exec || commands[k].fn == cmd_batch ||
                   commands[k].fn == cmd_copy)) {
        /* An operator's one request: once its output is out, nothing the
         * libraries' exit handlers tear down (OpenSSL's tables, nats.c's
         * threads) is worth 0.7 ms of every `kscore exec` (measured,
         * 40 runs). The connection is closed; the kernel closes the
         * rest. */
        int rc = commands[k].fn(argc - 1, argv + 1);
        errno = 0;
        bool failed = fflush(stdout) != 0 || ferror(stdout) ||
                      cli_write_error();
        int e = cli_write_error() ? cli_write_error() : errno;
        /* A reader that went away (`kscore exec -- seq 1 200000 | head
         * -2`): die of SIGPIPE, as cat, ssh and every filter do, so the
         * shell sees 141 and says nothing (issue 24: exit 125 "Broken
         * pipe"). */
        if (failed && e == EPIPE) {
            sigset_t pipe_set;
            sigemptyset(&pipe_set);
            sigaddset(&pipe_set, SIGPIPE);
            signal(SIGPIPE, SIG_DFL);
            sigprocmask(SIG_UNBLOCK, &pipe_set, NULL);
            raise(SIGPIPE);
        }
        /* Output that could not be written is a failure, not a success
         * with nothing shown (a full disk). */
        if (failed && rc == 0) {
            cli_err("cannot write the output: %s", strerror(e ? e : EIO));
            rc = CLI_EXIT_KSCORE;
        }
        fflush(NULL);
        _exit(rc);
    }
    if (k >= 0)
        return commands[k].fn(argc - 1, argv + 1);
    cli_err("unknown command '%s' (see kscore --help)", argv[1]);
    return CLI_EXIT_USAGE;
}
