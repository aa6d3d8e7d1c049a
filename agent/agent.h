/*
 * agent: runs commands for one or more agent ids.
 *
 * Two layers, one library:
 *
 *  1. The executor (exec_*): child processes under the kill protocol. It
 *     knows nothing of NATS or SQL, so it is tested and benchmarked alone
 *     against real processes. See "Executor" below.
 *  2. The agent runtime (agent_*): the commands of each agent id from its
 *     durable JetStream consumer (which the broker provisions), the claim
 *     request to the broker, results published to KSCORE_EVENTS,
 *     heartbeats in the KSCORE_AGENTS KV bucket, all as plain NATS (no
 *     JetStream API: events.h). See "Agent runtime" below.
 *
 * Kill protocol (the invariants the executor keeps):
 *  - The child leads its own process group (POSIX_SPAWN_SETPGROUP), starts
 *    with default signal dispositions (every signal 1..NSIG-1 but SIGKILL
 *    and SIGSTOP) and an empty mask, stdin /dev/null (or a pipe the
 *    executor writes exec_spec.stdin_data to), stdout/stderr on
 *    O_CLOEXEC pipes, every other fd closed, and a soft RLIMIT_NOFILE of
 *    min(EXEC_CHILD_NOFILE_SOFT, hard) with the hard limit the agent's.
 *  - Deadlines run on CLOCK_MONOTONIC. At timeout_ms: SIGTERM to the group;
 *    grace_ms later: SIGKILL to the group. The group is the job: when the
 *    leader exits, what is left of its group gets the same TERM, grace, KILL.
 *  - The leader stays unreaped (waitid(WNOWAIT)) until its group is clean, so
 *    no signal can reach a recycled pid or pgid.
 *  - Where a cgroup v2 can be created, each job gets its own cgroup and is
 *    finished with cgroup.kill (catches setsid escapees); elsewhere the
 *    process is a child subreaper and escapees are reported as survivors.
 *    The child is born in its cgroup (clone3 CLONE_INTO_CGROUP, x86_64):
 *    moving it after posix_spawn took 25 us to 9 ms here while it already
 *    forked. Without a cgroup the same clone3 child runs, minus
 *    CLONE_INTO_CGROUP (it sets the NOFILE limit, which posix_spawn has no
 *    attribute for); where clone3 is missing (off x86_64, valgrind, an old
 *    kernel or a seccomp filter) the spawn is posix_spawn, and the child
 *    keeps the agent's soft NOFILE limit (exec_spawn.c says why no other
 *    way is safe).
 *  - The executor reaps only what is its own: each leader by pid, and the
 *    zombies its job leaves to this subreaper (same pgid, or the job's
 *    cgroup). It never calls waitpid(-1): other children of the process
 *    (a test's nats-server, say) are left alone. A leader whose status
 *    cannot be read (waitid/wait4 ECHILD: someone else reaped it) ends
 *    the job at once as EXEC_STATUS_LOST, never as exit 0.
 *
 * Process start state (exec_process_init, called first by `kscore agent`,
 * `kscore broker` and the watchdog, before any thread exists):
 *  - What an execve(2) lets through from whoever started us is the signal
 *    mask and the signals set to SIG_IGN; handlers are reset (signal(7),
 *    "Signal mask and pending signals" and "Signal dispositions";
 *    execve(2)). A parent that ignored SIGCHLD (python's
 *    signal(SIGCHLD, SIG_IGN) before exec, some init scripts) passes that
 *    on, and then "children of the calling process do not become zombies"
 *    (waitpid(2) NOTES: POSIX.1-2001 specifies that if the disposition of
 *    SIGCHLD is set to SIG_IGN ... children that terminate do not become
 *    zombies): the kernel reaps every child at once, and neither the kill
 *    protocol's unreaped leader nor an exit status is left to us.
 *  - So every ignored signal goes back to SIG_DFL, SIGCHLD always
 *    (SIG_DFL, no SA_NOCLDWAIT), the mask is emptied, and then:
 *    SIGPIPE is SIG_IGN (a write to a closed pipe or socket is EPIPE, not
 *    the agent's death with children running); SIGINT and SIGTERM are
 *    blocked in every thread and taken by sigtimedwait()/sigwait() of the
 *    main thread (cli/cmd_stack.c, broker_run); the watchdog sets its own
 *    SIGHUP handler (PR_SET_PDEATHSIG). No other signal is used: SIGHUP,
 *    SIGALRM, SIGUSR1 and SIGUSR2 keep their default action (terminate).
 *  - Children are spawned from a known state whatever the agent's own:
 *    default dispositions and an empty mask (see the kill protocol).
 */
