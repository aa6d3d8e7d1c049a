/* kscore agents, and kscore agent label (an operator's command: the
 * broker signs the new labels). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli_int.h"

/* "k=v,k2=v2" (each key after prefix), printable, into buf. */
static void
kv_text(Ks__EnvVar *const *v, size_t n, const char *prefix, char *buf,
        size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < n && used < len; k++)
        used += (size_t)snprintf(buf + used, len - used, "%s%s%s=%s",
                                 k ? "," : "", prefix, v[k]->name,
                                 v[k]->value);
    cli_printable(buf);
}

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
                   "running, labels (signed by the broker), facts (what "
                   "each agent says of its host: fact.os, fact.kernel, "
                   "fact.arch, fact.cpus, fact.mem_mb; its own word).\n"
                   "--select: only the agents kscore batch --select would "
                   "pick (K=V, K!=V, K=V1|V2, globs; fact.K=V for a "
                   "fact).\n");
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
    /* A deaf registry view: online as of its last entry (broker
     * registry.c view_instant_locked). */
    if (!json && rep->view_stale_ms > 0)
        cli_err("agents: the broker has heard no registry entry for %.1f s "
                "(its registry watch or bucket is down): online is as of "
                "then",
                (double)rep->view_stale_ms / 1000);
    if (!json)
        printf("%-24s %-8s %-10s %7s %5s  %-30s %s\n", "ID", "STATE",
               "LAST SEEN", "RUNNING", "MAX", "LABELS (signed)",
               "FACTS (the agent's own word)");
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
            /* > 0: online is as of the broker's registry view that long
             * ago (its watch or bucket down) */
            json_object_set_new(o, "view_stale_ms",
                                json_integer(rep->view_stale_ms));
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
            /* A relabel's (kscore agent label): by whom, when. */
            if (st->labels_at_us) {
                json_object_set_new(o, "labels_by",
                                    json_string(st->labels_by));
                json_object_set_new(o, "labels_at",
                                    json_string(cli_time(st->labels_at_us)));
            }
            /* What the agent says of its host: its own word, never
             * signed, never a label (docs/fleet-runs.md "Inventory"). */
            json_t *facts = json_object();
            for (size_t k = 0; k < in->n_facts; k++)
                json_object_set_new(facts, in->facts[k]->name,
                                    json_string(in->facts[k]->value));
            json_object_set_new(o, "facts", facts);
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
        char ago[32], labels[512], facts[512];
        cli_ago(ago, sizeof(ago), now - st->last_seen_us);
        /* Labels the broker did not sign (--allow-unsigned-labels) are
         * marked so; facts are always the agent's say, prefixed fact. */
        kv_text(in->labels, in->n_labels, "", labels, sizeof(labels));
        if (in->n_labels && !st->labels_signed &&
            strlen(labels) + 12 < sizeof(labels))
            strcat(labels, " (unsigned)");
        kv_text(in->facts, in->n_facts, BROKER_FACT_PREFIX, facts,
                sizeof(facts));
        printf("%-24s %-8s %-10s %7u %5u  %-30s %s\n", in->agent_id,
               st->duplicate ? "duplicate"
               : st->online  ? "online"
                             : "offline",
               ago, in->running, in->max_concurrent,
               labels[0] ? labels : "-", facts[0] ? facts : "-");
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

/* ---- kscore agent label -------------------------------------------------- */

static const char label_usage[] =
    "usage: kscore agent label ID|pool-POOL KEY=VALUE|KEY-... [--json]\n"
    "Changes an agent's signed labels without a new enrolment: KEY=VALUE\n"
    "adds or replaces a label, KEY- removes one. The broker signs the new\n"
    "labels with its key, records the change (an AgentLabelsChanged event\n"
    "on stream agent-ID, naming you) and uses them from the agent's next\n"
    "heartbeat (within 2 s; an offline agent when it is back); commands\n"
    "get them as KSCORE_LABEL_<KEY>. A pool's ids share its labels: name\n"
    "the pool (pool-POOL). Keys: letters, digits, _ . - /, up to 63, not\n"
    "fact.*; values up to 255 bytes, no control character, no ','.\n"
    "Needs a \"label\" rule of the policy that matches the agent before and\n"
    "after the change. A newer enrolment (kscore agent enroll) replaces\n"
    "the labels set before it.\n"
    "  --json   one object: agent_id, labels, previous, changed, at,\n"
    "           online, applied\n"
    "Exit 0 (also when nothing changed), 2 usage, 125 refused or failed.\n"
    CLI_CONN_USAGE;

static json_t *
labels_json(Ks__EnvVar *const *v, size_t n)
{
    json_t *o = json_object();
    for (size_t i = 0; i < n; i++)
        json_object_set_new(o, v[i]->name, json_string(v[i]->value));
    return o;
}

/* Whether the broker shows id (or, for "pool-P", an id of pool P) with
 * exactly labels: the change is in effect. */
