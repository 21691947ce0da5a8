#!/usr/bin/env bash
# Runs the test suite of an instrumented build (ASan+UBSan, `make sanitize`)
# with UCX on: every test, including those that spawn `tandem` workers and
# routers and move KV over UCX, whose children inherit the settings below.
#
# Sanitizer settings: leak checks on (LeakSanitizer at each process's exit),
# any UBSan report fatal. UCX needs no suppression and no setting under ASan:
# kvtransfer_ucx_test (in-process and cross-process pulls over tcp and shm, a
# peer killed mid-transfer) passed instrumented with leak checks on, UCX's
# memory hooks left as they are (2026-11-24).
#
# Usage: scripts/run_sanitized_tests.sh BUILD_DIR [JOBS] [CTEST ARGS...]
set -uo pipefail
build=${1:?usage: run_sanitized_tests.sh BUILD_DIR [JOBS] [CTEST ARGS...]}
jobs=${2:-2}
shift $(($# >= 2 ? 2 : 1))
here=$(cd "$(dirname "$0")" && pwd)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
start=$(date +%s)
cd "$build" || exit 2
ctest --output-on-failure -j "$jobs" --timeout 900 "$@"
rc=$?
echo "run_sanitized_tests: ctest took $(($(date +%s) - start)) s (exit $rc)"
if ((rc != 0)); then "$here/show_failed_tests.sh" .; fi
exit $rc
