#!/usr/bin/python3
"""A modern training recipe under gTop-k: AdamW with decoupled weight
decay (none on biases and norm weights), linear warm-up then cosine decay,
gradient clipping on the aggregated gradient, bfloat16 autocast, and a CNN
with BatchNorm -- on Fashion-MNIST, one worker per process.

With the servers started as ``gtopk-server --apply=workers`` the servers
only aggregate: ``opt.synchronize()`` turns each rank's ``.grad`` into the
averaged global top-k gradient (the same on every rank), and each rank then
runs the wrapped ``torch.optim.AdamW`` itself. So anything that works on
``.grad`` or on the optimizer (clipping, schedulers, param groups, AMP)
works as in single-process PyTorch::

    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.synchronize()                       # the gTop-k exchange
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    with opt.skip_synchronize():
        opt.step()                          # AdamW's own step
    sched.step()

Every replica's parameters and buffers (BatchNorm's running statistics,
broadcast from rank 0 with every step) stay bit-identical, so every rank
evaluates the same model and reports the same test accuracy.

``--backend ddp`` runs the same model, data split, optimizer, schedule,
clipping and autocast under ``torch.nn.parallel.DistributedDataParallel``
(gloo, dense all-reduce), configured as torchrun configures it (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE): the baseline gtopk is compared with.

Run it through the local launcher (servers, TLS, logs, summary)::

    deploy/local/gtopk_local.py --worker python-modern --workers 4 --shards 2 \\
        --density 0.01 --epochs 2
    deploy/local/gtopk_local.py --worker python-modern --mode ddp --workers 4 \\
        --epochs 2
    make demo WORKER=python-modern

or by hand, one process per rank, against servers started with
``--apply=workers``::

    GTOPK_LEADER=127.0.0.1:50051 RANK=0 GTOPK_TLS=off \\
        PYTHONPATH=build/python examples/pytorch/train_modern.py --epochs 1
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=2 \\
        examples/pytorch/train_modern.py --backend ddp --epochs 1

Data: Debian's ``dataset-fashion-mnist`` (``/usr/share/datasets/
fashion-mnist``, gzipped IDX files), read with gzip/struct/numpy; the
per-epoch shuffle and the split by rank are those of
``train_fashion_mnist.py`` (and of ``gtopk-worker``): rank r takes the r-th
contiguous slice of each epoch's permutation.

Needs Debian's ``python3-torch`` (hence ``/usr/bin/python3``) and, for
``--backend gtopk``, the gtopk package (``make python``, then
``PYTHONPATH=build/python``).

``--summary-json`` writes this rank's summary: backend, workers,
test_accuracy, final_loss, steps, wall_seconds, step_seconds_p50,
sent_bytes_per_worker_per_step (gtopk: measured; ddp: the dense fp32 size,
an estimate, see ``sent_bytes_source``), n, density, and
``params_checksum`` / ``buffers_checksum`` (64-bit FNV-1a of the parameters'
and of the floating-point buffers' float32 bytes, as ``gtopk.checksum``), so
that a launcher can check every replica ended bit-identical.

Exit status: 0 on success; 1 on an error (printed on stderr); 2 for bad
flags.
"""

import argparse
import gzip
import json
import math
import os
import struct
import sys
import time

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
PIXEL_MEAN = 0.2860
PIXEL_STD = 0.3530
IMAGE_SIDE = 28
CLASSES = 10


