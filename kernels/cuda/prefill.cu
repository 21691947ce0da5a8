// Tensor-core prefill over the paged cache, for Hopper (sm_90a): bf16/f16
// in, f32 accumulation, head_dim 64 or 128, block_size 16, 32 or 64.
//
// The kernel LaunchPrefill runs for more than 64 query rows
// (PrefillFa3Kernel, the FlashAttention-3 recipe):
// - Work items (128 query rows of one head and sequence), numbered with the
//   query tile fastest, then head, then sequence: the items running
//   together share one head's K/V in L2 (with the head fastest they spanned
//   every head and missed L2: 6-8% slower from a cold L2). The tile index is
//   reversed so that the tiles with the most keys (the last query rows under
//   a causal mask) start first; tiles past a sequence's query count are
//   skipped (the host knows only max_q_len, not each q_len). Persistent:
//   one CTA an SM takes items from a counter in the workspace (the last CTA
//   out resets it); the producer checks the next item's blocks and loads its
//   Q (two Q buffers) and first tiles while the consumers finish the current
//   item. Against one CTA per item on an H200: +5-8% at 1k tokens, +2-4% at
//   2k-4k, within 1.5% at 8k-16k.
// - 384 threads: two consumer warpgroups of 64 query rows (a CTA serves 128
//   rows of one head) and a producer warpgroup; `setmaxnreg` moves registers
//   from the producer (56) to the consumers (224).
// - The producer loads an item's Q (cp.async) and then K and V tiles of 128
//   keys into two-stage rings of their own, whose positions run on across
//   items (2 Q + 2 x 2 tiles: 193 KB at head_dim 128). Whole pages go through the tensor-memory accelerator: the
//   layer's pool is a 5-D tensor map (element, slot, KV head, K|V, block), one box per page and 64-column panel,
//   landing in the 128-byte-swizzle layout wgmma reads; the lanes of one warp each issue a page's boxes. The first tile
//   (the last keys: a partial page past the context is zero-filled) goes through cp.async. Completion is counted on
//   "full" mbarriers (expect-tx bytes); the consumers release "empty" ones.
// - Each consumer issues tile j's S = Q K^T (wgmma m64n128k16, both from
//   shared memory, K-major) together with tile j-1's O += P V (wgmma
//   m64nDk16, P from registers, V transposed from shared memory), waits for
//   the first, runs tile j's online softmax while PV j-1 is still on the
//   tensor cores, then rescales O. Named barriers make the two consumers
//   take turns issuing (pingpong), so one's softmax runs under the other's
//   products. Scores are scaled inside the exponent (one FFMA each, the
//   maxima on raw scores) and exp2 is ex2.approx.ftz. At pages of 16 a row
//   keeps its running maximum until it grows by more than 2^8 (kOptLazyRescale),
//   so most tiles skip the rescale of O.
// - From 2048 keys the pipeline does not drain between items
//   (kOptCrossItem): an item's first QK^T is issued with the previous
//   item's last PV, its first softmax runs under that PV, and the previous
//   item's rows are stored in the place of the rescale (+1-2% at 4k-16k on
//   an H200; 1-1.5% slower at 1k, where it is not used).
// - Key tiles run from the last to the first: only the first few (causal
//   diagonal, ragged context end) need the mask.
// - Block ids: before any load, the producer checks every table entry the
//   item will use; one outside [0, num_blocks) records kErrBlockId for the sequence,
//   nothing is read through it or past it, and the rows whose keys reach it
//   come out zero (the rows before it are still computed).
// Every query count takes this kernel (the arithmetic of a row must not
// depend on chunking); where the pool's strides do not fit a tensor map,
// cp.async gathers every tile.
//
// LaunchPrefillVariant runs the others for comparison
// (kernels/cuda/bench/prefill_check.cu times them side by side; numbers in
// NOTES.md), among them PrefillWsKernel, the earlier warp-specialized kernel
// (one to three consumer warpgroups, 64-key tiles, cp.async gathers, no
// intra-warpgroup overlap). An mma.sync (FlashAttention-2 style) kernel and a wgmma kernel
// with CTA-wide barriers per tile are in git history (f952425, 0071241).
#include <cudaTypedefs.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/prefill_wgmma.cuh"

namespace tandem::kernels::cuda::internal {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// 64-bit shared-memory matrix descriptor for wgmma, 128-byte swizzle:
// start address, leading and stride byte offsets (all >> 4), mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (uint64_t{1} << 62);
}

