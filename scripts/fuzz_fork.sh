#!/usr/bin/env bash
# Long fuzzing runs on a machine with many cores: each target in libFuzzer's
# fork mode (-fork=JOBS: JOBS child processes share one corpus), one target
# after the other, SECONDS each, per-input leak checks off (-detect_leaks=0,
# about 3x the executions; LeakSanitizer still checks each child at its exit).
# A crash, timeout or out-of-memory fails the target; its reproducer lands in
# OUT/artifacts. Prints one line per target: executions (all children
# together), coverage, features, corpus size, and the crash/timeout/oom count.
#
# Usage: scripts/fuzz_fork.sh FUZZERS_TXT CORPUS_ROOT OUT SECONDS JOBS [NAME...]
#   FUZZERS_TXT: a TANDEM_FUZZ build's fuzzers.txt (name, binary, seeds, dict,
#   max_len, timeout); binaries are looked up beside it when the listed path
#   is missing. CORPUS_ROOT/NAME is each target's working corpus (kept).
set -uo pipefail
list=${1:?usage: fuzz_fork.sh FUZZERS_TXT CORPUS_ROOT OUT SECONDS JOBS [NAME...]}
root=${2:?} out=${3:?} seconds=${4:?} jobs=${5:?}
shift 5
here=$(cd "$(dirname "$list")" && pwd)
mkdir -p "$out/artifacts" "$out/logs"
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
printf '%-26s %12s %9s %8s %8s %10s\n' target executions cov ft corpus crash/to/oom
while read -r name bin seeds dict max_len timeout; do
  if (($# > 0)) && [[ " $* " != *" $name "* ]]; then continue; fi
  [[ -x $bin ]] || bin="$here/$name"
  mkdir -p "$root/$name"
  args=(-fork="$jobs" -max_total_time="$seconds" -max_len="$max_len" -timeout="$timeout"
        -rss_limit_mb=2560 -detect_leaks=0 -artifact_prefix="$out/artifacts/$name-")
  [[ $dict != - ]] && args+=(-dict="$dict")
  log="$out/logs/$name.log"
  (cd "$out" && "$bin" "${args[@]}" "$root/$name" "$seeds" >"$log" 2>&1)
  rc=$?
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
  execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last")
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  bad=$(sed -n 's/.*oom\/timeout\/crash: \([0-9/]*\).*/\1/p' <<<"$last")
  size=$(find "$root/$name" -type f | wc -l)
  printf '%-26s %12s %9s %8s %8s %10s%s\n' "$name" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$size" "${bad:-?}" \
    "$( ((rc != 0)) && echo "  FAILED (exit $rc, $log)")"
  ((rc != 0)) && failed=1
done <"$list"
exit $failed
