/*
 * stack_tls: the stack's own certificate authority, made with OpenSSL's
 * libcrypto (no openssl CLI needed on the broker host).
 *
 * <home>/tls/ca.key (0600) and ca.pem: a self-signed P-256 CA, made once
 * and kept (agents carry ca.pem in their bundles, so a new CA would cut
 * every enrolled agent off). Leaves are P-256 keys signed by it with
 * SHA-256: a server certificate for nats-server whose subjectAltName lists
 * every address it listens on (a client checks the name there, RFC 6125
 * 6.4), and client certificates (CN = the NATS identity) for mutual TLS.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "kproto.h"
#include "stack.h"

#define CA_DAYS (10 * 365)
#define LEAF_DAYS (2 * 365)

static EVP_PKEY *
new_key(void)
{
    return EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
}

static int
add_ext(X509 *cert, X509 *issuer, int nid, const char *value)
{
    X509V3_CTX ctx;
    X509_EXTENSION *ext;
    int ok;

    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, NULL, NULL, 0);
    ext = X509V3_EXT_conf_nid(NULL, &ctx, nid, value);
    if (!ext)
        return KS_EINVAL;
    ok = X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
    return ok ? 0 : KS_EINTERNAL;
}

/* A certificate for key named cn, valid days from now, with a random
 * serial; issuer NULL: self-signed. Not yet signed. */
static X509 *
new_cert(EVP_PKEY *key, const char *cn, X509 *issuer, int days)
{
    X509 *x = X509_new();
    X509_NAME *name;
    unsigned char serial[16];
    BIGNUM *bn = NULL;

    if (!x || RAND_bytes(serial, sizeof(serial)) != 1)
        goto fail;
    serial[0] &= 0x7f; /* positive */
    if (!(bn = BN_bin2bn(serial, sizeof(serial), NULL)) ||
        !BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) ||
        !X509_set_version(x, 2) ||
        !X509_gmtime_adj(X509_getm_notBefore(x), -3600) ||
        !X509_gmtime_adj(X509_getm_notAfter(x), (long)days * 86400) ||
        !X509_set_pubkey(x, key))
        goto fail;
    name = X509_get_subject_name(x);
    if (!X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                                    (const unsigned char *)"kscore", -1, -1,
                                    0) ||
        !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                                    (const unsigned char *)cn, -1, -1, 0) ||
        !X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer)
                                        : name))
        goto fail;
    BN_free(bn);
    return x;
fail:
    BN_free(bn);
    X509_free(x);
    return NULL;
}

/* Writes data to path with mode (replaced atomically). 0 or -errno. */
static int
write_file(const char *path, const char *data, size_t len, mode_t mode)
{
    char tmp[4300];
    int fd, rc = 0;

    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd == -1)
        return -errno;
    if (fchmod(fd, mode) == -1 || write(fd, data, len) != (ssize_t)len ||
        fsync(fd) == -1)
        rc = errno ? -errno : -EIO;
    if (close(fd) == -1 && rc == 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, path) == -1)
        rc = -errno;
    if (rc)
        unlink(tmp);
    return rc;
}

static char *
bio_text(BIO *b)
{
    char *p, *out;
    long n = BIO_get_mem_data(b, &p);
    if (n < 0 || !(out = malloc((size_t)n + 1)))
        return NULL;
    memcpy(out, p, (size_t)n);
    out[n] = '\0';
    return out;
}

static int
pem_of(X509 *x, EVP_PKEY *k, char **cert_out, char **key_out)
{
    BIO *bc = BIO_new(BIO_s_mem()), *bk = BIO_new(BIO_s_mem());
    int rc = KS_EINTERNAL;

    if (bc && bk && PEM_write_bio_X509(bc, x) &&
        PEM_write_bio_PrivateKey(bk, k, NULL, NULL, 0, NULL, NULL)) {
        *cert_out = bio_text(bc);
        *key_out = bio_text(bk);
        if (*cert_out && *key_out)
            rc = 0;
        else {
            free(*cert_out);
            free(*key_out);
            rc = -ENOMEM;
        }
    }
    BIO_free(bc);
    BIO_free(bk);
    return rc;
}

void
stack_tls_paths(const char *home, struct stack_tls_paths *out)
{
    snprintf(out->dir, sizeof(out->dir), "%s/tls", home);
    snprintf(out->ca_cert, sizeof(out->ca_cert), "%s/tls/ca.pem", home);
    snprintf(out->ca_key, sizeof(out->ca_key), "%s/tls/ca.key", home);
    snprintf(out->server_cert, sizeof(out->server_cert), "%s/tls/server.pem",
             home);
    snprintf(out->server_key, sizeof(out->server_key), "%s/tls/server.key",
             home);
}

int
stack_tls_ca_ensure(const char *home)
{
    struct stack_tls_paths p;
    EVP_PKEY *k = NULL;
    X509 *x = NULL;
    char *cert = NULL, *key = NULL;
    int rc;

    stack_tls_paths(home, &p);
    if (access(p.ca_cert, R_OK) == 0 && access(p.ca_key, R_OK) == 0)
        return 0;
    if ((rc = stack_mkdirs(p.dir, 0700)))
        return rc;
    rc = KS_EINTERNAL;
    if (!(k = new_key()) || !(x = new_cert(k, "kscore CA", NULL, CA_DAYS)))
        goto out;
    if ((rc = add_ext(x, x, NID_basic_constraints, "critical,CA:TRUE")) ||
        (rc = add_ext(x, x, NID_key_usage, "critical,keyCertSign,cRLSign")) ||
        (rc = add_ext(x, x, NID_subject_key_identifier, "hash")))
        goto out;
    rc = KS_EINTERNAL;
    if (!X509_sign(x, k, EVP_sha256()))
        goto out;
    if ((rc = pem_of(x, k, &cert, &key)))
        goto out;
    /* The key first: a ca.pem without its key is never left behind. */
    if ((rc = write_file(p.ca_key, key, strlen(key), 0600)) == 0)
        rc = write_file(p.ca_cert, cert, strlen(cert), 0644);
out:
    if (key)
        OPENSSL_cleanse(key, strlen(key));
    free(key);
    free(cert);
    X509_free(x);
    EVP_PKEY_free(k);
    return rc;
}

