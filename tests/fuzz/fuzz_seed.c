/*
 * Writes the seed corpus of the fuzz targets: fuzz_seed <dir> creates
 * <dir>/unpack, <dir>/decode_command, <dir>/signed_command,
 * <dir>/decide_report and <dir>/check_request. The files
 * under tests/fuzz/corpus come from
 *     build-fuzz/tests/fuzz/fuzz_seed tests/fuzz/corpus
 * and are rewritten identically on every run (fixed key, deterministic
 * Ed25519), so regenerate them whenever kscore.proto changes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_common.h"

static const char *root;

static void
write_seed(const char *sub, const char *name, const uint8_t *prefix,
           size_t prefix_len, const uint8_t *buf, size_t len)
{
    char path[4096];
    FILE *f;

    if (mkdir(root, 0755) == -1 && errno != EEXIST)
        fuzz_die("cannot create the corpus directory");
    snprintf(path, sizeof(path), "%s/%s", root, sub);
    if (mkdir(path, 0755) == -1 && errno != EEXIST)
        fuzz_die("cannot create a corpus directory");
    snprintf(path, sizeof(path), "%s/%s/%s", root, sub, name);
    f = fopen(path, "we");
    if (!f || fwrite(prefix, 1, prefix_len, f) != prefix_len ||
        fwrite(buf, 1, len, f) != len || fclose(f) != 0)
        fuzz_die("cannot write a seed");
}

/* A seed of fuzz_unpack: the descriptor's index, then the body. */
static void
unpack_seed(const char *name, const ProtobufCMessage *m)
{
    uint8_t *buf, sel;
    size_t len, i;

    for (i = 0; i < fuzz_n_wire_descs; i++)
        if (fuzz_wire_descs[i] == m->descriptor)
            break;
    if (i == fuzz_n_wire_descs)
        fuzz_die("not a wire message");
    sel = (uint8_t)i;
    if (kproto_pack(m, &buf, &len) != 0)
        fuzz_die("kproto_pack failed");
    write_seed("unpack", name, &sel, 1, buf, len);
    free(buf);
}

/* Signs cmd and writes it as a seed of fuzz_decode_command; also writes the
 * packed command itself as a seed of fuzz_signed_command. */
static void
command_seeds(const char *name, const Ks__Command *cmd)
{
    uint8_t *inner, *outer;
    size_t inner_len, outer_len;

    if (kproto_pack(&cmd->base, &inner, &inner_len) != 0)
        fuzz_die("kproto_pack failed");
    fuzz_sign_command_bytes(inner, inner_len, &outer, &outer_len);
    write_seed("decode_command", name, NULL, 0, outer, outer_len);
    write_seed("signed_command", name, NULL, 0, inner, inner_len);
    free(inner);
    free(outer);
}

/* The decode_command seeds must hit the branch their name promises, or
 * they seed nothing past the signature. */
static void
check_seed(const char *name, int want_rc, const char *want_reason)
{
    char path[4096], id[37];
    static uint8_t buf[64 * 1024];
    Ks__Command *cmd = NULL;
    const char *reason = NULL;
    size_t len;
    FILE *f;
    int rc;

    snprintf(path, sizeof(path), "%s/decode_command/%s", root, name);
    f = fopen(path, "re");
    if (!f)
        fuzz_die("cannot read a seed back");
    len = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    rc = agent_decode_command(fuzz_verifier(), FUZZ_AGENT_ID, FUZZ_NOW_US, buf,
                              len, &cmd, &reason, id);
    if (rc != want_rc ||
        (want_reason && (!reason || !strstr(reason, want_reason)))) {
        fprintf(stderr, "fuzz_seed: %s: %s (%s)\n", name, ks_err_name(rc),
                reason ? reason : "-");
        fuzz_die("a seed does not do what its name says");
    }
    ks__command__free_unpacked(cmd, NULL);
}

/* A well-formed SignedCommand around a valid command, tampered with. */
static void
tampered_seeds(const Ks__Command *cmd)
{
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    uint8_t sig[EVT_SIGNATURE_BYTES], *inner, *outer;
    size_t inner_len, outer_len;

    if (kproto_pack(&cmd->base, &inner, &inner_len) != 0)
        fuzz_die("kproto_pack failed");
    sc.command.data = inner;
    sc.command.len = inner_len;
    if (kproto_pack(&sc.base, &outer, &outer_len) != 0)
        fuzz_die("kproto_pack failed");
    write_seed("decode_command", "unsigned", NULL, 0, outer, outer_len);
    free(outer);

    if (evt_sign(fuzz_signer(), inner, inner_len, sig) != 0)
        fuzz_die("evt_sign failed");
    sig[0] ^= 1;
    sc.signature.data = sig;
    sc.signature.len = sizeof(sig);
    sc.key_id = "0000000000000000";
    if (kproto_pack(&sc.base, &outer, &outer_len) != 0)
        fuzz_die("kproto_pack failed");
    write_seed("decode_command", "bad-signature", NULL, 0, outer, outer_len);
    free(outer);
    free(inner);
}

