/*
 * kscore agent enroll|revoke|list, and the bundle `kscore agent --bundle`
 * reads: agents on other hosts.
 *
 * enroll makes the agent's NATS identity ("agent-<id>", an NKey, with the
 * same per-identity permissions as a local agent: deploy/nats-auth.conf.in)
 * in the local stack's registry, and writes everything the agent host needs
 * into one bundle file (0600). revoke removes the identity, makes
 * nats-server reload (which closes the agent's connections at once and
 * refuses its reconnects), then forgets the agent in the registry bucket
 * and deletes its consumer (evt_agent_forget), so the broker refuses new
 * commands for it.
 *
 * The bundle (docs/security.md "The bundle") is INI, one value a line:
 *
 *   # kscore agent bundle: secret (it holds the agent's NKey seed)
 *   [bundle]
 *   version = 1
 *   [agent]
 *   id = web1
 *   label = env=prod            (repeatable)
 *   enrolled_at_us = 1764550000000000
 *   labels_signature = ...      (base64: the broker's signature over id,
 *   labels_key_id = ...          enrolled_at_us and labels: evt_labels_sign)
 *   [nats]
 *   url = tls://10.0.0.1:4222   (repeatable; tried in order)
 *   nkey_seed = SU...
 *   [trust]
 *   signing_key_pem_base64 = ... (the broker's public signing key)
 *   [tls]                        (when the stack has a CA)
 *   ca_pem_base64 = ...
 *   cert_pem_base64 = ...        (client certificate, for mutual TLS)
 *   key_pem_base64 = ...
 *
 * Files travel as base64 of their PEM text so every value is one line.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "cli_int.h"
#include "stack.h"

/* ---- small helpers ------------------------------------------------------- */

static char *
slurp(const char *path, size_t max)
{
    FILE *f = fopen(path, "re");
    char *buf;
    size_t n;

    if (!f)
        return NULL;
    buf = malloc(max + 1);
    if (!buf) {
        fclose(f);
        return NULL;
    }
    n = fread(buf, 1, max, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static char *
b64_encode(const char *text)
{
    size_t n = strlen(text);
    char *out = malloc(4 * ((n + 2) / 3) + 1);
    if (out)
        EVP_EncodeBlock((unsigned char *)out, (const unsigned char *)text,
                        (int)n);
    return out;
}

/* Decodes base64 text into a NUL-ended string; NULL when it is not
 * base64. */
static char *
b64_decode(const char *b64)
{
    size_t n = strlen(b64);
    unsigned char *out;
    int len;

    if (n == 0 || n % 4)
        return NULL;
    out = malloc(n / 4 * 3 + 1);
    if (!out)
        return NULL;
    len = EVP_DecodeBlock(out, (const unsigned char *)b64, (int)n);
    if (len < 0) {
        free(out);
        return NULL;
    }
    /* EVP_DecodeBlock counts the padding as zero bytes. */
    if (b64[n - 1] == '=')
        len--;
    if (b64[n - 2] == '=')
        len--;
    out[len] = '\0';
    return (char *)out;
}

/* Decodes base64 of exactly len bytes into out; out, or NULL when v is
 * not that. */
static char *
b64_decode_bytes(const char *v, uint8_t *out, size_t len)
{
    unsigned char buf[128];
    size_t n = strlen(v);
    int got;

    if (n == 0 || n % 4 || n / 4 * 3 > sizeof(buf))
        return NULL;
    got = EVP_DecodeBlock(buf, (const unsigned char *)v, (int)n);
    if (got < 0)
        return NULL;
    if (v[n - 1] == '=')
        got--;
    if (v[n - 2] == '=')
        got--;
    if ((size_t)got != len)
        return NULL;
    memcpy(out, buf, len);
    return (char *)out;
}

static int
write_secret(const char *path, const char *text, mode_t mode)
{
    size_t n = strlen(text);
    int fd, rc = 0;

    unlink(path);
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd == -1)
        return -errno;
    if (write(fd, text, n) != (ssize_t)n)
        rc = errno ? -errno : -EIO;
    if (close(fd) == -1 && rc == 0)
        rc = -errno;
    return rc;
}

static bool
label_ok(const char *kv)
{
    const char *eq = strchr(kv, '=');
    return eq && eq != kv && !strchr(kv, '\n') && !strchr(kv, '\r');
}

/* nats://HOST:PORT, tls://HOST:PORT or HOST:PORT (what nats.c takes);
 * another scheme (http://, a pasted monitoring url) is a mistake that
 * would only show on the agent host, as a connection that never works. */
static bool
url_ok(const char *u)
{
    const char *scheme_end = strstr(u, "://");
    if (!u[0] || strpbrk(u, " \t\r\n,"))
        return false;
    if (!scheme_end)
        return true;
    return (strncmp(u, "nats://", 7) == 0 || strncmp(u, "tls://", 6) == 0) &&
           scheme_end[3] != '\0';
}

/* ---- the bundle ---------------------------------------------------------- */

void
cli_bundle_release(struct cli_bundle *b)
{
    if (b->made_dir && b->dir[0]) {
        const char *names[] = {"agent.nk", "trust.pub", "ca.pem", "client.pem",
                               "client.key"};
        char p[4400];
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
            snprintf(p, sizeof(p), "%s/%s", b->dir, names[i]);
            unlink(p);
        }
        rmdir(b->dir);
    }
    for (size_t i = 0; i < b->n_labels; i++)
        free(b->labels[i]);
    free(b->labels);
    free(b->urls);
    memset(b, 0, sizeof(*b));
}

