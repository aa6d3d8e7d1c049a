/* ks_log: one line per event, text (logfmt) or JSON, on stderr. */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kproto.h"

#define LOG_VALUE_MAX (64 * 1024)
#define LOG_FIELDS_MAX 32

static enum ks_log_format log_format = KS_LOG_TEXT;
static enum ks_log_level log_min = KS_LOG_INFO;
static const char *log_component;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

/* 1 when stderr is the journal: JOURNAL_STREAM ("<dev>:<inode>", set by
 * systemd) names the very stream fd 2 is (systemd.exec(5)), not merely
 * one a parent had. */
static int
stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 ||
        fstat(2, &st) != 0)
        return 0;
    return (unsigned long long)st.st_dev == dev &&
           (unsigned long long)st.st_ino == ino;
}

static int log_journal = -1; /* -1: not looked yet */

void
ks_log_setup(enum ks_log_format format, enum ks_log_level min,
             const char *component)
{
    log_format = format;
    log_min = min;
    log_component = component;
    log_journal = stderr_is_journal();
}

enum ks_log_format
ks_log_format_get(void)
{
    return log_format;
}

enum ks_log_level
ks_log_level_get(void)
{
    return log_min;
}

int
ks_log_enabled(enum ks_log_level level)
{
    return level >= log_min;
}

const char *
ks_log_level_name(enum ks_log_level level)
{
    return level >= KS_LOG_DEBUG && level <= KS_LOG_ERROR ? level_names[level]
                                                          : "info";
}

const char *
ks_log_format_name(enum ks_log_format format)
{
    return format == KS_LOG_JSON ? "json" : "text";
}

int
ks_log_level_parse(const char *s, enum ks_log_level *out)
{
    for (int i = KS_LOG_DEBUG; i <= KS_LOG_ERROR; i++)
        if (strcmp(s, level_names[i]) == 0) {
            *out = (enum ks_log_level)i;
            return 0;
        }
    if (strcmp(s, "warning") == 0) {
        *out = KS_LOG_WARN;
        return 0;
    }
    return KS_EINVAL;
}

int
ks_log_format_parse(const char *s, enum ks_log_format *out)
{
    if (strcmp(s, "text") == 0)
        *out = KS_LOG_TEXT;
    else if (strcmp(s, "json") == 0)
        *out = KS_LOG_JSON;
    else
        return KS_EINVAL;
    return 0;
}

/* ---- a growing buffer ---------------------------------------------------- */

struct lbuf {
    char *p;
    size_t n, cap;
    bool oom;
};

static void
lb_put(struct lbuf *b, const char *s, size_t len)
{
    if (b->oom)
        return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + len + 1)
            cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

static void
lb_str(struct lbuf *b, const char *s)
{
    lb_put(b, s, strlen(s));
}

static void
lb_printf(struct lbuf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n > 0)
        lb_put(b, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

/* Length of the valid UTF-8 sequence at s (of at most len bytes), or 0. */
static size_t
utf8_len(const unsigned char *s, size_t len)
{
    size_t need;
    unsigned c = s[0];
    unsigned cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        need = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        need = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        need = 4, cp = c & 0x07;
    else
        return 0;
    if (len < need)
        return 0;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    /* overlong, surrogates, past U+10FFFF */
    if ((need == 3 && cp < 0x800) || (need == 4 && cp < 0x10000) ||
        (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
        return 0;
    return need;
}

/* A JSON string body: quotes, backslashes and control bytes escaped;
 * an invalid UTF-8 byte becomes U+FFFD, so the line is always JSON. */
static void
json_escape(struct lbuf *b, const char *s)
{
    size_t len = s ? strlen(s) : 0;
    if (len > LOG_VALUE_MAX)
        len = LOG_VALUE_MAX;
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            lb_put(b, e, 2);
            i++;
        } else if (c == '\n') {
            lb_str(b, "\\n"), i++;
        } else if (c == '\t') {
            lb_str(b, "\\t"), i++;
        } else if (c == '\r') {
            lb_str(b, "\\r"), i++;
        } else if (c < 0x20 || c == 0x7f) {
            lb_printf(b, "\\u%04x", c), i++;
        } else {
            size_t k = utf8_len((const unsigned char *)s + i, len - i);
            if (k == 0) {
                lb_str(b, "\\ufffd");
                i++;
            } else {
                lb_put(b, s + i, k);
                i += k;
            }
        }
    }
}

static bool
text_needs_quotes(const char *s)
{
    size_t len = s ? strlen(s) : 0;
    if (!len)
        return true;
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f)
            return true;
        size_t k = utf8_len((const unsigned char *)s + i, len - i);
        if (!k)
            return true; /* shown as \ufffd, which needs the quotes */
        i += k;
    }
    return false;
}

