/*
 * kscore copy SRC... --to PATH [--mode M] [--owner U[:G]]: files to one
 * agent or a fleet (docs/scripts-and-files.md "Pushing files"). Each file
 * is uploaded once,
 * in parts, named by its SHA-256 (kscore.api.v1.upload: a file the broker
 * has already is not sent again); then the copy runs as a batch
 * (cli_batch_run: the same targets, rate, error budget, progress and
 * grouped results as kscore batch), each target's agent fetching the
 * parts, checking the SHA-256 and renaming the file into place.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "cli_int.h"

#define UPLOAD_TIMEOUT_MS 30000

static const char copy_usage[] =
    "usage: kscore copy TARGETS [RATE] [OPTIONS] SRC... --to PATH\n"
    "Writes the files SRC... on every target agent, each one atomically: to\n"
    "a temporary file beside its destination, checked against its SHA-256,\n"
    "then renamed into place. Exit codes as kscore batch (0: every target\n"
    "has every file).\n"
    "  --to PATH            absolute; the file's own path for one SRC, or the\n"
    "                       directory the files go into (under their names)\n"
    "                       when PATH ends in '/', for several SRC, or when\n"
    "                       it is a directory on the agent. It must exist.\n"
    "  --mode M             octal permission bits (default: those of the file\n"
    "                       it replaces, else 0644)\n"
    "  --owner USER[:GROUP] the files' owner on the agent (default: the\n"
    "                       replaced file's, else the agent's user)\n"
    "  --timeout D  --deliver-within D   as kscore batch\n"
    "Each file at most 256 MiB, at most 64 files; a file is uploaded once\n"
    "per operator (a copy names only files its operator uploaded),\n"
    "named by its SHA-256, and kept by the broker a day after its last copy\n"
    "(copy_keep), within the bounds of its config (copy_operator_mib).\n"
    "Targets, rate control and output: as kscore batch (--agents, --agents\n"
    "@FILE, --select, --all, --online-only, --dry-run, --yes,\n"
    "--confirm-over, --max-concurrency, --max-errors, --strict-errors,\n"
    "--waves, --wave-pause, --json, --detach, --stream); see kscore batch\n"
    "--help.\n"
    CLI_CONN_USAGE;

struct copy_src {
    const char *path;
    const char *name; /* its base name */
    uint64_t size;
    uint8_t sha256[KS_SHA256_BYTES];
};

struct copy_ctx {
    struct copy_src *src;
    size_t n;
};

/* The SHA-256 and size of a regular file. 0 or -1 after printing. */
static int
hash_file(struct copy_src *s)
{
    static uint8_t buf[1 << 16];
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned int n = 0;
    struct stat st;
    int fd = open(s->path, O_RDONLY | O_CLOEXEC | O_NOCTTY), rc = -1;

    if (fd == -1) {
        cli_err("'%s': %s", s->path, strerror(errno));
        goto out;
    }
    if (fstat(fd, &st) == -1 || !S_ISREG(st.st_mode)) {
        cli_err("'%s': not a regular file", s->path);
        goto out;
    }
    if ((uint64_t)st.st_size > KS_COPY_MAX_BYTES) {
        cli_err("'%s' is larger than %llu MiB, the most kscore copy takes: "
                "nothing was sent",
                s->path, (unsigned long long)(KS_COPY_MAX_BYTES >> 20));
        goto out;
    }
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
        goto out;
    s->size = 0;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof(buf));
        if (r == -1 && errno == EINTR)
            continue;
        if (r == -1) {
            cli_err("'%s': %s", s->path, strerror(errno));
            goto out;
        }
        if (r == 0)
            break;
        EVP_DigestUpdate(ctx, buf, (size_t)r);
        s->size += (uint64_t)r;
    }
    if (s->size > KS_COPY_MAX_BYTES) {
        cli_err("'%s' grew past %llu MiB while read", s->path,
                (unsigned long long)(KS_COPY_MAX_BYTES >> 20));
        goto out;
    }
    rc = EVP_DigestFinal_ex(ctx, s->sha256, &n) == 1 &&
                 n == KS_SHA256_BYTES
             ? 0
             : -1;
out:
    EVP_MD_CTX_free(ctx);
    if (fd != -1)
        close(fd);
    return rc;
}

