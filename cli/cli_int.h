/* Private to cli/: the subcommands and what they share. */
#ifndef KSCORE_CLI_INT_H
#define KSCORE_CLI_INT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "client.h"

/*
 * kscore is two executables (docs/development.md "Modules"): kscore, the
 * operator's
 * commands (cli/main.c), and the daemon half, CLI_DAEMON_NAME
 * (cli/daemon.c): the services, the local stack and what needs PostgreSQL
 * or libmicrohttpd, the commands of CLI_DAEMON_COMMANDS. kscore runs the
 * daemon half for those with the same argv. In the build tree both are in
 * build/cli/; installed, kscore is in bindir and the daemon half in
 * libexecdir/kscore/.
 */
#define CLI_DAEMON_NAME "kscore-daemon"
#define CLI_VERSION "0.1.0"
#define CLI_DAEMON_COMMANDS(X)                                                 \
    X(up) X(down) X(status) X(broker) X(agent) X(replay) X(perf) X(keygen)     \
        X(operator)
struct cli_command {
    const char *name;
    int (*fn)(int argc, char **argv); /* argv[0] is the name */
};
/*
 * main() of both halves: `help CMD` (CMD's own --help), -h as --help
 * before `--`, --help or no command (usage on stdout, or stderr and
 * CLI_EXIT_USAGE), --version, then argv[1]'s command of cmds (n
 * entries). A name not in cmds goes to other (may be NULL) with the
 * whole argv, which returns -1 when it is not its either, else an exit
 * code. Returns the process's exit code.
 */
int cli_main(int argc, char **argv, const struct cli_command *cmds, size_t n,
             const char *usage, int (*other)(char **argv, const char *name));

/*
 * The path of the other half, name (CLI_DAEMON_NAME or "kscore"): beside
 * this executable (the build tree), else at rel (from this executable's
 * directory to where the other half is installed, CMake's
 * KSCORE_DAEMON_REL / KSCORE_FRONT_REL). 0 with buf, or -errno (-ENOENT:
 * in neither place) with buf the last path tried ("" when this
 * executable's own path cannot be read).
 */
int cli_other_half(const char *name, const char *rel, char *buf, size_t len);

/*
 * Exit codes of kscore itself (docs/operating.md "Exit codes"). `kscore exec`
 * otherwise
 * exits with the command's own code, 128+N when it was killed by signal N,
 * and 124 when it timed out, as coreutils timeout(1) does.
 */
#define CLI_EXIT_USAGE 2       /* bad flags, durations, missing -- */
#define CLI_EXIT_TIMEDOUT 124  /* the command timed out */
#define CLI_EXIT_KSCORE 125    /* kscore failed: unreachable, refused, ... */
/* The outcome is unknown: the command may be recorded (and run); `kscore
 * get <id>` tells. Distinct from 125, which says it was not accepted. */
#define CLI_EXIT_UNKNOWN 69
/* Refused because it could not start in time (KS_EBUSY): nothing was
 * recorded, asking again later is safe. sysexits.h EX_TEMPFAIL. */
#define CLI_EXIT_BUSY 75
#define CLI_EXIT_CANNOT_RUN 126 /* start failed (cwd, permission, E2BIG) */
#define CLI_EXIT_NOT_FOUND 127 /* start failed: program not found */
/* kscore batch: no target failed, but some never ran (through): no
 * response, lost, not started, cancelled. */
#define CLI_EXIT_NOT_ALL_RAN 4

/*
 * Says that the outcome of a request is unknown (error: the broker's
 * words; command_id may be "" when only key names it) and how to look it
 * up, on stderr. Returns CLI_EXIT_UNKNOWN.
 */
int cli_outcome_unknown(const char *what, const char *error,
                        const char *command_id, const char *key);

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
 * A fleet run (cli/cmd_batch.c), shared by `kscore batch` and `kscore
 * copy`: its targets (--agents, --select, --all, --online-only,
 * --dry-run, --yes, --confirm-over), rate (--max-concurrency,
 * --max-errors, --strict-errors) and output (--json, --detach,
 * --stream) options, and the run itself: confirmation, progress, the
 * grouped results, the exit code (docs/operating.md "Exit codes").
 */
