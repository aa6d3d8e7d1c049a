/*
 * exec_spawn.c: everything up to the child's execve: spec checks, the
 * child's environment, PATH resolution, exec_precheck() and posix_spawn.
 */
#include "exec_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* execve(2) follows at most this many "#!" levels (BINPRM_MAX_RECURSION). */
#define EXEC_SHEBANG_DEPTH 4

int
exec__spec_valid(const struct exec_spec *spec)
{
    if (!spec || !spec->argv || !spec->argv[0] || !spec->argv[0][0])
        return KS_EINVAL;
    for (size_t i = 0; i < spec->env_len; i++) {
        const char *n = spec->env[i].name;
        if (!n || !n[0] || strchr(n, '=') || !spec->env[i].value)
            return KS_EINVAL;
    }
    if ((spec->stdin_len && !spec->stdin_data) ||
        (spec->user && (!spec->user->name || !spec->user->home ||
                        (spec->user->n_groups && !spec->user->groups))))
        return KS_EINVAL;
    return 0;
}

const char *
exec__cwd(const struct exec_spec *spec)
{
    return (spec->cwd && spec->cwd[0]) ? spec->cwd : "/";
}

const char *
exec__env_get(char *const *envp, const char *name)
{
    size_t n = strlen(name);

    for (; *envp; envp++)
        if (!strncmp(*envp, name, n) && (*envp)[n] == '=')
            return *envp + n + 1;
    return NULL;
}

int
exec__build_env(const struct exec_spec *spec, char ***envp_out)
{
    const struct exec_user *u = spec->user;
    struct {
        const char *name, *value;
    } base[6] = {{"PATH", EXEC_BASE_PATH},
                 {"LANG", EXEC_BASE_LANG},
                 {"HOME", u ? u->home : exec__home()}};
    size_t nbase = 3;
    if (u) {
        base[nbase].name = "USER";
        base[nbase++].value = u->name;
        base[nbase].name = "LOGNAME";
        base[nbase++].value = u->name;
    }
    if (spec->command_id) {
        base[nbase].name = "KSCORE_COMMAND_ID";
        base[nbase++].value = spec->command_id;
    }
    size_t max = nbase + spec->env_len;
    /* Slot i holds (name, value); a later spec entry replaces its slot. */
    const char **names = NULL, **values = NULL;
    size_t n = 0, bytes = 0;
    char **envp = NULL, *p;
    int ret = -ENOMEM;

    names = malloc(max * sizeof(*names));
    values = malloc(max * sizeof(*values));
    if (!names || !values)
        goto out;
    for (size_t i = 0; i < max; i++) {
        const char *name = i < nbase ? base[i].name : spec->env[i - nbase].name;
        const char *value =
            i < nbase ? base[i].value : spec->env[i - nbase].value;
        size_t j;

        for (j = 0; j < n; j++)
            if (!strcmp(names[j], name))
                break;
        names[j] = name;
        values[j] = value;
        if (j == n)
            n++;
    }
    for (size_t i = 0; i < n; i++)
        bytes += strlen(names[i]) + 1 + strlen(values[i]) + 1;
    envp = malloc((n + 1) * sizeof(*envp) + bytes);
    if (!envp)
        goto out;
    p = (char *)(envp + n + 1);
    for (size_t i = 0; i < n; i++) {
        envp[i] = p;
        p = stpcpy(p, names[i]);
        *p++ = '=';
        p = stpcpy(p, values[i]) + 1;
    }
    envp[n] = NULL;
    *envp_out = envp;
    ret = 0;
out:
    free(names);
    free(values);
    return ret;
}

int
exec__check_cwd(const char *cwd)
{
    struct stat st;

    if (stat(cwd, &st) == -1)
        return -errno;
    if (!S_ISDIR(st.st_mode))
        return -ENOTDIR;
    if (access(cwd, X_OK) == -1)
        return -errno;
    return 0;
}

/*
 * What execve would say about path, without running it: -ENOENT/-ENOTDIR
 * when missing, -EACCES for a directory, a special file or no x bit, and
 * the same for a "#!" interpreter (fs/binfmt_script.c).
 */
