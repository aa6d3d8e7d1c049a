/*
 * payload.c: what a command carries beyond argv, made ready for the
 * executor before the claim (docs/scripts-and-files.md):
 *
 *  - CommandSpec.input: the child's stdin bytes (exec_spec.stdin_data);
 *  - CommandSpec.run_as: the user to run as, looked up here (NSS may
 *    block: never on the executor's loop thread) into an exec_user;
 *  - CommandSpec.copy: the owner looked up, a private directory for the
 *    files (fetched after the claim: agent__payload_fetch, copy.c) and
 *    the writer that puts them in place;
 *  - CommandSpec.script: the bytes written to a private file,
 *    <run dir>/<command id>/<name> (the directory 0700, the file 0500,
 *    both owned by the user the command runs as), run by their "#!"
 *    interpreter (execve reads it) or by /bin/sh without one; argv[0]
 *    becomes that path, the script's arguments follow.
 *
 * Each payload's bytes are checked against their SHA-256 (signed with the
 * command) before use. The run dir is one per agent process,
 * mkdtemp("$TMPDIR/kscore-agent-XXXXXX"), mode 0711 (anyone may pass
 * through to their own command's directory, nobody may list it), made at
 * the first script or copy and noted in <state_dir>/run-dir: a restarted
 * agent removes what the last run left there (a crash, kill -9, a power
 * loss) when it starts.
 * A command's directory goes when its job ends, whatever the end (job_free
 * calls agent__payload_free).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "agent_int.h"

#define RUN_DIR_NOTE "run-dir"
/* Deeper than this, what a command left in its directory is left too. */
#define RM_MAX_DEPTH 64

const char *const agent_features[AGENT_N_FEATURES] = {"script", "input",
                                                      "run_as", "copy"};

struct agent_payload {
    char *dir;            /* <run dir>/<command id>, or NULL */
    char *script;         /* the script's path in dir, or NULL */
    const char **argv;    /* the script's argv (NULL: the command's own) */
    char **copy_argv;     /* a copy's writer (copy.c), or NULL */
    struct exec_env copy_env;
    struct exec_user user;
    gid_t *groups;
    char *user_name, *user_home;
};

/* Removes name under dfd and everything in it, never following a symlink
 * (a command's user owns its directory and may have put anything there,
 * a link to /etc included). */
static void
rm_tree_at(int dfd, const char *name, int depth)
{
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW |
                                   O_CLOEXEC | O_NOCTTY);
    DIR *d;
    struct dirent *de;

    if (fd == -1) {
        unlinkat(dfd, name, 0); /* a file, a link, or gone */
        return;
    }
    if (depth >= RM_MAX_DEPTH || !(d = fdopendir(fd))) {
        close(fd);
        return;
    }
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            rm_tree_at(dirfd(d), de->d_name, depth + 1);
    closedir(d);
    unlinkat(dfd, name, AT_REMOVEDIR);
}

/* Removes path (a directory) and what it holds. */
static void
rm_tree(const char *path)
{
    rm_tree_at(AT_FDCWD, path, 0);
}

/* The directory under which run dirs are made: $TMPDIR when absolute. */
static const char *
tmp_base(void)
{
    const char *t = getenv("TMPDIR");
    return t && t[0] == '/' ? t : "/tmp";
}

/* What the last run of this state dir left: its run dir, if the note
 * names one that is ours (a directory, not a link, owned by us). */
static void
remove_previous(const char *note)
{
    char buf[PATH_MAX] = "";
    struct stat st;
    FILE *f = fopen(note, "re");

    if (!f)
        return;
    if (fgets(buf, sizeof(buf), f))
        buf[strcspn(buf, "\n")] = '\0';
    fclose(f);
    if (buf[0] != '/' || !strstr(buf, "/kscore-agent-") ||
        lstat(buf, &st) == -1 || !S_ISDIR(st.st_mode) ||
        st.st_uid != geteuid())
        return;
    rm_tree(buf);
    ks_log(KS_LOG_INFO, "removed what the last run left of its commands' "
                        "private files",
           KS_S("dir", buf));
}

int
agent__payload_init(struct agent *a, char **errmsg)
{
    char note[PATH_MAX];

    (void)errmsg;
    if (a->state_dir) {
        snprintf(note, sizeof(note), "%s/" RUN_DIR_NOTE, a->state_dir);
        remove_previous(note);
        unlink(note);
    }
    return 0;
}

/* This run's directory, made at its first use (an agent that runs no
 * script and no copy leaves nothing in $TMPDIR) and noted in the state
 * dir before anything goes into it: a crash from then on leaves nothing
 * the next start does not find. 0 or -errno with why. */