/* One line of a bundle into b (the file's pieces into *blob). */
struct bundle_read {
    char section[32];
    char *seed, *trust, *ca, *cert, *key;
    int version;
};

static int
bundle_line(struct cli_bundle *b, struct bundle_read *r, char *line,
            char *why, size_t why_len)
{
    char *k, *v, *eq;
    size_t n;

    line[strcspn(line, "\r\n")] = '\0';
    while (*line == ' ' || *line == '\t')
        line++;
    if (!*line || *line == '#' || *line == ';')
        return 0;
    if (*line == '[') {
        char *end = strchr(line, ']');
        if (!end || (size_t)(end - line - 1) >= sizeof(r->section)) {
            snprintf(why, why_len, "bad section line '%.40s'", line);
            return KS_EINVAL;
        }
        snprintf(r->section, sizeof(r->section), "%.*s", (int)(end - line - 1),
                 line + 1);
        return 0;
    }
    if (!(eq = strchr(line, '='))) {
        snprintf(why, why_len, "expected KEY = VALUE, not '%.40s'", line);
        return KS_EINVAL;
    }
    *eq = '\0';
    k = line;
    v = eq + 1;
    for (n = strlen(k); n && (k[n - 1] == ' ' || k[n - 1] == '\t'); n--)
        k[n - 1] = '\0';
    while (*v == ' ' || *v == '\t')
        v++;
    for (n = strlen(v); n && (v[n - 1] == ' ' || v[n - 1] == '\t'); n--)
        v[n - 1] = '\0';

#define IS(sec, key) (strcmp(r->section, sec) == 0 && strcmp(k, key) == 0)
    if (IS("bundle", "version")) {
        r->version = atoi(v);
    } else if (IS("agent", "id")) {
        snprintf(b->id, sizeof(b->id), "%s", v);
    } else if (IS("agent", "pool")) {
        snprintf(b->pool, sizeof(b->pool), "%s", v);
    } else if (IS("agent", "pool_size")) {
        char *end;
        unsigned long n = strtoul(v, &end, 10);
        if (!v[0] || *end || n == 0 || n > STACK_POOL_MAX) {
            snprintf(why, why_len, "bad pool_size '%.40s'", v);
            return KS_EINVAL;
        }
        b->pool_size = (unsigned)n;
    } else if (IS("agent", "label")) {
        char **nl = realloc(b->labels, (b->n_labels + 1) * sizeof(*nl));
        if (!nl || !(nl[b->n_labels] = strdup(v))) {
            if (nl)
                b->labels = nl;
            return -ENOMEM;
        }
        b->labels = nl;
        b->n_labels++;
    } else if (IS("agent", "enrolled_at_us")) {
        char *end;
        b->enrolled_at_us = strtoll(v, &end, 10);
        if (!v[0] || *end) {
            snprintf(why, why_len, "bad enrolled_at_us '%.40s'", v);
            return KS_EINVAL;
        }
    } else if (IS("agent", "labels_signature")) {
        char *raw = strlen(v) == 4 * ((EVT_SIGNATURE_BYTES + 2) / 3)
                        ? b64_decode_bytes(v, b->labels_sig,
                                           sizeof(b->labels_sig))
                        : NULL;
        if (!raw) {
            snprintf(why, why_len, "bad labels_signature");
            return KS_EINVAL;
        }
        b->has_attest = true;
    } else if (IS("agent", "labels_key_id")) {
        snprintf(b->labels_key_id, sizeof(b->labels_key_id), "%s", v);
    } else if (IS("nats", "url")) {
        size_t have = b->urls ? strlen(b->urls) : 0;
        char *nu = realloc(b->urls, have + strlen(v) + 2);
        if (!nu)
            return -ENOMEM;
        b->urls = nu;
        snprintf(nu + have, strlen(v) + 2, "%s%s", have ? "," : "", v);
    } else if (IS("nats", "nkey_seed")) {
        free(r->seed);
        r->seed = strdup(v);
    } else if (IS("trust", "signing_key_pem_base64")) {
        free(r->trust);
        if (!(r->trust = b64_decode(v)))
            goto bad_b64;
    } else if (IS("tls", "ca_pem_base64")) {
        free(r->ca);
        if (!(r->ca = b64_decode(v)))
            goto bad_b64;
    } else if (IS("tls", "cert_pem_base64")) {
        free(r->cert);
        if (!(r->cert = b64_decode(v)))
            goto bad_b64;
    } else if (IS("tls", "key_pem_base64")) {
        free(r->key);
        if (!(r->key = b64_decode(v)))
            goto bad_b64;
    }
    /* Unknown keys are ignored: a newer kscore may add some. */
#undef IS
    return 0;
bad_b64:
    snprintf(why, why_len, "[%s] %s is not base64 (the file cut short or "
             "edited?)", r->section, k);
    return KS_EINVAL;
}

