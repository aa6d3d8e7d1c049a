/*
 * copy.c: kscore copy on the agent (docs/scripts-and-files.md "Pushing files").
 *
 * After the claim the agent fetches each file of the copy from the broker
 * in parts (kscore.api.v1.fetch, as the command's agent) into its private
 * directory, checking the whole against the SHA-256 signed into the
 * command (agent__copy_fetch). Then the executor runs the writer: this
 * same binary re-executed (/proc/self/exe, like the watchdog) with
 * KSCORE_EXEC_COPY in its environment, which a constructor below turns
 * into copy_main() before main() runs. Run as a command, it has the kill
 * protocol, the timeout, cancel and the record of any other command, and
 * none of the agent's memory (its NATS credentials).
 *
 * The writer puts each file beside its destination as an unnamed file
 * (O_TMPFILE: a kill at any point leaves nothing), checks its SHA-256
 * again while it writes, gives it its owner and mode, fsyncs it, names it
 * .<name>.kscore-<random> and renames that over the destination, then
 * fsyncs the directory: readers see the old file or the new one, never a
 * part. Where the file system has no O_TMPFILE the temporary is named
 * from the start and removed on SIGTERM (only a SIGKILL in between leaves
 * it).
 *
 * Writer arguments: SPOOL DEST MODE OWNER then NAME SHA256 SIZE per file;
 * MODE is octal or "-" (keep the mode of the file it replaces, else
 * 0644), OWNER "uid:gid" or "-" (keep the replaced file's, else the
 * agent's user). DEST is a directory (each file under its name) when it
 * ends in '/', when there are several files, or when it is one; else the
 * file's own path.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "agent_int.h"

#define COPY_ENV "KSCORE_EXEC_COPY"
/* One part's answer: within this (ms), waited for in slices of
 * FETCH_SLICE_MS so that a cancel or the agent's stop ends the wait. */
#define FETCH_TIMEOUT_MS 10000
#define FETCH_SLICE_MS 100
/* Tries of one part, and the waits between them (ms): a broker that
 * restarts, or PostgreSQL away for a few seconds, is waited out; a
 * refusal (denied, no such part) is not tried again. */
#define FETCH_TRIES 5
static const int fetch_backoff_ms[FETCH_TRIES - 1] = {250, 500, 1000, 2000};

const char agent__copy_env[] = COPY_ENV;

/* ---- the agent's side: fetch ---------------------------------------------- */

/* 0 while the fetch goes on; -ECANCELED when the command was cancelled
 * or the agent stops (job_done tells which: j->op_cancelled). */
static int
given_up(struct agent *a, struct job_ctx *j)
{
    bool cancelled;
    pthread_mutex_lock(&a->mu);
    cancelled = j->cancel_pending;
    pthread_mutex_unlock(&a->mu);
    return cancelled || atomic_load(&a->closing) ? -ECANCELED : 0;
}

/* Waits ms unless given up meanwhile: 0 or -ECANCELED. */
static int
pause_unless_given_up(struct agent *a, struct job_ctx *j, int ms)
{
    int rc;
    for (int waited = 0; (rc = given_up(a, j)) == 0 && waited < ms;
         waited += FETCH_SLICE_MS)
        nanosleep(&(struct timespec){0, FETCH_SLICE_MS * 1000000L}, NULL);
    return rc;
}

/*
 * One request for a part, as the command's agent: its own subject
 * (kscore.api.v1.fetch.agent-<id>), the answer to its own inbox, or the
 * pool's (a pool's claim: runtime.c). 0 with *reply, -ECANCELED
 * (given_up), or as evt_inbox_next (KS_ETIMEDOUT; KS_EUNAVAIL: nobody
 * serves fetch).
 */
