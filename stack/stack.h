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
#include <stddef.h>
#include <sys/types.h>

#include "events.h"

/* A free TCP port on 127.0.0.1, picked below the kernel's ephemeral range
 * (so no connect(2) takes it before the caller binds it), or -errno. */
int stack_free_port(void);

/* 1 if 127.0.0.1:port has no listener (it binds with SO_REUSEADDR, as
 * nats-server does), 0 if it is taken, KS_EINVAL or -errno. */
int stack_port_free(int port);

/* The port the last stack_nats_start of dir served on (<dir>/nats.port),
 * or 0 when there is none. */
int stack_nats_saved_port(const char *dir);
/* The TCP port written in the file dir/file (1..65535), or 0 when the file
 * is missing or holds none. */
int stack_read_port(const char *dir, const char *file);

/* The value of key in the <home>/env file `kscore up` writes (lines
 * KEY='value'), malloc'd, or NULL when the file or the key is missing. */
char *stack_env_get(const char *home, const char *key);

/* mkdir -p with mode; 0 or -errno. */
int stack_mkdirs(const char *path, unsigned mode);

/*
 * Starts nats-server with JetStream on 127.0.0.1:port (port 0: a free one),
 * store dir <dir>/nats, pid file <dir>/nats.pid, log <dir>/nats.log, config
 * <dir>/nats.conf written here (conf_extra, may be NULL, is appended to it).
 * Waits (<= 10 s) until it accepts connections; then writes the port to
 * <dir>/nats.port. On 0: *url_out (malloc'd)
 * is "nats://127.0.0.1:PORT" and *pid_out the server's pid.
 * Errors: -errno, KS_ETIMEDOUT (not ready), KS_EUNAVAIL (exited; see log).
 */
int stack_nats_start(const char *dir, int port, const char *conf_extra,
                     char **url_out, pid_t *pid_out);

/*
 * As stack_nats_start, listening on host (an IPv4 address: nats-server 2.9
 * has one client listener) instead of 127.0.0.1. tls_conf (may be NULL;
 * stack_tls_conf makes one) makes the port TLS-only, and *url_out is then
 * "tls://HOST:PORT".
 */
int stack_nats_start_at(const char *dir, const char *host, int port,
                        const char *tls_conf, const char *conf_extra,
                        char **url_out, pid_t *pid_out);

/*
 * As stack_nats_start_at, with server_name (NULL: "kscore_<port>"). A
 * node of a JetStream cluster needs a name that stays the same across
 * restarts: JetStream knows its peers by it.
 */
int stack_nats_start_named(const char *dir, const char *host, int port,
                           const char *server_name, const char *tls_conf,
                           const char *conf_extra, char **url_out,
                           pid_t *pid_out);

/*
 * Stops the nats-server whose pid is in <dir>/nats.pid (TERM, then KILL
 * after 5 s) and waits until it is gone. 0 if stopped or not running.
 */
int stack_nats_stop(const char *dir);

/*
 * Creates (initdb, once) and starts a PostgreSQL cluster: data <dir>/pg,
 * Unix socket in <dir>/pgsock, port `port` (0: a free one; it names the
 * socket file), role and database "kscore" created. Runs as `postgres`
 * when called as root. Authentication: no `trust`; peer on the socket, the
 * calling OS user mapped (pg_ident.conf) to the role kscore, and
 * scram-sha-256 on TCP, where it listens only when KSCORE_PG_LISTEN (a
 * listen_addresses value) is set. An already running cluster gets the same
 * rules by a reload. Waits (<= 30 s) until it accepts connections. On 0:
 * *conninfo_out (malloc'd) is a libpq conninfo such as
 * "host=<dir>/pgsock port=PORT dbname=kscore user=kscore", *pid_out the
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

/* ---- identities: who may connect to the stack's nats-server ------------
 *
 * The registry <home>/identities/ (stack_ident.c) has one entry per NATS
 * user: its kind, name and public NKey, nothing secret. Each seed is in its
 * own 0600 file that only its holder uses: <home>/keys/<name>.nk for the
 * stack's own daemons (broker, agents), <home>/operators/<name>.nk for an
 * operator. nats-server's authorization block is rendered from the
 * registry (deploy/nats-auth.conf.in, one permission template per kind)
 * into <nats dir>/nats-auth.conf, which nats.conf includes; so the server's
 * files hold public keys only. Entries and keys outlive `kscore down`: a
 * restart never changes anyone's credential.
 */
