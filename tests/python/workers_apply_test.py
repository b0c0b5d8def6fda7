"""gtopk.torch.DistributedOptimizer(optimizer, ...) -- workers apply
(gtopk-server --apply=workers) -- against real shards.

* Replicas are bit-identical to a reference written here: plain NumPy
  gTop-k (u = residual + g per worker, local top-k, the rank-order sum, the
  global top-k, put-back, the sum / P) feeding the same torch optimizer, for
  SGD with Nesterov momentum, Adam, RMSprop, and AdamW with two param
  groups and a cosine schedule, over P in {1, 2, 3} and S in {1, 2}.
* Buffers: BatchNorm running statistics equal rank 0's on every rank after
  every step; evaluation gives the same output everywhere; frozen
  parameters and buffers reach every rank at construction.
* The divergence alarm fires on a replica changed behind the optimizer's
  back (both ranks get FAILED_PRECONDITION naming the ranks and the step)
  and never on a healthy run; a write outside step() is refused before
  anything is sent.
* Every refusal's message; sparse embedding gradients; frozen parameters
  never move; backward_passes_per_step; synchronize/skip_synchronize.
* Resume from the users' checkpoints is bit-identical to an uninterrupted
  run; a rank coming back without one is told what to load.

Run: PYTHONPATH=build/python GTOPK_BUILD_DIR=build /usr/bin/python3
tests/python/workers_apply_test.py
"""

import math
import os
import shutil
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cluster_util as cu  # noqa: E402
import gtopk  # noqa: E402
import gtopk.torch  # noqa: E402
from gtopk._workers_apply import GradientAggregationOptimizer  # noqa: E402

F32 = np.float32
RPC_TIMEOUT = 30.0
THREAD_TIMEOUT = 120.0
DENSITY = 0.1
FLAGS = {"mode": "gtopk", "density": DENSITY, "apply": "workers",
         "selector": "exact"}


