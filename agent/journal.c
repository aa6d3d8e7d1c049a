/*
 * journal.c: the agent's journal of the command messages it holds (format
 * in agent_int.h), and what a restarted agent makes of it.
 *
 * The point is that a restart can tell apart a command that may have run
 * (Lost: it may have done part of its work) from one that provably never
 * started (claimed, but "spawned" was never written: it is written before
 * the command goes to the executor, and again with its pid once spawned;
 * written only after the spawn, a child that ran before the mark was run
 * again by the restart). The latter's claim id is on its claim line, written
 * before the claim was sent: the restart claims with it again (the claim
 * may have won while its reply was lost) and runs the command once;
 * without a readable claim id it reports NotStarted.
 */
#include <dirent.h>
#include <stdbool.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent_int.h"

/* Longest journal file read back (line 1 with a long ack subject, plus
 * the claim and spawned lines). */
#define JOURNAL_MAX_BYTES 4096
_Static_assert(JOURNAL_SPAWN_FIELD >= 8 + 10, "spawned <pid>");

static void
journal_path(struct agent *a, const char *command_id, char *buf, size_t len)
{
    snprintf(buf, len, "%s/running/%s", a->state_dir, command_id);
}

static void
spare_path(struct agent *a, unsigned long n, char *buf, size_t len)
{
    snprintf(buf, len, "%s/spare/%lu", a->state_dir, n);
}

void
agent__spare_init(struct agent *a)
{
    char dir[4200];
    DIR *d;
    struct dirent *de;

    pthread_mutex_init(&a->spare_mu, NULL);
    if (!a->state_dir)
        return;
    snprintf(dir, sizeof(dir), "%s/spare", a->state_dir);
    mkdir(dir, 0700);
    if (!(d = opendir(dir)))
        return;
    while ((de = readdir(d))) {
        char *end;
        unsigned long n = strtoul(de->d_name, &end, 10);
        if (de->d_name[0] < '0' || de->d_name[0] > '9' || *end)
            continue;
        if (a->nspares < AGENT_SPARE_MAX) {
            a->spares[a->nspares++] = n;
        } else {
            char p[4300];
            spare_path(a, n, p, sizeof(p));
            unlink(p);
        }
        if (n >= a->spare_next)
            a->spare_next = n + 1;
    }
    closedir(d);
}

int
agent__file_put(struct agent *a, const char *path, const void *data,
                size_t len)
{
    char sp[4300];
    unsigned long n;
    bool reuse;
    int fd, rc = 0;

    pthread_mutex_lock(&a->spare_mu);
    reuse = a->nspares > 0;
    n = reuse ? a->spares[--a->nspares] : a->spare_next++;
    pthread_mutex_unlock(&a->spare_mu);
    spare_path(a, n, sp, sizeof(sp));
    /* Written first, renamed into place after: a crash in between leaves
     * a spare, never a file holding another command's lines. Overwritten
     * from offset 0 and then cut to size, not truncated first: a small
     * file keeps its block instead of freeing and allocating one. */
    fd = open(sp, O_WRONLY | O_CLOEXEC | (reuse ? 0 : O_CREAT), 0600);
    if (fd == -1 && reuse && errno == ENOENT)
        fd = open(sp, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd == -1)
        return -errno;
    size_t total = len;
    off_t at = 0;
    while (len && rc == 0) {
        ssize_t w = pwrite(fd, data, len, at);
        if (w == -1 && errno == EINTR)
            continue;
        if (w <= 0)
            rc = w == -1 ? -errno : -EIO;
        else {
            data = (const char *)data + w;
            len -= (size_t)w;
            at += w;
        }
    }
    if (rc == 0 && ftruncate(fd, (off_t)total) == -1)
        rc = -errno;
    close(fd);
    if (rc == 0 && rename(sp, path) == -1)
        rc = -errno;
    if (rc)
        unlink(sp);
    return rc;
}

void
agent__file_drop(struct agent *a, const char *path)
{
    char sp[4300];
    unsigned long n = 0;
    bool keep;

    pthread_mutex_lock(&a->spare_mu);
    keep = a->nspares < AGENT_SPARE_MAX;
    if (keep)
        n = a->spare_next++;
    pthread_mutex_unlock(&a->spare_mu);
    if (keep) {
        spare_path(a, n, sp, sizeof(sp));
        if (rename(path, sp) == 0) {
            pthread_mutex_lock(&a->spare_mu);
            if (a->nspares < AGENT_SPARE_MAX) {
                a->spares[a->nspares++] = n;
                keep = false; /* kept: nothing left to do */
            }
            pthread_mutex_unlock(&a->spare_mu);
            if (keep)
                unlink(sp); /* the pool filled meanwhile */
            return;
        }
    }
    unlink(path);
}

