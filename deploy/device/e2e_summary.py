#!/usr/bin/env python3
"""Writes e2e.json for deploy/device/e2e_device.sh from the runs it made.

Inputs: the local launcher's summaries (deploy/local/gtopk_local.py writes
RUNS/NAME/summary.json, with each worker's own summary under "per_rank" and
its per-step phase times under per_rank[i]["per_step"], worker/flags.md),
the JUnit file of `ctest -L gpu`, and the script's step log (one JSON object
per line: {"step", "rc", "seconds", "skipped"?, "why"?}).

Per cluster run (`--run KEY=PATH`, KEY such as cuda_exact), the first
--warmup steps of every rank are dropped, each phase's median is taken per
rank, and the run reports the median over ranks (`*_us`) and the slowest
rank's median (`*_us_max_rank`), in microseconds:
  compute            making the gradient (synthetic: host random numbers and,
                     on cuda, the copy to the device; cnn: forward+backward)
  accumulate         momentum correction + error feedback (device: the
                     enqueueing of the fused update kernel)
  select             local top-k (device: the update and selection kernels
                     finishing, the pairs copied to the host, the codec
                     round trip)
  update_select_to_host  accumulate + select, per step: the issue-16 target
  encode             slicing and encoding the S pushes
  push, wait         pushes written to their streams; then until the last
                     pull was decoded (other workers and the servers)
  apply              put-back, momentum masking, the parameter update
  worker_overhead    accumulate + select + encode + apply (the worker's own
                     work: everything but the gradient and the network)
  step               the whole step
plus sent/received bytes per worker per step, the replicas' checksums and
whether they agree (null when unknown). Verdicts over what did not run are
null, not false: replicas_identical_all without runs (or with a run that
gave no verdict and none that differ), ctest_gpu_passed when ctest did not
run (false when it ran and left no JUnit file). Targets (issue 16): update_select_to_host <= 250 us and
worker_overhead <= 1000 us for cuda_exact; each gets a line in "targets"
(met/missed with the figure) and on stdout.

Exit status: 0 written (whatever the figures); 2 bad usage or unreadable
input.
"""

import argparse
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET

PHASES = ["compute", "accumulate", "select", "encode", "push", "wait", "apply", "step"]
TARGETS = [
    # (run, figure, limit in us, what)
    ("cuda_exact", "update_select_to_host_us", 250.0,
     "GPU worker, exact: update + selection + pairs to the host"),
    ("cuda_exact", "worker_overhead_us", 1000.0,
     "GPU worker, exact: whole worker-side overhead (all but gradient and network)"),
]


def median(values):
    return statistics.median(values) if values else None


def rank_series(per_step, warmup):
    """Per-step phase series (seconds) of one rank, warm-up dropped."""
    out = {}
    for phase in PHASES:
        series = per_step.get(phase + "_seconds")
        if series is not None:
            out[phase] = series[warmup:]
    acc, sel = out.get("accumulate"), out.get("select")
    if acc is not None and sel is not None:
        out["update_select_to_host"] = [a + s for a, s in zip(acc, sel)]
        enc, app = out.get("encode"), out.get("apply")
        if enc is not None and app is not None:
            out["worker_overhead"] = [a + s + e + p for a, s, e, p in zip(acc, sel, enc, app)]
    return out


def summarize_run(summary, warmup):
    ranks = summary.get("per_rank") or []
    per_phase = {}
    for r in ranks:
        for phase, series in rank_series(r.get("per_step") or {}, warmup).items():
            m = median(series)
            if m is not None:
                per_phase.setdefault(phase, []).append(m)
    timed = min((len((r.get("per_step") or {}).get("step_seconds", [])) for r in ranks), default=0)
    run = {
        "model": summary.get("model"), "n": summary.get("n"), "selector": summary.get("selector"),
        "mode": summary.get("mode"), "density": summary.get("density"),
        "workers": summary.get("workers"), "shards": summary.get("shards"),
        "steps": summary.get("steps"), "warmup_steps": warmup, "timed_steps": max(0, timed - warmup),
        "sent_bytes_per_worker_per_step": summary.get("sent_bytes_per_worker_per_step"),
        "received_bytes_per_worker_per_step": summary.get("received_bytes_per_worker_per_step"),
        "dense_bytes_per_worker_per_step": summary.get("dense_bytes_per_worker_per_step"),
        # null when the launcher gave no verdict (not checked is not "differ")
        "replicas_identical": (summary.get("replica_checksums_match")
                               if isinstance(summary.get("replica_checksums_match"), bool) else None),
        "param_checksums": summary.get("param_checksums"),
        "server_checksums": summary.get("server_checksums"),
        "test_accuracy": summary.get("test_accuracy"),
        "wall_seconds": summary.get("wall_seconds"),
    }
    for phase, medians in per_phase.items():
        run[phase + "_us"] = round(median(medians) * 1e6, 1)
        run[phase + "_us_max_rank"] = round(max(medians) * 1e6, 1)
    return run