class Failure(Exception):
    """Ends the run: printed on stderr, exit 1."""


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="AdamW + warm-up/cosine + clipping + bf16 autocast on a "
        "BatchNorm CNN (Fashion-MNIST), data-parallel with gtopk "
        "(servers started with --apply=workers) or torch DDP (gloo).")
    p.add_argument("--backend", default="gtopk", choices=["gtopk", "ddp"],
                   help="gtopk: gtopk.torch.DistributedOptimizer (leader "
                   "from --server or $GTOPK_LEADER); ddp: "
                   "DistributedDataParallel over gloo (MASTER_ADDR, "
                   "MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0,
                   help="> 0: at most this many steps in all (the schedule "
                   "spans them)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per step per worker")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="AdamW's peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05,
                   help="AdamW's decoupled weight decay (conv and linear "
                   "weights only; none on biases and norm weights)")
    p.add_argument("--warmup-steps", type=int, default=100,
                   help="linear warm-up steps, then cosine decay to 0")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the aggregated gradient's global L2 norm to "
                   "this (0: no clipping)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the initialisation and the shuffles")
    p.add_argument("--train-limit", type=int, default=0,
                   help="use the first N training samples (0: all)")
    p.add_argument("--test-limit", type=int, default=0,
                   help="use the first N test samples (0: all)")
    p.add_argument("--eval-every-epoch", action="store_true",
                   help="also evaluate after each epoch (default: at the "
                   "end only)")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"],
                   help="cnn: the BatchNorm CNN (94,186 parameters); mlp: "
                   "a wide MLP 784-3072-3072-10 (11,882,506 parameters, "
                   "where communication dominates a step; bench/tta)")
    p.add_argument("--mlp-width", type=int, default=None,
                   help="--model=mlp's two hidden layers (default %d; n = "
                   "785 w + w (w + 1) + 10 (w + 1)); bench/tta's --quick "
                   "uses 512" % MLP_HIDDEN)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="the wrapped torch optimizer: adamw (--lr 2e-3 "
                   "suits it), or sgd with momentum 0.9 (--lr 0.05 suits "
                   "it); the same object under every --backend")
    p.add_argument("--ddp-hook", default="none",
                   choices=["none", "fp16", "powersgd"],
                   help="--backend=ddp: the communication hook, as a DDP "
                   "user tunes it: fp16_compress_hook, or powerSGD_hook "
                   "(--powersgd-rank, warm start, error feedback)")
    p.add_argument("--powersgd-rank", type=int, default=1,
                   help="powerSGD_hook's matrix_approximation_rank")
    p.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="powerSGD_hook's start_powerSGD_iter: plain "
                   "all-reduce before it (the documented warm-up)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="> 0: evaluate on the test set every N steps "
                   "(rank 0; the time spent evaluating is left out of "
                   "train_seconds)")
    p.add_argument("--eval-log", default="",
                   help="rank 0 appends one JSON line per evaluation here "
                   "(step, train_seconds, test_accuracy, test_loss), "
                   "flushed as it goes")
    p.add_argument("--time-cap", type=float, default=0,
                   help="> 0: rank 0 stops at the first evaluation at or "
                   "after this many seconds of training (the others are "
                   "stopped by whoever launched them)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads")
    p.add_argument("--no-autocast", action="store_true",
                   help="run the forward in float32 (default: bfloat16 "
                   "autocast)")
    p.add_argument("--summary-json", default="",
                   help="write this rank's summary here")
    p.add_argument("--checkpoint-dir", default="",
                   help="at the end, save {model, opt, sched} to "
                   "DIR/ckpt-<rank>.pt")
    # gtopk backend: where the cluster is and how to reach it.
    p.add_argument("--server", default=None,
                   help="gtopk: leader host:port (default $GTOPK_LEADER)")
    p.add_argument("--rank", type=int, default=-1,
                   help="gtopk: rank to take (-1: $RANK or "
                   "$JOB_COMPLETION_INDEX, else any free rank); ddp: $RANK")
    p.add_argument("--tls", default=None, choices=["off", "server", "mutual"],
                   help="gtopk: transport security (default $GTOPK_TLS)")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--token-file", default=None)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="gtopk: serve the worker metrics on this port")
    p.add_argument("--metrics-host", default=None)
    p.add_argument("--recovery-timeout", type=float, default=120.0,
                   help="gtopk: seconds to keep recovering a failed step")
    args = p.parse_args(argv)
    errors = []
    if args.epochs < 1:
        errors.append("--epochs must be >= 1")
    if not 1 <= args.batch_size <= 65536:
        errors.append("--batch-size must be in [1, 65536]")
    for flag in ("steps", "train_limit", "test_limit", "warmup_steps"):
        if getattr(args, flag) < 0:
            errors.append("--%s must be >= 0" % flag.replace("_", "-"))
    if not args.lr > 0:
        errors.append("--lr must be > 0")
    if args.weight_decay < 0:
        errors.append("--weight-decay must be >= 0")
    if args.clip < 0:
        errors.append("--clip must be >= 0")
    if args.threads < 1:
        errors.append("--threads must be >= 1")
    if args.mlp_width is not None and args.model != "mlp":
        errors.append("--mlp-width is for --model=mlp")
    if args.mlp_width is None:
        args.mlp_width = MLP_HIDDEN
    if args.mlp_width < 1:
        errors.append("--mlp-width must be >= 1")
    if args.eval_every < 0:
        errors.append("--eval-every must be >= 0")
    if args.time_cap < 0:
        errors.append("--time-cap must be >= 0")
    if args.time_cap > 0 and args.eval_every == 0:
        errors.append("--time-cap needs --eval-every (it stops at an "
                      "evaluation)")
    if args.powersgd_rank < 1:
        errors.append("--powersgd-rank must be >= 1")
    if args.powersgd_start_iter < 2:
        errors.append("--powersgd-start-iter must be >= 2 (torch's "
                      "powerSGD_hook needs it with error feedback)")
    if args.ddp_hook != "none" and args.backend != "ddp":
        errors.append("--ddp-hook is for --backend=ddp")
    if errors:
        p.error("; ".join(errors))
    if args.backend == "gtopk" and not args.server:
        args.server = os.environ.get("GTOPK_LEADER") or \
            os.environ.get("GTOPK_SERVER")
        if not args.server:
            p.error("--backend=gtopk: --server (leader host:port) is "
                    "required (or set GTOPK_LEADER)")
    if args.backend == "ddp":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                               "WORLD_SIZE") if not os.environ.get(v)]
        if missing:
            p.error("--backend=ddp: set %s (as torchrun does)"
                    % ", ".join(missing))
    return args


