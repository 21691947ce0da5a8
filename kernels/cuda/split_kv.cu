// Split-KV ("flash-decoding") paged attention: the decode kernels. On
// tensor cores (DecodeMmaKernel, described below) for head_dim 64/128 and
// up to 16 query heads per KV head; otherwise on CUDA cores
// (SplitKvKernel), the general fallback for every shape the tensor-core
// kernels do not take (any query count per sequence, any head_dim that is
// a multiple of 8 up to 256). The rest of this comment is SplitKvKernel's.
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

// One output element of a split's CTA: normalised into `out` when the
// call has one split, else the split's partials for CombineKernel (a
// negative sum marks a split that met a bad block id: the combine then
// writes the row as zeros, as one split does, not the other splits' partial
// answer).
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

// ---- Tensor-core decode (DecodeMmaKernel) -----------------------------------
//
// For head_dim 64 or 128, bf16/f16, up to 16 query heads per KV head, and
// splits of whole 64-key tiles. A CTA serves one query token, one KV head
// (all its query heads: the M rows of mma.sync m16n8k16, padded to 16) and
// one split. K and V tiles of 64 keys go through a two-stage ring in shared
// memory: whole pages by TMA (the prefill's tensor map; a tile that ends
// inside a page, or a pool the map cannot describe, by cp.async with the
// keys past the split zero-filled), completing on one mbarrier per stage.
// Each of the four warps takes 16 keys of a tile: S = Q K^T (Q fragments in
// registers, K by ldmatrix), its own online softmax, O += P V (V by
// ldmatrix.trans, P straight from the score registers). The warps' states
// merge through shared memory; the output or the split's partials are laid
// out as SplitKvKernel's, so CombineKernel merges either.

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
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

// Keys per tile: 16 per warp. Three stages (two CTAs an SM) were 3-10%
// faster at batch 1 and 15-20% slower at 512 MiB; four stages of 32 keys
// (8 per warp, half of each PV step zeros) were 5-15% slower everywhere.
constexpr int kMmaTile = 64;
constexpr int kMmaStages = 2;
constexpr int kMmaMaxGroup = 16;

