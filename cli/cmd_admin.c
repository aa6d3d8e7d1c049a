/* kscore agents. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_int.h"

int
cmd_agents(int argc, char **argv)
{
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       {"select", required_argument, 0, 's'},
                                       CLI_CONN_LONGOPTS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    char *terms[64];
    size_t n_terms = 0;
    Ks__AgentsReply *rep = NULL;
    bool json = false;
    int opt, rc;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            json = true;
            break;
        case 's': {
            /* The matcher kscore batch --select resolves with (broker.h). */
            char why[256];
            for (char *save = NULL, *t = strtok_r(optarg, ",", &save); t;
                 t = strtok_r(NULL, ",", &save)) {
                if (broker_select_check(t, why, sizeof(why)) ||
                    n_terms == 64) {
                    cli_err("--select: %s",
                            n_terms == 64 ? "at most 64 terms" : why);
                    return CLI_EXIT_USAGE;
                }
                terms[n_terms++] = t;
            }
            break;
        }
        case 'h':
            printf("usage: kscore agents [--select TERM[,TERM]] [--json]\n"
                   "Lists the agents the broker knows: id, state, last seen, "
                   "running, labels.\n--select: only the agents kscore "
                   "batch --select would pick (K=V, K!=V, K=V1|V2, globs).\n");
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            return CLI_EXIT_USAGE;
        }
    }
    if (optind != argc) {
        cli_err("usage: kscore agents [--json]");
        return CLI_EXIT_USAGE;
    }
    if ((rc = cli_connect(&cc, &c)))
        return rc;
    rc = broker_call(c, EVT_API_AGENTS, &req.base,
                     &ks__agents_reply__descriptor, 5000,
                     (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        cli_err("agents: %s", rc ? ks_strerror(rc) : rep->error);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (!json)
        printf("%-24s %-8s %-10s %7s %5s  %s\n", "ID", "STATE", "LAST SEEN",
               "RUNNING", "MAX", "LABELS");
    int64_t now = ks_now_us();
    for (size_t i = 0; i < rep->n_agents; i++) {
        const Ks__AgentStatus *st = rep->agents[i];
        const Ks__AgentInfo *in = st->info;
        if (!broker_select_match(in, terms, n_terms))
            continue;
        if (json) {
            json_t *o = json_object(), *labels = json_object();
            for (size_t k = 0; k < in->n_labels; k++)
                json_object_set_new(labels, in->labels[k]->name,
                                    json_string(in->labels[k]->value));
            json_object_set_new(o, "agent_id", json_string(in->agent_id));
            json_object_set_new(o, "online", json_boolean(st->online));
            json_object_set_new(o, "last_seen",
                                json_string(cli_time(st->last_seen_us)));
            json_object_set_new(o, "running", json_integer(in->running));
            json_object_set_new(o, "max_concurrent",
                                json_integer(in->max_concurrent));
            json_object_set_new(o, "labels", labels);
            /* true: the broker's signed attestation's labels (kscore
             * agent enroll); false: the agent's own say */
            json_object_set_new(o, "labels_signed",
                                json_boolean(st->labels_signed));
            json_object_set_new(o, "host", json_string(in->host));
            json_object_set_new(o, "version", json_string(in->version));
            json_object_set_new(o, "pid", json_integer(in->pid));
            /* two processes serve this id (the other's host and pid) */
            json_object_set_new(o, "duplicate", json_boolean(st->duplicate));
            if (st->duplicate) {
                json_object_set_new(o, "duplicate_host",
                                    json_string(st->duplicate_host));
                json_object_set_new(o, "duplicate_pid",
                                    json_integer(st->duplicate_pid));
            }
            /* its consumer, when the broker's guard found it stalled or
             * repaired it (broker/stall.c) */
            json_object_set_new(o, "consumer", cli_consumer_json(st));
            cli_print_json(o);
            continue;
        }
        char ago[32], labels[512] = "";
        size_t used = 0;
        snprintf(ago, sizeof(ago), "%.1fs ago",
                 (double)(now - st->last_seen_us) / 1e6);
        for (size_t k = 0; k < in->n_labels && used < sizeof(labels); k++)
            used += (size_t)snprintf(labels + used, sizeof(labels) - used,
                                     "%s%s=%s", k ? "," : "",
                                     in->labels[k]->name,
                                     in->labels[k]->value);
        cli_printable(labels);
        printf("%-24s %-8s %-10s %7u %5u  %s\n", in->agent_id,
               st->duplicate ? "duplicate"
               : st->online  ? "online"
                             : "offline",
               ago, in->running,
               in->max_concurrent, labels);
        char cons[640];
        cli_consumer_line(st, now, cons, sizeof(cons));
        if (cons[0])
            printf("  %s\n", cons);
    }
    rc = 0;
out:
    if (rep)
        ks__agents_reply__free_unpacked(rep, NULL);
    evt_close(c);
    return rc;
}
