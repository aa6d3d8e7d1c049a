/*
 * stack_ident: the identity registry of a local stack.
 *
 * <home>/identities/<name> (dir 0700) holds one entry per NATS user:
 *     kind operator
 *     name alice
 *     nkey U...
 * and nothing secret. The seeds live apart, each in its own 0600 file used
 * only by its holder: <home>/keys/<name>.nk for the broker and the agents
 * (the stack's own daemons), <home>/operators/<name>.nk for operators (to
 * be handed to the person). nats-server's config is rendered from the
 * entries (stack_auth.c), so it holds public keys only.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "kproto.h"
#include "stack.h"

static const char *const kind_names[] = {
    [STACK_BROKER] = "broker",
    [STACK_OPERATOR] = "operator",
    [STACK_AGENT] = "agent",
    [STACK_POOL] = "pool",
    [STACK_SYSTEM] = "system",
};

const char *
stack_kind_name(enum stack_kind k)
{
    return (unsigned)k < sizeof(kind_names) / sizeof(kind_names[0])
               ? kind_names[k]
               : "?";
}

static int
kind_of(const char *s, enum stack_kind *out)
{
    for (size_t i = 0; i < sizeof(kind_names) / sizeof(kind_names[0]); i++)
        if (strcmp(s, kind_names[i]) == 0) {
            *out = (enum stack_kind)i;
            return 0;
        }
    return KS_EINVAL;
}

int
stack_operator_name_check(const char *name)
{
    if (!evt_identity_valid(name) || strcmp(name, "broker") == 0 ||
        strncmp(name, "agent-", 6) == 0 || strncmp(name, "pool-", 5) == 0 ||
        strcmp(name, "anonymous") == 0 || strcmp(name, "system") == 0)
        return KS_EINVAL;
    return 0;
}

/* The name each kind must have: "broker", "agent-<id>", or an operator's. */
static int
name_fits(enum stack_kind kind, const char *name)
{
    switch (kind) {
    case STACK_BROKER:
        return strcmp(name, "broker") == 0;
    case STACK_AGENT:
        return strncmp(name, "agent-", 6) == 0 && name[6] &&
               evt_identity_valid(name);
    case STACK_OPERATOR:
        return stack_operator_name_check(name) == 0;
    case STACK_POOL:
        return strncmp(name, "pool-", 5) == 0 && name[5] &&
               evt_identity_valid(name);
    case STACK_SYSTEM:
        return strcmp(name, "system") == 0;
    }
    return 0;
}

int
stack_ident_seed_path(const char *home, enum stack_kind kind, const char *name,
                      char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s/%s/%s.nk", home,
                     kind == STACK_OPERATOR ? "operators" : "keys", name);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

static int
entry_path(const char *home, const char *name, char *buf, size_t len)
{
    int n;
    if (!evt_identity_valid(name))
        return KS_EINVAL;
    n = snprintf(buf, len, "%s/identities/%s", home, name);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/* A value that does not fit is left empty, so the entry fails its check. */
static void
field(char *dst, size_t cap, const char *v)
{
    size_t n = strlen(v);
    dst[0] = '\0';
    if (n < cap) {
        memcpy(dst, v, n);
        dst[n] = '\0';
    }
}

int
stack_ident_get(const char *home, const char *name, struct stack_identity *out)
{
    char path[4200], line[256], kind[32] = "", nm[EVT_IDENTITY_MAX + 2] = "",
                                key[EVT_NKEY_PUBLIC_CHARS + 2] = "";
    unsigned long size = 0;
    struct stack_identity id = {0};
    uint8_t raw[32];
    FILE *f;
    int rc;

    if ((rc = entry_path(home, name, path, sizeof(path))))
        return rc;
    if (!(f = fopen(path, "re")))
        return errno == ENOENT ? KS_ENOTFOUND : -errno;
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\r\n")] = '\0';
        if (strncmp(line, "kind ", 5) == 0)
            field(kind, sizeof(kind), line + 5);
        else if (strncmp(line, "name ", 5) == 0)
            field(nm, sizeof(nm), line + 5);
        else if (strncmp(line, "nkey ", 5) == 0)
            field(key, sizeof(key), line + 5);
        else if (strncmp(line, "size ", 5) == 0)
            size = strtoul(line + 5, NULL, 10);
    }
    fclose(f);
    /* An entry that does not check out is refused, never half-used. */
    if (kind_of(kind, &id.kind) || strcmp(nm, name) != 0 ||
        !name_fits(id.kind, nm) || evt_nkey_decode_public(key, raw) ||
        (id.kind == STACK_POOL && (size == 0 || size > STACK_POOL_MAX)))
        return KS_EINVAL;
    id.pool_size = id.kind == STACK_POOL ? (unsigned)size : 0;
    snprintf(id.name, sizeof(id.name), "%s", nm);
    snprintf(id.nkey, sizeof(id.nkey), "%s", key);
    *out = id;
    return 0;
}

