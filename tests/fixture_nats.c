#include "fixture.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "broker.h"
#include "kproto.h"
#include "stack.h"

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
rm_tree(const char *dir)
{
    const char *keep = getenv("KSCORE_KEEP_TMP");
    if (dir[0] && !(keep && strcmp(keep, "1") == 0))
        nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int
make_tmp(char *dir, size_t len, const char *what)
{
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp)
        tmp = "/tmp";
    snprintf(dir, len, "%s/kscore-%s-XXXXXX", tmp, what);
    return mkdtemp(dir) ? 0 : -errno;
}

static int
nats_start(struct fixture_nats *out, const char *conf_extra,
           const char *ident_home)
{
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = make_tmp(out->dir, sizeof(out->dir), "nats")))
        return rc;
    if (ident_home) {
        if ((rc = stack_nats_auth_write(out->dir, ident_home)))
            return rc;
        conf_extra = STACK_NATS_AUTH_INCLUDE;
    }
    rc = stack_nats_start(out->dir, 0, conf_extra, &out->url, &out->pid);
    if (rc)
        fprintf(stderr, "fixture_nats_start: %s, see %s/nats.log\n",
                ks_strerror(rc), out->dir);
    return rc;
}

int
fixture_nats_start(struct fixture_nats *out, const char *conf_extra)
{
    return nats_start(out, conf_extra, NULL);
}

int
fixture_nats_start_auth(struct fixture_nats *out, const char *ident_home)
{
    return nats_start(out, NULL, ident_home);
}

void
fixture_nats_stop(struct fixture_nats *f)
{
    if (!f || !f->dir[0])
        return;
    stack_nats_stop(f->dir);
    rm_tree(f->dir);
    free(f->url);
    f->url = NULL;
    f->dir[0] = '\0';
}

static const char *
kscore_bin(void)
{
    const char *b = getenv("KSCORE_BIN");
    return b && b[0] ? b : KSCORE_BIN_DEFAULT;
}

static void
admin_opts(const struct fixture_stack *st, struct evt_connect_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->name = "fixture";
    if (st->secure)
        o->nkey_file = st->broker_seed;
}

static int
wait_broker(const struct fixture_stack *st, int timeout_ms)
{
    struct evt_connect_opts o;
    admin_opts(st, &o);
    return broker_wait_ready(st->nats.url, &o, timeout_ms);
}

static int
wait_agent(const struct fixture_stack *st, const char *id, int timeout_ms)
{
    struct evt_connect_opts o;
    admin_opts(st, &o);
    /* A heartbeat of this start, not one left by an earlier agent. */
    return broker_wait_agent(st->nats.url, &o, id, ks_now_us() - 1000000,
                             timeout_ms);
}

/* Starts `kscore broker` as the daemon name of the stack (its pid file
 * and log <dir>/<name>.{pid,log}, its local agents' state in state_dir),
 * as the stack's broker is. 0 or a negative code; waits for nothing. */
static int
broker_daemon(struct fixture_stack *s, const char *name,
              unsigned local_agents, const char *state)
{
    char n[16];
    pid_t pid;
    int rc;
    snprintf(n, sizeof(n), "%u", local_agents);
    char *argv[] = {(char *)kscore_bin(), "broker",     "--nats",
                    s->nats.url,          "--db",       s->pg.conninfo,
                    "--local-agents",     n,            "--state-dir",
                    (char *)state,        "--signing-key", s->signing_key,
                    NULL,                 NULL,          NULL};
    if (s->policy[0]) {
        size_t n = 0;
        while (argv[n])
            n++;
        argv[n] = "--policy";
        argv[n + 1] = s->policy;
        argv[n + 2] = NULL;
    }
    if (s->secure)
        setenv("KSCORE_NATS_NKEY", s->broker_seed, 1);
    /* The fixtures' agents are never enrolled and most tests select them
     * by the labels they declare: the broker's default (signed labels
     * only) is off here unless the test set KSCORE_REQUIRE_SIGNED_LABELS
     * itself (test_security's signed-labels case); set to "" it is
     * unset for the broker, which then runs with its own default. */
    const char *rsl = getenv("KSCORE_REQUIRE_SIGNED_LABELS");
    char *rsl_copy = rsl ? strdup(rsl) : NULL;
    if (!rsl)
        setenv("KSCORE_REQUIRE_SIGNED_LABELS", "false", 1);
    else if (!rsl[0])
        unsetenv("KSCORE_REQUIRE_SIGNED_LABELS");
    rc = stack_daemon(s->dir, name, argv, &pid);
    if (rsl_copy)
        setenv("KSCORE_REQUIRE_SIGNED_LABELS", rsl_copy, 1);
    else
        unsetenv("KSCORE_REQUIRE_SIGNED_LABELS");
    free(rsl_copy);
    unsetenv("KSCORE_NATS_NKEY");
    return rc;
}

