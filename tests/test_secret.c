/*
 * Secret variables (kscore exec/batch --secret-env): the seal API
 * (events/seal.c) against known answers and tampering, the broker's field
 * rules, and on a real secure stack: the child gets the value, and the
 * value is nowhere else: not in any PostgreSQL table, not in KSCORE_CMDS
 * (every command message as published, and what the stream still holds),
 * KSCORE_EVENTS or the registry bucket, not in any file of the stack (the
 * logs, the JetStream store, the PostgreSQL data directory, the agents'
 * state); get/events show it redacted; a changed or misused box makes the
 * agent refuse to run the command.
 *
 * The children print a SHA-256 of the value, never the value: a child's
 * output is recorded like any other (kscore does not scrub it).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <libpq-fe.h>
#include <openssl/evp.h>

#include "broker.h"
#include "events.h"
#include "fixture.h"
#include "store.h"

#define AGENT "sec1"
#define OPERATOR "alice"

static struct fixture_stack stack;
static char local_agent[96]; /* the broker's in-process agent */
static char tmpdir[PATH_MAX];

/* ---- helpers --------------------------------------------------------------
 */

static size_t
unhex(const char *h, uint8_t *out, size_t cap)
{
    size_t n = 0;
    for (; h[0] && h[1] && n < cap; h += 2) {
        unsigned v;
        sscanf(h, "%2x", &v);
        out[n++] = (uint8_t)v;
    }
    return n;
}

static void
tohex(const uint8_t *p, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", p[i]);
    out[2 * n] = '\0';
}

/* "<sha256 hex>  -\n", as sha256sum prints it for stdin. */
static void
sha256_line(const char *value, char out[160])
{
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    char hex[2 * EVP_MAX_MD_SIZE + 1];
    ck_assert(EVP_Digest(value, strlen(value), md, &len, EVP_sha256(), NULL));
    tohex(md, len, hex);
    snprintf(out, 160, "%s  -\n", hex);
}

/*
 * 16 random bytes as hex, straight from getrandom: ks_uuid draws from a
 * per-thread pool that a fork inherits, so two Check tests (each a fork
 * of the runner) would get the same "fresh" ids.
 */
static void
fresh_id(char out[37])
{
    uint8_t r[16];
    ck_assert_int_eq(getrandom(r, sizeof(r), 0), (ssize_t)sizeof(r));
    tohex(r, sizeof(r), out);
}

/* A value nothing else contains. */
static void
fresh_value(char out[64])
{
    char id[37];
    fresh_id(id);
    snprintf(out, 64, "kscore-secret %s!", id);
}

/* Runs kscore with NAME=value in its environment only. */
static void
kscore_with(const char *name, const char *value, const char *const args[],
            struct fixture_out *o)
{
    if (name)
        setenv(name, value, 1);
    ck_assert_int_eq(fixture_kscore(&stack, args, o), 0);
    if (name)
        unsetenv(name);
}

static struct evt_conn *
connect_as(const char *seed_file)
{
    struct evt_connect_opts o = {.name = "secret-test",
                                 .nkey_file = seed_file,
                                 .timeout_ms = 2000,
                                 .send_asap = true};
    struct evt_conn *c = NULL;
    ck_assert_int_eq(evt_connect(stack.nats.url, &o, &c, NULL), 0);
    return c;
}

/* The seal key agent_id publishes (through the broker's agents API). */
static void
agent_key(struct evt_conn *c, const char *agent_id,
          uint8_t pub[EVT_SEAL_KEY_BYTES])
{
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    Ks__AgentsReply *rep = NULL;
    bool found = false;
    ck_assert_int_eq(broker_call(c, EVT_API_AGENTS, &req.base,
                                 &ks__agents_reply__descriptor, 5000,
                                 (ProtobufCMessage **)&rep),
                     0);
    for (size_t i = 0; i < rep->n_agents; i++)
        if (strcmp(rep->agents[i]->info->agent_id, agent_id) == 0) {
            ck_assert_uint_eq(rep->agents[i]->info->seal_key.len,
                              EVT_SEAL_KEY_BYTES);
            memcpy(pub, rep->agents[i]->info->seal_key.data,
                   EVT_SEAL_KEY_BYTES);
            found = true;
        }
    ks__agents_reply__free_unpacked(rep, NULL);
    ck_assert_msg(found, "agent %s not listed", agent_id);
}

/* ---- every command message as published (core subscription) ------------- */

/*
 * KSCORE_CMDS is a work queue: a message is gone once its agent acks it,
 * and a second consumer may not overlap an agent's. So the broker user
 * hears every publish on kscore.cmd.> (the same bytes JetStream stores),
 * and the stream's leftovers are read by sequence (scan_stream).
 */
struct capture {
    pthread_mutex_t mu;
    uint8_t *buf;
    size_t len, cap;
    unsigned msgs;
    /* The sealed boxes seen in the captured commands, hex. */
    char boxes[16][2 * 512 + 1];
    unsigned n_boxes;
    natsSubscription *sub;
    struct evt_conn *c;
    /* Every event published while capturing (kscore.evt.>), whole:
     * KSCORE_EVENTS keeps an event only until it is recorded. */
    natsSubscription *evsub;
    uint8_t *ebuf;
    size_t elen, ecap;
    unsigned events;
};

