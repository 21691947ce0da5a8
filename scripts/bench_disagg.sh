#!/usr/bin/env bash
# Disaggregated versus aggregated on real CPU workers (builtin:small): the
# same load against `tandem up --prefill 1 --decode 1 --disaggregation always`
# (the KV moves prefill -> decode over UCX shared memory) and against
# `tandem up --aggregated 2`, each worker with one BLAS thread; prints TTFT,
# ITL, TPOT, end-to-end latency and throughput of each, and disagg / agg.
#
# The load is two clients at once, so that the requests that suffer prefill
# interference are measured apart from those that cause it:
#   prompt: long prompts, short answers (random, ~1536 -> ~8 tokens): TTFT;
#   gen:    short prompts, long answers (random, ~64 -> ~256 tokens): ITL.
# Aggregated, a worker runs a long prompt as one ~1.5-2 s step (it fits one
# 2048-token chunk), and every sequence it is decoding waits that long for
# its next token; disaggregated, the decode worker never prefills, but all
# prefills queue on one worker instead of two.
#
# Sizing for 2 cores (`tandem bench engine --threads 1`, quiet: a 1536-token
# prefill takes 1.4 s, decode runs at ~115 tokens/s alone, ~220 for 4):
# 0.25 prompts/s keep the lone prefill worker ~35% busy (each aggregated
# worker ~18%: the share of its time its decodes stall); 0.15 generations/s
# ask ~40 tokens/s of the decode worker. At the default 2048-token step
# budget a stall is one long gap per decoding sequence (~0.3% of the gaps at
# these rates), so it shows in TPOT and end-to-end latency more than in
# ITL p99. ITL is the gap between streamed text chunks: the builtin models'
# bytes that do not yet end a UTF-8 character are held back, so ITL p95/p99
# span several steps; TPOT (from the token counts) is the per-token figure.
# UP_ARGS adds flags to both clusters' `tandem up`, e.g.
# UP_ARGS=--worker-arg=--max-batched-tokens=256 for chunked prefill.
#
# Usage: scripts/bench_disagg.sh TANDEM_BIN [quick]
set -euo pipefail
bin=${1:?usage: bench_disagg.sh TANDEM_BIN [quick]}
quick=${2:-}
seconds=${DURATION:-180}   # arrival window per setup
[[ $quick == quick ]] && seconds=${DURATION:-30}
prompt_rate=${PROMPT_RATE:-0.25}
gen_rate=${GEN_RATE:-0.15}
prompt_flags="--random-input-len ${PROMPT_LEN:-1536} --random-output-len 8 --random-range-ratio 0.25"
gen_flags="--random-input-len 64 --random-output-len ${GEN_LEN:-256} --random-range-ratio 0.25"
count() { python3 -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$2"; }
out=$(mktemp -d /tmp/tandem-bench-disagg.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for setup in disagg agg; do
  run="$out/$setup"
  mkdir -p "$run"
  case $setup in
    disagg) shape="--prefill 1 --decode 1 --disaggregation always" ;;
    agg) shape="--aggregated 2" ;;
  esac
  "$bin" up --engine real --model builtin:small $shape --worker-threads 1 ${UP_ARGS:-} \
    --port 0 --ready-file "$run/url" --run-dir "$run" > "$run/up.log" 2>&1 &
  up=$!
  for _ in $(seq 600); do [[ -s "$run/url" ]] && break; sleep 0.1; done
  [[ -s "$run/url" ]] || { echo "tandem up failed for $setup:" >&2; tail -20 "$run/up.log" >&2; exit 1; }
  url=$(cat "$run/url")
  "$bin" bench --url "$url" --dataset random $prompt_flags --num-prompts "$(count "$prompt_rate" "$seconds")" \
    --request-rate "$prompt_rate" --ignore-eos --seed 1 --json "$out/$setup-prompt.json" \
    --title "$setup prompt" > "$run/prompt.txt" 2>&1 &
  prompt=$!
  "$bin" bench --url "$url" --dataset random $gen_flags --num-prompts "$(count "$gen_rate" "$seconds")" \
    --request-rate "$gen_rate" --ignore-eos --seed 2 --json "$out/$setup-gen.json" \
    --title "$setup gen" > "$run/gen.txt" 2>&1 &
  gen=$!
  wait "$prompt" || { cat "$run/prompt.txt" >&2; exit 1; }
  wait "$gen" || { cat "$run/gen.txt" >&2; exit 1; }
  curl -sf "$url/metrics" > "$out/$setup.metrics" || true
  kill -TERM "$up"; wait "$up" || true
  echo "$setup: done ($out)" >&2
done
python3 - "$out" <<'EOF'
import json, re, sys
out = sys.argv[1]
r = {(s, k): json.load(open(f"{out}/{s}-{k}.json")) for s in ("disagg", "agg") for k in ("prompt", "gen")}
cols = [("TTFT p50", lambda j: j["ttft_ms"]["median"]), ("TTFT p95", lambda j: j["ttft_ms"]["p95"]),
        ("TTFT p99", lambda j: j["ttft_ms"]["p99"]), ("ITL p50", lambda j: j["itl_ms"]["median"]),
        ("ITL p95", lambda j: j["itl_ms"]["p95"]), ("ITL p99", lambda j: j["itl_ms"]["p99"]),
        ("TPOT p50", lambda j: j["tpot_ms"]["median"]), ("TPOT p99", lambda j: j["tpot_ms"]["p99"]),
        ("E2E p95", lambda j: j["e2e_ms"]["p95"]),
        ("out tok/s", lambda j: j["output_throughput"])]
print("| stream | setup | done | failed | " + " | ".join(c[0] + ("" if c[0] == "out tok/s" else " ms") for c in cols) + " |")
print("|---" * (len(cols) + 4) + "|")
for k in ("prompt", "gen"):
    for s in ("disagg", "agg"):
        j = r[(s, k)]
        print(f"| {k} | {s} | {j['completed']} | {j['failed']} | " + " | ".join("%.1f" % c[1](j) for c in cols) + " |")
    a, b = r[("disagg", k)], r[("agg", k)]
    print(f"| {k} | disagg / agg | | | " +
          " | ".join(("%.2f" % (c[1](a) / c[1](b))) if c[1](b) else "-" for c in cols) + " |")
for s in ("disagg", "agg"):
    tok = sum(r[(s, k)]["total_output_tokens"] for k in ("prompt", "gen"))
    dur = max(r[(s, k)]["duration_s"] for k in ("prompt", "gen"))
    print(f"{s}: both streams {tok / dur:.1f} output tok/s, {tok} tokens in {dur:.1f} s", end="")
    try:
        m = open(f"{out}/{s}.metrics").read()
    except OSError:
        print(); continue
    def total(name, label=""):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*{label}[^}}]*}})?\s+(\S+)$", m, re.M))
    print(f"; router: {total('tandem_router_time_to_first_token_seconds_count', 'disaggregated'):.0f} "
          f"split requests, KV pulled {total('tandem_router_kv_transfer_bytes_total') / 2**20:.0f} MiB, "
          f"fallbacks {total('tandem_router_fallbacks_total'):.0f}")
EOF