// Switches of the wgmma kernels (kOpt bits): kOptTma loads full K/V pages
// with the tensor-memory accelerator (PrefillFa3Kernel only); kOptNoLoads is
// a diagnostic that loads only the first tiles (timing without the K/V
// traffic; its results are wrong).
constexpr int kOptNoLoads = 1;
constexpr int kOptTma = 2;
// kOptPersistent (PrefillFa3Kernel): one CTA an SM taking work items from a
// counter in the workspace, instead of one CTA per item.
constexpr int kOptPersistent = 4;
// kOptLazyRescale (PrefillFa3Kernel): a row keeps its running maximum until
// a tile's maximum exceeds it by more than 2^8 in the exponent (the
// FlashAttention-4 trick), so most tiles skip the rescale of O; the
// probabilities then reach at most 256 before the final division.
constexpr int kOptLazyRescale = 8;
// kOptQRegs (PrefillFa3Kernel): each consumer keeps its Q rows in registers
// (ldmatrix once per item) and issues QK^T with A from registers, which
// frees the Q buffer as soon as the item starts and reads 16 KB less
// shared memory per tile and warpgroup.
constexpr int kOptQRegs = 16;
// kOptCrossItem (PrefillFa3Kernel, persistent): no drain at an item
// boundary. A consumer issues the next item's first QK^T together with the
// current item's last PV, runs the next item's first softmax under that PV,
// then writes the current item's rows (in place of the rescale of O). Not
// with kOptQRegs.
constexpr int kOptCrossItem = 32;

// The epilogue of the wgmma kernels: the row sums reduced over the four
// lanes of a row, the output normalised and stored (rows past `rows` are not
// written). With a bad block id (bad_block != INT_MAX) the rows whose keys
// reach it are zeros; without the causal mask every row reaches it.
template <typename T, int kD>
__device__ __forceinline__ void StoreRows(T* out, int64_t out_stride, const float (&o)[kD / 2], float l_a, float l_b,
                                          int row_a, int row_b, int rows, int t, int pos_a, int pos_b, int bad_block,
                                          int block_size, bool causal) {
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
  const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
  const bool bad = bad_block != INT_MAX;
  const int first_bad_key = bad ? bad_block * block_size : 0;
  const bool zero_a = bad && (!causal || pos_a >= first_bad_key);
  const bool zero_b = bad && (!causal || pos_b >= first_bad_key);
  // One pointer a row (the columns are immediate offsets from it).
  uint32_t* const out_a = reinterpret_cast<uint32_t*>(out + int64_t{row_a} * out_stride + 2 * t);
  uint32_t* const out_b = reinterpret_cast<uint32_t*>(out + int64_t{row_b} * out_stride + 2 * t);
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    if (row_a < rows) out_a[i * 4] = zero_a ? 0u : Pack2<T>(o[4 * i] * inv_a, o[4 * i + 1] * inv_a);
    if (row_b < rows) out_b[i * 4] = zero_b ? 0u : Pack2<T>(o[4 * i + 2] * inv_b, o[4 * i + 3] * inv_b);
  }
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

  // Rows whose last key lies at or past a bad block come out zero.
  // (sm_first_bad is re-read here, not kept in registers through the loop,
  // which has none to spare.)
  StoreRows<T, kD>(out, out_stride, o, l_a, l_b, row_a, row_b, rows, t, pos_a, pos_b, sm_first_bad, a.pool.block_size,
                   a.causal);
}

