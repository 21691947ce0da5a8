#!/usr/bin/env bash
# `make run`: starts a local pair of tandem workers on the built-in model, a
# prefill worker and a decode worker joined by UCX over shared memory, shows
# one request split across them (prefill there, KV pulled, decode here), then
# keeps serving until Ctrl-C. (The router issue puts the OpenAI API on
# 127.0.0.1:8000 in front of them.)
set -euo pipefail
TANDEM=${1:-build/tandem}
PORT=${2:-50051}
MODEL=${TANDEM_MODEL:-builtin:tiny}
PROMPT=${TANDEM_PROMPT:-"Once upon a time"}

pids=()
files=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -f "${files[@]}"
}
trap cleanup EXIT INT TERM

# start_worker ROLE PORT: starts a worker and prints its address once it serves.
start_worker() {
  local ready
  ready=$(mktemp -u /tmp/tandem-worker.XXXXXX)
  files+=("$ready")
  "$TANDEM" worker --model "$MODEL" --role "$1" --host 127.0.0.1 --port "$2" --ready-file "$ready" \
    --kv-transport ucx --kv-transport-tls shm >&2 &
  pids+=($!)
  for _ in $(seq 300); do
    [[ -f "$ready" ]] && { cat "$ready"; return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "run_local: the $1 worker exited" >&2; return 1; }
    sleep 0.1
  done
  echo "run_local: the $1 worker did not start in 30 s" >&2
  return 1
}

# Command substitution would run start_worker in a subshell (losing its pid):
# start both in this shell, reading the addresses from files.
decode_file=$(mktemp /tmp/tandem-addr.XXXXXX); files+=("$decode_file")
prefill_file=$(mktemp /tmp/tandem-addr.XXXXXX); files+=("$prefill_file")
start_worker decode $((PORT + 1)) > "$decode_file"
start_worker prefill "$PORT" > "$prefill_file"
decode=$(cat "$decode_file")
prefill=$(cat "$prefill_file")

echo "== prefill on $prefill, decode on $decode (the built-in model has random weights: expect noise)"
"$TANDEM" generate --target "$prefill" --decode "$decode" --prompt "$PROMPT" --max-tokens 48 \
  --temperature 0.8 --seed 1
echo "== try: $TANDEM generate --target $prefill --decode $decode --prompt 'Hi'"
echo "== Ctrl-C to stop"
wait "${pids[@]}"
