/*
 * arena.c: kproto_arena, a bump allocator for memory that lives as long as
 * one unit of work (a message, a batch) and is given back all at once
 * (kproto.h has the contract).
 *
 * Two lists of chunks. The regular chunks (4 KiB, doubling up to 1 MiB)
 * stay allocated when the arena is rewound (release, reset) and are filled
 * again from the first, so a thread that decodes one batch after another
 * calls malloc only while its batches grow. A request larger than a
 * half of the largest regular chunk gets a chunk of its own, freed at
 * the next rewind past it.
 */
#include <errno.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kproto.h"

/* Under ASan (make asan), memory given back stays poisoned until it is
 * handed out again: a use after a reset or a release is reported, as a
 * use after free() would be. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define ARENA_CHUNK_MIN ((size_t)4 * 1024)
#define ARENA_CHUNK_MAX ((size_t)1024 * 1024)
#define ARENA_BIG (ARENA_CHUNK_MAX / 2)
/* Regular chunks kept past a reset: this many bytes at most. */
#define ARENA_KEEP ((size_t)4 * 1024 * 1024)
#define ARENA_ALIGN alignof(max_align_t)

struct kproto_arena_chunk {
    struct kproto_arena_chunk *next; /* regular: the next to fill; big:
                                        the one allocated before */
    size_t size;                     /* bytes of data[] */
    alignas(max_align_t) unsigned char data[];
};

static size_t
align_up(size_t n)
{
    return (n + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1);
}

static void *
pb_alloc(void *ud, size_t size)
{
    return kproto_arena_alloc(ud, size);
}

static void
pb_free(void *ud, void *p)
{
    /* Given back with the arena. */
    (void)ud;
    (void)p;
}

ProtobufCAllocator *
kproto_arena_pb(struct kproto_arena *a)
{
    a->pb.alloc = pb_alloc;
    a->pb.free = pb_free;
    a->pb.allocator_data = a;
    return &a->pb;
}

static void *
big_alloc(struct kproto_arena *a, size_t size)
{
    struct kproto_arena_chunk *c;
    if (size > SIZE_MAX - sizeof(*c))
        return NULL;
    c = malloc(sizeof(*c) + size);
    if (!c)
        return NULL;
    c->size = size;
    c->next = a->big;
    a->big = c;
    return c->data;
}

void *
kproto_arena_alloc(struct kproto_arena *a, size_t size)
{
    struct kproto_arena_chunk *c;
    size_t need;

    if (size == 0)
        size = 1;
    if (size > ARENA_BIG)
        return big_alloc(a, size);
    need = align_up(size);
    if (a->cur && a->cur->size - a->used >= need) {
        void *p = a->cur->data + a->used;
        a->used += need;
        UNPOISON(p, size);
        return p;
    }
    /* The next regular chunk that fits: one kept from before (one too
     * small stays for smaller requests of a later round), or a new one at
     * the end of the list. The rest of the current one stays unused. */
    c = a->cur ? a->cur->next : a->first;
    while (c && c->size < need)
        c = c->next;
    if (!c) {
        struct kproto_arena_chunk **tail = a->cur ? &a->cur->next : &a->first;
        size_t csize = ARENA_CHUNK_MIN;
        while (*tail) {
            csize = (*tail)->size * 2;
            tail = &(*tail)->next;
        }
        if (a->cur && csize < a->cur->size * 2)
            csize = a->cur->size * 2;
        if (csize > ARENA_CHUNK_MAX)
            csize = ARENA_CHUNK_MAX;
        if (csize < need)
            csize = need; /* need <= ARENA_BIG < ARENA_CHUNK_MAX */
        c = malloc(sizeof(*c) + csize);
        if (!c)
            return NULL;
        c->size = csize;
        c->next = NULL;
        POISON(c->data, csize);
        *tail = c;
    }
    a->cur = c;
    a->used = need;
    UNPOISON(c->data, size);
    return c->data;
}

void *
kproto_arena_calloc(struct kproto_arena *a, size_t n, size_t size)
{
    void *p;
    if (size && n > SIZE_MAX / size)
        return NULL;
    p = kproto_arena_alloc(a, n * size);
    if (p && n * size > 0)
        memset(p, 0, n * size);
    return p;
}

char *
kproto_arena_strdup(struct kproto_arena *a, const char *s)
{
    size_t len = strlen(s) + 1;
    char *p = kproto_arena_alloc(a, len);
    if (p)
        memcpy(p, s, len);
    return p;
}

struct kproto_arena_mark
kproto_arena_mark(const struct kproto_arena *a)
{
    return (struct kproto_arena_mark){a->cur, a->big, a->used};
}

void
kproto_arena_release(struct kproto_arena *a, struct kproto_arena_mark m)
{
    while (a->big && a->big != m.big) {
        struct kproto_arena_chunk *c = a->big;
        a->big = c->next;
        free(c);
    }
    a->cur = m.cur;
    a->used = m.used;
#if defined(__SANITIZE_ADDRESS__)
    for (struct kproto_arena_chunk *c = m.cur ? m.cur : a->first; c;
         c = c->next) {
        size_t from = c == m.cur ? m.used : 0;
        POISON(c->data + from, c->size - from);
    }
#endif
}

void
kproto_arena_reset(struct kproto_arena *a)
{
    size_t kept = 0;
    struct kproto_arena_chunk **pc = &a->first;

    kproto_arena_release(a, (struct kproto_arena_mark){NULL, NULL, 0});
    /* Keep what the next batch of the same size fills, up to ARENA_KEEP. */
    while (*pc && kept + (*pc)->size <= ARENA_KEEP) {
        kept += (*pc)->size;
        pc = &(*pc)->next;
    }
    while (*pc) {
        struct kproto_arena_chunk *c = *pc;
        *pc = c->next;
        free(c);
    }
}

void
kproto_arena_fini(struct kproto_arena *a)
{
    if (!a)
        return;
    kproto_arena_release(a, (struct kproto_arena_mark){NULL, NULL, 0});
    while (a->first) {
        struct kproto_arena_chunk *c = a->first;
        a->first = c->next;
        free(c);
    }
}
