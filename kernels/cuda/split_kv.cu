// Split-KV ("flash-decoding") paged attention: the decode kernels. On
// tensor cores (DecodeStreamKernel, described below) for head_dim 64/128 and
// up to 16 query heads per KV head; otherwise on CUDA cores
// (SplitKvKernel), the general fallback for every shape the tensor-core
// kernel does not take (any head_dim that is a multiple of 8 up to 256).
// Both take any query count per sequence. Where a row's keys are split, each
// split writes partials (unnormalised output, max, sum) to the workspace
// and the CTA that finishes a unit's last split merges them (ArriveAndMerge:
// no second launch). The rest of this comment is SplitKvKernel's.
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
// normalised output; with several, its partials.
#include <algorithm>
#include <cfloat>

#include "kernels/cuda/async_copy.cuh"
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
// The most splits a row is cut into (PlanSplits and FixedPlan keep to it).
constexpr int kMaxSplitsPerRow = 128;

template <int kLanes>  // lanes per key: a power of two, 16 bytes each
__device__ __forceinline__ float GroupSum(float x) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

struct Partials {
  float* o;            // [tokens, heads, splits, head_dim]
  float* ml;           // [tokens, heads, splits, 2]: running max (log2 domain), sum
  unsigned* arrivals;  // [units]: splits done (ArriveAndMerge; back to 0 after the merge)
};

// Keys query token `token` of sequence `s` attends to: causally, its
// position + 1 (the cached prefix and the queries up to it); otherwise the
// whole context.
__device__ __forceinline__ int KeysIn(const AttnArgs& a, int s, int token) {
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  const int ctx = __ldg(&a.context_lens[s]);
  return a.causal ? ctx - q_len + (token - q_begin) + 1 : ctx;
}
__device__ __forceinline__ int KeysOf(const AttnArgs& a, int token) {
  return KeysIn(a, SequenceOf(a.query_start, a.num_seqs, token), token);
}

// One output element of a split's CTA: normalised into `out` when the
// call has one split, else the split's partials for MergeUnit (a negative
// sum marks a split that met a bad block id: the merge then writes the row
// as zeros, as one split does, not the other splits' partial answer).
template <typename T>
__device__ __forceinline__ void WriteSplitResult(const AttnArgs& a, const Partials& part, int token, int h, int d,
                                                 int split, int num_splits, float acc, float sum, float mx, bool bad) {
  const int head_dim = a.pool.head_dim;
  const int64_t row = int64_t{token} * a.num_heads + h;
  if (num_splits == 1) {
    const float r = sum > 0.0f && !bad ? acc / sum : 0.0f;
    T* out = static_cast<T*>(a.out) + row * head_dim + d;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      *out = __float2bfloat16_rn(r);
    } else {
      *out = __float2half_rn(r);
    }
  } else {
    const int64_t prow = row * num_splits + split;
    part.o[prow * head_dim + d] = acc;
    if (d == 0) {
      part.ml[prow * 2] = sum > 0.0f ? mx : -FLT_MAX;
      part.ml[prow * 2 + 1] = bad ? -1.0f : sum;
    }
  }
}

