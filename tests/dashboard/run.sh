#!/usr/bin/env bash
# The router's /dashboard in a real browser: Debian's chromium, headless,
# driven by playwright-core (npm, pinned), against a `tandem up` cluster
# (one prefill and two decode workers; an API key, so the page is behind an
# admin key). dashboard_test.mjs checks what the page shows against the
# cluster: the pools, every worker healthy with its load, the policy, the
# recent decisions of requests sent here; that it loads nothing from
# anywhere else; and that without the key it is a 401.
# Usage: run.sh TANDEM_BIN WORK_DIR. Exits 77 (skipped) without node, npm or chromium.
set -euo pipefail
bin=${1:?usage: run.sh TANDEM_BIN WORK_DIR}
work=${2:?}
here=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 77; }
chromium=$(command -v chromium || command -v chromium-browser || true)
[[ -n $chromium ]] || { echo "SKIP: chromium is not installed"; exit 77; }
mkdir -p "$work"
if [[ ! -d "$work/node_modules/playwright-core" ]]; then
  (cd "$work" && { [[ -f package.json ]] || echo '{"name": "tandem-dashboard-test", "private": true}' > package.json; } &&
   npm install --no-audit --no-fund --loglevel=error playwright-core@1.49.1) ||
    { echo "SKIP: npm could not install playwright-core"; exit 77; }
fi
run_dir=$(mktemp -d /tmp/tandem-dashboard.XXXXXX)
key=dashboard-test-admin-key
"$bin" up --port 0 --ready-file "$run_dir/url" --run-dir "$run_dir" --worker-threads 1 --decode 2 \
  --api-key "$key" >"$run_dir/up.log" 2>&1 &
up=$!
cleanup() { kill -TERM "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; rm -rf "$run_dir"; }
trap cleanup EXIT
for _ in $(seq 600); do
  [[ -s "$run_dir/url" ]] && break
  kill -0 "$up" 2>/dev/null || { echo "tandem up exited"; tail "$run_dir/up.log"; exit 1; }
  sleep 0.1
done
url=$(cat "$run_dir/url")
model=$(sed -n 's/^  served_name: "\(.*\)"$/\1/p' "$run_dir/router.yaml")
# Requests to list: their ids come back in x-request-id.
: >"$run_dir/ids"
for i in 1 2 3 4 5; do
  curl -sS -D "$run_dir/h" -o /dev/null "$url/v1/completions" -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"dashboard request $i with some words in it\", \"max_tokens\": 3}"
  sed -n 's/^x-request-id: *\([0-9a-f]*\).*/\1/ip' "$run_dir/h" >>"$run_dir/ids"
done
[[ $(wc -l <"$run_dir/ids") == 5 ]] || { echo "FAIL: no request ids"; exit 1; }
cp "$here/dashboard_test.mjs" "$work/dashboard_test.mjs"
node "$work/dashboard_test.mjs" "$chromium" "$url" "$key" "$run_dir/ids"
