/* kscore up, down, status (the local stack) and the broker and agent
 * services. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"
#include "broker.h"
#include "cli_int.h"
#include "metrics_http.h"
#include "stack.h"
#include "store.h"

/* `up --cluster N` runs this many brokers (the queue group kscore-broker
 * shares requests, batch leases in PostgreSQL share batches). */
#define CLUSTER_BROKERS 2

/* The parts of a stack of `cluster` nodes (0: one nats-server): "nats" or
 * "nats-1".."nats-N", "pg", "broker" or "broker-1".."broker-2", "agent".
 * Returns how many. */
static size_t
part_names(unsigned cluster, char names[][16])
{
    size_t n = 0;
    if (!cluster)
        snprintf(names[n++], 16, "nats");
    for (unsigned i = 1; i <= cluster; i++)
        snprintf(names[n++], 16, "nats-%u", i);
    snprintf(names[n++], 16, "pg");
    if (!cluster)
        snprintf(names[n++], 16, "broker");
    for (unsigned i = 1; cluster && i <= CLUSTER_BROKERS; i++)
        snprintf(names[n++], 16, "broker-%u", i);
    snprintf(names[n++], 16, "agent");
    return n;
}

/* A part's pid file: a cluster node's is <home>/nats-<i>/nats.pid. */
static int
part_alive(const char *home, const char *name, pid_t *pid)
{
    if (strncmp(name, "nats-", 5) == 0) {
        char dir[4200];
        snprintf(dir, sizeof(dir), "%s/%s", home, name);
        return stack_pidfile_alive(dir, "nats", pid);
    }
    return stack_pidfile_alive(home, name, pid);
}

/* The node count the stack in home was started with (env), else the
 * nodes that run; 0: one nats-server. */
static unsigned
stack_cluster_size(const char *home)
{
    char *v = cli_env_get("KSCORE_CLUSTER");
    unsigned n = v ? (unsigned)strtoul(v, NULL, 10) : 0;
    free(v);
    if (n > STACK_CLUSTER_MAX)
        n = STACK_CLUSTER_MAX;
    if (n)
        return n;
    for (unsigned i = 1; i <= STACK_CLUSTER_MAX; i++) {
        char name[16];
        snprintf(name, sizeof(name), "nats-%u", i);
        if (part_alive(home, name, NULL))
            n = i;
    }
    return n;
}

