#!/usr/bin/env bash
# The CUDA device check (issues 5 and 15; see deploy/device/README.md). Builds
# the kernels (the source list and nvcc flags CMake reads too,
# common/cuda/sparsify/sources.txt and nvcc_flags.txt) and the checker with
# nvcc alone (no CMake cache, Abseil, gRPC or Debian packages needed), times torch.topk when torch is importable, then
# checks correctness and times our selectors on every input kind. Writes
# $OUT/cuda_select.json (and torch_topk.json, device_check.log) and prints
# one table per input and a line per issue-15 target. Then, where the tools
# work (Firecracker machines: see ../.library/device), runs the checker under
# compute-sanitizer (memcheck, racecheck, synccheck) on small sizes and three
# inputs, and under ncu for per-kernel times at n = 25,557,032.
#
# usage: deploy/device/device_check.sh [--quick] [device_check flags...]
#   --quick   n in {1, 1000, 1048583} only (a smoke run, under a minute)
# env: OUT (default build/device_check_out), BUILD_DIR (default
#   build/device_check), NVCC, PYTHON (default: the first of python3 on
#   PATH and Debian's /usr/bin/python3 whose torch sees a CUDA device, else
#   the first that imports torch, else python3), SIZES, DENSITIES,
#   INPUTS (default all six), ITERS (>= 20), WARMUP, SANITIZE (1: run step
#   4, default), PROFILE (1: run step 5, default), BUDGET (seconds for the
#   whole run, build included, default 300: every step's timeout is cut to
#   what is left, the checker stops starting (input, n) blocks in time, and
#   steps 4 and 5 are skipped when they no longer fit; a device lease is
#   short).
# Flags and settings are checked before anything is built: the checker's own
# argument parser (device_check_args.h, compiled alone with the host C++
# compiler in about a second) runs on the checker's whole command line
# (--validate-only), and BUDGET, SANITIZE and PROFILE are checked here; a bad
# one is named and the script exits 11 at once.
# Exit: 0 all correct; 1 a correctness failure, a sanitizer error, or the
#   checker ended otherwise (crashed: its status is in the log);
#   3 no CUDA device; 10 nvcc or a host C++ compiler missing, or the build
#   failed; 11 bad usage (an unknown flag, a bad flag value or setting, an
#   OUT or BUILD_DIR that cannot be written), found before the build;
#   124 the checker timed out.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/build/device_check_out}
BUILD_DIR=${BUILD_DIR:-$ROOT/build/device_check}
# torch.topk's interpreter: a pip torch with CUDA may be on PATH (the
# device machines), Debian's python3-torch (CPU only) belongs to
# /usr/bin/python3 while another python3 comes first on PATH (these
# machines): take the one whose torch can time on the GPU.
pick_python() {
  local p with_torch=""
  for p in python3 /usr/bin/python3; do
    command -v "$p" > /dev/null || continue
    if "$p" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        > /dev/null 2>&1; then
      echo "$p"
      return
    fi
    if [ -z "$with_torch" ] && "$p" -c 'import torch' > /dev/null 2>&1; then
      with_torch=$p
    fi
  done
  echo "${with_torch:-python3}"
}
PYTHON=${PYTHON:-$(pick_python)}
SIZES=${SIZES:-1,1000,1000003,25557032,138357544}
DENSITIES=${DENSITIES:-0.0001,0.001,0.01}
INPUTS=${INPUTS:-normal,narrow_band,ties,laplace_zeros,all_equal,outliers}
ITERS=${ITERS:-30}
WARMUP=${WARMUP:-5}
SANITIZE=${SANITIZE:-1}
PROFILE=${PROFILE:-1}
BUDGET=${BUDGET:-300}
# Per-step caps (seconds); each is also cut to what is left of BUDGET.
BUILD_S=120 TORCH_S=60 CHECK_S=170 SAN_S=45 NCU_S=60
# min(cap $1, what is left less timeout's 10 s kill grace), at least 1
# (timeout 0 would mean no limit).
cap() {
  local l=$(( BUDGET - SECONDS - 10 ))
  [ "$l" -lt 1 ] && l=1
  [ "$l" -lt "$1" ] && echo "$l" || echo "$1"
}
# Time left for an optional step that may take $1 seconds?
time_for() { [ $(( SECONDS + $1 )) -le "$BUDGET" ]; }
# "step: <name> <seconds> s" in the log: what the next budget is made of.
step_start=0
step_done() { say "step: $1 $(( SECONDS - step_start )) s (run at ${SECONDS} s of BUDGET=$BUDGET)"; step_start=$SECONDS; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
bad_usage() { echo "device_check.sh: $*" >&2; echo "(--help for usage)" >&2; exit 11; }

EXTRA=()
for arg in "$@"; do
  case "$arg" in
    --quick) SIZES=1,1000,1048583 ;;
    -h|--help) usage; exit 0 ;;
    --*) EXTRA+=("$arg") ;;
    *) bad_usage "bad argument '$arg': not a flag" ;;
  esac
