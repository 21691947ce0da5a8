#!/usr/bin/env bash
# Installs tandem's build and test dependencies from Debian 12 packages.
# Idempotent: quiet and fast (one dpkg query) when everything is present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libssl-dev libucx-dev libyaml-cpp-dev libboost-dev libopenblas-dev libxxhash-dev
  libsimdjson-dev rapidjson-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev libpcre2-dev libicu-dev
  python3 python3-numpy
  python3-jinja2  # chat_template_test's reference renderer (transformers' Jinja2 setup)
  dnsmasq-base  # router_dns_test's DNS server for discovery (A records added and removed)
  nginx  # bench_overhead.sh's reverse proxy, the baseline the router's overhead is compared with
  clang-14 libclang-rt-14-dev llvm-14  # make fuzz / make sanitize: libFuzzer, ASan+UBSan, llvm-cov
  clang-format-14  # make format / make format-check (.ci/run): the house format, .clang-format
  # tests/deploy/helmrender: `helm template` for the chart's tests, built in
  # GOPATH mode from Debian's Go sources (Sprig's -dev package pulls in its own).
  golang-go golang-github-masterminds-sprig-dev golang-github-xeipuuv-gojsonschema-dev
  golang-gopkg-yaml.v2-dev golang-gopkg-yaml.v3-dev
  python3-yaml  # tests/deploy/check_render.py reads the rendered manifests
  prometheus  # promtool checks the chart's alert rules (the server is not started)
  prometheus-cpp-dev  # common/metrics_bench: our registry against prometheus-cpp's core
  debootstrap  # make image-check: a Debian root with only the image's runtime packages
  chromium  # tests/dashboard: the router's /dashboard in a headless browser (playwright-core)
)
# The tokenizer tests fetch reference data with npm: Debian's Node.js unless
# one is installed already.
command -v npm >/dev/null || PACKAGES+=(nodejs npm)
# chart_test builds the kustomize overlays with kubectl's built-in kustomize:
# Debian's kubectl unless one is installed already.
command -v kubectl >/dev/null || PACKAGES+=(kubernetes-client)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# nginx's package would start a system web server on port 80 (prometheus's one
# on 9090); the benchmark
# runs its own from a generated config, so the service is kept from starting
# (policy-rc.d, as Debian's container images do) while installing.
if [[ " ${missing[*]} " =~ " "(nginx|prometheus)" " && ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
