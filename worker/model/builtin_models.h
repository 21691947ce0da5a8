// Built-in models: Llama-3-shaped decoders with deterministic, seeded random
// weights, served when no checkpoint is given ("builtin:tiny" for tests,
// "builtin:small" for CPU benchmarks; "builtin:llama-3.2-1b" and
// "builtin:llama-3.1-8b" have those published models' exact shapes, for GPU
// benchmarks), and their byte-level vocabulary.
//
// Weights come from a counter-based generator: value k of tensor `name` is a
// function of (seed, FNV-1a hash of name, k) only (SplitMix64 + Box-Muller in
// double, rounded to f32), so every machine and every call produces the same
// numbers, in any order: a large tensor is generated in parallel chunks, with
// the same values whatever the number of threads. Scales keep activations O(1)
// through the layers and give logits a standard deviation of about 3, so
// next-token distributions are peaked but not one-hot.
//
// Vocabulary (384 ids): 0-255 are the bytes; 256 <|begin_of_text|> (bos),
// 257 <|end_of_text|>, 258 <|start_header_id|>, 259 <|end_header_id|>,
// 260 <|eot_id|>, 261-383 <|reserved_special_token_0|> .. _122|>.
// eos_token_ids = {257, 260}, in every preset. The presets with a real
// model's vocabulary size (128256) keep this tokenizer and its ids (so their
// bos/eos are 256 and {257, 260}, not Llama's 128000 and 128001/128008/128009:
// those are the tokens the chat template writes); ids from 384 up are filler
// tokens "<|filler_ID|>" that no text encodes to (see BuiltinTokenText), there
// so that every id such a model emits decodes.
//
// Thread safety: all functions are thread-safe; a SeededTensorSource is
// immutable and its const methods may be called concurrently.
#ifndef TANDEM_WORKER_MODEL_BUILTIN_MODELS_H_
#define TANDEM_WORKER_MODEL_BUILTIN_MODELS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/model_config.h"
#include "worker/model/weights.h"

namespace tandem::worker {

// The byte-level vocabulary's size (the vocab_size of "tiny" and "small").
inline constexpr int kBuiltinVocabSize = 384;
inline constexpr int kBuiltinBeginOfTextId = 256;
inline constexpr int kBuiltinEndOfTextId = 257;
inline constexpr int kBuiltinStartHeaderId = 258;
inline constexpr int kBuiltinEndHeaderId = 259;
inline constexpr int kBuiltinEotId = 260;

// The preset names, smallest first: {"tiny", "small", "llama-3.2-1b", "llama-3.1-8b"}.
const std::vector<std::string>& BuiltinModelNames();

// The config of preset `name`. InvalidArgument listing the presets otherwise.
absl::StatusOr<ModelConfig> BuiltinModelConfig(std::string_view name);

// Seeded random weights for any valid `config`, by Hugging Face tensor name
// (biases included where the config has them).
class SeededTensorSource : public TensorSource {
 public:
  // `description` is what Describe() returns. With `scale_tied_embeddings`
  // (the presets set it) and tie_word_embeddings, the embeddings are drawn at
  // lm_head's scale: as the output matrix, embeddings of std 1 give logits of
  // std ~sqrt(hidden), and a model that always repeats its last token.
  // REQUIRES: config is valid.
  SeededTensorSource(ModelConfig config, uint64_t seed, std::string description, bool scale_tied_embeddings = false);

  absl::StatusOr<Tensor> Get(const std::string& name) const override;
  absl::StatusOr<std::vector<int64_t>> StoredShape(const std::string& name) const override;  // no generation
  bool Has(const std::string& name) const override;
  std::string Describe() const override;

  const ModelConfig& config() const { return config_; }
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;

 private:
  ModelConfig config_;
  uint64_t seed_;
  std::string description_;
  bool scale_tied_embeddings_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

// The weights of preset `name`; Describe() is "builtin:<name>".
absl::StatusOr<std::unique_ptr<SeededTensorSource>> MakeBuiltinTensorSource(std::string_view name);

// The text of token `id`: the single byte for 0-255, "<|...|>" for the special
// tokens (256-383), "<|filler_ID|>" for a larger id (a padding token of the
// large presets' vocabulary; nothing encodes to it). REQUIRES: id >= 0.
std::string BuiltinTokenText(int id);

// Bytes become ids 0-255, except that the exact text of a special token
// ("<|eot_id|>") becomes its id, as Hugging Face tokenizers match added tokens;
// so a rendered chat template encodes to its special tokens. Adds no bos; never
// yields a filler id.
std::vector<int> EncodeBuiltinText(std::string_view text);

// The bytes of ids 0-255, in order; special, filler and negative ids are skipped.
std::string DecodeBuiltinTokens(std::span<const int> ids);

// A Llama-3 style Jinja chat template over the special tokens above:
//   <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>...
// and, with add_generation_prompt, <|start_header_id|>assistant<|end_header_id|>\n\n.
// It uses bos_token, messages (role, content), add_generation_prompt, the
// `trim` filter, `+`, `for` and `if`.
std::string_view BuiltinChatTemplate();

namespace builtin_models_internal {

// Fills `out` with value k = mean + stddev * z_k, z_k the generator's standard
// normal k of `stream`, using up to `max_threads` threads (0: one per core).
// The values do not depend on max_threads. Exposed for tests.
void FillNormal(uint64_t stream, double mean, double stddev, std::span<float> out, int max_threads = 0);

}  // namespace builtin_models_internal

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_BUILTIN_MODELS_H_
