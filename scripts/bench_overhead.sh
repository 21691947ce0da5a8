#!/usr/bin/env bash
# Router overhead: the same client (`tandem bench`), the same requests and the
# same stream chunks against three set-ups, each started, measured, stopped:
#   direct  `tandem bench mock-server`, an instant OpenAI server (the baseline)
#   nginx   Debian's nginx reverse-proxying that server (upstream keepalive,
#           proxy_buffering off so SSE streams through), from a generated config
#   tandem  `tandem up --engine sim --aggregated 1`: the router in front of one
#           simulated worker whose timings are all zero
# For each: TTFT and e2e p50/p99 at a fixed moderate rate, the latency added
# over direct, the CPU-seconds per request of the proxy (utime + stime from
# /proc of nginx's master and workers, of the router process; the mock server
# and the sim worker apart as "backend"; clock ticks, so runs of hundreds of
# requests resolve ~0.01 ms), its context switches per request (from
# /proc/PID/task/*/status), and the saturation throughput (--request-rate inf
# at a fixed concurrency). Then tandem alone over prompt sizes, with the
# router's routing decision time from its /metrics histogram (deltas over the
# run: mean from _sum/_count, p99 as the bucket bound the 99th percentile
# falls under). Then the floor: one bare streamed gRPC call per request
# (`tandem bench grpc-floor`) at the latency runs' rate, what any router that
# drives its workers over gRPC pays. Prints markdown tables and the ratios
# issue 5 asks for.
#
# The proxy comparison sends its prompts as text (completions), so the router
# tokenizes them as a client's text makes it (IDS=1: token ids, no tokenizer).
# The prompt-size runs send both: token ids, whose sizes are exact (the
# routing decision at 8k tokens is measured on these), and the same prompts
# as text, which the router tokenizes. Random token ids decoded to text
# re-tokenize to ~1.9x as many tokens: the table shows the count the router
# saw (from usage).
# The client reports its own CPU per request (one thread): where its "client
# cores" near 1 at saturation, the client, not the server, is the limit.
# Everything shares the machine's cores, so run it on a quiet machine.
#
# Usage: scripts/bench_overhead.sh TANDEM_BIN [quick]
set -euo pipefail
bin=$(realpath "${1:?usage: bench_overhead.sh TANDEM_BIN [quick]}")
quick=${2:-}
input=${INPUT_LEN:-128}            # prompt tokens of the proxy comparison
output=${OUTPUT_LEN:-16}           # output tokens: 16 stream chunks per request
rate=${RATE:-50}                   # requests/s of the latency runs
lat_prompts=${LAT_PROMPTS:-1500}   # requests of each latency run (30 s at 50/s)
sat_prompts=${SAT_PROMPTS:-5000}   # requests of each saturation run
concurrency=${CONCURRENCY:-32}     # in flight during the saturation runs
sizes=${SIZES:-"1024 8192 32768"}  # tandem alone: prompt tokens
size_rate=${SIZE_RATE:-10}
size_prompts=${SIZE_PROMPTS:-200}
warmups=${WARMUPS:-20}
# HTTP threads of the mock server and nginx's workers: as many as the
# router's HTTP threads (the cores, at least 2 and at most 8).
threads=${THREADS:-$(n=$(nproc); echo $((n < 2 ? 2 : n > 8 ? 8 : n)))}
if [[ $quick == quick ]]; then
  lat_prompts=${LAT_PROMPTS:-400}
  sat_prompts=${SAT_PROMPTS:-1000}
  size_prompts=${SIZE_PROMPTS:-40}
fi
text_flag=--prompt-as-text
[[ ${IDS:-0} == 1 ]] && text_flag=
nginx=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
[[ -x $nginx ]] || { echo "nginx not found: scripts/install_deps.sh installs it" >&2; exit 1; }

out=$(mktemp -d /tmp/tandem-bench-overhead.XXXXXX)
chmod 755 "$out"  # nginx's workers run as its unprivileged user
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
echo "bench_overhead: results in $out" >&2

