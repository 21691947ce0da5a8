#include "kvtransfer/cuda_ipc/copy_runs.h"

#include <algorithm>

namespace tandem::kvtransfer::cuda_ipc {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // loads in flight a thread before its stores

__device__ __forceinline__ void CopyChunkBody(const CopyChunk& chunk) {
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

__global__ void __launch_bounds__(kThreads) CopyChunksKernel(const CopyChunk* __restrict__ chunks, int n) {
  // One read of each descriptor a CTA (they may be in host memory).
  __shared__ CopyChunk chunk;
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    if (threadIdx.x == 0) chunk = chunks[c];
    __syncthreads();
    CopyChunkBody(chunk);
    __syncthreads();  // all done with it before the next is read
  }
}

}  // namespace

int64_t ChunkBytesFor(int64_t total_bytes, int max_ctas) {
  const int64_t per_cta = (total_bytes / std::max(max_ctas, 1) + 15) / 16 * 16;
  return std::clamp(per_cta, kMinChunkBytes, kMaxChunkBytes);
}

bool AppendChunks(uint64_t src, uint64_t dst, int64_t bytes, int64_t chunk_bytes, std::vector<CopyChunk>* out) {
  if (src % 16 != 0 || dst % 16 != 0 || bytes < 0 || bytes % 16 != 0 || chunk_bytes <= 0 || chunk_bytes % 16 != 0) {
    return false;
  }
  for (int64_t at = 0; at < bytes; at += chunk_bytes) {
    const int64_t n = std::min(bytes - at, chunk_bytes);
    out->push_back(CopyChunk{src + uint64_t(at), dst + uint64_t(at), uint64_t(n)});
  }
  return true;
}

bool ChunksOf(const std::vector<CopySpan>& spans, int max_ctas, std::vector<CopyChunk>* out) {
  int64_t total = 0;
  for (const CopySpan& s : spans) total += s.bytes;
  const int64_t chunk_bytes = ChunkBytesFor(total, max_ctas);
  for (const CopySpan& s : spans) {
    if (!AppendChunks(s.src, s.dst, s.bytes, chunk_bytes, out)) return false;
  }
  return true;
}

cudaError_t LaunchCopyChunks(const CopyChunk* chunks, int n, int max_ctas, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  CopyChunksKernel<<<std::min(n, max_ctas), kThreads, 0, stream>>>(chunks, n);
  return cudaGetLastError();
}

}  // namespace tandem::kvtransfer::cuda_ipc
