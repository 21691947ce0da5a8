#!/usr/bin/env bash
# Runs the official `openai` npm client (client_test.mjs) and curl against a
# local cluster started with `tandem up`. Usage: run.sh TANDEM_BIN WORK_DIR [up flags...]
set -euo pipefail
bin=${1:?usage: run.sh TANDEM_BIN WORK_DIR [flags]}
work=${2:?}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
if [[ ! -d "$work/node_modules/openai" ]]; then
  (cd "$work" && { [[ -f package.json ]] || echo '{"name": "tandem-openai-client-test", "private": true}' > package.json; } &&
   npm install --no-audit --no-fund --loglevel=error openai@4.95.0)
fi
run_dir=$(mktemp -d /tmp/tandem-openai.XXXXXX)
"$bin" up --port 0 --ready-file "$run_dir/url" --run-dir "$run_dir" --worker-threads 1 "$@" &
up=$!
cleanup() { kill -TERM "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; rm -rf "$run_dir"; }
trap cleanup EXIT
for _ in $(seq 600); do
  [[ -s "$run_dir/url" ]] && break
  kill -0 "$up" 2>/dev/null || { echo "tandem up exited" >&2; exit 1; }
  sleep 0.1
done
url=$(cat "$run_dir/url")
model=$(sed -n 's/^  served_name: "\(.*\)"$/\1/p' "$run_dir/router.yaml")
echo "cluster at $url, model $model"
# ES modules resolve packages from the script's folder, not NODE_PATH.
cp "$here/client_test.mjs" "$work/client_test.mjs"
node "$work/client_test.mjs" "$url" "$model"
# curl: a streamed chat ends with [DONE]; a bad request is a 400 with an error object.
out=$(curl -sSN "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 4, \"stream\": true}")
grep -q '^data: {"id":"chatcmpl-' <<<"$out" || { echo "curl: no chunk: $out" >&2; exit 1; }
[[ $(tail -n 1 <<<"$out") == "data: [DONE]" ]] || { echo "curl: no [DONE]: $out" >&2; exit 1; }
code=$(curl -s -o "$run_dir/err" -w '%{http_code}' "$url/v1/completions" -H 'Content-Type: application/json' -d '{"model": 1}')
[[ $code == 400 ]] && grep -q '"error"' "$run_dir/err" || { echo "curl: bad request gave $code" >&2; exit 1; }
echo "curl: ok"
kill -TERM "$up"
wait "$up"
echo "tandem up: stopped cleanly"
trap - EXIT
rm -rf "$run_dir"
