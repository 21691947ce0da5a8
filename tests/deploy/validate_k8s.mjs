// Validates Kubernetes objects against their schemas (kubernetes-models and
// @kubernetes-models/prometheus-operator from npm, pinned by the caller), and
// checks every pod template for the chart's security rules.
// Usage: node validate_k8s.mjs FILE.json  (a JSON array of objects)
// Prints one line per object; exits 1 on the first file with any failure.
import { readFileSync } from "node:fs";

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
const failures = [];

async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const candidates = group === "monitoring.coreos.com"
    ? [`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`]
    : [`kubernetes-models/${group ? `${group}/` : ""}${version}/${kind}`];
  for (const path of candidates) {
    try {
      const mod = await import(path);
      return mod[kind] ?? mod.default;
    } catch (e) {
      if (e.code !== "ERR_MODULE_NOT_FOUND" && e.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED") throw e;
    }
  }
  return null;
}

// The pod spec of a workload, or null.
function podSpec(o) {
  if (o.kind === "Pod") return o.spec;
  if (["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"].includes(o.kind)) return o.spec?.template?.spec;
  return null;
}

function checkSecurity(name, spec) {
  const problems = [];
  const psc = spec.securityContext ?? {};
  if (psc.runAsNonRoot !== true) problems.push("pod securityContext.runAsNonRoot is not true");
  if (psc.seccompProfile?.type !== "RuntimeDefault") problems.push("pod seccompProfile is not RuntimeDefault");
  if (spec.automountServiceAccountToken !== false) problems.push("automountServiceAccountToken is not false");
  if (spec.hostNetwork || spec.hostPID || spec.hostIPC) problems.push("uses a host namespace");
  for (const c of [...(spec.initContainers ?? []), ...(spec.containers ?? [])]) {
    const sc = c.securityContext ?? {};
    if (sc.privileged) problems.push(`${c.name}: privileged`);
    if (sc.allowPrivilegeEscalation !== false) problems.push(`${c.name}: allowPrivilegeEscalation is not false`);
    if (sc.readOnlyRootFilesystem !== true) problems.push(`${c.name}: root file system is writable`);
    if (!(sc.capabilities?.drop ?? []).includes("ALL")) problems.push(`${c.name}: capabilities not dropped`);
    if (!c.resources?.limits?.memory || !c.resources?.limits?.cpu) problems.push(`${c.name}: no cpu/memory limits`);
    if (!c.resources?.requests?.memory || !c.resources?.requests?.cpu) problems.push(`${c.name}: no cpu/memory requests`);
    const isInit = (spec.initContainers ?? []).includes(c);
    if (!isInit && spec.restartPolicy !== "Never" && (!c.readinessProbe || !c.livenessProbe)) {
      problems.push(`${c.name}: readiness or liveness probe missing`);
    }
  }
  return problems.map((p) => `${name}: ${p}`);
}

for (const o of objects) {
  const name = `${o.kind}/${o.metadata?.name}`;
  const Model = await modelFor(o.apiVersion, o.kind);
  if (!Model) {
    failures.push(`${name}: no schema for ${o.apiVersion} ${o.kind}`);
    continue;
  }
  try {
    new Model(o).validate();
    console.log(`ok ${o.apiVersion} ${name}`);
  } catch (e) {
    failures.push(`${name}: ${e.message}`);
  }
  const spec = podSpec(o);
  if (spec) failures.push(...checkSecurity(name, spec));
}
for (const f of failures) console.error(`FAIL ${f}`);
process.exit(failures.length ? 1 : 0);
