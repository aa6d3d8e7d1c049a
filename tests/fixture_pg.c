#include "fixture.h"

#include <check.h>
#include <errno.h>
#include <libpq-fe.h>
#include <time.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
