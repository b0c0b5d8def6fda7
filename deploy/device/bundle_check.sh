#!/usr/bin/env bash
# Proves the device bundle on this machine (`make device-bundle-check`;
# deploy/device/README.md, "The whole worker on the device"): in a private
# mount namespace, overlays hide every system file the bundle stands in for
# (`device_bundle.py system-paths`: the gRPC, Abseil, re2, c-ares,
# prometheus-cpp and civetweb headers, libraries of every variant, CMake and
# pkg-config files, grpc_cpp_plugin; plus every libgrpc*/libgpr*/libupb*/
# libre2*/libcares*/libaddress_sorting*/libabsl_*/libprometheus-cpp*/
# libcivetweb* file), so they are absent, not empty. Then, from the bundle
# alone (-DGTOPK_DEVICE_BUNDLE), it configures with CUDA on, builds
# gtopk-server, gtopk-worker (against Debian's CPU libtorch here) and the
# gpu-labelled tests (their CUDA objects compile here; they cannot run),
# checks that no hidden library was linked and that prometheus-cpp and
# civetweb load from the bundle (LD_LIBRARY_PATH on its unpacked folder, as
# deploy/device/e2e_device.sh sets it on the device), and runs S=2 shards and
# P=2 workers on loopback for a few steps of synthetic:100000 and of the MLP
# on Fashion-MNIST (libtorch's module, taking Abseil from gtopk-worker; also
# on OpenBLAS when installed) with the device run's launcher
# (deploy/local/gtopk_local.py), requiring equal replica checksums. The
# device's own packages (protobuf 3.21, GTest, Boost, zlib, OpenSSL) stay
# visible: the device has them too.
#
# usage: deploy/device/bundle_check.sh      (as root: it needs unshare -m and
#        overlay mounts; `make device-bundle` first)
# env: BUNDLE (default build/device_bundle), BUILD_DIR (default
#   build/bundle_check; its CMake cache is kept between runs), JOBS
#   (default nproc), BUILD_TIMEOUT (seconds, default 1500).
# Exit: 0 the bundle builds and runs; 1 the smoke run failed; 2 not root or
#   no unshare/overlay; 3 no bundle; 10 configure or build failed; 12 a
#   hidden file is still visible or a hidden library was linked;
#   124 a step timed out.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
BUNDLE=${BUNDLE:-build/device_bundle}
BUILD_DIR=${BUILD_DIR:-build/bundle_check}
JOBS=${JOBS:-$(nproc)}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-1500}
PY=python3

