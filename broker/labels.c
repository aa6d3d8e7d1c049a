/*
 * labels.c: an agent's signed labels that change without a new enrolment
 * (`kscore agent label ID k=v|k-`, kscore.api.v1.label), and the labels
 * a command carries to its agent (Command.labels).
 *
 * A relabel is the broker's signature over (subject, time, labels), made
 * as `kscore agent enroll` makes one (events.h evt_labels_sign; subject:
 * the agent id, or "pool.<pool>/<size>" for a pool, whose ids share its
 * labels), recorded as an AgentLabelsChanged event on the agent's stream
 * ("agent-<id>", or "pool-<pool>") that names the operator, the labels it
 * replaced and the change asked for. The record is where it lives: every
 * broker reads the newest one of each stream at its start
 * (store_read_relabels, before the registry reads any entry), again when
 * another broker records one (its notice, BROKER_NOTICE_RELABEL) and
 * every BROKER_RELABEL_RELOAD_US anyway (a notice can be lost).
 *
 * Which labels an entry gets (registry.c labels_settle): the newer of the
 * relabel of its subject and its own attestation (the bundle's, signed at
 * enrolment; a new enrolment is newer than the relabels before it).
 * Entries keep sending their bundle's attestation, so that comparison is
 * made at every heartbeat: the change is seen at the agent's next one,
 * and an agent that presents its old attestation (the one in its bundle)
 * keeps the relabel's labels, not its old ones. A relabel is this
 * broker's signature like an attestation: an id that has one counts as
 * signed (broker__agent.ever_signed), for good, from the broker's start
 * (it is in the record), so it is never served with unsigned labels.
 *
 * Who may: the policy's "label" rules (policy.c broker__policy_check_label:
 * the rule must match the agent's labels before and after). Facts
 * (AgentInfo.facts) are never labels: no label key starts with "fact."
 * (client.h broker_label_check).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* A subject's newest relabel: b->relabels (subject -> struct relabel *),
 * under b->mu. */
struct relabel {
    Ks__Event *ev; /* AgentLabelsChanged, owned; its labels verified */
};

static void
relabel_free(struct relabel *r)
{
    if (!r)
        return;
    if (r->ev)
        ks__event__free_unpacked(r->ev, NULL);
    free(r);
}

static void
free_relabel(const char *key, void *val, void *ud)
{
    (void)key;
    (void)ud;
    relabel_free(val);
}

/* Whether ev is an AgentLabelsChanged whose labels this broker signed. */
static bool
relabel_valid(struct broker *b, const Ks__Event *ev)
{
    const Ks__LabelAttestation *at = ev->labels;
    return at && at->subject && at->subject[0] &&
           evt_labels_verify(b->local_trust, at->key_id, at->subject,
                             at->at_us, at->labels, at->n_labels,
                             at->signature.data, at->signature.len) == 0;
}

struct load_ctx {
    struct broker *b;
    struct ks_map *into;
    size_t n, bad;
    int rc;
};

static int
load_one(const Ks__RecordedEvent *rec, void *ud)
{
    struct load_ctx *c = ud;
    uint8_t *buf = NULL;
    size_t len = 0;
    struct relabel *r;

    if (!rec->event || !relabel_valid(c->b, rec->event)) {
        c->bad++; /* another key's (a new signing key voids them) */
        return 0;
    }
    if (!(r = calloc(1, sizeof(*r))) ||
        kproto_pack(&rec->event->base, &buf, &len) != 0 ||
        !(r->ev = ks__event__unpack(NULL, len, buf))) {
        free(buf);
        relabel_free(r);
        return c->rc = -ENOMEM;
    }
    free(buf);
    /* Two streams of one subject cannot be (agent ids have no '.'). */
    relabel_free(ks_map_del(c->into, r->ev->labels->subject));
    if (ks_map_put(c->into, r->ev->labels->subject, r) != 0) {
        relabel_free(r);
        return c->rc = -ENOMEM;
    }
    c->n++;
    return 0;
}

int
broker__relabels_load(struct broker *b, struct store *st)
{
    struct ks_map fresh = KS_MAP_INIT, old;
    struct load_ctx c = {b, &fresh, 0, 0, 0};
    int rc = store_read_relabels(st, NULL, load_one, &c);

    if (rc == 0)
        rc = c.rc;
    if (rc) {
        ks_map_each(&fresh, free_relabel, NULL);
        ks_map_clear(&fresh);
        return rc;
    }
    pthread_mutex_lock(&b->mu);
    old = b->relabels;
    b->relabels = fresh;
    b->relabels_loaded_mono_us = ks_mono_us();
    pthread_mutex_unlock(&b->mu);
    ks_map_each(&old, free_relabel, NULL);
    ks_map_clear(&old);
    if (c.bad)
        ks_log(KS_LOG_WARN,
               "relabels not signed by this broker's key are ignored",
               KS_S("module", "labels"), KS_I("ignored", c.bad));
    return 0;
}

