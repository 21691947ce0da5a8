// libFuzzer target: loading a tokenizer.json (the router reads one at start
// and on reload), then using what loaded. An input is the file's text,
// optionally followed by a NUL byte and a text to encode and decode (its
// first kMaxText bytes: long texts are tokenizer_encode_fuzzer's work, and
// here they made encoding, not loading, three quarters of every execution).
// A file that does not load must be InvalidArgument. Seeds: small byte-level
// (Llama 3 / Qwen style regexes) and SentencePiece-style (byte fallback,
// Metaspace) tokenizers in testdata/tokenizer_json_fuzzer.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "orchestrator/tokenizer/tokenizer.h"
#include "orchestrator/tokenizer/tokenizer_fuzz_util.h"

constexpr size_t kMaxText = 1024;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tandem::router::Tokenizer;
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view text = "Hello, world! 123 <s>\xC3\xA9 \xF0\x9F\x98\x80  end";
  if (const size_t nul = input.find('\0'); nul != std::string_view::npos) {
    text = input.substr(nul + 1, kMaxText);
    input = input.substr(0, nul);
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromJson(input);
  if (!tok.ok()) {
    if (tok.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "a refusal that is not InvalidArgument: %s\n", tok.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  tandem::router::fuzz::CheckEncode(**tok, text, /*add_special=*/true, /*skip_special=*/false);
  tandem::router::fuzz::CheckEncode(**tok, text, /*add_special=*/false, /*skip_special=*/true);
  return 0;
}
