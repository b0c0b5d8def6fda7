#!/usr/bin/env python3
"""Every out-of-range or malformed flag value of gtopk-server and
gtopk-worker is rejected at start: the process exits 2 (both programs,
cli/exit_codes.h kExitUsage) with a message naming the flag, and promptly;
so are Abseil's syntax errors (an unknown flag, a value that does not parse
as its flag's type), which cli/command_line.cc checks before Abseil's
parser, except inside a --flagfile (Abseil's own exit 1). The worker's cases
point --server at a port where nothing listens, with the default 60 s
--rpc-timeout-s: an exit within the per-case limit proves the check comes
before the join. --tls has no default (docs/security.md): every case says
--tls=off, and a process started without --tls exits the same way, naming
--tls and its choices.

Usage: flags_test.py SERVER_BINARY [WORKER_BINARY]
"""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SERVER = None
WORKER = None
CASE_TIMEOUT_S = 40
MODULE_FILE = "libgtopk_torch_model.so"  # gtopk-worker's libtorch module
# Set in __main__ before the tests run (skipIf reads it at class creation,
# so it is computed from argv here).
WORKER_MISSING = len(sys.argv) <= 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def taken_port():
    """A loopback port another socket listens on while the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


# (flag the message must name, extra arguments)
SERVER_CASES = [
    ("--shard-id", ["--shard-id=-1"]),
    ("--shard-id", ["--shard-id=1"]),
    ("--num-shards", ["--num-shards=0"]),
    ("--num-shards", ["--num-shards=65537"]),
    ("--workers", ["--workers=0"]),
    ("--workers", ["--workers=65537"]),
    ("--peers", ["--num-shards=2", "--peers=,nonsense"]),
    ("--peers", ["--num-shards=2", "--peers=,host:port"]),
    ("--peers", ["--num-shards=2", "--peers=,127.0.0.1:0"]),
    ("--peers", ["--num-shards=2", "--peers=127.0.0.1:1"]),
    ("--listen", ["--listen=nonsense"]),
    ("--listen", ["--listen=localhost:http"]),
    ("--listen", ["--listen=:50051"]),
    ("--listen", ["--listen=127.0.0.1:65536"]),
    ("--step-timeout", ["--step-timeout=0s"]),
    ("--step-timeout", ["--step-timeout=-1s"]),
    ("--step-timeout", ["--step-timeout=1000000h"]),
    # Not creatable: under a regular file (a missing directory is created).
    ("--checkpoint-dir", ["--checkpoint-dir=/etc/hostname/gtopk-ckpt"]),
    ("--checkpoint-every", ["--checkpoint-every=-1"]),
    ("--checkpoint-dir", ["--checkpoint-every=5"]),
    ("--checkpoint-keep", ["--checkpoint-keep=0"]),
    ("--checkpoint-keep", ["--checkpoint-keep=1001"]),
    ("--mode", ["--mode=sparse"]),
    ("--apply", ["--apply=both"]),
    ("--checksum-every", ["--checksum-every=-2"]),
    ("--selection", ["--selection=fast"]),
    ("--selection", ["--selection=quota", "--mode=topk"]),
    ("--selection", ["--selection=quota", "--mode=dense"]),
    ("--selection", ["--selection=layerwise", "--mode=topk"]),
    ("--bucket-mb", ["--selection=layerwise", "--bucket-mb=0"]),
    ("--bucket-mb", ["--selection=layerwise", "--bucket-mb=-1"]),
    ("--bucket-mb", ["--selection=layerwise", "--bucket-mb=nan"]),
    ("--bucket-mb", ["--selection=layerwise", "--bucket-mb=1e7"]),
    # Just over the bound, named as given (not rounded to "1e+06").
    ("got 1000001", ["--selection=layerwise", "--bucket-mb=1000001"]),
    # Buckets of 52 values keep none at density 0.001.
    ("--bucket-mb", ["--selection=layerwise", "--bucket-mb=0.0002",
                     "--density=0.001"]),
    # No buckets outside layer-wise selection.
    ("--bucket-mb", ["--bucket-mb=5"]),
    ("--bucket-mb", ["--selection=quota", "--bucket-mb=5"]),
    # ... the default's value given too (break-it run: it was accepted).
    ("--bucket-mb", ["--bucket-mb=25"]),
    ("--bucket-mb", ["--selection=threshold", "--bucket_mb=25.0"]),
    ("--selector", ["--selector=top"]),
    ("--index-codec", ["--index-codec=zip"]),
    ("--value-codec", ["--value-codec=fp8"]),
    ("--lr", ["--lr=0"]),
    ("--lr", ["--lr=-0.1"]),
    ("--lr", ["--lr=nan"]),
    ("--lr", ["--lr=inf"]),
    ("--lr", ["--lr=1e39"]),  # finite as a double, inf as the float used
    ("--momentum", ["--momentum=1"]),
    ("--momentum", ["--momentum=-0.1"]),
    ("--momentum", ["--momentum=nan"]),
    ("--momentum-mode", ["--momentum-mode=adam"]),
    ("--weight-decay", ["--weight-decay=-1"]),
    ("--weight-decay", ["--weight-decay=nan"]),
    ("--lr-warmup-steps", ["--lr-warmup-steps=-1"]),
    ("--density", ["--density=0"]),
    ("--density", ["--density=1.5"]),
    ("--density", ["--density=nan"]),
    ("--density-warmup", ["--density-warmup=0.5,abc",
                          "--steps-per-epoch=10"]),
    ("--density-warmup", ["--density-warmup=0.5,2", "--steps-per-epoch=10"]),
    ("--density-warmup", ["--density-warmup=0", "--steps-per-epoch=10"]),
    ("--steps-per-epoch", ["--density-warmup=dgc"]),
    ("--steps-per-epoch", ["--steps-per-epoch=-1"]),
    ("--max-message-bytes", ["--max-message-bytes=1023"]),
    ("--max-message-bytes", ["--max-message-bytes=2147483648"]),
    ("--max-concurrent-calls", ["--max-concurrent-calls=-1"]),
    ("--max-concurrent-calls", ["--max-concurrent-calls=1048577"]),
    ("--max-calls-per-peer", ["--max-calls-per-peer=-1"]),
    ("--max-streams-per-connection", ["--max-streams-per-connection=-5"]),
    ("--metrics-port", ["--metrics-port=-1"]),
    ("--metrics-port", ["--metrics-port=65536"]),
    ("--metrics-host", ["--metrics-port=9400", "--metrics-host="]),
    ("--metrics-host", ["--metrics-port=9400", "--metrics-host=[::1"]),
    ("--health-check", ["--health-check=nonsense"]),
    ("--health-check", ["--health-check=127.0.0.1:0"]),
    # Abseil's syntax (cli/command_line.h CheckFlagSyntax).
    ("unknown flag --no-such-flag", ["--no-such-flag=1"]),
    ("unknown flag --shardid", ["--shardid=1"]),
    ("invalid value 'abc' for --shard-id", ["--shard-id=abc"]),
    ("invalid value '3' for --step-timeout", ["--step-timeout=3"]),
    ("invalid value 'maybe' for --momentum-masking",
     ["--momentum-masking=maybe"]),
    ("--momentum-masking= needs true or false", ["--momentum-masking="]),
    ("--health-listen needs a value", ["--health-listen"]),
    # A word left after the flags is a setting lost: Abseil reads
    # `--momentum-masking false` as --momentum-masking=true and a word.
    ("unexpected argument 'false'", ["--momentum-masking", "false"]),
    ("unexpected argument 'extra'", ["extra"]),
    ("unexpected argument '--workers=2'", ["--", "--workers=2"]),
]

WORKER_CASES = [
    ("--server", ["--server=nonsense"]),
    ("--server", ["--server=127.0.0.1"]),
    ("--server", ["--server=127.0.0.1:port"]),
    ("--server", ["--server=127.0.0.1:0"]),
    ("--server", ["--server=:50051"]),
    ("--server", ["--server=::1:50051"]),  # IPv6 needs brackets
    ("--rank", ["--rank=-2"]),
    ("--rank", ["--rank=65536"]),
    ("--batch-size", ["--batch-size=0"]),
    ("--batch-size", ["--batch-size=65537"]),
    ("--epochs", ["--epochs=0"]),
    ("--epochs", ["--epochs=1000000000000"]),
    ("--steps", ["--steps=-1"]),
    ("--train-limit", ["--train-limit=-1"]),
    ("--test-limit", ["--test-limit=-1"]),
    ("--eval-every", ["--eval-every=-1"]),
    ("--compute-ms", ["--compute-ms=-1"]),
    ("--compute-ms", ["--model=mlp", "--compute-ms=5"]),
    ("--threads", ["--threads=0"]),
    ("--threads", ["--threads=1025"]),
    ("--device", ["--device=tpu"]),
    ("--model", ["--model=resnet"]),
    ("--model", ["--model=synthetic:0"]),
    ("--metrics-port", ["--metrics-port=-1"]),
    ("--metrics-port", ["--metrics-port=65536"]),
    ("--metrics-host", ["--metrics-port=9401", "--metrics-host="]),
    ("--rpc-timeout-s", ["--rpc-timeout-s=0"]),
    ("--rpc-timeout-s", ["--rpc-timeout-s=86401"]),
    ("--recovery-timeout", ["--recovery-timeout=-1s"]),
    ("--recovery-timeout", ["--recovery-timeout=25h"]),
    ("--recovery-timeout", ["--recovery-timeout=inf"]),
    ("invalid value '3' for --recovery-timeout", ["--recovery-timeout=3"]),
    ("--testing-final-check-delay", ["--testing-final-check-delay=-1s"]),
    ("--cpu-isa", ["--cpu-isa=avx512"]),
    ("--mode", ["--mode=sparse"]),
    ("--selector", ["--selector=top"]),
    ("--index-codec", ["--index-codec=zip"]),
    ("--value-codec", ["--value-codec=fp8"]),
    ("--density", ["--density=2"]),
    ("--density", ["--density=0"]),
    ("--density", ["--density=abc"]),
    ("--lr", ["--lr=nan"]),
    ("--lr", ["--lr=0"]),
    ("--lr", ["--lr=-1"]),
    ("--momentum", ["--momentum=1"]),
    ("--momentum", ["--momentum=-0.5"]),
    ("--summary-json", ["--summary-json=/nonexistent/dir/w.json"]),
    # Data that cannot be read is a startup failure too (Trainer::Prepare).
    ("--data-dir", ["--model=mlp", "--data-dir=/nonexistent/fashion"]),
    # A word left after the flags (the worker has no boolean flag).
    ("unexpected argument 'stray'", ["stray"]),
    # Abseil's syntax (cli/command_line.h CheckFlagSyntax).
    ("unknown flag --no-such-flag", ["--no-such-flag=1"]),
    ("invalid value 'x' for --rank", ["--rank=x"]),
    ("invalid value '1.5' for --batch-size", ["--batch-size=1.5"]),
    ("unknown flag --noserver: --server is not a boolean flag",
     ["--noserver"]),
    ("unexpected argument '--steps=5'", ["--", "--steps=5"]),
]

# What a process started without --tls says (cli/tls_flag.h).
TLS_REQUIRED = ("--tls is required: --tls=mutual (with --tls-cert/--tls-key/"
                "--tls-ca), --tls=server, or --tls=off for plaintext on a "
                "trusted network (docs/security.md)")


def run(argv, env=None):
    full_env = dict(os.environ)
    full_env.pop("JOB_COMPLETION_INDEX", None)
    full_env.update(env or {})
    return subprocess.run(argv, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CASE_TIMEOUT_S, env=full_env)


class ServerFlagsTest(unittest.TestCase):
    def test_each_bad_value_exits_2_naming_the_flag(self):
        for flag, extra in SERVER_CASES:
            with self.subTest(args=extra):
                # Port 0: a case that slipped through would still start
                # (and then time out here) without disturbing anything.
                r = run([SERVER, "--listen=127.0.0.1:0", "--tls=off"] + extra)
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(flag, r.stdout)
                self.assertNotIn("listening on", r.stdout)

    def test_without_tls_exits_2_naming_the_choices(self):
        """--tls has no default: plaintext only when said (docs/security.md).
        Also in --health-check's client mode."""
        for argv in ([SERVER, "--listen=127.0.0.1:0"],
                     [SERVER, "--listen=127.0.0.1:0", "--tls="],
                     [SERVER, "--health-check=127.0.0.1:%d" % free_port()]):
            with self.subTest(argv=argv[1:]):
                r = run(argv)
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(TLS_REQUIRED, r.stdout)
                self.assertNotIn("listening on", r.stdout)

    # --tls=off starting with its WARNING: security_flags_test.py's
    # test_plaintext_prints_the_warning (the same server binary).

    def test_good_values_start(self):
        """The control: the base flags alone start a server."""
        p = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:0", "--tls=off",
             "--metrics-host=127.0.0.1",
             "--metrics-port=%d" % free_port(), "--density-warmup=dgc",
             "--steps-per-epoch=10"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = p.stdout.readline()
            self.assertIn("listening on 127.0.0.1:", line)
            self.assertIn("metrics on 127.0.0.1:", p.stdout.readline())
        finally:
            p.terminate()
            p.wait(timeout=30)
            p.stdout.close()

    def test_a_taken_metrics_port_exits_2_naming_the_address(self):
        """prometheus-cpp's exposer throws when it cannot bind; the server
        turns that into a clear error at start, before the shard runs."""
        with taken_port() as port:
            r = run([SERVER, "--listen=127.0.0.1:0", "--tls=off",
                     "--metrics-host=127.0.0.1", "--metrics-port=%d" % port])
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn("--metrics-port=%d" % port, r.stdout)
        self.assertIn("UNAVAILABLE: cannot listen on 127.0.0.1:%d" % port,
                      r.stdout)
        self.assertNotIn("listening on", r.stdout)
        self.assertNotIn("terminate called", r.stdout)

    def test_a_flagfile_is_read_by_abseil(self):
        """Flags from a --flagfile: its good flags apply (here the bad
        --listen, exit 2 naming it), and a syntax error inside it is
        Abseil's, exit 1 (server/flags.md)."""
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "flags")

            def with_flagfile(line, *argv):
                with open(path, "w") as f:
                    f.write(line + "\n")
                return run([SERVER, "--tls=off"] + list(argv) +
                           ["--flagfile=" + path])

            r = with_flagfile("--listen=nonsense")
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn("--listen", r.stdout)
            r = with_flagfile("--no_such_flag=1", "--listen=127.0.0.1:0")
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn("no_such_flag", r.stdout)
            self.assertNotIn("listening on", r.stdout)
            # A flag given in the file counts as given: --bucket-mb at its
            # default's value outside layer-wise selection is refused.
            r = with_flagfile("--bucket_mb=25", "--listen=127.0.0.1:0")
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn("--bucket-mb", r.stdout)
            self.assertNotIn("listening on", r.stdout)


