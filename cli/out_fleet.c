/*
 * Fleet results (kscore batch, kscore get batch-...): targets grouped by
 * outcome and output as clubak -b groups them, node sets folded
 * (out_fold.c), the targets that never answered named, counts per state,
 * and the batch's exit code. One printer for both commands.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_int.h"
#include "out_fold.h"

int
fleet_exit_code(const Ks__BatchCounts *c)
{
    if (!c)
        return CLI_EXIT_KSCORE;
    if (c->failed + c->killed + c->timed_out > 0)
        return 1; /* a target ran and failed */
    if (c->succeeded == c->total)
        return 0;
    return CLI_EXIT_NOT_ALL_RAN; /* none failed, some never ran (through) */
}

void
fleet_counts_text(const Ks__BatchCounts *c, unsigned dispatched, char *buf,
                  size_t len)
{
    unsigned in_flight = c ? c->running : 0;
    if (dispatched > in_flight)
        dispatched = in_flight;
    const struct {
        unsigned v;
        const char *name;
    } parts[] = {
        {c ? c->succeeded : 0, "succeeded"},
        {c ? c->failed : 0, "failed"},
        {c ? c->killed : 0, "killed"},
        {c ? c->timed_out : 0, "timed out"},
        {c ? c->no_response : 0, "no response"},
        {c ? c->lost : 0, "lost"},
        {c ? c->not_started : 0, "not started"},
        {c ? c->cancelled : 0, "cancelled"},
        {in_flight - dispatched, "running"},
        {dispatched, "dispatched"},
        {c ? c->pending : 0, "pending"},
    };
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        if (!parts[i].v || used >= len)
            continue;
        used += (size_t)snprintf(buf + used, len - used, "%s%u %s",
                                 used ? ", " : "", parts[i].v, parts[i].name);
    }
    if (used < len)
        snprintf(buf + used, len - used, "%s%u target%s", used ? " of " : "",
                 c ? c->total : 0, c && c->total == 1 ? "" : "s");
}

json_t *
fleet_target_json(const char *batch_id, const Ks__BatchTarget *t)
{
    json_t *o = cli_result_json(t->result);
    json_object_set_new(o, "batch_id", json_string(batch_id));
    json_object_set_new(o, "agent_id", json_string(t->agent_id));
    json_object_set_new(o, "command_id", json_string(t->command_id));
    json_object_set_new(o, "status",
                        json_string(kproto_status_name(t->status)));
    json_object_set_new(
        o, "truncated",
        json_boolean(t->result && ((t->result->stdout &&
                                    t->result->stdout->truncated) ||
                                   (t->result->stderr &&
                                    t->result->stderr->truncated))));
    return o;
}

/* ---- fetching the targets' results ---------------------------------------- */

int
fleet_results_load(struct fleet_results *fr, struct evt_conn *c,
                   Ks__BatchReply *rep, struct ks_map *have, bool json)
{
    memset(fr, 0, sizeof(*fr));
    fr->rep = rep;
    fr->n = rep->n_targets;
    fr->full = calloc(fr->n + 1, sizeof(*fr->full));
    fr->fetched = calloc(fr->n + 1, sizeof(*fr->fetched));
    if (!fr->full || !fr->fetched)
        return -1;
    for (size_t i = 0; i < fr->n; i++) {
        Ks__BatchTarget *t =
            have ? ks_map_get(have, rep->targets[i]->command_id) : NULL;
        bool printed = t != NULL;
        /* Output that travelled in pieces is not in the progress message's
         * result: fetch the whole result, as for a target never heard of. */
        if (t && t->result &&
            ((t->result->stdout && t->result->stdout->chunked_bytes >
                                         t->result->stdout->data.len) ||
             (t->result->stderr && t->result->stderr->chunked_bytes >
                                         t->result->stderr->data.len)))
            t = NULL;
        if (!t) {
            Ks__GetRequest g = KS__GET_REQUEST__INIT;
            t = rep->targets[i];
            g.id = t->command_id;
            if (t->command_id[0] && t->status != KS__COMMAND_STATUS__PENDING &&
                broker_call(c, EVT_API_GET, &g.base,
                            &ks__get_reply__descriptor, 5000,
                            (ProtobufCMessage **)&fr->fetched[i]) == 0 &&
                fr->fetched[i]->command) {
                /* Swap in the full result (none while it runs); swapped
                 * back in release. In flight: its own state, Dispatched
                 * or Running. */
                Ks__CommandResult *mine = t->result;
                if (fr->fetched[i]->command->result || !mine) {
                    t->result = fr->fetched[i]->command->result;
                    fr->fetched[i]->command->result = mine;
                }
                if (!kproto_status_terminal(t->status))
                    t->status = fr->fetched[i]->command->status;
            }
            if (json && !printed)
                cli_print_json(fleet_target_json(rep->batch_id, t));
        }
        fr->full[i] = t;
    }
    return 0;
}

