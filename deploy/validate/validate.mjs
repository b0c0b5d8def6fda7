// Offline validation of rendered Kubernetes manifests (multi-document YAML,
// e.g. `kubectl kustomize deploy/k8s/overlays/cpu`). Run from a directory
// whose node_modules holds this package's locked dependencies
// (tests/deploy/npm_setup.py installs them):
//
//   node validate.mjs [--json-out FILE] RENDERED.yaml...
//
// Checks, for every object:
//   1. schema: kubernetes-models (core, apps, batch, policy, networking) and
//      @kubernetes-models/prometheus-operator (ServiceMonitor, PodMonitor)
//      validate types, required fields, enums and formats (their generated
//      ajv validators); an apiVersion/kind without a model is an error;
//   2. unknown fields: the objects are written as typed TypeScript constants
//      (`const o: IStatefulSet = {...}`) and type-checked with tsc --strict:
//      an object literal with a field the Kubernetes type does not declare
//      fails (excess-property check), as does a wrong type;
//   3. the project's container rules, for every container of every pod
//      template: startup, readiness and liveness probes (gRPC probes when the
//      container has a port named grpc), CPU and memory requests and limits,
//      and the restricted securityContext (runAsNonRoot, no privilege
//      escalation, capabilities drop ALL and add none, RuntimeDefault
//      seccomp, read-only root filesystem, not privileged), a pinned image.
// Exit 0 when every check passes, 1 otherwise (each problem on stderr as
// "file: Kind/name: problem"); 2 on bad usage. --json-out writes the parsed
// objects as a JSON array of {file, object}.

import fs from "node:fs";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { createRequire } from "node:module";
import { parseAllDocuments } from "yaml";

const require = createRequire(path.join(process.cwd(), "package.json"));

const args = process.argv.slice(2);
let jsonOut = null;
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--json-out") jsonOut = args[++i];
  else files.push(args[i]);
}
if (files.length === 0) {
  console.error("usage: node validate.mjs [--json-out FILE] RENDERED.yaml...");
  process.exit(2);
}

