# gtopk — the user's entry points. See README.md.
#
#   make deps    install the Debian packages the build needs (apt-get, as root)
#   make build   Release build in build/
#   make test    deps + build + every test (ctest); non-zero on any failure
#   make check   build + the unit tier (ctest -L unit): the fast loop after
#                a change (the tiers: make test-counts)
#   make test-counts  the CTest entries and test cases per label, generated
#                from the configured build (tests/count_tests.py)
#   make python  deps + the Python package (gtopk, gtopk.torch) in
#                BUILD_DIR/python: PYTHONPATH=BUILD_DIR/python /usr/bin/python3
#   make python-install  make python, then install the package into
#                /usr/local/lib/python3.X/dist-packages (as root)
#   make wheel   the same package as a wheel, dist/gtopk-*.whl, built by
#                `pip wheel --no-build-isolation ./python` for /usr/bin/python3
#                (python/setup.py; reuses BUILD_DIR's CMake build)
#   make bench   run the benchmarks, write bench/results/*.json
#   make bench-lowbw  (root) gTop-k vs Top-k vs dense vs PyTorch DDP over
#                1 Gbit/s links in network namespaces (bench/lowbw/);
#                bench/results/lowbw.json and lowbw.png. LOWBW_ARGS: extra
#                flags, e.g. LOWBW_ARGS="--rate 100mbit --workers 2,4"
#   make bench-lowbw-grid  (root) the issue-20 grid: lowbw per rate and
#                shard count (bench/lowbw/grid.py), merged into lowbw.json
#   make bench-model  the performance model (bench/model/): validation,
#                predictions, shard counts; bench/results/scale_model.json
#                and scale_model_*.png (no root, no build)
#   make device-bundle  pack what the GPU machine lacks into
#                BUILD_DIR/device_bundle/ (deploy/device/device_bundle.txt: static
#                gRPC, Abseil, re2, c-ares; shared prometheus-cpp and civetweb;
#                the generated proto sources, Fashion-MNIST); then on the
#                device, with that folder carried: bash
#                deploy/device/e2e_device.sh (deploy/device/README.md)
#   make device-bundle-check  (root) build gtopk-server, gtopk-worker and the
#                gpu tests from the bundle alone, the system's gRPC/Abseil/
#                prometheus-cpp/... hidden in a private mount namespace, then
#                a loopback run
#   make fuzz-smoke  build the libFuzzer harnesses (clang-14, GTOPK_FUZZ=ON, in
#                FUZZ_BUILD_DIR) and run each briefly (FUZZ_SMOKE_SECONDS, at
#                most FUZZ_SMOKE_RUNS executions); fails on any crash, leak or
#                sanitizer report (docs/fuzzing.md). Installs clang-14 and
#                libclang-rt-14-dev when missing (as root)
#   make fuzz    the same, each harness FUZZ_SECONDS (300); new corpus items in
#                FUZZ_BUILD_DIR/fuzz-scratch, figures in FUZZ_RESULTS
#                (bench/results/fuzz.json)
#   make format  clang-format the sources in place (needs clang-format)
#   make compose-certs  (root) the docker-compose cluster's set-up step: the
#                certificates of its default mutual TLS (deploy/tls/out/)
#   make compose-test  (root) the docker-compose cluster run for real
#   make deploy-sync  refresh deploy/k8s/base/generated/ from deploy/cluster.env
#                and dashboards/*.json (kustomize reads no file outside its root)
#   make demo    deps + build + a local cluster training Fashion-MNIST with
#                gTop-k (deploy/local/gtopk_local.py); logs and
#                runs/$(NAME)/summary.json. WORKER=python: the workers are
#                the PyTorch example examples/pytorch/train_fashion_mnist.py
#                on the gtopk Python package (built with `make python`)
#
# Variables: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc),
# CMAKE_ARGS (extra -D options, e.g. -DGTOPK_SANITIZE=address).
# Demo variables (defaults below): WORKERS SHARDS MODEL MODE SELECTION DENSITY
# DENSITY_WARMUP SELECTOR EPOCHS STEPS BATCH LR MOMENTUM MOMENTUM_MODE SEED
# NAME WORKER (cpp: gtopk-worker; python: the PyTorch example) DEMO_ARGS
# (extra launcher flags), e.g.
#   make demo WORKERS=8 SHARDS=3 MODE=dense DENSITY=0.01 EPOCHS=3 MODEL=mlp SELECTOR=gaussiank
#   make demo WORKER=python

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
# ctest's parallel entries (make test, make check): three per core. Most
# entries wait more than they compute (servers starting, deadlines,
# retries: the integration tier keeps about a quarter of a core busy per
# entry), so several per core keep the cores busy (full run here: 593 s at
# -j 2, 392 at -j 4, 356 at -j 6); docs/testing.md.
TEST_JOBS  ?= $(shell echo $$(( 3 * $(JOBS) )))
# Of those, how many may be entries that keep a core busy from start to end
# (RESOURCE_GROUPS cpu:1 in tests/CMakeLists.txt: the CUDA emulator's, ...):
# one per core, so the waiting entries run beside them from the start
# instead of together at the end. The spec ctest reads is written into the
# build folder on each run.
TEST_CPU_SLOTS ?= $(JOBS)
CTEST_RUN = printf '{"version":{"major":1,"minor":0},"local":[{"cpu":[{"id":"0","slots":%d}]}]}\n' \
	$(TEST_CPU_SLOTS) > $(BUILD_DIR)/ctest_resources.json && \
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(TEST_JOBS) --timeout 600 \
	--resource-spec-file $(abspath $(BUILD_DIR))/ctest_resources.json \
	--output-junit $(abspath $(BUILD_DIR))/ctest_junit.xml