void
fleet_results_release(struct fleet_results *fr)
{
    for (size_t i = 0; fr->fetched && i < fr->n; i++) {
        if (!fr->fetched[i])
            continue;
        if (fr->fetched[i]->command) {
            Ks__CommandResult *r = fr->rep->targets[i]->result;
            fr->rep->targets[i]->result = fr->fetched[i]->command->result;
            fr->fetched[i]->command->result = r;
        }
        ks__get_reply__free_unpacked(fr->fetched[i], NULL);
    }
    free(fr->full);
    free(fr->fetched);
    memset(fr, 0, sizeof(*fr));
}

/* ---- grouping ----------------------------------------------------------- */

static const Ks__Output *
out_of(const Ks__BatchTarget *t, bool err)
{
    if (!t->result)
        return NULL;
    return err ? t->result->stderr : t->result->stdout;
}

static int
cmp_output(const Ks__Output *a, const Ks__Output *b)
{
    size_t la = a ? a->data.len : 0, lb = b ? b->data.len : 0;
    int c;
    if (la != lb)
        return la < lb ? -1 : 1;
    if (la && (c = memcmp(a->data.data, b->data.data, la)))
        return c;
    bool ta = a && a->truncated, tb = b && b->truncated;
    if (ta != tb)
        return ta ? 1 : -1;
    uint64_t na = ta ? a->total_bytes : 0, nb = tb ? b->total_bytes : 0;
    return na == nb ? 0 : na < nb ? -1 : 1;
}

/* The group key: outcome (status, exit code, signal) then both outputs
 * (bytes, and truncation with its true size). 0: the same group. */
int
fleet_cmp_outcome(const Ks__BatchTarget *a, const Ks__BatchTarget *b)
{
    const Ks__CommandResult *ra = a->result, *rb = b->result;
    int c;
    if (a->status != b->status)
        return a->status < b->status ? -1 : 1;
    bool ea = ra && ra->has_exit_code, eb = rb && rb->has_exit_code;
    if (ea != eb)
        return ea ? -1 : 1;
    if (ea && ra->exit_code != rb->exit_code)
        return ra->exit_code < rb->exit_code ? -1 : 1;
    int sa = ra ? ra->signal : 0, sb = rb ? rb->signal : 0;
    if (sa != sb)
        return sa < sb ? -1 : 1;
    if ((c = cmp_output(out_of(a, false), out_of(b, false))))
        return c;
    return cmp_output(out_of(a, true), out_of(b, true));
}

static int
cmp_group_sort(const void *x, const void *y)
{
    const Ks__BatchTarget *a = *(Ks__BatchTarget *const *)x;
    const Ks__BatchTarget *b = *(Ks__BatchTarget *const *)y;
    int c = fleet_cmp_outcome(a, b);
    return c ? c : strcmp(a->agent_id, b->agent_id);
}

/* "Succeeded, exit 0", "Failed, signal 9", "TimedOut, signal 15". */
static void
outcome_text(const Ks__BatchTarget *t, char *buf, size_t len)
{
    const Ks__CommandResult *r = t->result;
    size_t used = (size_t)snprintf(buf, len, "%s",
                                   kproto_status_name(t->status));
    if (r && r->has_exit_code && used < len)
        used += (size_t)snprintf(buf + used, len - used, ", exit %d",
                                 r->exit_code);
    else if (r && r->signal && used < len)
        used += (size_t)snprintf(buf + used, len - used, ", signal %d",
                                 r->signal);
    for (int e = 0; e < 2 && used < len; e++) {
        const Ks__Output *o = out_of(t, e);
        if (o && o->truncated)
            used += (size_t)snprintf(
                buf + used, len - used,
                ", %s TRUNCATED (%llu of %llu bytes kept)",
                e ? "stderr" : "stdout", (unsigned long long)o->data.len,
                (unsigned long long)o->total_bytes);
    }
}

