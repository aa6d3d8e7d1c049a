/* The local stack: shared helpers and nats-server. PostgreSQL is in
 * stack_pg.c. */
#include "stack.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kproto.h"

/* Debian installs it in /usr/sbin; $KSCORE_NATS_SERVER overrides. */
static const char *
nats_server_bin(void)
{
    static const char *const cands[] = {"/usr/sbin/nats-server",
                                        "/usr/bin/nats-server",
                                        "/usr/local/bin/nats-server"};
    const char *env = getenv("KSCORE_NATS_SERVER");
    if (env && env[0])
        return env;
    for (size_t i = 0; i < sizeof(cands) / sizeof(cands[0]); i++)
        if (access(cands[i], X_OK) == 0)
            return cands[i];
    return cands[0];
}

/* Binds a TCP socket to 127.0.0.1:port (0: any the kernel gives) and
 * closes it: the port bound, or -errno. */
static int
try_port(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (fd == -1)
        return -errno;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == -1 ||
        getsockname(fd, (struct sockaddr *)&a, &alen) == -1) {
        int e = -errno;
        close(fd);
        return e;
    }
    close(fd);
    return ntohs(a.sin_port);
}

/* The first port of the kernel's ephemeral range (what connect(2) and
 * bind(0) give out), from /proc/sys/net/ipv4/ip_local_port_range. */
static int
ephemeral_low(void)
{
    int lo = 32768, hi = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "re");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2)
            lo = 32768;
        fclose(f);
    }
    return lo;
}

int
stack_free_port(void)
{
    /* Below the ephemeral range: a port bind(0) gives out is one a
     * connect(2) of any process may take as its own before the caller's
     * server binds it, and a node of `kscore up --cluster 3` exited on
     * "bind: address already in use" while suites ran side by side
     * (issue 22). Random picks in the 16384 ports below it, each checked
     * by a bind; bind(0) only when none is free. */
    static _Atomic uint64_t seq;
    int lo = ephemeral_low(), base = lo - 16384 > 1024 ? lo - 16384 : 1024;
    uint64_t x = ((uint64_t)getpid() << 32) ^ (uint64_t)ks_mono_us() ^
                 (++seq * 0x9E3779B97F4A7C15ULL);
    for (int tries = 0; base < lo && tries < 64; tries++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int p = try_port(base + (int)(x % (uint64_t)(lo - base)));
        if (p > 0)
            return p;
    }
    return try_port(0);
}

int
stack_mkdirs(const char *path, unsigned mode)
{
    char buf[4096];
    size_t n = strlen(path);

    if (n == 0 || n >= sizeof(buf))
        return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, mode) == -1 && errno != EEXIST)
            return -errno;
        *p = '/';
    }
    if (mkdir(buf, mode) == -1 && errno != EEXIST)
        return -errno;
    return 0;
}

int
stack_port_free(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1, r;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (port <= 0 || port > 65535)
        return KS_EINVAL;
    if (fd == -1)
        return -errno;
    /* As nats-server (Go) binds: SO_REUSEADDR, so the TIME_WAIT sockets a
     * killed server leaves behind do not count as "taken"; only a
     * listener does. */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    r = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 ? 1
        : errno == EADDRINUSE                           ? 0
                                                        : -errno;
    close(fd);
    return r;
}

int
stack_read_port(const char *dir, const char *file)
{
    char path[4400];
    long v = 0;
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, file);
    if (!(f = fopen(path, "re")))
        return 0;
    if (fscanf(f, "%ld", &v) != 1 || v <= 0 || v > 65535)
        v = 0;
    fclose(f);
    return (int)v;
}

char *
stack_env_get(const char *home, const char *key)
{
    char path[4400], line[8192];
    size_t kl = strlen(key);
    char *v = NULL;
    FILE *f;

    snprintf(path, sizeof(path), "%s/env", home);
    if (!(f = fopen(path, "re")))
        return NULL;
    while (!v && fgets(line, sizeof(line), f))
        if (strncmp(line, key, kl) == 0 && line[kl] == '=') {
            char *s = line + kl + 1;
            s += *s == '\'';
            s[strcspn(s, "'\n")] = '\0';
            v = strdup(s);
        }
    fclose(f);
    return v;
}

int
stack_nats_saved_port(const char *dir)
{
    return stack_read_port(dir, "nats.port");
}

static int
read_pidfile(const char *path, pid_t *pid_out)
{
    FILE *f = fopen(path, "re");
    long v = 0;
    if (!f)
        return -errno;
    if (fscanf(f, "%ld", &v) != 1)
        v = 0;
    fclose(f);
    if (v <= 0)
        return KS_ENOTFOUND;
    *pid_out = (pid_t)v;
    return 0;
}

