#!/usr/bin/env python3
"""Offline validation of the deployments: deploy/docker-compose.yml,
deploy/k8s (kustomize base + overlays), deploy/prometheus, the Dockerfiles
and deploy/cluster.env. No Docker engine or Kubernetes cluster is needed;
the real tools render and check what they can offline.

One ctest test per class (label `deploy`), e.g.
  python3 tests/deploy/deploy_test.py ComposeTest

  GeneratedTest     deploy/k8s/base/generated/ equals its sources
                    (deploy/sync_generated.py --check), and the check fails
                    on a stale copy
  ComposeTest       `docker-compose config -q` (Debian's docker-compose) with
                    no warning; the topology: S shards, P workers,
                    Prometheus, Grafana, health checks, depends_on
                    service_healthy, Grafana's provisioning mounts; the
                    PyTorch variant (-f docker-compose.python.yml) replaces
                    exactly worker-N's image, build target and command
                    (the example in the image, worker-N's flags), nothing
                    else; mutual TLS by default (docs/security.md): one
                    --tls, the mutual one, and each service's own
                    certificate from its directory of the set-up step
                    (deploy/tls/compose-certs.sh, run here: the files exist,
                    CN and CA right, no other service's key), the shards'
                    HEALTHCHECK presenting it; the plaintext opt-out
                    (docker-compose.plaintext.yml, and
                    docker-compose.python-plaintext.yml for the PyTorch
                    workers) says --tls=off, mounts no certificate and
                    changes nothing else
  KustomizeTest     `kubectl kustomize` renders every overlay; StatefulSet,
                    headless Service, PDB, Indexed Job, ConfigMaps,
                    NetworkPolicy semantics, monitors, annotations; the
                    gpu overlay's workers pass --device=cuda, run the CUDA
                    image and hold an nvidia.com/gpu limit, the cpu
                    overlay's none of these; every overlay runs mutual TLS
                    (the base's default), its files provided by the
                    one-shot Secrets (deploy/tls/k8s-secrets.sh, run here)
                    or by cert-manager (examples/cert-manager), the shards'
                    exec probes (gtopk-server --health-check) on the
                    health-only port, bound to loopback and not exposed;
                    the plaintext opt-out
                    (components/plaintext, examples/plaintext) renders
                    --tls=off over every overlay and changes nothing else
  SchemaTest        every rendered object (overlays and examples) against
                    the Kubernetes and Prometheus Operator schemas, unknown
                    fields, container rules (deploy/validate/validate.mjs,
                    npm packages locked in deploy/validate/package-lock.json);
                    the validator rejects broken copies
  PromtoolTest      `promtool check config` on every deploy/prometheus/*.yml
  DockerfileTest    the images without an engine: Debian bases, every source
                    folder CMake needs is copied, the targets exist, the
                    runtime stages' packages (and their dependencies) own
                    every library the built binaries load, non-root user
                    10001 as in the manifests, ports, HEALTHCHECK;
                    Dockerfile.cuda builds with -DGTOPK_CUDA=ON and Torch_DIR
                    at the libtorch of the named context `libtorch`
                    (nothing downloaded), its runtime stage copies
                    libtorch's lib/ to the linked path and checks it with
                    deploy/docker/ldd-check.sh, which is tested on a
                    program with a library of its own; the python-worker
                    stage: FROM the worker, python3/python3-torch/
                    python3-numpy, the gtopk wheel (pip wheel
                    --no-build-isolation in the build stage) pip-installed
                    where /usr/bin/python3 finds it, the example where compose
                    runs it, ENTRYPOINT python3; every package a stage
                    installs is a Debian 12 package, every COPY source
                    exists in the build context
  FlagsTest         every flag the images, compose, Kubernetes and the
                    launcher pass exists in the built binaries (--helpfull)
                    or, for the Python workers, in the example's argparse
                    (examples/pytorch/train_fashion_mnist.py --help), which
                    also parses the compose Python workers' values; the
                    entrypoints print their usage; and the compose cluster's
                    processes, started with the compose flags (addresses
                    and paths moved to loopback and temporary directories,
                    the model to synthetic:N) by default (mutual TLS, the
                    set-up step's certificates) and with the plaintext
                    opt-out: the shards answer SERVING to the compose
                    HEALTHCHECK (an mTLS port refuses a plaintext check),
                    the workers train a few steps and agree on the
                    checksum, the shards stop cleanly
  ConsistencyTest   compose (both variants), Kubernetes and the launcher
                    (--config deploy/cluster.env, --worker cpp and python)
                    pass the same flags with the same values; the
                    Makefile's demo defaults equal cluster.env;
                    docs/deployment.md documents every variable

Environment: GTOPK_BUILD_DIR (ctest sets it; default build/).
"""

import atexit
import copy
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEPLOY = os.path.join(ROOT, "deploy")
BUILD_DIR = os.path.abspath(os.environ.get("GTOPK_BUILD_DIR",
                                           os.path.join(ROOT, "build")))
SERVER_BIN = os.path.join(BUILD_DIR, "server", "gtopk-server")
WORKER_BIN = os.path.join(BUILD_DIR, "worker", "gtopk-worker")
# gtopk-worker's libtorch module in the images' build stage and where the
# worker stages put it (worker/trainer/torch_module.h).
BUILT_TORCH_MODULE = "/build/worker/libgtopk_torch_model.so"
MODULE_IN_IMAGE = "/usr/local/lib/gtopk/libgtopk_torch_model.so"
VALIDATE_DIR = os.path.join(BUILD_DIR, "deploy-validate")
# The Python package as `make python` builds it (PYTHONPATH=BUILD_DIR/python).
PYTHON_BUILD_DIR = os.path.join(BUILD_DIR, "python")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, the images' python3
# The PyTorch example, in the repository and in the python-worker image.
EXAMPLE = os.path.join(ROOT, "examples", "pytorch", "train_fashion_mnist.py")
EXAMPLE_IN_IMAGE = "/opt/gtopk/examples/train_fashion_mnist.py"
COMPOSE_FILE = os.path.join(DEPLOY, "docker-compose.yml")
# The PyTorch-workers variant: an override file merged over COMPOSE_FILE.
PYTHON_COMPOSE_FILE = os.path.join(DEPLOY, "docker-compose.python.yml")
# The plaintext opt-out of the default mutual TLS (docs/security.md): merged
# over COMPOSE_FILE, and for the PyTorch workers the second one merged last.
PLAINTEXT_COMPOSE_FILE = os.path.join(DEPLOY, "docker-compose.plaintext.yml")
PYTHON_PLAINTEXT_COMPOSE_FILE = os.path.join(
    DEPLOY, "docker-compose.python-plaintext.yml")
# The set-up steps that make the certificates: compose (files per service)
# and Kubernetes (the Secrets the base mounts).
COMPOSE_CERTS = os.path.join(DEPLOY, "tls", "compose-certs.sh")
K8S_SECRETS = os.path.join(DEPLOY, "tls", "k8s-secrets.sh")
# Where every deployment mounts the certificates, and the --tls flags.
TLS_MOUNT = "/etc/gtopk/tls"
TLS_FLAGS = ("--tls=", "--tls-cert=", "--tls-key=", "--tls-ca=")
# The containers' user (the Dockerfile's, the manifests' runAsUser).
CONTAINER_UID = 10001
OVERLAYS = sorted(os.path.basename(p) for p in
                  glob.glob(os.path.join(DEPLOY, "k8s", "overlays", "*"))
                  if os.path.isfile(os.path.join(p, "kustomization.yaml")))
GRPC_PORT = 50051
SERVER_METRICS_PORT = 9400
WORKER_METRICS_PORT = 9401
FASHION_MNIST_TRAIN = 60000
# Where dashboards/provisioning's file provider reads the dashboards.
GRAFANA_DASHBOARDS = "/var/lib/grafana/dashboards/gtopk"
# The Prometheus jobs the dashboards and docs/metrics.md expect.
SERVER_JOB, WORKER_JOB = "gtopk-server", "gtopk-worker"

# Flags whose values differ per deployment by nature (addresses, paths,
# identities); every other flag must be identical everywhere. The launcher
# binds metrics to loopback (--metrics-host); containers keep 0.0.0.0.
# Transport security (docs/security.md) is the deployment's, not a cluster
# setting: all three run mutual TLS by default, each with its own
# certificates and paths (the launcher's throwaway ones, compose's set-up
# step, the k8s Secrets), plaintext being an explicit opt-out.
SECURITY_FLAGS = {"tls", "tls_cert", "tls_key", "tls_ca", "token_file",
                  "shard_token_file", "health_listen"}
SERVER_LOCAL_FLAGS = {"listen", "shard_id", "peers", "checkpoint_dir",
                      "metrics_port", "metrics_host"} | SECURITY_FLAGS
# --device: the hardware the deployment runs on (the gpu overlay: cuda).
WORKER_LOCAL_FLAGS = {"server", "rank", "summary_json", "metrics_port",
                      "metrics_host", "data_dir", "device"} | SECURITY_FLAGS

INSTALL_HINT = {
    "docker-compose": "apt-get install docker-compose (or `make deps`)",
    "promtool": "apt-get install prometheus (or `make deps`)",
    "kubectl": ("install kubectl >= 1.22 (kustomize >= v4.1): e.g. from the "
                "Kubernetes apt repository, see "
                "https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/; "
                "Debian 12's kubernetes-client (1.20) is too old"),
    "node": "apt-get install npm (or `make deps`)",
}


def need(tool):
    path = shutil.which(tool)
    if path is None:
        raise AssertionError("`%s` not found: %s" % (tool, INSTALL_HINT[tool]))
    return path


def run(cmd, **kw):
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, **kw)


def read_env(path=os.path.join(DEPLOY, "cluster.env")):
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                k, _, v = line.partition("=")
                values[k] = v
    return values


def flag_dict(argv):
    """['--a-b=1', '--c'] -> {'a_b': '1', 'c': None}; names normalised to
    underscores (Abseil accepts both spellings)."""
    out = {}
    for a in argv:
        if not a.startswith("--"):
            raise AssertionError("not a --flag=value argument: %r" % a)
        name, sep, value = a[2:].partition("=")
        name = name.replace("-", "_")
        if name in out:
            raise AssertionError("flag --%s given twice in %s" % (name, argv))
        out[name] = value if sep else None
    return out


def same_value(a, b):
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


_compose_cache = {}


def compose_files(python=False, plaintext=False):
    """docker-compose's -f options: the compose file (mutual TLS), with
    plaintext=True the plaintext opt-out, with python=True the
    PyTorch-workers override, and with both the Python workers' plaintext
    file last (docs/security.md, "Compose")."""
    files = ([COMPOSE_FILE] + ([PLAINTEXT_COMPOSE_FILE] if plaintext else [])
             + ([PYTHON_COMPOSE_FILE] if python else [])
             + ([PYTHON_PLAINTEXT_COMPOSE_FILE] if python and plaintext
                else []))
    return [a for f in files for a in ("-f", f)]


def compose_env(tls_dir=None):
    """The environment docker-compose runs in: GTOPK_COMPOSE_TLS_DIR is
    tls_dir, or unset (the file's default, ./tls/out) whatever the caller's
    environment says."""
    env = dict(os.environ)
    env.pop("GTOPK_COMPOSE_TLS_DIR", None)
    if tls_dir is not None:
        env["GTOPK_COMPOSE_TLS_DIR"] = tls_dir
    return env


def compose_config(python=False, plaintext=False, tls_dir=None):
    """The compose file (with python=True: merged with
    docker-compose.python.yml; plaintext=True: with the plaintext opt-out)
    as docker-compose resolves it (variables from deploy/.env substituted,
    the certificates' directory tls_dir or the default)."""
    key = (python, plaintext, tls_dir)
    if key not in _compose_cache:
        exe = need("docker-compose")
        r = run([exe, "--project-directory", DEPLOY]
                + compose_files(python, plaintext) + ["config"],
                env=compose_env(tls_dir))
        if r.returncode != 0:
            raise AssertionError("docker-compose config failed:\n" + r.stderr)
        _compose_cache[key] = yaml.safe_load(r.stdout)
    return _compose_cache[key]


