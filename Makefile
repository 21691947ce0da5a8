# tandem: `make run` and `make test` are the two set-up commands on a fresh Debian 12 machine.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
PORT ?= 8000

.PHONY: deps configure build run test asan fuzz fuzz-build sanitize bench soak deploy-test deploy-base image-check clean \
  format format-check

deps:
	@scripts/install_deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Starts a local cluster (router on 127.0.0.1:$(PORT), a prefill and a decode worker) on the built-in model.
run: build
	scripts/run_local.sh $(BUILD_DIR)/tandem $(PORT)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600 || \
	  { cd $(CURDIR) && scripts/show_failed_tests.sh $(BUILD_DIR); exit 1; }

# The house format (.clang-format, clang-format 14): `make format` rewrites the C++ and CUDA
# sources, `make format-check` fails on one that differs (.ci/run runs it first).
format:
	scripts/format.sh

format-check:
	scripts/format.sh --check

# The whole suite again under AddressSanitizer and UBSan, in its own build directory (UCX
# and CUDA off: their libraries are not instrumented). Not part of `make test`: the
# instrumented build takes several times as long on a small machine.
asan:
	$(MAKE) test BUILD_DIR=build-asan CMAKE_FLAGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTANDEM_SANITIZE=address,undefined -DTANDEM_WITH_UCX=OFF -DTANDEM_CUDA=OFF"

# libFuzzer targets (clang-14, ASan+UBSan, in $(FUZZ_DIR)): `make fuzz` builds only the fuzzers and
# the libraries they need, then runs each for FUZZ_SECONDS on its seed corpus (the new inputs it
# finds stay in $(FUZZ_DIR)/fuzz/corpus); a crash fails it and leaves the reproducer in
# $(FUZZ_DIR)/fuzz/artifacts.
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_CMAKE_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" -DTANDEM_FUZZ=ON -DTANDEM_BUILD_TESTS=OFF \
  -DTANDEM_SANITIZE=address,undefined -DTANDEM_CUDA=OFF

$(FUZZ_DIR)/build.ninja:
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_DIR) -G Ninja $(FUZZ_CMAKE_FLAGS)

fuzz-build: deps $(FUZZ_DIR)/build.ninja
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target fuzzers

fuzz: fuzz-build
	scripts/run_fuzzers.sh $(FUZZ_DIR) $(FUZZ_SECONDS)

# CI's sanitizer stage: the whole suite under ASan+UBSan with UCX on (gcc: clang-14 cannot
# compile the load generator's coroutines against Debian's libstdc++/Boost), at -O1 in
# build-asan-ucx, then `make fuzz`. UCX needs no suppression under ASan (scripts/run_sanitized_tests.sh).
SANITIZE_DIR ?= build-asan-ucx
sanitize:
	$(MAKE) build BUILD_DIR=$(SANITIZE_DIR) CMAKE_FLAGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 \
	  -DTANDEM_SANITIZE=address,undefined -DTANDEM_WITH_UCX=ON -DTANDEM_CUDA=OFF"
	scripts/run_sanitized_tests.sh $(SANITIZE_DIR) $(JOBS)
	$(MAKE) fuzz

# Quick benchmarks (a few minutes): routing quality on simulated workers, the router's overhead
# against nginx and the KV index at scale, with one ratio table; then the engine.
bench: build
	scripts/bench_quick.sh $(BUILD_DIR)
	$(BUILD_DIR)/tandem bench engine --model builtin:small

# A long run under steady streaming load on a 2P2D cluster (SOAK_SECONDS, default 1800): fails
# on a failed request, or when RSS, open fds or KV blocks do not stay flat (scripts/soak.sh).
soak: build
	scripts/soak.sh $(BUILD_DIR)/tandem $(SOAK_DIR)

# The Helm chart and kustomize manifests (also part of `make test`): rendered with each ci/ values
# file, validated against the Kubernetes schemas, the router's YAML checked (tests/deploy/chart_test.sh).
deploy-test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -R '^(helmrender_test|chart_test)$$'

# Regenerates deploy/kustomize/base/tandem.yaml from the chart (chart_test fails when it differs).
deploy-base: build
	deploy/kustomize/render_base.sh $(BUILD_DIR)/tests/helmrender/helmrender > deploy/kustomize/base/tandem.yaml

# The image's runtime package list is complete: a Debian 12 root with only those packages runs a
# cluster and answers a request (scripts/image_check.sh; root and Debian's mirror; ~6 min cold).
image-check: build
	scripts/image_check.sh $(BUILD_DIR)/tandem || [ $$? -eq 77 ]  # 77: skipped (not root, no debootstrap)

clean:
	rm -rf $(BUILD_DIR)