#ifndef KSCORE_AGENT_H
#define KSCORE_AGENT_H

#include <stdbool.h>
#include <stddef.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>

#include "kproto.h"

/* ------------------------------------------------------------------------ */
/* Executor                                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Output caps, per stream. The rule: a spec cap of 0 means
 * EXEC_OUTPUT_CAP_DEFAULT; a spec cap > 0 is clamped to EXEC_OUTPUT_CAP_MAX.
 * The default is larger than the max on purpose: the default serves direct
 * users of exec_run()/exec_loop (tests, perf, local runs; K07 wants 1 MiB),
 * the max is what fits a result in one NATS message, and the agent runtime
 * always passes an explicit cap <= EXEC_OUTPUT_CAP_MAX. Past the cap, bytes
 * are read, counted in total and dropped; the child never blocks.
 */
#define EXEC_OUTPUT_CAP_DEFAULT (1024 * 1024)
/*
 * Largest cap per stream a spec may ask for (bytes). The agent sends output
 * past what fits one NATS message in pieces (OutputChunk), so this bounds
 * memory, not the message size: the executor keeps what it reads up to the
 * cap.
 */
#define EXEC_OUTPUT_CAP_MAX (1024u * 1024 * 1024)
/* The agent's cap per stream when the spec gives 0 (kscore exec
 * --max-output). */
#define EXEC_OUTPUT_CAP_AGENT_DEFAULT (16u * 1024 * 1024)
/* Grace between SIGTERM and SIGKILL when the spec gives 0 (ms). */
#define EXEC_GRACE_DEFAULT_MS 5000
/*
 * A child's soft RLIMIT_NOFILE (its hard limit is the agent's, and the
 * soft one is lower when the hard one is). systemd.exec(5), LimitNOFILE=:
 * services get a soft limit of 1024 so that programs using select(2) keep
 * working (FD_SETSIZE is 1024), while the agent itself may run with many
 * more (its unit's LimitNOFILE=, or the ulimit of the shell that ran it).
 */
#define EXEC_CHILD_NOFILE_SOFT 1024

/* The child's environment base (documented; nothing else is inherited). */
#define EXEC_BASE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define EXEC_BASE_LANG "C.UTF-8"
/* HOME is the home of the agent's user (getpwuid), "/" if it has none;
 * with exec_spec.user, that user's home, and USER and LOGNAME its name. */

struct exec_env {
    const char *name;
    const char *value; /* may be "" */
};

/*
 * A user to run a child as (exec_spec.user), resolved by the caller: name
 * lookups (getpwnam, initgroups' group scan) may block on NSS (LDAP,
 * sssd), so they never run on the loop thread. The child calls
 * setgroups(groups), setresgid(gid), setresuid(uid) before its chdir and
 * execve, so the cwd and the program are reached as that user, and a
 * non-root uid leaves no capability (capabilities(7): all of the
 * permitted and effective sets go when every uid becomes non-zero) and
 * none of the agent's groups.
 */
struct exec_user {
    uid_t uid;
    gid_t gid;              /* the primary group */
    const gid_t *groups;    /* supplementary groups, n_groups (may be 0) */
    size_t n_groups;
    const char *name;       /* the child's USER and LOGNAME */
    const char *home;       /* the child's HOME */
};

