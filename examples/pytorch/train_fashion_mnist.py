#!/usr/bin/env python3
"""Train a small CNN on Fashion-MNIST with gTop-k: one worker of a gtopk
cluster, written as a plain PyTorch script. Copy it and put your own model in.

What gtopk adds to an ordinary PyTorch training loop is one line: the
optimizer, ``gtopk.torch.DistributedOptimizer``, which joins the cluster,
makes every replica start from the servers' parameters, and turns each
``opt.step()`` into one synchronous gTop-k step (Shi et al., ICDCS 2019,
arXiv:1901.04359; DGC momentum correction, Lin et al., arXiv:1712.01887).
The rest is the script's own: the model, the data split by rank,
evaluation, and the recovery loop around ``opt.step()``.

Run P copies against running servers (``gtopk-server``, see the README),
one per rank::

    PYTHONPATH=build/python /usr/bin/python3 \\
        examples/pytorch/train_fashion_mnist.py --server 127.0.0.1:50051 \\
        --rank 0 --epochs 1

or let the local launcher start servers and workers::

    deploy/local/gtopk_local.py --worker python --workers 2 --epochs 1
    make demo WORKER=python

The servers own the optimizer's configuration (mode, density, lr,
momentum, ...); ``--lr``, ``--momentum``, ``--mode``, ``--density`` here are
checks against it. Flags, stdout lines and ``--summary-json`` are those of
``gtopk-worker`` (worker/flags.md), so the launcher runs either. The model is
the same architecture as ``gtopk-worker --model=cnn`` (n = 317,066), with
the same initialisation, data order and normalisation, so the two are
comparable (with ``--cpu-isa=portable`` and the same ``--threads``, even
bit-identical).

Data: Debian's ``dataset-fashion-mnist`` (``/usr/share/datasets/
fashion-mnist``, gzipped IDX files), read with gzip/struct/numpy; nothing is
downloaded.

Environment (when the flags are not given): ``GTOPK_LEADER`` (or
``GTOPK_SERVER``) for ``--server``; ``RANK`` or ``JOB_COMPLETION_INDEX`` for
``--rank``; ``WORLD_SIZE`` is checked against the cluster;
``GTOPK_METRICS_PORT`` for ``--metrics-port``; ``GTOPK_TLS``,
``GTOPK_TLS_CERT``, ``GTOPK_TLS_KEY``, ``GTOPK_TLS_CA`` and
``GTOPK_TOKEN_FILE`` for the transport-security flags (as gtopk-worker's,
docs/security.md; ``--tls`` or ``GTOPK_TLS`` is required).

Exit status: 0 on success; 1 on an error (printed as ``CODE: message`` on
stderr), including final parameters that differ from the servers'; 2 for
bad flags.
"""

import argparse
import gzip
import json
import math
import os
import resource
import struct
import sys
import time

# -- flags (before torch is imported: --cpu-isa sets its environment) -------

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
PIXEL_MEAN = 0.2860   # as gtopk-worker (worker/trainer/model.h)
PIXEL_STD = 0.3530
IMAGE_SIDE = 28
IMAGE_PIXELS = IMAGE_SIDE * IMAGE_SIDE
CLASSES = 10
DEFAULT_RECOVERY_STEPS = 4  # recovery budget in step timeouts (gtopk-worker)

