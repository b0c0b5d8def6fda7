#!/usr/bin/env python3
"""The docker-compose cluster, run for real (issue 21).

Builds the gtopk-server and gtopk-worker images from deploy/docker/Dockerfile
(unchanged) and runs deploy/docker-compose.yml with the test-only override
tests/deploy/compose/docker-compose.test.yml (host networking, every service
on its own 127.0.0.1 port), then checks, against the running containers:

  small form (--form=small): shard-0 + worker-0 (S = 1, P = 1);
  full form  (--form=full):  shard-0..1 + worker-0..3 (S = 2, P = 4).

  * mutual TLS on every hop, the compose file's default: the set-up step
    makes the certificates with deploy/tls/compose-certs.sh (what a user
    runs before `docker compose up`) into the work directory, and the
    services mount them from there (GTOPK_COMPOSE_TLS_DIR);
  * every shard reports healthy through the HEALTHCHECK (gtopk-server
    --health-check presenting the shard's certificate, grpc.health.v1);
  * the workers train --model=synthetic:N for --steps steps and exit 0, and
    all summaries' param_checksum and server_checksum are equal;
  * the images run as the non-root user 10001:10001 and their binaries'
    libraries resolve (deploy/docker/ldd-check.sh inside the image);
  * full form: shard-1's process is SIGKILLed while the workers train and
    `restart: on-failure` brings it back healthy from its checkpoint volume;
    every worker pushed steps before and after the kill, at least one logged
    the recovery, and all still end with equal checksums;
  * `docker-compose down -v` leaves no container, network or volume of the
    project behind.

Engine preparation (what a fresh Debian 12 machine needs): docker.io and
debootstrap are apt-installed when missing; dockerd is started when not
running and stopped at the end if this test started it; debian:bookworm
(and debian:bookworm-slim, the same image tagged twice) is made with
`debootstrap --variant=minbase bookworm` + `docker import` when missing.
Builds use the legacy builder (no registry for BuildKit's dockerfile
frontend) with --network=host; --cpuset-cpus limits the build's cores.

Run as root:  make compose-test  (or python3 tests/deploy/compose/compose_test.py --form=small)
Prints one `time <step> <seconds>` line per step. Exit status: 0 every check
passed (last line `PASS compose_test <form>`), 1 a check failed (a `FAIL:`
line says which), 2 bad arguments, 3 no container engine can run on this
machine (dockerd exits at start or never answers; a `NO ENGINE:` line with
its log), which .ci/run reports and does not count as a failure.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEPLOY = os.path.join(ROOT, "deploy")
OVERRIDE = os.path.join(ROOT, "tests", "deploy", "compose", "docker-compose.test.yml")
PROJECT = "gtopkct"
SERVER_IMAGE = "gtopk-server:0.1.0"
WORKER_IMAGE = "gtopk-worker:0.1.0"
USER = "10001:10001"
# deploy/docker-compose.yml names this image; no registry here, so the full
# form builds a stand-in from Debian's prometheus package (the same 2.42.0).
PROMETHEUS_IMAGE = "prom/prometheus:v2.42.0"


def log(msg):
    print(msg, flush=True)


def run(cmd, check=True, capture=False, env=None, cwd=None):
    log("+ " + " ".join(cmd))
    r = subprocess.run(cmd, check=False, text=True, env=env, cwd=cwd,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.STDOUT if capture else None)
    if check and r.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {r.returncode}"
                         + (f":\n{r.stdout}" if capture else ""))
    return r


class Timer:
    def __init__(self):
        self.times = []

    def step(self, name, fn, *args):
        t0 = time.monotonic()
        result = fn(*args)
        dt = time.monotonic() - t0
        self.times.append((name, dt))
        log(f"time {name} {dt:.1f}")
        return result


def docker_ok():
    return subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def install_packages():
    missing = [p for p, c in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"),
                              ("docker-compose", "docker-compose"))
               if shutil.which(c) is None]
    if missing:
        run(["apt-get", "install", "-y", "--no-install-recommends"] + missing)


# Exit status when this machine cannot run a container engine at all (dockerd
# exits at start, e.g. no overlay/cgroup support in an unprivileged
# container): says nothing about gtopk, so .ci/run reports it, not fails.
NO_ENGINE = 3


def start_dockerd(logdir):
    """Starts dockerd when `docker info` fails; returns the Popen or None.

    Exits NO_ENGINE (3) with dockerd's last log lines when dockerd cannot
    start here; waits at most 60 s for it to answer."""
    if docker_ok():
        return None
    path = os.path.join(logdir, "dockerd.log")
    logf = open(path, "w")
    proc = subprocess.Popen(["dockerd"], stdout=logf, stderr=subprocess.STDOUT)
    for _ in range(120):
        if docker_ok():
            return proc
        if proc.poll() is not None:
            logf.close()
            with open(path) as f:
                tail = "".join(f.readlines()[-5:])
            log(f"NO ENGINE: dockerd exited {proc.returncode} at start; its last lines:\n{tail}")
            sys.exit(NO_ENGINE)
        time.sleep(0.5)
    proc.kill()
    proc.wait(timeout=30)
    log("NO ENGINE: dockerd did not answer `docker info` within 60 s")
    sys.exit(NO_ENGINE)


def image_exists(ref):
    return subprocess.run(["docker", "image", "inspect", ref], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def import_base_image(workdir):
    if image_exists("debian:bookworm"):
        if not image_exists("debian:bookworm-slim"):
            run(["docker", "tag", "debian:bookworm", "debian:bookworm-slim"])
        return
    rootfs = os.path.join(workdir, "rootfs")
    run(["debootstrap", "--variant=minbase", "bookworm", rootfs])
    tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", "debian:bookworm"], stdin=tar.stdout, check=True)
    tar.wait()
    shutil.rmtree(rootfs)
    # The Dockerfile's runtime stages start from bookworm-slim; minbase is
    # about as small, so the same import serves as both.
    run(["docker", "tag", "debian:bookworm", "debian:bookworm-slim"])


def build_image(target, tag, cpuset):
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    cmd = ["docker", "build", "--network=host", "-f", "deploy/docker/Dockerfile",
           "--target", target, "-t", tag]
    if cpuset:
        cmd += ["--cpuset-cpus", cpuset]
    run(cmd + ["."], env=env, cwd=ROOT)


def build_prometheus(cpuset):
    if image_exists(PROMETHEUS_IMAGE):
        return
    cmd = ["docker", "build", "--network=host", "-f",
           os.path.join(ROOT, "tests", "deploy", "compose", "Dockerfile.prometheus"),
           "-t", PROMETHEUS_IMAGE]
    if cpuset:
        cmd += ["--cpuset-cpus", cpuset]
    run(cmd + [os.path.join(ROOT, "tests", "deploy", "compose")],
        env=dict(os.environ, DOCKER_BUILDKIT="0"))


def write_prometheus_config(env, shards, workers, path):
    """deploy/prometheus/compose.yml's jobs with the 127.0.0.1 ports."""
    lines = ["global:", "  scrape_interval: 2s", "scrape_configs:",
             "  - job_name: gtopk-server", "    static_configs:"]
    for s in range(shards):
        lines += [f"      - targets: ['127.0.0.1:{env[f'CT_S{s}_METRICS']}']",
                  f"        labels: {{shard: '{s}'}}"]
    lines += ["  - job_name: gtopk-worker", "    static_configs:"]
    for w in range(workers):
        lines += [f"      - targets: ['127.0.0.1:{env[f'CT_W{w}_METRICS']}']",
                  f"        labels: {{rank: '{w}'}}"]
    lines += ["  - job_name: prometheus", "    static_configs:",
              f"      - targets: ['127.0.0.1:{env['CT_PROMETHEUS']}']"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o644)


