/*
 * What every kscore command shares (both halves: kscore and
 * kscore-daemon): errors on stderr, $KSCORE_HOME and its env file, the
 * NATS connection flags, the command options of exec and batch,
 * durations and times, exit codes. Calls only down, into the libraries:
 * no command is called from here.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent.h" /* EXEC_OUTPUT_CAP_MAX: --max-output's bound */
#include "cli_int.h"

static bool err_as_log;

/* ---- the status line --------------------------------------------------- */

/* A line redrawn in place at the bottom of the terminal on stderr (batch
 * progress). Other output to that terminal erases it first and draws it
 * again after, so that nothing is glued to it. */
static pthread_mutex_t status_mu = PTHREAD_MUTEX_INITIALIZER;
static char status_text[512];
static bool status_shown;
static int stdout_tty = -1; /* isatty(1), asked once */

/* Draws the kept text (on) or erases the line, under status_mu. */
static void
status_draw_locked(bool on)
{
    fflush(stdout); /* what was written before stays before */
    fprintf(stderr, "\r\033[K%s", on ? status_text : "");
    fflush(stderr);
    status_shown = on;
}

void
cli_status_show(const char *text)
{
    pthread_mutex_lock(&status_mu);
    snprintf(status_text, sizeof(status_text), "%s", text);
    status_draw_locked(true);
    pthread_mutex_unlock(&status_mu);
}

void
cli_status_end(void)
{
    pthread_mutex_lock(&status_mu);
    if (status_shown)
        status_draw_locked(false);
    status_text[0] = '\0';
    pthread_mutex_unlock(&status_mu);
}

void
cli_status_hide(int fd)
{
    pthread_mutex_lock(&status_mu);
    if (fd == 1 && stdout_tty < 0)
        stdout_tty = isatty(1);
    if (status_shown && (fd == 2 || (fd == 1 && stdout_tty)))
        status_draw_locked(false);
    fflush(fd == 1 ? stdout : stderr);
    pthread_mutex_unlock(&status_mu);
}

void
cli_status_redraw(void)
{
    pthread_mutex_lock(&status_mu);
    if (!status_shown && status_text[0])
        status_draw_locked(true);
    pthread_mutex_unlock(&status_mu);
}

void
cli_err_as_log(void)
{
    err_as_log = true;
}

void
cli_err(const char *fmt, ...)
{
    char buf[2048], *w = buf;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    /* One line, always: libpq and nats.c messages carry newlines/tabs. */
    for (const char *r = buf; *r; r++) {
        if (*r == '\n' || *r == '\t' || *r == '\r') {
            if (w > buf && w[-1] != ' ')
                *w++ = ' ';
            continue;
        }
        *w++ = *r;
    }
    while (w > buf && w[-1] == ' ')
        w--;
    *w = '\0';
    if (err_as_log) {
        ks_log(KS_LOG_ERROR, buf);
        return;
    }
    cli_status_hide(2);
    fprintf(stderr, "kscore: %s\n", buf);
    cli_status_redraw();
}

const char *
cli_home(void)
{
    static char buf[4096];
    const char *h = getenv("KSCORE_HOME");
    if (h && h[0])
        return h;
    h = getenv("HOME");
    snprintf(buf, sizeof(buf), "%s/.local/state/kscore", h ? h : "/tmp");
    return buf;
}

char *
cli_env_get(const char *key)
{
    char path[4200], line[4096];
    size_t klen = strlen(key);
    char *val = NULL;
    FILE *f;

    snprintf(path, sizeof(path), "%s/env", cli_home());
    f = fopen(path, "re");
    if (!f)
        return NULL;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            char *v = line + klen + 1;
            v[strcspn(v, "\n")] = '\0';
            /* values are written single-quoted */
            if (v[0] == '\'' && strlen(v) >= 2 && v[strlen(v) - 1] == '\'') {
                v[strlen(v) - 1] = '\0';
                v++;
            }
            val = strdup(v);
            break;
        }
    }
    fclose(f);
    return val;
}