def compose_mounts(svc):
    """{target: (source or None, read_only, type)} of a resolved service's
    volumes (docker-compose config writes binds and named volumes as
    "source:target[:mode]", tmpfs as a mapping)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out[parts[1]] = (parts[0], len(parts) > 2 and
                             "ro" in parts[2].split(","),
                             "bind" if parts[0].startswith("/") else "volume")
        else:
            out[v["target"]] = (v.get("source"), bool(v.get("read_only")),
                                v.get("type"))
    return out


def tls_args(argv):
    """The --tls flags of an argument list, in order."""
    return [a for a in argv if a.startswith(TLS_FLAGS)]


def mutual_tls_args(name, mount=TLS_MOUNT):
    """The --tls flags of a process whose certificate is NAME.{crt,key}."""
    return ["--tls=mutual", "--tls-cert=%s/%s.crt" % (mount, name),
            "--tls-key=%s/%s.key" % (mount, name),
            "--tls-ca=%s/ca.crt" % mount]


def certs_env():
    """The environment for the set-up scripts: the keys go to the
    containers' uid as root (what the documented step does); another user
    keeps them (the script refuses to give them away without root)."""
    env = dict(os.environ)
    env.pop("GTOPK_SHARDS", None)
    env.pop("GTOPK_WORKERS", None)
    if os.getuid() != 0:
        env["GTOPK_COMPOSE_UID"] = str(os.getuid())
    return env


def make_compose_certs(out):
    r = run([COMPOSE_CERTS, out], env=certs_env())
    if r.returncode != 0:
        raise AssertionError("%s failed (%d):\n%s" % (
            COMPOSE_CERTS, r.returncode, r.stdout + r.stderr))
    return out


def cert_subject_cn(path):
    r = run(["openssl", "x509", "-in", path, "-noout", "-subject",
             "-nameopt", "multiline"])
    if r.returncode != 0:
        raise AssertionError("openssl x509 %s: %s" % (path, r.stderr))
    m = re.search(r"commonName\s*=\s*(.*)", r.stdout)
    return m.group(1).strip() if m else None


def cert_verifies(cert, ca):
    return run(["openssl", "verify", "-CAfile", ca, cert]).returncode == 0


_render_cache = {}
_tmp = []


def _rendered_dir():
    """A directory of this process (ctest runs the classes in parallel),
    removed at exit."""
    if not _tmp:
        _tmp.append(tempfile.mkdtemp(prefix="gtopk-deploy-rendered-"))
        atexit.register(shutil.rmtree, _tmp[0], True)
    return _tmp[0]


def render(overlay):
    """kubectl kustomize deploy/k8s/overlays/OVERLAY -> (path, objects)."""
    if overlay not in _render_cache:
        exe = need("kubectl")
        if "kustomize" not in _render_cache:
            v = run([exe, "version", "--client", "-o", "json"])
            try:
                kv = json.loads(v.stdout).get("kustomizeVersion", "")
            except ValueError:
                kv = ""
            m = re.match(r"v(\d+)\.(\d+)", kv)
            if not m or (int(m.group(1)), int(m.group(2))) < (4, 1):
                raise AssertionError("kubectl's kustomize is %r; the "
                                     "manifests need >= v4.1: %s" % (
                                         kv, INSTALL_HINT["kubectl"]))
            _render_cache["kustomize"] = kv
        r = run([exe, "kustomize", os.path.join(DEPLOY, "k8s", "overlays",
                                                overlay)])
        if r.returncode != 0:
            raise AssertionError("kubectl kustomize overlays/%s failed:\n%s"
                                 % (overlay, r.stderr))
        path = os.path.join(_rendered_dir(), overlay + ".yaml")
        with open(path, "w") as f:
            f.write(r.stdout)
        objs = [o for o in yaml.safe_load_all(r.stdout) if o]
        _render_cache[overlay] = (path, objs)
    return _render_cache[overlay]


def find(objs, kind, name=None, prefix=None):
    found = [o for o in objs if o["kind"] == kind and
             (name is None or o["metadata"]["name"] == name) and
             (prefix is None or o["metadata"]["name"].startswith(prefix))]
    return found


def one(objs, kind, name=None, prefix=None):
    found = find(objs, kind, name, prefix)
    if len(found) != 1:
        raise AssertionError("expected one %s %s, found %d" % (
            kind, name or prefix or "", len(found)))
    return found[0]


def container(obj, name):
    for c in obj["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError("%s has no container %s" % (obj["metadata"]["name"],
                                                     name))


def k8s_args(objs, obj, cname):
    """The container's args with $(VAR) expanded from its env and the
    ConfigMaps of its envFrom (as the kubelet does); downward-API variables
    become placeholders <fieldPath>."""
    c = container(obj, cname)
    env = {}
    for src in c.get("envFrom", []):
        cm = one(objs, "ConfigMap", src["configMapRef"]["name"])
        env.update(cm.get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = "<%s>" % e["valueFrom"]["fieldRef"]["fieldPath"]
    out = []
    for a in c.get("args", []):
        def sub(m):
            if m.group(1) not in env:
                raise AssertionError("%s/%s: $(%s) in %r is not defined" % (
                    obj["metadata"]["name"], cname, m.group(1), a))
            return env[m.group(1)]
        out.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a))
    return out


def launcher_argv(extra=()):
    sys.path.insert(0, os.path.join(DEPLOY, "local"))
    try:
        import gtopk_local
    finally:
        sys.path.pop(0)
    args = gtopk_local.parse_args(
        ["--config", os.path.join(DEPLOY, "cluster.env")] + list(extra))
    launcher = gtopk_local.Launcher(args, [])
    launcher.addresses = ["127.0.0.1:%d" % (40000 + s)
                          for s in range(args.shards)]
    launcher.server_metrics = ["127.0.0.1:%d" % (41000 + s)
                               for s in range(args.shards)]
    launcher.worker_metrics = ["127.0.0.1:%d" % (42000 + w)
                               for w in range(args.workers)]
    return (launcher.server_argv(0, launcher.addresses)[1:],
            launcher.worker_argv(0)[1:])


def compose_command(svc):
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def example_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PYTHON_BUILD_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                              else []))
    for name in ("GTOPK_LEADER", "GTOPK_SERVER", "GTOPK_METRICS_PORT",
                 "RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX"):
        env.pop(name, None)
    return env


_example_flags = []


def example_flags():
    """Flag names (underscore spelling) the PyTorch example accepts, from
    its argparse --help."""
    if not _example_flags:
        r = run([SYSTEM_PYTHON, EXAMPLE, "--help"], env=example_env(),
                timeout=60)
        if r.returncode != 0:
            raise AssertionError("%s --help failed (%d):\n%s" % (
                EXAMPLE, r.returncode, r.stdout + r.stderr))
        flags = {m.replace("-", "_") for m in
                 re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", r.stdout)}
        if len(flags) < 10:
            raise AssertionError("no flags parsed from `%s --help`:\n%s" % (
                EXAMPLE, r.stdout[:2000]))
        _example_flags.append(flags)
    return _example_flags[0]


def binary_flags(binary):
    """Flag names (underscore spelling) the binary accepts, from --helpfull
    (Abseil lists them per source file: ours and its own, such as
    --help)."""
    if not os.access(binary, os.X_OK):
        raise AssertionError("%s not built: run `make build` (gtopk-worker "
                             "needs libtorch-dev)" % binary)
    r = run([binary, "--helpfull"])
    text = r.stdout + r.stderr
    flags = set()
    for line in text.splitlines():
        m = re.match(r"\s+--([A-Za-z0-9_]+) ", line)
        if m:
            flags.add(m.group(1))
    if not flags:
        raise AssertionError("no flags parsed from `%s --helpfull`:\n%s" % (
            binary, text[:2000]))
    # Abseil's usage flags are not listed by --helpfull itself.
    return flags | {"help", "helpfull", "helpshort", "version"}


# ---------------------------------------------------------------------------


class GeneratedTest(unittest.TestCase):
    SCRIPT = os.path.join(DEPLOY, "sync_generated.py")

    def test_generated_copies_are_in_sync(self):
        r = run([sys.executable, self.SCRIPT, "--check"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_check_detects_a_stale_copy_and_sync_repairs_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "deploy", "k8s", "base"))
            os.makedirs(os.path.join(tmp, "dashboards"))
            shutil.copy(self.SCRIPT, os.path.join(tmp, "deploy"))
            shutil.copy(os.path.join(DEPLOY, "cluster.env"),
                        os.path.join(tmp, "deploy"))
            shutil.copytree(os.path.join(DEPLOY, "k8s", "base", "generated"),
                            os.path.join(tmp, "deploy", "k8s", "base",
                                         "generated"))
            with open(os.path.join(tmp, "dashboards", "new.json"), "w") as f:
                f.write('{"title": "new"}\n')
            with open(os.path.join(tmp, "deploy", "cluster.env"), "a") as f:
                f.write("GTOPK_EXTRA=1\n")
            script = os.path.join(tmp, "deploy", "sync_generated.py")
            r = run([sys.executable, script, "--check"])
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn("generated/cluster.env: differs", r.stdout)
            self.assertIn("generated/dashboards/new.json: missing", r.stdout)
            self.assertIn("make deploy-sync", r.stdout)
            self.assertEqual(run([sys.executable, script]).returncode, 0)
            r = run([sys.executable, script, "--check"])
            self.assertEqual(r.returncode, 0, r.stdout)
            with open(os.path.join(tmp, "deploy", "k8s", "base", "generated",
                                   "kustomization.yaml")) as f:
                k = yaml.safe_load(f)
            gens = {g["name"]: g for g in k["configMapGenerator"]}
            self.assertEqual(gens["gtopk-grafana-dashboards"]["files"],
                             ["dashboards/new.json"])
            # A removed dashboard is removed from the copy too.
            os.remove(os.path.join(tmp, "dashboards", "new.json"))
            self.assertEqual(run([sys.executable, script]).returncode, 0)
            self.assertFalse(os.path.exists(os.path.join(
                tmp, "deploy", "k8s", "base", "generated", "dashboards",
                "new.json")))


class ComposeTest(unittest.TestCase):
    def setUp(self):
        self.env = read_env()
        self.S = int(self.env["GTOPK_SHARDS"])
        self.P = int(self.env["GTOPK_WORKERS"])
        self.services = compose_config()["services"]

    def test_config_quiet_is_clean(self):
        exe = need("docker-compose")
        r = run([exe, "config", "-q"], cwd=DEPLOY)
        self.assertEqual(r.returncode, 0, r.stderr)
        # Warnings (e.g. "variable is not set") fail too.
        self.assertEqual(r.stderr.strip(), "")

    def test_python_variant_config_quiet_is_clean(self):
        exe = need("docker-compose")
        r = run([exe] + compose_files(python=True) + ["config", "-q"],
                cwd=DEPLOY)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr.strip(), "")

    def test_python_variant_replaces_exactly_the_workers(self):
        """docker-compose.python.yml overrides worker-0..P-1 and nothing
        else: the merged file has the same services; each worker-N runs the
        python-worker image with the example (where the Dockerfile puts it)
        and worker-N's flags and values, and keeps its health check,
        depends_on, volumes, hostname and restart policy. So the Python
        workers take the same ranks instead of fighting for them, and
        Prometheus (worker-N:9401) and the dashboards work unchanged."""
        with open(PYTHON_COMPOSE_FILE) as f:
            raw = yaml.safe_load(f)
        self.assertEqual(set(raw["services"]),
                         {"worker-%d" % w for w in range(self.P)},
                         "docker-compose.python.yml vs GTOPK_WORKERS=%d"
                         % self.P)
        merged = compose_config(python=True)["services"]
        self.assertEqual(set(merged), set(self.services))
        changed = {"image", "build", "command"}

        def rest(svc):
            # docker-compose lists merged volumes in another order.
            return {k: sorted(map(str, v)) if k == "volumes" else v
                    for k, v in svc.items() if k not in changed}
        for name, svc in self.services.items():
            if not name.startswith("worker-"):
                self.assertEqual(rest(merged[name]), rest(svc), name)
                for k in changed:
                    self.assertEqual(merged[name].get(k), svc.get(k), name)
                continue
            py = merged[name]
            self.assertEqual(rest(py), rest(svc), name)
            self.assertTrue(py["image"].startswith("gtopk-python-worker:"),
                            name)
            self.assertEqual(py["image"].split(":")[1],
                             svc["image"].split(":")[1], "same version tag")
            self.assertEqual(py["build"]["target"], "python-worker")
            self.assertEqual(py["build"]["context"], svc["build"]["context"])
            self.assertEqual(py["build"]["dockerfile"],
                             svc["build"]["dockerfile"])
            cmd = compose_command(py)
            self.assertEqual(cmd[0], EXAMPLE_IN_IMAGE, name)
            self.assertEqual(flag_dict(cmd[1:]),
                             flag_dict(compose_command(svc)),
                             "%s: the Python worker must pass the C++ "
                             "worker's flags and values" % name)

    def gtopk_services(self):
        return (["shard-%d" % s for s in range(self.S)] +
                ["worker-%d" % w for w in range(self.P)])

    def test_default_is_mutual_tls(self):
        """docker-compose.yml, alone and with the PyTorch workers: every
        shard and worker says --tls=mutual with its own certificate (the
        workers their rank's, CN gtopk-worker-N), mounted read-only at
        /etc/gtopk/tls from its own directory of the set-up step, by
        default deploy/tls/out/<service> (GTOPK_COMPOSE_TLS_DIR unset)."""
        for python in (False, True):
            services = compose_config(python=python)["services"]
            for name in self.gtopk_services():
                where = "%s%s" % (name, " (python)" if python else "")
                svc = services[name]
                cmd = compose_command(svc)
                self.assertEqual(tls_args(cmd), mutual_tls_args(name), where)
                source, read_only, kind = compose_mounts(svc)[TLS_MOUNT]
                self.assertEqual(source, os.path.join(DEPLOY, "tls", "out",
                                                      name), where)
                self.assertTrue(read_only, where)
                self.assertEqual(kind, "bind", where)

    def test_certificates_come_from_the_set_up_step(self):
        """deploy/tls/compose-certs.sh (the documented set-up step) run
        into a temporary directory, the compose file pointed at it with
        GTOPK_COMPOSE_TLS_DIR: every file a shard's or worker's --tls flags
        or HEALTHCHECK name is there; the mounted directory holds only
        ca.crt and that service's own certificate and key (no CA key, no
        other service's key); the certificate's CN is the role the servers
        check (gtopk-shard-s, gtopk-worker-r) and chains to ca.crt; the key
        is 0600 and, made as root, the containers' uid's."""
        with tempfile.TemporaryDirectory() as tmp:
            out = make_compose_certs(os.path.join(tmp, "tls"))
            for python in (False, True):
                services = compose_config(python=python,
                                          tls_dir=out)["services"]
                for name in self.gtopk_services():
                    svc = services[name]
                    where = "%s%s" % (name, " (python)" if python else "")
                    source = compose_mounts(svc)[TLS_MOUNT][0]
                    self.assertEqual(source, os.path.join(out, name), where)
                    self.assertEqual(sorted(os.listdir(source)),
                                     sorted(["ca.crt", name + ".crt",
                                             name + ".key"]), where)
                    argv = compose_command(svc) + svc["healthcheck"]["test"]
                    for a in tls_args(argv):
                        if a.startswith("--tls="):
                            continue
                        path = a.split("=", 1)[1]
                        self.assertTrue(path.startswith(TLS_MOUNT + "/"), a)
                        host = os.path.join(source,
                                            path[len(TLS_MOUNT) + 1:])
                        self.assertTrue(os.path.isfile(host), (where, a))
                    crt = os.path.join(source, name + ".crt")
                    self.assertEqual(cert_subject_cn(crt), "gtopk-" + name)
                    self.assertTrue(cert_verifies(
                        crt, os.path.join(source, "ca.crt")), where)
                    st = os.stat(os.path.join(source, name + ".key"))
                    self.assertEqual(st.st_mode & 0o777, 0o600, where)
                    self.assertEqual(st.st_uid, CONTAINER_UID
                                     if os.getuid() == 0 else os.getuid())
            # The CA key stays outside every mounted directory; on the host
            # only the owner reaches any key (the keys are the containers'
            # uid's, which may be some other user's here).
            self.assertTrue(os.path.isfile(os.path.join(out, "ca", "ca.key")))
            self.assertEqual(os.stat(out).st_mode & 0o777, 0o700)

    def test_set_up_step_refuses_bad_settings(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "tls")
            for var, value in (("GTOPK_SHARDS", "two"),
                               ("GTOPK_WORKERS", "-1"),
                               ("GTOPK_COMPOSE_UID", "gtopk")):
                r = run([COMPOSE_CERTS, out],
                        env=dict(certs_env(), **{var: value}))
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("%s must be" % var, r.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "ca")))
            # Not root and not the containers' uid: keys the containers
            # could not read are refused, naming the fix.
            setpriv = shutil.which("setpriv")
            if os.getuid() == 0 and setpriv:
                cmd = [setpriv, "--reuid=65534", "--regid=65534",
                       "--clear-groups", COMPOSE_CERTS, out]
                env = {k: v for k, v in certs_env().items()
                       if k != "GTOPK_COMPOSE_UID"}
            else:
                cmd, env = [COMPOSE_CERTS, out], dict(
                    certs_env(), GTOPK_COMPOSE_UID=str(os.getuid() + 1))
            r = run(cmd, env=env)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("could not read keys", r.stderr)
            self.assertIn("sudo", r.stderr)

    def test_plaintext_variants_config_quiet_is_clean(self):
        exe = need("docker-compose")
        for python in (False, True):
            r = run([exe] + compose_files(python, plaintext=True)
                    + ["config", "-q"], cwd=DEPLOY, env=compose_env())
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stderr.strip(), "")

    def test_plaintext_opt_out(self):
        """docker-compose.plaintext.yml (and, for the PyTorch workers,
        docker-compose.python-plaintext.yml merged last) overrides exactly
        the shards and workers: one --tls, --tls=off; the commands otherwise
        the default's, in the same order (the files stay in step); no
        certificate mounted (an empty tmpfs at /etc/gtopk/tls, so no set-up
        step is needed); the shards' HEALTHCHECK checks the plaintext port;
        everything else unchanged."""
        for path, want in ((PLAINTEXT_COMPOSE_FILE, self.gtopk_services()),
                           (PYTHON_PLAINTEXT_COMPOSE_FILE,
                            ["worker-%d" % w for w in range(self.P)])):
            with open(path) as f:
                self.assertEqual(sorted(yaml.safe_load(f)["services"]),
                                 sorted(want), path)
        for python in (False, True):
            mtls = compose_config(python=python)["services"]
            plain = compose_config(python=python, plaintext=True)["services"]
            self.assertEqual(set(plain), set(mtls))
            for name, svc in mtls.items():
                where = "%s%s" % (name, " (python)" if python else "")
                p = plain[name]
                if name not in self.gtopk_services():
                    # docker-compose lists merged volumes in another order.
                    self.assertEqual(compose_mounts(p), compose_mounts(svc),
                                     where)
                    self.assertEqual(dict(p, volumes=None),
                                     dict(svc, volumes=None), where)
                    continue
                cmd = compose_command(p)
                self.assertEqual(tls_args(cmd), ["--tls=off"], where)
                self.assertEqual(
                    [c for c in cmd if not c.startswith(TLS_FLAGS)],
                    [c for c in compose_command(svc)
                     if not c.startswith(TLS_FLAGS)], where)
                mounts = compose_mounts(p)
                self.assertEqual(mounts[TLS_MOUNT], (None, False, "tmpfs"),
                                 where)
                self.assertEqual({k: v for k, v in mounts.items()
                                  if k != TLS_MOUNT},
                                 {k: v for k, v in compose_mounts(svc).items()
                                  if k != TLS_MOUNT}, where)
                hc = dict(p["healthcheck"])
                want_hc = dict(svc["healthcheck"])
                if name.startswith("shard-"):
                    self.assertEqual(hc.pop("test"), [
                        "CMD", "gtopk-server",
                        "--health-check=127.0.0.1:%d" % GRPC_PORT,
                        "--tls=off"], where)
                    want_hc.pop("test")
                self.assertEqual(hc, want_hc, where)
                rest = ("command", "volumes", "healthcheck")
                self.assertEqual({k: v for k, v in p.items()
                                  if k not in rest},
                                 {k: v for k, v in svc.items()
                                  if k not in rest}, where)

    def test_services_are_the_topology(self):
        want = ({"shard-%d" % s for s in range(self.S)} |
                {"worker-%d" % w for w in range(self.P)} |
                {"prometheus", "grafana"})
        self.assertEqual(set(self.services), want,
                         "compose services vs GTOPK_SHARDS=%d GTOPK_WORKERS=%d"
                         % (self.S, self.P))

    def test_every_service_has_a_health_check(self):
        for name, svc in self.services.items():
            hc = svc.get("healthcheck", {})
            self.assertTrue(hc.get("test"), "%s has no healthcheck" % name)
            self.assertFalse(hc.get("disable", False), name)
        # The shards' check presents the shard's own certificate on the
        # mutual-TLS port (the plaintext one: test_plaintext_opt_out).
        for s in range(self.S):
            self.assertEqual(
                self.services["shard-%d" % s]["healthcheck"]["test"],
                ["CMD", "gtopk-server", "--health-check=127.0.0.1:%d" %
                 GRPC_PORT] + mutual_tls_args("shard-%d" % s))

    def test_depends_on_waits_for_healthy(self):
        def deps(name):
            d = self.services[name].get("depends_on", {})
            self.assertIsInstance(d, dict, "%s: depends_on needs conditions"
                                  % name)
            return {k: v.get("condition") for k, v in d.items()}
        shards = {"shard-%d" % s: "service_healthy" for s in range(self.S)}
        for w in range(self.P):
            self.assertEqual(deps("worker-%d" % w), shards)
        for s in range(1, self.S):
            self.assertEqual(deps("shard-%d" % s),
                             {"shard-0": "service_healthy"})
        self.assertEqual(deps("grafana"), {"prometheus": "service_healthy"})

    def test_shard_and_worker_identities(self):
        peers = ",".join("shard-%d:%d" % (s, GRPC_PORT) for s in range(self.S))
        for s in range(self.S):
            svc = self.services["shard-%d" % s]
            f = flag_dict(compose_command(svc))
            self.assertEqual(f["shard_id"], str(s))
            self.assertEqual(f["peers"], peers)
            self.assertEqual(f["listen"], "0.0.0.0:%d" % GRPC_PORT)
            self.assertEqual(f["metrics_port"], str(SERVER_METRICS_PORT))
            self.assertIn(f["checkpoint_dir"], self._mounts("shard-%d" % s),
                          "shard-%d: no volume at its --checkpoint-dir" % s)
        for w in range(self.P):
            f = flag_dict(compose_command(self.services["worker-%d" % w]))
            self.assertEqual(f["rank"], str(w))
            self.assertEqual(f["server"], "shard-0:%d" % GRPC_PORT)
            self.assertEqual(f["metrics_port"], str(WORKER_METRICS_PORT))

    def _mounts(self, name):
        out = {}
        for v in self.services[name].get("volumes", []):
            if isinstance(v, str):
                parts = v.split(":")
                out[parts[1]] = parts[0]
            else:
                out[v["target"]] = v.get("source")
        return out

    def test_prometheus_scrapes_every_process(self):
        mounts = self._mounts("prometheus")
        cfg_path = mounts.get("/etc/prometheus/prometheus.yml")
        self.assertEqual(os.path.realpath(cfg_path or ""),
                         os.path.join(DEPLOY, "prometheus", "compose.yml"))
        with open(cfg_path) as f:
            cfg = yaml.safe_load(f)
        targets = {(job["job_name"], t) for job in cfg["scrape_configs"]
                   for sc in job.get("static_configs", [])
                   for t in sc["targets"]}
        for s in range(self.S):
            self.assertIn((SERVER_JOB, "shard-%d:%d" % (s, SERVER_METRICS_PORT)),
                          targets)
        for w in range(self.P):
            self.assertIn((WORKER_JOB, "worker-%d:%d" % (w, WORKER_METRICS_PORT)),
                          targets)

    def test_grafana_gets_the_dashboards_and_provisioning(self):
        mounts = self._mounts("grafana")
        dash_root = os.path.join(ROOT, "dashboards")
        self.assertEqual(os.path.realpath(
            mounts.get("/etc/grafana/provisioning", "")),
            os.path.join(dash_root, "provisioning"))
        self.assertEqual(os.path.realpath(
            mounts.get(GRAFANA_DASHBOARDS, "")), dash_root)
        self.assertIn("3000:3000", [str(p) if not isinstance(p, dict) else
                                    "%s:%s" % (p["published"], p["target"])
                                    for p in self.services["grafana"]["ports"]])
        # Whatever provisioning exists must point at these mounts.
        for path in glob.glob(os.path.join(dash_root, "provisioning", "**",
                                           "*.y*ml"), recursive=True):
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
            for p in doc.get("providers", []):
                self.assertEqual(p.get("options", {}).get("path"),
                                 GRAFANA_DASHBOARDS, path)
            for d in doc.get("datasources", []):
                if d.get("type") == "prometheus":
                    self.assertEqual(d.get("url"), "http://prometheus:9090",
                                     path)


K8S_EXAMPLES = sorted(
    os.path.basename(p) for p in
    glob.glob(os.path.join(DEPLOY, "k8s", "examples", "*"))
    if os.path.isfile(os.path.join(p, "kustomization.yaml")))
HEALTH_PORT = 50052  # --health-listen (loopback): the shards' probes under mTLS
# The shards' probes: run in the container, on the loopback health port.
HEALTH_PROBE = ["gtopk-server", "--health-check=127.0.0.1:%d" % HEALTH_PORT,
                "--tls=off"]


def render_dir(path, key):
    """kubectl kustomize PATH -> (rendered file, objects), cached by KEY."""
    if key not in _render_cache:
        render("cpu")  # checks kubectl's kustomize version once
        r = run([need("kubectl"), "kustomize", path])
        if r.returncode != 0:
            raise AssertionError("kubectl kustomize %s failed:\n%s"
                                 % (path, r.stderr))
        out = os.path.join(_rendered_dir(), key.replace("/", "-") + ".yaml")
        with open(out, "w") as f:
            f.write(r.stdout)
        _render_cache[key] = (out, [o for o in yaml.safe_load_all(r.stdout)
                                    if o])
    return _render_cache[key]


def render_example(name):
    """kubectl kustomize deploy/k8s/examples/NAME -> (path, objects)."""
    return render_dir(os.path.join(DEPLOY, "k8s", "examples", name),
                      "examples/" + name)


def render_plaintext(overlay):
    """overlays/OVERLAY with components/plaintext, as a user's overlay
    would add it (kustomize takes relative paths only)."""
    key = "plaintext/" + overlay
    if key not in _render_cache:
        d = os.path.join(_rendered_dir(), "plaintext-" + overlay)
        os.makedirs(d, exist_ok=True)
        k8s = os.path.relpath(os.path.join(DEPLOY, "k8s"), d)
        with open(os.path.join(d, "kustomization.yaml"), "w") as f:
            yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [k8s + "/overlays/" + overlay],
                "components": [k8s + "/components/plaintext"]}, f)
        render_dir(d, key)
    return _render_cache[key]


def mounted_tls_files(tc, obj, c, secrets):
    """The file names the container's volume at TLS_MOUNT provides, per
    source Secret. secrets[name]: that Secret's keys, or None when unknown
    (a generic Secret made outside the manifests): its files are then None.
    Every source must be one of `secrets`."""
    mounts = [m for m in c.get("volumeMounts", [])
              if m["mountPath"] == TLS_MOUNT]
    tc.assertEqual(len(mounts), 1, c.get("volumeMounts"))
    tc.assertTrue(mounts[0].get("readOnly"), mounts[0])
    vols = [v for v in obj["spec"]["template"]["spec"]["volumes"]
            if v["name"] == mounts[0]["name"]]
    tc.assertEqual(len(vols), 1)
    v = vols[0]
    sources = ([{"secret": dict(src["secret"], secretName=src["secret"][
        "name"])} for src in v["projected"]["sources"]]
               if "projected" in v else [v])
    files = {}
    for src in sources:
        sec = src["secret"]
        tc.assertIn(sec["secretName"], secrets, sec)
        keys = secrets[sec["secretName"]]
        items = sec.get("items")
        if items is None:
            files[sec["secretName"]] = None if keys is None else set(keys)
        else:
            for it in items:
                if keys is not None:
                    tc.assertIn(it["key"], keys, it)
                files.setdefault(sec["secretName"], set()).add(it["path"])
    return files


def check_mutual_tls(tc, objs, S, secrets):
    """Mutual TLS as the base runs it (docs/security.md, "Kubernetes"):
    shards and workers say --tls=mutual first, then the certificate flags
    at TLS_MOUNT (the shard's own by $(SHARD_ID), the workers' any-rank
    worker.crt); the shards serve the health-only port 50052 on loopback
    only (plaintext and unauthenticated: nothing outside the pod may reach
    it, docs/resource-limits.md, "Big messages"), no containerPort names it,
    and the probes are exec probes checking it with gtopk-server
    --health-check --tls=off (they present no certificate) within a
    timeout above the check's own 5 s deadline; TLS_MOUNT is mounted
    read-only from `secrets` and, where their keys are known, provides
    exactly the files the flags name, for every shard id."""
    sts = one(objs, "StatefulSet", "gtopk-shard")
    job = one(objs, "Job", "gtopk-worker")
    shard, worker = container(sts, "shard"), container(job, "worker")
    tc.assertEqual(shard["args"][:4], mutual_tls_args("shard-$(SHARD_ID)"))
    tc.assertEqual(tls_args(shard["args"]),
                   mutual_tls_args("shard-$(SHARD_ID)"))
    tc.assertEqual(worker["args"][:4], mutual_tls_args("worker"))
    tc.assertEqual(tls_args(worker["args"]), mutual_tls_args("worker"))
    tc.assertEqual([a for a in shard["args"]
                    if a.startswith("--health-listen=")],
                   ["--health-listen=127.0.0.1:%d" % HEALTH_PORT])
    tc.assertEqual([p for p in shard["ports"]
                    if p["containerPort"] == HEALTH_PORT
                    or p["name"] == "health"], [])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        tc.assertEqual(set(shard[probe]) & {"grpc", "tcpSocket", "httpGet"},
                       set(), probe)
        tc.assertEqual(shard[probe]["exec"]["command"], HEALTH_PROBE, probe)
        tc.assertGreater(shard[probe]["timeoutSeconds"], 5, probe)
    need_shard = {"ca.crt"} | {"shard-%d.%s" % (i, ext) for i in range(S)
                               for ext in ("crt", "key")}
    for obj, c, want in ((sts, shard, need_shard),
                         (job, worker, {"ca.crt", "worker.crt",
                                        "worker.key"})):
        files = mounted_tls_files(tc, obj, c, secrets)
        if None not in files.values():
            tc.assertEqual(set().union(*files.values()), want, files)


def without_tls(obj):
    """A StatefulSet or Job with its TLS pieces taken out: the --tls flags,
    the TLS_MOUNT mount and its volume. -> (object, [--tls flags])."""
    o = copy.deepcopy(obj)
    spec = o["spec"]["template"]["spec"]
    c = spec["containers"][0]
    flags = tls_args(c["args"])
    c["args"] = [a for a in c["args"] if not a.startswith(TLS_FLAGS)]
    names = {m["name"] for m in c["volumeMounts"]
             if m["mountPath"] == TLS_MOUNT}
    c["volumeMounts"] = [m for m in c["volumeMounts"]
                         if m["mountPath"] != TLS_MOUNT]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in names]
    return o, flags


def k8s_secrets(tc, out):
    """deploy/tls/k8s-secrets.sh OUT -> {Secret name: Secret}."""
    r = run([K8S_SECRETS, out], env=certs_env())
    tc.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    return {d["metadata"]["name"]: d for d in docs}


class KustomizeTest(unittest.TestCase):
    def setUp(self):
        self.env = read_env()
        self.S = int(self.env["GTOPK_SHARDS"])
        self.P = int(self.env["GTOPK_WORKERS"])

    def test_overlays_exist(self):
        self.assertEqual(OVERLAYS, ["cpu", "gpu"])

    def test_every_overlay_renders_the_cluster(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                _, objs = render(overlay)
                self.check_cluster(objs)

    def check_cluster(self, objs):
        ns = {o["metadata"].get("namespace") for o in objs
              if o["kind"] != "Namespace"}
        self.assertEqual(ns, {"gtopk"})
        namespace = one(objs, "Namespace", "gtopk")
        self.assertEqual(namespace["metadata"]["labels"][
            "pod-security.kubernetes.io/enforce"], "restricted")

        cm = one(objs, "ConfigMap", prefix="gtopk-cluster-")
        self.assertEqual(cm["data"], self.env)

        svc = one(objs, "Service", "gtopk-shard")
        self.assertEqual(svc["spec"]["clusterIP"], "None")
        self.assertIs(svc["spec"]["publishNotReadyAddresses"], True)
        self.assertEqual({p["name"]: p["port"] for p in svc["spec"]["ports"]},
                         {"grpc": GRPC_PORT, "metrics": SERVER_METRICS_PORT})

        sts = one(objs, "StatefulSet", "gtopk-shard")
        spec = sts["spec"]
        self.assertEqual(spec["serviceName"], "gtopk-shard")
        self.assertEqual(spec["podManagementPolicy"], "Parallel")
        self.assertEqual(spec["replicas"], self.S, "replicas != GTOPK_SHARDS")
        sel = spec["selector"]["matchLabels"]
        self.assertEqual(svc["spec"]["selector"], sel)
        shard = container(sts, "shard")
        f = flag_dict(k8s_args(objs, sts, "shard"))
        self.assertEqual(f["shard_id"],
                         "<metadata.labels['apps.kubernetes.io/pod-index']>")
        self.assertEqual(f["peers"], ",".join(
            "gtopk-shard-%d.gtopk-shard.<metadata.namespace>.svc:%d"
            % (s, GRPC_PORT) for s in range(self.S)))
        claims = [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]]
        mounts = {m["mountPath"]: m["name"] for m in shard["volumeMounts"]}
        self.assertIn(mounts.get(f["checkpoint_dir"]), claims,
                      "--checkpoint-dir is not on the claimed volume")
        self.assertEqual(f["metrics_port"], str(SERVER_METRICS_PORT))

        pdb = one(objs, "PodDisruptionBudget", "gtopk-shard")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], sel)

        job = one(objs, "Job", "gtopk-worker")
        self.assertEqual(job["spec"]["completionMode"], "Indexed")
        self.assertEqual(job["spec"]["completions"], self.P)
        self.assertEqual(job["spec"]["parallelism"], self.P)
        wf = flag_dict(k8s_args(objs, job, "worker"))
        self.assertEqual(wf["rank"], "-1")  # = $JOB_COMPLETION_INDEX
        self.assertEqual(wf["server"],
                         "gtopk-shard-0.gtopk-shard.<metadata.namespace>.svc:%d"
                         % GRPC_PORT)
        self.assertEqual(wf["metrics_port"], str(WORKER_METRICS_PORT))

        # Scrape annotations and monitors point at the metrics ports.
        for obj, cname, port in ((sts, "shard", SERVER_METRICS_PORT),
                                 (job, "worker", WORKER_METRICS_PORT)):
            ann = obj["spec"]["template"]["metadata"]["annotations"]
            self.assertEqual(ann["prometheus.io/scrape"], "true")
            self.assertEqual(ann["prometheus.io/port"], str(port))
            self.assertEqual(ann["prometheus.io/path"], "/metrics")
            ports = {p["name"]: p["containerPort"]
                     for p in container(obj, cname)["ports"]}
            self.assertEqual(ports["metrics"], port)
        sm = one(objs, "ServiceMonitor", "gtopk-shard")
        sm_sel = sm["spec"]["selector"]["matchLabels"]
        self.assertEqual(sm_sel, {k: v for k, v in
                                  svc["metadata"]["labels"].items()
                                  if k in sm_sel})
        self.assertTrue(sm_sel)
        self.assertEqual([e["port"] for e in sm["spec"]["endpoints"]],
                         ["metrics"])
        self.assertEqual(sm["spec"]["endpoints"][0]["relabelings"],
                         [{"targetLabel": "job", "replacement": SERVER_JOB}])
        pm = one(objs, "PodMonitor", "gtopk-worker")
        self.assertEqual(pm["spec"]["selector"]["matchLabels"],
                         job["spec"]["template"]["metadata"]["labels"])
        self.assertEqual([e["port"] for e in pm["spec"]["podMetricsEndpoints"]],
                         ["metrics"])
        self.assertEqual(pm["spec"]["podMetricsEndpoints"][0]["relabelings"],
                         [{"targetLabel": "job", "replacement": WORKER_JOB}])

        self.check_dashboards(objs)
        self.check_network_policy(objs, sts, job)
        check_mutual_tls(self, objs, self.S,
                         {"gtopk-tls-shards": None, "gtopk-tls-workers": None})

    def check_dashboards(self, objs):
        want = {}
        for path in sorted(glob.glob(os.path.join(ROOT, "dashboards",
                                                  "*.json"))):
            with open(path) as f:
                want[os.path.basename(path)] = f.read()
        found = find(objs, "ConfigMap", "gtopk-grafana-dashboards")
        if not want:
            self.assertEqual(found, [])
            return
        self.assertEqual(len(found), 1, "no dashboards ConfigMap")
        self.assertEqual(found[0]["data"], want)
        self.assertEqual(found[0]["metadata"]["labels"]["grafana_dashboard"],
                         "1")

    def check_network_policy(self, objs, sts, job):
        """Evaluates the policies for the pairs that matter: what may reach
        a shard or a worker, and where they may connect."""
        pols = find(objs, "NetworkPolicy")
        shard_labels = sts["spec"]["template"]["metadata"]["labels"]
        worker_labels = job["spec"]["template"]["metadata"]["labels"]
        prom = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
        other = ("gtopk", {"app.kubernetes.io/name": "something-else"})
        dns = ("kube-system", {"k8s-app": "kube-dns"})
        outside = ("default", {"app": "client"})

        def matches(selector, labels):
            return all(labels.get(k) == v for k, v in
                       (selector or {}).get("matchLabels", {}).items())

        def peer_ok(peer, ns, labels, own_ns="gtopk"):
            if "ipBlock" in peer:
                return False
            if "namespaceSelector" in peer:
                ns_labels = {"kubernetes.io/metadata.name": ns}
                if not matches(peer["namespaceSelector"], ns_labels):
                    return False
            elif ns != own_ns:
                return False
            return matches(peer.get("podSelector", {}), labels)

        def allowed(direction, pod_labels, peer_ns, peer_labels, port):
            selecting = [p for p in pols
                         if direction.capitalize() in p["spec"]["policyTypes"]
                         and matches(p["spec"]["podSelector"], pod_labels)]
            self.assertTrue(selecting, "%s of %s is not restricted" % (
                direction, pod_labels))
            for p in selecting:
                for rule in p["spec"].get(direction, []):
                    peers = rule.get("from" if direction == "ingress"
                                     else "to")
                    ports = rule.get("ports")
                    if peers is not None and not any(
                            peer_ok(x, peer_ns, peer_labels) for x in peers):
                        continue
                    if ports is not None and not any(
                            x.get("port") == port for x in ports):
                        continue
                    return True
            return False

        gtopk = lambda labels: ("gtopk", labels)  # noqa: E731
        ingress_cases = [
            (shard_labels, gtopk(worker_labels), GRPC_PORT, True),
            (shard_labels, gtopk(shard_labels), GRPC_PORT, True),
            (shard_labels, prom, SERVER_METRICS_PORT, True),
            (shard_labels, prom, GRPC_PORT, False),
            (shard_labels, gtopk(worker_labels), SERVER_METRICS_PORT, False),
            (shard_labels, other, GRPC_PORT, False),
            (shard_labels, outside, GRPC_PORT, False),
            # The health-only port is on loopback; no policy opens it.
            (shard_labels, gtopk(worker_labels), HEALTH_PORT, False),
            (shard_labels, prom, HEALTH_PORT, False),
            (worker_labels, prom, WORKER_METRICS_PORT, True),
            (worker_labels, gtopk(shard_labels), WORKER_METRICS_PORT, False),
            (worker_labels, outside, WORKER_METRICS_PORT, False),
        ]
        for pod, (ns, labels), port, want in ingress_cases:
            self.assertEqual(allowed("ingress", pod, ns, labels, port), want,
                             "ingress to %s from %s/%s port %d" % (
                                 pod, ns, labels, port))
        egress_cases = [
            (worker_labels, gtopk(shard_labels), GRPC_PORT, True),
            (shard_labels, gtopk(shard_labels), GRPC_PORT, True),
            (worker_labels, dns, 53, True),
            (worker_labels, gtopk(shard_labels), SERVER_METRICS_PORT, False),
            (worker_labels, outside, 443, False),
            (shard_labels, gtopk(worker_labels), WORKER_METRICS_PORT, False),
        ]
        for pod, (ns, labels), port, want in egress_cases:
            self.assertEqual(allowed("egress", pod, ns, labels, port), want,
                             "egress from %s to %s/%s port %d" % (
                                 pod, ns, labels, port))
        # Any other pod of the namespace: denied both ways.
        self.assertFalse(allowed("ingress", {"x": "y"}, "gtopk",
                                 worker_labels, GRPC_PORT))
        self.assertFalse(allowed("egress", {"x": "y"}, "gtopk", shard_labels,
                                 GRPC_PORT))

    def test_examples_exist(self):
        self.assertEqual(K8S_EXAMPLES, ["cert-manager", "plaintext"])

    def test_one_shot_secrets_provide_every_mounted_file(self):
        """deploy/tls/k8s-secrets.sh (the one-shot step, run here offline)
        prints exactly the two Secrets the base mounts, in its namespace,
        with every file the --tls flags name (for every shard id) and no CA
        key; the shard certificates carry CN gtopk-shard-s and the headless
        Service's names as SANs, the workers' CN gtopk-worker, all signed
        by the ca.crt they come with."""
        import base64
        with tempfile.TemporaryDirectory() as tmp:
            secrets = k8s_secrets(self, os.path.join(tmp, "k8s"))
            self.assertEqual(sorted(secrets), ["gtopk-tls-shards",
                                               "gtopk-tls-workers"])
            for sec in secrets.values():
                self.assertEqual(sec["kind"], "Secret")
                self.assertEqual(sec["metadata"]["namespace"], "gtopk")
                self.assertNotIn("ca.key", sec["data"])
            for overlay in OVERLAYS:
                with self.subTest(overlay=overlay):
                    check_mutual_tls(self, render(overlay)[1], self.S, {
                        n: set(s["data"]) for n, s in secrets.items()})
            _, objs = render("cpu")
            svc = one(objs, "StatefulSet", "gtopk-shard")["spec"][
                "serviceName"]
            files = {}
            for name, sec in secrets.items():
                for key, value in sec["data"].items():
                    path = os.path.join(tmp, "%s-%s" % (name, key))
                    with open(path, "wb") as f:
                        f.write(base64.b64decode(value))
                    files[name, key] = path
            for name, sec in secrets.items():
                ca = files[name, "ca.crt"]
                for key in sec["data"]:
                    if not key.endswith(".crt") or key == "ca.crt":
                        continue
                    crt = files[name, key]
                    self.assertTrue(cert_verifies(crt, ca), key)
                    self.assertEqual(cert_subject_cn(crt),
                                     "gtopk-" + key[:-len(".crt")])
                    if key.startswith("shard-"):
                        sans = run(["openssl", "x509", "-in", crt, "-noout",
                                    "-ext", "subjectAltName"]).stdout
                        self.assertIn("DNS:gtopk-%s.%s.gtopk.svc" % (
                            key[:-len(".crt")], svc), sans)
        with open(os.path.join(ROOT, "docs", "security.md")) as f:
            self.assertTrue("deploy/tls/k8s-secrets.sh | kubectl apply -f -"
                            in f.read(), "docs/security.md does not show "
                            "the one-shot step")

    def test_plaintext_opt_out(self):
        """components/plaintext over every overlay (examples/plaintext: over
        the cpu one): the shards and workers say --tls=off and no other
        --tls flag, mount no certificate and need no Secret; everything
        else is the overlay's, the args in the same order (the shards keep
        their loopback health-only port and exec probes, which check it
        with --tls=off in both)."""
        _, example = render_example("plaintext")
        self.assertEqual(example, render_plaintext("cpu")[1])
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                _, mtls = render(overlay)
                _, plain = render_plaintext(overlay)
                self.assertEqual(len(plain), len(mtls))
                for o in plain:
                    m = one(mtls, o["kind"], o["metadata"]["name"])
                    if o["kind"] not in ("StatefulSet", "Job"):
                        self.assertEqual(o, m)
                        continue
                    p_rest, p_flags = without_tls(o)
                    m_rest, m_flags = without_tls(m)
                    self.assertEqual(p_flags, ["--tls=off"])
                    self.assertEqual(p_rest, m_rest)
                    spec = o["spec"]["template"]["spec"]
                    self.assertEqual(o["spec"]["template"]["spec"][
                        "containers"][0]["args"][0], "--tls=off")
                    self.assertFalse([v for v in spec["volumes"]
                                      if "secret" in v or "projected" in v])

    def test_every_example_object_is_in_the_gtopk_namespace(self):
        # A component's own resources do not get the base's namespace:
        # cert-manager would write the Secrets where the pods cannot see
        # them.
        for name in K8S_EXAMPLES:
            _, objs = render_example(name)
            for o in objs:
                if o["kind"] == "Namespace":
                    continue
                with self.subTest(example=name, kind=o["kind"],
                                  name=o["metadata"]["name"]):
                    self.assertEqual(o["metadata"].get("namespace"), "gtopk")

    def test_cert_manager_issues_every_mounted_secret(self):
        _, objs = render_example("cert-manager")
        certs = {c["spec"]["secretName"]: c
                 for c in find(objs, "Certificate")}
        issuers = {i["metadata"]["name"]: i for i in find(objs, "Issuer")}
        # cert-manager writes tls.crt, tls.key and ca.crt into each Secret;
        # the base's one-shot Secrets are no longer mounted.
        check_mutual_tls(self, objs, self.S, {
            name: {"tls.crt", "tls.key", "ca.crt"} for name in certs})
        sts = one(objs, "StatefulSet", "gtopk-shard")
        svc = sts["spec"]["serviceName"]
        vol = [v for v in sts["spec"]["template"]["spec"]["volumes"]
               if "projected" in v][0]
        for src in vol["projected"]["sources"]:
            cert = certs[src["secret"]["name"]]["spec"]
            paths = {it["path"] for it in src["secret"]["items"]}
            shard_files = [p for p in paths if p.startswith("shard-")]
            self.assertTrue(shard_files, paths)
            sid = int(shard_files[0].split("-")[1].split(".")[0])
            # The CN is the role the server checks; the SANs what the
            # shards are dialled at (the headless Service's pod names).
            self.assertEqual(cert["commonName"], "gtopk-shard-%d" % sid)
            self.assertIn("gtopk-shard-%d.%s.gtopk.svc" % (sid, svc),
                          cert["dnsNames"])
            self.assertEqual(set(cert["usages"]),
                             {"server auth", "client auth"})
        worker = [c["spec"] for c in certs.values()
                  if c["spec"].get("commonName") == "gtopk-worker"]
        self.assertEqual(len(worker), 1)
        self.assertEqual(worker[0]["usages"], ["client auth"])
        # Every certificate chains to one CA issued by the self-signed root.
        for c in certs.values():
            ref = c["spec"]["issuerRef"]
            self.assertEqual(ref["kind"], "Issuer")
            self.assertIn(ref["name"], issuers)
        ca_issuer = issuers["gtopk-ca"]["spec"]["ca"]["secretName"]
        self.assertTrue(certs[ca_issuer]["spec"]["isCA"])

    def test_gpu_overlay_requests_gpus_and_cpu_does_not(self):
        _, cpu = render("cpu")
        _, gpu = render("gpu")
        for objs, want in ((cpu, None), (gpu, 1)):
            res = container(one(objs, "Job", "gtopk-worker"),
                            "worker")["resources"]
            self.assertEqual(res["requests"].get("nvidia.com/gpu"), want)
            self.assertEqual(res["limits"].get("nvidia.com/gpu"), want)
            shard_res = container(one(objs, "StatefulSet", "gtopk-shard"),
                                  "shard")["resources"]
            self.assertNotIn("nvidia.com/gpu", shard_res["limits"])
        self.assertTrue(container(one(gpu, "Job", "gtopk-worker"), "worker")
                        ["image"].startswith("gtopk-worker-cuda:"))

    def test_gpu_workers_train_with_device_cuda_and_cpu_workers_do_not(self):
        """A container holding a GPU must use it: every worker container of
        the gpu overlay passes --device=cuda, runs the CUDA image and has an
        nvidia.com/gpu limit (= its request, as Kubernetes requires for
        extended resources); the cpu overlay's pass no --device=cuda (absent
        or cpu), run the CPU image and hold no GPU; shards never do."""
        for overlay, gpu in (("cpu", False), ("gpu", True)):
            _, objs = render(overlay)
            job = one(objs, "Job", "gtopk-worker")
            cs = job["spec"]["template"]["spec"]["containers"]
            workers = [c for c in cs if c["image"].split(":")[0] in
                       ("gtopk-worker", "gtopk-worker-cuda")]
            self.assertEqual(len(workers), 1, overlay)
            for c in workers:
                where = "%s overlay, container %s" % (overlay, c["name"])
                device = flag_dict(k8s_args(objs, job, c["name"])).get(
                    "device", "cpu")
                limits = c.get("resources", {}).get("limits", {})
                requests = c.get("resources", {}).get("requests", {})
                if gpu:
                    self.assertEqual(device, "cuda", where)
                    self.assertGreaterEqual(int(limits.get(
                        "nvidia.com/gpu", 0)), 1, where)
                    self.assertEqual(requests.get("nvidia.com/gpu"),
                                     limits["nvidia.com/gpu"], where)
                    self.assertTrue(c["image"].startswith(
                        "gtopk-worker-cuda:"), where)
                else:
                    self.assertEqual(device, "cpu", where)
                    self.assertNotIn("nvidia.com/gpu", limits, where)
                    self.assertNotIn("nvidia.com/gpu", requests, where)
                    self.assertFalse(c["image"].startswith(
                        "gtopk-worker-cuda"), where)
            sts = one(objs, "StatefulSet", "gtopk-shard")
            self.assertNotIn("device", flag_dict(k8s_args(objs, sts,
                                                          "shard")))

    def test_gpu_workers_cuda_cache_is_writable_and_bounded(self):
        """The root filesystem is read-only: the CUDA JIT cache of the gpu
        overlay's workers must lie on one of the pod's emptyDirs, and its
        maximum size must stay below that emptyDir's sizeLimit (a full
        emptyDir evicts the pod)."""
        units = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30}
        _, objs = render("gpu")
        job = one(objs, "Job", "gtopk-worker")
        spec = job["spec"]["template"]["spec"]
        c = container(job, "worker")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        self.assertIn("CUDA_CACHE_PATH", env)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [m for m in c["volumeMounts"]
                  if (env["CUDA_CACHE_PATH"] + "/").startswith(
                      m["mountPath"].rstrip("/") + "/")]
        self.assertEqual(len(mounts), 1, env["CUDA_CACHE_PATH"])
        self.assertFalse(mounts[0].get("readOnly", False))
        empty = volumes[mounts[0]["name"]].get("emptyDir")
        self.assertIsNotNone(empty, "the CUDA cache must be on an emptyDir")
        m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", empty["sizeLimit"])
        self.assertTrue(m, empty["sizeLimit"])
        limit = int(m.group(1)) * units[m.group(2)]
        self.assertLess(int(env["CUDA_CACHE_MAXSIZE"]), limit)


class SchemaTest(unittest.TestCase):
    def validate(self, paths):
        node = need("node")
        if not os.path.isfile(os.path.join(VALIDATE_DIR, "node_modules",
                                           ".gtopk-lock-sha256")):
            raise AssertionError(
                "validator packages not installed in %s: run "
                "`python3 tests/deploy/npm_setup.py %s` (ctest's fixture "
                "deploy_npm_setup does)" % (VALIDATE_DIR, BUILD_DIR))
        return run([node, "validate.mjs"] + list(paths), cwd=VALIDATE_DIR)

    def test_rendered_overlays_pass(self):
        paths = [render(o)[0] for o in OVERLAYS]
        r = self.validate(paths)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("schemas, fields and container rules OK", r.stdout)

    def test_examples_pass(self):
        # The validator has no cert-manager schemas: its objects are
        # checked by KustomizeTest; everything else goes through it as the
        # overlays, the plaintext opt-out over each overlay too.
        paths = []
        for name in K8S_EXAMPLES:
            _, objs = render_example(name)
            path = os.path.join(_rendered_dir(),
                                "example-%s-core.yaml" % name)
            with open(path, "w") as f:
                yaml.safe_dump_all(
                    [o for o in objs if not o["apiVersion"].startswith(
                        "cert-manager.io/")], f)
            paths.append(path)
        paths += [render_plaintext(o)[0] for o in OVERLAYS]
        r = self.validate(paths)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("schemas, fields and container rules OK", r.stdout)

    def test_broken_copies_are_rejected(self):
        """The validator is not a rubber stamp: each break of a rendered
        object is reported."""
        _, objs = render("cpu")
        sts = one(objs, "StatefulSet", "gtopk-shard")
        sm = one(objs, "ServiceMonitor", "gtopk-shard")
        job = one(objs, "Job", "gtopk-worker")

        def shard_c(o):
            return o["spec"]["template"]["spec"]["containers"][0]

        cases = []

        def case(name, base, mutate, expect):
            o = copy.deepcopy(base)
            mutate(o)
            cases.append((name, o, expect))

        case("unknown container field", sts,
             lambda o: shard_c(o).update(resourcez={}), "'\"resourcez\"'")
        case("unknown nested field", sts,
             lambda o: shard_c(o)["startupProbe"]["exec"].update(cmd=[]),
             "'\"cmd\"'")
        case("unknown monitor field", sm,
             lambda o: o["spec"]["endpoints"][0].update(prt="metrics"),
             "'\"prt\"'")
        case("wrong type", sts,
             lambda o: o["spec"].update(replicas="2"),
             "replicas must be integer")
        case("missing required", job,
             lambda o: o["spec"]["template"]["spec"].pop("containers"),
             "must have required property containers")
        case("no liveness probe", sts,
             lambda o: shard_c(o).pop("livenessProbe"), "no livenessProbe")
        case("tcp probe on the grpc port", sts,
             lambda o: shard_c(o).update(
                 readinessProbe={"tcpSocket": {"port": GRPC_PORT}}),
             "readinessProbe must be an exec probe running gtopk-server "
             "--health-check=127.0.0.1:%d --tls=off" % HEALTH_PORT)
        case("no memory limit", job,
             lambda o: shard_c(o)["resources"]["limits"].pop("memory"),
             "no resources.limits.memory")
        case("capabilities kept", job,
             lambda o: shard_c(o)["securityContext"].update(
                 capabilities={"drop": ["NET_RAW"]}),
             "capabilities.drop lacks ALL")
        case("writable root", sts,
             lambda o: shard_c(o)["securityContext"].update(
                 readOnlyRootFilesystem=False),
             "readOnlyRootFilesystem is not true")
        case("privilege escalation", sts,
             lambda o: shard_c(o)["securityContext"].pop(
                 "allowPrivilegeEscalation"),
             "allowPrivilegeEscalation is not false")
        case("unconfined seccomp", job,
             lambda o: (shard_c(o)["securityContext"].update(
                 seccompProfile={"type": "Unconfined"})),
             "seccompProfile.type is not RuntimeDefault")
        case("unknown kind", sm, lambda o: o.update(kind="ServiceMonitr"),
             "no schema for apiVersion")
        # Probes on the health-only port when nothing serves it there:
        # under mutual TLS nothing a probe can check is left.
        case("probes on an unserved health port", sts,
             lambda o: shard_c(o).update(args=[
                 a for a in shard_c(o)["args"]
                 if not a.startswith("--health-listen=")]),
             "readinessProbe: with --tls=mutual and no --health-listen no "
             "probe can check grpc.health.v1")
        # ... and in plaintext: a grpc probe of the gRPC port would do.
        case("plaintext probes on an unserved health port", sts,
             lambda o: shard_c(o).update(args=["--tls=off"] + [
                 a for a in shard_c(o)["args"]
                 if not a.startswith(("--health-listen=", "--tls"))]),
             "readinessProbe must be a grpc probe on port %d or an exec "
             "probe" % GRPC_PORT)

        def set_health_listen(o, value):
            c = shard_c(o)
            c["args"] = [("--health-listen=" + value)
                         if a.startswith("--health-listen=") else a
                         for a in c["args"]]

        def set_probe(o, probe, **fields):
            shard_c(o)[probe].update(fields)

        # The plaintext, unauthenticated health port reachable from the
        # network (docs/resource-limits.md, "Big messages"), even though
        # the exec probes would still work on it.
        case("health port bound to 0.0.0.0", sts,
             lambda o: set_health_listen(o, "0.0.0.0:%d" % HEALTH_PORT),
             "--health-listen=0.0.0.0:%d is not bound to loopback"
             % HEALTH_PORT)
        # The old form: the kubelet's grpc probe dials the pod IP, which
        # the loopback port is not on.
        case("grpc probe on the loopback health port", sts,
             lambda o: shard_c(o).update(livenessProbe={
                 "grpc": {"port": HEALTH_PORT}, "timeoutSeconds": 7}),
             "livenessProbe must be an exec probe running gtopk-server")
        case("exec probe of another port", sts,
             lambda o: set_probe(o, "startupProbe", exec={"command": [
                 "gtopk-server", "--health-check=127.0.0.1:%d" % GRPC_PORT,
                 "--tls=off"]}),
             "startupProbe must be an exec probe running gtopk-server")
        case("exec probe without --tls=off", sts,
             lambda o: set_probe(o, "readinessProbe", exec={"command": [
                 "gtopk-server",
                 "--health-check=127.0.0.1:%d" % HEALTH_PORT]}),
             "readinessProbe must be an exec probe running gtopk-server")
        case("exec probe of another program", sts,
             lambda o: set_probe(o, "readinessProbe", exec={"command": [
                 "true", "--health-check=127.0.0.1:%d" % HEALTH_PORT,
                 "--tls=off"]}),
             "readinessProbe must be an exec probe running gtopk-server")
        case("probe timeout within the check's deadline", sts,
             lambda o: set_probe(o, "livenessProbe", timeoutSeconds=5),
             "livenessProbe.timeoutSeconds is 5: it must exceed")
        case("probe timeout left at the default", sts,
             lambda o: shard_c(o)["readinessProbe"].pop("timeoutSeconds"),
             "readinessProbe.timeoutSeconds is 1 (the default)")

        # One validator run over every case (tsc starts once); each case is
        # its own file and its problems are reported under its name.
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for i, (name, obj, _) in enumerate(cases):
                paths.append(os.path.join(tmp, "case%d.yaml" % i))
                with open(paths[-1], "w") as f:
                    json.dump(obj, f)  # JSON is YAML
            r = self.validate(paths)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        for path, (name, _, expect) in zip(paths, cases):
            with self.subTest(case=name):
                lines = [l for l in r.stderr.splitlines()
                         if l.startswith(path + ":")]
                self.assertTrue(any(expect in l for l in lines),
                                "%s: %r not among %s" % (name, expect, lines))


class PromtoolTest(unittest.TestCase):
    def test_every_prometheus_config_checks(self):
        exe = need("promtool")
        configs = sorted(glob.glob(os.path.join(DEPLOY, "prometheus",
                                                "*.yml")))
        self.assertTrue(configs)
        for path in configs:
            r = run([exe, "check", "config", path])
            self.assertEqual(r.returncode, 0, "%s:\n%s%s" % (
                path, r.stdout, r.stderr))
            self.assertIn("SUCCESS", r.stdout + r.stderr)

    def test_promtool_rejects_an_unknown_field(self):
        exe = need("promtool")
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            f.write("scrape_configs:\n  - job_name: x\n    static_cfgs: []\n")
            f.flush()
            self.assertNotEqual(run([exe, "check", "config",
                                     f.name]).returncode, 0)


def dockerfile_flags(path):
    """(binary -> [argv]) from the exec-form ENTRYPOINT/CMD/HEALTHCHECK lines
    of a Dockerfile, per stage."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    used = []
    entry = None
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"FROM\s", line)
        if m:
            entry = None
        m = re.match(r"ENTRYPOINT\s+(\[.*\])", line)
        if m:
            entry = json.loads(m.group(1))
        m = re.match(r"CMD\s+(\[.*\])", line)
        if m and entry:
            used.append(entry + json.loads(m.group(1)))
        m = re.match(r"HEALTHCHECK\s.*CMD\s+(\[.*\])", line)
        if m:
            used.append(json.loads(m.group(1)))
    return used


