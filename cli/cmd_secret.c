/*
 * --secret-env NAME (kscore exec, kscore batch): the value of NAME in the
 * operator's own environment, sealed here to each target agent's X25519
 * key (events/seal.c), so the broker, the record (PostgreSQL), JetStream
 * and every log only ever hold ciphertext. Only the agent the value is
 * sealed to can open it, and only in a command of this operator under
 * this name (evt_seal_env).
 *
 * Targets: exec and batch --agents name them; for --select and --all the
 * broker resolves the targets after this, so the value is sealed to every
 * agent the broker lists that matches (online or not), and the broker
 * refuses the batch if it resolves a target that has no value (an agent
 * that joined in between), and leaves out the values of agents that are
 * not targets. The public keys come from `kscore agents` (AgentInfo.
 * seal_key), which the broker reads from the registry each agent alone
 * may write.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_int.h"

int
cli_secret_opt(struct cli_secrets *s, const char *name)
{
    const char *v;

    if (!broker_env_name_ok(name)) {
        cli_err("bad --secret-env '%s': a variable name (letters, digits "
                "and _, not starting with a digit, not KSCORE_*)",
                name);
        return -1;
    }
    for (size_t i = 0; i < s->n_names; i++)
        if (strcmp(s->names[i], name) == 0) {
            cli_err("--secret-env %s given twice", name);
            return -1;
        }
    if (!(v = getenv(name))) {
        cli_err("--secret-env %s: %s is not set in your environment", name,
                name);
        return -1;
    }
    if (strlen(v) > EVT_SEAL_ENV_VALUE_MAX) {
        cli_err("--secret-env %s: the value is %zu bytes, at most %d", name,
                strlen(v), EVT_SEAL_ENV_VALUE_MAX);
        return -1;
    }
    if (s->n_names == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 8;
        const char **p = realloc(s->names, nc * sizeof(*p));
        if (!p) {
            cli_err("out of memory");
            return -1;
        }
        s->names = p;
        s->cap = nc;
    }
    s->names[s->n_names++] = name;
    return 1;
}

int
cli_secrets_check(const struct cli_secrets *s, const Ks__CommandSpec *spec)
{
    for (size_t i = 0; i < s->n_names; i++)
        for (size_t k = 0; k < spec->n_env; k++)
            if (strcmp(spec->env[k]->name, s->names[i]) == 0) {
                cli_err("%s is given with both --env and --secret-env",
                        s->names[i]);
                return -1;
            }
    return 0;
}

void
cli_secrets_release(struct cli_secrets *s)
{
    for (size_t i = 0; i < s->n_items; i++) {
        free(s->items[i].agent_id);
        free(s->items[i].sealed.data);
    }
    free(s->items);
    free(s->ptrs);
    free(s->names);
    memset(s, 0, sizeof(*s));
}

static int
cmp_cstr(const void *x, const void *y)
{
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

static int
cmp_agent(const void *x, const void *y)
{
    return strcmp((*(const Ks__AgentInfo *const *)x)->agent_id,
                  (*(const Ks__AgentInfo *const *)y)->agent_id);
}

static const Ks__AgentStatus *
find_agent(const Ks__AgentsReply *rep, const char *id)
{
    for (size_t i = 0; i < rep->n_agents; i++)
        if (rep->agents[i]->info &&
            strcmp(rep->agents[i]->info->agent_id, id) == 0)
            return rep->agents[i];
    return NULL;
}

/* Seals every name to one agent into s->items (sorted names). */
static int
seal_to(struct cli_secrets *s, const Ks__AgentInfo *in, const char *op,
        const char **names)
{
    for (size_t k = 0; k < s->n_names; k++) {
        Ks__SealedEnv *e = &s->items[s->n_items];
        uint8_t *box = NULL;
        size_t len = 0;
        int rc = evt_seal_env(in->seal_key.data, in->agent_id, op, names[k],
                              getenv(names[k]), &box, &len);
        if (rc) {
            cli_err("--secret-env %s: cannot seal to agent %s: %s", names[k],
                    in->agent_id, ks_strerror(rc));
            return -1;
        }
        ks__sealed_env__init(e);
        e->name = (char *)names[k];
        e->agent_id = strdup(in->agent_id);
        e->sealed.data = box;
        e->sealed.len = len;
        s->ptrs[s->n_items++] = e;
        if (!e->agent_id) {
            cli_err("out of memory");
            return -1;
        }
    }
    return 0;
}

