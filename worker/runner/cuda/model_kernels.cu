// The CUDA runner's row and element-wise kernels (see model_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <type_traits>

#include "common/xxh3_portable.h"
#include "kernels/cuda/common.cuh"
#include "worker/runner/cuda/clean_logit.cuh"
#include "worker/runner/cuda/model_kernels.h"

namespace tandem::worker::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
using kernels::cuda::internal::kErrSlot;
using kernels::cuda::internal::LoadStreaming;
using kernels::cuda::internal::PoolOffset;
using kernels::cuda::internal::RecordError;

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }
int Err() { return static_cast<int>(cudaGetLastError()); }
unsigned Blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__device__ __forceinline__ float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The normed row AddRmsNormKernel writes and the fused products build in
// shared memory: out = bf16(in * scale * weight), this thread's share of a
// CTA's float4 walk over `vecs`.
__device__ __forceinline__ void WriteNormed(const float4* in, const bf16* weight, float scale, int vecs, bf16* out) {
  auto* o = reinterpret_cast<__nv_bfloat162*>(out);
  const auto* w = reinterpret_cast<const __nv_bfloat162*>(weight);
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    const float4 v = in[i];
    const float2 w0 = __bfloat1622float2(w[2 * i]), w1 = __bfloat1622float2(w[2 * i + 1]);
    o[2 * i] = __floats2bfloat162_rn(v.x * scale * w0.x, v.y * scale * w0.y);
    o[2 * i + 1] = __floats2bfloat162_rn(v.z * scale * w1.x, v.w * scale * w1.y);
  }
}

// silu(g) * u with SiLU rounded to bf16 first (the caller rounds the
// product).
__device__ __forceinline__ float SiluTimes(float g, float u) { return RoundBf16(g / (1.0f + __expf(-g))) * u; }

// RoPE at position `pos` for pair i: the angle in double, its cos and sin
// as float (x: cos, y: sin).
__device__ __forceinline__ float2 RopeTrig(double pos, double inv_freq) {
  double s, c;
  sincos(pos * inv_freq, &s, &c);
  return make_float2(static_cast<float>(c), static_cast<float>(s));
}
// A pair (x0 at i, x1 at i + head_dim/2) rotated, each rounded to bf16.
__device__ __forceinline__ void RotatePair(float x0, float x1, float2 cs, bf16* y0, bf16* y1) {
  *y0 = __float2bfloat16(x0 * cs.x - x1 * cs.y);
  *y1 = __float2bfloat16(x1 * cs.x + x0 * cs.y);
}

// A token's KV slot in a layer's pool: block -1 where nothing is written
// (slot -1, or past the pool: then `past`, which the caller records).
struct KvSlot {
  int64_t block = -1;
  int in_block = 0;
  bool past = false;
};
__device__ __forceinline__ KvSlot SlotOf(const kernels::cuda::internal::PoolView& p, int64_t slot) {
  KvSlot s;
  if (slot < 0) return s;
  s.block = slot / p.block_size;
  s.in_block = static_cast<int>(slot % p.block_size);
  if (s.block >= p.num_blocks) {
    s.block = -1;
    s.past = true;
  }
  return s;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024).
__device__ float BlockSum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? partial[lane] : 0.0f;
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[0] = v;
  }
  __syncthreads();
  const float total = partial[0];
  __syncthreads();  // partial is reused by the next call
  return total;
}

template <typename T>
__global__ void ToBf16Kernel(const T* src, bf16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      dst[i] = __float2bfloat16(src[i]);
    } else {
      dst[i] = __float2bfloat16(__half2float(src[i]));
    }
  }
}

// The residual stream is float32: one row of bfloat16 embeddings widened.
__global__ void EmbedKernel(const int32_t* tokens, const bf16* table, int hidden, float* out) {
  const int t = blockIdx.x;
  const bf16* row = table + int64_t{tokens[t]} * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[int64_t{t} * hidden + i] = __bfloat162float(row[i]);
}

// One CTA per row: x[row] += delta + bias (when given), then, when `weight`
// is given, out = bf16(x * rsqrt(mean(x^2) + eps) * weight). float4 steps
// (hidden % 8 == 0, checked by the runner); the row is read back from L1/L2
// for the second pass.
__global__ void AddRmsNormKernel(float* x, const int* rows, const bf16* delta, const bf16* bias, int hidden,
                                 const bf16* weight, float eps, bf16* out) {
  const int r = blockIdx.x;
  const int64_t src = rows != nullptr ? rows[r] : r;
  float4* in = reinterpret_cast<float4*>(x + src * hidden);
  const int vecs = hidden / 4;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    float4 v = in[i];
    if (delta != nullptr) {
      const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(delta + src * hidden) + 2 * i;
      const float2 d0 = __bfloat1622float2(d[0]), d1 = __bfloat1622float2(d[1]);
      v.x += d0.x;
      v.y += d0.y;
      v.z += d1.x;
      v.w += d1.y;
      if (bias != nullptr) {
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(bias) + 2 * i;
        const float2 b0 = __bfloat1622float2(b[0]), b1 = __bfloat1622float2(b[1]);
        v.x += b0.x;
        v.y += b0.y;
        v.z += b1.x;
        v.w += b1.y;
      }
      in[i] = v;
    }
    sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  if (weight == nullptr) return;
  WriteNormed(in, weight, rsqrtf(BlockSum(sum) / hidden + eps), vecs, out + int64_t{r} * hidden);
}