def make_model(seed=7, bn=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 10)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(10))
    layers += [torch.nn.ReLU(), torch.nn.Linear(10, 3)]
    return torch.nn.Sequential(*layers)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(6, 12, generator=g),
            torch.randint(0, 3, (6,), generator=g))


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def groups_of(model):
    """Two param groups: weights with decay, biases without (and a 10x lr
    on the biases, so the groups differ in more than one setting)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters()
                if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.05},
            {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}]


OPTIMIZERS = {
    "sgd_nesterov": (lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, nesterov=True), None),
    "adam": (lambda m: torch.optim.Adam(m.parameters(), lr=0.01), None),
    "rmsprop": (lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01,
                                              momentum=0.5), None),
    "adamw_groups_cosine": (
        lambda m: torch.optim.AdamW(groups_of(m), lr=0.002),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5)),
}


def flat_of(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


def topk_indices(values, k):
    """The k largest |values|, ties to the lower index (the exact
    selector's and the servers' rule)."""
    order = np.argsort(-np.abs(values), kind="stable")
    return np.sort(order[:k])


def reference(P, steps, opt_name, density=DENSITY):
    """Final flat parameters of P replicas trained with plain gTop-k and the
    named torch optimizer (every replica is the same model, so one is
    kept)."""
    model = make_model()
    make_opt, make_sched = OPTIMIZERS[opt_name]
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    k = max(1, int(round(density * n)))
    residual = [np.zeros(n, F32) for _ in range(P)]
    for step in range(steps):
        us, sent = [], []
        for w in range(P):
            model.zero_grad()
            loss_of(model, w, step).backward()
            g = flat_of([p.grad for p in params]).astype(F32)
            u = (residual[w] + g).astype(F32)
            us.append(u)
            sent.append(topk_indices(u, k))
        total = np.zeros(n, F32)
        union = np.zeros(n, bool)
        for w in range(P):  # rank order, as the shards add
            total[sent[w]] += us[w][sent[w]]
            union[sent[w]] = True
        cand = np.nonzero(union)[0]
        keep = cand[topk_indices(total[cand], min(k, cand.size))]
        selected = np.zeros(n, bool)
        selected[keep] = True
        for w in range(P):
            r = us[w].copy()
            r[sent[w]] = 0.0
            back = sent[w][~selected[sent[w]]]
            r[back] = us[w][back]
            residual[w] = r
        avg = np.zeros(n, F32)
        avg[keep] = total[keep] / F32(P)
        off = 0
        for p in params:
            cnt = p.numel()
            p.grad = torch.from_numpy(avg[off:off + cnt].copy()).view(p.shape)
            off += cnt
        opt.step()
        if sched is not None:
            sched.step()
    return flat_of(params), k


def in_threads(count, fn, in_main=None):
    """fn(i) for i in range(count), each in a thread of its own, but for
    i == in_main, run in the calling thread (where a signal such as
    _thread.interrupt_main reaches it). Returns (results, exceptions)."""
    results, errs = [None] * count, [None] * count

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: B902 - re-raised below
            errs[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True)
               for i in range(count) if i != in_main]
    for t in threads:
        t.start()
    if in_main is not None:
        body(in_main)
    for t in threads:
        t.join(THREAD_TIMEOUT)
        if t.is_alive():
            raise AssertionError("a worker thread did not finish")
    return results, errs


def raise_first(errs):
    for e in errs:
        if e is not None:
            raise e


def step_with_retry(opt, deadline, failures=None, index=0):
    """opt.step() with the documented recovery loop until `deadline`
    (time.monotonic()); counts the failures in failures[index]."""
    import time
    while True:
        try:
            opt.step()
            return
        except gtopk.RETRYABLE:
            if failures is not None:
                failures[index] += 1
            if time.monotonic() > deadline:
                raise
            opt.recover()


class ClusterCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk-workers-apply-test-")
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, shards, workers, name="srv", **flags):
        f = dict(FLAGS)
        f.update(flags)
        s = cu.Servers(shards, workers, self.dir, name=name, **f)
        self.servers.append(s)
        return s.start()

    def wrap(self, srv, inner, rank, **kw):
        kw.setdefault("rpc_timeout", RPC_TIMEOUT)
        return gtopk.torch.DistributedOptimizer(
            inner, leader=srv.leader, rank=rank, tls="off", **kw)


class ReferenceTest(ClusterCase):
    """Replicas bit-identical to the NumPy gTop-k + torch optimizer."""

    def run_case(self, opt_name, P, S, steps=6):
        srv = self.start(S, P, checksum_every=2)
        models = [make_model() for _ in range(P)]
        make_opt, make_sched = OPTIMIZERS[opt_name]

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, make_opt(model), w,
                            named_parameters=model.named_parameters(),
                            model=model)
            sched = make_sched(opt) if make_sched else None
            ks = []
            try:
                for step in range(steps):
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    opt.step()
                    ks.append(opt.stats["k"])
                    if sched is not None:
                        sched.step()
                return flat_of(model.parameters()), ks
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        want, k = reference(P, steps, opt_name)
        for w, (got, ks) in enumerate(results):
            self.assertEqual(ks, [k] * steps)
            np.testing.assert_array_equal(
                got.view(np.uint32), want.view(np.uint32),
                err_msg="%s P=%d S=%d rank %d" % (opt_name, P, S, w))

    def test_sgd_nesterov_one_worker_one_shard(self):
        self.run_case("sgd_nesterov", P=1, S=1)

    def test_sgd_nesterov_three_workers_two_shards(self):
        self.run_case("sgd_nesterov", P=3, S=2)

    def test_adam_two_workers_two_shards(self):
        self.run_case("adam", P=2, S=2)

    def test_rmsprop_two_workers_one_shard(self):
        self.run_case("rmsprop", P=2, S=1)

    def test_adamw_groups_cosine_two_workers_one_shard(self):
        self.run_case("adamw_groups_cosine", P=2, S=1)

    def test_adamw_groups_cosine_three_workers_two_shards(self):
        self.run_case("adamw_groups_cosine", P=3, S=2)


class BuffersAndStateTest(ClusterCase):
    def test_buffers_equal_rank0_and_evaluation_agrees(self):
        P = 2
        srv = self.start(2, P)
        models = [make_model(bn=True) for _ in range(P)]
        # Rank 1 starts from other values, frozen parameters and buffers:
        # construction must replace them with rank 0's.
        torch.manual_seed(99)
        with torch.no_grad():
            for p in models[1].parameters():
                p.add_(torch.randn_like(p))
            models[1][1].running_mean.fill_(3.0)
        frozen = [torch.nn.Parameter(torch.full((3,), float(w)),
                                     requires_grad=False) for w in range(P)]
        for w in range(P):
            models[w].register_parameter("frozen", frozen[w])
        x_eval = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.AdamW(model.parameters(),
                                                   lr=0.01), w, model=model)
            try:
                start = {k: v.clone() for k, v in model.state_dict().items()}
                per_step = []
                for step in range(4):
                    model.train()
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    opt.step()
                    per_step.append([b.clone() for b in model.buffers()])
                model.eval()
                with torch.no_grad():
                    out = model(x_eval)
                return start, per_step, out, model.frozen.clone()
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        start0, steps0, out0, frozen0 = results[0]
        start1, steps1, out1, frozen1 = results[1]
        for key in start0:
            torch.testing.assert_close(start1[key], start0[key], rtol=0,
                                       atol=0, msg="state %s at start" % key)
        for s, (b0, b1) in enumerate(zip(steps0, steps1)):
            for x, y in zip(b0, b1):
                self.assertTrue(torch.equal(x, y), "buffers at step %d" % s)
        # The buffers moved (rank 0's BatchNorm statistics travelled).
        self.assertFalse(torch.equal(steps0[-1][0], start0["1.running_mean"]))
        self.assertTrue(torch.equal(out0, out1))
        # Frozen: rank 0's value everywhere, never moved by AdamW's decay.
        self.assertTrue(torch.equal(frozen0, torch.zeros(3)))
        self.assertTrue(torch.equal(frozen1, torch.zeros(3)))

    def test_an_empty_parameter_is_carried_along(self):
        """A zero-element parameter (nn.Parameter(torch.zeros(0)), e.g. a
        layer configured away) has no storage to view: it trains with the
        others instead of being refused as "replaced"."""
        srv = self.start(1, 1)
        model = make_model()
        model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
        opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                        model=model)
        try:
            for step in range(2):
                opt.zero_grad()
                (loss_of(model, 0, step) + model.empty.sum()).backward()
                opt.step()
            self.assertEqual(opt.next_step, 2)
        finally:
            opt.close()

    def test_one_cycle_state_dict_saves_as_without_gtopk(self):
        """OneCycleLR's state_dict() holds anneal_func, a bound method that
        pickles the scheduler and its optimizer: torch.save of it works as
        with a plain optimizer (the wrapper pickles as the wrapped one, a
        detached copy), and a scheduler loaded from it continues with the
        learning rates of one that never stopped."""
        import io
        import pickle
        srv = self.start(1, 1)
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = self.wrap(srv, inner, 0, model=model)
        try:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5,
                                                        total_steps=10)
            for step in range(3):
                opt.zero_grad()
                loss_of(model, 0, step).backward()
                opt.step()
                sched.step()
            buf = io.BytesIO()
            torch.save({"sched": sched.state_dict()}, buf)
            copy = pickle.loads(pickle.dumps(opt))
            self.assertIs(type(copy), torch.optim.SGD)
            self.assertEqual(copy.param_groups[0]["lr"],
                             inner.param_groups[0]["lr"])
            self.assertEqual(len(copy.state), len(inner.state))
            buf.seek(0)
            saved = torch.load(buf)["sched"]
            again = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5,
                                                        total_steps=10)
            again.load_state_dict(saved)
            self.assertEqual(again.last_epoch, sched.last_epoch)
            for _ in range(3):
                sched.step()
                again.step()
                self.assertEqual(again.get_last_lr(), sched.get_last_lr())
        finally:
            opt.close()

    def test_sparse_embedding_and_accumulation(self):
        srv = self.start(1, 1, density=1.0)
        torch.manual_seed(5)
        emb = torch.nn.Embedding(20, 4, sparse=True)
        head = torch.nn.Linear(4, 2)
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
        opt = self.wrap(srv, torch.optim.Adam(model.parameters(), lr=0.1), 0,
                        model=model, backward_passes_per_step=2)
        try:
            before = emb.weight.detach().clone()
            for _ in range(2):
                idx = torch.tensor([1, 3, 3])
                head(emb(idx)).sum().backward()
            self.assertTrue(emb.weight.grad.is_sparse)
            opt.step()
            self.assertFalse(emb.weight.grad.is_sparse)
            moved = (before != emb.weight.detach()).any(dim=1)
            self.assertEqual(moved.nonzero().flatten().tolist(), [1, 3])
            # Three passes with backward_passes_per_step=2: refused.
            opt.zero_grad()
            for _ in range(3):
                head(emb(torch.tensor([2]))).sum().backward()
            with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                        "computed 3 times.*"
                                        "backward_passes_per_step=2"):
                opt.step()
        finally:
            opt.close()

    def test_synchronize_then_clip_under_skip_synchronize(self):
        srv = self.start(1, 1, density=1.0)
        model = make_model()
        opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                        model=model)
        try:
            loss_of(model, 0, 0).backward()
            local = flat_of([p.grad for p in model.parameters()]).copy()
            opt.synchronize()
            # P = 1, density 1: the average is the local gradient itself.
            np.testing.assert_array_equal(
                flat_of([p.grad for p in model.parameters()]), local)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            clipped = [p.grad.clone() for p in model.parameters()]
            before = [p.detach().clone() for p in model.parameters()]
            with opt.skip_synchronize():
                opt.step()
            self.assertEqual(opt.next_step, 1)  # one exchange, not two
            for p, b, g in zip(model.parameters(), before, clipped):
                torch.testing.assert_close(p.detach(), b - 0.1 * g,
                                           rtol=1e-6, atol=1e-7)
        finally:
            opt.close()


class RefusalTest(ClusterCase):
    def test_an_empty_state_blob_says_shard_0_restarted(self):
        """Shard 0 restored from a checkpoint serves no rank-0 state: the
        joining rank is told that, not that its model differs."""
        from gtopk._workers_apply import _Layout
        layout = _Layout([("bn.running_mean", torch.zeros(3))])
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "shard 0 holds no state.*restarted"):
            layout.unpack(b"", "state")
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "do not match this model"):
            layout.unpack(b"x" * 20, "state")

    def test_messages(self):
        srv = self.start(1, 1)
        model = make_model()
        with self.assertRaisesRegex(TypeError, r"float32 parameters only; "
                                    r"0\.weight is torch\.bfloat16"):
            m = make_model().to(torch.bfloat16)
            self.wrap(srv, torch.optim.AdamW(m.parameters()), 0,
                      named_parameters=m.named_parameters())
        with self.assertRaisesRegex(ValueError, "is not in it"):
            self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                      named_parameters=list(model.named_parameters())[:1])
        with self.assertRaisesRegex(ValueError, "backward_passes_per_step"):
            self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                      backward_passes_per_step=0)
        opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                        model=model)
        try:
            with self.assertRaisesRegex(ValueError, "add_param_group"):
                opt.add_param_group({"params": [torch.zeros(1)]})
            opt.zero_grad()
            loss_of(model, 0, 0).backward()
            opt.step()
            # A late load_state_dict: refused before anything is sent.
            state = {k: v + 1 for k, v in model.state_dict().items()}
            model.load_state_dict(state)
            loss_of(model, 0, 1).backward()
            with self.assertRaisesRegex(
                    gtopk.FailedPrecondition,
                    "written outside step.*0.weight.*Load the model's state "
                    "before constructing"):
                opt.step()
            self.assertEqual(opt.next_step, 1)
            opt.accept_parameter_changes()
            opt.step()
            self.assertEqual(opt.next_step, 2)
        finally:
            opt.close()

    def test_construction_and_checkpoint_messages(self):
        srv = self.start(1, 1)
        model = make_model()
        sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
        cases = [
            (TypeError, "expected a torch.optim.Optimizer",
             lambda: GradientAggregationOptimizer(
                 [torch.zeros(1)], leader=srv.leader, tls="off")),
            (TypeError, "model must be a torch.nn.Module",
             lambda: self.wrap(srv, sgd(model), 0, model="net")),
            (TypeError, "density must be a real number",
             lambda: self.wrap(srv, sgd(model), 0, density="0.1")),
            (ValueError, r"must be \(name, parameter\) pairs",
             lambda: self.wrap(srv, sgd(model), 0,
                               named_parameters=list(model.parameters()))),
            (ValueError, "no parameter that requires a gradient",
             lambda: self.wrap(srv, torch.optim.SGD(
                 [torch.zeros(2, requires_grad=False)], lr=0.1), 0)),
        ]
        for exc, pattern, make in cases:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(exc, pattern):
                    make()
        opt = self.wrap(srv, sgd(model), 0, model=model)
        try:
            with self.assertRaisesRegex(TypeError, "already a gtopk"):
                self.wrap(srv, opt, 0)
            loss_of(model, 0, 0).backward()
            opt.step()
            good = opt.state_dict()
            bad = [
                (ValueError, "no 'gtopk' entry",
                 {k: v for k, v in good.items() if k != "gtopk"}),
                (gtopk.FailedPrecondition, "saved with the servers applying",
                 dict(good, gtopk=dict(good["gtopk"], apply="servers"))),
                (gtopk.FailedPrecondition, "has n=3 but this model has n=",
                 dict(good, gtopk=dict(good["gtopk"], n=3))),
                (gtopk.FailedPrecondition, "holds rank 1's gtopk state",
                 dict(good, gtopk=dict(good["gtopk"], rank=1))),
            ]
            for exc, pattern, sd in bad:
                with self.subTest(pattern=pattern):
                    with self.assertRaisesRegex(exc, pattern):
                        opt.load_state_dict(sd)
            self.assertEqual(opt.next_step, 1)  # nothing moved
        finally:
            opt.close()
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "optimizer is closed"):
            opt.step()

    def test_another_model_layout_on_a_rank_is_refused(self):
        P = 2
        srv = self.start(1, P)
        models = [make_model(bn=True), make_model(bn=True)]
        # Same parameters, another buffer layout on rank 1.
        models[1][1].register_buffer("extra", torch.zeros(3))

        def worker(w):
            return self.wrap(srv, torch.optim.SGD(models[w].parameters(),
                                                  lr=0.1), w,
                             model=models[w])

        results, errs = in_threads(P, worker)
        for r in results:
            if r is not None:
                r.close()
        self.assertIsNone(errs[0])
        self.assertIsInstance(errs[1], gtopk.FailedPrecondition)
        self.assertRegex(str(errs[1]), "rank 0's state .* do not match this "
                         "model's")

    def test_servers_apply_cluster_refuses_the_wrapper_and_back(self):
        srv = self.start(1, 1, apply="servers", lr=0.1)
        model = make_model()
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "--apply=workers"):
            self.wrap(srv, torch.optim.AdamW(model.parameters()), 0)
        srv2 = self.start(1, 1, name="w")
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "wrap your own optimizer"):
            gtopk.torch.DistributedOptimizer(model.parameters(), lr=0.1,
                                             leader=srv2.leader, tls="off")


class OutsideTestingTest(ClusterCase):
    """The break-it run of 2026-12-06: each input that let replicas differ
    silently, or failed with a confusing error."""

    def test_a_group_added_to_the_wrapped_optimizer_is_refused(self):
        srv = self.start(1, 1)
        model = make_model()
        extra = torch.nn.Parameter(torch.ones(2))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = self.wrap(srv, inner, 0, model=model)
        try:
            inner.add_param_group({"params": [extra]})
            loss_of(model, 0, 0).backward()
            with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                        "param groups changed"):
                opt.step()
            self.assertEqual(opt.next_step, 0)
        finally:
            opt.close()

    def test_frozen_parameters_are_guarded(self):
        # In place: the version counter, on this rank, before sending.
        srv = self.start(1, 1)
        model = make_model()
        model[2].weight.requires_grad_(False)
        opt = self.wrap(srv, torch.optim.AdamW(model.parameters()), 0,
                        model=model)
        try:
            with torch.no_grad():
                model[2].weight.add_(0.5)
            loss_of(model, 0, 0).backward()
            with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                        r"frozen parameter\(s\) 2.weight"):
                opt.step()
            opt.accept_parameter_changes()
            # Unfreezing after construction: refused, named.
            model[2].weight.requires_grad_(True)
            with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                        "2.weight was frozen"):
                opt.step()
        finally:
            opt.close()

    def test_a_parameter_frozen_mid_training_stops_moving(self):
        """Progressive freezing, as under DDP: once requires_grad is False
        the wrapped optimizer leaves the parameter alone (AdamW's decay
        included); the others keep training, replicas equal."""
        P = 2
        srv = self.start(1, P, density=1.0)
        models = [make_model() for _ in range(P)]

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.AdamW(model.parameters(),
                                                   lr=0.01), w, model=model)
            try:
                for step in range(4):
                    if step == 2:
                        model[0].weight.requires_grad_(False)
                        frozen = model[0].weight.detach().clone()
                        other = model[2].weight.detach().clone()
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    opt.step()
                self.assertTrue(torch.equal(model[0].weight.detach(), frozen))
                self.assertFalse(torch.equal(model[2].weight.detach(), other))
                return flat_of(model.parameters())
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        np.testing.assert_array_equal(results[0].view(np.uint32),
                                      results[1].view(np.uint32))

    def test_a_frozen_parameter_changed_through_data_on_one_rank(self):
        P = 2
        srv = self.start(1, P, checksum_every=1)
        models = [make_model() for _ in range(P)]
        for m in models:
            m[2].weight.requires_grad_(False)
        barrier = threading.Barrier(P)

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1),
                            w, model=model)
            try:
                loss_of(model, w, 0).backward()
                opt.step()
                barrier.wait()
                if w == 1:
                    model[2].weight.data[0, 0] += 1.0  # no version bump
                opt.zero_grad()
                loss_of(model, w, 1).backward()
                with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                            "parameters differ at step 1"):
                    opt.step()
            finally:
                opt.close()

        _, errs = in_threads(P, worker)
        raise_first(errs)

    def test_ranks_resumed_from_different_steps_cannot_continue(self):
        import time
        P = 2
        srv = self.start(1, P, step_timeout="3s")
        ckpt = os.path.join(self.dir, "c-%d-%d.pt")
        models = [make_model() for _ in range(P)]

        def first(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.Adam(model.parameters(),
                                                  lr=0.01), w, model=model)
            try:
                for step in range(5):
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    opt.step()
                    if step in (2, 4):
                        torch.save({"model": model.state_dict(),
                                    "opt": opt.state_dict()},
                                   ckpt % (w, step + 1))
            finally:
                opt.close()

        raise_first(in_threads(P, first)[1])
        # Rank 0 from step 5's checkpoint, rank 1 from step 3's.
        outcome = [None] * P

        def resumed(w):
            at = 5 if w == 0 else 3
            c = torch.load(ckpt % (w, at))
            model = make_model()
            model.load_state_dict(c["model"])
            opt = self.wrap(srv, torch.optim.Adam(model.parameters(),
                                                  lr=0.01), w, model=model,
                            recovery_timeout=10.0)
            try:
                opt.load_state_dict(c["opt"])
                deadline = time.monotonic() + 20
                for step in range(opt.next_step, 8):
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    step_with_retry(opt, deadline)
                outcome[w] = "finished"
            except gtopk.Error as e:
                outcome[w] = e
            finally:
                opt.close()

        in_threads(P, resumed)
        for w in range(P):
            self.assertNotEqual(outcome[w], "finished",
                                "rank %d trained on with a replica that "
                                "differs" % w)
        # Whichever resume comes last sets the shards' step; the other
        # rank's push is refused (ahead of, or behind, the shards: its
        # Recover then says it cannot catch up), or, when its round was
        # pending at the resume, it recovers, renumbers and fails the
        # divergence check with the other rank. Every order ends the run.
        messages = " | ".join(str(e) for e in outcome)
        self.assertRegex(messages, "parameters differ|step 5 is ahead of "
                         "shard 0, which is at step 3|step 3 was already "
                         "applied; shard 0 is at step 5|the shards are at "
                         "step 5 but this worker is at step 3")

    def test_one_rank_back_from_an_older_checkpoint_stops_the_run(self):
        """Rank 1 dies after step 5 and comes back from its step-3
        checkpoint while rank 0 waits in step 5: the resume rolls the
        shards back, rank 0 recovers (renumbered, with its later state),
        and the first step after it compares checksums: both ranks stop
        with FailedPrecondition instead of training on apart."""
        import time
        P = 2
        srv = self.start(1, P, step_timeout="5s")
        ckpt = os.path.join(self.dir, "older-%d.pt")
        models = [make_model() for _ in range(P)]
        outcome = [None] * P

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.Adam(model.parameters(),
                                                  lr=0.01), w, model=model,
                            recovery_timeout=10.0)
            deadline = time.monotonic() + 25
            try:
                step = 0
                while step < 9:
                    if w == 1 and step == 5:
                        opt.close()  # "crashes"; back from its checkpoint
                        c = torch.load(ckpt % w)
                        model = make_model()
                        model.load_state_dict(c["model"])
                        opt = self.wrap(srv, torch.optim.Adam(
                            model.parameters(), lr=0.01), w, model=model)
                        opt.load_state_dict(c["opt"])
                        step = opt.next_step
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    step_with_retry(opt, deadline)
                    step = opt.next_step - 1
                    if w == 1 and step == 2:
                        torch.save({"model": model.state_dict(),
                                    "opt": opt.state_dict()}, ckpt % w)
                    step = opt.next_step
                outcome[w] = "finished"
            except gtopk.Error as e:
                outcome[w] = e
            finally:
                opt.close()

        in_threads(P, worker)
        for w in range(P):
            self.assertIsInstance(outcome[w], gtopk.FailedPrecondition,
                                  "rank %d: %r" % (w, outcome[w]))
            self.assertRegex(str(outcome[w]), "parameters differ at step 3")

    def test_a_rank_back_from_a_checkpoint_of_this_step_continues(self):
        """Rank 1 saves after step 3 and comes back from that checkpoint at
        once, while rank 0 waits in step 4: it lost nothing, so its
        checksum (sent unasked after the resume) passes without rank 0's,
        and the run ends bit-identical to the reference."""
        import time
        P, steps = 2, 6
        srv = self.start(1, P)
        ckpt = os.path.join(self.dir, "same-step.pt")
        make_opt, _ = OPTIMIZERS["adam"]
        models = [make_model() for _ in range(P)]

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, make_opt(model), w, model=model,
                            recovery_timeout=20.0)
            try:
                step = 0
                while step < steps:
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    step_with_retry(opt, time.monotonic() + 30)
                    step = opt.next_step
                    if w == 1 and step == 4:
                        torch.save({"model": model.state_dict(),
                                    "opt": opt.state_dict()}, ckpt)
                        opt.close()
                        c = torch.load(ckpt)
                        model = make_model()
                        model.load_state_dict(c["model"])
                        opt = self.wrap(srv, make_opt(model), w,
                                        model=model, recovery_timeout=20.0)
                        opt.load_state_dict(c["opt"])
                        self.assertEqual(opt.next_step, 4)
                return flat_of(model.parameters())
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        want, _ = reference(P, steps, "adam")
        for w in range(P):
            np.testing.assert_array_equal(results[w].view(np.uint32),
                                          want.view(np.uint32))

    def test_closure_optimizers_and_misuse_are_refused_clearly(self):
        srv = self.start(1, 1)
        model = make_model()
        with self.assertRaisesRegex(TypeError, "LBFGS.step.. requires a "
                                    "closure"):
            self.wrap(srv, torch.optim.LBFGS(model.parameters()), 0)
        gen = model.named_parameters()
        list(gen)
        with self.assertRaisesRegex(ValueError, "used up"):
            self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                      named_parameters=gen)
        opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                        model=model)
        try:
            loss_of(model, 0, 0).backward()
            opt.synchronize()
            loss_of(model, 0, 0).backward()  # after the exchange
            with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                        "backward.. ran after this step.s exchange"):
                with opt.skip_synchronize():
                    opt.step()
        finally:
            opt.close()


class StartUpTest(ClusterCase):
    def test_a_first_download_that_times_out_is_retried_within_the_budget(self):
        """Rank 1 constructs first: its download of the initial parameters
        waits on the servers for rank 0 and times out (rpc_timeout 1 s:
        DeadlineExceeded, "shard 0 has no parameters yet"), as when a break-it
        run stopped the leader during start-up. It is retried within the
        recovery budget, as gtopk-worker retries it; rank 1 used to raise it
        from the constructor. Both ranks then hold rank 0's parameters."""
        import time
        srv = self.start(2, 2)
        models = [make_model(seed=7), make_model(seed=8)]
        opts = [None, None]

        def worker(w):
            if w == 0:
                time.sleep(3.0)  # rank 1's first download times out first
            opts[w] = self.wrap(
                srv, torch.optim.SGD(models[w].parameters(), lr=0.1), w,
                model=models[w], rpc_timeout=1.0, recovery_timeout=60.0)

        try:
            _, errs = in_threads(2, worker)
            raise_first(errs)
            want = flat_of(make_model(seed=7).parameters())
            for w in range(2):
                np.testing.assert_array_equal(
                    flat_of(models[w].parameters()).view(np.uint32),
                    want.view(np.uint32), err_msg="rank %d" % w)
        finally:
            for opt in opts:
                if opt is not None:
                    opt.close()


