/* Shared set-up of the fuzz targets: see fuzz_common.h. */
#include "fuzz_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sanitizer/allocator_interface.h>

const ProtobufCMessageDescriptor *const fuzz_wire_descs[] = {
    /* broker: requests and events */
    &ks__execute_request__descriptor,
    &ks__claim_request__descriptor,
    &ks__get_request__descriptor,
    &ks__events_request__descriptor,
    &ks__cancel_request__descriptor,
    &ks__agents_request__descriptor,
    &ks__batch_request__descriptor,
    &ks__list_request__descriptor,
    &ks__event__descriptor,
    /* agent: commands, cancels, its own registry entry */
    &ks__signed_command__descriptor,
    &ks__command__descriptor,
    &ks__cancel_command__descriptor,
    &ks__agent_info__descriptor,
    /* CLI and agent: replies */
    &ks__execute_reply__descriptor,
    &ks__claim_reply__descriptor,
    &ks__get_reply__descriptor,
    &ks__events_reply__descriptor,
    &ks__cancel_reply__descriptor,
    &ks__agents_reply__descriptor,
    &ks__batch_reply__descriptor,
    &ks__batch_progress__descriptor,
    &ks__list_reply__descriptor,
};
const size_t fuzz_n_wire_descs =
    sizeof(fuzz_wire_descs) / sizeof(fuzz_wire_descs[0]);

/* Not a secret: a key anyone can sign fuzz seeds with. */
static const uint8_t fixed_seed[32] = "kscore fuzz key, not a secret!!";

static struct evt_signer *signer;
static struct evt_verifier *verifier;

_Noreturn void
fuzz_die(const char *what)
{
    fprintf(stderr, "fuzz: %s\n", what);
    abort();
}

/* evt_signer_load() reads PEM files only: write the fixed key to one. */
static void
load_fixed_key(void)
{
    char dir[] = "/tmp/kscore-fuzz-XXXXXX", path[64];
    EVP_PKEY *k;
    FILE *f;
    int ok;

    k = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, fixed_seed,
                                     sizeof(fixed_seed));
    if (!k || !mkdtemp(dir))
        fuzz_die("cannot make the fixed key");
    snprintf(path, sizeof(path), "%s/key.pem", dir);
    f = fopen(path, "we");
    ok = f && PEM_write_PrivateKey(f, k, NULL, NULL, 0, NULL, NULL) == 1;
    if (f && fclose(f) != 0)
        ok = 0;
    EVP_PKEY_free(k);
    if (ok)
        ok = evt_signer_load(path, &signer) == 0;
    unlink(path);
    rmdir(dir);
    if (!ok || evt_verifier_new(&verifier) != 0 ||
        evt_verifier_add_signer(verifier, signer) != 0)
        fuzz_die("cannot load the fixed key");
}

const struct evt_signer *
fuzz_signer(void)
{
    if (!signer)
        load_fixed_key();
    return signer;
}

const struct evt_verifier *
fuzz_verifier(void)
{
    if (!verifier)
        load_fixed_key();
    return verifier;
}

void
fuzz_valid_command(Ks__Command *cmd, Ks__CommandSpec *spec)
{
    static char *argv[] = {"/bin/echo", "hello"};

    ks__command__init(cmd);
    ks__command_spec__init(spec);
    spec->n_argv = 2;
    spec->argv = argv;
    spec->timeout_ms = 5000;
    cmd->command_id = "0b7e8a3c-5f0e-4a6b-9a51-3d2c1f0e9b87";
    cmd->attempt = 1;
    cmd->agent_id = FUZZ_AGENT_ID;
    cmd->spec = spec;
    cmd->issued_at_us = FUZZ_NOW_US - 1000000;
    cmd->not_after_us = FUZZ_NOW_US + 60000000;
    cmd->operator_ = "fuzz";
    cmd->dispatch_version = 2;
}

void
fuzz_sign_command_bytes(const uint8_t *cmd_bytes, size_t cmd_len,
                        uint8_t **buf_out, size_t *len_out)
{
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    uint8_t sig[EVT_SIGNATURE_BYTES];

    if (evt_sign(fuzz_signer(), cmd_bytes, cmd_len, sig) != 0)
        fuzz_die("evt_sign failed");
    sc.command.data = (uint8_t *)cmd_bytes;
    sc.command.len = cmd_len;
    sc.signature.data = sig;
    sc.signature.len = sizeof(sig);
    sc.key_id = (char *)evt_signer_key_id(fuzz_signer());
    if (kproto_pack(&sc.base, buf_out, len_out) != 0)
        fuzz_die("kproto_pack failed");
}

