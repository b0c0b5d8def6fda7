#!/usr/bin/env python3
"""A stand-in for gtopk-worker that follows its output contract (progress
lines on rank 0, --summary-json, exit codes) without training, so the
launcher's process handling is tested even where libtorch is missing.

Behaviour from the environment:
  FAKE_STEPS      steps to run (default: --steps or 20)
  FAKE_STEP_S     seconds per step (default 0.02)
  FAKE_FAIL_RANK  this rank exits 3 after FAKE_FAIL_AT steps
  FAKE_FAIL_AT    (default 5)
  FAKE_CHECKSUM_SKEW  this rank reports a different param_checksum (and
                      server_checksum: it agrees with the servers, not with
                      the other ranks)
  FAKE_SERVER_SKEW    this rank's param_checksum differs from its
                      server_checksum: like gtopk-worker, it writes its
                      summary, then fails (exit 1)
"""

import argparse
import json
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--server", required=True)
p.add_argument("--rank", type=int, required=True)
p.add_argument("--summary-json", required=True)
p.add_argument("--steps", type=int, default=None)
p.add_argument("--model", default="mlp")
p.add_argument("--mode", default="gtopk")
p.add_argument("--selector", default="exact")
p.add_argument("--density", type=float, default=0.001)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--batch-size", type=int, default=32)
args, _ = p.parse_known_args()

steps = int(os.environ.get("FAKE_STEPS", args.steps or 20))
step_s = float(os.environ.get("FAKE_STEP_S", "0.02"))
fail_rank = int(os.environ.get("FAKE_FAIL_RANK", "-1"))
fail_at = int(os.environ.get("FAKE_FAIL_AT", "5"))
skew = int(os.environ.get("FAKE_CHECKSUM_SKEW", "-1"))
server_skew = int(os.environ.get("FAKE_SERVER_SKEW", "-1"))

n = 1000
loss = 2.3
for s in range(steps):
    time.sleep(step_s)
    if args.rank == fail_rank and s == fail_at:
        print("fake worker %d: simulated failure at step %d" % (args.rank, s),
              file=sys.stderr)
        sys.exit(3)
    loss *= 0.97
    if args.rank == 0:
        print("step %d/%d epoch 0 loss %.4f samples/s 1000 sent_bytes 80 "
              "step_ms %.1f" % (s + 1, steps, loss, step_s * 1000), flush=True)
if args.rank == 0:
    print("done steps %d test_accuracy 0.8 final_loss %.4f wall_seconds 1"
          % (steps, loss), flush=True)
with open(args.summary_json, "w") as f:
    json.dump({
        "rank": args.rank, "model": args.model, "n": n, "mode": args.mode,
        "selector": args.selector, "density": args.density, "workers": 0,
        "shards": 0, "epochs": args.epochs, "steps": steps,
        "batch_size": args.batch_size, "final_loss": loss,
        "test_accuracy": 0.8 if args.rank == 0 else None,
        "wall_seconds": steps * step_s, "step_seconds_p50": step_s,
        "sent_bytes_per_step": 80.0, "received_bytes_per_step": 80.0,
        "dense_bytes_per_step": 4.0 * n,
        "param_checksum": "abc" if args.rank != skew else "abd",
        "server_checksum": "abc" if args.rank != skew else "abd",
        "steps_per_epoch": steps,
    }, f)
if args.rank == server_skew:
    print("gtopk-worker: INTERNAL: rank %d's final parameters (checksum abc) "
          "differ from the servers' (checksum abd, at step %d): the replicas "
          "diverged" % (args.rank, steps), file=sys.stderr)
    sys.exit(1)
