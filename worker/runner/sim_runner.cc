#include "worker/runner/builtin_runners.h"

#include <algorithm>
#include <numeric>
#include <thread>
#include <utility>

#include "common/status_macros.h"

namespace tandem::worker {
namespace {

// The simulated token at `position` of a sequence: a hash of the request's
// seed and the position, never one of `eos` (so it runs to its max_tokens).
// Its logprob is 0 (certain); top_logprobs list only it.
SampledToken SimToken(uint64_t seed, int position, int vocab_size, std::span<const int> eos,
                      const SamplingParams& params) {
  uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(position + 1));
  int token = 0;
  for (int tries = 0; tries < 64; ++tries) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    token = static_cast<int>(x % static_cast<uint64_t>(vocab_size));
    if (std::find(eos.begin(), eos.end(), token) == eos.end()) break;
  }
  SampledToken t{.token_id = token};
  if (params.logprobs > 0) t.top_logprobs.push_back(TokenLogprob{.token_id = token, .logprob = 0.0f});
  return t;
}

class SimRunner final : public ModelRunner {
 public:
  SimRunner(ModelConfig config, SimTiming timing) : ModelRunner(std::move(config)), timing_(timing) {}

  std::string_view name() const override { return "sim"; }
  bool simulated() const override { return true; }
  kernels::KvLayout KvBlockLayout(int block_size) const override { return HostKvLayout(config(), block_size); }

  absl::Status Step(const BatchInput& in, std::span<const RowSampling> rows, KvStorage& /*kv*/,
                    std::vector<SampledToken>* sampled) override {
    const int64_t context_tokens = std::accumulate(in.context_lens.begin(), in.context_lens.end(), int64_t{0});
    const double seconds = timing_.StepSeconds(in.prefill_tokens, in.decode_seqs, context_tokens);
    std::this_thread::sleep_until(
        in.started + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds)));
    sampled->clear();
    for (const RowSampling& r : rows) {
      sampled->push_back(SimToken(r.seed, r.position, config().vocab_size, config().eos_token_ids, *r.params));
    }
    return absl::OkStatus();
  }

  absl::Status Logits(const BatchInput&, KvStorage&, std::vector<float>*) override {
    return absl::UnimplementedError("the simulated runner (--engine sim) computes no logits");
  }

  double Flops(int64_t, int64_t, int64_t) const override { return 0; }

 private:
  const SimTiming timing_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> NewSimRunner(ModelConfig config,
                                                          std::shared_ptr<const TensorSource> /*tensors: none read*/,
                                                          const RunnerOptions& options) {
  RETURN_IF_ERROR(options.sim.Validate());
  return std::unique_ptr<ModelRunner>(new SimRunner(std::move(config), options.sim));
}

}  // namespace tandem::worker
