// What the two tokenizer fuzz targets check on a loaded tokenizer: encoding
// and decoding never crash, every id Encode returns is in the vocabulary,
// and IncrementalDetokenizer's stream equals Decode() wherever the contract
// says so (the decoded text holds no U+FFFD, which is where a ByteFallback
// decoder may legitimately differ). Aborts on a violation. Fuzz builds only.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_FUZZ_UTIL_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_FUZZ_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "orchestrator/tokenizer/tokenizer.h"

namespace tandem::router::fuzz {

inline void CheckDecode(const Tokenizer& tok, std::span<const int32_t> ids, bool skip_special) {
  const std::string text = tok.Decode(ids, skip_special);
  IncrementalDetokenizer detok(tok, skip_special);
  std::string streamed;
  for (int32_t id : ids) streamed += detok.Add(id);
  streamed += detok.Flush();
  if (text.find("\xEF\xBF\xBD") == std::string::npos && streamed != text) {
    std::fprintf(stderr, "streamed decode \"%s\" differs from Decode \"%s\"\n", streamed.c_str(), text.c_str());
    std::abort();
  }
}

inline void CheckEncode(const Tokenizer& tok, std::string_view text, bool add_special, bool skip_special) {
  const std::vector<int32_t> ids = tok.Encode(text, add_special);
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) {
      std::fprintf(stderr, "Encode returned id %d outside [0, %d)\n", id, tok.vocab_size());
      std::abort();
    }
    (void)tok.IdToToken(id);
    (void)tok.IsSpecial(id);
  }
  CheckDecode(tok, ids, skip_special);
}

}  // namespace tandem::router::fuzz

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_FUZZ_UTIL_H_
