#!/usr/bin/env python3
"""Big-message flood of one gtopk-server leader shard (issue 42, item 3).

Measures what concurrent oversized-but-admitted unary requests cost the
leader's memory: COUNT concurrent `/gtopk.v1.Aggregator/AbortStep` calls per
source address, each carrying a BYTES-byte AbortStepRequest (step = -1, so
the handler refuses it INVALID_ARGUMENT; a legitimate one is a few hundred
bytes), sent by a small C++ generic-stub client (embedded below, compiled
into a temporary directory with g++ and pkg-config grpc++).

Scenarios (each run REPEATS times, a fresh server each time):
  baseline   no flood: the server idles as long as a flood takes;
  A          COUNT calls from 127.0.0.1 (one connection);
  B          COUNT calls from each of 127.0.0.2, .3 and .4 (one connection
             each, through TCP forwarders that bind their outgoing socket to
             the source address, as tests/integration/flood_test.py does);
  C          A, the server started with --max-message-bytes=C_LIMIT;
  A24        A over COUNT connections (one call per connection).
Under mutual TLS (off by default; `--scenarios mtls` runs them all), the
server started with --tls=mutual and certificates that the script makes
with deploy/tls/make-certs.sh in its temporary directory:
  Mbaseline  baseline;
  MA, MB     A and B from a plaintext client (no TLS at all);
  MA-nocert, MB-nocert
             A and B from a TLS client that trusts the server's CA but
             presents no client certificate;
  MA-otherca, MB-otherca
             A and B from a TLS client whose certificate (CN gtopk-worker-0)
             another CA signed;
  MA-cert    A from a client holding a valid certificate (CN gtopk-worker-0,
             the cluster CA): the control, what an authenticated client
             still costs (AbortStep is a shard RPC: PERMISSION_DENIED);
  MH         A sent in plaintext to the server's --health-listen port (the
             plaintext grpc.health.v1-only port for probes without a
             certificate; the Kubernetes base now binds it to the pod's
             loopback; AbortStep: UNIMPLEMENTED there);
  MH-check   MH with /grpc.health.v1.Health/Check as the method.

For each run it records the server's VmHWM and VmRSS (/proc/PID/status)
before the flood, when the last client call has ended, and AFTER_S seconds
later, the highest VmRSS sampled during the flood, every call's status code
and message, and the wall time; then, after those, one small AbortStep from
a legitimate client (under mutual TLS: the shard-0 certificate; expected
INVALID_ARGUMENT, step = -1) as a health probe, and under TLS the server's
log lines about handshakes; then writes one JSON file.

  python3 bench/flood/big_messages.py --build-dir build \\
      --out bench/results/big_message_flood.json
  python3 bench/flood/big_messages.py --build-dir build --scenarios mtls \\
      --out bench/results/big_message_flood_mtls.json

Standard library only (plus g++ and the grpc++ development package for the
client, and the openssl CLI for the mutual-TLS scenarios). Run it on an otherwise idle machine: the figures are the server's
memory, but the timing depends on the CPUs available.
"""

import argparse
import collections
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "tests", "testing"))
from tcp_forwarder import Forwarder  # noqa: E402

