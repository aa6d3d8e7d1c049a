/*
 * Identities: the NKey encoder against nats.c and a real nats-server, the
 * stack's identity registry and what it renders, the whole `kscore up` /
 * `kscore operator add|remove` cycle with a real stack in a private
 * $KSCORE_HOME, and PostgreSQL without trust.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>
#include <openssl/evp.h>

#include "events.h"
#include "fixture.h"
#include "stack.h"

static char tmpdir[PATH_MAX];

static void
tmp_up(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/kscore-ident-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir))
        exit(1);
}

static void
tmp_down(void)
{
    char cmd[PATH_MAX + 16];
    const char *keep = getenv("KSCORE_KEEP_TMP");
    if (keep && strcmp(keep, "1") == 0)
        return;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
}

static char *
slurp(const char *path)
{
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t len = 0;
    ck_assert_msg(f != NULL, "open %s: %s", path, strerror(errno));
    ck_assert_int_eq(getdelim(&buf, &len, '\0', f) >= 0, 1);
    fclose(f);
    return buf;
}

static mode_t
mode_of(const char *path)
{
    struct stat st;
    ck_assert_msg(stat(path, &st) == 0, "stat %s", path);
    return st.st_mode & 07777;
}

/* ---- the encoder ------------------------------------------------------- */

START_TEST(nkey_round_trips_and_matches_nats_c)
{
    for (int round = 0; round < 64; round++) {
        uint8_t raw[32], back[32];
        char seed[EVT_NKEY_SEED_CHARS + 1], pub[EVT_NKEY_PUBLIC_CHARS + 1];
        ck_assert_int_eq(getrandom(raw, sizeof(raw), 0), 32);

        evt_nkey_encode_seed(raw, seed);
        ck_assert_uint_eq(strlen(seed), EVT_NKEY_SEED_CHARS);
        ck_assert(seed[0] == 'S' && seed[1] == 'U');
        ck_assert_int_eq(evt_nkey_decode_seed(seed, back), 0);
        ck_assert_mem_eq(raw, back, 32);

        evt_nkey_encode_public(raw, pub);
        ck_assert_uint_eq(strlen(pub), EVT_NKEY_PUBLIC_CHARS);
        ck_assert(pub[0] == 'U');
        ck_assert_int_eq(evt_nkey_decode_public(pub, back), 0);
        ck_assert_mem_eq(raw, back, 32);

        /* One kind is not the other, and any changed character is caught
         * (the CRC, or the alphabet). */
        ck_assert_int_eq(evt_nkey_decode_seed(pub, back), KS_EINVAL);
        ck_assert_int_eq(evt_nkey_decode_public(seed, back), KS_EINVAL);
        char bad[EVT_NKEY_SEED_CHARS + 1];
        memcpy(bad, seed, sizeof(bad));
        size_t at = 2 + (size_t)round % (EVT_NKEY_SEED_CHARS - 3);
        bad[at] = bad[at] == 'A' ? 'B' : 'A';
        ck_assert_int_eq(evt_nkey_decode_seed(bad, back), KS_EINVAL);
    }

    /* nats.c decodes our seed on its own (nats_Sign) and its signature
     * verifies under the public key we derived: the same key pair. */
    char seed[EVT_NKEY_SEED_CHARS + 1], pub[EVT_NKEY_PUBLIC_CHARS + 1],
        pub2[EVT_NKEY_PUBLIC_CHARS + 1];
    uint8_t raw_pub[32];
    unsigned char *sig = NULL;
    int sig_len = 0;
    ck_assert_int_eq(nats_Open(-1), NATS_OK); /* nats_Sign needs it */
    ck_assert_int_eq(evt_nkey_generate(seed, pub), 0);
    ck_assert_int_eq(evt_nkey_public_of_seed(seed, pub2), 0);
    ck_assert_str_eq(pub, pub2);
    ck_assert_int_eq(nats_Sign(seed, "the server's nonce", &sig, &sig_len),
                     NATS_OK);
    ck_assert_int_eq(evt_nkey_decode_public(pub, raw_pub), 0);
    EVP_PKEY *k =
        EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, raw_pub, 32);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    ck_assert_ptr_nonnull(k);
    ck_assert_int_eq(EVP_DigestVerifyInit(md, NULL, NULL, NULL, k), 1);
    ck_assert_int_eq(EVP_DigestVerify(md, sig, (size_t)sig_len,
                                      (const unsigned char *)"the server's "
                                                             "nonce",
                                      18),
                     1);
    EVP_MD_CTX_free(md);
    EVP_PKEY_free(k);
    free(sig);
}
END_TEST

