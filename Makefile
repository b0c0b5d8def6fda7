# gtopk — the user's entry points. See README.md.
#
#   make deps    install the Debian packages the build needs (apt-get, as root)
#   make build   Release build in build/
#   make test    deps + build + every test (ctest); non-zero on any failure
#   make bench   run the benchmarks, write bench/results/*.json
#   make format  clang-format the sources in place (needs clang-format)
#
# Variables: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc),
# CMAKE_ARGS (extra -D options, e.g. -DGTOPK_SANITIZE=address).

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=

# Debian 12 packages the build and tests need.
DEB_PACKAGES := build-essential cmake ninja-build pkg-config \
	libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev zlib1g-dev \
	libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc

.PHONY: all deps build test bench format clean

all: build

deps:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
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
# CMAKE_ARGS given on the command line always take effect.
build:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGTOPK_WERROR=OFF $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGTOPK_WERROR=ON $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

bench: build
	mkdir -p bench/results
	$(BUILD_DIR)/bench/cpu_select_bench --results_json=bench/results/cpu_select.json
	$(BUILD_DIR)/bench/codec_bench --results_json=bench/results/codec.json
	$(BUILD_DIR)/bench/merge_bench --results_json=bench/results/merge.json
	$(BUILD_DIR)/bench/aggregation_bench --results_json=bench/results/aggregation.json

format:
	find common server worker tests bench -name '*.h' -o -name '*.cc' -o -name '*.cu' 2>/dev/null | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
