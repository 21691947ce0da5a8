#!/usr/bin/env bash
# Prints deploy/kustomize/base/tandem.yaml: the chart rendered with base-values.yaml
# (release tandem, namespace tandem), without the chart's `helm test` pod.
# Usage: render_base.sh HELMRENDER_BIN  (or helm: `helm template` is used where it is on PATH)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
args=(--release tandem --namespace tandem -f "$here/base-values.yaml")
if command -v helm >/dev/null; then
  helm template tandem "$here/../helm/tandem" --namespace tandem -f "$here/base-values.yaml" --skip-tests
else
  "${1:?usage: render_base.sh HELMRENDER_BIN}" --chart "$here/../helm/tandem" "${args[@]}"
fi | awk '
  /^---$/ { if (doc != "" && doc !~ /# Source: [^\n]*\/templates\/tests\//) printf "%s", doc; doc = $0 "\n"; next }
  { doc = doc $0 "\n" }
  END { if (doc != "" && doc !~ /# Source: [^\n]*\/templates\/tests\//) printf "%s", doc }'
