/*
 * test_agent: the agent under faults (issue 10, items 3, 4 and 5), against
 * real processes: the executor's watchdog alone, then a real stack
 * (nats-server, PostgreSQL, broker, `kscore agent` processes).
 *
 *  - capacity: an agent claims only with a free slot; the backlog waits in
 *    JetStream, unclaimed; after kill -9 and a restart, what ran is Lost,
 *    the rest runs once;
 *  - children never outlive their agent: kill -9, SIGSTOP (watchdog), NATS
 *    outage (self-fence), each reported Lost with its reason;
 *  - a command claimed but never spawned is claimed again with its
 *    journalled claim id and runs once;
 *  - a claim is tried with one id until the broker answers; a Running
 *    command no heartbeat of its claimer lists ends Lost;
 *  - TERM drains: what runs finishes, what waits stays in JetStream.
 *
 * Processes of a command are found by KSCORE_COMMAND_ID / KSCORE_AGENT_ID
 * in /proc/<pid>/environ, which no other test's processes carry.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "agent.h"
#include "broker.h"
#include "fixture.h"
#include "stack.h"

#define MS 1000000L /* ns */

static void
sleep_ms(long ms)
{
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * MS}, NULL);
}

/* ---- /proc ------------------------------------------------------------------
 */

/* 1 if the process is gone or a zombie. */
static int
pid_dead(pid_t pid)
{
    char path[64], buf[512], *p;
    FILE *f;
    size_t n;

    if (kill(pid, 0) == -1 && errno == ESRCH)
        return 1;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return 1;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    p = strrchr(buf, ')');
    return p && (p[2] == 'Z' || p[2] == 'X');
}

/* 1 if the NUL-separated environ of pid holds the entry `entry`. */
static int
environ_has(const char *pid, const char *entry)
{
    char path[64], buf[16384];
    size_t n, len = strlen(entry);
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%s/environ", pid);
    f = fopen(path, "r");
    if (!f)
        return 0;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        if (!strncmp(buf + i, entry, len) && buf[i + len] == '\0')
            return 1;
    return 0;
}

/* Live processes whose environment holds `entry`; *first gets one pid. */
static int
procs_with_env(const char *entry, pid_t *first)
{
    DIR *d = opendir("/proc");
    struct dirent *de;
    int n = 0;

    while (d && (de = readdir(d))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9')
            continue;
        if (environ_has(de->d_name, entry) && !pid_dead(atoi(de->d_name))) {
            if (first && n == 0)
                *first = atoi(de->d_name);
            n++;
        }
    }
    if (d)
        closedir(d);
    return n;
}

static int
command_procs(const char *command_id, pid_t *first)
{
    char entry[64];
    snprintf(entry, sizeof(entry), "KSCORE_COMMAND_ID=%.36s", command_id);
    return procs_with_env(entry, first);
}

/* The KSCORE_COMMAND_ID of pid's environ into id (37), or 0. */
static int
environ_command_id(const char *pid, char id[37])
{
    char path[64], buf[16384];
    size_t n;
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%s/environ", pid);
    if (!(f = fopen(path, "r")))
        return 0;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        if (!strncmp(buf + i, "KSCORE_COMMAND_ID=", 18) &&
            strlen(buf + i + 18) == 36) {
            memcpy(id, buf + i + 18, 37);
            return 1;
        }
    return 0;
}

/*
 * Processes of these commands (not of another run's "cap" agent that a
 * concurrent test on this machine may have) that run at one moment: one
 * pass over /proc, then only those still alive when it ends. A pass per
 * command, or counting what died during the pass, adds up processes of
 * different moments: at a wave's end (8 exit, 4 start) that counted 9 to
 * 12 processes for 8 slots.
 */
/* One pass over /proc: the processes of these commands into found (up to
 * 256), with the index in ids of each one's command into of. */
static int
scan_command_procs(char (*ids)[37], int n, pid_t *found, int *of)
{
    int nf = 0;
    DIR *d = opendir("/proc");
    struct dirent *de;

    while (d && (de = readdir(d)) && nf < 256) {
        char id[37];
        if (de->d_name[0] < '0' || de->d_name[0] > '9' ||
            !environ_command_id(de->d_name, id))
            continue;
        for (int i = 0; i < n; i++)
            if (!strcmp(ids[i], id)) {
                of[nf] = i;
                found[nf++] = atoi(de->d_name);
                break;
            }
    }
    if (d)
        closedir(d);
    return nf;
}

static int
procs_of_commands(char (*ids)[37], int n)
{
    pid_t found[256];
    int of[256], alive = 0;
    int nf = scan_command_procs(ids, n, found, of);
    for (int i = 0; i < nf; i++)
        alive += !pid_dead(found[i]);
    return alive;
}

/* How many of these commands have a live process at one moment (one
 * pass, as procs_of_commands): a command held at a gate is a shell and,
 * now and then, its `sleep`. */
static int
commands_with_procs(char (*ids)[37], int n)
{
    pid_t found[256];
    int of[256], count = 0;
    bool live[64] = {false};

    ck_assert_int_le(n, 64);
    int nf = scan_command_procs(ids, n, found, of);
    for (int i = 0; i < nf; i++)
        if (!pid_dead(found[i]) && !live[of[i]]) {
            live[of[i]] = true;
            count++;
        }
    return count;
}

/* ---- the executor's watchdog, alone
 * ------------------------------------------- */

/* A child process running one exec_loop with a watchdog and one job; it
 * tells the parent over a pipe "S <job pid> <watchdog pid>" at the spawn
 * and "D <watchdog_killed> <silence_ms> <signal>" at the end. */
struct wd_child {
    int wfd;
    struct exec_loop *loop;
};

static void
wd_child_started(uint64_t job_id, pid_t pid, void *ud)
{
    struct wd_child *c = ud;
    char line[64];
    (void)job_id;
    int n = snprintf(line, sizeof(line), "S %d %d\n", (int)pid,
                     (int)exec_loop_watchdog_pid(c->loop));
    if (write(c->wfd, line, (size_t)n) != n)
        _exit(3);
}

static void
wd_child_done(uint64_t job_id, struct exec_result *r, void *ud)
{
    struct wd_child *c = ud;
    char line[96];
    (void)job_id;
    int n = snprintf(line, sizeof(line), "D %d %lld %d\n",
                     r->watchdog_killed ? 1 : 0,
                     (long long)r->watchdog_silence_ms, r->signal);
    if (write(c->wfd, line, (size_t)n) != n)
        _exit(3);
    _exit(0);
}

/* The thread of this process that is not its main thread (the loop's). */
static pid_t
other_thread(void)
{
    pid_t tid = 0;
    struct dirent *de;
    DIR *d = opendir("/proc/self/task");

    if (!d)
        return 0;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.' && atoi(de->d_name) != getpid())
            tid = atoi(de->d_name);
    closedir(d);
    return tid;
}

/*
 * Starts the child. With gofd (not NULL), it first says "R <loop thread>
 * <watchdog pid>" once its loop and watchdog run, and submits only when a
 * byte comes on *gofd (the parent's write end).
 */
static pid_t
wd_child_start_held(unsigned watchdog_ms, const char *tag, int *rfd,
                    int *gofd)
{
    int p[2], g[2] = {-1, -1};
    pid_t pid;

    ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
    if (gofd)
        ck_assert_int_eq(pipe2(g, O_CLOEXEC), 0);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        struct exec_loop_opts o = {.max_concurrent = 2,
                                   .watchdog_ms = watchdog_ms};
        static struct wd_child c;
        const char *argv[] = {"sleep", "60", NULL};
        struct exec_spec spec = {.argv = argv, .command_id = tag};
        char line[64], go;
        close(p[0]);
        c.wfd = p[1];
        if (exec_loop_start(&o, &c.loop) != 0)
            _exit(2);
        if (gofd) {
            close(g[1]);
            for (int i = 0; i < 500 && !exec_loop_watchdog_pid(c.loop); i++)
                sleep_ms(10);
            int n = snprintf(line, sizeof(line), "R %d %d\n",
                             (int)other_thread(),
                             (int)exec_loop_watchdog_pid(c.loop));
            if (write(c.wfd, line, (size_t)n) != n || read(g[0], &go, 1) != 1)
                _exit(3);
        }
        if (exec_submit_ex(c.loop, &spec, wd_child_started, wd_child_done, &c,
                           NULL) != 0)
            _exit(2);
        for (;;)
            pause();
    }
    close(p[1]);
    *rfd = p[0];
    if (gofd) {
        close(g[0]);
        *gofd = g[1];
    }
    return pid;
}

static pid_t
wd_child_start(unsigned watchdog_ms, const char *tag, int *rfd)
{
    return wd_child_start_held(watchdog_ms, tag, rfd, NULL);
}

/* Reads one line from fd within timeout_ms into buf; 0 or -1. */
static int
read_line(int fd, char *buf, size_t len, int timeout_ms)
{
    size_t n = 0;
    while (n + 1 < len) {
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, timeout_ms) <= 0)
            return -1;
        if (read(fd, buf + n, 1) != 1)
            return -1;
        if (buf[n++] == '\n')
            break;
    }
    buf[n] = '\0';
    return 0;
}

/* Waits up to timeout_ms for pid to die; returns the ms it took or -1. */
static long
wait_dead(pid_t pid, long timeout_ms)
{
    for (long t = 0; t <= timeout_ms; t += 50) {
        if (pid_dead(pid))
            return t;
        sleep_ms(50);
    }
    return -1;
}

/* kill -9 of the process that runs the loop: its job is killed at once, by
 * the watchdog, and the watchdog exits. */
START_TEST(watchdog_kills_jobs_of_a_dead_process)
{
    char line[128];
    int rfd, job = 0, wd = 0;
    pid_t child = wd_child_start(3000, "wd-dead", &rfd);

    ck_assert_int_eq(read_line(rfd, line, sizeof(line), 10000), 0);
    ck_assert_int_eq(sscanf(line, "S %d %d", &job, &wd), 2);
    ck_assert_int_gt(job, 0);
    ck_assert_int_gt(wd, 0);
    ck_assert(!pid_dead(job));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    long ms = wait_dead(job, 5000);
    ck_assert_msg(ms >= 0, "the job outlived its dead loop by 5 s");
    ck_assert_msg(wait_dead(wd, 5000) >= 0, "the watchdog did not exit");
    fprintf(stderr, "watchdog: job dead %ld ms after kill -9 of its loop\n",
            ms);
    close(rfd);
}
END_TEST

/* SIGSTOP of the process that runs the loop: the watchdog kills the job
 * after watchdog_ms; after SIGCONT the loop reports it watchdog_killed. */
/* Reads the child's "D" line: its job was killed (SIGKILL) by the
 * watchdog after at least min_silence_ms; reaps the child; returns the
 * silence. */
static long long
read_watchdog_killed(pid_t child, int rfd, long long min_silence_ms)
{
    char line[128];
    int wk = -1, sig = 0;
    long long silence = 0;

    ck_assert_int_eq(read_line(rfd, line, sizeof(line), 10000), 0);
    ck_assert_int_eq(sscanf(line, "D %d %lld %d", &wk, &silence, &sig), 3);
    ck_assert_int_eq(wk, 1);
    ck_assert_int_ge(silence, min_silence_ms);
    ck_assert_int_eq(sig, SIGKILL);
    waitpid(child, NULL, 0);
    return silence;
}

START_TEST(watchdog_kills_jobs_of_a_stopped_process)
{
    char line[128];
    int rfd, job = 0, wd = 0;
    long long silence = 0;
    pid_t child = wd_child_start(1500, "wd-stop", &rfd);

    ck_assert_int_eq(read_line(rfd, line, sizeof(line), 10000), 0);
    ck_assert_int_eq(sscanf(line, "S %d %d", &job, &wd), 2);
    kill(child, SIGSTOP);
    long ms = wait_dead(job, 5000);
    ck_assert_msg(ms >= 0, "the job of a stopped loop still runs after 5 s");
    kill(child, SIGCONT);
    silence = read_watchdog_killed(child, rfd, 1500);
    ck_assert(wait_dead(wd, 5000) >= 0);
    fprintf(stderr,
            "watchdog: job of a stopped loop dead after %ld ms "
            "(silence %lld ms)\n",
            ms, silence);
    close(rfd);
}
END_TEST

