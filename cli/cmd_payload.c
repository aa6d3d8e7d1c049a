/*
 * What `kscore exec` and `kscore batch` send besides argv
 * (docs/scripts-and-files.md): --script FILE [ARG]..., the command's stdin
 * (read when it is not a terminal, --stdin-file FILE, --no-stdin) and
 * --run-as USER[:GROUP]; and how get and events show them (sizes and
 * SHA-256, never the bytes).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "cli_int.h"

/* A recorded SHA-256 in hex (at most 32 bytes of it). */
static void
sum_hex(const ProtobufCBinaryData *sum, char hex[2 * KS_SHA256_BYTES + 1])
{
    ks_hex(sum->data, sum->len < KS_SHA256_BYTES ? sum->len : KS_SHA256_BYTES,
           hex);
}

int
cli_payload_opt(struct cli_payload *p, int opt, const char *arg)
{
    switch (opt) {
    case CLI_OPT_PAYLOAD:
        p->script_path = arg;
        return 1;
    case CLI_OPT_PAYLOAD + 1:
        p->stdin_path = arg;
        return 1;
    case CLI_OPT_PAYLOAD + 2:
        p->no_stdin = true;
        return 1;
    case CLI_OPT_PAYLOAD + 3:
        if (!broker_user_spec_ok(arg)) {
            cli_err("bad --run-as '%s': USER or USER:GROUP (names of "
                    "letters, digits, _, . and -)",
                    arg);
            return -1;
        }
        p->run_as = arg;
        return 1;
    }
    return 0;
}

int
cli_payload_argv(struct cli_payload *p, struct cli_spec *cs, int argc,
                 char **argv, int optind, const char *name)
{
    if (p->stdin_path && p->no_stdin) {
        cli_err("--stdin-file and --no-stdin: give one");
        return -1;
    }
    if (!p->script_path)
        return cli_spec_argv(cs, argc, argv, optind, name);
    /* --script FILE [--] [ARG]...: argv[0] names the script (display:
     * the agent runs its private copy), the rest are its $1... */
    const char *base = strrchr(p->script_path, '/');
    base = base ? base + 1 : p->script_path;
    if (!base[0]) {
        cli_err("--script '%s': not a file name", p->script_path);
        return -1;
    }
    size_t n = optind < argc ? (size_t)(argc - optind) : 0;
    p->argv = calloc(n + 1, sizeof(*p->argv));
    if (!p->argv) {
        cli_err("out of memory");
        return -1;
    }
    p->argv[0] = (char *)base;
    for (size_t i = 0; i < n; i++)
        p->argv[i + 1] = argv[optind + (int)i];
    cs->spec.argv = p->argv;
    cs->spec.n_argv = n + 1;
    return 0;
}

/*
 * Reads fd to its end, at most max bytes: 0 with *buf (malloc'd, NULL when
 * empty) and *len, -EFBIG past max, -errno.
 */
static int
read_capped(int fd, size_t max, uint8_t **buf, size_t *len)
{
    size_t cap = 0, n = 0;
    uint8_t *b = NULL;

    for (;;) {
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 65536;
            if (nc > max + 1)
                nc = max + 1;
            if (nc == cap) {
                free(b);
                return -EFBIG;
            }
            uint8_t *nb = realloc(b, nc);
            if (!nb) {
                free(b);
                return -ENOMEM;
            }
            b = nb;
            cap = nc;
        }
        ssize_t r = read(fd, b + n, cap - n);
        if (r == -1 && errno == EINTR)
            continue;
        if (r == -1) {
            int e = errno;
            free(b);
            return -e;
        }
        if (r == 0)
            break;
        n += (size_t)r;
        if (n > max) {
            free(b);
            return -EFBIG;
        }
    }
    if (n == 0) {
        free(b);
        b = NULL;
    }
    *buf = b;
    *len = n;
    return 0;
}

/* A file's bytes (a regular file, or a pipe such as /dev/stdin). */
static int
read_file(const char *what, const char *path, size_t max, uint8_t **buf,
          size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    struct stat st;
    int rc;

    if (fd == -1) {
        cli_err("%s '%s': %s", what, path, strerror(errno));
        return -1;
    }
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        close(fd);
        cli_err("%s '%s': is a directory", what, path);
        return -1;
    }
    rc = read_capped(fd, max, buf, len);
    close(fd);
    if (rc == -EFBIG) {
        cli_err("%s '%s' is larger than %zu KiB, the most that travels "
                "inside a command: nothing was sent (push a larger file "
                "with kscore copy, then run it there)",
                what, path, max / 1024);
        return -1;
    }
    if (rc) {
        cli_err("%s '%s': %s", what, path, strerror(-rc));
        return -1;
    }
    return 0;
}

/* p's bytes into pl, with their SHA-256. */
static int
payload_set(Ks__Payload *pl, uint8_t sum[KS_SHA256_BYTES], uint8_t *data,
            size_t len, const char *name)
{
    unsigned int n = 0;

    ks__payload__init(pl);
    if (EVP_Digest(data ? data : (uint8_t *)"", len, sum, &n, EVP_sha256(),
                   NULL) != 1 ||
        n != KS_SHA256_BYTES) {
        cli_err("cannot compute a SHA-256");
        return -1;
    }
    pl->data.data = data;
    pl->data.len = len;
    pl->sha256.data = sum;
    pl->sha256.len = KS_SHA256_BYTES;
    pl->name = (char *)(name ? name : "");
    return 0;
}