CLIENT_SOURCE = r'''
// bigmsg_client TARGET COUNT BYTES CHANNELS DEADLINE_S KIND [CREDS CA CERT KEY [METHOD]]
// COUNT concurrent unary /gtopk.v1.Aggregator/AbortStep calls, each a
// BYTES-byte request, spread over CHANNELS connections; one JSON line out.
// CREDS insecure (the default): plaintext; tls: TLS trusting the PEM CA,
// presenting the PEM CERT and KEY unless they are "-". METHOD: the full
// method name (default /gtopk.v1.Aggregator/AbortStep).
// KIND valid: AbortStepRequest{step=-1, shard_id=0, reason='x'...};
// KIND junk: a field whose declared length runs past the end.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/generic/generic_stub.h>

namespace {
using Clock = std::chrono::steady_clock;

void Varint(std::string* out, uint64_t v) {
  while (v >= 0x80) { out->push_back(char(v | 0x80)); v >>= 7; }
  out->push_back(char(v));
}

std::string Payload(size_t bytes, const std::string& kind) {
  std::string p;
  if (kind == "junk") {
    p.push_back(0x1a);
    Varint(&p, uint64_t{1} << 40);
    p.resize(bytes, 'x');
    return p;
  }
  std::string head;
  head.push_back(0x08); Varint(&head, uint64_t(-1));  // step = -1
  head.push_back(0x10); Varint(&head, 0);             // shard_id = 0
  head.push_back(0x1a);                               // reason
  for (size_t lenlen = 1; lenlen <= 10; ++lenlen) {
    if (bytes < head.size() + lenlen) break;
    size_t len = bytes - head.size() - lenlen;
    std::string v; Varint(&v, len);
    if (v.size() == lenlen) {
      p = head + v;
      p.resize(bytes, 'x');
      return p;
    }
  }
  std::fprintf(stderr, "cannot build a %zu-byte payload\n", bytes);
  std::exit(2);
}

std::string ReadFile(const char* path) {
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(2);
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Json(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') { o.push_back('\\'); o.push_back(c); }
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); o += b; }
    else o.push_back(c);
  }
  return o + "\"";
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 11 && argc != 12) {
    std::fprintf(stderr, "usage: %s TARGET COUNT BYTES CHANNELS DEADLINE_S KIND"
                 " [CREDS CA CERT KEY [METHOD]]\n", argv[0]);
    return 2;
  }
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::InsecureChannelCredentials();
  const std::string method =
      argc == 12 ? argv[11] : "/gtopk.v1.Aggregator/AbortStep";
  if (argc >= 11 && std::string(argv[7]) == "tls") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadFile(argv[8]);
    if (std::string(argv[9]) != "-") {
      o.pem_cert_chain = ReadFile(argv[9]);
      o.pem_private_key = ReadFile(argv[10]);
    }
    creds = grpc::SslCredentials(o);
  } else if (argc >= 11 && std::string(argv[7]) != "insecure") {
    std::fprintf(stderr, "CREDS: insecure or tls\n");
    return 2;
  }
  const std::string target = argv[1];
  const int count = std::atoi(argv[2]);
  const size_t bytes = std::strtoull(argv[3], nullptr, 10);
  const int nch = std::atoi(argv[4]);
  const int deadline_s = std::atoi(argv[5]);
  const std::string kind = argv[6];
  const std::string payload = Payload(bytes, kind);
  // One refcounted slice shared by every call: the client holds one copy.
  grpc::Slice slice(payload.data(), payload.size());
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int c = 0; c < nch; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    args.SetInt("gtopk.bigmsg.channel", c);
    stubs.emplace_back(new grpc::GenericStub(grpc::CreateCustomChannel(
        target, creds, args)));
  }
  struct Call {
    grpc::ClientContext ctx;
    grpc::ByteBuffer req, resp;
    grpc::Status status;
    double ms = 0;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < count; ++i) {
    calls.emplace_back(new Call);
    Call* call = calls.back().get();
    call->req = grpc::ByteBuffer(&slice, 1);
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::seconds(deadline_s));
    stubs[i % nch]->UnaryCall(
        &call->ctx, method, grpc::StubOptions(),
        &call->req, &call->resp, [&, call](grpc::Status st) {
          std::lock_guard<std::mutex> l(mu);
          call->status = st;
          call->ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
          ++done;
          cv.notify_all();
        });
  }
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done == count; });
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  std::string out = "{\"wall_s\":" + std::to_string(wall) + ",\"calls\":[";
  for (int i = 0; i < count; ++i) {
    const Call& c = *calls[i];
    std::string msg = c.status.error_message();
    if (msg.size() > 400) msg = msg.substr(0, 400) + "...";
    if (i) out += ",";
    out += "{\"code\":" + std::to_string(int(c.status.error_code())) +
           ",\"message\":" + Json(msg) + ",\"ms\":" + std::to_string(c.ms) + "}";
  }
  out += "]}";
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
  return 0;
}
'''

CODE_NAMES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
              "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
              "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"]

MIB = 1024.0


