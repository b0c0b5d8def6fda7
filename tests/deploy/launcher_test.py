#!/usr/bin/env python3
"""Tests of the local cluster launcher, deploy/local/gtopk_local.py.

Two groups:
  * LauncherMechanicsTest: the real gtopk-server with a stand-in trainer
    (tests/deploy/fake_worker.py) - success summary, a failing worker, a
    checksum mismatch, Ctrl-C; runs wherever the server is built.
  * TrainingTest: the real gtopk-worker on a small slice of Fashion-MNIST -
    end to end (loss falls, accuracy far above chance, replicas identical),
    gtopk at density 1.0 == dense S-SGD bit for bit, a worker killed with
    SIGKILL mid-run. Skipped (with the reason) when gtopk-worker was not
    built, which happens when libtorch-dev is missing - except under CI
    (env CI=true), where that is a failure.
  * PythonWorkerTest: --worker=python, the PyTorch example
    (examples/pytorch/train_fashion_mnist.py) on the gtopk Python package,
    trains the same slice bit-identically to gtopk-worker. Skipped like
    TrainingTest when the package (BUILD_DIR/python) or torch for
    /usr/bin/python3 is missing.

The build directory comes from GTOPK_BUILD_DIR (ctest sets it), else build/.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCHER = os.path.join(ROOT, "deploy", "local", "gtopk_local.py")
FAKE_WORKER = os.path.join(HERE, "fake_worker.py")
BUILD_DIR = os.path.abspath(os.environ.get("GTOPK_BUILD_DIR",
                                           os.path.join(ROOT, "build")))
SERVER_BIN = os.path.join(BUILD_DIR, "server", "gtopk-server")
WORKER_BIN = os.path.join(BUILD_DIR, "worker", "gtopk-worker")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PYTHON_PACKAGE = os.path.join(BUILD_DIR, "python", "gtopk")
WORKER_PYTHON = "/usr/bin/python3"  # Debian's, with python3-torch


def python_worker_missing():
    """Why --worker=python cannot run here (None when it can)."""
    if not os.access(WORKER_BIN, os.X_OK):
        return "gtopk-worker not built at %s" % WORKER_BIN
    if not os.path.isdir(PYTHON_PACKAGE) or not any(
            f.startswith("_gtopk") and f.endswith(".so")
            for f in os.listdir(PYTHON_PACKAGE)):
        return "the gtopk Python package is not built in %s (make python)" \
            % PYTHON_PACKAGE
    if subprocess.run([WORKER_PYTHON, "-c", "import torch"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                      ).returncode != 0:
        return "%s cannot import torch (python3-torch)" % WORKER_PYTHON
    return None


try:
    PYTHON_WORKER_MISSING = python_worker_missing()
except OSError as e:  # no /usr/bin/python3
    PYTHON_WORKER_MISSING = str(e)
STEP_RE = re.compile(r"^step (\d+)/(\d+) epoch (\d+) loss (\S+)", re.M)


def alive(pid):
    """True if pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_mentioning(text):
    """PIDs (not this one) whose command line contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmd and alive(int(entry)):
            found.append((int(entry), cmd))
    return found


class LauncherCase(unittest.TestCase):
    def setUp(self):
        if not os.access(SERVER_BIN, os.X_OK):
            self.fail("gtopk-server not built at %s (set GTOPK_BUILD_DIR)"
                      % SERVER_BIN)
        self.tmp = tempfile.TemporaryDirectory(prefix="gtopk-launcher-test-")
        self.runs = self.tmp.name
        self.addCleanup(self.tmp.cleanup)

    def argv(self, name, *extra, worker_bin=None):
        argv = [sys.executable, LAUNCHER, "--name", name, "--build-dir",
                BUILD_DIR, "--runs-dir", self.runs, "--grace", "10",
                "--step-timeout", "20s"]
        if worker_bin:
            argv += ["--worker-bin", worker_bin]
        return argv + list(extra)

    def launch(self, name, *extra, worker_bin=None, env=None, timeout=300):
        e = dict(os.environ)
        e.update(env or {})
        r = subprocess.run(self.argv(name, *extra, worker_bin=worker_bin),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, env=e, timeout=timeout,
                           text=True)
        return r.returncode, r.stdout

    def run_dir(self, name):
        return os.path.join(self.runs, name)

    def load(self, name, file):
        with open(os.path.join(self.run_dir(name), file)) as f:
            return json.load(f)

    def assert_nothing_left(self, name):
        pids = self.load(name, "pids.json")
        everything = pids["servers"] + pids["workers"]
        self.assertTrue(everything)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(map(alive, everything)):
            time.sleep(0.1)
        self.assertEqual([p for p in everything if alive(p)], [],
                         "processes of run %s still alive" % name)
        self.assertEqual(processes_mentioning(self.run_dir(name)), [])


class LauncherMechanicsTest(LauncherCase):
    """Real servers, a stand-in trainer: the launcher's process handling."""

    COMMON = ("--workers", "3", "--shards", "2", "--model", "mlp")

    def test_success_writes_merged_summary(self):
        code, out = self.launch("ok", *self.COMMON, "--steps", "12",
                                worker_bin=FAKE_WORKER)
        self.assertEqual(code, 0, out)
        self.assertIn("step 12/12", out)
        s = self.load("ok", "summary.json")
        for key in ("mode", "workers", "shards", "model", "n", "density",
                    "selector", "epochs", "steps", "test_accuracy",
                    "final_loss", "wall_seconds", "step_seconds_p50",
                    "sent_bytes_per_worker_per_step",
                    "dense_bytes_per_worker_per_step",
                    "replica_checksums_match", "command"):
            self.assertIn(key, s)
        self.assertEqual((s["workers"], s["shards"], s["steps"]), (3, 2, 12))
        self.assertTrue(s["replica_checksums_match"])
        self.assertEqual(s["server_exit_codes"], [0, 0])
        self.assertEqual(len(s["per_rank"]), 3)
        self.assertEqual(s["sent_fraction_of_dense"], 80 / 4000)
        # Servers got the same cluster flags and every peer, on loopback.
        for shard in (0, 1):
            with open(os.path.join(self.run_dir("ok"),
                                   "server-%d.log" % shard)) as f:
                log = f.read()
            self.assertIn("--peers=127.0.0.1:", log)
            self.assertIn("--steps-per-epoch=625", log)  # 60000 / 3 / 32
            self.assertIn("--shard-id=%d" % shard, log)
        self.assert_nothing_left("ok")

    def test_failing_worker_fails_the_run(self):
        code, out = self.launch("fail", *self.COMMON, "--steps", "500",
                                worker_bin=FAKE_WORKER,
                                env={"FAKE_FAIL_RANK": "2",
                                     "FAKE_FAIL_AT": "3"})
        self.assertEqual(code, 1, out)
        self.assertRegex(out, r"worker 2 \(pid \d+\) failed \(exit code 3\)")
        self.assertIn("simulated failure at step 3", out)  # the log tail
        self.assertFalse(os.path.exists(
            os.path.join(self.run_dir("fail"), "summary.json")))
        self.assert_nothing_left("fail")

    def test_checksum_mismatch_is_reported(self):
        code, out = self.launch("skew", *self.COMMON, "--steps", "3",
                                worker_bin=FAKE_WORKER,
                                env={"FAKE_CHECKSUM_SKEW": "1"})
        self.assertEqual(code, 1, out)
        self.assertIn("replica checksums differ", out)
        self.assertFalse(self.load("skew", "summary.json")
                         ["replica_checksums_match"])

    def test_worker_differing_from_the_servers_fails_the_run(self):
        code, out = self.launch("serverskew", *self.COMMON, "--steps", "3",
                                worker_bin=FAKE_WORKER,
                                env={"FAKE_SERVER_SKEW": "1"})
        self.assertEqual(code, 1, out)
        self.assertRegex(out, r"worker 1 \(pid \d+\) failed \(exit code 1\)")
        self.assertIn("differ from the servers'", out)
        self.assertIn("FAILED", out)
        self.assert_nothing_left("serverskew")

    def test_sigint_stops_everything(self):
        p = subprocess.Popen(
            self.argv("int", *self.COMMON, "--steps", "100000",
                      worker_bin=FAKE_WORKER),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            pids_path = os.path.join(self.run_dir("int"), "pids.json")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if os.path.exists(pids_path) and \
                        len(self.load("int", "pids.json")["workers"]) == 3:
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            out, _ = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 130, out)
        self.assertIn("SIGINT received", out)
        self.assert_nothing_left("int")

    def test_bad_arguments(self):
        code, out = self.launch("bad", "--workers", "4", "--batch-size",
                                "64", "--train-limit", "100",
                                worker_bin=FAKE_WORKER)
        self.assertEqual(code, 2, out)
        self.assertIn("steps per epoch", out)
        code, out = self.launch("nobin", worker_bin="/nonexistent/worker")
        self.assertEqual(code, 2, out)
        self.assertIn("not found", out)


