#!/usr/bin/env python3
"""CTest for deploy/device/device_check's non-GPU paths (and a tiny GPU run
where a device exists): argument handling, torch-timings merge, JSON output.

With --emulated (the binary is cuda_device_check_emu, the same program on the
CUDA emulator) it also runs the correctness checks for real on every input
kind at small sizes (--check-only on an H200-sized grid, and with threads and
blocks shuffled on 2 multiprocessors), a timed run of every input on a
2-multiprocessor grid (the emulator is slow: a 1024-thread block is 1024
fibers) whose JSON rows, x_normal figures and targets it validates against
an independent reading of the contracts, and checks that a device failure
(emulated device memory too small) gives exit 1 and a JSON naming the
failure. Both modes check that every bad argument (a number not whole or out
of range, an unknown flag, an unwritable --json) exits 2 at once naming it;
with --emulated also that deploy/device/device_check.sh refuses bad flags and
settings with exit 11 before it builds anything.

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
INPUTS = ("normal", "narrow_band", "ties", "laplace_zeros", "all_equal",
          "outliers")
# The timed run (2 multiprocessors): every input at one n, two densities.
TIMED_SIZES = (1000,)
TIMED_DENSITIES = (0.001, 0.01)
# Rows per (input, n, density) and how many correctness checks each does.
METHODS = ("exact", "exact_after_update", "fused_update", "gaussiank",
           "gaussiank_after_update", "dgc")
CHECKS_PER_DENSITY = 5  # exact, exact+update, gaussiank, gaussiank+update, dgc
GAUSSIANK_CHECKS_PER_DENSITY = 2  # gaussiank, gaussiank+update
# Issue 15's targets by name; those measured only at n = 25,557,032 or
# 138,357,544 (not measured on small sizes).
BIG_N_TARGETS = ("exact_n25557032_d0.001", "exact_after_update_n25557032_d0.001",
                 "gaussiank_wall_n25557032_d0.001", "dgc_wall_n25557032_d0.001",
                 "exact_n138357544_d0.001_vs_read")
ALL_TARGETS = BIG_N_TARGETS + tuple(
    "any_input_" + i for i in INPUTS if i != "normal") + (
        "small_n_le_1000000", "gaussiank_count_contract")


# A hang guard per process, not a time limit: the longest emulated run takes
# about 27 s alone and several times that on a busy machine (ctest's other
# entries beside it); the entry's TIMEOUT bounds the whole (docs/testing.md,
# "Timeouts").
RUN_TIMEOUT_S = 600
# Timed iterations of the emulated runs: what each checks per iteration
# holds the same at 5 as at 20 (the emulator's timings mean nothing), at a
# quarter of the CPU (device_check_args.h kMinIters: 3 there).
EMU_ITERS = 5


def run(binary, *args, emu=None):
    env = dict(os.environ)
    if emu is not None:
        env["GTOPK_CUDA_EMU"] = emu
    return subprocess.run([binary, *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env)


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


def figure(r):
    """What x_normal and the targets compare: wall_us, else us."""
    return r["wall_us"] if r["wall_us"] is not None else r["us"]


def close(a, b):
    # The JSON prints 6 significant digits.
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-9


def check_rows(doc, failures, inputs=INPUTS, sizes=TIMED_SIZES,
               densities=TIMED_DENSITIES):
    """Every row of a timed run: present once, within its contracts."""
    rows = [r for r in doc.get("rows", []) if r.get("input") is not None]
    seen = {}
    for r in rows:
        key = (r["input"], r["n"], r["density"], r["method"])
        if key in seen:
            failures.append("duplicate row %r" % (key,))
        seen[key] = r
    copies = {r["n"]: r for r in doc.get("rows", [])
              if r["method"] == "d2d_copy"}
    want = len(inputs) * len(sizes) * len(densities) * len(METHODS)
    if len(rows) != want:
        failures.append("%d input rows, want %d" % (len(rows), want))
    if [i["name"] for i in doc.get("inputs", [])] != list(inputs):
        failures.append("inputs %r" % doc.get("inputs"))
    for n in sizes:
        c = copies.get(n)
        if c is None or c["k"] != 0 or c["count"] != 0 or \
                c["density"] != 0 or c["input"] is not None or \
                c["x_normal"] is not None:
            failures.append("d2d_copy row for n=%d: %r" % (n, c))
            continue
        one_read = c["us"] / 2
        for inp in inputs:
            for d in densities:
                k = expected_k(n, d)
                for m in METHODS:
                    r = seen.get((inp, n, d, m))
                    where = "%s %s n=%d density=%g" % (inp, m, n, d)
                    if r is None:
                        failures.append("no row " + where)
                        continue
                    check_row(r, seen[("normal", n, d, m)], k, one_read,
                              where, failures)
    check_floor_rows(doc, seen, sizes, densities, failures)


def baseline(r, method, n, density, k):
    """Is r the baseline row `method` at (n, density) with k pairs?"""
    return r["method"] == method and r["input"] is None and \
        r["n"] == n and r["density"] == density and r["k"] == k and \
        r["count"] == k and r["x_normal"] is None and \
        r["wall_us"] is None and isinstance(r["us"], (int, float)) and \
        r["us"] >= 0


def check_floor_rows(doc, seen, sizes, densities, failures):
    """The wall floor's baselines: a read pass per n, a copy of k pairs per
    (n, density), and their sum with the normal exact row's wall_us - us."""
    base = [r for r in doc.get("rows", []) if r.get("input") is None]
    for n in sizes:
        # The read pass, and the same with the histogram pass's sums and
        # with its histogram: one row each per n.
        for method in ("read_pass_moments", "read_pass_hist"):
            parts = [r for r in base if r["method"] == method and
                     r["n"] == n]
            if len(parts) != 1 or not baseline(parts[0], method, n, 0, 0):
                failures.append("%s rows for n=%d: %r" % (method, n, parts))
        reads = [r for r in base if r["method"] == "read_pass" and
                 r["n"] == n]
        if len(reads) != 1 or not baseline(reads[0], "read_pass", n, 0, 0):
            failures.append("read_pass rows for n=%d: %r" % (n, reads))
            continue
        for d in densities:
            k = expected_k(n, d)
            copies = [r for r in base if r["method"] == "pairs_copy" and
                      r["n"] == n and r["density"] == d]
            floors = [r for r in base if r["method"] == "wall_floor" and
                      r["n"] == n and r["density"] == d]
            if len(copies) != 1 or not baseline(copies[0], "pairs_copy", n,
                                                d, k):
                failures.append("pairs_copy rows for n=%d density=%g: %r" %
                                (n, d, copies))
                continue
            exact = seen.get(("normal", n, d, "exact"))
            want = reads[0]["us"] + copies[0]["us"] + \
                exact["wall_us"] - exact["us"]
            # Each part printed to 6 significant digits: exact's us and
            # wall_us may be far larger than their difference.
            slack = 1e-5 * (reads[0]["us"] + copies[0]["us"] +
                            exact["wall_us"] + exact["us"]) + 1e-9
            if len(floors) != 1 or \
                    not baseline(floors[0], "wall_floor", n, d, k) or \
                    abs(floors[0]["us"] - want) > slack:
                failures.append("wall_floor rows for n=%d density=%g: %r, "
                                "want us %r" % (n, d, floors, want))
    known = ("d2d_copy", "read_pass", "read_pass_moments", "read_pass_hist",
             "pairs_copy", "wall_floor", "torch.topk(abs)")
    for r in base:
        if r["method"] not in known:
            failures.append("unknown baseline row %r" % r)


