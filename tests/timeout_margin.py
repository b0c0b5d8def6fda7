#!/usr/bin/env python3
"""Which CTest entries came close to their TIMEOUT in the last run.

Usage: python3 tests/timeout_margin.py BUILD_DIR [--fraction F] [--strict]

Reads the run's times from BUILD_DIR/ctest_junit.xml (make test and make
check pass --output-junit) and each entry's TIMEOUT from `ctest
--show-only=json-v1` (the entries without one get ctest's --timeout, 600 s
as make test runs it). Prints every entry that took more than F (default
0.25) of its TIMEOUT: on a slower or busier machine (a CI runner, two
builds at once) such an entry times out although nothing hangs; flags_test
did, at 180 s, on a fresh clone where it took 107 s on average here
(docs/testing.md, "Timeouts"). Exits 0 unless --strict, then 1 when any
entry is listed; 2 when the run's times cannot be read.
"""

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

DEFAULT_TIMEOUT_S = 600.0  # make test's ctest --timeout


def timeouts(build_dir):
    """{entry name: TIMEOUT in s} for every entry of the configured build."""
    out = subprocess.run(["ctest", "--test-dir", build_dir,
                          "--show-only=json-v1"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    result = {}
    for test in json.loads(out)["tests"]:
        props = {p["name"]: p["value"] for p in test.get("properties", [])}
        result[test["name"]] = float(props.get("TIMEOUT", DEFAULT_TIMEOUT_S))
    return result


def run_times(junit_path):
    """{entry name: seconds} from ctest's JUnit report."""
    root = ET.parse(junit_path).getroot()
    return {case.get("name"): float(case.get("time", "0"))
            for case in root.iter("testcase")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build_dir")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--strict", action="store_true")
    args = parser.parse_args()
    junit = os.path.join(args.build_dir, "ctest_junit.xml")
    try:
        times = run_times(junit)
    except (OSError, ET.ParseError) as e:
        print("timeout_margin: cannot read the run's times from %s: %s"
              % (junit, e), file=sys.stderr)
        return 2
    limits = timeouts(args.build_dir)
    close = sorted(((t / limits[n], n, t, limits[n])
                    for n, t in times.items()
                    if n in limits and t > args.fraction * limits[n]),
                   reverse=True)
    for share, name, t, limit in close:
        print("timeout_margin: %s took %.1f s, %.0f %% of its TIMEOUT %.0f s"
              % (name, t, 100 * share, limit))
    if close:
        print("timeout_margin: %d entr%s above %.0f %% of TIMEOUT: raise "
              "the TIMEOUT (set_tests_properties) before a slower machine "
              "runs out of it"
              % (len(close), "y" if len(close) == 1 else "ies",
                 100 * args.fraction))
    return 1 if close and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
