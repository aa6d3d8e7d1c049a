/* Ed25519 signatures over commands, through OpenSSL's EVP interface
 * (one-shot EVP_DigestSign with a NULL digest, as Ed25519 requires:
 * OpenSSL 3 docs, EVP_SIGNATURE-ED25519(7)). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>

#include "events_int.h"

#define MAX_TRUSTED 64

struct evt_signer {
    EVP_PKEY *key;
    char key_id[EVT_KEY_ID_CHARS + 1];
};

struct evt_verifier {
    EVP_PKEY *keys[MAX_TRUSTED];
    char ids[MAX_TRUSTED][EVT_KEY_ID_CHARS + 1];
    size_t n;
};

/* Key id: the first 8 bytes of SHA-256 of the raw public key, in hex. */
static int
key_id_of(EVP_PKEY *k, char out[EVT_KEY_ID_CHARS + 1])
{
    uint8_t raw[32], md[EVP_MAX_MD_SIZE];
    size_t rlen = sizeof(raw);
    unsigned int mdlen = 0;
    if (EVP_PKEY_get_raw_public_key(k, raw, &rlen) != 1 ||
        EVP_Digest(raw, rlen, md, &mdlen, EVP_sha256(), NULL) != 1)
        return KS_EINVAL;
    for (int i = 0; i < EVT_KEY_ID_CHARS / 2; i++)
        snprintf(out + 2 * i, 3, "%02x", md[i]);
    return 0;
}

static int
write_pem(const char *path, mode_t mode, EVP_PKEY *k, int private)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    FILE *f;
    int ok;
    if (fd == -1)
        return -errno;
    f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        return -errno;
    }
    ok = private ? PEM_write_PrivateKey(f, k, NULL, NULL, 0, NULL, NULL)
                 : PEM_write_PUBKEY(f, k);
    if (fclose(f) != 0 || ok != 1) {
        unlink(path);
        return KS_EINTERNAL;
    }
    return 0;
}

int
evt_keygen(const char *priv_path, const char *pub_path)
{
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    EVP_PKEY *k = NULL;
    int rc = KS_EINTERNAL;

    if (!ctx || EVP_PKEY_keygen_init(ctx) != 1 || EVP_PKEY_keygen(ctx, &k) != 1)
        goto out;
    rc = write_pem(priv_path, 0600, k, 1);
    if (rc)
        goto out;
    rc = write_pem(pub_path, 0644, k, 0);
    if (rc)
        unlink(priv_path);
out:
    EVP_PKEY_free(k);
    EVP_PKEY_CTX_free(ctx);
    return rc;
}

/* Reads a PEM key: private if it is one, else public. */
static int
read_key(const char *path, int want_private, EVP_PKEY **out)
{
    FILE *f = fopen(path, "re");
    EVP_PKEY *k = NULL;
    if (!f)
        return -errno;
    k = PEM_read_PrivateKey(f, NULL, NULL, NULL);
    if (!k && !want_private) {
        rewind(f);
        k = PEM_read_PUBKEY(f, NULL, NULL, NULL);
    }
    fclose(f);
    if (!k || EVP_PKEY_get_id(k) != EVP_PKEY_ED25519) {
        EVP_PKEY_free(k);
        return KS_EINVAL;
    }
    *out = k;
    return 0;
}

int
evt_signer_load(const char *priv_path, struct evt_signer **out)
{
    struct evt_signer *s = calloc(1, sizeof(*s));
    int rc;
    if (!s)
        return -ENOMEM;
    rc = read_key(priv_path, 1, &s->key);
    if (rc == 0)
        rc = key_id_of(s->key, s->key_id);
    if (rc) {
        evt_signer_free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void
evt_signer_free(struct evt_signer *s)
{
    if (!s)
        return;
    EVP_PKEY_free(s->key);
    free(s);
}

const char *
evt_signer_key_id(const struct evt_signer *s)
{
    return s->key_id;
}

int
evt_verifier_new(struct evt_verifier **out)
{
    struct evt_verifier *v = calloc(1, sizeof(*v));
    if (!v)
        return -ENOMEM;
    *out = v;
    return 0;
}

void
evt_verifier_free(struct evt_verifier *v)
{
    if (!v)
        return;
    for (size_t i = 0; i < v->n; i++)
        EVP_PKEY_free(v->keys[i]);
    free(v);
}

static int
add_key(struct evt_verifier *v, EVP_PKEY *k)
{
    if (v->n == MAX_TRUSTED) {
        EVP_PKEY_free(k);
        return KS_ETOOBIG;
    }
    if (key_id_of(k, v->ids[v->n]) != 0) {
        EVP_PKEY_free(k);
        return KS_EINVAL;
    }
    v->keys[v->n++] = k;
    return 0;
}

int
evt_verifier_add_file(struct evt_verifier *v, const char *path)
{
    EVP_PKEY *k = NULL;
    int rc = read_key(path, 0, &k);
    return rc ? rc : add_key(v, k);
}

int
evt_verifier_add_signer(struct evt_verifier *v, const struct evt_signer *s)
{
    uint8_t raw[32];
    size_t len = sizeof(raw);
    EVP_PKEY *k;
    if (EVP_PKEY_get_raw_public_key(s->key, raw, &len) != 1)
        return KS_EINTERNAL;
    k = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, raw, len);
    return k ? add_key(v, k) : KS_EINTERNAL;
}

size_t
evt_verifier_count(const struct evt_verifier *v)
{
    return v->n;
}

int
evt_sign(const struct evt_signer *s, const void *data, size_t len,
         uint8_t sig[EVT_SIGNATURE_BYTES])
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    size_t slen = EVT_SIGNATURE_BYTES;
    int ok = md && EVP_DigestSignInit(md, NULL, NULL, NULL, s->key) == 1 &&
             EVP_DigestSign(md, sig, &slen, data, len) == 1 &&
             slen == EVT_SIGNATURE_BYTES;
    EVP_MD_CTX_free(md);
    return ok ? 0 : KS_EINTERNAL;
}

