/*
 * fuzz_common: what the libFuzzer targets in tests/fuzz share.
 *
 *  - A signing key derived at start-up from a fixed 32-byte seed, so the
 *    seed corpus checked in under tests/fuzz/corpus (written by fuzz_seed)
 *    stays validly signed: Ed25519 signatures are deterministic (RFC 8032
 *    5.1.6), the same key and bytes give the same signature on every run.
 *  - The descriptors of every message kscore decodes from the network.
 *  - The size gate check: inputs over KS_MAX_MESSAGE_BYTES are refused
 *    with KS_ETOOBIG before any allocation. libFuzzer's inputs stay far
 *    below 1 MiB (-max_len), so this is checked once, at start-up, with a
 *    malloc hook, rather than left to the fuzzer to stumble on.
 *
 * Everything here aborts on failure: a harness that cannot set itself up
 * must not report "no crash".
 */
#ifndef KSCORE_FUZZ_COMMON_H
#define KSCORE_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "agent.h"

/* The agent id the harnesses decode for, and the clock they decode at
 * (2023-11-14, epoch us): fixed, so a seed's not-after never expires. */
#define FUZZ_AGENT_ID "fuzz-agent"
#define FUZZ_NOW_US INT64_C(1700000000000000)

/* Every message that arrives from the network (broker, agent, CLI). */
extern const ProtobufCMessageDescriptor *const fuzz_wire_descs[];
extern const size_t fuzz_n_wire_descs;

/* The signer of the fixed key (process lifetime). */
const struct evt_signer *fuzz_signer(void);
/* A verifier that trusts exactly fuzz_signer() (process lifetime). */
const struct evt_verifier *fuzz_verifier(void);

/*
 * Fills cmd with a command that agent_decode_command() accepts for
 * FUZZ_AGENT_ID at FUZZ_NOW_US. Strings point at static storage; spec is
 * the caller's (it must outlive cmd).
 */
void fuzz_valid_command(Ks__Command *cmd, Ks__CommandSpec *spec);

/*
 * Packs cmd, signs the bytes with fuzz_signer() and packs the
 * SignedCommand into *buf_out (malloc'd, *len_out bytes). Aborts on error.
 */
void fuzz_sign_command_bytes(const uint8_t *cmd_bytes, size_t cmd_len,
                             uint8_t **buf_out, size_t *len_out);

/*
 * Asserts the size gate of evt_unpack() for every wire descriptor and of
 * agent_decode_command(): KS_MAX_MESSAGE_BYTES + 1 bytes of an otherwise
 * valid message are refused with KS_ETOOBIG and no malloc; exactly
 * KS_MAX_MESSAGE_BYTES bytes decode. Aborts with a message on failure.
 */
void fuzz_check_size_gate(void);

/*
 * Packs m, unpacks the result, packs again: the two packings must be equal
 * (protobuf-c writes a canonical encoding, so decode(encode(x)) is a fixed
 * point) and m must pass protobuf_c_message_check(). Aborts otherwise.
 */
void fuzz_check_round_trip(const ProtobufCMessage *m);

/* Aborts with "fuzz: <what>" on stderr. */
_Noreturn void fuzz_die(const char *what);

#endif
