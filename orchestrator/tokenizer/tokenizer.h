// The router's tokenizer: loads a Hugging Face tokenizer.json and encodes text
// to token ids and back, bit-for-bit as the `tokenizers` library does, so the
// router can count tokens, match KV-cache prefixes and detokenize streams.
//
// Encode pipeline: added tokens (special or not) are matched first on the raw
// text, longest first, leftmost first; the text between them is normalized,
// pre-tokenized into words, and each word is run through the model; then,
// with add_special_tokens, the post-processor's template adds e.g. Llama 3's
// <|begin_of_text|>. Supported today: model BPE, both byte-level (GPT-2,
// Llama 3, Qwen2/3) and SentencePiece-style with byte_fallback (Llama 2,
// Mistral v0.1: Prepend/Replace normalizers or a Metaspace pre-tokenizer,
// and a Replace/ByteFallback/Fuse/Strip or Metaspace decoder); see
// normalizer.h, pre_tokenizer.h, bpe_model.h and decoder.h for each step.
// Added tokens must not use lstrip/rstrip/single_word, nor normalized: true
// when there is a normalizer (no supported file does). Chat templates fit in
// as a further step of the same pipeline.
//
// Contract: FromJson/FromFile validate everything up front; anything
// unsupported is an InvalidArgument naming its JSON path, never a silent
// mis-tokenization. Encode never fails: invalid UTF-8 input is first repaired
// (U+FFFD). Decode never fails either: unknown ids are skipped and bytes that
// are not valid UTF-8 become U+FFFD (with a ByteFallback decoder, as in HF,
// an invalid run of <0xXX> tokens becomes one U+FFFD per token). Decode does
// not apply transformers' clean_up_tokenization_spaces (a Python-side
// option, not tokenizer.json).
//
// Thread safety: a Tokenizer is immutable after construction except for the
// BPE word cache, which is internally synchronized; Encode, Decode and all
// accessors are safe to call concurrently. IncrementalDetokenizer is one per
// stream and not thread-safe.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "orchestrator/tokenizer/bpe_model.h"
#include "orchestrator/tokenizer/decoder.h"
#include "orchestrator/tokenizer/normalizer.h"
#include "orchestrator/tokenizer/pre_tokenizer.h"

namespace tandem::router {

class Tokenizer {
 public:
  // Reads and parses a tokenizer.json file. NotFound when it cannot be read.
  // With `json`, the file's text is left there too (e.g. to fingerprint it
  // without reading the file again).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& tokenizer_json_path,
                                                             std::string* json = nullptr);
  // Parses the contents of a tokenizer.json file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const;

  // Plain-text spans inside text that also holds control tokens (a chat
  // template rendered over a user's messages). EscapeSpecialTokens marks
  // every special token that `text` spells (as Encode would match it) with
  // kEscapeMark after each of its characters but the last, so no added token
  // matches there, and doubles any kEscapeMark already in `text`.
  // EncodeEscaped is Encode for text holding such spans: added tokens are
  // matched first, as always, and the escaped spans are not matched; then
  // every text segment loses its single marks (a doubled one becomes one)
  // before it is normalized and tokenized. So an escaped "<|eot_id|>" is
  // tokenized as the seven characters it is, while the template's own
  // unescaped special tokens stay control tokens. A template that cuts
  // through an escaped span (slicing content by characters) can leave a
  // mark split from its pair; it is dropped, never a control token.
  static constexpr std::string_view kEscapeMark = "\xEF\xB7\x90";  // U+FDD0, a noncharacter
  std::string EscapeSpecialTokens(std::string_view text) const;
  std::vector<int32_t> EncodeEscaped(std::string_view text, bool add_special_tokens) const;

  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Appends the raw bytes that `id` contributes to decoded text (possibly a
  // fragment of a UTF-8 character); nothing for unknown ids, or for special
  // tokens when `skip_special_tokens`. The building block of Decode and of
  // IncrementalDetokenizer. With a SentencePiece-style decoder these are the
  // bytes of a token that does not start the text: the start of a text may
  // lose a leading space (Strip, Metaspace), which IncrementalDetokenizer
  // handles.
  void AppendTokenBytes(int32_t id, bool skip_special_tokens, std::string* out) const;

  // One past the largest id of the vocabulary and the added tokens (what
  // `tokenizers` calls get_vocab_size(with_added_tokens=true) for dense ids).
  int vocab_size() const { return static_cast<int>(id_to_token_.size()); }
  // Looks up a vocabulary or added token by its exact string.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token string of `id` as written in tokenizer.json; nullopt if unknown.
  std::optional<std::string> IdToToken(int32_t id) const;
  // True for added tokens marked "special" (skipped by skip_special_tokens).
  bool IsSpecial(int32_t id) const;

 private:
  struct AddedToken {
    std::string content;
    int32_t id;
    bool special;
  };
  // Byte trie over the added tokens' contents, for longest-first matching.
  struct TrieNode {
    absl::flat_hash_map<unsigned char, int32_t> children;
    int32_t added_index = -1;  // index into added_ of the token ending here
  };

  Tokenizer() = default;
  absl::Status Load(std::string_view json_text);
  // Finds the longest added token starting at text[pos]; its length, or 0.
  size_t MatchAddedToken(std::string_view text, size_t pos, int32_t* id) const;
  // Normalizes, pre-tokenizes and tokenizes text that holds no added token;
  // `at_text_start`: the segment begins the input.
  void EncodeSegment(std::string_view segment, bool at_text_start, std::vector<int32_t>* ids) const;
  // Encode, or EncodeEscaped when `escaped`.
  std::vector<int32_t> EncodeImpl(std::string_view text, bool add_special_tokens, bool escaped) const;
  // True when `id` has a token that Decode passes to the decoder.
  bool Decodes(int32_t id, bool skip_special_tokens) const;

  friend class IncrementalDetokenizer;

  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::vector<AddedToken> added_;
  std::vector<TrieNode> trie_;  // trie_[0] is the root
  absl::flat_hash_map<std::string, int32_t> added_ids_;
  std::vector<int32_t> prefix_ids_;  // post-processor template before the text
  std::vector<int32_t> suffix_ids_;  // and after it
  std::vector<std::string> id_to_token_;
  std::vector<std::string> id_to_bytes_;  // what each id decodes to
  // SentencePiece-style decoders only (GPT-2-style ones use ByteLevelDecode).
  std::optional<Decoder> decoder_;
  // What each id decodes to as the first token; empty unless it differs.
  std::vector<std::string> id_to_first_bytes_;
  std::vector<bool> special_;
};

// Turns a stream of ids into text, emitting only complete UTF-8 characters:
// a character whose bytes span several tokens comes out with its last byte.
// Usage: for each id, out += d.Add(id); at the end, out += d.Flush().
// The concatenated output equals Decode() of all the ids, except that with a
// ByteFallback decoder an invalid run of <0xXX> tokens yields its complete
// characters and one U+FFFD per invalid part (Decode, as HF: one U+FFFD per
// token of the run; it cannot be known before the run ends). REQUIRES: the
// Tokenizer outlives this object. Not thread-safe; one per stream.
class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  // Returns the text completed by `id` (often empty mid-character).
  std::string Add(int32_t id);
  // Returns what is left: an incomplete trailing character becomes U+FFFD.
  std::string Flush();

 private:
  // Removes what the decoder strips from the start of the text.
  void StripStart(std::string* out);

  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of an incomplete character, at most 3
  bool first_ = true;    // no token decoded yet
  size_t strip_left_;    // leading characters still to strip (Strip decoder)
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_TOKENIZER_H_