class CheckpointStartLineTest(unittest.TestCase):
    """The line after `listening on` says what a start came back with
    (server/flags.md, --checkpoint-dir): the operator's evidence that a
    restarted shard read its checkpoint volume (the compose test relies on
    it)."""

    def start(self, ckpt):
        p = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:0", "--tls=off",
             "--checkpoint-dir=" + ckpt,
             "--checkpoint-every=1", "--steps-per-epoch=10"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        listening = p.stdout.readline()
        self.assertIn("listening on 127.0.0.1:", listening)
        return p, listening.split("listening on ")[1].strip(), p.stdout.readline()

    def stop(self, p):
        p.terminate()
        p.wait(timeout=30)
        p.stdout.close()

    @unittest.skipIf(WORKER_MISSING, "gtopk-worker is not built (no libtorch)")
    def test_empty_then_restored_after_a_run(self):
        import tempfile
        with tempfile.TemporaryDirectory() as ckpt:
            p, address, line = self.start(ckpt)
            try:
                self.assertEqual(line, "no checkpoint in %s: starting empty\n" % ckpt)
                r = run([WORKER, "--server=" + address, "--tls=off",
                         "--model=synthetic:1000", "--steps=3",
                         "--compute-ms=0"])
                self.assertEqual(r.returncode, 0, r.stdout)
            finally:
                self.stop(p)
            p, _, line = self.start(ckpt)
            try:
                self.assertEqual(line, "restored checkpoint from %s: next step 3\n" % ckpt)
            finally:
                self.stop(p)


