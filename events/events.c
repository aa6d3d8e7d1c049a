#include "events_int.h"

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

/* nats.c takes JetStream durations in nanoseconds (jsStreamConfig.MaxAge,
 * .Duplicates, jsConsumerConfig.AckWait: nats.h "expressed in nanoseconds"),
 * and kvConfig.TTL is copied straight into MaxAge (nats.c src/kv.c). */
#define NS_PER_MS INT64_C(1000000)

int
evt_err(natsStatus s)
{
    switch (s) {
    case NATS_OK:
        return 0;
    case NATS_TIMEOUT:
        return KS_ETIMEDOUT;
    case NATS_NO_SERVER:
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_RESPONDERS:
    case NATS_STALE_CONNECTION:
        return KS_EUNAVAIL;
    case NATS_NOT_FOUND:
        return KS_ENOTFOUND;
    case NATS_NO_MEMORY:
        return -ENOMEM;
    case NATS_MAX_PAYLOAD:
        return KS_ETOOBIG;
    default:
        return KS_ENATS;
    }
}

static char *
errmsg_dup(const char *fmt, const char *a, const char *b)
{
    char *m = NULL;
    if (asprintf(&m, fmt, a, b) < 0)
        return NULL;
    return m;
}

/* The name a connection's callbacks print. nats.c may run them after
 * evt_close has freed the evt_conn (they are queued to its callback
 * thread), so they get a string that lives as long as the process: one per
 * identity, a few per process. */
static const char *
conn_name(const char *identity)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static char names[64][EVT_IDENTITY_MAX + 1];
    static size_t n;
    const char *r = "a connection";

    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < n; i++)
        if (strcmp(names[i], identity) == 0) {
            r = names[i];
            goto out;
        }
    if (n < sizeof(names) / sizeof(names[0])) {
        snprintf(names[n], sizeof(names[n]), "%s", identity);
        r = names[n++];
    }
out:
    pthread_mutex_unlock(&mu);
    return r;
}

/* Disconnected, reconnected and closed, for services (retry_forever). */
static void
on_conn_event(natsConnection *nc, void *closure)
{
    const char *who = closure;
    const char *err = NULL;
    natsConnStatus st = natsConnection_Status(nc);

    natsConnection_GetLastError(nc, &err);
    /* Through ks_log, as every other line of the service: with a time and
     * a level, and valid JSON under --log-format json. */
    if (st == NATS_CONN_STATUS_CONNECTED) {
        ks_log(KS_LOG_INFO, "NATS connection is back", KS_S("identity", who));
        return;
    }
    /* Closed without an error: our own evt_close, nothing to say. */
    if (st == NATS_CONN_STATUS_CLOSED && !(err && err[0]))
        return;
    if (st == NATS_CONN_STATUS_CLOSED)
        ks_log(KS_LOG_ERROR, "NATS connection closed for good",
               KS_S("identity", who), KS_S("error", err));
    else if (err && err[0])
        ks_log(KS_LOG_WARN, "NATS connection lost (reconnecting)",
               KS_S("identity", who), KS_S("error", err));
    else
        ks_log(KS_LOG_WARN, "NATS connection lost (reconnecting)",
               KS_S("identity", who));
}

static _Atomic unsigned zero_sigs_total;

unsigned
evt_nkey_zero_signatures(void)
{
    return atomic_load(&zero_sigs_total);
}

/* natsSignatureHandler (nats.h): signs the server's nonce with the
 * connection's NKey; nats.c frees *sig. Called by nats.c on the connecting
 * thread, and on its reconnect thread.
 *
 * nats.c 3.4.1 base64-encodes the signature with _base64Encode
 * (src/util.c), which returns an empty string when src[0] == '\0': a
 * signature whose first byte is 0 (one in 256, Ed25519 being
 * deterministic for a nonce) goes out as no signature at all, and
 * nats-server refuses the connect ("authentication error"). That was the
 * "1 in ~200 NKey handshakes with a correct key" (issue 22). Such a
 * signature is not sent: the attempt fails here, before CONNECT, and the
 * next one gets a new nonce from the server (evt_connect tries again;
 * nats.c's reconnect loop does by itself, and no auth error reaches the
 * server, so nats.c never takes it for a revoked credential). */
static natsStatus
sign_nonce(char **err_txt, unsigned char **sig, int *sig_len,
           const char *nonce, void *closure)
{
    struct evt_conn *c = closure;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    size_t len = 64;
    unsigned char *out = malloc(len);
    int ok = md && out &&
             EVP_DigestSignInit(md, NULL, NULL, NULL, c->nkey) == 1 &&
             EVP_DigestSign(md, out, &len, (const unsigned char *)nonce,
                            strlen(nonce)) == 1 &&
             len == 64;

    EVP_MD_CTX_free(md);
    if (!ok) {
        free(out);
        *err_txt = strdup("cannot sign the server's nonce");
        return NATS_ERR;
    }
    if (out[0] == 0) {
        free(out);
        atomic_fetch_add(&c->zero_sigs, 1);
        atomic_fetch_add(&zero_sigs_total, 1);
        *err_txt = strdup("the nonce's signature begins with a zero byte, "
                          "which nats.c 3.4.1 would send as none: another "
                          "nonce is needed");
        return NATS_ERR;
    }
    *sig = out;
    *sig_len = (int)len;
    return NATS_OK;
}

int
evt_connect(const char *url, const struct evt_connect_opts *o,
            struct evt_conn **out, char **errmsg)
{
    static const struct evt_connect_opts defaults;
    char nkey_pub[EVT_NKEY_PUBLIC_CHARS + 1], nkey_id[EVT_IDENTITY_MAX + 1] = "";
    natsOptions *opts = NULL;
    struct evt_conn *c = NULL;
    natsStatus s;
    int rc = 0;

