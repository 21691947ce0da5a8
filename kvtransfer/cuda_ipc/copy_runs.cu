#include "kvtransfer/cuda_ipc/copy_runs.h"

namespace tandem::kvtransfer::cuda_ipc {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // loads in flight a thread before its stores

__global__ void __launch_bounds__(kThreads) CopyChunksKernel(const CopyChunk* __restrict__ chunks, int n) {
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    const CopyChunk chunk = chunks[c];
    const uint4* src = reinterpret_cast<const uint4*>(chunk.src);
    uint4* dst = reinterpret_cast<uint4*>(chunk.dst);
    const int64_t vecs = static_cast<int64_t>(chunk.bytes / sizeof(uint4));
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < vecs; i += kUnroll * kThreads) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(src + i + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) __stcs(dst + i + u * kThreads, v[u]);
    }
    for (; i < vecs; i += kThreads) __stcs(dst + i, __ldcs(src + i));
  }
}

}  // namespace

bool AppendChunks(uint64_t src, uint64_t dst, int64_t bytes, std::vector<CopyChunk>* out) {
  if (src % 16 != 0 || dst % 16 != 0 || bytes < 0 || bytes % 16 != 0) return false;
  for (int64_t at = 0; at < bytes; at += kCopyChunkBytes) {
    const int64_t n = bytes - at < kCopyChunkBytes ? bytes - at : kCopyChunkBytes;
    out->push_back(CopyChunk{src + uint64_t(at), dst + uint64_t(at), uint64_t(n)});
  }
  return true;
}

cudaError_t LaunchCopyChunks(const CopyChunk* chunks, int n, int max_ctas, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int ctas = n < max_ctas ? n : max_ctas;
  CopyChunksKernel<<<ctas, kThreads, 0, stream>>>(chunks, n);
  return cudaGetLastError();
}

}  // namespace tandem::kvtransfer::cuda_ipc
