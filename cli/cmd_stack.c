/* kscore up, down, status (the local stack) and the broker and agent
 * services. */
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
#include "cli_int.h"
#include "stack.h"

static const char *const parts[] = {"nats", "pg", "broker", "agent"};

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
           int timeout_ms)
{
    struct evt_connect_opts o = {.name = "kscore-up",
                                 .nkey_file = broker_seed,
                                 .tls_ca = up_tls.ca,
                                 .tls_cert = up_tls.cert,
                                 .tls_key = up_tls.key};
    return broker_wait_agent(url, &o, id,
                             ks_now_us() - (int64_t)EVT_AGENT_TTL_MS * 1000,
                             timeout_ms);
}

static int
write_env(const char *home, const char *url, const char *db,
          const char *agent, unsigned local_agents, const char *nkey_file)
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
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        return -errno;
    return 0;
}

static int
print_status(bool json)
{
    const char *home = cli_home();
    char *url = cli_env_get("KSCORE_NATS_URL");
    char *db = cli_env_get("KSCORE_DB");
    char *agent = cli_env_get("KSCORE_AGENT");
    int running = 0;
    json_t *o = json_object(), *jp = json_object();

    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        pid_t pid = 0;
        int alive = stack_pidfile_alive(home, parts[i], &pid);
        const char *addr = strcmp(parts[i], "nats") == 0  ? url
                           : strcmp(parts[i], "pg") == 0  ? db
                           : strcmp(parts[i], "agent") == 0 ? agent
                                                            : "";
        running += alive;
        json_t *p = json_object();
        json_object_set_new(p, "state",
                            json_string(alive ? "running" : "stopped"));
        json_object_set_new(p, "pid", alive ? json_integer(pid) : json_null());
        json_object_set_new(p, "address", json_string(addr ? addr : ""));
        json_object_set_new(jp, parts[i], p);
        if (!json) {
            char pids[16] = "-";
            if (alive)
                snprintf(pids, sizeof(pids), "%d", (int)pid);
            printf("%-7s %-8s pid %-8s %s\n", parts[i],
                   alive ? "running" : "stopped", pids, addr ? addr : "");
        }
    }
    if (json) {
        json_object_set_new(o, "home", json_string(home));
        json_object_set_new(o, "nats_url", url ? json_string(url)
                                               : json_null());
        json_object_set_new(o, "db", db ? json_string(db) : json_null());
        json_object_set_new(o, "agent_id", agent ? json_string(agent)
                                                 : json_null());
        json_object_set_new(o, "running",
                            json_boolean(running == (int)(sizeof(parts) /
                                                          sizeof(parts[0]))));
        json_object_set_new(o, "parts", jp);
        cli_print_json(o);
    } else {
        json_decref(o);
        json_decref(jp);
    }
    free(url);
    free(db);
    free(agent);
    return running == (int)(sizeof(parts) / sizeof(parts[0])) ? 0 : 1;
}

int
cmd_status(int argc, char **argv)
{
    bool json = argc > 1 && strcmp(argv[1], "--json") == 0;
    if (argc > 1 && !json) {
        if (strcmp(argv[1], "--help") == 0) {
            printf("usage: kscore status [--json]\nExit 0 when every part "
                   "of the local stack runs, 1 otherwise.\n");
            return 0;
        }
        cli_err("usage: kscore status [--json]");
        return CLI_EXIT_USAGE;
    }
    return print_status(json);
}

