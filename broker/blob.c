/*
 * blob.c: the files of kscore copy (docs/scripts-and-files.md "Pushing files").
 *
 *  kscore.api.v1.upload.<operator>  UploadRequest: an operator sends a
 *      file in parts (KS_BLOB_PART_BYTES), then commits it: the broker
 *      reads the parts back, checks their SHA-256 against the file's name
 *      and marks it complete (store/blob.c). A commit with no data of a
 *      file already complete that this operator uploaded answers at
 *      once: a file is stored once, however often and to however many
 *      agents it is copied. Another operator's is "not there": sent
 *      whole, each part the same as the stored one, it is this
 *      operator's too, and nothing is stored again (prove). A copy names
 *      only its operator's files.
 *  kscore.api.v1.fetch.agent-<id>   FetchRequest: an agent reads a part of
 *      a file of a copy it runs: only the command's own agent (the
 *      subject NATS let it publish on), for the attempt it claimed, while
 *      the command runs, and only a file the command names. The agent
 *      checks the whole against the SHA-256 signed into the command.
 *
 * Who may upload: only an operator the policy lets copy to some agent
 * (broker__policy_check_upload); any other is refused before anything is
 * stored, with a RequestDenied (bounded as every annotation: budget.c).
 * How much: each operator's parts (unfinished uploads and files) within
 * copy_operator_bytes, everyone's within copy_total_bytes, checked in the
 * transaction that writes each part (store_blob_put), so parallel
 * uploads, through any broker, cannot pass them; a refused upload's parts
 * are dropped at once. How long: the scanner deletes files no one
 * uploaded or copied for copy_keep that no open batch names, and the parts
 * of uploads not finished within copy_upload_keep (broker__blob_expire).
 *
 * One store connection, opened at the first request, under blob_mu: an
 * upload or a fetch never waits behind get or events (st_misc).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "broker_int.h"

/*
 * Reads every part back and checks them against sha256 and size: 1 when
 * they make that file (vers[i]: the version of part i read), 0 when a part
 * is missing (*missing set), -EBADMSG when they make another file, or a
 * store error. No transaction is held meanwhile (seconds for 256 MiB):
 * store_blob_mark_complete confirms the versions.
 */
static int
verify(struct store *st, const uint8_t *sha256, uint64_t size,
       uint32_t *missing, uint64_t *vers)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    int rc = 1;

    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return KS_EINTERNAL;
    }
    for (uint32_t i = 0; i < ks_blob_parts(size) && rc == 1; i++) {
        uint8_t *data = NULL;
        size_t len = 0;
        int r = store_blob_read(st, sha256, i, &data, &len, &vers[i]);
        if (r == KS_ENOTFOUND) {
            *missing = i;
            rc = 0;
        } else if (r) {
            rc = r;
        } else if (len != ks_blob_part_len(size, i) ||
                   EVP_DigestUpdate(ctx, data, len) != 1) {
            rc = -EBADMSG;
        }
        free(data);
    }
    if (rc == 1 &&
        (EVP_DigestFinal_ex(ctx, md, &n) != 1 || n != KS_SHA256_BYTES ||
         memcmp(md, sha256, KS_SHA256_BYTES) != 0))
        rc = -EBADMSG;
    EVP_MD_CTX_free(ctx);
    return rc;
}

/* What the bounds are (broker.h: 0 in the options is the default). */
static struct store_blob_bounds
bounds_of(const struct broker *b)
{
    struct store_blob_bounds bd = {b->opts->copy_operator_bytes,
                                   b->opts->copy_total_bytes};
    if (!bd.operator_bytes)
        bd.operator_bytes = BROKER_COPY_OPERATOR_BYTES;
    if (!bd.total_bytes)
        bd.total_bytes = BROKER_COPY_TOTAL_BYTES;
    return bd;
}