/* logfmt value: bare when it can be, else quoted with Go-style escapes
 * (\" \\ \n \t \r, other control bytes \u00XX; UTF-8 kept, an invalid
 * byte \ufffd as in JSON). */
static void
text_value(struct lbuf *b, const char *s)
{
    if (!text_needs_quotes(s)) {
        json_escape(b, s); /* nothing to escape: copied (up to the cap) */
        return;
    }
    lb_put(b, "\"", 1);
    json_escape(b, s);
    lb_put(b, "\"", 1);
}

/* A key: letters, digits, '_', '.', '-'; anything else becomes '_', so a
 * careless key never breaks the line. */
static void
put_key(struct lbuf *b, const char *k)
{
    for (const char *p = k; *p; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                  (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
        lb_put(b, ok ? p : "_", 1);
    }
}

static void
rfc3339(char out[64], int64_t us)
{
    time_t t = (time_t)(us / 1000000);
    struct tm tm;
    gmtime_r(&t, &tm);
    snprintf(out, 64, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
             tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
             tm.tm_min, tm.tm_sec, (int)((us / 1000) % 1000));
}

char *
ks_log_format_line(enum ks_log_format format, int64_t now_us, int with_time,
                   enum ks_log_level level, const char *component,
                   const char *msg, const struct ks_log_field *fields,
                   size_t n_fields)
{
    struct lbuf b = {0};
    char ts[64];
    bool json = format == KS_LOG_JSON;

    rfc3339(ts, now_us);
    if (json) {
        lb_str(&b, "{");
        if (with_time) {
            lb_str(&b, "\"time\":\"");
            lb_str(&b, ts);
            lb_str(&b, "\",");
        }
        lb_str(&b, "\"level\":\"");
        lb_str(&b, ks_log_level_name(level));
        lb_str(&b, "\",\"msg\":\"");
        json_escape(&b, msg);
        lb_str(&b, "\"");
        if (component) {
            lb_str(&b, ",\"service\":\"");
            json_escape(&b, component);
            lb_str(&b, "\"");
        }
    } else {
        if (with_time) {
            lb_str(&b, "time=");
            lb_str(&b, ts);
            lb_str(&b, " ");
        }
        lb_str(&b, "level=");
        lb_str(&b, ks_log_level_name(level));
        lb_str(&b, " msg=");
        text_value(&b, msg);
        if (component) {
            lb_str(&b, " service=");
            text_value(&b, component);
        }
    }
    for (size_t i = 0; i < n_fields; i++) {
        const struct ks_log_field *f = &fields[i];
        lb_str(&b, json ? ",\"" : " ");
        put_key(&b, f->key);
        lb_str(&b, json ? "\":" : "=");
        switch (f->kind) {
        case 'i':
            lb_printf(&b, "%lld", f->i);
            break;
        case 'd':
            /* JSON has no NaN or infinity */
            if (f->d != f->d || f->d > 1e300 || f->d < -1e300)
                lb_str(&b, json ? "null" : "NaN");
            else
                lb_printf(&b, "%.3f", f->d);
            break;
        default:
            if (json) {
                lb_str(&b, "\"");
                json_escape(&b, f->s);
                lb_str(&b, "\"");
            } else {
                text_value(&b, f->s ? f->s : "");
            }
        }
    }
    lb_str(&b, json ? "}\n" : "\n");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

void
ks__log(enum ks_log_level level, const char *msg, ...)
{
    struct ks_log_field fields[LOG_FIELDS_MAX];
    size_t n = 0;
    va_list ap;

    if (level < log_min)
        return;
    va_start(ap, msg);
    for (;;) {
        struct ks_log_field f = va_arg(ap, struct ks_log_field);
        if (!f.key)
            break;
        if (n < LOG_FIELDS_MAX)
            fields[n++] = f;
    }
    va_end(ap);
    /* journald stamps each line; the text then need not. */
    if (log_journal < 0)
        log_journal = stderr_is_journal();
    int with_time = log_format == KS_LOG_JSON || !log_journal;
    char *line = ks_log_format_line(log_format, ks_now_us(), with_time, level,
                                    log_component, msg, fields, n);
    if (!line) {
        static const char oom[] = "level=error msg=\"log: out of memory\"\n";
        (void)!write(2, oom, sizeof(oom) - 1);
        return;
    }
    /* One write per line: lines of concurrent threads never mix. */
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t w = write(2, line + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    free(line);
}
