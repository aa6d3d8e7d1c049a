#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kproto.h"

struct ks_map_entry {
    struct ks_map_entry *next;
    void *val;
    uint64_t hash;
    char key[];
};

uint64_t
ks_fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static uint64_t
fnv1a(const char *s)
{
    return ks_fnv1a(KS_FNV1A_INIT, s, strlen(s));
}

static int
grow(struct ks_map *m)
{
    size_t n = m->nbuckets ? m->nbuckets * 2 : 64;
    struct ks_map_entry **b = calloc(n, sizeof(*b));
    if (!b)
        return -ENOMEM;
    for (size_t i = 0; i < m->nbuckets; i++) {
        struct ks_map_entry *e = m->buckets[i], *next;
        for (; e; e = next) {
            next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
        }
    }
    free(m->buckets);
    m->buckets = b;
    m->nbuckets = n;
    return 0;
}

int
ks_map_put(struct ks_map *m, const char *key, void *val)
{
    uint64_t h = fnv1a(key);
    struct ks_map_entry *e;
    size_t klen = strlen(key);

    if (m->nbuckets) {
        for (e = m->buckets[h & (m->nbuckets - 1)]; e; e = e->next)
            if (e->hash == h && strcmp(e->key, key) == 0) {
                e->val = val;
                return 0;
            }
    }
    if (m->count + 1 > m->nbuckets * 3 / 4 && grow(m) != 0)
        return -ENOMEM;
    e = malloc(sizeof(*e) + klen + 1);
    if (!e)
        return -ENOMEM;
    memcpy(e->key, key, klen + 1);
    e->hash = h;
    e->val = val;
    e->next = m->buckets[h & (m->nbuckets - 1)];
    m->buckets[h & (m->nbuckets - 1)] = e;
    m->count++;
    return 0;
}

void *
ks_map_get(const struct ks_map *m, const char *key)
{
    uint64_t h;
    if (!m->nbuckets)
        return NULL;
    h = fnv1a(key);
    for (struct ks_map_entry *e = m->buckets[h & (m->nbuckets - 1)]; e;
         e = e->next)
        if (e->hash == h && strcmp(e->key, key) == 0)
            return e->val;
    return NULL;
}

void *
ks_map_del(struct ks_map *m, const char *key)
{
    uint64_t h;
    if (!m->nbuckets)
        return NULL;
    h = fnv1a(key);
    for (struct ks_map_entry **pp = &m->buckets[h & (m->nbuckets - 1)]; *pp;
         pp = &(*pp)->next) {
        struct ks_map_entry *e = *pp;
        if (e->hash == h && strcmp(e->key, key) == 0) {
            void *v = e->val;
            *pp = e->next;
            free(e);
            m->count--;
            return v;
        }
    }
    return NULL;
}

void
ks_map_each(const struct ks_map *m,
            void (*fn)(const char *key, void *val, void *ud), void *ud)
{
    for (size_t i = 0; i < m->nbuckets; i++)
        for (struct ks_map_entry *e = m->buckets[i]; e; e = e->next)
            fn(e->key, e->val, ud);
}

void
ks_map_clear(struct ks_map *m)
{
    for (size_t i = 0; i < m->nbuckets; i++) {
        struct ks_map_entry *e = m->buckets[i], *next;
        for (; e; e = next) {
            next = e->next;
            free(e);
        }
    }
    free(m->buckets);
    m->buckets = NULL;
    m->nbuckets = m->count = 0;
}
