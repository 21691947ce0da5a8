#!/usr/bin/env bash
# The chart's cluster, run for real without Kubernetes: every pod of the render
# of netns-values.yaml (a router, 2 prefill and 2 decode workers) is a process
# in its own network namespace with its own address on a bridge (its interface
# named eth0, as in a pod), started with the container's command and arguments
# read from the rendered manifests, its mounted files (the router ConfigMap, the
# TLS Secret from `tandem certs`) under a folder that stands for /etc/tandem.
# The router finds the workers through the chart's headless Service names, which
# dnsmasq (Debian) answers with the pods' A records, as cluster DNS would. Checks:
#   1. requests flow through the router (chat, streamed and not);
#   2. a decode pod added to its Service's DNS records is discovered and used;
#   3. a decode pod killed (SIGKILL) under load is ejected and no request fails;
#   4. a rolling restart of the decode pool under steady load (each pod: SIGTERM,
#      exit, start again at its address, the Deployment's minReadySeconds
#      before the next) fails no request;
#   5. a real Prometheus (Debian's), scraping the pods as the rendered
#      ServiceMonitors declare (their Services' DNS names, ports and paths; the
#      pods' prometheus.io/* annotations agree), has every target up, and every
#      dashboard and alert expression evaluates, each dashboard query with data.
# Usage: netns_cluster_test.sh HELMRENDER TANDEM WORK_DIR
# Exits 77 (skipped) without root, `ip netns`, dnsmasq, prometheus or the renderer.
set -euo pipefail
render_bin=${1:?usage: netns_cluster_test.sh HELMRENDER TANDEM WORK_DIR}
tandem=${2:?}
work=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
(( $(id -u) == 0 )) || { echo "SKIP: needs root for network namespaces"; exit 77; }
[[ -x $render_bin ]] || { echo "SKIP: no helmrender at $render_bin"; exit 77; }
command -v dnsmasq >/dev/null || [[ -x /usr/sbin/dnsmasq ]] || { echo "SKIP: dnsmasq is not installed"; exit 77; }
dnsmasq=$(command -v dnsmasq || echo /usr/sbin/dnsmasq)
command -v prometheus >/dev/null || { echo "SKIP: prometheus is not installed"; exit 77; }
tag=$(( $$ % 10000 ))
hub=tdhub$tag
ip netns add "$hub" 2>/dev/null || { echo "SKIP: cannot create network namespaces here"; exit 77; }
net=10.$(( 64 + $$ % 100 )).7
rm -rf "$work" && mkdir -p "$work/etc/tandem/router" "$work/logs"
namespaces=("$hub")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in "${namespaces[@]}"; do ip netns del "$n" 2>/dev/null || true; rm -rf "/etc/netns/$n"; done
}
trap cleanup EXIT

# --- The render: what each pod runs.
"$render_bin" --chart "$root/deploy/helm/tandem" -f "$here/netns-values.yaml" --release tandem --namespace llm \
  >"$work/manifests.yaml"
python3 "$here/check_render.py" "$work/manifests.yaml" "$here/netns-values.yaml" "$work" >/dev/null
python3 - "$work" <<'PY'
import json, shlex, sys
work = sys.argv[1]
objs = json.load(open(f"{work}/objects.json"))
for d in objs:
    if d["kind"] != "Deployment":
        continue
    c = d["spec"]["template"]["spec"]["containers"][0]
    comp = d["metadata"]["labels"]["app.kubernetes.io/component"]
    argv = c["command"] + c["args"]
    open(f"{work}/{comp}.argv", "w").write(" ".join(shlex.quote(a) for a in argv) + "\n")
    open(f"{work}/{comp}.replicas", "w").write(str(d["spec"]["replicas"]) + "\n")
    open(f"{work}/{comp}.minready", "w").write(str(d["spec"].get("minReadySeconds", 0)) + "\n")
def dns(svc):
    return f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
for s in objs:
    if s["kind"] == "Service":
        comp = s["metadata"]["labels"]["app.kubernetes.io/component"]
        open(f"{work}/{comp}.dns", "w").write(dns(s) + "\n")

# Prometheus' scrape jobs, as the Prometheus Operator makes them from each
# ServiceMonitor: the Services it selects, the endpoints' port (by name), path
# and interval; the pods behind a Service are its DNS name's A records here
# (Kubernetes' endpoints there), each labelled with its namespace and Service.
def selects(sel, labels):
    ok = all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())
    for e in sel.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok
def pods_of(svc):
    return [d for d in objs if d["kind"] == "Deployment" and d["metadata"]["namespace"] == svc["metadata"]["namespace"]
            and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
jobs = []
for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
    for svc in (o for o in objs if o["kind"] == "Service" and selects(sm["spec"]["selector"], o["metadata"]["labels"])):
        for i, ep in enumerate(sm["spec"]["endpoints"]):
            assert "authorization" not in ep, "the netns cluster runs without API keys"
            sport = next(p for p in svc["spec"]["ports"] if p["name"] == ep["port"])
            deployments = pods_of(svc)
            assert deployments, f"{svc['metadata']['name']} selects no pods"
            for d in deployments:
                c = d["spec"]["template"]["spec"]["containers"][0]
                target = next(p["containerPort"] for p in c["ports"] if p["name"] == sport["targetPort"])
                ann = d["spec"]["template"]["metadata"]["annotations"]
                assert ann["prometheus.io/scrape"] == "true", ann
                assert int(ann["prometheus.io/port"]) == target and ann["prometheus.io/path"] == ep["path"], (ann, ep)
            jobs.append(f"""  - job_name: serviceMonitor/{sm['metadata']['namespace']}/{sm['metadata']['name']}/{svc['metadata']['name']}/{i}
    metrics_path: {ep['path']}
    scrape_interval: {ep['interval']}
    dns_sd_configs: [{{names: ['{dns(svc)}'], type: A, port: {target}, refresh_interval: 1s}}]
    relabel_configs:
      - {{target_label: namespace, replacement: {svc['metadata']['namespace']}}}
      - {{target_label: service, replacement: {svc['metadata']['name']}}}
      - {{target_label: job, replacement: {svc['metadata']['name']}}}
""")
assert len(jobs) == 3, f"router, prefill and decode scrape jobs, not {len(jobs)}"
open(f"{work}/prometheus.yml", "w").write("global: {scrape_timeout: 1s, evaluation_interval: 1s}\n"
                                           "rule_files: [rules.yaml]\nscrape_configs:\n" + "".join(jobs))
import yaml
rule = next(o for o in objs if o["kind"] == "PrometheusRule")
yaml.safe_dump({"groups": rule["spec"]["groups"]}, open(f"{work}/rules.yaml", "w"))
PY
promtool check config "$work/prometheus.yml" >/dev/null
promtool check rules "$work/rules.yaml" >/dev/null
cp "$work/router.yaml" "$work/etc/tandem/router/router.yaml"
sed -i "s|/etc/tandem/|$work/etc/tandem/|g" "$work/etc/tandem/router/router.yaml"
"$tandem" certs --out "$work/etc/tandem/tls" >/dev/null
# The container's arguments, with the pod's mounts under $work/etc/tandem.
argv() { sed "s|/etc/tandem/|$work/etc/tandem/|g; s|^tandem |$tandem |" "$work/$1.argv"; }

# --- The network: a bridge in the hub namespace, dnsmasq there; a namespace per pod.
ip -n "$hub" link add br0 type bridge
ip -n "$hub" addr add "$net.1/24" dev br0
ip -n "$hub" link set br0 up
ip -n "$hub" link set lo up
pod_ns() {  # NAME HOST: a namespace with eth0 at $net.HOST on the bridge
  local ns=td$tag-$1 host=$2
  ip netns add "$ns"
  namespaces+=("$ns")
  ip -n "$hub" link add "v$tag-$host" type veth peer name eth0 netns "$ns"
  ip -n "$hub" link set "v$tag-$host" master br0 up
  ip -n "$ns" addr add "$net.$host/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns" && echo "nameserver $net.1" >"/etc/netns/$ns/resolv.conf"
}
hosts=$work/hosts
: >"$hosts"
ip netns exec "$hub" "$dnsmasq" --keep-in-foreground --no-resolv --no-hosts --addn-hosts="$hosts" \
  --listen-address="$net.1" --bind-interfaces --port=53 --user=root --local-ttl=0 \
  --local=/cluster.local/ --pid-file="$work/dnsmasq.pid" --log-facility="$work/logs/dnsmasq.log" &
pids+=($!)
dns_pid=$!
publish() {  # the Services' records: every running pod of each pool
  : >"$hosts.new"
  for comp in prefill decode router; do
    for f in "$work"/pods/"$comp"-*; do
      # pods/NAME holds the pod's host number; pods/NAME.pid its process.
      [[ -e $f && $f != *.pid ]] && echo "$net.$(cat "$f") $(cat "$work/$comp.dns")" >>"$hosts.new"
    done
  done
  mv "$hosts.new" "$hosts"
  kill -HUP "$dns_pid"
}
mkdir -p "$work/pods"
start_pod() {  # COMPONENT INDEX HOST
  local comp=$1 i=$2 host=$3 name=$1-$2
  [[ -e /var/run/netns/td$tag-$name ]] || pod_ns "$name" "$host"
  # shellcheck disable=SC2046
  eval "exec ip netns exec td$tag-$name $(argv "$comp")" >>"$work/logs/$name.log" 2>&1 &
  echo $! >"$work/pods/$name.pid"
  pids+=($!)
  echo "$host" >"$work/pods/$name"
}
wait_port() {  # HOST PORT: until the pod's port accepts
  for _ in $(seq 300); do
    ip netns exec "$hub" bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "FAIL: nothing listens on $1:$2"; return 1
}
for comp in prefill decode; do
  base=$([[ $comp == prefill ]] && echo 20 || echo 30)
  for i in $(seq 0 $(( $(cat "$work/$comp.replicas") - 1 ))); do start_pod "$comp" "$i" $((base + i)); done
done
for f in "$work"/pods/*-[0-9]; do wait_port "$net.$(cat "$f")" 50051; done
publish
pod_ns router 10
eval "exec ip netns exec td$tag-router $(argv router)" >"$work/logs/router.log" 2>&1 &
pids+=($!)
echo 10 >"$work/pods/router-0"
publish
url=http://$net.10:8000
hub_curl() { ip netns exec "$hub" curl "$@"; }
for _ in $(seq 300); do
  [[ $(hub_curl -s -o /dev/null -w '%{http_code}' "$url/health" || true) == 200 ]] && break
  sleep 0.1
done
[[ $(hub_curl -s -o /dev/null -w '%{http_code}' "$url/health") == 200 ]] ||
  { echo "FAIL: the router never became ready"; tail -20 "$work/logs/router.log"; exit 1; }
model=$(sed -n 's/^  served_name: *//p' "$work/router.yaml" | tr -d '"')
# Prometheus in the hub namespace, resolving the Services through dnsmasq.
mkdir -p "/etc/netns/$hub" && echo "nameserver $net.1" >"/etc/netns/$hub/resolv.conf"
ip netns exec "$hub" prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/prometheus" \
  --web.listen-address="$net.1:9090" >"$work/logs/prometheus.log" 2>&1 &
pids+=($!)
api=http://$net.1:9090/api/v1

request() {  # N: one chat request; prints the HTTP status
  local stream=$([[ $(( $1 % 2 )) == 0 ]] && echo true || echo false)
  hub_curl -sS -o "$work/answers/$1" -w '%{http_code}' "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"max_tokens\": 24, \"stream\": $stream, \"messages\": [{\"role\": \"user\", \"content\": \"Tell me about pod $1 of the network namespace cluster test\"}]}" || echo 000
}
mkdir -p "$work/answers"
load() {  # FROM COUNT PARALLEL: requests FROM..FROM+COUNT-1, PARALLEL at a time; prints failures
  local from=$1 count=$2 par=$3 j
  for j in $(seq 0 $((par - 1))); do
    (for n in $(seq $((from + j)) "$par" $((from + count - 1))); do
       code=$(request "$n")
       if [[ $code != 200 ]] || { [[ $((n % 2)) == 0 ]] && ! grep -q '\[DONE\]' "$work/answers/$n"; }; then
         echo "request $n: HTTP $code: $(head -c 200 "$work/answers/$n")"
       fi
     done) &
  done
  wait
}
metric() { hub_curl -s "$url/metrics" | grep -E "^$1" || true; }

echo "== 1. requests flow"
failures=$(load 0 16 4)
[[ -z $failures ]] || { echo "FAIL: $failures"; exit 1; }
echo "ok: 16 requests through 2 prefill + 2 decode pods"
# The probes the chart declares answer on each worker's metrics port.
mport=$(python3 -c "import json; print(next(p['containerPort'] for d in json.load(open('$work/objects.json')) if d['kind'] == 'Deployment' and d['metadata']['name'].endswith('-decode') for p in d['spec']['template']['spec']['containers'][0]['ports'] if p['name'] == 'metrics'))")
for f in "$work"/pods/{prefill,decode}-[0-9]; do
  [[ $(hub_curl -s "http://$net.$(cat "$f"):$mport/readyz") == ready ]] || { echo "FAIL: $f not ready on :$mport/readyz"; exit 1; }
done
echo "ok: every worker's /readyz on :$mport answers ready; $(hub_curl -s "http://$net.30:$mport/metrics" | grep -c '^tandem_worker') worker series on /metrics"
metric 'tandem_router_worker_healthy' | sed 's/^/  /'

echo "== 2. a decode pod added to DNS is discovered and used"
start_pod decode 2 32
wait_port "$net.32" 50051
publish
for _ in $(seq 100); do metric "tandem_router_worker_healthy.*$net.32:50051.* 1" | grep -q . && break; sleep 0.1; done
metric "tandem_router_worker_healthy.*$net.32:50051.* 1" | grep -q . || { echo "FAIL: $net.32 not discovered"; exit 1; }
failures=$(load 100 24 4)
[[ -z $failures ]] || { echo "FAIL: $failures"; exit 1; }
used=$(metric "tandem_router_worker_outcomes_total.*$net.32:50051" | awk '{s += $2} END {print s + 0}')
(( used > 0 )) || { echo "FAIL: the new decode pod served no request"; metric tandem_router_worker_outcomes_total; exit 1; }
echo "ok: $net.32 discovered and served $used generations"

echo "== 3. a decode pod killed under load: ejected, no request fails"
load 200 40 4 >"$work/load3" &
loader=$!
sleep 1
kill -KILL "$(cat "$work/pods/decode-0.pid")"
wait "$(cat "$work/pods/decode-0.pid")" 2>/dev/null || true
rm "$work/pods/decode-0"
wait "$loader"
[[ ! -s $work/load3 ]] || { echo "FAIL: $(cat "$work/load3")"; exit 1; }
gone() { ! metric "tandem_router_worker_healthy.*$net.30:50051.* 1" | grep -q .; }
for _ in $(seq 100); do gone && break; sleep 0.1; done
gone || { echo "FAIL: the killed pod $net.30 is still routable"; exit 1; }
publish
echo "ok: 40 requests, none failed, while $net.30 was killed (no longer routable); $(metric 'tandem_router_retries_total' | awk '{s += $2} END {print s + 0}') retries and $(metric 'tandem_router_failovers_total' | awk '{s += $2} END {print s + 0}') failovers so far"

echo "== 4. a rolling restart of the decode pool under steady load fails no request"
load 300 80 3 >"$work/load4" &
loader=$!
for i in 1 2; do
  pid=$(cat "$work/pods/decode-$i.pid")
  # As Kubernetes does: the terminating pod leaves its Service's endpoints, then gets SIGTERM.
  mv "$work/pods/decode-$i" "$work/decode-$i.host"
  publish
  kill -TERM "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && { echo "FAIL: decode-$i did not exit within 30 s of SIGTERM"; exit 1; }
  start_pod decode "$i" $((30 + i))
  wait_port "$net.$((30 + i))" 50051
  publish
  # As the Deployment's rolling update does: the next pod goes once this one was
  # available for minReadySeconds (the router's discovery and health checks).
  sleep "$(cat "$work/decode.minready")"
done
wait "$loader"
[[ ! -s $work/load4 ]] || { echo "FAIL: $(cat "$work/load4")"; exit 1; }
echo "ok: 80 requests, none failed, while decode-1 and decode-2 restarted one after the other"
echo "$(metric 'tandem_router_failovers_total' | awk '{s += $2} END {print s + 0}') failovers, $(metric 'tandem_router_retries_total' | awk '{s += $2} END {print s + 0}') retries, $(metric 'tandem_router_worker_waits_total' | awk '{s += $2} END {print s + 0}') waits for a worker"

echo "== 5. Prometheus scrapes the pods as the chart declares; the dashboard and alerts evaluate"
promq() {  # EXPR: the query's result as JSON
  ip netns exec "$hub" curl -sS -G "$api/query" --data-urlencode "query=$1"
}
promv() { promq "$1" | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)'; }
# The router and the four running workers (decode-0 was killed in 3 and left its Service).
for _ in $(seq 100); do [[ $(promv 'count(up == 1)') == 5 ]] && break; sleep 0.2; done
if [[ $(promv 'count(up == 1)') != 5 ]]; then
  echo "FAIL: not every target is up"
  ip netns exec "$hub" curl -s "$api/targets"
  echo; echo "the Services' records now:"; cat "$hosts"
  for comp in prefill decode; do
    echo "$comp: $(ip netns exec "$hub" getent ahostsv4 "$(cat "$work/$comp.dns")" | awk '{print $1}' | sort -u | xargs)"
  done
  exit 1
fi
# (A pod restarted in 4 was last scraped while it drained, serving 0, until its next scrape.)
for _ in $(seq 100); do [[ $(promv 'count(tandem_worker_serving{namespace="llm"} == 1)') == 4 ]] && break; sleep 0.2; done
[[ $(promv 'count(tandem_worker_serving{namespace="llm"} == 1)') == 4 ]] ||
  { echo "FAIL: the four workers' own metrics are not scraped"; promq 'tandem_worker_serving'; exit 1; }
failures=$(load 500 16 4)  # (in a subshell: load's `wait` must not wait for the pods)
[[ -z $failures ]] || { echo "FAIL: $failures"; exit 1; }
ip netns exec "$hub" python3 "$here/eval_promql.py" "$api" "$root/deploy/helm/tandem/files/grafana-dashboard.json" \
  "$work/rules.yaml"
echo "ok: 5 targets up (router, 2 prefill, 2 decode); every dashboard query has data, every alert evaluates"