# After a run: the entries that took over a quarter of their TIMEOUT
# (tests/timeout_margin.py; a warning, the run's exit status is kept).
TIMEOUT_MARGIN = rc=$$?; /usr/bin/python3 tests/timeout_margin.py $(BUILD_DIR); exit $$rc
CMAKE_ARGS ?=

# Debian 12 packages the build and tests need.
DEB_PACKAGES := build-essential cmake ninja-build pkg-config libboost-context-dev \
	libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev zlib1g-dev \
	libgrpc++-dev libssl-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
	libtorch-dev dataset-fashion-mnist python3 \
	prometheus-cpp-dev prometheus \
	python3-torch python3-numpy python3-dev pybind11-dev python3-pybind11 \
	gnuplot-nox iproute2 clang-format \
	docker-compose python3-yaml \
	python3-pip python3-setuptools python3-wheel python3-venv

# Commands the deployment tests (ctest label deploy) need, with the Debian
# package that provides each when it is missing. npm is checked as a command:
# Node.js from another source (e.g. NodeSource, which conflicts with Debian's
# npm package) brings its own npm. kubectl is not in Debian 12 in a usable
# version: the test says how to install it.
DEB_COMMANDS := npm:npm

# `make demo` defaults: P workers, S shards, about 5 minutes on 2 cores
# (measured: docs/demo.md). DGC's own warm-up ("dgc": four epochs)
# is too long for a 6-epoch run; one epoch at density 0.01 is used instead.
WORKERS        ?= 4
SHARDS         ?= 2
MODEL          ?= cnn
MODE           ?= gtopk
SELECTION      ?= threshold
DENSITY        ?= 0.001
DENSITY_WARMUP ?= 0.01
SELECTOR       ?= exact
EPOCHS         ?= 6
STEPS          ?=
BATCH          ?= 32
LR             ?= 0.05
MOMENTUM       ?= 0.9
MOMENTUM_MODE  ?= dgc
SEED           ?= 1
NAME           ?= demo
WORKER         ?= cpp
DEMO_ARGS      ?=
LOWBW_ARGS     ?=
TTA_ARGS       ?=