def check_row(r, normal, k, one_read, where, failures):
    m = r["method"]
    lo, hi = count_range(m, k)
    if r["k"] != k:
        failures.append("%s: k %r, want %d" % (where, r["k"], k))
    if not lo <= r["count"] <= hi:
        failures.append("%s: count %d outside [%d, %d]" %
                        (where, r["count"], lo, hi))
    us, min_us = r["us"], r["min_us"]
    if not (isinstance(us, (int, float)) and
            isinstance(min_us, (int, float)) and 0 <= min_us <= us):
        failures.append("%s: us %r min_us %r" % (where, us, min_us))
    if r["one_read_us"] is None or \
            abs(r["one_read_us"] - one_read) > 1e-3 * one_read + 1e-2:
        failures.append("%s: one_read_us %r, d2d copy / 2 = %r" %
                        (where, r["one_read_us"], one_read))
    if r["torch_topk_us"] is not None:
        failures.append("%s: torch timing without --torch-json" % where)
    # Selections carry the host wall time; gaussiank/dgc the share of
    # fast-path (device-decided) selections.
    base = m.replace("_after_update", "")
    wall = r.get("wall_us")
    if (base in ("exact", "gaussiank", "dgc")) != \
            (isinstance(wall, (int, float)) and wall > 0):
        failures.append("%s: wall_us %r" % (where, wall))
    fast = r.get("fast_path_fraction")
    if base in ("gaussiank", "dgc"):
        if not (isinstance(fast, (int, float)) and 0 <= fast <= 1):
            failures.append("%s: fast_path_fraction %r" % (where, fast))
    elif fast is not None:
        failures.append("%s: fast_path_fraction %r for a method without one"
                        % (where, fast))
    # The shares of the fast path the device corrected (gaussiank) or
    # trimmed (dgc): on that method's rows only, within its fast path.
    for key, owner in (("corrected_fraction", "gaussiank"),
                       ("trimmed_fraction", "dgc")):
        share = r.get(key)
        if base == owner:
            if not (isinstance(share, (int, float)) and 0 <= share <= fast):
                failures.append("%s: %s %r (fast_path_fraction %r)" %
                                (where, key, share, fast))
        elif share is not None:
            failures.append("%s: %s %r for a method without one" %
                            (where, key, share))
    # x_normal: this row's figure over the normal row's (1 on normal).
    xn = r.get("x_normal")
    if not isinstance(xn, (int, float)) or \
            not close(xn, figure(r) / figure(normal)) or \
            (r["input"] == "normal" and xn != 1):
        failures.append("%s: x_normal %r, figure %r / normal %r" %
                        (where, xn, figure(r), figure(normal)))
    # The share of exact selections that started from a sample, on exact
    # rows only (after the update only where its plan needed several
    # passes over u: never on normal input).
    sampled = r.get("sampled_fraction", "absent")
    if base == "exact":
        if not (isinstance(sampled, (int, float)) and 0 <= sampled <= 1) or \
                (m != "exact" and r["input"] == "normal" and sampled != 0):
            failures.append("%s: sampled_fraction %r" % (where, sampled))
    elif sampled is not None:
        failures.append("%s: sampled_fraction %r for a method without one" %
                        (where, sampled))
    # Every selection row: the share run as one block, all of them at
    # n <= 4096 and none above; none for the update's own row.
    one_block = r.get("one_block_fraction", "absent")
    if m == "fused_update":
        if one_block is not None:
            failures.append("%s: one_block_fraction %r" % (where, one_block))
    elif one_block != (1 if r["n"] <= 4096 else 0):
        failures.append("%s: one_block_fraction %r at n=%d" %
                        (where, one_block, r["n"]))
    # The share of exact and gaussiank selections whose candidates came
    # from the first pass's compaction: on those rows only; 0 for exact
    # without the update (gaussiank's own histogram pass keeps them too).
    from_update = r.get("from_update_fraction", "absent")
    if base in ("exact", "gaussiank"):
        if not (isinstance(from_update, (int, float)) and
                0 <= from_update <= 1) or (m == "exact" and from_update != 0):
            failures.append("%s: from_update_fraction %r" %
                            (where, from_update))
    elif from_update is not None:
        failures.append("%s: from_update_fraction %r for a method without "
                        "one" % (where, from_update))
    # The exact plan of the last timed selection, on exact rows only (no
    # digit pass when it started from a sample or ran as one block).
    passes, from_u = r.get("digit_passes", "absent"), \
        r.get("final_from_u", "absent")
    if base == "exact":
        if not (isinstance(passes, int) and 0 <= passes <= 3 and
                (passes >= 1 or m != "exact" or one_block == 1 or
                 (isinstance(sampled, (int, float)) and sampled > 0))) or \
                not isinstance(from_u, bool):
            failures.append("%s: digit_passes %r final_from_u %r" %
                            (where, passes, from_u))
    elif passes is not None or from_u is not None:
        failures.append("%s: digit_passes %r final_from_u %r on a method "
                        "without an exact plan" % (where, passes, from_u))


