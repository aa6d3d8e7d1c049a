/*
 * nkey.c: NATS NKeys (Ed25519 keys in NATS' text form) made with OpenSSL.
 *
 * The NKeys format (github.com/nats-io/nkeys, strkey.go): base32 (RFC 4648
 * alphabet, no padding) of prefix byte(s) + the 32 key bytes + CRC-16/XMODEM
 * of those bytes, little-endian. A user public key has the prefix byte
 * 20 << 3 ('U'); a user seed has two: 18 << 3 | (20 << 3) >> 5 and
 * ((20 << 3) & 31) << 3 ("SU"), then the 32-byte Ed25519 seed (what
 * OpenSSL calls the raw private key). nats-server checks a signature of its
 * nonce against the public key in its config; nats.c signs with the seed.
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

#include "events_int.h"

#define PREFIX_SEED (18 << 3)
#define PREFIX_USER (20 << 3)

static const char b32[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/* CRC-16/XMODEM: polynomial 0x1021, initial value 0, no reflection. */
static uint16_t
crc16(const uint8_t *p, size_t n)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021)
                               : (uint16_t)(crc << 1);
    }
    return crc;
}

/* Base32 without padding of n bytes into out (room for ceil(n*8/5)+1). */
static void
b32_encode(const uint8_t *p, size_t n, char *out)
{
    uint32_t acc = 0;
    int bits = 0;
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        acc = (acc << 8) | p[i];
        bits += 8;
        while (bits >= 5) {
            out[j++] = b32[(acc >> (bits - 5)) & 31];
            bits -= 5;
        }
    }
    if (bits > 0)
        out[j++] = b32[(acc << (5 - bits)) & 31];
    out[j] = '\0';
}

/* Decodes exactly `chars` characters of base32 into n bytes; KS_EINVAL on a
 * character outside the alphabet or a length that does not fit. */
static int
b32_decode(const char *s, size_t chars, uint8_t *out, size_t n)
{
    uint32_t acc = 0;
    int bits = 0;
    size_t j = 0;
    if ((chars * 5) / 8 != n)
        return KS_EINVAL;
    for (size_t i = 0; i < chars; i++) {
        const char *c = s[i] ? strchr(b32, s[i]) : NULL;
        if (!c)
            return KS_EINVAL;
        acc = (acc << 5) | (uint32_t)(c - b32);
        bits += 5;
        if (bits >= 8) {
            out[j++] = (uint8_t)(acc >> (bits - 8));
            bits -= 8;
        }
    }
    /* The unused low bits of the last character must be zero. */
    if (bits > 0 && (acc & ((1u << bits) - 1)) != 0)
        return KS_EINVAL;
    return j == n ? 0 : KS_EINVAL;
}

/* prefix (plen bytes) + key (32) + crc into out (text). */
static void
encode(const uint8_t *prefix, size_t plen, const uint8_t key[32], char *out)
{
    uint8_t raw[2 + 32 + 2];
    uint16_t crc;
    memcpy(raw, prefix, plen);
    memcpy(raw + plen, key, 32);
    crc = crc16(raw, plen + 32);
    raw[plen + 32] = (uint8_t)(crc & 0xff);
    raw[plen + 33] = (uint8_t)(crc >> 8);
    b32_encode(raw, plen + 34, out);
    OPENSSL_cleanse(raw, sizeof(raw));
}

static int
decode(const char *text, size_t chars, const uint8_t *prefix, size_t plen,
       uint8_t key_out[32])
{
    uint8_t raw[2 + 32 + 2];
    int rc = KS_EINVAL;
    if (!text || strlen(text) != chars ||
        b32_decode(text, chars, raw, plen + 34) != 0)
        goto out;
    if (memcmp(raw, prefix, plen) != 0)
        goto out;
    if (crc16(raw, plen + 32) !=
        (uint16_t)(raw[plen + 32] | (uint16_t)raw[plen + 33] << 8))
        goto out;
    memcpy(key_out, raw + plen, 32);
    rc = 0;
out:
    OPENSSL_cleanse(raw, sizeof(raw));
    return rc;
}

static const uint8_t seed_prefix[2] = {PREFIX_SEED | (PREFIX_USER >> 5),
                                       (PREFIX_USER & 31) << 3};
static const uint8_t user_prefix[1] = {PREFIX_USER};

void
evt_nkey_encode_public(const uint8_t raw[32],
                       char out[EVT_NKEY_PUBLIC_CHARS + 1])
{
    encode(user_prefix, 1, raw, out);
}

void
evt_nkey_encode_seed(const uint8_t seed[32], char out[EVT_NKEY_SEED_CHARS + 1])
{
    encode(seed_prefix, 2, seed, out);
}

int
evt_nkey_decode_public(const char *text, uint8_t raw_out[32])
{
    return decode(text, EVT_NKEY_PUBLIC_CHARS, user_prefix, 1, raw_out);
}

int
evt_nkey_decode_seed(const char *text, uint8_t seed_out[32])
{
    return decode(text, EVT_NKEY_SEED_CHARS, seed_prefix, 2, seed_out);
}