int
fixture_stack_broker_start(struct fixture_stack *s, unsigned local_agents)
{
    char state[PATH_MAX + 16];
    snprintf(state, sizeof(state), "%s/local-agents", s->dir);
    int rc = broker_daemon(s, "broker", local_agents, state);
    if (rc == 0)
        rc = wait_broker(s, 30000);
    if (rc)
        fprintf(stderr, "fixture: broker did not start (%s), see %s\n",
                ks_strerror(rc), s->dir);
    /* The broker answers before its local agents have heartbeated: a test
     * that selects them must find all of them registered. */
    for (unsigned i = 0; rc == 0 && local_agents > 1 && i < local_agents; i++) {
        char host[64], id[96];
        gethostname(host, sizeof(host));
        host[sizeof(host) - 1] = '\0';
        host[strcspn(host, ".")] = '\0';
        snprintf(id, sizeof(id), "%s-%u", host, i);
        if ((rc = wait_agent(s, id, 30000)))
            fprintf(stderr, "fixture: local agent %s did not heartbeat (%s)\n",
                    id, ks_strerror(rc));
    }
    return rc;
}

int
fixture_stack_broker_spawn(struct fixture_stack *s, const char *name)
{
    char state[PATH_MAX + 96], log[PATH_MAX + 96];
    struct stat sb;
    snprintf(state, sizeof(state), "%s/%s-local-agents", s->dir, name);
    snprintf(log, sizeof(log), "%s/%s.log", s->dir, name);
    /* The log is appended to at each start: only this start's lines. */
    off_t from = stat(log, &sb) == 0 ? sb.st_size : 0;
    int rc = broker_daemon(s, name, 0, state);
    for (int i = 0; rc == 0 && i < 600; i++) {
        char buf[8192] = "";
        FILE *f = fopen(log, "r");
        if (f && fseeko(f, from, SEEK_SET) == 0) {
            size_t n = fread(buf, 1, sizeof(buf) - 1, f);
            buf[n] = '\0';
        }
        if (f)
            fclose(f);
        if (strstr(buf, "msg=serving "))
            return 0;
        if (!stack_pidfile_alive(s->dir, name, NULL))
            break;
        nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    }
    fprintf(stderr, "fixture: broker %s did not start (%s), see %s\n", name,
            ks_strerror(rc ? rc : KS_ETIMEDOUT), log);
    return rc ? rc : KS_ETIMEDOUT;
}

void
fixture_stack_broker_kill(struct fixture_stack *s, int sig)
{
    pid_t pid;
    if (sig == SIGTERM) {
        stack_stop(s->dir, "broker", 20000);
        return;
    }
    if (stack_pidfile_alive(s->dir, "broker", &pid)) {
        kill(pid, sig);
        /* A stop or continue is no end: only a kill is waited for (a
         * waitpid after SIGSTOP of a child waited for good). */
        if (sig != SIGSTOP && sig != SIGCONT)
            waitpid(pid, NULL, 0);
    }
}

int
fixture_stack_agent_start(struct fixture_stack *s, const char *extra_env)
{
    char state[PATH_MAX + 96];
    pid_t pid;
    int rc;
    snprintf(state, sizeof(state), "%s/agent-%s", s->dir, s->agent_id);
    char *argv[] = {(char *)kscore_bin(), "agent",    "--id", s->agent_id,
                    "--nats",             s->nats.url, "--state-dir", state,
                    "--trust-key",        s->trust_key, NULL, NULL, NULL};
    if (s->agent_labels[0]) {
        argv[10] = "--label";
        argv[11] = s->agent_labels;
    }
    if (s->secure)
        setenv("KSCORE_NATS_NKEY", s->agent_seed, 1);
    if (extra_env) {
        /* "K=V K2=V2": set for the child only (stack_daemon inherits). */
        char *copy = strdup(extra_env), *save = NULL;
        pid = fork();
        if (pid == 0) {
            for (char *t = strtok_r(copy, " ", &save); t;
                 t = strtok_r(NULL, " ", &save))
                putenv(t);
            pid_t child;
            _exit(stack_daemon(s->dir, "agent", argv, &child) ? 1 : 0);
        }
        free(copy);
        int st = 0;
        waitpid(pid, &st, 0);
        rc = WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : KS_EINTERNAL;
    } else {
        rc = stack_daemon(s->dir, "agent", argv, &pid);
    }
    unsetenv("KSCORE_NATS_NKEY");
    if (rc == 0)
        rc = wait_agent(s, s->agent_id, 30000);
    if (rc)
        fprintf(stderr, "fixture: agent did not start (%s), see %s\n",
                ks_strerror(rc), s->dir);
    return rc;
}