    if (!o)
        o = &defaults;
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    s = natsOptions_Create(&opts);
    if (s == NATS_OK) {
        /* "nats://a:1,nats://b:2": every server of a cluster, each its
         * own entry, so nats.c tries them all and reconnects to another
         * when one goes. */
        const char *servers[16];
        char *copy = strdup(url ? url : ""), *save = NULL;
        int n = 0;
        for (char *t = copy ? strtok_r(copy, ", ", &save) : NULL;
             t && n < (int)(sizeof(servers) / sizeof(servers[0]));
             t = strtok_r(NULL, ", ", &save))
            servers[n++] = t;
        if (n == 0)
            servers[n++] = url;
        s = natsOptions_SetServers(opts, servers, n);
        free(copy);
    }
    if (s == NATS_OK && o->name)
        s = natsOptions_SetName(opts, o->name);
    if (s == NATS_OK)
        s = natsOptions_SetSendAsap(opts, o->send_asap);
    if (s == NATS_OK)
        s = natsOptions_SetTimeout(opts, o->timeout_ms ? o->timeout_ms : 2000);
    if (s == NATS_OK && o->retry_forever) {
        s = natsOptions_SetMaxReconnect(opts, -1);
        if (s == NATS_OK)
            s = natsOptions_SetReconnectWait(opts, 250);
        /* Publishes made while disconnected wait in this buffer. */
        if (s == NATS_OK)
            s = natsOptions_SetReconnectBufSize(opts, 64 * 1024 * 1024);
    }
    if (s == NATS_OK && o->one_server) {
        s = natsOptions_SetIgnoreDiscoveredServers(opts, true);
        if (s == NATS_OK)
            s = natsOptions_SetAllowReconnect(opts, false);
    }
    if (s == NATS_OK && o->global_delivery)
        s = natsOptions_UseGlobalMessageDelivery(opts, true);
    if (o->nkey_file) {
        /* The public key nats.c sends with the signature; the seed is read
         * here once to derive it (and the identity the file names), and by
         * nats.c at every (re)connect to sign the server's nonce. */
        char seed[EVT_NKEY_SEED_CHARS + 1];
        rc = evt_nkey_read_seed(o->nkey_file, seed, nkey_pub, nkey_id);
        if (rc) {
            OPENSSL_cleanse(seed, sizeof(seed));
            if (errmsg)
                *errmsg = errmsg_dup("NATS nkey seed file %s: %s",
                                     o->nkey_file,
                                     rc == KS_EINVAL ? "no valid user seed "
                                                       "(SU...) in it"
                                                     : ks_strerror(rc));
            goto out;
        }
        /* nats.c's own Ed25519 (no libsodium in Debian's build) took
         * 3 ms to sign the nonce, a tenth of a whole `kscore exec`;
         * OpenSSL's takes about 0.1 ms. The key is kept for reconnects. */
        if (rc == 0 && s == NATS_OK) {
            uint8_t raw[32];
            rc = evt_nkey_decode_seed(seed, raw);
            if (rc == 0 &&
                !(c->nkey = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519,
                                                         NULL, raw, 32)))
                rc = KS_EINTERNAL;
            OPENSSL_cleanse(raw, sizeof(raw));
        }
        OPENSSL_cleanse(seed, sizeof(seed));
        if (rc) {
            if (errmsg)
                *errmsg = errmsg_dup("NATS nkey seed file %s: %s",
                                     o->nkey_file, ks_strerror(rc));
            goto out;
        }
        if (s == NATS_OK)
            s = natsOptions_SetNKey(opts, nkey_pub, sign_nonce, c);
    } else if (s == NATS_OK && o->user) {
        s = natsOptions_SetUserInfo(opts, o->user, o->password);
    }
    if (s == NATS_OK && o->token)
        s = natsOptions_SetToken(opts, o->token);
    if (s == NATS_OK && o->creds_file)
        s = natsOptions_SetUserCredentialsFromFiles(opts, o->creds_file, NULL);
    if (s == NATS_OK && (o->tls_ca || o->tls_cert)) {
        s = natsOptions_SetSecure(opts, true);
        if (s == NATS_OK && o->tls_ca)
            s = natsOptions_LoadCATrustedCertificates(opts, o->tls_ca);
        if (s == NATS_OK && o->tls_cert)
            s = natsOptions_LoadCertificatesChain(opts, o->tls_cert,
                                                  o->tls_key);
    }
    if (s != NATS_OK) {
        if (errmsg)
            *errmsg = errmsg_dup("bad NATS options: %s%s",
                                 nats_GetLastError(NULL), "");
        rc = KS_EINVAL;
        goto out;
    }
    {
        const char *id = o->identity  ? o->identity
                         : nkey_id[0] ? nkey_id
                         : o->user    ? o->user
                                      : "anonymous";
        size_t j = 0;
        for (size_t i = 0; id[i] && j + 1 < sizeof(c->identity); i++) {
            char ch = id[i];
            int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                     (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
            c->identity[j++] = ok ? ch : '_';
        }
        c->identity[j] = '\0';
        if (!j)
            snprintf(c->identity, sizeof(c->identity), "anonymous");
    }
    /* A service says when its connection goes and comes back: a revoked
     * credential, an expired certificate or a server away must show in
     * its log, not only as silence. */
    if (s == NATS_OK && o->retry_forever) {
        void *who = (void *)conn_name(c->identity);
        s = natsOptions_SetDisconnectedCB(opts, on_conn_event, who);
        if (s == NATS_OK)
            s = natsOptions_SetReconnectedCB(opts, on_conn_event, who);
        if (s == NATS_OK)
            s = natsOptions_SetClosedCB(opts, on_conn_event, who);
    }
    /* A connect given up in sign_nonce (a signature that nats.c 3.4.1
     * cannot send) is tried again at once: each try is a new connection
     * and so a new nonce. Only that case: a refused key is not retried. */
    for (int tries = 0; s == NATS_OK; tries++) {
        unsigned zeros = atomic_load(&c->zero_sigs);
        s = natsConnection_Connect(&c->nc, opts);
        if (s == NATS_OK || atomic_load(&c->zero_sigs) == zeros ||
            tries == 7)
            break;
        s = NATS_OK; /* try again */
    }
    if (s != NATS_OK) {
        if (errmsg)
            *errmsg = errmsg_dup("cannot connect to NATS at %s: %s", url,
                                 natsStatus_GetText(s));
        rc = KS_EUNAVAIL;
        goto out;
    }
    if ((rc = evt__mux_init(c))) {
        if (errmsg)
            *errmsg = errmsg_dup("%s%s", ks_strerror(rc), "");
        goto out;
    }
    s = natsConnection_JetStream(&c->js, c->nc, NULL);
    if (s != NATS_OK) {
        if (errmsg)
            *errmsg = errmsg_dup("JetStream context: %s%s",
                                 natsStatus_GetText(s), "");
        rc = KS_ENATS;
        goto out;
    }
out:
    natsOptions_Destroy(opts);
    if (rc) {
        evt_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

void
evt_close(struct evt_conn *c)
{
    if (!c)
        return;
    jsCtx_Destroy(c->js);
    if (c->nc) {
        natsConnection_FlushTimeout(c->nc, 500);
        natsConnection_Close(c->nc);
    }
    /* After the close: its read thread, joined, delivers to no inbox. */
    evt__mux_free(c);
    natsConnection_Destroy(c->nc);
    EVP_PKEY_free(c->nkey); /* after the connection: reconnects sign */
    free(c);
}

static int
add_or_update_stream(jsCtx *js, jsStreamConfig *sc, jsOptions *jo,
                     char **errmsg)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_AddStream(&si, js, sc, jo, &jerr);
    if (s != NATS_OK && jerr == JSStreamNameExistErr)
        s = js_UpdateStream(&si, js, sc, jo, &jerr);
    jsStreamInfo_Destroy(si);
    if (s != NATS_OK) {
        /* nats.c leaves no text for a request nobody answered */
        const char *why = nats_GetLastError(NULL);
        if (errmsg)
            *errmsg = errmsg_dup("cannot create stream %s: %s", sc->Name,
                                 why && why[0] ? why : natsStatus_GetText(s));
        return KS_ENATS;
    }
    return 0;
}

const char *const evt_part_names[EVT_PARTS] = {
    EVT_STREAM_CMDS, EVT_STREAM_EVENTS, "KV_" EVT_KV_AGENTS,
    EVT_STREAM_EVENTS "/" EVT_RECORDER_DURABLE};

int
evt_parts_missing(struct evt_conn *c, int timeout_ms, unsigned *missing_out)
{
    jsOptions jo;
    int first = 0;

    *missing_out = 0;
    jsOptions_Init(&jo);
    jo.Wait = timeout_ms;
    for (int i = 0; i < EVT_PARTS; i++) {
        jsErrCode jerr = 0;
        natsStatus s;
        if (i < 3) {
            jsStreamInfo *si = NULL;
            s = js_GetStreamInfo(&si, c->js, evt_part_names[i], &jo, &jerr);
            jsStreamInfo_Destroy(si);
        } else {
            jsConsumerInfo *ci = NULL;
            s = js_GetConsumerInfo(&ci, c->js, EVT_STREAM_EVENTS,
                                   EVT_RECORDER_DURABLE, &jo, &jerr);
            jsConsumerInfo_Destroy(ci);
        }
        if (s == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr ||
            jerr == JSConsumerNotFoundErr)
            *missing_out |= 1u << i;
        else if (s != NATS_OK && !first)
            first = evt_err(s);
    }
    return first;
}

int
evt_setup(struct evt_conn *c, char **errmsg)
{
    return evt_setup_replicas(c, 1, errmsg);
}

/* One try of evt_setup_replicas; jo: each stream request's wait (NULL:
 * the context's, 5 s). */
static int
setup_once(struct evt_conn *c, int replicas, jsOptions *jo, char **errmsg)
{
    jsStreamConfig sc;
    kvConfig kc;
    kvStore *kv = NULL;
    natsStatus s;
    int rc;

    jsStreamConfig_Init(&sc);
    sc.Name = EVT_STREAM_CMDS;
    sc.Subjects = (const char *[]){"kscore.cmd.>"};
    sc.SubjectsLen = 1;
    sc.Retention = js_WorkQueuePolicy;
    sc.Storage = js_FileStorage;
    sc.Duplicates = EVT_DUPLICATE_WINDOW_MS * NS_PER_MS;
    sc.MaxMsgSize = KS_MAX_MESSAGE_BYTES;
    /* Bounded (issue 21: one operator put 269 MB here for an offline
     * agent, kept until it acks, for good if it never comes back). Only
     * limits: a stream made before gets them in place (nats-server
     * changes limits and discard, never retention or storage). */
    sc.MaxBytes = EVT_CMDS_MAX_BYTES;
    sc.Discard = js_DiscardNew;
    sc.MaxAge = (int64_t)EVT_CMDS_MAX_AGE_MS * NS_PER_MS;
    /* No purge and no message delete through the API, for anyone: a
     * client may publish to a stream subject (an agent to its own) with a
     * reply address of its choosing, and the server sends the stream's
     * PubAck there from inside, with the account's rights; sent to
     * $JS.API.STREAM.PURGE.<stream> or ...MSG.DELETE.<stream>, that
     * {"stream":..,"seq":N} would purge or delete. The work queue's own
     * removal of acked messages is not an API delete. */
    sc.DenyDelete = true;
    sc.DenyPurge = true;
    sc.Replicas = replicas;
    rc = add_or_update_stream(c->js, &sc, jo, errmsg);
    if (rc)
        return rc;

    jsStreamConfig_Init(&sc);
    sc.Name = EVT_STREAM_EVENTS;
    sc.Subjects = (const char *[]){"kscore.evt.>"};
    sc.SubjectsLen = 1;
    /* PostgreSQL is the record; the stream only holds what the recorder
     * has not acked yet: interest retention drops an event once the
     * recorder's consumer (its only one) acks it, after the commit, so
     * an agent that floods reports fills nothing for good (issue 21:
     * 100 MB of one agent's events stayed stored for a day). At most
     * EVT_EVENTS_MAX_BYTES wait unrecorded (PostgreSQL down for long);
     * past that a publish is refused (discard new: nothing stored is
     * dropped) and agents keep their results in their outboxes and try
     * again. And a day at most, as before. */
    sc.Retention = js_InterestPolicy;
    sc.MaxBytes = EVT_EVENTS_MAX_BYTES;
    sc.Discard = js_DiscardNew;
    /* Each agent's share (EVT_EVENTS_PER_SUBJECT): past it only that
     * agent is refused. */
    sc.MaxMsgsPerSubject = EVT_EVENTS_PER_SUBJECT;
    sc.DiscardNewPerSubject = true;
    {
        /* A stream made by an older kscore keeps its retention (nats-server
         * cannot change it in place); it works as it did. */
        jsStreamInfo *old = NULL;
        if (js_GetStreamInfo(&old, c->js, EVT_STREAM_EVENTS, jo, NULL) ==
                NATS_OK &&
            old && old->Config->Retention != js_InterestPolicy)
            sc.Retention = old->Config->Retention;
        jsStreamInfo_Destroy(old);
    }
    sc.Storage = js_FileStorage;
    sc.Duplicates = EVT_DUPLICATE_WINDOW_MS * NS_PER_MS;
    sc.MaxAge = INT64_C(24) * 3600 * 1000 * NS_PER_MS;
    sc.MaxMsgSize = KS_MAX_MESSAGE_BYTES;
    sc.DenyDelete = true; /* as KSCORE_CMDS */
    sc.DenyPurge = true;
    sc.Replicas = replicas;
    rc = add_or_update_stream(c->js, &sc, jo, errmsg);
    if (rc)
        return rc;

    kvConfig_Init(&kc);
    kc.Bucket = EVT_KV_AGENTS;
    kc.History = 1;
    kc.TTL = EVT_AGENT_TTL_MS * NS_PER_MS;
    kc.StorageType = js_FileStorage;
    kc.Replicas = replicas;
    /* Made once; after that its stream is kscore's (below), which
     * js_CreateKeyValue would call "a different configuration". */
    s = js_KeyValue(&kv, c->js, EVT_KV_AGENTS);
    if (s != NATS_OK)
        s = js_CreateKeyValue(&kv, c->js, &kc);
    kvStore_Destroy(kv);
    if (s != NATS_OK) {
        if (errmsg)
            *errmsg = errmsg_dup("cannot create KV bucket %s: %s",
                                 EVT_KV_AGENTS, nats_GetLastError(NULL));
        return KS_ENATS;
    }
    /* The bucket's stream: no message delete through the API, and no
     * roll-up (kvConfig has no such options in nats.c 3.4.1). A roll-up
     * header is the publisher's choice, and an agent may publish its own
     * key: "Nats-Rollup: all" there removed every other entry (issue 21:
     * one agent credential emptied the registry). kscore only puts and
     * deletes keys (a delete is a marker message, which History 1 keeps
     * alone: evt_agent_forget), so it needs none. Purge stays allowed:
     * nats-server 2.9.10 refuses to turn deny_purge off again, and a
     * cluster node that replays the bucket's creation over a stream that
     * denies purge panics (jetstream_cluster.go processClusterCreateStream,
     * seen in test_cluster); no agent reaches the purge API (the
     * accounts). */
    {
        jsStreamInfo *si = NULL;
        char kvs[64];
        snprintf(kvs, sizeof(kvs), "KV_%s", EVT_KV_AGENTS);
        s = js_GetStreamInfo(&si, c->js, kvs, jo, NULL);
        /* A bucket made with fewer replicas (a stack that became a
         * cluster) is scaled here too: js_CreateKeyValue leaves an
         * existing bucket as it is. */
        if (s == NATS_OK && si &&
            (!si->Config->DenyDelete || si->Config->AllowRollup ||
             si->Config->Replicas != replicas)) {
            jsStreamInfo *nsi = NULL;
            si->Config->DenyDelete = true;
            si->Config->AllowRollup = false;
            si->Config->Replicas = replicas;
            s = js_UpdateStream(&nsi, c->js, si->Config, jo, NULL);
            jsStreamInfo_Destroy(nsi);
        }
        jsStreamInfo_Destroy(si);
        if (s != NATS_OK) {
            if (errmsg)
                *errmsg = errmsg_dup("cannot lock KV bucket %s: %s",
                                     EVT_KV_AGENTS, nats_GetLastError(NULL));
            return KS_ENATS;
        }
    }
    return 0;
}

int
evt_setup_replicas(struct evt_conn *c, int replicas, char **errmsg)
{
    /* A cluster that has just started has no JetStream meta leader for a
     * few seconds (elections), and until then every stream request fails
     * ("JetStream system temporarily unavailable", or no reply): a
     * replicated setup is tried again for up to 30 s. One node answers
     * at once or not at all, as before. */
    return evt_setup_wait(c, replicas, 30000, errmsg);
}

int
evt_setup_wait(struct evt_conn *c, int replicas, int wait_ms, char **errmsg)
{
    int64_t deadline = ks_mono_us() + (int64_t)wait_ms * 1000;
    int rc;

    jsOptions jo;
    jsOptions_Init(&jo);
    /* A request of a short wait waits no longer than the wait. */
    if (wait_ms > 0 && wait_ms < 5000)
        jo.Wait = wait_ms;
    if (replicas < 1)
        replicas = 1;
    for (;;) {
        char *why = NULL;
        rc = setup_once(c, replicas, &jo, &why);
        if (rc == 0 || replicas == 1 || ks_mono_us() >= deadline) {
            if (errmsg)
                *errmsg = why;
            else
                free(why);
            return rc;
        }
        free(why);
        struct timespec ts = {0, 250 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

int
evt__token_ok(const char *s, size_t max)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > max)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9') || ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

int
evt_agent_id_valid(const char *id)
{
    return evt__token_ok(id, EVT_AGENT_ID_MAX);
}

void
evt_event_subject(char *buf, size_t len, const char *agent_id,
                  const char *command_id)
{
    snprintf(buf, len, "kscore.evt.%s.%s",
             agent_id && agent_id[0] ? agent_id : "_",
             command_id && command_id[0] ? command_id : "_");
}

int
evt_event_subject_ok(const char *subject, const char *agent_id,
                     const char *command_id)
{
    char want[16 + EVT_AGENT_ID_MAX + 40];
    size_t n;

    if (!subject || !agent_id || !agent_id[0])
        return 0;
    evt_event_subject(want, sizeof(want), agent_id, command_id);
    if (strcmp(want, subject) == 0)
        return 1;
    /* "kscore.evt.<agent_id>.0": want with "0" for its last token. */
    n = strlen(want) - strlen(strrchr(want, '.')) + 1;
    return strncmp(want, subject, n) == 0 && strcmp(subject + n, "0") == 0;
}

int
evt_events_agents_at_share(struct evt_conn *c, int timeout_ms,
                           char ***ids_out, size_t *n_out)
{
    jsOptions jo;
    jsStreamInfo *si = NULL;
    char **ids = NULL;
    size_t n = 0;
    natsStatus s;

    *ids_out = NULL;
    *n_out = 0;
    jsOptions_Init(&jo);
    jo.Wait = timeout_ms;
    /* Only kscore.evt.<id>.0: the agents' own subjects, as mapped. */
    jo.Stream.Info.SubjectsFilter = "kscore.evt.*.0";
    s = js_GetStreamInfo(&si, c->js, EVT_STREAM_EVENTS, &jo, NULL);
    if (s != NATS_OK)
        return evt_err(s);
    const jsStreamStateSubjects *ss = si->State.Subjects;
    for (int i = 0; ss && i < ss->Count; i++) {
        const jsStreamStateSubject *e = &ss->List[i];
        if (e->Msgs < EVT_EVENTS_PER_SUBJECT)
            continue;
        char **v = realloc(ids, (n + 1) * sizeof(*ids));
        if (!v)
            break;
        ids = v;
        char id[EVT_AGENT_ID_MAX + 1];
        if (!evt_event_subject_agent(e->Subject, id, sizeof(id))[0])
            continue;
        if (!(ids[n] = strdup(id)))
            break;
        n++;
    }
    jsStreamInfo_Destroy(si);
    *ids_out = ids;
    *n_out = n;
    return 0;
}

void
evt_strv_free(char **v, size_t n)
{
    for (size_t i = 0; v && i < n; i++)
        free(v[i]);
    free(v);
}

char *
evt_event_subject_agent(const char *subject, char *buf, size_t len)
{
    static const char prefix[] = "kscore.evt.";
    size_t n;

    buf[0] = '\0';
    if (!subject || strncmp(subject, prefix, sizeof(prefix) - 1) != 0)
        return buf;
    subject += sizeof(prefix) - 1;
    n = strcspn(subject, ".");
    if (n == 0 || n >= len || n > EVT_AGENT_ID_MAX)
        return buf;
    memcpy(buf, subject, n);
    buf[n] = '\0';
    if (!evt_agent_id_valid(buf))
        buf[0] = '\0';
    return buf;
}

void
evt_cmd_subject(char *buf, size_t len, const char *pool, const char *agent_id)
{
    if (pool && pool[0])
        snprintf(buf, len, "kscore.cmd.%s.%s", pool, agent_id);
    else
        snprintf(buf, len, "kscore.cmd.%s", agent_id);
}

void
evt_pool_durable(char *buf, size_t len, const char *pool)
{
    snprintf(buf, len, "pool-%s", pool);
}

void
evt_pool_attest_id(char *buf, size_t len, const char *pool, uint32_t size)
{
    snprintf(buf, len, EVT_POOL_KEY_PREFIX "%s/%u", pool, size);
}

long
evt_pool_index(const char *pool, const char *id, uint32_t size)
{
    size_t pl = strlen(pool);
    const char *d;
    unsigned long n = 0;

    if (strncmp(id, pool, pl) != 0 || id[pl] != '-')
        return -1;
    d = id + pl + 1;
    if (!*d || (d[0] == '0' && d[1]) || strlen(d) > 9)
        return -1;
    for (; *d; d++) {
        if (*d < '0' || *d > '9')
            return -1;
        n = n * 10 + (unsigned long)(*d - '0');
    }
    return n < size ? (long)n : -1;
}

void
evt_agent_durable(char *buf, size_t len, const char *agent_id)
{
    snprintf(buf, len, "agent-%s", agent_id);
}

void
evt_deliver_subject(char *buf, size_t len, const char *durable)
{
    snprintf(buf, len, "_KSCORE.deliver.%s", durable);
}

/* Packs msg into a buffer of its exact size; KS_ETOOBIG past the limit. */
static int
pack_checked(const ProtobufCMessage *msg, uint8_t **buf, size_t *len)
{
    if (protobuf_c_message_get_packed_size(msg) > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    return kproto_pack(msg, buf, len);
}

/* One message's subject and de-duplication id, with their storage. */
struct cmd_msg {
    char subject[20 + 2 * EVT_AGENT_ID_MAX];
    char msg_id[64];
    uint8_t *buf;
    size_t len;
};

/* Signs and packs cmd into m: "<command_id>.<attempt>" as its Nats-Msg-Id
 * (the broker publishes a new attempt under a new id). */
static int
cmd_msg_make(const struct evt_signer *signer, const Ks__Command *cmd,
             const char *pool, struct cmd_msg *m)
{
    int rc = evt__sign_command(signer, cmd, &m->buf, &m->len);
    if (rc)
        return rc;
    evt_cmd_subject(m->subject, sizeof(m->subject), pool, cmd->agent_id);
    snprintf(m->msg_id, sizeof(m->msg_id), "%s.%u", cmd->command_id,
             cmd->attempt);
    return 0;
}

int
evt_publish_command(struct evt_conn *c, const struct evt_signer *signer,
                    const Ks__Command *cmd, const char *pool, int timeout_ms,
                    uint64_t *seq_out)
{
    struct cmd_msg m = {0};
    struct evt_puback ack = {0};
    int rc;

    if (seq_out)
        *seq_out = 0;
    if ((rc = cmd_msg_make(signer, cmd, pool, &m)))
        return rc;
    rc = evt_js_publish_as(c, NULL, m.subject, m.msg_id, m.buf, m.len,
                           timeout_ms, &ack, NULL, 0);
    free(m.buf);
    if (rc == 0 && seq_out)
        *seq_out = ack.seq;
    return rc;
}

int
evt_publish_commands(struct evt_conn *c, const struct evt_signer *signer,
                     Ks__Command *const *cmds, const char *const *pools,
                     size_t n, int timeout_ms, uint64_t *seqs_out,
                     int *rcs_out)
{
    struct cmd_msg m[EVT_JS_WINDOW_MAX];
    struct evt_js_msg w[EVT_JS_WINDOW_MAX];
    struct evt_puback ack[EVT_JS_WINDOW_MAX];
    size_t at[EVT_JS_WINDOW_MAX]; /* w[j] is cmds[at[j]] */
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    int failed = 0;

    /* A window at a time: each PubAck looked at (nats.c 3.4.1's
     * js_PublishAsync drops an error PubAck unless an error handler is
     * set, and the batch took such commands for published). */
    for (size_t off = 0; off < n; off += EVT_JS_WINDOW_MAX) {
        size_t k = n - off < EVT_JS_WINDOW_MAX ? n - off : EVT_JS_WINDOW_MAX;
        size_t nw = 0;
        int64_t left_ms = (deadline - ks_mono_us()) / 1000;

        for (size_t i = 0; i < k; i++) {
            const Ks__Command *cmd = cmds[off + i];
            struct cmd_msg *cm = &m[nw];
            memset(cm, 0, sizeof(*cm));
            int mrc = cmd_msg_make(signer, cmd, pools ? pools[off + i] : NULL,
                                   cm);
            if (rcs_out)
                rcs_out[off + i] = mrc;
            if (mrc != 0) {
                failed++; /* too large: never sent */
                continue;
            }
            memset(&ack[nw], 0, sizeof(ack[nw]));
            at[nw] = off + i;
            w[nw] = (struct evt_js_msg){cm->subject, cm->msg_id, cm->buf,
                                        cm->len, 0, &ack[nw], NULL, 0};
            nw++;
        }
        if (seqs_out)
            for (size_t i = 0; i < k; i++)
                seqs_out[off + i] = 0;
        if (nw)
            evt_js_publish_window(c, NULL, w, nw,
                                  left_ms > 0 ? (int)left_ms : 1);
        for (size_t i = 0; i < nw; i++) {
            failed += w[i].rc != 0;
            if (rcs_out)
                rcs_out[at[i]] = w[i].rc;
            if (seqs_out && w[i].rc == 0)
                seqs_out[at[i]] = ack[i].seq;
            free(m[i].buf);
        }
    }
    return failed;
}

int
evt_publish_event(struct evt_conn *c, const Ks__Event *ev, int timeout_ms)
{
    char subject[16 + EVT_AGENT_ID_MAX + 40];
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    rc = pack_checked(&ev->base, &buf, &len);
    if (rc)
        return rc;
    evt_event_subject(subject, sizeof(subject), ev->agent_id, ev->command_id);
    rc = evt_js_publish_as(c, NULL, subject, ev->event_id, buf, len,
                           timeout_ms, NULL, NULL, 0);
    free(buf);
    return rc;
}

int
evt_request(struct evt_conn *c, const char *subject,
            const ProtobufCMessage *msg, int timeout_ms, natsMsg **reply_out)
{
    return evt_request_as(c, NULL, subject, msg, timeout_ms, reply_out);
}

int
evt_publish_msg(struct evt_conn *c, const char *subject,
                const ProtobufCMessage *msg)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    natsStatus s;
    int rc;

    rc = pack_checked(msg, &buf, &len);
    if (rc)
        return rc;
    s = natsConnection_Publish(c->nc, subject, buf, (int)len);
    free(buf);
    return evt_err(s);
}

int
evt_publish_reply(struct evt_conn *c, const char *subject,
                  const ProtobufCMessage *msg)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    natsStatus s;

    /* Sized once (every API reply passes here, execute's included). */
    len = protobuf_c_message_get_packed_size(msg);
    if (len > EVT_REPLY_MAX_BYTES)
        return KS_ETOOBIG;
    if (!(buf = malloc(len ? len : 1)))
        return -ENOMEM;
    protobuf_c_message_pack(msg, buf);
    if (len <= EVT_PART_BYTES) {
        s = natsConnection_Publish(c->nc, subject, buf, (int)len);
        free(buf);
        return evt_err(s);
    }
    /* Larger than one NATS message: in parts, in order, to the one
     * subscriber of the reply inbox, which puts them back together
     * (request.c). Core NATS keeps the order of one publisher's messages
     * to one subscription. */
    size_t n = (len + EVT_PART_BYTES - 1) / EVT_PART_BYTES;
    char total[24], idx[24];
    snprintf(total, sizeof(total), "%zu", n);
    s = NATS_OK;
    for (size_t i = 0; i < n && s == NATS_OK; i++) {
        natsMsg *m = NULL;
        size_t off = i * EVT_PART_BYTES;
        size_t part = len - off < EVT_PART_BYTES ? len - off : EVT_PART_BYTES;
        snprintf(idx, sizeof(idx), "%zu", i + 1);
        s = natsMsg_Create(&m, subject, NULL, (const char *)buf + off,
                           (int)part);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, EVT_HDR_PARTS, total);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, EVT_HDR_PART, idx);
        if (s == NATS_OK)
            s = natsConnection_PublishMsg(c->nc, m);
        natsMsg_Destroy(m);
    }
    free(buf);
    return evt_err(s);
}

