#!/usr/bin/env bash
# Prints, at the end of a failed `make test`, the output of each test that
# failed (its last lines), from ctest's log: with -j, ctest's own report of a
# failure lands mid-log among other tests' lines, and CI shows the tail.
# Usage: scripts/show_failed_tests.sh BUILD_DIR [LINES]
set -uo pipefail
log=${1:?usage: show_failed_tests.sh BUILD_DIR [LINES]}/Testing/Temporary/LastTest.log
lines=${2:-120}
[[ -f $log ]] || { echo "no ctest log at $log" >&2; exit 0; }
awk -v keep="$lines" '
  /^[0-9]+\/[0-9]+ Testing: / { name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); n = 0; next }
  /^<end of output>$/ { done = 1; next }
  /^Output:$/ { done = 0; n = 0; next }
  /^Test Failed\.$/ || /^Test (Not Run|Timeout|Exception)/ {
    printf "\n===== failed: %s (its last %d lines) =====\n", name, (n < keep ? n : keep)
    for (i = (n > keep ? n - keep : 0); i < n; i++) print buf[i % keep]
    next
  }
  !done && name != "" { buf[n % keep] = $0; n++ }
' "$log"