static void
print_bytes(FILE *f, const Ks__Output *o)
{
    fwrite(o->data.data, 1, o->data.len, f);
    if (o->data.data[o->data.len - 1] != '\n')
        fputc('\n', f);
}

static const char *
first_line(const Ks__BatchTarget *t, char *buf, size_t len)
{
    const Ks__Output *o = out_of(t, false);
    size_t n = 0;
    if (!o || !o->data.len)
        o = out_of(t, true);
    if (!o || !o->data.len)
        return t->result && t->result->reason[0] ? t->result->reason : "";
    while (n < o->data.len && n + 1 < len && o->data.data[n] != '\n') {
        unsigned char ch = o->data.data[n];
        buf[n] = ch >= 0x20 && ch != 0x7f ? (char)ch : '?';
        n++;
    }
    buf[n] = '\0';
    return buf;
}

/* Whether a target never answered: its agent never took the command. */
static bool
no_response(const Ks__BatchTarget *t)
{
    return t->status == KS__COMMAND_STATUS__UNDELIVERABLE;
}

static int
cmp_reason(const void *x, const void *y)
{
    const Ks__BatchTarget *a = *(Ks__BatchTarget *const *)x;
    const Ks__BatchTarget *b = *(Ks__BatchTarget *const *)y;
    const char *ra = a->result ? a->result->reason : "";
    const char *rb = b->result ? b->result->reason : "";
    int c = strcmp(ra, rb);
    return c ? c : strcmp(a->agent_id, b->agent_id);
}

/* "no response from: db-1 (offline since 12:03:11 UTC), web[2-3] (...)". */
static void
print_no_response(FILE *f, Ks__BatchTarget **v, size_t n)
{
    Ks__BatchTarget **nr = calloc(n + 1, sizeof(*nr));
    const char **ids = calloc(n + 1, sizeof(*ids));
    size_t k = 0;
    for (size_t i = 0; nr && i < n; i++)
        if (no_response(v[i]))
            nr[k++] = v[i];
    if (!nr || !ids || k == 0)
        goto out;
    qsort(nr, k, sizeof(*nr), cmp_reason);
    fputs("no response from: ", f);
    for (size_t i = 0; i < k;) {
        const char *why = nr[i]->result ? nr[i]->result->reason : "";
        size_t j = i, m = 0;
        while (j < k && strcmp(why, nr[j]->result ? nr[j]->result->reason
                                                  : "") == 0)
            ids[m++] = nr[j++]->agent_id;
        char *set = fold_nodeset(ids, m);
        fprintf(f, "%s%s", i ? ", " : "", set ? set : "?");
        if (why[0])
            fprintf(f, " (%s)", why);
        free(set);
        i = j;
    }
    fputc('\n', f);
out:
    free(nr);
    free(ids);
}

void
fleet_print(FILE *f, const Ks__BatchReply *rep, Ks__BatchTarget *const *full,
            size_t n)
{
    char line[160], what[256];
    Ks__BatchTarget **v = calloc(n + 1, sizeof(*v));
    const char **ids = calloc(n + 1, sizeof(*ids));

    fprintf(f, "%-24s %-13s %5s %10s  %s\n", "AGENT", "STATUS", "EXIT",
            "DURATION", "OUTPUT");
    for (size_t i = 0; i < n; i++) {
        const Ks__BatchTarget *t = full[i];
        const Ks__CommandResult *r = t->result;
        char exit_s[16] = "-", dur[24] = "-";
        bool trunc = r && ((r->stdout && r->stdout->truncated) ||
                           (r->stderr && r->stderr->truncated));
        if (r && r->has_exit_code)
            snprintf(exit_s, sizeof(exit_s), "%d", r->exit_code);
        else if (r && r->signal)
            snprintf(exit_s, sizeof(exit_s), "sig%d", r->signal);
        if (r && r->duration_us)
            snprintf(dur, sizeof(dur), "%.1fms",
                     (double)r->duration_us / 1000.0);
        fprintf(f, "%-24s %-13s %5s %10s  %s%s\n", t->agent_id,
                kproto_status_name(t->status), exit_s, dur,
                trunc ? "[TRUNCATED] " : "", first_line(t, line, sizeof(line)));
    }
    if (!v || !ids)
        goto out;
    /* clubak -b: one block per (outcome, stdout, stderr). */
    memcpy(v, full, n * sizeof(*v));
    qsort(v, n, sizeof(*v), cmp_group_sort);
    for (size_t i = 0; i < n;) {
        size_t j = i, m = 0;
        while (j < n && fleet_cmp_outcome(v[i], v[j]) == 0)
            ids[m++] = v[j++]->agent_id;
        char *set = fold_nodeset(ids, m);
        const Ks__Output *o = out_of(v[i], false), *e = out_of(v[i], true);
        outcome_text(v[i], what, sizeof(what));
        fprintf(f, "---------------\n%s (%zu): %s\n---------------\n",
                set ? set : "?", m, what);
        free(set);
        fflush(f);
        if (o && o->data.len)
            print_bytes(f, o);
        if (e && e->data.len) {
            fputs("[stderr]\n", f);
            print_bytes(f, e);
        }
        if ((!o || !o->data.len) && (!e || !e->data.len))
            fputs("(no output)\n", f);
        i = j;
    }
    print_no_response(f, v, n);
out:
    free(v);
    free(ids);
}