.PHONY: python python-install wheel all deps build test check test-counts bench bench-lowbw bench-lowbw-grid bench-tta tta-blas bench-model demo format format-check clean deploy-sync \
	device-bundle device-bundle-check compose-certs compose-test fuzz fuzz-smoke fuzz-build fuzz-deps

all: build

deps:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	for pc in $(DEB_COMMANDS); do \
	  command -v $${pc%%:*} >/dev/null 2>&1 || missing="$$missing $${pc#*:}"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps: all Debian packages present"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "deps: missing Debian packages:$$missing"; \
	  echo "deps: run 'sudo make deps' or: sudo apt-get install -y$$missing"; exit 1; \
	fi; \
	echo "deps: installing$$missing"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing

# Configure every time (cheap when nothing changed), so BUILD_TYPE and
# CMAKE_ARGS given on the command line always take effect. GTOPK_WERROR is
# left as the cache has it (make test turns it on), so `make demo` after
# `make test` does not rebuild everything.
build:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: deps
	@$(MAKE) --no-print-directory tta-blas
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGTOPK_WERROR=ON -DGTOPK_PYTHON=ON $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)
	$(CTEST_RUN); $(TIMEOUT_MARGIN)

# The unit tier after a change: configured as `make test` (no rebuild when
# switching between the two), no deps check. Other tiers: ctest -L
# integration|emulator|python|deploy|... (make test-counts lists them).
check:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGTOPK_WERROR=ON -DGTOPK_PYTHON=ON $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)
	$(CTEST_RUN) -L unit; $(TIMEOUT_MARGIN)

test-counts:
	/usr/bin/python3 tests/count_tests.py $(BUILD_DIR)

# The Python package for Debian's /usr/bin/python3 (docs/python.md,
# "Building and installing"): the extension gtopk._gtopk and the modules of python/gtopk.
python: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGTOPK_PYTHON=ON $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target gtopk_python
	@echo "python: built $(BUILD_DIR)/python/gtopk; use it with"
	@echo "  PYTHONPATH=$(abspath $(BUILD_DIR))/python /usr/bin/python3 -c 'import gtopk'"

python-install: python
	cmake --install $(BUILD_DIR) --component python

# The wheel (docs/python.md, "Building and installing"): python/setup.py builds the
# target gtopk_python in BUILD_DIR (configured by `make python` first) and
# packs it with python/gtopk/*.py, offline (Debian's setuptools and wheel).
wheel: python
	GTOPK_BUILD_DIR=$(abspath $(BUILD_DIR)) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
	  /usr/bin/python3 -m pip wheel --no-build-isolation --no-deps --no-index \
	  -w dist ./python
	@echo "wheel: $$(ls -t dist/gtopk-*.whl | head -1); install it with"
	@echo "  /usr/bin/python3 -m pip install --break-system-packages <that wheel>  (or into a venv --system-site-packages)"

bench: build
	mkdir -p bench/results
	$(BUILD_DIR)/bench/cpu_select_bench --results_json=bench/results/cpu_select.json
	$(BUILD_DIR)/bench/codec_bench --results_json=bench/results/codec.json
	$(BUILD_DIR)/bench/merge_bench --results_json=bench/results/merge.json
	$(BUILD_DIR)/bench/aggregation_bench --results_json=bench/results/aggregation.json

# Root first (namespaces and tc need it), then deps and build, then the run.
# Debian's python3-torch is imported by /usr/bin/python3 (not a pyenv one).
bench-lowbw:
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "bench-lowbw: needs root (it creates network namespaces and tc qdiscs): sudo make bench-lowbw"; \
	  exit 2; fi
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory build
	/usr/bin/python3 bench/lowbw/lowbw.py --build-dir $(BUILD_DIR) $(LOWBW_ARGS)

bench-lowbw-grid:
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "bench-lowbw-grid: needs root: sudo make bench-lowbw-grid"; \
	  exit 2; fi
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory build
	/usr/bin/python3 bench/lowbw/grid.py --build-dir $(BUILD_DIR) $(LOWBW_ARGS)

