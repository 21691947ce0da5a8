// Token sampling: turns one sequence's final-position logits into its next
// token. The engine calls SampleToken once per sequence per step.
//
// SampleToken(logits, params, prompt, output, eos_token_ids, seed):
//  1. Non-finite logits are replaced: NaN by -inf (never sampled), +inf by
//     the largest float.
//  2. If params.logprobs >= 0, the model's raw distribution is recorded:
//     log_softmax of these logits, before any step below, accumulated in
//     double.
//  3. ProcessLogits: repetition penalty over the distinct tokens of prompt +
//     output (a positive logit divided by it, any other multiplied); then
//     frequency and presence penalties over the output (logit -= frequency *
//     count, then -= presence); then, while the output holds fewer than
//     params.min_tokens tokens, stop_token_ids and (unless ignore_eos) EOS
//     ids are set to -inf. Float arithmetic, as vLLM does it.
//  4. temperature == 0: the argmax, ties to the lowest id.
//     Otherwise the softmax of logits / temperature, in double. Candidates
//     are ordered by processed logit, descending (so by probability), ties
//     by lower id. Keep the first top_k (when on); then the shortest prefix
//     whose probability reaches top_p of what is kept (when on; at least one
//     token); then those with probability >= min_p * the most likely one's
//     (when on). Renormalize and pick by inverse CDF over that order: the
//     first token whose cumulative probability exceeds
//     u = UniformDouble(seed, position), where position = prompt.size() +
//     output.size() is the sampled token's index in the sequence.
//     If every logit is -inf (all masked), the result is token 0.
//  5. logprob is the sampled token's raw logprob from step 2 and
//     top_logprobs the params.logprobs most likely raw tokens, most likely
//     first, ties by lower id. Both are empty (logprob 0) when
//     params.logprobs is -1.
//
// Reproducible: the token is a function of (logits, params, prompt, output,
// eos ids, seed) alone, bit for bit on any IEEE-754 machine: the random draw
// is counter based (philox.h), exp is PortableExp (portable_exp.h), every sum
// runs in a fixed order (over the whole vocabulary, eight interleaved partial
// sums in token-id order; over a prefix of the order, along it), and the
// library is built without FMA contraction. A sequence sampled partly on one
// worker and partly on another therefore gets the same tokens as on one
// worker. Reported logprobs use std::log once, so their last bit may differ
// across C libraries; the sampled token never does.
//
// Cost, for vocabulary V: greedy is three passes over the logits.
// Sampling adds the softmax's denominator, one exp per token (none with
// top_k, which needs only its k), and one pass with a heap to find the 64
// most likely candidates. The sorted prefix grows 4x each time a walk
// (top_p, min_p, the pick) goes past it: by heap up to 1024, then by
// nth_element over a list of the vocabulary, so a full sort happens only
// when a walk reaches deep into a flat distribution. Penalties cost
// O(prompt + output). Measured on one Xeon core, 128k vocabulary: greedy
// 0.07 ms, top_k=50 0.18 ms, top_p or min_p 0.6 ms, unfiltered sampling of a
// flat distribution 1.6 ms; logprobs add 0.6 ms (their own softmax).
//
// Thread safety: pure functions; concurrent calls on distinct logits are safe.
#ifndef TANDEM_WORKER_SAMPLING_SAMPLER_H_
#define TANDEM_WORKER_SAMPLING_SAMPLER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "worker/sampling/sampling_params.h"

namespace tandem::worker {

struct TokenLogprob {
  int token_id;
  float logprob;
};

struct SampledToken {
  int token_id = 0;
  float logprob = 0.0f;                    // set when params.logprobs >= 0
  std::vector<TokenLogprob> top_logprobs;  // params.logprobs of them, or empty
};

// Samples the next token of one sequence, as described above. `logits` holds
// the vocabulary's logits and is overwritten (scratch). Token ids outside
// [0, logits.size()) in prompt, output and eos_token_ids are ignored.
// REQUIRES: !logits.empty(); ValidateSamplingParams(params, logits.size()) is OK.
SampledToken SampleToken(std::span<float> logits, const SamplingParams& params, std::span<const int> prompt,
                         std::span<const int> output, std::span<const int> eos_token_ids, uint64_t seed);

// Step 3 of SampleToken alone, in place: penalties and the min_tokens mask.
// REQUIRES: as SampleToken.
void ProcessLogits(std::span<float> logits, const SamplingParams& params, std::span<const int> prompt,
                   std::span<const int> output, std::span<const int> eos_token_ids);

// True if generation stops after `token`: it is one of params.stop_token_ids,
// or one of eos_token_ids unless params.ignore_eos.
bool IsStopToken(int token, const SamplingParams& params, std::span<const int> eos_token_ids);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SAMPLING_SAMPLER_H_
