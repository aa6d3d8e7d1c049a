/*
 * Sealed boxes (events.h "sealed values"): X25519 (RFC 7748) with a fresh
 * ephemeral key per box, HKDF-SHA256 (RFC 5869) over the shared secret,
 * ChaCha20-Poly1305 (RFC 8439), all through OpenSSL 3's EVP interface
 * (EVP_PKEY-X25519(7), EVP_KDF-HKDF(7) via EVP_PKEY_HKDF,
 * EVP_chacha20_poly1305(3)). Nothing here is home-made cryptography: this
 * file only fixes the format and the key-file handling.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/pem.h>
#include <openssl/rand.h>

#include "events_int.h"

#define NONCE_BYTES 12
#define TAG_BYTES 16
#define HKDF_LABEL "kscore seal v1"
#define ENV_AAD_LABEL "kscore sealed env v1"

struct evt_seal_key {
    EVP_PKEY *key;
    uint8_t pub[EVT_SEAL_KEY_BYTES];
};

static int
key_wrap(EVP_PKEY *k, struct evt_seal_key **out)
{
    struct evt_seal_key *sk;
    size_t len = EVT_SEAL_KEY_BYTES;

    if (EVP_PKEY_get_id(k) != EVP_PKEY_X25519) {
        EVP_PKEY_free(k);
        return KS_EINVAL;
    }
    if (!(sk = calloc(1, sizeof(*sk)))) {
        EVP_PKEY_free(k);
        return -ENOMEM;
    }
    sk->key = k;
    if (EVP_PKEY_get_raw_public_key(k, sk->pub, &len) != 1 ||
        len != EVT_SEAL_KEY_BYTES) {
        evt_seal_key_free(sk);
        return KS_EINTERNAL;
    }
    *out = sk;
    return 0;
}

static EVP_PKEY *
x25519_generate(void)
{
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, NULL);
    EVP_PKEY *k = NULL;
    if (!ctx || EVP_PKEY_keygen_init(ctx) != 1 || EVP_PKEY_keygen(ctx, &k) != 1)
        k = NULL;
    EVP_PKEY_CTX_free(ctx);
    return k;
}

int
evt_seal_key_new(struct evt_seal_key **out)
{
    EVP_PKEY *k = x25519_generate();
    return k ? key_wrap(k, out) : KS_EINTERNAL;
}

int
evt_seal_key_from_raw(const uint8_t priv[EVT_SEAL_KEY_BYTES],
                      struct evt_seal_key **out)
{
    EVP_PKEY *k = EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, NULL, priv,
                                               EVT_SEAL_KEY_BYTES);
    return k ? key_wrap(k, out) : KS_EINVAL;
}

void
evt_seal_key_free(struct evt_seal_key *k)
{
    if (!k)
        return;
    EVP_PKEY_free(k->key);
    free(k);
}

void
evt_seal_key_public(const struct evt_seal_key *k,
                    uint8_t pub[EVT_SEAL_KEY_BYTES])
{
    memcpy(pub, k->pub, EVT_SEAL_KEY_BYTES);
}

static void
set_err(char **errmsg, const char *fmt, const char *path, const char *what)
{
    if (errmsg && asprintf(errmsg, fmt, path, what) < 0)
        *errmsg = NULL;
}

/* Writes a new key to a temporary file beside path and links it into
 * place: link(2) fails with EEXIST when another process was first, and
 * then its key is the one (both load it). */
static int
key_create(const char *path, char **errmsg)
{
    char tmp[4200];
    EVP_PKEY *k = x25519_generate();
    FILE *f = NULL;
    int fd, rc = 0, ok;

    if (!k)
        return KS_EINTERNAL;
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd == -1) {
        rc = -errno;
        set_err(errmsg, "seal key %s: %s", tmp, strerror(-rc));
        goto out;
    }
    if (!(f = fdopen(fd, "w"))) {
        rc = -errno;
        close(fd);
        unlink(tmp);
        goto out;
    }
    ok = PEM_write_PrivateKey(f, k, NULL, NULL, 0, NULL, NULL);
    if (fclose(f) != 0 || ok != 1) {
        unlink(tmp);
        rc = KS_EINTERNAL;
        set_err(errmsg, "seal key %s: %s", tmp, "cannot write");
        goto out;
    }
    if (link(tmp, path) == -1 && errno != EEXIST) {
        rc = -errno;
        set_err(errmsg, "seal key %s: %s", path, strerror(-rc));
    }
    unlink(tmp);
