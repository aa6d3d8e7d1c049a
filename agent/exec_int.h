/*
 * exec_int.h: private declarations of the executor (exec_*.c only).
 *
 * One state machine drives every job: exec_run() runs it on the caller's
 * thread over a private epoll set, an exec_loop runs it on its own thread.
 *
 *  exec_spawn.c  spec checks, environment, PATH resolution, posix_spawn
 *  exec_group.c  process-wide set-up, per-job cgroups, /proc scans, reaping
 *  exec.c        the job state machine, the loop, exec_run, exec_loop_*
 */
#ifndef KSCORE_EXEC_INT_H
#define KSCORE_EXEC_INT_H

#include <limits.h>
#include <stddef.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>

#include "agent.h"

/* The kernel's limit for one argv/env string, NUL included (binfmts.h). */
#define EXEC__MAX_ARG_STRLEN (32 * 4096)

/* Per-job cgroup v2 directory; fds are -1 when the job has no cgroup. */
struct exec__cgroup {
    char path[PATH_MAX];
    unsigned long seq; /* name: j<seq> under the process's kscore-<pid> */
    int dir_fd;    /* the directory, for clone3(CLONE_INTO_CGROUP) */
    int events_fd; /* cgroup.events, read for "populated", polled (PRI) */
    bool in_use;   /* the directory exists */
    bool moved;    /* the leader is in it (cloned into it, or moved) */
    bool killed;   /* cgroup.kill was written: never reused */
};

/* What a job's group holds right now, besides the (zombie) leader. */
struct exec__members {
    unsigned pgroup;  /* live processes in the job's process group */
    unsigned escaped; /* live processes of the job outside its group */
};

/* exec_spawn.c */

/* 0 or KS_EINVAL: argv non-empty, env names valid. */
int exec__spec_valid(const struct exec_spec *spec);
/*
 * Builds the child's environment: the documented base, then spec->env
 * (later entries override). *envp_out is one malloc'd block.
 */
int exec__build_env(const struct exec_spec *spec, char ***envp_out);
/* Value of name in a NULL-terminated envp, or NULL. */
const char *exec__env_get(char *const *envp, const char *name);
/* "/" for NULL or "". */
const char *exec__cwd(const struct exec_spec *spec);
/* 0, or -ENOENT/-ENOTDIR/-EACCES for a cwd the child cannot enter. */
int exec__check_cwd(const char *cwd);
/*
 * Resolves argv[0] against the child's PATH (no '/' in it) into a malloc'd
 * path; with a '/', copies it. -ENOENT/-EACCES like execvp would report.
 */
int exec__resolve(const char *argv0, const char *path_env, char **out);
/*
 * Spawns the leader under the kill protocol. out_fds receive the read ends
 * of stdout/stderr and the write end of stdin, or -1 when the spec has no
 * stdin bytes (all O_CLOEXEC|O_NONBLOCK). On failure returns -errno and
 * sets *stage ("pipe", "spawn", "exec", "chdir"; "user" for a spec with a
 * user, which posix_spawn cannot start: -ENOTSUP).
 */
int exec__spawn(const struct exec_spec *spec, const char *path,
                char *const *envp, pid_t *pid_out, int out_fds[3],
                const char **stage);
/* The child's RLIMIT_NOFILE: soft min(EXEC_CHILD_NOFILE_SOFT, hard), hard
 * ours. */
void exec__child_nofile(struct rlimit *out);

/*
 * Spawns the leader with clone3 (x86_64) and a child of our own code:
 * straight into the cgroup cgroup_fd (CLONE_INTO_CGROUP), or, with
 * cgroup_fd -1, into ours. The same child set-up as exec__spawn(), plus
 * what posix_spawn cannot do: the soft RLIMIT_NOFILE of
 * exec__child_nofile(), and the spec's user (setgroups, setresgid,
 * setresuid: stage "user"). Also returns a pidfd (-1 after the clone(2)
 * fallback below). Without clone3 and without a cgroup, a spec with a user
 * takes the same child on clone(2) (CLONE_VM|CLONE_VFORK). -ENOSYS when
 * the kernel, arch or a filter cannot (valgrind has no clone3): the caller
 * uses exec__spawn().
 *
 * wdc (NULL: none): the watchdog ADD the child sends itself before it runs
 * anything of the command (exec__wd_child_prepare; wdc->sent says whether
 * it did). A child that dies before its execve has it taken back
 * (exec__wd_child_undo) before it is reaped. exec__spawn()'s child cannot
 * send it: the loop registers such a job after the spawn, which leaves the
 * window exec_watchdog.c describes open there.
 */
struct exec__wd_child;
int exec__spawn_cgroup(const struct exec_spec *spec, const char *path,
                       char *const *envp, int cgroup_fd,
                       struct exec__wd_child *wdc, pid_t *pid_out,
                       int *pidfd_out, int out_fds[3], const char **stage);

/* exec_group.c */

/* Process-wide state set by exec_global_init(). */
bool exec__cgroup_enabled(void);
const char *exec__home(void);
/* Creates the job's cgroup directory and opens cgroup.events. */
int exec__cgroup_create(struct exec__cgroup *cg);
/* Moves pid into the cgroup (write to cgroup.procs). */
int exec__cgroup_move(struct exec__cgroup *cg, pid_t pid);
/* 1 if the cgroup has live processes, 0 if not, -errno. */
int exec__cgroup_populated(struct exec__cgroup *cg);
/* Writes 1 to cgroup.kill: SIGKILL to every process in the cgroup. */
int exec__cgroup_kill(struct exec__cgroup *cg);
/*
 * Closes the fds; an unpopulated cgroup goes back to the process's pool,
 * else its directory is removed (kept if survivors remain). Idempotent.
 */
