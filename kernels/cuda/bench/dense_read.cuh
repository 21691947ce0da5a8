// The device's read ceiling for the benchmark tools (prefill_check's
// `dense-read` variant, worker/runner/cuda/bench/gemv_chain): a grid-stride
// read of n 16-byte vectors, each loaded once, streamed past L1 with eight
// loads in flight a thread. One word a CTA comes out (never, in practice)
// so the loads stay.
#ifndef TANDEM_KERNELS_CUDA_BENCH_DENSE_READ_CUH_
#define TANDEM_KERNELS_CUDA_BENCH_DENSE_READ_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace tandem::kernels::cuda::bench {

__global__ void DenseReadKernel(const uint4* p, int64_t n, unsigned* out) {
  unsigned acc = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = internal::LoadStreaming(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = internal::LoadStreaming(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

}  // namespace tandem::kernels::cuda::bench

#endif  // TANDEM_KERNELS_CUDA_BENCH_DENSE_READ_CUH_