if [ "${GTOPK_BUNDLE_CHECK_INNER:-}" != 1 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v unshare > /dev/null; then
    echo "bundle_check.sh: needs root and unshare (a private mount namespace)" >&2
    exit 2
  fi
  if [ ! -f "$BUNDLE/MANIFEST.json" ]; then
    echo "bundle_check.sh: no bundle at $BUNDLE (make device-bundle)" >&2
    exit 3
  fi
  GTOPK_BUNDLE_CHECK_INNER=1 exec unshare -m --propagation private "$0" "$@"
fi

t_start=$SECONDS
say() { echo "bundle-check: $*"; }

# 1. Hide: one overlay per root, a whiteout (char 0:0) per hidden entry.
ROOTS=(/usr/include /usr/lib/x86_64-linux-gnu /usr/bin)
EXTRA=(libgrpc* libgpr* libupb* libre2* libcares* libaddress_sorting* libabsl_*
       libprometheus-cpp* libcivetweb*)
mapfile -t HIDE < <(
  "$PY" deploy/device/device_bundle.py system-paths "$BUNDLE"
  for g in "${EXTRA[@]}"; do compgen -G "/usr/lib/x86_64-linux-gnu/$g"; done
)
[ "${#HIDE[@]}" -gt 0 ] || { say "nothing to hide?"; exit 12; }
TMP=$(mktemp -d) && mount -t tmpfs tmpfs "$TMP" || exit 2
for r in "${ROOTS[@]}"; do
  d="$TMP/${r//\//_}"
  mkdir -p "$d/upper" "$d/work"
done
for p in "${HIDE[@]}"; do
  for r in "${ROOTS[@]}"; do
    case "$p" in
      "$r"/*)
        w="$TMP/${r//\//_}/upper/${p#"$r"/}"
        mkdir -p "${w%/*}" && { [ -e "$w" ] || mknod "$w" c 0 0; } || exit 2
        break ;;
    esac
  done
done
for r in "${ROOTS[@]}"; do
  d="$TMP/${r//\//_}"
  mount -t overlay overlay -o "lowerdir=$r,upperdir=$d/upper,workdir=$d/work" "$r" ||
    { say "overlay mount on $r failed"; exit 2; }
done
for p in "${HIDE[@]}"; do
  if [ -e "$p" ] || [ -L "$p" ]; then say "still visible: $p"; exit 12; fi
done
say "${#HIDE[@]} system paths hidden (e.g. /usr/include/grpcpp, libgrpc++.a, libabsl_base.so, grpc_cpp_plugin,
  /usr/include/prometheus, libprometheus-cpp-pull.so.1.0, libcivetweb.so.1)"

# 2. Configure and build from the bundle. CUDA on: the worker's device
# Step and the gpu tests compile here, as on the device.
TARGETS=(gtopk_server gtopk_worker cuda_sparsify_test worker_client_cuda_test)
# The bundle's shared libraries (prometheus-cpp core and pull, civetweb;
# CMake unpacks them there) for everything that runs, from the build's test
# discovery on: the binaries' RUNPATH finds prometheus-cpp, but not what
# libprometheus-cpp-pull.so itself needs (civetweb). As on the device.
case "$BUILD_DIR" in /*) DEPS_LIB=$BUILD_DIR ;; *) DEPS_LIB=$ROOT/$BUILD_DIR ;; esac
DEPS_LIB=$DEPS_LIB/device_deps/prefix/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$DEPS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$SECONDS
rm -f "$BUILD_DIR/CMakeCache.txt"  # found afresh (the objects stay)
if ! timeout -k 10 300 cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGTOPK_DEVICE_BUNDLE="$BUNDLE" -DGTOPK_CUDA=ON -DGTOPK_PYTHON=OFF \
    -DGTOPK_BUILD_BENCH=OFF -DGTOPK_WERROR=ON > "$BUILD_DIR.configure.log" 2>&1; then
  tail -30 "$BUILD_DIR.configure.log"
  say "configure failed (log: $BUILD_DIR.configure.log)"; exit 10
fi
grep -E "^(gRPC|absl|prometheus-cpp|civetweb)_DIR" "$BUILD_DIR/CMakeCache.txt"
for pkg in gRPC prometheus-cpp civetweb; do
  if ! grep -q "^${pkg}_DIR:PATH=.*device_deps" "$BUILD_DIR/CMakeCache.txt"; then
    say "$pkg was not found in the bundle"; exit 12
  fi
done
timeout -k 10 "$BUILD_TIMEOUT" cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"
rc=$?
if [ $rc -ne 0 ]; then
  say "build failed (exit $rc)"; [ $rc -eq 124 ] && exit 124; exit 10
fi
say "configure + build: $(( SECONDS - t0 )) s"

# 3. Nothing hidden got linked: gRPC, Abseil, re2, c-ares are static; the
# shared prometheus-cpp (core, pull) and civetweb (and civetweb-cpp) load
# from the bundle's folder, each of the four, and from nowhere else.
for b in "$BUILD_DIR/server/gtopk-server" "$BUILD_DIR/worker/gtopk-worker"; do
  deps=$(ldd "$b" 2>&1)
  if grep -E "libgrpc|libgpr|libabsl|libupb|libre2|libcares|not found" <<< "$deps"; then
    say "$b links a hidden or missing library"; exit 12
  fi
  for lib in libprometheus-cpp-core.so.1.0 libprometheus-cpp-pull.so.1.0 libcivetweb.so.1 \
      libcivetweb-cpp.so.1; do
    line=$(grep -F "$lib =>" <<< "$deps" | sed 's/^[[:space:]]*//')
    case "$line" in
      *"=> $DEPS_LIB/$lib "*) echo "  ${b##*/}: $line" ;;
      *) say "${b##*/}: $lib not from the bundle: '${line:-not needed}'"; exit 12 ;;
    esac
  done
