// Small device helpers shared by the kernels of kernels/cuda/: element
// conversion of 16-byte vectors, the paged pool's addressing, and the error
// word.
#ifndef TANDEM_KERNELS_CUDA_COMMON_CUH_
#define TANDEM_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace tandem::kernels::cuda::internal {

// Eight elements (16 bytes) to floats and back.
template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& raw, float (&f)[8]) {
  const auto* h = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h[i]));
    } else {
      x = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
    }
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 Pack8(const float (&f)[8]) {
  uint4 raw;
  auto* h = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 v = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      h[i] = *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      h[i] = *reinterpret_cast<uint32_t*>(&v);
    }
  }
  return raw;
}

// A 16-byte read-only load that does not allocate in L1: data read once and
// streamed (a weight row read once a step; the x rows, read by every warp,
// stay cached).
__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Records the first error of a launch (later ones are dropped).
__device__ __forceinline__ void RecordError(int* error, int kind, int index) {
  if (error != nullptr) atomicCAS(error, 0, (kind << 28) | (index & ((1 << 28) - 1)));
}

// Element offset of (block, K|V, head, slot) in the layer view.
__device__ __forceinline__ int64_t PoolOffset(const PoolView& p, int64_t block, int kv, int head, int slot) {
  return block * p.block_stride + kv * p.kv_stride + head * p.head_stride + int64_t{slot} * p.head_dim;
}

// A persistent kernel's next work item (`taken`: items this CTA took
// before): its first is its own, blockIdx.x, so no atomic round trip comes
// before its first load; the counter sched[0] hands out the rest from
// gridDim.x on (the grid is never larger than the item count).
__device__ __forceinline__ int NextWorkItem(unsigned* sched, int taken) {
  return taken == 0 ? static_cast<int>(blockIdx.x) : static_cast<int>(gridDim.x + atomicAdd(&sched[0], 1u));
}

// A persistent kernel's exit, by one thread of each CTA after the CTA took
// its last item from the work counter sched[0]: counts the CTA out in
// sched[1], and the last CTA out sets both back to zero for the next launch
// (every CTA has taken its last item before it counts itself out).
__device__ __forceinline__ void ReleaseWorkCounter(unsigned* sched) {
  __threadfence();
  if (atomicAdd(&sched[1], 1u) == gridDim.x - 1) {
    sched[0] = 0;
    sched[1] = 0;
    __threadfence();
  }
}

// The sequence a token belongs to: the last s with query_start[s] <= token.
__device__ __forceinline__ int SequenceOf(const int* query_start, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(&query_start[mid]) <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace tandem::kernels::cuda::internal

#endif  // TANDEM_KERNELS_CUDA_COMMON_CUH_
