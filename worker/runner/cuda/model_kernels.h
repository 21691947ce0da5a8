// The CUDA runner's element-wise and row kernels (model_kernels.cu): the
// parts of a Llama-family forward pass that are not matrix products
// (cuBLASLt) or attention (kernels/). Plain structs and device pointers, no
// absl (the .cu file builds as CUDA C++17). Weights and the activations that
// feed matrix products are bfloat16; the residual stream is float32 (the
// products accumulate onto it in float32, so it is rounded nowhere), and
// statistics are float32. Launchers return the launch's cudaError_t
// (0 = success) and never synchronize. cuda_runner.cc checks shapes first.
#ifndef TANDEM_WORKER_RUNNER_CUDA_MODEL_KERNELS_H_
#define TANDEM_WORKER_RUNNER_CUDA_MODEL_KERNELS_H_

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace tandem::worker::cuda_ops {

// A checkpoint tensor's element type, for the conversion to bfloat16.
enum class SrcType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// dst[i] = bfloat16(src[i]), round to nearest even, for n elements.
int LaunchToBf16(const void* src, SrcType type, void* dst, int64_t n, void* stream);

// out[t, :] = table[tokens[t], :] (bf16 -> f32) for t < num_tokens (ids
// checked on the host).
int LaunchEmbed(const int32_t* tokens, int num_tokens, const void* table, int hidden, float* out, void* stream);

// For each row r (x's row(r) = rows[r] when `rows` is given, gathering the
// logits rows, else r): when `delta` is given, x[row] += delta[row] (+ bias
// when given; bf16), the residual add after a product; then, when `weight`
// is given, out[r, :] = bf16(RMSNorm(x[row]) * weight), in float32 from the
// float32 residual. hidden % 8 == 0. `out` may be `delta` (rows are read
// before they are written).
int LaunchAddRmsNorm(float* x, const int* rows, int num_rows, int hidden, const void* delta, const void* bias,
                     const void* weight, float eps, void* out, void* stream);

// Adds the QKV bias (when given) and rotary embedding to the fused QKV rows
// of one layer, in place for Q, and writes each token's rotated K and its V
// into its slot of the paged pool (a negative slot skips the token; a slot
// past the pool is recorded in `error` as kernels' kErrSlot). Angles are
// position * inv_freq in double, so long contexts lose nothing to float
// rounding; pairs are (i, i + head_dim/2) (rotate_half).
struct RopeWriteArgs {
  void* qkv = nullptr;  // [num_tokens, qkv_stride] bf16: q heads, k heads, v heads
  int num_tokens = 0;
  int qkv_stride = 0;          // elements between tokens
  const void* bias = nullptr;  // [q + 2 kv] bf16, or null
  const int32_t* positions = nullptr;
  const double* inv_freq = nullptr;  // [head_dim / 2]
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  const int64_t* slot_mapping = nullptr;
  kernels::cuda::internal::PoolView pool;  // one layer's view; pool.kv writable
  int* error = nullptr;
};
int LaunchRopeWriteKv(const RopeWriteArgs& a, void* stream);

// out[t, j] = silu(gu[t, j]) * gu[t, inter + j] (gate rows then up rows), each
// product rounded as PyTorch rounds it in bfloat16. inter % 8 == 0.
int LaunchSiluMul(const void* gu, int num_tokens, int inter, void* out, void* stream);

// out[i] = the argmax of logits row rows[i] (float32, `vocab` wide) as the
// host sampler's greedy pick: NaN never chosen, +inf as the largest float,
// ties to the lowest id, a row of -inf gives 0. For rows that need nothing
// else (no penalties, masks or logprobs). Each row is split over
// kArgmaxParts CTAs (one CTA could not read a 128k-wide row at the memory's
// rate), whose (value, id) pairs go to `workspace`
// (ArgmaxWorkspaceBytes(num_rows), 8-byte aligned) and one warp a row then
// picks among them.
inline constexpr int kArgmaxParts = 32;
inline constexpr int64_t ArgmaxWorkspaceBytes(int num_rows) { return int64_t{num_rows} * kArgmaxParts * 8; }
int LaunchArgmax(const float* logits, const int* rows, int num_rows, int vocab, void* workspace, int32_t* out,
                 void* stream);

// y[m, n] = x[m, k] . w[n, k]^T for m <= kMaxGemvRows rows (decode's
// products): each output column's weight row streamed once in 16-byte loads
// by four warps at m <= kMaxFusedRows (each a quarter of the row; their sums
// added in a fixed order), else by one, float32 accumulation, then warp
// reductions. y is bf16 or (`f32`) float32. k % 8 == 0; x and w 16-byte
// aligned.
inline constexpr int kMaxGemvRows = 8;
int LaunchGemv(const void* x, int m, int k, const void* w, int n, void* y, bool f32, void* stream);

// The same product on the tensor cores (mma.sync, bf16 in, float32
// accumulation) for 1 to kMaxGemvMmaRows rows: each weight row is read once
// in 32-byte runs whatever m is, where LaunchGemv's CUDA-core dot products
// become issue-bound from three rows. A row's result does not depend on the
// other rows (each output is its own accumulator; the k slices' sums are
// added in a fixed order). GemvMmaSupports: m in range, k % 64 == 0,
// n % 16 == 0, x and w 16-byte aligned; LaunchGemvMma refuses
// (cudaErrorInvalidValue) what it does not support.
inline constexpr int kMaxGemvMmaRows = 16;
bool GemvMmaSupports(const void* x, int m, int k, const void* w, int n);
int LaunchGemvMma(const void* x, int m, int k, const void* w, int n, void* y, bool f32, void* stream);

// The same product for a step of one token (or up to kMaxFusedRows: `rows`
// below) with the kernels around it folded in (cuda_runner's fused path): x
// may be built by the product itself as the RMS norm of a float32 residual
// (norm_x, k values a token; every CTA reduces it, so no norm kernel runs
// before), and the output may be the residual's update, the
// SiLU-and-multiply of the gate and up halves, or the QKV rows rotated and
// written to the KV cache. Roundings are those of the unfused kernels (the
// normed x, the product and its bias in bf16), so only the norm's sum order
// differs.
enum class GemvEpilogue {
  kStore,     // y[j] = bf16(x . w_j (+ bias[j]))
  kResidual,  // residual[j] += bf16(x . w_j) (+ bias[j]); y unused
  kSiluMul,   // w holds 2n rows (gate, then up): y[j] = silu(g_j) * u_j, each bf16 (+ its bias)
  // The QKV product with RopeWriteKv's work (`rope`, a token a row): n is
  // half the product's rows, warp u computes a head's rows i and i +
  // head_dim/2; Q rotated into rope.qkv, K rotated and V into the pool at
  // each token's slot (a slot past the pool: rope.error, nothing written).
  // y unused.
  kRopeWriteKv,
};
struct GemvFusion {
  const float* norm_x = nullptr;  // set: x is RMSNorm(norm_x) * norm_weight in bf16 (x ignored)
  const void* norm_weight = nullptr;
  float eps = 0.0f;
  float* residual = nullptr;   // kResidual
  const void* bias = nullptr;  // n values (kSiluMul, kRopeWriteKv: 2n, in the weight rows' order)
  RopeWriteArgs rope;          // kRopeWriteKv (its bias unused: `bias` above)
  // Warps a row: 1, 2, 4 or 8 (each sums a slice of the row; the slices'
  // sums are added in order), 0: the kernel's default (where it norms x, 1
  // for kRopeWriteKv and 2 for the others; else 4, LaunchGemv's at one
  // row). Only the default for rows > 1.
  int split = 0;
  // Tokens, 1 to kMaxFusedRows: x and norm_x hold `rows` rows of k values,
  // y and residual `rows` rows of n, rope.qkv `rows` tokens (qkv_stride
  // apart) with as many positions and slots. Each token's result is the
  // bits a launch of that token alone gives.
  int rows = 1;
};
inline constexpr int kMaxFusedRows = 4;

// LaunchGemvMma with the fused path's epilogue, for steps of up to
// kMaxGemvMmaRows tokens whose x is given (normed by a kernel before):
// kSiluMul (w: 2n rows, gate then up; y: m rows of n) or kRopeWriteKv (n:
// half the QKV rows; `f.rope` as for LaunchGemvFused, its num_tokens >= m).
// f.bias as there; f.split and f.rows are ignored (m counts the tokens).
// Each token's result is the bits of LaunchGemvMma's product followed by
// the kernels the epilogue replaces (AddBias, SiluMul; RopeWriteKv), and
// independent of m. GemvMmaFusedSupports: the epilogue is one of those two,
// n % 8 == 0, and GemvMmaSupports(x, m, k, w, 2n); LaunchGemvMmaFused also
// refuses (cudaErrorInvalidValue) f.norm_x or f.residual set, an odd
// rope.head_dim and rope.num_tokens < m.
bool GemvMmaFusedSupports(const void* x, int m, int k, const void* w, int n, GemvEpilogue epi);
int LaunchGemvMmaFused(const void* x, int m, int k, const void* w, int n, void* y, GemvEpilogue epi,
                       const GemvFusion& f, void* stream);
// Refuses (cudaErrorInvalidValue) k % 8 != 0, a norm over more than
// kMaxGemvNormWidth values in all (the normed rows in the default 48 KB of
// shared memory, less the kernel's 384 bytes of its own), a norm together
// with kResidual's update of the same launch, kResidual without a residual,
// and rows or a split other than those above.
inline constexpr int kMaxGemvNormWidth = 24320;
int LaunchGemvFused(const void* x, int k, const void* w, int n, void* y, GemvEpilogue epi, const GemvFusion& f,
                    void* stream);

// out[j] = XXH3-64 of block blocks[j] of `pool` (block_bytes each): the
// values common/block_hash.h's HashBytes gives on the host (xxh3_portable.h;
// `secret`: DefaultHashSecret's 192 bytes, in device memory). One warp a
// block, its eight lanes' accumulators over four stripes at a time.
int LaunchKvChecksums(const void* pool, int64_t block_bytes, const int32_t* blocks, int n, const unsigned char* secret,
                      uint64_t* out, void* stream);

// y[r, :] += bias for r < rows (bf16).
int LaunchAddBias(void* y, int rows, int n, const void* bias, void* stream);

// x[i] = float(bf16(x[i])) for i < n (round to nearest even; the logits
// of --logits-dtype bfloat16). x 16-byte aligned.
int LaunchRoundToBf16(float* x, int64_t n, void* stream);

}  // namespace tandem::worker::cuda_ops

#endif  // TANDEM_WORKER_RUNNER_CUDA_MODEL_KERNELS_H_
