#!/usr/bin/python3
"""Low-bandwidth benchmark: gTop-k vs Top-k vs dense S-SGD (gtopk-server
modes) vs PyTorch DistributedDataParallel (gloo), side by side over the same
rate-limited links. Needs root (network namespaces, tc).

  /usr/bin/python3 bench/lowbw/lowbw.py                 # make bench-lowbw
  /usr/bin/python3 bench/lowbw/lowbw.py --workers 2 --n 1000000 --steps 10 \
      --out /tmp/lowbw.json --plot /tmp/lowbw.png   # a quick look; keeps bench/results
  /usr/bin/python3 bench/lowbw/lowbw.py --cleanup        # stale namespaces

Network. One network namespace per host: every worker rank (w0..w{P-1}) and
every shard (s0..s{S-1}) runs in its own, with one veth link to a bridge that
lives in a namespace of its own. Each link is limited with `tc tbf` to
--rate in both directions (on the host's eth0 and on the bridge's port), like
a full-duplex Ethernet link to a switch. Nothing runs in, or is routed to,
the machine's own network namespace. Namespace names start with a prefix
unique to this run (`glbw<pid>-`); everything is removed at the end, on
failure and on Ctrl-C/SIGTERM/SIGHUP (processes killed, namespaces deleted,
which deletes their links); the clean-up is safe to run twice, and
`--cleanup` removes what a killed run left (prefixes whose pid is dead).

Runs, in one invocation, for every P in --workers and every method in
--methods (each on a fresh set of processes, the same links):
  dense, topk, gtopk   gtopk-server --mode=<m> (gtopk: --selection=<--selection>) with
                       S = --shards shards (default 2), and
                       P gtopk-worker --model=synthetic:<n> --compute-ms=<c>
  gtopk_layerwise      (not in the default list) gtopk with
                       --selection=layerwise --bucket-mb=<--bucket-mb>: the
                       workers overlap, their --compute-ms is an emulated
                       backward pass that reports the gradient in 100 equal
                       ranges from the end over the c ms (worker/flags.md),
                       so selection and communication run beside it;
                       exposed = the wait after it (per_step exposed_seconds)
  ddp                  bench/lowbw/ddp_allreduce.py: torch DDP, gloo, the same
                       n floats, the same --compute-ms
Each run does --warmup + --steps steps; the first --warmup are dropped. Per
step the ranks' times are averaged, then the median over the timed steps is
reported: step time, compute (gradient incl. --compute-ms), local
(sparsification and update on the worker) and communication (see
worker/flags.md `per_step`; for DDP see ddp_allreduce.py).

Single-worker baseline (P = 1): one worker's gradient phase, uncontended and
without communication: for the gtopk-server modes the median
`compute_seconds` of a P = 1 gtopk run; for DDP the same of a P = 1 DDP run
(world size 1: no peers). Scaling efficiency as in arXiv:1901.04359:
throughput(P) / (P x throughput(1)) = t1 / t(P), with throughput = P / t(P)
samples-per-step units.

CPU share: the same matrix is also run without the tc limit (--cpu-share,
default on): what is left there is the cost of the processes sharing the
machine's cores, not of the link.

Writes --out (JSON: command, machine facts incl. load, config, every run,
efficiencies, the issue's targets), --plot (PNG via gnuplot) and prints a
Markdown table. Exit: 0 done, 1 a run failed (its log tail is printed),
2 bad arguments / not root / tools missing, 130 interrupted.
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUBNET = "10.77.0."           # hosts are .1, .2, ...; inside our namespaces
SERVER_PORT = 50051
DDP_PORT = 29500
PREFIX_RE = re.compile(r"^glbw(\d+)-")
METHODS = ("dense", "topk", "gtopk", "ddp", "gtopk_layerwise")
# --methods' default (gtopk_layerwise is asked for by name).
DEFAULT_METHODS = ("dense", "topk", "gtopk", "ddp")


class Interrupted(Exception):
    pass


class RunFailed(Exception):
    pass


def sh(argv, check=True, capture=False):
    """Runs a command (no shell); raises RunFailed naming it on failure."""
    r = subprocess.run(argv, stdout=subprocess.PIPE if capture else
                       subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RunFailed("%s: exit %d: %s" % (" ".join(argv), r.returncode,
                                              r.stderr.strip()))
    return r.stdout if capture else r.returncode


def list_netns():
    out = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Topology:
    """Namespaces <prefix>br (bridge br0) and <prefix><host> (eth0 at
    SUBNET.<i+1>) for each host, veth eth0 <-> br's p<i>."""

    def __init__(self, prefix, hosts):
        self.prefix = prefix
        self.hosts = list(hosts)
        self.bridge_ns = prefix + "br"
        self.created = []
        self.rate = None

    def ns(self, host):
        return self.prefix + host

    def ip(self, host):
        return SUBNET + str(self.hosts.index(host) + 1)

    def up(self):
        for name in [self.bridge_ns] + [self.ns(h) for h in self.hosts]:
            sh(["ip", "netns", "add", name])
            self.created.append(name)
            sh(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        b = ["ip", "netns", "exec", self.bridge_ns]
        sh(b + ["ip", "link", "add", "br0", "type", "bridge"])
        sh(b + ["ip", "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            # Created directly inside the namespaces: no name in the
            # machine's own namespace, ever.
            sh(["ip", "link", "add", "eth0", "netns", self.ns(h), "type",
                "veth", "peer", "name", "p%d" % i, "netns", self.bridge_ns])
            x = ["ip", "netns", "exec", self.ns(h)]
            sh(x + ["ip", "addr", "add", self.ip(h) + "/24", "dev", "eth0"])
            sh(x + ["ip", "link", "set", "eth0", "up"])
            sh(b + ["ip", "link", "set", "p%d" % i, "master", "br0", "up"])

    def set_rate(self, rate, burst="64kb"):
        """tbf at `rate` (tc syntax, e.g. 1gbit) on both ends of every link;
        None removes the limit (veth line rate)."""
        for i, h in enumerate(self.hosts):
            for ns, dev in ((self.ns(h), "eth0"), (self.bridge_ns, "p%d" % i)):
                base = ["ip", "netns", "exec", ns, "tc", "qdisc"]
                if rate is None:
                    sh(base + ["del", "dev", dev, "root"], check=False)
                else:
                    sh(base + ["replace", "dev", dev, "root", "tbf", "rate",
                               rate, "burst", burst, "latency", "200ms"])
        self.rate = rate

    def qdiscs(self):
        return sh(["ip", "netns", "exec", self.ns(self.hosts[0]), "tc",
                   "qdisc", "show", "dev", "eth0"], capture=True).strip()

    def down(self):
        """Kills every process in our namespaces and deletes them (which
        deletes their links). Safe to call more than once."""
        teardown_prefix(self.prefix)
        self.created = []


def teardown_prefix(prefix):
    names = [n for n in list_netns() if n.startswith(prefix)]
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for name in names:
        for _ in range(50):
            if subprocess.run(["ip", "netns", "del", name],
                              stderr=subprocess.DEVNULL).returncode == 0:
                break
            if name not in list_netns():
                break
            time.sleep(0.1)
    return names


def cleanup_stale():
    """Removes namespaces of runs whose harness pid is dead."""
    removed = []
    for name in list_netns():
        m = PREFIX_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            removed += teardown_prefix(m.group(0))
    return removed


class Procs:
    """Children, each in its own process group, with their logs."""

    def __init__(self):
        self.items = []  # (name, Popen, log path)

    def start(self, name, ns, argv, log, env=None):
        f = open(log, "w")
        p = subprocess.Popen(["ip", "netns", "exec", ns] + argv, stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        f.close()
        self.items.append((name, p, log))
        return p

    def kill_all(self):
        for _, p, _ in self.items:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, p, _ in self.items:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.items = []


def tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for(procs, waited, deadline, what, sample=None):
    """Waits until every Popen in `waited` exits 0; any non-zero exit, or any
    other child exiting, or the deadline, raises RunFailed. `sample`, if
    given, is called on every poll (every 50 ms)."""
    while True:
        if sample:
            sample()
        done = True
        for name, p, log in procs.items:
            rc = p.poll()
            if p in waited:
                if rc is None:
                    done = False
                elif rc != 0:
                    raise RunFailed("%s: %s exited %d; last lines of %s:\n%s"
                                    % (what, name, rc, log, tail(log)))
            elif rc is not None:
                raise RunFailed("%s: %s exited early (%d); last lines of %s:\n%s"
                                % (what, name, rc, log, tail(log)))
        if done:
            return
        if time.monotonic() > deadline:
            raise RunFailed("%s: not done after its time limit" % what)
        time.sleep(0.05)


def proc_cpu_seconds(pid):
    """User + system CPU seconds of a live process, from /proc/<pid>/stat;
    None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is the state (field 3); utime and stime are fields 14, 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_shard_cpu(summaries, samples, warmup):
    """Each shard's CPU seconds per timed step: its CPU time (sampled every
    50 ms, interpolated) between the end of the last warm-up step and the
    end of the last step (the latest pull_end over ranks), divided by the
    steps in between. None without timestamps or samples."""
    if not samples or not all("pull_end_unix" in s["per_step"]
                              for s in summaries):
        return None
    ends = [max(s["per_step"]["pull_end_unix"][i] for s in summaries)
            for i in range(min(len(s["per_step"]["pull_end_unix"])
                               for s in summaries))]
    if warmup < 1 or len(ends) <= warmup:
        return None
    t0, t1, steps = ends[warmup - 1], ends[-1], len(ends) - warmup

    def at(t, j):
        pts = [(ts, v[j]) for ts, v in samples if v[j] is not None]
        for (ta, va), (tb, vb) in zip(pts, pts[1:]):
            if ta <= t <= tb:
                return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else va
        return None

    out = []
    for j in range(len(samples[0][1])):
        a, b = at(t0, j), at(t1, j)
        if a is None or b is None:
            return None
        out.append(round((b - a) / steps, 5))
    return out


def summary_cpu_seconds(s):
    """A worker's whole-run CPU seconds (user + system) from its summary;
    None for summaries without them."""
    if "cpu_user_seconds" not in s:
        return None
    return (s["cpu_user_seconds"] or 0) + (s["cpu_system_seconds"] or 0)


def median_of_steps(summaries, key, warmup):
    """Per step the mean over ranks, then the median over the steps after
    the first `warmup`."""
    series = [s["per_step"][key] for s in summaries]
    steps = min(len(x) for x in series)
    means = [statistics.fmean(x[i] for x in series) for i in range(steps)]
    timed = means[warmup:]
    if not timed:
        raise RunFailed("no timed steps (%d steps, %d warm-up)" % (steps, warmup))
    return statistics.median(timed), len(timed)


def last_pusher_communication(summaries, warmup):
    """Per step, the rank whose pushes went out last: its pull_end -
    push_start (all ranks share one clock), i.e. the network and the
    servers' work without waiting for slower workers; the median over the
    timed steps. None for summaries without the timestamps (DDP)."""
    if not all("push_start_unix" in s["per_step"] for s in summaries):
        return None
    starts = [s["per_step"]["push_start_unix"] for s in summaries]
    ends = [s["per_step"]["pull_end_unix"] for s in summaries]
    steps = min(len(x) for x in starts)
    values = []
    for i in range(warmup, steps):
        last = max(range(len(starts)), key=lambda r: starts[r][i])
        values.append(ends[last][i] - starts[last][i])
    return statistics.median(values) if values else None


class Bench:
    def __init__(self, a):
        self.a = a
        self.server_bin = os.path.join(a.build_dir, "server", "gtopk-server")
        self.worker_bin = os.path.join(a.build_dir, "worker", "gtopk-worker")
        self.prefix = "glbw%d-" % os.getpid()
        p_max = max(a.workers + ([1] if a.baseline else []))
        hosts = ["w%d" % i for i in range(p_max)] + \
            ["s%d" % s for s in range(a.shards)]
        self.topo = Topology(self.prefix, hosts)
        self.procs = Procs()
        self.logdir = a.log_dir or tempfile.mkdtemp(prefix="gtopk-lowbw-")
        os.makedirs(self.logdir, exist_ok=True)
        self.k = max(1, round(a.density * a.n))

    # -- one run -------------------------------------------------------------

    def run_ps(self, mode, P, tag, selection=None):
        a, t = self.a, self.topo
        selection = selection or a.selection
        S = a.shards
        peers = ["%s:%d" % (t.ip("s%d" % s), SERVER_PORT) for s in range(S)]
        for s in range(S):
            argv = [self.server_bin, "--listen=" + peers[s],
                    "--shard-id=%d" % s, "--num-shards=%d" % S,
                    "--workers=%d" % P, "--peers=" + ",".join(peers),
                    "--mode=" + mode,
                    "--density=%r" % a.density, "--step-timeout=600s",
                    "--max-message-bytes=1073741824",
                    "--tls=off"]  # plaintext, as the DDP baseline's gloo
            if mode == "gtopk":  # the servers reject it for topk and dense
                argv.append("--selection=" + selection)
            if selection == "layerwise":
                argv.append("--bucket-mb=%r" % a.bucket_mb)
            self.procs.start("server %d" % s, t.ns("s%d" % s), argv,
                             os.path.join(self.logdir, "%s-server-%d.log" % (tag, s)))
        deadline = time.monotonic() + 30
        while True:
            rc = sh(["ip", "netns", "exec", t.ns("s0"), self.server_bin,
                     "--health-check=" + peers[0], "--tls=off"], check=False)
            if rc == 0:
                break
            wait_for(self.procs, [], time.monotonic() + 1, tag)  # any exit?
            if time.monotonic() > deadline:
                raise RunFailed("%s: leader not SERVING after 30 s" % tag)
            time.sleep(0.2)
        workers, outs = [], []
        for w in range(P):
            out = os.path.join(self.logdir, "%s-worker-%d.json" % (tag, w))
            outs.append(out)
            argv = [self.worker_bin, "--server=" + peers[0], "--rank=%d" % w,
                    "--model=synthetic:%d" % a.n,
                    "--compute-ms=%d" % a.compute_ms,
                    "--steps=%d" % (a.warmup + a.steps), "--seed=1",
                    "--rpc-timeout-s=600", "--mode=" + mode,
                    "--density=%r" % a.density, "--summary-json=" + out,
                    "--tls=off"]
            workers.append(self.procs.start(
                "worker %d" % w, t.ns("w%d" % w), argv,
                os.path.join(self.logdir, "%s-worker-%d.log" % (tag, w))))
        # The shards' CPU time, sampled every 50 ms with the time, so the
        # timed steps' share can be cut out of the whole run's.
        shard_pids = [p.pid for name, p, _ in self.procs.items
                      if name.startswith("server")]
        samples = []

        def sample():
            samples.append((time.time(),
                            [proc_cpu_seconds(pid) for pid in shard_pids]))

        wait_for(self.procs, workers, time.monotonic() + a.run_timeout_s, tag,
                 sample)
        sample()
        # The shards are still up (they serve until killed): their CPU
        # time over the whole run, start-up included.
        shard_cpu = samples[-1][1]
        self.procs.kill_all()
        summaries = []
        for out in outs:
            with open(out) as f:
                summaries.append(json.load(f))
        checks = {s["param_checksum"] for s in summaries} | \
            {s["server_checksum"] for s in summaries}
        extra = {
            "sent_bytes_per_worker_per_step": statistics.fmean(
                s["sent_bytes_per_step"] for s in summaries),
            "received_bytes_per_worker_per_step": statistics.fmean(
                s["received_bytes_per_step"] for s in summaries),
            "replicas_identical": len(checks) == 1,
            "shard_cpu_seconds": shard_cpu,
            "shard_cpu_samples": samples,
            "bytes_source": "gtopk-worker summary (serialized messages)",
        }
        return summaries, extra

    def run_ddp(self, P, tag):
        a, t = self.a, self.topo
        master = "%s:%d" % (t.ip("w0"), DDP_PORT)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        ranks, outs = [], []
        for w in range(P):
            out = os.path.join(self.logdir, "%s-rank-%d.json" % (tag, w))
            outs.append(out)
            argv = [a.python, os.path.join(HERE, "ddp_allreduce.py"),
                    "--rank=%d" % w, "--world-size=%d" % P,
                    "--master=" + master, "--n=%d" % a.n,
                    "--compute-ms=%d" % a.compute_ms,
                    "--steps=%d" % (a.warmup + a.steps), "--out=" + out]
            ranks.append(self.procs.start(
                "ddp rank %d" % w, t.ns("w%d" % w), argv,
                os.path.join(self.logdir, "%s-rank-%d.log" % (tag, w)), env=env))
        wait_for(self.procs, ranks, time.monotonic() + a.run_timeout_s, tag)
        self.procs.kill_all()
        summaries = []
        for out in outs:
            with open(out) as f:
                summaries.append(json.load(f))
        # Measured on eth0 (frames, so TCP/IP headers included); gloo's ring
        # all-reduce needs 2 (P-1)/P x 4n bytes each way per rank.
        return summaries, {
            "sent_bytes_per_worker_per_step": statistics.fmean(
                s["wire_sent_bytes_per_step"] or 0 for s in summaries),
            "received_bytes_per_worker_per_step": statistics.fmean(
                s["wire_received_bytes_per_step"] or 0 for s in summaries),
            "bytes_source": "eth0 counters (frames)"}

    def run(self, method, P, rate):
        tag = "%s-p%d-%s" % (method, P, rate or "unlimited")
        load = os.getloadavg()
        t0 = time.monotonic()
        if method == "ddp":
            summaries, extra = self.run_ddp(P, tag)
        elif method == "gtopk_layerwise":
            summaries, extra = self.run_ps("gtopk", P, tag, "layerwise")
        else:
            summaries, extra = self.run_ps(method, P, tag)
        r = {"method": method, "workers": P,
             "shards": self.a.shards if method != "ddp" else 0,
             "rate": rate or "unlimited"}
        for key in ("step_seconds", "compute_seconds", "local_seconds",
                    "communication_seconds"):
            r[key + "_p50"], r["timed_steps"] = median_of_steps(
                summaries, key, self.a.warmup)
        if all("exposed_seconds" in s["per_step"] for s in summaries):
            # gtopk-worker: the wait for the client after the gradient was
            # made (the whole Step, or what backward did not cover).
            r["exposed_seconds_p50"] = median_of_steps(
                summaries, "exposed_seconds", self.a.warmup)[0]
        r["last_pusher_communication_seconds_p50"] = \
            last_pusher_communication(summaries, self.a.warmup)
        r.update(extra)
        r["run_wall_seconds"] = round(time.monotonic() - t0, 2)
        r["load_average_1m_before"] = load[0]
        r["load_average_1m_after"] = os.getloadavg()[0]
        # CPU time beside wall time, so contention is visible (issue 20).
        if all("cpu_seconds" in s["per_step"] for s in summaries):
            r["worker_cpu_seconds_per_step_p50"] = median_of_steps(
                summaries, "cpu_seconds", self.a.warmup)[0]
        cpus = [summary_cpu_seconds(s) for s in summaries]
        r["worker_cpu_seconds"] = cpus
        steps_all = self.a.warmup + self.a.steps
        if r.get("shard_cpu_seconds") and None not in r["shard_cpu_seconds"]:
            r["shard_cpu_seconds_per_step"] = [
                round(c / steps_all, 4) for c in r["shard_cpu_seconds"]]
        samples = r.pop("shard_cpu_samples", None)
        timed = timed_shard_cpu(summaries, samples, self.a.warmup)
        if timed:
            r["shard_cpu_seconds_per_timed_step"] = timed
        self.log("  %-5s P=%d %-9s step %8.1f ms  compute %7.1f  local %7.1f  "
                 "comm %8.1f ms%s  (%.0f s)" % (
                     method, P, r["rate"], r["step_seconds_p50"] * 1e3,
                     r["compute_seconds_p50"] * 1e3,
                     r["local_seconds_p50"] * 1e3,
                     r["communication_seconds_p50"] * 1e3,
                     "" if r["last_pusher_communication_seconds_p50"] is None
                     else " (last pusher %.1f)" %
                     (r["last_pusher_communication_seconds_p50"] * 1e3),
                     r["run_wall_seconds"]))
        self.log("        cpu/step: worker %s, shards %s; load %.1f -> %.1f" % (
            "%.1f ms" % (r["worker_cpu_seconds_per_step_p50"] * 1e3)
            if "worker_cpu_seconds_per_step_p50" in r else "-",
            r.get("shard_cpu_seconds_per_step", "-"),
            r["load_average_1m_before"], r["load_average_1m_after"]))
        return r

    def log(self, msg):
        print(msg, flush=True)

    # -- the whole matrix ----------------------------------------------------

    def main(self):
        a = self.a
        self.log("lowbw: namespaces %s*, logs in %s" % (self.prefix, self.logdir))
        self.topo.up()
        runs = []
        self.topo.set_rate(a.rate, a.burst)
        self.log("lowbw: links limited to %s (%s)" % (a.rate, self.topo.qdiscs()))
        baseline = {}
        if a.baseline:
            for method in ("gtopk", "ddp"):
                if method in a.methods or (method == "gtopk" and set(
                        a.methods) & {"dense", "topk"}):
                    r = self.run(method, 1, a.rate)
                    r["baseline"] = True
                    runs.append(r)
                    baseline["ddp" if method == "ddp" else "gtopk-server"] = \
                        r["compute_seconds_p50"]
        for P in a.workers:
            for method in a.methods:
                runs.append(self.run(method, P, a.rate))
        cpu_runs = []
        if a.cpu_share:
            self.topo.set_rate(None)
            self.log("lowbw: CPU share: the same runs without the tc limit")
            for P in a.workers:
                for method in a.methods:
                    cpu_runs.append(self.run(method, P, None))
        return runs, cpu_runs, baseline


# -- results -----------------------------------------------------------------

def machine_facts():
    facts = {"kernel": platform.release(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
            facts["cpu"] = m.group(1) if m else "unknown"
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemTotal:\s*(\d+) kB", f.read(), re.M)
            facts["memory_gib"] = round(int(m.group(1)) / 2**20, 1)
        with open("/etc/os-release") as f:
            m = re.search(r'^PRETTY_NAME="?([^"\n]*)', f.read(), re.M)
            facts["os"] = m.group(1) if m else "unknown"
    except OSError:
        pass
    facts["python"] = platform.python_version()
    return facts


def load_now():
    with open("/proc/loadavg") as f:
        return f.read().strip()


def git_commit():
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
    return r.stdout.strip() or None


def find(runs, method, P):
    for r in runs:
        if r["method"] == method and r["workers"] == P and not r.get("baseline"):
            return r
    return None


def analyse(a, runs, cpu_runs, baseline):
    """Efficiencies and the issue's targets (P = max, the last --workers)."""
    eff = {}
    for r in runs:
        if r.get("baseline"):
            continue
        t1 = baseline.get("ddp" if r["method"] == "ddp" else "gtopk-server")
        if t1:
            r["scaling_efficiency"] = t1 / r["step_seconds_p50"]
            eff.setdefault(r["method"], {})[str(r["workers"])] = round(
                r["scaling_efficiency"], 4)
    for r in cpu_runs:
        lim = find(runs, r["method"], r["workers"])
        if lim:
            lim["unlimited_step_seconds_p50"] = r["step_seconds_p50"]
            lim["link_share_of_step"] = max(
                0.0, 1 - r["step_seconds_p50"] / lim["step_seconds_p50"])
    targets = {}
    pmax, pmin = max(a.workers), min(a.workers)
    g, d, t = (find(runs, m, pmax) for m in ("gtopk", "ddp", "topk"))
    if g and d:
        ratio = d["step_seconds_p50"] / g["step_seconds_p50"]
        targets["gtopk_step_x_faster_than_ddp_at_P%d" % pmax] = {
            "value": round(ratio, 3), "target": ">= 20", "met": ratio >= 20}
    if g and t:
        gaps = {}
        for P in a.workers:
            gp, tp = find(runs, "gtopk", P), find(runs, "topk", P)
            if gp and tp:
                gaps[str(P)] = round(tp["step_seconds_p50"] -
                                     gp["step_seconds_p50"], 4)
        vals = [gaps[str(P)] for P in a.workers if str(P) in gaps]
        met = all(v > 0 for v in vals) and all(
            x < y for x, y in zip(vals, vals[1:]))
        targets["topk_minus_gtopk_step_seconds"] = {
            "value": gaps, "target": "> 0 and growing with P", "met": met}
    g1 = find(runs, "gtopk", pmin)
    if g and g1 and pmax != pmin:
        growth = g["communication_seconds_p50"] / g1["communication_seconds_p50"]
        targets["gtopk_communication_growth_P%d_to_P%d" % (pmin, pmax)] = {
            "value": round(growth, 3), "target": "<= 1.5", "met": growth <= 1.5}
        if g.get("last_pusher_communication_seconds_p50") and \
                g1.get("last_pusher_communication_seconds_p50"):
            lp = (g["last_pusher_communication_seconds_p50"] /
                  g1["last_pusher_communication_seconds_p50"])
            targets["gtopk_last_pusher_communication_growth_P%d_to_P%d" % (
                pmin, pmax)] = {"value": round(lp, 3), "target": "<= 1.5",
                                "met": lp <= 1.5,
                                "note": "communication without the wait for "
                                        "slower workers"}
    return eff, targets


def markdown(a, runs, cpu_runs):
    lines = ["| method | P | step | compute | local | communication | "
             "step without tc limit | sent / received per worker per step | "
             "scaling eff. |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("baseline"):
            continue
        un = r.get("unlimited_step_seconds_p50")
        lines.append("| %s | %d | %.0f ms | %.0f ms | %.0f ms | %.0f ms | %s | "
                     "%s | %s |" % (
                         r["method"], r["workers"], r["step_seconds_p50"] * 1e3,
                         r["compute_seconds_p50"] * 1e3,
                         r["local_seconds_p50"] * 1e3,
                         r["communication_seconds_p50"] * 1e3,
                         "%.0f ms" % (un * 1e3) if un else "-",
                         human_bytes(r["sent_bytes_per_worker_per_step"]) +
                         " / " +
                         human_bytes(r["received_bytes_per_worker_per_step"]),
                         "%.3f" % r["scaling_efficiency"]
                         if "scaling_efficiency" in r else "-"))
    return "\n".join(lines)


def human_bytes(b):
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= s:
            return "%.1f %s" % (b / s, unit)
    return "%d B" % b


def plot(a, runs, path):
    """Step time and communication time vs P, one line per method (gnuplot)."""
    tmp = tempfile.mkdtemp(prefix="gtopk-lowbw-plot-")
    try:
        series = []
        for m in a.methods:
            data = os.path.join(tmp, m + ".dat")
            with open(data, "w") as f:
                for P in a.workers:
                    r = find(runs, m, P)
                    if r:
                        f.write("%d %g %g\n" % (P, r["step_seconds_p50"],
                                                r["communication_seconds_p50"]))
            series.append((m, data))
        title = "n = %d, density %g, %s links, compute %d ms" % (
            a.n, a.density, a.rate, a.compute_ms)
        xt = "(" + ", ".join('"%d" %d' % (P, P) for P in a.workers) + ")"
        script = [
            'set terminal pngcairo size 1200,520 font "sans,10"',
            "set output '%s'" % path,
            "set multiplot layout 1,2 title '%s'" % title,
            "set logscale x 2", "set logscale y 10", "set format y '%g'",
            "set xtics %s" % xt, "set grid",
            "set key top left", "set xlabel 'workers P'",
            "set xrange [%g:%g]" % (min(a.workers) / 1.2, max(a.workers) * 1.2)]
        for col, ylabel in ((2, "step time (s, median)"),
                            (3, "communication time per step (s, median)")):
            script.append("set ylabel '%s'" % ylabel)
            script.append("plot " + ", ".join(
                "'%s' using 1:%d with linespoints lw 2 pt 7 title '%s'" % (
                    d, col, m) for m, d in series))
        script.append("unset multiplot")
        r = subprocess.run(["gnuplot"], input="\n".join(script) + "\n",
                           text=True, stderr=subprocess.PIPE)
        if r.returncode != 0:
            raise RunFailed("gnuplot failed: " + r.stderr.strip())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="gTop-k vs Top-k vs dense vs PyTorch DDP over rate-limited "
        "links in network namespaces (root).")
    ap.add_argument("--rate", default="1gbit",
                    help="tc rate of every link, each direction (tc syntax: "
                    "1gbit, 100mbit; default 1gbit)")
    ap.add_argument("--burst", default="",
                    help="tbf bucket, bytes (default: 8 ms at --rate, at "
                    "least 64 KiB; 1,000,000 at 1gbit)")
    ap.add_argument("--workers", default="2,4,8",
                    help="comma list of P (default 2,4,8)")
    ap.add_argument("--shards", type=int, default=2,
                    help="S, gtopk-server shards, each on its own link (2)")
    ap.add_argument("--selection", choices=("threshold", "quota", "exact"),
                    default="threshold",
                    help="gtopk selection across shards (server/flags.md; "
                    "quota has no shard-leader threshold exchange)")
    ap.add_argument("--n", type=int, default=25557032,
                    help="floats per gradient (default 25,557,032: ResNet-50)")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--compute-ms", type=int, default=100,
                    help="emulated compute per step, ms (default 100)")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps run first and not timed (default 3)")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gtopk_layerwise: the servers' --bucket-mb (25)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma list of dense, topk, gtopk, ddp, "
                    "gtopk_layerwise (default: all but gtopk_layerwise)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the P = 1 runs (no scaling efficiency)")
    ap.add_argument("--no-cpu-share", dest="cpu_share", action="store_false",
                    help="skip the runs without the tc limit")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="interpreter with Debian's torch, for DDP")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "lowbw.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "results",
                                                   "lowbw.png"),
                    help="PNG path; empty: no plot")
    ap.add_argument("--log-dir", default="",
                    help="process logs and summaries (default: a new temp dir)")
    ap.add_argument("--run-timeout-s", type=float, default=900,
                    help="limit of one run (all its steps), seconds")
    ap.add_argument("--replot", metavar="JSON", default="",
                    help="only redraw --plot and the table of an existing "
                    "result file (no root needed), then exit")
    ap.add_argument("--cleanup", action="store_true",
                    help="only remove namespaces left by dead runs, then exit")
    a = ap.parse_args(argv)
    try:
        a.workers = sorted({int(x) for x in a.workers.split(",") if x})
    except ValueError:
        ap.error("--workers: a comma list of integers, got %r" % a.workers)
    a.methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        ap.error("--methods: unknown %s (known: %s)" % (bad, ", ".join(METHODS)))
    if not a.workers or min(a.workers) < 1 or max(a.workers) > 64:
        ap.error("--workers: P in 1..64")
    if a.shards < 1 or a.shards > 16:
        ap.error("--shards: 1..16")
    if a.n < 1 or a.n > 2**32:
        ap.error("--n: 1..2^32")
    if not 0 < a.density <= 1:
        ap.error("--density: in (0, 1]")
    if a.steps < 1 or a.warmup < 0 or a.compute_ms < 0:
        ap.error("--steps >= 1, --warmup >= 0, --compute-ms >= 0")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", a.rate)
    if not m or float(m.group(1)) <= 0:
        ap.error("--rate: tc rate like 1gbit or 100mbit, got %r" % a.rate)
    a.rate_bits_per_s = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6,
                                             "g": 1e9}[m.group(2)] * (
        8 if m.group(3) == "bps" else 1)
    if not a.burst:
        # A small bucket starves senders that the 2-core machine does not
        # schedule in time (tokens beyond the bucket are lost): measured for
        # DDP, P = 8, 10 MB, 1 Gbit/s: 64 KiB 1.19 s, 512 KiB 0.64 s,
        # 2 MiB 0.54 s of communication per step.
        a.burst = str(max(65536, int(a.rate_bits_per_s / 8 * 0.008)))
    elif not re.fullmatch(r"\d+[kmg]?b?", a.burst):
        ap.error("--burst: bytes in tc syntax like 1mb, got %r" % a.burst)
    return a


