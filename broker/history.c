/* kscore.api.v1.list: history of commands and batches (store_list), with
 * the read policy applied to each row. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_int.h"

/* Rows the store is asked for per request at most, whatever the policy
 * hides: a reply comes in bounded time, and the client pages on. */
#define LIST_SCAN_MAX 5000
#define LIST_LIMIT_MAX 1000

struct list_acc {
    struct broker *b;
    const char *op;
    Ks__ListItem **items;
    size_t n, cap, want;
    size_t scanned;
    int64_t last_at_us; /* the last row scanned: where the next page starts */
    char last_id[160];
};

/* Whether op may read this row (broker.c may_read, row by row, without
 * recording a denial: a row hidden from a list is not a refusal). */
static bool
row_visible(struct list_acc *a, const Ks__ListItem *it)
{
    char why[300];
    Ks__AgentInfo *info = NULL;
    int rc;

    if (!a->b->policy)
        return true;
    if (!it->is_batch && it->agent_id[0]) {
        info = broker__agent_info(a->b, it->agent_id);
        if (!info && (info = calloc(1, sizeof(*info)))) {
            ks__agent_info__init(info);
            info->agent_id = strdup(it->agent_id);
        }
    }
    rc = broker__policy_check_read(a->b->policy, a->op, it->operator_, info,
                                   false, why, sizeof(why));
    if (info)
        ks__agent_info__free_unpacked(info, NULL);
    return rc == 0;
}

static int
collect(const Ks__ListItem *it, void *ud)
{
    struct list_acc *a = ud;
    uint8_t *buf;
    size_t len;

    a->scanned++;
    a->last_at_us = it->requested_at_us;
    snprintf(a->last_id, sizeof(a->last_id), "%s", it->id);
    if (a->n >= a->want || !row_visible(a, it))
        return 0;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        void *p = realloc(a->items, nc * sizeof(*a->items));
        if (!p)
            return -ENOMEM;
        a->items = p;
        a->cap = nc;
    }
    /* The store lends the row; keep a copy for the reply. */
    if (kproto_pack(&it->base, &buf, &len))
        return -ENOMEM;
    a->items[a->n] = ks__list_item__unpack(NULL, len, buf);
    free(buf);
    if (!a->items[a->n])
        return -ENOMEM;
    a->n++;
    return 0;
}

void
broker__handle_list(struct broker *b, natsMsg *msg)
{
    Ks__ListRequest *req = NULL;
    Ks__ListReply r = KS__LIST_REPLY__INIT;
    struct list_acc acc = {.b = b, .op = broker__operator_of(msg)};
    struct store_list_query q = {0};
    char why[600], cursor_id[160] = "";
    int rc;

    rc = broker__unpack_request(msg, &ks__list_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc) {
        broker__reply_error(b, msg, r.base.descriptor, rc, why);
        return;
    }
    acc.want = req->limit ? req->limit : STORE_LIST_DEFAULT;
    if (acc.want > LIST_LIMIT_MAX)
        acc.want = LIST_LIMIT_MAX;
    q.agents = (const char *const *)req->agents;
    q.n_agents = req->n_agents;
    q.operator_ = req->operator_;
    q.statuses = (const char *const *)req->statuses;
    q.n_statuses = req->n_statuses;
    q.since_us = req->since_us;
    q.until_us = req->until_us;
    q.batch_id = req->batch_id;
    q.cursor_at_us = req->cursor_at_us;
    q.cursor_id = req->cursor_id;
    snprintf(cursor_id, sizeof(cursor_id), "%s", req->cursor_id);
    /* Pages of the store until the reply is full, the store has no more,
     * or LIST_SCAN_MAX rows were looked at (rows the policy hides). */
    for (;;) {
        size_t before = acc.scanned;
        q.limit = (uint32_t)(acc.want - acc.n);
        rc = store_list(b->st_misc, &q, collect, &acc);
        if (rc)
            break;
        size_t got = acc.scanned - before;
        if (got < q.limit) {
            r.more = false;
            break;
        }
        r.more = true;
        if (acc.n >= acc.want || acc.scanned >= LIST_SCAN_MAX)
            break;
        q.cursor_at_us = acc.last_at_us;
        snprintf(cursor_id, sizeof(cursor_id), "%s", acc.last_id);
        q.cursor_id = cursor_id;
    }
    if (rc) {
        r.error_code = rc;
        r.error = (char *)broker__store_error(b->st_misc, rc, why, sizeof(why));
        r.more = false;
        acc.n = 0;
    }
    r.items = acc.items;
    r.n_items = acc.n;
    r.cursor_at_us = acc.last_at_us;
    r.cursor_id = acc.last_id;
    /* Keep the reply under the max payload: drop the tail; the cursor then
     * points at the last item kept and the client pages on. */
    while (r.n_items > 1 &&
           protobuf_c_message_get_packed_size(&r.base) > KS_MAX_MESSAGE_BYTES)
        r.n_items /= 2;
    if (r.n_items < acc.n) {
        r.more = true;
        r.cursor_at_us = acc.items[r.n_items - 1]->requested_at_us;
        r.cursor_id = acc.items[r.n_items - 1]->id;
    }
    {
        const char *reply = natsMsg_GetReply(msg);
        if (reply && reply[0]) {
            int prc = evt_publish_msg(b->nc, reply, &r.base);
            if (prc)
                ks_log(KS_LOG_WARN, "cannot send a reply",
                       KS_S("subject", reply), KS_ERR(prc));
        }
    }
    for (size_t i = 0; i < acc.n; i++)
        ks__list_item__free_unpacked(acc.items[i], NULL);
    free(acc.items);
    ks__list_request__free_unpacked(req, NULL);
}
