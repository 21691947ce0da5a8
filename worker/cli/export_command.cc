// `tandem export-model`: writes a built-in model as a Hugging Face checkpoint
// (config.json, safetensors, tokenizer files) that transformers loads as
// LlamaForCausalLM and `tandem worker --model DIR` loads back.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "worker/cli/commands.h"
#include "worker/model/builtin_models.h"
#include "worker/model/export.h"

namespace tandem::worker {
namespace {
struct ExportCommandOptions {
  std::string preset = "tiny";
  std::string dir;
  ExportOptions options;
  std::string max_shard_size;
};
}  // namespace

void AddExportModelCommand(CLI::App& app) {
  auto opt = std::make_shared<ExportCommandOptions>();
  CLI::App* cmd = app.add_subcommand("export-model", "Write a built-in model as a Hugging Face checkpoint");
  cmd->add_option("--preset", opt->preset,
                  "Built-in model: tiny, small, llama-3.2-1b or llama-3.1-8b (the last two: those models' shapes, "
                  "random weights; 2.5 and 16 GB in bfloat16)")
      ->capture_default_str();
  cmd->add_option("dir", opt->dir, "Output directory")->required();
  cmd->add_option("--dtype", opt->options.dtype, "float32, bfloat16 or float16")->capture_default_str();
  cmd->add_option("--max-shard-bytes", opt->max_shard_size,
                  "Split the weights into shards of at most this size (e.g. 64KiB; default one file)");
  cmd->callback([opt] {
    absl::Status st;
    if (absl::StatusOr<ModelConfig> preset = BuiltinModelConfig(opt->preset); !preset.ok()) {
      ExitWithStatus("export-model", absl::InvalidArgumentError(absl::StrCat("--preset: ", preset.status().message())));
    }
    if (!opt->max_shard_size.empty()) {
      absl::StatusOr<int64_t> bytes = ParseByteSize(opt->max_shard_size);
      if (bytes.ok()) opt->options.max_shard_bytes = *bytes;
      st = bytes.status();
    }
    if (st.ok()) st = ExportModel(opt->preset, opt->dir, opt->options);
    ExitWithStatus("export-model", st);
  });
}

}  // namespace tandem::worker