def build_client(workdir):
    src = os.path.join(workdir, "bigmsg_client.cc")
    exe = os.path.join(workdir, "bigmsg_client")
    with open(src, "w") as f:
        f.write(CLIENT_SOURCE)
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++",
                            "protobuf"], check=True, stdout=subprocess.PIPE,
                           text=True).stdout.split()
    subprocess.run(["g++", "-O1", "-std=c++17", "-o", exe, src] + flags,
                   check=True)
    return exe


def proc_status(pid):
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "VmRSS", "Threads"):
                    out[key] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return out


def mem_point(pid):
    s = proc_status(pid)
    if s is None:
        return {"alive": False}
    return {"alive": True, "vm_hwm_mib": round(s["VmHWM"] / MIB, 1),
            "vm_rss_mib": round(s["VmRSS"] / MIB, 1),
            "threads": s.get("Threads")}


class Sampler:
    """Samples the server's VmRSS every `period` s until stopped."""

    def __init__(self, pid, period=0.02, timeline_every=0.25):
        self.pid, self.period, self.timeline_every = pid, period, timeline_every
        self.max_rss_kib = 0
        self.timeline = []  # [seconds since start, VmRSS MiB]
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        next_tl = 0.0
        while not self._stop.is_set():
            s = proc_status(self.pid)
            if s is None:
                break
            self.max_rss_kib = max(self.max_rss_kib, s["VmRSS"])
            t = time.monotonic() - self._t0
            if t >= next_tl:
                self.timeline.append([round(t, 2), round(s["VmRSS"] / MIB, 1)])
                next_tl += self.timeline_every
            time.sleep(self.period)

    def stop(self):
        self._stop.set()
        self._thread.join()


