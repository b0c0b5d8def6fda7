#!/usr/bin/env python3
"""Local gTop-k cluster launcher: S `gtopk-server` shards and P `gtopk-worker`
trainers as processes on loopback (127.0.0.1 only), on free ports.

  deploy/local/gtopk_local.py --name demo --workers 4 --shards 2 --model cnn \
      --mode gtopk --selection threshold --density 0.001 --selector exact \
      --epochs 1 --batch-size 32 --lr 0.1

--worker python runs P copies of the PyTorch example
(examples/pytorch/train_fashion_mnist.py, the gtopk Python package: build it
with `make python`) instead of gtopk-worker, with the same flags, under an
interpreter that has torch (default /usr/bin/python3, Debian's
python3-torch) and PYTHONPATH=BUILD_DIR/python; everything else (servers,
progress, logs, runs/NAME/summary.json) is the same.

--worker python-modern runs examples/pytorch/train_modern.py instead: AdamW
(no weight decay on biases and norm weights), linear warm-up then cosine
decay, gradient clipping on the aggregated gradient, bf16 autocast and a
BatchNorm CNN. The servers get --apply=workers (they aggregate; each worker
runs its own AdamW), with --mode/--selection/--density/--density-warmup/
--selector as usual; --lr, --weight-decay, --warmup-steps and --clip are the
workers' AdamW settings (script defaults when not given; --momentum and
--momentum-mode do not apply). The summary checks that every rank's
parameters AND BatchNorm buffers ended bit-identical
(replica_checksums_match, buffers_match). With --mode ddp the same script
runs under torch DistributedDataParallel (gloo) instead: no servers, no
certificates; each worker gets torchrun's environment (MASTER_ADDR=127.0.0.1,
a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) -- the dense baseline:

  deploy/local/gtopk_local.py --worker python-modern --density 0.01 --epochs 2
  deploy/local/gtopk_local.py --worker python-modern --mode ddp --epochs 2
  make demo WORKER=python-modern [MODE=ddp]

What it does, in order:
  1. computes steps_per_epoch = floor(train_samples / P / batch_size)
     (train_samples = 60000, the Fashion-MNIST training set, or --train-limit);
  2. empties runs/NAME/ and starts the S servers (same cluster flags for all,
     --peers listing every shard, checkpoints in runs/NAME/ckpt/, logs in
     runs/NAME/server-s.log) and waits until each answers SERVING to
     `gtopk-server --health-check`;
  3. starts the P workers (logs in runs/NAME/worker-w.log, summaries in
     runs/NAME/worker-w.json) and writes runs/NAME/pids.json;
  4. streams rank 0's progress lines (one rewritten status line on a TTY,
     plain lines otherwise) while watching every process: a worker that exits
     non-zero, or a server that exits at all, stops the whole run (the failing
     process and the tail of its log are printed; exit 1);
  5. on success stops the servers with SIGTERM (they checkpoint and exit 0;
     SIGKILL after a grace period) and writes runs/NAME/summary.json, merging
     the workers' summaries.

Metrics: every server and worker gets a free --metrics-port, bound to
loopback only (--metrics-host=127.0.0.1; GET /metrics, docs/metrics.md; the
addresses are in runs/NAME/pids.json). When
`prometheus` (Debian package) is on PATH (or --prometheus=on), the launcher
also starts a Prometheus on a free loopback port with a generated scrape
config covering every process (jobs gtopk-server and gtopk-worker, file
runs/NAME/prometheus.yml), keeps its data in runs/NAME/prometheus/, prints
its URL, and stops it with the rest.

Every child runs in its own process group (and gets SIGKILL if the launcher
itself dies, via PR_SET_PDEATHSIG); groups are stopped on success, failure,
SIGINT/SIGTERM/SIGHUP (exit 130) and at interpreter exit, so no process
outlives the launcher. Exit codes: 0 success, 1 a process failed or the
servers did not stop cleanly, 2 bad arguments or missing binaries,
130 interrupted.

Standard library only (Python 3.9+).
"""

import argparse
import atexit
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_plot  # noqa: E402  (runs/NAME/training.png)

FASHION_MNIST_TRAIN_SAMPLES = 60000
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PYTHON_WORKER_SCRIPT = "train_fashion_mnist.py"
DEFAULT_PYTHON_WORKER = os.path.join(REPO_ROOT, "examples", "pytorch",
                                     PYTHON_WORKER_SCRIPT)
# --worker=python-modern: AdamW, schedule, clipping, autocast, BatchNorm;
# servers with --apply=workers (or --mode=ddp: torch DDP, no servers).
MODERN_WORKER_SCRIPT = "train_modern.py"
DEFAULT_MODERN_WORKER = os.path.join(REPO_ROOT, "examples", "pytorch",
                                     MODERN_WORKER_SCRIPT)
PYTHON_WORKERS = ("python", "python-modern")
# The SGD lr of --worker=cpp|python (the servers' optimizer) when neither
# --lr nor a --config file gives one: deploy/cluster.env's GTOPK_LR. Not the
# servers' own default of 0.1: with this launcher's other defaults (the cnn,
# density 0.001 from the first step, DGC momentum 0.9) that diverged (NaN at
# step 101 with P = 4, at step 84 with P = 1); 0.05 trains (one epoch:
# accuracy 0.819 with P = 4, 0.848 with 2, 0.866 with 1).
DEFAULT_SERVER_LR = 0.05
# Debian's python3-torch belongs to /usr/bin/python3 (a python3 first on
# PATH may be another interpreter without torch).
DEFAULT_WORKER_PYTHON = "/usr/bin/python3" if os.access(
    "/usr/bin/python3", os.X_OK) else sys.executable
LOOPBACK = "127.0.0.1"
TAIL_LINES = 20
PROGRESS_RE = re.compile(r"^(step|eval|done) ")
STEP_RE = re.compile(r"^step (\d+)/(\d+) epoch (\d+) loss (\S+)")


class LaunchError(Exception):
    """A failure the launcher reports (message printed, exit 1)."""


class Interrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP received."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def log(msg):
    sys.stderr.write("gtopk_local: %s\n" % msg)
    sys.stderr.flush()


# --------------------------------------------------------------------------
# Child processes


_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux/glibc
    _libc = None


def _child_setup():
    """Runs in the child between fork and exec: own process group, and
    SIGKILL when the launcher dies (even by SIGKILL)."""
    os.setsid()
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Child:
    """One server or worker process, in its own process group."""

    def __init__(self, kind, index, argv, log_path, env=None):
        self.kind = kind
        self.index = index
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc = None

    @property
    def label(self):
        return "%s %d" % (self.kind, self.index)

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def start(self):
        with open(self.log_path, "ab") as out:
            out.write(("$ %s\n" % shlex.join(self.argv)).encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, preexec_fn=_child_setup,
                close_fds=True, env=self.env)

    def poll(self):
        return self.proc.poll() if self.proc else None

    def signal_group(self, sig):
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n=TAIL_LINES):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 64 * 1024))
                data = f.read().decode("utf-8", "replace")
        except OSError as e:
            return "(cannot read %s: %s)" % (self.log_path, e)
        return "\n".join(data.splitlines()[-n:])


def describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            return "killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "killed by signal %d" % -code
    return "exit code %d" % code


def stop_children(children, grace):
    """SIGTERM every group still running, wait up to `grace` seconds, then
    SIGKILL the rest; also SIGKILLs the groups of exited leaders (stray
    descendants) and reaps everything."""
    running = [c for c in children if c.proc is not None and c.poll() is None]
    for c in running:
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in running:
        left = deadline - time.monotonic()
        try:
            c.proc.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        if c.proc is None:
            continue
        c.signal_group(signal.SIGKILL)
        try:
            c.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            log("%s (pid %d) did not die after SIGKILL" % (c.label, c.pid))


# --------------------------------------------------------------------------
# Helpers


def pick_free_ports(count):
    """Distinct free loopback ports (all sockets held open together, so the
    ports differ; a race with another program remains possible and is
    handled by retrying the server start)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def human_bytes(b):
    # Decimal units, as the README's figures (4.3 KB = 4300 bytes).
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return ("%.0f %s" if unit == "B" else "%.1f %s") % (b, unit)
        b /= 1000.0
    return "%g" % b  # pragma: no cover


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gtopk_pid(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return (b"gtopk-" in cmd or PYTHON_WORKER_SCRIPT.encode() in cmd
            or MODERN_WORKER_SCRIPT.encode() in cmd)


class ProgressPrinter:
    """Follows rank 0's log and prints its progress lines."""

    def __init__(self, path, tty):
        self.path = path
        self.tty = tty
        self.offset = 0
        self.partial = b""
        self.status_shown = False

    def poll(self, final=False):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            if PROGRESS_RE.match(line):
                self.emit(line)

    def emit(self, line):
        if self.tty and line.startswith("step "):
            width = shutil.get_terminal_size((120, 20)).columns
            sys.stdout.write("\r\033[K" + line[:max(10, width - 1)])
            self.status_shown = True
        else:
            self.clear()
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def clear(self):
        if self.status_shown:
            sys.stdout.write("\r\033[K")
            self.status_shown = False


# --------------------------------------------------------------------------
# The launcher


# deploy/cluster.env variable -> (launcher option dest, type). The same file
# configures deploy/docker-compose.yml and deploy/k8s (docs/deployment.md).
# GTOPK_STEPS_PER_EPOCH is checked, not taken: the launcher derives
# steps_per_epoch from the data, the worker count and the batch size.
CLUSTER_ENV_KEYS = {
    "GTOPK_WORKERS": ("workers", int),
    "GTOPK_SHARDS": ("shards", int),
    "GTOPK_MODE": ("mode", str),
    "GTOPK_SELECTION": ("selection", str),
    "GTOPK_SELECTOR": ("selector", str),
    "GTOPK_DENSITY": ("density", float),
    "GTOPK_DENSITY_WARMUP": ("density_warmup", str),
    "GTOPK_STEPS_PER_EPOCH": (None, int),
    "GTOPK_LR": ("lr", float),
    "GTOPK_MOMENTUM": ("momentum", float),
    "GTOPK_MOMENTUM_MODE": ("momentum_mode", str),
    "GTOPK_SEED": ("seed", int),
    "GTOPK_STEP_TIMEOUT": ("step_timeout", str),
    "GTOPK_CHECKPOINT_EVERY": ("checkpoint_every", int),
    "GTOPK_MODEL": ("model", str),
    "GTOPK_EPOCHS": ("epochs", int),
    "GTOPK_BATCH_SIZE": ("batch_size", int),
    "GTOPK_THREADS": ("threads", int),
}


def read_cluster_env(path):
    """Reads a cluster.env file (KEY=VALUE lines, # comments) into
    {variable: string}. Raises ValueError naming the file and line for a
    malformed line, an unknown GTOPK_ variable or a repeated one."""
    values = {}
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
                raise ValueError("%s:%d: not KEY=VALUE: %r" % (path, lineno, line))
            if key not in CLUSTER_ENV_KEYS:
                raise ValueError("%s:%d: unknown variable %s (known: %s)" % (
                    path, lineno, key, ", ".join(sorted(CLUSTER_ENV_KEYS))))
            if key in values:
                raise ValueError("%s:%d: %s set twice" % (path, lineno, key))
            values[key] = value
    return values


def config_defaults(path):
    """Option defaults from a cluster.env file; ValueError on a bad file or
    a value of the wrong type."""
    values = read_cluster_env(path)
    defaults = {}
    for key, value in values.items():
        dest, kind = CLUSTER_ENV_KEYS[key]
        try:
            typed = kind(value)
        except ValueError:
            raise ValueError("%s: %s=%r is not %s" % (
                path, key, value, kind.__name__)) from None
        if dest is not None:
            defaults[dest] = typed
    return defaults, values


