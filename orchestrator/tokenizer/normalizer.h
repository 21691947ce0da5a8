// The "normalizer" step of a tokenizer.json: rewrites text before
// pre-tokenization (Qwen2/3 use NFC; Llama 3 and GPT-2 none; Llama 2 and
// Mistral v0.1 prepend "▁" and replace " " with "▁", SentencePiece style).
// Supported, applied in order: NFC, NFKC, NFD, NFKD (through ICU);
//   Prepend {prepend} (prepended to non-empty text only, as in `tokenizers`);
//   Replace {pattern: {String|Regex}, content} (every non-overlapping match,
//     left to right; regexes on PCRE2);
//   and a Sequence of those; null is the identity.
// Contract: Create names the JSON path of an unsupported normalizer or of a
// regex PCRE2 rejects. Normalize requires valid UTF-8 and returns valid UTF-8.
// Thread safety: immutable after Create; Normalize is safe concurrently.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_

#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "orchestrator/tokenizer/pre_tokenizer.h"

namespace tandem::router {

class Normalizer {
 public:
  enum class Form { kNfc, kNfkc, kNfd, kNfkd };
  struct Prepend {
    std::string prefix;
  };
  struct Replace {
    Regex pattern;
    std::string content;
  };
  using Step = std::variant<Form, Prepend, Replace>;

  // `config` is the tokenizer.json "normalizer" value (may be null).
  static absl::StatusOr<Normalizer> Create(const nlohmann::json& config);

  bool is_identity() const { return steps_.empty(); }
  // Replaces `*text` with its normalized form.
  void Normalize(std::string* text) const;

 private:
  std::vector<Step> steps_;  // applied in order
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_
