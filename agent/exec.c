/*
 * exec.c: the job state machine and the loops that drive it.
 *
 * A job goes: queued -> running (leader alive) -> leader exited (group may
 * still hold processes) -> finished (group clean, leader reaped). Every
 * transition happens on the thread that owns the loop: the caller's for
 * exec_run(), the loop thread for exec_loop. Other threads only touch the
 * submission queue and cancel flags, under loop->mu, and wake the loop with
 * its eventfd.
 */
#include "exec_int.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define NEVER INT64_MAX
/* After SIGKILL, how long a leftover may take to die before it is counted
 * as a survivor (uninterruptible sleep, or outside our reach). */
#define EXEC_SURVIVOR_WAIT_US (2 * 1000000)
/* Polling of a group without cgroup notifications: 1 ms doubling to 64. */
#define EXEC_POLL_MIN_US 1000
#define EXEC_POLL_MAX_US 64000
#define EXEC_READ_CHUNK 65536

enum watch_kind { W_OUT, W_ERR, W_PID, W_CG, W_EVENT, W_WD, W_IN };

struct exec_job;

struct watch {
    struct exec_job *job;
    enum watch_kind kind;
};

struct outbuf {
    char *data;
    size_t len, alloc, cap;
    uint64_t total;
};

struct exec_job {
    /* loop->active (queued or running), under loop->mu */
    struct exec_job *prev, *next;
    struct exec_job *qnext;   /* loop->queue, under loop->mu */
    struct exec_job *rnext;   /* running list, loop thread only */
    struct exec_job *dnext;   /* finished in this step, loop thread only */
    uint64_t id;
    struct exec_spec spec;
    void *blob; /* owned copy of the spec's strings (NULL: borrowed) */
    exec_started_fn started_cb;
    exec_output_fn output_cb;
    exec_done_fn done;
    void *ud;
    bool cancel_req; /* under loop->mu */
    bool kill_req;   /* under loop->mu */
    bool wd_added;   /* registered with the watchdog, loop thread only */

    bool started, finished, leader_exited;
    bool term_sent, kill_sent, cg_watched, scan_pgroup, had_members;
    bool poll_leader; /* no pidfd: leader exit found by polling */
    int wait_errno;   /* waitid/wait4 failed (ECHILD): status lost */
    pid_t pid;
    int pidfd;
    int fd[2];
    struct watch w[4];
    /* stdin: our write end (-1: none or done), how much is written, and
     * its watch (EPOLLOUT while the pipe is full). */
    int in_fd;
    size_t in_off;
    bool in_watched;
    struct watch win;
    struct outbuf buf[2];
    int64_t t0, grace_us;
    uint64_t start_ticks; /* boot-time ticks at spawn, for /proc starttime */
    int64_t term_at, kill_at, give_up_at, poll_at, poll_step;
    struct exec__cgroup cg;
    struct exec__members last;
    struct exec_result res;
};

struct exec_loop {
    int epfd;
    int evfd; /* -1 for exec_run's private loop */
    struct watch evw;
    bool threaded;
    pthread_t thr;
    unsigned max_concurrent;
    atomic_uint nrunning;

    pthread_mutex_t mu;
    struct exec_job *active;            /* under mu */
    struct exec_job *qhead, *qtail;     /* under mu */
    uint64_t next_id;                   /* under mu */
    bool stopping, cancel_pending;      /* under mu */

    struct exec_job *running; /* loop thread */
    struct exec_job *dhead;   /* loop thread */

    struct exec__wd wd;       /* loop thread */
    struct watch wdw;
    atomic_int wd_pid;        /* for exec_loop_watchdog_pid() */
    struct exec__wd_child wdc; /* the spawning child's ADD (job_start) */
};

/*
 * Where bytes past a cap go. Per thread, not per loop: exec_run() builds a
 * loop per call, and a 64 KiB heap block per call cost page faults (glibc
 * trimmed and regrew the heap every run).
 */
static __thread char scratch[EXEC_READ_CHUNK];

void
exec_result_release(struct exec_result *r)
{
    if (!r)
        return;
    free(r->out.data);
    free(r->err.data);
    r->out.data = r->err.data = NULL;
    r->out.len = r->err.len = 0;
}

static size_t
cap_of(size_t spec_cap)
{
    if (spec_cap == 0)
        return EXEC_OUTPUT_CAP_DEFAULT;
    return spec_cap < EXEC_OUTPUT_CAP_MAX ? spec_cap : EXEC_OUTPUT_CAP_MAX;
}

static void
job_init(struct exec_job *job, const struct exec_spec *spec)
{
    job->spec = *spec;
    job->pidfd = job->fd[0] = job->fd[1] = job->in_fd = -1;
    job->win.job = job;
    job->win.kind = W_IN;
    job->cg.events_fd = job->cg.dir_fd = -1;
    for (int i = 0; i < 4; i++) {
        job->w[i].job = job;
        job->w[i].kind = (enum watch_kind)i;
    }
    job->buf[0].cap = cap_of(spec->stdout_cap_bytes);
    job->buf[1].cap = cap_of(spec->stderr_cap_bytes);
    job->grace_us =
        (int64_t)(spec->grace_ms ? spec->grace_ms : EXEC_GRACE_DEFAULT_MS) *
        1000;
    job->term_at = job->kill_at = job->give_up_at = job->poll_at = NEVER;
    job->res.term_sent_us = job->res.kill_sent_us = -1;
}

