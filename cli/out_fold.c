/* Node-set folding (out_fold.h): what clubak -b prints for a group. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "out_fold.h"

struct fnode {
    const char *name;
    size_t plen;        /* prefix: name[0, plen) */
    const char *suffix; /* after the digits; "" */
    size_t dlen;        /* digits; 0: a literal name */
    unsigned long num;
    int width; /* group width: 0 unpadded, else the padded digit count */
};

static int
cmp_node(const void *x, const void *y)
{
    const struct fnode *a = x, *b = y;
    size_t m = a->plen < b->plen ? a->plen : b->plen;
    int c = strncmp(a->name, b->name, m);
    if (c)
        return c;
    if (a->plen != b->plen)
        return a->plen < b->plen ? -1 : 1;
    if ((c = strcmp(a->suffix, b->suffix)))
        return c;
    if ((a->dlen == 0) != (b->dlen == 0))
        return a->dlen == 0 ? -1 : 1;
    if (a->width != b->width)
        return a->width < b->width ? -1 : 1;
    if (a->num != b->num)
        return a->num < b->num ? -1 : 1;
    return 0;
}

static bool
same_set(const struct fnode *a, const struct fnode *b)
{
    return a->dlen && b->dlen && a->plen == b->plen &&
           strncmp(a->name, b->name, a->plen) == 0 &&
           strcmp(a->suffix, b->suffix) == 0 && a->width == b->width;
}

/* Appends to a growing string; false without memory. */
struct sbuf {
    char *s;
    size_t len, cap;
};

static bool
sb_add(struct sbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t nc = (b->len + n + 1) * 2;
        char *x = realloc(b->s, nc);
        if (!x)
            return false;
        b->s = x;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
    return true;
}

static bool
sb_num(struct sbuf *b, unsigned long v, int width)
{
    char t[32];
    int n = snprintf(t, sizeof(t), "%0*lu", width, v);
    return sb_add(b, t, (size_t)n);
}

char *
fold_nodeset(const char *const *ids, size_t n)
{
    struct fnode *v = calloc(n ? n : 1, sizeof(*v));
    struct sbuf out = {0};
    bool ok = v && sb_add(&out, "", 0);

    for (size_t i = 0; ok && i < n; i++) {
        const char *s = ids[i];
        size_t len = strlen(s), end = len, start;
        while (end > 0 && (s[end - 1] < '0' || s[end - 1] > '9'))
            end--;
        start = end;
        while (start > 0 && s[start - 1] >= '0' && s[start - 1] <= '9')
            start--;
        v[i].name = s;
        v[i].suffix = s + end;
        if (end == start || end - start > 18) { /* a literal */
            v[i].plen = len;
            v[i].suffix = "";
            continue;
        }
        v[i].plen = start;
        v[i].dlen = end - start;
        v[i].num = strtoul(s + start, NULL, 10);
        /* Padded ("007"): a fixed width. Unpadded: width 0 for now. */
        v[i].width = v[i].dlen > 1 && s[start] == '0' ? (int)v[i].dlen : 0;
    }
    /* An unpadded number as wide as a padded one of its set ("n10" with
     * "n01") belongs to that padded set. */
    for (size_t i = 0; ok && i < n; i++) {
        if (!v[i].dlen || v[i].width)
            continue;
        for (size_t k = 0; k < n; k++)
            if (v[k].width == (int)v[i].dlen && v[k].plen == v[i].plen &&
                strncmp(v[k].name, v[i].name, v[i].plen) == 0 &&
                strcmp(v[k].suffix, v[i].suffix) == 0) {
                v[i].width = (int)v[i].dlen;
                break;
            }
    }
    if (ok)
        qsort(v, n, sizeof(*v), cmp_node);
    for (size_t i = 0; ok && i < n;) {
        size_t j = i + 1;
        while (j < n && same_set(&v[i], &v[j]))
            j++;
        if (out.len)
            ok = sb_add(&out, ",", 1);
        /* Duplicates (the same name twice) count once. */
        size_t distinct = 1;
        for (size_t k = i + 1; k < j; k++)
            distinct += v[k].num != v[k - 1].num;
        if (!v[i].dlen || distinct == 1) {
            ok = ok && sb_add(&out, v[i].name, strlen(v[i].name));
            /* A literal's duplicates: skip them too. */
            while (!v[i].dlen && j < n && !v[j].dlen &&
                   strcmp(v[j].name, v[i].name) == 0)
                j++;
            i = j;
            continue;
        }
        ok = ok && sb_add(&out, v[i].name, v[i].plen) && sb_add(&out, "[", 1);
        for (size_t k = i; ok && k < j;) {
            size_t r = k;
            while (r + 1 < j && v[r + 1].num <= v[r].num + 1)
                r++;
            if (k > i)
                ok = sb_add(&out, ",", 1);
            ok = ok && sb_num(&out, v[k].num, v[k].width);
            if (v[r].num != v[k].num)
                ok = ok && sb_add(&out, "-", 1) &&
                     sb_num(&out, v[r].num, v[r].width);
            k = r + 1;
        }
        ok = ok && sb_add(&out, "]", 1) &&
             sb_add(&out, v[i].suffix, strlen(v[i].suffix));
        i = j;
    }
    free(v);
    if (!ok) {
        free(out.s);
        return NULL;
    }
    return out.s;
}
