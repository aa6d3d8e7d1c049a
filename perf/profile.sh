#!/bin/sh
# make profile: the SLO scenarios (command_latency, event_throughput,
# batch_exec_10) of `kscore perf`, twice:
#   1. under `perf record -a -g` (system wide, so the broker, the agent
#      process and the perf client are all sampled; reported for the
#      processes named kscore), or valgrind callgrind on the broker when
#      perf cannot sample; the broker and the agent are kscore's daemon
#      half, named kscore-daemon, so both names are reported;
#   2. with the broker and the agent process under heaptrack
#      (KSCORE_PERF_WRAP / KSCORE_PERF_WRAP_AGENT).
# Prints the top 20 CPU consumers and the top 20 allocation sites of the
# kscore processes, with the total bytes allocated, and checks two targets
# of issue 15 (perf/README.md "Profile targets"), also written to
# $OUT/profile-targets.json:
#   - allocated bytes over the SLO suite (broker + agent, heaptrack)
#     <= 10 MB (10,000,000 bytes);
#   - no single kscore function (a symbol of the kscore binary, not of
#     libc, libpq, nats.c, ...) above 5% of the kscore processes' samples
#     (self time).
# Files stay in $OUT.
#
#   BUILD=build  KSCORE=$BUILD/cli/kscore  OUT=/tmp/kscore-profile
#   PROFILE_ROUNDS=2 (rounds per scenario)  PROFILE_SCENARIOS="..."
#   PROFILE_ARGS=--quick (a dry run of the script itself)
set -eu

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
KSCORE=${KSCORE:-$BUILD/cli/kscore}
OUT=${OUT:-/tmp/kscore-profile}
ROUNDS=${PROFILE_ROUNDS:-2}
SCENARIOS=${PROFILE_SCENARIOS:-command_latency event_throughput batch_exec_10}
EXTRA=${PROFILE_ARGS:-}

KSCORE_PROFILE=1 ./deploy/bootstrap.sh
KSCORE=$(readlink -f "$KSCORE")
rm -rf "$OUT"
mkdir -p "$OUT"

ALLOC_LIMIT=10000000 # 10 MB
CPU_LIMIT_PCT=5
cpu_evaluated=false
cpu_reason=""

# ---- CPU ------------------------------------------------------------------
# No hardware counters in most VMs: perf falls back to the cpu-clock
# software event, which is enough for sampling. Probe first.
cpu_tool=perf
if ! perf record -a -g -o "$OUT/probe.data" -- sleep 0.2 >/dev/null 2>&1 ||
   [ "$(perf report -i "$OUT/probe.data" --stdio 2>/dev/null | grep -c '%')" = 0 ]; then
    cpu_tool=callgrind
fi
rm -f "$OUT/probe.data"

echo "profile: CPU with $cpu_tool: kscore perf $SCENARIOS --rounds $ROUNDS" >&2
if [ "$cpu_tool" = perf ]; then
    perf record -a -g -F 999 -o "$OUT/cpu.data" -- \
        "$KSCORE" perf $SCENARIOS --rounds "$ROUNDS" $EXTRA --out "$OUT/cpu-run.json" \
        >"$OUT/cpu-run.txt" 2>"$OUT/cpu-run.log"
    perf report -i "$OUT/cpu.data" --stdio -g none --sort comm \
        >"$OUT/cpu-by-process.txt" 2>/dev/null
    perf report -i "$OUT/cpu.data" --stdio -g none --no-children \
        --comms kscore,kscore-daemon --sort dso,sym >"$OUT/cpu-self.txt" 2>/dev/null
    perf report -i "$OUT/cpu.data" --stdio -g none --children \
        --comms kscore,kscore-daemon --sort sym >"$OUT/cpu-children.txt" 2>/dev/null
    echo
    echo "== CPU by process (all samples, system wide)"
    grep -v '^#' "$OUT/cpu-by-process.txt" | grep -v '^$' | head -8
    echo
    echo "== top 20 CPU consumers of the kscore processes (self time)"
    grep -v '^#' "$OUT/cpu-self.txt" | grep -v '^$' | head -20
    # Self time as a share of the kscore processes' samples only
    # (--percentage relative: the filtered samples are 100%), per symbol of
    # the kscore binary (dso column "kscore").
    perf report -i "$OUT/cpu.data" --stdio -g none --no-children \
        --comms kscore,kscore-daemon --percentage relative --sort dso,sym \
        >"$OUT/cpu-self-relative.txt" 2>/dev/null
    kscore_dso=$(basename "$KSCORE")
    awk -v dso="$kscore_dso" -v lim="$CPU_LIMIT_PCT" '
        /^#/ || NF < 4 { next }
        $2 == dso || $2 == dso "-daemon" { p = $1; sub(/%$/, "", p); sym = $4
                    for (i = 5; i <= NF; i++) sym = sym " " $i
                    if (p + 0 > lim + 0) printf "%s\t%s\n", p, sym }' \
        "$OUT/cpu-self-relative.txt" >"$OUT/cpu-over-limit.tsv"
    awk -v dso="$kscore_dso" '
        /^#/ || NF < 4 { next }
        $2 == dso || $2 == dso "-daemon" { p = $1; sub(/%$/, "", p); sym = $4
                    for (i = 5; i <= NF; i++) sym = sym " " $i
                    printf "%s\t%s\n", p, sym; if (++n == 10) exit }' \
        "$OUT/cpu-self-relative.txt" >"$OUT/cpu-top-kscore.tsv"
    cpu_evaluated=true
    echo
    echo "== top 20 CPU consumers of the kscore processes (with callees;"
    echo "   frame-pointer stacks, so library frames may be cut short)"
    grep -v '^#' "$OUT/cpu-children.txt" | grep -v '^$' | head -20