/* STACK_SYSTEM: "system", the user of nats-server's system account
 * (SYS): the stack's own view of the server's monitoring
 * (stack_nats_monitor), which no other user may ask for. */
enum stack_kind {
    STACK_BROKER,
    STACK_OPERATOR,
    STACK_AGENT,
    STACK_POOL,
    STACK_SYSTEM
};

struct stack_identity {
    enum stack_kind kind;
    /* "broker", "agent-<id>", or an operator's name (a subject token) */
    char name[EVT_IDENTITY_MAX + 1];
    char nkey[EVT_NKEY_PUBLIC_CHARS + 1]; /* public key, "U..." */
    /* STACK_POOL ("pool-<pool>"): it serves <pool>-0 .. <pool>-<size-1>,
     * and its NATS permissions name each of them (1..STACK_POOL_MAX). */
    unsigned pool_size;
};

/* Most ids one pool identity may serve: its permissions list each id
 * (about 150 bytes of nats-auth.conf per id). */
#define STACK_POOL_MAX 100000

/*
 * Limits of the agents' account AGENTS in nats-auth.conf. nats-server 2.9
 * has limits per account only (opts.go parseAccountLimits), none per
 * user, and an account that a reload adds gets no working service
 * imports (2.9.10: its requests reach nobody until a restart), so agents
 * and pools share AGENTS and its limits: STACK_AGENT_CONNECTIONS
 * connections per agent or pool identity and
 * STACK_AGENTS_SPARE_CONNECTIONS more, all together; each connection at
 * most STACK_SUBSCRIPTIONS subscriptions more than the largest pool has
 * ids. Measured: an agent uses 1 connection and 2 subscriptions, a pool
 * of N ids 1 connection and N + 1 (one per id's cancels), the broker 1
 * and 32 (its in-process agents another, 1 + ids).
 */
#define STACK_AGENT_CONNECTIONS 4
#define STACK_AGENTS_SPARE_CONNECTIONS 16
#define STACK_SUBSCRIPTIONS 64

/*
 * A new pool identity "pool-<pool>" (pool: a subject token) serving
 * <pool>-0 .. <pool>-<size-1>: as stack_ident_add, with the size in its
 * entry. 0, -EEXIST, KS_EINVAL (bad name, size 0 or > STACK_POOL_MAX),
 * -errno.
 */
int stack_ident_add_pool(const char *home, const char *pool, unsigned size,
                         struct stack_identity *out);

/* "broker", "operator", "agent", "pool" (the template's section names). */
const char *stack_kind_name(enum stack_kind k);

/* An operator name is a subject token ([A-Za-z0-9_-], at most
 * EVT_IDENTITY_MAX), not "broker", "system" or "anonymous", and does not
 * start with "agent-" or "pool-". 0 or KS_EINVAL. */
int stack_operator_name_check(const char *name);

/* The seed file of an identity held under home (see above). 0 or
 * -ENAMETOOLONG. */
int stack_ident_seed_path(const char *home, enum stack_kind kind,
                          const char *name, char *buf, size_t len);

/* The entry of name. 0, KS_ENOTFOUND, KS_EINVAL (a damaged entry), -errno. */
int stack_ident_get(const char *home, const char *name,
                    struct stack_identity *out);

/*
 * A new identity: a fresh key pair (OpenSSL), its seed file (0600) and its
 * entry. The name must fit the kind ("broker", "agent-<id>", or
 * stack_operator_name_check). 0, -EEXIST (the name is taken), KS_EINVAL,
 * -errno. Does not touch nats-server: stack_nats_auth_write and
 * stack_nats_reload do.
 */
int stack_ident_add(const char *home, enum stack_kind kind, const char *name,
                    struct stack_identity *out);

/*
 * The identity as it is when its entry and the seed file we hold agree
 * (the usual case: no new secret at every start); the entry rewritten
 * from the seed file when only that one is right; a new pair when there is
 * no usable seed file (a damaged one is renamed to <file>.bad). 0 or as
 * stack_ident_add.
 */
int stack_ident_ensure(const char *home, enum stack_kind kind,
                       const char *name, struct stack_identity *out);

