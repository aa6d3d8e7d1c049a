/*
 * chaos: kscore's fault-injection suite (`make chaos`, tests/chaos/README.md).
 * Private to tests/chaos/: chaos.c runs the scenarios, chaos_load.c drives
 * the stack (submitters, batches, readers, probes), chaos_check.c checks the
 * record's invariants I1..I6 and prints the tables.
 */
#ifndef KSCORE_CHAOS_H
#define KSCORE_CHAOS_H

#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "broker.h"
#include "fixture.h"

/* Target of the progress gap: losing one node or broker costs at most
 * this long without a new terminal event (issue 14). Printed, not an
 * invariant. */
#define CHAOS_GAP_TARGET_S 10.0
/* The heartbeat deadline of I3 (an agent is dead after this silence). */
#define CHAOS_HEARTBEAT_DEADLINE_MS 10000
/* I6: the system serves again within this long after a restart. */
#define CHAOS_RECOVER_LIMIT_S 10.0
/* I3 slack for the scanner's period and the commit of the terminal event. */
#define CHAOS_SLACK_MS 2000
/* Default grace of a command (docs/operating.md "Limits and defaults":
 * grace 5 s) when the spec says 0. */
#define CHAOS_DEFAULT_GRACE_MS 5000

#define CHAOS_MAX_BATCHES 16
#define CHAOS_MAX_RECOVERIES 4
#define CHAOS_MAX_AGENTS 24
#define CHAOS_SUBMITTERS 4

/* One submission through the client API. */
struct chaos_sub {
    char agent[64];
    char key[64];   /* idempotency key: the same on every retry */
    double sleep_s; /* what the command sleeps after its side effect */
    char id[37];    /* "" until accepted */
    int attempts;
    int last_err;
    int64_t accept_us; /* wall clock of the accepting reply */
};

/* A reader of the whole log (I5): what it saw, in order. */
struct chaos_reader {
    const char *name; /* "api" (kscore.api.v1.follow) or "store" */
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    int64_t *pos; /* global_pos of each event seen, in order */
    uint64_t *tx; /* its tx_id, as the reader was told */
    size_t n, cap;
    atomic_long errors; /* failed reads (retried) */
    atomic_int stop;
    struct chaos_run *run;
};

struct chaos_recovery {
    char what[64];
    double seconds; /* < 0: never within the probe window */
};

struct chaos_batch {
    char id[48]; /* "batch-<uuid>" */
    unsigned targets, conc;
    int64_t accept_us;
};

/* One scenario's run. */
struct chaos_run {
    const struct chaos_scenario *sc;
    bool short_mode;
    uint64_t seed;
    uint64_t rng;
    struct fixture_stack st;
    bool stack_up;
    char side[PATH_MAX]; /* side-effect files: <side>/<command_id> */
    int64_t t0_mono;     /* scenario start (for log lines) */
    char note[512];      /* what the fault was, where it hit */

    /* agents the scenario targets */
    char agents[CHAOS_MAX_AGENTS][64];
    unsigned nagents;
    char probe_agent[64];

    /* what every submitted command asks for */
    uint64_t deliver_ms, timeout_ms, grace_ms;

    /* submissions */
    struct chaos_sub *subs;
    size_t nsubs;
    double rate; /* submissions per second; 0: as fast as possible */
    pthread_mutex_t mu;
    size_t next;          /* next submission to take */
    atomic_long accepted; /* replies with an id */
    atomic_long finished; /* accepted or given up */
    int64_t submit_start_mono;
    pthread_t submitters[CHAOS_SUBMITTERS];
    unsigned nsubmitters;

    struct chaos_batch batches[CHAOS_MAX_BATCHES];
    unsigned nbatches;
    unsigned batch_errors;

    struct chaos_recovery rec[CHAOS_MAX_RECOVERIES];
    unsigned nrec;

    struct chaos_reader readers[2];

    /* results */
    unsigned violations[7]; /* by invariant, 1..6 */
    bool setup_failed;
    bool cluster; /* the stack is `kscore up --cluster 3` in st.dir */
    /* Every agent stays alive and heard (a broker pause): a Lost end is a
     * false one, an I2 violation. */
    bool forbid_lost;
    /* How long the record refused every write (pg-full): no end can be
     * recorded meanwhile, so it is added to I3's deadlines. */
    int64_t refused_us;
    /* The scenario's own checks that failed (chaos_fail): printed as
     * "VIOLATION S" and counted in violations[0]. */
    char fails[4][320];
    unsigned nfails;
    /* The scenario cannot run here (chaos_skip): SKIPPED, not a failure. */
    char skipped[160];
    /* tmpfs the scenario mounted (chaos_mount_small): unmounted once the
     * stack is down. */
    char mounts[2][PATH_MAX];
    unsigned nmounts;
    /* Progress: the wall clock of the fault (0: none marked), and the
     * longest time without a new terminal event of a batch target from
     * then to the last one (gap_s), and before it (gap_before_s); < 0
     * when not measured. chaos_check fills them. */
    int64_t fault_us;
    double gap_s, gap_before_s;
    struct chaos_stats {
        long submitted, accepted, recorded, ran0, ran1, ran2, lost, twice;
        double gap_s; /* progress gap after the fault; < 0: none */
    } stats;
};