// Grid (tokens, parts): each CTA computes its token's cos/sin table
// (shared), then its part of the (head, pair)s of Q and K, then of V; a
// decode step's one token is spread over several CTAs instead of looping in
// one (same values either way).
__global__ void RopeWriteKvKernel(RopeWriteArgs a) {
  extern __shared__ float trig[];  // [half] cos, then [half] sin
  const int t = blockIdx.x;
  const int half = a.head_dim / 2;
  const double pos = a.positions[t];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float2 cs = RopeTrig(pos, a.inv_freq[i]);
    trig[i] = cs.x;
    trig[half + i] = cs.y;
  }
  __syncthreads();

  bf16* row = static_cast<bf16*>(a.qkv) + int64_t{t} * a.qkv_stride;
  const bf16* bias = static_cast<const bf16*>(a.bias);
  const int q_size = a.num_heads * a.head_dim, kv_size = a.num_kv_heads * a.head_dim;
  const KvSlot kv = SlotOf(a.pool, a.slot_mapping[t]);
  if (kv.past && threadIdx.x == 0 && blockIdx.y == 0) RecordError(a.error, kErrSlot, t);
  const int64_t block = kv.block;
  const int in_block = kv.in_block;
  bf16* pool = static_cast<bf16*>(const_cast<void*>(a.pool.kv));
  auto load = [&](int col) {
    float v = __bfloat162float(row[col]);
    if (bias != nullptr) v = RoundBf16(v + __bfloat162float(bias[col]));
    return v;
  };
  const int pairs = (a.num_heads + a.num_kv_heads) * half;
  const int first = blockIdx.y * blockDim.x, stride = gridDim.y * blockDim.x;
  for (int p = first + threadIdx.x; p < pairs; p += stride) {
    const int head = p / half, i = p % half;  // heads: Q's, then K's
    const int col = head * a.head_dim + i;
    const float x0 = load(col), x1 = load(col + half);
    bf16 y0, y1;
    RotatePair(x0, x1, make_float2(trig[i], trig[half + i]), &y0, &y1);
    if (head < a.num_heads) {
      row[col] = y0;
      row[col + half] = y1;
    } else if (block >= 0) {
      const int64_t at = PoolOffset(a.pool, block, 0, head - a.num_heads, in_block);
      pool[at + i] = y0;
      pool[at + i + half] = y1;
    }
  }
  if (block < 0) return;
  for (int j = first + threadIdx.x; j < kv_size; j += stride) {
    const int head = j / a.head_dim, d = j % a.head_dim;
    pool[PoolOffset(a.pool, block, 1, head, in_block) + d] = __float2bfloat16(load(q_size + kv_size + j));
  }
}

// Grid (column groups, token groups); each thread eight columns through
// 16-byte loads and stores (inter % 8 == 0, checked by the runner), for
// tokens blockIdx.y, + gridDim.y, ... (grid.y is at most 65535).
__global__ void SiluMulKernel(const bf16* gu, int inter, int num_tokens, bf16* out) {
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (j >= inter) return;
  for (int t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const uint4 graw = *reinterpret_cast<const uint4*>(gu + int64_t{t} * 2 * inter + j);
    const uint4 uraw = *reinterpret_cast<const uint4*>(gu + int64_t{t} * 2 * inter + inter + j);
    const auto* g2 = reinterpret_cast<const __nv_bfloat162*>(&graw);
    const auto* u2 = reinterpret_cast<const __nv_bfloat162*>(&uraw);
    uint4 oraw;
    auto* o2 = reinterpret_cast<__nv_bfloat162*>(&oraw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 g = __bfloat1622float2(g2[k]), u = __bfloat1622float2(u2[k]);
      o2[k] = __floats2bfloat162_rn(SiluTimes(g.x, u.x), SiluTimes(g.y, u.y));
    }
    *reinterpret_cast<uint4*>(out + int64_t{t} * inter + j) = oraw;
  }
}

__global__ void AddBiasKernel(bf16* y, int n, int64_t total, const bf16* bias) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = __float2bfloat16(__bfloat162float(y[i]) + __bfloat162float(bias[i % n]));
  }
}

// x[i] = float(bf16(x[i])), four values a thread (a tail of n % 4 by the
// first threads).
__global__ void RoundToBf16Kernel(float* x, int64_t n) {
  const int64_t vecs = n / 4;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vecs; i += int64_t{gridDim.x} * blockDim.x) {
    float4 v = reinterpret_cast<float4*>(x)[i];
    v = make_float4(RoundBf16(v.x), RoundBf16(v.y), RoundBf16(v.z), RoundBf16(v.w));
    reinterpret_cast<float4*>(x)[i] = v;
  }
  const int64_t tail = vecs * 4 + blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (tail < n) x[tail] = RoundBf16(x[tail]);
}

// One warp's dot products of R weight rows (wr[r]: k / 8 16-byte chunks)
// with M x rows (row stride k; in shared memory where kSharedX), this lane's
// share of the chunks, into acc. kLoads 16-byte weight loads a row are in
// flight before any is used; `prologue` runs once the first of them are
// issued (the fused kernel builds its x there: the weights stream meanwhile).
template <int M, int R, int kLoads, bool kSharedX, typename Prologue>
__device__ __forceinline__ void GemvDot(const uint4* const (&wr)[R], int chunks, int lane, const bf16* x, int k,
                                        bool active, float (&acc)[R][M], Prologue&& prologue) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  uint4 wv[R][kLoads];
  auto load = [&](int base) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int c = base + 32 * u;
        wv[r][u] = active && c < chunks ? LoadStreaming(wr[r] + c) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  load(lane);
  prologue();
  if (!active) return;
  for (int base = lane; base < chunks; base += 32 * kLoads) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int c = base + 32 * u;
      if (c >= chunks) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const uint4* xp = reinterpret_cast<const uint4*>(x + int64_t{i} * k) + c;
        const uint4 xv = kSharedX ? *xp : __ldg(xp);
        const auto* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const auto* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[r][u]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(x2[q]), wf = __bfloat1622float2(w2[q]);
            acc[r][i] = fmaf(wf.x, f.x, acc[r][i]);
            acc[r][i] = fmaf(wf.y, f.y, acc[r][i]);
          }
        }
      }
    }
    if (base + 32 * kLoads < chunks) load(base + 32 * kLoads);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      for (int o = 16; o > 0; o >>= 1) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], o);
    }
  }
}

