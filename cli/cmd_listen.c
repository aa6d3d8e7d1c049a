/*
 * `kscore up --listen ADDR`: the local stack's nats-server reachable from
 * other hosts, TLS-only, with certificates from the stack's own CA
 * (cli/stack_tls.c). See cli_int.h.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_int.h"
#include "stack.h"

static bool
loopback(const char *host)
{
    struct in_addr a;
    return inet_pton(AF_INET, host, &a) == 1 &&
           (ntohl(a.s_addr) >> 24) == 127;
}

static bool
name_ok(const char *n)
{
    if (!n[0] || strlen(n) > 253)
        return false;
    for (const char *p = n; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
              (*p >= '0' && *p <= '9') || *p == '-' || *p == '.'))
            return false;
    return true;
}

int
cli_listen_opt(struct cli_listen *l, int opt, const char *arg)
{
    struct in_addr a;

    switch (opt) {
    case 'L':
        if (inet_pton(AF_INET, arg, &a) != 1 || a.s_addr == INADDR_ANY ||
            strlen(arg) >= sizeof(l->host)) {
            cli_err("bad --listen '%s': an IPv4 address of this host that "
                    "agents reach (nats-server 2.9 listens on one address; "
                    "not 0.0.0.0)",
                    arg);
            return CLI_EXIT_USAGE;
        }
        l->given_host = arg;
        return 0;
    case 'N':
        if (!name_ok(arg) ||
            l->n_names >= sizeof(l->names) / sizeof(l->names[0])) {
            cli_err("bad --tls-name '%s' (a DNS name; at most %zu)", arg,
                    sizeof(l->names) / sizeof(l->names[0]));
            return CLI_EXIT_USAGE;
        }
        l->names[l->n_names++] = arg;
        return 0;
    case 'M':
        l->mtls = l->mtls_given = true;
        return 0;
    }
    return CLI_EXIT_USAGE;
}

/* KEY='value' from $KSCORE_HOME/listen (malloc'd), or NULL. The file
 * outlives `kscore down`, which removes env. */
static char *
saved(const char *key)
{
    char path[4200], line[1024];
    size_t kl = strlen(key);
    char *val = NULL;
    FILE *f;

    snprintf(path, sizeof(path), "%s/listen", cli_home());
    if (!(f = fopen(path, "re")))
        return NULL;
    while (!val && fgets(line, sizeof(line), f)) {
        char *v = line + kl + 1;
        if (strncmp(line, key, kl) != 0 || line[kl] != '=')
            continue;
        v[strcspn(v, "\n")] = '\0';
        if (v[0] == '\'' && strlen(v) >= 2 && v[strlen(v) - 1] == '\'') {
            v[strlen(v) - 1] = '\0';
            v++;
        }
        val = strdup(v);
    }
    fclose(f);
    return val;
}

void
cli_listen_resolve(struct cli_listen *l)
{
    char *host = l->given_host ? NULL : saved("KSCORE_NATS_LISTEN");
    char *mtls = saved("KSCORE_NATS_MTLS");
    static char *names; /* lives as long as l->names point into it */

    snprintf(l->host, sizeof(l->host), "%s",
             l->given_host ? l->given_host
             : host && name_ok(host) ? host
                                     : "127.0.0.1");
    /* A new --listen starts afresh; otherwise what the last `up` had. */
    if (!l->given_host && !l->mtls_given && mtls && strcmp(mtls, "1") == 0)
        l->mtls = true;
    if (!l->given_host && l->n_names == 0 &&
        (names = saved("KSCORE_NATS_TLS_NAMES"))) {
        for (char *save = NULL, *t = strtok_r(names, ",", &save);
             t && l->n_names < sizeof(l->names) / sizeof(l->names[0]);
             t = strtok_r(NULL, ",", &save))
            if (name_ok(t))
                l->names[l->n_names++] = t;
    }
    l->tls = !loopback(l->host);
    if (!l->tls)
        l->mtls = false;
    free(host);
    free(mtls);
}

/* "--listen 10.0.0.5 --mtls --tls-name a": the settings as flags. */
static void
settings_text(const struct cli_listen *l, char *buf, size_t len)
{
    size_t used = (size_t)snprintf(buf, len, "--listen %s%s", l->host,
                                   l->mtls ? " --mtls" : "");
    for (size_t i = 0; i < l->n_names && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, " --tls-name %s",
                                 l->names[i]);
}

bool
cli_listen_differs(const struct cli_listen *given, char *now, size_t now_len,
                   char *asked, size_t asked_len)
{
    struct cli_listen run = {0}, want = *given;
    char a[512], b[512];

    if (!given->given_host && !given->mtls_given && !given->n_names)
        return false;
    cli_listen_resolve(&run);
    cli_listen_resolve(&want);
    settings_text(&run, a, sizeof(a));
    settings_text(&want, b, sizeof(b));
    snprintf(now, now_len, "%s", a);
    snprintf(asked, asked_len, "%s", b);
    if (strcmp(run.host, want.host) != 0 || run.mtls != want.mtls ||
        run.n_names != want.n_names)
        return true;
    for (size_t i = 0; i < want.n_names; i++) {
        bool found = false;
        for (size_t j = 0; j < run.n_names && !found; j++)
            found = strcmp(want.names[i], run.names[j]) == 0;
        if (!found)
            return true;
    }
    return false;
}

