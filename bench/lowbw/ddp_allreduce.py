#!/usr/bin/python3
"""One rank of PyTorch DistributedDataParallel (gloo backend) all-reducing n
floats per step: the dense S-SGD users run today, the baseline of
bench/lowbw/lowbw.py. Debian's python3-torch (1.13, CPU).

The model is one flat parameter of n floats and a fixed input x of n floats;
loss = sum(w * x), so backward produces the gradient x (one pass over n) and
DDP all-reduces it in its buckets (gloo's ring all-reduce) before backward
returns. A step: sleep --compute-ms (the emulated compute, as
`gtopk-worker --compute-ms`), forward, backward (+ all-reduce), SGD update.

Communication time per step = backward time minus the median backward time
without the all-reduce (the same step under `ddp.no_sync()`, measured on
--local-steps steps before the timed ones).

Writes --out: {"rank", "world_size", "n", "cpu_user_seconds",
"cpu_system_seconds", "per_step": {"step_seconds", "compute_seconds",
"local_seconds", "communication_seconds", "cpu_seconds"}} (seconds, one
number per timed step, the same keys as `gtopk-worker --summary-json`).
Exit 0 on success, 1 on any error (printed).
"""

import argparse
import datetime
import json
import resource
import os
import statistics
import sys
import time


def wire_bytes(dev="eth0"):
    """(tx, rx) byte counters of `dev`, or (None, None)."""
    try:
        base = "/sys/class/net/%s/statistics/" % dev
        with open(base + "tx_bytes") as f, open(base + "rx_bytes") as g:
            return int(f.read()), int(g.read())
    except OSError:
        return None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--master", required=True, help="rank 0's host:port")
    ap.add_argument("--n", type=int, required=True, help="floats per step")
    ap.add_argument("--compute-ms", type=float, default=0.0)
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--local-steps", type=int, default=3,
                    help="steps under no_sync() that time the local backward")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    host, port = a.master.rsplit(":", 1)
    dist.init_process_group(
        "gloo", init_method="tcp://%s:%s" % (host, port), rank=a.rank,
        world_size=a.world_size,
        timeout=datetime.timedelta(seconds=a.timeout_s))

    class Flat(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            g = torch.Generator().manual_seed(a.seed)
            self.w = torch.nn.Parameter(torch.rand(n, generator=g) * 0.2 - 0.1)
            self.register_buffer(
                "x", torch.rand(n, generator=g.manual_seed(a.seed + 1 + a.rank))
                * 2 - 1)

        def forward(self):
            return (self.w * self.x).sum()

    # broadcast_buffers=False: DDP would otherwise broadcast rank 0's input
    # buffer x (n more floats) before every forward, ~1.5x the all-reduce's
    # bytes, which is not the dense S-SGD being compared.
    model = DDP(Flat(a.n), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(sync):
        t0 = time.perf_counter()
        if a.compute_ms > 0:
            time.sleep(a.compute_ms / 1e3)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if sync:
            model().backward()
        else:
            with model.no_sync():
                model().backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return t3 - t0, t1 - t0, t2 - t1, t3 - t2

    local = [step(False)[2] for _ in range(max(1, a.local_steps))]
    local_backward = statistics.median(local)
    dist.barrier()
    tx0, rx0 = wire_bytes()
    per = {"step_seconds": [], "compute_seconds": [], "local_seconds": [],
           "communication_seconds": [], "cpu_seconds": []}
    for _ in range(a.steps):
        cpu0 = time.process_time()
        total, compute, backward, update = step(True)
        per["cpu_seconds"].append(time.process_time() - cpu0)
        per["step_seconds"].append(total)
        per["compute_seconds"].append(compute + min(backward, local_backward))
        per["local_seconds"].append(update)
        per["communication_seconds"].append(max(0.0, backward - local_backward))
    tx1, rx1 = wire_bytes()
    dist.barrier()
    dist.destroy_process_group()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": a.rank, "world_size": a.world_size, "n": a.n,
                   "torch": torch.__version__,
                   "local_backward_seconds": local_backward,
                   # eth0's counters over the timed steps (frames, headers
                   # included); null outside a namespace with an eth0.
                   "wire_sent_bytes_per_step":
                       (tx1 - tx0) / a.steps if tx0 is not None else None,
                   "wire_received_bytes_per_step":
                       (rx1 - rx0) / a.steps if rx0 is not None else None,
                   # This process's CPU time over the whole run (user,
                   # system; all threads incl. gloo's), like gtopk-worker's.
                   "cpu_user_seconds": usage.ru_utime,
                   "cpu_system_seconds": usage.ru_stime,
                   "per_step": per}, f)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # report and fail; the harness prints the log
        print("ddp_allreduce: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        sys.exit(1)