/* What to run. Borrowed by the call that takes it; copied if kept. */
struct exec_spec {
    const char *const *argv;   /* NULL-terminated, argv[0] non-empty */
    const struct exec_env *env; /* env_len entries, added to the base */
    size_t env_len;
    const char *cwd;           /* NULL or "": "/" */
    const char *command_id;    /* exported as KSCORE_COMMAND_ID; may be NULL */
    uint64_t timeout_ms;       /* 0: none */
    uint64_t grace_ms;         /* 0: EXEC_GRACE_DEFAULT_MS */
    size_t stdout_cap_bytes;   /* 0: default; else <= EXEC_OUTPUT_CAP_MAX */
    size_t stderr_cap_bytes;
    /* The child's stdin: these bytes on a pipe that the executor writes
     * (never blocking its loop) and closes after the last byte, or at
     * once when the child closes its end. NULL / 0: stdin is /dev/null. */
    const void *stdin_data;
    size_t stdin_len;
    /* NULL: the agent's own user. Needs the clone child (x86_64): where
     * only posix_spawn is left, the start fails (stage "user", ENOTSUP). */
    const struct exec_user *user;
};

enum exec_outcome {
    EXEC_EXITED = 1,      /* exit_code valid */
    EXEC_SIGNALED = 2,    /* signal valid; never reported as exit 0 */
    EXEC_START_FAILED = 3, /* start_stage + start_errno valid; no exit code */
    /*
     * The leader ran and is gone, but its exit status could not be read:
     * waitid/wait4 said wait_errno (ECHILD: someone else reaped it, e.g. the
     * kernel, when this process ignores SIGCHLD; see "Process start state").
     * No exit code, no signal; never reported as success.
     */
    EXEC_STATUS_LOST = 4
};

struct exec_output {
    char *data;        /* malloc'd, len bytes (+ NUL for convenience) */
    size_t len;        /* <= the cap */
    uint64_t total;    /* bytes the child wrote */
    bool truncated;    /* total > len */
};

struct exec_result {
    enum exec_outcome outcome;
    int exit_code;
    int signal;
    bool core_dumped;
    bool timed_out;
    bool cancelled;
    struct exec_output out, err;
    pid_t pid;
    int64_t started_at_us;  /* realtime */
    int64_t finished_at_us; /* realtime */
    int64_t duration_us;    /* monotonic, spawn -> group clean */
    int64_t term_sent_us;   /* monotonic offset from spawn; -1: not sent */
    int64_t kill_sent_us;   /* monotonic offset from spawn; -1: not sent */
    int64_t utime_us, stime_us, maxrss_kb; /* leader's rusage (wait4) */
    const char *start_stage; /* static: "chdir", "exec", "pipe", "spawn",
                                "user" */
    int start_errno;
    int wait_errno; /* EXEC_STATUS_LOST: the errno of the failed wait */
    /* Most processes one signal step (TERM, KILL) reached, leader included. */
    unsigned signalled;
    /* Alive after the protocol: in the group or cgroup 2 s after SIGKILL, or
     * (no cgroup) orphans of the job that made their own session. */
    unsigned survivors;
    /* exec_kill() ended it: SIGKILL at once, no TERM, no grace. */
    bool killed;
    /* The loop's watchdog killed it: the loop thread had given no sign of
     * life for watchdog_silence_ms (the process was stopped or hung). */
    bool watchdog_killed;
    int64_t watchdog_silence_ms;
};

/* Frees the output buffers; accepts a zeroed or NULL result. */
void exec_result_release(struct exec_result *r);

/*
 * Checks, without spawning, what would make the spawn fail: cwd (stage
 * "chdir": ENOENT, ENOTDIR, EACCES), the program (stage "exec": ENOENT,
 * EACCES for a directory or a non-executable file, ENOENT for a "#!"
 * interpreter that does not exist), argument sizes (stage "exec": E2BIG when
 * one string exceeds MAX_ARG_STRLEN or the total exceeds ARG_MAX).
 * Returns 0 if the spawn should succeed, else -errno with *stage_out set to a
 * static string. The agent calls it before claiming a command, so that a
 * start failure never records CommandStarted. The spawn stays authoritative.
 */
int exec_precheck(const struct exec_spec *spec, const char **stage_out);

/*
 * Runs one command to the end under the kill protocol, on the calling
 * thread. Returns 0 with *out filled (including start failures, which are a
 * result, not an error), or -errno / KS_EINVAL for a bad spec (empty argv).
 * The caller releases *out with exec_result_release().
 */
int exec_run(const struct exec_spec *spec, struct exec_result *out);

