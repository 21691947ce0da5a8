// ModelRunner: what the engine asks of the hardware each step. A runner owns
// a model's weights and runs one engine step, any mix of prefill chunks and
// decode tokens over a paged KV cache (BatchInput), then samples one token
// for each row whose logits are wanted. It also says how its KV blocks are
// laid out, so the engine sizes and allocates the pool without building a
// model to ask.
//
// Runners are chosen by name from a registry (ModelRunnerRegistry): "cpu"
// (LlamaModel: f32 activations, OpenBLAS, the CPU attention kernels), "sim"
// (a timing model for routing experiments: no compute, meaningless tokens)
// and "cuda" (bf16 on one NVIDIA Hopper GPU; builds without nvcc register it
// as a runner that explains why it is missing).
//
// Not thread-safe: the engine thread owns its runner.
#ifndef TANDEM_WORKER_RUNNER_MODEL_RUNNER_H_
#define TANDEM_WORKER_RUNNER_MODEL_RUNNER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/paged_attention.h"
#include "worker/kv_cache/kv_storage.h"
#include "worker/model/model_config.h"
#include "worker/model/weights.h"
#include "worker/sampling/sampler.h"
#include "worker/sampling/sampling_params.h"

namespace tandem::worker {

// The tokens of one step, sequences concatenated.
struct BatchInput {
  std::vector<int32_t> tokens;        // [T]
  std::vector<int32_t> positions;     // [T], position of each token in its sequence
  std::vector<int64_t> slot_mapping;  // [T], block * block_size + offset of its K/V
  std::vector<int> query_start;       // [S + 1], prefix sums of tokens per sequence
  std::vector<int> context_lens;      // [S], tokens in cache after this step
  // [S], 1 where the sequence's tokens this step are its prompt's (prefill,
  // recomputation), 0 where it decodes; empty: a sequence with one token
  // decodes. A GPU runner keeps each kind on one attention kernel.
  std::vector<uint8_t> prefilling;
  std::vector<int32_t> block_tables;  // [S * max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::vector<int> logits_rows;  // indices into tokens whose logits are wanted
  // The step's make-up: prompt tokens computed, sequences decoding, and when
  // the engine started the step (the simulator's clock).
  int64_t prefill_tokens = 0;
  int64_t decode_seqs = 0;
  std::chrono::steady_clock::time_point started;

  void Clear();
  int num_tokens() const { return static_cast<int>(tokens.size()); }
  int num_seqs() const { return static_cast<int>(context_lens.size()); }
};

// How to sample the token of one logits row (a sequence's next token).
struct RowSampling {
  const SamplingParams* params = nullptr;
  std::span<const int> prompt;
  std::span<const int> output;  // generated so far
  uint64_t seed = 0;            // the request's
  int position = 0;             // tokens in the sequence so far
};

// The simulated runner's timing model (`tandem worker --engine sim`): a step
// takes step_ms plus prefill_us_per_token per prompt token computed, plus
// decode_us_per_seq per sequence decoding, plus context_ns_per_token per KV
// token attended. The defaults are a rough 8B-class model on one GPU (prefill
// about 15k tokens/s; a decode step of about 7 ms at batch 1, 12 ms at batch
// 64). For routing experiments at scale only: outputs are meaningless.
struct SimTiming {
  double step_ms = 6.0;
  double prefill_us_per_token = 60.0;
  double decode_us_per_seq = 80.0;
  double context_ns_per_token = 2.0;

  absl::Status Validate() const;
  // The simulated duration of a step, in seconds.
  double StepSeconds(int64_t prefill_tokens, int64_t decode_seqs, int64_t context_tokens) const;
};

// What a runner may need besides the model.
struct RunnerOptions {
  SimTiming sim;   // "sim"
  int device = 0;  // "cuda": the CUDA device's index (`--device cuda:N`)
  // "cuda" (`--batch-invariant`): every kernel reduces a row the same way
  // whatever else the step holds (single-pass matrix products, decode
  // attention split at fixed key counts), so a sequence's tokens do not
  // depend on what it was batched with; small products lose bandwidth.
  // Either way prompt rows stay on the prefill kernel (chunking changes no
  // bit).
  bool batch_invariant = false;
  // "cuda" (`--enforce-eager` turns it off): decode steps of up to 256
  // sequences replay a CUDA graph captured per batch-size bucket and
  // block-table width (padded rows write nothing and are not sampled),
  // instead of launching each kernel from the host.
  bool cuda_graphs = true;
  // "cuda" (`--host-sampling` turns it off): rows that are not plain greedy
  // are sampled on the GPU (gpu_sampler.h) instead of by the host sampler;
  // the tokens are the same.
  bool gpu_sampling = true;
  // "cuda" (`--logits-dtype bfloat16`): the LM head's logits rounded to
  // bfloat16, as transformers and vLLM leave them (the product's output in
  // the model's dtype): their logprobs' precision, a step of 1/16 at
  // |logit| 8 to 16, instead of float32's. Sampling reads the rounded
  // values.
  bool bf16_logits = false;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  // Its registry name: "cpu", "sim", ...
  virtual std::string_view name() const = 0;
  const ModelConfig& config() const { return config_; }
  // True when its tokens are not a model's (the simulator): the context may
  // exceed the model's positions, and workers say so (ModelInfo.engine).
  virtual bool simulated() const { return false; }

