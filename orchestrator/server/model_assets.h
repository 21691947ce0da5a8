// ModelAssets: what the router needs to turn requests into token ids and
// back: the tokenizer, the chat template and the template's bos/eos token
// strings, loaded once at startup from ModelConfig.tokenizer:
//   "builtin"          the built-in presets' tokenizer (384 ids: tiny, small)
//                      and chat template;
//   "builtin:NAME"     the same, padded to preset NAME's vocabulary
//                      (BuiltinTokenizerJson; builtin:llama-3.1-8b: 128256 ids);
//   a directory        its tokenizer.json and tokenizer_config.json (a Hugging
//                      Face checkpoint directory);
//   a tokenizer.json   that file, and tokenizer_config.json beside it if any.
// ModelConfig.chat_template, when set, is a file whose text replaces the
// model's template. A template the interpreter cannot run fails here, at
// startup, naming the file, line and construct; a model without a template
// serves completions only (chat requests get a 400 that says so).
//
// Thread safety: immutable after LoadModelAssets; share it freely.
#ifndef TANDEM_ORCHESTRATOR_SERVER_MODEL_ASSETS_H_
#define TANDEM_ORCHESTRATOR_SERVER_MODEL_ASSETS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "orchestrator/chat_template/chat_template.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/tokenizer/tokenizer.h"

namespace tandem::router {

struct ModelAssets {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;  // null: the model has none
  std::string bos_token;                        // the template's bos_token / eos_token variables
  std::string eos_token;
  std::string source;  // where they came from, for logs
  // Hex SHA-256 of the tokenizer.json text: the workers' models must report
  // the same (orchestrator/cluster/compatibility.h).
  std::string tokenizer_sha256;
};

absl::StatusOr<std::shared_ptr<const ModelAssets>> LoadModelAssets(const ModelConfig& config);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_MODEL_ASSETS_H_
