/*
 * The documentation keeps up with the binary: every subcommand that
 * `kscore --help` lists has a man page (deploy/man/kscore-CMD.1.scd) that
 * scdoc builds and the build made, named in kscore.1; every flag a
 * subcommand's --help shows is in its page and in the bash completion.
 * Fails when a flag or a subcommand is added without its documentation.
 */
#include <check.h>
#include <ctype.h>
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
    snprintf(path, sizeof(path), "%s/README.md", src_dir());
    char *t = slurp(path);
    ck_assert_ptr_nonnull(t);
    ck_assert_msg(!strstr(t, "local-0"), "README.md says local-0");
    free(t);
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
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
