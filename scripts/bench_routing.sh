#!/usr/bin/env bash
# Routing quality: the same workload at the same request rate against a
# local cluster of simulated workers (`tandem up --engine sim`), once per
# routing policy; prints each policy's prefix-cache hit rate, TTFT, ITL and
# throughput, and kv_cache_aware's ratios to round_robin and prefix_aware.
#
# The workload's working set exceeds one worker's KV cache but fits in the
# cluster's: shared-prefix with GROUPS prefixes of PREFIX tokens (or
# multi-turn sessions), each worker's cache holding CACHE_BLOCKS blocks.
#
# Usage: scripts/bench_routing.sh TANDEM_BIN [shared-prefix|multi-turn] [quick]
set -euo pipefail
bin=${1:?usage: bench_routing.sh TANDEM_BIN [shared-prefix|multi-turn] [quick]}
dataset=${2:-shared-prefix}
quick=${3:-}
workers=${WORKERS:-8}
policies=${POLICIES:-"round_robin least_request power_of_two prefix_aware kv_cache_aware"}
rate=${RATE:-16}   # sessions per second
prompts=${PROMPTS:-400}
[[ $quick == quick ]] && prompts=${PROMPTS:-160}
# A sim block (builtin:tiny's geometry, 16 tokens) takes 12 KiB: 2048 blocks = 24 MiB.
cache=${CACHE:-24MiB}
case $dataset in
  shared-prefix)
    # 32 groups x 4096 tokens = 8192 blocks: 4x one worker's 2048, half the cluster's.
    flags="--dataset shared-prefix --num-groups ${GROUPS_:-32} --prefix-len ${PREFIX:-4096} --suffix-len 128 --output-len 64"
    endpoint=completions ;;
  multi-turn)
    # ~16 live sessions of ~2k tokens: twice one worker's 1024 blocks, a quarter of the cluster's.
    flags="--dataset multi-turn --turns 5 --system-len 1024 --user-len 128 --output-len 32"
    cache=${CACHE:-12MiB}
    rate=${RATE:-8}
    endpoint=chat ;;
  *) echo "unknown dataset $dataset" >&2; exit 2 ;;
esac
out=$(mktemp -d /tmp/tandem-bench-routing.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for policy in $policies; do
  run="$out/$policy"
  mkdir -p "$run"
  "$bin" up --engine sim --aggregated "$workers" --policy "$policy" --kv-cache-memory "$cache" \
    --worker-arg=--max-model-len=32768 \
    --port 0 --ready-file "$run/url" --run-dir "$run" --worker-threads 1 > "$run/up.log" 2>&1 &
  up=$!
  for _ in $(seq 600); do [[ -s "$run/url" ]] && break; sleep 0.1; done
  [[ -s "$run/url" ]] || { echo "tandem up failed for $policy:" >&2; tail -20 "$run/up.log" >&2; exit 1; }
  "$bin" bench --url "$(cat "$run/url")" --endpoint "$endpoint" $flags --num-prompts "$prompts" \
    --request-rate "$rate" --seed 7 --json "$out/$policy.json" --title "$policy" > "$run/bench.txt" 2>&1 \
    || { cat "$run/bench.txt" >&2; exit 1; }
  kill -TERM "$up"; wait "$up" || true
  echo "$policy: done" >&2
done
python3 - "$out" $policies <<'EOF'
import json, sys
out, policies = sys.argv[1], sys.argv[2:]
r = {p: json.load(open(f"{out}/{p}.json")) for p in policies}
cols = [("hit rate", lambda j: j.get("router_prefix_hit_rate", 0) * 100, "%.1f%%"),
        ("TTFT p50 ms", lambda j: j["ttft_ms"]["median"], "%.1f"),
        ("TTFT p90 ms", lambda j: j["ttft_ms"]["p90"], "%.1f"),
        ("TTFT p99 ms", lambda j: j["ttft_ms"]["p99"], "%.1f"),
        ("ITL p50 ms", lambda j: j["itl_ms"]["median"], "%.2f"),
        ("ITL p99 ms", lambda j: j["itl_ms"]["p99"], "%.2f"),
        ("out tok/s", lambda j: j["output_throughput"], "%.0f"),
        ("failed", lambda j: j["failed"], "%d")]
print("| policy | " + " | ".join(c[0] for c in cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for p in policies:
    print(f"| {p} | " + " | ".join(c[2] % c[1](r[p]) for c in cols) + " |")
if "kv_cache_aware" in r:
    k = r["kv_cache_aware"]
    for base in ("round_robin", "prefix_aware"):
        if base not in r: continue
        b = r[base]
        hit = (k.get("router_prefix_hit_rate", 0) / b["router_prefix_hit_rate"]) if b.get("router_prefix_hit_rate") else float("inf")
        print(f"kv_cache_aware vs {base}: hit rate x{hit:.2f}, "
              f"TTFT p90 {b['ttft_ms']['p90'] / k['ttft_ms']['p90']:.2f}x better, "
              f"TTFT p50 {b['ttft_ms']['median'] / k['ttft_ms']['median']:.2f}x better, "
              f"ITL p99 {b['itl_ms']['p99'] / k['itl_ms']['p99']:.2f}x better, "
              f"throughput x{k['output_throughput'] / b['output_throughput']:.2f}")
EOF
