#!/usr/bin/env python3
"""Step time with mutual TLS against plaintext in the same run
(docs/security.md, "Cost"): the local launcher (deploy/local/gtopk_local.py)
runs P workers and S shards on loopback with --model=synthetic:N, alternately
with --tls=mutual and --tls=off (ABAB...: drift of a shared machine falls on
both modes alike), and the median over runs of each run's rank-0 step time
p50 is compared. Writes bench/results/tls.json with the command, the load
average before and after each run, and every run's figures.

Usage: bench/tls/tls_bench.py [--pairs 2] [--workers 4] [--shards 2]
           [--n 25557032] [--steps 20] [--build-dir build] [--out FILE]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
LAUNCHER = os.path.join(ROOT, "deploy", "local", "gtopk_local.py")


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def run_once(args, tls, index):
    name = "tlsbench-%s-%d" % (tls, index)
    cmd = [sys.executable, LAUNCHER, "--name", name,
           "--runs-dir", args.runs_dir, "--build-dir", args.build_dir,
           "--workers", str(args.workers), "--shards", str(args.shards),
           "--model", "synthetic:%d" % args.n, "--steps", str(args.steps),
           "--density", str(args.density), "--prometheus", "off",
           "--tls", tls]
    before = loadavg()
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    wall = time.monotonic() - t0
    after = loadavg()
    if r.returncode != 0:
        sys.exit("%s failed (%d):\n%s" % (" ".join(cmd), r.returncode,
                                          r.stdout[-4000:]))
    with open(os.path.join(args.runs_dir, name, "summary.json")) as f:
        s = json.load(f)
    return {
        "tls": tls,
        "step_seconds_p50": s["step_seconds_p50"],
        "step_seconds_p50_max_over_ranks":
            s.get("step_seconds_p50_max_over_ranks"),
        "replica_checksums_match": s.get("replica_checksums_match"),
        "wall_seconds": round(wall, 1),
        "loadavg_before": before,
        "loadavg_after": after,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--n", type=int, default=25557032)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                 "tls.json"))
    args = p.parse_args()
    runs = []
    for i in range(args.pairs):
        for tls in ("mutual", "off"):
            r = run_once(args, tls, i)
            print("%-6s run %d: step p50 %.1f ms (load %s)" % (
                tls, i, 1000 * r["step_seconds_p50"], r["loadavg_before"]),
                flush=True)
            runs.append(r)
    med = {t: statistics.median(r["step_seconds_p50"] for r in runs
                                if r["tls"] == t) for t in ("mutual", "off")}
    overhead = med["mutual"] / med["off"] - 1
    result = {
        "what": "step time, mutual TLS vs plaintext, same run, ABAB order",
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] +
                            sys.argv[1:]),
        "workers": args.workers, "shards": args.shards, "n": args.n,
        "density": args.density, "steps_per_run": args.steps,
        "model": "synthetic:%d" % args.n, "network": "loopback",
        "machine": "%s, %d CPUs (shared)" % (platform.machine(),
                                             os.cpu_count()),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step_seconds_p50_median": med,
        "mtls_overhead_fraction": round(overhead, 4),
        "target_overhead_fraction": 0.05,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print("mTLS %.1f ms vs plaintext %.1f ms: %+.1f%% -> %s" % (
        1000 * med["mutual"], 1000 * med["off"], 100 * overhead, args.out))


if __name__ == "__main__":
    main()
