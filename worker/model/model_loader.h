// LoadModel: the one entry point that turns a model spec into a config and
// the model's tensors, checked (presence, shapes, dtypes) but not yet read:
// each model runner reads them its own way (the CPU runner converts them to
// f32, a GPU runner uploads them as stored, the simulator reads none).
//
//   "builtin:NAME"      a seeded built-in preset (builtin_models.h): tiny,
//                       small, llama-3.2-1b, llama-3.1-8b
//   any other string    a Hugging Face checkpoint directory with config.json
//                       and model.safetensors or
//                       model.safetensors.index.json + shards
//
// Every failure (no such directory, unsupported architecture, missing or
// misshapen tensor, truncated file) is a Status naming the file or tensor;
// nothing here crashes on bad input.
//
// Thread safety: LoadModel may be called concurrently; a LoadedModel is plain data.
#ifndef TANDEM_WORKER_MODEL_MODEL_LOADER_H_
#define TANDEM_WORKER_MODEL_MODEL_LOADER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/model/model_config.h"
#include "worker/model/weights.h"

namespace tandem::worker {

struct LoadedModel {
  std::string name;  // the preset ("tiny") or the directory's base name
  ModelConfig config;
  std::shared_ptr<const TensorSource> tensors;  // every tensor of `config`, checked
  std::string source_dir;                       // the checkpoint directory; empty for built-ins
  // Hex SHA-256 of the tokenizer.json that goes with the weights (the
  // checkpoint's, or BuiltinTokenizerJson(vocab_size)); empty if the checkpoint has none.
  std::string tokenizer_sha256;
};

absl::StatusOr<LoadedModel> LoadModel(const std::string& spec);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_MODEL_LOADER_H_