int
cli_bundle_load(const char *path, const char *state_dir, struct cli_bundle *b,
                char *why, size_t why_len)
{
    struct bundle_read r = {.section = ""};
    struct stat st;
    char line[16384], identity[EVT_AGENT_ID_MAX + 8], p[4400];
    FILE *f;
    int rc = 0;

    memset(b, 0, sizeof(*b));
    if (!(f = fopen(path, "re"))) {
        snprintf(why, why_len, "%s", strerror(errno));
        return -errno;
    }
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(f);
        snprintf(why, why_len, "a directory, not a bundle file");
        return KS_EINVAL;
    }
    if ((rc = cli_file_trusted(fileno(f), path, why, why_len)) != 0) {
        fclose(f);
        return rc;
    }
    mode_t mode = fstat(fileno(f), &st) == 0 ? st.st_mode : 0;
    while (rc == 0 && fgets(line, sizeof(line), f))
        rc = bundle_line(b, &r, line, why, why_len);
    fclose(f);
    if (rc)
        goto out;
    rc = KS_EINVAL;
    if (r.version != 1) {
        snprintf(why, why_len, "not a kscore agent bundle of version 1");
        goto out;
    }
    /* Only now: a file that is no bundle at all gets no warning about it. */
    if (mode & 0077)
        fprintf(stderr,
                "kscore agent: warning: %s is readable by others (mode %03o); "
                "it holds the agent's secret: chmod 600 it\n",
                path, (unsigned)(mode & 0777));
    if (b->pool[0]) {
        snprintf(identity, sizeof(identity), "pool-%s", b->pool);
        if (b->id[0] || !b->pool_size || !evt_agent_id_valid(b->pool) ||
            !evt_identity_valid(identity)) {
            snprintf(why, why_len, "bad [agent] pool: a pool's bundle has "
                                   "pool and pool_size, and no id");
            goto out;
        }
    } else {
        snprintf(identity, sizeof(identity), "agent-%s", b->id);
        if (!evt_agent_id_valid(b->id) || !evt_identity_valid(identity)) {
            snprintf(why, why_len, "bad or missing [agent] id");
            goto out;
        }
    }
    if (!b->urls || !r.seed || !r.trust) {
        snprintf(why, why_len,
                 "incomplete: needs [nats] url and nkey_seed and [trust] "
                 "signing_key_pem_base64");
        goto out;
    }
    /* A bundle cut short (a copy that stopped, a paste) still decodes:
     * say so here, not as a TLS or signature error on the first connect. */
    {
        const struct {
            const char *text, *name;
        } pems[] = {{r.trust, "[trust] signing_key_pem_base64"},
                    {r.ca, "[tls] ca_pem_base64"},
                    {r.cert, "[tls] cert_pem_base64"},
                    {r.key, "[tls] key_pem_base64"}};
        for (size_t i = 0; i < sizeof(pems) / sizeof(pems[0]); i++)
            if (pems[i].text && (strncmp(pems[i].text, "-----BEGIN ", 11) ||
                                 !strstr(pems[i].text, "-----END "))) {
                snprintf(why, why_len,
                         "%s is not a whole PEM block (the file cut short "
                         "or edited?)",
                         pems[i].name);
                goto out;
            }
    }
    for (size_t i = 0; i < b->n_labels; i++)
        if (!label_ok(b->labels[i])) {
            snprintf(why, why_len, "bad label '%s' (KEY=VALUE)", b->labels[i]);
            goto out;
        }
    /* The pieces become files in a private directory, as nats.c and the
     * agent read them (nats.c reads the seed again at every reconnect). */
    if (state_dir) {
        snprintf(b->dir, sizeof(b->dir), "%s/bundle", state_dir);
        if ((rc = stack_mkdirs(b->dir, 0700)) || chmod(b->dir, 0700) == -1) {
            rc = rc ? rc : -errno;
            snprintf(why, why_len, "cannot make %s: %s", b->dir,
                     ks_strerror(rc));
            goto out;
        }
    } else {
        const char *t = getenv("TMPDIR");
        snprintf(b->dir, sizeof(b->dir), "%s/kscore-agent-XXXXXX",
                 t && t[0] ? t : "/tmp");
        if (!mkdtemp(b->dir)) {
            rc = -errno;
            snprintf(why, why_len, "cannot make a private directory: %s",
                     strerror(errno));
            b->dir[0] = '\0';
            goto out;
        }
        b->made_dir = true;
    }
    snprintf(b->nkey_file, sizeof(b->nkey_file), "%s/agent.nk", b->dir);
    unlink(b->nkey_file);
    if ((rc = evt_nkey_write_seed(b->nkey_file, identity, r.seed))) {
        snprintf(why, why_len, "bad nkey_seed: %s", ks_strerror(rc));
        goto out;
    }
    snprintf(b->trust_key, sizeof(b->trust_key), "%s/trust.pub", b->dir);
    if ((rc = write_secret(b->trust_key, r.trust, 0644)))
        goto io;
    if (r.ca) {
        snprintf(b->tls_ca, sizeof(b->tls_ca), "%s/ca.pem", b->dir);
        if ((rc = write_secret(b->tls_ca, r.ca, 0644)))
            goto io;
    }
    if (r.cert && r.key) {
        snprintf(b->tls_cert, sizeof(b->tls_cert), "%s/client.pem", b->dir);
        snprintf(b->tls_key, sizeof(b->tls_key), "%s/client.key", b->dir);
        if ((rc = write_secret(b->tls_cert, r.cert, 0644)) ||
            (rc = write_secret(b->tls_key, r.key, 0600)))
            goto io;
    }
    rc = 0;
    goto out;