def prometheus_get(env, path):
    import urllib.request
    url = f"http://127.0.0.1:{env['CT_PROMETHEUS']}{path}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def wait_targets_up(env, want, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            targets = prometheus_get(env, "/api/v1/targets")["data"]["activeTargets"]
            up = [t for t in targets if t["health"] == "up"]
            if len(up) == want:
                return
        except OSError as e:
            targets = str(e)
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: Prometheus targets not all up: {targets}")
        time.sleep(1)


def image_size_mb(ref):
    out = run(["docker", "image", "inspect", "-f", "{{.Size}}", ref], capture=True).stdout
    return int(out.strip()) / 1e6


def check_image(ref, binary):
    user = run(["docker", "image", "inspect", "-f", "{{.Config.User}}", ref],
               capture=True).stdout.strip()
    if user != USER:
        raise SystemExit(f"FAIL: {ref} runs as {user!r}, want {USER}")
    uid = run(["docker", "run", "--rm", "--network=none", "--entrypoint", "id", ref, "-u"],
              capture=True).stdout.strip()
    if uid != "10001":
        raise SystemExit(f"FAIL: {ref}: id -u is {uid!r}")
    # ldd-check.sh from the source tree, mounted read-only (it is not in the image).
    run(["docker", "run", "--rm", "--network=none", "-v",
         os.path.join(DEPLOY, "docker", "ldd-check.sh") + ":/ldd-check.sh:ro",
         "--entrypoint", "sh", ref, "/ldd-check.sh", binary])
    log(f"image {ref} {image_size_mb(ref):.0f} MB user {user} ldd ok")


