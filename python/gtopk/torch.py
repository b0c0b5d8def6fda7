"""gtopk for PyTorch: :class:`DistributedOptimizer`, an optimizer that makes
each training step one gTop-k step of a gtopk cluster.

gTop-k S-SGD (Shi et al., "A Distributed Synchronous SGD Algorithm with
Global Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019,
arXiv:1901.04359): every worker sends only the k largest entries of its
accumulated gradient (the rest stays in its residual, error feedback),
sharded ``gtopk-server`` processes keep only the global top-k of the sum,
and every worker applies that same sparse update, so the replicas stay
bit-identical. Momentum correction, momentum factor masking and density
warm-up are those of Deep Gradient Compression (Lin et al., ICLR 2018,
arXiv:1712.01887). The step itself runs in the C++ worker client
(``gtopk._gtopk``); this module only arranges the parameters and gradients
in flat buffers around it.
"""

import math
import os
import time
import warnings

import numbers
import sys

try:
    import numpy as np
    import torch
except ImportError as _e:  # not Debian's python3-torch interpreter
    raise ImportError(
        "gtopk.torch: cannot import %s with %s: gtopk.torch needs PyTorch "
        "and NumPy for this interpreter -- on Debian, python3-torch with "
        "/usr/bin/python3 (a pyenv or venv python3 does not see Debian's "
        "packages)" % (_e.name or "torch/numpy", sys.executable)) from _e

import gtopk
from gtopk import errors

__all__ = ["DistributedOptimizer"]

_F32 = np.float32