static void
on_cmd(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct capture *cp = ud;
    const uint8_t *d = (const uint8_t *)natsMsg_GetData(msg);
    size_t n = (size_t)natsMsg_GetDataLength(msg);
    ProtobufCMessage *pm = NULL, *inner = NULL;
    (void)nc;
    (void)sub;
    pthread_mutex_lock(&cp->mu);
    if (cp->len + n > cp->cap) {
        cp->cap = (cp->len + n) * 2;
        cp->buf = realloc(cp->buf, cp->cap);
    }
    memcpy(cp->buf + cp->len, d, n);
    cp->len += n;
    cp->msgs++;
    if (evt_unpack(&ks__signed_command__descriptor, d, n, &pm) == 0) {
        Ks__SignedCommand *sc = (Ks__SignedCommand *)pm;
        if (evt_unpack(&ks__command__descriptor, sc->command.data,
                       sc->command.len, &inner) == 0) {
            Ks__Command *cmd = (Ks__Command *)inner;
            for (size_t i = 0;
                 cmd->spec && i < cmd->spec->n_sealed_env && cp->n_boxes < 16;
                 i++) {
                ProtobufCBinaryData *b = &cmd->spec->sealed_env[i]->sealed;
                if (b->len <= 512)
                    tohex(b->data, b->len, cp->boxes[cp->n_boxes++]);
            }
            ks__command__free_unpacked(cmd, NULL);
        }
        ks__signed_command__free_unpacked(sc, NULL);
    }
    pthread_mutex_unlock(&cp->mu);
    natsMsg_Destroy(msg);
}

static void
on_evt(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct capture *cp = ud;
    size_t n = (size_t)natsMsg_GetDataLength(msg);
    (void)nc;
    (void)sub;
    pthread_mutex_lock(&cp->mu);
    if (cp->elen + n > cp->ecap) {
        cp->ecap = (cp->elen + n) * 2;
        cp->ebuf = realloc(cp->ebuf, cp->ecap);
        ck_assert_ptr_nonnull(cp->ebuf);
    }
    memcpy(cp->ebuf + cp->elen, natsMsg_GetData(msg), n);
    cp->elen += n;
    cp->events++;
    pthread_mutex_unlock(&cp->mu);
    natsMsg_Destroy(msg);
}

static void
capture_start(struct capture *cp)
{
    memset(cp, 0, sizeof(*cp));
    pthread_mutex_init(&cp->mu, NULL);
    cp->c = connect_as(stack.broker_seed);
    ck_assert_int_eq(natsConnection_Subscribe(&cp->sub, cp->c->nc,
                                              "kscore.cmd.>", on_cmd, cp),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Subscribe(&cp->evsub, cp->c->nc,
                                              "kscore.evt.>", on_evt, cp),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Flush(cp->c->nc), NATS_OK);
}

static void
capture_stop(struct capture *cp)
{
    natsConnection_Flush(cp->c->nc);
    natsSubscription_Unsubscribe(cp->sub);
    natsSubscription_Destroy(cp->sub);
    natsSubscription_Unsubscribe(cp->evsub);
    natsSubscription_Destroy(cp->evsub);
    free(cp->ebuf);
    evt_close(cp->c);
    free(cp->buf);
    pthread_mutex_destroy(&cp->mu);
}

/* Every message a stream still holds, read by sequence as the broker user.
 * Returns how many were read; fails if one contains needle. */
static unsigned
scan_stream(struct evt_conn *c, const char *stream, const char *needle)
{
    jsStreamInfo *si = NULL;
    unsigned n = 0;
    ck_assert_int_eq(js_GetStreamInfo(&si, c->js, stream, NULL, NULL), NATS_OK);
    uint64_t first = si->State.FirstSeq, last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    for (uint64_t seq = first; seq && seq <= last; seq++) {
        natsMsg *m = NULL;
        if (js_GetMsg(&m, c->js, stream, seq, NULL, NULL) != NATS_OK)
            continue; /* deleted (acked work) */
        ck_assert_msg(
            !memmem(natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m),
                    needle, strlen(needle)),
            "the value is in %s message %llu", stream, (unsigned long long)seq);
        natsMsg_Destroy(m);
        n++;
    }
    return n;
}

/* ---- files and tables --------------------------------------------------- */

static const char *scan_needle;
static unsigned scan_files, scan_hit;
static char scan_hit_path[PATH_MAX];

static int
scan_one(const char *path, const struct stat *st, int flag, struct FTW *f)
{
    (void)f;
    if (flag != FTW_F || !S_ISREG(st->st_mode) || st->st_size == 0 ||
        st->st_size > 256 * 1024 * 1024)
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd == -1)
        return 0;
    char *buf = malloc((size_t)st->st_size);
    ssize_t r = buf ? read(fd, buf, (size_t)st->st_size) : -1;
    close(fd);
    if (r > 0) {
        scan_files++;
        if (memmem(buf, (size_t)r, scan_needle, strlen(scan_needle)) &&
            !scan_hit++)
            snprintf(scan_hit_path, sizeof(scan_hit_path), "%s", path);
    }
    free(buf);
    return 0;
}

/* No file of the stack holds needle: logs, the JetStream store, the
 * PostgreSQL data directory, the agents' state dirs. */
static void
assert_not_in_files(const char *needle)
{
    const char *dirs[] = {stack.dir, stack.nats.dir, stack.pg.dir};
    scan_needle = needle;
    scan_files = scan_hit = 0;
    for (size_t i = 0; i < 3; i++)
        nftw(dirs[i], scan_one, 32, FTW_PHYS);
    ck_assert_msg(scan_files > 10, "scanned only %u files", scan_files);
    ck_assert_msg(scan_hit == 0, "the value is in %u file(s), e.g. %s",
                  scan_hit, scan_hit_path);
}

/* Rows of every table in the record whose text holds needle (as text, or
 * as the hex that a bytea column shows). */
