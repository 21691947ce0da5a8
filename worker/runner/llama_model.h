// LlamaModel: the CPU forward pass of a Llama-family decoder (Llama 2/3,
// Mistral, Qwen2) over a ragged batch whose KV cache is paged.
//
// One Forward() runs one engine step: any mix of prefill chunks (over a
// cached prefix or not) and decode tokens. Activations are f32; every matrix
// product goes through OpenBLAS sgemm (which brings its own threads);
// attention goes through kernels::PagedAttention.
//
// Not thread-safe: the engine thread owns the model and its scratch buffers.
#ifndef TANDEM_WORKER_RUNNER_LLAMA_MODEL_H_
#define TANDEM_WORKER_RUNNER_LLAMA_MODEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/paged_attention.h"
#include "worker/model/model_config.h"
#include "worker/model/weights.h"
#include "worker/runner/model_runner.h"

namespace tandem::worker {

// Hugging Face's RoPE inverse frequencies for `config`: theta^(-2i/d), then
// its scaling (linear, llama3), [head_dim / 2], in double.
std::vector<double> RopeInverseFrequencies(const ModelConfig& config);

// Floating-point operations of a Llama-family forward over `num_tokens` new
// tokens whose attention spans `attended_keys` (query, key) pairs in total,
// with `logits_rows` rows through the LM head, counting 2 per multiply-add
// (any runner of these models: for FLOP rates).
double LlamaForwardFlops(const ModelConfig& config, int64_t num_tokens, int64_t attended_keys, int64_t logits_rows);

class LlamaModel {
 public:
  LlamaModel(ModelConfig config, ModelWeights weights);

  const ModelConfig& config() const { return config_; }

  // The KV geometry this model needs for blocks of `block_size` tokens
  // (num_blocks left 0 for the caller to fill).
  kernels::KvLayout KvBlockLayout(int block_size) const;

  // Runs `in`: writes its tokens' K/V into `kv_cache` (laid out as `layout`)
  // and returns the logits of in.logits_rows, [rows, vocab], in `logits`.
  // REQUIRES: token ids < vocab_size, positions < max_position_embeddings.
  absl::Status Forward(const BatchInput& in, float* kv_cache, const kernels::KvLayout& layout,
                       std::vector<float>* logits);

 private:
  void ComputeRope(const BatchInput& in);
  void ApplyRope(float* x, int num_heads, int64_t row_stride, int num_tokens) const;

  ModelConfig config_;
  ModelWeights w_;
  std::vector<double> inv_freq_;  // [head_dim / 2]
  // Scratch, reused across steps.
  std::vector<float> x_, h_, qkv_, attn_, gu_, act_, cos_, sin_, last_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_LLAMA_MODEL_H_
