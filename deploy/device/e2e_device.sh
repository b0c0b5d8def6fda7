#!/usr/bin/env bash
# The whole worker on a GPU (issue 16; deploy/device/README.md, "The whole
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
# Writes $OUT/e2e.json (deploy/device/e2e_summary.py: every figure, GPU name,
# commit, what was skipped), e2e.log, steps.jsonl, ctest_gpu.xml and
# runs.json (the launcher's summaries, per-step series included): 5 files;
# prints one line per target (met/missed with the figure).
#
# usage: bash deploy/device/e2e_device.sh [--help]
# env: OUT (default build/e2e_out), BUNDLE (default build/device_bundle),
#   BUILD_DIR (default build/e2e_device), JOBS (default nproc), BUDGET
#   (seconds for everything, default 360), TORCH_PYTHON (default
#   /opt/torch/.venv/bin/python, else python3: the interpreter whose torch
#   gives the CMake prefix), NVIDIA_SMI (default from PATH), N (25557032),
#   DENSITY (0.001), STEPS (30 timed), WARMUP (5), WORKERS (4), SHARDS (2).
# Exit: 0 everything ran and passed (--help: the usage); 1 a failure (a gpu
#   test, a run, or replicas that differ); 3 no CUDA device (nothing built;
#   the reason says what nvidia-smi did: not installed, failed with a status,
#   printed nothing); 10 configure or build failed; 11 no bundle, or bad
#   usage (an argument, or a setting above that is not a number in range);
#   124 a step timed out or the budget left steps out (the rest still ran).
#   Every exit but --help and an OUT that cannot be created writes e2e.json,
#   with `exit_status` and, for an early exit, `reason`.
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
PYTHON=python3
command -v python3 > /dev/null || PYTHON=/usr/bin/python3
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

# Arguments and settings: a bad one is bad usage (exit 11, e2e.json says
# which), found before anything runs.
USAGE_ERROR=
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    *) USAGE_ERROR="bad argument '$arg' (the script takes none; settings are env variables)"; break ;;
  esac
done
if [ -z "$USAGE_ERROR" ]; then
  for v in BUDGET N STEPS WORKERS SHARDS JOBS WARMUP; do
    lo=1; [ "$v" = WARMUP ] && lo=0
    if ! [[ "${!v}" =~ ^[0-9]{1,10}$ ]] || [ "${!v}" -lt "$lo" ]; then
      USAGE_ERROR="bad setting $v='${!v}': want a whole number >= $lo"; break
    fi
  done
fi
if [ -z "$USAGE_ERROR" ] && ! "$PYTHON" -c 'import sys; d=float(sys.argv[1]); sys.exit(not (0 < d <= 1))' \
    "$DENSITY" 2> /dev/null; then
  USAGE_ERROR="bad setting DENSITY='$DENSITY': want a number in (0, 1]"
fi

if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd); then
  echo "e2e: cannot create OUT=$OUT: no e2e.json written" >&2
  exit 11
fi
LOG="$OUT/e2e.log"
STEPS_LOG="$OUT/steps.jsonl"
: > "$LOG"
: > "$STEPS_LOG"
say() { echo "e2e: $*" | tee -a "$LOG"; }
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
# The e2e.json fields that are not run figures: meta AVAILABLE REASON EXIT,
# AVAILABLE true, false or null (a CUDA device found, none, not looked for).
# Settings that are not numbers (bad usage) are kept as strings.
meta() {
  "$PYTHON" - "$1" "$2" "$3" "$COMMIT" "$BUNDLE_COMMIT" "${GPU:-}" "$BUDGET" "$N" \
    "$DENSITY" "$WORKERS" "$SHARDS" "$STEPS" "$WARMUP" <<'EOF'
import datetime, json, sys
a = sys.argv[1:]
def num(s, kind):
    try:
        return kind(s)
    except ValueError:
        return s
names = ["budget_seconds", "n", "density", "workers", "shards", "timed_steps", "warmup_steps"]
m = {"issue": 16, "commit": a[3], "bundle_commit": a[4], "gpu": a[5],
     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
     "command": "bash deploy/device/e2e_device.sh"}
for name, value in zip(names, a[6:]):
    m[name] = num(value, float if name == "density" else int)
m.update(available=json.loads(a[0]), reason=a[1], exit_status=int(a[2]))
print(json.dumps(m))
EOF
}
# finish RC AVAILABLE REASON: an early exit, e2e.json written first.
finish() {
  say "$3"
  "$PYTHON" deploy/device/e2e_summary.py --meta "$(meta "$2" "$3" "$1")" \
    --steps-log "$STEPS_LOG" --out "$OUT/e2e.json" > /dev/null
  exit "$1"
}
if [ -n "$USAGE_ERROR" ]; then
  echo "e2e: $USAGE_ERROR (--help for usage)" >&2
  finish 11 null "bad usage: $USAGE_ERROR; nothing ran"
