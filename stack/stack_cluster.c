/* The local stack as a JetStream cluster (`kscore up --cluster N`): N
 * nats-server nodes with routes on loopback, each in <home>/nats-<i>/. */
#include "stack.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "events.h"
#include "kproto.h"

static void
sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

static int
write_port(const char *dir, const char *file, int port)
{
    char path[4400];
    FILE *f;
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    if (!(f = fopen(path, "we")))
        return -errno;
    fprintf(f, "%d\n", port);
    return fclose(f) == 0 ? 0 : -errno;
}

int
stack_cluster_nodes(const char *home, unsigned n, struct stack_node *out)
{
    if (n < 1 || n > STACK_CLUSTER_MAX)
        return KS_EINVAL;
    for (unsigned i = 0; i < n; i++) {
        struct stack_node *nd = &out[i];
        memset(nd, 0, sizeof(*nd));
        nd->index = i + 1;
        snprintf(nd->dir, sizeof(nd->dir), "%s/nats-%u", home, i + 1);
        snprintf(nd->name, sizeof(nd->name), "nats-%u", i + 1);
        nd->port = stack_read_port(nd->dir, "nats.port");
        nd->route_port = stack_read_port(nd->dir, "route.port");
        /* No HTTP monitoring port (stack_nats_monitor asks over NATS):
         * a monitor.port kept by an older kscore is not read. */
        nd->mon_port = 0;
        snprintf(nd->url, sizeof(nd->url), "nats://127.0.0.1:%d", nd->port);
        nd->running = stack_pidfile_alive(nd->dir, "nats", &nd->pid) == 1;
    }
    return 0;
}

/* A port for a node that starts: the kept one when it is free, else a new
 * free one that no other node uses. 0 when there is none. */
static int
pick_port(int kept, const int *taken, size_t n_taken)
{
    if (kept > 0 && stack_port_free(kept) == 1) {
        bool dup = false;
        for (size_t i = 0; i < n_taken; i++)
            dup = dup || taken[i] == kept;
        if (!dup)
            return kept;
    }
    for (int tries = 0; tries < 50; tries++) {
        int p = stack_free_port();
        bool dup = false;
        if (p <= 0)
            return 0;
        for (size_t i = 0; i < n_taken; i++)
            dup = dup || taken[i] == p;
        if (!dup)
            return p;
    }
    return 0;
}

