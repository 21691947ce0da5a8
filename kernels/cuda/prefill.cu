// Tensor-core prefill over the paged cache (FlashAttention-2 style, sm_90a,
// mma.sync m16n8k16 on bf16/f16 with f32 accumulation).
//
// Grid: (query head, sequence, query tile), the tile index reversed so that
// the tiles with the most keys (the last query rows of the longest
// sequences under a causal mask) start first; tiles past a sequence's query
// count exit at once (the host knows only max_q_len, not each q_len).
// A CTA of kWarps warps serves kM = 16 * kWarps query rows of one head;
// each warp owns 16 rows. Key/value tiles of kN = 64 keys are gathered page
// by page (block_size 16, 32 or 64: a tile covers whole pages) into shared
// memory with 16-byte cp.async, double-buffered (K and V each in their own
// commit group, so the QK^T of tile j overlaps the V load of tile j and the
// PV of tile j overlaps the K load of tile j-1). Shared rows are swizzled
// (16-byte chunk c of row r sits at chunk c ^ (r & 7)) so that ldmatrix
// reads 8 rows of one chunk column without bank conflicts.
//
// Key tiles run from the last to the first: only the first few (the causal
// diagonal, the ragged end of the context) need the mask; a warp whose rows
// all lie before a key tile skips its math. The online softmax keeps, per
// row, the running max (log2 domain: scale * log2(e) folds into one FMA
// before exp2) and this thread's partial sum; the quad reduces the sums at
// the end.
//
// Block ids: before any load, the CTA checks every table entry it will use;
// one outside [0, num_blocks) records kErrBlockId for the sequence, and the
// CTA writes zeros for its rows and reads nothing through the table.
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/prefill_wgmma.cuh"

