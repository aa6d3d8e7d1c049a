/*
 * exec_watchdog.c: a small process that kills a loop's jobs when the loop
 * can no longer look after them.
 *
 * Why: the jobs of an exec_loop are children of the agent. When the agent
 * dies (kill -9) they are reparented and run on; when it is stopped
 * (SIGSTOP), swapped out or hung, nothing enforces their timeouts, and the
 * broker will soon declare them Lost (EVT_AGENT_TTL_MS without a
 * heartbeat). "Lost" must be true: what the agent ran must be dead by then.
 *
 * How: the loop thread spawns the watchdog at its start and talks to it over
 * a SOCK_SEQPACKET socketpair (one record per send, MSG_NOSIGNAL so a dead
 * watchdog is an error, not a SIGPIPE):
 *
 *   child -> watchdog ADD_CHILD job_id pgid cgroup
 *                                             sent by the job's own child
 *                                             after its setpgid, before it
 *                                             runs anything of the command
 *                                             (exec__spawn_cgroup)
 *   loop -> watchdog  ADD job_id pgid cgroup  after the spawn, only when the
 *                                             child could not (posix_spawn)
 *                                             or did not say it did
 *                     DEL job_id              before the leader is reaped,
 *                                             so a pgid the watchdog kills is
 *                                             never a recycled one
 *                     PING                    every dead_ms / 3
 *   watchdog -> loop  FIRED job_id silence_ms before it kills that job
 *
 * Why the child registers itself: the loop thread is suspended in the clone
 * (CLONE_VFORK) until the child's execve, and a SIGSTOP or SIGKILL of the
 * agent that arrives meanwhile takes effect the moment the clone returns.
 * An ADD sent by the loop after the spawn then never came while the command
 * ran (test_agent saw `sleep 30` outlive its stopped agent), so the one
 * process the watchdog exists for was the one it did not know.
 *
 * An ADD of a job already registered replaces its entry, and a DEL removes
 * every entry of its job. Any record but ADD_CHILD is a sign of the loop's
 * life (a child's ADD says nothing of the loop). On EOF (every copy of the loop's end closed: the
 * agent died, or the loop was freed) or when the loop thread that spawned
 * it dies (PR_SET_PDEATHSIG), the watchdog reads on until EOF, for up to
 * WD_LAST_ADD_MS (a job's child before its execve holds a copy of the end
 * and may yet send its ADD), SIGKILLs every registered process group and
 * writes cgroup.kill of every registered cgroup, then exits. With no
 * PING for dead_ms (the agent is stopped or hung) it reports FIRED for each
 * job, kills them, and keeps watching: an agent that comes back reads the
 * reports and says why its jobs died. A report is written before its kill,
 * so the loop, which finishes a job only once its group is dead, always
 * finds the report first.
 *
 * The watchdog is the same binary re-executed (/proc/self/exe) with only
 * KSCORE_EXEC_WATCHDOG in its environment: a constructor below turns that
 * process into the watchdog before main() runs. So it holds no copy of the
 * agent's memory (NATS credentials), no fd but the socket (closefrom) and
 * its stderr (the agent's log), and it leads its own session, so signals to
 * the agent's process group or terminal do not reach it.
 */
#include "exec_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WD_ENV "KSCORE_EXEC_WATCHDOG"
#define WD_FD 3

/* How long a watchdog whose agent died waits for the last copy of the
 * agent's end to close (a job's child between its clone and its execve). */
#define WD_LAST_ADD_MS 1000
#define WD_HDR_BYTES EXEC__WD_HDR_BYTES

static int64_t
mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the loop's side -------------------------------------------------- */