io:
    snprintf(p, sizeof(p), "%s", b->dir);
    snprintf(why, why_len, "cannot write in %s: %s", p, ks_strerror(rc));
out:
    if (r.seed)
        OPENSSL_cleanse(r.seed, strlen(r.seed));
    if (r.key)
        OPENSSL_cleanse(r.key, strlen(r.key));
    free(r.seed);
    free(r.trust);
    free(r.ca);
    free(r.cert);
    free(r.key);
    if (rc)
        cli_bundle_release(b);
    return rc;
}

/* ---- enroll / revoke / list ---------------------------------------------- */

static const char usage[] =
    "usage: kscore agent enroll ID [--label K=V]... [--out FILE]\n"
    "                           [--nats-url URL]...\n"
    "       kscore agent enroll POOL --pool-size N [--label K=V]... [--out "
    "FILE]\n"
    "       kscore agent revoke ID|pool-POOL [--nats URL]\n"
    "       kscore agent list [--json]\n"
    "       kscore agent label ID|pool-POOL KEY=VALUE|KEY-... [--json]\n"
    "The agents of the stack in $KSCORE_HOME (now %s).\n"
    "enroll makes agent ID's NATS identity (an NKey allowed only what agent\n"
    "ID may do) and writes a bundle (default $KSCORE_HOME/bundles/ID.bundle,\n"
    "mode 0600): the NATS urls (--nats-url, repeatable; default the stack's\n"
    "url), the agent's seed, the CA certificate and a client certificate\n"
    "when the stack has a CA ($KSCORE_HOME/tls), the broker's public\n"
    "signing key, the id and the labels, signed with the broker's key (the\n"
    "broker gives the agent those labels only). Copy it to the agent host,\n"
    "run `kscore agent --bundle FILE` there, and delete it here: it is the\n"
    "agent's secret. A running nats-server reloads its users without a\n"
    "restart.\n"
    "With --pool-size N, POOL is an agent pool: one identity, pool-POOL,\n"
    "for the ids POOL-0 .. POOL-<N-1> served by one process (`kscore agent\n"
    "--bundle FILE` serves them all through one consumer); its NATS\n"
    "permissions name each of its ids and nothing of any other agent.\n"
    "revoke removes the identity: nats-server closes the agent's connections\n"
    "and refuses it from then on; the broker forgets the agent, so commands\n"
    "for it are refused.\n"
    "label changes an agent's signed labels without a new enrolment (see\n"
    "kscore agent label --help); list shows the labels of the enrolment.\n";

/* The broker's signature over id, at and the "K=V" labels
 * (evt_labels_sign). 0 or a negative code. */
static int
sign_labels(const struct evt_signer *s, const char *id, int64_t at,
            char *const *labels, size_t n, uint8_t sig[EVT_SIGNATURE_BYTES])
{
    Ks__EnvVar *v = calloc(n + 1, sizeof(*v));
    Ks__EnvVar **p = calloc(n + 1, sizeof(*p));
    char **keys = calloc(n + 1, sizeof(*keys));
    int rc = -ENOMEM;

    if (!v || !p || !keys)
        goto out;
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(labels[i], '=');
        ks__env_var__init(&v[i]);
        if (!eq || !(keys[i] = strndup(labels[i], (size_t)(eq - labels[i]))))
            goto out;
        v[i].name = keys[i];
        v[i].value = (char *)eq + 1;
        p[i] = &v[i];
    }
    rc = evt_labels_sign(s, id, at, p, n, sig);
out:
    for (size_t i = 0; keys && i < n; i++)
        free(keys[i]);
    free(keys);
    free(p);
    free(v);
    return rc;
}