class WorkerFlagsTest(unittest.TestCase):
    def test_without_tls_exits_2_naming_the_choices(self):
        for extra in ([], ["--tls="]):
            with self.subTest(args=extra):
                r = run([WORKER, "--server=127.0.0.1:%d" % free_port(),
                         "--model=synthetic:10"] + extra)
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(TLS_REQUIRED, r.stdout)

    def test_tls_off_prints_the_warning(self):
        """Nothing listens: the join fails after --rpc-timeout-s (the run
        failed: exit 1, not a startup failure), and the WARNING came
        first."""
        r = run([WORKER, "--server=127.0.0.1:%d" % free_port(), "--tls=off",
                 "--model=synthetic:10", "--rpc-timeout-s=1"])
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("gtopk-worker: WARNING: --tls=off: plaintext and "
                      "unauthenticated", r.stdout)
        self.assertNotIn("--tls is required", r.stdout)

    def test_each_bad_value_exits_2_before_joining_naming_the_flag(self):
        leader = "--server=127.0.0.1:%d" % free_port()  # nothing listens
        for flag, extra in WORKER_CASES:
            with self.subTest(args=extra):
                argv = [WORKER, leader, "--tls=off", "--model=synthetic:10"]
                if any(a.startswith("--model=") for a in extra):
                    argv.remove("--model=synthetic:10")
                r = run(argv + extra)
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(flag, r.stdout)

    def test_a_taken_metrics_port_exits_2_before_joining(self):
        with taken_port() as port:
            r = run([WORKER, "--server=127.0.0.1:%d" % free_port(),
                     "--tls=off", "--model=synthetic:10",
                     "--metrics-host=127.0.0.1",
                     "--metrics-port=%d" % port])
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn("--metrics-port=%d" % port, r.stdout)
        self.assertIn("cannot listen on 127.0.0.1:%d" % port, r.stdout)
        self.assertNotIn("terminate called", r.stdout)

    def test_libtorch_is_loaded_only_for_a_torch_model(self):
        """libtorch is the module libgtopk_torch_model.so, loaded on the
        first torch model (worker/trainer/torch_module.h). With
        GTOPK_TORCH_MODULE naming a file that is missing, a directory, or
        a file that is not the module, --model=mlp exits 2 before the join
        naming the path (the libtorch hint only when a library the module
        needs is missing); synthetic:N never loads it (the same bad path,
        and the join is what fails: exit 1). A relative path is the working
        directory's."""
        leader = "--server=127.0.0.1:%d" % free_port()  # nothing listens
        base = [WORKER, leader, "--tls=off", "--rpc-timeout-s=1"]
        missing = "/nonexistent/libgtopk_torch_model.so"
        r = run(base + ["--model=mlp"], env={"GTOPK_TORCH_MODULE": missing})
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn("GTOPK_TORCH_MODULE=%s: no such file" % missing, r.stdout)
        self.assertIn("the variable replaces the search", r.stdout)
        not_module = os.path.realpath(SERVER)  # an ELF file, not a module
        for bad in (not_module, os.path.dirname(not_module)):
            r = run(base + ["--model=cnn"], env={"GTOPK_TORCH_MODULE": bad})
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn("cannot load gtopk's libtorch module " + bad,
                          r.stdout)
            self.assertNotIn("needs libtorch", r.stdout)
        r = run(base + ["--model=synthetic:10"],
                env={"GTOPK_TORCH_MODULE": missing})
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertNotIn("libtorch", r.stdout)
        self.assertIn("127.0.0.1", r.stdout)
        # Relative: the module beside the worker, named from its directory;
        # it loads, so the join is what fails.
        worker_dir = os.path.dirname(os.path.realpath(WORKER))
        r = subprocess.run([os.path.realpath(WORKER)] + base[1:] +
                           ["--model=mlp"], cwd=worker_dir,
                           env=dict(os.environ,
                                    GTOPK_TORCH_MODULE=MODULE_FILE),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True,
                           timeout=CASE_TIMEOUT_S)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertNotIn("libtorch module", r.stdout)

    def test_a_module_of_other_headers_is_refused(self):
        """The module's identity is the version and a hash of the headers
        whose types cross (worker/CMakeLists.txt): a module that says only
        the version is refused (exit 2), not called through another
        vtable."""
        cc = shutil.which("cc") or shutil.which("gcc")
        self.assertIsNotNone(cc, "a C compiler (build-essential)")
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "fake.c")
            with open(src, "w") as f:
                f.write("struct api { const char* v; void* f[3]; };\n"
                        "static const struct api a = {\"0.1.0\", {0, 0, 0}};\n"
                        "const struct api* gtopk_torch_model_api(void) "
                        "{ return &a; }\n")
            fake = os.path.join(tmp, "libfake.so")
            subprocess.run([cc, "-shared", "-fPIC", "-o", fake, src],
                           check=True)
            r = run([WORKER, "--server=127.0.0.1:%d" % free_port(),
                     "--tls=off", "--model=mlp"],
                    env={"GTOPK_TORCH_MODULE": fake})
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertRegex(r.stdout, r"is the libtorch module of gtopk 0\.1\.0; "
                         r"this gtopk-worker is [0-9.]+\+[0-9a-f]{16}")

    def test_an_installed_layout_is_found_also_through_the_loader(self):
        """gtopk-worker in bin/ loads ../lib/gtopk/libgtopk_torch_model.so,
        run directly and as /lib64/ld-linux-x86-64.so.2 bin/gtopk-worker
        (/proc/self/exe is the loader then): the copy's module is the one
        mapped while the worker waits for its leader."""
        loader = "/lib64/ld-linux-x86-64.so.2"
        module = os.path.join(os.path.dirname(os.path.realpath(WORKER)),
                              MODULE_FILE)
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "bin"))
            os.makedirs(os.path.join(tmp, "lib", "gtopk"))
            worker = os.path.join(tmp, "bin", "gtopk-worker")
            installed = os.path.join(tmp, "lib", "gtopk", MODULE_FILE)
            shutil.copy2(os.path.realpath(WORKER), worker)
            shutil.copy2(module, installed)
            for prefix in ([], [loader] if os.path.exists(loader) else None):
                if prefix is None:
                    continue
                with self.subTest(prefix=prefix):
                    env = dict(os.environ)
                    env.pop("GTOPK_TORCH_MODULE", None)
                    p = subprocess.Popen(
                        prefix + [worker, "--server=127.0.0.1:%d" % free_port(),
                                  "--tls=off", "--model=mlp",
                                  "--rpc-timeout-s=20"],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, env=env)
                    try:
                        maps = ""
                        deadline = time.monotonic() + 20
                        while MODULE_FILE not in maps and \
                                time.monotonic() < deadline and p.poll() is None:
                            time.sleep(0.05)
                            with open("/proc/%d/maps" % p.pid) as f:
                                maps = f.read()
                        self.assertIn(installed, maps)
                        self.assertNotIn(module, maps)
                    finally:
                        p.kill()
                        p.wait()

    def test_portable_re_executes_when_openblas_is_loaded_before_main(self):
        """--cpu-isa=portable when OpenBLAS is already loaded (LD_PRELOAD
        here; a program linked against it) pins OPENBLAS_CORETYPE by
        running the program again (worker/trainer/cpu_isa.h), directly and
        through /lib64/ld-linux-x86-64.so.2, where /proc/self/exe is the
        loader (a break-it run found the loader given the worker's flags:
        "unrecognized option"). Both runs reach the join, which fails
        (nothing listens): exit 1, the pinned note printed once."""
        openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
        if not os.path.exists(openblas):
            self.skipTest("needs OpenBLAS at %s (Debian: libopenblas0-pthread,"
                          " which libtorch-dev pulls in)" % openblas)
        loader = "/lib64/ld-linux-x86-64.so.2"
        for prefix in ([], [loader]):
            with self.subTest(prefix=prefix):
                env = dict(os.environ, LD_PRELOAD=openblas)
                env.pop("OPENBLAS_CORETYPE", None)
                r = subprocess.run(
                    prefix + [os.path.realpath(WORKER),
                              "--server=127.0.0.1:%d" % free_port(),
                              "--tls=off", "--rpc-timeout-s=1",
                              "--model=synthetic:10", "--cpu-isa=portable"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True,
                    timeout=CASE_TIMEOUT_S, env=env)
                self.assertEqual(r.returncode, 1, r.stdout)
                self.assertEqual(r.stdout.count(
                    "--cpu-isa=portable: ATEN_CPU_CAPABILITY=avx2"), 1,
                    r.stdout)
                self.assertIn("OPENBLAS_CORETYPE=Haswell", r.stdout)
                self.assertIn("127.0.0.1", r.stdout)  # the join failed
                self.assertNotIn("unrecognized option", r.stdout)

    def test_bad_job_completion_index(self):
        r = run([WORKER, "--server=127.0.0.1:%d" % free_port(), "--tls=off",
                 "--model=synthetic:10"], env={"JOB_COMPLETION_INDEX": "x"})
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn("JOB_COMPLETION_INDEX", r.stdout)


if __name__ == "__main__":
    SERVER = sys.argv[1]
    WORKER = sys.argv[2] if len(sys.argv) > 2 else None
    if WORKER is None:
        del WorkerFlagsTest  # gtopk-worker is not built (no libtorch)
    unittest.main(argv=[sys.argv[0]], verbosity=2)
