/*
 * Output every command shares: a result and an event as JSON (docs/operating.md
 * "Output", "Events"), one JSON line on stdout,
 * text made safe for a terminal, argv as a shell reads it back. Calls
 * only down (cli.c, the libraries).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "cli_int.h"

static int
utf8_valid(const uint8_t *s, size_t n)
{
    /* jansson refuses invalid UTF-8 and NUL in json_stringn only for
     * invalid UTF-8; NUL is fine, but we only call text what a terminal can
     * show as is, so NUL also makes it binary. */
    for (size_t i = 0; i < n; i++)
        if (s[i] == 0)
            return 0;
    json_t *j = json_stringn((const char *)s, n);
    if (!j)
        return 0;
    json_decref(j);
    return 1;
}

/* Base64 through OpenSSL (EVP_EncodeBlock writes no newlines). */
static json_t *
b64(const uint8_t *s, size_t n)
{
    size_t olen = 4 * ((n + 2) / 3);
    unsigned char *o = malloc(olen + 1);
    json_t *j;
    if (!o || n > INT32_MAX) {
        free(o);
        return json_null();
    }
    EVP_EncodeBlock(o, s, (int)n);
    j = json_stringn((const char *)o, olen);
    free(o);
    return j;
}

static void
put_output(json_t *o, const char *name, const Ks__Output *out)
{
    char key[64];
    size_t n = out ? out->data.len : 0;
    const uint8_t *d = n ? out->data.data : (const uint8_t *)"";
    json_object_set_new(o, name,
                        utf8_valid(d, n) ? json_stringn((const char *)d, n)
                                         : json_null());
    snprintf(key, sizeof(key), "%s_base64", name);
    json_object_set_new(o, key, b64(d, n));
    snprintf(key, sizeof(key), "%s_truncated", name);
    json_object_set_new(o, key, json_boolean(out && out->truncated));
    snprintf(key, sizeof(key), "%s_total_bytes", name);
    json_object_set_new(o, key, json_integer(out ? (json_int_t)out->total_bytes
                                                 : 0));
    if (out && out->chunked_bytes && !out->data.len) {
        /* Not here: in the record's pieces (kscore logs). */
        snprintf(key, sizeof(key), "%s_chunked_bytes", name);
        json_object_set_new(o, key, json_integer((json_int_t)out->chunked_bytes));
    }
}

json_t *
cli_result_json(const Ks__CommandResult *r)
{
    json_t *o = json_object();
    if (!r)
        return o;
    json_object_set_new(o, "status",
                        json_string(kproto_status_name(r->status)));
    json_object_set_new(o, "exit_code", r->has_exit_code
                                            ? json_integer(r->exit_code)
                                            : json_null());
    json_object_set_new(o, "signal",
                        r->signal ? json_integer(r->signal) : json_null());
    json_object_set_new(o, "core_dumped", json_boolean(r->core_dumped));
    json_object_set_new(o, "timed_out", json_boolean(r->timed_out));
    json_object_set_new(o, "cancelled", json_boolean(r->cancelled));
    put_output(o, "stdout", r->stdout);
    put_output(o, "stderr", r->stderr);
    json_object_set_new(o, "started_at",
                        r->started_at_us ? json_string(cli_time(r->started_at_us))
                                         : json_null());
    json_object_set_new(o, "finished_at",
                        r->finished_at_us
                            ? json_string(cli_time(r->finished_at_us))
                            : json_null());
    json_object_set_new(o, "duration_ms",
                        json_real((double)r->duration_us / 1000.0));
    json_object_set_new(o, "term_sent_ms",
                        r->term_sent_us >= 0 && r->timed_out + r->cancelled +
                                                        r->signalled >
                                                    0
                            ? json_real((double)r->term_sent_us / 1000.0)
                            : json_null());
    json_object_set_new(o, "kill_sent_ms",
                        r->kill_sent_us > 0
                            ? json_real((double)r->kill_sent_us / 1000.0)
                            : json_null());
    json_object_set_new(o, "user_cpu_ms",
                        json_real((double)r->utime_us / 1000.0));
    json_object_set_new(o, "system_cpu_ms",
                        json_real((double)r->stime_us / 1000.0));
    json_object_set_new(o, "max_rss_kb", json_integer(r->maxrss_kb));
    json_object_set_new(o, "signalled", json_integer(r->signalled));
    json_object_set_new(o, "survivors", json_integer(r->survivors));
    if (r->reason[0])
        json_object_set_new(o, "reason", json_string(r->reason));
    if (r->status == KS__COMMAND_STATUS__START_FAILED) {
        json_object_set_new(o, "start_stage", json_string(r->start_stage));
        json_object_set_new(o, "start_errno", json_integer(r->start_errno));
        json_object_set_new(o, "start_error",
                            json_string(strerror(r->start_errno)));
    }
    return o;
}

