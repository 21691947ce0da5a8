// cuda:: entry points: host-side checks, launch planning and dispatch to the
// kernels of kernels/cuda/*.cu (through launch.h). Nothing here reads device
// memory except TakeError.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/launch.h"
#include "kernels/paged_attention.h"

namespace tandem::kernels::cuda {
namespace {

using internal::AttnArgs;
using internal::Elem;
using internal::PoolView;
using internal::ViewOf;

struct DeviceInfo {
  bool ok = false;
  std::string why;
  int num_sms = 0;
};

const DeviceInfo& Device() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      d.why = absl::StrFormat("no CUDA device (%s)",
                              e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
      cudaGetLastError();  // clear the sticky-free error for later calls
      return d;
    }
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
      d.why = "cudaGetDeviceProperties failed";
      return d;
    }
    if (prop.major != 9) {
      d.why = absl::StrFormat("the kernels are built for sm_90a (Hopper); device %d (%s) is sm_%d%d", device, prop.name,
                              prop.major, prop.minor);
      return d;
    }
    d.ok = true;
    d.num_sms = prop.multiProcessorCount;
    return d;
  }();
  return info;
}

absl::Status CudaStatus(int err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(static_cast<cudaError_t>(err))));
}

absl::StatusOr<Elem> ElemOf(DType t, const char* what) {
  switch (t) {
    case DType::kBF16:
      return Elem::kBF16;
    case DType::kF16:
      return Elem::kF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: the CUDA kernels take bfloat16 or float16, not %s", what, DTypeName(t)));
  }
}

absl::Status CheckLayout(const KvLayout& L, int layer, const char* what) {
  if (L.num_kv_heads <= 0 || L.num_layers <= 0 || L.num_blocks <= 0 || L.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: the KV layout is empty (%d layers, %d kv heads, %d blocks of %d)", what, L.num_layers,
                        L.num_kv_heads, L.num_blocks, L.block_size));
  }
  if (L.head_dim <= 0 || L.head_dim % 8 != 0 || L.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: head_dim %d is not supported (the CUDA kernels take multiples of 8 up to 256)", what, L.head_dim));
  }
  if (layer < 0 || layer >= L.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: layer %d outside [0, %d)", what, layer, L.num_layers));
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Splits of a fixed number of keys (a multiple of the kernel's 64-key tile).
internal::SplitPlan FixedPlan(int max_context, int keys_per_split) {
  internal::SplitPlan plan;
  plan.keys_per_split = (std::max(keys_per_split, 1) + 63) / 64 * 64;
  plan.num_splits = std::max(1, (max_context + plan.keys_per_split - 1) / plan.keys_per_split);
  return plan;
}

}  // namespace

}  // namespace tandem::kernels::cuda

namespace tandem::kernels::cuda::internal {

PoolView ViewOf(const KvLayout& L, const void* kv, int layer) {
  PoolView v;
  v.kv = static_cast<const char*>(kv) + layer * L.layer_stride_bytes();
  v.block_stride = L.block_stride_elems();
  v.kv_stride = L.kv_stride_elems();
  v.head_stride = L.head_stride_elems();
  v.num_blocks = L.num_blocks;
  v.block_size = L.block_size;
  v.head_dim = L.head_dim;
  v.num_kv_heads = L.num_kv_heads;
  return v;
}

}  // namespace tandem::kernels::cuda::internal

