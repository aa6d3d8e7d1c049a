/*
 * token.c: token files, the secrets kscore's own processes share through
 * a file of their owner's: a metrics bearer token (`kscore up --metrics`,
 * --metrics-token-file), the local cluster's route password.
 */
#include "events_int.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/rand.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void
set_err(char **errmsg, const char *fmt, const char *a)
{
    if (errmsg && asprintf(errmsg, fmt, a) < 0)
        *errmsg = NULL;
}

static bool
token_char(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
           (c >= '0' && c <= '9') || strchr("-._~+/=", c) != NULL;
}

int
evt_token_file_read(const char *path, char *buf, size_t len,
                       char **errmsg)
{
    char line[EVT_TOKEN_MAX + 3];
    struct stat st;
    size_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);

    if (fd == -1) {
        int e = errno;
        set_err(errmsg, "cannot read the token file %s", path);
        return -e;
    }
    if (fstat(fd, &st) == -1 || !S_ISREG(st.st_mode) ||
        (st.st_mode & 077) != 0) {
        /* A secret: its owner's alone, as ssh wants of a key. */
        close(fd);
        set_err(errmsg,
                "the token file %s must be a regular file that "
                "only its owner may read (chmod 600)",
                path);
        return KS_EINVAL;
    }
    ssize_t r = read(fd, line, sizeof(line) - 1);
    close(fd);
    line[r > 0 ? r : 0] = '\0';
    n = strcspn(line, "\r\n");
    line[n] = '\0';
    bool ok = n >= EVT_TOKEN_MIN && n <= EVT_TOKEN_MAX &&
              n < len;
    for (size_t i = 0; ok && i < n; i++)
        ok = token_char(line[i]);
    if (!ok) {
        set_err(errmsg,
                "the token file %s holds no token (one line of 16 "
                "to 256 of A-Z a-z 0-9 - . _ ~ + / =)",
                path);
        return KS_EINVAL;
    }
    memcpy(buf, line, n + 1);
    return 0;
}

int
evt_token_file_make(const char *path)
{
    unsigned char raw[32];
    char hex[2 * sizeof(raw) + 2];
    int fd;

    if (RAND_bytes(raw, sizeof(raw)) != 1)
        return KS_EINTERNAL;
    for (size_t i = 0; i < sizeof(raw); i++)
        snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    hex[2 * sizeof(raw)] = '\n';
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd == -1)
        return -errno;
    if (write(fd, hex, 2 * sizeof(raw) + 1) != 2 * sizeof(raw) + 1 ||
        fsync(fd) == -1) {
        int e = errno ? errno : EIO;
        close(fd);
        unlink(path);
        return -e;
    }
    return close(fd) == 0 ? 0 : -errno;
}