static int
run_dir(struct agent *a, char *why, size_t len)
{
    char note[PATH_MAX], tmp[PATH_MAX + 8], templ[PATH_MAX];
    int rc = 0;

    pthread_mutex_lock(&a->mu);
    if (a->run_dir)
        goto out;
    snprintf(templ, sizeof(templ), "%s/kscore-agent-XXXXXX", tmp_base());
    if (!mkdtemp(templ) || chmod(templ, 0711) == -1) {
        rc = -errno;
        snprintf(why, len, "cannot make a private directory in %s: %s",
                 tmp_base(), strerror(-rc));
        goto out;
    }
    if (!(a->run_dir = strdup(templ))) {
        rmdir(templ);
        rc = -ENOMEM;
        goto out;
    }
    if (a->state_dir) {
        FILE *f;
        snprintf(note, sizeof(note), "%s/" RUN_DIR_NOTE, a->state_dir);
        snprintf(tmp, sizeof(tmp), "%s.tmp", note);
        f = fopen(tmp, "we");
        if (!f || fprintf(f, "%s\n", templ) < 0 || fclose(f) != 0 ||
            rename(tmp, note) == -1)
            ks_log(KS_LOG_WARN,
                   "cannot note the private directory: a crash would leave "
                   "it behind",
                   KS_S("dir", templ), KS_S("error", strerror(errno)));
    }
out:
    pthread_mutex_unlock(&a->mu);
    return rc;
}

void
agent__payload_release(struct agent *a)
{
    char note[PATH_MAX];

    if (!a->run_dir)
        return;
    rm_tree(a->run_dir);
    free(a->run_dir);
    a->run_dir = NULL;
    if (a->state_dir) {
        snprintf(note, sizeof(note), "%s/" RUN_DIR_NOTE, a->state_dir);
        unlink(note);
    }
}

int
agent__payload_sha256(const void *data, size_t len,
                      uint8_t out[KS_SHA256_BYTES])
{
    unsigned int n = 0;

    if (EVP_Digest(data, len, out, &n, EVP_sha256(), NULL) != 1 ||
        n != KS_SHA256_BYTES)
        return KS_EINTERNAL;
    return 0;
}

/* 0 if p's data has p's sha256; else -EBADMSG with why. */
static int
check_sum(const Ks__Payload *p, const char *what, char *why, size_t len)
{
    uint8_t md[KS_SHA256_BYTES];

    if (p->sha256.len != KS_SHA256_BYTES ||
        agent__payload_sha256(p->data.data, p->data.len, md) != 0 ||
        memcmp(md, p->sha256.data, KS_SHA256_BYTES) != 0) {
        snprintf(why, len, "the %s's bytes do not match their SHA-256", what);
        return -EBADMSG;
    }
    return 0;
}

int
agent__user_lookup(const char *spec, struct exec_user *u, gid_t **groups,
                   char **name, char **home, char *why, size_t len)
{
    char user[256], *colon;
    struct passwd pw, *pwp = NULL;
    struct group gr, *grp = NULL;
    char *buf = NULL;
    long bl = sysconf(_SC_GETPW_R_SIZE_MAX);
    size_t blen = bl > 0 ? (size_t)bl : 16384;
    int ng = 32, rc;

    snprintf(user, sizeof(user), "%s", spec);
    colon = strchr(user, ':');
    if (colon)
        *colon++ = '\0';
    *groups = NULL;
    *name = *home = NULL;
    for (;;) {
        if (!(buf = realloc(buf, blen)))
            return -ENOMEM;
        rc = getpwnam_r(user, &pw, buf, blen, &pwp);
        if (rc != ERANGE)
            break;
        blen *= 2;
    }
    if (!pwp) {
        snprintf(why, len, "no user '%.64s' on this agent%s%s", user,
                 rc ? ": " : "", rc ? strerror(rc) : "");
        free(buf);
        return rc ? -rc : -ENOENT;
    }
    u->uid = pw.pw_uid;
    u->gid = pw.pw_gid;
    *name = strdup(pw.pw_name);
    *home = strdup(pw.pw_dir && pw.pw_dir[0] ? pw.pw_dir : "/");
    if (colon) {
        char *gbuf = NULL;
        size_t glen = 16384;
        for (;;) {
            if (!(gbuf = realloc(gbuf, glen))) {
                rc = ENOMEM;
                break;
            }
            rc = getgrnam_r(colon, &gr, gbuf, glen, &grp);
            if (rc != ERANGE)
                break;
            glen *= 2;
        }
        if (grp)
            u->gid = grp->gr_gid;
        free(gbuf);
        if (!grp) {
            snprintf(why, len, "no group '%.64s' on this agent%s%s", colon,
                     rc ? ": " : "", rc ? strerror(rc) : "");
            free(buf);
            free(*name);
            free(*home);
            *name = *home = NULL;
            return rc ? -rc : -ENOENT;
        }
    }
    /* initgroups(3)'s list: the user's groups, and the primary one. */
    for (;;) {
        gid_t *g = realloc(*groups, (size_t)ng * sizeof(gid_t));
        int n = ng;
        if (!g) {
            rc = -ENOMEM;
            goto fail;
        }
        *groups = g;
        if (getgrouplist(pw.pw_name, u->gid, g, &n) != -1) {
            ng = n;
            break;
        }
        /* Too small: n says how many there are (or, on old libcs,
         * nothing useful: grow anyway). */
        ng = n > ng ? n : ng * 2;
        if (ng > 65536) {
            rc = -E2BIG;
            goto fail;
        }
    }
    free(buf);
    if (!*name || !*home) {
        rc = -ENOMEM;
        goto fail_nobuf;
    }
    u->groups = *groups;
    u->n_groups = (size_t)ng;
    u->name = *name;
    u->home = *home;
    return 0;
fail:
    free(buf);
fail_nobuf:
    free(*groups);
    free(*name);
    free(*home);
    *groups = NULL;
    *name = *home = NULL;
    return rc;
}