static int
ask_part(struct agent *a, struct job_ctx *j, const Ks__FetchRequest *req,
         natsMsg **reply)
{
    char subject[sizeof(EVT_API_FETCH) + 16 + EVT_AGENT_ID_MAX];
    struct evt_inbox *ib = NULL;
    natsMsg *m = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc;

    snprintf(subject, sizeof(subject), "%s.%s", EVT_API_FETCH,
             j->slot->identity);
    if ((rc = kproto_pack(&req->base, &buf, &len)) ||
        (rc = evt_inbox_take(a->nc,
                             a->opts.pool ? a->pool_identity
                                          : j->slot->identity,
                             &ib)) ||
        (rc = evt_inbox_send(ib, subject, NULL, NULL, buf, len)))
        goto out;
    for (int waited = 0;;) {
        rc = evt_inbox_next(ib, FETCH_SLICE_MS, &m);
        if (rc != KS_ETIMEDOUT)
            break;
        if ((rc = given_up(a, j)))
            goto out;
        if ((waited += FETCH_SLICE_MS) >= FETCH_TIMEOUT_MS) {
            rc = KS_ETIMEDOUT;
            goto out;
        }
    }
    if (rc == 0)
        rc = evt_join_parts(ib, m, FETCH_TIMEOUT_MS, reply);
out:
    evt_inbox_give(ib);
    free(buf);
    return rc;
}

/* A broker's refusal that another try may not meet: its store was away,
 * it stops, or this agent was past its share of failed fetches and
 * claims (KS_EBUSY: broker/budget.c). */
static bool
passing(int error_code)
{
    return error_code == KS_EPGDOWN || error_code == KS_EPGREFUSED ||
           error_code == KS_EUNAVAIL || error_code == KS_ESTOPPED ||
           error_code == KS_ETIMEDOUT || error_code == KS_EBUSY;
}

/* One part, as the command's agent, tried again as the top says. 0 with
 * *rep, -ECANCELED (given_up), or an error, each with why. */
static int
fetch_part(struct agent *a, struct job_ctx *j, const Ks__Command *cmd,
           const Ks__CopyFile *f, uint32_t part, Ks__FetchReply **rep,
           char *why, size_t len)
{
    Ks__FetchRequest req = KS__FETCH_REQUEST__INIT;
    int64_t t0 = ks_mono_us();
    char last[300] = "";
    int rc = 0, t;

    req.command_id = cmd->command_id;
    req.attempt = cmd->attempt;
    req.agent_id = j->slot->id;
    req.sha256 = f->sha256;
    req.part = part;
    for (t = 0; t < FETCH_TRIES; t++) {
        ProtobufCMessage *pm = NULL;
        natsMsg *m = NULL;
        if ((rc = pause_unless_given_up(a, j,
                                        t ? fetch_backoff_ms[t - 1] : 0)))
            break;
        rc = ask_part(a, j, &req, &m);
        if (rc == -ECANCELED)
            break;
        if (rc) {
            snprintf(last, sizeof(last), "%s",
                     rc == KS_EUNAVAIL ? "no broker answers "
                                         "kscore.api.v1.fetch"
                                       : ks_strerror(rc));
            continue;
        }
        rc = evt_unpack(&ks__fetch_reply__descriptor, natsMsg_GetData(m),
                        (size_t)natsMsg_GetDataLength(m), &pm);
        natsMsg_Destroy(m);
        if (rc) {
            snprintf(why, len, "a bad answer to the fetch of '%s': %s",
                     f->name, ks_strerror(rc));
            return rc;
        }
        *rep = (Ks__FetchReply *)pm;
        if (!(*rep)->error_code)
            return 0;
        rc = (*rep)->error_code;
        snprintf(last, sizeof(last), "the broker refused it: %s",
                 (*rep)->error);
        ks__fetch_reply__free_unpacked(*rep, NULL);
        *rep = NULL;
        if (!passing(rc)) {
            snprintf(why, len, "cannot fetch part %u of %u of '%s': %s",
                     part + 1, ks_blob_parts(f->size), f->name, last);
            return rc;
        }
    }
    if (rc == -ECANCELED && atomic_load(&a->closing))
        snprintf(why, len,
                 "the agent stopped while fetching '%s': the copy never ran",
                 f->name);
    else if (rc == -ECANCELED)
        snprintf(why, len, "cancelled while fetching '%s' (part %u of %u)",
                 f->name, part + 1, ks_blob_parts(f->size));
    else
        snprintf(why, len,
                 "cannot fetch part %u of %u of '%s' after %d tries in %.1f "
                 "s: %s",
                 part + 1, ks_blob_parts(f->size), f->name, t,
                 (double)(ks_mono_us() - t0) / 1e6, last);
    return rc;
}