// The merge of one unit's splits (`rows` query heads from `head0`, at most
// 16) by the CTA that finished the unit's last split, with 128 threads
// (threadIdx.x 0-127) that sync on named barrier `bar`: warp w reduces rows
// w, w + 4, ... over the splits (max, bad flag, weights into `sm_w`
// [rows][kMaxSplitsPerRow], sum); then each thread takes 4 dims of a row
// and sums the splits' partial outputs, 8 loads of 16 bytes in flight (past
// L1: other CTAs wrote them). A fixed order for a given split count: the
// same bits for a row in any batch. Splits that start past the token's keys
// hold nothing and are not read.
template <typename T>
__device__ void MergeUnit(const AttnArgs& a, const Partials& part, int token, int head0, int rows, int num_splits,
                          int keys_per_split, float* sm_w, int bar) {
  __shared__ float sm_sum[16], sm_mx[16];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head_dim = a.pool.head_dim;
  const int n_keys = KeysOf(a, token);
  const int splits = max(1, min(num_splits, (n_keys + keys_per_split - 1) / keys_per_split));
  const int cached = min(splits, kMaxSplitsPerRow);
  const int64_t row0 = int64_t{token} * a.num_heads + head0;
  for (int g = warp; g < rows; g += 4) {
    const float* ml = part.ml + (row0 + g) * num_splits * 2;
    float mx = -FLT_MAX;
    int bad = 0;
    for (int j = lane; j < splits; j += 32) {
      mx = fmaxf(mx, __ldcg(&ml[j * 2]));
      bad |= __ldcg(&ml[j * 2 + 1]) < 0.0f;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    bad = __any_sync(0xffffffffu, bad);
    float sum = 0.0f;
    for (int j = lane; j < splits; j += 32) {
      const float lj = __ldcg(&ml[j * 2 + 1]);
      const float w = lj > 0.0f ? exp2f(__ldcg(&ml[j * 2]) - mx) : 0.0f;
      if (j < kMaxSplitsPerRow) sm_w[g * kMaxSplitsPerRow + j] = w;
      sum += w * lj;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      sm_sum[g] = bad ? 0.0f : sum;  // a bad block: the row is written as zeros
      sm_mx[g] = mx;
    }
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
  const int vecs = head_dim / 4;  // float4 columns of a row
  for (int e = tid; e < rows * vecs; e += 128) {
    const int g = e / vecs, d = (e % vecs) * 4;
    const float sum = sm_sum[g];
    const float* w = sm_w + g * kMaxSplitsPerRow;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (sum > 0.0f) {
      const float4* o = reinterpret_cast<const float4*>(part.o + (row0 + g) * num_splits * head_dim + d);
      int j = 0;
      for (; j + 8 <= cached; j += 8) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = __ldcg(&o[(j + u) * vecs]);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          acc.x += w[j + u] * v[u].x;
          acc.y += w[j + u] * v[u].y;
          acc.z += w[j + u] * v[u].z;
          acc.w += w[j + u] * v[u].w;
        }
      }
      for (; j < splits; ++j) {  // the rest, and fixed plans that cut a row more ways
        float wj = 0.0f;
        if (j < kMaxSplitsPerRow) {
          wj = w[j];
        } else {
          const float* ml = part.ml + (row0 + g) * num_splits * 2;
          const float lj = __ldcg(&ml[j * 2 + 1]);
          wj = lj > 0.0f ? exp2f(__ldcg(&ml[j * 2]) - sm_mx[g]) : 0.0f;
        }
        const float4 v = __ldcg(&o[int64_t{j} * vecs]);
        acc.x += wj * v.x;
        acc.y += wj * v.y;
        acc.z += wj * v.z;
        acc.w += wj * v.w;
      }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* out = static_cast<T*>(a.out) + (row0 + g) * head_dim + d;
    uint2 packed;
    packed.x = Pack2<T>(acc.x * inv, acc.y * inv);
    packed.y = Pack2<T>(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out) = packed;
  }
}

// Counts a split of `unit` in (after its partials were written and
// fenced): true in the one arrival that brings the count to `arrivals`,
// which also sets the counter back to 0 for the next launch.
__device__ __forceinline__ bool CountArrival(const Partials& part, int64_t unit, int arrivals) {
  const bool last = atomicAdd(&part.arrivals[unit], 1u) == static_cast<unsigned>(arrivals - 1);
  if (last) part.arrivals[unit] = 0;
  return last;
}

// After a CTA wrote its split's partials of a unit (arrival counter `unit`;
// query heads head0 .. head0 + rows - 1 of `token`): counts it in (fence,
// then the atomic, by thread 0 of the 128 that sync on `bar`) and, in the
// CTA that brings the count to `arrivals` (the unit's last split to
// finish), merges the splits. The counter goes back to 0 for the next
// launch.
template <typename T>
__device__ void ArriveAndMerge(const AttnArgs& a, const Partials& part, int64_t unit, int token, int head0, int rows,
                               int num_splits, int keys_per_split, int arrivals, float* sm_w, int bar) {
  __shared__ int sm_last;
  __threadfence();
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
  if (threadIdx.x == 0) sm_last = CountArrival(part, unit, arrivals);
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
  if (!sm_last) return;
  __threadfence();
  MergeUnit<T>(a, part, token, head0, rows, num_splits, keys_per_split, sm_w, bar);
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");  // sm_w and sm_last are free again
}

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
  const int n_keys = KeysIn(a, s, token);
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
    WriteSplitResult<T>(a, part, token, kv_head * a.group + g0 + g, d, split, num_splits, acc, sum, mx, bad);
  }
  if (num_splits > 1) {  // the unit's last split to finish merges them
    __shared__ float sm_w[kHeads * kMaxSplitsPerRow];
    ArriveAndMerge<T>(
        a, part, (int64_t{token} * a.pool.num_kv_heads + kv_head) * head_chunks + blockIdx.y % head_chunks, token,
        kv_head * a.group + g0, min(kHeads, a.group - g0), num_splits, keys_per_split, num_splits, sm_w, 0);
  }
}

// ---- Tensor-core decode (DecodeStreamKernel) -------------------------------
//
// For head_dim 64 or 128, bf16/f16, up to 16 query heads per KV head, and
// splits of whole 64-key tiles. An item is one query token, one KV head (all
// its query heads: the M rows of mma.sync m16n8k16, padded to 16) and one
// split. Each of four consumer warps takes 16 keys of a 64-key tile
// (MmaTileStep): S = Q K^T (Q fragments in registers, K by ldmatrix), its
// own online softmax, O += P V (V by ldmatrix.trans, P straight from the
// score registers).

// c += a * b for one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Keys per tile: 16 per warp. (In the grid-launched kernel this one
// replaced, 32-key tiles in four stages, 8 keys a warp and half of each PV
// step zeros, were 5-15% slower everywhere.)
constexpr int kMmaTile = 64;
constexpr int kMmaMaxGroup = 16;
// The tensor map's L2 promotion for the decode kernels (EncodePoolMap): 128
// bytes, a box row. 256 (the prefill's) read the KV at 4.30 TB/s on an H200
// at 8 GiB, 128 at 4.50 (cuDNN's rate on dense tensors): promoting a
// 128-byte row to 256 fetches the row's other half early, a second request
// for the same bytes.
constexpr int kDecodeL2Promotion = 2;

// A decode stage: a 64-key tile of K and V laid out as one TMA box a page
// lands it (EncodePoolMap with split_rows and kv_box 2): [page][K|V][slot x
// half][128 bytes], a half being 64 columns (head_dim 128 has two), each
// 128-byte row's 16-byte chunks swizzled by that row (the 128-byte
// swizzle; every page's K or V run is 1024-byte aligned as pages hold 16+
// slots). Eight keys at one column fall on four swizzle rows at head_dim
// 128: ldmatrix meets 2-way bank conflicts, and the box reads a page's
// rows whole, front to back.
template <int kD>
__device__ __forceinline__ uint32_t StageOffset(int kv, int r, int ch, int bs_shift) {
  constexpr int kHalves = kD / 64;
  const int row = (r & ((1 << bs_shift) - 1)) * kHalves + (ch >> 3);
  return static_cast<uint32_t>(((r >> bs_shift) * 2 + kv) * (kHalves * 128 << bs_shift) + row * 128 +
                               (((ch & 7) ^ (row & 7)) << 4));
}