// ex2.approx with denormals flushed (exp2f adds a range fix-up we do not need:
// every argument is <= 0 and a result below 2^-126 may as well be 0).
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Named barriers 1 and 2 order the two consumer warpgroups' matrix products
// (id 0 is __syncthreads).
__device__ __forceinline__ void NamedSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void NamedArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int kN>
__device__ __forceinline__ void FenceRegsU(uint32_t (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The pool's tensor maps for PrefillFa3Kernel: box[j] reads 16 * (j + 1)
// slots of one page (a key tile is loaded as its pieces within pages; only
// the sizes a launch can meet are encoded).
struct PoolMaps {
  CUtensorMap box[4];
};

// The FlashAttention-3 recipe (the file comment describes it). kOpt:
// kOptTma loads whole pages with TMA (the default); without it every tile
// is gathered with cp.async (for comparison). Every consumer runs every key
// tile (no per-warpgroup skip: both must pass the same named barriers);
// masked rows of a tile come out as zero probabilities. The first tile is
// peeled off the loop so that the loop's wgmma waits are uniform (a branch
// between issue and wait makes ptxas serialize the products). Same contract
// (grid, masks, bad block ids, zero rows) as PrefillWsKernel.
template <typename T, int kD, int kOpt, int kN>
__global__ void __launch_bounds__(384, 1)
    PrefillFa3Kernel(AttnArgs a, const __grid_constant__ PoolMaps maps, int tiles_x, int num_items, unsigned* sched) {
  static_assert(kN == 128 || (kN == 176 && kD == 128), "key tiles of 128, or 176 at head_dim 128");
  constexpr int kM = 128;
  constexpr int kChunks = kD / 8;
  constexpr int kRowBytes = kD * 2;
  constexpr int kTileBytes = kN * kRowBytes;
  constexpr int kQPanel = 64 * 128;  // Q: one 64-row tile per warpgroup
  constexpr int kKPanel = kN * 128;
  constexpr int kStages = 2;
  constexpr bool kPersistent = (kOpt & kOptPersistent) != 0;
  constexpr bool kLazy = (kOpt & kOptLazyRescale) != 0;
  constexpr bool kQRegs = (kOpt & kOptQRegs) != 0;
  constexpr bool kCross = (kOpt & kOptCrossItem) != 0 && kPersistent;
  static_assert(!(kCross && kQRegs), "kOptCrossItem keeps Q in shared memory");
  static_assert(!(kQRegs && kN != 128), "kOptQRegs has no registers to spare past 128-key tiles");
  // 176-key tiles: K and V stages of 44 KB leave room for one Q buffer, and
  // the consumers take 240 registers (S of the next tile, P and O live
  // together: 196 a thread; 20 bytes of spills at 240, 88 at 232).
  constexpr int kQBufs = kN == 128 ? 2 : 1;
  constexpr int kProducerRegs = kN == 128 ? 56 : 24;
  constexpr int kConsumerRegs = kN == 128 ? 224 : 240;
  // setmaxnreg.inc waits until the CTA's pool holds the registers: all
  // there is is what the launch gave, 168 a thread (65536 / 384, rounded
  // down to 8); asking for more hangs the consumers.
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 168 * 384, "setmaxnreg beyond the CTA's registers");
  // A work item (128 query rows of one head and sequence) as the producer
  // publishes it with its Q buffer; n_keys < 0: no more items.
  struct Item {
    int s, h, m0, rows, pos0, n_keys, first_bad;
  };
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Item sm_item[2];
  __shared__ int sm_scan;
  // full_k[2], empty_k[2], full_v[2], empty_v[2], q_full[2], q_empty[2]
  __shared__ __align__(8) uint64_t bars[4 * kStages + 4];
  const uint32_t sQ0 = (SmemAddr(smem) + 1023) & ~1023u;  // Q buffer i at sQ0 + i * kM * kRowBytes
  const uint32_t sK = sQ0 + kQBufs * kM * kRowBytes;      // K stage i at sK + i * tile
  const uint32_t sV = sK + kStages * kTileBytes;          // V stage i at sV + i * tile
  const uint32_t fullk = SmemAddr(&bars[0]), emptyk = fullk + 8 * kStages;
  const uint32_t fullv = emptyk + 8 * kStages, emptyv = fullv + 8 * kStages;
  const uint32_t qfull = emptyv + 8 * kStages, qempty = qfull + 16;

  const int tid = threadIdx.x, lane = tid % 32;
  const int wg = tid / 128, warp = (tid / 32) % 4;
  const int64_t out_stride = int64_t{a.num_heads} * kD;
  const int bs_shift = __ffs(a.pool.block_size) - 1;
  const int bs_mask = a.pool.block_size - 1;
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarInit(fullk + 8 * i, 128);
      MbarInit(emptyk + 8 * i, 256);
      MbarInit(fullv + 8 * i, 128);
      MbarInit(emptyv + 8 * i, 256);
    }
    for (int i = 0; i < 2; ++i) {
      MbarInit(qfull + 8 * i, 129);  // 128 cp.async arrivals and the item's publication
      MbarInit(qempty + 8 * i, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {
    // Producer: per item, its block ids checked, Q into a free Q buffer and
    // the item published; then K and V of each tile (last tile first) into
    // their rings, whose positions run on across items.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    const int ptid = tid - 256;
    const T* pool = static_cast<const T*>(a.pool.kv);
    // The next item: this CTA's one (grid mode), or the work counter's.
    __shared__ int sm_next;
    int taken = 0;
    auto grab = [&]() {
      if constexpr (!kPersistent) {
        return taken++ == 0 ? static_cast<int>(blockIdx.x + tiles_x * (blockIdx.y + gridDim.y * blockIdx.z))
                            : num_items;
      }
      if (taken++ == 0) return NextWorkItem(sched, 0);
      if (ptid == 0) sm_next = NextWorkItem(sched, 1);
      NamedSync(3, 128);
      const int next = sm_next;
      NamedSync(3, 128);
      return next;
    };
    int gt = 0;  // K/V tiles loaded so far (ring position)
    for (int n = 0;; ++n) {
      const int slot = n % kQBufs;
      Item item{};
      int w = grab();
      for (; w < num_items; w = grab()) {
        const int x = w % tiles_x, rest = w / tiles_x;
        item.h = rest % a.num_heads;
        item.s = rest / a.num_heads;
        // Reversed: the tiles with the most keys (the last query rows under
        // a causal mask) first.
        item.m0 = (tiles_x - 1 - x) * kM;
        const int q_len = __ldg(&a.query_start[item.s + 1]) - __ldg(&a.query_start[item.s]);
        if (item.m0 < q_len) {
          const int ctx = __ldg(&a.context_lens[item.s]);
          item.pos0 = ctx - q_len + item.m0;
          item.rows = min(kM, q_len - item.m0);
          item.n_keys = a.causal ? min(ctx, item.pos0 + item.rows) : ctx;
          break;
        }
        // Past this sequence's queries (the host knows only max_q_len).
      }
      const bool done = w >= num_items;
      const int32_t* table = a.block_tables + int64_t{item.s} * a.max_blocks_per_seq;
      if (!done) {
        // Every table entry the item will use: one outside the pool stops
        // the keys before it (its rows come out zero).
        if (ptid == 0) sm_scan = INT_MAX;
        NamedSync(3, 128);
        for (int b = ptid; b <= (item.n_keys - 1) >> bs_shift; b += 128) {
          const int32_t id = __ldg(&table[b]);
          if (id < 0 || id >= a.pool.num_blocks) atomicMin(&sm_scan, b);
        }
        NamedSync(3, 128);
        item.first_bad = sm_scan;
        if (item.first_bad != INT_MAX) {
          if (ptid == 0) RecordError(a.error, kErrBlockId, item.s);
          item.n_keys = min(item.n_keys, item.first_bad << bs_shift);
        }
        item.n_keys = max(item.n_keys, 0);
        // The Q buffer's previous item has done its last QK^T (after the
        // block scan: with one Q buffer this wait is on the item boundary).
        if (n >= kQBufs) MbarWait(qempty + 8 * slot, ((n / kQBufs) - 1) & 1);
        const int q_begin = __ldg(&a.query_start[item.s]);
        const T* q = static_cast<const T*>(a.q) + int64_t{q_begin + item.m0} * a.q_stride + int64_t{item.h} * kD;
        const uint32_t sQ = sQ0 + slot * (kM * kRowBytes);
        for (int c = ptid; c < kM * kChunks; c += 128) {
          const int r = c / kChunks, ch = c % kChunks;
          const bool ok = r < item.rows && item.n_keys > 0;
          CpAsync16(sQ + (r / 64) * (64 * kRowBytes) + PanelOffset<kD>(64, r % 64, ch),
                    ok ? q + int64_t{r} * a.q_stride + ch * 8 : q, ok ? 16 : 0);
        }
      } else {
        if (n >= kQBufs) MbarWait(qempty + 8 * slot, ((n / kQBufs) - 1) & 1);
        item.n_keys = -1;
      }
      MbarArriveOnCpAsync(qfull + 8 * slot);
      if (ptid == 0) {
        sm_item[slot] = item;
        MbarArrive(qfull + 8 * slot);
      }
      if (done) break;
      const int n_tiles = (item.n_keys + kN - 1) / kN;
      const int kv_head = item.h / a.group;
      for (int it = 0; it < n_tiles; ++it, ++gt) {
        const int stage = gt % kStages;
        const int parity = ((gt / kStages) - 1) & 1;
        const int tile = n_tiles - 1 - it;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
          if (gt >= kStages) MbarWait((kv == 0 ? emptyk : emptyv) + 8 * stage, parity);
          const uint32_t dst = (kv == 0 ? sK : sV) + stage * kTileBytes;
          const uint32_t full = (kv == 0 ? fullk : fullv) + 8 * stage;
          if ((kOpt & kOptTma) && it > 0) {
            // Every tile after the item's first (the last keys, maybe a
            // partial page: cp.async zero-fills past the context) is keys
            // below the context. Thread 0's arrival carries the expected
            // bytes; thread pc issues the boxes of the tile's piece within
            // its pc-th page (whole pages for 128-key tiles; a 176-key tile
            // meets up to four pieces of 16-64 keys at pages of 64). A box
            // that lands before the expectation only drives the count
            // negative: the phase cannot end before thread 0 arrives.
            if (ptid == 0) {
              MbarArriveExpectTx(full, kTileBytes);
            } else {
              MbarArrive(full);
            }
            const int k0 = tile * kN;
            const int b = (k0 >> bs_shift) + ptid;
            const int first = max(k0, b << bs_shift), end = min(k0 + kN, (b + 1) << bs_shift);
            if (first < end) {
              const int32_t block = __ldg(&table[b]);
              const CUtensorMap* map = &maps.box[((end - first) >> 4) - 1];
#pragma unroll
              for (int c = 0; c < kD / 64; ++c) {
                TmaLoadBox(dst + c * kKPanel + (first - k0) * 128, map, c * 64, first & bs_mask, kv_head, kv, block,
                           full);
              }
            }
            continue;
          }
          for (int c = ptid; c < ((kOpt & kOptNoLoads) && gt >= kStages ? 0 : kN * kChunks); c += 128) {
            const int r = c / kChunks, ch = c % kChunks;
            const int key = tile * kN + r;
            const T* src = pool;
            int bytes = 0;
            if (key < item.n_keys) {
              const int32_t block = __ldg(&table[key >> bs_shift]);
              src = pool + PoolOffset(a.pool, block, kv, kv_head, key & bs_mask) + ch * 8;
              bytes = 16;
            }
            CpAsync16(dst + PanelOffset<kD>(kN, r, ch), src, bytes);
          }
          MbarArriveOnCpAsync(full);
        }
      }
    }
    CpAsyncWait<0>();
    if constexpr (kPersistent) {
      if (ptid == 0) ReleaseWorkCounter(sched);
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
  const int g = lane / 4, t = lane % 4;
  const int wrow0 = wg * 64;
  const int row_a = wrow0 + warp * 16 + g, row_b = row_a + 8;
  const float qk_scale = a.scale * kLog2e;
  // The current item's (set per item; the lambdas below read them).
  int pos0 = 0, pos_a = 0, pos_b = 0, n_keys = 0;
  uint32_t sQwg = sQ0;

  float o[kD / 2];
  float m_a, m_b, l_a, l_b;
  float corr_a = 1.0f, corr_b = 1.0f;
  uint32_t pa[kN / 16][4];
  uint32_t qf[kQRegs ? kD / 16 : 1][4];
  float p[kN / 2];

  // S = Q K^T of the tile in K stage `stage` into p (issued, committed).
  auto issue_qk = [&](int stage) {
    const uint32_t cK = sK + stage * kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint64_t dk = Desc(cK + (kk / 4) * kKPanel + (kk % 4) * 32, 16, 1024);
      const uint64_t dq = Desc(sQwg + (kk / 4) * kQPanel + (kk % 4) * 32, 16, 1024);
      if constexpr (kQRegs) {
        wgmma::RS128<T, 0>(p, qf[kk], dk, kk > 0);
      } else if constexpr (kN == 176) {
        wgmma::SS176<T>(p, dq, dk, kk > 0);
      } else {
        wgmma::SS128<T>(p, dq, dk, kk > 0);
      }
    }
    wgmma::Commit();
  };
  // O += P V with the V tile in V stage `stage` (issued, committed).
  auto issue_pv_at = [&](uint32_t cV) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint64_t dv = Desc(cV + kk * 16 * 128, kN * 128, 1024);
      if constexpr (kD == 128) {
        wgmma::RS128<T>(o, pa[kk], dv, 1);
      } else {
        wgmma::RS64<T>(o, pa[kk], dv, 1);
      }
    }
    wgmma::Commit();
  };
  auto issue_pv = [&](int stage) { issue_pv_at(sV + stage * kTileBytes); };
  // Registers written outside wgmma stay ordered before the next fence.
  auto fence_operands = [&]() {
    wgmma::FenceRegs(o);
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) FenceRegsU(pa[kk]);
  };
  // Q's fragments stay in their registers until the product reading them is done.
  auto fence_q = [&]() {
    if constexpr (kQRegs) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) FenceRegsU(qf[kk]);
    }
  };
  // Masks, online-softmax statistics and exponentials of the scores in p
  // for the keys from k0; sets corr_a/corr_b for the output's rescale.
  auto softmax = [&](int k0) {
    const bool need_mask = k0 + kN > n_keys || (a.causal && k0 + kN - 1 > pos0 + wrow0);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < kN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + i * 8 + 2 * t + (e & 1);
          const int pos = e < 2 ? pos_a : pos_b;
          if (key >= n_keys || (a.causal && key > pos)) p[4 * i + e] = -INFINITY;
        }
      }
    }
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      mx_a = fmaxf(mx_a, fmaxf(p[4 * i], p[4 * i + 1]));
      mx_b = fmaxf(mx_b, fmaxf(p[4 * i + 2], p[4 * i + 3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    if constexpr (kLazy) {
      // Growth of at most 8 in the exponent keeps the old maximum (a first
      // finite maximum grows by inf; -inf over -inf is NaN and keeps -inf).
      if (!((mx_a - m_a) * qk_scale > 8.0f)) mx_a = m_a;
      if (!((mx_b - m_b) * qk_scale > 8.0f)) mx_b = m_b;
    }
    // Maxima are on raw scores; a row with every key so far masked keeps -inf.
    const float base_a = mx_a == -INFINITY ? 0.0f : mx_a * qk_scale;
    const float base_b = mx_b == -INFINITY ? 0.0f : mx_b * qk_scale;
    corr_a = mx_a == m_a ? 1.0f : Ex2(m_a * qk_scale - base_a);
    corr_b = mx_b == m_b ? 1.0f : Ex2(m_b * qk_scale - base_b);
    m_a = mx_a;
    m_b = mx_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      p[4 * i] = Ex2(fmaf(p[4 * i], qk_scale, -base_a));
      p[4 * i + 1] = Ex2(fmaf(p[4 * i + 1], qk_scale, -base_a));
      p[4 * i + 2] = Ex2(fmaf(p[4 * i + 2], qk_scale, -base_b));
      p[4 * i + 3] = Ex2(fmaf(p[4 * i + 3], qk_scale, -base_b));
      sum_a += p[4 * i] + p[4 * i + 1];
      sum_b += p[4 * i + 2] + p[4 * i + 3];
    }
    l_a = l_a * corr_a + sum_a;
    l_b = l_b * corr_b + sum_b;
  };
  auto pack_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      pa[kk][0] = Pack2<T>(p[8 * kk], p[8 * kk + 1]);
      pa[kk][1] = Pack2<T>(p[8 * kk + 2], p[8 * kk + 3]);
      pa[kk][2] = Pack2<T>(p[8 * kk + 4], p[8 * kk + 5]);
      pa[kk][3] = Pack2<T>(p[8 * kk + 6], p[8 * kk + 7]);
    }
  };

  // The item in Q buffer `slot`: its fields for the masks; returns its
  // output rows.
  auto open_item = [&](const Item& item, int slot) -> T* {
    pos0 = item.pos0;
    pos_a = pos0 + row_a;
    pos_b = pos0 + row_b;
    n_keys = item.n_keys;
    sQwg = sQ0 + slot * (kM * kRowBytes) + wg * (64 * kRowBytes);
    return static_cast<T*>(a.out) + int64_t{__ldg(&a.query_start[item.s]) + item.m0} * out_stride +
           int64_t{item.h} * kD;
  };
  // An item with no key (a bad first block, or none at all): zero rows.
  auto zero_rows = [&](const Item& item, T* out, int slot) {
    MbarArrive(qempty + 8 * slot);
    for (int c = tid; c < item.rows * kChunks; c += 256) {
      *reinterpret_cast<uint4*>(out + int64_t{c / kChunks} * out_stride + (c % kChunks) * 8) = make_uint4(0, 0, 0, 0);
    }
  };
  // Tiles 1 .. n_tiles - 1 of the item whose first tile is at ring position
  // gt: tile it's QK^T and tile it-1's PV together, it's softmax under that PV.
  auto middle_tiles = [&](int gt, int n_tiles) {
    for (int it = 1; it < n_tiles; ++it) {
      const int r = gt + it;
      const int stage = r % kStages, pstage = (r - 1) % kStages;
      MbarWait(fullk + 8 * stage, (r / kStages) & 1);
      MbarWait(fullv + 8 * pstage, ((r - 1) / kStages) & 1);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      NamedSync(1 + wg, 256);
      fence_operands();
      wgmma::Fence();
      issue_qk(stage);
      issue_pv(pstage);
      NamedArrive(2 - wg, 256);
      wgmma::Wait<1>();
      wgmma::FenceRegs(p);
      fence_q();
      MbarArrive(emptyk + 8 * stage);
      softmax((n_tiles - 1 - it) * kN);
      wgmma::Wait<0>();
      fence_operands();
      MbarArrive(emptyv + 8 * pstage);
      if (!kLazy || __any_sync(0xffffffffu, corr_a != 1.0f || corr_b != 1.0f)) {
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          o[4 * i] *= corr_a;
          o[4 * i + 1] *= corr_a;
          o[4 * i + 2] *= corr_b;
          o[4 * i + 3] *= corr_b;
        }
      }
      pack_p();
    }
  };
  // The PV of the tile at ring position r, alone (an item's last).
  auto last_pv = [&](int r) {
    const int pstage = r % kStages;
    MbarWait(fullv + 8 * pstage, (r / kStages) & 1);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    fence_operands();
    wgmma::Fence();
    issue_pv(pstage);
    wgmma::Wait<0>();
    fence_operands();
    MbarArrive(emptyv + 8 * pstage);
  };

  if (wg == 1) NamedArrive(1, 256);  // warpgroup 0 issues first
  int gt = 0;                        // K/V tiles consumed so far (ring position)
  if constexpr (kCross) {
    // An item's first QK^T goes with the previous item's last PV (that
    // item's rows are written after it, in place of the rescale of O). With
    // no previous item the PV is a dummy that reads this item's first V tile
    // (landed; released by its real PV later) with P as it is: O is zeroed
    // after it. One code path for every turn, so ptxas keeps the products
    // asynchronous.
    bool pending = false;  // the previous item's last PV and rows are still to do
    T* p_out = nullptr;
    int p_rows = 0, p_bad = INT_MAX, p_pos_a = 0, p_pos_b = 0, p_r = 0;
    // What the first dummy PV reads and the first turn saves (its result is
    // discarded: defined all the same).
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    l_a = l_b = 0.0f;
    for (int n = 0;; ++n) {
      const int slot = n % kQBufs;
      MbarWait(qfull + 8 * slot, (n / kQBufs) & 1);
      const Item item = sm_item[slot];
      if (item.n_keys < 0) break;
      T* const out = open_item(item, slot);
      if (n_keys == 0) {
        zero_rows(item, out, slot);
        continue;
      }
      const int n_tiles = (n_keys + kN - 1) / kN;
      {
        const int vr = pending ? p_r : gt;  // the V tile the (maybe dummy) PV reads
        const int stage = gt % kStages, pstage = vr % kStages;
        MbarWait(fullk + 8 * stage, (gt / kStages) & 1);
        MbarWait(fullv + 8 * pstage, (vr / kStages) & 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        NamedSync(1 + wg, 256);
        fence_operands();
        wgmma::Fence();
        issue_qk(stage);
        issue_pv(pstage);
        NamedArrive(2 - wg, 256);
        wgmma::Wait<1>();
        wgmma::FenceRegs(p);
        MbarArrive(emptyk + 8 * stage);
        const float p_l_a = l_a, p_l_b = l_b;
        m_a = m_b = -INFINITY;
        l_a = l_b = 0.0f;
        softmax((n_tiles - 1) * kN);
        wgmma::Wait<0>();
        fence_operands();
        if (pending) MbarArrive(emptyv + 8 * pstage);
        pack_p();
        if (pending) {
          StoreRows<T, kD>(p_out, out_stride, o, p_l_a, p_l_b, row_a, row_b, p_rows, t, p_pos_a, p_pos_b, p_bad,
                           a.pool.block_size, a.causal);
        }
#pragma unroll
        for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
      }
      middle_tiles(gt, n_tiles);
      MbarArrive(qempty + 8 * slot);  // every QK^T of the item is done: its Q buffer is free
      pending = true;
      p_out = out;
      p_rows = item.rows;
      p_bad = item.first_bad;
      p_pos_a = pos_a;
      p_pos_b = pos_b;
      p_r = gt + n_tiles - 1;
      gt += n_tiles;
    }
    if (pending) {
      last_pv(p_r);
      StoreRows<T, kD>(p_out, out_stride, o, l_a, l_b, row_a, row_b, p_rows, t, p_pos_a, p_pos_b, p_bad,
                       a.pool.block_size, a.causal);
    }
  } else {
    for (int n = 0;; ++n) {
      const int slot = n % kQBufs;
      MbarWait(qfull + 8 * slot, (n / kQBufs) & 1);
      const Item item = sm_item[slot];
      if (item.n_keys < 0) break;
      T* const out = open_item(item, slot);
      if (n_keys == 0) {
        zero_rows(item, out, slot);
        continue;
      }
      const int n_tiles = (n_keys + kN - 1) / kN;
      if constexpr (kQRegs) {
        // This warp's 16 rows, as wgmma's A fragments (lanes 16-31 the upper 8 columns of each 16).
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          LdMatrixX4(sQwg + PanelOffset<kD>(64, warp * 16 + (lane & 15), kk * 2 + (lane >> 4)), qf[kk]);
        }
        MbarArrive(qempty + 8 * slot);
      }
#pragma unroll
      for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
      m_a = m_b = -INFINITY;
      l_a = l_b = 0.0f;
      {
        // The first tile (the last keys): its product alone.
        const int stage = gt % kStages;
        MbarWait(fullk + 8 * stage, (gt / kStages) & 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        NamedSync(1 + wg, 256);
        wgmma::Fence();
        issue_qk(stage);
        NamedArrive(2 - wg, 256);
        wgmma::Wait<0>();
        wgmma::FenceRegs(p);
        fence_q();
        MbarArrive(emptyk + 8 * stage);
        softmax((n_tiles - 1) * kN);
        pack_p();
      }
      middle_tiles(gt, n_tiles);
      if constexpr (!kQRegs) MbarArrive(qempty + 8 * slot);  // every QK^T of the item is done: its Q buffer is free
      last_pv(gt + n_tiles - 1);
      gt += n_tiles;
      StoreRows<T, kD>(out, out_stride, o, l_a, l_b, row_a, row_b, item.rows, t, pos_a, pos_b, item.first_bad,
                       a.pool.block_size, a.causal);
    }
  }
  // Warpgroup 1's last arrival on barrier 1 (after its last product, or
  // the first one if there was none) has no turn of warpgroup 0 to take.
  if (wg == 0) NamedSync(1, 256);
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

template <typename T, int kD, int kOpt, int kN = 128>
int LaunchFa3(const AttnArgs& a, cudaStream_t stream) {
  // Q buffers (two, or one with 176-key tiles) + two K and two V stages + alignment.
  constexpr int kSmem = ((kN == 128 ? 2 : 1) * 128 + 2 * 2 * kN) * kD * 2 + 1024;
  auto* kernel = PrefillFa3Kernel<T, kD, kOpt, kN>;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  PoolMaps maps{};
  if constexpr ((kOpt & kOptTma) != 0) {
    // The box sizes the tiles' pieces can have: whole pages where a tile
    // is whole pages, else every multiple of 16 up to a page. A 256-byte L2
    // promotion (the decode kernel's 128 measured the same here).
    const int page = a.pool.block_size;
    for (int j = 0; j < page / 16; ++j) {
      if (kN % page == 0 && 16 * (j + 1) != page) continue;
      if (!EncodePoolMap(a, 16 * (j + 1), &maps.box[j], 3)) return LaunchFa3<T, kD, kOpt & ~kOptTma, kN>(a, stream);
    }
  }
  const int tiles_x = (a.max_q_len + 127) / 128;
  const int64_t items = int64_t{tiles_x} * a.num_heads * a.num_seqs;
  if (items >= (int64_t{1} << 31)) return static_cast<int>(cudaErrorInvalidValue);
  if constexpr ((kOpt & kOptPersistent) != 0) {
    // The work counter and exit count: in the zeroed head of the workspace,
    // past the error word (the kernel leaves them zero).
    unsigned* sched = reinterpret_cast<unsigned*>(a.error) + 32;
    const int grid = static_cast<int>(std::min<int64_t>(items, a.num_sms > 0 ? a.num_sms : 132));
    kernel<<<grid, 384, kSmem, stream>>>(a, maps, tiles_x, static_cast<int>(items), sched);
  } else {
    const dim3 grid(tiles_x, a.num_heads, a.num_seqs);
    kernel<<<grid, 384, kSmem, stream>>>(a, maps, tiles_x, static_cast<int>(items), nullptr);
  }
  return static_cast<int>(cudaGetLastError());
}

// PrefillFa3Kernel, persistent, with TMA loads, the lazy rescale where it
// pays (head_dim 128 at pages of 16), and no drain at item boundaries if
// `cross`.
template <typename T, int kD, int kN>
int LaunchTuned(const AttnArgs& a, cudaStream_t stream, bool cross) {
  constexpr int kBase = kOptTma | kOptPersistent;
  if constexpr (kD == 128) {
    if (a.pool.block_size == 16) {
      return cross ? LaunchFa3<T, kD, kBase | kOptLazyRescale | kOptCrossItem, kN>(a, stream)
                   : LaunchFa3<T, kD, kBase | kOptLazyRescale, kN>(a, stream);
    }
  }
  return cross ? LaunchFa3<T, kD, kBase | kOptCrossItem, kN>(a, stream) : LaunchFa3<T, kD, kBase, kN>(a, stream);
}

template <typename T, int kD>
int LaunchTypedDim(const AttnArgs& a, cudaStream_t stream, int variant) {
  switch (variant) {
    case 1:  // the earlier warp-specialized kernel: 64-key tiles, cp.async, one warpgroup up to 64 rows
      return a.max_q_len > 64 ? LaunchWs<T, kD, 3, 3>(a, stream) : LaunchWs<T, kD, 1, 3>(a, stream);
    case 2:  // PrefillFa3Kernel with cp.async gathers instead of TMA
      return LaunchFa3<T, kD, kOptPersistent>(a, stream);
    case 3:  // diagnostic: PrefillFa3Kernel loading only its first tiles (wrong results)
      return LaunchFa3<T, kD, kOptNoLoads | kOptPersistent>(a, stream);
    case 4:  // PrefillFa3Kernel with one CTA per work item (no work counter)
      return LaunchFa3<T, kD, kOptTma>(a, stream);
    case 5:  // the default with the lazy rescale
      return LaunchFa3<T, kD, kOptTma | kOptPersistent | kOptLazyRescale>(a, stream);
    case 6:  // the default with Q in registers
      return LaunchFa3<T, kD, kOptTma | kOptPersistent | kOptQRegs>(a, stream);
    case 7:  // the default with a drain at every item boundary
    case 8:  // the default with none
      return LaunchTuned<T, kD, 128>(a, stream, variant == 8);
    case 9:  // the default with 176-key tiles where not causal at head_dim 128
    case 10:
      if constexpr (kD == 128) {
        if (!a.causal) return LaunchTuned<T, kD, 176>(a, stream, variant == 10);
      }
      return LaunchTuned<T, kD, 128>(a, stream, variant == 10);
    default:
      // Every query count takes the same kernel (a short chunk wastes half
      // of a 128-row CTA) so that a row's arithmetic does not depend on how
      // its prompt was chunked: one-pass, chunked and token-by-token prefill
      // give the same bits (the options below change the order of the work,
      // never a row's arithmetic). Pages of 16 (the engine's default) take
      // the lazy rescale: +4-5% there on an H100, 0.5-1.5% slower at page 64
      // and 4% at head_dim 64 (NOTES.md, 2026-11-28). From 2048 keys the item
      // boundaries do not drain (kOptCrossItem): +1-2% at 4k-16k, equal at
      // 2k, 1-1.5% slower at 1k (H200, NOTES.md, 2026-11-28 morning).
      // Non-causal at head_dim 128 from 8192 keys takes 176-key tiles
      // (9% fewer instructions, +1.2% at 8k and even at 16k on an H200;
      // 0.8% slower at 4k, whose 24th tile holds 48 keys: NOTES.md,
      // 2026-11-28 fifth session). Causal rows, the engine's, never do.
      if constexpr (kD == 128) {
        if (!a.causal && a.max_context >= 8192) return LaunchTypedDim<T, kD>(a, stream, 10);
      }
      return LaunchTypedDim<T, kD>(a, stream, a.max_context >= 2048 ? 8 : 7);
  }
}

template <typename T>
int LaunchTyped(const AttnArgs& a, cudaStream_t stream, int variant) {
  if (a.pool.head_dim == 64) return LaunchTypedDim<T, 64>(a, stream, variant);
  return LaunchTypedDim<T, 128>(a, stream, variant);
}

}  // namespace

