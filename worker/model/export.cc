#include "worker/model/export.h"

#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/model/builtin_models.h"
#include "worker/model/io_util.h"
#include "worker/model/model_config.h"
#include "worker/model/safetensors.h"

namespace tandem::worker {
namespace {

using model_internal::JoinPath;
using nlohmann::ordered_json;

constexpr char kTransformersVersion[] = "4.46.0";

std::string Utf8(char32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else {  // the byte-level alphabet stays below U+0800
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
  return out;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves; the
// others, in increasing order, map to U+0100, U+0101, ...
std::string ByteLevelSymbol(int byte) {
  int shifted = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (b == byte) return Utf8(printable ? b : 256 + shifted);
    if (!printable) ++shifted;
  }
  return "";
}

ordered_json AddedToken(int id, bool with_id) {
  ordered_json token;
  if (with_id) token["id"] = id;
  token["content"] = BuiltinTokenText(id);
  token["single_word"] = false;
  token["lstrip"] = false;
  token["rstrip"] = false;
  token["normalized"] = false;
  token["special"] = true;
  return token;
}

}  // namespace

std::string BuiltinTokenizerJson(int vocab_size) {
  CHECK(vocab_size >= kBuiltinVocabSize) << "vocab_size " << vocab_size;
  ordered_json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  ordered_json vocab = ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelSymbol(b)] = b;
  // The fillers, appended to the ordered map's vector directly: its operator[]
  // searches linearly, quadratic over 128k keys, and these are distinct.
  auto& entries = static_cast<ordered_json::object_t::Container&>(vocab.get_ref<ordered_json::object_t&>());
  entries.reserve(entries.size() + (vocab_size - kBuiltinVocabSize));
  for (int id = kBuiltinVocabSize; id < vocab_size; ++id) entries.emplace_back(BuiltinTokenText(id), id);
  ordered_json added = ordered_json::array();
  for (int id = kBuiltinBeginOfTextId; id < kBuiltinVocabSize; ++id) {
    added.push_back(AddedToken(id, /*with_id=*/true));
  }
  ordered_json tokenizer;
  tokenizer["version"] = "1.0";
  tokenizer["truncation"] = nullptr;
  tokenizer["padding"] = nullptr;
  tokenizer["added_tokens"] = std::move(added);
  tokenizer["normalizer"] = nullptr;
  tokenizer["pre_tokenizer"] = byte_level;
  // No post-processor: encoding adds no bos, as EncodeBuiltinText; the chat
  // template writes it.
  tokenizer["post_processor"] = nullptr;
  tokenizer["decoder"] = byte_level;
  tokenizer["model"] = {
      {"type", "BPE"},
      {"dropout", nullptr},
      {"unk_token", nullptr},
      {"continuing_subword_prefix", nullptr},
      {"end_of_word_suffix", nullptr},
      {"fuse_unk", false},
      {"byte_fallback", false},
      {"vocab", std::move(vocab)},
      {"merges", ordered_json::array()},
  };
  return model_internal::DumpJson(tokenizer, 2) + "\n";
}

std::string BuiltinTokenizerConfigJson(const ModelConfig& config) {
  ordered_json decoder = ordered_json::object();
  for (int id = kBuiltinBeginOfTextId; id < kBuiltinVocabSize; ++id) {
    decoder[std::to_string(id)] = AddedToken(id, /*with_id=*/false);
  }
  ordered_json tokenizer_config;
  tokenizer_config["added_tokens_decoder"] = std::move(decoder);
  tokenizer_config["bos_token"] = BuiltinTokenText(kBuiltinBeginOfTextId);
  tokenizer_config["chat_template"] = std::string(BuiltinChatTemplate());
  tokenizer_config["clean_up_tokenization_spaces"] = false;
  tokenizer_config["eos_token"] = BuiltinTokenText(kBuiltinEotId);
  tokenizer_config["model_input_names"] = {"input_ids", "attention_mask"};
  tokenizer_config["model_max_length"] = config.max_position_embeddings;
  tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast";
  return model_internal::DumpJson(tokenizer_config, 2) + "\n";
}

namespace {

std::string GenerationConfigJson(const ModelConfig& config) {
  ordered_json generation;
  generation["bos_token_id"] = config.bos_token_id;
  generation["eos_token_id"] = config.eos_token_ids;
  generation["transformers_version"] = kTransformersVersion;
  return model_internal::DumpJson(generation, 2) + "\n";
}

bool IsWeightFile(std::string_view name) {
  const bool is_shard =
      name.starts_with("model-") && name.ends_with(".safetensors") && name.find("-of-") != std::string_view::npos;
  return is_shard || name == "model.safetensors" || name == "model.safetensors.index.json";
}

absl::Status RemoveOldWeights(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!IsWeightFile(entry.path().filename().string())) continue;
    std::error_code remove_error;
    std::filesystem::remove(entry.path(), remove_error);
    if (remove_error) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove ", entry.path().string(), ": ", remove_error.message()));
    }
  }
  if (ec) return absl::UnavailableError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

