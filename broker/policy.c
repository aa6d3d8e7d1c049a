/*
 * The operator policy: which operators may run commands on which agents,
 * and optionally which executables. Default deny once a policy is loaded;
 * no policy file: every authenticated operator may do everything (the NATS
 * permissions already confine who is an operator).
 *
 * File (JSON):
 *   {"operators": {
 *      "alice": [{"agents": {"env": "dev"}, "executables": ["uptime"]}],
 *      "root":  [{"agents": "*"}]}}
 * A request is allowed when any rule of its operator matches: "agents" is
 * "*" or label pairs the agent must all have; "executables", when given,
 * must hold argv[0] exactly, and then the command may set only the
 * environment variables the rule lists in "env" (default none); "can" (default ["run", "read"]) says what the
 * rule grants: "run" (exec, batch, cancel on those agents) and "read"
 * (get, events, logs and history of commands on those agents).
 *   {"auditor": [{"agents": "*", "can": ["read"]}]}
 * An operator always reads what it ran itself. Reading every stream at
 * once (events --follow without an id) takes a "read" rule with agents
 * "*". "label" (never granted unless listed) lets the operator change
 * the signed labels of the agents the rule matches (kscore agent label),
 * if the rule matches them after the change too:
 *   {"ops": [{"agents": {"env": "dev"}, "can": ["label"]}]}
 * Rules match labels only: a key "fact.*" (an agent's own word about its
 * host) is refused when the policy loads.
 *
 * Users (kscore exec --run-as USER[:GROUP]): every run is a run as a user,
 * the --run-as value or "root" without one (the agent's own user, root
 * for the packaged service). "run_as" lists the users a rule grants, as
 * fnmatch(3) globs matched against "USER" or "USER:GROUP" ("deploy",
 * "deploy:*", "*"); a rule without "run_as" grants "root" only, so a
 * policy written before --run-as grants what it granted. As sudoers
 * (alice ALL=(deploy) ALL) and SSM's run-as: a rule that lists users
 * grants exactly those; "root" must be listed to keep running as root.
 *   {"alice": [{"agents": {"role": "web"}, "run_as": ["deploy"]}]}
 * A script (--script) is any code its interpreter runs: only a rule
 * without "executables" grants it. A copy (kscore copy) writes files as
 * the agent's user: it takes a rule without "executables" that grants
 * "root".
 */
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker_int.h"

struct broker__policy {
    json_t *operators; /* object: name -> array of rules */
};

/* What a copy takes, in a denial's words. */
#define COPY_RULE                                                              \
    "a copy writes as root: it takes a \"run\" rule without "                  \
    "\"executables\" that grants root"