int
evt_verify(const struct evt_verifier *v, const char *key_id,
           const void *data, size_t len, const uint8_t *sig, size_t sig_len)
{
    if (!v || sig_len != EVT_SIGNATURE_BYTES)
        return KS_EREJECTED;
    for (size_t i = 0; i < v->n; i++) {
        if (key_id && key_id[0] && strcmp(key_id, v->ids[i]) != 0)
            continue;
        EVP_MD_CTX *md = EVP_MD_CTX_new();
        int ok = md &&
                 EVP_DigestVerifyInit(md, NULL, NULL, NULL, v->keys[i]) == 1 &&
                 EVP_DigestVerify(md, sig, sig_len, data, len) == 1;
        EVP_MD_CTX_free(md);
        if (ok)
            return 0;
    }
    return KS_EREJECTED;
}

int
evt__sign_command(const struct evt_signer *s, const Ks__Command *cmd,
                  uint8_t **buf_out, size_t *len_out)
{
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    uint8_t sig[EVT_SIGNATURE_BYTES];
    uint8_t *inner = NULL;
    size_t inner_len = 0;
    int rc;

    rc = kproto_pack(&cmd->base, &inner, &inner_len);
    if (rc)
        return rc;
    if (s && (rc = evt_sign(s, inner, inner_len, sig)) != 0) {
        free(inner);
        return rc;
    }
    sc.command.data = inner;
    sc.command.len = inner_len;
    if (s) {
        sc.signature.data = sig;
        sc.signature.len = sizeof(sig);
        sc.key_id = (char *)s->key_id;
    }
    rc = protobuf_c_message_get_packed_size(&sc.base) > KS_MAX_MESSAGE_BYTES
             ? KS_ETOOBIG
             : kproto_pack(&sc.base, buf_out, len_out);
    free(inner);
    return rc;
}

/* ---- label attestations (events.h evt_labels_*) -------------------------- */

static int
cmp_label(const void *x, const void *y)
{
    const Ks__EnvVar *a = *(Ks__EnvVar *const *)x;
    const Ks__EnvVar *b = *(Ks__EnvVar *const *)y;
    int c = strcmp(a->name ? a->name : "", b->name ? b->name : "");
    return c ? c : strcmp(a->value ? a->value : "", b->value ? b->value : "");
}

int
evt_labels_text(const char *agent_id, int64_t enrolled_at_us,
                Ks__EnvVar *const *labels, size_t n, char **out, size_t *len)
{
    Ks__EnvVar **sorted = calloc(n + 1, sizeof(*sorted));
    char *buf = NULL;
    size_t size = 0;
    FILE *f;

    if (!sorted)
        return -ENOMEM;
    if (n)
        memcpy(sorted, labels, n * sizeof(*sorted));
    qsort(sorted, n, sizeof(*sorted), cmp_label);
    if (!(f = open_memstream(&buf, &size))) {
        free(sorted);
        return -ENOMEM;
    }
    fprintf(f, EVT_LABELS_ATTEST_HEADER "agent %zu:%s\nenrolled_at_us %lld\n",
            strlen(agent_id), agent_id, (long long)enrolled_at_us);
    for (size_t i = 0; i < n; i++) {
        const char *k = sorted[i]->name ? sorted[i]->name : "";
        const char *v = sorted[i]->value ? sorted[i]->value : "";
        fprintf(f, "label %zu:%s %zu:%s\n", strlen(k), k, strlen(v), v);
    }
    free(sorted);
    if (fclose(f) != 0 || !buf) {
        free(buf);
        return -ENOMEM;
    }
    *out = buf;
    *len = size;
    return 0;
}

int
evt_labels_sign(const struct evt_signer *s, const char *agent_id,
                int64_t enrolled_at_us, Ks__EnvVar *const *labels, size_t n,
                uint8_t sig[EVT_SIGNATURE_BYTES])
{
    char *text = NULL;
    size_t len = 0;
    int rc = evt_labels_text(agent_id, enrolled_at_us, labels, n, &text, &len);
    if (rc == 0)
        rc = evt_sign(s, text, len, sig);
    free(text);
    return rc;
}

int
evt_labels_verify(const struct evt_verifier *v, const char *key_id,
                  const char *agent_id, int64_t enrolled_at_us,
                  Ks__EnvVar *const *labels, size_t n, const uint8_t *sig,
                  size_t sig_len)
{
    char *text = NULL;
    size_t len = 0;
    int rc;

    if (!agent_id || !sig || sig_len != EVT_SIGNATURE_BYTES)
        return KS_EREJECTED;
    if (evt_labels_text(agent_id, enrolled_at_us, labels, n, &text, &len))
        return KS_EREJECTED;
    rc = evt_verify(v, key_id, text, len, sig, sig_len);
    free(text);
    return rc ? KS_EREJECTED : 0;
}