static long
rows_with(const char *needle_text, const char *needle_hex)
{
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    ck_assert_int_eq(PQstatus(pg), CONNECTION_OK);
    PGresult *t = PQexec(pg, "SELECT table_name FROM information_schema."
                             "tables WHERE table_schema = 'public' AND "
                             "table_type = 'BASE TABLE'");
    ck_assert_int_eq(PQresultStatus(t), PGRES_TUPLES_OK);
    ck_assert_int_ge(PQntuples(t), 3);
    long total = 0;
    for (int i = 0; i < PQntuples(t); i++) {
        char sql[512];
        const char *params[2] = {needle_text, needle_hex};
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM public.\"%s\" x WHERE "
                 "strpos(x::text, $1) > 0 OR strpos(x::text, $2) > 0",
                 PQgetvalue(t, i, 0));
        PGresult *r = PQexecParams(pg, sql, 2, NULL, params, NULL, NULL, 0);
        ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql,
                      PQerrorMessage(pg));
        total += atol(PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    PQclear(t);
    PQfinish(pg);
    return total;
}

/*
 * The value is nowhere but in the child: not in the record, not in NATS,
 * not in any file. And the checks can see: the sealed boxes the captured
 * commands carried are found in the record (inside bytea) by the same
 * query.
 */
static void
assert_nowhere(struct capture *cp, const char *value)
{
    char hex[256];
    tohex((const uint8_t *)value, strlen(value), hex);
    natsConnection_Flush(cp->c->nc);
    pthread_mutex_lock(&cp->mu);
    ck_assert_uint_ge(cp->msgs, 1);
    ck_assert_uint_ge(cp->n_boxes, 1);
    ck_assert_msg(!memmem(cp->buf, cp->len, value, strlen(value)),
                  "the value is in a command published on KSCORE_CMDS");
    ck_assert_int_ge(rows_with(cp->boxes[0], cp->boxes[0]), 1);
    pthread_mutex_unlock(&cp->mu);
    ck_assert_int_eq(rows_with(value, hex), 0);
    scan_stream(cp->c, EVT_STREAM_CMDS, value);
    scan_stream(cp->c, EVT_STREAM_EVENTS, value);
    pthread_mutex_lock(&cp->mu);
    ck_assert_uint_ge(cp->events, 1);
    ck_assert_msg(!memmem(cp->ebuf, cp->elen, value, strlen(value)),
                  "the value is in an event published to KSCORE_EVENTS");
    pthread_mutex_unlock(&cp->mu);
    scan_stream(cp->c, "KV_" EVT_KV_AGENTS, value);
    assert_not_in_files(value);
}

/* ---- the seal API ----------------------------------------------------------
 */

/*
 * Known answers. The keys are RFC 7748 section 6.1's (Alice's as the
 * ephemeral key, Bob's as the recipient). The boxes were made by an
 * independent implementation of the format in events.h (Python's
 * `cryptography` 48: X25519, HKDF(SHA256, salt None, info "kscore seal v1"
 * || epk || rpk), ChaCha20Poly1305 with aad 0x01 || aad) with nonce
 * 000102...0b, so they pin the format, not just our own round trip.
 */
static const char bob_priv[] =
    "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb";
static const char bob_pub[] =
    "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f";
static const char alice_priv[] =
    "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a";
static const char alice_pub[] =
    "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a";
/* aad "kscore test aad", value "attack at dawn" */
static const char kat_box[] =
    "018520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a00"
    "0102030405060708090a0b2f983b97a28fdc0a22e205bb62f5e062793ce6347e1bea"
    "f6c6db2ce787fc";
/* evt_seal_env: agent "agent-1", operator "alice", name "TOKEN", value
 * "s3cr3t-value" */
static const char kat_env_box[] =
    "018520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a00"
    "0102030405060708090a0b3ddf2c84f290d11d37ae14bf3ed67a02bc272bc6c2ab0b"
    "9ea29203bd";

static struct evt_seal_key *
key_of(const char *hex)
{
    uint8_t raw[32];
    struct evt_seal_key *k = NULL;
    ck_assert_uint_eq(unhex(hex, raw, sizeof(raw)), 32);
    ck_assert_int_eq(evt_seal_key_from_raw(raw, &k), 0);
    return k;
}

START_TEST(seal_known_answers)
{
    struct evt_seal_key *bob = key_of(bob_priv), *alice = key_of(alice_priv);
    uint8_t pub[32], want[32], box[128], *pt = NULL;
    size_t n, len = 0;
    char *v = NULL;

    evt_seal_key_public(bob, pub);
    unhex(bob_pub, want, sizeof(want));
    ck_assert_mem_eq(pub, want, 32);
    evt_seal_key_public(alice, pub);
    unhex(alice_pub, want, sizeof(want));
    ck_assert_mem_eq(pub, want, 32);

    n = unhex(kat_box, box, sizeof(box));
    ck_assert_uint_eq(n, strlen("attack at dawn") + EVT_SEAL_OVERHEAD);
    ck_assert_int_eq(evt_unseal(bob, "kscore test aad", 15, box, n, &pt, &len),
                     0);
    ck_assert_uint_eq(len, 14);
    ck_assert_mem_eq(pt, "attack at dawn", 14);
    ck_assert_int_eq(pt[len], '\0');
    evt_seal_wipe_free(pt, len);

    n = unhex(kat_env_box, box, sizeof(box));
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-1", "alice", "TOKEN", box, n, &v), 0);
    ck_assert_str_eq(v, "s3cr3t-value");
    evt_seal_wipe_free(v, strlen(v));
    /* The ephemeral key's holder is not the recipient. */
    ck_assert_int_eq(
        evt_unseal_env(alice, "agent-1", "alice", "TOKEN", box, n, &v),
        KS_EREJECTED);
    evt_seal_key_free(bob);
    evt_seal_key_free(alice);
}
END_TEST

