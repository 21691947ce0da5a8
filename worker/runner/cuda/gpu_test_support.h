// Shared by the cuda runner's GPU tests: whether to skip (no usable Hopper
// GPU: CI), saying why.
#ifndef TANDEM_WORKER_RUNNER_CUDA_GPU_TEST_SUPPORT_H_
#define TANDEM_WORKER_RUNNER_CUDA_GPU_TEST_SUPPORT_H_

#include <cstdio>

#include "kernels/paged_attention.h"

namespace tandem::worker {

// True (and the reason printed) without a GPU the CUDA kernels can run on.
inline bool SkipWithoutGpu() {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) {
    std::printf("skipped: %s\n", why);
    return true;
  }
  return false;
}

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CUDA_GPU_TEST_SUPPORT_H_
