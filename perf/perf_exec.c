/*
 * perf_exec: what the executor costs on top of a bare spawn.
 *
 *  A  bare posix_spawn("/bin/true") + waitpid, no pipes, no group
 *  B  exec_run("/bin/true"): pipes, own group and cgroup, pidfd, epoll,
 *     the group check, wait4 with rusage
 *
 * Rounds of A and B alternate (DESIGN "Performance culture"), each round
 * RUNS spawn-to-reap latencies; per round p50/p95/p99, then the median of
 * the round p50s, their spread (min-max) and the ratio B/A. Then 100
 * concurrent `sleep 0.1` through one exec_loop: wall time vs the ideal 0.1 s.
 *
 * Usage: perf_exec [--rounds N] [--runs N] [--json]
 */
#include <errno.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"

extern char **environ;

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int64_t
pct(int64_t *sorted, int n, int p)
{
    int i = (int)((int64_t)n * p / 100);
    return sorted[i < n ? i : n - 1];
}

static int
run_bare(void)
{
    char *argv[] = {"/bin/true", NULL};
    pid_t pid;
    int status, rc;

    rc = posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ);
    if (rc)
        return -rc;
    while (waitpid(pid, &status, 0) == -1)
        if (errno != EINTR)
            return -errno;
    return 0;
}

static int
run_exec(void)
{
    const char *argv[] = {"/bin/true", NULL};
    struct exec_spec s = {.argv = argv, .timeout_ms = 10000};
    struct exec_result r;
    int rc = exec_run(&s, &r);

    if (rc == 0 && (r.outcome != EXEC_EXITED || r.exit_code != 0))
        rc = KS_EINTERNAL;
    exec_result_release(&r);
    return rc;
}

struct round {
    int64_t p50, p95, p99;
};

static int
measure(int (*fn)(void), int runs, int64_t *lat, struct round *out)
{
    for (int i = 0; i < runs; i++) {
        int64_t t0 = ks_mono_us();
        int rc = fn();
        if (rc) {
            fprintf(stderr, "run failed: %s\n", ks_strerror(rc));
            return rc;
        }
        lat[i] = ks_mono_us() - t0;
    }
    qsort(lat, (size_t)runs, sizeof(*lat), cmp_i64);
    out->p50 = pct(lat, runs, 50);
    out->p95 = pct(lat, runs, 95);
    out->p99 = pct(lat, runs, 99);
    return 0;
}

static atomic_int g_done;

static void
on_done(uint64_t id, struct exec_result *r, void *ud)
{
    exec_result_release(r);
    atomic_fetch_add(&g_done, 1);
}

/* 100 x sleep 0.1 through one loop; returns the wall time (us). */
static int64_t
loop_wall(void)
{
    const char *argv[] = {"sleep", "0.1", NULL};
    struct exec_spec s = {.argv = argv, .timeout_ms = 10000};
    struct exec_loop *loop;
    int64_t t0;

    if (exec_loop_new(128, &loop))
        return -1;
    atomic_store(&g_done, 0);
    t0 = ks_mono_us();
    for (int i = 0; i < 100; i++)
        if (exec_submit(loop, &s, on_done, NULL, NULL))
            return -1;
    while (atomic_load(&g_done) < 100)
        usleep(200);
    t0 = ks_mono_us() - t0;
    exec_loop_free(loop);
    return t0;
}

int
main(int argc, char **argv)
{
    int rounds = 10, runs = 200, json = 0;
    struct round *ra, *rb;
    int64_t *lat, *p50a, *p50b, wall;
    double ratio;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--rounds N] [--runs N] [--json]\n",
                    argv[0]);
            return 2;
        }
    }
    if (rounds < 1 || runs < 1)
        return 2;
    int cg = exec_global_init();
    ra = calloc((size_t)rounds, sizeof(*ra));
    rb = calloc((size_t)rounds, sizeof(*rb));
    lat = calloc((size_t)runs, sizeof(*lat));
    p50a = calloc((size_t)rounds, sizeof(*p50a));
    p50b = calloc((size_t)rounds, sizeof(*p50b));
    if (!ra || !rb || !lat || !p50a || !p50b)
        return 1;

    /* Warm-up: page cache, the cgroup pool, the first cgroup operation. */
    if (measure(run_bare, runs / 4 + 1, lat, &ra[0]) ||
        measure(run_exec, runs / 4 + 1, lat, &rb[0]))
        return 1;
    if (!json)
        printf("spawn-to-reap of /bin/true, %d rounds x %d runs, cgroups "
               "%s (us)\nround  bare p50/p95/p99     exec p50/p95/p99\n",
               rounds, runs, cg ? "on" : "off");
    for (int r = 0; r < rounds; r++) {
        if (measure(run_bare, runs, lat, &ra[r]) ||
            measure(run_exec, runs, lat, &rb[r]))
            return 1;
        p50a[r] = ra[r].p50;
        p50b[r] = rb[r].p50;
        if (!json)
            printf("%5d  %5lld/%5lld/%5lld    %5lld/%5lld/%5lld\n", r,
                   (long long)ra[r].p50, (long long)ra[r].p95,
                   (long long)ra[r].p99, (long long)rb[r].p50,
                   (long long)rb[r].p95, (long long)rb[r].p99);
    }
    qsort(p50a, (size_t)rounds, sizeof(*p50a), cmp_i64);
    qsort(p50b, (size_t)rounds, sizeof(*p50b), cmp_i64);
    int64_t ma = p50a[rounds / 2], mb = p50b[rounds / 2];
    ratio = (double)mb / (double)ma;
    wall = loop_wall();

    if (json) {
        printf("{\"rounds\":%d,\"runs\":%d,\"cgroups\":%s,"
               "\"bare\":{\"p50_median_us\":%lld,\"p50_min_us\":%lld,"
               "\"p50_max_us\":%lld},"
               "\"exec\":{\"p50_median_us\":%lld,\"p50_min_us\":%lld,"
               "\"p50_max_us\":%lld},\"ratio\":%.3f,"
               "\"loop_100_sleep_0.1_wall_us\":%lld}\n",
               rounds, runs, cg ? "true" : "false", (long long)ma,
               (long long)p50a[0], (long long)p50a[rounds - 1],
               (long long)mb, (long long)p50b[0],
               (long long)p50b[rounds - 1], ratio, (long long)wall);
    } else {
        printf("bare: median p50 %lld us, spread %lld-%lld\n", (long long)ma,
               (long long)p50a[0], (long long)p50a[rounds - 1]);
        printf("exec: median p50 %lld us, spread %lld-%lld\n", (long long)mb,
               (long long)p50b[0], (long long)p50b[rounds - 1]);
        printf("ratio exec/bare: %.3f (target <= 1.15)\n", ratio);
        printf("exec_loop: 100 x sleep 0.1 in %.3f s (ideal 0.100 s)\n",
               (double)wall / 1e6);
    }
    free(ra);
    free(rb);
    free(lat);
    free(p50a);
    free(p50b);
    return 0;
}
