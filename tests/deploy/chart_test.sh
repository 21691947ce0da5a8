#!/usr/bin/env bash
# The Helm chart's tests, without helm or a cluster: renders deploy/helm/tandem
# with each values file in its ci/ folder (helm template where helm is on PATH,
# else tests/deploy/helmrender), then for every render
#   - validates each object against the Kubernetes schemas (kubernetes-models and
#     @kubernetes-models/prometheus-operator from npm, pinned) and checks every
#     pod for the chart's security rules (tests/deploy/validate_k8s.mjs);
#   - runs `tandem router --check-config` on the router ConfigMap's YAML;
#   - runs `promtool check rules` on the PrometheusRule's groups (if promtool is here);
#   - checks what each values file asked for reached the objects (tests/deploy/check_render.py);
# then checks the failure cases (a missing required value, a schema violation)
# and that deploy/kustomize's base is the chart's render and its overlays build.
# Usage: chart_test.sh HELMRENDER_BIN TANDEM_BIN WORK_DIR
# Exits 77 (skipped) when node/npm or the Go renderer are missing.
set -euo pipefail
render_bin=${1:?usage: chart_test.sh HELMRENDER_BIN TANDEM_BIN WORK_DIR}
tandem=${2:?}
work=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
chart=$root/deploy/helm/tandem
mkdir -p "$work"

command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 77; }
if command -v helm >/dev/null; then
  render() { helm template "$@"; }
  helm lint "$chart" >/dev/null
else
  [[ -x $render_bin ]] || { echo "SKIP: no helm and no helmrender ($render_bin)"; exit 77; }
  render() { "$render_bin" "$@"; }
fi
if [[ ! -d $work/node_modules/@kubernetes-models/prometheus-operator ]]; then
  (cd "$work" && { [[ -f package.json ]] || echo '{"name": "tandem-chart-test", "private": true}' >package.json; } &&
   npm install --no-audit --no-fund --loglevel=error kubernetes-models@5.1.0 @kubernetes-models/prometheus-operator@6.0.0)
fi
cp "$here/validate_k8s.mjs" "$work/validate_k8s.mjs"

# The router's YAML names files the pod mounts under /etc/tandem (an API keys
# Secret): the check reads it with those paths under a folder that has them.
mkdir -p "$work/etc/tandem/auth"
echo "ops 0123456789abcdef0123456789abcdef admin" >"$work/etc/tandem/auth/keys"
check_router_config() {
  sed "s|/etc/tandem/|$work/etc/tandem/|g" "$1" >"$1.here"
  "$tandem" router --check-config "$1.here"
}

