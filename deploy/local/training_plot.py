"""Training curves as PNG (gnuplot, pngcairo): shared by the local launcher
(`make demo` writes runs/<NAME>/training.png) and the time-to-accuracy
benchmark (bench/tta/tta.py writes bench/results/tta_<rate>.png).

Input is plain data -- no gtopk or torch import -- so both callers pass what
their logs hold. gnuplot comes from Debian's gnuplot-nox (make deps).
Errors: PlotError naming what failed (gnuplot missing, or its message).
"""

import os
import re
import shutil
import subprocess
import tempfile


class PlotError(Exception):
    pass


def human_bytes(b):
    if b is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return "%.2f %s" % (b / scale, unit)
    return "%d B" % b


def _quote(text):
    return str(text).replace("'", "''")


def _run_gnuplot(script):
    if shutil.which("gnuplot") is None:
        raise PlotError("gnuplot not found (Debian package gnuplot-nox; "
                        "make deps installs it)")
    r = subprocess.run(["gnuplot"], input="\n".join(script) + "\n",
                       text=True, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise PlotError("gnuplot failed: " + r.stderr.strip())


def accuracy_plot(path, series, target, title):
    """Test accuracy against training time (left) and against step (right),
    one line per series.

    series: [{"name": str, "points": [(seconds, step, accuracy), ...]}];
    target: a horizontal line at this accuracy (None: none). Writes `path`
    (PNG, 1300x540)."""
    tmp = tempfile.mkdtemp(prefix="gtopk-plot-")
    try:
        files = []
        for i, s in enumerate(series):
            data = os.path.join(tmp, "s%d.dat" % i)
            with open(data, "w") as f:
                for seconds, step, acc in s["points"]:
                    if acc is not None and seconds is not None:
                        f.write("%g %g %g\n" % (seconds, step, acc))
            files.append((s["name"], data))
        # From a little below the lowest accuracy after the first
        # evaluation (the start, near chance, would flatten the rest).
        later = [acc for s in series for _sec, step, acc in s["points"]
                 if acc is not None and step > 0]
        bottom = max(0.0, int((min(later) - 0.05) * 20) / 20) if later \
            else 0.0
        script = ['set terminal pngcairo size 1300,540 font "sans,10" noenhanced',
                  "set output '%s'" % _quote(path),
                  "set multiplot layout 1,2 title '%s'" % _quote(title),
                  "set grid", "set key bottom right",
                  "set yrange [%g:*]" % bottom,
                  "set ylabel 'test accuracy'"]
        if target is not None:
            script.append("set arrow 1 from graph 0, first %g to graph 1, "
                          "first %g nohead dt 2 lc rgb 'gray40'" % (target,
                                                                   target))
        for col, xlabel in ((1, "training time (s, evaluations left out)"),
                            (2, "step")):
            script.append("set xlabel '%s'" % xlabel)
            script.append("plot " + ", ".join(
                "'%s' using %d:3 with linespoints lw 2 pt 7 ps 0.6 "
                "title '%s'" % (_quote(d), col, _quote(n))
                for n, d in files))
        script.append("unset multiplot")
        _run_gnuplot(script)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- make demo: a run's training.png from its rank-0 log -------------------

_STEP = re.compile(r"^step (\d+)/\d+ .*?loss ([-+0-9.eE]+|nan|inf).*?"
                   r"step_ms ([0-9.]+)")
_EVAL = re.compile(r"^eval step (\d+) test_accuracy ([0-9.]+) "
                   r"test_loss ([-+0-9.eE]+|nan|inf)")


def parse_worker_log(path):
    """A worker's stdout (gtopk-worker, train_fashion_mnist.py and
    train_modern.py print the same lines): (steps, evals) with steps =
    [(step, loss, seconds since the start)] -- the sum of step_ms -- and
    evals = [(step, accuracy, loss, seconds)]."""
    steps, evals, clock = [], [], 0.0
    with open(path, errors="replace") as f:
        for line in f:
            m = _STEP.match(line)
            if m:
                clock += float(m.group(3)) / 1e3
                steps.append((int(m.group(1)), float(m.group(2)), clock))
                continue
            m = _EVAL.match(line)
            if m:
                evals.append((int(m.group(1)), float(m.group(2)),
                              float(m.group(3)), clock))
    return steps, evals


def training_plot(path, runs, title):
    """A run's training.png: training loss and test accuracy against step
    (left) and against wall time (middle), and bytes per worker per step
    (right, one bar per run).

    runs: [{"name": str, "log": rank 0's log path,
            "bytes_per_step": float or None}] -- one run, or the gtopk and
    the dense one side by side. Writes `path` (PNG, 1500x500)."""
    tmp = tempfile.mkdtemp(prefix="gtopk-plot-")
    try:
        loss_files, acc_files, bars = [], [], []
        for i, r in enumerate(runs):
            steps, evals = parse_worker_log(r["log"])
            lf = os.path.join(tmp, "loss%d.dat" % i)
            af = os.path.join(tmp, "acc%d.dat" % i)
            with open(lf, "w") as f:
                for step, loss, seconds in steps:
                    f.write("%d %g %g\n" % (step, loss, seconds))
            with open(af, "w") as f:
                for step, acc, _loss, seconds in evals:
                    f.write("%d %g %g\n" % (step, acc, seconds))
            loss_files.append((r["name"], lf, bool(steps)))
            acc_files.append((r["name"], af, bool(evals)))
            bars.append((r["name"], r.get("bytes_per_step")))
        bar_file = os.path.join(tmp, "bars.dat")
        with open(bar_file, "w") as f:
            for i, (name, b) in enumerate(bars):
                f.write("%d \"%s\" %g \"%s\"\n" % (
                    i, name, max(b or 0, 1), human_bytes(b)))
        script = ['set terminal pngcairo size 1500,500 font "sans,10" noenhanced',
                  "set output '%s'" % _quote(path),
                  "set multiplot layout 1,3 title '%s'" % _quote(title),
                  "set grid", "set key top right",
                  "set ylabel 'training loss (rank 0)'",
                  "set y2label 'test accuracy'", "set y2tics", "set ytics nomirror",
                  "set y2range [0:1]"]
        for col, xlabel in ((1, "step"), (3, "wall time (s, sum of steps)")):
            script.append("set xlabel '%s'" % xlabel)
            plots = []
            for (name, lf, has), (_, af, has_acc) in zip(loss_files,
                                                         acc_files):
                if has:
                    plots.append("'%s' using %d:2 with lines lw 1 title "
                                 "'%s loss'" % (_quote(lf), col,
                                                _quote(name)))
                if has_acc:
                    plots.append("'%s' using %d:2 axes x1y2 with "
                                 "linespoints lw 2 pt 7 title '%s test "
                                 "accuracy'" % (_quote(af), col,
                                                _quote(name)))
            script.append("plot " + (", ".join(plots) if plots else
                                     "NaN notitle"))
        script += ["unset y2label", "unset y2tics", "set ytics mirror",
                   "set xlabel ''",
                   "set ylabel 'bytes sent per worker per step (log)'",
                   "set logscale y", "set format y '%.0s%c'",
                   "set style fill solid 0.6", "set boxwidth 0.5",
                   "set yrange [1:*]", "set xrange [-0.7:%g]" % (
                       len(bars) - 0.3),
                   "plot '%s' using 1:3:xtic(2) with boxes notitle, "
                   "'' using 1:3:4 with labels offset 0,1 notitle" %
                   _quote(bar_file),
                   "unset multiplot"]
        _run_gnuplot(script)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
