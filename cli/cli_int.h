/* Private to cli/: the subcommands and what they share. */
#ifndef KSCORE_CLI_INT_H
#define KSCORE_CLI_INT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "broker.h"

/*
 * Exit codes of kscore itself (README "Exit codes"). `kscore exec` otherwise
 * exits with the command's own code, 128+N when it was killed by signal N,
 * and 124 when it timed out, as coreutils timeout(1) does.
 */
#define CLI_EXIT_USAGE 2       /* bad flags, durations, missing -- */
#define CLI_EXIT_TIMEDOUT 124  /* the command timed out */
#define CLI_EXIT_KSCORE 125    /* kscore failed: unreachable, refused, ... */
#define CLI_EXIT_CANNOT_RUN 126 /* start failed (cwd, permission, E2BIG) */
#define CLI_EXIT_NOT_FOUND 127 /* start failed: program not found */

/* Where the local stack lives: $KSCORE_HOME or ~/.local/state/kscore. */
const char *cli_home(void);

/* Connection settings shared by the client subcommands. */
struct cli_conn {
    const char *nats_url; /* --nats, $KSCORE_NATS_URL, or the local stack */
    struct evt_connect_opts opts;
    char *owned[8];       /* strings read from $KSCORE_HOME/env */
};

/*
 * The NATS connection flags every command takes, for getopt_long tables:
 * --nats URL, --nkey FILE, --user U, --password P, --creds FILE,
 * --token T, --tls-ca FILE, --tls-cert FILE, --tls-key FILE. Each also has
 * an environment variable: KSCORE_NATS_URL, KSCORE_NATS_NKEY,
 * KSCORE_NATS_USER, KSCORE_NATS_PASSWORD, KSCORE_NATS_CREDS,
 * KSCORE_NATS_TOKEN, KSCORE_NATS_TLS_CA, KSCORE_NATS_TLS_CERT,
 * KSCORE_NATS_TLS_KEY. --nkey is an NKey seed file (`kscore operator add`
 * writes one); it names the identity, and user/password are then unused.
 */
#define CLI_OPT_NATS 0x1000
#define CLI_CONN_LONGOPTS                                                      \
    {"nats", required_argument, 0, CLI_OPT_NATS},                              \
        {"user", required_argument, 0, CLI_OPT_NATS + 1},                      \
        {"password", required_argument, 0, CLI_OPT_NATS + 2},                  \
        {"creds", required_argument, 0, CLI_OPT_NATS + 3},                     \
        {"token", required_argument, 0, CLI_OPT_NATS + 4},                     \
        {"tls-ca", required_argument, 0, CLI_OPT_NATS + 5},                    \
        {"tls-cert", required_argument, 0, CLI_OPT_NATS + 6},                  \
        {"tls-key", required_argument, 0, CLI_OPT_NATS + 7},                   \
    {                                                                          \
        "nkey", required_argument, 0, CLI_OPT_NATS + 8                         \
    }
#define CLI_CONN_USAGE                                                         \
    "NATS: --nats URL --nkey FILE --user U --password P --creds FILE\n"       \
    "      --token T --tls-ca FILE --tls-cert FILE --tls-key FILE\n"          \
    "      (or KSCORE_NATS_*)\n"

/*
 * The command options `exec` and `batch` share: --timeout D, --grace D,
 * --env K=V (repeatable), --cwd DIR, --deliver-within D.
 */
#define CLI_OPT_SPEC 0x2000
#define CLI_SPEC_LONGOPTS                                                      \
    {"timeout", required_argument, 0, CLI_OPT_SPEC},                           \
        {"grace", required_argument, 0, CLI_OPT_SPEC + 1},                     \
        {"env", required_argument, 0, CLI_OPT_SPEC + 2},                       \
        {"cwd", required_argument, 0, CLI_OPT_SPEC + 3},                       \
        {"deliver-within", required_argument, 0, CLI_OPT_SPEC + 4},            \
    {                                                                          \
        "max-output", required_argument, 0, CLI_OPT_SPEC + 5                   \
    }

struct cli_spec {
    Ks__CommandSpec spec;   /* argv set by the caller */
    Ks__EnvVar *envs;       /* storage for --env, cap entries */
    Ks__EnvVar **envp;
    size_t cap;
    uint64_t deliver_within_ms;
};

/* Allocates room for cap --env values; 0 or -ENOMEM. */
int cli_spec_init(struct cli_spec *cs, size_t cap);
void cli_spec_release(struct cli_spec *cs);
/*
 * Takes one of the CLI_SPEC_LONGOPTS (arg is modified for --env): 1 if
 * taken, 0 if opt is not one of them, -1 after printing a bad value.
 */
int cli_spec_opt(struct cli_spec *cs, int opt, char *arg);

/*
 * After getopt: the command must follow "--" (argv[optind - 1]) and have a
 * non-empty name; sets cs->spec.argv. 0, or -1 after printing one line
 * naming what is wrong (name: "exec" or "batch").
 */
int cli_spec_argv(struct cli_spec *cs, int argc, char **argv, int optind,
                  const char *name);

/*
 * --secret-env NAME (cli/cmd_secret.c): NAME's value in this process's
 * environment, sealed to each target agent's key before the request goes
 * out. cli_secret_opt takes one flag (1, or -1 after printing why: a bad
 * or repeated name, not set, too long). cli_secrets_seal lists the
 * agents, seals every name to each target (agents, plus for select / all
 * every listed agent that matches) and points spec->sealed_env at the
 * result (owned by s); 0, or -1 after printing why. Nothing to do without
 * names.
 */
