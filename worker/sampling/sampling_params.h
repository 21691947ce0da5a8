// SamplingParams: how the worker turns one sequence's logits into its next
// token, as carried by a request (OpenAI / vLLM field names and meanings).
// Plain data with in-line defaults; ValidateSamplingParams checks one set
// against a vocabulary once, at admission, so that SampleToken (sampler.h)
// can rely on it at every step.
//
// Thread safety: plain data; ValidateSamplingParams is a pure function.
#ifndef TANDEM_WORKER_SAMPLING_SAMPLING_PARAMS_H_
#define TANDEM_WORKER_SAMPLING_SAMPLING_PARAMS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"

namespace tandem::worker {

// The largest number of top alternatives a request may ask logprobs for.
inline constexpr int kMaxLogprobs = 20;

struct SamplingParams {
  // Divides the logits before the softmax. 0 = greedy (argmax).
  float temperature = 1.0f;
  // Keep only the k most likely tokens. 0 or -1 = off.
  int top_k = 0;
  // Keep the smallest most-likely set whose probability reaches top_p; in
  // (0, 1], 1 = off.
  float top_p = 1.0f;
  // Keep tokens whose probability is at least min_p times the most likely
  // token's; in [0, 1], 0 = off.
  float min_p = 0.0f;
  // > 0; 1 = off. Applied once to every distinct token of prompt + output:
  // a positive logit is divided by it, any other multiplied (as vLLM and
  // Hugging Face do).
  float repetition_penalty = 1.0f;
  // In [-2, 2]; subtracted once from the logit of every token the output
  // holds.
  float presence_penalty = 0.0f;
  // In [-2, 2]; subtracted, times the token's count in the output, from the
  // logit of every token the output holds.
  float frequency_penalty = 0.0f;
  // The most output tokens to generate; -1 = up to the context length (the
  // engine resolves it), else >= 1.
  int max_tokens = -1;
  // EOS (unless ignore_eos) and stop_token_ids are masked until the output
  // holds this many tokens. >= 0, and <= max_tokens when that is set.
  int min_tokens = 0;
  // Generation stops after any of these ids (they are in the output).
  std::vector<int> stop_token_ids;
  // If true, the model's EOS ids neither stop generation nor are masked.
  bool ignore_eos = false;
  // -1 = none; else report the sampled token's logprob plus this many most
  // likely alternatives (0..kMaxLogprobs).
  int logprobs = -1;
  // Unset: the engine draws one at admission, so that every step, on any
  // worker, uses the same seed.
  std::optional<uint64_t> seed;
};

// Returns OK when `params` is usable with a vocabulary of `vocab_size` tokens,
// else InvalidArgument naming the field and its allowed range. NaN and
// infinities are rejected in every float field.
absl::Status ValidateSamplingParams(const SamplingParams& params, int vocab_size);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SAMPLING_SAMPLING_PARAMS_H_
