"""The model's per-operation costs, read from the measurements in
bench/results/ (each file records the command that produced it; see
bench/model/README.md for the table). Seconds, bytes.

load_costs() returns a dict: numbers, plus functions of P or S or n where a
cost depends on them (merge per pair vs P, threshold exchange vs S, GPU
selection vs n). describe() turns it into JSON with each figure's source.
"""

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "bench", "results")
CUDA = os.path.join(RESULTS, "cuda", "2026-11-30_h200", "cuda_select.json")

# One-way latency of a datacenter Ethernet hop for the predictions (an
# assumption, not measured here: the testbed's veth latency is inside the
# measured per-message overhead).
PREDICTION_LATENCY_S = 25e-6
# The cores of the machine that measured bench/results/aggregation.json
# (bench/results/README.md: the 2-core development VM).
AGGREGATION_CORES = 2


def _load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def load_costs(results=None):
    """Reads the result files; `results` overrides the directory (tests)."""
    global RESULTS
    if results:
        RESULTS = results
    src = {}
    sel = _load("cpu_select.json")
    d = next(x for x in sel["densities"] if x["density"] == 0.001)
    n_sel = sel["n"]
    c = {"cpu_select_per_element": d["exact_ms"] * 1e-3 / n_sel}
    src["cpu_select_per_element"] = "cpu_select.json exact_ms, density 0.001: %s" % sel["command"]

    codec = _load("codec.json")
    cv = next(x for x in codec["codecs"]
              if x["index"] == "delta-varint" and x["value"] == "fp32")
    c["pair_bytes"] = cv["bytes_per_pair"]
    c["encode_per_pair"] = 8 / (cv["encode_gb_per_s"] * 1e9)
    c["decode_per_pair"] = 8 / (cv["decode_gb_per_s"] * 1e9)
    for k in ("pair_bytes", "encode_per_pair", "decode_per_pair"):
        src[k] = "codec.json delta-varint + fp32 (server default): %s" % codec["command"]

    merge = _load("merge.json")
    pts = [(math.log2(r["P"]), r["sparse_sum_us"] * 1e-6 / r["pairs"])
           for r in merge["sum"]]
    # Least squares a + b log2 P over the measured P (2, 8, 32).
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    c["merge_a"], c["merge_b"] = a, b
    c["merge_per_pair"] = lambda P, a=a, b=b: a + b * math.log2(max(P, 2))
    src["merge_per_pair"] = ("merge.json sparse_sum_us / pairs at P = 2, 8, 32, "
                             "fitted a + b log2 P: %s" % merge["command"])
    tk = merge["sparse_topk_P32"]
    c["sparse_topk_per_entry"] = tk["us"] * 1e-6 / tk["sum_nnz"]
    src["sparse_topk_per_entry"] = "merge.json sparse_topk_P32 us / sum_nnz"

    agg = _load("aggregation.json")
    modes = {m["mode"]: m for m in agg["modes"]}
    k_agg = agg["density"] * agg["n"]
    # aggregation_bench runs P worker threads and S servers in one process
    # on the machine's cores (8 + 2 on 2): each phase's wall time is shared
    # by up to (P + S) / cores threads. Divided by that, the figures are a
    # dedicated machine's (an estimate; the unscaled ones are kept too).
    share = (agg["workers"] + agg["shards"]) / float(AGGREGATION_CORES)
    c["aggregation_thread_share"] = share
    c["apply_per_pair"] = modes["gtopk"]["apply_ms"] * 1e-3 / k_agg / share
    src["apply_per_pair"] = ("aggregation.json gtopk apply_ms / k / ((P + S) / "
                             "cores): %s" % agg["command"])
    dense = modes["dense"]
    c["dense_add_per_element"] = dense["server_merge_ms"] * 1e-3 / (
        agg["workers"] * agg["n"] / agg["shards"]) / share
    c["dense_codec_per_element"] = dense["encode_ms"] * 1e-3 / agg["n"] / share
    src["dense_add_per_element"] = ("aggregation.json dense server_merge_ms / "
                                    "(P n / S) / ((P + S) / cores)")
    src["dense_codec_per_element"] = ("aggregation.json dense encode_ms / n / "
                                      "((P + S) / cores)")

    ovh = _load("overhead.json")
    s1 = ovh["results"]["S1"]["communication_seconds_min_rank_p50"]
    s2 = ovh["results"]["S2"]["communication_seconds_min_rank_p50"]
    c["message_overhead"] = s1 / 2
    # A shard's CPU per message: not separable from the loopback round;
    # half the round's per-message cost (the other half is the worker's).
    c["message_cpu"] = s1 / 4
    c["threshold_exchange_S2"] = max(0.0, s2 - s1)
    c["threshold_exchange"] = lambda S, t=c["threshold_exchange_S2"], m=c["message_cpu"]: \
        0.0 if S <= 1 else t + (S - 2) * m
    src["message_overhead"] = ("overhead.json S1 / 2 (push + pull of 100 pairs, "
                               "loopback, P = 2): %s" % ovh["command"])
    src["message_cpu"] = "overhead.json S1 / 4 (assumed half of a message's cost)"
    src["threshold_exchange"] = ("overhead.json S2 - S1 for S = 2; + one message_cpu "
                                 "per further shard at the leader")

    fit = shard_cpu_per_worker(c)
    if fit:
        c["message_cpu"], c["shard_cpu_fit"] = fit
        src["message_cpu"] = ("lowbw.json gtopk runs: each shard's CPU seconds "
                              "per timed step (user + system, /proc) fitted "
                              "a + b P per S; b minus the modelled merge and "
                              "decode of k/S pairs, halved (a push and a pull "
                              "per worker)")

    try:
        cu = json.load(open(CUDA))
        rows = {(r["n"], r["method"]): r["us"] for r in cu["rows"]
                if r["density"] == 0.001}
        ns = sorted({n for n, _ in rows if n > 1000})
        pts = [(n, (rows[(n, "fused_update")] + rows[(n, "exact_after_update")]) * 1e-6)
               for n in ns]
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        slope = (t1 - t0) / (n1 - n0)
        c["gpu_select"] = lambda n, n0=n0, t0=t0, s=slope: max(0.0, t0 + s * (n - n0))
        c["gpu_select_points"] = pts
        src["gpu_select"] = ("cuda/2026-11-30_h200/cuda_select.json fused_update + "
                             "exact_after_update, density 0.001, linear in n: %s"
                             % cu["command"])
    except (OSError, KeyError, StopIteration):
        c["gpu_select"] = lambda n, s=c["cpu_select_per_element"]: n * s
        src["gpu_select"] = "no GPU figures: the CPU's"

    try:
        lc = _load("link_check.json")
        c["link_check"] = {r["rate"]: r["one_stream_gbit_per_s"] for r in lc["results"]}
        src["link_check"] = "link_check.json one_stream_gbit_per_s: %s" % lc["command"]
    except OSError:
        c["link_check"] = {}
    c["latency"] = 0.0  # the testbed's; predictions pass PREDICTION_LATENCY_S
    c["prediction_latency"] = PREDICTION_LATENCY_S
    c["_sources"] = src
    return c


