#!/usr/bin/env python3
"""Checks a rendered manifest stream (helm template / helmrender / kubectl kustomize).

Usage: check_render.py MANIFESTS.yaml VALUES.yaml|- OUT_DIR

Writes OUT_DIR/objects.json (every object, for validate_k8s.mjs), OUT_DIR/router.yaml
(the router ConfigMap's configuration), OUT_DIR/rules.yaml (the PrometheusRule's
groups, when there is one) and OUT_DIR/worker-flags.txt (every flag the worker
containers are given). Checks that the objects fit together (Services, PDBs and
network policies select pods that exist; probes and Service ports name container
ports; the router's pools name the workers' Services) and, with a values file,
that what the values asked for reached the objects. Exits 1 listing every problem.
"""
import json
import math
import sys

import yaml

manifests, values_path, out = sys.argv[1:4]
docs = [d for d in yaml.safe_load_all(open(manifests)) if d]
problems = []
json.dump(docs, open(f"{out}/objects.json", "w"))


def by_kind(kind):
    return [d for d in docs if d["kind"] == kind]


def pod_templates():
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def match_expressions(sel, labels):
    ok = matches(sel.get("matchLabels", {}), labels)
    for e in sel.get("matchExpressions", []):
        if e["operator"] == "In":
            ok = ok and labels.get(e["key"]) in e["values"]
    return ok


