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
// This header knows nothing of any device: the CPU implementation is always
// built and is the reference; a CUDA implementation sits behind the same API.
// Functions are thread-compatible: concurrent calls on distinct outputs are safe.
#ifndef TANDEM_KERNELS_PAGED_ATTENTION_H_
#define TANDEM_KERNELS_PAGED_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels {

// Geometry of a paged KV pool. Block b holds, for every layer, K then V, each
// as [num_kv_heads][block_size][head_dim] floats: one block is one contiguous
// run of block_stride() floats (so a block moves between workers in one
// piece), and one head's keys inside a block are contiguous rows.
struct KvLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;  // tokens per block
  int64_t num_blocks = 0;

  int64_t head_stride() const { return int64_t{block_size} * head_dim; }
  int64_t kv_stride() const { return num_kv_heads * head_stride(); }        // K -> V
  int64_t layer_stride() const { return 2 * kv_stride(); }
  int64_t block_stride() const { return num_layers * layer_stride(); }
  int64_t total_floats() const { return num_blocks * block_stride(); }
  // Offset of (block, layer, kv = 0 for K / 1 for V, head, slot) in floats.
  int64_t Offset(int64_t block, int layer, int kv, int head, int slot) const {
    return block * block_stride() + layer * layer_stride() + kv * kv_stride() +
           head * head_stride() + int64_t{slot} * head_dim;
  }
};

// Writes the K and V rows of `num_tokens` new tokens into the cache.
// k, v: [num_tokens, num_kv_heads, head_dim] with row stride `src_stride`
// floats between tokens. slot_mapping[t] = block * block_size + slot.
struct WriteKvParams {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t src_stride = 0;
  const int64_t* slot_mapping = nullptr;
  int num_tokens = 0;
  int layer = 0;
  KvLayout layout;
  float* kv_cache = nullptr;
};
absl::Status WriteKvCache(const WriteKvParams& params);

struct PagedAttentionParams {
  const float* q = nullptr;     // [num_tokens, num_heads, head_dim], row stride q_stride
  int64_t q_stride = 0;         // floats between consecutive tokens' q rows
  float* out = nullptr;         // [num_tokens, num_heads * head_dim], dense
  const float* kv_cache = nullptr;
  KvLayout layout;
  int layer = 0;
  int num_heads = 0;            // query heads; a multiple of layout.num_kv_heads (GQA)
  float scale = 1.0f;           // usually 1/sqrt(head_dim)
  int num_seqs = 0;
  const int* query_start = nullptr;     // [num_seqs + 1], prefix sums of q_len
  const int* context_lens = nullptr;    // [num_seqs], tokens in cache incl. the queries
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
};

// REQUIRES: every block id the queries reach is < layout.num_blocks, and
// q_len(s) <= context_lens[s]. Violations return InvalidArgument.
absl::Status PagedAttention(const PagedAttentionParams& params);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_PAGED_ATTENTION_H_
