/*
 * blob.c: files for kscore copy (migration 10: blob_parts, blob_files),
 * named by their SHA-256 and kept in parts of KS_BLOB_PART_BYTES. The
 * broker (broker/blob.c) writes the parts an operator uploads, checks the
 * whole against its name, marks it complete, and reads parts back for the
 * agents that copy it. A complete file's parts never change.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "store_int.h"

/* One statement that returns no rows. 0 or a store error. */
static int
blob_command(struct store *s, const char *sql, const struct store__params *p)
{
    PGresult *res = PQexecParams(s->conn, sql, p->n, NULL, p->val, p->len,
                                 p->fmt, 0);
    int rc = 0;
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        rc = store__pg_error(s, res, NULL);
    PQclear(res);
    return rc;
}

int
store_blob_put(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
               uint32_t part, const void *data, size_t len)
{
    struct store__params p = {0};
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_i64(&p, part);
    store__p_bin(&p, len ? data : "", len);
    /* Until the file is complete a part may be sent again (a retry, or a
     * fresh upload after a mismatch); after, it is the record. */
    return blob_command(
        s,
        "INSERT INTO blob_parts (sha256, part, data)"
        " VALUES ($1, $2::int, $3)"
        " ON CONFLICT (sha256, part) DO UPDATE SET data = EXCLUDED.data"
        " WHERE NOT EXISTS (SELECT 1 FROM blob_files f"
        "                   WHERE f.sha256 = EXCLUDED.sha256)",
        &p);
}

int
store_blob_complete(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                    uint64_t *size_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    res = PQexecParams(s->conn,
                       "SELECT size FROM blob_files WHERE sha256 = $1", p.n,
                       NULL, p.val, p.len, p.fmt, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        rc = store__read_error(s, res);
    else if (PQntuples(res) == 0)
        rc = 0;
    else {
        if (size_out)
            *size_out = strtoull(PQgetvalue(res, 0, 0), NULL, 10);
        rc = 1;
    }
    PQclear(res);
    return rc;
}

int
store_blob_read(struct store *s, const uint8_t sha256[KS_SHA256_BYTES],
                uint32_t part, uint8_t **data_out, size_t *len_out)
{
    struct store__params p = {0};
    PGresult *res;
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_i64(&p, part);
    res = PQexecParams(s->conn,
                       "SELECT data FROM blob_parts"
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
        else if (len > KS_BLOB_PART_BYTES)
            rc = KS_ETOOBIG;
        else {
            memcpy(buf, PQgetvalue(res, 0, 0), len);
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
                         const char *operator_)
{
    struct store__params p = {0};
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    store__p_i64(&p, (int64_t)size);
    store__p_text(&p, operator_ ? operator_ : "");
    return blob_command(s,
                        "INSERT INTO blob_files (sha256, size, operator)"
                        " VALUES ($1, $2::bigint, $3)"
                        " ON CONFLICT (sha256) DO NOTHING",
                        &p);
}

int
store_blob_drop(struct store *s, const uint8_t sha256[KS_SHA256_BYTES])
{
    struct store__params p = {0};
    int rc;

    if ((rc = store__ready(s)))
        return rc;
    store__p_bin(&p, sha256, KS_SHA256_BYTES);
    return blob_command(s,
                        "DELETE FROM blob_parts WHERE sha256 = $1"
                        " AND NOT EXISTS (SELECT 1 FROM blob_files f"
                        "                 WHERE f.sha256 = $1)",
                        &p);
}