// One warp's share of a 64-key tile (16 keys from `key0`) in `stage` (the
// layout above): S = Q K^T, the online-softmax update of
// (m, l) for its rows g (a) and g + 8 (b), O += P V. Keys at or past k_end
// are masked.
template <typename T, int kD>
__device__ __forceinline__ void MmaTileStep(uint32_t stage, int bs_shift, int warp, int lane,
                                            const uint32_t (&qa)[kD / 16][4], int key0, int k_end, float qk_scale,
                                            float (&o)[kD / 8][4], float& m_a, float& m_b, float& l_a, float& l_b) {
  const int t = lane % 4;
  float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const int r = warp * 16 + (lane & 7) + (lane >> 4) * 8;
    uint32_t b[4];
    LdMatrixX4(stage + StageOffset<kD>(0, r, kk * 2 + ((lane >> 3) & 1), bs_shift), b);
    Mma<T>(sc[0], qa[kk], b[0], b[1]);
    Mma<T>(sc[1], qa[kk], b[2], b[3]);
  }
  float mx_a = m_a, mx_b = m_b;
#pragma unroll
  for (int nn = 0; nn < 2; ++nn) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + nn * 8 + 2 * t + (e & 1);
      sc[nn][e] = key < k_end ? sc[nn][e] * qk_scale : -INFINITY;
    }
    mx_a = fmaxf(mx_a, fmaxf(sc[nn][0], sc[nn][1]));
    mx_b = fmaxf(mx_b, fmaxf(sc[nn][2], sc[nn][3]));
  }
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
  const float base_a = mx_a == -INFINITY ? 0.0f : mx_a;
  const float base_b = mx_b == -INFINITY ? 0.0f : mx_b;
  const float corr_a = exp2f(m_a - base_a), corr_b = exp2f(m_b - base_b);
  m_a = mx_a;
  m_b = mx_b;
#pragma unroll
  for (int nn = 0; nn < 2; ++nn) {
    sc[nn][0] = exp2f(sc[nn][0] - base_a);
    sc[nn][1] = exp2f(sc[nn][1] - base_a);
    sc[nn][2] = exp2f(sc[nn][2] - base_b);
    sc[nn][3] = exp2f(sc[nn][3] - base_b);
  }
  l_a = l_a * corr_a + sc[0][0] + sc[0][1] + sc[1][0] + sc[1][1];
  l_b = l_b * corr_b + sc[0][2] + sc[0][3] + sc[1][2] + sc[1][3];
  const uint32_t pa[4] = {Pack2<T>(sc[0][0], sc[0][1]), Pack2<T>(sc[0][2], sc[0][3]), Pack2<T>(sc[1][0], sc[1][1]),
                          Pack2<T>(sc[1][2], sc[1][3])};
#pragma unroll
  for (int dd = 0; dd < kD / 16; ++dd) {
    o[2 * dd][0] *= corr_a;
    o[2 * dd][1] *= corr_a;
    o[2 * dd][2] *= corr_b;
    o[2 * dd][3] *= corr_b;
    o[2 * dd + 1][0] *= corr_a;
    o[2 * dd + 1][1] *= corr_a;
    o[2 * dd + 1][2] *= corr_b;
    o[2 * dd + 1][3] *= corr_b;
    const int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    uint32_t b[4];
    LdMatrixX4Trans(stage + StageOffset<kD>(1, r, dd * 2 + (lane >> 4), bs_shift), b);
    Mma<T>(o[2 * dd], pa, b[0], b[1]);
    Mma<T>(o[2 * dd + 1], pa, b[2], b[3]);
  }
}

// ---- Persistent warp-specialized decode (DecodeStreamKernel) ---------------
//
// Organised as FlashAttention-3 organises prefill: a producer warp and four
// consumer warps, and a grid of as many CTAs as fit the GPU at once, each
// walking work items until none are left. Items are numbered split-fastest.
// The producer takes the next item from an atomic counter in the workspace
// (so CTAs that finish early take more) and streams its 64-key K/V tiles
// (TMA with a 128-byte L2 promotion, or cp.async for a tile that ends
// inside the split; each tile's block ids checked just before its load)
// through a ring of `kStages` stages; the item's query rows ride along
// with its first tile. Each stage carries a
// descriptor (item, tile, tile count) and completes on a "full" mbarrier;
// consumers release it on an "empty" mbarrier as soon as they have read it,
// so the producer runs ahead across item boundaries and no CTA-wide barrier
// stalls the loads. At an item's last tile the consumers merge their four
// states through shared memory (two rounds, fixed order: the same bits
// whatever the grid) and warp 0 writes the output or the split's partials;
// then ArriveAndMerge. Splits that start past a token's keys are skipped
// (MergeUnit does not read them).
constexpr int kStreamConsumers = 4;
constexpr int kStreamThreads = (kStreamConsumers + 1) * 32;
// Three stages of 64 keys (K and V) and two CTAs an SM (the most that fit
// two CTAs at head dim 128: the merge at an item's end borrows the stage of
// its last tile instead of buffers of its own). Persistent variants
// measured on an H200 (kernels/cuda/NOTES.md): four stages and one CTA an
// SM read 2-5% slower than two stages and two CTAs; items handed out by
// grid stride instead of the counter, slower where the item count is not a
// multiple of the grid.
constexpr int kStages = 3;

struct StreamItem {
  int token, kv_head, split, seq, k_begin, k_end, n_keys;
};

// What a stage carries besides its tile: which item and tile it is.
struct StageDesc {
  StreamItem it;
  int item;      // -1: no more items (nothing else is set)
  int tile;      // tile index within the item
  int n_tiles;   // the item's tiles
  int bad;       // a block id of this tile is out of range: nothing was loaded
  int item_bad;  // so was one of this or an earlier tile of the item's
};

template <int kD>
__host__ __device__ constexpr int StreamQBytes() {
  return 16 * kD * 2;
}
template <int kD>
__host__ __device__ constexpr int StreamSmemBytes() {
  // stages x (K + V tile + query rows) + alignment (the merge's two
  // [kD/8][32] float4 buffers fit in one stage's tile)
  static_assert(2 * 16 * kD * 4 <= 2 * kMmaTile * kD * 2);
  return kStages * (2 * kMmaTile * kD * 2 + StreamQBytes<kD>()) + 1024;
}