done

# gtopk-worker's libtorch module (worker/trainer/torch_module.h) links
# libtorch, nothing hidden or missing, and no Abseil: against the bundle's
# static Abseil it uses gtopk-worker's, so every Abseil symbol it needs must
# be exported by the worker (worker/CMakeLists.txt).
module="$BUILD_DIR/worker/libgtopk_torch_model.so"
if [ ! -f "$module" ] || grep -E "libgrpc|libgpr|libabsl|libupb|libre2|libcares|not found" <<< "$(ldd "$module" 2>&1)"; then
  say "$module is missing or links a hidden or missing library"; exit 12
fi
missing=$(comm -23 <(nm -D --undefined-only "$module" | awk '/4absl/ {print $2}' | sort -u) \
  <(nm -D --defined-only "$BUILD_DIR/worker/gtopk-worker" | awk '/4absl/ {print $3}' | sort -u))
if [ -n "$missing" ]; then
  say "the module needs Abseil symbols gtopk-worker does not export:"; echo "$missing" | head; exit 12
fi
echo "  libgtopk_torch_model.so: $(nm -D --undefined-only "$module" | grep -c 4absl) Abseil symbols, all from gtopk-worker"

# 4. Loopback smoke runs, S=2, P=2, 5 steps each: synthetic, then the MLP
# on Fashion-MNIST (Debian's dataset-fashion-mnist, which make test
# installs): the worker's libtorch module, loaded on the first torch model.
t0=$SECONDS
smoke() {  # smoke NAME MODEL [BLAS_DIR: put first on LD_LIBRARY_PATH]
  LD_LIBRARY_PATH="${3:+$3:}$LD_LIBRARY_PATH" \
  timeout -k 10 180 "$PY" deploy/local/gtopk_local.py --name "$1" \
    --build-dir "$BUILD_DIR" --runs-dir "$BUILD_DIR/runs" --workers 2 --shards 2 \
    --model "$2" --steps 5 --density 0.01 --prometheus off \
    --timeout 150 > "$BUILD_DIR.$1.log" 2>&1
  local rc=$?
  tail -12 "$BUILD_DIR.$1.log"
  if [ $rc -ne 0 ]; then
    say "smoke run $1 failed (exit $rc; logs in $BUILD_DIR/runs/$1)"
    [ $rc -eq 124 ] && exit 124; exit 1
  fi
  "$PY" - "$BUILD_DIR/runs/$1/summary.json" "$2" <<'EOF' || exit 1
import json, sys
s = json.load(open(sys.argv[1]))
assert s["replica_checksums_match"], s["param_checksums"]
assert s["steps"] == 5 and s["workers"] == 2 and s["shards"] == 2, s
print("bundle-check: smoke run %s: %d steps, P=%d S=%d, checksums %s, %d bytes/worker/step"
      % (sys.argv[2], s["steps"], s["workers"], s["shards"], s["param_checksums"][0],
         s["sent_bytes_per_worker_per_step"]))
EOF
}
smoke bundle_check synthetic:100000
smoke bundle_check_mlp mlp
# Again with OpenBLAS as the BLAS when it is installed (make test installs
# it; libtorch recommends it): its thread-local storage with libtorch's
# once left no room in civetweb's metrics threads (worker/CMakeLists.txt).
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -e "$OPENBLAS_DIR/libblas.so.3" ]; then
  smoke bundle_check_mlp_openblas mlp "$OPENBLAS_DIR"
else
  say "smoke run with OpenBLAS: SKIPPED (no $OPENBLAS_DIR)"
fi
say "smoke run: $(( SECONDS - t0 )) s; all: $(( SECONDS - t_start )) s"
exit 0