class TrainerTest(ClusterCase):
    def test_gtopk_worker_refuses_a_workers_apply_cluster(self):
        import subprocess
        worker = os.path.join(cu.BUILD_DIR, "worker", "gtopk-worker")
        if not os.path.exists(worker):
            self.skipTest("gtopk-worker not built (no libtorch): %s" % worker)
        srv = self.start(1, 1)
        r = subprocess.run(
            [worker, "--server=" + srv.leader, "--tls=off",
             "--model=synthetic:100", "--rpc-timeout-s=10"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("gtopk-worker trains with the servers' SGD only",
                      r.stdout)


class DivergenceTest(ClusterCase):
    def test_alarm_names_the_ranks_and_step(self):
        P = 2
        srv = self.start(1, P, checksum_every=2, step_timeout="10s")
        models = [make_model() for _ in range(P)]
        barrier = threading.Barrier(P)

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1),
                            w, model=model)
            try:
                for step in range(2):
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    opt.step()
                barrier.wait()
                if w == 1:
                    # Behind the optimizer's back (.data: no version bump).
                    model[0].weight.data[0, 0] += 1.0
                opt.zero_grad()
                loss_of(model, w, 2).backward()
                try:
                    opt.step()
                except gtopk.FailedPrecondition as e:
                    return str(e), opt.next_step
                return None, opt.next_step
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        for msg, step in results:
            self.assertIsNotNone(msg, "the alarm did not fire")
            self.assertRegex(msg, "step 2")
            self.assertRegex(msg, "rank 0")
            self.assertRegex(msg, "rank 1")
            self.assertEqual(step, 2)


