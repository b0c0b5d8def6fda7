#!/usr/bin/env python3
"""CTest for bench/cuda/device_check's non-GPU paths (and a tiny GPU run
where a device exists): argument handling, torch-timings merge, JSON output.

With --emulated (the binary is cuda_device_check_emu, the same program on the
CUDA emulator) it also runs the correctness checks for real on small sizes
and validates every JSON row against an independent reading of the
contracts, runs --check-only (also with threads and blocks shuffled on 2
multiprocessors), and checks that a device failure (emulated device memory
too small) gives exit 1 and a JSON naming the failure.

usage: device_check_test.py [--emulated] <device_check binary>
"""
import json
import math
import os
import subprocess
import sys
import tempfile

SIZES = (1, 1000, 100003)
DENSITIES = (0.0001, 0.001, 0.01)
# Rows per (n, density) and how many correctness checks each method does.
METHODS = ("exact", "exact_after_update", "fused_update", "gaussiank",
           "gaussiank_after_update", "dgc")
CHECKS_PER_DENSITY = 5  # exact, exact+update, gaussiank, gaussiank+update, dgc


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True,
                          timeout=120)


def expected_k(n, density):
    # llround(density * n) clamped to [1, n], as the checker documents.
    return max(1, min(n, int(math.floor(density * n + 0.5))))