int
cli_conn_opt(struct cli_conn *cc, int opt, const char *arg)
{
    switch (opt) {
    case CLI_OPT_NATS:
        cc->nats_url = arg;
        return 1;
    case CLI_OPT_NATS + 1:
        cc->opts.user = arg;
        return 1;
    case CLI_OPT_NATS + 2:
        cc->opts.password = arg;
        return 1;
    case CLI_OPT_NATS + 3:
        cc->opts.creds_file = arg;
        return 1;
    case CLI_OPT_NATS + 4:
        cc->opts.token = arg;
        return 1;
    case CLI_OPT_NATS + 5:
        cc->opts.tls_ca = arg;
        return 1;
    case CLI_OPT_NATS + 6:
        cc->opts.tls_cert = arg;
        return 1;
    case CLI_OPT_NATS + 7:
        cc->opts.tls_key = arg;
        return 1;
    case CLI_OPT_NATS + 8:
        cc->opts.nkey_file = arg;
        return 1;
    }
    return 0;
}

static void
env_default(const char **field, const char *name)
{
    const char *v = getenv(name);
    if (!*field && v && v[0])
        *field = v;
}

void
cli_conn_env(struct cli_conn *cc)
{
    env_default(&cc->nats_url, "KSCORE_NATS_URL");
    env_default(&cc->opts.user, "KSCORE_NATS_USER");
    env_default(&cc->opts.password, "KSCORE_NATS_PASSWORD");
    env_default(&cc->opts.creds_file, "KSCORE_NATS_CREDS");
    env_default(&cc->opts.token, "KSCORE_NATS_TOKEN");
    env_default(&cc->opts.tls_ca, "KSCORE_NATS_TLS_CA");
    env_default(&cc->opts.tls_cert, "KSCORE_NATS_TLS_CERT");
    env_default(&cc->opts.tls_key, "KSCORE_NATS_TLS_KEY");
    env_default(&cc->opts.nkey_file, "KSCORE_NATS_NKEY");
}

void
cli_conn_release(struct cli_conn *cc)
{
    for (size_t i = 0; i < sizeof(cc->owned) / sizeof(cc->owned[0]); i++) {
        free(cc->owned[i]);
        cc->owned[i] = NULL;
    }
}