static int
entry_write(const char *home, const struct stack_identity *id)
{
    char dir[4200], path[4200], tmp[4300];
    FILE *f;
    int fd, rc;

    snprintf(dir, sizeof(dir), "%s/identities", home);
    if ((rc = stack_mkdirs(dir, 0700)) ||
        (rc = entry_path(home, id->name, path, sizeof(path))))
        return rc;
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd == -1 || !(f = fdopen(fd, "w"))) {
        rc = -errno;
        if (fd != -1)
            close(fd);
        return rc;
    }
    fprintf(f, "kind %s\nname %s\nnkey %s\n", stack_kind_name(id->kind),
            id->name, id->nkey);
    if (id->kind == STACK_POOL)
        fprintf(f, "size %u\n", id->pool_size);
    if (fclose(f) != 0 || rename(tmp, path) == -1) {
        rc = -errno;
        unlink(tmp);
        return rc;
    }
    return 0;
}

/* A new key pair: the seed into its file (0600, never replacing one), the
 * public key into the entry. */
static int
ident_make(const char *home, enum stack_kind kind, const char *name,
           unsigned pool_size, struct stack_identity *out)
{
    char seed[EVT_NKEY_SEED_CHARS + 1], seed_path[4200], dir[4200];
    struct stack_identity id = {.kind = kind, .pool_size = pool_size};
    int rc;

    snprintf(id.name, sizeof(id.name), "%s", name);
    snprintf(dir, sizeof(dir), "%s/%s", home,
             kind == STACK_OPERATOR ? "operators" : "keys");
    if ((rc = stack_mkdirs(dir, 0700)) ||
        (rc = stack_ident_seed_path(home, kind, name, seed_path,
                                    sizeof(seed_path))) ||
        (rc = evt_nkey_generate(seed, id.nkey)))
        goto out;
    rc = evt_nkey_write_seed(seed_path, name, seed);
    if (rc == 0 && (rc = entry_write(home, &id)))
        unlink(seed_path);
    if (rc == 0)
        *out = id;
out:
    OPENSSL_cleanse(seed, sizeof(seed));
    return rc;
}

int
stack_ident_add(const char *home, enum stack_kind kind, const char *name,
                struct stack_identity *out)
{
    struct stack_identity cur;
    int rc;

    if (!name_fits(kind, name))
        return KS_EINVAL;
    rc = stack_ident_get(home, name, &cur);
    if (rc == 0 || rc == KS_EINVAL)
        return -EEXIST;
    if (rc != KS_ENOTFOUND)
        return rc;
    return ident_make(home, kind, name, 0, out);
}

int
stack_ident_ensure(const char *home, enum stack_kind kind, const char *name,
                   struct stack_identity *out)
{
    char seed_path[4200], seed[EVT_NKEY_SEED_CHARS + 1],
        pub[EVT_NKEY_PUBLIC_CHARS + 1], named[EVT_IDENTITY_MAX + 1];
    struct stack_identity cur;
    int rc, have_entry, have_seed;

