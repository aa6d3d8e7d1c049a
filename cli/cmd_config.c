/*
 * The services' configuration files (/etc/kscore/broker.conf,
 * /etc/kscore/agent.conf): INI read with inih, one `key = value` per
 * line. Precedence is flags > environment (KSCORE_*) > file: the commands
 * take their flags first, then fill what is still unset from here.
 *
 * Every key is checked when the file is read, so a typo or a bad value
 * stops the service at once with FILE:LINE and the key (exit 2), instead
 * of being ignored. deploy/man/kscore.conf.5.scd documents each key; the
 * table below is the one list of them.
 */
#include <errno.h>
#include <fcntl.h>
#include <ini.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_int.h"

enum conf_type { CT_STR, CT_UINT, CT_DUR, CT_LOGFMT, CT_LOGLVL, CT_LABEL,
                 CT_ID, CT_BOOL };

struct conf_key {
    const char *name;
    const char *env; /* NULL: no environment variable */
    unsigned services;
    enum conf_type type;
    bool list;          /* may be given more than once */
    unsigned long min, max; /* CT_UINT; CT_DUR: min ms */
};

#define B CLI_CONF_BROKER
#define A CLI_CONF_AGENT
static const struct conf_key conf_keys[] = {
    {"nats_url", "KSCORE_NATS_URL", B | A, CT_STR, false, 0, 0},
    {"nkey", "KSCORE_NATS_NKEY", B | A, CT_STR, false, 0, 0},
    {"user", "KSCORE_NATS_USER", B | A, CT_STR, false, 0, 0},
    {"password", "KSCORE_NATS_PASSWORD", B | A, CT_STR, false, 0, 0},
    {"creds", "KSCORE_NATS_CREDS", B | A, CT_STR, false, 0, 0},
    {"token", "KSCORE_NATS_TOKEN", B | A, CT_STR, false, 0, 0},
    {"tls_ca", "KSCORE_NATS_TLS_CA", B | A, CT_STR, false, 0, 0},
    {"tls_cert", "KSCORE_NATS_TLS_CERT", B | A, CT_STR, false, 0, 0},
    {"tls_key", "KSCORE_NATS_TLS_KEY", B | A, CT_STR, false, 0, 0},
    {"state_dir", "KSCORE_STATE_DIR", B | A, CT_STR, false, 0, 0},
    {"log_format", "KSCORE_LOG_FORMAT", B | A, CT_LOGFMT, false, 0, 0},
    {"log_level", "KSCORE_LOG_LEVEL", B | A, CT_LOGLVL, false, 0, 0},
    {"db", "KSCORE_DB", B, CT_STR, false, 0, 0},
    {"signing_key", "KSCORE_SIGNING_KEY", B, CT_STR, false, 0, 0},
    {"policy", "KSCORE_POLICY", B, CT_STR, false, 0, 0},
    {"local_agents", "KSCORE_LOCAL_AGENTS", B, CT_UINT, false, 0, 10000},
    {"require_signed_labels", "KSCORE_REQUIRE_SIGNED_LABELS", B, CT_BOOL,
     false, 0, 0},
    {"replicas", "KSCORE_REPLICAS", B, CT_UINT, false, 1, 5},
    {"copy_operator_mib", "KSCORE_COPY_OPERATOR_MIB", B, CT_UINT, false, 1,
     1UL << 20},
    {"copy_total_mib", "KSCORE_COPY_TOTAL_MIB", B, CT_UINT, false, 1,
     1UL << 24},
    {"cmds_operator_mib", "KSCORE_CMDS_OPERATOR_MIB", B, CT_UINT, false, 1,
     1UL << 20},
    {"copy_keep", "KSCORE_COPY_KEEP", B, CT_DUR, false, 1000, 0},
    {"copy_upload_keep", "KSCORE_COPY_UPLOAD_KEEP", B, CT_DUR, false, 1000,
     0},
    {"metrics_listen", "KSCORE_METRICS_LISTEN", B | A, CT_STR, false, 0, 0},
    {"metrics_token_file", "KSCORE_METRICS_TOKEN_FILE", B | A, CT_STR, false,
     0, 0},
    {"bundle", "KSCORE_BUNDLE", A, CT_STR, false, 0, 0},
    {"id", NULL, A, CT_ID, true, 0, 0},
    {"label", "KSCORE_LABELS", A, CT_LABEL, true, 0, 0},
    {"trust_key", "KSCORE_TRUST_KEY", A, CT_STR, true, 0, 0},
    {"pool", "KSCORE_POOL", A, CT_STR, false, 0, 0},
    {"pool_size", "KSCORE_POOL_SIZE", A, CT_UINT, false, 1, 100000},
    {"max_concurrent", "KSCORE_MAX_CONCURRENT", A, CT_UINT, false, 1, 100000},
    {"ack_wait", "KSCORE_ACK_WAIT", A, CT_DUR, false, 1000, 0},
    {"drain_timeout", "KSCORE_DRAIN_TIMEOUT", B | A, CT_DUR, false, 0, 0},
};
#undef B
#undef A