int
cli_payload_load(struct cli_payload *p, Ks__CommandSpec *spec,
                 bool stdin_too)
{
    if (p->run_as)
        spec->run_as = (char *)p->run_as;
    if (p->script_path) {
        if (read_file("--script", p->script_path, KS_SCRIPT_MAX_BYTES,
                      &p->script, &p->script_len) != 0 ||
            payload_set(&p->script_pl, p->script_sum, p->script,
                        p->script_len, spec->argv[0]) != 0)
            return CLI_EXIT_USAGE;
        spec->script = &p->script_pl;
    }
    if (!stdin_too || p->no_stdin)
        return 0;
    if (p->stdin_path) {
        if (read_file("--stdin-file", p->stdin_path, KS_INPUT_MAX_BYTES,
                      &p->input, &p->input_len) != 0)
            return CLI_EXIT_USAGE;
    } else if (!isatty(0)) {
        /* As ssh and clush: what is piped in goes to the command (a
         * terminal is never read: type into a pipe, `cat | kscore
         * exec ...`). Read whole before anything is sent. */
        int rc = read_capped(0, KS_INPUT_MAX_BYTES, &p->input,
                             &p->input_len);
        if (rc == -EFBIG) {
            cli_err("stdin is larger than %d KiB, the most that travels "
                    "inside a command: nothing was sent (push larger data "
                    "with kscore copy; --no-stdin sends none)",
                    KS_INPUT_MAX_BYTES / 1024);
            return CLI_EXIT_USAGE;
        }
        /* No stdin at all (closed, EBADF) is none. */
        if (rc && rc != -EBADF) {
            cli_err("cannot read stdin: %s (--no-stdin sends none)",
                    strerror(-rc));
            return CLI_EXIT_USAGE;
        }
    }
    if (p->input_len) {
        if (payload_set(&p->input_pl, p->input_sum, p->input, p->input_len,
                        NULL) != 0)
            return CLI_EXIT_USAGE;
        spec->input = &p->input_pl;
    }
    return 0;
}

void
cli_payload_release(struct cli_payload *p)
{
    free(p->script);
    free(p->input);
    free(p->argv);
    p->script = p->input = NULL;
    p->argv = NULL;
}

/* {"name", "bytes", "sha256"} of a payload. */
static json_t *
payload_json(const Ks__Payload *pl, bool with_name)
{
    char hex[2 * KS_SHA256_BYTES + 1];
    json_t *o = json_object();

    sum_hex(&pl->sha256, hex);
    if (with_name)
        json_object_set_new(o, "name", json_string(pl->name));
    json_object_set_new(o, "bytes", json_integer((json_int_t)pl->data.len));
    json_object_set_new(o, "sha256", json_string(hex));
    return o;
}

void
cli_payload_json(json_t *o, const Ks__CommandSpec *sp)
{
    if (sp->script)
        json_object_set_new(o, "script", payload_json(sp->script, true));
    if (sp->input && sp->input->data.len)
        json_object_set_new(o, "stdin", payload_json(sp->input, false));
    if (sp->run_as && sp->run_as[0])
        json_object_set_new(o, "run_as", json_string(sp->run_as));
    if (sp->copy) {
        const Ks__CopySpec *cp = sp->copy;
        json_t *c = json_object(), *files = json_array();
        char hex[2 * KS_SHA256_BYTES + 1];
        for (size_t i = 0; i < cp->n_files; i++) {
            json_t *f = json_object();
            sum_hex(&cp->files[i]->sha256, hex);
            json_object_set_new(f, "name", json_string(cp->files[i]->name));
            json_object_set_new(f, "bytes",
                                json_integer((json_int_t)cp->files[i]->size));
            json_object_set_new(f, "sha256", json_string(hex));
            json_array_append_new(files, f);
        }
        json_object_set_new(c, "to", json_string(cp->path));
        json_object_set_new(c, "files", files);
        json_object_set_new(c, "mode",
                            cp->has_mode ? json_integer(cp->mode)
                                         : json_null());
        json_object_set_new(c, "owner", cp->owner[0]
                                            ? json_string(cp->owner)
                                            : json_null());
        json_object_set_new(o, "copy", c);
    }
}

void
cli_payload_print(FILE *f, const Ks__CommandSpec *sp, const char *indent)
{
    char hex[2 * KS_SHA256_BYTES + 1];

    if (sp->script) {
        sum_hex(&sp->script->sha256, hex);
        fprintf(f, "%sscript    %s (%zu bytes, sha256 %s)\n", indent,
                sp->script->name, sp->script->data.len, hex);
    }
    if (sp->input && sp->input->data.len) {
        sum_hex(&sp->input->sha256, hex);
        fprintf(f, "%sstdin     %zu bytes, sha256 %s\n", indent,
                sp->input->data.len, hex);
    }
    if (sp->run_as && sp->run_as[0])
        fprintf(f, "%srun as    %s\n", indent, sp->run_as);
    if (sp->copy) {
        const Ks__CopySpec *cp = sp->copy;
        fprintf(f, "%scopy to   %s", indent, cp->path);
        if (cp->has_mode)
            fprintf(f, " mode %04o", cp->mode);
        if (cp->owner[0])
            fprintf(f, " owner %s", cp->owner);
        fputc('\n', f);
        for (size_t i = 0; i < cp->n_files; i++) {
            sum_hex(&cp->files[i]->sha256, hex);
            fprintf(f, "%sfile      %s (%llu bytes, sha256 %s)\n", indent,
                    cp->files[i]->name,
                    (unsigned long long)cp->files[i]->size, hex);
        }
    }
}