static uint64_t
keep_ms(const struct broker *b)
{
    return b->opts->copy_keep_ms ? b->opts->copy_keep_ms
                                 : BROKER_COPY_KEEP_MS;
}

static uint64_t
upload_keep_ms(const struct broker *b)
{
    return b->opts->copy_upload_keep_ms ? b->opts->copy_upload_keep_ms
                                        : BROKER_COPY_UPLOAD_KEEP_MS;
}

/* ms as the config file writes it: "24h", "90m", "2s", "1500ms". */
static void
duration_text(uint64_t ms, char *buf, size_t len)
{
    if (ms % 3600000 == 0)
        snprintf(buf, len, "%lluh", (unsigned long long)(ms / 3600000));
    else if (ms % 60000 == 0)
        snprintf(buf, len, "%llum", (unsigned long long)(ms / 60000));
    else if (ms % 1000 == 0)
        snprintf(buf, len, "%llus", (unsigned long long)(ms / 1000));
    else
        snprintf(buf, len, "%llums", (unsigned long long)ms);
}

#define MIB(n) ((double)(n) / (1024.0 * 1024.0))

/* Answers an upload that would pass a bound: which one (its config key),
 * what is held, how long things are kept. dropped: the parts of the file
 * sent so far were dropped. */
static void
reply_over(struct broker *b, natsMsg *msg, const char *op,
           const struct store_blob_refusal *r, uint64_t size, bool dropped)
{
    struct store_blob_bounds bd = bounds_of(b);
    char why[700], keep[32], upload_keep[32];
    int n;

    duration_text(keep_ms(b), keep, sizeof(keep));
    duration_text(upload_keep_ms(b), upload_keep, sizeof(upload_keep));
    if (r->bound == STORE_BLOB_OVER_OPERATOR)
        n = snprintf(why, sizeof(why),
                     "upload refused: operator '%s' holds %.1f MiB of files "
                     "for kscore copy, and a file of %.1f MiB would pass its "
                     "bound of %.1f MiB (copy_operator_mib in the broker's "
                     "config)",
                     op, MIB(r->used_bytes), MIB(size),
                     MIB(bd.operator_bytes));
    else
        n = snprintf(why, sizeof(why),
                     "upload refused: the broker holds %.1f MiB of files for "
                     "kscore copy, and a file of %.1f MiB would pass the "
                     "bound of all operators together, %.1f MiB "
                     "(copy_total_mib in the broker's config)",
                     MIB(r->used_bytes), MIB(size), MIB(bd.total_bytes));
    if (n > 0 && (size_t)n < sizeof(why))
        snprintf(why + n, sizeof(why) - (size_t)n,
                 "%s; a file is kept %s after its last upload or copy "
                 "(copy_keep), an unfinished upload %s (copy_upload_keep)",
                 dropped ? "; the parts of it sent were dropped" : "", keep,
                 upload_keep);
    ks_log(KS_LOG_WARN, "upload refused: past a bound of kscore copy's files",
           KS_S("operator", op),
           KS_S("bound", r->bound == STORE_BLOB_OVER_OPERATOR
                             ? "copy_operator_mib"
                             : "copy_total_mib"),
           KS_I("held_bytes", (int64_t)r->used_bytes),
           KS_I("file_bytes", (int64_t)size));
    broker__reply_error(b, msg, &ks__upload_reply__descriptor, KS_ETOOBIG,
                        why);
}

/* Answers an upload whose parts do not make the file it names. */
static void
reply_not_the_file(struct broker *b, natsMsg *msg, const char *hex,
                   uint64_t size)
{
    char why[300];
    snprintf(why, sizeof(why),
             "the parts sent are not the file of sha256 %s and %llu bytes: "
             "they were dropped, send it again",
             hex, (unsigned long long)size);
    broker__reply_error(b, msg, &ks__upload_reply__descriptor, KS_EINVAL,
                        why);
}

