/*
 * kscore: the operator's binary, thin over the broker's client API
 * (client/client.h). It links NATS, protobuf and jansson, never libpq nor
 * libmicrohttpd: a `kscore exec` starts like a small C program. The
 * services, the local stack and what needs PostgreSQL are the daemon half
 * (kscore-daemon, cli/daemon.c): `kscore broker ...` and the others of
 * CLI_DAEMON_COMMANDS run it with the same argv (execv: same pid, same
 * arguments, same environment).
 */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    "       [--json] -- CMD [ARG]...   run CMD on one agent\n"
    "  batch TARGETS [RATE] [--json] [--detach] -- CMD [ARG]...\n"
    "                          run CMD on many agents (--agents, --select,\n"
    "                          --all; --max-concurrency, --max-errors)\n"
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


static const struct {
    const char *name;
    int (*fn)(int, char **);
} commands[] = {
    {"exec", cmd_exec},     {"get", cmd_get},       {"events", cmd_events},
    {"cancel", cmd_cancel}, {"agents", cmd_agents}, {"batch", cmd_batch},
    {"list", cmd_list},     {"logs", cmd_logs},
};

#define CLI_NAME(c) #c,
static const char *const daemon_commands[] = {CLI_DAEMON_COMMANDS(CLI_NAME)};
#undef CLI_NAME

/* The subcommand named name, or -1. */
static int
find_command(const char *name)
{
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (strcmp(name, commands[i].name) == 0)
            return (int)i;
    return -1;
}

static bool
is_daemon_command(const char *name)
{
    for (size_t i = 0; i < sizeof(daemon_commands) / sizeof(daemon_commands[0]);
         i++)
        if (strcmp(name, daemon_commands[i]) == 0)
            return true;
    return false;
}

/* Runs the daemon half with this argv; returns only when it cannot. */
static int
run_daemon(char **argv, const char *name)
{
    char path[PATH_MAX];
    int rc = cli_other_half(CLI_DAEMON_NAME, KSCORE_DAEMON_REL, path,
                            sizeof(path));
    if (rc == 0) {
        fflush(NULL);
        execv(path, argv);
        rc = -errno;
    }
    cli_err("cannot run `kscore %s`: its daemon half %s: %s", name,
            path[0] ? path : CLI_DAEMON_NAME, strerror(-rc));
    return CLI_EXIT_KSCORE;
}

int
main(int argc, char **argv)
{
    /* `kscore help CMD`: that command's own help. */
    if (argc >= 3 && strcmp(argv[1], "help") == 0) {
        int k = find_command(argv[2]);
        char *hargv[] = {argv[2], "--help", NULL};
        if (is_daemon_command(argv[2]))
            return run_daemon(argv, argv[2]);
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
        printf("kscore " CLI_VERSION "\n");
        return 0;
    }
    if (is_daemon_command(argv[1]))
        return run_daemon(argv, argv[1]);
    int k = find_command(argv[1]);
    if (k >= 0 && (commands[k].fn == cmd_exec || commands[k].fn == cmd_batch)) {
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