static void
local_agent_id(char *buf, size_t len)
{
    char host[256];
    size_t j = 0;
    if (gethostname(host, sizeof(host)) != 0)
        snprintf(host, sizeof(host), "local");
    host[sizeof(host) - 1] = '\0';
    /* Agent ids are subject tokens: the host name up to its first dot, with
     * anything outside [A-Za-z0-9_-] made '-', short enough that its NATS
     * identity "agent-<id>" is one (EVT_IDENTITY_MAX). */
    for (size_t i = 0; host[i] && host[i] != '.' && j + 1 < len &&
                       j < EVT_IDENTITY_MAX - 6;
         i++) {
        char ch = host[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                 (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
        buf[j++] = ok ? ch : '-';
    }
    buf[j] = '\0';
    if (!j)
        snprintf(buf, len, "local");
}

/* The operator's NATS user on the local stack: the login name. */
static void
operator_user(char *buf, size_t len)
{
    struct passwd *pw = getpwuid(getuid());
    const char *name = pw && pw->pw_name ? pw->pw_name : "operator";
    size_t j = 0;
    for (size_t i = 0; name[i] && j + 1 < len; i++) {
        char ch = name[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                 (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
        buf[j++] = ok ? ch : '_';
    }
    buf[j] = '\0';
    if (stack_operator_name_check(buf) != 0)
        snprintf(buf, len, "operator");
}

/* The caller's own NATS credentials must not leak into the daemons `up`
 * starts (stack_daemon passes the environment on). */
static void
clear_nats_env(void)
{
    static const char *const vars[] = {
        "KSCORE_NATS_USER", "KSCORE_NATS_PASSWORD", "KSCORE_NATS_CREDS",
        "KSCORE_NATS_TOKEN", "KSCORE_NATS_NKEY"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
        unsetenv(vars[i]);
}

static int
self_exe(char *buf, size_t len)
{
    ssize_t n = readlink("/proc/self/exe", buf, len - 1);
    if (n <= 0)
        return -errno;
    buf[n] = '\0';
    return 0;
}

/* `up --listen`: the TLS files the stack's own connections use (all
 * NULL on a loopback stack). up_tls.cert/key: the operator's, for the
 * waits; the daemons get their own. */
static struct {
    const char *ca, *cert, *key;
} up_tls;

static int
wait_broker(const char *url, const char *operator_seed, int timeout_ms)
{
    struct evt_connect_opts o = {.name = "kscore-up",
                                 .nkey_file = operator_seed,
                                 .tls_ca = up_tls.ca,
                                 .tls_cert = up_tls.cert,
                                 .tls_key = up_tls.key};
    return broker_wait_ready(url, &o, timeout_ms);
}

static int
wait_agent(const char *url, const char *id, const char *broker_seed,
           int64_t since_us, int timeout_ms)
{
    struct evt_connect_opts o = {.name = "kscore-up",
                                 .nkey_file = broker_seed,
                                 .tls_ca = up_tls.ca,
                                 .tls_cert = up_tls.cert,
                                 .tls_key = up_tls.key};
    return broker_wait_agent(url, &o, id, since_us, timeout_ms);
}

/* A small file's text (malloc'd), or NULL. */
static char *
slurp_small(const char *path)
{
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t cap = 0, n = 0;
    if (!f)
        return NULL;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            char *nb = realloc(buf, cap = n + 4096 + 1);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, 4096, f);
        n += r;
        if (r == 0)
            break;
    }
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static int
write_env(const char *home, const char *url, const char *db,
          const char *agent, unsigned local_agents, const char *nkey_file,
          const char *extra)
{
    char path[4200], tmp[4300];
    FILE *f;
    snprintf(path, sizeof(path), "%s/env", home);
    snprintf(tmp, sizeof(tmp), "%s/env.tmp", home);
    /* No secret in it (the operator's seed stays in its own 0600 file),
     * but 0600 all the same: it is this login's view of the stack. */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0)
            close(fd);
        return -errno;
    }
    fprintf(f,
            "# the local kscore stack; written by `kscore up`\n"
            "KSCORE_NATS_URL='%s'\nKSCORE_DB='%s'\nKSCORE_AGENT='%s'\n"
            "KSCORE_LOCAL_AGENTS='%u'\nKSCORE_NATS_NKEY='%s'\n",
            url, db, agent, local_agents, nkey_file);
    fputs(extra ? extra : "", f);
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        return -errno;
    return 0;
}

/*
 * The agents the broker knows (the registry, through the agents API):
 * local or on other hosts, online or not. Into o["agents"] (an array) or,
 * when the broker cannot be asked, o["agents_error"]; printed as a table
 * unless json. Nothing is asked when there is no NATS url to ask.
 */
static void
status_agents(struct cli_conn *cc, const char *local_agent, bool json,
              json_t *o)
{
    struct evt_conn *c = NULL;
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    Ks__AgentsReply *rep = NULL;
    char *errmsg = NULL, *env_url = NULL, *env_nkey = NULL;
    char *env_ca = NULL, *env_cert = NULL, *env_key = NULL;
    const char *url = cc->nats_url;
    int rc;

    cli_conn_env(cc);
    url = cc->nats_url;
    env_url = cli_env_get("KSCORE_NATS_URL");
    /* The local stack's url, and this login's seed for it (as
     * cli_connect does): only for that url, only without another
     * credential. */
    bool local = !url || !url[0] || (env_url && strcmp(env_url, url) == 0);
    if (!url || !url[0])
        url = env_url;
    if (local && !cc->opts.nkey_file && !cc->opts.user &&
        !cc->opts.creds_file && !cc->opts.token &&
        (env_nkey = cli_env_get("KSCORE_NATS_NKEY")))
        cc->opts.nkey_file = env_nkey;
    /* `kscore up --listen`: the stack's CA and, with --mtls, this login's
     * client certificate (as cli_connect), unless TLS files were given;
     * without them a TLS-only stack's status could not list its agents. */
    if (local && !cc->opts.tls_ca &&
        (env_ca = cli_env_get("KSCORE_NATS_TLS_CA")))
        cc->opts.tls_ca = env_ca;
    if (local && !cc->opts.tls_cert &&
        (env_cert = cli_env_get("KSCORE_NATS_TLS_CERT")) &&
        (env_key = cli_env_get("KSCORE_NATS_TLS_KEY"))) {
        cc->opts.tls_cert = env_cert;
        cc->opts.tls_key = env_key;
    }
    if (!url || !url[0]) {
        json_object_set_new(o, "agents", json_null());
        json_object_set_new(o, "agents_error",
                            json_string("no NATS url (no local stack)"));
        goto out;
    }
    cc->opts.name = "kscore-status";
    cc->opts.send_asap = true;
    rc = evt_connect(url, &cc->opts, &c, &errmsg);
    if (rc == 0)
        rc = broker_call(c, EVT_API_AGENTS, &req.base,
                         &ks__agents_reply__descriptor, 3000,
                         (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        char why[512];
        snprintf(why, sizeof(why), "cannot list the agents: %s",
                 errmsg ? errmsg : rc ? ks_strerror(rc) : rep->error);
        json_object_set_new(o, "agents", json_null());
        json_object_set_new(o, "agents_error", json_string(why));
        if (!json)
            printf("\nagents: %s\n", why);
        goto out;
    }
    json_t *arr = json_array();
    int64_t now = ks_now_us();
    if (!json)
        printf("\n%-24s %-8s %-11s %-9s %7s  %-20s %s\n", "AGENT", "STATE",
               "LAST SEEN", "VERSION", "RUNNING", "HOST", "LABELS");
    for (size_t i = 0; i < rep->n_agents; i++) {
        const Ks__AgentStatus *st = rep->agents[i];
        const Ks__AgentInfo *in = st->info;
        bool local = local_agent && strcmp(in->agent_id, local_agent) == 0;
        json_t *a = json_object(), *labels = json_object();
        for (size_t k = 0; k < in->n_labels; k++)
            json_object_set_new(labels, in->labels[k]->name,
                                json_string(in->labels[k]->value));
        json_object_set_new(a, "agent_id", json_string(in->agent_id));
        json_object_set_new(a, "online", json_boolean(st->online));
        json_object_set_new(a, "last_seen",
                            json_string(cli_time(st->last_seen_us)));
        json_object_set_new(a, "last_seen_ago_ms",
                            json_integer((now - st->last_seen_us) / 1000));
        json_object_set_new(a, "version", json_string(in->version));
        json_object_set_new(a, "running", json_integer(in->running));
        json_object_set_new(a, "max_concurrent",
                            json_integer(in->max_concurrent));
        json_object_set_new(a, "host", json_string(in->host));
        json_object_set_new(a, "pid", json_integer(in->pid));
        json_object_set_new(a, "labels", labels);
        json_object_set_new(a, "local", json_boolean(local));
        json_object_set_new(a, "duplicate", json_boolean(st->duplicate));
        json_object_set_new(a, "consumer", cli_consumer_json(st));
        json_array_append_new(arr, a);
        if (!json) {
            char ago[32], run[32], lab[512] = "";
            size_t used = 0;
            cli_ago(ago, sizeof(ago), now - st->last_seen_us);
            snprintf(run, sizeof(run), "%u/%u", in->running,
                     in->max_concurrent);
            for (size_t k = 0; k < in->n_labels && used < sizeof(lab); k++)
                used += (size_t)snprintf(lab + used, sizeof(lab) - used,
                                         "%s%s=%s", k ? "," : "",
                                         in->labels[k]->name,
                                         in->labels[k]->value);
            printf("%-24s %-8s %-11s %-9s %7s  %-20s %s%s\n", in->agent_id,
                   st->duplicate ? "duplicate"
                   : st->online  ? "online"
                                 : "offline",
                   ago, in->version[0] ? in->version : "-", run,
                   in->host[0] ? in->host : "-", lab,
                   local ? (lab[0] ? " (local)" : "(local)") : "");
            /* a stalled or repaired consumer (the brokers' guard) */
            char cons[640];
            cli_consumer_line(st, now, cons, sizeof(cons));
            if (cons[0])
                printf("  %s\n", cons);
        }
    }
    json_object_set_new(o, "agents", arr);
out:
    if (rep)
        ks__agents_reply__free_unpacked(rep, NULL);
    evt_close(c);
    free(errmsg);
    /* cc outlives this call: leave no pointer to what is freed here. */
    if (env_nkey && cc->opts.nkey_file == env_nkey)
        cc->opts.nkey_file = NULL;
    if (env_ca && cc->opts.tls_ca == env_ca)
        cc->opts.tls_ca = NULL;
    if (env_key && cc->opts.tls_key == env_key) {
        cc->opts.tls_cert = NULL;
        cc->opts.tls_key = NULL;
    }
    free(env_url);
    free(env_nkey);
    free(env_ca);
    free(env_cert);
    free(env_key);
}

/* The batches each broker drives (its leases in batch_leases): owner is
 * "<host>/<pid>/<uuid>", so a broker is known by its pid. */
struct lease_list {
    pid_t pids[2 * STACK_CLUSTER_MAX];
    json_t *held[2 * STACK_CLUSTER_MAX]; /* array of batch ids per pid */
    size_t n;
};

static void
lease_add(const char *owner, const char *batch_id, void *ud)
{
    struct lease_list *ll = ud;
    const char *sl = strchr(owner, '/');
    pid_t pid = sl ? (pid_t)atoi(sl + 1) : 0;
    for (size_t i = 0; i < ll->n; i++)
        if (ll->pids[i] == pid) {
            json_array_append_new(ll->held[i], json_string(batch_id));
            return;
        }
}

/* Fills ll->held for the brokers' pids (those alive) from the database;
 * false when it cannot be read (the lists stay empty). */
static bool
leases_read(const char *db, struct lease_list *ll)
{
    struct store *st = NULL;
    bool ok = false;
    if (db && db[0] && store_open(db, &st, NULL) == 0)
        ok = store_batch_leases_held(st, lease_add, ll) == 0;
    store_close(st);
    return ok;
}

/* A cluster's streams as their leaders see them: text and JSON. */
static json_t *
status_streams(const struct stack_node *nodes, unsigned n, bool json)
{
    struct stack_stream_state ss[STACK_STREAMS];
    json_t *a = json_array();
    if (stack_cluster_streams(nodes, n, ss) != 0)
        return a;
    for (int k = 0; k < STACK_STREAMS; k++) {
        const struct stack_stream_state *s = &ss[k];
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(s->name));
        json_object_set_new(o, "leader", s->leader[0]
                                             ? json_string(s->leader)
                                             : json_null());
        json_object_set_new(o, "replicas", json_integer(s->replicas + 1));
        json_object_set_new(o, "followers_current", json_integer(s->current));
        json_object_set_new(o, "followers", json_integer(s->replicas));
        json_object_set_new(o, "behind", json_string(s->behind));
        json_object_set_new(o, "current", json_boolean(
                                              s->leader[0] &&
                                              s->current == s->replicas));
        json_object_set_new(o, "messages", json_integer(s->messages));
        json_object_set_new(o, "last_seq", json_integer(s->last_seq));
        json_array_append_new(a, o);
        if (json)
            continue;
        char behind[160] = "";
        if (s->behind[0])
            snprintf(behind, sizeof(behind), " (behind: %s)", s->behind);
        if (!s->leader[0])
            printf("stream   %-17s no leader\n", s->name);
        else
            printf("stream   %-17s leader %s, followers %d/%d current%s, "
                   "%lld messages\n",
                   s->name, s->leader, s->current, s->replicas, behind,
                   s->messages);
    }
    return a;
}

static void broker_part(const char *home, unsigned cluster, unsigned k,
                        char *name, size_t name_len, char *dir,
                        size_t dir_len);

/* The stack's policy, and what each running broker loaded (the note it
 * wrote at start: broker.h BROKER_POLICY_NOTE), into o["policy"]. */
static void
status_policy(const char *home, unsigned cluster, bool json, json_t *o)
{
    struct cli_policy pol;
    json_t *jp = json_object(), *jl = json_object();
    unsigned n = cluster ? CLUSTER_BROKERS : 1;
    char loaded[512] = "";
    size_t used = 0;

    cli_policy_get(home, &pol);
    json_object_set_new(jp, "configured", json_boolean(pol.configured));
    json_object_set_new(jp, "source", pol.configured && pol.source[0]
                                          ? json_string(pol.source)
                                          : json_null());
    json_object_set_new(jp, "file", pol.configured ? json_string(pol.file)
                                                   : json_null());
    json_object_set_new(jp, "sha256", pol.configured && pol.sha256[0]
                                          ? json_string(pol.sha256)
                                          : json_null());
    json_object_set_new(jp, "error", pol.error ? json_string(pol.error)
                                               : json_null());
    for (unsigned k = 0; k < n; k++) {
        char name[16], dir[4200], hex[BROKER_POLICY_DIGEST_HEX] = "";
        pid_t pid = 0;
        const char *want = pol.configured ? pol.sha256 : "none";
        broker_part(home, cluster, k, name, sizeof(name), dir, sizeof(dir));
        if (stack_pidfile_alive(home, name, &pid) != 1)
            continue;
        bool known = cli_policy_loaded(dir, pid, hex);
        /* "none", a digest, or null: it runs and said nothing. */
        json_object_set_new(jl, name, known ? json_string(hex) : json_null());
        if (used < sizeof(loaded))
            used += (size_t)snprintf(
                loaded + used, sizeof(loaded) - used, "%s%s %s", used ? ", " : "",
                name,
                !known                      ? "loaded an unknown policy "
                                              "(older kscore)"
                : strcmp(hex, "none") == 0 ? "runs without a policy"
                : strcmp(hex, want) == 0    ? "loaded it"
                                            : "loaded another policy");
        if (used < sizeof(loaded) && known && strcmp(hex, want) != 0 &&
            strcmp(hex, "none") != 0)
            used += (size_t)snprintf(loaded + used, sizeof(loaded) - used,
                                     " (sha256 %s)", hex);
    }
    json_object_set_new(jp, "loaded", jl);
    json_object_set_new(o, "policy", jp);
    if (!json) {
        if (!pol.configured)
            printf("policy: none (every operator may run anything)");
        else if (pol.error)
            printf("policy: %s CANNOT BE LOADED: %s; no broker starts "
                   "without it",
                   pol.source, pol.error);
        else
            printf("policy: %s sha256 %s (copy %s)", pol.source, pol.sha256,
                   pol.file);
        printf("%s%s\n", loaded[0] ? "; " : "", loaded);
    }
    cli_policy_release(&pol);
}

/* Whether the metric line "name value" in a Prometheus text body has a
 * value above 0. */
static bool
metric_on(const char *body, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : p)
        if (strncmp(p, name, n) == 0 && p[n] == ' ')
            return atof(p + n + 1) > 0;
    return false;
}

/* A stall line of the broker's log is current for this long: the broker
 * repeats it every 10 s while the stall lasts (broker/recorder.c). */
#define STALL_LINE_FRESH_S 25

/*
 * The recorder's last word in the broker's log (<home>/broker.log, logfmt):
 * when its last state line ("cannot record; ...", "recorder still
 * stalled", "recording again") says it is stalled and is fresh, the
 * cause it names (its error= value, which names the SQLSTATE and the
 * server's message) into buf; else "". Reads the last 256 KiB.
 */
static void
recorder_stall_in_log(const char *home, char *buf, size_t len)
{
    char path[PATH_MAX + 16], *text = NULL, *last = NULL;
    buf[0] = '\0';
    snprintf(path, sizeof(path), "%s/broker.log", home);
    FILE *f = fopen(path, "re");
    if (!f)
        return;
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    long from = size > 256 * 1024 ? size - 256 * 1024 : 0;
    if (size > 0 && fseek(f, from, SEEK_SET) == 0 &&
        (text = calloc(1, (size_t)(size - from) + 1)))
        fread(text, 1, (size_t)(size - from), f);
    fclose(f);
    for (char *p = text, *nl; p && *p; p = nl ? nl + 1 : NULL) {
        nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        if (strstr(p, "module=recorder") &&
            (strstr(p, "msg=\"cannot record;") ||
             strstr(p, "msg=\"recorder still stalled") ||
             strstr(p, "msg=\"recording again\"")))
            last = p;
    }
    struct tm tm = {0};
    const char *t = last ? strstr(last, "time=") : NULL;
    const char *e = last ? strstr(last, " error=\"") : NULL;
    if (last && !strstr(last, "recording again") && t && e &&
        strptime(t + 5, "%Y-%m-%dT%H:%M:%S", &tm) &&
        time(NULL) - timegm(&tm) <= STALL_LINE_FRESH_S) {
        e += 8;
        size_t n = strcspn(e, "\"");
        snprintf(buf, len, "%.*s", (int)(n < 400 ? n : 400), e);
    }
    free(text);
}

/*
 * The recorder's state: from the broker's own metrics (the cheap path:
 * `kscore up --metrics` wrote KSCORE_BROKER_METRICS_URL), "recording", or
 * why it holds events unrecorded (kscore_recorder_stalled{cause}), with
 * the cause as its log names it (the SQLSTATE and the server's words);
 * without metrics, from the log alone (NULL when it says nothing fresh).
 * The returned string is in buf (len bytes) or static. NULL when the
 * broker serves no metrics (or does not answer in 1 s) and its log names
 * no stall.
 */
static const char *
recorder_state(const char *home, char *buf, size_t len)
{
    char *url = cli_env_get("KSCORE_BROKER_METRICS_URL");
    const char *colon = url ? strrchr(url, ':') : NULL, *st = NULL;
    char *body = NULL, cause[448], token[EVT_TOKEN_MAX + 1] = "", path[4200];
    int port = colon ? atoi(colon + 1) : 0;

    recorder_stall_in_log(home, cause, sizeof(cause));
    snprintf(path, sizeof(path), "%s/keys/" STACK_METRICS_TOKEN, cli_home());
    if (evt_token_file_read(path, token, sizeof(token), NULL) != 0)
        token[0] = '\0';
    if (port > 0 &&
        stack_http_get_auth(port, "/metrics", token, 1000, &body) == 0 &&
        body) {
        if (metric_on(body, "kscore_recorder_stalled{cause=\"refuses_writes\"}"))
            st = "stalled: PostgreSQL refuses writes";
        else if (metric_on(body,
                           "kscore_recorder_stalled{cause=\"unreachable\"}"))
            st = "stalled: PostgreSQL unreachable";
        else
            st = "recording";
    } else if (cause[0]) {
        st = "stalled";
    }
    if (st && strcmp(st, "recording") != 0 && cause[0]) {
        snprintf(buf, len, "stalled: %s", cause);
        st = buf;
    }
    free(body);
    free(url);
    return st;
}

static int
print_status(bool json, struct cli_conn *cc)
{
    const char *home = cli_home();
    char *url = cli_env_get("KSCORE_NATS_URL");
    char *db = cli_env_get("KSCORE_DB");
    char *agent = cli_env_get("KSCORE_AGENT");
    unsigned cluster = stack_cluster_size(home);
    char names[2 * STACK_CLUSTER_MAX + 8][16];
    size_t nparts = part_names(cluster, names);
    struct stack_node nodes[STACK_CLUSTER_MAX];
    int running = 0;
    json_t *o = json_object(), *jp = json_object();
    json_t *jn = json_array(), *jb = json_array();

    struct lease_list ll = {.n = 0};
    bool leases = false;
    if (cluster) {
        stack_cluster_nodes(home, cluster, nodes);
        for (unsigned k = 1; k <= CLUSTER_BROKERS; k++) {
            char bname[16];
            pid_t bp = 0;
            snprintf(bname, sizeof(bname), "broker-%u", k);
            if (stack_pidfile_alive(home, bname, &bp) == 1) {
                ll.pids[ll.n] = bp;
                ll.held[ll.n++] = json_array();
            }
        }
        if (ll.n && stack_pidfile_alive(home, "pg", NULL) == 1)
            leases = leases_read(db, &ll);
    }
    for (size_t i = 0; i < nparts; i++) {
        pid_t pid = 0;
        const char *name = names[i];
        int alive = part_alive(home, name, &pid);
        bool node = strncmp(name, "nats-", 5) == 0;
        bool broker = strncmp(name, "broker", 6) == 0;
        char naddr[64] = "", extra[768] = "";
        const char *addr = strcmp(name, "nats") == 0    ? url
                           : strcmp(name, "pg") == 0    ? db
                           : strcmp(name, "agent") == 0 ? agent
                                                        : "";
        running += alive;
        json_t *p = json_object();
        json_object_set_new(p, "state",
                            json_string(alive ? "running" : "stopped"));
        json_object_set_new(p, "pid", alive ? json_integer(pid) : json_null());
        if (node) {
            /* A node: its port, its name and its JetStream role (leader
             * or follower of the meta group), from its monitoring
             * (stack_nats_monitor). */
            const struct stack_node *nd = &nodes[atoi(name + 5) - 1];
            struct stack_js_info ji;
            bool have = alive && stack_nats_js_info(nd, &ji) == 0;
            long rss = alive ? stack_rss_kb(pid) : -1;
            snprintf(naddr, sizeof(naddr), "nats://127.0.0.1:%d", nd->port);
            addr = naddr;
            json_object_set_new(p, "name", json_string(name));
            json_object_set_new(p, "port", json_integer(nd->port));
            json_object_set_new(p, "route_port",
                                json_integer(nd->route_port));
            json_object_set_new(p, "server_name",
                                have ? json_string(ji.server_name)
                                     : json_null());
            json_object_set_new(p, "jetstream_role",
                                have ? json_string(stack_js_role(&ji))
                                     : json_null());
            json_object_set_new(p, "meta_leader",
                                have && ji.meta_leader[0]
                                    ? json_string(ji.meta_leader)
                                    : json_null());
            json_object_set_new(p, "rss_kb",
                                rss >= 0 ? json_integer(rss) : json_null());
            if (have)
                snprintf(extra, sizeof(extra), "  %s %s, rss %ld MiB",
                         ji.server_name, stack_js_role(&ji),
                         rss >= 0 ? rss / 1024 : 0);
            json_array_append(jn, p);
        } else if (broker) {
            long rss = alive ? stack_rss_kb(pid) : -1;
            json_object_set_new(p, "name", json_string(name));
            json_object_set_new(p, "rss_kb",
                                rss >= 0 ? json_integer(rss) : json_null());
            if (rss >= 0)
                snprintf(extra, sizeof(extra), "rss %ld MiB", rss / 1024);
            /* The recorder: results held unrecorded show here at once. */
            char recbuf[512];
            const char *rec = alive && !cluster
                                  ? recorder_state(home, recbuf,
                                                   sizeof(recbuf))
                                  : NULL;
            json_object_set_new(p, "recorder",
                                rec ? json_string(rec) : json_null());
            if (rec) {
                size_t l = strlen(extra);
                snprintf(extra + l, sizeof(extra) - l, "%srecorder %s",
                         l ? ", " : "", rec);
            }
            json_t *held = NULL;
            for (size_t k = 0; alive && k < ll.n; k++)
                if (ll.pids[k] == pid)
                    held = ll.held[k];
            if (cluster) {
                /* the batches it drives (holds the lease of) */
                size_t nh = held ? json_array_size(held) : 0;
                json_object_set(p, "batches",
                                leases && held ? held : json_null());
                if (leases && alive) {
                    size_t l = strlen(extra);
                    snprintf(extra + l, sizeof(extra) - l,
                             ", drives %zu batch%s%s%s", nh,
                             nh == 1 ? "" : "es", nh ? ": " : "",
                             nh ? json_string_value(json_array_get(held, 0))
                                : "");
                    l = strlen(extra);
                    if (nh > 1)
                        snprintf(extra + l, sizeof(extra) - l, " ...");
                }
                json_array_append(jb, p);
            }
        }
        json_object_set_new(p, "address", json_string(addr ? addr : ""));
        json_object_set_new(jp, name, p);
        if (!json) {
            char pids[16] = "-";
            if (alive)
                snprintf(pids, sizeof(pids), "%d", (int)pid);
            printf("%-8s %-8s pid %-8s %s%s\n", name,
                   alive ? "running" : "stopped", pids, addr ? addr : "",
                   extra);
        }
    }
    status_policy(home, cluster, json, o);
    if (cluster)
        json_object_set_new(o, "streams",
                            status_streams(nodes, cluster, json));
    /* The JetStream parts the brokers stand on: a deleted stream or
     * recorder consumer is a stack that does not work, whatever its
     * processes say (the brokers make a missing part again within 5 s). */
    unsigned present = 0;
    bool asked = false;
    if (cluster) {
        for (unsigned i = 0; i < cluster; i++) {
            unsigned p1 = 0;
            if (nodes[i].running && stack_js_parts(&nodes[i], &p1) == 0) {
                present |= p1;
                asked = true;
            }
        }
    } else if (stack_pidfile_alive(home, "nats", NULL) == 1) {
        struct stack_node nd;
        if (stack_single_node(home, &nd) == 0 &&
            stack_js_parts(&nd, &present) == 0)
            asked = true;
    }
    bool js_ok = true;
    json_t *jmissing = json_array();
    for (int k = 0; asked && k < EVT_PARTS; k++) {
        if (present & (1u << k))
            continue;
        js_ok = false;
        json_array_append_new(jmissing, json_string(evt_part_names[k]));
        if (!json)
            printf("jetstream MISSING  %s %s (the brokers make it again; "
                   "until then nothing %s)\n",
                   k == 3 ? "consumer" : "stream", evt_part_names[k],
                   k == 0   ? "is delivered to agents"
                   : k == 2 ? "hears the agents' heartbeats"
                            : "is recorded");
    }
    json_t *jjs = json_object();
    json_object_set_new(jjs, "checked", json_boolean(asked));
    json_object_set_new(jjs, "ok", json_boolean(asked && js_ok));
    json_object_set_new(jjs, "missing", jmissing);
    json_object_set_new(o, "jetstream", jjs);
    if (!js_ok)
        running--; /* exit 1, as for a stopped part */
    for (size_t k = 0; k < ll.n; k++)
        json_decref(ll.held[k]);
    if (json) {
        json_object_set_new(o, "home", json_string(home));
        json_object_set_new(o, "nats_url", url ? json_string(url)
                                               : json_null());
        json_object_set_new(o, "db", db ? json_string(db) : json_null());
        json_object_set_new(o, "agent_id", agent ? json_string(agent)
                                                 : json_null());
        json_object_set_new(o, "running",
                            json_boolean(running == (int)nparts));
        json_object_set_new(o, "parts", jp);
        json_object_set_new(o, "cluster", json_integer(cluster));
        if (cluster) {
            json_object_set_new(o, "nodes", jn);
            json_object_set_new(o, "brokers", jb);
            jn = jb = NULL;
        }
    }
    json_decref(jn);
    json_decref(jb);
    /* Remote agents too: whatever the registry holds. Only when there is
     * a NATS server to ask (a running local one, or one given). */
    bool nats_alive = stack_pidfile_alive(home, "nats", NULL);
    for (unsigned i = 0; i < cluster; i++)
        nats_alive = nats_alive || nodes[i].running;
    if (cc && (cc->nats_url || getenv("KSCORE_NATS_URL") || nats_alive))
        status_agents(cc, agent, json, o);
    else
        json_object_set_new(o, "agents", json_null());
    if (json) {
        cli_print_json(o);
    } else {
        json_decref(o);
        json_decref(jp);
    }
    free(url);
    free(db);
    free(agent);
    return running == (int)nparts ? 0 : 1;
}

int
cmd_status(int argc, char **argv)
{
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       CLI_CONN_LONGOPTS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    bool json = false;
    int opt;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            json = true;
            break;
        case 'h':
            printf("usage: kscore status [--json] [--nats URL --nkey FILE "
                   "...]\nThe local stack's parts (pid, address, state) and "
                   "every agent the broker knows, local or remote (online, "
                   "last seen, version, running). On a cluster (up "
                   "--cluster N) also each node's JetStream role, each "
                   "stream's leader and whether its followers are current, "
                   "and the batches each broker drives. Also whether the "
                   "JetStream streams and the recorder's consumer exist "
                   "(a 'jetstream MISSING' line each one that is gone).\n"
                   "Exit 0 when every part of the local stack runs and "
                   "every JetStream part exists, 1 otherwise.\n");
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            return CLI_EXIT_USAGE;
        }
    }
    if (optind != argc) {
        cli_err("usage: kscore status [--json]");
        return CLI_EXIT_USAGE;
    }
    return print_status(json, &cc);
}

