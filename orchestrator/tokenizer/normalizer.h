// The "normalizer" step of a tokenizer.json: Unicode normalization applied to
// text before pre-tokenization (Qwen2/3 use NFC; Llama 3 and GPT-2 none).
// Supported: null, NFC, NFKC, NFD, NFKD (through ICU), and a Sequence of
// those. Later: Prepend/Replace for SentencePiece-style models.
// Contract: Create names the JSON path of an unsupported normalizer.
// Normalize requires valid UTF-8 and returns valid UTF-8.
// Thread safety: immutable after Create; Normalize is safe concurrently.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace tandem::router {

class Normalizer {
 public:
  enum class Form { kNfc, kNfkc, kNfd, kNfkd };

  // `config` is the tokenizer.json "normalizer" value (may be null).
  static absl::StatusOr<Normalizer> Create(const nlohmann::json& config);

  bool is_identity() const { return forms_.empty(); }
  // Replaces `*text` with its normalized form.
  void Normalize(std::string* text) const;

 private:
  std::vector<Form> forms_;  // applied in order
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_NORMALIZER_H_