/* One upload request; 0 with *complete, or -1 after printing. */
static int
upload_call(struct evt_conn *c, Ks__UploadRequest *req, const char *path,
            bool *complete)
{
    Ks__UploadReply *rep = NULL;
    int rc = broker_call(c, EVT_API_UPLOAD, &req->base,
                         &ks__upload_reply__descriptor, UPLOAD_TIMEOUT_MS,
                         (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        cli_err("upload '%s': %s", path,
                rc == KS_EUNAVAIL ? "no broker serves kscore.api.v1.upload "
                                    "(an older broker?)"
                : rc              ? ks_strerror(rc)
                                  : rep->error);
        if (rep)
            ks__upload_reply__free_unpacked(rep, NULL);
        return -1;
    }
    *complete = rep->complete;
    ks__upload_reply__free_unpacked(rep, NULL);
    return 0;
}

/*
 * Uploads s unless the broker has it: parts of KS_BLOB_PART_BYTES read
 * again from the file, which must still have the SHA-256 computed before
 * (the commit checks it). 0 or -1 after printing.
 */
static int
upload_file(struct evt_conn *c, const struct copy_src *s)
{
    Ks__UploadRequest req = KS__UPLOAD_REQUEST__INIT;
    uint8_t *buf = NULL;
    bool complete = false;
    int fd = -1, rc = -1;

    req.sha256.data = (uint8_t *)s->sha256;
    req.sha256.len = KS_SHA256_BYTES;
    req.size = s->size;
    req.commit = 1; /* first: is it there already? */
    if (upload_call(c, &req, s->path, &complete) != 0)
        return -1;
    if (complete)
        return 0;
    req.commit = 0;
    if (!(buf = malloc(KS_BLOB_PART_BYTES)) ||
        (fd = open(s->path, O_RDONLY | O_CLOEXEC | O_NOCTTY)) == -1) {
        cli_err("'%s': %s", s->path, strerror(errno));
        goto out;
    }
    /* An empty file has no part: the commit above found it complete. */
    uint32_t parts = ks_blob_parts(s->size);
    for (uint32_t p = 0; p < parts; p++) {
        size_t want = ks_blob_part_len(s->size, p), got = 0;
        while (got < want) {
            ssize_t r = read(fd, buf + got, want - got);
            if (r == -1 && errno == EINTR)
                continue;
            if (r <= 0) {
                cli_err("'%s' changed while it was sent (shorter)", s->path);
                goto out;
            }
            got += (size_t)r;
        }
        req.part = p;
        req.data.data = buf;
        req.data.len = want;
        req.commit = p + 1 == parts;
        if (upload_call(c, &req, s->path, &complete) != 0)
            goto out;
    }
    if (!complete) {
        cli_err("upload '%s': the broker does not have it whole after the "
                "upload (it changed while it was sent?)",
                s->path);
        goto out;
    }
    rc = 0;
out:
    if (fd != -1)
        close(fd);
    free(buf);
    return rc;
}

/* cli_batch_run's prepare: every file uploaded before the copy is asked. */
static int
upload_all(void *ud, struct evt_conn *c)
{
    struct copy_ctx *x = ud;
    for (size_t i = 0; i < x->n; i++)
        if (upload_file(c, &x->src[i]) != 0)
            return CLI_EXIT_KSCORE;
    return 0;
}

int
cmd_copy(int argc, char **argv)
{
    enum { O_TO = 0x3000, O_MODE, O_OWNER, O_TIMEOUT, O_DELIVER };
    static const struct option lo[] = {
        CLI_BATCH_LONGOPTS,
        {"to", required_argument, 0, O_TO},
        {"mode", required_argument, 0, O_MODE},
        {"owner", required_argument, 0, O_OWNER},
        {"timeout", required_argument, 0, O_TIMEOUT},
        {"deliver-within", required_argument, 0, O_DELIVER},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct cli_batch bt;
    struct cli_conn cc = {0};
    Ks__CommandSpec spec = KS__COMMAND_SPEC__INIT;
    Ks__CopySpec cp = KS__COPY_SPEC__INIT;
    Ks__CopyFile *files = NULL, **fps = NULL;
    struct copy_ctx x = {0};
    char **dargv = NULL;
    const char *to = NULL;
    int opt, rc;

    if ((rc = cli_batch_init(&bt, argc, argv)))
        goto out;
    rc = CLI_EXIT_USAGE;
    optind = 1;
    /* Options may follow the files (getopt permutes). */
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        int taken = cli_batch_opt(&bt, opt, optarg);
        if (taken < 0)
            goto out;
        if (taken)
            continue;
        switch (opt) {
        case O_TO:
            to = optarg;
            break;
        case O_MODE: {
            char *end;
            errno = 0;
            long m = strtol(optarg, &end, 8);
            if (errno || !optarg[0] || *end || m < 0 || m > 07777) {
                cli_err("bad --mode '%s': octal permission bits, 0 to 7777",
                        optarg);
                goto out;
            }
            cp.has_mode = 1;
            cp.mode = (uint32_t)m;
            break;
        }
        case O_OWNER:
            if (!broker_user_spec_ok(optarg)) {
                cli_err("bad --owner '%s': USER or USER:GROUP", optarg);
                goto out;
            }
            cp.owner = optarg;
            break;
        case O_TIMEOUT:
        case O_DELIVER: {
            uint64_t ms;
            if (cli_parse_duration(optarg, &ms) != 0) {
                cli_err("bad duration '%s' (use 500ms, 10s, 2m, 1h)", optarg);
                goto out;
            }
            if (opt == O_TIMEOUT)
                spec.timeout_ms = ms;
            else
                bt.req.deliver_within_ms = ms;
            break;
        }
        case 'h':
            fputs(copy_usage, stdout);
            rc = 0;
            goto out;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            cli_err("see kscore copy --help");
            goto out;
        }
    }
    if (cli_batch_check(&bt) != 0)
        goto out;
    if (!to || to[0] != '/') {
        cli_err(to ? "--to '%s': an absolute path on the agents"
                   : "no destination: give --to PATH (absolute)",
                to);
        goto out;
    }
    x.n = optind < argc ? (size_t)(argc - optind) : 0;
    if (x.n == 0 && !bt.req.dry_run) {
        cli_err("no files: kscore copy TARGETS SRC... --to PATH");
        goto out;
    }
    if (x.n > KS_COPY_MAX_FILES) {
        cli_err("%zu files: at most %d per copy", x.n, KS_COPY_MAX_FILES);
        goto out;
    }
    x.src = calloc(x.n + 1, sizeof(*x.src));
    files = calloc(x.n + 1, sizeof(*files));
    fps = calloc(x.n + 1, sizeof(*fps));
    dargv = calloc(x.n + 3, sizeof(*dargv));
    if (!x.src || !files || !fps || !dargv) {
        cli_err("out of memory");
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    /* Shown as `copy a.conf b.conf /etc/app/` in list, get, events. */
    dargv[0] = "copy";
    for (size_t i = 0; i < x.n; i++) {
        struct copy_src *s = &x.src[i];
        s->path = argv[optind + (int)i];
        const char *slash = strrchr(s->path, '/');
        s->name = slash ? slash + 1 : s->path;
        if (!s->name[0] || !strcmp(s->name, ".") || !strcmp(s->name, "..")) {
            cli_err("'%s': not a file name", s->path);
            goto out;
        }
        for (size_t k = 0; k < i; k++)
            if (strcmp(x.src[k].name, s->name) == 0) {
                cli_err("two files named '%s': they would go to the same "
                        "place",
                        s->name);
                goto out;
            }
        if (hash_file(s) != 0)
            goto out;
        ks__copy_file__init(&files[i]);
        files[i].name = (char *)s->name;
        files[i].sha256.data = s->sha256;
        files[i].sha256.len = KS_SHA256_BYTES;
        files[i].size = s->size;
        fps[i] = &files[i];
        dargv[i + 1] = (char *)s->name;
    }
    dargv[x.n + 1] = (char *)to;
    cp.path = (char *)to;
    cp.files = fps;
    cp.n_files = x.n;
    spec.argv = dargv;
    spec.n_argv = x.n + 2;
    spec.copy = x.n ? &cp : NULL; /* none: a dry run lists the targets */
    rc = cli_batch_run(&bt, &cc, &spec, NULL, upload_all, &x);
out:
    free(x.src);
    free(files);
    free(fps);
    free(dargv);
    cli_batch_release(&bt);
    cli_conn_release(&cc);
    return rc;
}
