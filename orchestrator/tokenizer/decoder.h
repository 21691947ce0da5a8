// The "decoder" step of a tokenizer.json for SentencePiece-style files
// (Llama 2, Mistral): turns the token strings of a Decode back into text.
// Supported steps, alone or in a Sequence, with the semantics of the Rust
// `tokenizers` crate's decode_chain:
//   Replace {pattern: {String}, content}  in every token (e.g. "▁" -> " ");
//   ByteFallback  runs of "<0xXX>" tokens become the UTF-8 text of their
//     bytes, or one U+FFFD per token when the run is not valid UTF-8;
//   Fuse  joins all tokens into one;
//   Strip {content, start, stop}  removes up to `start` leading and `stop`
//     trailing `content` characters from every token (after Fuse: from the
//     whole text; there only start is supported);
//   Metaspace {replacement, prepend_scheme}  replacement -> " ", except that
//     in the first token it is dropped unless the scheme is "never".
// (The byte-level decoder of GPT-2-style files is ByteLevelDecode, in
// byte_level.h.) After Fuse only Strip may follow, so that a stream can be
// decoded token by token: TokenBytes gives what one token contributes and
// stream_strip() what to remove from the start of the whole text.
// Contract: Create names the JSON path of anything unsupported. Decode is
// exact for any token list; for ids of valid text, concatenating TokenBytes
// (first = true for the first token) and then stripping the stream start
// gives the same text.
// Thread safety: immutable after Create; all methods are safe concurrently.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_DECODER_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_DECODER_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace tandem::router {

class Decoder {
 public:
  // `config` is the tokenizer.json "decoder" value; REQUIRES: not null and
  // not of type ByteLevel (the caller handles those).
  static absl::StatusOr<Decoder> Create(const nlohmann::json& config);

  // The decoded text of `tokens` (the token strings, special tokens included
  // unless skipped), exactly as `tokenizers` decodes them.
  std::string Decode(std::vector<std::string> tokens) const;

  // The bytes that `token` contributes to a streamed text when it is (first)
  // or is not the first token: ByteFallback tokens give their raw byte,
  // which may be part of a UTF-8 character.
  std::string TokenBytes(std::string_view token, bool first) const;
  // True when a token's bytes depend on whether it comes first (Metaspace).
  bool first_token_differs() const { return first_token_differs_; }

  // What to remove from the start of the whole streamed text: up to `count`
  // leading `content` characters (Strip after Fuse).
  struct StreamStrip {
    std::string content;
    size_t count = 0;
  };
  const StreamStrip& stream_strip() const { return stream_strip_; }

 private:
  struct Replace {
    std::string pattern;
    std::string content;
  };
  struct ByteFallback {};
  struct Fuse {};
  struct Strip {
    std::string content;  // one character
    size_t start;
    size_t stop;
  };
  struct Metaspace {
    std::string replacement;  // one character
    bool drop_in_first;       // prepend_scheme is not "never"
  };
  using Step = std::variant<Replace, ByteFallback, Fuse, Strip, Metaspace>;

  static absl::Status AddSteps(const nlohmann::json& config, const std::string& path, Decoder* out);

  std::vector<Step> steps_;  // up to the Fuse, if any
  bool first_token_differs_ = false;
  bool fused_ = false;
  StreamStrip stream_strip_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_DECODER_H_