namespace tandem::kernels::cuda::internal {
namespace {

constexpr int kN = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes 0 fills the destination with zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
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

template <typename T>
__device__ __forceinline__ uint32_t Pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of
// kRowBytes-wide rows.
template <int kRowBytes>
__device__ __forceinline__ uint32_t Swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

template <typename T, int kD, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1) PrefillKernel(AttnArgs a) {
  constexpr int kM = 16 * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kChunks = kD / 8;         // 16-byte chunks per row
  constexpr int kRowBytes = kD * 2;
  constexpr int kTileBytes = kN * kRowBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int sm_bad;
  const uint32_t sQ = SmemAddr(smem);
  const uint32_t sK = sQ + kM * kRowBytes;     // two buffers
  const uint32_t sV = sK + 2 * kTileBytes;     // two buffers

  const int h = blockIdx.x;
  const int s = blockIdx.y;
  const int m0 = (gridDim.z - 1 - blockIdx.z) * kM;
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  if (m0 >= q_len) return;
  const int ctx = __ldg(&a.context_lens[s]);
  const int pos0 = ctx - q_len + m0;  // position of this tile's first query row
  const int rows = min(kM, q_len - m0);
  const int n_keys = a.causal ? min(ctx, pos0 + rows) : ctx;
  const int kv_head = h / a.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t out_stride = int64_t{a.num_heads} * kD;
  T* out = static_cast<T*>(a.out) + int64_t{q_begin + m0} * out_stride + int64_t{h} * kD;

  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;
  if (tid == 0) sm_bad = 0;
  __syncthreads();
  if (n_keys > 0) {
    for (int b = tid; b <= (n_keys - 1) >> bs_shift; b += kThreads) {
      const int32_t id = __ldg(&table[b]);
      if (id < 0 || id >= a.pool.num_blocks) sm_bad = 1;
    }
  }
  __syncthreads();
  if (sm_bad != 0) {
    if (tid == 0) RecordError(a.error, kErrBlockId, s);
    for (int c = tid; c < rows * kChunks; c += kThreads) {
      *reinterpret_cast<uint4*>(out + int64_t{c / kChunks} * out_stride + (c % kChunks) * 8) = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  const T* pool = static_cast<const T*>(a.pool.kv);
  // Q tile (rows past the sequence's queries are zero-filled).
  {
    const T* q = static_cast<const T*>(a.q) + int64_t{q_begin + m0} * a.q_stride + int64_t{h} * kD;
    for (int c = tid; c < kM * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool ok = r < rows;
      CpAsync16(sQ + Swz<kRowBytes>(r, ch), ok ? q + int64_t{r} * a.q_stride + ch * 8 : q, ok ? 16 : 0);
    }
  }
  // One K or V tile (kv = 0 or 1) of keys [tile * kN, +kN) into `dst`.
  auto load_kv = [&](int tile, int kv, uint32_t dst) {
    for (int c = tid; c < kN * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const int key = tile * kN + r;
      const T* src = pool;
      int bytes = 0;
      if (key < n_keys) {
        const int32_t block = __ldg(&table[key >> bs_shift]);
        src = pool + PoolOffset(a.pool, block, kv, kv_head, key & bs_mask) + ch * 8;
        bytes = 16;
      }
      CpAsync16(dst + Swz<kRowBytes>(r, ch), src, bytes);
    }
  };

  const int n_tiles = (n_keys + kN - 1) / kN;
  int buf = 0;
  load_kv(n_tiles - 1, 0, sK);
  CpAsyncCommit();  // group: Q + K[last]
  load_kv(n_tiles - 1, 1, sV);
  CpAsyncCommit();  // group: V[last]

  const int g = lane / 4, t = lane % 4;
  const int wrow0 = warp * 16;                 // this warp's first row in the tile
  const int row_a = wrow0 + g, row_b = row_a + 8;
  const int pos_a = pos0 + row_a, pos_b = pos0 + row_b;
  const int warp_last_pos = pos0 + wrow0 + 15;
  const bool warp_live = wrow0 < rows;
  const float qk_scale = a.scale * kLog2e;

  uint32_t qf[kD / 16][4];
  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  for (int tile = n_tiles - 1; tile >= 0; --tile) {
    const uint32_t cK = sK + buf * kTileBytes, cV = sV + buf * kTileBytes;
    const uint32_t nK = sK + (buf ^ 1) * kTileBytes, nV = sV + (buf ^ 1) * kTileBytes;
    CpAsyncWait<1>();  // K[tile] (and Q) landed
    __syncthreads();
    if (tile == n_tiles - 1) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const int r = wrow0 + (lane & 7) + ((lane >> 3) & 1) * 8;
        LdMatrixX4(sQ + Swz<kRowBytes>(r, kk * 2 + (lane >> 4)), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
      }
    }
    if (tile > 0) load_kv(tile - 1, 0, nK);
    CpAsyncCommit();

    const int k0 = tile * kN;
    const bool compute = warp_live && (!a.causal || k0 <= warp_last_pos);
    float p[kN / 8][4];
    if (compute) {
      // S = Q K^T
#pragma unroll
      for (int i = 0; i < kN / 8; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
        for (int nn = 0; nn < kN / 16; ++nn) {
          const int r = nn * 16 + (lane & 7) + (lane >> 4) * 8;
          uint32_t b0, b1, b2, b3;
          LdMatrixX4(cK + Swz<kRowBytes>(r, kk * 2 + ((lane >> 3) & 1)), b0, b1, b2, b3);
          Mma<T>(p[2 * nn], qf[kk], b0, b1);
          Mma<T>(p[2 * nn + 1], qf[kk], b2, b3);
        }
      }
      // Mask (the causal diagonal, keys past the context) and online softmax.
      const bool need_mask = k0 + kN > n_keys || (a.causal && k0 + kN - 1 > pos0 + wrow0);
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int i = 0; i < kN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = p[i][e] * qk_scale;
          if (need_mask) {
            const int key = k0 + i * 8 + 2 * t + (e & 1);
            const int pos = e < 2 ? pos_a : pos_b;
            if (key >= n_keys || (a.causal && key > pos)) x = -INFINITY;
          }
          p[i][e] = x;
        }
        mx_a = fmaxf(mx_a, fmaxf(p[i][0], p[i][1]));
        mx_b = fmaxf(mx_b, fmaxf(p[i][2], p[i][3]));
      }
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
      const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
      // A row with every key so far masked keeps max -inf: subtract 0 instead.
      const float base_a = new_a == -INFINITY ? 0.0f : new_a;
      const float base_b = new_b == -INFINITY ? 0.0f : new_b;
      const float corr_a = exp2f(m_a - base_a), corr_b = exp2f(m_b - base_b);
      m_a = new_a;
      m_b = new_b;
      float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
      for (int i = 0; i < kN / 8; ++i) {
        p[i][0] = exp2f(p[i][0] - base_a);
        p[i][1] = exp2f(p[i][1] - base_a);
        p[i][2] = exp2f(p[i][2] - base_b);
        p[i][3] = exp2f(p[i][3] - base_b);
        sum_a += p[i][0] + p[i][1];
        sum_b += p[i][2] + p[i][3];
      }
      l_a = l_a * corr_a + sum_a;
      l_b = l_b * corr_b + sum_b;
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        o[i][0] *= corr_a;
        o[i][1] *= corr_a;
        o[i][2] *= corr_b;
        o[i][3] *= corr_b;
      }
    }

