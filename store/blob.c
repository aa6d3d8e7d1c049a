/*
 * blob.c: files for kscore copy (migrations 10, 11 and 14: blob_parts,
 * blob_files, blob_usage, blob_owners, blob_proofs), named by their
 * SHA-256 and kept in parts of
 * KS_BLOB_PART_BYTES. The broker (broker/blob.c) writes the parts an
 * operator uploads, under that operator's bound and everyone's, checks
 * the whole against its name, marks it complete, and reads parts back for
 * the agents that copy it; its scanner expires what is no longer used. A
 * complete file's parts never change.
 *
 * Every statement here is one short transaction: the bounds and sums live
 * in SQL functions (migration 11) that lock the '*' row of blob_usage
 * first, and the checking of a whole file (seconds for 256 MiB) happens
 * outside any transaction, confirmed at the commit by the parts' ver.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store_int.h"

/* Parts deleted per transaction when a file's parts are dropped at once
 * (store_blob_drop): 32 MiB, so that no drop is a long transaction. */
#define DROP_PARTS_PER_TX 64

/* Column col of row 0 of a text result, a number >= 0. */
static uint64_t
text_u64(const PGresult *res, int col)
{
    return strtoull(PQgetvalue(res, 0, col), NULL, 10);
}

/* One statement whose one row's first column is a number: *out. 0 or a
 * store error (KS_ENOTFOUND: no row). */
static int
blob_number(struct store *s, const char *sql, const struct store__params *p,
            int64_t *out)
{
    PGresult *res = PQexecParams(s->conn, sql, p->n, NULL, p->val, p->len,
                                 p->fmt, 0);
    int rc = 0;
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        rc = store__pg_error(s, res, NULL);
    else if (PQntuples(res) == 0 || PQgetisnull(res, 0, 0))
        rc = KS_ENOTFOUND;
    else
        *out = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
    return rc;
}

/* $1..$4 of a part's statements: the file, the part's number, its bytes
 * and the operator who sent them. */
static void
part_params(struct store__params *p, const uint8_t *sha256, uint32_t part,
            const void *data, size_t len, const char *operator_)
{
    store__p_bin(p, sha256, KS_SHA256_BYTES);
    store__p_i64(p, part);
    store__p_bin(p, len ? data : "", len);
    store__p_text(p, operator_);
}

int
store_blob_put(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
               uint32_t part, const void *data, size_t len,
               const char *operator_, const struct store_blob_bounds *bounds,
               struct store_blob_refusal *refusal_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    part_params(&p, sha256, part, data, len, operator_);
    store__p_i64(&p, (int64_t)bounds->operator_bytes);
    store__p_i64(&p, (int64_t)bounds->total_bytes);
    res = PQexecParams(s->conn,
                       "SELECT o_bound, o_used FROM kscore_blob_put($1,"
                       " $2::int, $3, $4, $5::bigint, $6::bigint)",
                       p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        rc = store__pg_error(s, res, NULL);
    } else if (!PQgetisnull(res, 0, 0)) {
        refusal_out->bound = strcmp(PQgetvalue(res, 0, 0), "total") == 0
                                 ? STORE_BLOB_OVER_TOTAL
                                 : STORE_BLOB_OVER_OPERATOR;
        refusal_out->used_bytes =
            text_u64(res, 1);
        rc = KS_ETOOBIG;
    }
    PQclear(res);
    return rc;
}

int
store_blob_room(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                uint64_t size, const char *operator_,
                const struct store_blob_bounds *bounds,
                struct store_blob_refusal *refusal_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_text(&p, operator_);
    /* What is held now, and how much of it is this file's parts already
     * (sent again, they replace themselves). */
    res = PQexecParams(
        s->conn,
        "SELECT coalesce((SELECT bytes FROM blob_usage"
        "                 WHERE operator = $2), 0),"
        "       coalesce((SELECT sum(octet_length(data)) FROM blob_parts"
        "                 WHERE sha256 = $1 AND operator = $2), 0),"
        "       coalesce((SELECT bytes FROM blob_usage"
        "                 WHERE operator = '*'), 0),"
        "       coalesce((SELECT sum(octet_length(data)) FROM blob_parts"
        "                 WHERE sha256 = $1), 0)",
        p.n, NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        rc = store__read_error(s, res);
    } else {
        uint64_t mine = text_u64(res, 0);
        uint64_t mine_here = text_u64(res, 1);
        uint64_t total = text_u64(res, 2);
        uint64_t total_here = text_u64(res, 3);
        if (mine - mine_here + size > bounds->operator_bytes) {
            refusal_out->bound = STORE_BLOB_OVER_OPERATOR;
            refusal_out->used_bytes = mine;
            rc = KS_ETOOBIG;
        } else if (total - total_here + size > bounds->total_bytes) {
            refusal_out->bound = STORE_BLOB_OVER_TOTAL;
            refusal_out->used_bytes = total;
            rc = KS_ETOOBIG;
        }
    }
    PQclear(res);
    return rc;
}

