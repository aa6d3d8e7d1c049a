/*
 * exec_group.c: what a job is made of besides its leader. Process-wide
 * set-up (subreaper, cgroup v2 probe, HOME), one cgroup per job, counting
 * a job's live members, and reaping the zombies it leaves to us.
 *
 * cgroup placement: on x86_64 the leader is cloned straight into its
 * cgroup, a pre-made one from the pool below (exec_spawn.c
 * exec__spawn_cgroup: clone3(CLONE_INTO_CGROUP)), so it never runs outside
 * it and no move is made. Only where clone3 is missing (valgrind, an old
 * kernel, a seccomp filter, another architecture) is the leader written
 * into cgroup.procs after posix_spawn (exec__cgroup_move), which has a
 * cost and a window. The cost, measured with `strace -T` on Linux 6.18
 * here (issue 23; perf/BASELINE.md "The cgroup step"): p50 16-21 us, p90
 * 45-50 us, p99 0.65-12 ms: since Linux 6.0 the write takes
 * cgroup_threadgroup_rwsem for writing, which waits for an RCU grace
 * period; spawn to reap p99 doubled with it. The window: the child runs
 * meanwhile, and a process the leader forks before the move stays outside
 * the cgroup. The executor notices (right after the move the leader is
 * dead or already has children) and then also scans /proc for the process
 * group, so such a stray still gets TERM/KILL as a group member. A stray
 * that also calls setsid() before the move is out of the cgroup's reach;
 * it is counted as a survivor if it was reparented to us.
 */
#include "exec_int.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t g_pid;           /* the process the set-up ran in (fork!) */
static bool g_cgroup;         /* per-job cgroups are used */
static char g_cg_mount[PATH_MAX];  /* cgroup2 mount point */
static char g_cg_parent[PATH_MAX]; /* <mount><own cgroup>/kscore-<pid> */
static char g_home[PATH_MAX];
static atomic_ulong g_seq;

/*
 * Empty job cgroups kept for reuse: mkdir + rmdir of a cgroup cost 70-450 us
 * here, more than the rest of a spawn. Names only, no fds held.
 */
#define EXEC_CG_POOL 64
static unsigned long g_pool[EXEC_CG_POOL];
static unsigned g_pool_len;

/* snprintf for paths: -ENAMETOOLONG instead of a silently cut path. */
static int __attribute__((format(printf, 3, 4)))
path_fmt(char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, size, fmt, ap);
    va_end(ap);
    return (n < 0 || (size_t)n >= size) ? -ENAMETOOLONG : 0;
}

bool
exec__cgroup_enabled(void)
{
    return g_cgroup;
}

const char *
exec__home(void)
{
    return g_home[0] ? g_home : "/";
}

static ssize_t
read_file(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n, total = 0;

    if (fd == -1)
        return -errno;
    while ((size_t)total < size - 1) {
        n = read(fd, buf + total, size - 1 - total);
        if (n == -1 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        total += n;
    }
    close(fd);
    buf[total] = '\0';
    return total;
}

static int
write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    size_t len = strlen(text);
    int ret = 0;

    if (fd == -1)
        return -errno;
    if (write(fd, text, len) != (ssize_t)len)
        ret = -errno;
    close(fd);
    return ret;
}

/* 1 if pid is gone or a zombie (dead, not yet reaped by its parent). */
static int
pid_dead(long pid)
{
    char path[64], buf[512], *rp;
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH)
        return 1;
    snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    if (read_file(path, buf, sizeof(buf)) <= 0)
        return 1;
    rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

/* Kills and removes a leftover kscore-<pid> tree of a dead agent. */
static void
remove_stale_tree(const char *dir)
{
    char path[PATH_MAX], buf[128];
    DIR *d = opendir(dir);
    struct dirent *de;

    if (!d)
        return;
    while ((de = readdir(d))) {
        if (de->d_type != DT_DIR || de->d_name[0] == '.')
            continue;
        path_fmt(path, sizeof(path), "%s/%s/cgroup.kill", dir, de->d_name);
        write_file(path, "1");
        path_fmt(path, sizeof(path), "%s/%s/cgroup.events", dir, de->d_name);
        for (int i = 0; i < 100; i++) {
            if (read_file(path, buf, sizeof(buf)) <= 0 ||
                strstr(buf, "populated 0"))
                break;
            usleep(2000);
        }
        path_fmt(path, sizeof(path), "%s/%s", dir, de->d_name);
        rmdir(path);
    }
    closedir(d);
    rmdir(dir);
}

/*
 * Finds the cgroup2 mount and our own cgroup; kills what agents that died
 * left behind (K25: a restarted agent kills its predecessor's groups); makes
 * our kscore-<pid> parent. Returns true if job cgroups can be made.
 */
