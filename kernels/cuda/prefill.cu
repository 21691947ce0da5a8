// Tensor-core prefill over the paged cache, for Hopper (sm_90a): bf16/f16
// in, f32 accumulation, head_dim 64 or 128, block_size 16, 32 or 64.
//
// The kernel LaunchPrefill runs (PrefillWsKernel, warp-specialized wgmma):
// - Grid (query head, sequence, query tile), the tile index reversed so that
//   the tiles with the most keys (the last query rows under a causal mask)
//   start first; tiles past a sequence's query count exit at once (the host
//   knows only max_q_len, not each q_len).
// - A CTA serves kM = 64 * kWG query rows of one head (kWG = 3 consumer
//   warpgroups, or 1 when max_q_len <= 64) plus one producer warpgroup.
// - The producer gathers Q once and then K/V tiles of 64 keys, page by page
//   through the block table, with 16-byte cp.async into a ring of stages
//   (three: with the Q tile, 145 KB of shared memory at head_dim 128), and
//   signals each stage's "full" mbarrier with
//   cp.async.mbarrier.arrive; it refills a stage after the consumers arrive
//   on its "empty" mbarrier. No CTA-wide barrier sits in the loop, so the
//   consumer warpgroups drift apart and one's softmax overlaps another's
//   matrix products.
// - Each consumer warpgroup computes S = Q K^T (wgmma m64n64k16, Q and K
//   from shared memory, both K-major), the online softmax in registers
//   (exp2 domain: scale * log2(e) folds into one multiply), and O += P V
//   (wgmma m64nDk16, P from registers in the accumulator layout, V from
//   shared memory transposed). Shared tiles use the 128-byte-swizzle layout
//   (64-column panels of 128-byte rows, chunk c of row r at c ^ (r & 7)).
// - Key tiles run from the last to the first: only the first few (causal
//   diagonal, ragged context end) need the mask; a warpgroup whose rows all
//   precede a key tile skips its math.
// - Block ids: before any load, the CTA checks every table entry it will
//   use; one outside [0, num_blocks) records kErrBlockId for the sequence,
//   nothing is read through it or past it, and the rows whose keys reach it
//   come out zero (the rows before it are still computed). The comparison
//   kernel zeroes every row of such a CTA instead.
//
// An earlier kernel stays for comparison (LaunchPrefillVariant, timed side
// by side by kernels/cuda/bench/prefill_check.cu; numbers in NOTES.md):
// PrefillKernel (FlashAttention-2 style, mma.sync m16n8k16, 16 rows per
// warp, ldmatrix). A wgmma kernel in which every thread loaded, with two
// CTA-wide barriers per tile (158-212 TFLOP/s), is in git history (0071241).
#include <cfloat>
#include <climits>

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
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
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

// The mma.sync kernel (comparison variant 1): kWarps warps of 16 query rows
// each; K/V tiles double-buffered by every thread with cp.async (K and V in
// separate commit groups), rows swizzled for conflict-free ldmatrix (chunk c
// of row r at c ^ (r & 7)); fragments by ldmatrix (.trans for V); same grid,
// masking, softmax and block-id checks as the kernel above describes.
template <typename T, int kD, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1) PrefillKernel(AttnArgs a) {
  constexpr int kM = 16 * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  constexpr int kRowBytes = kD * 2;
  constexpr int kTileBytes = kN * kRowBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int sm_bad;
  const uint32_t sQ = SmemAddr(smem);
  const uint32_t sK = sQ + kM * kRowBytes;  // two buffers
  const uint32_t sV = sK + 2 * kTileBytes;  // two buffers

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
  const int wrow0 = warp * 16;  // this warp's first row in the tile
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
      *reinterpret_cast<uint32_t*>(out + int64_t{row_a} * out_stride + col) =
          Pack2<T>(o[i][0] * inv_a, o[i][1] * inv_a);
    }
    if (row_b < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_b} * out_stride + col) =
          Pack2<T>(o[i][2] * inv_b, o[i][3] * inv_b);
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