json_t *
cli_event_json(const Ks__RecordedEvent *rec)
{
    const Ks__Event *e = rec->event;
    json_t *o = json_object();
    json_object_set_new(o, "version", json_integer(rec->version));
    json_object_set_new(o, "type", json_string(e ? e->type : ""));
    json_object_set_new(o, "event_id", json_string(e ? e->event_id : ""));
    json_object_set_new(o, "recorded_at",
                        json_string(cli_time(rec->recorded_at_us)));
    json_object_set_new(o, "global_pos", json_integer(rec->global_pos));
    if (!e)
        return o;
    json_object_set_new(o, "stream_id", json_string(e->stream_id));
    if (e->command_id[0])
        json_object_set_new(o, "command_id", json_string(e->command_id));
    if (e->agent_id[0])
        json_object_set_new(o, "agent_id", json_string(e->agent_id));
    if (e->attempt)
        json_object_set_new(o, "attempt", json_integer(e->attempt));
    if (e->operator_[0])
        json_object_set_new(o, "operator", json_string(e->operator_));
    if (e->reason[0] && strcmp(e->type, "CommandRequested") != 0)
        json_object_set_new(o, "reason", json_string(e->reason));
    if (e->command && e->command->spec) {
        const Ks__CommandSpec *sp = e->command->spec;
        json_t *argv = json_array(), *env = json_object();
        for (size_t i = 0; i < sp->n_argv; i++)
            json_array_append_new(argv, json_string(sp->argv[i]));
        for (size_t i = 0; i < sp->n_env; i++)
            json_object_set_new(env, sp->env[i]->name,
                                json_string(sp->env[i]->value));
        json_object_set_new(o, "argv", argv);
        json_object_set_new(o, "env", env);
        if (sp->n_sealed_env) {
            /* Redacted: the name, never the ciphertext (harmless, but
             * noise), only its size. */
            json_t *sec = json_array();
            for (size_t i = 0; i < sp->n_sealed_env; i++) {
                const Ks__SealedEnv *se = sp->sealed_env[i];
                json_t *x = json_object();
                json_object_set_new(env, se->name,
                                    json_string(CLI_SECRET_SHOWN));
                json_object_set_new(x, "name", json_string(se->name));
                json_object_set_new(x, "agent_id",
                                    json_string(se->agent_id));
                json_object_set_new(x, "sealed_bytes",
                                    json_integer((json_int_t)se->sealed.len));
                json_array_append_new(sec, x);
            }
            json_object_set_new(o, "secret_env", sec);
        }
        cli_payload_json(o, sp);
        json_object_set_new(o, "cwd", json_string(sp->cwd));
        json_object_set_new(o, "timeout_ms", json_integer(sp->timeout_ms));
        json_object_set_new(o, "grace_ms", json_integer(sp->grace_ms));
    }
    if (e->result)
        json_object_set_new(o, "result", cli_result_json(e->result));
    /* AgentLabelsChanged: the signed labels, and those they replaced. */
    if (e->labels) {
        json_t *now = json_object(), *was = json_object();
        for (size_t i = 0; i < e->labels->n_labels; i++)
            json_object_set_new(now, e->labels->labels[i]->name,
                                json_string(e->labels->labels[i]->value));
        for (size_t i = 0; i < e->labels->n_previous; i++)
            json_object_set_new(was, e->labels->previous[i]->name,
                                json_string(e->labels->previous[i]->value));
        json_object_set_new(o, "labels", now);
        json_object_set_new(o, "previous_labels", was);
        json_object_set_new(o, "labels_subject",
                            json_string(e->labels->subject));
    }
    /* Waves and reruns of a batch. */
    if (e->wave)
        json_object_set_new(o, "wave", json_integer(e->wave));
    if (e->halted)
        json_object_set_new(o, "halted", json_true());
    if (e->next_wave_at_us)
        json_object_set_new(o, "next_wave_at",
                            json_string(cli_time(e->next_wave_at_us)));
    if (e->rerun_batch_id[0])
        json_object_set_new(o, "rerun_batch_id",
                            json_string(e->rerun_batch_id));
    if (e->batch && e->batch->rerun_of[0])
        json_object_set_new(o, "rerun_of", json_string(e->batch->rerun_of));
    return o;
}

void
cli_print_json(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT | JSON_ENSURE_ASCII |
                                JSON_REAL_PRECISION(9));
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        free(s);
    }
    json_decref(j);
}