def count_range(method, k):
    """The count contract of common/cuda/sparsify.h (MinCount/MaxCount)."""
    if method in ("exact", "exact_after_update"):
        return k, k
    if method in ("gaussiank", "gaussiank_after_update"):
        lo, hi = -(-2 * k // 3), 4 * k // 3
        return (lo, hi) if lo <= hi else (k, k)
    if method == "dgc":
        return 1, k
    return 0, 0  # fused_update, d2d_copy: no selection


def check_real_run(doc, stdout, failures):
    """The JSON of the small emulated run: every row, within contracts."""
    if not doc.get("device_present") or "emulator" not in doc.get("gpu", ""):
        failures.append("emulated run: device %r, gpu %r" %
                        (doc.get("device_present"), doc.get("gpu")))
    want_checks = CHECKS_PER_DENSITY * len(SIZES) * len(DENSITIES)
    c = doc.get("correctness", {})
    if c.get("checks") != want_checks or c.get("failed") != 0 or \
            c.get("failures"):
        failures.append("correctness %r, want %d checks, 0 failed" %
                        (c, want_checks))
    if "correctness: %d checks, 0 failed" % want_checks not in stdout:
        failures.append("summary line missing: %r" % stdout[-300:])
    rows = doc.get("rows", [])
    seen = {}
    for r in rows:
        key = (r["n"], r["density"], r["method"])
        if key in seen:
            failures.append("duplicate row %r" % (key,))
        seen[key] = r
    copies = {r["n"]: r for r in rows if r["method"] == "d2d_copy"}
    want_rows = len(SIZES) * (len(DENSITIES) * len(METHODS) + 1)
    if len(rows) != want_rows:
        failures.append("%d rows, want %d" % (len(rows), want_rows))
    for n in SIZES:
        if n not in copies or copies[n]["k"] != 0 or \
                copies[n]["count"] != 0 or copies[n]["density"] != 0:
            failures.append("d2d_copy row for n=%d: %r" % (n, copies.get(n)))
            continue
        one_read = copies[n]["us"] / 2
        for d in DENSITIES:
            k = expected_k(n, d)
            for m in METHODS:
                r = seen.get((n, d, m))
                if r is None:
                    failures.append("no %s row for n=%d density=%g" % (m, n, d))
                    continue
                lo, hi = count_range(m, k)
                where = "%s n=%d density=%g" % (m, n, d)
                if r["k"] != k:
                    failures.append("%s: k %r, want %d" % (where, r["k"], k))
                if not lo <= r["count"] <= hi:
                    failures.append("%s: count %d outside [%d, %d]" %
                                    (where, r["count"], lo, hi))
                us, min_us = r["us"], r["min_us"]
                if not (isinstance(us, (int, float)) and
                        isinstance(min_us, (int, float)) and
                        0 <= min_us <= us):
                    failures.append("%s: us %r min_us %r" % (where, us,
                                                             min_us))
                if r["one_read_us"] is None or \
                        abs(r["one_read_us"] - one_read) > 1e-3 * one_read + 1e-2:
                    failures.append("%s: one_read_us %r, d2d copy / 2 = %r" %
                                    (where, r["one_read_us"], one_read))
                if r["torch_topk_us"] is not None:
                    failures.append("%s: torch timing without --torch-json" %
                                    where)
                # Selections carry the host wall time; gaussiank/dgc the
                # share of fast-path (device-decided) selections.
                base = m.replace("_after_update", "")
                timed = base in ("exact", "gaussiank", "dgc")
                wall = r.get("wall_us")
                if timed != (isinstance(wall, (int, float)) and wall > 0):
                    failures.append("%s: wall_us %r" % (where, wall))
                fast = r.get("fast_path_fraction")
                if base in ("gaussiank", "dgc"):
                    if not (isinstance(fast, (int, float)) and 0 <= fast <= 1):
                        failures.append("%s: fast_path_fraction %r" %
                                        (where, fast))
                elif fast is not None:
                    failures.append("%s: fast_path_fraction %r for a method "
                                    "without one" % (where, fast))


def emulated_checks(binary, tmp, failures):
    # The real run on small sizes.
    out = os.path.join(tmp, "emu.json")
    r = run(binary, "--sizes=" + ",".join(map(str, SIZES)),
            "--densities=" + ",".join(map(str, DENSITIES)), "--iters=20",
            "--warmup=2", "--json=" + out)
    if r.returncode != 0:
        failures.append("emulated run: rc %d: %s %s" %
                        (r.returncode, r.stdout[-2000:], r.stderr[-2000:]))
    if not os.path.exists(out):
        failures.append("emulated run wrote no JSON")
    else:
        check_real_run(json.load(open(out)), r.stdout, failures)
    # --check-only: the same checks, no timing rows.
    out = os.path.join(tmp, "check_only.json")
    r = run(binary, "--sizes=1000", "--densities=0.01", "--check-only",
            "--json=" + out)
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("--check-only: rc %d: %s" % (r.returncode,
                                                     r.stderr[-500:]))
    else:
        doc = json.load(open(out))
        if doc["rows"] or doc["correctness"]["checks"] != CHECKS_PER_DENSITY \
                or doc["correctness"]["failed"] != 0:
            failures.append("--check-only: rows %r, correctness %r" %
                            (doc["rows"], doc["correctness"]))
    # The checks again with threads and blocks shuffled on 2 multiprocessors
    # (16 blocks at most: the capped grids and longer grid-stride loops).
    out = os.path.join(tmp, "shuffled.json")
    env = dict(os.environ, GTOPK_CUDA_EMU="order=shuffle seed=7 sms=2")
    r = subprocess.run([binary, "--sizes=" + ",".join(map(str, SIZES)),
                        "--densities=" + ",".join(map(str, DENSITIES)),
                        "--check-only", "--json=" + out],
                       capture_output=True, text=True, timeout=120, env=env)
    want_checks = CHECKS_PER_DENSITY * len(SIZES) * len(DENSITIES)
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("shuffled: rc %d: %s %s" % (r.returncode,
                                                    r.stdout[-2000:],
                                                    r.stderr[-500:]))
    else:
        c = json.load(open(out))["correctness"]
        if c["checks"] != want_checks or c["failed"] != 0:
            failures.append("shuffled: correctness %r" % c)
    # A device failure: 1.5 MB of emulated device memory cannot hold the
    # selector's scratch for n = 100003 (20 bytes per entry + 1 MiB).
    out = os.path.join(tmp, "oom.json")
    env = dict(os.environ, GTOPK_CUDA_EMU="memory_bytes=1500000")
    r = subprocess.run([binary, "--sizes=100003", "--densities=0.01",
                        "--json=" + out], capture_output=True, text=True,
                       timeout=120, env=env)
    if r.returncode != 1 or not os.path.exists(out):
        failures.append("out of device memory: rc %d (want 1): %s" %
                        (r.returncode, r.stderr[-500:]))
    else:
        c = json.load(open(out))["correctness"]
        if c["failed"] < 1 or "set-up" not in " ".join(c["failures"]) or \
                "FAIL" not in r.stdout:
            failures.append("out of device memory not reported: %r %r" %
                            (c, r.stdout[-500:]))


def main():
    args = sys.argv[1:]
    emulated = "--emulated" in args
    binary = [a for a in args if a != "--emulated"][0]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        # Bad arguments: usage, exit 2, no JSON.
        for bad in (["--sizes=0"], ["--iters=5"], ["--densities=1.5"],
                    ["--bogus"], ["--sizes=1,x"], ["--check-only=1"]):
            r = run(binary, *bad, "--json=" + os.path.join(tmp, "bad.json"))
            if r.returncode != 2 or "usage" not in r.stderr:
                failures.append("%s: rc %d, stderr %r" % (bad, r.returncode,
                                                          r.stderr[-200:]))
        if os.path.exists(os.path.join(tmp, "bad.json")):
            failures.append("a JSON was written for bad arguments")
        # torch timings are merged into the rows.
        torch = os.path.join(tmp, "torch.json")
        with open(torch, "w") as f:
            json.dump({"available": True, "version": "test", "note": "",
                       "rows": [{"n": 1000, "density": 0.01, "k": 10,
                                 "topk_us": 50.0, "copy_us": 4.0}]}, f)
        out = os.path.join(tmp, "out.json")
        r = run(binary, "--allow-no-device", "--sizes=1000",
                "--densities=0.01", "--iters=20", "--warmup=2",
                "--torch-json=" + torch, "--json=" + out)
        if r.returncode != 0:
            failures.append("run: rc %d: %s %s" % (r.returncode, r.stdout,
                                                   r.stderr))
        else:
            doc = json.load(open(out))
            for key in ("command", "gpu", "device_present", "torch",
                        "correctness", "rows"):
                if key not in doc:
                    failures.append("JSON lacks %r" % key)
            torch_rows = [x for x in doc.get("rows", [])
                          if x["method"] == "torch.topk(abs)"]
            if len(torch_rows) != 1 or torch_rows[0]["us"] != 50:
                failures.append("torch row not merged: %r" % torch_rows)
            if doc.get("device_present"):
                methods = {x["method"] for x in doc["rows"]}
                for m in ("exact", "gaussiank", "dgc", "d2d_copy"):
                    if m not in methods:
                        failures.append("no %s row on a GPU" % m)
                if doc["correctness"]["failed"] != 0:
                    failures.append("correctness: %r" % doc["correctness"])
                x = [r for r in doc["rows"] if r["method"] == "exact"][0]
                if x["x_torch_topk"] is None:
                    failures.append("x_torch_topk missing")
            if "n" not in r.stdout or "wrote" not in r.stdout:
                failures.append("no table printed: %r" % r.stdout)
        if emulated:
            emulated_checks(binary, tmp, failures)
    for f in failures:
        print("FAIL", f)
    print("device_check_test: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
