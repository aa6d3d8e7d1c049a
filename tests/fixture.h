/*
 * fixture: private servers for integration tests. Each fixture starts its
 * server in a fresh mkdtemp directory on a free port, through the same
 * cli/stack.h code `kscore up` uses, and stops it and removes the directory
 * at the end. Set KSCORE_KEEP_TMP=1 to keep the directory (logs) for a
 * post-mortem.
 */
#ifndef KSCORE_FIXTURE_H
#define KSCORE_FIXTURE_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* ------------------------------------------------------------------------ */
/* PostgreSQL (tests/fixture_pg.c)                                           */
/* ------------------------------------------------------------------------ */

struct fixture_pg {
    char dir[PATH_MAX]; /* the temporary stack directory */
    char *conninfo;     /* libpq conninfo of database "kscore" (malloc'd) */
    pid_t pid;          /* postmaster */
    bool small_disk;    /* fixture_pg_small_disk mounted one */
};

/*
 * Starts a private cluster (stack_pg_start) in a new directory under
 * $TMPDIR (default /tmp). Unless KSCORE_PG_FAST is already set, sets it to 1
 * (fsync=off: a test cluster is thrown away). Returns 0 with *out filled, or
 * a negative code (see <dir>/pg.log; the directory is kept on failure).
 */
int fixture_pg_start(struct fixture_pg *out);

/* Stops the cluster and removes its directory. Accepts NULL. */
void fixture_pg_stop(struct fixture_pg *f);

/*
 * A PostgreSQL outage, with the code `kscore down`/`up` use
 * (stack_pg_stop: pg_ctl stop -m fast, every session terminated with
 * 57P01; stack_pg_start: the same directory, port and socket, so the
 * conninfo stays valid). fixture_pg_halt stops the server and keeps the
 * directory; fixture_pg_resume starts it again and waits until it accepts
 * connections; fixture_pg_restart is both (pg_ctl restart -m fast). 0 or a
 * negative code.
 */
int fixture_pg_halt(struct fixture_pg *f);
int fixture_pg_resume(struct fixture_pg *f);
int fixture_pg_restart(struct fixture_pg *f);

/*
 * Runs sql on database kscore as the superuser postgres: a child becomes
 * the server's OS user and connects by peer, as the stack's own
 * administration does. For the faults a test injects (a tablespace, a
 * full disk), never for what kscore does. 0, or -1 with the server's
 * message on stderr (an error sql expects, e.g. 53100 of a filler, is
 * allowed_sqlstate: then 0 too; NULL: none).
 */
int fixture_pg_admin(const struct fixture_pg *f, const char *sql,
                     const char *allowed_sqlstate);

/*
 * A small disk under the events table (issue 25, fleet case F06, a full
 * disk with PostgreSQL up): a tmpfs of size_mb mounted at <dir>/evdisk,
 * the tablespace kscore_evdisk on it, the table events moved there (its
 * indexes stay). fixture_pg_fill_disk fills it (a filler table in the
 * tablespace, until PostgreSQL answers 53100 disk_full): events can grow
 * no more, every append fails with 53100 (a few may still fit in the
 * table's last page). fixture_pg_free_disk drops the filler: the space is
 * back. fixture_pg_small_disk_undo moves events back and unmounts
 * (fixture_pg_stop does it too). 0; KS_EUNAVAIL when no tmpfs can be
 * mounted (not root, no CAP_SYS_ADMIN: the caller skips, saying so); -1.
 */
int fixture_pg_small_disk(struct fixture_pg *f, int size_mb);
int fixture_pg_fill_disk(struct fixture_pg *f);
int fixture_pg_free_disk(struct fixture_pg *f);
void fixture_pg_small_disk_undo(struct fixture_pg *f);

/* ------------------------------------------------------------------------ */
/* NATS and the whole stack (tests/fixture_nats.c)                          */
/* ------------------------------------------------------------------------ */

struct fixture_nats {
    char dir[PATH_MAX];
    char *url; /* "nats://127.0.0.1:PORT" (malloc'd) */
    pid_t pid;
};

/* Starts a private nats-server with JetStream (stack_nats_start) in a new
 * temporary directory on a free port. conf_extra may be NULL. */
int fixture_nats_start(struct fixture_nats *out, const char *conf_extra);
/* As fixture_nats_start, with the users of the identity registry under
 * ident_home (stack_nats_auth_write). */
int fixture_nats_start_auth(struct fixture_nats *out, const char *ident_home);
/* Stops it and removes its directory. Accepts NULL. */
void fixture_nats_stop(struct fixture_nats *f);

/*
 * The whole stack for end-to-end tests: nats-server, PostgreSQL, a broker
 * (`kscore broker`, the real binary from $KSCORE_BIN, with local_agents
 * in-process agents) and, when agent_id is set, one `kscore agent` process.
 * Waits until the broker serves and the agent has registered.
 */
