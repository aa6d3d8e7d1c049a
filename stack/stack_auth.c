/* NATS users and permissions for the local stack: deploy/nats-auth.conf.in
 * (compiled in by cli/CMakeLists.txt) rendered for the identities of the
 * registry (stack_ident.c), and the reload of a running nats-server. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kproto.h"
#include "nats_auth_conf.h"
#include "stack.h"

/* Appends s to the growing buffer; 0 or -ENOMEM. */
static int
put(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*len + n + 1) * 2;
        char *b = realloc(*buf, nc);
        if (!b)
            return -ENOMEM;
        *buf = b;
        *cap = nc;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

struct var {
    const char *name, *value;
};

/* Appends text[0..n) with every @NAME@ of vars replaced by its value. */
static int
fill(char **buf, size_t *len, size_t *cap, const char *text, size_t n,
     const struct var *vars, size_t nvars)
{
    const char *p = text, *end = text + n;
    int rc = 0;

    while (p < end && rc == 0) {
        const char *at = memchr(p, '@', (size_t)(end - p));
        size_t i;
        if (!at)
            return put(buf, len, cap, p, (size_t)(end - p));
        rc = put(buf, len, cap, p, (size_t)(at - p));
        for (i = 0; rc == 0 && i < nvars; i++) {
            size_t vn = strlen(vars[i].name);
            if ((size_t)(end - at) >= vn &&
                strncmp(at, vars[i].name, vn) == 0) {
                rc = put(buf, len, cap, vars[i].value, strlen(vars[i].value));
                p = at + vn;
                break;
            }
        }
        if (rc == 0 && i == nvars) {
            rc = put(buf, len, cap, "@", 1);
            p = at + 1;
        }
    }
    return rc;
}

/* The "#% <kind>" section of the template: its text up to the next "#%"
 * line. 0, or KS_ENOTFOUND. */
static int
section(const char *kind, const char **start, size_t *n)
{
    const char *t = stack__nats_auth_template, *p = t;
    size_t kn = strlen(kind);

    while ((p = strstr(p, "#% ")) != NULL) {
        if ((p == t || p[-1] == '\n') && strncmp(p + 3, kind, kn) == 0 &&
            p[3 + kn] == '\n') {
            const char *body = p + 3 + kn + 1, *next = body;
            while ((next = strstr(next, "#%")) && next[-1] != '\n')
                next++;
            *start = body;
            *n = next ? (size_t)(next - body) : strlen(body);
            return 0;
        }
        p += 3;
    }
    return KS_ENOTFOUND;
}

/* A pool's user: the section with its pool, last id, and the per-id
 * subjects of each of its ids (what an agent-<id> user has for one). */
static int
fill_pool(char **buf, size_t *len, size_t *cap, const char *body, size_t blen,
          const struct stack_identity *id)
{
    const char *pool = id->name + 5; /* "pool-<pool>" */
    char *pub = NULL, *sub = NULL, last[16], line[5 * EVT_AGENT_ID_MAX + 192];
    size_t plen = 0, pcap = 0, slen = 0, scap = 0;
    int rc = 0;

    if (id->pool_size == 0)
        return KS_EINVAL;
    snprintf(last, sizeof(last), "%u", id->pool_size - 1);
    for (unsigned i = 0; rc == 0 && i < id->pool_size; i++) {
        const char *sep = i + 1 < id->pool_size ? "," : "";
        int n = snprintf(line, sizeof(line),
                         "            \"kscore.api.v1.claim.agent-%s-%u\", "
                         "\"kscore.api.v1.claim.again.agent-%s-%u\", "
                         "\"kscore.api.v1.fetch.agent-%s-%u\", "
                         "\"kscore.evt.%s-%u.0\"%s\n",
                         pool, i, pool, i, pool, i, pool, i, sep);
        rc = put(&pub, &plen, &pcap, line, (size_t)n);
        n = snprintf(line, sizeof(line),
                     "            \"kscore.cancel.%s-%u\"%s\n", pool, i, sep);
        if (rc == 0)
            rc = put(&sub, &slen, &scap, line, (size_t)n);
    }
    /* The template's own line ends after each list. */
    if (rc == 0 && plen)
        pub[--plen] = '\0';
    if (rc == 0 && slen)
        sub[--slen] = '\0';
    if (rc == 0) {
        const struct var vars[] = {{"@NKEY@", id->nkey},
                                   {"@POOL@", pool},
                                   {"@LAST@", last},
                                   {"@IDS_PUB@", pub},
                                   {"@IDS_SUB@", sub}};
        rc = fill(buf, len, cap, body, blen, vars, 5);
    }
    free(pub);
    free(sub);
    return rc;
}

/* Drops the trailing newline of a user list: the frame's line brings its
 * own after each field. */
static void
chop(char *s, size_t *len)
{
    if (s && *len && s[*len - 1] == '\n')
        s[--*len] = '\0';
}