else
    echo "profile: perf cannot sample here; falling back to valgrind" \
         "callgrind on the broker (instruction counts, not time)" >&2
    cpu_reason="perf cannot sample here (callgrind instruction counts of the broker only)"
    KSCORE_PERF_WRAP="valgrind --tool=callgrind --callgrind-out-file=$OUT/callgrind.broker.%n" \
        "$KSCORE" perf $SCENARIOS --rounds 1 --quick --out "$OUT/cpu-run.json" \
        >"$OUT/cpu-run.txt" 2>"$OUT/cpu-run.log"
    echo
    echo "== top 20 CPU consumers of the broker (callgrind, instructions)"
    for f in "$OUT"/callgrind.broker.*; do
        callgrind_annotate --inclusive=no "$f" 2>/dev/null | sed -n '/^-----/,$p' |
            grep -v '^-' | grep -v '^$' | head -22
    done
fi

# ---- allocations ----------------------------------------------------------
echo >&2
echo "profile: allocations with heaptrack (broker and agent)" >&2
KSCORE_PERF_WRAP="heaptrack -o $OUT/heaptrack.broker.%n" \
KSCORE_PERF_WRAP_AGENT="heaptrack -o $OUT/heaptrack.agent.%n" \
    "$KSCORE" perf $SCENARIOS --rounds "$ROUNDS" $EXTRA --out "$OUT/heap-run.json" \
    >"$OUT/heap-run.txt" 2>"$OUT/heap-run.log"

total_bytes=0
for f in "$OUT"/heaptrack.*.gz "$OUT"/heaptrack.*.zst; do
    [ -e "$f" ] || continue
    base=${f%.*}
    heaptrack_print -f "$f" -a -m 0 -n 20 -p 0 -T 0 -H "$base.hist" \
        >"$base.txt" 2>/dev/null || true
    # The size histogram ("size count" per line) sums to the bytes allocated.
    b=$(awk '{ s += $1 * $2 } END { printf "%.0f", s }' "$base.hist" 2>/dev/null || echo 0)
    total_bytes=$((total_bytes + b))
    echo "$(basename "$f"): $b bytes allocated" >>"$OUT/heap-totals.txt"
done

echo
echo "== allocations of the kscore processes (heaptrack)"
cat "$OUT/heap-totals.txt" 2>/dev/null || echo "(no heaptrack files)"
echo "total bytes allocated: $total_bytes ($((total_bytes / 1048576)) MiB)"
for f in "$OUT"/heaptrack.broker.*.txt "$OUT"/heaptrack.agent.*.txt; do
    [ -e "$f" ] || continue
    echo
    echo "== top 20 allocation sites by calls: $(basename "$f" .txt)"
    # Each site: "N calls to allocation functions with B peak consumption
    # from", then its backtrace (frame name, "at file:line", "in lib").
    # Shown: the allocator, and the first frame in kscore's own sources.
    awk -v src="$(pwd)/" '
        function flush() {
            if (calls != "")
                printf "%9s calls  peak %-8s  %-28s  %s\n", calls, peak,
                       substr(alloc, 1, 28), site == "" ? "(no kscore frame)" : site
            calls = ""
        }
        /^[0-9]+ calls to allocation functions with/ { flush(); calls = $1; peak = $7;
            alloc = ""; site = ""; fn = ""; next }
        calls == "" { next }
        /^  [^ ]/ { fn = $1; if (alloc == "") alloc = fn; next }
        /^    at / { if (site == "" && index($2, src) == 1)
                       site = fn " (" substr($2, length(src) + 1) ")"; next }
        END { flush() }' "$f"
    sed -n '/^total runtime/,$p' "$f"