fi

# 0. A CUDA device, or nothing to do (exit 3, e2e.json says what nvidia-smi
# did: not installed, failed, printed nothing).
SMI_ARGS=(--query-gpu=name,driver_version,memory.total --format=csv,noheader)
SMI_CMD="$NVIDIA_SMI ${SMI_ARGS[*]}"
GPU=
if ! command -v "$NVIDIA_SMI" > /dev/null 2>&1; then
  reason="no CUDA device: nvidia-smi not installed ('$NVIDIA_SMI' not found on PATH or not executable; NVIDIA_SMI overrides)"
else
  smi_err=$(mktemp)
  smi_out=$(timeout 20 "$NVIDIA_SMI" "${SMI_ARGS[@]}" 2> "$smi_err")
  smi_rc=$?
  GPU=$(printf '%s\n' "$smi_out" | head -1)
  err=$(head -1 "$smi_err")
  rm -f "$smi_err"
  if [ $smi_rc -eq 124 ]; then
    reason="no CUDA device: '$SMI_CMD' timed out after 20 s"
    GPU=
  elif [ $smi_rc -ne 0 ]; then
    reason="no CUDA device: '$SMI_CMD' failed with status $smi_rc${err:+: $err}"
    GPU=
  elif [ -z "$GPU" ]; then
    reason="no CUDA device: '$SMI_CMD' printed nothing${err:+ (stderr: $err)}"
  fi
fi
[ -z "$GPU" ] && finish 3 false "$reason"
say "GPU: $GPU; commit ${COMMIT:-?} (bundle from ${BUNDLE_COMMIT:-?})"
if [ ! -f "$BUNDLE/MANIFEST.json" ]; then
  finish 11 true "no bundle at $BUNDLE: run 'make device-bundle' here and carry build/device_bundle"
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
  finish 10 true "configure/build failed (exit $rc): nothing ran"
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
"$PYTHON" deploy/device/e2e_summary.py --meta "$(meta true "" 0)" \
  ${RUNS[@]+"${RUNS[@]}"} --warmup "$WARMUP" --junit "$OUT/ctest_gpu.xml" \
  --steps-log "$STEPS_LOG" --out "$OUT/e2e.json" --runs-out "$OUT/runs.json" | tee -a "$LOG"
"$PYTHON" - "$OUT/e2e.json" <<'EOF' || worse 1
import json, sys
r = json.load(open(sys.argv[1]))
# false fails; null (not run: skipped for time, exit 124 already) does not.
bad = [k for k, v in r["runs"].items() if v["replicas_identical"] is False]
if bad or r["ctest_gpu_passed"] is False:
    print("e2e: FAILED: replicas differ in %s; ctest -L gpu passed: %s" % (bad, r["ctest_gpu_passed"]))
    sys.exit(1)
EOF
"$PYTHON" - "$OUT/e2e.json" "$RC" <<'EOF'
import json, os, sys
r = json.load(open(sys.argv[1]))
r["exit_status"] = int(sys.argv[2])
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(r, f, indent=1)
    f.write("\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
EOF
say "done in ${SECONDS} s (exit $RC); $OUT/e2e.json"
exit "$RC"
