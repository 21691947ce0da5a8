// What kernels/cuda/api.cc hands the CUDA kernels: plain structs (no absl,
// no C++20: the .cu files build as CUDA C++17), element strides, device
// pointers, and one launcher per kernel family. api.cc validates everything
// it can on the host first (shapes, dtype, host copies of the lengths), so a
// launcher only maps the call onto a grid. Launchers return the launch's
// cudaError_t (0 = cudaSuccess); none synchronizes.
#ifndef TANDEM_KERNELS_CUDA_LAUNCH_H_
#define TANDEM_KERNELS_CUDA_LAUNCH_H_

#include <cstdint>

namespace tandem::kernels {
struct KvLayout;  // paged_attention.h
}  // namespace tandem::kernels

namespace tandem::kernels::cuda::internal {

enum class Elem : int { kBF16 = 1, kF16 = 2 };

// Device-side error word (the first int of the workspace): 0, or the first
// error a kernel met, as (kind << 28) | index. TakeError decodes it.
enum ErrorKind : int {
  kErrBlockId = 1,  // a block table entry outside [0, num_blocks): index = sequence
  kErrSlot = 2,     // a slot_mapping entry past the pool: index = token
};

// The paged pool as the kernels index it: element strides; layer offset
// folded into `kv` (kv points at the layer's K of block 0).
struct PoolView {
  const void* kv = nullptr;  // + block * block_stride + (0 | kv_stride) + head * head_stride + slot * head_dim
  int64_t block_stride = 0;
  int64_t kv_stride = 0;
  int64_t head_stride = 0;
  int64_t num_blocks = 0;
  int block_size = 0;
  int head_dim = 0;
  int num_kv_heads = 0;
};

// The view of `layer` of a pool laid out as `layout` at `kv` (api.cc).
PoolView ViewOf(const KvLayout& layout, const void* kv, int layer);

// The same view of a one-layer pool of that layout (K of every head, then
// V, block after block), for tests and tools that build a pool by hand.
inline PoolView OneLayerView(const void* kv, int64_t num_blocks, int block_size, int head_dim, int num_kv_heads) {
  PoolView v;
  v.kv = kv;
  v.head_stride = int64_t{block_size} * head_dim;
  v.kv_stride = num_kv_heads * v.head_stride;
  v.block_stride = 2 * v.kv_stride;
  v.num_blocks = num_blocks;
  v.block_size = block_size;
  v.head_dim = head_dim;
  v.num_kv_heads = num_kv_heads;
  return v;
}

struct WriteKvArgs {
  Elem elem = Elem::kBF16;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t src_stride = 0;  // elements between tokens
  const int64_t* slot_mapping = nullptr;
  int num_tokens = 0;
  PoolView pool;  // pool.kv is writable here
  int* error = nullptr;
};
int LaunchWriteKv(const WriteKvArgs& a, void* stream);

struct AttnArgs {
  Elem elem = Elem::kBF16;
  const void* q = nullptr;
  int64_t q_stride = 0;  // elements between tokens
  void* out = nullptr;   // dense [tokens, num_heads * head_dim]
  PoolView pool;
  int num_heads = 0;
  int group = 0;  // num_heads / num_kv_heads
  float scale = 1.0f;
  bool causal = true;
  int num_seqs = 0;
  const int* query_start = nullptr;   // device
  const int* context_lens = nullptr;  // device
  const int32_t* block_tables = nullptr;
  int max_blocks_per_seq = 0;
  int* error = nullptr;
  // From the host copies:
  int num_tokens = 0;  // query_start[num_seqs]
  int max_q_len = 0;
  int max_context = 0;
  // The device's SMs: persistent kernels size their grid by it (0: 132).
  int num_sms = 0;
};

// Split-KV ("flash-decoding") attention for query rows of any count per
// sequence (decode, and the general fallback for shapes the prefill kernel
// does not take). Partials live in `workspace` after the error word.
struct SplitPlan {
  int num_splits = 1;      // KV partitions per (token, kv head)
  int keys_per_split = 0;  // multiple of the kernel's key tile
};
// At most as many splits as `workspace_bytes` (beyond the error word) holds.
SplitPlan PlanSplits(const AttnArgs& a, int num_sms, int64_t workspace_bytes);
int LaunchSplitKv(const AttnArgs& a, const SplitPlan& plan, void* workspace, int64_t workspace_bytes, void* stream);
// The same with a kernel chosen for comparison (kernels/cuda/bench): 0 the
// default, 1 the CUDA-core kernel (the fallback for other shapes) always;
// at head_dim 128 in bf16, 2 the default without its math (the loads' own
// time), 3 the default writing a per-CTA trace (CopyDecodeTrace), 5 the
// trace without the math, 6 items by grid stride (an experiment; other
// shapes fall back to the CUDA-core kernel).
int LaunchSplitKvVariant(const AttnArgs& a, const SplitPlan& plan, void* workspace, int64_t workspace_bytes,
                         void* stream, int variant);
// Variant 3's (or 5's) trace of its last call: for each of the first
// kDecodeTraceCtas CTAs, kDecodeTraceWords words indexed by DecodeTraceWord.
enum DecodeTraceWord { kTraceStartNs, kTraceFirstTileNs, kTraceEndNs, kTraceItems, kTraceStartClock, kTraceEndClock };
inline constexpr int kDecodeTraceWords = 6;
inline constexpr int kDecodeTraceCtas = 1024;
int CopyDecodeTrace(unsigned long long* host);
// The most splits a call of `num_tokens` query tokens can be given (every
// token is at least one unit of work), for sizing workspaces.
int MaxUsefulSplits(int num_tokens, int num_sms);
// Bytes of partials a split plan needs (beyond the error word).
int64_t SplitKvWorkspaceBytes(int num_tokens, int num_heads, int head_dim, int num_splits);

// Tensor-core prefill (head_dim 64 or 128): true if it takes this call.
bool PrefillSupports(const AttnArgs& a);
int LaunchPrefill(const AttnArgs& a, void* stream);

}  // namespace tandem::kernels::cuda::internal

#endif  // TANDEM_KERNELS_CUDA_LAUNCH_H_
