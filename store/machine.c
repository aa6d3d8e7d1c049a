/*
 * machine.c: the command state machine, the one definition of which event
 * may follow which (store.h "The command state machine"). Pure: no I/O, so
 * it is fuzzed directly (tests/fuzz) and used under the row locks of
 * store_append_checked().
 */
#include "store_int.h"

#include <string.h>

/* Bit of a status in a "from" set. */
#define S(x) (1u << KS__COMMAND_STATUS__##x)
#define NONE 0u /* the command does not exist yet */

static const struct {
    const char *type;
    unsigned from;  /* statuses the event may follow */
    bool terminal;  /* it ends the command */
    bool creates;   /* it creates the command (no state before it) */
    unsigned ends;  /* terminal: the statuses it may end the command in */
} steps[] = {
    {"CommandRequested", NONE, false, true, 0},
    {"CommandDispatched", S(PENDING) | S(DISPATCHED), false, false, 0},
    {"CommandStarted", S(DISPATCHED), false, false, 0},
    /* A claim with a failed precheck (Dispatched), or a spawn that failed
     * after the claim (Running). */
    {"CommandStartFailed", S(DISPATCHED) | S(RUNNING), true, false,
     S(START_FAILED)},
    {"CommandCompleted", S(RUNNING), true, false,
     S(SUCCEEDED) | S(FAILED) | S(TIMED_OUT) | S(CANCELLED)},
    {"CommandLost", S(RUNNING), true, false, S(LOST)},
    {"CommandNotStarted", S(RUNNING), true, false, S(NOT_STARTED)},
    {"CommandUndeliverable", S(PENDING) | S(DISPATCHED), true, false,
     S(UNDELIVERABLE)},
    /* Only before a claim; a running command is cancelled by its agent
     * (CommandCompleted with result.cancelled). */
    {"CommandCancelled", S(PENDING) | S(DISPATCHED), true, false,
     S(CANCELLED)},
};

int
store_event_is_terminal(const char *type)
{
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++)
        if (strcmp(type, steps[i].type) == 0)
            return steps[i].terminal;
    return 0;
}

enum store_step
store_command_step(const struct store_command_state *st, const Ks__Event *ev,
                   Ks__CommandStatus *next_out, const char **why)
{
    const char *type = ev->type ? ev->type : "";
    Ks__CommandStatus cur = st->exists ? st->status
                                       : KS__COMMAND_STATUS__STATUS_UNSPECIFIED;
    size_t i;

    *why = NULL;
    *next_out = cur;
    for (i = 0; i < sizeof(steps) / sizeof(steps[0]); i++)
        if (strcmp(type, steps[i].type) == 0)
            break;
    if (i == sizeof(steps) / sizeof(steps[0])) {
        /* An annotation (CommandRejected, DuplicateSuppressed, ...): any
         * time, as long as the command exists; it changes no state. */
        if (!st->exists && strncmp(type, "Command", 7) == 0 &&
            strcmp(type, "CommandRejected") != 0) {
            *why = "no such command";
            return STORE_STEP_ILLEGAL;
        }
        return STORE_STEP_APPLY;
    }
    if (steps[i].creates) {
        if (st->exists) {
            *why = "the command exists already";
            return STORE_STEP_ILLEGAL;
        }
        *next_out = KS__COMMAND_STATUS__PENDING;
        return STORE_STEP_APPLY;
    }
    if (!st->exists) {
        *why = "no such command";
        return STORE_STEP_ILLEGAL;
    }
    if (kproto_status_terminal(cur)) {
        if (steps[i].terminal) {
            *why = "the command had already ended";
            return STORE_STEP_LATE;
        }
        *why = "the command has ended";
        return STORE_STEP_ILLEGAL;
    }
    if (cur >= 32 || !(steps[i].from & (1u << cur))) {
        *why = steps[i].terminal ? "the command is not in a state this end "
                                   "can follow (not claimed)"
                                 : "not a transition of the command's state";
        return STORE_STEP_ILLEGAL;
    }
    if (strcmp(type, "CommandDispatched") == 0)
        *next_out = KS__COMMAND_STATUS__DISPATCHED;
    else if (strcmp(type, "CommandStarted") == 0)
        *next_out = KS__COMMAND_STATUS__RUNNING;
    else {
        Ks__CommandStatus own;
        enum store__proj_kind k = store__proj_kind(ev, &own);
        Ks__CommandStatus end = k == STORE__PROJ_RESULT
                                    ? store__result_status(ev->result, own)
                                    : own;
        /* The status the projection will show must be one this type may
         * end in: a CommandCompleted cannot say Lost, a start failure
         * cannot say Succeeded (and carry output). */
        if (end <= 0 || end >= 32 || !(steps[i].ends & (1u << end))) {
            *why = "its result's status is not one this event may end a "
                   "command in";
            return STORE_STEP_ILLEGAL;
        }
        *next_out = end;
    }
    return STORE_STEP_APPLY;
}
