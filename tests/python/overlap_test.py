"""Overlapped steps from PyTorch (gtopk-server --selection=layerwise
--apply=workers): gtopk.torch.DistributedOptimizer reports each parameter's
gradient from its autograd hook, and each bucket is selected and pushed
while backward goes on.

* Replicas are bit-identical to a plain NumPy layer-wise gTop-k written here
  (the vector cut into --bucket-mb buckets and again at the shard
  boundary; per piece: u = residual + g, local top round(k n_p / n), the
  rank-order sum, its top, put-back, sum / P) feeding AdamW with two param
  groups and a cosine schedule, P = 2, S = 2, a bucket that straddles the
  shard boundary; overlap=False (the whole exchange after backward) gives
  the same bits.
* Ctrl-C during backward (a KeyboardInterrupt raised inside the backward
  pass, after the later layers' buckets were reported and pushed): the
  rank repeats the step, the other rank's step fails and is retried after
  recover(), and the run ends bit-identical to one without the interrupt.
* Parameters on the GPU: the gradient is staged through host memory piece
  by piece (_stage_on_host). The same path is run here on the CPU, with
  and without Ctrl-C, bit-identical to the reference; on a CUDA build of
  torch with a GPU, overlap=None and overlap=False give the same bits
  (skipped, naming why, elsewhere: Debian's torch has no CUDA).
* overlap=True where it cannot be (servers without layerwise selection) is
  refused naming why.

Run: PYTHONPATH=build/python GTOPK_BUILD_DIR=build /usr/bin/python3
tests/python/overlap_test.py
"""

import _thread
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gtopk  # noqa: E402
import gtopk.torch  # noqa: E402
import workers_apply_test as wat  # noqa: E402  (helpers only)

F32 = np.float32
DENSITY = 0.1
BUCKET = 40  # values per bucket
BUCKET_MB = BUCKET * 4.0 / (1 << 20)
FLAGS = {"selection": "layerwise", "bucket_mb": repr(BUCKET_MB)}
STEPS = 5


class Interrupt(torch.autograd.Function):
    """Identity whose backward raises KeyboardInterrupt once, when armed:
    Ctrl-C arriving in the middle of the backward pass."""
    armed = {}

    @staticmethod
    def forward(ctx, x, rank):
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Interrupt.armed.pop(ctx.rank, False):
            # Time for the selection thread to push the later layers'
            # buckets: the interrupt then strikes a step under way.
            time.sleep(0.3)
            raise KeyboardInterrupt()
        return g, None


