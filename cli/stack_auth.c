/* NATS users and permissions for the local stack, from
 * deploy/nats-auth.conf.in (compiled in by cli/CMakeLists.txt). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "kproto.h"
#include "nats_auth_conf.h"
#include "stack.h"

int
stack_secret(char out[33])
{
    uint8_t raw[16];
    size_t got = 0;
    while (got < sizeof(raw)) {
        ssize_t r = getrandom(raw + got, sizeof(raw) - got, 0);
        if (r == -1) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        got += (size_t)r;
    }
    for (size_t i = 0; i < sizeof(raw); i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return 0;
}

/* Appends s to the growing buffer; 0 or -ENOMEM. */
static int
put(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*len + n + 1) * 2;
        char *b = realloc(*buf, nc);
        if (!b)
            return -ENOMEM;
        *buf = b;
        *cap = nc;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

int
stack_nats_auth_conf(const struct stack_auth *a, char **conf_out)
{
    const struct {
        const char *name, *value;
    } vars[] = {
        {"@BROKER_PASSWORD@", a->broker_password},
        {"@OPERATOR_PASSWORD@", a->operator_password},
        {"@OPERATOR@", a->operator_name},
        {"@AGENT_PASSWORD@", a->agent_password},
        {"@AGENT_ID@", a->agent_id},
    };
    const char *p = stack__nats_auth_template;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int rc = 0;

    while (*p && rc == 0) {
        const char *at = strchr(p, '@');
        size_t i;
        if (!at) {
            rc = put(&buf, &len, &cap, p, strlen(p));
            break;
        }
        rc = put(&buf, &len, &cap, p, (size_t)(at - p));
        for (i = 0; rc == 0 && i < sizeof(vars) / sizeof(vars[0]); i++) {
            size_t n = strlen(vars[i].name);
            if (strncmp(at, vars[i].name, n) == 0) {
                rc = put(&buf, &len, &cap, vars[i].value,
                         strlen(vars[i].value));
                p = at + n;
                break;
            }
        }
        if (rc == 0 && i == sizeof(vars) / sizeof(vars[0])) {
            rc = put(&buf, &len, &cap, "@", 1);
            p = at + 1;
        }
    }
    if (rc) {
        free(buf);
        return rc;
    }
    *conf_out = buf;
    return 0;
}
