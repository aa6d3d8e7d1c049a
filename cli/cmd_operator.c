/* kscore operator add|list|remove: the operators of the local stack, in
 * its identity registry (cli/stack.h), and the reload of its nats-server. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_int.h"
#include "stack.h"

static const char usage[] =
    "usage: kscore operator add NAME [--json]\n"
    "       kscore operator list [--all] [--json]\n"
    "       kscore operator remove NAME\n"
    "The operators of the local stack in $KSCORE_HOME (now %s).\n"
    "add writes NAME's NKey seed file (0600; whoever holds it is NAME to\n"
    "NATS: give it to NAME, who uses it with --nkey FILE or\n"
    "KSCORE_NATS_NKEY) and lets NAME in; remove shuts NAME out, and closes\n"
    "NAME's open connections. A running nats-server reloads its users\n"
    "without a restart. NAME: letters, digits, _ and -, not \"broker\",\n"
    "not starting with \"agent-\".\n";

int
cli_nats_users_apply(const char *home)
{
    int rc = stack_nats_auth_write(home, home);
    if (rc) {
        cli_err("cannot write %s/" STACK_NATS_AUTH_FILE ": %s", home,
                ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    rc = stack_nats_reload(home, 10000);
    if (rc && rc != KS_ENOTFOUND) {
        cli_err("nats-server did not reload its users: %s (see %s/nats.log)",
                rc == KS_EINVAL ? "it refused the new config" : ks_strerror(rc),
                home);
        return CLI_EXIT_KSCORE;
    }
    /* A cluster (kscore up --cluster N): each node has its own copy of the
     * users (stack_cluster_start), and each one that runs reloads it. */
    for (int i = 1; i <= STACK_CLUSTER_MAX; i++) {
        char dir[4200], conf[4300];
        snprintf(dir, sizeof(dir), "%s/nats-%d", home, i);
        snprintf(conf, sizeof(conf), "%s/nats.conf", dir);
        if (access(conf, F_OK) != 0)
            continue;
        if ((rc = stack_nats_auth_write(dir, home))) {
            cli_err("cannot write %s/" STACK_NATS_AUTH_FILE ": %s", dir,
                    ks_strerror(rc));
            return CLI_EXIT_KSCORE;
        }
        rc = stack_nats_reload(dir, 10000);
        if (rc && rc != KS_ENOTFOUND) {
            cli_err("nats-server nats-%d did not reload its users: %s (see "
                    "%s/nats.log)",
                    i,
                    rc == KS_EINVAL ? "it refused the new config"
                                    : ks_strerror(rc),
                    dir);
            return CLI_EXIT_KSCORE;
        }
    }
    return 0; /* not running: `kscore up` starts with these users */
}

static int
op_add(const char *home, const char *name, bool json)
{
    struct stack_identity id;
    char seed[4200];
    int rc;

    if (stack_operator_name_check(name)) {
        cli_err("bad operator name '%s': letters, digits, _ and - (at most "
                "%d), not \"broker\", not starting with \"agent-\"",
                name, EVT_IDENTITY_MAX);
        return CLI_EXIT_USAGE;
    }
    if ((rc = stack_mkdirs(home, 0700)) ||
        (rc = stack_ident_add(home, STACK_OPERATOR, name, &id))) {
        if (rc == -EEXIST)
            cli_err("operator %s already exists (kscore operator remove %s "
                    "first to give it a new key)",
                    name, name);
        else
            cli_err("cannot add operator %s: %s", name, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if ((rc = cli_nats_users_apply(home)))
        return rc;
    stack_ident_seed_path(home, STACK_OPERATOR, name, seed, sizeof(seed));
    /* A stack with a CA (`up --listen`) may require client certificates
     * (--mtls): without one of its own, NAME could not connect from
     * another host. Next to the seed, as operators/NAME.pem and .key. */
    struct stack_tls_paths tp;
    char cert[4300] = "", key[4300] = "";
    stack_tls_paths(home, &tp);
    if (access(tp.ca_cert, R_OK) == 0) {
        snprintf(cert, sizeof(cert), "%s/operators/%s.pem", home, name);
        snprintf(key, sizeof(key), "%s/operators/%s.key", home, name);
        if ((rc = stack_tls_client_write(home, name, cert, key))) {
            cli_err("operator %s added, but its client certificate could not "
                    "be made: %s",
                    name, ks_strerror(rc));
            return CLI_EXIT_KSCORE;
        }
    }
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(name));
        json_object_set_new(o, "seed_file", json_string(seed));
        json_object_set_new(o, "public_key", json_string(id.nkey));
        if (cert[0]) {
            json_object_set_new(o, "tls_ca", json_string(tp.ca_cert));
            json_object_set_new(o, "tls_cert", json_string(cert));
            json_object_set_new(o, "tls_key", json_string(key));
        }
        cli_print_json(o);
        return 0;
    }
    printf("%s\n", seed);
    if (cert[0])
        fprintf(stderr,
                "kscore: the stack's NATS is TLS: give %s also %s (--tls-ca) "
                "and, for mutual TLS, %s and %s (--tls-cert, --tls-key).\n",
                name, tp.ca_cert, cert, key);
    fprintf(stderr,
            "kscore: operator %s added (public key %s). Its seed is %s: hand "
            "it to %s, who uses it with --nkey or KSCORE_NATS_NKEY; whoever "
            "holds it is %s.\n",
            name, id.nkey, seed, name, name);
    return 0;
}