class Net(torch.nn.Module):
    """Three layers, 273 parameters; flat in the optimizer's group order:
    the weights l1 [0, 120), l2 [120, 220), l3 [220, 250), then the biases
    [250, 273). With two shards ([0, 136), [136, 273)) and buckets of 40,
    the bucket [120, 160) straddles the boundary."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(7)
        self.rank = rank
        self.l1 = torch.nn.Linear(12, 10)
        self.l2 = torch.nn.Linear(10, 10)
        self.l3 = torch.nn.Linear(10, 3)

    def forward(self, x):
        h = Interrupt.apply(self.l1(x), self.rank)
        return self.l3(torch.relu(self.l2(torch.relu(h))))


def loss_of(model, rank, step, device="cpu"):
    x, y = wat.batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x.to(device)),
                                             y.to(device))


def flat_cpu(tensors):
    return wat.flat_of(t.detach().cpu() for t in tensors)


def make_opt(model, groups=True):
    """AdamW with two groups (weights with decay, biases without) or one
    (the flat order is then the model's: l1, l2, l3)."""
    return torch.optim.AdamW(
        wat.groups_of(model) if groups else model.parameters(), lr=0.002)


def make_sched(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)


def pieces_of(n, shard_begins):
    cuts = sorted(set(list(range(0, n, BUCKET)) + list(shard_begins)))
    return [(b, cuts[i + 1] if i + 1 < len(cuts) else n)
            for i, b in enumerate(cuts)]


def reference(P, S, steps, groups=True, clip=None):
    """Final flat parameters of P replicas trained with plain layer-wise
    gTop-k and AdamW (every replica is the same model: one is kept);
    `clip`: the average's norm clipped to it before each step."""
    model = Net(rank=-1)
    opt = make_opt(model, groups)
    sched = make_sched(opt)
    # The wrapper's flat order: the optimizer's groups in order (weights,
    # then biases), which is what the buckets cut.
    params = [p for g in opt.param_groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    k = max(1, int(round(DENSITY * n)))
    pieces = pieces_of(n, [s * n // S for s in range(S)])
    residual = [np.zeros(n, F32) for _ in range(P)]
    for step in range(steps):
        us = []
        for w in range(P):
            model.zero_grad()
            loss_of(model, w, step).backward()
            g = wat.flat_of([p.grad for p in params]).astype(F32)
            us.append((residual[w] + g).astype(F32))
        avg = np.zeros(n, F32)
        new_residual = [u.copy() for u in us]
        for b, e in pieces:
            kp = (2 * k * (e - b) + n) // (2 * n)  # round, halves up
            if kp == 0:
                continue
            sent = [b + wat.topk_indices(u[b:e], kp) for u in us]
            total = np.zeros(n, F32)
            union = np.zeros(n, bool)
            for w in range(P):  # rank order, as the shards add
                total[sent[w]] += us[w][sent[w]]
                union[sent[w]] = True
            cand = np.nonzero(union)[0]
            keep = cand[wat.topk_indices(total[cand], min(kp, cand.size))]
            selected = np.zeros(n, bool)
            selected[keep] = True
            for w in range(P):
                new_residual[w][sent[w][selected[sent[w]]]] = 0.0
            avg[keep] = total[keep] / F32(P)
        residual = new_residual
        off = 0
        for p in params:
            cnt = p.numel()
            p.grad = torch.from_numpy(avg[off:off + cnt].copy()).view(p.shape)
            off += cnt
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
    return wat.flat_of(params)


class OverlapTest(wat.ClusterCase):
    def train(self, srv, P, interrupt_at=None, groups=True, staged=False,
              device="cpu", clip=None, late=None, interrupt_wait=None,
              **kw):
        """Trains P ranks in threads with the documented recovery loop;
        rank 0's backward is interrupted once at step `interrupt_at`;
        `staged`: through host memory as for GPU parameters (asserting
        that every piece was staged). Returns, per rank: its flat
        parameters, the stats of its last step, its interrupted backward
        passes and its failed attempts (retried in step() after recover(),
        or recovered inside backward)."""
        models = [Net(rank=w).to(device) for w in range(P)]

        def worker(w):
            model = models[w]
            opt = self.wrap(srv, make_opt(model, groups), w,
                            named_parameters=model.named_parameters(),
                            model=model, **kw)
            # Every shard said at Connect that it takes pushes in parts.
            self.assertTrue(opt._client.servers_take_push_parts)
            self.assertEqual(opt._staged, device != "cpu" and opt._overlap)
            staged_pieces = set()
            if staged and not opt._staged:
                opt._stage_on_host()
            if opt._staged:
                stage = opt._stage_piece

                def counted(q):
                    staged_pieces.add(q)
                    stage(q)
                opt._stage_piece = counted
            sched = make_sched(opt)
            deadline = time.monotonic() + 60
            interrupted = failed = 0
            try:
                for step in range(STEPS):
                    if w == 0 and step == interrupt_at:
                        Interrupt.armed[0] = True
                    if late is not None and w == P - 1 and step == late[0]:
                        time.sleep(late[1])  # this rank starts the step late
                    if interrupt_wait is not None and w == 0 and \
                            step == interrupt_wait[0]:
                        # Ctrl-C in rank 0's end-of-backward wait (it runs
                        # in the main thread, where signals reach the wait).
                        threading.Timer(interrupt_wait[1],
                                        _thread.interrupt_main).start()
                    while True:
                        try:
                            opt.zero_grad()
                            loss_of(model, w, step, device).backward()
                            break
                        except KeyboardInterrupt:
                            interrupted += 1  # repeat the backward pass
                        except gtopk.RETRYABLE:
                            # The recovery budget ran out inside backward:
                            # recover, then repeat the pass (its end runs
                            # the retry).
                            failed += 1
                            if time.monotonic() > deadline:
                                raise
                            opt.recover()
                    if clip is not None:  # the average, after backward
                        torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       clip)
                    while True:  # the documented recovery loop
                        try:
                            opt.step()
                            break
                        except gtopk.RETRYABLE:
                            failed += 1
                            if time.monotonic() > deadline:
                                raise
                            opt.recover()
                    # A failed overlapped round is recovered and retried
                    # inside backward (counted there).
                    failed += opt.stats["recovered_in_backward"]
                    sched.step()
                if opt._staged and opt._overlap:
                    self.assertEqual(staged_pieces,
                                     set(range(len(opt._pieces))))
                return (flat_cpu(p for g in opt.param_groups
                                 for p in g["params"]),
                        dict(opt.stats), interrupted, failed)
            finally:
                opt.close()

        results, errs = wat.in_threads(
            P, worker, in_main=None if interrupt_wait is None else 0)
        wat.raise_first(errs)
        return results

    def assert_every_rank_is(self, results, want):
        for w, (got, _, _, _) in enumerate(results):
            np.testing.assert_array_equal(
                got.view(np.uint32), want.view(np.uint32),
                err_msg="rank %d" % w)

    def test_bit_identical_to_layerwise_reference_and_to_whole(self):
        srv = self.start(2, 2, **FLAGS)
        want = reference(2, 2, STEPS)
        for overlap in (None, False):
            results = self.train(srv, 2, overlap=overlap)
            for w, (got, stats, _, _) in enumerate(results):
                np.testing.assert_array_equal(
                    got.view(np.uint32), want.view(np.uint32),
                    err_msg="overlap=%s rank %d" % (overlap, w))
                if overlap is None:
                    # The overlapped path ran: its wait is measured, and
                    # its pieces went as parts (the servers take them).
                    self.assertGreater(stats["exposed_seconds"], 0.0)
                    self.assertGreater(stats["parts_sent"], 0)
                else:
                    self.assertEqual(stats["exposed_seconds"], 0.0)
                    self.assertEqual(stats["parts_sent"], 0)
            srv.stop()
            srv = self.start(2, 2, name="srv-whole", **FLAGS)

    def test_ctrl_c_during_backward_then_the_run_is_bit_identical(self):
        # One group: the flat order is l1, l2, l3, so shard 1's range
        # [136, 273) (within l2 and l3) is complete, and its push sent,
        # before the interrupt strikes in l1's backward.
        srv = self.start(2, 2, **FLAGS)
        results = self.train(srv, 2, interrupt_at=2, groups=False)
        want = reference(2, 2, STEPS, groups=False)
        self.assertEqual(results[0][2], 1, "rank 0 was not interrupted")
        # Rank 1's step failed (rank 0's abandoned attempt was failed on
        # every shard) and was retried after recover(), inside its
        # backward pass.
        self.assertGreaterEqual(results[1][3], 1, "rank 1 never failed")
        self.assert_every_rank_is(results, want)

    def test_a_rank_failing_in_backward_retries_there_so_clipping_agrees(
            self):
        """Rank 0's Ctrl-C fails rank 1's overlapped exchange at the end
        of its backward pass; rank 0's repeated pass then completes the
        step inside backward. Both ranks clip .grad between backward() and
        step(), which must be the average on both: rank 1 recovers and
        retries inside its backward pass (a retry left to step() would
        come after the clip, and that rank would step on the unclipped
        average: a break-it run's resumed script ended with two different
        replicas)."""
        srv = self.start(2, 2, **FLAGS)
        results = self.train(srv, 2, interrupt_at=2, groups=False, clip=0.05)
        want = reference(2, 2, STEPS, groups=False, clip=0.05)
        self.assertEqual(results[0][2], 1, "rank 0 was not interrupted")
        self.assertGreaterEqual(results[1][3], 1, "rank 1 never failed")
        self.assert_every_rank_is(results, want)

    def test_a_rank_late_beyond_the_budget_fails_backward_then_agrees(self):
        """The last rank starts step 2 six seconds late; rank 0's round
        fails at the 1 s step timeout and its recovery budget (1 s) runs
        out inside backward, which then raises gtopk.RETRYABLE instead of
        leaving the retry to step(), after the clip (a break-it run: the
        replicas differed, silently). The script recovers and repeats the
        backward pass, whose end runs the retry (a zero gradient: the
        failed attempt's is in the residual): every rank clips the same
        average, bit-identical to the reference."""
        srv = self.start(2, 2, step_timeout="1s", **FLAGS)
        results = self.train(srv, 2, groups=False, clip=0.05,
                             late=(2, 6.0), recovery_timeout=1.0)
        want = reference(2, 2, STEPS, groups=False, clip=0.05)
        self.assertGreaterEqual(results[0][3], 1, "rank 0 never failed")
        self.assert_every_rank_is(results, want)

    def test_ctrl_c_in_the_end_of_backward_wait_then_the_pass_retries(self):
        """The last rank starts step 2 1.5 s late; Ctrl-C reaches rank 0 0.7
        s into its end-of-backward wait: KeyboardInterrupt out of
        backward(), and the script repeats the pass, whose end runs the
        retry, so both ranks clip the same average (a break-it run with
        SIGINT: the retry ran in step(), after the clip, and the replicas
        differed)."""
        srv = self.start(2, 2, **FLAGS)
        results = self.train(srv, 2, groups=False, clip=0.05,
                             late=(2, 1.5), interrupt_wait=(2, 0.7))
        want = reference(2, 2, STEPS, groups=False, clip=0.05)
        self.assertEqual(results[0][2], 1, "rank 0 was not interrupted")
        self.assert_every_rank_is(results, want)

    def test_staged_through_host_memory_bit_identical(self):
        """The GPU parameters' path (each piece copied to a host buffer when
        its last parameter is ready, the average copied back), run on the
        CPU: bit-identical to the reference, also when rank 0's backward
        is interrupted (the open step given up, a new one staged)."""
        for groups, interrupt_at in ((True, None), (False, 2)):
            srv = self.start(2, 2, name="srv-%s" % groups, **FLAGS)
            want = reference(2, 2, STEPS, groups=groups)
            results = self.train(srv, 2, interrupt_at=interrupt_at,
                                 groups=groups, staged=True)
            for w, (got, stats, interrupted, _) in enumerate(results):
                np.testing.assert_array_equal(
                    got.view(np.uint32), want.view(np.uint32),
                    err_msg="groups=%s rank %d" % (groups, w))
                self.assertGreater(stats["parts_sent"], 0)
            if interrupt_at is not None:
                self.assertEqual(results[0][2], 1, "not interrupted")
            srv.stop()

    def test_a_parameter_with_no_values_is_no_obstacle(self):
        """A zero-element parameter used in forward (its .grad has no data,
        so no address to compare): overlapped steps, staged or not, go on
        overlapping (pieces sent as parts) and end bit-identical to
        overlap=False (a break-it run found every staged step refused as
        ".grad ... replaced", and unstaged overlap silently off)."""

        class Empty(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(3)
                self.l1 = torch.nn.Linear(12, 10)
                self.empty = torch.nn.Parameter(torch.zeros(0))
                self.l2 = torch.nn.Linear(10, 3)

            def forward(self, x):
                return self.l2(torch.relu(self.l1(x)) + self.empty.sum())

        got = {}
        for mode in ("whole", "overlap", "staged"):
            srv = self.start(1, 1, name="srv-%s" % mode, **FLAGS)
            model = Empty()
            opt = self.wrap(srv, torch.optim.AdamW(model.parameters(),
                                                   lr=0.01), 0, model=model,
                            overlap=False if mode == "whole" else None)
            try:
                if mode == "staged":
                    opt._stage_on_host()
                parts = 0
                for step in range(STEPS):
                    opt.zero_grad()
                    loss_of(model, 0, step).backward()
                    opt.step()
                    parts += opt.stats["parts_sent"]
                self.assertEqual(parts > 0, mode != "whole", mode)
                got[mode] = flat_cpu(model.parameters())
            finally:
                opt.close()
            srv.stop()
        for mode in ("overlap", "staged"):
            np.testing.assert_array_equal(got[mode].view(np.uint32),
                                          got["whole"].view(np.uint32),
                                          err_msg=mode)

    def test_on_the_gpu_overlap_gives_the_bits_of_the_whole_exchange(self):
        if not torch.cuda.is_available():
            self.skipTest("needs torch with CUDA and a GPU (torch %s: "
                          "CUDA %s)" % (torch.__version__,
                                        torch.version.cuda or "not built"))
        results = {}
        for overlap in (None, False):
            srv = self.start(2, 2, name="srv-gpu-%s" % overlap, **FLAGS)
            results[overlap] = self.train(srv, 2, device="cuda",
                                          overlap=overlap)
            srv.stop()
        for w in range(2):
            np.testing.assert_array_equal(
                results[None][w][0].view(np.uint32),
                results[False][w][0].view(np.uint32), err_msg="rank %d" % w)
            self.assertGreater(results[None][w][1]["parts_sent"], 0)
            self.assertEqual(results[False][w][1]["parts_sent"], 0)

    def test_after_backward_grad_is_the_average_as_under_ddp(self):
        """An overlapped step ends with backward(): .grad is then the
        aggregated gradient, as under DDP, so clipping it between
        backward() and step() gives exactly what the whole exchange gives
        with synchronize(), clip, step() (overlap=False); a .grad replaced
        then is stepped on as the user set it, on every rank alike."""
        results = {}
        for overlap in (None, False):
            srv = self.start(2, 2, name="srv-%s" % overlap, **FLAGS)
            models = [Net(rank=w) for w in range(2)]

            def worker(w):
                model = models[w]
                opt = self.wrap(srv, make_opt(model), w, model=model,
                                named_parameters=model.named_parameters(),
                                overlap=overlap)
                try:
                    for step in range(4):
                        opt.zero_grad()
                        loss_of(model, w, step).backward()
                        if overlap is False:
                            opt.synchronize()
                        torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       0.05)
                        model.l3.bias.grad = model.l3.bias.grad * 0.5
                        with opt.skip_synchronize():
                            opt.step()
                    return wat.flat_of(model.parameters())
                finally:
                    opt.close()

            got, errs = wat.in_threads(2, worker)
            wat.raise_first(errs)
            results[overlap] = got
            srv.stop()
        for w in range(2):
            np.testing.assert_array_equal(
                results[None][w].view(np.uint32),
                results[False][w].view(np.uint32), err_msg="rank %d" % w)
        np.testing.assert_array_equal(results[None][0].view(np.uint32),
                                      results[None][1].view(np.uint32))

    def test_zero_grad_discards_an_exchange_and_restarts_the_count(self):
        """backward(); zero_grad(); backward(); step() works in both modes
        (the first pass no longer counts; under overlap its exchange, done
        at the end of backward, is discarded and the second makes a new
        one), and a checkpoint between the exchange and step() is refused
        with what to do."""
        for overlap in (None, False):
            srv = self.start(1, 1, name="srv-%s" % overlap, **FLAGS)
            model = Net(rank=0)
            opt = self.wrap(srv, make_opt(model), 0, model=model,
                            overlap=overlap)
            try:
                loss_of(model, 0, 0).backward()
                opt.zero_grad()
                loss_of(model, 0, 0).backward()
                opt.synchronize()
                with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                            "save the checkpoint after"):
                    opt.state_dict()
                opt.step()
                self.assertEqual(opt.next_step, 2 if overlap is None else 1)
                opt.state_dict()  # after step(): fine
            finally:
                opt.close()
            srv.stop()

    def test_two_backward_passes_before_step_name_the_remedy(self):
        """Gradient accumulation without backward_passes_per_step under
        overlap: the first pass's end exchanged, so step() refuses, naming
        that exchange and backward_passes_per_step (a break-it run found it
        naming only synchronize(), which the script never called)."""
        srv = self.start(1, 1, **FLAGS)
        model = Net(rank=0)
        opt = self.wrap(srv, make_opt(model), 0, model=model)
        try:
            loss_of(model, 0, 0).backward()
            loss_of(model, 0, 0).backward()
            with self.assertRaisesRegex(
                    gtopk.FailedPrecondition,
                    "end of an overlapped backward pass.*"
                    "backward_passes_per_step"):
                opt.step()
        finally:
            opt.close()

    def test_overlap_true_without_layerwise_servers_is_refused(self):
        srv = self.start(1, 1)
        model = Net(rank=0)
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "selection=layerwise"):
            self.wrap(srv, make_opt(model), 0, model=model, overlap=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