int
stack_cluster_start(const char *home, unsigned n, struct stack_node *nodes,
                    const char *conf_extra, char *moved, size_t moved_len)
{
    int taken[3 * STACK_CLUSTER_MAX];
    size_t nt = 0;
    int rc;

    if (moved && moved_len)
        moved[0] = '\0';
    /* The running nodes keep their ports; the others get theirs back when
     * free. Every route port is known before the first node starts, so
     * each node's routes name all the others. */
    for (unsigned i = 0; i < n; i++)
        if (nodes[i].running) {
            taken[nt++] = nodes[i].port;
            taken[nt++] = nodes[i].route_port;
        }
    for (unsigned i = 0; i < n; i++) {
        struct stack_node *nd = &nodes[i];
        int want[2] = {nd->port, nd->route_port};
        if (nd->running)
            continue;
        nd->port = pick_port(nd->port, taken, nt);
        taken[nt++] = nd->port;
        nd->route_port = pick_port(nd->route_port, taken, nt);
        taken[nt++] = nd->route_port;
        if (!nd->port || !nd->route_port)
            return KS_EUNAVAIL;
        snprintf(nd->url, sizeof(nd->url), "nats://127.0.0.1:%d", nd->port);
        if (want[0] > 0 && want[0] != nd->port && moved && moved_len) {
            size_t l = strlen(moved);
            snprintf(moved + l, moved_len - l, "%s%s: %d -> %d",
                     l ? ", " : "", nd->name, want[0], nd->port);
        }
    }
    /* The routes' password: a route carries every message of every
     * account and may send any (a server trusts its peers), and a port on
     * loopback is open to every user of the host, so a node takes a route
     * only from who knows it (issue 21: without it a local user joined
     * the routes and read the stack's messages). Made once, kept. */
    char secret_path[4300], secret[EVT_TOKEN_MAX + 1];
    snprintf(secret_path, sizeof(secret_path), "%s/keys/" STACK_ROUTE_SECRET,
             home);
    if (access(secret_path, F_OK) != 0) {
        char keys[4200];
        snprintf(keys, sizeof(keys), "%s/keys", home);
        if ((rc = stack_mkdirs(keys, 0700)) ||
            (rc = evt_token_file_make(secret_path)))
            return rc;
    }
    if ((rc = evt_token_file_read(secret_path, secret, sizeof(secret), NULL)))
        return rc;
    for (unsigned i = 0; i < n; i++) {
        struct stack_node *nd = &nodes[i];
        char *extra = NULL, routes[(96 + EVT_TOKEN_MAX) * STACK_CLUSTER_MAX] =
                                "";
        size_t rl = 0;
        char *url = NULL;
        if (nd->running)
            continue;
        if ((rc = stack_mkdirs(nd->dir, 0700)) ||
            (rc = stack_nats_auth_write(nd->dir, home)))
            return rc;
        for (unsigned j = 0; j < n; j++)
            if (j != i)
                rl += (size_t)snprintf(
                    routes + rl, sizeof(routes) - rl,
                    "%s\"nats-route://route:%s@127.0.0.1:%d\"",
                    rl ? ", " : "", secret, nodes[j].route_port);
        /* Routes bind loopback and want the routes' password (nats.conf
         * is 0600). No HTTP monitoring port: nats-server 2.9 asks no
         * credential there, and /connz lists every user
         * (stack_nats_monitor asks over NATS instead). */
        if (asprintf(&extra,
                     "%scluster {\n  name: kscore\n"
                     "  listen: \"127.0.0.1:%d\"\n"
                     "  authorization {\n    user: route\n"
                     "    password: \"%s\"\n    timeout: 2\n  }\n"
                     "  routes: [%s]\n}\n",
                     conf_extra ? conf_extra : "", nd->route_port, secret,
                     routes) < 0)
            return -ENOMEM;
        rc = stack_nats_start_named(nd->dir, "127.0.0.1", nd->port, nd->name,
                                    NULL, extra, &url, &nd->pid);
        free(extra);
        free(url);
        if (rc)
            return rc;
        write_port(nd->dir, "route.port", nd->route_port);
        nd->running = true;
        nd->started = true;
    }
    return 0;
}

int
stack_cluster_urls(const struct stack_node *nodes, unsigned n, char **out)
{
    size_t cap = (size_t)n * 32 + 1, l = 0;
    char *s = malloc(cap);
    if (!s)
        return -ENOMEM;
    s[0] = '\0';
    for (unsigned i = 0; i < n; i++)
        l += (size_t)snprintf(s + l, cap - l, "%snats://127.0.0.1:%d",
                              i ? "," : "", nodes[i].port);
    *out = s;
    return 0;
}

int
stack_http_get(int port, const char *path, int timeout_ms, char **body_out)
{
    return stack_http_get_auth(port, path, NULL, timeout_ms, body_out);
}