void
broker__relabels_free(struct broker *b)
{
    ks_map_each(&b->relabels, free_relabel, NULL);
    ks_map_clear(&b->relabels);
}

/* A malloc'd copy of v (protobuf-c frees it with free_unpacked). NULL
 * without memory. */
static Ks__EnvVar *
env_copy(const Ks__EnvVar *v)
{
    Ks__EnvVar *c = malloc(sizeof(*c));
    if (!c)
        return NULL;
    ks__env_var__init(c);
    c->name = strdup(v->name ? v->name : "");
    c->value = strdup(v->value ? v->value : "");
    if (!c->name || !c->value) {
        free(c->name);
        free(c->value);
        free(c);
        return NULL;
    }
    return c;
}

static void
env_list_free(Ks__EnvVar **v, size_t n)
{
    for (size_t i = 0; v && i < n; i++)
        ks__env_var__free_unpacked(v[i], NULL);
    free(v);
}

/* A copy of n labels (malloc'd as an unpacked message's are). 0 or
 * -ENOMEM. */
static int
env_list_copy(Ks__EnvVar *const *src, size_t n, Ks__EnvVar ***out)
{
    Ks__EnvVar **v = calloc(n + 1, sizeof(*v));
    if (!v)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        if (!(v[i] = env_copy(src[i]))) {
            env_list_free(v, i);
            return -ENOMEM;
        }
    *out = v;
    return 0;
}

bool
broker__relabel_settle(struct broker *b, const char *subject,
                       int64_t entry_at_us, Ks__AgentInfo *info,
                       struct broker__settled *out)
{
    Ks__EnvVar **copy = NULL;
    struct relabel *r;
    bool applied = false;

    pthread_mutex_lock(&b->mu);
    r = ks_map_get(&b->relabels, subject);
    /* The newer signature wins: a new enrolment replaces the relabels
     * before it; an old bundle's attestation replaces nothing. */
    if (r && r->ev->labels->at_us >= entry_at_us &&
        env_list_copy(r->ev->labels->labels, r->ev->labels->n_labels,
                      &copy) == 0) {
        for (size_t i = 0; i < info->n_labels; i++)
            ks__env_var__free_unpacked(info->labels[i], NULL);
        free(info->labels);
        info->labels = copy;
        info->n_labels = r->ev->labels->n_labels;
        out->relabelled = true;
        snprintf(out->by, sizeof(out->by), "%s",
                 r->ev->operator_ ? r->ev->operator_ : "");
        out->at_us = r->ev->labels->at_us;
        applied = true;
    }
    pthread_mutex_unlock(&b->mu);
    return applied;
}

bool
broker__relabels_due(struct broker *b)
{
    bool due;
    pthread_mutex_lock(&b->mu);
    due = atomic_exchange(&b->relabels_dirty, false) ||
          ks_mono_us() - b->relabels_loaded_mono_us >= BROKER_RELABEL_RELOAD_US;
    pthread_mutex_unlock(&b->mu);
    return due;
}

/* ---- the labels a command carries ---------------------------------------- */

static int
cmp_env(const void *x, const void *y)
{
    const Ks__EnvVar *a = *(Ks__EnvVar *const *)x;
    const Ks__EnvVar *b = *(Ks__EnvVar *const *)y;
    return strcmp(a->name, b->name);
}

void
broker__command_labels(struct broker *b, const char *agent_id,
                       struct broker__labels *out)
{
    struct broker__agent *a;

    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a && a->info && a->info->n_labels &&
        env_list_copy(a->info->labels, a->info->n_labels, &out->v) == 0)
        out->n = a->info->n_labels;
    pthread_mutex_unlock(&b->mu);
    /* In key order: the first of two keys that map to one variable
     * name gives its value (agent/facts.c). */
    if (out->n > 1)
        qsort(out->v, out->n, sizeof(*out->v), cmp_env);
}

void
broker__labels_release(struct broker__labels *l)
{
    env_list_free(l->v, l->n);
    memset(l, 0, sizeof(*l));
}

/* ---- kscore.api.v1.label ------------------------------------------------- */

/* A copy of the entry of an id of pool (each has the pool's labels and
 * size), or NULL when the broker knows no id of it. */
