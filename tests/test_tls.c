/*
 * TLS and credentials to NATS: evt_connect() against a private nats-server
 * that requires mutual TLS, and one that requires a user and password.
 *
 * The certificates come from the openssl CLI at set-up, in a mkdtemp
 * directory: a CA, a server certificate for 127.0.0.1 and localhost (in
 * subjectAltName: the client checks the name there, RFC 6125 6.4), a
 * client certificate, and a second CA that signed nothing kscore trusts.
 *
 * nats-server 2.9 greets with a plain-text INFO (tls_required: true) and
 * upgrades after it (nats-server docs, "TLS"; handshake_first only came in
 * 2.10), so stack_nats_start()'s readiness probe, which waits for "INFO"
 * on the plain socket, serves a TLS server unchanged.
 */
#include <check.h>
#include <errno.h>
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "fixture.h"

static char certs[PATH_MAX]; /* the mkdtemp directory of the certificates */
static struct fixture_nats tls_nats, auth_nats;

/* ---- certificates ------------------------------------------------------- */

static const char openssl_cnf[] =
    "[req]\n"
    "distinguished_name = dn\n"
    "[dn]\n"
    "[ca]\n"
    "basicConstraints = critical,CA:TRUE\n"
    "keyUsage = critical,keyCertSign,cRLSign\n"
    "subjectKeyIdentifier = hash\n"
    "[server]\n"
    "basicConstraints = CA:FALSE\n"
    "keyUsage = critical,digitalSignature\n"
    "extendedKeyUsage = serverAuth\n"
    "subjectAltName = IP:127.0.0.1,DNS:localhost\n"
    "[client]\n"
    "basicConstraints = CA:FALSE\n"
    "keyUsage = critical,digitalSignature\n"
    "extendedKeyUsage = clientAuth\n";

/* Runs one command (printf format) in the certificate directory, its
 * output appended to openssl.log. 0 or -1. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int
sh(const char *fmt, ...)
{
    char cmd[4 * PATH_MAX], line[2 * PATH_MAX];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "cd '%s' && %s >>openssl.log 2>&1", certs, line);
    return system(cmd) == 0 ? 0 : -1;
}

#define NEWKEY "-nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1"

/* A self-signed CA: <name>.pem and <name>.key. */
static int
make_ca(const char *name)
{
    return sh("openssl req -config openssl.cnf -x509 -extensions ca " NEWKEY
              " -days 2 -subj /CN=kscore-test-%s -keyout %s.key -out %s.pem",
              name, name, name);
}

/* A leaf certificate <name>.pem/.key with extensions section ext of
 * openssl.cnf, signed by the CA <ca>. */
static int
make_leaf(const char *name, const char *ext, const char *ca, int serial)
{
    if (sh("openssl req -config openssl.cnf " NEWKEY
           " -subj /CN=kscore-test-%s -keyout %s.key -out %s.csr",
           name, name, name) != 0)
        return -1;
    return sh("openssl x509 -req -in %s.csr -CA %s.pem -CAkey %s.key "
              "-set_serial %d -days 2 -extfile openssl.cnf -extensions %s "
              "-out %s.pem",
              name, ca, ca, serial, ext, name);
}

