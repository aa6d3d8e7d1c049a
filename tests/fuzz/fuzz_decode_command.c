/*
 * Fuzzes agent_decode_command(), the agent's gate for the bytes of
 * kscore.cmd.<id>: the input is the whole SignedCommand. The verifier
 * trusts the fixed fuzz key, and the seed corpus (tests/fuzz/corpus/
 * decode_command, from fuzz_seed) holds commands signed with it, so
 * mutations start past the signature check; most of them then fail it,
 * which is what the gate is for. fuzz_signed_command fuzzes what lies
 * behind a valid signature.
 */
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

/* What every caller relies on after a 0 from the gate. */
static void
check_accepted(const Ks__Command *cmd, const char *id)
{
    if (!ks_is_uuid(cmd->command_id) || strcmp(id, cmd->command_id) != 0)
        fuzz_die("accepted a command without a valid id");
    if (strcmp(cmd->agent_id, FUZZ_AGENT_ID) != 0)
        fuzz_die("accepted a command for another agent");
    if (!cmd->not_after_us || cmd->not_after_us < FUZZ_NOW_US)
        fuzz_die("accepted an expired command");
    if (!cmd->spec || !cmd->spec->n_argv || !cmd->spec->argv[0][0])
        fuzz_die("accepted a command without argv");
    /* Touch every string the runtime hands to the executor. */
    for (size_t i = 0; i < cmd->spec->n_argv; i++)
        (void)strlen(cmd->spec->argv[i]);
    for (size_t i = 0; i < cmd->spec->n_env; i++)
        (void)(strlen(cmd->spec->env[i]->name) +
               strlen(cmd->spec->env[i]->value));
    (void)strlen(cmd->spec->cwd);
    fuzz_check_round_trip(&cmd->base);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Ks__Command *cmd = NULL;
    const char *reason = NULL;
    char id[37];
    int rc;

    memset(id, 0x55, sizeof(id));
    rc = agent_decode_command(fuzz_verifier(), FUZZ_AGENT_ID, FUZZ_NOW_US, data,
                              size, &cmd, &reason, id);
    if (rc == 0) {
        if (!cmd || reason)
            fuzz_die("success without a command, or with a reason");
        check_accepted(cmd, id);
        ks__command__free_unpacked(cmd, NULL);
        return 0;
    }
    if (cmd)
        fuzz_die("refusal wrote *out");
    if (rc == KS_EREJECTED ? !reason || !ks_is_uuid(id) : reason != NULL)
        fuzz_die("reason set without KS_EREJECTED, or missing with it");
    if (rc != KS_EREJECTED && rc != KS_EDECODE)
        fuzz_die("unexpected error code");
    if (id[0] && !ks_is_uuid(id))
        fuzz_die("cmd_id_out is neither empty nor a uuid");
    return 0;
}
