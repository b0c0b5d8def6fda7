#!/usr/bin/env bash
# The whole worker on a GPU (issue 16; bench/cuda/README.md, "The whole
# worker on the device"). Run from the repository root on the GPU machine
# with the device bundle carried (`make device-bundle` here first); no other
# input. Builds gtopk-server, gtopk-worker (CUDA kernels on, against the
# device's CUDA PyTorch) and the gpu-labelled tests from the bundle, then,
# each step under `timeout` and skipped (and said so) when the budget
# would not allow it:
#   1. ctest -L gpu (device workers bit-identical to host workers);
#   2. a GPU cluster: S=2 shards, P=4 workers --device cuda on one GPU,
#      synthetic:N (default 25,557,032), density 0.001, WARMUP + STEPS steps,
#      selectors exact and gaussiank: per-phase medians, bytes, checksums;
#   3. the same clusters with --device cpu (the side-by-side ratio);
#   4. cnn on Fashion-MNIST (when the bundle has it), one epoch, --device cuda
#      (run before the CPU gaussiank cluster, the first to go when short).
# Writes $OUT/e2e.json (bench/cuda/e2e_summary.py: every figure, GPU name,
# commit, what was skipped), e2e.log, steps.jsonl, ctest_gpu.xml and
# runs.json (the launcher's summaries, per-step series included): 5 files;
# prints one line per target (met/missed with the figure).
#
# usage: bash bench/cuda/e2e_device.sh
# env: OUT (default build/e2e_out), BUNDLE (default build/device_bundle),
#   BUILD_DIR (default build/e2e_device), JOBS (default nproc), BUDGET
#   (seconds for everything, default 360), TORCH_PYTHON (default
#   /opt/torch/.venv/bin/python, else python3: the interpreter whose torch
#   gives the CMake prefix), NVIDIA_SMI (default from PATH), N (25557032),
#   DENSITY (0.001), STEPS (30 timed), WARMUP (5), WORKERS (4), SHARDS (2).
# Exit: 0 everything ran and passed; 1 a failure (a gpu test, a run, or
#   replicas that differ); 3 no CUDA device (e2e.json says why; nothing
#   built); 10 configure or build failed; 11 no bundle or bad usage;
#   124 a step timed out or the budget left steps out (the rest still ran).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 11
OUT=${OUT:-$ROOT/build/e2e_out}
BUNDLE=${BUNDLE:-build/device_bundle}
BUILD_DIR=${BUILD_DIR:-build/e2e_device}
JOBS=${JOBS:-$(nproc)}
BUDGET=${BUDGET:-360}
N=${N:-25557032}
DENSITY=${DENSITY:-0.001}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
WORKERS=${WORKERS:-4}
SHARDS=${SHARDS:-2}
NVIDIA_SMI=${NVIDIA_SMI:-$(command -v nvidia-smi || echo nvidia-smi)}
if [ -z "${TORCH_PYTHON:-}" ]; then
  TORCH_PYTHON=/opt/torch/.venv/bin/python
  [ -x "$TORCH_PYTHON" ] || TORCH_PYTHON=python3
fi
[ "$#" -eq 0 ] || { sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 11; }

mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 11
LOG="$OUT/e2e.log"
STEPS_LOG="$OUT/steps.jsonl"
: > "$LOG"
: > "$STEPS_LOG"
say() { echo "e2e: $*" | tee -a "$LOG"; }
json_str() { "$PYTHON" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"; }
PYTHON=python3
command -v python3 > /dev/null || PYTHON=/usr/bin/python3
RC=0
worse() { [ "$1" -ne 0 ] && { [ "$RC" -eq 0 ] || [ "$RC" -eq 124 ]; } && RC=$1; return 0; }
# Time left for a step that may take $1 seconds?
time_for() { [ $(( SECONDS + $1 )) -le "$BUDGET" ]; }
# step NAME TIMEOUT CMD...: runs CMD under timeout unless the budget is
# spent; records {"step", "rc", "seconds"} or {"skipped": true, "why"}.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if ! time_for "$limit"; then
    say "$name: SKIPPED (${SECONDS} s of BUDGET=$BUDGET used, needs up to $limit s)"
    printf '{"step": "%s", "skipped": true, "why": "budget: %d s of %d used, the step may take %d s"}\n' \
      "$name" "$SECONDS" "$BUDGET" "$limit" >> "$STEPS_LOG"
    worse 124
    return 124
  fi
  say "$name: $*"
  timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" $(( SECONDS - t0 )) >> "$STEPS_LOG"
  say "$name: exit $rc in $(( SECONDS - t0 )) s"
  return $rc
}
COMMIT=$(git rev-parse HEAD 2> /dev/null || true)
BUNDLE_COMMIT=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["commit"])' \
  "$BUNDLE/MANIFEST.json" 2> /dev/null || true)
meta() {  # the e2e.json fields that are not run figures
  printf '{"issue": 16, "commit": %s, "bundle_commit": %s, "gpu": %s, "date": %s, "command": "bash bench/cuda/e2e_device.sh", "budget_seconds": %d, "n": %d, "density": %s, "workers": %d, "shards": %d, "timed_steps": %d, "warmup_steps": %d, "available": %s, "reason": %s}' \
    "$(json_str "$COMMIT")" "$(json_str "$BUNDLE_COMMIT")" "$(json_str "${GPU:-}")" \
    "$(json_str "$(date -u +%FT%TZ)")" "$BUDGET" "$N" "$DENSITY" "$WORKERS" "$SHARDS" \
    "$STEPS" "$WARMUP" "$1" "$(json_str "$2")"
}

# 0. A CUDA device, or nothing to do (exit 3, e2e.json says why).
GPU=$(timeout 20 "$NVIDIA_SMI" --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader 2> /dev/null | head -1)
if [ -z "$GPU" ]; then
  reason="no CUDA device: '$NVIDIA_SMI --query-gpu=name' printed nothing"
  say "$reason"
  "$PYTHON" bench/cuda/e2e_summary.py --meta "$(meta false "$reason")" \
    --steps-log "$STEPS_LOG" --out "$OUT/e2e.json" > /dev/null
  exit 3
fi
say "GPU: $GPU; commit ${COMMIT:-?} (bundle from ${BUNDLE_COMMIT:-?})"
if [ ! -f "$BUNDLE/MANIFEST.json" ]; then
  say "no bundle at $BUNDLE: run 'make device-bundle' here and carry build/device_bundle"
  exit 11
fi