/* A safe file name for the script: its own base name when it is one. */
static const char *
script_file_name(const Ks__Payload *s)
{
    const char *n = s->name;
    if (!n[0] || strchr(n, '/') || !strcmp(n, ".") || !strcmp(n, "..") ||
        strlen(n) > 128)
        return "script";
    return n;
}

/* <run dir>/<command id>, 0700, ours for now (the user gets it only once
 * what it holds is done): 0 with p->dir. */
static int
private_dir(struct agent *a, const Ks__Command *cmd, struct agent_payload *p,
            char *why, size_t len)
{
    int rc = 0;

    if ((rc = run_dir(a, why, len)))
        return rc;
    if (asprintf(&p->dir, "%s/%s", a->run_dir, cmd->command_id) < 0) {
        p->dir = NULL;
        return -ENOMEM;
    }
    if (mkdir(p->dir, 0700) == -1) {
        rc = -errno;
        if (rc == -EEXIST) {
            /* A redelivery of a command this process already prepared
             * and gave up: start again from nothing. */
            rm_tree(p->dir);
            rc = mkdir(p->dir, 0700) == -1 ? -errno : 0;
        }
    }
    if (rc)
        snprintf(why, len, "cannot make %s: %s", p->dir, strerror(-rc));
    return rc;
}

/* A copy (copy.c): its owner looked up, its spool directory, the writer's
 * argv and environment. */
static int
prepare_copy(struct agent *a, const Ks__Command *cmd,
             struct agent_payload *p, struct exec_spec *spec,
             const char **stage, char *why, size_t len)
{
    const Ks__CopySpec *cp = cmd->spec->copy;
    struct exec_user owner = {0};
    gid_t *groups = NULL;
    char *name = NULL, *home = NULL;
    int rc;

    if (cp->owner[0]) {
        *stage = "owner";
        rc = agent__user_lookup(cp->owner, &owner, &groups, &name, &home, why,
                                len);
        free(groups);
        free(name);
        free(home);
        if (rc)
            return rc;
    }
    *stage = "copy";
    if ((rc = private_dir(a, cmd, p, why, len)) ||
        (rc = agent__copy_argv(cp, p->dir, cp->owner[0] ? &owner : NULL,
                               &p->copy_argv)))
        return rc;
    /* The writer is this binary (copy.c): only its marker, no env of the
     * command's. */
    p->copy_env.name = agent__copy_env;
    p->copy_env.value = "1";
    spec->argv = (const char *const *)p->copy_argv;
    spec->env = &p->copy_env;
    spec->env_len = 1;
    spec->cwd = "/";
    return 0;
}

bool
agent__payload_fetches(const struct agent_payload *p)
{
    return p && p->copy_argv;
}

int
agent__payload_fetch(struct agent *a, struct job_ctx *j,
                     const Ks__Command *cmd, char *why, size_t len)
{
    if (!agent__payload_fetches(j->payload))
        return 0;
    return agent__copy_fetch(a, j, cmd, j->payload->dir, why, len);
}

