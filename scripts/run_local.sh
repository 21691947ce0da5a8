#!/usr/bin/env bash
# `make run`: a local cluster on the built-in model -- a prefill worker, a
# decode worker (KV moved between them over UCX shared memory) and the
# OpenAI-compatible router on 127.0.0.1:PORT -- started by `tandem up`, which
# prints a ready-to-paste curl command and stops everything on Ctrl-C.
# TANDEM_MODEL picks another model (a Hugging Face checkpoint directory).
set -euo pipefail
TANDEM=${1:-build/tandem}
PORT=${2:-8000}
MODEL=${TANDEM_MODEL:-builtin:tiny}
exec "$TANDEM" up --model "$MODEL" --port "$PORT"