int
store_blob_complete(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                    const char *operator_, uint64_t *size_out)
{
    struct store__params p = {0};
    int64_t size = 0;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_text(&p, operator_);
    /* A use: the file is kept store_blob_expire's files_unused_us from
     * now. Only its owners' uses count. */
    rc = blob_number(s,
                     "UPDATE blob_files f SET used_at = now()"
                     " WHERE f.sha256 = $1 AND EXISTS (SELECT 1 FROM"
                     " blob_owners o WHERE o.sha256 = f.sha256 AND"
                     " o.operator = $2) RETURNING size",
                     &p, &size);
    if (rc == KS_ENOTFOUND) {
        /* Not operator_'s: stored at all? */
        rc = blob_number(s,
                         "SELECT size FROM blob_files WHERE sha256 = $1"
                         " AND $2::text IS NOT NULL",
                         &p, &size);
        if (rc == KS_ENOTFOUND)
            return 0;
        if (rc)
            return rc;
        if (size_out)
            *size_out = (uint64_t)size;
        return 2;
    }
    if (rc)
        return rc;
    if (size_out)
        *size_out = (uint64_t)size;
    return 1;
}

int
store_blob_prove(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                 uint32_t part, const void *data, size_t len, uint32_t n,
                 bool commit, bool bad, const char *operator_)
{
    struct store__params p = {0};
    int64_t v = 0;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    part_params(&p, sha256, part, data, len, operator_);
    store__p_i64(&p, n);
    store__p_bool(&p, commit);
    store__p_bool(&p, bad);
    rc = blob_number(s,
                     "SELECT kscore_blob_prove($1, $2::int, $3, $4,"
                     " $5::int, $6::bool, $7::bool)",
                     &p, &v);
    if (rc)
        return rc;
    return v < 0 ? -EBADMSG : (int)v;
}

int
store_blob_read(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                uint32_t part, uint8_t **data_out, size_t *len_out,
                uint64_t *ver_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_i64(&p, part);
    res = PQexecParams(s->conn,
                       "SELECT data, coalesce(ver, 0) FROM blob_parts"
                       " WHERE sha256 = $1 AND part = $2::int",
                       p.n, NULL, p.val, p.len, p.fmt, 1);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        rc = store__read_error(s, res);
    } else if (PQntuples(res) == 0) {
        rc = KS_ENOTFOUND;
    } else {
        size_t len = (size_t)PQgetlength(res, 0, 0);
        uint8_t *buf = malloc(len ? len : 1);
        if (!buf)
            rc = -ENOMEM;
        else if (len > KS_BLOB_PART_BYTES || PQgetlength(res, 0, 1) != 8)
            rc = KS_ETOOBIG;
        else {
            memcpy(buf, PQgetvalue(res, 0, 0), len);
            if (ver_out)
                *ver_out = (uint64_t)store__rd_i64(PQgetvalue(res, 0, 1));
            *data_out = buf;
            *len_out = len;
            buf = NULL;
        }
        free(buf);
    }
    PQclear(res);
    return rc;
}

int
store_blob_mark_complete(struct store *s,
                         const uint8_t sha256[KS_SHA256_BYTES], uint64_t size,
                         const char *operator_, const uint64_t *vers,
                         uint32_t n)
{
    struct store__params p = {0};
    char *arr = malloc((size_t)n * 21 + 3), *at = arr;
    int64_t ok = 0;
    int rc;

    if (!arr)
        return -ENOMEM;
    *at++ = '{';
    for (uint32_t i = 0; i < n; i++)
        at += sprintf(at, "%s%llu", i ? "," : "", (unsigned long long)vers[i]);
    strcpy(at, "}");
    if ((rc = store__ready(s)) == 0) {
        store__p_bin(&p, sha256, KS_SHA256_BYTES);
        store__p_i64(&p, (int64_t)size);
        store__p_text(&p, operator_ ? operator_ : "");
        store__p_text(&p, arr);
        rc = blob_number(s,
                         "SELECT kscore_blob_commit($1, $2::bigint, $3,"
                         " $4::bigint[])::int",
                         &p, &ok);
    }
    free(arr);
    return rc ? rc : (int)ok;
}

