// `tandem logits`: runs the model over token sequences through the same paged
// KV cache and forward pass the engine uses, and writes the full-vocabulary
// logits of every position as JSON. The reference test compares them with an
// independent float64 implementation.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "worker/cli/commands.h"
#include "worker/kv_cache/kv_storage.h"
#include "worker/model/model_loader.h"
#include "worker/runner/llama_model.h"

namespace tandem::worker {
namespace {

struct LogitsOptions {
  std::string model;
  std::vector<std::string> tokens;  // one comma-separated list per sequence
  std::string output = "-";
  int block_size = 16;
  int chunk = 0;  // prefill in chunks of this many tokens (0: one pass)
};

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrFormat("--tokens: '%s' is not a token id", part));
    }
    ids.push_back(v);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--tokens: empty sequence");
  return ids;
}

absl::Status RunLogits(const LogitsOptions& opt) {
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(opt.model));
  ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(loaded.config, *loaded.tensors));
  LlamaModel model(loaded.config, std::move(weights));
  const ModelConfig& c = model.config();
  nlohmann::json out;
  out["vocab_size"] = c.vocab_size;
  out["sequences"] = nlohmann::json::array();
  for (const std::string& text : opt.tokens) {
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ParseTokens(text));
    const int n = static_cast<int>(tokens.size());
    for (int t : tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrFormat("token id %d is outside the vocabulary [0, %d)", t, c.vocab_size));
      }
    }
    if (n > c.max_position_embeddings) {
      return absl::InvalidArgumentError("sequence longer than the model's context");
    }
    kernels::KvLayout layout = model.KvBlockLayout(opt.block_size);
    layout.num_blocks = (n + opt.block_size - 1) / opt.block_size;
    ASSIGN_OR_RETURN(std::unique_ptr<KvStorage> kv, KvStorage::Create(layout));
    // Blocks in reverse order, so the test exercises a real block table.
    std::vector<int32_t> table(layout.num_blocks);
    for (int64_t b = 0; b < layout.num_blocks; ++b) table[b] = int32_t(layout.num_blocks - 1 - b);

    std::vector<float> all(size_t(n) * c.vocab_size), logits;
    const int chunk = opt.chunk > 0 ? opt.chunk : n;
    for (int start = 0; start < n; start += chunk) {
      const int len = std::min(chunk, n - start);
      BatchInput in;
      in.Clear();
      for (int i = start; i < start + len; ++i) {
        in.tokens.push_back(tokens[i]);
        in.positions.push_back(i);
        in.slot_mapping.push_back(int64_t{table[i / opt.block_size]} * opt.block_size + i % opt.block_size);
        in.logits_rows.push_back(i - start);
      }
      in.query_start.push_back(len);
      in.context_lens.push_back(start + len);
      in.block_tables = table;
      in.max_blocks_per_seq = static_cast<int>(table.size());
      RETURN_IF_ERROR(model.Forward(in, kv->host_f32(), kv->layout(), &logits));
      std::copy(logits.begin(), logits.end(), all.begin() + size_t(start) * c.vocab_size);
    }
    nlohmann::json seq;
    seq["tokens"] = tokens;
    seq["logits"] = nlohmann::json::array();
    for (int i = 0; i < n; ++i) {
      seq["logits"].push_back(
          std::vector<float>(all.begin() + size_t(i) * c.vocab_size, all.begin() + size_t(i + 1) * c.vocab_size));
    }
    out["sequences"].push_back(std::move(seq));
  }
  std::string text = out.dump();
  if (opt.output == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return absl::OkStatus();
  }
  std::ofstream f(opt.output);
  f << text;
  if (!f) return absl::UnavailableError(absl::StrFormat("cannot write %s", opt.output));
  return absl::OkStatus();
}

}  // namespace

void AddLogitsCommand(CLI::App& app) {
  auto opt = std::make_shared<LogitsOptions>();
  CLI::App* cmd = app.add_subcommand("logits", "Print full-vocabulary logits of token sequences as JSON");
  cmd->add_option("--model", opt->model, "builtin:tiny, builtin:small or a checkpoint directory")->required();
  cmd->add_option("--tokens", opt->tokens, "Comma-separated token ids; repeat for more sequences")->required();
  cmd->add_option("--output", opt->output, "Output file ('-': stdout)")->capture_default_str();
  cmd->add_option("--block-size", opt->block_size, "Tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--chunk", opt->chunk, "Prefill in chunks of this many tokens (0: one pass)")->capture_default_str();
  cmd->callback([opt] { ExitWithStatus("logits", RunLogits(*opt)); });
}

}  // namespace tandem::worker
