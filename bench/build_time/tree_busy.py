#!/usr/bin/env python3
"""How many cores a process tree keeps busy, sampled every few seconds.

usage: tree_busy.py PID [SECONDS]

Prints one line per sample, "elapsed_s cores_busy": the CPU-seconds (user +
sys, children that were reaped included) the tree under PID used in the
interval, over the interval's length. Ends when PID exits. For reading the
shape of a `ctest -j` run (docs/testing.md): e.g.
  ctest --test-dir build -j 6 & bench/build_time/tree_busy.py $! > busy.txt
Linux only (/proc); a process that leaves the tree (re-parented to init)
is no longer counted.
"""
import os
import sys
import time


def tree_cpu_seconds(root):
    """CPU-seconds of root and its descendants (utime, stime, cutime,
    cstime of /proc/<pid>/stat)."""
    parent, used = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        pid = int(name)
        parent[pid] = int(fields[1])
        used[pid] = sum(int(x) for x in fields[11:15])
    children = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    root = int(sys.argv[1])
    period = float(sys.argv[2]) if len(sys.argv) == 3 else 5.0
    start = last_t = time.monotonic()
    last = tree_cpu_seconds(root)
    while True:
        time.sleep(period)
        if not os.path.exists(f"/proc/{root}"):
            break
        now, cpu = time.monotonic(), tree_cpu_seconds(root)
        print(f"{now - start:.0f} {(cpu - last) / (now - last_t):.2f}",
              flush=True)
        last, last_t = cpu, now


if __name__ == "__main__":
    main()