def preflight(a):
    if os.geteuid() != 0:
        return ("lowbw: needs root (it creates network namespaces and tc "
                "qdiscs); run `sudo make bench-lowbw`")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return "lowbw: `%s` not found; install iproute2" % tool
    if a.cleanup:
        return None  # needs only ip: no plot, no binaries, no torch
    if a.plot and not shutil.which("gnuplot"):
        return "lowbw: gnuplot not found; install gnuplot-nox (or pass --plot '')"
    for path in ((os.path.join(a.build_dir, "server", "gtopk-server"),
                  os.path.join(a.build_dir, "worker", "gtopk-worker"))
                 if set(a.methods) - {"ddp"} else ()):
        if not os.access(path, os.X_OK):
            return "lowbw: %s not built; run `make build`" % path
    if "ddp" in a.methods:
        r = subprocess.run([a.python, "-c", "import torch.distributed as d; "
                            "assert d.is_gloo_available()"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if r.returncode != 0:
            return ("lowbw: %s cannot import torch with gloo; install "
                    "python3-torch" % a.python)
    return None


def replot(a):
    with open(a.replot) as f:
        result = json.load(f)
    c = result["config"]
    a.workers, a.methods = c["workers"], c["methods"]
    a.n, a.density, a.compute_ms = c["n"], c["density"], c["compute_ms"]
    a.rate = c["rate_per_link_each_direction"]
    result["table_markdown"] = markdown(a, result["runs"],
                                        result["runs_without_tc_limit"])
    with open(a.replot + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(a.replot + ".tmp", a.replot)
    if a.plot:
        plot(a, result["runs"], a.plot)
    print(result["table_markdown"])
    return 0


def main(argv):
    a = parse_args(argv)
    if a.replot:
        return replot(a)
    problem = preflight(a)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if a.cleanup:
        removed = cleanup_stale()
        print("lowbw: removed %s" % (", ".join(removed) or "nothing"))
        return 0
    a.build_dir = os.path.abspath(a.build_dir)

    def on_signal(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    bench = Bench(a)
    load_before = load_now()
    t0 = time.time()
    try:
        runs, cpu_runs, baseline = bench.main()
    except Interrupted as e:
        print("lowbw: interrupted (%s); cleaning up" % e, file=sys.stderr)
        return 130
    except RunFailed as e:
        print("lowbw: FAILED: %s\n(logs in %s)" % (e, bench.logdir),
              file=sys.stderr)
        return 1
    finally:
        # Ignore further signals while tearing down, so a second Ctrl-C
        # cannot leave half the namespaces behind.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        bench.procs.kill_all()
        bench.topo.down()
        left = [n for n in list_netns() if n.startswith(bench.prefix)]
        if left:
            print("lowbw: could not remove namespaces %s" % left,
                  file=sys.stderr)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
    eff, targets = analyse(a, runs, cpu_runs, baseline)
    table = markdown(a, runs, cpu_runs)
    result = {
        "command": " ".join(["bench/lowbw/lowbw.py"] + argv) if argv else
        "bench/lowbw/lowbw.py",
        "git_commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_seconds": round(time.time() - t0, 1),
        "machine": dict(machine_facts(), load_before=load_before,
                        load_after=load_now()),
        "config": {
            "rate_per_link_each_direction": a.rate,
            "tc": "tbf burst %s latency 200ms on both ends of every link"
                  % a.burst,
            "topology": "one netns per worker and per shard, veth to a bridge "
                        "in its own netns",
            "n": a.n, "density": a.density, "k": bench.k,
            "compute_ms": a.compute_ms, "workers": a.workers,
            "shards": a.shards, "selection": a.selection,
            "bucket_mb": a.bucket_mb,
            "codecs": "delta-varint + fp32 (server defaults)",
            "timed_steps": a.steps, "warmup_steps": a.warmup,
            "methods": a.methods,
        },
        "definitions": {
            "step_seconds_p50": "per step the mean over ranks, median over "
                                "the timed steps",
            "compute_seconds_p50": "the gradient: synthetic random gradient "
                                   "+ compute-ms (gtopk-server modes); "
                                   "compute-ms + forward/backward without "
                                   "all-reduce (ddp)",
            "local_seconds_p50": "worker-side error feedback, selection, "
                                 "encoding and update (ddp: optimizer step)",
            "communication_seconds_p50": "pushes out until the last pull "
                                         "decoded (network, waiting for the "
                                         "other workers, servers' work); ddp: "
                                         "backward minus backward without "
                                         "all-reduce",
            "exposed_seconds_p50": "gtopk-server modes: the wait for the "
                                   "worker client after the gradient was "
                                   "made (the whole exchange; "
                                   "gtopk_layerwise: what the emulated "
                                   "backward pass did not cover)",
            "last_pusher_communication_seconds_p50": "per step, the rank "
                                                     "whose pushes went out "
                                                     "last: pushes out until "
                                                     "its last pull decoded "
                                                     "(the network and the "
                                                     "servers, no waiting "
                                                     "for slower workers); "
                                                     "median over the timed "
                                                     "steps; null for ddp",
            "baseline_single_worker_seconds": "P = 1, uncontended, no "
                                              "communication: median "
                                              "compute_seconds of a P = 1 run",
            "scaling_efficiency": "throughput(P) / (P x throughput(1)) "
                                  "= baseline / step_seconds_p50 "
                                  "(arXiv:1901.04359)",
            "unlimited_step_seconds_p50": "the same run without the tc limit "
                                          "(CPU and memory share)",
            "link_share_of_step": "1 - unlimited / limited step time",
            "worker_cpu_seconds_per_step_p50": "a worker process's CPU time "
                                               "(user + system, all threads) "
                                               "per step: per step the mean "
                                               "over ranks, median over the "
                                               "timed steps",
            "worker_cpu_seconds": "each worker's CPU seconds (user + system) "
                                  "over its whole run (getrusage)",
            "shard_cpu_seconds_per_timed_step": "each shard's CPU seconds "
                                                "per timed step (sampled "
                                                "every 50 ms, between the "
                                                "ends of the last warm-up "
                                                "and the last step)",
            "shard_cpu_seconds": "each shard's CPU seconds (user + system, "
                                 "/proc/<pid>/stat) over its whole run, "
                                 "start-up included; _per_step divides by "
                                 "warm-up + timed steps",
            "load_average_1m_before/after": "the machine's 1-minute load "
                                            "average around the run (other "
                                            "work shares the cores)",
        },
        "baseline_single_worker_seconds": baseline,
        "runs": runs,
        "runs_without_tc_limit": cpu_runs,
        "scaling_efficiency": eff,
        "targets": targets,
        "table_markdown": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(a.out + ".tmp", a.out)
    if a.plot:
        plot(a, runs, a.plot)
    print(table)
    print("targets: " + json.dumps(targets))
    print("lowbw: wrote %s%s" % (a.out, " and " + a.plot if a.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