/*
 * An executor loop: one thread that runs many jobs at once (one epoll set
 * for all pipes, pidfds and cgroup.events, deadlines as the epoll timeout),
 * so threads do not grow with jobs.
 */
struct exec_loop;

/*
 * Called once per job on the loop thread when the job is finished (the group
 * clean). The callee owns *result and releases it with exec_result_release().
 * It must not block for long: every other job waits on this thread.
 */
typedef void (*exec_done_fn)(uint64_t job_id, struct exec_result *result,
                             void *ud);

/*
 * Called once per job on the loop thread right after its leader was
 * spawned (never for a start failure), before any output is read. Same
 * rules as exec_done_fn: it must not block.
 */
typedef void (*exec_started_fn)(uint64_t job_id, pid_t pid, void *ud);

struct exec_loop_opts {
    unsigned max_concurrent; /* >= 1: jobs running at once; more queue */
    /*
     * 0: no watchdog. Else the loop keeps a watchdog process (see
     * exec_watchdog.c): the loop thread pings it every watchdog_ms / 3 and
     * registers each job's process group and cgroup; when the process dies
     * (kill -9 included) the watchdog kills every job at once, and when the
     * loop thread is silent for watchdog_ms (the process is stopped, hung,
     * swapped out) it kills them too and says so: their results have
     * watchdog_killed set once the loop runs again. The watchdog is
     * re-executed from /proc/self/exe with nothing of this process but one
     * socket, leads its own session, and exits with the loop.
     */
    unsigned watchdog_ms;
};

/*
 * Called on the loop thread with each piece of output kept (within the
 * cap; stream 1 stdout, 2 stderr) as it is read, before the job's done
 * callback. Same rules as exec_done_fn: it must not block.
 */
typedef void (*exec_output_fn)(uint64_t job_id, int stream, const char *data,
                               size_t len, void *ud);

/*
 * Starts a loop thread. Returns 0, KS_EINVAL (max_concurrent 0) or -errno.
 * A watchdog that cannot be spawned does not fail the start: the loop runs
 * without and tries again every second (exec_loop_watchdog_pid() says).
 */
int exec_loop_start(const struct exec_loop_opts *opts, struct exec_loop **out);

/* exec_loop_start() without a watchdog. */
int exec_loop_new(unsigned max_concurrent, struct exec_loop **out);

/* The pid of the loop's watchdog process, 0 when it has none. Any thread. */
pid_t exec_loop_watchdog_pid(struct exec_loop *loop);

/*
 * Cancels every job (TERM, grace, KILL), waits for their callbacks, stops
 * the thread and frees. Blocks up to the longest grace_ms of a job that
 * ignores TERM. Accepts NULL. Never call it from a done callback (BUG).
 */
void exec_loop_free(struct exec_loop *loop);

/*
 * Submits a job; spec is copied. Callable from any thread, done callbacks
 * included. On 0, done is called exactly once (also for start failures);
 * on error (KS_EINVAL bad spec, -ENOMEM, KS_ESTOPPED while the loop is
 * being freed), never. *job_id_out (may be NULL) identifies the job for
 * exec_cancel().
 */
int exec_submit(struct exec_loop *loop, const struct exec_spec *spec,
                exec_done_fn done, void *ud, uint64_t *job_id_out);

/* exec_submit() that also calls started (may be NULL) after the spawn. */
int exec_submit_ex(struct exec_loop *loop, const struct exec_spec *spec,
                   exec_started_fn started, exec_done_fn done, void *ud,
                   uint64_t *job_id_out);

/* exec_submit_ex() that also calls output (may be NULL) as output is read. */
int exec_submit_out(struct exec_loop *loop, const struct exec_spec *spec,
                    exec_started_fn started, exec_output_fn output,
                    exec_done_fn done, void *ud, uint64_t *job_id_out);

/*
 * Cancels a job: TERM to its group now, KILL after its grace; the result has
 * cancelled = true. A job still queued never starts: its result is
 * EXEC_START_FAILED, stage "spawn", errno ECANCELED. Any thread. Returns 0,
 * or KS_ENOTFOUND if the job already finished (its callback has run or is
 * running).
 */