/*
 * 1 if m or a message inside it kept an unknown field numbered 0. Field 0
 * does not exist (protobuf encoding spec: field numbers start at 1), and
 * protobuf-c 1.4.1 refuses it as the one-byte tag 00 but accepts it spelt
 * as a longer varint (80 00) and keeps it; packing writes it back as 00,
 * which protobuf-c then refuses. Such a message decodes once and never
 * again: the recorder would re-pack it into the event log and leave a row
 * that no reader or replay can decode. Found by tests/fuzz/fuzz_unpack.
 * kscore.proto has no recursive message, so the depth is the schema's.
 */
static int
has_field_zero(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;

    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return 1;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *member = (const char *)m + f->offset;

        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n =
                *(const size_t *)((const char *)m + f->quantifier_offset);
            ProtobufCMessage *const *v =
                *(ProtobufCMessage *const *const *)member;
            for (size_t j = 0; j < n; j++)
                if (has_field_zero(v[j]))
                    return 1;
        } else {
            const ProtobufCMessage *sub = *(ProtobufCMessage *const *)member;
            if (sub && has_field_zero(sub))
                return 1;
        }
    }
    return 0;
}

int
evt_unpack(const ProtobufCMessageDescriptor *desc, const void *data,
           size_t len, ProtobufCMessage **out)
{
    int rc = evt_unpack_why(desc, data, len, out, NULL, 0);
    /* Without a caller to tell which field, a string kscore cannot carry
     * is one more way of being undecodable. */
    return rc == KS_EINVAL ? KS_EDECODE : rc;
}