static int
check_exec(const char *path, int depth)
{
    struct stat st;
    char line[256], *interp, *end;
    ssize_t n;
    int fd;

    if (stat(path, &st) == -1)
        return -errno;
    if (!S_ISREG(st.st_mode))
        return -EACCES;
    if (access(path, X_OK) == -1)
        return -errno;
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd == -1)
        return 0; /* execve needs no read permission on a binary */
    n = read(fd, line, sizeof(line) - 1);
    close(fd);
    if (n < 2 || line[0] != '#' || line[1] != '!')
        return 0;
    if (depth >= EXEC_SHEBANG_DEPTH)
        return -ELOOP;
    line[n] = '\0';
    interp = line + 2 + strspn(line + 2, " \t");
    end = interp + strcspn(interp, " \t\n");
    if (end == interp)
        return -ENOEXEC;
    *end = '\0';
    return check_exec(interp, depth + 1);
}

int
exec__resolve(const char *argv0, const char *path_env, char **out)
{
    const char *dir, *next;
    size_t alen = strlen(argv0);
    int seen_eacces = 0;
    char *buf;

    if (strchr(argv0, '/')) {
        *out = strdup(argv0);
        return *out ? 0 : -ENOMEM;
    }
    if (!path_env)
        path_env = EXEC_BASE_PATH;
    buf = malloc(strlen(path_env) + alen + 2);
    if (!buf)
        return -ENOMEM;
    for (dir = path_env; *dir; dir = next) {
        size_t dlen = strcspn(dir, ":");
        struct stat st;

        next = dir[dlen] ? dir + dlen + 1 : dir + dlen;
        /* A relative PATH entry would depend on the cwd: skip it. */
        if (dlen == 0 || dir[0] != '/')
            continue;
        memcpy(buf, dir, dlen);
        buf[dlen] = '/';
        memcpy(buf + dlen + 1, argv0, alen + 1);
        if (stat(buf, &st) == -1)
            continue;
        if (S_ISREG(st.st_mode) && access(buf, X_OK) == 0) {
            *out = buf;
            return 0;
        }
        seen_eacces = 1;
    }
    free(buf);
    return seen_eacces ? -EACCES : -ENOENT;
}

/* Kernel limits on execve's strings (fs/exec.c: copy_strings, E2BIG). */
static int
check_sizes(const char *const *argv, char *const *envp)
{
    long arg_max = sysconf(_SC_ARG_MAX);
    size_t total = 0, count = 0;

    for (const char *const *a = argv; *a; a++, count++) {
        size_t l = strlen(*a) + 1;
        if (l > EXEC__MAX_ARG_STRLEN)
            return -E2BIG;
        total += l;
    }
    for (char *const *e = envp; *e; e++, count++) {
        size_t l = strlen(*e) + 1;
        if (l > EXEC__MAX_ARG_STRLEN)
            return -E2BIG;
        total += l;
    }
    total += (count + 2) * sizeof(char *);
    if (arg_max > 0 && total > (size_t)arg_max)
        return -E2BIG;
    return 0;
}

int
exec_precheck(const struct exec_spec *spec, const char **stage_out)
{
    const char *cwd, *argv0;
    char **envp = NULL, *path = NULL, *joined = NULL;
    const char *stage = "exec";
    int ret;

    ret = exec__spec_valid(spec);
    if (ret)
        goto out;
    cwd = exec__cwd(spec);
    ret = exec__check_cwd(cwd);
    if (ret) {
        stage = "chdir";
        goto out;
    }
    ret = exec__build_env(spec, &envp);
    if (ret)
        goto out;
    ret = check_sizes(spec->argv, envp);
    if (ret)
        goto out;
    argv0 = spec->argv[0];
    ret = exec__resolve(argv0, exec__env_get(envp, "PATH"), &path);
    if (ret)
        goto out;
    if (path[0] != '/') {
        /* "./x" or "bin/x": the child resolves it in its cwd. */
        joined = malloc(strlen(cwd) + strlen(path) + 2);
        if (!joined) {
            ret = -ENOMEM;
            goto out;
        }
        sprintf(joined, "%s/%s", cwd, path);
    }
    ret = check_exec(joined ? joined : path, 0);
out:
    if (ret && stage_out)
        *stage_out = stage;
    free(envp);
    free(path);
    free(joined);
    return ret;
}