def dockerfile_stages(path):
    """{stage: {"from": image or stage, "packages": [apt-get installed],
    "lines": [instructions]}} of a Dockerfile (continuations joined)."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    stages = {"global": {"from": None, "packages": [], "lines": []}}
    current = "global"  # ARGs before the first FROM
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or "stage%d" % len(stages)
            stages[current] = {"from": m.group(1), "packages": [],
                               "lines": []}
            continue
        stages[current]["lines"].append(line)
        for seg in re.findall(r"apt-get install\s+(.*?)(?:&&|$)", line):
            stages[current]["packages"] += [t for t in seg.split()
                                            if not t.startswith("-")]
    return stages


_dpkg_db = {}


def dpkg_db():
    """{package: (depends, provides)} of the installed packages, and the
    map virtual name -> providers; one dpkg-query call."""
    if not _dpkg_db:
        r = run(["dpkg-query", "-W", "-f=${Package}\t${Status}\t${Depends}, "
                 "${Pre-Depends}\t${Provides}\n"])
        pkgs, provides = {}, {}

        def names(field):
            out = []
            for alt in field.split(","):
                for name in alt.split("|"):
                    name = re.sub(r"\(.*?\)|:any", "", name).strip()
                    if name:
                        out.append(name)
            return out

        for line in r.stdout.splitlines():
            name, status, deps, prov = (line.split("\t") + ["", "", ""])[:4]
            if "install ok installed" not in status:
                continue
            pkgs[name] = names(deps)
            for v in names(prov):
                provides.setdefault(v, []).append(name)
        _dpkg_db["pkgs"], _dpkg_db["provides"] = pkgs, provides
    return _dpkg_db["pkgs"], _dpkg_db["provides"]


def installed_closure(packages):
    """The packages plus everything they depend on, transitively, among the
    packages installed here (dpkg's Depends and Pre-Depends; any installed
    alternative or provider counts)."""
    pkgs, provides = dpkg_db()
    seen = set()
    todo = list(packages)
    while todo:
        name = todo.pop()
        for pkg in [name] + provides.get(name, []):
            if pkg in pkgs and pkg not in seen:
                seen.add(pkg)
                todo.extend(pkgs[pkg])
    return seen


CUDA_TOOLKIT_PREFIX = "/usr/local/cuda"


def library_owners(binary):
    """Debian packages owning the shared libraries `binary` loads
    ({package: library})."""
    r = run(["ldd", binary])
    libs = re.findall(r"=>\s+(/\S+)", r.stdout)
    candidates = {}
    for lib in libs:
        real = os.path.realpath(lib)
        if real.startswith(CUDA_TOOLKIT_PREFIX):
            # A build tree configured where nvcc exists links the CUDA
            # runtime; the CPU image builds with -DGTOPK_CUDA=OFF (asserted
            # in test_cpu_image_builds_without_cuda) and the CUDA image
            # (Dockerfile.cuda) brings these libraries from its base.
            continue
        paths = {lib, real}
        for p in list(paths):  # merged /usr: dpkg may know either spelling
            if p.startswith("/usr/lib/"):
                paths.add(p[len("/usr"):])
            elif p.startswith("/lib/"):
                paths.add("/usr" + p)
        candidates[lib] = paths
    every = sorted(set().union(*candidates.values())) if candidates else []
    q = run(["dpkg", "-S"] + every)
    owner_of = {}
    for line in q.stdout.splitlines():
        pkg, _, path = line.partition(": ")
        owner_of[path.strip()] = pkg.split(":")[0].split(",")[0].strip()
    owners = {}
    for lib, paths in candidates.items():
        found = [owner_of[p] for p in paths if p in owner_of]
        if not found:
            raise AssertionError("%s: %s belongs to no Debian package" % (
                binary, lib))
        owners[found[0]] = lib
    return owners


def python_extension():
    """The built extension gtopk._gtopk (`make python`)."""
    found = glob.glob(os.path.join(PYTHON_BUILD_DIR, "gtopk", "_gtopk*.so"))
    if len(found) != 1:
        raise AssertionError("%s/gtopk/_gtopk*.so not built: run `make "
                             "python` (pybind11-dev, python3-dev)"
                             % PYTHON_BUILD_DIR)
    return found[0]


class DockerfileTest(unittest.TestCase):
    """What can be checked of the images without a Docker engine."""

    def setUp(self):
        self.cpu = dockerfile_stages(os.path.join(DEPLOY, "docker",
                                                  "Dockerfile"))
        self.cuda = dockerfile_stages(os.path.join(DEPLOY, "docker",
                                                   "Dockerfile.cuda"))

    def packages(self, stages, stage):
        pkgs = []
        while stage in stages:
            pkgs += stages[stage]["packages"]
            stage = stages[stage]["from"]
        return pkgs

    def test_bases_and_stages(self):
        self.assertTrue(self.cpu["build"]["from"].startswith("debian:"))
        self.assertEqual(self.cpu["runtime-base"]["from"],
                         "debian:${DEBIAN_RELEASE}-slim")
        self.assertIn("DEBIAN_RELEASE=bookworm", open(os.path.join(
            DEPLOY, "docker", "Dockerfile")).read())
        self.assertTrue(self.cuda["build"]["from"].startswith("nvidia/cuda:"))
        self.assertTrue(self.cuda["worker"]["from"].startswith("nvidia/cuda:"))
        cuda_build = " ".join(self.cuda["build"]["lines"])
        self.assertIn("-DGTOPK_CUDA=ON", cuda_build)

    def copies(self, stages, stage):
        """[(from or None, [sources], dest)] of the stage's COPY lines."""
        out = []
        for l in stages[stage]["lines"]:
            if not l.startswith("COPY "):
                continue
            words = l.split()[1:]
            frm = None
            opts = [w for w in words if w.startswith("--")]
            for o in opts:
                if o.startswith("--from="):
                    frm = o[len("--from="):]
            paths = [w for w in words if not w.startswith("--")]
            out.append((frm, paths[:-1], paths[-1]))
        return out

    def test_cuda_image_builds_against_the_copied_libtorch(self):
        """Dockerfile.cuda: the libtorch comes from the named context
        `libtorch` (a stage of that name, empty by default, that
        --build-context libtorch=DIR replaces), CMake finds it through
        Torch_DIR at the copied directory, with the CUDA kernels on; Ubuntu's
        CPU-only libtorch is not installed; nothing is downloaded."""
        path = os.path.join(DEPLOY, "docker", "Dockerfile.cuda")
        with open(path) as f:
            text = f.read()
        self.assertEqual(self.cuda["libtorch"]["from"], "scratch")
        self.assertEqual(self.cuda["libtorch"]["lines"], [])
        dests = [d for frm, srcs, d in self.copies(self.cuda, "build")
                 if frm == "libtorch" and srcs == ["/"]]
        self.assertEqual(len(dests), 1, "the build stage copies the libtorch "
                         "context once, whole")
        libtorch = dests[0].rstrip("/")
        build = " ".join(self.cuda["build"]["lines"])
        self.assertIn("-DGTOPK_CUDA=ON", build)
        torch_dirs = re.findall(r"-DTorch_DIR=(\S+)", build)
        self.assertEqual(torch_dirs, [libtorch + "/share/cmake/Torch"])
        # The build refuses a missing, CPU-only or old-ABI libtorch.
        self.assertIn("test -f %s/share/cmake/Torch/TorchConfig.cmake"
                      % libtorch, build)
        self.assertIn("%s/lib/libtorch_cuda.so" % libtorch, build)
        self.assertIn("_GLIBCXX_USE_CXX11_ABI=1", build)
        for stage in self.cuda:
            self.assertFalse([p for p in self.cuda[stage]["packages"]
                              if p.startswith("libtorch")],
                             "%s installs a distribution libtorch (CPU-only)"
                             % stage)
        # No download: no URL, no fetching tool, no ADD (which fetches).
        code = "\n".join(l for st in self.cuda.values() for l in st["lines"])
        self.assertNotRegex(text, r"(?i)https?://|ftp://")
        self.assertNotRegex(code, r"(?m)\b(curl|wget|git clone|pip)\b|^ADD ")
        self.assertIn("--build-context libtorch=", text)

    def test_cuda_runtime_stage_has_the_libtorch_libraries(self):
        """The runtime stage copies libtorch's lib/ to the path the build
        linked against (the binary's RUNPATH) before it checks, with
        ldd-check.sh, that every library of the installed binary resolves
        and that libtorch's come from there."""
        build_dest = [d for frm, srcs, d in self.copies(self.cuda, "build")
                      if frm == "libtorch"][0].rstrip("/")
        want_lib = build_dest + "/lib"
        copies = self.copies(self.cuda, "worker")
        lib_copies = [i for i, (frm, srcs, d) in enumerate(copies)
                      if d.rstrip("/") == want_lib and (
                          (frm == "libtorch" and
                           [s.strip("/") for s in srcs] == ["lib"]) or
                          (frm == "build" and
                           [s.rstrip("/") for s in srcs] == [want_lib]))]
        self.assertEqual(len(lib_copies), 1, "the worker stage must copy "
                         "libtorch's lib/ to %s: %s" % (want_lib, copies))
        binary = [i for i, (frm, srcs, d) in enumerate(copies)
                  if frm == "build" and srcs == ["/build/worker/gtopk-worker"]
                  and d == "/usr/local/bin/gtopk-worker"]
        self.assertEqual(len(binary), 1)
        # The libtorch module (the one file that links libtorch), where
        # gtopk-worker looks for it: ../lib/gtopk/ from its directory
        # (worker/trainer/torch_module.h).
        module = [i for i, (frm, srcs, d) in enumerate(copies)
                  if frm == "build" and srcs == [BUILT_TORCH_MODULE]
                  and d == MODULE_IN_IMAGE]
        self.assertEqual(len(module), 1, copies)
        check = [(i, d) for i, (frm, srcs, d) in enumerate(copies)
                 if frm is None and srcs == ["deploy/docker/ldd-check.sh"]]
        self.assertEqual(len(check), 1)
        check_bin = check[0][1]
        lines = self.cuda["worker"]["lines"]
        runs = [l for l in lines if l.startswith("RUN ") and
                os.path.basename(check_bin) in l]
        self.assertEqual(len(runs), 1)
        commands = [shlex.split(c) for c in runs[0][len("RUN "):].split("&&")]
        checked = {argv[1]: argv[2:] for argv in commands
                   if argv[0] == os.path.basename(check_bin)}
        self.assertEqual(set(checked), {"/usr/local/bin/gtopk-worker",
                                        MODULE_IN_IMAGE}, commands)
        for lib in ("libtorch.so", "libtorch_cuda.so", "libc10.so",
                    "libc10_cuda.so"):
            self.assertIn("%s=%s" % (lib, want_lib), checked[MODULE_IN_IMAGE])
        # The check runs after the copies.
        copy_lines = [l for l in lines if l.startswith("COPY ")]
        run_at = lines.index(runs[0])
        for i in lib_copies + binary + module + [check[0][0]]:
            self.assertLess(lines.index(copy_lines[i]), run_at)
        # The runtime packages come from the binary's and the module's ldd.
        build = " ".join(self.cuda["build"]["lines"])
        self.assertRegex(build, r"ldd /build/worker/gtopk-worker +%s"
                         % re.escape(BUILT_TORCH_MODULE))

    def test_cpu_worker_stage_has_the_libtorch_module(self):
        """Dockerfile's worker stage: gtopk-worker in /usr/local/bin and its
        libtorch module in /usr/local/lib/gtopk/, where the worker looks
        (../lib/gtopk/ from its directory), both stripped in the build
        stage; Debian's libtorch1.13, which the module links, installed."""
        copies = self.copies(self.cpu, "worker")
        self.assertIn(("build", ["/build/worker/gtopk-worker"],
                       "/usr/local/bin/gtopk-worker"), copies)
        self.assertIn(("build", [BUILT_TORCH_MODULE], MODULE_IN_IMAGE),
                      copies)
        self.assertIn("libtorch1.13", self.packages(self.cpu, "worker"))
        # The image checks that both resolve their libraries, after the
        # copies.
        lines = self.cpu["worker"]["lines"]
        checks = [i for i, l in enumerate(lines) if l.startswith("RUN ") and
                  "ldd /usr/local/bin/gtopk-worker %s" % MODULE_IN_IMAGE in l
                  and '! ' in l and 'grep "not found"' in l]
        self.assertEqual(len(checks), 1, lines)
        copies = [i for i, l in enumerate(lines) if l.startswith("COPY ")]
        self.assertLess(max(copies), checks[0])
        build = " ".join(self.cpu["build"]["lines"])
        self.assertRegex(build, r"strip [^&]*%s" % re.escape(BUILT_TORCH_MODULE))
        self.assertTrue(os.path.isfile(os.path.join(
            BUILD_DIR, "worker", "libgtopk_torch_model.so")),
            "the build makes the module the images copy")

    def test_ldd_check_finds_missing_and_misplaced_libraries(self):
        """deploy/docker/ldd-check.sh against a program linking a library of
        our own (RUNPATH to its directory): passes while it resolves, fails
        when it is gone or comes from another directory; passes on the
        built gtopk-worker."""
        script = os.path.join(DEPLOY, "docker", "ldd-check.sh")
        cc = shutil.which("cc") or shutil.which("gcc")
        self.assertIsNotNone(cc, "a C compiler (build-essential)")
        with tempfile.TemporaryDirectory() as tmp:
            libdir = os.path.join(tmp, "opt", "lib")
            os.makedirs(libdir)
            with open(os.path.join(tmp, "f.c"), "w") as f:
                f.write("int gtopk_f(void) { return 7; }\n")
            with open(os.path.join(tmp, "m.c"), "w") as f:
                f.write("int gtopk_f(void);\nint main(void) "
                        "{ return gtopk_f() - 7; }\n")
            lib = os.path.join(libdir, "libgtopkf.so")
            exe = os.path.join(tmp, "prog")
            for argv in ([cc, "-shared", "-fPIC", "-o", lib,
                          os.path.join(tmp, "f.c")],
                         [cc, "-o", exe, os.path.join(tmp, "m.c"), "-L",
                          libdir, "-lgtopkf", "-Wl,-rpath," + libdir]):
                r = run(argv)
                self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(run([exe]).returncode, 0)

            def check(*args):
                return run(["sh", script, exe] + list(args))
            r = check("libgtopkf.so=" + libdir)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = check("libgtopkf.so=" + tmp)
            self.assertEqual(r.returncode, 1)
            self.assertIn("loads libgtopkf.so from %s, not from %s" % (
                lib, tmp), r.stderr)
            r = check("libnotthere.so=" + libdir)
            self.assertEqual(r.returncode, 1)
            self.assertIn("does not load libnotthere.so", r.stderr)
            self.assertEqual(check("libgtopkf.so").returncode, 2)
            os.remove(lib)
            r = check()
            self.assertEqual(r.returncode, 1)
            self.assertIn("libgtopkf.so => not found", r.stderr)
        self.assertTrue(os.access(WORKER_BIN, os.X_OK), WORKER_BIN)
        r = run(["sh", script, WORKER_BIN])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        module = os.path.join(BUILD_DIR, "worker", "libgtopk_torch_model.so")
        r = run(["sh", script, module])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def instruction(self, stages, stage, keyword):
        """The stage's last KEYWORD instruction as exec-form JSON (None
        when it has none)."""
        found = [l for l in stages[stage]["lines"]
                 if l.startswith(keyword + " ")]
        return json.loads(found[-1][len(keyword) + 1:]) if found else None

    def test_python_worker_stage(self):
        """Target python-worker: FROM the worker stage (the libtorch layers
        shared, the dataset there), Debian's python3/python3-torch/
        python3-numpy without recommends, the example where compose runs
        it, ENTRYPOINT python3 with the example's --help as the default
        command, the state directories of runtime-base, GTOPK_METRICS_PORT
        = the health-checked port; the server and worker stages untouched
        by it (their entrypoints)."""
        st = self.cpu["python-worker"]
        self.assertEqual(st["from"], "worker")
        self.assertTrue({"python3", "python3-torch", "python3-numpy"} <=
                        set(st["packages"]), st["packages"])
        self.assertEqual(self.instruction(self.cpu, "python-worker",
                                          "ENTRYPOINT"), ["python3"])
        self.assertEqual(self.instruction(self.cpu, "python-worker", "CMD"),
                         [EXAMPLE_IN_IMAGE, "--help"])
        self.assertEqual(self.instruction(self.cpu, "worker", "ENTRYPOINT"),
                         ["gtopk-worker"])
        self.assertEqual(self.instruction(self.cpu, "server", "ENTRYPOINT"),
                         ["gtopk-server"])
        copies = self.copies(self.cpu, "python-worker")
        self.assertIn((None, [os.path.relpath(EXAMPLE, ROOT)],
                       EXAMPLE_IN_IMAGE), copies)
        env = " ".join(l for l in st["lines"] if l.startswith("ENV "))
        self.assertIn("GTOPK_METRICS_PORT=%d" % WORKER_METRICS_PORT, env)
        self.assertIn("PYTHONUNBUFFERED=1", env)  # progress in docker logs
        # Built-in checks: the package imports, the example runs.
        runs = " ".join(l for l in st["lines"] if l.startswith("RUN "))
        self.assertIn("import gtopk, gtopk.torch", runs)
        self.assertIn("python3 %s --help" % EXAMPLE_IN_IMAGE, runs)
        # The state directories (and the user) come from runtime-base.
        base = " ".join(self.cpu["runtime-base"]["lines"])
        for d in ("/var/lib/gtopk/checkpoints", "/var/lib/gtopk/run"):
            self.assertIn(d, base)

    def test_python_package_is_the_wheel(self):
        """The build stage makes the wheel as Python users do (docs/python.md):
        `pip wheel --no-build-isolation` of python/
        with Debian's setuptools/wheel, reusing the stage's CMake build
        (GTOPK_BUILD_DIR=/build, where gtopk_python was built); the
        python-worker stage copies the wheel folder and pip-installs it
        offline into /usr/bin/python3's default sys.path, which compileall
        then byte-compiles. That this pip command puts the package on the
        default sys.path, and that the wheel imports, is checked for real
        by tests/python/packaging_test.py (ctest -L packaging)."""
        build = " ".join(self.cpu["build"]["lines"])
        self.assertIn("-DGTOPK_PYTHON=ON", build)
        self.assertRegex(build, r"--target [\w ]*\bgtopk_python\b")
        self.assertTrue({"python3-pip", "python3-setuptools",
                         "python3-wheel"} <= set(self.cpu["build"]["packages"]))
        m = re.search(r"GTOPK_BUILD_DIR=/build python3 -m pip wheel "
                      r"((?:--\S+ +)+)-w (\S+) \./python\b", build)
        self.assertTrue(m, "the build stage makes the wheel with pip wheel")
        flags, wheels = m.group(1).split(), m.group(2).rstrip("/")
        for flag in ("--no-build-isolation", "--no-deps", "--no-index"):
            self.assertIn(flag, flags)
        self.assertTrue(os.path.exists(os.path.join(ROOT, "python",
                                                    "setup.py")))
        self.assertTrue(os.path.exists(os.path.join(ROOT, "python",
                                                    "pyproject.toml")))
        copies = [(srcs, d) for frm, srcs, d in
                  self.copies(self.cpu, "python-worker") if frm == "build"]
        self.assertEqual(len(copies), 1, copies)
        (src,), dest = copies[0]
        self.assertEqual(src.rstrip("/"), wheels)
        st = self.cpu["python-worker"]
        self.assertIn("python3-pip", st["packages"])
        runs = [l for l in st["lines"] if l.startswith("RUN ")]
        installs = [l for l in runs if "pip install" in l]
        self.assertEqual(len(installs), 1, installs)
        m = re.search(r"python3 -m pip install ((?:--\S+ +)+)(\S+)",
                      installs[0])
        self.assertTrue(m, installs[0])
        for flag in ("--no-index", "--no-deps", "--break-system-packages"):
            self.assertIn(flag, m.group(1).split())
        self.assertTrue(fnmatch.fnmatch(
            dest.rstrip("/") + "/gtopk-0.1.0-cp311-cp311-linux_x86_64.whl",
            m.group(2)), m.group(2))
        # Installed before it is byte-compiled and imported.
        text = " ".join(runs)
        self.assertLess(text.index("pip install"), text.index("compileall"))
        globs = re.findall(r"compileall -q (\S+)", text)
        self.assertEqual(len(globs), 1)
        self.assertTrue(fnmatch.fnmatch(
            "/usr/local/lib/python3.11/dist-packages/gtopk", globs[0]))

    def test_every_copy_source_exists(self):
        """Every COPY from the build context names a path that exists in
        the repository and that .dockerignore does not exclude."""
        with open(os.path.join(ROOT, ".dockerignore")) as f:
            ignored = [l.strip().rstrip("/") for l in f
                       if l.strip() and not l.startswith("#")]
        for name, stages in (("Dockerfile", self.cpu),
                             ("Dockerfile.cuda", self.cuda)):
            for stage in stages:
                for frm, srcs, _ in self.copies(stages, stage):
                    if frm is not None:
                        continue
                    for src in srcs:
                        where = "%s stage %s: COPY %s" % (name, stage, src)
                        self.assertTrue(os.path.exists(os.path.join(ROOT,
                                                                    src)),
                                        where)
                        parts = src.strip("/").split("/")
                        for pat in ignored:
                            if pat.startswith("**/"):  # at any depth
                                hit = any(fnmatch.fnmatch(p, pat[3:])
                                          for p in parts)
                            else:  # from the context's root
                                hit = any(fnmatch.fnmatch(
                                    "/".join(parts[:i + 1]), pat)
                                    for i in range(len(parts)))
                            self.assertFalse(hit, "%s is excluded by "
                                             ".dockerignore (%s)" % (where,
                                                                     pat))

    def test_every_package_is_a_debian_package(self):
        """Every package a stage of the Debian Dockerfile installs exists in
        Debian 12 (installed here, or known to apt), and apt installs no
        recommends (python3-torch would pull in libtorch-dev and
        build-essential)."""
        r = run(["dpkg-query", "-W", "-f=${Package}\n"])
        installed = set(r.stdout.split())
        for stage, st in self.cpu.items():
            for line in st["lines"]:
                if "apt-get install" in line:
                    self.assertIn("--no-install-recommends", line, stage)
            for pkg in st["packages"]:
                if pkg in installed:
                    continue
                r = run(["apt-cache", "show", "--no-all-versions", pkg])
                self.assertTrue(r.returncode == 0 and r.stdout.strip(),
                                "%s stage installs %s, which is neither "
                                "installed here nor known to apt" % (stage,
                                                                      pkg))

    def test_cpu_image_builds_without_cuda(self):
        # library_owners skips the CUDA toolkit's libraries on that basis.
        self.assertIn("-DGTOPK_CUDA=OFF", " ".join(self.cpu["build"]["lines"]))

    def test_images_run_as_the_non_root_user_of_the_manifests(self):
        for stages, stage in ((self.cpu, "server"), (self.cpu, "worker"),
                              (self.cpu, "python-worker"),
                              (self.cuda, "worker")):
            users = []
            s = stage
            while s in stages:
                users = [l.split()[1] for l in stages[s]["lines"]
                         if l.startswith("USER ")] or users
                if users:
                    break
                s = stages[s]["from"]
            self.assertEqual(users[-1], "10001:10001", stage)
        for overlay in OVERLAYS:
            _, objs = render(overlay)
            for kind in ("StatefulSet", "Job"):
                for o in find(objs, kind):
                    psc = o["spec"]["template"]["spec"]["securityContext"]
                    self.assertEqual((psc["runAsUser"], psc["runAsGroup"]),
                                     (10001, 10001))

    def test_sources_and_targets_exist(self):
        """The build stages copy every folder CMake adds (python/ when the
        stage configures -DGTOPK_PYTHON=ON; tests/ and bench/ are off) and
        build targets that exist."""
        with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
            top = f.read()
        subdirs = set(re.findall(r"^add_subdirectory\((\w+)\)", top, re.M))
        conditional = set(re.findall(r"^\s+add_subdirectory\((\w+)\)", top,
                                     re.M))
        self.assertIn("python", conditional)
        targets = set()
        for cm in glob.glob(os.path.join(ROOT, "*", "CMakeLists.txt")):
            with open(cm) as f:
                targets |= set(re.findall(
                    r"(?:add_executable|pybind11_add_module)\((\w+)",
                    f.read()))
        self.assertIn("gtopk_python", targets)
        for name, stages in (("Dockerfile", self.cpu),
                             ("Dockerfile.cuda", self.cuda)):
            build = " ".join(stages["build"]["lines"])
            copied = set(re.findall(r"COPY (\w+) \1", build))
            want = set(subdirs)
            if "-DGTOPK_PYTHON=ON" in build:
                want.add("python")
            self.assertEqual(copied, want, "%s copies %s; CMake needs %s"
                             % (name, sorted(copied), sorted(want)))
            self.assertIn("-DGTOPK_BUILD_TESTS=OFF", build)
            self.assertIn("-DGTOPK_BUILD_BENCH=OFF", build)
            built = re.findall(r"--target ([\w ]+?) (?:&&|$)", build)
            self.assertTrue(built, name)
            for t in " ".join(built).split():
                self.assertIn(t, targets, "%s builds unknown target %s" % (
                    name, t))

    def test_build_packages_are_the_projects(self):
        with open(os.path.join(ROOT, "Makefile")) as f:
            m = re.search(r"^DEB_PACKAGES :=(.*?)\n\n", f.read(), re.M | re.S)
        make = set(m.group(1).replace("\\", " ").split())
        self.assertTrue(set(self.cpu["build"]["packages"]) <= make,
                        set(self.cpu["build"]["packages"]) - make)

    def test_runtime_stages_provide_every_library(self):
        """Each library the built binaries load is owned by a package the
        runtime stage installs or one they depend on (or by the slim base:
        the Essential packages and apt), as resolved on this Debian 12."""
        r = run(["dpkg-query", "-W", "-f=${Package} ${Essential}\n"])
        essential = [l.split()[0] for l in r.stdout.splitlines()
                     if l.endswith(" yes")]
        base = installed_closure(essential + ["apt"])
        extension = python_extension()
        module = os.path.join(BUILD_DIR, "worker", "libgtopk_torch_model.so")
        for stage, binary in (("server", SERVER_BIN), ("worker", WORKER_BIN),
                              ("worker", module),
                              ("python-worker", WORKER_BIN),
                              ("python-worker", extension)):
            with self.subTest(stage=stage, binary=os.path.basename(binary)):
                self.assertTrue(os.path.isfile(binary), binary)
                pkgs = self.packages(self.cpu, stage)
                provided = installed_closure(pkgs) | base
                missing = {p: lib for p, lib in
                           library_owners(binary).items()
                           if p not in provided}
                self.assertEqual(missing, {}, "the %s image lacks the "
                                 "packages of these libraries" % stage)
        self.assertIn("dataset-fashion-mnist",
                      self.packages(self.cpu, "worker"))
        self.assertNotIn("libtorch1.13", self.packages(self.cpu, "server"))
        # The example's and gtopk.torch's imports (python3-torch depends on
        # python3-numpy; named anyway, the extension uses it directly).
        py = installed_closure(self.packages(self.cpu, "python-worker"))
        for pkg in ("python3", "python3-torch", "python3-numpy",
                    "dataset-fashion-mnist", "libtorch1.13"):
            self.assertIn(pkg, py)

    def test_health_checks_and_ports(self):
        def lines(stages, stage, prefix):
            return [l for l in stages[stage]["lines"] if l.startswith(prefix)]
        self.assertEqual(lines(self.cpu, "server", "EXPOSE"),
                         ["EXPOSE %d %d" % (GRPC_PORT, SERVER_METRICS_PORT)])
        self.assertEqual(lines(self.cpu, "worker", "EXPOSE"),
                         ["EXPOSE %d" % WORKER_METRICS_PORT])
        hc = lines(self.cpu, "server", "HEALTHCHECK")
        self.assertEqual(len(hc), 1)
        self.assertIn('["gtopk-server", "--health-check=127.0.0.1:%d", '
                      '"--tls=off"]' % GRPC_PORT, hc[0])
        # The Python worker: the C++ worker's port and health check (the
        # metrics endpoint), stated in its own stage.
        self.assertEqual(lines(self.cpu, "python-worker", "EXPOSE"),
                         ["EXPOSE %d" % WORKER_METRICS_PORT])
        whc = lines(self.cpu, "worker", "HEALTHCHECK")
        self.assertEqual(len(whc), 1)
        self.assertIn("/dev/tcp/127.0.0.1/%d" % WORKER_METRICS_PORT, whc[0])
        self.assertEqual(lines(self.cpu, "python-worker", "HEALTHCHECK"), whc)

    def test_kubernetes_exec_probes_find_their_binary(self):
        """The shards' exec probes run `gtopk-server` by name: the server
        stage installs it in /usr/local/bin, on the default PATH of the
        Debian base (no ENV PATH override), and the shard container runs
        that image."""
        copies = [l for l in self.cpu["server"]["lines"]
                  if l.startswith("COPY ")]
        self.assertIn("COPY --from=build /build/server/gtopk-server "
                      "/usr/local/bin/gtopk-server", copies)
        for stage in ("runtime-base", "server"):
            self.assertFalse([l for l in self.cpu[stage]["lines"]
                              if re.match(r"ENV\s+PATH\b", l)], stage)
        for overlay in OVERLAYS:
            _, objs = render(overlay)
            shard = container(one(objs, "StatefulSet", "gtopk-shard"),
                              "shard")
            self.assertTrue(shard["image"].startswith("gtopk-server:"),
                            shard["image"])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                self.assertEqual(shard[probe]["exec"]["command"][0],
                                 "gtopk-server", (overlay, probe))