/* 1 once pid runs `sleep` (its execve is done), within timeout_ms. */
static int
wait_execed(pid_t pid, long timeout_ms)
{
    char path[64], exe[PATH_MAX];

    snprintf(path, sizeof(path), "/proc/%d/exe", (int)pid);
    for (long t = 0; t <= timeout_ms; t += 5) {
        ssize_t n = readlink(path, exe, sizeof(exe) - 1);
        if (n > 0) {
            exe[n] = '\0';
            const char *b = strrchr(exe, '/');
            if (b && !strcmp(b + 1, "sleep"))
                return 1;
        }
        sleep_ms(5);
    }
    return 0;
}

/*
 * The window between the clone and the loop's next step: the loop thread
 * is held (ptrace) in its clone of the job (CLONE_VFORK) until the job's
 * command runs, then its process is stopped (stop) or killed. The job must
 * still die: its child registered itself with the watchdog before its
 * execve. Before that fix the loop registered the job only after the clone
 * returned, and test_agent's stopped agent saw `sleep 30` outlive it.
 */
/* waitpid(pid, __WALL) for up to timeout_ms: pid, or -1. */
static pid_t
wait_traced(pid_t pid, int *st, long timeout_ms)
{
    for (long t = 0; t <= timeout_ms; t += 5) {
        pid_t r = waitpid(pid, st, __WALL | WNOHANG);
        if (r != 0)
            return r;
        sleep_ms(5);
    }
    return -1;
}

static void
job_held_in_the_clone(bool stop)
{
    char line[128];
    int rfd, gofd, tid = 0, wd = 0, st, jpid = 0;
    unsigned long msg = 0;

    /* Without clone3 (a seccomp filter), jobs start through posix_spawn,
     * whose child cannot register itself: the guarantee is not made. */
    if (syscall(SYS_clone3, NULL, 0) == -1 && errno == ENOSYS) {
        fprintf(stderr, "watchdog: no clone3 here: clone window not tested\n");
        return;
    }
    pid_t child = wd_child_start_held(1500, stop ? "wd-clone-stop"
                                                 : "wd-clone-kill",
                                      &rfd, &gofd);

    ck_assert_int_eq(read_line(rfd, line, sizeof(line), 10000), 0);
    ck_assert_int_eq(sscanf(line, "R %d %d", &tid, &wd), 2);
    ck_assert_int_gt(tid, 0);
    ck_assert_int_gt(wd, 0);
    if (ptrace(PTRACE_SEIZE, tid, NULL, (void *)(long)PTRACE_O_TRACEVFORK) ==
            -1 &&
        errno == EPERM) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        fprintf(stderr, "watchdog: ptrace refused: clone window not tested\n");
        return;
    }
    ck_assert_int_eq(write(gofd, "g", 1), 1);
    /* The loop thread stops in its clone of the job. */
    ck_assert_int_eq(wait_traced(tid, &st, 10000), tid);
    ck_assert(WIFSTOPPED(st));
    ck_assert_int_eq(st >> 8, SIGTRAP | (PTRACE_EVENT_VFORK << 8));
    ck_assert_int_eq(ptrace(PTRACE_GETEVENTMSG, tid, NULL, &msg), 0);
    pid_t job = (pid_t)msg;
    /* The job's child (traced from its start) goes on to its execve. */
    ck_assert_int_eq(wait_traced(job, &st, 10000), job);
    ck_assert_int_eq(ptrace(PTRACE_DETACH, job, NULL, NULL), 0);
    ck_assert_msg(wait_execed(job, 5000), "the job's child did not exec");
    if (stop) {
        /* Stopped before its clone returns: the thread joins the stop as
         * soon as it is let go. */
        kill(child, SIGSTOP);
        ck_assert_int_eq(ptrace(PTRACE_DETACH, tid, NULL, NULL), 0);
    } else {
        kill(child, SIGKILL);
        waitpid(tid, NULL, __WALL); /* the traced thread's end */
        waitpid(child, NULL, 0);
    }
    long ms = wait_dead(job, 10000);
    if (ms < 0) {
        kill(job, SIGKILL);
        kill(child, SIGKILL);
    }
    ck_assert_msg(ms >= 0, "the job outlived its %s loop by 10 s",
                  stop ? "stopped" : "killed");
    fprintf(stderr, "watchdog: job of a loop %s in its clone dead after %ld ms\n",
            stop ? "stopped" : "killed", ms);
    if (stop) {
        kill(child, SIGCONT);
        ck_assert_int_eq(read_line(rfd, line, sizeof(line), 10000), 0);
        ck_assert_int_eq(sscanf(line, "S %d %d", &jpid, &wd), 2);
        ck_assert_int_eq(jpid, job);
        read_watchdog_killed(child, rfd, 1500);
    }
    ck_assert(wait_dead(wd, 5000) >= 0);
    close(rfd);
    close(gofd);
}

START_TEST(watchdog_kills_a_job_whose_loop_stopped_in_its_clone)
{
    job_held_in_the_clone(true);
}
END_TEST

START_TEST(watchdog_kills_a_job_whose_loop_died_in_its_clone)
{
    job_held_in_the_clone(false);
}
END_TEST

/* The watchdog holds nothing of the agent (fds, environment), leads its
 * own session, is replaced when it dies, and exits with its loop. */
START_TEST(watchdog_is_isolated_replaced_and_reaped)
{
    struct exec_loop_opts o = {.max_concurrent = 1, .watchdog_ms = 3000};
    struct exec_loop *loop = NULL;
    pid_t wd = 0, wd2 = 0;
    char path[64];
    DIR *d;
    struct dirent *de;
    int fds = 0;

    setenv("KSCORE_TEST_SECRET", "s3cret", 1);
    ck_assert_int_eq(exec_loop_start(&o, &loop), 0);
    for (int i = 0; i < 100 && !(wd = exec_loop_watchdog_pid(loop)); i++)
        sleep_ms(20);
    ck_assert_int_gt(wd, 0);
    sleep_ms(200); /* past its exec */
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)wd);
    d = opendir(path);
    ck_assert_ptr_nonnull(d);
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') {
            ck_assert_int_le(atoi(de->d_name), 3);
            fds++;
        }
    closedir(d);
    ck_assert_int_eq(fds, 4); /* stdin, stdout (/dev/null), stderr, socket */
    snprintf(path, sizeof(path), "%d", (int)wd);
    ck_assert(!environ_has(path, "KSCORE_TEST_SECRET=s3cret"));
    ck_assert_int_eq(getsid(wd), wd);
    ck_assert_int_ne(getpgid(wd), getpgid(0));

    kill(wd, SIGKILL);
    for (int i = 0; i < 150; i++) {
        wd2 = exec_loop_watchdog_pid(loop);
        if (wd2 && wd2 != wd)
            break;
        sleep_ms(20);
    }
    ck_assert_int_gt(wd2, 0);
    ck_assert_int_ne(wd2, wd);
    exec_loop_free(loop);
    ck_assert(pid_dead(wd2));
}
END_TEST

/* ---- the stack
 * ----------------------------------------------------------------- */

static struct fixture_stack stack;
static char side_dir[PATH_MAX];
/* The tmpfs of state_dir_full_refuses_claims (<stack dir>/fullfs),
 * unmounted by stack_down too, for a test that failed before it did. */
static char full_mnt[PATH_MAX];

static void
stack_up(void)
{
    if (fixture_stack_start(&stack, NULL, 0) != 0) {
        fixture_stack_stop(&stack);
        exit(1);
    }
    snprintf(full_mnt, sizeof(full_mnt), "%.4000s/fullfs", stack.dir);
    snprintf(side_dir, sizeof(side_dir), "%.4000s/side", stack.dir);
    mkdir(side_dir, 0777);
}

static void
stack_down(void)
{
    /* A test that failed with its tmpfs mounted (the test ran in a child
     * process: this one cannot know, so it tries): the stack's directory
     * cannot go while it is. */
    stack_stop(stack.dir, "agent-full", 20000);
    umount2(full_mnt, MNT_DETACH); /* EINVAL when not mounted */
    fixture_stack_stop(&stack);
}

static struct evt_conn *
client(void)
{
    return fixture_client(&stack);
}

/* Submits a detached `sh -c script`; 0 with id_out, or the error. */
static int
submit(struct evt_conn *c, const char *agent, const char *script,
       char id_out[37])
{
    return fixture_submit(c, agent, script, 120000, 0, id_out);
}

static PGconn *
db(void)
{
    PGconn *pg = PQconnectdb(stack.pg.conninfo);
    ck_assert_int_eq(PQstatus(pg), CONNECTION_OK);
    return pg;
}

static long
sql_long(PGconn *pg, const char *fmt, ...)
{
    char sql[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sql, sizeof(sql), fmt, ap);
    va_end(ap);
    return fixture_pg_long(pg, sql);
}

/* The projection's status of a command ("" if none), into buf. */
static const char *
status_of(PGconn *pg, const char *id, char *buf, size_t len)
{
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT status FROM commands WHERE command_id = '%s'", id);
    PGresult *r = PQexec(pg, sql);
    snprintf(buf, len, "%s", PQntuples(r) ? PQgetvalue(r, 0, 0) : "");
    PQclear(r);
    return buf;
}

static int
wait_status(PGconn *pg, const char *id, const char *want, int timeout_ms)
{
    char st[32];
    for (int t = 0; t <= timeout_ms; t += 100) {
        if (!strcmp(status_of(pg, id, st, sizeof(st)), want))
            return 0;
        sleep_ms(100);
    }
    return -1;
}

/* Lines in the side-effect file of one command: how often it ran. */
static int
runs_of(const char *id)
{
    char path[PATH_MAX + 80], line[64];
    int n = 0;
    snprintf(path, sizeof(path), "%s/%s", side_dir, id);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        n++;
    fclose(f);
    return n;
}

static pid_t
agent_pid(const char *name)
{
    pid_t pid = 0;
    ck_assert(stack_pidfile_alive(stack.dir, name, &pid));
    return pid;
}

static void
agent_kill9(const char *name)
{
    pid_t pid = agent_pid(name);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0); /* ECHILD for a daemon: then poll */
    ck_assert(wait_dead(pid, 5000) >= 0);
}

/*
 * The events of a command through `kscore events ID --json`: 1 if one has
 * type `type`, a reason containing `reason_part` (NULL: any) and, when
 * `status` is set, that result status.
 */
static int
has_event(const char *id, const char *type, const char *reason_part,
          const char *status)
{
    const char *args[] = {"events", id, "--json", NULL};
    struct fixture_out o;
    int found = 0;

    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    for (char *line = strtok(o.out, "\n"); line && !found;
         line = strtok(NULL, "\n")) {
        json_t *j = json_loads(line, 0, NULL);
        const char *t = json_string_value(json_object_get(j, "type"));
        const char *r = json_string_value(json_object_get(j, "reason"));
        const char *s = json_string_value(
            json_object_get(json_object_get(j, "result"), "status"));
        found = t && !strcmp(t, type) &&
                (!reason_part || (r && strstr(r, reason_part))) &&
                (!status || (s && !strcmp(s, status)));
        json_decref(j);
    }
    fixture_out_release(&o);
    return found;
}

static void
print_events(const char *id)
{
    const char *args[] = {"events", id, NULL};
    struct fixture_out o;
    if (fixture_kscore(&stack, args, &o) == 0)
        fprintf(stderr, "events of %s:\n%s", id, o.out);
    fixture_out_release(&o);
}

/* Copies a file (a daemon's log) to stderr, for a failure's diagnosis. */
static void
print_file(const char *path)
{
    char buf[4096];
    size_t n;
    FILE *f = fopen(path, "r");

    if (!f)
        return;
    fprintf(stderr, "--- %s:\n", path);
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0)
        fwrite(buf, 1, n, stderr);
    fclose(f);
}

/* Waits for the command's single process; returns its pid. */
static pid_t
wait_running(PGconn *pg, const char *id)
{
    pid_t pid = 0;
    ck_assert_int_eq(wait_status(pg, id, "Running", 10000), 0);
    for (int i = 0; i < 100 && command_procs(id, &pid) == 0; i++)
        sleep_ms(50);
    ck_assert_int_gt(pid, 0);
    return pid;
}

/*
 * Item 4: 20 sleeps to an agent with --max-concurrent 8. At most 8 run or
 * are claimed at once; the other 12 wait in JetStream, unclaimed. kill -9
 * and a restart: the 8 that ran end Lost, the 12 run after the restart,
 * none twice, every one terminal.
 */
