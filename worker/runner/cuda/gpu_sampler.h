// GpuSampler: the cuda runner's sampling on the GPU (sampling_kernels.h).
// Builds each row's arguments and token lists on the host (the distinct
// tokens of prompt + output for the repetition penalty, the output's counts,
// the min_tokens mask), uploads them in one copy, launches one CTA per row
// and reads the results back. Rows it cannot take (top_k above
// cuda_ops::kSampleCandidates) and rows the kernel hands back (a walk past
// its candidates) are the host sampler's: it picks the same token from the
// same logits (SampleToken).
//
// Thread safety: one caller at a time (a runner's step).
#ifndef TANDEM_WORKER_RUNNER_CUDA_GPU_SAMPLER_H_
#define TANDEM_WORKER_RUNNER_CUDA_GPU_SAMPLER_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "worker/runner/cuda/cuda_buffers.h"
#include "worker/runner/cuda/sampling_kernels.h"
#include "worker/runner/model_runner.h"
#include "worker/sampling/sampler.h"

namespace tandem::worker {

class GpuSampler {
 public:
  // Whether the GPU kernel can take a row with these parameters.
  static bool Takes(const SamplingParams& p, int vocab);

  // Enqueues, on `stream`, the sampling of rows[i] from logits row i of
  // `logits` ([*, vocab], device) for every i in `which` (distinct). The
  // rows' logits come out as the host sampler reads them (sampling_kernels.h).
  // The results are Finish's once the stream has synchronized.
  absl::Status Enqueue(float* logits, int vocab, std::span<const RowSampling> rows, std::span<const int> which,
                       std::span<const int> eos_token_ids, cudaStream_t stream);

  // After the stream synchronized: (*sampled)[i] for every row the kernel
  // sampled; the rows it handed back are appended to *host_rows.
  void Finish(std::span<const RowSampling> rows, std::vector<SampledToken>* sampled, std::vector<int>* host_rows);

 private:
  // Distinct in-vocabulary tokens, a generation stamp per vocabulary entry.
  void NewList(int vocab);
  bool FirstTime(int token);

  std::vector<cuda_ops::SampleRowArgs> args_;
  std::vector<int32_t> ids_;
  std::vector<int> which_;
  std::vector<uint32_t> stamp_;
  std::vector<int32_t> counts_;
  uint32_t generation_ = 0;
  cuda_util::PinnedBuffer up_, down_;
  cuda_util::DeviceBuffer d_up_, d_saved_, d_out_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CUDA_GPU_SAMPLER_H_
