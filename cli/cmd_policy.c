/*
 * The local stack's operator policy (`kscore up --policy FILE`,
 * `--no-policy`), a setting of the stack like its ports and --listen.
 *
 * `up --policy FILE` checks FILE (owner and mode as for a config file,
 * then the broker's own parser) and copies its bytes into
 * $KSCORE_HOME/policy.json (0600), with $KSCORE_HOME/policy saying that
 * the stack has a policy, where it came from and the SHA-256 of the copy.
 * Every later `up` (and so the systemd unit's start and reload, and each
 * broker of --cluster) starts the brokers with --policy on the copy.
 *
 * Why a copy and not the path: the stack dir is its owner's alone (0700),
 * so the file checked at `up --policy` is the file every later start
 * loads, whoever may write the original's directory meanwhile; and what
 * `status` reports is what was checked. The price: an edit of the original
 * takes `kscore up --policy FILE` again (which restarts the brokers with it).
 *
 * Fail closed: once the setting exists, a copy that is missing, unreadable,
 * not a policy, or other bytes than were saved stops `up` before anything
 * starts, and the broker itself refuses a --policy it cannot load. Only
 * `up --no-policy` goes back to no policy.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker.h"
#include "cli_int.h"

#define SETTING_FILE "policy"
#define COPY_FILE "policy.json"

/* value of "key=" in the line-based file path (malloc'd), or NULL. */
static char *
setting_get(const char *path, const char *key)
{
    char line[4400];
    size_t kl = strlen(key);
    char *val = NULL;
    FILE *f = fopen(path, "re");

    if (!f)
        return NULL;
    while (!val && fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, kl) != 0 || line[kl] != '=')
            continue;
        line[strcspn(line, "\n")] = '\0';
        val = strdup(line + kl + 1);
    }
    fclose(f);
    return val;
}

/* Writes len bytes to path through path.tmp (mode 0600), replaced
 * atomically. 0 or -errno. */
static int
write_atomic(const char *path, const char *buf, size_t len)
{
    char tmp[4400];
    int fd, rc = 0;

    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
              0600);
    if (fd == -1)
        return -errno;
    /* An old tmp made with another mode keeps it: 0600 all the same. */
    if (fchmod(fd, 0600) == -1)
        rc = -errno;
    for (size_t off = 0; !rc && off < len;) {
        ssize_t w = write(fd, buf + off, len - off);
        if (w == -1 && errno == EINTR)
            continue;
        if (w == -1)
            rc = -errno;
        else
            off += (size_t)w;
    }
    if (!rc && fsync(fd) == -1)
        rc = -errno;
    if (close(fd) == -1 && !rc)
        rc = -errno;
    if (!rc && rename(tmp, path) == -1)
        rc = -errno;
    if (rc)
        unlink(tmp);
    return rc;
}

int
cli_policy_check(const char *src, char **buf_out, size_t *len_out)
{
    char *buf = NULL, *errmsg = NULL;
    size_t len = 0;
    int rc;

    if (!src[0] || strchr(src, '\n')) {
        cli_err("bad --policy '%s': a file name", src);
        return CLI_EXIT_USAGE;
    }
    /* A policy others may write grants what they like: refused. */
    if ((rc = cli_path_trusted(src)))
        return rc;
    if ((rc = broker_policy_read(src, &buf, &len, &errmsg)) ||
        (rc = broker_policy_check_text(src, buf, len, &errmsg))) {
        cli_err("--policy: %s", errmsg ? errmsg : ks_strerror(rc));
        free(errmsg);
        free(buf);
        return CLI_EXIT_USAGE;
    }
    *buf_out = buf;
    *len_out = len;
    return 0;
}

