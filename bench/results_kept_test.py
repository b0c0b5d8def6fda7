#!/usr/bin/env python3
"""A benchmark program writes its committed results file only from a full run.

`cpu_select_bench --benchmark_list_tests=true` used to overwrite
bench/results/cpu_select.json with zeros and NaNs (nothing had run), and a
filtered run would have written a summary of zeros for the benchmarks it
skipped. Each case runs in a scratch directory holding a sentinel at the
default path (bench/results/<name>.json, relative to the working directory)
and checks the sentinel is left byte for byte; an explicit --results_json
still gets a filtered run's summary, and nothing when nothing was measured.

usage: results_kept_test.py CPU_SELECT_BENCH
"""
import os
import re
import subprocess
import sys
import tempfile


def main():
    binary = os.path.abspath(sys.argv[1])
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "bench", "results"))
        default = os.path.join(tmp, "bench", "results", "cpu_select.json")
        sentinel = '{"sentinel": true}\n'
        explicit = os.path.join(tmp, "explicit.json")
        cases = [
            (["--benchmark_list_tests=true"], "nothing was measured", None),
            (["--benchmark_filter=no_such_benchmark"],
             "nothing was measured", None),
            (["--n=1000000", "--benchmark_filter=memcpy",
              "--benchmark_min_time=0.01"], "a filtered run", None),
            (["--benchmark_list_tests=true", "--results_json=" + explicit],
             "nothing was measured", None),
            (["--n=1000000", "--benchmark_filter=memcpy",
              "--benchmark_min_time=0.01", "--results_json=" + explicit],
             "wrote " + explicit, explicit),
        ]
        for args, said, written in cases:
            with open(default, "w") as f:
                f.write(sentinel)
            if os.path.exists(explicit):
                os.remove(explicit)
            r = subprocess.run([binary] + args, cwd=tmp, capture_output=True,
                               text=True, timeout=120)
            where = " ".join(args)
            if r.returncode != 0:
                failures.append("%s: exit %d: %s" % (where, r.returncode,
                                                      r.stderr[-500:]))
            if said not in r.stdout:
                failures.append("%s: stdout lacks %r: %r" %
                                (where, said, r.stdout[-500:]))
            if open(default).read() != sentinel:
                failures.append("%s: overwrote the default results file" %
                                where)
            if written is None:
                if os.path.exists(explicit):
                    failures.append("%s: wrote %s" % (where, explicit))
            else:
                # (Text, not json: a filtered run's summary prints the
                # ratios of the benchmarks it skipped as nan.)
                try:
                    text = open(written).read()
                    m = re.search(r'"memcpy_ms": ([0-9.]+)', text)
                    if m is None or not float(m.group(1)) > 0:
                        failures.append("%s: memcpy_ms in %r" %
                                        (where, text[:300]))
                except OSError as e:
                    failures.append("%s: %s" % (where, e))
    for f in failures:
        print("FAIL " + f)
    print("results_kept_test: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