template <int kD>
constexpr int MmaSmemBytes() {
  return kMmaStages * 2 * kMmaTile * kD * 2 + 1024;  // stages x (K + V) + alignment
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads)
    DecodeMmaKernel(AttnArgs a, const __grid_constant__ CUtensorMap pool_map, bool use_tma, int num_splits,
                    int keys_per_split, int token_base, Partials part) {
  constexpr int kChunks = kD / 8;
  constexpr int kTileBytes = kMmaTile * kD * 2;
  constexpr int kPanel = kMmaTile * 128;
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMmaStages];
  __shared__ int sm_bad;
  const uint32_t base = (SmemAddr(smem) + 1023) & ~1023u;
  auto* aligned = smem + (base - SmemAddr(smem));

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int token = token_base + blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  const int s = SequenceOf(a.query_start, a.num_seqs, token);
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  const int ctx = __ldg(&a.context_lens[s]);
  const int n_keys = a.causal ? ctx - q_len + (token - q_begin) + 1 : ctx;
  const int k_begin = split * keys_per_split;
  const int k_end = min(n_keys, k_begin + keys_per_split);
  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;

  if (tid == 0) {
    sm_bad = 0;
    for (int i = 0; i < kMmaStages; ++i) MbarInit(SmemAddr(&bars[i]), kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (k_begin < k_end) {
    for (int b = (k_begin >> bs_shift) + tid; b <= (k_end - 1) >> bs_shift; b += kThreads) {
      const int32_t id = __ldg(&table[b]);
      if (id < 0 || id >= a.pool.num_blocks) sm_bad = 1;
    }
  }
  __syncthreads();
  const bool bad = sm_bad != 0;
  if (bad && tid == 0) RecordError(a.error, kErrBlockId, s);
  const int n_tiles = bad || k_begin >= k_end ? 0 : (k_end - k_begin + kMmaTile - 1) / kMmaTile;

  const T* pool = static_cast<const T*>(a.pool.kv);
  // Tile `tile` of the split into stage `st`.
  auto load = [&](int tile, int st) {
    const int key0 = k_begin + tile * kMmaTile;
    const uint32_t dk = base + st * 2 * kTileBytes;
    const uint32_t full = SmemAddr(&bars[st]);
    if (use_tma && key0 + kMmaTile <= k_end) {
      if (tid == 0) {
        MbarArriveExpectTx(full, 2 * kTileBytes);
      } else {
        MbarArrive(full);
      }
      const int pages = kMmaTile >> bs_shift;
      if (tid < 2 * pages) {
        const int page = tid % pages, kv = tid / pages;
        const int32_t block = __ldg(&table[(key0 >> bs_shift) + page]);
        // The stage was last read by ldmatrix (generic proxy; the CTA barrier
        // orders those reads before this): order them before the async writes.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#pragma unroll
        for (int c = 0; c < kD / 64; ++c) {
          TmaLoadBox(dk + kv * kTileBytes + c * kPanel + (page << bs_shift) * 128, &pool_map, c * 64, 0, kv_head, kv,
                     block, full);
        }
      }
      return;
    }
    for (int c = tid; c < 2 * kMmaTile * kChunks; c += kThreads) {
      const int kv = c / (kMmaTile * kChunks);
      const int r = (c / kChunks) % kMmaTile, ch = c % kChunks;
      const int key = key0 + r;
      const T* src = pool;
      int bytes = 0;
      if (key < k_end) {
        const int32_t block = __ldg(&table[key >> bs_shift]);
        src = pool + PoolOffset(a.pool, block, kv, kv_head, key & bs_mask) + ch * 8;
        bytes = 16;
      }
      CpAsync16(dk + kv * kTileBytes + PanelOffset<kD>(kMmaTile, r, ch), src, bytes);
    }
    MbarArriveOnCpAsync(full);
  };
  for (int i = 0; i < min(kMmaStages, n_tiles); ++i) load(i, i);

  // Q fragments (rows: the group's query heads, zero past the group).
  uint32_t qa[kD / 16][4];
  {
    const T* q = static_cast<const T*>(a.q) + int64_t{token} * a.q_stride + int64_t{kv_head} * a.group * kD;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = g + (i & 1) * 8;
        const int col = kk * 16 + 2 * t + (i >> 1) * 8;
        qa[kk][i] = row < a.group ? __ldg(reinterpret_cast<const uint32_t*>(q + row * kD + col)) : 0u;
      }
    }
  }
  const float qk_scale = a.scale * kLog2e;
  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int st = tile % kMmaStages;
    MbarWait(SmemAddr(&bars[st]), (tile / kMmaStages) & 1);
    const uint32_t ck = base + st * 2 * kTileBytes, cv = ck + kTileBytes;
    const int key0 = k_begin + tile * kMmaTile + warp * 16;  // this warp's 16 keys
    float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int r = warp * 16 + (lane & 7) + (lane >> 4) * 8;
      uint32_t b[4];
      LdMatrixX4(ck + PanelOffset<kD>(kMmaTile, r, kk * 2 + ((lane >> 3) & 1)), b);
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
      LdMatrixX4Trans(cv + PanelOffset<kD>(kMmaTile, r, dd * 2 + (lane >> 4)), b);
      Mma<T>(o[2 * dd], pa, b[0], b[1]);
      Mma<T>(o[2 * dd + 1], pa, b[2], b[3]);
    }
    __syncthreads();  // every warp is done with this stage
    if (tile + kMmaStages < n_tiles) load(tile + kMmaStages, st);
  }

  // Merge the warps: (m, l) per row and the rows' outputs through shared
  // memory (the stages are free now).
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  auto* sm_o = reinterpret_cast<float*>(aligned);  // [warp][16 rows][kD]
  __shared__ float sm_m[kWarps][16], sm_l[kWarps][16];
  if (t == 0) {
    sm_m[warp][g] = m_a;
    sm_m[warp][g + 8] = m_b;
    sm_l[warp][g] = l_a;
    sm_l[warp][g + 8] = l_b;
  }
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    float* row_a = sm_o + (warp * 16 + g) * kD + n * 8 + 2 * t;
    float* row_b = row_a + 8 * kD;
    row_a[0] = o[n][0];
    row_a[1] = o[n][1];
    row_b[0] = o[n][2];
    row_b[1] = o[n][3];
  }
  __syncthreads();
  for (int e = tid; e < a.group * kD; e += kThreads) {
    const int row = e / kD, d = e % kD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (sm_l[w][row] > 0.0f) mx = fmaxf(mx, sm_m[w][row]);
    }
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (sm_l[w][row] > 0.0f) {
        const float wt = exp2f(sm_m[w][row] - mx);
        sum += wt * sm_l[w][row];
        acc += wt * sm_o[(w * 16 + row) * kD + d];
      }
    }
    WriteSplitResult<T>(a, part, token, kv_head * a.group + row, d, split, num_splits, acc, sum, mx, bad);
  }
}

