/*
 * The Prometheus endpoints: the registry's text format (every line
 * parses, HELP/TYPE once per family, histograms cumulative), the HTTP
 * server (libmicrohttpd) scraped with a plain socket, and a real stack
 * whose broker and agent serve metrics (--metrics-listen) while a batch
 * and a few commands run: the counters must move.
 */
#include <arpa/inet.h>
#include <time.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <dirent.h>
#include <jansson.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker.h"
#include "events.h"
#include "fixture.h"
#include "kproto.h"
#include "metrics_http.h"
#include "stack.h"

/* ---- helpers ---------------------------------------------------------------
 */

/* GET path from 127.0.0.1:port over a plain socket (HTTP/1.0): the status
 * code, *body (malloc'd) and the Content-Type header value in ctype. */
static int
http_get_from(in_addr_t src, unsigned port, const char *path,
              const char *bearer, char **body, char *ctype, size_t ctlen)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port)};
    char req[512], *buf = NULL;
    size_t len = 0, cap = 0;
    int fd, code = -1;

    *body = NULL;
    if (ctype)
        ctype[0] = '\0';
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(fd, 0);
    if (src) {
        struct sockaddr_in from = {.sin_family = AF_INET,
                                   .sin_addr.s_addr = src};
        ck_assert_int_eq(bind(fd, (struct sockaddr *)&from, sizeof(from)), 0);
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -errno;
    }
    snprintf(req, sizeof(req),
             "GET %s HTTP/1.0\r\nHost: localhost\r\n%s%s%s\r\n", path,
             bearer ? "Authorization: Bearer " : "", bearer ? bearer : "",
             bearer ? "\r\n" : "");
    ck_assert_int_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? cap * 2 : 65536;
            buf = realloc(buf, cap + 1);
            ck_assert_ptr_nonnull(buf);
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    if (!buf)
        return -EIO;
    buf[len] = '\0';
    sscanf(buf, "HTTP/1.%*d %d", &code);
    char *hdr_end = strstr(buf, "\r\n\r\n");
    ck_assert_ptr_nonnull(hdr_end);
    *hdr_end = '\0';
    if (ctype) {
        char *ct = strcasestr(buf, "\r\nContent-Type: ");
        if (ct) {
            ct += strlen("\r\nContent-Type: ");
            size_t n = strcspn(ct, "\r\n");
            snprintf(ctype, ctlen, "%.*s", (int)n, ct);
        }
    }
    *body = strdup(hdr_end + 4);
    free(buf);
    return code;
}

static int
http_get(unsigned port, const char *path, char **body, char *ctype,
         size_t ctlen)
{
    return http_get_from(0, port, path, NULL, body, ctype, ctlen);
}

/* The same with "Authorization: Bearer <bearer>" (a kscore /metrics with a
 * token file). */
static int
http_get_bearer(unsigned port, const char *path, const char *bearer,
                char **body)
{
    return http_get_from(0, port, path, bearer, body, NULL, 0);
}

/* The value of one series ("name" or "name{labels}" exactly as rendered),
 * or -1 when it is not there. */
static double
series(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, name, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return -1;
}

/*
 * Checks text against the exposition format as Prometheus reads it:
 * every line is HELP, TYPE or `name{labels} value`; HELP and TYPE come
 * once per family, before its samples, and a family's samples are
 * together; histogram buckets are cumulative, end with le="+Inf" equal to
 * _count, and come with _sum. Fails the test with the line otherwise.
 * Returns the number of samples.
 */