# Time to accuracy on slow links (bench/tta/tta.py, issue 43): root, deps,
# build and the Python package first. TTA_ARGS=--quick for the short form.
# It preloads OpenBLAS (Debian's libopenblas0-pthread, installed here if
# missing) into its Python workers only; the system's libblas.so.3 choice is
# left as it was (the BLAS changes results' bits; bench/tta/README.md).
TTA_OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
bench-tta:
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "bench-tta: needs root (it creates network namespaces and tc qdiscs): sudo make bench-tta"; \
	  exit 2; fi
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory build
	@$(MAKE) --no-print-directory python
	@$(MAKE) --no-print-directory tta-blas
	/usr/bin/python3 bench/tta/tta.py --build-dir $(BUILD_DIR) $(TTA_ARGS)

# OpenBLAS for the time-to-accuracy benchmark's Python workers only
# (bench/tta/tta.py preloads it there), installed when missing without
# changing the system's BLAS choice (the BLAS changes results' bits). As
# root only; without it tta.py --quick (ctest tta_test) runs on the
# system's BLAS, slower, and flags_test's OpenBLAS case is skipped.
tta-blas:
	@if [ ! -e $(TTA_OPENBLAS) ] && [ "$$(id -u)" = 0 ]; then \
	  blas=$$(update-alternatives --query libblas.so.3-x86_64-linux-gnu | sed -n 's/^Value: //p'); \
	  lapack=$$(update-alternatives --query liblapack.so.3-x86_64-linux-gnu | sed -n 's/^Value: //p'); \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenblas0-pthread && \
	  update-alternatives --set libblas.so.3-x86_64-linux-gnu $$blas && \
	  update-alternatives --set liblapack.so.3-x86_64-linux-gnu $$lapack; fi

# Stdlib only (numpy not needed); gnuplot for the plots, as bench-lowbw.
bench-model:
	/usr/bin/python3 bench/model/scale_model.py

# deps and build first (in that order, also under -j), then the launcher.
# WORKER=python-modern (AdamW, servers --apply=workers; MODE=ddp: torch DDP)
# takes LR only when given (make demo ... LR=0.003): the default LR is the
# servers' SGD rate, not an AdamW one. DEMO_BUILD=no runs the launcher on
# what BUILD_DIR holds, without configuring or building (ctest's
# python_example_test: a build during a ctest run would relink binaries the
# other tests are running).
DEMO_BUILD ?= yes
demo: deps
	$(if $(filter no,$(DEMO_BUILD)),,@$(MAKE) --no-print-directory build)
	$(if $(filter no,$(DEMO_BUILD)),,$(if $(filter python python-modern,$(WORKER)),@$(MAKE) --no-print-directory python))
	python3 deploy/local/gtopk_local.py --config deploy/cluster.env --name $(NAME) \
	  --worker $(WORKER) \
	  --workers $(WORKERS) --shards $(SHARDS) --model $(MODEL) \
	  --mode $(MODE) --selection $(SELECTION) --density $(DENSITY) \
	  --density-warmup '$(strip $(DENSITY_WARMUP))' \
	  --selector $(SELECTOR) --epochs $(EPOCHS) $(if $(strip $(STEPS)),--steps $(STEPS)) \
	  --batch-size $(BATCH) $(if $(and $(filter python-modern,$(WORKER)),$(filter file default,$(origin LR))),,--lr $(LR)) --momentum $(MOMENTUM) \
	  --momentum-mode $(MOMENTUM_MODE) --seed $(SEED) \
	  --build-dir $(BUILD_DIR) --runs-dir runs $(DEMO_ARGS)

# The GPU machine has no gRPC C++, Abseil, prometheus-cpp or Fashion-MNIST:
# this packs them from this machine's Debian packages (deploy/device/README.md,
# "The whole worker on the device").
device-bundle: deps
	python3 deploy/device/device_bundle.py pack --out $(BUILD_DIR)/device_bundle

