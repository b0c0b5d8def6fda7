#!/usr/bin/env python3
"""CTest for bench/cuda/device_check's non-GPU paths (and a tiny GPU run
where a device exists): argument handling, torch-timings merge, JSON output.

usage: device_check_test.py <device_check binary>
"""
import json
import os
import subprocess
import sys
import tempfile


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True,
                          timeout=120)


def main():
    binary = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        # Bad arguments: usage, exit 2, no JSON.
        for bad in (["--sizes=0"], ["--iters=5"], ["--densities=1.5"],
                    ["--bogus"], ["--sizes=1,x"]):
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
    for f in failures:
        print("FAIL", f)
    print("device_check_test: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
