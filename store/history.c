/* History: commands and batches, newest first (store_list). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store_int.h"

/* A text[] parameter in binary format; an empty list is a 0-dimension
 * array (what '{}' is). */
static int
text_array(struct store__buf *b, const char *const *v, size_t n)
{
    int rc;
    if (n == 0) {
        b->len = 0;
        if ((rc = store__buf_put_be32(b, 0)) < 0 ||
            (rc = store__buf_put_be32(b, 0)) < 0)
            return rc;
        return store__buf_put_be32(b, STORE__OID_TEXT);
    }
    if ((rc = store__arr_begin(b, STORE__OID_TEXT, n)) < 0)
        return rc;
    for (size_t i = 0; i < n; i++)
        if ((rc = store__arr_put(b, v[i], strlen(v[i]))) < 0)
            return rc;
    return 0;
}

/*
 * Both halves are ordered and limited on their own so each can walk its
 * index (requested_at) backwards from the cursor; the outer ORDER BY merges
 * them. Ids compare bytewise (COLLATE "C"): the cursor's tie-break must be
 * the same order whatever the database's collation.
 */
#define LIST_FILTERS(T, ID, STATUS_ALSO)                                       \
    " AND ($2 = '' OR " T ".operator = $2)"                                    \
    " AND (cardinality($3::text[]) = 0 OR " T ".status = ANY ($3::text[])"     \
    STATUS_ALSO ")"                                                            \
    " AND ($4::bigint = 0 OR " T ".requested_at >= kscore_ts($4::bigint))"     \
    " AND ($5::bigint = 0 OR " T ".requested_at < kscore_ts($5::bigint))"      \
    " AND ($7::bigint = 0 OR " T ".requested_at < kscore_ts($7::bigint)"       \
    "      OR (" T ".requested_at = kscore_ts($7::bigint)"                     \
    "          AND " ID " COLLATE \"C\" < $8))"                                \
    " ORDER BY " T ".requested_at DESC, " ID " COLLATE \"C\" DESC"             \
    " LIMIT $9::int"

static const char list_sql[] =
    "SELECT * FROM ("
    "(SELECT false AS is_batch, c.command_id::text AS id, c.agent_id,"
    "  c.operator, c.status, c.argv[1:32], cardinality(c.argv),"
    "  kscore_us(c.requested_at) AS at,"
    "  coalesce(kscore_us(c.finished_at), 0), c.exit_code,"
    "  coalesce(c.signal, 0), coalesce(c.batch_id, ''), 0, 0, 0, 0,"
    "  coalesce(c.timed_out, false)"
    " FROM commands c WHERE c.requested_at IS NOT NULL"
    " AND CASE WHEN $6 <> '' THEN c.batch_id = $6"
    "          WHEN cardinality($1::text[]) > 0 THEN true"
    "          ELSE c.batch_id IS NULL END"
    " AND (cardinality($1::text[]) = 0 OR c.agent_id = ANY ($1::text[]))"
    LIST_FILTERS("c", "c.command_id::text", "") ")"
    " UNION ALL "
    "(SELECT true, b.batch_id, '', b.operator, b.status,"
    "  (SELECT t.argv[1:32] FROM commands t WHERE t.batch_id = b.batch_id"
    "   LIMIT 1),"
    "  (SELECT cardinality(t.argv) FROM commands t"
    "   WHERE t.batch_id = b.batch_id LIMIT 1),"
    "  kscore_us(b.requested_at), coalesce(kscore_us(b.finished_at), 0),"
    "  NULL, 0, '', b.total, b.succeeded, b.failed, b.cancelled, false"
    " FROM batches b WHERE b.requested_at IS NOT NULL"
    " AND $6 = '' AND cardinality($1::text[]) = 0"
    /* "Completed" (a batch's status before migration 13): any batch that
     * ended but a cancelled one. */
    LIST_FILTERS("b", "b.batch_id",
                 " OR ('Completed' = ANY ($3::text[]) AND b.status IN"
                 " ('Succeeded', 'PartialFailure', 'Failed'))") ")"
    ") x ORDER BY at DESC, id COLLATE \"C\" DESC LIMIT $9::int";

/* Parses a text[] value ({a,"b c",...}) into at most cap strings in
 * place; returns the count. Elements are unquoted and unescaped. */