def check_targets(doc, stdout, gaussiank_checks, timed, failures):
    """The targets array against the rows, and their summary lines."""
    targets = {t["name"]: t for t in doc.get("targets", [])}
    if sorted(targets) != sorted(ALL_TARGETS):
        failures.append("targets %r, want %r" % (sorted(targets),
                                                  sorted(ALL_TARGETS)))
        return
    rows = [r for r in doc["rows"] if r.get("input") is not None]
    by_key = {(r["input"], r["n"], r["density"], r["method"]): r
              for r in rows}
    expect = {name: (None, None) for name in ALL_TARGETS}  # (met, figure)
    if timed:
        for inp in INPUTS[1:]:
            worst, fig = None, None
            for r in rows:
                if r["input"] != inp or r["density"] not in DENSITIES:
                    continue
                ratio = figure(r) / figure(
                    by_key[("normal", r["n"], r["density"], r["method"])])
                if worst is None or ratio > worst:
                    worst, fig = ratio, figure(r)
            expect["any_input_" + inp] = (worst <= 2, fig)
        small = max(figure(r) for r in rows if r["n"] <= 1000000)
        expect["small_n_le_1000000"] = (small <= 15, small)
    expect["gaussiank_count_contract"] = (True, None)
    for name, (met, fig) in expect.items():
        t = targets[name]
        if t["met"] is not met:
            failures.append("target %s: met %r, want %r" % (name, t["met"],
                                                            met))
        if fig is None and t["figure_us"] is not None or \
                fig is not None and (t["figure_us"] is None or
                                     not close(t["figure_us"], fig)):
            failures.append("target %s: figure_us %r, want %r" %
                            (name, t["figure_us"], fig))
        # The floor only on the wall targets, and only where its rows ran
        # (n = 25,557,032: never in these runs).
        if t.get("floor_us", "absent") is not None:
            failures.append("target %s: floor_us %r, want null" %
                            (name, t.get("floor_us")))
        status = {True: "met", False: "missed", None: "not measured"}[met]
        if "target %s: %s (" % (name, status) not in stdout:
            failures.append("no summary line 'target %s: %s'" % (name,
                                                                status))
    want = "0 of %d checks failed" % gaussiank_checks
    if want not in targets["gaussiank_count_contract"]["detail"] and \
            want not in stdout:
        failures.append("gaussiank_count_contract: %r, want %r" %
                        (targets["gaussiank_count_contract"], want))