/* File i of the copy into spool/<i>, checked against its SHA-256. */
static int
fetch_file(struct agent *a, struct job_ctx *j, const Ks__Command *cmd,
           const char *spool, size_t i, char *why, size_t len)
{
    const Ks__CopyFile *f = cmd->spec->copy->files[i];
    char path[PATH_MAX];
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int fd, rc = 0;

    snprintf(path, sizeof(path), "%s/%zu", spool, i);
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
              0600);
    if (fd == -1 || !ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        rc = fd == -1 ? -errno : KS_EINTERNAL;
        snprintf(why, len, "cannot spool '%s' in %s: %s", f->name, spool,
                 ks_strerror(rc));
        goto out;
    }
    for (uint32_t p = 0; p < ks_blob_parts(f->size) && rc == 0; p++) {
        Ks__FetchReply *rep = NULL;
        if ((rc = fetch_part(a, j, cmd, f, p, &rep, why, len)))
            break;
        if (rep->data.len != ks_blob_part_len(f->size, p)) {
            rc = -EBADMSG;
            snprintf(why, len, "part %u of '%s' has %zu bytes, not %zu", p,
                     f->name, rep->data.len, ks_blob_part_len(f->size, p));
        }
        for (size_t at = 0; rc == 0 && at < rep->data.len;) {
            ssize_t w = write(fd, rep->data.data + at, rep->data.len - at);
            if (w == -1 && errno == EINTR)
                continue;
            if (w <= 0) {
                rc = w == -1 ? -errno : -EIO;
                snprintf(why, len, "cannot spool '%s' in %s: %s", f->name,
                         spool, strerror(-rc));
            } else {
                at += (size_t)w;
            }
        }
        if (rc == 0 &&
            EVP_DigestUpdate(ctx, rep->data.data, rep->data.len) != 1)
            rc = KS_EINTERNAL;
        ks__fetch_reply__free_unpacked(rep, NULL);
    }
    if (rc == 0 &&
        (EVP_DigestFinal_ex(ctx, md, &n) != 1 || n != KS_SHA256_BYTES ||
         memcmp(md, f->sha256.data, KS_SHA256_BYTES) != 0)) {
        char hex[2 * KS_SHA256_BYTES + 1];
        ks_hex(f->sha256.data, KS_SHA256_BYTES, hex);
        rc = -EBADMSG;
        snprintf(why, len, "'%s' as fetched is not the file of sha256 %s",
                 f->name, hex);
    }
out:
    if (fd != -1 && close(fd) == -1 && rc == 0) {
        rc = -errno;
        snprintf(why, len, "cannot spool '%s': %s", f->name, strerror(-rc));
    }
    EVP_MD_CTX_free(ctx);
    return rc;
}

int
agent__copy_fetch(struct agent *a, struct job_ctx *j, const Ks__Command *cmd,
                  const char *spool, char *why, size_t len)
{
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < cmd->spec->copy->n_files; i++)
        rc = fetch_file(a, j, cmd, spool, i, why, len);
    return rc;
}

int
agent__copy_argv(const Ks__CopySpec *cp, const char *spool,
                 const struct exec_user *owner, char ***argv_out)
{
    size_t n = 5 + 3 * cp->n_files;
    char **argv = calloc(n + 1, sizeof(*argv));
    char num[64];
    int ok = argv != NULL;

    if (!ok)
        return -ENOMEM;
    argv[0] = strdup("/proc/self/exe");
    argv[1] = strdup(spool);
    argv[2] = strdup(cp->path);
    snprintf(num, sizeof(num), "%o", cp->mode);
    argv[3] = strdup(cp->has_mode ? num : "-");
    snprintf(num, sizeof(num), "%u:%u", owner ? (unsigned)owner->uid : 0,
             owner ? (unsigned)owner->gid : 0);
    argv[4] = strdup(owner ? num : "-");
    for (size_t i = 0; i < cp->n_files; i++) {
        char hex[2 * KS_SHA256_BYTES + 1];
        ks_hex(cp->files[i]->sha256.data, KS_SHA256_BYTES, hex);
        snprintf(num, sizeof(num), "%llu",
                 (unsigned long long)cp->files[i]->size);
        argv[5 + 3 * i] = strdup(cp->files[i]->name);
        argv[6 + 3 * i] = strdup(hex);
        argv[7 + 3 * i] = strdup(num);
    }
    for (size_t i = 0; i < n; i++)
        ok &= argv[i] != NULL;
    if (!ok) {
        agent__copy_argv_free(argv);
        return -ENOMEM;
    }
    *argv_out = argv;
    return 0;
}

void
agent__copy_argv_free(char **argv)
{
    if (!argv)
        return;
    for (char **p = argv; *p; p++)
        free(*p);
    free(argv);
}