static int
meta_path(const char *home, const char *id, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s/enrolled/%s", home, id);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/*
 * Why id (pool_size 0) or pool id (pool_size > 0) may not be enrolled
 * next to what is: an agent id that is an id of an enrolled pool
 * (<pool>-<n>), a pool one of whose ids is an enrolled agent's, or a pool
 * named as this host (the broker's own local agents <host>-0.. are that
 * pool). NULL when none; why is filled.
 */
static const char *
enroll_clash(const char *home, const char *id, unsigned pool_size, char *why,
             size_t len)
{
    struct stack_identity *ids = NULL;
    size_t n = 0;
    char host[64] = "";

    if (pool_size) {
        gethostname(host, sizeof(host));
        host[sizeof(host) - 1] = '\0';
        host[strcspn(host, ".")] = '\0';
        if (strcmp(host, id) == 0) {
            snprintf(why, len,
                     "pool %s is this host's name: a broker's own local "
                     "agents %s-0, %s-1, ... are the pool %s",
                     id, host, host, host);
            return why;
        }
    }
    if (stack_ident_list(home, &ids, &n) != 0)
        return NULL; /* no registry yet: nothing to clash with */
    why[0] = '\0';
    for (size_t i = 0; i < n && !why[0]; i++) {
        const struct stack_identity *e = &ids[i];
        if (!pool_size && e->kind == STACK_POOL &&
            evt_pool_index(e->name + 5, id, UINT32_MAX) >= 0)
            snprintf(why, len,
                     "agent id %s is an id of the enrolled pool %s (its ids "
                     "are %s-<n>)",
                     id, e->name + 5, e->name + 5);
        else if (pool_size && e->kind == STACK_AGENT &&
                 evt_pool_index(id, e->name + 6, UINT32_MAX) >= 0)
            snprintf(why, len,
                     "pool %s would have the id of the enrolled agent %s",
                     id, e->name + 6);
    }
    free(ids);
    return why[0] ? why : NULL;
}

static int
fleet_enroll(const char *home, const char *id, unsigned pool_size,
             char **labels, size_t n_labels, const char *out_path, char **urls,
             size_t n_urls)
{
    char identity[EVT_AGENT_ID_MAX + 8], seed_path[4200], out_buf[4400],
        meta[4200], dir[4200], seed[EVT_NKEY_SEED_CHARS + 1],
        pub[EVT_NKEY_PUBLIC_CHARS + 1], nid[EVT_IDENTITY_MAX + 1];
    char *env_url = NULL, *trust = NULL, *trust64 = NULL, *ca64 = NULL,
         *cert = NULL, *key = NULL, *cert64 = NULL, *key64 = NULL,
         *ca = NULL;
    struct stack_tls_paths tp;
    struct stack_identity sid;
    struct evt_signer *signer = NULL;
    uint8_t sig[EVT_SIGNATURE_BYTES];
    char sig64[4 * ((EVT_SIGNATURE_BYTES + 2) / 3) + 1];
    int64_t enrolled_at_us = ks_now_us();
    bool added = false, created = false;
    FILE *f = NULL;
    int fd = -1, rc, ret = CLI_EXIT_KSCORE;

    /* A pool (--pool-size N): id names the pool, its ids are id-0 ..
     * id-<N-1>, its identity pool-<id> (deploy/nats-auth.conf.in). */
    const enum stack_kind kind = pool_size ? STACK_POOL : STACK_AGENT;
    /* A pool's labels are attested with its name and size,
     * "pool.<id>/<size>": the broker takes no more ids than that. */
    char pool_key[sizeof(EVT_POOL_KEY_PREFIX) + EVT_AGENT_ID_MAX + 12];
    evt_pool_attest_id(pool_key, sizeof(pool_key), id, pool_size);
    snprintf(identity, sizeof(identity), "%s-%s", pool_size ? "pool" : "agent",
             id);
    /* The NATS identity "agent-<id>" or "pool-<id>" is a user name of at
     * most EVT_IDENTITY_MAX bytes; a pool's ids "<id>-<n>" must be agent
     * ids too (n < STACK_POOL_MAX: "-" and up to 6 digits). */
    size_t max = pool_size ? EVT_IDENTITY_MAX - 5 : EVT_IDENTITY_MAX - 6;
    if (pool_size && max > EVT_AGENT_ID_MAX - 7)
        max = EVT_AGENT_ID_MAX - 7;
    if (!evt_agent_id_valid(id) || !evt_identity_valid(identity) ||
        strlen(id) > max) {
        cli_err("bad %s '%s'%s: 1 to %zu letters, digits, _ and - (its NATS "
                "identity %s-<%s> is at most %d characters)",
                pool_size ? "pool name" : "agent id", id,
                strlen(id) > max ? ": too long" : "", max,
                pool_size ? "pool" : "agent", pool_size ? "name" : "id",
                EVT_IDENTITY_MAX);
        return CLI_EXIT_USAGE;
    }
    {
        char why[256];
        if (enroll_clash(home, id, pool_size, why, sizeof(why))) {
            cli_err("cannot enrol %s: %s", identity, why);
            return CLI_EXIT_USAGE;
        }
    }
    for (size_t i = 0; i < n_labels; i++) {
        char why[200], key[BROKER_LABEL_KEY_MAX + 2];
        const char *eq = strchr(labels[i], '=');
        if (!label_ok(labels[i])) {
            cli_err("bad --label '%s': expected KEY=VALUE", labels[i]);
            return CLI_EXIT_USAGE;
        }
        /* What `kscore agent label` takes too (a key too long is cut
         * here, and refused for its length). */
        snprintf(key, sizeof(key), "%.*s", (int)(eq - labels[i]), labels[i]);
        if (broker_label_check(key, eq + 1, why, sizeof(why))) {
            cli_err("bad --label '%s': %s", labels[i], why);
            return CLI_EXIT_USAGE;
        }
    }
    for (size_t i = 0; i < n_urls; i++)
        if (!url_ok(urls[i])) {
            cli_err("bad --nats-url '%s': tls://HOST:PORT (or nats://, or "
                    "HOST:PORT), one url per flag",
                    urls[i]);
            return CLI_EXIT_USAGE;
        }
    if (n_urls == 0) {
        env_url = cli_env_get("KSCORE_NATS_URL");
        if (!env_url) {
            cli_err("no NATS url for the bundle: give --nats-url URL (the "
                    "address agents reach nats-server at), or start the "
                    "stack with `kscore up`");
            return CLI_EXIT_USAGE;
        }
        urls = &env_url;
        n_urls = 1;
    }
    if (!out_path) {
        snprintf(dir, sizeof(dir), "%s/bundles", home);
        if ((rc = stack_mkdirs(dir, 0700))) {
            cli_err("cannot create %s: %s", dir, ks_strerror(rc));
            goto out;
        }
        snprintf(out_buf, sizeof(out_buf), "%s/%s.bundle", dir,
                 pool_size ? identity : id);
        out_path = out_buf;
    }
    snprintf(dir, sizeof(dir), "%s/keys/broker.pub", home);
    if (!(trust = slurp(dir, 64 * 1024)) || !trust[0]) {
        cli_err("cannot read the broker's public signing key %s (kscore up "
                "makes it)",
                dir);
        goto out;
    }
    /* The broker believes an agent's labels only with its own signature
     * over them (broker/registry.c labels_settle): it is the one key that
     * signs commands too, so the agent host needs nothing new to trust. */
    snprintf(dir, sizeof(dir), "%s/keys/broker.key", home);
    if ((rc = evt_signer_load(dir, &signer)) ||
        (rc = sign_labels(signer, pool_size ? pool_key : id, enrolled_at_us,
                          labels, n_labels, sig))) {
        cli_err("cannot sign agent %s's labels with the broker's key %s: %s",
                id, dir, ks_strerror(rc));
        goto out;
    }
    EVP_EncodeBlock((unsigned char *)sig64, sig, (int)sizeof(sig));
    stack_tls_paths(home, &tp);
    if ((ca = slurp(tp.ca_cert, 64 * 1024)) && !(ca64 = b64_encode(ca)))
        goto out;
    /* Before the identity exists: an unwritable --out makes nothing. */
    fd = open(out_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd == -1) {
        cli_err("cannot create %s: %s", out_path,
                errno == EEXIST ? "it exists (not overwritten)"
                                : strerror(errno));
        goto out;
    }
    created = true;
    if ((rc = stack_mkdirs(home, 0700)) ||
        (rc = pool_size ? stack_ident_add_pool(home, id, pool_size, &sid)
                        : stack_ident_add(home, STACK_AGENT, identity, &sid))) {
        if (rc == -EEXIST)
            cli_err("%s is already enrolled (kscore agent revoke %s first to "
                    "give it a new identity)",
                    identity, pool_size ? identity : id);
        else
            cli_err("cannot enrol %s: %s", identity, ks_strerror(rc));
        goto out;
    }
    added = true;
    stack_ident_seed_path(home, kind, identity, seed_path, sizeof(seed_path));
    if ((rc = evt_nkey_read_seed(seed_path, seed, pub, nid))) {
        cli_err("cannot read %s: %s", seed_path, ks_strerror(rc));
        goto out;
    }
    if (ca && access(tp.ca_key, R_OK) == 0 &&
        (rc = stack_tls_issue(home, identity, NULL, 0, &cert, &key)) == 0) {
        cert64 = b64_encode(cert);
        key64 = b64_encode(key);
    }
    if (!(trust64 = b64_encode(trust)) || !(f = fdopen(fd, "w")))
        goto out;
    fd = -1;
    fprintf(f,
            "# kscore agent bundle for %s, written by `kscore agent "
            "enroll` at %s.\n"
            "# SECRET: it holds the agent's NATS key. Keep it mode 0600, copy "
            "it to the agent\n"
            "# host only, and run `kscore agent --bundle FILE` there.\n"
            "[bundle]\nversion = 1\n\n[agent]\n",
            identity, cli_time(ks_now_us()));
    if (pool_size)
        fprintf(f, "# The ids %s-0 .. %s-%u, served by one process.\n"
                   "pool = %s\npool_size = %u\n",
                id, id, pool_size - 1, id, pool_size);
    else
        fprintf(f, "id = %s\n", id);
    for (size_t i = 0; i < n_labels; i++)
        fprintf(f, "label = %s\n", labels[i]);
    fprintf(f,
            "# The broker's signature over id, labels and enrolled_at_us: "
            "the broker\n# gives the agent these labels only (a changed "
            "one voids it).\n"
            "enrolled_at_us = %lld\nlabels_signature = %s\n"
            "labels_key_id = %s\n",
            (long long)enrolled_at_us, sig64, evt_signer_key_id(signer));
    fprintf(f, "\n[nats]\n");
    for (size_t i = 0; i < n_urls; i++)
        fprintf(f, "url = %s\n", urls[i]);
    fprintf(f, "nkey_seed = %s\n\n[trust]\nsigning_key_pem_base64 = %s\n",
            seed, trust64);
    if (ca64) {
        fprintf(f, "\n[tls]\nca_pem_base64 = %s\n", ca64);
        if (cert64 && key64)
            fprintf(f, "cert_pem_base64 = %s\nkey_pem_base64 = %s\n", cert64,
                    key64);
    }
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
        cli_err("cannot write %s: %s", out_path, strerror(errno));
        goto out;
    }
    /* The bundle is the agent's one copy of its seed: none stays here. */
    unlink(seed_path);
    /* The note is also what tells `kscore up` that the stack has
     * enrolled agents (cli_stack_enrolled): no enrolment without it. */
    if (meta_path(home, pool_size ? identity : id, meta, sizeof(meta)) != 0) {
        cli_err("cannot note the enrolment of %s: its name is too long",
                identity);
        goto out;
    } else {
        char mdir[4200];
        snprintf(mdir, sizeof(mdir), "%s/enrolled", home);
        FILE *m = stack_mkdirs(mdir, 0700) == 0 ? fopen(meta, "we") : NULL;
        if (!m) {
            cli_err("cannot write %s: %s", meta, strerror(errno));
            goto out;
        } else {
            /* Absolute: `agent list` is read from anywhere. */
            char abs[PATH_MAX];
            fprintf(m, "enrolled_at %s\nbundle %s\n", cli_time(enrolled_at_us),
                    realpath(out_path, abs) ? abs : out_path);
            for (size_t i = 0; i < n_labels; i++)
                fprintf(m, "label %s\n", labels[i]);
            for (size_t i = 0; i < n_urls; i++)
                fprintf(m, "url %s\n", urls[i]);
            fclose(m);
        }
    }
    if ((ret = cli_nats_users_apply(home)) != 0)
        goto out;
    /* The stack's brokers take its agents' signed labels only from now
     * on: one that allowed unsigned ones (no agent was enrolled when it
     * started) is restarted. */
    if ((ret = cli_stack_signed_labels_apply(home)) != 0)
        goto out;
    printf("%s\n", out_path);
    fprintf(stderr,
            "kscore: %s enrolled (public key %s). Copy %s to its host "
            "(it is secret), run `kscore agent --bundle FILE` there, and "
            "delete it here.\n",
            identity, sid.nkey, out_path);
    ret = 0;
out:
    /* Nothing half-made stays: no identity without its bundle, no bundle
     * without its identity. */
    if (ret && added) {
        stack_ident_remove(home, identity);
        if (meta_path(home, pool_size ? identity : id, meta, sizeof(meta)) ==
            0)
            unlink(meta);
        /* nats-auth.conf may already name it: not at the next start. */
        stack_nats_auth_write(home, home);
    }
    if (ret && created)
        unlink(out_path);
    if (f)
        fclose(f);
    if (fd != -1)
        close(fd);
    OPENSSL_cleanse(seed, sizeof(seed));
    if (key)
        OPENSSL_cleanse(key, strlen(key));
    if (key64)
        OPENSSL_cleanse(key64, strlen(key64));
    evt_signer_free(signer);
    free(env_url);
    free(trust);
    free(trust64);
    free(ca);
    free(ca64);
    free(cert);
    free(cert64);
    free(key);
    free(key64);
    return ret;
}