int
stack_nats_auth_conf(const struct stack_identity *ids, size_t n,
                     char **conf_out)
{
    static const char head[] = "# written by kscore from the identity registry "
                               "(deploy/nats-auth.conf.in); public keys only\n";
    const char *t = stack__nats_auth_template;
    const char *frame_end = strstr(t, "\n#%");
    /* [0]: account KSCORE (brokers, operators); [1]: AGENTS (agents,
     * pools); [2]: SYS (the system user). */
    char *users[3] = {NULL, NULL, NULL}, *out = NULL;
    size_t ulen[3] = {0, 0, 0}, ucap[3] = {0, 0, 0}, olen = 0, ocap = 0;
    unsigned n_agents = 0, largest_pool = 0;
    int rc = 0;

    /* nats-server with an empty user list would let anyone in. */
    if (n == 0 || !frame_end)
        return KS_EINVAL;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const struct stack_identity *id = &ids[i];
        const char *body;
        size_t blen;
        const char *agent_id =
            id->kind == STACK_AGENT && strncmp(id->name, "agent-", 6) == 0
                ? id->name + 6
                : id->name;
        const struct var vars[] = {{"@NKEY@", id->nkey},
                                   {"@NAME@", id->name},
                                   {"@AGENT_ID@", agent_id}};
        int a = id->kind == STACK_SYSTEM                             ? 2
                : id->kind == STACK_AGENT || id->kind == STACK_POOL ? 1
                                                                     : 0;
        if (!evt_identity_valid(id->name) || id->nkey[0] != 'U' ||
            strlen(id->nkey) != EVT_NKEY_PUBLIC_CHARS) {
            rc = KS_EINVAL;
            break;
        }
        if (id->kind == STACK_AGENT || id->kind == STACK_POOL)
            n_agents++;
        if (id->kind == STACK_POOL && id->pool_size > largest_pool)
            largest_pool = id->pool_size;
        rc = section(stack_kind_name(id->kind), &body, &blen);
        if (rc == 0 && id->kind == STACK_POOL)
            rc = fill_pool(&users[a], &ulen[a], &ucap[a], body, blen, id);
        else if (rc == 0)
            rc = fill(&users[a], &ulen[a], &ucap[a], body, blen, vars, 3);
    }
    if (rc == 0) {
        for (int k = 0; k < 3; k++)
            chop(users[k], &ulen[k]);
        char conns[16], subs[16];
        snprintf(conns, sizeof(conns), "%u",
                 STACK_AGENT_CONNECTIONS * n_agents +
                     STACK_AGENTS_SPARE_CONNECTIONS);
        snprintf(subs, sizeof(subs), "%u",
                 largest_pool + STACK_SUBSCRIPTIONS);
        const struct var frame[] = {
            {"@KSCORE_USERS@", users[0] ? users[0] : ""},
            {"@AGENT_USERS@", users[1] ? users[1] : ""},
            {"@SYSTEM_USERS@", users[2] ? users[2] : ""},
            {"@AGENT_CONNECTIONS@", conns},
            {"@AGENT_SUBSCRIPTIONS@", subs}};
        rc = put(&out, &olen, &ocap, head, sizeof(head) - 1);
        if (rc == 0)
            rc = fill(&out, &olen, &ocap, t, (size_t)(frame_end - t) + 1, frame,
                      5);
    }
    for (int k = 0; k < 3; k++)
        free(users[k]);
    if (rc) {
        free(out);
        return rc;
    }
    *conf_out = out;
    return 0;
}

int
stack_nats_auth_write(const char *nats_dir, const char *home)
{
    struct stack_identity *ids = NULL;
    char path[4200], tmp[4300], *conf = NULL;
    size_t n = 0, len;
    int fd = -1, rc;

    if ((rc = stack_ident_list(home, &ids, &n)) ||
        (rc = stack_nats_auth_conf(ids, n, &conf)))
        goto out;
    snprintf(path, sizeof(path), "%s/" STACK_NATS_AUTH_FILE, nats_dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    len = strlen(conf);
    /* Public keys only, but who may connect is nobody else's business. */
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd == -1 || fchmod(fd, 0600) == -1 ||
        write(fd, conf, len) != (ssize_t)len || fsync(fd) == -1) {
        rc = errno ? -errno : -EIO;
        goto out;
    }
    if (close(fd) == -1) {
        fd = -1;
        rc = -errno;
        goto out;
    }
    fd = -1;
    /* rename: a reload never reads half a file. */
    if (rename(tmp, path) == -1)
        rc = -errno;
out:
    if (fd != -1) {
        close(fd);
        unlink(tmp);
    }
    free(conf);
    free(ids);
    return rc;
}

static off_t
file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? st.st_size : 0;
}

/* 1 if the log, from offset on, holds needle. */
static int
log_says(const char *path, off_t offset, const char *needle)
{
    char buf[8192];
    size_t keep = 0, nl = strlen(needle);
    int found = 0;
    FILE *f = fopen(path, "re");

    if (!f)
        return 0;
    if (fseeko(f, offset, SEEK_SET) == 0) {
        size_t r;
        /* Chunks overlap by the needle's length so a match across two
         * reads is found. */
        while (!found &&
               (r = fread(buf + keep, 1, sizeof(buf) - 1 - keep, f)) > 0) {
            size_t have = keep + r;
            buf[have] = '\0';
            found = strstr(buf, needle) != NULL;
            keep = have > nl ? nl : have;
            memmove(buf, buf + have - keep, keep);
        }
    }
    fclose(f);
    return found;
}

int
stack_nats_reload(const char *nats_dir, int timeout_ms)
{
    char log[4200];
    pid_t pid;
    off_t at;

    if (!stack_pidfile_alive(nats_dir, "nats", &pid))
        return KS_ENOTFOUND;
    snprintf(log, sizeof(log), "%s/nats.log", nats_dir);
    at = file_size(log);
    /* nats-server reloads its config on SIGHUP (`nats-server --signal
     * reload` sends the same), keeping every connection whose user is
     * still allowed. It says how it went only in its log. */
    if (kill(pid, SIGHUP) == -1)
        return -errno;
    for (int waited = 0; waited <= timeout_ms; waited += 20) {
        if (log_says(log, at, "Reloaded server configuration"))
            return 0;
        if (log_says(log, at, "Failed to reload"))
            return KS_EINVAL;
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
    return KS_ETIMEDOUT;
}
