#!/usr/bin/python3
"""Tests of the time-to-accuracy harness, bench/tta/tta.py --quick (issue
43): real network namespaces, a 1 Gbit/s tc limit, torch DDP (fp32 and
PowerSGD rank 1) and gtopk (servers --apply=workers, Python workers) on the
wide MLP, a few dozen steps. Checks the harness, not the speed:

  * every method has evaluations whose steps and training times increase,
    accuracies in [0, 1] above chance by the end, a step split whose parts
    are >= 0 and a byte count per step (gtopk: far below DDP's);
  * the target is fp32 DDP's final accuracy minus the margin, and each
    run's time to target is the first evaluation at or above it (recomputed
    here from the evaluations), or None;
  * the DDP fp32 run's bytes on the wire are at least the dense all-reduce
    (so the run went through the links) and the PNG and JSON are written;
  * nothing is left behind (namespaces, processes).

Skips (exit 77) when not root, when namespaces cannot be made here, or when
python3-torch, gnuplot or the gtopk Python package are missing -- except
under CI=true, where a missing package is a failure.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import lowbw_test  # noqa: E402  (skip_reason's probes, leftovers)

HARNESS = os.path.join(ROOT, "bench", "tta", "tta.py")
BUILD_DIR = lowbw_test.BUILD_DIR
PYTHON = lowbw_test.PYTHON


def skip_reason():
    why = lowbw_test.skip_reason()
    if why:
        return why
    if not os.path.isdir(os.path.join(BUILD_DIR, "python", "gtopk")):
        msg = "the gtopk Python package is not built (make python)"
        if lowbw_test.IN_CI:
            print("FAIL under CI: " + msg)
            sys.exit(1)
        return msg
    return None


class TtaArgsTest(unittest.TestCase):
    """--mlp-width: not given to the script by default (its own 3072),
    512 under --quick unless given; a width under 1 refused (exit 2) with
    --quick too."""

    def parse(self, *argv):
        sys.path.insert(0, os.path.dirname(HARNESS))
        try:
            import tta  # noqa: E402
        finally:
            sys.path.pop(0)
        return tta.parse_args(list(argv))

    def test_mlp_width(self):
        self.assertIsNone(self.parse().mlp_width)
        self.assertEqual(self.parse("--quick").mlp_width, 512)
        self.assertEqual(self.parse("--quick", "--mlp-width", "3072").mlp_width,
                         3072)
        for argv in (["--mlp-width", "0"], ["--quick", "--mlp-width", "0"]):
            with self.assertRaises(SystemExit) as e:
                self.parse(*argv)
            self.assertEqual(e.exception.code, 2)


class TtaTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="gtopk-tta-test-")
        self.logs = os.path.join(self.tmp, "logs")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_quick_run(self):
        out_json = os.path.join(self.tmp, "tta.json")
        p = subprocess.Popen(
            [PYTHON, HARNESS, "--quick", "--build-dir", BUILD_DIR,
             "--log-dir", self.logs, "--out", out_json, "--plot-dir",
             self.tmp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        out, _ = p.communicate(timeout=900)
        self.assertEqual(p.returncode, 0, out)
        self.assertEqual(lowbw_test.namespaces("glbw%d-" % p.pid), [],
                         "namespaces left behind")
        self.assertEqual(lowbw_test.processes_mentioning(self.logs), [],
                         "processes left behind")
        with open(out_json) as f:
            doc = json.load(f)
        self.assertIn("tta.py", doc["command"])
        runs = {r["method"]: r for r in doc["runs"]}
        self.assertEqual(set(runs), {"ddp_fp32", "ddp_powersgd_r1",
                                     "gtopk_d0.01"})
        target = runs["ddp_fp32"]["final_accuracy"] - 0.005
        self.assertAlmostEqual(doc["target_accuracy"], target, places=9)
        for method, r in runs.items():
            evals = r["evals"]
            self.assertGreaterEqual(len(evals), 3, method)
            steps = [e["step"] for e in evals]
            times = [e["train_seconds"] for e in evals]
            self.assertEqual(steps, sorted(set(steps)), method)
            self.assertEqual(times, sorted(times), method)
            self.assertEqual(steps[0], 0, method)
            for e in evals:
                self.assertGreaterEqual(e["test_accuracy"], 0.0)
                self.assertLessEqual(e["test_accuracy"], 1.0)
            # Ten classes: a trained model is well above chance.
            self.assertGreater(r["final_accuracy"], 0.3, method)
            self.assertEqual(r["steps"], steps[-1] if r["capped"]
                             else r["planned_steps"], method)
            # The time to target is the first evaluation at or above it.
            first = next((e for e in evals
                          if e["test_accuracy"] >= target), None)
            self.assertEqual(r["time_to_target"],
                             first["train_seconds"] if first else None,
                             method)
            split = r["step_split_p50"]
            for key in ("compute", "selection", "communication", "other",
                        "step"):
                self.assertGreaterEqual(split[key], 0.0, (method, key))
        n = runs["ddp_fp32"]["n"]
        # --quick's MLP: 784 -> 512 -> 512 -> 10.
        self.assertEqual(n, 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)
        # The dense all-reduce crossed the links: a ring all-reduce sends
        # 2 (P - 1) / P of 4n bytes per worker per step.
        P = doc["config"]["workers"]
        self.assertGreater(runs["ddp_fp32"]["wire_tx_bytes_per_worker_per_step"],
                           0.9 * 2 * (P - 1) / P * 4 * n)
        self.assertLess(runs["gtopk_d0.01"]["sent_bytes_per_worker_per_step"],
                        0.05 * 4 * n)
        self.assertTrue(os.path.getsize(os.path.join(self.tmp,
                                                     "tta_1gbit.png")) > 0)


if __name__ == "__main__":
    why = skip_reason()
    if why:
        print("SKIP: " + why)
        sys.exit(77)
    unittest.main()