// The GEMV kernels' CTA: eight warps; each output row is split over kSplit
// of them (consecutive), warp `part` taking the part-th slice of the row's
// k / 8 chunks. Many warps with few loads each put the whole weight matrix
// in flight at once and end together: on an H200, 8B decode shapes, a row
// split over four warps with two loads a lane in flight took 13.9 / 9.9 /
// 53.9 / 28.6 us for the QKV / output / gate+up / down products against
// 17.4 / 11.6 / 57.3 / 34.8 us for a warp a row with eight
// (kernels/cuda/NOTES.md, 2026-11-29). A product that norms its own x does
// so once a CTA, so splitting it finer multiplies that work: two warps a row
// there (the 8B batch-1 step at 128 keys: 4.70 ms unsplit, 4.46 with the
// plain products split in four, 4.43 with the normed ones in two as well;
// 4.71-4.75 with every product in four, 5.5 in eight), and one for the QKV
// product, whose norm is the largest share of its time (16.7 us against
// 18.3 in two, once its epilogue's inputs were loaded in the prologue; the
// gate/up product 58.4 in one against 57.0 in two). Sixteen or 32 warps a
// CTA for the normed products (fewer CTAs, fewer norms) were slower.
inline constexpr int kGemvWarps = 8;
inline constexpr int kGemvSplit = 4;
template <GemvEpilogue E>
inline constexpr int kGemvSplitNorm = E == GemvEpilogue::kRopeWriteKv ? 1 : 2;
struct ChunkRange {
  int begin, len;
};
__device__ __forceinline__ ChunkRange PartOf(int chunks, int part, int split) {
  const int per = (chunks + split - 1) / split;
  const int begin = min(chunks, part * per);
  return {begin, min(chunks, begin + per) - begin};
}
// 16-byte weight loads in flight a lane and row (all issued before any is
// used): eight at a warp a row, four at two, two from four on (halved
// where a warp computes two rows, or LaunchGemv's more than kMaxFusedRows
// x rows; the fused products at four tokens took 15.0 / 38.9 us for the
// 8B output / down products with two loads, 16.3 / 40.6 with one, on an
// H200).
__host__ __device__ constexpr int GemvLoads(int split, bool wide) {
  const int loads = (wide ? 4 : 8) / (split < 4 ? split : 4);
  return loads > 0 ? loads : 1;
}

// A row's total over its kSplit warps, in part order (the same bits however
// the warps run), into lane 0 of its first warp. Every thread of the CTA
// calls it.
template <int kSplit, int R, int M>
__device__ __forceinline__ void SumParts(float (&acc)[R][M]) {
  if constexpr (kSplit > 1) {
    __shared__ float sums[kGemvWarps][R * M];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < M; ++i) sums[warp][r * M + i] = acc[r][i];
      }
    }
    __syncthreads();
    if (lane == 0 && warp % kSplit == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float s = sums[warp][r * M + i];
          for (int p = 1; p < kSplit; ++p) s += sums[warp + p][r * M + i];
          acc[r][i] = s;
        }
      }
    }
  }
}

template <int M, typename Out, int kSplit>
__global__ void __launch_bounds__(256) GemvKernel(const bf16* x, const bf16* w, Out* y, int n, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.x * (kGemvWarps / kSplit) + warp / kSplit, part = warp % kSplit;
  const bool active = j < n;
  const ChunkRange cr = PartOf(k / 8, part, kSplit);
  const uint4* const wr[1] = {reinterpret_cast<const uint4*>(w + int64_t{active ? j : 0} * k) + cr.begin};
  float acc[1][M];
  GemvDot<M, 1, GemvLoads(kSplit, M > kMaxFusedRows), false>(wr, cr.len, lane, x + cr.begin * 8, k, active, acc, [] {});
  SumParts<kSplit>(acc);
  if (!active || part != 0) return;
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (lane == 0) {
      if constexpr (std::is_same_v<Out, float>) {
        y[int64_t{r} * n + j] = acc[0][r];
      } else {
        y[int64_t{r} * n + j] = __float2bfloat16(acc[0][r]);
      }
    }
  }
}

// The fused products' epilogue (GemvEpilogue) for token t at output unit u
// (a row, or a row pair where R = 2): v0 and v1, the sums of its weight
// rows; b0 and b1, their bias values (has_bias); res, the residual's value
// (kResidual); trig and slot, RoPE's angle and the token's slot
// (kRopeWriteKv). The roundings of the unfused kernels: the product's
// output, + bias, in bf16.
template <GemvEpilogue kEpi>
__device__ __forceinline__ void ApplyEpilogue(const GemvFusion& f, bf16* y, int n, int u, int t, float v0, float v1,
                                              bool has_bias, float b0, float b1, float res, float2 trig, int64_t slot) {
  auto out = [&](float v, float b) {
    const float r = RoundBf16(v);
    return has_bias ? RoundBf16(r + b) : r;
  };
  if constexpr (kEpi == GemvEpilogue::kStore) {
    y[int64_t{t} * n + u] = __float2bfloat16(out(v0, b0));
  } else if constexpr (kEpi == GemvEpilogue::kResidual) {
    // AddRmsNormKernel's order: (x + delta) + bias, the delta in bf16.
    const float d = RoundBf16(v0);
    f.residual[int64_t{t} * n + u] = has_bias ? res + d + b0 : res + d;
  } else if constexpr (kEpi == GemvEpilogue::kSiluMul) {
    y[int64_t{t} * n + u] = __float2bfloat16(SiluTimes(out(v0, b0), out(v1, b1)));
  } else {
    // RopeWriteKvKernel's arithmetic for token t, at this pair.
    const RopeWriteArgs& a = f.rope;
    const int half = a.head_dim / 2, head = u / half, pair = u % half;
    const int row0 = head * a.head_dim + pair;
    const float x0 = out(v0, b0), x1 = out(v1, b1);
    bf16 y0 = __float2bfloat16(x0), y1 = __float2bfloat16(x1);
    if (head < a.num_heads + a.num_kv_heads) RotatePair(x0, x1, trig, &y0, &y1);
    if (head < a.num_heads) {
      bf16* q = static_cast<bf16*>(a.qkv) + int64_t{t} * a.qkv_stride;
      q[row0] = y0;
      q[row0 + half] = y1;
      return;
    }
    const KvSlot kv = SlotOf(a.pool, slot);
    if (kv.past && head == a.num_heads && pair == 0) RecordError(a.error, kErrSlot, t);
    if (kv.block < 0) return;
    const bool is_k = head < a.num_heads + a.num_kv_heads;
    const int kv_head = head - a.num_heads - (is_k ? 0 : a.num_kv_heads);
    bf16* pool = static_cast<bf16*>(const_cast<void*>(a.pool.kv));
    const int64_t at = PoolOffset(a.pool, kv.block, is_k ? 0 : 1, kv_head, kv.in_block);
    pool[at + pair] = y0;
    pool[at + pair + half] = y1;
  }
}