START_TEST(claims_only_with_a_free_slot)
{
    enum { N = 20, SLOTS = 8 };
    const char *extra[] = {"--max-concurrent", "8", NULL};
    struct evt_conn *c = client();
    PGconn *pg = db();
    char ids[N][37], script[2 * PATH_MAX + 256];
    bool ran_before[N];
    int max_procs = 0, max_running = 0, procs;
    long running = 0;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-cap", "cap", extra), 0);
    /* The first wave sleeps until the kill (30 s), so it is surely the
     * one running when it comes, whatever the machine's load: with 3 s
     * for all, a loaded machine saw the first wave end before the kill,
     * the dead agent's second wave still dying when the new agent ran
     * its own, and counted 12 processes. After the restart, 1 s each. */
    char fast[PATH_MAX + 16];
    snprintf(fast, sizeof(fast), "%s/cap-fast", side_dir);
    unlink(fast);
    snprintf(script, sizeof(script),
             "echo run >> %s/$KSCORE_COMMAND_ID; if [ -e %s ]; then exec "
             "sleep 1; else exec sleep 30; fi",
             side_dir, fast);
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(submit(c, "cap", script, ids[i]), 0);

    /* Until the first wave runs: never more than 8 claimed. */
    for (int t = 0; t < 100 && running < SLOTS; t++) {
        running = sql_long(pg, "SELECT count(*) FROM commands WHERE "
                               "agent_id = 'cap' AND status = 'Running'");
        procs = procs_of_commands(ids, N);
        if (running > max_running)
            max_running = (int)running;
        if (procs > max_procs)
            max_procs = procs;
        sleep_ms(50);
    }
    ck_assert_int_eq(running, SLOTS);
    sleep_ms(300); /* would more be claimed? */
    running = sql_long(pg, "SELECT count(*) FROM commands WHERE agent_id = "
                           "'cap' AND status IN ('Running','Succeeded')");
    ck_assert_int_le(max_running, SLOTS);
    ck_assert_int_eq(running, SLOTS);
    /* The rest wait in JetStream: delivered to nobody, unclaimed. */
    jsConsumerInfo *ci = NULL;
    ck_assert_int_eq(js_GetConsumerInfo(&ci, c->js, EVT_STREAM_CMDS,
                                        "agent-cap", NULL, NULL),
                     NATS_OK);
    ck_assert_int_eq(ci->NumAckPending, SLOTS);
    ck_assert_int_eq(ci->NumPending, N - SLOTS);
    jsConsumerInfo_Destroy(ci);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM commands WHERE "
                                  "agent_id = 'cap' AND status = "
                                  "'Dispatched'"),
                     N - SLOTS);
    for (int i = 0; i < N; i++) {
        char st[32];
        ran_before[i] =
            !strcmp(status_of(pg, ids[i], st, sizeof(st)), "Running");
    }

    agent_kill9("agent-cap");
    int fd = open(fast, O_WRONLY | O_CREAT, 0644);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-cap", "cap", extra), 0);
    /* Until every command is terminal: the new agent never runs more than
     * 8 at once. The first wave's processes are the dead agent's (its
     * watchdog kills them; a loaded machine may take a moment), so they
     * are counted apart: they must be gone by the end. */
    char rest[N][37];
    int n_rest = 0, old_procs = 0;
    for (int i = 0; i < N; i++)
        if (!ran_before[i])
            memcpy(rest[n_rest++], ids[i], 37);
    long open = -1;
    for (int t = 0; t < 600 && open != 0; t++) {
        procs = procs_of_commands(rest, n_rest);
        if (procs > max_procs)
            max_procs = procs;
        if (procs > SLOTS && getenv("KS_DEBUG_CAP")) {
            for (int k = 0; k < n_rest; k++) {
                char st[32];
                pid_t fp = 0;
                int np = command_procs(rest[k], &fp);
                fprintf(stderr, "DEBUG %s %s procs=%d pid=%d\n", rest[k],
                        status_of(pg, rest[k], st, sizeof(st)), np, (int)fp);
            }
        }
        open = sql_long(pg, "SELECT count(*) FROM commands WHERE agent_id = "
                            "'cap' AND status IN ('Pending','Dispatched',"
                            "'Running')");
        sleep_ms(50);
    }
    ck_assert_int_eq(open, 0);
    ck_assert_int_le(max_procs, SLOTS);
    old_procs = procs_of_commands(ids, N);
    ck_assert_msg(old_procs == 0, "%d processes of ended commands left",
                  old_procs);
    int lost = 0, succeeded = 0;
    for (int i = 0; i < N; i++) {
        char st[32];
        status_of(pg, ids[i], st, sizeof(st));
        ck_assert_int_le(runs_of(ids[i]), 1);
        if (ran_before[i]) {
            ck_assert_msg(!strcmp(st, "Lost"), "%s ran, then %s", ids[i], st);
            ck_assert_int_eq(runs_of(ids[i]), 1);
            lost++;
        } else {
            /* Run after the restart, once. */
            ck_assert_msg(!strcmp(st, "Succeeded"), "%s: %s", ids[i], st);
            ck_assert_int_eq(runs_of(ids[i]), 1);
            succeeded++;
        }
    }
    ck_assert_int_eq(lost, SLOTS);
    ck_assert_int_eq(succeeded, N - SLOTS);
    ck_assert_int_eq(sql_long(pg, "SELECT count(*) FROM (SELECT stream_id "
                                  "FROM events WHERE type = 'CommandStarted' "
                                  "GROUP BY stream_id "
                                  "HAVING count(*) > 1) x"),
                     0);
    fprintf(stderr,
            "capacity: at most %d running, %d processes; %d Lost, "
            "%d run after the restart\n",
            max_running, max_procs, lost, succeeded);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-cap", 20000);
}
END_TEST

/* One process serving two ids shares one pool of slots. */
START_TEST(slots_are_shared_by_the_ids_of_a_process)
{
    const char *extra[] = {"--id", "mid-b", "--max-concurrent", "2", NULL};
    struct evt_conn *c = client();
    PGconn *pg = db();
    char ids[6][37];
    int max_procs = 0;

    int64_t since = ks_now_us() - 1000000;
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-mid", "mid-a", extra),
                     0);
    /* The spawn waits for mid-a's heartbeat only; the process writes
     * mid-b's after it, and a command for mid-b before then is refused
     * as for an unknown agent (seen under load: KS_ENOAGENT). */
    ck_assert_int_eq(fixture_stack_wait_agent(&stack, "mid-b", since, 30000),
                     0);
    /* Each command waits at a gate of its own, which the test opens
     * once both slots are seen full: a command the record says Running
     * whose gate is closed surely runs. It was `exec sleep 1` and "a
     * third Running for 200 ms is the record's lag": a loaded machine
     * can lag more than that. */
    struct fixture_gate gate[6];
    bool released[6] = {false};
    int n_released = 0;
    for (int i = 0; i < 6; i++) {
        char name[16], sh[sizeof(gate[0].sh) + PATH_MAX + 64];
        snprintf(name, sizeof(name), "mid%d", i);
        fixture_gate_init(&gate[i], side_dir, name);
        snprintf(sh, sizeof(sh), "echo run >> %s/$KSCORE_COMMAND_ID; %s",
                 side_dir, gate[i].sh);
        ck_assert_int_eq(submit(c, i % 2 ? "mid-b" : "mid-a", sh, ids[i]),
                         0);
    }
    long open = -1;
    for (int t = 0; t < 1200 && open != 0; t++) {
        int n = commands_with_procs(ids, 6);
        if (n > max_procs)
            max_procs = n;
        /* Held and recorded Running: they run now. */
        int held = 0, oldest = -1;
        for (int i = 0; i < 6; i++) {
            char st[32];
            if (!released[i] &&
                !strcmp(status_of(pg, ids[i], st, sizeof(st)), "Running")) {
                held++;
                if (oldest < 0)
                    oldest = i;
            }
        }
        ck_assert_msg(held <= 2, "%d commands run at once on 2 slots",
                      held);
        if (held > 0 && held == (6 - n_released < 2 ? 6 - n_released : 2)) {
            /* Both slots full (or the last one): would a third be
             * claimed? Then the oldest goes on. */
            sleep_ms(300);
            held = 0;
            for (int i = 0; i < 6; i++) {
                char st[32];
                held += !released[i] &&
                        !strcmp(status_of(pg, ids[i], st, sizeof(st)),
                                "Running");
            }
            ck_assert_msg(held <= 2, "%d commands run at once on 2 slots",
                          held);
            fixture_gate_open(&gate[oldest]);
            released[oldest] = true;
            n_released++;
        }
        open = sql_long(pg, "SELECT count(*) FROM commands WHERE agent_id "
                            "LIKE 'mid-%%' AND status IN ('Pending',"
                            "'Dispatched','Running')");
        sleep_ms(50);
    }
    ck_assert_int_eq(open, 0);
    ck_assert_int_eq(n_released, 6);
    ck_assert_int_le(max_procs, 2);
    for (int i = 0; i < 6; i++) {
        char st[32];
        ck_assert_str_eq(status_of(pg, ids[i], st, sizeof(st)), "Succeeded");
        ck_assert_int_eq(runs_of(ids[i]), 1);
    }
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-mid", 20000);
}
END_TEST

/* Item 5: kill -9 of the agent during `sleep 30`: the sleep is gone within
 * 5 s, with no restart; a restart then reports it Lost. */
START_TEST(children_die_with_their_agent)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37], wd_entry[64];
    pid_t child, apid;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-k9", "k9", NULL), 0);
    ck_assert_int_eq(submit(c, "k9", "exec sleep 30", id), 0);
    child = wait_running(pg, id);
    apid = agent_pid("agent-k9");
    snprintf(wd_entry, sizeof(wd_entry), "KSCORE_EXEC_WATCHDOG=3:%d:%d",
             (int)apid, AGENT_WATCHDOG_MS);
    int watchdogs = procs_with_env(wd_entry, NULL);
    agent_kill9("agent-k9");
    /* The watchdog sees its agent die at once (its pipe's end); the time
     * is printed, and the bound is only for a command left running. */
    long ms = wait_dead(child, 30000);
    ck_assert_msg(ms >= 0, "the command outlived its agent by 30 s");
    ck_assert_int_eq(command_procs(id, NULL), 0);
    /* The agent had its watchdog, and it is gone with its work done. */
    ck_assert_int_eq(watchdogs, 1);
    for (int i = 0; i < 50 && procs_with_env(wd_entry, NULL); i++)
        sleep_ms(100);
    ck_assert_int_eq(procs_with_env(wd_entry, NULL), 0);
    fprintf(stderr, "kill -9: the command died %ld ms after its agent\n", ms);

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-k9", "k9", NULL), 0);
    ck_assert_int_eq(wait_status(pg, id, "Lost", 10000), 0);
    ck_assert(has_event(id, "CommandLost", "watchdog", "Lost"));
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-k9", 20000);
}
END_TEST

/* Items 3a and 5: SIGSTOP of the agent: its child is gone within 5 s; after
 * SIGCONT the agent reports it Lost, killed by its watchdog. */
START_TEST(stopped_agent_watchdog_kills_and_reports_lost)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37];
    pid_t child, apid;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-stp", "stp", NULL), 0);
    ck_assert_int_eq(submit(c, "stp", "exec sleep 30", id), 0);
    child = wait_running(pg, id);
    apid = agent_pid("agent-stp");
    kill(apid, SIGSTOP);
    /* Killed while the agent is still stopped, so by its watchdog (the
     * stopped agent can do nothing). How soon (AGENT_WATCHDOG_MS) is
     * printed, not asserted: a loaded machine schedules the watchdog late
     * (issue 22: 1 soak run in 9 missed a 5 s bound at a load of 15). */
    long ms = wait_dead(child, 60000);
    kill(apid, SIGCONT);
    fprintf(stderr, "SIGSTOP: the command died %ld ms after its agent stopped\n",
            ms);
    ck_assert_msg(ms >= 0, "the command of a stopped agent still runs");
    ck_assert_int_eq(wait_status(pg, id, "Lost", 15000), 0);
    if (!has_event(id, "CommandLost", "killed by the agent's watchdog",
                   "Lost")) {
        char log[PATH_MAX + 32];
        print_events(id);
        snprintf(log, sizeof(log), "%s/agent-stp.log", stack.dir);
        print_file(log);
    }
    ck_assert(
        has_event(id, "CommandLost", "killed by the agent's watchdog", "Lost"));
    ck_assert(!has_event(id, "CommandCompleted", NULL, NULL));
    /* The agent goes on working. */
    ck_assert_int_eq(submit(c, "stp", "true", id), 0);
    ck_assert_int_eq(wait_status(pg, id, "Succeeded", 15000), 0);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-stp", 20000);
}
END_TEST

