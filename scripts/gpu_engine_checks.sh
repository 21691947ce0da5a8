#!/usr/bin/env bash
# The GPU engine's checks and benchmark in one go, on a machine with a Hopper
# GPU, CUDA 13 and torch/transformers (the lent GPU machine):
#   runner   cuda_runner_test, lt_gemm_test and gpu_sampler_test (the cuda
#            runner against the CPU runner, chunk and batch invariance,
#            --gpu-memory-utilization, device block checksums, no step waiting
#            beside a blocked stream; cuBLASLt rows independent of the batch,
#            the GEMV and the greedy argmax; the GPU sampler's tokens against
#            the host sampler's)
#   transfer kvtransfer_cuda_ipc_test (the cuda_ipc KV transport), then
#            disagg_grpc_test on GPU workers over cuda_ipc (--batch-invariant)
#            and up_command_test's GPU split cluster through the router
#   grpc     worker_grpc_test with TANDEM_TEST_WORKER_DEVICE=cuda: the worker
#            tests' aggregated real-engine workers on the GPU runner
#   reference  tests/reference/gpu_transformers_check.py (against transformers
#            bf16 and the CPU engine in f32)
#   bench    `tandem export-model --preset llama-3.1-8b` (once, into $WORK) and
#            `tandem bench engine --device cuda` on it (BENCH_ENGINE_ARGS: more
#            options, e.g. --prefill-lens 8192), transformers in the same
#            run; the JSON in $OUT (or $WORK); then `tandem bench transfer
#            --backend cuda_ipc`, pull and push
# Steps run in the order given (default: all); every step runs, and the script
# exits nonzero if any failed. cuBLASLt is found in torch's nvidia packages
# unless TANDEM_CUBLASLT is set.
#
# Usage: gpu_engine_checks.sh BIN_DIR [runner] [transfer] [grpc] [reference] [bench]
#   BIN_DIR holds tandem, cuda_runner_test, lt_gemm_test, gpu_sampler_test,
#   kvtransfer_cuda_ipc_test, disagg_grpc_test, up_command_test and
#   worker_grpc_test with lib/ beside them, as scripts/device_bundle.sh packs
#   them:
#     scripts/device_bundle.sh /tmp/gb build/tandem build/worker/runner/cuda_runner_test \
#       build/worker/runner/lt_gemm_test build/worker/runner/gpu_sampler_test \
#       build/kvtransfer/kvtransfer_cuda_ipc_test build/tests/disagg_grpc_test \
#       build/tests/up_command_test build/tests/worker_grpc_test
#   and the repository (for the Python scripts) is the working directory.
set -uo pipefail
bin=${1:?usage: gpu_engine_checks.sh BIN_DIR [runner] [transfer] [grpc] [reference] [bench]}
shift
steps=("$@")
((${#steps[@]} > 0)) || steps=(runner transfer grpc reference bench)
work=${WORK:-/tmp/tandem_gpu_engine}
out=${OUT:-$work}
mkdir -p "$work" "$out"
# shellcheck source=scripts/gpu_checks_common.sh
source "$(dirname "$0")/gpu_checks_common.sh"
echo "cuBLASLt: ${TANDEM_CUBLASLT:-on the loader path}"
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader

for s in "${steps[@]}"; do
  case $s in
    runner)
      step cuda_runner_test "$bin/cuda_runner_test"
      step lt_gemm_test "$bin/lt_gemm_test"
      step gpu_sampler_test "$bin/gpu_sampler_test" ;;
    transfer)
      step kvtransfer_cuda_ipc_test "$bin/kvtransfer_cuda_ipc_test"
      step "disagg_grpc_test (cuda, cuda_ipc)" env TANDEM_BIN="$bin/tandem" TANDEM_TEST_WORKER_DEVICE=cuda \
        TANDEM_TEST_KV_TRANSPORT=cuda_ipc TANDEM_TEST_WORKER_ARGS=--batch-invariant "$bin/disagg_grpc_test"
      step "up_command_test (GPU split cluster)" env TANDEM_BIN="$bin/tandem" "$bin/up_command_test" \
        --gtest_filter='*Gpu*' ;;
    grpc)
      step "worker_grpc_test (cuda)" env TANDEM_BIN="$bin/tandem" TANDEM_TEST_WORKER_DEVICE=cuda \
        "$bin/worker_grpc_test" ;;
    reference)
      step gpu_transformers_check python3 tests/reference/gpu_transformers_check.py --tandem "$bin/tandem" \
        --workdir "$work/reference" ;;
    bench)
      if [[ ! -f $work/llama-3.1-8b/config.json ]]; then
        step export "$bin/tandem" export-model --preset llama-3.1-8b --dtype bfloat16 "$work/llama-3.1-8b"
      fi
      step "bench engine" bash -c "'$bin/tandem' bench engine --device cuda --model '$work/llama-3.1-8b' \
        --transformers-script scripts/bench_engine_transformers.py ${BENCH_ENGINE_ARGS:-} \
        --json >'$out/bench_engine_cuda.json'"
      for op in pull push; do
        step "bench transfer cuda_ipc ($op)" "$bin/tandem" bench transfer --backend cuda_ipc --op "$op" --repeats 9
      done ;;
    *)
      echo "unknown step '$s' (runner, transfer, grpc, reference, bench)" >&2
      failed+=("$s") ;;
  esac
done
finish