class FlagsTest(unittest.TestCase):
    def test_entrypoints_help(self):
        """Both image entrypoints run and print Abseil's usage. Abseil
        20220623 ends --help and --helpfull with exit code 1."""
        for binary in (SERVER_BIN, WORKER_BIN):
            self.assertTrue(os.access(binary, os.X_OK),
                            "%s not built (make build; the worker needs "
                            "libtorch-dev)" % binary)
            for flag in ("--help", "--helpfull"):
                r = run([binary, flag], timeout=30)
                self.assertIn(r.returncode, (0, 1), r.stdout + r.stderr)
                self.assertRegex(r.stdout + r.stderr,
                                 r"Try --helpfull|Flags from")
            self.assertIn("Flags from", run([binary, "--helpfull"]).stdout)
        # The python-worker image's default command: the example's usage.
        r = run([SYSTEM_PYTHON, EXAMPLE, "--help"], env=example_env(),
                timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("usage:", r.stdout)

    def test_every_flag_used_exists(self):
        # "example": the PyTorch example's argparse flags (gtopk-worker's
        # names), for the python-worker image and `--worker python`.
        known = {"gtopk-server": binary_flags(SERVER_BIN),
                 "gtopk-worker": binary_flags(WORKER_BIN),
                 "example": example_flags()}
        uses = []  # (where, binary, argv)
        python_workers = 0
        for variant in (False, True):
            for name, svc in compose_config(variant)["services"].items():
                where = "compose%s %s" % (" (python)" if variant else "",
                                          name)
                image = svc.get("image", "")
                for binary in ("gtopk-server", "gtopk-worker"):
                    if image.startswith(binary + ":"):
                        uses.append((where, binary, compose_command(svc)))
                if image.startswith("gtopk-python-worker:"):
                    cmd = compose_command(svc)
                    self.assertEqual(cmd[0], EXAMPLE_IN_IMAGE, where)
                    uses.append((where, "example", cmd[1:]))
                    python_workers += 1
                test = svc.get("healthcheck", {}).get("test", [])
                if len(test) > 1 and test[1] in known:
                    uses.append(("%s healthcheck" % where, test[1],
                                 test[2:]))
        self.assertEqual(python_workers,
                         int(read_env()["GTOPK_WORKERS"]))
        for overlay in OVERLAYS:
            _, objs = render(overlay)
            for kind, name, cname, binary in (
                    ("StatefulSet", "gtopk-shard", "shard", "gtopk-server"),
                    ("Job", "gtopk-worker", "worker", "gtopk-worker")):
                obj = one(objs, kind, name)
                self.assertIn(binary, container(obj, cname)["image"].replace(
                    "gtopk-worker-cuda", "gtopk-worker"))
                uses.append(("k8s %s %s" % (overlay, name), binary,
                             k8s_args(objs, obj, cname)))
                # Exec probes run a binary of the image (the shards'
                # gtopk-server --health-check).
                for probe in ("startupProbe", "readinessProbe",
                              "livenessProbe"):
                    cmd = container(obj, cname).get(probe, {}).get(
                        "exec", {}).get("command", [])
                    if cmd and cmd[0] in known:
                        uses.append(("k8s %s %s %s" % (overlay, name, probe),
                                     cmd[0], cmd[1:]))
        for df in glob.glob(os.path.join(DEPLOY, "docker", "Dockerfile*")):
            for argv in dockerfile_flags(df):
                if argv[0] in known:
                    uses.append((os.path.relpath(df, ROOT), argv[0],
                                 argv[1:]))
                elif argv[:2] == ["python3", EXAMPLE_IN_IMAGE]:
                    uses.append((os.path.relpath(df, ROOT), "example",
                                 argv[2:]))
        server, worker = launcher_argv()
        uses.append(("gtopk_local.py --config", "gtopk-server", server))
        uses.append(("gtopk_local.py --config", "gtopk-worker", worker))
        _, py_worker = launcher_argv(["--worker", "python"])
        self.assertEqual(os.path.basename(py_worker[0]),
                         os.path.basename(EXAMPLE))
        uses.append(("gtopk_local.py --worker python", "example",
                     py_worker[1:]))
        self.assertGreaterEqual(len(uses), 10)
        for where, binary, argv in uses:
            for flag in flag_dict(argv):
                self.assertIn(flag, known[binary], "%s passes --%s, which "
                              "%s does not define" % (where, flag, binary))

    def test_example_parses_the_compose_python_workers_flags(self):
        """The values too (argparse types and choices, the script's own
        checks): the example run with worker-0's command of the Python
        variant gets past its flags and fails only where this machine is
        not the container, at the data directory (moved to one that does
        not exist; the summary to a temporary directory), before any
        connection."""
        svc = compose_config(python=True)["services"]["worker-0"]
        f = flag_dict(compose_command(svc)[1:])
        with tempfile.TemporaryDirectory() as tmp:
            missing = os.path.join(tmp, "no-data")
            f.update(data_dir=missing,
                     summary_json=os.path.join(tmp, "worker-0.json"))
            argv = ["--%s=%s" % (k.replace("_", "-"), v) if v is not None
                    else "--" + k.replace("_", "-") for k, v in f.items()]
            r = run([SYSTEM_PYTHON, EXAMPLE] + argv, env=example_env(),
                    timeout=120)
        out = r.stdout + r.stderr
        self.assertNotIn("usage:", out)
        self.assertEqual(r.returncode, 1, out)
        self.assertIn("NOT_FOUND: %s" % missing, out)

    def test_compose_cluster_runs_with_the_deployed_flags(self):
        """The compose shards' and workers' flags, by default (mutual TLS,
        certificates from the set-up step deploy/tls/compose-certs.sh) and
        with the plaintext opt-out; only the addresses, the metrics ports,
        the checkpoint and summary paths and the model (synthetic:N, a few
        steps) changed, the certificate paths moved from /etc/gtopk/tls to
        the service's directory: every shard starts, answers SERVING to the
        compose HEALTHCHECK (under mTLS it presents the shard's certificate,
        and a plaintext check of the same port fails), serves /metrics; the
        P workers train and agree on the checksum with the servers; the
        shards exit 0 on SIGTERM."""
        for plaintext in (False, True):
            with self.subTest(plaintext=plaintext):
                # The ports are picked by binding port 0 and closing it, so
                # another test running beside this one can take one before
                # the shard binds it ("cannot listen on", as a fresh-clone
                # make test saw once): then again on fresh ports, at most
                # three times; any other failure fails at once.
                for attempt in range(3):
                    try:
                        self.run_compose_processes(plaintext)
                        break
                    except self.failureException as e:
                        if "cannot listen on" not in str(e) or attempt == 2:
                            raise

    def run_compose_processes(self, plaintext):
        self.assertTrue(os.access(SERVER_BIN, os.X_OK), SERVER_BIN)
        self.assertTrue(os.access(WORKER_BIN, os.X_OK), WORKER_BIN)
        env = read_env()
        S, P = int(env["GTOPK_SHARDS"]), int(env["GTOPK_WORKERS"])
        socks = []
        for _ in range(2 * S):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        addrs = ["127.0.0.1:%d" % sock.getsockname()[1] for sock in socks[:S]]
        metrics = [sock.getsockname()[1] for sock in socks[S:]]
        for sock in socks:
            sock.close()
        procs, workers = [], []
        with tempfile.TemporaryDirectory() as tmp:
            tls_dir = os.path.join(tmp, "tls")
            if not plaintext:
                make_compose_certs(tls_dir)
            services = compose_config(plaintext=plaintext,
                                      tls_dir=tls_dir)["services"]

            def local(name, argv):
                """argv with /etc/gtopk/tls/... moved to where the service's
                mount comes from (nothing to move in plaintext)."""
                src = compose_mounts(services[name])[TLS_MOUNT][0]
                out = []
                for a in argv:
                    k, sep, v = a.partition("=")
                    if sep and v.startswith(TLS_MOUNT + "/"):
                        self.assertFalse(plaintext, a)
                        a = "%s=%s" % (k, os.path.join(
                            src, v[len(TLS_MOUNT) + 1:]))
                    out.append(a)
                return out

            def log(name):
                with open(os.path.join(tmp, name + ".log")) as f:
                    return f.read()

            def start(name, argv):
                with open(os.path.join(tmp, name + ".log"), "w") as out:
                    return subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=out,
                        stderr=subprocess.STDOUT)

            def argv_of(name, **changes):
                f = flag_dict(local(name, compose_command(services[name])))
                f.update(changes)
                return ["--%s=%s" % kv for kv in f.items()]

            try:
                ckpt = os.path.join(tmp, "ckpt")
                os.mkdir(ckpt)
                for s in range(S):
                    name = "shard-%d" % s
                    procs.append(start(name, [SERVER_BIN] + argv_of(
                        name, listen=addrs[s], peers=",".join(addrs),
                        checkpoint_dir=ckpt, metrics_port=metrics[s])))
                for s, proc in enumerate(procs):
                    name = "shard-%d" % s
                    test = local(name, services[name]["healthcheck"]["test"])
                    self.assertEqual(test[:3], [
                        "CMD", "gtopk-server",
                        "--health-check=127.0.0.1:%d" % GRPC_PORT])
                    check = ([SERVER_BIN, "--health-check=" + addrs[s]]
                             + test[3:])
                    deadline = time.monotonic() + 30
                    while True:
                        if proc.poll() is not None:
                            self.fail("shard %d exited (%d): %s" % (
                                s, proc.returncode, log(name)))
                        r = run(check, timeout=10)
                        if r.returncode == 0:
                            self.assertIn("SERVING", r.stdout)
                            break
                        if time.monotonic() > deadline:
                            self.fail("shard %d not SERVING to %s: %s%s" % (
                                s, check, r.stdout + r.stderr, log(name)))
                        time.sleep(0.1)
                    if not plaintext:
                        # The gRPC port is not plaintext.
                        r = run([SERVER_BIN, "--health-check=" + addrs[s],
                                 "--tls=off"], timeout=10)
                        self.assertNotEqual(r.returncode, 0, r.stdout)
                    url = "http://127.0.0.1:%d/metrics" % metrics[s]
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        body = resp.read().decode()
                    self.assertIn("gtopk_build_info", body)
                for w in range(P):
                    name = "worker-%d" % w
                    workers.append(start(name, [WORKER_BIN] + argv_of(
                        name, server=addrs[0], model="synthetic:20000",
                        steps=3, metrics_port=0,
                        summary_json=os.path.join(tmp, name + ".json"))))
                sums = []
                for w, proc in enumerate(workers):
                    name = "worker-%d" % w
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        self.fail("%s still running: %s" % (name, log(name)))
                    self.assertEqual(proc.returncode, 0, log(name))
                    with open(os.path.join(tmp, name + ".json")) as f:
                        sums.append(json.load(f))
                checks = {s["param_checksum"] for s in sums}
                self.assertEqual(len(checks), 1, sums)
                self.assertEqual({s["server_checksum"] for s in sums}, checks)
                if plaintext:
                    self.assertIn("WARNING: --tls=off", log("shard-0"))
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                for s, proc in enumerate(procs):
                    proc.wait(timeout=30)
                    self.assertEqual(proc.returncode, 0,
                                     log("shard-%d" % s))
            finally:
                for proc in procs + workers:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()


