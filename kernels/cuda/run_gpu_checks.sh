#!/usr/bin/env bash
# The CUDA kernels' checks, on a machine with a Hopper GPU, CUDA and torch:
#  1. the gtest suite (kernels_cuda_test);
#  2. compute-sanitizer memcheck, racecheck and synccheck on its Small* tests;
#  3. check_attention.py (FlashAttention's 2x-of-torch error rule).
# Exits nonzero if any step fails (every step runs regardless).
#
# Usage: run_gpu_checks.sh BIN_DIR [LOG_DIR]
#   BIN_DIR holds kernels_cuda_test and libtandem_kernels_capi.so (and lib/
#   with their shared libraries, as scripts/device_bundle.sh packs them).
# From a build here to the lent GPU machine (whose call sees /work/main):
#   cmake --build build --target kernels_cuda_test tandem_kernels_capi
#   scripts/device_bundle.sh /tmp/gpuchk build/kernels/kernels_cuda_test build/kernels/libtandem_kernels_capi.so
#   cp /tmp/gpuchk.tar.xz kernels/cuda/{run_gpu_checks.sh,check_attention.py} /work/main/.dev-NAME/
#   run (carry .dev-NAME): mkdir -p /tmp/b && tar xJf .dev-NAME/gpuchk.tar.xz -C /tmp/b &&
#                          bash .dev-NAME/run_gpu_checks.sh /tmp/b
# On the H100 the whole script takes about 45 s.
set -uo pipefail
bin=${1:?usage: run_gpu_checks.sh BIN_DIR [LOG_DIR]}
logs=${2:-/tmp/tandem_gpu_checks}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$logs"
export LD_LIBRARY_PATH="$bin/lib"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
failed=()

step() {  # step NAME COMMAND...
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "=== $name: ok ($((SECONDS - t0)) s)"
  else
    echo "=== $name: FAILED (rc $?, $((SECONDS - t0)) s); tail of $logs/$name.log:"
    tail -40 "$logs/$name.log"
    failed+=("$name")
  fi
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
step gtest "$bin/kernels_cuda_test" --gtest_brief=1
grep -E "PASSED|FAILED|SKIPPED" "$logs/gtest.log" | head -40
if [[ -n $sanitizer ]]; then
  for tool in memcheck racecheck synccheck; do
    step "sanitizer-$tool" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      "$bin/kernels_cuda_test" --gtest_filter='*Small*' --gtest_brief=1
    tail -3 "$logs/sanitizer-$tool.log"
  done
else
  echo "=== compute-sanitizer not found"
  failed+=(sanitizer-missing)
fi
# Python (torch) must keep the machine's own libstdc++: the bundle's is older.
mkdir -p "$logs/pylib"
for f in "$bin"/lib/*; do
  case $(basename "$f") in libstdc++*|libgcc_s*) ;; *) ln -sf "$f" "$logs/pylib/" ;; esac
done
step check_attention env LD_LIBRARY_PATH="$logs/pylib" python3 "$here/check_attention.py" \
  --lib "$bin/libtandem_kernels_capi.so"
cat "$logs/check_attention.log"

if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all GPU checks passed"
