#!/usr/bin/env python3
"""Sums a cpulaunch.sh log: CPU-seconds (user+sys) per kind of command and
per target, and the costliest commands. A rebuilt output counts once (its
last line). Usage: cpusum.py CPULOG [N]."""
import re, sys, collections
last = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 4 or not re.match(r'^[0-9.]+$', p[0]):
        continue
    wall, u, s, out = float(p[0]), float(p[1]), float(p[2]), p[3]
    last[out] = (u + s, wall, out)
rows = list(last.values())
tot = sum(r[0] for r in rows)
def target(out):
    m = re.search(r'CMakeFiles/([^/]+)\.dir/', out)
    return m.group(1) if m else ('link:' + out.split('/')[-1])
def kind(out):
    if out.endswith('.gch'): return 'pch'
    if '.cu.o' in out: return 'nvcc'
    if out.endswith('.o'):
        return 'compile tests/' if out.startswith('tests/') else 'compile lib/other'
    return 'link/archive'
bykind = collections.Counter(); bytgt = collections.Counter()
for c, w, o in rows:
    bykind[kind(o)] += c
    bytgt[target(o)] += c
print('commands %d, CPU-s %.1f' % (len(rows), tot))
for k, v in bykind.most_common(): print('  %-20s %7.1f' % (k, v))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
print('by target (top %d):' % n)
for k, v in bytgt.most_common(n): print('  %-40s %7.1f' % (k, v))
print('top %d commands:' % n)
for c, w, o in sorted(rows, reverse=True)[:n]: print('  %6.1f %s' % (c, o))