START_TEST(seal_tampering_fails)
{
    struct evt_seal_key *bob = key_of(bob_priv);
    uint8_t box[128], *pt = NULL;
    size_t n = unhex(kat_box, box, sizeof(box)), len;
    char *v = NULL;

    /* Every byte, every bit position class: version, key, nonce, text,
     * tag. */
    for (size_t i = 0; i < n; i++)
        for (int bit = 0; bit < 8; bit += 3) {
            box[i] ^= (uint8_t)(1u << bit);
            ck_assert_msg(evt_unseal(bob, "kscore test aad", 15, box, n, &pt,
                                     &len) == KS_EREJECTED,
                          "flipped bit %d of byte %zu opened", bit, i);
            box[i] ^= (uint8_t)(1u << bit);
        }
    for (size_t cut = 0; cut < n; cut++)
        ck_assert_int_eq(
            evt_unseal(bob, "kscore test aad", 15, box, cut, &pt, &len),
            KS_EREJECTED);
    ck_assert_int_eq(evt_unseal(bob, "kscore test aae", 15, box, n, &pt, &len),
                     KS_EREJECTED);
    ck_assert_int_eq(evt_unseal(bob, NULL, 0, box, n, &pt, &len), KS_EREJECTED);
    /* Untouched, it still opens. */
    ck_assert_int_eq(evt_unseal(bob, "kscore test aad", 15, box, n, &pt, &len),
                     0);
    evt_seal_wipe_free(pt, len);

    /* An env box opens for its agent, operator and name only. */
    n = unhex(kat_env_box, box, sizeof(box));
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-2", "alice", "TOKEN", box, n, &v),
        KS_EREJECTED);
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-1", "mallory", "TOKEN", box, n, &v),
        KS_EREJECTED);
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-1", "alice", "OTHER", box, n, &v),
        KS_EREJECTED);
    /* Lengths delimit the fields: moving a byte between them fails. */
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-1a", "lice", "TOKEN", box, n, &v),
        KS_EREJECTED);
    box[40] ^= 1;
    ck_assert_int_eq(
        evt_unseal_env(bob, "agent-1", "alice", "TOKEN", box, n, &v),
        KS_EREJECTED);
    evt_seal_key_free(bob);
}
END_TEST

START_TEST(seal_round_trips)
{
    struct evt_seal_key *k = NULL, *other = NULL;
    uint8_t pub[32], *a = NULL, *b = NULL, *pt = NULL;
    size_t alen, blen, len;
    static const size_t sizes[] = {0, 1, 15, 16, 17, 1000, 64 * 1024 + 3};
    char *big = malloc(EVT_SEAL_ENV_VALUE_MAX + 2), *v = NULL;

    ck_assert_int_eq(evt_seal_key_new(&k), 0);
    ck_assert_int_eq(evt_seal_key_new(&other), 0);
    evt_seal_key_public(k, pub);
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint8_t *in = malloc(sizes[i] + 1);
        for (size_t j = 0; j < sizes[i]; j++)
            in[j] = (uint8_t)(j * 7 + i);
        ck_assert_int_eq(evt_seal(pub, "x", 1, in, sizes[i], &a, &alen), 0);
        ck_assert_uint_eq(alen, sizes[i] + EVT_SEAL_OVERHEAD);
        ck_assert_int_eq(evt_unseal(k, "x", 1, a, alen, &pt, &len), 0);
        ck_assert_uint_eq(len, sizes[i]);
        ck_assert(len == 0 || memcmp(pt, in, len) == 0);
        evt_seal_wipe_free(pt, len);
        ck_assert_int_eq(evt_unseal(other, "x", 1, a, alen, &pt, &len),
                         KS_EREJECTED);
        free(a);
        free(in);
    }
    /* A fresh ephemeral key and nonce every time. */
    ck_assert_int_eq(evt_seal(pub, NULL, 0, "same", 4, &a, &alen), 0);
    ck_assert_int_eq(evt_seal(pub, NULL, 0, "same", 4, &b, &blen), 0);
    ck_assert_uint_eq(alen, blen);
    ck_assert(memcmp(a, b, alen) != 0);
    ck_assert(memcmp(a + 1, b + 1, 32) != 0);
    free(a);
    free(b);
    /* The largest env value, and one byte more. */
    memset(big, 'v', EVT_SEAL_ENV_VALUE_MAX);
    big[EVT_SEAL_ENV_VALUE_MAX] = '\0';
    ck_assert_int_eq(evt_seal_env(pub, "a", "op", "N", big, &a, &alen), 0);
    ck_assert_int_eq(evt_unseal_env(k, "a", "op", "N", a, alen, &v), 0);
    ck_assert_uint_eq(strlen(v), EVT_SEAL_ENV_VALUE_MAX);
    evt_seal_wipe_free(v, strlen(v));
    free(a);
    big[EVT_SEAL_ENV_VALUE_MAX] = 'v';
    big[EVT_SEAL_ENV_VALUE_MAX + 1] = '\0';
    ck_assert_int_eq(evt_seal_env(pub, "a", "op", "N", big, &a, &alen),
                     KS_EINVAL);
    /* A value with a NUL (sealed with the raw API by whoever has the
     * public key) is refused, not cut. */
    uint8_t aad[64] = "kscore sealed env v1\0\1a\0\2op\0\1N";
    ck_assert_int_eq(evt_seal(pub, aad, 20 + 3 + 4 + 3, "ab\0cd", 5, &a, &alen),
                     0);
    ck_assert_int_eq(evt_unseal_env(k, "a", "op", "N", a, alen, &v),
                     KS_EREJECTED);
    free(a);
    /* The same layout without the NUL opens: the aad above is right. */
    ck_assert_int_eq(evt_seal(pub, aad, 20 + 3 + 4 + 3, "abcd", 4, &a, &alen),
                     0);
    ck_assert_int_eq(evt_unseal_env(k, "a", "op", "N", a, alen, &v), 0);
    ck_assert_str_eq(v, "abcd");
    evt_seal_wipe_free(v, 4);
    free(a);
    /* A low-order public key (all zeros) gets no box. */
    memset(pub, 0, sizeof(pub));
    ck_assert_int_eq(evt_seal(pub, NULL, 0, "x", 1, &a, &alen), KS_EINVAL);
    free(big);
    evt_seal_key_free(k);
    evt_seal_key_free(other);
}
END_TEST