int exec_cancel(struct exec_loop *loop, uint64_t job_id);

/*
 * Kills a job now: SIGKILL to its group and cgroup.kill, no TERM and no
 * grace (the agent's self-fence: it must be dead before anyone declares it
 * Lost). The result has killed = true. A queued job never starts (as
 * exec_cancel). Any thread. 0, or KS_ENOTFOUND if it already finished.
 */
int exec_kill(struct exec_loop *loop, uint64_t job_id);

/* Jobs running now (not queued). Any thread. */
unsigned exec_loop_running(struct exec_loop *loop);

/*
 * Process-wide set-up, before the first spawn; exec_run() and
 * exec_loop_new() call it too, and it runs again in a forked child (the
 * subreaper flag is not inherited). Makes the process a child subreaper and
 * probes cgroup v2: the cgroup2 mount in /proc/mounts, our own cgroup from
 * /proc/self/cgroup, a writable cgroup.procs there and cgroup.kill (Linux
 * 5.14). Job cgroups live in <own cgroup>/kscore-<pid>/j<n>; empty ones are
 * reused, and those of agents that died are killed and removed here (K25).
 * KSCORE_EXEC_CGROUP=0 in the environment turns cgroups off.
 * Returns 1 if per-job cgroups are used, 0 if not.
 */
int exec_global_init(void);

/*
 * Puts the calling process into the known start state ("Process start
 * state" above): ignored signals and SIGCHLD back to SIG_DFL, SIGPIPE
 * ignored, an empty signal mask. Call it first in main() (or the
 * subcommand), before any thread exists: it sets the calling thread's mask,
 * which threads created later inherit. Cannot fail.
 */
void exec_process_init(void);

/* ------------------------------------------------------------------------ */
/* Agent runtime                                                             */
/* ------------------------------------------------------------------------ */

#include "events.h"

/*
 * What this agent runs beyond argv (AgentInfo.features): "script"
 * (CommandSpec.script), "input" (stdin), "run_as", "copy". The broker
 * sends a command that needs one only to an agent that lists it.
 */
extern const char *const agent_features[];
#define AGENT_N_FEATURES 4

/*
 * The name a label (prefix "KSCORE_LABEL_") or a fact ("KSCORE_FACT_")
 * has in a command's environment: prefix, then key with each ASCII letter
 * upper-cased, each digit kept and every other byte '_'
 * ("app.kubernetes.io/name" -> KSCORE_LABEL_APP_KUBERNETES_IO_NAME),
 * into out (len bytes, cut to fit; AGENT_INVENTORY_NAME_MAX is enough for
 * any key the CLI takes). Two keys that map to one name: the one that
 * sorts first gives the value (docs/fleet-runs.md "Inventory").
 */
#define AGENT_INVENTORY_NAME_MAX 160
void agent_inventory_name(const char *prefix, const char *key, char *out,
                          size_t len);

/* Default commands running at once per agent process: CPUs x 4. */
unsigned agent_default_max_concurrent(void);

/* The bytes of one output stream the agent keeps of a command whose spec
 * asks for spec_cap (CommandSpec.stdout_cap_bytes / stderr_cap_bytes; 0:
 * EXEC_OUTPUT_CAP_AGENT_DEFAULT; never more than EXEC_OUTPUT_CAP_MAX):
 * no piece of its output lies past it (the broker refuses one that
 * does). */
uint32_t agent_output_cap(uint32_t spec_cap);

struct agent_label {
    const char *key, *value;
};

/* The broker's signed attestation of one id's labels (events.h
 * evt_labels_sign; a bundle's, or the broker's own for its in-process
 * agents). The agent only passes it on in its registry entry: the broker
 * verifies it and then uses exactly these labels. */
struct agent_attestation {
    const struct agent_label *labels;
    size_t n_labels;
    int64_t enrolled_at_us;
    const uint8_t *sig; /* EVT_SIGNATURE_BYTES */
    const char *key_id; /* NULL or "": any of the broker's keys */
};

