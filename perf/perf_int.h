/* Private to perf/: the runner, the stack and the scenarios. */
#ifndef KSCORE_PERF_INT_H
#define KSCORE_PERF_INT_H

#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>
#include <sys/types.h>

#include "broker.h"
#include "perf.h"

/* Agent ids of the `kscore agent` process the suite starts: perf-0..9. */
#define PERF_AGENTS 10
#define PERF_AGENT_PREFIX "perf-"

/* A scenario round that could not run for a reason outside the suite
 * (the batch API not served yet): not an error. */
#define PERF_SKIPPED 1

/* Set by the SIGINT/SIGTERM handler: every loop stops early. */
extern volatile sig_atomic_t perf__interrupted;

struct perf_opts {
    bool quick;         /* tiny counts: a smoke run, not a measurement */
    bool json;          /* JSON instead of the table */
    int rounds;         /* 0: each scenario's default */
    double rate;        /* sustained: commands per second */
    int duration_s;     /* sustained: length of a round */
    int window_s;       /* sustained: latency window */
    uint64_t deliver_ms; /* the loads' delivery deadline, 0: the default */
    const char *out_path; /* --out FILE, NULL: stdout */
    const char *nats_url; /* --nats: a running nats-server, NULL: private */
    const char *db;       /* --db: a running PostgreSQL, NULL: private */
    char bin_a[PATH_MAX]; /* this kscore binary */
    const char *bin_b;    /* --ab OTHER: B binary, NULL: no A/B */
};

/*
 * The servers and services of a run. nats-server and PostgreSQL live for
 * the whole run; the broker and the agent process are (re)started from a
 * given binary with a given number of local agents when a scenario needs a
 * different set-up, and for every round of an A/B.
 */
struct perf_stack {
    char dir[PATH_MAX];  /* temporary: pid files, logs, server data */
    char *nats_url;      /* malloc'd */
    char *conninfo;      /* malloc'd */
    bool own_nats, own_pg;
    char bin[PATH_MAX];  /* kscore binary of the running broker/agent (its
                            daemon half runs them); "" none */
    unsigned local_agents;
    bool agent_up;
    unsigned starts;     /* broker starts so far (state dir names) */
    pid_t broker_pid;    /* the kscore broker process (not its wrapper) */
    pid_t agent_pid;     /* the kscore agent process, or 0 */
    pid_t broker_daemon, agent_daemon; /* what stack_daemon() started */
    pid_t nats_pid;      /* the nats-server, when own_nats */
    char host[64];       /* host name up to the first dot: local agent ids */
    char pg_fsync[16], pg_sync_commit[16]; /* SHOW fsync, synchronous_commit */
    pid_t pg_pid;        /* the postmaster, when own_pg */
};

/* Starts (or adopts, with --nats/--db) nats-server and PostgreSQL. 0, or a
 * negative code with a line on stderr. */
int perf__stack_start(struct perf_stack *st, const struct perf_opts *o);
/* Stops the services and the private servers, removes the directory
 * unless keep (logs of a failed run) or KSCORE_KEEP_TMP=1. Accepts a stack
 * that never started. */
void perf__stack_stop(struct perf_stack *st, bool keep);

/*
 * Makes sure a broker from bin with local_agents local agents runs, and,
 * with agent, a `kscore agent` process serving perf-0..9; restarts them
 * when bin or local_agents differ or restart is set. Waits until the broker
 * answers and lists every agent online. KSCORE_PERF_WRAP (broker) and
 * KSCORE_PERF_WRAP_AGENT (agent) are command prefixes split on spaces ("%n"
 * becomes the start number), e.g. "heaptrack -o /tmp/h.%n".
 */
int perf__services(struct perf_stack *st, const char *bin,
                   unsigned local_agents, bool agent, bool restart);
/* Stops the broker and the agent process (TERM; they flush and exit). */
void perf__services_stop(struct perf_stack *st);

/* Connects to the stack's NATS with send_asap (latency-critical). */
int perf__connect(const struct perf_stack *st, const char *name,
                  struct evt_conn **out);

/* CPU (utime + stime, us) and RSS (VmRSS, KiB) of a process, and the CPU
 * of its children it has reaped (cutime + cstime, us). */
struct perf_proc {
    int64_t cpu_us;
    int64_t children_us;
    int64_t rss_kb;
};
int perf__proc_sample(pid_t pid, struct perf_proc *out);
/* CPU (us) of pid with what it reaped (cutime, cstime) and its live
 * children (PostgreSQL's postmaster and backends); -1 when gone. */
int64_t perf__tree_cpu_us(pid_t pid);