START_TEST(seal_key_file)
{
    char dir[] = "/tmp/kscore-sealkey-XXXXXX", path[PATH_MAX];
    struct evt_seal_key *k1 = NULL, *k2 = NULL;
    uint8_t p1[32], p2[32];
    struct stat st;
    char *err = NULL;

    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/seal.key", dir);
    ck_assert_int_eq(evt_seal_key_open(path, &k1, &err), 0);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0600);
    ck_assert_int_eq(evt_seal_key_open(path, &k2, &err), 0);
    evt_seal_key_public(k1, p1);
    evt_seal_key_public(k2, p2);
    ck_assert_mem_eq(p1, p2, 32);
    evt_seal_key_free(k2);
    chmod(path, 0640);
    ck_assert_int_eq(evt_seal_key_open(path, &k2, &err), KS_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "0600"));
    free(err);
    err = NULL;
    /* Another kind of key (the broker's Ed25519 signing key) is no seal
     * key. */
    char priv[PATH_MAX + 16], pub[PATH_MAX + 16];
    snprintf(priv, sizeof(priv), "%s/ed.key", dir);
    snprintf(pub, sizeof(pub), "%s/ed.pub", dir);
    ck_assert_int_eq(evt_keygen(priv, pub), 0);
    ck_assert_int_eq(evt_seal_key_open(priv, &k2, &err), KS_EINVAL);
    free(err);
    evt_seal_key_free(k1);
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* The broker's field rules for sealed_env (broker/validate.c). */
START_TEST(request_rules)
{
    char *argv[] = {"true"};
    uint8_t box[EVT_SEAL_OVERHEAD + 4];
    Ks__SealedEnv e[3];
    Ks__SealedEnv *ep[3] = {&e[0], &e[1], &e[2]};
    Ks__EnvVar plain = KS__ENV_VAR__INIT, *pp[1] = {&plain};
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    char why[512];

    memset(box, 7, sizeof(box));
    box[0] = EVT_SEAL_VERSION;
    for (int i = 0; i < 3; i++) {
        ks__sealed_env__init(&e[i]);
        e[i].sealed.data = box;
        e[i].sealed.len = sizeof(box);
    }
    spec.argv = argv;
    spec.n_argv = 1;
    spec.sealed_env = ep;
    req.spec = &spec;
    req.agent_id = "a";
#define CHECK(want)                                                            \
    do {                                                                       \
        why[0] = '\0';                                                         \
        int rc_ = broker_check_request(&req.base, "op", why, sizeof(why));     \
        ck_assert_msg(rc_ == (want), "rc %d: %s", rc_, why);                   \
    } while (0)
    /* Two agents, the same names, sorted: fine. */
    e[0].agent_id = "a", e[0].name = "A";
    e[1].agent_id = "a", e[1].name = "B";
    spec.n_sealed_env = 2;
    CHECK(0);
    /* Unsorted, or a name twice. */
    e[0].name = "B", e[1].name = "A";
    CHECK(KS_EINVAL);
    e[0].name = "A", e[1].name = "A";
    CHECK(KS_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "sealed_env"));
    /* Another agent with other names. */
    e[1].agent_id = "b", e[1].name = "B";
    CHECK(KS_EINVAL);
    e[1].name = "A";
    CHECK(0);
    e[2].agent_id = "b", e[2].name = "B";
    spec.n_sealed_env = 3; /* b has A, B; a has only A */
    CHECK(KS_EINVAL);
    spec.n_sealed_env = 2;
    /* Names: POSIX, not KSCORE_*, not also a plain variable. */
    e[0].name = e[1].name = "KSCORE_X";
    CHECK(KS_EINVAL);
    e[0].name = e[1].name = "1X";
    CHECK(KS_EINVAL);
    e[0].name = e[1].name = "X";
    plain.name = "X";
    plain.value = "1";
    spec.env = pp;
    spec.n_env = 1;
    CHECK(KS_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "plain env"));
    spec.n_env = 0;
    CHECK(0);
    /* The agent id, the box's size and version. */
    e[1].agent_id = "b.c";
    CHECK(KS_EINVAL);
    e[1].agent_id = "b";
    e[0].sealed.len = EVT_SEAL_OVERHEAD - 1;
    CHECK(KS_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "sealed"));
    e[0].sealed.len = sizeof(box);
    box[0] = 9;
    CHECK(KS_EINVAL);
    box[0] = EVT_SEAL_VERSION;
    CHECK(0);
#undef CHECK
}
END_TEST

/* ---- on a real stack ------------------------------------------------------
 */