/* Writes a seed file for identity and returns its public key. */
static void
make_seed(const char *path, const char *identity,
          char pub[EVT_NKEY_PUBLIC_CHARS + 1])
{
    char seed[EVT_NKEY_SEED_CHARS + 1];
    ck_assert_int_eq(evt_nkey_generate(seed, pub), 0);
    ck_assert_int_eq(evt_nkey_write_seed(path, identity, seed), 0);
}

START_TEST(nats_server_takes_a_good_seed_and_refuses_a_wrong_one)
{
    char good[PATH_MAX + 16], wrong[PATH_MAX + 16], junk[PATH_MAX + 16];
    char pub[EVT_NKEY_PUBLIC_CHARS + 1], other[EVT_NKEY_PUBLIC_CHARS + 1];
    char conf[512], *err = NULL;
    struct fixture_nats n;
    struct evt_conn *c = NULL;

    snprintf(good, sizeof(good), "%s/good.nk", tmpdir);
    snprintf(wrong, sizeof(wrong), "%s/wrong.nk", tmpdir);
    snprintf(junk, sizeof(junk), "%s/junk.nk", tmpdir);
    make_seed(good, "carol", pub);
    make_seed(wrong, "carol", other);
    ck_assert_int_eq(mode_of(good), 0600);
    /* Never replaces a credential. */
    {
        char seed[EVT_NKEY_SEED_CHARS + 1], p2[EVT_NKEY_PUBLIC_CHARS + 1];
        ck_assert_int_eq(evt_nkey_generate(seed, p2), 0);
        ck_assert_int_eq(evt_nkey_write_seed(good, "carol", seed), -EEXIST);
    }
    snprintf(conf, sizeof(conf),
             "authorization {\n  users = [\n    { nkey: \"%s\" }\n  ]\n}\n",
             pub);
    ck_assert_int_eq(fixture_nats_start(&n, conf), 0);

    struct evt_connect_opts o = {.name = "ident-test", .timeout_ms = 2000};
    o.nkey_file = good;
    ck_assert_msg(evt_connect(n.url, &o, &c, &err) == 0, "good seed: %s",
                  err ? err : "");
    /* The identity comes from the seed file. */
    ck_assert_str_eq(c->identity, "carol");
    evt_close(c);
    c = NULL;

    o.nkey_file = wrong;
    ck_assert_int_eq(evt_connect(n.url, &o, &c, &err), KS_EUNAVAIL);
    ck_assert_ptr_nonnull(err);
    ck_assert_msg(strstr(err, "Authentication Violation") ||
                      strstr(err, "Authorization Violation"),
                  "%s", err);
    free(err);
    err = NULL;

    /* Neither without a credential. */
    o.nkey_file = NULL;
    ck_assert_int_eq(evt_connect(n.url, &o, &c, NULL), KS_EUNAVAIL);

    /* A file with no valid seed is refused before connecting. */
    FILE *f = fopen(junk, "w");
    fprintf(f, "# kscore NATS identity: carol\nSUnot-a-seed\n");
    fclose(f);
    o.nkey_file = junk;
    ck_assert_int_eq(evt_connect(n.url, &o, &c, &err), KS_EINVAL);
    free(err);
    fixture_nats_stop(&n);
}
END_TEST