void
exec__child_nofile(struct rlimit *out)
{
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) == -1) {
        rl.rlim_cur = rl.rlim_max = RLIM_INFINITY;
    }
    /* systemd.exec(5), LimitNOFILE=: a soft limit above 1024 breaks
     * programs that still use select(2) (FD_SETSIZE). The hard limit
     * stays, so a child that needs more can raise its own. */
    if (rl.rlim_max == RLIM_INFINITY || rl.rlim_max > EXEC_CHILD_NOFILE_SOFT)
        rl.rlim_cur = EXEC_CHILD_NOFILE_SOFT;
    else
        rl.rlim_cur = rl.rlim_max;
    *out = rl;
}

/*
 * The process's own start state (agent.h, "Process start state"): what
 * execve(2) let through from whoever started us is undone. Only ignored
 * signals survive an execve (handlers are reset): each goes back to
 * SIG_DFL, SIGCHLD always (and without SA_NOCLDWAIT), then SIGPIPE is
 * ignored on purpose, and the inherited mask is emptied. Handlers that
 * a sanitizer runtime installed before main() are left alone.
 */
void
exec_process_init(void)
{
    struct sigaction dfl, cur;
    sigset_t none;

    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        /* glibc's own signals (SIGCANCEL, SIGSETXID) refuse: EINVAL. */
        if (sigaction(sig, NULL, &cur) == -1)
            continue;
        if (sig == SIGCHLD || cur.sa_handler == SIG_IGN)
            sigaction(sig, &dfl, NULL);
    }
    /* A write to a closed pipe or socket (stderr after its reader went,
     * an OpenSSL write to a reset connection) is an error the caller
     * sees (EPIPE), never the death of an agent that has children
     * running. Children get SIG_DFL back (exec__spawn, child_main). */
    dfl.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &dfl, NULL);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/*
 * stdout/stderr pipes (p[0], p[1]) and, with stdin bytes to give, the
 * stdin pipe (p[2]), all O_CLOEXEC. Our ends (the read ends of stdout and
 * stderr, the write end of stdin) are O_NONBLOCK (their own open file
 * description: the child's ends stay blocking). Every fd is >= 3, so
 * dup'ing onto 0-2 in the child never meets itself.
 */
static int
make_pipes(int p[3][2], bool with_stdin)
{
    for (int i = 0; i < (with_stdin ? 3 : 2); i++) {
        if (pipe2(p[i], O_CLOEXEC) == -1)
            return -errno;
        for (int j = 0; j < 2; j++) {
            if (p[i][j] < 3) {
                int fd = fcntl(p[i][j], F_DUPFD_CLOEXEC, 3);
                if (fd == -1)
                    return -errno;
                close(p[i][j]);
                p[i][j] = fd;
            }
        }
        if (fcntl(p[i][i == 2 ? 1 : 0], F_SETFL, O_NONBLOCK) == -1)
            return -errno;
    }
    return 0;
}

static void
close_pipes(int p[3][2])
{
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 2; j++)
            if (p[i][j] != -1)
                close(p[i][j]);
}

/* Our ends to the caller: out_fds[0] stdout, [1] stderr (read), [2] stdin
 * (write, -1 without stdin bytes). */
static void
take_ends(int p[3][2], int out_fds[3])
{
    out_fds[0] = p[0][0];
    out_fds[1] = p[1][0];
    out_fds[2] = p[2][1];
    p[0][0] = p[1][0] = p[2][1] = -1;
}

