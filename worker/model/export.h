// ExportModel: writes a built-in preset as a Hugging Face checkpoint directory
// that transformers loads as LlamaForCausalLM and that LoadModel(dir) reads
// back (bit-identical weights for float32):
//   config.json, generation_config.json,
//   model.safetensors  or  model-0000i-of-0000N.safetensors + model.safetensors.index.json,
//   tokenizer.json (byte-level BPE with no merges, for the `tokenizers` library),
//   tokenizer_config.json (PreTrainedTokenizerFast, with the built-in chat template).
// Weight files of an earlier export in `dir` are removed first, so a sharded
// export does not leave a stale model.safetensors that would shadow it.
// Tensors are generated, converted and written one at a time: memory holds one
// tensor in f32 (2 GiB for llama-3.1-8b's embeddings), not the model.
//
// Thread safety: concurrent exports must use different directories.
#ifndef TANDEM_WORKER_MODEL_EXPORT_H_
#define TANDEM_WORKER_MODEL_EXPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "worker/model/builtin_models.h"
#include "worker/model/model_config.h"

namespace tandem::worker {

struct ExportOptions {
  // Weight dtype, also written as config.json's torch_dtype: "float32",
  // "bfloat16" or "float16" (16-bit values round to nearest even).
  std::string dtype = "float32";
  // 0: one model.safetensors. Otherwise tensors, in name order, fill shards of
  // at most this many bytes (a larger tensor gets a shard of its own), named
  // model-00001-of-0000N.safetensors, with model.safetensors.index.json
  // holding metadata.total_size and the weight_map.
  int64_t max_shard_bytes = 0;
};

// Exports preset `preset` (one of BuiltinModelNames()) into `dir`, creating
// it. InvalidArgument listing the presets for an unknown one.
absl::Status ExportModel(const std::string& preset, const std::string& dir, const ExportOptions& options = {});

// Exports `source`, a preset's or any seeded model's (a test's own config), as
// ExportModel does. InvalidArgument when its vocab_size is below
// kBuiltinVocabSize (the tokenizer's special tokens would not fit).
absl::Status ExportSeededModel(const SeededTensorSource& source, const std::string& dir,
                               const ExportOptions& options = {});

// The built-in presets' tokenizer.json for a model of `vocab_size` ids:
// byte-level BPE over the 256 bytes, the special tokens 256-383 as added
// tokens, and, from 384 up, the filler tokens BuiltinTokenText names as
// ordinary vocabulary entries: a BPE without merges never produces a
// multi-character entry, so text encodes as with 384 ids and as fast (added
// tokens would be matched on every encode); the router's Tokenizer loads the
// 128256-id file (4 MiB) in about 0.1 s.
// What ExportModel writes; the router loads it for `tokenizer: builtin`
// (384 ids) or `builtin:NAME`. REQUIRES: vocab_size >= kBuiltinVocabSize.
std::string BuiltinTokenizerJson(int vocab_size = kBuiltinVocabSize);

// The built-in presets' tokenizer_config.json for `config` (bos/eos tokens and
// BuiltinChatTemplate()).
std::string BuiltinTokenizerConfigJson(const ModelConfig& config);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_EXPORT_H_
