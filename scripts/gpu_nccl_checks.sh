#!/usr/bin/env bash
# The NCCL KV transport's checks and measurements (issue 24) in one go, on a
# machine with two Hopper GPUs of one host, CUDA 13 and torch's NCCL (the lent
# `nvidia-h200-x2`):
#   probe    cuda_runner_test's FirstUse/StepsNever cases: which first-use
#            call of a step waits for another stream's work (a posted NCCL
#            receive holds such a call until its bytes come; cudaFree is the
#            control that must wait)
#   seam     kvtransfer_nccl_gpu_test: the real library between the two GPUs
#            (groups in order, staged copies, an abort)
#   bench    `tandem bench transfer --backend nccl --op push`, scattered
#            blocks and one run (--sequential), against cudaMemcpyPeer of the
#            same bytes in the same run
#   disagg   disagg_grpc_test's push cases with GPU workers on one GPU each
#            (cuda:by-role) over nccl (the filter of ctest's
#            disagg_grpc_test_ucx_staged), --batch-invariant
#   up       up_command_test's two-GPU split cluster over nccl
#   compare  one prefill GPU + one decode GPU over nccl against two aggregated
#            GPUs: `tandem up` of the 8B preset, `tandem bench` of 4-8k
#            prompts and 512 outputs at RATE requests/s (default 4.5); the
#            JSON and HTML reports in $OUT
# Steps run in the order given (default: all); every step runs, and the script
# exits nonzero if any failed. NCCL is torch's libnccl.so.2 unless TANDEM_NCCL
# is set; cuBLASLt is found in torch's nvidia packages unless TANDEM_CUBLASLT
# is set; NCCL_NVLS_ENABLE stays 0.
#
# Usage: gpu_nccl_checks.sh BIN_DIR [probe] [seam] [bench] [disagg] [up] [compare]
#   BIN_DIR holds tandem, cuda_runner_test, kvtransfer_nccl_gpu_test,
#   disagg_grpc_test and up_command_test with lib/ beside them, as
#   scripts/device_bundle.sh packs them:
#     scripts/device_bundle.sh /tmp/gn build/tandem build/worker/runner/cuda_runner_test \
#       build/kvtransfer/kvtransfer_nccl_gpu_test build/tests/disagg_grpc_test \
#       build/tests/up_command_test
set -uo pipefail
bin=${1:?usage: gpu_nccl_checks.sh BIN_DIR [probe] [seam] [bench] [disagg] [up] [compare]}
shift
steps=("$@")
((${#steps[@]} > 0)) || steps=(probe seam bench disagg up compare)
out=${OUT:-/tmp/tandem_gpu_nccl}
mkdir -p "$out"
# shellcheck source=scripts/gpu_checks_common.sh
source "$(dirname "$0")/gpu_checks_common.sh"
export NCCL_NVLS_ENABLE=0
if [[ -z ${TANDEM_NCCL:-} ]]; then
  TANDEM_NCCL=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
fi
export TANDEM_NCCL
echo "NCCL: ${TANDEM_NCCL:-on the loader path}; cuBLASLt: ${TANDEM_CUBLASLT:-on the loader path}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

# compare: NAME then `tandem up` flags; the cluster serves, the bench runs, it stops.
compare_one() {
  local name=$1
  shift
  local ready="$out/$name.url" log="$out/up_$name.log"
  rm -f "$ready"
  "$bin/tandem" up --model builtin:llama-3.1-8b --device cuda --insecure --port 0 --ready-file "$ready" "$@" \
    >"$log" 2>&1 &
  local up=$! t0=$SECONDS
  while [[ ! -s $ready ]] && ((SECONDS - t0 < 240)) && kill -0 "$up" 2>/dev/null; do sleep 1; done
  if [[ ! -s $ready ]]; then
    echo "$name: not ready after $((SECONDS - t0)) s"
    tail -30 "$log"
    kill -INT "$up" 2>/dev/null
    wait "$up"
    return 1
  fi
  echo "$name: ready after $((SECONDS - t0)) s"
  local rc=0
  timeout 300 "$bin/tandem" bench --url "$(cat "$ready")" --dataset random --input-len 6144 --random-range-ratio 0.33 \
    --output-len 512 --num-prompts 90 --request-rate "${RATE:-4.5}" --seed 1 --num-warmups 2 \
    --goodput ttft:2000 tpot:25 --json "$out/$name.json" --html "$out/$name.html" --title "$name" || rc=$?
  kill -INT "$up"
  wait "$up"
  grep -iE "error|fallback" "$log" | grep -v INSECURE | tail -5
  return "$rc"
}

for s in "${steps[@]}"; do
  case $s in
    probe)
      step "cuda_runner_test (first use beside a blocked stream)" "$bin/cuda_runner_test" \
        --gtest_filter='*FirstUse*:*StepsNever*' ;;
    seam)
      step kvtransfer_nccl_gpu_test "$bin/kvtransfer_nccl_gpu_test" ;;
    bench)
      step "bench transfer nccl (scattered blocks)" "$bin/tandem" bench transfer --backend nccl --op push --repeats 7
      step "bench transfer nccl (one run)" "$bin/tandem" bench transfer --backend nccl --op push --repeats 7 \
        --sequential ;;
    disagg)
      step "disagg_grpc_test (cuda:by-role, nccl)" env TANDEM_BIN="$bin/tandem" TANDEM_TEST_WORKER_DEVICE=cuda:by-role \
        TANDEM_TEST_KV_TRANSPORT=nccl TANDEM_TEST_WORKER_ARGS=--batch-invariant "$bin/disagg_grpc_test" \
        '--gtest_filter=*PushedSplits*:*ForgedCachedPrefix*:*EveryPushFault*:*StoppingPusher*:*SenderError*:*AKilled*:*ExpiredReservation*:*CancelledReservation*:*RandomCancellations*:*Shutdown*:*Draining*:*FallbackError*:*PairingOffer*' ;;
    up)
      step "up_command_test (two GPUs over nccl)" env TANDEM_BIN="$bin/tandem" "$bin/up_command_test" \
        --gtest_filter='*TwoGpu*' ;;
    compare)
      step "disaggregated over nccl" compare_one disagg_nccl --prefill 1 --decode 1 --kv-transport nccl
      step "aggregated on two GPUs" compare_one agg --aggregated 2 ;;
    *)
      echo "unknown step '$s' (probe, seam, bench, disagg, up, compare)" >&2
      failed+=("$s") ;;
  esac
done
finish