// mbarrier helpers (shared::cta, 64-bit barrier words).
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void MbarArriveOnCpAsync(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Warp-specialized wgmma prefill: one producer warpgroup gathers Q and the
// K/V pages with cp.async into a ring of kStages stages and signals each
// stage's mbarrier when its copies land (cp.async.mbarrier.arrive); kWG
// consumer warpgroups (64 query rows each) wait on the stage, run
// S = Q K^T, the online softmax and O += P V on wgmma, and release the stage
// on its "empty" mbarrier. No CTA-wide barrier inside the loop: the
// consumer warpgroups drift apart, so one's softmax overlaps another's
// matrix products. Same contract as PrefillKernel.
template <typename T, int kD, int kWG, int kStages>
__global__ void __launch_bounds__((kWG + 1) * 128, 1) PrefillWsKernel(AttnArgs a) {
  constexpr int kN = 64;
  constexpr int kM = 64 * kWG;
  constexpr int kThreads = (kWG + 1) * 128;
  constexpr int kChunks = kD / 8;
  constexpr int kRowBytes = kD * 2;
  constexpr int kTileBytes = kN * kRowBytes;
  constexpr int kPanel = 64 * 128;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int sm_first_bad;                             // the first block index outside the pool, or INT_MAX
  __shared__ __align__(8) uint64_t bars[2 * kStages + 1];  // full[kStages], empty[kStages], q
  const uint32_t sQ = (SmemAddr(smem) + 1023) & ~1023u;
  const uint32_t sKV = sQ + kM * kRowBytes;  // stage i: K at sKV + 2i*tile, V after it
  const uint32_t full0 = SmemAddr(&bars[0]), empty0 = SmemAddr(&bars[kStages]), qbar = SmemAddr(&bars[2 * kStages]);

  const int h = blockIdx.x;
  const int s = blockIdx.y;
  const int m0 = (gridDim.z - 1 - blockIdx.z) * kM;
  const int q_begin = __ldg(&a.query_start[s]);
  const int q_len = __ldg(&a.query_start[s + 1]) - q_begin;
  if (m0 >= q_len) return;
  const int ctx = __ldg(&a.context_lens[s]);
  const int pos0 = ctx - q_len + m0;
  const int rows = min(kM, q_len - m0);
  int n_keys = a.causal ? min(ctx, pos0 + rows) : ctx;
  const int kv_head = h / a.group;
  const int tid = threadIdx.x, lane = tid % 32;
  const int wg = tid / 128, warp = (tid / 32) % 4;
  const int64_t out_stride = int64_t{a.num_heads} * kD;
  T* out = static_cast<T*>(a.out) + int64_t{q_begin + m0} * out_stride + int64_t{h} * kD;

  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;
  if (tid == 0) {
    sm_first_bad = INT_MAX;
    for (int i = 0; i < kStages; ++i) {
      MbarInit(full0 + 8 * i, 128);         // one cp.async arrival per producer thread
      MbarInit(empty0 + 8 * i, kWG * 128);  // every consumer thread releases
    }
    MbarInit(qbar, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  for (int b = tid; b <= (n_keys - 1) >> bs_shift; b += kThreads) {
    const int32_t id = __ldg(&table[b]);
    if (id < 0 || id >= a.pool.num_blocks) atomicMin(&sm_first_bad, b);
  }
  __syncthreads();
  // A bad block id: the rows that reach it come out zero (epilogue); the
  // rows before it are computed from the keys before it, all that is read.
  if (sm_first_bad != INT_MAX) {
    if (tid == 0) RecordError(a.error, kErrBlockId, s);
    n_keys = min(n_keys, sm_first_bad << bs_shift);
    if (n_keys == 0) {
      for (int c = tid; c < rows * kChunks; c += kThreads) {
        *reinterpret_cast<uint4*>(out + int64_t{c / kChunks} * out_stride + (c % kChunks) * 8) = make_uint4(0, 0, 0, 0);
      }
      return;
    }
  }
  const int n_tiles = (n_keys + kN - 1) / kN;

  if (wg == kWG) {
    // Producer.
    const int ptid = tid - kWG * 128;
    const T* pool = static_cast<const T*>(a.pool.kv);
    {
      const T* q = static_cast<const T*>(a.q) + int64_t{q_begin + m0} * a.q_stride + int64_t{h} * kD;
      for (int c = ptid; c < kM * kChunks; c += 128) {
        const int r = c / kChunks, ch = c % kChunks;
        const bool ok = r < rows;
        CpAsync16(sQ + (r / 64) * (64 * kRowBytes) + PanelOffset<kD>(64, r % 64, ch),
                  ok ? q + int64_t{r} * a.q_stride + ch * 8 : q, ok ? 16 : 0);
      }
      MbarArriveOnCpAsync(qbar);
    }
    for (int it = 0; it < n_tiles; ++it) {
      const int stage = it % kStages;
      if (it >= kStages) MbarWait(empty0 + 8 * stage, ((it / kStages) - 1) & 1);
      const int tile = n_tiles - 1 - it;
      const uint32_t dK = sKV + 2 * stage * kTileBytes, dV = dK + kTileBytes;
      for (int c = ptid; c < kN * kChunks; c += 128) {
        const int r = c / kChunks, ch = c % kChunks;
        const int key = tile * kN + r;
        const T* srcK = pool;
        const T* srcV = pool;
        int bytes = 0;
        if (key < n_keys) {
          const int32_t block = __ldg(&table[key >> bs_shift]);
          srcK = pool + PoolOffset(a.pool, block, 0, kv_head, key & bs_mask) + ch * 8;
          srcV = srcK + a.pool.kv_stride;
          bytes = 16;
        }
        CpAsync16(dK + PanelOffset<kD>(kN, r, ch), srcK, bytes);
        CpAsync16(dV + PanelOffset<kD>(kN, r, ch), srcV, bytes);
      }
      MbarArriveOnCpAsync(full0 + 8 * stage);
    }
    CpAsyncWait<0>();
    return;
  }

  // Consumers.
  const int g = lane / 4, t = lane % 4;
  const int wrow0 = wg * 64;
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
  MbarWait(qbar, 0);

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it % kStages;
    const int tile = n_tiles - 1 - it;
    const uint32_t cK = sKV + 2 * stage * kTileBytes, cV = cK + kTileBytes;
    MbarWait(full0 + 8 * stage, (it / kStages) & 1);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const int k0 = tile * kN;
    const bool compute = wg_live && (!a.causal || k0 <= wg_last_pos);
    if (compute) {
      float p[32];
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
    MbarArrive(empty0 + 8 * stage);
  }

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
  const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
  // Rows whose last key lies at or past a bad block: zeros. (Re-read here,
  // not kept in registers through the loop, which has none to spare.)
  // Without the causal mask every row reaches every checked block.
  const int bad_block = sm_first_bad;
  const bool bad = bad_block != INT_MAX;
  const int first_bad_key = bad ? bad_block * a.pool.block_size : 0;
  const bool zero_a = bad && (!a.causal || pos_a >= first_bad_key);
  const bool zero_b = bad && (!a.causal || pos_b >= first_bad_key);
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    const int col = i * 8 + 2 * t;
    if (row_a < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_a} * out_stride + col) =
          zero_a ? 0u : Pack2<T>(o[4 * i] * inv_a, o[4 * i + 1] * inv_a);
    }
    if (row_b < rows) {
      *reinterpret_cast<uint32_t*>(out + int64_t{row_b} * out_stride + col) =
          zero_b ? 0u : Pack2<T>(o[4 * i + 2] * inv_b, o[4 * i + 3] * inv_b);
    }
  }
}