# -- data (as train_fashion_mnist.py) ------------------------------------------


def read_idx(path, magic, dims):
    """A gzipped or plain IDX file as a numpy uint8 array."""
    import numpy as np
    candidates = [path, path[:-3]] if path.endswith(".gz") else \
        [path + ".gz", path]
    for candidate in candidates:
        if os.path.exists(candidate):
            break
    else:
        raise Failure("%s not found (Debian package dataset-fashion-mnist; "
                      "or --data-dir)" % candidates[0])
    opener = gzip.open if candidate.endswith(".gz") else open
    with opener(candidate, "rb") as f:
        data = f.read()
    if len(data) < 4 + 4 * dims or \
            struct.unpack(">I", data[:4])[0] != magic:
        raise Failure("%s: not an IDX file with magic 0x%08x"
                      % (candidate, magic))
    shape = struct.unpack(">%dI" % dims, data[4:4 + 4 * dims])
    count = 1
    for d in shape:
        count *= d
    body = data[4 + 4 * dims:]
    if len(body) != count:
        raise Failure("%s: %d bytes of data for shape %s"
                      % (candidate, len(body), shape))
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
        raise Failure("%s: %d images of %s, %d labels" % (
            data_dir, images.shape[0], images.shape[1:], labels.shape[0]))
    if limit > 0:
        images, labels = images[:limit], labels[:limit]
    return images, labels.astype(np.int64)


def normalise(pixels):
    """uint8 pixels -> float32 [N, 1, 28, 28], standardised."""
    import numpy as np
    f = np.float32
    x = pixels.astype(f) * (f(1.0) / f(255.0))
    x = (x - f(PIXEL_MEAN)) / f(PIXEL_STD)
    return x.reshape(-1, 1, IMAGE_SIDE, IMAGE_SIDE)


# The per-epoch shuffle of train_fashion_mnist.py and gtopk-worker
# (worker/trainer/trainer.cc EpochPermutation): Fisher-Yates driven by
# std::mt19937_64 seeded with SplitMix64(seed, 0x5f0000 + epoch).
_M64 = (1 << 64) - 1