struct agent_opts {
    const char *nats_url;
    struct evt_connect_opts nats;  /* credentials / TLS */
    const char *const *ids;        /* n_ids agent ids served by this process */
    size_t n_ids;
    /*
     * NULL or "": each id has its own consumer and registry entry. Else
     * the pool these ids form (a subject token; every id must be
     * "<pool>-..."): all their commands come through one consumer,
     * "pool-<pool>" (events.h evt_pool_consumer), and one registry entry
     * per heartbeat stands for all of them (evt_pool_put). Per-id
     * attestations are not sent for a pool (its ids share its labels).
     * What a process serving thousands of ids wants: nats-server keeps one
     * consumer instead of thousands, and the registry gets one put per
     * heartbeat instead of one per id (deploy/SCALING.md). Copied.
     */
    const char *pool;
    /* NULL, or the broker's attestation of the pool's labels, signed over
     * the id "pool.<pool>" (its registry key): sent in every pool entry,
     * as an id's own attestation is (copied as attestations are). */
    const struct agent_attestation *pool_attestation;
    /* The pool's size as enrolled and signed (pool_attestation is over
     * "pool.<pool>/<size>", events.h evt_pool_attest_id); its ids must be
     * <pool>-<n>, n below it. 0: n_ids. */
    unsigned pool_size;
    const struct agent_label *labels; /* for every id */
    size_t n_labels;
    /* NULL, or n_ids entries (one per id; sig NULL: none for that id):
     * the signature and key id are copied, the labels borrowed (they
     * outlive the agent, as labels do). */
    const struct agent_attestation *attestations;
    unsigned max_concurrent;       /* 0: agent_default_max_concurrent() */
    const char *state_dir;         /* NULL: no disk buffer of results */
    /* Keys whose signatures this agent accepts: at least one is required.
     * trust (borrowed, outlives the agent) and/or trust_keys (PEM paths). */
    const struct evt_verifier *trust;
    const char *const *trust_keys;
    size_t n_trust_keys;
    uint64_t ack_wait_ms;          /* consumer ack wait; 0: 30000, else
                                      clamped by evt_agent_ack_wait_ms().
                                      Sent in AgentInfo: the broker makes
                                      the consumer with it. A command's
                                      message stays unacked while it waits
                                      and runs, kept alive with a progress
                                      ack every ack_wait / 3 */
    uint64_t fence_ms;             /* 0: AGENT_FENCE_MS */
    uint64_t link_timeout_ms;      /* 0: AGENT_LINK_TIMEOUT_MS */
    unsigned watchdog_ms;          /* 0: AGENT_WATCHDOG_MS */
};

/*
 * Self-fence (ms): when no heartbeat has reached NATS for this long (NATS
 * down, cut off, JetStream not answering; but not while a connected NATS
 * answers that the registry bucket itself is unavailable: then no broker
 * hears any heartbeat and none judges by silence, runtime.c heard()),
 * the agent SIGKILLs every command
 * it runs and reports each as CommandLost "agent lost contact with NATS for
 * N s: its processes were killed (self-fence)" once it can. Half the
 * broker's EVT_AGENT_TTL_MS, after which the broker declares the commands
 * of a silent agent Lost: by then they are dead, so the record's Lost is
 * true. A command claimed while fenced is not spawned (CommandNotStarted).
 */
#define AGENT_FENCE_MS 5000
/*
 * Link timeout (ms): when nats.c has said CONNECTED for this long and the
 * server has answered nothing in that time (no PubAck, no reply, no PONG
 * to the PINGs the agent sends every EVT_LINK_PROBE_MS: events/link.c),
 * the link is dead in a way nats.c will not repair (a server stopped or
 * cut off without a reset; a read thread that hangs, while every write
 * fails with EPIPE: issue 22). The agent is fenced long before (it heard
 * nothing: AGENT_FENCE_MS); then it can serve no more as it is and stops
 * with AGENT_EXIT_LINK, which its supervisor restarts (agent_fatal).
 * While nats.c says it is reconnecting, the agent stays fenced and waits:
 * a new process would find the server no better.
 */
#define AGENT_LINK_TIMEOUT_MS 30000
/*
 * Watchdog (ms): the executor loop's watchdog process (exec_loop_opts)
 * kills every command at once when the agent process dies, and when the
 * agent has been stopped or hung this long; the agent then reports those
 * as CommandLost "killed by the agent's watchdog: the agent was stopped or
 * hung for N s". Below AGENT_FENCE_MS, well below EVT_AGENT_TTL_MS.
 */