static int
fleet_revoke(const char *home, struct cli_conn *cc, const char *id)
{
    char identity[EVT_AGENT_ID_MAX + 8], meta[4200], broker_seed[4200];
    struct stack_identity sid;
    struct evt_conn *c = NULL;
    char *errmsg = NULL;
    int rc;

    /* "pool-<pool>": an agent pool's identity (enroll --pool-size). */
    const char *pool = strncmp(id, "pool-", 5) == 0 ? id + 5 : NULL;
    if (pool)
        snprintf(identity, sizeof(identity), "%s", id);
    else
        snprintf(identity, sizeof(identity), "agent-%s", id);
    if (!evt_agent_id_valid(pool ? pool : id) ||
        !evt_identity_valid(identity)) {
        cli_err("bad agent id '%s'", id);
        return CLI_EXIT_USAGE;
    }
    rc = stack_ident_get(home, identity, &sid);
    if (rc == 0 && sid.kind != (pool ? STACK_POOL : STACK_AGENT))
        rc = KS_EINVAL;
    if (rc == 0)
        rc = stack_ident_remove(home, identity);
    if (rc) {
        cli_err("cannot revoke agent %s: %s", id,
                rc == KS_ENOTFOUND ? "no such agent enrolled"
                                   : ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if (meta_path(home, id, meta, sizeof(meta)) == 0)
        unlink(meta);
    /* First shut it out (the reload closes its connections), then forget
     * it: in this order it cannot put its registry entry back. */
    if ((rc = cli_nats_users_apply(home)))
        return rc;
    stack_ident_seed_path(home, STACK_BROKER, "broker", broker_seed,
                          sizeof(broker_seed));
    /* The broker's rights (JetStream API), whatever KSCORE_NATS_NKEY
     * says; --nkey FILE overrides. */
    const char *flag_nkey = cc->opts.nkey_file;
    cli_conn_env(cc);
    cc->opts.nkey_file = flag_nkey;
    if (!cc->nats_url)
        cc->nats_url = cc->owned[0] = cli_env_get("KSCORE_NATS_URL");
    if (!cc->opts.nkey_file)
        cc->opts.nkey_file = broker_seed;
    if (!cc->opts.tls_ca)
        cc->opts.tls_ca = cc->owned[1] = cli_env_get("KSCORE_NATS_TLS_CA");
    if (!cc->opts.tls_cert)
        cc->opts.tls_cert = cc->owned[2] = cli_env_get("KSCORE_NATS_TLS_CERT");
    if (!cc->opts.tls_key)
        cc->opts.tls_key = cc->owned[3] = cli_env_get("KSCORE_NATS_TLS_KEY");
    cc->opts.name = "kscore-revoke";
    if (!cc->nats_url) {
        fprintf(stderr,
                "kscore: agent %s revoked; no running stack, so its registry "
                "entry is left to expire\n",
                id);
        return 0;
    }
    rc = evt_connect(cc->nats_url, &cc->opts, &c, &errmsg);
    if (rc == 0)
        rc = pool ? evt_pool_forget(c, pool, &errmsg)
                  : evt_agent_forget(c, id, &errmsg);
    evt_close(c);
    if (rc) {
        cli_err("agent %s can no longer connect, but the broker could not be "
                "told to forget it: %s",
                id, errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return CLI_EXIT_KSCORE;
    }
    fprintf(stderr,
            "kscore: agent %s revoked: it can no longer connect, and commands "
            "for it are refused\n",
            id);
    return 0;
}

static int
fleet_list(const char *home, bool json)
{
    struct stack_identity *ids = NULL;
    size_t n = 0;
    bool header = false;
    int rc = stack_ident_list(home, &ids, &n);

    if (rc) {
        cli_err("cannot read %s/identities: %s", home, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    for (size_t i = 0; i < n; i++) {
        const char *id = ids[i].name + 6;
        char meta[4200], line[4400], at[64] = "", bundle[4300] = "";
        json_t *labels = json_object();
        FILE *m;

        if (ids[i].kind != STACK_AGENT)
            continue;
        if (meta_path(home, id, meta, sizeof(meta)) == 0 &&
            (m = fopen(meta, "re"))) {
            while (fgets(line, sizeof(line), m)) {
                line[strcspn(line, "\n")] = '\0';
                if (strncmp(line, "enrolled_at ", 12) == 0)
                    snprintf(at, sizeof(at), "%.63s", line + 12);
                else if (strncmp(line, "bundle ", 7) == 0)
                    snprintf(bundle, sizeof(bundle), "%.4290s", line + 7);
                else if (strncmp(line, "label ", 6) == 0) {
                    char *eq = strchr(line + 6, '=');
                    if (eq) {
                        *eq = '\0';
                        json_object_set_new(labels, line + 6,
                                            json_string(eq + 1));
                    }
                }
            }
            fclose(m);
        }
        if (json) {
            json_t *o = json_object();
            json_object_set_new(o, "id", json_string(id));
            json_object_set_new(o, "identity", json_string(ids[i].name));
            json_object_set_new(o, "nkey", json_string(ids[i].nkey));
            json_object_set_new(o, "enrolled", json_boolean(at[0] != '\0'));
            json_object_set_new(o, "enrolled_at",
                                at[0] ? json_string(at) : json_null());
            json_object_set_new(o, "bundle",
                                bundle[0] ? json_string(bundle) : json_null());
            json_object_set_new(o, "labels", labels);
            cli_print_json(o); /* one a line, as every other list */
        } else {
            const char *k;
            json_t *v;
            if (!header) {
                printf("%-24s %-56s %-27s %-30s %s\n", "AGENT", "NKEY",
                       "ENROLLED", "BUNDLE", "LABELS");
                header = true;
            }
            printf("%-24s %s %-27s %-30s", id, ids[i].nkey,
                   at[0] ? at : "local (kscore up)", bundle[0] ? bundle : "-");
            json_object_foreach(labels, k, v)
                printf(" %s=%s", k, json_string_value(v));
            printf("\n");
            json_decref(labels);
        }
    }
    free(ids);
    return 0;
}

int
cmd_agent_admin(int argc, char **argv)
{
    static const struct option lo[] = {
        CLI_CONN_LONGOPTS,
        {"label", required_argument, 0, 'l'},
        {"pool-size", required_argument, 0, 'N'},
        {"out", required_argument, 0, 'o'},
        {"nats-url", required_argument, 0, 'u'},
        {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *home = cli_home(), *out = NULL;
    char **labels = calloc((size_t)argc + 1, sizeof(*labels));
    char **urls = calloc((size_t)argc + 1, sizeof(*urls));
    size_t n_labels = 0, n_urls = 0;
    unsigned long pool_size = 0;
    struct cli_conn cc = {0};
    bool json = false;
    int opt, rc = CLI_EXIT_USAGE;

    if (!labels || !urls) {
        free(labels);
        free(urls);
        return CLI_EXIT_KSCORE;
    }
    /* argv[0] is the verb: getopt permutes the operands after it. */
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'l':
            labels[n_labels++] = optarg;
            break;
        case 'o':
            out = optarg;
            break;
        case 'N': {
            char *end;
            pool_size = strtoul(optarg, &end, 10);
            if (*end || !pool_size || pool_size > STACK_POOL_MAX ||
                optarg[0] == '-') {
                cli_err("bad --pool-size '%s' (1 to %d)", optarg,
                        STACK_POOL_MAX);
                goto done;
            }
            break;
        }
        case 'u':
            urls[n_urls++] = optarg;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            printf(usage, home);
            rc = 0;
            goto done;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            goto done;
        }
    }
    const char *verb = argv[0];
    int rest = argc - optind;
    if (strcmp(verb, "enroll") == 0 && rest == 1 && !json)
        rc = fleet_enroll(home, argv[optind], (unsigned)pool_size, labels,
                          n_labels, out, urls, n_urls);
    else if (strcmp(verb, "revoke") == 0 && rest == 1 && !json &&
             !n_labels && !out && !n_urls && !pool_size)
        rc = fleet_revoke(home, &cc, argv[optind]);
    else if (strcmp(verb, "list") == 0 && rest == 0 && !n_labels && !out &&
             !n_urls)
        rc = fleet_list(home, json);
    else
        fprintf(stderr, usage, home);
done:
    cli_conn_release(&cc);
    free(labels);
    free(urls);
    return rc;
}
