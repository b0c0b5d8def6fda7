#!/usr/bin/env python3
"""`<binary> --help` lists every flag that <flags.md> documents.

Usage: help_test.py BINARY FLAGS_MD. The flags documented are the
backquoted `--name` in the first column of the markdown tables; --help
prints them with underscores (Abseil's spelling; both are accepted).
"""
import re
import subprocess
import sys


def main():
    binary, flags_md = sys.argv[1], sys.argv[2]
    documented = set()
    for line in open(flags_md, encoding="utf-8"):
        m = re.match(r"\|\s*`--([a-z0-9-]+)`", line)
        if m:
            documented.add(m.group(1).replace("-", "_"))
    if not documented:
        print("no flags found in %s" % flags_md)
        return 1
    r = subprocess.run([binary, "--help"], capture_output=True, text=True,
                       timeout=30)
    out = r.stdout + r.stderr
    if "No flags matched" in out:
        print("--help matched no flags:\n" + out)
        return 1
    listed = set(re.findall(r"^\s+--([a-z0-9_]+)", out, re.M))
    missing = sorted(documented - listed)
    if missing:
        print("documented in %s but not in --help: %s\n%s" % (
            flags_md, ", ".join(missing), out))
        return 1
    print("%d documented flags listed by %s --help" % (len(documented), binary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