// Writes `source`'s tensors, generating each as the writer reaches it and
// dropping it once written.
absl::Status WriteWeights(const std::string& dir, const SeededTensorSource& source, SafetensorsDtype dtype,
                          int64_t max_shard_bytes) {
  const std::map<std::string, std::vector<int64_t>> shapes = ExpectedTensorShapes(source.config());
  auto bytes_of = [dtype](const std::vector<int64_t>& shape) {
    int64_t n = SafetensorsDtypeSize(dtype);
    for (int64_t d : shape) n *= d;
    return n;
  };
  int64_t total_bytes = 0;
  for (const auto& [name, shape] : shapes) total_bytes += bytes_of(shape);

  Tensor current;
  int64_t written = 0;
  int logged_tenths = 0;
  const TensorValues values = [&](const std::string& name) -> absl::StatusOr<std::span<const float>> {
    written += current.data.size() * SafetensorsDtypeSize(dtype);
    if (total_bytes >= (int64_t{1} << 30) && written * 10 / total_bytes > logged_tenths) {
      logged_tenths = static_cast<int>(written * 10 / total_bytes);
      LOG(INFO) << "export: " << logged_tenths * 10 << "% of " << total_bytes / (1 << 20) << " MiB written";
    }
    current = Tensor();  // free the previous tensor before making the next
    ASSIGN_OR_RETURN(current, source.Get(name));
    return std::span<const float>(current.data);
  };
  if (max_shard_bytes == 0) {
    return WriteSafetensorsStreaming(JoinPath(dir, "model.safetensors"), shapes, dtype, values);
  }
  // Greedy in name order, as transformers' save_pretrained shards.
  std::vector<std::map<std::string, std::vector<int64_t>>> shards(1);
  int64_t shard_bytes = 0;
  for (const auto& [name, shape] : shapes) {
    const int64_t bytes = bytes_of(shape);
    if (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += bytes;
    shards.back().emplace(name, shape);
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    RETURN_IF_ERROR(WriteSafetensorsStreaming(JoinPath(dir, file), shards[i], dtype, values));
    for (const auto& [name, shape] : shards[i]) weight_map[name] = file;
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", std::move(weight_map)}};
  return model_internal::WriteFile(JoinPath(dir, "model.safetensors.index.json"),
                                   model_internal::DumpJson(index, 2) + "\n");
}

}  // namespace

absl::Status ExportModel(const std::string& preset, const std::string& dir, const ExportOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<SeededTensorSource> source, MakeBuiltinTensorSource(preset));
  return ExportSeededModel(*source, dir, options);
}

absl::Status ExportSeededModel(const SeededTensorSource& source, const std::string& dir, const ExportOptions& options) {
  absl::StatusOr<SafetensorsDtype> dtype = SafetensorsDtypeFromTorchName(options.dtype);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("export: ", dtype.status().message()));
  }
  if (options.max_shard_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("export: max_shard_bytes must be >= 0, got ", options.max_shard_bytes));
  }
  ModelConfig config = source.config();
  if (config.vocab_size < kBuiltinVocabSize) {
    return absl::InvalidArgumentError(absl::StrCat("export: ", source.Describe(), " has vocab_size ", config.vocab_size,
                                                   ", below the built-in tokenizer's ", kBuiltinVocabSize, " ids"));
  }
  config.torch_dtype = options.dtype;

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  }
  RETURN_IF_ERROR(RemoveOldWeights(dir));
  RETURN_IF_ERROR(WriteWeights(dir, source, *dtype, options.max_shard_bytes));

  using model_internal::WriteFile;
  RETURN_IF_ERROR(WriteFile(JoinPath(dir, "config.json"), ModelConfigToJson(config)));
  RETURN_IF_ERROR(WriteFile(JoinPath(dir, "generation_config.json"), GenerationConfigJson(config)));
  RETURN_IF_ERROR(WriteFile(JoinPath(dir, "tokenizer.json"), BuiltinTokenizerJson(config.vocab_size)));
  RETURN_IF_ERROR(WriteFile(JoinPath(dir, "tokenizer_config.json"), BuiltinTokenizerConfigJson(config)));
  LOG(INFO) << "exported " << source.Describe() << " (" << options.dtype << ") to " << dir;
  return absl::OkStatus();
}

}  // namespace tandem::worker