# wait_file FILE LOG PID: waits for the ready file a starting server writes;
# fails showing its LOG if PID exits first or 60 s pass.
wait_file() {
  for _ in $(seq 600); do
    [[ -s $1 ]] && return 0
    kill -0 "$3" 2>/dev/null || break
    sleep 0.1
  done
  echo "no $1:" >&2; tail -20 "$2" >&2; exit 1
}

# The sum of utime + stime (clock ticks) of the given pids, from /proc.
ticks() {
  local total=0 pid stat f
  for pid in "$@"; do
    stat=$(<"/proc/$pid/stat")
    read -ra f <<< "${stat##*) }"  # fields after "(comm)": state is f[0], utime f[11], stime f[12]
    total=$((total + f[11] + f[12]))
  done
  echo "$total"
}

# The context switches (voluntary and involuntary) of the given pids' threads.
switches() {
  local total=0 pid n
  for pid in "$@"; do
    for n in $(sed -n 's/^.*ctxt_switches:[[:space:]]*//p' /proc/"$pid"/task/*/status 2>/dev/null); do
      total=$((total + n))
    done
  done
  echo "$total"
}

# Child pids of $1 whose command line contains $2.
children() {
  local path pid stat f
  for path in /proc/[0-9]*/stat; do
    pid=${path#/proc/}; pid=${pid%/stat}
    stat=$(cat "$path" 2>/dev/null) || continue
    read -ra f <<< "${stat##*) }"  # f[1]: the parent's pid
    [[ ${f[1]} == "$1" ]] || continue
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2" && echo "$pid"
  done
  return 0
}

metrics() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1] + "/metrics").read().decode())' "$1"; }

# run NAME URL [flags]: one `tandem bench` run with CPU ticks of $proxy and
# $backend (pid lists) around it, and the router's /metrics when $router_url.
run() {
  local name=$1 url=$2 p0 b0 s0
  shift 2
  [[ -n ${router_url:-} ]] && metrics "$router_url" > "$out/$name.metrics0"
  p0=$(ticks $proxy); b0=$(ticks $backend); s0=$(switches $proxy)
  "$bin" bench --url "$url" --endpoint completions --dataset random --random-output-len "$output" \
    --seed 7 --num-warmups "$warmups" --title "$name" --json "$out/$name.json" "$@" \
    > "$out/$name.txt" 2>&1 || { cat "$out/$name.txt" >&2; exit 1; }
  echo "{\"proxy_ticks\": $(($(ticks $proxy) - p0)), \"backend_ticks\": $(($(ticks $backend) - b0)),"\
    "\"proxy_switches\": $(($(switches $proxy) - s0)), \"warmups\": $warmups}" \
    > "$out/$name.cpu.json"
  [[ -n ${router_url:-} ]] && metrics "$router_url" > "$out/$name.metrics1"
  echo "$name: $(grep -m1 'Request throughput' "$out/$name.txt" || true)" >&2
}

# Both runs of the proxy comparison for set-up $1 at URL $2.
measure() {
  run "$1-latency" "$2" $text_flag --random-input-len "$input" --num-prompts "$lat_prompts" \
    --request-rate "$rate"
  run "$1-saturation" "$2" $text_flag --random-input-len "$input" --num-prompts "$sat_prompts" \
    --request-rate inf --max-concurrency "$concurrency"
}

start_mock() {
  "$bin" bench mock-server --port 0 --threads "$threads" --ready-file "$out/mock.url" > "$out/mock.log" 2>&1 &
  mock=$!
  wait_file "$out/mock.url" "$out/mock.log" "$mock"
}

# a. direct
start_mock
proxy="" backend=$mock
measure direct "$(cat "$out/mock.url")"

