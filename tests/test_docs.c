/*
 * The documentation keeps up with the binary: every subcommand that
 * `kscore --help` lists has a man page (deploy/man/kscore-CMD.1.scd) that
 * scdoc builds and the build made, named in kscore.1; every flag a
 * subcommand's --help shows is in its page and in the bash completion.
 * Fails when a flag or a subcommand is added without its documentation.
 * The README is a short front page that links every guide in docs/; the
 * guides' links resolve, and so does every docs/<guide>.md "Section" that
 * the code, the man pages and the other documents name.
 */
#include <check.h>
#include <ctype.h>
#include <ftw.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"

static char *
slurp(const char *path)
{
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t len = 0;
    if (!f)
        return NULL;
    FILE *m = open_memstream(&buf, &len);
    char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0)
        fwrite(chunk, 1, n, m);
    fclose(f);
    fclose(m);
    return buf;
}

static const char *
src_dir(void)
{
    const char *d = getenv("KSCORE_SOURCE_DIR");
    ck_assert_msg(d && d[0], "KSCORE_SOURCE_DIR is not set");
    return d;
}

/* The subcommands `kscore --help` lists (indented two spaces), once each,
 * into names; returns the count. */
static size_t
subcommands(char names[][32], size_t cap)
{
    struct fixture_out o;
    const char *args[] = {"--help", NULL};
    size_t n = 0;
    ck_assert_int_eq(fixture_kscore_home("/nonexistent", args, &o), 0);
    ck_assert_int_eq(o.status, 0);
    for (char *save = NULL, *line = strtok_r(o.out, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "  ", 2) != 0 || !islower((unsigned char)line[2]))
            continue;
        char name[32];
        size_t k = 0;
        for (const char *p = line + 2; islower((unsigned char)*p) && k < 31;
             p++)
            name[k++] = *p;
        name[k] = '\0';
        bool dup = false;
        for (size_t i = 0; i < n; i++)
            dup |= strcmp(names[i], name) == 0;
        if (!dup && n < cap)
            snprintf(names[n++], 32, "%s", name);
    }
    fixture_out_release(&o);
    return n;
}

/* Whether text holds flag as a whole word ("--json", not "--json-x"). */
static bool
has_flag(const char *text, const char *flag)
{
    size_t n = strlen(flag);
    for (const char *p = strstr(text, flag); p; p = strstr(p + 1, flag)) {
        char after = p[n];
        bool before_ok = p == text || !(isalnum((unsigned char)p[-1]) ||
                                        p[-1] == '-');
        if (before_ok && !(isalnum((unsigned char)after) || after == '-'))
            return true;
    }
    return false;
}

START_TEST(every_subcommand_has_a_page_that_builds)
{
    char names[64][32], path[PATH_MAX];
    size_t n = subcommands(names, 64);
    ck_assert_msg(n >= 15, "only %zu subcommands in kscore --help", n);
    snprintf(path, sizeof(path), "%s/deploy/man/kscore.1.scd", src_dir());
    char *top = slurp(path);
    ck_assert_msg(top != NULL, "no %s", path);

    /* The built pages: <build>/man, next to <build>/cli/kscore. */
    char built[PATH_MAX];
    const char *bin = getenv("KSCORE_BIN");
    ck_assert_msg(bin && bin[0], "KSCORE_BIN is not set");
    snprintf(built, sizeof(built), "%s", bin);
    char *slash = strrchr(built, '/');
    ck_assert_ptr_nonnull(slash);
    *slash = '\0';
    slash = strrchr(built, '/');
    ck_assert_ptr_nonnull(slash);
    *slash = '\0'; /* <build> */

    for (size_t i = 0; i <= n; i++) {
        char page[64], ref[128], cmd[PATH_MAX * 2 + 64], out[PATH_MAX + 80];
        struct stat sb;
        if (i < n)
            snprintf(page, sizeof(page), "kscore-%.31s.1", names[i]);
        else
            snprintf(page, sizeof(page), "kscore.1");
        snprintf(path, sizeof(path), "%s/deploy/man/%s.scd", src_dir(), page);
        ck_assert_msg(access(path, R_OK) == 0, "no man page %s", path);
        snprintf(cmd, sizeof(cmd), "scdoc < '%s' > /dev/null", path);
        int st = system(cmd);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                      "scdoc fails on %s", path);
        snprintf(out, sizeof(out), "%s/man/%s", built, page);
        ck_assert_msg(stat(out, &sb) == 0 && sb.st_size > 0,
                      "the build did not make %s", out);
        if (i < n) {
            snprintf(ref, sizeof(ref), "*kscore-%.31s*(1)", names[i]);
            ck_assert_msg(strstr(top, ref) != NULL,
                          "kscore.1.scd does not name %s", ref);
        }
    }
    free(top);
}
END_TEST

