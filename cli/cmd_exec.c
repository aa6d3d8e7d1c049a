/* kscore exec, get, events, cancel. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_int.h"

/* ---- exec ---------------------------------------------------------------- */

static const char exec_usage[] =
    "usage: kscore exec [OPTIONS] -- CMD [ARG]...\n"
    "       kscore exec [OPTIONS] --script FILE [--] [ARG]...\n"
    "Runs CMD on one agent through the broker and exits with its exit code\n"
    "(128+N when killed by signal N, 124 on timeout, 125 when kscore failed\n"
    "and the command was not accepted, 75 when it was refused because it\n"
    "could not start within its delivery deadline, or its operator's\n"
    "commands not ended pass cmds_operator_mib (busy: nothing recorded,\n"
    "try again later), 69 when the outcome is unknown: it names the command\n"
    "for kscore get; see docs/operating.md \"Exit codes\").\n"
    "  --agent ID          target agent (default: the local stack's agent)\n"
    "  --timeout D         SIGTERM to the process group after D (default: "
    "none)\n"
    "  --grace D           SIGKILL D after the SIGTERM (default 5s)\n"
    "  --env K=V           add to the command's environment (repeatable)\n"
    "  --secret-env NAME   pass $NAME from your environment, sealed to the\n"
    "                      agent's key: the broker, the record and the logs\n"
    "                      never see it (repeatable)\n"
    "  --cwd DIR           working directory (default /)\n"
    "  --deliver-within D  fail as Undeliverable if no agent claims it in D\n"
    "                      (default 30s); refused at once (exit 75) when it\n"
    "                      cannot start in D (without it: in 250 ms)\n"
    "  --idempotency-key K a repeat with the same key returns the first "
    "result\n"
    "                      (safe to repeat after exit 69)\n"
    "  --max-output SIZE   keep at most SIZE bytes of each of stdout and\n"
    "                      stderr (default 16M; K, M, G suffixes); the rest\n"
    "                      is counted, not kept\n"
    CLI_PAYLOAD_USAGE
    "  --detach            print the command id and return at once\n"
    "  --json              print one JSON object with the whole result\n"
    "  -q, --quiet         no notes on stderr about what it waits for\n"
    "Output is printed as the command writes it. Ctrl-C cancels the command\n"
    "(TERM, grace, KILL) and exits 130; a second Ctrl-C stops waiting.\n"
    "When the agent is offline, or no broker answers, it says so at once on\n"
    "stderr (\"kscore: agent X is offline ...: waiting up to 30s\"), as ssh\n"
    "and kubectl print their notes, whatever stderr is; -q leaves them out\n"
    "(errors are always printed).\n"
    "Stdin is read to its end before the command is sent (when it is not a\n"
    "terminal): use --no-stdin in a loop that reads its own stdin.\n"
    CLI_CONN_USAGE;

