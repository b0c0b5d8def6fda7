"""Shared helpers of the Python tests and benchmarks: gtopk-server shards
and worker subprocesses on loopback, each in its own process group, always
killed (SIGKILL to the group) when the test is done.

    with Servers(num_shards=2, workers=3, log_dir=d, mode="gtopk") as srv:
        client = gtopk.Client(srv.leader, n, rank=0, tls="off")

Paths: GTOPK_BUILD_DIR (set by ctest) or <repo>/build.
Standard library only.
"""

import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

LOOPBACK = "127.0.0.1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BUILD_DIR = os.environ.get("GTOPK_BUILD_DIR") or os.path.join(REPO, "build")
SERVER_BIN = os.path.join(BUILD_DIR, "server", "gtopk-server")
REPLAY_BIN = os.path.join(BUILD_DIR, "tests", "gtopk_replay_worker")
PYTHON_DIR = os.path.join(BUILD_DIR, "python")

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not glibc
    _libc = None


def child_setup():
    """preexec_fn: own session/process group, SIGKILL when the parent dies,
    and SIGINT at its default (a shell's background job ignores SIGINT, and
    a Python child that inherits SIG_IGN installs no KeyboardInterrupt
    handler)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_ports(count):
    """Distinct free loopback ports (held open together so they differ; a
    race with another program is handled by Servers' retry)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def python_env():
    """The environment for a Python child that imports gtopk."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    if PYTHON_DIR not in path.split(os.pathsep):
        env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + path if path else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """A subprocess in its own process group, output to a log file."""

    def __init__(self, argv, log_path, env=None, stdout_pipe=False):
        self.argv = list(argv)
        self.log_path = log_path
        with open(log_path, "ab") as out:
            out.write(("$ %s\n" % shlex.join(self.argv)).encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else out,
                stderr=out, preexec_fn=child_setup, close_fds=True,
                env=env)

    @property
    def pid(self):
        return self.proc.pid

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout):
        return self.proc.wait(timeout=timeout)

    def kill(self):
        """SIGKILL to the whole group (also after the leader exited: stray
        descendants), then reap."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            sys.stderr.write("pid %d did not die after SIGKILL\n"
                             % self.proc.pid)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def log(self, max_bytes=16384):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError as e:
            return "(cannot read %s: %s)" % (self.log_path, e)