bool
cli_conf_true(const char *v)
{
    return strcmp(v, "true") == 0 || strcmp(v, "yes") == 0 ||
           strcmp(v, "1") == 0;
}

static const struct conf_key *
key_of(const char *name, unsigned service)
{
    for (size_t i = 0; i < sizeof(conf_keys) / sizeof(conf_keys[0]); i++)
        if (strcmp(conf_keys[i].name, name) == 0 &&
            (conf_keys[i].services & service))
            return &conf_keys[i];
    return NULL;
}

/* NULL if v is a good value of k, else why not (static text). */
static const char *
value_problem(const struct conf_key *k, const char *v)
{
    char *end;
    uint64_t ms;
    enum ks_log_format f;
    enum ks_log_level l;

    switch (k->type) {
    case CT_STR:
        return v[0] ? NULL : "empty";
    case CT_ID:
        return evt_agent_id_valid(v) ? NULL
                                     : "not an agent id (1-128 of letters, "
                                       "digits, '_', '-')";
    case CT_UINT: {
        errno = 0;
        unsigned long n = strtoul(v, &end, 10);
        if (!v[0] || *end || v[0] == '-' || errno || n < k->min ||
            n > k->max) {
            static char msg[64];
            snprintf(msg, sizeof(msg), "not a number in %lu..%lu", k->min,
                     k->max);
            return msg;
        }
        return NULL;
    }
    case CT_DUR:
        if (cli_parse_duration(v, &ms) || ms < k->min)
            return "not a duration of at least 1s (500ms, 10s, 2m, 1h)";
        return NULL;
    case CT_LOGFMT:
        return ks_log_format_parse(v, &f) ? "not text or json" : NULL;
    case CT_LOGLVL:
        return ks_log_level_parse(v, &l) ? "not debug, info, warn or error"
                                         : NULL;
    case CT_BOOL:
        return cli_conf_true(v) || strcmp(v, "false") == 0 ||
                       strcmp(v, "no") == 0 || strcmp(v, "0") == 0
                   ? NULL
                   : "not true or false";
    case CT_LABEL: {
        const char *eq = strchr(v, '=');
        return eq && eq != v ? NULL : "not KEY=VALUE";
    }
    }
    return "unknown";
}

/* ---- reading the file --------------------------------------------------- */

struct conf_read {
    struct cli_conf *c;
    FILE *f;
    int line, next_line;
    int too_long_line;
    char err[512];
    int err_line;
};

/* fgets for inih that knows the line number; a line longer than inih's
 * buffer is an error rather than two half lines. */
static char *
conf_reader(char *str, int num, void *stream)
{
    struct conf_read *r = stream;
    char *s = fgets(str, num, r->f);
    if (!s)
        return NULL;
    r->line = r->next_line;
    if (strchr(s, '\n')) {
        r->next_line++;
    } else if (!feof(r->f)) {
        int ch;
        while ((ch = fgetc(r->f)) != EOF && ch != '\n')
            ;
        r->next_line++;
        if (!r->too_long_line)
            r->too_long_line = r->line;
    }
    return s;
}

static int
conf_add(struct cli_conf *c, const char *key, const char *value, int line)
{
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 16;
        struct cli_conf_entry *nv = realloc(c->v, cap * sizeof(*nv));
        if (!nv)
            return -ENOMEM;
        c->v = nv;
        c->cap = cap;
    }
    struct cli_conf_entry *e = &c->v[c->n];
    e->key = strdup(key);
    e->value = strdup(value);
    e->line = line;
    if (!e->key || !e->value) {
        free(e->key);
        free(e->value);
        return -ENOMEM;
    }
    c->n++;
    return 0;
}

