// Validates Kubernetes objects against their schemas (kubernetes-models and
// @kubernetes-models/prometheus-operator from npm, pinned by the caller), and
// checks every pod template for the chart's security rules.
// The packages' validators accept fields they do not know (the OpenAPI
// schemas allow them), where `kubectl apply --validate=strict` refuses them
// and a lenient API server drops them without a word (a misspelled
// securityContext field is a silently missing security setting). So each
// object is also walked against the type declarations the packages ship
// (.d.ts: one interface per schema type), and an unknown field fails.
// Usage: node validate_k8s.mjs FILE.json  (a JSON array of objects)
// Prints one line per object; exits 1 on the first file with any failure.
import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
const failures = [];

// The model class of an apiVersion and kind, and its module path; null if none.
async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const candidates = group === "monitoring.coreos.com"
    ? [`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`]
    : [`kubernetes-models/${group ? `${group}/` : ""}${version}/${kind}`];
  for (const path of candidates) {
    try {
      const mod = await import(path);
      return { Model: mod[kind] ?? mod.default, path };
    } catch (e) {
      if (e.code !== "ERR_MODULE_NOT_FOUND" && e.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED") throw e;
    }
  }
  return null;
}

const nodeModules = join(dirname(fileURLToPath(import.meta.url)), "node_modules");

// The declaration file of a module path as the packages import it.
function declarationFile(from, spec) {
  const base = spec.startsWith(".") ? join(dirname(from), spec) : join(nodeModules, spec);
  const file = base.replace(/\.js$/, "") + ".d.ts";
  return existsSync(file) ? file : null;
}

// A type's text up to the ';' that ends it (braces nest: index signatures).
function readType(text, i) {
  let depth = 0;
  const start = i;
  for (; i < text.length; i++) {
    const c = text[i];
    if (c === "{") depth++;
    else if (c === "}") depth--;
    else if (c === ";" && depth === 0) break;
  }
  return [text.slice(start, i).trim(), i + 1];
}

// The properties of an interface body ('"name"?: Type;' ...): name -> {type,
// ctx}, ctx being where the type's names are imported ({file, imports}).
function parseProperties(body, ctx) {
  const props = new Map();
  let i = 0;
  const prop = /\s*"([^"]+)"\??:\s*/y;
  for (;;) {
    prop.lastIndex = i;
    const m = prop.exec(body);
    if (!m) break;
    const [type, next] = readType(body, prop.lastIndex);
    props.set(m[1], { type, ctx });
    i = next;
  }
  return props;
}

// file -> the properties of its interface, its bases' included; null for a
// type alias (a scalar such as IntOrString).
const declarations = new Map();
function declaration(file) {
  if (declarations.has(file)) return declarations.get(file);
  declarations.set(file, null);
  const text = readFileSync(file, "utf8").replace(/\/\*[\s\S]*?\*\//g, "");
  const ctx = { file, imports: new Map() };
  for (const m of text.matchAll(/import \{([^}]+)\} from "([^"]+)";/g)) {
    for (const name of m[1].split(",").map((n) => n.trim())) ctx.imports.set(name, m[2]);
  }
  const head = /export interface \w+(?: extends ([^{]+))? \{/.exec(text);
  if (!head) return null;
  let depth = 1, i = head.index + head[0].length;
  const start = i;
  for (; depth > 0; i++) depth += text[i] === "{" ? 1 : text[i] === "}" ? -1 : 0;
  const props = new Map();
  for (const base of (head[1] ?? "").split(",").map((b) => b.trim()).filter(Boolean)) {
    const baseFile = ctx.imports.has(base) && declarationFile(file, ctx.imports.get(base));
    const inherited = baseFile && declaration(baseFile);
    if (inherited) for (const [k, v] of inherited) props.set(k, v);
  }
  for (const [k, v] of parseProperties(text.slice(start, i - 1), ctx)) props.set(k, v);
  declarations.set(file, props);
  return props;
}

// Unknown fields of `value` read as `type` (its names imported as in `ctx`), as paths.
function unknownFields(value, type, ctx, path) {
  if (value === null || typeof value !== "object") return [];
  let m;
  if ((m = /^Array<(.+)>$/s.exec(type))) {
    return Array.isArray(value) ? value.flatMap((v, i) => unknownFields(v, m[1], ctx, `${path}[${i}]`)) : [];
  }
  if ((m = /^\{\s*\[key: string\]:\s*(.+?);?\s*\}$/s.exec(type))) {
    return Object.entries(value).flatMap(([k, v]) => unknownFields(v, m[1], ctx, `${path}.${k}`));
  }
  if (type.startsWith("{")) return unknownIn(value, parseProperties(type.slice(1, -1), ctx), path);
  if (/^\w+$/.test(type) && ctx.imports.has(type)) {
    const file = declarationFile(ctx.file, ctx.imports.get(type));
    const props = file && declaration(file);
    return props ? unknownIn(value, props, path) : [];
  }
  return [];  // a scalar, a union or a free-form value
}

function unknownIn(obj, props, path) {
  if (Array.isArray(obj)) return [];
  return Object.entries(obj).flatMap(([k, v]) => {
    const where = path ? `${path}.${k}` : k;
    const p = props.get(k);
    return p ? unknownFields(v, p.type, p.ctx, where) : [`unknown field ${where}`];
  });
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
  const model = await modelFor(o.apiVersion, o.kind);
  if (!model) {
    failures.push(`${name}: no schema for ${o.apiVersion} ${o.kind}`);
    continue;
  }
  const file = declarationFile(join(nodeModules, "x"), model.path);
  const props = file && declaration(file);
  const unknown = props ? unknownIn(o, props, "") : [`no type declarations at ${model.path}.d.ts`];
  try {
    new model.Model(o).validate();
    if (unknown.length === 0) console.log(`ok ${o.apiVersion} ${name}`);
  } catch (e) {
    failures.push(`${name}: ${e.message}`);
  }
  failures.push(...unknown.map((u) => `${name}: ${u}`));
  const spec = podSpec(o);
  if (spec) failures.push(...checkSecurity(name, spec));
}
for (const f of failures) console.error(`FAIL ${f}`);
process.exit(failures.length ? 1 : 0);