done

# ---- targets (issue 15) ---------------------------------------------------
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"; }
heap_files=$(cat "$OUT/heap-totals.txt" 2>/dev/null | grep -c . || true)
echo
echo "== targets"
if [ "$heap_files" -gt 0 ]; then
    alloc_met=false
    [ "$total_bytes" -le "$ALLOC_LIMIT" ] && alloc_met=true
    word=MISS; [ "$alloc_met" = true ] && word=met
    echo "allocated bytes over the SLO suite: $total_bytes (target <= 10 MB): $word"
    alloc_json="{\"target\": \"allocated bytes over the SLO suite (broker + agent) <= 10 MB\", \"evaluated\": true, \"value\": $total_bytes, \"limit\": $ALLOC_LIMIT, \"met\": $alloc_met, \"files\": {"
    sep=""
    while read -r name b rest; do
        alloc_json="$alloc_json$sep$(json_str "${name%:}"): $b"
        sep=", "
    done <"$OUT/heap-totals.txt"
    alloc_json="$alloc_json}}"
else
    echo "allocated bytes over the SLO suite: not evaluated (no heaptrack files)"
    alloc_json="{\"target\": \"allocated bytes over the SLO suite (broker + agent) <= 10 MB\", \"evaluated\": false, \"reason\": \"no heaptrack files\", \"limit\": $ALLOC_LIMIT, \"met\": false}"
fi
if [ "$cpu_evaluated" = true ]; then
    cpu_met=true
    [ -s "$OUT/cpu-over-limit.tsv" ] && cpu_met=false
    word=MISS; [ "$cpu_met" = true ] && word=met
    echo "no single kscore function above $CPU_LIMIT_PCT% of kscore's samples: $word"
    over="" sep=""
    while IFS="$(printf '\t')" read -r pct sym; do
        echo "  $pct%  $sym"
        over="$over$sep{\"symbol\": $(json_str "$sym"), \"pct\": $pct}"
        sep=", "
    done <"$OUT/cpu-over-limit.tsv"
    top="" sep=""
    while IFS="$(printf '\t')" read -r pct sym; do
        top="$top$sep{\"symbol\": $(json_str "$sym"), \"pct\": $pct}"
        sep=", "
    done <"$OUT/cpu-top-kscore.tsv"
    if [ "$cpu_met" = true ] && [ -s "$OUT/cpu-top-kscore.tsv" ]; then
        IFS="$(printf '\t')" read -r pct sym <"$OUT/cpu-top-kscore.tsv"
        echo "  (the top kscore function: $sym, $pct%)"
    fi
    cpu_json="{\"target\": \"no single kscore function above 5% of kscore's samples (self)\", \"evaluated\": true, \"limit_pct\": $CPU_LIMIT_PCT, \"met\": $cpu_met, \"over\": [$over], \"top\": [$top]}"
else
    echo "no single kscore function above $CPU_LIMIT_PCT% of kscore's samples: not evaluated ($cpu_reason)"
    cpu_json="{\"target\": \"no single kscore function above 5% of kscore's samples (self)\", \"evaluated\": false, \"reason\": $(json_str "$cpu_reason"), \"limit_pct\": $CPU_LIMIT_PCT, \"met\": false}"
fi
printf '{"scenarios": %s, "rounds": %s, "quick": %s,\n "alloc": %s,\n "cpu": %s}\n' \
    "$(json_str "$SCENARIOS")" "$ROUNDS" \
    "$(case " $EXTRA " in *" --quick "*) echo true ;; *) echo false ;; esac)" \
    "$alloc_json" "$cpu_json" >"$OUT/profile-targets.json"

echo
echo "profile: files in $OUT (perf report -i $OUT/cpu.data; heaptrack_print -f ...;"
echo "         targets: $OUT/profile-targets.json)"