int
cli_policy_save(const char *home, const char *src, const char *buf,
                size_t len, bool *changed)
{
    char copy[4200], setting[4200], hex[BROKER_POLICY_DIGEST_HEX];
    char abs[PATH_MAX], *text = NULL;
    struct cli_policy now;
    int rc;

    *changed = false;
    snprintf(copy, sizeof(copy), "%s/" COPY_FILE, home);
    snprintf(setting, sizeof(setting), "%s/" SETTING_FILE, home);
    if (!realpath(src, abs))
        snprintf(abs, sizeof(abs), "%s", src);
    if ((rc = broker_policy_digest(buf, len, hex)))
        goto out;
    /* The same file again (KSCORE_UP_ARGS at every reload of the unit):
     * nothing to write. */
    cli_policy_get(home, &now);
    bool same = now.configured && !now.error &&
                strcmp(now.sha256, hex) == 0 && strcmp(now.source, abs) == 0;
    cli_policy_release(&now);
    if (same)
        goto out;
    *changed = true;
    if (asprintf(&text,
                 "# kscore up --policy; written by `kscore up` (--no-policy "
                 "removes it)\nsource=%s\nsha256=%s\n",
                 abs, hex) < 0) {
        text = NULL;
        rc = -ENOMEM;
        goto out;
    }
    /* The copy first: a crash between the two leaves a setting whose
     * digest does not match, which `up` refuses (never no policy). */
    if ((rc = write_atomic(copy, buf, len)) ||
        (rc = write_atomic(setting, text, strlen(text))))
        goto out;
out:
    free(text);
    if (rc)
        cli_err("cannot save the policy in %s: %s", home, ks_strerror(rc));
    return rc ? CLI_EXIT_KSCORE : 0;
}

int
cli_policy_clear(const char *home)
{
    char copy[4200], setting[4200];

    snprintf(copy, sizeof(copy), "%s/" COPY_FILE, home);
    snprintf(setting, sizeof(setting), "%s/" SETTING_FILE, home);
    /* The setting first: without it the copy means nothing. */
    if ((unlink(setting) == -1 && errno != ENOENT) ||
        (unlink(copy) == -1 && errno != ENOENT)) {
        cli_err("cannot remove the policy of %s: %s", home, strerror(errno));
        return CLI_EXIT_KSCORE;
    }
    return 0;
}

void
cli_policy_get(const char *home, struct cli_policy *out)
{
    char setting[4200], *buf = NULL, *errmsg = NULL;
    char *src, *hex;
    size_t len = 0;
    int rc;

    memset(out, 0, sizeof(*out));
    snprintf(setting, sizeof(setting), "%s/" SETTING_FILE, home);
    snprintf(out->file, sizeof(out->file), "%s/" COPY_FILE, home);
    if (access(setting, F_OK) != 0 && errno == ENOENT)
        return;
    out->configured = true;
    src = setting_get(setting, "source");
    hex = setting_get(setting, "sha256");
    snprintf(out->source, sizeof(out->source), "%s", src ? src : "");
    snprintf(out->sha256, sizeof(out->sha256), "%s", hex ? hex : "");
    free(src);
    free(hex);
    if (!out->sha256[0] || strlen(out->sha256) != 64) {
        if (asprintf(&out->error, "%s names no sha256 (damaged)", setting) <
            0)
            out->error = NULL;
        goto out;
    }
    if ((rc = broker_policy_read(out->file, &buf, &len, &errmsg))) {
        out->error = errmsg;
        errmsg = NULL;
        goto out;
    }
    if (broker_policy_digest(buf, len, out->now) == 0 &&
        strcmp(out->now, out->sha256) != 0) {
        if (asprintf(&out->error,
                     "%s changed since `kscore up --policy` saved it "
                     "(sha256 %.12s..., saved %.12s...)",
                     out->file, out->now, out->sha256) < 0)
            out->error = NULL;
        goto out;
    }
    if (broker_policy_check_text(out->file, buf, len, &errmsg)) {
        out->error = errmsg;
        errmsg = NULL;
    }
out:
    if (out->configured && !out->error && !out->now[0])
        out->error = strdup("cannot tell (out of memory)");
    free(errmsg);
    free(buf);
}

void
cli_policy_release(struct cli_policy *p)
{
    if (!p)
        return;
    free(p->error);
    p->error = NULL;
}

int
cli_policy_loaded(const char *state_dir, pid_t pid,
                  char hex[BROKER_POLICY_DIGEST_HEX])
{
    char note[4200];
    char *npid, *nhex;
    int known = 0;

    snprintf(note, sizeof(note), "%s/" BROKER_POLICY_NOTE, state_dir);
    npid = setting_get(note, "pid");
    nhex = setting_get(note, "sha256");
    /* Only the running broker's own note counts: a note of an earlier
     * process says nothing about this one. */
    if (npid && nhex && atol(npid) == (long)pid &&
        strlen(nhex) < BROKER_POLICY_DIGEST_HEX) {
        snprintf(hex, BROKER_POLICY_DIGEST_HEX, "%s", nhex);
        known = 1;
    }
    free(npid);
    free(nhex);
    return known;
}
