#!/usr/bin/env python3
"""gtopk-server's transport security flags as a process (docs/security.md):
certificates made by deploy/tls/make-certs.sh; a server with --tls=mutual and
--health-listen answers `--health-check` on the plaintext health port without
credentials and on the main port only with a certificate; a check without one
fails promptly (no hang); bad certificate flags exit 2 naming the flag and
file before anything listens; --tls=off prints the WARNING line. --tls has
no default: every command here says which mode it means (flags_test.py
checks the exit without it).

Usage: security_flags_test.py SERVER_BINARY
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SERVER = None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_CERTS = os.path.join(ROOT, "deploy", "tls", "make-certs.sh")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=20):
    return subprocess.run([SERVER] + args, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


class SecurityFlagsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.certs = os.path.join(cls.tmp.name, "tls")
        subprocess.run(["sh", MAKE_CERTS, cls.certs, "1", "1"], check=True,
                       stdout=subprocess.DEVNULL, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def c(self, name):
        return os.path.join(self.certs, name)

    def mutual(self, who="shard-0"):
        return ["--tls=mutual", "--tls-cert=" + self.c(who + ".crt"),
                "--tls-key=" + self.c(who + ".key"),
                "--tls-ca=" + self.c("ca.crt")]

    def test_health_checks_of_a_mutual_tls_server(self):
        port, health = free_port(), free_port()
        p = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:%d" % port,
             "--health-listen=127.0.0.1:%d" % health] + self.mutual(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            self.assertIn("listening on 127.0.0.1:%d" % port,
                          p.stdout.readline())
            self.assertIn("health on 127.0.0.1:%d" % health,
                          p.stdout.readline())
            self.assertIn("tls=mutual", p.stdout.readline())
            # The plaintext health port: no credentials needed.
            r = run(["--health-check=127.0.0.1:%d" % health, "--tls=off"])
            self.assertEqual(r.returncode, 0, r.stdout)
            self.assertEqual(r.stdout.strip(), "SERVING")
            # The main port with a shard certificate (what a HEALTHCHECK
            # inside the shard's container can present).
            r = run(["--health-check=127.0.0.1:%d" % port] + self.mutual())
            self.assertEqual(r.returncode, 0, r.stdout)
            self.assertEqual(r.stdout.strip(), "SERVING")
            # Without one: refused by the handshake, promptly (5 s deadline).
            start = time.monotonic()
            r = run(["--health-check=127.0.0.1:%d" % port, "--tls=off"])
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn("UNAVAILABLE", r.stdout)
            self.assertLess(time.monotonic() - start, 10)
        finally:
            p.terminate()
            p.wait(timeout=30)
            p.stdout.close()

    def test_bad_certificate_flags_exit_2_naming_flag_and_file(self):
        cases = [
            (["--tls=mutual", "--tls-cert=" + self.c("shard-0.crt"),
              "--tls-key=" + self.c("worker.key"),
              "--tls-ca=" + self.c("ca.crt")],
             "--tls-key=%s does not match the certificate" % self.c(
                 "worker.key")),
            (["--tls=mutual", "--tls-cert=/nonexistent.crt",
              "--tls-key=" + self.c("shard-0.key"),
              "--tls-ca=" + self.c("ca.crt")],
             "--tls-cert=/nonexistent.crt: cannot be read"),
            (["--tls=mutual"], "--tls=mutual needs --tls-cert and --tls-key"),
            (["--tls=maybe"], "--tls: unknown TLS mode 'maybe'"),
            (["--tls=off", "--tls-cert=" + self.c("shard-0.crt")],
             "--tls-cert is set but --tls=off"),
            (["--tls-cert=" + self.c("shard-0.crt")], "--tls is required"),
            (["--tls=off", "--token-file=" + self.c("token")],
             "--token-file needs --shard-token-file"),
            (["--tls=off", "--health-listen=nonsense"], "health-listen"),
            # Devices and directories are refused, not read without bound.
            (["--tls=server", "--tls-cert=" + self.c("shard-0.crt"),
              "--tls-key=" + self.c("shard-0.key"), "--tls-ca=/dev/zero"],
             "--tls-ca=/dev/zero: larger than 1 MiB"),
            (["--tls=server", "--tls-cert=" + self.c("shard-0.crt"),
              "--tls-key=" + self.c("shard-0.key"),
              "--tls-ca=" + self.certs],
             "--tls-ca=%s: is a directory" % self.certs),
        ]
        for args, message in cases:
            with self.subTest(args=args):
                r = run(["--listen=127.0.0.1:0"] + args)
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(message, r.stdout)
                self.assertNotIn("listening on", r.stdout)

    def test_health_check_of_a_tls_server_needs_only_the_ca(self):
        # --tls=server with tokens: an operator holding the CA bundle (no
        # certificate of their own) checks the main port; the check is a
        # client, like a worker.
        port = free_port()
        p = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:%d" % port, "--tls=server",
             "--tls-cert=" + self.c("shard-0.crt"),
             "--tls-key=" + self.c("shard-0.key"),
             "--tls-ca=" + self.c("ca.crt"),
             "--token-file=" + self.c("token"),
             "--shard-token-file=" + self.c("shard-token")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            self.assertIn("listening on 127.0.0.1:%d" % port,
                          p.stdout.readline())
            r = run(["--health-check=127.0.0.1:%d" % port, "--tls=server",
                     "--tls-ca=" + self.c("ca.crt")])
            self.assertEqual(r.returncode, 0, r.stdout)
            self.assertEqual(r.stdout.strip(), "SERVING")
        finally:
            p.terminate()
            p.wait(timeout=30)
            p.stdout.close()

    def test_make_certs_refuses_bad_counts(self):
        cases = [(["x", "1"], {}, "SHARDS must be a non-negative integer"),
                 (["1", "2x"], {}, "WORKERS must be a non-negative integer"),
                 (["-1", "2"], {}, "SHARDS must be a non-negative integer"),
                 (["", "1"], {}, "SHARDS must be a non-negative integer"),
                 (["1", "1"], {"GTOPK_CERT_DAYS": "0"},
                  "GTOPK_CERT_DAYS must be at least 1")]
        for args, env, message in cases:
            with self.subTest(args=args, env=env):
                out = os.path.join(self.tmp.name, "bad")
                r = subprocess.run(["sh", MAKE_CERTS, out] + args,
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   timeout=60, env=dict(os.environ, **env))
                self.assertEqual(r.returncode, 2, r.stdout)
                self.assertIn(message, r.stdout)
                self.assertFalse(os.path.exists(os.path.join(out, "ca.crt")))

    def test_plaintext_prints_the_warning(self):
        p = subprocess.Popen([SERVER, "--listen=127.0.0.1:0", "--tls=off"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        try:
            self.assertIn("listening on", p.stdout.readline())
            self.assertIn("tls=off", p.stdout.readline())
            self.assertIn("WARNING: --tls=off: plaintext and unauthenticated",
                          p.stdout.readline())
        finally:
            p.terminate()
            p.wait(timeout=30)
            p.stdout.close()


if __name__ == "__main__":
    SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)