static int
conf_handler(void *user, const char *section, const char *name,
             const char *value)
{
    struct conf_read *r = user;
    struct cli_conf *c = r->c;
    const struct conf_key *k;
    const char *why;

    if (r->err[0])
        return 1; /* the first error is the one reported */
    if (section[0] && strcmp(section, c->service_name) != 0) {
        snprintf(r->err, sizeof(r->err),
                 "unknown section [%s] (keys go at the top, or under [%s])",
                 section, c->service_name);
        goto bad;
    }
    if (!(k = key_of(name, c->service))) {
        snprintf(r->err, sizeof(r->err), "unknown key '%s' for the %s", name,
                 c->service_name);
        goto bad;
    }
    if (!k->list)
        for (size_t i = 0; i < c->n; i++)
            if (strcmp(c->v[i].key, name) == 0) {
                snprintf(r->err, sizeof(r->err),
                         "%s: set twice (also at line %d)", name,
                         c->v[i].line);
                goto bad;
            }
    if ((why = value_problem(k, value))) {
        snprintf(r->err, sizeof(r->err), "%s: bad value '%.200s': %s", name,
                 value, why);
        goto bad;
    }
    if (conf_add(c, name, value, r->line) != 0) {
        snprintf(r->err, sizeof(r->err), "out of memory");
        goto bad;
    }
    return 1;
bad:
    r->err_line = r->line;
    return 0;
}

int
cli_file_trusted(int fd, const char *path, char *why, size_t why_len)
{
    struct stat st;

    if (fstat(fd, &st) == -1) {
        snprintf(why, why_len, "%s: %s", path, strerror(errno));
        return -errno;
    }
    if (S_ISCHR(st.st_mode))
        return 0;
    if (st.st_uid != 0 && st.st_uid != geteuid()) {
        snprintf(why, why_len,
                 "%s is owned by uid %u, not by root or by us (uid %u): "
                 "refused, since whoever may change it decides what runs "
                 "here",
                 path, (unsigned)st.st_uid, (unsigned)geteuid());
        return KS_EINVAL;
    }
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, why_len,
                 "%s is writable by %s (mode %03o): refused, since whoever "
                 "may change it decides what runs here; chmod go-w it",
                 path, st.st_mode & S_IWOTH ? "everyone" : "its group",
                 (unsigned)(st.st_mode & 0777));
        return KS_EINVAL;
    }
    return 0;
}

int
cli_path_trusted(const char *path)
{
    char why[PATH_MAX + 256];
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd == -1)
        return 0; /* its reader says what is wrong with it */
    int rc = cli_file_trusted(fd, path, why, sizeof(why));
    close(fd);
    if (rc) {
        cli_err("%s", why);
        return CLI_EXIT_USAGE;
    }
    return 0;
}

int
cli_conf_load(struct cli_conf *c, unsigned service, const char *path)
{
    const char *def = service == CLI_CONF_BROKER ? CLI_CONF_DIR "/broker.conf"
                                                 : CLI_CONF_DIR "/agent.conf";
    struct conf_read r = {.c = c, .line = 0, .next_line = 1};
    int rc;

    memset(c, 0, sizeof(*c));
    c->service = service;
    c->service_name = service == CLI_CONF_BROKER ? "broker" : "agent";
    if (!path) {
        /* The default file is optional: used only when it is there. */
        if (access(def, F_OK) != 0)
            return 0;
        path = def;
    }
    c->path = strdup(path);
    if (!c->path)
        return CLI_EXIT_KSCORE;
    r.f = fopen(path, "re");
    if (!r.f) {
        cli_err("%s: %s", path, strerror(errno));
        return CLI_EXIT_USAGE;
    }
    {
        char why[PATH_MAX + 256];
        if (cli_file_trusted(fileno(r.f), path, why, sizeof(why)) != 0) {
            fclose(r.f);
            cli_err("%s", why);
            return CLI_EXIT_USAGE;
        }
    }
    rc = ini_parse_stream(conf_reader, &r, conf_handler, &r);
    fclose(r.f);
    if (r.too_long_line && (!r.err_line || r.too_long_line < r.err_line)) {
        cli_err("%s:%d: line too long (at most %d bytes)", path,
                r.too_long_line, INI_MAX_LINE - 2);
        return CLI_EXIT_USAGE;
    }
    if (r.err[0]) {
        cli_err("%s:%d: %s", path, r.err_line, r.err);
        return CLI_EXIT_USAGE;
    }
    if (rc != 0) {
        /* inih's own: a line that is neither `key = value`, a [section]
         * nor a comment */
        cli_err("%s:%d: not `key = value`, a [section] or a comment", path,
                rc > 0 ? rc : 0);
        return CLI_EXIT_USAGE;
    }
    return 0;
}

void
cli_conf_release(struct cli_conf *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < c->n; i++) {
        free(c->v[i].key);
        free(c->v[i].value);
    }
    free(c->v);
    free(c->path);
    for (size_t i = 0; i < c->n_shown; i++)
        free(c->shown[i].from);
    memset(c, 0, sizeof(*c));
}