struct find_pool {
    const char *pool;
    const char *id;
};

static void
find_member(const char *key, void *val, void *ud)
{
    struct find_pool *f = ud;
    const struct broker__agent *a = val;
    if (!f->id && a->info && a->info->pool &&
        strcmp(a->info->pool, f->pool) == 0)
        f->id = key;
}

static Ks__AgentInfo *
pool_member(struct broker *b, const char *pool)
{
    struct find_pool f = {pool, NULL};
    char id[EVT_AGENT_ID_MAX + 1] = "";

    pthread_mutex_lock(&b->mu);
    ks_map_each(&b->agents, find_member, &f);
    if (f.id)
        snprintf(id, sizeof(id), "%s", f.id);
    pthread_mutex_unlock(&b->mu);
    return id[0] ? broker__agent_info(b, id) : NULL;
}

/* The time of the entry's own attestation, if it verified (registry.c
 * keeps it), else 0. */
static int64_t
entry_at(struct broker *b, const char *agent_id)
{
    struct broker__agent *a;
    int64_t at = 0;
    pthread_mutex_lock(&b->mu);
    a = ks_map_get(&b->agents, agent_id);
    if (a)
        at = a->entry_at_us;
    pthread_mutex_unlock(&b->mu);
    return at;
}

struct last_relabel {
    Ks__Event *ev; /* owned */
};

static int
keep_last(const Ks__RecordedEvent *rec, void *ud)
{
    struct last_relabel *l = ud;
    uint8_t *buf = NULL;
    size_t len = 0;
    if (!rec->event || kproto_pack(&rec->event->base, &buf, &len) != 0)
        return -ENOMEM;
    if (l->ev)
        ks__event__free_unpacked(l->ev, NULL);
    l->ev = ks__event__unpack(NULL, len, buf);
    free(buf);
    return l->ev ? 0 : -ENOMEM;
}

/* base with req's change: a sorted copy (*out, *n_out). 0 or -ENOMEM. */
static int
apply_change(Ks__EnvVar *const *base, size_t n_base,
             const Ks__LabelRequest *req, Ks__EnvVar ***out, size_t *n_out)
{
    Ks__EnvVar **v = calloc(n_base + req->n_set + 1, sizeof(*v));
    size_t n = 0;
    if (!v)
        return -ENOMEM;
    for (size_t i = 0; i < n_base; i++) {
        bool drop = false;
        for (size_t k = 0; k < req->n_remove && !drop; k++)
            drop = strcmp(base[i]->name, req->remove[k]) == 0;
        for (size_t k = 0; k < req->n_set && !drop; k++)
            drop = strcmp(base[i]->name, req->set[k]->name) == 0;
        if (!drop && !(v[n++] = env_copy(base[i])))
            goto nomem;
    }
    for (size_t k = 0; k < req->n_set; k++)
        if (!(v[n++] = env_copy(req->set[k])))
            goto nomem;
    qsort(v, n, sizeof(*v), cmp_env);
    *out = v;
    *n_out = n;
    return 0;
nomem:
    env_list_free(v, n - 1);
    return -ENOMEM;
}

static bool
same_labels(Ks__EnvVar *const *a, size_t na, Ks__EnvVar *const *b, size_t nb)
{
    if (na != nb)
        return false;
    for (size_t i = 0; i < na; i++)
        if (strcmp(a[i]->name, b[i]->name) != 0 ||
            strcmp(a[i]->value, b[i]->value) != 0)
            return false;
    return true;
}

/* req's fields, checked at the boundary. 0 or KS_EINVAL with why. */
static int
label_request_check(const Ks__LabelRequest *req, const char *pool, char *why,
                    size_t len)
{
    if (!evt_agent_id_valid(pool ? pool : req->agent_id)) {
        snprintf(why, len,
                 "bad agent id '%s' (letters, digits, _ and -; pool-POOL for "
                 "a pool)",
                 req->agent_id);
        return KS_EINVAL;
    }
    if (req->n_set + req->n_remove == 0) {
        snprintf(why, len, "no change: give KEY=VALUE or KEY- (remove)");
        return KS_EINVAL;
    }
    if (req->n_set + req->n_remove > BROKER_AGENT_INFO_MAX_LABELS) {
        snprintf(why, len, "at most %d labels", BROKER_AGENT_INFO_MAX_LABELS);
        return KS_EINVAL;
    }
    for (size_t i = 0; i < req->n_set + req->n_remove; i++) {
        const char *k = i < req->n_set ? req->set[i]->name
                                       : req->remove[i - req->n_set];
        const char *v = i < req->n_set ? req->set[i]->value : NULL;
        int rc = broker_label_check(k, v, why, len);
        if (rc)
            return rc;
        for (size_t j = 0; j < i; j++) {
            const char *o = j < req->n_set ? req->set[j]->name
                                           : req->remove[j - req->n_set];
            if (strcmp(o, k) == 0) {
                snprintf(why, len, "label %s given twice", k);
                return KS_EINVAL;
            }
        }
    }
    return 0;
}