done
[[ "$BUDGET" =~ ^[0-9]{1,6}$ ]] && [ "$BUDGET" -ge 1 ] || \
  bad_usage "bad setting BUDGET='$BUDGET': want whole seconds, 1..999999"
for v in SANITIZE PROFILE; do
  [[ "${!v}" =~ ^[01]$ ]] || bad_usage "bad setting $v='${!v}': want 0 or 1"
done

mkdir -p "$OUT" "$BUILD_DIR" || bad_usage "cannot create OUT=$OUT or BUILD_DIR=$BUILD_DIR"
LOG="$OUT/device_check.log"
: > "$LOG" || bad_usage "cannot write $LOG"
say() { echo "$@" | tee -a "$LOG"; }

# The checker's command line (step 3; --budget-s is added there), checked
# now by its own parser compiled alone, before the minute-long nvcc build.
TORCH_JSON="$OUT/torch_topk.json"
CHECK_ARGS=(--sizes="$SIZES" --densities="$DENSITIES" --inputs="$INPUTS"
            --iters="$ITERS" --warmup="$WARMUP" --json="$OUT/cuda_select.json"
            --torch-json="$TORCH_JSON" ${EXTRA[@]+"${EXTRA[@]}"})
HOST_CXX=${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}
if [ -z "$HOST_CXX" ]; then
  say "device_check.sh: no host C++ compiler (c++, g++ or clang++; nvcc needs one too)"
  exit 10
fi
if ! "$HOST_CXX" -std=c++17 -O0 -I"$ROOT" "$ROOT/deploy/device/device_check_args.cc" \
    -o "$BUILD_DIR/device_check_args" >> "$LOG" 2>&1; then
  say "device_check.sh: building the argument check with $HOST_CXX failed; see $LOG"
  exit 10
fi
if ! "$BUILD_DIR/device_check_args" --validate-only "${CHECK_ARGS[@]}" 2> "$OUT/usage.txt"; then
  cat "$OUT/usage.txt" >> "$LOG"
  bad_usage "$(head -1 "$OUT/usage.txt") (from SIZES/DENSITIES/INPUTS/ITERS/WARMUP or a flag; nothing built)"
fi
rm -f "$OUT/usage.txt"

NVCC=${NVCC:-$(command -v nvcc || true)}
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
  say "device_check.sh: nvcc not found (set NVCC or install the CUDA toolkit)"
  exit 10
fi
say "== device_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
say "python (torch.topk): $PYTHON"
command -v nvidia-smi > /dev/null && \
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader 2>&1 | tee -a "$LOG"

# 1. Build: the selector's sources (common/cuda/sparsify/sources.txt, the
# list CMake builds) and the checker, every translation unit in parallel,
# sm_90 only, with the nvcc flags CMake uses for them
# (common/cuda/sparsify/nvcc_flags.txt).
read_list() { grep -v -e '^#' -e '^[[:space:]]*$' "$1"; }
mapfile -t SOURCES < <(read_list "$ROOT/common/cuda/sparsify/sources.txt")
mapfile -t SHARED_FLAGS < <(read_list "$ROOT/common/cuda/sparsify/nvcc_flags.txt")
NVFLAGS=(-std=c++17 -O3 -gencode arch=compute_90,code=sm_90
         "${SHARED_FLAGS[@]}" -I"$ROOT")
t0=$(date +%s)
BT=$(cap $BUILD_S)
mkdir -p "$BUILD_DIR/obj"
OBJS=() PIDS=()
for src in "${SOURCES[@]}" deploy/device/device_check.cu; do
  obj="$BUILD_DIR/obj/${src//\//_}.o"
  OBJS+=("$obj")
  timeout -k 10 "$BT" "$NVCC" "${NVFLAGS[@]}" -c "$ROOT/$src" -o "$obj" \
    >> "$LOG" 2>&1 &
  PIDS+=($!)