// Brings the lines an item's lookups read into L1 at once (the query
// starts and context length of `token`'s own sequence, the first block ids
// from `first_block`), so that DecodeItem's dependent loads (query starts,
// then the context length, then the block ids) take one memory round trip
// instead of three. A guess: right for decode batches (a token is its own
// sequence), harmless otherwise (the addresses are in the arrays). Four
// lines of block ids: 128 ids, a 2048-key item at pages of 16. Measured on
// an H200 (kernels/cuda/NOTES.md): 0.5-1% at short items (1 x 128, 1 x 8k,
// 64 x 1k), nothing at long ones.
__device__ __forceinline__ void PrefetchItemLookups(const AttnArgs& a, int token, int first_block, int lane) {
  if (a.num_seqs <= 0) return;
  const int seq = min(token, a.num_seqs - 1);
  auto prefetch = [](const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); };
  if (lane == 0) {
    prefetch(&a.query_start[seq]);
    prefetch(&a.context_lens[seq]);
  }
  const int b = first_block + 32 * lane;
  if (lane < 4 && b < a.max_blocks_per_seq) prefetch(a.block_tables + int64_t{seq} * a.max_blocks_per_seq + b);
}

// An item's token, KV head, split, sequence and key range; `lane` of the
// warp that asks (the producer), which prefetches the lookups first.
__device__ __forceinline__ StreamItem DecodeItem(const AttnArgs& a, int item, int num_splits, int keys_per_split,
                                                 int bs_shift, int lane) {
  StreamItem it;
  it.split = item % num_splits;
  const int unit = item / num_splits;
  it.kv_head = unit % a.pool.num_kv_heads;
  it.token = unit / a.pool.num_kv_heads;
  it.k_begin = it.split * keys_per_split;
  PrefetchItemLookups(a, it.token, it.k_begin >> bs_shift, lane);
  // Decode batches: sequence `token` holds just this token (no search).
  const bool own = it.token < a.num_seqs && __ldg(&a.query_start[it.token]) == it.token &&
                   __ldg(&a.query_start[it.token + 1]) == it.token + 1;
  it.seq = own ? it.token : SequenceOf(a.query_start, a.num_seqs, it.token);
  it.n_keys = KeysIn(a, it.seq, it.token);
  it.k_end = min(it.n_keys, it.k_begin + keys_per_split);
  return it;
}

// Diagnostic variants (kVar; prefill_check dbench only): bit 0 no math
// (the loads' own time), bit 1 a trace (per-CTA start, first tile and end
// times, items taken and the SM clock at start and end, into
// g_decode_trace; CopyDecodeTrace reads it), bit 2 no merge of the four
// consumer warps' states at an item's end (what the merge costs short
// items; results wrong), bit 3 the outputs merged in one round (warps 1-3
// hand theirs over at once, warp 0 adds them: one barrier fewer an item),
// bit 4 each consumer warp taking whole items in turn (no merge; unsplit
// plans only).
__device__ unsigned long long g_decode_trace[kDecodeTraceWords * kDecodeTraceCtas];  // launch.h: DecodeTraceWord
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void ConsumerBarrier() { asm volatile("bar.sync 1, %0;\n" ::"n"(kStreamConsumers * 32)); }