START_TEST(every_flag_in_help_is_documented)
{
    char names[64][32], path[PATH_MAX];
    size_t n = subcommands(names, 64);
    snprintf(path, sizeof(path), "%s/deploy/bash-completion/kscore",
             src_dir());
    char *completion = slurp(path);
    ck_assert_msg(completion != NULL, "no %s", path);

    for (size_t i = 0; i < n; i++) {
        struct fixture_out o;
        const char *args[] = {names[i], "--help", NULL};
        ck_assert_int_eq(fixture_kscore_home("/nonexistent", args, &o), 0);
        ck_assert_msg(o.status == 0, "%s --help: exit %d", names[i],
                      o.status);
        snprintf(path, sizeof(path), "%s/deploy/man/kscore-%s.1.scd",
                 src_dir(), names[i]);
        char *page = slurp(path);
        ck_assert_msg(page != NULL, "no %s", path);
        ck_assert_msg(has_flag(completion, names[i]),
                      "the bash completion does not know '%s'", names[i]);
        for (const char *p = strstr(o.out, "--"); p; p = strstr(p + 2, "--")) {
            char flag[64];
            size_t k = 0;
            if (!islower((unsigned char)p[2]))
                continue;
            flag[k++] = '-';
            flag[k++] = '-';
            for (const char *q = p + 2;
                 (islower((unsigned char)*q) || isdigit((unsigned char)*q) ||
                  *q == '-') &&
                 k < sizeof(flag) - 1;
                 q++)
                flag[k++] = *q;
            while (k > 2 && flag[k - 1] == '-')
                k--;
            flag[k] = '\0';
            ck_assert_msg(has_flag(page, flag),
                          "kscore %s --help shows %s; kscore-%s.1.scd does "
                          "not document it",
                          names[i], flag, names[i]);
            ck_assert_msg(has_flag(completion, flag),
                          "kscore %s --help shows %s; the bash completion "
                          "does not offer it",
                          names[i], flag);
        }
        free(page);
        fixture_out_release(&o);
    }
    free(completion);
}
END_TEST

/* What the completion offers for the words (the last one being
 * completed), as bash would call it; malloc'd. */
static char *
complete_words(const char *words)
{
    char cmd[PATH_MAX * 2];
    snprintf(cmd, sizeof(cmd),
             "bash -c 'source \"%s/deploy/bash-completion/kscore\"; "
             "COMP_WORDS=(%s); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); "
             "_kscore; echo \"${COMPREPLY[*]}\"'",
             src_dir(), words);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof(buf) - 1, p);
    buf[n] = '\0';
    ck_assert_int_eq(pclose(p), 0);
    buf[strcspn(buf, "\n")] = '\0';
    return strdup(buf);
}

START_TEST(bash_completion_completes)
{
    char *r = complete_words("kscore li");
    ck_assert_str_eq(r, "list");
    free(r);
    r = complete_words("kscore list --st");
    ck_assert_str_eq(r, "--status");
    free(r);
    r = complete_words("kscore list --status Fa");
    ck_assert_str_eq(r, "Failed");
    free(r);
    r = complete_words("kscore help ex");
    ck_assert_str_eq(r, "exec");
    free(r);
    r = complete_words("kscore operator \\\"\\\"");
    ck_assert_str_eq(r, "add list remove");
    free(r);
    r = complete_words("kscore exec -- ls --");
    ck_assert_str_eq(r, ""); /* the remote command's own */
    free(r);
}
END_TEST

/* ---- the guides (README.md and docs/<guide>.md) ---------------------------- */

/* The guides, docs/<name>.md, into names (sorted); the count. */
static size_t
guides(char names[][64], size_t cap)
{
    char pat[PATH_MAX];
    glob_t g;
    size_t n = 0;
    snprintf(pat, sizeof(pat), "%s/docs/*.md", src_dir());
    ck_assert_msg(glob(pat, 0, NULL, &g) == 0, "no %s", pat);
    for (size_t i = 0; i < g.gl_pathc && n < cap; i++) {
        const char *base = strrchr(g.gl_pathv[i], '/') + 1;
        snprintf(names[n++], 64, "%s", base);
    }
    globfree(&g);
    return n;
}

