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
//      template: startup, readiness and liveness probes (when the container
//      has a port named grpc: probes of grpc.health.v1 on a port it serves,
//      below), CPU and memory requests and limits,
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

// The value of the last --NAME=VALUE in args (Abseil: the last one wins).
function flagValue(args, name) {
  let v;
  for (const a of args ?? []) {
    if (typeof a === "string" && a.startsWith(`--${name}=`)) v = a.slice(name.length + 3);
  }
  return v;
}

function splitHostPort(v) {
  const i = v.lastIndexOf(":");
  return i < 0 ? { host: v, port: NaN } : { host: v.slice(0, i), port: Number(v.slice(i + 1)) };
}

const LOOPBACK = new Set(["127.0.0.1", "localhost", "::1", "[::1]"]);
// gtopk-server --health-check has a 5 s deadline of its own.
const HEALTH_CHECK_DEADLINE_S = 5;

// Probes of a container that serves gRPC: each must really ask
// grpc.health.v1 of a port the container serves, in a way that can succeed.
// - With --health-listen=HOST:PORT (the base, under mutual TLS: the probes
//   present no client certificate): HOST must be loopback -- the port is
//   plaintext and unauthenticated, and gRPC reads a whole request before its
//   size check (docs/resource-limits.md, "Big messages") -- and every probe
//   an exec probe running gtopk-server --health-check=<loopback>:PORT
//   --tls=off, with timeoutSeconds above the check's own 5 s deadline (the
//   kubelet's grpc: probes dial the pod IP, which a loopback port is not on).
// - Without it and with --tls=off: a grpc probe on the gRPC port (or the
//   same exec probe on it).
// - Without it and with any other --tls (or none): nothing can succeed (the
//   gRPC port wants a certificate the kubelet does not have).
function checkGrpcProbes(c, grpcPort, bad) {
  const args = c.args ?? [];
  const tls = flagValue(args, "tls");
  const healthListen = flagValue(args, "health-listen");
  let target = null; // the port the exec probes must check
  let grpcProbeOk = false; // whether a kubelet grpc: probe on grpcPort works
  if (healthListen !== undefined && healthListen !== "") {
    const { host, port } = splitHostPort(healthListen);
    if (!LOOPBACK.has(host)) {
      bad(`--health-listen=${healthListen} is not bound to loopback: a plaintext, ` +
        "unauthenticated grpc.health.v1 port reachable from outside the pod " +
        "(docs/security.md); bind it to 127.0.0.1 and probe it with an exec " +
        `probe (gtopk-server --health-check=127.0.0.1:${port} --tls=off)`);
    }
    target = port;
  } else if (tls === "off") {
    target = grpcPort;
    grpcProbeOk = true;
  }
  for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const p = c[probe];
    if (!p) { bad(`no ${probe}`); continue; }
    if (target === null) {
      bad(`${probe}: with ${tls === undefined ? "no --tls" : `--tls=${tls}`} and no ` +
        "--health-listen no probe can check grpc.health.v1 (the gRPC port wants a " +
        "client certificate): serve it with --health-listen=127.0.0.1:PORT and " +
        "probe it with an exec probe (gtopk-server --health-check=127.0.0.1:PORT --tls=off)");
      continue;
    }
    if (grpcProbeOk && p.grpc && p.grpc.port === grpcPort) continue;
    const cmd = p.exec?.command ?? [];
    const checks = cmd.filter((a) => typeof a === "string" && a.startsWith("--health-check="));
    const checked = checks.length === 1 ? splitHostPort(checks[0].slice("--health-check=".length)) : null;
    const execOk = typeof cmd[0] === "string" && path.basename(cmd[0]) === "gtopk-server" &&
      checked !== null && LOOPBACK.has(checked.host) && checked.port === target &&
      flagValue(cmd, "tls") === "off";
    if (!execOk) {
      bad(grpcProbeOk
        ? `${probe} must be a grpc probe on port ${grpcPort} or an exec probe running ` +
          `gtopk-server --health-check=127.0.0.1:${grpcPort} --tls=off (grpc.health.v1)`
        : `${probe} must be an exec probe running gtopk-server ` +
          `--health-check=127.0.0.1:${target} --tls=off (grpc.health.v1 on the ` +
          "loopback --health-listen port)");
      continue;
    }
    if (!((p.timeoutSeconds ?? 1) > HEALTH_CHECK_DEADLINE_S)) {
      bad(`${probe}.timeoutSeconds is ${p.timeoutSeconds ?? "1 (the default)"}: it must ` +
        `exceed gtopk-server --health-check's own ${HEALTH_CHECK_DEADLINE_S} s deadline`);
    }
  }
}

function checkContainer(where, c, pod) {
  const bad = (msg) => problems.push(`${where}: container ${c.name}: ${msg}`);
  const grpcPort = (c.ports ?? []).find((p) => p.name === "grpc");
  if (grpcPort) checkGrpcProbes(c, grpcPort.containerPort, bad);
  else {
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      if (!c[probe]) bad(`no ${probe}`);
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
