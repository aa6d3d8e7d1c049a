/*
 * stack_pg: the private PostgreSQL cluster of the local stack.
 *
 * Layout under <dir>: pg/ (data, initdb'd once), pgsock/ (Unix socket; no
 * TCP listener unless KSCORE_PG_LISTEN), pg.log, pg.pid (postmaster pid, for stack_pidfile_alive),
 * pg.port (the port chosen the first time, reused so the conninfo of a
 * stack stays the same across restarts).
 *
 * PostgreSQL refuses to run as root ("root" execution of the PostgreSQL
 * server is not permitted", src/backend/main/main.c). When geteuid() == 0,
 * initdb and pg_ctl run as the `postgres` user (fork, setgid, initgroups,
 * setuid), pg/, pgsock/ and pg.log are chowned to it, and every directory
 * from <dir> up to (not including) / gets o+x added, so that user can reach
 * its data (e.g. /root is 0700 on Debian: it becomes 0701, never readable).
 *
 * Authentication (pg_write_auth): no `trust` anywhere. The Unix socket
 * takes peer authentication mapped by pg_ident.conf: the OS user that runs
 * kscore is the role kscore (owner of database kscore, no superuser), and
 * only the server's own OS user is the superuser postgres, which the
 * administration here (role, database) runs as. Any TCP listener
 * (KSCORE_PG_LISTEN, a listen_addresses value; none by default) takes
 * scram-sha-256 only, and no role has a password until someone sets one.
 *
 * KSCORE_PG_FAST=1 in the environment starts the server with fsync=off,
 * synchronous_commit=off and full_page_writes=off: for throwaway test
 * clusters only, a crash can lose or corrupt committed data.
 *
 * Helpers that cli/stack.c also provides (free port, pid file) are private
 * copies here so this file links on its own.
 */
#include "stack.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kproto.h"

#define PG_DEFAULT_BINDIR "/usr/lib/postgresql/15/bin"
#define PG_START_TIMEOUT_S 30
#define PG_STOP_TIMEOUT_S 60

/* Where initdb/pg_ctl/psql live: $KSCORE_PG_BINDIR, else Debian's path. */
static const char *
pg_bindir(void)
{
    const char *e = getenv("KSCORE_PG_BINDIR");
    return e && *e ? e : PG_DEFAULT_BINDIR;
}

/* Adds o+x to path and every parent up to, not including, "/". */
static int
pg_make_traversable(const char *path)
{
    char buf[PATH_MAX];
    struct stat st;
    size_t len = strlen(path);

    if (len >= sizeof(buf))
        return -ENAMETOOLONG;
    memcpy(buf, path, len + 1);
    while (len > 1) {
        if (stat(buf, &st) == -1)
            return -errno;
        if (!(st.st_mode & S_IXOTH) &&
            chmod(buf, (st.st_mode & 07777) | S_IXOTH) == -1)
            return -errno;
        char *slash = strrchr(buf, '/');
        if (!slash || slash == buf)
            break;
        *slash = '\0';
        len = (size_t)(slash - buf);
    }
    return 0;
}

static int
pg_read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n;

    if (fd == -1)
        return -errno;
    n = read(fd, buf, cap - 1);
    if (n == -1) {
        n = -errno;
        close(fd);
        return (int)n;
    }
    close(fd);
    buf[n] = '\0';
    return (int)n;
}

static int
pg_write_file(const char *path, const char *text)
{
    char tmp[PATH_MAX + 8];
    size_t len = strlen(text);
    int fd;

    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return -ENAMETOOLONG;
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd == -1)
        return -errno;
    if (write(fd, text, len) != (ssize_t)len) {
        int err = errno ? -errno : -EIO;
        close(fd);
        unlink(tmp);
        return err;
    }
    close(fd);
    if (rename(tmp, path) == -1)
        return -errno;
    return 0;
}

/*
 * The running postmaster from <dir>/pg/postmaster.pid: line 1 is its pid,
 * line 4 its port (PostgreSQL docs 19.3 / src/include/utils/pidfile.h).
 * Returns 1 if alive (and fills what is asked), else 0.
 */