static int
check_exposition(const char *text)
{
    regex_t sample, help, type;
    char seen[200][96], family[96] = "", ftype[16] = "";
    int nseen = 0, samples = 0;
    double last_bucket = -1, inf = -1, count = -1;
    bool have_sum = false;

    ck_assert_int_eq(
        regcomp(&sample,
                "^([a-zA-Z_:][a-zA-Z0-9_:]*)"
                "(\\{[a-zA-Z_][a-zA-Z0-9_]*=\"[^\"\\\\]*\""
                "(,[a-zA-Z_][a-zA-Z0-9_]*=\"[^\"\\\\]*\")*\\})? "
                "(-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?|\\+Inf|NaN)$",
                REG_EXTENDED),
        0);
    ck_assert_int_eq(
        regcomp(&help, "^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+$", REG_EXTENDED),
        0);
    ck_assert_int_eq(regcomp(&type,
                             "^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) "
                             "(counter|gauge|histogram|summary|untyped)$",
                             REG_EXTENDED),
                     0);
    ck_assert_msg(text[0] && text[strlen(text) - 1] == '\n',
                  "the text must end with a newline");
    char *copy = strdup(text), *save = NULL;
    for (char *line = strtok_r(copy, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        regmatch_t m[8];
        char name[96];
        if (regexec(&help, line, 2, m, 0) == 0)
            continue;
        if (regexec(&type, line, 3, m, 0) == 0) {
            /* The previous histogram is complete. */
            if (!strcmp(ftype, "histogram"))
                ck_assert_msg(inf >= 0 && inf == count && have_sum,
                              "histogram %s: +Inf %g, _count %g", family, inf,
                              count);
            snprintf(family, sizeof(family), "%.*s",
                     (int)(m[1].rm_eo - m[1].rm_so), line + m[1].rm_so);
            snprintf(ftype, sizeof(ftype), "%.*s",
                     (int)(m[2].rm_eo - m[2].rm_so), line + m[2].rm_so);
            for (int i = 0; i < nseen; i++)
                ck_assert_msg(strcmp(seen[i], family) != 0, "TYPE %s twice",
                              family);
            ck_assert_int_lt(nseen, 200);
            snprintf(seen[nseen++], sizeof(seen[0]), "%s", family);
            last_bucket = inf = count = -1;
            have_sum = false;
            continue;
        }
        ck_assert_msg(regexec(&sample, line, 5, m, 0) == 0,
                      "not a sample: '%s'", line);
        /* Each series (name and labels) once. */
        {
            size_t sl = strrchr(line, ' ') - line;
            for (const char *p = text; p < text + (line - copy);) {
                ck_assert_msg(strncmp(p, line, sl + 1) != 0,
                              "series twice: %.*s", (int)sl, line);
                p = strchr(p, '\n');
                if (!p)
                    break;
                p++;
            }
        }
        samples++;
        snprintf(name, sizeof(name), "%.*s", (int)(m[1].rm_eo - m[1].rm_so),
                 line + m[1].rm_so);
        double v = strtod(strrchr(line, ' ') + 1, NULL);
        if (!strcmp(ftype, "histogram")) {
            size_t fl = strlen(family);
            ck_assert_msg(!strncmp(name, family, fl), "%s outside %s", name,
                          family);
            const char *suf = name + fl;
            if (!strcmp(suf, "_bucket")) {
                ck_assert_msg(v >= last_bucket, "%s: buckets not cumulative",
                              line);
                last_bucket = v;
                if (strstr(line, "le=\"+Inf\""))
                    inf = v;
            } else if (!strcmp(suf, "_sum")) {
                have_sum = true;
            } else {
                ck_assert_msg(!strcmp(suf, "_count"), "%s in histogram %s",
                              name, family);
                count = v;
            }
        } else {
            ck_assert_msg(!strcmp(name, family),
                          "sample %s outside its family (current %s)", name,
                          family);
            if (!strcmp(ftype, "counter"))
                ck_assert_msg(v >= 0, "negative counter: %s", line);
        }
    }
    if (!strcmp(ftype, "histogram"))
        ck_assert(inf >= 0 && inf == count && have_sum);
    free(copy);
    regfree(&sample);
    regfree(&help);
    regfree(&type);
    return samples;
}

/* ---- the registry and the server ------------------------------------------
 */

START_TEST(render_is_valid_text_format)
{
    char *text = NULL;
    size_t len = 0;

    ks_metric_inc(KS_C_EVENTS_RECORDED);
    ks_metric_status_inc(KS_SC_COMMANDS, KS__COMMAND_STATUS__SUCCEEDED);
    ks_metric_status_inc(KS_SC_AGENT_COMMANDS, KS__COMMAND_STATUS__FAILED);
    ks_metric_observe_us(KS_H_RECORD_LATENCY, 1500);       /* 1.5 ms */
    ks_metric_observe_us(KS_H_RECORD_LATENCY, 7200000000); /* 2 h */
    ks_metric_observe_us(KS_H_AGENT_COMMAND, -5);          /* clamped */
    ck_assert_int_eq(
        ks_metrics_render(KS_METRICS_BROKER | KS_METRICS_AGENT, &text, &len),
        0);
    ck_assert_uint_eq(strlen(text), len);
    ck_assert_int_gt(check_exposition(text), 40);
    ck_assert(series(text, "kscore_events_recorded_total") >= 1);
    ck_assert(series(text, "kscore_commands_total{status=\"Succeeded\"}") >= 1);
    ck_assert(series(text, "kscore_commands_total{status=\"Lost\"}") == 0);
    ck_assert(series(text, "kscore_agent_commands_total{status=\"Failed\"}") >=
              1);
    ck_assert(
        series(text, "kscore_record_latency_seconds_bucket{le=\"0.001\"}") ==
        0);
    ck_assert(
        series(text, "kscore_record_latency_seconds_bucket{le=\"0.0025\"}") ==
        1);
    ck_assert(
        series(text, "kscore_record_latency_seconds_bucket{le=\"3600\"}") == 1);
    ck_assert(
        series(text, "kscore_record_latency_seconds_bucket{le=\"+Inf\"}") == 2);
    ck_assert(series(text, "kscore_record_latency_seconds_count") == 2);
    ck_assert(series(text, "kscore_record_latency_seconds_sum") > 7200);
    ck_assert(series(text, "kscore_agent_command_duration_seconds_sum") == 0);
    free(text);

    /* An agent alone shows the agent's metrics, with their own heads. */
    ck_assert_int_eq(ks_metrics_render(KS_METRICS_AGENT, &text, &len), 0);
    check_exposition(text);
    ck_assert(series(text, "kscore_events_recorded_total") == -1);
    ck_assert(series(text, "kscore_nats_connected{component=\"agent\"}") == 0);
    ck_assert(series(text, "kscore_nats_connected{component=\"broker\"}") ==
              -1);
    ck_assert_ptr_nonnull(strstr(text, "# TYPE kscore_nats_connected gauge"));
    free(text);
}
END_TEST

static void
collect_seven(void *ctx)
{
    ks_metric_gauge_add(KS_G_AGENTS_ONLINE, *(int *)ctx);
}

START_TEST(collectors_run_at_each_scrape)
{
    static int seven = 7;
    char *text = NULL;
    size_t len;

    ck_assert_int_eq(ks_metrics_collector_add(collect_seven, &seven), 0);
    for (int i = 0; i < 2; i++) { /* reset between scrapes: not 14 */
        ck_assert_int_eq(ks_metrics_render(KS_METRICS_BROKER, &text, &len), 0);
        ck_assert(series(text, "kscore_agents_online") == 7);
        free(text);
    }
    ks_metrics_collector_remove(collect_seven, &seven);
    ck_assert_int_eq(ks_metrics_render(KS_METRICS_BROKER, &text, &len), 0);
    ck_assert(series(text, "kscore_agents_online") == 0);
    free(text);
}
END_TEST

/*
 * One client that opens connections and sends nothing must not take every
 * connection the server has: a scraper at another address still gets its
 * metrics. Found by a security review (16 idle connections blocked every
 * scrape).
 */
START_TEST(idle_connections_do_not_starve_the_scraper)
{
    struct cli_metrics_server *m = NULL;
    char *errmsg = NULL, *body = NULL;
    int held[32];

    ck_assert_int_eq(
        cli_metrics_serve("127.0.0.1:0", KS_METRICS_BROKER, &m, &errmsg), 0);
    unsigned port = cli_metrics_port(m);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (size_t i = 0; i < sizeof(held) / sizeof(held[0]); i++) {
        held[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(held[i], 0);
        ck_assert_int_eq(connect(held[i], (struct sockaddr *)&a, sizeof(a)),
                         0);
        /* Half a request, never finished. */
        ck_assert_int_eq(write(held[i], "GET /metrics HTTP/1.1\r\n", 23), 23);
    }
    nanosleep(&(struct timespec){0, 200 * 1000000L}, NULL);
    ck_assert_int_eq(http_get_from(inet_addr("127.0.0.2"), port, "/metrics",
                                   NULL, &body, NULL, 0),
                     200);
    free(body);
    for (size_t i = 0; i < sizeof(held) / sizeof(held[0]); i++)
        close(held[i]);
    cli_metrics_stop(m);
}
END_TEST

/*
 * With a token file, /metrics answers only a request that carries the
 * token (a port on loopback is open to every local user, issue 21): 401
 * without it or with another, 200 with it. A token file others may read
 * is refused, as ssh refuses such a key.
 */
START_TEST(metrics_need_their_token)
{
    char dir[] = "/tmp/kscore-token-XXXXXX", path[64], token[300];
    struct cli_metrics_server *m = NULL;
    char *errmsg = NULL, *body = NULL;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/metrics.token", dir);
    ck_assert_int_eq(evt_token_file_make(path), 0);
    ck_assert_int_eq(evt_token_file_make(path), -EEXIST);
    ck_assert_int_eq(evt_token_file_read(path, token, sizeof(token), NULL),
                     0);
    ck_assert_uint_eq(strlen(token), 64);
    ck_assert_int_eq(cli_metrics_serve_auth("127.0.0.1:0", KS_METRICS_BROKER,
                                            path, &m, &errmsg),
                     0);
    unsigned port = cli_metrics_port(m);
    ck_assert_int_eq(http_get(port, "/metrics", &body, NULL, 0), 401);
    ck_assert_ptr_null(strstr(body, "kscore_"));
    free(body);
    ck_assert_int_eq(http_get_bearer(port, "/metrics", "0123456789abcdef",
                                     &body),
                     401);
    free(body);
    token[10] ^= 1; /* one bit off */
    ck_assert_int_eq(http_get_bearer(port, "/metrics", token, &body), 401);
    free(body);
    token[10] ^= 1;
    ck_assert_int_eq(http_get_bearer(port, "/metrics", token, &body), 200);
    check_exposition(body);
    free(body);
    cli_metrics_stop(m);
    /* Readable by others: refused, nothing served. */
    ck_assert_int_eq(chmod(path, 0640), 0);
    errmsg = NULL;
    ck_assert_int_eq(cli_metrics_serve_auth("127.0.0.1:0", KS_METRICS_BROKER,
                                            path, &m, &errmsg),
                     KS_EINVAL);
    ck_assert_ptr_nonnull(strstr(errmsg, "chmod 600"));
    free(errmsg);
    unlink(path);
    rmdir(dir);
}
END_TEST

START_TEST(server_answers_metrics_and_404)
{
    struct cli_metrics_server *m = NULL;
    char *errmsg = NULL, *body = NULL, ctype[128];

    ck_assert_int_eq(
        cli_metrics_serve("127.0.0.1:0", KS_METRICS_BROKER, &m, &errmsg), 0);
    unsigned port = cli_metrics_port(m);
    ck_assert_uint_gt(port, 0);
    ck_assert_int_eq(http_get(port, "/metrics", &body, ctype, sizeof(ctype)),
                     200);
    ck_assert_str_eq(ctype, "text/plain; version=0.0.4; charset=utf-8");
    check_exposition(body);
    ck_assert(series(body, "kscore_events_recorded_total") >= 0);
    free(body);
    ck_assert_int_eq(http_get(port, "/nothing", &body, NULL, 0), 404);
    free(body);
    cli_metrics_stop(m);
    /* Stopped: nobody listens any more. */
    ck_assert_int_lt(http_get(port, "/metrics", &body, NULL, 0), 0);

    const char *bad[] = {"",          "127.0.0.1", "127.0.0.1:99999",
                         "nohost:80", "[::1",      "1.2.3.4:x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        errmsg = NULL;
        ck_assert_int_eq(
            cli_metrics_serve(bad[i], KS_METRICS_BROKER, &m, &errmsg),
            KS_EINVAL);
        ck_assert_ptr_nonnull(errmsg);
        free(errmsg);
    }
    /* A port in use is refused, not shared. */
    ck_assert_int_eq(
        cli_metrics_serve("127.0.0.1:0", KS_METRICS_AGENT, &m, &errmsg), 0);
    char addr[64];
    struct cli_metrics_server *m2 = NULL;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", cli_metrics_port(m));
    errmsg = NULL;
    ck_assert_int_eq(cli_metrics_serve(addr, KS_METRICS_AGENT, &m2, &errmsg),
                     KS_EUNAVAIL);
    free(errmsg);
    cli_metrics_stop(m);
}
END_TEST

/* ---- a real stack
 * ------------------------------------------------------------ */

static struct fixture_stack stack;

/* The token scrapes carry (a stack of `kscore up --metrics`), or NULL. */
static const char *scrape_bearer;

static double
scrape(unsigned port, const char *name, char **keep)
{
    char *body = NULL;
    int code = http_get_bearer(port, "/metrics", scrape_bearer, &body);
    ck_assert_msg(code == 200, "scrape of port %u: %d", port, code);
    check_exposition(body);
    double v = series(body, name);
    if (keep)
        *keep = body;
    else
        free(body);
    return v;
}

static int bport, aport;

/* A stack whose broker and agent serve metrics. Started and stopped in the
 * runner's process (an unchecked fixture), so a failing test leaves
 * nothing running. */
static void
metrics_stack_up(void)
{
    const char *bin = getenv("KSCORE_BIN");
    char blisten[64], alisten[64], state[PATH_MAX + 32];
    pid_t pid;

    bport = stack_free_port();
    aport = stack_free_port();
    if (!bin || bport <= 0 || aport <= 0 || bport == aport ||
        fixture_stack_start(&stack, NULL, 0) != 0)
        goto fail;
    /* The fixture's broker, again, with metrics: the only broker, so every
     * request and every recorded event is its own. */
    fixture_stack_broker_kill(&stack, SIGTERM);
    snprintf(blisten, sizeof(blisten), "127.0.0.1:%d", bport);
    snprintf(alisten, sizeof(alisten), "127.0.0.1:%d", aport);
    snprintf(state, sizeof(state), "%s/state-broker-m", stack.dir);
    char *bargv[] = {(char *)bin,
                     "broker",
                     "--nats",
                     stack.nats.url,
                     "--db",
                     stack.pg.conninfo,
                     "--local-agents",
                     "0",
                     "--state-dir",
                     state,
                     "--signing-key",
                     stack.signing_key,
                     "--metrics-listen",
                     blisten,
                     NULL};
    struct evt_connect_opts no = {.name = "test"};
    const char *extra[] = {"--metrics-listen", alisten, "--max-concurrent", "4",
                           NULL};
    if (stack_daemon(stack.dir, "broker", bargv, &pid) != 0 ||
        broker_wait_ready(stack.nats.url, &no, 30000) != 0 ||
        fixture_agent_spawn(&stack, "magent", "m1", extra) != 0)
        goto fail;
    return;
fail:
    fprintf(stderr, "test_metrics: cannot start the stack\n");
    stack_stop(stack.dir, "magent", 20000);
    fixture_stack_stop(&stack);
    exit(1);
}

static void
metrics_stack_down(void)
{
    stack_stop(stack.dir, "magent", 20000);
    fixture_stack_stop(&stack);
}

START_TEST(counters_move_during_a_batch)
{
    char *before = NULL, *after = NULL, *abefore = NULL, *aafter = NULL;
    struct fixture_out o = {0};

    double rec0 = scrape(bport, "kscore_events_recorded_total", &before);
    double ok0 = series(before, "kscore_commands_total{status=\"Succeeded\"}");
    double fail0 = series(before, "kscore_commands_total{status=\"Failed\"}");
    double lat0 = series(before, "kscore_record_latency_seconds_count");
    double aok0 = scrape(
        aport, "kscore_agent_commands_total{status=\"Succeeded\"}", &abefore);
    double claim0 =
        series(abefore, "kscore_agent_claim_duration_seconds_count");
    ck_assert(rec0 >= 0 && ok0 >= 0 && fail0 >= 0 && lat0 >= 0);
    ck_assert(aok0 == 0);
    ck_assert(series(abefore, "kscore_agent_slots") == 4);
    ck_assert(series(abefore, "kscore_nats_connected{component=\"agent\"}") ==
              1);

    /* A batch (one target) and a few commands, one of them failing. */
    const char *batch[] = {"batch", "--agents", "m1", "--", "true", NULL};
    ck_assert_int_eq(fixture_kscore(&stack, batch, &o), 0);
    ck_assert_msg(o.status == 0, "batch: %s", o.err);
    fixture_out_release(&o);
    for (int i = 0; i < 4; i++) {
        const char *exec[] = {"exec",
                              "--agent",
                              "m1",
                              "--",
                              "sh",
                              "-c",
                              i == 3 ? "exit 3" : "echo hi",
                              NULL};
        ck_assert_int_eq(fixture_kscore(&stack, exec, &o), 0);
        ck_assert_int_eq(o.status, i == 3 ? 3 : 0);
        fixture_out_release(&o);
    }
    /* A running child shows in the agent's gauge while it runs: it
     * waits at a gate until the gauge was read (a `sleep 3` could end
     * before a loaded machine's scrapes saw it). */
    struct fixture_gate gate;
    fixture_gate_init(&gate, stack.dir, "gauge");
    const char *slow[] = {"exec", "--agent", "m1", "--detach",
                          "--",   "sh",      "-c", gate.sh, NULL};
    ck_assert_int_eq(fixture_kscore(&stack, slow, &o), 0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
    double running = 0;
    for (int i = 0; i < 300 && running < 1; i++) {
        running = scrape(aport, "kscore_agent_running_children", NULL);
        if (running < 1)
            usleep(50000);
    }
    fixture_gate_open(&gate);
    ck_assert(running == 1);

    /* The broker records asynchronously: poll until it has all five. */
    double ok1 = 0;
    for (int i = 0; i < 200; i++) {
        free(after);
        scrape(bport, "kscore_events_recorded_total", &after);
        ok1 = series(after, "kscore_commands_total{status=\"Succeeded\"}");
        if (ok1 >= ok0 + 4)
            break;
        usleep(50000);
    }
    ck_assert_msg(ok1 >= ok0 + 4, "Succeeded %g -> %g", ok0, ok1);
    ck_assert(series(after, "kscore_commands_total{status=\"Failed\"}") ==
              fail0 + 1);
    /* Requested, Dispatched, Started, Completed each, and the batch's. */
    ck_assert(series(after, "kscore_events_recorded_total") >= rec0 + 20);
    ck_assert(series(after, "kscore_record_latency_seconds_count") >=
              lat0 + 20);
    ck_assert(series(after, "kscore_command_duration_seconds_count") >= 5);
    ck_assert(series(after, "kscore_append_duration_seconds_count") > 0);
    ck_assert(series(after, "kscore_agents_online") >= 1);
    ck_assert(series(after, "kscore_nats_connected{component=\"broker\"}") ==
              1);
    ck_assert(series(after, "kscore_postgres_connections{state=\"open\"}") >=
              1);
    ck_assert(series(after, "kscore_postgres_connections{state=\"down\"}") ==
              0);
    ck_assert(series(after, "kscore_queue_depth{queue=\"events\"}") >= 0);
    ck_assert(series(after, "kscore_queue_depth{queue=\"commands\"}") >= 0);
    ck_assert(series(after, "kscore_recorder_redeliveries_total") >= 0);
    ck_assert(series(after, "kscore_claim_conflicts_total") == 0);
    /* The broker alone shows no agent metrics. */
    ck_assert(series(after, "kscore_agent_running_children") == -1);

    double aok1 = 0;
    for (int i = 0; i < 100; i++) {
        free(aafter);
        aok1 =
            scrape(aport, "kscore_agent_commands_total{status=\"Succeeded\"}",
                   &aafter);
        if (aok1 >= aok0 + 4)
            break;
        usleep(50000);
    }
    ck_assert_msg(aok1 >= aok0 + 4, "agent Succeeded %g -> %g", aok0, aok1);
    ck_assert(
        series(aafter, "kscore_agent_commands_total{status=\"Failed\"}") == 1);
    ck_assert(series(aafter, "kscore_agent_claim_duration_seconds_count") >=
              claim0 + 6);
    ck_assert(series(aafter, "kscore_agent_command_duration_seconds_count") >=
              5);
    ck_assert(series(aafter, "kscore_events_recorded_total") == -1);

    /* The slow one ends; the gauge comes back to 0. */
    for (int i = 0; i < 200 && running > 0; i++) {
        usleep(50000);
        running = scrape(aport, "kscore_agent_running_children", NULL);
    }
    ck_assert(running == 0);
    free(before);
    free(after);
    free(abefore);
    free(aafter);
}
END_TEST

/* ---- kscore up --metrics ------------------------------------------------ */

static char up_tmp[PATH_MAX], up_home[PATH_MAX + 16];

static void
up_setup(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(up_tmp, sizeof(up_tmp), "%s/kscore-metrics-XXXXXX",
             t && *t ? t : "/tmp");
    if (!mkdtemp(up_tmp))
        exit(1);
    snprintf(up_home, sizeof(up_home), "%s/home", up_tmp);
}

static void
up_teardown(void)
{
    struct fixture_out o;
    const char *args[] = {"down", NULL};
    char cmd[PATH_MAX + 16];
    fixture_kscore_home(up_home, args, &o);
    fixture_out_release(&o);
    const char *keep = getenv("KSCORE_KEEP_TMP");
    if (keep && strcmp(keep, "1") == 0)
        return;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", up_tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", up_tmp);
}

/* `kscore up --metrics` of up_home (exit 0), and its env file into env. */
static void
up_metrics(char *env, size_t len)
{
    struct fixture_out o;
    char path[PATH_MAX + 32];
    setenv("KSCORE_PG_FAST", "1", 0);
    ck_assert_int_eq(
        fixture_kscore_home(up_home, (const char *[]){"up", "--metrics", NULL},
                            &o),
        0);
    ck_assert_msg(o.status == 0, "up: %s", o.err);
    fixture_out_release(&o);
    snprintf(path, sizeof(path), "%s/env", up_home);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(env, 1, len - 1, f);
    env[n] = '\0';
    fclose(f);
}

/* The token of the stack's /metrics (keys/metrics.token; static). */
static const char *
up_token(void)
{
    static char token[EVT_TOKEN_MAX + 1];
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/keys/" STACK_METRICS_TOKEN, up_home);
    ck_assert_int_eq(evt_token_file_read(path, token, sizeof(token), NULL),
                     0);
    return token;
}

/* The port of KEY='http://127.0.0.1:PORT...' in env, or 0. */
static unsigned
env_port(const char *env, const char *key)
{
    char pat[128];
    const char *p;
    snprintf(pat, sizeof(pat), "%s='http://127.0.0.1:", key);
    p = strstr(env, pat);
    return p ? (unsigned)strtoul(p + strlen(pat), NULL, 10) : 0;
}

START_TEST(local_stack_serves_metrics)
{
    struct fixture_out o;
    char path[PATH_MAX + 32], env[4096];
    FILE *f;
    size_t n;

    up_metrics(env, sizeof(env));
    snprintf(path, sizeof(path), "%s/env", up_home);
    unsigned bp = env_port(env, "KSCORE_BROKER_METRICS_URL");
    unsigned ap = env_port(env, "KSCORE_AGENT_METRICS_URL");
    ck_assert_msg(bp && ap, "env: %s", env);
    ck_assert_msg(!strstr(env, "KSCORE_NATS_MONITOR_URL"), "env: %s", env);
    scrape_bearer = up_token();

    /* nats-server's own monitoring, asked as the stack's system user. */
    {
        struct stack_node nd;
        json_t *j = NULL;
        ck_assert_int_eq(stack_single_node(up_home, &nd), 0);
        ck_assert_int_eq(stack_nats_monitor(&nd, "VARZ", 0, 5000, &j), 0);
        ck_assert_ptr_nonnull(json_string_value(json_object_get(j,
                                                                "server_id")));
        json_decref(j);
    }

    double ok0 =
        scrape(bp, "kscore_commands_total{status=\"Succeeded\"}", NULL);
    double aok0 =
        scrape(ap, "kscore_agent_commands_total{status=\"Succeeded\"}", NULL);
    ck_assert_int_eq(
        fixture_kscore_home(up_home,
                            (const char *[]){"exec", "--", "true", NULL}, &o),
        0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
    double ok1 = ok0;
    for (int i = 0; i < 200 && ok1 < ok0 + 1; i++) {
        ok1 = scrape(bp, "kscore_commands_total{status=\"Succeeded\"}", NULL);
        if (ok1 < ok0 + 1)
            usleep(50000);
    }
    ck_assert(ok1 == ok0 + 1);
    ck_assert(scrape(ap, "kscore_agent_commands_total{status=\"Succeeded\"}",
                     NULL) == aok0 + 1);
    /* Without --metrics, `up` after `down` serves none. */
    ck_assert_int_eq(
        fixture_kscore_home(up_home, (const char *[]){"down", NULL}, &o), 0);
    fixture_out_release(&o);
    ck_assert_int_eq(
        fixture_kscore_home(up_home, (const char *[]){"up", NULL}, &o), 0);
    ck_assert_int_eq(o.status, 0);
    fixture_out_release(&o);
    f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    n = fread(env, 1, sizeof(env) - 1, f);
    env[n] = '\0';
    fclose(f);
    ck_assert_uint_eq(env_port(env, "KSCORE_BROKER_METRICS_URL"), 0);
    scrape_bearer = NULL;
}
END_TEST

/* Listening TCP ports of pid (its sockets' inodes in /proc/<pid>/fd, found
 * LISTEN in /proc/net/tcp and tcp6), into ports; how many. */
static int
listen_ports(pid_t pid, int *ports, int max)
{
    char dir[64], link[PATH_MAX], path[PATH_MAX + 64], line[512];
    unsigned long inodes[256];
    int ni = 0, n = 0;
    DIR *d;
    struct dirent *de;
    snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
    d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    while ((de = readdir(d)) && ni < 256) {
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        ssize_t l = readlink(path, link, sizeof(link) - 1);
        if (l <= 0)
            continue;
        link[l] = '\0';
        if (sscanf(link, "socket:[%lu]", &inodes[ni]) == 1)
            ni++;
    }
    closedir(d);
    const char *tables[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (int t = 0; t < 2; t++) {
        FILE *f = fopen(tables[t], "re");
        while (f && fgets(line, sizeof(line), f)) {
            char local[128];
            unsigned st;
            unsigned long inode;
            if (sscanf(line, " %*d: %127s %*s %x %*s %*s %*s %*d %*d %lu",
                       local, &st, &inode) != 3 ||
                st != 0x0A /* TCP_LISTEN */)
                continue;
            for (int i = 0; i < ni; i++)
                if (inodes[i] == inode && n < max)
                    ports[n++] = (int)strtol(strrchr(local, ':') + 1, NULL,
                                             16);
        }
        if (f)
            fclose(f);
    }
    return n;
}

/*
 * What a local user without the stack's credentials can read of it (issue
 * 21): on the code before, nats-server's monitoring port (/connz: every
 * user's NKey, address and subscriptions) and the broker's and the
 * agent's /metrics answered anyone on the host. Now nats-server listens
 * on its client port only (its monitoring is asked over NATS by the
 * system user), and /metrics wants the token in the owner's keys/.
 */
START_TEST(a_local_user_reads_no_monitoring)
{
    struct fixture_out o;
    char path[PATH_MAX + 64], env[4096], *body = NULL;
    struct stat st;

    /* --metrics applies when the stack starts. */
    fixture_kscore_home(up_home, (const char *[]){"down", NULL}, &o);
    fixture_out_release(&o);
    up_metrics(env, sizeof(env));
    unsigned ports[2] = {env_port(env, "KSCORE_BROKER_METRICS_URL"),
                         env_port(env, "KSCORE_AGENT_METRICS_URL")};
    ck_assert_msg(ports[0] && ports[1], "env: %s", env);
    /* Without the token, or with another, no metrics. */
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(http_get(ports[i], "/metrics", &body, NULL, 0), 401);
        ck_assert_ptr_null(strstr(body, "kscore_"));
        free(body);
        ck_assert_int_eq(http_get_bearer(ports[i], "/metrics",
                                         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                         &body),
                         401);
        free(body);
        ck_assert_int_eq(http_get_bearer(ports[i], "/metrics", up_token(),
                                         &body),
                         200);
        free(body);
    }
    /* The token is the owner's alone. */
    snprintf(path, sizeof(path), "%s/keys", up_home);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 077, 0);
    snprintf(path, sizeof(path), "%s/keys/" STACK_METRICS_TOKEN, up_home);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 077, 0);

    /* nats-server listens on its client port and nowhere else. */
    pid_t npid = 0;
    ck_assert_int_eq(stack_pidfile_alive(up_home, "nats", &npid), 1);
    int lp[8];
    int nl = listen_ports(npid, lp, 8);
    ck_assert_msg(nl == 1, "nats-server listens on %d ports (%d, %d)", nl,
                  nl > 0 ? lp[0] : 0, nl > 1 ? lp[1] : 0);
    ck_assert_int_eq(lp[0], stack_nats_saved_port(up_home));

    /* Its monitoring answers the system user, and not the login's
     * operator credential. */
    struct stack_node nd;
    json_t *j = NULL;
    ck_assert_int_eq(stack_single_node(up_home, &nd), 0);
    ck_assert_int_eq(stack_nats_monitor(&nd, "CONNZ", 0, 5000, &j), 0);
    ck_assert(json_is_array(json_object_get(j, "connections")));
    json_decref(j);
    /* The system user sees nothing of kscore's own traffic: its account
     * imports none. */
    {
        char sys_seed[PATH_MAX + 64];
        struct evt_connect_opts so = {.name = "sys", .nkey_file = sys_seed,
                                      .timeout_ms = 5000};
        struct evt_conn *sc = NULL;
        natsSubscription *all = NULL;
        natsMsg *m = NULL;
        snprintf(sys_seed, sizeof(sys_seed), "%s/keys/system.nk", up_home);
        ck_assert_int_eq(evt_connect(nd.url, &so, &sc, NULL), 0);
        ck_assert_int_eq(natsConnection_SubscribeSync(&all, sc->nc,
                                                      "kscore.>"),
                         NATS_OK);
        natsConnection_Flush(sc->nc);
        ck_assert_int_eq(
            fixture_kscore_home(up_home,
                                (const char *[]){"exec", "--", "true", NULL},
                                &o),
            0);
        ck_assert_int_eq(o.status, 0);
        fixture_out_release(&o);
        ck_assert_int_ne(natsSubscription_NextMsg(&m, all, 500), NATS_OK);
        natsSubscription_Destroy(all);
        evt_close(sc);
    }
    char *seed = stack_env_get(up_home, "KSCORE_NATS_NKEY");
    ck_assert_ptr_nonnull(seed);
    struct evt_connect_opts co = {.name = "op", .nkey_file = seed,
                                  .timeout_ms = 5000};
    struct evt_conn *c = NULL;
    ck_assert_int_eq(evt_connect(nd.url, &co, &c, NULL), 0);
    natsMsg *reply = NULL;
    ck_assert_int_ne(natsConnection_RequestString(
                         &reply, c->nc, "$SYS.REQ.SERVER.PING.CONNZ", "",
                         1000),
                     NATS_OK);
    natsMsg_Destroy(reply);
    evt_close(c);
    free(seed);
}
END_TEST

static Suite *
suite(void)
{
    Suite *s = suite_create("metrics");
    TCase *t = tcase_create("format");
    tcase_add_test(t, render_is_valid_text_format);
    tcase_add_test(t, collectors_run_at_each_scrape);
    tcase_add_test(t, server_answers_metrics_and_404);
    tcase_add_test(t, metrics_need_their_token);
    tcase_add_test(t, idle_connections_do_not_starve_the_scraper);
    suite_add_tcase(s, t);
    t = tcase_create("stack");
    tcase_set_timeout(t, 300);
    tcase_add_unchecked_fixture(t, metrics_stack_up, metrics_stack_down);
    tcase_add_test(t, counters_move_during_a_batch);
    suite_add_tcase(s, t);
    t = tcase_create("up");
    tcase_set_timeout(t, 300);
    tcase_add_unchecked_fixture(t, up_setup, up_teardown);
    tcase_add_test(t, local_stack_serves_metrics);
    tcase_add_test(t, a_local_user_reads_no_monitoring);
    suite_add_tcase(s, t);
    return s;
}

int
main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
