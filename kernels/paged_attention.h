// Paged attention: the attention of a ragged batch of sequences whose keys and
// values live in a paged KV cache, read through per-sequence block tables.
//
// One call serves prefill, chunked prefill over a cached prefix, and decode:
// sequence s contributes q_len(s) = query_start[s+1] - query_start[s] query
// tokens, which are the LAST q_len(s) of its context_lens[s] tokens. Query i
// of sequence s is at position context_lens[s] - q_len(s) + i and attends
// causally to the keys at positions 0..that position. The K/V of the query
// tokens themselves must already be in the cache (WriteKvCache first).
//
// Two implementations sit behind one API and link into one binary: cpu::
// (float32, always built, the reference) and cuda:: (bfloat16 and float16 on
// Hopper, sm_90a; built wherever nvcc exists, see kernels/cuda/). The free
// functions dispatch on the params' `backend` at run time; cuda:: calls
// return FailedPrecondition where no CUDA device (or no CUDA build) exists.
// Functions are thread-compatible: concurrent calls on distinct outputs are safe.
#ifndef TANDEM_KERNELS_PAGED_ATTENTION_H_
#define TANDEM_KERNELS_PAGED_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels {

// Element type of Q, the output and the KV cache (one type for all three).
enum class DType : uint8_t { kF32, kBF16, kF16 };
inline constexpr int DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* DTypeName(DType t);

// Where the pointers of a call live and which implementation runs it.
enum class Backend : uint8_t { kCpu, kCuda };

// Geometry of a paged KV pool.
//
// Block b holds, for every layer, K then V, each as
// [num_kv_heads][block_size][head_dim] elements of `dtype`:
//
//   block b = [layer 0: K[h0][slot][d] ... K[hN] | V[h0] ... V[hN]] [layer 1: ...] ...
//
// Why this layout (the same on the CPU and the GPU):
//  - Transfer: one block is ONE contiguous run of block_bytes() (every layer,
//    K and V), so a hand-off between workers moves a block as one piece (UCX
//    put, CUDA IPC copy or NCCL send) whatever the model depth.
//  - Kernels: one (layer, K|V, head)'s keys inside a block are block_size
//    contiguous rows of head_dim elements (256 B at head_dim 128 in bf16): a
//    page is a dense [block_size, head_dim] tile, which a TMA descriptor
//    covers as a 5-D view (head_dim, slot, head, K|V, block) with every stride
//    a multiple of 16 bytes (the kernels load one page and 64 columns per
//    box), which cp.async reads as 16-byte vectors, and which a decode warp
//    reads as fully coalesced rows. The page size is the
//    pool's block_size: 16, 32 or 64 tokens on the GPU (any size on the CPU).
//  - The cost: a token's K for all heads is not contiguous (the write kernel
//    scatters per head, one 16-byte vector per lane, which is cheap).
// Every stride below is in bytes; *_elems() variants count elements.
struct KvLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;  // tokens per block (the page size)
  int64_t num_blocks = 0;
  DType dtype = DType::kF32;

  int64_t elem_bytes() const { return DTypeBytes(dtype); }
  int64_t head_stride_elems() const { return int64_t{block_size} * head_dim; }
  int64_t kv_stride_elems() const { return num_kv_heads * head_stride_elems(); }  // K -> V
  int64_t layer_stride_elems() const { return 2 * kv_stride_elems(); }
  int64_t block_stride_elems() const { return num_layers * layer_stride_elems(); }
  int64_t total_elems() const { return num_blocks * block_stride_elems(); }
  // Offset of (block, layer, kv = 0 for K / 1 for V, head, slot) in elements.
  int64_t OffsetElems(int64_t block, int layer, int kv, int head, int slot) const {
    return block * block_stride_elems() + layer * layer_stride_elems() + kv * kv_stride_elems() +
           head * head_stride_elems() + int64_t{slot} * head_dim;
  }

  int64_t row_bytes() const { return head_dim * elem_bytes(); }
  int64_t head_stride_bytes() const { return head_stride_elems() * elem_bytes(); }
  int64_t kv_stride_bytes() const { return kv_stride_elems() * elem_bytes(); }
  int64_t layer_stride_bytes() const { return layer_stride_elems() * elem_bytes(); }
  int64_t block_bytes() const { return block_stride_elems() * elem_bytes(); }
  int64_t total_bytes() const { return total_elems() * elem_bytes(); }
  int64_t OffsetBytes(int64_t block, int layer, int kv, int head, int slot) const {
    return OffsetElems(block, layer, kv, head, slot) * elem_bytes();
  }
};

// Writes the K and V rows of `num_tokens` new tokens into the cache.
// k, v: [num_tokens, num_kv_heads, head_dim] of layout.dtype, `src_stride_bytes`
// between tokens. slot_mapping[t] = block * block_size + slot; a negative
// slot skips the token (a padded row). All pointers in the backend's memory.
// CUDA: a slot past the pool is skipped and reported by TakeError (below).
struct WriteKvParams {
  Backend backend = Backend::kCpu;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t src_stride_bytes = 0;
  const int64_t* slot_mapping = nullptr;
  int num_tokens = 0;
  int layer = 0;
  KvLayout layout;
  void* kv_cache = nullptr;
  void* stream = nullptr;     // CUDA: a cudaStream_t (nullptr: the legacy default stream)
  void* workspace = nullptr;  // CUDA: at least kErrorWordBytes, for TakeError
};
absl::Status WriteKvCache(const WriteKvParams& params);