/* What get / events show for a secret variable's value. */
#define CLI_SECRET_SHOWN "<secret>"
struct cli_secrets {
    const char **names; /* borrowed from argv */
    size_t n_names, cap;
    Ks__SealedEnv *items, **ptrs;
    size_t n_items;
};
int cli_secret_opt(struct cli_secrets *s, const char *name);
/* After parsing: no name is also an --env name. 0, or -1 after printing. */
int cli_secrets_check(const struct cli_secrets *s, const Ks__CommandSpec *spec);
int cli_secrets_seal(struct cli_secrets *s, struct evt_conn *c,
                     char *const *agents, size_t n_agents,
                     Ks__EnvVar *const *select, size_t n_select, bool all,
                     Ks__CommandSpec *spec);
void cli_secrets_release(struct cli_secrets *s);

/* Takes one of the CLI_CONN_LONGOPTS; 1 if opt was one, else 0. */
int cli_conn_opt(struct cli_conn *cc, int opt, const char *arg);
/* Fills unset fields from the environment (KSCORE_NATS_*). */
void cli_conn_env(struct cli_conn *cc);
/* Frees what cli_connect read from the env file. */
void cli_conn_release(struct cli_conn *cc);

/*
 * Resolves the NATS url (flag, environment, $KSCORE_HOME/env) and the
 * credential (--nkey and the other flags, then the environment, then the
 * local stack's $KSCORE_HOME/env when it is that stack's url), and
 * connects. Prints one line naming the problem and returns non-zero on
 * failure.
 */
int cli_connect(struct cli_conn *cc, struct evt_conn **out);

/* Value of KEY in $KSCORE_HOME/env (malloc'd), or NULL. */
char *cli_env_get(const char *key);

/* Parses "500ms", "10s", "2m", "1h" or plain seconds into ms. 0 or -1. */
int cli_parse_duration(const char *s, uint64_t *ms_out);

/* Prints "kscore: <message>" on stderr. */
void cli_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The command result as JSON (text when valid UTF-8, base64 always). */
json_t *cli_result_json(const Ks__CommandResult *r);
/* One recorded event as JSON (README "kscore events --json"). */
json_t *cli_event_json(const Ks__RecordedEvent *rec);
/* Prints j compactly on one line to stdout; frees it. */
void cli_print_json(json_t *j);
/* Microseconds since the epoch as RFC 3339 UTC text (static buffer). */
const char *cli_time(int64_t us);

/* A batch reply (state, counts, targets) as JSON. */
json_t *cli_batch_json(const Ks__BatchReply *rep);

/* Exit status for a finished command (see the codes above). */
int cli_exit_status(const Ks__CommandResult *r);

int cmd_up(int argc, char **argv);
int cmd_down(int argc, char **argv);
int cmd_status(int argc, char **argv);
int cmd_broker(int argc, char **argv);
int cmd_agent(int argc, char **argv);
int cmd_exec(int argc, char **argv);
int cmd_get(int argc, char **argv);
int cmd_events(int argc, char **argv);
int cmd_cancel(int argc, char **argv);
int cmd_agents(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_perf(int argc, char **argv);
int cmd_batch(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_operator(int argc, char **argv);
int cmd_logs(int argc, char **argv);

/* ---- output as it is written (cli/out_stream.c) ---- */
struct cli_bytes {
    uint8_t *data;
    size_t len;
};
/* One kscore.api.v1.logs page. 0 with *out, or a transport error. */
int cli_logs_page(struct evt_conn *c, const char *command_id, uint64_t out_off,
                  uint64_t err_off, bool no_out, bool no_err,
                  Ks__LogsReply **out);
/* Bytes [from, to) of one stream (1 stdout, 2 stderr) from the record, to
 * fd (-1: none) and/or appended to acc (may be NULL). 0, or an error
 * (KS_ETIMEDOUT: the record does not hold them after a wait). */
int cli_output_range(struct evt_conn *c, const char *command_id, int stream,
                     uint64_t from, uint64_t to, int fd,
                     struct cli_bytes *acc);
/* An exec's live output and its Ctrl-C. */
struct cli_live {
    struct evt_conn *c;
    bool print;      /* write the output to fds 1 and 2 (not --json) */
    char command_id[37];
    uint64_t off[2]; /* bytes of each stream written */
    bool cancel_sent;
};
void cli_live_init(struct cli_live *lv, struct evt_conn *c, bool print);
/* From now on Ctrl-C is the hooks' to act on (cancel, then detach). */
void cli_live_catch_sigint(void);
void cli_live_hooks(struct cli_live *lv, struct broker_exec_hooks *h);
/* Whether Ctrl-C was pressed. */
bool cli_live_interrupted(const struct cli_live *lv);
/* At the end: prints what was not printed live (print), or fills r's
 * outputs that travelled in pieces (--json). 0 or an error (said). */
int cli_live_finish(struct cli_live *lv, const char *command_id,
                    Ks__CommandResult *r);
/* batch --stream: prints a progress message's pieces as "agent: line";
 * _end prints what is left of unfinished lines. */
void cli_stream_batch_piece(const Ks__BatchProgress *p);
void cli_stream_batch_end(void);

#endif