/*
 * What the stack spends between two samples: PostgreSQL's write
 * transactions (xids handed out: every transaction that wrote, whoever
 * ran it, and nothing else), the CPU of nats-server and PostgreSQL (when
 * the suite started them), of the broker and of the agent process, and
 * of the agent's reaped children (the commands). -1: not known.
 */
struct perf_cost {
    int64_t xid, nats_cpu_us, pg_cpu_us, broker_cpu_us, agent_cpu_us,
        children_cpu_us;
};
#define PERF_COST_UNKNOWN {-1, -1, -1, -1, -1, -1}
void perf__cost_sample(const struct perf_stack *st, struct perf_cost *out);
/* Sets, on o, pg_write_xacts_per_<unit>, nats_cpu_us_per_<unit>,
 * pg_cpu_us_per_<unit>, broker_cpu_us_per_<unit>,
 * agent_cpu_us_per_<unit> and children_cpu_us_per_<unit> between a and b
 * for `units` commands (or targets, events), those known, and
 * cpu_per_<unit>_us, the sum of the four processes' (children excluded),
 * when all four are known. */
void perf__cost_json(json_t *o, const struct perf_cost *a,
                     const struct perf_cost *b, double units,
                     const char *unit);

/* The one number a query returns (one row, one column), or -1. */
typedef struct pg_conn PGconn;
long perf__sql_long(PGconn *pg, const char *sql);
/* Removes dir and everything under it (nftw, depth first, no symlinks
 * followed); errors are ignored. */
void perf__rm_tree(const char *dir);
/* The 1-minute load average (/proc/loadavg), or -1: the machine may be
 * shared, and the report says how busy it was. */
double perf__loadavg(void);

/* ---- statistics (perf_stats.c) ---------------------------------------- */

/* Sorts v (n >= 1) ascending in place. */
void perf__sort(int64_t *v, size_t n);
/* Nearest-rank percentile p (0..100) of a sorted array (n >= 1). */
int64_t perf__pct(const int64_t *sorted, size_t n, int p);
/* Sorts lat and sets p50_us, p95_us, p99_us, max_us, mean_us on o. */
void perf__lat_json(json_t *o, int64_t *lat, size_t n);
/* Median of doubles (n >= 1; v is sorted in place). */
double perf__median(double *v, size_t n);

/*
 * Summary of rounds (an array of objects): every numeric key of the first
 * round becomes key = median over the rounds, and spread.key = [min, max].
 * Returns a new object.
 */
json_t *perf__summarize(json_t *rounds);

/* ---- scenarios -------------------------------------------------------- */

struct perf_ctx {
    const struct perf_opts *o;
    struct perf_stack *st;
    double floor_sum_us; /* this run's floors sum (median), 0 if unknown */
    double capacity_per_s; /* this run's capacity (median), 0 if unknown */
};

/* The spec every load runs: /bin/true, timeout 10 s (argv: one slot). */
void perf__true_spec(Ks__CommandSpec *spec, char **argv);

/* One round: 0 with *out (a JSON object of metrics), PERF_SKIPPED with
 * *out = {"skipped": why}, or a negative code. */
typedef int (*perf_round_fn)(struct perf_ctx *ctx, int round, json_t **out);

struct perf_scenario {
    const char *name;
    int default_rounds;
    unsigned local_agents; /* broker --local-agents */
    bool agent;            /* needs the perf-0..9 agent process */
    bool services;         /* needs a broker at all */
    bool opt_in;           /* not run unless named */
    perf_round_fn round;
};

/* Packs the CommandCompleted event event_throughput publishes (an agent's
 * result with a 23-byte stdout, from perf-0) into buf; returns its size. */
#define PERF_EVENT_BUF 1024
size_t perf__completed_pack(const char *event_id, const char *command_id,
                            uint8_t *buf);

int perf__floors_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__latency_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__process_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__events_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__batch10_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__batch1000_round(struct perf_ctx *ctx, int round, json_t **out);
/* batch_exec_10000 (perf_cluster.c): its own `kscore up --cluster 3`. */
int perf__batch10000_round(struct perf_ctx *ctx, int round, json_t **out);
/* The open-loop loads (perf_load.c). */
int perf__sustained_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__capacity_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__overload_round(struct perf_ctx *ctx, int round, json_t **out);
int perf__trace_round(struct perf_ctx *ctx, int round, json_t **out);
/* consumer_cost (perf_consumers.c): its round, and its steps table. */
int perf__consumers_round(struct perf_ctx *ctx, int round, json_t **out);
void perf__consumers_table(FILE *f, json_t *round);

/* Sleeps ms milliseconds (interrupted runs return early). */
void perf__sleep_ms(int ms);

#endif