    CpAsyncWait<1>();  // V[tile] landed
    __syncthreads();
    if (tile > 0) load_kv(tile - 1, 1, nV);
    CpAsyncCommit();

    if (compute) {
      // O += P V
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = Pack2<T>(p[2 * kk][0], p[2 * kk][1]);
        pa[1] = Pack2<T>(p[2 * kk][2], p[2 * kk][3]);
        pa[2] = Pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[3] = Pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
        for (int dd = 0; dd < kD / 16; ++dd) {
          const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          uint32_t b0, b1, b2, b3;
          LdMatrixX4Trans(cV + Swz<kRowBytes>(r, dd * 2 + (lane >> 4)), b0, b1, b2, b3);
          Mma<T>(o[2 * dd], pa, b0, b1);
          Mma<T>(o[2 * dd + 1], pa, b2, b3);
        }
      }
    }
    buf ^= 1;
  }
  CpAsyncWait<0>();

  // Epilogue: normalise and store (rows past the sequence's queries are not written).
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
  const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    const int col = i * 8 + 2 * t;
    if (row_a < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_a} * out_stride + col) = Pack2<T>(o[i][0] * inv_a, o[i][1] * inv_a);
    }
    if (row_b < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_b} * out_stride + col) = Pack2<T>(o[i][2] * inv_b, o[i][3] * inv_b);
    }
  }
}

// 64-bit shared-memory matrix descriptor for wgmma, 128-byte swizzle:
// start address, leading and stride byte offsets (all >> 4), mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (uint64_t{1} << 62);
}

