#!/usr/bin/env bash
# `make run`: starts a local tandem worker on the built-in model, generates
# from a prompt through the gRPC API to show it working, then keeps serving
# until Ctrl-C. (The router issue turns this into a full local cluster
# serving the OpenAI API on 127.0.0.1:8000.)
set -euo pipefail
TANDEM=${1:-build/tandem}
PORT=${2:-50051}
MODEL=${TANDEM_MODEL:-builtin:tiny}
PROMPT=${TANDEM_PROMPT:-"Once upon a time"}

ready=$(mktemp -u /tmp/tandem-worker.XXXXXX)
"$TANDEM" worker --model "$MODEL" --host 127.0.0.1 --port "$PORT" --ready-file "$ready" &
worker=$!
trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null; rm -f "$ready"' EXIT INT TERM

for _ in $(seq 300); do
  [[ -f "$ready" ]] && break
  kill -0 $worker 2>/dev/null || { echo "run_local: the worker exited" >&2; exit 1; }
  sleep 0.1
done
[[ -f "$ready" ]] || { echo "run_local: the worker did not start in 30 s" >&2; exit 1; }
addr=$(cat "$ready")

echo "== generating from \"$PROMPT\" on $addr (the built-in model has random weights: expect noise)"
"$TANDEM" generate --target "$addr" --prompt "$PROMPT" --max-tokens 48 --temperature 0.8 --seed 1
echo "== worker serving $MODEL on $addr; try: $TANDEM generate --target $addr --prompt 'Hi'"
echo "== Ctrl-C to stop"
wait $worker