/* kscore_blob_forget: up to limit parts, or a store error. */
static int
forget(struct store *s, const uint8_t *sha256, const char *operator_,
       int64_t before_us, unsigned limit)
{
    struct store__params p = {0};
    int64_t n = 0;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    if (sha256)
        store__p_bin(&p, sha256, KS_SHA256_BYTES);
    else
        store__p_null(&p);
    store__p_text(&p, operator_);
    store__p_i64(&p, before_us);
    store__p_i64(&p, limit);
    rc = blob_number(s,
                     "SELECT kscore_blob_forget($1, 0, $2, CASE WHEN"
                     " $3::bigint = 0 THEN NULL ELSE now() - $3::bigint *"
                     " interval '1 microsecond' END, $4::int)",
                     &p, &n);
    return rc ? rc : (int)n;
}

int
store_blob_drop(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                const char *operator_)
{
    int n;
    do
        n = forget(s, sha256, operator_, 0, DROP_PARTS_PER_TX);
    while (n == DROP_PARTS_PER_TX);
    return n < 0 ? n : 0;
}

int
store_blob_expire(struct store *s, int64_t files_unused_us,
                  int64_t parts_unwritten_us, unsigned limit,
                  unsigned *files_out, unsigned *parts_out)
{
    struct store__params p = {0};
    int64_t files = 0;
    int rc, parts;

    BUG_ON(files_unused_us <= 0 || parts_unwritten_us <= 0 || limit == 0);
    if ((rc = store__ready(s)))
        return rc;
    store__p_i64(&p, files_unused_us);
    store__p_i64(&p, limit);
    /*
     * A file is in use while an open batch names it: its BatchRequested
     * (the first event of the batch's stream, version 1) holds the spec,
     * and the spec each file's SHA-256 as the 32 bytes themselves (a
     * protobuf bytes field is its bytes), so a batch names a file when
     * those bytes are in its event. A batch is open while its lease is
     * not 'infinity' (migration 2: the lease row is written with
     * BatchRequested, set to 'infinity' when the batch ends). A batch
     * accepted but not yet recorded is not seen here: its acceptance
     * marked the file used (store_blob_complete), and the row lock taken
     * here sees that update (a touched row no longer matches used_at <).
     * A file deleted here leaves its parts not complete and long written:
     * the next step takes them.
     */
    rc = blob_number(
        s,
        "WITH gone AS ("
        " DELETE FROM blob_files f WHERE f.sha256 IN ("
        "  SELECT c.sha256 FROM blob_files c"
        "  WHERE c.used_at < now() - $1::bigint * interval '1 microsecond'"
        "    AND NOT EXISTS (SELECT 1 FROM batch_leases l"
        "      JOIN events e ON e.stream_id = l.batch_id AND e.version = 1"
        "      WHERE l.lease_until < 'infinity'"
        "        AND position(c.sha256 IN e.data) > 0)"
        "  ORDER BY c.used_at LIMIT $2::int"
        "  FOR UPDATE OF c SKIP LOCKED)"
        " RETURNING 1)"
        " SELECT count(*) FROM gone",
        &p, &files);
    if (rc)
        return rc;
    parts = forget(s, NULL, NULL, parts_unwritten_us, limit);
    if (parts < 0)
        return parts;
    /* The parts of a stored file that an operator began to send again
     * and never finished (kscore_blob_prove): as unfinished uploads. */
    int64_t proofs = 0;
    struct store__params q = {0};
    store__p_i64(&q, parts_unwritten_us);
    store__p_i64(&q, limit);
    rc = blob_number(
        s,
        "WITH gone AS (DELETE FROM blob_proofs WHERE ctid IN ("
        " SELECT ctid FROM blob_proofs WHERE sent_at < now() -"
        " $1::bigint * interval '1 microsecond' LIMIT $2::int)"
        " RETURNING 1) SELECT count(*) FROM gone",
        &q, &proofs);
    if (rc)
        return rc;
    if (proofs > parts)
        parts = (int)proofs;
    *files_out = (unsigned)files;
    *parts_out = (unsigned)parts;
    return 0;
}