/* Broker k's (0-based) part name and state dir, as cmd_up starts it. */
static void
broker_part(const char *home, unsigned cluster, unsigned k, char *name,
            size_t name_len, char *dir, size_t dir_len)
{
    if (cluster)
        snprintf(name, name_len, "broker-%u", k + 1);
    else
        snprintf(name, name_len, "broker");
    if (k == 0)
        snprintf(dir, dir_len, "%s/local-agents", home);
    else
        snprintf(dir, dir_len, "%s/local-agents-%u", home, k + 1);
}

/* A running broker that did not load the stack's policy (another one,
 * none, or it noted nothing: an older kscore) is stopped, so that this
 * `up` starts it again with the stack's. */
static void
restart_other_policy(const char *home, unsigned cluster,
                     const struct cli_policy *pol)
{
    const char *want = pol->configured ? pol->sha256 : "none";
    unsigned n = cluster ? CLUSTER_BROKERS : 1;

    for (unsigned k = 0; k < n; k++) {
        char name[16], dir[4200], hex[BROKER_POLICY_DIGEST_HEX] = "";
        pid_t pid = 0;
        broker_part(home, cluster, k, name, sizeof(name), dir, sizeof(dir));
        if (stack_pidfile_alive(home, name, &pid) != 1)
            continue;
        if (cli_policy_loaded(dir, pid, hex) && strcmp(hex, want) == 0)
            continue;
        fprintf(stderr,
                "kscore: the %s runs with policy %.12s%s, the stack's is "
                "%.12s%s: restarting it\n",
                name, hex[0] ? hex : "unknown", strlen(hex) > 12 ? "..." : "",
                want, strlen(want) > 12 ? "..." : "");
        stack_stop(home, name, 20000);
    }
}

bool
cli_stack_enrolled(const char *home)
{
    char dir[4200];
    struct dirent *de;
    bool any = false;
    DIR *d;

    snprintf(dir, sizeof(dir), "%s/enrolled", home);
    if (!(d = opendir(dir)))
        return false;
    while (!any && (de = readdir(d)))
        any = de->d_name[0] != '.';
    closedir(d);
    return any;
}

/* Whether process pid was started with --allow-unsigned-labels (its
 * command line, /proc/<pid>/cmdline: NUL-separated words). */
static bool
runs_unsigned_labels(pid_t pid)
{
    char path[64], buf[8192];
    ssize_t n;
    int fd;

    snprintf(path, sizeof(path), "/proc/%d/cmdline", (int)pid);
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) == -1)
        return false;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = '\0';
    for (ssize_t i = 0; i < n; i += (ssize_t)strlen(buf + i) + 1)
        if (strcmp(buf + i, "--allow-unsigned-labels") == 0)
            return true;
    return false;
}

/* A stack with enrolled agents: each running broker that allows unsigned
 * labels (started before the first enrolment, or by an older kscore) is
 * stopped, so that this `up` starts it with signed labels only. How
 * many were stopped. */
static unsigned
restart_unsigned_labels(const char *home, unsigned cluster)
{
    unsigned n = cluster ? CLUSTER_BROKERS : 1, stopped = 0;

    if (!cli_stack_enrolled(home))
        return 0;
    for (unsigned k = 0; k < n; k++) {
        char name[16], dir[4200];
        pid_t pid = 0;
        broker_part(home, cluster, k, name, sizeof(name), dir, sizeof(dir));
        if (stack_pidfile_alive(home, name, &pid) != 1 ||
            !runs_unsigned_labels(pid))
            continue;
        fprintf(stderr,
                "kscore: the %s takes agents' unsigned labels, and the stack "
                "has enrolled agents: restarting it with signed labels only\n",
                name);
        stack_stop(home, name, 20000);
        stopped++;
    }
    return stopped;
}

int
cli_stack_signed_labels_apply(const char *home)
{
    char *argv[] = {"up", NULL};
    int saved, rc;

    if (!restart_unsigned_labels(home, stack_cluster_size(home)))
        return 0;
    /* The stack's saved policy, not one in the caller's environment. */
    unsetenv("KSCORE_POLICY");
    /* `up` starts what is down; its status table goes to stderr, as the
     * caller's stdout is its own (enroll prints the bundle's path). */
    fflush(stdout);
    if ((saved = dup(STDOUT_FILENO)) == -1)
        return CLI_EXIT_KSCORE;
    dup2(STDERR_FILENO, STDOUT_FILENO);
    optind = 0; /* getopt_long again, from the start (glibc) */
    rc = cmd_up(1, argv);
    fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    return rc;
}

/* The port of a kept "http://127.0.0.1:PORT[/...]" when it is free again,
 * else a new free port (0 when none). */
static int
metrics_port(const char *prev_url)
{
    const char *c = prev_url ? strrchr(prev_url, ':') : NULL;
    int port = c ? atoi(c + 1) : 0;
    if (port > 0 && stack_port_free(port) == 1)
        return port;
    return stack_free_port();
}