#define CLI_BATCH_LONGOPTS                                                     \
    {"agents", required_argument, 0, 'a'},                                     \
        {"select", required_argument, 0, 's'},                                 \
        {"all", no_argument, 0, 'A'}, {"online-only", no_argument, 0, 'O'},    \
        {"dry-run", no_argument, 0, 'n'}, {"yes", no_argument, 0, 'y'},        \
        {"confirm-over", required_argument, 0, 'C'},                           \
        {"max-concurrency", required_argument, 0, 'c'},                        \
        {"max-errors", required_argument, 0, 'E'},                             \
        {"strict-errors", no_argument, 0, 'S'},                                \
        {"waves", required_argument, 0, 'W'},                                  \
        {"wave-pause", required_argument, 0, 'P'},                             \
        {"json", no_argument, 0, 'j'}, {"detach", no_argument, 0, 'D'},        \
    {                                                                          \
        "stream", no_argument, 0, 'T'                                          \
    }
struct cli_batch {
    Ks__BatchRequest req; /* targets and rate; spec set by cli_batch_run */
    Ks__Amount conc, errs;
    char **agents, **terms; /* storage of req.agents, req.selector */
    size_t cap;            /* of terms */
    size_t agents_cap;     /* of agents (grows: --agents @FILE) */
    char **owned;          /* the ids read from files */
    size_t n_owned, owned_cap;
    bool agents_stdin;     /* --agents @-: stdin held the ids */
    Ks__Amount *waves;     /* --waves, storage of req.waves */
    Ks__Amount **wavep;
    const char *errs_arg;
    bool yes, json;
    long confirm_over;
};
/* Room for argv's targets, $KSCORE_CONFIRM_OVER. 0, or an exit code after
 * printing. */
int cli_batch_init(struct cli_batch *bt, int argc, char **argv);
void cli_batch_release(struct cli_batch *bt);
/* --waves takes at most this many sizes; --wave-pause at most 24 h. */
#define CLI_WAVES_MAX 1000
#define CLI_WAVE_PAUSE_MAX_MS (24 * 3600 * 1000ULL)
/* One of CLI_BATCH_LONGOPTS: 1 taken, 0 not one, -1 after printing. */
int cli_batch_opt(struct cli_batch *bt, int opt, char *arg);
/* After getopt: targets given and consistent, and the rate options
 * (cli_batch_check_rate alone: a rerun's, whose targets are the
 * broker's). 0 or -1 after printing. */
int cli_batch_check(const struct cli_batch *bt);
int cli_batch_check_rate(const struct cli_batch *bt);
/*
 * Connects (cc), lists the targets for a dry run or a confirmation, calls
 * prepare (may be NULL: what must exist before the request, e.g. kscore
 * copy's uploads; it returns 0 or an exit code after printing), seals sec
 * (may be NULL), runs spec on the targets and prints as kscore batch does.
 * Returns the exit code.
 */
struct cli_secrets;
int cli_batch_run(struct cli_batch *bt, struct cli_conn *cc,
                  Ks__CommandSpec *spec, struct cli_secrets *sec,
                  int (*prepare)(void *ud, struct evt_conn *c), void *ud);

/*
 * What exec and batch send besides argv (cli/cmd_payload.c): --script
 * FILE [ARG]..., stdin (read to its end when it is not a terminal, or
 * --stdin-file FILE; --no-stdin: none), --run-as USER[:GROUP].
 */
#define CLI_OPT_PAYLOAD 0x2100
#define CLI_PAYLOAD_LONGOPTS                                                   \
    {"script", required_argument, 0, CLI_OPT_PAYLOAD},                         \
        {"stdin-file", required_argument, 0, CLI_OPT_PAYLOAD + 1},             \
        {"no-stdin", no_argument, 0, CLI_OPT_PAYLOAD + 2},                     \
    {                                                                          \
        "run-as", required_argument, 0, CLI_OPT_PAYLOAD + 3                    \
    }
#define CLI_PAYLOAD_USAGE                                                      \
    "  --script FILE       run FILE (at most 512 KiB) on the agent by its #!\n" \
    "                      interpreter (none: /bin/sh), from a private copy\n" \
    "                      removed after; the arguments after it are $1...\n"  \
    "  --stdin-file FILE   the command's stdin (at most 256 KiB); without it\n" \
    "                      kscore's own stdin when it is not a terminal\n"      \
    "  --no-stdin          send no stdin (the command reads /dev/null), as\n"  \
    "                      ssh -n: for a stdin that never ends\n"              \
    "  --run-as USER[:GROUP]  run as USER (its groups, HOME), when the\n"       \
    "                      policy allows it\n"