template <typename T, int kD, int kVar = 0>
__global__ void __launch_bounds__(kStreamThreads, 2)
    DecodeStreamKernel(AttnArgs a, const __grid_constant__ CUtensorMap pool_map, bool use_tma, int num_splits,
                       int keys_per_split, int num_items, Partials part, unsigned* sched) {
  constexpr int kChunks = kD / 8;
  constexpr int kTileBytes = kMmaTile * kD * 2;
  constexpr int kQBytes = StreamQBytes<kD>();
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  __shared__ StageDesc desc[kStages];
  __shared__ int owner_of[kStages];  // kWarpItems: the consumer warp that takes the stage's item
  __shared__ float sm_ml[kStreamConsumers][16][2];
  const uint32_t base = (SmemAddr(smem) + 1023) & ~1023u;
  unsigned char* aligned = smem + (base - SmemAddr(smem));
  const uint32_t qbase = base + kStages * 2 * kTileBytes;
  const unsigned char* qsmem = aligned + kStages * 2 * kTileBytes;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;
  constexpr bool kMath = (kVar & 1) == 0;
  constexpr bool kTrace = (kVar & 2) != 0;
  // Experiment: each consumer warp takes whole items in turn (all 64 keys of
  // their tiles), so nothing is merged at an item's end. Unsplit plans only
  // (LaunchSplitKvVariant).
  constexpr bool kWarpItems = (kVar & 16) != 0;
  // Diagnostic: without the merge, warp 0 writes its own state (results wrong).
  constexpr bool kMerge = (kVar & 4) == 0 && !kWarpItems;
  constexpr bool kOneRound = (kVar & 8) != 0;  // experiment: the outputs merged in one round
  static_assert(!kOneRound || 3 * 16 * kD * 4 <= 2 * kMmaTile * kD * 2, "three merge buffers in a stage");
  // This CTA's trace words (kTrace, the first kDecodeTraceCtas CTAs), else null.
  unsigned long long* const trace =
      kTrace && blockIdx.x < kDecodeTraceCtas ? g_decode_trace + blockIdx.x * kDecodeTraceWords : nullptr;
  if (trace != nullptr && tid == 0) {
    trace[kTraceStartNs] = GlobalTimer();
    trace[kTraceStartClock] = clock64();
  }

  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarInit(SmemAddr(&full[i]), 33);                      // lane 0's arrive (+ TMA bytes), and 32 cp.async arrivals
      MbarInit(SmemAddr(&empty[i]), kStreamConsumers * 32);  // every consumer thread releases
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == kStreamConsumers) {
    // ---- producer ----
    // The tensor map's descriptor, fetched while the first item's lookups
    // run rather than by the first TMA load after them.
    if (lane == 0 && use_tma) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&pool_map) : "memory");
    int taken = 0;
    auto grab = [&]() {
      if (taken++ == 0) return NextWorkItem(sched, 0);
      int next = 0;
      if (lane == 0) next = NextWorkItem(sched, 1);
      return __shfl_sync(0xffffffffu, next, 0);
    };
    // An item as the producer streams it. Its block ids are checked tile
    // by tile as the tiles load (a whole-item scan before the first load
    // cost a long item's first tile up to 30 us: 8192 ids at 128k keys).
    struct Prepared {
      StreamItem it;
      const int32_t* table;
      int item, n_tiles;
      int32_t block0;  // this lane's block id of the first tile (lanes < its pages)
      bool done, skip;
    };
    // A tile's pages (the last tile of an item may hold fewer keys).
    auto pages_of = [&](const StreamItem& it, int key0) {
      return (min(it.k_end, key0 + kMmaTile) - key0 + a.pool.block_size - 1) >> bs_shift;
    };
    auto prepare = [&](int item) {
      Prepared p{};
      p.item = item;
      p.done = item >= num_items;
      if (p.done) return p;
      p.it = DecodeItem(a, item, num_splits, keys_per_split, bs_shift, lane);
      p.skip = p.it.k_begin >= p.it.k_end;  // past this token's keys
      if (p.skip) return p;
      p.table = a.block_tables + int64_t{p.it.seq} * a.max_blocks_per_seq;
      p.n_tiles = (p.it.k_end - p.it.k_begin + kMmaTile - 1) / kMmaTile;
      p.block0 = lane < pages_of(p.it, p.it.k_begin) ? __ldg(&p.table[(p.it.k_begin >> bs_shift) + lane]) : 0;
      return p;
    };
    const T* pool = static_cast<const T*>(a.pool.kv);
    int st = 0, ph = 0;
    int ordinal = 0;  // kWarpItems: items this CTA has started
    Prepared cur = prepare(grab());
    for (;;) {
      if (cur.skip) {
        cur = prepare(grab());
        continue;
      }
      const StreamItem& it = cur.it;
      const int fills = cur.done ? 1 : cur.n_tiles;
      const int owner = cur.done ? 0 : ordinal++ % kStreamConsumers;
      Prepared next{};
      int32_t next_block = cur.block0;  // the ids are read a tile ahead of their check and load
      int item_bad = 0;
      for (int t = 0; t < fills; ++t) {
        const uint32_t f = SmemAddr(&full[st]);
        MbarWait(SmemAddr(&empty[st]), ph ^ 1);
        const int key0 = it.k_begin + t * kMmaTile;
        // The tile's block ids: one a lane, checked before any load. A bad
        // id loads nothing for the tile; the consumers then write the
        // item's rows as zeros (or mark its partials bad).
        const int pages = pages_of(it, key0);
        const int32_t block = next_block;
        int bad = 0;
        if (!cur.done) {
          bad = __any_sync(0xffffffffu, lane < pages && (block < 0 || block >= a.pool.num_blocks)) ? 1 : 0;
          if (bad && lane == 0) RecordError(a.error, kErrBlockId, it.seq);
          item_bad |= bad;
        }
        const bool load = !cur.done && !bad;
        const bool tma = load && use_tma && key0 + kMmaTile <= it.k_end;
        if (lane == 0) {
          desc[st] = StageDesc{it, cur.done ? -1 : cur.item, t, cur.n_tiles, bad, item_bad};
          if constexpr (kWarpItems) owner_of[st] = owner;
          MbarArriveExpectTx(f, tma ? 2 * kTileBytes : 0);
        }
        __syncwarp();
        const uint32_t dk = base + st * 2 * kTileBytes;
        if (!cur.done && t == 0) {  // the item's query rows, zero past the group
          const T* q = static_cast<const T*>(a.q) + int64_t{it.token} * a.q_stride + int64_t{it.kv_head} * a.group * kD;
          for (int c = lane; c < 16 * kChunks; c += 32) {
            const int row = c / kChunks, ch = c % kChunks;
            CpAsync16(qbase + st * kQBytes + c * 16, row < a.group ? q + row * kD + ch * 8 : q, row < a.group ? 16 : 0);
          }
        }
        if (tma) {
          // Lane p issues page p's box: its K and V, whole rows.
          if (lane < pages) {
            // The stage was last read by ldmatrix (generic proxy; the empty
            // barrier orders those reads before this): order them before the
            // async writes.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            TmaLoadBox(dk + lane * (2 * kD * 2 << bs_shift), &pool_map, 0, 0, it.kv_head, 0, block, f);
          }
        } else if (load) {
          for (int c = lane; c < 2 * kMmaTile * kChunks; c += 32) {
            const int kv = c / (kMmaTile * kChunks);
            const int r = (c / kChunks) % kMmaTile, ch = c % kChunks;
            const int key = key0 + r;
            const T* src = pool;
            int bytes = 0;
            const int32_t id = __shfl_sync(0xffffffffu, block, (key - key0) >> bs_shift);  // every lane
            if (key < it.k_end) {
              src = pool + PoolOffset(a.pool, id, kv, it.kv_head, key & bs_mask) + ch * 8;
              bytes = 16;
            }
            CpAsync16(dk + StageOffset<kD>(kv, r, ch, bs_shift), src, bytes);
          }
        }
        MbarArriveOnCpAsync(f);
        if (!cur.done && t + 1 < fills) {
          const int key1 = key0 + kMmaTile;
          next_block = lane < pages_of(it, key1) ? __ldg(&cur.table[(key1 >> bs_shift) + lane]) : 0;
          // Keeps the block table's lines in L1 ahead of the loads: the line
          // 128 ids on (32 tiles at pages of 16), after the item's first 128
          // that PrefetchItemLookups brought.
          const int ahead = (key0 >> bs_shift) + 128;
          if (lane == 0 && ahead <= (it.k_end - 1) >> bs_shift) {
            asm volatile("prefetch.global.L1 [%0];\n" ::"l"(cur.table + ahead));
          }
        }
        if (++st == kStages) {
          st = 0;
          ph ^= 1;
        }
        // The next item's lookups run while this item's first tiles load.
        if (t == 0 && !cur.done) next = prepare(grab());
      }
      if (cur.done) break;
      cur = next;
    }
    if (lane == 0) ReleaseWorkCounter(sched);
    return;
  }

  // ---- consumers ----
  const int g = lane / 4, t = lane % 4;
  const float qk_scale = a.scale * kLog2e;
  uint32_t qa[kD / 16][4];
  float o[kD / 8][4];
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
  int st = 0, ph = 0;
  int traced_items = 0;
  for (;;) {
    MbarWait(SmemAddr(&full[st]), ph);
    if (trace != nullptr && tid == 0 && traced_items == 0) trace[kTraceFirstTileNs] = GlobalTimer();
    const StageDesc d = desc[st];
    if (d.item < 0) break;
    if constexpr (kWarpItems) {
      if (owner_of[st] != warp) {  // another warp's item: release the stage at once
        MbarArrive(SmemAddr(&empty[st]));
        if (++st == kStages) {
          st = 0;
          ph ^= 1;
        }
        continue;
      }
    }
    if (kTrace && d.tile == 0) ++traced_items;
    const StreamItem& it = d.it;
    if (d.tile == 0) {
      const auto* q = reinterpret_cast<const uint32_t*>(qsmem + st * kQBytes);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = g + (i & 1) * 8;
          const int col = kk * 16 + 2 * t + (i >> 1) * 8;
          qa[kk][i] = q[(row * kD + col) / 2];
        }
      }
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
      m_a = m_b = -INFINITY;
      l_a = l_b = 0.0f;
    }
    if (kMath && !d.bad) {
      const uint32_t ck = base + st * 2 * kTileBytes;
      if constexpr (kWarpItems) {
#pragma unroll 1
        for (int part = 0; part < kStreamConsumers; ++part) {
          MmaTileStep<T, kD>(ck, bs_shift, part, lane, qa, it.k_begin + d.tile * kMmaTile + part * 16, it.k_end,
                             qk_scale, o, m_a, m_b, l_a, l_b);
        }
      } else {
        MmaTileStep<T, kD>(ck, bs_shift, warp, lane, qa, it.k_begin + d.tile * kMmaTile + warp * 16, it.k_end, qk_scale,
                           o, m_a, m_b, l_a, l_b);
      }
    }
    const int used = st;
    if (++st == kStages) {
      st = 0;
      ph ^= 1;
    }
    if (d.tile + 1 < d.n_tiles) {
      MbarArrive(SmemAddr(&empty[used]));
      continue;
    }

    // The item's last tile: merge the four warps' states, through the
    // tile's stage (released after the merge; the other stages load on).
    // (m, l) first.
    auto* merge = reinterpret_cast<float4*>(aligned + used * 2 * kTileBytes);  // [2][kD/8][32]
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    float mx_a = m_a, mx_b = m_b, sum_a = l_a, sum_b = l_b;
    if constexpr (kMerge) {
      if (t == 0) {
        sm_ml[warp][g][0] = m_a;
        sm_ml[warp][g][1] = l_a;
        sm_ml[warp][g + 8][0] = m_b;
        sm_ml[warp][g + 8][1] = l_b;
      }
      ConsumerBarrier();
      mx_a = -INFINITY;
      mx_b = -INFINITY;
#pragma unroll
      for (int w = 0; w < kStreamConsumers; ++w) {
        if (sm_ml[w][g][1] > 0.0f) mx_a = fmaxf(mx_a, sm_ml[w][g][0]);
        if (sm_ml[w][g + 8][1] > 0.0f) mx_b = fmaxf(mx_b, sm_ml[w][g + 8][0]);
      }
      sum_a = sum_b = 0.0f;
      float self_a = 0.0f, self_b = 0.0f;
#pragma unroll
      for (int w = 0; w < kStreamConsumers; ++w) {
        const float la = sm_ml[w][g][1], lb = sm_ml[w][g + 8][1];
        const float wa = la > 0.0f ? exp2f(sm_ml[w][g][0] - mx_a) : 0.0f;
        const float wb = lb > 0.0f ? exp2f(sm_ml[w][g + 8][0] - mx_b) : 0.0f;
        sum_a += wa * la;
        sum_b += wb * lb;
        if (w == warp) {
          self_a = wa;
          self_b = wb;
        }
      }
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[n][0] *= self_a;
        o[n][1] *= self_a;
        o[n][2] *= self_b;
        o[n][3] *= self_b;
      }
      // Hands this warp's output over through buffer `b` ([kD/8][32] float4)
      // or adds the one handed over.
      auto put = [&](float4* b) {
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) b[n * 32 + lane] = make_float4(o[n][0], o[n][1], o[n][2], o[n][3]);
      };
      auto add = [&](const float4* b) {
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          const float4 v = b[n * 32 + lane];
          o[n][0] += v.x;
          o[n][1] += v.y;
          o[n][2] += v.z;
          o[n][3] += v.w;
        }
      };
      if constexpr (kOneRound) {
        // Warps 1-3 hand their outputs over at once; warp 0 adds them in order.
        if (warp != 0) put(merge + (warp - 1) * (kD / 8) * 32);
        ConsumerBarrier();
        if (warp == 0) {
#pragma unroll 1
          for (int w = 0; w < kStreamConsumers - 1; ++w) add(merge + w * (kD / 8) * 32);
        }
      } else {
        // Round 1: warps 1 and 3 hand their outputs to warps 0 and 2.
        float4* buf = merge + (warp >> 1) * (kD / 8) * 32;
        if (warp & 1) put(buf);
        ConsumerBarrier();
        if (!(warp & 1)) add(buf);
        // Round 2: warp 2 hands its sum to warp 0 (through the buffer it just read).
        if (warp == 2) put(buf);
        ConsumerBarrier();
        if (warp == 0) add(merge + (kD / 8) * 32);
      }
    }
    const bool bad = d.item_bad != 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = g + half * 8;
      if ((!kWarpItems && warp != 0) || row >= a.group) continue;  // (kWarpItems: only the owner is here)
      const float sum = half ? sum_b : sum_a;
      const float mx = half ? mx_b : mx_a;
      const int64_t out_row = int64_t{it.token} * a.num_heads + int64_t{it.kv_head} * a.group + row;
      if (num_splits == 1) {
        const bool zero = bad || !(sum > 0.0f);
        const float inv = zero ? 0.0f : 1.0f / sum;
        T* out = static_cast<T*>(a.out) + out_row * kD + 2 * t;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          *reinterpret_cast<uint32_t*>(out + n * 8) =
              zero ? 0u : Pack2<T>(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
        }
      } else {
        const int64_t prow = out_row * num_splits + it.split;
        float* po = part.o + prow * kD + 2 * t;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          *reinterpret_cast<float2*>(po + n * 8) = make_float2(o[n][2 * half], o[n][2 * half + 1]);
        }
        if (t == 0) {
          part.ml[prow * 2] = sum > 0.0f ? mx : -FLT_MAX;
          part.ml[prow * 2 + 1] = bad ? -1.0f : sum;
        }
      }
    }
    // The unit's last split to finish merges them (no second launch).
    if (!kWarpItems && num_splits > 1) {
      const int arrivals = max(1, min(num_splits, (it.n_keys + keys_per_split - 1) / keys_per_split));
      ArriveAndMerge<T>(a, part, int64_t{it.token} * a.pool.num_kv_heads + it.kv_head, it.token, it.kv_head * a.group,
                        a.group, num_splits, keys_per_split, arrivals, reinterpret_cast<float*>(merge), 1);
    }
    MbarArrive(SmemAddr(&empty[used]));
  }
  if (trace != nullptr && tid == 0) {
    trace[kTraceEndNs] = GlobalTimer();
    trace[kTraceItems] = traced_items;
    trace[kTraceEndClock] = clock64();
  }
}

