// KV write (the reshape_and_cache step): new tokens' K and V rows into their
// cache slots. One CTA per token; each thread moves 16-byte vectors, so a
// head's row (head_dim elements) is written by head_dim / 8 consecutive
// threads with coalesced stores into the page.
#include "kernels/cuda/common.cuh"

namespace tandem::kernels::cuda::internal {
namespace {

__global__ void WriteKvKernel(WriteKvArgs a) {
  const int t = blockIdx.x;
  const int64_t slot = a.slot_mapping[t];
  if (slot < 0) return;  // a padded row
  const int64_t block = slot / a.pool.block_size;
  if (block >= a.pool.num_blocks) {
    if (threadIdx.x == 0) RecordError(a.error, kErrSlot, t);
    return;
  }
  const int in_block = static_cast<int>(slot % a.pool.block_size);
  const int vecs_per_row = a.pool.head_dim / 8;
  const int vecs = a.pool.num_kv_heads * vecs_per_row;
  auto* pool = static_cast<uint4*>(const_cast<void*>(a.pool.kv));
  const auto* k = reinterpret_cast<const uint4*>(static_cast<const char*>(a.k) + t * a.src_stride * 2);
  const auto* v = reinterpret_cast<const uint4*>(static_cast<const char*>(a.v) + t * a.src_stride * 2);
  for (int i = threadIdx.x; i < 2 * vecs; i += blockDim.x) {
    const int kv = i >= vecs;
    const int j = kv ? i - vecs : i;
    const int head = j / vecs_per_row;
    const int part = j % vecs_per_row;
    const int64_t dst = PoolOffset(a.pool, block, kv, head, in_block) / 8 + part;
    pool[dst] = kv ? v[j] : k[j];
  }
}

}  // namespace

int LaunchWriteKv(const WriteKvArgs& a, void* stream) {
  // Element type does not matter to a copy: both are 2 bytes.
  const int vecs = 2 * a.pool.num_kv_heads * (a.pool.head_dim / 8);
  const int threads = vecs >= 256 ? 256 : ((vecs + 31) / 32) * 32;
  WriteKvKernel<<<a.num_tokens, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tandem::kernels::cuda::internal
