"""The Python binding (gtopk._gtopk.Client) against the C++ worker client.

* Bit-identity: P Python clients (threads of this process; the binding
  releases the GIL) and P C++ clients (gtopk_replay_worker processes) step
  through the same seeded gradients on fresh servers with the same flags;
  every rank's final parameters, in both runs, and the servers' parameters
  (a fresh download) are the same bytes. Every mode (gtopk exact, gtopk
  quota, topk, dense) x P in {1, 2, 3} x S in {1, 2}.
* A mixed cluster (P = 3, S = 2): ranks 0 and 2 Python, rank 1 C++, ends
  bit-identical to the all-C++ run.
* Errors from real server conditions, with their gtopk.Error subclass,
  .code and .message; recover() after a missing peer; the state()
  /load_state() round trip resumes bit-identically.

Run: PYTHONPATH=build/python GTOPK_BUILD_DIR=build /usr/bin/python3
tests/python/binding_test.py  (ctest -R python_binding_test).
"""

import os
import pathlib
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import cluster_util as cu  # noqa: E402
import gtopk  # noqa: E402

N = 3001        # odd: the shards' ranges differ in length with S = 2
STEPS = 5
DENSITY = 0.01  # k = 30
SEED = 20240611
# Generous: 2 busy cores; a step takes milliseconds.
RPC_TIMEOUT = 30.0
JOIN_TIMEOUT = 120.0

CONFIGS = {  # name -> server flags
    "gtopk-exact": {"mode": "gtopk", "selection": "exact"},
    "gtopk-quota": {"mode": "gtopk", "selection": "quota"},
    "topk": {"mode": "topk"},
    "dense": {"mode": "dense"},
}