void
fuzz_check_round_trip(const ProtobufCMessage *m)
{
    ProtobufCMessage *again = NULL;
    uint8_t *b1 = NULL, *b2 = NULL;
    size_t l1 = 0, l2 = 0;

    if (!protobuf_c_message_check(m))
        fuzz_die("decoded message fails protobuf_c_message_check");
    if (kproto_pack(m, &b1, &l1) != 0)
        fuzz_die("kproto_pack failed");
    /* Re-encoding may grow a message (a 5-byte negative int32 varint is
     * written back in 10), past what evt_unpack takes: nothing to compare. */
    if (l1 <= KS_MAX_MESSAGE_BYTES) {
        if (evt_unpack(m->descriptor, b1, l1, &again) != 0)
            fuzz_die("re-packed message does not decode");
        if (kproto_pack(again, &b2, &l2) != 0)
            fuzz_die("kproto_pack failed");
        if (l1 != l2 || memcmp(b1, b2, l1) != 0)
            fuzz_die("pack(unpack(pack(m))) differs from pack(m)");
        protobuf_c_message_free_unpacked(again, NULL);
    }
    free(b1);
    free(b2);
}

/* ---- the size gate ------------------------------------------------------ */

static volatile int counting;
static volatile size_t mallocs;

static void
count_malloc(const volatile void *ptr, size_t size)
{
    (void)ptr;
    (void)size;
    if (counting)
        mallocs++;
}

static void
ignore_free(const volatile void *ptr)
{
    (void)ptr;
}

/*
 * len bytes holding one unknown length-delimited field (number 1000), which
 * every message type accepts and keeps (protobuf-c stores unknown fields),
 * so the bytes are a valid message of any descriptor and only the size gate
 * can refuse them. Tag 1000<<3|2 = 8002 = varint c2 3e; the length is a
 * 3-byte varint for any len in [2^14 + 5, 2^21 + 4].
 */
static uint8_t *
unknown_field_message(size_t len)
{
    uint8_t *b = malloc(len);
    size_t body = len - 5;
    if (!b)
        fuzz_die("out of memory");
    b[0] = 0xc2;
    b[1] = 0x3e;
    b[2] = (uint8_t)(0x80 | (body & 0x7f));
    b[3] = (uint8_t)(0x80 | ((body >> 7) & 0x7f));
    b[4] = (uint8_t)(body >> 14);
    memset(b + 5, 'x', body);
    return b;
}

void
fuzz_check_size_gate(void)
{
    static int installed;
    const size_t max = KS_MAX_MESSAGE_BYTES;
    uint8_t *at_max = unknown_field_message(max);
    uint8_t *over = unknown_field_message(max + 1);
    const struct evt_verifier *trust;
    Ks__Command *cmd = NULL;
    ProtobufCMessage *m;
    const char *reason = NULL;
    char id[37];
    int rc;

    if (!installed &&
        !__sanitizer_install_malloc_and_free_hooks(count_malloc, ignore_free))
        fuzz_die("cannot install the malloc hook");
    installed = 1;

    for (size_t i = 0; i < fuzz_n_wire_descs; i++) {
        const ProtobufCMessageDescriptor *d = fuzz_wire_descs[i];
        /* Meaningful only if the bytes would decode without the gate. */
        m = protobuf_c_message_unpack(d, NULL, max + 1, over);
        if (!m)
            fuzz_die("the oversized probe is not a valid message");
        protobuf_c_message_free_unpacked(m, NULL);

        m = NULL;
        mallocs = 0;
        counting = 1;
        rc = evt_unpack(d, over, max + 1, &m);
        counting = 0;
        if (rc != KS_ETOOBIG || m) {
            fprintf(stderr, "fuzz: %s: evt_unpack(%zu bytes) = %s\n", d->name,
                    max + 1, ks_err_name(rc));
            fuzz_die("oversized message not refused with KS_ETOOBIG");
        }
        if (mallocs)
            fuzz_die("evt_unpack allocated before refusing a large message");
        if (evt_unpack(d, at_max, max, &m) != 0)
            fuzz_die("a message of exactly KS_MAX_MESSAGE_BYTES is refused");
        protobuf_c_message_free_unpacked(m, NULL);
    }

    trust = fuzz_verifier(); /* loads the key: not while counting */
    mallocs = 0;
    counting = 1;
    rc = agent_decode_command(trust, FUZZ_AGENT_ID, FUZZ_NOW_US, over, max + 1,
                              &cmd, &reason, id);
    counting = 0;
    if (rc != KS_ETOOBIG || cmd || reason || id[0])
        fuzz_die("agent_decode_command took an oversized message");
    if (mallocs)
        fuzz_die("agent_decode_command allocated before refusing it");
    free(at_max);
    free(over);
}