/* GitHub's anchor of a heading's text: lower case, spaces to '-', every
 * character but letters, digits, '-' and '_' dropped. */
static void
slug(const char *h, size_t len, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < len && k + 1 < cap; i++) {
        unsigned char c = (unsigned char)h[i];
        if (isalnum(c) || c == '-' || c == '_')
            out[k++] = (char)tolower(c);
        else if (c == ' ')
            out[k++] = '-';
    }
    out[k] = '\0';
}

/*
 * Whether the markdown text has a heading (outside ``` blocks) whose
 * anchor is anchor (exact, when prefix is NULL), or whose text starts
 * with prefix.
 */
static bool
has_heading(const char *text, const char *anchor, const char *prefix)
{
    bool fenced = false;
    for (const char *l = text, *nl; l && *l; l = nl ? nl + 1 : NULL) {
        nl = strchr(l, '\n');
        if (strncmp(l, "```", 3) == 0)
            fenced = !fenced;
        if (fenced || *l != '#')
            continue;
        const char *h = l + strspn(l, "#");
        h += strspn(h, " ");
        size_t len = strcspn(h, "\n");
        if (prefix) {
            if (strncmp(h, prefix, strlen(prefix)) == 0 &&
                strlen(prefix) <= len)
                return true;
            continue;
        }
        char s[256];
        slug(h, len, s, sizeof(s));
        if (strcmp(s, anchor) == 0)
            return true;
    }
    return false;
}

/*
 * issue 24: the README was 1,976 lines; it is a front page now. It keeps
 * the two commands at its very top, stays under 200 lines, and links
 * every guide under docs/.
 */
START_TEST(front_page_is_short_and_links_every_guide)
{
    char path[PATH_MAX], names[64][64];
    snprintf(path, sizeof(path), "%s/README.md", src_dir());
    char *t = slurp(path);
    ck_assert_ptr_nonnull(t);
    size_t lines = 0;
    for (const char *p = t; *p; p++)
        lines += *p == '\n';
    ck_assert_msg(lines < 200, "README.md has %zu lines: the front page "
                  "stays under 200, the rest goes to docs/", lines);
    ck_assert_msg(strncmp(t, "# kscore\n\n```sh\nmake run ", 25) == 0,
                  "README.md does not open with the make run block");
    ck_assert_msg(strstr(t, "\nmake test ") != NULL &&
                      strstr(t, "\nmake test ") < strstr(t, "\n```\n"),
                  "README.md's first block has no make test");
    size_t n = guides(names, 64);
    ck_assert_msg(n >= 10, "only %zu guides in docs/", n);
    for (size_t i = 0; i < n; i++) {
        char link[96];
        snprintf(link, sizeof(link), "](docs/%s)", names[i]);
        ck_assert_msg(strstr(t, link) != NULL,
                      "README.md does not link docs/%s", names[i]);
    }
    free(t);
}
END_TEST

/* Every relative link of README.md and the guides names a file that
 * exists, and its #anchor a heading of that file. */