int
exec__wd_spawn(struct exec__wd *wd)
{
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    bool fa_ok = false, attr_ok = false;
    char env0[96], env1[48], env2[48], *envp[4] = {env0, env1, env2, NULL};
    char *argv[] = {"kscore-watchdog", NULL};
    int sv[2] = {-1, -1};
    sigset_t set;
    pid_t pid;
    int ret;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == -1)
        return -errno;
    /* dup2 onto itself would keep FD_CLOEXEC on older libcs. */
    if (sv[1] == WD_FD) {
        int fd = fcntl(sv[1], F_DUPFD_CLOEXEC, WD_FD + 1);
        if (fd == -1) {
            ret = -errno;
            goto out;
        }
        close(sv[1]);
        sv[1] = fd;
    }
    snprintf(env0, sizeof(env0), "%s=%d:%ld:%u", WD_ENV, WD_FD, (long)getpid(),
             wd->dead_ms);
    /* It logs as the agent does (ks_log), into the same stderr. */
    snprintf(env1, sizeof(env1), "KSCORE_LOG_FORMAT=%s",
             ks_log_format_name(ks_log_format_get()));
    snprintf(env2, sizeof(env2), "KSCORE_LOG_LEVEL=%s",
             ks_log_level_name(ks_log_level_get()));
    if ((ret = -posix_spawn_file_actions_init(&fa)))
        goto out;
    fa_ok = true;
    if ((ret = -posix_spawnattr_init(&attr)))
        goto out;
    attr_ok = true;
    if ((ret = -posix_spawn_file_actions_adddup2(&fa, sv[1], WD_FD)) ||
        (ret = -posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY,
                                                 0)) ||
        (ret = -posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY,
                                                 0)) ||
        (ret = -posix_spawn_file_actions_addclosefrom_np(&fa, WD_FD + 1)))
        goto out;
    sigfillset(&set);
    if ((ret = -posix_spawnattr_setsigdefault(&attr, &set)))
        goto out;
    sigemptyset(&set);
    if ((ret = -posix_spawnattr_setsigmask(&attr, &set)) ||
        (ret = -posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID |
                                                    POSIX_SPAWN_SETSIGDEF |
                                                    POSIX_SPAWN_SETSIGMASK)))
        goto out;
    ret = -posix_spawn(&pid, "/proc/self/exe", &fa, &attr, argv, envp);
    if (ret)
        goto out;
    if (fcntl(sv[0], F_SETFL, O_NONBLOCK) == -1) {
        ret = -errno;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        goto out;
    }
    wd->fd = sv[0];
    wd->pid = pid;
    sv[0] = -1;
out:
    if (attr_ok)
        posix_spawnattr_destroy(&attr);
    if (fa_ok)
        posix_spawn_file_actions_destroy(&fa);
    if (sv[0] != -1)
        close(sv[0]);
    if (sv[1] != -1)
        close(sv[1]);
    return ret;
}

void
exec__wd_stop(struct exec__wd *wd, bool force)
{
    /* SIGKILL before the EOF: a watchdog that saw the EOF first would kill
     * every job still registered (a replacement keeps them running). */
    if (force && wd->pid > 0)
        kill(wd->pid, SIGKILL);
    if (wd->fd != -1)
        close(wd->fd); /* EOF: it kills what is registered (nothing, at a
                          clean stop) and exits */
    wd->fd = -1;
    if (wd->pid > 0) {
        while (waitpid(wd->pid, NULL, 0) == -1 && errno == EINTR)
            ;
    }
    wd->pid = 0;
}

/* Lays out one record in m; its length in *len. 0, or -ENAMETOOLONG. */
static int
wd_fill(struct exec__wd_msg *m, unsigned type, uint64_t job_id, pid_t pgid,
        const char *path, size_t *len)
{
    *len = WD_HDR_BYTES;
    memset(m, 0, WD_HDR_BYTES);
    m->type = type;
    m->job_id = job_id;
    m->pgid = (int32_t)pgid;
    if (path && path[0]) {
        size_t pl = strlen(path);
        if (pl >= sizeof(m->path))
            return -ENAMETOOLONG;
        memcpy(m->path, path, pl + 1);
        *len += pl + 1;
    }
    return 0;
}