// The inputs of RoPE's epilogue for token t at unit u (ApplyEpilogue's trig
// and slot): the angle where the unit is in a Q or K head, the slot where
// in a K or V head.
__device__ __forceinline__ void RopeInputs(const RopeWriteArgs& a, int u, int t, float2* trig, int64_t* slot) {
  const int half = a.head_dim / 2, head = u / half;
  *slot = head >= a.num_heads ? a.slot_mapping[t] : -1;
  *trig = head < a.num_heads + a.num_kv_heads ? RopeTrig(a.positions[t], a.inv_freq[u % half]) : float2{};
}

// The fused GEMV of a decode step of M tokens (GemvFusion). Its x rows are
// the RMS-normed residual rows (built in shared memory by every CTA, rounded
// to bf16 as AddRmsNormKernel writes them) or bf16 vectors; its outputs are
// bf16 vectors, the residual's update, the SiLU-and-multiply of a gate row
// and its up row (R = 2: warp j computes rows j and j + n), or RopeWriteKv's
// rotation and KV write of a head's row pair (R = 2: rows i and i + half).
// Each token's sums are those of a launch of that token alone.
template <bool kNorm, GemvEpilogue kEpi, int kSplit, int M>
__global__ void __launch_bounds__(256)
    GemvFusedKernel(const bf16* x, const bf16* w, bf16* y, int n, int k, GemvFusion f) {
  constexpr bool kRope = kEpi == GemvEpilogue::kRopeWriteKv;
  constexpr int R = kEpi == GemvEpilogue::kSiluMul || kRope ? 2 : 1;
  extern __shared__ __align__(16) bf16 xs[];  // [M, k] where kNorm
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.x * (kGemvWarps / kSplit) + warp / kSplit, part = warp % kSplit;
  const bool active = j < n;
  const int unit = active ? j : 0;
  // The warp's weight rows: j (and j + n), or a head's pair.
  const int half = kRope ? f.rope.head_dim / 2 : 1;
  const int row0 = kRope ? unit / half * f.rope.head_dim + unit % half : unit;
  const int step = kRope ? half : n;
  const ChunkRange cr = PartOf(k / 8, part, kSplit);
  uint4 const* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wr[r] = reinterpret_cast<const uint4*>(w + (int64_t{row0} + r * int64_t{step}) * k) + cr.begin;
  }
  // The epilogue's inputs, loaded by the lane that writes the row's results
  // as soon as the first weight loads are in flight (after the sums they
  // were a round trip at the end of every CTA): the bias, the residual
  // values (kResidual), RoPE's angles and the slots (kRopeWriteKv).
  const bool owner = active && lane == 0 && part == 0;
  const auto* bias = static_cast<const bf16*>(f.bias);
  float in_bias[R] = {}, in_res[M] = {};
  float2 in_trig[M] = {};
  int64_t in_slot[M] = {};
  auto prologue = [&] {
    if (owner) {
#pragma unroll
      for (int r = 0; r < R; ++r) in_bias[r] = bias != nullptr ? __bfloat162float(bias[row0 + r * step]) : 0.0f;
#pragma unroll
      for (int t = 0; t < M; ++t) {
        if constexpr (kEpi == GemvEpilogue::kResidual) in_res[t] = f.residual[int64_t{t} * n + j];
        if constexpr (kRope) RopeInputs(f.rope, unit, t, &in_trig[t], &in_slot[t]);
      }
    }
    if constexpr (kNorm) {  // x: the normed residual rows, into shared memory
      const int vecs = k / 4;
#pragma unroll 1
      for (int t = 0; t < M; ++t) {
        const float4* in = reinterpret_cast<const float4*>(f.norm_x + int64_t{t} * k);
        float sum = 0.0f;
        for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
          const float4 v = in[i];
          sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        WriteNormed(in, static_cast<const bf16*>(f.norm_weight), rsqrtf(BlockSum(sum) / k + f.eps), vecs,
                    xs + int64_t{t} * k);
      }
      __syncthreads();
    }
  };
  float acc[R][M];
  GemvDot<M, R, GemvLoads(kSplit, R == 2), kNorm>(wr, cr.len, lane, (kNorm ? xs : x) + cr.begin * 8, k, active, acc,
                                                  prologue);
  SumParts<kSplit>(acc);
  if (!owner) return;
#pragma unroll
  for (int t = 0; t < M; ++t) {
    ApplyEpilogue<kEpi>(f, y, n, j, t, acc[0][t], acc[R - 1][t], bias != nullptr, in_bias[0], in_bias[R - 1], in_res[t],
                        in_trig[t], in_slot[t]);
  }
}

// CTAs for n rows at `split` warps a row.
unsigned GemvBlocks(int n, int split) {
  return static_cast<unsigned>((int64_t{n} * split + kGemvWarps - 1) / kGemvWarps);
}

// Up to kMaxFusedRows rows: kGemvSplit warps a row, as the fused products
// split them; more: a warp a row.
template <int M>
int GemvFor(const bf16* x, int k, const bf16* w, int n, void* y, bool f32, cudaStream_t s) {
  constexpr int kSplit = M <= kMaxFusedRows ? kGemvSplit : 1;
  const unsigned blocks = GemvBlocks(n, kSplit);
  if (f32) {
    GemvKernel<M, float, kSplit><<<blocks, kGemvWarps * 32, 0, s>>>(x, w, static_cast<float*>(y), n, k);
  } else {
    GemvKernel<M, bf16, kSplit><<<blocks, kGemvWarps * 32, 0, s>>>(x, w, static_cast<bf16*>(y), n, k);
  }
  return static_cast<int>(cudaGetLastError());
}

