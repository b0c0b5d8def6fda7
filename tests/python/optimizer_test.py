"""gtopk.torch.DistributedOptimizer against real gtopk-server shards.

* The flat buffer: parameters are views of it after construction, keep
  their values from rank 0, gradients become views after the first step
  (backward accumulates in place), a parameter without .grad counts as a
  zero gradient, zero_grad(set_to_none=True) works.
* The optimizer adds nothing to the step: P workers (threads of this
  process; the binding releases the GIL) end bit-identical to raw
  gtopk.Client instances fed the same gradients, and to the servers.
* state_dict() / load_state_dict() around a server restart from its
  checkpoint resumes bit-identically (DGC and global momentum).
* lr schedules as documented: a scheduler that leaves the lr alone works, one
  that changes it is refused with FailedPrecondition before anything is
  sent; so is a changed momentum.
* Errors from real conditions: no leader (ValueError), wrong n, settings and
  world size that differ from the cluster (FailedPrecondition), a dead shard
  (RETRYABLE), a checkpoint of another step or rank; the documented
  recovery loop after a missing peer ends with identical replicas.

Run: PYTHONPATH=build/python GTOPK_BUILD_DIR=build /usr/bin/python3
tests/python/optimizer_test.py
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cluster_util as cu  # noqa: E402
import gtopk  # noqa: E402
import gtopk.torch  # noqa: E402

RPC_TIMEOUT = 30.0
THREAD_TIMEOUT = 120.0
FLAGS = {"mode": "gtopk", "density": 0.05, "lr": 0.1, "momentum": 0.9}


def make_model(seed=7, extra=True):
    """A small model; `extra`: a parameter the forward never uses (its
    .grad stays None). Seeds torch's global generator: call it from the
    main thread only (worker threads get their models made before)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(),
                                torch.nn.Linear(10, 3))
    unused = torch.nn.Parameter(torch.full((4,), 0.5)) if extra else None
    return model, unused


def params_of(model, unused):
    return list(model.parameters()) + ([unused] if unused is not None else [])


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(6, 12, generator=g),
            torch.randint(0, 3, (6,), generator=g))


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def in_threads(count, fn):
    """fn(i) in `count` threads; returns the results, re-raises the first
    exception."""
    results, errors = [None] * count, [None] * count

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: B902 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True)
               for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_TIMEOUT)
        if t.is_alive():
            raise AssertionError("a worker thread did not finish in %.0f s"
                                 % THREAD_TIMEOUT)
    for e in errors:
        if e is not None:
            raise e
    return results


class ClusterCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk-optimizer-test-")
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

    def optimizer(self, srv, params, **kw):
        kw.setdefault("rpc_timeout", RPC_TIMEOUT)
        return gtopk.torch.DistributedOptimizer(params, leader=srv.leader,
                                                tls="off", **kw)

    def server_checksum(self, opt):
        scratch = opt.flat_parameters().detach().clone()
        opt.client.synchronize_parameters(scratch.numpy())
        return gtopk.checksum(scratch.numpy())