struct fixture_stack {
    struct fixture_pg pg;
    struct fixture_nats nats;
    char dir[PATH_MAX]; /* logs and pid files of broker and agent */
    char agent_id[64];
    char signing_key[PATH_MAX + 16]; /* <dir>/broker.key (kscore keygen) */
    char trust_key[PATH_MAX + 16];   /* <dir>/broker.pub */
    /* Secure stacks (fixture_stack_start_secure): NATS identities in a
     * registry under dir (cli/stack.h: dir/identities, seeds in dir/keys
     * and dir/operators), rendered through deploy/nats-auth.conf.in into
     * the server's nats-auth.conf, as `kscore up` makes them. */
    bool secure;
    char operator_name[64];
    char broker_seed[PATH_MAX + 64], operator_seed[PATH_MAX + 64],
        agent_seed[PATH_MAX + 256];
    char policy[PATH_MAX + 16]; /* broker --policy, "" for none */
    const char *policy_json;    /* fixture_stack_start_policy's text */
    char agent_labels[128];     /* "--label" value for the agent, or "" */
};

/*
 * As fixture_stack_start, with NATS authentication and permissions: users
 * "broker", operator_name and "agent-<agent_id>"; the broker gets
 * --policy policy_file when it is not NULL, the agent --label label (may be
 * NULL). fixture_kscore() then runs as the operator.
 */
int fixture_stack_start_secure(struct fixture_stack *s, const char *agent_id,
                               const char *label, const char *operator_name,
                               const char *policy_file);
int fixture_stack_start(struct fixture_stack *s, const char *agent_id,
                        unsigned local_agents);
/* As fixture_stack_start_secure, with the policy given as its JSON text
 * (written to <dir>/policy.json, removed with the stack). */
int fixture_stack_start_policy(struct fixture_stack *s, const char *agent_id,
                               const char *label, const char *operator_name,
                               const char *policy_json);
/*
 * A secure stack after its registry (s->dir) changed (stack_ident_add or
 * _remove with home s->dir): renders nats-auth.conf again and makes
 * nats-server reload it. 0 or a negative code.
 */
int fixture_stack_nats_reauth(struct fixture_stack *s);
void fixture_stack_stop(struct fixture_stack *s);
/*
 * Starts one more `kscore agent --id id` daemon named `name` (its pid file
 * <dir>/<name>.pid) with extra arguments (NULL-terminated, may be NULL),
 * and waits for its heartbeat. Stop it with stack_stop(s->dir, name, ...).
 */
int fixture_agent_spawn(struct fixture_stack *s, const char *name,
                        const char *id, const char *const extra[]);
/* As fixture_agent_spawn, started through launcher (NULL-terminated: a
 * program and its arguments, run with the agent's command line after
 * them, which it must exec), e.g. one that leaves odd signal state. Its
 * state dir is <dir>/state-<name>. */
int fixture_agent_spawn_via(struct fixture_stack *s, const char *name,
                            const char *id, const char *const extra[],
                            const char *const launcher[]);
/* Restarts nats-server on the same port and store dir (SIGTERM first, so
 * JetStream flushes). */
int fixture_stack_nats_restart(struct fixture_stack *s);

/*
 * Sends sig to the stack's nats-server. SIGKILL and SIGTERM wait until it
 * is gone (start it again with fixture_stack_nats_start); SIGSTOP and
 * SIGCONT pause and resume it. 0 or -errno (not running: -ESRCH).
 */
int fixture_stack_nats_kill(struct fixture_stack *s, int sig);
/* Starts nats-server again on the same port and store dir, after
 * fixture_stack_nats_kill. 0 or a negative code. */
int fixture_stack_nats_start(struct fixture_stack *s);

/*
 * Sends sig to the daemon <dir>/<name>.pid of the stack ("broker",
 * "agent", or a fixture_agent_spawn name). SIGKILL waits until it is gone
 * (reaped). 0 or -ESRCH when it is not running.
 */
int fixture_stack_signal(struct fixture_stack *s, const char *name, int sig);
/* As fixture_stack_signal, to the process and to every process descended
 * from it (by PPid in /proc, at most 256): an agent, its watchdog and its
 * commands together, as a frozen VM or cgroup stops them (SIGSTOP /
 * SIGCONT). 0 or -ESRCH. */
int fixture_stack_signal_tree(struct fixture_stack *s, const char *name,
                              int sig);
/* Waits (<= timeout_ms) for a heartbeat of agent id at or after since_us
 * (epoch us; 0: any). 0 or KS_ETIMEDOUT. */
int fixture_stack_wait_agent(const struct fixture_stack *s, const char *id,
                             int64_t since_us, int timeout_ms);