def mix_seed(seed, stream):
    z = (seed + 0x9E3779B97F4A7C15 * (stream + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class MT19937_64:
    """std::mt19937_64, 312 values at a time with numpy."""

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
        mt[0:N - M] = step(0, N - M, mt[M:N])
        mt[N - M:N - 1] = step(N - M, N - 1, mt[0:M - 1])
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
    """The training set's order for `epoch` (a list of indices), the same
    on every rank."""
    rng = MT19937_64(mix_seed(seed, 0x5F0000 + epoch))
    perm = list(range(count))
    for i in range(count, 1, -1):
        limit = _M64 - (_M64 % i)
        x = rng()
        while x >= limit:
            x = rng()
        j = x % i
        perm[i - 1], perm[j] = perm[j], perm[i - 1]
    return perm


# -- model, param groups, schedule ---------------------------------------------


def build_model(seed):
    """Three conv 3x3 blocks (conv without bias, BatchNorm, ReLU; max-pool
    after the first two), global average pooling, a linear head.
    n = 94,186 parameters; 6 BatchNorm buffers (running mean/var and the
    batch counters)."""
    import torch
    import torch.nn as nn

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    torch.manual_seed(seed)  # every rank builds the same initial model
    return nn.Sequential(
        *block(1, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, CLASSES))


MLP_HIDDEN = 3072


def build_mlp(seed, width=MLP_HIDDEN):
    """A wide MLP: 784 -> width -> width -> 10 with ReLU, no buffers. At the
    default width 3072, n = 11,882,506 parameters: big enough that a dense
    fp32 all-reduce of its gradient (48 MB) dominates a CPU step on a
    1 Gbit/s link."""
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    side = IMAGE_SIDE * IMAGE_SIDE
    return nn.Sequential(
        nn.Flatten(), nn.Linear(side, width), nn.ReLU(inplace=True),
        nn.Linear(width, width), nn.ReLU(inplace=True),
        nn.Linear(width, CLASSES))


def param_groups(model, weight_decay):
    """AdamW's groups: weight decay on conv and linear weights only; none on
    biases and on normalisation layers' weights (the usual recipe)."""
    import torch.nn as nn
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                  nn.LayerNorm)
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, norm_types) or name == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps, total_steps):
    """LambdaLR's factor: linear from 1/warmup to 1 over the warm-up, then
    a cosine to 0 at total_steps."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def step_split(phases, step_seconds, compute_probe):
    """Median seconds per step of each phase (past the first 10% of the
    steps, the warm-up): gtopk's own split, or for DDP compute =
    compute_probe and communication = forward_backward - compute_probe
    (DDP all-reduces during backward) with the rest as other."""
    def median(values):
        values = sorted(values)
        return values[len(values) // 2] if values else None
    begin = len(phases) // 10
    phases, step_seconds = phases[begin:], step_seconds[begin:]
    if not phases:
        return {}
    if "forward_backward" in phases[0]:
        probe = compute_probe or 0.0
        rows = [{"compute": probe,
                 "selection": 0.0,
                 "hidden": 0.0,
                 "communication": max(0.0, p["forward_backward"] - probe),
                 "other": max(0.0, p["step"] - p["forward_backward"])}
                for p in phases]
    else:
        rows = phases
    out = {k: json_number(median([r[k] for r in rows])) for k in rows[0]}
    out["step"] = json_number(median(step_seconds))
    return out


# -- checksums -----------------------------------------------------------------


def fnv1a64_hex(data):
    """64-bit FNV-1a of `data` as 16 hex digits: gtopk.checksum's value,
    for when the gtopk package is not there (--backend ddp)."""
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & _M64
    return "%016x" % h


def checksum(tensors):
    """Checksum of the tensors' values as float32, concatenated in order
    (parameters: model.parameters() order; buffers: the floating-point
    ones, model.buffers() order)."""
    import numpy as np
    import torch
    parts = [t.detach().to("cpu", dtype=torch.float32).reshape(-1).numpy()
             for t in tensors]
    flat = np.ascontiguousarray(np.concatenate(parts) if parts
                                else np.zeros(0, np.float32))
    try:
        import gtopk
        return gtopk.checksum(flat)
    except ImportError:
        return fnv1a64_hex(flat.tobytes())


# -- the run -------------------------------------------------------------------


def print_line(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def json_number(v):
    if v is None or not math.isfinite(v):
        return None
    return float("%.10g" % v)


class GtopkBackend:
    """gtopk.torch.DistributedOptimizer around AdamW (servers with
    --apply=workers)."""

    name = "gtopk"

    def __init__(self, args, model, inner):
        try:
            import gtopk
            import gtopk.torch
        except ImportError as e:
            raise Failure("the gtopk package is not importable (%s); build "
                          "it with `make python` and set "
                          "PYTHONPATH=build/python" % e)
        self.gtopk = gtopk
        kwargs = {}
        for key in ("tls", "tls_cert", "tls_key", "tls_ca", "token_file",
                    "metrics_port", "metrics_host"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        self.opt = gtopk.torch.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), model=model,
            backward_passes_per_step=1, leader=args.server,
            rank=None if args.rank == -1 else args.rank, **kwargs)
        self.model = model
        self.recovery_timeout = args.recovery_timeout
        self.rank = self.opt.rank
        self.workers = self.num_workers()
        self.sent = []

    def num_workers(self):
        for attr in ("num_workers", "world_size"):
            v = getattr(self.opt, attr, None)
            if isinstance(v, int):
                return v
        return self.opt.client.num_workers

    def cluster(self):
        c = self.opt.client.cluster
        return c() if callable(c) else c

    @property
    def optimizer(self):
        return self.opt

    def train_module(self):
        return self.model

    def synchronize(self):
        """The gTop-k exchange, retried through opt.recover() (a restarting
        shard or leader) within --recovery-timeout."""
        gtopk = self.gtopk
        deadline = time.monotonic() + self.recovery_timeout
        while True:
            try:
                self.opt.synchronize()
                break
            except gtopk.RETRYABLE as e:
                if time.monotonic() > deadline:
                    raise
                sys.stderr.write("rank %d: synchronize failed (%s); "
                                 "recovering\n" % (self.rank, e))
                self.opt.recover()
        stats = self.opt.stats or {}
        self.sent.append(sum(stats.get("bytes_sent", []) or [0]))

    def step_phases(self, compute, step):
        """One step's split (seconds): compute (forward + backward),
        selection (error feedback, top-k, encoding), communication (pushes
        and the wait for the pulls), other (the optimizer, the rest).
        Overlapped steps (--selection=layerwise servers): selection and most
        of the communication run during backward; communication is then
        what backward's end still waited for (exposed_seconds, taken out of
        the timed forward + backward), hidden the selection and
        communication time that backward covered."""
        st = self.opt.stats or {}
        selection = sum(st.get(k, 0.0) or 0.0 for k in (
            "accumulate_seconds", "select_seconds", "encode_seconds"))
        communication = (st.get("push_seconds", 0.0) or 0.0) + \
            (st.get("wait_seconds", 0.0) or 0.0)
        exposed = st.get("exposed_seconds", 0.0) or 0.0
        if exposed > 0.0:
            # The overlapped exchange ends inside backward (autograd's
            # end-of-pass callback): its wait is in `compute` as timed.
            compute = max(0.0, compute - exposed)
            return {"compute": compute, "selection": 0.0,
                    "communication": exposed,
                    "hidden": max(0.0, selection + communication - exposed),
                    "other": max(0.0, step - compute - exposed)}
        return {"compute": compute, "selection": selection,
                "communication": communication, "hidden": 0.0,
                "other": max(0.0, step - compute - selection -
                             communication)}

    def step(self, clip, params):
        self.synchronize()
        if clip > 0:
            import torch
            torch.nn.utils.clip_grad_norm_(params, clip)
        with self.opt.skip_synchronize():
            self.opt.step()

    def finish(self):
        pass

    def summary_fields(self, n):
        density = None
        try:
            density = self.cluster().get("density")
        except Exception:  # noqa: BLE001 - reported as null
            pass
        sent = sum(self.sent) / len(self.sent) if self.sent else None
        return {"density": density,
                "sent_bytes_per_worker_per_step": json_number(sent),
                "sent_bytes_source": "measured: gtopk opt.stats bytes_sent, "
                "mean over steps",
                "dense_bytes_per_worker_per_step": 4 * n}

    def close(self):
        close = getattr(self.opt, "close", None)
        if close:
            close()


class DdpBackend:
    """DistributedDataParallel over gloo, torchrun's environment."""

    name = "ddp"

    def __init__(self, args, model, inner):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        self.dist = dist
        dist.init_process_group("gloo", init_method="env://")
        self.rank = dist.get_rank()
        self.workers = dist.get_world_size()
        if args.rank not in (-1, self.rank):
            raise Failure("--rank=%d but $RANK=%d" % (args.rank, self.rank))
        self.model = model
        # broadcast_buffers (default True): rank 0's BatchNorm statistics
        # at the start of every forward, as gtopk broadcasts them.
        kwargs = {}
        if args.ddp_hook == "powersgd":
            # One bucket: torch 1.13's powerSGD_hook issues its P and Q
            # all-reduces from the futures' callbacks, and with two or more
            # buckets gloo sees them in another order on each rank (gloo
            # "op.preamble.length <= op.nbytes", or a hang). DDP's own knobs
            # (bucket_cap_mb, and the first bucket's size, which torch says
            # users may set) put every gradient in one bucket.
            total_mb = sum(p.numel() * p.element_size()
                           for p in model.parameters()) / 2 ** 20
            kwargs["bucket_cap_mb"] = math.ceil(total_mb) + 1
            dist._DEFAULT_FIRST_BUCKET_BYTES = int(
                kwargs["bucket_cap_mb"] * 2 ** 20)
        self.ddp = DistributedDataParallel(model, **kwargs)
        self.hook = args.ddp_hook
        self.rank_of_hook = args.powersgd_rank
        if args.ddp_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import \
                default_hooks
            self.ddp.register_comm_hook(None,
                                        default_hooks.fp16_compress_hook)
        elif args.ddp_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import \
                powerSGD_hook
            # The settings torch's documentation recommends: error feedback
            # and warm start on, plain all-reduce for the first iterations.
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=args.powersgd_start_iter,
                use_error_feedback=True, warm_start=True,
                random_seed=args.seed)
            self.ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self.opt = inner

    @property
    def optimizer(self):
        return self.opt

    def train_module(self):
        return self.ddp

    def step_phases(self, compute, step):
        """One step's split (seconds). DDP communicates during backward,
        so compute is the local forward + backward measured alone before
        training (compute_probe) and communication what the step took
        beyond it (the hook's compression included), less the optimizer."""
        return {"forward_backward": compute, "step": step}

    def step(self, clip, params):
        # DDP averaged the gradients during backward().
        if clip > 0:
            import torch
            torch.nn.utils.clip_grad_norm_(params, clip)
        self.opt.step()

    def finish(self):
        """The last forward updated each rank's BatchNorm statistics from
        its own batch; DDP would broadcast rank 0's at the next forward, so
        do it now: every rank then evaluates rank 0's model."""
        for b in self.model.buffers():
            self.dist.broadcast(b.data, src=0)

    def summary_fields(self, n):
        if self.hook == "fp16":
            sent, what = 2 * n, "the fp16 gradient, 2 * n bytes"
        elif self.hook == "powersgd":
            sent, what = self.powersgd_bytes(), (
                "PowerSGD's P and Q factors of every matrix (4 bytes * rank "
                "* (rows + cols)) plus the vectors it all-reduces whole")
        else:
            sent, what = 4 * n, "the dense fp32 gradient, 4 * n bytes"
        return {"density": 1.0,
                "ddp_hook": self.hook,
                "sent_bytes_per_worker_per_step": sent,
                "sent_bytes_source": "estimate: %s (gloo's ring all-reduce "
                "sends about 2 * (P - 1) / P of it, plus BatchNorm buffers "
                "from rank 0)" % what,
                "dense_bytes_per_worker_per_step": 4 * n}

    def powersgd_bytes(self):
        """PowerSGD's all-reduced bytes per step after its warm-up: each
        >= 2-D gradient as a rows x cols matrix sends rank * (rows + cols)
        floats (P, then Q); 1-D tensors (biases) go whole."""
        rank = self.rank_of_hook
        total = 0
        for p in self.model.parameters():
            if p.dim() > 1:
                rows = p.shape[0]
                cols = math.prod(p.shape[1:])
                total += 4 * min(rank, rows, cols) * (rows + cols)
            else:
                total += 4 * p.numel()
        return total

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def run(args):
    try:
        import numpy as np
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        raise Failure("%s: cannot import torch/numpy (%s); run it with "
                      "Debian's /usr/bin/python3 and python3-torch "
                      "(apt-get install python3-torch)" % (sys.executable, e))
    torch.set_num_threads(args.threads)
    if args.summary_json:
        tmp = args.summary_json + ".tmp"
        try:
            open(tmp, "a").close()
            os.remove(tmp)
        except OSError as e:
            raise Failure("--summary-json=%s: cannot write %s: %s"
                          % (args.summary_json, tmp, e))

    # Model and data first, so local errors come before joining anything.
    model = (build_mlp(args.seed, args.mlp_width) if args.model == "mlp"
             else build_model(args.seed))
    train_x, train_y = load_split(args.data_dir, "train", args.train_limit)
    test_x, test_y = load_split(args.data_dir, "t10k", args.test_limit)
    groups = param_groups(model, args.weight_decay)
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(groups, lr=args.lr, momentum=0.9)
    else:
        inner = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999),
                                  eps=1e-8)
    # Local compute alone (forward and backward, no communication), before
    # anything is joined: the reference the step split is measured against.
    compute_probe = probe_compute(args, model, train_x, train_y, torch, F)
    backend = (GtopkBackend if args.backend == "gtopk" else DdpBackend)(
        args, model, inner)
    try:
        return train(args, backend, model, inner, train_x, train_y, test_x,
                     test_y, np, torch, F, compute_probe)
    finally:
        backend.close()