namespace tandem::kernels::cuda {

bool Available(const char** why) {
  const DeviceInfo& d = Device();
  if (!d.ok && why != nullptr) *why = d.why.c_str();
  return d.ok;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool CanAccessPeer(int from, int to) {
  if (from == to) return from >= 0 && from < DeviceCount();
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

int64_t WorkspaceBytes(int num_tokens, int num_heads, int head_dim, int max_splits) {
  const int useful = internal::MaxUsefulSplits(num_tokens, Device().ok ? Device().num_sms : 0);
  return kErrorWordBytes +
         internal::SplitKvWorkspaceBytes(num_tokens, num_heads, head_dim, std::max(1, std::min(max_splits, useful)));
}

int64_t FixedSplitWorkspaceBytes(int num_tokens, int num_heads, int head_dim, int max_context, int keys_per_split) {
  return kErrorWordBytes + internal::SplitKvWorkspaceBytes(num_tokens, num_heads, head_dim,
                                                           FixedPlan(max_context, keys_per_split).num_splits);
}

absl::Status WriteKvCache(const WriteKvParams& p) {
  const char* what = "write kv";
  if (const char* why = nullptr; !Available(&why)) return absl::FailedPreconditionError(why);
  auto elem = ElemOf(p.layout.dtype, what);
  if (!elem.ok()) return elem.status();
  if (absl::Status s = CheckLayout(p.layout, p.layer, what); !s.ok()) return s;
  if (p.num_tokens < 0) return absl::InvalidArgumentError("write kv: num_tokens < 0");
  if (p.num_tokens == 0) return absl::OkStatus();
  if (p.k == nullptr || p.v == nullptr || p.slot_mapping == nullptr || p.kv_cache == nullptr ||
      p.workspace == nullptr) {
    return absl::InvalidArgumentError("write kv: k, v, slot_mapping, kv_cache and workspace are required");
  }
  const int64_t eb = p.layout.elem_bytes();
  if (p.src_stride_bytes % eb != 0 || p.src_stride_bytes < p.layout.num_kv_heads * p.layout.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat("write kv: src_stride_bytes %d is not a whole row of %d kv heads",
                                                      p.src_stride_bytes, p.layout.num_kv_heads));
  }
  if (!Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.kv_cache) || p.src_stride_bytes % 16 != 0) {
    return absl::InvalidArgumentError("write kv: k, v, kv_cache and src_stride_bytes must be 16-byte aligned");
  }
  internal::WriteKvArgs a;
  a.elem = *elem;
  a.k = p.k;
  a.v = p.v;
  a.src_stride = p.src_stride_bytes / eb;
  a.slot_mapping = p.slot_mapping;
  a.num_tokens = p.num_tokens;
  a.pool = ViewOf(p.layout, p.kv_cache, p.layer);
  a.error = static_cast<int*>(p.workspace);
  return CudaStatus(internal::LaunchWriteKv(a, p.stream), "write kv launch");
}

absl::Status PagedAttention(const PagedAttentionParams& p) {
  const char* what = "paged attention";
  if (const char* why = nullptr; !Available(&why)) return absl::FailedPreconditionError(why);
  auto elem = ElemOf(p.layout.dtype, what);
  if (!elem.ok()) return elem.status();
  if (absl::Status s = CheckLayout(p.layout, p.layer, what); !s.ok()) return s;
  const KvLayout& L = p.layout;
  if (p.num_heads <= 0 || p.num_heads % L.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "paged attention: %d query heads is not a multiple of %d kv heads", p.num_heads, L.num_kv_heads));
  }
  // A grid's y and z dimensions hold at most 65535 (the combine's y is the heads).
  if (p.num_heads > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("paged attention: %d query heads; the CUDA kernels take at most 65535", p.num_heads));
  }
  if (p.num_seqs < 0) return absl::InvalidArgumentError("paged attention: num_seqs < 0");
  if (p.num_seqs == 0) return absl::OkStatus();
  if (p.host_query_start == nullptr || p.host_context_lens == nullptr) {
    return absl::InvalidArgumentError("paged attention: the CUDA backend needs host_query_start and host_context_lens");
  }
  if (p.q == nullptr || p.out == nullptr || p.kv_cache == nullptr || p.query_start == nullptr ||
      p.context_lens == nullptr || p.block_tables == nullptr || p.workspace == nullptr) {
    return absl::InvalidArgumentError(
        "paged attention: q, out, kv_cache, query_start, context_lens, block_tables and workspace "
        "are required");
  }
  if (p.workspace_bytes < kErrorWordBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("paged attention: the workspace holds %d bytes; at least %d are needed (cuda::WorkspaceBytes "
                        "says how many let long contexts split across the GPU)",
                        p.workspace_bytes, kErrorWordBytes));
  }
  const int64_t eb = L.elem_bytes();
  if (p.q_stride_bytes % eb != 0 || p.q_stride_bytes < p.num_heads * L.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "paged attention: q_stride_bytes %d is not a whole row of %d heads", p.q_stride_bytes, p.num_heads));
  }
  if (!Aligned16(p.q) || !Aligned16(p.out) || !Aligned16(p.kv_cache) || p.q_stride_bytes % 16 != 0) {
    return absl::InvalidArgumentError("paged attention: q, out, kv_cache and q_stride_bytes must be 16-byte aligned");
  }
  AttnArgs a;
  a.elem = *elem;
  a.q = p.q;
  a.q_stride = p.q_stride_bytes / eb;
  a.out = p.out;
  a.pool = ViewOf(L, p.kv_cache, p.layer);
  a.num_heads = p.num_heads;
  a.group = p.num_heads / L.num_kv_heads;
  a.scale = p.scale;
  a.causal = p.causal;
  a.num_seqs = p.num_seqs;
  a.query_start = p.query_start;
  a.context_lens = p.context_lens;
  a.block_tables = p.block_tables;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.error = static_cast<int*>(p.workspace);
  a.num_sms = Device().num_sms;
  if (p.host_query_start[0] != 0) {
    return absl::InvalidArgumentError("paged attention: query_start[0] must be 0");
  }
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q_len = p.host_query_start[s + 1] - p.host_query_start[s];
    const int ctx = p.host_context_lens[s];
    if (q_len < 0 || ctx < q_len) {
      return absl::InvalidArgumentError(
          absl::StrFormat("paged attention: sequence %d has %d queries but context %d", s, q_len, ctx));
    }
    const int64_t blocks = (int64_t{ctx} + L.block_size - 1) / L.block_size;
    if (blocks > p.max_blocks_per_seq) {
      return absl::InvalidArgumentError(absl::StrFormat("paged attention: sequence %d needs %d blocks, table holds %d",
                                                        s, blocks, p.max_blocks_per_seq));
    }
    a.max_q_len = std::max(a.max_q_len, q_len);
    a.max_context = std::max(a.max_context, ctx);
  }
  a.num_tokens = p.host_query_start[p.num_seqs];
  if (a.num_tokens == 0) return absl::OkStatus();

  const bool prefill_wanted =
      p.kernel == AttentionKernel::kPrefill || (p.kernel == AttentionKernel::kAuto && a.max_q_len > 1);
  if (prefill_wanted && internal::PrefillSupports(a)) {
    return CudaStatus(internal::LaunchPrefill(a, p.stream), "paged attention (prefill) launch");
  }
  internal::SplitPlan plan;
  if (p.keys_per_split > 0) {
    plan = FixedPlan(a.max_context, p.keys_per_split);
    const int64_t need =
        FixedSplitWorkspaceBytes(a.num_tokens, a.num_heads, L.head_dim, a.max_context, p.keys_per_split);
    if (p.workspace_bytes < need) {
      return absl::InvalidArgumentError(
          absl::StrFormat("paged attention: splits of %d keys over %d tokens need %d bytes of workspace, got %d",
                          plan.keys_per_split, a.num_tokens, need, p.workspace_bytes));
    }
  } else {
    // PlanSplits gives no more splits than the workspace's partials hold.
    plan = internal::PlanSplits(a, Device().num_sms, std::max<int64_t>(0, p.workspace_bytes - kErrorWordBytes));
  }
  return CudaStatus(internal::LaunchSplitKv(a, plan, static_cast<char*>(p.workspace) + kErrorWordBytes,
                                            p.workspace_bytes - kErrorWordBytes, p.stream),
                    "paged attention (split-KV) launch");
}

