// A small C ABI over the public kernel API, for callers outside C++:
// kernels/cuda/check_attention.py loads it with ctypes and passes torch
// tensors' data_ptr(). Every pointer named *_dev is device memory; host_*
// are host copies. Functions return nullptr on success, otherwise the
// Status as text (valid until the calling thread's next call).
#include <cstdint>
#include <string>

#include "kernels/paged_attention.h"

namespace {

using tandem::kernels::Backend;
using tandem::kernels::DType;
using tandem::kernels::KvLayout;

thread_local std::string last_error;

const char* Result(const absl::Status& s) {
  if (s.ok()) return nullptr;
  last_error = s.ToString();
  return last_error.c_str();
}

// dtype: 0 f32, 1 bf16, 2 f16.
KvLayout LayoutOf(int dtype, int num_layers, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks) {
  return KvLayout{.num_layers = num_layers,
                  .num_kv_heads = num_kv_heads,
                  .head_dim = head_dim,
                  .block_size = block_size,
                  .num_blocks = num_blocks,
                  .dtype = dtype == 1   ? DType::kBF16
                           : dtype == 2 ? DType::kF16
                                        : DType::kF32};
}

}  // namespace

extern "C" {

// 1 if the CUDA kernels can run here; otherwise 0 and *why says why.
int tandem_cuda_available(const char** why) { return tandem::kernels::cuda::Available(why) ? 1 : 0; }

int64_t tandem_workspace_bytes(int num_tokens, int num_heads, int head_dim) {
  return tandem::kernels::cuda::WorkspaceBytes(num_tokens, num_heads, head_dim);
}

const char* tandem_take_error(void* workspace_dev, void* stream) {
  return Result(tandem::kernels::cuda::TakeError(workspace_dev, stream));
}

const char* tandem_write_kv(int dtype, int num_layers, int num_kv_heads, int head_dim, int block_size,
                            int64_t num_blocks, int layer, const void* k_dev, const void* v_dev,
                            int64_t src_stride_bytes, const int64_t* slot_mapping_dev, int num_tokens,
                            void* kv_cache_dev, void* workspace_dev, void* stream) {
  tandem::kernels::WriteKvParams p{
      .backend = Backend::kCuda,
      .k = k_dev,
      .v = v_dev,
      .src_stride_bytes = src_stride_bytes,
      .slot_mapping = slot_mapping_dev,
      .num_tokens = num_tokens,
      .layer = layer,
      .layout = LayoutOf(dtype, num_layers, num_kv_heads, head_dim, block_size, num_blocks),
      .kv_cache = kv_cache_dev,
      .stream = stream,
      .workspace = workspace_dev};
  return Result(tandem::kernels::WriteKvCache(p));
}

const char* tandem_paged_attention(int dtype, int num_layers, int num_kv_heads, int head_dim, int block_size,
                                   int64_t num_blocks, int layer, const void* q_dev, int64_t q_stride_bytes,
                                   void* out_dev, const void* kv_cache_dev, int num_heads, float scale, int causal,
                                   int num_seqs, const int* query_start_dev, const int* context_lens_dev,
                                   const int32_t* block_tables_dev, int max_blocks_per_seq, const int* host_query_start,
                                   const int* host_context_lens, void* workspace_dev, int64_t workspace_bytes,
                                   void* stream) {
  tandem::kernels::PagedAttentionParams p{
      .backend = Backend::kCuda,
      .q = q_dev,
      .q_stride_bytes = q_stride_bytes,
      .out = out_dev,
      .kv_cache = kv_cache_dev,
      .layout = LayoutOf(dtype, num_layers, num_kv_heads, head_dim, block_size, num_blocks),
      .layer = layer,
      .num_heads = num_heads,
      .scale = scale,
      .causal = causal != 0,
      .num_seqs = num_seqs,
      .query_start = query_start_dev,
      .context_lens = context_lens_dev,
      .block_tables = block_tables_dev,
      .max_blocks_per_seq = max_blocks_per_seq,
      .host_query_start = host_query_start,
      .host_context_lens = host_context_lens,
      .stream = stream,
      .workspace = workspace_dev,
      .workspace_bytes = workspace_bytes};
  return Result(tandem::kernels::PagedAttention(p));
}

}  // extern "C"