// The wgmma kernel's shared layout (the canonical 128-byte-swizzle layout):
// a tile of R rows x kD elements is stored as kD/64 "panels" of 64 columns;
// a panel is R rows of 128 bytes, and 16-byte chunk c of row r sits at chunk
// c ^ (r & 7). Every panel starts 1024-byte aligned. Q is stored as one
// 64-row tile per warpgroup.
template <int kD>
__device__ __forceinline__ uint32_t PanelOffset(int rows_per_tile, int r, int ch) {
  return static_cast<uint32_t>((ch >> 3) * rows_per_tile * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// Same contract as PrefillKernel, with the products on wgmma: kWG consumer
// warpgroups of 64 query rows each (kM = 64 * kWG). S = Q K^T reads Q and K
// from shared memory (both K-major); O += P V takes P from registers (the
// S accumulator layout is the A-fragment layout) and V from shared memory
// transposed (MN-major). Loads stay on cp.async by every thread.
template <typename T, int kD, int kWG>
__global__ void __launch_bounds__(kWG * 128, 1) PrefillWgmmaKernel(AttnArgs a) {
  constexpr int kM = 64 * kWG;
  constexpr int kThreads = kWG * 128;
  constexpr int kChunks = kD / 8;
  constexpr int kRowBytes = kD * 2;
  constexpr int kTileBytes = kN * kRowBytes;
  constexpr int kPanel = 64 * 128;  // bytes of one 64-row panel
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int sm_bad;
  const uint32_t sQ = (SmemAddr(smem) + 1023) & ~1023u;
  const uint32_t sK = sQ + kM * kRowBytes;
  const uint32_t sV = sK + 2 * kTileBytes;

  const int h = blockIdx.x;
  const int s = blockIdx.y;
  const int m0 = (gridDim.z - 1 - blockIdx.z) * kM;
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  if (m0 >= q_len) return;
  const int ctx = __ldg(&a.context_lens[s]);
  const int pos0 = ctx - q_len + m0;
  const int rows = min(kM, q_len - m0);
  const int n_keys = a.causal ? min(ctx, pos0 + rows) : ctx;
  const int kv_head = h / a.group;
  const int tid = threadIdx.x, lane = tid % 32;
  const int wg = tid / 128, warp = (tid / 32) % 4;
  const int64_t out_stride = int64_t{a.num_heads} * kD;
  T* out = static_cast<T*>(a.out) + int64_t{q_begin + m0} * out_stride + int64_t{h} * kD;

  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;
  if (tid == 0) sm_bad = 0;
  __syncthreads();
  for (int b = tid; b <= (n_keys - 1) >> bs_shift; b += kThreads) {
    const int32_t id = __ldg(&table[b]);
    if (id < 0 || id >= a.pool.num_blocks) sm_bad = 1;
  }
  __syncthreads();
  if (sm_bad != 0) {
    if (tid == 0) RecordError(a.error, kErrBlockId, s);
    for (int c = tid; c < rows * kChunks; c += kThreads) {
      *reinterpret_cast<uint4*>(out + int64_t{c / kChunks} * out_stride + (c % kChunks) * 8) = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  const T* pool = static_cast<const T*>(a.pool.kv);
  {
    const T* q = static_cast<const T*>(a.q) + int64_t{q_begin + m0} * a.q_stride + int64_t{h} * kD;
    for (int c = tid; c < kM * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool ok = r < rows;
      CpAsync16(sQ + (r / 64) * (64 * kRowBytes) + PanelOffset<kD>(64, r % 64, ch),
                ok ? q + int64_t{r} * a.q_stride + ch * 8 : q, ok ? 16 : 0);
    }
  }
  auto load_kv = [&](int tile, int kv, uint32_t dst) {
    for (int c = tid; c < kN * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const int key = tile * kN + r;
      const T* src = pool;
      int bytes = 0;
      if (key < n_keys) {
        const int32_t block = __ldg(&table[key >> bs_shift]);
        src = pool + PoolOffset(a.pool, block, kv, kv_head, key & bs_mask) + ch * 8;
        bytes = 16;
      }
      CpAsync16(dst + PanelOffset<kD>(kN, r, ch), src, bytes);
    }
  };

  const int n_tiles = (n_keys + kN - 1) / kN;
  int buf = 0;
  load_kv(n_tiles - 1, 0, sK);
  CpAsyncCommit();
  load_kv(n_tiles - 1, 1, sV);
  CpAsyncCommit();

  const int g = lane / 4, t = lane % 4;
  const int wrow0 = wg * 64;                  // this warpgroup's first row in the tile
  const int row_a = wrow0 + warp * 16 + g, row_b = row_a + 8;
  const int pos_a = pos0 + row_a, pos_b = pos0 + row_b;
  const int wg_last_pos = pos0 + wrow0 + 63;
  const bool wg_live = wrow0 < rows;
  const float qk_scale = a.scale * kLog2e;
  const uint32_t sQwg = sQ + wg * (64 * kRowBytes);

  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  for (int tile = n_tiles - 1; tile >= 0; --tile) {
    const uint32_t cK = sK + buf * kTileBytes, cV = sV + buf * kTileBytes;
    const uint32_t nK = sK + (buf ^ 1) * kTileBytes, nV = sV + (buf ^ 1) * kTileBytes;
    CpAsyncWait<1>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (tile > 0) load_kv(tile - 1, 0, nK);
    CpAsyncCommit();

    const int k0 = tile * kN;
    const bool compute = wg_live && (!a.causal || k0 <= wg_last_pos);
    float p[32];
    if (compute) {
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t off = (kk / 4) * kPanel + (kk % 4) * 32;
        wgmma::SS64<T>(p, Desc(sQwg + off, 16, 1024), Desc(cK + off, 16, 1024), kk > 0);
      }
      wgmma::Commit();
      wgmma::Wait<0>();
      wgmma::FenceRegs(p);
      const bool need_mask = k0 + kN > n_keys || (a.causal && k0 + kN - 1 > pos0 + wrow0);
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = p[4 * i + e] * qk_scale;
          if (need_mask) {
            const int key = k0 + i * 8 + 2 * t + (e & 1);
            const int pos = e < 2 ? pos_a : pos_b;
            if (key >= n_keys || (a.causal && key > pos)) x = -INFINITY;
          }
          p[4 * i + e] = x;
        }
        mx_a = fmaxf(mx_a, fmaxf(p[4 * i], p[4 * i + 1]));
        mx_b = fmaxf(mx_b, fmaxf(p[4 * i + 2], p[4 * i + 3]));
      }
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
      const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
      const float base_a = new_a == -INFINITY ? 0.0f : new_a;
      const float base_b = new_b == -INFINITY ? 0.0f : new_b;
      const float corr_a = exp2f(m_a - base_a), corr_b = exp2f(m_b - base_b);
      m_a = new_a;
      m_b = new_b;
      float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        p[4 * i] = exp2f(p[4 * i] - base_a);
        p[4 * i + 1] = exp2f(p[4 * i + 1] - base_a);
        p[4 * i + 2] = exp2f(p[4 * i + 2] - base_b);
        p[4 * i + 3] = exp2f(p[4 * i + 3] - base_b);
        sum_a += p[4 * i] + p[4 * i + 1];
        sum_b += p[4 * i + 2] + p[4 * i + 3];
      }
      l_a = l_a * corr_a + sum_a;
      l_b = l_b * corr_b + sum_b;
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        o[4 * i] *= corr_a;
        o[4 * i + 1] *= corr_a;
        o[4 * i + 2] *= corr_b;
        o[4 * i + 3] *= corr_b;
      }
    }

    CpAsyncWait<1>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (tile > 0) load_kv(tile - 1, 1, nV);
    CpAsyncCommit();

    if (compute) {
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = Pack2<T>(p[8 * kk], p[8 * kk + 1]);
        pa[kk][1] = Pack2<T>(p[8 * kk + 2], p[8 * kk + 3]);
        pa[kk][2] = Pack2<T>(p[8 * kk + 4], p[8 * kk + 5]);
        pa[kk][3] = Pack2<T>(p[8 * kk + 6], p[8 * kk + 7]);
      }
      wgmma::FenceRegs(o);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // 16 keys = two 8-row groups (SBO 1024); head dims in 64-wide panels (LBO).
        const uint64_t dv = Desc(cV + kk * 16 * 128, kN * 128, 1024);
        if constexpr (kD == 128) {
          wgmma::RS128<T>(o, pa[kk], dv, 1);
        } else {
          wgmma::RS64<T>(o, pa[kk], dv, 1);
        }
      }
      wgmma::Commit();
      wgmma::Wait<0>();
      wgmma::FenceRegs(o);
    }
    buf ^= 1;
  }
  CpAsyncWait<0>();

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
  const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    const int col = i * 8 + 2 * t;
    if (row_a < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_a} * out_stride + col) =
          Pack2<T>(o[4 * i] * inv_a, o[4 * i + 1] * inv_a);
    }
    if (row_b < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_b} * out_stride + col) =
          Pack2<T>(o[4 * i + 2] * inv_b, o[4 * i + 3] * inv_b);
    }
  }
}