absl::Status TakeError(void* workspace, void* stream) {
  int word = 0;
  if (absl::Status st = ReadErrorAsync(workspace, &word, stream); !st.ok()) return st;
  if (absl::Status st = CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "synchronize"); !st.ok()) {
    return st;
  }
  return ErrorFromWord(word, workspace, stream);
}

absl::Status ReadErrorAsync(void* workspace, int* word, void* stream) {
  if (const char* why = nullptr; !Available(&why)) return absl::FailedPreconditionError(why);
  return CudaStatus(
      cudaMemcpyAsync(word, workspace, sizeof(*word), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
      "read the error word");
}

absl::Status ErrorFromWord(int word, void* workspace, void* stream) {
  if (word == 0) return absl::OkStatus();
  if (absl::Status st = CudaStatus(cudaMemsetAsync(workspace, 0, sizeof(word), static_cast<cudaStream_t>(stream)),
                                   "clear the error word");
      !st.ok()) {
    return st;
  }
  const int kind = static_cast<unsigned>(word) >> 28;
  const int index = word & ((1 << 28) - 1);
  switch (kind) {
    case internal::kErrBlockId:
      return absl::InvalidArgumentError(
          absl::StrFormat("paged attention: sequence %d's block table holds a block id outside the pool (its rows "
                          "were written as zeros)",
                          index));
    case internal::kErrSlot:
      return absl::InvalidArgumentError(
          absl::StrFormat("write kv: token %d maps to a slot outside the pool (it was not written)", index));
    default:
      return absl::InternalError(absl::StrFormat("a kernel recorded an unknown error word %#x", word));
  }
}

}  // namespace tandem::kernels::cuda
