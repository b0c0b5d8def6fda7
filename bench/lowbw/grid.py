#!/usr/bin/python3
"""The issue-20 grid of the low-bandwidth benchmark: lowbw.py once per
(rate, S), each into bench/results/lowbw_grid/<rate>-s<S>.json, then all of
them merged into bench/results/lowbw.json (the same top-level keys as one
lowbw.py result; every run carries its own "rate" and "shards"). DDP does
not use shards, so it runs once per rate (with S = 1); the P = 1 baselines
too. Needs root, like lowbw.py.

  /usr/bin/python3 bench/lowbw/grid.py                 # the whole grid
  /usr/bin/python3 bench/lowbw/grid.py --merge-only    # re-merge the parts
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PARTS = os.path.join(ROOT, "bench", "results", "lowbw_grid")


def part_path(rate, shards):
    return os.path.join(PARTS, "%s-s%d.json" % (rate, shards))


def merge(out, command):
    parts = sorted(glob.glob(os.path.join(PARTS, "*.json")))
    runs, baselines, machines, configs = [], {}, [], []
    for p in parts:
        with open(p) as f:
            r = json.load(f)
        c = r["config"]
        rate = c["rate_per_link_each_direction"]
        for run in r["runs"]:
            run["rate"] = rate
            runs.append(run)
        if r.get("baseline_single_worker_seconds"):
            baselines[rate] = r["baseline_single_worker_seconds"]
        # One entry per part: where, when, at which commit and load.
        machines.append(dict(r["machine"], part=os.path.relpath(p, ROOT),
                             date_utc=r["date_utc"],
                             wall_seconds=r["wall_seconds"],
                             git_commit=r["git_commit"],
                             command=r["command"]))
        configs.append(c)
    for rate in {run["rate"] for run in runs}:  # compute only: any rate's
        if rate not in baselines and baselines:
            baselines[rate] = dict(next(iter(baselines.values())),
                                   measured_at=next(iter(baselines)))
    eff = {}
    for run in runs:
        b = baselines.get(run["rate"], {})
        t1 = b.get("ddp" if run["method"] == "ddp" else "gtopk-server")
        if t1 and not run.get("baseline"):
            run["scaling_efficiency"] = t1 / run["step_seconds_p50"]
            eff.setdefault(run["rate"], {}).setdefault(
                "%s-s%d" % (run["method"], run["shards"]), {})[
                str(run["workers"])] = round(run["scaling_efficiency"], 4)
    c0 = configs[0] if configs else {}
    doc = {
        "command": command,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parts": [m["part"] for m in machines],
        "machine": machines,
        "config": dict(c0, rate_per_link_each_direction=sorted(
            {c["rate_per_link_each_direction"] for c in configs}),
            shards=sorted({c["shards"] for c in configs}),
            workers=sorted({w for c in configs for w in c["workers"]}),
            methods=sorted({m for c in configs for m in c["methods"]})),
        "baseline_single_worker_seconds": baselines,
        "runs": runs,
        "runs_without_tc_limit": [],
        "scaling_efficiency": eff,
        "targets": {},
        "table_markdown": table(runs),
    }
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(out + ".tmp", out)
    return doc


def table(runs):
    lines = ["| rate | S | method | P | step | compute | local | communication "
             "| last pusher | worker CPU/step | shard CPU/step | load 1m | "
             "sent / received per worker per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["rate"], r["shards"], r["workers"], r["method"])
    for r in sorted((r for r in runs if not r.get("baseline")), key=key):
        lp = r.get("last_pusher_communication_seconds_p50")
        # CPU per timed step when sampled; else the whole run's per step
        # (start-up included, marked *).
        sc = r.get("shard_cpu_seconds_per_timed_step")
        star = ""
        if not sc and r.get("shard_cpu_seconds_per_step"):
            sc, star = r["shard_cpu_seconds_per_step"], "*"
        lines.append("| %s | %s | %s | %d | %.0f ms | %.0f ms | %.0f ms | %.1f ms "
                     "| %s | %s | %s | %.1f | %.1f KB / %.1f KB |" % (
                         r["rate"], r["shards"] or "-", r["method"], r["workers"],
                         r["step_seconds_p50"] * 1e3,
                         r["compute_seconds_p50"] * 1e3,
                         r["local_seconds_p50"] * 1e3,
                         r["communication_seconds_p50"] * 1e3,
                         "%.1f ms" % (lp * 1e3) if lp else "-",
                         "%.0f ms" % (r["worker_cpu_seconds_per_step_p50"] * 1e3)
                         if r.get("worker_cpu_seconds_per_step_p50") else "-",
                         "/".join("%.1f" % (x * 1e3) for x in sc) + " ms" + star
                         if sc else "-",
                         r["load_average_1m_before"],
                         r["sent_bytes_per_worker_per_step"] / 1e3,
                         r["received_bytes_per_worker_per_step"] / 1e3))
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--dense-workers", default="2",
                    help="P list for dense (each step moves 4n per worker; "
                    "'' for none)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "lowbw.json"))
    ap.add_argument("--merge-only", action="store_true")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="no P = 1 runs (merge takes another rate's)")
    ap.add_argument("--skip-existing", action="store_true",
                    help="keep parts already measured")
    a = ap.parse_args(argv)
    command = "bench/lowbw/grid.py " + " ".join(argv)
    if not a.merge_only:
        os.makedirs(PARTS, exist_ok=True)
        for rate in a.rates.split(","):
            for i, s in enumerate(int(x) for x in a.shards.split(",")):
                # DDP and the P = 1 baselines do not depend on S: once per
                # rate. Dense only at --dense-workers (slow on 2 cores).
                parts = [("", "topk,gtopk" + (",ddp" if i == 0 else ""),
                          a.workers, i == 0 and a.baselines)]
                if a.dense_workers:
                    parts.append(("-dense", "dense", a.dense_workers, False))
                for suffix, methods, workers, baseline in parts:
                    out = part_path(rate, s)[:-5] + suffix + ".json"
                    if a.skip_existing and os.path.exists(out):
                        continue
                    argv2 = [sys.executable, os.path.join(HERE, "lowbw.py"),
                             "--build-dir", a.build_dir, "--rate", rate,
                             "--shards", str(s), "--workers", workers,
                             "--methods", methods, "--steps", str(a.steps),
                             "--warmup", str(a.warmup), "--no-cpu-share",
                             "--out", out, "--plot", ""]
                    if not baseline:
                        argv2.append("--no-baseline")
                    print("grid: %s" % " ".join(argv2), flush=True)
                    rc = subprocess.run(argv2).returncode
                    if rc != 0:
                        print("grid: part %s failed (%d); going on" % (
                            out, rc), flush=True)
                    merge(a.out, command)  # after every part: partial results
    doc = merge(a.out, command)
    print(doc["table_markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
