#!/usr/bin/env python3
"""torch.topk(g.abs(), k) and a device-to-device copy of g, timed with CUDA
events (median after warm-up), for deploy/device/device_check.sh.

Writes --out as JSON after every n (so a timeout keeps what was measured):
  {"available": bool, "version": str, "gpu": str, "note": str,
   "rows": [{"n", "density", "k", "topk_us", "copy_us"}]}
Without torch or without a CUDA device it writes available=false and a note,
and exits 0: the C++ check then times our kernels alone and says why.
"""
import argparse
import json
import math
import statistics
import sys


def write(path, doc):
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    import os
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,1000,25557032,138357544")
    ap.add_argument("--densities", default="0.0001,0.001,0.01")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    densities = [float(x) for x in a.densities.split(",")]
    doc = {"available": False, "version": "", "gpu": "", "note": "", "rows": []}
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        doc["note"] = "torch not importable: %s" % (e,)
        write(a.out, doc)
        print("torch_topk: " + doc["note"])
        return 0
    doc["version"] = torch.__version__
    if not torch.cuda.is_available():
        doc["note"] = "torch %s sees no CUDA device" % torch.__version__
        write(a.out, doc)
        print("torch_topk: " + doc["note"])
        return 0
    doc["available"] = True
    doc["gpu"] = torch.cuda.get_device_name(0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(a.seed)

    def timed(fn):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        samples = []
        for it in range(a.warmup + a.iters):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            if it >= a.warmup:
                samples.append(start.elapsed_time(stop) * 1000.0)
        return statistics.median(samples)

    for n in sizes:
        g = torch.randn(n, device="cuda", generator=gen, dtype=torch.float32)
        dst = torch.empty_like(g)
        copy_us = timed(lambda: dst.copy_(g))
        for d in densities:
            k = max(1, min(n, int(round(d * n))))
            topk_us = timed(lambda: torch.topk(g.abs(), k))
            doc["rows"].append({"n": n, "density": d, "k": k,
                                "topk_us": topk_us, "copy_us": copy_us})
            print("torch_topk: n=%d density=%g k=%d topk %.1f us, copy %.1f us"
                  % (n, d, k, topk_us, copy_us), flush=True)
        del g, dst
        torch.cuda.empty_cache()
        write(a.out, doc)
    write(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