int
cmd_up(int argc, char **argv)
{
    static const struct option lo[] = {
        {"local-agents", required_argument, 0, 'l'},
        {"listen", required_argument, 0, 'L'},
        {"tls-name", required_argument, 0, 'N'},
        {"mtls", no_argument, 0, 'M'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *home = cli_home();
    struct cli_listen ul = {0};
    char exe[4096], agent_id[EVT_AGENT_ID_MAX + 1], nlocal[16];
    char agent_state[4200], local_state[4200];
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
        case 'L':
        case 'N':
        case 'M':
            if ((rc = cli_listen_opt(&ul, opt, optarg)))
                return rc;
            break;
        case 'h':
            printf("usage: kscore up [--local-agents N] [--listen ADDR "
                   "[--tls-name NAME]... [--mtls]]\nStarts the local "
                   "stack under $KSCORE_HOME (now %s).\n"
                   "--listen ADDR: nats-server listens on ADDR (an IPv4 "
                   "address agents on other hosts reach) instead of "
                   "127.0.0.1, TLS-only, with a certificate from the "
                   "stack's own CA ($KSCORE_HOME/tls) for ADDR, the host "
                   "name and each --tls-name; --mtls: clients must show a "
                   "certificate from that CA too. Kept for later `up`s "
                   "(--listen 127.0.0.1 goes back to loopback).\n",
                   home);
            return 0;
        default:
            return CLI_EXIT_USAGE;
        }
    }
    if (self_exe(exe, sizeof(exe)) != 0) {
        cli_err("cannot find my own executable");
        return CLI_EXIT_KSCORE;
    }
    int alive = 0;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        alive += stack_pidfile_alive(home, parts[i], NULL);
    /* Without --local-agents, keep what the stack was started with. */
    char *prev = cli_env_get("KSCORE_LOCAL_AGENTS");
    unsigned prev_n = prev ? (unsigned)strtoul(prev, NULL, 10) : 0;
    free(prev);
    if (alive == (int)(sizeof(parts) / sizeof(parts[0]))) {
        fprintf(stderr, "kscore: the local stack is already running in %s\n",
                home);
        if (local_agents_given && local_agents != prev_n)
            fprintf(stderr,
                    "kscore: it runs %u local agents, not %u: `kscore down` "
                    "first to change that\n",
                    prev_n, local_agents);
        if (ul.given_host || ul.mtls_given || ul.n_names)
            fprintf(stderr, "kscore: --listen, --tls-name and --mtls apply "
                            "when it starts: `kscore down` first\n");
        print_status(false);
        return 0;
    }
    if (!local_agents_given)
        local_agents = prev_n;
    /* 0700 when new: only its owner has business in it (PostgreSQL's
     * user, when we are root, gets o+x: stack_pg.c). */
    if ((rc = stack_mkdirs(home, 0700))) {
        cli_err("cannot create %s: %s", home, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    local_agent_id(agent_id, sizeof(agent_id));
    char keydir[4200], signing_key[4300], trust_key[4300];
    snprintf(keydir, sizeof(keydir), "%s/keys", home);
    snprintf(signing_key, sizeof(signing_key), "%s/broker.key", keydir);
    snprintf(trust_key, sizeof(trust_key), "%s/broker.pub", keydir);
    if (access(signing_key, R_OK) != 0) {
        if ((rc = stack_mkdirs(keydir, 0700)) ||
            (rc = evt_keygen(signing_key, trust_key))) {
            cli_err("cannot make the signing key in %s: %s", keydir,
                    ks_strerror(rc));
            return CLI_EXIT_KSCORE;
        }
    }

    /* A partial stack is stopped first and started again; the identities
     * are kept (stack_ident_ensure), so a restart cuts nobody off. */
    stack_stop(home, "agent", 20000);
    stack_stop(home, "broker", 20000);
    stack_nats_stop(home);
    cli_listen_resolve(&ul);
    char operator_name[EVT_IDENTITY_MAX + 1];
    char agent_user[EVT_IDENTITY_MAX + 8];
    char broker_seed[4200], agent_seed[4200], operator_seed[4200];
    struct stack_identity sid;
    operator_user(operator_name, sizeof(operator_name));
    snprintf(agent_user, sizeof(agent_user), "agent-%s", agent_id);
    if ((rc = stack_ident_ensure(home, STACK_BROKER, "broker", &sid)) ||
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
        return CLI_EXIT_KSCORE;
    }
    if ((rc = cli_listen_tls(home, &ul, agent_user, operator_name)))
        return rc;
    up_tls.ca = ul.tls ? ul.ca : NULL;
    up_tls.cert = ul.mtls ? ul.ocert : NULL;
    up_tls.key = ul.mtls ? ul.okey : NULL;
    fprintf(stderr, "kscore: starting nats-server ...\n");
    rc = stack_nats_start_at(home, ul.host, 0, ul.tls_conf,
                             STACK_NATS_AUTH_INCLUDE, &url, &pid);
    if (rc) {
        cli_err("cannot start nats-server: %s (see %s/nats.log)",
                ks_strerror(rc), home);
        return CLI_EXIT_KSCORE;
    }
    fprintf(stderr, "kscore: starting PostgreSQL ...\n");
    rc = stack_pg_start(home, 0, &db, &pid);
    if (rc) {
        cli_err("cannot start PostgreSQL: %s (see %s/pg.log)",
                ks_strerror(rc), home);
        free(url);
        return CLI_EXIT_KSCORE;
    }
    fprintf(stderr, "kscore: starting the broker ...\n");
    snprintf(nlocal, sizeof(nlocal), "%u", local_agents);
    snprintf(local_state, sizeof(local_state), "%s/local-agents", home);
    snprintf(agent_state, sizeof(agent_state), "%s/agent", home);
    {
        /* Each daemon gets its own seed file through the environment; no
         * other credential of the caller's may reach it. */
        clear_nats_env();
        setenv("KSCORE_NATS_NKEY", broker_seed, 1);
        char *bargv[] = {exe,         "broker",         "--nats",
                         url,         "--db",           db,
                         "--local-agents", nlocal,      "--state-dir",
                         local_state, "--signing-key",  signing_key,
                         NULL,        NULL,             NULL,
                         NULL,        NULL,             NULL,
                         NULL};
        cli_listen_args(bargv, &ul, 0);
        rc = stack_daemon(home, "broker", bargv, &pid);
        if (rc == 0)
            rc = wait_broker(url, operator_seed, 30000);
        if (rc) {
            cli_err("the broker did not start: %s (see %s/broker.log)",
                    ks_strerror(rc), home);
            goto fail;
        }
    }
    fprintf(stderr, "kscore: starting agent %s ...\n", agent_id);
    {
        setenv("KSCORE_NATS_NKEY", agent_seed, 1);
        char *aargv[] = {exe,         "agent",       "--id",      agent_id,
                         "--nats",    url,           "--state-dir",
                         agent_state, "--trust-key", trust_key,   NULL,
                         NULL,        NULL,          NULL,        NULL,
                         NULL,        NULL};
        cli_listen_args(aargv, &ul, 1);
        rc = stack_daemon(home, "agent", aargv, &pid);
        unsetenv("KSCORE_NATS_NKEY");
        if (rc == 0)
            rc = wait_agent(url, agent_id, broker_seed, 30000);
        if (rc) {
            cli_err("the agent did not start: %s (see %s/agent.log)",
                    ks_strerror(rc), home);
            goto fail;
        }
    }
    if ((rc = write_env(home, url, db, agent_id, local_agents,
                        operator_seed)) ||
        (rc = cli_listen_env(home, &ul))) {
        cli_err("cannot write %s/env: %s", home, ks_strerror(rc));
        goto fail;
    }
    fprintf(stderr, "kscore: the local stack is up in %s\n", home);
    free(url);
    free(db);
    free(ul.tls_conf);
    print_status(false);
    return 0;
fail:
    free(url);
    free(db);
    free(ul.tls_conf);
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
    /* Agent first, so its running commands end and report while the
     * broker and the servers are still there. */
    if (stack_stop(home, "agent", 20000) != 0)
        rc = CLI_EXIT_KSCORE;
    if (stack_stop(home, "broker", 20000) != 0)
        rc = CLI_EXIT_KSCORE;
    if (stack_nats_stop(home) != 0)
        rc = CLI_EXIT_KSCORE;
    if (stack_pg_stop(home) != 0)
        rc = CLI_EXIT_KSCORE;
    snprintf(path, sizeof(path), "%s/env", home);
    unlink(path);
    if (rc)
        cli_err("some part of the stack did not stop (kscore status)");
    else
        fprintf(stderr, "kscore: the local stack in %s is stopped\n", home);
    return rc;
}

/* ---- services ------------------------------------------------------------ */

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
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct broker_opts o = {0};
    struct cli_conn cc = {0};
    char *errmsg = NULL;
    int opt, rc;

    o.db_conninfo = getenv("KSCORE_DB");
    o.signing_key = getenv("KSCORE_SIGNING_KEY");
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end;
        switch (opt) {
        case 'd':
            o.db_conninfo = optarg;
            break;
        case 'l':
            o.local_agents = (unsigned)strtoul(optarg, &end, 10);
            if (*end || !optarg[0] || o.local_agents > 10000) {
                cli_err("bad --local-agents '%s' (0..10000)", optarg);
                return CLI_EXIT_USAGE;
            }
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
        case 'h':
            printf("usage: kscore broker --nats URL --db CONNINFO "
                   "--signing-key FILE [--policy FILE] [--local-agents N] "
                   "[--state-dir DIR]\n"
                   "The signing key (kscore keygen) signs every command; "
                   "agents trust its public half.\n");
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            return CLI_EXIT_USAGE;
        }
    }
    cli_conn_env(&cc);
    o.nats_url = cc.nats_url;
    o.nats = cc.opts;
    if (!o.nats_url || !o.db_conninfo) {
        cli_err("the broker needs --nats URL and --db CONNINFO (or "
                "KSCORE_NATS_URL and KSCORE_DB)");
        return CLI_EXIT_USAGE;
    }
    rc = broker_run(&o, &errmsg);
    if (rc) {
        cli_err("broker: %s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        return CLI_EXIT_KSCORE;
    }
    return 0;
}

int
cmd_agent(int argc, char **argv)
{
    static const struct option lo[] = {
        {"id", required_argument, 0, 'i'},
        {"label", required_argument, 0, 'l'},
        CLI_CONN_LONGOPTS,
        {"state-dir", required_argument, 0, 's'},
        {"max-concurrent", required_argument, 0, 'm'},
        {"ack-wait", required_argument, 0, 'w'},
        {"trust-key", required_argument, 0, 'k'},
        {"bundle", required_argument, 0, 'b'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct agent_opts o = {0};
    struct cli_bundle bundle = {0};
    const char *bundle_file = NULL;
    struct cli_conn cc = {0};
    const char **ids = calloc((size_t)argc, sizeof(*ids));
    const char **keys = calloc((size_t)argc + 1, sizeof(*keys));
    struct agent_label *labels = calloc((size_t)argc, sizeof(*labels));
    struct agent *a = NULL;
    char *errmsg = NULL;
    sigset_t set;
    int opt, sig, rc = CLI_EXIT_USAGE;

    /* Subcommand words select the fleet mode (cli/cmd_enroll.c). */
    if (argc > 1 && (strcmp(argv[1], "enroll") == 0 ||
                     strcmp(argv[1], "revoke") == 0 ||
                     strcmp(argv[1], "list") == 0)) {
        free(ids);
        free(keys);
        free(labels);
        return cmd_agent_admin(argc - 1, argv + 1);
    }
    if (!ids || !labels || !keys)
        return CLI_EXIT_KSCORE;
    if (getenv("KSCORE_TRUST_KEY") && getenv("KSCORE_TRUST_KEY")[0])
        keys[o.n_trust_keys++] = getenv("KSCORE_TRUST_KEY");
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        char *end, *eq;
        switch (opt) {
        case 'i':
            ids[o.n_ids++] = optarg;
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
            o.max_concurrent = (unsigned)strtoul(optarg, &end, 10);
            if (*end || !o.max_concurrent) {
                cli_err("bad --max-concurrent '%s' (>= 1)", optarg);
                goto out;
            }
            break;
        case 'k':
            keys[o.n_trust_keys++] = optarg;
            break;
        case 'b':
            bundle_file = optarg;
            break;
        case 'w':
            if (cli_parse_duration(optarg, &o.ack_wait_ms) ||
                o.ack_wait_ms < 1000) {
                cli_err("bad --ack-wait '%s' (a duration >= 1s)", optarg);
                goto out;
            }
            break;
        case 'h':
            printf("usage: kscore agent --id ID [--id ID]... --trust-key FILE "
                   "[--label K=V]... [--nats URL] [--state-dir DIR] "
                   "[--max-concurrent N] [--ack-wait D]\n"
                   "       kscore agent --bundle FILE [--state-dir DIR] "
                   "[--label K=V]... [--max-concurrent N]\n"
                   "       kscore agent enroll|revoke|list ... (kscore agent "
                   "enroll --help)\n"
                   "A bundle (kscore agent enroll) gives the id, labels, "
                   "NATS urls, credential, TLS files and trust key; flags "
                   "override it.\n"
                   "Runs only commands signed by a trusted key "
                   "(--trust-key, repeatable, or KSCORE_TRUST_KEY).\n");
            rc = 0;
            goto out;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            goto out;
        }
    }
    if (bundle_file) {
        char why[512] = "";
        int brc = cli_bundle_load(bundle_file, o.state_dir, &bundle, why,
                                  sizeof(why));
        if (brc) {
            cli_err("bad bundle: %s", why[0] ? why : ks_strerror(brc));
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        /* The bundle's identity may serve its own id only. */
        for (size_t i = 0; i < o.n_ids; i++)
            if (strcmp(ids[i], bundle.id) != 0) {
                cli_err("--id %s: the bundle is agent %s's (its NATS user "
                        "may serve no other id)",
                        ids[i], bundle.id);
                goto out;
            }
        if (o.n_ids == 0)
            ids[o.n_ids++] = bundle.id;
        struct agent_label *nl =
            realloc(labels, ((size_t)argc + bundle.n_labels) * sizeof(*nl));
        if (!nl) {
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        labels = nl;
        size_t given = o.n_labels;
        for (size_t i = 0; i < bundle.n_labels; i++) {
            char *kv = bundle.labels[i], *eq = strchr(kv, '=');
            bool dup = false;
            *eq = '\0';
            for (size_t j = 0; j < given; j++)
                dup = dup || strcmp(labels[j].key, kv) == 0;
            if (!dup) {
                labels[o.n_labels].key = kv;
                labels[o.n_labels++].value = eq + 1;
            }
        }
        keys[o.n_trust_keys++] = bundle.trust_key;
        /* Flags first, then the bundle: the environment's KSCORE_NATS_*
         * would otherwise mix another credential into the bundle's. */
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
    if (o.n_ids == 0) {
        cli_err("the agent needs --id ID (or --bundle FILE)");
        goto out;
    }
    if (!bundle_file)
        cli_conn_env(&cc);
    o.nats_url = cc.nats_url;
    o.nats = cc.opts;
    if (!o.nats_url) {
        cli_err("the agent needs --nats URL (or KSCORE_NATS_URL)");
        goto out;
    }
    o.ids = ids;
    o.labels = labels;
    o.trust_keys = keys;
    /* Before any thread exists, so only sigwait() sees these. */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    rc = agent_start(&o, &a, &errmsg);
    if (rc) {
        cli_err("agent: %s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    fprintf(stderr, "kscore agent: serving %zu id(s) on %s\n", o.n_ids,
            o.nats_url);
    sigwait(&set, &sig);
    fprintf(stderr, "kscore agent: %s, stopping\n", strsignal(sig));
    agent_stop(a);
    rc = 0;
out:
    cli_bundle_release(&bundle);
    free(ids);
    free(labels);
    free(keys);
    return rc;
}

int
cmd_keygen(int argc, char **argv)
{
    static const struct option lo[] = {{"out", required_argument, 0, 'o'},
                                       {"name", required_argument, 0, 'n'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    const char *dir = ".", *name = "kscore";
    char priv[4200], pub[4200];
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
        case 'h':
            printf("usage: kscore keygen [--out DIR] [--name NAME]\n"
                   "Writes an Ed25519 key pair: DIR/NAME.key (private, "
                   "0600: give it to the broker, --signing-key) and "
                   "DIR/NAME.pub (give it to agents, --trust-key).\n");
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
    printf("%s\n%s\n", priv, pub);
    return 0;
}
