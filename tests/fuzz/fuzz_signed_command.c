/*
 * Fuzzes what agent_decode_command() checks behind a valid signature: the
 * input is the packed Command, which the harness signs with the trusted
 * fuzz key and wraps in a SignedCommand, so every input passes the
 * signature and the agent id, expiry and argv checks see fuzzed values.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_check_size_gate();
    return 0;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Ks__Command *cmd = NULL;
    const char *reason = NULL;
    uint8_t *signed_bytes = NULL;
    size_t signed_len = 0;
    char id[37];
    int rc;

    fuzz_sign_command_bytes(data, size, &signed_bytes, &signed_len);
    rc = agent_decode_command(fuzz_verifier(), FUZZ_AGENT_ID, FUZZ_NOW_US,
                              signed_bytes, signed_len, &cmd, &reason, id);
    free(signed_bytes);
    if (rc == KS_EREJECTED) {
        /* A valid signature over a decodable command: the refusal must be
         * one of the checks behind the signature, never the signature. */
        if (!reason || strstr(reason, "signature"))
            fuzz_die("a validly signed command failed its signature check");
        return 0;
    }
    if (rc != 0) {
        if (cmd || (rc != KS_EDECODE &&
                    !(rc == KS_ETOOBIG && signed_len > KS_MAX_MESSAGE_BYTES)))
            fuzz_die("unexpected refusal");
        return 0;
    }
    if (strcmp(cmd->agent_id, FUZZ_AGENT_ID) != 0 ||
        cmd->not_after_us < FUZZ_NOW_US || !cmd->spec || !cmd->spec->n_argv ||
        !cmd->spec->argv[0][0] || strcmp(id, cmd->command_id) != 0)
        fuzz_die("accepted a command the gate should refuse");
    fuzz_check_round_trip(&cmd->base);
    ks__command__free_unpacked(cmd, NULL);
    return 0;
}
