/* Label selectors (client.h): the one rule the brokers resolve batches
 * with and the CLI filters `kscore agents --select` and sealed targets
 * with. */
#include <fnmatch.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "client.h"

/* Splits term at "!=" or "="; 0 with the key length, negation and value,
 * or -1. */
static int
select_split(const char *term, size_t *klen, bool *neg, const char **val)
{
    const char *eq = strchr(term, '=');
    if (!eq || eq == term)
        return -1;
    *neg = eq[-1] == '!';
    *klen = (size_t)(eq - term) - (*neg ? 1 : 0);
    *val = eq + 1;
    return *klen ? 0 : -1;
}

int
broker_select_check(const char *term, char *why, size_t len)
{
    size_t klen;
    bool neg;
    const char *val;
    if (select_split(term, &klen, &neg, &val) != 0) {
        snprintf(why, len,
                 "bad selector term '%s': expected KEY=VALUE, KEY!=VALUE or "
                 "KEY=V1|V2 (globs allowed)",
                 term);
        return KS_EINVAL;
    }
    return 0;
}

/* 1 when value matches one of the '|'-separated globs in pats. */
static int
select_value_match(const char *value, const char *pats)
{
    char pat[512];
    for (const char *p = pats;;) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n < sizeof(pat)) {
            memcpy(pat, p, n);
            pat[n] = '\0';
            if (fnmatch(pat, value, 0) == 0)
                return 1;
        }
        if (!bar)
            return 0;
        p = bar + 1;
    }
}

int
broker_select_match(const Ks__AgentInfo *info, char *const *terms, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t klen;
        bool neg;
        const char *val, *have = NULL;
        if (!info || select_split(terms[i], &klen, &neg, &val) != 0)
            return 0;
        for (size_t k = 0; k < info->n_labels && !have; k++)
            if (strlen(info->labels[k]->name) == klen &&
                strncmp(info->labels[k]->name, terms[i], klen) == 0)
                have = info->labels[k]->value;
        int hit = have && select_value_match(have, val);
        if (neg ? hit : !hit)
            return 0;
    }
    return 1;
}

/* A user or group name as useradd(8) takes it (NAME_REGEX, relaxed to
 * upper case): letters, digits, _, . and -, not - first; 1-32 bytes. */
static bool
name_ok(const char *s, size_t n)
{
    if (n == 0 || n > 32 || s[0] == '-')
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
              (s[i] >= '0' && s[i] <= '9') || s[i] == '_' || s[i] == '.' ||
              s[i] == '-'))
            return false;
    return true;
}

bool
broker_user_spec_ok(const char *s)
{
    const char *colon = strchr(s, ':');
    if (!colon)
        return name_ok(s, strlen(s));
    return name_ok(s, (size_t)(colon - s)) &&
           name_ok(colon + 1, strlen(colon + 1));
}