/* Item 3b: NATS goes away for longer than the fence: the agent kills its
 * command itself and, once NATS is back, reports it Lost and why. */
START_TEST(self_fence_when_nats_is_gone)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37];
    pid_t child;
    const char *colon = strrchr(stack.nats.url, ':');
    int port = colon ? atoi(colon + 1) : 0;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-fen", "fen", NULL), 0);
    ck_assert_int_eq(submit(c, "fen", "exec sleep 30", id), 0);
    child = wait_running(pg, id);
    evt_close(c);
    int64_t t0 = ks_mono_us();
    ck_assert_int_eq(stack_nats_stop(stack.nats.dir), 0);
    long ms = wait_dead(child, AGENT_FENCE_MS + 5000);
    int64_t dead_after_us = ks_mono_us() - t0;
    /* Back on the same port and store. */
    char *url = NULL;
    pid_t npid;
    ck_assert_int_eq(stack_nats_start(stack.nats.dir, port, NULL, &url, &npid),
                     0);
    free(stack.nats.url);
    stack.nats.url = url;
    stack.nats.pid = npid;
    ck_assert_msg(ms >= 0, "the command outlived the fence");
    /* Not before the fence (counted from the last heartbeat, which may
     * be up to EVT_HEARTBEAT_MS older than the outage). */
    ck_assert_int_ge(dead_after_us,
                     (int64_t)(AGENT_FENCE_MS - EVT_HEARTBEAT_MS - 500) * 1000);
    ck_assert_int_eq(wait_status(pg, id, "Lost", 30000), 0);
    if (!has_event(id, "CommandLost", "self-fence", "Lost"))
        print_events(id);
    ck_assert(has_event(id, "CommandLost", "agent lost contact with NATS for",
                        "Lost"));
    ck_assert(has_event(id, "CommandLost", "(self-fence)", "Lost"));
    fprintf(stderr, "self-fence: the command died %.1f s after NATS\n",
            (double)dead_after_us / 1e6);
    /* The agent works again. */
    c = client();
    ck_assert_int_eq(submit(c, "fen", "true", id), 0);
    if (wait_status(pg, id, "Succeeded", 20000) != 0) {
        jsConsumerInfo *ci = NULL;
        print_events(id);
        if (js_GetConsumerInfo(&ci, c->js, EVT_STREAM_CMDS, "agent-fen", NULL,
                               NULL) == NATS_OK) {
            fprintf(stderr,
                    "agent-fen: ack pending %lld, pending %llu, "
                    "redelivered %lld\n",
                    (long long)ci->NumAckPending,
                    (unsigned long long)ci->NumPending,
                    (long long)ci->NumRedelivered);
            jsConsumerInfo_Destroy(ci);
        }
        ck_abort_msg("the agent does not work after the outage");
    }
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-fen", 20000);
}
END_TEST

/* A connection of its own that holds the row lock of a command's stream
 * (streams FOR UPDATE): a claim of it blocks in the broker until
 * unlock_stream. */
static PGconn *
lock_stream(const char *id)
{
    PGconn *pg = db();
    char sql[256];
    PQclear(PQexec(pg, "BEGIN"));
    snprintf(sql, sizeof(sql),
             "SELECT version FROM streams WHERE stream_id = 'command-%s' "
             "FOR UPDATE",
             id);
    PGresult *r = PQexec(pg, sql);
    ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    ck_assert_int_eq(PQntuples(r), 1);
    PQclear(r);
    return pg;
}

static void
unlock_stream(PGconn *pg)
{
    PQclear(PQexec(pg, "COMMIT"));
    PQfinish(pg);
}

/* A command to agent `agent` that waits until <side>/<go> exists; its id
 * once it runs. */
static void
blocker(struct evt_conn *c, PGconn *pg, const char *agent, const char *go,
        char id[37])
{
    char script[PATH_MAX + 128];
    snprintf(script, sizeof(script),
             "while [ ! -e %s/%s ]; do sleep 0.05; done", side_dir, go);
    ck_assert_int_eq(fixture_submit(c, agent, script, 120000, 120000, id), 0);
    ck_assert_int_eq(wait_status(pg, id, "Running", 15000), 0);
}

static void
touch_side(const char *name)
{
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/%s", side_dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    ck_assert_int_ge(fd, 0);
    close(fd);
}

static long
events_of_type(PGconn *pg, const char *id, const char *type)
{
    return sql_long(pg,
                    "SELECT count(*) FROM events WHERE stream_id = "
                    "'command-%s' AND type = '%s'",
                    id, type);
}

/*
 * A claim held up in PostgreSQL: agent `agent` (daemon `name`, one slot,
 * extra arguments after --max-concurrent 1) runs a blocker, a second
 * command (`echo run >> <side>/$KSCORE_COMMAND_ID`) waits for the slot,
 * its stream is locked (lock_stream), and the blocker let go: the second
 * command's claim goes out and waits in the broker until unlock_stream.
 * Its id into target; returns the lock.
 */
static PGconn *
claim_held_up(struct evt_conn *c, PGconn *pg, const char *name,
              const char *agent, char target[37])
{
    const char *extra[] = {"--max-concurrent", "1", NULL};
    char first[37], go[64], script[PATH_MAX + 64];

    snprintf(go, sizeof(go), "go-%s", agent);
    ck_assert_int_eq(fixture_agent_spawn(&stack, name, agent, extra), 0);
    blocker(c, pg, agent, go, first);
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side_dir);
    ck_assert_int_eq(
        fixture_submit(c, agent, script, 120000, 120000, target), 0);
    ck_assert_int_eq(wait_status(pg, target, "Dispatched", 5000), 0);
    PGconn *lock = lock_stream(target);
    touch_side(go); /* the slot passes on: the claim goes out */
    ck_assert_int_eq(wait_status(pg, first, "Succeeded", 15000), 0);
    return lock;
}

/* Command id ended Succeeded (within timeout_ms), ran once, claimed once. */
static void
assert_ran_once(PGconn *pg, const char *id, int timeout_ms)
{
    char st[32];
    if (wait_status(pg, id, "Succeeded", timeout_ms) != 0)
        print_events(id);
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Succeeded");
    ck_assert_int_eq(runs_of(id), 1);
    ck_assert_int_eq(events_of_type(pg, id, "CommandStarted"), 1);
}


/* As agent `agent` (its identity, no process): claims command id at
 * version 2 (Requested, Dispatched) with claim_id; asserts it is granted. */
static void
claim_as(struct evt_conn *c, const char *agent, const char *id,
         const char *claim_id)
{
    Ks__ClaimRequest req = KS__CLAIM_REQUEST__INIT;
    natsMsg *m = NULL;
    ProtobufCMessage *pm = NULL;
    char who[96];

    req.command_id = (char *)id;
    req.attempt = 1;
    req.agent_id = (char *)agent;
    req.event_id = (char *)claim_id;
    req.expected_version = 2;
    /* The broker takes the claimer from the subject. */
    snprintf(who, sizeof(who), "agent-%s", agent);
    ck_assert_int_eq(
        evt_request_as(c, who, EVT_API_CLAIM, &req.base, 5000, &m), 0);
    ck_assert_int_eq(evt_unpack(&ks__claim_reply__descriptor,
                                natsMsg_GetData(m),
                                (size_t)natsMsg_GetDataLength(m), &pm),
                     0);
    ck_assert_msg(((Ks__ClaimReply *)pm)->granted, "claim: %d %s",
                  ((Ks__ClaimReply *)pm)->error_code,
                  ((Ks__ClaimReply *)pm)->error);
    protobuf_c_message_free_unpacked(pm, NULL);
    natsMsg_Destroy(m);
}

/*
 * Item 4 and issue 22: a command claimed but never spawned, found in the
 * journal by the restarted agent. The crash window (between the claim and
 * the spawn, a millisecond) is made wide here: the test claims the
 * commands as agent "ns" would, and leaves the journal entries "ns" would
 * have left. The claim id is in the journal, so the restarted agent
 * claims with it again when JetStream delivers the message again: the
 * claim that won is its own, and the command runs, once (before, it was
 * reported NotStarted and never ran). An entry whose claim id cannot be
 * read (a damaged file) still ends NotStarted, and never runs.
 */
START_TEST(claimed_never_spawned_runs_once_after_restart)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    Ks__AgentInfo info = KS__AGENT_INFO__INIT;
    char id[37], id2[37], claim_id[37], claim2[37], script[PATH_MAX + 64],
        path[PATH_MAX + 128], path2[PATH_MAX + 128];

    /* Known to the broker, but no agent process yet. */
    info.agent_id = "ns";
    info.version = "test";
    info.host = "test";
    info.heartbeat_at_us = ks_now_us();
    ck_assert_int_eq(evt_agent_put(c, NULL, &info, 5000), 0);
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side_dir);
    /* Refused as for an unknown agent (nothing recorded) until the
     * broker has read that entry: asked again until then (it was a fixed
     * 300 ms, which a loaded machine can overrun). */
    int rc;
    for (int i = 0; (rc = submit(c, "ns", script, id)) == KS_ENOAGENT &&
                    i < 100;
         i++)
        sleep_ms(100);
    ck_assert_int_eq(rc, 0);
    ck_assert_int_eq(submit(c, "ns", script, id2), 0);
    ck_assert_int_eq(wait_status(pg, id, "Dispatched", 5000), 0);
    ck_assert_int_eq(wait_status(pg, id2, "Dispatched", 5000), 0);
    ks_uuid(claim_id);
    ks_uuid(claim2);
    claim_as(c, "ns", id, claim_id);
    claim_as(c, "ns", id2, claim2);
    ck_assert_int_eq(wait_status(pg, id, "Running", 5000), 0);
    ck_assert_int_eq(wait_status(pg, id2, "Running", 5000), 0);

    snprintf(path, sizeof(path), "%s/state-agent-ns", stack.dir);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/state-agent-ns/running", stack.dir);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/state-agent-ns/running/%s", stack.dir, id);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    /* As the agent writes it (agent_int.h: the "pending" room of the
     * spawn line is JOURNAL_SPAWN_FIELD, 24, wide). */
    fprintf(f, "ns 1 - -\nclaim %s\n%-24s\n", claim_id, "pending");
    fclose(f);
    snprintf(path2, sizeof(path2), "%s/state-agent-ns/running/%s", stack.dir,
             id2);
    f = fopen(path2, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "ns 1 - -\nclaim %.8s\n", claim2); /* damaged */
    fclose(f);

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-ns", "ns", NULL), 0);
    assert_ran_once(pg, id, 20000);
    ck_assert(!has_event(id, "CommandNotStarted", NULL, NULL));
    ck_assert(!has_event(id, "DuplicateSuppressed", NULL, NULL));

    int found = 0;
    for (int i = 0; i < 100 && !found; i++) {
        found = has_event(id2, "CommandNotStarted", "never ran", "NotStarted");
        if (!found)
            sleep_ms(100);
    }
    if (!found)
        print_events(id2);
    ck_assert(found);
    ck_assert(!has_event(id2, "CommandLost", NULL, NULL));
    /* `kscore events --follow` stops at this end as at any other (it
     * followed a NotStarted command forever). */
    {
        const char *args[] = {"events", "--follow", id2, NULL};
        struct fixture_proc p;
        ck_assert_int_eq(fixture_kscore_spawn(&stack, args, false, &p), 0);
        int st = fixture_proc_wait(&p, 0, 20000);
        ck_assert_msg(st == 0 && strstr(p.out, "CommandNotStarted"),
                      "events --follow: exit %d: %s", st, p.out);
        fixture_proc_release(&p);
    }
    {
        const char *args[] = {"get", id2, "--json", NULL};
        struct fixture_out o;
        int ok = 0;
        for (int i = 0; i < 50 && !ok; i++) {
            ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
            json_t *j = json_loads(o.out, JSON_DISABLE_EOF_CHECK, NULL);
            const char *s2 = json_string_value(json_object_get(j, "status"));
            ok = s2 && !strcmp(s2, "NotStarted");
            ck_assert_msg(s2 && (ok || !strcmp(s2, "Running")),
                          "kscore get: %s", o.out);
            json_decref(j);
            fixture_out_release(&o);
            if (!ok)
                sleep_ms(100);
        }
        ck_assert(ok);
    }
    /* Its message, still in JetStream, reaches the agent: the claim fence
     * refuses it, and it never runs. */
    for (int i = 0;
         i < 100 && !has_event(id2, "DuplicateSuppressed", NULL, NULL); i++)
        sleep_ms(100);
    ck_assert(has_event(id2, "DuplicateSuppressed", NULL, NULL));
    sleep_ms(500);
    ck_assert_int_eq(runs_of(id2), 0);
    ck_assert_int_eq(access(path, F_OK), -1); /* the journal is done */
    ck_assert_int_eq(access(path2, F_OK), -1);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-ns", 20000);
}
END_TEST