struct cli_payload {
    const char *script_path, *stdin_path, *run_as; /* borrowed from argv */
    bool no_stdin;
    uint8_t *script, *input; /* what was read (malloc'd) */
    size_t script_len, input_len;
    uint8_t script_sum[32], input_sum[32];
    Ks__Payload script_pl, input_pl;
    char **argv; /* --script: the script's name and arguments */
};
/* One of CLI_PAYLOAD_LONGOPTS: 1 taken, 0 not one, -1 after printing. */
int cli_payload_opt(struct cli_payload *p, int opt, const char *arg);
/* After getopt: without --script as cli_spec_argv; with it, argv[optind..]
 * (after an optional --) are the script's arguments. 0 or -1 after
 * printing. */
int cli_payload_argv(struct cli_payload *p, struct cli_spec *cs, int argc,
                     char **argv, int optind, const char *name);
/*
 * Reads the script and (stdin_too) stdin within their caps (proto/kproto.h
 * KS_SCRIPT_MAX_BYTES, KS_INPUT_MAX_BYTES) and points spec at them with
 * their SHA-256, before anything is sent. 0, or CLI_EXIT_USAGE after
 * printing why (unreadable, over its cap: nothing is sent).
 */
int cli_payload_load(struct cli_payload *p, Ks__CommandSpec *spec,
                     bool stdin_too);
void cli_payload_release(struct cli_payload *p);
/* get / events: a recorded spec's script, stdin, run_as and copy, as
 * JSON keys of o or text lines (sizes and SHA-256, never the bytes). */
void cli_payload_json(json_t *o, const Ks__CommandSpec *sp);
void cli_payload_print(FILE *f, const Ks__CommandSpec *sp,
                       const char *indent);

/*
 * --secret-env NAME (cli/cmd_secret.c): NAME's value in this process's
 * environment, sealed to each target agent's key before the request goes
 * out. cli_secret_opt takes one flag (1, or -1 after printing why: a bad
 * or repeated name, not set, too long). cli_secrets_seal lists the
 * agents, seals every name to each target (agents; without agents, for
 * selector terms / all every listed agent that matches) and points spec->sealed_env at the
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
                     char *const *terms, size_t n_terms, bool all,
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

/* Prints "kscore: <message>" on stderr; once cli_err_as_log() was called,
 * a ks_log error line instead. */
void cli_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/*
 * The status line (kscore batch's progress bar): one line on stderr,
 * redrawn in place ("\r\033[K" then the text), for the caller to use
 * only when stderr is a terminal. cli_status_show draws text (at most 511
 * bytes, no newline) and keeps it; cli_status_end erases it for good.
 * Around any other output that may reach the terminal, cli_status_hide(fd)
 * (fd 1 or 2: what is about to be written) erases the line when fd is
 * that terminal, or stdout is a terminal too, and flushes fd's stdio
 * stream; cli_status_redraw draws the kept text again. cli_err does both.
 * Any thread (one lock).
 */
void cli_status_show(const char *text);
void cli_status_end(void);
void cli_status_hide(int fd);
void cli_status_redraw(void);
/* From here on cli_err() logs through ks_log (KS_LOG_ERROR): a service's
 * log settings are known (cli_conf_log), so a `--log-format json` log
 * stays JSON to its last line ("cannot connect to NATS", ...). */
void cli_err_as_log(void);
/* Says that a request (argv, environment, options) is over the NATS max
 * payload and nothing was sent: the bare KS_ETOOBIG ("too large") does not
 * tell an operator which limit or what to do. */
void cli_err_too_large(void);

/* The command result as JSON (text when valid UTF-8, base64 always). */
json_t *cli_result_json(const Ks__CommandResult *r);
/* One recorded event as JSON (docs/operating.md "Events"). */
json_t *cli_event_json(const Ks__RecordedEvent *rec);
/* Prints j compactly on one line to stdout; frees it. */
void cli_print_json(json_t *j);
/* Microseconds since the epoch as RFC 3339 UTC text (static buffer). */
const char *cli_time(int64_t us);
/* What the broker's consumer guard saw of an agent's consumer
 * (AgentStatus.consumer*): a JSON object {"name", "stalled" (why, or
 * null), "stalled_since", "repairs", "last_repair", "repaired_at"}, or
 * json_null() when it saw nothing wrong. */