// The tensor-core product of a few rows (GemvMmaKernel): a CTA computes 16
// output columns (16 weight rows) for every token, its kMmaGemvWarps warps
// each taking every kMmaGemvWarps-th 64-wide slice of k. The weight rows
// are the mma's A operand (16 x 16 a k-step), the tokens its B (16 x 8, one
// or two tiles of eight tokens). A lane loads 32 contiguous bytes of each of
// its two weight rows (g and g + 8) and of its token's x row (g) a slice:
// the same k positions for both operands, so the slice's 64 values are fed
// to the four k-steps in a permuted order that the dot product does not
// see. The warps' partial sums meet in shared memory, added in warp order.
// Each warp loads kMmaGemvBatch slices (fewer at 16 rows: registers) before
// their products, so that several loads are in flight a warp (the volatile
// loads do not move past each other's mma); kMmaGemvCtas CTAs an SM. Two
// slices and three CTAs were the fastest of (1, 2), (4, 2), (3, 3), (2, 3)
// and (2, 4) on an H200 (docs/benchmarks.md); gemv_chain builds with other
// values (-DTANDEM_GEMV_MMA_BATCH=, -DTANDEM_GEMV_MMA_CTAS=) to compare.
constexpr int kMmaGemvWarps = 8;
#ifndef TANDEM_GEMV_MMA_BATCH
#define TANDEM_GEMV_MMA_BATCH 2
#endif
#ifndef TANDEM_GEMV_MMA_CTAS
#define TANDEM_GEMV_MMA_CTAS 3
#endif
constexpr int kMmaGemvBatch = TANDEM_GEMV_MMA_BATCH;
constexpr int kMmaGemvCtas = TANDEM_GEMV_MMA_CTAS;

__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// kFused: the fused products' epilogue kEpi (kSiluMul or kRopeWriteKv) on
// n units of two weight rows each (row0 and row0 + step, as
// GemvFusedKernel pairs them): the tile's rows g and g + 8 are unit
// blockIdx.x * 8 + g's two rows, so a lane holds both sums of its unit for
// its tokens. Otherwise n plain rows, 16 a CTA, into y (bf16 or float32).
template <int NT, typename Out, bool kFused = false, GemvEpilogue kEpi = GemvEpilogue::kStore>
__global__ void __launch_bounds__(kMmaGemvWarps * 32, kMmaGemvCtas)
    GemvMmaKernel(const bf16* x, const bf16* w, Out* y, int m, int n, int k, GemvFusion f) {
  constexpr bool kRope = kEpi == GemvEpilogue::kRopeWriteKv;
  __shared__ float4 part[kMmaGemvWarps][NT][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int slices = k / 64;
  // This lane's weight rows (A's rows g and g + 8).
  int64_t row_a = int64_t{blockIdx.x} * 16 + g, row_b = row_a + 8;
  const int unit = blockIdx.x * 8 + g;
  if constexpr (kFused) {
    const int half = kRope ? f.rope.head_dim / 2 : 1;
    row_a = kRope ? unit / half * f.rope.head_dim + unit % half : unit;
    row_b = row_a + (kRope ? half : n);
  }
  // uint4 units: a slice is 8 of a row; this lane's 32 bytes are 2 of them.
  const uint4* const w0 = reinterpret_cast<const uint4*>(w + row_a * k) + 2 * t;
  const uint4* const w1 = reinterpret_cast<const uint4*>(w + row_b * k) + 2 * t;
  const uint4* xr[NT];
  bool has[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int token = g + 8 * nt;
    has[nt] = token < m;
    xr[nt] = reinterpret_cast<const uint4*>(x + int64_t{has[nt] ? token : 0} * k) + 2 * t;
  }
  // The epilogue's inputs, loaded by warp 0 (which writes the results) as
  // its first weight loads go out: the unit's biases, and RoPE's angle and
  // slot for the lane's tokens 8 nt + 2 t + i.
  const auto* bias = static_cast<const bf16*>(f.bias);
  float b0 = 0.0f, b1 = 0.0f;
  float2 trig[NT][2] = {};
  int64_t slot[NT][2] = {};
  if (kFused && warp == 0) {
    if (bias != nullptr) {
      b0 = __bfloat162float(bias[row_a]);
      b1 = __bfloat162float(bias[row_b]);
    }
    if constexpr (kRope) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int token = 8 * nt + 2 * t + i;
          if (token < m) RopeInputs(f.rope, unit, token, &trig[nt][i], &slot[nt][i]);
        }
      }
    }
  }
  constexpr int kBatch = NT == 1 ? kMmaGemvBatch : (kMmaGemvBatch * 3 + 3) / 4;
  float c[NT][4] = {};
  for (int s0 = warp; s0 < slices; s0 += kBatch * kMmaGemvWarps) {
    uint4 a[kBatch][2][2], b[kBatch][NT][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = s0 + u * kMmaGemvWarps;
      const int o = s * 8;
      const bool in = s < slices;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        a[u][0][h] = in ? LoadStreaming(w0 + o + h) : make_uint4(0, 0, 0, 0);
        a[u][1][h] = in ? LoadStreaming(w1 + o + h) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) b[u][nt][h] = in && has[nt] ? __ldg(xr[nt] + o + h) : make_uint4(0, 0, 0, 0);
      }
    }
    // k-step j takes the values 4j..4j+3 of the lane's 16 (words 2j, 2j+1).
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int h = j / 2, w_lo = 2 * (j % 2);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          MmaBf16(c[nt], Word(a[u][0][h], w_lo), Word(a[u][1][h], w_lo), Word(a[u][0][h], w_lo + 1),
                  Word(a[u][1][h], w_lo + 1), Word(b[u][nt][h], w_lo), Word(b[u][nt][h], w_lo + 1));
        }
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) part[warp][nt][lane] = make_float4(c[nt][0], c[nt][1], c[nt][2], c[nt][3]);
  __syncthreads();
  if (warp != 0) return;
    // c[0..1]: row g (row_a), tokens 2t and 2t + 1 of the tile; c[2..3]: row g + 8 (row_b).
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float4 s = part[0][nt][lane];
#pragma unroll
    for (int wi = 1; wi < kMmaGemvWarps; ++wi) {
      const float4 v = part[wi][nt][lane];
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int token = 8 * nt + 2 * t + i;
      if (token >= m) continue;
      if constexpr (kFused) {
        ApplyEpilogue<kEpi>(f, y, n, unit, token, v[i], v[2 + i], bias != nullptr, b0, b1, 0.0f, trig[nt][i],
                            slot[nt][i]);
      } else if constexpr (std::is_same_v<Out, float>) {
        y[int64_t{token} * n + row_a] = v[i];
        y[int64_t{token} * n + row_b] = v[2 + i];
      } else {
        y[int64_t{token} * n + row_a] = __float2bfloat16(v[i]);
        y[int64_t{token} * n + row_b] = __float2bfloat16(v[2 + i]);
      }
    }
  }
}