# b. nginx in front of the same mock server
mock_port=$(sed 's/.*://' "$out/mock.url")
nginx_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$out/nginx"
cat > "$out/nginx/nginx.conf" <<EOF
daemon off;
worker_processes $threads;
pid $out/nginx/nginx.pid;
error_log $out/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $out/nginx/body;
  proxy_temp_path $out/nginx/proxy;
  fastcgi_temp_path $out/nginx/fastcgi;
  uwsgi_temp_path $out/nginx/uwsgi;
  scgi_temp_path $out/nginx/scgi;
  client_max_body_size 16m;
  client_body_buffer_size 1m;  # bodies stay in memory
  upstream mock {
    server 127.0.0.1:$mock_port;
    keepalive 64;
  }
  server {
    listen 127.0.0.1:$nginx_port;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
"$nginx" -p "$out/nginx" -c "$out/nginx/nginx.conf" -e "$out/nginx/error.log" > "$out/nginx/stdout.log" 2>&1 &
nginx_pid=$!
for _ in $(seq 100); do
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1])' \
    "http://127.0.0.1:$nginx_port/health" 2>/dev/null && break
  kill -0 "$nginx_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$nginx_pid" 2>/dev/null || { echo "nginx did not start:" >&2; cat "$out"/nginx/*.log >&2; exit 1; }
proxy="$nginx_pid $(children "$nginx_pid" nginx | tr '\n' ' ')"
echo "nginx: master and workers $proxy" >&2
measure nginx "http://127.0.0.1:$nginx_port"
kill -TERM "$nginx_pid"; wait "$nginx_pid" || true
kill -TERM "$mock"; wait "$mock" || true

# c. tandem: the router in front of one instant simulated worker; the same
# cluster serves the prompt sizes of (d), so its worker takes 32k prompts
# (~62k tokens as text).
mkdir -p "$out/tandem"
"$bin" up --engine sim --aggregated 1 --port 0 --ready-file "$out/tandem.url" --run-dir "$out/tandem" \
  --worker-threads 1 --kv-cache-memory 1GiB --worker-arg=--max-model-len=72000 \
  --worker-arg=--sim-step-ms=0 --worker-arg=--sim-prefill-us-per-token=0 \
  --worker-arg=--sim-decode-us-per-seq=0 --worker-arg=--sim-context-ns-per-token=0 \
  > "$out/up.log" 2>&1 &
up=$!
wait_file "$out/tandem.url" "$out/up.log" "$up"
router_url=$(cat "$out/tandem.url")
proxy=$(children "$up" " router ")
backend=$(children "$up" " worker " | tr '\n' ' ')
echo "tandem: router $proxy, worker $backend" >&2
measure tandem "$router_url"

# d. tandem alone over prompt sizes.
for prompt in ids text; do
  for size in $sizes; do
    run "size-$prompt-$size" "$router_url" $([[ $prompt == text ]] && echo --prompt-as-text) \
      --random-input-len "$size" --num-prompts "$size_prompts" --request-rate "$size_rate"
  done
done
kill -TERM "$up"; wait "$up" || true

# e. the floor: one bare streamed gRPC call per request, at the latency runs'
# rate, from the router's channel and poller to a server that answers on its
# poller thread ("poller") or hands each call to a second thread that writes
# ("handoff", a worker's poller and engine threads), and on the poller with
# gRPC's minimal stack on both ends ("minimal", the leanest gRPC there is).
# No HTTP, tokenizer, routing or engine: what any router that drives its
# workers over gRPC pays on top of an HTTP proxy's client side.
for mode in poller handoff minimal; do
  flags=()
  [[ $mode == handoff ]] && flags=(--handoff)
  [[ $mode == minimal ]] && flags=(--minimal-stack)
  "$bin" bench grpc-floor --serve "${flags[@]}" \
    --ready-file "$out/floor-$mode.addr" > "$out/floor-$mode.log" 2>&1 &
  floor=$!
  wait_file "$out/floor-$mode.addr" "$out/floor-$mode.log" "$floor"
  flags=()
  [[ $mode == minimal ]] && flags=(--minimal-stack)
  "$bin" bench grpc-floor "${flags[@]}" --target "$(cat "$out/floor-$mode.addr")" --request-rate "$rate" \
    --num-prompts "$lat_prompts" --warmups "$warmups" --input-len "$input" --max-tokens "$output" \
    --seed 7 --json "$out/floor-$mode.json" > "$out/floor-$mode.txt" 2>&1 \
    || { cat "$out/floor-$mode.txt" >&2; exit 1; }
  kill -TERM "$floor"; wait "$floor" || true
  echo "floor-$mode: $(sed -n 2p "$out/floor-$mode.txt")" >&2
done

python3 - "$out" "$(getconf CLK_TCK)" "$input" "$output" "$rate" "$concurrency" $sizes <<'EOF'
import json, sys
out, hz, input_len, output_len, rate, conc = sys.argv[1], int(sys.argv[2]), *sys.argv[3:7]
sizes = sys.argv[7:]

def load(name):
    j = json.load(open(f"{out}/{name}.json"))
    j.update(json.load(open(f"{out}/{name}.cpu.json")))
    sent = j["completed"] + j["failed"] + j["warmups"]
    j["proxy_ms"] = j["proxy_ticks"] / hz / sent * 1e3 if sent else 0  # CPU ms per request
    j["backend_ms"] = j["backend_ticks"] / hz / sent * 1e3 if sent else 0
    j["proxy_cs"] = j["proxy_switches"] / sent if sent else 0  # context switches per request
    j["client_us"] = j["client_overhead_us_per_request"]
    return j

def decision(name, metric="tandem_router_routing_decision_seconds"):
    """Routing decisions during a run (deltas of the histogram `metric`: wall
    clock, or the thread's CPU time with the _cpu_ one): count, mean, and the
    bucket (lower, upper] where the cumulative count crosses 99%, in us, with
    a linear interpolation inside it (as Prometheus' histogram_quantile)."""
    def read(path):
        buckets, total, count = {}, 0.0, 0.0
        for line in open(path):
            if not line.startswith(metric + "_"): continue
            series, value = line.rsplit(" ", 1)
            if "_bucket{" in series:
                le = series.split('le="')[1].split('"')[0]
                le = float("inf") if le == "+Inf" else float(le)
                buckets[le] = buckets.get(le, 0.0) + float(value)
            elif series.startswith(metric + "_sum"):
                total += float(value)
            elif series.startswith(metric + "_count"):
                count += float(value)
        return buckets, total, count
    b0, s0, c0 = read(f"{out}/{name}.metrics0")
    b1, s1, c1 = read(f"{out}/{name}.metrics1")
    n = c1 - c0
    if n <= 0: return 0, 0.0, (0.0, 0.0, 0.0)
    lower, below = 0.0, 0.0
    for le in sorted(b1):
        cum = b1[le] - b0.get(le, 0.0)
        if cum >= 0.99 * n:
            est = le if le == float("inf") else lower + (le - lower) * (0.99 * n - below) / (cum - below)
            return int(n), (s1 - s0) / n * 1e6, (lower * 1e6, le * 1e6, est * 1e6)
        lower, below = le, cum
    return int(n), (s1 - s0) / n * 1e6, (lower * 1e6, float("inf"), float("inf"))

setups = ["direct", "nginx", "tandem"]
lat = {s: load(f"{s}-latency") for s in setups}
sat = {s: load(f"{s}-saturation") for s in setups}
d = lat["direct"]

print(f"\n### Proxy overhead: completions, streaming, {input_len}-token prompts (text), "
      f"{output_len} output tokens (= stream chunks); {rate} req/s, {d['completed'] + d['failed']} requests\n")
print("| set-up | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | added e2e p50 ms | added e2e p99 ms "
      "| added TTFT p99 ms | proxy CPU ms/req | proxy ctx sw/req | backend CPU ms/req | client CPU us/req | failed |")
print("|---" * 13 + "|")
for s in setups:
    j = lat[s]
    add = lambda m, q: j[m][q] - d[m][q]
    added = "-" if s == "direct" else None
    print(f"| {s} | {j['ttft_ms']['median']:.3f} | {j['ttft_ms']['p99']:.3f} | {j['e2e_ms']['median']:.3f} "
          f"| {j['e2e_ms']['p99']:.3f} | {added or '%.3f' % add('e2e_ms', 'median')} "
          f"| {added or '%.3f' % add('e2e_ms', 'p99')} | {added or '%.3f' % add('ttft_ms', 'p99')} "
          f"| {'-' if s == 'direct' else '%.3f' % j['proxy_ms']} | {'-' if s == 'direct' else '%.1f' % j['proxy_cs']} "
          f"| {j['backend_ms']:.3f} | {j['client_us']:.0f} | {j['failed']} |")

print(f"\n### Saturation: --request-rate inf, --max-concurrency {conc}, {sat['direct']['completed'] + sat['direct']['failed']} requests\n")
print("| set-up | req/s | e2e p50 ms | e2e p99 ms | proxy CPU ms/req | proxy cores | proxy ctx sw/req "
      "| backend CPU ms/req | backend cores | client CPU us/req | client cores | failed |")
print("|---" * 12 + "|")
for s in setups:
    j = sat[s]
    dur = j["duration_s"] or 1
    sent = j["completed"] + j["failed"]
    print(f"| {s} | {j['request_throughput']:.0f} | {j['e2e_ms']['median']:.2f} | {j['e2e_ms']['p99']:.2f} "
          f"| {'-' if s == 'direct' else '%.3f' % j['proxy_ms']} "
          f"| {'-' if s == 'direct' else '%.2f' % (j['proxy_ticks'] / hz / dur)} "
          f"| {'-' if s == 'direct' else '%.1f' % j['proxy_cs']} | {j['backend_ms']:.3f} | {j['backend_ticks'] / hz / dur:.2f} "
          f"| {j['client_us']:.0f} | {j['client_us'] * sent / 1e6 / dur:.2f} | {j['failed']} |")

print(f"\n### The floor: one bare streamed gRPC call per request (`tandem bench grpc-floor`), {rate} req/s\n")
print("| server | first message p50 ms | first message p90 ms | first message p99 ms | end p50 ms | end p99 ms | failed |")
print("|---" * 7 + "|")
for m in ("poller", "handoff", "minimal"):
    j = json.load(open(f"{out}/floor-{m}.json"))
    print(f"| {m} | {j['first_ms']['median']:.3f} | {j['first_ms']['p90']:.3f} | {j['first_ms']['p99']:.3f} "
          f"| {j['end_ms']['median']:.3f} | {j['end_ms']['p99']:.3f} | {j['failed']} |")

print("\n### tandem alone over prompt sizes: token ids (exact sizes), then the same prompts as text\n")
print(f"| prompt | tokens asked | tokens routed | req/s | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms "
      "| router CPU ms/req | router ctx sw/req | worker CPU ms/req | client CPU us/req | decision mean us "
      "| decision p99 us: bucket (interpolated) | decision CPU mean us | decision CPU p99 us | failed |")
print("|---" * 17 + "|")
dec, cpu = {}, {}
for prompt in ("ids", "text"):
    for size in sizes:
        j = load(f"size-{prompt}-{size}")
        dec[prompt, size] = decision(f"size-{prompt}-{size}")
        cpu[prompt, size] = decision(f"size-{prompt}-{size}", "tandem_router_routing_decision_cpu_seconds")
        n, mean, p99 = dec[prompt, size]
        _, cpu_mean, cpu_p99 = cpu[prompt, size]
        routed = j["total_input_tokens"] / j["completed"] if j["completed"] else 0
        print(f"| {prompt} | {size} | {routed:.0f} | {j['request_rate']} | {j['ttft_ms']['median']:.2f} "
              f"| {j['ttft_ms']['p99']:.2f} | {j['e2e_ms']['median']:.2f} | {j['e2e_ms']['p99']:.2f} "
              f"| {j['proxy_ms']:.3f} | {j['proxy_cs']:.1f} | {j['backend_ms']:.3f} | {j['client_us']:.0f} | {mean:.1f} "
              f"| {p99[0]:.0f}-{p99[1]:.0f} (~{p99[2]:.0f}) | {cpu_mean:.1f} "
              f"| {cpu_p99[0]:.0f}-{cpu_p99[1]:.0f} (~{cpu_p99[2]:.0f}) | {j['failed']} |")

def ratio(a, b):
    # An added latency at or below zero is within this run's noise: no ratio.
    return f"{a / b:.2f}" if a > 0 and b > 0 else "n/a (an added latency <= 0: below this run's noise)"

def times(a, b):
    r = ratio(a, b)
    return r + "x" if not r.startswith("n/a") else r

t, n = lat["tandem"], lat["nginx"]
print("\n### Ratios\n")
for m, label in (("e2e_ms", "e2e"), ("ttft_ms", "TTFT")):
    ta, na = t[m]["p99"] - d[m]["p99"], n[m]["p99"] - d[m]["p99"]
    print(f"- added {label} p99, tandem / nginx: {ta:.3f} / {na:.3f} ms = {ratio(ta, na)} (target <= 1.5)")
    ta, na = t[m]["median"] - d[m]["median"], n[m]["median"] - d[m]["median"]
    print(f"- added {label} p50, tandem / nginx: {ta:.3f} / {na:.3f} ms = {ratio(ta, na)}")
print(f"- proxy CPU per request, tandem router / nginx: {t['proxy_ms']:.3f} / {n['proxy_ms']:.3f} ms = "
      f"{ratio(t['proxy_ms'], n['proxy_ms'])} (sim worker apart: {t['backend_ms']:.3f} ms/req)")
fl = {m: json.load(open(f"{out}/floor-{m}.json")) for m in ("poller", "handoff", "minimal")}
for q, name in (("p99", "p99"), ("median", "p50")):
    ta, na = t["ttft_ms"][q] - d["ttft_ms"][q], n["ttft_ms"][q] - d["ttft_ms"][q]
    f = fl["poller"]["first_ms"][q]
    print(f"- the floor: a bare gRPC call's first message at {name} {f:.3f} ms = {times(f, na)} nginx's "
          f"added TTFT {name} ({na:.3f} ms); tandem's added TTFT {name} {ta:.3f} ms = {times(ta, f)} the floor "
          f"(with a writer thread's hand-off: {fl['handoff']['first_ms'][q]:.3f} ms; gRPC's minimal stack: "
          f"{fl['minimal']['first_ms'][q]:.3f} ms = {times(fl['minimal']['first_ms'][q], na)} nginx's)")
st, sn = sat["tandem"]["request_throughput"], sat["nginx"]["request_throughput"]
print(f"- saturation throughput, tandem / nginx: {st:.0f} / {sn:.0f} req/s = {ratio(st, sn)} "
      f"(direct: {sat['direct']['request_throughput']:.0f} req/s)")
if ("ids", "8192") in dec:
    n8, mean8, (lo, hi, est) = dec["ids", "8192"]
    verdict = ("meets" if hi <= 100 else "misses" if lo >= 100
               else f"the bucket straddles it, interpolated ~{est:.0f} us")
    print(f"- routing decision p99 at 8k tokens: in ({lo:.0f}, {hi:.0f}] us, ~{est:.0f} us interpolated "
          f"({n8} decisions, mean {mean8:.1f} us); target < 100 us: {verdict}")
    _, cmean8, (clo, chi, cest) = cpu["ids", "8192"]
    verdict = ("meets" if chi <= 100 else "misses" if clo >= 100
               else f"the bucket straddles it, interpolated ~{cest:.0f} us")
    print(f"- the same decisions' CPU time (the thread's clock: no preemption): p99 in ({clo:.0f}, "
          f"{chi:.0f}] us, ~{cest:.0f} us interpolated, mean {cmean8:.1f} us; target < 100 us: {verdict}")
for cpu_ms, where in ((t["proxy_ms"], f"at {rate} req/s"), (sat["tandem"]["proxy_ms"], "at saturation")):
    if cpu_ms > 0:
        print(f"- vs NVIDIA Dynamo's frontend (~6.5 ms CPU/request): tandem's router {cpu_ms:.3f} ms/request "
              f"{where}, {6.5 / cpu_ms:.0f}x less")
print(f"- vs llm-d's endpoint picker (~330-390 req/s per replica): tandem {st:.0f} req/s = "
      f"{st / 390:.1f}x-{st / 330:.1f}x (router, sim worker and client sharing this machine's cores)")
EOF