static void
stack_up(void)
{
    char host[64];
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kscore-secret-XXXXXX");
    if (!mkdtemp(tmpdir))
        exit(1);
    chmod(tmpdir, 0777);
    gethostname(host, sizeof(host));
    host[strcspn(host, ".")] = '\0';
    snprintf(local_agent, sizeof(local_agent), "%s-0", host);
    if (fixture_stack_start_secure(&stack, AGENT, "env=dev", OPERATOR, NULL) !=
        0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
}

static void
stack_down(void)
{
    char cmd[PATH_MAX + 16];
    fixture_stack_stop(&stack);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
}

static json_t *
json_line(const char *text, size_t line)
{
    const char *p = text;
    for (size_t i = 0; i < line && p; i++) {
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    ck_assert_ptr_nonnull(p);
    json_error_t je;
    json_t *j = json_loadb(p, strcspn(p, "\n"), 0, &je);
    ck_assert_msg(j != NULL, "not JSON: %s", p);
    return j;
}

START_TEST(exec_delivers_the_value_to_the_child_only)
{
    char value[64], digest[160], id[37];
    struct capture cp;
    struct fixture_out o;

    fresh_value(value);
    sha256_line(value, digest);
    capture_start(&cp);
    const char *args[] = {"exec",
                          "--agent",
                          AGENT,
                          "--json",
                          "--env",
                          "PLAIN=shown",
                          "--secret-env",
                          "TOKEN",
                          "--",
                          "sh",
                          "-c",
                          "printf %s \"$TOKEN\" | sha256sum",
                          NULL};
    kscore_with("TOKEN", value, args, &o);
    ck_assert_msg(o.status == 0, "exec: %d %s %s", o.status, o.out, o.err);
    json_t *j = json_line(o.out, 0);
    ck_assert_str_eq(json_string_value(json_object_get(j, "stdout")), digest);
    snprintf(id, sizeof(id), "%s",
             json_string_value(json_object_get(j, "command_id")));
    json_decref(j);
    ck_assert(!strstr(o.out, value) && !strstr(o.err, value));
    fixture_out_release(&o);

    /* get and events: the name, "<secret>", the box's size; never the
     * value nor the box. */
    const char *g[] = {"get", id, NULL};
    kscore_with(NULL, NULL, g, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_msg(strstr(o.out, "TOKEN=<secret>") &&
                      strstr(o.out, "PLAIN=shown"),
                  "%s", o.out);
    fixture_out_release(&o);
    const char *gj[] = {"get", id, "--json", NULL};
    kscore_with(NULL, NULL, gj, &o);
    ck_assert_int_eq(o.status, 0);
    j = json_line(o.out, 0);
    json_t *env = json_object_get(j, "env");
    ck_assert_str_eq(json_string_value(json_object_get(env, "TOKEN")),
                     "<secret>");
    ck_assert_str_eq(json_string_value(json_object_get(env, "PLAIN")), "shown");
    json_decref(j);
    fixture_out_release(&o);
    const char *ev[] = {"events", id, NULL};
    kscore_with(NULL, NULL, ev, &o);
    ck_assert_int_eq(o.status, 0);
    ck_assert_msg(strstr(o.out, "TOKEN=<secret>"), "%s", o.out);
    fixture_out_release(&o);
    const char *evj[] = {"events", id, "--json", NULL};
    kscore_with(NULL, NULL, evj, &o);
    ck_assert_int_eq(o.status, 0);
    j = json_line(o.out, 0);
    ck_assert_str_eq(json_string_value(json_object_get(j, "type")),
                     "CommandRequested");
    env = json_object_get(j, "env");
    ck_assert_str_eq(json_string_value(json_object_get(env, "TOKEN")),
                     "<secret>");
    json_t *se = json_array_get(json_object_get(j, "secret_env"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(se, "name")), "TOKEN");
    ck_assert_str_eq(json_string_value(json_object_get(se, "agent_id")), AGENT);
    ck_assert_int_eq(json_integer_value(json_object_get(se, "sealed_bytes")),
                     (json_int_t)(strlen(value) + EVT_SEAL_OVERHEAD));
    json_decref(j);
    pthread_mutex_lock(&cp.mu);
    ck_assert_uint_ge(cp.n_boxes, 1);
    ck_assert_msg(!strstr(o.out, cp.boxes[0]), "events print the box");
    pthread_mutex_unlock(&cp.mu);
    ck_assert(!strstr(o.out, value));
    fixture_out_release(&o);

    assert_nowhere(&cp, value);
    capture_stop(&cp);
}
END_TEST

START_TEST(cli_refuses_bad_secret_flags)
{
    struct fixture_out o;
    const char *unset[] = {
        "exec", "--agent", AGENT, "--secret-env", "KSCORE_TEST_UNSET_VAR",
        "--",   "true",    NULL};
    unsetenv("KSCORE_TEST_UNSET_VAR");
    kscore_with(NULL, NULL, unset, &o);
    ck_assert_int_eq(o.status, 2);
    ck_assert_ptr_nonnull(strstr(o.err, "KSCORE_"));
    fixture_out_release(&o);
    const char *unset2[] = {"exec",           "--agent", AGENT,  "--secret-env",
                            "NOT_SET_HERE_X", "--",      "true", NULL};
    unsetenv("NOT_SET_HERE_X");
    kscore_with(NULL, NULL, unset2, &o);
    ck_assert_int_eq(o.status, 2);
    ck_assert_ptr_nonnull(strstr(o.err, "not set"));
    fixture_out_release(&o);
    const char *both[] = {"exec",         "--agent", AGENT, "--env", "T=1",
                          "--secret-env", "T",       "--",  "true",  NULL};
    kscore_with("T", "2", both, &o);
    ck_assert_int_eq(o.status, 2);
    fixture_out_release(&o);
    const char *unknown[] = {"exec", "--agent", "nobody-here", "--secret-env",
                             "T",    "--",      "true",        NULL};
    kscore_with("T", "2", unknown, &o);
    ck_assert_int_eq(o.status, 125);
    ck_assert_ptr_nonnull(strstr(o.err, "unknown agent"));
    fixture_out_release(&o);
}
END_TEST

/* An ExecuteRequest made by hand, as operator OPERATOR: spec runs
 * `touch <marker>`, with one sealed entry. */
static Ks__ExecuteReply *
crafted_exec(struct evt_conn *c, const char *marker, const char *agent_id,
             const char *entry_agent, const char *entry_name,
             const uint8_t *box, size_t box_len)
{
    char script[PATH_MAX + 16];
    char *argv[] = {"sh", "-c", script};
    Ks__SealedEnv e = KS__SEALED_ENV__INIT, *ep[1] = {&e};
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__ExecuteReply *rep = NULL;

    snprintf(script, sizeof(script), "touch %s", marker);
    spec.argv = argv;
    spec.n_argv = 3;
    e.name = (char *)entry_name;
    e.agent_id = (char *)entry_agent;
    e.sealed.data = (uint8_t *)box;
    e.sealed.len = box_len;
    spec.sealed_env = ep;
    spec.n_sealed_env = 1;
    req.spec = &spec;
    req.agent_id = (char *)agent_id;
    req.deliver_within_ms = 20000;
    ck_assert_int_eq(broker_execute(c, &req, 30000, &rep), 0);
    return rep;
}

static bool
exists(const char *path)
{
    return access(path, F_OK) == 0;
}

static void
expect_refused(Ks__ExecuteReply *rep, const char *marker, const char *what)
{
    ck_assert_msg(rep->error_code == 0, "%s: %s", what, rep->error);
    ck_assert_ptr_nonnull(rep->result);
    ck_assert_msg(rep->result->status == KS__COMMAND_STATUS__START_FAILED,
                  "%s: status %s", what,
                  kproto_status_name(rep->result->status));
    ck_assert_str_eq(rep->result->start_stage, "secret");
    ck_assert_msg(strstr(rep->result->reason, "TOKEN"), "%s: reason %s", what,
                  rep->result->reason);
    ck_assert_msg(!exists(marker), "%s: the command ran", what);
    ks__execute_reply__free_unpacked(rep, NULL);
}

START_TEST(changed_or_misused_boxes_are_refused)
{
    struct evt_conn *c = connect_as(stack.operator_seed);
    uint8_t pub[32], local_pub[32], *box = NULL;
    size_t len = 0;
    char marker[PATH_MAX + 64], id[37];
    Ks__ExecuteReply *rep;

    ck_assert_str_eq(c->identity, OPERATOR);
    agent_key(c, AGENT, pub);
    agent_key(c, local_agent, local_pub);
    ck_assert(memcmp(pub, local_pub, 32) != 0);

    /* Control: made right by hand, it runs. */
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/ok-%s", tmpdir, id);
    ck_assert_int_eq(
        evt_seal_env(pub, AGENT, OPERATOR, "TOKEN", "v", &box, &len), 0);
    rep = crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len);
    ck_assert_msg(rep->error_code == 0, "%s", rep->error);
    ck_assert_int_eq(rep->result->status, KS__COMMAND_STATUS__SUCCEEDED);
    ck_assert(exists(marker));
    ks__execute_reply__free_unpacked(rep, NULL);

    /* One flipped byte of the ciphertext, then of the tag. */
    size_t at[] = {1 + 32 + 12, len - 1, 5, 1 + 32 + 3};
    const char *what[] = {"ciphertext", "tag", "ephemeral key", "nonce"};
    for (size_t i = 0; i < 4; i++) {
        fresh_id(id);
        snprintf(marker, sizeof(marker), "%s/t-%s", tmpdir, id);
        box[at[i]] ^= 0x20;
        expect_refused(crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len),
                       marker, what[i]);
        box[at[i]] ^= 0x20;
    }
    free(box);

    /* Sealed for another operator's command (a box copied out of the
     * record into one's own command). */
    ck_assert_int_eq(
        evt_seal_env(pub, AGENT, "mallory", "TOKEN", "v", &box, &len), 0);
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/op-%s", tmpdir, id);
    expect_refused(crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len),
                   marker, "another operator");
    free(box);
    /* Sealed as another variable. */
    ck_assert_int_eq(
        evt_seal_env(pub, AGENT, OPERATOR, "OTHER", "v", &box, &len), 0);
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/name-%s", tmpdir, id);
    expect_refused(crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len),
                   marker, "another name");
    free(box);
    /* Sealed to another agent's key, labelled as this agent's. */
    ck_assert_int_eq(
        evt_seal_env(local_pub, AGENT, OPERATOR, "TOKEN", "v", &box, &len), 0);
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/key-%s", tmpdir, id);
    expect_refused(crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len),
                   marker, "another key");
    free(box);
    /* Sealed to another agent and its id, sent to this one: the broker
     * refuses it before recording anything. */
    ck_assert_int_eq(evt_seal_env(local_pub, local_agent, OPERATOR, "TOKEN",
                                  "v", &box, &len),
                     0);
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/agent-%s", tmpdir, id);
    rep = crafted_exec(c, marker, AGENT, local_agent, "TOKEN", box, len);
    ck_assert_int_eq(rep->error_code, KS_EINVAL);
    ck_assert_msg(strstr(rep->error, "another agent"), "%s", rep->error);
    ck_assert_str_eq(rep->command_id, "");
    ks__execute_reply__free_unpacked(rep, NULL);
    free(box);
    ck_assert(!exists(marker));
    evt_close(c);
}
END_TEST