/* Alive and not a zombie (a zombie can linger until its parent reaps). */
static int
pid_alive(pid_t pid)
{
    char path[64], state = 0;
    FILE *f;
    int r;

    /* EPERM: it exists, it is only not ours to signal (a stack started
     * by root, asked about by another user). */
    if (pid <= 0 || (kill(pid, 0) == -1 && errno != EPERM))
        return 0;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    f = fopen(path, "re");
    if (!f)
        return 0;
    /* "pid (comm) S ...": comm may hold spaces; state follows the last ')'. */
    char line[512];
    r = fgets(line, sizeof(line), f) != NULL;
    fclose(f);
    if (r) {
        char *rp = strrchr(line, ')');
        if (rp && rp[1] == ' ')
            state = rp[2];
    }
    return state && state != 'Z' && state != 'X';
}

int
stack_pid_alive(pid_t pid)
{
    return pid_alive(pid);
}

/* The first line of path (up to cap - 1 bytes, no newline) into buf. */
static int
read_line(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -errno;
    int ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (!ok)
        return KS_ENOTFOUND;
    buf[strcspn(buf, "\n")] = '\0';
    return 0;
}

int
stack_forget_other_boot(const char *dir)
{
    static const char *const pidfiles[] = {"nats.pid", "pg.pid", "broker.pid",
                                           "agent.pid", "pg/postmaster.pid"};
    char now[64], was[64], path[4200];
    struct stat st;
    int rc;

    if (stat(dir, &st) == -1 || !S_ISDIR(st.st_mode))
        return 0;
    if ((rc = read_line("/proc/sys/kernel/random/boot_id", now,
                        sizeof(now))) < 0)
        return rc;
    snprintf(path, sizeof(path), "%s/boot_id", dir);
    rc = read_line(path, was, sizeof(was));
    if (rc == 0 && strcmp(was, now) == 0)
        return 0;
    /* Another boot's (or, without the file, a stack older than it: pid
     * files whose boot nobody knows stay as they are). */
    if (rc == 0) {
        for (size_t i = 0; i < sizeof(pidfiles) / sizeof(pidfiles[0]); i++) {
            snprintf(path, sizeof(path), "%s/%s", dir, pidfiles[i]);
            if (unlink(path) == 0)
                fprintf(stderr,
                        "kscore: %s/%s is from before the last reboot: "
                        "forgotten\n",
                        dir, pidfiles[i]);
        }
        /* PostgreSQL's socket lock (.s.PGSQL.<port>.lock) holds the
         * postmaster's pid too, and it refuses to start while that pid
         * exists. */
        snprintf(path, sizeof(path), "%s/pgsock", dir);
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            size_t n = strlen(e->d_name);
            if (strncmp(e->d_name, ".s.PGSQL.", 9) != 0 || n < 5 ||
                strcmp(e->d_name + n - 5, ".lock") != 0)
                continue;
            snprintf(path, sizeof(path), "%s/pgsock/%s", dir, e->d_name);
            unlink(path);
        }
        if (d)
            closedir(d);
    }
    snprintf(path, sizeof(path), "%s/boot_id", dir);
    FILE *f = fopen(path, "we");
    if (!f)
        return -errno;
    fprintf(f, "%s\n", now);
    return fclose(f) == 0 ? 0 : -errno;
}

int
stack_pidfile_alive(const char *dir, const char *name, pid_t *pid_out)
{
    char path[4096];
    pid_t pid = 0;

    snprintf(path, sizeof(path), "%s/%s.pid", dir, name);
    if (read_pidfile(path, &pid) != 0 || !pid_alive(pid))
        return 0;
    if (pid_out)
        *pid_out = pid;
    return 1;
}

static void
sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/* Sends sig, then waits up to wait_ms for the process to be gone, reaping
 * it if it is our child. */
static int
stop_pid(pid_t pid, int wait_ms)
{
    int64_t deadline = ks_mono_us() + (int64_t)wait_ms * 1000;

    if (kill(pid, SIGTERM) == -1)
        return errno == ESRCH ? 0 : -errno;
    while (ks_mono_us() < deadline) {
        waitpid(pid, NULL, WNOHANG);
        if (!pid_alive(pid))
            return 0;
        sleep_ms(20);
    }
    kill(pid, SIGKILL);
    for (int i = 0; i < 250; i++) {
        waitpid(pid, NULL, WNOHANG);
        if (!pid_alive(pid))
            return 0;
        sleep_ms(20);
    }
    return KS_ETIMEDOUT;
}

static int
tcp_ready(const char *host, int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    char buf[8];
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int ok = 0;

    if (fd == -1)
        return 0;
    if (host && inet_pton(AF_INET, host, &a.sin_addr) != 1)
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
        /* nats-server greets with INFO once it serves clients. */
        struct timeval tv = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ok = read(fd, buf, 4) == 4 && memcmp(buf, "INFO", 4) == 0;
    }
    close(fd);
    return ok;
}

