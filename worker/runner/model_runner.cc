#include "worker/runner/model_runner.h"

#include <charconv>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/runner/builtin_runners.h"

namespace tandem::worker {

void BatchInput::Clear() {
  tokens.clear();
  positions.clear();
  slot_mapping.clear();
  query_start.assign(1, 0);
  context_lens.clear();
  prefilling.clear();
  block_tables.clear();
  max_blocks_per_seq = 0;
  logits_rows.clear();
  prefill_tokens = 0;
  decode_seqs = 0;
}

absl::Status SimTiming::Validate() const {
  for (auto [name, v] : {std::pair<const char*, double>{"step_ms", step_ms},
                         {"prefill_us_per_token", prefill_us_per_token},
                         {"decode_us_per_seq", decode_us_per_seq},
                         {"context_ns_per_token", context_ns_per_token}}) {
    if (!(v >= 0 && v < 1e6)) {
      return absl::InvalidArgumentError(absl::StrFormat("sim %s must be in [0, 1e6), got %g", name, v));
    }
  }
  return absl::OkStatus();
}

double SimTiming::StepSeconds(int64_t prefill_tokens, int64_t decode_seqs, int64_t context_tokens) const {
  return step_ms * 1e-3 + prefill_us_per_token * 1e-6 * static_cast<double>(prefill_tokens) +
         decode_us_per_seq * 1e-6 * static_cast<double>(decode_seqs) +
         context_ns_per_token * 1e-9 * static_cast<double>(context_tokens);
}

absl::StatusOr<int64_t> ModelRunner::KvBudget(double /*utilization*/, int /*max_batched_tokens*/, int /*max_seqs*/) {
  return absl::FailedPreconditionError(absl::StrCat("--gpu-memory-utilization sizes a GPU's KV cache; the ",
                                                    std::string(name()),
                                                    " runner keeps it in host memory (--kv-cache-memory)"));
}

kernels::KvLayout HostKvLayout(const ModelConfig& config, int block_size) {
  return kernels::KvLayout{.num_layers = config.num_layers,
                           .num_kv_heads = config.num_kv_heads,
                           .head_dim = config.head_dim,
                           .block_size = block_size,
                           .num_blocks = 0};
}

absl::Status SelectDevice(std::string_view device, std::string* runner, RunnerOptions* options) {
  if (device == "cpu") {
    *runner = "cpu";
    return absl::OkStatus();
  }
  int index = 0;
  bool ok = device == "cuda";
  if (!ok && device.substr(0, 5) == "cuda:" && device.size() > 5 && device.size() <= 8) {
    const std::string_view digits = device.substr(5);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    ok = ec == std::errc() && end == digits.data() + digits.size() && index >= 0;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu, cuda or cuda:N, got '", std::string(device), "'"));
  }
  *runner = "cuda";
  options->device = index;
  return absl::OkStatus();
}

absl::Status SelectLogitsDtype(std::string_view dtype, std::string_view runner, std::string_view device,
                               RunnerOptions* options) {
  if (dtype != "float32" && dtype != "bfloat16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--logits-dtype must be float32 or bfloat16, got '", std::string(dtype), "'"));
  }
  options->bf16_logits = dtype == "bfloat16";
  if (options->bf16_logits && runner != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--logits-dtype bfloat16 applies to --device cuda only (",
                     runner == "sim" ? std::string("the simulator computes no logits")
                                     : absl::StrCat("--device ", std::string(device), " computes float32 logits"),
                     ")"));
  }
  return absl::OkStatus();
}

void ModelRunnerRegistry::Register(std::string name, Factory factory) {
  CHECK(factories_.count(name) == 0) << "runner " << name << " registered twice";
  factories_.emplace(std::move(name), std::move(factory));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunnerRegistry::Create(std::string_view name, ModelConfig config,
                                                                         std::shared_ptr<const TensorSource> tensors,
                                                                         const RunnerOptions& options) const {
  RETURN_IF_ERROR(Check(name));
  return factories_.find(name)->second(std::move(config), std::move(tensors), options);
}

absl::Status ModelRunnerRegistry::Check(std::string_view name) const {
  if (factories_.count(name) > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model runner '", std::string(name), "' (known: ", absl::StrJoin(names(), ", "), ")"));
}

std::vector<std::string> ModelRunnerRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

const ModelRunnerRegistry& ModelRunnerRegistry::Builtin() {
  static const ModelRunnerRegistry* registry = [] {
    auto* r = new ModelRunnerRegistry;
    r->Register("cpu", NewCpuRunner);
    r->Register("sim", NewSimRunner);
    r->Register("cuda", NewCudaRunner);
    return r;
  }();
  return *registry;
}

}  // namespace tandem::worker