START_TEST(doc_links_resolve)
{
    char names[64][64], files[65][PATH_MAX + 80];
    size_t n = guides(names, 64), nf = 0;
    snprintf(files[nf++], sizeof(files[0]), "%s/README.md", src_dir());
    for (size_t i = 0; i < n; i++)
        snprintf(files[nf++], sizeof(files[0]), "%s/docs/%s", src_dir(), names[i]);
    size_t checked = 0;
    for (size_t f = 0; f < nf; f++) {
        char *t = slurp(files[f]);
        ck_assert_msg(t != NULL, "cannot read %s", files[f]);
        char dir[sizeof(files[0])];
        snprintf(dir, sizeof(dir), "%.*s", (int)sizeof(dir) - 1, files[f]);
        *strrchr(dir, '/') = '\0';
        bool fenced = false;
        for (char *save = NULL, *l = strtok_r(t, "\n", &save); l;
             l = strtok_r(NULL, "\n", &save)) {
            if (strncmp(l, "```", 3) == 0)
                fenced = !fenced;
            if (fenced)
                continue;
            for (char *p = strstr(l, "]("); p; p = strstr(p + 2, "](")) {
                char target[PATH_MAX], file[sizeof(files[0]) + PATH_MAX + 2];
                size_t len = strcspn(p + 2, ") ");
                if (len == 0 || len >= sizeof(target))
                    continue;
                memcpy(target, p + 2, len);
                target[len] = '\0';
                if (strstr(target, "://") || strncmp(target, "mailto:", 7) == 0)
                    continue;
                char *hash = strchr(target, '#');
                if (hash)
                    *hash++ = '\0';
                if (target[0])
                    snprintf(file, sizeof(file), "%s/%s", dir, target);
                else
                    snprintf(file, sizeof(file), "%.*s",
                             (int)sizeof(files[0]) - 1, files[f]);
                ck_assert_msg(access(file, R_OK) == 0, "%s: a link to %s: "
                              "no such file", files[f], target);
                if (hash && *hash) {
                    char *linked = slurp(file);
                    ck_assert_ptr_nonnull(linked);
                    ck_assert_msg(has_heading(linked, hash, NULL),
                                  "%s: a link to %s#%s: no such heading",
                                  files[f], target, hash);
                    free(linked);
                }
                checked++;
            }
        }
        free(t);
    }
    ck_assert_msg(checked >= 50, "only %zu links checked", checked);
}
END_TEST

/*
 * Text that joins what a comment, a man page or a C string cut over lines:
 * each line break, with the blanks and the comment leader ('*', '#',
 * "//") after it, becomes one blank; \" becomes ".
 */
static char *
joined(const char *text)
{
    size_t n = strlen(text), k = 0;
    char *out = malloc(n + 1);
    ck_assert_ptr_nonnull(out);
    for (size_t i = 0; i < n; i++) {
        if (text[i] == '\n') {
            i++;
            i += strspn(text + i, " \t");
            if (text[i] == '*' && text[i + 1] != '/')
                i++;
            else if (text[i] == '#')
                i += strspn(text + i, "#");
            else if (text[i] == '/' && text[i + 1] == '/')
                i += 2;
            i += strspn(text + i, " \t");
            i--;
            out[k++] = ' ';
        } else if (text[i] == '\\' && text[i + 1] == '"') {
            out[k++] = '"';
            i++;
        } else {
            out[k++] = text[i];
        }
    }
    out[k] = '\0';
    return out;
}

static size_t refs_checked;

/* nftw callback: every `docs/<guide>.md "Section"` in a source file names
 * a guide that exists and the start of one of its headings; no file
 * names a section of README.md, which has none left but the front page. */
static int
check_refs(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    const char *base = path + ftw->base;
    if (type == FTW_D && (strcmp(base, ".git") == 0 ||
                          strncmp(base, "build", 5) == 0 ||
                          strcmp(base, "Testing") == 0))
        return FTW_SKIP_SUBTREE;
    if (type != FTW_F)
        return FTW_CONTINUE;
    const char *dot = strrchr(base, '.');
    static const char *const exts[] = {".c", ".h", ".md", ".scd", ".in",
                                       ".proto", ".sh", ".conf", ".txt"};
    bool wanted = strcmp(base, "postinst") == 0 || strcmp(base, "prerm") == 0 ||
                  strcmp(base, "postrm") == 0 || strcmp(base, "Makefile") == 0;
    for (size_t i = 0; dot && i < sizeof(exts) / sizeof(exts[0]); i++)
        wanted |= strcmp(dot, exts[i]) == 0;
    if (!wanted || strcmp(base, "test_docs.c") == 0)
        return FTW_CONTINUE;
    char *raw = slurp(path);
    if (!raw)
        return FTW_CONTINUE;
    char *t = joined(raw);
    free(raw);
    for (const char *p = strstr(t, "README"); p; p = strstr(p + 1, "README")) {
        if (p > t && (p[-1] == '/' || isalnum((unsigned char)p[-1])))
            continue; /* perf/README.md, tests/chaos/README.md */
        const char *q = p + 6;
        if (strncmp(q, ".md", 3) == 0)
            q += 3;
        q += strspn(q, " ,");
        ck_assert_msg(*q != '"', "%s names a README section (%.60s): the "
                      "README is a front page now, name the guide in docs/",
                      path, p);
    }
    for (const char *p = strstr(t, "docs/"); p; p = strstr(p + 1, "docs/")) {
        if (p > t && (isalnum((unsigned char)p[-1]) || p[-1] == '/' ||
                      p[-1] == '.'))
            continue;
        size_t len = strspn(p + 5, "abcdefghijklmnopqrstuvwxyz-");
        if (len == 0 || strncmp(p + 5 + len, ".md", 3) != 0)
            continue;
        char guide[PATH_MAX];
        snprintf(guide, sizeof(guide), "%s/docs/%.*s.md", src_dir(), (int)len,
                 p + 5);
        char *g = slurp(guide);
        ck_assert_msg(g != NULL, "%s names %.*s, which does not exist", path,
                      (int)len + 8, p);
        const char *q = p + 5 + len + 3;
        q += strspn(q, " ,");
        if (*q == '"') {
            q++;
            /* a C string cut in two: "... \"" "Section\"..." */
            if (*q == ' ' || *q == '"') {
                q += strspn(q, " ");
                if (*q == '"')
                    q++;
                if (*q == '"')
                    q++;
            }
            char name[128];
            size_t nl = strcspn(q, "\"");
            if (nl > 0 && nl < sizeof(name) && q[nl] == '"') {
                memcpy(name, q, nl);
                name[nl] = '\0';
                ck_assert_msg(has_heading(g, NULL, name),
                              "%s names docs/%.*s.md \"%s\": no heading "
                              "there starts so",
                              path, (int)len, p + 5, name);
            }
        }
        free(g);
        refs_checked++;
    }
    free(t);
    return FTW_CONTINUE;
}