struct cmd_check {
    const char *agent_id;
    int requested, sealed_own, sealed_other;
};

static int
check_requested(const Ks__RecordedEvent *rec, void *ud)
{
    struct cmd_check *cc = ud;
    const Ks__Event *e = rec->event;
    if (!e || strcmp(e->type, "CommandRequested") != 0 || !e->command ||
        !e->command->spec)
        return 0;
    cc->requested++;
    for (size_t i = 0; i < e->command->spec->n_sealed_env; i++)
        if (strcmp(e->command->spec->sealed_env[i]->agent_id, cc->agent_id) ==
            0)
            cc->sealed_own++;
        else
            cc->sealed_other++;
    return 0;
}

/* Runs a batch with TOKEN=value; each target's stdout must be digest, and
 * each target's recorded command carries its own agent's value only.
 * Returns the number of targets. */
static size_t
batch_with_secret(const char *const targets[], const char *value,
                  const char *digest, const char *const expect[])
{
    const char *args[16];
    size_t n = 0, seen = 0;
    struct fixture_out o;
    args[n++] = "batch";
    for (size_t i = 0; targets[i]; i++)
        args[n++] = targets[i];
    const char *rest[] = {"--json",
                          "--secret-env",
                          "TOKEN",
                          "--",
                          "sh",
                          "-c",
                          "printf %s \"$TOKEN\" | sha256sum",
                          NULL};
    for (size_t i = 0; rest[i]; i++)
        args[n++] = rest[i];
    args[n] = NULL;
    kscore_with("TOKEN", value, args, &o);
    ck_assert_msg(o.status == 0, "batch: %d %s %s", o.status, o.out, o.err);
    ck_assert(!strstr(o.out, value) && !strstr(o.err, value));
    struct store *st = NULL;
    ck_assert_int_eq(store_open(stack.pg.conninfo, &st, NULL), 0);
    for (size_t line = 0;; line++) {
        const char *p = o.out;
        for (size_t i = 0; i < line && p; i++)
            if ((p = strchr(p, '\n')))
                p++;
        if (!p || !*p)
            break;
        json_t *j = json_line(o.out, line);
        const char *agent = json_string_value(json_object_get(j, "agent_id"));
        const char *out = json_string_value(json_object_get(j, "stdout"));
        if (agent && out) {
            bool expected = false;
            for (size_t i = 0; expect[i]; i++)
                expected |= strcmp(expect[i], agent) == 0;
            ck_assert_msg(expected, "unexpected target %s", agent);
            ck_assert_str_eq(out, digest);
            char stream[64];
            struct cmd_check cc = {.agent_id = agent};
            snprintf(stream, sizeof(stream), "command-%s",
                     json_string_value(json_object_get(j, "command_id")));
            ck_assert_int_eq(
                store_read_stream(st, stream, 0, 0, check_requested, &cc), 0);
            ck_assert_int_eq(cc.requested, 1);
            ck_assert_int_eq(cc.sealed_own, 1);
            ck_assert_int_eq(cc.sealed_other, 0);
            seen++;
        }
        json_decref(j);
    }
    store_close(st);
    fixture_out_release(&o);
    return seen;
}