int
cmd_exec(int argc, char **argv)
{
    static const struct option lo[] = {
        {"agent", required_argument, 0, 'a'},
        CLI_SPEC_LONGOPTS,
        CLI_PAYLOAD_LONGOPTS,
        {"secret-env", required_argument, 0, 'X'},
        {"idempotency-key", required_argument, 0, 'k'},
        {"detach", no_argument, 0, 'D'},
        {"json", no_argument, 0, 'j'},
        {"quiet", no_argument, 0, 'q'},
        CLI_CONN_LONGOPTS,
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    Ks__ExecuteRequest req = KS__EXECUTE_REQUEST__INIT;
    struct cli_spec cs = {0};
    Ks__CommandSpec *sp = &cs.spec;
    struct cli_conn cc = {0};
    struct cli_secrets sec = {0};
    struct cli_payload pl = {0};
    struct evt_conn *c = NULL;
    Ks__ExecuteReply *rep = NULL;
    char *agent_from_env = NULL;
    const char *agent = NULL;
    bool json = false, quiet = false;
    int opt, rc = CLI_EXIT_USAGE;

    if (cli_spec_init(&cs, (size_t)argc) != 0)
        return CLI_EXIT_KSCORE;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "+q", lo, NULL)) != -1) {
        int taken = cli_spec_opt(&cs, opt, optarg);
        if (!taken)
            taken = cli_payload_opt(&pl, opt, optarg);
        if (taken < 0)
            goto out;
        if (taken)
            continue;
        switch (opt) {
        case 'a':
            agent = optarg;
            break;
        case 'X':
            if (cli_secret_opt(&sec, optarg) < 0)
                goto out;
            break;
        case 'k':
            req.idempotency_key = optarg;
            break;
        case 'D':
            req.detach = 1;
            break;
        case 'j':
            json = true;
            break;
        case 'q':
            quiet = true;
            break;
        case 'h':
            fputs(exec_usage, stdout);
            rc = 0;
            goto out;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            cli_err("see kscore exec --help");
            goto out;
        }
    }
    if (cli_payload_argv(&pl, &cs, argc, argv, optind, "exec") != 0 ||
        cli_secrets_check(&sec, sp) != 0)
        goto out;
    req.deliver_within_ms = cs.deliver_within_ms;
    if (!agent) {
        agent = getenv("KSCORE_AGENT");
        if (!agent || !agent[0])
            agent = agent_from_env = cli_env_get("KSCORE_AGENT");
    }
    if (!agent || !agent[0]) {
        /* No agent because there is no stack at all (no url anywhere):
         * kscore cannot reach anything, which is 125, not a usage error. */
        char *env_url = cli_env_get("KSCORE_NATS_URL");
        const char *url = cc.nats_url ? cc.nats_url : getenv("KSCORE_NATS_URL");
        if ((!url || !url[0]) && !env_url) {
            cli_err("the local stack is not running (no %s/env): start it "
                    "with `kscore up`, or give --nats URL and --agent ID",
                    cli_home());
            rc = CLI_EXIT_KSCORE;
        } else {
            cli_err("no agent: give --agent ID (no local stack agent found "
                    "in %s/env)",
                    cli_home());
        }
        free(env_url);
        goto out;
    }
    /* A usage error (docs/operating.md "Exit codes": 2), said before any
     * connection, as the broker would refuse it. */
    if (!evt_agent_id_valid(agent)) {
        cli_err("bad agent id '%s' (letters, digits, _ and -, up to %d)",
                agent, EVT_AGENT_ID_MAX);
        goto out;
    }
    req.agent_id = (char *)agent;
    req.spec = sp;
    /* The script and stdin are read whole before anything is sent. */
    if ((rc = cli_payload_load(&pl, sp, true)))
        goto out;

    if ((rc = cli_connect(&cc, &c)))
        goto out;
    if (cli_secrets_seal(&sec, c, &req.agent_id, 1, NULL, 0, false, sp)) {
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    struct cli_live lv;
    struct broker_exec_hooks hooks;
    cli_live_init(&lv, c, !json, quiet);
    cli_live_hooks(&lv, &hooks);
    if (!req.detach) {
        req.live_output = 1;
        cli_live_catch_sigint();
    }
    rc = broker_execute_hooks(c, &req, broker_execute_wait_ms(&req),
                              req.detach ? NULL : &hooks, &rep);
    if (rc == -EINTR) {
        rc = 130; /* a second Ctrl-C: detached (said so) */
        goto out;
    }
    if (rc) {
        if (natsConnection_Status(c->nc) != NATS_CONN_STATUS_CONNECTED)
            cli_err("lost the connection to NATS while waiting for the "
                    "result");
        else if (rc == KS_EUNAVAIL)
            cli_err("no broker is serving %s (is `kscore broker` running?)",
                    EVT_API_EXECUTE);
        else if (rc == KS_ETIMEDOUT)
            cli_err("no reply from the broker in time");
        else if (rc == KS_ETOOBIG)
            cli_err_too_large();
        else
            cli_err("execute: %s", ks_strerror(rc));
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (rep->error_code) {
        bool unknown = rep->error_code == KS_EINDOUBT;
        if (unknown)
            cli_outcome_unknown("command", rep->error, rep->command_id,
                                req.idempotency_key);
        else
            cli_err("%s", rep->error);
        if (json) {
            json_t *o = json_object();
            json_object_set_new(o, "error", json_string(rep->error));
            json_object_set_new(o, "error_code",
                                json_string(ks_err_name(rep->error_code)));
            json_object_set_new(o, "recorded",
                                unknown ? json_null() : json_false());
            if (rep->command_id && rep->command_id[0])
                json_object_set_new(o, "command_id",
                                    json_string(rep->command_id));
            cli_print_json(o);
        }
        rc = unknown                            ? CLI_EXIT_UNKNOWN
             : rep->error_code == KS_EBUSY ? CLI_EXIT_BUSY
                                           : CLI_EXIT_KSCORE;
        goto out;
    }
    if (req.detach) {
        if (json) {
            json_t *o = json_object();
            json_object_set_new(o, "command_id", json_string(rep->command_id));
            json_object_set_new(o, "agent_id", json_string(rep->agent_id));
            cli_print_json(o);
        } else {
            printf("%s\n", rep->command_id);
        }
        rc = 0;
        goto out;
    }
    Ks__CommandResult *r = rep->result;
    fflush(stdout);
    cli_live_finish(&lv, rep->command_id, r);
    if (cli_live_interrupted(&lv)) {
        /* Ctrl-C: cancelled; say how it ended. */
        cli_err("command %s ended %s", rep->command_id,
                r ? kproto_status_name(r->status) : "(unknown)");
        if (json) {
            json_t *o = cli_result_json(r);
            json_object_set_new(o, "command_id", json_string(rep->command_id));
            json_object_set_new(o, "agent_id", json_string(rep->agent_id));
            cli_print_json(o);
        }
        rc = 130;
        goto out;
    }
    if (json) {
        json_t *o = cli_result_json(r);
        json_object_set_new(o, "command_id", json_string(rep->command_id));
        json_object_set_new(o, "agent_id", json_string(rep->agent_id));
        cli_print_json(o);
    } else if (r) {
        /* The output went out as it came (cli_live_finish). */
        if (r->stdout && r->stdout->truncated)
            cli_err("stdout truncated: %llu of %llu bytes shown",
                    (unsigned long long)(r->stdout->data.len
                                             ? r->stdout->data.len
                                             : r->stdout->chunked_bytes),
                    (unsigned long long)r->stdout->total_bytes);
        if (r->stderr && r->stderr->truncated)
            cli_err("stderr truncated: %llu of %llu bytes shown",
                    (unsigned long long)(r->stderr->data.len
                                             ? r->stderr->data.len
                                             : r->stderr->chunked_bytes),
                    (unsigned long long)r->stderr->total_bytes);
        if (r->status == KS__COMMAND_STATUS__START_FAILED &&
            strcmp(r->start_stage, "secret") == 0)
            cli_err("cannot start %s: %s", sp->argv[0],
                    r->reason[0] ? r->reason
                                 : "a secret variable cannot be opened");
        else if (r->status == KS__COMMAND_STATUS__START_FAILED &&
                 r->reason[0])
            cli_err("cannot start %s: %s (%s: %s)", sp->argv[0], r->reason,
                    r->start_stage, strerror(r->start_errno));
        else if (r->status == KS__COMMAND_STATUS__START_FAILED &&
                 strcmp(r->start_stage, "user") == 0)
            cli_err("cannot start %s as '%s': %s", sp->argv[0], sp->run_as,
                    strerror(r->start_errno));
        else if (r->status == KS__COMMAND_STATUS__START_FAILED &&
                 strcmp(r->start_stage, "chdir") == 0)
            cli_err("cannot start %s: cannot chdir to '%s': %s", sp->argv[0],
                    sp->cwd && sp->cwd[0] ? sp->cwd : "/",
                    strerror(r->start_errno));
        else if (r->status == KS__COMMAND_STATUS__START_FAILED)
            cli_err("cannot start %s: %s failed: %s", sp->argv[0],
                    r->start_stage, strerror(r->start_errno));
        else if (r->timed_out)
            cli_err("timed out after %.3fs (command %s)",
                    (double)sp->timeout_ms / 1000.0, rep->command_id);
        else if (!kproto_status_terminal(r->status) ||
                 r->status >= KS__COMMAND_STATUS__CANCELLED)
            cli_err("command %s ended %s%s%s", rep->command_id,
                    kproto_status_name(r->status), r->reason[0] ? ": " : "",
                    r->reason);
    }
    rc = cli_exit_status(r);
out:
    if (rep)
        ks__execute_reply__free_unpacked(rep, NULL);
    evt_close(c);
    free(agent_from_env);
    cli_secrets_release(&sec);
    cli_payload_release(&pl);
    cli_spec_release(&cs);
    cli_conn_release(&cc);
    return rc;
}

/* ---- get / events / cancel ----------------------------------------------- */

/* Parses "ID [--json] [connection flags]" where ID is a command id or a
 * batch id; returns the id, or NULL after printing why (*rc set). usage:
 * the --help text; its first line is the usage line that errors quote. */
static const char *
parse_id_args(int argc, char **argv, const char *usage, bool *json,
              struct cli_conn *cc, int *rc)
{
    char usage_line[160];
    snprintf(usage_line, sizeof(usage_line), "%.*s",
             (int)strcspn(usage, "\n"), usage);
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       CLI_CONN_LONGOPTS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    int opt;
    optind = 1;
    *rc = CLI_EXIT_USAGE;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            *json = true;
            break;
        case 'h':
            fputs(usage, stdout);
            *rc = 0;
            return NULL;
        default:
            if (cli_conn_opt(cc, opt, optarg))
                break;
            fprintf(stderr, "%s\n", usage_line);
            return NULL;
        }
    }
    if (optind != argc - 1) {
        cli_err("expected one id: %s", usage_line);
        return NULL;
    }
    const char *id = argv[optind];
    if (!ks_is_uuid(id) &&
        !(strncmp(id, "batch-", 6) == 0 && ks_is_uuid(id + 6))) {
        cli_err("'%s' is not a command id (a UUID) nor a batch id "
                "(batch-<uuid>)",
                id);
        return NULL;
    }
    return id;
}

