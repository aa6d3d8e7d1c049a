/* Node sets: agent ids folded as clubak/nodeset print them (cli/out_fold.c).
 * Pure: no kscore dependencies, unit-tested directly (tests/test_batch.c). */
#ifndef KSCORE_CLI_OUT_FOLD_H
#define KSCORE_CLI_OUT_FOLD_H

#include <stddef.h>

/*
 * Folds ids (n of them, in any order, duplicates allowed) into one node
 * set: names that differ only in their last run of digits become
 * prefix[ranges]suffix ("vm-0".."vm-19" -> "vm-[0-19]", "web1,web2,web3,
 * web7" -> "web[1-3,7]"), zero padding kept ("n01".."n10" -> "n[01-10]";
 * a padded and an unpadded number of different widths are never merged);
 * a lone name and names without digits are printed as they are. Sets are
 * joined by ',' in sorted order. Returns a malloc'd string, NULL without
 * memory.
 */
char *fold_nodeset(const char *const *ids, size_t n);

#endif