def compose_env(args, shards, workers):
    base = args.port_base
    env = dict(os.environ)
    env.update({
        "GTOPK_SHARDS": str(shards), "GTOPK_WORKERS": str(workers),
        "GTOPK_MODEL": f"synthetic:{args.n}",
        "CT_STEPS": str(args.steps), "CT_COMPUTE_MS": str(args.compute_ms),
    })
    for s in range(2):
        env[f"CT_S{s}_GRPC"] = str(base + s)
        env[f"CT_S{s}_METRICS"] = str(base + 10 + s)
    for w in range(4):
        env[f"CT_W{w}_METRICS"] = str(base + 20 + w)
    env["CT_PEERS"] = ",".join(f"127.0.0.1:{base + s}" for s in range(shards))
    env["CT_PROMETHEUS"] = str(base + 30)
    return env


def make_certs(env, workdir):
    """The compose set-up step (docs/security.md, "Compose"): the mTLS
    certificates, each service's own in its directory, keys given to the
    containers' uid 10001 (this test runs as root)."""
    out = os.path.join(workdir, "tls")
    run([os.path.join(DEPLOY, "tls", "compose-certs.sh"), out], env=env)
    env["GTOPK_COMPOSE_TLS_DIR"] = out


def render(env, path):
    """The merged base + override, without `ports` on host-network services.

    Debian's docker-compose (1.29, docker-py) refuses `ports` with
    network_mode: host ("host" network_mode is incompatible with
    port_bindings), and a v1 override cannot remove a list the base file sets
    (v2's `!reset` can), so the test runs the rendered file."""
    import yaml
    out = run(["docker-compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", OVERRIDE,
               "config"], capture=True, env=env, cwd=DEPLOY).stdout
    cfg = yaml.safe_load(out)
    for svc in cfg["services"].values():
        if svc.get("network_mode") == "host":
            svc.pop("ports", None)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    env["CT_RENDERED"] = path


def compose(env, *cmd, check=True, capture=False):
    return run(["docker-compose", "-p", PROJECT, "-f", env["CT_RENDERED"]]
               + list(cmd), check=check, capture=capture, env=env, cwd=DEPLOY)


def container_id(env, service):
    return compose(env, "ps", "-q", service, capture=True).stdout.strip()


def inspect(cid, fmt):
    return run(["docker", "inspect", "-f", fmt, cid], capture=True).stdout.strip()


def wait_healthy(env, services, timeout_s):
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for s in list(pending):
            cid = container_id(env, s)
            if cid and inspect(cid, "{{.State.Health.Status}}") == "healthy":
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"FAIL: not healthy within {timeout_s} s: {pending}")
        if pending:
            time.sleep(1)


def wait_exited(env, services, timeout_s):
    deadline = time.monotonic() + timeout_s
    codes = {}
    while len(codes) < len(services):
        for s in services:
            if s in codes:
                continue
            cid = container_id(env, s)
            if cid and inspect(cid, "{{.State.Status}}") == "exited":
                codes[s] = int(inspect(cid, "{{.State.ExitCode}}"))
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: still running after {timeout_s} s: "
                             f"{[s for s in services if s not in codes]}")
        time.sleep(1)
    return codes