#define AGENT_WATCHDOG_MS 3000

struct agent;

/*
 * Starts serving: one NATS connection; per id a registry entry (the first
 * heartbeat, before anything else: the broker sees it and provisions the
 * id's durable push consumer agent-<id>, filter kscore.cmd.<id>, explicit
 * ack, max_ack_pending = max_concurrent, ack wait from AgentInfo; see
 * evt_agent_consumer) and a core queue subscription to that consumer's
 * deliver subject; one executor loop with its watchdog process, a
 * publisher thread for results, a heartbeat thread and a keeper thread
 * (progress acks, contact with NATS, self-fence). The agent uses JetStream
 * as plain NATS only: publishes whose PubAck comes to "_INBOX.agent-<id>.",
 * acks published to each message's reply subject; its NATS user needs no
 * "_INBOX.>" and no "$JS.API.>" (deploy/nats-auth.conf.in). Messages of
 * another subject than kscore.cmd.<id> (a consumer with a wrong filter,
 * which the broker replaces) are left alone: never run, refused or acked.
 * Returns 0, KS_EINVAL (bad id), KS_EUNAVAIL (NATS unreachable, or no
 * registry bucket: no broker has set up this NATS) with *errmsg (malloc'd).
 *
 * The child's environment is the executor's base plus KSCORE_AGENT_ID (the
 * agent id it runs for) plus the command's declared variables.
 *
 * Per command: check target and expiry; wait for one of the process's
 * max_concurrent slots (shared by all its ids; the message stays unacked,
 * unclaimed); exec_precheck(); journal; claim through the broker
 * (kscore.api.v1.claim); run (journal "spawned"); publish the result to
 * KSCORE_EVENTS until a PubAck arrives (outbox on disk); ack the JetStream
 * message; the slot goes to the next message.
 *
 * A claim is tried with one claim id until the broker answers it (a claim
 * whose reply was lost may have won: the broker grants a repeat of the
 * winning claim while the command runs), and every command from its claim
 * until its end is published is listed in the heartbeats (AgentInfo.holds,
 * with heartbeat_seq); the broker ends a Running command that a live
 * heartbeat of its claimer, sent after the claim, does not list.
 *
 * With a state_dir, a restart reports what the previous run left: commands
 * it had spawned as CommandLost; commands it had claimed but never spawned
 * are claimed again with the journalled claim id when JetStream delivers
 * them again (at once: their messages are nak'd), and run if that claim
 * won; unclaimed messages go back to JetStream.
 *
 * A state_dir that takes no more writes (full, read-only) never leaves a
 * command the journal does not know: a message it cannot journal is not
 * claimed but nak'd (redelivered after 1, 2, 4, 8 s: to this process or
 * another of its id), and an event it cannot save in the outbox is
 * published from memory. Each failure counts in
 * kscore_agent_state_write_errors_total and is logged once per 10 s.
 */
int agent_start(const struct agent_opts *opts, struct agent **out,
                char **errmsg);

/*
 * Decodes and checks one message from kscore.cmd.<agent_id> (the bytes of a
 * SignedCommand, at most KS_MAX_MESSAGE_BYTES): a signature from a trusted
 * key over the packed Command, addressed to agent_id, not past its
 * not-after (now_us, epoch us), with a command id and an argv.
 * Returns 0 with *out (ks__command__free_unpacked), or KS_EREJECTED with
 * *reason_out (static text: "missing signature", "bad signature",
 * "addressed to another agent", "expired", ...), or KS_EDECODE /
 * KS_ETOOBIG for bytes that are no command at all. *cmd_id_out (may be
 * NULL) gets the command id when the inner command could be read, so a
 * refusal can be recorded against it. Pure: no I/O; any thread.
 */
int agent_decode_command(const struct evt_verifier *trust,
                         const char *agent_id, int64_t now_us,
                         const void *data, size_t len, Ks__Command **out,
                         const char **reason_out, char cmd_id_out[37]);