class FailureTest(ClusterCase):
    def test_a_failed_step_retried_is_bit_identical(self):
        """Rank 1 arrives late at step 2, past the step timeout: the step
        fails for rank 0 (and rank 1's late push is refused), both recover
        and retry with the documented loop, and the run ends bit-identical
        to the reference without any failure: nothing was applied by the
        failed attempt and the retry resent the same gradient."""
        import time
        P, steps = 2, 5
        srv = self.start(2, P, step_timeout="2s")
        models = [make_model() for _ in range(P)]
        make_opt, _ = OPTIMIZERS["adam"]
        failures = [0] * P

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, make_opt(model), w, model=model,
                            recovery_timeout=20.0)
            try:
                for step in range(steps):
                    opt.zero_grad()
                    loss_of(model, w, step).backward()
                    if w == 1 and step == 2:
                        time.sleep(3.0)
                    step_with_retry(opt, time.monotonic() + 30, failures, w)
                return flat_of(model.parameters())
            finally:
                opt.close()

        results, errs = in_threads(P, worker)
        raise_first(errs)
        self.assertGreater(sum(failures), 0, "no step failed")
        want, _ = reference(P, steps, "adam")
        for w in range(P):
            np.testing.assert_array_equal(results[w].view(np.uint32),
                                          want.view(np.uint32))