/*
 * The code, the man pages, the units and the other documents name where
 * the README's sections went (issue 24): each docs/<guide>.md "Section"
 * they name is there, and none names a README section any more.
 */
START_TEST(references_to_the_guides_resolve)
{
    refs_checked = 0;
    ck_assert_int_eq(nftw(src_dir(), check_refs, 16,
                          FTW_PHYS | FTW_ACTIONRETVAL),
                     0);
    ck_assert_msg(refs_checked >= 30, "only %zu references to docs/ checked",
                  refs_checked);
}
END_TEST

/*
 * kscore.conf(5) named a broker's in-process agents local-0, ...; the
 * broker names them <host>-0, ... (broker/broker.c, what `kscore up`'s
 * agent and test_history's local_names use). Every page that names them
 * names them so, and none says local-N.
 */
START_TEST(pages_name_in_process_agents_as_the_broker_does)
{
    static const char *const pages[] = {"kscore.conf.5", "kscore-broker.1"};
    char path[PATH_MAX];
    for (size_t i = 0; i < sizeof(pages) / sizeof(pages[0]); i++) {
        snprintf(path, sizeof(path), "%s/deploy/man/%s.scd", src_dir(),
                 pages[i]);
        char *t = slurp(path);
        ck_assert_msg(t != NULL, "no %s", path);
        ck_assert_msg(strstr(t, "_host_*-0*"), "%s: no _host_-0", path);
        ck_assert_msg(!strstr(t, "local-0"), "%s says local-0", path);
        free(t);
    }
    char names[64][64], files[65][PATH_MAX + 80];
    size_t n = guides(names, 64), nf = 0;
    snprintf(files[nf++], sizeof(files[0]), "%s/README.md", src_dir());
    for (size_t i = 0; i < n; i++)
        snprintf(files[nf++], sizeof(files[0]), "%s/docs/%s", src_dir(), names[i]);
    for (size_t f = 0; f < nf; f++) {
        char *t = slurp(files[f]);
        ck_assert_ptr_nonnull(t);
        ck_assert_msg(!strstr(t, "local-0"), "%s says local-0", files[f]);
        free(t);
    }
}
END_TEST

int
main(void)
{
    Suite *s = suite_create("docs");
    TCase *tc = tcase_create("docs");
    tcase_add_test(tc, every_subcommand_has_a_page_that_builds);
    tcase_add_test(tc, every_flag_in_help_is_documented);
    tcase_add_test(tc, bash_completion_completes);
    tcase_add_test(tc, pages_name_in_process_agents_as_the_broker_does);
    tcase_add_test(tc, front_page_is_short_and_links_every_guide);
    tcase_add_test(tc, doc_links_resolve);
    tcase_add_test(tc, references_to_the_guides_resolve);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
