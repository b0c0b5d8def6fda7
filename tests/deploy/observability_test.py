#!/usr/bin/env python3
"""Observability tests: the Grafana dashboards and the metrics of real
processes.

  * DashboardLintTest (ctest dashboard_lint_test; no cluster): in the spirit
    of grafana's dashboard-linter - fixed uid; a datasource variable used by
    every panel and query; job/instance variables, and job=~"$job",
    instance=~"$instance" matchers on every selector; $__rate_interval in
    every rate; unit, title and description on every panel; every metric
    referenced is documented in docs/metrics.md; with the types documented
    there: rate() only over counters/histogram series and every counter
    under a rate(), histogram_quantile over _bucket aggregated by le, and
    the panel unit matching the base unit (s, Bps, bytes). Also the
    provisioning files.
  * ClusterMetricsTest (ctest observability_test): runs the local cluster
    (deploy/local/gtopk_local.py, real gtopk-server and gtopk-worker on a
    slice of Fashion-MNIST) with a real Prometheus, checks every process's
    /metrics with `promtool check metrics`, waits for scrapes and evaluates
    every dashboard panel's PromQL (variables substituted) through
    Prometheus's HTTP API: each must succeed and return at least one series.
    Skipped (with the reason) when prometheus/promtool or gtopk-worker are
    missing, except under CI=true, where that is a failure.

The build directory comes from GTOPK_BUILD_DIR (ctest sets it), else build/.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCHER = os.path.join(ROOT, "deploy", "local", "gtopk_local.py")
DASHBOARDS = sorted(glob.glob(os.path.join(ROOT, "dashboards", "*.json")))
PROVISIONING = os.path.join(ROOT, "dashboards", "provisioning")
METRICS_DOC = os.path.join(ROOT, "docs", "metrics.md")
BUILD_DIR = os.path.abspath(os.environ.get("GTOPK_BUILD_DIR",
                                           os.path.join(ROOT, "build")))
SERVER_BIN = os.path.join(BUILD_DIR, "server", "gtopk-server")
WORKER_BIN = os.path.join(BUILD_DIR, "worker", "gtopk-worker")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DATASOURCE_UIDS = ("${datasource}", "$datasource")
# What the dashboard's "All" means (allValue) and the rate window used when
# a panel's query is evaluated outside Grafana.
ALL_VALUE = ".+"
RATE_INTERVAL = "10s"
METRIC_RE = re.compile(r"\b((?:gtopk|process)_[a-zA-Z0-9_]+)\b(\{[^}]*\})?")
RANGE_FUNC_RE = re.compile(r"\b(rate|irate|increase|delta|deriv)\s*\(")


def panels_of(dashboard):
    """Every panel, rows' nested panels included; rows themselves excluded."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def base_metric(name):
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def lint_expr(expr, documented):
    """Problems of one PromQL expression (a list of strings)."""
    problems = []
    for m in METRIC_RE.finditer(expr):
        name, matchers = m.group(1), m.group(2) or ""
        if 'job=~"$job"' not in matchers:
            problems.append("%s has no job=~\"$job\" matcher" % name)
        if 'instance=~"$instance"' not in matchers:
            problems.append("%s has no instance=~\"$instance\" matcher" % name)
        if documented is not None and name not in documented and \
                base_metric(name) not in documented:
            problems.append("%s is not documented in docs/metrics.md" % name)
    if not METRIC_RE.search(expr):
        problems.append("no gtopk_/process_ metric in %r" % expr)
    for m in RANGE_FUNC_RE.finditer(expr):
        # The range of this call: the first [...] after it.
        rng = re.search(r"\[([^\]]*)\]", expr[m.end():])
        if rng is None or rng.group(1) != "$__rate_interval":
            problems.append("%s(...) must use [$__rate_interval], got %s" % (
                m.group(1), rng.group(0) if rng else "no range"))
    for rng in re.finditer(r"\[([^\]]*)\]", expr):
        if rng.group(1) != "$__rate_interval":
            problems.append("range [%s] is not [$__rate_interval]"
                            % rng.group(1))
    return problems