out:
    EVP_PKEY_free(k);
    return rc;
}

int
evt_seal_key_open(const char *path, struct evt_seal_key **out, char **errmsg)
{
    EVP_PKEY *k = NULL;
    struct stat st;
    FILE *f;
    int fd, rc;

    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd == -1 && errno == ENOENT) {
        if ((rc = key_create(path, errmsg)))
            return rc;
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    }
    if (fd == -1) {
        rc = -errno;
        set_err(errmsg, "seal key %s: %s", path, strerror(-rc));
        return rc;
    }
    if (fstat(fd, &st) == -1 || !S_ISREG(st.st_mode) || (st.st_mode & 077)) {
        close(fd);
        set_err(errmsg, "seal key %s: %s", path,
                "not a private file: it must be a regular file of mode "
                "0600 (chmod 600, or remove it to make a new key)");
        return KS_EINVAL;
    }
    if (!(f = fdopen(fd, "r"))) {
        rc = -errno;
        close(fd);
        return rc;
    }
    k = PEM_read_PrivateKey(f, NULL, NULL, NULL);
    fclose(f);
    if (!k || EVP_PKEY_get_id(k) != EVP_PKEY_X25519) {
        EVP_PKEY_free(k);
        set_err(errmsg, "seal key %s: %s", path,
                "not an X25519 private key (PEM)");
        return KS_EINVAL;
    }
    return key_wrap(k, out);
}

/* key = HKDF-SHA256(X25519(priv, peer), info = label || epk || rpk). */
static int
derive_key(EVP_PKEY *priv, EVP_PKEY *peer, const uint8_t epk[32],
           const uint8_t rpk[32], uint8_t key[32])
{
    static const uint8_t zero[32];
    uint8_t shared[32], info[sizeof(HKDF_LABEL) - 1 + 64];
    size_t slen = sizeof(shared), klen = 32;
    EVP_PKEY_CTX *dh = EVP_PKEY_CTX_new(priv, NULL), *kdf = NULL;
    int rc = KS_EINTERNAL;

    if (!dh || EVP_PKEY_derive_init(dh) != 1 ||
        EVP_PKEY_derive_set_peer(dh, peer) != 1)
        goto out;
    if (EVP_PKEY_derive(dh, shared, &slen) != 1 || slen != sizeof(shared) ||
        CRYPTO_memcmp(shared, zero, sizeof(zero)) == 0) {
        /* A low-order public key gives an all-zero secret (RFC 7748
         * section 6.1: "check ... is not all zeros"); OpenSSL refuses it
         * too. Whoever sent it gets no box. */
        rc = KS_EINVAL;
        goto out;
    }
    memcpy(info, HKDF_LABEL, sizeof(HKDF_LABEL) - 1);
    memcpy(info + sizeof(HKDF_LABEL) - 1, epk, 32);
    memcpy(info + sizeof(HKDF_LABEL) - 1 + 32, rpk, 32);
    kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    if (!kdf || EVP_PKEY_derive_init(kdf) != 1 ||
        EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) != 1 ||
        EVP_PKEY_CTX_set1_hkdf_key(kdf, shared, sizeof(shared)) != 1 ||
        EVP_PKEY_CTX_add1_hkdf_info(kdf, info, sizeof(info)) != 1 ||
        EVP_PKEY_derive(kdf, key, &klen) != 1 || klen != 32)
        goto out;
    rc = 0;
out:
    OPENSSL_cleanse(shared, sizeof(shared));
    EVP_PKEY_CTX_free(dh);
    EVP_PKEY_CTX_free(kdf);
    return rc;
}