/* Whether file path holds needle. */
static bool
file_has(const char *path, const char *needle)
{
    char buf[65536];
    FILE *f = fopen(path, "r");
    size_t n;
    if (!f)
        return false;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

/* `kscore agents --json` says id is duplicate. */
static bool
agents_say_duplicate(const char *id)
{
    const char *args[] = {"agents", "--json", NULL};
    struct fixture_out o;
    bool dup = false;

    if (fixture_kscore(&stack, args, &o) == 0)
        for (char *line = strtok(o.out, "\n"); line && !dup;
             line = strtok(NULL, "\n")) {
            json_t *j = json_loads(line, 0, NULL);
            const char *a = json_string_value(json_object_get(j, "agent_id"));
            dup = a && !strcmp(a, id) &&
                  json_is_true(json_object_get(j, "duplicate"));
            json_decref(j);
        }
    fixture_out_release(&o);
    return dup;
}

/* One id served by two agent processes (the same bundle on two hosts):
 * the broker says so once in its log and in `kscore agents`, refuses the
 * newer process's claims, which then stands aside (no deliveries) instead
 * of stopping for good; every command runs once. When the older one
 * stops, the newer one serves the id. */
START_TEST(two_processes_with_one_id_are_a_duplicate)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char ids[40][37], script[PATH_MAX + 128], log[PATH_MAX + 32],
        blog[PATH_MAX + 32];
    int n = 0;
    bool dup = false;

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-dupa", "dup", NULL),
                     0);
    sleep_ms(300); /* started later: the newer one */
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-dupb", "dup", NULL),
                     0);
    for (int i = 0; i < 150 && !(dup = agents_say_duplicate("dup")); i++)
        sleep_ms(100);
    ck_assert_msg(dup, "two processes serve 'dup', kscore agents does not "
                       "say duplicate");
    snprintf(blog, sizeof(blog), "%s/broker.log", stack.dir);
    ck_assert_msg(file_has(blog, "duplicate agent"), "see %s", blog);
    /* Commands until the newer one got one and was refused. */
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side_dir);
    snprintf(log, sizeof(log), "%s/agent-dupb.log", stack.dir);
    while (n < 39 && !file_has(log, "another agent process serves this id")) {
        ck_assert_int_eq(submit(c, "dup", script, ids[n]), 0);
        n++;
        sleep_ms(300);
    }
    ck_assert_msg(file_has(log, "another agent process serves this id"),
                  "see %s", log);
    ck_assert_msg(file_has(log, "stands aside"), "see %s", log);
    ck_assert_msg(stack_pidfile_alive(stack.dir, "agent-dupb", NULL),
                  "the newer process stopped (see %s)", log);
    ck_assert_msg(!file_has(log, "exit_code=78"), "see %s", log);
    ck_assert(stack_pidfile_alive(stack.dir, "agent-dupa", NULL));
    for (int i = 0; i < n; i++) {
        char st[32];
        ck_assert_int_eq(wait_status(pg, ids[i], "Succeeded", 20000), 0);
        ck_assert_str_eq(status_of(pg, ids[i], st, sizeof(st)), "Succeeded");
        ck_assert_int_eq(runs_of(ids[i]), 1);
    }
    fprintf(stderr, "duplicate: %d commands until the newer process was "
                    "refused\n", n);
    /* The older one goes: once the broker no longer hears it, the newer
     * one serves the id. */
    stack_stop(stack.dir, "agent-dupa", 20000);
    for (int i = 0; i < 300 && agents_say_duplicate("dup"); i++)
        sleep_ms(100);
    ck_assert_msg(!agents_say_duplicate("dup"), "still a duplicate");
    ck_assert_int_eq(submit(c, "dup", script, ids[n]), 0);
    ck_assert_int_eq(wait_status(pg, ids[n], "Succeeded", 30000), 0);
    ck_assert_int_eq(runs_of(ids[n]), 1);
    ck_assert(stack_pidfile_alive(stack.dir, "agent-dupb", NULL));
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-dupb", 20000);
}
END_TEST

/* ---- issue 25: the process state an agent inherits ---------------------- */

/* argv[1] of this binary that makes it a wrapper (see main): it ignores
 * SIGCHLD, blocks SIGTERM and SIGCHLD, and execs argv[2..], as
 * python3 -c 'signal.signal(SIGCHLD, SIG_IGN); os.execvp(...)' did. */
#define WRAP_IGNORING "--exec-ignoring-sigchld"

static const char *
kscore_bin(void)
{
    const char *b = getenv("KSCORE_BIN");
    ck_assert_msg(b && b[0], "KSCORE_BIN is not set (run through ctest)");
    return b;
}

/* `kscore agent --id id --state-dir state` as daemon `name` of the stack,
 * through the wrapper when wrap; waits for its heartbeat. */
static void
agent_daemon(const char *name, const char *id, const char *state, bool wrap)
{
    char self[PATH_MAX];
    const char *argv[16];
    size_t n = 0;
    int64_t since = ks_now_us();
    pid_t pid;

    if (wrap) {
        ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
        ck_assert_int_gt(len, 0);
        self[len] = '\0';
        argv[n++] = self;
        argv[n++] = WRAP_IGNORING;
    }
    argv[n++] = kscore_bin();
    argv[n++] = "agent";
    argv[n++] = "--id";
    argv[n++] = id;
    argv[n++] = "--nats";
    argv[n++] = stack.nats.url;
    argv[n++] = "--state-dir";
    argv[n++] = state;
    argv[n++] = "--trust-key";
    argv[n++] = stack.trust_key;
    argv[n] = NULL;
    ck_assert_int_eq(stack_daemon(stack.dir, name, (char *const *)argv, &pid),
                     0);
    ck_assert_msg(fixture_stack_wait_agent(&stack, id, since, 30000) == 0,
                  "agent %s did not heartbeat (see %s/%s.log)", id, stack.dir,
                  name);
}

/* The hex mask after "key:\t" in text (a /proc/<pid>/status), or ~0. */
static unsigned long long
status_mask(const char *text, const char *key)
{
    const char *p = strstr(text, key);
    return p ? strtoull(p + strlen(key) + 1, NULL, 16) : ~0ULL;
}

/*
 * Issue 25, item 1: an agent whose parent ignored SIGCHLD and blocked
 * SIGTERM. Before the fix `exit 3` never ended (the kernel reaped the
 * leader, the loop spun on its pidfd): this test failed at the first
 * wait_status. Now: exit 3 is Failed with exit code 3, a --timeout command
 * is TimedOut, the child starts with nothing blocked or ignored and a soft
 * NOFILE of 1024 (item 2), and the agent stops on SIGTERM.
 */
START_TEST(agent_started_with_sigchld_ignored)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char state[PATH_MAX + 32], id[37], st[32];
    struct rlimit rl;
    struct fixture_out o;

    snprintf(state, sizeof(state), "%s/state-sigign", stack.dir);
    agent_daemon("agent-sigign", "sigign", state, true);

    ck_assert_int_eq(submit(c, "sigign", "exit 3", id), 0);
    ck_assert_msg(wait_status(pg, id, "Failed", 60000) == 0,
                  "exit 3 did not end Failed: %s (see %s/agent-sigign.log)",
                  status_of(pg, id, st, sizeof(st)), stack.dir);
    ck_assert_int_eq(
        sql_long(pg, "SELECT exit_code FROM commands WHERE command_id = '%s'",
                 id),
        3);

    ck_assert_int_eq(
        fixture_submit(c, "sigign", "exec sleep 3041", 1000, 0, id), 0);
    ck_assert_msg(wait_status(pg, id, "TimedOut", 60000) == 0,
                  "a --timeout 1s command did not end TimedOut: %s",
                  status_of(pg, id, st, sizeof(st)));
    ck_assert_int_eq(command_procs(id, NULL), 0);

    const char *args[] = {
        "exec", "--agent", "sigign", "--", "sh", "-c",
        "ulimit -Sn; ulimit -Hn; exec grep -E '^Sig(Blk|Ign):' "
        "/proc/self/status",
        NULL};
    ck_assert_int_eq(fixture_kscore(&stack, args, &o), 0);
    ck_assert_msg(o.status == 0, "kscore exec: %d\n%s%s", o.status, o.out,
                  o.err);
    ck_assert_msg(status_mask(o.out, "SigBlk:") == 0,
                  "the child starts with signals blocked:\n%s", o.out);
    ck_assert_msg(status_mask(o.out, "SigIgn:") == 0,
                  "the child starts with signals ignored:\n%s", o.out);
    /* The agent has this test's limits (stack_daemon keeps them). */
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    char want[64];
    if (rl.rlim_max == RLIM_INFINITY)
        snprintf(want, sizeof(want), "1024\nunlimited\n");
    else
        snprintf(want, sizeof(want), "%llu\n%llu\n",
                 (unsigned long long)(rl.rlim_max > 1024 ? 1024
                                                         : rl.rlim_max),
                 (unsigned long long)rl.rlim_max);
    ck_assert_msg(!strncmp(o.out, want, strlen(want)),
                  "ulimit -Sn, -Hn in the child:\n%s\nwant:\n%s", o.out, want);
    fixture_out_release(&o);

    ck_assert_int_eq(stack_stop(stack.dir, "agent-sigign", 20000), 0);
    PQfinish(pg);
    evt_close(c);
}
END_TEST


/* Fills the file system of dir (a file "filler" in it) until ENOSPC. */
static void
fill_fs(const char *dir)
{
    char path[PATH_MAX + 16], buf[4096];
    int fd;

    memset(buf, 'x', sizeof(buf));
    snprintf(path, sizeof(path), "%s/filler", dir);
    fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    ck_assert_int_ge(fd, 0);
    while (write(fd, buf, sizeof(buf)) > 0)
        ;
    ck_assert_int_eq(errno, ENOSPC);
    close(fd);
}

static void
unfill_fs(const char *dir)
{
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/filler", dir);
    ck_assert_int_eq(unlink(path), 0);
}

/* Polls the log for needle for up to timeout_ms; 1 if found. */
static int
wait_log(const char *log, const char *needle, int timeout_ms)
{
    for (int t = 0; t <= timeout_ms; t += 100) {
        if (file_has(log, needle))
            return 1;
        sleep_ms(100);
    }
    return 0;
}

/*
 * Issue 25, item 3: the agent's state dir on a small tmpfs, filled up.
 * A claim the journal cannot hold is refused (the message goes back to
 * JetStream, the log says why) and runs once the space is back; a result
 * the outbox cannot hold (the tmpfs made read-only) is still published. Before the fix the write
 * errors were ignored: the command ran at once with nothing journaled, and
 * the log said nothing (this test failed at "cannot journal").
 */
