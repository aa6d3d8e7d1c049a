/*
 * stack: the private local stack (nats-server with JetStream, a PostgreSQL
 * cluster from initdb) under one directory. Used by `kscore up/down/status`
 * and by the test fixtures, so both start the servers the same way.
 *
 * PostgreSQL refuses to run as root; when the caller is root, initdb and the
 * server run as the `postgres` user, and the data and socket directories are
 * made theirs (every parent must be searchable by that user).
 *
 * Processes started here are daemons (setsid, own process group) whose pids
 * are written to files in the directory, so another process can stop them.
 */
#ifndef KSCORE_STACK_H
#define KSCORE_STACK_H

#include <stdbool.h>
#include <sys/types.h>

/* A free TCP port on 127.0.0.1 (bind to port 0), or -errno. */
int stack_free_port(void);

/* mkdir -p with mode; 0 or -errno. */
int stack_mkdirs(const char *path, unsigned mode);

/*
 * Starts nats-server with JetStream on 127.0.0.1:port (port 0: a free one),
 * store dir <dir>/nats, pid file <dir>/nats.pid, log <dir>/nats.log, config
 * <dir>/nats.conf written here (conf_extra, may be NULL, is appended to it).
 * Waits (<= 10 s) until it accepts connections. On 0: *url_out (malloc'd)
 * is "nats://127.0.0.1:PORT" and *pid_out the server's pid.
 * Errors: -errno, KS_ETIMEDOUT (not ready), KS_EUNAVAIL (exited; see log).
 */
int stack_nats_start(const char *dir, int port, const char *conf_extra,
                     char **url_out, pid_t *pid_out);

/*
 * Stops the nats-server whose pid is in <dir>/nats.pid (TERM, then KILL
 * after 5 s) and waits until it is gone. 0 if stopped or not running.
 */
int stack_nats_stop(const char *dir);

/*
 * Creates (initdb, once) and starts a PostgreSQL cluster: data <dir>/pg,
 * Unix socket in <dir>/pgsock, listening on no TCP address, port `port`
 * (0: a free one; it names the socket file), database "kscore" created.
 * Runs as `postgres` when called as root. Waits (<= 30 s) until it accepts
 * connections. On 0: *conninfo_out (malloc'd) is a libpq conninfo such as
 * "host=<dir>/pgsock port=PORT dbname=kscore user=postgres", *pid_out the
 * postmaster pid. Errors: -errno, KS_ETIMEDOUT, KS_EUNAVAIL (see
 * <dir>/pg.log).
 */
int stack_pg_start(const char *dir, int port, char **conninfo_out,
                   pid_t *pid_out);

/* pg_ctl stop -m fast; waits until the postmaster is gone. 0 or -errno. */
int stack_pg_stop(const char *dir);

/*
 * Starts argv as a daemon: own session, stdin /dev/null, stdout/stderr
 * appended to <dir>/<name>.log, pid written to <dir>/<name>.pid. argv[0]
 * is a path. On 0, *pid_out is its pid. Returns -errno on failure.
 */
int stack_daemon(const char *dir, const char *name, char *const argv[],
                 pid_t *pid_out);

/*
 * Stops the daemon in <dir>/<name>.pid: SIGTERM, then SIGKILL after
 * wait_ms, and waits until it is gone (reaping it when it is our child).
 * 0 if stopped or not running, KS_ETIMEDOUT if it would not die.
 */
int stack_stop(const char *dir, const char *name, int wait_ms);

/* 32 random hex characters (getrandom) into out[33]. 0 or -errno. */
int stack_secret(char out[33]);

/* The users of deploy/nats-auth.conf.in. Every name is a subject token. */
struct stack_auth {
    const char *broker_password;
    const char *operator_name, *operator_password;
    const char *agent_id, *agent_password; /* user "agent-<agent_id>" */
};

/*
 * The nats-server `authorization` block for these users: the template
 * deploy/nats-auth.conf.in with its @FIELDS@ filled. *conf_out is
 * malloc'd; pass it as stack_nats_start()'s conf_extra. 0 or -ENOMEM.
 */
int stack_nats_auth_conf(const struct stack_auth *a, char **conf_out);

/* 1 if the pid in <dir>/<name>.pid is alive, else 0; *pid_out if alive. */
int stack_pidfile_alive(const char *dir, const char *name, pid_t *pid_out);

#endif
