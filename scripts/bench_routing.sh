#!/usr/bin/env bash
# Routing quality: the same workload at the same request rate against a
# local cluster (`tandem up --aggregated N`), once per routing policy; prints
# each policy's prefix-cache hit rate, TTFT, ITL and throughput, and
# kv_cache_aware's ratios to round_robin and prefix_aware.
#
# ENGINE=sim (the default): 8 simulated workers (`--engine sim`). ENGINE=real:
# 2 real CPU workers on builtin:small (`--engine real`), with smaller
# workloads and rates that two workers sharing a 2-core machine sustain.
#
# The workload's working set exceeds one worker's KV cache but fits in the
# cluster's: shared-prefix with GROUPS_ prefixes of PREFIX tokens (or
# multi-turn sessions), each worker's cache holding CACHE bytes of blocks.
#
# COMMON (multi-turn on real workers): system-prompt tokens every session
# shares, out of its 256 (default 0: each session's own); TURNS: turns per
# session (default 4).
# CONFIG: a router config file for `tandem up --config` (its decode pool's
# policy and params); then POLICIES only names the runs. Give it
# `debug: {worker_details: true}` for the per-worker spread (the router
# shows worker addresses only as debug output).
# WORKER_ARGS: more worker flags for every policy's cluster (e.g.
# "--max-batched-tokens=256"), passed as --worker-arg=FLAG each.
#
# Usage: [ENGINE=sim|real] scripts/bench_routing.sh TANDEM_BIN [shared-prefix|multi-turn] [quick]
set -euo pipefail
bin=${1:?usage: bench_routing.sh TANDEM_BIN [shared-prefix|multi-turn] [quick]}
dataset=${2:-shared-prefix}
quick=${3:-}
engine=${ENGINE:-sim}
policies=${POLICIES:-"round_robin least_request power_of_two prefix_aware kv_cache_aware"}
case $engine/$dataset in
  sim/*)
    workers=${WORKERS:-8}
    up_flags="--engine sim --worker-arg=--max-model-len=32768"
    rate=${RATE:-16}   # sessions per second
    prompts=${PROMPTS:-400}
    [[ $quick == quick ]] && prompts=${PROMPTS:-160}
    # A sim block (builtin:tiny's geometry, 16 tokens) takes 12 KiB: 2048 blocks = 24 MiB.
    cache=${CACHE:-24MiB} ;;&
  sim/shared-prefix)
    # 32 groups x 4096 tokens = 8192 blocks: 4x one worker's 2048, half the cluster's.
    groups=${GROUPS_:-32}
    if [[ $quick == quick ]]; then
      # The same ratios at half the size: 16 groups x 4096 tokens = 4096 blocks,
      # 4x one worker's 1024 (12 MiB), half the cluster's. 240 requests, so
      # that the groups' 16 cold first requests (a miss under every policy)
      # stay under the 10% that TTFT p90 looks at (160 requests of 32 groups
      # put p90 on a cold miss).
      groups=${GROUPS_:-16}
      cache=${CACHE:-12MiB}
      prompts=${PROMPTS:-240}
    fi
    flags="--dataset shared-prefix --num-groups $groups --prefix-len ${PREFIX:-4096} --suffix-len 128 --output-len 64"
    endpoint=completions ;;
  sim/multi-turn)
    # ~16 live sessions of ~2k tokens: twice one worker's 1024 blocks, a quarter of the cluster's.
    flags="--dataset multi-turn --turns 5 --system-len 1024 --user-len 128 --output-len 32"
    cache=${CACHE:-12MiB}
    rate=${RATE:-8}
    endpoint=chat ;;
  real/*)
    # builtin:small keeps f32 KV: 8 layers x 2 (K, V) x 4 KV heads x 64 dims x
    # 16 tokens x 4 bytes = 256 KiB per block (16 KiB per token). Each worker
    # gets one BLAS thread: the two share the machine's 2 cores, where one
    # prefills ~1,100 tokens/s and decodes ~115 (alone) to ~220 (4 batched)
    # tokens/s (`tandem bench engine --threads 1`, quiet machine).
    workers=${WORKERS:-2}
    up_flags="--engine real --model builtin:small" ;;&
  real/shared-prefix)
    # 11 groups x 512 tokens = 352 blocks: 1.6x one worker's 224 (56 MiB),
    # 0.79 of the cluster's, leaving each worker room for the suffix and
    # output blocks that finished requests leave in its LRU (a tighter fit,
    # 12 groups, had kv_cache_aware evict its own prefixes now and then). A
    # miss prefills 576 tokens (~0.5 s on one core), a hit 64. 240 requests,
    # so that the 11 cold first requests of the groups (a miss under every
    # policy) stay under the 10% that TTFT p90 looks at. With 2 workers and a
    # working set within the cluster's cache, round_robin still finds a group
    # on its worker more than half the time, so kv_cache_aware's hit rate can
    # be about 1.6-2x round_robin's, no more.
    flags="--dataset shared-prefix --num-groups ${GROUPS_:-11} --prefix-len ${PREFIX:-512} --suffix-len 64 --output-len 32"
    cache=${CACHE:-56MiB}
    rate=${RATE:-1}
    prompts=${PROMPTS:-240}
    [[ $quick == quick ]] && prompts=${PROMPTS:-40}
    endpoint=completions ;;
  real/multi-turn)
    # Chat text re-encodes to ~1.9 builtin tokens per drawn token, answers
    # included: turns of ~580, 740, 890 and 1060 tokens (the last 68 blocks).
    # Each worker's 128 blocks (32 MiB) hold the largest request and another.
    # Here the working set cannot exceed a worker's cache at a rate two CPU
    # workers sustain: at 0.2 sessions/s only 1-2 sessions are live (~55
    # blocks each), about one worker's cache when round_robin sends every
    # session to both. A smaller cache or a higher rate stalls admission and
    # the misses feed on themselves (24 MiB at 0.25/s on a loaded machine:
    # round_robin 9% hits, 10 s TTFT). What round_robin loses here is affinity:
    # half of its turns land where the previous turn did not run.
    # COMMON: tokens of the system prompt shared by every session (one
    # application's prompt, --common-prefix-len), taken out of its 256.
    flags="--dataset multi-turn --turns ${TURNS:-4} --common-prefix-len ${COMMON:-0} --system-len $((256 - ${COMMON:-0})) --user-len 32 --output-len 32"
    cache=${CACHE:-32MiB}
    rate=${RATE:-0.2}
    prompts=${PROMPTS:-80}
    [[ $quick == quick ]] && prompts=${PROMPTS:-24}
    endpoint=chat ;;
  sim/*|real/*) echo "unknown dataset $dataset" >&2; exit 2 ;;
  *) echo "ENGINE must be sim or real, got $engine" >&2; exit 2 ;;
esac
for arg in ${WORKER_ARGS:-}; do up_flags+=" --worker-arg=$arg"; done
out=$(mktemp -d /tmp/tandem-bench-routing.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for policy in $policies; do
  run="$out/$policy"
  mkdir -p "$run"
  policy_flags=(--policy "$policy")
  [[ -n ${CONFIG:-} ]] && policy_flags=(--config "$CONFIG")
  "$bin" up $up_flags --aggregated "$workers" "${policy_flags[@]}" --kv-cache-memory "$cache" \
    --port 0 --ready-file "$run/url" --run-dir "$run" --worker-threads 1 > "$run/up.log" 2>&1 &
  up=$!
  for _ in $(seq 600); do [[ -s "$run/url" ]] && break; sleep 0.1; done
  [[ -s "$run/url" ]] || { echo "tandem up failed for $policy:" >&2; tail -20 "$run/up.log" >&2; exit 1; }
  "$bin" bench --url "$(cat "$run/url")" --endpoint "$endpoint" $flags --num-prompts "$prompts" \
    --request-rate "$rate" --ignore-eos --seed 7 --save-detailed --json "$out/$policy.json" --title "$policy" > "$run/bench.txt" 2>&1 \
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
# Multi-turn: a session's first turn is a prompt no worker has seen, a miss
# under every policy; the later turns are what routing can serve from cache.
def pct(v, q):
    v = sorted(v)
    if not v: return 0.0
    k = (len(v) - 1) * q / 100
    f = int(k)
    c = min(f + 1, len(v) - 1)
    return v[f] + (v[c] - v[f]) * (k - f)
if any(x.get("turn", 0) > 0 for p in policies for x in r[p].get("requests", [])):
    print("\n| policy | first turns | TTFT p50 ms | later turns | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |")
    print("|---" * 7 + "|")
    for p in policies:
        reqs = [x for x in r[p]["requests"] if x["ok"] and x["ttft_ms"] is not None]
        first = [x["ttft_ms"] for x in reqs if x["turn"] == 0]
        later = [x["ttft_ms"] for x in reqs if x["turn"] > 0]
        print(f"| {p} | {len(first)} | {pct(first, 50):.1f} | {len(later)} | {pct(later, 50):.1f} "
              f"| {pct(later, 90):.1f} | {pct(later, 99):.1f} |")
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
