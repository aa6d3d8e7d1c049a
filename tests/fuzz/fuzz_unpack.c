/*
 * Fuzzes evt_unpack(), the one decoder of every protobuf body kscore takes
 * from NATS (broker requests, events, commands, registry entries, replies).
 * The first input byte picks the message type from fuzz_wire_descs; the
 * rest is the body. A body that decodes must also survive a pack/unpack
 * round trip unchanged (fuzz_check_round_trip).
 */
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
    const ProtobufCMessageDescriptor *desc;
    ProtobufCMessage *m = NULL;

    if (size < 1)
        return 0;
    desc = fuzz_wire_descs[data[0] % fuzz_n_wire_descs];
    if (evt_unpack(desc, data + 1, size - 1, &m) != 0) {
        if (m)
            fuzz_die("evt_unpack failed but wrote *out");
        return 0;
    }
    fuzz_check_round_trip(m);
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
