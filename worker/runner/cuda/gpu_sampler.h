// GpuSampler: the cuda runner's sampling on the GPU (sampling_kernels.h).
// Builds each row's arguments and token lists on the host (the distinct
// tokens of prompt + output for the repetition penalty, the output's counts,
// the min_tokens mask), uploads them in one copy, launches one CTA per row
// and reads the results back. The rows whose walk goes past the first
// cuda_ops::kSampleCandidates candidates (a flat distribution under top_p,
// top_k above that) take a second, full pass (their whole vocabulary
// sorted), kSampleFullRows at a time. Every row gets the host sampler's
// token (SampleToken) bit for bit.
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
  // Enqueues, on `stream`, the sampling of rows[i] from logits row i of
  // `logits` ([*, vocab], device) for every i in `which` (distinct). The
  // rows' logits come out as the host sampler reads them (sampling_kernels.h).
  // The results are Finish's once the stream has synchronized. On an error
  // nothing is enqueued and no row is pending (ResourceExhausted: its
  // buffers could not grow; the caller may sample the rows elsewhere).
  absl::Status Enqueue(float* logits, int vocab, std::span<const RowSampling> rows, std::span<const int> which,
                       std::span<const int> eos_token_ids, cudaStream_t stream);

  // After the stream synchronized: (*sampled)[i] for every row the last
  // pass sampled. True when rows remain for the full pass: EnqueueRest, a
  // synchronization and Finish again.
  bool Finish(std::span<const RowSampling> rows, std::vector<SampledToken>* sampled);

  // Enqueues the full pass of the rows the last Finish left.
  absl::Status EnqueueRest(float* logits, int vocab, cudaStream_t stream);

  // The rows the last Finish left (its logits rows), for a caller that
  // samples them another way (EnqueueRest could not get its memory).
  std::vector<int> PendingRows() const;

  // Allocates the buffers of a pass of up to `rows` rows with up to `ids`
  // listed tokens ahead of use (ModelRunner::ReserveSteps); a pass past
  // that grows them.
  absl::Status Reserve(int rows, int ids, int vocab, cudaStream_t stream);

 private:
  // The buffers of `rows` rows and `ids` listed tokens.
  absl::Status ReserveRows(size_t rows, size_t ids, cudaStream_t stream);
  // Distinct in-vocabulary tokens, a generation stamp per vocabulary entry.
  void NewList(int vocab);
  bool FirstTime(int token);

  std::vector<cuda_ops::SampleRowArgs> args_;
  std::vector<int32_t> ids_;
  std::vector<int> slots_;  // the last pass's results, in order: indices into args_
  std::vector<cuda_ops::SampleRowArgs> rest_;
  size_t args_bytes_ = 0;
  std::vector<uint32_t> stamp_;
  std::vector<int32_t> counts_;
  uint32_t generation_ = 0;
  cuda_util::PinnedBuffer up_, down_;
  cuda_util::DeviceBuffer d_up_, d_saved_, d_out_, d_full_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CUDA_GPU_SAMPLER_H_