static size_t
parse_text_array(char *s, char **out, size_t cap)
{
    size_t n = 0;
    char *w, *r;

    if (!s || *s != '{')
        return 0;
    r = s + 1;
    while (*r && *r != '}' && n < cap) {
        char *start = w = r;
        if (*r == '"') {
            start = w = ++r;
            while (*r && *r != '"') {
                if (*r == '\\' && r[1])
                    r++;
                *w++ = *r++;
            }
            if (*r == '"')
                r++;
        } else {
            while (*r && *r != ',' && *r != '}')
                *w++ = *r++;
        }
        char end = *r;
        *w = '\0';
        out[n++] = start;
        if (end == ',')
            r++;
        else
            break;
    }
    return n;
}

/* Cuts s to at most max bytes at a UTF-8 boundary; true if it cut. */
static bool
cut_utf8(char *s, size_t max)
{
    size_t n = strlen(s);
    if (n <= max)
        return false;
    while (max > 0 && ((unsigned char)s[max] & 0xC0) == 0x80)
        max--;
    s[max] = '\0';
    return true;
}

int
store_list(struct store *s, const struct store_list_query *q,
           store_list_fn cb, void *ud)
{
    struct store__buf agents = {.cap = KS_MAX_MESSAGE_BYTES},
                      statuses = {.cap = KS_MAX_MESSAGE_BYTES};
    struct store__params p = {0};
    PGresult *res = NULL;
    int rc;

    if ((rc = text_array(&agents, q->agents, q->n_agents)) < 0 ||
        (rc = text_array(&statuses, q->statuses, q->n_statuses)) < 0)
        goto out;
    store__p_bin(&p, agents.p, agents.len);
    store__p_text(&p, q->operator_ ? q->operator_ : "");
    store__p_bin(&p, statuses.p, statuses.len);
    store__p_i64(&p, q->since_us);
    store__p_i64(&p, q->until_us);
    store__p_text(&p, q->batch_id ? q->batch_id : "");
    store__p_i64(&p, q->cursor_at_us);
    store__p_text(&p, q->cursor_id ? q->cursor_id : "");
    store__p_i64(&p, q->limit ? q->limit : STORE_LIST_DEFAULT);
    if ((rc = store__ready(s)) < 0)
        goto out;
    res = PQexecParams(s->conn, list_sql, p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
        goto out;
    }
    for (int i = 0; i < PQntuples(res) && rc == 0; i++) {
        Ks__ListItem it = KS__LIST_ITEM__INIT;
        char *argv[32];
        it.is_batch = PQgetvalue(res, i, 0)[0] == 't';
        it.id = PQgetvalue(res, i, 1);
        it.agent_id = PQgetvalue(res, i, 2);
        it.operator_ = PQgetvalue(res, i, 3);
        it.status = PQgetvalue(res, i, 4);
        it.n_argv = parse_text_array(PQgetvalue(res, i, 5), argv, 32);
        it.argv = argv;
        it.argv_truncated =
            strtoul(PQgetvalue(res, i, 6), NULL, 10) > it.n_argv;
        for (size_t k = 0; k < it.n_argv; k++)
            if (cut_utf8(argv[k], 256))
                it.argv_truncated = true;
        it.requested_at_us = strtoll(PQgetvalue(res, i, 7), NULL, 10);
        it.finished_at_us = strtoll(PQgetvalue(res, i, 8), NULL, 10);
        it.has_exit_code = !PQgetisnull(res, i, 9);
        it.exit_code = (int32_t)strtol(PQgetvalue(res, i, 9), NULL, 10);
        it.signal = (int32_t)strtol(PQgetvalue(res, i, 10), NULL, 10);
        it.batch_id = PQgetvalue(res, i, 11);
        it.total = (uint32_t)strtoul(PQgetvalue(res, i, 12), NULL, 10);
        it.succeeded = (uint32_t)strtoul(PQgetvalue(res, i, 13), NULL, 10);
        it.failed = (uint32_t)strtoul(PQgetvalue(res, i, 14), NULL, 10);
        it.cancelled = (uint32_t)strtoul(PQgetvalue(res, i, 15), NULL, 10);
        it.timed_out = PQgetvalue(res, i, 16)[0] == 't';
        rc = cb(&it, ud);
    }
out:
    PQclear(res);
    store__buf_release(&agents);
    store__buf_release(&statuses);
    return rc;
}