@unittest.skipIf(not os.access(WORKER_BIN, os.X_OK) and not IN_CI,
                 "gtopk-worker not built at %s (libtorch-dev missing?); "
                 "the trainer tests need it" % WORKER_BIN)
class TrainingTest(LauncherCase):
    """The real trainer on a small slice of Fashion-MNIST."""

    SLICE = ("--model", "mlp", "--train-limit", "4096", "--test-limit",
             "1000", "--batch-size", "32")

    def setUp(self):
        super().setUp()
        self.assertTrue(os.access(WORKER_BIN, os.X_OK),
                        "CI is set but gtopk-worker was not built at %s"
                        % WORKER_BIN)

    def test_end_to_end_small_slice(self):
        code, out = self.launch(
            "e2e", *self.SLICE, "--workers", "2", "--shards", "2",
            "--mode", "gtopk", "--density", "0.01", "--steps", "40",
            "--lr", "0.1", "--momentum", "0.9", "--seed", "1")
        self.assertEqual(code, 0, out)
        with open(os.path.join(self.run_dir("e2e"), "worker-0.log")) as f:
            losses = [float(m.group(4)) for m in STEP_RE.finditer(f.read())]
        self.assertGreaterEqual(len(losses), 30, out)
        first = sum(losses[:5]) / 5
        last = sum(losses[-5:]) / 5
        self.assertLess(last, 0.8 * first, "loss did not fall: %s" % losses)
        s = self.load("e2e", "summary.json")
        self.assertEqual(s["steps"], 40)
        self.assertGreater(s["test_accuracy"], 0.5)  # chance is 0.1
        self.assertTrue(s["replica_checksums_match"], s)
        self.assertLess(s["sent_bytes_per_worker_per_step"],
                        s["dense_bytes_per_worker_per_step"])
        self.assert_nothing_left("e2e")

    def test_defaults_train_the_default_model(self):
        """The launcher with its own defaults (the cnn, P = 4, S = 2,
        density 0.001 without warm-up, DGC momentum 0.9) trains: at the
        servers' lr of 0.1 this run went NaN at step 101 (the launcher's
        default is deploy/cluster.env's 0.05)."""
        code, out = self.launch("defaults", "--steps", "110",
                                "--test-limit", "1000", "--prometheus",
                                "off")
        self.assertEqual(code, 0, out)
        s = self.load("defaults", "summary.json")
        self.assertEqual((s["steps"], s["workers"], s["shards"]),
                         (110, 4, 2))
        self.assertTrue(math.isfinite(s["final_loss"]), s)
        self.assertGreater(s["test_accuracy"], 0.5)  # chance is 0.1
        self.assertTrue(s["replica_checksums_match"], s)

    def test_gtopk_density_one_equals_dense(self):
        # Global momentum (DGC's local correction and masking differ from
        # dense S-SGD by design) and fp32 values: with k = n the sparse sum
        # adds the same values in the same rank order as the dense sum, so
        # the parameters must be bit-identical.
        common = self.SLICE + ("--workers", "2", "--shards", "2", "--steps",
                               "12", "--density", "1.0", "--momentum-mode",
                               "global", "--index-codec", "delta-varint",
                               "--value-codec", "fp32", "--seed", "7")
        checksums = {}
        for mode in ("gtopk", "dense"):
            code, out = self.launch(mode, *common, "--mode", mode)
            self.assertEqual(code, 0, out)
            s = self.load(mode, "summary.json")
            self.assertTrue(s["replica_checksums_match"], s)
            checksums[mode] = s["param_checksums"][0]
            # runs/NAME/training.png (issue 43): the dense run is drawn
            # beside the gtopk one that exists by then, sparse first.
            with open(s["training_png"], "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertEqual(s["training_png"], os.path.join(
                self.run_dir(mode), "training.png"))
            self.assertIn("training plot   " + s["training_png"], out)
        self.assertEqual(checksums["gtopk"], checksums["dense"])
        self.assertEqual(self.load("gtopk", "summary.json")[
            "training_png_runs"], ["gtopk (gtopk)"])
        self.assertEqual(self.load("dense", "summary.json")[
            "training_png_runs"], ["gtopk (gtopk)", "dense (dense)"])

    def test_synthetic_epochs_follow_the_servers_warmup(self):
        # synthetic:N has no data epoch: the worker takes the servers'
        # --steps-per-epoch (the launcher's floor(60000 / 2 / 32) = 937), so
        # their density warm-up epochs match, and --steps is the run length
        # (it used to be the epoch length too, with a mismatch warning).
        code, out = self.launch(
            "synthetic", "--model", "synthetic:1000", "--workers", "2",
            "--shards", "1", "--steps", "12", "--epochs", "1",
            "--density-warmup", "0.5", "--density", "0.01")
        self.assertEqual(code, 0, out)
        for rank in (0, 1):
            w = self.load("synthetic", "worker-%d.json" % rank)
            self.assertEqual(w["steps"], 12)
            self.assertEqual(w["steps_per_epoch"], 60000 // 2 // 32)
            self.assertEqual(len(w["per_step"]["step_seconds"]), 12)
            self.assertEqual(len(w["per_step"]["communication_seconds"]), 12)
            # The client's phases (for the GPU step profile, issue 16):
            # one number per step, and local_seconds is their sum.
            per = w["per_step"]
            for phase in ("accumulate", "select", "encode", "push", "wait",
                          "apply"):
                self.assertEqual(len(per[phase + "_seconds"]), 12, phase)
            for i in range(12):
                self.assertAlmostEqual(
                    per["local_seconds"][i],
                    per["accumulate_seconds"][i] + per["select_seconds"][i]
                    + per["encode_seconds"][i] + per["apply_seconds"][i],
                    delta=1e-6)
                self.assertLessEqual(per["push_seconds"][i] +
                                     per["wait_seconds"][i],
                                     per["communication_seconds"][i] + 1e-6)
            # Warm-up density 0.5 for the whole run: k = 500 of n = 1000.
            self.assertGreaterEqual(w["sent_bytes_per_step"], 500 * 4)
            with open(os.path.join(self.run_dir("synthetic"),
                                   "worker-%d.log" % rank)) as f:
                self.assertNotIn("differs from", f.read())
        self.assert_nothing_left("synthetic")

    def test_device_reaches_the_workers(self):
        # --device is passed to every worker: with Debian's CPU-only
        # libtorch, --device=cuda (also for synthetic:N) fails at the
        # worker's start, naming why, and fails the run.
        code, out = self.launch("device", "--model", "synthetic:1000",
                                "--workers", "1", "--shards", "1", "--steps",
                                "2", "--device", "cuda")
        self.assertEqual(code, 1, out)
        self.assertIn("FAILED_PRECONDITION", out)
        self.assertIn("--device=cuda", out)
        self.assert_nothing_left("device")

    def test_cpu_isa_portable_pins_the_kernels(self):
        # Issue 13, part 7: libtorch picks CPU kernels by the CPU it finds
        # (ATen's AVX2/AVX-512 dispatch, oneDNN's instruction set for the
        # convolutions), so the demo's figures differed on another machine.
        # Other CPUs are emulated here with the variables those libraries
        # read to choose (both settings run on any CPU with AVX2). Native:
        # the settings give different parameters; --cpu-isa=portable (the
        # default) pins them: bit-identical whatever the environment says.
        emulated = {
            "a": {"ATEN_CPU_CAPABILITY": "default",
                  "ONEDNN_MAX_CPU_ISA": "SSE41"},
            "b": {"ATEN_CPU_CAPABILITY": "avx2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2"},
        }
        common = ("--model", "cnn", "--train-limit", "640", "--test-limit",
                  "100", "--workers", "1", "--shards", "1", "--steps", "5",
                  "--density", "0.01", "--seed", "3")
        checksums = {}
        for isa in ("native", "portable"):
            for cpu, env in emulated.items():
                name = "%s-%s" % (isa, cpu)
                code, out = self.launch(name, *common, "--cpu-isa", isa,
                                        env=env)
                self.assertEqual(code, 0, out)
                s = self.load(name, "summary.json")
                self.assertTrue(s["replica_checksums_match"], s)
                checksums[name] = s["param_checksums"][0]
                self.assertEqual(self.load(name, "worker-0.json")["cpu_isa"],
                                 isa)
        self.assertNotEqual(checksums["native-a"], checksums["native-b"],
                            "the emulated CPUs no longer change the kernels: "
                            "this test shows nothing (%s)" % checksums)
        self.assertEqual(checksums["portable-a"], checksums["portable-b"],
                         checksums)

    def test_killed_worker_fails_the_run_and_leaves_nothing(self):
        p = subprocess.Popen(
            self.argv("kill", *self.SLICE, "--workers", "2", "--shards", "2",
                      "--density", "0.01", "--epochs", "50"),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            log0 = os.path.join(self.run_dir("kill"), "worker-0.log")
            deadline = time.monotonic() + 60
            steps = 0
            while time.monotonic() < deadline and p.poll() is None:
                try:
                    with open(log0) as f:
                        steps = len(STEP_RE.findall(f.read()))
                except OSError:
                    pass
                if steps >= 3:
                    break
                time.sleep(0.1)
            self.assertGreaterEqual(steps, 3, "no progress before the kill")
            victim = self.load("kill", "pids.json")["workers"][1]
            os.kill(victim, signal.SIGKILL)
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 1, out)
        self.assertRegex(out, r"worker 1 \(pid %d\) failed \(killed by SIGKILL\)"
                         % victim)
        self.assertIn("last lines of", out)
        self.assertIn("--rank=1", out)  # the tail of worker-1.log
        self.assert_nothing_left("kill")


@unittest.skipIf(PYTHON_WORKER_MISSING is not None and not IN_CI,
                 "--worker=python: %s" % PYTHON_WORKER_MISSING)
class PythonWorkerTest(LauncherCase):
    """--worker=python: the PyTorch example instead of gtopk-worker."""

    def setUp(self):
        super().setUp()
        self.assertIsNone(PYTHON_WORKER_MISSING,
                          "CI is set but --worker=python cannot run")

    def test_python_workers_train_like_gtopk_worker(self):
        # The example's CNN has gtopk-worker's architecture, initialisation,
        # data order and normalisation, and --cpu-isa=portable pins the same
        # kernels in the same libtorch: the two kinds of worker must end
        # bit-identical, with the same progress lines.
        common = ("--model", "cnn", "--train-limit", "1280", "--test-limit",
                  "300", "--workers", "2", "--shards", "2", "--steps", "12",
                  "--density", "0.01", "--seed", "5")
        summaries, lines = {}, {}
        # The caller's GTOPK_TLS* environment must not reach the workers:
        # their security is the launcher's --tls (a stray token file or
        # mode would fail or be sent).
        stray = {"GTOPK_TOKEN_FILE": "/nonexistent/token",
                 "GTOPK_TLS": "server", "GTOPK_TLS_CA": "/nonexistent/ca"}
        for worker in ("cpp", "python"):
            code, out = self.launch(worker, *common, "--worker", worker,
                                    env=stray)
            self.assertEqual(code, 0, out)
            self.assertIn("step 12/12", out)
            s = self.load(worker, "summary.json")
            self.assertTrue(s["replica_checksums_match"], s)
            self.assertEqual(s["worker"], worker)
            # Both kinds of worker over mutual TLS (the default).
            self.assertEqual(s["tls"], "mutual")
            with open(os.path.join(self.run_dir(worker),
                                   "worker-0.log")) as f:
                self.assertNotIn("WARNING: --tls=off", f.read())
            summaries[worker] = s
            with open(os.path.join(self.run_dir(worker),
                                   "worker-0.log")) as f:
                lines[worker] = [
                    re.sub(r" (samples/s|step_ms|wall_seconds) \S+", "", l)
                    for l in f.read().splitlines()
                    if re.match(r"(step|eval|done) ", l)]
            self.assert_nothing_left(worker)
        cpp, py = summaries["cpp"], summaries["python"]
        self.assertEqual(py["param_checksums"], cpp["param_checksums"])
        self.assertEqual(py["test_accuracy"], cpp["test_accuracy"])
        self.assertEqual(lines["python"], lines["cpp"])
        self.assertEqual(len(lines["python"]), 12 + 2)  # steps, eval, done
        # The same summary keys (the example adds "worker": "python").
        for c, p in zip(cpp["per_rank"], py["per_rank"]):
            self.assertEqual(set(p) - {"worker"}, set(c))
            self.assertEqual(set(p["per_step"]), set(c["per_step"]))
            self.assertEqual(p["sent_bytes_per_step"],
                             c["sent_bytes_per_step"])

    def test_python_worker_refuses_synthetic(self):
        code, out = self.launch("syn", "--worker", "python", "--model",
                                "synthetic:100")
        self.assertEqual(code, 2, out)
        self.assertIn("--worker=python trains --model=cnn or mlp", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