/* Every entry, by kind then name. *out is malloc'd (NULL when *n_out is
 * 0). 0, KS_EINVAL (a damaged entry), -errno. */
int stack_ident_list(const char *home, struct stack_identity **out,
                     size_t *n_out);

/* Removes the entry and its seed file. 0, KS_ENOTFOUND, -errno. */
int stack_ident_remove(const char *home, const char *name);

/*
 * The nats-server accounts and users for these identities:
 * deploy/nats-auth.conf.in with one user per identity from its kind's
 * section, brokers and operators in account KSCORE (which holds
 * JetStream), single agents in account AGENTS and each pool in an account
 * of its own, "pool-<pool>" (which reach KSCORE through the template's
 * imports only), with the limits above; the system user in SYS.
 * *conf_out is malloc'd. 0, KS_EINVAL (no identity at all: an empty user
 * list would let anyone in; or a bad name or key), -ENOMEM.
 */
int stack_nats_auth_conf(const struct stack_identity *ids, size_t n,
                         char **conf_out);

/* Where the rendered block goes, and the line of nats.conf that reads it
 * (pass it as stack_nats_start()'s conf_extra; nats-server resolves an
 * include relative to the including file). */
#define STACK_NATS_AUTH_FILE "nats-auth.conf"
#define STACK_NATS_AUTH_INCLUDE "include \"" STACK_NATS_AUTH_FILE "\"\n"

/* Renders the registry of home into <nats_dir>/nats-auth.conf (0600,
 * replaced atomically). 0 or as stack_ident_list / stack_nats_auth_conf. */
int stack_nats_auth_write(const char *nats_dir, const char *home);

/*
 * Makes the nats-server of nats_dir reload its config (SIGHUP, as
 * `nats-server --signal reload` does) and waits up to timeout_ms until its
 * log says it did. The server keeps running and keeps every connection
 * whose user is still allowed; a connection of a user no longer in the
 * config is closed by the server (Authorization Violation) and its
 * reconnects are refused. So is, once, a connection still in its
 * handshake (its CONNECT not yet read: nats-server 2.9 checks it as a
 * user with no key, "authentication error - Nkey \"\""): an agent
 * starting then exits and its unit starts it again. 0; KS_ENOTFOUND
 * (not running: nothing to do); KS_EINVAL (the server refused the new
 * config and runs on the old one; see <nats_dir>/nats.log); KS_ETIMEDOUT;
 * -errno.
 */
int stack_nats_reload(const char *nats_dir, int timeout_ms);

/* 1 if the pid in <dir>/<name>.pid is alive, else 0; *pid_out if alive. */
int stack_pidfile_alive(const char *dir, const char *name, pid_t *pid_out);
/* 1 when pid runs: exists and is not a zombie (a killed process whose
 * parent has not reaped it yet, e.g. a daemon under a slow init). */
int stack_pid_alive(pid_t pid);

/*
 * The pid files of <dir> (nats, pg, broker, agent and PostgreSQL's
 * pg/postmaster.pid, and the pid in its socket lock
 * pgsock/.s.PGSQL.PORT.lock) are forgotten when <dir>/boot_id names another boot
 * than this one: no process outlives a reboot, and a stack that was not
 * stopped (power loss, a crash) leaves pids that after the reboot may be
 * other processes', which `up` would take for running parts and `down`
 * (or pg_ctl) would signal. Then records this boot in <dir>/boot_id. A
 * dir that does not exist is left alone. 0, or -errno (nothing is lost by
 * ignoring it: the pid files are then read as before).
 */
int stack_forget_other_boot(const char *dir);

/* ---- the stack as a JetStream cluster (stack_cluster.c) ----------------
 *
 * `kscore up --cluster N`: nodes nats-1..N, each in <home>/nats-<i>/ with
 * its own store, pid file, log and kept ports (nats.port for clients,
 * route.port for the cluster's routes), all on 127.0.0.1; server_name is
 * "nats-<i>" (JetStream knows its peers by name, so it never changes).
 * No node opens an HTTP monitoring port: stack_nats_monitor asks over
 * NATS as the stack's system user. */
#define STACK_CLUSTER_MAX 5