/* Refuses (answers) a part that is not one of the file's: true then. */
static bool
bad_part(struct broker *b, natsMsg *msg, const Ks__UploadRequest *req)
{
    char why[300];
    uint32_t n = ks_blob_parts(req->size);
    if (req->part < n &&
        req->data.len == ks_blob_part_len(req->size, req->part))
        return false;
    snprintf(why, sizeof(why),
             "UploadRequest.part: part %u of %zu bytes is not "
             "allowed: a file of %llu bytes has %u part(s) of %d "
             "bytes (the last one shorter)",
             req->part, req->data.len, (unsigned long long)req->size, n,
             KS_BLOB_PART_BYTES);
    broker__reply_error(b, msg, &ks__upload_reply__descriptor, KS_EINVAL,
                        why);
    return true;
}

/*
 * An upload by op of a file stored already (stored_size bytes) that op
 * does not own: a file is stored once, but a copy may name it only for
 * an operator who showed it has the bytes (issue 21: knowing the SHA-256
 * and size, which kscore get shows every reader of a copy, was enough to
 * copy another operator's file to an agent of one's own, and the first
 * question of an upload told whether anyone had stored some content).
 * Answered as an upload of a file the broker does not have: the first
 * question "not complete" (within the bounds: store_blob_room), so the
 * client sends every part; each part "taken", compared with the stored
 * one and noted (store_blob_prove); the commit complete when all were
 * the stored bytes (op owns the file from now on, nothing is stored
 * again), the same refusal as a file whose parts do not make its
 * SHA-256 when one was not. Answers msg.
 */
static void
prove(struct broker *b, struct store *st, natsMsg *msg,
      const Ks__UploadRequest *req, const char *op, uint64_t stored_size,
      const char *hex)
{
    Ks__UploadReply r = KS__UPLOAD_REPLY__INIT;
    struct store_blob_bounds bounds = bounds_of(b);
    struct store_blob_refusal over = {0};
    uint32_t n = ks_blob_parts(req->size);
    char why[600];
    int rc;

    if (n && req->commit && !req->data.len) {
        /* The first question, as for a file not there. */
        rc = store_blob_room(st, req->sha256.data, req->size, op, &bounds,
                             &over);
        if (rc == KS_ETOOBIG) {
            reply_over(b, msg, op, &over, req->size, false);
            return;
        }
        if (rc)
            goto store_err;
        goto reply;
    }
    if (n && bad_part(b, msg, req))
        return;
    rc = store_blob_prove(st, req->sha256.data, req->part, req->data.data,
                          req->data.len, n, req->commit,
                          req->size != stored_size, op);
    if (rc == -EBADMSG) {
        reply_not_the_file(b, msg, hex, req->size);
        return;
    }
    if (rc < 0)
        goto store_err;
    r.complete = rc == 1;
    if (r.complete)
        ks_log(KS_LOG_INFO,
               "file for kscore copy sent whole by another operator (stored "
               "once)",
               KS_S("sha256", hex), KS_I("bytes", (int64_t)stored_size),
               KS_S("operator", op));
reply:
    evt_publish_reply(b->nc, natsMsg_GetReply(msg), &r.base);
    return;
store_err:
    broker__store_error(st, rc, why, sizeof(why));
    broker__reply_error(b, msg, &ks__upload_reply__descriptor, rc, why);
}