int
stack_nats_start(const char *dir, int port, const char *conf_extra,
                 char **url_out, pid_t *pid_out)
{
    return stack_nats_start_at(dir, "127.0.0.1", port, NULL, conf_extra,
                               url_out, pid_out);
}

int
stack_nats_start_at(const char *dir, const char *host, int port,
                    const char *tls_conf, const char *conf_extra,
                    char **url_out, pid_t *pid_out)
{
    return stack_nats_start_named(dir, host, port, NULL, tls_conf,
                                  conf_extra, url_out, pid_out);
}

int
stack_nats_start_named(const char *dir, const char *host, int port,
                       const char *server_name, const char *tls_conf,
                       const char *conf_extra, char **url_out,
                       pid_t *pid_out)
{
    char conf[4096], store[4096], pidf[4096], sname[128];
    FILE *f;
    pid_t pid;
    int rc;

    rc = stack_mkdirs(dir, 0755);
    if (rc)
        return rc;
    if (port <= 0) {
        port = stack_free_port();
        if (port < 0)
            return port;
    }
    if (server_name && server_name[0])
        snprintf(sname, sizeof(sname), "%s", server_name);
    else
        snprintf(sname, sizeof(sname), "kscore_%d", port);
    snprintf(conf, sizeof(conf), "%s/nats.conf", dir);
    snprintf(store, sizeof(store), "%s/nats", dir);
    snprintf(pidf, sizeof(pidf), "%s/nats.pid", dir);

    /* 0600: no secret in it (users are public NKeys, included from
     * nats-auth.conf), but it is the server's business alone. */
    int cfd = open(conf, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (cfd == -1 || fchmod(cfd, 0600) == -1 || !(f = fdopen(cfd, "w"))) {
        int e = -errno;
        if (cfd != -1)
            close(cfd);
        return e;
    }
    fprintf(f,
            "# written by kscore; regenerated at every start\n"
            "listen: \"%s:%d\"\n"
            "server_name: %s\n"
            "pid_file: \"%s\"\n"
            "max_payload: %d\n"
            "jetstream {\n  store_dir: \"%s\"\n}\n%s%s\n",
            host, port, sname, pidf, KS_MAX_MESSAGE_BYTES, store,
            tls_conf ? tls_conf : "", conf_extra ? conf_extra : "");
    if (fclose(f) != 0)
        return -errno;

    rc = stack_daemon(dir, "nats",
                      (char *const[]){(char *)nats_server_bin(), "-c", conf, NULL},
                      &pid);
    if (rc)
        return rc;
    for (int i = 0; i < 500; i++) {
        if (tcp_ready(host, port)) {
            /* Remembered, so the next start can offer the same port (and
             * remote agents keep their URL): stack_nats_saved_port. */
            char portf[4096];
            snprintf(portf, sizeof(portf), "%s/nats.port", dir);
            FILE *pf = fopen(portf, "we");
            if (pf) {
                fprintf(pf, "%d\n", port);
                fclose(pf);
            }
            if (asprintf(url_out, "%s://%s:%d", tls_conf ? "tls" : "nats",
                         host, port) < 0)
                return -ENOMEM;
            if (pid_out)
                *pid_out = pid;
            return 0;
        }
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return KS_EUNAVAIL;
        sleep_ms(20);
    }
    stop_pid(pid, 2000);
    return KS_ETIMEDOUT;
}

int
stack_nats_stop(const char *dir)
{
    return stack_stop(dir, "nats", 5000);
}

int
stack_stop(const char *dir, const char *name, int wait_ms)
{
    pid_t pid = 0;
    char pidf[4096];
    int rc;

    if (!stack_pidfile_alive(dir, name, &pid))
        return 0;
    rc = stop_pid(pid, wait_ms);
    snprintf(pidf, sizeof(pidf), "%s/%s.pid", dir, name);
    if (rc == 0)
        unlink(pidf);
    return rc;
}

int
stack_daemon(const char *dir, const char *name, char *const argv[],
             pid_t *pid_out)
{
    char log[4096], pidf[4096];
    FILE *f;
    pid_t pid;

    snprintf(log, sizeof(log), "%s/%s.log", dir, name);
    snprintf(pidf, sizeof(pidf), "%s/%s.pid", dir, name);
    pid = fork();
    if (pid == -1)
        return -errno;
    if (pid == 0) {
        /* 0640: logs name users, subjects and commands. */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
        if (fd >= 0)
            fchmod(fd, 0640); /* a log made by an older kscore was 0644 */
        int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (nul >= 0)
            dup2(nul, 0);
        closefrom(3);
        execv(argv[0], argv);
        _exit(127);
    }
    f = fopen(pidf, "we");
    if (f) {
        fprintf(f, "%d\n", (int)pid);
        fclose(f);
    }
    *pid_out = pid;
    return 0;
}
