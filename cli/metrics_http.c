/*
 * metrics_http.c: the Prometheus scrape endpoint of `kscore broker` and
 * `kscore agent` (--metrics), on libmicrohttpd's own polling thread. Only
 * the daemon half (kscore-daemon) links it, and so libmicrohttpd. With a
 * token file, every request must carry "Authorization: Bearer <token>"
 * (Prometheus: scrape_config authorization.credentials_file): a port on
 * loopback is still open to every local user.
 */
#include "metrics_http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

struct cli_metrics_server {
    struct MHD_Daemon *d;
    unsigned roles;
    unsigned port;
    /* "Bearer <token>" every request must carry; "" for none. */
    char auth[8 + EVT_TOKEN_MAX + 1];
};

static void
set_err(char **errmsg, const char *fmt, const char *a)
{
    if (errmsg && asprintf(errmsg, fmt, a) < 0)
        *errmsg = NULL;
}

static enum MHD_Result
answer(void *cls, struct MHD_Connection *conn, const char *url,
       const char *method, const char *version, const char *upload,
       size_t *upload_len, void **req_cls)
{
    struct cli_metrics_server *m = cls;
    struct MHD_Response *r;
    enum MHD_Result ret;
    unsigned status = MHD_HTTP_OK;
    char *text = NULL;
    size_t len = 0;

    const char *given =
        m->auth[0] ? MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                 MHD_HTTP_HEADER_AUTHORIZATION)
                   : NULL;
    if (m->auth[0] &&
        (!given || strlen(given) != strlen(m->auth) ||
         CRYPTO_memcmp(given, m->auth, strlen(m->auth)) != 0)) {
        /* RFC 6750: a bearer token, compared in constant time. */
        static const char msg[] = "a bearer token is needed: the metrics "
                                  "are their owner's\n";
        r = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg,
                                            MHD_RESPMEM_PERSISTENT);
        if (r)
            MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                    "Bearer realm=\"kscore\"");
        status = MHD_HTTP_UNAUTHORIZED;
    } else if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        static const char msg[] = "only GET\n";
        r = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg,
                                            MHD_RESPMEM_PERSISTENT);
        status = MHD_HTTP_METHOD_NOT_ALLOWED;
    } else if (strcmp(url, "/metrics") != 0 && strcmp(url, "/") != 0) {
        static const char msg[] = "not found: the metrics are at /metrics\n";
        r = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg,
                                            MHD_RESPMEM_PERSISTENT);
        status = MHD_HTTP_NOT_FOUND;
    } else if (ks_metrics_render(m->roles, &text, &len) != 0) {
        static const char msg[] = "out of memory\n";
        r = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg,
                                            MHD_RESPMEM_PERSISTENT);
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
    } else {
        r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
        if (!r)
            free(text);
        else
            MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                                    "text/plain; version=0.0.4; "
                                    "charset=utf-8");
    }
    if (!r)
        return MHD_NO;
    ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static int
parse_listen(const char *listen, struct sockaddr_storage *ss)
{
    char host[256];
    const char *colon, *port_s;
    char *end;
    unsigned long port;

    memset(ss, 0, sizeof(*ss));
    if (!listen || !listen[0])
        return KS_EINVAL;
    if (listen[0] == '[') {
        const char *rb = strchr(listen, ']');
        if (!rb || rb[1] != ':' || (size_t)(rb - listen - 1) >= sizeof(host))
            return KS_EINVAL;
        memcpy(host, listen + 1, (size_t)(rb - listen - 1));
        host[rb - listen - 1] = '\0';
        port_s = rb + 2;
    } else {
        colon = strrchr(listen, ':');
        if (!colon || (size_t)(colon - listen) >= sizeof(host))
            return KS_EINVAL;
        memcpy(host, listen, (size_t)(colon - listen));
        host[colon - listen] = '\0';
        port_s = colon + 1;
    }
    errno = 0;
    port = strtoul(port_s, &end, 10);
    if (!port_s[0] || *end || errno || port > 65535)
        return KS_EINVAL;
    if (!host[0] || strcmp(host, "*") == 0) {
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
        a6->sin6_family = AF_INET6;
        a6->sin6_addr = in6addr_any;
        a6->sin6_port = htons((uint16_t)port);
        return 0;
    }
    struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)port);
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        return 0;
    }
    if (strcmp(host, "localhost") == 0) {
        a4->sin_family = AF_INET;
        a4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a4->sin_port = htons((uint16_t)port);
        return 0;
    }
    return KS_EINVAL;
}

int
cli_metrics_serve(const char *listen, unsigned roles,
                  struct cli_metrics_server **out, char **errmsg)
{
    return cli_metrics_serve_auth(listen, roles, NULL, out, errmsg);
}

int
cli_metrics_serve_auth(const char *listen, unsigned roles,
                       const char *token_file,
                       struct cli_metrics_server **out, char **errmsg)
{
    struct sockaddr_storage ss;
    struct cli_metrics_server *m;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    char token[EVT_TOKEN_MAX + 1];
    int rc;

    *out = NULL;
    if (parse_listen(listen, &ss) != 0) {
        set_err(errmsg,
                "bad metrics address '%s' (ADDR:PORT, [ADDR]:PORT or :PORT)",
                listen ? listen : "");
        return KS_EINVAL;
    }
    if (token_file && token_file[0] &&
        (rc = evt_token_file_read(token_file, token, sizeof(token),
                                     errmsg)))
        return rc;
    m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->roles = roles;
    if (token_file && token_file[0])
        snprintf(m->auth, sizeof(m->auth), "Bearer %s", token);
    if (ss.ss_family == AF_INET6)
        flags |=
            MHD_USE_IPv6 |
            (IN6_IS_ADDR_UNSPECIFIED(&((struct sockaddr_in6 *)&ss)->sin6_addr)
                 ? MHD_USE_DUAL_STACK
                 : 0);
    /* A scrape renders in microseconds: one thread, few connections, short
     * timeouts so a stuck client holds nothing for long. A few per client
     * address: else one client that opens connections and sends nothing
     * (slowloris) holds all of them, and the scraper gets none. */
    m->d = MHD_start_daemon(
        flags, 0, NULL, NULL, answer, m, MHD_OPTION_SOCK_ADDR,
        (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, (unsigned)64,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)4,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!m->d) {
        set_err(errmsg, "cannot listen for metrics on %s", listen);
        free(m);
        return KS_EUNAVAIL;
    }
    const union MHD_DaemonInfo *di =
        MHD_get_daemon_info(m->d, MHD_DAEMON_INFO_BIND_PORT);
    m->port = di ? di->port : 0;
    *out = m;
    return 0;
}

unsigned
cli_metrics_port(const struct cli_metrics_server *m)
{
    return m ? m->port : 0;
}

void
cli_metrics_stop(struct cli_metrics_server *m)
{
    if (!m)
        return;
    MHD_stop_daemon(m->d);
    free(m);
}