static void
handle_upload(struct broker *b, struct store *st, natsMsg *msg)
{
    Ks__UploadRequest *req = NULL;
    Ks__UploadReply r = KS__UPLOAD_REPLY__INIT;
    const char *op = broker__operator_of(msg);
    struct store_blob_bounds bounds = bounds_of(b);
    struct store_blob_refusal over = {0};
    char why[600], hex[2 * KS_SHA256_BYTES + 1];
    uint64_t *vers = NULL;
    uint32_t missing = 0;
    int rc;

    rc = broker__unpack_request(msg, &ks__upload_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc == 0 &&
        (rc = broker__policy_check_upload(b->policy, op, why,
                                          sizeof(why))) != 0)
        broker__record_denied(b, st, op, NULL, NULL, why);
    if (rc) {
        broker__reply_error(b, msg, &ks__upload_reply__descriptor, rc, why);
        goto out;
    }
    ks_hex(req->sha256.data, KS_SHA256_BYTES, hex);
    uint64_t stored_size = 0;
    rc = store_blob_complete(st, req->sha256.data, op, &stored_size);
    if (rc == 1) {
        r.complete = 1; /* stored already, its own: nothing to send */
        goto reply;
    }
    if (rc < 0)
        goto store_err;
    if (rc == 2) {
        /* Stored, but another operator's: op names it once it has sent
         * it whole, each part the same bytes (nothing stored again). */
        prove(b, st, msg, req, op, stored_size, hex);
        goto out;
    }
    if (!req->commit || req->data.len) {
        if (bad_part(b, msg, req))
            goto out;
        rc = store_blob_put(st, req->sha256.data, req->part, req->data.data,
                            req->data.len, op, &bounds, &over);
        if (rc == KS_ETOOBIG) {
            /* Its other parts would only hold the operator's room until
             * they expire. */
            store_blob_drop(st, req->sha256.data, op);
            reply_over(b, msg, op, &over, req->size, true);
            goto out;
        }
        if (rc)
            goto store_err;
    }
    if (req->commit) {
        if (!(vers = calloc(ks_blob_parts(req->size) + 1, sizeof(*vers)))) {
            rc = -ENOMEM;
            goto store_err;
        }
        rc = verify(st, req->sha256.data, req->size, &missing, vers);
        if (rc == 0 && !req->data.len) {
            /* Asked before an upload: refused now if it cannot fit, not
             * after 256 MiB were sent. */
            rc = store_blob_room(st, req->sha256.data, req->size, op,
                                 &bounds, &over);
            if (rc == KS_ETOOBIG) {
                reply_over(b, msg, op, &over, req->size, false);
                goto out;
            }
            if (rc)
                goto store_err;
            goto reply; /* not there: complete stays false */
        }
        if (rc == 0)
            goto reply; /* not all there: complete stays false */
        if (rc == 1) {
            rc = store_blob_mark_complete(st, req->sha256.data, req->size,
                                          op, vers,
                                          ks_blob_parts(req->size));
            if (rc == 0) {
                snprintf(why, sizeof(why),
                         "the parts of the file of sha256 %s changed while "
                         "they were checked (another upload of it?): send "
                         "it again",
                         hex);
                broker__reply_error(b, msg, &ks__upload_reply__descriptor,
                                    KS_ECONFLICT, why);
                goto out;
            }
            if (rc == 1)
                rc = 0;
        }
        if (rc == -EBADMSG) {
            store_blob_drop(st, req->sha256.data, NULL);
            reply_not_the_file(b, msg, hex, req->size);
            goto out;
        }
        if (rc)
            goto store_err;
        r.complete = 1;
        ks_log(KS_LOG_INFO, "file stored for kscore copy",
               KS_S("sha256", hex), KS_I("bytes", (int64_t)req->size),
               KS_S("operator", op));
    }
reply:
    evt_publish_reply(b->nc, natsMsg_GetReply(msg), &r.base);
    goto out;
store_err:
    broker__store_error(st, rc, why, sizeof(why));
    broker__reply_error(b, msg, &ks__upload_reply__descriptor, rc, why);
out:
    free(vers);
    if (req)
        ks__upload_request__free_unpacked(req, NULL);
}

/* The size of the file sha256 names in the copy of the command whose
 * CommandRequested is rev (store_read_stream's callback; ud: struct
 * named). */
struct named {
    const uint8_t *sha256;
    bool found;
    uint64_t size;
};

