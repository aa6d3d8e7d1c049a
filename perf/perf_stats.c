/* Percentiles, medians and the summary of rounds. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "perf_int.h"

volatile sig_atomic_t perf__interrupted;

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int
cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void
perf__sort(int64_t *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_i64);
}

int64_t
perf__pct(const int64_t *sorted, size_t n, int p)
{
    /* Nearest rank: the smallest value with at least p% at or below it. */
    size_t rank = ((size_t)p * n + 99) / 100;
    if (rank == 0)
        rank = 1;
    if (rank > n)
        rank = n;
    return sorted[rank - 1];
}

void
perf__lat_json(json_t *o, int64_t *lat, size_t n)
{
    double sum = 0;
    if (n == 0)
        return;
    perf__sort(lat, n);
    for (size_t i = 0; i < n; i++)
        sum += (double)lat[i];
    json_object_set_new(o, "p50_us", json_integer(perf__pct(lat, n, 50)));
    json_object_set_new(o, "p95_us", json_integer(perf__pct(lat, n, 95)));
    json_object_set_new(o, "p99_us", json_integer(perf__pct(lat, n, 99)));
    json_object_set_new(o, "max_us", json_integer(lat[n - 1]));
    json_object_set_new(o, "mean_us", json_real(sum / (double)n));
}

double
perf__median(double *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_dbl);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

json_t *
perf__summarize(json_t *rounds)
{
    json_t *sum = json_object(), *spread = json_object();
    json_t *first = json_array_get(rounds, 0);
    size_t n = json_array_size(rounds);
    double *v = n ? calloc(n, sizeof(*v)) : NULL;
    const char *key;
    json_t *val;

    if (!first || !v)
        goto out;
    json_object_foreach(first, key, val)
    {
        size_t k = 0;
        bool ints = true;
        if (!json_is_number(val))
            continue;
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_object_get(json_array_get(rounds, i), key);
            if (!json_is_number(x))
                continue;
            if (!json_is_integer(x))
                ints = false;
            v[k++] = json_number_value(x);
        }
        if (k == 0)
            continue;
        double med = perf__median(v, k); /* sorts v */
        json_object_set_new(sum, key,
                            ints && med == (double)(int64_t)med
                                ? json_integer((json_int_t)med)
                                : json_real(med));
        json_object_set_new(spread, key,
                            json_pack("[f,f]", v[0], v[k - 1]));
    }
out:
    free(v);
    json_object_set_new(sum, "spread", spread);
    return sum;
}

void
perf__sleep_ms(int ms)
{
    while (ms > 0 && !perf__interrupted) {
        int step = ms > 50 ? 50 : ms;
        nanosleep(&(struct timespec){0, step * 1000000L}, NULL);
        ms -= step;
    }
}
