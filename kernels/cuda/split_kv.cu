// Split-KV ("flash-decoding") paged attention on CUDA cores: the decode
// kernel, and the general fallback for every shape the tensor-core prefill
// does not take (any query count per sequence, any head_dim that is a
// multiple of 8 up to 256).
//
// Grid: (split, kv head x head chunk, token). A CTA serves one query token
// and up to kHeads query heads that share one KV head (GQA packing: each K/V
// byte is read once per KV head and token, not once per query head), over
// one contiguous range of keys (its split). Within the CTA, four warps take
// turns over that range; inside a warp, a "lane group" of head_dim/8 lanes
// holds one key row, each lane 16 bytes of it, so a warp step reads
// 32 x 16 contiguous bytes of a page per K and per V. Every lane group keeps
// its own online-softmax state (exp2 domain, scale * log2(e) folded into
// Q), updated once per batch of kUnroll keys; the groups and warps merge
// through shared memory at the end. With one split the CTA writes the
// normalised output; with several it writes its unnormalised output and
// (max, sum) to the workspace, and CombineKernel merges the splits.
#include <cfloat>

#include "kernels/cuda/common.cuh"

namespace tandem::kernels::cuda::internal {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;  // keys per lane group per softmax update
// Query heads per CTA: at most 4. Eight (a 64:8 model) took 255 registers a
// thread, two CTAs an SM, and read the KV at half the copy's bandwidth on an
// H100; two CTAs of 4 heads each read the same pages, the second mostly from L2.
constexpr int kMaxHeads = 4;
__host__ __device__ constexpr int HeadsPerCta(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : kMaxHeads; }
constexpr float kLog2e = 1.4426950408889634f;

template <int kLanes>  // lanes per key: a power of two, 16 bytes each
__device__ __forceinline__ float GroupSum(float x) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

struct Partials {
  float* o;   // [tokens, heads, splits, head_dim]
  float* ml;  // [tokens, heads, splits, 2]: running max (log2 domain), sum
};

template <typename T, int kLanes, int kHeads>
__global__ void __launch_bounds__(kThreads)
    SplitKvKernel(AttnArgs a, int num_splits, int keys_per_split, int head_chunks, int token_base, Partials part) {
  constexpr int kGroups = 32 / kLanes;  // keys per warp step
  constexpr int kAllGroups = kWarps * kGroups;
  __shared__ float sm_o[kAllGroups][kHeads][kLanes * 8];
  __shared__ float sm_m[kAllGroups][kHeads];
  __shared__ float sm_l[kAllGroups][kHeads];
  __shared__ int sm_bad;

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / head_chunks;
  const int g0 = (blockIdx.y % head_chunks) * kHeads;
  const int token = token_base + blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / kLanes, chunk = lane % kLanes;
  const int head_dim = a.pool.head_dim;
  const bool lane_active = chunk * 8 < head_dim;

  const int s = SequenceOf(a.query_start, a.num_seqs, token);
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  const int ctx = __ldg(&a.context_lens[s]);
  // Causal: keys [0, position]; otherwise the whole context.
  const int n_keys = a.causal ? ctx - q_len + (token - q_begin) + 1 : ctx;
  const int k_begin = split * keys_per_split;
  const int k_end = min(n_keys, k_begin + keys_per_split);
  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int bs = a.pool.block_size;

  // Every block id this CTA reads must be inside the pool.
  if (threadIdx.x == 0) sm_bad = 0;
  __syncthreads();
  if (k_begin < k_end) {
    for (int b = k_begin / bs + threadIdx.x; b <= (k_end - 1) / bs; b += kThreads) {
      const int32_t id = __ldg(&table[b]);
      if (id < 0 || id >= a.pool.num_blocks) sm_bad = 1;
    }
  }
  __syncthreads();
  const bool bad = sm_bad != 0;
  if (bad && threadIdx.x == 0) RecordError(a.error, kErrBlockId, s);

  // This lane's 8 dims of each head's query, scaled into the log2 domain.
  float q[kHeads][8];
  const float qscale = a.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    const int hg = g0 + g;
    if (hg < a.group && lane_active) {
      const int h = kv_head * a.group + hg;
      const auto* src = reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + int64_t{token} * a.q_stride +
                                                       int64_t{h} * head_dim + chunk * 8);
      Unpack8<T>(*src, q[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] *= qscale;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] = 0.0f;
    }
  }

  float m[kHeads], l[kHeads], o[kHeads][8];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[g][i] = 0.0f;
  }

  const T* pool = static_cast<const T*>(a.pool.kv);
  if (!bad) {
    constexpr int kStep = kWarps * kGroups;  // keys per CTA step
    for (int base = k_begin; base < k_end; base += kStep * kUnroll) {
      uint4 kraw[kUnroll], vraw[kUnroll];
      bool valid[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int key = base + (u * kWarps + warp) * kGroups + group;
        valid[u] = key < k_end;
        if (valid[u] && lane_active) {
          const int32_t block = __ldg(&table[key / bs]);
          const int64_t off = PoolOffset(a.pool, block, 0, kv_head, key % bs) + chunk * 8;
          kraw[u] = __ldg(reinterpret_cast<const uint4*>(pool + off));
          vraw[u] = __ldg(reinterpret_cast<const uint4*>(pool + off + a.pool.kv_stride));
        } else {
          kraw[u] = make_uint4(0, 0, 0, 0);
          vraw[u] = make_uint4(0, 0, 0, 0);
        }
      }
      float sc[kUnroll][kHeads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float kf[8];
        Unpack8<T>(kraw[u], kf);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          float d = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) d = fmaf(q[g][i], kf[i], d);
          d = GroupSum<kLanes>(d);
          sc[u][g] = valid[u] ? d : -FLT_MAX;
        }
      }
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, sc[u][g]);
        const float corr = exp2f(m[g] - mx);
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[g][i] *= corr;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float vf[8];
        Unpack8<T>(vraw[u], vf);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          const float p = valid[u] ? exp2f(sc[u][g] - m[g]) : 0.0f;
          l[g] += p;