const problems = [];
const objects = [];
for (const file of files) {
  const docs = parseAllDocuments(fs.readFileSync(file, "utf8"));
  for (const doc of docs) {
    if (doc.errors.length) {
      problems.push(`${file}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      continue;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    objects.push({ file, object: obj });
  }
}

function modulePath(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return null;
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    return `@kubernetes-models/prometheus-operator/${apiVersion}/${kind}`;
  }
  return `kubernetes-models/${apiVersion}/${kind}`;
}

function label(o) {
  return `${o.kind ?? "?"}/${o.metadata?.name ?? "?"}`;
}

// 1. Schemas.
const typed = [];
for (const { file, object } of objects) {
  const mod = modulePath(object.apiVersion, object.kind);
  let Model = null;
  try {
    Model = mod && (await import(mod))[object.kind];
  } catch {
    Model = null;
  }
  if (!Model) {
    problems.push(`${file}: ${label(object)}: no schema for apiVersion ${object.apiVersion} kind ${object.kind}`);
    continue;
  }
  try {
    new Model(object).validate();
  } catch (e) {
    problems.push(`${file}: ${label(object)}: schema: ${e.message}`);
  }
  typed.push({ file, object, mod });
}

// 2. Unknown fields, through TypeScript's excess-property check.
if (typed.length) {
  const work = fs.mkdtempSync(path.join(process.cwd(), ".tscheck-"));
  try {
    const lines = [];
    const origin = new Map();
    typed.forEach(({ file, object, mod }, i) => {
      lines.push(`import type { I${object.kind} as T${i} } from "${mod}";`);
    });
    typed.forEach(({ file, object }, i) => {
      origin.set(lines.length + 1, `${file}: ${label(object)}`);
      lines.push(`export const o${i}: T${i} = ${JSON.stringify(object)};`);
    });
    fs.writeFileSync(path.join(work, "objects.ts"), lines.join("\n") + "\n");
    const tsc = require.resolve("typescript/bin/tsc");
    try {
      execFileSync(process.execPath, [tsc, "--noEmit", "--strict", "--skipLibCheck",
        "--target", "es2022", "--module", "nodenext", "--moduleResolution", "nodenext",
        "--pretty", "false", path.join(work, "objects.ts")],
        { cwd: process.cwd(), encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
    } catch (e) {
      const out = `${e.stdout ?? ""}${e.stderr ?? ""}`;
      const re = /objects\.ts\((\d+),\d+\): error (TS\d+: .*)/g;
      let m;
      let found = false;
      while ((m = re.exec(out)) !== null) {
        found = true;
        problems.push(`${origin.get(Number(m[1])) ?? "objects.ts:" + m[1]}: fields: ${m[2]}`);
      }
      if (!found) problems.push(`tsc failed: ${out.trim() || e.message}`);
    }
  } finally {
    fs.rmSync(work, { recursive: true, force: true });
  }
}

// 3. Container rules.
function podSpecOf(o) {
  switch (o.kind) {
    case "Pod": return o.spec;
    case "Deployment": case "StatefulSet": case "DaemonSet": case "ReplicaSet":
    case "Job": return o.spec?.template?.spec;
    case "CronJob": return o.spec?.jobTemplate?.spec?.template?.spec;
    default: return null;
  }
}

function checkContainer(where, c, pod) {
  const bad = (msg) => problems.push(`${where}: container ${c.name}: ${msg}`);
  const grpcPort = (c.ports ?? []).find((p) => p.name === "grpc");
  // Under mutual TLS the kubelet's probes (no client certificate) use the
  // plaintext health-only port: a port named "health" that the container
  // serves with --health-listen=HOST:PORT (docs/security.md).
  const healthPort = (c.ports ?? []).find((p) => p.name === "health");
  const healthServed = healthPort && (c.args ?? []).some((a) =>
    a.startsWith("--health-listen=") && a.endsWith(`:${healthPort.containerPort}`));
  const probePort = healthServed ? healthPort.containerPort : grpcPort?.containerPort;
  for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const p = c[probe];
    if (!p) { bad(`no ${probe}`); continue; }
    if (grpcPort && !(p.grpc && (p.grpc.port === probePort))) {
      bad(`${probe} must be a grpc probe on port ${probePort} (grpc.health.v1${healthServed ? ", the --health-listen port" : ""})`);
    }
  }
  for (const kind of ["requests", "limits"]) {
    for (const r of ["cpu", "memory"]) {
      if (c.resources?.[kind]?.[r] === undefined) bad(`no resources.${kind}.${r}`);
    }
  }
  const sc = c.securityContext ?? {};
  const psc = pod.securityContext ?? {};
  if ((sc.runAsNonRoot ?? psc.runAsNonRoot) !== true) bad("runAsNonRoot is not true");
  if ((sc.runAsUser ?? psc.runAsUser) === 0) bad("runAsUser is 0");
  if (sc.allowPrivilegeEscalation !== false) bad("allowPrivilegeEscalation is not false");
  if (sc.privileged === true) bad("privileged");
  if (!(sc.capabilities?.drop ?? []).includes("ALL")) bad("capabilities.drop lacks ALL");
  if ((sc.capabilities?.add ?? []).length) bad("capabilities.add is not empty");
  if ((sc.seccompProfile?.type ?? psc.seccompProfile?.type) !== "RuntimeDefault") {
    bad("seccompProfile.type is not RuntimeDefault");
  }
  if (sc.readOnlyRootFilesystem !== true) bad("readOnlyRootFilesystem is not true");
  if (typeof c.image !== "string" || !/:[^/]+$/.test(c.image) || c.image.endsWith(":latest")) {
    bad(`image ${c.image} has no pinned tag`);
  }
}

let containers = 0;
for (const { file, object } of objects) {
  const pod = podSpecOf(object);
  if (!pod) continue;
  const where = `${file}: ${label(object)}`;
  const all = [...(pod.initContainers ?? []), ...(pod.containers ?? [])];
  if (!all.length) problems.push(`${where}: no containers`);
  for (const c of all) {
    containers++;
    checkContainer(where, c, pod);
  }
}

if (jsonOut) fs.writeFileSync(jsonOut, JSON.stringify(objects, null, 1));
for (const p of problems) console.error(p);
console.log(`${objects.length} objects, ${containers} containers in ${files.length} file(s): ` +
  (problems.length ? `${problems.length} problem(s)` : "schemas, fields and container rules OK"));
process.exit(problems.length ? 1 : 0);
