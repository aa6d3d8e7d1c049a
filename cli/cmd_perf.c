/* kscore perf: the SLO suite. Thin: everything lives in perf/ (perf.h). */
#include "cli_int.h"
#include "perf.h"

int
cmd_perf(int argc, char **argv)
{
    return perf_main(argc, argv);
}