static int
find_file(const Ks__RecordedEvent *rev, void *ud)
{
    struct named *n = ud;
    const Ks__Event *ev = rev->event;
    if (!ev || !ev->command || !ev->command->spec || !ev->command->spec->copy)
        return 0;
    const Ks__CopySpec *cp = ev->command->spec->copy;
    for (size_t i = 0; i < cp->n_files; i++)
        if (cp->files[i]->sha256.len == KS_SHA256_BYTES &&
            memcmp(cp->files[i]->sha256.data, n->sha256, KS_SHA256_BYTES) ==
                0) {
            n->found = true;
            n->size = cp->files[i]->size;
        }
    return 0;
}

/*
 * The parts fetched lately, by a hash of (command, attempt, file, part):
 * an agent fetches each part of its copy once (again after a lost reply),
 * so a part asked for again is charged to the agent's share of claims and
 * fetches that fail (budget.c): an agent re-fetching its own copy's parts
 * again and again (each a read of PostgreSQL) is answered busy past its
 * share, as one fetching made-up copies. 65536 slots (512 KiB,
 * b->blob_fetched, under blob_mu): a part pushed out by others is charged
 * no more.
 */
#define FETCHED_SLOTS 65536

/* true if this part was fetched lately (and notes it); false too when
 * there is no memory for the slots. Under blob_mu. */
static bool
fetched_again(struct broker *b, const Ks__FetchRequest *req)
{
    if (!b->blob_fetched &&
        !(b->blob_fetched = calloc(FETCHED_SLOTS, sizeof(uint64_t))))
        return false;
    uint64_t h = KS_FNV1A_INIT;
    h = ks_fnv1a(h, req->command_id, strlen(req->command_id) + 1);
    h = ks_fnv1a(h, &req->attempt, sizeof(req->attempt));
    h = ks_fnv1a(h, req->sha256.data, req->sha256.len);
    h = ks_fnv1a(h, &req->part, sizeof(req->part)) | 1;
    uint64_t *slot = &b->blob_fetched[h & (FETCHED_SLOTS - 1)];
    bool again = *slot == h;
    *slot = h;
    return again;
}

/* Answers a fetch: the code it was refused with, 1 when it was served but
 * fetched lately already (fetched_again), or 0 (served, or the store
 * failed: not the agent's doing). */