START_TEST(state_dir_full_refuses_claims)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char state[PATH_MAX + 32], log[PATH_MAX + 32], id[37], id2[37], st[32],
        script[PATH_MAX + 128], go[PATH_MAX + 32];

    ck_assert_int_eq(mkdir(full_mnt, 0700), 0);
    if (mount("tmpfs", full_mnt, "tmpfs", MS_NOSUID | MS_NODEV,
              "size=256k,mode=0700") != 0) {
        fprintf(stderr, "state_dir_full_refuses_claims: skipped, cannot "
                        "mount a tmpfs (%s)\n",
                strerror(errno));
        return;
    }
    snprintf(state, sizeof(state), "%s/state", full_mnt);
    snprintf(log, sizeof(log), "%s/agent-full.log", stack.dir);
    agent_daemon("agent-full", "full", state, false);

    /* Full: the claim is refused, nothing runs. */
    fill_fs(full_mnt);
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side_dir);
    ck_assert_int_eq(submit(c, "full", script, id), 0);
    ck_assert_msg(wait_log(log, "cannot journal a claim", 30000),
                  "no refusal in %s", log);
    ck_assert_int_eq(runs_of(id), 0);
    status_of(pg, id, st, sizeof(st));
    ck_assert_msg(strcmp(st, "Running") && strcmp(st, "Succeeded"),
                  "claimed without a journal: %s", st);

    /* Space again: JetStream's redelivery (or the broker's re-dispatch)
     * runs it, once. */
    unfill_fs(full_mnt);
    ck_assert_msg(wait_status(pg, id, "Succeeded", 90000) == 0,
                  "not Succeeded once the space was back: %s",
                  status_of(pg, id, st, sizeof(st)));
    ck_assert_int_eq(runs_of(id), 1);

    /* Read-only while it runs: its result misses the outbox, and is
     * published all the same. (Not full: the spare files of the outbox,
     * agent__file_put, already hold the blocks a small event needs.) */
    snprintf(go, sizeof(go), "%s/go-full", side_dir);
    snprintf(script, sizeof(script),
             "while [ ! -e %s ]; do sleep 0.05; done; echo done", go);
    ck_assert_int_eq(submit(c, "full", script, id2), 0);
    wait_running(pg, id2);
    ck_assert_msg(mount("tmpfs", full_mnt, "tmpfs",
                        MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
                        "size=256k") == 0,
                  "remount read-only: %s", strerror(errno));
    int fd = open(go, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_msg(wait_status(pg, id2, "Succeeded", 60000) == 0,
                  "a result that missed the outbox was not published: %s",
                  status_of(pg, id2, st, sizeof(st)));
    ck_assert_msg(file_has(log, "cannot save an event in the outbox"),
                  "see %s", log);

    ck_assert_int_eq(stack_stop(stack.dir, "agent-full", 20000), 0);
    ck_assert_int_eq(umount2(full_mnt, MNT_DETACH), 0);
    PQfinish(pg);
    evt_close(c);
}
END_TEST

/*
 * Issue 22: a delivery the consumer counts as made that the agent never
 * gets. F03 (consumer_leader_changes: a command waited 10.1 s for its
 * claim across a consumer step-down): the consumer holds it unacked for
 * its whole ack wait (30 s) and goes on delivering the rest, so it is no
 * stall of the consumer's. F02 (publish_during_a_stream_leader_election,
 * after KSCORE_CMDS's leader moved): the consumer passed a message the
 * stream still held, nothing pending, nothing unacked, and delivered
 * everything after it. Before, only the scanner published either again,
 * at its attempt's deadline (a third of the 30 s delivery window: 10 s).
 * Here the test takes one delivery itself, as a second member of the id's
 * queue group, and either never acks it (held unacked: as a process of
 * the id that stops; the stream still holds it, as F02's) or acks it
 * (the work queue drops it: gone). Right: the broker's guard sees the
 * agent with free slots not listing it and at once makes the consumer
 * again while the stream holds the message (it delivers that same
 * message: one stream message, no second attempt), or publishes it again
 * as a new attempt once it is gone (said in the record); it runs once.
 */
static void
lost_delivery(const char *agent, bool ack)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char durable[128], deliver[192], stolen[37] = "", id[37], name[64];
    natsSubscription *thief = NULL;

    snprintf(name, sizeof(name), "agent-%s", agent);
    ck_assert_int_eq(fixture_agent_spawn(&stack, name, agent, NULL), 0);
    ck_assert_int_eq(submit(c, agent, "true", id), 0);
    ck_assert_int_eq(wait_status(pg, id, "Succeeded", 30000), 0);
    evt_agent_durable(durable, sizeof(durable), agent);
    evt_deliver_subject(deliver, sizeof(deliver), durable);
    struct evt_consumer_state before, after;
    ck_assert_int_eq(evt_consumer_state(c, EVT_STREAM_CMDS, durable, 5000,
                                        &before),
                     0);
    ck_assert_int_eq(natsConnection_QueueSubscribeSync(&thief, c->nc, deliver,
                                                       durable),
                     NATS_OK);
    ck_assert_int_eq(natsConnection_Flush(c->nc), NATS_OK);
    /* JetStream gives each message to one member of the group, at random:
     * one in two is the test's (40 misses in a row: 1 in 10^12). */
    for (int i = 0; i < 40 && !stolen[0]; i++) {
        ck_assert_int_eq(submit(c, agent, "true", id), 0);
        natsMsg *m = NULL;
        while (!stolen[0] &&
               natsSubscription_NextMsg(&m, thief, 1000) == NATS_OK) {
            const char *mid = NULL;
            /* "<command id>.<attempt>"; a status message has none */
            if (natsMsgHeader_Get(m, "Nats-Msg-Id", &mid) == NATS_OK &&
                mid && strlen(mid) > 36 && mid[36] == '.') {
                snprintf(stolen, sizeof(stolen), "%.36s", mid);
                if (ack) /* JetStream's ack: "+ACK" to its reply subject */
                    ck_assert_int_eq(
                        natsConnection_PublishString(
                            c->nc, natsMsg_GetReply(m), "+ACK"),
                        NATS_OK);
            }
            natsMsg_Destroy(m);
            m = NULL;
        }
    }
    natsSubscription_Unsubscribe(thief);
    natsSubscription_Destroy(thief);
    ck_assert_msg(stolen[0], "the agent took all 40 deliveries");
    ck_assert_int_eq(wait_status(pg, stolen, "Succeeded", 20000), 0);
    long wait_ms = sql_long(pg,
                            "SELECT (extract(epoch FROM started_at - "
                            "requested_at) * 1000)::bigint FROM commands "
                            "WHERE command_id = '%s'",
                            stolen);
    fprintf(stderr, "test_agent: the lost delivery of %s (%s) was claimed "
                    "%.1f s after its request\n", stolen,
            ack ? "acked by the thief" : "held unacked", (double)wait_ms / 1000);
    /* The scanner alone: 10 s. The guard: a suspect GUARD_WAITING_US (2 s)
     * after the dispatch, a look within a tick (0.5 s), a heartbeat put
     * GUARD_LIST_US after it (within a heartbeat period, 2 s), and the
     * next look (0.75 s): 3.2-5.6 s measured. Who published it again is
     * the record's reason below; this bound only says it came before the
     * scanner's deadline, with room for a loaded machine. */
    ck_assert_msg(wait_ms < 9000,
                  "the lost delivery of %s was claimed %.1f s after its "
                  "request (the guard did not publish it again)",
                  stolen, (double)wait_ms / 1000);
    ck_assert_int_eq(evt_consumer_state(c, EVT_STREAM_CMDS, durable, 5000,
                                        &after),
                     0);
    if (ack) {
        /* gone from the stream: a new attempt, and the record says why */
        ck_assert_int_eq(
            sql_long(pg,
                     "SELECT count(*) FROM events WHERE stream_id = "
                     "'command-%s' AND type = 'CommandDispatched' AND "
                     "position('delivered by its consumer but never taken'"
                     "::bytea IN data) > 0",
                     stolen),
            1);
        ck_assert_int_eq(events_of_type(pg, stolen, "CommandDispatched"), 2);
        ck_assert(after.created_ns == before.created_ns);
    } else {
        /* still held: the consumer made again delivered the same message */
        ck_assert_int_eq(events_of_type(pg, stolen, "CommandDispatched"), 1);
        ck_assert_msg(after.created_ns != before.created_ns,
                      "the consumer was not made again");
    }
    ck_assert_int_eq(events_of_type(pg, stolen, "CommandStarted"), 1);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, name, 20000);
}

START_TEST(a_lost_delivery_is_delivered_again)
{
    lost_delivery("ld", false);
}
END_TEST

START_TEST(a_delivery_passed_unheld_is_published_again)
{
    lost_delivery("lda", true);
}
END_TEST

/* ---- claims whose reply is lost, holds, graceful stops ---------------------- */


/*
 * Issue 22: a claim that commits while its reply is lost. The claim of the
 * second command (one slot: it waits behind a blocker) is held up in
 * PostgreSQL by a row lock for 25 s, longer than the agent used to retry
 * (20 s): it then gave the claim up, claimed again under a new id when the
 * message came back, got DuplicateSuppressed once the first claim
 * committed, and dropped the command, Running for good. Now the claim is
 * tried with its one id until the broker answers: it runs, once.
 */
START_TEST(claim_whose_reply_is_lost_runs_once)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37], st[32];

    PGconn *lock = claim_held_up(c, pg, "agent-lk", "lk", id);
    /* Meanwhile the broker serves everything else: a claim waiting for a
     * row lock must not hold up the appends queued behind it on the group
     * writer's connection (store.c WRITER_SESSION's lock_timeout; before,
     * this exec got no answer while the lock was held). */
    const char *extra[] = {"--max-concurrent", "1", NULL};
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-lk2", "lk2", extra),
                     0);
    struct fixture_out o;
    const char *ex[] = {"exec", "--agent", "lk2", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, ex, &o), 0);
    ck_assert_msg(o.status == 0, "exec while a claim waits: exit %d: %s",
                  o.status, o.err);
    fixture_out_release(&o);
    /* ... while the claim still waited */
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Dispatched");
    stack_stop(stack.dir, "agent-lk2", 20000);
    sleep_ms(25000);
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Dispatched");
    unlock_stream(lock);
    assert_ran_once(pg, id, 20000);
    ck_assert_int_eq(events_of_type(pg, id, "DuplicateSuppressed"), 0);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-lk", 20000);
}
END_TEST

/*
 * Issue 22 (grey failures): the scanner serves every command's deadline
 * in turn on one connection, so a stream held by a stalled transaction (a
 * paused broker's) must fail alone (BROKER_BG_LOCK_TIMEOUT_MS) and not stop
 * the deadlines behind it. Command a's stream is locked while its deadline
 * passes; b's deadline passes later and b must still end Undeliverable.
 * Before, the scanner waited on a's row for as long as the lock was held
 * and b stayed Dispatched.
 */
/* A command a for agent id (process name agent-<id>), known to the broker
 * and then stopped, whose delivery deadline is deliver_ms: Dispatched,
 * with its stream's row held (lock_stream) until unlock_stream. */
static PGconn *
dispatched_and_locked(struct evt_conn *c, PGconn *pg, const char *id,
                      uint64_t deliver_ms, char a[37])
{
    char name[64];
    snprintf(name, sizeof(name), "agent-%s", id);
    ck_assert_int_eq(fixture_agent_spawn(&stack, name, id, NULL), 0);
    ck_assert_int_eq(stack_stop(stack.dir, name, 20000), 0);
    ck_assert_int_eq(fixture_submit(c, id, "true", 10000, deliver_ms, a), 0);
    ck_assert_int_eq(wait_status(pg, a, "Dispatched", 5000), 0);
    return lock_stream(a);
}

START_TEST(a_locked_stream_does_not_stop_the_scanner)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char a[37], b[37], st[32];

    /* Known to the broker, then offline: its commands wait for it. */
    PGconn *lock = dispatched_and_locked(c, pg, "scl", 1500, a);
    ck_assert_int_eq(fixture_submit(c, "scl", "true", 10000, 3000, b), 0);
    if (wait_status(pg, b, "Undeliverable", 30000) != 0)
        print_events(b);
    ck_assert_str_eq(status_of(pg, b, st, sizeof(st)), "Undeliverable");
    /* a's end could not be written while its row was held ... */
    ck_assert_str_eq(status_of(pg, a, st, sizeof(st)), "Dispatched");
    unlock_stream(lock);
    /* ... and is, once it is let go. */
    if (wait_status(pg, a, "Undeliverable", 30000) != 0)
        print_events(a);
    ck_assert_str_eq(status_of(pg, a, st, sizeof(st)), "Undeliverable");
    PQfinish(pg);
    evt_close(c);
}
END_TEST