#pragma unroll
          for (int i = 0; i < 8; ++i) o[g][i] = fmaf(p, vf[i], o[g][i]);
        }
      }
    }
  }

  // Merge the lane groups' and warps' states.
  const int slot = warp * kGroups + group;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    if (chunk == 0) {
      sm_m[slot][g] = m[g];
      sm_l[slot][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sm_o[slot][g][chunk * 8 + i] = o[g][i];
  }
  __syncthreads();
  const int64_t num_heads = a.num_heads;
  for (int e = threadIdx.x; e < kHeads * head_dim; e += kThreads) {
    const int g = e / head_dim, d = e % head_dim;
    if (g0 + g >= a.group) continue;
    float mx = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < kAllGroups; ++j) mx = fmaxf(mx, sm_m[j][g]);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kAllGroups; ++j) {
      const float w = sm_l[j][g] > 0.0f ? exp2f(sm_m[j][g] - mx) : 0.0f;
      sum += w * sm_l[j][g];
      acc += w * sm_o[j][g][d];
    }
    const int h = kv_head * a.group + g0 + g;
    if (num_splits == 1) {
      const float r = sum > 0.0f ? acc / sum : 0.0f;
      T* out = static_cast<T*>(a.out) + (int64_t{token} * num_heads + h) * head_dim + d;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        *out = __float2bfloat16_rn(r);
      } else {
        *out = __float2half_rn(r);
      }
    } else {
      const int64_t row = (int64_t{token} * num_heads + h) * num_splits + split;
      part.o[row * head_dim + d] = acc;
      if (d == 0) {
        part.ml[row * 2] = sum > 0.0f ? mx : -FLT_MAX;
        // A negative sum marks a split that met a bad block id: the combine
        // then writes the row as zeros (as one split does), not the other
        // splits' partial answer.
        part.ml[row * 2 + 1] = bad ? -1.0f : sum;
      }
    }
  }
}

// One CTA per (token, head): merges the splits' partial outputs.
template <typename T>
__global__ void CombineKernel(AttnArgs a, int num_splits, Partials part) {
  const int token = blockIdx.x, h = blockIdx.y;
  const int head_dim = a.pool.head_dim;
  const int64_t row0 = (int64_t{token} * a.num_heads + h) * num_splits;
  float mx = -FLT_MAX;
  for (int j = 0; j < num_splits; ++j) mx = fmaxf(mx, part.ml[(row0 + j) * 2]);
  float sum = 0.0f;
  bool bad = false;
  for (int j = 0; j < num_splits; ++j) {
    const float lj = part.ml[(row0 + j) * 2 + 1];
    bad |= lj < 0.0f;
    if (lj > 0.0f) sum += exp2f(part.ml[(row0 + j) * 2] - mx) * lj;
  }
  if (bad) sum = 0.0f;  // the row is written as zeros
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    if (sum > 0.0f) {
      for (int j = 0; j < num_splits; ++j) {
        const float lj = part.ml[(row0 + j) * 2 + 1];
        if (lj > 0.0f) acc += exp2f(part.ml[(row0 + j) * 2] - mx) * part.o[(row0 + j) * head_dim + d];
      }
    }
    const float r = sum > 0.0f ? acc / sum : 0.0f;
    T* out = static_cast<T*>(a.out) + (int64_t{token} * a.num_heads + h) * head_dim + d;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      *out = __float2bfloat16_rn(r);
    } else {
      *out = __float2half_rn(r);
    }
  }
}

constexpr int kMaxSplits = 128;
// CTAs a split-KV launch aims at: eight per SM.
int64_t TargetCtas(int num_sms) { return 8LL * (num_sms > 0 ? num_sms : 132); }

