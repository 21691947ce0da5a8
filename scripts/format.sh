#!/usr/bin/env bash
# The tree's C++ and CUDA sources through clang-format 14 with the root
# .clang-format. `scripts/format.sh` rewrites them in place;
# `scripts/format.sh --check` changes nothing and fails, listing the files,
# when one differs (CI runs it: .ci/run through `make format-check`).
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
[[ -n $fmt ]] || { echo "format.sh: clang-format 14 is not installed (scripts/install_deps.sh)" >&2; exit 1; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$fmt" --style=file "$f" | cmp -s - "$f" || bad+=("$f")
  done
  if ((${#bad[@]} > 0)); then
    printf 'format.sh: not formatted (run `make format`):\n' >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format.sh: ${#files[@]} files formatted"
else
  printf '%s\0' "${files[@]}" | xargs -0 -n 32 -P "$(nproc)" "$fmt" -i --style=file
fi