static bool
cgroup_probe(void)
{
    char buf[8192], own[PATH_MAX] = "", dir[PATH_MAX], path[PATH_MAX];
    const char *env = getenv("KSCORE_EXEC_CGROUP");
    char *line, *save;
    DIR *d;
    struct dirent *de;

    if (env && !strcmp(env, "0"))
        return false;
    g_cg_mount[0] = '\0';
    if (read_file("/proc/mounts", buf, sizeof(buf)) <= 0)
        return false;
    for (line = strtok_r(buf, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        char mnt[PATH_MAX], type[64];
        if (sscanf(line, "%*s %4095s %63s", mnt, type) == 2 &&
            !strcmp(type, "cgroup2")) {
            path_fmt(g_cg_mount, sizeof(g_cg_mount), "%s", mnt);
            break;
        }
    }
    if (!g_cg_mount[0])
        return false;
    if (read_file("/proc/self/cgroup", buf, sizeof(buf)) <= 0)
        return false;
    for (line = strtok_r(buf, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save))
        if (!strncmp(line, "0::", 3))
            path_fmt(own, sizeof(own), "%s", line + 3);
    if (!own[0])
        return false;
    if (path_fmt(dir, sizeof(dir), "%s%s", g_cg_mount,
                 strcmp(own, "/") ? own : ""))
        return false;
    /* Moving a process into a child cgroup needs write access here. */
    if (path_fmt(path, sizeof(path), "%s/cgroup.procs", dir) ||
        access(path, W_OK) == -1)
        return false;

    d = opendir(dir);
    if (d) {
        while ((de = readdir(d))) {
            long pid;
            char *end;
            if (strncmp(de->d_name, "kscore-", 7))
                continue;
            pid = strtol(de->d_name + 7, &end, 10);
            if (*end || pid <= 0)
                continue;
            if (pid != getpid() && !pid_dead(pid))
                continue;
            if (!path_fmt(path, sizeof(path), "%s/%s", dir, de->d_name))
                remove_stale_tree(path);
        }
        closedir(d);
    }
    if (path_fmt(g_cg_parent, sizeof(g_cg_parent), "%s/kscore-%d", dir,
                 (int)getpid()))
        return false;
    if (mkdir(g_cg_parent, 0755) == -1 && errno != EEXIST)
        return false;
    /* cgroup.kill (Linux 5.14) is what catches setsid escapees. */
    path_fmt(path, sizeof(path), "%s/cgroup.kill", g_cg_parent);
    if (access(path, W_OK) == -1) {
        rmdir(g_cg_parent);
        return false;
    }
    return true;
}

int
exec_global_init(void)
{
    int ret;

    pthread_mutex_lock(&g_mu);
    /* Per process: the subreaper flag is not inherited across fork. */
    if (g_pid != getpid()) {
        struct passwd pw, *res = NULL;
        char buf[4096];

        prctl(PR_SET_CHILD_SUBREAPER, 1);
        g_home[0] = '\0';
        if (getpwuid_r(getuid(), &pw, buf, sizeof(buf), &res) == 0 && res &&
            res->pw_dir && res->pw_dir[0])
            path_fmt(g_home, sizeof(g_home), "%s", res->pw_dir);
        g_pool_len = 0; /* a parent's pooled cgroups are not ours */
        g_cgroup = cgroup_probe();
        g_pid = getpid();
    }
    ret = g_cgroup ? 1 : 0;
    pthread_mutex_unlock(&g_mu);
    return ret;
}

int
exec__cgroup_create(struct exec__cgroup *cg)
{
    unsigned long seq;
    bool reused = false;
    int ret;

    cg->dir_fd = cg->events_fd = -1;
    cg->in_use = cg->moved = cg->killed = false;
    pthread_mutex_lock(&g_mu);
    if (g_pool_len) {
        seq = g_pool[--g_pool_len];
        reused = true;
    } else {
        seq = (unsigned long)atomic_fetch_add(&g_seq, 1);
    }
    pthread_mutex_unlock(&g_mu);
    if (path_fmt(cg->path, sizeof(cg->path), "%s/j%lu", g_cg_parent, seq))
        return -ENAMETOOLONG;
    cg->seq = seq;
    if (!reused && mkdir(cg->path, 0755) == -1)
        return -errno;
    cg->in_use = true;
    cg->dir_fd = open(cg->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cg->dir_fd != -1)
        cg->events_fd =
            openat(cg->dir_fd, "cgroup.events", O_RDONLY | O_CLOEXEC);
    if (cg->events_fd == -1) {
        ret = -errno;
        exec__cgroup_destroy(cg);
        return ret;
    }
    return 0;
}

int
exec__cgroup_move(struct exec__cgroup *cg, pid_t pid)
{
    char path[PATH_MAX + 32], text[24];
    int ret;

    path_fmt(path, sizeof(path), "%s/cgroup.procs", cg->path);
    path_fmt(text, sizeof(text), "%d", (int)pid);
    ret = write_file(path, text);
    if (ret == 0)
        cg->moved = true;
    return ret;
}

int
exec__cgroup_populated(struct exec__cgroup *cg)
{
    char buf[128];
    ssize_t n = pread(cg->events_fd, buf, sizeof(buf) - 1, 0);
    char *p;

    if (n == -1)
        return -errno;
    buf[n] = '\0';
    p = strstr(buf, "populated ");
    if (!p)
        return -EINVAL;
    return p[10] == '1';
}

int
exec__cgroup_kill(struct exec__cgroup *cg)
{
    char path[PATH_MAX + 32];

    path_fmt(path, sizeof(path), "%s/cgroup.kill", cg->path);
    cg->killed = true;
    return write_file(path, "1");
}

void
exec__cgroup_destroy(struct exec__cgroup *cg)
{
    bool pooled = false;

    /* A killed cgroup is not reused: here (Linux 6.18) it went on killing
     * every process later cloned into it. */
    if (cg->in_use && !cg->killed && cg->events_fd != -1 &&
        exec__cgroup_populated(cg) == 0) {
        pthread_mutex_lock(&g_mu);
        if (g_pool_len < EXEC_CG_POOL) {
            g_pool[g_pool_len++] = cg->seq;
            pooled = true;
        }
        pthread_mutex_unlock(&g_mu);
    }
    if (cg->events_fd != -1)
        close(cg->events_fd);
    if (cg->dir_fd != -1)
        close(cg->dir_fd);
    cg->events_fd = cg->dir_fd = -1;
    /* Still populated means survivors: the next probe removes it. */
    if (cg->in_use && !pooled)
        rmdir(cg->path);
    cg->in_use = cg->moved = false;
}

int
exec__may_have_forked(pid_t pid)
{
    char path[64], buf[512], *p;

    /* Dead already: it ran (and maybe forked) before the move. */
    path_fmt(path, sizeof(path), "/proc/%d/stat", (int)pid);
    if (read_file(path, buf, sizeof(buf)) <= 0)
        return 1;
    p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X')
        return 1;
    path_fmt(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid,
             (int)pid);
    return read_file(path, buf, sizeof(buf)) != 0;
}

int
exec__pidfd_open(pid_t pid)
{
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

struct pstat {
    char state;
    pid_t ppid, pgrp, sid;
    unsigned long long start;
};

/* Parses /proc/<pid>/stat (the comm field may hold spaces and parens). */
static int
read_pstat(int procfd, const char *pid, struct pstat *ps)
{
    char path[64], buf[1024], *p;
    int fd;
    ssize_t n;

    path_fmt(path, sizeof(path), "%s/stat", pid);
    fd = openat(procfd, path, O_RDONLY | O_CLOEXEC);
    if (fd == -1)
        return -errno;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -EIO;
    buf[n] = '\0';
    p = strrchr(buf, ')');
    if (!p || sscanf(p + 1, " %c %d %d %d", &ps->state, &ps->ppid,
                     &ps->pgrp, &ps->sid) != 4)
        return -EIO;
    /* Field 22 is starttime; we are at field 3 after ')'. */
    ps->start = 0;
    for (int field = 2; field < 22 && p; field++)
        p = strchr(p + 1, ' ');
    if (p)
        ps->start = strtoull(p + 1, NULL, 10);
    return 0;
}

static bool
alive(const struct pstat *ps)
{
    return ps->state != 'Z' && ps->state != 'X' && ps->state != 'x';
}

void
exec__members(pid_t pgid, struct exec__cgroup *cg, bool scan_pgroup,
              struct exec__members *m)
{
    char buf[8192], path[PATH_MAX + 32], name[24];
    int procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    unsigned cg_pgroup = 0;
    struct pstat ps;

    m->pgroup = m->escaped = 0;
    if (procfd == -1)
        return;
    if (cg && cg->moved) {
        char *s, *end;
        path_fmt(path, sizeof(path), "%s/cgroup.procs", cg->path);
        /* Bounded: a fork bomb can list more; the count is then a floor. */
        if (read_file(path, buf, sizeof(buf)) < 0)
            buf[0] = '\0';
        for (s = buf; *s; s = end) {
            long pid = strtol(s, &end, 10);
            if (end == s)
                break;
            if (pid == pgid || pid <= 0)
                continue;
            path_fmt(name, sizeof(name), "%ld", pid);
            if (read_pstat(procfd, name, &ps) || !alive(&ps))
                continue;
            if (ps.pgrp == pgid)
                cg_pgroup++;
            else
                m->escaped++;
        }
        m->pgroup = cg_pgroup;
    }
    if (scan_pgroup || !cg || !cg->moved) {
        DIR *d = fdopendir(dup(procfd));
        struct dirent *de;
        pid_t self = getpid(), sid = getsid(0);

        m->pgroup = 0;
        while (d && (de = readdir(d))) {
            if (!isdigit((unsigned char)de->d_name[0]))
                continue;
            if (atoi(de->d_name) == pgid ||
                read_pstat(procfd, de->d_name, &ps) || !alive(&ps))
                continue;
            if (ps.pgrp == pgid)
                m->pgroup++;
            else if ((!cg || !cg->moved || scan_pgroup) && ps.ppid == self &&
                     ps.sid != sid && ps.sid == atoi(de->d_name))
                /*
                 * Without a cgroup, an orphan that made its own session
                 * was reparented to us (subreaper): count it as escaped.
                 */
                m->escaped++;
        }
        if (d)
            closedir(d);
    }
    close(procfd);
}

uint64_t
exec__boot_ticks(void)
{
    struct timespec ts;
    long hz = sysconf(_SC_CLK_TCK);

    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * (uint64_t)hz +
           (uint64_t)ts.tv_nsec / (1000000000ULL / (uint64_t)hz);
}

int
exec__members_possible(pid_t pgid, uint64_t since_ticks)
{
    int procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    int ret = 0;

    if (procfd == -1 || !d) {
        ret = 1;
        goto out;
    }
    while (!ret && (de = readdir(d))) {
        char path[64], buf[4096], *s, *end;
        if (de->d_name[0] == '.')
            continue;
        path_fmt(path, sizeof(path), "/proc/self/task/%s/children",
                 de->d_name);
        if (read_file(path, buf, sizeof(buf)) < 0)
            continue;
        for (s = buf; *s && !ret; s = end) {
            long pid = strtol(s, &end, 10);
            char name[24];
            struct pstat ps;
            if (end == s)
                break;
            if (pid == pgid)
                continue;
            path_fmt(name, sizeof(name), "%ld", pid);
            if (read_pstat(procfd, name, &ps) || !alive(&ps))
                continue;
            /* A member, or something started since the job: look closer. */
            if (ps.pgrp == pgid || ps.start + 1 >= since_ticks)
                ret = 1;
        }
    }
out:
    if (d)
        closedir(d);
    if (procfd != -1)
        close(procfd);
    return ret;
}

/* 1 if /proc/<pid>/cgroup names the cgroup at path. */
static int
in_cgroup(int procfd, const char *pid, const char *path)
{
    char file[64], buf[4096], *line, *save;
    const char *rel = path + strlen(g_cg_mount);
    int fd;
    ssize_t n;

    path_fmt(file, sizeof(file), "%s/cgroup", pid);
    fd = openat(procfd, file, O_RDONLY | O_CLOEXEC);
    if (fd == -1)
        return 0;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    for (line = strtok_r(buf, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save))
        if (!strncmp(line, "0::", 3) && !strcmp(line + 3, rel))
            return 1;
    return 0;
}

void
exec__reap_leftovers(pid_t pgid, struct exec__cgroup *cg)
{
    siginfo_t si;
    int procfd;
    DIR *d;
    struct dirent *de;

    /* Zombies of the group pin the pgid, so this cannot reach a stranger. */
    while (waitpid(-pgid, NULL, WNOHANG) > 0)
        ;
    if (!cg || !cg->moved)
        return;
    /* Cheap test first: any zombie child at all? */
    memset(&si, 0, sizeof(si));
    if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) == -1 ||
        si.si_pid == 0)
        return;
    /* Escapees that left the group: zombie children in the job's cgroup. */
    procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (procfd == -1)
        return;
    d = opendir("/proc/self/task");
    while (d && (de = readdir(d))) {
        char path[64], buf[4096], *s, *end;
        if (de->d_name[0] == '.')
            continue;
        path_fmt(path, sizeof(path), "/proc/self/task/%s/children",
                 de->d_name);
        if (read_file(path, buf, sizeof(buf)) <= 0)
            continue;
        for (s = buf; *s; s = end) {
            long pid = strtol(s, &end, 10);
            char name[24];
            struct pstat ps;
            if (end == s)
                break;
            path_fmt(name, sizeof(name), "%ld", pid);
            if (read_pstat(procfd, name, &ps) || ps.state != 'Z')
                continue;
            if (in_cgroup(procfd, name, cg->path))
                waitpid((pid_t)pid, NULL, WNOHANG);
        }
    }
    if (d)
        closedir(d);
    close(procfd);
}