struct stack_node {
    int index;          /* 1..N */
    char dir[4200];     /* <home>/nats-<i> */
    char name[32];      /* server_name and part name: "nats-<i>" */
    int port, route_port; /* 0: none kept */
    /* > 0: the node's HTTP monitoring port (a node of the deploy files,
     * deploy/cluster), asked instead of the system user over NATS */
    int mon_port;
    char url[64]; /* nats://127.0.0.1:<port>, or the stack's own url */
    bool running;
    bool started;       /* started by stack_cluster_start */
    pid_t pid;
};

/* The token a scrape of the local stack's /metrics needs, in
 * <home>/keys/ (evt_token_file_make; `kscore up --metrics`). */
#define STACK_METRICS_TOKEN "metrics.token"
/* The password of the local cluster's routes, in <home>/keys/ (made by
 * the first stack_cluster_start; evt_token_file_make). */
#define STACK_ROUTE_SECRET "route.secret"

/* The n nodes as they are on disk (kept ports) and whether each runs.
 * 0 or KS_EINVAL (n not in 1..STACK_CLUSTER_MAX). */
int stack_cluster_nodes(const char *home, unsigned n, struct stack_node *out);

/*
 * Starts the nodes that do not run, each with a nats.conf naming every
 * other node's route and including conf_extra (the auth include; each
 * node dir gets its own nats-auth.conf from home's registry). A node gets
 * its kept ports back when they are free, else new ones; moved (may be
 * NULL) then says which client ports changed. Each start waits until the
 * node accepts clients, not for the meta leader
 * (stack_cluster_wait_leader). 0 or as stack_nats_start.
 */
int stack_cluster_start(const char *home, unsigned n, struct stack_node *nodes,
                        const char *conf_extra, char *moved,
                        size_t moved_len);

/* "nats://127.0.0.1:P1,nats://127.0.0.1:P2,...": every node (*out
 * malloc'd), as evt_connect takes it. 0 or -ENOMEM. */
int stack_cluster_urls(const struct stack_node *nodes, unsigned n, char **out);

/*
 * What a stack nats-server's monitoring says: `what` "VARZ", "JSZ" or
 * "CONNZ" (the server's /varz, /jsz, /connz; flags add the accounts',
 * streams' and consumers' details and the consumers' config to JSZ, each
 * connection's subscriptions to CONNZ; at most STACK_MON_LIMIT
 * connections or accounts), asked over NATS as the stack's system user
 * ($SYS.REQ.SERVER.<server id>.<what> of the server at nd->url, seed
 * <home>/keys/system.nk, TLS files from <home>/env; home is the parent of
 * nd->dir), or at nd->mon_port when that is set. *out (the caller's) is
 * what the HTTP port would answer. 0, KS_ENOTFOUND (no system user: a
 * stack that `kscore up` has not started since it has one),
 * KS_EUNAVAIL (no answer), KS_ETIMEDOUT, KS_EDECODE.
 */
#define STACK_MON_ACCOUNTS 1u
#define STACK_MON_STREAMS 2u
#define STACK_MON_CONSUMERS 4u
#define STACK_MON_CONFIG 8u
#define STACK_MON_SUBS 16u
#define STACK_MON_LIMIT 1024
struct json_t; /* jansson's json_t */
int stack_nats_monitor(const struct stack_node *nd, const char *what,
                       unsigned flags, int timeout_ms, struct json_t **out);
/* The node of a one-node stack (dir <home>/nats, its url from
 * <home>/env), for stack_nats_monitor. 0 or KS_ENOTFOUND (no url). */
int stack_single_node(const char *home, struct stack_node *out);

/* What a node's monitoring says (VARZ and JSZ). */
struct stack_js_info {
    char server_name[64];
    char meta_leader[64]; /* "" while there is none */
    int cluster_size, streams, consumers;
    long long mem_bytes;
};
/* As stack_nats_monitor. */
int stack_nats_js_info(const struct stack_node *nd, struct stack_js_info *out);
/* "leader", "follower" (of the JetStream meta group) or "no-leader". */
const char *stack_js_role(const struct stack_js_info *ji);

/* Waits (<= timeout_ms) until a running node names a meta leader (into
 * leader, may be NULL). 0 or KS_ETIMEDOUT. */
int stack_cluster_wait_leader(const struct stack_node *nodes, unsigned n,
                              int timeout_ms, char *leader, size_t len);