class FlatBufferTest(ClusterCase):
    def test_views_grads_and_missing_grads(self):
        srv = self.start(1, 1)
        model, unused = make_model()
        before = [p.detach().clone() for p in params_of(model, unused)]
        opt = self.optimizer(srv, params_of(model, unused), rank=0)
        self.addCleanup(opt.close)
        flat = opt.flat_parameters()
        self.assertEqual(opt.n, sum(p.numel() for p in before))
        self.assertEqual(flat.numel(), opt.n)
        offset = 0
        for p, b in zip(params_of(model, unused), before):
            self.assertEqual(p.data_ptr(), flat.data_ptr() + 4 * offset)
            self.assertTrue(torch.equal(p.detach(), b))  # rank 0's values
            offset += p.numel()
        # First step: .grad copied in, then a view; `unused` stays None.
        loss_of(model, 0, 0).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]
                             + [torch.zeros(4)])
        opt.step()
        self.assertTrue(torch.equal(opt._flat_grad, expected))
        self.assertIsNone(unused.grad)
        self.assertTrue(torch.equal(unused.detach(), torch.full((4,), 0.5)),
                        "a parameter without gradient moved (no weight "
                        "decay, nothing sent)")
        grad_ptr = opt._flat_grad.data_ptr()
        w = model[0].weight
        self.assertEqual(w.grad.data_ptr(), grad_ptr)
        # zero_grad() + backward accumulate in place in the flat buffer.
        opt.zero_grad()
        loss_of(model, 0, 1).backward()
        self.assertEqual(w.grad.data_ptr(), grad_ptr)
        in_place = opt._flat_grad.clone()
        opt.step()
        self.assertTrue(torch.equal(opt._flat_grad, in_place))
        # set_to_none: fresh tensors, copied at the step.
        opt.zero_grad(set_to_none=True)
        loss_of(model, 0, 2).backward()
        self.assertNotEqual(w.grad.data_ptr(), grad_ptr)
        opt.step()
        self.assertEqual(w.grad.data_ptr(), grad_ptr)
        self.assertEqual(opt.next_step, 3)
        self.assertEqual(opt.stats["step"], 2)
        self.assertEqual(len(opt.stats["bytes_sent"]), 1)
        self.assertEqual(gtopk.checksum(flat.detach().numpy()),
                         self.server_checksum(opt))
        with self.assertRaises(ValueError):
            opt.add_param_group({"params": [torch.nn.Parameter(
                torch.ones(1))]})

    def test_bad_parameters_before_joining(self):
        with self.assertRaisesRegex(TypeError, "float32"):
            gtopk.torch.DistributedOptimizer(
                [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))],
                leader="127.0.0.1:1", tls="off")
        env = {k: os.environ.pop(k) for k in ("GTOPK_LEADER", "GTOPK_SERVER")
               if k in os.environ}
        self.addCleanup(os.environ.update, env)
        with self.assertRaisesRegex(ValueError, "GTOPK_LEADER"):
            gtopk.torch.DistributedOptimizer(make_model()[0].parameters())


    def test_tls_required_and_read_from_the_environment(self):
        keys = ("GTOPK_TLS", "GTOPK_TLS_CERT", "GTOPK_TLS_KEY",
                "GTOPK_TLS_CA", "GTOPK_TOKEN_FILE")
        saved = {k: os.environ.pop(k) for k in keys if k in os.environ}

        def restore():
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update(saved)
        self.addCleanup(restore)
        params = make_model()[0].parameters
        # Plaintext only when said: neither tls= nor GTOPK_TLS is an error
        # before anything is dialled.
        with self.assertRaisesRegex(ValueError, "tls is required"):
            gtopk.torch.DistributedOptimizer(params(), leader="127.0.0.1:1")
        with self.assertRaisesRegex(ValueError, "'plain'"):
            gtopk.torch.DistributedOptimizer(params(), leader="127.0.0.1:1",
                                             tls="plain")
        with self.assertRaisesRegex(TypeError, "tls_ca"):
            gtopk.torch.DistributedOptimizer(params(), leader="127.0.0.1:1",
                                             tls="mutual", tls_ca=3)
        # The environment is read: its files are checked (a missing file
        # named in the error), still before dialling.
        os.environ.update(GTOPK_TLS="mutual",
                          GTOPK_TLS_CERT="/nonexistent/worker.crt",
                          GTOPK_TLS_KEY="/nonexistent/worker.key",
                          GTOPK_TLS_CA="/nonexistent/ca.crt")
        with self.assertRaises(gtopk.InvalidArgument) as cm:
            gtopk.torch.DistributedOptimizer(params(), leader="127.0.0.1:1")
        self.assertIn("/nonexistent/", cm.exception.message)


class EmptyParameterTest(ClusterCase):
    def test_an_empty_parameter_is_carried_along(self):
        """A zero-element parameter has no storage to view (data_ptr 0):
        it is carried along instead of being refused as "no longer a
        view"."""
        srv = self.start(1, 1)
        model, unused = make_model()
        empty = torch.nn.Parameter(torch.zeros(0))
        opt = self.optimizer(srv, params_of(model, unused) + [empty], rank=0)
        self.addCleanup(opt.close)
        for step in range(2):
            opt.zero_grad()
            (loss_of(model, 0, step) + empty.sum()).backward()
            opt.step()
        self.assertEqual(empty.numel(), 0)