template <typename T, int kD, int kWG>
int LaunchWgmma(const AttnArgs& a, cudaStream_t stream) {
  constexpr int kM = 64 * kWG;
  constexpr int kSmem = (kM + 4 * kN) * kD * 2 + 1024;  // + alignment slack
  static const cudaError_t attr = cudaFuncSetAttribute(PrefillWgmmaKernel<T, kD, kWG>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  const dim3 grid(a.num_heads, a.num_seqs, (a.max_q_len + kM - 1) / kM);
  PrefillWgmmaKernel<T, kD, kWG><<<grid, kWG * 128, kSmem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int kD, int kWarps>
int Launch(const AttnArgs& a, cudaStream_t stream) {
  constexpr int kM = 16 * kWarps;
  constexpr int kSmem = (kM + 4 * kN) * kD * 2;
  static const cudaError_t attr = cudaFuncSetAttribute(PrefillKernel<T, kD, kWarps>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  const dim3 grid(a.num_heads, a.num_seqs, (a.max_q_len + kM - 1) / kM);
  PrefillKernel<T, kD, kWarps><<<grid, kWarps * 32, kSmem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int LaunchTyped(const AttnArgs& a, cudaStream_t stream, bool use_wgmma) {
  // 128-row tiles halve the K/V traffic per query row; 64-row tiles when the
  // queries are few (a short chunk fills only part of a 128-row tile).
  const bool wide = a.max_q_len > 64;
  if (use_wgmma) {
    if (a.pool.head_dim == 64) return wide ? LaunchWgmma<T, 64, 2>(a, stream) : LaunchWgmma<T, 64, 1>(a, stream);
    return wide ? LaunchWgmma<T, 128, 2>(a, stream) : LaunchWgmma<T, 128, 1>(a, stream);
  }
  if (a.pool.head_dim == 64) return wide ? Launch<T, 64, 8>(a, stream) : Launch<T, 64, 4>(a, stream);
  return wide ? Launch<T, 128, 8>(a, stream) : Launch<T, 128, 4>(a, stream);
}

}  // namespace

bool PrefillSupports(const AttnArgs& a) {
  const PoolView& p = a.pool;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.block_size != 16 && p.block_size != 32 && p.block_size != 64) return false;
  if (a.elem != Elem::kBF16 && a.elem != Elem::kF16) return false;
  // cp.async moves 16-byte vectors: every row start must be 16-byte aligned.
  if (a.q_stride % 8 != 0 || p.block_stride % 8 != 0 || p.kv_stride % 8 != 0 || p.head_stride % 8 != 0) return false;
  if (reinterpret_cast<uintptr_t>(a.q) % 16 != 0 || reinterpret_cast<uintptr_t>(a.out) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.kv) % 16 != 0) {
    return false;
  }
  if (a.group <= 0 || a.num_heads % a.group != 0) return false;
  // Grid limits: y (sequences) and z (query tiles) at most 65535.
  if (a.num_seqs > 65535 || (a.max_q_len + 63) / 64 > 65535) return false;
  return true;
}

// variant 0: wgmma (the default), 1: mma.sync (kept for comparison; the
// stand-alone check in kernels/cuda/bench/ runs both).
int LaunchPrefillVariant(const AttnArgs& a, void* stream, int variant) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.elem == Elem::kBF16) return LaunchTyped<__nv_bfloat16>(a, st, variant == 0);
  return LaunchTyped<__half>(a, st, variant == 0);
}

int LaunchPrefill(const AttnArgs& a, void* stream) { return LaunchPrefillVariant(a, stream, 0); }

}  // namespace tandem::kernels::cuda::internal
