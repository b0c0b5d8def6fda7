#!/usr/bin/python3
"""Performance model of gtopk's step beyond one machine (issue 20).

Predicts, per synchronous step, the communication time of five ways to
exchange a gradient of n floats among P workers, each on its own link of
bandwidth B bytes/s per direction and latency alpha:

  gtopk_ps    ours: gTop-k through S shards (docs/design.md): each
              worker pushes k/S pairs to each shard, a shard sums the P
              pushes, agrees a global threshold with the leader (S > 1),
              keeps the global top-k of its range and every worker pulls it.
  topk_ps     ours, --mode=topk: the same push; the pull is the whole sum
              (the union of the P local top-k's, O(kP) per worker).
  dense_ps    ours, --mode=dense: n/S floats to each shard and back.
  gtopk_tree  the paper's gTop-k all-reduce (Shi et al., "A Distributed
              Synchronous SGD Algorithm with Global Top-k Sparsification for
              Low Bandwidth Networks", ICDCS 2019, arXiv:1901.04359): log2 P
              rounds of k pairs each way with a merge and top-k per round,
              then log2 P rounds of broadcast: 2 log2 P (alpha + 8k/B).
  topk_allgather  Top-k S-SGD: every worker receives the other P-1 workers'
              k pairs (recursive doubling: log2 P messages, (P-1) 8k bytes).
  ring        dense all-reduce (PyTorch DDP, NCCL/gloo ring): 2 (P-1)
              messages of 4n/P bytes; 2 (P-1)/P 4n bytes each way per worker.

A worker's NIC and a shard's NIC are shared by all their streams: a phase
in which P workers send to S shards takes max(worker bytes, shard bytes)/B.
Phases are store-and-forward (no overlap of push, merge and pull) and
communication is not overlapped with compute: the paper's model too.

Every CPU cost comes from a measurement on this machine (costs.load_costs
reads bench/results/*.json, each file naming its command). Units: seconds
and bytes throughout; rates in the CLI in Gbit/s.

  /usr/bin/python3 bench/model/scale_model.py            # writes scale_model.json + plots
  /usr/bin/python3 bench/model/scale_model.py --no-plots
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import costs as costs_mod  # noqa: E402

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

MODELS = {  # name: (n, assumed compute seconds per step on one GPU)
    "resnet50": (25557032, 0.10),
    "vgg16": (138357544, 0.15),
    "bert_base": (110000000, 0.12),
}
METHODS = ("gtopk_ps", "topk_ps", "dense_ps", "gtopk_tree",
           "topk_allgather", "ring")


class Link:
    """One NIC direction: `bandwidth` bytes/s, `latency` seconds per
    message. `bucket`/`line`: a tc tbf bucket (bytes) that a sender idle
    long enough finds full, drained at `line` bytes/s (the veth's own
    speed) before `bandwidth` applies; 0 for a plain link."""

    def __init__(self, bandwidth, latency=0.0, bucket=0.0, line=None):
        if bandwidth <= 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.bucket = float(bucket)
        self.line = float(line) if line else self.bandwidth

    def time(self, nbytes):
        """Seconds to move `nbytes` through this NIC direction (no
        latency)."""
        if nbytes <= 0:
            return 0.0
        if self.bucket <= 0:
            return nbytes / self.bandwidth
        burst = min(nbytes, self.bucket)
        return burst / self.line + (nbytes - burst) / self.bandwidth

    @staticmethod
    def gbit(rate, latency=0.0):
        return Link(rate * GBIT, latency)


def log2c(P):
    return math.ceil(math.log2(P)) if P > 1 else 0


def union_size(m, P, density):
    """Expected distinct indices among P independent random k-subsets of a
    range of m (k = density m): m (1 - (1 - density)^P)."""
    return m * (1.0 - (1.0 - density) ** P)


def gtopk_ps(n, P, S, link, c, density=0.001, shard_link=None):
    """Ours, gTop-k through S shards. Returns a dict of seconds and bytes:
    comm (the step's communication on the critical path), the phases,
    bytes per worker each way, shard NIC bytes and shard CPU per step."""
    sl = shard_link or link
    k = density * n
    ks = k / S
    b = c["pair_bytes"]
    push = max(link.time(k * b), sl.time(P * ks * b))
    merge = P * ks * (c["merge_per_pair"](P) + c["decode_per_pair"])
    select = union_size(n / S, P, density) * c["sparse_topk_per_entry"]
    thr = c["threshold_exchange"](S) if S > 1 else 0.0
    apply_ = ks * (c["apply_per_pair"] + c["encode_per_pair"])
    pull = max(sl.time(P * ks * b), link.time(k * b))
    decode = k * c["decode_per_pair"]
    fixed = 2 * (link.latency + c["message_overhead"])
    shard_cpu = merge + select + apply_ + \
        2 * P * c["message_cpu"] / c.get("shard_cores", 1)
    comm = fixed + push + pull + thr + decode + merge + select + apply_
    # A shard handles every worker's push and pull (2P messages) whatever
    # S is, spread over shard_cores cores (default 1: one core, as
    # measured): its CPU can bound the step.
    comm = max(comm, fixed + shard_cpu + thr)
    return {"comm": comm, "push": push, "pull": pull, "shard_cpu": shard_cpu,
            "threshold": thr, "sent": k * b, "received": k * b,
            "shard_nic_in": P * ks * b, "shard_nic_out": P * ks * b}


def topk_ps(n, P, S, link, c, density=0.001, shard_link=None):
    """Ours, --mode=topk: the pull is the union of the P local top-k's."""
    sl = shard_link or link
    k = density * n
    ks = k / S
    b = c["pair_bytes"]
    us = union_size(n / S, P, density)  # pairs a shard returns
    push = max(link.time(k * b), sl.time(P * ks * b))
    merge = P * ks * (c["merge_per_pair"](P) + c["decode_per_pair"])
    enc = us * c["encode_per_pair"]
    pull = max(sl.time(P * us * b), link.time(S * us * b))
    decode = S * us * (c["decode_per_pair"] + c["apply_per_pair"])
    fixed = 2 * (link.latency + c["message_overhead"])
    shard_cpu = merge + enc + 2 * P * c["message_cpu"] / c.get("shard_cores", 1)
    comm = fixed + push + merge + enc + pull + decode
    comm = max(comm, fixed + shard_cpu)
    return {"comm": comm, "push": push, "pull": pull, "shard_cpu": shard_cpu,
            "sent": k * b, "received": S * us * b,
            "shard_nic_in": P * ks * b, "shard_nic_out": P * us * b}


def dense_ps(n, P, S, link, c, density=None, shard_link=None):
    """Ours, --mode=dense: 4n/S bytes to each shard and back."""
    sl = shard_link or link
    up = 4.0 * n
    push = max(link.time(up), sl.time(P * up / S))
    merge = P * (n / S) * c["dense_add_per_element"]
    codec = 2 * n * c["dense_codec_per_element"]  # decode pull, server side
    pull = max(sl.time(P * up / S), link.time(up))
    fixed = 2 * (link.latency + c["message_overhead"])
    shard_cpu = merge + P * (n / S) * c["dense_codec_per_element"] \
        + 2 * P * c["message_cpu"] / c.get("shard_cores", 1)
    comm = fixed + push + merge + pull + codec
    comm = max(comm, fixed + shard_cpu)
    return {"comm": comm, "push": push, "pull": pull, "shard_cpu": shard_cpu,
            "sent": up, "received": up, "shard_nic_in": P * up / S,
            "shard_nic_out": P * up / S}


def gtopk_tree(n, P, S, link, c, density=0.001, shard_link=None):
    """The paper's gTop-k all-reduce: log2 P reduce rounds (send and
    receive k pairs of 8 bytes, merge the two, keep the top k) and log2 P
    broadcast rounds: 2 log2 P (alpha + o + 8k/B) + log2 P merges."""
    k = density * n
    r = log2c(P)
    msg = link.latency + c["message_overhead"] + link.time(8 * k)
    merge = 2 * k * (c["merge_per_pair"](2) + c["sparse_topk_per_entry"])
    comm = 2 * r * msg + r * merge
    return {"comm": comm, "sent": 2 * r * 8 * k, "received": 2 * r * 8 * k}


def topk_allgather(n, P, S, link, c, density=0.001, shard_link=None):
    """Top-k S-SGD: all-gather of every worker's k pairs (recursive
    doubling, log2 P messages, (P-1) 8k bytes each way), then a local sum
    of the P k pairs."""
    k = density * n
    r = log2c(P)
    comm = r * (link.latency + c["message_overhead"]) \
        + link.time(8 * k * (P - 1)) + P * k * c["merge_per_pair"](P)
    return {"comm": comm, "sent": 8 * k * (P - 1), "received": 8 * k * (P - 1)}


def ring(n, P, S, link, c, density=None, shard_link=None):
    """Ring all-reduce (DDP): reduce-scatter then all-gather, 2 (P-1)
    messages of 4n/P bytes each way: 2 (P-1)/P 4n bytes per worker per
    direction; (P-1)/P n additions."""
    if P == 1:
        return {"comm": 0.0, "sent": 0.0, "received": 0.0}
    nbytes = 2.0 * (P - 1) / P * 4 * n
    comm = 2 * (P - 1) * (link.latency + c["message_overhead"]) \
        + link.time(nbytes) + (P - 1) / P * n * c["dense_add_per_element"]
    return {"comm": comm, "sent": nbytes, "received": nbytes}


FUNCS = {"gtopk_ps": gtopk_ps, "topk_ps": topk_ps, "dense_ps": dense_ps,
         "gtopk_tree": gtopk_tree, "topk_allgather": topk_allgather,
         "ring": ring}


def local_seconds(method, n, c, device, density=0.001):
    """The worker's own work beside communication: selection and encoding
    for the sparse methods (GPU: the fused update + selection measured on
    the H200; CPU: exact selection), nothing for dense."""
    if method in ("dense_ps", "ring"):
        return 0.0
    sel = c["gpu_select"](n) if device == "gpu" else \
        n * c["cpu_select_per_element"]
    return sel + density * n * c["encode_per_pair"]


def step(method, n, P, S, rate_gbit, c, compute, device="gpu",
         density=0.001, latency=None):
    """Step, communication and scaling efficiency (t1 / step, t1 = compute:
    one worker alone needs no exchange, arXiv:1901.04359)."""
    link = Link.gbit(rate_gbit, c["prediction_latency"] if latency is None
                     else latency)
    r = FUNCS[method](n, P, S, link, c, density=density)
    loc = local_seconds(method, n, c, device, density)
    t = compute + loc + r["comm"]
    return dict(r, local=loc, compute=compute, step=t,
                efficiency=compute / t)


def best_shards(n, P, rate_gbit, c, density=0.001, tolerance=1.10,
                s_max=None, compute=None, step_tolerance=0.02):
    """The fewest shards (powers of 2 up to P) whose gtopk communication is
    within `tolerance` of the best over that range, or, given `compute`
    (seconds per step), whose step compute + communication is within
    `step_tolerance` of the best step: fewer and the shards' NICs or CPUs
    bound the step."""
    s_max = s_max or max(1, P)
    link = Link.gbit(rate_gbit, c["prediction_latency"])
    cands = [1]
    while cands[-1] * 2 <= s_max:
        cands.append(cands[-1] * 2)
    times = {S: gtopk_ps(n, P, S, link, c, density)["comm"] for S in cands}
    best = min(times.values())
    for S in cands:
        if compute is None and times[S] <= tolerance * best:
            return S, times
        if compute is not None and \
                compute + times[S] <= (1 + step_tolerance) * (compute + best):
            return S, times
    return cands[-1], times


# -- validation against bench/results/lowbw.json ------------------------------

VALIDATED = {"gtopk": "gtopk_ps", "topk": "topk_ps", "dense": "dense_ps",
             "ddp": "ring"}


def testbed_link(rate, c):
    """The lowbw links: tbf at `rate` (its bucket: 8 ms at the rate, at least
    64 KiB; full after a step's compute) over a veth whose own speed is what
    link_check measured without a limit; the rate itself capped at what
    link_check measured with it."""
    lc = c["link_check"]
    nominal = float(rate.replace("gbit", "")) * GBIT
    measured = lc.get(rate, nominal / GBIT) * GBIT
    line = lc.get("unlimited", measured / GBIT) * GBIT
    bucket = max(65536.0, nominal * 0.008)
    return Link(min(nominal, measured), c["latency"], bucket=bucket,
                line=max(line, min(nominal, measured)))


CPU_KEYS = ("encode_per_pair", "decode_per_pair", "sparse_topk_per_entry",
            "apply_per_pair", "dense_add_per_element",
            "dense_codec_per_element", "message_overhead", "message_cpu")


def scale_cpu(c, f):
    """The costs with every CPU figure times `f` (f = 1: unchanged): the
    measured runs share 2 cores with other work, so each process gets
    about cores / load of a core."""
    s = dict(c)
    for key in CPU_KEYS:
        s[key] = c[key] * f
    s["merge_per_pair"] = lambda P, m=c["merge_per_pair"]: m(P) * f
    s["threshold_exchange"] = lambda S, t=c["threshold_exchange"]: t(S) * f
    return s


def validate(lowbw, c, cores=None):
    """Per measured run: the model's communication time beside the
    measured one; also with the CPU costs scaled by the run's contention
    max(1, load / cores) (the load average before the run)."""
    if cores is None:
        m = lowbw.get("machine")
        m = m[0] if isinstance(m, list) and m else (m or {})
        cores = m.get("cores") or os.cpu_count()
    rows = []
    for r in lowbw["runs"]:
        if r.get("baseline") or r["method"] not in VALIDATED:
            continue
        rate = r.get("rate") or lowbw["config"]["rate_per_link_each_direction"]
        if rate == "unlimited":
            continue
        link = testbed_link(rate, c)
        P, S = r["workers"], max(1, r.get("shards") or 1)
        cfg = lowbw["config"]
        pred = FUNCS[VALIDATED[r["method"]]](cfg["n"], P, S, link, c,
                                             density=cfg["density"])
        measured = r["last_pusher_communication_seconds_p50"] \
            if r["method"] != "ddp" else r["communication_seconds_p50"]
        if not measured:
            continue
        err = pred["comm"] / measured - 1
        f = max(1.0, (r.get("load_average_1m_before") or 0) / cores)
        contended = FUNCS[VALIDATED[r["method"]]](
            cfg["n"], P, S, link, scale_cpu(c, f), density=cfg["density"])
        err_c = contended["comm"] / measured - 1
        rows.append({
            "method": r["method"], "rate": rate, "workers": P,
            "shards": r.get("shards"),
            "measured_communication_seconds": round(measured, 5),
            "measured_is": "last pusher" if r["method"] != "ddp" else
            "backward - backward without all-reduce",
            "measured_mean_rank_communication_seconds": round(
                r["communication_seconds_p50"], 5),
            "predicted_communication_seconds": round(pred["comm"], 5),
            "error": round(err, 3), "within_25_percent": abs(err) <= 0.25,
            "contention_factor": round(f, 2),
            "predicted_contended_communication_seconds": round(
                contended["comm"], 5),
            "error_contended": round(err_c, 3),
            "load_average_1m_before": r.get("load_average_1m_before"),
            "worker_cpu_seconds_per_step_p50":
                r.get("worker_cpu_seconds_per_step_p50"),
            "shard_cpu_seconds_per_step": r.get("shard_cpu_seconds_per_step"),
            "predicted_shard_cpu_seconds": round(pred.get("shard_cpu", 0), 5),
        })
    return rows


# -- the predictions ------------------------------------------------------------

PS = (4, 8, 16, 32, 64, 128, 256)
RATES = (1, 10, 25)


def predictions(c):
    out = []
    for model, (n, compute) in MODELS.items():
        for rate in RATES:
            for P in PS:
                S_best, _ = best_shards(n, P, rate, c, compute=compute)
                for m in METHODS:
                    S = S_best if m.endswith("_ps") else 0
                    if m == "dense_ps":
                        S = P  # dense needs S = P for worker-bound links
                    r = step(m, n, P, max(S, 1), rate, c, compute)
                    out.append({"model": model, "n": n, "rate_gbit": rate,
                                "workers": P, "method": m, "shards": S,
                                "compute_seconds": compute,
                                "local_seconds": round(r["local"], 6),
                                "communication_seconds": round(r["comm"], 6),
                                "step_seconds": round(r["step"], 6),
                                "scaling_efficiency": round(r["efficiency"], 4),
                                "sent_bytes_per_worker": round(r["sent"]),
                                "received_bytes_per_worker":
                                    round(r["received"])})
    return out


def headline(c, P=32, rate=1):
    """The seed's configuration: 32 workers, 1 Gbit/s. The paper reports
    gTop-k at 2.7-12x the scaling efficiency of dense S-SGD and 1.1-1.7x
    of Top-k S-SGD (arXiv:1901.04359, 32 GPUs, 1 GbE)."""
    rows = []
    for model, (n, compute) in MODELS.items():
        e = {m: step(m, n, P, best_shards(n, P, rate, c, compute=compute)[0]
                     if m != "dense_ps" else P, rate, c, compute)["efficiency"]
             for m in METHODS}
        rows.append({"model": model, "n": n, "workers": P, "rate_gbit": rate,
                     "efficiency": {m: round(v, 4) for m, v in e.items()},
                     "gtopk_tree_over_ring": round(e["gtopk_tree"] / e["ring"], 2),
                     "gtopk_tree_over_topk_allgather":
                         round(e["gtopk_tree"] / e["topk_allgather"], 2),
                     "gtopk_ps_over_ring": round(e["gtopk_ps"] / e["ring"], 2),
                     "gtopk_ps_over_topk_allgather":
                         round(e["gtopk_ps"] / e["topk_allgather"], 2)})
    return {"rows": rows, "paper": {
        "source": "Shi et al., ICDCS 2019, arXiv:1901.04359: 32 GPUs on "
                  "1 Gbit/s Ethernet",
        "gtopk_over_dense_ssgd": [2.7, 12.0],
        "gtopk_over_topk_ssgd": [1.1, 1.7]}}


def capacity(c, density=0.001):
    rows = []
    for model in ("resnet50", "bert_base", "vgg16"):
        n, compute = MODELS[model]
        for rate in RATES:
            for P in (8, 16, 32, 64, 128, 256):
                S, times = best_shards(n, P, rate, c, density, compute=compute)
                link = Link.gbit(rate, c["prediction_latency"])
                r = gtopk_ps(n, P, S, link, c, density)
                rows.append({"model": model, "n": n, "rate_gbit": rate,
                             "workers": P, "shards": S,
                             "communication_seconds": round(r["comm"], 5),
                             "communication_seconds_S1": round(times[1], 5),
                             "shard_nic_bytes_each_way": round(r["shard_nic_in"]),
                             "shard_cpu_seconds": round(r["shard_cpu"], 5)})
    return rows


# -- plots (gnuplot, as bench/lowbw does) ----------------------------------------

def plot(preds, path, key, ylabel, model="resnet50", logy=True):
    tmp = tempfile.mkdtemp(prefix="gtopk-model-plot-")
    script = ['set terminal pngcairo size 1500,480 font "sans,10" noenhanced',
              "set output '%s'" % path,
              "set multiplot layout 1,3 title 'model: %s (n = %d), %s'" % (
                  model, MODELS[model][0], ylabel),
              "set logscale x 2", "set grid", "set key top left font ',8'",
              "set xlabel 'workers P'", "set ylabel '%s'" % ylabel,
              "set xrange [3:300]"]
    if logy:
        script.append("set logscale y 10")
    for rate in RATES:
        series = []
        for m in METHODS:
            d = os.path.join(tmp, "%s-%d.dat" % (m, rate))
            with open(d, "w") as f:
                for p in preds:
                    if p["model"] == model and p["rate_gbit"] == rate and \
                            p["method"] == m:
                        f.write("%d %g\n" % (p["workers"], p[key]))
            series.append((m, d))
        script.append("set title '%d Gbit/s'" % rate)
        script.append("plot " + ", ".join(
            "'%s' using 1:2 with linespoints lw 2 title '%s'" % (d, m)
            for m, d in series))
    script.append("unset multiplot")
    r = subprocess.run(["gnuplot"], input="\n".join(script) + "\n",
                       text=True, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise RuntimeError("gnuplot: " + r.stderr)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lowbw", default=",".join(
        os.path.join(ROOT, "bench", "results", f) for f in
        ("lowbw_2026-11-30_idle.json", "lowbw.json")),
        help="comma list of lowbw results to validate against")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "scale_model.json"))
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    ap.add_argument("--shard-cores", type=int, default=1,
                    help="cores a shard spreads its per-message work over in "
                    "the predictions (default 1; the validation always 1)")
    a = ap.parse_args(argv)
    c = costs_mod.load_costs()
    val = []
    for path in a.lowbw.split(","):
        with open(path) as f:
            lowbw = json.load(f)
        for row in validate(lowbw, c):
            row["source"] = os.path.relpath(path, ROOT)
            val.append(row)
    cp = dict(c, shard_cores=a.shard_cores)
    preds = predictions(cp)
    doc = {"command": "bench/model/scale_model.py " + " ".join(argv),
           "inputs": costs_mod.describe(c),
           "assumed_compute_seconds": {m: v[1] for m, v in MODELS.items()},
           "assumptions": [
               "phases store-and-forward, no overlap of communication with "
               "compute (as the paper's model)",
               "compute per step per model is an assumption (one modern GPU), "
               "not a measurement; step and communication times do not depend "
               "on it, efficiencies do",
               "worker local time: the H200's fused update + exact selection "
               "(bench/results/cuda), linear in n; encoding on the CPU",
               "links: bandwidth per direction, full duplex, one NIC per "
               "worker and per shard, shared by all their streams",
               "topk_ps/gtopk_ps union sizes for independent random top-k's"],
           "validation": {"against": [os.path.relpath(p, ROOT)
                                      for p in a.lowbw.split(",")],
                          "rows": val,
                          "within_25_percent": sum(r["within_25_percent"]
                                                   for r in val),
                          "of": len(val)},
           "shard_cores": a.shard_cores,
           "headline_P32_1gbit": headline(cp),
           "capacity": capacity(cp),
           "capacity_8_core_shards": capacity(dict(c, shard_cores=8)),
           "predictions": preds}
    with open(a.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(a.out + ".tmp", a.out)
    if a.plots:
        res = os.path.dirname(a.out)
        for model in MODELS:
            plot(preds, os.path.join(res, "scale_model_efficiency_%s.png" % model),
                 "scaling_efficiency", "scaling efficiency", model, logy=False)
            plot(preds, os.path.join(res, "scale_model_comm_%s.png" % model),
                 "communication_seconds", "communication time per step (s)",
                 model)
    doc["markdown"] = {"validation": markdown_validation(val),
                       "headline": markdown_headline(doc["headline_P32_1gbit"]),
                       "capacity": markdown_capacity(doc["capacity"]),
                       "capacity_8_core_shards": markdown_capacity(
                           doc["capacity_8_core_shards"])}
    with open(a.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(a.out + ".tmp", a.out)
    for v in doc["markdown"].values():
        print(v + "\n")
    return 0


def markdown_headline(h):
    lines = ["| model | gtopk_ps | gtopk_tree | topk_allgather | topk_ps | ring | "
             "dense_ps | gtopk_tree / ring | gtopk_tree / topk_allgather | "
             "gtopk_ps / ring | gtopk_ps / topk_allgather |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in h["rows"]:
        e = r["efficiency"]
        lines.append("| %s | %.2f | %.2f | %.2f | %.2f | %.3f | %.3f | %.1f | %.2f "
                     "| %.1f | %.2f |" % (
                         r["model"], e["gtopk_ps"], e["gtopk_tree"],
                         e["topk_allgather"], e["topk_ps"], e["ring"],
                         e["dense_ps"], r["gtopk_tree_over_ring"],
                         r["gtopk_tree_over_topk_allgather"],
                         r["gtopk_ps_over_ring"],
                         r["gtopk_ps_over_topk_allgather"]))
    lines.append("| paper (arXiv:1901.04359) | | | | | | | 2.7-12 (vs dense "
                 "S-SGD) | 1.1-1.7 | | |")
    return "\n".join(lines)


def markdown_capacity(rows):
    Ps = sorted({r["workers"] for r in rows})
    lines = ["| model | rate | " + " | ".join("P = %d" % P for P in Ps) + " |",
             "|---|---|" + "---|" * len(Ps)]
    for model in ("resnet50", "bert_base", "vgg16"):
        for rate in RATES:
            cells = []
            for P in Ps:
                r = next(x for x in rows if x["model"] == model and
                         x["rate_gbit"] == rate and x["workers"] == P)
                cells.append("S = %d (%.0f ms)" % (
                    r["shards"], r["communication_seconds"] * 1e3))
            lines.append("| %s | %d Gbit/s | %s |" % (model, rate,
                                                      " | ".join(cells)))
    return "\n".join(lines)


def markdown_validation(rows):
    lines = ["| method | rate | S | P | measured comm | predicted | error | "
             "load / cores | predicted, CPU x load/cores | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %s | %s | %d | %.1f ms | %.1f ms | %+.0f %% | "
                     "%.1f | %.1f ms | %+.0f %% |" % (
                         r["method"], r["rate"], r["shards"] or "-",
                         r["workers"],
                         r["measured_communication_seconds"] * 1e3,
                         r["predicted_communication_seconds"] * 1e3,
                         r["error"] * 100, r["contention_factor"],
                         r["predicted_contended_communication_seconds"] * 1e3,
                         r["error_contended"] * 100))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