/*
 * Every NKey connect with a good key succeeds, the first time: nats.c 3.4.1
 * sends a signature whose first byte is 0 as no signature (src/util.c
 * _base64Encode stops at src[0] == '\0'), which nats-server refuses: one
 * connect in 256, the "1 in ~200" that evt_connect used to retry on any
 * authentication failure (issue 22). Now such a signature is never sent
 * (events.c sign_nonce) and only that case is tried again, with a new
 * nonce. 3,000 connects: the zero-byte case is met (all but certainly:
 * (255/256)^3000 < 1e-5) and no connect fails.
 */
START_TEST(nkey_connects_with_a_good_key_never_fail)
{
    char good[PATH_MAX + 16], pub[EVT_NKEY_PUBLIC_CHARS + 1], conf[512];
    struct fixture_nats n;
    snprintf(good, sizeof(good), "%s/many.nk", tmpdir);
    make_seed(good, "dave", pub);
    snprintf(conf, sizeof(conf),
             "authorization {\n  users = [\n    { nkey: \"%s\" }\n  ]\n}\n",
             pub);
    ck_assert_int_eq(fixture_nats_start(&n, conf), 0);
    struct evt_connect_opts o = {.name = "ident-many", .timeout_ms = 2000,
                                 .nkey_file = good};
    unsigned zeros0 = evt_nkey_zero_signatures();
    for (int i = 0; i < 3000; i++) {
        struct evt_conn *c = NULL;
        char *err = NULL;
        int rc = evt_connect(n.url, &o, &c, &err);
        ck_assert_msg(rc == 0, "connect %d: %s", i, err ? err : ks_strerror(rc));
        evt_close(c);
    }
    ck_assert_uint_gt(evt_nkey_zero_signatures(), zeros0);
    fixture_nats_stop(&n);
}
END_TEST

/* ---- the registry ------------------------------------------------------ */

START_TEST(registry_keeps_keys_and_renders_public_keys_only)
{
    char home[PATH_MAX + 16], seedp[PATH_MAX + 64], *conf;
    struct stack_identity b, op, ag, again, *ids = NULL;
    size_t n = 0;

    snprintf(home, sizeof(home), "%s/reg", tmpdir);
    ck_assert_int_eq(stack_mkdirs(home, 0700), 0);
    /* Nobody yet: rendering refuses (an empty user list lets anyone in). */
    ck_assert_int_eq(stack_nats_auth_write(home, home), KS_EINVAL);

    ck_assert_int_eq(stack_ident_add(home, STACK_BROKER, "broker", &b), 0);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "alice", &op), 0);
    ck_assert_int_eq(stack_ident_add(home, STACK_AGENT, "agent-h1", &ag), 0);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "alice", &again),
                     -EEXIST);
    /* Names are subject tokens, and the kinds' names stay apart. */
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "broker", &again),
                     KS_EINVAL);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "agent-h1", &again),
                     KS_EINVAL);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "a.b", &again),
                     KS_EINVAL);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "a>", &again),
                     KS_EINVAL);
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, "", &again),
                     KS_EINVAL);
    char longname[EVT_IDENTITY_MAX + 2];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    ck_assert_int_eq(stack_ident_add(home, STACK_OPERATOR, longname, &again),
                     KS_EINVAL);

    /* ensure keeps what is there: no new secret at every start. */
    ck_assert_int_eq(stack_ident_ensure(home, STACK_OPERATOR, "alice", &again),
                     0);
    ck_assert_str_eq(again.nkey, op.nkey);
    stack_ident_seed_path(home, STACK_OPERATOR, "alice", seedp, sizeof(seedp));
    ck_assert_int_eq(mode_of(seedp), 0600);

    ck_assert_int_eq(stack_ident_list(home, &ids, &n), 0);
    ck_assert_uint_eq(n, 3);
    free(ids);

    ck_assert_int_eq(stack_nats_auth_write(home, home), 0);
    snprintf(seedp, sizeof(seedp), "%s/" STACK_NATS_AUTH_FILE, home);
    ck_assert_int_eq(mode_of(seedp), 0600);
    conf = slurp(seedp);
    ck_assert_ptr_nonnull(strstr(conf, b.nkey));
    ck_assert_ptr_nonnull(strstr(conf, op.nkey));
    ck_assert_ptr_nonnull(strstr(conf, ag.nkey));
    ck_assert_ptr_nonnull(strstr(conf, "\"_INBOX.alice.>\""));
    ck_assert_ptr_nonnull(strstr(conf, "\"kscore.evt.h1.0\""));
    ck_assert_ptr_null(strstr(conf, "password"));
    /* No seed of anyone's. */
    const char *names[] = {"broker", "alice", "agent-h1"};
    const enum stack_kind kinds[] = {STACK_BROKER, STACK_OPERATOR, STACK_AGENT};
    for (int i = 0; i < 3; i++) {
        char p[PATH_MAX + 64], seed[EVT_NKEY_SEED_CHARS + 1],
            pub[EVT_NKEY_PUBLIC_CHARS + 1], id[EVT_IDENTITY_MAX + 1];
        stack_ident_seed_path(home, kinds[i], names[i], p, sizeof(p));
        ck_assert_int_eq(evt_nkey_read_seed(p, seed, pub, id), 0);
        ck_assert_str_eq(id, names[i]);
        ck_assert_ptr_null(strstr(conf, seed));
    }
    free(conf);

    /* Removed: gone from the registry, the config and the disk. */
    ck_assert_int_eq(stack_ident_remove(home, "alice"), 0);
    ck_assert_int_eq(stack_ident_get(home, "alice", &again), KS_ENOTFOUND);
    stack_ident_seed_path(home, STACK_OPERATOR, "alice", seedp, sizeof(seedp));
    ck_assert_int_ne(access(seedp, F_OK), 0);
    ck_assert_int_eq(stack_nats_auth_write(home, home), 0);
    snprintf(seedp, sizeof(seedp), "%s/" STACK_NATS_AUTH_FILE, home);
    conf = slurp(seedp);
    ck_assert_ptr_null(strstr(conf, op.nkey));
    free(conf);
    ck_assert_int_eq(stack_ident_remove(home, "alice"), KS_ENOTFOUND);
}
END_TEST

