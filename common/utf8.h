// UTF-8 helpers: walking code points and repairing invalid byte sequences
// (the tokenizer, the detokenizer, JSON output). Tokens of a byte-level BPE vocabulary are arbitrary
// byte strings, so decoded text is only valid UTF-8 once the bytes of a whole
// character have arrived; these helpers find that boundary.
// Contract: invalid input is never an error; each maximal invalid subpart
// becomes U+FFFD, as Unicode's "best practice" (and Python's / Rust's lossy
// decoders) do. Pure functions, thread-safe.
#ifndef TANDEM_COMMON_UTF8_H_
#define TANDEM_COMMON_UTF8_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace tandem {

inline constexpr std::string_view kUtf8Replacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the valid UTF-8 sequence at the start of `s`: 1..4, 0 when the
// bytes there are invalid, or -1 when they are a valid but incomplete prefix
// (more bytes could make it a character). REQUIRES: !s.empty().
int Utf8SequenceLength(std::string_view s);

// Appends to `out` the valid UTF-8 text of `in`, with invalid parts replaced
// by U+FFFD. When `final` is false an incomplete character at the end is left
// unconsumed; returns the number of bytes of `in` consumed.
size_t AppendValidUtf8(std::string_view in, bool final, std::string* out);

// True when `s` is entirely valid UTF-8.
bool IsValidUtf8(std::string_view s);

}  // namespace tandem

#endif  // TANDEM_COMMON_UTF8_H_