/*
 * Issue 22 (test_cluster registry_watch_node_dies, 1 run in 20): a busy
 * scanner is no pause. The broker's pause detector was the scanner's own
 * loop, so a pass held up a second (here: a locked stream, the scanner
 * session's 1 s lock timeout, as under a loaded PostgreSQL) read as a
 * SIGSTOP, and the broker judged no agent by silence for the next 6 s,
 * again at every slow pass: an agent stopped past its TTL was not told
 * offline. Now a thread of its own keeps the time, and a wake lasts until
 * the broker sees its own next beacon.
 */
START_TEST(a_busy_scanner_is_no_pause)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char a[37], b[37], st[32];

    /* a's deadline passes while its row is held: every scanner pass now
     * waits a second on it */
    PGconn *lock = dispatched_and_locked(c, pg, "bsy", 500, a);
    /* past EVT_AGENT_TTL_MS since the agent's last heartbeat */
    sleep_ms(EVT_AGENT_TTL_MS + 2500);
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"true", NULL};
    spec.argv = argv;
    spec.n_argv = 1;
    spec.timeout_ms = 10000;
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__ExecuteReply *rep = NULL;
    req.spec = &spec;
    req.agent_id = "bsy";
    req.detach = 1;
    req.deliver_within_ms = 3000;
    ck_assert_int_eq(broker_execute(c, &req, 5000, &rep), 0);
    ck_assert_int_eq(rep->error_code, 0);
    snprintf(b, sizeof(b), "%s", rep->command_id);
    bool offline = rep->agent_offline;
    ks__execute_reply__free_unpacked(rep, NULL);
    unlock_stream(lock);
    ck_assert_msg(offline, "an agent silent past its TTL was not told "
                           "offline while the scanner was busy");
    ck_assert_int_eq(wait_status(pg, a, "Undeliverable", 30000), 0);
    ck_assert_int_eq(wait_status(pg, b, "Undeliverable", 30000), 0);
    ck_assert_str_eq(status_of(pg, b, st, sizeof(st)), "Undeliverable");
    PQfinish(pg);
    evt_close(c);
}
END_TEST

/*
 * Issue 22: the agent stops (TERM) while its claim is unanswered, and a
 * restart (same state dir) finds the claim id in its journal: it claims
 * with that id again, and the claim that won (committed after the stop)
 * is granted to it, so the command runs once. Before, the stop forgot the
 * claim, the restart claimed under a new id, was refused, and the command
 * stayed Running for good.
 */
START_TEST(claim_taken_up_after_a_restart)
{
    const char *extra[] = {"--max-concurrent", "1", NULL};
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37];

    PGconn *lock = claim_held_up(c, pg, "agent-rs", "rs", id);
    sleep_ms(1500); /* the claim is out, and held up */
    /* The default drain timeout (10 s): the stop waits for the claim that
     * far, then leaves it unanswered. */
    ck_assert_int_eq(stack_stop(stack.dir, "agent-rs", 20000), 0);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-rs", "rs", extra), 0);
    sleep_ms(1500);
    unlock_stream(lock);
    assert_ran_once(pg, id, 20000);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-rs", 20000);
}
END_TEST

/*
 * Issue 22 (test_batch cancel_through_either_broker: 9 of 10 cancelled):
 * a cancel that reaches the agent after it sent the claim and before the
 * executor spawned the command (its claim's reply and the cancel come on
 * different paths, from different brokers) used to end the command
 * StartFailed ("spawn: Operation canceled"): the executor reports a job
 * cancelled while queued as a start failure. Nobody's start failed; it
 * was cancelled, and never ran. Here the claim is held up in PostgreSQL
 * while the cancel comes, as a broker sends it.
 */
START_TEST(cancel_before_the_spawn_is_cancelled)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37], st[32];

    PGconn *lock = claim_held_up(c, pg, "agent-cx", "cx", id);
    sleep_ms(500);
    Ks__CancelCommand cc = KS__CANCEL_COMMAND__INIT;
    cc.command_id = id;
    ck_assert_int_eq(evt_publish_msg(c, "kscore.cancel.cx", &cc.base), 0);
    natsConnection_Flush(c->nc);
    sleep_ms(500);
    unlock_stream(lock);
    if (wait_status(pg, id, "Cancelled", 15000) != 0)
        print_events(id);
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Cancelled");
    ck_assert(has_event(id, "CommandCompleted", "before it was spawned",
                        "Cancelled"));
    ck_assert_int_eq(runs_of(id), 0);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-cx", 20000);
}
END_TEST

/* One heartbeat of the fake agent `id` (process instance, number seq)
 * listing the n commands in held (text UUIDs). */
static void
fake_heartbeat(struct evt_conn *c, const char *id, const char *instance,
               uint64_t seq, const char *const *held, size_t n)
{
    Ks__AgentInfo info = KS__AGENT_INFO__INIT;
    ProtobufCBinaryData bin[4];
    uint8_t raw[4][16];
    info.agent_id = (char *)id;
    info.version = "test";
    info.host = "test";
    info.heartbeat_at_us = ks_now_us();
    info.instance_id = (char *)instance;
    info.started_at_us = 1;
    info.heartbeat_seq = seq;
    info.holds_complete = true;
    for (size_t i = 0; i < n && i < 4; i++) {
        ck_assert_int_eq(ks_uuid_bin(held[i], raw[i]), 0);
        bin[i] = (ProtobufCBinaryData){16, raw[i]};
    }
    info.holds = bin;
    info.n_holds = n;
    ck_assert_int_eq(evt_agent_put(c, NULL, &info, 5000), 0);
}

/*
 * The broker ends a Running command that the heartbeats of the process
 * that claimed it, sent after the claim, no longer list (AgentInfo.holds),
 * and only then: a fake agent "hb" claims (instance I, listed from its
 * heartbeat 3); heartbeats 1-2 (made before the claim) and 3-5 (listing
 * it) leave it Running; heartbeat 6 lists nothing and it ends Lost, with
 * the reason, well within I3.
 */
START_TEST(running_command_no_heartbeat_lists_ends_lost)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    Ks__ClaimRequest req = KS__CLAIM_REQUEST__INIT;
    natsMsg *m = NULL;
    ProtobufCMessage *pm = NULL;
    char id[37], claim_id[37], inst[37], st[32];
    uint64_t seq = 0;

    ks_uuid(inst);
    fake_heartbeat(c, "hb", inst, ++seq, NULL, 0);
    /* Refused as for an unknown agent (nothing recorded) until the
     * broker has read that heartbeat: asked again until then. It was a
     * fixed 300 ms, which a loaded machine can overrun. */
    int rc;
    for (int i = 0; (rc = fixture_submit(c, "hb", "true", 120000, 120000,
                                         id)) == KS_ENOAGENT &&
                    i < 100;
         i++)
        sleep_ms(100);
    ck_assert_int_eq(rc, 0);
    ck_assert_int_eq(wait_status(pg, id, "Dispatched", 5000), 0);
    fake_heartbeat(c, "hb", inst, ++seq, NULL, 0);
    ks_uuid(claim_id);
    req.command_id = id;
    req.attempt = 1;
    req.agent_id = "hb";
    req.event_id = claim_id;
    req.expected_version = 2; /* Requested, Dispatched */
    req.instance_id = inst;
    req.listed_from_seq = seq + 1;
    ck_assert_int_eq(
        evt_request_as(c, "agent-hb", EVT_API_CLAIM, &req.base, 5000, &m), 0);
    ck_assert_int_eq(evt_unpack(&ks__claim_reply__descriptor,
                                natsMsg_GetData(m),
                                (size_t)natsMsg_GetDataLength(m), &pm),
                     0);
    ck_assert(((Ks__ClaimReply *)pm)->granted);
    protobuf_c_message_free_unpacked(pm, NULL);
    natsMsg_Destroy(m);
    ck_assert_int_eq(wait_status(pg, id, "Running", 5000), 0);
    /* A heartbeat made before the claim (a lower number) says nothing. */
    for (int i = 0; i < 4; i++) {
        fake_heartbeat(c, "hb", inst, seq, NULL, 0);
        sleep_ms(500);
    }
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Running");
    /* Listed: it runs. */
    const char *held[] = {id};
    for (int i = 0; i < 6; i++) {
        fake_heartbeat(c, "hb", inst, ++seq, held, 1);
        sleep_ms(500);
    }
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Running");
    /* Let go: Lost within a few seconds, heartbeats going on. */
    int64_t t0 = ks_mono_us();
    for (int i = 0; i < 20 && strcmp(status_of(pg, id, st, sizeof(st)),
                                     "Running") == 0;
         i++) {
        fake_heartbeat(c, "hb", inst, ++seq, NULL, 0);
        sleep_ms(500);
    }
    ck_assert_str_eq(status_of(pg, id, st, sizeof(st)), "Lost");
    ck_assert(has_event(id, "CommandLost", "does not run it", "Lost"));
    fprintf(stderr, "not listed: Lost %.1f s after the first heartbeat "
                    "without it\n",
            (double)(ks_mono_us() - t0) / 1e6);
    /* The claim that won, asked again now: too late, refused. */
    m = NULL;
    pm = NULL;
    ck_assert_int_eq(
        evt_request_as(c, "agent-hb", EVT_API_CLAIM, &req.base, 5000, &m), 0);
    ck_assert_int_eq(evt_unpack(&ks__claim_reply__descriptor,
                                natsMsg_GetData(m),
                                (size_t)natsMsg_GetDataLength(m), &pm),
                     0);
    ck_assert(!((Ks__ClaimReply *)pm)->granted);
    ck_assert_int_eq(((Ks__ClaimReply *)pm)->error_code, KS_ECLAIMED);
    protobuf_c_message_free_unpacked(pm, NULL);
    natsMsg_Destroy(m);
    PQfinish(pg);
    evt_close(c);
}
END_TEST

/* Starts `kscore agent --id id` named name without a state dir, and
 * waits for its heartbeat. */
static void
agent_spawn_stateless(const char *name, const char *id)
{
    const char *argv[] = {getenv("KSCORE_BIN"), "agent", "--id", id,
                          "--nats", stack.nats.url, "--trust-key",
                          stack.trust_key, NULL};
    pid_t pid;
    int64_t since = ks_now_us();
    ck_assert_ptr_nonnull(argv[0]);
    ck_assert_int_eq(stack_daemon(stack.dir, name, (char *const *)argv, &pid),
                     0);
    ck_assert_int_eq(fixture_stack_wait_agent(&stack, id, since, 30000), 0);
}

/*
 * Issue 25: an agent without --state-dir, killed (-9) while a command
 * runs and restarted at once. Its watchdog killed the command; the new
 * process knows nothing of it and heartbeats on, so silence never ended
 * it, and the redelivered message was only refused: Running past its
 * bound. Now no heartbeat lists it and the claimer is gone: Lost, within
 * the heartbeat deadline (I3).
 */
START_TEST(restart_without_state_dir_ends_lost)
{
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37], st[32];

    agent_spawn_stateless("agent-nsd", "nsd");
    ck_assert_int_eq(submit(c, "nsd", "exec sleep 60", id), 0);
    wait_running(pg, id);
    agent_kill9("agent-nsd");
    agent_spawn_stateless("agent-nsd", "nsd");
    int64_t t0 = ks_mono_us();
    /* The claimer's heartbeat deadline (10 s) and a few scans. */
    for (int i = 0; i < 250 && strcmp(status_of(pg, id, st, sizeof(st)),
                                      "Running") == 0;
         i++)
        sleep_ms(100);
    if (strcmp(st, "Lost"))
        print_events(id);
    ck_assert_str_eq(st, "Lost");
    ck_assert(has_event(id, "CommandLost", "does not run it", "Lost"));
    fprintf(stderr, "restart without a state dir: Lost %.1f s after it\n",
            (double)(ks_mono_us() - t0) / 1e6);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-nsd", 20000);
}
END_TEST

/*
 * A graceful stop (TERM) drains: the running command finishes and is
 * recorded as it ended (not Cancelled), the one waiting for a slot is not
 * claimed (still Dispatched, for after the restart), and the agent exits
 * once nothing runs. Restarted, it runs the one that waited.
 */