static int
pg_running(const char *dir, pid_t *pid_out, int *port_out)
{
    char path[PATH_MAX], buf[1024];
    long pid, port = 0;
    char *line;

    if (snprintf(path, sizeof(path), "%s/pg/postmaster.pid", dir) >=
        (int)sizeof(path))
        return 0;
    if (pg_read_file(path, buf, sizeof(buf)) <= 0)
        return 0;
    pid = strtol(buf, NULL, 10);
    if (pid <= 0)
        return 0;
    /* A killed postmaster stays a zombie until its parent (init) reaps
     * it: not running, but its pid still answers kill(pid, 0), and
     * PostgreSQL will not start on a postmaster.pid whose pid exists.
     * Give init a moment; then it is down either way. */
    if (!stack_pid_alive((pid_t)pid)) {
        for (int i = 0; i < 250 && kill((pid_t)pid, 0) == 0; i++) {
            struct timespec ts = {0, 20000000};
            nanosleep(&ts, NULL);
        }
        return 0;
    }
    line = buf;
    for (int i = 0; i < 3 && line; i++) {
        line = strchr(line, '\n');
        if (line)
            line++;
    }
    if (line)
        port = strtol(line, NULL, 10);
    if (pid_out)
        *pid_out = (pid_t)pid;
    if (port_out)
        *port_out = (int)port;
    return 1;
}

/*
 * Runs argv (argv[0] an absolute path) to completion with stdin /dev/null,
 * stdout to out_fd (-1: the log) and stderr to log_fd; as `postgres` when
 * pw is not NULL. Returns the exit status (>= 0) or -errno.
 */
static int
pg_run(char *const argv[], const struct passwd *pw, const char *cwd,
       int log_fd, int out_fd)
{
    pid_t pid = fork();
    int status;

    if (pid == -1)
        return -errno;
    if (pid == 0) {
        int null = open("/dev/null", O_RDONLY);
        if (null == -1 || dup2(null, 0) == -1 ||
            dup2(out_fd >= 0 ? out_fd : log_fd, 1) == -1 ||
            dup2(log_fd, 2) == -1)
            _exit(126);
        if (pw && (setgid(pw->pw_gid) == -1 ||
                   initgroups(pw->pw_name, pw->pw_gid) == -1 ||
                   setuid(pw->pw_uid) == -1))
            _exit(126);
        if (pw) {
            setenv("HOME", pw->pw_dir, 1);
            setenv("USER", pw->pw_name, 1);
            setenv("LOGNAME", pw->pw_name, 1);
        }
        if (cwd && chdir(cwd) == -1)
            _exit(126);
        execv(argv[0], argv);
        _exit(127);
    }
    while (waitpid(pid, &status, 0) == -1)
        if (errno != EINTR)
            return -errno;
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}

static int
pg_chown(const char *path, const struct passwd *pw)
{
    if (pw && chown(path, pw->pw_uid, pw->pw_gid) == -1)
        return -errno;
    return 0;
}

/* Where the administration runs: as the server's OS user (`postgres` when
 * we are root, else ourselves), which pg_ident.conf maps to the superuser
 * role postgres; never as the role kscore. */
struct pg_admin {
    const struct passwd *pw; /* NULL: ourselves */
    const char *dir, *sock, *port;
    int log_fd;
};

/*
 * Runs one SQL command through psql on database db as the superuser. With
 * out (cap bytes), the first row's first column, trimmed ("" for no row).
 * 0, or KS_EUNAVAIL (see the log), -errno.
 */
static int
pg_psql(const struct pg_admin *a, const char *db, const char *sql, char *out,
        size_t cap)
{
    char bin[PATH_MAX];
    int pipefd[2] = {-1, -1}, rc;
    ssize_t n = 0;

    snprintf(bin, sizeof(bin), "%s/psql", pg_bindir());
    char *const argv[] = {bin,          "-X",       "-q",         "-t",
                          "-A",         "-v",       "ON_ERROR_STOP=1",
                          "-h",         (char *)a->sock,          "-p",
                          (char *)a->port,          "-U",         "postgres",
                          "-d",         (char *)db, "-c",         (char *)sql,
                          NULL};
    if (out && pipe2(pipefd, O_CLOEXEC) == -1)
        return -errno;
    rc = pg_run(argv, a->pw, a->dir, a->log_fd, out ? pipefd[1] : -1);
    if (out) {
        close(pipefd[1]);
        n = read(pipefd[0], out, cap - 1);
        close(pipefd[0]);
        out[n > 0 ? n : 0] = '\0';
        out[strcspn(out, "\r\n")] = '\0';
    }
    if (rc < 0)
        return rc;
    return rc == 0 ? 0 : KS_EUNAVAIL;
}

/* A database made by an older kscore belongs to postgres: hand it and
 * everything in its public schema to kscore, once. (REASSIGN OWNED BY
 * postgres is refused: the bootstrap superuser owns the catalogs.) A
 * sequence behind an identity column follows its table. */
