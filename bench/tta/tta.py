#!/usr/bin/python3
"""Time to accuracy on slow links (issue 43): the same PyTorch script, model,
seeds, data split, optimizer and number of epochs under PyTorch DDP (gloo)
as its users tune it -- fp32, fp16_compress_hook, powerSGD_hook at rank 1
and 4 -- and under gtopk (gtopk.torch.DistributedOptimizer around the same
torch optimizer, servers with --apply=workers) at density 0.01 and 0.001
(exact top-k) and 0.01 (Gaussian-k), at P workers (S shards for gtopk),
every link limited to each --rates rate. Needs root (network namespaces,
tc); uses the namespaces of bench/lowbw/lowbw.py.

  sudo make bench-tta                      # the whole benchmark (< 90 min)
  sudo /usr/bin/python3 bench/tta/tta.py --quick --out /tmp/q.json \\
      --plot-dir /tmp                      # the harness in < 10 min
  sudo /usr/bin/python3 bench/tta/tta.py --replot bench/results/tta.json

The script is examples/pytorch/train_modern.py --model mlp (a 784-3072-
3072-10 MLP, 11,882,506 parameters: a dense fp32 all-reduce of 48 MB per
step dominates a CPU step at 1 Gbit/s) --optimizer sgd (momentum 0.9,
linear warm-up then cosine decay), fp32. Rank 0 evaluates on the whole
Fashion-MNIST test set every --eval-every steps; the time spent evaluating
is left out of its clock (train_seconds). Every run stops at the end of
--epochs or at the first evaluation past --time-cap seconds of training,
except fp32 DDP at the first rate: it sets the target, so it always ends.

Measured per run: test accuracy against train_seconds and against step,
the time to reach the target accuracy (chosen before the other runs: the
accuracy fp32 DDP reaches at the end of the first rate's run, minus
--target-margin points; > cap when a run does not reach it), final
accuracy, bytes per worker per step (the script's own count -- gtopk
measures its messages, DDP's hooks are computed from the tensor sizes --
and eth0's transmitted bytes over the whole run, start-up and the initial
parameter broadcast included), and the step split (compute / selection /
communication / other; train_modern.py's step_split_p50).

Writes --out (JSON: the command, machine facts, the configuration, every
run with its evaluations, the targets' verdicts), one PNG per rate in
--plot-dir (tta_<rate>.png: accuracy against training time, and against
step), and prints a Markdown table. Exit: 0 done, 1 a run failed (its log
tail is printed), 2 bad arguments / not root / missing tools, 130
interrupted.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "lowbw"))
sys.path.insert(0, os.path.join(ROOT, "deploy", "local"))

import lowbw  # noqa: E402  (namespaces, processes, machine facts)
import training_plot  # noqa: E402  (the PNGs, shared with make demo)

SCRIPT = os.path.join(ROOT, "examples", "pytorch", "train_modern.py")
SERVER_PORT = 50051
DDP_PORT = 29500

# method -> how it runs. Order: the order of the table and the plots.
METHODS = {
    "ddp_fp32": {"backend": "ddp", "hook": "none"},
    "ddp_fp16": {"backend": "ddp", "hook": "fp16"},
    "ddp_powersgd_r1": {"backend": "ddp", "hook": "powersgd", "rank": 1},
    "ddp_powersgd_r4": {"backend": "ddp", "hook": "powersgd", "rank": 4},
    "gtopk_d0.01": {"backend": "gtopk", "density": 0.01,
                    "selector": "exact"},
    "gtopk_d0.001": {"backend": "gtopk", "density": 0.001,
                     "selector": "exact"},
    "gtopk_d0.01_gaussiank": {"backend": "gtopk", "density": 0.01,
                              "selector": "gaussiank"},
    # Layer-wise gTop-k with the pushes overlapped with backward
    # (--selection=layerwise, 25 MiB buckets; docs/overlap.md).
    "gtopk_d0.01_layerwise": {"backend": "gtopk", "density": 0.01,
                              "selector": "exact", "selection": "layerwise"},
}
QUICK_METHODS = ["ddp_fp32", "ddp_powersgd_r1", "gtopk_d0.01"]


class RunFailed(Exception):
    pass


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Time to accuracy of DDP (fp32, fp16, PowerSGD) and "
        "gtopk on rate-limited links (root).")
    p.add_argument("--rates", default="1gbit,100mbit",
                   help="comma list of tc rates; the first one's fp32 DDP "
                   "run sets the target")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma list of: " + ", ".join(METHODS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32,
                   help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=23,
                   help="steps between evaluations (23: ten per epoch of "
                   "30,000 samples at P = 4, batch 32)")
    p.add_argument("--time-cap", type=float, default=300,
                   help="seconds of training after which a run stops at "
                   "its next evaluation")
    p.add_argument("--train-limit", type=int, default=30000,
                   help="the first N training samples (0: all 60,000; "
                   "30,000 keeps the whole benchmark within an hour here)")
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--powersgd-start-iter", type=int, default=10)
    p.add_argument("--target-margin", type=float, default=0.005,
                   help="target = fp32 DDP's final accuracy minus this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mlp-width", type=int, default=None,
                   help="the MLP's hidden layers (train_modern.py "
                   "--mlp-width; default: the script's, 3072, n = "
                   "11,882,506; 512 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="the harness in minutes: 1gbit, %s, 1024 "
                   "training and 1000 test samples (8 steps at P = 4), "
                   "evaluations every 4 steps, 120 s cap, --mlp-width 512 "
                   "(n = 669,706: the harness's checks, a sixth of the "
                   "bytes through the namespaces)" % ", ".join(QUICK_METHODS))
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--python", default="/usr/bin/python3")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                 "tta.json"))
    p.add_argument("--plot-dir", default=os.path.join(ROOT, "bench",
                                                      "results"))
    p.add_argument("--log-dir", default="")
    p.add_argument("--replot", default="",
                   help="redraw the PNGs and the table from this JSON")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces a killed run left, and exit")
    a = p.parse_args(argv)
    if a.quick:
        a.rates = "1gbit"
        if a.methods == ",".join(METHODS):
            a.methods = ",".join(QUICK_METHODS)
        a.train_limit = 1024
        a.test_limit = a.test_limit or 1000
        a.eval_every = 4
        a.time_cap = min(a.time_cap, 120)
        a.warmup_steps = 4
        a.powersgd_start_iter = 4
        if a.mlp_width is None:
            a.mlp_width = 512
    a.rates = [r for r in a.rates.split(",") if r]
    a.methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        p.error("unknown method(s) %s; known: %s"
                % (", ".join(unknown), ", ".join(METHODS)))
    if not a.rates:
        p.error("--rates is empty")
    for name in ("workers", "shards", "epochs", "batch_size", "eval_every",
                 "mlp_width"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    if a.time_cap <= 0:
        p.error("--time-cap must be > 0")
    return a


def preflight(a):
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    missing = [t for t in ("ip", "tc", "gnuplot")
               if subprocess.run(["which", t], stdout=subprocess.DEVNULL)
               .returncode != 0]
    if missing:
        return "missing: %s (make deps)" % ", ".join(missing)
    server = os.path.join(a.build_dir, "server", "gtopk-server")
    if any(METHODS[m]["backend"] == "gtopk" for m in a.methods):
        if not os.access(server, os.X_OK):
            return "%s not built (make build)" % server
        if not os.path.isdir(os.path.join(a.build_dir, "python", "gtopk")):
            return "the gtopk Python package is not built in %s/python " \
                   "(make python)" % a.build_dir
    if not os.path.exists(OPENBLAS) and not a.quick:
        # --quick checks the harness, not the speed: it runs on the
        # system's BLAS then (workers_blas in the results says so).
        return ("%s missing: apt-get install libopenblas0-pthread (sudo "
                "make bench-tta does, keeping the system's BLAS choice)"
                % OPENBLAS)
    r = subprocess.run([a.python, "-c", "import torch, numpy"],
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        return "%s cannot import torch/numpy (python3-torch): %s" % (
            a.python, r.stderr.strip().splitlines()[-1:])
    return None


OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def blas():
    """The BLAS behind Debian's torch (libblas.so.3's alternative): the
    reference one is about 20x slower than OpenBLAS here."""
    r = subprocess.run(["update-alternatives", "--query",
                        "libblas.so.3-x86_64-linux-gnu"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
    for line in r.stdout.splitlines():
        if line.startswith("Value:"):
            return line.split(":", 1)[1].strip()
    return None


def tx_bytes(ns):
    """eth0's transmitted bytes in namespace `ns`."""
    out = lowbw.sh(["ip", "netns", "exec", ns, "cat",
                    "/sys/class/net/eth0/statistics/tx_bytes"], capture=True)
    return int(out.strip())