/* ChaCha20-Poly1305 with aad = version || caller's aad. encrypt: in ->
 * out, tag written; else in -> out checked against tag. 0, KS_EREJECTED
 * (tag mismatch), KS_EINTERNAL. */
static int
aead(bool encrypt, const uint8_t key[32], const uint8_t nonce[NONCE_BYTES],
     const void *aad, size_t aad_len, const uint8_t *in, size_t len,
     uint8_t *out, uint8_t tag[TAG_BYTES])
{
    static const uint8_t version = EVT_SEAL_VERSION;
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    int n = 0, rc = KS_EINTERNAL;

    if (!c || len > INT32_MAX || aad_len > INT32_MAX)
        goto out;
    if (EVP_CipherInit_ex(c, EVP_chacha20_poly1305(), NULL, NULL, NULL,
                          encrypt) != 1 ||
        EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_IVLEN, NONCE_BYTES, NULL) !=
            1 ||
        EVP_CipherInit_ex(c, NULL, NULL, key, nonce, encrypt) != 1 ||
        EVP_CipherUpdate(c, NULL, &n, &version, 1) != 1 ||
        (aad_len && EVP_CipherUpdate(c, NULL, &n, aad, (int)aad_len) != 1) ||
        (len && EVP_CipherUpdate(c, out, &n, in, (int)len) != 1))
        goto out;
    if (encrypt) {
        if (EVP_CipherFinal_ex(c, out + len, &n) != 1 ||
            EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, TAG_BYTES, tag) != 1)
            goto out;
    } else {
        if (EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_TAG, TAG_BYTES, tag) != 1)
            goto out;
        if (EVP_CipherFinal_ex(c, out + len, &n) != 1) {
            rc = KS_EREJECTED;
            goto out;
        }
    }
    rc = 0;
out:
    EVP_CIPHER_CTX_free(c);
    return rc;
}

int
evt_seal(const uint8_t pub[EVT_SEAL_KEY_BYTES], const void *aad, size_t aad_len,
         const void *pt, size_t pt_len, uint8_t **out, size_t *out_len)
{
    EVP_PKEY *peer = NULL, *eph = NULL;
    uint8_t key[32], *box = NULL, *epk, *nonce;
    size_t len = EVT_SEAL_KEY_BYTES;
    int rc;

    if (pt_len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    if (!(box = malloc(pt_len + EVT_SEAL_OVERHEAD)))
        return -ENOMEM;
    epk = box + 1;
    nonce = epk + EVT_SEAL_KEY_BYTES;
    box[0] = EVT_SEAL_VERSION;
    peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, pub,
                                       EVT_SEAL_KEY_BYTES);
    if (!peer) {
        rc = KS_EINVAL;
        goto out;
    }
    rc = KS_EINTERNAL;
    if (!(eph = x25519_generate()) ||
        EVP_PKEY_get_raw_public_key(eph, epk, &len) != 1 ||
        len != EVT_SEAL_KEY_BYTES || RAND_bytes(nonce, NONCE_BYTES) != 1)
        goto out;
    if ((rc = derive_key(eph, peer, epk, pub, key)))
        goto out;
    rc = aead(true, key, nonce, aad, aad_len, pt, pt_len, nonce + NONCE_BYTES,
              nonce + NONCE_BYTES + pt_len);
out:
    OPENSSL_cleanse(key, sizeof(key));
    EVP_PKEY_free(peer);
    EVP_PKEY_free(eph);
    if (rc) {
        free(box);
        return rc;
    }
    *out = box;
    *out_len = pt_len + EVT_SEAL_OVERHEAD;
    return 0;
}