/* Writes the script into its private directory (0700 dir, 0500 file, the
 * user's): 0 with p->dir and the path in *path_out (malloc'd). */
static int
write_script(struct agent *a, const Ks__Command *cmd, struct agent_payload *p,
             char **path_out, char *why, size_t len)
{
    const Ks__Payload *s = cmd->spec->script;
    const struct exec_user *u = p->user.name ? &p->user : NULL;
    const char *fname = script_file_name(s);
    size_t at = 0;
    char *path = NULL;
    int fd = -1, rc = 0;

    if ((rc = private_dir(a, cmd, p, why, len)))
        return rc;
    if (asprintf(&path, "%s/%s", p->dir, fname) < 0)
        return -ENOMEM;
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
              0700);
    if (fd == -1) {
        rc = -errno;
        goto fail;
    }
    while (at < s->data.len) {
        ssize_t n = write(fd, s->data.data + at, s->data.len - at);
        if (n == -1 && errno == EINTR)
            continue;
        if (n <= 0) {
            rc = n == -1 ? -errno : -EIO;
            goto fail;
        }
        at += (size_t)n;
    }
    if (fchmod(fd, 0500) == -1 ||
        (u && fchown(fd, u->uid, u->gid) == -1)) {
        rc = -errno;
        goto fail;
    }
    /* Closed before any spawn: execve of a file open for writing is
     * ETXTBSY. */
    if (close(fd) == -1) {
        fd = -1;
        rc = -errno;
        goto fail;
    }
    fd = -1;
    if (u && chown(p->dir, u->uid, u->gid) == -1) {
        rc = -errno;
        goto fail;
    }
    *path_out = path;
    return 0;
fail:
    snprintf(why, len, "cannot write the script to %s: %s", path,
             strerror(-rc));
    if (fd != -1)
        close(fd);
    free(path);
    return rc;
}

int
agent__payload_prepare(struct agent *a, const Ks__Command *cmd,
                       struct exec_spec *spec, struct agent_payload **out,
                       const char **stage, char *why, size_t len)
{
    const Ks__CommandSpec *cs = cmd->spec;
    struct agent_payload *p;
    char *path = NULL;
    int rc = 0;

    *out = NULL;
    if (!cs->input && !cs->script && !cs->run_as[0] && !cs->copy)
        return 0;
    if (!(p = calloc(1, sizeof(*p))))
        return -ENOMEM;
    if (cs->copy) {
        if ((rc = prepare_copy(a, cmd, p, spec, stage, why, len)))
            goto fail;
        *out = p;
        return 0;
    }
    if (cs->input && cs->input->data.len) {
        *stage = "input";
        if ((rc = check_sum(cs->input, "stdin", why, len)))
            goto fail;
        spec->stdin_data = cs->input->data.data;
        spec->stdin_len = cs->input->data.len;
    }
    if (cs->run_as[0]) {
        *stage = "user";
        if ((rc = agent__user_lookup(cs->run_as, &p->user, &p->groups,
                                     &p->user_name, &p->user_home, why,
                                     len)))
            goto fail;
        spec->user = &p->user;
    }
    if (cs->script) {
        size_t n = cs->n_argv ? cs->n_argv - 1 : 0, k = 0;
        bool shebang = cs->script->data.len >= 2 &&
                       cs->script->data.data[0] == '#' &&
                       cs->script->data.data[1] == '!';
        *stage = "script";
        if ((rc = check_sum(cs->script, "script", why, len)) ||
            (rc = write_script(a, cmd, p, &path, why, len)))
            goto fail;
        if (!(p->argv = calloc(n + 3, sizeof(*p->argv)))) {
            rc = -ENOMEM;
            goto fail;
        }
        /* Without "#!" execve says ENOEXEC; a shell runs such a file
         * itself (execvp(3) does the same). */
        if (!shebang)
            p->argv[k++] = "/bin/sh";
        p->argv[k++] = path;
        for (size_t i = 0; i < n; i++)
            p->argv[k++] = cs->argv[i + 1];
        p->argv[k] = NULL;
        spec->argv = p->argv;
        p->script = path;
        path = NULL;
    }
    *out = p;
    return 0;
fail:
    free(path);
    agent__payload_free(p);
    return rc;
}

void
agent__payload_free(struct agent_payload *p)
{
    if (!p)
        return;
    if (p->dir)
        rm_tree(p->dir);
    free(p->script);
    free(p->argv);
    agent__copy_argv_free(p->copy_argv);
    free(p->dir);
    free(p->groups);
    free(p->user_name);
    free(p->user_home);
    free(p);
}