// Resident CTAs of DecodeStreamKernel an SM holds (from the occupancy API,
// once per instantiation; also sets its shared-memory size).
template <typename T, int kD, int kVar = 0>
int StreamCtasPerSm() {
  static const int n = [] {
    int blocks = 0;
    auto* kernel = DecodeStreamKernel<T, kD, kVar>;
    constexpr int kSmem = StreamSmemBytes<kD>();
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kStreamThreads, kSmem) != cudaSuccess) {
      return 1;
    }
    return blocks > 0 ? blocks : 1;
  }();
  return n;
}

// `sched`: two zeroed words of the workspace, the work counter and the
// CTAs' exit count (the kernel leaves them zero).
template <typename T, int kD, int kVar = 0>
int LaunchStream(const AttnArgs& a, const SplitPlan& plan, Partials part, unsigned* sched, cudaStream_t stream) {
  const int per_sm = StreamCtasPerSm<T, kD, kVar>();
  CUtensorMap map{};
  const bool use_tma = EncodePoolMap(a, a.pool.block_size, &map, kDecodeL2Promotion, /*kv_box=*/2, /*split_rows=*/true);
  const int64_t items = int64_t{a.num_tokens} * a.pool.num_kv_heads * plan.num_splits;
  if (items >= (int64_t{1} << 31)) return static_cast<int>(cudaErrorInvalidValue);
  const int sms = a.num_sms > 0 ? a.num_sms : 132;
  const int grid = static_cast<int>(std::min<int64_t>(items, int64_t{per_sm} * sms));
  DecodeStreamKernel<T, kD, kVar><<<grid, kStreamThreads, StreamSmemBytes<kD>(), stream>>>(
      a, map, use_tma, plan.num_splits, plan.keys_per_split, static_cast<int>(items), part, sched);
  return static_cast<int>(cudaGetLastError());
}

