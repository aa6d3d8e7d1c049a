/* The agent's gate: what it accepts from kscore.cmd.<id>. */
#include <string.h>

#include "agent.h"

int
agent_decode_command(const struct evt_verifier *trust, const char *agent_id,
                     int64_t now_us, const void *data, size_t len,
                     Ks__Command **out, const char **reason_out,
                     char cmd_id_out[37])
{
    ProtobufCMessage *pm = NULL;
    Ks__SignedCommand *sc = NULL;
    Ks__Command *cmd = NULL;
    const char *reason = NULL;
    int rc;

    if (cmd_id_out)
        cmd_id_out[0] = '\0';
    rc = evt_unpack(&ks__signed_command__descriptor, data, len, &pm);
    if (rc)
        return rc;
    sc = (Ks__SignedCommand *)pm;
    rc = evt_unpack(&ks__command__descriptor, sc->command.data,
                    sc->command.len, &pm);
    if (rc)
        goto out;
    cmd = (Ks__Command *)pm;
    if (!ks_is_uuid(cmd->command_id)) {
        rc = KS_EDECODE;
        goto out;
    }
    if (cmd_id_out)
        memcpy(cmd_id_out, cmd->command_id, 37);
    /* Signature first: nothing else in an unsigned message is believed. */
    if (sc->signature.len == 0)
        reason = "missing signature";
    else if (evt_verify(trust, sc->key_id, sc->command.data, sc->command.len,
                        sc->signature.data, sc->signature.len) != 0)
        reason = "bad signature";
    else if (strcmp(cmd->agent_id, agent_id) != 0)
        reason = "addressed to another agent";
    else if (!cmd->not_after_us || now_us > cmd->not_after_us)
        reason = "expired: past its not-after time";
    else if (!cmd->spec || cmd->spec->n_argv == 0 || !cmd->spec->argv[0][0])
        reason = "no command to run (empty argv)";
    if (reason) {
        rc = KS_EREJECTED;
        *reason_out = reason;
        goto out;
    }
    *out = cmd;
    cmd = NULL;
out:
    if (cmd)
        ks__command__free_unpacked(cmd, NULL);
    ks__signed_command__free_unpacked(sc, NULL);
    return rc;
}