static int
handle_fetch(struct broker *b, struct store *st, natsMsg *msg)
{
    Ks__FetchRequest *req = NULL;
    Ks__FetchReply r = KS__FETCH_REPLY__INIT;
    Ks__CommandView *v = NULL;
    const char *who = broker__operator_of(msg);
    char why[600], want[EVT_AGENT_ID_MAX + 8], stream[64];
    struct named n = {0};
    uint8_t *data = NULL;
    size_t len = 0;
    int rc, store_rc = 0, refused = 0;

    rc = broker__unpack_request(msg, &ks__fetch_request__descriptor,
                                (ProtobufCMessage **)&req, why, sizeof(why));
    if (rc)
        goto fail;
    /* Who asks is what NATS vouches for (as a claim: broker.c on_claim),
     * never a field of the message. */
    snprintf(want, sizeof(want), "agent-%s", req->agent_id);
    if (strcmp(who, want) != 0 && strcmp(who, "broker") != 0) {
        snprintf(why, sizeof(why),
                 "denied: '%s' may not fetch for agent '%s' (only agent-%s "
                 "may)",
                 who, req->agent_id, req->agent_id);
        rc = KS_EDENIED;
        goto fail;
    }
    rc = store_get_command(st, req->command_id, &v);
    if (rc == 0 && (strcmp(v->agent_id, req->agent_id) != 0 ||
                    v->status != KS__COMMAND_STATUS__RUNNING ||
                    v->attempt != req->attempt))
        rc = KS_ENOTFOUND;
    if (rc == 0) {
        n.sha256 = req->sha256.data;
        snprintf(stream, sizeof(stream), "command-%s", req->command_id);
        rc = store_read_stream(st, stream, 0, 1, find_file, &n);
        if (rc == 0 && !n.found)
            rc = KS_ENOTFOUND;
    }
    if (rc == KS_ENOTFOUND) {
        snprintf(why, sizeof(why),
                 "denied: command %s is no copy of this file that agent '%s' "
                 "runs (attempt %u)",
                 req->command_id, req->agent_id, req->attempt);
        rc = KS_EDENIED;
        goto fail;
    }
    if (rc)
        goto store_fail;
    if (req->part >= ks_blob_parts(n.size)) {
        snprintf(why, sizeof(why), "FetchRequest.part: %u is past the end "
                 "of a file of %llu bytes", req->part,
                 (unsigned long long)n.size);
        rc = KS_EINVAL;
        goto fail;
    }
    rc = store_blob_read(st, req->sha256.data, req->part, &data, &len, NULL);
    if (rc == KS_ENOTFOUND) {
        char hex[2 * KS_SHA256_BYTES + 1];
        ks_hex(req->sha256.data, KS_SHA256_BYTES, hex);
        snprintf(why, sizeof(why),
                 "part %u of the file of sha256 %s is not in the store (it "
                 "was deleted: a new kscore copy uploads it again)",
                 req->part, hex);
        goto fail;
    }
    if (rc)
        goto store_fail;
    r.data.data = data;
    r.data.len = len;
    evt_publish_reply(b->nc, natsMsg_GetReply(msg), &r.base);
    refused = fetched_again(b, req) ? 1 : 0;
    goto out;
store_fail:
    broker__store_error(st, rc, why, sizeof(why));
    /* The store's failure, not the agent's doing. */
    store_rc = rc;
fail:
    broker__reply_error(b, msg, &ks__fetch_reply__descriptor, rc, why);
    if (store_rc == 0)
        refused = rc;
out:
    free(data);
    if (v)
        ks__command_view__free_unpacked(v, NULL);
    if (req)
        ks__fetch_request__free_unpacked(req, NULL);
    return refused;
}

void
broker__on_blob(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                void *ud)
{
    struct broker *b = ud;
    const char *subj = natsMsg_GetSubject(msg);
    char *errmsg = NULL;

    (void)nc;
    (void)sub;
    pthread_mutex_lock(&b->blob_mu);
    if (!b->st_blob &&
        store_open(b->opts->db_conninfo, &b->st_blob, &errmsg) != 0) {
        char why[600];
        snprintf(why, sizeof(why), "cannot connect to PostgreSQL: %s",
                 errmsg ? errmsg : "?");
        broker__reply_error(b, msg,
                            broker__is_method(subj, EVT_API_UPLOAD)
                                ? &ks__upload_reply__descriptor
                                : &ks__fetch_reply__descriptor,
                            KS_EPGDOWN, why);
        b->st_blob = NULL;
    } else if (broker__is_method(subj, EVT_API_UPLOAD)) {
        handle_upload(b, b->st_blob, msg);
    } else if (broker__is_method(subj, EVT_API_FETCH)) {
        /* An agent's fetches that fail or ask again for a part it had
         * (fetched_again) share its claims' share (budget.c): past it,
         * answered busy (or dropped) without the store, so one agent cannot take this
         * thread's time (everyone's uploads and fetches, each identity in
         * its turn: fairq.c) with fetches of made-up copies or the same
         * parts again and again. */
        const char *who = broker__operator_of(msg);
        bool agent = strncmp(who, "agent-", 6) == 0;
        bool answer = true;
        if (agent && !broker__budget_ask_ok(b, who, &answer)) {
            if (answer)
                broker__reply_error(
                    b, msg, &ks__fetch_reply__descriptor, KS_EBUSY,
                    "busy: this agent's claims and fetches that failed or "
                    "were repeated are past its share: try again later");
        } else if (handle_fetch(b, b->st_blob, msg) != 0 && agent) {
            broker__budget_ask_failed(b, who);
        }
    }
    pthread_mutex_unlock(&b->blob_mu);
    free(errmsg);
    natsMsg_Destroy(msg);
}