/* "env=prod, -role": what was asked, for the event's reason. */
static void
change_text(const Ks__LabelRequest *req, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < req->n_set + req->n_remove && used < len; i++)
        used += (size_t)snprintf(
            buf + used, len - used, "%s%s%s%s", i ? ", " : "",
            i < req->n_set ? req->set[i]->name : "-",
            i < req->n_set ? "=" : req->remove[i - req->n_set],
            i < req->n_set ? req->set[i]->value : "");
}

/* A relabel just recorded here (ev, borrowed): this broker uses it at
 * once, the others at their notice. */
static void
relabel_keep(struct broker *b, const Ks__Event *ev)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    struct relabel *r = calloc(1, sizeof(*r));
    if (!r || kproto_pack(&ev->base, &buf, &len) != 0 ||
        !(r->ev = ks__event__unpack(NULL, len, buf))) {
        free(buf);
        relabel_free(r);
        atomic_store(&b->relabels_dirty, true); /* read it back instead */
        return;
    }
    free(buf);
    pthread_mutex_lock(&b->mu);
    struct relabel *old = ks_map_get(&b->relabels, r->ev->labels->subject);
    if (old && old->ev->labels->at_us > r->ev->labels->at_us) {
        relabel_free(r);
    } else if (ks_map_put(&b->relabels, r->ev->labels->subject, r) == 0) {
        relabel_free(old);
    } else {
        relabel_free(r);
        atomic_store(&b->relabels_dirty, true);
    }
    pthread_mutex_unlock(&b->mu);
}