static const char pg_handover_sql[] =
    "DO $$\n"
    "DECLARE r record;\n"
    "BEGIN\n"
    "  FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c\n"
    "      JOIN pg_namespace n ON n.oid = c.relnamespace\n"
    "      WHERE n.nspname = 'public' AND c.relowner <> 'kscore'::regrole\n"
    "        AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')\n"
    "        AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid\n"
    "          AND d.classid = 'pg_class'::regclass AND d.deptype IN ('a', 'i'))\n"
    "  LOOP\n"
    "    EXECUTE format('ALTER TABLE %s OWNER TO kscore', r.rel);\n"
    "  END LOOP;\n"
    "  FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p\n"
    "      JOIN pg_namespace n ON n.oid = p.pronamespace\n"
    "      WHERE n.nspname = 'public' AND p.proowner <> 'kscore'::regrole\n"
    "  LOOP\n"
    "    EXECUTE format('ALTER ROUTINE %s OWNER TO kscore', r.fn);\n"
    "  END LOOP;\n"
    "END $$";

/*
 * The role kscore (LOGIN, no superuser, no password: it logs in by peer on
 * the socket; over TCP only once someone gives it a password) and its
 * database kscore. Idempotent.
 */
static int
pg_create_db(const struct pg_admin *a)
{
    char owner[128], bin[PATH_MAX];
    int rc;

    rc = pg_psql(a, "postgres",
                 "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE "
                 "rolname = 'kscore') THEN CREATE ROLE kscore LOGIN; END IF; "
                 "END $$",
                 NULL, 0);
    if (rc == 0)
        rc = pg_psql(a, "postgres",
                     "SELECT pg_get_userbyid(datdba) FROM pg_database "
                     "WHERE datname = 'kscore'",
                     owner, sizeof(owner));
    if (rc)
        return rc;
    if (!owner[0]) {
        snprintf(bin, sizeof(bin), "%s/createdb", pg_bindir());
        char *const argv[] = {bin,    "-h",     (char *)a->sock, "-p",
                              (char *)a->port,  "-U",     "postgres",
                              "-O",   "kscore", "-E",     "UTF8",
                              "kscore", NULL};
        rc = pg_run(argv, a->pw, a->dir, a->log_fd, -1);
        return rc == 0 ? 0 : rc < 0 ? rc : KS_EUNAVAIL;
    }
    if (strcmp(owner, "kscore") == 0)
        return 0;
    rc = pg_psql(a, "postgres", "ALTER DATABASE kscore OWNER TO kscore",
                 NULL, 0);
    return rc ? rc : pg_psql(a, "kscore", pg_handover_sql, NULL, 0);
}

/* A name for pg_hba.conf / pg_ident.conf: double-quoted (both files
 * take quoted names); none of ours has a quote or a line break. */
static int
pg_quotable(const char *name)
{
    return name && name[0] && !strpbrk(name, "\"\r\n");
}

/* Writes path as the server's file (0600, owned by pw when we are root). */
static int
pg_write_owned(const char *path, const char *text, const struct passwd *pw)
{
    int rc = pg_write_file(path, text);
    if (rc == 0 && chmod(path, 0600) == -1)
        rc = -errno;
    if (rc == 0)
        rc = pg_chown(path, pw);
    return rc;
}

/*
 * pg_hba.conf and pg_ident.conf, written at every start so a cluster made
 * by an older kscore (initdb --auth=trust) loses trust too. On the Unix
 * socket: peer authentication (the kernel says which OS user connects),
 * through the map "kscore": the OS user that runs kscore may be the role
 * kscore only, the server's own OS user the superuser postgres (and kscore,
 * when it is the same user). Over TCP, when KSCORE_PG_LISTEN opens a
 * listener: scram-sha-256 only, so no role without a password gets in.
 * PostgreSQL docs 21.1 (pg_hba.conf), 21.2 (user name maps), 21.4 (peer),
 * 21.5 (password: scram-sha-256).
 */