// n plain rows (16 a CTA), or with kFused n units (8 a CTA).
template <int NT, bool kFused = false, GemvEpilogue kEpi = GemvEpilogue::kStore>
int GemvMmaFor(const bf16* x, int m, int k, const bf16* w, int n, void* y, bool f32, const GemvFusion& f,
               cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(kFused ? n / 8 : n / 16);
  if constexpr (!kFused) {
    if (f32) {
      GemvMmaKernel<NT, float><<<blocks, kMmaGemvWarps * 32, 0, s>>>(x, w, static_cast<float*>(y), m, n, k, f);
      return static_cast<int>(cudaGetLastError());
    }
  }
  GemvMmaKernel<NT, bf16, kFused, kEpi><<<blocks, kMmaGemvWarps * 32, 0, s>>>(x, w, static_cast<bf16*>(y), m, n, k, f);
  return static_cast<int>(cudaGetLastError());
}

// (value, id) pairs: the larger value wins, a tie goes to the lower id;
// id INT_MAX is "nothing seen" and loses to anything.
struct ArgmaxPair {
  float v;
  int id;
};
__device__ __forceinline__ ArgmaxPair Better(ArgmaxPair a, ArgmaxPair b) {
  if (a.id == INT_MAX) return b;
  if (b.id == INT_MAX) return a;
  return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
}
__device__ __forceinline__ ArgmaxPair WarpBest(ArgmaxPair p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ArgmaxPair o{__shfl_xor_sync(0xffffffffu, p.v, off), __shfl_xor_sync(0xffffffffu, p.id, off)};
    p = Better(p, o);
  }
  return p;
}

constexpr int kArgmaxThreads = 256;

static_assert(sizeof(ArgmaxPair) * kArgmaxParts == ArgmaxWorkspaceBytes(1));

// Grid (rows, kArgmaxParts): CTA (r, p) takes the p-th slice of row rows[r]
// and writes its best pair to part[r * kArgmaxParts + p].
__global__ void __launch_bounds__(kArgmaxThreads)
    ArgmaxPartKernel(const float* logits, const int* rows, int vocab, ArgmaxPair* part) {
  const float* row = logits + int64_t{rows[blockIdx.x]} * vocab;
  const int per = (vocab + kArgmaxParts - 1) / kArgmaxParts;
  const int begin = blockIdx.y * per, end = min(vocab, begin + per);
  ArgmaxPair best{-INFINITY, INT_MAX};
#pragma unroll 4
  for (int i = begin + threadIdx.x; i < end; i += kArgmaxThreads) {
    best = Better(best, ArgmaxPair{CleanLogit(row[i]), i});
  }
  best = WarpBest(best);
  __shared__ ArgmaxPair s[kArgmaxThreads / 32];
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = WarpBest(threadIdx.x < kArgmaxThreads / 32 ? s[threadIdx.x] : ArgmaxPair{-INFINITY, INT_MAX});
    if (threadIdx.x == 0) part[int64_t{blockIdx.x} * kArgmaxParts + blockIdx.y] = best;
  }
}

// One warp a row over its kArgmaxParts pairs.
__global__ void ArgmaxFinalKernel(const ArgmaxPair* part, int num_rows, int32_t* out) {
  static_assert(kArgmaxParts <= 32);
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= num_rows) return;
  const ArgmaxPair best =
      WarpBest(lane < kArgmaxParts ? part[r * kArgmaxParts + lane] : ArgmaxPair{-INFINITY, INT_MAX});
  if (lane == 0) out[r] = best.id == INT_MAX ? 0 : best.id;
}

// One warp per block (KvChecksums): lane l owns accumulator l % 8 and
// stripes l / 8, l / 8 + 4, ... of each 1 KiB block; the four groups' sums
// meet before the block's scramble (the accumulators only add in between).
__global__ void KvChecksumKernel(const unsigned char* pool, int64_t block_bytes, const int32_t* blocks, int n,
                                 const unsigned char* secret_in, uint64_t* out) {
  namespace x = tandem::xxh3;
  __shared__ unsigned char secret[x::kSecretSize];
  for (int i = threadIdx.x; i < x::kSecretSize; i += blockDim.x) secret[i] = secret_in[i];
  __syncthreads();
  const int w = static_cast<int>(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  if (w >= n) return;
  const unsigned char* p = pool + int64_t{blocks[w]} * block_bytes;
  const size_t len = static_cast<size_t>(block_bytes);
  if (len <= x::kMidSizeMax || ((reinterpret_cast<uintptr_t>(p) | len) & 7) != 0) {
    if (lane == 0) out[w] = x::Hash64(p, len, secret);
    return;
  }
  const int i = lane % 8, g = lane / 8;
  // This lane's accumulator's share of `count` stripes from `base`, summed
  // over the four groups: its own products and its neighbour's words.
  auto stripes = [&](const unsigned char* base, int count) {
    unsigned long long prod = 0, words = 0;
    for (int s = g; s < count; s += 4) {
      const unsigned long long word = *reinterpret_cast<const unsigned long long*>(base + s * x::kStripeLen + 8 * i);
      prod += x::StripeProduct(word, secret + 8 * s, i);
      words += word;
    }
    unsigned long long c = prod + __shfl_xor_sync(0xffffffffu, words, 1);
    c += __shfl_xor_sync(0xffffffffu, c, 8);
    c += __shfl_xor_sync(0xffffffffu, c, 16);
    return c;
  };
  unsigned long long acc = x::InitialAcc(i);
  const size_t full = (len - 1) / x::kBlockLen;
  for (size_t b = 0; b < full; ++b) {
    acc += stripes(p + b * x::kBlockLen, x::kStripesPerBlock);
    acc = x::Scramble(acc, secret, i);
  }
  acc += stripes(p + full * x::kBlockLen, static_cast<int>(((len - 1) - x::kBlockLen * full) / x::kStripeLen));
  // The last stripe (every group computes it; each lane counts it once).
  const unsigned long long last = *reinterpret_cast<const unsigned long long*>(p + len - x::kStripeLen + 8 * i);
  acc += x::StripeProduct(last, secret + x::kLastStripeSecret, i) + __shfl_xor_sync(0xffffffffu, last, 1);
  uint64_t a[8];
  for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc, k);
  if (lane == 0) out[w] = x::MergeAccs(a, secret, len);
}

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 65535u * 4;  // grid-stride loops beyond this