def gradients(rank, steps=STEPS, n=N):
    """rank's seeded gradients, steps x n float32, different per rank and
    step, with ties and zeros:
      t % 3 == 0: 60 entries (the same indices on every rank) set to 3.5,
                  so the local and the summed top-k (k = 30) cut through
                  ties;
      t % 3 == 1: the first half zero;
      rank 1, t == 2: all zero (a worker with nothing to send).
    """
    g = np.empty((steps, n), np.float32)
    for t in range(steps):
        rng = np.random.default_rng([SEED, rank, t])
        g[t] = rng.standard_normal(n).astype(np.float32)
        if t % 3 == 0:
            tied = np.random.default_rng([SEED, 999, t]).choice(
                n, 60, replace=False)
            g[t, tied] = np.float32(3.5)
        elif t % 3 == 1:
            g[t, : n // 2] = 0
        if rank == 1 and t == 2:
            g[t] = 0
    return g


def initial_params(n=N):
    return np.random.default_rng([SEED, 12345]).standard_normal(n).astype(
        np.float32)


def first_difference(a, b):
    a = np.ascontiguousarray(a, np.float32).view(np.uint32)
    b = np.ascontiguousarray(b, np.float32).view(np.uint32)
    if a.shape != b.shape:
        return "shapes %s and %s" % (a.shape, b.shape)
    bad = np.nonzero(a != b)[0]
    if len(bad) == 0:
        return None
    i = bad[0]
    return ("%d of %d values differ; first at %d: %r (0x%08x) vs %r (0x%08x)"
            % (len(bad), len(a), i, a[i:i + 1].view(np.float32)[0], a[i],
               b[i:i + 1].view(np.float32)[0], b[i]))


class ClusterTest(cu.KeepLogsOnFailure, unittest.TestCase):
    """Temp dir per test; every server stopped at the end."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk_py_")
        self.servers = []
        self.procs = []
        # Cleanups run last-in first-out: clients a test registers later
        # close before the processes are killed.
        self.addCleanup(self.stop_all)

    def stop_all(self):
        for p in self.procs:
            p.kill()
        for s in self.servers:
            s.stop()

    def start_servers(self, num_shards, workers, **flags):
        flags.setdefault("density", DENSITY)
        s = cu.Servers(num_shards, workers, self.dir,
                       name="srv%d" % len(self.servers), **flags)
        self.servers.append(s)
        return s.start()

    def assertBitIdentical(self, a, b, what):
        diff = first_difference(a, b)
        if diff is not None:
            self.fail("%s: not bit-identical: %s" % (what, diff))

    def server_params(self, leader, n=N, rank=0):
        """The servers' parameters: a download by a fresh client that
        re-joins as `rank` (its worker is gone)."""
        c = gtopk.Client(leader, n, rank=rank, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        try:
            scratch = np.zeros(n, np.float32)
            step = c.synchronize_parameters(scratch)
            return step, scratch
        finally:
            c.close()

    # -- running workers ------------------------------------------------

    def python_worker(self, leader, rank, grads, steps, out, errors,
                      n=N):
        try:
            c = gtopk.Client(leader, n, rank=rank, rpc_timeout=RPC_TIMEOUT,
                             tls="off")
            try:
                p = initial_params(n) if rank == 0 else np.zeros(n,
                                                                np.float32)
                start = c.synchronize_parameters(p)
                if start != 0:
                    raise AssertionError("rank %d starts at step %d"
                                         % (rank, start))
                for t in range(steps):
                    stats = c.step(grads[t % len(grads)], p)
                    if stats["step"] != t:
                        raise AssertionError("stats step %d at %d"
                                             % (stats["step"], t))
                out[rank] = p
                out[("next_step", rank)] = c.next_step
            finally:
                c.close()
        except BaseException as e:  # reported by the main thread
            errors.append((rank, e))

    def write_inputs(self, ranks):
        params_file = os.path.join(self.dir, "params.bin")
        initial_params().tofile(params_file)
        files = {}
        for r in ranks:
            files[r] = os.path.join(self.dir, "grads-%d.bin" % r)
            if not os.path.exists(files[r]):
                gradients(r).tofile(files[r])
        return params_file, files

    def run_cluster(self, flags, num_shards, workers, cpp_ranks=(),
                    steps=STEPS):
        """Fresh servers; ranks in cpp_ranks run gtopk_replay_worker, the
        others are Python clients in threads. Returns (per-rank final
        params, (servers' step, servers' params))."""
        srv = self.start_servers(num_shards, workers, **flags)
        params_file, grad_files = self.write_inputs(range(workers))
        tag = "%d" % len(self.servers)
        procs = {}
        for r in cpp_ranks:
            out = os.path.join(self.dir, "out-%s-%d.bin" % (tag, r))
            p = cu.Proc(cu.replay_argv(srv.leader, r, N, grad_files[r], steps,
                                       out, params=params_file if r == 0
                                       else None),
                        os.path.join(self.dir, "replay-%s-%d.log" % (tag, r)))
            self.procs.append(p)
            procs[r] = (p, out)
        results, errors, threads = {}, [], []
        for r in range(workers):
            if r in procs:
                continue
            th = threading.Thread(
                target=self.python_worker,
                args=(srv.leader, r, gradients(r), steps, results, errors),
                daemon=True)
            th.start()
            threads.append(th)
        deadline = time.monotonic() + JOIN_TIMEOUT
        for th in threads:
            th.join(max(0.1, deadline - time.monotonic()))
        hung = [th for th in threads if th.is_alive()]
        if hung or errors:
            for p, _ in procs.values():
                p.kill()
            srv.stop()  # unblocks the threads
            for th in threads:
                th.join(30)
            self.fail("Python worker(s) failed: %s%s\n%s" % (
                errors, " (%d still running)" % len(hung) if hung else "",
                srv.logs()))
        cu.wait_all([p for p, _ in procs.values()],
                    max(1.0, deadline - time.monotonic()), "replay worker")
        for r, (_, out) in procs.items():
            results[r] = np.fromfile(out, np.float32)
        for r in range(workers):
            if r not in procs:
                self.assertEqual(results[("next_step", r)], steps)
        server = self.server_params(srv.leader)
        srv.stop()
        return [results[r] for r in range(workers)], server


class BitIdentityTest(ClusterTest):
    # (config, P, S): every mode with every P and every S; gtopk exact
    # with all six.
    CASES = [(c, p, s) for c in CONFIGS for p in (1, 2, 3) for s in (1, 2)]

    #: (config, P, S) -> the all-C++ run's params (for MixedClusterTest).
    cpp_runs = {}

    def check_run(self, label, params, server, initial):
        step, server_params = server
        self.assertEqual(step, STEPS, "%s: servers at step %d" % (label,
                                                                  step))
        for r, p in enumerate(params):
            self.assertEqual(p.shape, (N,))
            self.assertBitIdentical(p, params[0], "%s rank %d vs rank 0"
                                    % (label, r))
        self.assertBitIdentical(server_params, params[0],
                                "%s servers vs rank 0" % label)
        self.assertEqual(gtopk.checksum(server_params),
                         gtopk.checksum(params[0]))
        changed = np.count_nonzero(params[0] != initial)
        self.assertGreater(changed, 0, "%s: nothing was applied" % label)
        return changed

    def test_python_equals_cpp(self):
        initial = initial_params()
        for config, P, S in self.CASES:
            with self.subTest(config=config, P=P, S=S):
                label = "%s P=%d S=%d" % (config, P, S)
                py, py_server = self.run_cluster(CONFIGS[config], S, P)
                cpp, cpp_server = self.run_cluster(CONFIGS[config], S, P,
                                                   cpp_ranks=range(P))
                self.check_run(label + " Python", py, py_server, initial)
                changed = self.check_run(label + " C++", cpp, cpp_server,
                                         initial)
                self.assertBitIdentical(py[0], cpp[0],
                                        "%s Python vs C++" % label)
                # A sparse step changes at most k = 30 values per step.
                if CONFIGS[config]["mode"] == "dense":
                    self.assertGreater(changed, N // 2)
                BitIdentityTest.cpp_runs[(config, P, S)] = cpp[0]


class MixedClusterTest(ClusterTest):

    def test_python_and_cpp_workers_in_one_cluster(self):
        flags = CONFIGS["gtopk-exact"]
        mixed, server = self.run_cluster(flags, 2, 3, cpp_ranks=(1,))
        reference = BitIdentityTest.cpp_runs.get(("gtopk-exact", 3, 2))
        if reference is None:
            cpp, _ = self.run_cluster(flags, 2, 3, cpp_ranks=range(3))
            reference = cpp[0]
        for r in range(3):
            self.assertBitIdentical(mixed[r], reference,
                                    "mixed rank %d vs the all-C++ run" % r)
        self.assertBitIdentical(server[1], reference, "mixed servers")
        self.assertGreater(np.count_nonzero(reference != initial_params()),
                           0)


class ErrorTest(ClusterTest):

    def assertError(self, cm, cls, code, *fragments):
        e = cm.exception
        self.assertIsInstance(e, gtopk.Error)
        self.assertIsInstance(e, cls)
        self.assertEqual(e.code, code)
        self.assertIsInstance(e.message, str)
        self.assertEqual(str(e), "%s: %s" % (code.name, e.message))
        for f in fragments:
            self.assertIn(f, e.message)

    def test_wrong_n(self):
        srv = self.start_servers(1, 2, mode="gtopk")
        a = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        try:
            with self.assertRaises(gtopk.FailedPrecondition) as cm:
                gtopk.Client(srv.leader, N - 1, rank=1,
                             rpc_timeout=RPC_TIMEOUT, tls="off")
            self.assertError(cm, gtopk.FailedPrecondition,
                             gtopk.StatusCode.FAILED_PRECONDITION,
                             "n = %d" % (N - 1), "n = %d" % N)
        finally:
            a.close()

    def test_nothing_listening(self):
        port = cu.free_ports(1)[0]
        t0 = time.monotonic()
        with self.assertRaises(gtopk.Error) as cm:
            gtopk.Client("%s:%d" % (cu.LOOPBACK, port), N, rpc_timeout=1.0,
                         tls="off")
        elapsed = time.monotonic() - t0
        self.assertIsInstance(cm.exception,
                              (gtopk.DeadlineExceeded, gtopk.Unavailable))
        self.assertIn(cm.exception.code,
                      (gtopk.StatusCode.DEADLINE_EXCEEDED,
                       gtopk.StatusCode.UNAVAILABLE))
        self.assertIn(str(port), cm.exception.message)
        self.assertLess(elapsed, 3.0, "rpc_timeout=1 s but %.1f s" % elapsed)

    def joined(self, srv, rank=0, n=N):
        c = gtopk.Client(srv.leader, n, rank=rank, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        self.addCleanup(c.close)
        p = initial_params(n) if rank == 0 else np.zeros(n, np.float32)
        c.synchronize_parameters(p)
        return c, p

    def test_missing_peer_deadline_keeps_residual(self):
        srv = self.start_servers(1, 2, mode="gtopk", step_timeout="2s")
        c, p = self.joined(srv)
        before = p.copy()
        g = gradients(0)[0]
        t0 = time.monotonic()
        with self.assertRaises(gtopk.DeadlineExceeded) as cm:
            c.step(g, p)
        elapsed = time.monotonic() - t0
        self.assertError(cm, gtopk.DeadlineExceeded,
                         gtopk.StatusCode.DEADLINE_EXCEEDED,
                         "worker(s) 1")
        self.assertGreater(elapsed, 1.5)
        self.assertLess(elapsed, 10.0)
        self.assertEqual(c.next_step, 0)
        self.assertBitIdentical(p, before, "params after a failed step")
        st = c.state()
        self.assertEqual(st["step"], 0)
        # The residual is kept in lr units: all of lr * g, the top-k
        # included (nothing was lost with the failed push).
        lr = np.float32(c.cluster()["lr"])
        self.assertBitIdentical(st["residual"], lr * g,
                                "residual after a failed step")
        self.assertBitIdentical(st["velocity"], g,
                                "DGC velocity after a failed step")

    def test_bad_buffers(self):
        srv = self.start_servers(1, 1, mode="gtopk")
        c, p = self.joined(srv)
        g = gradients(0)[0]
        nan = g.copy()
        nan[7] = np.nan
        readonly = p.copy()
        readonly.flags.writeable = False
        cases = [
            ("float64 gradient", g.astype(np.float64), p, "float32"),
            ("short gradient", g[:-1], p, "%d" % (N - 1)),
            ("long params", g, np.zeros(N + 1, np.float32), "%d" % (N + 1)),
            ("strided gradient", np.zeros(2 * N, np.float32)[::2], p,
             "contiguous"),
            ("non-finite gradient", nan, p, "position 7"),
            ("read-only params", g, readonly, "writable"),
        ]
        for what, grad, params, fragment in cases:
            with self.subTest(what):
                with self.assertRaises(gtopk.InvalidArgument) as cm:
                    c.step(grad, params)
                self.assertError(cm, gtopk.InvalidArgument,
                                 gtopk.StatusCode.INVALID_ARGUMENT, fragment)
        with self.assertRaises(gtopk.InvalidArgument):
            c.synchronize_parameters(np.zeros(N, np.float64))
        with self.assertRaises(gtopk.InvalidArgument):
            c.load_state(0, np.zeros(N - 1, np.float32),
                         np.zeros(N, np.float32))
        # Nothing of that reached the state; a good step still works.
        self.assertEqual(c.next_step, 0)
        self.assertFalse(np.any(c.state()["residual"]))
        c.step(g, p)
        self.assertEqual(c.next_step, 1)

    def test_check_settings(self):
        srv = self.start_servers(1, 1, mode="gtopk", lr=0.1, momentum=0.9,
                                 momentum_mode="dgc")
        c, _ = self.joined(srv)
        c.check_settings(mode="gtopk", selection="exact", selector="exact",
                         density=DENSITY, lr=0.1, momentum=0.9,
                         momentum_mode="dgc", index_codec="delta-varint",
                         value_codec="fp32")
        with self.assertRaises(gtopk.FailedPrecondition) as cm:
            c.check_settings(lr=0.05)
        self.assertError(cm, gtopk.FailedPrecondition,
                         gtopk.StatusCode.FAILED_PRECONDITION,
                         "lr=0.05 but the servers' cluster spec has lr 0.1")
        with self.assertRaises(gtopk.FailedPrecondition) as cm:
            c.check_settings(mode="dense")
        self.assertError(cm, gtopk.FailedPrecondition,
                         gtopk.StatusCode.FAILED_PRECONDITION, "dense",
                         "gtopk")

    def test_load_state_wrong_step_and_closed(self):
        srv = self.start_servers(1, 1, mode="gtopk")
        c, p = self.joined(srv)
        c.step(gradients(0)[0], p)
        st = c.state()
        self.assertEqual(st["step"], 1)
        with self.assertRaises(gtopk.FailedPrecondition) as cm:
            c.load_state(3, st["residual"], st["velocity"])
        self.assertError(cm, gtopk.FailedPrecondition,
                         gtopk.StatusCode.FAILED_PRECONDITION, "step")
        c.load_state(1, st["residual"], st["velocity"])  # the right step
        c.close()
        for what, call in [
                ("step", lambda: c.step(gradients(0)[1], p)),
                ("state", c.state),
                ("synchronize_parameters",
                 lambda: c.synchronize_parameters(p)),
                ("recover", lambda: c.recover(p))]:
            with self.subTest(what):
                with self.assertRaises(gtopk.FailedPrecondition) as cm:
                    call()
                self.assertError(cm, gtopk.FailedPrecondition,
                                 gtopk.StatusCode.FAILED_PRECONDITION,
                                 "closed")
        c.close()  # twice is fine


class TlsTest(ClusterTest):
    """The Python client's transport security (docs/security.md) against
    real shards over loopback: mutual TLS accepted, the wrong certificate,
    a plaintext client and a bad file refused with a clear error and no
    hang."""

    def setUp(self):
        super().setUp()
        self.tls = cu.make_certs(os.path.join(self.dir, "tls"), 1, 2)

    def files(self, who, tls=None):
        d = tls or self.tls
        return dict(tls="mutual", tls_cert=os.path.join(d, who + ".crt"),
                    tls_key=os.path.join(d, who + ".key"),
                    tls_ca=os.path.join(d, "ca.crt"))

    def test_mutual_tls_trains_and_refuses_others(self):
        srv = self.start_servers(1, 2, mode="gtopk", tls_dir=self.tls)
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         **self.files("worker-0"))
        self.addCleanup(c.close)
        self.assertEqual(c.rank, 0)
        params = np.zeros(N, dtype=np.float32)
        self.assertEqual(c.synchronize_parameters(params), 0)
        # A certificate pinned to rank 1 cannot join as rank 0: refused by
        # the server, nothing joined.
        with self.assertRaises(gtopk.PermissionDenied) as cm:
            gtopk.Client(srv.leader, N, rank=0, rpc_timeout=5.0,
                         **self.files("worker-1"))
        self.assertIn("gtopk-worker-1", cm.exception.message)
        # Another cluster's certificates (another CA, trusted by the
        # client): the handshake fails, quickly.
        other = cu.make_certs(os.path.join(self.dir, "other"), 1, 2)
        for kwargs in (self.files("worker-1", tls=other),
                       dict(tls="off")):
            t0 = time.monotonic()
            with self.assertRaises(gtopk.Error) as cm:
                gtopk.Client(srv.leader, N, rank=1, rpc_timeout=2.0,
                             **kwargs)
            self.assertIn(cm.exception.code,
                          (gtopk.StatusCode.UNAVAILABLE,
                           gtopk.StatusCode.DEADLINE_EXCEEDED), kwargs)
            if cm.exception.code == gtopk.StatusCode.DEADLINE_EXCEEDED:
                # The retried handshake: the error says what it may be.
                self.assertIn("TLS settings match", cm.exception.message)
            self.assertLess(time.monotonic() - t0, 10.0, kwargs)
        # The legitimate worker still joins with rank 1's certificate
        # (file arguments as os.PathLike too).
        c1 = gtopk.Client(srv.leader, N, rank=1, rpc_timeout=RPC_TIMEOUT,
                          **{k: (pathlib.Path(v) if k != "tls" else v)
                             for k, v in self.files("worker-1").items()})
        self.addCleanup(c1.close)
        self.assertEqual(c1.rank, 1)

    def test_arguments_checked_before_dialling(self):
        port = cu.free_ports(1)[0]  # nothing listens: no dial may happen
        leader = "%s:%d" % (cu.LOOPBACK, port)
        with self.assertRaises(TypeError):  # tls is a required keyword
            gtopk.Client(leader, N)
        cases = [
            (dict(tls=""), "tls is required"),
            (dict(tls="plain"), "plain"),
            (dict(self.files("worker-0"),
                  tls_cert=os.path.join(self.dir, "missing.crt")),
             "missing.crt"),
            (dict(self.files("worker-0"),
                  tls_key=os.path.join(self.tls, "worker-1.key")),
             "tls-key"),
            (dict(tls="off", tls_ca=os.path.join(self.tls, "ca.crt")),
             "--tls=off"),
        ]
        # A certificate that does not chain to tls_ca: refused at load.
        other = cu.make_certs(os.path.join(self.dir, "other"), 1, 1)
        cases.append((dict(self.files("worker-0", tls=other),
                           tls_ca=os.path.join(self.tls, "ca.crt")),
                      "worker-0.crt"))
        for kwargs, fragment in cases:
            with self.assertRaises(gtopk.InvalidArgument,
                                   msg=str(kwargs)) as cm:
                gtopk.Client(leader, N, rpc_timeout=1.0, **kwargs)
            self.assertIn(fragment, cm.exception.message, kwargs)


class RecoverTest(ClusterTest):

    def test_recover_after_missing_peer(self):
        srv = self.start_servers(1, 2, mode="gtopk", step_timeout="2s")
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        self.addCleanup(c.close)
        p = initial_params()
        self.assertEqual(c.synchronize_parameters(p), 0)
        g0 = gradients(0)
        with self.assertRaises(gtopk.DeadlineExceeded):
            c.step(g0[0], p)
        self.assertIsInstance(gtopk.DeadlineExceeded("x"), gtopk.RETRYABLE)
        self.assertEqual(c.recover(p), 0)
        self.assertEqual(c.next_step, 0)
        # The missing peer arrives; the retried step (the next gradient on
        # top of the residual) and one more succeed on both.
        peer_out, errors = {}, []
        peer = threading.Thread(
            target=self.python_worker,
            args=(srv.leader, 1, gradients(1), 2, peer_out, errors),
            daemon=True)
        peer.start()
        for t in (1, 2):
            stats = c.step(g0[t], p)
            self.assertEqual(stats["step"], t - 1)
        peer.join(JOIN_TIMEOUT)
        self.assertFalse(peer.is_alive())
        self.assertEqual(errors, [])
        self.assertEqual(c.next_step, 2)
        self.assertBitIdentical(p, peer_out[1], "rank 0 vs rank 1")
        self.assertGreater(np.count_nonzero(p != initial_params()), 0)
        server = np.zeros(N, np.float32)
        self.assertEqual(c.synchronize_parameters(server), 2)
        self.assertBitIdentical(server, p, "servers vs rank 0")


    def test_recover_waits_for_a_killed_leader(self):
        """recover() waits for a leader that is down, up to its timeout,
        and succeeds when it comes back in time. Before the fix the first
        call after the leader was killed failed at once with Unavailable
        ("Socket closed": it went out on the dead connection), so the
        documented loop (recover() outside the try) gave up."""
        ckpt = os.path.join(self.dir, "ckpt")
        os.mkdir(ckpt)
        srv = self.start_servers(1, 2, mode="gtopk", step_timeout="1s",
                                 checkpoint_dir=ckpt, checkpoint_every=1)
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        self.addCleanup(c.close)
        p = initial_params()
        c.synchronize_parameters(p)
        with self.assertRaises(gtopk.DeadlineExceeded):
            c.step(gradients(0)[0], p)
        srv.stop()  # SIGKILL: the connection dies under the client
        time.sleep(0.5)
        t0 = time.monotonic()
        with self.assertRaises((gtopk.DeadlineExceeded, gtopk.Unavailable)):
            c.recover(p, 2.0)
        self.assertGreater(time.monotonic() - t0, 1.5)  # it waited
        # The leader comes back (from its checkpoint, same address) while
        # recover() waits: it succeeds.
        result = {}

        def recover():
            try:
                result["step"] = c.recover(p, 20.0)
            except gtopk.Error as e:  # pragma: no cover - reported below
                result["error"] = e
        t = threading.Thread(target=recover, daemon=True)
        t.start()
        time.sleep(1.0)
        restarted = cu.Servers(1, 2, self.dir, name="restarted",
                               **srv.flags)
        restarted.addresses = list(srv.addresses)
        restarted.procs = [cu.Proc(restarted.argv(0), os.path.join(
            self.dir, "restarted.log"))]
        self.servers.append(restarted)
        restarted._wait_listening(30)
        t.join(JOIN_TIMEOUT)
        self.assertFalse(t.is_alive())
        self.assertEqual(result.get("step"), 0, result)


class StateRoundTripTest(ClusterTest):

    def run_steps(self, c, p, first, last):
        g = gradients(0, steps=6)
        for t in range(first, last):
            self.assertEqual(c.step(g[t], p)["step"], t)

    def test_state_resumes_bit_identically(self):
        flags = dict(mode="gtopk", momentum_mode="dgc")
        # Uninterrupted: 6 steps.
        srv = self.start_servers(1, 1, **flags)
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        p_ref = initial_params()
        c.synchronize_parameters(p_ref)
        self.run_steps(c, p_ref, 0, 6)
        ref_state = c.state()
        c.close()
        srv.stop()
        # Interrupted after 3: state, close, join again, load, 3 more.
        srv = self.start_servers(1, 1, **flags)
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        p = initial_params()
        c.synchronize_parameters(p)
        self.run_steps(c, p, 0, 3)
        saved = c.state()
        self.assertEqual(saved["step"], 3)
        self.assertTrue(np.any(saved["residual"]))
        self.assertTrue(np.any(saved["velocity"]))
        c.close()
        c = gtopk.Client(srv.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                         tls="off")
        self.addCleanup(c.close)
        q = np.zeros(N, np.float32)
        self.assertEqual(c.synchronize_parameters(q), 3)
        self.assertBitIdentical(q, p, "download after rejoining")
        self.assertFalse(np.any(c.state()["residual"]))  # a new client
        c.load_state(saved["step"], saved["residual"], saved["velocity"])
        st = c.state()
        self.assertBitIdentical(st["residual"], saved["residual"],
                                "loaded residual")
        self.run_steps(c, q, 3, 6)
        self.assertBitIdentical(q, p_ref, "resumed vs uninterrupted")
        end = c.state()
        self.assertEqual(end["step"], 6)
        self.assertBitIdentical(end["residual"], ref_state["residual"],
                                "final residual")
        self.assertBitIdentical(end["velocity"], ref_state["velocity"],
                                "final velocity")
        # Without the state the run differs (the test can tell).
        srv2 = self.start_servers(1, 1, **flags)
        c2 = gtopk.Client(srv2.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                          tls="off")
        self.addCleanup(c2.close)
        p2 = initial_params()
        c2.synchronize_parameters(p2)
        self.run_steps(c2, p2, 0, 3)
        c2.close()
        c2 = gtopk.Client(srv2.leader, N, rank=0, rpc_timeout=RPC_TIMEOUT,
                          tls="off")
        self.addCleanup(c2.close)
        c2.synchronize_parameters(p2)
        self.run_steps(c2, p2, 3, 6)
        self.assertIsNotNone(first_difference(p2, p_ref))


if __name__ == "__main__":
    unittest.main(verbosity=2)