/* ---- the writer (the re-executed binary) ---------------------------------- */

/* A named temporary to remove if we are told to stop (-1: none). */
static volatile int tmp_dfd = -1;
static char tmp_name[NAME_MAX + 1];

static void
on_term(int sig)
{
    if (tmp_dfd != -1)
        unlinkat(tmp_dfd, tmp_name, 0);
    _exit(128 + sig);
}

/* ".<base>.kscore-<12 random hex>" into tmp_name. */
static void
make_tmp_name(const char *base)
{
    unsigned char r[6] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd != -1) {
        if (read(fd, r, sizeof(r)) != (ssize_t)sizeof(r))
            memset(r, 0, sizeof(r));
        close(fd);
    }
    snprintf(tmp_name, sizeof(tmp_name), ".%.200s.kscore-%02x%02x%02x%02x%02x%02x",
             base, r[0], r[1], r[2], r[3], r[4], r[5]);
}

static int
fail(const char *target, const char *what, int err)
{
    if (tmp_dfd != -1) {
        unlinkat(tmp_dfd, tmp_name, 0);
        tmp_dfd = -1;
    }
    fprintf(stderr, "kscore copy: %s: %s%s%s\n", target, what,
            err ? ": " : "", err ? strerror(err) : "");
    return 1;
}

/* Copies src into fd, hashing it: 0, or -errno / -EBADMSG. */
static int
copy_hashed(int src, int fd, uint64_t size, const char *sha_hex,
            char got_hex[2 * KS_SHA256_BYTES + 1])
{
    static char buf[1 << 16];
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    uint64_t total = 0;
    int rc = 0;

    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return -ENOMEM;
    }
    for (;;) {
        ssize_t r = read(src, buf, sizeof(buf));
        if (r == -1 && errno == EINTR)
            continue;
        if (r == -1) {
            rc = -errno;
            break;
        }
        if (r == 0)
            break;
        EVP_DigestUpdate(ctx, buf, (size_t)r);
        total += (uint64_t)r;
        for (ssize_t at = 0; at < r;) {
            ssize_t w = write(fd, buf + at, (size_t)(r - at));
            if (w == -1 && errno == EINTR)
                continue;
            if (w <= 0) {
                rc = w == -1 ? -errno : -EIO;
                goto out;
            }
            at += w;
        }
    }
    if (rc == 0 && EVP_DigestFinal_ex(ctx, md, &n) == 1) {
        ks_hex(md, KS_SHA256_BYTES, got_hex);
        if (total != size || strcmp(got_hex, sha_hex) != 0)
            rc = -EBADMSG;
    }
out:
    EVP_MD_CTX_free(ctx);
    return rc;
}

