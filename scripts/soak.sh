#!/usr/bin/env bash
# `make soak`: a long run under steady streaming load that must leave nothing
# behind. A 2P2D cluster from `tandem up` (simulated compute by default, so
# the router, the scheduler, the KV pools, the prefix caches, the KV events
# and the UCX hand-offs all run for real at a rate two cores can sustain)
# takes `tandem bench` streams for SOAK_SECONDS (default 1800). Every
# SAMPLE_SECONDS the script records, per process (router and each worker),
# its resident memory and open file descriptors, and, from the router's
# /metrics (the workers' load reports), each worker's used / quarantined KV
# blocks and reserved / prefilled sequences, into soak.csv.
#
# It passes when, after the load:
#   - every bench round answered every request (no failed request);
#   - each process's RSS over the last quarter of the run is within
#     RSS_SLACK_MB (default 32) and RSS_SLACK_PCT (default 10) of its
#     level over the second quarter (the first is warm-up: caches fill);
#   - each process's fd count at the end is within FD_SLACK (default 8) of
#     its level after warm-up;
#   - once idle, no worker has a KV block used or quarantined, nor a
#     sequence reserved or prefilled.
# Otherwise it prints what grew and exits 1.
#
# Usage: scripts/soak.sh TANDEM_BIN [OUT_DIR]
# Environment: SOAK_SECONDS, SAMPLE_SECONDS (10), ENGINE (sim | real), KV_CACHE,
# RATE (requests/s, default 8 sim / 1 real), UP_ARGS (more `tandem up` flags).
set -euo pipefail
bin=${1:?usage: soak.sh TANDEM_BIN [OUT_DIR]}
out=${2:-$(mktemp -d /tmp/tandem-soak.XXXXXX)}
seconds=${SOAK_SECONDS:-1800}
sample=${SAMPLE_SECONDS:-10}
engine=${ENGINE:-sim}
rate=${RATE:-$([[ $engine == sim ]] && echo 8 || echo 1)}
mkdir -p "$out"
echo "soak: ${seconds}s of streaming load at ${rate} req/s on a 2P2D $engine cluster; results in $out"

trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
# A small KV cache (KV_CACHE, default 64MiB) fills in the first minutes, so
# its lazily mapped pages are all resident before the second quarter and
# eviction runs for most of the soak.
"$bin" up --engine "$engine" --prefill 1 --decode 1 --disaggregation always \
  --policy kv_cache_aware --worker-threads 1 --kv-cache-memory "${KV_CACHE:-64MiB}" \
  --port 0 --ready-file "$out/url" \
  --run-dir "$out/run" ${UP_ARGS:-} > "$out/up.log" 2>&1 &
up=$!
for _ in $(seq 900); do [[ -s "$out/url" ]] && break; sleep 0.1; done
[[ -s "$out/url" ]] || { echo "soak: tandem up failed:" >&2; tail -20 "$out/up.log" >&2; exit 1; }
url=$(cat "$out/url")

# The processes to watch: tandem up's children (router and workers).
pids() { pgrep -P "$up" | sort -n; }
label() {  # router, prefill or decode
  local args
  args=$(tr '\0' ' ' < "/proc/$1/cmdline")
  case "$args" in
    *" router "*) echo router ;;
    *" worker "*) sed -nE 's/.*--role ([a-z]+).*/\1/p' <<< "$args" ;;
    *) echo other ;;
  esac
}
metric_sum() {  # the sum of every series of a metric with a label value
  curl -sf "$url/metrics" | awk -v m="$1" -v s="$2" \
    'index($0, m "{") == 1 && index($0, "state=\"" s "\"") { v += $NF } END { print v + 0 }'
}

echo "t,pid,process,rss_kb,fds,used_blocks,quarantined_blocks,reserved,prefilled" > "$out/soak.csv"
sampler() {
  local start=$SECONDS
  while true; do
    local t=$((SECONDS - start))
    local used quar res pre
    used=$(metric_sum tandem_router_worker_kv_blocks used)
    quar=$(metric_sum tandem_router_worker_kv_blocks quarantined)
    res=$(metric_sum tandem_router_worker_sequences reserved)
    pre=$(metric_sum tandem_router_worker_sequences prefilled)
    for p in $(pids); do
      [[ -r /proc/$p/status ]] || continue
      local rss fds
      rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status")
      fds=$(ls "/proc/$p/fd" 2>/dev/null | wc -l)
      echo "$t,$p,$(label "$p"),$rss,$fds,$used,$quar,$res,$pre" >> "$out/soak.csv"
    done
    sleep "$sample"
  done
}
sampler &
sampler_pid=$!