def emulated_checks(binary, tmp, failures):
    # Every input's correctness checks on an H200-sized grid, in order.
    out = os.path.join(tmp, "check_only.json")
    r = run(binary, "--sizes=" + ",".join(map(str, SIZES)),
            "--densities=" + ",".join(map(str, DENSITIES)), "--check-only",
            "--json=" + out)
    want_checks = CHECKS_PER_DENSITY * len(SIZES) * len(DENSITIES) * \
        len(INPUTS)
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("--check-only: rc %d: %s %s" %
                        (r.returncode, r.stdout[-2000:], r.stderr[-500:]))
    else:
        doc = json.load(open(out))
        c = doc["correctness"]
        if doc["rows"] or c["checks"] != want_checks or c["failed"] != 0 or \
                c["failures"]:
            failures.append("--check-only: rows %r, correctness %r, want %d "
                            "checks" % (doc["rows"][:2], c, want_checks))
        if "correctness: %d checks, 0 failed" % want_checks not in r.stdout:
            failures.append("summary line missing: %r" % r.stdout[-300:])
        # No timing: every timing target is "not measured".
        check_targets(doc, r.stdout, GAUSSIANK_CHECKS_PER_DENSITY *
                      len(SIZES) * len(DENSITIES) * len(INPUTS), False,
                      failures)
    # The timed run: every input, on 2 multiprocessors (in order).
    out = os.path.join(tmp, "emu.json")
    r = run(binary, "--sizes=" + ",".join(map(str, TIMED_SIZES)),
            "--densities=" + ",".join(map(str, TIMED_DENSITIES)),
            "--iters=%d" % EMU_ITERS, "--warmup=1", "--json=" + out,
            emu="sms=2")
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("emulated run: rc %d: %s %s" %
                        (r.returncode, r.stdout[-2000:], r.stderr[-2000:]))
    else:
        doc = json.load(open(out))
        if not doc.get("device_present") or \
                "emulator" not in doc.get("gpu", ""):
            failures.append("emulated run: device %r, gpu %r" %
                            (doc.get("device_present"), doc.get("gpu")))
        c = doc["correctness"]
        want = CHECKS_PER_DENSITY * len(TIMED_SIZES) * \
            len(TIMED_DENSITIES) * len(INPUTS)
        if c["checks"] != want or c["failed"] != 0:
            failures.append("emulated run: correctness %r, want %d" %
                            (c, want))
        check_rows(doc, failures)
        check_targets(doc, r.stdout, GAUSSIANK_CHECKS_PER_DENSITY *
                      len(TIMED_SIZES) * len(TIMED_DENSITIES) * len(INPUTS),
                      True, failures)
        for inp in INPUTS:
            if "== input %s: " % inp not in r.stdout:
                failures.append("no table for input %s" % inp)
    # Exact from a sample at every n it can (--exact-sample-min-n=0; the
    # default minimum is 2^22, above what the emulator runs): timed rows on
    # normal data and on ties (the sample's bound is the tied key: the keys
    # above it, with the ties written from u where they are needed), every
    # selection from the sample, all correct.
    out = os.path.join(tmp, "sampled.json")
    r = run(binary, "--sizes=100003", "--densities=0.001",
            "--inputs=normal,ties", "--iters=%d" % EMU_ITERS, "--warmup=1",
            "--exact-sample-min-n=0", "--json=" + out, emu="sms=2")
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("sampled: rc %d: %s %s" % (r.returncode,
                                                   r.stdout[-2000:],
                                                   r.stderr[-500:]))
    else:
        doc = json.load(open(out))
        c = doc["correctness"]
        if c["checks"] != CHECKS_PER_DENSITY * 2 or c["failed"] != 0:
            failures.append("sampled: correctness %r" % c)
        check_rows(doc, failures, ("normal", "ties"), (100003,), (0.001,))
        share = {r2["input"]: r2["sampled_fraction"] for r2 in doc["rows"]
                 if r2.get("method") == "exact"}
        if share != {"normal": 1, "ties": 1}:
            failures.append("sampled: exact's sampled shares %r, want 1 "
                            "on both" % share)
        # The same u after every update: the predicted bin always holds,
        # so every timed exact selection after it takes the update's
        # candidates (plan p1) on normal data.
        # The same for Gaussian-k, whose planner predicts the bin from its
        # own key, after the update and from its own histogram pass.
        for method in ("exact_after_update", "gaussiank_after_update",
                       "gaussiank"):
            share = [r2["from_update_fraction"] for r2 in doc["rows"]
                     if r2.get("method") == method and
                     r2.get("input") == "normal"]
            if share != [1]:
                failures.append("sampled: normal %s from_update_fraction "
                                "%r, want [1]" % (method, share))
        if not any(line.split()[-1:] == ["s1"] for line in
                   r.stdout.splitlines() if " exact " in line):
            failures.append("sampled: no exact row with plan s1: %r" %
                            r.stdout[-1500:])
    # Inputs whose k-th key's digit-0 bin is crowded (the narrow band;
    # every value equal; ties at 0.01: the k-th key with its ties): the
    # plan predicts a finer key, or that key with its ties, and every timed
    # exact selection after the update (the same u each time) takes the
    # update's candidates (plan p1), the ties by the write on the update's
    # layout; all correct.
    out = os.path.join(tmp, "crowded.json")
    crowded_inputs = ("narrow_band", "all_equal", "ties")
    r = run(binary, "--sizes=100003", "--densities=0.001,0.01",
            "--inputs=" + ",".join(crowded_inputs),
            "--iters=%d" % EMU_ITERS, "--warmup=1", "--json=" + out,
            emu="sms=2")
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("crowded: rc %d: %s %s" % (r.returncode,
                                                   r.stdout[-2000:],
                                                   r.stderr[-500:]))
    else:
        doc = json.load(open(out))
        c = doc["correctness"]
        if c["checks"] != CHECKS_PER_DENSITY * 2 * len(crowded_inputs) or \
                c["failed"] != 0:
            failures.append("crowded: correctness %r" % c)
        # Gaussian-k too, after the update and from u: its rule ends out
        # of range on these inputs (but for ties at 0.001, in range at its
        # predicted bin), and its exact top-k takes the first pass's
        # candidates as exact's does after the update.
        for method in ("exact_after_update", "gaussiank_after_update",
                       "gaussiank"):
            share = {(r2["input"], r2["density"]): r2["from_update_fraction"]
                     for r2 in doc["rows"] if r2.get("method") == method}
            if len(share) != 2 * len(crowded_inputs) or \
                    any(v != 1 for v in share.values()):
                failures.append("crowded: %s from_update_fraction %r, want "
                                "1 on each" % (method, share))
    # The checks again with threads and blocks shuffled on 2 multiprocessors
    # (16 blocks at most: the capped grids and longer grid-stride loops),
    # exact starting from a sample where it can.
    out = os.path.join(tmp, "shuffled.json")
    shuffled_inputs = ("normal", "narrow_band", "ties", "all_equal")
    r = run(binary, "--sizes=" + ",".join(map(str, SIZES)),
            "--densities=" + ",".join(map(str, DENSITIES)),
            "--inputs=" + ",".join(shuffled_inputs), "--check-only",
            "--exact-sample-min-n=0", "--json=" + out,
            emu="order=shuffle seed=7 sms=2")
    want_checks = CHECKS_PER_DENSITY * len(SIZES) * len(DENSITIES) * \
        len(shuffled_inputs)
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("shuffled: rc %d: %s %s" % (r.returncode,
                                                    r.stdout[-2000:],
                                                    r.stderr[-500:]))
    else:
        c = json.load(open(out))["correctness"]
        if c["checks"] != want_checks or c["failed"] != 0:
            failures.append("shuffled: correctness %r" % c)
    # --budget-s: no block starts past the budget; each is listed as skipped
    # (and the exit status still means correctness: 0).
    out = os.path.join(tmp, "budget.json")
    r = run(binary, "--sizes=1000,1", "--densities=0.01", "--check-only",
            "--inputs=normal,ties", "--budget-s=0.000001", "--json=" + out)
    skipped = ["normal n=1000", "normal n=1", "ties n=1000", "ties n=1"]
    if r.returncode != 0 or not os.path.exists(out):
        failures.append("--budget-s: rc %d: %s" % (r.returncode,
                                                   r.stderr[-500:]))
    else:
        doc = json.load(open(out))
        if doc["skipped"] != skipped or doc["correctness"]["checks"] != 0 or \
                "NOT RUN (--budget-s=1e-06): ties n=1" not in r.stdout:
            failures.append("--budget-s: skipped %r, correctness %r, %r" %
                            (doc["skipped"], doc["correctness"],
                             r.stdout[-500:]))
    # A device failure: 1.5 MB of emulated device memory cannot hold the
    # selector's scratch for n = 100003 (20 bytes per entry + 1 MiB).
    out = os.path.join(tmp, "oom.json")
    r = run(binary, "--sizes=100003", "--densities=0.01", "--json=" + out,
            emu="memory_bytes=1500000")
    if r.returncode != 1 or not os.path.exists(out):
        failures.append("out of device memory: rc %d (want 1): %s" %
                        (r.returncode, r.stderr[-500:]))
    else:
        c = json.load(open(out))["correctness"]
        if c["failed"] < 1 or "set-up" not in " ".join(c["failures"]) or \
                "FAIL" not in r.stdout:
            failures.append("out of device memory not reported: %r %r" %
                            (c, r.stdout[-500:]))


