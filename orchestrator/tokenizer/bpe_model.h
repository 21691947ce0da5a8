// The BPE model of a Hugging Face tokenizer.json ("model": {"type": "BPE"}):
// turns one pre-tokenized word into token ids by applying the ranked merges,
// lowest rank first and leftmost first among equal ranks (as the Rust
// `tokenizers` crate's word.rs does). With `ignore_merges` (Llama 3) a word
// that is itself in the vocabulary becomes that one token without merging.
// Contract: Create validates the whole model section and names the JSON path
// of anything unsupported (dropout, affixes, ...). A character absent from
// the vocabulary becomes, as in the Rust crate: with `byte_fallback`
// (SentencePiece-style files: Llama 2, Mistral), one <0xXX> token per UTF-8
// byte when the vocabulary has all of them; otherwise unk_token when one is
// set (consecutive ones fused into one with `fuse_unk`); otherwise nothing.
// Thread safety: Tokenize is safe to call concurrently; the per-word result
// cache is sharded and each shard is guarded by its own mutex.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_BPE_MODEL_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_BPE_MODEL_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json_fwd.hpp"

namespace tandem::router {

// The byte-fallback token of `byte`, e.g. "<0xE4>".
std::string ByteFallbackToken(unsigned char byte);
// The byte that a "<0xXX>" token stands for (hex digits of either case, as
// the ByteFallback decoder reads them); nullopt for any other token.
std::optional<unsigned char> ParseByteFallbackToken(std::string_view token);

class BpeModel {
 public:
  // Words longer than this (bytes) are not cached: they are rare and would
  // crowd out the common ones.
  static constexpr size_t kMaxCachedWordBytes = 256;
  // Total cached words across shards. 64k words of ~10 bytes with their ids
  // is a few MiB and covers the hot vocabulary of typical prompts; once a
  // shard is full it stops admitting (no eviction), as the Rust crate's
  // cache does, so a hostile stream of unique words cannot grow memory.
  static constexpr size_t kCacheCapacity = 1 << 16;

  // `model` is the tokenizer.json "model" object.
  static absl::StatusOr<std::unique_ptr<BpeModel>> Create(const nlohmann::json& model);

  // Appends the ids of `word` (in the model's alphabet, e.g. byte-level
  // characters) to `ids`.
  void Tokenize(std::string_view word, std::vector<int32_t>* ids) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // Token strings indexed by id; ids without a token are empty.
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  struct CacheShard {
    absl::Mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> words ABSL_GUARDED_BY(mu);
  };
  static constexpr size_t kCacheShards = 16;

  BpeModel() = default;
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const;
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left, right) -> merge
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  std::array<int32_t, 256> byte_ids_;  // id of "<0xXX>" per byte, or -1
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_BPE_MODEL_H_
