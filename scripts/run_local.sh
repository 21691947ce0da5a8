#!/usr/bin/env bash
# `make run`: a local cluster on the built-in model -- a prefill worker, a
# decode worker (KV moved between them over UCX shared memory) and the
# OpenAI-compatible router on 127.0.0.1:PORT -- started by `tandem up`, which
# prints a ready-to-paste curl command and stops everything on Ctrl-C.
# TANDEM_MODEL picks another model (a Hugging Face checkpoint directory).
# Where Hopper GPUs exist (nvidia-smi reports compute capability 9.0), GPU
# workers serve instead, one per GPU: with two or more GPUs that reach each
# other's memory (nvidia-smi topo -p2p r) half of them prefill and the rest
# decode (the KV moves GPU to GPU over cuda_ipc); otherwise one aggregated
# worker per GPU. TANDEM_DEVICE=cpu keeps the CPU
# cluster, TANDEM_DEVICE=cuda asks for the GPUs.
set -euo pipefail
TANDEM=${1:-build/tandem}
PORT=${2:-8000}
MODEL=${TANDEM_MODEL:-builtin:tiny}
DEVICE=${TANDEM_DEVICE:-auto}
gpus=0
if [[ $DEVICE != cpu ]] && command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -c '^9\.0' || true)
fi
case $DEVICE in
  auto | cuda)
    p2p=no
    # Every entry of the read peer-access matrix OK (its rows: GPUn, then X
    # on the diagonal and OK or NS/CNS/... elsewhere).
    if ((gpus > 1)) && nvidia-smi topo -p2p r 2>/dev/null | awk '
        $1 ~ /^GPU[0-9]+$/ {
          row = 0
          for (i = 2; i <= NF; ++i) if ($i == "X") row = 1
          if (!row) next
          ++rows
          for (i = 2; i <= NF; ++i) if ($i != "X" && $i != "OK") bad = 1
        }
        END { exit !(rows > 1 && !bad) }'; then
      p2p=yes
    fi
    if [[ $p2p == yes ]]; then
      exec "$TANDEM" up --model "$MODEL" --port "$PORT" --device cuda --prefill $((gpus / 2)) \
        --decode $((gpus - gpus / 2))
    elif ((gpus > 0)); then
      exec "$TANDEM" up --model "$MODEL" --port "$PORT" --device cuda --aggregated "$gpus"
    elif [[ $DEVICE == cuda ]]; then
      echo "make run: TANDEM_DEVICE=cuda but nvidia-smi reports no Hopper GPU (compute capability 9.0)" >&2
      exit 2
    fi ;;
  cpu) ;;
  *)
    echo "make run: TANDEM_DEVICE must be auto, cpu or cuda, got '$DEVICE'" >&2
    exit 2 ;;
esac
exec "$TANDEM" up --model "$MODEL" --port "$PORT"