int
broker_policy_read(const char *path, char **buf_out, size_t *len_out,
                   char **errmsg)
{
    struct stat st;
    char *buf = NULL;
    size_t len = 0;
    int rc = 0;
    bool said = false;
    /* O_NONBLOCK: a FIFO in its place must not hang the start. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);

    if (fd == -1) {
        rc = -errno;
        goto out;
    }
    if (fstat(fd, &st) == -1) {
        rc = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = KS_EINVAL;
        said = errmsg && asprintf(errmsg, "policy %s: not a regular file",
                                  path) >= 0;
        goto out;
    }
    if (st.st_size > BROKER_POLICY_MAX_BYTES) {
        rc = KS_ETOOBIG;
        goto out;
    }
    if (!(buf = malloc((size_t)st.st_size + 1))) {
        rc = -ENOMEM;
        goto out;
    }
    /* The size fstat saw; a file that grows meanwhile is cut there, and
     * the digest is of the bytes read, so it still names what loaded. */
    while (len < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + len, (size_t)st.st_size - len);
        if (r == -1 && errno == EINTR)
            continue;
        if (r == -1) {
            rc = -errno;
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    buf[len] = '\0';
out:
    if (fd != -1)
        close(fd);
    if (rc) {
        free(buf);
        if (errmsg && !said &&
            asprintf(errmsg, "policy %s: %s", path, ks_strerror(rc)) < 0)
            *errmsg = NULL;
        return rc;
    }
    *buf_out = buf;
    *len_out = len;
    return 0;
}

int
broker_policy_digest(const char *buf, size_t len,
                     char hex[BROKER_POLICY_DIGEST_HEX])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;

    if (EVP_Digest(buf, len, md, &n, EVP_sha256(), NULL) != 1 || n != 32)
        return KS_EINTERNAL;
    for (unsigned int i = 0; i < n; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return 0;
}

/* The policy in buf (len bytes; name says where it came from in errors). */
static int
policy_parse(const char *path, const char *buf, size_t len,
             struct broker__policy **out, char **errmsg)
{
    json_error_t jerr;
    json_t *root = json_loadb(buf, len, 0, &jerr), *ops, *rules;
    const char *name;
    char why[300] = "";

    if (!root) {
        snprintf(why, sizeof(why), "%s:%d: %s", path, jerr.line, jerr.text);
        goto bad;
    }
    if (!json_is_object(root)) {
        snprintf(why, sizeof(why), "%s: not a JSON object", path);
        goto bad;
    }
    ops = json_object_get(root, "operators");
    if (!json_is_object(ops)) {
        snprintf(why, sizeof(why), "%s: no \"operators\" object", path);
        goto bad;
    }
    json_object_foreach(ops, name, rules)
    {
        size_t i;
        json_t *rule;
        if (!json_is_array(rules)) {
            snprintf(why, sizeof(why),
                     "%s: operator \"%s\": expected a list of rules", path,
                     name);
            goto bad;
        }
        json_array_foreach(rules, i, rule)
        {
            json_t *ag = json_object_get(rule, "agents");
            json_t *ex = json_object_get(rule, "executables");
            json_t *can = json_object_get(rule, "can");
            json_t *envl = json_object_get(rule, "env");
            json_t *ras = json_object_get(rule, "run_as"), *ra;
            size_t ri;
            bool ras_ok = !ras || json_is_array(ras);
            if (ras && json_is_array(ras))
                json_array_foreach(ras, ri, ra)
                {
                    if (!json_is_string(ra) || !json_string_value(ra)[0])
                        ras_ok = false;
                }
            if (!ras_ok) {
                snprintf(why, sizeof(why),
                         "%s: operator \"%s\" rule %zu: \"run_as\" is a list "
                         "of user names or globs (\"deploy\", \"deploy:*\", "
                         "\"*\")",
                         path, name, i + 1);
                goto bad;
            }
            if (envl && !json_is_array(envl)) {
                snprintf(why, sizeof(why),
                         "%s: operator \"%s\" rule %zu: \"env\" is a list "
                         "of variable names",
                         path, name, i + 1);
                goto bad;
            }
            size_t k;
            json_t *c;
            bool can_ok = !can || json_is_array(can);
            if (can && json_is_array(can))
                json_array_foreach(can, k, c)
                {
                    if (!json_is_string(c) ||
                        (strcmp(json_string_value(c), "run") != 0 &&
                         strcmp(json_string_value(c), "read") != 0 &&
                         strcmp(json_string_value(c), "label") != 0))
                        can_ok = false;
                }
            if (!can_ok) {
                snprintf(why, sizeof(why),
                         "%s: operator \"%s\" rule %zu: \"can\" is a list "
                         "of \"run\", \"read\" and \"label\"",
                         path, name, i + 1);
                goto bad;
            }
            /* A fact is what an agent says of itself: it grants nothing
             * (a rule on one would be a rule any agent can meet). */
            const char *lk;
            json_t *lv;
            if (json_is_object(ag))
                json_object_foreach(ag, lk, lv)
                {
                    if (strncmp(lk, BROKER_FACT_PREFIX,
                                strlen(BROKER_FACT_PREFIX)) == 0) {
                        snprintf(why, sizeof(why),
                                 "%s: operator \"%s\" rule %zu: \"%s\" is "
                                 "a fact, the agent's own word: a rule "
                                 "matches signed labels only",
                                 path, name, i + 1, lk);
                        goto bad;
                    }
                }
            if (!json_is_object(rule) ||
                !(json_is_object(ag) ||
                  (json_is_string(ag) &&
                   strcmp(json_string_value(ag), "*") == 0)) ||
                (ex && !json_is_array(ex))) {
                snprintf(why, sizeof(why),
                         "%s: operator \"%s\" rule %zu: expected "
                         "{\"agents\": \"*\" or {labels}, \"executables\": "
                         "[...]}",
                         path, name, i + 1);
                goto bad;
            }
        }
    }
    struct broker__policy *p = calloc(1, sizeof(*p));
    if (!p) {
        json_decref(root);
        return -ENOMEM;
    }
    p->operators = json_incref(ops);
    json_decref(root);
    *out = p;
    return 0;
bad:
    json_decref(root);
    if (errmsg && asprintf(errmsg, "bad policy: %s", why) < 0)
        *errmsg = NULL;
    return KS_EINVAL;
}

int
broker_policy_check_text(const char *name, const char *buf, size_t len,
                         char **errmsg)
{
    struct broker__policy *p = NULL;
    int rc = policy_parse(name, buf, len, &p, errmsg);
    broker__policy_free(p);
    return rc;
}

int
broker__policy_load(const char *path, struct broker__policy **out,
                    char hex[BROKER_POLICY_DIGEST_HEX], char **errmsg)
{
    char *buf = NULL;
    size_t len = 0;
    int rc;

    if (!path || !path[0]) {
        /* A policy asked for and not named (a caller of broker_run
         * that passes ""; the CLI's config reader already refuses an
         * empty value): never "no policy". */
        if (errmsg && asprintf(errmsg, "bad policy: the policy setting is "
                                       "empty (give a file, or no setting "
                                       "for none)") < 0)
            *errmsg = NULL;
        return KS_EINVAL;
    }
    if ((rc = broker_policy_read(path, &buf, &len, errmsg)))
        return rc;
    if ((rc = broker_policy_digest(buf, len, hex)) ||
        (rc = policy_parse(path, buf, len, out, errmsg))) {
        free(buf);
        return rc;
    }
    free(buf);
    return 0;
}

void
broker__policy_note(const char *state_dir, const char *path, const char *hex)
{
    char file[4200], tmp[4300];
    FILE *f;
    int fd;

    if (path)
        ks_log(KS_LOG_INFO, "policy loaded", KS_S("file", path),
               KS_S("sha256", hex));
    else
        ks_log(KS_LOG_WARN, "no policy: every operator may run anything");
    if (!state_dir || !state_dir[0])
        return;
    if (mkdir(state_dir, 0700) == -1 && errno != EEXIST)
        goto fail;
    snprintf(file, sizeof(file), "%s/" BROKER_POLICY_NOTE, state_dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", file);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd == -1 || !(f = fdopen(fd, "w"))) {
        if (fd != -1)
            close(fd);
        goto fail;
    }
    fprintf(f, "pid=%ld\nsha256=%s\nfile=%s\n", (long)getpid(),
            path ? hex : "none", path ? path : "");
    if (fclose(f) != 0 || rename(tmp, file) == -1)
        goto fail;
    return;
fail:
    ks_log(KS_LOG_WARN, "cannot note the loaded policy",
           KS_S("dir", state_dir), KS_S("error", strerror(errno)));
}

void
broker__policy_free(struct broker__policy *p)
{
    if (!p)
        return;
    json_decref(p->operators);
    free(p);
}

static bool
has_label(const Ks__AgentInfo *info, const char *k, const char *v)
{
    for (size_t i = 0; info && i < info->n_labels; i++)
        if (strcmp(info->labels[i]->name, k) == 0 &&
            strcmp(info->labels[i]->value, v) == 0)
            return true;
    return false;
}

/* 1 if rule grants what ("run", "read" or "label"); a rule without
 * "can" grants run and read (label only when listed: policies written
 * before it grant what they granted). */
static bool
rule_can(json_t *rule, const char *what)
{
    json_t *can = json_object_get(rule, "can"), *c;
    size_t i;
    if (!can)
        return strcmp(what, "label") != 0;
    json_array_foreach(can, i, c)
    {
        if (strcmp(json_string_value(c), what) == 0)
            return true;
    }
    return false;
}

/* 1 if name is in the rule's "env" list. */
static bool
env_listed(json_t *rule, const char *name)
{
    json_t *env = json_object_get(rule, "env"), *e;
    size_t i;
    json_array_foreach(env, i, e)
    {
        if (json_is_string(e) && strcmp(json_string_value(e), name) == 0)
            return true;
    }
    return false;
}

/* The user a command runs as, for the policy: --run-as, else "root". */
static const char *
run_user(const Ks__CommandSpec *spec)
{
    return spec->run_as && spec->run_as[0] ? spec->run_as : "root";
}

/* 1 if the rule grants running as user (see the top: no "run_as": root). */
static bool
user_listed(json_t *rule, const char *user)
{
    json_t *ras = json_object_get(rule, "run_as"), *r;
    size_t i;
    if (!ras)
        return strcmp(user, "root") == 0;
    json_array_foreach(ras, i, r)
    {
        if (fnmatch(json_string_value(r), user, 0) == 0)
            return true;
    }
    return false;
}

static bool
rule_allows(json_t *rule, const Ks__AgentInfo *agent,
            const Ks__CommandSpec *spec)
{
    json_t *ag = json_object_get(rule, "agents");
    json_t *ex = json_object_get(rule, "executables");
    const char *argv0 = spec && spec->n_argv ? spec->argv[0] : NULL;
    if (spec && !user_listed(rule, run_user(spec)))
        return false;
    /* A script is whatever its interpreter runs, a copy any file as the
     * agent's user: an executables list cannot vouch for either (argv[0]
     * only names them). */
    if (spec && ex && (spec->script || spec->copy))
        return false;
    if (json_is_object(ag)) {
        const char *k;
        json_t *v;
        json_object_foreach(ag, k, v)
        {
            if (!json_is_string(v) ||
                !has_label(agent, k, json_string_value(v)))
                return false;
        }
    }
    if (ex && spec) {
        size_t i;
        json_t *e;
        bool listed = false;
        /* A rule that names executables names the only variables the
         * command may set ("env", default none): PATH would pick another
         * file for the same name, LD_PRELOAD or an interpreter's own
         * variables (BASH_ENV, PYTHONPATH, ...) would run other code under
         * it. Found by a security review. */
        for (size_t k = 0; k < spec->n_env; k++)
            if (!env_listed(rule, spec->env[k]->name))
                return false;
        for (size_t k = 0; k < spec->n_sealed_env; k++)
            if (!env_listed(rule, spec->sealed_env[k]->name))
                return false;
        json_array_foreach(ex, i, e)
        {
            if (json_is_string(e) && argv0 &&
                strcmp(json_string_value(e), argv0) == 0)
                listed = true;
        }
        return listed;
    }
    return true;
}

/*
 * When the variables a command sets are all that stands in the way (a
 * "run" rule allows it without them), says so in why, naming those its
 * "env" does not list; true then. A denial only mentions variables that
 * were given and not allowed.
 */
static bool
env_denied(const char *op, json_t *rules, const Ks__AgentInfo *agent,
           const Ks__CommandSpec *spec, char *why, size_t len)
{
    Ks__CommandSpec bare;
    json_t *rule, *grant = NULL;
    size_t i, used;

    if (!spec->n_env && !spec->n_sealed_env)
        return false;
    bare = *spec;
    bare.n_env = bare.n_sealed_env = 0;
    json_array_foreach(rules, i, rule)
    {
        if (!grant && rule_can(rule, "run") && rule_allows(rule, agent, &bare))
            grant = rule;
    }
    if (!grant)
        return false;
    used = (size_t)snprintf(
        why, len,
        "denied: operator '%s' may run '%s' as '%s' on agent '%s', but not "
        "with the environment variable(s)",
        op, spec->argv[0], run_user(spec), agent ? agent->agent_id : "?");
    for (size_t k = 0; k < spec->n_env + spec->n_sealed_env; k++) {
        const char *name = k < spec->n_env
                               ? spec->env[k]->name
                               : spec->sealed_env[k - spec->n_env]->name;
        if (!env_listed(grant, name) && used < len)
            used += (size_t)snprintf(why + used, len - used, " %s", name);
    }
    if (used < len)
        snprintf(why + used, len - used,
                 ": a rule that lists \"executables\" lets a command set "
                 "only the variables its \"env\" lists");
    return true;
}

int
broker__policy_check(const struct broker__policy *p, const char *op,
                     const Ks__AgentInfo *agent, const Ks__CommandSpec *spec,
                     char *why, size_t len)
{
    const char *argv0 = spec && spec->n_argv ? spec->argv[0] : NULL;
    json_t *rules, *rule;
    size_t i;

    if (!p)
        return 0;
    rules = json_object_get(p->operators, op);
    if (!rules) {
        snprintf(why, len, "denied: operator '%s' is not in the policy", op);
        return KS_EDENIED;
    }
    if (!agent && !argv0)
        return 0; /* the agent list: being listed is enough */
    json_array_foreach(rules, i, rule)
    {
        if (rule_can(rule, "run") && rule_allows(rule, agent, spec))
            return 0;
    }
    if (spec && spec->copy)
        snprintf(why, len,
                 "denied: operator '%s' may not copy files to agent '%s' "
                 "(" COPY_RULE ")",
                 op, agent ? agent->agent_id : "?");
    else if (spec && spec->script)
        snprintf(why, len,
                 "denied: operator '%s' may not run the script '%s' as '%s' "
                 "on agent '%s' (a script takes a \"run\" rule without "
                 "\"executables\" whose \"run_as\" grants the user)",
                 op, argv0 ? argv0 : "?", run_user(spec),
                 agent ? agent->agent_id : "?");
    else if (!argv0)
        snprintf(why, len, "denied: operator '%s' may not act on agent '%s'",
                 op, agent ? agent->agent_id : "?");
    else if (!env_denied(op, rules, agent, spec, why, len))
        snprintf(why, len,
                 "denied: operator '%s' may not run '%s' as '%s' on agent "
                 "'%s'",
                 op, argv0, run_user(spec), agent ? agent->agent_id : "?");
    return KS_EDENIED;
}

int
broker__policy_check_upload(const struct broker__policy *p, const char *op,
                            char *why, size_t len)
{
    json_t *rules, *rule;
    size_t i;

    if (!p)
        return 0;
    rules = json_object_get(p->operators, op);
    json_array_foreach(rules, i, rule)
    {
        /* What rule_allows asks of a copy, on whichever agents. */
        if (rule_can(rule, "run") && !json_object_get(rule, "executables") &&
            user_listed(rule, "root"))
            return 0;
    }
    snprintf(why, len,
             "denied: operator '%s' may not upload files for kscore copy, "
             "as it may copy to no agent (" COPY_RULE ")",
             op);
    return KS_EDENIED;
}

int
broker__policy_check_batch(const struct broker__policy *p, const char *op,
                           const char *owner, char *why, size_t len)
{
    json_t *rules, *rule;
    size_t i;

    if (!p || strcmp(op, "broker") == 0 || (owner && strcmp(owner, op) == 0))
        return 0;
    rules = json_object_get(p->operators, op);
    json_array_foreach(rules, i, rule)
    {
        json_t *ag = json_object_get(rule, "agents");
        if (rule_can(rule, "run") && json_is_string(ag))
            return 0; /* runs anywhere: may stop anyone's batch */
    }
    snprintf(why, len,
             "denied: operator '%s' may not act on another operator's batch "
             "(it needs a \"run\" rule on agents \"*\")",
             op);
    return KS_EDENIED;
}

int
broker__policy_check_read(const struct broker__policy *p, const char *op,
                          const char *owner, const Ks__AgentInfo *agent,
                          bool every_agent, char *why, size_t len)
{
    json_t *rules, *rule;
    size_t i;

    if (!p || strcmp(op, "broker") == 0)
        return 0; /* the control plane itself (its readiness checks) */
    rules = json_object_get(p->operators, op);
    if (!rules) {
        snprintf(why, len, "denied: operator '%s' is not in the policy", op);
        return KS_EDENIED;
    }
    if (owner && strcmp(owner, op) == 0)
        return 0;
    json_array_foreach(rules, i, rule)
    {
        json_t *ag = json_object_get(rule, "agents");
        if (!rule_can(rule, "read"))
            continue;
        if (json_is_string(ag))
            return 0; /* "*" */
        if (!every_agent && agent && rule_allows(rule, agent, NULL))
            return 0;
    }
    if (every_agent)
        snprintf(why, len,
                 "denied: operator '%s' may not read every agent's records "
                 "(a \"read\" rule on agents \"*\" is needed)",
                 op);
    else
        snprintf(why, len,
                 "denied: operator '%s' may not read records of agent '%s'",
                 op, agent && agent->agent_id[0] ? agent->agent_id : "?");
    return KS_EDENIED;
}

int
broker__policy_check_label(const struct broker__policy *p, const char *op,
                           const Ks__AgentInfo *before,
                           const Ks__AgentInfo *after, char *why, size_t len)
{
    json_t *rules, *rule;
    size_t i;

    if (!p)
        return 0;
    rules = json_object_get(p->operators, op);
    json_array_foreach(rules, i, rule)
    {
        /* Its labels now and after: an operator cannot move an agent
         * out of reach of its rules, nor into another group's. */
        if (rule_can(rule, "label") && rule_allows(rule, before, NULL) &&
            rule_allows(rule, after, NULL))
            return 0;
    }
    snprintf(why, len,
             "denied: operator '%s' may not give agent '%s' these labels (a "
             "\"label\" rule must match its labels before and after)",
             op, before && before->agent_id[0] ? before->agent_id : "?");
    return KS_EDENIED;
}

void
broker__record_denied(struct broker *b, struct store *st, const char *op,
                      const char *agent_id, const Ks__CommandSpec *spec,
                      const char *why)
{
    char stream[128], evid[37];
    Ks__Event ev;
    Ks__Command cmd = KS__COMMAND__INIT;

    snprintf(stream, sizeof(stream), "operator-%s", op);
    broker__event_init(&ev, evid, stream, "RequestDenied", NULL);
    ev.operator_ = (char *)op;
    ev.agent_id = (char *)(agent_id ? agent_id : "");
    ev.reason = (char *)why;
    if (spec) {
        cmd.spec = (Ks__CommandSpec *)spec;
        cmd.agent_id = ev.agent_id;
        cmd.command_id = "";
        cmd.batch_id = "";
        cmd.operator_ = (char *)op;
        ev.command = &cmd;
    }
    char identity[16 + EVT_IDENTITY_MAX];
    snprintf(identity, sizeof(identity), "operator-%s", op);
    /* Past the operator's share of annotation rows it is still denied,
     * only not written (budget.c). */
    if (!broker__budget_take(b, identity, ks__event__get_packed_size(&ev),
                             BROKER_ANNOTATION_DENIAL))
        return;
    struct store_event se = {&ev};
    store_append(st, stream, STORE_ANY, &se, 1, NULL);
}
