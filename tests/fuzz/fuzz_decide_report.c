/*
 * Fuzzes broker_decide_report(), the decision behind every event an agent
 * adds to the record (the recorder takes it under the stream's lock). The
 * input is a record state (its first bytes) and an Event (the rest, as
 * evt_unpack decodes it off the wire). Whatever the bytes, the decision
 * must keep the record's promises, checked here against rules written
 * down a second time, independently of the state machine's table:
 *  - an agent never adds intent (Requested, Dispatched, Started,
 *    Undeliverable, Cancelled) nor anything about another agent's command;
 *  - a command that has ended never ends again (a terminal report is LATE
 *    or refused, never applied);
 *  - an applied end follows a claim (Running), or is a start failure of a
 *    Dispatched command, and ends in a status its type may carry;
 *  - a refusal always says why; an acceptance never does.
 */
#include <string.h>

#include "broker.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const agents[] = {FUZZ_AGENT_ID, "other-agent", ""};

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct store_command_state st = {0};
    ProtobufCMessage *m = NULL;
    const char *why = NULL;

    if (size < 3)
        return 0;
    st.exists = data[0] & 1;
    st.status = (Ks__CommandStatus)(data[1] % 13);
    snprintf(st.agent_id, sizeof(st.agent_id), "%s", agents[data[0] >> 1 & 1]);
    st.attempt = data[2] % 4;
    if (evt_unpack(&ks__event__descriptor, data + 3, size - 3, &m) != 0)
        return 0;
    Ks__Event *ev = (Ks__Event *)m;
    enum store_step v = broker_decide_report(&st, ev, &why);
    bool terminal = strcmp(ev->type, "CommandCompleted") == 0 ||
                    strcmp(ev->type, "CommandStartFailed") == 0 ||
                    strcmp(ev->type, "CommandLost") == 0 ||
                    strcmp(ev->type, "CommandNotStarted") == 0 ||
                    strcmp(ev->type, "CommandUndeliverable") == 0 ||
                    strcmp(ev->type, "CommandCancelled") == 0;

    if (v == STORE_STEP_APPLY) {
        if (why)
            fuzz_die("applied with a reason");
        if (strcmp(ev->type, "CommandRequested") == 0 ||
            strcmp(ev->type, "CommandDispatched") == 0 ||
            strcmp(ev->type, "CommandStarted") == 0 ||
            strcmp(ev->type, "CommandUndeliverable") == 0 ||
            strcmp(ev->type, "CommandCancelled") == 0)
            fuzz_die("an agent added intent to the record");
        if (st.exists && strcmp(st.agent_id, ev->agent_id) != 0)
            fuzz_die("applied a report about another agent's command");
        if (terminal) {
            if (!st.exists)
                fuzz_die("ended a command that does not exist");
            if (kproto_status_terminal(st.status))
                fuzz_die("a second end of a command");
            bool claimed = st.status == KS__COMMAND_STATUS__RUNNING;
            bool early_fail = st.status == KS__COMMAND_STATUS__DISPATCHED &&
                              strcmp(ev->type, "CommandStartFailed") == 0;
            if (!claimed && !early_fail)
                fuzz_die("an end that follows no claim");
            if (ev->attempt != st.attempt)
                fuzz_die("an end for an attempt that was not claimed");
            if (ev->result) {
                Ks__CommandStatus s = ev->result->status;
                bool ok =
                    strcmp(ev->type, "CommandCompleted") == 0
                        ? s == KS__COMMAND_STATUS__SUCCEEDED ||
                              s == KS__COMMAND_STATUS__FAILED ||
                              s == KS__COMMAND_STATUS__TIMED_OUT ||
                              s == KS__COMMAND_STATUS__CANCELLED ||
                              s == KS__COMMAND_STATUS__STATUS_UNSPECIFIED
                    : strcmp(ev->type, "CommandStartFailed") == 0
                        ? s == KS__COMMAND_STATUS__START_FAILED ||
                              s == KS__COMMAND_STATUS__STATUS_UNSPECIFIED
                    : strcmp(ev->type, "CommandLost") == 0
                        ? s == KS__COMMAND_STATUS__LOST ||
                              s == KS__COMMAND_STATUS__STATUS_UNSPECIFIED
                        : s == KS__COMMAND_STATUS__NOT_STARTED ||
                              s == KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
                if (!ok)
                    fuzz_die("an end in a status its type may not carry");
            }
        }
    } else if (v == STORE_STEP_LATE) {
        if (!why || !*why)
            fuzz_die("late without a reason");
        if (!terminal || !st.exists || !kproto_status_terminal(st.status))
            fuzz_die("late but not an end of an ended command");
    } else if (v == STORE_STEP_ILLEGAL) {
        if (!why || !*why)
            fuzz_die("refused without a reason");
    } else {
        fuzz_die("an unknown verdict");
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
