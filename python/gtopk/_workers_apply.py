"""Workers apply (gradient aggregation): any ``torch.optim`` optimizer on a
gtopk cluster started with ``gtopk-server --apply=workers``.

Each step, every worker keeps error feedback on its gradient (u = residual +
g), sends its local top-k, the shards agree on the global top-k of the sum
(gTop-k, Shi et al., "A Distributed Synchronous SGD Algorithm with Global
Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019,
arXiv:1901.04359) and return it; every worker writes the average into its
parameters' ``.grad`` and runs the wrapped optimizer, as Horovod's and
BytePS's ``DistributedOptimizer`` and DDP's communication hooks do. Used
through :func:`gtopk.torch.DistributedOptimizer` with an optimizer as its
first argument.
"""

import contextlib
import hashlib
import inspect
import os
import time

import numpy as np
import torch

import gtopk
from gtopk import errors
from gtopk.torch import _ClusterMember

_F32 = np.float32


def _tensor_bytes(t):
    """The raw bytes of a tensor (any dtype), in memory order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _load_bytes(t, data):
    """Copies `data` (the raw bytes of a tensor shaped like `t`) into `t`."""
    if t.numel() == 0:
        return
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    src = src.view(t.dtype).reshape(t.shape)
    with torch.no_grad():
        t.copy_(src)


class _Layout:
    """A list of named tensors and the signature of their names, dtypes and
    shapes, so that bytes from rank 0 are only ever read into a model of the
    same layout (a mismatch names the first differing entry)."""

    def __init__(self, named):
        self.named = [(name, t) for name, t in named]
        text = "\n".join("%s %s %s" % (name, t.dtype, tuple(t.shape))
                         for name, t in self.named)
        self.signature = hashlib.sha256(text.encode()).digest()[:16]
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.named)
        self.text = text

    def pack(self):
        return self.signature + b"".join(_tensor_bytes(t)
                                         for _, t in self.named)

    def unpack(self, blob, what):
        if not blob:
            raise errors.FailedPrecondition(
                "shard 0 holds no %s of rank 0: it restarted from a "
                "checkpoint after rank 0 initialised the cluster and before "
                "this rank joined (checkpoints keep the parameters and the "
                "step, not rank 0's buffers and frozen parameters). Restart "
                "rank 0 together with the servers (a fresh run), or resume "
                "every rank from its own checkpoint" % what)
        if len(blob) != 16 + self.nbytes or blob[:16] != self.signature:
            raise errors.FailedPrecondition(
                "rank 0's %s do not match this model's (%d bytes with "
                "signature %s, expected %d bytes with signature %s): every "
                "rank must build the same model (same names, dtypes and "
                "shapes)" % (what, len(blob) - 16, blob[:16].hex(),
                             self.nbytes, self.signature.hex()))
        off = 16
        for _, t in self.named:
            size = t.numel() * t.element_size()
            _load_bytes(t, blob[off:off + size])
            off += size


def _as_unpickled(optimizer):
    """GradientAggregationOptimizer's pickle: the wrapped optimizer, as
    pickle made it (``__reduce_ex__`` below)."""
    return optimizer


class GradientAggregationOptimizer(_ClusterMember, torch.optim.Optimizer):
    """Wraps any ``torch.optim.Optimizer`` so that its ``step()`` runs on the
    gTop-k average of every worker's gradient (workers-apply mode).

    Construct it with :func:`gtopk.torch.DistributedOptimizer`::

        model = Net()                      # load a checkpoint's model state here
        inner = torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.05)
        opt = gtopk.torch.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), model=model)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                     # exchange, then inner.step()
            sched.step()

    The servers must run with ``--apply=workers`` (the wrapped optimizer
    owns lr, momentum, weight decay, param groups and schedules; the servers
    only aggregate). Optimizer hyperparameters, param groups and every
    ``torch.optim.lr_scheduler`` work unchanged: ``param_groups`` and
    ``state`` are the wrapped optimizer's own objects.

    **Which parameters travel.** The trainable parameters (``requires_grad``)
    of the wrapped optimizer's param groups, in group order, become views of
    one contiguous float32 buffer of n elements (the cluster's n); their
    gradients are gathered into a second flat buffer whose slices become
    their ``.grad``. Parameters that do not require gradients are never
    given a ``.grad`` here, so no optimizer (nor its weight decay) moves
    them. Only float32 parameters on one device are accepted (a bf16/fp16
    parameter is refused at construction, named); use
    ``torch.autocast`` for mixed precision.

    **Construction** (blocks; each RPC at most ``rpc_timeout``): joins the
    cluster; when the cluster is at step 0, rank 0's parameters and (with
    ``model=``) its whole ``model.state_dict()`` -- buffers and frozen
    parameters included -- reach every replica through the shards. When the
    cluster is past step 0 (a run being resumed, or a rank coming back) the
    shards hold no current parameters: :meth:`load_state_dict` with this
    rank's checkpoint must follow, and :meth:`step` refuses until then with
    a message saying so.

    **Buffers** (``model=``, ``broadcast_buffers=True``): every step, rank
    0's buffers after its forward pass (e.g. BatchNorm running statistics)
    travel with its push to shard 0 and replace every other rank's at the
    end of the step, so all replicas hold rank 0's buffers after every
    ``step()`` (DDP's ``broadcast_buffers``, which broadcasts rank 0's
    buffers before each forward) and evaluation gives the same result on
    every rank.

    **Gradients each call sees.** Before :meth:`synchronize` each ``.grad``
    is this worker's local gradient (summed over ``backward_passes_per_step``
    backward passes); after it, every ``.grad`` is the same sparse average:
    the global top-k's sum divided by P at the selected entries, zero
    elsewhere (dense, float32). So ``clip_grad_norm_`` between
    ``synchronize()`` and a ``step()`` under :meth:`skip_synchronize` clips
    the aggregated gradient identically on every rank (Horovod's pattern).
    A sparse gradient (``nn.Embedding(sparse=True)``) is densified, as
    Horovod's ``sparse_as_dense``; the wrapped optimizer then sees a dense
    gradient (use Adam/AdamW, not SparseAdam).

    **Divergence cannot be silent.** Every ``checksum_every`` steps (a
    server flag, default 100), and at the first step after a resume or a
    rollback, each worker sends a checksum of its parameters, trainable and
    frozen; when they differ the step fails on every worker with
    :class:`gtopk.FailedPrecondition` naming the ranks and the step (so
    ranks resumed from checkpoints of different steps cannot continue). A
    write to a parameter outside :meth:`step` (e.g. ``model.load_state_dict``
    after construction; frozen parameters included) is found at the next
    step from the tensors' version counters and refused the same way,
    before anything is sent; call :meth:`accept_parameter_changes` after
    changing the parameters identically on every rank on purpose. So are a
    group added to the wrapped optimizer after wrapping, a parameter
    unfrozen after construction, and a ``backward()`` between
    :meth:`synchronize` and :meth:`step`. Optimizers whose ``step()``
    requires a closure (LBFGS) are refused at construction: each of their
    evaluations would need its own exchange.

    **Failures.** A failed exchange raises the status code's
    :class:`gtopk.Error` subclass and applies nothing (the wrapped
    optimizer's step is not called). The gradient stays in the residual, so
    the retry -- call :meth:`step` (or :meth:`synchronize`) again after
    :meth:`recover` for :data:`gtopk.RETRYABLE` errors -- sends exactly what
    the failed attempt did, and the run stays bit-identical to one without
    the failure.

    **Checkpoints** (one place: the servers hold nothing to keep aligned):
    :meth:`state_dict` is the wrapped optimizer's plus ``"gtopk"`` (step,
    error-feedback residual, rank, n). A run restarted from every rank's
    checkpoint (model state loaded before construction, then
    ``opt.load_state_dict``) is bit-identical to an uninterrupted one.

    Not thread-safe; blocking calls release the GIL and Ctrl-C interrupts
    them (``KeyboardInterrupt``, nothing applied).
    """

    def __init__(self, optimizer, named_parameters=None, *, model=None,
                 backward_passes_per_step=1, broadcast_buffers=True,
                 leader=None, rank=None, world_size=None, mode=None,
                 selector=None, density=None, index_codec=None,
                 value_codec=None, rpc_timeout=30.0, metrics_port=None,
                 metrics_host="0.0.0.0", recovery_timeout=None,
                 step_watchdog_margin=2.0, record_step_metrics=True,
                 tls=None, tls_cert=None, tls_key=None, tls_ca=None,
                 token_file=None, overlap=None):
        from gtopk import torch as gt  # the shared argument helpers
        # Not Optimizer.__init__: the wrapped optimizer's param_groups,
        # state and defaults are used as they are (properties below).
        self._client = None
        self._frozen = False
        self._opt = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("gtopk: expected a torch.optim.Optimizer, got %r"
                            % type(optimizer).__name__)
        if isinstance(optimizer, (GradientAggregationOptimizer,
                                  gt.DistributedOptimizer)):
            raise TypeError("gtopk: the optimizer is already a gtopk "
                            "DistributedOptimizer")
        if isinstance(backward_passes_per_step, bool) or not isinstance(
                backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("gtopk: backward_passes_per_step must be an "
                             "int >= 1, got %r" % (backward_passes_per_step,))
        self._passes = backward_passes_per_step
        try:
            closure = inspect.signature(optimizer.step).parameters.get(
                "closure")
        except (TypeError, ValueError):
            closure = None
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(
                "gtopk: %s.step() requires a closure (it re-evaluates the "
                "model inside one step, e.g. LBFGS): every evaluation would "
                "need its own exchange of gradients, which one gtopk step "
                "cannot give; use an optimizer whose closure is optional"
                % type(optimizer).__name__)
        if overlap not in (None, True, False):
            raise TypeError("gtopk: overlap must be None, True or False, "
                            "got %r" % (overlap,))
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError("gtopk: model must be a torch.nn.Module, got %r"
                            % type(model).__name__)
        conn = gt._connection_args(leader, rank, world_size, metrics_port,
                                   rpc_timeout, recovery_timeout,
                                   step_watchdog_margin, tls, tls_cert,
                                   tls_key, tls_ca, token_file)
        if density is not None and not gt._is_real(density):
            raise TypeError("gtopk: density must be a real number or None, "
                            "got %r" % (density,))
        self._recovery_timeout = recovery_timeout
        self._record_step_metrics = bool(record_step_metrics)

        # -- names, the trainable set and the flat buffers ------------------
        names = {}
        if named_parameters is None and model is not None:
            named_parameters = model.named_parameters()
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            if not named_parameters:
                raise ValueError(
                    "gtopk: named_parameters is empty (a generator such as "
                    "model.named_parameters() that was already used up?): "
                    "pass model.named_parameters() afresh")
            for item in named_parameters:
                if not (isinstance(item, tuple) and len(item) == 2
                        and isinstance(item[0], str)
                        and isinstance(item[1], torch.Tensor)):
                    raise ValueError(
                        "gtopk: named_parameters must be (name, parameter) "
                        "pairs, e.g. model.named_parameters(); got %r"
                        % (item,))
                names.setdefault(id(item[1]), item[0])
        seen = set()
        plist = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if named_parameters is not None and id(p) not in names:
                    raise ValueError(
                        "gtopk: named_parameters was given, but a parameter "
                        "of the optimizer (shape %s) is not in it: pass the "
                        "model's named_parameters() for the whole model"
                        % (tuple(p.shape),))
                if p.requires_grad:
                    plist.append(p)
        self._names = [names.get(id(p), "parameter %d" % i)
                       for i, p in enumerate(plist)]
        if not plist:
            raise ValueError("gtopk: the optimizer has no parameter that "
                             "requires a gradient")
        bad = [(nm, p.dtype) for nm, p in zip(self._names, plist)
               if p.dtype != torch.float32]
        if bad:
            raise TypeError(
                "gtopk: gtopk trains float32 parameters only; %s "
                "(keep the parameters float32 and use torch.autocast for "
                "bf16/fp16 compute)" % ", ".join(
                    "%s is %s" % (nm, dt) for nm, dt in bad[:5]))
        device = plist[0].device
        for nm, p in zip(self._names, plist):
            if p.device != device:
                raise ValueError("gtopk: parameters on different devices (%s "
                                 "and %s at %s); put the whole model on one "
                                 "device" % (device, p.device, nm))
            if p.is_sparse:
                raise TypeError("gtopk: %s is a sparse tensor" % nm)
        if device.type not in ("cpu", "cuda"):
            raise ValueError("gtopk: parameters on %s; gtopk supports the "
                             "CPU and CUDA devices" % device)
        self._cuda = device.type == "cuda"
        self._make_flat(plist, device)
        n = self._n

        # What the wrapped optimizer steps, as built here: a group added to
        # it behind the wrapper's back (inner.add_param_group) or a
        # parameter unfrozen later would be stepped on local gradients.
        self._group_ids = self._group_signature()
        trainable = set(id(p) for p in plist)
        # Frozen parameters (the model's and the groups'): guarded by their
        # version counters at every step and in the divergence checksum.
        frozen, fseen = [], set()
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in trainable and id(p) not in fseen:
                    fseen.add(id(p))
                    frozen.append((names.get(id(p), "a parameter of shape "
                                             "%s" % (tuple(p.shape),)), p))
        if model is not None:
            for name, p in model.named_parameters():
                if id(p) not in trainable and id(p) not in fseen:
                    fseen.add(id(p))
                    frozen.append((name, p))
        self._frozen_params = frozen
        # The model's other state: frozen parameters and buffers (sent once
        # at construction), and the buffers (every step).
        self._state_layout = None
        self._buffer_layout = None
        if model is not None:
            others = [(k, t) for k, t in model.state_dict(keep_vars=True)
                      .items() if isinstance(t, torch.Tensor)
                      and id(t) not in trainable]
            self._state_layout = _Layout(others)
            buffers = list(model.named_buffers())
            if broadcast_buffers and buffers:
                self._buffer_layout = _Layout(buffers)

        # -- backward-pass counting (backward_passes_per_step) ---------------
        self._pass_counts = [0] * len(plist)
        self._hooks = []
        for i, p in enumerate(plist):
            self._hooks.append(p.register_hook(self._make_hook(i)))
        # -- overlap (--selection=layerwise): each parameter's gradient is
        # reported from its AccumulateGrad node's hook, once accumulated
        # into .grad (Horovod's hook point), so that its bucket is selected
        # and pushed while backward goes on. The nodes are kept alive here.
        self._grad_accs = []
        self._reported = [False] * len(plist)
        self._overlap = False
        self._overlap_off = False
        self._deferred_error = None
        self._whole_at_end = False  # _begin_overlap: "whole"
        # Parameters on the GPU: the overlapped step's gradient is staged in
        # host memory, piece by piece (_stage_on_host).
        self._staged = False

        # -- join, check, synchronise -----------------------------------------
        self._client = gtopk.Client(
            str(conn["leader"]), n, conn["rank"],
            rpc_timeout=float(rpc_timeout),
            step_watchdog_margin=float(step_watchdog_margin),
            metrics_port=conn["metrics_port"],
            metrics_host=str(metrics_host), **conn["security"])
        try:
            self._cluster = dict(self._client.cluster())
            c = self._cluster
            gt._check_world_size(conn, c)
            if c.get("apply") != "workers":
                raise errors.FailedPrecondition(
                    "gtopk.torch.DistributedOptimizer(optimizer, ...) runs "
                    "your optimizer on the aggregated gradient, which needs "
                    "the servers started with --apply=workers; these apply "
                    "updates themselves (--apply=%s, their --lr %s). Restart "
                    "them with --apply=workers, or use "
                    "DistributedOptimizer(model.parameters(), lr=...) for "
                    "their SGD" % (c.get("apply"), c.get("lr")))
            self._client.check_settings(
                mode=mode, selector=selector, density=density,
                index_codec=index_codec, value_codec=value_codec)
            self._overlap = self._overlap_mode(overlap, c)
            self._needs_resume = False
            if int(c.get("next_step", 0)) > 0:
                # The shards hold only the initial broadcast: nothing of the
                # current parameters to download.
                self._needs_resume = True
                self._resume_reason = int(c["next_step"])
            else:
                self._synchronize_initial()
        except BaseException:
            self._client.close()
            raise
        if self._overlap and self._cuda:
            self._stage_on_host()
        if self._overlap:
            for i, p in enumerate(plist):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._grad_accs.append(acc)
                self._hooks.append(acc.register_hook(self._make_ready_hook(i)))
        self._stats = None
        self._retry_step = None
        self._failed_grads = None
        self._synchronized = False
        self._counts_at_sync = None
        self._skip_sync = False
        self._last_step_end = time.perf_counter()
        self._record_versions()
        self._frozen = True

    # -- torch.optim.Optimizer's containers: the wrapped optimizer's ---------

    @property
    def param_groups(self):
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._opt.param_groups = value

    @property
    def state(self):
        return self._opt.state

    @state.setter
    def state(self, value):
        self._opt.state = value

    @property
    def defaults(self):
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value):
        self._opt.defaults = value

    @property
    def optimizer(self):
        """The wrapped ``torch.optim.Optimizer``."""
        return self._opt

    def __repr__(self):
        return "gtopk.torch.DistributedOptimizer(%r, apply=workers)" % (
            self._opt,)

    def __reduce_ex__(self, protocol):
        """Pickles as the wrapped optimizer: unpickling gives a detached
        ``torch.optim`` optimizer (its param groups and state, no cluster
        connection), as pickling a plain optimizer gives a detached copy.
        What makes a scheduler's ``state_dict()`` that holds a bound method
        (``OneCycleLR``'s ``anneal_func``, which pickles the scheduler and
        so its optimizer) save with ``torch.save`` as it does without gtopk.
        To resume, use ``state_dict()`` / ``load_state_dict()``: they carry
        the residual, a pickle does not."""
        return (_as_unpickled, (self._opt,))

    def add_param_group(self, param_group):
        raise ValueError(
            "gtopk: add_param_group after construction is not supported (the "
            "trainable parameters form one flat buffer of the cluster's n); "
            "add every group to the optimizer before wrapping it")

    def zero_grad(self, set_to_none=False):
        """The wrapped optimizer's zero_grad. With ``set_to_none=False`` (the
        default here) the gradients stay views of the flat buffer, so
        backward() accumulates in place and gathering copies nothing.
        The gradients it zeroes no longer count: the count of backward
        passes starts afresh, and an exchange done but not yet stepped on
        (synchronize(), or the end of an overlapped backward pass) is
        discarded -- the next backward pass and step() make a new one (each
        exchange is one of the cluster's steps; every rank must do the
        same)."""
        self._opt.zero_grad(set_to_none=set_to_none)
        self._synchronized = False
        self._pass_counts = [0] * len(self._params)

    # -- properties ------------------------------------------------------------

    @property
    def num_workers(self):
        return self._open_client().num_workers

    # -- construction helpers --------------------------------------------------

    def _make_hook(self, i):
        def hook(grad):
            self._pass_counts[i] += 1
            return grad
        return hook

    def _overlap_mode(self, overlap, c):
        """Whether steps overlap with backward: by default when the servers
        run --selection=layerwise (with one backward pass per step; on the
        CPU or the GPU, _stage_on_host); overlap=True where that cannot be
        is refused, naming why."""
        layerwise = c.get("selection") == "layerwise"
        if overlap is False:
            return False
        why = None
        if not layerwise:
            why = ("the servers run --selection=%s: only layer-wise buckets "
                   "(--selection=layerwise) can be pushed while backward "
                   "goes on" % c.get("selection"))
        elif self._passes != 1:
            why = ("backward_passes_per_step=%d: the gradient is final only "
                   "after the last pass" % self._passes)
        if why is None:
            return True
        if overlap:
            raise errors.FailedPrecondition("gtopk: overlap=True, but " + why)
        return False

    def _stage_on_host(self):
        """Overlapped steps through host memory, for parameters on the GPU
        (called at construction; tests call it on the CPU to run the same
        path there): the client selects on the host, so each bucket piece's
        gradient is copied from the device buffer into a pinned host buffer
        as soon as the last parameter overlapping it is ready, then
        reported (one device-to-host copy per piece, which waits for the
        backward work queued so far on the current stream: with the default
        25 MiB buckets a few per step). The average comes back into the
        device buffer in one copy after the round. Pieces: the client's
        bucket_pieces, which partition [0, n)."""
        n = self._n
        pin = self._flat_grad.is_cuda
        self._host_grad = torch.zeros(n, dtype=torch.float32, pin_memory=pin)
        self._host_params = None
        self._pieces = [(int(b), int(e))
                        for b, e in self._client.bucket_pieces]
        if not self._pieces:
            self._pieces = [(0, n)]
        # Per parameter: [(piece index, values of the parameter in it)].
        self._param_pieces = []
        j = 0
        for off, cnt in self._slices:
            while j + 1 < len(self._pieces) and self._pieces[j][1] <= off:
                j += 1
            mine, q = [], j
            while cnt > 0 and q < len(self._pieces) and \
                    self._pieces[q][0] < off + cnt:
                b, e = self._pieces[q]
                mine.append((q, min(e, off + cnt) - max(b, off)))
                q += 1
            self._param_pieces.append(mine)
        self._piece_left = [e - b for b, e in self._pieces]
        self._staged = True

    def _stage_piece(self, q):
        """Piece q's gradient, final on the device: to the host buffer,
        then reported."""
        b, e = self._pieces[q]
        with torch.no_grad():
            self._host_grad[b:e].copy_(self._flat_grad[b:e])
        self._client.gradient_ready(b, e)

    def _make_ready_hook(self, i):
        def hook(*unused):
            self._grad_ready(i)
        return hook

    def _grad_ready(self, i):
        """Parameter i's gradient is accumulated: report its range to the
        open overlapped step (opening one at the first parameter of a
        pass). A parameter reported twice means a new backward pass (e.g.
        after a KeyboardInterrupt in the last one): the open step is
        abandoned and a new one opened. Anything unexpected turns overlap
        off for this step; synchronize() then runs the whole exchange and
        raises what is wrong."""
        client = self._client
        if client is None or not self._overlap or self._overlap_off:
            return
        if self._slices[i][1] == 0:
            return  # no values: nothing to report (its .grad has no data)
        try:
            if self._reported[i] and client.overlapped_step_open:
                client.abandon_overlapped_step()
                self._reported = [False] * len(self._params)
                self._pass_counts = [1 if j == i else 0
                                     for j in range(len(self._params))]
            if not client.overlapped_step_open and \
                    self._begin_overlap() is not True:
                self._overlap_off = True
                return
            off, cnt = self._slices[i]
            p = self._params[i]
            g = p.grad
            fg = self._flat_grad
            if g is not None and not (
                    not g.is_sparse and g.data_ptr() == fg.data_ptr() + 4 * off
                    and g.is_contiguous() and g.shape == p.shape):
                with torch.no_grad():
                    slot = fg[off:off + cnt]
                    slot.copy_((g.to_dense() if g.is_sparse else g)
                               .reshape(-1))
                    p.grad = slot.view(p.shape)
            elif g is None:
                return  # reported at synchronize() (zeros)
            self._reported[i] = True
            if not self._staged:
                client.gradient_ready(off, off + cnt)
                return
            for q, values in self._param_pieces[i]:
                self._piece_left[q] -= values
                if self._piece_left[q] == 0:
                    self._stage_piece(q)
        except errors.Error:
            if client.overlapped_step_open:
                client.abandon_overlapped_step()
            self._overlap_off = True

    def _begin_overlap(self):
        """Opens the step's overlapped exchange from the first gradient
        hook. True when opened; "whole" when a failed attempt of this step
        is pending (its gradient is in the residual): the retry, the whole
        exchange with a zero gradient, then runs at the end of this
        backward pass, so that .grad is the average when backward()
        returns, as on the other ranks; False when the step is left to
        synchronize() (a resume, a write outside step(), too many passes,
        an exchange already done), which raises what is wrong."""
        if self._needs_resume or self._synchronized:
            return False
        if self._pass_counts and max(self._pass_counts) > self._passes:
            return False
        try:
            self._check_unchanged()
        except errors.Error:
            return False
        if self._retry_step is not None:
            self._whole_at_end = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self._end_of_backward)
            return "whole"
        client = self._client
        due = client.checksum_due
        state_checksum = self._state_checksum() if due else 0
        buffers = (self._buffer_layout.pack()
                   if self._buffer_layout is not None and client.rank == 0
                   else b"")
        if self._staged:
            grad = self._host_grad.numpy()
            # Alive until the step ends (the client reads it).
            self._host_params = (self._flat.detach().to("cpu")
                                 if due else None)
            params = (self._host_params.numpy()
                      if self._host_params is not None else None)
            self._piece_left = [e - b for b, e in self._pieces]
        else:
            grad = self._flat_grad.numpy()
            params = self._flat.numpy() if due else None
        client.begin_overlapped_step(grad, grad, params, buffers,
                                     state_checksum)
        self._reported = [False] * len(self._params)
        # At the end of this backward pass (as DDP's reducer finalises its
        # buckets): the exchange ends, and .grad is the average when
        # backward() returns.
        torch.autograd.Variable._execution_engine.queue_callback(
            self._end_of_backward)
        return True

    def _end_of_backward(self):
        """Autograd's end-of-pass callback for an overlapped step: waits
        for the remaining pulls and writes the average into .grad, so that
        after backward() the gradient is the aggregated one, as under DDP
        (clip it, then step()). A failed round (gtopk.RETRYABLE) is
        recovered and the step retried here, within the recovery budget:
        the other ranks get this step's average inside their backward pass
        and may change it before step() (clip_grad_norm_), so this rank
        must have it there too; a retry left to step() would come after
        the script's change and this replica would differ. The same holds
        for the retry of an attempt that failed earlier (a Ctrl-C in this
        wait, the budget spent): the next backward pass's end runs it
        (_begin_overlap, "whole"). A retryable failure the budget cannot
        mend is raised out of backward(), as DDP raises from backward()
        when its all-reduce fails; every other gtopk error is kept and
        raised by the next synchronize()/step(); Ctrl-C propagates out of
        backward()."""
        client = self._client
        whole, self._whole_at_end = self._whole_at_end, False
        if client is None or not (client.overlapped_step_open or whole):
            return
        t0 = time.perf_counter()
        recovered = 0
        try:
            try:
                if client.overlapped_step_open:
                    stats, received = self._finish_overlap()
                else:
                    stats, received = self._exchange_whole()
            except errors.RETRYABLE as failed:
                stats, received, recovered = self._retry_in_backward(failed)
        except errors.RETRYABLE:
            # The recovery budget is spent. Deferred to step(), the retry
            # would run after the script's changes to .grad, which the
            # other ranks made to the average.
            raise
        except errors.Error as e:
            self._deferred_error = e
            return
        self._after_exchange(stats, received, t0)
        self._stats["recovered_in_backward"] = recovered

    def _retry_in_backward(self, failed):
        """The documented recovery loop, run at the end of backward after
        the overlapped round failed: recover(), then the whole exchange
        with a zero gradient, until it succeeds or the recovery budget is
        spent (then the last error). Returns (stats, buffers, recoveries)."""
        deadline = time.monotonic() + self._budget()
        recoveries = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise failed
            try:
                self._recover_within_budget(
                    lambda secs: self._client.recover(None, secs), left)
                recoveries += 1
                stats, received = self._exchange_whole()
                return stats, received, recoveries
            except errors.RETRYABLE as e:
                failed = e

    def _end_overlap_step(self):
        """Between steps: overlap on again, nothing reported."""
        self._overlap_off = False
        self._reported = [False] * len(self._params)

    def _finish_overlap(self):
        """synchronize() of an overlapped step: the parameters that got no
        gradient hook (unused, or .grad None) go in as zeros or as their
        .grad, then the round's end. Same failure contract as the whole
        exchange."""
        client = self._client
        fg = self._flat_grad
        ptr0 = fg.data_ptr()
        for i, (p, (off, cnt)) in enumerate(zip(self._params, self._slices)):
            g = p.grad
            if self._reported[i] and (g is None or g.is_sparse or not (
                    g.data_ptr() == ptr0 + 4 * off and g.is_contiguous()
                    and g.shape == p.shape)):
                # .grad was replaced after backward (p.grad = p.grad * c):
                # what was sent is not the gradient this rank now holds.
                client.abandon_overlapped_step()
                self._end_overlap_step()
                raise errors.FailedPrecondition(
                    "the .grad of %s was replaced after backward and before "
                    "the step: an overlapped step sends each bucket as "
                    "backward produces it, so the replacement would not be "
                    "what was sent. Change gradients after synchronize() "
                    "(then step() under skip_synchronize()), or pass "
                    "overlap=False; the step was given up (recover(), then "
                    "repeat it)" % self._names[i])
        with torch.no_grad():
            for i, (p, (off, cnt)) in enumerate(zip(self._params,
                                                   self._slices)):
                if self._reported[i]:
                    continue
                slot = fg[off:off + cnt]
                g = p.grad
                if g is None:
                    slot.zero_()
                elif g.is_sparse or not (
                        g.data_ptr() == ptr0 + 4 * off and g.is_contiguous()
                        and g.shape == p.shape):
                    slot.copy_((g.to_dense() if g.is_sparse else g)
                               .reshape(-1))
                p.grad = slot.view(p.shape)
            if self._staged:
                # The pieces not complete yet (a parameter without a hook
                # call): as they are now, taken unreported by the client.
                for q, left in enumerate(self._piece_left):
                    if left > 0:
                        b, e = self._pieces[q]
                        self._host_grad[b:e].copy_(fg[b:e])
        self._retry_step = None
        self._failed_grads = None
        try:
            result = client.finish_overlapped_step()
            if self._staged:
                with torch.no_grad():
                    fg.copy_(self._host_grad)  # the average, to the device
            return result
        except (errors.InvalidArgument, errors.Unimplemented):
            raise
        except (errors.Error, KeyboardInterrupt):
            self._retry_step = client.next_step
            self._failed_grads = self._grad_signature()
            raise
        finally:
            self._host_params = None
            self._end_overlap_step()

    def _synchronize_initial(self):
        """Rank 0's parameters and state to every replica (the shards keep
        the first rank 0 offered), recovering within the budget when a shard
        is restarting or stalled (as gtopk-worker does)."""
        blob = self._state_layout.pack() if self._state_layout else b""
        step, state = self._retry_within_budget(
            lambda: self._with_host_params(
                lambda buf: self._client.synchronize_with_state(buf, blob)),
            lambda left: self._client.recover(None, left))
        if step != 0:
            self._needs_resume = True
            self._resume_reason = step
            return
        if self._state_layout is not None:
            self._state_layout.unpack(state, "state (buffers and frozen "
                                      "parameters)")

    # -- the version check (writes outside step) ------------------------------

    def _record_versions(self):
        self._versions = [p._version for p in self._params]
        self._frozen_versions = [p._version for _, p in self._frozen_params]

    def _group_signature(self):
        return [tuple(id(p) for p in g["params"])
                for g in self._opt.param_groups]

    def _state_checksum(self):
        """The frozen parameters' checksum (0 without any), sent with the
        parameters' on checksum steps so that a frozen weight edited on one
        rank is caught too."""
        if not self._frozen_params:
            return 0
        h = hashlib.blake2b(digest_size=8)
        for _, p in self._frozen_params:
            h.update(_tensor_bytes(p))
        return int.from_bytes(h.digest(), "little") or 1

    def accept_parameter_changes(self):
        """Say that the parameters were changed outside :meth:`step` on
        purpose, identically on every rank (e.g. weight clipping); the next
        step does not refuse. The checksum alarm still compares replicas."""
        self._check_views()
        self._record_versions()

    def _check_views(self):
        base = self._flat.data_ptr()
        for i, (p, (off, cnt)) in enumerate(zip(self._params, self._slices)):
            # An empty parameter has no storage to point into (data_ptr 0).
            if cnt > 0 and p.data_ptr() != base + 4 * off:
                raise errors.FailedPrecondition(
                    "%s was replaced after the gtopk DistributedOptimizer was "
                    "constructed (e.g. model.to(), .float(), load_state_dict "
                    "with assign); updates would not reach the model. "
                    "Construct the optimizer after moving the model, and load "
                    "state before constructing it" % self._names[i])

    def _check_unchanged(self):
        self._check_views()
        if self._group_signature() != self._group_ids:
            raise errors.FailedPrecondition(
                "the wrapped optimizer's param groups changed after the gtopk "
                "DistributedOptimizer was constructed (add_param_group on the "
                "wrapped optimizer, or params replaced): those parameters "
                "would be stepped on each rank's local gradient and the "
                "replicas would differ. Give the optimizer every group before "
                "wrapping it")
        for nm, p in self._frozen_params:
            if p.requires_grad:
                raise errors.FailedPrecondition(
                    "%s was frozen (requires_grad=False) when the gtopk "
                    "DistributedOptimizer was constructed and now requires a "
                    "gradient: it is not among the n parameters the cluster "
                    "aggregates, so it would be trained on each rank's local "
                    "gradient. Unfreeze parameters before constructing the "
                    "optimizer (and the servers' n), or keep it frozen" % nm)
        changed_frozen = [nm for (nm, p), v in zip(self._frozen_params,
                                                   self._frozen_versions)
                          if p._version != v]
        if changed_frozen:
            raise errors.FailedPrecondition(
                "the frozen parameter(s) %s were written outside step() since "
                "the last step: this replica would silently differ from the "
                "others. Load the model's state before constructing the "
                "optimizer, or restart every rank from one checkpoint; if you "
                "changed them identically on every rank on purpose, call "
                "opt.accept_parameter_changes()" % ", ".join(
                    changed_frozen[:3]))
        changed = [self._names[i] for i, p in enumerate(self._params)
                   if p._version != self._versions[i]]
        if changed:
            raise errors.FailedPrecondition(
                "the parameters were written outside step() since the last "
                "step (%s%s), e.g. by model.load_state_dict after the gtopk "
                "DistributedOptimizer was constructed: this replica would "
                "silently differ from the others. Load the model's state "
                "before constructing the optimizer (rank 0's state is then "
                "broadcast), or restart every rank from one checkpoint; if "
                "you changed the parameters identically on every rank on "
                "purpose, call opt.accept_parameter_changes()" % (
                    ", ".join(changed[:3]),
                    "" if len(changed) <= 3 else
                    " and %d more" % (len(changed) - 3)))

    # -- the step -------------------------------------------------------------

    def synchronize(self):
        """The gTop-k exchange of this step: afterwards every trainable
        parameter's ``.grad`` is the average of the global top-k (identical
        on every rank). Blocks until every shard answered (at most the
        servers' step timeout plus ``step_watchdog_margin``).

        Raises: :class:`gtopk.FailedPrecondition` before anything is sent
        when the parameters were written outside step(), when this rank must
        load its checkpoint first, or when more backward passes than
        ``backward_passes_per_step`` were accumulated; the exchange's
        :class:`gtopk.Error` (nothing applied; retry after :meth:`recover`
        for :data:`gtopk.RETRYABLE`)."""
        self._check_open()
        if self._synchronized:
            return
        if self._needs_resume:
            raise errors.FailedPrecondition(
                "the cluster is at step %d and runs with --apply=workers: the "
                "servers hold no copy of the current parameters, so this rank "
                "cannot join from them. Load this rank's checkpoint: the "
                "model's state_dict before constructing the optimizer, then "
                "opt.load_state_dict(checkpoint['opt']) (every rank, the "
                "checkpoints of one step); or restart the servers for a new "
                "run" % self._resume_reason)
        self._check_unchanged()
        most = max(self._pass_counts) if self._pass_counts else 0
        if most > self._passes:
            raise errors.FailedPrecondition(
                "gradients were computed %d times before the step, more than "
                "backward_passes_per_step=%d: pass "
                "backward_passes_per_step=%d to accumulate them locally, or "
                "call zero_grad() between passes" % (most, self._passes,
                                                      most))
        client = self._client
        t0 = time.perf_counter()
        if self._deferred_error is not None:
            # The overlapped exchange at the end of backward failed: its
            # error now, where the recovery loop is (the retry runs whole).
            e, self._deferred_error = self._deferred_error, None
            raise e
        if client.overlapped_step_open:
            stats, received = self._finish_overlap()
        else:
            stats, received = self._exchange_whole()
        self._after_exchange(stats, received, t0)

    def _exchange_whole(self):
        """The whole exchange after backward (or the retry of a failed
        one, with a zero gradient: the failed attempt's is in the
        residual); returns (stats, rank 0's buffers). The average is in
        .grad. Errors as synchronize()'s."""
        client = self._client
        self._end_overlap_step()
        if self._retry_step is not None and (
                self._retry_step == client.next_step
                or self._same_grads(self._grad_signature(),
                                    self._failed_grads)):
            # The failed attempt's gradient is in the residual: send zero.
            if self._zero_grad_buf is None:
                self._zero_grad_buf = torch.zeros_like(self._flat_grad)
            # .grad views in place for the result
            self._gather_gradients(view_missing=True)
            grad = self._zero_grad_buf
        else:
            self._gather_gradients(view_missing=True)
            grad = self._flat_grad
        due = client.checksum_due
        state_checksum = self._state_checksum() if due else 0
        rank0 = client.rank == 0
        buffers = (self._buffer_layout.pack()
                   if self._buffer_layout is not None and rank0 else b"")
        self._retry_step = None
        self._failed_grads = None
        try:
            if not self._cuda:
                stats, received = client.aggregate_step(
                    grad.numpy(), self._flat_grad.numpy(),
                    self._flat.numpy() if due else None, buffers,
                    state_checksum)
            else:
                host_grad = grad.detach().to("cpu", copy=True)
                host_avg = torch.empty_like(host_grad)
                host_params = self._flat.detach().to("cpu").numpy() \
                    if due else None
                stats, received = client.aggregate_step(
                    host_grad.numpy(), host_avg.numpy(), host_params, buffers,
                    state_checksum)
                with torch.no_grad():
                    self._flat_grad.copy_(host_avg)
        except (errors.InvalidArgument, errors.Unimplemented):
            raise
        except (errors.Error, KeyboardInterrupt):
            self._retry_step = client.next_step
            self._failed_grads = self._grad_signature()
            raise
        return stats, received

    def _after_exchange(self, stats, received, t0):
        """The end of a successful exchange (whole or overlapped): rank 0's
        buffers, frozen parameters' .grad, the stats."""
        if self._buffer_layout is not None and self._client.rank != 0:
            self._buffer_layout.unpack(received, "buffers")
        # A parameter frozen since construction (requires_grad=False now)
        # is left alone by the wrapped optimizer, as under DDP: no .grad.
        # Every rank drops the same entries, so the replicas stay equal.
        for p in self._params:
            if not p.requires_grad:
                p.grad = None
        self._stats = dict(stats)
        self._stats["exchange_seconds"] = time.perf_counter() - t0
        self._stats["recovered_in_backward"] = 0
        self._synchronized = True
        self._counts_at_sync = list(self._pass_counts)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, :meth:`step` runs the wrapped optimizer only (after an
        explicit :meth:`synchronize`), as Horovod's ``skip_synchronize``."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None, *, loss=None):
        """:meth:`synchronize` (unless it already ran for this step, or
        inside :meth:`skip_synchronize`), then the wrapped optimizer's
        ``step()`` on the averaged gradient. Returns the closure's loss.

        ``loss`` (keyword): this step's loss for the metrics."""
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._check_open()
        t0 = time.perf_counter()
        compute = t0 - self._last_step_end
        if self._synchronized and self._pass_counts != self._counts_at_sync:
            self._synchronized = False
            self._pass_counts = [0] * len(self._params)
            raise errors.FailedPrecondition(
                "backward() ran after this step's exchange and before "
                "step() (synchronize(), or the end of an overlapped "
                "backward pass, which exchanges as synchronize() does): "
                ".grad is no longer the aggregated gradient (the replicas "
                "would differ). To accumulate several backward passes per "
                "step pass backward_passes_per_step (overlap then stays "
                "off); else call synchronize() after the last backward "
                "pass. zero_grad() and compute the step's gradient again")
        if not self._skip_sync or not self._synchronized:
            self.synchronize()
        self._opt.step()
        self._synchronized = False
        self._pass_counts = [0] * len(self._params)
        self._record_versions()
        now = time.perf_counter()
        client = self._client
        if self._record_step_metrics and client.metrics_port:
            if loss is None and result is not None:
                loss = result
            loss_value = float("nan") if loss is None else float(
                loss.detach().item() if torch.is_tensor(loss) else loss)
            client.record_metrics(compute, compute + (now - t0), loss_value)
        self._last_step_end = now
        return result

    def recover(self, timeout=None):
        """After a failed exchange: asks the leader to bring the shards to one
        step and returns it (:attr:`next_step`). Nothing is downloaded (the
        shards hold no parameters in this mode); a rollback renumbers the
        steps. Waits for a shard or leader that is restarting (the leader's
        UNAVAILABLE answers are asked again) up to `timeout` seconds, default
        the constructor's ``recovery_timeout``, else 4 step timeouts.
        Raises :class:`gtopk.FailedPrecondition` when this worker missed a
        committed step's result (restart every rank from one checkpoint)."""
        self._check_open()
        return self._recover_within_budget(
            lambda left: self._client.recover(None, left), timeout)

    # -- checkpoints -----------------------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()`` plus ``"gtopk"``:
        ``{"step": int, "residual": float32 tensor [n], "rank": int, "n":
        int, "apply": "workers", "cluster_fingerprint": str}`` (CPU
        copies). Per rank: every rank saves its own.

        Raises :class:`gtopk.FailedPrecondition` between the exchange and
        ``step()`` (after ``synchronize()``, or after ``backward()`` of an
        overlapped step, which exchanges at its end): the step's exchange
        is done but the optimizer has not stepped, so no consistent state
        exists then; save after ``step()``."""
        self._check_open()
        if self._synchronized:
            raise errors.FailedPrecondition(
                "state_dict() between this step's exchange and step(): the "
                "gradients were aggregated (synchronize(), or the end of an "
                "overlapped backward pass) but the optimizer has not stepped, "
                "so the residual and the parameters belong to different steps; "
                "save the checkpoint after opt.step()")
        sd = self._opt.state_dict()
        st = self._client.state()
        sd["gtopk"] = {
            "step": int(st["step"]),
            "residual": torch.from_numpy(np.array(st["residual"], _F32)),
            "rank": self.rank,
            "n": self._n,
            "apply": "workers",
            "cluster_fingerprint": self._cluster.get("cluster_fingerprint"),
        }
        return sd

    def load_state_dict(self, state_dict):
        """Restores a :meth:`state_dict` of this rank: the wrapped optimizer's
        state, the residual and the step; the shards are moved to that step
        (they hold nothing else). Load the model's own state *before*
        constructing the optimizer. Every rank loads its checkpoint of the
        same step.

        Raises ``ValueError`` for a dict without ``"gtopk"``;
        :class:`gtopk.FailedPrecondition` for another rank's or n's state
        or one saved in servers-apply mode."""
        self._check_open()
        if self._client.overlapped_step_open:
            # A checkpoint loaded in the middle of a step starts over.
            self._client.abandon_overlapped_step()
            self._end_overlap_step()
        if "gtopk" not in state_dict:
            raise ValueError(
                "gtopk: this state dict has no 'gtopk' entry: it is not from "
                "gtopk.torch.DistributedOptimizer.state_dict()")
        sd = dict(state_dict)
        g = sd.pop("gtopk")
        if g.get("apply") != "workers":
            raise errors.FailedPrecondition(
                "the checkpoint's gtopk state was saved with the servers "
                "applying the updates (--apply=servers); it cannot resume a "
                "workers-apply run")
        if int(g["n"]) != self._n:
            raise errors.FailedPrecondition(
                "the checkpoint's gtopk state has n=%d but this model has "
                "n=%d" % (int(g["n"]), self._n))
        if int(g["rank"]) != self.rank:
            raise errors.FailedPrecondition(
                "the checkpoint holds rank %d's gtopk state (its residual) "
                "but this worker is rank %d: every rank saves and loads its "
                "own (e.g. torch.save(opt.state_dict(), "
                "f'opt-rank{opt.rank}.pt')) and joins as the same rank "
                "(rank=..., $RANK)" % (int(g["rank"]), self.rank))
        step = int(g["step"])
        residual = g["residual"]
        residual = (residual.detach().to("cpu", torch.float32).contiguous()
                    if torch.is_tensor(residual)
                    else torch.as_tensor(residual, dtype=torch.float32))
        self._client.resume_at(step)
        self._client.load_state(step, residual.numpy(),
                                np.zeros(self._n, _F32))
        self._opt.load_state_dict(sd)
        self._needs_resume = False
        self._retry_step = None
        self._failed_grads = None
        self._synchronized = False
        self._record_versions()

    # -- life cycle ------------------------------------------------------------

    def _release(self):
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