json_t *cli_consumer_json(const Ks__AgentStatus *st);
/* The same as one line for a table ("" when nothing), into buf, e.g.
 * "consumer agent-x STALLED 3.1 s: ...; repaired 2 times, last 4 s ago:
 * made it again: ...". */
void cli_consumer_line(const Ks__AgentStatus *st, int64_t now_us, char *buf,
                       size_t len);
/* How long ago us microseconds is, short, into buf: "0.4s ago", "3m ago",
 * "2h ago", "5d ago" (negative: 0). */
void cli_ago(char *buf, size_t len, int64_t us);

/* A batch reply (state, counts, targets) as JSON. */
json_t *cli_batch_json(const Ks__BatchReply *rep);

/* ---- fleet results (cli/out_fleet.c): kscore batch and get batch-... -- */

/* The batch's exit code from its counts: 0 every target succeeded; 1 one
 * ran and failed (Failed, killed, TimedOut, StartFailed); else
 * CLI_EXIT_NOT_ALL_RAN. */
int fleet_exit_code(const Ks__BatchCounts *c);
/* "3 succeeded, 1 failed, 1 no response of 5 targets" (only states > 0);
 * of c->running (in flight), dispatched are said "dispatched" (not yet
 * claimed), the rest "running". */
void fleet_counts_text(const Ks__BatchCounts *c, unsigned dispatched,
                       char *buf, size_t len);
const char *fleet_status_name(Ks__BatchStatus s);
/* One target's result as JSON (cli_result_json + batch_id, agent_id,
 * command_id, status, truncated). */
json_t *fleet_target_json(const char *batch_id, const Ks__BatchTarget *t);
/* Orders targets by outcome and output; 0: they belong to one group. */
int fleet_cmp_outcome(const Ks__BatchTarget *a, const Ks__BatchTarget *b);

/* Every target of rep with its whole result: from have (command id ->
 * Ks__BatchTarget *, may be NULL), else fetched with a get (printed as a
 * JSON line when json). full[i] is target i. */
struct fleet_results {
    Ks__BatchReply *rep;
    Ks__BatchTarget **full;
    Ks__GetReply **fetched;
    size_t n;
};
int fleet_results_load(struct fleet_results *fr, struct evt_conn *c,
                       Ks__BatchReply *rep, struct ks_map *have, bool json);
void fleet_results_release(struct fleet_results *fr);
/* The per-target table, one block per group (clubak -b: the node set
 * folded, its outcome, stdout, then stderr), then "no response from:". */
void fleet_print(FILE *f, const Ks__BatchReply *rep,
                 Ks__BatchTarget *const *full, size_t n);
/* The waves of rep in one line ("waves: 3 (1, 5, 44 targets), pause
 * 10s; halted after wave 2 of 3: ..."), "" without waves. */
void fleet_waves_text(const Ks__BatchReply *rep, char *buf, size_t len);
/* "<id>: <status>: <counts> in <s>", then budget (a line) when set, the
 * waves, and a rerun's original and the batch's reruns. */
void fleet_summary(FILE *f, const Ks__BatchReply *rep, const char *budget);

/* Exit status for a finished command (see the codes above). */
int cli_exit_status(const Ks__CommandResult *r);

/*
 * The configuration file of a service (cli/cmd_config.c, man page
 * kscore.conf(5)): INI, `key = value`, checked as it is read. Precedence
 * is flags > environment (KSCORE_*) > file; each getter leaves a field a
 * flag set alone.
 */
#define CLI_CONF_DIR "/etc/kscore"
#define CLI_CONF_BROKER 1u
#define CLI_CONF_AGENT 2u
struct cli_conf_entry {
    char *key, *value;
    int line;
};
#define CLI_CONF_SHOWN_MAX 256
struct cli_conf {
    unsigned service;
    const char *service_name; /* "broker", "agent" */
    char *path;               /* NULL: no file */
    struct cli_conf_entry *v;
    size_t n, cap;
    /* what was decided, for --show-config: key, value, where from */
    struct {
        const char *key, *value;
        char *from;
    } shown[CLI_CONF_SHOWN_MAX];
    size_t n_shown;
};
/* Reads path, or CLI_CONF_DIR/<service>.conf when path is NULL and that
 * file exists. 0, or an exit code after printing FILE:LINE and the key
 * (CLI_EXIT_USAGE for an unknown key, a bad value, a key set twice). */
