#!/usr/bin/env python3
"""The modern recipe (examples/pytorch/train_modern.py: AdamW, warm-up +
cosine, clipping, bf16 autocast, a BatchNorm CNN) on a slice of
Fashion-MNIST (ctest python_modern_example_test, labels python and
integration).

  * DdpTest: two copies of the script under --backend ddp (gloo), with the
    environment torchrun gives (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE): both exit 0 and report the same test accuracy, parameter
    checksum and BatchNorm buffer checksum. Needs only python3-torch and
    dataset-fashion-mnist.
  * LauncherDdpTest: `gtopk_local.py --worker python-modern --mode ddp`
    (no servers): the merged summary says every rank's parameters and
    buffers are bit-identical.
  * LauncherGtopkTest: `gtopk_local.py --worker python-modern` with P = 2,
    S = 1 (servers --apply=workers, density 0.01): replicas and buffers
    bit-identical, fewer bytes than dense. Skipped, saying why, when
    gtopk-server or the Python package (with DistributedOptimizer's
    synchronize) is not built -- a failure instead when CI=true.
  * ChecksumTest: the script's own FNV-1a (used when gtopk is not
    importable) against the published test vectors and gtopk.checksum.

Each run takes well under a minute on 2 cores (512 training and 256 test
samples, one epoch).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_util as cu  # noqa: E402

SCRIPT = os.path.join(cu.REPO, "examples", "pytorch", "train_modern.py")
LAUNCHER = os.path.join(cu.REPO, "deploy", "local", "gtopk_local.py")
PYTHON = "/usr/bin/python3"  # Debian's, with python3-torch
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SLICE = ["--train-limit", "512", "--test-limit", "256", "--epochs", "1",
         "--warmup-steps", "2"]


def torch_missing():
    try:
        r = subprocess.run([PYTHON, "-c", "import torch, numpy"],
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "%s: %s" % (PYTHON, e)
    if r.returncode != 0:
        return "%s cannot import torch and numpy (python3-torch)" % PYTHON
    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        return "no /usr/share/datasets/fashion-mnist (dataset-fashion-mnist)"
    return None


def gtopk_missing():
    """Why the gtopk backend cannot run here (None when it can)."""
    if not os.access(cu.SERVER_BIN, os.X_OK):
        return "gtopk-server not built at %s" % cu.SERVER_BIN
    package = os.path.join(cu.PYTHON_DIR, "gtopk")
    if not os.path.isdir(package) or not any(
            f.startswith("_gtopk") and f.endswith(".so")
            for f in os.listdir(package)):
        return "the gtopk Python package is not built in %s (make python)" \
            % package
    # DistributedOptimizer(optimizer, ...) returns the workers-apply
    # wrapper (gtopk._workers_apply), which has synchronize().
    probe = ("import sys, gtopk.torch as t\n"
             "classes = [t.DistributedOptimizer]\n"
             "try:\n"
             "    from gtopk._workers_apply import "
             "GradientAggregationOptimizer as G\n"
             "    classes.append(G)\n"
             "except ImportError:\n"
             "    pass\n"
             "sys.exit(0 if any(hasattr(c, 'synchronize') and "
             "hasattr(c, 'skip_synchronize') for c in classes) else 3)\n")
    r = subprocess.run([PYTHON, "-c", probe], env=cu.python_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    if r.returncode == 3:
        return ("gtopk.torch.DistributedOptimizer has no synchronize() / "
                "skip_synchronize() (workers-apply API) in %s" % package)
    if r.returncode != 0:
        return "cannot import gtopk.torch from %s: %s" % (
            cu.PYTHON_DIR, r.stdout.strip().splitlines()[-1:])
    return None


TORCH_MISSING = torch_missing()
GTOPK_MISSING = TORCH_MISSING or gtopk_missing()


def load_script_module():
    spec = importlib.util.spec_from_file_location("train_modern", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MlpWidthTest(unittest.TestCase):
    """--mlp-width (bench/tta's --quick uses 512): the two hidden layers'
    width, the parameter count 785 w + w (w + 1) + 10 (w + 1); 0 refused
    at parse (exit 2, naming the flag)."""

    @unittest.skipIf(TORCH_MISSING is not None and not IN_CI,
                     "needs torch: %s" % TORCH_MISSING)
    def test_width_sets_the_hidden_layers(self):
        probe = (
            "import importlib.util\n"
            "s = importlib.util.spec_from_file_location('m', %r)\n"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "for w in (3072, 512, 7):\n"
            "    model = m.build_mlp(1, w)\n"
            "    print(w, [tuple(p.shape) for p in model.parameters()])\n"
            % SCRIPT)
        r = subprocess.run([PYTHON, "-c", probe], capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        for line in r.stdout.splitlines():
            w, shapes = line.split(" ", 1)
            w = int(w)
            self.assertEqual(shapes, str([(w, 784), (w,), (w, w), (w,),
                                          (10, w), (10,)]))
        # The default: 11,882,506 parameters (bench/tta's full runs).
        self.assertEqual(785 * 3072 + 3072 * 3073 + 10 * 3073, 11882506)

    def test_zero_width_is_refused(self):
        r = subprocess.run([PYTHON, SCRIPT, "--model=mlp",
                            "--mlp-width=0"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--mlp-width must be >= 1", r.stderr)
        r = subprocess.run([PYTHON, SCRIPT, "--model=cnn", "--mlp-width=7"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--mlp-width is for --model=mlp", r.stderr)


class ChecksumTest(unittest.TestCase):
    def test_fnv1a64_vectors(self):
        m = load_script_module()
        # FNV-1a 64-bit test vectors (Fowler/Noll/Vo).
        self.assertEqual(m.fnv1a64_hex(b""), "cbf29ce484222325")
        self.assertEqual(m.fnv1a64_hex(b"a"), "af63dc4c8601ec8c")
        self.assertEqual(m.fnv1a64_hex(b"foobar"), "85944171f73967e8")

    @unittest.skipIf(TORCH_MISSING is not None or not os.path.isdir(
        os.path.join(cu.PYTHON_DIR, "gtopk")),
        "needs numpy and the gtopk package (make python)")
    def test_fallback_equals_gtopk_checksum(self):
        probe = (
            "import importlib.util, numpy as np, gtopk\n"
            "s = importlib.util.spec_from_file_location('m', %r)\n"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "x = np.linspace(-3, 3, 1001, dtype=np.float32)\n"
            "a, b = gtopk.checksum(x), m.fnv1a64_hex(x.tobytes())\n"
            "assert a == b, (a, b)\n" % SCRIPT)
        r = subprocess.run([PYTHON, "-c", probe], env=cu.python_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
        if "No module named 'gtopk'" in r.stdout or \
                "cannot import" in r.stdout:
            self.skipTest("gtopk not importable: %s" % r.stdout[-300:])
        self.assertEqual(r.returncode, 0, r.stdout)


@unittest.skipIf(TORCH_MISSING is not None and not IN_CI,
                 "modern recipe: %s" % TORCH_MISSING)
class DdpTest(cu.KeepLogsOnFailure, unittest.TestCase):
    dir = ""  # a skipped test has no temp dir to remove

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk_modern_ddp_")

    def test_two_ranks_agree(self):
        port = cu.free_ports(1)[0]
        procs = []
        for rank in range(2):
            env = dict(os.environ)
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "RANK": str(rank), "WORLD_SIZE": "2",
                        "LOCAL_RANK": str(rank), "PYTHONUNBUFFERED": "1",
                        "PYTHONDONTWRITEBYTECODE": "1"})
            procs.append(cu.Proc(
                [PYTHON, SCRIPT, "--backend", "ddp"] + SLICE +
                ["--summary-json", os.path.join(self.dir, "r%d.json" % rank)],
                os.path.join(self.dir, "r%d.log" % rank), env=env))
        cu.wait_all(procs, timeout=300, what="ddp rank")
        s = []
        for rank in range(2):
            with open(os.path.join(self.dir, "r%d.json" % rank)) as f:
                s.append(json.load(f))
        for rank, r in enumerate(s):
            self.assertEqual(r["rank"], rank)
            self.assertEqual(r["backend"], "ddp")
            self.assertEqual(r["workers"], 2)
            self.assertEqual(r["steps"], 8)  # 512 / 2 / 32
            self.assertEqual(r["test_samples"], 256)
            self.assertRegex(r["params_checksum"], "^[0-9a-f]{16}$")
            self.assertRegex(r["buffers_checksum"], "^[0-9a-f]{16}$")
            self.assertEqual(r["autocast"], "bf16")
            self.assertIn("estimate", r["sent_bytes_source"])
        self.assertEqual(s[0]["test_accuracy"], s[1]["test_accuracy"])
        self.assertEqual(s[0]["params_checksum"], s[1]["params_checksum"])
        self.assertEqual(s[0]["buffers_checksum"], s[1]["buffers_checksum"])
        self.assertGreater(s[0]["test_accuracy"], 0.1)  # learned something


class LauncherCase(cu.KeepLogsOnFailure, unittest.TestCase):
    dir = ""  # a skipped test has no temp dir to remove

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gtopk_modern_launch_")

    def launch(self, name, *extra, timeout=300):
        argv = [sys.executable, LAUNCHER, "--name", name, "--runs-dir",
                self.dir, "--build-dir", cu.BUILD_DIR, "--worker",
                "python-modern", "--workers", "2", "--shards", "1",
                "--prometheus", "off"] + SLICE + list(extra)
        r = subprocess.run(argv, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout,
                           preexec_fn=cu.child_setup)
        summary = None
        path = os.path.join(self.dir, name, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        return r.returncode, r.stdout, summary

    def assert_identical(self, out, s):
        self.assertTrue(s["replica_checksums_match"], s["params_checksums"])
        self.assertTrue(s["buffers_match"], s["buffers_checksums"])
        self.assertTrue(s["test_accuracies_match"], s["test_accuracies"])
        self.assertIn("replicas identical (every rank's parameters): yes",
                      out)
        self.assertIn("buffers identical (every rank's BatchNorm "
                      "statistics): yes", out)
        self.assertEqual(s["steps"], 8)
        self.assertEqual(len(s["per_rank"]), 2)


@unittest.skipIf(TORCH_MISSING is not None and not IN_CI,
                 "modern recipe: %s" % TORCH_MISSING)
class LauncherDdpTest(LauncherCase):
    def test_launcher_ddp(self):
        code, out, s = self.launch("ddp", "--mode", "ddp")
        self.assertEqual(code, 0, out[-6000:])
        self.assert_identical(out, s)
        self.assertEqual(s["backend"], "ddp")
        self.assertEqual(s["shards"], 0)
        self.assertEqual(s["sent_fraction_of_dense"], 1.0)

    def test_bad_combinations_refused(self):
        code, out, _ = self.launch("bad1", "--mode", "ddp", "--worker",
                                   "python")
        self.assertEqual(code, 2, out)
        self.assertIn("--mode=ddp runs --worker=python-modern", out)
        code, out, _ = self.launch("bad2", "--worker", "cpp", "--clip", "1")
        self.assertEqual(code, 2, out)
        self.assertIn("--clip applies to --worker=python-modern only", out)


@unittest.skipIf(GTOPK_MISSING is not None and not IN_CI,
                 "gtopk backend: %s" % GTOPK_MISSING)
class LauncherGtopkTest(LauncherCase):
    def setUp(self):
        super().setUp()
        self.assertIsNone(GTOPK_MISSING,
                          "CI is set but the gtopk backend cannot run")

    def test_launcher_gtopk_workers_apply(self):
        code, out, s = self.launch("gtopk", "--mode", "gtopk", "--density",
                                   "0.01", "--selector", "exact")
        self.assertEqual(code, 0, out[-6000:])
        self.assert_identical(out, s)
        self.assertEqual(s["backend"], "gtopk")
        self.assertEqual(s["apply"], "workers")
        self.assertAlmostEqual(s["density"], 0.01)
        self.assertLess(s["sent_bytes_per_worker_per_step"],
                        s["dense_bytes_per_worker_per_step"])
        # The servers were told to aggregate only.
        with open(os.path.join(self.dir, "gtopk", "server-0.log")) as f:
            self.assertIn("--apply=workers", f.readline())


if __name__ == "__main__":
    unittest.main(verbosity=2)