def probe_compute(args, model, train_x, train_y, torch, F, steps=5):
    """Median seconds of a local forward + backward of one batch (no
    communication, gradients discarded): the compute part of a step."""
    x = torch.from_numpy(normalise(train_x[:args.batch_size]))
    y = torch.from_numpy(train_y[:args.batch_size])
    times = []
    autocast = not args.no_autocast
    for _ in range(steps):
        t0 = time.monotonic()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        times.append(time.monotonic() - t0)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def train(args, backend, model, inner, train_x, train_y, test_x, test_y, np,
          torch, F, compute_probe=None):
    rank, workers = backend.rank, backend.workers
    steps_per_epoch = len(train_y) // workers // args.batch_size
    if steps_per_epoch < 1:
        raise Failure("training set of %d samples is too small for %d "
                      "workers x --batch-size=%d" % (len(train_y), workers,
                                                     args.batch_size))
    total_steps = args.epochs * steps_per_epoch
    if args.steps > 0:
        total_steps = min(total_steps, args.steps)
    opt = backend.optimizer
    # The scheduler drives the wrapped AdamW's param groups' lr (any
    # torch scheduler works: each rank steps its own AdamW).
    sched = torch.optim.lr_scheduler.LambdaLR(
        inner, warmup_cosine(args.warmup_steps, total_steps))
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    net = backend.train_module()
    autocast = not args.no_autocast
    test_images = torch.from_numpy(normalise(test_x))
    test_labels = torch.from_numpy(test_y)
    if rank == 0:
        print_line("backend %s workers %d n %d steps %d (%d per epoch) "
                   "batch %d lr %g weight_decay %g warmup %d clip %g "
                   "autocast %s" % (
                       backend.name, workers, n, total_steps,
                       steps_per_epoch, args.batch_size, args.lr,
                       args.weight_decay, args.warmup_steps, args.clip,
                       "bf16" if autocast else "off"))

    eval_seconds = [0.0]  # time spent evaluating (not training)

    def evaluate(done, every_rank=True):
        """Test accuracy and loss after `done` steps. The evaluations of
        --eval-every run on rank 0 only (every_rank=False: the others wait
        for it in their next step, so it may use their cores); the final
        one on every rank (each reports it)."""
        t_eval = time.monotonic()
        if not every_rank:
            if rank != 0:
                return None, None
            torch.set_num_threads(max(args.threads, os.cpu_count() or 1))
        model.eval()
        correct, loss_sum, total = 0, 0.0, len(test_labels)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                             enabled=autocast):
            for begin in range(0, total, 1000):
                logits = model(test_images[begin:begin + 1000]).float()
                y = test_labels[begin:begin + 1000]
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int(logits.argmax(1).eq(y).sum().item())
        model.train()
        torch.set_num_threads(args.threads)
        acc = correct / total if total else 0.0
        test_loss = loss_sum / total if total else 0.0
        train_seconds = t_eval - t_start - eval_seconds[0]
        eval_seconds[0] += time.monotonic() - t_eval
        if rank == 0:
            print_line("eval step %d test_accuracy %.4f test_loss %.4f "
                       "train_seconds %.1f" % (done, acc, test_loss,
                                               train_seconds))
            if args.eval_log:
                with open(args.eval_log, "a") as f:
                    f.write(json.dumps({
                        "step": done, "epoch": done / steps_per_epoch,
                        "train_seconds": json_number(train_seconds),
                        "test_accuracy": json_number(acc),
                        "test_loss": json_number(test_loss)}) + "\n")
        return acc, train_seconds

    per_rank = steps_per_epoch * args.batch_size
    perm, perm_epoch = None, -1
    step_seconds, losses, phases = [], [], []
    t_start = time.monotonic()
    model.train()
    if args.eval_every > 0:
        evaluate(0, every_rank=False)
    capped = False
    for step in range(total_steps):
        t0 = time.monotonic()
        epoch = step // steps_per_epoch
        if epoch != perm_epoch:
            perm = np.array(epoch_permutation(len(train_y), args.seed, epoch),
                            dtype=np.int64)
            perm_epoch = epoch
        base = rank * per_rank + (step % steps_per_epoch) * args.batch_size
        idx = perm[base:base + args.batch_size]
        x = torch.from_numpy(normalise(train_x[idx]))
        y = torch.from_numpy(train_y[idx])
        lr = inner.param_groups[0]["lr"]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        t_backward = time.monotonic()
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise Failure("loss is %s at step %d (diverged; lower --lr)"
                          % (loss_value, step))
        backend.step(args.clip, params)
        sched.step()
        seconds = time.monotonic() - t0
        step_seconds.append(seconds)
        losses.append(loss_value)
        phases.append(backend.step_phases(t_backward - t0, seconds))
        done = step + 1
        if rank == 0:
            print_line("step %d/%d epoch %d loss %.4f lr %.3g step_ms %.1f"
                       % (done, total_steps, epoch + 1, loss_value,
                          lr, seconds * 1e3))
        if done < total_steps and (
                (args.eval_every_epoch and done % steps_per_epoch == 0) or
                (args.eval_every > 0 and done % args.eval_every == 0)):
            _, trained = evaluate(done, every_rank=False)
            # Rank 0 decides (the others stop when it does: the launcher
            # ends them).
            if rank == 0 and args.time_cap > 0 and \
                    trained >= args.time_cap:
                capped = True
                break
    steps_done = len(step_seconds)
    if capped:
        # Stopped at the evaluation just made; the other ranks are stopped
        # by the launcher (nothing collective after this).
        accuracy, train_seconds = _, trained
    else:
        backend.finish()
    wall_seconds = time.monotonic() - t_start
    if not capped:
        accuracy, train_seconds = evaluate(steps_done)

    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    params_checksum = checksum(params)
    buffers_checksum = checksum(float_buffers)
    split = step_split(phases, step_seconds, compute_probe)
    last = losses[-20:]
    final_loss = sum(last) / len(last) if last else float("nan")
    p50 = sorted(step_seconds)[len(step_seconds) // 2] if step_seconds \
        else float("nan")
    if rank == 0:
        print_line("done steps %d test_accuracy %.4f final_loss %.4f "
                   "wall_seconds %.1f%s" % (steps_done, accuracy, final_loss,
                                            wall_seconds,
                                            " (time cap)" if capped else ""))
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict()},
                   os.path.join(args.checkpoint_dir, "ckpt-%d.pt" % rank))
    if args.summary_json:
        summary = {
            "backend": backend.name,
            "rank": rank,
            "workers": workers,
            "n": n,
            "steps": steps_done,
            "planned_steps": total_steps,
            "capped": capped,
            "time_cap": args.time_cap,
            "train_seconds": json_number(train_seconds),
            "eval_seconds": json_number(eval_seconds[0]),
            "model": args.model,
            "optimizer": args.optimizer,
            "steps_per_epoch": steps_per_epoch,
            "epochs": json_number(steps_done / steps_per_epoch),
            "compute_probe_seconds": json_number(compute_probe),
            "step_split_p50": split,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "warmup_steps": args.warmup_steps,
            "clip": args.clip,
            "autocast": "bf16" if autocast else "off",
            "seed": args.seed,
            "train_limit": args.train_limit,
            "test_limit": args.test_limit,
            "test_samples": len(test_labels),
            "test_accuracy": json_number(accuracy),
            "final_loss": json_number(final_loss),
            "wall_seconds": json_number(wall_seconds),
            "step_seconds_p50": json_number(p50),
            **backend.summary_fields(n),
            "params_checksum": params_checksum,
            "buffers_checksum": buffers_checksum,
            "per_step": {
                "step_seconds": [json_number(v) for v in step_seconds],
                "loss": [json_number(v) for v in losses],
            },
        }
        tmp = args.summary_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.summary_json)
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except Failure as e:
        sys.stderr.write("error: %s\n" % e)
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except Exception as e:  # gtopk.Error: its code and message
        gtopk = sys.modules.get("gtopk")
        if gtopk is not None and isinstance(e, gtopk.Error):
            sys.stderr.write("%s\n" % e)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