workloads = list(pod_templates())
for d, t in workloads:
    name = d["metadata"]["name"]
    if not matches(d["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]):
        problems.append(f"{name}: its selector does not match its pod template")
    for c in t["spec"]["containers"]:
        ports = {p["name"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            p = c.get(probe)
            if not p:
                continue
            port = (p.get("httpGet") or p.get("tcpSocket") or p.get("grpc") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                problems.append(f"{name}: {probe} names port {port}, which the container does not have")
        mounts = {m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in t["spec"].get("volumes", [])}
        for m in mounts - volumes:
            problems.append(f"{name}: mounts volume {m}, which the pod does not have")

for s in by_kind("Service"):
    sel = s["spec"].get("selector", {})
    hits = [t for _, t in workloads if matches(sel, t["metadata"]["labels"])]
    if not hits:
        problems.append(f"Service {s['metadata']['name']}: its selector matches no pod template")
    for p in s["spec"]["ports"]:
        tp = p.get("targetPort")
        for t in hits:
            names = {cp["name"] for c in t["spec"]["containers"] for cp in c.get("ports", [])}
            if isinstance(tp, str) and tp not in names:
                problems.append(f"Service {s['metadata']['name']}: targetPort {tp} is no container port")
for kind in ("PodDisruptionBudget", "NetworkPolicy"):
    for o in by_kind(kind):
        sel = o["spec"]["selector"] if kind == "PodDisruptionBudget" else o["spec"]["podSelector"]
        if not any(match_expressions(sel, t["metadata"]["labels"]) for _, t in workloads):
            problems.append(f"{kind} {o['metadata']['name']}: selects no pod")

routers = [c for c in by_kind("ConfigMap") if "router.yaml" in c.get("data", {})]
if len(routers) != 1:
    problems.append(f"expected one router ConfigMap, found {len(routers)}")
    router = {}
else:
    text = routers[0]["data"]["router.yaml"]
    open(f"{out}/router.yaml", "w").write(text)
    router = yaml.safe_load(text)
services = {s["metadata"]["name"]: s for s in by_kind("Service")}
for pool, p in router.get("pools", {}).items():
    dns = p.get("discovery", {}).get("dns", "")
    svc = dns.split(".")[0]
    if svc not in services or services[svc]["spec"].get("clusterIP") != "None":
        problems.append(f"router pool {pool}: {dns} is no headless Service of this render")
    else:
        ns = services[svc]["metadata"].get("namespace")
        if ns and dns.split(".")[1] != ns:
            problems.append(f"router pool {pool}: {dns} is not in the Service's namespace {ns}")
        port = services[svc]["spec"]["ports"][0]["port"]
        if p["discovery"].get("port") != port:
            problems.append(f"router pool {pool}: port {p['discovery'].get('port')} is not the Service's {port}")

rules = by_kind("PrometheusRule")
if rules:
    yaml.safe_dump({"groups": rules[0]["spec"]["groups"]}, open(f"{out}/rules.yaml", "w"))

workers = {d["metadata"]["labels"]["app.kubernetes.io/component"]: (d, t) for d, t in workloads
           if d["metadata"]["labels"].get("app.kubernetes.io/component") in ("prefill", "decode", "aggregated")}
flags = set()
for comp, (d, t) in workers.items():
    for a in t["spec"]["containers"][0]["args"][1:]:
        flags.add(a.split("=")[0])
open(f"{out}/worker-flags.txt", "w").write("\n".join(sorted(flags)) + "\n")


def arg(t, flag):
    for a in t["spec"]["containers"][0]["args"]:
        if a == flag or a.startswith(flag + "="):
            return a.partition("=")[2] or True
    return None


if values_path != "-":
    chart_values = yaml.safe_load(open(__file__.rsplit("/tests/", 1)[0] + "/deploy/helm/tandem/values.yaml"))
    user = yaml.safe_load(open(values_path)) or {}

    def merged(base, over):  # the values file over the chart's defaults, maps deeply
        out = dict(base)
        for k, v in over.items():
            out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    values = merged(chart_values, user)

    def get(path):
        v = values
        for k in path.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        return v

    mode = get("mode")
    want = {"aggregated"} if mode == "aggregated" else {"prefill", "decode"}
    if set(workers) != want:
        problems.append(f"mode {mode}: worker pools {sorted(workers)}, expected {sorted(want)}")
    roles = {"aggregated": "both", "prefill": "prefill", "decode": "decode"}
    # A new pod is routable once the router discovered it and it passed its health checks.
    routable_s = get("router.discoveryIntervalS") + math.ceil(get("router.health.intervalS")) * get(
        "router.health.healthyAfter")
    for comp, (d, t) in workers.items():
        if arg(t, "--role") != roles[comp]:
            problems.append(f"{comp}: --role is {arg(t, '--role')}")
        if d["spec"].get("minReadySeconds") != routable_s:
            problems.append(f"{comp}: minReadySeconds {d['spec'].get('minReadySeconds')}, the router routes to a "
                            f"new pod after {routable_s} s")
        if d["spec"]["replicas"] != get(f"workers.{comp}.replicas"):
            problems.append(f"{comp}: replicas {d['spec']['replicas']}, values ask {get(f'workers.{comp}.replicas')}")
        gpus = get(f"workers.{comp}.gpus")
        got = t["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        if got != gpus:
            problems.append(f"{comp}: {got} GPUs, values ask {gpus}")
        tls = get("tls.enabled")
        if bool(arg(t, "--tls-ca")) != tls or bool(arg(t, "--insecure")) == tls:
            problems.append(f"{comp}: TLS flags do not match tls.enabled={tls}")
        if gpus:
            # GPU workers: the model on the card, the KV cache sized from it.
            if arg(t, "--device") != "cuda":
                problems.append(f"{comp}: {gpus} GPUs but --device is {arg(t, '--device')}")
            if float(arg(t, "--gpu-memory-utilization") or 0) != float(get("workerDefaults.gpuMemoryUtilization")):
                problems.append(f"{comp}: --gpu-memory-utilization {arg(t, '--gpu-memory-utilization')}")
            if arg(t, "--kv-cache-memory"):
                problems.append(f"{comp}: a GPU worker also given --kv-cache-memory")
            if bool(arg(t, "--batch-invariant")) != bool(get("workerDefaults.batchInvariant")):
                problems.append(f"{comp}: --batch-invariant does not match workerDefaults.batchInvariant")
            if (arg(t, "--logits-dtype") or "float32") != get("workerDefaults.logitsDtype"):
                problems.append(f"{comp}: --logits-dtype {arg(t, '--logits-dtype')}")
        else:
            if arg(t, "--device") or arg(t, "--gpu-memory-utilization") or arg(t, "--logits-dtype"):
                problems.append(f"{comp}: a CPU worker given GPU flags")
            if arg(t, "--kv-cache-memory") != get("workerDefaults.kvCacheMemory"):
                problems.append(f"{comp}: --kv-cache-memory {arg(t, '--kv-cache-memory')}")
        source = get("model.source")
        if source == "builtin":
            if arg(t, "--model") != "builtin:" + get("model.builtin.name"):
                problems.append(f"{comp}: --model {arg(t, '--model')}")
        else:
            if not str(arg(t, "--model")).startswith(get("model.mountPath")):
                problems.append(f"{comp}: --model {arg(t, '--model')} is not under {get('model.mountPath')}")
            vols = [v for v in t["spec"]["volumes"] if v["name"] == "model"]
            key = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "init": "emptyDir"}[source]
            if not vols or key not in vols[0]:
                problems.append(f"{comp}: no {key} model volume")
    if router:
        if mode == "aggregated" and (set(router["pools"]) != {"decode"} or router["disaggregation"]["mode"] != "never"):
            problems.append("aggregated: the router should have one decode pool and disaggregation never")
        if router["tls"]["mode"] != ("mutual" if get("tls.enabled") else "insecure"):
            problems.append(f"router tls mode {router['tls']['mode']}")
        if router["model"]["served_name"] != get("model.servedName"):
            problems.append("router served_name differs from model.servedName")
        if "retries" not in (get("router.extraConfig") or {}) and \
                router["retries"]["wait_for_worker_s"] != get("router.retries.waitForWorkerS"):
            problems.append(f"router retries.wait_for_worker_s {router['retries']['wait_for_worker_s']}")
        if get("router.apiKeysSecret") and "auth" not in router:
            problems.append("router.apiKeysSecret set but the router has no auth section")
        for k, v in (get("router.extraConfig") or {}).items():
            if router.get(k) != v:
                problems.append(f"router.extraConfig.{k} did not reach the router's configuration")
    kinds = {d["kind"] for d in docs}
    for flag, kind in (("router.autoscaling.enabled", "HorizontalPodAutoscaler"),
                       ("monitoring.serviceMonitor.enabled", "ServiceMonitor"),
                       ("monitoring.prometheusRule.enabled", "PrometheusRule"),
                       ("networkPolicy.enabled", "NetworkPolicy")):
        if bool(get(flag)) != (kind in kinds):
            problems.append(f"{flag}={get(flag)} but {kind} {'missing' if get(flag) else 'rendered'}")

for p in problems:
    print("FAIL", p, file=sys.stderr)
print(f"{len(docs)} objects: {', '.join(sorted({d['kind'] for d in docs}))}")
sys.exit(1 if problems else 0)