struct chaos_scenario {
    const char *name;
    const char *what;
    int (*run)(struct chaos_run *r);
};

/* ---- chaos.c ------------------------------------------------------------- */
extern volatile sig_atomic_t chaos_interrupted;
/* A line "[  12.3s] name: ..." on stdout. */
void chaos_log(struct chaos_run *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Seeded PRNG of the run: uniform in [lo, hi]. */
uint64_t chaos_rand(struct chaos_run *r, uint64_t lo, uint64_t hi);
double chaos_randf(struct chaos_run *r, double lo, double hi);
void chaos_sleep_ms(int64_t ms);
double chaos_since_s(int64_t mono_us);
/* A check of the scenario's own failed: said now, a violation "S" in the
 * check, the scenario FAILs. */
void chaos_fail(struct chaos_run *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- chaos_load.c -------------------------------------------------------- */
/* The stack: nats-server, PostgreSQL, a broker with local_agents, the side
 * directory and the two readers. 0 or a negative code. */
int chaos_stack_up(struct chaos_run *r, unsigned local_agents);
void chaos_stack_down(struct chaos_run *r);
/* The two readers of I5 (chaos_stack_up starts them). */
int chaos_readers_start(struct chaos_run *r);
/* The operator's seed on a secure stack, else NULL (no credential). */
static inline const char *
chaos_nkey(const struct chaos_run *r)
{
    return r->st.secure ? r->st.operator_seed : NULL;
}

/* ---- chaos_cluster.c ----------------------------------------------------- */
/* `kscore up --cluster 3` in a new directory (st.dir is its KSCORE_HOME;
 * secure: the operator's seed), and one `kscore agent` process
 * "agent-fleet" serving ids[0..n-1] with the broker's credential. Starts
 * the readers. 0 or a negative code. */
int chaos_cluster_up(struct chaos_run *r, char (*ids)[16], unsigned n);
/* `kscore up` again: starts what is down. 0 or the exit status. */
int chaos_cluster_restart(struct chaos_run *r);
/* `kscore down` and the fleet; removes the directory unless kept. */
void chaos_cluster_down(struct chaos_run *r);
/* One `kscore agent` process `name` serving ids[0..n-1], max_concurrent. */
int chaos_agent_spawn(struct chaos_run *r, const char *name,
                      const char *const *ids, unsigned n,
                      unsigned max_concurrent);
/* As chaos_agent_spawn, through launcher (fixture_agent_spawn_via). */
int chaos_agent_spawn_via(struct chaos_run *r, const char *name,
                          const char *const *ids, unsigned n,
                          unsigned max_concurrent,
                          const char *const launcher[]);
/* Prepares n submissions round-robin over r->agents, sleeping a random
 * time in [sleep_lo, sleep_hi] s each. */
void chaos_subs_prepare(struct chaos_run *r, size_t n, double sleep_lo,
                        double sleep_hi);
/* A tmpfs of size_mb at path (made if missing), unmounted by
 * chaos_stack_down. 0, or KS_EUNAVAIL when this host cannot mount one. */
int chaos_mount_small(struct chaos_run *r, const char *path, int size_mb);
/* Starts the submitter threads over r->subs at r->rate. */
int chaos_submit_start(struct chaos_run *r);
/* Joins them (each gives up on a submission after its retry budget). */
void chaos_submit_join(struct chaos_run *r);
/* Waits until at least n submissions are accepted or all finished. */
void chaos_wait_accepted(struct chaos_run *r, long n);
/* Submits a detached batch over agents; 0 and recorded in r->batches. */
int chaos_batch_submit(struct chaos_run *r, const char *const *agents,
                       unsigned n, unsigned conc, double sleep_s);
/* Probes with `kscore exec` on agent until one succeeds; records the
 * seconds since t0_mono as a recovery named what. */
double chaos_probe(struct chaos_run *r, const char *what, const char *agent,
                   int64_t t0_mono);
/*
 * As chaos_probe, for an agent restarted (or thawed) with a backlog of its
 * own: a fresh exec would be refused as busy at once (admission, exit 75),
 * truthfully, or queue behind the backlog, which is no fault; serving
 * again is then the agent's first command started after t0_mono. With no
 * command waiting, chaos_probe. Seconds, or -1 (not within the window).
 */
double chaos_serving_again(struct chaos_run *r, const char *what,
                           const char *agent, int64_t t0_mono);
void chaos_add_recovery(struct chaos_run *r, const char *what, double s);
/* Commands of a status ("Running") on agent (NULL: any), from the
 * projection; -1 on error. */
long chaos_count_status(struct chaos_run *r, const char *status,
                        const char *agent);
/* Waits until every command is terminal, every batch ended and every
 * submission finished, or past the deadline of the last one. */
void chaos_wait_settled(struct chaos_run *r);
void chaos_readers_stop(struct chaos_run *r);
/* A shell-quoted side-effect script: echo $$ >> side/$KSCORE_COMMAND_ID. */
void chaos_script(const struct chaos_run *r, double sleep_s, char *buf,
                  size_t len);

/* ---- chaos_check.c ------------------------------------------------------- */
/* Checks I1..I6, prints the violations and the table. 0 PASS, 1 FAIL. */
int chaos_check(struct chaos_run *r);
#endif
