/* Private to events/. */
#ifndef KSCORE_EVENTS_INT_H
#define KSCORE_EVENTS_INT_H

#include "events.h"

/* Packs cmd into a SignedCommand (signed by s; unsigned when s is NULL)
 * in a new buffer. 0, KS_ETOOBIG, -ENOMEM, KS_EINTERNAL. */
int evt__sign_command(const struct evt_signer *s, const Ks__Command *cmd,
                      uint8_t **buf_out, size_t *len_out);

/* "_INBOX.<identity>.<uuid>" into buf (request.c). 0 or KS_ETOOBIG. */
int evt__inbox_of(const char *identity, char *buf, size_t len);

#endif
