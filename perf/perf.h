/*
 * perf: kscore's SLO suite, `kscore perf` (perf/README.md).
 *
 * It drives the real system: a nats-server with JetStream file storage, a
 * PostgreSQL cluster with durability on (fsync and synchronous_commit as
 * PostgreSQL ships them; KSCORE_PG_FAST is cleared), a broker started from
 * the kscore binary itself (`kscore broker`) and agents (`kscore agent`, or
 * the broker's local agents). The servers are private to the run, in a
 * temporary directory, unless --nats/--db name running ones; the broker and
 * agents are always the suite's own. Everything the suite started is
 * stopped before perf_main() returns.
 *
 * Scenarios (each reports every round, then the median of the rounds and
 * the spread, min-max of the round values):
 *   floors            serial primitives of one command: NATS request/reply,
 *                     JetStream sync publish, PostgreSQL single-row commit,
 *                     posix_spawn + waitpid of /bin/true; p50s and sum_us
 *   command_latency   sequential ExecuteCommand of /bin/true
 *   event_throughput  async JetStream publish of CommandCompleted events and
 *                     their recording in PostgreSQL by the broker
 *   batch_exec_10     one BatchExecuteCommand across 10 local agents
 *   batch_exec_1000   the same across 1,000 local agents (opt-in)
 *   sustained         a fixed command rate across 10 agents, per window
 *
 * Threads: perf_main() runs on the caller's thread and starts its own; it
 * installs SIGINT/SIGTERM handlers for its duration so an interrupted run
 * still stops what it started.
 */
#ifndef KSCORE_PERF_H
#define KSCORE_PERF_H

/*
 * `kscore perf [SCENARIO]... [OPTIONS]`: argv[0] is "perf"; kscore_bin is
 * the operator's kscore binary under test (binary A: it runs `kscore
 * broker` and `kscore agent` through its daemon half). Prints the
 * table (or JSON) on stdout, progress and errors on stderr. Returns the
 * process exit code: 0 when every selected scenario ran (a skipped one
 * counts as run), 2 on usage errors, 125 when the stack could not be
 * started or a scenario failed.
 */
int perf_main(int argc, char **argv, const char *kscore_bin);

#endif
