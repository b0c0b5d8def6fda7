"""The child process of interrupt_test.py: makes one blocking gtopk call
and reports, as one JSON line on stdout, how a SIGINT ended it.

    interrupt_child.py LEADER N CASE [uncaught]
CASE:
  join     Client(LEADER, ...) where nothing listens yet (Join waits up to
           rpc_timeout = 60 s);
  download rank 1 joins a P = 2 cluster whose rank 0 never initialises the
           parameters, and calls synchronize_parameters (waits up to the
           servers' step timeout);
  step     rank 0 joins a P = 2 cluster alone and steps (the peer never
           pushes; the servers' step timeout is long);
  recover  as step, with a short step timeout: the step fails, the child
           prints "step failed" and waits for a line on stdin (the parent
           kills the servers meanwhile), then recover() waits for the
           leader (timeout 60 s).
With "uncaught" the KeyboardInterrupt is not caught: the interpreter
ends as a user's script does on Ctrl-C (the client not closed).
Before the blocking call it prints "blocking <case>" (flushed). On
KeyboardInterrupt it prints {"interrupted": true, "caught_at": <CLOCK_MONOTONIC
seconds>, "elapsed": <seconds in the call>, "threads": <threading.active_count()>,
"os_threads_before"/"os_threads_interrupted": <threads of this process not
named by gRPC, before the call, right after the interrupt>,
"os_threads_settled"/"settle_seconds": <the same once it reached 1, at most
1 s later, and how long that took>, "os_threads_after": <after close()>,
...} and
exits 0; exit 3 when the call returned or raised something else.
"""

import json
import os
import sys
import threading
import time

import numpy as np

import gtopk


def os_threads():
    """Threads of this process that carry the process's own name: the main
    thread and the threads the binding and the client start (a blocking
    call's helper, the per-shard step threads); gRPC names its own
    (default-executor, grpc_global_timer, event_engine, ...), which it
    keeps and ends on its own schedule."""
    def comm(task):
        try:
            with open("/proc/self/task/%s/comm" % task) as f:
                return f.read().strip()
        except OSError:  # ended meanwhile
            return None
    main = comm(str(os.getpid()))
    return sum(1 for t in os.listdir("/proc/self/task") if comm(t) == main)


def settle(limit=1.0):
    """Waits up to `limit` s for os_threads() to reach 1 (a thread that was
    told to stop may take a moment to end); returns (count, seconds)."""
    start = now()
    while True:
        count = os_threads()
        if count == 1 or now() - start > limit:
            return count, now() - start
        time.sleep(0.01)


def now():
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def main():
    leader, n, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    report = {"case": case}
    client = None
    rng = np.random.default_rng(7)
    g = rng.standard_normal(n).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)
    p0 = p.copy()
    if case == "join":
        def call():
            return gtopk.Client(leader, n, rank=0, rpc_timeout=60.0, tls="off")
    else:
        rank = 1 if case == "download" else 0
        client = gtopk.Client(leader, n, rank=rank, rpc_timeout=60.0,
                              tls="off")
        if case == "download":
            def call():
                return client.synchronize_parameters(p)
        else:
            client.synchronize_parameters(p)
            p0 = p.copy()
            if case == "step":
                def call():
                    return client.step(g, p)
            elif case == "recover":
                try:
                    client.step(g, p)
                    report["error"] = "the step succeeded"
                    print(json.dumps(report), flush=True)
                    return 3
                except gtopk.DeadlineExceeded as e:
                    report["step_error"] = str(e)
                print("step failed", flush=True)
                sys.stdin.readline()  # the parent killed the servers
                # The leader is dead: recover() waits for it (the first
                # call too: it used to fail at once with UNAVAILABLE
                # "Socket closed", fixed in WorkerClient::Recover).

                def call():
                    return client.recover(p, timeout=60.0)
            else:
                raise SystemExit("unknown case %r" % case)
    report["os_threads_before"] = os_threads()
    print("blocking %s" % case, flush=True)
    if sys.argv[4:] == ["uncaught"]:
        call()
        return 3
    start = now()
    try:
        result = call()
        report["error"] = "returned %r" % (result,)
        print(json.dumps(report), flush=True)
        return 3
    except KeyboardInterrupt:
        caught = now()
    except BaseException as e:  # noqa: BLE001 - reported
        report["error"] = "raised %s: %s" % (type(e).__name__, e)
        report["elapsed"] = now() - start
        print(json.dumps(report), flush=True)
        return 3
    report.update(interrupted=True, caught_at=caught, elapsed=caught - start,
                  threads=threading.active_count(),
                  os_threads_interrupted=os_threads())
    report["os_threads_settled"], report["settle_seconds"] = settle()
    if client is not None:
        st = client.state()
        lr = np.float32(client.cluster()["lr"])
        report.update(
            next_step=client.next_step, state_step=st["step"],
            residual_sum=float(st["residual"].astype(np.float64).sum()),
            # step: the residual holds lr * g, all of it (nothing applied);
            # the other cases never accumulated anything.
            residual_is_lr_g=bool(np.array_equal(st["residual"], lr * g)),
            residual_is_zero=not bool(np.any(st["residual"])),
            params_unchanged=bool(np.array_equal(p.view(np.uint32),
                                                 p0.view(np.uint32))))
        client.close()
    report["os_threads_after"], _ = settle()
    report["threads_after_close"] = threading.active_count()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