int
evt_nkey_public_of_seed(const char *seed_text,
                        char pub_out[EVT_NKEY_PUBLIC_CHARS + 1])
{
    uint8_t seed[32], pub[32];
    size_t plen = sizeof(pub);
    EVP_PKEY *k = NULL;
    int rc = evt_nkey_decode_seed(seed_text, seed);

    if (rc)
        return rc;
    k = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, 32);
    OPENSSL_cleanse(seed, sizeof(seed));
    if (!k || EVP_PKEY_get_raw_public_key(k, pub, &plen) != 1 || plen != 32) {
        EVP_PKEY_free(k);
        return KS_EINTERNAL;
    }
    EVP_PKEY_free(k);
    evt_nkey_encode_public(pub, pub_out);
    return 0;
}

int
evt_nkey_generate(char seed_out[EVT_NKEY_SEED_CHARS + 1],
                  char pub_out[EVT_NKEY_PUBLIC_CHARS + 1])
{
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    EVP_PKEY *k = NULL;
    uint8_t seed[32], pub[32];
    size_t slen = sizeof(seed), plen = sizeof(pub);
    int rc = KS_EINTERNAL;

    if (!ctx || EVP_PKEY_keygen_init(ctx) != 1 ||
        EVP_PKEY_keygen(ctx, &k) != 1 ||
        EVP_PKEY_get_raw_private_key(k, seed, &slen) != 1 || slen != 32 ||
        EVP_PKEY_get_raw_public_key(k, pub, &plen) != 1 || plen != 32)
        goto out;
    evt_nkey_encode_seed(seed, seed_out);
    evt_nkey_encode_public(pub, pub_out);
    rc = 0;
out:
    OPENSSL_cleanse(seed, sizeof(seed));
    EVP_PKEY_free(k);
    EVP_PKEY_CTX_free(ctx);
    return rc;
}

int
evt_identity_valid(const char *name)
{
    return evt__token_ok(name, EVT_IDENTITY_MAX);
}

#define IDENTITY_LINE "# kscore NATS identity: "

int
evt_nkey_write_seed(const char *path, const char *identity,
                    const char *seed_text)
{
    char pub[EVT_NKEY_PUBLIC_CHARS + 1];
    FILE *f;
    int fd, rc;

    if (!evt_identity_valid(identity))
        return KS_EINVAL;
    if ((rc = evt_nkey_public_of_seed(seed_text, pub)))
        return rc;
    /* O_EXCL: never replace someone's credential by accident. */
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd == -1)
        return -errno;
    /* The umask may not take bits away from 0600, but make sure. */
    if (fchmod(fd, 0600) == -1 || !(f = fdopen(fd, "w"))) {
        rc = -errno;
        close(fd);
        unlink(path);
        return rc;
    }
    /* nats.c reads the first line that starts with "SU" as the seed
     * (src/conn.c, _getJwtOrSeed); the comments name the identity for
     * kscore, which must put that name in the subjects it uses. */
    fprintf(f,
            IDENTITY_LINE
            "%s\n"
            "# public key: %s\n"
            "# Whoever holds this file connects as %s: keep it private "
            "(0600).\n"
            "%s\n",
            identity, pub, identity, seed_text);
    if (fclose(f) != 0) {
        rc = -errno;
        unlink(path);
        return rc;
    }
    return 0;
}

int
evt_nkey_read_seed(const char *path, char seed_out[EVT_NKEY_SEED_CHARS + 1],
                   char pub_out[EVT_NKEY_PUBLIC_CHARS + 1],
                   char identity_out[EVT_IDENTITY_MAX + 1])
{
    char line[256], seed[EVT_NKEY_SEED_CHARS + 1] = "",
                                               id[EVT_IDENTITY_MAX + 1] = "";
    FILE *f = fopen(path, "re");
    int rc;

    if (!f)
        return -errno;
    while (fgets(line, sizeof(line), f)) {
        char *p = line;
        p[strcspn(p, "\r\n")] = '\0';
        while (*p == ' ' || *p == '\t')
            p++;
        if (strncmp(p, IDENTITY_LINE, strlen(IDENTITY_LINE)) == 0 && !id[0]) {
            const char *v = p + strlen(IDENTITY_LINE);
            if (evt_identity_valid(v))
                snprintf(id, sizeof(id), "%s", v);
        } else if (p[0] == 'S' && p[1] == 'U' && !seed[0]) {
            /* As nats.c does: the first "SU..." line is the seed. */
            size_t n = strcspn(p, " \t");
            if (n == EVT_NKEY_SEED_CHARS) {
                memcpy(seed, p, n);
                seed[n] = '\0';
            } else {
                seed[0] = '?'; /* a seed line that cannot be one */
            }
        }
    }
    OPENSSL_cleanse(line, sizeof(line));
    fclose(f);
    rc = seed[0] ? evt_nkey_public_of_seed(seed, pub_out) : KS_EINVAL;
    if (rc == 0) {
        memcpy(seed_out, seed, sizeof(seed));
        snprintf(identity_out, EVT_IDENTITY_MAX + 1, "%s", id);
    }
    OPENSSL_cleanse(seed, sizeof(seed));
    return rc;
}