# What --cpu-isa=portable pins (worker/trainer/cpu_isa.cc): ATen's kernels,
# oneDNN's instruction set and an optimised BLAS to AVX2, read by those
# libraries when torch is imported -- so set before that.
PORTABLE_CPU_PINS = (
    ("ATEN_CPU_CAPABILITY", "avx2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),
    ("DNNL_MAX_CPU_ISA", "AVX2"),
    ("OPENBLAS_CORETYPE", "Haswell"),
    ("MKL_CBWR", "AVX2"),
)


class Failure(Exception):
    """Ends the run: printed as '<CODE>: <message>' on stderr, exit 1."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code, message))


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="One gTop-k worker training a CNN on Fashion-MNIST "
        "(flags as gtopk-worker's, worker/flags.md).")
    p.add_argument("--server", default=None,
                   help="leader (shard 0) host:port; default $GTOPK_LEADER, "
                   "then $GTOPK_SERVER")
    p.add_argument("--rank", type=int, default=-1,
                   help="rank to take; -1: $RANK or $JOB_COMPLETION_INDEX "
                   "if set, else any free rank")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"],
                   help="the script's CNN (as gtopk-worker's cnn) or an "
                   "MLP 784-256-10 (as its mlp)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per step per worker")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0,
                   help="> 0: at most this many steps in all")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--train-limit", type=int, default=0,
                   help="use the first N training samples (0: all)")
    p.add_argument("--test-limit", type=int, default=0,
                   help="use the first N test samples (0: all)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="rank 0 also evaluates every N steps (0: per epoch "
                   "and at the end only)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the initialisation and the shuffles")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads")
    p.add_argument("--cpu-isa", default="portable",
                   choices=["portable", "native"],
                   help="portable: pin torch's CPU kernels to AVX2 (results "
                   "bit-identical on any AVX2 CPU); native: torch chooses")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: train on CUDA device 0 (needs a CUDA build "
                   "of PyTorch and of gtopk)")
    p.add_argument("--summary-json", default="",
                   help="write this rank's summary here")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the worker metrics on this port (0: off; "
                   "default $GTOPK_METRICS_PORT, else off)")
    p.add_argument("--metrics-host", default="0.0.0.0")
    # Transport security (docs/security.md), as gtopk-worker's flags.
    p.add_argument("--tls", default=None, choices=["off", "server", "mutual"],
                   help="required (or $GTOPK_TLS): mutual TLS, TLS, or off "
                   "(plaintext on a trusted network, with a WARNING)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate of this worker (CN gtopk-worker or "
                   "gtopk-worker-<rank>); default $GTOPK_TLS_CERT")
    p.add_argument("--tls-key", default=None,
                   help="PEM key of --tls-cert; default $GTOPK_TLS_KEY")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle of the shards' certificates; default "
                   "$GTOPK_TLS_CA")
    p.add_argument("--token-file", default=None,
                   help="file holding the workers' shared token (never the "
                   "token itself); default $GTOPK_TOKEN_FILE")
    p.add_argument("--rpc-timeout-s", type=float, default=60,
                   help="deadline of the join and of each parameter RPC")
    p.add_argument("--recovery-timeout", type=float, default=None,
                   help="seconds to recover a failed step (0: none; "
                   "default 4 x the servers' step timeout)")
    # Checks against the servers' cluster spec.
    p.add_argument("--mode", default=None,
                   choices=["gtopk", "topk", "dense"])
    p.add_argument("--selector", default=None)
    p.add_argument("--density", type=float, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--momentum-mode", default=None,
                   choices=["none", "dgc", "global"])
    p.add_argument("--index-codec", default=None)
    p.add_argument("--value-codec", default=None)
    args = p.parse_args([_dash_flag(a) for a in argv])
    errors = []
    if args.batch_size < 1 or args.batch_size > 65536:
        errors.append("--batch-size must be in [1, 65536]")
    if args.epochs < 1:
        errors.append("--epochs must be >= 1")
    for flag in ("steps", "train_limit", "test_limit", "eval_every"):
        if getattr(args, flag) < 0:
            errors.append("--%s must be >= 0" % flag.replace("_", "-"))
    if args.threads < 1:
        errors.append("--threads must be >= 1")
    if args.rank < -1:
        errors.append("--rank must be >= -1")
    if args.recovery_timeout is not None and args.recovery_timeout < 0:
        errors.append("--recovery-timeout must be >= 0")
    if errors:
        p.error("; ".join(errors))
    if args.server is None:
        args.server = os.environ.get("GTOPK_LEADER") or \
            os.environ.get("GTOPK_SERVER")
    if not args.server:
        p.error("--server (leader host:port) is required (or set "
                "GTOPK_LEADER)")
    return args


def _dash_flag(arg):
    """--batch_size=32 -> --batch-size=32 (gtopk-worker accepts both)."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def apply_cpu_isa(isa):
    """Environment for --cpu-isa (before torch is imported); a note for
    stderr."""
    if isa == "native":
        return ("--cpu-isa=native: torch chooses the CPU kernels for this "
                "machine (results may differ on another CPU)")
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        raise Failure("FAILED_PRECONDITION",
                      "--cpu-isa=portable pins x86-64 AVX2 kernels; on this "
                      "architecture use --cpu-isa=native")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        flags = ["avx2", "fma"]  # cannot tell: let torch decide
    if "avx2" not in flags or "fma" not in flags:
        raise Failure("FAILED_PRECONDITION",
                      "--cpu-isa=portable pins torch to its AVX2 kernels, and "
                      "this CPU has no AVX2/FMA; use --cpu-isa=native "
                      "(results then depend on the CPU)")
    for name, value in PORTABLE_CPU_PINS:
        os.environ[name] = value
    return "--cpu-isa=portable: " + " ".join(
        "%s=%s" % nv for nv in PORTABLE_CPU_PINS)


# -- data ---------------------------------------------------------------------


def read_idx(path, magic, dims):
    """A gzipped or plain IDX file as a numpy uint8 array."""
    import numpy as np
    candidates = [path, path[:-3]] if path.endswith(".gz") else \
        [path + ".gz", path]
    for candidate in candidates:
        if os.path.exists(candidate):
            break
    else:
        raise Failure("NOT_FOUND",
                      "%s not found (Debian package dataset-fashion-mnist; "
                      "or --data-dir)" % candidates[0])
    opener = gzip.open if candidate.endswith(".gz") else open
    try:
        with opener(candidate, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise Failure("DATA_LOSS", "%s: %s" % (candidate, e))
    if len(data) < 4 + 4 * dims or \
            struct.unpack(">I", data[:4])[0] != magic:
        raise Failure("INVALID_ARGUMENT",
                      "%s: not an IDX file with magic 0x%08x" % (candidate,
                                                                 magic))
    shape = struct.unpack(">%dI" % dims, data[4:4 + 4 * dims])
    count = 1
    for d in shape:
        count *= d
    body = data[4 + 4 * dims:]
    if len(body) != count:
        raise Failure("DATA_LOSS", "%s: %d bytes of data for shape %s" % (
            candidate, len(body), shape))
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def load_split(data_dir, prefix, limit):
    """(images [N, 28, 28] uint8, labels [N] int64) after --*-limit."""
    import numpy as np
    images = read_idx(os.path.join(data_dir, "%s-images-idx3-ubyte.gz"
                                   % prefix), 0x00000803, 3)
    labels = read_idx(os.path.join(data_dir, "%s-labels-idx1-ubyte.gz"
                                   % prefix), 0x00000801, 1)
    if images.shape[0] != labels.shape[0] or \
            images.shape[1:] != (IMAGE_SIDE, IMAGE_SIDE):
        raise Failure("INVALID_ARGUMENT", "%s: %d images of %s, %d labels" % (
            data_dir, images.shape[0], images.shape[1:], labels.shape[0]))
    if limit > 0:
        images, labels = images[:limit], labels[:limit]
    return images, labels.astype(np.int64)


def normalise(pixels):
    """uint8 pixels -> float32, scaled to [0, 1] and standardised, in
    float32 arithmetic as gtopk-worker does."""
    import numpy as np
    f = np.float32
    x = pixels.astype(f) * (f(1.0) / f(255.0))
    return (x - f(PIXEL_MEAN)) / f(PIXEL_STD)


# The per-epoch shuffle, identical on every rank and to gtopk-worker's
# (worker/trainer/trainer.cc EpochPermutation): Fisher-Yates driven by
# std::mt19937_64 seeded with SplitMix64(seed, 0x5f0000 + epoch).
_M64 = (1 << 64) - 1


def mix_seed(seed, stream):
    z = (seed + 0x9E3779B97F4A7C15 * (stream + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class MT19937_64:
    """std::mt19937_64 (its output is fixed by the C++ standard), with
    numpy-vectorised generation of 312 values at a time."""

    N, M = 312, 156

    def __init__(self, seed):
        import numpy as np
        mt = [seed & _M64]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i)
                      & _M64)
        self.mt = np.array(mt, dtype=np.uint64)
        self.out = None
        self.pos = self.N

    def _twist(self):
        import numpy as np
        mt, N, M = self.mt, self.N, self.M
        upper = np.uint64(0xFFFFFFFF80000000)
        lower = np.uint64(0x7FFFFFFF)
        matrix = np.uint64(0xB5026F5AA96619E9)
        one = np.uint64(1)

        def step(i0, i1, src):
            y = (mt[i0:i1] & upper) | (mt[i0 + 1:i1 + 1] & lower)
            return src ^ (y >> one) ^ np.where((y & one) == one, matrix,
                                                np.uint64(0))
        # i in [0, N-M): uses mt[i+M], not yet rewritten.
        mt[0:N - M] = step(0, N - M, mt[M:N])
        # i in [N-M, N-1): uses mt[i+M-N], rewritten above.
        mt[N - M:N - 1] = step(N - M, N - 1, mt[0:M - 1])
        # i = N-1: wraps to mt[0] (new).
        y = (mt[N - 1] & upper) | (mt[0] & lower)
        mt[N - 1] = mt[M - 1] ^ (y >> one) ^ (matrix if int(y) & 1
                                               else np.uint64(0))
        x = mt.copy()
        x ^= (x >> np.uint64(29)) & np.uint64(0x5555555555555555)
        x ^= (x << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        x ^= (x << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        x ^= x >> np.uint64(43)
        self.out = [int(v) for v in x]
        self.pos = 0

    def __call__(self):
        if self.pos >= self.N:
            self._twist()
        v = self.out[self.pos]
        self.pos += 1
        return v


def epoch_permutation(count, seed, epoch):
    """The training set's order for `epoch` (a list of indices)."""
    rng = MT19937_64(mix_seed(seed, 0x5F0000 + epoch))
    perm = list(range(count))
    for i in range(count, 1, -1):
        limit = _M64 - (_M64 % i)  # UniformBelow: rejection, no modulo bias
        x = rng()
        while x >= limit:
            x = rng()
        j = x % i
        perm[i - 1], perm[j] = perm[j], perm[i - 1]
    return perm


# -- the model (the script's own; same architecture as gtopk-worker's cnn) --


def build_model(kind, seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Cnn(nn.Module):
        """conv 5x5 1->32, ReLU, max-pool 2; conv 5x5 32->64, ReLU, max-pool
        2; fc 1024->256, ReLU; fc 256->10; log-softmax. n = 317,066."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 5)
            self.conv2 = nn.Conv2d(32, 64, 5)
            self.fc1 = nn.Linear(1024, 256)
            self.fc2 = nn.Linear(256, CLASSES)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = x.reshape(x.size(0), 1024)
            x = F.relu(self.fc1(x))
            return F.log_softmax(self.fc2(x), dim=1)

    class Mlp(nn.Module):
        """784-256-10, ReLU; log-softmax. n = 203,530."""

        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(IMAGE_PIXELS, 256)
            self.fc2 = nn.Linear(256, CLASSES)

        def forward(self, x):
            x = x.reshape(x.size(0), IMAGE_PIXELS)
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    model = Cnn() if kind == "cnn" else Mlp()
    # The initialisation gtopk-worker uses: uniform(-1/sqrt(fan_in),
    # 1/sqrt(fan_in)) for every weight and bias, in order, from
    # manual_seed(seed) (PyTorch's default draws the same distribution, but
    # computes the bound differently). Only rank 0's values matter: the
    # servers keep them and every rank downloads them.
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.children():
            fan_in = module.weight[0].numel()
            bound = 1.0 / math.sqrt(fan_in)
            module.weight.uniform_(-bound, bound)
            module.bias.uniform_(-bound, bound)
    return model


# -- recovery (as gtopk-worker's, worker/flags.md --recovery-timeout) --------


class Recovery:
    """After a failed step (or parameter check): opt.recover() with backoff
    until it answers, within the budget from the first failure; returns the
    step to continue from, or raises Failure when the error is not
    retryable or the time is up."""

    def __init__(self, opt, rank, budget, step_timeout):
        self.opt = opt
        self.rank = rank
        self.budget = budget
        self.call_time = step_timeout + 1.0
        self.failing = False
        self.first_failure = 0.0
        self.calls = 0
        self.precondition_recovered = False

    def succeeded(self):
        self.failing = False
        self.precondition_recovered = False

    def after_failure(self, failure, what):
        import gtopk
        now = time.monotonic()
        if not self.failing:
            self.failing, self.first_failure, self.calls = True, now, 0
        deadline = self.first_failure + (
            max(self.budget, self.call_time) if self.budget > 0 else 0.0)
        from_recover = False
        step_precondition = isinstance(failure, gtopk.FailedPrecondition)
        while True:
            precondition_again = (
                isinstance(failure, gtopk.FailedPrecondition)
                and not from_recover and self.precondition_recovered)
            retryable = isinstance(failure, gtopk.RETRYABLE + (
                gtopk.Cancelled,)) or (
                isinstance(failure, gtopk.FailedPrecondition)
                and not from_recover and not precondition_again)
            elapsed = time.monotonic() - self.first_failure
            out_of_time = deadline - time.monotonic() < self.call_time
            if not retryable or out_of_time:
                why = ""
                if retryable and self.budget <= 0:
                    why = " (--recovery-timeout=0: no recovery)"
                elif retryable:
                    why = (" (no recovery within --recovery-timeout=%gs: "
                           "%.1f s since the first failure, %d Recover "
                           "call(s))" % (self.budget, elapsed, self.calls))
                elif precondition_again:
                    why = (" (again after a recovery: not a step mismatch; "
                           "%.1f s since the first failure)" % elapsed)
                elif self.calls > 0:
                    why = " (after %.1f s and %d Recover call(s))" % (
                        elapsed, self.calls)
                code = getattr(failure, "code_name", "UNKNOWN")
                message = getattr(failure, "message", str(failure))
                raise Failure(code, "%s: %s%s" % (what, message, why))
            sys.stderr.write(
                "rank %d: %s failed: %s; recovering (%.1f s since the first "
                "failure, %.1f s left, Recover call %d)\n" % (
                    self.rank, what, failure, elapsed,
                    deadline - time.monotonic(), self.calls + 1))
            sys.stderr.flush()
            time.sleep(min(0.1 * (1 << min(self.calls, 4)),
                           max(0.0, deadline - self.call_time
                               - time.monotonic())))
            self.calls += 1
            try:
                nxt = self.opt.recover(
                    timeout=max(deadline - time.monotonic(), self.call_time))
            except gtopk.Error as e:
                failure, from_recover = e, True
                continue
            if step_precondition:
                self.precondition_recovered = True
            return nxt


# -- the run ------------------------------------------------------------------


def print_line(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def json_number(v):
    """A JSON number as gtopk-worker writes it (10 significant digits; null
    for NaN/inf)."""
    if v is None or not math.isfinite(v):
        return None
    return float("%.10g" % v)


def run(args, cpu_note):
    import torch
    try:
        import gtopk.torch
    except ImportError as e:
        raise Failure("FAILED_PRECONDITION", str(e))

    if args.summary_json:
        # Fail now, not after the run: the summary goes through <path>.tmp.
        tmp = args.summary_json + ".tmp"
        try:
            open(tmp, "a").close()
            os.remove(tmp)
        except OSError as e:
            raise Failure("INVALID_ARGUMENT", "--summary-json=%s: cannot "
                          "write %s: %s" % (args.summary_json, tmp, e))
    if cpu_note:
        sys.stderr.write(cpu_note + "\n")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise Failure("FAILED_PRECONDITION", "--device=cuda: this PyTorch "
                      "has no CUDA or sees no CUDA device; use --device=cpu")

    # Model and data first, so local errors come before the join.
    model = build_model(args.model, args.seed).to(device)
    train_x, train_y = load_split(args.data_dir, "train", args.train_limit)
    test_x, test_y = load_split(args.data_dir, "t10k", args.test_limit)

    opt = gtopk.torch.DistributedOptimizer(
        model.parameters(), lr=args.lr, momentum=args.momentum,
        leader=args.server, rank=None if args.rank == -1 else args.rank,
        mode=args.mode, selector=args.selector, density=args.density,
        momentum_mode=args.momentum_mode, index_codec=args.index_codec,
        value_codec=args.value_codec, rpc_timeout=args.rpc_timeout_s,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        recovery_timeout=args.recovery_timeout, tls=args.tls,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        token_file=args.token_file,
        record_step_metrics=False)  # recorded below, with the compute time
    with opt:
        return train(args, opt, model, device, train_x, train_y, test_x,
                     test_y)


def train(args, opt, model, device, train_x, train_y, test_x, test_y):
    """The training loop (as gtopk-worker's, worker/trainer/trainer.cc),
    the final check against the servers and the summary."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import gtopk

    rank, workers, n = opt.rank, opt.world_size, opt.n
    cluster = opt.cluster
    if opt.metrics_port:
        print_line("metrics on %s:%d" % (args.metrics_host, opt.metrics_port))
    leader_rank = rank == 0
    steps_per_epoch = len(train_y) // workers // args.batch_size
    if steps_per_epoch < 1:
        raise Failure("FAILED_PRECONDITION",
                      "training set of %d samples is too small for %d workers "
                      "x --batch-size=%d" % (len(train_y), workers,
                                             args.batch_size))
    total_steps = args.epochs * steps_per_epoch
    if args.steps > 0:
        total_steps = min(total_steps, args.steps)
    if cluster.get("density_warmup") and leader_rank and \
            cluster.get("steps_per_epoch") != steps_per_epoch:
        sys.stderr.write(
            "warning: the servers' --steps-per-epoch=%s differs from this "
            "worker's %d steps per epoch; density warm-up epochs will not "
            "match data epochs\n" % (cluster.get("steps_per_epoch"),
                                     steps_per_epoch))
    step_timeout = cluster.get("step_timeout_ms", 30000) / 1000.0
    budget = args.recovery_timeout if args.recovery_timeout is not None \
        else DEFAULT_RECOVERY_STEPS * step_timeout
    recovery = Recovery(opt, rank, budget, step_timeout)
    start_step = opt.next_step  # the servers' step (0 for a fresh cluster)
    flat = opt.flat_parameters()
    t_start = time.monotonic()

    test_images = None
    if leader_rank:
        test_images = torch.from_numpy(normalise(test_x)).reshape(
            -1, 1, IMAGE_SIDE, IMAGE_SIDE)
        test_labels = torch.from_numpy(test_y)
    state = {"test_accuracy": float("nan"), "last_eval": -1}

    def evaluate(done):
        if not leader_rank or done == state["last_eval"]:
            return
        state["last_eval"] = done
        loss_sum, correct, total = 0.0, 0, len(test_labels)
        model.eval()
        with torch.no_grad():
            for begin in range(0, total, 1000):
                x = test_images[begin:begin + 1000].to(device)
                y = test_labels[begin:begin + 1000].to(device)
                logp = model(x)
                loss_sum += F.nll_loss(logp, y, reduction="sum").item()
                correct += int(logp.argmax(1).eq(y).sum().item())
        model.train()
        accuracy = correct / total if total else 0.0
        state["test_accuracy"] = accuracy
        opt.record_test_accuracy(accuracy)
        print_line("eval step %d test_accuracy %.4f test_loss %.4f" % (
            done, accuracy, loss_sum / total if total else 0.0))

    per_rank = steps_per_epoch * args.batch_size
    perm, perm_epoch = None, -1
    step_seconds, compute_seconds, local_seconds = [], [], []
    # The step's time after backward (opt.step()), as gtopk-worker's
    # exposed_seconds (it overlaps only on layer-wise clusters).
    exposed_seconds = []
    communication_seconds, push_start_unix, pull_end_unix = [], [], []
    # This process's CPU time (user + system, all threads) per step, beside
    # its wall time, as gtopk-worker's summary has it (issue 20).
    cpu_seconds = []
    # The client's phases per step, as gtopk-worker's summary has them.
    phases = ("accumulate", "select", "encode", "push", "wait", "apply")
    phase_seconds = {name: [] for name in phases}
    losses = []
    sent_total = received_total = 0
    loss_value = 0.0
    retry = False  # the failed step again: its gradient is in the residual
    step = start_step
    while True:  # training, then the final check against the servers
        while step < total_steps:
            t0 = time.monotonic()
            cpu0 = time.process_time()
            epoch = step // steps_per_epoch
            if not retry:
                if epoch != perm_epoch:
                    perm = np.array(epoch_permutation(len(train_y), args.seed,
                                                      epoch), dtype=np.int64)
                    perm_epoch = epoch
                base = rank * per_rank + (step % steps_per_epoch) * \
                    args.batch_size
                idx = perm[base:base + args.batch_size]
                x = torch.from_numpy(normalise(train_x[idx])).reshape(
                    -1, 1, IMAGE_SIDE, IMAGE_SIDE).to(device)
                y = torch.from_numpy(train_y[idx]).to(device)
                opt.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise Failure("INTERNAL", "loss is %s at step %d "
                                  "(diverged; lower the servers' --lr)"
                                  % (loss_value, step))
            t_compute = time.monotonic()
            step_call = time.time()
            try:
                opt.step()  # one gTop-k step; a retry sends no new gradient
            except gtopk.Error as e:
                resumed = recovery.after_failure(e, "step %d" % step)
                if resumed != step:
                    sys.stderr.write("rank %d: continuing from step %d\n"
                                     % (rank, resumed))
                retry = resumed == step
                step = resumed
                continue
            recovery.succeeded()
            retry = False
            st = opt.stats
            seconds = time.monotonic() - t0
            compute = t_compute - t0
            opt.record_metrics(compute, seconds, loss_value)
            step_seconds.append(seconds)
            cpu_seconds.append(time.process_time() - cpu0)
            compute_seconds.append(compute)
            exposed_seconds.append(seconds - compute)
            local_seconds.append(st["accumulate_seconds"]
                                 + st["select_seconds"]
                                 + st["encode_seconds"] + st["apply_seconds"])
            for name in phases:
                phase_seconds[name].append(st[name + "_seconds"])
            push_wait = st["push_seconds"] + st["wait_seconds"]
            communication_seconds.append(push_wait)
            push_start = step_call + st["accumulate_seconds"] + \
                st["select_seconds"] + st["encode_seconds"]
            push_start_unix.append(push_start)
            pull_end_unix.append(push_start + push_wait)
            losses.append(loss_value)
            sent = sum(st["bytes_sent"])
            sent_total += sent
            received_total += sum(st["bytes_received"])
            done = step + 1
            if leader_rank:
                print_line(
                    "step %d/%d epoch %d loss %.4f samples/s %.0f sent_bytes "
                    "%d step_ms %.1f" % (
                        done, total_steps, epoch + 1, loss_value,
                        workers * args.batch_size / seconds if seconds > 0
                        else 0.0, sent, seconds * 1e3))
            if done % steps_per_epoch == 0 or (
                    args.eval_every > 0 and done % args.eval_every == 0):
                evaluate(done)
            step += 1
        evaluate(total_steps)
        wall_seconds = time.monotonic() - t_start

        # The final check: the servers' parameters after the last step, into
        # a scratch copy; when a recovery rolled the servers back after this
        # worker's last step, go back and run the missing steps.
        host = flat.detach().to("cpu", copy=True)
        param_checksum = gtopk.checksum(host.numpy())
        resume = -1
        while True:
            scratch = host.clone()
            try:
                synced = opt.client.synchronize_parameters(scratch.numpy())
            except gtopk.Error as e:
                nxt = recovery.after_failure(e, "the final parameter check")
                if nxt < total_steps:
                    resume = nxt  # recover() re-downloaded the parameters
                    break
                continue  # the servers are at the end: check once more
            if synced < total_steps:
                with torch.no_grad():
                    flat.copy_(scratch)
                resume = synced
                break
            server_step = synced
            break
        if resume >= 0:
            sys.stderr.write(
                "rank %d: the servers were rolled back to step %d after this "
                "worker's last step; continuing from step %d\n" % (
                    rank, resume, resume))
            step, retry = resume, False
            state["last_eval"] = -1
            continue
        recovery.succeeded()
        server_checksum = gtopk.checksum(scratch.numpy())
        break

    final_loss = float("nan")
    if losses:
        last = losses[-20:]
        final_loss = sum(last) / len(last)
    p50 = float("nan")
    if step_seconds:
        p50 = sorted(step_seconds)[len(step_seconds) // 2]
    if leader_rank:
        print_line("done steps %d test_accuracy %.4f final_loss %.4f "
                   "wall_seconds %.1f" % (total_steps, state["test_accuracy"],
                                          final_loss, wall_seconds))
    if args.summary_json:
        runs = len(step_seconds)
        per = 1.0 / runs if runs else float("nan")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        summary = {
            "rank": rank,
            "model": args.model,
            "n": n,
            "mode": cluster["mode"],
            "selector": cluster["selector"],
            "density": cluster["density"],
            "workers": workers,
            "shards": opt.num_shards,
            "epochs": json_number(total_steps / steps_per_epoch),
            "steps": total_steps,
            "start_step": start_step,
            "steps_per_epoch": steps_per_epoch,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "cpu_isa": args.cpu_isa,
            "final_loss": json_number(final_loss),
            "test_accuracy": json_number(state["test_accuracy"])
            if leader_rank else None,
            "wall_seconds": json_number(wall_seconds),
            "cpu_user_seconds": json_number(usage.ru_utime),
            "cpu_system_seconds": json_number(usage.ru_stime),
            "step_seconds_p50": json_number(p50),
            "sent_bytes_per_step": json_number(sent_total * per),
            "received_bytes_per_step": json_number(received_total * per),
            "dense_bytes_per_step": 4 * n,
            "param_checksum": param_checksum,
            "server_checksum": server_checksum,
            "per_step": {
                "step_seconds": [json_number(v) for v in step_seconds],
                "compute_seconds": [json_number(v) for v in compute_seconds],
                "exposed_seconds": [json_number(v) for v in exposed_seconds],
                "local_seconds": [json_number(v) for v in local_seconds],
                "cpu_seconds": [json_number(v) for v in cpu_seconds],
                "communication_seconds": [json_number(v) for v in
                                          communication_seconds],
                **{name + "_seconds": [json_number(v) for v in
                                       phase_seconds[name]]
                   for name in phases},
                "push_start_unix": [round(t, 6) for t in push_start_unix],
                "pull_end_unix": [round(t, 6) for t in pull_end_unix],
            },
            "worker": "python",
        }
        tmp = args.summary_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.summary_json)
    if param_checksum != server_checksum:
        raise Failure(
            "INTERNAL",
            "rank %d's final parameters (checksum %s) differ from the "
            "servers' (checksum %s, at step %d): the replicas diverged; the "
            "run's result is not the servers' model (were the shards started "
            "with different settings?)" % (rank, param_checksum,
                                           server_checksum, server_step))
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cpu_note = apply_cpu_isa(args.cpu_isa)
        return run(args, cpu_note)
    except Failure as e:
        sys.stderr.write("%s\n" % e)
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except Exception as e:  # gtopk.Error and the like: code and message
        import gtopk
        if isinstance(e, gtopk.Error):
            sys.stderr.write("%s\n" % e)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