/* The replicated streams of the stack (KSCORE_CMDS, KSCORE_EVENTS and the
 * agents bucket's KV_KSCORE_AGENTS), as their leader sees them. */
#define STACK_STREAMS 3
extern const char *const stack_stream_names[STACK_STREAMS];
struct stack_stream_state {
    char name[32];
    char leader[64];   /* "" while its raft group has no leader */
    int replicas;      /* the peers besides the leader */
    int current;       /* of those, how many the leader calls current */
    char behind[128];  /* the ones that are not, comma separated */
    long long messages, last_seq;
};

/* Each stack stream's state (out[STACK_STREAMS], in stack_stream_names'
 * order), from the running nodes' /jsz: the leader's own view of its
 * replicas (a follower's view of the others is stale). A stream that no
 * node reports, or whose named leader does not report it as leader, has
 * leader "". 0, or KS_EUNAVAIL when no node answered. */
int stack_cluster_streams(const struct stack_node *nodes, unsigned n,
                          struct stack_stream_state *out);

/*
 * Which of kscore's JetStream parts (evt_part_names: the three streams and
 * the recorder's consumer) the nats-server nd holds, from its JSZ (any
 * account): bit i of *present for evt_part_names[i]. On a cluster, OR the
 * nodes' answers (a node holds only the streams it replicates). 0, or as
 * stack_nats_monitor.
 */
int stack_js_parts(const struct stack_node *nd, unsigned *present);

/* Waits (<= timeout_ms) until every stack stream has a leader and, with
 * all_current, every replica is current. 0 or KS_ETIMEDOUT. */
int stack_cluster_wait_streams(const struct stack_node *nodes, unsigned n,
                               bool all_current, int timeout_ms);

/* GET http://127.0.0.1:port<path>: the body of a 200 (malloc'd). 0,
 * KS_EUNAVAIL, KS_ETIMEDOUT, -errno. */
int stack_http_get(int port, const char *path, int timeout_ms,
                   char **body_out);
/* The same with "Authorization: Bearer <bearer>" when bearer is not NULL
 * or "" (a kscore /metrics with a token file). */
int stack_http_get_auth(int port, const char *path, const char *bearer,
                        int timeout_ms, char **body_out);

/* VmRSS of pid in kB, or -1. */
long stack_rss_kb(pid_t pid);
/* Its peak resident set (VmHWM) in kB, or -1. */
long stack_rss_peak_kb(pid_t pid);

/* ---- TLS: the stack's own CA (stack_tls.c, OpenSSL libcrypto) ---------
 *
 * <home>/tls/ca.key (0600) and ca.pem, a P-256 CA made once and kept;
 * server.pem/.key for nats-server (subjectAltName: each listen address);
 * client certificates (CN = NATS identity) for mutual TLS. */
struct stack_tls_paths {
    char dir[4200], ca_cert[4300], ca_key[4300], server_cert[4300],
        server_key[4300];
};
void stack_tls_paths(const char *home, struct stack_tls_paths *out);
/* Makes the CA unless both files are there. 0, KS_EINTERNAL, -errno. */
int stack_tls_ca_ensure(const char *home);
/*
 * A leaf certificate signed by the CA, as PEM text (both malloc'd): with
 * sans (IP addresses or DNS names), a server certificate for them; with
 * none, a client certificate whose CN is cn. 0, KS_ENOTFOUND (no CA),
 * KS_EINVAL (a bad CA file or name), KS_EINTERNAL, -errno.
 */
int stack_tls_issue(const char *home, const char *cn, const char *const *sans,
                    size_t n_sans, char **cert_out, char **key_out);
/* The CA (made when missing) and a new server certificate for hosts
 * (server.pem, server.key 0600). 0 or as above. */
int stack_tls_server_ensure(const char *home, const char *const *hosts,
                            size_t n_hosts);
/* A client certificate for cn into cert_path (0644) and key_path (0600). */
int stack_tls_client_write(const char *home, const char *cn,
                           const char *cert_path, const char *key_path);
/* nats-server's tls block for home's server certificate (*conf_out
 * malloc'd); verify_clients: mutual TLS. 0 or -ENOMEM. */
int stack_tls_conf(const char *home, bool verify_clients, char **conf_out);

#endif