int cli_conf_load(struct cli_conf *c, unsigned service, const char *path);

/* 0 when the open file fd (named path) may steer a service: it is not
 * writable by anyone but its owner, and its owner is root or us. A file
 * that decides which key an agent trusts, or which NATS user it is, and
 * that another user may write, would let that user run anything where the
 * agent runs (as root). Devices (/dev/null) pass. Else KS_EINVAL with why. */
int cli_file_trusted(int fd, const char *path, char *why, size_t why_len);
/* cli_file_trusted on the file at path (printed); 0 also when it cannot
 * be opened (its reader reports that), else CLI_EXIT_USAGE. */
int cli_path_trusted(const char *path);
/* Makes s safe to print on a terminal, in place: every control byte (C0,
 * DEL) and every C1 control (U+0080..U+009F) becomes '?'. For text others
 * chose (an agent's labels, another operator's argv): raw, an ESC or a CR
 * could rewrite what the operator sees (forge another agent's row). */
void cli_printable(char *s);
/* Writes argv (n words) into out (cap bytes, NUL-terminated, cut at cap)
 * as a POSIX shell would read it back: a word with a space, quote or other
 * shell character, or an empty one, in single quotes ('\'' for a quote);
 * one with a control byte (a newline, an ESC, a C1 control) as $'...'
 * with escapes (\n, \t, \r, \xHH), so it is one line and safe on a
 * terminal. 4 * strlen + 4 bytes a word (with its separator) and one
 * for the NUL always suffice.
 * Joined with bare spaces, `sh -c 'a; b'` and `sh -c a; b` would print the
 * same and a listed command could not be told apart or pasted back. */
void cli_shell_join(char *const *argv, size_t n, char *out, size_t cap);
void cli_conf_release(struct cli_conf *c);
/* Sets *field, when no flag did, from the key's KSCORE_* variable, else
 * the file. 0, or CLI_EXIT_USAGE after printing a bad environment value. */
int cli_conf_str(struct cli_conf *c, const char *key, const char **field);
/* A boolean key's value ("true", "yes", "1"; else false). */
bool cli_conf_true(const char *v);
/* Notes a decided value and where it came from ("flag", "KSCORE_X",
 * "FILE:LINE") for cli_conf_show. */
void cli_conf_note(struct cli_conf *c, const char *key, const char *value,
                   const char *from);
/* Where the file's n-th value of key is ("FILE:LINE", malloc'd). */
char *cli_conf_where(const struct cli_conf *c, const char *key, size_t nth);
/* Prints every decided setting, `key = value  # from`, secrets (password,
 * token) masked: `kscore broker|agent --show-config`. */
void cli_conf_show(const struct cli_conf *c, FILE *out);
/* The file's values of a repeatable key, in order (at most cap). */
size_t cli_conf_list(const struct cli_conf *c, const char *key,
                     const char **out, size_t cap);
/* The NATS connection settings (nats_url, nkey, user, ...) of cc that no
 * flag set, from the environment, then the file. */
void cli_conf_conn(struct cli_conf *c, struct cli_conn *cc);
/* --log-format / --log-level (may be NULL), else log_format / log_level,
 * then ks_log_setup with service ("broker", "agent"). 0 or CLI_EXIT_USAGE
 * after printing. */