const char *
fleet_status_name(Ks__BatchStatus s)
{
    return kproto_batch_status_name(s);
}

void
fleet_waves_text(const Ks__BatchReply *rep, char *buf, size_t len)
{
    size_t n = rep->n_wave_ends, used;
    buf[0] = '\0';
    if (!n)
        return;
    used = (size_t)snprintf(buf, len, "waves: %zu (", n);
    for (size_t i = 0; i < n && used < len; i++) {
        if (i == 6 && n > 8) { /* the sizes repeat: enough to read */
            used += (size_t)snprintf(buf + used, len - used, ", ...");
            i = n - 1;
        }
        used += (size_t)snprintf(
            buf + used, len - used, "%s%u", i ? ", " : "",
            rep->wave_ends[i] - (i ? rep->wave_ends[i - 1] : 0));
    }
    if (used < len)
        used += (size_t)snprintf(buf + used, len - used, " targets)");
    if (rep->wave_pause_ms && used < len)
        used += (size_t)snprintf(buf + used, len - used, ", pause %.0fs",
                                 (double)rep->wave_pause_ms / 1000.0);
    if (used >= len)
        return;
    if (rep->halted)
        snprintf(buf + used, len - used, "; %s; the rest were cancelled",
                 rep->halt_reason);
    else if (rep->status != KS__BATCH_STATUS__BATCH_RUNNING &&
             rep->status != KS__BATCH_STATUS__BATCH_STATUS_UNSPECIFIED)
        snprintf(buf + used, len - used, "; %u of %zu ran", rep->wave, n);
    else if (rep->next_wave_at_us) {
        int64_t left = rep->next_wave_at_us - ks_now_us();
        snprintf(buf + used, len - used,
                 "; wave %u of %zu ended, wave %u starts in %.0fs",
                 rep->wave, n, rep->wave + 1,
                 left > 0 ? (double)left / 1e6 : 0.0);
    } else if (rep->wave)
        snprintf(buf + used, len - used, "; in wave %u of %zu", rep->wave, n);
}

void
fleet_summary(FILE *f, const Ks__BatchReply *rep, const char *budget)
{
    char counts[512];
    unsigned dispatched = 0;
    /* In flight: claimed (Running) or not yet (Dispatched), as each
     * target's line says. */
    for (size_t i = 0; i < rep->n_targets; i++)
        dispatched += rep->targets[i]->status == KS__COMMAND_STATUS__DISPATCHED;
    fleet_counts_text(rep->counts, dispatched, counts, sizeof(counts));
    fprintf(f, "%s: %s: %s", rep->batch_id, fleet_status_name(rep->status),
            counts);
    if (rep->elapsed_us > 0)
        fprintf(f, " in %.2fs", (double)rep->elapsed_us / 1e6);
    fputc('\n', f);
    if (budget && budget[0])
        fprintf(f, "%s\n", budget);
    char waves[512];
    fleet_waves_text(rep, waves, sizeof(waves));
    if (waves[0])
        fprintf(f, "%s\n", waves);
    if (rep->rerun_of[0])
        fprintf(f, "rerun of %s (its %s targets)\n", rep->rerun_of,
                strcmp(rep->rerun_filter, "not-succeeded") == 0
                    ? "not succeeded"
                    : "failed");
    for (size_t i = 0; i < rep->n_reruns; i++)
        fprintf(f, "%s %s\n", i ? "        " : "rerun by", rep->reruns[i]);
}

