#!/bin/sh
# make soak: run the timing-sensitive suites N times each and print how
# many passed. A suite that does not pass N of N has a race in the product
# or the test: its failing runs' logs are kept in $BUILD/soak/<suite>.<run>.log
# (and the failed case's stack directory, named in the log) for the cause to
# be found (never retried around: issue 22).
#
# Each suite runs the way `make test` runs it: test_cluster as its two
# halves side by side (CK_INCLUDE_TAGS part1 and part2, tests/CMakeLists.txt),
# a run passing only when both do. The suites' loops run side by side
# (SOAK_SERIAL=1: one suite after another), each suite's runs one at a time.
#   soak.sh BUILD N SUITE...      exit 0 only when every suite passed N/N
set -u
BUILD=$(cd "${1:?build dir}" && pwd) || exit 2
SRC=$(cd "$(dirname "$0")/.." && pwd)
N=${2:?runs}
shift 2
[ $# -gt 0 ] || set -- test_agent test_batch test_security test_cluster
case $N in '' | *[!0-9]*) echo "soak: N must be a number, not '$N'" >&2; exit 2 ;; esac
out="$BUILD/soak"
mkdir -p "$out"
for s in "$@"; do
    [ -x "$BUILD/tests/$s" ] || { echo "soak: no suite $s in $BUILD/tests" >&2; exit 2; }
done

# One run of suite $1 into log $2, with the environment ctest gives every
# suite (tests/CMakeLists.txt).
run_once() {
    if [ "$1" = test_cluster ]; then
        (run_part "$1" part1 "$2.part1") &
        p1=$!
        run_part "$1" part2 "$2.part2"
        r2=$?
        wait "$p1"
        r1=$?
        cat "$2.part1" "$2.part2" >"$2"
        rm -f "$2.part1" "$2.part2"
        [ "$r1" -eq 0 ] && [ "$r2" -eq 0 ]
    else
        run_part "$1" "" "$2"
    fi
}

run_part() {
    (cd "$BUILD" && env CK_DEFAULT_TIMEOUT=300 ${2:+CK_INCLUDE_TAGS=$2} \
        KSCORE_BIN="$BUILD/cli/kscore" KSCORE_SOURCE_DIR="$SRC" \
        timeout 900 "tests/$1") >"$3" 2>&1
}

# Suite $1's N runs; its summary line into $out/$1.result.
soak_suite() {
    pass=0
    t0=$(date +%s)
    i=1
    while [ "$i" -le "$N" ]; do
        log="$out/$1.$i.log"
        if run_once "$1" "$log"; then
            pass=$((pass + 1))
            rm -f "$log"
            echo "  $1 run $i passed"
        else
            echo "  $1 run $i FAILED (log: $log):"
            grep -E ':[EF]:' "$log" | head -5 | sed 's/^/    /'
        fi
        i=$((i + 1))
    done
    t1=$(date +%s)
    printf '%-16s %d/%d passed  (%d s)\n' "$1" "$pass" "$N" $((t1 - t0)) \
        >"$out/$1.result"
}

for s in "$@"; do
    rm -f "$out/$s.result"
    if [ "${SOAK_SERIAL:-0}" = 1 ]; then
        soak_suite "$s"
    else
        soak_suite "$s" &
    fi
done
wait
rc=0
for s in "$@"; do
    if [ -f "$out/$s.result" ]; then
        cat "$out/$s.result"
        grep -q " $N/$N passed" "$out/$s.result" || rc=1
    else
        printf '%-16s did not finish\n' "$s"
        rc=1
    fi
done
exit $rc