void
broker__handle_label(struct broker *b, struct store *st, natsMsg *msg)
{
    Ks__LabelRequest *req = NULL;
    Ks__LabelReply r = KS__LABEL_REPLY__INIT;
    Ks__AgentInfo *info = NULL;
    Ks__EnvVar **now_v = NULL, **base_v = NULL;
    size_t now_n = 0, base_n = 0;
    struct last_relabel last = {NULL};
    const char *op = broker__operator_of(msg);
    char why[512] = "", subject[sizeof(EVT_POOL_KEY_PREFIX) +
                                EVT_AGENT_ID_MAX + 12],
         stream[16 + EVT_AGENT_ID_MAX], change[600];
    int rc;

    rc = broker__unpack_request(msg, &ks__label_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc)
        goto reply;
    const char *pool =
        strncmp(req->agent_id, "pool-", 5) == 0 ? req->agent_id + 5 : NULL;
    if ((rc = label_request_check(req, pool, why, sizeof(why))))
        goto reply;
    if (pool) {
        info = pool_member(b, pool);
        if (!info) {
            rc = KS_ENOAGENT;
            snprintf(why, sizeof(why),
                     "unknown pool '%s' (no id of it has heartbeat to this "
                     "broker)",
                     pool);
            goto reply;
        }
        evt_pool_attest_id(subject, sizeof(subject), pool, info->pool_size);
        snprintf(stream, sizeof(stream), "pool-%s", pool);
    } else {
        if (!broker__agent_known(b, req->agent_id) ||
            !(info = broker__agent_info(b, req->agent_id))) {
            rc = KS_ENOAGENT;
            snprintf(why, sizeof(why), "unknown agent '%s'", req->agent_id);
            goto reply;
        }
        if (info->pool && info->pool[0]) {
            rc = KS_EINVAL;
            snprintf(why, sizeof(why),
                     "agent '%s' is an id of pool %s, whose ids share its "
                     "labels: kscore agent label pool-%s ...",
                     req->agent_id, info->pool, info->pool);
            goto reply;
        }
        snprintf(subject, sizeof(subject), "%s", req->agent_id);
        snprintf(stream, sizeof(stream), "agent-%s", req->agent_id);
    }
    int64_t own_at = entry_at(b, info->agent_id);
    change_text(req, change, sizeof(change));
    /* Read, decide, append at the version read: two changes at once
     * never lose one (the second is decided again on the first's). */
    for (int tries = 0;; tries++) {
        int64_t version = 0;
        if (last.ev)
            ks__event__free_unpacked(last.ev, NULL);
        last.ev = NULL;
        env_list_free(now_v, now_n);
        now_v = NULL;
        now_n = 0;
        if ((rc = store_stream_version(st, stream, &version)) ||
            (rc = store_read_relabels(st, stream, keep_last, &last))) {
            broker__store_error(st, rc, why, sizeof(why));
            goto reply;
        }
        /* The labels now: the newer of the recorded relabel (of this
         * very subject: a pool enrolled again with another size is
         * another) and the entry's own attestation. */
        const Ks__LabelAttestation *la =
            last.ev && last.ev->labels &&
                    strcmp(last.ev->labels->subject, subject) == 0
                ? last.ev->labels
                : NULL;
        if (la && la->at_us >= own_at) {
            base_v = la->labels;
            base_n = la->n_labels;
        } else {
            base_v = info->labels;
            base_n = info->n_labels;
        }
        if ((rc = apply_change(base_v, base_n, req, &now_v, &now_n)))
            goto reply;
        if (b->policy) {
            Ks__AgentInfo before = *info, after = *info;
            before.labels = base_v;
            before.n_labels = base_n;
            after.labels = now_v;
            after.n_labels = now_n;
            if ((rc = broker__policy_check_label(b->policy, op, &before,
                                                 &after, why, sizeof(why)))) {
                broker__record_denied(b, st, op, info->agent_id, NULL, why);
                goto reply;
            }
        }
        Ks__EnvVar **sorted_base = NULL;
        size_t sorted_n = 0;
        Ks__LabelRequest none = KS__LABEL_REQUEST__INIT;
        if ((rc = apply_change(base_v, base_n, &none, &sorted_base,
                               &sorted_n)))
            goto reply;
        bool same = same_labels(sorted_base, sorted_n, now_v, now_n);
        env_list_free(sorted_base, sorted_n);
        if (same) {
            r.changed = false;
            r.at_us = la && la->at_us >= own_at ? la->at_us : own_at;
            break;
        }
        /* Newer than every signature of the subject, whatever the
         * clock says. */
        int64_t at = ks_now_us();
        if (la && at <= la->at_us)
            at = la->at_us + 1;
        if (at <= own_at)
            at = own_at + 1;
        uint8_t sig[EVT_SIGNATURE_BYTES];
        if ((rc = evt_labels_sign(b->signer, subject, at, now_v, now_n,
                                  sig))) {
            snprintf(why, sizeof(why), "cannot sign the labels: %s",
                     ks_strerror(rc));
            goto reply;
        }
        Ks__LabelAttestation att = KS__LABEL_ATTESTATION__INIT;
        att.subject = subject;
        att.labels = now_v;
        att.n_labels = now_n;
        att.at_us = at;
        att.signature.data = sig;
        att.signature.len = sizeof(sig);
        att.key_id = (char *)evt_signer_key_id(b->signer);
        att.previous = base_v;
        att.n_previous = base_n;
        char evid[37];
        Ks__Event ev;
        broker__event_init(&ev, evid, stream, "AgentLabelsChanged", NULL);
        ev.agent_id = pool ? "" : info->agent_id;
        ev.operator_ = (char *)op;
        ev.reason = change;
        ev.labels = &att;
        struct store_event se = {&ev};
        rc = store_append(st, stream, version, &se, 1, NULL);
        if (rc == KS_ECONFLICT && tries < 5)
            continue;
        if (rc) {
            broker__store_error(st, rc, why, sizeof(why));
            goto reply;
        }
        relabel_keep(b, &ev);
        broker__notice_relabel(b, stream);
        ks_log(KS_LOG_INFO, "labels changed", KS_S("module", "labels"),
               KS_S("agent", req->agent_id), KS_S("operator", op),
               KS_S("change", change));
        r.changed = true;
        r.at_us = at;
        break;
    }
    r.labels = now_v;
    r.n_labels = now_n;
    r.previous = base_v;
    r.n_previous = base_n;
    r.online = broker__agent_presence(b, info->agent_id, NULL) == 1;
reply:
    if (rc) {
        r.error_code = rc;
        r.error = why[0] ? why : (char *)ks_strerror(rc);
    }
    broker__reply_msg(b, natsMsg_GetReply(msg), &r.base);
    env_list_free(now_v, now_n);
    if (last.ev)
        ks__event__free_unpacked(last.ev, NULL);
    if (info)
        ks__agent_info__free_unpacked(info, NULL);
    if (req)
        ks__label_request__free_unpacked(req, NULL);
}