int
fixture_agent_spawn(struct fixture_stack *s, const char *name, const char *id,
                    const char *const extra[])
{
    return fixture_agent_spawn_via(s, name, id, extra, NULL);
}

int
fixture_agent_spawn_via(struct fixture_stack *s, const char *name,
                        const char *id, const char *const extra[],
                        const char *const launcher[])
{
    char state[PATH_MAX + 96];
    const char *argv[80];
    size_t n = 0;
    pid_t pid;
    int rc;

    snprintf(state, sizeof(state), "%s/state-%s", s->dir, name);
    for (size_t i = 0; launcher && launcher[i] && n < 8; i++)
        argv[n++] = launcher[i];
    argv[n++] = kscore_bin();
    argv[n++] = "agent";
    argv[n++] = "--id";
    argv[n++] = id;
    argv[n++] = "--nats";
    argv[n++] = s->nats.url;
    argv[n++] = "--state-dir";
    argv[n++] = state;
    argv[n++] = "--trust-key";
    argv[n++] = s->trust_key;
    for (size_t i = 0; extra && extra[i] && n < 79; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    rc = stack_daemon(s->dir, name, (char *const *)argv, &pid);
    if (rc == 0)
        rc = wait_agent(s, id, 30000);
    return rc;
}

int
fixture_stack_nats_restart(struct fixture_stack *s)
{
    const char *colon = strrchr(s->nats.url, ':');
    int port = colon ? atoi(colon + 1) : 0;
    char *url = NULL;
    pid_t pid;
    int rc;

    stack_nats_stop(s->nats.dir);
    rc = stack_nats_start(s->nats.dir, port,
                          s->secure ? STACK_NATS_AUTH_INCLUDE : NULL, &url,
                          &pid);
    if (rc == 0) {
        free(s->nats.url);
        s->nats.url = url;
        s->nats.pid = pid;
    }
    return rc;
}

void
fixture_stack_agent_kill(struct fixture_stack *s, int sig)
{
    pid_t pid;
    if (sig == SIGTERM) {
        stack_stop(s->dir, "agent", 20000);
        return;
    }
    if (stack_pidfile_alive(s->dir, "agent", &pid)) {
        kill(pid, sig);
        waitpid(pid, NULL, 0);
        for (int i = 0; i < 100 && kill(pid, 0) == 0; i++)
            nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
}

static int
stack_start(struct fixture_stack *s, const char *agent_id,
            unsigned local_agents);

int
fixture_stack_start(struct fixture_stack *s, const char *agent_id,
                    unsigned local_agents)
{
    memset(s, 0, sizeof(*s));
    return stack_start(s, agent_id, local_agents);
}

/* A secure stack with a policy file, or its text (one of the two, or
 * neither). */
static int
secure_start(struct fixture_stack *s, const char *agent_id,
             const char *label, const char *operator_name,
             const char *policy_file, const char *policy_json)
{
    memset(s, 0, sizeof(*s));
    s->secure = true;
    s->policy_json = policy_json;
    snprintf(s->operator_name, sizeof(s->operator_name), "%s",
             operator_name);
    if (policy_file)
        snprintf(s->policy, sizeof(s->policy), "%s", policy_file);
    if (label)
        snprintf(s->agent_labels, sizeof(s->agent_labels), "%s", label);
    snprintf(s->agent_id, sizeof(s->agent_id), "%s", agent_id);
    return stack_start(s, agent_id, 1);
}

int
fixture_stack_start_secure(struct fixture_stack *s, const char *agent_id,
                           const char *label, const char *operator_name,
                           const char *policy_file)
{
    return secure_start(s, agent_id, label, operator_name, policy_file,
                        NULL);
}

int
fixture_stack_start_policy(struct fixture_stack *s, const char *agent_id,
                           const char *label, const char *operator_name,
                           const char *policy_json)
{
    return secure_start(s, agent_id, label, operator_name, NULL,
                        policy_json);
}

/* The secure stack's identities, as `kscore up` makes them: broker,
 * the operator and agent-<id>, in the registry under s->dir. */
static int
make_identities(struct fixture_stack *s)
{
    struct stack_identity id;
    char agent_user[96];
    int rc;

    snprintf(agent_user, sizeof(agent_user), "agent-%s", s->agent_id);
    if ((rc = stack_ident_add(s->dir, STACK_BROKER, "broker", &id)) ||
        (rc = stack_ident_add(s->dir, STACK_OPERATOR, s->operator_name,
                              &id)) ||
        (rc = stack_ident_add(s->dir, STACK_AGENT, agent_user, &id)))
        return rc;
    stack_ident_seed_path(s->dir, STACK_BROKER, "broker", s->broker_seed,
                          sizeof(s->broker_seed));
    stack_ident_seed_path(s->dir, STACK_OPERATOR, s->operator_name,
                          s->operator_seed, sizeof(s->operator_seed));
    stack_ident_seed_path(s->dir, STACK_AGENT, agent_user, s->agent_seed,
                          sizeof(s->agent_seed));
    return 0;
}

int
fixture_stack_nats_reauth(struct fixture_stack *s)
{
    int rc = stack_nats_auth_write(s->nats.dir, s->dir);
    return rc ? rc : stack_nats_reload(s->nats.dir, 10000);
}

static int
stack_start(struct fixture_stack *s, const char *agent_id,
            unsigned local_agents)
{
    int rc;
    if ((rc = make_tmp(s->dir, sizeof(s->dir), "stack")))
        return rc;
    if (s->policy_json) {
        FILE *f;
        snprintf(s->policy, sizeof(s->policy), "%s/policy.json", s->dir);
        if (!(f = fopen(s->policy, "w")) || fputs(s->policy_json, f) < 0 ||
            fclose(f) != 0)
            return -EIO;
    }
    snprintf(s->signing_key, sizeof(s->signing_key), "%s/broker.key",
             s->dir);
    snprintf(s->trust_key, sizeof(s->trust_key), "%s/broker.pub", s->dir);
    if ((rc = evt_keygen(s->signing_key, s->trust_key)))
        return rc;
    if (s->secure && (rc = make_identities(s)))
        return rc;
    if ((rc = s->secure ? fixture_nats_start_auth(&s->nats, s->dir)
                        : fixture_nats_start(&s->nats, NULL)))
        return rc;
    if ((rc = fixture_pg_start(&s->pg)))
        return rc;
    if ((rc = fixture_stack_broker_start(s, local_agents)))
        return rc;
    if (agent_id) {
        snprintf(s->agent_id, sizeof(s->agent_id), "%s", agent_id);
        if ((rc = fixture_stack_agent_start(s, NULL)))
            return rc;
    }
    return 0;
}

void
fixture_stack_stop(struct fixture_stack *s)
{
    DIR *d;
    struct dirent *de;

    if (!s || !s->dir[0])
        return;
    /* Every daemon a test started here, also those of a test that failed
     * before it could stop them (agent-*.pid, and brokers the test spawned
     * besides the stack's: broker*.pid): agents first. A stopped one
     * (SIGSTOP) is continued first, to hear the TERM. */
    for (int pass = 0; pass < 2; pass++) {
        const char *kind = pass == 0 ? "agent" : "broker";
        d = opendir(s->dir);
        while (d && (de = readdir(d))) {
            size_t n = strlen(de->d_name);
            if (n > 4 && strcmp(de->d_name + n - 4, ".pid") == 0 &&
                strncmp(de->d_name, kind, strlen(kind)) == 0) {
                char name[256];
                snprintf(name, sizeof(name), "%.*s", (int)(n - 4),
                         de->d_name);
                fixture_stack_signal(s, name, SIGCONT);
                stack_stop(s->dir, name, 20000);
            }
        }
        if (d)
            closedir(d);
    }
    fixture_nats_stop(&s->nats);
    fixture_pg_stop(&s->pg);
    rm_tree(s->dir);
    s->dir[0] = '\0';
}

static int
append(char **buf, size_t *len, size_t *cap, const char *p, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*len + n + 1) * 2;
        char *b = realloc(*buf, nc);
        if (!b)
            return -ENOMEM;
        *buf = b;
        *cap = nc;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

static int
run_kscore(const struct fixture_stack *s, const char *home,
           const char *stdin_path, const char *const args[],
           struct fixture_out *out);

int
fixture_kscore(const struct fixture_stack *s, const char *const args[],
               struct fixture_out *out)
{
    return run_kscore(s, NULL, NULL, args, out);
}

int
fixture_kscore_stdin(const struct fixture_stack *s, const char *stdin_path,
                     const char *const args[], struct fixture_out *out)
{
    return run_kscore(s, NULL, stdin_path, args, out);
}

int
fixture_kscore_as(struct fixture_stack *s, const char *name,
                  const char *const args[], struct fixture_out *out)
{
    char seed[PATH_MAX + 64], saved[sizeof(s->operator_seed)];
    struct stack_identity id;
    int rc;

    stack_ident_seed_path(s->dir, STACK_OPERATOR, name, seed, sizeof(seed));
    if (access(seed, R_OK) != 0 &&
        ((rc = stack_ident_add(s->dir, STACK_OPERATOR, name, &id)) ||
         (rc = fixture_stack_nats_reauth(s))))
        return rc;
    snprintf(saved, sizeof(saved), "%s", s->operator_seed);
    snprintf(s->operator_seed, sizeof(s->operator_seed), "%s", seed);
    rc = run_kscore(s, NULL, NULL, args, out);
    snprintf(s->operator_seed, sizeof(s->operator_seed), "%s", saved);
    return rc;
}

int
fixture_kscore_home(const char *home, const char *const args[],
                    struct fixture_out *out)
{
    return run_kscore(NULL, home, NULL, args, out);
}

/* In a forked child: the environment of a kscore run against s (or the
 * local stack of home), then execv of the binary with args. */
static void __attribute__((noreturn))
exec_kscore(const struct fixture_stack *s, const char *home,
            const char *const args[])
{
    size_t n = 0;
    while (args[n])
        n++;
    const char **argv = calloc(n + 2, sizeof(*argv));
    if (!argv)
        _exit(126);
    argv[0] = kscore_bin();
    for (size_t i = 0; i < n; i++)
        argv[i + 1] = args[i];
    if (s)
        setenv("KSCORE_NATS_URL", s->nats.url, 1);
    if (s && s->secure)
        setenv("KSCORE_NATS_NKEY", s->operator_seed, 1);
    /* never fall back to a developer's own local stack */
    setenv("KSCORE_HOME", home ? home : "/nonexistent-kscore-home", 1);
    if (home) {
        /* the stack of home alone decides */
        static const char *const vars[] = {
            "KSCORE_NATS_URL",   "KSCORE_NATS_NKEY",  "KSCORE_NATS_USER",
            "KSCORE_NATS_PASSWORD", "KSCORE_NATS_CREDS",
            "KSCORE_NATS_TOKEN", "KSCORE_AGENT",      "KSCORE_DB"};
        for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
            unsetenv(vars[i]);
    }
    execv(argv[0], (char *const *)argv);
    _exit(127);
}

/* Starts kscore with args against s (or the local stack of home), stdin
 * stdin_path (NULL: /dev/null), or on a terminal (fixture_kscore_spawn). */
static int
proc_start(const struct fixture_stack *s, const char *home,
           const char *stdin_path, const char *const args[], bool terminal,
           struct fixture_proc *p)
{
    int po[2] = {-1, -1}, pe[2] = {-1, -1};

    memset(p, 0, sizeof(*p));
    p->fd_out = p->fd_err = -1;
    p->status = -1;
    if (terminal) {
        /* A terminal of 120x40: stdin, stdout and stderr are its slave,
         * the process leads its session with it as the controlling
         * terminal, so a ^C written to the master is a SIGINT. */
        struct winsize ws = {.ws_row = 40, .ws_col = 120};
        int master = -1;
        p->pid = forkpty(&master, NULL, NULL, &ws);
        if (p->pid == -1)
            return -errno;
        if (p->pid == 0)
            exec_kscore(s, home, args);
        p->fd_out = master;
        return 0;
    }
    if (pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC))
        return -errno;
    p->pid = fork();
    if (p->pid == -1)
        return -errno;
    if (p->pid == 0) {
        int nul = open(stdin_path ? stdin_path : "/dev/null", O_RDONLY);
        if (nul == -1)
            _exit(126);
        dup2(nul, 0);
        dup2(po[1], 1);
        dup2(pe[1], 2);
        exec_kscore(s, home, args);
    }
    close(po[1]);
    close(pe[1]);
    p->fd_out = po[0];
    p->fd_err = pe[0];
    return 0;
}

int
fixture_kscore_spawn(const struct fixture_stack *s, const char *const args[],
                     bool terminal, struct fixture_proc *p)
{
    return proc_start(s, NULL, NULL, args, terminal, p);
}

/* Reads what is there (waiting up to wait_ms for something); 0, or -1
 * when every fd is closed. */
static int
proc_collect(struct fixture_proc *p, int wait_ms)
{
    struct pollfd fds[2] = {{p->fd_out, POLLIN, 0}, {p->fd_err, POLLIN, 0}};
    if (p->fd_out < 0 && p->fd_err < 0)
        return -1;
    if (poll(fds, 2, wait_ms) <= 0)
        return 0;
    for (int i = 0; i < 2; i++) {
        char buf[65536];
        if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        ssize_t r = read(fds[i].fd, buf, sizeof(buf));
        if (r == -1 && errno == EINTR)
            continue;
        if (r <= 0) {
            /* EOF, or EIO: a terminal whose last slave is closed */
            close(fds[i].fd);
            *(i == 0 ? &p->fd_out : &p->fd_err) = -1;
            continue;
        }
        if (i == 0)
            append(&p->out, &p->out_len, &p->out_cap, buf, (size_t)r);
        else
            append(&p->err, &p->err_len, &p->err_cap, buf, (size_t)r);
    }
    return 0;
}

int
fixture_proc_expect(struct fixture_proc *p, const char *needle,
                    int timeout_ms)
{
    int64_t until = ks_mono_us() + (int64_t)timeout_ms * 1000;
    for (;;) {
        if ((p->out && strstr(p->out, needle)) ||
            (p->err && strstr(p->err, needle)))
            return 0;
        int64_t left = (until - ks_mono_us()) / 1000;
        if (left <= 0 || proc_collect(p, left > 100 ? 100 : (int)left) < 0)
            return (p->out && strstr(p->out, needle)) ||
                           (p->err && strstr(p->err, needle))
                       ? 0
                       : KS_ETIMEDOUT;
    }
}

int
fixture_proc_write(struct fixture_proc *p, const char *bytes)
{
    size_t n = strlen(bytes);
    if (p->fd_out < 0 || p->fd_err >= 0)
        return -EINVAL; /* a terminal's only */
    return write(p->fd_out, bytes, n) == (ssize_t)n ? 0 : -errno;
}

int
fixture_proc_wait(struct fixture_proc *p, int sig, int timeout_ms)
{
    int64_t until = ks_mono_us() + (int64_t)timeout_ms * 1000;
    int st = 0;
    pid_t r = 0;

    if (p->status >= 0)
        return p->status;
    if (sig)
        kill(p->pid, sig);
    while ((r = waitpid(p->pid, &st, WNOHANG)) == 0) {
        if (ks_mono_us() >= until) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            r = p->pid;
            break;
        }
        if (proc_collect(p, 50) < 0)
            nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
    /* What it wrote before it exited (a pipe's EOF; a terminal's master
     * gives EIO once the slave is closed). */
    while (proc_collect(p, 100) == 0 && (p->fd_out >= 0 || p->fd_err >= 0))
        ;
    p->status = r == p->pid ? (WIFEXITED(st) ? WEXITSTATUS(st)
                                             : 128 + WTERMSIG(st))
                            : -1;
    return p->status;
}

/* Runs kscore to its end: what fixture_kscore and its variants return. */
static int
run_kscore(const struct fixture_stack *s, const char *home,
           const char *stdin_path, const char *const args[],
           struct fixture_out *out)
{
    struct fixture_proc p;
    int64_t t0 = ks_mono_us();
    int rc = proc_start(s, home, stdin_path, args, false, &p);

    memset(out, 0, sizeof(*out));
    if (rc)
        return rc;
    out->status = fixture_proc_wait(&p, 0, INT_MAX);
    out->seconds = (double)(ks_mono_us() - t0) / 1e6;
    out->out = p.out ? p.out : strdup("");
    out->err = p.err ? p.err : strdup("");
    out->out_len = p.out_len;
    out->err_len = p.err_len;
    p.out = p.err = NULL;
    fixture_proc_release(&p);
    return 0;
}

const char *
fixture_last_line(const char *out)
{
    const char *last = out;
    for (const char *p = out; *p; p++)
        if (*p == '\n' && p[1])
            last = p + 1;
    return last;
}

void
fixture_proc_release(struct fixture_proc *p)
{
    if (!p || !p->pid)
        return;
    if (p->status < 0)
        fixture_proc_wait(p, SIGKILL, 5000);
    if (p->fd_out >= 0)
        close(p->fd_out);
    if (p->fd_err >= 0)
        close(p->fd_err);
    free(p->out);
    free(p->err);
    memset(p, 0, sizeof(*p));
}

int
fixture_bundle_strip_labels(const char *path, const char *out_path,
                            const char *from, const char *to)
{
    FILE *in = fopen(path, "re"), *out = fopen(out_path, "we");
    char l[16384], was[128], now[128];
    int rc = 0;

    snprintf(was, sizeof(was), "label = %s\n", from);
    snprintf(now, sizeof(now), "label = %s\n", to);
    if (!in || !out)
        rc = -errno;
    while (rc == 0 && fgets(l, sizeof(l), in))
        if (strncmp(l, "labels_signature", 16) != 0 &&
            strncmp(l, "labels_key_id", 13) != 0 &&
            strncmp(l, "enrolled_at_us", 14) != 0)
            fputs(strcmp(l, was) == 0 ? now : l, out);
    if (in)
        fclose(in);
    if (out && fclose(out) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && chmod(out_path, 0600) == -1)
        rc = -errno;
    return rc;
}

void
fixture_out_release(struct fixture_out *o)
{
    if (!o)
        return;
    free(o->out);
    free(o->err);
    o->out = o->err = NULL;
}

/* Waits until pid is gone (reaping it when it is our child). */
static void
wait_gone(pid_t pid)
{
    for (int i = 0; i < 500; i++) {
        waitpid(pid, NULL, WNOHANG);
        if (kill(pid, 0) == -1)
            return;
        /* a zombie that is not our child: gone for every purpose */
        char path[64], buf[256];
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        FILE *f = fopen(path, "r");
        if (f) {
            size_t n = fread(buf, 1, sizeof(buf) - 1, f);
            fclose(f);
            buf[n] = '\0';
            char *rp = strrchr(buf, ')');
            if (rp && rp[1] == ' ' && rp[2] == 'Z')
                return;
        }
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
}

int
fixture_stack_signal_tree(struct fixture_stack *s, const char *name, int sig)
{
    pid_t tree[256];
    size_t n = 0, done = 0;

    if (!stack_pidfile_alive(s->dir, name, &tree[0]))
        return -ESRCH;
    n = 1;
    while (done < n) {
        pid_t parent = tree[done++];
        DIR *d = opendir("/proc");
        struct dirent *de;
        while (d && (de = readdir(d)) && n < 256) {
            char path[300], line[128];
            int ppid = -1;
            if (de->d_name[0] < '0' || de->d_name[0] > '9')
                continue;
            snprintf(path, sizeof(path), "/proc/%s/status", de->d_name);
            FILE *f = fopen(path, "re");
            while (f && fgets(line, sizeof(line), f))
                if (sscanf(line, "PPid: %d", &ppid) == 1)
                    break;
            if (f)
                fclose(f);
            if (ppid == parent)
                tree[n++] = (pid_t)atoi(de->d_name);
        }
        if (d)
            closedir(d);
    }
    for (size_t i = 0; i < n; i++)
        kill(tree[i], sig);
    return 0;
}

int
fixture_stack_signal(struct fixture_stack *s, const char *name, int sig)
{
    pid_t pid;
    if (!stack_pidfile_alive(s->dir, name, &pid))
        return -ESRCH;
    if (kill(pid, sig) == -1)
        return -errno;
    if (sig == SIGKILL)
        wait_gone(pid);
    return 0;
}

int
fixture_stack_nats_kill(struct fixture_stack *s, int sig)
{
    pid_t pid;
    if (sig == SIGTERM)
        return stack_nats_stop(s->nats.dir);
    if (!stack_pidfile_alive(s->nats.dir, "nats", &pid))
        return -ESRCH;
    if (kill(pid, sig) == -1)
        return -errno;
    if (sig == SIGKILL)
        wait_gone(pid);
    return 0;
}

int
fixture_stack_nats_start(struct fixture_stack *s)
{
    const char *colon = strrchr(s->nats.url, ':');
    int port = colon ? atoi(colon + 1) : 0;
    char *url = NULL;
    pid_t pid;
    int rc = stack_nats_start(s->nats.dir, port, NULL, &url, &pid);
    if (rc == 0) {
        free(s->nats.url);
        s->nats.url = url;
        s->nats.pid = pid;
    }
    return rc;
}

int
fixture_stack_wait_agent(const struct fixture_stack *s, const char *id,
                         int64_t since_us, int timeout_ms)
{
    struct evt_connect_opts o;
    admin_opts(s, &o);
    return broker_wait_agent(s->nats.url, &o, id, since_us, timeout_ms);
}

/* ---- clients for tests (tests/fixture.h "Clients") ---- */

int
fixture_registry_last(struct evt_conn *c, const char *key, natsMsg **out)
{
    char subj[64 + EVT_AGENT_ID_MAX];
    snprintf(subj, sizeof(subj), "$KV." EVT_KV_AGENTS ".%s", key);
    *out = NULL;
    return js_GetLastMsg(out, c->js, "KV_" EVT_KV_AGENTS, subj, NULL, NULL) ==
                   NATS_OK
               ? 0
               : -1;
}

struct evt_conn *
fixture_client(const struct fixture_stack *s)
{
    struct evt_connect_opts o = {.name = "test", .send_asap = true};
    struct evt_conn *c = NULL;
    ck_assert_int_eq(evt_connect(s->nats.url, &o, &c, NULL), 0);
    return c;
}

int
fixture_submit(struct evt_conn *c, const char *agent, const char *script,
               uint64_t timeout_ms, uint64_t deliver_within_ms,
               char id_out[37])
{
    return fixture_submit_key(c, agent, script, timeout_ms,
                              deliver_within_ms, NULL, id_out);
}

int
fixture_submit_key(struct evt_conn *c, const char *agent, const char *script,
                   uint64_t timeout_ms, uint64_t deliver_within_ms,
                   const char *key, char id_out[37])
{
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"sh", "-c", (char *)script};

    spec.argv = argv;
    spec.n_argv = 3;
    spec.timeout_ms = timeout_ms;
    return fixture_submit_spec(c, agent, &spec, deliver_within_ms, key,
                               id_out);
}

int
fixture_submit_spec(struct evt_conn *c, const char *agent,
                    Ks__CommandSpec *spec, uint64_t deliver_within_ms,
                    const char *key, char id_out[37])
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__ExecuteReply *rep = NULL;
    int rc;

    req.spec = spec;
    req.agent_id = (char *)agent;
    req.detach = 1;
    req.deliver_within_ms = deliver_within_ms;
    req.idempotency_key = (char *)key;
    rc = broker_execute(c, &req, 5000, &rep);
    if (rc == 0 && rep->error_code)
        rc = rep->error_code;
    if (rc == 0)
        snprintf(id_out, 37, "%s", rep->command_id);
    if (rep)
        ks__execute_reply__free_unpacked(rep, NULL);
    return rc;
}

