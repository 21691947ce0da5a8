#!/usr/bin/env bash
# helmrender's tests: builds the tool (Go in GOPATH mode over Debian's
# sources) into WORKDIR, renders testdata/chart and compares the output with
# testdata/expected.yaml, then checks that each kind of failure exits 1 with a
# message naming what failed. Exits 77 (ctest's skip) when Go or the Go
# packages are missing; scripts/install_deps.sh installs them.
#
# Usage: helmrender_test.sh [WORKDIR]   (default: a temporary directory)
# HELMRENDER_GOPATH overrides the Go sources' root (default /usr/share/gocode).
# Set UPDATE_GOLDEN=1 to rewrite testdata/expected.yaml (then review the diff).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
gopath=${HELMRENDER_GOPATH:-/usr/share/gocode}
if ! command -v go >/dev/null; then
  echo "SKIP: no go binary (Debian: golang-go)"
  exit 77
fi
for pkg in github.com/Masterminds/sprig github.com/xeipuuv/gojsonschema gopkg.in/yaml.v2 gopkg.in/yaml.v3; do
  if [[ ! -d $gopath/src/$pkg ]]; then
    echo "SKIP: $gopath/src/$pkg is missing (scripts/install_deps.sh installs it)"
    exit 77
  fi
done

work=${1:-}
if [[ -z $work ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
work=$(cd "$work" && pwd)
bin=$work/helmrender
# The build cache lives in WORKDIR: the source tree stays clean and HOME need
# not be writable.
(cd "$here" && GO111MODULE=off GOPATH=$gopath GOFLAGS= GOCACHE=$work/gocache \
  nice go build -o "$bin" .)

data=$here/testdata
chart=$data/chart
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# expect_error NAME PATTERN ARGS...: helmrender exits 1 and stderr matches
# the extended regex PATTERN.
expect_error() {
  local name=$1 pattern=$2 rc=0
  shift 2
  "$bin" "$@" >"$work/out" 2>"$work/err" || rc=$?
  if [[ $rc -ne 1 ]]; then
    fail "$name: exit $rc, want 1"
  elif ! grep -Eq -- "$pattern" "$work/err"; then
    fail "$name: stderr does not match /$pattern/: $(cat "$work/err")"
  else
    echo "ok: $name"
  fi
}

# The golden file: every feature of the test chart, with a user's values file
# that deletes keys with null, --set, and the Prometheus Operator's API.
golden_args=(--chart "$chart" -f "$data/override.yaml" --set replicaCount=3
             --api-versions monitoring.coreos.com/v1 --release tandem)
"$bin" "${golden_args[@]}" --output "$work/golden.yaml"
if [[ ${UPDATE_GOLDEN:-} == 1 ]]; then
  cp "$work/golden.yaml" "$data/expected.yaml"
fi
if diff -u "$data/expected.yaml" "$work/golden.yaml"; then
  echo "ok: golden output"
else
  fail "golden output differs from testdata/expected.yaml (diff above)"
fi

# Rendering is deterministic (Go map order must not leak into the output).
"$bin" "${golden_args[@]}" >"$work/again.yaml"
cmp -s "$work/golden.yaml" "$work/again.yaml" && echo "ok: deterministic" || fail "two renders differ"

# --validate-yaml accepts the chart.
"$bin" "${golden_args[@]}" --validate-yaml >/dev/null && echo "ok: --validate-yaml on the chart" ||
  fail "--validate-yaml rejects the test chart"

# Without the monitoring.coreos.com/v1 API there is no ServiceMonitor.
"$bin" --chart "$chart" -f "$data/override.yaml" >"$work/out"
if grep -q 'kind: ServiceMonitor' "$work/out"; then
  fail "ServiceMonitor rendered without monitoring.coreos.com/v1"
else
  echo "ok: Capabilities.APIVersions.Has"
fi

# A later -f file's null deletes a key an earlier one set; --set null too.
"$bin" --chart "$chart" -f "$data/override.yaml" -f "$data/override2.yaml" \
  --set env.LOG_LEVEL=null --show-only templates/deployment.yaml >"$work/out"
if grep -Eq 'name: (MODE|LOG_LEVEL)$' "$work/out"; then
  fail "null in a later values file or --set did not delete the key"
elif [[ $(grep -c '^# Source:' "$work/out") -ne 1 ]]; then
  fail "--show-only printed $(grep -c '^# Source:' "$work/out") templates, want 1"
else
  echo "ok: null deletes, --show-only"
fi

# NOTES.txt only with --notes, last.
"$bin" "${golden_args[@]}" --notes | tail -1 | grep -qx 'tandem-demo is installed.' &&
  echo "ok: --notes" || fail "--notes did not print NOTES.txt last"

# Failures.
expect_error "required value missing" \
  '^helmrender: execution error at \(demo/templates/secret\.yaml:7:[0-9]+\): apiKey is required' \
  --chart "$chart"
expect_error "schema: wrong type" '^- replicaCount: Invalid type\. Expected: integer, given: string' \
  --chart "$chart" -f "$data/override.yaml" --set replicaCount=two
expect_error "schema: every violation listed" \
  'image\.repository: String length must be greater than or equal to 1' \
  --chart "$chart" -f "$data/override.yaml" --set replicaCount=0 --set image.repository=
grep -q '^- replicaCount: Must be greater than or equal to 1' "$work/err" ||
  fail "schema: the replicaCount violation is not listed with the other one: $(cat "$work/err")"

broken=$work/broken
rm -rf "$broken"
cp -r "$chart" "$broken"
printf 'a: 1\nb: {{ .Values.apiKey\n' >"$broken/templates/zz_broken.yaml"
expect_error "template syntax error" \
  '^helmrender: parse error at \(demo/templates/zz_broken\.yaml:[23]\): unclosed action' \
  --chart "$broken" -f "$data/override.yaml"
printf 'a: 1\nb: {{ nosuchfunc .Values.apiKey }}\n' >"$broken/templates/zz_broken.yaml"
expect_error "unknown function" \
  '^helmrender: parse error at \(demo/templates/zz_broken\.yaml:2\): function "nosuchfunc" not defined' \
  --chart "$broken" -f "$data/override.yaml"
printf '{{ define "demo.bad" }}{{ fail "bad helper" }}{{ end }}' >"$broken/templates/_bad.tpl"
printf 'a: {{ include "demo.bad" . }}\n' >"$broken/templates/zz_broken.yaml"
expect_error "fail inside an included helper names the helper" \
  '^helmrender: execution error at \(demo/templates/_bad\.tpl:1:[0-9]+\): bad helper' \
  --chart "$broken" -f "$data/override.yaml"
rm "$broken/templates/_bad.tpl"
printf 'a: [1,\n' >"$broken/templates/zz_broken.yaml"
expect_error "rendered output is not YAML" '^helmrender: YAML parse error on demo/templates/zz_broken\.yaml' \
  --chart "$broken" -f "$data/override.yaml"
printf 'apiVersion: v1\nmetadata:\n  name: x\n' >"$broken/templates/zz_broken.yaml"
expect_error "--validate-yaml: no kind" '^helmrender: demo/templates/zz_broken\.yaml \(document 1\): no kind' \
  --chart "$broken" -f "$data/override.yaml" --validate-yaml
expect_error "--show-only matches nothing" 'could not find template templates/nope\.yaml' \
  --chart "$chart" -f "$data/override.yaml" --show-only templates/nope.yaml

if ((failures > 0)); then
  echo "helmrender_test: $failures check(s) failed"
  exit 1
fi
echo "helmrender_test: all checks passed"