int
stack_http_get_auth(int port, const char *path, const char *bearer,
                    int timeout_ms, char **body_out)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    char req[1024], *buf = NULL, *body;
    size_t len = 0, cap = 0;
    int fd, rc = KS_EUNAVAIL;

    *body_out = NULL;
    if (port <= 0 || port > 65535)
        return KS_EINVAL;
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd == -1)
        return -errno;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == -1)
        goto out;
    /* HTTP/1.0: the server closes after the answer, so its end is EOF. */
    bool auth = bearer && bearer[0];
    int rl = snprintf(req, sizeof(req),
                      "GET %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n%s%s%s\r\n",
                      path, port, auth ? "Authorization: Bearer " : "",
                      auth ? bearer : "", auth ? "\r\n" : "");
    if (rl < 0 || (size_t)rl >= sizeof(req))
        goto out;
    if (write(fd, req, (size_t)rl) != rl)
        goto out;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *nb = realloc(buf, cap = cap ? cap * 2 : 16384);
            if (!nb) {
                rc = -ENOMEM;
                goto out;
            }
            buf = nb;
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            rc = errno == EAGAIN ? KS_ETIMEDOUT : -errno;
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    if (!buf)
        goto out;
    buf[len] = '\0';
    if (strncmp(buf, "HTTP/1.", 7) != 0 || strncmp(buf + 9, "200", 3) != 0 ||
        !(body = strstr(buf, "\r\n\r\n")))
        goto out;
    body += 4;
    memmove(buf, body, strlen(body) + 1);
    *body_out = buf;
    buf = NULL;
    rc = 0;
out:
    free(buf);
    close(fd);
    return rc;
}

/* The home of a node: the parent of its dir ("<home>/nats" or
 * "<home>/nats-<i>"). */
static void
node_home(const struct stack_node *nd, char *buf, size_t len)
{
    const char *slash = strrchr(nd->dir, '/');
    size_t n = slash ? (size_t)(slash - nd->dir) : 0;
    if (n >= len)
        n = len - 1;
    memcpy(buf, nd->dir, n);
    buf[n] = '\0';
}

/* The monitoring answer over NATS: $SYS.REQ.SERVER.<id>.<WHAT> of the
 * server the system user reaches at nd->url (events.go 2.9: the answer
 * is {"server": {...}, "data": <what its HTTP port says>}). */
static int
monitor_nats(const struct stack_node *nd, const char *what, unsigned flags,
             int timeout_ms, json_t **out)
{
    char home[4200], seed[4400], id[128], subject[200], body[256];
    char *ca, *cert, *key, *err = NULL;
    struct evt_conn *c = NULL;
    natsMsg *reply = NULL;
    json_t *j = NULL;
    int rc;

    node_home(nd, home, sizeof(home));
    if (!nd->url[0] ||
        stack_ident_seed_path(home, STACK_SYSTEM, "system", seed,
                              sizeof(seed)) != 0 ||
        access(seed, R_OK) != 0)
        return KS_ENOTFOUND; /* a stack from before the system user */
    ca = stack_env_get(home, "KSCORE_NATS_TLS_CA");
    cert = stack_env_get(home, "KSCORE_NATS_TLS_CERT");
    key = stack_env_get(home, "KSCORE_NATS_TLS_KEY");
    /* This node's answer only: a connection that went over to another
     * node would ask that one (test_cluster check_status: node 3's row
     * named nats-2). */
    struct evt_connect_opts o = {.name = "kscore-monitor",
                                 .send_asap = true,
                                 .one_server = true,
                                 .timeout_ms = timeout_ms,
                                 .nkey_file = seed,
                                 .tls_ca = ca,
                                 .tls_cert = cert && key ? cert : NULL,
                                 .tls_key = cert && key ? key : NULL};
    rc = evt_connect(nd->url, &o, &c, &err);
    free(err);
    free(ca);
    free(cert);
    free(key);
    if (rc)
        return rc == KS_ETIMEDOUT ? rc : KS_EUNAVAIL;
    if (natsConnection_GetConnectedServerId(c->nc, id, sizeof(id)) !=
        NATS_OK) {
        rc = KS_EUNAVAIL;
        goto out;
    }
    snprintf(subject, sizeof(subject), "$SYS.REQ.SERVER.%s.%s", id, what);
    /* JSzOptions and ConnzOptions (monitor.go 2.9: "consumer", not
     * "consumers"; each ignores the other's fields). */
    snprintf(body, sizeof(body), "{\"accounts\":%s,\"streams\":%s,"
             "\"consumer\":%s,\"config\":%s,\"subscriptions\":%s,"
             "\"limit\":%d}",
             flags & STACK_MON_ACCOUNTS ? "true" : "false",
             flags & STACK_MON_STREAMS ? "true" : "false",
             flags & STACK_MON_CONSUMERS ? "true" : "false",
             flags & STACK_MON_CONFIG ? "true" : "false",
             flags & STACK_MON_SUBS ? "true" : "false", STACK_MON_LIMIT);
    if (natsConnection_RequestString(&reply, c->nc, subject, body,
                                     timeout_ms) != NATS_OK) {
        rc = KS_ETIMEDOUT;
        goto out;
    }
    /* As reals: an account's reserved_memory is 2^64-1, past jansson's
     * integers. */
    j = json_loadb(natsMsg_GetData(reply),
                   (size_t)natsMsg_GetDataLength(reply),
                   JSON_DECODE_INT_AS_REAL, NULL);
    if (!json_is_object(json_object_get(j, "data"))) {
        rc = KS_EDECODE;
        goto out;
    }
    *out = json_incref(json_object_get(j, "data"));
    rc = 0;
out:
    json_decref(j);
    natsMsg_Destroy(reply);
    evt_close(c);
    return rc;
}

