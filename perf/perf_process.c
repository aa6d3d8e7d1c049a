/*
 * exec_process: the whole `kscore exec -- /bin/true` process, as a user
 * runs it, against the suite's stack. Per round:
 *
 *  exec      50 runs (after 3 untimed) of this kscore binary as
 *            `kscore exec --nats URL --agent perf-0 -- /bin/true`, with
 *            KSCORE_HOME an empty directory of the run (so no user's
 *            $KSCORE_HOME/env or KSCORE_NATS_* is read): wall time from
 *            posix_spawn to waitpid; p50/p95/p99
 *
 * and, in the same round, the parts of its floor (issue 23: "empty C
 * program start + connect + command p50"):
 *
 *  empty     50 runs of /bin/true (a C program that links libc only and
 *            returns at once) under the same environment: process start,
 *            spawn to reap; p50
 *  version   50 runs of the same binary as `kscore --version` (returns
 *            before any connection): kscore's own start and library
 *            loading, reported beside the floor (version - empty is what
 *            kscore's start costs over an empty program); p50
 *  connect   20 evt_connect + evt_close on the suite's nats-server,
 *            in-process, with the cli's options (send_asap); p50
 *  command   20 ExecuteCommand of /bin/true on perf-0 through
 *            broker_execute, in-process; p50 (the floor uses
 *            command_latency's p50 when that scenario ran, this otherwise)
 *
 * Stdout and stderr of the children go to exec_process.log in the run's
 * directory; a run that does not exit 0 counts as an error.
 */
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "perf_int.h"

extern char **environ;

#define PROC_WARM 3

/* environ without the variables the cli reads its stack from, plus
 * KSCORE_HOME=home. Returns a malloc'd array (strings: environ's and
 * *home_var, also malloc'd). */
static char **
child_env(const char *home, char **home_var)
{
    static const char *const drop[] = {"KSCORE_HOME=", "KSCORE_NATS",
                                       "KSCORE_AGENT="};
    size_t n = 0, k = 0;
    char **env;

    while (environ[n])
        n++;
    if (!(env = calloc(n + 2, sizeof(*env))))
        return NULL;
    if (asprintf(home_var, "KSCORE_HOME=%s", home) < 0) {
        free(env);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        bool keep = true;
        for (size_t d = 0; d < sizeof(drop) / sizeof(drop[0]); d++)
            if (strncmp(environ[i], drop[d], strlen(drop[d])) == 0)
                keep = false;
        if (keep)
            env[k++] = environ[i];
    }
    env[k++] = *home_var;
    env[k] = NULL;
    return env;
}

/* Runs argv once; *us: spawn to reap. 0 when it exited 0, KS_EINTERNAL
 * when it exited otherwise, a negative errno when it could not run. */
static int
run_once(char *const argv[], char **env, int log_fd, int64_t *us)
{
    posix_spawn_file_actions_t fa;
    pid_t pid;
    int st, rc;

    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    if (log_fd >= 0) {
        posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
        posix_spawn_file_actions_adddup2(&fa, log_fd, 2);
    }
    int64_t t0 = ks_mono_us();
    rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, env);
    posix_spawn_file_actions_destroy(&fa);
    if (rc)
        return -rc;
    while (waitpid(pid, &st, 0) == -1)
        if (errno != EINTR)
            return -errno;
    *us = ks_mono_us() - t0;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : KS_EINTERNAL;
}

/* n timed runs after PROC_WARM untimed ones; lat gets the successful
 * ones, *ok their number, *errors the others. */
static int
run_many(char *const argv[], char **env, int log_fd, int n, int64_t *lat,
         int *ok, int *errors)
{
    *ok = *errors = 0;
    for (int i = -PROC_WARM; i < n && !perf__interrupted; i++) {
        int64_t us = 0;
        int rc = run_once(argv, env, log_fd, &us);
        if (rc < 0)
            return rc;
        if (i < 0)
            continue;
        if (rc)
            (*errors)++;
        else
            lat[(*ok)++] = us;
    }
    return perf__interrupted ? -EINTR : 0;
}

static int
connect_p50(const struct perf_stack *st, int n, int64_t *lat, int64_t *p50)
{
    struct evt_connect_opts co = {.name = "kscore-perf-connect",
                                  .send_asap = true};
    for (int i = -2; i < n; i++) {
        struct evt_conn *c = NULL;
        char *errmsg = NULL;
        int64_t t0 = ks_mono_us();
        int rc = evt_connect(st->nats_url, &co, &c, &errmsg);
        evt_close(c);
        if (rc) {
            fprintf(stderr, "kscore perf: exec_process connect: %s\n",
                    errmsg ? errmsg : ks_strerror(rc));
            free(errmsg);
            return rc;
        }
        if (i >= 0)
            lat[i] = ks_mono_us() - t0;
    }
    perf__sort(lat, (size_t)n);
    *p50 = perf__pct(lat, (size_t)n, 50);
    return 0;
}

