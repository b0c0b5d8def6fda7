#!/bin/bash
# Per-step fixed cost of a gtopk round on loopback (bench/model/README.md):
# P = 2 workers, n = 100,000 (k = 100 pairs: bytes and merge negligible),
# 60 steps, S = 1 (push, merge, pull: two messages per worker) and S = 2
# (plus the shard<->leader threshold exchange and commit vote). Writes
# bench/results/overhead.json (median over steps 10..59 of the rank with
# the smaller communication time per step, and of the mean over ranks).
#   bench/model/overhead.sh [build-dir]
set -euo pipefail
B=${1:-build}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$ROOT/bench/results/overhead.json
TMP=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$TMP"' EXIT
for S in 1 2; do
  PEERS=$(seq -s, -f "127.0.0.1:%g" 56200 $((56200 + S - 1)))
  for s in $(seq 0 $((S - 1))); do
    "$B/server/gtopk-server" --listen=127.0.0.1:$((56200 + s)) --shard-id=$s \
      --num-shards=$S --peers="$PEERS" --workers=2 --density=0.001 \
      --mode=gtopk --tls=off > "$TMP/s$S-$s.log" 2>&1 &
  done
  sleep 1.5
  W=()
  for r in 0 1; do
    "$B/worker/gtopk-worker" --server=127.0.0.1:56200 --rank=$r \
      --model=synthetic:100000 --steps=60 --seed=1 --tls=off \
      --summary-json="$TMP/s$S-w$r.json" > "$TMP/s$S-w$r.log" 2>&1 &
    W+=($!)
  done
  wait "${W[@]}"
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
done
/usr/bin/python3 - "$TMP" "$OUT" <<'PY'
import json, os, statistics as st, sys, time
tmp, out = sys.argv[1], sys.argv[2]
res = {}
for S in (1, 2):
    ss = [json.load(open(os.path.join(tmp, "s%d-w%d.json" % (S, r)))) for r in (0, 1)]
    c = [s["per_step"]["communication_seconds"] for s in ss]
    res["S%d" % S] = {
        "communication_seconds_min_rank_p50": st.median(min(x[i] for x in c) for i in range(10, 60)),
        "communication_seconds_mean_rank_p50": st.median(st.fmean(x[i] for x in c) for i in range(10, 60)),
        "sent_bytes_per_step": ss[0]["sent_bytes_per_step"]}
doc = {"command": "bench/model/overhead.sh",
       "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "load_average": open("/proc/loadavg").read().split()[:3],
       "what": "loopback gtopk round, P = 2, n = 100,000, k = 100: S1 = two messages per worker (push, pull) and the shard's work; S2 - S1 = the threshold exchange and commit vote between the two shards",
       "results": res}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
PY