int
cli_secrets_seal(struct cli_secrets *s, struct evt_conn *c, char *const *agents,
                 size_t n_agents, char *const *terms, size_t n_terms,
                 bool all, Ks__CommandSpec *spec)
{
    Ks__AgentsRequest req = KS__AGENTS_REQUEST__INIT;
    Ks__AgentsReply *rep = NULL;
    const Ks__AgentInfo **targets = NULL;
    const char **names = NULL;
    size_t nt = 0;
    int rc = -1;

    if (s->n_names == 0)
        return 0;
    int crc =
        broker_call(c, EVT_API_AGENTS, &req.base, &ks__agents_reply__descriptor,
                    5000, (ProtobufCMessage **)&rep);
    if (crc || rep->error_code) {
        cli_err("--secret-env: cannot list the agents' keys: %s",
                crc ? ks_strerror(crc) : rep->error);
        goto out;
    }
    targets = calloc(n_agents + rep->n_agents + 1, sizeof(*targets));
    names = calloc(s->n_names, sizeof(*names));
    if (!targets || !names) {
        cli_err("out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_agents; i++) {
        const Ks__AgentStatus *st = find_agent(rep, agents[i]);
        if (!st) {
            cli_err("unknown agent '%s': no agent with this id has "
                    "registered (see kscore agents)",
                    agents[i]);
            goto out;
        }
        if (st->info->seal_key.len != EVT_SEAL_KEY_BYTES) {
            cli_err("agent '%s' publishes no seal key, so it cannot open "
                    "--secret-env values (a kscore agent older than "
                    "--secret-env?)",
                    agents[i]);
            goto out;
        }
        targets[nt++] = st->info;
    }
    if (n_agents == 0 && (all || n_terms)) {
        for (size_t i = 0; i < rep->n_agents; i++) {
            const Ks__AgentStatus *st = rep->agents[i];
            if (!st->info || !broker_select_match(st->info, terms, n_terms))
                continue;
            if (st->info->seal_key.len != EVT_SEAL_KEY_BYTES) {
                /* The broker would pick an online one: say why now. */
                if (st->online) {
                    cli_err("agent '%s' matches but publishes no seal key, "
                            "so it cannot open --secret-env values",
                            st->info->agent_id);
                    goto out;
                }
                continue;
            }
            targets[nt++] = st->info;
        }
    }
    /* One run per agent, sorted by agent id then name: the broker's rule
     * (broker/validate.c), so it finds each target's values at once. */
    qsort(targets, nt, sizeof(*targets), cmp_agent);
    size_t u = 0;
    for (size_t i = 0; i < nt; i++)
        if (u == 0 ||
            strcmp(targets[u - 1]->agent_id, targets[i]->agent_id) != 0)
            targets[u++] = targets[i];
    nt = u;
    memcpy(names, s->names, s->n_names * sizeof(*names));
    qsort(names, s->n_names, sizeof(*names), cmp_cstr);
    s->items = calloc(nt * s->n_names + 1, sizeof(*s->items));
    s->ptrs = calloc(nt * s->n_names + 1, sizeof(*s->ptrs));
    if (!s->items || !s->ptrs) {
        cli_err("out of memory");
        goto out;
    }
    for (size_t i = 0; i < nt; i++)
        if (seal_to(s, targets[i], c->identity, names))
            goto out;
    spec->sealed_env = s->ptrs;
    spec->n_sealed_env = s->n_items;
    rc = 0;
out:
    free(targets);
    free(names);
    if (rep)
        ks__agents_reply__free_unpacked(rep, NULL);
    return rc;
}