// True where DecodeStreamKernel takes the call (before the split plan).
bool MmaShapeSupported(const AttnArgs& a) {
  const PoolView& p = a.pool;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.block_size != 16 && p.block_size != 32 && p.block_size != 64) return false;
  if (a.elem != Elem::kBF16 && a.elem != Elem::kF16) return false;
  if (a.group <= 0 || a.group > kMmaMaxGroup || a.num_heads != p.num_kv_heads * a.group) return false;
  if (a.q_stride % 8 != 0 || p.block_stride % 8 != 0 || p.kv_stride % 8 != 0 || p.head_stride % 8 != 0) return false;
  if (reinterpret_cast<uintptr_t>(a.q) % 16 != 0 || reinterpret_cast<uintptr_t>(p.kv) % 16 != 0) return false;
  return p.num_kv_heads <= 65535;
}

constexpr int kMaxSplits = kMaxSplitsPerRow;
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
  // At least 256 keys per split (128 for DecodeStreamKernel, whose items
  // cost less to start) so the merge stays a small share; at most kMaxSplits,
  // and no more than the workspace holds. Splits are whole 64-key tiles.
  constexpr int kAlign = 64;
  const bool mma = MmaShapeSupported(a);
  const int heads = mma ? a.group : HeadsPerCta(a.group);
  const int64_t units = int64_t{a.num_tokens} * a.pool.num_kv_heads * ((a.group + heads - 1) / heads);
  const int min_keys = mma ? 128 : 256;
  int max_splits = std::max(1, std::min(kMaxSplits, (a.max_context + min_keys - 1) / min_keys));
  while (max_splits > 1 &&
         SplitKvWorkspaceBytes(a.num_tokens, a.num_heads, a.pool.head_dim, max_splits) > workspace_bytes) {
    --max_splits;
  }
  auto plan_for = [&](int splits) {
    SplitPlan plan;
    int per = (a.max_context + splits - 1) / splits;
    plan.keys_per_split = std::max(kAlign, (per + kAlign - 1) / kAlign * kAlign);
    plan.num_splits = std::max(1, (a.max_context + plan.keys_per_split - 1) / plan.keys_per_split);
    return plan;
  };
  if (!mma) {
    // Enough CTAs for about eight per SM (four are resident at a time: with
    // 32 KV rows of 16 bytes in flight per lane group that keeps the HBM
    // busy; at four per SM, batch 1 at 128k read at 0.57x of the copy on an
    // H100).
    const int64_t target = TargetCtas(num_sms);
    return plan_for(static_cast<int>(std::min<int64_t>(max_splits, (target + units - 1) / units)));
  }
  // DecodeStreamKernel, whose persistent CTAs (two an SM) take (token, KV
  // head, split) items from an atomic counter: the fewest splits whose
  // items fill at least 90% of the rounds they run in, a round being one
  // item an SM while they are no more than the SMs, else one a CTA. Fewer,
  // longer items cost less (each ends in a merge that stalls its CTA's
  // consumers); rounds that end together leave no SM idle at the end; and
  // while the work is short of the grid, one CTA an SM streams its three
  // stages with the memory system to itself. Measured in one run each
  // (kernels/cuda/NOTES.md, 2026-11-27 night): on an H200, 64 x 8k (512
  // units) 516 us in 5 splits, 494 unsplit (97% of two rounds of CTAs); 16
  // x 32k (128 units) 488 us in 2 splits, 523 unsplit with two stages; 1 x
  // 128k 138.6 us in 128 items, 147.6 in 264; on an H100, 1 x 8k 25.0 us in
  // 128 items, 29.1 in 256.
  const int64_t sms = num_sms > 0 ? num_sms : 132;
  for (int s = 1; s < max_splits; ++s) {
    const SplitPlan plan = plan_for(s);
    const int64_t items = units * plan.num_splits;
    const int64_t round = items <= sms ? sms : 2 * sms;
    const int64_t rounds = (items + round - 1) / round;
    if (items * 10 >= rounds * round * 9) return plan;
  }
  return plan_for(max_splits);
}

