// How the GPU kernels that pick tokens read a logit, as the host sampler's
// ReplaceNonFinite (worker/sampling/sampler.cc) does: NaN is never chosen
// (-inf), +inf counts as the largest float. Used by the GPU sampler
// (sampling_kernels.cu) and the greedy argmax (model_kernels.cu).
#ifndef TANDEM_WORKER_RUNNER_CUDA_CLEAN_LOGIT_CUH_
#define TANDEM_WORKER_RUNNER_CUDA_CLEAN_LOGIT_CUH_

#include <cfloat>

namespace tandem::worker::cuda_ops {

__device__ __forceinline__ float CleanLogit(float v) { return isnan(v) ? -INFINITY : fminf(v, FLT_MAX); }

}  // namespace tandem::worker::cuda_ops

#endif  // TANDEM_WORKER_RUNNER_CUDA_CLEAN_LOGIT_CUH_