// Declared in async_copy.cuh.
bool EncodePoolMap(const AttnArgs& a, int box_rows, CUtensorMap* map, int l2_promotion, int kv_box, bool split_rows) {
  static const auto encode = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  const PoolView& p = a.pool;
  const int halves = split_rows ? p.head_dim / 64 : 1;  // 128-byte rows per head_dim row
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(split_rows ? 64 : p.head_dim),
                              static_cast<cuuint64_t>(p.block_size) * halves,
                              static_cast<cuuint64_t>(a.num_heads / a.group), 2, static_cast<cuuint64_t>(p.num_blocks)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(split_rows ? 64 : p.head_dim) * 2,
                                 static_cast<cuuint64_t>(p.head_stride) * 2, static_cast<cuuint64_t>(p.kv_stride) * 2,
                                 static_cast<cuuint64_t>(p.block_stride) * 2};
  const cuuint32_t box[5] = {64, static_cast<cuuint32_t>(box_rows * halves), 1, static_cast<cuuint32_t>(kv_box), 1};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  return encode(map, a.elem == Elem::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
                const_cast<void*>(p.kv), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, static_cast<CUtensorMapL2promotion>(l2_promotion),
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

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
  // Grid limits: y and z at most 65535 (heads and sequences; the comparison
  // kernel's 64-row query tiles).
  if (a.num_seqs > 65535 || a.num_heads > 65535 || (a.max_q_len + 63) / 64 > 65535) return false;
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
