// libFuzzer target: encoding client text and decoding worker ids with real
// tokenizers, as every request does. The tokenizers are loaded once: the
// seed files of tokenizer_json_fuzzer (built into the path below) and any
// tokenizer.json listed in $TANDEM_FUZZ_TOKENIZERS (colon-separated, e.g. the
// Llama 3 and Qwen3 files the tokenizer tests fetch). An input's first byte
// picks the tokenizer and the special-token flags; the rest is the text to
// encode, and also read as 16-bit ids to decode (ids past the vocabulary
// included: Decode skips them).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_split.h"
#include "orchestrator/tokenizer/tokenizer.h"
#include "orchestrator/tokenizer/tokenizer_fuzz_util.h"

namespace tandem::router {
namespace {

std::unique_ptr<Tokenizer> Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  if (const size_t nul = text.find('\0'); nul != std::string::npos) text.resize(nul);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromJson(text);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s does not load: %s\n", path.c_str(), tok.status().ToString().c_str());
    std::abort();
  }
  return *std::move(tok);
}

std::vector<std::unique_ptr<Tokenizer>>* LoadAll() {
  auto* all = new std::vector<std::unique_ptr<Tokenizer>>();
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(TANDEM_TOKENIZER_FUZZ_SEEDS)) {
    if (entry.path().extension() == ".json") paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  if (const char* extra = std::getenv("TANDEM_FUZZ_TOKENIZERS"); extra != nullptr) {
    for (absl::string_view p : absl::StrSplit(extra, ':', absl::SkipEmpty())) paths.emplace_back(p);
  }
  for (const std::string& path : paths) {
    all->push_back(Load(path));
    std::fprintf(stderr, "tokenizer %zu: %s\n", all->size() - 1, path.c_str());
  }
  if (all->empty()) std::abort();
  return all;
}

const std::vector<std::unique_ptr<Tokenizer>>& Tokenizers() {
  static const auto* const all = LoadAll();
  return *all;
}

}  // namespace
}  // namespace tandem::router

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tandem::router::Tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& all = tandem::router::Tokenizers();
  const tandem::router::Tokenizer& tok = *all[(data[0] >> 2) % all.size()];
  const bool add_special = data[0] & 1;
  const bool skip_special = data[0] & 2;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  tandem::router::fuzz::CheckEncode(tok, text, add_special, skip_special);
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    ids.push_back(static_cast<int32_t>(static_cast<uint8_t>(text[i]) | (static_cast<uint8_t>(text[i + 1]) << 8)) %
                  (tok.vocab_size() + 16));
  }
  tandem::router::fuzz::CheckDecode(tok, ids, skip_special);
  return 0;
}
