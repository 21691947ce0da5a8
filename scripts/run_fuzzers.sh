#!/usr/bin/env bash
# Runs the libFuzzer targets of a TANDEM_FUZZ build, each for SECONDS, one
# after the other, on its seed corpus from the source tree (read-only) plus a
# working corpus in BUILD_DIR/fuzz/corpus/NAME, where the new inputs it finds
# are kept for the next run. A crash, leak, timeout or out-of-memory fails the
# run; the reproducer is left in BUILD_DIR/fuzz/artifacts (copy it into the
# seed folder once fixed, as a regression input). Prints one line per target:
# executions, executions per second, coverage (libFuzzer's cov: edges
# reached, of all the binary's instrumented edges, and ft: features) and the
# corpus size.
#
# Usage: scripts/run_fuzzers.sh BUILD_DIR SECONDS [NAME...]   (all targets by default)
# Extra libFuzzer flags: FUZZ_FLAGS="-jobs=2 -workers=2" scripts/run_fuzzers.sh ...
set -uo pipefail
build=${1:?usage: run_fuzzers.sh BUILD_DIR SECONDS [NAME...]}
seconds=${2:?usage: run_fuzzers.sh BUILD_DIR SECONDS [NAME...]}
shift 2
list="$build/fuzzers.txt"
[[ -s $list ]] || { echo "run_fuzzers: $list is missing: configure $build with -DTANDEM_FUZZ=ON" >&2; exit 2; }
build=$(cd "$build" && pwd)
mkdir -p "$build/fuzz/artifacts" "$build/fuzz/logs"
# Leaks are checked by libFuzzer itself (-detect_leaks, on by default).
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

failed=()
printf '%-26s %12s %9s %14s %8s %8s  %s\n' target executions exec/s cov/edges ft corpus result
while read -r name bin corpus dict max_len timeout; do
  if (($# > 0)) && [[ " $* " != *" $name "* ]]; then continue; fi
  [[ -x $bin ]] || { echo "run_fuzzers: $bin is not built" >&2; failed+=("$name"); continue; }
  work="$build/fuzz/corpus/$name"
  mkdir -p "$work"
  log="$build/fuzz/logs/$name.log"
  args=(-max_total_time="$seconds" -max_len="$max_len" -timeout="$timeout" -rss_limit_mb=2560
        -artifact_prefix="$build/fuzz/artifacts/$name-" -print_final_stats=1)
  [[ $dict != - ]] && args+=(-dict="$dict")
  # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
  "$bin" "${args[@]}" ${FUZZ_FLAGS:-} "$work" "$corpus" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  edges=$(sed -n 's/^INFO: Loaded 1 modules *(\([0-9]*\) inline 8-bit counters.*/\1/p' "$log" | head -n 1)
  size=$(find "$work" -type f | wc -l)
  result=ok
  if ((rc != 0)); then
    result="FAILED (exit $rc, log $log)"
    failed+=("$name")
  fi
  printf '%-26s %12s %9s %14s %8s %8s  %s\n' "$name" "${execs:-?}" "${rate:-?}" "${cov:-?}/${edges:-?}" "${ft:-?}" "$size" "$result"
  if ((rc != 0)); then
    grep -E 'ERROR|SUMMARY|==[0-9]+==|Test unit written' "$log" | head -n 20 >&2
  fi
done <"$list"

if ((${#failed[@]} > 0)); then
  echo "run_fuzzers: failed: ${failed[*]}" >&2
  exit 1
fi