int
exec__spawn(const struct exec_spec *spec, const char *path,
            char *const *envp, pid_t *pid_out, int out_fds[3],
            const char **stage)
{
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    bool fa_ok = false, attr_ok = false;
    int p[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
    sigset_t set;
    pid_t pid;
    int ret;

    if (spec->user) {
        /* posix_spawn has no attribute for another user (only
         * POSIX_SPAWN_RESETIDS, back to the real ids). */
        *stage = "user";
        return -ENOTSUP;
    }
    *stage = "pipe";
    ret = make_pipes(p, spec->stdin_len > 0);
    if (ret)
        goto out;

    *stage = "spawn";
    ret = -posix_spawn_file_actions_init(&fa);
    if (ret)
        goto out;
    fa_ok = true;
    ret = -posix_spawnattr_init(&attr);
    if (ret)
        goto out;
    attr_ok = true;
    if ((ret = p[2][0] != -1
                   ? -posix_spawn_file_actions_adddup2(&fa, p[2][0], 0)
                   : -posix_spawn_file_actions_addopen(&fa, 0, "/dev/null",
                                                       O_RDONLY, 0)) ||
        (ret = -posix_spawn_file_actions_adddup2(&fa, p[0][1], 1)) ||
        (ret = -posix_spawn_file_actions_adddup2(&fa, p[1][1], 2)) ||
        (ret = -posix_spawn_file_actions_addchdir_np(&fa, exec__cwd(spec))) ||
        (ret = -posix_spawn_file_actions_addclosefrom_np(&fa, 3)))
        goto out;
    sigfillset(&set);
    if ((ret = -posix_spawnattr_setsigdefault(&attr, &set)))
        goto out;
    sigemptyset(&set);
    if ((ret = -posix_spawnattr_setsigmask(&attr, &set)) ||
        (ret = -posix_spawnattr_setpgroup(&attr, 0)) ||
        (ret = -posix_spawnattr_setflags(
             &attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF |
                        POSIX_SPAWN_SETSIGMASK)))
        goto out;

    /*
     * glibc runs the child on CLONE_VFORK and returns the errno of a failed
     * file action or execve, so this is the authoritative exec result.
     */
    ret = -posix_spawn(&pid, path, &fa, &attr, (char *const *)spec->argv,
                       envp);
    if (ret) {
        /* A failed chdir file action looks like an exec error: tell apart. */
        int cwd_err = exec__check_cwd(exec__cwd(spec));
        *stage = cwd_err ? "chdir" : "exec";
        if (cwd_err)
            ret = cwd_err;
        goto out;
    }
    *pid_out = pid;
    take_ends(p, out_fds);
out:
    close_pipes(p);
    if (attr_ok)
        posix_spawnattr_destroy(&attr);
    if (fa_ok)
        posix_spawn_file_actions_destroy(&fa);
    return ret;
}

#if defined(__x86_64__)
/*
 * Spawning straight into the job's cgroup: clone3(CLONE_INTO_CGROUP) with
 * CLONE_VM|CLONE_VFORK, what glibc's posix_spawn does minus the cgroup
 * (glibc 2.36 has no way to pass one). The alternative, writing the pid to
 * cgroup.procs after posix_spawn, measured 25 us to 9 ms here (the kernel
 * takes cgroup_threadgroup_rwsem for writing) while the child already runs
 * and forks: its early children, setsid escapees included, stayed outside.
 *
 * The same child serves spawns without a cgroup (no CLONE_INTO_CGROUP),
 * for the one set-up posix_spawn has no attribute for: the child's soft
 * RLIMIT_NOFILE (exec__child_nofile). The alternatives are wrong: our own
 * soft limit lowered around posix_spawn is the whole process's for that
 * moment (another thread's open or accept fails with EMFILE), and
 * prlimit(pid) after posix_spawn races the child's execve (it has run the
 * program by then). Where clone3 is missing (valgrind, an old kernel, a
 * seccomp filter, not x86_64) posix_spawn remains, and the child keeps the
 * agent's soft limit (docs/operating.md "Execution").
 *
 * The child runs on its own stack in our address space while this thread
 * is suspended; it uses raw syscalls only. A failure before or in execve
 * goes back through a CLOEXEC error pipe (errno and stage), not through
 * shared memory: valgrind runs CLONE_VFORK as a plain fork, and the
 * failure must still never look like a program exiting 127.
 */
struct child_ctx {
    const char *path;
    char *const *argv, *const *envp;
    const char *cwd;
    int in_r; /* stdin pipe, -1: /dev/null */
    int out_w, err_w;
    int report_w; /* error pipe, CLOEXEC: EOF means execve succeeded */
    struct rlimit nofile; /* exec__child_nofile() */
    const struct exec_user *user; /* NULL: stay who we are */
    struct exec__wd_child *wd;    /* its own ADD to the watchdog, or NULL */
};

/* What the child writes to the error pipe when it fails. */
struct child_report {
    int err;
    int stage; /* index into child_stages */
};

static const char *const child_stages[] = {"spawn", "chdir", "exec",
                                           "user"};

/* The kernel's struct sigaction for rt_sigaction on x86_64. */
struct ksigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

#define CHILD_STACK_BYTES (32 * 1024)

static int __attribute__((noinline, no_sanitize("address", "undefined")))
child_main(void *arg)
{
    struct child_ctx *c = arg;
    struct ksigaction dfl = {SIG_DFL, 0, NULL, 0};
    uint64_t empty = 0;
    long fd;

    struct child_report rep = {0, 0};

    if (syscall(SYS_setpgid, 0, 0) == -1)
        goto fail;
    /* Registered with the watchdog before anything of the command can run
     * (exec_watchdog.c says why). The loop thread waits in the clone until
     * our execve, so the record and the flag are ours to write. Not sent:
     * the loop sends it after the spawn. */
    if (c->wd && c->wd->fd != -1) {
        c->wd->msg.pgid = (int32_t)syscall(SYS_getpid);
        if (syscall(SYS_sendto, c->wd->fd, &c->wd->msg, c->wd->len,
                    MSG_NOSIGNAL | MSG_DONTWAIT, NULL, 0) ==
            (long)c->wd->len)
            c->wd->sent = true;
    }
    /* Default dispositions; handlers of ours must never run here. */
    for (int sig = 1; sig < 65; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof(uint64_t));
    if (c->in_r != -1) {
        if (syscall(SYS_dup3, c->in_r, 0, 0) == -1)
            goto fail;
    } else {
        fd = syscall(SYS_openat, AT_FDCWD, "/dev/null", O_RDONLY);
        if (fd == -1)
            goto fail;
        if (fd != 0) {
            if (syscall(SYS_dup3, fd, 0, 0) == -1)
                goto fail;
            syscall(SYS_close, fd);
        }
    }
    if (syscall(SYS_dup3, c->out_w, 1, 0) == -1 ||
        syscall(SYS_dup3, c->err_w, 2, 0) == -1)
        goto fail;
    if (c->user) {
        /* Groups first (they need our CAP_SETGID), then the gid, then the
         * uid, which drops every capability when it is not 0. Raw
         * syscalls: glibc's wrappers would signal every thread of the
         * agent (setxid) from this vfork child. */
        rep.stage = 3;
        if (syscall(SYS_setgroups, c->user->n_groups, c->user->groups) ==
                -1 ||
            syscall(SYS_setresgid, c->user->gid, c->user->gid,
                    c->user->gid) == -1 ||
            syscall(SYS_setresuid, c->user->uid, c->user->uid,
                    c->user->uid) == -1)
            goto fail;
    }
    rep.stage = 1;
    if (syscall(SYS_chdir, c->cwd) == -1)
        goto fail;
    rep.stage = 0;
    /* All but 0-2 and the error pipe (CLOEXEC: execve closes it). */
    if (c->report_w > 3 &&
        syscall(SYS_close_range, 3, c->report_w - 1, 0) == -1)
        goto fail;
    if (syscall(SYS_close_range, c->report_w + 1, ~0U, 0) == -1)
        goto fail;
    /* Only the soft limit comes down, which needs no privilege. */
    if (syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, &c->nofile, NULL) == -1)
        goto fail;
    if (syscall(SYS_rt_sigprocmask, SIG_SETMASK, &empty, NULL,
                sizeof(empty)) == -1)
        goto fail;
    rep.stage = 2;
    syscall(SYS_execve, c->path, c->argv, c->envp);
fail:
    rep.err = errno;
    syscall(SYS_write, c->report_w, &rep, sizeof(rep));
    return 127;
}