/* ---- kscore up, operator add / remove ---------------------------------- */

static char home[PATH_MAX + 16];

static void
up_setup(void)
{
    tmp_up();
    snprintf(home, sizeof(home), "%s/home", tmpdir);
}

static void
up_teardown(void)
{
    struct fixture_out o;
    const char *args[] = {"down", NULL};
    fixture_kscore_home(home, args, &o);
    fixture_out_release(&o);
    tmp_down();
}

/* Runs kscore for home; returns its exit status, output in *o. */
static int
ks(struct fixture_out *o, const char *const args[])
{
    ck_assert_int_eq(fixture_kscore_home(home, args, o), 0);
    return o->status;
}

static int
ks_ok(const char *const args[])
{
    struct fixture_out o;
    int st = ks(&o, args);
    ck_assert_msg(st == 0, "kscore %s %s: exit %d: %s", args[0],
                  args[1] ? args[1] : "", st, o.err);
    fixture_out_release(&o);
    return st;
}

static void
read_file_to(const char *path, char *buf, size_t cap)
{
    char *s = slurp(path);
    snprintf(buf, cap, "%s", s);
    free(s);
}

/* The "command_id" of an `exec --json` result (static buffer). */
static const char *
command_id_of(const char *json)
{
    static char id[40];
    const char *p = strstr(json, "\"command_id\":\"");
    ck_assert_ptr_nonnull(p);
    snprintf(id, sizeof(id), "%.36s", p + 14);
    return id;
}