template <typename T, int kLanes>
int LaunchTyped(const AttnArgs& a, const SplitPlan& plan, Partials part, cudaStream_t stream) {
  const int heads = HeadsPerCta(a.group);
  const int head_chunks = (a.group + heads - 1) / heads;
  // The grid's z dimension holds at most 65535 tokens: larger batches take
  // several launches.
  constexpr int kMaxGridZ = 65535;
  for (int base = 0; base < a.num_tokens; base += kMaxGridZ) {
    const dim3 grid(plan.num_splits, a.pool.num_kv_heads * head_chunks, std::min(kMaxGridZ, a.num_tokens - base));
    switch (heads) {
      case 1:
        SplitKvKernel<T, kLanes, 1>
            <<<grid, kThreads, 0, stream>>>(a, plan.num_splits, plan.keys_per_split, head_chunks, base, part);
        break;
      case 2:
        SplitKvKernel<T, kLanes, 2>
            <<<grid, kThreads, 0, stream>>>(a, plan.num_splits, plan.keys_per_split, head_chunks, base, part);
        break;
      default:
        SplitKvKernel<T, kLanes, kMaxHeads>
            <<<grid, kThreads, 0, stream>>>(a, plan.num_splits, plan.keys_per_split, head_chunks, base, part);
        break;
    }
  }
  if (plan.num_splits > 1) {
    const int threads = a.pool.head_dim >= 128 ? 128 : 64;
    CombineKernel<T><<<dim3(a.num_tokens, a.num_heads), threads, 0, stream>>>(a, plan.num_splits, part);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int LaunchForDim(const AttnArgs& a, const SplitPlan& plan, Partials part, cudaStream_t stream) {
  const int vecs = a.pool.head_dim / 8;  // 16-byte vectors per row
  if (vecs <= 1) return LaunchTyped<T, 1>(a, plan, part, stream);
  if (vecs <= 2) return LaunchTyped<T, 2>(a, plan, part, stream);
  if (vecs <= 4) return LaunchTyped<T, 4>(a, plan, part, stream);
  if (vecs <= 8) return LaunchTyped<T, 8>(a, plan, part, stream);
  if (vecs <= 16) return LaunchTyped<T, 16>(a, plan, part, stream);
  return LaunchTyped<T, 32>(a, plan, part, stream);
}

}  // namespace

int MaxUsefulSplits(int num_tokens, int num_sms) {
  const int64_t target = TargetCtas(num_sms);
  const int64_t tokens = std::max(1, num_tokens);
  return static_cast<int>(std::min<int64_t>(kMaxSplits, (target + tokens - 1) / tokens));
}

SplitPlan PlanSplits(const AttnArgs& a, int num_sms, int64_t workspace_bytes) {
  // Enough CTAs for about eight per SM (four are resident at a time: with
  // 32 KV rows of 16 bytes in flight per lane group that keeps the HBM busy;
  // at four per SM, batch 1 at 128k read at 0.57x of the copy on an H100);
  // at least 256 keys per split so the combine stays a small share; at most
  // kMaxSplits, and no more than the workspace holds.
  const int heads = HeadsPerCta(a.group);
  const int64_t units = int64_t{a.num_tokens} * a.pool.num_kv_heads * ((a.group + heads - 1) / heads);
  const int64_t target = TargetCtas(num_sms);
  int splits = static_cast<int>(std::min<int64_t>(kMaxSplits, (target + units - 1) / units));
  splits = std::max(1, std::min(splits, (a.max_context + 255) / 256));
  while (splits > 1 && SplitKvWorkspaceBytes(a.num_tokens, a.num_heads, a.pool.head_dim, splits) > workspace_bytes) {
    --splits;
  }
  constexpr int kAlign = 64;
  int per = (a.max_context + splits - 1) / splits;
  per = std::max(kAlign, (per + kAlign - 1) / kAlign * kAlign);
  SplitPlan plan;
  plan.keys_per_split = per;
  plan.num_splits = std::max(1, (a.max_context + per - 1) / per);
  return plan;
}

int64_t SplitKvWorkspaceBytes(int num_tokens, int num_heads, int head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  const int64_t rows = int64_t{num_tokens} * num_heads * num_splits;
  const int64_t o_bytes = (rows * head_dim * 4 + 255) / 256 * 256;
  return o_bytes + rows * 2 * 4;
}

int LaunchSplitKv(const AttnArgs& a, const SplitPlan& plan, void* workspace, int64_t workspace_bytes, void* stream) {
  (void)workspace_bytes;  // checked by the caller
  Partials part{};
  if (plan.num_splits > 1) {
    const int64_t rows = int64_t{a.num_tokens} * a.num_heads * plan.num_splits;
    const int64_t o_bytes = (rows * a.pool.head_dim * 4 + 255) / 256 * 256;
    part.o = static_cast<float*>(workspace);
    part.ml = reinterpret_cast<float*>(static_cast<char*>(workspace) + o_bytes);
  }
  auto s = static_cast<cudaStream_t>(stream);
  return a.elem == Elem::kBF16 ? LaunchForDim<__nv_bfloat16>(a, plan, part, s) : LaunchForDim<__half>(a, plan, part, s);
}

}  // namespace tandem::kernels::cuda::internal