/* Sends one record without blocking: 0, or -errno (-EIO: cut short). */
static int
wd_put(int fd, const struct exec__wd_msg *m, size_t len)
{
    ssize_t n;

    do {
        n = send(fd, m, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n == -1 && errno == EINTR);
    return n == (ssize_t)len ? 0 : (n == -1 ? -errno : -EIO);
}

int
exec__wd_send(struct exec__wd *wd, unsigned type, uint64_t job_id, pid_t pgid,
              const char *path)
{
    struct exec__wd_msg m;
    size_t len;
    int rc;

    if (wd->fd == -1)
        return -EPIPE;
    if ((rc = wd_fill(&m, type, job_id, pgid, path, &len)))
        return rc;
    return wd_put(wd->fd, &m, len);
}

void
exec__wd_child_prepare(struct exec__wd_child *c, const struct exec__wd *wd,
                       uint64_t job_id, const char *path)
{
    c->sent = false;
    /* A path too long: the loop's own ADD refuses it the same way. */
    c->fd = wd_fill(&c->msg, EXEC__WD_ADD_CHILD, job_id, 0, path, &c->len) == 0
                ? wd->fd
                : -1;
}

void
exec__wd_child_undo(struct exec__wd_child *c)
{
    struct exec__wd_msg m;
    size_t len;

    /* Whatever `sent` says: a child killed between its send and its flag
     * (or one valgrind ran as a plain fork) registered all the same. */
    if (c->fd == -1)
        return;
    (void)wd_fill(&m, EXEC__WD_DEL, c->msg.job_id, 0, NULL, &len);
    c->sent = false;
    c->del_lost = wd_put(c->fd, &m, len) != 0;
}

int
exec__wd_read(struct exec__wd *wd, exec__wd_fired_fn fired, void *ud)
{
    struct exec__wd_msg m;
    ssize_t n;

    if (wd->fd == -1)
        return -EPIPE;
    for (;;) {
        n = recv(wd->fd, &m, sizeof(m), MSG_DONTWAIT);
        if (n == -1 && errno == EINTR)
            continue;
        if (n == -1)
            return errno == EAGAIN ? 0 : -errno;
        if (n == 0)
            return -EPIPE; /* the watchdog is gone */
        if ((size_t)n >= WD_HDR_BYTES && m.type == EXEC__WD_FIRED)
            fired(m.job_id, m.value, ud);
    }
}

/* ---- the watchdog process ------------------------------------------------ */

struct wd_entry {
    uint64_t job_id;
    pid_t pgid;
    bool fired;
    char *path;
};

static volatile sig_atomic_t wd_parent_gone;

static void
wd_on_hup(int sig)
{
    (void)sig;
    wd_parent_gone = 1;
}

static void
wd_kill(const struct wd_entry *e)
{
    if (e->pgid > 1)
        kill(-e->pgid, SIGKILL);
    if (e->path && e->path[0]) {
        char p[PATH_MAX + 16];
        int fd;
        snprintf(p, sizeof(p), "%s/cgroup.kill", e->path);
        fd = open(p, O_WRONLY | O_CLOEXEC);
        if (fd != -1) {
            if (write(fd, "1", 1) == -1)
                (void)errno; /* the cgroup is gone: nothing to kill */
            close(fd);
        }
    }
}

struct wd_table {
    struct wd_entry *e;
    size_t n, cap;
    int64_t last_ping_ms;
};

/* Reads every record there is; returns true at EOF (or a dead socket). */
static bool
wd_read_all(int fd, struct wd_table *t)
{
    struct exec__wd_msg m;
    ssize_t r;

    for (;;) {
        r = recv(fd, &m, sizeof(m), MSG_DONTWAIT);
        if (r == -1 && errno == EINTR)
            continue;
        if (r == 0)
            return true;
        if (r == -1)
            return errno != EAGAIN && errno != EWOULDBLOCK;
        if ((size_t)r < WD_HDR_BYTES)
            continue;
        ((char *)&m)[r < (ssize_t)sizeof(m) ? r : r - 1] = '\0';
        /* A sign of the loop's life, but for a child's ADD: it sends its
         * own, whatever state the loop is in. */
        if (m.type != EXEC__WD_ADD_CHILD)
            t->last_ping_ms = mono_ms();
        if (m.type == EXEC__WD_ADD || m.type == EXEC__WD_ADD_CHILD) {
            size_t i = 0;
            while (i < t->n && t->e[i].job_id != m.job_id)
                i++;
            if (i < t->n) { /* again (the loop after its child): replace */
                free(t->e[i].path);
                t->e[i].pgid = m.pgid;
                t->e[i].path =
                    (size_t)r > WD_HDR_BYTES ? strdup(m.path) : NULL;
                continue;
            }
            if (t->n == t->cap) {
                size_t nc = t->cap ? t->cap * 2 : 64;
                struct wd_entry *e = realloc(t->e, nc * sizeof(*e));
                if (!e)
                    continue;
                t->e = e;
                t->cap = nc;
            }
            t->e[t->n].job_id = m.job_id;
            t->e[t->n].pgid = m.pgid;
            t->e[t->n].fired = false;
            t->e[t->n].path = (size_t)r > WD_HDR_BYTES ? strdup(m.path) : NULL;
            t->n++;
        } else if (m.type == EXEC__WD_DEL) {
            for (size_t i = 0; i < t->n;)
                if (t->e[i].job_id == m.job_id) {
                    free(t->e[i].path);
                    t->e[i] = t->e[--t->n];
                } else {
                    i++;
                }
        }
    }
}

static void __attribute__((noreturn))
wd_main(int fd, pid_t ppid, unsigned dead_ms)
{
    struct wd_table t = {NULL, 0, 0, mono_ms()};
    struct sigaction sa;
    sigset_t block, waitmask;
    bool eof = false;

    /* exec__wd_spawn gave it default dispositions and an empty mask; this
     * holds whoever started it (and ignores SIGPIPE as the agent does). */
    exec_process_init();
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = wd_on_hup;
    sigaction(SIGHUP, &sa, NULL);
    sigemptyset(&block);
    sigaddset(&block, SIGHUP);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    /* The loop thread that spawned us dies with its process. */
    prctl(PR_SET_PDEATHSIG, SIGHUP);
    if (getppid() != ppid)
        wd_parent_gone = 1;
    if (dead_ms == 0)
        dead_ms = 3000;

    while (!wd_parent_gone && !eof) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int64_t now = mono_ms(), wait_ms;
        bool armed = false;
        struct timespec ts;

        for (size_t i = 0; i < t.n; i++)
            armed |= !t.e[i].fired;
        wait_ms = armed ? t.last_ping_ms + dead_ms - now : 1000;
        if (wait_ms < 0)
            wait_ms = 0;
        if (wait_ms > 1000)
            wait_ms = 1000;
        ts.tv_sec = wait_ms / 1000;
        ts.tv_nsec = (wait_ms % 1000) * 1000000;
        if (ppoll(&pfd, 1, &ts, &waitmask) > 0)
            eof = wd_read_all(fd, &t);
        now = mono_ms();
        if (!eof && !wd_parent_gone &&
            now - t.last_ping_ms >= (int64_t)dead_ms) {
            unsigned killed = 0;
            for (size_t i = 0; i < t.n; i++) {
                struct exec__wd_msg m;
                if (t.e[i].fired)
                    continue;
                memset(&m, 0, WD_HDR_BYTES);
                m.type = EXEC__WD_FIRED;
                m.job_id = t.e[i].job_id;
                m.pgid = t.e[i].pgid;
                m.value = now - t.last_ping_ms;
                /* The report first: the loop must find it before it sees
                 * the job die. */
                if (send(fd, &m, WD_HDR_BYTES, MSG_NOSIGNAL | MSG_DONTWAIT) ==
                    -1)
                    (void)errno; /* the loop reads it if it ever can */
                wd_kill(&t.e[i]);
                t.e[i].fired = true;
                killed++;
            }
            if (killed)
                ks_log(KS_LOG_WARN, "no sign of life from the agent: killed "
                                    "its jobs",
                       KS_I("agent_pid", ppid),
                       KS_D("silent_s", (double)(now - t.last_ping_ms) / 1000),
                       KS_I("jobs", killed));
        }
    }
    /* What the agent registered before it died is still in the socket
     * (it may have died before this process even started), and a job's
     * child between its clone and its execve may still send its ADD: read
     * until the last copy of the agent's end is closed (EOF). */
    bool closed = eof;
    for (int64_t until = mono_ms() + WD_LAST_ADD_MS; !eof;) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int64_t left = until - mono_ms();
        if (left <= 0 || poll(&pfd, 1, (int)left) <= 0)
            break;
        eof = wd_read_all(fd, &t);
    }
    if (t.n)
        ks_log(KS_LOG_WARN,
               closed ? "the agent closed its end: killing its jobs"
                   : "the agent died: killing its jobs",
               KS_I("agent_pid", ppid), KS_I("jobs", t.n));
    for (size_t i = 0; i < t.n; i++)
        wd_kill(&t.e[i]);
    _exit(0);
}

/*
 * Runs before main() in every binary that links the executor; only a
 * process spawned by exec__wd_spawn() has WD_ENV, and it never returns.
 */
__attribute__((constructor)) static void
wd_ctor(void)
{
    const char *v = getenv(WD_ENV);
    int fd;
    long ppid;
    unsigned dead_ms;

    if (!v)
        return;
    if (sscanf(v, "%d:%ld:%u", &fd, &ppid, &dead_ms) != 3 || fd < 0)
        _exit(2);
    enum ks_log_format lf = KS_LOG_TEXT;
    enum ks_log_level ll = KS_LOG_INFO;
    const char *e = getenv("KSCORE_LOG_FORMAT");
    if (e)
        ks_log_format_parse(e, &lf);
    if ((e = getenv("KSCORE_LOG_LEVEL")))
        ks_log_level_parse(e, &ll);
    ks_log_setup(lf, ll, "watchdog");
    wd_main(fd, (pid_t)ppid, dead_ms);
}