/* Writes one file into place. 0 or 1 (said on stderr). */
static int
write_one(const char *spool, size_t i, const char *target, int mode,
          bool has_owner, uid_t uid, gid_t gid, const char *sha_hex,
          uint64_t size)
{
    char dir[PATH_MAX], src_path[PATH_MAX], proc[64];
    char got[2 * KS_SHA256_BYTES + 1] = "";
    const char *base;
    struct stat old;
    bool exists;
    int dfd = -1, src = -1, fd = -1, rc = 1, e;
    bool unnamed = true;

    snprintf(dir, sizeof(dir), "%s", target);
    char *slash = strrchr(dir, '/');
    base = target + (slash - dir) + 1;
    if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    if (!base[0])
        return fail(target, "not a file name", 0);
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd == -1)
        return fail(dir, "cannot open the directory", errno);
    exists = fstatat(dfd, base, &old, AT_SYMLINK_NOFOLLOW) == 0;
    if (exists && S_ISDIR(old.st_mode)) {
        rc = fail(target, "is a directory", 0);
        goto out;
    }
    exists = exists && S_ISREG(old.st_mode);
    if (mode < 0)
        mode = exists ? (int)(old.st_mode & 07777) : 0644;
    if (!has_owner) {
        uid = exists ? old.st_uid : geteuid();
        gid = exists ? old.st_gid : getegid();
    }
    snprintf(src_path, sizeof(src_path), "%s/%zu", spool, i);
    src = open(src_path, O_RDONLY | O_CLOEXEC);
    if (src == -1) {
        rc = fail(target, "cannot read the fetched file", errno);
        goto out;
    }
    make_tmp_name(base);
    fd = openat(dfd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    if (fd == -1 && (errno == EOPNOTSUPP || errno == EISDIR ||
                     errno == EINVAL || errno == ENOENT)) {
        /* No O_TMPFILE here: a named temporary, removed on TERM. */
        unnamed = false;
        tmp_dfd = dfd;
        fd = openat(dfd, tmp_name,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
        if (fd == -1)
            tmp_dfd = -1;
    }
    if (fd == -1) {
        rc = fail(target, "cannot create a file beside it", errno);
        goto out;
    }
    if ((e = -copy_hashed(src, fd, size, sha_hex, got))) {
        rc = fail(target,
                  e == EBADMSG ? "the bytes written are not the file's "
                                 "(sha256 mismatch): left as it was"
                               : "cannot write",
                  e == EBADMSG ? 0 : e);
        goto out;
    }
    /* Owner before mode: chown(2) clears set-user-ID bits. */
    if (fchown(fd, uid, gid) == -1) {
        rc = fail(target, "cannot give it its owner", errno);
        goto out;
    }
    if (fchmod(fd, (mode_t)mode) == -1 || fsync(fd) == -1) {
        rc = fail(target, "cannot set its mode or sync it", errno);
        goto out;
    }
    if (unnamed) {
        /* linkat of /proc/self/fd needs no CAP_DAC_READ_SEARCH, which
         * AT_EMPTY_PATH would (linkat(2)). */
        snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
        tmp_dfd = dfd;
        if (linkat(AT_FDCWD, proc, dfd, tmp_name, AT_SYMLINK_FOLLOW) == -1) {
            tmp_dfd = -1;
            rc = fail(target, "cannot name it", errno);
            goto out;
        }
    }
    if (renameat(dfd, tmp_name, dfd, base) == -1) {
        rc = fail(target, "cannot rename it into place", errno);
        goto out;
    }
    tmp_dfd = -1;
    fsync(dfd); /* the rename itself, across a crash */
    printf("%s: %llu bytes, sha256 %s, mode %04o, owner %u:%u\n", target,
           (unsigned long long)size, got, (unsigned)mode, (unsigned)uid,
           (unsigned)gid);
    rc = 0;
out:
    if (fd != -1)
        close(fd);
    if (src != -1)
        close(src);
    if (dfd != -1)
        close(dfd);
    return rc;
}

static int
copy_main(int argc, char **argv)
{
    struct sigaction sa;
    struct stat st;
    int mode = -1;
    bool has_owner = false, dir_mode;
    unsigned uid = 0, gid = 0;

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    if (argc < 8 || (argc - 5) % 3 != 0) {
        fprintf(stderr, "kscore copy: bad arguments\n");
        return 2;
    }
    const char *spool = argv[1], *dest = argv[2];
    if (strcmp(argv[3], "-") != 0)
        mode = (int)strtol(argv[3], NULL, 8);
    if (strcmp(argv[4], "-") != 0) {
        has_owner = sscanf(argv[4], "%u:%u", &uid, &gid) == 2;
        if (!has_owner) {
            fprintf(stderr, "kscore copy: bad owner '%s'\n", argv[4]);
            return 2;
        }
    }
    size_t n = (size_t)(argc - 5) / 3;
    size_t dl = strlen(dest);
    dir_mode = (dl && dest[dl - 1] == '/') || n > 1 ||
               (stat(dest, &st) == 0 && S_ISDIR(st.st_mode));
    for (size_t i = 0; i < n; i++) {
        const char *name = argv[5 + 3 * i];
        char target[PATH_MAX];
        if (dir_mode)
            snprintf(target, sizeof(target), "%s%s%s", dest,
                     dl && dest[dl - 1] == '/' ? "" : "/", name);
        else
            snprintf(target, sizeof(target), "%s", dest);
        if (write_one(spool, i, target, mode, has_owner, (uid_t)uid,
                      (gid_t)gid, argv[6 + 3 * i],
                      strtoull(argv[7 + 3 * i], NULL, 10)) != 0)
            return 1;
        fflush(stdout);
    }
    return 0;
}

/* glibc passes (argc, argv, envp) to the constructors of a program. */
__attribute__((constructor)) static void
copy_ctor(int argc, char **argv, char **envp)
{
    (void)envp;
    if (!getenv(COPY_ENV))
        return;
    int rc = copy_main(argc, argv);
    fflush(NULL);
    _exit(rc);
}