/* clone3 that runs fn(arg) on the new stack in the child, then exits. */
static long
clone3_run(struct clone_args *ca, int (*fn)(void *), void *arg)
{
    register long rax __asm__("rax") = SYS_clone3;
    register void *r12 __asm__("r12") = (void *)fn;
    register void *r13 __asm__("r13") = arg;

    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "xor %%ebp, %%ebp\n\t"
                     "mov %%r13, %%rdi\n\t"
                     "call *%%r12\n\t"
                     "mov %%eax, %%edi\n\t"
                     "mov $231, %%eax\n\t" /* exit_group */
                     "syscall\n\t"
                     "hlt\n\t"
                     "1:\n\t"
                     : "+r"(rax)
                     : "D"(ca), "S"(sizeof(*ca)), "r"(r12), "r"(r13)
                     : "rcx", "r11", "memory");
    return rax;
}

int
exec__spawn_cgroup(const struct exec_spec *spec, const char *path,
                   char *const *envp, int cgroup_fd,
                   struct exec__wd_child *wdc, pid_t *pid_out,
                   int *pidfd_out, int out_fds[3], const char **stage)
{
    static _Alignas(16) __thread char stack[CHILD_STACK_BYTES];
    int p[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
    int rp[2] = {-1, -1};
    struct child_ctx c = {0};
    struct child_report rep;
    struct clone_args ca;
    sigset_t all, old;
    int pidfd = -1;
    ssize_t n;
    long pid;
    int ret;

    *stage = "pipe";
    ret = make_pipes(p, spec->stdin_len > 0);
    if (ret)
        goto out;
    if (pipe2(rp, O_CLOEXEC) == -1) {
        ret = -errno;
        goto out;
    }
    for (int i = 0; i < 2; i++) {
        if (rp[i] < 3) { /* 0-2 are the child's: keep the pipe above */
            int fd = fcntl(rp[i], F_DUPFD_CLOEXEC, 3);
            if (fd == -1) {
                ret = -errno;
                goto out;
            }
            close(rp[i]);
            rp[i] = fd;
        }
    }
    c.path = path;
    c.argv = (char *const *)spec->argv;
    c.envp = envp;
    c.cwd = exec__cwd(spec);
    c.in_r = p[2][0];
    c.user = spec->user;
    c.out_w = p[0][1];
    c.err_w = p[1][1];
    c.report_w = rp[1];
    c.wd = wdc;
    exec__child_nofile(&c.nofile);
    memset(&ca, 0, sizeof(ca));
    ca.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD;
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = sizeof(stack);
    if (cgroup_fd != -1) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }

    /* No handler of ours may run in the child (shared memory). */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid = clone3_run(&ca, child_main, &c);
    if (pid < 0 && cgroup_fd == -1 && spec->user &&
        (pid == -ENOSYS || pid == -EPERM || pid == -EOPNOTSUPP)) {
        /*
         * No clone3 (a seccomp filter, Docker's among them, answers
         * ENOSYS so that glibc falls back to clone): the same child on
         * clone(2), which posix_spawn itself uses, since only our child
         * can change the user. The pidfd comes from pidfd_open after.
         */
        pid = clone(child_main, stack + sizeof(stack),
                    CLONE_VM | CLONE_VFORK | SIGCHLD, &c);
        if (pid == -1)
            pid = -errno;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    *stage = "spawn";
    if (pid < 0) {
        /* Old kernel or a filter: the caller falls back to posix_spawn. */
        ret = (pid == -ENOSYS || pid == -EINVAL || pid == -E2BIG ||
               pid == -EPERM || pid == -EOPNOTSUPP)
                  ? -ENOSYS
                  : (int)pid;
        goto out;
    }
    close(rp[1]);
    rp[1] = -1;
    do {
        n = read(rp[0], &rep, sizeof(rep));
    } while (n == -1 && errno == EINTR);
    if (n == (ssize_t)sizeof(rep)) {
        /* Died before or in execve: reap it; it never ran anything. Its
         * ADD is taken back first: once reaped, its pgid may be reused. */
        if (wdc)
            exec__wd_child_undo(wdc);
        while (waitpid((pid_t)pid, NULL, 0) == -1 && errno == EINTR)
            ;
        if (pidfd != -1)
            close(pidfd);
        *stage = child_stages[rep.stage];
        ret = rep.err ? -rep.err : -EIO;
        goto out;
    }
    *pid_out = (pid_t)pid;
    *pidfd_out = pidfd;
    take_ends(p, out_fds);
out:
    if (rp[0] != -1)
        close(rp[0]);
    if (rp[1] != -1)
        close(rp[1]);
    close_pipes(p);
    return ret;
}
#else
int
exec__spawn_cgroup(const struct exec_spec *spec, const char *path,
                   char *const *envp, int cgroup_fd,
                   struct exec__wd_child *wdc, pid_t *pid_out,
                   int *pidfd_out, int out_fds[3], const char **stage)
{
    return -ENOSYS;
}
#endif
