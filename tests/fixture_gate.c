#include "fixture.h"

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

void
fixture_gate_init(struct fixture_gate *g, const char *dir, const char *name)
{
    int n = snprintf(g->path, sizeof(g->path), "%s/gate-%s", dir, name);
    ck_assert_msg(n > 0 && (size_t)n < sizeof(g->path), "gate path: %s/%s",
                  dir, name);
    unlink(g->path);
    n = snprintf(g->sh, sizeof(g->sh),
                 "n=0; while [ ! -e '%s' ] && [ $n -lt %d ]; do sleep 0.05; "
                 "n=$((n+1)); done; [ -e '%s' ] || echo 'gate %s: never "
                 "opened' >&2",
                 g->path, FIXTURE_GATE_MAX_S * 20, g->path, name);
    ck_assert_msg(n > 0 && (size_t)n < sizeof(g->sh), "gate text: %s", name);
}

void
fixture_gate_open(const struct fixture_gate *g)
{
    int fd = open(g->path, O_WRONLY | O_CREAT, 0644);
    ck_assert_msg(fd >= 0, "cannot make %s", g->path);
    close(fd);
}
