"""Ctrl-C during a blocking gtopk call: KeyboardInterrupt within 1 s,
nothing applied, no thread left, the process exits.

Each case runs interrupt_child.py in its own process group with SIGINT at
its default disposition (a background shell ignores SIGINT, and a Python
started with SIGINT ignored would never raise KeyboardInterrupt), waits
for its "blocking <case>" line, sends SIGINT about 1 s later and checks
the child's JSON report:
  join      Client() while the leader is not started (Join waits up to
            rpc_timeout = 60 s);
  download  synchronize_parameters() of rank 1 while rank 0 never
            initialises (servers' --step-timeout=60s);
  step      step() of rank 0 of a P = 2 cluster whose rank 1 never comes
            (--step-timeout=60s): the residual then still holds lr * g and
            next_step is 0;
  recover   recover() after a failed step while the leader is down
            (timeout 60 s);
  step, uncaught  as step, but the script does not catch the
            KeyboardInterrupt: the process ends (killed by SIGINT, as
            Python does) within a few seconds.

Run: PYTHONPATH=build/python GTOPK_BUILD_DIR=build /usr/bin/python3
tests/python/interrupt_test.py  (ctest -R python_interrupt_test).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cluster_util as cu  # noqa: E402

N = 4000
CHILD = os.path.join(HERE, "interrupt_child.py")
SIGNAL_AFTER = 1.0    # seconds after "blocking"
PROMPT = 1.0          # KeyboardInterrupt within this of the signal
EXIT_WITHIN = 5.0     # the process is gone within this of the signal


def now():
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Child:
    """interrupt_child.py with its stdout lines in a queue."""

    def __init__(self, leader, case, log_path, extra=()):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, leader, str(N), case] + list(extra),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            preexec_fn=cu.child_setup, close_fds=True, env=cu.python_env())
        self.lines = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.decode("utf-8", "replace").rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix, timeout):
        deadline = now() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - now()))
            except queue.Empty:
                raise AssertionError("no %r from the child in %.0f s (%s)"
                                     % (prefix, timeout, self.stderr()))
            if line is None:
                raise AssertionError("the child exited (%s) before %r: %s"
                                     % (self.proc.poll(), prefix,
                                        self.stderr()))
            if line.startswith(prefix):
                return line

    def stderr(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()


class InterruptTest(cu.KeepLogsOnFailure, unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk_int_")
        self.to_stop = []
        self.addCleanup(self._stop_all)

    def _stop_all(self):
        for x in reversed(self.to_stop):
            x.kill() if isinstance(x, Child) else x.stop()

    def servers(self, step_timeout):
        s = cu.Servers(1, 2, self.dir, mode="gtopk", density=0.01,
                       step_timeout=step_timeout)
        self.to_stop.append(s)
        return s.start()

    def interrupt(self, leader, case, before_block=None):
        child = Child(leader, case, os.path.join(self.dir, case + ".log"))
        self.to_stop.append(child)
        if before_block is not None:
            before_block(child)
        child.expect("blocking", 60)
        time.sleep(SIGNAL_AFTER)
        self.assertIsNone(child.proc.poll(),
                          "the child exited before the signal: "
                          + child.stderr())
        sent = now()
        os.kill(child.proc.pid, signal.SIGINT)
        line = child.expect("{", EXIT_WITHIN + 10)
        try:
            code = child.proc.wait(max(0.1, sent + EXIT_WITHIN - now()))
        except subprocess.TimeoutExpired:
            self.fail("the child still runs %.0f s after SIGINT" %
                      EXIT_WITHIN)
        exited = now() - sent
        report = json.loads(line)
        sys.stderr.write("  %s: KeyboardInterrupt %.3f s after SIGINT, "
                         "process gone after %.2f s, %s\n" % (
                             case, report.get("caught_at", sent) - sent,
                             exited, line))
        self.assertEqual(code, 0, "%s\n%s" % (line, child.stderr()))
        self.assertTrue(report.get("interrupted"), line)
        delay = report["caught_at"] - sent
        self.assertGreaterEqual(delay, 0.0, "the call ended before SIGINT")
        self.assertLess(delay, PROMPT,
                        "KeyboardInterrupt %.2f s after SIGINT" % delay)
        self.assertGreater(report["elapsed"], SIGNAL_AFTER * 0.9)
        self.assertEqual(report["threads"], 1, line)
        self.assertEqual(report["threads_after_close"], 1, line)
        # The call's helper thread and the client's step threads are gone
        # (at most 1 s after the interrupt): of the OS threads not named by
        # gRPC, only the main thread is left (gRPC's own threads end on its
        # schedule, not checked).
        self.assertEqual(report["os_threads_settled"], 1, line)
        self.assertEqual(report["os_threads_after"], 1, line)
        self.assertLess(exited, EXIT_WITHIN)
        return report

    def test_join(self):
        port = cu.free_ports(1)[0]
        self.interrupt("%s:%d" % (cu.LOOPBACK, port), "join")

    def test_download(self):
        srv = self.servers("60s")
        r = self.interrupt(srv.leader, "download")
        self.assertTrue(r["residual_is_zero"])

    def test_step(self):
        srv = self.servers("60s")
        r = self.interrupt(srv.leader, "step")
        self.assertEqual(r["next_step"], 0)
        self.assertEqual(r["state_step"], 0)
        self.assertTrue(r["residual_is_lr_g"], r)
        self.assertNotEqual(r["residual_sum"], 0.0)
        self.assertTrue(r["params_unchanged"], r)

    def test_step_uncaught(self):
        # A user's script on Ctrl-C: the KeyboardInterrupt is not caught and
        # the client not closed; the interpreter must still end promptly
        # (no thread keeps it alive), killed by SIGINT as Python does.
        srv = self.servers("60s")
        child = Child(srv.leader, "step",
                      os.path.join(self.dir, "uncaught.log"), ["uncaught"])
        self.to_stop.append(child)
        child.expect("blocking", 60)
        time.sleep(SIGNAL_AFTER)
        self.assertIsNone(child.proc.poll(), child.stderr())
        sent = now()
        os.kill(child.proc.pid, signal.SIGINT)
        try:
            code = child.proc.wait(EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            self.fail("the child still runs %.0f s after SIGINT: %s"
                      % (EXIT_WITHIN, child.stderr()))
        sys.stderr.write("  uncaught: process gone %.2f s after SIGINT, "
                         "code %d\n" % (now() - sent, code))
        self.assertEqual(code, -signal.SIGINT, child.stderr())
        self.assertIn("KeyboardInterrupt", child.stderr())

    def test_recover(self):
        srv = self.servers("1s")

        def kill_servers(child):
            child.expect("step failed", 60)
            srv.stop()
            child.proc.stdin.write(b"go\n")
            child.proc.stdin.flush()

        r = self.interrupt(srv.leader, "recover", before_block=kill_servers)
        self.assertEqual(r["next_step"], 0)
        self.assertTrue(r["residual_is_lr_g"], r)
        self.assertTrue(r["params_unchanged"], r)


if __name__ == "__main__":
    unittest.main(verbosity=2)