int
evt_unseal(const struct evt_seal_key *k, const void *aad, size_t aad_len,
           const void *box_v, size_t box_len, uint8_t **out, size_t *out_len)
{
    const uint8_t *box = box_v, *epk, *nonce, *ct;
    EVP_PKEY *peer = NULL;
    uint8_t key[32], *pt = NULL;
    size_t len;
    int rc;

    if (!k || box_len < EVT_SEAL_OVERHEAD || box[0] != EVT_SEAL_VERSION ||
        box_len - EVT_SEAL_OVERHEAD > KS_MAX_MESSAGE_BYTES)
        return KS_EREJECTED;
    epk = box + 1;
    nonce = epk + EVT_SEAL_KEY_BYTES;
    ct = nonce + NONCE_BYTES;
    len = box_len - EVT_SEAL_OVERHEAD;
    if (!(pt = malloc(len + 1)))
        return -ENOMEM;
    peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, epk,
                                       EVT_SEAL_KEY_BYTES);
    rc = !peer ? KS_EREJECTED : derive_key(k->key, peer, epk, k->pub, key);
    if (rc == KS_EINVAL)
        rc = KS_EREJECTED; /* a low-order ephemeral key: no box of ours */
    if (rc == 0)
        rc = aead(false, key, nonce, aad, aad_len, ct, len, pt,
                  (uint8_t *)(ct + len));
    OPENSSL_cleanse(key, sizeof(key));
    EVP_PKEY_free(peer);
    if (rc) {
        evt_seal_wipe_free(pt, len + 1);
        return rc;
    }
    pt[len] = '\0';
    *out = pt;
    *out_len = len;
    return 0;
}

void
evt_seal_wipe_free(void *p, size_t len)
{
    if (!p)
        return;
    OPENSSL_cleanse(p, len);
    free(p);
}

/* "kscore sealed env v1" || len16 agent || agent || len16 op || op ||
 * len16 name || name, in a new buffer. */
static int
env_aad(const char *agent_id, const char *operator_name, const char *name,
        uint8_t **out, size_t *out_len)
{
    const char *parts[3] = {agent_id, operator_name, name};
    size_t n = sizeof(ENV_AAD_LABEL) - 1, at;
    uint8_t *a;

    for (int i = 0; i < 3; i++) {
        if (!parts[i] || strlen(parts[i]) > 0xffff)
            return KS_EINVAL;
        n += 2 + strlen(parts[i]);
    }
    if (!(a = malloc(n)))
        return -ENOMEM;
    memcpy(a, ENV_AAD_LABEL, sizeof(ENV_AAD_LABEL) - 1);
    at = sizeof(ENV_AAD_LABEL) - 1;
    for (int i = 0; i < 3; i++) {
        size_t l = strlen(parts[i]);
        a[at++] = (uint8_t)(l >> 8);
        a[at++] = (uint8_t)l;
        memcpy(a + at, parts[i], l);
        at += l;
    }
    *out = a;
    *out_len = n;
    return 0;
}

int
evt_seal_env(const uint8_t pub[EVT_SEAL_KEY_BYTES], const char *agent_id,
             const char *operator_name, const char *name, const char *value,
             uint8_t **out, size_t *out_len)
{
    uint8_t *aad = NULL;
    size_t aad_len = 0;
    int rc;

    if (!value || strlen(value) > EVT_SEAL_ENV_VALUE_MAX || !name || !name[0])
        return KS_EINVAL;
    if ((rc = env_aad(agent_id, operator_name, name, &aad, &aad_len)))
        return rc;
    rc = evt_seal(pub, aad, aad_len, value, strlen(value), out, out_len);
    free(aad);
    return rc;
}

int
evt_unseal_env(const struct evt_seal_key *k, const char *agent_id,
               const char *operator_name, const char *name, const void *box,
               size_t box_len, char **value_out)
{
    uint8_t *aad = NULL, *pt = NULL;
    size_t aad_len = 0, len = 0;
    int rc;

    if ((rc = env_aad(agent_id, operator_name, name, &aad, &aad_len)))
        return rc == KS_EINVAL ? KS_EREJECTED : rc;
    rc = evt_unseal(k, aad, aad_len, box, box_len, &pt, &len);
    free(aad);
    if (rc)
        return rc;
    /* Sealed by whoever had the public key: a value the child could not
     * get whole (a NUL cuts it) is refused, not cut. */
    if (len > EVT_SEAL_ENV_VALUE_MAX || memchr(pt, '\0', len)) {
        evt_seal_wipe_free(pt, len + 1);
        return KS_EREJECTED;
    }
    *value_out = (char *)pt;
    return 0;
}