/*
 * The command's environment as requested (its CommandRequested event: the
 * commands projection keeps no env), secret variables redacted. NULL when
 * it cannot be read (an older broker, a read the policy refuses).
 */
static json_t *
requested_env(struct evt_conn *c, const char *command_id,
              Ks__EventsReply **rep_out)
{
    Ks__EventsRequest req = KS__EVENTS_REQUEST__INIT;
    Ks__EventsReply *rep = NULL;
    char stream[64];
    json_t *env = NULL;

    snprintf(stream, sizeof(stream), "command-%s", command_id);
    req.stream_id = stream;
    req.limit = 1;
    if (broker_call(c, EVT_API_EVENTS, &req.base,
                    &ks__events_reply__descriptor, 5000,
                    (ProtobufCMessage **)&rep) != 0)
        return NULL;
    if (!rep->error_code && rep->n_events == 1 && rep->events[0]->event &&
        rep->events[0]->event->command &&
        rep->events[0]->event->command->spec) {
        const Ks__CommandSpec *sp = rep->events[0]->event->command->spec;
        env = json_object();
        for (size_t i = 0; i < sp->n_env; i++)
            json_object_set_new(env, sp->env[i]->name,
                                json_string(sp->env[i]->value));
        for (size_t i = 0; i < sp->n_sealed_env; i++)
            json_object_set_new(env, sp->sealed_env[i]->name,
                                json_string(CLI_SECRET_SHOWN));
        *rep_out = rep; /* its script, stdin, user, files */
        return env;
    }
    ks__events_reply__free_unpacked(rep, NULL);
    return env;
}