int
evt_unpack_reply(const ProtobufCMessageDescriptor *desc, const void *data,
                 size_t len, ProtobufCMessage **out)
{
    ProtobufCMessage *m;
    if (len <= KS_MAX_MESSAGE_BYTES)
        return evt_unpack(desc, data, len, out);
    /* A reply put together from parts: from the broker the caller asked,
     * on the caller's own inbox; still bounded and checked. */
    if (len > EVT_REPLY_MAX_BYTES)
        return KS_ETOOBIG;
    if (evt_check_wire(desc, data, len, NULL, 0) != 0)
        return KS_EDECODE;
    m = protobuf_c_message_unpack(desc, NULL, len, data);
    if (!m)
        return KS_EDECODE;
    *out = m;
    return 0;
}

static int
unpack_checked(const ProtobufCMessageDescriptor *desc, const void *data,
               size_t len, ProtobufCAllocator *alloc, ProtobufCMessage **out,
               char *why, size_t why_len)
{
    ProtobufCMessage *m;
    int rc;
    if (len > KS_MAX_MESSAGE_BYTES)
        return KS_ETOOBIG;
    /* What the wire check cannot read is refused, never left to
     * protobuf-c: it reads some malformed forms (a field numbered 0 spelt
     * 80 00) and goes on, while the check stopped there, so the strings
     * after it went unchecked. A BatchRequest whose spec held such a
     * field carried a progress_subject of broken UTF-8 that decoded once
     * and, re-packed, never again (make fuzz, fuzz_unpack; the seed
     * corpus/unpack/wire-stop-hides-a-string). */
    rc = evt_check_wire(desc, data, len, why, why_len);
    if (rc)
        return rc == KS_EINVAL ? rc : KS_EDECODE;
    m = protobuf_c_message_unpack(desc, alloc, len, data);
    if (!m)
        return KS_EDECODE;
    if (has_field_zero(m)) {
        protobuf_c_message_free_unpacked(m, alloc);
        return KS_EDECODE;
    }
    *out = m;
    return 0;
}

