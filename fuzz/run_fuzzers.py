#!/usr/bin/env python3
"""Runs the libFuzzer harnesses of fuzz/ (docs/fuzzing.md).

Each harness runs alone (one process at a time), on its committed seed corpus
fuzz/corpus/<harness>/ (read only) plus a scratch corpus
SCRATCH/corpus/<harness>/ that receives the new inputs; crash, leak and
timeout inputs go to SCRATCH/artifacts/. The repository is never written,
except the --results JSON.

  --smoke        every harness for at most --runs executions or --seconds
                 seconds (the first reached); exit 1 on any crash, leak,
                 sanitizer report, timeout or out-of-memory.
  (default)      every harness for --seconds seconds (make fuzz: FUZZ_SECONDS),
                 the same failure rule; with --results, per harness:
                 executions, seconds, exec/s, final cov/ft, corpus size and
                 the exact command.

Standard library only.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

HARNESSES = [
    "codec_decode_fuzz",
    "codec_roundtrip_fuzz",
    "cluster_spec_fuzz",
    "server_requests_fuzz",
    "checkpoint_fuzz",
    "idx_reader_fuzz",
    "flag_values_fuzz",
]

# Out-of-memory and slow-input limits: a parser of a few KB that allocates
# 2 GB, or takes 25 s, is a finding (malloc_limit_mb: one allocation).
LIMITS = ["-rss_limit_mb=4096", "-malloc_limit_mb=2048", "-timeout=25"]

FAULT = re.compile(
    r"ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|"
    r"SUMMARY: |invariant violated|==\d+==ERROR")
STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


def run_one(binary, harness, repo, scratch, seconds, runs, log_dir):
    corpus = os.path.join(scratch, "corpus", harness)
    artifacts = os.path.join(scratch, "artifacts")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    seeds = os.path.join(repo, "fuzz", "corpus", harness)
    cmd = [binary, "-print_final_stats=1", f"-max_total_time={seconds}",
           f"-artifact_prefix={artifacts}/{harness}-"] + LIMITS
    if runs is not None:
        cmd.append(f"-runs={runs}")
    cmd += [corpus, seeds]
    env = dict(os.environ)
    # File readers write their input to a scratch file per execution.
    if "TMPDIR" not in env and os.path.isdir("/dev/shm"):
        env["TMPDIR"] = "/dev/shm"
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    log_path = os.path.join(log_dir, f"{harness}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    wall = time.monotonic() - start
    text = open(log_path, errors="replace").read()
    stats = {k: int(v) for k, v in re.findall(r"stat::(\w+):\s+(\d+)", text)}
    cov = ft = corp = None
    for line in text.splitlines():
        m = STATUS.match(line)
        if m:
            cov, ft, corp = int(m.group(2)), int(m.group(3)), int(m.group(4))
    faults = sorted(set(m.group(0) for m in FAULT.finditer(text)))
    result = {
        "harness": harness,
        "executions": stats.get("number_of_executed_units"),
        "seconds": round(wall, 1),
        "exec_per_sec": stats.get("average_exec_per_sec"),
        "cov": cov,
        "ft": ft,
        "corpus_items": corp,
        "new_units_added": stats.get("new_units_added"),
        "peak_rss_mb": stats.get("peak_rss_mb"),
        "slowest_unit_time_sec": stats.get("slowest_unit_time_sec"),
        "exit_code": rc,
        "faults": faults,
        "crashes": 0 if rc == 0 and not faults else 1,
        "command": " ".join(shlex.quote(c) for c in cmd),
        "log": log_path,
    }
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build-dir", default="build-fuzz")
    p.add_argument("--scratch", default="build-fuzz/fuzz-scratch")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seconds", type=int, default=300)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--only", default="",
                   help="comma list of harnesses (default: all)")
    p.add_argument("--seconds-for", default="",
                   help="per-harness seconds, e.g. server_requests_fuzz=600")
    p.add_argument("--results", default="",
                   help="write the figures to this JSON file")
    a = p.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    harnesses = [h for h in a.only.split(",") if h] or HARNESSES
    per = dict(kv.split("=") for kv in a.seconds_for.split(",") if kv)
    log_dir = os.path.join(a.scratch, "logs")
    os.makedirs(log_dir, exist_ok=True)
    results = []
    total_start = time.monotonic()
    for h in harnesses:
        binary = os.path.join(a.build_dir, "fuzz", h)
        if not os.access(binary, os.X_OK):
            print(f"fuzz: {binary} is missing (make fuzz-build)", file=sys.stderr)
            return 2
        seconds = int(per.get(h, a.seconds))
        r = run_one(binary, h, repo, a.scratch, seconds, a.runs, log_dir)
        results.append(r)
        print(f"fuzz: {h}: {r['executions']} runs in {r['seconds']} s "
              f"({r['exec_per_sec']}/s), cov {r['cov']} ft {r['ft']}, corpus "
              f"{r['corpus_items']}, exit {r['exit_code']}"
              + (f", FAULT {r['faults']} (log {r['log']})"
                 if r["crashes"] else ""), flush=True)
    total = {
        "executions": sum(r["executions"] or 0 for r in results),
        "seconds": round(time.monotonic() - total_start, 1),
        "crashes": sum(r["crashes"] for r in results),
        "harnesses": len(results),
    }
    print(f"fuzz: total {total['executions']} executions in "
          f"{total['seconds']} s, {total['crashes']} harness(es) with faults")
    if a.results:
        doc = {
            "what": "libFuzzer runs of every harness in fuzz/ (docs/fuzzing.md)",
            "mode": "smoke" if a.smoke else "long",
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{os.cpu_count()} cores (shared)",
            "command": " ".join(shlex.quote(c) for c in sys.argv),
            "total": total,
            "harnesses": results,
        }
        with open(a.results, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 1 if total["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