class StepTest(ClusterCase):
    def run_optimizers(self, srv, P, steps, momentum_mode_check=None):
        models = [make_model() for _ in range(P)]

        def worker(r):
            model, unused = models[r]
            opt = self.optimizer(srv, params_of(model, unused), rank=r,
                                 momentum_mode=momentum_mode_check)
            grads = []
            try:
                for t in range(steps):
                    opt.zero_grad()
                    loss_of(model, r, t).backward()
                    grads.append(torch.cat(
                        [p.grad.reshape(-1).clone()
                         for p in model.parameters()] + [torch.zeros(4)]))
                    opt.step()
                return (gtopk.checksum(opt.flat_parameters().numpy()),
                        self.server_checksum(opt), grads)
            finally:
                opt.close()
        return in_threads(P, worker)

    def test_optimizer_equals_the_client_and_the_servers(self):
        P, S, steps = 2, 2, 6
        got = self.run_optimizers(self.start(S, P, name="opt"), P, steps,
                                  momentum_mode_check="dgc")
        checksums = {c for c, s, _ in got} | {s for c, s, _ in got}
        self.assertEqual(len(checksums), 1, got)
        # The raw client with the same initial values and gradients.
        srv = self.start(S, P, name="raw")
        model, unused = make_model()
        init = torch.cat([p.detach().reshape(-1)
                          for p in params_of(model, unused)]).numpy()

        def raw(r):
            c = gtopk.Client(srv.leader, init.size, r,
                             rpc_timeout=RPC_TIMEOUT, tls="off")
            try:
                params = init.copy()
                c.synchronize_parameters(params)
                for g in got[r][2]:
                    c.step(g.numpy(), params)
                return gtopk.checksum(params)
            finally:
                c.close()
        self.assertEqual(set(in_threads(P, raw)), checksums)