def worker_step(env, w):
    """gtopk_worker_step (steps applied so far) from worker w's metrics
    endpoint on 127.0.0.1, or None when it does not answer."""
    import urllib.request
    try:
        url = f"http://127.0.0.1:{env[f'CT_W{w}_METRICS']}/metrics"
        with urllib.request.urlopen(url, timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("gtopk_worker_step "):
                    return int(float(line.split()[1]))
    except OSError:
        return None
    return None


def kill_and_recover(env, service, at_step, steps, workers):
    """Waits (at most 120 s) until every worker has applied at_step steps,
    so the kill lands in training whatever the machine's load, then SIGKILLs
    the shard's process from the host (a crash: `docker kill` counts as a
    manual stop, which no restart policy undoes) and waits for `restart:
    on-failure` to bring it back healthy. Returns the kill's Unix time (the
    containers share the host's clock), for check_mid_training."""
    # Looked up first: docker-compose and docker inspect take seconds each on
    # a loaded machine, long enough for the workers to finish.
    cid = container_id(env, service)
    pid = inspect(cid, "{{.State.Pid}}")
    restarts = int(inspect(cid, "{{.RestartCount}}"))
    deadline = time.monotonic() + 120
    while True:
        at = {w: worker_step(env, i) for i, w in enumerate(workers)}
        if all(v is not None and v >= at_step for v in at.values()):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: workers not at step {at_step} within 120 s: {at}")
        time.sleep(0.2)
    # Every worker's metrics endpoint answered with a step below the last:
    # all are training now.
    if any(v >= steps for v in at.values()):
        raise SystemExit(f"FAIL: workers not all training at the kill: steps {at} of {steps}")
    log(f"kill -9 {service} with the workers at steps {at} of {steps}")
    kill_unix = time.time()
    run(["kill", "-9", pid])
    deadline = time.monotonic() + 90
    while True:
        if (int(inspect(cid, "{{.RestartCount}}")) > restarts
                and inspect(cid, "{{.State.Health.Status}}") == "healthy"):
            return kill_unix
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: {service} not restarted and healthy 90 s after kill -9")
        time.sleep(1)


def check_mid_training(env, service, workers, sums, kill_unix):
    """The kill landed inside training, shown by the processes themselves,
    not by the test's timing: every worker has steps that pushed before the
    kill and steps that pushed after it (its summary's per-step
    push_start_unix), at least one worker logged a failed step it recovered
    from (worker/trainer/recovery.cc), and the restarted shard restored its
    checkpoint from the volume (server/main.cc's start line)."""
    for s in sums:
        starts = s["per_step"]["push_start_unix"]
        before = sum(1 for t in starts if t < kill_unix)
        after = sum(1 for t in starts if t > kill_unix)
        if before == 0 or after == 0:
            raise SystemExit(f"FAIL: rank {s['rank']}: {before} steps before the kill, "
                             f"{after} after: the kill did not land mid-training")
        log(f"rank {s['rank']}: {before} steps pushed before the kill, {after} after")
    recovered = []
    for w in workers:
        out = run(["docker", "logs", container_id(env, w)], capture=True).stdout
        if "failed" in out and "recovering" in out:
            recovered.append(w)
            line = next(l for l in out.splitlines() if "recovering" in l)
            log(f"{w}: {line.strip()}")
    if not recovered:
        raise SystemExit("FAIL: no worker logged a recovery after the shard was killed")
    out = run(["docker", "logs", container_id(env, service)], capture=True).stdout
    restored = [l for l in out.splitlines() if l.startswith("restored checkpoint from ")]
    if not restored:
        raise SystemExit(f"FAIL: restarted {service} did not restore a checkpoint:\n{out}")
    log(f"{service}: {restored[-1]}")


def read_summaries(env, workers, workdir):
    sums = []
    cid = container_id(env, "worker-0")
    for w in range(workers):
        dst = os.path.join(workdir, f"worker-{w}.json")
        run(["docker", "cp", f"{cid}:/var/lib/gtopk/run/worker-{w}.json", dst])
        with open(dst) as f:
            sums.append(json.load(f))
    return sums


def leftovers():
    out = []
    for kind in ("container", "network", "volume"):
        cmd = ["docker", kind, "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]
        if kind == "container":
            cmd = ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]
        ids = run(cmd, capture=True).stdout.split()
        out += [f"{kind} {i}" for i in ids]
    return out


def run_cluster(args, timer, workdir):
    shards, workers = (1, 1) if args.form == "small" else (2, 4)
    env = compose_env(args, shards, workers)
    shard_svcs = [f"shard-{s}" for s in range(shards)]
    worker_svcs = [f"worker-{w}" for w in range(workers)]
    env["CT_PROMETHEUS_CONFIG"] = os.path.join(workdir, "prometheus.yml")
    write_prometheus_config(env, shards, workers, env["CT_PROMETHEUS_CONFIG"])
    timer.step("certs", make_certs, env, workdir)
    render(env, os.path.join(workdir, "compose.rendered.yml"))
    compose(env, "down", "-v", "--remove-orphans", check=False)
    try:
        timer.step("compose-up-shards", compose, env, "up", "-d", "--no-build", "--no-deps",
                   *shard_svcs)
        timer.step("shards-healthy", wait_healthy, env, shard_svcs, 120)
        if args.form == "full":
            compose(env, "up", "-d", "--no-build", "--no-deps", "prometheus")
        timer.step("compose-up-workers", compose, env, "up", "-d", "--no-build", "--no-deps",
                   *worker_svcs)
        if args.form == "full":
            # While the workers train: every shard, worker and Prometheus itself.
            timer.step("targets-up", wait_targets_up, env, shards + workers + 1, 60)
            q = prometheus_get(env, "/api/v1/query?query=gtopk_build_info")
            if not q["data"]["result"]:
                raise SystemExit(f"FAIL: query gtopk_build_info returned no series: {q}")
        kill_unix = None
        if args.form == "full" and args.kill_at_step > 0:
            kill_unix = timer.step("kill-shard-recover", kill_and_recover, env, "shard-1",
                                   args.kill_at_step, args.steps, worker_svcs)
        codes = timer.step("train", wait_exited, env, worker_svcs, args.train_timeout)
        if any(codes.values()):
            compose(env, "logs", "--tail=30", check=False)
            raise SystemExit(f"FAIL: worker exit codes {codes}")
        sums = read_summaries(env, workers, workdir)
        pc = {s["param_checksum"] for s in sums}
        sc = {s["server_checksum"] for s in sums}
        if len(pc) != 1 or pc != sc:
            raise SystemExit(f"FAIL: checksums differ: param {pc} server {sc}")
        log(f"workers exit 0, {len(sums)} summaries, checksum {pc.pop()}")
        if kill_unix is not None:
            check_mid_training(env, "shard-1", worker_svcs, sums, kill_unix)
    except SystemExit:
        # What the containers said, before down removes them.
        compose(env, "logs", "--tail=25", check=False)
        raise
    finally:
        timer.step("compose-down", compose, env, "down", "-v", "--remove-orphans")
    left = leftovers()
    if left:
        raise SystemExit(f"FAIL: left behind after down: {left}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--form", choices=("small", "full"), default="small")
    p.add_argument("--cpuset", default=os.environ.get("GTOPK_COMPOSE_CPUSET", ""),
                   help="docker build --cpuset-cpus (e.g. 1); empty: all cores")
    p.add_argument("--no-build", action="store_true", help="use the existing images")
    p.add_argument("--port-base", type=int, default=25050,
                   help="127.0.0.1 ports: shards base+s, shard metrics base+10+s, "
                        "worker metrics base+20+w, Prometheus base+30")
    p.add_argument("--n", type=int, default=100000, help="synthetic:N gradient size")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per worker; default 200 (small), 600 (full: the workers "
                        "must outlast the Prometheus checks and the kill on a loaded machine)")
    p.add_argument("--compute-ms", type=int, default=50,
                   help="synthetic compute per step: keeps the run long enough to scrape")
    p.add_argument("--kill-at-step", type=int, default=20,
                   help="full form: kill -9 shard-1 once every worker has applied this many "
                        "steps; 0: no kill")
    p.add_argument("--train-timeout", type=int, default=300)
    args = p.parse_args()
    if args.steps is None:
        args.steps = 600 if args.form == "full" else 200
    if args.form == "full" and args.kill_at_step >= args.steps:
        p.error(f"--kill-at-step={args.kill_at_step} must be below --steps={args.steps}")
    if os.geteuid() != 0:
        raise SystemExit("compose_test: run as root (dockerd, apt-get)")

    timer = Timer()
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="gtopk-compose-")
    dockerd = None
    try:
        timer.step("install", install_packages)
        dockerd = timer.step("dockerd", start_dockerd, workdir)
        timer.step("base-image", import_base_image, workdir)
        if not args.no_build:
            timer.step("build-server", build_image, "server", SERVER_IMAGE, args.cpuset)
            timer.step("build-worker", build_image, "worker", WORKER_IMAGE, args.cpuset)
        if args.form == "full":
            timer.step("build-prometheus", build_prometheus, args.cpuset)
        check_image(SERVER_IMAGE, "/usr/local/bin/gtopk-server")
        check_image(WORKER_IMAGE, "/usr/local/bin/gtopk-worker")
        run_cluster(args, timer, workdir)
    finally:
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"time total {time.monotonic() - t0:.1f}")
    log("PASS compose_test " + args.form)


if __name__ == "__main__":
    main()
