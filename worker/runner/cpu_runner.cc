#include "worker/runner/builtin_runners.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/runner/llama_model.h"

namespace tandem::worker {
namespace {

class CpuRunner final : public ModelRunner {
 public:
  CpuRunner(ModelConfig config, ModelWeights weights)
      : ModelRunner(config), model_(std::move(config), std::move(weights)) {}

  std::string_view name() const override { return "cpu"; }
  kernels::KvLayout KvBlockLayout(int block_size) const override { return model_.KvBlockLayout(block_size); }

  absl::Status Logits(const BatchInput& in, KvStorage& kv, std::vector<float>* logits) override {
    float* kv_cache = kv.host_f32();
    if (kv_cache == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("the cpu runner needs a float32 KV pool in host memory, got ",
                                                        kernels::DTypeName(kv.dtype()), " in ",
                                                        MemoryLocationName(kv.location()), " memory"));
    }
    return model_.Forward(in, kv_cache, kv.layout(), logits);
  }

  absl::Status Step(const BatchInput& in, std::span<const RowSampling> rows, KvStorage& kv,
                    std::vector<SampledToken>* sampled) override {
    RETURN_IF_ERROR(Logits(in, kv, &logits_));
    const ModelConfig& mc = config();
    const size_t vocab = static_cast<size_t>(mc.vocab_size);
    sampled->clear();
    sampled->reserve(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const RowSampling& r = rows[i];
      sampled->push_back(SampleToken(std::span<float>(&logits_[i * vocab], vocab), *r.params, r.prompt, r.output,
                                     mc.eos_token_ids, r.seed));
    }
    return absl::OkStatus();
  }

  double Flops(int64_t num_tokens, int64_t attended_keys, int64_t logits_rows) const override {
    return LlamaForwardFlops(config(), num_tokens, attended_keys, logits_rows);
  }

 private:
  LlamaModel model_;
  std::vector<float> logits_;  // [rows, vocab], reused across steps
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCpuRunner(ModelConfig config,
                                                          std::shared_ptr<const TensorSource> tensors,
                                                          const RunnerOptions& /*options*/) {
  // f32, fused as the forward pass wants them.
  ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(config, *tensors));
  return std::unique_ptr<ModelRunner>(new CpuRunner(std::move(config), std::move(weights)));
}

}  // namespace tandem::worker