static const char get_usage[] =
    "usage: kscore get ID [--json]\n"
    "ID is a command id (a UUID) or a batch id (batch-<uuid>).\n"
    "A command: its state, argv, environment, who asked it, why it ended\n"
    "so, its exit code or signal, duration, output and late reports. A\n"
    "batch: each target's outcome and output, grouped as kscore batch\n"
    "prints them, and the summary.\n"
    "  --json   one object: a command's whole result; a batch with its\n"
    "           targets and exit_code, the code kscore batch exits with\n"
    "           (null while the batch runs)\n"
    "Exit 0 whatever the command or batch did, 125 kscore failed\n"
    "(unreachable, not found, denied), 2 usage.\n"
    CLI_CONN_USAGE;

int
cmd_get(int argc, char **argv)
{
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__GetRequest req = KS__GET_REQUEST__INIT;
    Ks__GetReply *rep = NULL;
    bool json = false;
    int rc;
    const char *id = parse_id_args(argc, argv, get_usage, &json, &cc, &rc);
    if (!id)
        return rc;
    if ((rc = cli_connect(&cc, &c)))
        return rc;
    req.id = (char *)id;
    rc = broker_call(c, EVT_API_GET, &req.base, &ks__get_reply__descriptor,
                     5000, (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        cli_err("get %s: %s", id, rc ? ks_strerror(rc) : rep->error);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    if (rep->batch) {
        /* Each target's outcome and output, grouped as kscore batch
         * prints them (cli/out_fleet.c); --json: the batch with every
         * target's whole result. */
        Ks__BatchReply *bt = rep->batch;
        struct fleet_results fr;
        if (fleet_results_load(&fr, c, bt, NULL, false) != 0) {
            fleet_results_release(&fr);
            cli_err("out of memory");
            rc = CLI_EXIT_KSCORE;
            goto out;
        }
        if (json) {
            json_t *o = cli_batch_json(bt), *tv = json_array();
            for (size_t i = 0; i < fr.n; i++)
                json_array_append_new(
                    tv, fleet_target_json(bt->batch_id, fr.full[i]));
            json_object_set_new(o, "targets", tv);
            cli_print_json(o);
        } else {
            fleet_print(stdout, bt, fr.full, fr.n);
            char budget[128] = "";
            if (bt->has_max_errors)
                snprintf(budget, sizeof(budget),
                         "error budget: stop after more than %u error(s)",
                         bt->max_errors);
            fleet_summary(stdout, bt, budget);
        }
        fleet_results_release(&fr);
        rc = 0;
        goto out;
    }
    const Ks__CommandView *v = rep->command;
    Ks__EventsReply *first = NULL;
    json_t *env = requested_env(c, v->command_id, &first);
    const Ks__CommandSpec *rsp =
        first ? first->events[0]->event->command->spec : NULL;
    if (json) {
        json_t *o = cli_result_json(v->result);
        json_t *argvj = json_array();
        for (size_t i = 0; i < v->n_argv; i++)
            json_array_append_new(argvj, json_string(v->argv[i]));
        json_object_set_new(o, "command_id", json_string(v->command_id));
        json_object_set_new(o, "agent_id", json_string(v->agent_id));
        json_object_set_new(o, "status",
                            json_string(kproto_status_name(v->status)));
        json_object_set_new(o, "argv", argvj);
        if (env)
            json_object_set_new(o, "env", json_incref(env));
        if (rsp)
            cli_payload_json(o, rsp);
        json_object_set_new(o, "attempt", json_integer(v->attempt));
        json_object_set_new(o, "version", json_integer(v->version));
        json_object_set_new(o, "requested_at",
                            json_string(cli_time(v->requested_at_us)));
        json_object_set_new(o, "operator", json_string(v->operator_));
        json_t *late = json_array();
        for (size_t i = 0; i < v->n_late_results; i++)
            json_array_append_new(late, cli_result_json(v->late_results[i]));
        json_object_set_new(o, "late_results", late);
        cli_print_json(o);
    } else {
        const Ks__CommandResult *r = v->result;
        printf("command   %s\nagent     %s\nstatus    %s\nargv     ",
               v->command_id, v->agent_id, kproto_status_name(v->status));
        size_t need = 1;
        for (size_t i = 0; i < v->n_argv; i++)
            need += 4 * strlen(v->argv[i]) + 4; /* cli_shell_join */
        char *a = malloc(need);
        if (a) {
            cli_shell_join(v->argv, v->n_argv, a, need);
            cli_printable(a); /* another operator's, maybe */
        }
        printf(" %s", a ? a : "?");
        free(a);
        if (env && json_object_size(env)) {
            const char *k;
            json_t *val;
            printf("\nenv      ");
            json_object_foreach(env, k, val)
                printf(" %s=%s", k, json_string_value(val));
        }
        printf("\n");
        if (rsp)
            cli_payload_print(stdout, rsp, "");
        printf("requested %s", cli_time(v->requested_at_us));
        if (v->operator_[0])
            printf(" by %s", v->operator_);
        printf("\n");
        if (r && r->reason && r->reason[0] &&
            r->status != KS__COMMAND_STATUS__SUCCEEDED)
            printf("reason    %s\n", r->reason);
        if (r && r->has_exit_code)
            printf("exit code %d\n", r->exit_code);
        if (r && r->signal)
            printf("signal    %d (%s)\n", r->signal, strsignal(r->signal));
        if (r && r->status == KS__COMMAND_STATUS__START_FAILED)
            printf("start     %s failed: %s\n", r->start_stage,
                   strerror(r->start_errno));
        if (r && r->duration_us)
            printf("duration  %.3f ms\n", (double)r->duration_us / 1000.0);
        if (r && r->stdout && r->stdout->data.len) {
            printf("stdout    (%llu bytes%s)\n",
                   (unsigned long long)r->stdout->total_bytes,
                   r->stdout->truncated ? ", truncated" : "");
            fflush(stdout);
            cli_write_all(1, r->stdout->data.data, r->stdout->data.len);
        }
        if (r && r->stderr && r->stderr->data.len) {
            printf("stderr    (%llu bytes%s)\n",
                   (unsigned long long)r->stderr->total_bytes,
                   r->stderr->truncated ? ", truncated" : "");
            fflush(stdout);
            cli_write_all(1, r->stderr->data.data, r->stderr->data.len);
        }
        /* Reports that came after the end: the record keeps its first
         * terminal event, and says what else the agent told it. */
        for (size_t i = 0; i < v->n_late_results; i++) {
            const Ks__CommandResult *l = v->late_results[i];
            printf("late      %s", kproto_status_name(l->status));
            if (l->has_exit_code)
                printf(", exit %d", l->exit_code);
            if (l->signal)
                printf(", signal %d", l->signal);
            if (l->reason && l->reason[0])
                printf(" (%s)", l->reason);
            printf(": reported after the end, kept as a LateResult "
                   "(kscore events %s)\n", v->command_id);
        }
    }
    json_decref(env);
    if (first)
        ks__events_reply__free_unpacked(first, NULL);
    rc = 0;
out:
    if (rep)
        ks__get_reply__free_unpacked(rep, NULL);
    evt_close(c);
    return rc;
}

static int
is_terminal_event(const char *type)
{
    /* The ends of store/machine.c's state machine, and a batch's. */
    static const char *const t[] = {
        "CommandCompleted",     "CommandStartFailed", "CommandCancelled",
        "CommandUndeliverable", "CommandLost",        "CommandNotStarted",
        "CommandRejected",      "BatchCompleted",     "BatchCancelled"};
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        if (strcmp(type, t[i]) == 0)
            return 1;
    return 0;
}

static void
print_event(const Ks__RecordedEvent *e, bool json, bool all)
{
    if (json) {
        cli_print_json(cli_event_json(e));
        return;
    }
    if (all)
        printf("%-44s ", e->event->stream_id);
    printf("%3lld  %-22s %s  %s", (long long)e->version, e->event->type,
           cli_time(e->recorded_at_us), e->event->agent_id);
    if (e->event->result)
        printf("  %s", kproto_status_name(e->event->result->status));
    if (e->event->wave)
        printf("  wave %u", e->event->wave);
    if (e->event->rerun_batch_id[0])
        printf("  %s", e->event->rerun_batch_id);
    if (e->event->reason[0] && strcmp(e->event->type, "CommandRequested") != 0)
        printf("  (%s)", e->event->reason);
    if (e->event->command && e->event->command->spec)
        for (size_t i = 0; i < e->event->command->spec->n_sealed_env; i++)
            printf("  %s=%s", e->event->command->spec->sealed_env[i]->name,
                   CLI_SECRET_SHOWN);
    printf("\n");
    if (e->event->command && e->event->command->spec)
        cli_payload_print(stdout, e->event->command->spec, "     ");
}

static const char events_usage[] =
    "usage: kscore events ID [--follow] [--json]\n"
    "       kscore events --follow [--since T | --from-start] [--json]\n"
    "       kscore events --since T | --from-start [--json]\n"
    "ID is a command id, or a stream id: command-<uuid>, batch-<uuid>,\n"
    "operator-<name> (that operator's refusals, RequestDenied) or\n"
    "agent-<id> (what that agent reported about no command of its own, and\n"
    "its relabels) or pool-<pool> (a pool's relabels).\n"
    "With a policy, an operator reads its own stream, and others' with a\n"
    "\"read\" rule on agents \"*\" (an agent's: a \"read\" rule matching it).\n"
    "  --follow       print events as they are recorded: one stream from its\n"
    "                 first event until its end (a command's or a batch's\n"
    "                 terminal event; an operator's or an agent's stream\n"
    "                 until interrupted); every stream (no ID) from now on,\n"
    "                 until interrupted\n"
    "  --since T      every stream, from the first event recorded at or\n"
    "                 after T: a duration back from now (90s, 1h, `2h ago`)\n"
    "                 or an RFC 3339 time or date (as kscore list)\n"
    "  --from-start   every stream, from the first event ever recorded\n"
    "Without --follow, --since and --from-start print what is recorded up\n"
    "to now and exit.\n"
    "Exit 0; 125 kscore failed (unreachable, denied, no events for a\n"
    "command or batch id); 2 usage.\n"
    CLI_CONN_USAGE;

/* The stream an `events` ID names, into stream (len bytes). 0, or -1
 * after saying why. */
static int
events_stream_of(const char *id, char *stream, size_t len)
{
    bool ok;
    if (ks_is_uuid(id)) {
        snprintf(stream, len, "command-%s", id);
        return 0;
    }
    if (strncmp(id, "command-", 8) == 0)
        ok = ks_is_uuid(id + 8);
    else if (strncmp(id, "batch-", 6) == 0)
        ok = ks_is_uuid(id + 6);
    else if (strncmp(id, "operator-", 9) == 0)
        ok = evt_identity_valid(id + 9);
    else if (strncmp(id, "agent-", 6) == 0)
        ok = evt_agent_id_valid(id + 6);
    else if (strncmp(id, "pool-", 5) == 0)
        ok = evt_agent_id_valid(id + 5);
    else
        ok = false;
    if (!ok || strlen(id) >= len) {
        cli_err("'%s' is not a command id nor a stream id (command-<uuid>, "
                "batch-<uuid>, operator-<name>, agent-<id>, pool-<pool>)",
                id);
        return -1;
    }
    snprintf(stream, len, "%s", id);
    return 0;
}

int
cmd_events(int argc, char **argv)
{
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       {"follow", no_argument, 0, 'f'},
                                       {"since", required_argument, 0, 'S'},
                                       {"from-start", no_argument, 0, 'B'},
                                       CLI_CONN_LONGOPTS,
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__EventsRequest req = KS__EVENTS_REQUEST__INIT;
    char stream[EVT_AGENT_ID_MAX + 16] = "";
    bool json = false, follow = false, from_start = false, done = false;
    const char *id = NULL, *since = NULL;
    int64_t since_us = 0;
    int opt, rc, total = 0;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            json = true;
            break;
        case 'f':
            follow = true;
            break;
        case 'S':
            since = optarg;
            if (cli_parse_time(optarg, ks_now_us(), &since_us) != 0 ||
                since_us <= 0) {
                cli_err("bad --since '%s': a duration back from now (90s, "
                        "1h, `2h ago`) or an RFC 3339 time or date",
                        optarg);
                return CLI_EXIT_USAGE;
            }
            break;
        case 'B':
            from_start = true;
            break;
        case 'h':
            fputs(events_usage, stdout);
            return 0;
        default:
            if (cli_conn_opt(&cc, opt, optarg))
                break;
            fputs(events_usage, stderr);
            return CLI_EXIT_USAGE;
        }
    }
    if (optind < argc)
        id = argv[optind++];
    if (optind != argc) {
        cli_err("expected one id: kscore events ID (see kscore events "
                "--help)");
        return CLI_EXIT_USAGE;
    }
    if (id && (since || from_start)) {
        cli_err("--since and --from-start read every stream: give no ID "
                "(one stream is read from its first event)");
        return CLI_EXIT_USAGE;
    }
    if (since && from_start) {
        cli_err("--since and --from-start are two starts: give one");
        return CLI_EXIT_USAGE;
    }
    if (!id && !follow && !since && !from_start) {
        cli_err("expected an id, --follow, --since T or --from-start (see "
                "kscore events --help)");
        return CLI_EXIT_USAGE;
    }
    if (id && events_stream_of(id, stream, sizeof(stream)) != 0)
        return CLI_EXIT_USAGE;
    if ((rc = cli_connect(&cc, &c)))
        return rc;
    req.stream_id = stream;
    req.wait_ms = follow ? 5000 : 0;
    /* Every stream: from now on unless told otherwise, so that following
     * a long record does not print all of it first. */
    req.start_now = !id && !since && !from_start;
    req.start_at_us = since ? since_us : 0;
    while (!done) {
        Ks__EventsReply *rep = NULL;
        rc = broker_call(c, follow ? EVT_API_FOLLOW : EVT_API_EVENTS,
                         &req.base, &ks__events_reply__descriptor,
                         follow ? 15000 : 5000, (ProtobufCMessage **)&rep);
        if (rc || rep->error_code) {
            cli_err("events %s: %s", id ? id : "(all)",
                    rc ? ks_strerror(rc) : rep->error);
            if (rep)
                ks__events_reply__free_unpacked(rep, NULL);
            evt_close(c);
            return CLI_EXIT_KSCORE;
        }
        for (size_t i = 0; i < rep->n_events; i++) {
            const Ks__RecordedEvent *e = rep->events[i];
            print_event(e, json, !id);
            req.after_version = e->version;
            total++;
            if (id && follow && is_terminal_event(e->event->type))
                done = true;
        }
        if (!id) {
            req.cursor_tx_id = rep->cursor_tx_id;
            req.cursor_pos = rep->cursor_pos;
        }
        if (rep->n_events == 0 && !follow)
            done = true;
        ks__events_reply__free_unpacked(rep, NULL);
        /* The reader went away (a closed pipe): stop following. */
        if (fflush(stdout) != 0 || ferror(stdout)) {
            evt_close(c);
            return total ? 0 : CLI_EXIT_KSCORE;
        }
    }
    evt_close(c);
    /* A command or a batch without events does not exist (or may not be
     * read); an operator's or an agent's stream is empty until something
     * is recorded there, and every stream may be quiet. */
    if (total == 0 && id &&
        (strncmp(stream, "command-", 8) == 0 ||
         strncmp(stream, "batch-", 6) == 0)) {
        cli_err("no events for %s", id);
        return CLI_EXIT_KSCORE;
    }
    if (total == 0 && id)
        cli_err("no events recorded on %s", stream);
    return 0;
}