template <typename T, int kD, int kWG, int kStages>
int LaunchWs(const AttnArgs& a, cudaStream_t stream) {
  constexpr int kM = 64 * kWG;
  constexpr int kSmem = (kM + 2 * kStages * 64) * kD * 2 + 1024;  // + alignment slack
  auto* kernel = PrefillWsKernel<T, kD, kWG, kStages>;
  // Per call, not once: the limit belongs to the current device's context.
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  const dim3 grid(a.num_heads, a.num_seqs, (a.max_q_len + kM - 1) / kM);
  kernel<<<grid, (kWG + 1) * 128, kSmem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int kD, int kWarps>
int Launch(const AttnArgs& a, cudaStream_t stream) {
  constexpr int kM = 16 * kWarps;
  constexpr int kSmem = (kM + 4 * kN) * kD * 2;
  const cudaError_t attr =
      cudaFuncSetAttribute(PrefillKernel<T, kD, kWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  const dim3 grid(a.num_heads, a.num_seqs, (a.max_q_len + kM - 1) / kM);
  PrefillKernel<T, kD, kWarps><<<grid, kWarps * 32, kSmem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int kD>
int LaunchTypedDim(const AttnArgs& a, cudaStream_t stream, int variant) {
  // 192-row tiles (three consumer warpgroups) cut the K/V traffic per query
  // row and give each SM three warpgroups to overlap; one warpgroup (64
  // rows) when the queries are few (a short chunk, or the tail of a
  // chunked prefill).
  const bool wide = a.max_q_len > 64;
  switch (variant) {
    case 1:  // mma.sync, 16 rows per warp
      return wide ? Launch<T, kD, 8>(a, stream) : Launch<T, kD, 4>(a, stream);
    case 2:  // warp-specialized with two stages (2-6% slower than three on an H100)
      return wide ? LaunchWs<T, kD, 3, 2>(a, stream) : LaunchWs<T, kD, 1, 2>(a, stream);
    default:  // warp-specialized wgmma, three stages
      return wide ? LaunchWs<T, kD, 3, 3>(a, stream) : LaunchWs<T, kD, 1, 3>(a, stream);
  }
}

template <typename T>
int LaunchTyped(const AttnArgs& a, cudaStream_t stream, int variant) {
  if (a.pool.head_dim == 64) return LaunchTypedDim<T, 64>(a, stream, variant);
  return LaunchTypedDim<T, 128>(a, stream, variant);
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

// Variant 0 is the kernel LaunchPrefill runs (warp-specialized wgmma); the
// others stay for comparison (kernels/cuda/bench/prefill_check.cu times
// them side by side): 1 mma.sync, 2 the warp-specialized kernel with two
// stages instead of three.
int LaunchPrefillVariant(const AttnArgs& a, void* stream, int variant) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.elem == Elem::kBF16) return LaunchTyped<__nv_bfloat16>(a, st, variant);
  return LaunchTyped<__half>(a, st, variant);
}

int LaunchPrefill(const AttnArgs& a, void* stream) { return LaunchPrefillVariant(a, stream, 0); }

}  // namespace tandem::kernels::cuda::internal