def _env_int(names):
    """(name, int value) of the first of `names` set in the environment, or
    (None, None). ValueError naming the variable when it is not an int."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return name, int(raw)
        except ValueError:
            raise ValueError("%s=%r is not an integer" % (name, raw)) from None
    return None, None


#: The longest timeout accepted (the extension's limit): one year.
_MAX_SECONDS = 86400.0 * 365


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_seconds(name, value, allow_zero=False):
    """TypeError / ValueError naming `name` unless `value` is a number of
    seconds in (0, one year] ([0, ...] with allow_zero)."""
    if not _is_real(value):
        raise TypeError("gtopk: %s must be a number of seconds, got %r of "
                        "type %s" % (name, value, type(value).__name__))
    v = float(value)
    low_ok = v >= 0 if allow_zero else v > 0
    if not (low_ok and v <= _MAX_SECONDS):
        raise ValueError("gtopk: %s must be %s 0 and at most one year "
                         "(%d s) of seconds, got %r" % (
                             name, ">=" if allow_zero else ">",
                             _MAX_SECONDS, value))


def _same_f32(a, b):
    return _F32(a) == _F32(b)


def _f32_float(x):
    """x as the float32 it is used as, written shortest (0.05, not
    0.05000000074505806): the servers keep lr and momentum as float32."""
    return float(str(_F32(x)))


def _connection_args(leader, rank, world_size, metrics_port, rpc_timeout,
                     recovery_timeout, step_watchdog_margin, tls, tls_cert,
                     tls_key, tls_ca, token_file):
    """The connection arguments of both optimizers, with their environment
    defaults, checked before any RPC (ValueError / TypeError naming the
    argument). Returns a dict: leader, rank, world_size, world_size_from,
    metrics_port, security (the Client's TLS keyword arguments)."""
    # -- arguments and environment (no RPC yet) ------------------------
    if leader is None:
        leader = os.environ.get("GTOPK_LEADER") or \
            os.environ.get("GTOPK_SERVER")
    if not leader:
        raise ValueError(
            "gtopk: no leader address: pass leader='host:port' or set "
            "GTOPK_LEADER (or GTOPK_SERVER) to the leader shard's "
            "host:port")
    security = {}
    for name, value, env in (("tls", tls, "GTOPK_TLS"),
                             ("tls_cert", tls_cert, "GTOPK_TLS_CERT"),
                             ("tls_key", tls_key, "GTOPK_TLS_KEY"),
                             ("tls_ca", tls_ca, "GTOPK_TLS_CA"),
                             ("token_file", token_file,
                              "GTOPK_TOKEN_FILE")):
        if value is None:
            value = os.environ.get(env, "")
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError("gtopk: %s must be a string or path, got %r"
                            % (name, value))
        security[name] = os.fspath(value)
    if not security["tls"]:
        raise ValueError(
            "gtopk: tls is required: pass tls='mutual' (with tls_cert, "
            "tls_key, tls_ca), tls='server' (with tls_ca) or tls='off' "
            "for plaintext on a trusted network, or set GTOPK_TLS "
            "(docs/security.md)")
    if security["tls"] not in ("off", "server", "mutual"):
        raise ValueError("gtopk: tls must be 'off', 'server' or "
                         "'mutual', got %r" % security["tls"])
    if rank is None:
        _, rank = _env_int(("RANK", "JOB_COMPLETION_INDEX"))
        if rank is None:
            rank = -1
    rank = int(rank)
    if rank < -1:
        raise ValueError("gtopk: rank must be >= 0, or -1 for any free "
                         "rank; got %d" % rank)
    world_size_from = "world_size"
    if world_size is None:
        world_size_from, world_size = _env_int(("WORLD_SIZE",))
    if world_size is not None:
        world_size = int(world_size)
        if world_size < 1:
            raise ValueError("gtopk: %s must be >= 1, got %d" % (
                world_size_from, world_size))
    if metrics_port is None:
        _, metrics_port = _env_int(("GTOPK_METRICS_PORT",))
        if metrics_port is None:
            metrics_port = 0
    metrics_port = int(metrics_port)
    if not 0 <= metrics_port <= 65535:
        raise ValueError("gtopk: metrics_port must be in [0, 65535] "
                         "(0: off), got %d" % metrics_port)
    _check_seconds("rpc_timeout", rpc_timeout)
    if recovery_timeout is not None:
        _check_seconds("recovery_timeout", recovery_timeout)
    _check_seconds("step_watchdog_margin", step_watchdog_margin,
                   allow_zero=True)
    return {"leader": leader, "rank": rank, "world_size": world_size,
            "world_size_from": world_size_from,
            "metrics_port": metrics_port, "security": security}


def _check_world_size(conn, cluster):
    """FailedPrecondition when the given world size is not the cluster's P."""
    world_size = conn["world_size"]
    if world_size is not None and world_size != cluster["num_workers"]:
        raise errors.FailedPrecondition(
            "%s=%d but the servers' cluster spec has num_workers %d (start "
            "the servers with --workers=%d, or run %d worker(s))" % (
                "WORLD_SIZE" if conn["world_size_from"] == "WORLD_SIZE"
                else "world_size", world_size, cluster["num_workers"],
                world_size, cluster["num_workers"]))


class _ClusterMember:
    """What both optimizers share as one worker of a gtopk cluster: the
    client and its properties, the flat parameter buffer, the gradient
    signature of a failed step, metrics and the life cycle. Expects _client,
    _cluster, _n, _flat, _device, _stats and _params."""

    # -- properties ----------------------------------------------------------

    @property
    def client(self):
        """The underlying :class:`gtopk.Client` (for what this class does not
        wrap; do not step it directly)."""
        return self._client

    @property
    def rank(self):
        """This worker's rank, 0..P-1."""
        return self._open_client().rank

    @property
    def world_size(self):
        """P, the cluster's number of workers."""
        return self._open_client().num_workers

    @property
    def num_shards(self):
        """S, the cluster's number of server shards."""
        return self._open_client().num_shards

    @property
    def n(self):
        """The number of parameters (elements of the flat buffer)."""
        return self._n

    @property
    def next_step(self):
        """The step the next :meth:`step` runs (numbered from 0; after a
        restart or rollback, the servers' step)."""
        return self._open_client().next_step

    @property
    def cluster(self):
        """The cluster spec as a dict (a copy; see ``gtopk.Client.cluster``:
        n, num_workers, mode, selection, selector, lr, momentum,
        momentum_mode, density, density_warmup, steps_per_epoch,
        step_timeout_ms, shards, ...; its next_step is the value at join)."""
        return dict(self._cluster)

    @property
    def stats(self):
        """The last successful step's statistics (a dict; None before the
        first): step, k, sent_pairs, received_pairs, bytes_sent and
        bytes_received (lists, per shard, serialized bytes), and the phase
        times in seconds: accumulate_seconds, select_seconds,
        encode_seconds, push_seconds, wait_seconds, apply_seconds,
        server_merge_seconds, server_select_seconds."""
        return self._stats

    @property
    def metrics_port(self):
        """The port the worker metrics are served on (0: off)."""
        return self._open_client().metrics_port

    @property
    def device(self):
        """The device of the parameters (cpu or cuda:i)."""
        return self._device

    def flat_parameters(self):
        """The flat float32 parameter buffer (n elements; every parameter is
        a view of a slice of it). Read it (e.g. ``gtopk.checksum(
        opt.flat_parameters().cpu().numpy())``); do not write it."""
        return self._flat

    def _budget(self):
        if self._recovery_timeout is not None:
            return float(self._recovery_timeout)
        return 4.0 * self._cluster.get("step_timeout_ms", 30000) / 1000.0

    def _retry_within_budget(self, sync, recover):
        """sync(), and while it fails because the shards are at different
        steps (FAILED_PRECONDITION) or one is restarting (UNAVAILABLE),
        recover(seconds left) and sync() again, with backoff, within the
        recovery budget (as gtopk-worker does); while it fails with
        DEADLINE_EXCEEDED or ABORTED (a download that waited its
        rpc_timeout for rank 0's initial parameters, e.g. rank 0 started
        later or the leader was stopped meanwhile), sync() again."""
        deadline = time.monotonic() + self._budget()
        backoff = 0.1
        while True:
            try:
                return sync()
            except (errors.FailedPrecondition, errors.Unavailable):
                if time.monotonic() + backoff > deadline:
                    raise
                needs_recover = True
            except (errors.DeadlineExceeded, errors.Aborted):
                # Nothing to bring together (e.g. rank 0 has not offered
                # the initial parameters yet: a shard without them cannot
                # be recovered): asked again.
                if time.monotonic() + backoff > deadline:
                    raise
                needs_recover = False
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.6)
            if not needs_recover:
                continue
            try:
                recover(max(1.0, deadline - time.monotonic()))
            except errors.RETRYABLE:
                if time.monotonic() > deadline:
                    raise

    def _recover_within_budget(self, recover, timeout):
        """recover(seconds left), asked again with backoff while the leader
        answers UNAVAILABLE (a shard or the leader restarting: it cannot read
        every shard's state yet), as gtopk-worker's recovery loop does, for
        up to `timeout` seconds (None: the recovery budget); then the last
        error."""
        budget = self._budget() if timeout is None else float(timeout)
        deadline = time.monotonic() + budget
        backoff = 0.1
        while True:
            try:
                return recover(max(0.1, deadline - time.monotonic()))
            except errors.Unavailable:
                if time.monotonic() + backoff >= deadline:
                    raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.6)

    def _with_host_params(self, fn):
        """fn(float32 numpy view of the parameters): in place on the CPU; on
        a CUDA model through a host copy, copied back afterwards (also when
        fn raises: it may have written part of the buffer)."""
        if not self._cuda:
            return fn(self._flat.numpy())
        host = self._flat.detach().to("cpu", copy=True)
        try:
            return fn(host.numpy())
        finally:
            with torch.no_grad():
                self._flat.copy_(host)

    def _make_flat(self, plist, device):
        """Copies `plist` into one contiguous float32 buffer (_flat) and makes
        each p.data a view of its slice (as DeepSpeed's and Apex's flat
        buffers do); _flat_grad is the matching gradient buffer."""
        self._device = device
        self._params = plist
        self._slices = []  # (offset, numel) per parameter
        n = 0
        for p in plist:
            self._slices.append((n, p.numel()))
            n += p.numel()
        self._n = n
        with torch.no_grad():
            flat = torch.empty(n, dtype=torch.float32, device=device)
            for p, (off, cnt) in zip(plist, self._slices):
                flat[off:off + cnt].copy_(p.detach().reshape(-1))
            for p, (off, cnt) in zip(plist, self._slices):
                p.data = flat[off:off + cnt].view(p.shape)
        self._flat = flat
        self._flat_grad = torch.zeros(n, dtype=torch.float32, device=device)
        self._zero_grad_buf = None  # allocated at the first retried step

    def _gather_gradients(self, view_missing=False):
        """p.grad -> the flat gradient buffer (None: zeros; sparse:
        densified, Horovod's sparse_as_dense); leaves each p.grad a view of
        its slice, so the next backward accumulates there (`view_missing`:
        also the parameters whose .grad was None, so that an aggregated
        gradient written into the buffer reaches them)."""
        fg = self._flat_grad
        ptr0 = fg.data_ptr()
        with torch.no_grad():
            for p, (off, cnt) in zip(self._params, self._slices):
                slot = fg[off:off + cnt]
                g = p.grad
                if g is None:
                    slot.zero_()
                    if view_missing:
                        p.grad = slot.view(p.shape)
                    continue
                if g.is_sparse:
                    # Before any data_ptr(): a sparse tensor has none.
                    g = g.to_dense()
                elif (g.data_ptr() == ptr0 + 4 * off and g.is_contiguous()
                      and g.dtype == torch.float32 and g.device == fg.device
                      and g.shape == p.shape):
                    continue  # already the view: backward wrote in place
                slot.copy_(g.reshape(-1))
                p.grad = slot.view(p.shape)

    def _grad_signature(self):
        """Each parameter's .grad and its version counter: equal to an
        earlier signature only when no gradient was recomputed, zeroed or
        replaced since (holds the tensors, so no id is reused)."""
        return [(g, g._version) if g is not None else None
                for g in (p.grad for p in self._params)]

    def _same_grads(self, a, b):
        return a is not None and b is not None and len(a) == len(b) and all(
            (x is None and y is None) or (x is not None and y is not None
                                          and x[0] is y[0] and x[1] == y[1])
            for x, y in zip(a, b))

    # -- metrics -------------------------------------------------------------

    def record_metrics(self, compute_seconds, step_seconds, loss):
        """Records the last step in the worker metrics (with
        ``record_step_metrics=False``): compute time and whole step time in
        seconds, and the batch's loss. No-op when metrics are off."""
        self._check_open()
        self._client.record_metrics(float(compute_seconds),
                                    float(step_seconds), float(loss))

    def record_test_accuracy(self, accuracy):
        """Sets ``gtopk_worker_test_accuracy`` (in [0, 1]). No-op when
        metrics are off."""
        self._check_open()
        self._client.record_test_accuracy(float(accuracy))

    # -- life cycle ----------------------------------------------------------

    def _check_open(self):
        if self._client is None:
            raise errors.FailedPrecondition(
                "the gtopk optimizer is closed")

    def _open_client(self):
        self._check_open()
        return self._client

    def close(self):
        """Leaves the cluster's streams (cancels any in flight). The optimizer
        is unusable afterwards; idempotent."""
        self._release()
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _release(self):
        """What a subclass lets go of at close() (hooks); nothing here."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __getstate__(self):
        raise TypeError("gtopk.torch.DistributedOptimizer cannot be pickled "
                        "(it holds a cluster connection); save state_dict()")


class DistributedOptimizer(_ClusterMember, torch.optim.Optimizer):
    """SGD through a gtopk cluster: ``step()`` is one synchronous gTop-k step.

    Two forms (docs/apply-modes.md says when to choose which):

    * ``DistributedOptimizer(optimizer, named_parameters=..., model=...)``
      -- any ``torch.optim`` optimizer, its param groups and schedules, on a
      cluster started with ``gtopk-server --apply=workers``: the servers
      only aggregate; see :class:`gtopk._workers_apply.
      GradientAggregationOptimizer` (returned by this call).
    * ``DistributedOptimizer(params, lr=..., momentum=...)`` -- documented
      below: the servers' momentum SGD (``--apply=servers``, the default).

    Use it in place of ``torch.optim.SGD``; constructing it joins the
    cluster::

        import gtopk.torch
        opt = gtopk.torch.DistributedOptimizer(model.parameters(), lr=0.05,
                                               momentum=0.9)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    **Construction** (blocks until joined and synchronised, at most about
    ``rpc_timeout`` seconds per RPC):

    1. Every parameter of every group, in order of appearance, is copied into
       one contiguous float32 buffer of n elements (:meth:`flat_parameters`)
       and each ``p.data`` becomes a view of its slice (as DeepSpeed's and
       Apex's flat buffers do). Gradients are gathered into a second flat
       buffer; after the first step each ``p.grad`` is a view of its slice,
       so ``backward()`` accumulates in place and the gathering copies
       nothing. All parameters must be float32 and on one device: the CPU,
       or one CUDA device (then the client's device step is used: the dense
       gradient never leaves the GPU; needs ``gtopk.has_cuda``).
    2. It joins the cluster at ``leader`` as ``rank`` (the cluster's n must
       be this n: a mismatch is :class:`gtopk.FailedPrecondition`), checks
       every setting given here against the servers' cluster spec, and
       downloads the servers' parameters into the buffer (rank 0 first
       offers its own values as the initial ones), so every replica starts
       equal to the servers. Do not change the parameters yourself after
       this (e.g. ``model.load_state_dict`` after construction): replicas
       would differ; load the model *before* constructing the optimizer, or
       call :meth:`load_state_dict` (which downloads them again).

    **The servers own the optimizer's configuration.** Mode, selector,
    density (and its warm-up), learning rate, momentum, momentum mode and
    weight decay are ``gtopk-server`` flags; the arguments of the same names
    here are *checks*: a value that differs from the cluster's raises
    :class:`gtopk.FailedPrecondition` with the same message as
    ``gtopk-worker``'s flags (``"lr=0.1 but the servers' cluster spec has lr
    0.05 (configure the servers and workers alike)"``). Arguments left
    ``None`` take the cluster's values (``param_groups[i]["lr"]`` and
    ``["momentum"]`` are then the cluster's).

    **Learning-rate schedules are not supported**: the learning rate is
    fixed by the servers' ``--lr`` (every replica and every shard apply the
    same rule; ``--lr-warmup-steps`` gives a linear warm-up, and density
    warm-up is ``--density-warmup``). A ``torch.optim.lr_scheduler``
    scheduler that leaves ``lr`` unchanged keeps working (constructing one is
    fine), but when one *changes* ``param_groups[i]["lr"]`` (or anything
    changes ``["momentum"]``) away from the cluster's value, the next
    :meth:`step` raises :class:`gtopk.FailedPrecondition` naming both
    values, before anything is sent. Values are compared as float32.

    **Failures and recovery.** A failed step raises the :class:`gtopk.Error`
    subclass of its status code, with the server's message (naming the shard
    or worker that failed). Nothing was applied to the parameters; the
    gradient is kept in the residual, so the next step() sends a zero
    gradient when it is the same step again (whatever ``.grad`` holds then),
    as ``gtopk-worker`` does, or when no gradient was recomputed since the
    failure. The recovery loop::

        deadline = time.monotonic() + 120   # the recovery budget
        while True:
            try:
                opt.step()
                break
            except gtopk.RETRYABLE:   # Aborted, DeadlineExceeded, Unavailable
                if time.monotonic() > deadline:
                    raise             # e.g. a peer that never comes back
                opt.recover()         # waits for a restarting shard/leader

    :meth:`recover` asks the leader to bring the shards to one step and
    returns the step to continue from (``opt.next_step``). When the servers
    were rolled back (a shard restarted from an older checkpoint) that step
    is earlier than the failed one, the parameters were downloaded again,
    and a training script should recompute the gradient of that step (the
    example ``examples/pytorch/train_fashion_mnist.py`` does; without it the
    step only sends what the residual holds). Other errors
    (:class:`gtopk.InvalidArgument`, :class:`gtopk.PermissionDenied`, ...)
    are not retryable.

    **Checkpoints.** :meth:`state_dict` adds this worker's own gtopk state --
    the step, the error-feedback residual and the (DGC) local velocity, as
    CPU tensors -- under the key ``"gtopk"``, so ``torch.save(opt.state_dict(),
    path)`` checkpoints everything a resumed run needs besides the servers'
    parameters (the servers checkpoint those themselves). The state is per
    rank: every rank saves and loads its own file. :meth:`load_state_dict`
    needs the servers at the checkpoint's step.

    **Statistics and metrics.** :attr:`stats` is the last step's statistics
    (bytes per shard, phase times in seconds; see :meth:`step`). With
    ``metrics_port`` set, the worker's Prometheus metrics (the same as
    ``gtopk-worker``'s, docs/metrics.md) are served on it, and every
    successful step is recorded (compute time: from the end of the previous
    ``step()``; loss: the closure's, or ``step(loss=...)``). Pass
    ``record_step_metrics=False`` to record the steps yourself with
    :meth:`record_metrics`.

    **Thread-safety**: not thread-safe; use it from one thread. Blocking
    calls release the GIL, and Ctrl-C interrupts them within a second with
    ``KeyboardInterrupt`` (nothing applied; the step may be retried).

    Args:
      params: an iterable of tensors or of param-group dicts, as for any
        torch optimizer (every parameter is trained by the servers' rule;
        per-group ``lr``/``momentum`` must equal the cluster's).
      lr, momentum: checks against the cluster (see above); ``None``: take
        the cluster's.
      leader: ``host:port`` of the leader shard; default ``$GTOPK_LEADER``,
        then ``$GTOPK_SERVER``. Missing: ``ValueError``.
      rank: rank to take, ``0..P-1``; default ``$RANK`` (torchrun), then
        ``$JOB_COMPLETION_INDEX`` (Kubernetes indexed Jobs), else ``-1``: any
        free rank the leader hands out.
      world_size: checked against the cluster's number of workers P; default
        ``$WORLD_SIZE`` when set. A mismatch is
        :class:`gtopk.FailedPrecondition`.
      mode, selector, density, momentum_mode, weight_decay, index_codec,
        value_codec: checks against the cluster (``None``: no check).
      rpc_timeout: seconds, the deadline of the join and of each parameter
        upload/download RPC.
      metrics_port: serve Prometheus metrics on this port (``0``: off);
        default ``$GTOPK_METRICS_PORT``, else off. ``metrics_host``: the
        address it binds.
      recovery_timeout: seconds; the default timeout of :meth:`recover`
        (``None``: the client's, the RPC timeout plus the servers' step
        timeout), and the budget for recovering a failed initial parameter
        download (``None``: 4 x the servers' step timeout, as gtopk-worker).
      step_watchdog_margin: seconds a step may wait beyond the servers' step
        timeout before a stalled shard is cancelled.
      record_step_metrics: record every successful step in the metrics
        (when ``metrics_port`` is on).
      tls: transport security (docs/security.md), as gtopk-worker's
        ``--tls``: ``"mutual"`` (mTLS: ``tls_cert``/``tls_key`` are this
        worker's PEM certificate, CN ``gtopk-worker`` or
        ``gtopk-worker-<rank>``, and key; ``tls_ca`` the PEM CA bundle the
        shards' certificates chain to), ``"server"`` (TLS, ``tls_ca``) or
        ``"off"`` (plaintext, for a trusted network only: a WARNING on
        stderr). Required: default ``$GTOPK_TLS``; neither given is a
        ``ValueError`` (plaintext only when said explicitly).
      tls_cert, tls_key, tls_ca, token_file: file paths; default
        ``$GTOPK_TLS_CERT``, ``$GTOPK_TLS_KEY``, ``$GTOPK_TLS_CA``,
        ``$GTOPK_TOKEN_FILE``. ``token_file`` holds the workers' shared token
        (the secret itself is never an argument or an environment value).

    Raises (construction): ``ValueError`` / ``TypeError`` for bad arguments
    (before joining); :class:`gtopk.Unimplemented` for CUDA parameters in a
    build without CUDA; the join's and the download's :class:`gtopk.Error`
    (:class:`gtopk.FailedPrecondition` for an n or settings mismatch,
    :class:`gtopk.AlreadyExists` for a rank taken by a live worker,
    :class:`gtopk.DeadlineExceeded` / :class:`gtopk.Unavailable` when the
    leader cannot be reached).
    """

    def __new__(cls, params=None, *args, **kwargs):
        # DistributedOptimizer(optimizer, named_parameters=..., ...): the
        # workers apply the update with the wrapped optimizer (--apply=
        # workers); DistributedOptimizer(params, lr=...): the servers do.
        if isinstance(params, torch.optim.Optimizer):
            from gtopk._workers_apply import GradientAggregationOptimizer
            return GradientAggregationOptimizer(params, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, params, lr=None, momentum=None, *, leader=None,
                 rank=None, world_size=None, mode=None, selector=None,
                 density=None, momentum_mode=None, weight_decay=None,
                 index_codec=None, value_codec=None, rpc_timeout=30.0,
                 metrics_port=None, metrics_host="0.0.0.0",
                 recovery_timeout=None, step_watchdog_margin=2.0,
                 record_step_metrics=True, tls=None, tls_cert=None,
                 tls_key=None, tls_ca=None, token_file=None):
        self._client = None
        self._frozen = False
        conn = _connection_args(leader, rank, world_size, metrics_port,
                                rpc_timeout, recovery_timeout,
                                step_watchdog_margin, tls, tls_cert, tls_key,
                                tls_ca, token_file)
        security = conn["security"]
        leader, rank, metrics_port = (conn["leader"], conn["rank"],
                                      conn["metrics_port"])
        world_size, world_size_from = conn["world_size"], conn[
            "world_size_from"]
        for name, value in (("lr", lr), ("momentum", momentum),
                            ("density", density),
                            ("weight_decay", weight_decay)):
            if value is not None and not _is_real(value):
                raise TypeError(
                    "gtopk: %s must be a real number (int, float or a NumPy "
                    "float) or None, got %r of type %s"
                    % (name, value, type(value).__name__))
        self._recovery_timeout = recovery_timeout
        self._record_step_metrics = bool(record_step_metrics)

        # torch's bookkeeping: param_groups (lr/momentum filled in from the
        # cluster below when not given).
        super().__init__(params, {"lr": lr, "momentum": momentum})

        # -- the flat buffers ----------------------------------------------
        # A parameter listed twice in a group (torch only warns) would get
        # two slices, its gradient counted twice: keep its first place.
        for g in self.param_groups:
            seen = set()
            g["params"] = [p for p in g["params"]
                           if id(p) not in seen and not seen.add(id(p))]
        plist = [p for g in self.param_groups for p in g["params"]]
        if not plist:
            raise ValueError("gtopk: no parameters to optimize")
        device = plist[0].device
        for i, p in enumerate(plist):
            if p.dtype != torch.float32:
                raise TypeError(
                    "gtopk: parameter %d (shape %s) is %s; gtopk trains "
                    "float32 parameters only (model.float())"
                    % (i, tuple(p.shape), p.dtype))
            if p.device != device:
                raise ValueError(
                    "gtopk: parameters on different devices (%s and %s); "
                    "put the whole model on one device" % (device, p.device))
            if p.is_sparse:
                raise TypeError("gtopk: parameter %d is a sparse tensor" % i)
        if device.type not in ("cpu", "cuda"):
            raise ValueError("gtopk: parameters on %s; gtopk supports the "
                             "CPU and CUDA devices" % device)
        self._cuda = device.type == "cuda"
        if self._cuda and not gtopk.has_cuda:
            raise errors.Unimplemented(
                "the model is on %s but this gtopk build has no CUDA step "
                "(gtopk.has_cuda is False: built without nvcc/CUDA); "
                "rebuild gtopk with CUDA or train on the CPU" % device)
        self._make_flat(plist, device)
        n = self._n

        # -- join, check, synchronise -----------------------------------------
        self._client = gtopk.Client(
            str(leader), n, rank, rpc_timeout=float(rpc_timeout),
            step_watchdog_margin=float(step_watchdog_margin),
            metrics_port=metrics_port, metrics_host=str(metrics_host),
            **security)
        try:
            self._cluster = dict(self._client.cluster())
            c = self._cluster
            if world_size is not None and world_size != c["num_workers"]:
                raise errors.FailedPrecondition(
                    "%s=%d but the servers' cluster spec has num_workers %d "
                    "(start the servers with --workers=%d, or run %d "
                    "worker(s))" % (
                        "WORLD_SIZE" if world_size_from == "WORLD_SIZE"
                        else "world_size", world_size, c["num_workers"],
                        world_size, c["num_workers"]))
            if c.get("apply") == "workers":
                raise errors.FailedPrecondition(
                    "the servers run with --apply=workers (gradient "
                    "aggregation): wrap your own optimizer, "
                    "gtopk.torch.DistributedOptimizer(torch.optim.SGD("
                    "model.parameters(), lr=...), named_parameters="
                    "model.named_parameters(), model=model), instead of "
                    "passing parameters and lr")
            self._client.check_settings(
                mode=mode, selector=selector, density=density, lr=lr,
                momentum=momentum, momentum_mode=momentum_mode,
                weight_decay=weight_decay, index_codec=index_codec,
                value_codec=value_codec)
            # Per-group values (a param-group dict may name its own).
            for i, group in enumerate(self.param_groups):
                for key in ("lr", "momentum"):
                    if group.get(key) is None:
                        group[key] = _f32_float(c[key])
                    elif not _same_f32(group[key], c[key]):
                        self._client.check_settings(**{key: group[key]})
                        raise errors.FailedPrecondition(
                            "param_groups[%d][%r] is %s but the servers' "
                            "cluster spec has %s %s (configure the servers "
                            "and workers alike)" % (i, key, group[key], key,
                                                    _f32_float(c[key])))
                self._check_group_options(i, group)
                group.setdefault("weight_decay", _f32_float(c["weight_decay"]))
            self.defaults["lr"] = _f32_float(c["lr"])
            self.defaults["momentum"] = _f32_float(c["momentum"])
            self._synchronize_initial()
        except BaseException:
            self._client.close()
            raise
        self._stats = None
        # After a failed step (its gradient is in the residual): the step
        # that failed and the gradients as they were (_grad_signature).
        self._retry_step = None
        self._failed_grads = None
        self._last_step_end = time.perf_counter()
        self._frozen = True

    # -- construction helpers ------------------------------------------------

    def _synchronize_initial(self):
        """synchronize_parameters, recovering (as gtopk-worker does) when the
        shards are at different steps (FAILED_PRECONDITION) or a retryable
        error (gtopk.RETRYABLE) came, within the recovery budget."""
        return self._retry_within_budget(
            lambda: self._with_host_params(
                self._client.synchronize_parameters),
            lambda left: self._with_host_params(
                lambda buf: self._client.recover(buf, left)))

    def add_param_group(self, param_group):
        """Only at construction: the flat buffer and the cluster's n are fixed
        once joined (raises ``ValueError`` afterwards)."""
        if getattr(self, "_frozen", False):
            raise ValueError(
                "gtopk: add_param_group after construction is not supported "
                "(the parameters form one flat buffer of the cluster's n); "
                "pass every parameter to the constructor")
        super().add_param_group(param_group)

    # -- the step ------------------------------------------------------------

    def _check_group_options(self, i, group):
        """A param group's own SGD options the servers do not apply are
        refused (FailedPrecondition), not silently ignored."""
        c = self._cluster
        wd = group.get("weight_decay")
        if wd is not None and not _same_f32(wd, c["weight_decay"]):
            raise errors.FailedPrecondition(
                "param_groups[%d]['weight_decay'] is %r but the servers' "
                "cluster spec has weight_decay %r: weight decay is the "
                "servers' --weight-decay, one value for every parameter "
                "(per-group values are not supported)"
                % (i, wd, _f32_float(c["weight_decay"])))
        if group.get("nesterov"):
            raise errors.FailedPrecondition(
                "param_groups[%d]['nesterov'] is True: gtopk applies the "
                "servers' momentum rule (--momentum-mode), not Nesterov "
                "momentum" % i)
        if group.get("dampening", 0) not in (0, 0.0):
            raise errors.FailedPrecondition(
                "param_groups[%d]['dampening'] is %r: gtopk's momentum has "
                "no dampening (0 only)" % (i, group["dampening"]))

    def _check_views(self):
        """Every parameter must still be the view of its slice of the flat
        buffer that construction made it; otherwise the servers' update
        would no longer reach the model."""
        base = self._flat.data_ptr()
        for i, (p, (off, cnt)) in enumerate(zip(self._params, self._slices)):
            # An empty parameter has no storage to point into (data_ptr 0).
            moved = cnt > 0 and p.data_ptr() != base + 4 * off
            if moved or p.device != self._device \
                    or p.dtype != torch.float32:
                raise errors.FailedPrecondition(
                    "parameter %d (shape %s) is no longer a view of the "
                    "optimizer's flat buffer: it was replaced, moved or "
                    "converted after the optimizer was constructed (e.g. "
                    "model.to(), .double()/.float(), load_state_dict with "
                    "assign); updates would not reach the model. Construct "
                    "the optimizer after moving the model, and change "
                    "parameters in place (param.data.copy_)"
                    % (i, tuple(p.shape)))

    def _check_hyperparameters(self):
        c = self._cluster
        for i, group in enumerate(self.param_groups):
            self._check_group_options(i, group)
            for key in ("lr", "momentum"):
                value = group.get(key)
                if value is None or not _same_f32(value, c[key]):
                    if key == "lr":
                        what = (
                            "the learning rate is fixed by the servers' --lr "
                            "(every replica and shard applies the same rule; "
                            "--lr-warmup-steps gives a linear warm-up). "
                            "Per-step learning-rate schedules (a "
                            "torch.optim.lr_scheduler that changes the lr) "
                            "are not supported: set the servers' --lr and "
                            "--lr-warmup-steps instead, or use a scheduler "
                            "that leaves the lr unchanged")
                    else:
                        what = (
                            "the momentum is fixed by the servers' "
                            "--momentum (every replica and shard applies "
                            "the same rule); changing it is not supported")
                    raise errors.FailedPrecondition(
                        "param_groups[%d][%r] is %r but the cluster's %s is "
                        "%r: %s" % (i, key, value, key, _f32_float(c[key]),
                                    what))

    def step(self, closure=None, *, loss=None):
        """One gTop-k step (docs/design.md): gathers the gradients,
        sends this worker's local top-k, and applies the global update to the
        parameters in place (the same update on every replica and shard).

        Args:
          closure: optional; re-evaluates the model and returns the loss
            (run under ``torch.enable_grad()`` before the step).
          loss: optional, keyword-only; this step's loss for the metrics
            (``gtopk_worker_loss``) when no closure gives it.

        Returns the closure's loss (None without a closure).

        Blocks until every shard answered: at most the servers' step timeout
        plus ``step_watchdog_margin``. Stores the step's statistics in
        :attr:`stats`. A parameter whose ``.grad`` is None contributes a
        zero gradient.

        Raises :class:`gtopk.Error` subclasses: see the class docstring
        (nothing applied; retry after :meth:`recover` for
        :data:`gtopk.RETRYABLE`); :class:`gtopk.FailedPrecondition` when lr or
        momentum were changed (no step); :class:`gtopk.InvalidArgument` for a
        non-finite gradient.
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._check_open()
        self._check_hyperparameters()
        self._check_views()
        t0 = time.perf_counter()
        compute = t0 - self._last_step_end
        client = self._client
        if self._retry_step is not None and (
                self._retry_step == client.next_step
                or self._same_grads(self._grad_signature(),
                                    self._failed_grads)):
            # The failed attempt's gradient is already in the residual
            # (worker/client.h, Step's failure contract): the same step
            # again, or another one (after a rollback) with the gradients
            # untouched since, sends nothing new.
            if self._zero_grad_buf is None:
                self._zero_grad_buf = torch.zeros_like(self._flat_grad)
            grad = self._zero_grad_buf
        else:
            self._gather_gradients()
            grad = self._flat_grad
        self._retry_step = None
        self._failed_grads = None
        try:
            if self._cuda:
                if not gtopk.has_cuda:  # checked at construction too
                    raise errors.Unimplemented(
                        "this gtopk build has no CUDA step")
                with torch.cuda.device(self._device):
                    stream = torch.cuda.current_stream(self._device)
                    stats = client.step_cuda(
                        grad.data_ptr(), self._flat.data_ptr(), self._n,
                        stream.cuda_stream)
            else:
                stats = client.step(grad.numpy(), self._flat.numpy())
        except (errors.InvalidArgument, errors.Unimplemented):
            raise  # refused before anything was accumulated
        except (errors.Error, KeyboardInterrupt):
            # Accumulated into the residual: a retry sends zero (see above).
            self._retry_step = client.next_step
            self._failed_grads = self._grad_signature()
            raise
        now = time.perf_counter()
        self._stats = stats
        if self._record_step_metrics and client.metrics_port:
            if loss is None and result is not None:
                loss = result
            if loss is None:
                loss_value = float("nan")
            else:
                loss_value = float(loss.detach().item()
                                   if torch.is_tensor(loss) else loss)
            client.record_metrics(compute, compute + (now - t0), loss_value)
        self._last_step_end = now
        return result

    def recover(self, timeout=None):
        """After a failed :meth:`step`: asks the leader to bring the shards to
        one step and returns the step to continue from (also
        :attr:`next_step`). A rank that lost the result of a step that
        committed (the shards one step ahead) gets its own step back, and
        its retry gets that step's result, kept by the shards (bit-identical
        to a run without the failure). When the servers were rolled back,
        or are further ahead, the parameters are downloaded again (so they
        equal the servers'; with ``--apply=workers`` nothing is downloaded:
        a rollback renumbers the step); otherwise they are untouched. The
        loop::

            deadline = time.monotonic() + 120   # the recovery budget
            while True:
                try:
                    opt.step()
                    break
                except gtopk.RETRYABLE:
                    if time.monotonic() > deadline:
                        raise   # e.g. a peer that never returns
                    opt.recover()

        (a retry of the same step sends no new gradient: the failed
        attempt's is in the residual). When the returned step is earlier
        than the failed one, recompute the gradient for that step before
        stepping again.

        Args:
          timeout: seconds to wait for a leader or shard that is down or
            restarting (the leader's UNAVAILABLE answers are asked again
            until then); default the constructor's ``recovery_timeout``,
            else 4 step timeouts (as gtopk-worker's --recovery-timeout).

        Blocks up to the timeout (plus a parameter download).

        Raises :class:`gtopk.FailedPrecondition` when the shards cannot be
        brought to a common step (the message names every shard's step and
        checkpoints; do not retry); :class:`gtopk.Unavailable`,
        :class:`gtopk.DeadlineExceeded`, :class:`gtopk.Aborted`: retry
        later.
        """
        self._check_open()
        if timeout is not None:
            _check_seconds("timeout", timeout)
        return self._recover_within_budget(
            lambda left: self._with_host_params(
                lambda buf: self._client.recover(buf, left)), timeout)

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self):
        """torch's optimizer state dict plus ``"gtopk"``: ``{"step": int,
        "residual": float32 tensor [n], "velocity": float32 tensor [n],
        "rank": int, "n": int, "cluster_fingerprint": str}`` (CPU tensors,
        copies). Per rank: save one per worker."""
        self._check_open()
        sd = super().state_dict()
        st = self._client.state()
        sd["gtopk"] = {
            "step": int(st["step"]),
            "residual": torch.from_numpy(np.array(st["residual"], _F32,
                                                  copy=False)),
            "velocity": torch.from_numpy(np.array(st["velocity"], _F32,
                                                  copy=False)),
            "rank": self.rank,
            "n": self._n,
            "cluster_fingerprint": self._cluster.get("cluster_fingerprint"),
        }
        return sd

    def load_state_dict(self, state_dict):
        """Restores a :meth:`state_dict` of the same rank, taken at the step
        the servers are at now (e.g. servers restarted from their checkpoint
        of that step), then downloads the servers' parameters again so this
        replica equals them (the model's own loaded values are replaced by
        the servers', which are the authoritative ones).

        Raises ``ValueError`` for a dict without ``"gtopk"``;
        :class:`gtopk.FailedPrecondition` for another rank's, n's or step's
        state; :class:`gtopk.InvalidArgument` for a wrong length or a
        non-finite value (nothing changed).
        """
        self._check_open()
        self._failed_grads = None
        if "gtopk" not in state_dict:
            raise ValueError(
                "gtopk: this state dict has no 'gtopk' entry: it is not from "
                "gtopk.torch.DistributedOptimizer.state_dict()")
        sd = dict(state_dict)
        g = sd.pop("gtopk")
        if int(g.get("n", self._n)) != self._n:
            raise errors.FailedPrecondition(
                "the checkpoint's gtopk state has n=%d but this model has "
                "n=%d" % (int(g["n"]), self._n))
        if "rank" in g and int(g["rank"]) != self.rank:
            raise errors.FailedPrecondition(
                "the checkpoint holds rank %d's gtopk state (its residual and "
                "velocity) but this worker is rank %d: every rank saves and "
                "loads its own optimizer state (e.g. torch.save("
                "opt.state_dict(), f'opt-rank{opt.rank}.pt')) and joins as "
                "the same rank (rank=..., $RANK)" % (int(g["rank"]),
                                                     self.rank))
        fp = g.get("cluster_fingerprint")
        if fp and fp != self._cluster.get("cluster_fingerprint"):
            warnings.warn(
                "gtopk: the checkpoint was saved in a cluster configured "
                "differently (fingerprint %s, now %s)" % (
                    fp, self._cluster.get("cluster_fingerprint")))
        step = int(g["step"])
        # The servers' parameters first (this replica must equal them) and
        # their step, which the state must belong to.
        servers_step = self._with_host_params(
            self._client.synchronize_parameters)
        if step != servers_step:
            raise errors.FailedPrecondition(
                "the servers are at step %d but the checkpoint is from step "
                "%d: restore the servers from their checkpoint of step %d "
                "(gtopk-server --checkpoint-dir) or load the optimizer state "
                "saved at step %d" % (servers_step, step, step, servers_step))

        def host(t):
            t = t.detach().to("cpu", torch.float32).contiguous() \
                if torch.is_tensor(t) else torch.as_tensor(t, torch.float32)
            return t.numpy()
        self._client.load_state(step, host(g["residual"]),
                                host(g["velocity"]))
        super().load_state_dict(sd)
        # torch restored the saved lr/momentum; a checkpoint from another
        # cluster configuration shows at the next step().
        self._retry_step = None

