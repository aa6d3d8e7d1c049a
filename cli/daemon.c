/*
 * kscore-daemon: the daemon half of kscore (cli_int.h "two executables").
 * `kscore broker`, `kscore agent`, the local stack (`up`, `down`,
 * `status`), `replay`, `perf`, `keygen` and `operator` run here: kscore
 * runs this binary with the same argv, so argv[1] is the command's name
 * as the operator typed it. It links what only they need: libpq (store/,
 * through the broker and `replay`), libmicrohttpd (the metrics
 * endpoint), inih (the services' config files). The agent's watchdog is
 * this binary re-executed (agent/exec_watchdog.c).
 */
#include <stdio.h>
#include <string.h>

#include "cli_int.h"

#define CLI_ENTRY(c) {#c, cmd_##c},
static const struct {
    const char *name;
    int (*fn)(int, char **);
} commands[] = {CLI_DAEMON_COMMANDS(CLI_ENTRY)};
#undef CLI_ENTRY

static const char usage[] =
    "usage: kscore COMMAND [OPTIONS]\n"
    "kscore-daemon is the daemon half of kscore: run it as kscore (see\n"
    "kscore --help), which runs it for these commands:\n"
    "  up down status broker agent replay perf keygen operator\n";

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
    /* As kscore does: -h is --help before `--`. */
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
    int k = find_command(argv[1]);
    if (k >= 0)
        return commands[k].fn(argc - 1, argv + 1);
    cli_err("unknown command '%s' (the daemon half runs up, down, status, "
            "broker, agent, replay, perf, keygen, operator; see kscore "
            "--help)",
            argv[1]);
    return CLI_EXIT_USAGE;
}