int
evt_unpack_why(const ProtobufCMessageDescriptor *desc, const void *data,
               size_t len, ProtobufCMessage **out, char *why, size_t why_len)
{
    return unpack_checked(desc, data, len, NULL, out, why, why_len);
}

int
evt_unpack_in(const ProtobufCMessageDescriptor *desc, const void *data,
              size_t len, ProtobufCAllocator *alloc, ProtobufCMessage **out)
{
    int rc = unpack_checked(desc, data, len, alloc, out, NULL, 0);
    return rc == KS_EINVAL ? KS_EDECODE : rc;
}

int
evt_agents_kv(struct evt_conn *c, int wait_ms, kvStore **kv_out)
{
    jsOptions jo;
    jsCtx *js = NULL;
    natsStatus s;

    if (wait_ms <= 0)
        return evt_err(js_KeyValue(kv_out, c->js, EVT_KV_AGENTS));
    jsOptions_Init(&jo);
    jo.Wait = wait_ms;
    s = natsConnection_JetStream(&js, c->nc, &jo);
    if (s == NATS_OK)
        s = js_KeyValue(kv_out, js, EVT_KV_AGENTS);
    jsCtx_Destroy(js); /* the kvStore holds its own reference (kv.c) */
    return evt_err(s);
}

/* Puts info under key in the registry bucket as a plain publish to
 * "$KV.KSCORE_AGENTS.<key>" and waits for the PubAck on identity's inbox. */
