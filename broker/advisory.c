/*
 * JetStream's max-deliveries advisory, turned into an event. When an agent
 * consumer gives up on a command message (MaxDeliver reached: the agent
 * kept failing before it could claim), nats-server publishes
 * $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer> with the
 * stream sequence (nats-server docs, "JetStream advisories";
 * io.nats.jetstream.advisory.v1.max_deliver). The broker records
 * CommandDeliveryExhausted on the command's stream and removes the message;
 * the deadline scanner then re-dispatches or ends the command.
 */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "broker_int.h"

#define ADVISORY_SUBJECT                                                       \
    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." EVT_STREAM_CMDS ".*"

static void
on_advisory(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *ud)
{
    struct broker *b = ud;
    json_t *j = NULL;
    natsMsg *cm = NULL;
    ProtobufCMessage *pm = NULL, *inner = NULL;
    char stream[64], evid[37], reason[200];

    (void)nc;
    (void)sub;
    j = json_loadb(natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg), 0,
                   NULL);
    json_int_t seq = json_integer_value(json_object_get(j, "stream_seq"));
    json_int_t n = json_integer_value(json_object_get(j, "deliveries"));
    const char *consumer = json_string_value(json_object_get(j, "consumer"));
    natsStatus gs = seq > 0 ? js_GetMsg(&cm, b->nc->js, EVT_STREAM_CMDS,
                                         (uint64_t)seq, NULL, NULL)
                            : NATS_ERR;
    if (gs != NATS_OK) {
        ks_log(KS_LOG_WARN, "max-deliveries advisory: message not found",
               KS_S("consumer", consumer ? consumer : "?"),
               KS_I("stream_seq", seq), KS_S("error", natsStatus_GetText(gs)));
        goto out;
    }
    if (evt_unpack(&ks__signed_command__descriptor, natsMsg_GetData(cm),
                   (size_t)natsMsg_GetDataLength(cm), &pm) != 0)
        goto drop;
    Ks__SignedCommand *sc = (Ks__SignedCommand *)pm;
    if (evt_unpack(&ks__command__descriptor, sc->command.data,
                   sc->command.len, &inner) != 0)
        goto drop;
    Ks__Command *cmd = (Ks__Command *)inner;
    if (!ks_is_uuid(cmd->command_id))
        goto drop;
    snprintf(stream, sizeof(stream), "command-%s", cmd->command_id);
    snprintf(reason, sizeof(reason),
             "JetStream gave up after %lld deliveries to consumer %s",
             (long long)n, consumer ? consumer : "?");
    Ks__Event ev;
    broker__event_init(&ev, evid, stream, "CommandDeliveryExhausted",
                       cmd->command_id);
    ev.agent_id = cmd->agent_id;
    ev.attempt = cmd->attempt;
    ev.operator_ = cmd->operator_;
    ev.reason = reason;
    struct store_event se = {&ev};
    pthread_mutex_lock(&b->misc_mu);
    int rc = store_append(b->st_misc, stream, STORE_ANY, &se, 1, NULL);
    pthread_mutex_unlock(&b->misc_mu);
    if (rc)
        ks_log(KS_LOG_ERROR, "cannot record", KS_S("type", ev.type),
               KS_S("command_id", cmd->command_id),
               KS_S("agent", cmd->agent_id), KS_I("attempt", cmd->attempt),
               KS_ERR(rc));
drop:
    /* Work-queue retention keeps an unacked message forever: remove it. */
    js_DeleteMsg(b->nc->js, EVT_STREAM_CMDS, (uint64_t)seq, NULL, NULL);
out:
    if (inner)
        protobuf_c_message_free_unpacked(inner, NULL);
    if (pm)
        protobuf_c_message_free_unpacked(pm, NULL);
    natsMsg_Destroy(cm);
    json_decref(j);
    natsMsg_Destroy(msg);
}

int
broker__advisory_start(struct broker *b, char **errmsg)
{
    /* Every broker hears it (no queue group would share it), so one
     * broker of a group records it: a queue group. */
    natsStatus s = natsConnection_QueueSubscribe(
        &b->sub_advisory, b->nc->nc, ADVISORY_SUBJECT, EVT_BROKER_QUEUE,
        on_advisory, b);
    if (s != NATS_OK) {
        if (errmsg && asprintf(errmsg, "subscribe %s: %s", ADVISORY_SUBJECT,
                               natsStatus_GetText(s)) < 0)
            *errmsg = NULL;
        return KS_ENATS;
    }
    return 0;
}
