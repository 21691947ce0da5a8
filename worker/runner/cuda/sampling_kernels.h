// Sampling on the GPU (sampling_kernels.cu): one CTA per logits row does
// what the host's SampleToken (worker/sampling/sampler.h) does, with the same
// arithmetic, so a row gets the host sampler's token bit for bit: non-finite
// logits replaced, raw logprobs and the top alternatives, repetition /
// frequency / presence penalties, the min_tokens mask, then the argmax
// (temperature 0) or top_k / top_p / min_p and the inverse-CDF pick over the
// softmax in double (sampling_math.h's exp and walk; the whole-vocabulary sum
// in the host's eight-lane order).
//
// The walk reads the first kSampleCandidates candidates of the sampling
// order (chosen by a radix select, sorted in shared memory). A row whose
// walk needs more (a flat distribution under top_p, top_k above that) comes
// back with `fallback` set; the full pass (`full` scratch given) then sorts
// its whole vocabulary (a stable radix sort in global memory) and never
// falls back. Plain structs, no absl (CUDA C++17); the launcher
// returns the launch's cudaError_t and never synchronizes. The file builds
// with -fmad=false: no multiply-add contraction, as on the host.
#ifndef TANDEM_WORKER_RUNNER_CUDA_SAMPLING_KERNELS_H_
#define TANDEM_WORKER_RUNNER_CUDA_SAMPLING_KERNELS_H_

#include <cstdint>

namespace tandem::worker::cuda_ops {

inline constexpr int kSampleCandidates = 1024;
inline constexpr int kSampleMaxTop = 20;  // kMaxLogprobs
// Rows per launch of the full pass, and its scratch for `rows` rows.
inline constexpr int kSampleFullRows = 32;
inline constexpr int64_t SampleFullScratchBytes(int vocab, int rows) { return int64_t{rows} * 2 * vocab * 8; }

// One row's request, as SamplingParams and the sequence's tokens give it.
// The token lists live in one int array (`ids`), built on the host: the
// distinct in-vocabulary tokens of prompt + output (repetition penalty), the
// (token, count) pairs of the output (frequency and presence penalties), and
// the tokens masked to -inf (stop ids and EOS while output < min_tokens).
struct SampleRowArgs {
  int logits_row = 0;  // row of the logits buffer
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int logprobs = -1;     // -1: none, else 0..kSampleMaxTop alternatives
  double uniform = 0.0;  // UniformDouble(seed, position)
  int rep_begin = 0, rep_count = 0;
  int freq_begin = 0, freq_count = 0;  // pairs: 2 * freq_count ints
  int mask_begin = 0, mask_count = 0;
};

struct SampleRowResult {
  int token = 0;
  int fallback = 0;      // 1: sample this row on the host
  float logprob = 0.0f;  // the sampled token's raw logprob (logprobs >= 0)
  int num_top = 0;
  int top_ids[kSampleMaxTop];
  float top_logprobs[kSampleMaxTop];
};

// Samples rows[r] for r < num_rows from `logits` ([*, vocab] float32) into
// out[r]. A row is processed in place and left as the host sampler reads it:
// NaN and +inf replaced, every other logit as it came (the listed tokens'
// are saved in `saved`, as many floats as `ids` holds, and put back). Rows
// must be distinct. With `full` (SampleFullScratchBytes(vocab, num_rows)),
// the full pass.
int LaunchSample(float* logits, int vocab, const SampleRowArgs* rows, int num_rows, const int32_t* ids, float* saved,
                 SampleRowResult* out, unsigned long long* full, void* stream);

}  // namespace tandem::worker::cuda_ops

#endif  // TANDEM_WORKER_RUNNER_CUDA_SAMPLING_KERNELS_H_