static int
registry_put(struct evt_conn *c, const char *identity, const char *key,
             const Ks__AgentInfo *info, int timeout_ms)
{
    char subject[16 + sizeof(EVT_KV_AGENTS) + EVT_AGENT_ID_MAX];
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    if ((rc = pack_checked(&info->base, &buf, &len)))
        return rc;
    snprintf(subject, sizeof(subject), "$KV.%s.%s", EVT_KV_AGENTS, key);
    rc = evt_js_publish_as(c, identity, subject, NULL, buf, len, timeout_ms,
                           NULL, NULL, 0);
    free(buf);
    return rc;
}

int
evt_agent_put(struct evt_conn *c, const char *identity,
              const Ks__AgentInfo *info, int timeout_ms)
{
    if (!evt_agent_id_valid(info->agent_id))
        return KS_EINVAL;
    return registry_put(c, identity, info->agent_id, info, timeout_ms);
}

int
evt_pool_put(struct evt_conn *c, const char *identity,
             const Ks__AgentInfo *info, int timeout_ms)
{
    char key[sizeof(EVT_POOL_KEY_PREFIX) + EVT_AGENT_ID_MAX];

    if (!info->pool || !evt_agent_id_valid(info->pool))
        return KS_EINVAL;
    snprintf(key, sizeof(key), EVT_POOL_KEY_PREFIX "%s", info->pool);
    return registry_put(c, identity, key, info, timeout_ms);
}

