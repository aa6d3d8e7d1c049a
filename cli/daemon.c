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
#include "cli_int.h"

#define CLI_ENTRY(c) {#c, cmd_##c},
static const struct cli_command commands[] = {CLI_DAEMON_COMMANDS(CLI_ENTRY)};
#undef CLI_ENTRY

static const char usage[] =
    "usage: kscore COMMAND [OPTIONS]\n"
    "kscore-daemon is the daemon half of kscore: run it as kscore (see\n"
    "kscore --help), which runs it for these commands:\n"
    "  up down status broker agent replay perf keygen operator\n";

int
main(int argc, char **argv)
{
    return cli_main(argc, argv, commands,
                    sizeof(commands) / sizeof(commands[0]), usage, NULL);
}