// Which CUDA kernel a call uses. kAuto: the tensor-core prefill kernel when
// some sequence has several queries and it takes the shape, else split-KV.
// kPrefill: the prefill kernel whenever it takes the shape (single-query
// sequences too); kSplitKv: always split-KV. A caller that keeps each kind of
// row (prompt, generated) on one kernel gets the same bits for a row however
// its tokens were batched or chunked.
enum class AttentionKernel : uint8_t { kAuto, kPrefill, kSplitKv };

struct PagedAttentionParams {
  Backend backend = Backend::kCpu;
  const void* q = nullptr;     // [num_tokens, num_heads, head_dim] of layout.dtype
  int64_t q_stride_bytes = 0;  // between consecutive tokens' q rows
  void* out = nullptr;         // [num_tokens, num_heads * head_dim], dense, layout.dtype
  const void* kv_cache = nullptr;
  KvLayout layout;
  int layer = 0;
  int num_heads = 0;   // query heads; a multiple of layout.num_kv_heads (GQA)
  float scale = 1.0f;  // usually 1/sqrt(head_dim)
  // false: every query attends to all context_lens[s] keys (encoders, and the
  // non-causal benchmark shapes); true: causally, as described above.
  bool causal = true;
  int num_seqs = 0;
  // In the backend's memory (device memory for CUDA).
  const int* query_start = nullptr;       // [num_seqs + 1], prefix sums of q_len
  const int* context_lens = nullptr;      // [num_seqs], tokens in cache incl. the queries
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;

  // CUDA only. Host copies of query_start and context_lens: the call checks
  // them (q_len <= context, tables large enough) and sizes its launch from
  // them (longest query run, longest context, split-KV count) without reading
  // device memory. Block ids are checked on the device: a kernel that meets
  // one outside the pool reads nothing through it, writes zeros for the rows
  // it serves and records the error for TakeError.
  const int* host_query_start = nullptr;
  const int* host_context_lens = nullptr;
  void* stream = nullptr;  // a cudaStream_t; nullptr is the legacy default stream
  // Device memory of at least cuda::WorkspaceBytes(...), zeroed (cudaMemset)
  // before its first call; calls leave it that way (the decode kernels keep
  // work and arrival counters in it, back at zero when they finish), except
  // for the error word, which TakeError clears. One call at a time.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // CUDA, split-KV kernel (calls whose query runs are all 1 long, or that
  // the prefill kernel does not take). 0: the split is planned for the whole
  // call (how many rows, how long the longest context, how much workspace).
  // > 0 (rounded up to a multiple of 64): every sequence's keys are split in
  // runs of this many, whatever else the call holds, so each row's result is
  // the same bits in any batch (the GPU engine's batch invariance); the
  // workspace must then hold cuda::FixedSplitWorkspaceBytes(...), else
  // InvalidArgument.
  int keys_per_split = 0;
  AttentionKernel kernel = AttentionKernel::kAuto;  // CUDA
};

// REQUIRES: every block id the queries reach is < layout.num_blocks, and
// q_len(s) <= context_lens[s]. Violations return InvalidArgument (CPU), or
// are reported as described above (CUDA).
absl::Status PagedAttention(const PagedAttentionParams& params);

namespace cpu {
// float32 only; pointers are host memory; stream and workspace are unused.
absl::Status WriteKvCache(const WriteKvParams& params);
absl::Status PagedAttention(const PagedAttentionParams& params);
}  // namespace cpu

namespace cuda {
// True when this binary has the CUDA kernels and a device of compute
// capability 9.0 is present; otherwise `why` (if given) says what is missing.
bool Available(const char** why = nullptr);
// The CUDA devices this process sees (0 without CUDA), and whether device
// `from` can read and write device `to`'s memory (peer access; true for a
// device and itself).
int DeviceCount();
bool CanAccessPeer(int from, int to);
// Bytes of device workspace for a PagedAttention call of up to `num_tokens`
// query tokens to split each row's keys up to `max_splits` ways (split-KV
// partial outputs and their softmax statistics, plus the error word). A call
// needs at least kErrorWordBytes; with less than this it splits fewer ways
// (same results, less of the GPU busy on long contexts with few sequences).
int64_t WorkspaceBytes(int num_tokens, int num_heads, int head_dim, int max_splits = 128);
inline constexpr int64_t kErrorWordBytes = 256;
// Bytes of device workspace for a call of `num_tokens` query tokens whose
// longest context is `max_context`, split in runs of `keys_per_split` keys
// (PagedAttentionParams::keys_per_split).
int64_t FixedSplitWorkspaceBytes(int num_tokens, int num_heads, int head_dim, int max_context, int keys_per_split);
absl::Status WriteKvCache(const WriteKvParams& params);
absl::Status PagedAttention(const PagedAttentionParams& params);
// The first device-side error recorded in `workspace` since the last call
// (a block id or slot outside the pool), as InvalidArgument naming the
// sequence or token; OK if none. Synchronizes `stream`; clears the word.
absl::Status TakeError(void* workspace, void* stream);
// TakeError in two halves, for a caller that synchronizes `stream` anyway:
// ReadErrorAsync queues the error word's copy into *word (host memory valid
// until the stream synchronized: pinned for the copy to be asynchronous);
// once it has, ErrorFromWord(*word, ...) is TakeError's answer (and queues
// the word's clearing when it was set).
absl::Status ReadErrorAsync(void* workspace, int* word, void* stream);
absl::Status ErrorFromWord(int word, void* workspace, void* stream);
}  // namespace cuda

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_PAGED_ATTENTION_H_