namespace {
// The partials' layout in the workspace (after the error word): o, (m, l),
// then one arrival counter per (token, head) (an upper bound on the units).
Partials PartialsAt(void* workspace, int num_tokens, int num_heads, int head_dim, int num_splits, int64_t* bytes) {
  Partials part{};
  const int64_t rows = int64_t{num_tokens} * num_heads * num_splits;
  const int64_t o_bytes = (rows * head_dim * 4 + 255) / 256 * 256;
  const int64_t ml_bytes = (rows * 2 * 4 + 255) / 256 * 256;
  auto* base = static_cast<char*>(workspace);
  part.o = reinterpret_cast<float*>(base);
  part.ml = reinterpret_cast<float*>(base + o_bytes);
  part.arrivals = reinterpret_cast<unsigned*>(base + o_bytes + ml_bytes);
  *bytes = o_bytes + ml_bytes + int64_t{num_tokens} * num_heads * 4;
  return part;
}
}  // namespace

// Copies g_decode_trace (launch.h's layout) to `host`.
int CopyDecodeTrace(unsigned long long* host) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, g_decode_trace, sizeof(g_decode_trace)));
}

int64_t SplitKvWorkspaceBytes(int num_tokens, int num_heads, int head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  int64_t bytes = 0;
  PartialsAt(nullptr, num_tokens, num_heads, head_dim, num_splits, &bytes);
  return bytes;
}

int LaunchSplitKvVariant(const AttnArgs& a, const SplitPlan& plan, void* workspace, int64_t workspace_bytes,
                         void* stream, int variant) {
  (void)workspace_bytes;  // checked by the caller
  Partials part{};
  if (plan.num_splits > 1) {
    int64_t bytes = 0;
    part = PartialsAt(workspace, a.num_tokens, a.num_heads, a.pool.head_dim, plan.num_splits, &bytes);
  }
  auto s = static_cast<cudaStream_t>(stream);
  const bool streams = MmaShapeSupported(a) && plan.keys_per_split % kMmaTile == 0;
  // The work counter: in the zeroed head of the workspace, past the error
  // word.
  unsigned* sched = reinterpret_cast<unsigned*>(a.error) + 32;
  if (streams && a.pool.head_dim == 128 && a.elem == Elem::kBF16) {  // diagnostics and experiments (kVar)
    switch (variant) {
      case 2:
        return LaunchStream<__nv_bfloat16, 128, 1>(a, plan, part, sched, s);
      case 3:
        return LaunchStream<__nv_bfloat16, 128, 2>(a, plan, part, sched, s);
      case 5:  // the trace without the math
        return LaunchStream<__nv_bfloat16, 128, 3>(a, plan, part, sched, s);
      case 6:  // no merge of the four warps' states at an item's end
        return LaunchStream<__nv_bfloat16, 128, 4>(a, plan, part, sched, s);
      case 7:  // the outputs merged in one round
        return LaunchStream<__nv_bfloat16, 128, 8>(a, plan, part, sched, s);
      case 8:  // each consumer warp takes whole items (unsplit plans; else the default kernel)
        return plan.num_splits == 1 ? LaunchStream<__nv_bfloat16, 128, 16>(a, plan, part, sched, s)
                                    : LaunchStream<__nv_bfloat16, 128, 0>(a, plan, part, sched, s);
      default:
        break;
    }
  }
  if (variant == 0 && streams) {
    if (a.pool.head_dim == 64) {
      return a.elem == Elem::kBF16 ? LaunchStream<__nv_bfloat16, 64>(a, plan, part, sched, s)
                                   : LaunchStream<__half, 64>(a, plan, part, sched, s);
    }
    return a.elem == Elem::kBF16 ? LaunchStream<__nv_bfloat16, 128>(a, plan, part, sched, s)
                                 : LaunchStream<__half, 128>(a, plan, part, sched, s);
  }
  return a.elem == Elem::kBF16 ? LaunchForDim<__nv_bfloat16>(a, plan, part, s) : LaunchForDim<__half>(a, plan, part, s);
}

int LaunchSplitKv(const AttnArgs& a, const SplitPlan& plan, void* workspace, int64_t workspace_bytes, void* stream) {
  return LaunchSplitKvVariant(a, plan, workspace, workspace_bytes, stream, 0);
}

}  // namespace tandem::kernels::cuda::internal
