// The "pre_tokenizer" step of a tokenizer.json: splits normalized text into
// words that the model tokenizes independently, and maps them into the
// model's alphabet. Supported steps, applied in order to every piece:
//   Split {pattern: {Regex|String}, behavior: Isolated|Removed, invert: false}
//     (regexes run on PCRE2 with PCRE2_UTF|PCRE2_UCP, which accepts the
//     Llama 3 / Qwen / GPT-2 patterns: \p{L}, (?i:...), \s+(?!\S));
//   ByteLevel {add_prefix_space, use_regex} (GPT-2 regex, then bytes to the
//     byte-level alphabet);
//   Metaspace {replacement, prepend_scheme: always|first|never, split}
//     (SentencePiece style: " " becomes the replacement, e.g. "▁", which is
//     prepended to the first piece of the text (first) or of every text
//     between added tokens (always) unless already there; with split, each
//     run of replacements starts a new word, as `tokenizers` does with
//     MergedWithNext; files that predate prepend_scheme say add_prefix_space);
//   Sequence of the above. Later: Digits, Punctuation.
// Contract: Create names the JSON path of anything unsupported and of a
// regex PCRE2 rejects. Split requires valid UTF-8 input.
// Thread safety: immutable after Create; PreTokenize is safe concurrently
// (compiled patterns are shared read-only, match data is per call).
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_PRE_TOKENIZER_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_PRE_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {

// A compiled PCRE2 pattern (JIT-compiled where available).
class Regex {
 public:
  // `literal`: match `pattern` as plain text.
  static absl::StatusOr<Regex> Compile(const std::string& pattern, bool literal);
  // Calls fn(begin, end) for each non-overlapping match in `text`, left to
  // right; empty matches are skipped.
  template <typename Fn>
  void ForEachMatch(std::string_view text, Fn fn) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  // Finds the next match at or after `start`; false when there is none.
  bool Next(std::string_view text, size_t start, void* match_data, size_t* begin, size_t* end) const;
  void* NewMatchData() const;
  static void FreeMatchData(void* md);
};

class PreTokenizer {
 public:
  // `config` is the tokenizer.json "pre_tokenizer" value (may be null).
  static absl::StatusOr<PreTokenizer> Create(const nlohmann::json& config);

  // Appends the words of `text` to `words`. `at_text_start`: `text` begins
  // the whole input (no added token before it); Metaspace's "first" scheme
  // prepends only there.
  void PreTokenize(std::string_view text, bool at_text_start, std::vector<std::string>* words) const;

  // True when a ByteLevel step maps words into the byte-level alphabet.
  bool byte_level() const { return byte_level_; }

 private:
  struct SplitStep {
    Regex regex;
    bool remove_matches;  // behavior Removed; otherwise Isolated
  };
  struct ByteLevelStep {
    bool add_prefix_space;
    std::shared_ptr<const Regex> regex;  // GPT-2 regex when use_regex
  };
  struct MetaspaceStep {
    std::string replacement;  // one character, UTF-8
    PrependScheme prepend;
    bool split;
  };
  using Step = std::variant<SplitStep, ByteLevelStep, MetaspaceStep>;

  static absl::Status AddSteps(const nlohmann::json& config, const std::string& path, PreTokenizer* out);

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

template <typename Fn>
void Regex::ForEachMatch(std::string_view text, Fn fn) const {
  void* md = NewMatchData();
  size_t pos = 0, begin = 0, end = 0;
  while (pos <= text.size() && Next(text, pos, md, &begin, &end)) {
    if (end > begin) {
      fn(begin, end);
      pos = end;
    } else {
      pos = end + 1;  // empty match: step past it (one byte is fine, see Next)
    }
  }
  FreeMatchData(md);
}

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_PRE_TOKENIZER_H_