/* Failures of the state dir: one log line per LOG_EVERY_US, a counter
 * for each. */
static void
journal_failed(struct agent *a, const char *command_id, const char *what,
               int err)
{
    ks_metric_inc(KS_C_AGENT_STATE_WRITE_ERRORS);
    if (agent__log_due(&a->journal_err_logged_us))
        ks_log(KS_LOG_ERROR, what, KS_S("module", "journal"),
               KS_S("command_id", command_id), KS_S("error", strerror(-err)),
               KS_S("state_dir", a->state_dir));
}

int
agent__journal_hold(struct agent *a, struct job_ctx *j,
                    const char *claim_event_id)
{
    char path[4200], buf[JOURNAL_MAX_BYTES];
    int n, rc;

    j->spawn_at = -1;
    if (!a->state_dir)
        return 0;
    journal_path(a, j->command_id, path, sizeof(path));
    n = snprintf(buf, sizeof(buf), "%s %u %s %s\n", j->slot->id, j->attempt,
                 j->operator_name[0] ? j->operator_name : "-",
                 j->ack_subject && j->ack_subject[0] ? j->ack_subject : "-");
    if (n < 0 || (size_t)n >= sizeof(buf)) {
        rc = -ENAMETOOLONG;
        goto out;
    }
    if (claim_event_id) {
        /* The claim, then the room "spawned <pid>" takes later: written
         * now, while the claim can still be refused, so that the spawn
         * only overwrites bytes the file already has. */
        int m = snprintf(buf + n, sizeof(buf) - (size_t)n, "claim %s\n%-*s\n",
                         claim_event_id, JOURNAL_SPAWN_FIELD, "pending");
        if (m < 0 || (size_t)m >= sizeof(buf) - (size_t)n) {
            rc = -ENAMETOOLONG;
            goto out;
        }
        j->spawn_at = n + m - (JOURNAL_SPAWN_FIELD + 1);
        n += m;
    }
    rc = agent__file_put(a, path, buf, (size_t)n);
out:
    if (rc) {
        j->spawn_at = -1;
        journal_failed(a, j->command_id,
                       claim_event_id
                           ? "cannot journal a claim: refused, the message "
                             "goes back to JetStream"
                           : "cannot journal a waiting message: handed back "
                             "to JetStream",
                       rc);
    }
    return rc;
}

int
agent__journal_spawned(struct agent *a, const struct job_ctx *j, pid_t pid)
{
    char path[4200], line[JOURNAL_SPAWN_FIELD + 2];
    ssize_t w;
    int fd, rc = 0;

    if (!a->state_dir || j->spawn_at < 0)
        return 0;
    journal_path(a, j->command_id, path, sizeof(path));
    snprintf(line, sizeof(line), "spawned %-*d\n", JOURNAL_SPAWN_FIELD - 8,
             (int)pid);
    fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd == -1) {
        rc = -errno;
    } else {
        do {
            w = pwrite(fd, line, JOURNAL_SPAWN_FIELD + 1, j->spawn_at);
        } while (w == -1 && errno == EINTR);
        if (w == -1)
            rc = -errno;
        else if (w != JOURNAL_SPAWN_FIELD + 1)
            rc = -EIO;
        close(fd);
    }
    if (rc)
        journal_failed(a, j->command_id,
                       "cannot journal a spawn: a restart would call the "
                       "running command NotStarted",
                       rc);
    return rc;
}

void
agent__journal_remove(struct agent *a, const char *command_id)
{
    char path[4200];

    if (!a->state_dir)
        return;
    journal_path(a, command_id, path, sizeof(path));
    agent__file_drop(a, path);
}

/* What one journal file says. */
struct entry {
    char agent_id[EVT_AGENT_ID_MAX + 1];
    unsigned attempt;
    char op[64];
    char ack[JOURNAL_MAX_BYTES];
    bool claimed, spawned;
    char claim_id[37]; /* "" when the claim line names none */
    long pid;
};

static int
parse(const char *path, struct entry *e)
{
    char buf[JOURNAL_MAX_BYTES + 1], *line, *save = NULL;
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC), fields;

    if (fd == -1)
        return -errno;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -EIO;
    buf[n] = '\0';
    memset(e, 0, sizeof(*e));
    line = strtok_r(buf, "\n", &save);
    if (!line)
        return -EIO;
    fields = sscanf(line, "%128s %u %63s %4095s", e->agent_id, &e->attempt,
                    e->op, e->ack);
    if (fields < 3)
        return -EIO;
    if (fields == 3) {
        /* A marker of an older agent: written at claim, never told the
         * spawn apart. Assume it ran: Lost, as before. */
        e->claimed = e->spawned = true;
        return 0;
    }
    while ((line = strtok_r(NULL, "\n", &save))) {
        if (!strncmp(line, "claim ", 6)) {
            e->claimed = true;
            if (ks_is_uuid(line + 6))
                snprintf(e->claim_id, sizeof(e->claim_id), "%s", line + 6);
        }
        else if (!strncmp(line, "spawned ", 8)) { /* not "pending" */
            e->spawned = true;
            e->pid = atol(line + 8);
        }
    }
    return 0;
}

