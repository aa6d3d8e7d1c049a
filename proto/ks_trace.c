/*
 * ks_trace: step timestamps of one command across the client, the broker
 * and the agent, for `kscore perf trace` (kproto.h). Off unless
 * KSCORE_TRACE names a file (or ks_trace_open was called); then every
 * process that stamps appends "<monotonic us> <step> <command id>\n" to it
 * with one write(2) on an O_APPEND descriptor, so lines of several
 * processes never interleave. CLOCK_MONOTONIC is one clock for the whole
 * host, so stamps of different processes compare.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kproto.h"

static pthread_once_t trace_once = PTHREAD_ONCE_INIT;
static atomic_int trace_fd = -1;

static void
trace_env(void)
{
    const char *path = getenv("KSCORE_TRACE");
    if (path && *path && atomic_load(&trace_fd) < 0)
        atomic_store(&trace_fd,
                     open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC,
                          0600));
}

int
ks_trace_open(const char *path)
{
    int fd = -1, old;

    pthread_once(&trace_once, trace_env);
    if (path && (fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC,
                           0600)) < 0)
        return -errno;
    old = atomic_exchange(&trace_fd, fd);
    if (old >= 0)
        close(old);
    return 0;
}

int
ks_trace_on(void)
{
    pthread_once(&trace_once, trace_env);
    return atomic_load(&trace_fd) >= 0;
}

void
ks_trace(const char *step, const char *command_id)
{
    if (ks_trace_on())
        ks_trace_at(step, command_id, ks_mono_us());
}

void
ks_trace_at(const char *step, const char *command_id, int64_t mono_us)
{
    char line[160];
    int n, fd;

    if (!ks_trace_on() || (fd = atomic_load(&trace_fd)) < 0)
        return;
    n = snprintf(line, sizeof(line), "%lld %s %s\n", (long long)mono_us,
                 step, command_id && *command_id ? command_id : "-");
    if (n > 0 && (size_t)n < sizeof(line))
        (void)!write(fd, line, (size_t)n);
}