int
cmd_cancel(int argc, char **argv)
{
    struct cli_conn cc = {0};
    struct evt_conn *c = NULL;
    Ks__CancelRequest req = KS__CANCEL_REQUEST__INIT;
    Ks__CancelReply *rep = NULL;
    bool json = false;
    int rc;
    const char *id = parse_id_args(
        argc, argv,
        "usage: kscore cancel ID [--json]   (a command id, or batch-<uuid>)\n"
        "Before an agent claims it, a command ends Cancelled; a running one\n"
        "gets TERM, grace, KILL on its agent; a batch starts no more\n"
        "targets and cancels its running ones.\n"
        "  --json   one object: id, outcome (cancelled, requested, ended),\n"
        "           status\n"
        "Exit: 0 cancelled or cancel requested, 1 it had already ended "
        "(nothing done),\n125 kscore failed (unreachable, not found, "
        "denied), 2 usage.\n" CLI_CONN_USAGE,
        &json, &cc, &rc);
    if (!id)
        return rc;
    if ((rc = cli_connect(&cc, &c)))
        return rc;
    req.id = (char *)id;
    rc = broker_call(c, EVT_API_CANCEL, &req.base,
                     &ks__cancel_reply__descriptor, 5000,
                     (ProtobufCMessage **)&rep);
    if (rc || rep->error_code) {
        cli_err("cancel %s: %s", id, rc ? ks_strerror(rc) : rep->error);
        rc = CLI_EXIT_KSCORE;
        goto out;
    }
    const char *outcome = rep->outcome[0] ? rep->outcome : "requested";
    bool ended = strcmp(outcome, "ended") == 0;
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "id", json_string(id));
        json_object_set_new(o, "outcome", json_string(outcome));
        if (rep->batch_status)
            json_object_set_new(
                o, "status", json_string(fleet_status_name(rep->batch_status)));
        else if (rep->status)
            json_object_set_new(o, "status",
                                json_string(kproto_status_name(rep->status)));
        cli_print_json(o);
    } else if (ended) {
        printf("%s already ended: %s (nothing to cancel)\n", id,
               rep->batch_status ? fleet_status_name(rep->batch_status)
                                 : kproto_status_name(rep->status));
    } else if (strcmp(outcome, "cancelled") == 0) {
        printf("%s cancelled before it started\n", id);
    } else {
        printf("%s: cancel requested (TERM, grace, KILL on its agent); "
               "follow it with kscore get %s\n",
               id, id);
    }
    rc = ended ? 1 : 0;
out:
    if (rep)
        ks__cancel_reply__free_unpacked(rep, NULL);
    evt_close(c);
    return rc;
}
