/* kscore replay (daemon half: it needs PostgreSQL, so libpq). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_int.h"
#include "store.h"

/* kscore replay: rebuilds the projections from events, straight against
 * PostgreSQL (an administrator's command: it needs the database). */
int
cmd_replay(int argc, char **argv)
{
    static const struct option lo[] = {{"db", required_argument, 0, 'd'},
                                       {"json", no_argument, 0, 'j'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    const char *db = getenv("KSCORE_DB");
    char *db_env = NULL, *errmsg = NULL;
    struct store *st = NULL;
    bool json = false;
    int64_t n = 0, t0;
    int opt, rc;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'd':
            db = optarg;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            printf("usage: kscore replay [--db CONNINFO] [--json]\n"
                   "Rebuilds every projection (commands, batches, "
                   "batch_targets) from the events alone into fresh tables "
                   "and swaps them in, in one transaction.\n");
            return 0;
        default:
            return CLI_EXIT_USAGE;
        }
    }
    if (!db || !db[0])
        db = db_env = cli_env_get("KSCORE_DB");
    if (!db || !db[0]) {
        cli_err("no database: give --db CONNINFO or set KSCORE_DB (no local "
                "stack in %s)",
                cli_home());
        return CLI_EXIT_USAGE;
    }
    rc = store_open(db, &st, &errmsg);
    if (rc == 0)
        rc = store_migrate(st, &errmsg);
    t0 = ks_mono_us();
    if (rc == 0)
        rc = store_replay(st, &n, &errmsg);
    if (rc) {
        cli_err("replay: %s", errmsg ? errmsg : ks_strerror(rc));
        rc = CLI_EXIT_KSCORE;
    } else if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "events", json_integer(n));
        json_object_set_new(o, "ms",
                            json_real((double)(ks_mono_us() - t0) / 1000.0));
        cli_print_json(o);
    } else {
        printf("replayed %lld events into fresh projections in %.1f ms\n",
               (long long)n, (double)(ks_mono_us() - t0) / 1000.0);
    }
    free(errmsg);
    free(db_env);
    store_close(st);
    return rc;
}
