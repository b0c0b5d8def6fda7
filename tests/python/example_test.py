#!/usr/bin/env python3
"""End to end: the PyTorch example (examples/pytorch/train_fashion_mnist.py)
on a slice of Fashion-MNIST (ctest python_example_test, labels python and
integration).

  * EnvironmentTest: P = 2 copies of the script, configured only through
    the environment a torchrun / Kubernetes job gives (GTOPK_LEADER, RANK,
    WORLD_SIZE; JOB_COMPLETION_INDEX), against two gtopk-server shards
    started here: both exit 0, their summaries agree with each other and
    with the servers (param_checksum == server_checksum), and the run
    learned (accuracy above chance).
  * MakeDemoTest: `make demo WORKER=python` (the README's command) on a
    slice: the Makefile builds the package and the launcher runs the
    example; runs/<NAME>/summary.json says every replica is identical.

Needs the built package (BUILD_DIR/python), python3-torch for
/usr/bin/python3 and dataset-fashion-mnist; missing pieces fail the test
(they are installed by `make deps`).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_util as cu  # noqa: E402

EXAMPLE = os.path.join(cu.REPO, "examples", "pytorch",
                       "train_fashion_mnist.py")
PYTHON = "/usr/bin/python3"  # Debian's, with python3-torch
DATA_DIR = "/usr/share/datasets/fashion-mnist"


class EnvironmentTest(unittest.TestCase):
    def test_two_ranks_from_the_environment(self):
        tmp = tempfile.mkdtemp(prefix="gtopk_example_")
        try:
            # Mutual TLS, as `make demo` runs: the worker's security flags
            # from the environment (GTOPK_TLS*), as a Kubernetes Job sets.
            tls = cu.make_certs(os.path.join(tmp, "tls"), 2, 2)
            with cu.Servers(num_shards=2, workers=2, log_dir=tmp,
                            tls_dir=tls, mode="gtopk", density=0.01, lr=0.05,
                            momentum=0.9, steps_per_epoch=20) as srv:
                procs = []
                for rank in range(2):
                    env = cu.python_env()
                    env["GTOPK_LEADER"] = srv.leader
                    env["WORLD_SIZE"] = "2"
                    env["GTOPK_TLS"] = "mutual"
                    env["GTOPK_TLS_CERT"] = os.path.join(
                        tls, "worker-%d.crt" % rank)
                    env["GTOPK_TLS_KEY"] = os.path.join(
                        tls, "worker-%d.key" % rank)
                    env["GTOPK_TLS_CA"] = os.path.join(tls, "ca.crt")
                    # Rank 0 as torchrun names it, rank 1 as an indexed
                    # Kubernetes Job does.
                    env.pop("RANK", None)
                    env.pop("JOB_COMPLETION_INDEX", None)
                    if rank == 0:
                        env["RANK"] = "0"
                    else:
                        env["JOB_COMPLETION_INDEX"] = "1"
                    procs.append(cu.Proc(
                        [PYTHON, EXAMPLE, "--epochs", "2",
                         "--train-limit", "1280", "--test-limit", "500",
                         "--summary-json",
                         os.path.join(tmp, "rank%d.json" % rank)],
                        os.path.join(tmp, "rank%d.log" % rank), env=env))
                cu.wait_all(procs, timeout=240, what="example")
            summaries = []
            for rank in range(2):
                with open(os.path.join(tmp, "rank%d.json" % rank)) as f:
                    summaries.append(json.load(f))
            for rank, s in enumerate(summaries):
                self.assertEqual(s["rank"], rank)
                self.assertEqual(s["workers"], 2)
                self.assertEqual(s["shards"], 2)
                self.assertEqual(s["steps"], 40)  # 1280 / 2 / 32 x 2 epochs
                self.assertEqual(s["param_checksum"], s["server_checksum"])
            self.assertEqual(summaries[0]["param_checksum"],
                             summaries[1]["param_checksum"])
            # 40 steps of 64 samples: well above chance (0.1).
            self.assertGreater(summaries[0]["test_accuracy"], 0.4)
            self.assertLess(summaries[0]["sent_bytes_per_step"],
                            summaries[0]["dense_bytes_per_step"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class MakeDemoTest(unittest.TestCase):
    def test_make_demo_worker_python(self):
        runs = tempfile.mkdtemp(prefix="gtopk_demo_")
        try:
            cmd = ["make", "--no-print-directory", "-C", cu.REPO, "demo",
                   "WORKER=python", "BUILD_DIR=%s" % cu.BUILD_DIR,
                   "NAME=pytest", "WORKERS=2", "SHARDS=1", "EPOCHS=1",
                   "STEPS=12", "JOBS=1",
                   # ctest runs after the build: a build from here would
                   # relink gtopk-worker while other tests run it (a stale
                   # tree failed six of them, "Permission denied").
                   "DEMO_BUILD=no",
                   "BUILD_TYPE=%s" % (os.environ.get("GTOPK_BUILD_TYPE")
                                      or "Release"),
                   "DEMO_ARGS=--train-limit 1024 --test-limit 200 "
                   "--runs-dir %s --prometheus off" % runs]
            r = subprocess.run(cmd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               timeout=400, preexec_fn=cu.child_setup)
            self.assertEqual(r.returncode, 0, r.stdout[-6000:])
            with open(os.path.join(runs, "pytest", "summary.json")) as f:
                summary = json.load(f)
            self.assertTrue(summary["replica_checksums_match"], summary)
            self.assertEqual(summary["workers"], 2)
            self.assertEqual(summary["steps"], 12)
            self.assertIn("replicas identical (workers and servers): yes",
                          r.stdout)
        finally:
            shutil.rmtree(runs, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