fail=0
for values in "$chart"/ci/*-values.yaml; do
  name=$(basename "$values" -values.yaml)
  out=$work/$name
  mkdir -p "$out"
  echo "== $name"
  render --chart "$chart" -f "$values" --release tandem --namespace llm \
    --api-versions monitoring.coreos.com/v1 --validate-yaml >"$out/manifests.yaml"
  python3 "$here/check_render.py" "$out/manifests.yaml" "$values" "$out" || fail=1
  "$tandem" worker --help >"$work/worker-help.txt"
  while read -r flag; do
    grep -qE -- "^ +$flag( |,|\$)" "$work/worker-help.txt" || { echo "FAIL: tandem worker has no $flag"; fail=1; }
  done <"$out/worker-flags.txt"
  node "$work/validate_k8s.mjs" "$out/objects.json" >"$out/validate.log" 2>&1 || { cat "$out/validate.log"; fail=1; }
  echo "$(grep -c '^ok ' "$out/validate.log") objects valid"
  check_router_config "$out/router.yaml" || fail=1
  if [[ -s $out/rules.yaml ]]; then
    if command -v promtool >/dev/null; then promtool check rules "$out/rules.yaml" || fail=1
    else echo "(promtool not installed: rules not checked)"; fi
  fi
done

echo "== failure cases"
expect_failure() {  # DESCRIPTION PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  if render --chart "$chart" --release tandem --namespace llm "$@" >"$work/bad.out" 2>"$work/bad.err"; then
    echo "FAIL: $what rendered"; fail=1
  elif ! grep -q -- "$pattern" "$work/bad.err"; then
    echo "FAIL: $what: the error does not say '$pattern':"; cat "$work/bad.err"; fail=1
  else
    echo "ok: $what: $(grep -m1 -- "$pattern" "$work/bad.err")"
  fi
}
expect_failure "TLS on without a Secret" "tls.secretName is required"
expect_failure "a PVC model without a claim" "model.pvc.claimName is required" \
  --set tls.secretName=t --set model.source=pvc
expect_failure "an unknown policy" "policy" --set tls.secretName=t --set router.policy.decode.name=fastest
expect_failure "an unknown top-level key" "replicaCount" --set tls.secretName=t --set replicaCount=3
expect_failure "a logits dtype workers do not take" "logitsDtype" --set tls.secretName=t \
  --set workerDefaults.logitsDtype=float16
expect_failure "a drain longer than the grace period" "drainTimeoutS must be shorter" \
  --set tls.secretName=t --set workerDefaults.drainTimeoutS=200
expect_failure "a wait for a worker past the first-token timeout" "waitForWorkerS must be at most" \
  --set tls.secretName=t --set router.retries.waitForWorkerS=90
expect_failure "API keys without a scrape key" "bearerTokenSecret" --set tls.secretName=t \
  --set router.apiKeysSecret=k --set monitoring.serviceMonitor.enabled=true
# The schema check refuses what Kubernetes would drop: a misspelled field deep in a pod
# template and one in a ServiceMonitor's endpoint (inherited fields are known).
python3 - "$work/everything-on/objects.json" "$work/misspelled.json" <<'PY'
import json, sys
objs = json.load(open(sys.argv[1]))
d = next(o for o in objs if o["kind"] == "Deployment")
d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
sm = next(o for o in objs if o["kind"] == "ServiceMonitor")
sm["spec"]["endpoints"][0]["scrapeIntervall"] = "5s"
json.dump(objs, open(sys.argv[2], "w"))
PY
if node "$work/validate_k8s.mjs" "$work/misspelled.json" >"$work/misspelled.log" 2>&1; then
  echo "FAIL: misspelled fields validated"; fail=1
else
  for field in containers\\[0\\].securityContext.readOnlyRootFileSystem endpoints\\[0\\].scrapeIntervall; do
    grep -q "unknown field .*$field" "$work/misspelled.log" || { echo "FAIL: no error names $field"; cat "$work/misspelled.log"; fail=1; }
  done
  [[ $(grep -c '^FAIL' "$work/misspelled.log") == 2 ]] || { echo "FAIL: other errors:"; cat "$work/misspelled.log"; fail=1; }
  echo "ok: misspelled fields refused: $(grep -c '^FAIL' "$work/misspelled.log") errors"
fi

echo "== kustomize"
"$root/deploy/kustomize/render_base.sh" "$render_bin" >"$work/base.yaml"
if ! diff -u "$root/deploy/kustomize/base/tandem.yaml" "$work/base.yaml" >"$work/base.diff"; then
  echo "FAIL: deploy/kustomize/base/tandem.yaml is not the chart's render (make deploy-base):"
  head -40 "$work/base.diff"; fail=1
fi
if command -v kubectl >/dev/null; then
  for overlay in "$root"/deploy/kustomize/overlays/*/; do
    o=$(basename "$overlay")
    mkdir -p "$work/kustomize-$o"
    kubectl kustomize "$overlay" >"$work/kustomize-$o/manifests.yaml" || { fail=1; continue; }
    python3 "$here/check_render.py" "$work/kustomize-$o/manifests.yaml" - "$work/kustomize-$o" || fail=1
    node "$work/validate_k8s.mjs" "$work/kustomize-$o/objects.json" >"$work/kustomize-$o/validate.log" 2>&1 ||
      { cat "$work/kustomize-$o/validate.log"; fail=1; }
    check_router_config "$work/kustomize-$o/router.yaml" || fail=1
    echo "overlay $o: $(grep -c '^ok ' "$work/kustomize-$o/validate.log") objects valid"
  done
else
  echo "(kubectl not installed: overlays not built)"
fi
exit $fail