static int
pg_write_auth(const char *data, const struct passwd *pw)
{
    const struct passwd *me = getpwuid(geteuid());
    char me_name[256], server_name[256], path[PATH_MAX + 32], text[2048];
    int rc;

    if (!me)
        return KS_EUNAVAIL;
    snprintf(me_name, sizeof(me_name), "%s", me->pw_name);
    snprintf(server_name, sizeof(server_name), "%s",
             pw ? pw->pw_name : me_name);
    if (!pg_quotable(me_name) || !pg_quotable(server_name))
        return -EINVAL;
    snprintf(path, sizeof(path), "%s/pg_hba.conf", data);
    rc = pg_write_owned(
        path,
        "# written by kscore at every start (cli/stack_pg.c); no trust.\n"
        "# TYPE  DATABASE  USER  ADDRESS  METHOD\n"
        "local   all       all            peer map=kscore\n"
        "host    all       all   all      scram-sha-256\n",
        pw);
    if (rc)
        return rc;
    snprintf(text, sizeof(text),
             "# written by kscore at every start (cli/stack_pg.c)\n"
             "# MAPNAME  SYSTEM-USERNAME  PG-USERNAME\n"
             "kscore  \"%s\"  postgres\n"
             "kscore  \"%s\"  kscore\n"
             "kscore  \"%s\"  kscore\n",
             server_name, server_name, me_name);
    snprintf(path, sizeof(path), "%s/pg_ident.conf", data);
    return pg_write_owned(path, text, pw);
}

static int
pg_conninfo(const char *dir, int port, char **out)
{
    char *s;
    if (asprintf(&s, "host=%s/pgsock port=%d dbname=kscore user=kscore",
                 dir, port) == -1)
        return -ENOMEM;
    *out = s;
    return 0;
}