class NewUserInputTest(ClusterCase):
    """What a tester found by using the package as a new user would: each
    used to be silently ignored or to fail with an unclear message."""

    def test_group_options_the_servers_do_not_apply_are_refused(self):
        srv = self.start(1, 1)  # --weight-decay 0
        cases = [({"weight_decay": 0.1}, "weight_decay'] is 0.1"),
                 ({"nesterov": True}, "'nesterov'] is True"),
                 ({"dampening": 0.5}, "'dampening'] is 0.5")]
        for extra, message in cases:
            with self.subTest(extra=extra):
                model, _ = make_model(extra=False)
                groups = [dict({"params": model[0].parameters()}, **extra),
                          {"params": model[2].parameters()}]
                with self.assertRaises(gtopk.FailedPrecondition) as cm:
                    self.optimizer(srv, groups, rank=0)
                self.assertIn(message, cm.exception.message)

    def test_a_parameter_replaced_after_construction_is_refused(self):
        srv = self.start(1, 1)
        model, _ = make_model(extra=False)
        opt = self.optimizer(srv, model.parameters(), rank=0)
        self.addCleanup(opt.close)
        loss_of(model, 0, 0).backward()
        opt.step()
        model.double()
        model.float()  # new tensors: no longer views of the flat buffer
        opt.zero_grad()
        loss_of(model, 0, 1).backward()
        with self.assertRaises(gtopk.FailedPrecondition) as cm:
            opt.step()
        self.assertIn("no longer a view", cm.exception.message)
        self.assertEqual(opt.next_step, 1)  # nothing was sent

    def test_properties_after_close_and_argument_types(self):
        srv = self.start(1, 1)
        model, _ = make_model(extra=False)
        # A NumPy float is a number (it was refused as "not a number").
        opt = self.optimizer(srv, model.parameters(), rank=0,
                             lr=np.float32(0.1))
        opt.close()
        for name in ("rank", "world_size", "num_shards", "next_step",
                     "metrics_port"):
            with self.subTest(name=name):
                with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                            "closed"):
                    getattr(opt, name)
        bad = [({"rpc_timeout": 1e9}, ValueError, "at most one year"),
               ({"rpc_timeout": "5"}, TypeError, "number of seconds"),
               ({"recovery_timeout": 0}, ValueError, "recovery_timeout"),
               ({"step_watchdog_margin": -1}, ValueError,
                "step_watchdog_margin"),
               ({"lr": "0.1"}, TypeError, "real number")]
        for kw, error, message in bad:
            with self.subTest(kw=kw):
                with self.assertRaisesRegex(error, message):
                    self.optimizer(srv, make_model()[0].parameters(), **kw)

    def test_a_parameter_listed_twice_counts_once(self):
        """A parameter listed twice (torch only warns) got two slices of
        the flat buffer and its gradient twice: n was too large and the
        replicas trained another model than the servers' spec."""
        import warnings
        srv = self.start(1, 1)
        model, _ = make_model(extra=False)
        params = list(model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's duplicate warning
            opt = self.optimizer(srv, params + [params[0]], rank=0)
        self.addCleanup(opt.close)
        self.assertEqual(opt.n, sum(p.numel() for p in params))
        loss_of(model, 0, 0).backward()
        opt.step()
        self.assertEqual(
            gtopk.checksum(opt.flat_parameters().numpy()),
            self.server_checksum(opt))

    def test_import_without_torch_names_the_interpreter(self):
        import subprocess
        code = ("import sys; sys.modules['numpy'] = None\n"
                "try:\n    import gtopk.torch\n"
                "except ImportError as e:\n    print(e)\n")
        r = subprocess.run([sys.executable, "-c", code],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=cu.python_env(), timeout=60)
        self.assertIn("python3-torch with /usr/bin/python3", r.stdout)
        self.assertIn(sys.executable, r.stdout)


class MetricsTest(ClusterCase):
    def test_worker_metrics_served_and_recorded(self):
        """metrics_port: the worker families of docs/metrics.md ("Worker"),
        the process metrics and gtopk_build_info{program="gtopk-python"},
        with each successful step recorded (bytes, step counter, loss)."""
        import re
        import urllib.request
        srv = self.start(1, 1)
        model, unused = make_model()
        port = cu.free_ports(1)[0]
        opt = self.optimizer(srv, params_of(model, unused), rank=0,
                             metrics_port=port, metrics_host="127.0.0.1")
        try:
            self.assertEqual(opt.metrics_port, port)
            steps = 3
            for t in range(steps):
                opt.zero_grad()
                loss = loss_of(model, 0, t)
                loss.backward()
                opt.step(loss=loss)
            with urllib.request.urlopen(
                    "http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
                text = r.read().decode()

            def value(pattern):
                m = re.search(r"^%s (\S+)$" % pattern, text, re.MULTILINE)
                self.assertIsNotNone(m, "%s not in:\n%s" % (pattern, text))
                return float(m.group(1))
            self.assertEqual(value(r"gtopk_worker_step"), steps)
            self.assertAlmostEqual(value(r"gtopk_worker_loss"),
                                   float(loss.item()), places=5)
            sent = value(r'gtopk_worker_sent_bytes_total\{shard="0"\}')
            self.assertGreater(sent, 0)
            n = opt.n
            self.assertEqual(
                value(r"gtopk_worker_dense_equivalent_bytes_total"),
                4 * n * steps)
            self.assertLess(sent, 4 * n * steps)
            self.assertEqual(
                value(r"gtopk_worker_step_duration_seconds_count"), steps)
            self.assertIn('program="gtopk-python"', text)
            self.assertRegex(text, r"(?m)^process_cpu_seconds_total ")
        finally:
            opt.close()


class StateDictTest(ClusterCase):
    def resume(self, momentum_mode):
        P, S, total, half = 2, 2, 8, 4
        flags = {"momentum_mode": momentum_mode}

        def run(srv, action, stop):
            models = [make_model(extra=False)[0] for _ in range(P)]

            def worker(r):
                model = models[r]
                opt = self.optimizer(srv, model.parameters(), rank=r)
                path = os.path.join(self.dir, "opt-%d.pt" % r)
                try:
                    if action == "load":
                        ck = torch.load(path)
                        model.load_state_dict(ck["model"])
                        opt.load_state_dict(ck["opt"])
                    while opt.next_step < stop:
                        opt.zero_grad()
                        loss_of(model, r, opt.next_step).backward()
                        opt.step()
                    if action == "save":
                        torch.save({"model": model.state_dict(),
                                    "opt": opt.state_dict()}, path)
                    return gtopk.checksum(opt.flat_parameters().numpy())
                finally:
                    opt.close()
            return in_threads(P, worker)

        srv = self.start(S, P, name="straight-" + momentum_mode, **flags)
        straight = run(srv, "run", total)
        srv.stop()
        ckpt = os.path.join(self.dir, "ckpt-" + momentum_mode)
        os.mkdir(ckpt)
        srv = self.start(S, P, name="first-" + momentum_mode,
                         checkpoint_dir=ckpt, **flags)
        run(srv, "save", half)
        for p in srv.procs:  # graceful: the shards checkpoint and exit
            p.proc.send_signal(signal.SIGTERM)
        for p in srv.procs:
            self.assertEqual(p.wait(30), 0, p.log())
        srv.stop()
        srv = self.start(S, P, name="second-" + momentum_mode,
                         checkpoint_dir=ckpt, **flags)
        resumed = run(srv, "load", total)
        self.assertEqual(len(set(straight)), 1, straight)
        self.assertEqual(resumed, straight)

    def test_resume_dgc(self):
        self.resume("dgc")

    def test_resume_global(self):
        self.resume("global")

    def test_checkpoint_of_another_step_or_rank(self):
        srv = self.start(1, 1)
        model, _ = make_model(extra=False)
        opt = self.optimizer(srv, model.parameters(), rank=0)
        self.addCleanup(opt.close)
        sd = opt.state_dict()
        self.assertEqual(sd["gtopk"]["step"], 0)
        self.assertEqual(sd["gtopk"]["residual"].numel(), opt.n)
        loss_of(model, 0, 0).backward()
        opt.step()
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "servers are at step 1 but the "
                                    "checkpoint is from step 0"):
            opt.load_state_dict(sd)
        sd = opt.state_dict()
        sd["gtopk"]["rank"] = 3
        with self.assertRaisesRegex(gtopk.FailedPrecondition,
                                    "rank 3's gtopk state"):
            opt.load_state_dict(sd)
        with self.assertRaisesRegex(ValueError, "no 'gtopk' entry"):
            opt.load_state_dict({"state": {}, "param_groups": []})


class ScheduleAndErrorsTest(ClusterCase):
    def test_lr_schedules(self):
        srv = self.start(1, 1)
        model, _ = make_model(extra=False)
        opt = self.optimizer(srv, model.parameters(), rank=0)
        self.addCleanup(opt.close)
        self.assertEqual(opt.param_groups[0]["lr"], 0.1)  # the cluster's
        self.assertEqual(opt.param_groups[0]["momentum"], 0.9)
        constant = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        for t in range(2):
            opt.zero_grad()
            loss_of(model, 0, t).backward()
            opt.step()
            constant.step()
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        opt.zero_grad()
        loss_of(model, 0, 2).backward()
        opt.step()
        decay.step()  # lr 0.05 from here
        with self.assertRaises(gtopk.FailedPrecondition) as cm:
            opt.step()
        msg = str(cm.exception)
        for part in ("param_groups[0]['lr'] is 0.05", "lr is 0.1",
                     "--lr", "--lr-warmup-steps", "not supported"):
            self.assertIn(part, msg)
        self.assertEqual(opt.next_step, 3)  # nothing sent
        opt.param_groups[0]["lr"] = float(np.float32(0.1))  # float32-equal
        opt.param_groups[0]["momentum"] = 0.5
        with self.assertRaisesRegex(gtopk.FailedPrecondition, "--momentum"):
            opt.step()
        opt.param_groups[0]["momentum"] = 0.9
        opt.step()
        self.assertEqual(opt.next_step, 4)

    def test_settings_and_size_mismatches(self):
        srv = self.start(1, 4)
        cases = [
            ({"lr": 0.2}, "lr=0.2 but the servers' cluster spec has lr 0.1"),
            ({"mode": "dense"}, "mode=dense but the servers' cluster spec "
             "has mode gtopk"),
            ({"world_size": 3}, "world_size=3 but the servers' cluster spec "
             "has num_workers 4"),
        ]
        for kw, message in cases:
            with self.subTest(kw=kw):
                with self.assertRaises(gtopk.FailedPrecondition) as cm:
                    self.optimizer(srv, make_model()[0].parameters(), **kw)
                self.assertIn(message, cm.exception.message)
                self.assertEqual(cm.exception.code,
                                 gtopk.StatusCode.FAILED_PRECONDITION)
        first = self.optimizer(srv, make_model()[0].parameters(), rank=0)
        self.addCleanup(first.close)
        with self.assertRaisesRegex(gtopk.FailedPrecondition, "n = "):
            self.optimizer(srv, torch.nn.Linear(3, 3).parameters())

    def test_environment(self):
        srv = self.start(1, 2)
        saved = {k: os.environ.get(k) for k in
                 ("GTOPK_LEADER", "RANK", "WORLD_SIZE")}

        def restore():
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.addCleanup(restore)
        # Rank 0 first: it initialises the shards rank 1 downloads from.
        first = self.optimizer(srv, make_model()[0].parameters(), rank=0)
        self.addCleanup(first.close)
        os.environ.update(GTOPK_LEADER=srv.leader, RANK="1", WORLD_SIZE="2")
        opt = gtopk.torch.DistributedOptimizer(make_model()[0].parameters(),
                                               rpc_timeout=RPC_TIMEOUT,
                                               tls="off")
        self.addCleanup(opt.close)
        self.assertEqual((opt.rank, opt.world_size), (1, 2))

    def test_dead_shard_is_retryable_and_recovery_loop(self):
        # A missing peer: rank 1 joins late; rank 0's first step times out
        # (DEADLINE_EXCEEDED), the documented loop recovers and retries.
        srv = self.start(2, 2, step_timeout="2s")
        release = threading.Event()
        models = [make_model() for _ in range(2)]

        def worker(r):
            model, unused = models[r]
            opt = self.optimizer(srv, params_of(model, unused), rank=r)
            failures = []
            try:
                if r == 1:
                    release.wait(60)
                for t in range(3):
                    opt.zero_grad()
                    loss_of(model, r, t).backward()
                    while True:
                        try:
                            opt.step()
                            break
                        except gtopk.RETRYABLE as e:
                            failures.append(type(e).__name__)
                            release.set()
                            opt.recover()
                return (failures,
                        gtopk.checksum(opt.flat_parameters().numpy()),
                        self.server_checksum(opt))
            finally:
                opt.close()
        got = in_threads(2, worker)
        self.assertIn("DeadlineExceeded", got[0][0])
        self.assertEqual(len({c for _, c, s in got} | {s for _, c, s in got}),
                         1, got)
        # A dead shard within the step deadline: UNAVAILABLE or
        # DEADLINE_EXCEEDED, both retryable.
        srv = self.start(2, 1, name="dead", step_timeout="2s")
        model, _ = make_model()
        opt = self.optimizer(srv, model.parameters(), rank=0,
                             recovery_timeout=1.0)
        self.addCleanup(opt.close)
        srv.procs[1].kill()
        loss_of(model, 0, 0).backward()
        outcome = []

        def step():
            try:
                opt.step()
                outcome.append(None)
            except BaseException as e:  # noqa: B902 - checked below
                outcome.append(e)
        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(30)  # step timeout 2 s + the watchdog's 2 s margin
        self.assertFalse(t.is_alive(), "a step with a dead shard still blocks "
                         "after 30 s (step timeout 2 s)")
        self.assertIsInstance(outcome[0], gtopk.RETRYABLE)
        self.assertIn("shard 1", outcome[0].message)

    def test_recover_waits_for_a_restarting_shard(self):
        """opt.recover() asks the leader again while it answers UNAVAILABLE
        (a shard down or restarting), within its timeout, as gtopk-worker's
        recovery loop does. A break-it run found it raising Unavailable
        ("cannot read every shard's state") at once when a shard was down
        longer than the step timeout, which ended the documented loop."""
        ckpt = os.path.join(self.dir, "ckpt-restarting")
        os.mkdir(ckpt)
        srv = self.start(2, 1, name="restarting", step_timeout="1s",
                         checkpoint_dir=ckpt, checkpoint_every=1)
        model, _ = make_model()
        opt = self.optimizer(srv, model.parameters(), rank=0)
        self.addCleanup(opt.close)
        loss_of(model, 0, 0).backward()
        opt.step()
        srv.procs[1].kill()
        down = 4.0  # seconds: longer than the step timeout

        log = open(os.path.join(self.dir, "restarting-shard1-again.log"),
                   "wb")
        self.addCleanup(log.close)
        restarted = []

        def restart():
            # No preexec_fn: this process runs gRPC threads (a fork that
            # runs Python code in the child can deadlock on their locks).
            time.sleep(down)
            restarted.append(subprocess.Popen(
                srv.argv(1), stdin=subprocess.DEVNULL, stdout=log,
                stderr=log, start_new_session=True))
        t = threading.Thread(target=restart)
        t.start()
        start = time.monotonic()
        try:
            step = opt.recover(timeout=60)
        finally:
            t.join()
            for p in restarted:
                self.addCleanup(p.wait, 10)
                self.addCleanup(p.kill)
        self.assertEqual(step, 1)
        self.assertGreater(time.monotonic() - start, down - 0.5)
        loss_of(model, 0, 1).backward()
        opt.step()
        self.assertEqual(opt.next_step, 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