static void
watch_add(struct exec_loop *loop, int fd, struct watch *w, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = w};

    /* Only ENOMEM/ENOSPC can fail here; the job then runs on polling. */
    if (epoll_ctl(loop->epfd, EPOLL_CTL_ADD, fd, &ev) == -1 && w->job)
        w->job->poll_at = ks_mono_us() + EXEC_POLL_MIN_US;
}

static void
close_fd(struct exec_loop *loop, int *fd)
{
    if (*fd == -1)
        return;
    /* close() drops it from the epoll set: the fd is never dup'ed. */
    close(*fd);
    *fd = -1;
}

/* Room for more bytes in b, growing by doubling from 1 KiB (never past
 * cap + 1). 0, or -1 when out of memory. */
static int
outbuf_grow(struct outbuf *b, size_t more)
{
    size_t want = b->alloc ? b->alloc : 1024;
    char *p;

    if (b->alloc >= b->len + more + 1)
        return 0;
    while (want < b->len + more + 1)
        want *= 2;
    if (want > b->cap + 1)
        want = b->cap + 1;
    p = realloc(b->data, want);
    if (!p)
        return -1;
    b->data = p;
    b->alloc = want;
    return 0;
}

/* Reads once from one pipe; past the cap, counts and drops. 0 at EOF.
 * Reads into the thread's scratch and keeps what came: the buffer grows
 * by the output, not by a 64 KiB chunk per pipe (most commands print a
 * line or nothing). */
static ssize_t
pipe_read(struct exec_loop *loop, struct exec_job *job, int i)
{
    struct outbuf *b = &job->buf[i];
    size_t room = b->cap - b->len;
    ssize_t n;

    do {
        n = read(job->fd[i], scratch, sizeof(scratch));
    } while (n == -1 && errno == EINTR);
    if (n > 0) {
        size_t keep = (size_t)n < room ? (size_t)n : room;
        /* Out of memory: counted and dropped like past the cap. */
        if (keep && outbuf_grow(b, keep) == 0) {
            memcpy(b->data + b->len, scratch, keep);
            b->len += keep;
            if (job->output_cb)
                job->output_cb(job->id, i + 1, b->data + b->len - keep, keep,
                               job->ud);
        }
        b->total += (uint64_t)n;
    }
    return n;
}

/*
 * write(2) that never raises SIGPIPE, whatever the process's disposition
 * (exec_process_init ignores it, a program using exec_run may not): the
 * signal is blocked in this thread around the write, and the one a closed
 * pipe raised is taken back unless it was pending before (as git's
 * sigchain and libcurl do for sockets without MSG_NOSIGNAL).
 */