START_TEST(up_add_exec_remove_and_up_again)
{
    struct fixture_out o;
    char path[PATH_MAX + 64], carol_seed[PATH_MAX + 64], *s;
    char keys_before[3][512], keys_after[3][512];

    setenv("KSCORE_PG_FAST", "1", 0);
    ks_ok((const char *[]){"up", NULL});

    /* The env file points at a seed file and holds no secret. */
    snprintf(path, sizeof(path), "%s/env", home);
    s = slurp(path);
    ck_assert_ptr_nonnull(strstr(s, "KSCORE_NATS_NKEY='"));
    ck_assert_ptr_null(strstr(s, "PASSWORD"));
    ck_assert_ptr_null(strstr(s, "'SU"));
    free(s);

    /* The server's files: public keys only. */
    const char *server_files[] = {"nats.conf", STACK_NATS_AUTH_FILE};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof(path), "%s/%s", home, server_files[i]);
        s = slurp(path);
        ck_assert_ptr_null(strstr(s, "password"));
        /* A seed is "SU" + 56 base32 characters; none is here. */
        for (const char *p = s; (p = strstr(p, "SU")); p++) {
            size_t run = strspn(p, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567");
            ck_assert_msg(run < EVT_NKEY_SEED_CHARS, "a seed in %s",
                          server_files[i]);
        }
        free(s);
    }
    ck_assert_int_eq(mode_of(path), 0600);
    /* Logs are not world-readable. */
    const char *logs[] = {"nats.log", "broker.log", "agent.log", "pg.log"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", home, logs[i]);
        ck_assert_msg((mode_of(path) & 0007) == 0, "%s is %o", logs[i],
                      mode_of(path));
    }
    /* PostgreSQL: no trust. */
    snprintf(path, sizeof(path), "%s/pg/pg_hba.conf", home);
    s = slurp(path);
    ck_assert_ptr_null(strstr(s, "trust\n"));
    ck_assert_ptr_nonnull(strstr(s, "peer map=kscore"));
    free(s);

    /* The login's operator works without any flag (env file). */
    ck_assert_int_eq(ks(&o, (const char *[]){"exec", "--", "echo", "hi", NULL}),
                     0);
    ck_assert_str_eq(o.out, "hi\n");
    fixture_out_release(&o);

    /* A new operator. */
    ck_assert_int_eq(ks(&o, (const char *[]){"operator", "add", "carol", NULL}),
                     0);
    ck_assert_msg(strstr(o.out, "/operators/carol.nk") != NULL, "%s", o.out);
    snprintf(path, sizeof(path), "%s/operators/carol.nk", home);
    ck_assert_int_eq(mode_of(path), 0600);
    fixture_out_release(&o);
    ck_assert_int_eq(ks(&o, (const char *[]){"operator", "add", "carol", NULL}),
                     125);
    fixture_out_release(&o);
    ck_assert_int_eq(
        ks(&o, (const char *[]){"operator", "add", "agent-x", NULL}), 2);
    fixture_out_release(&o);
    /* As a person would: carol's own copy of her seed. */
    snprintf(carol_seed, sizeof(carol_seed), "%s/carol-copy.nk", tmpdir);
    {
        char seed[EVT_NKEY_SEED_CHARS + 1], pub[EVT_NKEY_PUBLIC_CHARS + 1],
            id[EVT_IDENTITY_MAX + 1];
        ck_assert_int_eq(evt_nkey_read_seed(path, seed, pub, id), 0);
        ck_assert_int_eq(evt_nkey_write_seed(carol_seed, id, seed), 0);
    }
    ck_assert_int_eq(
        ks(&o, (const char *[]){"operator", "list", "--json", NULL}), 0);
    ck_assert_ptr_nonnull(strstr(o.out, "\"name\":\"carol\""));
    fixture_out_release(&o);

    /* carol runs a command with her own seed, and the record names her. */
    ck_assert_int_eq(ks(&o, (const char *[]){"exec", "--nkey", carol_seed,
                                             "--json", "--", "true", NULL}),
                     0);
    char id[40];
    snprintf(id, sizeof(id), "%s", command_id_of(o.out));
    fixture_out_release(&o);
    ck_assert_int_eq(ks(&o, (const char *[]){"events", id, "--json", NULL}), 0);
    ck_assert_msg(strstr(o.out, "\"operator\":\"carol\"") != NULL, "%s", o.out);
    fixture_out_release(&o);

    /* An open connection of carol's, to see what a removal does to it. */
    char *url = NULL;
    {
        snprintf(path, sizeof(path), "%s/env", home);
        s = slurp(path);
        char *u = strstr(s, "KSCORE_NATS_URL='");
        ck_assert_ptr_nonnull(u);
        u += strlen("KSCORE_NATS_URL='");
        url = strndup(u, strcspn(u, "'"));
        free(s);
    }
    struct evt_connect_opts co = {.name = "carol-open",
                                  .nkey_file = carol_seed};
    struct evt_conn *open_conn = NULL;
    ck_assert_int_eq(evt_connect(url, &co, &open_conn, NULL), 0);

    /* Removed: refused after the reload, without a server restart. */
    pid_t nats_before = 0, nats_after = 0;
    ck_assert(stack_pidfile_alive(home, "nats", &nats_before));
    ck_assert_int_eq(
        ks(&o, (const char *[]){"operator", "remove", "carol", NULL}), 0);
    fixture_out_release(&o);
    ck_assert(stack_pidfile_alive(home, "nats", &nats_after));
    ck_assert_int_eq(nats_before, nats_after);
    ck_assert_int_eq(ks(&o, (const char *[]){"exec", "--nkey", carol_seed, "--",
                                             "true", NULL}),
                     125);
    ck_assert_msg(strstr(o.err, "Violation") != NULL, "%s", o.err);
    fixture_out_release(&o);
    /* Her open connection is closed by the server at the reload (nats.c
     * then tries to reconnect, and is refused). */
    int64_t deadline = ks_mono_us() + 10 * 1000000LL;
    while (natsConnection_Status(open_conn->nc) == NATS_CONN_STATUS_CONNECTED &&
           ks_mono_us() < deadline)
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    ck_assert_int_ne(natsConnection_Status(open_conn->nc),
                     NATS_CONN_STATUS_CONNECTED);
    evt_close(open_conn);
    /* Others are untouched. */
    ck_assert_int_eq(ks(&o, (const char *[]){"exec", "--", "true", NULL}), 0);
    fixture_out_release(&o);
    ck_assert_int_eq(
        ks(&o, (const char *[]){"operator", "remove", "broker", NULL}), 125);
    fixture_out_release(&o);

    /* down and up: the same keys, nothing new. */
    char login_seed[PATH_MAX + 64];
    {
        snprintf(path, sizeof(path), "%s/env", home);
        s = slurp(path);
        char *u = strstr(s, "KSCORE_NATS_NKEY='");
        u += strlen("KSCORE_NATS_NKEY='");
        snprintf(login_seed, sizeof(login_seed), "%.*s", (int)strcspn(u, "'"),
                 u);
        free(s);
    }
    snprintf(path, sizeof(path), "%s/keys/broker.nk", home);
    read_file_to(path, keys_before[0], sizeof(keys_before[0]));
    read_file_to(login_seed, keys_before[1], sizeof(keys_before[1]));
    snprintf(path, sizeof(path), "%s/" STACK_NATS_AUTH_FILE, home);
    read_file_to(path, keys_before[2], sizeof(keys_before[2]));
    ks_ok((const char *[]){"down", NULL});
    ks_ok((const char *[]){"up", NULL});
    snprintf(path, sizeof(path), "%s/keys/broker.nk", home);
    read_file_to(path, keys_after[0], sizeof(keys_after[0]));
    read_file_to(login_seed, keys_after[1], sizeof(keys_after[1]));
    snprintf(path, sizeof(path), "%s/" STACK_NATS_AUTH_FILE, home);
    read_file_to(path, keys_after[2], sizeof(keys_after[2]));
    for (int i = 0; i < 3; i++)
        ck_assert_str_eq(keys_before[i], keys_after[i]);
    ck_assert_int_eq(
        ks(&o, (const char *[]){"exec", "--", "echo", "again", NULL}), 0);
    ck_assert_str_eq(o.out, "again\n");
    fixture_out_release(&o);
    free(url);
}
END_TEST