/* (Re)starts or stops the stack's agent / broker process. */
int fixture_stack_agent_start(struct fixture_stack *s, const char *extra_env);
void fixture_stack_agent_kill(struct fixture_stack *s, int sig);
int fixture_stack_broker_start(struct fixture_stack *s, unsigned local_agents);
/*
 * One more `kscore broker` of the stack, in the same queue group and on
 * the same database, with no local agents: the daemon name (pid file and
 * log <dir>/<name>.{pid,log}). Waits until it logs that it serves (a
 * readiness probe would be answered by the first broker). Stop it with
 * stack_stop(s->dir, name, ...); signal it with fixture_stack_signal.
 * 0 or a negative code.
 */
int fixture_stack_broker_spawn(struct fixture_stack *s, const char *name);
void fixture_stack_broker_kill(struct fixture_stack *s, int sig);

/* What a child process did. */
struct fixture_out {
    char *out, *err; /* NUL-terminated; out_len/err_len bytes (malloc'd) */
    size_t out_len, err_len;
    int status;      /* exit code, or 128+signal */
    double seconds;  /* wall time */
};

/*
 * Runs the kscore binary with args (NULL-terminated, without argv[0]) and
 * KSCORE_NATS_URL pointing at the stack (s may be NULL; for a secure stack,
 * KSCORE_NATS_NKEY is the operator's seed), stdin /dev/null,
 * capturing stdout and stderr. Returns 0 or -errno.
 */
int fixture_kscore(const struct fixture_stack *s, const char *const args[],
                   struct fixture_out *out);
/* As fixture_kscore, with stdin the file stdin_path (not a terminal:
 * kscore exec and batch read it and send it to the command). */
int fixture_kscore_stdin(const struct fixture_stack *s, const char *stdin_path,
                         const char *const args[], struct fixture_out *out);
/* As fixture_kscore on a secure stack, as operator name: made in its
 * registry (and the server's users reloaded) the first time. 0 or a
 * negative code. */
int fixture_kscore_as(struct fixture_stack *s, const char *name,
                      const char *const args[], struct fixture_out *out);
/*
 * As fixture_kscore, for the local stack of `kscore up` in home: runs with
 * KSCORE_HOME=home and no KSCORE_NATS_* / KSCORE_AGENT / KSCORE_DB of the
 * caller's, so home's env file decides.
 */
int fixture_kscore_home(const char *home, const char *const args[],
                        struct fixture_out *out);
void fixture_out_release(struct fixture_out *o);
/* The agent bundle at path (`kscore agent enroll`) without its label
 * attestation (signature, key id and enrolment time), and with the line
 * "label = <from>" said as "label = <to>", into out_path (0600): what the
 * holder of an enrolled agent's bundle could run to choose its labels.
 * 0 or -errno. */
int fixture_bundle_strip_labels(const char *path, const char *out_path,
                                const char *from, const char *to);
/* The last line of out (a batch's --json summary), or out itself. */
const char *fixture_last_line(const char *out);

/*
 * A kscore process running beside the test (an `events --follow`, a batch
 * on a terminal), its output collected as the test waits for it.
 * terminal: stdin, stdout and stderr are a pseudo-terminal of 120x40
 * (forkpty), the process leads its session with it as its controlling
 * terminal, out is everything the terminal received (both streams, in
 * order, with the terminal's \r\n), err stays empty, and bytes written with
 * fixture_proc_write are typed (^C, \x03, is a SIGINT); else stdin is
 * /dev/null and stdout, stderr are pipes into out and err. The
 * environment is fixture_kscore's for s (s NULL: none of a stack's).
 */
struct fixture_proc {
    pid_t pid;
    int fd_out, fd_err; /* pipes, or the terminal's master and -1 */
    char *out, *err;    /* what came so far, NUL-terminated (or NULL) */
    size_t out_len, err_len, out_cap, err_cap;
    int status;         /* after fixture_proc_wait: as fixture_out's; -1 */
};
int fixture_kscore_spawn(const struct fixture_stack *s, const char *const args[],
                         bool terminal, struct fixture_proc *p);
/* Collects output until needle is in out or err: 0, or KS_ETIMEDOUT after
 * timeout_ms (or when the process closed its output without it). */
int fixture_proc_expect(struct fixture_proc *p, const char *needle,
                        int timeout_ms);
/* Types bytes on its terminal. 0 or -errno (-EINVAL: no terminal). */
int fixture_proc_write(struct fixture_proc *p, const char *bytes);
/* Sends sig (0: none), then collects output until it exits, at most
 * timeout_ms (then SIGKILL). Returns p->status. */
int fixture_proc_wait(struct fixture_proc *p, int sig, int timeout_ms);
/* Kills it if it still runs (SIGKILL), frees. Accepts a zeroed p. */
void fixture_proc_release(struct fixture_proc *p);

