/*
 * secret.c: secret environment variables on the agent's side. The CLI
 * seals each value to this agent's X25519 key (events/seal.c); the broker
 * records, signs and publishes the ciphertext; this file holds the key and
 * opens the values just before the spawn, so a value exists in plaintext
 * only in the operator's CLI, in this process while it spawns, and in the
 * child's environment.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"

#define SEAL_KEY_FILE "seal.key"

struct agent_secrets {
    size_t n;
    char *values[]; /* n opened values */
};

int
agent__secret_init(struct agent *a, char **errmsg)
{
    int rc;

    if (a->state_dir) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/%s", a->state_dir, SEAL_KEY_FILE);
        rc = evt_seal_key_open(path, &a->seal_key, errmsg);
    } else {
        rc = evt_seal_key_new(&a->seal_key);
        if (rc && errmsg &&
            asprintf(errmsg, "cannot make a seal key: %s", ks_strerror(rc)) < 0)
            *errmsg = NULL;
    }
    if (rc == 0)
        evt_seal_key_public(a->seal_key, a->seal_pub);
    return rc;
}

void
agent__secret_release(struct agent *a)
{
    evt_seal_key_free(a->seal_key);
    a->seal_key = NULL;
}

void
agent__secrets_free(struct agent_secrets *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++)
        evt_seal_wipe_free(s->values[i], strlen(s->values[i]));
    free(s);
}

int
agent__secrets_open(struct agent *a, const char *agent_id,
                    const Ks__Command *cmd, struct exec_env *env,
                    size_t *env_len, struct agent_secrets **out, char *why,
                    size_t why_len)
{
    const Ks__CommandSpec *sp = cmd->spec;
    struct agent_secrets *s;
    size_t first = *env_len;
    int rc = 0;

    *out = NULL;
    if (!sp || sp->n_sealed_env == 0)
        return 0;
    s = calloc(1, sizeof(*s) + sp->n_sealed_env * sizeof(s->values[0]));
    if (!s)
        return -ENOMEM;
    for (size_t i = 0; i < sp->n_sealed_env; i++) {
        const Ks__SealedEnv *e = sp->sealed_env[i];
        char *v = NULL;
        /* The broker gives each command its own agent's values only;
         * anything else is not for us, and running without it is not
         * what the operator asked for. */
        if (strcmp(e->agent_id, agent_id) != 0) {
            snprintf(why, why_len,
                     "secret variable %.64s is sealed to agent %.64s, not "
                     "to this agent",
                     e->name, e->agent_id);
            rc = -EBADMSG;
            break;
        }
        rc = evt_unseal_env(a->seal_key, agent_id, cmd->operator_, e->name,
                            e->sealed.data, e->sealed.len, &v);
        if (rc) {
            snprintf(why, why_len,
                     "secret variable %.64s cannot be opened: it was not "
                     "sealed to this agent's key for this operator (the "
                     "agent's key changed, e.g. a restart without "
                     "--state-dir), or it was altered",
                     e->name);
            rc = rc == -ENOMEM ? rc : -EBADMSG;
            break;
        }
        s->values[s->n++] = v;
        env[*env_len].name = e->name;
        env[*env_len].value = v;
        (*env_len)++;
    }
    if (rc) {
        *env_len = first;
        agent__secrets_free(s);
        return rc;
    }
    *out = s;
    return 0;
}