    if (!name_fits(kind, name))
        return KS_EINVAL;
    if ((rc = stack_ident_seed_path(home, kind, name, seed_path,
                                    sizeof(seed_path))))
        return rc;
    rc = stack_ident_get(home, name, &cur);
    if (rc && rc != KS_ENOTFOUND && rc != KS_EINVAL)
        return rc;
    have_entry = rc == 0 && cur.kind == kind;
    rc = evt_nkey_read_seed(seed_path, seed, pub, named);
    OPENSSL_cleanse(seed, sizeof(seed));
    if (rc && rc != -ENOENT && rc != KS_EINVAL)
        return rc;
    have_seed = rc == 0 && strcmp(named, name) == 0;
    if (have_entry && have_seed && strcmp(cur.nkey, pub) == 0) {
        *out = cur; /* the usual case: kept across up and down */
        return 0;
    }
    if (have_seed) {
        /* We hold its seed: the entry follows the key, not the other way
         * round (a new key would cut off whoever uses this one). */
        struct stack_identity id = {.kind = kind};
        snprintf(id.name, sizeof(id.name), "%s", name);
        snprintf(id.nkey, sizeof(id.nkey), "%s", pub);
        if ((rc = entry_write(home, &id)))
            return rc;
        *out = id;
        return 0;
    }
    /* No usable seed here: a new pair. A seed file that is not one is
     * moved aside, not destroyed. */
    if (access(seed_path, F_OK) == 0) {
        char aside[4300];
        snprintf(aside, sizeof(aside), "%s.bad", seed_path);
        if (rename(seed_path, aside) == -1)
            return -errno;
    }
    return ident_make(home, kind, name, 0, out);
}

static int
by_kind_name(const void *a, const void *b)
{
    const struct stack_identity *x = a, *y = b;
    if (x->kind != y->kind)
        return (int)x->kind - (int)y->kind;
    return strcmp(x->name, y->name);
}

int
stack_ident_list(const char *home, struct stack_identity **out, size_t *n_out)
{
    char dir[4200];
    struct stack_identity *ids = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    DIR *d;
    int rc = 0;

    snprintf(dir, sizeof(dir), "%s/identities", home);
    d = opendir(dir);
    if (!d && errno != ENOENT)
        return -errno;
    while (d && (de = readdir(d))) {
        struct stack_identity id;
        /* Names are tokens: "." entries and leftovers (*.tmp) are not. */
        if (!evt_identity_valid(de->d_name))
            continue;
        rc = stack_ident_get(home, de->d_name, &id);
        if (rc == KS_ENOTFOUND)
            continue; /* removed meanwhile */
        if (rc)
            break;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 8;
            struct stack_identity *m = realloc(ids, nc * sizeof(*ids));
            if (!m) {
                rc = -ENOMEM;
                break;
            }
            ids = m;
            cap = nc;
        }
        ids[n++] = id;
    }
    if (d)
        closedir(d);
    if (rc) {
        free(ids);
        return rc;
    }
    if (n)
        qsort(ids, n, sizeof(*ids), by_kind_name);
    *out = ids;
    *n_out = n;
    return 0;
}

int
stack_ident_remove(const char *home, const char *name)
{
    struct stack_identity id;
    char path[4200], seed_path[4200];
    int rc = stack_ident_get(home, name, &id);

    if (rc)
        return rc;
    if ((rc = entry_path(home, name, path, sizeof(path))) ||
        (rc = stack_ident_seed_path(home, id.kind, name, seed_path,
                                    sizeof(seed_path))))
        return rc;
    if (unlink(path) == -1)
        return -errno;
    /* The seed is worthless once the server forgets its key; removing it
     * also means a later add of the same name gets a new key. */
    if (unlink(seed_path) == -1 && errno != ENOENT)
        return -errno;
    return 0;
}

int
stack_ident_add_pool(const char *home, const char *pool, unsigned size,
                     struct stack_identity *out)
{
    char name[EVT_IDENTITY_MAX + 8], path[4200];

    if (!pool || !evt_agent_id_valid(pool) || size == 0 ||
        size > STACK_POOL_MAX)
        return KS_EINVAL;
    snprintf(name, sizeof(name), "pool-%s", pool);
    if (!name_fits(STACK_POOL, name))
        return KS_EINVAL;
    if (entry_path(home, name, path, sizeof(path)) == 0 &&
        access(path, F_OK) == 0)
        return -EEXIST;
    return ident_make(home, STACK_POOL, name, size, out);
}
