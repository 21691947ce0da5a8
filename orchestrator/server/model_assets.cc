#include "orchestrator/server/model_assets.h"

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/model/builtin_models.h"
#include "worker/model/export.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;

// tokenizer_config.json writes special tokens as a string or as an object
// {"content": "..."}.
std::string TokenString(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

// Fills the template and token strings from tokenizer_config.json text.
absl::Status ApplyTokenizerConfig(const std::string& text, const std::string& name, ModelAssets* assets,
                                  std::string* template_source) {
  nlohmann::json config = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a JSON object"));
  }
  assets->bos_token = TokenString(config, "bos_token");
  assets->eos_token = TokenString(config, "eos_token");
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    *template_source = it->get<std::string>();
    return absl::OkStatus();
  }
  // A list of named templates: the one named "default".
  if (it->is_array()) {
    for (const nlohmann::json& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string()) {
        *template_source = t["template"].get<std::string>();
        return absl::OkStatus();
      }
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": chat_template is neither a string nor a list with a \"default\""));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ModelAssets>> LoadModelAssets(const ModelConfig& config) {
  auto assets = std::make_shared<ModelAssets>();
  std::string template_source;
  std::string template_name;
  if (config.tokenizer == "builtin" || config.tokenizer.starts_with("builtin:")) {
    int vocab_size = worker::kBuiltinVocabSize;
    if (config.tokenizer != "builtin") {
      absl::StatusOr<worker::ModelConfig> preset = worker::BuiltinModelConfig(config.tokenizer.substr(8));
      if (!preset.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("model.tokenizer: ", preset.status().message()));
      }
      vocab_size = preset->vocab_size;
    }
    const std::string json = worker::BuiltinTokenizerJson(vocab_size);
    ASSIGN_OR_RETURN(assets->tokenizer, Tokenizer::FromJson(json));
    assets->tokenizer_sha256 = Sha256Hex(json);
    assets->bos_token = worker::BuiltinTokenText(worker::kBuiltinBeginOfTextId);
    assets->eos_token = worker::BuiltinTokenText(worker::kBuiltinEotId);
    template_source = std::string(worker::BuiltinChatTemplate());
    template_name = "the built-in chat template";
    assets->source = config.tokenizer;
  } else {
    std::error_code ec;
    const bool is_dir = fs::is_directory(config.tokenizer, ec);
    const fs::path dir = is_dir ? fs::path(config.tokenizer) : fs::path(config.tokenizer).parent_path();
    const std::string tokenizer_path = is_dir ? (dir / "tokenizer.json").string() : config.tokenizer;
    std::string json;
    ASSIGN_OR_RETURN(assets->tokenizer, Tokenizer::FromFile(tokenizer_path, &json));
    assets->tokenizer_sha256 = Sha256Hex(json);
    const std::string config_path = (dir / "tokenizer_config.json").string();
    if (fs::exists(config_path, ec)) {
      ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
      RETURN_IF_ERROR(ApplyTokenizerConfig(text, config_path, assets.get(), &template_source));
      template_name = config_path;
    }
    assets->source = tokenizer_path;
  }
  if (!config.chat_template.empty()) {
    ASSIGN_OR_RETURN(template_source, ReadFile(config.chat_template));
    template_name = config.chat_template;
  }
  if (!template_source.empty()) {
    absl::StatusOr<std::unique_ptr<ChatTemplate>> t = ChatTemplate::Create(template_source);
    if (!t.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(template_name, ": ", t.status().message()));
    }
    assets->chat_template = *std::move(t);
  }
  return std::shared_ptr<const ModelAssets>(std::move(assets));
}

}  // namespace tandem::router