static bool
labels_seen(struct evt_conn *c, const char *id, Ks__EnvVar *const *want,
            size_t n)
{
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    Ks__AgentsReply *rep = NULL;
    const char *pool = strncmp(id, "pool-", 5) == 0 ? id + 5 : NULL;
    bool seen = false;

    if (broker_call(c, EVT_API_AGENTS, &req.base,
                    &ks__agents_reply__descriptor, 5000,
                    (ProtobufCMessage **)&rep) != 0)
        return false;
    for (size_t i = 0; !rep->error_code && i < rep->n_agents && !seen; i++) {
        const Ks__AgentInfo *in = rep->agents[i]->info;
        if (pool ? strcmp(in->pool, pool) != 0 : strcmp(in->agent_id, id))
            continue;
        seen = in->n_labels == n;
        for (size_t k = 0; seen && k < n; k++) {
            bool found = false;
            for (size_t j = 0; j < in->n_labels && !found; j++)
                found = strcmp(in->labels[j]->name, want[k]->name) == 0 &&
                        strcmp(in->labels[j]->value, want[k]->value) == 0;
            seen = found;
        }
        if (pool)
            break; /* the ids of a pool have its labels */
    }
    ks__agents_reply__free_unpacked(rep, NULL);
    return seen;
}

int
cmd_agent_label(int argc, char **argv)
{
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       CLI_CONN_LONGOPTS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__LabelRequest req = KS__LABEL_REQUEST__INIT;
    Ks__LabelReply *rep = NULL;
    Ks__EnvVar *sets = NULL, **setp = NULL;
    char **removes = NULL, why[256];
    bool json = false;
    int opt, rc = CLI_EXIT_USAGE;

    /* argv[0] is "label": getopt permutes the operands after it. */
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            json = true;
            break;
        case 'h':
            fputs(label_usage, stdout);
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            fputs(label_usage, stderr);
            return CLI_EXIT_USAGE;
        }
    }
    if (argc - optind < 2) {
        cli_err("expected an agent and a change: kscore agent label ID "
                "KEY=VALUE|KEY- ... (see --help)");
        goto out;
    }
    const char *id = argv[optind];
    const char *pool = strncmp(id, "pool-", 5) == 0 ? id + 5 : NULL;
    if (!evt_agent_id_valid(pool ? pool : id)) {
        cli_err("bad agent id '%s' (letters, digits, _ and -, up to %d; "
                "pool-POOL for a pool)",
                id, EVT_AGENT_ID_MAX);
        goto out;
    }
    size_t n = (size_t)(argc - optind - 1);
    sets = calloc(n, sizeof(*sets));
    setp = calloc(n, sizeof(*setp));
    removes = calloc(n, sizeof(*removes));
    if (!sets || !setp || !removes) {
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char *arg = argv[optind + 1 + i], *eq = strchr(arg, '=');
        size_t len = strlen(arg);
        if (eq) {
            *eq = '\0';
            ks__env_var__init(&sets[req.n_set]);
            sets[req.n_set].name = arg;
            sets[req.n_set].value = eq + 1;
            setp[req.n_set] = &sets[req.n_set];
            req.n_set++;
            if (broker_label_check(arg, eq + 1, why, sizeof(why))) {
                cli_err("%s", why);
                goto out;
            }
        } else if (len > 1 && arg[len - 1] == '-') {
            arg[len - 1] = '\0';
            removes[req.n_remove++] = arg;
            if (broker_label_check(arg, NULL, why, sizeof(why))) {
                cli_err("%s", why);
                goto out;
            }
        } else {
            cli_err("bad change '%s': KEY=VALUE sets a label, KEY- removes "
                    "one",
                    arg);
            goto out;
        }
    }
    req.agent_id = (char *)id;
    req.set = setp;
    req.remove = removes;
    if ((rc = cli_connect(&cc, &c)))
        goto out;
    rc = broker_call(c, EVT_API_LABEL, &req.base, &ks__label_reply__descriptor,
                     10000, (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        cli_err("agent label %s: %s", id, rc ? ks_strerror(rc) : rep->error);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    /* In effect at the agent's next heartbeat (EVT_HEARTBEAT_MS): say
     * so once the broker shows it, rather than before. */
    bool applied = !rep->changed;
    for (int64_t until = ks_mono_us() + 10 * INT64_C(1000000);
         !applied && rep->online && ks_mono_us() < until;) {
        applied = labels_seen(c, id, rep->labels, rep->n_labels);
        if (!applied)
            nanosleep(&(struct timespec){0, 200 * 1000000L}, NULL);
    }
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "agent_id", json_string(id));
        json_object_set_new(o, "labels",
                            labels_json(rep->labels, rep->n_labels));
        json_object_set_new(o, "previous",
                            labels_json(rep->previous, rep->n_previous));
        json_object_set_new(o, "changed", json_boolean(rep->changed));
        json_object_set_new(o, "at", rep->at_us
                                         ? json_string(cli_time(rep->at_us))
                                         : json_null());
        json_object_set_new(o, "online", json_boolean(rep->online));
        json_object_set_new(o, "applied", json_boolean(applied));
        cli_print_json(o);
    } else {
        char now_s[2048], was[2048];
        kv_text(rep->labels, rep->n_labels, "", now_s, sizeof(now_s));
        kv_text(rep->previous, rep->n_previous, "", was, sizeof(was));
        printf("%s: %s (was %s)\n", id, now_s[0] ? now_s : "no labels",
               was[0] ? was : "no labels");
        fprintf(stderr, "kscore: %s\n",
                !rep->changed ? "unchanged: nothing recorded"
                : applied     ? "signed, recorded, and in effect"
                : rep->online
                    ? "signed and recorded; not yet seen in a heartbeat "
                      "(it takes effect at the next one)"
                    : "signed and recorded; the agent is offline: it takes "
                      "effect at its next heartbeat");
    }
    rc = 0;
out:
    if (rep)
        ks__label_reply__free_unpacked(rep, NULL);
    evt_close(c);
    cli_conn_release(&cc);
    free(sets);
    free(setp);
    free(removes);
    return rc;
}