def make_certs(workdir):
    """The cluster's certificates (1 shard, 1 worker) and another CA's."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                          "..", "deploy", "tls", "make-certs.sh")
    tls = os.path.join(workdir, "tls")
    other = os.path.join(workdir, "other-ca")
    subprocess.run(["sh", script, tls, "1", "1"], check=True)
    subprocess.run(["sh", script, other, "0", "1"], check=True)
    j = os.path.join
    return {
        "server": {"cert": j(tls, "shard-0.crt"), "key": j(tls, "shard-0.key"),
                   "ca": j(tls, "ca.crt")},
        # client credentials: [CREDS CA CERT KEY] of the embedded client
        "plain": ["insecure", "-", "-", "-"],
        "nocert": ["tls", j(tls, "ca.crt"), "-", "-"],
        "otherca": ["tls", j(tls, "ca.crt"), j(other, "worker-0.crt"),
                    j(other, "worker-0.key")],
        "cert": ["tls", j(tls, "ca.crt"), j(tls, "worker-0.crt"),
                 j(tls, "worker-0.key")],
        "probe": ["tls", j(tls, "ca.crt"), j(tls, "shard-0.crt"),
                  j(tls, "shard-0.key")],
    }


CLIENT_CREDS = {
    "plain": "plaintext (no TLS)",
    "nocert": "TLS trusting the cluster CA, no client certificate",
    "otherca": "TLS trusting the cluster CA, a client certificate "
               "(CN gtopk-worker-0) signed by another CA",
    "cert": "TLS with a valid client certificate (CN gtopk-worker-0, "
            "the cluster CA)",
}


def start_server(server, max_message_bytes, log_path, tls=None,
                 health=False):
    cmd = [server, "--listen=127.0.0.1:0", "--shard-id=0", "--num-shards=1",
           "--workers=2", "--metrics-port=0"]
    if tls is None:
        cmd.insert(5, "--tls=off")
    else:
        cmd[5:5] = ["--tls=mutual", "--tls-cert=" + tls["cert"],
                    "--tls-key=" + tls["key"], "--tls-ca=" + tls["ca"]]
    if max_message_bytes is not None:
        cmd.append("--max-message-bytes=%d" % max_message_bytes)
    if health:
        cmd.append("--health-listen=127.0.0.1:0")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                            text=True)
    deadline = time.monotonic() + 30
    port = health_port = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        m = re.search(r"health on 127\.0\.0\.1:(\d+)", line)
        if m:
            health_port = int(m.group(1))
        if port is not None and (health_port is not None or not health):
            break
    if port is None or (health and health_port is None):
        proc.kill()
        raise RuntimeError("server did not start: %s" % " ".join(cmd))
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, port, health_port, cmd


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def summarize_calls(calls):
    codes = collections.Counter(CODE_NAMES[c["code"]] if c["code"] < len(
        CODE_NAMES) else str(c["code"]) for c in calls)
    messages = collections.Counter(
        "%s: %s" % (CODE_NAMES[c["code"]], c["message"]) for c in calls)
    ms = sorted(c["ms"] for c in calls)
    return {"codes": dict(codes),
            "messages": [{"count": n, "status": m}
                         for m, n in messages.most_common()],
            "call_ms_min": round(ms[0], 1) if ms else None,
            "call_ms_max": round(ms[-1], 1) if ms else None}


def probe(client, port, creds):
    """One small AbortStep (step = -1) from a legitimate client."""
    try:
        r = subprocess.run([client, "127.0.0.1:%d" % port, "1", "64", "1",
                            "10", "valid"] + creds, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        line = r.stdout.splitlines()[0] if r.stdout else ""
        c = json.loads(line)["calls"][0]
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"error": repr(e)}
    return {"code": CODE_NAMES[c["code"]], "message": c["message"],
            "ms": round(c["ms"], 1)}


TLS_LOG = re.compile(r"handshake|SSL_ERROR|ssl_transport_security",
                     re.IGNORECASE)


def tls_log_summary(log_path):
    """The server log's lines about TLS handshakes, counted (the log prefix,
    time and thread, cut so that equal lines group)."""
    lines = collections.Counter()
    with open(log_path, errors="replace") as f:
        for line in f:
            if TLS_LOG.search(line):
                key = re.sub(r"^[EWIF]\d{4} [\d:.]+ +\d+ ", "", line.strip())
                lines[key[:300]] += 1
    return {"lines": sum(lines.values()),
            "distinct": [{"count": n, "line": l}
                         for l, n in lines.most_common(8)]}


def run_one(args, client, name, sources, channels_per_source, limit, flood,
            logdir, rep, certs=None, client_creds=None, health_method=None):
    log_path = os.path.join(logdir, "%s-%d.log" % (name, rep))
    proc, main_port, health_port, cmd = start_server(
        args.server, limit, log_path,
        certs["server"] if client_creds else None, bool(health_method))
    creds = certs[client_creds] if client_creds else []
    port = main_port
    if health_method:  # the flood goes to the plaintext health port
        port = health_port
        creds = certs["plain"] + [health_method]
    try:
        time.sleep(args.settle_s)
        before = mem_point(proc.pid)
        sampler = Sampler(proc.pid)
        forwarders = []
        t0 = time.monotonic()
        results = []
        if flood:
            targets = []
            for src in sources:
                if src == "127.0.0.1":
                    targets.append(("127.0.0.1", "127.0.0.1:%d" % port))
                else:
                    fw = Forwarder(src, ("127.0.0.1", port))
                    forwarders.append(fw)
                    targets.append((src, "127.0.0.1:%d" % fw.port))
            clients = [(src, subprocess.Popen(
                [client, target, str(args.count), str(args.bytes),
                 str(channels_per_source), str(args.deadline_s), args.kind]
                + creds,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                for src, target in targets]
            # The flood ends when every call has ended: each client prints
            # its report then (before gRPC's own shutdown, which can take
            # seconds more), so read the line, not the process's exit.
            for src, c in clients:
                line = c.stdout.readline()
                if not line:
                    c.wait()
                    raise RuntimeError("client failed (%s): %s" %
                                       (c.returncode, c.stderr.read()))
                r = json.loads(line)
                r["source"] = src
                results.append(r)
        else:
            time.sleep(args.idle_s)
        wall = time.monotonic() - t0
        end = mem_point(proc.pid)
        time.sleep(args.after_s)
        after = mem_point(proc.pid)
        sampler.stop()
        # Health: a legitimate call, after every memory figure was taken.
        health = probe(client, main_port,
                       certs["probe"] if client_creds else [])
        if flood:
            for src, c in clients:
                try:
                    c.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.communicate()
        for fw in forwarders:
            fw.close()
        all_calls = [c for r in results for c in r["calls"]]
        run = {
            "repeat": rep + 1,
            "server_command": " ".join(shlex.quote(x) for x in cmd),
            "wall_s": round(wall, 2),
            "wall_s_means": "from starting the clients to the last call's "
                            "end (no flood: the idle time)",
            "before": before,
            "end_of_flood": end,
            "after": after,
            "after_s": args.after_s,
            "max_sampled_vm_rss_mib": round(sampler.max_rss_kib / MIB, 1),
            "rss_timeline_mib": sampler.timeline,
            "probe_after": health,
        }
        if flood:
            run["clients"] = summarize_calls(all_calls)
            run["clients"]["per_source"] = [
                {"source": r["source"], "wall_s": round(r["wall_s"], 2),
                 "codes": summarize_calls(r["calls"])["codes"]}
                for r in results]
        run["server_exit_code"] = stop_server(proc)
        if client_creds:
            run["server_log_tls"] = tls_log_summary(log_path)
        return run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def machine_info(server):
    info = {"nproc": os.cpu_count(), "platform": platform.platform()}
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                info["mem_total_mib"] = round(int(line.split()[1]) / MIB)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}",
                              "libgrpc++1.51"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True).stdout
        info["grpc_version"] = "libgrpc++1.51 " + out.strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["pkg-config", "--modversion", "grpc++"],
                             stdout=subprocess.PIPE, text=True).stdout
        info["grpcpp_pkgconfig_version"] = out.strip()
    except OSError:
        pass
    with open(server, "rb") as f:
        info["server_binary_sha256"] = hashlib.sha256(f.read()).hexdigest()
    info["server_binary_mtime"] = datetime.datetime.fromtimestamp(
        os.path.getmtime(server), datetime.timezone.utc).isoformat()
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git_head"] = subprocess.run(
            ["git", "-C", repo, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True).stdout.strip()
    except OSError:
        pass
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build-dir", default="build")
    p.add_argument("--client", default="",
                   help="prebuilt client (default: compile the embedded one)")
    p.add_argument("--out", default="bench/results/big_message_flood.json")
    p.add_argument("--count", type=int, default=24, help="calls per source")
    p.add_argument("--bytes", type=int, default=60_000_000,
                   help="bytes per request")
    p.add_argument("--kind", default="valid", choices=["valid", "junk"])
    p.add_argument("--c-limit", type=int, default=4 << 20,
                   help="--max-message-bytes of scenario C")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", default="baseline,A,B,C,A24")
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="baseline: idle time standing for the flood")
    p.add_argument("--after-s", type=float, default=10.0)
    p.add_argument("--deadline-s", type=int, default=120)
    p.add_argument("--note", default="")
    args = p.parse_args()
    args.server = os.path.join(os.path.abspath(args.build_dir), "server",
                               "gtopk-server")

    workdir = tempfile.mkdtemp(prefix="gtopk-bigmsg-")
    client = args.client or build_client(workdir)
    # Run a private copy of the server binary: a rebuild of the build
    # directory during the runs cannot swap it (its hash is recorded).
    built_server = args.server
    args.server = os.path.join(workdir, "gtopk-server")
    shutil.copy2(built_server, args.server)
    scenarios = {
        "baseline": dict(sources=[], channels=1, limit=None, flood=False,
                         what="no flood"),
        "A": dict(sources=["127.0.0.1"], channels=1, limit=None, flood=True,
                  what="%d concurrent AbortStep from 127.0.0.1, one connection"
                  % args.count),
        "B": dict(sources=["127.0.0.2", "127.0.0.3", "127.0.0.4"], channels=1,
                  limit=None, flood=True,
                  what="%d concurrent AbortStep from each of 127.0.0.2/3/4 "
                  "(one connection each, via forwarders)" % args.count),
        "C": dict(sources=["127.0.0.1"], channels=1, limit=args.c_limit,
                  flood=True, what="A with --max-message-bytes=%d"
                  % args.c_limit),
        "A24": dict(sources=["127.0.0.1"], channels=args.count, limit=None,
                    flood=True, what="A over %d connections (one call each)"
                    % args.count),
    }
    for creds in ("plain", "nocert", "otherca", "cert"):
        for base in ("A", "B"):
            if creds == "cert" and base == "B":
                continue
            name = "M" + base + ("" if creds == "plain" else "-" + creds)
            scenarios[name] = dict(scenarios[base], client=creds,
                                   what="%s, the server --tls=mutual, the "
                                   "client %s" % (scenarios[base]["what"],
                                                  CLIENT_CREDS[creds]))
    scenarios["Mbaseline"] = dict(scenarios["baseline"], client="plain",
                                  what="no flood, the server --tls=mutual")
    for name, method in (("MH", "/gtopk.v1.Aggregator/AbortStep"),
                         ("MH-check", "/grpc.health.v1.Health/Check")):
        scenarios[name] = dict(
            scenarios["A"], client="plain", health_method=method,
            what="%d concurrent %s from 127.0.0.1, one connection, to the "
            "plaintext --health-listen port of a --tls=mutual server"
            % (args.count, method))
    mtls = ["Mbaseline", "MA", "MB", "MA-nocert", "MB-nocert", "MA-otherca",
            "MB-otherca", "MA-cert", "MH", "MH-check"]
    names = []
    for name in args.scenarios.split(","):
        names += mtls if name == "mtls" else [name]
    for name in names:
        if name not in scenarios:
            p.error("unknown scenario %s (known: %s, mtls)"
                    % (name, ",".join(scenarios)))
    certs = None
    if any(scenarios[n].get("client") for n in names):
        certs = make_certs(workdir)
    started = datetime.datetime.now(datetime.timezone.utc)
    out = {
        "what": "gtopk-server leader (S=1, P=2, --tls=off; the M scenarios "
                "--tls=mutual) memory under concurrent oversized AbortStep "
                "requests (issue 42, item 3)",
        "command": " ".join(shlex.quote(x) for x in
                            ["python3", os.path.relpath(__file__)] +
                            sys.argv[1:]),
        "date_utc": started.isoformat(timespec="seconds"),
        "machine": machine_info(args.server),
        "server_binary": os.path.relpath(built_server),
        "request": {"rpc": "/gtopk.v1.Aggregator/AbortStep",
                    "bytes": args.bytes, "kind": args.kind,
                    "content": "AbortStepRequest{step=-1, shard_id=0, "
                               "reason='x'*...}" if args.kind == "valid"
                               else "unparseable (length past the end)",
                    "calls_per_source": args.count},
        "default_max_message_bytes": 64 << 20,
        "note": args.note,
        "scenarios": {},
    }
    for name in names:
        sc = scenarios[name]
        runs = []
        for rep in range(args.repeats):
            print("== %s (%d/%d)" % (name, rep + 1, args.repeats),
                  file=sys.stderr, flush=True)
            run = run_one(args, client, name, sc["sources"], sc["channels"],
                          sc["limit"], sc["flood"], workdir, rep, certs,
                          sc.get("client"), sc.get("health_method"))
            print("   peak %.1f MiB, end %.1f MiB, after %.1f MiB, wall %.1f s,"
                  " codes %s, probe %s" % (
                      run["end_of_flood"].get("vm_hwm_mib", -1),
                      run["end_of_flood"].get("vm_rss_mib", -1),
                      run["after"].get("vm_rss_mib", -1), run["wall_s"],
                      run.get("clients", {}).get("codes"),
                      run["probe_after"].get("code")),
                  file=sys.stderr, flush=True)
            runs.append(run)
        out["scenarios"][name] = {
            "what": sc["what"],
            "max_message_bytes": sc["limit"] or (64 << 20),
            "sources": sc["sources"],
            "connections_per_source": sc["channels"],
            "server_tls": "mutual" if sc.get("client") else "off",
            "target_port": "--health-listen (plaintext)"
                           if sc.get("health_method") else "--listen",
            "method": sc.get("health_method",
                             "/gtopk.v1.Aggregator/AbortStep"),
            "client_credentials": CLIENT_CREDS.get(sc.get("client"),
                                                   "plaintext (no TLS)"),
            "runs": runs,
        }
    out["duration_s"] = round(
        (datetime.datetime.now(datetime.timezone.utc) - started)
        .total_seconds(), 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote %s" % args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