int cli_conf_log(struct cli_conf *c, const char *format_flag,
                 const char *level_flag, const char *service);

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
/* kscore agent label (cmd_admin.c): argv[0] is "label". */
int cmd_agent_label(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_perf(int argc, char **argv);
int cmd_batch(int argc, char **argv);
int cmd_copy(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_operator(int argc, char **argv);
int cmd_list(int argc, char **argv);

/* --since / --until: a duration back from now_us ("1h", "1h ago") or an
 * RFC 3339 time or date, into microseconds since the epoch. 0 or -1. */
int cli_parse_time(const char *s, int64_t now_us, int64_t *us_out);

/*
 * `kscore up --listen ADDR [--tls-name NAME]... [--mtls]` (cli/cmd_listen.c):
 * nats-server on ADDR instead of 127.0.0.1 (nats-server 2.9 has one client
 * listener, so the stack's own parts use ADDR too), TLS-only beyond
 * loopback with the stack's CA; kept in $KSCORE_HOME/env for later `up`s.
 */
struct cli_listen {
    const char *given_host;
    const char *names[16];
    size_t n_names;
    bool mtls, mtls_given;
    char host[64];  /* resolved: the address nats-server listens on */
    bool tls;       /* not a loopback address */
    /* The stack has enrolled agents or pools (cli_stack_enrolled): its
     * brokers take signed labels only, on loopback too. */
    bool enrolled;
    char *tls_conf; /* nats-server's tls block (malloc'd), NULL without */
    char ca[4300], bcert[4300], bkey[4300], acert[4300], akey[4300],
        ocert[4300], okey[4300];
};
/*
 * Whether the stack in home has enrolled an agent or a pool (`kscore agent
 * enroll`: an entry in home/enrolled/, removed by revoke). A loopback
 * stack's brokers allow self-declared labels only while it has none
 * (cli_listen_args): an enrolled bundle's holder could else leave the
 * signature out and declare another group's labels (issue 21).
 */
bool cli_stack_enrolled(const char *home);

/*
 * After an enrolment: a running broker of the stack in home that allows
 * unsigned labels (started before the stack had enrolled agents) is
 * restarted as `kscore up` starts it, with signed labels only; the
 * status `up` prints goes to stderr. 0, or `up`'s exit code.
 */
int cli_stack_signed_labels_apply(const char *home);

/* ---- the stack's operator policy (cmd_policy.c) -------------------------
 * `up --policy FILE` copies FILE into $KSCORE_HOME/policy.json and notes it
 * in $KSCORE_HOME/policy; every later `up` starts the brokers with it. */
struct cli_policy {
    bool configured;  /* the stack has a policy ($KSCORE_HOME/policy) */
    char file[4200];  /* the copy the brokers load */
    char source[4200]; /* what --policy named (absolute) */
    char sha256[65];  /* of the copy, as saved */
    char now[65];     /* of the copy as it is now ("" unreadable) */
    char *error;      /* malloc'd: why the brokers cannot load it; NULL */
};
/* src checked as `up --policy` takes it: owner and mode
 * (cli_path_trusted), read once, parsed by the broker's rules. On 0 its
 * bytes are *buf_out (malloc'd) and *len_out; else CLI_EXIT_USAGE after
 * printing what is wrong. */
int cli_policy_check(const char *src, char **buf_out, size_t *len_out);
/* Saves buf (checked) as the stack's policy; *changed: it was not the
 * saved one already. 0 or CLI_EXIT_KSCORE after printing why. */
int cli_policy_save(const char *home, const char *src, const char *buf,
                    size_t len, bool *changed);
/* `up --no-policy`. 0 or CLI_EXIT_KSCORE after printing why. */
int cli_policy_clear(const char *home);
/* The stack's policy setting and whether its copy loads (out->error);
 * cli_policy_release frees it. */
void cli_policy_get(const char *home, struct cli_policy *out);
void cli_policy_release(struct cli_policy *p);
/* What the broker running as pid wrote it loaded in state_dir
 * (BROKER_POLICY_NOTE): 1 with hex (digest or "none"), 0 when it noted
 * nothing (an older broker, another process's note). */
int cli_policy_loaded(const char *state_dir, pid_t pid, char hex[65]);

/* One of up's flags 'L' (--listen), 'N' (--tls-name), 'M' (--mtls): 0,
 * or CLI_EXIT_USAGE after printing why. */
int cli_listen_opt(struct cli_listen *l, int opt, const char *arg);
/* Fills what no flag gave from the env file of the last `up`. */
void cli_listen_resolve(struct cli_listen *l);
/* Whether the flags in given ask for other listen settings than the
 * stack's (those of the last `up`): true, with both as text in now and
 * asked. false when no --listen, --tls-name or --mtls was given. */
bool cli_listen_differs(const struct cli_listen *given, char *now,
                        size_t now_len, char *asked, size_t asked_len);
/* The CA, the server certificate and (mtls) the client certificates of
 * the broker, agent_user and operator; the tls block. 0 or
 * CLI_EXIT_KSCORE after printing why. */
int cli_listen_tls(const char *home, struct cli_listen *l,
                   const char *agent_user, const char *operator_name);
/* Puts --tls-ca/--tls-cert/--tls-key (the broker's, agent 0, or the
 * local agent's, agent 1) at argv's first NULL (6 free slots needed;
 * the broker's 7: it also gets --require-signed-labels); on loopback
 * (no TLS) the broker gets --allow-unsigned-labels only. */
void cli_listen_args(char **argv, const struct cli_listen *l, int agent);
/* Appends the listen settings and the operator's TLS files to the env
 * file. 0 or -errno. */
int cli_listen_env(const char *home, const struct cli_listen *l);

/* Re-renders $KSCORE_HOME's nats-auth.conf from the identity registry and
 * makes a running nats-server reload it (cli/cmd_operator.c; used by
 * operator add/remove and agent enroll/revoke). Prints what went wrong;
 * 0 or CLI_EXIT_KSCORE. A stopped server is fine: it starts with them. */
int cli_nats_users_apply(const char *home);

/* write(2) all n bytes to fd, through EINTR (cli/out_stream.c). 0 or -1
 * with errno. */
int cli_write_all(int fd, const uint8_t *p, size_t n);
/* errno of the first cli_write_all that failed in this process, or 0. */
int cli_write_error(void);

/* kscore agent enroll|revoke|list (cli/cmd_enroll.c); argv[0] is the verb. */
int cmd_agent_admin(int argc, char **argv);

/*
 * An agent bundle (`kscore agent enroll` writes it; format in
 * cli/cmd_enroll.c and docs/security.md "The bundle"), read back by
 * `kscore agent --bundle FILE`: its files are written into a private
 * directory (<state_dir>/bundle, or a new one under $TMPDIR removed by
 * cli_bundle_release) where nats.c and the agent read them.
 */
struct cli_bundle {
    char id[EVT_AGENT_ID_MAX + 1];   /* "" in a pool's bundle */
    /* A pool's bundle (`kscore agent enroll P --pool-size N`): its ids are
     * pool-0 .. pool-<pool_size-1>; "" and 0 otherwise. */
    char pool[EVT_AGENT_ID_MAX + 1];
    unsigned pool_size;
    char *urls;       /* comma-separated, as evt_connect takes them */
    char **labels;    /* "KEY=VALUE" */
    size_t n_labels;
    char dir[4200];
    bool made_dir;
    char nkey_file[4300], trust_key[4300];
    char tls_ca[4300], tls_cert[4300], tls_key[4300]; /* "" when absent */
    /* The broker's attestation of id and labels ([agent] enrolled_at_us,
     * labels_signature, labels_key_id); has_attest false: none (a bundle
     * from before attestations). */
    bool has_attest;
    int64_t enrolled_at_us;
    uint8_t labels_sig[EVT_SIGNATURE_BYTES];
    char labels_key_id[EVT_KEY_ID_CHARS + 1];
};
/* 0, or a negative code with why (one line) filled. */
int cli_bundle_load(const char *path, const char *state_dir,
                    struct cli_bundle *b, char *why, size_t why_len);
void cli_bundle_release(struct cli_bundle *b);

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
    bool quiet;      /* --quiet: no notes on stderr about the wait */
    char command_id[37];
    uint64_t off[2]; /* bytes of each stream written */
    bool cancel_sent;
};
/* The hooks say on stderr, at once, what a wait is for (an offline
 * agent, no broker answering), as ssh and kubectl print their notes,
 * unless quiet. */
void cli_live_init(struct cli_live *lv, struct evt_conn *c, bool print,
                   bool quiet);
/* From now on Ctrl-C is the hooks' to act on (cancel, then detach). */
void cli_live_catch_sigint(void);
void cli_live_hooks(struct cli_live *lv, struct broker_exec_hooks *h);
/* Whether Ctrl-C was pressed. */
bool cli_live_interrupted(const struct cli_live *lv);
/* How many times Ctrl-C was pressed since cli_live_catch_sigint (batch
 * acts on it as exec does: cancel, then detach). */
int cli_sigints(void);
/* At the end: prints what was not printed live (print), or fills r's
 * outputs that travelled in pieces (--json). 0 or an error (said). */
int cli_live_finish(struct cli_live *lv, const char *command_id,
                    Ks__CommandResult *r);
/* batch --stream: prints a progress message's pieces as "agent: line";
 * _end prints what is left of unfinished lines. */
void cli_stream_batch_piece(const Ks__BatchProgress *p);
void cli_stream_batch_end(void);

#endif
