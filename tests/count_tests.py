#!/usr/bin/env python3
"""The number of tests per CTest label, generated from a configured build.

Usage: python3 tests/count_tests.py [BUILD_DIR]   (make test-counts)

Prints a Markdown table: per label, the CTest entries and the gtest cases
they run. A gtest entry runs the cases its --gtest_filter selects (one per
case, a suite, or a shard of a suite: GTEST_TOTAL_SHARDS/GTEST_SHARD_INDEX);
they are listed from the built binary with --gtest_list_tests and
matched against the filter as gtest does. Any other
entry (a Python or shell test) counts as one. The README points here rather
than quoting numbers that go stale. Exits 1 when a gtest entry selects no
case (it would pass whatever the code does).
"""

import fnmatch
import json
import os
import subprocess
import sys
from collections import defaultdict


def binary_cases(exe, cache):
    """Every case of the gtest binary exe ("Suite.Case"), in gtest's order."""
    if exe not in cache:
        out = subprocess.run([exe, "--gtest_list_tests"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        cases, suite = [], None
        for line in out.splitlines():
            if not line or line.startswith("Running main()"):
                continue
            if line.startswith("  "):
                cases.append(suite + line.split("#")[0].strip())
            else:
                suite = line.split("#")[0].strip()
        cache[exe] = cases
    return cache[exe]


def selected(cases, gtest_filter):
    """The cases gtest's --gtest_filter selects: "POS[:POS...][-NEG[:NEG...]]"
    with * and ? wildcards."""
    positive, _, negative = gtest_filter.partition("-")
    pos = positive.split(":") if positive else ["*"]
    neg = negative.split(":") if negative else []

    def match(name, patterns):
        return any(fnmatch.fnmatchcase(name, p) for p in patterns if p)

    return [c for c in cases if match(c, pos) and not match(c, neg)]


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    # ctest evaluates the gtest entries' include files (listing the suites
    # of binaries newer than their lists) before printing.
    doc = json.loads(subprocess.run(
        ["ctest", "--test-dir", build, "--show-only=json-v1"],
        capture_output=True, text=True, check=True).stdout)
    entries = defaultdict(int)
    cases = defaultdict(int)
    cache = {}
    all_entries = all_cases = 0
    empty = []
    for test in doc["tests"]:
        props = {p["name"]: p["value"] for p in test.get("properties", [])}
        labels = props.get("LABELS", []) or ["(none)"]
        if props.get("DISABLED"):
            continue
        command = test.get("command", [])
        filters = [a[len("--gtest_filter="):] for a in command
                   if a.startswith("--gtest_filter=")]
        n = 1
        if filters:
            chosen = selected(binary_cases(command[0], cache), filters[-1])
            env = dict(e.split("=", 1) for e in props.get("ENVIRONMENT", []))
            total = int(env.get("GTEST_TOTAL_SHARDS", "1"))
            index = int(env.get("GTEST_SHARD_INDEX", "0"))
            # gtest's sharding: the j-th selected case runs in shard j % total.
            n = len(chosen[index::total])
            if n == 0:
                empty.append(test["name"])
        all_entries += 1
        all_cases += n
        for label in labels:
            entries[label] += 1
            cases[label] += n
    print("| label | CTest entries | test cases |")
    print("|---|---:|---:|")
    for label in sorted(entries):
        print(f"| {label} | {entries[label]} | {cases[label]} |")
    print(f"| all | {all_entries} | {all_cases} |")
    print()
    print("Test cases: gtest cases, and 1 for each other entry (Python, "
          "shell); an entry with several labels counts under each.")
    if empty:
        # An entry that runs no case passes whatever the code does.
        print("count_tests: entries that select no gtest case: " +
              ", ".join(empty), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