/*
 * A graceful stop, first half: takes no new work from now on. The
 * deliveries stop (each id's or the pool's subscription goes), messages
 * waiting for a slot or not yet claimed go back to JetStream (-NAK: for
 * another process of the id, or for this one after its restart), and no
 * claim is sent any more; claims already sent are answered, and what
 * runs goes on, reported as usual. Heartbeats, progress acks and the
 * self-fence go on. timeout_ms is only said in the reason of what
 * agent_stop must then stop. Returns at once; any thread; once (later
 * calls do nothing). Accepts NULL.
 *
 * The caller waits until agent_busy() is 0 or its drain timeout passed
 * (`kscore agent --drain-timeout`, `kscore broker --drain-timeout`:
 * AGENT_DRAIN_TIMEOUT_MS by default), then calls agent_stop().
 */
void agent_drain(struct agent *a, uint64_t timeout_ms);
/* Default drain timeout (ms) of `kscore agent` and `kscore broker` (its
 * in-process agents). A service manager's stop timeout must exceed it by
 * the longest --grace of the commands (deploy/systemd). */
#define AGENT_DRAIN_TIMEOUT_MS 10000

/* What this agent still holds: commands claimed or being claimed or
 * running, plus results not yet published (0 for NULL). Any thread. */
unsigned agent_busy(struct agent *a);

/*
 * The whole graceful stop of a process's agent: agent_drain, then waits
 * until agent_busy() is 0, timeout_ms passed, or a signal of stop_now
 * arrives (taken with sigtimedwait(2): they must be blocked in every
 * thread; NULL: none), then agent_stop (which stops what is left, as
 * "the agent stopped"). Logs which of them ended the drain. Returns the
 * signal that cut it short, or 0. Accepts NULL.
 */
int agent_stop_graceful(struct agent *a, uint64_t timeout_ms,
                        const sigset_t *stop_now);

/*
 * Stops taking work (messages not yet claimed go back to JetStream), stops
 * what still runs with the kill protocol (TERM, grace, KILL to its group),
 * publishes the results, frees. Accepts NULL. A command it stops ends
 * CommandLost with the reason "the agent stopped while the command ran",
 * one still queued in the executor CommandNotStarted: never Cancelled,
 * which only an operator's cancel is. A claim still unanswered is left as
 * it is: with a state dir the journal keeps it for the next start (which
 * claims again with the same claim id); without, the broker ends the
 * command if the claim won (no heartbeat lists it).
 */
void agent_stop(struct agent *a);

/*
 * Why this agent can serve no more and its process should exit: 0 while
 * it serves;
 *  AGENT_FATAL_REVOKED: NATS closed its connection for good (a revoked
 *   credential: an authorization violation at the reload) after it fenced
 *   itself, so it can neither run nor report anything any more. Exit
 *   AGENT_EXIT_CONFIG, which systemd does not restart
 *   (RestartPreventExitStatus=78 in deploy/systemd/kscore-agent.service).
 *  AGENT_FATAL_LINK: the link answered nothing for AGENT_LINK_TIMEOUT_MS
 *   while nats.c said CONNECTED, after it fenced itself. Exit
 *   AGENT_EXIT_LINK, which systemd restarts (Restart=on-failure): a new
 *   process has a new connection.
 * A claim refused because another, older process serves the same id
 * (KS_EDUPINSTANCE) is not fatal: the id stands aside (no deliveries) for
 * EVT_AGENT_TTL_MS and then claims again, so a process falsely taken for
 * a duplicate (a forged registry entry, issue 21) serves again once the
 * other is no longer live. Any thread.
 */
enum agent_fatal { AGENT_FATAL_NONE, AGENT_FATAL_REVOKED, AGENT_FATAL_LINK };
#define AGENT_EXIT_CONFIG 78 /* EX_CONFIG */
#define AGENT_EXIT_LINK 75   /* EX_TEMPFAIL */
enum agent_fatal agent_fatal(struct agent *a);

/* This process's instance id (AgentInfo.instance_id; 36 chars). */
const char *agent_instance_id(struct agent *a);

/* The pid of the agent's watchdog process, 0 if it has none. */
pid_t agent_watchdog_pid(struct agent *a);

#endif