/* An id without an entry of its own may be one of a pool's (evt_pool_put):
 * its pool is a prefix of it up to a '-', so each such prefix's entry is
 * looked at, the longest first. The pool's entry, as the id's (agent_id
 * set, pool_ids dropped), or KS_ENOTFOUND. */
static int
pool_member_get(kvStore *kv, const char *agent_id, Ks__AgentInfo **out)
{
    char key[sizeof(EVT_POOL_KEY_PREFIX) + EVT_AGENT_ID_MAX];
    size_t pl = strlen(EVT_POOL_KEY_PREFIX);

    for (const char *dash = strrchr(agent_id, '-'); dash && dash > agent_id;) {
        kvEntry *e = NULL;
        ProtobufCMessage *m = NULL;
        size_t n = (size_t)(dash - agent_id);
        snprintf(key, sizeof(key), "%s%.*s", EVT_POOL_KEY_PREFIX, (int)n,
                 agent_id);
        if (kvStore_Get(&e, kv, key) == NATS_OK) {
            int rc = evt_unpack(&ks__agent_info__descriptor, kvEntry_Value(e),
                                (size_t)kvEntry_ValueLen(e), &m);
            kvEntry_Destroy(e);
            Ks__AgentInfo *info = (Ks__AgentInfo *)m;
            bool member = false;
            for (size_t i = 0; rc == 0 && i < info->n_pool_ids; i++)
                member = member || strcmp(info->pool_ids[i], agent_id) == 0;
            if (member && info->pool && strlen(info->pool) == n &&
                strncmp(key + pl, info->pool, n) == 0) {
                char *id = strdup(agent_id);
                if (!id) {
                    ks__agent_info__free_unpacked(info, NULL);
                    return -ENOMEM;
                }
                for (size_t i = 0; i < info->n_pool_ids; i++)
                    free(info->pool_ids[i]);
                free(info->pool_ids);
                info->pool_ids = NULL;
                info->n_pool_ids = 0;
                if (info->agent_id != protobuf_c_empty_string)
                    free(info->agent_id);
                info->agent_id = id;
                *out = info;
                return 0;
            }
            if (rc == 0)
                ks__agent_info__free_unpacked(info, NULL);
        }
        while (--dash > agent_id && *dash != '-')
            ;
    }
    return KS_ENOTFOUND;
}

int
evt_agent_get(kvStore *kv, const char *agent_id, Ks__AgentInfo **out)
{
    kvEntry *e = NULL;
    ProtobufCMessage *m = NULL;
    natsStatus s;
    int rc;

    if (!evt_agent_id_valid(agent_id))
        return KS_ENOTFOUND;
    s = kvStore_Get(&e, kv, agent_id);
    if (s == NATS_NOT_FOUND)
        return pool_member_get(kv, agent_id, out);
    if (s != NATS_OK)
        return evt_err(s);
    rc = evt_unpack(&ks__agent_info__descriptor, kvEntry_Value(e),
                    (size_t)kvEntry_ValueLen(e), &m);
    kvEntry_Destroy(e);
    if (rc)
        return rc;
    *out = (Ks__AgentInfo *)m;
    return 0;
}

/* What of a consumer's config decides what it delivers where: any
 * difference here and it is replaced, not updated. */
static bool
delivers_otherwise(const jsConsumerConfig *have, const jsConsumerConfig *want)
{
    const char *hg = have->DeliverGroup ? have->DeliverGroup : "";
    const char *wg = want->DeliverGroup ? want->DeliverGroup : "";
    /* A pull consumer has no deliver subject. */
    const char *hd = have->DeliverSubject ? have->DeliverSubject : "";
    const char *wd = want->DeliverSubject ? want->DeliverSubject : "";

    return !have->FilterSubject ||
           strcmp(have->FilterSubject, want->FilterSubject) != 0 ||
           strcmp(hd, wd) != 0 ||
           strcmp(hg, wg) != 0 || have->AckPolicy != want->AckPolicy ||
           have->DeliverPolicy != want->DeliverPolicy || have->HeadersOnly ||
           have->FlowControl || have->Heartbeat != 0 ||
           have->RateLimit != 0 || have->BackOffLen != 0;
}

static bool
limits_differ(const jsConsumerConfig *have, const jsConsumerConfig *want)
{
    return have->AckWait != want->AckWait ||
           have->MaxDeliver != want->MaxDeliver ||
           have->MaxAckPending != want->MaxAckPending;
}

int
evt_consumer_ensure(struct evt_conn *c, const struct evt_durable *d,
                    enum evt_consumer_change *change_out, char **errmsg)
{
    jsConsumerConfig cc;
    jsConsumerInfo *ci = NULL;
    jsErrCode jerr = 0;
    char deliver[256];
    enum evt_consumer_change change = EVT_CONSUMER_KEPT;
    const char *step = "info";
    natsStatus s;

    evt_deliver_subject(deliver, sizeof(deliver), d->durable);
    jsConsumerConfig_Init(&cc);
    cc.Durable = d->durable;
    cc.DeliverSubject = d->pull ? NULL : deliver;
    cc.DeliverGroup = d->pull ? NULL : d->deliver_group;
    cc.FilterSubject = d->filter_subject;
    cc.AckPolicy = js_AckExplicit;
    cc.DeliverPolicy = js_DeliverAll;
    cc.MaxAckPending = d->max_ack_pending;
    cc.AckWait = d->ack_wait_ms * NS_PER_MS;
    cc.MaxDeliver = d->max_deliver ? d->max_deliver : -1;