def read_jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
    except OSError:
        pass
    return rows


class Bench:
    def __init__(self, a):
        self.a = a
        self.server_bin = os.path.join(a.build_dir, "server", "gtopk-server")
        self.prefix = "glbw%d-" % os.getpid()  # lowbw's --cleanup finds it
        hosts = ["w%d" % i for i in range(a.workers)] + \
            ["s%d" % s for s in range(a.shards)]
        self.topo = lowbw.Topology(self.prefix, hosts)
        self.procs = lowbw.Procs()
        self.logdir = a.log_dir or tempfile.mkdtemp(prefix="gtopk-tta-")
        os.makedirs(self.logdir, exist_ok=True)

    def log(self, msg):
        sys.stderr.write("[tta %s] %s\n" % (time.strftime("%H:%M:%S"), msg))
        sys.stderr.flush()

    def script_argv(self, method, rank, tag):
        a, m = self.a, METHODS[method]
        argv = [a.python, SCRIPT, "--backend=" + m["backend"],
                "--model=mlp", "--optimizer=sgd", "--no-autocast",
                "--lr=%r" % a.lr, "--weight-decay=0",
                "--warmup-steps=%d" % a.warmup_steps, "--clip=0",
                "--epochs=%d" % a.epochs, "--batch-size=%d" % a.batch_size,
                "--seed=%d" % a.seed, "--train-limit=%d" % a.train_limit,
                "--test-limit=%d" % a.test_limit,
                "--eval-every=%d" % a.eval_every,
                "--threads=1"]
        if a.mlp_width is not None:  # else the script's default
            argv += ["--mlp-width=%d" % a.mlp_width]
        if not self.is_reference(method, tag):
            argv += ["--time-cap=%r" % a.time_cap]
        if rank == 0:
            argv += ["--eval-log=" + os.path.join(self.logdir,
                                                  tag + "-evals.jsonl"),
                     "--summary-json=" + os.path.join(self.logdir,
                                                      tag + "-rank-0.json")]
        if m["backend"] == "ddp":
            argv += ["--ddp-hook=" + m["hook"]]
            if m["hook"] == "powersgd":
                argv += ["--powersgd-rank=%d" % m["rank"],
                         "--powersgd-start-iter=%d" % a.powersgd_start_iter]
        else:
            argv += ["--server=%s:%d" % (self.topo.ip("s0"), SERVER_PORT),
                     "--rank=%d" % rank, "--tls=off",
                     "--recovery-timeout=0"]
        return argv

    def is_reference(self, method, tag):
        """fp32 DDP at the first rate sets the target: it always trains to
        the end (no time cap), so the target is its final accuracy."""
        return method == "ddp_fp32" and tag.endswith("-" + self.a.rates[0])

    def start_servers(self, method, tag):
        a, t, m = self.a, self.topo, METHODS[method]
        peers = ["%s:%d" % (t.ip("s%d" % s), SERVER_PORT)
                 for s in range(a.shards)]
        for s in range(a.shards):
            argv = [self.server_bin, "--listen=" + peers[s],
                    "--shard-id=%d" % s, "--num-shards=%d" % a.shards,
                    "--workers=%d" % a.workers, "--peers=" + ",".join(peers),
                    "--mode=gtopk",
                    "--selection=" + m.get("selection", "threshold"),
                    "--selector=" + m["selector"],
                    "--density=%r" % m["density"], "--apply=workers",
                    "--seed=%d" % a.seed, "--step-timeout=120s",
                    "--tls=off"]  # plaintext, as DDP's gloo
            self.procs.start("server %d" % s, t.ns("s%d" % s), argv,
                             os.path.join(self.logdir,
                                          "%s-server-%d.log" % (tag, s)))
        deadline = time.monotonic() + 30
        while lowbw.sh(["ip", "netns", "exec", t.ns("s0"), self.server_bin,
                        "--health-check=" + peers[0], "--tls=off"],
                       check=False) != 0:
            for name, p, log in self.procs.items:
                if p.poll() is not None:
                    raise RunFailed("%s: %s exited %d:\n%s" % (
                        tag, name, p.returncode, lowbw.tail(log)))
            if time.monotonic() > deadline:
                raise RunFailed("%s: leader not SERVING after 30 s" % tag)
            time.sleep(0.2)

    def run(self, method, rate):
        a, t, m = self.a, self.topo, METHODS[method]
        tag = "%s-%s" % (method, rate)
        self.log("%s: starting" % tag)
        load = lowbw.load_now()
        started = time.monotonic()
        if m["backend"] == "gtopk":
            self.start_servers(method, tag)
        tx_before = [tx_bytes(t.ns("w%d" % w)) for w in range(a.workers)]
        # OpenBLAS for torch's matrix products in these processes only
        # (Debian's torch calls libblas.so.3: the reference BLAS, 20x
        # slower, unless the system chooses another).
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.path.join(a.build_dir, "python"),
                   GLOO_SOCKET_IFNAME="eth0",
                   MASTER_ADDR=t.ip("w0"), MASTER_PORT=str(DDP_PORT),
                   WORLD_SIZE=str(a.workers))
        if os.path.exists(OPENBLAS):
            env["LD_PRELOAD"] = OPENBLAS
        ranks = []
        for w in range(a.workers):
            ranks.append(self.procs.start(
                "rank %d" % w, t.ns("w%d" % w),
                self.script_argv(method, w, tag),
                os.path.join(self.logdir, "%s-rank-%d.log" % (tag, w)),
                env=dict(env, RANK=str(w))))
        # Rank 0 decides the end (the epochs, or the time cap at an
        # evaluation); the others then wait for a step that never comes.
        limit = time.monotonic() + (
            3 * 3600 if self.is_reference(method, tag) else
            a.time_cap * 2 + 600)
        rank0_log = os.path.join(self.logdir, "%s-rank-0.log" % tag)
        rank0_summary = os.path.join(self.logdir, tag + "-rank-0.json")
        while ranks[0].poll() is None:
            if os.path.exists(rank0_summary):
                # Done: the others lose their peer as rank 0 closes.
                time.sleep(0.2)
                continue
            for name, p, log in self.procs.items:
                if p is not ranks[0] and p.poll() not in (None, 0):
                    raise RunFailed("%s: %s exited %d; last lines of %s:\n%s"
                                    % (tag, name, p.returncode, log,
                                       lowbw.tail(log)))
            if time.monotonic() > limit:
                raise RunFailed("%s: rank 0 not done in time:\n%s" % (
                    tag, lowbw.tail(rank0_log)))
            time.sleep(0.2)
        if ranks[0].returncode != 0:
            raise RunFailed("%s: rank 0 exited %d; last lines:\n%s" % (
                tag, ranks[0].returncode, lowbw.tail(rank0_log)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and \
                any(p.poll() is None for p in ranks[1:]):
            time.sleep(0.2)
        tx_after = [tx_bytes(t.ns("w%d" % w)) for w in range(a.workers)]
        self.procs.kill_all()
        with open(os.path.join(self.logdir, tag + "-rank-0.json")) as f:
            summary = json.load(f)
        evals = read_jsonl(os.path.join(self.logdir, tag + "-evals.jsonl"))
        steps = summary["steps"]
        wire = [(b - a0) / max(1, steps) for a0, b in zip(tx_before, tx_after)]
        run = {
            "method": method, "rate": rate, **m,
            "workers": a.workers,
            "shards": a.shards if m["backend"] == "gtopk" else None,
            "evals": evals,
            "final_accuracy": summary["test_accuracy"],
            "steps": steps, "planned_steps": summary["planned_steps"],
            "epochs_done": summary["epochs"],
            "capped": summary["capped"],
            "train_seconds": summary["train_seconds"],
            "eval_seconds": summary["eval_seconds"],
            "step_split_p50": summary["step_split_p50"],
            "compute_probe_seconds": summary["compute_probe_seconds"],
            "sent_bytes_per_worker_per_step":
                summary["sent_bytes_per_worker_per_step"],
            "sent_bytes_source": summary["sent_bytes_source"],
            "wire_tx_bytes_per_worker_per_step": sum(wire) / len(wire),
            "wire_source": "eth0 tx_bytes of each worker namespace over the "
            "whole run (frames; start-up, the initial parameter broadcast "
            "and the evaluations' idle time included) / steps, mean over "
            "workers",
            "n": summary["n"],
            "load_before": load,
            "run_seconds": time.monotonic() - started,
        }
        self.log("%s: %d steps, accuracy %.4f, %.0f s of training%s" % (
            tag, steps, run["final_accuracy"], run["train_seconds"],
            " (capped)" if run["capped"] else ""))
        return run

    def main(self):
        a = self.a
        runs = []
        try:
            self.topo.up()
            for rate in a.rates:
                self.topo.set_rate(rate)
                for method in a.methods:
                    runs.append(self.run(method, rate))
        finally:
            self.procs.kill_all()
            self.topo.down()
        return runs


def time_to(evals, target):
    """train_seconds and step of the first evaluation at >= target, or
    (None, None)."""
    for e in evals:
        if e["test_accuracy"] is not None and e["test_accuracy"] >= target:
            return e["train_seconds"], e["step"]
    return None, None


def analyse(a, runs):
    first = [r for r in runs if r["method"] == "ddp_fp32"]
    if not first:
        return None, {}
    reference = first[0]
    target = reference["final_accuracy"] - a.target_margin
    for r in runs:
        tta, step = time_to(r["evals"], target)
        r["time_to_target"] = tta
        r["steps_to_target"] = step
        r["accuracy_at_end"] = r["final_accuracy"]
        split = r.get("step_split_p50") or {}
        step_s = split.get("step")
        r["communication_share"] = (split.get("communication", 0) / step_s
                                    if step_s else None)
    verdicts = {}
    for rate in a.rates:
        here = [r for r in runs if r["rate"] == rate]
        timed = [r for r in here if r["time_to_target"] is not None]
        best = min(timed, key=lambda r: r["time_to_target"]) if timed \
            else None
        gtopk = [r for r in timed if r["backend"] == "gtopk"]
        fastest_gtopk = min(gtopk, key=lambda r: r["time_to_target"]) \
            if gtopk else None
        ddp32 = next((r for r in here if r["method"] == "ddp_fp32"), None)
        v = {"first_to_target": best["method"] if best else None,
             "gtopk_first": bool(best and best["backend"] == "gtopk")}
        if fastest_gtopk and ddp32:
            if ddp32["time_to_target"] is not None:
                v["speedup_vs_ddp_fp32"] = (ddp32["time_to_target"] /
                                            fastest_gtopk["time_to_target"])
            else:
                v["speedup_vs_ddp_fp32_at_least"] = (
                    ddp32["train_seconds"] / fastest_gtopk["time_to_target"])
        verdicts[rate] = v
    d01 = [r for r in runs if r["method"] == "gtopk_d0.01"]
    if d01:
        verdicts["final_accuracy_gap_d0.01_vs_ddp_fp32"] = {
            r["rate"]: r["final_accuracy"] - next(
                x["final_accuracy"] for x in runs
                if x["method"] == "ddp_fp32" and x["rate"] == r["rate"])
            for r in d01
            if any(x["method"] == "ddp_fp32" and x["rate"] == r["rate"]
                   for x in runs)}
    return target, verdicts


def markdown(runs, target):
    lines = ["target accuracy %.4f" % target if target is not None
             else "no target (no ddp_fp32 run)", "",
             "| rate | method | time to target (s) | final acc | steps | "
             "step (s) | compute | selection | comm. | hidden | "
             "bytes/worker/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.get("step_split_p50") or {}
        tta = r.get("time_to_target")
        tta_text = "%.0f" % tta if tta is not None else \
            "> %.0f (%.4f at the %s)" % (r["train_seconds"],
                                         r["final_accuracy"],
                                         "cap" if r["capped"] else "end")
        lines.append("| %s | %s | %s | %.4f | %d%s | %.3f | %.3f | %.3f | "
                     "%.3f | %.3f | %s |" % (
                         r["rate"], r["method"], tta_text,
                         r["final_accuracy"], r["steps"],
                         " (cap)" if r["capped"] else "",
                         s.get("step") or 0, s.get("compute") or 0,
                         s.get("selection") or 0,
                         s.get("communication") or 0,
                         s.get("hidden") or 0,
                         training_plot.human_bytes(
                             r["sent_bytes_per_worker_per_step"])))
    return "\n".join(lines)


def plot(a, runs, target, plot_dir):
    paths = []
    for rate in a.rates:
        here = [r for r in runs if r["rate"] == rate]
        if not here:
            continue
        path = os.path.join(plot_dir, "tta_%s.png" % rate)
        series = [{"name": r["method"], "points": [
            (e["train_seconds"], e["step"], e["test_accuracy"])
            for e in r["evals"]]} for r in here]
        training_plot.accuracy_plot(
            path, series, target,
            "Fashion-MNIST, MLP n = %d, P = %d, %s links (target %.4f)" % (
                here[0]["n"], a.workers, rate, target or 0))
        paths.append(path)
    return paths


def main(argv):
    a = parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            doc = json.load(f)
        a.rates = doc["config"]["rates"]
        print(markdown(doc["runs"], doc["target_accuracy"]))
        plot(a, doc["runs"], doc["target_accuracy"], a.plot_dir)
        return 0
    if a.cleanup:
        removed = lowbw.cleanup_stale()
        print("removed: %s" % (", ".join(removed) or "nothing"))
        return 0
    why = preflight(a)
    if why:
        sys.stderr.write("tta: %s\n" % why)
        return 2
    bench = Bench(a)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    command = "sudo /usr/bin/python3 bench/tta/tta.py " + " ".join(argv)
    t0 = time.monotonic()
    try:
        runs = bench.main()
    except KeyboardInterrupt:
        sys.stderr.write("tta: interrupted\n")
        return 130
    except (RunFailed, lowbw.RunFailed) as e:
        sys.stderr.write("tta: %s\n(logs: %s)\n" % (e, bench.logdir))
        return 1
    target, verdicts = analyse(a, runs)
    doc = {
        "command": command.strip(),
        "commit": lowbw.git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": dict(lowbw.machine_facts(), blas=blas(),
                        workers_blas=(OPENBLAS + " (LD_PRELOAD)"
                                      if os.path.exists(OPENBLAS) else
                                      "the system's libblas.so.3 (OpenBLAS "
                                      "missing; allowed with --quick only)")),
        "load_at_end": lowbw.load_now(),
        "config": {k: getattr(a, k) for k in (
            "rates", "methods", "workers", "shards", "epochs", "batch_size",
            "lr", "warmup_steps", "eval_every", "time_cap", "train_limit",
            "test_limit", "powersgd_start_iter", "target_margin", "seed",
            "quick", "mlp_width")},
        "script": "examples/pytorch/train_modern.py --model mlp "
                  "--optimizer sgd --no-autocast (momentum 0.9, no weight "
                  "decay, no clipping, warm-up then cosine)",
        "target_accuracy": target,
        "target_rule": "ddp_fp32's final accuracy at %s minus %g" % (
            a.rates[0], a.target_margin),
        "verdicts": verdicts,
        "runs": runs,
        "bench_seconds": time.monotonic() - t0,
        "logs": bench.logdir,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.makedirs(a.plot_dir, exist_ok=True)
    paths = plot(a, runs, target, a.plot_dir)
    print(markdown(runs, target))
    print("\nverdicts: " + json.dumps(verdicts))
    print("wrote %s and %s" % (a.out, ", ".join(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