# Load: rounds of streaming requests (random prompts with a shared prefix
# mix, so the prefix caches fill, evict and hit), back to back until the
# time is up. Failed requests are counted over every round (each round's
# JSON keeps every request, --save-detailed, to see what failed).
end=$((SECONDS + seconds))
round=0
failed=0
failed_requests=0
while ((SECONDS < end)); do
  round=$((round + 1))
  left=$((end - SECONDS))
  n=$(python3 -c "print(max(4, min(int($rate * 120), int($rate * $left))))")
  dataset=$([[ $((round % 2)) == 0 ]] && echo shared-prefix || echo random)
  extra=$([[ $dataset == shared-prefix ]] && echo "--num-groups 8 --prefix-len 256" || echo "--random-input-len 256")
  "$bin" bench --url "$url" --dataset "$dataset" $extra --num-prompts "$n" \
    --request-rate "$rate" --random-output-len 32 --ignore-eos --seed "$round" \
    --json "$out/round-$round.json" --save-detailed > "$out/round-$round.txt" 2>&1 || true
  bad=$(python3 -c '
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print(-1)  # the round did not run
    sys.exit()
s = s.get("summary", s)
print(s.get("failed", 0) if s.get("completed") else -1)
' "$out/round-$round.json")
  if ((bad < 0)); then
    echo "soak: bench round $round did not run:" >&2
    tail -5 "$out/round-$round.txt" >&2
    failed=1
    break
  fi
  if ((bad > 0)); then
    echo "soak: round $round: $bad failed requests:" \
      "$(grep -A2 'First Errors' "$out/round-$round.txt" | tail -n +2 | head -2 | tr '\n' ' ')" >&2
    failed_requests=$((failed_requests + bad))
    failed=1
  fi
done
echo "soak: $round rounds, $failed_requests failed requests"

# Idle: give the workers' load reports a few health checks to settle.
sleep 5
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
for state in used quarantined; do
  v=$(metric_sum tandem_router_worker_kv_blocks "$state")
  [[ $v == 0 ]] || { echo "soak: $v KV blocks still $state once idle" >&2; failed=1; }
done
for state in reserved prefilled; do
  v=$(metric_sum tandem_router_worker_sequences "$state")
  [[ $v == 0 ]] || { echo "soak: $v sequences still $state once idle" >&2; failed=1; }
done

python3 - "$out/soak.csv" "${RSS_SLACK_MB:-32}" "${RSS_SLACK_PCT:-10}" "${FD_SLACK:-8}" <<'EOF' || failed=1
import csv, sys
from collections import defaultdict
path, slack_mb, slack_pct, fd_slack = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
rows = defaultdict(list)
for r in csv.DictReader(open(path)):
    rows[(r["pid"], r["process"])].append((int(r["t"]), int(r["rss_kb"]), int(r["fds"])))
ok = True
print(f"{'process':<16}{'pid':>8}{'rss q2 MB':>11}{'rss q4 MB':>11}{'growth':>9}{'fds q2':>8}{'fds end':>9}")
for (pid, name), samples in sorted(rows.items(), key=lambda kv: kv[0][1]):
    if len(samples) < 8:
        continue  # a process that came and went (a restarted worker)
    n = len(samples)
    q2 = samples[n // 4: n // 2]
    q4 = samples[3 * n // 4:]
    rss2 = sum(s[1] for s in q2) / len(q2) / 1024
    rss4 = sum(s[1] for s in q4) / len(q4) / 1024
    fd2 = max(s[2] for s in q2)
    fd_end = samples[-1][2]
    growth = rss4 - rss2
    bad = growth > slack_mb and growth > rss2 * slack_pct / 100
    bad_fd = fd_end > fd2 + fd_slack
    print(f"{name:<16}{pid:>8}{rss2:>11.1f}{rss4:>11.1f}{growth:>+9.1f}{fd2:>8}{fd_end:>9}"
          + ("  RSS GREW" if bad else "") + ("  FDS GREW" if bad_fd else ""))
    ok = ok and not bad and not bad_fd
sys.exit(0 if ok else 1)
EOF
if ((failed)); then
  echo "soak: FAILED (see $out)"
  exit 1
fi
echo "soak: passed ($round bench rounds; samples in $out/soak.csv)"