int
cli_listen_tls(const char *home, struct cli_listen *l, const char *agent_user,
               const char *operator_name)
{
    struct stack_tls_paths p;
    const char *sans[20];
    char hostname[256] = "";
    size_t n = 0;
    int rc;

    if (!l->tls)
        return 0;
    /* An address of another host (a typo, a lease that changed) would
     * only show as nats-server failing to bind, seconds later, in its log. */
    {
        struct sockaddr_in sa = {.sin_family = AF_INET};
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int err = 0;
        if (fd >= 0 && inet_pton(AF_INET, l->host, &sa.sin_addr) == 1 &&
            bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == -1)
            err = errno;
        if (fd >= 0)
            close(fd);
        if (err == EADDRNOTAVAIL) {
            cli_err("cannot listen on %s: not an address of this host (ip "
                    "-4 addr shows them)%s",
                    l->host,
                    l->given_host ? ""
                                  : "; it is the saved --listen: give "
                                    "another, or --listen 127.0.0.1");
            return CLI_EXIT_KSCORE;
        }
    }
    stack_tls_paths(home, &p);
    snprintf(l->ca, sizeof(l->ca), "%s", p.ca_cert);
    sans[n++] = l->host;
    /* The host name too, so agents may use it in their url. */
    if (gethostname(hostname, sizeof(hostname) - 1) == 0 &&
        name_ok(hostname))
        sans[n++] = hostname;
    for (size_t i = 0; i < l->n_names; i++)
        sans[n++] = l->names[i];
    if ((rc = stack_tls_server_ensure(home, sans, n)) ||
        (rc = stack_tls_conf(home, l->mtls, &l->tls_conf))) {
        cli_err("cannot make the TLS certificates in %s: %s", p.dir,
                ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if (!l->mtls)
        return 0;
    snprintf(l->bcert, sizeof(l->bcert), "%s/broker.pem", p.dir);
    snprintf(l->bkey, sizeof(l->bkey), "%s/broker.key", p.dir);
    snprintf(l->acert, sizeof(l->acert), "%s/%s.pem", p.dir, agent_user);
    snprintf(l->akey, sizeof(l->akey), "%s/%s.key", p.dir, agent_user);
    snprintf(l->ocert, sizeof(l->ocert), "%s/%s.pem", p.dir, operator_name);
    snprintf(l->okey, sizeof(l->okey), "%s/%s.key", p.dir, operator_name);
    /* Made once and kept, as the NKeys are. */
    struct {
        const char *cn, *cert, *key;
    } want[] = {{"broker", l->bcert, l->bkey},
                {agent_user, l->acert, l->akey},
                {operator_name, l->ocert, l->okey}};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        if (access(want[i].cert, R_OK) == 0 && access(want[i].key, R_OK) == 0)
            continue;
        if ((rc = stack_tls_client_write(home, want[i].cn, want[i].cert,
                                         want[i].key))) {
            cli_err("cannot make the client certificate of %s: %s",
                    want[i].cn, ks_strerror(rc));
            return CLI_EXIT_KSCORE;
        }
    }
    return 0;
}

void
cli_listen_args(char **argv, const struct cli_listen *l, int agent)
{
    size_t i = 0;

    while (argv[i])
        i++;
    /* On loopback only processes of this host reach NATS: while none of
     * its agents is enrolled (kscore agent --label on one host, the
     * tests) the broker's default (signed labels only) is turned off for
     * them. Once one is, its bundle may go to a user or a container of
     * the host, and whoever holds it could leave the signature out and
     * declare another group's labels, which a broker that never saw (or,
     * after a restart, forgot) the signed ones would take: signed only,
     * as beyond loopback. */
    if (!l->tls) {
        if (!agent)
            argv[i++] = l->enrolled ? "--require-signed-labels"
                                    : "--allow-unsigned-labels";
        return;
    }
    argv[i++] = "--tls-ca";
    argv[i++] = (char *)l->ca;
    if (l->mtls) {
        argv[i++] = "--tls-cert";
        argv[i++] = (char *)(agent ? l->acert : l->bcert);
        argv[i++] = "--tls-key";
        argv[i++] = (char *)(agent ? l->akey : l->bkey);
    }
    /* Agents on other hosts: their labels count only when the broker
     * signed them (kscore agent enroll). */
    if (!agent)
        argv[i++] = "--require-signed-labels";
}

static void
put_settings(FILE *f, const struct cli_listen *l)
{
    fprintf(f, "KSCORE_NATS_LISTEN='%s'\nKSCORE_NATS_MTLS='%d'\n", l->host,
            l->mtls ? 1 : 0);
    if (l->n_names) {
        fprintf(f, "KSCORE_NATS_TLS_NAMES='");
        for (size_t i = 0; i < l->n_names; i++)
            fprintf(f, "%s%s", i ? "," : "", l->names[i]);
        fprintf(f, "'\n");
    }
}

int
cli_listen_env(const char *home, const struct cli_listen *l)
{
    char path[4200];
    FILE *f;

    /* What the next `up` starts with, --listen or not. */
    snprintf(path, sizeof(path), "%s/listen", home);
    if (!(f = fopen(path, "we")))
        return -errno;
    fprintf(f, "# kscore up --listen settings; written by `kscore up`\n");
    put_settings(f, l);
    if (fclose(f) != 0)
        return -errno;
    snprintf(path, sizeof(path), "%s/env", home);
    if (!(f = fopen(path, "ae")))
        return -errno;
    put_settings(f, l);
    if (l->tls)
        fprintf(f, "KSCORE_NATS_TLS_CA='%s'\n", l->ca);
    if (l->mtls)
        fprintf(f, "KSCORE_NATS_TLS_CERT='%s'\nKSCORE_NATS_TLS_KEY='%s'\n",
                l->ocert, l->okey);
    return fclose(f) == 0 ? 0 : -errno;
}
