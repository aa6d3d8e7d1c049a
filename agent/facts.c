/*
 * facts.c: what an agent says of its host (AgentInfo.facts: fact.os,
 * fact.kernel, fact.arch, fact.cpus, fact.mem_mb), and the inventory a
 * command's child gets in its environment: its agent's labels as the
 * broker signed them into the command (Command.labels) as
 * KSCORE_LABEL_<KEY>, and the facts as KSCORE_FACT_<KEY>.
 *
 * Facts are the agent's own word: the broker takes them as they come
 * (selectable with --select fact.KEY=...), and nothing that grants
 * anything (labels, the policy) ever reads them.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "agent_int.h"

/* A value of os-release(5): the text after '=', its quotes and
 * backslash escapes undone (shell syntax, as the file's spec says),
 * into out. */
static void
os_release_value(const char *v, char *out, size_t len)
{
    size_t n = 0;
    char q = (*v == '"' || *v == '\'') ? *v++ : 0;
    for (; *v && *v != '\n' && n + 1 < len; v++) {
        if (q && *v == q)
            break;
        if (q == '"' && *v == '\\' && v[1])
            v++;
        out[n++] = *v;
    }
    out[n] = '\0';
}

/* "ID-VERSION_ID" of os-release(5) (/etc/os-release, else
 * /usr/lib/os-release): "debian-12", "ubuntu-24.04", or ID alone (a
 * rolling release has no VERSION_ID). "" when neither file says. */
static void
read_os(char *out, size_t len)
{
    static const char *const paths[] = {"/etc/os-release",
                                        "/usr/lib/os-release"};
    char line[512], id[64] = "", ver[64] = "";
    FILE *f = NULL;

    for (size_t i = 0; i < 2 && !f; i++)
        f = fopen(paths[i], "re");
    out[0] = '\0';
    if (!f)
        return;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "ID=", 3) == 0)
            os_release_value(line + 3, id, sizeof(id));
        else if (strncmp(line, "VERSION_ID=", 11) == 0)
            os_release_value(line + 11, ver, sizeof(ver));
    }
    fclose(f);
    if (id[0])
        snprintf(out, len, "%s%s%s", id, ver[0] ? "-" : "", ver);
}

static void
fact_add(struct agent_facts *f, const char *name, const char *value)
{
    if (!value[0] || f->n == AGENT_N_FACTS)
        return;
    ks__env_var__init(&f->v[f->n]);
    f->v[f->n].name = (char *)name;
    f->v[f->n].value = (char *)value;
    f->p[f->n] = &f->v[f->n];
    f->n++;
}

void
agent__facts_read(struct agent_facts *f)
{
    struct utsname u;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);

    memset(f, 0, sizeof(*f));
    read_os(f->os, sizeof(f->os));
    if (uname(&u) == 0) {
        snprintf(f->kernel, sizeof(f->kernel), "%s", u.release);
        snprintf(f->arch, sizeof(f->arch), "%s", u.machine);
    }
    if (cpus > 0)
        snprintf(f->cpus, sizeof(f->cpus), "%ld", cpus);
    if (pages > 0 && page > 0)
        snprintf(f->mem_mb, sizeof(f->mem_mb), "%lld",
                 (long long)pages * page / (1024 * 1024));
    /* Sorted by name, as labels are. */
    fact_add(f, "arch", f->arch);
    fact_add(f, "cpus", f->cpus);
    fact_add(f, "kernel", f->kernel);
    fact_add(f, "mem_mb", f->mem_mb);
    fact_add(f, "os", f->os);
}

void
agent_inventory_name(const char *prefix, const char *key, char *out,
                     size_t len)
{
    size_t n = (size_t)snprintf(out, len, "%s", prefix);
    for (; *key && n + 1 < len; key++, n++) {
        char c = *key;
        out[n] = (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ? c
                 : c >= 'a' && c <= 'z'                           ? (char)(c - 'a' + 'A')
                                                                  : '_';
    }
    out[n < len ? n : len - 1] = '\0';
}

/* Whether name is among the first n of env (a key mapped to one name
 * twice: the first, in key order, stands). */
static bool
env_has(const struct exec_env *env, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(env[i].name, name) == 0)
            return true;
    return false;
}

int
agent__inventory_env(const struct agent *a, const Ks__Command *cmd,
                     struct exec_env *env, size_t *env_len, char **names_out)
{
    size_t n_labels = cmd->n_labels, n = n_labels + a->facts.n;
    /* One block of names: "KSCORE_LABEL_" + key, each at most this (a
     * longer key is cut). */
    size_t each = AGENT_INVENTORY_NAME_MAX;
    char *names = calloc(n ? n : 1, each);
    size_t first = *env_len;

    *names_out = NULL;
    if (!names)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const Ks__EnvVar *kv =
            i < n_labels ? cmd->labels[i] : a->facts.p[i - n_labels];
        char *name = names + i * each;
        if (!kv->name || !kv->name[0] || !kv->value)
            continue;
        agent_inventory_name(i < n_labels ? "KSCORE_LABEL_" : "KSCORE_FACT_",
                             kv->name, name, each);
        if (env_has(env + first, *env_len - first, name))
            continue;
        env[*env_len].name = name;
        env[*env_len].value = kv->value;
        (*env_len)++;
    }
    *names_out = names;
    return 0;
}