START_TEST(term_drains_the_agent)
{
    const char *extra[] = {"--max-concurrent", "1", NULL};
    struct evt_conn *c = client();
    PGconn *pg = db();
    char a[37], b[37], script[PATH_MAX + 64], st[32];

    /* a runs until the agent says it drains (the TERM came while it
     * ran): with `sleep 2` a loaded machine saw a end before the TERM,
     * or before wait_status saw it Running, and b ran. */
    struct fixture_gate gate;
    char a_sh[sizeof(gate.sh) + 32], log[PATH_MAX + 32];
    fixture_gate_init(&gate, side_dir, "drain");
    snprintf(a_sh, sizeof(a_sh), "%s; echo done", gate.sh);
    snprintf(log, sizeof(log), "%s/agent-dr.log", stack.dir);
    unlink(log);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-dr", "dr", extra), 0);
    ck_assert_int_eq(submit(c, "dr", a_sh, a), 0);
    ck_assert_int_eq(wait_status(pg, a, "Running", 10000), 0);
    snprintf(script, sizeof(script), "echo run >> %s/$KSCORE_COMMAND_ID",
             side_dir);
    ck_assert_int_eq(submit(c, "dr", script, b), 0);
    ck_assert_int_eq(wait_status(pg, b, "Dispatched", 5000), 0);
    int64_t t0 = ks_mono_us();
    /* One TERM (a second one would stop what runs), then a goes on. */
    ck_assert_int_eq(fixture_stack_signal(&stack, "agent-dr", SIGTERM), 0);
    const char *draining = "draining: no new work";
    for (int i = 0; i < 400 && !file_has(log, draining); i++)
        sleep_ms(50);
    ck_assert_msg(file_has(log, draining), "no drain: see %s", log);
    fixture_gate_open(&gate);
    for (int i = 0; i < 400 && stack_pidfile_alive(stack.dir, "agent-dr",
                                                   NULL);
         i++)
        sleep_ms(50);
    ck_assert_msg(!stack_pidfile_alive(stack.dir, "agent-dr", NULL),
                  "the agent did not stop once a ended");
    double took = (double)(ks_mono_us() - t0) / 1e6;
    ck_assert_int_eq(stack_stop(stack.dir, "agent-dr", 20000), 0);
    ck_assert_int_eq(wait_status(pg, a, "Succeeded", 10000), 0);
    ck_assert(!has_event(a, "CommandCompleted", NULL, "Cancelled"));
    ck_assert_str_eq(status_of(pg, b, st, sizeof(st)), "Dispatched");
    ck_assert_int_eq(runs_of(b), 0);
    fprintf(stderr, "drain: the agent stopped %.1f s after TERM\n", took);
    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-dr", "dr", extra), 0);
    ck_assert_int_eq(wait_status(pg, b, "Succeeded", 20000), 0);
    ck_assert_int_eq(runs_of(b), 1);
    PQfinish(pg);
    evt_close(c);
    stack_stop(stack.dir, "agent-dr", 20000);
}
END_TEST

/* Past the drain timeout (the default, 10 s) what still runs is stopped
 * and ends Lost, the agent stopped: never Cancelled (nobody cancelled it).
 * Before, a TERM cancelled it at once. */
START_TEST(term_past_the_drain_timeout_ends_lost)
{
    const char *extra[] = {NULL};
    struct evt_conn *c = client();
    PGconn *pg = db();
    char id[37];

    ck_assert_int_eq(fixture_agent_spawn(&stack, "agent-dt", "dt", extra), 0);
    ck_assert_int_eq(submit(c, "dt", "exec sleep 60", id), 0);
    pid_t child = wait_running(pg, id);
    int64_t t0 = ks_mono_us();
    ck_assert_int_eq(stack_stop(stack.dir, "agent-dt", 20000), 0);
    double took = (double)(ks_mono_us() - t0) / 1e6;
    ck_assert(wait_dead(child, 5000) >= 0);
    ck_assert_int_eq(wait_status(pg, id, "Lost", 10000), 0);
    ck_assert(has_event(id, "CommandLost", "the agent stopped", "Lost"));
    ck_assert(!has_event(id, "CommandCompleted", NULL, NULL));
    ck_assert_msg(took >= AGENT_DRAIN_TIMEOUT_MS / 1000 - 1,
                  "stopped %.1f s after TERM: no drain", took);
    fprintf(stderr, "drain timeout %d s: the agent stopped %.1f s after "
                    "TERM\n",
            AGENT_DRAIN_TIMEOUT_MS / 1000, took);
    PQfinish(pg);
    evt_close(c);
}
END_TEST

/* The exit status of child pid (a daemon this test process started) once
 * it exits within timeout_ms; -1 if it does not. */
static int
wait_exit_status(pid_t pid, long timeout_ms)
{
    for (long t = 0; t <= timeout_ms; t += 100) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        sleep_ms(100);
    }
    return -1;
}

/* 1 if the daemon's log (<dir>/<name>.log) has text. */
static int
log_has(const char *dir, const char *name, const char *text)
{
    char path[PATH_MAX + 80], line[4096];
    int found = 0;
    snprintf(path, sizeof(path), "%s/%s.log", dir, name);
    FILE *f = fopen(path, "r");
    while (f && !found && fgets(line, sizeof(line), f))
        found = strstr(line, text) != NULL;
    if (f)
        fclose(f);
    return found;
}

/*
 * Issue 22: a link that answers nothing while nats.c says CONNECTED (here
 * a nats-server stopped with SIGSTOP: the socket stays open, nats.c
 * notices only after its 2-minute ping interval; in the cluster suite, a
 * read thread hung in nats.c with every write failing EPIPE) left the
 * agent fenced but alive for good, and the broker serving nothing. Now
 * the agent kills its command (the fence), and after
 * AGENT_LINK_TIMEOUT_MS stops with AGENT_EXIT_LINK, which systemd
 * restarts; the broker stops too (BROKER_LINK_TIMEOUT_MS), non-zero.
 * Its own stack: the broker is a child of this test process, to be
 * waited for.
 */
START_TEST(dead_link_stops_agent_and_broker)
{
    struct fixture_stack ls;
    struct evt_conn *c;
    PGconn *pg;
    char id[37];
    pid_t child = 0, apid = 0, bpid = 0;

    memset(&ls, 0, sizeof(ls));
    ck_assert_int_eq(fixture_stack_start(&ls, NULL, 0), 0);
    ck_assert_int_eq(fixture_agent_spawn(&ls, "agent-lnk", "lnk", NULL), 0);
    ck_assert(stack_pidfile_alive(ls.dir, "agent-lnk", &apid));
    ck_assert(stack_pidfile_alive(ls.dir, "broker", &bpid));
    c = fixture_client(&ls);
    pg = PQconnectdb(ls.pg.conninfo);
    ck_assert_int_eq(PQstatus(pg), CONNECTION_OK);
    ck_assert_int_eq(fixture_submit(c, "lnk", "exec sleep 120", 120000, 0, id),
                     0);
    evt_close(c);
    for (int i = 0; i < 200 && command_procs(id, &child) == 0; i++)
        sleep_ms(50);
    ck_assert_int_gt(child, 0);

    int64_t t0 = ks_mono_us();
    ck_assert_int_eq(fixture_stack_nats_kill(&ls, SIGSTOP), 0);
    /* Fenced: the command dies within the fence. */
    long fenced_ms = wait_dead(child, AGENT_FENCE_MS + 5000);
    /* Then both stop by themselves. */
    int ast = wait_exit_status(apid, AGENT_LINK_TIMEOUT_MS + 20000);
    double agent_s = (double)(ks_mono_us() - t0) / 1e6;
    int bst = wait_exit_status(bpid, BROKER_LINK_TIMEOUT_MS + 30000);
    double broker_s = (double)(ks_mono_us() - t0) / 1e6;
    fixture_stack_nats_kill(&ls, SIGCONT);
    fprintf(stderr,
            "dead link: agent exited %d after %.1f s, broker %d after "
            "%.1f s\n",
            ast, agent_s, bst, broker_s);
    bool agent_said = log_has(ls.dir, "agent-lnk",
                              "the NATS link answers nothing");
    bool broker_said = log_has(ls.dir, "broker",
                               "the NATS link answers nothing");
    if (!agent_said || !broker_said) {
        /* Seen once in make soak (the agent exited 75 and its log had no
         * such line): the logs as they are, for the cause. */
        char cmd[2 * sizeof(ls.dir) + 128];
        snprintf(cmd, sizeof(cmd),
                 "tail -c 3000 %s/agent-lnk.log %s/broker.log >&2", ls.dir,
                 ls.dir);
        (void)!system(cmd);
    }
    /* Nothing left behind, whatever the outcome. */
    if (ast == -1) {
        kill(apid, SIGKILL);
        waitpid(apid, NULL, 0);
    }
    if (bst == -1) {
        kill(bpid, SIGKILL);
        waitpid(bpid, NULL, 0);
    }
    PQfinish(pg);
    fixture_stack_stop(&ls);
    ck_assert_int_ge(fenced_ms, 0);
    ck_assert_int_eq(ast, AGENT_EXIT_LINK);
    ck_assert(agent_s * 1000 >= AGENT_LINK_TIMEOUT_MS - EVT_HEARTBEAT_MS);
    ck_assert(agent_said);
    ck_assert_int_ne(bst, 0);
    ck_assert_int_ne(bst, -1);
    ck_assert(broker_said);
}
END_TEST

/* KSCORE_TEST_ONLY=name runs one test of the stack case (development). */
static void
add_stack_test(TCase *tc, const TTest *t)
{
    const char *only = getenv("KSCORE_TEST_ONLY");
    if (!only || !strcmp(only, t->name))
        tcase_add_test(tc, t);
}

static Suite *
agent_suite(void)
{
    Suite *s = suite_create("agent");
    TCase *wd = tcase_create("watchdog");
    tcase_set_timeout(wd, 60);
    tcase_add_test(wd, watchdog_kills_jobs_of_a_dead_process);
    tcase_add_test(wd, watchdog_kills_jobs_of_a_stopped_process);
    tcase_add_test(wd, watchdog_is_isolated_replaced_and_reaped);
    tcase_add_test(wd, watchdog_kills_a_job_whose_loop_stopped_in_its_clone);
    tcase_add_test(wd, watchdog_kills_a_job_whose_loop_died_in_its_clone);
    suite_add_tcase(s, wd);

    TCase *tc = tcase_create("stack");
    tcase_add_unchecked_fixture(tc, stack_up, stack_down);
    tcase_set_timeout(tc, 240);
    add_stack_test(tc, children_die_with_their_agent);
    add_stack_test(tc, stopped_agent_watchdog_kills_and_reports_lost);
    add_stack_test(tc, claims_only_with_a_free_slot);
    add_stack_test(tc, slots_are_shared_by_the_ids_of_a_process);
    add_stack_test(tc, claimed_never_spawned_runs_once_after_restart);
    add_stack_test(tc, self_fence_when_nats_is_gone);
    add_stack_test(tc, two_processes_with_one_id_are_a_duplicate);
    add_stack_test(tc, agent_started_with_sigchld_ignored);
    add_stack_test(tc, state_dir_full_refuses_claims);
    add_stack_test(tc, claim_whose_reply_is_lost_runs_once);
    add_stack_test(tc, a_lost_delivery_is_delivered_again);
    add_stack_test(tc, a_delivery_passed_unheld_is_published_again);
    add_stack_test(tc, claim_taken_up_after_a_restart);
    add_stack_test(tc, a_locked_stream_does_not_stop_the_scanner);
    add_stack_test(tc, a_busy_scanner_is_no_pause);
    add_stack_test(tc, cancel_before_the_spawn_is_cancelled);
    add_stack_test(tc, running_command_no_heartbeat_lists_ends_lost);
    add_stack_test(tc, restart_without_state_dir_ends_lost);
    add_stack_test(tc, term_drains_the_agent);
    add_stack_test(tc, term_past_the_drain_timeout_ends_lost);
    suite_add_tcase(s, tc);

    /* Each test its own stack. */
    TCase *own = tcase_create("own-stack");
    tcase_set_timeout(own, 240);
    tcase_add_test(own, dead_link_stops_agent_and_broker);
    suite_add_tcase(s, own);
    return s;
}

int
main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], WRAP_IGNORING)) {
        /* The wrapper (agent_daemon): a parent's state passed on to the
         * agent by execve, as a careless supervisor would. */
        sigset_t block;
        signal(SIGCHLD, SIG_IGN);
        sigemptyset(&block);
        sigaddset(&block, SIGTERM);
        sigaddset(&block, SIGCHLD);
        sigprocmask(SIG_BLOCK, &block, NULL);
        execv(argv[2], argv + 2);
        _exit(127);
    }
    SRunner *sr = srunner_create(agent_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