int
broker__check_copy_files(struct broker *b, const Ks__CommandSpec *sp,
                         const char *op, char *why, size_t len)
{
    char hex[2 * KS_SHA256_BYTES + 1];
    int rc = 0;

    if (!sp || !sp->copy)
        return 0;
    pthread_mutex_lock(&b->blob_mu);
    char *errmsg = NULL;
    if (!b->st_blob &&
        store_open(b->opts->db_conninfo, &b->st_blob, &errmsg) != 0) {
        snprintf(why, len, "cannot connect to PostgreSQL: %s",
                 errmsg ? errmsg : "?");
        b->st_blob = NULL;
        rc = KS_EPGDOWN;
    }
    free(errmsg);
    for (size_t i = 0; rc == 0 && i < sp->copy->n_files; i++) {
        const Ks__CopyFile *f = sp->copy->files[i];
        uint64_t size = 0;
        int c = store_blob_complete(b->st_blob, f->sha256.data, op, &size);
        ks_hex(f->sha256.data, KS_SHA256_BYTES, hex);
        if (c < 0) {
            broker__store_error(b->st_blob, c, why, len);
            rc = c;
        } else if (c != 1 || size != f->size) {
            /* Another operator's file is not there for op (prove): the
             * same answer, so it tells nothing of what others stored. */
            snprintf(why, len,
                     "copy: no file of sha256 %s and %llu bytes ('%.128s') "
                     "was uploaded by operator '%s' (kscore copy uploads it "
                     "first: kscore.api.v1.upload)",
                     hex, (unsigned long long)f->size, f->name, op);
            rc = KS_EINVAL;
        }
    }
    pthread_mutex_unlock(&b->blob_mu);
    return rc;
}

/* store_blob_expire rounds: at most this many files and parts each (a
 * part is 512 KiB: 8 MiB per transaction), this many rounds per call. */
#define EXPIRE_BATCH 16
#define EXPIRE_ROUNDS 4
/* The longest wait between two calls (us). */
#define EXPIRE_PERIOD_US (10 * INT64_C(1000000))

int64_t
broker__blob_expire(struct broker *b, struct store *st)
{
    int64_t keep_us = (int64_t)keep_ms(b) * 1000;
    int64_t upload_keep_us = (int64_t)upload_keep_ms(b) * 1000;
    unsigned files = 0, parts = 0, f = 0, p = 0;
    bool more = false;
    int rc = 0;

    for (int i = 0; i < EXPIRE_ROUNDS; i++) {
        rc = store_blob_expire(st, keep_us, upload_keep_us, EXPIRE_BATCH, &f,
                               &p);
        if (rc)
            break;
        files += f;
        parts += p;
        more = f == EXPIRE_BATCH || p == EXPIRE_BATCH;
        if (!more)
            break;
    }
    if (files || parts)
        ks_log(KS_LOG_INFO,
               "kscore copy: deleted files nobody used for copy_keep and "
               "parts of uploads not finished within copy_upload_keep",
               KS_S("module", "scanner"), KS_I("files", files),
               KS_I("parts", parts));
    if (rc && rc != KS_EPGDOWN)
        ks_log(KS_LOG_WARN, "kscore copy: cannot delete expired files",
               KS_S("module", "scanner"), KS_ERR(rc));
    if (more && rc == 0)
        return 0; /* more is due: at the scanner's next turn */
    /* Often enough that nothing stays much past its keep. */
    int64_t period = EXPIRE_PERIOD_US;
    int64_t shortest = keep_us < upload_keep_us ? keep_us : upload_keep_us;
    if (shortest / 4 < period)
        period = shortest / 4;
    return period;
}