    s = js_GetConsumerInfo(&ci, c->js, d->stream, d->durable, NULL, &jerr);
    if (s == NATS_NOT_FOUND || jerr == JSConsumerNotFoundErr) {
        change = EVT_CONSUMER_CREATED;
    } else if (s != NATS_OK) {
        goto out;
    } else if (delivers_otherwise(ci->Config, &cc)) {
        /* Never patched: delete, then create as asked. */
        step = "delete";
        change = EVT_CONSUMER_REPLACED;
        s = js_DeleteConsumer(c->js, d->stream, d->durable, NULL, &jerr);
        if (s == NATS_NOT_FOUND || jerr == JSConsumerNotFoundErr)
            s = NATS_OK; /* another broker got there first */
        if (s != NATS_OK)
            goto out;
    } else if (limits_differ(ci->Config, &cc)) {
        step = "update";
        change = EVT_CONSUMER_UPDATED;
        jsConsumerInfo_Destroy(ci);
        ci = NULL;
        jerr = 0;
        s = js_UpdateConsumer(&ci, c->js, d->stream, &cc, NULL, &jerr);
        goto out;
    } else {
        goto out; /* as asked */
    }
    jsConsumerInfo_Destroy(ci);
    ci = NULL;
    jerr = 0;
    step = "create";
    s = js_AddConsumer(&ci, c->js, d->stream, &cc, NULL, &jerr);
out:
    jsConsumerInfo_Destroy(ci);
    if (s != NATS_OK) {
        if (errmsg && asprintf(errmsg, "consumer %s (%s): %s", d->durable,
                               step, nats_GetLastError(NULL)) < 0)
            *errmsg = NULL;
        return KS_ENATS;
    }
    if (change_out)
        *change_out = change;
    return 0;
}

int
evt_durable_subscribe(struct evt_conn *c, const struct evt_durable *d,
                      natsMsgHandler cb, void *ud, natsSubscription **sub_out,
                      char **errmsg)
{
    jsSubOptions so;
    jsErrCode jerr = 0;
    natsSubscription *sub = NULL;
    natsStatus s;
    int rc;

    rc = evt_consumer_ensure(c, d, NULL, errmsg);
    if (rc)
        return rc;
    jsSubOptions_Init(&so);
    so.Stream = d->stream;
    so.Consumer = d->durable; /* bound: nats.c never deletes it */
    if (d->pull) {
        BUG_ON(cb);
        s = js_PullSubscribe(&sub, c->js, d->filter_subject, d->durable,
                             NULL, &so, &jerr);
    } else {
        so.Queue = d->deliver_group;
        so.ManualAck = true;
        s = js_Subscribe(&sub, c->js, d->filter_subject, cb, ud, NULL, &so,
                         &jerr);
        if (s == NATS_OK)
            s = natsSubscription_SetPendingLimits(sub, -1, -1);
    }
    if (s != NATS_OK) {
        if (errmsg)
            *errmsg = errmsg_dup("consumer %s: %s", d->durable,
                                 nats_GetLastError(NULL));
        natsSubscription_Destroy(sub);
        return KS_ENATS;
    }
    *sub_out = sub;
    return 0;
}

int
evt_consumer_delete(struct evt_conn *c, const char *stream,
                    const char *durable)
{
    jsErrCode jerr = 0;
    natsStatus s = js_DeleteConsumer(c->js, stream, durable, NULL, &jerr);
    if (s == NATS_NOT_FOUND || jerr == JSConsumerNotFoundErr)
        return KS_ENOTFOUND;
    return s == NATS_OK ? 0 : KS_ENATS;
}

int
evt_fetch(natsSubscription *sub, int batch, int wait_ms, natsMsgList *out)
{
    jsFetchRequest req;
    natsStatus s;

    BUG_ON(batch < 1 || batch > EVT_FETCH_MAX || wait_ms < 1);
    jsFetchRequest_Init(&req);
    req.Batch = batch;
    req.NoWait = true;
    req.Expires = (int64_t)wait_ms * NS_PER_MS;
    s = natsSubscription_FetchRequest(out, sub, &req);
    if (s == NATS_OK)
        return out->Count > 0 ? 0 : KS_ETIMEDOUT;
    /* 404 (nothing, no wait) and 408 (expired, or other requests first)
     * are both "nothing now". */
    if (s == NATS_TIMEOUT || s == NATS_NOT_FOUND)
        return KS_ETIMEDOUT;
    return evt_err(s);
}

uint64_t
evt_agent_ack_wait_ms(uint64_t ack_wait_ms)
{
    if (ack_wait_ms == 0)
        return EVT_AGENT_ACK_WAIT_DEFAULT_MS;
    if (ack_wait_ms < EVT_AGENT_ACK_WAIT_MIN_MS)
        return EVT_AGENT_ACK_WAIT_MIN_MS;
    if (ack_wait_ms > EVT_AGENT_ACK_WAIT_MAX_MS)
        return EVT_AGENT_ACK_WAIT_MAX_MS;
    return ack_wait_ms;
}

/* What every agent or pool consumer shares: the stream, the name and
 * filter already in out, the queue group, and the limits. */
static void
agent_consumer_limits(struct evt_agent_consumer *out, uint32_t max_concurrent,
                      uint64_t ack_wait_ms)
{
    out->d.stream = EVT_STREAM_CMDS;
    out->d.durable = out->durable;
    out->d.filter_subject = out->filter;
    /* Processes serving the same id (or pool) share its messages. */
    out->d.deliver_group = out->durable;
    out->d.max_ack_pending =
        max_concurrent < 1 ? 1
        : max_concurrent > EVT_AGENT_MAX_ACK_PENDING
            ? EVT_AGENT_MAX_ACK_PENDING
            : (int64_t)max_concurrent;
    out->d.ack_wait_ms = (int64_t)evt_agent_ack_wait_ms(ack_wait_ms);
    out->d.max_deliver = EVT_AGENT_MAX_DELIVER;
}

void
evt_agent_consumer(struct evt_agent_consumer *out, const char *agent_id,
                   uint32_t max_concurrent, uint64_t ack_wait_ms)
{
    memset(out, 0, sizeof(*out));
    evt_agent_durable(out->durable, sizeof(out->durable), agent_id);
    evt_cmd_subject(out->filter, sizeof(out->filter), NULL, agent_id);
    agent_consumer_limits(out, max_concurrent, ack_wait_ms);
}

void
evt_pool_consumer(struct evt_agent_consumer *out, const char *pool,
                  uint32_t max_concurrent, uint64_t ack_wait_ms)
{
    memset(out, 0, sizeof(*out));
    evt_pool_durable(out->durable, sizeof(out->durable), pool);
    evt_cmd_subject(out->filter, sizeof(out->filter), pool, "*");
    agent_consumer_limits(out, max_concurrent, ack_wait_ms);
}