done
failed=0
for p in "${PIDS[@]}"; do wait "$p" || failed=$(( failed + 1 )); done
if [ ${#SOURCES[@]} -eq 0 ] || [ $failed -ne 0 ] || ! timeout -k 10 "$(cap 60)" "$NVCC" \
    -gencode arch=compute_90,code=sm_90 "${OBJS[@]}" \
    -o "$BUILD_DIR/device_check" >> "$LOG" 2>&1; then
  say "device_check.sh: build failed ($failed of ${#OBJS[@]} compiles); see $LOG"
  tail -30 "$LOG"
  exit 10
fi
say "build: $(( $(date +%s) - t0 )) s"
step_done build

# 2. torch.topk and copy baselines (optional: the check runs without).
rm -f "$TORCH_JSON"
if ! time_for 60; then
  say "torch_topk.py: skipped (${SECONDS} s of BUDGET=$BUDGET used)"
elif command -v "$PYTHON" > /dev/null; then
  timeout -k 10 "$(cap $TORCH_S)" "$PYTHON" "$ROOT/deploy/device/torch_topk.py" \
    --sizes "$SIZES" --densities "$DENSITIES" --iters "$ITERS" \
    --warmup "$WARMUP" --out "$TORCH_JSON" 2>&1 | tee -a "$LOG"
  rt=${PIPESTATUS[0]}
  [ "$rt" -ne 0 ] && say "torch_topk.py exited $rt (timeout: 124); using what it wrote"
else
  say "no $PYTHON: torch.topk not measured"
fi
if [ ! -s "$TORCH_JSON" ]; then
  printf '{"available": false, "version": "", "note": "torch_topk.py wrote nothing (see device_check.log)", "rows": []}\n' \
    > "$TORCH_JSON"
fi

step_done torch

# 3. Correctness and timings, every input. The checker starts no (input, n)
# block that would end past --budget-s (it lists those as skipped and writes
# its JSON); the timeout behind it covers the block in flight.
CT=$(cap $CHECK_S)
CB=$(( CT > 60 ? CT - 30 : CT / 2 ))
timeout -k 10 "$CT" "$BUILD_DIR/device_check" --budget-s="$CB" \
  "${CHECK_ARGS[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
case $rc in
  0) say "device_check: all correct; results in $OUT/cuda_select.json" ;;
  1) say "device_check: CORRECTNESS FAILURES (see above)" ;;
  2) say "device_check: refused its arguments (see above)"; exit 11 ;;
  3) say "device_check: no CUDA device"; exit 3 ;;
  124|137) say "device_check: timed out" ; rc=124 ;;
  *) say "device_check: exited $rc (counted as a failure: exit 1)"; rc=1 ;;
esac
step_done check

# A tool next to nvcc or on PATH.
cuda_tool() {
  local t
  t=$(command -v "$1" 2> /dev/null) || t="$(dirname "$NVCC")/$1"
  [ -x "$t" ] && echo "$t"
}
# Correctness runs only (--check-only): every launch is instrumented. Normal
# input and two on which the exact selector's digits decide late (more
# histogram passes, the final compaction from u); exact starts from a
# sample at n = 100003 (the default is n >= 2^22), from a histogram pass
# at n = 1000.
SMALL=(--sizes=1000,100003 --densities=0.001,0.3 --check-only
       --inputs=normal,narrow_band,ties --exact-sample-min-n=100000)

# 4. compute-sanitizer on small sizes and three inputs: out-of-bounds and misaligned
# accesses, shared-memory races, barrier misuse (each tool's errors fail
# the run; a tool that cannot run here is reported and skipped).
SAN=$(cuda_tool compute-sanitizer)
if [ "$SANITIZE" = 1 ] && [ -n "$SAN" ]; then
  for tool in memcheck racecheck synccheck; do
    if ! time_for $SAN_S; then
      say "compute-sanitizer $tool: skipped (${SECONDS} s of BUDGET=$BUDGET used)"
      continue
    fi
    timeout -k 10 "$SAN_S" "$SAN" --tool "$tool" --error-exitcode 99 \
      "$BUILD_DIR/device_check" "${SMALL[@]}" \
      --json="$OUT/sanitizer_$tool.json" > "$OUT/sanitizer_$tool.log" 2>&1
    rs=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" \
      "$OUT/sanitizer_$tool.log" | tail -1)
    case $rs in
      0) say "compute-sanitizer $tool: clean ($summary)" ;;
      99) say "compute-sanitizer $tool: ERRORS ($summary; see sanitizer_$tool.log)"
          [ "$rc" -eq 0 ] && rc=1 ;;
      *) say "compute-sanitizer $tool: did not complete (exit $rs; see sanitizer_$tool.log)" ;;
    esac
    step_done "sanitizer $tool"
  done
elif [ "$SANITIZE" = 1 ]; then
  say "compute-sanitizer not found: step 4 skipped"
fi

# 5. Per-kernel device times (ncu, clocks left as they are) for one size.
NCU=$(cuda_tool ncu)
if [ "$PROFILE" = 1 ] && [ -n "$NCU" ] && ! time_for $NCU_S; then
  say "ncu: skipped (${SECONDS} s of BUDGET=$BUDGET used)"
elif [ "$PROFILE" = 1 ] && [ -n "$NCU" ]; then
  # Every kernel of one checked selection per method (--check-only), with
  # the caches as the program leaves them (--cache-control none: u is
  # larger than L2 anyway; the small kernels would otherwise start cold).
  timeout -k 10 "$NCU_S" "$NCU" --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --launch-count 400 \
    --print-summary per-kernel --csv --log-file "$OUT/ncu_kernels.csv" \
    "$BUILD_DIR/device_check" --sizes=25557032 --densities=0.001 --check-only \
    --inputs=normal \
    --json="$OUT/ncu_run.json" > "$OUT/ncu.log" 2>&1
  rn=$?
  step_done ncu
  if [ $rn -eq 0 ]; then
    say "ncu: per-kernel times in $OUT/ncu_kernels.csv"
  else
    say "ncu: did not complete (exit $rn; see ncu.log)"
  fi
elif [ "$PROFILE" = 1 ]; then
  say "ncu not found: step 5 skipped"
fi
say "device_check.sh: done in ${SECONDS} s (BUDGET=$BUDGET)"
exit "$rc"
