#include "worker/model/model_loader.h"

#include <filesystem>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "worker/model/builtin_models.h"
#include "worker/model/export.h"
#include "worker/model/io_util.h"
#include "worker/model/safetensors.h"

namespace tandem::worker {
namespace {

constexpr std::string_view kBuiltinPrefix = "builtin:";

// "/a/b/llama/" -> "llama".
std::string BaseName(const std::string& dir) {
  std::filesystem::path path(dir);
  if (!path.has_filename()) path = path.parent_path();  // a trailing slash
  std::string name = path.filename().string();
  return name.empty() || name == "." || name == ".." ? dir : name;
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const std::string& spec) {
  LoadedModel model;
  if (spec.rfind(kBuiltinPrefix, 0) == 0) {
    model.name = spec.substr(kBuiltinPrefix.size());
    ASSIGN_OR_RETURN(std::unique_ptr<SeededTensorSource> source, MakeBuiltinTensorSource(model.name));
    model.config = source->config();
    RETURN_IF_ERROR(CheckTensors(model.config, *source));
    model.tensors = std::move(source);
    model.tokenizer_sha256 = Sha256Hex(BuiltinTokenizerJson(model.config.vocab_size));
  } else {
    std::error_code ec;
    if (!std::filesystem::is_directory(spec, ec)) {
      return absl::NotFoundError(absl::StrCat("model \"", spec, "\" is neither a checkpoint directory nor builtin:",
                                              absl::StrJoin(BuiltinModelNames(), "|")));
    }
    model.name = BaseName(spec);
    model.source_dir = spec;
    ASSIGN_OR_RETURN(model.config, LoadModelConfig(spec));
    ASSIGN_OR_RETURN(std::unique_ptr<CheckpointTensorSource> source, CheckpointTensorSource::Open(spec));
    RETURN_IF_ERROR(CheckTensors(model.config, *source));
    model.tensors = std::move(source);
    const std::string tokenizer_path = model_internal::JoinPath(spec, "tokenizer.json");
    if (std::filesystem::exists(tokenizer_path, ec)) {
      ASSIGN_OR_RETURN(std::string text, ReadFile(tokenizer_path));
      model.tokenizer_sha256 = Sha256Hex(text);
    }
  }
  LOG(INFO) << "loaded model " << model.name << " (" << model.config.architecture << ", " << model.config.num_layers
            << " layers, hidden " << model.config.hidden_size << ", " << ParameterCount(model.config)
            << " parameters) from " << (model.source_dir.empty() ? spec : model.source_dir);
  return model;
}

}  // namespace tandem::worker