unsigned StrideGrid(int64_t n) {
  const unsigned b = Blocks(n, kThreads);
  return b < kMaxGrid ? (b == 0 ? 1 : b) : kMaxGrid;
}

}  // namespace

int LaunchToBf16(const void* src, SrcType type, void* dst, int64_t n, void* stream) {
  if (n == 0) return 0;
  auto* d = static_cast<bf16*>(dst);
  switch (type) {
    case SrcType::kF32:
      ToBf16Kernel<<<StrideGrid(n), kThreads, 0, S(stream)>>>(static_cast<const float*>(src), d, n);
      break;
    case SrcType::kF16:
      ToBf16Kernel<<<StrideGrid(n), kThreads, 0, S(stream)>>>(static_cast<const __half*>(src), d, n);
      break;
    case SrcType::kBF16:
      return static_cast<int>(cudaMemcpyAsync(dst, src, n * 2, cudaMemcpyDeviceToDevice, S(stream)));
  }
  return Err();
}

int LaunchEmbed(const int32_t* tokens, int num_tokens, const void* table, int hidden, float* out, void* stream) {
  if (num_tokens == 0) return 0;
  EmbedKernel<<<num_tokens, kThreads, 0, S(stream)>>>(tokens, static_cast<const bf16*>(table), hidden, out);
  return Err();
}

int LaunchAddRmsNorm(float* x, const int* rows, int num_rows, int hidden, const void* delta, const void* bias,
                     const void* weight, float eps, void* out, void* stream) {
  if (num_rows == 0) return 0;
  const int vecs = hidden / 4;
  // A float4 or two a thread (a row's loads all in flight at once: at one
  // row a step, the kernel is that latency).
  const int threads = std::min(1024, std::max(64, (vecs + 1) / 2 / 32 * 32));
  AddRmsNormKernel<<<num_rows, threads, 0, S(stream)>>>(x, rows, static_cast<const bf16*>(delta),
                                                        static_cast<const bf16*>(bias), hidden,
                                                        static_cast<const bf16*>(weight), eps, static_cast<bf16*>(out));
  return Err();
}

int LaunchRopeWriteKv(const RopeWriteArgs& a, void* stream) {
  if (a.num_tokens == 0) return 0;
  const int half = a.head_dim / 2;
  // Parts: enough CTAs for one pass over the pairs at small batches, one
  // a token from 64 tokens on (the grid fills the GPU by tokens there).
  const int pairs = (a.num_heads + a.num_kv_heads) * half;
  const int parts = a.num_tokens >= 64 ? 1 : std::min(16, (pairs + kThreads - 1) / kThreads);
  RopeWriteKvKernel<<<dim3(a.num_tokens, parts), kThreads, 2 * half * sizeof(float), S(stream)>>>(a);
  return Err();
}

int LaunchSiluMul(const void* gu, int num_tokens, int inter, void* out, void* stream) {
  if (num_tokens == 0 || inter == 0) return 0;
  const int threads = 128;
  const dim3 grid(static_cast<unsigned>((inter / 8 + threads - 1) / threads),
                  static_cast<unsigned>(num_tokens < 65535 ? num_tokens : 65535));
  SiluMulKernel<<<grid, threads, 0, S(stream)>>>(static_cast<const bf16*>(gu), inter, num_tokens,
                                                 static_cast<bf16*>(out));
  return Err();
}