/* ---- PostgreSQL -------------------------------------------------------- */

START_TEST(pg_has_no_trust_and_tcp_needs_a_password)
{
    struct fixture_pg pg;
    char path[PATH_MAX + 32], conninfo[256];
    int port;

    setenv("KSCORE_PG_LISTEN", "127.0.0.1", 1);
    ck_assert_int_eq(fixture_pg_start(&pg), 0);
    unsetenv("KSCORE_PG_LISTEN");

    snprintf(path, sizeof(path), "%s/pg/pg_hba.conf", pg.dir);
    char *hba = slurp(path);
    /* No line (comments aside) says trust. */
    for (char *line = strtok(hba, "\n"); line; line = strtok(NULL, "\n"))
        if (line[0] != '#')
            ck_assert_msg(strstr(line, "trust") == NULL, "%s", line);
    free(hba);

    /* The socket: the OS user running kscore is the role kscore ... */
    PGconn *c = PQconnectdb(pg.conninfo);
    ck_assert_msg(PQstatus(c) == CONNECTION_OK, "%s", PQerrorMessage(c));
    PGresult *r = PQexec(c, "SELECT current_user, rolsuper FROM pg_roles "
                            "WHERE rolname = current_user");
    ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    ck_assert_str_eq(PQgetvalue(r, 0, 0), "kscore");
    ck_assert_str_eq(PQgetvalue(r, 0, 1), "f");
    PQclear(r);
    PQfinish(c);
    /* ... and not the superuser. */
    const char *sock = strstr(pg.conninfo, "host=");
    const char *pp = strstr(pg.conninfo, "port=");
    ck_assert(sock && pp);
    port = atoi(pp + 5);
    snprintf(conninfo, sizeof(conninfo),
             "%.*s port=%d dbname=kscore "
             "user=postgres",
             (int)strcspn(sock, " "), sock, port);
    c = PQconnectdb(conninfo);
    ck_assert_int_eq(PQstatus(c), CONNECTION_BAD);
    PQfinish(c);

    /* TCP without a password: refused, for every role. */
    const char *roles[] = {"kscore", "postgres"};
    for (int i = 0; i < 2; i++) {
        snprintf(conninfo, sizeof(conninfo),
                 "host=127.0.0.1 port=%d dbname=kscore user=%s "
                 "connect_timeout=5",
                 port, roles[i]);
        c = PQconnectdb(conninfo);
        ck_assert_int_eq(PQstatus(c), CONNECTION_BAD);
        ck_assert_msg(strstr(PQerrorMessage(c), "password") != NULL, "%s",
                      PQerrorMessage(c));
        PQfinish(c);
        /* and a wrong one too */
        snprintf(conninfo, sizeof(conninfo),
                 "host=127.0.0.1 port=%d dbname=kscore user=%s "
                 "password=guess connect_timeout=5",
                 port, roles[i]);
        c = PQconnectdb(conninfo);
        ck_assert_int_eq(PQstatus(c), CONNECTION_BAD);
        PQfinish(c);
    }
    fixture_pg_stop(&pg);
}
END_TEST

static Suite *
identity_suite(void)
{
    Suite *s = suite_create("identity");
    TCase *tc = tcase_create("nkeys");
    tcase_add_unchecked_fixture(tc, tmp_up, tmp_down);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, nkey_round_trips_and_matches_nats_c);
    tcase_add_test(tc, nats_server_takes_a_good_seed_and_refuses_a_wrong_one);
    tcase_add_test(tc, nkey_connects_with_a_good_key_never_fail);
    tcase_add_test(tc, registry_keeps_keys_and_renders_public_keys_only);
    suite_add_tcase(s, tc);

    tc = tcase_create("pg");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, pg_has_no_trust_and_tcp_needs_a_password);
    suite_add_tcase(s, tc);

    tc = tcase_create("up");
    tcase_add_unchecked_fixture(tc, up_setup, up_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, up_add_exec_remove_and_up_again);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(identity_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