# 1. Configure and build from the bundle, against the device's CUDA torch.
# The bundle's shared libraries (prometheus-cpp core and pull, civetweb;
# CMake unpacks them there) for everything that runs, from the build's test
# discovery on: the binaries' RUNPATH finds prometheus-cpp but not civetweb,
# which only libprometheus-cpp-pull.so needs.
case "$BUILD_DIR" in /*) DEPS_LIB=$BUILD_DIR ;; *) DEPS_LIB=$ROOT/$BUILD_DIR ;; esac
export LD_LIBRARY_PATH="$DEPS_LIB/device_deps/prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
TORCH_PREFIX=$(timeout 60 "$TORCH_PYTHON" -c \
  'import torch; print(torch.utils.cmake_prefix_path)' 2>> "$LOG")
say "torch CMake prefix: ${TORCH_PREFIX:-not found} ($TORCH_PYTHON)"
step configure 120 cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGTOPK_DEVICE_BUNDLE="$BUNDLE" -DGTOPK_CUDA=ON -DGTOPK_PYTHON=OFF \
  -DGTOPK_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real \
  ${TORCH_PREFIX:+-DCMAKE_PREFIX_PATH="$TORCH_PREFIX"}
rc=$?
if [ $rc -eq 0 ]; then
  step build 240 cmake --build "$BUILD_DIR" -j "$JOBS" --target gtopk_server \
    gtopk_worker cuda_sparsify_test worker_client_cuda_test
  rc=$?
fi
if [ $rc -ne 0 ] || [ ! -x "$BUILD_DIR/worker/gtopk-worker" ]; then
  tail -40 "$LOG"
  say "configure/build failed (exit $rc): nothing ran"
  "$PYTHON" bench/cuda/e2e_summary.py --meta "$(meta true "build failed")" \
    --steps-log "$STEPS_LOG" --out "$OUT/e2e.json"
  exit 10
fi
# 2. The GPU tests.
step ctest_gpu 120 ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure \
  -j 4 --timeout 100 --output-junit "$OUT/ctest_gpu.xml"
worse $?

# 3. Clusters: GPU then CPU, exact then gaussiank.
RUNS=()
cluster() {  # cluster DEVICE SELECTOR TIMEOUT
  local name="${1}_${2}"
  step "$name" "$3" "$PYTHON" deploy/local/gtopk_local.py --name "$name" \
    --build-dir "$BUILD_DIR" --runs-dir "$BUILD_DIR/runs" --workers "$WORKERS" \
    --shards "$SHARDS" --model "synthetic:$N" --density "$DENSITY" \
    --selector "$2" --steps $(( WARMUP + STEPS )) --device "$1" \
    --prometheus off --timeout $(( $3 - 10 ))
  worse $?
  if [ -f "$BUILD_DIR/runs/$name/summary.json" ]; then
    RUNS+=(--run "$name=$BUILD_DIR/runs/$name/summary.json")
  fi
}
cluster cuda exact 60
cluster cuda gaussiank 60
cluster cpu exact 60

# 4. cnn on Fashion-MNIST, one epoch on the GPU (before the second CPU
# cluster: a budget that runs short leaves out the least important).
DATA="$BUNDLE/data/fashion-mnist"
if [ -f "$DATA/train-images-idx3-ubyte.gz" ]; then
  step cuda_cnn 90 "$PYTHON" deploy/local/gtopk_local.py --name cuda_cnn \
    --build-dir "$BUILD_DIR" --runs-dir "$BUILD_DIR/runs" --workers "$WORKERS" \
    --shards "$SHARDS" --model cnn --epochs 1 --density "$DENSITY" \
    --device cuda --data-dir "$DATA" --prometheus off --timeout 80
  worse $?
  if [ -f "$BUILD_DIR/runs/cuda_cnn/summary.json" ]; then
    RUNS+=(--run "cuda_cnn=$BUILD_DIR/runs/cuda_cnn/summary.json")
  fi
else
  say "cuda_cnn: SKIPPED (no Fashion-MNIST in $DATA)"
  echo '{"step": "cuda_cnn", "skipped": true, "why": "the bundle has no Fashion-MNIST"}' >> "$STEPS_LOG"
fi
cluster cpu gaussiank 60

# 5. e2e.json and the target lines.
"$PYTHON" bench/cuda/e2e_summary.py --meta "$(meta true "")" \
  ${RUNS[@]+"${RUNS[@]}"} --warmup "$WARMUP" --junit "$OUT/ctest_gpu.xml" \
  --steps-log "$STEPS_LOG" --out "$OUT/e2e.json" --runs-out "$OUT/runs.json" | tee -a "$LOG"
"$PYTHON" - "$OUT/e2e.json" <<'EOF' || worse 1
import json, sys
r = json.load(open(sys.argv[1]))
bad = [k for k, v in r["runs"].items() if not v["replicas_identical"]]
if bad or not r["ctest_gpu_passed"]:
    print("e2e: FAILED: replicas differ in %s; ctest -L gpu passed: %s" % (bad, r["ctest_gpu_passed"]))
    sys.exit(1)
EOF
say "done in ${SECONDS} s (exit $RC); $OUT/e2e.json"
exit "$RC"
