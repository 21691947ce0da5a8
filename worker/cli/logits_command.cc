// `tandem logits`: runs the model over token sequences through the same paged
// KV cache and model runner the engine uses (--device cpu or cuda), and
// writes the full-vocabulary logits of every position: as JSON, or as raw
// little-endian float32 ([positions, vocab] per sequence, one after the
// other) with --format f32. The reference tests compare them with an
// independent float64 implementation and with Hugging Face transformers.
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
#include "worker/runner/model_runner.h"

namespace tandem::worker {
namespace {

struct LogitsOptions {
  std::string model;
  std::vector<std::string> tokens;  // one comma-separated list per sequence
  std::string output = "-";
  int block_size = 16;
  int chunk = 0;  // prefill in chunks of this many tokens (0: one pass)
  std::string device = "cpu";
  std::string logits_dtype = "float32";
  std::string format = "json";
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
  if (opt.format != "json" && opt.format != "f32") {
    return absl::InvalidArgumentError(absl::StrFormat("--format must be json or f32, got '%s'", opt.format));
  }
  if (opt.format == "f32" && opt.output == "-") {
    return absl::InvalidArgumentError("--format f32 writes binary: give --output FILE");
  }
  std::string runner_name;
  RunnerOptions runner_options;
  RETURN_IF_ERROR(SelectDevice(opt.device, &runner_name, &runner_options));
  RETURN_IF_ERROR(SelectLogitsDtype(opt.logits_dtype, runner_name, opt.device, &runner_options));
  std::vector<std::vector<int32_t>> sequences;
  for (const std::string& text : opt.tokens) {
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ParseTokens(text));
    sequences.push_back(std::move(tokens));
  }
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(opt.model));
  const ModelConfig& c = loaded.config;
  for (const std::vector<int32_t>& tokens : sequences) {
    for (int t : tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrFormat("token id %d is outside the vocabulary [0, %d)", t, c.vocab_size));
      }
    }
    if (static_cast<int>(tokens.size()) > c.max_position_embeddings) {
      return absl::InvalidArgumentError("sequence longer than the model's context");
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                   ModelRunnerRegistry::Builtin().Create(runner_name, c, loaded.tensors, runner_options));
  nlohmann::json out;
  out["vocab_size"] = c.vocab_size;
  out["sequences"] = nlohmann::json::array();
  std::string binary;
  for (const std::vector<int32_t>& tokens : sequences) {
    const int n = static_cast<int>(tokens.size());
    kernels::KvLayout layout = runner->KvBlockLayout(opt.block_size);
    layout.num_blocks = (n + opt.block_size - 1) / opt.block_size;
    RETURN_IF_ERROR(runner->CheckKvLayout(layout));
    ASSIGN_OR_RETURN(std::unique_ptr<KvStorage> kv, KvStorage::Create(layout, runner->KvAllocator()));
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
      in.prefilling.push_back(1);
      in.block_tables = table;
      in.max_blocks_per_seq = static_cast<int>(table.size());
      RETURN_IF_ERROR(runner->Logits(in, *kv, &logits));
      std::copy(logits.begin(), logits.end(), all.begin() + size_t(start) * c.vocab_size);
    }
    if (opt.format == "f32") {
      binary.append(reinterpret_cast<const char*>(all.data()), all.size() * sizeof(float));
      continue;
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
  const std::string text = opt.format == "f32" ? std::move(binary) : out.dump();
  if (opt.output == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return absl::OkStatus();
  }
  std::ofstream f(opt.output, std::ios::binary);
  f << text;
  if (!f) return absl::UnavailableError(absl::StrFormat("cannot write %s", opt.output));
  return absl::OkStatus();
}

}  // namespace

void AddLogitsCommand(CLI::App& app) {
  auto opt = std::make_shared<LogitsOptions>();
  CLI::App* cmd = app.add_subcommand("logits", "Print full-vocabulary logits of token sequences (JSON or raw float32)");
  cmd->add_option("--model", opt->model, "builtin:tiny, builtin:small or a checkpoint directory")->required();
  cmd->add_option("--tokens", opt->tokens, "Comma-separated token ids; repeat for more sequences")->required();
  cmd->add_option("--output", opt->output, "Output file ('-': stdout)")->capture_default_str();
  cmd->add_option("--block-size", opt->block_size, "Tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--chunk", opt->chunk, "Prefill in chunks of this many tokens (0: one pass)")->capture_default_str();
  cmd->add_option("--device", opt->device, "cpu, cuda or cuda:N (see tandem worker --help)")->capture_default_str();
  cmd->add_option("--logits-dtype", opt->logits_dtype, "float32, or bfloat16 (--device cuda; see tandem worker --help)")
      ->capture_default_str();
  cmd->add_option("--format", opt->format, "json, or f32: raw little-endian float32, [positions, vocab] per sequence")
      ->capture_default_str();
  cmd->callback([opt] { ExitWithStatus("logits", RunLogits(*opt)); });
}

}  // namespace tandem::worker