int
cmd_up(int argc, char **argv)
{
    static const struct option lo[] = {
        {"local-agents", required_argument, 0, 'l'},
        {"metrics", no_argument, 0, 'm'},
        {"json", no_argument, 0, 'j'},
        {"listen", required_argument, 0, 'L'},
        {"tls-name", required_argument, 0, 'N'},
        {"mtls", no_argument, 0, 'M'},
        {"cluster", required_argument, 0, 'C'},
        {"policy", required_argument, 0, 'P'},
        {"no-policy", no_argument, 0, 'n'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *home = cli_home();
    const char *policy_src = NULL;
    bool no_policy = false;
    char *policy_buf = NULL;
    size_t policy_len = 0;
    struct cli_policy pol = {0};
    unsigned cluster = 0;
    bool cluster_given = false;
    struct stack_node nodes[STACK_CLUSTER_MAX];
    struct cli_listen ul = {0};
    bool metrics = false, json = false;
    char env_extra[512] = "", bmetrics[64] = "", ametrics[64] = "";
    char exe[4096], agent_id[EVT_AGENT_ID_MAX + 1], nlocal[16];
    char agent_state[4200];
    char *url = NULL, *db = NULL;
    unsigned local_agents = 0;
    bool local_agents_given = false;
    pid_t pid;
    int opt, rc;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end;
        switch (opt) {
        case 'l':
            local_agents = (unsigned)strtoul(optarg, &end, 10);
            if (*end || !optarg[0] || optarg[0] == '-' ||
                local_agents > 10000) {
                cli_err("bad --local-agents '%s' (0..10000)", optarg);
                return CLI_EXIT_USAGE;
            }
            local_agents_given = true;
            break;
        case 'm':
            metrics = true;
            break;
        case 'C':
            cluster = (unsigned)strtoul(optarg, &end, 10);
            /* One node cannot be a JetStream cluster (nats-server wants
             * routes); 3 survive the loss of one. */
            if (*end || !optarg[0] || optarg[0] == '-' || cluster < 2 ||
                cluster > STACK_CLUSTER_MAX) {
                cli_err("bad --cluster '%s' (2..%d nodes; 3 survive the "
                        "loss of one)",
                        optarg, STACK_CLUSTER_MAX);
                return CLI_EXIT_USAGE;
            }
            cluster_given = true;
            break;
        case 'j':
            json = true;
            break;
        case 'P':
            policy_src = optarg;
            break;
        case 'n':
            no_policy = true;
            break;
        case 'L':
        case 'N':
        case 'M':
            if ((rc = cli_listen_opt(&ul, opt, optarg)))
                return rc;
            break;
        case 'h':
            printf("usage: kscore up [--local-agents N] [--metrics] [--json] "
                   "[--listen ADDR [--tls-name NAME]... [--mtls]] "
                   "[--cluster N] [--policy FILE | --no-policy]\n"
                   "Starts the local stack under $KSCORE_HOME (now %s) and "
                   "prints its\nstatus (--json: as `kscore status --json`). "
                   "Only the parts that are down\nare started; the NATS "
                   "port, credentials and keys stay the same.\n"
                   "--metrics: the broker and the agent serve Prometheus "
                   "metrics on free ports (in $KSCORE_HOME/env; kept while "
                   "the stack runs).\n"
                   "--listen ADDR: nats-server listens on ADDR (an IPv4 "
                   "address agents on other hosts reach) instead of "
                   "127.0.0.1, TLS-only, with a certificate from the "
                   "stack's own CA ($KSCORE_HOME/tls) for ADDR, the host "
                   "name and each --tls-name; --mtls: clients must show a "
                   "certificate from that CA too. Kept for later `up`s "
                   "(--listen 127.0.0.1 goes back to loopback).\n"
                   "--cluster N: N nats-server nodes (nats-1..N, routes on "
                   "loopback) with the streams and the KV bucket replicated "
                   "N times, and %d brokers; kept for later `up`s.\n"
                   "--policy FILE: the operator policy (docs/security.md "
                   "\"Operator identity and policy\"), checked first (a bad "
                   "file: "
                   "exit 2) and copied to $KSCORE_HOME/policy.json; every "
                   "later `up` starts the brokers with that copy, and one "
                   "that cannot be loaded stops `up`. A running broker with "
                   "another policy is restarted. An edit of FILE takes "
                   "`up --policy FILE` again. KSCORE_POLICY counts as "
                   "--policy. --no-policy: no policy from now on (every "
                   "operator may run anything).\n",
                   home, CLUSTER_BROKERS);
            return 0;
        default:
            return CLI_EXIT_USAGE;
        }
    }
    if (policy_src && no_policy) {
        cli_err("--policy and --no-policy: one or the other");
        return CLI_EXIT_USAGE;
    }
    /* As the broker takes its settings: a flag, else KSCORE_POLICY (which
     * `up` used to hand to the broker it started, and to no later one). */
    if (!policy_src && !no_policy && getenv("KSCORE_POLICY") &&
        getenv("KSCORE_POLICY")[0])
        policy_src = getenv("KSCORE_POLICY");
    /* Before anything starts: a bad policy is a usage error. */
    if (policy_src &&
        (rc = cli_policy_check(policy_src, &policy_buf, &policy_len)))
        return rc;
    if (self_exe(exe, sizeof(exe)) != 0) {
        cli_err("cannot find my own executable");
        free(policy_buf);
        return CLI_EXIT_KSCORE;
    }
    /* After a reboot without `down` (power loss), the pid files name
     * processes that are gone, or other processes by now. */
    stack_forget_other_boot(home);
    /* Without --cluster, keep what the stack was started with. */
    unsigned prev_cluster = stack_cluster_size(home);
    bool single_runs = stack_pidfile_alive(home, "nats", NULL);
    if (!cluster_given)
        cluster = single_runs ? 0 : prev_cluster;
    if (cluster_given && single_runs) {
        cli_err("a one-node stack runs in %s: `kscore down` first to start "
                "a cluster", home);
        free(policy_buf);
        return CLI_EXIT_USAGE;
    }
    if (cluster_given && prev_cluster && cluster != prev_cluster) {
        cli_err("a stack of %u nodes runs in %s: `kscore down` first to "
                "change that", prev_cluster, home);
        free(policy_buf);
        return CLI_EXIT_USAGE;
    }
    if (cluster && (ul.given_host || ul.mtls_given || ul.n_names)) {
        cli_err("--cluster runs on loopback: not with --listen, --tls-name "
                "or --mtls (deploy/cluster/ has the files for real hosts)");
        free(policy_buf);
        return CLI_EXIT_USAGE;
    }
    /* The policy is the stack's: saved or cleared now, then the one
     * every broker starts with; one that cannot be loaded stops here. */
    if ((policy_src || no_policy) && (rc = stack_mkdirs(home, 0700))) {
        cli_err("cannot create %s: %s", home, ks_strerror(rc));
        free(policy_buf);
        return CLI_EXIT_KSCORE;
    }
    bool policy_changed = false;
    rc = policy_src ? cli_policy_save(home, policy_src, policy_buf,
                                      policy_len, &policy_changed)
         : no_policy ? cli_policy_clear(home)
                     : 0;
    free(policy_buf);
    if (rc)
        return rc;
    cli_policy_get(home, &pol);
    if (pol.error) {
        cli_err("the stack's policy cannot be loaded: %s; no broker starts "
                "without it (`kscore up --policy FILE` saves a new one, "
                "`--no-policy` none)",
                pol.error);
        cli_policy_release(&pol);
        return CLI_EXIT_KSCORE;
    }
    if (policy_changed)
        fprintf(stderr, "kscore: policy %s (sha256 %s) saved as %s\n",
                pol.source, pol.sha256, pol.file);
    else if (no_policy)
        fprintf(stderr, "kscore: no policy: every operator may run "
                        "anything\n");
    restart_other_policy(home, cluster, &pol);
    restart_unsigned_labels(home, cluster);
    char names[2 * STACK_CLUSTER_MAX + 8][16];
    size_t nparts = part_names(cluster, names);
    int alive = 0;
    for (size_t i = 0; i < nparts; i++)
        alive += part_alive(home, names[i], NULL);
    /* Without --local-agents, keep what the stack was started with. */
    char *prev = cli_env_get("KSCORE_LOCAL_AGENTS");
    unsigned prev_n = prev ? (unsigned)strtoul(prev, NULL, 10) : 0;
    free(prev);
    if (alive == (int)nparts) {
        /* A running stack is left as it is. Asked for other settings than
         * it runs with, `up` says which and fails (125), so a script or a
         * state (Salt, Ansible) does not take the change for done. */
        bool refused = false;
        char now[512], asked[512];
        char *run_bm = cli_env_get("KSCORE_BROKER_METRICS_URL");
        fprintf(stderr, "kscore: the local stack is already running in %s\n",
                home);
        if (local_agents_given && local_agents != prev_n) {
            fprintf(stderr,
                    "kscore: it runs %u local agents, not %u: `kscore down` "
                    "first to change that\n",
                    prev_n, local_agents);
            refused = true;
        }
        if (cli_listen_differs(&ul, now, sizeof(now), asked, sizeof(asked))) {
            fprintf(stderr,
                    "kscore: it runs with %s, not %s: --listen, "
                    "--tls-name and --mtls apply when it starts (`kscore "
                    "down` first)\n",
                    now, asked);
            refused = true;
        }
        if (metrics && !(run_bm && run_bm[0])) {
            fprintf(stderr, "kscore: it runs without metrics: --metrics "
                            "applies when it starts (`kscore down` first)\n");
            refused = true;
        }
        free(run_bm);
        {
            /* Started by an older kscore: an HTTP monitoring port and
             * metrics that any local user may read, until it starts
             * again (this `up` then closes them). */
            char conf[4300];
            snprintf(conf, sizeof(conf), "%s/%s/nats.conf", home,
                     cluster ? "nats-1" : ".");
            char *text = slurp_small(conf);
            if (text && strstr(text, "\nhttp:"))
                fprintf(stderr,
                        "kscore: it runs with an HTTP monitoring port (and "
                        "metrics without a token) that any local user may "
                        "read: `kscore down` and `kscore up` close them\n");
            free(text);
        }
        print_status(json, &(struct cli_conn){0});
        return refused ? CLI_EXIT_KSCORE : 0;
    }
    if (!local_agents_given)
        local_agents = prev_n;
    /* Addresses of a stack that runs on keep it: with --metrics (once
     * given, kept), those of the broker and the agent. */
    char *prev_bm = cli_env_get("KSCORE_BROKER_METRICS_URL");
    char *prev_am = cli_env_get("KSCORE_AGENT_METRICS_URL");
    metrics = metrics || (prev_bm && prev_bm[0]);
    /* 0700 when new: only its owner has business in it (PostgreSQL's
     * user, when we are root, gets o+x: stack_pg.c). */
    if ((rc = stack_mkdirs(home, 0700))) {
        cli_err("cannot create %s: %s", home, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    stack_forget_other_boot(home); /* records this boot in a new home */
    local_agent_id(agent_id, sizeof(agent_id));
    char keydir[4200], signing_key[4300], trust_key[4300];
    snprintf(keydir, sizeof(keydir), "%s/keys", home);
    snprintf(signing_key, sizeof(signing_key), "%s/broker.key", keydir);
    snprintf(trust_key, sizeof(trust_key), "%s/broker.pub", keydir);
    /* The metrics are the stack owner's: a port on loopback is open to
     * every local user, so a scrape needs this token (made once, kept). */
    char metrics_token[4300];
    snprintf(metrics_token, sizeof(metrics_token), "%s/" STACK_METRICS_TOKEN,
             keydir);
    if (metrics && access(metrics_token, R_OK) != 0 &&
        ((rc = stack_mkdirs(keydir, 0700)) ||
         (rc = evt_token_file_make(metrics_token)))) {
        cli_err("cannot make %s: %s", metrics_token, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if (access(signing_key, R_OK) != 0) {
        if ((rc = stack_mkdirs(keydir, 0700)) ||
            (rc = evt_keygen(signing_key, trust_key))) {
            cli_err("cannot make the signing key in %s: %s", keydir,
                    ks_strerror(rc));
            return CLI_EXIT_KSCORE;
        }
    }

    /* Only the parts that are down are started: a running nats-server,
     * broker or agent keeps its pid, port and connections, and a part
     * started again gets the same port (nats.port, pg.port), identities
     * (stack_ident_ensure) and keys, so nobody is cut off by a restart. */
    pid_t nats_pid = 0, broker_pid = 0, agent_pid = 0;
    bool nats_up = stack_pidfile_alive(home, "nats", &nats_pid);
    bool pg_up = stack_pidfile_alive(home, "pg", NULL);
    bool broker_up = stack_pidfile_alive(home, "broker", &broker_pid);
    bool agent_up = stack_pidfile_alive(home, "agent", &agent_pid);
    char operator_name[EVT_IDENTITY_MAX + 1];
    char agent_user[EVT_IDENTITY_MAX + 8];
    char broker_seed[4200], agent_seed[4200], operator_seed[4200];
    char authp[4200];
    char *auth_before = NULL, *auth_after = NULL;
    struct stack_identity sid;
    int64_t since_us = ks_now_us() - (int64_t)EVT_AGENT_TTL_MS * 1000;
    operator_user(operator_name, sizeof(operator_name));
    snprintf(agent_user, sizeof(agent_user), "agent-%s", agent_id);
    snprintf(authp, sizeof(authp), "%s/" STACK_NATS_AUTH_FILE, home);
    auth_before = slurp_small(authp);
    if ((rc = stack_ident_ensure(home, STACK_BROKER, "broker", &sid)) ||
        (rc = stack_ident_ensure(home, STACK_SYSTEM, "system", &sid)) ||
        (rc = stack_ident_ensure(home, STACK_AGENT, agent_user, &sid)) ||
        (rc = stack_ident_ensure(home, STACK_OPERATOR, operator_name, &sid)) ||
        (rc = stack_ident_seed_path(home, STACK_BROKER, "broker", broker_seed,
                                    sizeof(broker_seed))) ||
        (rc = stack_ident_seed_path(home, STACK_AGENT, agent_user, agent_seed,
                                    sizeof(agent_seed))) ||
        (rc = stack_ident_seed_path(home, STACK_OPERATOR, operator_name,
                                    operator_seed, sizeof(operator_seed))) ||
        (rc = stack_nats_auth_write(home, home))) {
        cli_err("cannot make the NATS identities in %s/identities: %s", home,
                ks_strerror(rc));
        free(auth_before);
        return CLI_EXIT_KSCORE;
    }
    auth_after = slurp_small(authp);
    bool auth_changed = !auth_before || !auth_after ||
                        strcmp(auth_before, auth_after) != 0;
    /* A nats-server started by an older kscore has no system account (a
     * reload cannot add one) and an HTTP monitoring port that any local
     * user may read: it starts again, on its port. */
    bool nats_stale = auth_before && !strstr(auth_before, "system_account");
    free(auth_before);
    free(auth_after);

    if (nats_up && (ul.given_host || ul.mtls_given || ul.n_names)) {
        char now[512], asked[512];
        if (cli_listen_differs(&ul, now, sizeof(now), asked, sizeof(asked)))
            fprintf(stderr,
                    "kscore: nats-server runs with %s, not %s: --listen, "
                    "--tls-name and --mtls apply when it starts (`kscore "
                    "down` first)\n",
                    now, asked);
        memset(&ul, 0, sizeof(ul));
    }
    cli_listen_resolve(&ul);
    if ((rc = cli_listen_tls(home, &ul, agent_user, operator_name)))
        goto fail;
    up_tls.ca = ul.tls ? ul.ca : NULL;
    up_tls.cert = ul.mtls ? ul.ocert : NULL;
    up_tls.key = ul.mtls ? ul.okey : NULL;
    int port = cluster ? 0 : stack_nats_saved_port(home);
    if (cluster) {
        /* The nodes that are down start, on their kept ports; the
         * running ones reload their users when those changed. */
        char moved[256] = "", leader[64] = "";
        unsigned down = 0;
        int64_t t0 = ks_mono_us();
        stack_cluster_nodes(home, cluster, nodes);
        for (unsigned i = 0; i < cluster; i++) {
            if (nodes[i].running && nats_stale) {
                stack_nats_stop(nodes[i].dir);
                nodes[i].running = false;
            }
            down += !nodes[i].running;
            if (nodes[i].running && auth_changed &&
                stack_nats_auth_write(nodes[i].dir, home) == 0)
                stack_nats_reload(nodes[i].dir, 5000);
        }
        if (down)
            fprintf(stderr, "kscore: starting %u nats-server node%s ...\n",
                    down, down > 1 ? "s" : "");
        rc = stack_cluster_start(home, cluster, nodes,
                                 STACK_NATS_AUTH_INCLUDE, moved,
                                 sizeof(moved));
        if (rc) {
            cli_err("cannot start the nats-server nodes: %s (see "
                    "%s/nats-*/nats.log)",
                    ks_strerror(rc), home);
            goto fail;
        }
        if (moved[0])
            fprintf(stderr,
                    "kscore: a kept port was taken, so a node moved (%s); "
                    "the env file follows\n",
                    moved);
        /* Streams with replicas need a JetStream meta leader: elected a
         * few seconds after the nodes meet. */
        rc = stack_cluster_wait_leader(nodes, cluster, 30000, leader,
                                       sizeof(leader));
        if (rc) {
            cli_err("the nats-server nodes elect no JetStream leader (see "
                    "%s/nats-*/nats.log)",
                    home);
            goto fail;
        }
        if (down)
            fprintf(stderr, "kscore: JetStream meta leader %s (%.1f s)\n",
                    leader, (double)(ks_mono_us() - t0) / 1e6);
        if ((rc = stack_cluster_urls(nodes, cluster, &url)))
            goto fail;
        if (down == cluster)
            since_us = ks_now_us();
    } else if (port <= 0) {
        /* A stack of an older kscore: no nats.port, but env has the url. */
        char *old = cli_env_get("KSCORE_NATS_URL");
        const char *colon = old ? strrchr(old, ':') : NULL;
        port = colon ? atoi(colon + 1) : 0;
        free(old);
    }
    if (!cluster && nats_up && port > 0 && nats_stale) {
        fprintf(stderr, "kscore: restarting nats-server (no system account, "
                        "an HTTP monitoring port)\n");
        stack_nats_stop(home);
        nats_up = false;
    }
    if (cluster) {
        /* started above */
    } else if (nats_up && port > 0) {
        if (asprintf(&url, "%s://%s:%d", ul.tls ? "tls" : "nats", ul.host,
                     port) < 0)
            goto fail;
        /* New users (another host name, a repaired seed) without a
         * restart: the server reloads its users. */
        if (auth_changed)
            stack_nats_reload(home, 5000);
    } else {
        if (nats_up) {
            /* Running, but where is unknown: start the three afresh. */
            stack_stop(home, "agent", 20000);
            stack_stop(home, "broker", 20000);
            stack_nats_stop(home);
            broker_up = agent_up = false;
        }
        nats_up = false;
        if (port > 0 && stack_port_free(port) != 1) {
            fprintf(stderr,
                    "kscore: port %d, where nats-server served before, is "
                    "taken; using another (the env file follows; remote "
                    "agents need the new URL)\n",
                    port);
            port = 0;
            /* The running broker and agent know only the old port. */
            if (broker_up)
                stack_stop(home, "broker", 20000);
            if (agent_up)
                stack_stop(home, "agent", 20000);
            broker_up = agent_up = false;
        }
        /* No HTTP monitoring port: nats-server 2.9 asks no credential
         * there (server.go startMonitoring) and /connz lists every user;
         * the stack asks its monitoring over NATS as the system user
         * (stack_nats_monitor). */
        fprintf(stderr, "kscore: starting nats-server ...\n");
        rc = stack_nats_start_at(home, ul.host, port, ul.tls_conf,
                                 STACK_NATS_AUTH_INCLUDE, &url, &pid);
        if (rc) {
            cli_err("cannot start nats-server: %s (see %s/nats.log)",
                    ks_strerror(rc), home);
            rc = CLI_EXIT_KSCORE;
            goto fail;
        }
        /* The broker and agent that stayed up reconnect; only heartbeats
         * from now on show the agent is back. */
        since_us = ks_now_us();
    }
    if (!pg_up)
        fprintf(stderr, "kscore: starting PostgreSQL ...\n");
    rc = stack_pg_start(home, 0, &db, &pid);
    if (rc) {
        cli_err("cannot start PostgreSQL: %s (see %s/pg.log)",
                ks_strerror(rc), home);
        free(url);
        return CLI_EXIT_KSCORE;
    }
    snprintf(nlocal, sizeof(nlocal), "%u", local_agents);
    snprintf(agent_state, sizeof(agent_state), "%s/agent", home);
    /* Each daemon gets its own seed file through the environment; no
     * other credential of the caller's may reach it. */
    clear_nats_env();
    /* The brokers' policy is the stack's (--policy on its copy, or none),
     * not whatever this shell has. */
    unsetenv("KSCORE_POLICY");
    /* One broker, or CLUSTER_BROKERS on a cluster: broker-1 runs the
     * local agents and the metrics, each gets every node's url. */
    unsigned nbrokers = cluster ? CLUSTER_BROKERS : 1;
    char nreplicas[16];
    snprintf(nreplicas, sizeof(nreplicas), "%u", cluster ? cluster : 1);
    for (unsigned k = 0; k < nbrokers; k++) {
        char bname[16], blog_state[4200];
        bool bup;
        broker_part(home, cluster, k, bname, sizeof(bname), blog_state,
                    sizeof(blog_state));
        bup = cluster ? stack_pidfile_alive(home, bname, NULL) : broker_up;
        if (k == 0 && cluster)
            broker_up = bup;
        if (bup) {
            if (k == 0 && local_agents_given && local_agents != prev_n)
                fprintf(stderr,
                        "kscore: the broker runs %u local agents, not %u: "
                        "`kscore down` first to change that\n",
                        prev_n, local_agents);
            if (k == 0)
                local_agents = prev_n;
            continue;
        }
        fprintf(stderr, "kscore: starting the %s ...\n",
                cluster ? bname : "broker");
        snprintf(nlocal, sizeof(nlocal), "%u", k == 0 ? local_agents : 0);
        setenv("KSCORE_NATS_NKEY", broker_seed, 1);
        char *bargv[] = {exe,         "broker",         "--nats",
                         url,         "--db",           db,
                         "--local-agents", nlocal,      "--state-dir",
                         blog_state,  "--signing-key",  signing_key,
                         /* the host's own service config is not ours */
                         "--config", "/dev/null", NULL, NULL, NULL,
                         NULL,        NULL,             NULL,
                         NULL,        NULL,             NULL,
                         NULL,        NULL,             NULL,
                         NULL,        NULL,             NULL};
        if (metrics && k == 0) {
            int bp = metrics_port(prev_bm);
            if (bp > 0) {
                snprintf(bmetrics, sizeof(bmetrics), "127.0.0.1:%d", bp);
                bargv[14] = "--metrics-listen";
                bargv[15] = bmetrics;
                bargv[16] = "--metrics-token-file";
                bargv[17] = metrics_token;
            }
        }
        if (cluster) {
            size_t at = 14;
            while (bargv[at])
                at++;
            bargv[at] = "--replicas";
            bargv[at + 1] = nreplicas;
        }
        if (pol.configured) {
            size_t at = 14;
            while (bargv[at])
                at++;
            bargv[at] = "--policy";
            bargv[at + 1] = pol.file;
        }
        ul.enrolled = cli_stack_enrolled(home);
        cli_listen_args(bargv, &ul, 0);
        rc = stack_daemon(home, bname, bargv, &pid);
        unsetenv("KSCORE_NATS_NKEY");
        if (rc) {
            cli_err("the %s did not start: %s (see %s/%s.log)", bname,
                    ks_strerror(rc), home, bname);
            goto fail;
        }
    }
    /* On a cluster a broker waits for JetStream's leaders before it
     * serves (up to BROKER_JS_WAIT_MS, broker/jsready.c): longer here. */
    rc = wait_broker(url, operator_seed,
                     cluster ? BROKER_JS_WAIT_MS + 30000 : 30000);
    if (rc) {
        cli_err("the broker does not answer: %s (see %s/broker.log)",
                ks_strerror(rc), home);
        goto fail;
    }
    if (cluster) {
        /* Each replicated stream's raft group elects its own leader,
         * seconds after the meta leader and often after the brokers
         * answer (always so when the nodes start again with their
         * stores): until the registry's has one, an agent's heartbeat
         * finds no stream. The agent tries again for a while too; this
         * wait makes its first try the one that works. */
        int64_t t0 = ks_mono_us();
        if (stack_cluster_wait_streams(nodes, cluster, false, 60000) != 0)
            fprintf(stderr, "kscore: a stream has no leader yet (`kscore "
                            "status` says which); going on\n");
        else if (ks_mono_us() - t0 > 1000000)
            fprintf(stderr, "kscore: the streams' leaders elected (%.1f s)\n",
                    (double)(ks_mono_us() - t0) / 1e6);
    }
    if (!agent_up) {
        fprintf(stderr, "kscore: starting agent %s ...\n", agent_id);
        setenv("KSCORE_NATS_NKEY", agent_seed, 1);
        char *aargv[] = {exe,         "agent",       "--id",      agent_id,
                         "--nats",    url,           "--state-dir",
                         agent_state, "--trust-key", trust_key,
                         "--config",  "/dev/null",  NULL,        NULL,
                         NULL,        NULL,         NULL,        NULL,
                         NULL,        NULL,         NULL,        NULL,
                         NULL,        NULL,         NULL};
        if (metrics) {
            int ap = metrics_port(prev_am);
            if (ap > 0 && (!bmetrics[0] || ap != atoi(strrchr(bmetrics, ':') + 1))) {
                snprintf(ametrics, sizeof(ametrics), "127.0.0.1:%d", ap);
                aargv[12] = "--metrics-listen";
                aargv[13] = ametrics;
                aargv[14] = "--metrics-token-file";
                aargv[15] = metrics_token;
            }
        }
        cli_listen_args(aargv, &ul, 1);
        rc = stack_daemon(home, "agent", aargv, &pid);
        unsetenv("KSCORE_NATS_NKEY");
        if (rc) {
            cli_err("the agent did not start: %s (see %s/agent.log)",
                    ks_strerror(rc), home);
            goto fail;
        }
    }
    /* A cluster first elects the leaders of the replicated agents bucket,
     * which a loaded machine can stretch past half a minute. */
    rc = wait_agent(url, agent_id, broker_seed, since_us,
                    cluster ? 90000 : 30000);
    if (rc) {
        cli_err("the agent does not answer: %s (see %s/agent.log)",
                ks_strerror(rc), home);
        goto fail;
    }
    {
        size_t el = 0;
        if (bmetrics[0])
            el += (size_t)snprintf(env_extra + el, sizeof(env_extra) - el,
                                   "KSCORE_BROKER_METRICS_URL='http://%s/metrics'\n",
                                   bmetrics);
        else if (prev_bm && prev_bm[0] && broker_up)
            el += (size_t)snprintf(env_extra + el, sizeof(env_extra) - el,
                                   "KSCORE_BROKER_METRICS_URL='%s'\n", prev_bm);
        if (ametrics[0])
            snprintf(env_extra + el, sizeof(env_extra) - el,
                     "KSCORE_AGENT_METRICS_URL='http://%s/metrics'\n",
                     ametrics);
        else if (prev_am && prev_am[0] && agent_up)
            snprintf(env_extra + el, sizeof(env_extra) - el,
                     "KSCORE_AGENT_METRICS_URL='%s'\n", prev_am);
    }
    if (cluster) {
        size_t el = strlen(env_extra);
        snprintf(env_extra + el, sizeof(env_extra) - el,
                 "KSCORE_CLUSTER='%u'\n", cluster);
    }
    if ((rc = write_env(home, url, db, agent_id, local_agents,
                        operator_seed, env_extra)) ||
        (rc = cli_listen_env(home, &ul))) {
        cli_err("cannot write %s/env: %s", home, ks_strerror(rc));
        goto fail;
    }
    fprintf(stderr, "kscore: the local stack is up in %s\n", home);
    free(url);
    free(db);
    free(prev_bm);
    free(prev_am);
    free(ul.tls_conf);
    print_status(json, &(struct cli_conn){0});
    return 0;
fail:
    free(url);
    free(db);
    free(ul.tls_conf);
    free(prev_bm);
    free(prev_am);
    return CLI_EXIT_KSCORE;
}

static int
down_failed(const char *part, int rc)
{
    cli_err("cannot stop %s: %s%s", part, ks_strerror(rc),
            rc == -EPERM ? " (the stack belongs to another user)" : "");
    return CLI_EXIT_KSCORE;
}

int
cmd_down(int argc, char **argv)
{
    const char *home = cli_home();
    char path[4200];
    int rc = 0;

    if (argc > 1) {
        printf("usage: kscore down\nStops every part of the local stack in "
               "%s.\n",
               home);
        return strcmp(argv[1], "--help") == 0 ? 0 : CLI_EXIT_USAGE;
    }
    /* Never a signal to a pid of another boot (another process now). */
    stack_forget_other_boot(home);
    /* Agent first, so its running commands end and report while the
     * broker and the servers are still there. */
    int prc;
    if ((prc = stack_stop(home, "agent", 20000)) != 0)
        rc = down_failed("agent", prc);
    if ((prc = stack_stop(home, "broker", 20000)) != 0)
        rc = down_failed("broker", prc);
    /* A cluster's brokers and nodes (kscore up --cluster): whichever
     * have a pid file, running or not. */
    for (unsigned i = 1; i <= CLUSTER_BROKERS + 2; i++) {
        char name[16];
        snprintf(name, sizeof(name), "broker-%u", i);
        if ((prc = stack_stop(home, name, 20000)) != 0)
            rc = down_failed(name, prc);
    }
    if ((prc = stack_nats_stop(home)) != 0)
        rc = down_failed("nats", prc);
    for (unsigned i = 1; i <= STACK_CLUSTER_MAX; i++) {
        char dir[4200], name[16];
        snprintf(name, sizeof(name), "nats-%u", i);
        snprintf(dir, sizeof(dir), "%s/%s", home, name);
        if ((prc = stack_nats_stop(dir)) != 0)
            rc = down_failed(name, prc);
    }
    if ((prc = stack_pg_stop(home)) != 0)
        rc = down_failed("pg", prc);
    snprintf(path, sizeof(path), "%s/env", home);
    if (rc == 0) /* clients of a stack that still runs keep finding it */
        unlink(path);
    if (rc)
        cli_err("some part of the stack did not stop (kscore status)");
    else
        fprintf(stderr, "kscore: the local stack in %s is stopped\n", home);
    return rc;
}

/* ---- services ------------------------------------------------------------ */

/* The flags broker and agent share: --config, --log-format, --log-level,
 * --show-config, --metrics-listen, --metrics-token-file. */
struct svc_flags {
    const char *config, *log_format, *log_level, *metrics_listen;
    const char *metrics_token_file;
    bool show;
};
#define SVC_OPT_METRICS_TOKEN 1000

/* true when opt is one of them (and taken). */
static bool
svc_opt(struct svc_flags *f, int opt, const char *arg)
{
    switch (opt) {
    case 'c':
        f->config = arg;
        return true;
    case 'F':
        f->log_format = arg;
        return true;
    case 'L':
        f->log_level = arg;
        return true;
    case 'S':
        f->show = true;
        return true;
    case 'M':
        f->metrics_listen = arg;
        return true;
    case SVC_OPT_METRICS_TOKEN:
        f->metrics_token_file = arg;
        return true;
    default:
        return false;
    }
}

/* Serves metrics of roles on listen (the caller has blocked SIGINT and
 * SIGTERM first, so the server's thread never takes them). 0, or an exit
 * code after saying why. */
static int
metrics_start(const char *who, const struct svc_flags *sf, unsigned roles,
              struct cli_metrics_server **ms)
{
    const char *listen = sf->metrics_listen;
    char *errmsg = NULL;
    int rc = cli_metrics_serve_auth(listen, roles, sf->metrics_token_file,
                                    ms, &errmsg);
    if (rc) {
        cli_err("%s: %s", who, errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return rc == KS_EINVAL ? CLI_EXIT_USAGE : CLI_EXIT_KSCORE;
    }
    ks_log(KS_LOG_INFO, "metrics", KS_S("listen", listen),
           KS_I("port", cli_metrics_port(*ms)), KS_S("path", "/metrics"),
           KS_S("auth", sf->metrics_token_file &&
                                sf->metrics_token_file[0]
                            ? "bearer token"
                            : "none"));
    return 0;
}

/* --drain-timeout D of `kscore broker` and `kscore agent` (NULL: the
 * default, AGENT_DRAIN_TIMEOUT_MS) into *ms. 0, or CLI_EXIT_USAGE after
 * saying why. */
static int
drain_timeout(const char *d, uint64_t *ms)
{
    *ms = AGENT_DRAIN_TIMEOUT_MS;
    if (d && cli_parse_duration(d, ms)) {
        cli_err("bad --drain-timeout '%s' (a duration: 30s, 2m, 0)", d);
        return CLI_EXIT_USAGE;
    }
    return 0;
}

int
cmd_broker(int argc, char **argv)
{
    static const struct option lo[] = {
        CLI_CONN_LONGOPTS,
        {"db", required_argument, 0, 'd'},
        {"local-agents", required_argument, 0, 'l'},
        {"state-dir", required_argument, 0, 's'},
        {"signing-key", required_argument, 0, 'k'},
        {"policy", required_argument, 0, 'p'},
        {"config", required_argument, 0, 'c'},
        {"log-format", required_argument, 0, 'F'},
        {"log-level", required_argument, 0, 'L'},
        {"show-config", no_argument, 0, 'S'},
        {"metrics-listen", required_argument, 0, 'M'},
        {"metrics-token-file", required_argument, 0, SVC_OPT_METRICS_TOKEN},
        {"require-signed-labels", no_argument, 0, 'G'},
        {"allow-unsigned-labels", no_argument, 0, 'U'},
        {"replicas", required_argument, 0, 'R'},
        {"drain-timeout", required_argument, 0, 'D'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct broker_opts o = {0};
    const char *require_signed = NULL;
    const char *replicas = NULL, *drain = NULL;
    const char *copy_mib[2] = {NULL, NULL}, *copy_keep[2] = {NULL, NULL};
    const char *cmds_mib = NULL;
    struct cli_metrics_server *ms = NULL;
    struct svc_flags sf = {0};
    struct cli_conn cc = {0};
    struct cli_conf cf = {0};
    const char *local_agents = NULL;
    char *errmsg = NULL, *end;
    int opt, rc;

    /* Before any thread: the start state does not depend on who ran us
     * (a parent that ignored SIGCHLD or blocked signals; agent.h,
     * "Process start state"). */
    exec_process_init();
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'd':
            o.db_conninfo = optarg;
            break;
        case 'l':
            local_agents = optarg;
            break;
        case 's':
            o.state_dir = optarg;
            break;
        case 'k':
            o.signing_key = optarg;
            break;
        case 'p':
            o.policy_file = optarg;
            break;
        case 'R':
            replicas = optarg;
            break;
        case 'D':
            drain = optarg;
            break;
        case 'G':
            require_signed = "true";
            break;
        case 'U':
            require_signed = "false";
            break;
        case 'h':
            printf("usage: kscore broker --nats URL --db CONNINFO "
                   "--signing-key FILE [--policy FILE] [--local-agents N] "
                   "[--state-dir DIR] [--metrics-listen ADDR:PORT "
                   "[--metrics-token-file FILE]] "
                   "[--require-signed-labels|--allow-unsigned-labels] "
                   "[--replicas N] [--drain-timeout D] "
                   "[--config FILE] [--log-format "
                   "text|json] [--log-level LEVEL] [--show-config]\n"
                   "The signing key (kscore keygen) signs every command; "
                   "agents trust its public half.\n"
                   "--require-signed-labels (the default): an agent whose "
                   "labels the signing key did not sign (kscore agent "
                   "enroll) gets no labels. --allow-unsigned-labels: one "
                   "that was never enrolled keeps the labels it declares "
                   "(a single host); an id whose signed labels were seen "
                   "gets none without them either way.\n"
                   "--replicas N: copies of the streams and the KV bucket "
                   "on a JetStream cluster (1..5, at most its nodes; "
                   "default 1).\n"
                   "--drain-timeout D: at SIGTERM the in-process agents "
                   "take no new work and their running commands may finish "
                   "for up to D (default 10s; 0: stop them at once); what "
                   "is left is stopped and ends Lost (the agent stopped). "
                   "A second signal stops at once.\n"
                   "Settings: flags, then KSCORE_* variables, then the "
                   "config file (default " CLI_CONF_DIR "/broker.conf when "
                   "it exists; kscore.conf(5)).\n");
            return 0;
        default:
            if (svc_opt(&sf, opt, optarg) || cli_conn_opt(&cc, opt, optarg))
                break;
            return CLI_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        cli_err("broker: unexpected argument '%s'", argv[optind]);
        return CLI_EXIT_USAGE;
    }
    if ((rc = cli_conf_load(&cf, CLI_CONF_BROKER, sf.config)))
        goto out;
    cli_conf_conn(&cf, &cc);
    if ((rc = cli_conf_str(&cf, "db", &o.db_conninfo)) ||
        (rc = cli_conf_str(&cf, "signing_key", &o.signing_key)) ||
        (rc = cli_conf_str(&cf, "policy", &o.policy_file)) ||
        (rc = cli_conf_str(&cf, "state_dir", &o.state_dir)) ||
        (rc = cli_conf_str(&cf, "local_agents", &local_agents)) ||
        (rc = cli_conf_str(&cf, "metrics_listen", &sf.metrics_listen)) ||
        (rc = cli_conf_str(&cf, "metrics_token_file",
                           &sf.metrics_token_file)) ||
        (rc = cli_conf_str(&cf, "require_signed_labels", &require_signed)) ||
        (rc = cli_conf_str(&cf, "replicas", &replicas)) ||
        (rc = cli_conf_str(&cf, "drain_timeout", &drain)) ||
        (rc = cli_conf_str(&cf, "copy_operator_mib", &copy_mib[0])) ||
        (rc = cli_conf_str(&cf, "copy_total_mib", &copy_mib[1])) ||
        (rc = cli_conf_str(&cf, "cmds_operator_mib", &cmds_mib)) ||
        (rc = cli_conf_str(&cf, "copy_keep", &copy_keep[0])) ||
        (rc = cli_conf_str(&cf, "copy_upload_keep", &copy_keep[1])) ||
        (rc = cli_conf_log(&cf, sf.log_format, sf.log_level, "broker")))
        goto out;
    if ((rc = drain_timeout(drain, &o.drain_timeout_ms)))
        goto out;
    /* Checked as they were read (cli_conf_load, the environment's). */
    if (copy_mib[0])
        o.copy_operator_bytes = strtoull(copy_mib[0], NULL, 10) << 20;
    if (copy_mib[1])
        o.copy_total_bytes = strtoull(copy_mib[1], NULL, 10) << 20;
    if (cmds_mib)
        o.cmds_operator_bytes = strtoull(cmds_mib, NULL, 10) << 20;
    if (copy_keep[0])
        cli_parse_duration(copy_keep[0], &o.copy_keep_ms);
    if (copy_keep[1])
        cli_parse_duration(copy_keep[1], &o.copy_upload_keep_ms);
    /* On unless turned off: a label the agent merely declares would pick
     * prod's commands and secrets for any agent credential (issue 21). */
    o.require_signed_labels = !require_signed || cli_conf_true(require_signed);
    if (replicas) {
        o.replicas = (unsigned)strtoul(replicas, &end, 10);
        if (*end || !replicas[0] || replicas[0] == '-' || o.replicas < 1 ||
            o.replicas > 5) {
            cli_err("bad --replicas '%s' (1..5)", replicas);
            rc = CLI_EXIT_USAGE;
            goto out;
        }
    }
    if (local_agents) {
        o.local_agents = (unsigned)strtoul(local_agents, &end, 10);
        if (*end || !local_agents[0] || local_agents[0] == '-' ||
            o.local_agents > 10000) {
            cli_err("bad --local-agents '%s' (0..10000)", local_agents);
            rc = CLI_EXIT_USAGE;
            goto out;
        }
    }
    if (sf.show) {
        cli_conf_show(&cf, stdout);
        rc = 0;
        goto out;
    }
    o.nats_url = cc.nats_url;
    o.nats = cc.opts;
    if (!o.nats_url || !o.db_conninfo) {
        cli_err("the broker needs --nats URL and --db CONNINFO (or "
                "KSCORE_NATS_URL and KSCORE_DB, or nats_url and db in "
                "its config file)");
        rc = CLI_EXIT_USAGE;
        goto out;
    }
    /* A policy others may write grants what they like: refused. */
    if (o.policy_file && (rc = cli_path_trusted(o.policy_file)))
        goto out;
    if (sf.metrics_listen && sf.metrics_listen[0]) {
        /* Before the server's thread exists, so that SIGTERM reaches only
         * broker_run's sigwait (it blocks the same set). */
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &set, NULL);
        if ((rc = metrics_start("broker", &sf,
                                KS_METRICS_BROKER |
                                    (o.local_agents ? KS_METRICS_AGENT : 0),
                                &ms)))
            goto out;
    }
    rc = broker_run(&o, &errmsg);
    if (rc) {
        cli_err("broker: %s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        rc = CLI_EXIT_KSCORE;
    }
out:
    cli_metrics_stop(ms);
    cli_conf_release(&cf);
    return rc;
}

/* --show-config: what the bundle gave was noted as given by a flag (it is
 * put in before the environment and the file are read); say "bundle". */
static void
conf_from_bundle(struct cli_conf *cf, const char *value)
{
    for (size_t i = 0; value && i < cf->n_shown; i++)
        if (cf->shown[i].value == value &&
            strcmp(cf->shown[i].from, "flag") == 0) {
            char *b = strdup("bundle");
            if (b) {
                free(cf->shown[i].from);
                cf->shown[i].from = b;
            }
        }
}

int
cmd_agent(int argc, char **argv)
{
    static const struct option lo[] = {
        {"id", required_argument, 0, 'i'},
        {"pool", required_argument, 0, 'P'},
        {"pool-size", required_argument, 0, 'N'},
        {"label", required_argument, 0, 'l'},
        CLI_CONN_LONGOPTS,
        {"state-dir", required_argument, 0, 's'},
        {"max-concurrent", required_argument, 0, 'm'},
        {"ack-wait", required_argument, 0, 'w'},
        {"trust-key", required_argument, 0, 'k'},
        {"config", required_argument, 0, 'c'},
        {"log-format", required_argument, 0, 'F'},
        {"log-level", required_argument, 0, 'L'},
        {"show-config", no_argument, 0, 'S'},
        {"metrics-listen", required_argument, 0, 'M'},
        {"metrics-token-file", required_argument, 0, SVC_OPT_METRICS_TOKEN},
        {"bundle", required_argument, 0, 'b'},
        {"drain-timeout", required_argument, 0, 'D'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct agent_opts o = {0};
    struct cli_bundle bundle = {0};
    struct agent_attestation att = {0};
    struct agent_label *att_labels = NULL;
    const char *bundle_file = NULL;
    struct cli_metrics_server *ms = NULL;
    struct svc_flags sf = {0};
    struct cli_conn cc = {0};
    struct cli_conf cf = {0};
    const char *max_concurrent = NULL, *ack_wait = NULL, *drain = NULL;
    uint64_t drain_ms = AGENT_DRAIN_TIMEOUT_MS;
    const char *pool = NULL, *pool_size = NULL;
    char **pool_ids = NULL;
    size_t n_pool_ids = 0;
    char *labels_env = NULL;
    /* Lists (ids, labels, trust keys) come whole from the first source
     * that has any: flags, then the environment, then the file. */
    size_t room = (size_t)argc + 1024;
    const char **ids = calloc(room, sizeof(*ids));
    const char **keys = calloc(room, sizeof(*keys));
    struct agent_label *labels = calloc(room, sizeof(*labels));
    const char **strs = calloc(room, sizeof(*strs));
    char **label_keys = calloc(room, sizeof(*label_keys));
    size_t owned_label_keys = 0;
    struct agent *a = NULL;
    char *errmsg = NULL;
    sigset_t set;
    int opt, sig, rc = CLI_EXIT_USAGE;

    /* Before any thread: the start state does not depend on who ran us
     * (a parent that ignored SIGCHLD or blocked signals; agent.h,
     * "Process start state"). */
    exec_process_init();
    /* Subcommand words select the fleet mode (cli/cmd_enroll.c). */
    if (argc > 1 && (strcmp(argv[1], "enroll") == 0 ||
                     strcmp(argv[1], "revoke") == 0 ||
                     strcmp(argv[1], "list") == 0)) {
        free(label_keys);
        free(ids);
        free(labels);
        free(keys);
        free(strs);
        return cmd_agent_admin(argc - 1, argv + 1);
    }
    if (!ids || !labels || !keys || !strs || !label_keys) {
        free(label_keys);
        free(ids);
        free(labels);
        free(keys);
        free(strs);
        return CLI_EXIT_KSCORE;
    }
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *eq;
        switch (opt) {
        case 'i':
            ids[o.n_ids++] = optarg;
            break;
        case 'P':
            pool = optarg;
            break;
        case 'N':
            pool_size = optarg;
            break;
        case 'l':
            eq = strchr(optarg, '=');
            if (!eq || eq == optarg) {
                cli_err("bad --label '%s': expected KEY=VALUE", optarg);
                goto out;
            }
            *eq = '\0';
            labels[o.n_labels].key = optarg;
            labels[o.n_labels++].value = eq + 1;
            break;
        case 's':
            o.state_dir = optarg;
            break;
        case 'm':
            max_concurrent = optarg;
            break;
        case 'k':
            keys[o.n_trust_keys++] = optarg;
            break;
        case 'w':
            ack_wait = optarg;
            break;
        case 'b':
            bundle_file = optarg;
            break;
        case 'D':
            drain = optarg;
            break;
        case 'h':
            printf("usage: kscore agent --id ID [--id ID]... [--pool NAME "
                   "[--pool-size N]] --trust-key FILE "
                   "[--label K=V]... [--nats URL] [--state-dir DIR] "
                   "[--max-concurrent N] [--ack-wait D] "
                   "[--drain-timeout D] "
                   "[--metrics-listen ADDR:PORT [--metrics-token-file FILE]] "
                   "[--config FILE] "
                   "[--log-format text|json] [--log-level LEVEL] "
                   "[--show-config]\n"
                   "       kscore agent --bundle FILE [--state-dir DIR] "
                   "[--label K=V]... [--max-concurrent N]\n"
                   "       kscore agent enroll|revoke|list ... (kscore agent "
                   "enroll --help)\n"
                   "       kscore agent label ID|pool-POOL KEY=VALUE|KEY-... "
                   "[--json]: change its signed labels (kscore agent label "
                   "--help)\n"
                   "--pool NAME: the ids NAME-0 .. NAME-<N-1> form one "
                   "pool: one JetStream consumer and one registry entry for "
                   "all of them; --pool-size N serves them all. A pool "
                   "comes from its bundle (kscore agent enroll NAME "
                   "--pool-size N: the broker takes a pool it signed "
                   "only; deploy/SCALING.md).\n"
                   "--drain-timeout D: at SIGTERM the agent takes no new "
                   "work and its running commands may finish for up to D "
                   "(default 10s; 0: stop them at once); what is left is "
                   "stopped and ends Lost (the agent stopped). A second "
                   "signal stops at once.\n"
                   "A bundle (kscore agent enroll) gives the id, labels, "
                   "NATS urls, credential, TLS files and trust key; flags "
                   "override it.\n"
                   "Runs only commands signed by a trusted key "
                   "(--trust-key, repeatable, or KSCORE_TRUST_KEY).\n"
                   "Settings: flags, then KSCORE_* variables, then the "
                   "config file (default " CLI_CONF_DIR "/agent.conf when "
                   "it exists; kscore.conf(5)).\n");
            rc = 0;
            goto out;
        default:
            if (svc_opt(&sf, opt, optarg) || cli_conn_opt(&cc, opt, optarg))
                break;
            goto out;
        }
    }
    if (optind < argc) {
        cli_err("agent: unexpected argument '%s'", argv[optind]);
        goto out;
    }
    if ((rc = cli_conf_load(&cf, CLI_CONF_AGENT, sf.config)))
        goto out;
    rc = CLI_EXIT_USAGE;
    /* The log settings first: "bad bundle" is a line of the log too. */
    if (cli_conf_str(&cf, "bundle", &bundle_file) ||
        cli_conf_str(&cf, "state_dir", &o.state_dir) ||
        cli_conf_log(&cf, sf.log_format, sf.log_level, "agent"))
        goto out;
    if (bundle_file) {
        char why[512] = "";
        int brc = cli_bundle_load(bundle_file, o.state_dir, &bundle, why,
                                  sizeof(why));
        if (brc) {
            cli_err("bad bundle %s: %s", bundle_file,
                    why[0] ? why : ks_strerror(brc));
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        /* A pool's bundle serves its pool's ids, named by its size. */
        if (bundle.pool[0]) {
            static char size_buf[16];
            if (o.n_ids || (pool && strcmp(pool, bundle.pool) != 0)) {
                cli_err("the bundle is pool %s's: it serves %s-0 .. %s-%u "
                        "(no --id, no other --pool)",
                        bundle.pool, bundle.pool, bundle.pool,
                        bundle.pool_size - 1);
                goto out;
            }
            pool = bundle.pool;
            if (!pool_size) {
                snprintf(size_buf, sizeof(size_buf), "%u", bundle.pool_size);
                pool_size = size_buf;
            }
        }
        /* The bundle's identity may serve its own id only. */
        for (size_t i = 0; !bundle.pool[0] && i < o.n_ids; i++)
            if (strcmp(ids[i], bundle.id) != 0) {
                cli_err("--id %s: the bundle is agent %s's (its NATS user "
                        "may serve no other id)",
                        ids[i], bundle.id);
                goto out;
            }
        if (o.n_ids == 0 && !bundle.pool[0])
            ids[o.n_ids++] = bundle.id;
        /* Flags first, then the bundle, then the environment and file:
         * the bundle's credential is what this agent is. */
        if (!cc.nats_url)
            cc.nats_url = bundle.urls;
        if (!cc.opts.nkey_file)
            cc.opts.nkey_file = bundle.nkey_file;
        if (!cc.opts.tls_ca && bundle.tls_ca[0])
            cc.opts.tls_ca = bundle.tls_ca;
        if (!cc.opts.tls_cert && bundle.tls_cert[0]) {
            cc.opts.tls_cert = bundle.tls_cert;
            cc.opts.tls_key = bundle.tls_key;
        }
    }
    cli_conf_conn(&cf, &cc);
    if (cli_conf_str(&cf, "pool", &pool) ||
        cli_conf_str(&cf, "pool_size", &pool_size) ||
        cli_conf_str(&cf, "max_concurrent", &max_concurrent) ||
        cli_conf_str(&cf, "ack_wait", &ack_wait) ||
        cli_conf_str(&cf, "drain_timeout", &drain) ||
        cli_conf_str(&cf, "metrics_listen", &sf.metrics_listen) ||
        cli_conf_str(&cf, "metrics_token_file", &sf.metrics_token_file))
        goto out;
    if ((rc = drain_timeout(drain, &drain_ms)))
        goto out;
    if (max_concurrent) {
        char *end;
        o.max_concurrent = (unsigned)strtoul(max_concurrent, &end, 10);
        if (*end || !o.max_concurrent || max_concurrent[0] == '-') {
            cli_err("bad --max-concurrent '%s' (>= 1)", max_concurrent);
            goto out;
        }
    }
    if (ack_wait && (cli_parse_duration(ack_wait, &o.ack_wait_ms) ||
                     o.ack_wait_ms < 1000)) {
        cli_err("bad --ack-wait '%s' (a duration >= 1s)", ack_wait);
        goto out;
    }
    {
        /* where each list came from, for --show-config */
        const char *ids_from = o.n_ids ? "flag" : NULL;
        const char *keys_from = o.n_trust_keys ? "flag" : NULL;
        const char *k = getenv("KSCORE_TRUST_KEY");
        if (o.n_ids == 0)
            o.n_ids = cli_conf_list(&cf, "id", ids, room);
        if (o.n_trust_keys == 0 && k && k[0]) {
            keys[o.n_trust_keys++] = k;
            keys_from = "KSCORE_TRUST_KEY";
        } else if (o.n_trust_keys == 0) {
            o.n_trust_keys = cli_conf_list(&cf, "trust_key", keys, room);
        }
        for (size_t i = 0; i < o.n_ids; i++) {
            char *w = ids_from ? NULL : cli_conf_where(&cf, "id", i);
            cli_conf_note(&cf, "id", ids[i], w ? w : ids_from ? ids_from : "");
            free(w);
        }
        for (size_t i = 0; i < o.n_trust_keys; i++) {
            char *w = keys_from ? NULL : cli_conf_where(&cf, "trust_key", i);
            cli_conf_note(&cf, "trust_key", keys[i],
                          w ? w : keys_from ? keys_from : "");
            free(w);
        }
    }
    if (o.n_labels) {
        for (size_t i = 0; i < o.n_labels && owned_label_keys < room; i++) {
            char *kv = NULL;
            if (asprintf(&kv, "%s=%s", labels[i].key, labels[i].value) < 0)
                break;
            label_keys[owned_label_keys++] = kv;
            cli_conf_note(&cf, "label", kv, "flag");
        }
    }
    if (o.n_labels == 0) {
        /* KSCORE_LABELS="k=v,k=v" */
        const char *env = getenv("KSCORE_LABELS");
        size_t n = 0;
        if (env && env[0]) {
            if (!(labels_env = strdup(env))) {
                rc = CLI_EXIT_KSCORE;
                goto out;
            }
            for (char *save = NULL, *t = strtok_r(labels_env, ",", &save);
                 t && n < room; t = strtok_r(NULL, ",", &save))
                strs[n++] = t;
        } else {
            n = cli_conf_list(&cf, "label", strs, room);
        }
        for (size_t i = 0; i < n; i++) {
            const char *eq = strchr(strs[i], '=');
            if (!eq || eq == strs[i]) {
                cli_err("bad label '%s' in %s: expected KEY=VALUE", strs[i],
                        labels_env ? "KSCORE_LABELS" : cf.path);
                goto out;
            }
            char *k = strndup(strs[i], (size_t)(eq - strs[i]));
            if (!k) {
                rc = CLI_EXIT_KSCORE;
                goto out;
            }
            labels[o.n_labels].key = k;
            labels[o.n_labels++].value = eq + 1;
            char *w = labels_env ? NULL : cli_conf_where(&cf, "label", i);
            cli_conf_note(&cf, "label", strs[i],
                          w ? w : labels_env ? "KSCORE_LABELS" : "");
            free(w);
            /* strs[i] stays the K=V text: the value points into it */
            label_keys[owned_label_keys++] = k;
        }
    }
    if (bundle_file) {
        /* The bundle's labels, where no other source named the key. */
        size_t given = o.n_labels;
        for (size_t i = 0; i < bundle.n_labels && o.n_labels < room; i++) {
            char *kv = bundle.labels[i], *eq = strchr(kv, '=');
            bool dup = false;
            if (!eq)
                continue;
            *eq = '\0';
            for (size_t j = 0; j < given; j++)
                dup = dup || strcmp(labels[j].key, kv) == 0;
            if (!dup) {
                char *shown = NULL;
                labels[o.n_labels].key = kv;
                labels[o.n_labels++].value = eq + 1;
                if (owned_label_keys < room &&
                    asprintf(&shown, "%s=%s", kv, eq + 1) >= 0) {
                    label_keys[owned_label_keys++] = shown;
                    cli_conf_note(&cf, "label", shown, "bundle");
                }
            }
        }
        /* The broker's attestation of the bundle's own labels, passed on
         * as is: with it the broker gives this agent exactly those labels,
         * so other ones (--label, KSCORE_LABELS, agent.conf) are only
         * ours to see. The loop above split each "K=V" at its '='. */
        if (bundle.has_attest && (att_labels = calloc(
                                      bundle.n_labels + 1,
                                      sizeof(*att_labels)))) {
            for (size_t i = 0; i < bundle.n_labels; i++) {
                att_labels[i].key = bundle.labels[i];
                att_labels[i].value =
                    bundle.labels[i] + strlen(bundle.labels[i]) + 1;
            }
            att.labels = att_labels;
            att.n_labels = bundle.n_labels;
            att.enrolled_at_us = bundle.enrolled_at_us;
            att.sig = bundle.labels_sig;
            att.key_id = bundle.labels_key_id;
            if (bundle.pool[0])
                o.pool_attestation = &att;
            else
                o.attestations = &att;
            for (size_t i = 0; i < o.n_labels; i++) {
                bool attested = false;
                for (size_t j = 0; j < att.n_labels && !attested; j++)
                    attested = strcmp(labels[i].key, att_labels[j].key) == 0 &&
                               strcmp(labels[i].value, att_labels[j].value) == 0;
                if (!attested)
                    ks_log(KS_LOG_WARN,
                           "label not in the bundle: the broker ignores it "
                           "(it gives an enrolled agent only the labels it "
                           "signed; enrol it again to change them)",
                           KS_S("label", labels[i].key),
                           KS_S("value", labels[i].value));
            }
        }
        bool have = false;
        for (size_t i = 0; i < o.n_trust_keys; i++)
            have = have || strcmp(keys[i], bundle.trust_key) == 0;
        if (!have && o.n_trust_keys < room) {
            keys[o.n_trust_keys++] = bundle.trust_key;
            cli_conf_note(&cf, "trust_key", bundle.trust_key, "bundle");
        }
        conf_from_bundle(&cf, bundle.urls);
        conf_from_bundle(&cf, bundle.nkey_file);
        conf_from_bundle(&cf, bundle.tls_ca);
        conf_from_bundle(&cf, bundle.tls_cert);
        conf_from_bundle(&cf, bundle.tls_key);
        conf_from_bundle(&cf, bundle.id);
    }
    if (sf.show) {
        cli_conf_show(&cf, stdout);
        rc = 0;
        goto out;
    }
    if (pool_size) {
        char *end;
        unsigned long n = strtoul(pool_size, &end, 10);
        if (*end || !n || n > 100000 || pool_size[0] == '-' || !pool ||
            !evt_agent_id_valid(pool) ||
            strlen(pool) + 7 > EVT_AGENT_ID_MAX) {
            cli_err("bad --pool-size '%s' (1 to 100000, with --pool NAME)",
                    pool_size);
            goto out;
        }
        if (o.n_ids) {
            cli_err("--pool-size names the ids itself: not with --id");
            goto out;
        }
        pool_ids = calloc(n, sizeof(*pool_ids));
        for (size_t i = 0; pool_ids && i < n; i++) {
            if (asprintf(&pool_ids[i], "%s-%zu", pool, i) < 0) {
                pool_ids[i] = NULL;
                break;
            }
            n_pool_ids = i + 1;
        }
        if (n_pool_ids != n) {
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
    }
    if (pool && !evt_agent_id_valid(pool)) {
        cli_err("bad --pool '%s' (letters, digits, '-' and '_')", pool);
        goto out;
    }
    if (o.n_ids == 0 && n_pool_ids == 0) {
        cli_err("the agent needs --id ID (or --bundle FILE, or id in its "
                "config file)");
        goto out;
    }
    /* A trust key others may write is anyone's key: refused. */
    for (size_t i = 0; i < o.n_trust_keys; i++)
        if ((rc = cli_path_trusted(keys[i])))
            goto out;
    /* The broker ignores an entry past its bounds: say so now rather
     * than never show up. The rest of an entry (ids, host, version, key)
     * takes well under 2 KiB. */
    {
        size_t lbytes = 0;
        for (size_t i = 0; i < o.n_labels; i++)
            lbytes += strlen(labels[i].key) + strlen(labels[i].value) + 8;
        if (o.n_labels > BROKER_AGENT_INFO_MAX_LABELS ||
            lbytes > BROKER_AGENT_INFO_MAX_BYTES - 2048) {
            cli_err("too many labels: at most %d, of at most %d bytes in "
                    "all (the broker ignores a larger registry entry)",
                    BROKER_AGENT_INFO_MAX_LABELS,
                    BROKER_AGENT_INFO_MAX_BYTES - 2048);
            rc = CLI_EXIT_USAGE;
            goto out;
        }
    }
    o.nats_url = cc.nats_url;
    o.nats = cc.opts;
    if (!o.nats_url) {
        cli_err("the agent needs --nats URL (or KSCORE_NATS_URL, or nats_url "
                "in its config file)");
        goto out;
    }
    o.ids = ids;
    if (n_pool_ids) {
        o.ids = (const char *const *)pool_ids;
        o.n_ids = n_pool_ids;
    }
    o.pool = pool;
    if (bundle.pool[0])
        o.pool_size = bundle.pool_size; /* as enrolled and signed */
    o.labels = labels;
    o.trust_keys = keys;
    /* Before any thread exists, so only sigwait() sees these. */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    if (sf.metrics_listen && sf.metrics_listen[0] &&
        (rc = metrics_start("agent", &sf, KS_METRICS_AGENT, &ms)))
        goto out;
    rc = agent_start(&o, &a, &errmsg);
    if (rc) {
        cli_err("agent: %s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    ks_log(KS_LOG_INFO, "serving", KS_S("agent", o.ids[0]),
           KS_I("ids", o.n_ids), KS_S("nats", o.nats_url));
    ks_log(KS_LOG_INFO, "instance", KS_S("agent", o.ids[0]),
           KS_S("instance", agent_instance_id(a)));
    /* A signal, or the agent can serve no more (agent_fatal): then exit
     * AGENT_EXIT_CONFIG (revoked), which systemd does not restart, or
     * AGENT_EXIT_LINK (a dead link), which it does. */
    for (;;) {
        struct timespec tick = {0, 250 * 1000000L};
        sig = sigtimedwait(&set, NULL, &tick);
        if (sig > 0 || agent_fatal(a))
            break;
    }
    if (sig > 0) {
        ks_log(KS_LOG_INFO, "stopping", KS_S("signal", strsignal(sig)));
        rc = 0;
        /* Drains: no new work, what runs may finish (a second signal
         * stops at once). */
        agent_stop_graceful(a, drain_ms, &set);
    } else if (agent_fatal(a) == AGENT_FATAL_LINK) {
        ks_log(KS_LOG_ERROR, "stopping: the agent can serve no more",
               KS_S("reason", "the NATS link answers nothing"),
               KS_I("exit_code", AGENT_EXIT_LINK));
        rc = AGENT_EXIT_LINK;
        agent_stop(a);
    } else {
        ks_log(KS_LOG_ERROR, "stopping: the agent can serve no more",
               KS_S("reason", "revoked: NATS closed its connection"),
               KS_I("exit_code", AGENT_EXIT_CONFIG));
        rc = AGENT_EXIT_CONFIG;
        agent_stop(a);
    }
out:
    cli_metrics_stop(ms);
    cli_bundle_release(&bundle);
    free(att_labels);
    for (size_t i = 0; i < owned_label_keys; i++)
        free(label_keys[i]);
    free(label_keys);
    free(labels_env);
    free(strs);
    free(ids);
    for (size_t i = 0; i < n_pool_ids; i++)
        free(pool_ids[i]);
    free(pool_ids);
    free(labels);
    free(keys);
    cli_conf_release(&cf);
    return rc;
}

int
cmd_keygen(int argc, char **argv)
{
    static const struct option lo[] = {{"out", required_argument, 0, 'o'},
                                       {"name", required_argument, 0, 'n'},
                                       {"json", no_argument, 0, 'j'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    const char *dir = ".", *name = "kscore";
    char priv[4200], pub[4200];
    bool json = false;
    int opt, rc;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'o':
            dir = optarg;
            break;
        case 'n':
            name = optarg;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            printf("usage: kscore keygen [--out DIR] [--name NAME] [--json]\n"
                   "Writes an Ed25519 key pair: DIR/NAME.key (private, "
                   "0600: give it to the broker, --signing-key) and "
                   "DIR/NAME.pub (give it to agents, --trust-key).\n"
                   "Prints the two paths (--json: {\"private_key\", "
                   "\"public_key\"}).\n");
            return 0;
        default:
            return CLI_EXIT_USAGE;
        }
    }
    snprintf(priv, sizeof(priv), "%s/%s.key", dir, name);
    snprintf(pub, sizeof(pub), "%s/%s.pub", dir, name);
    rc = stack_mkdirs(dir, 0700);
    if (rc == 0)
        rc = evt_keygen(priv, pub);
    if (rc) {
        cli_err("keygen: %s: %s", rc == -EEXIST ? priv : dir,
                rc == -EEXIST ? "already exists (not overwritten)"
                              : ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "private_key", json_string(priv));
        json_object_set_new(o, "public_key", json_string(pub));
        cli_print_json(o);
        return 0;
    }
    printf("%s\n%s\n", priv, pub);
    return 0;
}