def shard_cpu_per_worker(c, name="lowbw.json"):
    """The shard's CPU per message, from the measured shard CPU time of the
    gtopk runs in bench/results/lowbw.json (CPU seconds, unlike wall times,
    barely change with the machine's load). None when there are not two P
    for some S."""
    try:
        lowbw = _load(name)
    except OSError:
        return None
    n, rho = lowbw["config"]["n"], lowbw["config"]["density"]
    by_s = {}
    for r in lowbw["runs"]:
        t = r.get("shard_cpu_seconds_per_timed_step")
        if r["method"] != "gtopk" or not t or r.get("baseline"):
            continue
        S = max(1, r.get("shards") or 1)
        by_s.setdefault(S, []).append((r["workers"], sum(t) / len(t)))
    per_msg, fits = [], {}
    for S, pts in by_s.items():
        if len({P for P, _ in pts}) < 2:
            continue
        mx = sum(P for P, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        b = sum((P - mx) * (y - my) for P, y in pts) / \
            sum((P - mx) ** 2 for P, _ in pts)
        ks = rho * n / S
        Pm = max(P for P, _ in pts)
        m = (b - ks * (c["merge_per_pair"](Pm) + c["decode_per_pair"])) / 2
        fits[str(S)] = {"points": pts, "slope_seconds_per_worker": b,
                        "message_cpu": m}
        per_msg.append(m)
    if not per_msg:
        return None
    return max(1e-6, sum(per_msg) / len(per_msg)), fits


def describe(c):
    out = {}
    for k, v in c.items():
        if k.startswith("_") or callable(v):
            continue
        out[k] = v
    out["merge_per_pair_at_P"] = {str(P): c["merge_per_pair"](P) for P in (2, 8, 32, 256)}
    out["threshold_exchange_at_S"] = {str(S): c["threshold_exchange"](S) for S in (2, 4, 16)}
    out["gpu_select_at_n"] = {str(n): c["gpu_select"](n) for n in (25557032, 110000000, 138357544)}
    out["sources"] = c["_sources"]
    return out