void
agent__report_end(struct agent *a, const char *command_id,
                  const char *agent_id, uint32_t attempt,
                  const char *operator_name, const char *type,
                  Ks__CommandStatus status, const char *reason, long pid)
{
    Ks__Event ev = KS__EVENT__INIT;
    Ks__CommandResult r = KS__COMMAND_RESULT__INIT;
    char event_id[37], stream[64];

    ks_uuid(event_id);
    snprintf(stream, sizeof(stream), "command-%s", command_id);
    r.status = status;
    r.term_sent_us = r.kill_sent_us = -1;
    r.pid = (int32_t)pid;
    r.reason = (char *)reason;
    ev.event_id = event_id;
    ev.stream_id = stream;
    ev.type = (char *)type;
    ev.occurred_at_us = ks_now_us();
    ev.command_id = (char *)command_id;
    ev.agent_id = (char *)agent_id;
    ev.attempt = attempt;
    ev.operator_ = (char *)(operator_name ? operator_name : "");
    ev.reason = r.reason;
    ev.result = &r;
    agent__queue_event(a, &ev);
}

/* agent__report_end of what journal entry e says. */
static void
report(struct agent *a, const char *command_id, const struct entry *e,
       const char *type, Ks__CommandStatus status, const char *reason)
{
    agent__report_end(a, command_id, e->agent_id, e->attempt,
                      strcmp(e->op, "-") ? e->op : "", type, status, reason,
                      e->pid);
}

void
agent__journal_recover(struct agent *a)
{
    char dir[4200];
    DIR *d;
    struct dirent *de;
    unsigned lost = 0, not_started = 0, requeued = 0, reclaimed = 0;

    snprintf(dir, sizeof(dir), "%s/running", a->state_dir);
    d = opendir(dir);
    if (!d)
        return;
    while ((de = readdir(d))) {
        char path[4500], command_id[37];
        struct entry e;
        if (!ks_is_uuid(de->d_name))
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        memcpy(command_id, de->d_name, 36);
        command_id[36] = '\0';
        if (parse(path, &e) != 0) {
            unlink(path);
            continue;
        }
        bool have_ack = e.ack[0] && strcmp(e.ack, "-") != 0;
        if (e.spawned) {
            report(a, command_id, &e, "CommandLost", KS__COMMAND_STATUS__LOST,
                   "the agent died while the command ran: its watchdog "
                   "killed the command's processes (SIGKILL to the process "
                   "group, cgroup.kill) and the restarted agent made sure");
            lost++;
        } else if (e.claimed && e.claim_id[0] &&
                   agent__claim_recovered(a, command_id, e.agent_id,
                                          e.attempt,
                                          strcmp(e.op, "-") ? e.op : "",
                                          e.claim_id) == 0) {
            /* Its claim may have won while its reply was lost: claimed
             * again with the same id when JetStream delivers it again
             * (now: the nak), it runs once; the file stays until then. */
            if (have_ack)
                agent__ack(a, e.ack, "-NAK");
            reclaimed++;
            continue;
        } else if (e.claimed) {
            report(a, command_id, &e, "CommandNotStarted",
                   KS__COMMAND_STATUS__NOT_STARTED,
                   "the agent claimed the command but died before it "
                   "spawned it: it never ran");
            not_started++;
        } else {
            /* Never claimed: JetStream may give it to us (or a peer of
             * the same id) again at once. */
            if (have_ack)
                agent__ack(a, e.ack, "-NAK");
            requeued++;
            unlink(path);
            continue;
        }
        /* Its result is queued (outbox): JetStream may forget it. */
        if (have_ack)
            agent__ack(a, e.ack, "+ACK");
        unlink(path);
    }
    closedir(d);
    if (lost || not_started || requeued || reclaimed)
        ks_log(KS_LOG_WARN,
               "a previous run left commands: running ones reported Lost, "
               "claimed but never started claimed again with the same "
               "claim id, waiting ones handed back to JetStream",
               KS_S("module", "journal"), KS_I("lost", lost),
               KS_I("reclaimed", reclaimed),
               KS_I("not_started", not_started), KS_I("requeued", requeued),
               KS_S("state_dir", a->state_dir));
}