/* ------------------------------------------------------------------------ */
/* Clients (tests/fixture_nats.c)                                            */
/* ------------------------------------------------------------------------ */

struct evt_conn;
struct __natsMsg; /* nats.c's natsMsg */
/* A client of s's NATS (send_asap); a failure fails the test. */
struct evt_conn *fixture_client(const struct fixture_stack *s);
/* The latest entry of key (an agent id, "pool.<pool>", ...) in the
 * registry bucket KSCORE_AGENTS, read from its stream through c (which
 * may read it): 0 with *out (the caller destroys it; natsMsg_GetTime is
 * when it was put, on the server's clock), or non-zero (none, or no
 * answer). */
int fixture_registry_last(struct evt_conn *c, const char *key,
                          struct __natsMsg **out);
/* Submits `sh -c script` to agent, detached, with timeout_ms (0: none) and
 * deliver_within_ms (0: the default): 0 with id_out, or the error (the
 * reply's error code, or the request's). */
int fixture_submit(struct evt_conn *c, const char *agent, const char *script,
                   uint64_t timeout_ms, uint64_t deliver_within_ms,
                   char id_out[37]);
/* fixture_submit with an idempotency key (NULL: none), so that asking
 * again after a failure cannot make a second command. */
int fixture_submit_key(struct evt_conn *c, const char *agent,
                       const char *script, uint64_t timeout_ms,
                       uint64_t deliver_within_ms, const char *key,
                       char id_out[37]);
/* fixture_submit_key with a spec of the caller's (a Ks__CommandSpec: its
 * argv, caps...). */
struct Ks__CommandSpec;
int fixture_submit_spec(struct evt_conn *c, const char *agent,
                        struct Ks__CommandSpec *spec,
                        uint64_t deliver_within_ms,
                        const char *key, char id_out[37]);
/* n bytes (malloc'd) of a xorshift sequence seeded by seed: the same
 * bytes for the same (n, seed), others for another seed. */
uint8_t *fixture_bytes(size_t n, uint32_t seed);

/*
 * Uploads len bytes (a file for kscore copy) as identity, as kscore copy
 * does, through kscore.api.v1.upload.<identity> on c: the question first
 * (a commit without data: is it there?), then parts 0 .. parts_max - 1, a
 * request each; with every part (parts_max >= its parts) the last one
 * commits. 0 when no answer was an error (*complete_out, may be NULL: the
 * last answer's complete), else the first error's code, its text in why
 * (why_len bytes; may be NULL), and nothing more sent. A request that
 * gets no answer fails the test.
 */
int fixture_upload(struct evt_conn *c, const char *identity, const void *data,
                   size_t len, uint32_t parts_max, bool *complete_out,
                   char *why, size_t why_len);

/* ------------------------------------------------------------------------ */
/* Gates (tests/fixture_gate.c)                                              */
/* ------------------------------------------------------------------------ */

/*
 * A gate: a step of a command's sh text that waits until the test opens
 * it (makes the file path). A test that asserts "this was seen while the
 * command still ran" (live output, a Running status, a report or a fault
 * that must come before the end) holds the command at a gate it opens
 * once it has seen it, instead of giving the command a `sleep`: a sleep's
 * margin is lost on a loaded machine (make test runs suites side by side
 * on 2 cores), a gate's is not. A gate never opened lets the command go
 * on after at least FIXTURE_GATE_MAX_S, saying so on its stderr, so that a
 * failed test does not leave it running for long.
 */
#define FIXTURE_GATE_MAX_S 60
struct fixture_gate {
    char path[PATH_MAX];     /* <dir>/gate-<name> */
    char sh[2 * PATH_MAX + 256]; /* sh text that waits at it */
};
/* A closed gate <dir>/gate-<name> (dir must be searchable by the agent
 * that runs the command); a failure fails the test. */
void fixture_gate_init(struct fixture_gate *g, const char *dir,
                       const char *name);
/* Opens it: the commands waiting there go on. */
void fixture_gate_open(const struct fixture_gate *g);

/* ------------------------------------------------------------------------ */
/* Queries for assertions (tests/fixture_pg.c)                               */
/* ------------------------------------------------------------------------ */

/* The first column of the first row of sql as a long (-1 when there is no
 * row) on pgconn (a PGconn *); a failed query fails the test. */
long fixture_pg_long(void *pgconn, const char *sql);
/* Lines in the file at path, 0 when there is none: how often a command
 * whose side effect appends a line to it ran. */
long fixture_file_lines(const char *path);
/* The same on a connection of its own to conninfo. */
long fixture_sql_long(const char *conninfo, const char *sql);
/* Polls sql until it returns want or timeout_ms passes: the last value. */
long fixture_wait_sql(const char *conninfo, const char *sql, long want,
                      int timeout_ms);

#endif