int
cli_connect(struct cli_conn *cc, struct evt_conn **out)
{
    char *errmsg = NULL;
    const char *url;
    int rc;

    cli_conn_env(cc);
    url = cc->nats_url;
    {
        /* The local stack: its url, and this login's seed file, from
         * $KSCORE_HOME/env. Its credential goes only to its own url, and
         * only when no other credential was given. */
        char *env_url = cli_env_get("KSCORE_NATS_URL");
        bool local = !url || !url[0] || (env_url && strcmp(env_url, url) == 0);
        bool given = cc->opts.nkey_file || cc->opts.user ||
                     cc->opts.creds_file || cc->opts.token;
        if (!url || !url[0])
            url = env_url;
        cc->owned[0] = env_url;
        if (local && !given &&
            (cc->owned[1] = cli_env_get("KSCORE_NATS_NKEY")))
            cc->opts.nkey_file = cc->owned[1];
        /* `kscore up --listen`: the stack's CA (and, with --mtls, this
         * login's client certificate), unless TLS files were given. */
        if (local && !cc->opts.tls_ca &&
            (cc->owned[2] = cli_env_get("KSCORE_NATS_TLS_CA")))
            cc->opts.tls_ca = cc->owned[2];
        if (local && !cc->opts.tls_cert &&
            (cc->owned[3] = cli_env_get("KSCORE_NATS_TLS_CERT")) &&
            (cc->owned[4] = cli_env_get("KSCORE_NATS_TLS_KEY"))) {
            cc->opts.tls_cert = cc->owned[3];
            cc->opts.tls_key = cc->owned[4];
        }
    }
    if (!url || !url[0]) {
        cli_err("no NATS url: give --nats URL, set KSCORE_NATS_URL, or start "
                "the local stack with `kscore up` (looked in %s/env)",
                cli_home());
        return CLI_EXIT_KSCORE;
    }
    cc->opts.send_asap = true;
    cc->opts.name = "kscore-cli";
    rc = evt_connect(url, &cc->opts, out, &errmsg);
    if (rc) {
        cli_err("%s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return CLI_EXIT_KSCORE;
    }
    return 0;
}

int
cli_spec_init(struct cli_spec *cs, size_t cap)
{
    memset(cs, 0, sizeof(*cs));
    ks__command_spec__init(&cs->spec);
    cs->envs = calloc(cap + 1, sizeof(*cs->envs));
    cs->envp = calloc(cap + 1, sizeof(*cs->envp));
    cs->cap = cap;
    cs->spec.env = cs->envp;
    return cs->envs && cs->envp ? 0 : -ENOMEM;
}

void
cli_spec_release(struct cli_spec *cs)
{
    free(cs->envs);
    free(cs->envp);
    cs->envs = NULL;
    cs->envp = NULL;
}

int
cli_spec_argv(struct cli_spec *cs, int argc, char **argv, int optind,
              const char *name)
{
    if (optind >= argc || strcmp(argv[optind - 1], "--") != 0) {
        if (optind < argc)
            cli_err("missing -- before the command: kscore %s [OPTIONS] -- "
                    "%s ...",
                    name, argv[optind]);
        else
            cli_err("no command given: kscore %s [OPTIONS] -- CMD [ARG]...",
                    name);
        return -1;
    }
    if (!argv[optind][0]) {
        cli_err("empty command name");
        return -1;
    }
    cs->spec.argv = argv + optind;
    cs->spec.n_argv = (size_t)(argc - optind);
    return 0;
}

static int
duration_opt(const char *name, const char *arg, uint64_t *ms)
{
    if (cli_parse_duration(arg, ms) == 0)
        return 1;
    cli_err("bad duration '%s' for --%s (use 500ms, 10s, 2m, 1h)", arg, name);
    return -1;
}

int
cli_spec_opt(struct cli_spec *cs, int opt, char *arg)
{
    switch (opt) {
    case CLI_OPT_SPEC:
        return duration_opt("timeout", arg, &cs->spec.timeout_ms);
    case CLI_OPT_SPEC + 1:
        return duration_opt("grace", arg, &cs->spec.grace_ms);
    case CLI_OPT_SPEC + 2: {
        char *eq = strchr(arg, '=');
        if (!eq || eq == arg || cs->spec.n_env >= cs->cap) {
            cli_err("bad --env '%s': expected NAME=VALUE", arg);
            return -1;
        }
        *eq = '\0';
        if (!broker_env_name_ok(arg)) {
            /* Said here, before anything is sent: a usage error (2). */
            cli_err("bad --env name '%s': letters, digits and _, not "
                    "starting with a digit, at most 256 bytes, not KSCORE_*",
                    arg);
            *eq = '=';
            return -1;
        }
        Ks__EnvVar *ev = &cs->envs[cs->spec.n_env];
        ks__env_var__init(ev);
        ev->name = arg;
        ev->value = eq + 1;
        cs->envp[cs->spec.n_env++] = ev;
        return 1;
    }
    case CLI_OPT_SPEC + 3:
        if (arg[0] != '/') {
            cli_err("bad --cwd '%s': an absolute path on the agent (the "
                    "default is /)",
                    arg);
            return -1;
        }
        cs->spec.cwd = arg;
        return 1;
    case CLI_OPT_SPEC + 4:
        return duration_opt("deliver-within", arg, &cs->deliver_within_ms);
    case CLI_OPT_SPEC + 5: {
        /* Bytes kept per stream: N, NK, NM, NG (powers of 1024). */
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(arg, &end, 10);
        unsigned long long mul = 1;
        if (end && (*end == 'k' || *end == 'K'))
            mul = 1024, end++;
        else if (end && (*end == 'm' || *end == 'M'))
            mul = 1024 * 1024, end++;
        else if (end && (*end == 'g' || *end == 'G'))
            mul = 1024 * 1024 * 1024, end++;
        if (errno || end == arg || *end || arg[0] == '-' || v == 0 ||
            v > EXEC_OUTPUT_CAP_MAX / mul) {
            cli_err("bad --max-output '%s': bytes per stream, 1 to 1G "
                    "(K, M, G suffixes)",
                    arg);
            return -1;
        }
        cs->spec.stdout_cap_bytes = cs->spec.stderr_cap_bytes =
            (uint32_t)(v * mul);
        return 1;
    }
    }
    return 0;
}

int
cli_parse_duration(const char *s, uint64_t *ms_out)
{
    char *end = NULL;
    double v;

    if (!s || !s[0])
        return -1;
    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || v < 0 || v != v)
        return -1;
    if (!*end || strcmp(end, "s") == 0)
        v *= 1000;
    else if (strcmp(end, "ms") == 0)
        ;
    else if (strcmp(end, "m") == 0)
        v *= 60 * 1000;
    else if (strcmp(end, "h") == 0)
        v *= 3600 * 1000;
    else
        return -1;
    if (v > 365.0 * 24 * 3600 * 1000)
        return -1;
    *ms_out = (uint64_t)(v + 0.5);
    return 0;
}