uint8_t *
fixture_bytes(size_t n, uint32_t seed)
{
    uint8_t *b = malloc(n ? n : 1);
    uint32_t x = 2463534242u ^ seed;
    ck_assert_ptr_nonnull(b);
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        b[i] = (uint8_t)x;
    }
    return b;
}

int
fixture_upload(struct evt_conn *c, const char *identity, const void *data,
               size_t len, uint32_t parts_max, bool *complete_out, char *why,
               size_t why_len)
{
    Ks__UploadRequest req = KS__UPLOAD_REQUEST__INIT;
    uint8_t sum[KS_SHA256_BYTES];
    unsigned int md_len = 0;
    uint32_t parts = ks_blob_parts(len);
    bool all = parts_max >= parts;

    ck_assert_int_eq(EVP_Digest(data, len, sum, &md_len, EVP_sha256(), NULL),
                     1);
    req.sha256.data = sum;
    req.sha256.len = sizeof(sum);
    req.size = len;
    /* As kscore copy asks: first whether it is there (a commit without
     * data), then each part, the last one with the commit. */
    for (int step = -1; step < (int)(all ? parts : parts_max); step++) {
        ProtobufCMessage *pm = NULL;
        natsMsg *m = NULL;
        req.commit = step == -1 || (all && (uint32_t)step + 1 == parts);
        req.part = step < 0 ? 0 : (uint32_t)step;
        req.data.data = step < 0 ? NULL
                                 : (uint8_t *)data + (size_t)step *
                                                         KS_BLOB_PART_BYTES;
        req.data.len = step < 0 ? 0 : ks_blob_part_len(len, req.part);
        ck_assert_int_eq(evt_request_as(c, identity, EVT_API_UPLOAD, &req.base,
                                        30000, &m),
                         0);
        ck_assert_int_eq(evt_unpack(&ks__upload_reply__descriptor,
                                    natsMsg_GetData(m),
                                    (size_t)natsMsg_GetDataLength(m), &pm),
                         0);
        natsMsg_Destroy(m);
        Ks__UploadReply *rep = (Ks__UploadReply *)pm;
        int code = rep->error_code;
        if (code && why)
            snprintf(why, why_len, "%s", rep->error);
        if (complete_out)
            *complete_out = rep->complete;
        bool done = rep->complete;
        ks__upload_reply__free_unpacked(rep, NULL);
        if (code)
            return code;
        if (done)
            break; /* there already: nothing to send */
    }
    return 0;
}