class ConsistencyTest(unittest.TestCase):
    def setUp(self):
        self.env = read_env()

    def compare(self, what, a_name, a, b_name, b, local):
        a = {k: v for k, v in flag_dict(a).items()
             if k not in local and v not in ("", None)}
        b = {k: v for k, v in flag_dict(b).items()
             if k not in local and v not in ("", None)}
        self.assertEqual(set(a), set(b), "%s flags: %s vs %s" % (
            what, a_name, b_name))
        for k in a:
            self.assertTrue(same_value(a[k], b[k]), "%s --%s: %s has %r, %s "
                            "has %r" % (what, k, a_name, a[k], b_name, b[k]))

    def test_compose_kubernetes_and_launcher_pass_the_same_flags(self):
        services = compose_config()["services"]
        l_server, l_worker = launcher_argv()
        servers = {"launcher": l_server,
                   "compose": compose_command(services["shard-0"])}
        _, l_py_worker = launcher_argv(["--worker", "python"])
        workers = {"launcher": l_worker,
                   "compose": compose_command(services["worker-0"]),
                   # The Python workers: the example's path, then the flags.
                   "launcher --worker python": l_py_worker[1:],
                   "compose python": compose_command(compose_config(
                       python=True)["services"]["worker-0"])[1:]}
        for overlay in OVERLAYS:
            _, objs = render(overlay)
            servers["k8s " + overlay] = k8s_args(
                objs, one(objs, "StatefulSet", "gtopk-shard"), "shard")
            workers["k8s " + overlay] = k8s_args(
                objs, one(objs, "Job", "gtopk-worker"), "worker")
        for group, local, what in ((servers, SERVER_LOCAL_FLAGS, "server"),
                                   (workers, WORKER_LOCAL_FLAGS, "worker")):
            for name, argv in group.items():
                self.compare(what, "launcher", group["launcher"], name, argv,
                             local)
        # And they carry cluster.env's values.
        f = flag_dict(servers["compose"])
        self.assertEqual(f["workers"], self.env["GTOPK_WORKERS"])
        self.assertEqual(f["num_shards"], self.env["GTOPK_SHARDS"])
        self.assertEqual(f["density"], self.env["GTOPK_DENSITY"])

    def test_steps_per_epoch_is_the_workers_epoch(self):
        self.assertEqual(int(self.env["GTOPK_STEPS_PER_EPOCH"]),
                         FASHION_MNIST_TRAIN // int(self.env["GTOPK_WORKERS"])
                         // int(self.env["GTOPK_BATCH_SIZE"]))

    def test_every_variable_is_used_by_the_launcher(self):
        sys.path.insert(0, os.path.join(DEPLOY, "local"))
        try:
            import gtopk_local
        finally:
            sys.path.pop(0)
        self.assertEqual(set(self.env), set(gtopk_local.CLUSTER_ENV_KEYS))

    def test_launcher_config_rejects_bad_files(self):
        launcher = os.path.join(DEPLOY, "local", "gtopk_local.py")
        with tempfile.TemporaryDirectory() as tmp:
            for text, expect in (
                    ("GTOPK_WORKRS=4\n", "unknown variable GTOPK_WORKRS"),
                    ("GTOPK_WORKERS=four\n", "GTOPK_WORKERS='four' is not int"),
                    ("GTOPK_LR=0.1\nGTOPK_LR=0.2\n", "GTOPK_LR set twice"),
                    ("just words\n", "not KEY=VALUE")):
                path = os.path.join(tmp, "c.env")
                with open(path, "w") as f:
                    f.write(text)
                r = run([sys.executable, launcher, "--config", path])
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn(expect, r.stderr)

    def test_launcher_flags_override_the_config(self):
        server, worker = launcher_argv(["--workers", "8", "--lr", "0.2"])
        self.assertEqual(flag_dict(server)["workers"], "8")
        self.assertEqual(flag_dict(server)["lr"], "0.2")
        self.assertEqual(flag_dict(worker)["lr"], "0.2")
        self.assertEqual(flag_dict(server)["steps_per_epoch"],
                         str(FASHION_MNIST_TRAIN // 8 //
                             int(self.env["GTOPK_BATCH_SIZE"])))

    def test_make_demo_defaults_equal_cluster_env(self):
        names = {"WORKERS": "GTOPK_WORKERS", "SHARDS": "GTOPK_SHARDS",
                 "MODEL": "GTOPK_MODEL", "MODE": "GTOPK_MODE",
                 "SELECTION": "GTOPK_SELECTION", "DENSITY": "GTOPK_DENSITY",
                 "DENSITY_WARMUP": "GTOPK_DENSITY_WARMUP",
                 "SELECTOR": "GTOPK_SELECTOR", "EPOCHS": "GTOPK_EPOCHS",
                 "BATCH": "GTOPK_BATCH_SIZE", "LR": "GTOPK_LR",
                 "MOMENTUM": "GTOPK_MOMENTUM",
                 "MOMENTUM_MODE": "GTOPK_MOMENTUM_MODE", "SEED": "GTOPK_SEED"}
        with open(os.path.join(ROOT, "Makefile")) as f:
            make = dict(re.findall(r"^([A-Z_]+)\s*\?=[ \t]*(.*?)\s*$", f.read(),
                                   re.M))
        for var, key in names.items():
            self.assertEqual(make.get(var), self.env[key],
                             "Makefile %s vs cluster.env %s" % (var, key))

    def test_make_demo_variables_reach_the_launcher(self):
        # `make demo VAR=value` must reach the servers' flags; an empty
        # DENSITY_WARMUP means "no warm-up" (README), not cluster.env's.
        def server_flags(*assignments):
            r = run(["make", "-n", "--no-print-directory", "-C", ROOT, "demo"]
                    + list(assignments))
            self.assertEqual(r.returncode, 0, r.stderr)
            text = re.sub(r"\\\n", " ", r.stdout)
            line = [l for l in text.splitlines() if "gtopk_local.py" in l][-1]
            argv = shlex.split(line)
            args = argv[argv.index([a for a in argv
                                    if a.endswith("gtopk_local.py")][0]) + 1:]
            i = args.index("--config")  # relative to ROOT; launcher_argv's
            del args[i:i + 2]
            return flag_dict(launcher_argv(args)[0])
        self.assertEqual(server_flags().get("density_warmup"),
                         self.env["GTOPK_DENSITY_WARMUP"])
        self.assertEqual(server_flags("DENSITY_WARMUP=dgc")["density_warmup"],
                         "dgc")
        self.assertNotIn("density_warmup", server_flags("DENSITY_WARMUP="))
        f = server_flags("WORKERS=3", "SHARDS=3", "MODE=dense",
                         "DENSITY=0.01", "SELECTOR=gaussiank")
        self.assertEqual((f["workers"], f["num_shards"], f["mode"],
                          f["density"], f["selector"]),
                         ("3", "3", "dense", "0.01", "gaussiank"))

    def test_deployment_doc_documents_every_variable(self):
        with open(os.path.join(ROOT, "docs", "deployment.md")) as f:
            doc = f.read()
        for key in self.env:
            self.assertIn("`%s`" % key, doc)


if __name__ == "__main__":
    unittest.main(verbosity=2)