const char *
cli_time(int64_t us)
{
    static char buf[64];
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    char base[32];

    if (us <= 0)
        return "";
    gmtime_r(&t, &tm);
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf, sizeof(buf), "%s.%06ldZ", base, (long)(us % 1000000));
    return buf;
}

void
cli_ago(char *buf, size_t len, int64_t us)
{
    double s = us < 0 ? 0 : (double)us / 1e6;
    if (s < 60)
        snprintf(buf, len, "%.1fs ago", s);
    else if (s < 3600)
        snprintf(buf, len, "%.0fm ago", s / 60);
    else if (s < 86400)
        snprintf(buf, len, "%.0fh ago", s / 3600);
    else
        snprintf(buf, len, "%.0fd ago", s / 86400);
}

int
cli_outcome_unknown(const char *what, const char *error,
                    const char *command_id, const char *key)
{
    cli_err("%s", error);
    if (command_id && command_id[0])
        cli_err("the outcome is unknown (not \"not recorded\"): look %s %s "
                "up with `kscore get %s`",
                what, command_id, command_id);
    else if (key && key[0])
        cli_err("the outcome is unknown: the %s may be recorded (and run); "
                "asking again with --idempotency-key %s is safe",
                what, key);
    else
        cli_err("the outcome is unknown: the %s may be recorded (and run); "
                "look for it with `kscore list`",
                what);
    return CLI_EXIT_UNKNOWN;
}

int
cli_exit_status(const Ks__CommandResult *r)
{
    if (!r)
        return CLI_EXIT_KSCORE;
    if (r->status == KS__COMMAND_STATUS__START_FAILED)
        return r->start_errno == ENOENT && strcmp(r->start_stage, "exec") == 0
                   ? CLI_EXIT_NOT_FOUND
                   : CLI_EXIT_CANNOT_RUN;
    if (r->timed_out)
        return CLI_EXIT_TIMEDOUT;
    if (r->signal > 0)
        return 128 + r->signal;
    if (r->has_exit_code)
        return r->exit_code;
    return CLI_EXIT_KSCORE; /* Undeliverable, Lost, Cancelled, Rejected */
}

void
cli_err_too_large(void)
{
    cli_err("command too large: its argv, environment and options exceed "
            "the NATS max payload (%d bytes); nothing was sent (pass large "
            "data in a file on the agent instead)",
            KS_MAX_MESSAGE_BYTES);
}

int
cli_other_half(const char *name, const char *rel, char *buf, size_t len)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    char *slash;

    buf[0] = '\0';
    if (n <= 0)
        return -errno;
    self[n] = '\0';
    if (!(slash = strrchr(self, '/')))
        return -ENOENT;
    *slash = '\0';
    snprintf(buf, len, "%s/%s", self, name);
    if (access(buf, X_OK) == 0)
        return 0;
    snprintf(buf, len, "%s/%s/%s", self, rel, name);
    return access(buf, X_OK) == 0 ? 0 : -errno;
}

int
cli_main(int argc, char **argv, const struct cli_command *cmds, size_t n,
         const char *usage, int (*other)(char **argv, const char *name))
{
    size_t k = 0;
    int rc;

    /* `kscore help CMD`: that command's own help. */
    if (argc >= 3 && strcmp(argv[1], "help") == 0) {
        char *hargv[] = {argv[2], "--help", NULL};
        while (k < n && strcmp(argv[2], cmds[k].name) != 0)
            k++;
        if (k < n)
            return cmds[k].fn(2, hargv);
        if (other && (rc = other(argv, argv[2])) >= 0)
            return rc;
        cli_err("unknown command '%s' (see kscore --help)", argv[2]);
        return CLI_EXIT_USAGE;
    }
    /* -h is --help on every subcommand (their getopt tables are long
     * options only); the command after `--` keeps its own -h. */
    for (int i = 2; i < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "-h") == 0)
            argv[i] = "--help";
    if (argc < 2 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("kscore " CLI_VERSION "\n");
        return 0;
    }
    while (k < n && strcmp(argv[1], cmds[k].name) != 0)
        k++;
    if (k < n)
        return cmds[k].fn(argc - 1, argv + 1);
    if (other && (rc = other(argv, argv[1])) >= 0)
        return rc;
    cli_err("unknown command '%s' (see kscore --help)", argv[1]);
    return CLI_EXIT_USAGE;
}