START_TEST(batch_seals_to_each_agent)
{
    char value[64], digest[160], agents[256];
    struct capture cp;

    fresh_value(value);
    sha256_line(value, digest);
    capture_start(&cp);
    snprintf(agents, sizeof(agents), "%s,%s", AGENT, local_agent);
    const char *t1[] = {"--agents", agents, NULL};
    const char *e2[] = {AGENT, local_agent, NULL};
    ck_assert_uint_eq(batch_with_secret(t1, value, digest, e2), 2);
    /* Targets the broker resolves: the CLI seals to every agent that
     * matches in the agents list. */
    const char *t2[] = {"--all", NULL};
    ck_assert_uint_eq(batch_with_secret(t2, value, digest, e2), 2);
    const char *t3[] = {"--select", "env=dev", NULL};
    const char *e1[] = {AGENT, NULL};
    ck_assert_uint_eq(batch_with_secret(t3, value, digest, e1), 1);
    pthread_mutex_lock(&cp.mu);
    ck_assert_uint_ge(cp.msgs, 5);
    pthread_mutex_unlock(&cp.mu);
    assert_nowhere(&cp, value);
    capture_stop(&cp);
}
END_TEST

/* Last: it restarts the agent. The key outlives a restart (its state
 * dir), so what was sealed before still opens after. */
START_TEST(seal_key_survives_a_restart)
{
    struct evt_conn *c = connect_as(stack.operator_seed);
    uint8_t before[32], after[32], *box = NULL;
    size_t len = 0;
    char path[PATH_MAX + 96], marker[PATH_MAX + 64], id[37];
    struct stat st;

    agent_key(c, AGENT, before);
    snprintf(path, sizeof(path), "%s/agent-%s/seal.key", stack.dir, AGENT);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0600);
    ck_assert_int_eq(
        evt_seal_env(before, AGENT, OPERATOR, "TOKEN", "v", &box, &len), 0);
    fixture_stack_agent_kill(&stack, SIGTERM);
    ck_assert_int_eq(fixture_stack_agent_start(&stack, NULL), 0);
    agent_key(c, AGENT, after);
    ck_assert_mem_eq(before, after, 32);
    fresh_id(id);
    snprintf(marker, sizeof(marker), "%s/restart-%s", tmpdir, id);
    Ks__ExecuteReply *rep =
        crafted_exec(c, marker, AGENT, AGENT, "TOKEN", box, len);
    ck_assert_msg(rep->error_code == 0, "%s", rep->error);
    ck_assert_int_eq(rep->result->status, KS__COMMAND_STATUS__SUCCEEDED);
    ck_assert(exists(marker));
    ks__execute_reply__free_unpacked(rep, NULL);
    free(box);
    evt_close(c);
}
END_TEST

static Suite *
secret_suite(void)
{
    Suite *s = suite_create("secret");
    TCase *unit = tcase_create("seal");
    tcase_add_test(unit, seal_known_answers);
    tcase_add_test(unit, seal_tampering_fails);
    tcase_add_test(unit, seal_round_trips);
    tcase_add_test(unit, seal_key_file);
    tcase_add_test(unit, request_rules);
    suite_add_tcase(s, unit);
    TCase *tc = tcase_create("stack");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 180);
    tcase_add_test(tc, exec_delivers_the_value_to_the_child_only);
    tcase_add_test(tc, cli_refuses_bad_secret_flags);
    tcase_add_test(tc, changed_or_misused_boxes_are_refused);
    tcase_add_test(tc, batch_seals_to_each_agent);
    tcase_add_test(tc, seal_key_survives_a_restart);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(secret_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
