/*
 * ks_sort.c: qsort(3) without allocating (kproto.h). glibc's qsort (2.36,
 * Debian 12) is a merge sort that mallocs a copy of the array whenever it
 * is larger than 1 KiB; the recorder sorts a batch's event ids and streams
 * every batch. An introsort: quicksort (median of three, Hoare partition),
 * insertion sort below 16 elements, heapsort once the recursion is deeper
 * than 2 log2 n, so O(n log n) whatever the input.
 */
#include <string.h>

#include "kproto.h"

typedef int (*cmp_fn)(const void *, const void *);

#define SMALL 16

static void
swap(unsigned char *a, unsigned char *b, size_t size)
{
    unsigned char t[64];
    while (size) {
        size_t k = size < sizeof(t) ? size : sizeof(t);
        memcpy(t, a, k);
        memcpy(a, b, k);
        memcpy(b, t, k);
        a += k;
        b += k;
        size -= k;
    }
}

static void
insertion_sort(unsigned char *base, size_t n, size_t size, cmp_fn cmp)
{
    for (size_t i = 1; i < n; i++)
        for (size_t j = i;
             j > 0 && cmp(base + (j - 1) * size, base + j * size) > 0; j--)
            swap(base + (j - 1) * size, base + j * size, size);
}

static void
sift_down(unsigned char *base, size_t root, size_t n, size_t size,
          cmp_fn cmp)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n)
            return;
        if (child + 1 < n &&
            cmp(base + child * size, base + (child + 1) * size) < 0)
            child++;
        if (cmp(base + root * size, base + child * size) >= 0)
            return;
        swap(base + root * size, base + child * size, size);
        root = child;
    }
}

static void
heap_sort(unsigned char *base, size_t n, size_t size, cmp_fn cmp)
{
    for (size_t i = n / 2; i-- > 0;)
        sift_down(base, i, n, size, cmp);
    for (size_t end = n; end-- > 1;) {
        swap(base, base + end * size, size);
        sift_down(base, 0, end, size, cmp);
    }
}

static void
intro_sort(unsigned char *base, size_t n, size_t size, cmp_fn cmp,
           unsigned depth)
{
    while (n > SMALL) {
        unsigned char *mid = base + (n / 2) * size, *last = base + (n - 1) * size;
        size_t i = 0, j = n;

        if (depth-- == 0) {
            heap_sort(base, n, size, cmp);
            return;
        }
        /* Median of three: base <= mid <= last; the median goes to base[0]
         * as the pivot, and last (>= pivot) stops the scan up. */
        if (cmp(mid, base) < 0)
            swap(mid, base, size);
        if (cmp(last, base) < 0)
            swap(last, base, size);
        if (cmp(last, mid) < 0)
            swap(last, mid, size);
        swap(base, mid, size);
        for (;;) {
            do
                i++;
            while (cmp(base + i * size, base) < 0);
            do
                j--;
            while (cmp(base + j * size, base) > 0);
            if (i >= j)
                break;
            swap(base + i * size, base + j * size, size);
        }
        swap(base, base + j * size, size); /* the pivot at its place, j */
        /* Recurse into the smaller side, loop on the larger: the stack
         * stays O(log n). */
        if (j < n - j - 1) {
            intro_sort(base, j, size, cmp, depth);
            base += (j + 1) * size;
            n -= j + 1;
        } else {
            intro_sort(base + (j + 1) * size, n - j - 1, size, cmp, depth);
            n = j;
        }
    }
    insertion_sort(base, n, size, cmp);
}

void
ks_sort(void *base, size_t n, size_t size,
        int (*cmp)(const void *, const void *))
{
    unsigned depth = 0;
    for (size_t m = n; m > 1; m >>= 1)
        depth += 2;
    if (n > 1 && size > 0)
        intro_sort(base, n, size, cmp, depth);
}