void
cli_printable(char *s)
{
    for (unsigned char *p = (unsigned char *)s; p && *p; p++) {
        if (*p < 0x20 || *p == 0x7f)
            *p = '?';
        else if (*p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f)
            p[0] = p[1] = '?';
    }
}

void
cli_shell_join(char *const *argv, size_t n, char *out, size_t cap)
{
    size_t used = 0;

    if (!cap)
        return;
#define PUT(ch)                                                              \
    do {                                                                     \
        if (used + 1 < cap)                                                  \
            out[used++] = (ch);                                              \
    } while (0)
    for (size_t i = 0; i < n; i++) {
        const char *a = argv[i];
        bool plain = a[0] != '\0';
        for (const char *p = a; *p && plain; p++)
            plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                    (*p >= '0' && *p <= '9') || strchr("_@%+=:,./-", *p) ||
                    (unsigned char)*p >= 0x80;
        bool control = false;
        for (const unsigned char *p = (const unsigned char *)a; *p; p++)
            control |= *p < 0x20 || *p == 0x7f ||
                       (*p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f);
        plain = plain && !control; /* a C1 control is >= 0x80 */
        if (i)
            PUT(' ');
        if (plain) {
            for (const char *p = a; *p; p++)
                PUT(*p);
            continue;
        }
        if (control) {
            /* $'...' (bash, ksh, zsh, POSIX.1-2024 sh): a control byte
             * as an escape, never raw, so the line is one line and no
             * escape sequence reaches the terminal. */
            static const char hex[] = "0123456789abcdef";
            PUT('$');
            PUT('\'');
            for (const unsigned char *p = (const unsigned char *)a; *p; p++) {
                bool c1 = *p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f;
                if (*p == '\n' || *p == '\t' || *p == '\r') {
                    PUT('\\');
                    PUT(*p == '\n' ? 'n' : *p == '\t' ? 't' : 'r');
                } else if (*p == '\\' || *p == '\'') {
                    PUT('\\');
                    PUT(*p);
                } else if (*p < 0x20 || *p == 0x7f || c1) {
                    size_t k = c1 ? 2 : 1; /* a C1 control is 2 bytes */
                    for (size_t j = 0; j < k; j++) {
                        PUT('\\');
                        PUT('x');
                        PUT(hex[p[j] >> 4]);
                        PUT(hex[p[j] & 15]);
                    }
                    p += k - 1;
                } else {
                    PUT(*p);
                }
            }
            PUT('\'');
            continue;
        }
        PUT('\'');
        for (const char *p = a; *p; p++) {
            if (*p == '\'') {
                PUT('\'');
                PUT('\\');
                PUT('\'');
            }
            PUT(*p);
        }
        PUT('\'');
    }
#undef PUT
    out[used] = '\0';
}

/* A time (epoch us) as cli_time's text, or null for 0. */
static json_t *
time_or_null(int64_t us)
{
    return us ? json_string(cli_time(us)) : json_null();
}

json_t *
cli_consumer_json(const Ks__AgentStatus *st)
{
    if (!st->consumer || !st->consumer[0])
        return json_null();
    json_t *o = json_object();
    json_object_set_new(o, "name", json_string(st->consumer));
    json_object_set_new(o, "stalled", st->consumer_stall[0]
                                          ? json_string(st->consumer_stall)
                                          : json_null());
    json_object_set_new(o, "stalled_since",
                        time_or_null(st->consumer_stalled_since_us));
    json_object_set_new(o, "repairs", json_integer(st->consumer_repairs));
    json_object_set_new(o, "last_repair",
                        st->consumer_last_repair[0]
                            ? json_string(st->consumer_last_repair)
                            : json_null());
    json_object_set_new(o, "repaired_at",
                        time_or_null(st->consumer_repaired_at_us));
    return o;
}

void
cli_consumer_line(const Ks__AgentStatus *st, int64_t now_us, char *buf,
                  size_t len)
{
    size_t l = 0;
    buf[0] = '\0';
    if (!st->consumer || !st->consumer[0])
        return;
    l += (size_t)snprintf(buf, len, "consumer %s", st->consumer);
    if (st->consumer_stall[0] && l < len)
        l += (size_t)snprintf(buf + l, len - l, " STALLED %.1f s: %s",
                              (double)(now_us -
                                       st->consumer_stalled_since_us) / 1e6,
                              st->consumer_stall);
    if (st->consumer_repairs && l < len)
        snprintf(buf + l, len - l, "%s repaired %u time%s, last %.1f s ago: %s",
                 st->consumer_stall[0] ? ";" : "", st->consumer_repairs,
                 st->consumer_repairs == 1 ? "" : "s",
                 (double)(now_us - st->consumer_repaired_at_us) / 1e6,
                 st->consumer_last_repair);
    cli_printable(buf);
}