void exec__cgroup_destroy(struct exec__cgroup *cg);
/* 1 if the leader may have forked before the move: dead, or has children. */
int exec__may_have_forked(pid_t pid);
/*
 * Counts live members of the job besides the leader. With a cgroup and
 * !scan_pgroup, from cgroup.procs; else by a /proc scan for the pgid
 * (plus cgroup.procs when there is a cgroup).
 */
void exec__members(pid_t pgid, struct exec__cgroup *cg, bool scan_pgroup,
                   struct exec__members *m);
/* Now on CLOCK_BOOTTIME in clock ticks (the unit of /proc/<pid>/stat). */
uint64_t exec__boot_ticks(void);
/*
 * Without a cgroup, after the leader (pgid) exited: 0 if its group surely
 * has no live member, 1 if a /proc scan is needed. Every live descendant of
 * the leader has a chain of live ancestors up to a child of ours (we are
 * the subreaper), so it is enough to look at our children: one in the
 * group, or one started since since_ticks, means "look closer".
 */
int exec__members_possible(pid_t pgid, uint64_t since_ticks);
/*
 * Reaps what the job left as zombie children of this process (subreaper):
 * members of its process group, and with a cgroup, children whose cgroup is
 * the job's. Never waits for anything else.
 */
void exec__reap_leftovers(pid_t pgid, struct exec__cgroup *cg);
/* waitid(P_PIDFD) wrapper (glibc 2.36 knows P_PIDFD). */
int exec__pidfd_open(pid_t pid);

/* exec_watchdog.c (the protocol is described there) */

/* A loop's watchdog process, as the loop thread sees it. */
struct exec__wd {
    unsigned dead_ms; /* silence after which it kills; 0: no watchdog */
    int fd;           /* our end of the socketpair (O_NONBLOCK), -1: none */
    pid_t pid;
    int64_t next_ping_us, retry_at_us; /* monotonic */
};
/* The protocol's record types (exec_watchdog.c describes each). */
#define EXEC__WD_PING 1
#define EXEC__WD_ADD 2
#define EXEC__WD_DEL 3
#define EXEC__WD_FIRED 4     /* the watchdog's, to the loop */
#define EXEC__WD_ADD_CHILD 5 /* a job's child's own ADD (not the loop's) */
/* One record of the protocol, either way (SOCK_SEQPACKET: one per send). */
struct exec__wd_msg {
    uint32_t type;
    int32_t pgid;
    uint64_t job_id;
    int64_t value;       /* FIRED: the silence (ms) that made it fire */
    char path[PATH_MAX]; /* ADD: the job's cgroup directory, or "" */
};
#define EXEC__WD_HDR_BYTES offsetof(struct exec__wd_msg, path)
/*
 * The ADD a job's child sends itself, after its setpgid and before it runs
 * anything of the command (exec__spawn_cgroup's child): so no process of a
 * job ever runs unregistered, even when the agent is stopped or killed
 * between the clone and the loop's next step. Prepared by the loop thread
 * (exec__wd_child_prepare); the child fills in its pgid and sets `sent`
 * (CLONE_VM|CLONE_VFORK: the loop thread reads it once the child has
 * exec'd or died). fd -1: no watchdog, the child sends nothing.
 */
struct exec__wd_child {
    int fd;        /* the loop's end of the socketpair, or -1 */
    size_t len;    /* bytes of msg to send */
    bool sent;     /* written by the child */
    bool del_lost; /* an undo (DEL) could not be sent: replace the watchdog */
    struct exec__wd_msg msg;
};
/* Prepares the child's ADD of job_id (path: its cgroup directory, or NULL
 * when the child is not cloned into one). wd->fd -1 leaves c->fd -1. */
void exec__wd_child_prepare(struct exec__wd_child *c, const struct exec__wd *wd,
                            uint64_t job_id, const char *path);
/* The child died before its execve: takes its ADD back (DEL, whether or not
 * `sent` says it was sent) before it is reaped, so its pgid is never killed
 * once recycled. Sets del_lost when the DEL cannot be sent (job_start
 * clears it once it has replaced the watchdog). */
void exec__wd_child_undo(struct exec__wd_child *c);
/* Spawns the watchdog: wd->fd and wd->pid on 0, else -errno. */
int exec__wd_spawn(struct exec__wd *wd);
/* Closes our end (the watchdog exits on EOF; SIGKILL first when force) and
 * reaps it. */
void exec__wd_stop(struct exec__wd *wd, bool force);
/* Sends one record without blocking: 0, or -errno (-EAGAIN when the
 * watchdog does not read: the caller replaces it). */
int exec__wd_send(struct exec__wd *wd, unsigned type, uint64_t job_id,
                  pid_t pgid, const char *path);
typedef void (*exec__wd_fired_fn)(uint64_t job_id, int64_t silence_ms,
                                  void *ud);
/* Reads what the watchdog reported (FIRED records) without blocking: 0, or
 * -EPIPE once it is gone. */
int exec__wd_read(struct exec__wd *wd, exec__wd_fired_fn fired, void *ud);

#endif