static int
rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static void
rm_certs(void)
{
    const char *keep = getenv("KSCORE_KEEP_TMP");
    if (certs[0] && !(keep && strcmp(keep, "1") == 0))
        nftw(certs, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    certs[0] = '\0';
}

static void
make_certs(void)
{
    const char *tmp = getenv("TMPDIR");
    char path[PATH_MAX + 32];
    FILE *f;

    snprintf(certs, sizeof(certs), "%s/kscore-tls-XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(certs)) {
        perror("mkdtemp");
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/openssl.cnf", certs);
    f = fopen(path, "we");
    if (!f || fputs(openssl_cnf, f) == EOF || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
    if (make_ca("ca") || make_ca("other-ca") ||
        make_leaf("server", "server", "ca", 2) ||
        make_leaf("client", "client", "ca", 3) ||
        make_leaf("stranger", "client", "other-ca", 4)) {
        fprintf(stderr, "openssl failed: see %s/openssl.log\n", certs);
        exit(1);
    }
}

/* <certs>/<name> into a static buffer (one per slot). */
static const char *
cert(int slot, const char *name)
{
    static char buf[4][PATH_MAX + 32];
    snprintf(buf[slot], sizeof(buf[slot]), "%s/%s", certs, name);
    return buf[slot];
}

/* ---- servers ------------------------------------------------------------ */

static void
tls_up(void)
{
    char conf[4 * PATH_MAX + 256];

    make_certs();
    snprintf(conf, sizeof(conf),
             "tls {\n"
             "  cert_file: \"%s/server.pem\"\n"
             "  key_file: \"%s/server.key\"\n"
             "  ca_file: \"%s/ca.pem\"\n"
             "  verify: true\n"
             "  timeout: 2\n"
             "}\n",
             certs, certs, certs);
    if (fixture_nats_start(&tls_nats, conf) != 0) {
        fixture_nats_stop(&tls_nats);
        rm_certs();
        exit(1);
    }
}

static void
tls_down(void)
{
    fixture_nats_stop(&tls_nats);
    rm_certs();
}

/* "tls://127.0.0.1:PORT" from the fixture's "nats://...". */
static const char *
tls_url(void)
{
    static char url[128];
    const char *hostport = strstr(tls_nats.url, "://");
    snprintf(url, sizeof(url), "tls%s", hostport);
    return url;
}

static void
echo(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    (void)sub;
    (void)ud;
    natsConnection_Publish(nc, natsMsg_GetReply(msg), natsMsg_GetData(msg),
                           natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
}

/* Connects with o; returns the evt_connect code, and closes. */
static int
try_connect(const char *url, struct evt_connect_opts *o)
{
    struct evt_conn *c = NULL;
    char *err = NULL;
    int rc;

    o->timeout_ms = 3000;
    rc = evt_connect(url, o, &c, &err);
    if (rc)
        fprintf(stderr, "  (expected refusal: %s)\n", err ? err : "-");
    free(err);
    evt_close(c);
    return rc;
}

/* ---- tests: TLS --------------------------------------------------------- */

/* Mutual TLS: the client trusts the CA and shows its certificate; a
 * request/reply goes round over the encrypted connection. */
START_TEST(tls_client_cert_round_trip)
{
    struct evt_connect_opts o = {.name = "test-tls"};
    Ks__GetRequest req = KS__GET_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    natsSubscription *sub = NULL;
    struct evt_conn *c = NULL;
    natsMsg *reply = NULL;
    char *err = NULL;

    o.tls_ca = cert(0, "ca.pem");
    o.tls_cert = cert(1, "client.pem");
    o.tls_key = cert(2, "client.key");
    ck_assert_msg(evt_connect(tls_url(), &o, &c, &err) == 0, "connect: %s",
                  err ? err : "-");
    ck_assert_int_eq(
        natsConnection_Subscribe(&sub, c->nc, "tls.echo", echo, NULL), NATS_OK);
    ck_assert_int_eq(natsConnection_Flush(c->nc), NATS_OK);
    req.id = "over tls";
    ck_assert_int_eq(evt_request(c, "tls.echo", &req.base, 2000, &reply), 0);
    ck_assert_int_eq(evt_unpack(&ks__get_request__descriptor,
                                natsMsg_GetData(reply),
                                (size_t)natsMsg_GetDataLength(reply), &m),
                     0);
    ck_assert_str_eq(((Ks__GetRequest *)m)->id, "over tls");
    protobuf_c_message_free_unpacked(m, NULL);
    natsMsg_Destroy(reply);
    natsSubscription_Destroy(sub);
    evt_close(c);
}
END_TEST

/* nats:// with TLS options upgrades too: the options, not the scheme,
 * make evt_connect secure. */
START_TEST(tls_nats_scheme_with_options)
{
    struct evt_connect_opts o = {0};
    o.tls_ca = cert(0, "ca.pem");
    o.tls_cert = cert(1, "client.pem");
    o.tls_key = cert(2, "client.key");
    ck_assert_int_eq(try_connect(tls_nats.url, &o), 0);
}
END_TEST

/* verify: true: no client certificate, no connection. */
START_TEST(tls_without_client_cert_refused)
{
    struct evt_connect_opts o = {0};
    o.tls_ca = cert(0, "ca.pem");
    ck_assert_int_eq(try_connect(tls_url(), &o), KS_EUNAVAIL);
}
END_TEST

/* The client trusts another CA: the server's certificate does not verify. */
START_TEST(tls_wrong_ca_refused)
{
    struct evt_connect_opts o = {0};
    o.tls_ca = cert(0, "other-ca.pem");
    o.tls_cert = cert(1, "client.pem");
    o.tls_key = cert(2, "client.key");
    ck_assert_int_eq(try_connect(tls_url(), &o), KS_EUNAVAIL);
}
END_TEST

/* A client certificate from a CA the server does not trust. */
START_TEST(tls_untrusted_client_cert_refused)
{
    struct evt_connect_opts o = {0};
    o.tls_ca = cert(0, "ca.pem");
    o.tls_cert = cert(1, "stranger.pem");
    o.tls_key = cert(2, "stranger.key");
    ck_assert_int_eq(try_connect(tls_url(), &o), KS_EUNAVAIL);
}
END_TEST

/* No TLS at all against a server that requires it. */
START_TEST(tls_plain_client_refused)
{
    struct evt_connect_opts o = {0};
    ck_assert_int_eq(try_connect(tls_nats.url, &o), KS_EUNAVAIL);
}
END_TEST

/* ---- tests: user and password ------------------------------------------- */

static void
auth_up(void)
{
    static const char conf[] =
        "authorization {\n"
        "  users = [\n"
        "    { user: \"alice\", password: \"alice-secret\",\n"
        "      permissions: { publish: [\"ok.>\", \"_INBOX.>\"],\n"
        "                     subscribe: [\"ok.>\", \"_INBOX.>\"] } }\n"
        "  ]\n"
        "}\n";
    if (fixture_nats_start(&auth_nats, conf) != 0) {
        fixture_nats_stop(&auth_nats);
        exit(1);
    }
}

static void
auth_down(void)
{
    fixture_nats_stop(&auth_nats);
}

START_TEST(auth_right_password)
{
    struct evt_connect_opts o = {.user = "alice", .password = "alice-secret"};
    ck_assert_int_eq(try_connect(auth_nats.url, &o), 0);
}
END_TEST

START_TEST(auth_wrong_password_refused)
{
    struct evt_connect_opts o = {.user = "alice", .password = "guess"};
    ck_assert_int_eq(try_connect(auth_nats.url, &o), KS_EUNAVAIL);
}
END_TEST

START_TEST(auth_no_credentials_refused)
{
    struct evt_connect_opts o = {0};
    ck_assert_int_eq(try_connect(auth_nats.url, &o), KS_EUNAVAIL);
}
END_TEST

static Suite *
tls_suite(void)
{
    Suite *s = suite_create("tls");
    TCase *tc = tcase_create("mutual-tls");
    tcase_add_unchecked_fixture(tc, tls_up, tls_down);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, tls_client_cert_round_trip);
    tcase_add_test(tc, tls_nats_scheme_with_options);
    tcase_add_test(tc, tls_without_client_cert_refused);
    tcase_add_test(tc, tls_wrong_ca_refused);
    tcase_add_test(tc, tls_untrusted_client_cert_refused);
    tcase_add_test(tc, tls_plain_client_refused);
    suite_add_tcase(s, tc);

    tc = tcase_create("user-password");
    tcase_add_unchecked_fixture(tc, auth_up, auth_down);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, auth_right_password);
    tcase_add_test(tc, auth_wrong_password_refused);
    tcase_add_test(tc, auth_no_credentials_refused);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(tls_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