int
stack_pg_start(const char *dir_arg, int port, char **conninfo_out,
               pid_t *pid_out)
{
    char dir[PATH_MAX], data[PATH_MAX + 8], sock[PATH_MAX + 8],
        logp[PATH_MAX + 8], path[2 * PATH_MAX], bin[PATH_MAX], buf[64],
        portstr[16], opts[2 * PATH_MAX];
    const struct passwd *pw = NULL;
    struct stat st;
    pid_t pid = 0;
    int rc, log_fd = -1, running_port = 0, running;
    char *conninfo = NULL;

    rc = stack_mkdirs(dir_arg, 0755);
    if (rc < 0)
        return rc;
    if (!realpath(dir_arg, dir))
        return -errno;
    /* The path goes into a shell command line inside pg_ctl, quoted. */
    if (strchr(dir, '\'') || strlen(dir) > 80)
        return -EINVAL; /* also: sun_path is 108 bytes */

    running = pg_running(dir, &pid, &running_port);
    if (geteuid() == 0) {
        pw = getpwnam("postgres");
        if (!pw)
            return KS_EUNAVAIL;
        rc = pg_make_traversable(dir);
        if (rc < 0)
            return rc;
    }
    snprintf(data, sizeof(data), "%s/pg", dir);
    snprintf(sock, sizeof(sock), "%s/pgsock", dir);
    snprintf(logp, sizeof(logp), "%s/pg.log", dir);
    if ((mkdir(data, 0700) == -1 && errno != EEXIST) ||
        (mkdir(sock, 0700) == -1 && errno != EEXIST))
        return -errno;
    log_fd = open(logp, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (log_fd == -1)
        return -errno;
    if ((rc = pg_chown(data, pw)) < 0 || (rc = pg_chown(sock, pw)) < 0 ||
        (rc = pg_chown(logp, pw)) < 0)
        goto out;

    if (running) {
        /* Already up (a partial stack): the same authentication rules,
         * applied by a reload (pg_hba.conf and pg_ident.conf are read
         * again on SIGHUP, PostgreSQL docs 21.1), and the same role. */
        port = running_port;
        snprintf(portstr, sizeof(portstr), "%d", port);
        snprintf(bin, sizeof(bin), "%s/pg_ctl", pg_bindir());
        char *const argv[] = {bin, "reload", "-s", "-D", data, NULL};
        if ((rc = pg_write_auth(data, pw)) < 0)
            goto out;
        if ((rc = pg_run(argv, pw, dir, log_fd, -1)) != 0) {
            rc = rc < 0 ? rc : KS_EUNAVAIL;
            goto out;
        }
        goto admin;
    }

    snprintf(path, sizeof(path), "%s/PG_VERSION", data);
    if (stat(path, &st) == -1) {
        snprintf(bin, sizeof(bin), "%s/initdb", pg_bindir());
        char *const argv[] = {bin,
                              "-D",
                              data,
                              "-U",
                              "postgres",
                              "--auth-local=peer",
                              "--auth-host=scram-sha-256",
                              "-E",
                              "UTF8",
                              "--locale=C",
                              "--no-sync",
                              "--no-instructions",
                              NULL};
        rc = pg_run(argv, pw, dir, log_fd, -1);
        if (rc != 0) {
            rc = rc < 0 ? rc : KS_EUNAVAIL;
            goto out;
        }
    }

    snprintf(path, sizeof(path), "%s/pg.port", dir);
    if (port == 0 && pg_read_file(path, buf, sizeof(buf)) > 0)
        port = atoi(buf);
    if (port <= 0) {
        port = stack_free_port();
        if (port < 0) {
            rc = port;
            goto out;
        }
    }
    snprintf(portstr, sizeof(portstr), "%d", port);
    snprintf(buf, sizeof(buf), "%d\n", port);
    if ((rc = pg_write_file(path, buf)) < 0)
        goto out;

    if ((rc = pg_write_auth(data, pw)) < 0)
        goto out;
    /* No TCP listener unless asked for (then scram-sha-256 only). */
    const char *listen = getenv("KSCORE_PG_LISTEN");
    if (!listen)
        listen = "";
    if (strpbrk(listen, "'\" \\")) {
        rc = -EINVAL;
        goto out;
    }
    snprintf(opts, sizeof(opts),
             "-c listen_addresses='%s' -k '%s' -p %d%s", listen, sock, port,
             getenv("KSCORE_PG_FAST") &&
                     strcmp(getenv("KSCORE_PG_FAST"), "1") == 0
                 ? " -c fsync=off -c synchronous_commit=off"
                   " -c full_page_writes=off"
                 : "");
    snprintf(bin, sizeof(bin), "%s/pg_ctl", pg_bindir());
    {
        char tmo[16];
        snprintf(tmo, sizeof(tmo), "%d", PG_START_TIMEOUT_S);
        char *const argv[] = {bin,  "start", "-w",  "-t",  tmo,  "-s", "-D",
                              data, "-l",    logp,  "-o",  opts, NULL};
        rc = pg_run(argv, pw, dir, log_fd, -1);
    }
    if (rc != 0) {
        rc = pg_running(dir, NULL, NULL) ? KS_ETIMEDOUT : KS_EUNAVAIL;
        goto out;
    }
    if (!pg_running(dir, &pid, NULL)) {
        rc = KS_EUNAVAIL;
        goto out;
    }
admin:
    {
        struct pg_admin a = {pw, dir, sock, portstr, log_fd};
        rc = pg_create_db(&a);
    }
    if (rc < 0)
        goto out;
    rc = pg_conninfo(dir, port, &conninfo);
    if (rc < 0)
        goto out;

    snprintf(path, sizeof(path), "%s/pg.pid", dir);
    snprintf(buf, sizeof(buf), "%ld\n", (long)pid);
    rc = pg_write_file(path, buf);
    if (rc < 0)
        goto out;
    *conninfo_out = conninfo;
    conninfo = NULL;
    if (pid_out)
        *pid_out = pid;
    rc = 0;
out:
    free(conninfo);
    if (log_fd != -1)
        close(log_fd);
    return rc;
}

int
stack_pg_stop(const char *dir_arg)
{
    char dir[PATH_MAX], data[PATH_MAX + 8], logp[PATH_MAX + 8],
        path[PATH_MAX + 8], bin[PATH_MAX], tmo[16];
    const struct passwd *pw = NULL;
    pid_t pid;
    int rc = 0, log_fd;

    if (!realpath(dir_arg, dir))
        return errno == ENOENT ? 0 : -errno;
    snprintf(path, sizeof(path), "%s/pg.pid", dir);
    if (!pg_running(dir, &pid, NULL)) {
        /* Its data directory may only be unreadable to us (another user's
         * stack): pg.pid still says whether it runs. */
        if (stack_pidfile_alive(dir, "pg", &pid))
            return -EPERM;
        unlink(path);
        return 0;
    }
    if (geteuid() == 0 && !(pw = getpwnam("postgres")))
        return KS_EUNAVAIL;
    snprintf(data, sizeof(data), "%s/pg", dir);
    snprintf(logp, sizeof(logp), "%s/pg.log", dir);
    snprintf(bin, sizeof(bin), "%s/pg_ctl", pg_bindir());
    snprintf(tmo, sizeof(tmo), "%d", PG_STOP_TIMEOUT_S);
    log_fd = open(logp, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (log_fd == -1)
        log_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (log_fd == -1)
        return -errno;
    char *const argv[] = {bin, "stop", "-w",  "-t", tmo,
                          "-s", "-D",  data, "-m", "fast", NULL};
    rc = pg_run(argv, pw, dir, log_fd, -1);
    close(log_fd);
    if (rc < 0)
        return rc;
    /* pg_ctl -w returns once postmaster.pid is gone; make sure of the pid. */
    for (int i = 0; i < 100 && kill(pid, 0) == 0; i++) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (kill(pid, 0) == 0)
        return -EBUSY;
    unlink(path);
    return 0;
}