def call_argument(expr, open_paren):
    """The text between expr[open_paren] == "(" and its matching ")"."""
    depth = 0
    for i in range(open_paren, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[open_paren + 1:i]
    return expr[open_paren + 1:]


def lint_semantics(expr, types):
    """Problems with what an expression computes, given the documented
    metric types: rates of counters only, every counter under a rate,
    histogram_quantile over rated _bucket series aggregated by le."""
    problems = []
    for a, b in ("()", "[]", "{}"):
        if expr.count(a) != expr.count(b):
            problems.append("unbalanced %s%s" % (a, b))
    for m in METRIC_RE.finditer(expr):
        name = m.group(1)
        base = base_metric(name)
        kind = types.get(name) or types.get(base)
        if kind is None:
            continue  # reported as undocumented
        if kind == "histogram" and name == base:
            problems.append("histogram %s used without _bucket/_sum/_count"
                            % name)
            continue
        cumulative = kind in ("counter", "histogram")
        under_rate = re.search(r"\b(rate|irate|increase)\s*\(\s*$",
                               expr[:m.start()]) is not None
        if cumulative and not under_rate:
            problems.append("%s %s is cumulative: wrap it in rate()"
                            % (kind, name))
        if not cumulative and under_rate:
            problems.append("rate() of %s %s: rate is for counters"
                            % (kind, name))
    for m in re.finditer(r"\bhistogram_quantile\s*\(", expr):
        arg = call_argument(expr, m.end() - 1)
        names = [n.group(1) for n in METRIC_RE.finditer(arg)]
        if not names or any(not n.endswith("_bucket") for n in names):
            problems.append("histogram_quantile over %s: needs _bucket "
                            "series" % (names or "nothing"))
        if re.search(r"\b(sum|avg|min|max|count)\b", arg) and not \
                re.search(r"\bby\s*\([^)]*\ble\b", arg):
            problems.append("histogram_quantile aggregates without "
                            "'by (..., le)'")
    return problems


BYTES_PER_SECOND_UNITS = ("Bps", "binBps", "decBps")
BYTES_UNITS = ("bytes", "decbytes")


def expected_units(expr, types):
    """The Grafana units an expression's base unit allows, or None when the
    lint cannot tell (dimensionless ratios, counts, CPU cores)."""
    names = [m.group(1) for m in METRIC_RE.finditer(expr)]
    if not names:
        return None
    bases = {base_metric(n) for n in names}
    if "histogram_quantile" in expr or (
            "/" in expr and len(bases) == 1 and
            {n[len(next(iter(bases))):] for n in names} == {"_sum",
                                                           "_count"}):
        base = next(iter(bases))
        return ("s",) if base.endswith("_seconds") else None
    if "/" in expr or len(bases) != 1:
        return None
    base = next(iter(bases))
    if base.endswith("_bytes_total") and re.search(r"\b(i?rate)\s*\(",
                                                   expr):
        return BYTES_PER_SECOND_UNITS
    if types.get(base) == "gauge" and base.endswith("_seconds"):
        return ("s",)
    if types.get(base) == "gauge" and base.endswith("_bytes"):
        return BYTES_UNITS
    return None


def lint_dashboard(d, documented):
    """Problems of one dashboard (a list of strings; empty = clean)."""
    problems = []
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", str(d.get("uid", ""))):
        problems.append("dashboard uid must be a fixed id, got %r"
                        % d.get("uid"))
    if not d.get("title"):
        problems.append("dashboard has no title")
    variables = {v.get("name"): v
                 for v in d.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if ds is None or ds.get("type") != "datasource" or \
            ds.get("query") != "prometheus":
        problems.append("no datasource variable of type datasource for "
                        "prometheus")
    for name in ("job", "instance"):
        v = variables.get(name)
        if v is None:
            problems.append("no %s variable" % name)
            continue
        if (v.get("datasource") or {}).get("uid") not in DATASOURCE_UIDS:
            problems.append("variable %s does not use ${datasource}" % name)
    ids = set()
    for p in panels_of(d):
        where = "panel %r" % p.get("title", p.get("id"))
        if p.get("id") in ids:
            problems.append("%s: duplicate id %s" % (where, p.get("id")))
        ids.add(p.get("id"))
        if not p.get("title"):
            problems.append("%s: no title" % where)
        if not p.get("description"):
            problems.append("%s: no description" % where)
        if (p.get("datasource") or {}).get("uid") not in DATASOURCE_UIDS:
            problems.append("%s: datasource is not ${datasource}" % where)
        if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            problems.append("%s: no unit" % where)
        targets = p.get("targets") or []
        if not targets:
            problems.append("%s: no queries" % where)
        for t in targets:
            if (t.get("datasource") or {}).get("uid") not in DATASOURCE_UIDS:
                problems.append("%s query %s: datasource is not ${datasource}"
                                % (where, t.get("refId")))
            expr = t.get("expr", "")
            if not expr:
                problems.append("%s query %s: empty" % (where, t.get("refId")))
            problems += ["%s query %s: %s" % (where, t.get("refId"), e)
                         for e in lint_expr(expr, documented)]
            if documented is not None:
                problems += ["%s query %s: %s" % (where, t.get("refId"), e)
                             for e in lint_semantics(expr, documented)]
                units = expected_units(expr, documented)
                unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
                if units is not None and unit and unit not in units:
                    problems.append(
                        "%s query %s: unit %r does not match the query's "
                        "base unit (one of %s)" % (where, t.get("refId"), unit,
                                                   ", ".join(units)))
    return problems


def documented_metrics():
    """Metric name -> type (counter, gauge, histogram) from docs/metrics.md."""
    with open(METRICS_DOC) as f:
        return dict(re.findall(r"^\| `([a-z_:]+)` \| (\w+) \|", f.read(),
                               re.M))


def substitute(expr):
    return (expr.replace("$__rate_interval", RATE_INTERVAL)
            .replace("$job", ALL_VALUE).replace("$instance", ALL_VALUE))


class DashboardLintTest(unittest.TestCase):
    def test_there_are_dashboards(self):
        self.assertTrue(DASHBOARDS, "no dashboards/*.json")

    def test_dashboards_pass_the_lint(self):
        documented = documented_metrics()
        self.assertGreater(len(documented), 20, "docs/metrics.md tables?")
        for path in DASHBOARDS:
            with open(path) as f:
                d = json.load(f)
            problems = lint_dashboard(d, documented)
            self.assertEqual(problems, [], "%s:\n  %s" % (
                path, "\n  ".join(problems)))

    def test_the_lint_finds_each_kind_of_problem(self):
        bad = {
            "uid": "",
            "templating": {"list": []},
            "panels": [
                {"id": 1, "title": "", "type": "timeseries",
                 "datasource": {"uid": "prom"},
                 "fieldConfig": {"defaults": {}},
                 "targets": [{"refId": "A", "datasource": {"uid": "prom"},
                              "expr": "rate(gtopk_worker_sent_bytes_total[5m])"
                              " + gtopk_unknown_total{job=~\"$job\","
                              "instance=~\"$instance\"}"}]},
            ]}
        problems = "\n".join(lint_dashboard(bad, documented_metrics()))
        for expected in ("uid must be a fixed id", "no datasource variable",
                         "no job variable", "no instance variable",
                         ": no title", "no description",
                         "datasource is not ${datasource}", "no unit",
                         "gtopk_worker_sent_bytes_total has no job",
                         "has no instance", "must use [$__rate_interval]",
                         "gtopk_unknown_total is not documented"):
            self.assertIn(expected, problems)

    def test_the_lint_catches_wrong_queries_and_units(self):
        # Each mutation of the real dashboard makes a panel show something
        # meaningless while every query still returns series (so the
        # Prometheus evaluation in ClusterMetricsTest cannot catch it).
        documented = documented_metrics()
        with open(os.path.join(ROOT, "dashboards", "gtopk.json")) as f:
            original = json.load(f)
        self.assertEqual(lint_dashboard(original, documented), [])
        m = '{job=~"$job",instance=~"$instance"}'
        r = "[$__rate_interval]"
        mutations = [
            ("Training loss", None, "rate(gtopk_worker_loss%s%s)" % (m, r),
             "rate() of gauge gtopk_worker_loss"),
            ("Resident memory", None,
             "increase(process_resident_memory_bytes%s%s)" % (m, r),
             "rate() of gauge process_resident_memory_bytes"),
            ("Bytes/s sent per worker", None,
             "sum by (instance) (gtopk_worker_sent_bytes_total%s)" % m,
             "gtopk_worker_sent_bytes_total is cumulative"),
            ("Step latency p50 / p99", None,
             "histogram_quantile(0.99, sum by (instance) (rate("
             "gtopk_worker_step_duration_seconds_bucket%s%s)))" % (m, r),
             "without 'by (..., le)'"),
            ("Step latency p50 / p99", None,
             "histogram_quantile(0.99, sum by (le) (rate("
             "gtopk_worker_step_duration_seconds_sum%s%s)))" % (m, r),
             "needs _bucket series"),
            ("Step latency p50 / p99", None,
             "histogram_quantile(0.99, sum by (le) ("
             "gtopk_worker_step_duration_seconds_bucket%s))" % m,
             "_bucket is cumulative"),
            ("CPU", None, "rate(process_cpu_seconds_total%s%s" % (m, r),
             "unbalanced ()"),
            ("Step latency p50 / p99", "ms", None, "unit 'ms'"),
            ("Wait for pulls per worker", "percent", None, "unit 'percent'"),
            ("Bytes/s sent per worker", "bytes", None, "unit 'bytes'"),
            ("Resident memory", "Bps", None, "unit 'Bps'"),
        ]
        for title, unit, expr, expected in mutations:
            d = json.loads(json.dumps(original))
            panel = [p for p in panels_of(d) if p["title"] == title][0]
            if unit is not None:
                panel["fieldConfig"]["defaults"]["unit"] = unit
            if expr is not None:
                panel["targets"][0]["expr"] = expr
            problems = "\n".join(lint_dashboard(d, documented))
            self.assertIn(expected, problems, (title, unit, expr))

    def test_provisioning_points_at_the_dashboards_datasource(self):
        with open(os.path.join(PROVISIONING, "datasources",
                               "prometheus.yml")) as f:
            ds = f.read()
        uid = re.search(r"^\s*uid:\s*(\S+)", ds, re.M)
        self.assertIsNotNone(uid, "datasource provisioning has no uid")
        self.assertRegex(ds, r"(?m)^\s*type:\s*prometheus\s*$")
        self.assertRegex(ds, r"(?m)^\s*url:\s*http://prometheus:9090\s*$")
        self.assertRegex(ds, r"(?m)^apiVersion:\s*1\s*$")
        for path in DASHBOARDS:
            with open(path) as f:
                d = json.load(f)
            ds_var = [v for v in d["templating"]["list"]
                      if v["name"] == "datasource"][0]
            self.assertEqual(ds_var["current"]["value"], uid.group(1), path)
        with open(os.path.join(PROVISIONING, "dashboards", "gtopk.yml")) as f:
            provider = f.read()
        self.assertRegex(provider, r"(?m)^apiVersion:\s*1\s*$")
        self.assertRegex(provider, r"(?m)^\s*type:\s*file\s*$")
        self.assertRegex(provider, r"(?m)^\s*path:\s*/var/lib/grafana/"
                         r"dashboards/gtopk\s*$")


def missing_tools():
    missing = [t for t in ("prometheus", "promtool") if not shutil.which(t)]
    if not os.access(WORKER_BIN, os.X_OK):
        missing.append("gtopk-worker (%s; needs libtorch-dev)" % WORKER_BIN)
    if not os.access(SERVER_BIN, os.X_OK):
        missing.append("gtopk-server (%s)" % SERVER_BIN)
    return missing


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def prom_query(base, expr):
    url = "%s/api/v1/query?%s" % (base, urllib.parse.urlencode(
        {"query": expr}))
    try:
        return json.loads(http_get(url, timeout=10))
    except urllib.error.HTTPError as e:  # 400 for a bad query
        return json.loads(e.read().decode("utf-8"))


@unittest.skipIf(missing_tools() and not IN_CI,
                 "missing: %s" % ", ".join(missing_tools()))
class ClusterMetricsTest(unittest.TestCase):
    def setUp(self):
        missing = missing_tools()
        if missing:
            self.fail("CI is set but these are missing: %s"
                      % ", ".join(missing))
        self.tmp = tempfile.TemporaryDirectory(prefix="gtopk-obs-test-")
        self.addCleanup(self.tmp.cleanup)

    def wait_for(self, what, predicate, timeout, launcher):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if launcher.poll() is not None:
                self.fail("the launcher exited (%s) while waiting for %s:\n%s"
                          % (launcher.returncode, what, self.log()))
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        self.fail("timed out after %d s waiting for %s:\n%s"
                  % (timeout, what, self.log()))

    def log(self):
        try:
            with open(self.log_path) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def test_real_metrics_pass_promtool_and_every_panel_has_data(self):
        name = "obs"
        run_dir = os.path.join(self.tmp.name, name)
        self.log_path = os.path.join(self.tmp.name, "launcher.log")
        argv = [sys.executable, LAUNCHER, "--name", name,
                "--runs-dir", self.tmp.name, "--build-dir", BUILD_DIR,
                "--workers", "2", "--shards", "2", "--model", "cnn",
                "--train-limit", "640", "--test-limit", "200",
                "--batch-size", "32", "--epochs", "1000", "--eval-every", "5",
                "--density", "0.01", "--step-timeout", "30s",
                "--prometheus", "on", "--scrape-interval", "1s",
                "--grace", "10"]
        with open(self.log_path, "w") as log:
            launcher = subprocess.Popen(argv, stdout=log, stderr=log,
                                        stdin=subprocess.DEVNULL)

        def stop():
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
                try:
                    launcher.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    launcher.kill()
                    launcher.wait()
        self.addCleanup(stop)

        def pids():
            try:
                with open(os.path.join(run_dir, "pids.json")) as f:
                    p = json.load(f)
            except (OSError, ValueError):
                return None
            return p if p.get("prometheus_url") else None
        info = self.wait_for("Prometheus to start (pids.json)", pids, 90,
                             launcher)
        base = info["prometheus_url"]
        endpoints = ([("server", a) for a in info["server_metrics"]] +
                     [("worker", a) for a in info["worker_metrics"]])
        self.assertEqual(len(endpoints), 4)

        def all_up():
            try:
                t = json.loads(http_get(base + "/api/v1/targets"))
            except (OSError, ValueError):
                return False
            active = t["data"]["activeTargets"]
            return len(active) == 4 and all(a["health"] == "up"
                                            for a in active)
        self.wait_for("every target up in Prometheus", all_up, 90, launcher)

        # Data for every panel: steps done everywhere, an evaluation (test
        # accuracy), and enough scrapes for rates over RATE_INTERVAL.
        def has_series(expr):
            r = prom_query(base, expr)
            return r.get("status") == "success" and r["data"]["result"]
        self.wait_for("steps on every worker and server", lambda: all(
            len(has_series(q) or []) == 2 for q in
            ("gtopk_worker_step > 10", "gtopk_server_step > 10")), 120,
            launcher)
        self.wait_for("a test accuracy", lambda: has_series(
            "gtopk_worker_test_accuracy"), 60, launcher)
        time.sleep(3)

        # promtool on every process's real /metrics.
        for kind, address in endpoints:
            text = http_get("http://%s/metrics" % address)
            r = subprocess.run(["promtool", "check", "metrics"],
                               input=text.encode(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=30)
            self.assertEqual(r.returncode, 0, "promtool on %s %s:\n%s" % (
                kind, address, r.stdout.decode()))
            for family in ("gtopk_build_info", "process_cpu_seconds_total",
                           "process_resident_memory_bytes",
                           "gtopk_%s_" % kind):
                self.assertIn(family, text, "%s %s" % (kind, address))

        # The variables' queries, then every panel query.
        jobs = has_series("group by (job) (gtopk_build_info)")
        self.assertEqual(sorted(s["metric"]["job"] for s in jobs),
                         ["gtopk-server", "gtopk-worker"])
        failures = []
        count = 0
        for path in DASHBOARDS:
            with open(path) as f:
                d = json.load(f)
            for p in panels_of(d):
                for t in p.get("targets", []):
                    count += 1
                    expr = substitute(t["expr"])
                    r = prom_query(base, expr)
                    if r.get("status") != "success":
                        failures.append("%s / %s: error %s: %s" % (
                            p["title"], t["refId"], r.get("errorType"),
                            r.get("error")))
                    elif not r["data"]["result"]:
                        failures.append("%s / %s: no series for %s" % (
                            p["title"], t["refId"], expr))
        self.assertGreater(count, 20)
        self.assertEqual(failures, [], "\n".join(failures))

        # Ctrl-C stops everything, Prometheus included.
        prometheus_pid = info["prometheus"]
        launcher.send_signal(signal.SIGINT)
        self.assertEqual(launcher.wait(timeout=60), 130, self.log())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(
                "/proc/%d" % prometheus_pid):
            with open("/proc/%d/stat" % prometheus_pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.2)
        self.assertFalse(
            os.path.exists("/proc/%d/cmdline" % prometheus_pid) and
            open("/proc/%d/stat" % prometheus_pid).read()
            .rsplit(")", 1)[1].split()[0] != "Z",
            "prometheus (pid %d) outlived the launcher" % prometheus_pid)
        self.assertTrue(os.path.isdir(os.path.join(run_dir, "prometheus")))


if __name__ == "__main__":
    unittest.main()