/* The environment's value of k, checked: NULL when unset; *bad set (after
 * printing) when it is not a good value. */
static const char *
env_value(const struct conf_key *k, bool *bad)
{
    const char *v = k->env ? getenv(k->env) : NULL;
    const char *why;
    if (!v || !v[0])
        return NULL;
    if (k->type != CT_LABEL && (why = value_problem(k, v))) {
        cli_err("%s: bad value '%.200s': %s", k->env, v, why);
        *bad = true;
        return NULL;
    }
    return v;
}

void
cli_conf_note(struct cli_conf *c, const char *key, const char *value,
              const char *from)
{
    if (c->n_shown == CLI_CONF_SHOWN_MAX)
        return;
    c->shown[c->n_shown].key = key;
    c->shown[c->n_shown].value = value;
    c->shown[c->n_shown].from = strdup(from);
    c->n_shown++;
}

char *
cli_conf_where(const struct cli_conf *c, const char *key, size_t nth)
{
    char *s = NULL;
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->v[i].key, key) == 0 && nth-- == 0) {
            if (asprintf(&s, "%s:%d", c->path, c->v[i].line) < 0)
                s = NULL;
            break;
        }
    return s;
}

void
cli_conf_show(const struct cli_conf *c, FILE *out)
{
    fprintf(out, "# kscore %s: flags > environment > %s\n", c->service_name,
            c->path ? c->path : "(no config file)");
    for (size_t i = 0; i < c->n_shown; i++) {
        const char *k = c->shown[i].key, *v = c->shown[i].value;
        if (strcmp(k, "password") == 0 || strcmp(k, "token") == 0)
            v = "<secret>";
        fprintf(out, "%s = %s  # %s\n", k, v, c->shown[i].from);
    }
}

int
cli_conf_str(struct cli_conf *c, const char *key, const char **field)
{
    const struct conf_key *k = key_of(key, c->service);
    bool bad = false;
    const char *v;

    BUG_ON(!k);
    if (*field) {
        cli_conf_note(c, key, *field, "flag"); /* a flag said so */
        return 0;
    }
    if ((v = env_value(k, &bad))) {
        *field = v;
        cli_conf_note(c, key, v, k->env);
        return 0;
    }
    if (bad)
        return CLI_EXIT_USAGE;
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->v[i].key, key) == 0) {
            char from[4200];
            *field = c->v[i].value;
            snprintf(from, sizeof(from), "%s:%d", c->path, c->v[i].line);
            cli_conf_note(c, key, *field, from);
            return 0;
        }
    return 0;
}

size_t
cli_conf_list(const struct cli_conf *c, const char *key, const char **out,
              size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < c->n && n < cap; i++)
        if (strcmp(c->v[i].key, key) == 0)
            out[n++] = c->v[i].value;
    return n;
}

void
cli_conf_conn(struct cli_conf *c, struct cli_conn *cc)
{
    /* Flags first (already in cc), then the environment, then the file. */
    cli_conf_str(c, "nats_url", &cc->nats_url);
    cli_conf_str(c, "nkey", &cc->opts.nkey_file);
    cli_conf_str(c, "user", &cc->opts.user);
    cli_conf_str(c, "password", &cc->opts.password);
    cli_conf_str(c, "creds", &cc->opts.creds_file);
    cli_conf_str(c, "token", &cc->opts.token);
    cli_conf_str(c, "tls_ca", &cc->opts.tls_ca);
    cli_conf_str(c, "tls_cert", &cc->opts.tls_cert);
    cli_conf_str(c, "tls_key", &cc->opts.tls_key);
}

int
cli_conf_log(struct cli_conf *c, const char *format_flag,
             const char *level_flag, const char *service)
{
    const char *fv = format_flag, *lv = level_flag;
    enum ks_log_format f = KS_LOG_TEXT;
    enum ks_log_level l = KS_LOG_INFO;
    int rc;

    if ((rc = cli_conf_str(c, "log_format", &fv)) ||
        (rc = cli_conf_str(c, "log_level", &lv)))
        return rc;
    if (fv && ks_log_format_parse(fv, &f)) {
        cli_err("bad --log-format '%s' (text or json)", fv);
        return CLI_EXIT_USAGE;
    }
    if (lv && ks_log_level_parse(lv, &l)) {
        cli_err("bad --log-level '%s' (debug, info, warn or error)", lv);
        return CLI_EXIT_USAGE;
    }
    ks_log_setup(f, l, service);
    /* A service's errors from here on are lines of its log. */
    cli_err_as_log();
    return 0;
}