template <typename T, int kD>
int LaunchMma(const AttnArgs& a, const SplitPlan& plan, Partials part, cudaStream_t stream) {
  constexpr int kSmem = MmaSmemBytes<kD>();
  auto* kernel = DecodeMmaKernel<T, kD>;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  CUtensorMap map{};
  const bool use_tma = EncodePoolMap(a, a.pool.block_size, &map);
  constexpr int kMaxGridZ = 65535;
  for (int base = 0; base < a.num_tokens; base += kMaxGridZ) {
    const dim3 grid(plan.num_splits, a.pool.num_kv_heads, std::min(kMaxGridZ, a.num_tokens - base));
    kernel<<<grid, kThreads, kSmem, stream>>>(a, map, use_tma, plan.num_splits, plan.keys_per_split, base, part);
  }
  if (plan.num_splits > 1) {
    CombineKernel<T><<<dim3(a.num_tokens, a.num_heads), kD, 0, stream>>>(a, plan.num_splits, part);
  }
  return static_cast<int>(cudaGetLastError());
}

// True where DecodeMmaKernel takes the call (before the split plan).
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

constexpr int kMaxSplits = 128;
// CTAs a split-KV launch aims at: eight per SM.
int64_t TargetCtas(int num_sms) { return 8LL * (num_sms > 0 ? num_sms : 132); }
// DecodeMmaKernel's resident CTAs (three of 64 KB of shared memory and 157
// registers a thread fit an SM): PlanSplits fills whole waves of them.
int64_t TargetMmaCtas(int num_sms) { return 3LL * (num_sms > 0 ? num_sms : 132); }

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
  // At least 256 keys per split (128 for DecodeMmaKernel, whose CTAs cost
  // less to start) so the combine stays a small share; at most kMaxSplits,
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
  // DecodeMmaKernel: CTAs stream whole splits, so the last partial wave of
  // CTAs runs with most of the GPU idle (400 CTAs over 396 slots took two
  // waves' time). Take the split count whose CTAs fill their waves best;
  // among nearly equal fills, the fewest splits.
  const int64_t slots = TargetMmaCtas(num_sms);
  SplitPlan best = plan_for(1);
  double best_fill = 0.0;
  for (int splits = 1; splits <= max_splits; ++splits) {
    const SplitPlan plan = plan_for(splits);
    const int64_t ctas = units * plan.num_splits;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double fill = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (fill > best_fill + 0.02) {
      best_fill = fill;
      best = plan;
    }
  }
  return best;
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
  if (MmaShapeSupported(a) && plan.keys_per_split % kMmaTile == 0) {
    const bool bf16 = a.elem == Elem::kBF16;
    if (a.pool.head_dim == 64) {
      return bf16 ? LaunchMma<__nv_bfloat16, 64>(a, plan, part, s) : LaunchMma<__half, 64>(a, plan, part, s);
    }
    return bf16 ? LaunchMma<__nv_bfloat16, 128>(a, plan, part, s) : LaunchMma<__half, 128>(a, plan, part, s);
  }
  return a.elem == Elem::kBF16 ? LaunchForDim<__nv_bfloat16>(a, plan, part, s) : LaunchForDim<__half>(a, plan, part, s);
}

}  // namespace tandem::kernels::cuda::internal
