#include "fixture.h"

#include <check.h>
#include <errno.h>
#include <libpq-fe.h>
#include <time.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grp.h>
#include <pwd.h>

#include "kproto.h"
#include "stack.h"

static int
rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

int
fixture_pg_start(struct fixture_pg *out)
{
    const char *tmp = getenv("TMPDIR");
    char dir[PATH_MAX];
    char *conninfo = NULL;
    pid_t pid;
    int rc;

    if (!tmp || !*tmp)
        tmp = "/tmp";
    if (snprintf(dir, sizeof(dir), "%s/kscore-pg-XXXXXX", tmp) >=
        (int)sizeof(dir))
        return -ENAMETOOLONG;
    if (!mkdtemp(dir))
        return -errno;
    setenv("KSCORE_PG_FAST", "1", 0);
    rc = stack_pg_start(dir, 0, &conninfo, &pid);
    if (rc < 0) {
        fprintf(stderr, "fixture_pg_start: %s (%d), see %s/pg.log\n",
                ks_strerror(rc), rc, dir);
        return rc;
    }
    memset(out, 0, sizeof(*out));
    memcpy(out->dir, dir, sizeof(dir));
    out->conninfo = conninfo;
    out->pid = pid;
    return 0;
}

void
fixture_pg_stop(struct fixture_pg *f)
{
    const char *keep = getenv("KSCORE_KEEP_TMP");

    if (!f || !f->dir[0])
        return;
    stack_pg_stop(f->dir);
    if (f->small_disk) {
        /* After the server: its shutdown checkpoint writes there. */
        char mnt[PATH_MAX + 16];
        snprintf(mnt, sizeof(mnt), "%s/evdisk", f->dir);
        umount2(mnt, MNT_DETACH);
        f->small_disk = false;
    }
    if (!(keep && strcmp(keep, "1") == 0))
        nftw(f->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(f->conninfo);
    f->conninfo = NULL;
    f->dir[0] = '\0';
}

int
fixture_pg_halt(struct fixture_pg *f)
{
    int rc = stack_pg_stop(f->dir);
    if (rc < 0)
        fprintf(stderr, "fixture_pg_halt: %s (%d), see %s/pg.log\n",
                ks_strerror(rc), rc, f->dir);
    return rc;
}

int
fixture_pg_resume(struct fixture_pg *f)
{
    char *conninfo = NULL;
    pid_t pid;
    int rc = stack_pg_start(f->dir, 0, &conninfo, &pid);

    if (rc < 0) {
        fprintf(stderr, "fixture_pg_resume: %s (%d), see %s/pg.log\n",
                ks_strerror(rc), rc, f->dir);
        return rc;
    }
    /* The port comes from <dir>/pg.port: the same conninfo as before. */
    if (strcmp(conninfo, f->conninfo) != 0) {
        fprintf(stderr, "fixture_pg_resume: conninfo changed: %s -> %s\n",
                f->conninfo, conninfo);
        free(conninfo);
        return -EINVAL;
    }
    free(conninfo);
    f->pid = pid;
    return 0;
}

int
fixture_pg_restart(struct fixture_pg *f)
{
    int rc = fixture_pg_halt(f);
    return rc < 0 ? rc : fixture_pg_resume(f);
}

/* ---- queries for assertions (tests/fixture.h "Queries") ---- */

long
fixture_pg_long(void *pgconn, const char *sql)
{
    PGconn *pg = pgconn;
    PGresult *r = PQexec(pg, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql,
                  PQerrorMessage(pg));
    long v = PQntuples(r) ? atol(PQgetvalue(r, 0, 0)) : -1;
    PQclear(r);
    return v;
}

long
fixture_sql_long(const char *conninfo, const char *sql)
{
    PGconn *pg = PQconnectdb(conninfo);
    ck_assert_msg(PQstatus(pg) == CONNECTION_OK, "%s", PQerrorMessage(pg));
    long v = fixture_pg_long(pg, sql);
    PQfinish(pg);
    return v;
}

long
fixture_wait_sql(const char *conninfo, const char *sql, long want,
                 int timeout_ms)
{
    long v = -1;
    for (int i = 0; i <= timeout_ms / 50; i++) {
        if ((v = fixture_sql_long(conninfo, sql)) == want)
            return v;
        nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    }
    return v;
}

long
fixture_file_lines(const char *path)
{
    char line[256];
    long n = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        n += strchr(line, '\n') != NULL;
    fclose(f);
    return n;
}

/* ---- a small disk under events (issue 25, F06) ------------------------- */

int
fixture_pg_admin(const struct fixture_pg *f, const char *sql,
                 const char *allowed_sqlstate)
{
    const struct passwd *pw = geteuid() == 0 ? getpwnam("postgres") : NULL;
    char ci[PATH_MAX + 64];
    pid_t pid;
    int st;

    snprintf(ci, sizeof(ci), "%s user=postgres", f->conninfo);
    fflush(NULL);
    if ((pid = fork()) == -1)
        return -1;
    if (pid == 0) {
        if (pw && (setgid(pw->pw_gid) == -1 ||
                   initgroups(pw->pw_name, pw->pw_gid) == -1 ||
                   setuid(pw->pw_uid) == -1))
            _exit(2);
        PGconn *c = PQconnectdb(ci);
        if (PQstatus(c) != CONNECTION_OK) {
            fprintf(stderr, "fixture_pg_admin: %s", PQerrorMessage(c));
            _exit(1);
        }
        PGresult *r = PQexec(c, sql);
        ExecStatusType es = PQresultStatus(r);
        const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
        int ok = es == PGRES_COMMAND_OK || es == PGRES_TUPLES_OK ||
                 (allowed_sqlstate && state &&
                  strcmp(state, allowed_sqlstate) == 0);
        if (!ok)
            fprintf(stderr, "fixture_pg_admin: %s: %s", sql,
                    PQresultErrorMessage(r));
        PQclear(r);
        PQfinish(c);
        _exit(ok ? 0 : 1);
    }
    while (waitpid(pid, &st, 0) == -1 && errno == EINTR)
        ;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

int
fixture_pg_small_disk(struct fixture_pg *f, int size_mb)
{
    const struct passwd *pw = getpwnam("postgres");
    char mnt[PATH_MAX + 16], opts[64], sql[PATH_MAX + 128];

    snprintf(mnt, sizeof(mnt), "%s/evdisk", f->dir);
    snprintf(opts, sizeof(opts), "size=%dm,mode=0700", size_mb);
    if (mkdir(mnt, 0700) == -1 && errno != EEXIST)
        return -1;
    if (mount("tmpfs", mnt, "tmpfs", 0, opts) == -1) {
        fprintf(stderr, "fixture_pg_small_disk: cannot mount a tmpfs at "
                        "%s: %s\n",
                mnt, strerror(errno));
        return KS_EUNAVAIL;
    }
    f->small_disk = true;
    if (pw && chown(mnt, pw->pw_uid, pw->pw_gid) == -1)
        return -1;
    snprintf(sql, sizeof(sql),
             "CREATE TABLESPACE kscore_evdisk LOCATION '%s'", mnt);
    if (fixture_pg_admin(f, sql, NULL) ||
        fixture_pg_admin(f, "ALTER TABLE events SET TABLESPACE kscore_evdisk",
                         NULL))
        return -1;
    return 0;
}

int
fixture_pg_fill_disk(struct fixture_pg *f)
{
    /* Stored as written (PLAIN: no compression, no TOAST), never vacuumed:
     * the pages the failing insert extended the file by stay. 53100 is
     * what it must end with. */
    /* The table committed first: the file of a table whose creation rolls
     * back is removed, and its space with it. */
    if (fixture_pg_admin(
            f,
            "CREATE TABLE IF NOT EXISTS kscore_evdisk_filler (x text)"
            " WITH (autovacuum_enabled = off) TABLESPACE kscore_evdisk;"
            "ALTER TABLE kscore_evdisk_filler ALTER x SET STORAGE PLAIN",
            NULL))
        return -1;
    if (fixture_pg_admin(
            f,
            "INSERT INTO kscore_evdisk_filler"
            " SELECT repeat(md5(i::text), 60)"
            " FROM generate_series(1, 10000000) i",
            "53100"))
        return -1;
    /* And the room left in the pages events has: small committed rows,
     * one a transaction, until none fits (an empty event: every reader
     * decodes it). Else the first appends of the fault still fit there,
     * and rolled-back ones leave dead rows that pruning gives back. */
    return fixture_pg_admin(
        f,
        "DO $$ BEGIN FOR i IN 1..100000 LOOP"
        "  INSERT INTO events (stream_id, version, event_id, type, data)"
        "  VALUES ('kscore-evdisk-filler', i, gen_random_uuid(),"
        "          'DiskFiller', ''::bytea);"
        "  COMMIT;"
        " END LOOP; END $$",
        "53100");
}

int
fixture_pg_free_disk(struct fixture_pg *f)
{
    return fixture_pg_admin(f, "DROP TABLE IF EXISTS kscore_evdisk_filler",
                            NULL);
}

void
fixture_pg_small_disk_undo(struct fixture_pg *f)
{
    char mnt[PATH_MAX + 16];
    if (!f->small_disk)
        return;
    fixture_pg_free_disk(f);
    fixture_pg_admin(f, "ALTER TABLE events SET TABLESPACE pg_default", NULL);
    fixture_pg_admin(f, "DROP TABLESPACE IF EXISTS kscore_evdisk", NULL);
    snprintf(mnt, sizeof(mnt), "%s/evdisk", f->dir);
    if (umount2(mnt, MNT_DETACH) == 0)
        f->small_disk = false;
}
