#!/usr/bin/python3
"""What the low-bandwidth benchmark's links really carry (issue 20): the
same namespaces, veth pairs, bridge and `tc tbf` as bench/lowbw/lowbw.py,
then one TCP stream of --bytes from host a to host b (Python sockets, 4 MiB
writes), and two streams at once from a and c into b (b's link is shared,
as a shard's is), at each --rates. Needs root.

  /usr/bin/python3 bench/lowbw/link_check.py --out bench/results/link_check.json

Writes --out: per rate the throughput (Gbit/s of payload) of one stream and
of two streams into one receiver, the command and the load average.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lowbw  # noqa: E402

PORT = 5201

SINK = r"""
import socket, sys, time
n = int(sys.argv[1]); conns = int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", %d)); s.listen(conns)
print("ready", flush=True)
cs = [s.accept()[0] for _ in range(conns)]
import selectors
sel = selectors.DefaultSelector()
for c in cs: sel.register(c, selectors.EVENT_READ)
got = 0; t0 = None; buf = bytearray(4 << 20); open_ = conns
while open_:
    for key, _ in sel.select():
        r = key.fileobj.recv_into(buf)
        if t0 is None: t0 = time.perf_counter()
        if r == 0:
            sel.unregister(key.fileobj); open_ -= 1
        got += r
print(got, time.perf_counter() - t0, flush=True)
""" % PORT

SOURCE = r"""
import socket, sys
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], %d))
buf = b"\0" * (4 << 20); sent = 0
while sent < n:
    sent += c.send(buf[:min(len(buf), n - sent)])
c.close()
""" % PORT


def transfer(topo, senders, receiver, nbytes):
    sink = subprocess.Popen(
        ["ip", "netns", "exec", topo.ns(receiver), sys.executable, "-c", SINK,
         str(nbytes), str(len(senders))], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    srcs = [subprocess.Popen(["ip", "netns", "exec", topo.ns(h),
                              sys.executable, "-c", SOURCE,
                              topo.ip(receiver), str(nbytes)])
            for h in senders]
    for p in srcs:
        p.wait(timeout=300)
    got, seconds = sink.stdout.readline().split()
    sink.wait(timeout=30)
    return int(got) * 8 / float(seconds) / 1e9


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit,unlimited")
    ap.add_argument("--bytes", type=int, default=1 << 30,
                    help="bytes per stream (default 1 GiB)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("link_check: needs root", file=sys.stderr)
        return 2
    topo = lowbw.Topology("glbw%d-" % os.getpid(), ["a", "b", "c"])
    results = []
    try:
        topo.up()
        for rate in a.rates.split(","):
            r = None if rate == "unlimited" else rate
            burst = "64kb"
            if r:
                m = lowbw.parse_args(["--rate", r])
                burst = m.burst
            topo.set_rate(r, burst)
            load = os.getloadavg()[0]
            one = transfer(topo, ["a"], "b", a.bytes)
            two = transfer(topo, ["a", "c"], "b", a.bytes)
            row = {"rate": rate, "burst": burst if r else None,
                   "one_stream_gbit_per_s": round(one, 3),
                   "two_streams_into_one_receiver_gbit_per_s": round(two, 3),
                   "load_average_1m_before": load}
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        topo.down()
    doc = {"command": "bench/lowbw/link_check.py " + " ".join(argv),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "bytes_per_stream": a.bytes, "cores": os.cpu_count(),
           "what": "TCP payload throughput through the lowbw topology "
                   "(veth to a bridge, tbf on both ends of every link)",
           "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