class ResumeTest(ClusterCase):
    def test_resume_from_checkpoints_is_bit_identical(self):
        P, steps, cut = 2, 6, 3
        ckpt = os.path.join(self.dir, "ckpt-%d.pt")

        def make(w, srv, load=False):
            model = make_model()
            if load:
                model.load_state_dict(torch.load(ckpt % w)["model"])
            inner = torch.optim.AdamW(groups_of(model), lr=0.002)
            opt = self.wrap(srv, inner, w, model=model)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
            if load:
                c = torch.load(ckpt % w)
                opt.load_state_dict(c["opt"])
                sched.load_state_dict(c["sched"])
            return model, opt, sched

        def train(model, opt, sched, w, begin, end):
            for step in range(begin, end):
                opt.zero_grad()
                loss_of(model, w, step).backward()
                opt.step()
                sched.step()

        srv = self.start(1, P, name="a")

        def uninterrupted(w):
            model, opt, sched = make(w, srv)
            try:
                train(model, opt, sched, w, 0, cut)
                torch.save({"model": model.state_dict(),
                            "opt": opt.state_dict(),
                            "sched": sched.state_dict()}, ckpt % w)
                train(model, opt, sched, w, cut, steps)
                return flat_of(model.parameters())
            finally:
                opt.close()

        full, errs = in_threads(P, uninterrupted)
        raise_first(errs)

        # The same servers (now at step 6) and fresh ones (at step 0).
        for name, srv2 in (("same servers", srv),
                           ("new servers", self.start(1, P, name="b"))):
            def resumed(w):
                model, opt, sched = make(w, srv2, load=True)
                try:
                    self.assertEqual(opt.next_step, cut)
                    train(model, opt, sched, w, cut, steps)
                    return flat_of(model.parameters())
                finally:
                    opt.close()

            got, errs = in_threads(P, resumed)
            raise_first(errs)
            for w in range(P):
                np.testing.assert_array_equal(
                    got[w].view(np.uint32), full[w].view(np.uint32),
                    err_msg="%s, rank %d" % (name, w))

    def test_a_rank_without_its_checkpoint_is_told_what_to_load(self):
        srv = self.start(1, 1)
        model = make_model()
        opt = self.wrap(srv, torch.optim.SGD(model.parameters(), lr=0.1), 0)
        loss_of(model, 0, 0).backward()
        opt.step()
        opt.close()
        model2 = make_model()
        opt2 = self.wrap(srv, torch.optim.SGD(model2.parameters(), lr=0.1),
                         0)
        try:
            loss_of(model2, 0, 1).backward()
            with self.assertRaisesRegex(
                    gtopk.FailedPrecondition,
                    "cluster is at step 1 .*Load this rank's checkpoint"):
                opt2.step()
        finally:
            opt2.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