  // The KV geometry for blocks of `block_size` tokens (num_blocks left 0 for
  // the caller to fill).
  virtual kernels::KvLayout KvBlockLayout(int block_size) const = 0;
  // InvalidArgument for a pool geometry the runner cannot run (a GPU
  // runner's block sizes); `layout` is KvBlockLayout's with num_blocks set.
  virtual absl::Status CheckKvLayout(const kernels::KvLayout& /*layout*/) const { return absl::OkStatus(); }
  // Where its KV pool must live: null for host memory (the engine's default
  // or a transport's), else the allocator of the runner's own memory (a GPU
  // runner's device memory, owned by the runner, which outlives the pool).
  virtual KvStorage::Allocator KvAllocator() { return nullptr; }
  // The bytes a KV pool may take so that this process's use of the device
  // stays within `utilization` of its memory (its own share: other
  // processes' memory counts only where it leaves less free), counting the
  // weights and a step's activations at `max_batched_tokens`
  // tokens and `max_seqs` sequences. ResourceExhausted naming what was
  // needed and what was free when nothing is left; FailedPrecondition for a
  // runner without a device.
  virtual absl::StatusOr<int64_t> KvBudget(double utilization, int max_batched_tokens, int max_seqs);
  // Allocates, before serving, what a step of up to `max_batched_tokens`
  // tokens and `max_seqs` sequences of up to `max_blocks_per_seq` blocks
  // needs, so that steps do not allocate (on a GPU an allocation may wait
  // for all of the device's work, an NCCL receive posted for a hand-off
  // included). The engine calls it once, after the KV pool.
  virtual absl::Status ReserveSteps(int /*max_batched_tokens*/, int /*max_seqs*/, int /*max_blocks_per_seq*/) {
    return absl::OkStatus();
  }
  // Prepares, before serving, what a step would otherwise prepare the first
  // time it meets its shape, on `kv` (the pool it will serve from; nothing is
  // written to it): the cuda runner captures the CUDA graph of every decode
  // bucket of up to `max_seqs` sequences of up to `max_blocks_per_seq`
  // blocks, so that no decode step stalls on a capture mid-serving (nor on
  // whatever the capture waits for). The engine calls it after ReserveSteps.
  virtual absl::Status WarmUp(KvStorage& /*kv*/, int /*max_seqs*/, int /*max_blocks_per_seq*/) {
    return absl::OkStatus();
  }
  // Decode steps' CUDA graphs captured and held (the cuda runner's; 0
  // elsewhere).
  virtual int decode_graphs() const { return 0; }

  // One step: writes the K/V of `in`'s tokens into `kv` and samples one
  // token for each of in.logits_rows, in order, as `rows` says.
  // FailedPrecondition for a pool the runner cannot use (its location or
  // dtype). REQUIRES: rows.size() == in.logits_rows.size(); token ids <
  // vocab_size; positions < max_position_embeddings unless simulated().
  virtual absl::Status Step(const BatchInput& in, std::span<const RowSampling> rows, KvStorage& kv,
                            std::vector<SampledToken>* sampled) = 0;

  // The forward pass alone: writes the K/V of `in`'s tokens into `kv` and the
  // float32 logits of in.logits_rows, [rows, vocab], into `logits` (for
  // `tandem logits` and correctness checks). Unimplemented for a runner
  // without a model (the simulator).
  virtual absl::Status Logits(const BatchInput& in, KvStorage& kv, std::vector<float>* logits) = 0;

  // Floating-point operations of a forward over `num_tokens` new tokens whose
  // attention spans `attended_keys` (query, key) pairs in total, counting 2
  // per multiply-add (for FLOP rates).
  virtual double Flops(int64_t num_tokens, int64_t attended_keys, int64_t logits_rows) const = 0;

 protected:
  explicit ModelRunner(ModelConfig config) : config_(std::move(config)) {}

 private:
  const ModelConfig config_;
};

// The host KV pool's block layout for `config` (f32 K and V of every layer,
// KV head and token): the cpu and sim runners' (num_blocks left 0).
kernels::KvLayout HostKvLayout(const ModelConfig& config, int block_size);

// `--device`: "cpu" (the cpu runner), "cuda" (the cuda runner on device 0)
// or "cuda:N". Sets the runner's name and options.device; InvalidArgument
// naming the flag otherwise.
absl::Status SelectDevice(std::string_view device, std::string* runner, RunnerOptions* options);
// `--logits-dtype`: float32 (the default) or bfloat16 (options->bf16_logits;
// the cuda runner's only: `runner` is SelectDevice's, `device` the flag's
// value for the message). InvalidArgument naming the flag otherwise.
absl::Status SelectLogitsDtype(std::string_view dtype, std::string_view runner, std::string_view device,
                               RunnerOptions* options);

class ModelRunnerRegistry {
 public:
  // `tensors`: the model's, checked by LoadModel; each runner reads them its own way.
  using Factory = std::function<absl::StatusOr<std::unique_ptr<ModelRunner>>(
      ModelConfig, std::shared_ptr<const TensorSource> tensors, const RunnerOptions&)>;

  // REQUIRES: `name` not registered yet.
  void Register(std::string name, Factory factory);
  // InvalidArgument naming the known runners for an unknown name.
  absl::StatusOr<std::unique_ptr<ModelRunner>> Create(std::string_view name, ModelConfig config,
                                                      std::shared_ptr<const TensorSource> tensors,
                                                      const RunnerOptions& options) const;
  // OK when `name` is registered; Create's InvalidArgument otherwise.
  absl::Status Check(std::string_view name) const;
  std::vector<std::string> names() const;

  // The runners built into this binary ("cpu", "sim", "cuda").
  static const ModelRunnerRegistry& Builtin();

 private:
  std::map<std::string, Factory, std::less<>> factories_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_MODEL_RUNNER_H_