def all_of(verdicts):
    """True if every verdict is True, False if any is False, else None (no
    verdicts, or some unknown): what did not run is not a failure."""
    if any(v is False for v in verdicts):
        return False
    if verdicts and all(v is True for v in verdicts):
        return True
    return None


def read_junit(path):
    if not path or not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = [c for s in suites for c in s.findall("testcase")]
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c.get("name") for c in cases if c.find("skipped") is not None
               or c.get("status") in ("notrun", "disabled")]
    return {"tests": len(cases), "failed": failed, "skipped": len(skipped),
            "passed": len(cases) - len(failed) - len(skipped)}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", default=[], metavar="KEY=SUMMARY_JSON")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--junit", default=None, help="ctest -L gpu --output-junit file")
    ap.add_argument("--steps-log", default=None, help="the script's step log (JSON lines)")
    ap.add_argument("--meta", default=None, help="JSON object merged in (gpu, commit, command, ...)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs-out", default=None,
                    help="also write the runs' launcher summaries here, as one JSON object by KEY")
    a = ap.parse_args(argv)
    try:
        result = json.loads(a.meta) if a.meta else {}
        result["runs"] = {}
        raw = {}
        for spec in a.run:
            key, sep, path = spec.partition("=")
            if not sep:
                ap.error("--run needs KEY=PATH, got %r" % spec)
            if os.path.exists(path):
                with open(path) as f:
                    raw[key] = json.load(f)
                run = summarize_run(raw[key], a.warmup)
                run["device"] = key.split("_", 1)[0]  # cuda_exact -> cuda
                result["runs"][key] = run
        result["ctest_gpu"] = read_junit(a.junit)
        steps = []
        if a.steps_log and os.path.exists(a.steps_log):
            with open(a.steps_log) as f:
                steps = [json.loads(line) for line in f if line.strip()]
        result["steps"] = steps
        result["skipped"] = [s for s in steps if s.get("skipped")]
        if a.runs_out:
            with open(a.runs_out, "w") as f:
                json.dump(raw, f)
                f.write("\n")
    except (OSError, ValueError, ET.ParseError) as e:
        print("e2e_summary.py: %s" % e, file=sys.stderr)
        return 2

    runs = result["runs"]
    targets = []
    for run, figure, limit, what in TARGETS:
        value = runs.get(run, {}).get(figure)
        status = "not measured" if value is None else ("met" if value <= limit else "missed")
        targets.append({"run": run, "figure": figure, "limit_us": limit, "value_us": value,
                        "status": status, "what": what})
    for sel in ("exact", "gaussiank"):
        g, c = runs.get("cuda_" + sel), runs.get("cpu_" + sel)
        if g and c and g.get("worker_overhead_us") and c.get("worker_overhead_us"):
            result.setdefault("cpu_over_gpu", {})[sel] = {
                "worker_overhead": round(c["worker_overhead_us"] / g["worker_overhead_us"], 2),
                "update_select_to_host": round(c["update_select_to_host_us"] / g["update_select_to_host_us"], 2),
            }
    result["targets"] = targets
    result["replicas_identical_all"] = all_of([r["replicas_identical"] for r in runs.values()])
    ct = result["ctest_gpu"]
    if ct:
        result["ctest_gpu_passed"] = ct["tests"] > 0 and not ct["failed"]
    else:
        # No JUnit file: ctest failed if it ran (crashed or timed out before
        # writing one), else it did not run, which is not a failure: null.
        ran = any(s.get("step") == "ctest_gpu" and not s.get("skipped") for s in steps)
        result["ctest_gpu_passed"] = False if ran else None
    with open(a.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(a.out + ".tmp", a.out)

    for t in targets:
        v = "-" if t["value_us"] is None else "%.1f us" % t["value_us"]
        print("target %-26s %-12s %s (limit %.0f us): %s" % (t["figure"], t["status"].upper(), v,
                                                              t["limit_us"], t["what"]))
    for key, r in runs.items():
        print("run %-14s step %s us, update+select+to-host %s us, overhead %s us, %s B/worker/step, "
              "replicas %s" % (key, r.get("step_us"), r.get("update_select_to_host_us"),
                               r.get("worker_overhead_us"), r.get("sent_bytes_per_worker_per_step"),
                               {True: "identical", False: "DIFFER"}.get(r["replicas_identical"], "unknown")))
    if ct:
        print("ctest -L gpu: %d passed, %d failed, %d skipped" % (ct["passed"], len(ct["failed"]), ct["skipped"]))
    for s in result["skipped"]:
        print("skipped %s: %s" % (s.get("step"), s.get("why")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