static ssize_t
write_nosigpipe(int fd, const void *buf, size_t len)
{
    sigset_t pipe_set, old, pending;
    bool was_pending;
    ssize_t n;
    int e;

    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigpending(&pending);
    was_pending = sigismember(&pending, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    n = write(fd, buf, len);
    e = errno;
    if (n == -1 && e == EPIPE && !was_pending) {
        const struct timespec zero = {0, 0};
        sigtimedwait(&pipe_set, NULL, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = e;
    return n;
}

/*
 * Writes what the pipe takes of the child's stdin; at the end, or when the
 * child has closed its end (EPIPE), closes ours, so the child reads EOF.
 * Until then, waits for EPOLLOUT.
 */
static void
feed_stdin(struct exec_loop *loop, struct exec_job *job)
{
    const char *data = job->spec.stdin_data;

    while (job->in_fd != -1 && job->in_off < job->spec.stdin_len) {
        ssize_t n = write_nosigpipe(job->in_fd, data + job->in_off,
                                    job->spec.stdin_len - job->in_off);
        if (n == -1 && errno == EINTR)
            continue;
        if (n == -1 && errno == EAGAIN) {
            if (!job->in_watched) {
                struct epoll_event ev = {.events = EPOLLOUT,
                                         .data.ptr = &job->win};
                /* Where epoll cannot take it (ENOMEM), the child gets
                 * EOF early rather than the loop spinning on it. */
                if (epoll_ctl(loop->epfd, EPOLL_CTL_ADD, job->in_fd, &ev) ==
                    -1)
                    break;
                job->in_watched = true;
            }
            return;
        }
        if (n <= 0)
            break; /* EPIPE: the child does not read any more */
        job->in_off += (size_t)n;
    }
    close_fd(loop, &job->in_fd);
}

static void
on_pipe(struct exec_loop *loop, struct exec_job *job, int i)
{
    ssize_t n = pipe_read(loop, job, i);

    if (n == 0 || (n == -1 && errno != EAGAIN))
        close_fd(loop, &job->fd[i]);
}

/* Members that one signal step reaches: the leader if alive, plus m. */
static void
count_signalled(struct exec_job *job, const struct exec__members *m,
                bool escapees_too)
{
    unsigned n = (job->leader_exited ? 0 : 1) + m->pgroup +
                 (escapees_too ? m->escaped : 0);
    if (n > job->res.signalled)
        job->res.signalled = n;
}

static void
send_term(struct exec_job *job, int64_t now)
{
    struct exec__members m;

    exec__members(job->pid, &job->cg, job->scan_pgroup, &m);
    count_signalled(job, &m, false);
    kill(-job->pid, SIGTERM);
    job->term_sent = true;
    job->res.term_sent_us = now - job->t0;
    job->kill_at = now + job->grace_us;
}

static void
send_kill(struct exec_job *job, int64_t now)
{
    struct exec__members m;

    exec__members(job->pid, &job->cg, job->scan_pgroup, &m);
    count_signalled(job, &m, true);
    kill(-job->pid, SIGKILL);
    if (job->cg.moved)
        exec__cgroup_kill(&job->cg);
    job->kill_sent = true;
    if (job->res.kill_sent_us < 0)
        job->res.kill_sent_us = now - job->t0;
    job->give_up_at = now + EXEC_SURVIVOR_WAIT_US;
}

static void
fill_output(struct exec_output *o, struct outbuf *b)
{
    if (!b->data)
        b->data = malloc(1);
    if (b->data)
        b->data[b->len] = '\0';
    o->data = b->data;
    o->len = b->data ? b->len : 0;
    o->total = b->total;
    o->truncated = b->total > o->len;
    b->data = NULL;
}

static void
job_done(struct exec_loop *loop, struct exec_job *job)
{
    job->finished = true;
    job->dnext = loop->dhead;
    loop->dhead = job;
}

/* ---- the watchdog (exec_watchdog.c) ------------------------------------- */

static void wd_replace(struct exec_loop *loop);

static void
wd_send(struct exec_loop *loop, unsigned type, struct exec_job *job)
{
    const char *path = job && job->cg.moved ? job->cg.path : NULL;

    if (loop->wd.fd == -1)
        return;
    if (exec__wd_send(&loop->wd, type, job ? job->id : 0,
                      job ? job->pid : 0, path) != 0)
        /* It does not read (stopped?) or is gone: a fresh one gets the
         * whole registry, so no DEL is ever lost. */
        wd_replace(loop);
}

static void
wd_on_fired(uint64_t job_id, int64_t silence_ms, void *ud)
{
    struct exec_loop *loop = ud;

    for (struct exec_job *j = loop->running; j; j = j->rnext)
        if (j->id == job_id && !j->finished) {
            j->res.watchdog_killed = true;
            j->res.watchdog_silence_ms = silence_ms;
            /* Killed from outside: never pooled (see cgroup_destroy). */
            if (j->cg.moved)
                j->cg.killed = true;
        }
}

/* Reads the watchdog's reports; replaces it if it died. */
static void
wd_drain(struct exec_loop *loop)
{
    if (loop->wd.fd != -1 &&
        exec__wd_read(&loop->wd, wd_on_fired, loop) == -EPIPE)
        wd_replace(loop);
}

/* (Re)spawns the watchdog and registers every running job with it. */
static void
wd_start(struct exec_loop *loop)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &loop->wdw};
    int64_t now = ks_mono_us();

    if (exec__wd_spawn(&loop->wd) != 0) {
        loop->wd.retry_at_us = now + 1000000;
        return;
    }
    atomic_store(&loop->wd_pid, (int)loop->wd.pid);
    loop->wdw.kind = W_WD;
    loop->wdw.job = NULL;
    epoll_ctl(loop->epfd, EPOLL_CTL_ADD, loop->wd.fd, &ev);
    loop->wd.next_ping_us = now + (int64_t)loop->wd.dead_ms * 1000 / 3;
    loop->wd.retry_at_us = NEVER;
    for (struct exec_job *j = loop->running; j; j = j->rnext) {
        j->wd_added = false;
        /* After the leader's exit its group may still hold processes;
         * its unreaped zombie still pins the pgid. */
        if (!j->finished) {
            j->wd_added = true;
            if (exec__wd_send(&loop->wd, EXEC__WD_ADD, j->id, j->pid,
                              j->cg.moved ? j->cg.path : NULL) != 0) {
                /* A new watchdog that cannot take its registry: try again
                 * later rather than recurse. */
                exec__wd_stop(&loop->wd, true);
                atomic_store(&loop->wd_pid, 0);
                loop->wd.retry_at_us = now + 1000000;
                return;
            }
        }
    }
}

/* A PING when one is due. Also between the spawns and ends of a burst
 * (settle): a job's child's own ADD is no sign of the loop's life. */
static void
wd_ping_if_due(struct exec_loop *loop, int64_t now)
{
    if (loop->wd.fd != -1 && now >= loop->wd.next_ping_us) {
        loop->wd.next_ping_us = now + (int64_t)loop->wd.dead_ms * 1000 / 3;
        wd_send(loop, EXEC__WD_PING, NULL);
    }
}

static void
wd_replace(struct exec_loop *loop)
{
    exec__wd_stop(&loop->wd, true);
    atomic_store(&loop->wd_pid, 0);
    wd_start(loop);
}

/* A job that never ran (start failure, or cancelled while queued). */
static void
job_fail(struct exec_loop *loop, struct exec_job *job, const char *stage,
         int err)
{
    struct exec_result *r = &job->res;

    r->outcome = EXEC_START_FAILED;
    r->start_stage = stage;
    r->start_errno = err;
    r->exit_code = -1;
    if (!r->started_at_us)
        r->started_at_us = ks_now_us();
    r->finished_at_us = ks_now_us();
    r->duration_us = job->t0 ? ks_mono_us() - job->t0 : 0;
    fill_output(&r->out, &job->buf[0]);
    fill_output(&r->err, &job->buf[1]);
    exec__cgroup_destroy(&job->cg);
    job_done(loop, job);
}

/* The group is clean (or given up on): drain, reap, report. */
static void
job_finish(struct exec_loop *loop, struct exec_job *job)
{
    struct exec_result *r = &job->res;
    struct rusage ru;
    int status = 0;
    pid_t w;

    for (int i = 0; i < 2; i++) {
        while (job->fd[i] != -1) {
            ssize_t n = pipe_read(loop, job, i);
            if (n <= 0)
                close_fd(loop, &job->fd[i]);
        }
    }
    close_fd(loop, &job->pidfd);
    close_fd(loop, &job->in_fd);
    if (job->wd_added) {
        /* Its report (if it fired) is read before the result is made, and
         * the DEL goes out while the unreaped leader still pins the pgid. */
        wd_drain(loop);
        wd_send(loop, EXEC__WD_DEL, job);
        job->wd_added = false;
    }
    memset(&ru, 0, sizeof(ru));
    do {
        w = wait4(job->pid, &status, 0, &ru);
    } while (w == -1 && errno == EINTR);
    if (w == -1 && !job->wait_errno)
        job->wait_errno = errno;
    exec__reap_leftovers(job->pid, &job->cg);

    if (job->wait_errno) {
        /* A status of 0 we never read must not look like success. */
        r->outcome = EXEC_STATUS_LOST;
        r->wait_errno = job->wait_errno;
        r->exit_code = -1;
    } else if (WIFSIGNALED(status)) {
        r->outcome = EXEC_SIGNALED;
        r->signal = WTERMSIG(status);
        r->core_dumped = WCOREDUMP(status);
        r->exit_code = -1;
    } else {
        r->outcome = EXEC_EXITED;
        r->exit_code = WEXITSTATUS(status);
    }
    r->utime_us = (int64_t)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec;
    r->stime_us = (int64_t)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec;
    r->maxrss_kb = ru.ru_maxrss;
    if (job->cg.moved && exec__cgroup_populated(&job->cg) == 1) {
        struct exec__members m;
        exec__members(job->pid, &job->cg, job->scan_pgroup, &m);
        r->survivors = m.pgroup + m.escaped;
        /* Keep the cgroup; a later exec_global_init() in a new agent
         * process removes it. Drop our fd only. */
        close(job->cg.events_fd);
        job->cg.events_fd = -1;
        job->cg.in_use = false;
    } else {
        r->survivors = job->last.pgroup + job->last.escaped;
    }
    exec__cgroup_destroy(&job->cg);
    r->finished_at_us = ks_now_us();
    r->duration_us = ks_mono_us() - job->t0;
    fill_output(&r->out, &job->buf[0]);
    fill_output(&r->err, &job->buf[1]);
    job_done(loop, job);
}

/*
 * The leader has exited: is the group clean? If not, what is left gets
 * TERM now (K04), KILL after the grace; setsid escapees in the job's
 * cgroup get cgroup.kill once the group itself is clean.
 */
static void
check_group(struct exec_loop *loop, struct exec_job *job, int64_t now)
{
    struct exec__members m = {0, 0};
    bool pg_clean, clean;

    if (job->cg.moved && !job->scan_pgroup) {
        int pop = exec__cgroup_populated(&job->cg);
        if (pop == 1)
            exec__members(job->pid, &job->cg, false, &m);
    } else if (!job->cg.moved && !job->had_members &&
               !exec__members_possible(job->pid, job->start_ticks)) {
        /* Fast path without a cgroup: nothing left, no /proc scan. */
    } else {
        exec__members(job->pid, &job->cg, job->scan_pgroup, &m);
    }
    job->last = m;
    pg_clean = m.pgroup == 0;
    /* Without a cgroup, escapees are out of reach: reported, not awaited. */
    clean = pg_clean && (!job->cg.moved || m.escaped == 0);
    if (!pg_clean || (job->cg.moved && m.escaped))
        job->had_members = true;
    if (clean || (job->kill_sent && now >= job->give_up_at)) {
        if (!clean)
            job->last = m;
        job_finish(loop, job);
        return;
    }
    if (!pg_clean && !job->term_sent)
        send_term(job, now);
    else if (pg_clean && !job->kill_sent)
        send_kill(job, now); /* only escapees are left: cgroup.kill */

    if (job->cg.moved && !job->cg_watched) {
        watch_add(loop, job->cg.events_fd, &job->w[W_CG],
                  EPOLLPRI | EPOLLERR);
        job->cg_watched = true;
        /* The read above armed the notification; re-check for a race. */
        if (!job->scan_pgroup && exec__cgroup_populated(&job->cg) == 0) {
            job->last.pgroup = job->last.escaped = 0;
            job_finish(loop, job);
            return;
        }
    }
    if (!job->cg.moved || job->scan_pgroup) {
        job->poll_step = job->poll_step ? job->poll_step * 2 : EXEC_POLL_MIN_US;
        if (job->poll_step > EXEC_POLL_MAX_US)
            job->poll_step = EXEC_POLL_MAX_US;
        job->poll_at = now + job->poll_step;
    }
}

static void
on_leader_exit(struct exec_loop *loop, struct exec_job *job)
{
    siginfo_t si;
    int rc;

    memset(&si, 0, sizeof(si));
    rc = waitid(job->pidfd != -1 ? (idtype_t)P_PIDFD : P_PID,
                job->pidfd != -1 ? (id_t)job->pidfd : (id_t)job->pid, &si,
                WEXITED | WNOHANG | WNOWAIT);
    if (rc == -1 && errno == EINTR)
        return;
    if (rc == -1) {
        /*
         * ECHILD: the leader is no child to wait for any more: the kernel
         * reaped it (this process ignores SIGCHLD, waitpid(2) NOTES) or a
         * waitpid(-1) elsewhere did. It has exited (its pidfd said so, or
         * it is no child at all), its status is gone. Returning here would
         * spin: the pidfd stays readable. The job ends, status lost.
         */
        job->wait_errno = errno;
    } else if (si.si_pid == 0) {
        return;
    }
    close_fd(loop, &job->pidfd);
    job->leader_exited = true;
    check_group(loop, job, ks_mono_us());
}

static void
on_timers(struct exec_loop *loop, struct exec_job *job, int64_t now)
{
    if (!job->term_sent && now >= job->term_at) {
        job->res.timed_out = true;
        send_term(job, now);
    }
    if (job->term_sent && !job->kill_sent && now >= job->kill_at)
        send_kill(job, now);
    if (!job->leader_exited && job->poll_leader && now >= job->poll_at) {
        job->poll_step = job->poll_step ? job->poll_step * 2 : EXEC_POLL_MIN_US;
        if (job->poll_step > EXEC_POLL_MAX_US)
            job->poll_step = EXEC_POLL_MAX_US;
        job->poll_at = now + job->poll_step;
        on_leader_exit(loop, job);
        if (job->leader_exited)
            job->poll_step = 0;
        return;
    }
    if (job->leader_exited &&
        (now >= job->poll_at || (job->kill_sent && now >= job->give_up_at))) {
        job->poll_at = NEVER;
        check_group(loop, job, now);
    }
}

static int64_t
next_deadline(struct exec_job *job)
{
    int64_t t = job->poll_at;

    if (!job->term_sent && job->term_at < t)
        t = job->term_at;
    if (job->term_sent && !job->kill_sent && job->kill_at < t)
        t = job->kill_at;
    if (job->kill_sent && job->leader_exited && job->give_up_at < t)
        t = job->give_up_at;
    return t;
}

static void
job_start(struct exec_loop *loop, struct exec_job *job)
{
    const struct exec_spec *spec = &job->spec;
    char **envp = NULL, *path = NULL;
    const char *stage = "spawn";
    int fds[3] = {-1, -1, -1};
    int ret;

    job->started = true;
    job->res.started_at_us = ks_now_us();
    ret = exec__build_env(spec, &envp);
    if (ret)
        goto fail;
    ret = exec__check_cwd(exec__cwd(spec));
    if (ret) {
        stage = "chdir";
        goto fail;
    }
    ret = exec__resolve(spec->argv[0], exec__env_get(envp, "PATH"), &path);
    if (ret) {
        stage = "exec";
        goto fail;
    }
    if (exec__cgroup_enabled() && exec__cgroup_create(&job->cg) != 0)
        job->scan_pgroup = true;
    job->t0 = ks_mono_us();
    if (!job->cg.in_use)
        job->start_ticks = exec__boot_ticks();
    ret = -ENOSYS;
    if (job->cg.in_use) {
        exec__wd_child_prepare(&loop->wdc, &loop->wd, job->id, job->cg.path);
        ret = exec__spawn_cgroup(spec, path, envp, job->cg.dir_fd, &loop->wdc,
                                 &job->pid, &job->pidfd, fds, &stage);
        if (ret == 0)
            job->cg.moved = true;
    }
    if (ret == -ENOSYS) {
        /* Our child without a cgroup (it sets the child's NOFILE limit),
         * else posix_spawn (exec_spawn.c), whose child cannot register
         * itself: the loop does, after the spawn. The cgroup (the job's
         * own) goes in the record all the same: the child is moved there
         * next. */
        exec__wd_child_prepare(&loop->wdc, &loop->wd, job->id,
                               job->cg.in_use ? job->cg.path : NULL);
        ret = exec__spawn_cgroup(spec, path, envp, -1, &loop->wdc, &job->pid,
                                 &job->pidfd, fds, &stage);
        if (ret == -ENOSYS)
            ret = exec__spawn(spec, path, envp, &job->pid, fds, &stage);
        if (ret == 0 && job->cg.in_use &&
            (exec__cgroup_move(&job->cg, job->pid) != 0 ||
             exec__may_have_forked(job->pid)))
            job->scan_pgroup = true;
        if (ret == 0 && job->pidfd == -1)
            job->pidfd = exec__pidfd_open(job->pid);
    }
    if (loop->wdc.del_lost) {
        /* A dead child's ADD may still be registered: a new watchdog gets
         * only the jobs that run. */
        loop->wdc.del_lost = false;
        wd_replace(loop);
    }
    if (ret)
        goto fail;
    job->fd[0] = fds[0];
    job->fd[1] = fds[1];
    job->in_fd = fds[2];
    job->res.pid = job->pid;
    if (job->pidfd == -1) {
        /*
         * No pidfd (kernel < 5.3, or valgrind): the leader is polled with
         * waitid(P_PID, WNOWAIT) instead, 1 ms doubling to 64 ms. Safe: an
         * unreaped child's pid cannot be reused.
         */
        job->poll_leader = true;
        job->poll_at = ks_mono_us() + EXEC_POLL_MIN_US;
    }
    watch_add(loop, job->fd[0], &job->w[W_OUT], EPOLLIN);
    watch_add(loop, job->fd[1], &job->w[W_ERR], EPOLLIN);
    feed_stdin(loop, job);
    if (job->pidfd != -1)
        watch_add(loop, job->pidfd, &job->w[W_PID], EPOLLIN);
    if (spec->timeout_ms)
        job->term_at = job->t0 + (int64_t)spec->timeout_ms * 1000;
    job->rnext = loop->running;
    loop->running = job;
    atomic_fetch_add(&loop->nrunning, 1);
    if (loop->wdc.sent)
        job->wd_added = true; /* by its child, before its execve */
    else if (loop->wd.fd != -1) {
        job->wd_added = true;
        wd_send(loop, EXEC__WD_ADD, job);
    }
    loop->wdc.sent = false;
    if (job->started_cb)
        job->started_cb(job->id, job->pid, job->ud);
    goto out;
fail:
    job_fail(loop, job, stage, -ret);
out:
    free(envp);
    free(path);
}

static void
job_cancel(struct exec_loop *loop, struct exec_job *job, int64_t now)
{
    if (job->res.cancelled || job->finished)
        return;
    job->res.cancelled = true;
    if (!job->term_sent)
        send_term(job, now);
}

static void
job_kill(struct exec_loop *loop, struct exec_job *job, int64_t now)
{
    if (job->res.killed || job->finished)
        return;
    job->res.killed = true;
    send_kill(job, now);
}

static void
job_free(struct exec_job *job)
{
    if (!job)
        return;
    free(job->blob);
    free(job);
}

/* Submissions and cancels from other threads (called on the loop thread). */
static void
on_wakeup(struct exec_loop *loop)
{
    struct exec_job *cancel_queued = NULL, *j, *next;
    bool cancels;
    uint64_t v;

    if (read(loop->evfd, &v, sizeof(v)) == -1 && errno != EAGAIN)
        return;
    pthread_mutex_lock(&loop->mu);
    cancels = loop->cancel_pending;
    loop->cancel_pending = false;
    if (cancels) {
        /* Queued jobs that are cancelled never start. */
        struct exec_job **pp = &loop->qhead;
        loop->qtail = NULL;
        while (*pp) {
            j = *pp;
            if (j->cancel_req || j->kill_req) {
                *pp = j->qnext;
                j->qnext = cancel_queued;
                cancel_queued = j;
            } else {
                loop->qtail = j;
                pp = &j->qnext;
            }
        }
    }
    pthread_mutex_unlock(&loop->mu);
    for (j = cancel_queued; j; j = next) {
        next = j->qnext;
        j->res.cancelled = !j->kill_req;
        j->res.killed = j->kill_req;
        job_fail(loop, j, "spawn", ECANCELED);
    }
    if (cancels) {
        int64_t now = ks_mono_us();
        for (j = loop->running; j; j = j->rnext) {
            bool req, kill_req;
            pthread_mutex_lock(&loop->mu);
            req = j->cancel_req;
            kill_req = j->kill_req;
            pthread_mutex_unlock(&loop->mu);
            if (kill_req)
                job_kill(loop, j, now);
            else if (req)
                job_cancel(loop, j, now);
        }
    }
}

/* Hands finished jobs over, then starts queued jobs while there is room. */
static void
settle(struct exec_loop *loop)
{
    struct exec_job *j, *next;

    for (j = loop->dhead; j; j = next) {
        struct exec_job **pp;
        next = j->dnext;
        for (pp = &loop->running; *pp; pp = &(*pp)->rnext) {
            if (*pp == j) {
                *pp = j->rnext;
                atomic_fetch_sub(&loop->nrunning, 1);
                break;
            }
        }
        if (!loop->threaded)
            continue;
        pthread_mutex_lock(&loop->mu);
        if (j->prev)
            j->prev->next = j->next;
        else
            loop->active = j->next;
        if (j->next)
            j->next->prev = j->prev;
        pthread_mutex_unlock(&loop->mu);
        j->done(j->id, &j->res, j->ud);
        job_free(j);
        wd_ping_if_due(loop, ks_mono_us());
    }
    loop->dhead = NULL;
    if (!loop->threaded)
        return;
    for (;;) {
        pthread_mutex_lock(&loop->mu);
        j = NULL;
        if (loop->qhead &&
            atomic_load(&loop->nrunning) < loop->max_concurrent) {
            j = loop->qhead;
            loop->qhead = j->qnext;
            if (!loop->qhead)
                loop->qtail = NULL;
        }
        pthread_mutex_unlock(&loop->mu);
        if (!j)
            break;
        job_start(loop, j);
        wd_ping_if_due(loop, ks_mono_us());
        if (loop->dhead)
            settle(loop); /* a start failure finished at once */
    }
}

/*
 * epoll_pwait2 (Linux 5.11) for microsecond deadlines; epoll_wait with the
 * timeout rounded up to a millisecond where it is missing (valgrind 3.19).
 */
static int
wait_events(int epfd, struct epoll_event *evs, int max,
            const struct timespec *ts, int forever)
{
    static atomic_bool no_pwait2;
    int n, ms;

    if (!atomic_load_explicit(&no_pwait2, memory_order_relaxed)) {
        n = epoll_pwait2(epfd, evs, max, ts, NULL);
        if (n != -1 || errno != ENOSYS)
            return n;
        atomic_store(&no_pwait2, true);
    }
    ms = forever ? -1
                 : (int)(ts->tv_sec * 1000 + (ts->tv_nsec + 999999) / 1000000);
    return epoll_wait(epfd, evs, max, ms);
}

/* One turn: wait for the next event or deadline, act, settle. */
static void
loop_step(struct exec_loop *loop)
{
    struct epoll_event evs[64];
    struct timespec ts, *tsp = NULL;
    int64_t deadline = NEVER, now;
    struct exec_job *j, *next;
    int n;

    for (j = loop->running; j; j = j->rnext) {
        int64_t t = next_deadline(j);
        if (t < deadline)
            deadline = t;
    }
    if (loop->wd.dead_ms) {
        int64_t t = loop->wd.fd != -1 ? loop->wd.next_ping_us
                                      : loop->wd.retry_at_us;
        if (t < deadline)
            deadline = t;
    }
    if (deadline != NEVER) {
        int64_t wait = deadline - ks_mono_us();
        if (wait < 0)
            wait = 0;
        ts.tv_sec = wait / 1000000;
        ts.tv_nsec = (wait % 1000000) * 1000;
        tsp = &ts;
    }
    n = wait_events(loop->epfd, evs, 64, tsp, deadline == NEVER ? -1 : 0);
    for (int i = 0; i < n; i++) {
        struct watch *w = evs[i].data.ptr;
        if (w->kind == W_EVENT) {
            on_wakeup(loop);
            continue;
        }
        if (w->kind == W_WD) {
            wd_drain(loop);
            continue;
        }
        j = w->job;
        if (j->finished)
            continue;
        switch (w->kind) {
        case W_OUT:
        case W_ERR:
            if (j->fd[w->kind] != -1)
                on_pipe(loop, j, w->kind);
            break;
        case W_PID:
            if (j->pidfd != -1)
                on_leader_exit(loop, j);
            break;
        case W_IN:
            feed_stdin(loop, j);
            break;
        case W_CG:
            if (j->leader_exited)
                check_group(loop, j, ks_mono_us());
            break;
        default:
            break;
        }
    }
    now = ks_mono_us();
    for (j = loop->running; j; j = next) {
        next = j->rnext;
        if (!j->finished && next_deadline(j) <= now)
            on_timers(loop, j, now);
    }
    if (loop->wd.dead_ms) {
        if (loop->wd.fd == -1 && now >= loop->wd.retry_at_us)
            wd_start(loop);
        else
            wd_ping_if_due(loop, now);
    }
    settle(loop);
}

static int
loop_init(struct exec_loop *loop, bool threaded)
{
    memset(loop, 0, sizeof(*loop));
    loop->evfd = -1;
    loop->wd.fd = -1;
    loop->threaded = threaded;
    loop->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (loop->epfd == -1)
        return -errno;
    return 0;
}

int
exec_run(const struct exec_spec *spec, struct exec_result *out)
{
    struct exec_loop loop;
    struct exec_job job;
    int ret;

    ret = exec__spec_valid(spec);
    if (ret)
        return ret;
    exec_global_init();
    ret = loop_init(&loop, false);
    if (ret)
        return ret;
    memset(&job, 0, sizeof(job));
    job_init(&job, spec);
    job_start(&loop, &job);
    while (!job.finished)
        loop_step(&loop);
    settle(&loop);
    *out = job.res;
    close(loop.epfd);
    return 0;
}

static void *
loop_main(void *arg)
{
    struct exec_loop *loop = arg;

    /* Spawned from this thread: PR_SET_PDEATHSIG follows the thread that
     * created the watchdog, and this one lives exactly as long as the
     * loop. */
    if (loop->wd.dead_ms)
        wd_start(loop);
    for (;;) {
        bool stop;
        pthread_mutex_lock(&loop->mu);
        stop = loop->stopping && !loop->active;
        pthread_mutex_unlock(&loop->mu);
        if (stop)
            break;
        loop_step(loop);
    }
    /* Every job is finished and unregistered: nothing is left to guard.
     * SIGKILL rather than wait for it to see EOF, so a watchdog someone
     * stopped cannot hang the stop. */
    exec__wd_stop(&loop->wd, true);
    atomic_store(&loop->wd_pid, 0);
    return NULL;
}

int
exec_loop_new(unsigned max_concurrent, struct exec_loop **out)
{
    struct exec_loop_opts o = {.max_concurrent = max_concurrent};

    return exec_loop_start(&o, out);
}

pid_t
exec_loop_watchdog_pid(struct exec_loop *loop)
{
    return (pid_t)atomic_load(&loop->wd_pid);
}

int
exec_loop_start(const struct exec_loop_opts *opts, struct exec_loop **out)
{
    unsigned max_concurrent = opts->max_concurrent;
    struct exec_loop *loop;
    int ret;

    if (max_concurrent < 1)
        return KS_EINVAL;
    exec_global_init();
    loop = malloc(sizeof(*loop));
    if (!loop)
        return -ENOMEM;
    ret = loop_init(loop, true);
    if (ret)
        goto fail;
    loop->max_concurrent = max_concurrent;
    loop->wd.dead_ms = opts->watchdog_ms;
    loop->wd.retry_at_us = NEVER;
    loop->next_id = 1;
    pthread_mutex_init(&loop->mu, NULL);
    loop->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (loop->evfd == -1) {
        ret = -errno;
        goto fail;
    }
    loop->evw.kind = W_EVENT;
    watch_add(loop, loop->evfd, &loop->evw, EPOLLIN);
    ret = -pthread_create(&loop->thr, NULL, loop_main, loop);
    if (ret)
        goto fail;
    *out = loop;
    return 0;
fail:
    if (loop->evfd != -1)
        close(loop->evfd);
    if (loop->epfd != -1)
        close(loop->epfd);
    free(loop);
    return ret;
}

static void
wake(struct exec_loop *loop)
{
    uint64_t one = 1;

    /* EAGAIN only when the counter is full: the loop is awake anyway. */
    if (write(loop->evfd, &one, sizeof(one)) == -1)
        (void)errno;
}

void
exec_loop_free(struct exec_loop *loop)
{
    if (!loop)
        return;
    BUG_ON(pthread_equal(pthread_self(), loop->thr));
    pthread_mutex_lock(&loop->mu);
    loop->stopping = true;
    for (struct exec_job *j = loop->active; j; j = j->next)
        j->cancel_req = true;
    loop->cancel_pending = true;
    pthread_mutex_unlock(&loop->mu);
    wake(loop);
    pthread_join(loop->thr, NULL);
    close(loop->evfd);
    close(loop->epfd);
    pthread_mutex_destroy(&loop->mu);
    free(loop);
}

/* Deep copy of a spec into one block, so the caller's may go away. */
static int
spec_copy(const struct exec_spec *spec, struct exec_job *job)
{
    size_t argc = 0, bytes = 0;
    const char **argv;
    struct exec_env *env;
    char *p;

#define STR_BYTES(s) ((s) ? strlen(s) + 1 : 0)
    while (spec->argv[argc])
        bytes += strlen(spec->argv[argc++]) + 1;
    for (size_t i = 0; i < spec->env_len; i++)
        bytes += STR_BYTES(spec->env[i].name) + STR_BYTES(spec->env[i].value);
    bytes += STR_BYTES(spec->cwd) + STR_BYTES(spec->command_id);
    if (spec->user)
        bytes += STR_BYTES(spec->user->name) + STR_BYTES(spec->user->home);
    bytes += spec->stdin_len;
    /* Aligned parts first (user, groups, env, argv), then the bytes. */
    size_t ngroups = spec->user ? spec->user->n_groups : 0;
    job->blob = malloc(sizeof(struct exec_user) + ngroups * sizeof(gid_t) +
                       (argc + 1) * sizeof(char *) +
                       spec->env_len * sizeof(struct exec_env) + bytes);
    if (!job->blob)
        return -ENOMEM;
    struct exec_user *user = job->blob;
    env = (struct exec_env *)(user + 1);
    argv = (const char **)(env + spec->env_len);
    gid_t *groups = (gid_t *)(argv + argc + 1);
    p = (char *)(groups + ngroups);
#define STR_COPY(dst, s)                                                       \
    do {                                                                       \
        if (s) {                                                               \
            (dst) = p;                                                         \
            p = stpcpy(p, (s)) + 1;                                            \
        } else {                                                               \
            (dst) = NULL;                                                      \
        }                                                                      \
    } while (0)
    for (size_t i = 0; i < argc; i++)
        STR_COPY(argv[i], spec->argv[i]);
    argv[argc] = NULL;
    for (size_t i = 0; i < spec->env_len; i++) {
        STR_COPY(env[i].name, spec->env[i].name);
        STR_COPY(env[i].value, spec->env[i].value);
    }
    job->spec.argv = argv;
    job->spec.env = env;
    STR_COPY(job->spec.cwd, spec->cwd);
    STR_COPY(job->spec.command_id, spec->command_id);
    if (spec->user) {
        *user = *spec->user;
        if (ngroups)
            memcpy(groups, spec->user->groups, ngroups * sizeof(gid_t));
        user->groups = groups;
        STR_COPY(user->name, spec->user->name);
        STR_COPY(user->home, spec->user->home);
        job->spec.user = user;
    }
    if (spec->stdin_len) {
        memcpy(p, spec->stdin_data, spec->stdin_len);
        job->spec.stdin_data = p;
        p += spec->stdin_len;
    }
#undef STR_COPY
#undef STR_BYTES
    return 0;
}

int
exec_submit(struct exec_loop *loop, const struct exec_spec *spec,
            exec_done_fn done, void *ud, uint64_t *job_id_out)
{
    return exec_submit_ex(loop, spec, NULL, done, ud, job_id_out);
}

int
exec_submit_ex(struct exec_loop *loop, const struct exec_spec *spec,
               exec_started_fn started, exec_done_fn done, void *ud,
               uint64_t *job_id_out)
{
    return exec_submit_out(loop, spec, started, NULL, done, ud, job_id_out);
}

int
exec_submit_out(struct exec_loop *loop, const struct exec_spec *spec,
                exec_started_fn started, exec_output_fn output,
                exec_done_fn done, void *ud, uint64_t *job_id_out)
{
    struct exec_job *job;
    int ret;

    BUG_ON(!loop || !done);
    ret = exec__spec_valid(spec);
    if (ret)
        return ret;
    job = calloc(1, sizeof(*job));
    if (!job)
        return -ENOMEM;
    job_init(job, spec);
    ret = spec_copy(spec, job);
    if (ret) {
        job_free(job);
        return ret;
    }
    job->started_cb = started;
    job->output_cb = output;
    job->done = done;
    job->ud = ud;
    pthread_mutex_lock(&loop->mu);
    if (loop->stopping) {
        pthread_mutex_unlock(&loop->mu);
        job_free(job);
        return KS_ESTOPPED;
    }
    job->id = loop->next_id++;
    job->next = loop->active;
    if (loop->active)
        loop->active->prev = job;
    loop->active = job;
    if (loop->qtail)
        loop->qtail->qnext = job;
    else
        loop->qhead = job;
    loop->qtail = job;
    if (job_id_out)
        *job_id_out = job->id;
    pthread_mutex_unlock(&loop->mu);
    wake(loop);
    return 0;
}

static int
request(struct exec_loop *loop, uint64_t job_id, bool kill_now)
{
    int ret = KS_ENOTFOUND;

    pthread_mutex_lock(&loop->mu);
    for (struct exec_job *j = loop->active; j; j = j->next) {
        if (j->id == job_id) {
            if (kill_now)
                j->kill_req = true;
            else
                j->cancel_req = true;
            loop->cancel_pending = true;
            ret = 0;
            break;
        }
    }
    pthread_mutex_unlock(&loop->mu);
    if (ret == 0)
        wake(loop);
    return ret;
}

int
exec_cancel(struct exec_loop *loop, uint64_t job_id)
{
    return request(loop, job_id, false);
}

int
exec_kill(struct exec_loop *loop, uint64_t job_id)
{
    return request(loop, job_id, true);
}

unsigned
exec_loop_running(struct exec_loop *loop)
{
    return atomic_load(&loop->nrunning);
}