static int
load_ca(const char *home, X509 **x_out, EVP_PKEY **k_out)
{
    struct stack_tls_paths p;
    FILE *f;

    stack_tls_paths(home, &p);
    if (!(f = fopen(p.ca_cert, "re")))
        return errno == ENOENT ? KS_ENOTFOUND : -errno;
    *x_out = PEM_read_X509(f, NULL, NULL, NULL);
    fclose(f);
    if (!(f = fopen(p.ca_key, "re"))) {
        X509_free(*x_out);
        return errno == ENOENT ? KS_ENOTFOUND : -errno;
    }
    *k_out = PEM_read_PrivateKey(f, NULL, NULL, NULL);
    fclose(f);
    if (!*x_out || !*k_out) {
        X509_free(*x_out);
        EVP_PKEY_free(*k_out);
        return KS_EINVAL;
    }
    return 0;
}

int
stack_tls_issue(const char *home, const char *cn, const char *const *sans,
                size_t n_sans, char **cert_out, char **key_out)
{
    X509 *ca = NULL, *x = NULL;
    EVP_PKEY *cak = NULL, *k = NULL;
    char *san = NULL;
    size_t slen = 0;
    int rc;

    if ((rc = load_ca(home, &ca, &cak)))
        return rc;
    rc = KS_EINTERNAL;
    if (!(k = new_key()) || !(x = new_cert(k, cn, ca, LEAF_DAYS)))
        goto out;
    if ((rc = add_ext(x, ca, NID_basic_constraints, "CA:FALSE")) ||
        (rc = add_ext(x, ca, NID_key_usage, "critical,digitalSignature")) ||
        (rc = add_ext(x, ca, NID_authority_key_identifier, "keyid")) ||
        (rc = add_ext(x, ca, NID_ext_key_usage,
                      n_sans ? "serverAuth" : "clientAuth")))
        goto out;
    for (size_t i = 0; i < n_sans; i++) {
        unsigned char buf[16];
        /* IP: for addresses, DNS: for names. */
        int ip = inet_pton(AF_INET, sans[i], buf) == 1 ||
                 inet_pton(AF_INET6, sans[i], buf) == 1;
        size_t need = slen + strlen(sans[i]) + 8;
        char *n = realloc(san, need);
        if (!n) {
            rc = -ENOMEM;
            goto out;
        }
        san = n;
        slen += (size_t)snprintf(san + slen, need - slen, "%s%s:%s",
                                 i ? "," : "", ip ? "IP" : "DNS", sans[i]);
    }
    if (san && (rc = add_ext(x, ca, NID_subject_alt_name, san)))
        goto out;
    rc = KS_EINTERNAL;
    if (!X509_sign(x, cak, EVP_sha256()))
        goto out;
    rc = pem_of(x, k, cert_out, key_out);
out:
    free(san);
    X509_free(x);
    X509_free(ca);
    EVP_PKEY_free(k);
    EVP_PKEY_free(cak);
    return rc;
}

int
stack_tls_server_ensure(const char *home, const char *const *hosts,
                        size_t n_hosts)
{
    struct stack_tls_paths p;
    char *cert = NULL, *key = NULL;
    int rc;

    if (n_hosts == 0)
        return KS_EINVAL;
    stack_tls_paths(home, &p);
    if ((rc = stack_tls_ca_ensure(home)) ||
        (rc = stack_tls_issue(home, hosts[0], hosts, n_hosts, &cert, &key)))
        return rc;
    if ((rc = write_file(p.server_key, key, strlen(key), 0600)) == 0)
        rc = write_file(p.server_cert, cert, strlen(cert), 0644);
    OPENSSL_cleanse(key, strlen(key));
    free(key);
    free(cert);
    return rc;
}

int
stack_tls_client_write(const char *home, const char *cn, const char *cert_path,
                       const char *key_path)
{
    char *cert = NULL, *key = NULL;
    int rc = stack_tls_issue(home, cn, NULL, 0, &cert, &key);

    if (rc)
        return rc;
    if ((rc = write_file(key_path, key, strlen(key), 0600)) == 0)
        rc = write_file(cert_path, cert, strlen(cert), 0644);
    OPENSSL_cleanse(key, strlen(key));
    free(key);
    free(cert);
    return rc;
}

int
stack_tls_conf(const char *home, bool verify_clients, char **conf_out)
{
    struct stack_tls_paths p;

    stack_tls_paths(home, &p);
    /* nats-server 2.9: a tls block makes the client port TLS-only (the
     * INFO greeting stays plain, the upgrade follows it). verify: every
     * client must show a certificate from the CA (mutual TLS). */
    if (asprintf(conf_out,
                 "tls {\n  cert_file: \"%s\"\n  key_file: \"%s\"\n"
                 "  ca_file: \"%s\"\n  verify: %s\n  timeout: 5\n}\n",
                 p.server_cert, p.server_key, p.ca_cert,
                 verify_clients ? "true" : "false") < 0)
        return -ENOMEM;
    return 0;
}