int LaunchGemv(const void* x, int m, int k, const void* w, int n, void* y, bool f32, void* stream) {
  if (m == 0 || n == 0) return 0;
  if (k % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  switch (m) {
    case 1:
      return GemvFor<1>(xb, k, wb, n, y, f32, S(stream));
    case 2:
      return GemvFor<2>(xb, k, wb, n, y, f32, S(stream));
    case 3:
      return GemvFor<3>(xb, k, wb, n, y, f32, S(stream));
    case 4:
      return GemvFor<4>(xb, k, wb, n, y, f32, S(stream));
    case 5:
      return GemvFor<5>(xb, k, wb, n, y, f32, S(stream));
    case 6:
      return GemvFor<6>(xb, k, wb, n, y, f32, S(stream));
    case 7:
      return GemvFor<7>(xb, k, wb, n, y, f32, S(stream));
    case 8:
      return GemvFor<8>(xb, k, wb, n, y, f32, S(stream));
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

bool GemvMmaSupports(const void* x, int m, int k, const void* w, int n) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return m >= 1 && m <= kMaxGemvMmaRows && k > 0 && k % 64 == 0 && n > 0 && n % 16 == 0 && aligned(x) && aligned(w);
}

int LaunchGemvMma(const void* x, int m, int k, const void* w, int n, void* y, bool f32, void* stream) {
  if (m == 0 || n == 0) return 0;
  if (!GemvMmaSupports(x, m, k, w, n)) return static_cast<int>(cudaErrorInvalidValue);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  return m <= 8 ? GemvMmaFor<1>(xb, m, k, wb, n, y, f32, {}, S(stream))
                : GemvMmaFor<2>(xb, m, k, wb, n, y, f32, {}, S(stream));
}

bool GemvMmaFusedSupports(const void* x, int m, int k, const void* w, int n, GemvEpilogue epi) {
  return (epi == GemvEpilogue::kSiluMul || epi == GemvEpilogue::kRopeWriteKv) && n % 8 == 0 &&
         GemvMmaSupports(x, m, k, w, 2 * n);
}

int LaunchGemvMmaFused(const void* x, int m, int k, const void* w, int n, void* y, GemvEpilogue epi,
                       const GemvFusion& f, void* stream) {
  if (m == 0 || n == 0) return 0;
  if (!GemvMmaFusedSupports(x, m, k, w, n, epi) || f.norm_x != nullptr || f.residual != nullptr ||
      (epi == GemvEpilogue::kRopeWriteKv && (f.rope.head_dim % 2 != 0 || f.rope.num_tokens < m))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  constexpr GemvEpilogue kSilu = GemvEpilogue::kSiluMul, kRope = GemvEpilogue::kRopeWriteKv;
  if (epi == kSilu) {
    return m <= 8 ? GemvMmaFor<1, true, kSilu>(xb, m, k, wb, n, y, false, f, S(stream))
                  : GemvMmaFor<2, true, kSilu>(xb, m, k, wb, n, y, false, f, S(stream));
  }
  return m <= 8 ? GemvMmaFor<1, true, kRope>(xb, m, k, wb, n, y, false, f, S(stream))
                : GemvMmaFor<2, true, kRope>(xb, m, k, wb, n, y, false, f, S(stream));
}

namespace {

// The fused kernel of epilogue E at M rows: kPlainSplit warps a row, or
// kNormSplit where it norms its own x.
template <GemvEpilogue E, int kPlainSplit, int kNormSplit, int M>
int LaunchFusedKernel(const bf16* x, int k, const bf16* w, int n, bf16* y, const GemvFusion& f, cudaStream_t s) {
  const bool norm = f.norm_x != nullptr;
  const size_t smem = norm ? size_t{2} * M * k : 0;
  const unsigned blocks = GemvBlocks(n, norm ? kNormSplit : kPlainSplit);
  auto kernel = norm ? GemvFusedKernel<true, E, kNormSplit, M> : GemvFusedKernel<false, E, kPlainSplit, M>;
  kernel<<<blocks, kGemvWarps * 32, smem, s>>>(x, w, y, n, k, f);
  return Err();
}

// LaunchFusedKernel for f.rows and f.split: any split at one row, the
// defaults at more.
template <GemvEpilogue E>
int LaunchFusedFor(const bf16* x, int k, const bf16* w, int n, bf16* y, const GemvFusion& f, cudaStream_t s) {
  switch (f.rows) {
    case 1:
      switch (f.split) {
        case 1:
          return LaunchFusedKernel<E, 1, 1, 1>(x, k, w, n, y, f, s);
        case 2:
          return LaunchFusedKernel<E, 2, 2, 1>(x, k, w, n, y, f, s);
        case 4:
          return LaunchFusedKernel<E, 4, 4, 1>(x, k, w, n, y, f, s);
        case 8:
          return LaunchFusedKernel<E, 8, 8, 1>(x, k, w, n, y, f, s);
        default:
          return LaunchFusedKernel<E, kGemvSplit, kGemvSplitNorm<E>, 1>(x, k, w, n, y, f, s);
      }
    case 2:
      return LaunchFusedKernel<E, kGemvSplit, kGemvSplitNorm<E>, 2>(x, k, w, n, y, f, s);
    case 3:
      return LaunchFusedKernel<E, kGemvSplit, kGemvSplitNorm<E>, 3>(x, k, w, n, y, f, s);
    default:
      return LaunchFusedKernel<E, kGemvSplit, kGemvSplitNorm<E>, 4>(x, k, w, n, y, f, s);
  }
}

}  // namespace

int LaunchGemvFused(const void* x, int k, const void* w, int n, void* y, GemvEpilogue epi, const GemvFusion& f,
                    void* stream) {
  if (n == 0) return 0;
  const bool norm = f.norm_x != nullptr;
  // The normed rows live in the default 48 KB of shared memory; a launch
  // that norms the residual it also updates would race with itself; the
  // residual's update needs the residual.
  const bool split_ok = f.split == 0 || (f.rows == 1 && (f.split == 1 || f.split == 2 || f.split == 4 || f.split == 8));
  if (f.rows < 1 || f.rows > kMaxFusedRows || (norm && int64_t{f.rows} * k > kMaxGemvNormWidth) ||
      (norm && f.residual != nullptr) || (epi == GemvEpilogue::kResidual && f.residual == nullptr) || k % 8 != 0 ||
      !split_ok) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  auto* yb = static_cast<bf16*>(y);
  switch (epi) {
    case GemvEpilogue::kStore:
      return LaunchFusedFor<GemvEpilogue::kStore>(xb, k, wb, n, yb, f, S(stream));
    case GemvEpilogue::kResidual:
      return LaunchFusedFor<GemvEpilogue::kResidual>(xb, k, wb, n, yb, f, S(stream));
    case GemvEpilogue::kSiluMul:
      return LaunchFusedFor<GemvEpilogue::kSiluMul>(xb, k, wb, n, yb, f, S(stream));
    case GemvEpilogue::kRopeWriteKv:
      return LaunchFusedFor<GemvEpilogue::kRopeWriteKv>(xb, k, wb, n, yb, f, S(stream));
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int LaunchArgmax(const float* logits, const int* rows, int num_rows, int vocab, void* workspace, int32_t* out,
                 void* stream) {
  if (num_rows == 0) return 0;
  if (vocab <= 0 || reinterpret_cast<uintptr_t>(workspace) % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
  auto* part = static_cast<ArgmaxPair*>(workspace);
  ArgmaxPartKernel<<<dim3(num_rows, kArgmaxParts), kArgmaxThreads, 0, S(stream)>>>(logits, rows, vocab, part);
  constexpr int kRowsPerCta = 8;
  ArgmaxFinalKernel<<<(num_rows + kRowsPerCta - 1) / kRowsPerCta, kRowsPerCta * 32, 0, S(stream)>>>(part, num_rows,
                                                                                                    out);
  return Err();
}

int LaunchKvChecksums(const void* pool, int64_t block_bytes, const int32_t* blocks, int n, const unsigned char* secret,
                      uint64_t* out, void* stream) {
  if (n == 0) return 0;
  constexpr int kWarpsPerCta = 4;
  KvChecksumKernel<<<(n + kWarpsPerCta - 1) / kWarpsPerCta, 32 * kWarpsPerCta, 0, S(stream)>>>(
      static_cast<const unsigned char*>(pool), block_bytes, blocks, n, secret, out);
  return Err();
}

int LaunchRoundToBf16(float* x, int64_t n, void* stream) {
  if (n == 0) return 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n / 4 + threads - 1) / threads + 1, 4096);
  RoundToBf16Kernel<<<static_cast<unsigned>(blocks), threads, 0, S(stream)>>>(x, n);
  return Err();
}

int LaunchAddBias(void* y, int rows, int n, const void* bias, void* stream) {
  const int64_t total = int64_t{rows} * n;
  if (total == 0) return 0;
  AddBiasKernel<<<StrideGrid(total), kThreads, 0, S(stream)>>>(static_cast<bf16*>(y), n, total,
                                                               static_cast<const bf16*>(bias));
  return Err();
}

}  // namespace tandem::worker::cuda_ops