json_t *
cli_batch_json(const Ks__BatchReply *rep)
{
    const Ks__BatchCounts *c = rep->counts;
    json_t *o = json_object();
    json_object_set_new(o, "batch_id", json_string(rep->batch_id));
    json_object_set_new(o, "status",
                        json_string(fleet_status_name(rep->status)));
#define COUNT(name) json_object_set_new(o, #name, json_integer(c ? c->name : 0))
    COUNT(total);
    COUNT(succeeded);
    COUNT(failed);
    COUNT(killed);
    COUNT(timed_out);
    COUNT(no_response);
    COUNT(lost);
    COUNT(not_started);
    COUNT(cancelled);
    COUNT(running);
    COUNT(pending);
    COUNT(errors);
#undef COUNT
    /* A batch that runs has no exit code yet (4 said "some never ran"). */
    json_object_set_new(o, "exit_code",
                        rep->status == KS__BATCH_STATUS__BATCH_RUNNING
                            ? json_null()
                            : json_integer(fleet_exit_code(c)));
    json_object_set_new(o, "elapsed_ms",
                        json_real((double)rep->elapsed_us / 1000.0));
    json_object_set_new(o, "max_concurrency",
                        json_integer(rep->max_concurrency));
    json_object_set_new(o, "max_errors",
                        rep->has_max_errors ? json_integer(rep->max_errors)
                                            : json_null());
    /* Waves: each one's size, the one now, a halt. */
    json_t *waves = rep->n_wave_ends ? json_array() : json_null();
    for (size_t i = 0; i < rep->n_wave_ends; i++)
        json_array_append_new(
            waves, json_integer(rep->wave_ends[i] -
                                (i ? rep->wave_ends[i - 1] : 0)));
    json_object_set_new(o, "waves", waves);
    json_object_set_new(o, "wave", json_integer(rep->wave));
    json_object_set_new(o, "wave_pause_ms",
                        json_integer((json_int_t)rep->wave_pause_ms));
    json_object_set_new(o, "next_wave_at",
                        rep->next_wave_at_us
                            ? json_string(cli_time(rep->next_wave_at_us))
                            : json_null());
    json_object_set_new(o, "halted", json_boolean(rep->halted));
    json_object_set_new(o, "halted_wave",
                        rep->halted ? json_integer(rep->halted_wave)
                                    : json_null());
    json_object_set_new(o, "halt_reason",
                        rep->halted ? json_string(rep->halt_reason)
                                    : json_null());
    /* A rerun's original, and this batch's reruns. */
    json_object_set_new(o, "rerun_of", rep->rerun_of[0]
                                           ? json_string(rep->rerun_of)
                                           : json_null());
    json_object_set_new(o, "rerun_filter",
                        rep->rerun_of[0] ? json_string(rep->rerun_filter)
                                         : json_null());
    json_t *reruns = json_array();
    for (size_t i = 0; i < rep->n_reruns; i++)
        json_array_append_new(reruns, json_string(rep->reruns[i]));
    json_object_set_new(o, "reruns", reruns);
    json_t *targets = json_array();
    for (size_t i = 0; i < rep->n_targets; i++) {
        const Ks__BatchTarget *bt = rep->targets[i];
        json_t *t = json_object();
        json_object_set_new(t, "agent_id", json_string(bt->agent_id));
        json_object_set_new(t, "command_id", json_string(bt->command_id));
        json_object_set_new(t, "status",
                            json_string(kproto_status_name(bt->status)));
        if (bt->result) {
            const Ks__CommandResult *r = bt->result;
            json_object_set_new(t, "exit_code",
                                r->has_exit_code ? json_integer(r->exit_code)
                                                 : json_null());
            json_object_set_new(t, "signal", r->signal
                                                 ? json_integer(r->signal)
                                                 : json_null());
            if (r->reason[0])
                json_object_set_new(t, "reason", json_string(r->reason));
        }
        json_array_append_new(targets, t);
    }
    json_object_set_new(o, "targets", targets);
    return o;
}
