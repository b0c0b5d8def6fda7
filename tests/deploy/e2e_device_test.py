#!/usr/bin/env python3
"""What of the GPU end-to-end run (issue 16) can be checked without a GPU.

- The device scripts parse (bash -n).
- deploy/device/e2e_device.sh without a CUDA device: exit 3 at once, nothing
  built, and an e2e.json saying what nvidia-smi really did (not installed,
  failed with a status, printed nothing), with what did not run null, not
  false; every other early exit (no bundle, bad usage or setting) also
  writes e2e.json with the reason; --help prints the usage and exits 0.
- deploy/device/e2e_summary.py on canned launcher summaries: warm-up steps
  dropped, per-phase medians over steps then ranks, the two targets met or
  missed by the right figures, CPU/GPU ratios, replicas that differ
  flagged, ctest failures and skipped steps reported, what did not run
  (ctest, replica checks) null rather than false.
- deploy/device/device_bundle.py: the package list parses (and a bad line is
  an error naming it), `when=` follows the project's CMake files
  (find_package and pkg_check_modules, build folders skipped) and every
  conditional line is one the build uses today, and the CMake rewrite turns
  a Debian SHARED import into a STATIC one at the .a.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = os.path.join(ROOT, "deploy", "device")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(DEVICE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rank(checksum, compute, acc, sel, enc, push, wait, apply, steps=8):
    """A worker summary with constant phases except two slow warm-up steps."""
    def series(v):
        return [1.0, 1.0] + [v] * (steps - 2)  # warm-up outliers: 1 s
    per_step = {"step_seconds": series(compute + acc + sel + enc + push + wait + apply),
                "compute_seconds": series(compute), "accumulate_seconds": series(acc),
                "select_seconds": series(sel), "encode_seconds": series(enc),
                "push_seconds": series(push), "wait_seconds": series(wait),
                "apply_seconds": series(apply)}
    return {"rank": 0, "param_checksum": checksum, "server_checksum": checksum, "per_step": per_step}


def launcher_summary(ranks, match=True):
    return {"model": "synthetic:25557032", "n": 25557032, "selector": "exact", "mode": "gtopk",
            "density": 0.001, "workers": len(ranks), "shards": 2, "steps": 8,
            "sent_bytes_per_worker_per_step": 204456.0, "received_bytes_per_worker_per_step": 200000.0,
            "dense_bytes_per_worker_per_step": 102228128.0, "replica_checksums_match": match,
            "param_checksums": [r["param_checksum"] for r in ranks],
            "server_checksums": [r["server_checksum"] for r in ranks], "per_rank": ranks}


class ScriptsTest(unittest.TestCase):
    def test_scripts_parse(self):
        for script in ("e2e_device.sh", "bundle_check.sh", "device_check.sh"):
            r = subprocess.run(["bash", "-n", os.path.join(DEVICE, script)], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, script + ": " + r.stderr)

    QUERY = "--query-gpu=name,driver_version,memory.total --format=csv,noheader"

    def run_script(self, d, args=(), nvidia_smi=None, **env_extra):
        """e2e_device.sh with OUT, BUILD_DIR and BUNDLE in d; nvidia_smi: the
        body of a fake nvidia-smi script in d (None: a path that does not
        exist). Returns (CompletedProcess, e2e.json or None)."""
        smi = os.path.join(d, "no-nvidia-smi")
        if nvidia_smi is not None:
            smi = os.path.join(d, "nvidia-smi")
            with open(smi, "w") as f:
                f.write("#!/bin/sh\n" + nvidia_smi)
            os.chmod(smi, 0o755)
        env = dict(os.environ, OUT=os.path.join(d, "out"), BUILD_DIR=os.path.join(d, "build"),
                   BUNDLE=os.path.join(d, "no-bundle"), NVIDIA_SMI=smi, **env_extra)
        r = subprocess.run(["bash", os.path.join(DEVICE, "e2e_device.sh")] + list(args), cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertFalse(os.path.exists(os.path.join(d, "build")), "built: " + r.stdout)
        path = os.path.join(d, "out", "e2e.json")
        if not os.path.exists(path):
            return r, None
        with open(path) as f:
            return r, json.load(f)

    def assert_nothing_ran(self, result):
        self.assertEqual(result["runs"], {})
        self.assertEqual({t["status"] for t in result["targets"]}, {"not measured"})
        # Not run is not a failure: null, not false.
        self.assertIsNone(result["replicas_identical_all"])
        self.assertIsNone(result["ctest_gpu_passed"])
        self.assertIsNone(result["ctest_gpu"])

    def test_no_gpu_exits_3_with_reason(self):
        with tempfile.TemporaryDirectory() as d:
            r, result = self.run_script(d)
            self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
            self.assertIn("no CUDA device", r.stdout)
            self.assertIsNotNone(result, "no e2e.json")
            self.assertIs(result["available"], False)
            self.assertIn("no CUDA device", result["reason"])
            self.assertIn("not installed", result["reason"])
            self.assertIn(os.path.join(d, "no-nvidia-smi"), result["reason"])
            self.assertNotIn("printed nothing", result["reason"])
            self.assert_nothing_ran(result)

    def test_no_gpu_reason_says_what_nvidia_smi_did(self):
        cases = (("echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n",
                  ["failed with status 9", "NVIDIA-SMI has failed: no driver"]),
                 ("exit 0\n", ["printed nothing"]))
        for body, wants in cases:
            with tempfile.TemporaryDirectory() as d:
                r, result = self.run_script(d, nvidia_smi=body)
                self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
                self.assertIsNotNone(result, "no e2e.json")
                self.assertIs(result["available"], False)
                # The real command, whole.
                self.assertIn(os.path.join(d, "nvidia-smi") + " " + self.QUERY, result["reason"])
                for want in wants:
                    self.assertIn(want, result["reason"])
                self.assert_nothing_ran(result)

    def test_no_bundle_exits_11_with_e2e_json(self):
        with tempfile.TemporaryDirectory() as d:
            r, result = self.run_script(d, nvidia_smi="echo 'NVIDIA H200, 570.1, 143771 MiB'\n")
            self.assertEqual(r.returncode, 11, r.stdout + r.stderr)
            self.assertIsNotNone(result, "no e2e.json for exit 11 (no bundle)")
            self.assertIs(result["available"], True)
            self.assertEqual(result["gpu"], "NVIDIA H200, 570.1, 143771 MiB")
            self.assertIn("no bundle", result["reason"])
            self.assertEqual(result["exit_status"], 11)
            self.assert_nothing_ran(result)

    def test_build_failure_writes_e2e_json(self):
        # A bundle that is only a manifest: configure fails (exit 10), e2e.json says so.
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "bundle"))
            with open(os.path.join(d, "bundle", "MANIFEST.json"), "w") as f:
                json.dump({"commit": "abc123"}, f)
            smi = os.path.join(d, "nvidia-smi")
            with open(smi, "w") as f:
                f.write("#!/bin/sh\necho 'NVIDIA H200, 570.1, 143771 MiB'\n")
            os.chmod(smi, 0o755)
            env = dict(os.environ, OUT=os.path.join(d, "out"), BUILD_DIR=os.path.join(d, "build"),
                       BUNDLE=os.path.join(d, "bundle"), NVIDIA_SMI=smi, TORCH_PYTHON="false")
            r = subprocess.run(["bash", os.path.join(DEVICE, "e2e_device.sh")], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=100)
            self.assertEqual(r.returncode, 10, r.stdout + r.stderr)
            with open(os.path.join(d, "out", "e2e.json")) as f:
                result = json.load(f)
            self.assertIs(result["available"], True)
            self.assertEqual(result["bundle_commit"], "abc123")
            self.assertIn("build failed", result["reason"])
            self.assertEqual(result["exit_status"], 10)
            self.assertEqual([s["step"] for s in result["steps"]], ["configure"])
            self.assert_nothing_ran(result)

    def test_arguments_are_refused(self):
        for args, env, named in ((["--fast"], {}, "'--fast'"), ([], {"BUDGET": "abc"}, "BUDGET"),
                                 ([], {"WORKERS": "0"}, "WORKERS"), ([], {"DENSITY": "1.5"}, "DENSITY"),
                                 ([], {"STEPS": "3x"}, "STEPS")):
            with tempfile.TemporaryDirectory() as d:
                r, result = self.run_script(d, args, **env)
                self.assertEqual(r.returncode, 11, r.stdout + r.stderr)
                self.assertIn(named, r.stderr)
                self.assertIsNotNone(result, "no e2e.json for bad usage %r %r" % (args, env))
                self.assertIsNone(result["available"])  # not looked for
                self.assertIn("bad usage", result["reason"])
                self.assertIn(named, result["reason"])
                self.assertEqual(result["exit_status"], 11)
                self.assert_nothing_ran(result)

    def test_help_prints_usage(self):
        with tempfile.TemporaryDirectory() as d:
            r, result = self.run_script(d, ["--help"])
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("usage: bash deploy/device/e2e_device.sh", r.stdout)
            self.assertRegex(r.stdout, r"11 no bundle, or bad\s+usage")
            self.assertIsNone(result)  # --help runs nothing


class SummaryTest(unittest.TestCase):
    def run_summary(self, runs, junit=None, steps=None):
        with tempfile.TemporaryDirectory() as d:
            args = []
            for key, summary in runs.items():
                path = os.path.join(d, key + ".json")
                with open(path, "w") as f:
                    json.dump(summary, f)
                args += ["--run", "%s=%s" % (key, path)]
            if junit is not None:
                with open(os.path.join(d, "junit.xml"), "w") as f:
                    f.write(junit)
                args += ["--junit", os.path.join(d, "junit.xml")]
            if steps is not None:
                with open(os.path.join(d, "steps.jsonl"), "w") as f:
                    f.write("".join(json.dumps(s) + "\n" for s in steps))
                args += ["--steps-log", os.path.join(d, "steps.jsonl")]
            out = os.path.join(d, "e2e.json")
            r = subprocess.run([sys.executable, os.path.join(DEVICE, "e2e_summary.py"), "--warmup", "2",
                                "--meta", json.dumps({"gpu": "NVIDIA H200", "commit": "abc"}),
                                "--out", out] + args, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(out) as f:
                return json.load(f), r.stdout

    def test_medians_targets_and_ratios(self):
        us = 1e-6
        gpu = launcher_summary([
            rank("aa", 0.05, 10 * us, 200 * us, 20 * us, 30 * us, 900 * us, 40 * us),
            rank("aa", 0.05, 10 * us, 220 * us, 20 * us, 30 * us, 900 * us, 60 * us)])
        cpu = launcher_summary([
            rank("aa", 0.05, 0.03, 0.2, 20 * us, 30 * us, 900 * us, 0.01),
            rank("aa", 0.05, 0.03, 0.2, 20 * us, 30 * us, 900 * us, 0.01)])
        junit = ('<testsuites><testsuite name="x">'
                 '<testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
                 '<testcase name="c"><skipped/></testcase></testsuite></testsuites>')
        steps = [{"step": "build", "rc": 0, "seconds": 90},
                 {"step": "cpu_gaussiank", "skipped": True, "why": "budget"}]
        result, stdout = self.run_summary({"cuda_exact": gpu, "cpu_exact": cpu}, junit, steps)
        g = result["runs"]["cuda_exact"]
        self.assertEqual(g["device"], "cuda")
        self.assertEqual(g["timed_steps"], 6)  # 8 - 2 warm-up: the 1 s outliers are gone
        self.assertAlmostEqual(g["update_select_to_host_us"], 220.0)  # median of 210, 230
        self.assertAlmostEqual(g["update_select_to_host_us_max_rank"], 230.0)
        self.assertAlmostEqual(g["worker_overhead_us"], 290.0)  # (270 + 310) / 2
        self.assertAlmostEqual(g["wait_us"], 900.0)
        self.assertTrue(g["replicas_identical"])
        self.assertEqual(g["sent_bytes_per_worker_per_step"], 204456.0)
        status = {t["figure"]: (t["status"], t["value_us"]) for t in result["targets"]}
        self.assertEqual(status["update_select_to_host_us"], ("met", 220.0))
        self.assertEqual(status["worker_overhead_us"], ("met", 290.0))
        self.assertAlmostEqual(result["cpu_over_gpu"]["exact"]["update_select_to_host"], 230000 / 220.0, 1)
        self.assertEqual(result["ctest_gpu"], {"tests": 3, "failed": ["b"], "skipped": 1, "passed": 1})
        self.assertFalse(result["ctest_gpu_passed"])
        self.assertEqual([s["step"] for s in result["skipped"]], ["cpu_gaussiank"])
        self.assertEqual(result["gpu"], "NVIDIA H200")
        self.assertRegex(stdout, r"target update_select_to_host_us +MET +220.0 us")

    def test_missed_targets_and_differing_replicas(self):
        us = 1e-6
        gpu = launcher_summary([
            rank("aa", 0.05, 10 * us, 400 * us, 300 * us, 30 * us, 900 * us, 400 * us),
            rank("bb", 0.05, 10 * us, 400 * us, 300 * us, 30 * us, 900 * us, 400 * us)], match=False)
        result, stdout = self.run_summary({"cuda_exact": gpu})
        status = {t["figure"]: (t["status"], t["value_us"]) for t in result["targets"]}
        self.assertEqual(status["update_select_to_host_us"], ("missed", 410.0))
        self.assertEqual(status["worker_overhead_us"], ("missed", 1110.0))
        self.assertFalse(result["runs"]["cuda_exact"]["replicas_identical"])
        self.assertFalse(result["replicas_identical_all"])
        self.assertIsNone(result["ctest_gpu"])
        self.assertIsNone(result["ctest_gpu_passed"])  # ctest did not run: unknown, not failed
        self.assertIn("DIFFER", stdout)

    def test_not_run_is_null_not_false(self):
        result, stdout = self.run_summary({})
        self.assertIsNone(result["replicas_identical_all"])
        self.assertIsNone(result["ctest_gpu_passed"])
        self.assertNotIn("cpu_over_gpu", result)
        # ctest ran but left no JUnit file (it crashed or timed out): failed.
        result, _ = self.run_summary({}, steps=[{"step": "ctest_gpu", "rc": 124, "seconds": 120}])
        self.assertIs(result["ctest_gpu_passed"], False)
        # ctest skipped for time: not run.
        result, _ = self.run_summary({}, steps=[{"step": "ctest_gpu", "skipped": True, "why": "budget"}])
        self.assertIsNone(result["ctest_gpu_passed"])
        # A run whose summary lacks the checksum verdict: unknown, and so is the whole.
        us = 1e-6
        run = launcher_summary([rank("aa", 0.05, 10 * us, 200 * us, 20 * us, 30 * us, 900 * us, 40 * us)])
        del run["replica_checksums_match"]
        result, stdout = self.run_summary({"cuda_exact": run})
        self.assertIsNone(result["runs"]["cuda_exact"]["replicas_identical"])
        self.assertIsNone(result["replicas_identical_all"])
        self.assertIn("replicas unknown", stdout)
        # One run that differs makes the whole false even next to an unknown one.
        other = launcher_summary([rank("aa", 0.05, 10 * us, 200 * us, 20 * us, 30 * us, 900 * us, 40 * us)],
                                 match=False)
        result, _ = self.run_summary({"cuda_exact": run, "cpu_exact": other})
        self.assertIs(result["replicas_identical_all"], False)


class BundleListTest(unittest.TestCase):
    def setUp(self):
        self.mod = load("device_bundle")

    def test_list_parses(self):
        entries = self.mod.parse_list(self.mod.LIST)
        by_name = {e["package"]: e for e in entries}
        self.assertEqual(by_name["libgrpc++-dev"]["kind"], "static")
        self.assertIn("absl_*", by_name["libabsl-dev"]["libs"])
        # prometheus-cpp (core, pull) and civetweb: shared (Debian has no .a),
        # packed while the build finds prometheus-cpp.
        for pkg in ("prometheus-cpp-dev", "libcivetweb-dev"):
            self.assertEqual(by_name[pkg]["kind"], "shared", pkg)
            self.assertEqual(by_name[pkg]["when"], "prometheus-cpp", pkg)
        self.assertEqual(by_name["dataset-fashion-mnist"]["kind"], "data")

    def test_every_conditional_entry_is_packed_today(self):
        # A when= that no CMakeLists.txt finds is a dead line: the list should
        # say what the bundle carries (cpp-httplib was dropped, not kept
        # conditional, when issue 17 ended its use).
        for e in self.mod.parse_list(self.mod.LIST):
            if e["when"]:
                self.assertTrue(self.mod.project_uses(e["when"]),
                                "%s: when=%s, which no CMakeLists.txt finds" % (e["package"], e["when"]))

    def test_bad_line_is_named(self):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("# ok\nlibfoo-dev static libs=foo\nlibbar-dev sometimes\n")
        try:
            with self.assertRaisesRegex(self.mod.BundleError, r":3: expected"):
                self.mod.parse_list(f.name)
        finally:
            os.unlink(f.name)

    def test_when_follows_the_cmake_files(self):
        self.assertTrue(self.mod.project_uses("absl"))
        self.assertTrue(self.mod.project_uses("prometheus-cpp"))  # find_package(prometheus-cpp CONFIG ...)
        self.assertFalse(self.mod.project_uses("cpp-httplib"))  # gone with issue 17
        self.assertFalse(self.mod.project_uses("no-such-package-xyz"))

    def test_when_reads_both_forms_and_skips_build_folders(self):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "sub"))
            os.makedirs(os.path.join(root, "build", "x"))
            with open(os.path.join(root, "CMakeLists.txt"), "w") as f:
                f.write("find_package(foo-cpp CONFIG REQUIRED)\nadd_subdirectory(sub)\n")
            with open(os.path.join(root, "sub", "CMakeLists.txt"), "w") as f:
                f.write("pkg_check_modules(BAR REQUIRED IMPORTED_TARGET bar-lib>=1.0)\n")
            with open(os.path.join(root, "build", "x", "CMakeLists.txt"), "w") as f:
                f.write("find_package(baz)\n")
            self.assertTrue(self.mod.project_uses("foo-cpp", root))
            self.assertFalse(self.mod.project_uses("foo", root))  # a prefix is not the package
            self.assertTrue(self.mod.project_uses("bar-lib", root))  # pkg_check_modules
            self.assertFalse(self.mod.project_uses("baz", root))  # under build/

    def test_cmake_rewrite_imports_the_static_library(self):
        with tempfile.TemporaryDirectory() as prefix:
            lib = os.path.join(prefix, "lib", "x86_64-linux-gnu")
            os.makedirs(os.path.join(lib, "cmake", "foo"))
            open(os.path.join(lib, "libfoo.a"), "w").close()
            targets = os.path.join(lib, "cmake", "foo", "fooTargets.cmake")
            config = os.path.join(lib, "cmake", "foo", "fooTargets-none.cmake")
            with open(targets, "w") as f:
                f.write("add_library(foo::foo SHARED IMPORTED)\nadd_library(foo::bar SHARED IMPORTED)\n")
            with open(config, "w") as f:
                f.write('set_target_properties(foo::foo PROPERTIES\n'
                        '  IMPORTED_LOCATION_NONE "${_IMPORT_PREFIX}/lib/x86_64-linux-gnu/libfoo.so.1.2.3"\n'
                        '  IMPORTED_SONAME_NONE "libfoo.so.1"\n  )\n'
                        'list(APPEND _cmake_import_check_files_for_foo::foo '
                        '"${_IMPORT_PREFIX}/lib/x86_64-linux-gnu/libfoo.so.1.2.3" )\n'
                        'set_target_properties(foo::bar PROPERTIES\n'
                        '  IMPORTED_LOCATION_NONE "${_IMPORT_PREFIX}/lib/x86_64-linux-gnu/libbar.so.1"\n  )\n'
                        'list(APPEND _cmake_import_check_files_for_foo::bar '
                        '"${_IMPORT_PREFIX}/lib/x86_64-linux-gnu/libbar.so.1" )\n')
            static = {"libfoo"}
            found = self.mod.static_targets([targets, config], static)
            self.assertEqual(found, {"foo::foo"})
            for path in (targets, config):
                self.mod.rewrite_cmake(path, prefix, static, found, [])
            with open(targets) as f:
                t = f.read()
            with open(config) as f:
                c = f.read()
            self.assertIn("add_library(foo::foo STATIC IMPORTED)", t)
            self.assertIn("add_library(foo::bar SHARED IMPORTED)", t)  # no .a packed
            self.assertIn('lib/x86_64-linux-gnu/libfoo.a"', c)
            self.assertNotIn("libfoo.so", c)
            self.assertNotIn("IMPORTED_SONAME_NONE \"libfoo", c)
            # The check of a file the bundle leaves out is dropped; libfoo.a's stays.
            self.assertNotIn("_cmake_import_check_files_for_foo::bar", c)
            self.assertIn("_cmake_import_check_files_for_foo::foo", c)


if __name__ == "__main__":
    unittest.main(verbosity=2)