/* The same from a node's HTTP monitoring port (a node of the deploy
 * files, deploy/cluster: nd->mon_port > 0). */
static int
monitor_http(const struct stack_node *nd, const char *what, unsigned flags,
             int timeout_ms, json_t **out)
{
    char path[160], *body = NULL;
    size_t n = (size_t)snprintf(path, sizeof(path), "/%s?", what);
    for (char *p = path + 1; *p; p++)
        *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
    if (flags & STACK_MON_ACCOUNTS)
        n += (size_t)snprintf(path + n, sizeof(path) - n, "accounts=true&");
    if (flags & STACK_MON_STREAMS)
        n += (size_t)snprintf(path + n, sizeof(path) - n, "streams=true&");
    if (flags & STACK_MON_CONSUMERS)
        n += (size_t)snprintf(path + n, sizeof(path) - n, "consumers=true&");
    if (flags & STACK_MON_CONFIG)
        n += (size_t)snprintf(path + n, sizeof(path) - n, "config=true&");
    if (flags & STACK_MON_SUBS)
        n += (size_t)snprintf(path + n, sizeof(path) - n, "subs=1&");
    snprintf(path + n, sizeof(path) - n, "limit=%d", STACK_MON_LIMIT);
    int rc = stack_http_get(nd->mon_port, path, timeout_ms, &body);
    if (rc)
        return rc;
    *out = json_loads(body, JSON_DECODE_INT_AS_REAL, NULL);
    free(body);
    if (!json_is_object(*out)) {
        json_decref(*out);
        *out = NULL;
        return KS_EDECODE;
    }
    return 0;
}

int
stack_single_node(const char *home, struct stack_node *out)
{
    char *url = stack_env_get(home, "KSCORE_NATS_URL");
    memset(out, 0, sizeof(*out));
    /* Its files are in home itself (stack_nats_start); dir only names
     * home as its parent, as a node's does. */
    snprintf(out->dir, sizeof(out->dir), "%s/nats", home);
    snprintf(out->name, sizeof(out->name), "nats");
    out->port = stack_nats_saved_port(home);
    out->running = stack_pidfile_alive(home, "nats", &out->pid) == 1;
    if (!url || strlen(url) >= sizeof(out->url)) {
        free(url);
        return KS_ENOTFOUND;
    }
    snprintf(out->url, sizeof(out->url), "%s", url);
    free(url);
    return 0;
}

int
stack_nats_monitor(const struct stack_node *nd, const char *what,
                   unsigned flags, int timeout_ms, json_t **out)
{
    *out = NULL;
    return nd->mon_port > 0 ? monitor_http(nd, what, flags, timeout_ms, out)
                            : monitor_nats(nd, what, flags, timeout_ms, out);
}