device-bundle-check: device-bundle
	BUNDLE=$(BUILD_DIR)/device_bundle BUILD_DIR=$(BUILD_DIR)/bundle_check JOBS=$(JOBS) \
	  deploy/device/bundle_check.sh

# The compose cluster's set-up step (as root): the certificates of its
# default mutual TLS in deploy/tls/out/<service>/ (docs/security.md,
# "Compose"); then `cd deploy && docker compose up --build`. Plaintext is
# the explicit opt-out -f docker-compose.yml -f docker-compose.plaintext.yml.
compose-certs:
	deploy/tls/compose-certs.sh

# The docker-compose cluster run for real (issue 21; as root): builds the
# images from deploy/docker/Dockerfile and runs the cluster, over mutual TLS
# with certificates from its own set-up step, on host networking.
# COMPOSE_FORM=small: 1 shard + 1 worker; full: 2 + 4.
# COMPOSE_CPUSET limits the image builds to those cores (docker build
# --cpuset-cpus), e.g. 1 on a shared machine.
COMPOSE_FORM   ?= small
COMPOSE_CPUSET ?=
COMPOSE_ARGS   ?=
compose-test:
	python3 tests/deploy/compose/compose_test.py --form=$(COMPOSE_FORM) \
	  --cpuset=$(COMPOSE_CPUSET) $(COMPOSE_ARGS)

# Fuzzing (issue 19, docs/fuzzing.md): clang's libFuzzer on every parser of
# untrusted bytes. A build folder of its own (clang, sanitizers); only the
# harnesses and what they link are built.
FUZZ_BUILD_DIR     ?= build-fuzz
FUZZ_SECONDS       ?= 300
FUZZ_SMOKE_SECONDS ?= 10
FUZZ_SMOKE_RUNS    ?= 200000
FUZZ_RESULTS       ?= bench/results/fuzz.json
FUZZ_ARGS          ?=
FUZZ_DEB_PACKAGES  := clang-14 libclang-rt-14-dev

fuzz-deps: deps
	@missing=""; \
	for p in $(FUZZ_DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "fuzz: missing Debian packages (clang and its libFuzzer runtime):$$missing"; \
	  echo "fuzz: run 'sudo make fuzz-deps' or: sudo apt-get install -y$$missing"; exit 1; \
	fi; \
	echo "fuzz: installing$$missing"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing

fuzz-build: fuzz-deps
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_BUILD_DIR) -G Ninja \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGTOPK_FUZZ=ON -DGTOPK_BUILD_TESTS=OFF \
	  -DGTOPK_BUILD_BENCH=OFF -DGTOPK_PYTHON=OFF -DGTOPK_CUDA=OFF
	cmake --build $(FUZZ_BUILD_DIR) -j $(JOBS) --target gtopk_fuzzers

fuzz-smoke: fuzz-build
	python3 fuzz/run_fuzzers.py --smoke --build-dir $(FUZZ_BUILD_DIR) \
	  --scratch $(FUZZ_BUILD_DIR)/fuzz-scratch-smoke \
	  --seconds $(FUZZ_SMOKE_SECONDS) --runs $(FUZZ_SMOKE_RUNS) $(FUZZ_ARGS)

fuzz: fuzz-build
	python3 fuzz/run_fuzzers.py --build-dir $(FUZZ_BUILD_DIR) \
	  --scratch $(FUZZ_BUILD_DIR)/fuzz-scratch --seconds $(FUZZ_SECONDS) \
	  --results $(FUZZ_RESULTS) $(FUZZ_ARGS)

deploy-sync:
	python3 deploy/sync_generated.py

# Every C++ source the repository tracks (.clang-format: Google style, 80
# columns); `make format-check` is what CI runs (.ci/run).
FORMAT_FILES = git ls-files '*.h' '*.cc' '*.cu' '*.cuh'

format:
	$(FORMAT_FILES) | xargs clang-format -i

format-check: deps
	$(FORMAT_FILES) | xargs clang-format --dry-run -Werror

clean:
	rm -rf $(BUILD_DIR)
