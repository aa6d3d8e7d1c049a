/*
 * The Prometheus endpoint of the daemons (cli/metrics_http.c): `kscore
 * broker --metrics ADDR` and `kscore agent --metrics ADDR`. libmicrohttpd,
 * its own polling thread; GET /metrics answers ks_metrics_render(roles) as
 * text/plain; version=0.0.4. Only kscore-daemon (and test_metrics) link
 * it: the operator's kscore never loads libmicrohttpd.
 */
#ifndef KSCORE_CLI_METRICS_HTTP_H
#define KSCORE_CLI_METRICS_HTTP_H

#include "events.h"
#include "kproto.h"

struct cli_metrics_server;
/*
 * Listens on listen ("ADDR:PORT", "[V6ADDR]:PORT" or ":PORT" for every
 * address; port 0 picks a free one); roles: KS_METRICS_* (kproto.h). 0
 * with *out, or KS_EINVAL (bad address) / KS_EUNAVAIL (cannot listen)
 * with *errmsg (malloc'd).
 */
int cli_metrics_serve(const char *listen, unsigned roles,
                      struct cli_metrics_server **out, char **errmsg);
/*
 * As cli_metrics_serve; with token_file (not NULL or ""), every request
 * must carry "Authorization: Bearer <the token in it>", else 401 (a port
 * on loopback is open to every local user). The file is read once, as
 * evt_token_file_read (events.h). Errors as cli_metrics_serve, and its
 * errors.
 */
int cli_metrics_serve_auth(const char *listen, unsigned roles,
                           const char *token_file,
                           struct cli_metrics_server **out, char **errmsg);
/* The port it listens on. */
unsigned cli_metrics_port(const struct cli_metrics_server *m);
/* Stops serving and frees. Accepts NULL. */
void cli_metrics_stop(struct cli_metrics_server *m);

#endif