int
stack_nats_js_info(const struct stack_node *nd, struct stack_js_info *out)
{
    json_t *j = NULL;
    int rc;

    memset(out, 0, sizeof(*out));
    if ((rc = stack_nats_monitor(nd, "VARZ", 0, 2000, &j)))
        return rc;
    snprintf(out->server_name, sizeof(out->server_name), "%s",
             json_string_value(json_object_get(j, "server_name"))
                 ? json_string_value(json_object_get(j, "server_name"))
                 : "");
    out->mem_bytes = (long long)json_number_value(json_object_get(j, "mem"));
    json_decref(j);
    if ((rc = stack_nats_monitor(nd, "JSZ", 0, 2000, &j)))
        return rc;
    json_t *meta = json_object_get(j, "meta_cluster");
    const char *leader = json_string_value(json_object_get(meta, "leader"));
    snprintf(out->meta_leader, sizeof(out->meta_leader), "%s",
             leader ? leader : "");
    out->cluster_size =
        (int)json_number_value(json_object_get(meta, "cluster_size"));
    out->streams = (int)json_number_value(json_object_get(j, "streams"));
    out->consumers = (int)json_number_value(json_object_get(j, "consumers"));
    json_decref(j);
    return 0;
}

const char *
stack_js_role(const struct stack_js_info *ji)
{
    if (!ji->meta_leader[0])
        return "no-leader";
    return strcmp(ji->meta_leader, ji->server_name) == 0 ? "leader"
                                                         : "follower";
}

int
stack_cluster_wait_leader(const struct stack_node *nodes, unsigned n,
                          int timeout_ms, char *leader, size_t len)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    /* Every running node must name the same leader: a node started
     * again has then rejoined the meta group, not only its peers. */
    do {
        char first[64] = "";
        bool all = true;
        for (unsigned i = 0; i < n && all; i++) {
            struct stack_js_info ji;
            if (!nodes[i].running)
                continue;
            if (stack_nats_js_info(&nodes[i], &ji) != 0 ||
                !ji.meta_leader[0] ||
                (first[0] && strcmp(first, ji.meta_leader) != 0))
                all = false;
            else
                snprintf(first, sizeof(first), "%s", ji.meta_leader);
        }
        if (all && first[0]) {
            if (leader && len)
                snprintf(leader, len, "%s", first);
            return 0;
        }
        sleep_ms(200);
    } while (ks_mono_us() < deadline);
    return KS_ETIMEDOUT;
}

const char *const stack_stream_names[STACK_STREAMS] = {
    "KSCORE_CMDS", "KSCORE_EVENTS", "KV_KSCORE_AGENTS"};

int
stack_js_parts(const struct stack_node *nd, unsigned *present)
{
    json_t *j, *acc, *st, *co;
    size_t ai, si, ci;
    int rc;

    *present = 0;
    if ((rc = stack_nats_monitor(nd, "JSZ",
                                 STACK_MON_ACCOUNTS | STACK_MON_STREAMS |
                                     STACK_MON_CONSUMERS,
                                 2000, &j)))
        return rc;
    json_array_foreach(json_object_get(j, "account_details"), ai, acc)
    {
        json_array_foreach(json_object_get(acc, "stream_detail"), si, st)
        {
            const char *name = json_string_value(json_object_get(st, "name"));
            for (int k = 0; name && k < 3; k++)
                if (strcmp(name, evt_part_names[k]) == 0)
                    *present |= 1u << k;
            if (!name || strcmp(name, EVT_STREAM_EVENTS) != 0)
                continue;
            json_array_foreach(json_object_get(st, "consumer_detail"), ci, co)
            {
                const char *cn =
                    json_string_value(json_object_get(co, "name"));
                if (cn && strcmp(cn, EVT_RECORDER_DURABLE) == 0)
                    *present |= 1u << 3;
            }
        }
    }
    json_decref(j);
    return 0;
}

