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
    "  events ID [--json]      a command's events, in order (or a batch's,\n"
    "                          an operator's, an agent's stream)\n"
    "  events --follow [ID] [--since T | --from-start]\n"
    "                          events as they are recorded (from now on)\n"
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
    "  agent label ID K=V|K-...  change its signed labels (no new bundle)\n"
    "  agent list [--json]     the agent identities\n"
    "\n"
    "Every client command takes --nats URL (or $KSCORE_NATS_URL) and\n"
    "--nkey FILE (or $KSCORE_NATS_NKEY); without them the local stack and\n"
    "this login's operator are used. `kscore COMMAND --help` for details.\n"
    "Durations: 500ms, 10s, 2m, 1h (a plain number is seconds).\n";


/*
 * An operator's one request (exec, batch): once its output is out,
 * nothing the libraries' exit handlers tear down (OpenSSL's tables,
 * nats.c's threads) is worth 0.7 ms of every `kscore exec` (measured, 40
 * runs). The connection is closed; the kernel closes the rest.
 */
static int
run_and_exit(int (*fn)(int, char **), int argc, char **argv)
{
    int rc = fn(argc, argv);
    errno = 0;
    bool failed = fflush(stdout) != 0 || ferror(stdout) || cli_write_error();
    int e = cli_write_error() ? cli_write_error() : errno;
    /* A reader that went away (`kscore exec -- seq 1 200000 | head -2`):
     * die of SIGPIPE, as cat, ssh and every filter do, so the shell sees
     * 141 and says nothing (issue 24: exit 125 "Broken pipe"). */
    if (failed && e == EPIPE) {
        sigset_t pipe_set;
        sigemptyset(&pipe_set);
        sigaddset(&pipe_set, SIGPIPE);
        signal(SIGPIPE, SIG_DFL);
        sigprocmask(SIG_UNBLOCK, &pipe_set, NULL);
        raise(SIGPIPE);
    }
    /* Output that could not be written is a failure, not a success with
     * nothing shown (a full disk). */
    if (failed && rc == 0) {
        cli_err("cannot write the output: %s", strerror(e ? e : EIO));
        rc = CLI_EXIT_KSCORE;
    }
    fflush(NULL);
    _exit(rc);
}

static int
exec_then_exit(int argc, char **argv)
{
    return run_and_exit(cmd_exec, argc, argv);
}

static int
batch_then_exit(int argc, char **argv)
{
    return run_and_exit(cmd_batch, argc, argv);
}

static int
copy_then_exit(int argc, char **argv)
{
    return run_and_exit(cmd_copy, argc, argv);
}

static const struct cli_command commands[] = {
    {"exec", exec_then_exit}, {"get", cmd_get},       {"events", cmd_events},
    {"cancel", cmd_cancel},   {"agents", cmd_agents}, {"batch", batch_then_exit},
    {"list", cmd_list},       {"logs", cmd_logs},     {"copy", copy_then_exit},
};

#define CLI_NAME(c) #c,
static const char *const daemon_commands[] = {CLI_DAEMON_COMMANDS(CLI_NAME)};
#undef CLI_NAME

/* cli_main's other: a command of the daemon half runs there, with this
 * argv; returns only when it cannot (-1: name is not one of them). */
static int
run_daemon(char **argv, const char *name)
{
    char path[PATH_MAX];
    size_t i = 0;

    /* `kscore agent label` is an operator's request to the broker (no
     * PostgreSQL, no stack), so it runs here; the other agent words are
     * the daemon half's. */
    if (strcmp(name, "agent") == 0 && argv[1] && argv[2] &&
        strcmp(argv[2], "label") == 0) {
        int argc = 0;
        while (argv[2 + argc])
            argc++;
        return cmd_agent_label(argc, argv + 2);
    }

    while (i < sizeof(daemon_commands) / sizeof(daemon_commands[0]) &&
           strcmp(name, daemon_commands[i]) != 0)
        i++;
    if (i == sizeof(daemon_commands) / sizeof(daemon_commands[0]))
        return -1;
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
    return cli_main(argc, argv, commands,
                    sizeof(commands) / sizeof(commands[0]), usage,
                    run_daemon);
}
