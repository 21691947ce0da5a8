# shellcheck shell=bash
# Sourced by the GPU check scripts (gpu_engine_checks.sh, gpu_nccl_checks.sh):
# the bundle's libraries on the loader path, cuBLASLt from torch's nvidia
# packages unless TANDEM_CUBLASLT is set, and the steps' bookkeeping.
# REQUIRES: $bin, the bundle's directory.
: "${bin:?gpu_checks_common.sh: set bin, the bundle directory, before sourcing}"
export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -z ${TANDEM_CUBLASLT:-} ]]; then
  TANDEM_CUBLASLT=$(
    python3 - 2>/dev/null <<'PY'
import glob, os, nvidia
for root in nvidia.__path__:
    for p in glob.glob(os.path.join(root, "**", "libcublasLt.so.13*"), recursive=True):
        print(p)
        raise SystemExit
PY
  )
fi
export TANDEM_CUBLASLT
failed=()

step() {  # step NAME COMMAND...: runs it; a failure is recorded, not fatal
  local name=$1
  shift
  echo "=== $name"
  if ! "$@"; then failed+=("$name"); fi
}

finish() {  # exits nonzero, naming them, if any step failed
  if ((${#failed[@]} > 0)); then
    echo "FAILED: ${failed[*]}"
    exit 1
  fi
  echo "all passed"
}
