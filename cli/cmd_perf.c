/* kscore perf: the SLO suite. Thin: everything lives in perf/ (perf.h). */
#include <limits.h>
#include <string.h>

#include "cli_int.h"
#include "perf.h"

int
cmd_perf(int argc, char **argv)
{
    /* The binary under test is the operator's kscore (its `kscore exec`
     * processes are what exec_process times, and it runs this half for
     * the broker and the agents), not this daemon half. */
    char kscore[PATH_MAX];
    int rc = cli_other_half("kscore", KSCORE_FRONT_REL, kscore,
                            sizeof(kscore));
    if (rc) {
        cli_err("perf: cannot find the kscore binary beside %s: %s",
                CLI_DAEMON_NAME, strerror(-rc));
        return CLI_EXIT_KSCORE;
    }
    return perf_main(argc, argv, kscore);
}