# Every number is parsed whole and range-checked: each of these exits 2 at
# once, naming the argument and why, before any check runs.
BAD_VALUES = (
    "--seed=x", "--seed=12abc", "--seed=-1", "--seed=", "--seed= 7",
    "--seed=18446744073709551616", "--iters=20x", "--iters=2",
    "--iters=1e2", "--iters=99999999999999999999", "--warmup=-1",
    "--warmup=0", "--warmup=2.5", "--sizes=0", "--sizes=1.5",
    "--sizes=99999999999999999999", "--sizes=1,x", "--sizes=1,,2",
    "--sizes=+5", "--densities=2", "--densities=0", "--densities=nan",
    "--densities=inf", "--densities=0.1x", "--densities=0.1,", "--budget-s=-1",
    "--budget-s=abc", "--budget-s=nan", "--budget-s=inf", "--budget-s=",
    "--json=", "--bogus", "--check-only=1", "--exact-sample-min-n=-1",
    "--exact-sample-min-n=4294967297", "--exact-sample-min-n=")


def argument_checks(binary, tmp, failures, emulated):
    out = os.path.join(tmp, "arg.json")
    # Under 20 timed iterations on a GPU; the emulator's build takes 3.
    for bad in BAD_VALUES + (() if emulated else ("--iters=19",)):
        r = run(binary, "--sizes=1", "--densities=0.01", "--check-only",
                "--inputs=normal", "--json=" + out, bad)
        first = r.stderr.split("\n", 1)[0]
        if r.returncode != 2 or r.stdout or \
                not first.startswith("device_check: bad argument '%s': " %
                                     bad) or \
                len(first) <= len("device_check: bad argument '%s': " % bad) \
                or "usage" not in r.stderr:
            failures.append("%s: rc %d (want 2), stdout %r, stderr %r" %
                            (bad, r.returncode, r.stdout[-200:],
                             r.stderr[:300]))
    if os.path.exists(out):
        failures.append("a JSON was written for a bad value")
    # The largest values that fit are taken.
    r = run(binary, "--validate-only", "--seed=18446744073709551615",
            "--sizes=4294967296", "--iters=10000", "--warmup=1000",
            "--densities=1,0.5e-3", "--budget-s=0", "--json=" + out)
    if r.returncode != 0 or r.stdout or os.path.exists(out):
        failures.append("--validate-only on good values: rc %d %r %r, JSON "
                        "written: %s" % (r.returncode, r.stdout, r.stderr,
                                         os.path.exists(out)))
    # --validate-only: arguments only, nothing run or written.
    r = run(binary, "--validate-only", "--seed=12abc")
    if r.returncode != 2 or "'--seed=12abc'" not in r.stderr:
        failures.append("--validate-only --seed=12abc: rc %d %r" %
                        (r.returncode, r.stderr[:200]))
    # A --json that cannot be written: exit 2 before any check runs.
    for path in ("/nonexistent/x.json", tmp):
        r = run(binary, "--sizes=1", "--densities=0.01", "--check-only",
                "--inputs=normal", "--json=" + path)
        if r.returncode != 2 or r.stdout or \
                ("cannot write '%s'" % path) not in r.stderr:
            failures.append("--json=%s: rc %d (want 2 at once), stdout %r, "
                            "stderr %r" % (path, r.returncode,
                                           r.stdout[-200:], r.stderr[:300]))