static int
op_remove(const char *home, const char *name)
{
    struct stack_identity id;
    int rc = stack_ident_get(home, name, &id);

    if (rc == 0 && id.kind != STACK_OPERATOR) {
        cli_err("%s is the stack's %s, not an operator", name,
                stack_kind_name(id.kind));
        return CLI_EXIT_KSCORE;
    }
    if (rc == 0)
        rc = stack_ident_remove(home, name);
    if (rc) {
        cli_err("cannot remove operator %s: %s", name,
                rc == KS_ENOTFOUND ? "no such operator" : ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    if ((rc = cli_nats_users_apply(home)))
        return rc;
    {
        char path[4300];
        snprintf(path, sizeof(path), "%s/operators/%s.pem", home, name);
        unlink(path);
        snprintf(path, sizeof(path), "%s/operators/%s.key", home, name);
        unlink(path);
    }
    fprintf(stderr, "kscore: operator %s removed: it can no longer connect\n",
            name);
    return 0;
}

static int
op_list(const char *home, bool all, bool json)
{
    struct stack_identity *ids = NULL;
    size_t n = 0;
    bool header = false;
    int rc = stack_ident_list(home, &ids, &n);

    if (rc) {
        cli_err("cannot read %s/identities: %s", home, ks_strerror(rc));
        return CLI_EXIT_KSCORE;
    }
    for (size_t i = 0; i < n; i++) {
        char seed[4200];
        if (!all && ids[i].kind != STACK_OPERATOR)
            continue;
        stack_ident_seed_path(home, ids[i].kind, ids[i].name, seed,
                              sizeof(seed));
        /* The seed file only when it is still here (it may have been
         * handed over and deleted). */
        bool here = access(seed, F_OK) == 0;
        if (json) {
            /* One object a line, as every other list (list, agents). */
            json_t *o = json_object();
            json_object_set_new(o, "name", json_string(ids[i].name));
            json_object_set_new(o, "kind",
                                json_string(stack_kind_name(ids[i].kind)));
            json_object_set_new(o, "nkey", json_string(ids[i].nkey));
            json_object_set_new(o, "seed_file",
                                here ? json_string(seed) : json_null());
            cli_print_json(o);
        } else {
            if (!header)
                printf("%-24s %-8s %-56s %s\n", "NAME", "KIND", "NKEY",
                       "SEED FILE");
            header = true;
            printf("%-24s %-8s %s %s\n", ids[i].name,
                   stack_kind_name(ids[i].kind), ids[i].nkey,
                   here ? seed : "-");
        }
    }
    free(ids);
    return 0;
}

int
cmd_operator(int argc, char **argv)
{
    static const struct option lo[] = {{"json", no_argument, 0, 'j'},
                                       {"all", no_argument, 0, 'a'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    const char *home = cli_home();
    bool json = false, all = false;
    int opt;

    optind = 1;
    while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (opt) {
        case 'j':
            json = true;
            break;
        case 'a':
            all = true;
            break;
        case 'h':
            printf(usage, home);
            return 0;
        default:
            return CLI_EXIT_USAGE;
        }
    }
    const char *verb = optind < argc ? argv[optind] : NULL;
    int rest = argc - optind - 1;
    if (verb && strcmp(verb, "list") == 0 && rest == 0)
        return op_list(home, all, json);
    if (verb && strcmp(verb, "add") == 0 && rest == 1 && !all)
        return op_add(home, argv[optind + 1], json);
    if (verb && strcmp(verb, "remove") == 0 && rest == 1 && !json && !all)
        return op_remove(home, argv[optind + 1]);
    fprintf(stderr, usage, home);
    return CLI_EXIT_USAGE;
}