static int
command_p50(const struct perf_stack *st, int n, int64_t *lat, int64_t *p50)
{
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    char *argv[] = {"/bin/true"};
    struct evt_conn *c = NULL;
    int rc, k = 0;

    if ((rc = perf__connect(st, "kscore-perf-process", &c)))
        return rc;
    spec.argv = argv;
    spec.n_argv = 1;
    spec.timeout_ms = 10000;
    req.spec = &spec;
    req.agent_id = PERF_AGENT_PREFIX "0";
    for (int i = -2; i < n && !perf__interrupted; i++) {
        Ks__ExecuteReply *rep = NULL;
        int64_t t0 = ks_mono_us();
        rc = broker_execute(c, &req, 30000, &rep);
        int64_t dt = ks_mono_us() - t0;
        if (rc == 0 && (rep->error_code || !rep->result ||
                        rep->result->status != KS__COMMAND_STATUS__SUCCEEDED))
            rc = KS_EINTERNAL;
        if (rep)
            ks__execute_reply__free_unpacked(rep, NULL);
        if (rc == 0 && i >= 0)
            lat[k++] = dt;
    }
    evt_close(c);
    if (k == 0)
        return rc ? rc : KS_EINTERNAL;
    perf__sort(lat, (size_t)k);
    *p50 = perf__pct(lat, (size_t)k, 50);
    return 0;
}

int
perf__process_round(struct perf_ctx *ctx, int round, json_t **out)
{
    int n = ctx->o->quick ? 5 : 50, nc = ctx->o->quick ? 5 : 20;
    int64_t *lat = calloc((size_t)n, sizeof(*lat));
    char home[PATH_MAX + 16], logp[PATH_MAX + 32], *home_var = NULL;
    char **env = NULL;
    int log_fd = -1, ok, errors, verr, rc;
    int64_t empty_p50, ver_p50, conn_p50, cmd_p50;
    json_t *o = NULL;

    (void)round;
    snprintf(home, sizeof(home), "%s/exec-home", ctx->st->dir);
    snprintf(logp, sizeof(logp), "%s/exec_process.log", ctx->st->dir);
    if (!lat) {
        rc = -ENOMEM;
        goto out;
    }
    if (mkdir(home, 0700) != 0 && errno != EEXIST) {
        rc = -errno;
        goto out;
    }
    log_fd = open(logp, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (!(env = child_env(home, &home_var))) {
        rc = -ENOMEM;
        goto out;
    }
    char *empty_argv[] = {"/bin/true", NULL};
    if ((rc = run_many(empty_argv, env, log_fd, n, lat, &ok, &verr)))
        goto out;
    if (ok == 0) {
        fprintf(stderr, "kscore perf: exec_process: /bin/true failed\n");
        rc = KS_EINTERNAL;
        goto out;
    }
    perf__sort(lat, (size_t)ok);
    empty_p50 = perf__pct(lat, (size_t)ok, 50);
    char *ver_argv[] = {ctx->st->bin, "--version", NULL};
    if ((rc = run_many(ver_argv, env, log_fd, n, lat, &ok, &verr)))
        goto out;
    if (ok == 0) {
        fprintf(stderr, "kscore perf: exec_process: %s --version failed\n",
                ctx->st->bin);
        rc = KS_EINTERNAL;
        goto out;
    }
    perf__sort(lat, (size_t)ok);
    ver_p50 = perf__pct(lat, (size_t)ok, 50);
    if ((rc = connect_p50(ctx->st, nc, lat, &conn_p50)) ||
        (rc = command_p50(ctx->st, nc, lat, &cmd_p50)))
        goto out;

    char *exec_argv[] = {ctx->st->bin, "exec",    "--nats",
                         ctx->st->nats_url,       "--agent",
                         PERF_AGENT_PREFIX "0",   "--",
                         "/bin/true",             NULL};
    if ((rc = run_many(exec_argv, env, log_fd, n, lat, &ok, &errors)))
        goto out;
    if (ok == 0) {
        fprintf(stderr, "kscore perf: exec_process: every `kscore exec` "
                        "failed (%s)\n",
                logp);
        rc = KS_EINTERNAL;
        goto out;
    }
    o = json_object();
    perf__lat_json(o, lat, (size_t)ok);
    json_object_set_new(o, "runs", json_integer(n));
    json_object_set_new(o, "errors", json_integer(errors));
    json_object_set_new(o, "empty_p50_us", json_integer(empty_p50));
    json_object_set_new(o, "version_p50_us", json_integer(ver_p50));
    json_object_set_new(o, "connect_p50_us", json_integer(conn_p50));
    json_object_set_new(o, "command_p50_us", json_integer(cmd_p50));
    /* This round's own floor; the target uses command_latency's p50 for
     * the last part when that scenario ran (perf_main.c). */
    json_object_set_new(o, "floor_own_us",
                        json_integer(empty_p50 + conn_p50 + cmd_p50));
    *out = o;
    rc = 0;
out:
    if (log_fd >= 0)
        close(log_fd);
    free(env);
    free(home_var);
    free(lat);
    return rc;
}