def script_checks(tmp, failures):
    """device_check.sh refuses bad flags and settings (exit 11, the reason
    given) before it builds anything: a fake nvcc that records its calls
    must never run."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "device_check.sh")
    nvcc = os.path.join(tmp, "fake-nvcc")
    called = os.path.join(tmp, "nvcc-called")
    with open(nvcc, "w") as f:
        f.write("#!/bin/sh\necho \"$@\" >> %s\nexit 1\n" % called)
    os.chmod(nvcc, 0o755)
    cases = (
        (["--bogus"], {}, "'--bogus'"),
        (["--sizes=0"], {}, "'--sizes=0'"),
        (["--seed=12abc"], {}, "'--seed=12abc'"),
        (["--quick", "--iters=5"], {}, "'--iters=5'"),
        (["-x"], {}, "'-x'"),
        ([], {"SIZES": "0"}, "--sizes=0"),
        ([], {"DENSITIES": "nan"}, "--densities=nan"),
        ([], {"ITERS": "20x"}, "--iters=20x"),
        ([], {"BUDGET": "abc"}, "BUDGET"),
        ([], {"SANITIZE": "yes"}, "SANITIZE"),
    )
    for args, extra_env, named in cases:
        build = os.path.join(tmp, "script_build")
        env = dict(os.environ, OUT=os.path.join(tmp, "script_out"),
                   BUILD_DIR=build, NVCC=nvcc, **extra_env)
        r = subprocess.run(["bash", script] + args, capture_output=True,
                           text=True, timeout=RUN_TIMEOUT_S, env=env)
        where = "device_check.sh %s %r" % (" ".join(args), extra_env)
        if r.returncode != 11 or named not in r.stdout + r.stderr:
            failures.append("%s: rc %d (want 11, naming %s): %r %r" %
                            (where, r.returncode, named, r.stdout[-400:],
                             r.stderr[-400:]))
        if os.path.exists(called):
            failures.append("%s: nvcc ran before the flags were checked: %r"
                            % (where, open(called).read()[:200]))
            os.unlink(called)
    r = subprocess.run(["bash", script, "--help"], capture_output=True,
                       text=True, timeout=RUN_TIMEOUT_S)
    if r.returncode != 0 or "usage" not in r.stdout or \
            "11 bad usage" not in r.stdout:
        failures.append("device_check.sh --help: rc %d %r" %
                        (r.returncode, r.stdout[-300:]))


def main():
    args = sys.argv[1:]
    emulated = "--emulated" in args
    binary = [a for a in args if a != "--emulated"][0]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        # Bad arguments: usage, exit 2, no JSON.
        for bad in (["--sizes=0"], ["--iters=2"], ["--densities=1.5"],
                    ["--bogus"], ["--sizes=1,x"], ["--check-only=1"],
                    ["--inputs=normal,bogus"], ["--inputs=ties,ties"],
                    ["--inputs="], ["--budget-s=-1"]):
            r = run(binary, *bad, "--json=" + os.path.join(tmp, "bad.json"))
            if r.returncode != 2 or "usage" not in r.stderr:
                failures.append("%s: rc %d, stderr %r" % (bad, r.returncode,
                                                          r.stderr[-200:]))
        if os.path.exists(os.path.join(tmp, "bad.json")):
            failures.append("a JSON was written for bad arguments")
        argument_checks(binary, tmp, failures, emulated)
        if emulated:  # the script's checks do not depend on the binary
            script_checks(tmp, failures)
        # torch timings are merged into the rows.
        torch = os.path.join(tmp, "torch.json")
        with open(torch, "w") as f:
            json.dump({"available": True, "version": "test", "note": "",
                       "rows": [{"n": 1000, "density": 0.01, "k": 10,
                                 "topk_us": 50.0, "copy_us": 4.0}]}, f)
        out = os.path.join(tmp, "out.json")
        r = run(binary, "--allow-no-device", "--sizes=1000",
                "--densities=0.01", "--iters=20", "--warmup=2",
                "--inputs=normal", "--torch-json=" + torch, "--json=" + out,
                emu="sms=2")
        if r.returncode != 0:
            failures.append("run: rc %d: %s %s" % (r.returncode, r.stdout,
                                                   r.stderr))
        else:
            doc = json.load(open(out))
            for key in ("command", "gpu", "device_present", "torch",
                        "correctness", "inputs", "skipped", "rows",
                        "targets"):
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