def parse_args(argv):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    p = argparse.ArgumentParser(
        prog="gtopk_local.py",
        description="Run a local gTop-k cluster (S servers, P workers) on "
        "127.0.0.1; logs and summaries in RUNS_DIR/NAME/.")
    p.add_argument("--config", default=None, metavar="CLUSTER_ENV",
                   help="take the defaults of the cluster options from this "
                   "file (deploy/cluster.env, shared with docker-compose and "
                   "Kubernetes); flags given on the command line win")
    p.add_argument("--name", default="demo",
                   help="run name: files go to RUNS_DIR/NAME/ (emptied first)")
    p.add_argument("--workers", type=int, default=4, help="P")
    p.add_argument("--shards", type=int, default=2, help="S")
    p.add_argument("--model", default="cnn",
                   help="mlp | cnn | synthetic:N")
    p.add_argument("--mode", default="gtopk",
                   choices=["gtopk", "topk", "dense", "ddp"],
                   help="the servers' --mode; ddp (--worker=python-modern "
                   "only): torch DistributedDataParallel over gloo, no "
                   "servers")
    p.add_argument("--selection", default="threshold",
                   choices=["threshold", "quota", "exact"],
                   help="exact: the old name of threshold")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--density-warmup", default="",
                   help="per-epoch warm-up densities (comma list) or 'dgc'; "
                   "empty: none")
    p.add_argument("--selector", default="exact",
                   choices=["exact", "gaussiank", "dgc", "randomk"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None,
                   help="the servers' SGD lr (default %g); "
                   "--worker=python-modern: the workers' AdamW peak lr "
                   "(default: the script's, 2e-3; a --config file's "
                   "GTOPK_LR is not used)" % DEFAULT_SERVER_LR)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--momentum-mode", default="dgc",
                   choices=["none", "dgc", "global"])
    p.add_argument("--weight-decay", type=float, default=None,
                   help="the servers' --weight-decay; "
                   "--worker=python-modern: AdamW's (default: the "
                   "script's, 0.05)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="--worker=python-modern: linear lr warm-up steps "
                   "before the cosine decay (default: the script's, 100)")
    p.add_argument("--clip", type=float, default=None,
                   help="--worker=python-modern: clip the aggregated "
                   "gradient's norm (default: the script's, 1.0; 0: off)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--index-codec", default=None,
                   choices=["raw", "delta-varint", "delta-bitpack"])
    p.add_argument("--value-codec", default=None,
                   choices=["fp32", "fp16", "bf16"])
    p.add_argument("--train-limit", type=int, default=None)
    p.add_argument("--test-limit", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="workers' --device (default: theirs, cpu); cuda: "
                   "every worker on CUDA device 0 (a build against a CUDA "
                   "libtorch, worker/flags.md)")
    p.add_argument("--cpu-isa", choices=["portable", "native"], default=None,
                   help="workers' --cpu-isa (default: theirs, portable: "
                   "libtorch's CPU kernels pinned to AVX2, so the results "
                   "are bit-identical on any x86-64 CPU with AVX2; native: "
                   "libtorch chooses for this CPU)")
    p.add_argument("--build-dir", default="build")
    p.add_argument("--server-bin", default=None,
                   help="default BUILD_DIR/server/gtopk-server")
    p.add_argument("--worker-bin", default=None,
                   help="default BUILD_DIR/worker/gtopk-worker")
    p.add_argument("--worker", default="cpp",
                   choices=["cpp", "python", "python-modern"],
                   help="cpp: gtopk-worker (default); python: the PyTorch "
                   "example (--python-worker) on the gtopk Python package "
                   "(`make python`), with the same flags; python-modern: "
                   "examples/pytorch/%s (AdamW, warm-up + cosine, clipping, "
                   "bf16 autocast, BatchNorm) with the servers' "
                   "--apply=workers, or under torch DDP with --mode=ddp"
                   % MODERN_WORKER_SCRIPT)
    p.add_argument("--python", default=DEFAULT_WORKER_PYTHON,
                   help="--worker=python: the interpreter, one that has "
                   "torch (default %(default)s)")
    p.add_argument("--python-worker", default=None,
                   help="--worker=python|python-modern: the training script "
                   "(default examples/pytorch/%s, or %s)" % (
                       PYTHON_WORKER_SCRIPT, MODERN_WORKER_SCRIPT))
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--tls", choices=["mutual", "off"], default=None,
                   help="mutual: a throwaway CA and certificates "
                   "(deploy/tls/make-certs.sh) in runs/NAME/tls/ and mutual "
                   "TLS on every hop; off: plaintext (the processes print a "
                   "WARNING). Default: mutual")
    p.add_argument("--step-timeout", default="60s",
                   help="servers' --step-timeout (Abseil duration)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="servers' --checkpoint-every (default: the "
                   "servers' default, only on shutdown)")
    p.add_argument("--ready-timeout", type=float, default=30.0,
                   help="seconds to wait for each server to be SERVING")
    p.add_argument("--grace", type=float, default=15.0,
                   help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--timeout", type=float, default=0,
                   help="fail the run after this many seconds (0: none)")
    p.add_argument("--prometheus", default="auto",
                   choices=["auto", "on", "off"],
                   help="start Prometheus scraping every process: auto = "
                   "when `prometheus` is on PATH (default)")
    p.add_argument("--prometheus-bin", default="prometheus",
                   help="the Prometheus server binary (default: from PATH)")
    p.add_argument("--prometheus-port", type=int, default=0,
                   help="Prometheus web port on 127.0.0.1 (0: a free port)")
    p.add_argument("--scrape-interval", default="5s",
                   help="Prometheus scrape interval (Prometheus duration)")
    env_values = {}
    if known.config:
        try:
            defaults, env_values = config_defaults(known.config)
        except (OSError, ValueError) as e:
            p.error("--config: %s" % e)
        p.set_defaults(**defaults)
    args = p.parse_args(argv)
    modern = args.worker == "python-modern"
    if args.python_worker is None:
        args.python_worker = DEFAULT_MODERN_WORKER if modern else \
            DEFAULT_PYTHON_WORKER
    # --lr given on the command line (not from --config): python-modern
    # takes it as AdamW's; a cluster.env's GTOPK_LR is the servers' SGD lr.
    lr_given = any(a == "--lr" or a.startswith("--lr=") for a in argv)
    if modern and not lr_given:
        args.lr = None
    elif args.lr is None:
        args.lr = DEFAULT_SERVER_LR

    errors = []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name):
        errors.append("--name must match [A-Za-z0-9][A-Za-z0-9._-]*")
    for flag in ("workers", "shards", "epochs", "batch_size", "threads"):
        if getattr(args, flag) < 1:
            errors.append("--%s must be >= 1" % flag.replace("_", "-"))
    for flag in ("steps", "train_limit", "test_limit", "eval_every"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            errors.append("--%s must be >= 1" % flag.replace("_", "-"))
    if not 0 < args.density <= 1:
        errors.append("--density must be in (0, 1]")
    if args.selection == "quota" and args.mode != "gtopk":
        errors.append("--selection=quota applies to --mode=gtopk only")
    if args.mode == "ddp" and not modern:
        errors.append("--mode=ddp runs --worker=python-modern (torch DDP, "
                      "no servers), not --worker=%s" % args.worker)
    if not modern:
        for flag in ("warmup_steps", "clip"):
            if getattr(args, flag) is not None:
                errors.append("--%s applies to --worker=python-modern only"
                              % flag.replace("_", "-"))
    if args.warmup_steps is not None and args.warmup_steps < 0:
        errors.append("--warmup-steps must be >= 0")
    if args.clip is not None and args.clip < 0:
        errors.append("--clip must be >= 0")
    if args.lr is not None and not args.lr > 0:
        errors.append("--lr must be > 0")
    if modern:
        for flag, value in (("device", args.device), ("cpu_isa", args.cpu_isa),
                            ("eval_every", args.eval_every)):
            if value is not None:
                errors.append("--%s does not apply to --worker=python-modern"
                              % flag.replace("_", "-"))
    if args.worker == "python" and args.model not in ("cnn", "mlp"):
        errors.append("--worker=python trains --model=cnn or mlp (the "
                      "example's models), not %s" % args.model)
    if not 0 <= args.prometheus_port <= 65535:
        errors.append("--prometheus-port must be in [0, 65535]")
    if not re.fullmatch(r"[0-9]+(ms|s|m)", args.scrape_interval):
        errors.append("--scrape-interval must be a duration such as 5s or "
                      "500ms")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        errors.append("--checkpoint-every must be >= 0")
    if "GTOPK_STEPS_PER_EPOCH" in env_values and not errors:
        train = args.train_limit or FASHION_MNIST_TRAIN_SAMPLES
        derived = train // args.workers // args.batch_size
        given = int(env_values["GTOPK_STEPS_PER_EPOCH"])
        if given != derived:
            log("note: %s has GTOPK_STEPS_PER_EPOCH=%d; this run uses "
                "floor(%d / %d / %d) = %d" % (known.config, given, train,
                                              args.workers, args.batch_size,
                                              derived))
    if errors:
        p.error("; ".join(errors))
    return args


class Launcher:
    def __init__(self, args, argv):
        self.args = args
        self.argv = argv
        self.run_dir = os.path.abspath(os.path.join(args.runs_dir, args.name))
        self.servers = []
        self.workers = []
        self.t0 = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.progress = None
        build = args.build_dir
        self.server_bin = os.path.abspath(
            args.server_bin or os.path.join(build, "server", "gtopk-server"))
        self.worker_bin = os.path.abspath(
            args.worker_bin or os.path.join(build, "worker", "gtopk-worker"))
        self.python_path = os.path.abspath(os.path.join(build, "python"))
        train = args.train_limit or FASHION_MNIST_TRAIN_SAMPLES
        self.train_samples = train
        self.steps_per_epoch = train // args.workers // args.batch_size
        self.addresses = []
        self.server_metrics = []  # host:port of each server's /metrics
        self.worker_metrics = []  # host:port of each worker's /metrics
        self.prometheus = None    # Child, when started
        self.prometheus_url = None
        # Transport security (docs/security.md): certificates in tls_dir.
        self.tls = args.tls or "mutual"
        self.tls_dir = os.path.join(self.run_dir, "tls")
        # --worker=python-modern: servers with --apply=workers; --mode=ddp:
        # no servers at all (torch DDP over gloo between the workers).
        self.modern = args.worker == "python-modern"
        self.ddp = args.mode == "ddp"
        if self.ddp:
            self.tls = "none (ddp)"
        self.master_port = None

    @property
    def children(self):
        return self.servers + self.workers + (
            [self.prometheus] if self.prometheus else [])

    # -- set-up -------------------------------------------------------------

    def check(self):
        binaries = [] if self.ddp else [("server", self.server_bin)]
        if self.args.worker == "cpp":
            binaries.append(("worker", self.worker_bin))
        for what, path in binaries:
            if not os.access(path, os.X_OK):
                hint = ("build it with `make build`" if what == "server" else
                        "build it with `make build` (needs libtorch-dev)")
                raise UsageError("%s binary %s not found or not executable; %s"
                                 % (what, path, hint))
        if self.args.worker in PYTHON_WORKERS:
            self.check_python_worker()
        if self.ddp and self.args.prometheus == "on":
            raise UsageError("--prometheus=on: --mode=ddp workers serve no "
                             "metrics")
        if self.args.prometheus == "on" and not shutil.which(
                self.args.prometheus_bin):
            raise UsageError("--prometheus=on but %s is not on PATH (Debian: "
                             "apt-get install prometheus)"
                             % self.args.prometheus_bin)
        if self.steps_per_epoch < 1:
            raise UsageError(
                "steps per epoch = floor(%d / %d / %d) = 0: use fewer workers, "
                "a smaller batch or a larger --train-limit"
                % (self.train_samples, self.args.workers, self.args.batch_size))

    def tls_flags(self, who):
        """--tls flags for a process whose certificate is tls/WHO.{crt,key}
        (shard-<s>, worker-<r>)."""
        if self.tls == "off":
            return ["--tls=off"]
        return ["--tls=mutual",
                "--tls-cert=%s" % os.path.join(self.tls_dir, who + ".crt"),
                "--tls-key=%s" % os.path.join(self.tls_dir, who + ".key"),
                "--tls-ca=%s" % os.path.join(self.tls_dir, "ca.crt")]

    def make_certs(self):
        """--tls=mutual: a throwaway CA and one certificate per shard and
        rank, made by deploy/tls/make-certs.sh into runs/NAME/tls/."""
        if self.tls != "mutual":
            return
        script = os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tls", "make-certs.sh")
        try:
            r = subprocess.run(["sh", script, self.tls_dir,
                                str(self.args.shards), str(self.args.workers)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=120,
                               text=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError("--tls=mutual: %s failed: %s" % (script, e))
        if r.returncode != 0:
            raise UsageError("--tls=mutual: %s failed (is the openssl CLI "
                             "installed?):\n%s" % (script, r.stdout))

    def worker_env(self):
        """The workers' environment: --worker=python finds the gtopk
        package in BUILD_DIR/python first."""
        if self.args.worker not in PYTHON_WORKERS:
            return None
        env = dict(os.environ)
        # The workers' security is the launcher's --tls flags, never what
        # the caller's environment happens to hold (the example reads these
        # when a flag is not given: a stray GTOPK_TOKEN_FILE would be sent).
        for k in ("GTOPK_TLS", "GTOPK_TLS_CERT", "GTOPK_TLS_KEY",
                  "GTOPK_TLS_CA", "GTOPK_TOKEN_FILE"):
            env.pop(k, None)
        env["PYTHONPATH"] = os.pathsep.join(
            [self.python_path] + ([env["PYTHONPATH"]]
                                  if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        if self.modern:  # the launcher's flags (and ddp_env) decide
            for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                      "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GTOPK_LEADER"):
                env.pop(k, None)
        return env

    def ddp_env(self, rank):
        """--mode=ddp: the environment torchrun gives each process."""
        env = self.worker_env()
        env.update({"MASTER_ADDR": LOOPBACK,
                    "MASTER_PORT": str(self.master_port),
                    "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(self.args.workers),
                    "LOCAL_WORLD_SIZE": str(self.args.workers)})
        return env

    def check_python_worker(self):
        """--worker=python: the script, the interpreter, and that it imports
        torch and the built gtopk package (one short subprocess)."""
        a = self.args
        if not os.path.isfile(a.python_worker):
            raise UsageError("--python-worker %s not found" % a.python_worker)
        python = shutil.which(a.python) or a.python
        if not os.access(python, os.X_OK):
            raise UsageError("--python %s not found or not executable"
                             % a.python)
        a.python = python
        probe = ("import sys\n"
                 "try:\n import torch, numpy\n"
                 "except ImportError as e:\n"
                 " sys.exit('torch/numpy: %s (Debian: apt-get install "
                 "python3-torch; or --python=an interpreter with torch)' % e)\n"
                 + ("" if self.ddp else "import gtopk\n"))
        try:
            r = subprocess.run([python, "-c", probe], env=self.worker_env(),
                               stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=120,
                               text=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError("--python %s: cannot run it: %s" % (python, e))
        if r.returncode != 0:
            lines = r.stdout.strip().splitlines()
            raise UsageError(
                "--worker=%s: %s cannot import torch and the gtopk "
                "package from %s; build it with `make python`:\n%s" % (
                    a.worker, python, self.python_path,
                    "\n".join("    | " + l for l in lines[-8:])))

    def prepare_run_dir(self):
        pids = os.path.join(self.run_dir, "pids.json")
        if os.path.exists(pids):
            try:
                with open(pids) as f:
                    old = json.load(f)
                live = [p for p in old.get("servers", []) + old.get("workers", [])
                        if _pid_alive(p) and _gtopk_pid(p)]
            except (OSError, ValueError, AttributeError, TypeError):
                live = []
            if live:
                raise UsageError("run %s looks alive (pids %s in %s); stop it "
                                 "or pick another --name" % (
                                     self.args.name, live, pids))
        if os.path.isdir(self.run_dir):
            shutil.rmtree(self.run_dir)
        os.makedirs(os.path.join(self.run_dir, "ckpt"))

    def server_argv(self, shard, peers):
        a = self.args
        argv = [
            self.server_bin,
            "--listen=%s" % peers[shard],
            "--shard-id=%d" % shard,
            "--num-shards=%d" % a.shards,
            "--workers=%d" % a.workers,
            "--peers=%s" % ",".join(peers),
            "--mode=%s" % a.mode,
            "--selection=%s" % a.selection,
            "--selector=%s" % a.selector,
            "--density=%r" % a.density,
        ]
        if self.modern:
            # The workers run their own optimizer (AdamW): the servers
            # aggregate only, and their optimizer flags are not given.
            argv.append("--apply=workers")
        else:
            argv += ["--lr=%r" % a.lr,
                     "--momentum=%r" % a.momentum,
                     "--momentum-mode=%s" % a.momentum_mode]
        argv += [
            "--seed=%d" % a.seed,
            "--steps-per-epoch=%d" % self.steps_per_epoch,
            "--step-timeout=%s" % a.step_timeout,
            "--checkpoint-dir=%s" % os.path.join(self.run_dir, "ckpt"),
            "--metrics-port=%s" % self.server_metrics[shard].rsplit(":", 1)[1],
            # Loopback only: a local run exposes nothing to the network.
            "--metrics-host=%s" % LOOPBACK,
        ]
        if a.density_warmup:
            argv.append("--density-warmup=%s" % a.density_warmup)
        if a.checkpoint_every is not None:
            argv.append("--checkpoint-every=%d" % a.checkpoint_every)
        if a.weight_decay is not None and not self.modern:
            argv.append("--weight-decay=%r" % a.weight_decay)
        if a.index_codec:
            argv.append("--index-codec=%s" % a.index_codec)
        if a.value_codec:
            argv.append("--value-codec=%s" % a.value_codec)
        argv += self.tls_flags("shard-%d" % shard)
        return argv

    def modern_worker_argv(self, rank):
        """--worker=python-modern: examples/pytorch/train_modern.py's flags
        (the model is the script's own BatchNorm CNN; --model is not
        used)."""
        a = self.args
        argv = [a.python, os.path.abspath(a.python_worker),
                "--backend=%s" % ("ddp" if self.ddp else "gtopk"),
                "--rank=%d" % rank,
                "--batch-size=%d" % a.batch_size,
                "--epochs=%d" % a.epochs,
                "--seed=%d" % a.seed,
                "--threads=%d" % a.threads,
                "--summary-json=%s" % os.path.join(self.run_dir,
                                                   "worker-%d.json" % rank)]
        if not self.ddp:
            argv += ["--server=%s" % self.addresses[0],
                     "--metrics-port=%s"
                     % self.worker_metrics[rank].rsplit(":", 1)[1],
                     "--metrics-host=%s" % LOOPBACK]
            argv += self.tls_flags("worker-%d" % rank)
        if a.lr is not None:
            argv.append("--lr=%r" % a.lr)
        if a.weight_decay is not None:
            argv.append("--weight-decay=%r" % a.weight_decay)
        if a.warmup_steps is not None:
            argv.append("--warmup-steps=%d" % a.warmup_steps)
        if a.clip is not None:
            argv.append("--clip=%r" % a.clip)
        for flag in ("steps", "train_limit", "test_limit"):
            v = getattr(a, flag)
            if v is not None:
                argv.append("--%s=%d" % (flag.replace("_", "-"), v))
        if a.data_dir:
            argv.append("--data-dir=%s" % os.path.abspath(a.data_dir))
        return argv

    def worker_argv(self, rank):
        a = self.args
        if self.modern:
            return self.modern_worker_argv(rank)
        # --worker=python: the example takes gtopk-worker's flags.
        program = [self.worker_bin] if a.worker == "cpp" else [
            a.python, os.path.abspath(a.python_worker)]
        argv = program + [
            "--server=%s" % self.addresses[0],
            "--rank=%d" % rank,
            "--model=%s" % a.model,
            "--batch-size=%d" % a.batch_size,
            "--epochs=%d" % a.epochs,
            "--seed=%d" % a.seed,
            "--threads=%d" % a.threads,
            "--summary-json=%s" % os.path.join(self.run_dir,
                                               "worker-%d.json" % rank),
            # Consistency flags: checked against the servers' cluster spec.
            "--mode=%s" % a.mode,
            "--selector=%s" % a.selector,
            "--density=%r" % a.density,
            "--lr=%r" % a.lr,
            "--momentum=%r" % a.momentum,
            "--metrics-port=%s" % self.worker_metrics[rank].rsplit(":", 1)[1],
            "--metrics-host=%s" % LOOPBACK,
        ]
        if a.index_codec:
            argv.append("--index-codec=%s" % a.index_codec)
        if a.value_codec:
            argv.append("--value-codec=%s" % a.value_codec)
        if a.cpu_isa:
            argv.append("--cpu-isa=%s" % a.cpu_isa)
        if a.device:
            argv.append("--device=%s" % a.device)
        for flag in ("steps", "train_limit", "test_limit", "eval_every"):
            v = getattr(a, flag)
            if v is not None:
                argv.append("--%s=%d" % (flag.replace("_", "-"), v))
        if a.data_dir:
            argv.append("--data-dir=%s" % os.path.abspath(a.data_dir))
        # The example takes gtopk-worker's --tls flags too.
        argv += self.tls_flags("worker-%d" % rank)
        return argv

    def write_pids(self):
        path = os.path.join(self.run_dir, "pids.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"launcher": os.getpid(),
                       "servers": [c.pid for c in self.servers],
                       "workers": [c.pid for c in self.workers],
                       "addresses": self.addresses,
                       "server_metrics": self.server_metrics,
                       "worker_metrics": self.worker_metrics,
                       "prometheus": self.prometheus.pid
                       if self.prometheus else None,
                       "prometheus_url": self.prometheus_url}, f)
            f.write("\n")
        os.replace(tmp, path)

    def start_servers(self, attempts=3):
        for attempt in range(1, attempts + 1):
            S = self.args.shards
            ports = pick_free_ports(2 * S)
            self.addresses = ["%s:%d" % (LOOPBACK, p) for p in ports[:S]]
            self.server_metrics = ["%s:%d" % (LOOPBACK, p)
                                   for p in ports[S:]]
            self.servers = [
                Child("server", s, self.server_argv(s, self.addresses),
                      os.path.join(self.run_dir, "server-%d.log" % s))
                for s in range(self.args.shards)]
            for c in self.servers:
                c.start()
            self.write_pids()
            try:
                for c in self.servers:
                    self.wait_serving(c)
                log("%d server(s) SERVING at %s" % (
                    len(self.servers), ",".join(self.addresses)))
                return
            except LaunchError as e:
                tails = "".join(c.tail() for c in self.servers)
                port_race = ("Address already in use" in tails
                             or "Failed to add" in tails
                             or "cannot listen" in tails.lower())
                if attempt < attempts and port_race:
                    log("a port was taken, retrying with new ports")
                    stop_children(self.servers, self.args.grace)
                    self.servers = []
                    continue
                raise e

    def wait_serving(self, c):
        deadline = time.monotonic() + self.args.ready_timeout
        addr = self.addresses[c.index]
        while True:
            code = c.poll()
            if code is not None:
                raise LaunchError(self.failure_text(
                    c, "exited during start-up (%s)" % describe_exit(code)))
            try:
                r = subprocess.run(
                    [self.server_bin, "--health-check=%s" % addr] +
                    self.tls_flags("shard-%d" % c.index),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, timeout=10)
                if r.returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(self.failure_text(
                    c, "not SERVING at %s after %.0f s" % (
                        addr, self.args.ready_timeout)))
            time.sleep(0.1)

    def pick_worker_metrics_ports(self):
        """Before Prometheus starts: its scrape config names them."""
        if self.ddp:  # torch DDP workers serve no metrics
            self.worker_metrics = []
            return
        self.worker_metrics = ["%s:%d" % (LOOPBACK, p)
                               for p in pick_free_ports(self.args.workers)]

    def start_workers(self):
        if self.ddp:
            self.master_port = pick_free_ports(1)[0]
        for w in range(self.args.workers):
            c = Child("worker", w, self.worker_argv(w),
                      os.path.join(self.run_dir, "worker-%d.log" % w),
                      env=self.ddp_env(w) if self.ddp else self.worker_env())
            self.workers.append(c)
            c.start()
        self.write_pids()
        log("%d worker(s) started; logs in %s" % (len(self.workers),
                                                  self.run_dir))

    def prometheus_config(self):
        """The scrape config: one job per process kind, every process a
        target (instance = its loopback host:port), labelled with its
        shard or rank."""
        def job(name, targets, label):
            lines = ["  - job_name: %s" % name, "    static_configs:"]
            for i, t in enumerate(targets):
                lines += ["      - targets: ['%s']" % t,
                          "        labels: {%s: '%d'}" % (label, i)]
            return lines
        a = self.args
        lines = ["# Generated by deploy/local/gtopk_local.py for run %s."
                 % a.name,
                 "global:",
                 "  scrape_interval: %s" % a.scrape_interval,
                 "  scrape_timeout: %s" % a.scrape_interval,
                 "  evaluation_interval: %s" % a.scrape_interval,
                 "scrape_configs:"]
        lines += job("gtopk-server", self.server_metrics, "shard")
        lines += job("gtopk-worker", self.worker_metrics, "rank")
        return "\n".join(lines) + "\n"

    def start_prometheus(self):
        a = self.args
        if a.prometheus == "off" or self.ddp or (
                a.prometheus == "auto" and not shutil.which(a.prometheus_bin)):
            return
        config = os.path.join(self.run_dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(self.prometheus_config())
        data = os.path.join(self.run_dir, "prometheus")
        os.makedirs(data, exist_ok=True)
        port = a.prometheus_port or pick_free_ports(1)[0]
        listen = "%s:%d" % (LOOPBACK, port)
        self.prometheus = Child("prometheus", 0, [
            shutil.which(a.prometheus_bin) or a.prometheus_bin,
            "--config.file=%s" % config,
            "--storage.tsdb.path=%s" % data,
            "--web.listen-address=%s" % listen,
            "--storage.tsdb.retention.time=7d",
        ], os.path.join(self.run_dir, "prometheus.log"))
        self.prometheus.start()
        self.prometheus_url = "http://%s" % listen
        self.write_pids()
        if not wait_http_ready(self.prometheus_url + "/-/ready", 15.0,
                               self.prometheus):
            log(self.failure_text(self.prometheus, "is not ready at %s after "
                                  "15 s; training continues without it" %
                                  self.prometheus_url))
            return
        log("prometheus on %s (scraping %d server(s) and %d worker(s) every "
            "%s; data in %s)" % (self.prometheus_url, len(self.servers),
                                 len(self.worker_metrics), a.scrape_interval, data))

    # -- running ------------------------------------------------------------

    def failure_text(self, c, what):
        return "%s (pid %s) %s; last lines of %s:\n%s" % (
            c.label, c.pid, what, c.log_path, indent(c.tail()))

    def monitor(self):
        self.progress = ProgressPrinter(self.workers[0].log_path, self.tty)
        deadline = (self.t0 + self.args.timeout) if self.args.timeout else None
        while True:
            self.progress.poll()
            failed = []
            for c in self.servers:
                code = c.poll()
                if code is not None:
                    failed.append((c, "exited before the workers finished (%s)"
                                   % describe_exit(code)))
            if self.prometheus is not None and \
                    self.prometheus.poll() is not None and \
                    not getattr(self, "_prometheus_reported", False):
                # Monitoring is not the job: say so, keep training.
                self._prometheus_reported = True
                log(self.failure_text(self.prometheus, "exited (%s); training "
                                      "continues without it" % describe_exit(
                                          self.prometheus.poll())))
            done = 0
            for c in self.workers:
                code = c.poll()
                if code is None:
                    continue
                if code == 0:
                    done += 1
                else:
                    failed.append((c, "failed (%s)" % describe_exit(code)))
            if failed:
                self.progress.poll(final=True)
                self.progress.clear()
                # Workers first: a dead worker is the usual cause.
                failed.sort(key=lambda fc: fc[0].kind != "worker")
                raise LaunchError("\n".join(self.failure_text(c, what)
                                            for c, what in failed))
            if done == len(self.workers):
                self.progress.poll(final=True)
                self.progress.clear()
                return
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError("run exceeded --timeout=%g s" %
                                  self.args.timeout)
            time.sleep(0.2)

    def stop_servers(self):
        """SIGTERM (checkpoint + exit 0), SIGKILL after the grace period."""
        for c in self.servers:
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        codes = {}
        for c in self.servers:
            try:
                codes[c.index] = c.proc.wait(
                    timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.signal_group(signal.SIGKILL)
                c.proc.wait()
                codes[c.index] = "killed after %g s grace" % self.args.grace
        return codes

    # -- summary ------------------------------------------------------------

    def summarize_modern(self, reports, server_codes):
        """--worker=python-modern: every rank's parameters and float
        buffers (BatchNorm statistics) must be bit-identical; accuracy is
        evaluated on every rank (and equal when they are)."""
        a = self.args
        r0 = next((r for r in reports if r.get("rank") == 0), reports[0])

        def mean(key):
            vals = [r[key] for r in reports
                    if isinstance(r.get(key), (int, float))]
            return statistics.fmean(vals) if vals else None

        def same(key):
            vals = [r.get(key) for r in reports]
            return (len(reports) == a.workers and vals[0] is not None
                    and all(v == vals[0] for v in vals)), vals

        params_match, params = same("params_checksum")
        buffers_match, buffers = same("buffers_checksum")
        accuracy_match, accuracies = same("test_accuracy")
        sent = mean("sent_bytes_per_worker_per_step")
        dense = mean("dense_bytes_per_worker_per_step")
        summary = {
            "name": a.name,
            "mode": a.mode,
            "backend": r0.get("backend"),
            "apply": None if self.ddp else "workers",
            "selection": None if self.ddp else a.selection,
            "workers": a.workers,
            "shards": 0 if self.ddp else a.shards,
            "model": "bn-cnn (%s)" % MODERN_WORKER_SCRIPT,
            "worker": a.worker,
            "tls": self.tls,
            "n": r0.get("n"),
            "density": r0.get("density"),
            "density_warmup": None if self.ddp else a.density_warmup,
            "selector": None if self.ddp else a.selector,
            "epochs": r0.get("epochs", a.epochs),
            "epochs_requested": a.epochs,
            "steps": r0.get("steps"),
            "steps_per_epoch": self.steps_per_epoch,
            "batch_size": a.batch_size,
            "optimizer": "AdamW",
            "lr": r0.get("lr"),
            "weight_decay": r0.get("weight_decay"),
            "warmup_steps": r0.get("warmup_steps"),
            "clip": r0.get("clip"),
            "autocast": r0.get("autocast"),
            "seed": a.seed,
            "index_codec": a.index_codec,
            "value_codec": a.value_codec,
            "train_limit": a.train_limit,
            "test_limit": a.test_limit,
            "test_accuracy": r0.get("test_accuracy"),
            "test_accuracies": accuracies,
            "test_accuracies_match": accuracy_match,
            "final_loss": mean("final_loss"),
            "wall_seconds": round(time.monotonic() - self.t0, 3),
            "train_wall_seconds": r0.get("wall_seconds"),
            "step_seconds_p50": r0.get("step_seconds_p50"),
            "step_seconds_p50_max_over_ranks": max(
                (r["step_seconds_p50"] for r in reports
                 if isinstance(r.get("step_seconds_p50"), (int, float))),
                default=None),
            "sent_bytes_per_worker_per_step": sent,
            "sent_bytes_source": r0.get("sent_bytes_source"),
            "dense_bytes_per_worker_per_step": dense,
            "sent_fraction_of_dense": (sent / dense) if sent is not None
            and dense else None,
            # Workers-apply: the servers hold no parameters to compare with;
            # the replicas are compared with each other.
            "replica_checksums_match": params_match,
            "buffers_match": buffers_match,
            "params_checksums": params,
            "buffers_checksums": buffers,
            "server_exit_codes": [server_codes.get(i)
                                  for i in range(len(self.servers))],
            "run_dir": self.run_dir,
            "command": [sys.executable, os.path.abspath(sys.argv[0])]
            + self.argv,
            "command_line": shlex.join(
                [os.path.abspath(sys.argv[0])] + self.argv),
            "per_rank": reports,
        }
        return summary

    def summarize(self, server_codes):
        a = self.args
        reports = []
        for c in self.workers:
            path = os.path.join(self.run_dir, "worker-%d.json" % c.index)
            try:
                with open(path) as f:
                    reports.append(json.load(f))
            except (OSError, ValueError) as e:
                raise LaunchError("worker %d exited 0 but its summary %s is "
                                  "unreadable: %s" % (c.index, path, e))
        if self.modern:
            summary = self.summarize_modern(reports, server_codes)
            return self.write_summary(summary)
        r0 = next((r for r in reports if r.get("rank") == 0), reports[0])

        def mean(key):
            vals = [r[key] for r in reports
                    if isinstance(r.get(key), (int, float))]
            return statistics.fmean(vals) if vals else None

        param = [r.get("param_checksum") for r in reports]
        server = [r.get("server_checksum") for r in reports]
        match = (len(reports) == a.workers and param[0] is not None
                 and all(p == param[0] for p in param)
                 and all(s == param[0] for s in server))
        sent = mean("sent_bytes_per_step")
        dense = mean("dense_bytes_per_step")
        summary = {
            "name": a.name,
            "mode": r0.get("mode", a.mode),
            "selection": a.selection,
            "workers": a.workers,
            "shards": a.shards,
            "model": r0.get("model", a.model),
            "worker": a.worker,
            "tls": self.tls,
            "n": r0.get("n"),
            "density": a.density,
            "density_warmup": a.density_warmup,
            "selector": r0.get("selector", a.selector),
            "epochs": r0.get("epochs", a.epochs),
            "epochs_requested": a.epochs,
            "steps": r0.get("steps"),
            "steps_per_epoch": self.steps_per_epoch,
            "batch_size": a.batch_size,
            "lr": a.lr,
            "momentum": a.momentum,
            "momentum_mode": a.momentum_mode,
            "seed": a.seed,
            "index_codec": a.index_codec,
            "value_codec": a.value_codec,
            "train_limit": a.train_limit,
            "test_limit": a.test_limit,
            "test_accuracy": r0.get("test_accuracy"),
            "final_loss": mean("final_loss"),
            "wall_seconds": round(time.monotonic() - self.t0, 3),
            "train_wall_seconds": r0.get("wall_seconds"),
            "step_seconds_p50": r0.get("step_seconds_p50"),
            "step_seconds_p50_max_over_ranks": max(
                (r["step_seconds_p50"] for r in reports
                 if isinstance(r.get("step_seconds_p50"), (int, float))),
                default=None),
            "sent_bytes_per_worker_per_step": sent,
            "received_bytes_per_worker_per_step":
                mean("received_bytes_per_step"),
            "dense_bytes_per_worker_per_step": dense,
            "sent_fraction_of_dense": (sent / dense) if sent is not None
            and dense else None,
            "replica_checksums_match": match,
            "param_checksums": param,
            "server_checksums": server,
            "server_exit_codes": [server_codes.get(i)
                                  for i in range(len(self.servers))],
            "run_dir": self.run_dir,
            "command": [sys.executable, os.path.abspath(sys.argv[0])]
            + self.argv,
            "command_line": shlex.join(
                [os.path.abspath(sys.argv[0])] + self.argv),
            "per_rank": reports,
        }
        return self.write_summary(summary)

    def write_summary(self, summary):
        path = os.path.join(self.run_dir, "summary.json")
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(path + ".tmp", path)
        return summary, path

    def counterpart_run(self, summary):
        """The newest other run under --runs-dir with the same worker,
        model and P but the other kind of exchange (dense vs. sparse), whose
        rank-0 log is there: drawn beside this one."""
        runs_dir = os.path.dirname(self.run_dir)
        dense = summary.get("mode") in ("dense", "ddp")
        best, best_time = None, -1.0
        for name in os.listdir(runs_dir):
            other_dir = os.path.join(runs_dir, name)
            if other_dir == self.run_dir:
                continue
            path = os.path.join(other_dir, "summary.json")
            try:
                with open(path) as f:
                    other = json.load(f)
                mtime = os.path.getmtime(path)
            except (OSError, ValueError):
                continue
            if (other.get("mode") in ("dense", "ddp")) == dense or \
                    any(other.get(k) != summary.get(k)
                        for k in ("worker", "model", "workers")) or \
                    not os.path.exists(os.path.join(other_dir,
                                                    "worker-0.log")):
                continue
            if mtime > best_time:
                best, best_time = (name, other), mtime
        return best

    def draw_training(self, summary):
        """runs/NAME/training.png (deploy/local/training_plot.py): rank
        0's training loss and test accuracy against step and wall time,
        and the bytes per worker per step -- beside the counterpart run's
        when there is one. Recorded in the summary as training_png (null,
        with the reason on stderr, when it cannot be drawn)."""
        png = os.path.join(self.run_dir, "training.png")
        runs = [{"name": "%s (%s)" % (summary["name"], summary["mode"]),
                 "log": os.path.join(self.run_dir, "worker-0.log"),
                 "bytes_per_step": summary.get(
                     "sent_bytes_per_worker_per_step")}]
        other = self.counterpart_run(summary)
        if other is not None:
            name, o = other
            runs.append({"name": "%s (%s)" % (name, o.get("mode")),
                         "log": os.path.join(os.path.dirname(self.run_dir),
                                             name, "worker-0.log"),
                         "bytes_per_step": o.get(
                             "sent_bytes_per_worker_per_step")})
        if summary["mode"] in ("dense", "ddp") and len(runs) == 2:
            runs.reverse()  # the sparse run first, as in the README
        try:
            training_plot.training_plot(
                png, runs, "%s: P = %d, model %s" % (
                    summary["name"], summary["workers"], summary["model"]))
            summary["training_png"] = png
            summary["training_png_runs"] = [r["name"] for r in runs]
        except (training_plot.PlotError, OSError) as e:
            log("training plot not drawn: %s" % e)
            summary["training_png"] = None
            summary["training_png_runs"] = []
        return self.write_summary(summary)

    def print_summary(self, s, path):
        acc = s["test_accuracy"]
        lines = ["%s: %s, P=%d workers, S=%d shards, model %s (n=%s), "
                 "density %s, %s steps" % (
                     s["name"], s["mode"], s["workers"], s["shards"],
                     s["model"], s["n"], "%g" % s["density"]
                     if isinstance(s["density"], (int, float))
                     else s["density"], s["steps"])]
        lines.append("  test accuracy   %s" % (
            "%.4f" % acc if isinstance(acc, (int, float)) else acc))
        if isinstance(s["final_loss"], (int, float)):
            lines.append("  final loss      %.4f (mean over ranks)"
                         % s["final_loss"])
        if s["sent_bytes_per_worker_per_step"] is not None and \
                s["dense_bytes_per_worker_per_step"]:
            lines.append("  sent per worker per step  %s vs %s dense (%.3f%%)"
                         % (human_bytes(s["sent_bytes_per_worker_per_step"]),
                            human_bytes(s["dense_bytes_per_worker_per_step"]),
                            100 * s["sent_fraction_of_dense"]))
        if isinstance(s["step_seconds_p50"], (int, float)):
            lines.append("  step time p50   %.1f ms" %
                         (1000 * s["step_seconds_p50"]))
        lines.append("  wall time       %.1f s" % s["wall_seconds"])
        if s.get("training_png"):
            lines.append("  training plot   %s" % s["training_png"])
        if s.get("worker") == "python-modern":
            lines.append("  replicas identical (every rank's parameters): "
                         "%s" % ("yes" if s["replica_checksums_match"]
                                 else "NO"))
            lines.append("  buffers identical (every rank's BatchNorm "
                         "statistics): %s" % ("yes" if s["buffers_match"]
                                              else "NO"))
            if s["replica_checksums_match"]:
                lines.append("  parameter checksum  %s"
                             % s["params_checksums"][0])
            lines.append("  summary         %s" % path)
            print("\n".join(lines))
            sys.stdout.flush()
            return
        lines.append("  replicas identical (workers and servers): %s" % (
            "yes" if s["replica_checksums_match"] else "NO"))
        checksums = set(s.get("param_checksums") or []) | set(
            s.get("server_checksums") or [])
        if s["replica_checksums_match"] and len(checksums) == 1:
            # What the README's figures quote, to compare runs at a glance.
            lines.append("  parameter checksum  %s" % checksums.pop())
        lines.append("  summary         %s" % path)
        print("\n".join(lines))
        sys.stdout.flush()

    # -- all of it ----------------------------------------------------------

    def run(self):
        self.check()
        self.prepare_run_dir()
        self.make_certs()
        a = self.args
        log("run %s: %s, P=%d, S=%d, model %s, tls %s, %d steps/epoch x "
            "%d epoch(s)%s%s"
            % (a.name, a.mode, a.workers, 0 if self.ddp else a.shards,
               "bn-cnn" if self.modern else a.model, self.tls,
               self.steps_per_epoch, a.epochs,
               ", at most %d steps" % a.steps if a.steps else "",
               "; Python workers: %s %s%s" % (
                   a.python, a.python_worker,
                   " (torch DDP, gloo)" if self.ddp else
                   " (servers --apply=workers)" if self.modern else "")
               if a.worker in PYTHON_WORKERS else ""))
        if not self.ddp:
            self.start_servers()
        self.pick_worker_metrics_ports()
        # Prometheus before the workers, so that their first steps are
        # scraped too.
        self.start_prometheus()
        self.start_workers()
        if not self.ddp:
            log("metrics: servers %s, workers %s" % (
                ",".join(self.server_metrics), ",".join(self.worker_metrics)))
        self.monitor()
        codes = self.stop_servers()
        if self.prometheus is not None:
            stop_children([self.prometheus], self.args.grace)
        summary, path = self.summarize(codes)
        summary, path = self.draw_training(summary)
        self.print_summary(summary, path)
        bad = {i: c for i, c in codes.items() if c != 0}
        if bad:
            for i, c in sorted(bad.items()):
                log(self.failure_text(self.servers[i],
                                      "did not stop cleanly (%s)" % (
                                          describe_exit(c)
                                          if isinstance(c, int) else c)))
            return 1
        if self.modern:
            if not (summary["replica_checksums_match"]
                    and summary["buffers_match"]):
                log("replicas differ: parameter checksums %s, buffer "
                    "checksums %s" % (summary["params_checksums"],
                                      summary["buffers_checksums"]))
                return 1
            return 0
        if not summary["replica_checksums_match"]:
            log("replica checksums differ: %s (workers) vs %s (servers)" % (
                summary["param_checksums"], summary["server_checksums"]))
            return 1
        return 0


class UsageError(Exception):
    """Bad arguments or missing binaries (exit 2)."""


def indent(text, prefix="    | "):
    return "\n".join(prefix + line for line in text.splitlines()) or \
        prefix + "(empty log)"


def wait_http_ready(url, timeout_s, child):
    """True once GET url answers 200 within timeout_s; False when the time is
    up or `child` exited first."""
    deadline = time.monotonic() + timeout_s
    # No proxy: the URL is on loopback whatever http_proxy says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return False
        try:
            with opener.open(url, timeout=1.0) as r:
                if r.status == 200:
                    return True
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return False


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    launcher = Launcher(args, argv)

    def on_signal(signum, _frame):
        # Ignore repeats while stopping; the first one unwinds main().
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    atexit.register(lambda: stop_children(launcher.children, 0))

    try:
        return launcher.run()
    except UsageError as e:
        log("error: %s" % e)
        return 2
    except LaunchError as e:
        if launcher.progress:
            launcher.progress.clear()
        log("run %s FAILED: %s" % (args.name, e))
        log("stopping every process; logs in %s" % launcher.run_dir)
        return 1
    except Interrupted as e:
        if launcher.progress:
            launcher.progress.clear()
        log("%s received: stopping every process; logs in %s" % (
            e, launcher.run_dir))
        return 130
    finally:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # pragma: no cover - not main thread
            pass
        stop_children(launcher.children, min(args.grace, 10.0))


if __name__ == "__main__":
    sys.exit(main())
