#!/usr/bin/env bash
# The chart's monitoring against a real Prometheus (Debian's): a `tandem up`
# cluster (router, prefill and decode workers) under a short load is scraped
# with the scrape settings the rendered chart declares (the router pods'
# prometheus.io/* annotations, or the ServiceMonitor's endpoint: port, path,
# interval, and the namespace label both give the series); then every PromQL
# expression of the Grafana dashboard and of the alert rules is evaluated
# through Prometheus' HTTP API (eval_promql.py): each must evaluate without
# error, and each dashboard query on the router's metrics must return data
# (netns_cluster_test scrapes the workers' own metrics too).
# Usage: prometheus_test.sh TANDEM_BIN WORK_DIR OBJECTS_JSON (chart_test's render with every
# option on, as JSON: BUILD/tests/chart/everything-on/objects.json)
# Exits 77 (skipped) where prometheus is not installed.
set -euo pipefail
tandem=${1:?usage: prometheus_test.sh TANDEM_BIN WORK_DIR OBJECTS_JSON}
work=${2:?}
objects=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
command -v prometheus >/dev/null || { echo "SKIP: prometheus is not installed"; exit 77; }
[[ -s $objects ]] || { echo "SKIP: no rendered chart at $objects (chart_test renders it)"; exit 77; }
rm -rf "$work" && mkdir -p "$work"

# The cluster, with an admin API key (the chart's everything-on render scrapes with one).
key=prom-test-admin-key
"$tandem" up --port 0 --ready-file "$work/url" --run-dir "$work/run" --worker-threads 1 --api-key "$key" \
  >"$work/up.log" 2>&1 &
up=$!
prom=
cleanup() {
  [[ -n $prom ]] && kill "$prom" 2>/dev/null
  kill -TERM "$up" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 600); do [[ -s $work/url ]] && break; sleep 0.1; done
[[ -s $work/url ]] || { echo "FAIL: the cluster did not start"; tail "$work/up.log"; exit 1; }
url=$(cat "$work/url")
hostport=${url#http://}

# The scrape job from the rendered chart: the ServiceMonitor's endpoint and the
# router pods' annotations must agree; the namespace label is what Kubernetes
# service discovery adds.
python3 - "$objects" "$hostport" "$key" "$work" <<'PY'
import json, sys
objects, target, key, work = sys.argv[1:5]
objs = json.load(open(objects))
router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router"))
ann = router["spec"]["template"]["metadata"]["annotations"]
sm = next(o for o in objs if o["kind"] == "ServiceMonitor" and o["metadata"]["name"].endswith("-router"))
ep = sm["spec"]["endpoints"][0]
container = router["spec"]["template"]["spec"]["containers"][0]
port = next(p for p in container["ports"] if p["name"] == ep["port"])
assert ann["prometheus.io/scrape"] == "true", ann
assert int(ann["prometheus.io/port"]) == port["containerPort"], (ann, port)
assert ann["prometheus.io/path"] == ep["path"], (ann, ep)
assert ep["authorization"]["type"] == "Bearer"
open(f"{work}/key", "w").write(key)
open(f"{work}/prometheus.yml", "w").write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [rules.yaml]
scrape_configs:
  - job_name: tandem-router
    metrics_path: {ep['path']}
    authorization: {{type: Bearer, credentials_file: {work}/key}}
    static_configs:
      - targets: ['{target}']
        labels: {{namespace: {router['metadata']['namespace']}}}
""")
rule = next(o for o in objs if o["kind"] == "PrometheusRule")
import yaml
yaml.safe_dump({"groups": rule["spec"]["groups"]}, open(f"{work}/rules.yaml", "w"))
PY
promtool check config "$work/prometheus.yml" >/dev/null
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:$port >"$work/prometheus.log" 2>&1 &
prom=$!
api=http://127.0.0.1:$port/api/v1

# Load: 80 chat requests, 4 at a time, half streamed, sharing a long system
# prompt (prefix cache hits), over about 15 s.
prefix=$(printf 'You are a careful assistant for the tandem monitoring test. %.0s' $(seq 3))
load() {
  local i
  for i in $(seq "$1" 4 80); do
    stream=$([[ $((i % 2)) == 0 ]] && echo true || echo false)
    code=$(curl -sS -o "$work/answer-$1" -w '%{http_code}' "$url/v1/chat/completions" -H "Authorization: Bearer $key" \
      -H 'Content-Type: application/json' -d "{\"model\": \"$model\", \"max_tokens\": 12, \"stream\": $stream,
        \"messages\": [{\"role\": \"system\", \"content\": \"$prefix\"}, {\"role\": \"user\", \"content\": \"question $i\"}]}")
    [[ $code == 200 ]] || { echo "request $i: HTTP $code: $(head -c 300 "$work/answer-$1")"; return 1; }
  done
}
model=$(sed -n 's/^  served_name: "\(.*\)"$/\1/p' "$work/run/router.yaml")
pids=()
for j in 1 2 3 4; do load $j & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || { echo "FAIL: a load request failed"; exit 1; }; done
# Prometheus applies new targets at most every 5 s after it starts, and the load may end sooner:
# wait for the target to be up and scraped twice (rates need two samples).
up_since=
for _ in $(seq 300); do
  if curl -fsS "$api/targets" | grep -q '"health":"up"'; then
    up_since=${up_since:-$SECONDS}
    ((SECONDS - up_since >= 3)) && break
  fi
  sleep 0.1
done
[[ -n $up_since ]] || { echo "FAIL: the router's target is not up"; curl -s "$api/targets"; exit 1; }

# The workers' own metrics are netns_cluster_test's to check (here they share one host and
# have no metrics ports).
python3 "$here/eval_promql.py" "$api" "$root/deploy/helm/tandem/files/grafana-dashboard.json" \
  "$work/rules.yaml" --no-data-needed tandem_worker_