/* One node's view of the stack streams it holds, merged into out: a
 * stream's entry is taken from the node that calls itself its leader. */
static int
node_streams(const struct stack_node *nd, struct stack_stream_state *out)
{
    json_t *j, *accs, *acc;
    size_t ai, si;
    int rc;

    if ((rc = stack_nats_monitor(nd, "JSZ",
                                 STACK_MON_ACCOUNTS | STACK_MON_STREAMS, 2000,
                                 &j)))
        return rc;
    accs = json_object_get(j, "account_details");
    json_array_foreach(accs, ai, acc)
    {
        json_t *st;
        json_array_foreach(json_object_get(acc, "stream_detail"), si, st)
        {
            const char *name = json_string_value(json_object_get(st, "name"));
            json_t *cl = json_object_get(st, "cluster"), *state, *rp;
            const char *leader =
                json_string_value(json_object_get(cl, "leader"));
            size_t ri;
            for (int k = 0; name && k < STACK_STREAMS; k++) {
                struct stack_stream_state *o = &out[k];
                if (strcmp(name, stack_stream_names[k]) != 0 || !leader ||
                    strcmp(leader, nd->name) != 0)
                    continue;
                snprintf(o->leader, sizeof(o->leader), "%s", leader);
                state = json_object_get(st, "state");
                o->messages = (long long)json_number_value(
                    json_object_get(state, "messages"));
                o->last_seq = (long long)json_number_value(
                    json_object_get(state, "last_seq"));
                o->replicas = o->current = 0;
                o->behind[0] = '\0';
                json_array_foreach(json_object_get(cl, "replicas"), ri, rp)
                {
                    const char *rn =
                        json_string_value(json_object_get(rp, "name"));
                    o->replicas++;
                    if (json_is_true(json_object_get(rp, "current"))) {
                        o->current++;
                    } else {
                        size_t l = strlen(o->behind);
                        snprintf(o->behind + l, sizeof(o->behind) - l,
                                 "%s%s", l ? "," : "", rn ? rn : "?");
                    }
                }
            }
        }
    }
    json_decref(j);
    return 0;
}

int
stack_cluster_streams(const struct stack_node *nodes, unsigned n,
                      struct stack_stream_state *out)
{
    int answered = 0;
    for (int k = 0; k < STACK_STREAMS; k++) {
        memset(&out[k], 0, sizeof(out[k]));
        snprintf(out[k].name, sizeof(out[k].name), "%s",
                 stack_stream_names[k]);
    }
    for (unsigned i = 0; i < n; i++)
        if (nodes[i].running && node_streams(&nodes[i], out) == 0)
            answered++;
    return answered ? 0 : KS_EUNAVAIL;
}

int
stack_cluster_wait_streams(const struct stack_node *nodes, unsigned n,
                           bool all_current, int timeout_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)timeout_ms * 1000;
    do {
        struct stack_stream_state ss[STACK_STREAMS];
        bool ok = stack_cluster_streams(nodes, n, ss) == 0;
        for (int k = 0; ok && k < STACK_STREAMS; k++)
            ok = ss[k].leader[0] &&
                 (!all_current || ss[k].current == ss[k].replicas);
        if (ok)
            return 0;
        sleep_ms(200);
    } while (ks_mono_us() < deadline);
    return KS_ETIMEDOUT;
}

/* A "Vm...:" line of /proc/<pid>/status in kB, or -1. */
static long
status_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    size_t fl = strlen(field);
    long kb = -1;
    FILE *f;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    if (!(f = fopen(path, "re")))
        return -1;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, field, fl) == 0 && line[fl] == ':' &&
            sscanf(line + fl + 1, " %ld kB", &kb) == 1)
            break;
    fclose(f);
    return kb;
}

long
stack_rss_kb(pid_t pid)
{
    return status_kb(pid, "VmRSS");
}

long
stack_rss_peak_kb(pid_t pid)
{
    return status_kb(pid, "VmHWM");
}
