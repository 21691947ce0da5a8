#!/usr/bin/env bash
# Long fuzzing runs on a machine with many cores: JOBS copies of each target
# (libFuzzer -jobs/-workers: independent processes that share one corpus
# directory and pick up each other's finds), each stopping after RUNS/JOBS
# executions (or SECONDS), with per-input leak checks off (-detect_leaks=0,
# about 3x the executions; LeakSanitizer still checks each process at its
# exit). Targets run one after the other. A crash, timeout, leak or
# out-of-memory fails the target, its reproducer in OUT/artifacts. Prints one
# line per target: executions (all jobs together), the largest job's
# coverage and features, the corpus size, and the failed jobs (a job cut by
# the hard stop, SECONDS + 60, has no final stats and counts as failed).
#
# Usage: scripts/fuzz_long.sh FUZZERS_TXT CORPUS_ROOT OUT RUNS SECONDS JOBS [NAME...]
#   FUZZERS_TXT: a TANDEM_FUZZ build's fuzzers.txt (name, binary, seeds, dict,
#   max_len, timeout); a binary missing at its listed path is looked up beside
#   the list. CORPUS_ROOT/NAME is each target's working corpus (kept).
set -uo pipefail
list=${1:?usage: fuzz_long.sh FUZZERS_TXT CORPUS_ROOT OUT RUNS SECONDS JOBS [NAME...]}
root=${2:?} out=${3:?} runs=${4:?} seconds=${5:?} jobs=${6:?}
shift 6
here=$(cd "$(dirname "$list")" && pwd)
mkdir -p "$out/artifacts"
# A 16 MB quarantine (ASan's default is 256 MB) keeps reusing warm pages: in
# the GPU machine's VM page faults cost tokenizer_json_fuzzer most of its
# time; here it cut its minor faults 181k -> 65k and its RSS 490 -> 110 MB.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:quarantine_size_mb=16}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
printf '%-26s %12s %9s %8s %8s %7s %s\n' target executions cov ft corpus seconds failed-jobs
while read -r name bin seeds dict max_len timeout; do
  if (($# > 0)) && [[ " $* " != *" $name "* ]]; then continue; fi
  [[ -x $bin ]] || bin="$here/$name"
  mkdir -p "$root/$name" "$out/$name"
  args=(-jobs="$jobs" -workers="$jobs" -runs=$(( (runs + jobs - 1) / jobs )) -max_total_time="$seconds"
        -max_len="$max_len" -timeout="$timeout" -rss_limit_mb=2560 -detect_leaks=0 -print_final_stats=1
        -artifact_prefix="$out/artifacts/$name-")
  [[ $dict != - ]] && args+=(-dict="$dict")
  t0=$SECONDS
  # A hard stop 60 s after SECONDS: libFuzzer checks its time only between
  # inputs, and a job replaying a corpus of slow inputs overran a 600 s call
  # (GNU timeout signals its whole process group: every job goes).
  (cd "$out/$name" && timeout -k 10 $((seconds + 60)) "$bin" "${args[@]}" "$root/$name" "$seeds" \
     >"$out/$name/main.log" 2>&1)
  execs=0 cov=0 ft=0 bad=()
  for log in "$out/$name"/fuzz-*.log; do
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    if [[ -z $n ]] || grep -qE 'ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer)|runtime error:' "$log"; then
      bad+=("$(basename "$log")")
    fi
    execs=$((execs + ${n:-0}))
    last=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
    c=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last"); f=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    ((${c:-0} > cov)) && cov=$c
    ((${f:-0} > ft)) && ft=$f
  done
  size=$(find "$root/$name" -type f | wc -l)
  printf '%-26s %12s %9s %8s %8s %7s %s\n' "$name" "$execs" "$cov" "$ft" "$size" "$((SECONDS - t0))" "${bad[*]:-none}"
  ((${#bad[@]} > 0)) && failed=1
done <"$list"
exit $failed
