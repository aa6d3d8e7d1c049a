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
    /* "env==prod" is the habit of other selector languages (kubectl,
     * jq); read as written it would be the value "=prod", which no agent
     * has, and the batch would match nothing or, negated, everything. */
    if (val[0] == '=') {
        snprintf(why, len,
                 "bad selector term '%s': '%s=' is no operator: KEY%sVALUE "
                 "(did you mean '%.*s%s%s'?)",
                 term, neg ? "!=" : "=", neg ? "!=" : "=", (int)klen, term,
                 neg ? "!=" : "=", val + 1);
        return KS_EINVAL;
    }
    if (klen == strlen(BROKER_FACT_PREFIX) &&
        strncmp(term, BROKER_FACT_PREFIX, klen) == 0) {
        snprintf(why, len,
                 "bad selector term '%s': a fact is fact.KEY (fact.os, "
                 "fact.kernel, fact.arch, fact.cpus, fact.mem_mb)",
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
        const char *val, *have = NULL, *key = terms[i];
        if (!info || select_split(terms[i], &klen, &neg, &val) != 0)
            return 0;
        /* fact.KEY: what the agent says of its host, never a label. */
        Ks__EnvVar *const *kv = info->labels;
        size_t n_kv = info->n_labels;
        size_t plen = strlen(BROKER_FACT_PREFIX);
        if (klen > plen && strncmp(key, BROKER_FACT_PREFIX, plen) == 0) {
            kv = info->facts;
            n_kv = info->n_facts;
            key += plen;
            klen -= plen;
        }
        for (size_t k = 0; k < n_kv && !have; k++)
            if (strlen(kv[k]->name) == klen &&
                strncmp(kv[k]->name, key, klen) == 0)
                have = kv[k]->value;
        int hit = have && select_value_match(have, val);
        if (neg ? hit : !hit)
            return 0;
    }
    return 1;
}

int
broker_label_check(const char *key, const char *value, char *why, size_t len)
{
    size_t n = strlen(key);
    if (n == 0 || n > BROKER_LABEL_KEY_MAX) {
        snprintf(why, len, "bad label key '%s': 1 to %d characters", key,
                 BROKER_LABEL_KEY_MAX);
        return KS_EINVAL;
    }
    for (size_t i = 0; i < n; i++) {
        char c = key[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-' ||
              c == '/')) {
            snprintf(why, len,
                     "bad label key '%s': letters, digits, '_', '.', '-' "
                     "and '/' only",
                     key);
            return KS_EINVAL;
        }
    }
    if (strncmp(key, BROKER_FACT_PREFIX, strlen(BROKER_FACT_PREFIX)) == 0) {
        snprintf(why, len,
                 "bad label key '%s': fact.* are the agents' facts, not "
                 "labels",
                 key);
        return KS_EINVAL;
    }
    if (!value)
        return 0;
    if (strlen(value) > BROKER_LABEL_VALUE_MAX) {
        snprintf(why, len, "label %s: a value of at most %d bytes", key,
                 BROKER_LABEL_VALUE_MAX);
        return KS_EINVAL;
    }
    for (const unsigned char *p = (const unsigned char *)value; *p; p++)
        if (*p < 0x20 || *p == 0x7f || *p == ',') {
            snprintf(why, len,
                     "label %s: its value may hold no control character "
                     "and no ',' (it separates --select terms)",
                     key);
            return KS_EINVAL;
        }
    return 0;
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

bool
broker_env_name_ok(const char *n)
{
    bool ok = (n[0] >= 'A' && n[0] <= 'Z') || (n[0] >= 'a' && n[0] <= 'z') ||
              n[0] == '_';
    for (const char *c = n; ok && *c; c++)
        ok = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') ||
             (*c >= '0' && *c <= '9') || *c == '_';
    return ok && strlen(n) <= 256 && strncmp(n, "KSCORE_", 7) != 0;
}