class Servers:
    """S gtopk-server shards on loopback ports.

    flags: cluster flags as keyword arguments, underscores for dashes
    (mode="gtopk", selection="quota", density=0.01, step_timeout="30s",
    momentum_mode="dgc", ...). Every shard gets the same ones.
    tls_dir: a directory made by deploy/tls/make-certs.sh: every shard runs
    with --tls=mutual and its own certificate (shard-<s>.crt); None: the
    shards run with --tls=off (plaintext, said explicitly) unless the flags
    name --tls.
    """

    DEFAULTS = {"step_timeout": "30s", "drain_timeout": "0s", "seed": 1}

    def __init__(self, num_shards, workers, log_dir, name="srv",
                 tls_dir=None, **flags):
        self.tls_dir = tls_dir
        self.num_shards = num_shards
        self.workers = workers
        self.log_dir = log_dir
        self.name = name
        self.flags = dict(self.DEFAULTS)
        self.flags.update(flags)
        self.procs = []
        self.addresses = []

    @property
    def leader(self):
        return self.addresses[0]

    def argv(self, shard):
        a = [SERVER_BIN,
             "--listen=%s" % self.addresses[shard],
             "--shard-id=%d" % shard,
             "--num-shards=%d" % self.num_shards,
             "--workers=%d" % self.workers,
             "--peers=%s" % ",".join(self.addresses)]
        for k, v in sorted(self.flags.items()):
            a.append("--%s=%s" % (k.replace("_", "-"), v))
        if self.tls_dir:
            a += ["--tls=mutual",
                  "--tls-cert=%s" % os.path.join(self.tls_dir,
                                                 "shard-%d.crt" % shard),
                  "--tls-key=%s" % os.path.join(self.tls_dir,
                                                "shard-%d.key" % shard),
                  "--tls-ca=%s" % os.path.join(self.tls_dir, "ca.crt")]
        elif "tls" not in self.flags:
            a.append("--tls=off")
        return a

    def start(self, attempts=3, ready_timeout=30.0):
        for attempt in range(attempts):
            self.addresses = ["%s:%d" % (LOOPBACK, p)
                              for p in free_ports(self.num_shards)]
            self.procs = []
            try:
                for s in range(self.num_shards):
                    log = os.path.join(self.log_dir, "%s-%d-shard%d.log" % (
                        self.name, attempt, s))
                    self.procs.append(Proc(self.argv(s), log))
                self._wait_listening(ready_timeout)
                return self
            except RuntimeError as e:
                text = "".join(p.log() for p in self.procs)
                self.stop()
                race = ("already in use" in text or "cannot listen" in text
                        or "Failed to add" in text)
                if not race or attempt == attempts - 1:
                    raise RuntimeError("%s\n%s" % (e, text)) from None
        raise AssertionError("unreachable")

    def _wait_listening(self, timeout):
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.procs)))
        while pending:
            for s in sorted(pending):
                p = self.procs[s]
                if "listening on " in p.log():
                    pending.discard(s)
                elif p.poll() is not None:
                    raise RuntimeError("shard %d exited during start-up "
                                       "(code %s)" % (s, p.poll()))
            if pending and time.monotonic() > deadline:
                raise RuntimeError("shard(s) %s not listening after %.0f s"
                                   % (sorted(pending), timeout))
            if pending:
                time.sleep(0.02)

    def stop(self):
        for p in self.procs:
            p.kill()
        self.procs = []

    def logs(self):
        return "".join("--- %s\n%s" % (p.log_path, p.log())
                       for p in self.procs)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def make_certs(out_dir, shards, workers):
    """Throwaway CA and certificates (deploy/tls/make-certs.sh, openssl CLI)
    in out_dir: ca.crt, shard-<s>.{crt,key}, worker-<r>.{crt,key},
    worker.{crt,key}, token, shard-token. Returns out_dir."""
    subprocess.run(["sh", os.path.join(REPO, "deploy", "tls", "make-certs.sh"),
                    out_dir, str(shards), str(workers)], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    return out_dir


def replay_argv(leader, rank, n, gradients, steps, out, params=None,
                timing_json=None):
    """gtopk_replay_worker's command line (tests/python/replay_worker.cc)."""
    a = [REPLAY_BIN, "--leader=%s" % leader, "--rank=%d" % rank,
         "--n=%d" % n, "--gradients=%s" % gradients, "--steps=%d" % steps,
         "--out=%s" % out]
    if params:
        a.append("--params=%s" % params)
    if timing_json:
        # Abseil flags: underscores (--timing-json is refused).
        a.append("--timing_json=%s" % timing_json)
    return a


def wait_all(procs, timeout, what="worker"):
    """Waits for every Proc; kills them all and raises on a non-zero exit
    or when `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            left = max(0.1, deadline - time.monotonic())
            try:
                code = p.wait(left)
            except subprocess.TimeoutExpired:
                raise AssertionError("%s %s still running after %.0f s:\n%s"
                                     % (what, p.argv, timeout, p.log()))
            if code != 0:
                raise AssertionError("%s %s exited %d:\n%s"
                                     % (what, p.argv, code, p.log()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


class KeepLogsOnFailure:
    """unittest.TestCase mixin: removes the test's temp dir `self.dir`
    after a passing test, keeps it (and says where) after a failing one."""

    def run(self, result=None):
        before = len(result.failures) + len(result.errors) if result else 0
        out = super().run(result)
        if result and len(result.failures) + len(result.errors) > before:
            sys.stderr.write("logs kept in %s\n" % self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        return out