int
main(int argc, char **argv)
{
    Ks__Command cmd;
    Ks__CommandSpec spec;
    Ks__EnvVar env = KS__ENV_VAR__INIT, *envp = &env;
    Ks__CommandResult res = KS__COMMAND_RESULT__INIT;
    Ks__Output out = KS__OUTPUT__INIT;
    Ks__Event ev = KS__EVENT__INIT;
    Ks__RecordedEvent rec = KS__RECORDED_EVENT__INIT, *recp = &rec;
    Ks__EventsReply er = KS__EVENTS_REPLY__INIT;
    Ks__ExecuteRequest xr = KS__EXECUTE_REQUEST__INIT;
    Ks__ExecuteReply xp = KS__EXECUTE_REPLY__INIT;
    Ks__ClaimRequest cr = KS__CLAIM_REQUEST__INIT;
    Ks__AgentInfo ai = KS__AGENT_INFO__INIT;
    Ks__AgentStatus as = KS__AGENT_STATUS__INIT, *asp = &as;
    Ks__AgentsReply ar = KS__AGENTS_REPLY__INIT;
    Ks__BatchRequest br = KS__BATCH_REQUEST__INIT;
    Ks__Amount amt = KS__AMOUNT__INIT;
    Ks__BatchCounts counts = KS__BATCH_COUNTS__INIT;
    Ks__BatchTarget bt = KS__BATCH_TARGET__INIT, *btp = &bt;
    Ks__BatchReply bp = KS__BATCH_REPLY__INIT;
    Ks__BatchProgress prog = KS__BATCH_PROGRESS__INIT;
    Ks__CommandView cv = KS__COMMAND_VIEW__INIT;
    Ks__GetReply gr = KS__GET_REPLY__INIT;
    Ks__SignedCommand sc = KS__SIGNED_COMMAND__INIT;
    uint8_t *inner;
    size_t inner_len;

    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seed <corpus dir>\n");
        return 2;
    }
    root = argv[1];

    /* decode_command / signed_command */
    fuzz_valid_command(&cmd, &spec);
    command_seeds("valid", &cmd);
    env.name = "LANG";
    env.value = "C";
    spec.n_env = 1;
    spec.env = &envp;
    spec.cwd = "/tmp";
    spec.stdout_cap_bytes = 4096;
    cmd.batch_id = "batch-0b7e8a3c-5f0e-4a6b-9a51-3d2c1f0e9b87";
    command_seeds("valid-env-cwd-batch", &cmd);
    tampered_seeds(&cmd);
    fuzz_valid_command(&cmd, &spec);
    cmd.agent_id = "another-agent";
    command_seeds("other-agent", &cmd);
    fuzz_valid_command(&cmd, &spec);
    cmd.not_after_us = FUZZ_NOW_US - 1;
    command_seeds("expired", &cmd);
    fuzz_valid_command(&cmd, &spec);
    spec.n_argv = 0;
    command_seeds("no-argv", &cmd);

    /* unpack: one filled message per family; empty ones for the rest */
    fuzz_valid_command(&cmd, &spec);
    spec.n_env = 1;
    spec.env = &envp;
    out.data.data = (uint8_t *)"hello\n";
    out.data.len = 6;
    out.total_bytes = 6;
    res.status = KS__COMMAND_STATUS__SUCCEEDED;
    res.has_exit_code = 1;
    res.stdout = &out;
    res.term_sent_us = -1;
    res.start_stage = "exec";
    ev.event_id = "5d1c8f7e-2a3b-4c5d-8e9f-0a1b2c3d4e5f";
    ev.stream_id = "command-0b7e8a3c-5f0e-4a6b-9a51-3d2c1f0e9b87";
    ev.type = "CommandCompleted";
    ev.command = &cmd;
    ev.result = &res;
    ev.target_status = KS__COMMAND_STATUS__FAILED;
    ev.batch_counts = &counts;
    unpack_seed("event", &ev.base);
    unpack_seed("command", &cmd.base);
    rec.event = &ev;
    rec.version = 3;
    rec.tx_id = 77;
    er.n_events = 1;
    er.events = &recp;
    er.cursor_pos = 9;
    unpack_seed("events-reply", &er.base);

    xr.spec = &spec;
    xr.agent_id = FUZZ_AGENT_ID;
    xr.idempotency_key = "k1";
    unpack_seed("execute-request", &xr.base);
    xp.error_code = KS_ENOAGENT;
    xp.error = "unknown agent";
    xp.result = &res;
    unpack_seed("execute-reply", &xp.base);
    cr.command_id = cmd.command_id;
    cr.attempt = 1;
    cr.agent_id = FUZZ_AGENT_ID;
    cr.start_failure = &res;
    cr.expected_version = 2;
    unpack_seed("claim-request", &cr.base);

    ai.agent_id = FUZZ_AGENT_ID;
    ai.n_labels = 1;
    ai.labels = &envp;
    ai.max_concurrent = 8;
    unpack_seed("agent-info", &ai.base);
    as.info = &ai;
    as.online = 1;
    ar.n_agents = 1;
    ar.agents = &asp;
    unpack_seed("agents-reply", &ar.base);

    amt.value = 50;
    amt.percent = 1;
    br.spec = &spec;
    br.n_select = 1;
    br.select = &envp;
    br.max_concurrency = &amt;
    br.max_errors = &amt;
    br.progress_subject = "_INBOX.x";
    unpack_seed("batch-request", &br.base);
    counts.total = 3;
    counts.succeeded = 2;
    bt.agent_id = FUZZ_AGENT_ID;
    bt.command_id = cmd.command_id;
    bt.result = &res;
    bp.batch_id = "batch-1";
    bp.counts = &counts;
    bp.n_targets = 1;
    bp.targets = &btp;
    unpack_seed("batch-reply", &bp.base);
    prog.target = &bt;
    prog.counts = &counts;
    unpack_seed("batch-progress", &prog.base);
    cv.command_id = cmd.command_id;
    cv.n_argv = spec.n_argv;
    cv.argv = spec.argv;
    cv.result = &res;
    gr.command = &cv;
    gr.batch = &bp;
    unpack_seed("get-reply", &gr.base);

    check_seed("valid", 0, NULL);
    check_seed("valid-env-cwd-batch", 0, NULL);
    check_seed("unsigned", KS_EREJECTED, "missing signature");
    check_seed("bad-signature", KS_EREJECTED, "bad signature");
    check_seed("other-agent", KS_EREJECTED, "another agent");
    check_seed("expired", KS_EREJECTED, "expired");
    check_seed("no-argv", KS_EREJECTED, "argv");

    /* decide_report: state bytes (exists|agent, status, attempt), then an
     * event an agent reports. */
    {
        static const struct {
            const char *name, *type;
            uint8_t st[3];
            Ks__CommandStatus res;
        } rs[] = {
            {"completed-running", "CommandCompleted", {1, 3, 1},
             KS__COMMAND_STATUS__SUCCEEDED},
            {"completed-ended", "CommandCompleted", {1, 10, 1},
             KS__COMMAND_STATUS__SUCCEEDED},
            {"lost-running", "CommandLost", {1, 3, 1},
             KS__COMMAND_STATUS__LOST},
            {"startfailed-dispatched", "CommandStartFailed", {1, 2, 1},
             KS__COMMAND_STATUS__START_FAILED},
            {"requested-forged", "CommandRequested", {0, 0, 0}, 0},
            {"other-agents-command", "CommandCompleted", {3, 3, 1},
             KS__COMMAND_STATUS__SUCCEEDED},
        };
        for (size_t i = 0; i < sizeof(rs) / sizeof(rs[0]); i++) {
            Ks__Event e = KS__EVENT__INIT;
            Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
            uint8_t *buf;
            size_t len;
            e.event_id = "5d1c8f7e-2a3b-4c5d-8e9f-0a1b2c3d4e5f";
            e.stream_id = "command-0b7e8a3c-5f0e-4a6b-9a51-3d2c1f0e9b87";
            e.command_id = "0b7e8a3c-5f0e-4a6b-9a51-3d2c1f0e9b87";
            e.type = (char *)rs[i].type;
            e.agent_id = FUZZ_AGENT_ID;
            e.attempt = 1;
            if (rs[i].res) {
                r.status = rs[i].res;
                e.result = &r;
            }
            if (kproto_pack(&e.base, &buf, &len) != 0)
                fuzz_die("kproto_pack failed");
            write_seed("decide_report", rs[i].name, rs[i].st, 3, buf, len);
            free(buf);
        }
    }
    /* check_request: the request type's index, then the request. */
    {
        const struct {
            const char *name;
            uint8_t sel;
            const ProtobufCMessage *m;
        } qs[] = {
            {"execute", 0, &xr.base},
            {"batch", 1, &br.base},
            {"claim", 2, &cr.base},
        };
        br.progress_subject = "_INBOX.fuzzop.0b7e8a3c";
        cr.event_id = "5d1c8f7e-2a3b-4c5d-8e9f-0a1b2c3d4e5f";
        for (size_t i = 0; i < sizeof(qs) / sizeof(qs[0]); i++) {
            uint8_t *buf;
            size_t len;
            if (kproto_pack(qs[i].m, &buf, &len) != 0)
                fuzz_die("kproto_pack failed");
            write_seed("check_request", qs[i].name, &qs[i].sel, 1, buf, len);
            free(buf);
        }
    }

    if (kproto_pack(&cmd.base, &inner, &inner_len) != 0)
        fuzz_die("kproto_pack failed");
    sc.command.data = inner;
    sc.command.len = inner_len;
    unpack_seed("signed-command", &sc.base);
    free(inner);
    return 0;
}
