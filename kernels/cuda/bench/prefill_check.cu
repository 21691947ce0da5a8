// Stand-alone GPU check and benchmark of the tensor-core prefill kernel
// (kernels/cuda/prefill.cu) and the decode kernels (split_kv.cu), calling the
// internal launchers directly (no absl, so it builds with nvcc alone). Not
// part of the cmake build: the library globs kernels/cuda/*.cu only. Build
// and run on an H100/H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -lcuda \
//     kernels/cuda/prefill.cu kernels/cuda/split_kv.cu kernels/cuda/bench/prefill_check.cu -o prefill_check
//   ./prefill_check            # correctness cases, then the benchmark table
//   ./prefill_check check [V,..] # correctness only (those variants); `bench`: the table only
//   ./prefill_check dcheck     # the decode variants' correctness
//   ./prefill_check dbench 0,2 # the decode variants' timings (GPU time from a
//                              # cold L2, and back-to-back call time); 2 the
//                              # loads without the math, 3 a per-CTA trace,
//                              # 4 a dense read of the same bytes, 5 the
//                              # trace without the math, 6 without the
//                              # four warps' merge at an item's end
//                              # (timing only: its results are wrong),
//                              # 7 the outputs merged in one round, 8 each
//                              # consumer warp taking whole items (unsplit
//                              # plans; split ones run the default) (2, 3,
//                              # 5-8 are head_dim 128 bf16 variants: dcheck's
//                              # other cases run the CUDA-core kernel)
//   ./prefill_check dbench V KPS 8b:64x1024,70b:16x8192 shuf|seq PAGE
//   DBENCH_LAYERS=32 DBENCH_POOL_GIB=100 ./prefill_check dbench ...
//                              # blocks of 32 layers (layer 0 read), as the
//                              # engine's pool holds them, drawn from a
//                              # pool of 100 GiB (default: just the blocks
//                              # read)
//
// Correctness: fresh random inputs rounded to the element type, a paged pool
// with shuffled block ids, two layers (the layer offset and block stride
// are exercised), a padded q stride; the output is poisoned with NaN first,
// and compared with a float64 reference by ||out - ref|| / ||ref||.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/bench/dense_read.cuh"
#include "kernels/cuda/launch.h"

using namespace tandem::kernels::cuda::internal;
namespace tandem::kernels::cuda::internal {
int LaunchPrefillVariant(
    const AttnArgs& a, void* stream,
    int variant);  // prefill.cu: 0 default, 1 ws, 2 cp.async, 3 no loads, 4 grid, ... (kVariantName)
}
static const char* kVariantName[] = {"fa3",          "ws",        "fa3:cp.async", "fa3:noload", "fa3:grid",
                                     "fa3:lazy",     "fa3:qregs", "fa3:drain",    "fa3:xitem",  "fa3:176:drain",
                                     "fa3:176:xitem"};
// LaunchSplitKvVariant's variants (2: the loads without the math; 3: the
// default with a per-CTA trace, printed after the shape's timings: when
// each CTA saw its first tile and ended, and its SM clock from clock64
// against %globaltimer), then this file's dense read of the same bytes (4:
// the device's read ceiling for the call's size), then 5: the trace of the
// loads without the math, 6: no merge of the consumer warps' states at an
// item's end (its results are wrong: timing only), 7: the merge in one
// round, and 8: each consumer warp taking whole items (no merge).
static const char* kDecodeName[] = {"stream",         "cuda-core",     "stream:nomath",
                                    "stream:trace",   "dense-read",    "stream:trace:nomath",
                                    "stream:nomerge", "stream:merge1", "stream:warpitems"};
static constexpr int kDenseRead = 4;
static int g_rounds = 3;           // dbench: interleaved rounds (DBENCH_ROUNDS)
static bool g_seq_tables = false;  // dbench: blocks in order instead of shuffled
static int g_layers = 1;           // dbench: layers a block holds (DBENCH_LAYERS; the engine's pool: every layer)
static double g_pool_gib = 0;      // dbench: the pool's size (DBENCH_POOL_GIB; 0: the blocks read, no more)
// PC_KV_ADJ=1: each KV head's K and V rows of a block side by side (one run
// of 2 x page rows a head) instead of every head's K, then every head's V.
static const bool g_kv_adjacent = [] {
  const char* e = std::getenv("PC_KV_ADJ");
  return e != nullptr && std::string(e) == "1";
}();
// A layer's strides in elements, as g_kv_adjacent lays a block out: its
// (head, K|V) strides and the whole layer's.
struct Strides {
  int64_t head, kv, layer;
};
static Strides PoolStrides(int bs, int D, int Hkv) {
  const int64_t rows = int64_t{bs} * D;
  return {g_kv_adjacent ? 2 * rows : rows, g_kv_adjacent ? rows : Hkv * rows, 2 * Hkv * rows};
}
static std::string DecodeName(int v) { return kDecodeName[v]; }
static const int kVariants = 11;
static bool Checked(int v) { return v != 3; }  // variant 3 skips loads (timing only)

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                           \
    }                                                                                         \
  } while (0)

static uint16_t ToBits(float x, Elem e) {
  if (e == Elem::kBF16) {
    __nv_bfloat16 b = __float2bfloat16_rn(x);
    return *reinterpret_cast<uint16_t*>(&b);
  }
  __half h = __float2half_rn(x);
  return *reinterpret_cast<uint16_t*>(&h);
}
static float FromBits(uint16_t u, Elem e) {
  if (e == Elem::kBF16) return __bfloat162float(*reinterpret_cast<__nv_bfloat16*>(&u));
  return __half2float(*reinterpret_cast<__half*>(&u));
}

struct Case {
  const char* name;
  Elem elem;
  int head_dim, block_size, num_kv_heads, group;
  bool causal;
  std::vector<int> q_lens, ctx;
  int bad_seq = -1;   // a block id past the pool in this sequence's table
  int bad_block = 0;  // at this block index; rows whose keys reach it must be zero
};

static std::mt19937_64 rng(12345);
static int g_sms = 132;

// The split-KV launch the API makes: `kps` > 0 fixes the split size (the
// engine's batch-invariant plan), else PlanSplits chooses.
static int LaunchDecode(const AttnArgs& a, int variant, int kps, int* ws, int64_t ws_bytes,
                        cudaStream_t stream = nullptr) {
  if (variant == kDenseRead) {
    // The KV bytes the decode reads (the pool's first bytes, contiguous).
    const int64_t bytes = int64_t{a.num_seqs} * a.max_context * a.pool.num_kv_heads * a.pool.head_dim * 2 * 2;
    tandem::kernels::cuda::bench::DenseReadKernel<<<g_sms * 4, 512, 0, stream>>>(
        static_cast<const uint4*>(a.pool.kv), bytes / 16, reinterpret_cast<unsigned*>(ws + 64));
    return static_cast<int>(cudaGetLastError());
  }
  SplitPlan plan;
  if (kps > 0) {
    plan.keys_per_split = (kps + 63) / 64 * 64;
    plan.num_splits = std::max(1, (a.max_context + plan.keys_per_split - 1) / plan.keys_per_split);
  } else {
    plan = PlanSplits(a, g_sms, ws_bytes - 256);
  }
  if (SplitKvWorkspaceBytes(a.num_tokens, a.num_heads, a.pool.head_dim, plan.num_splits) > ws_bytes - 256) {
    std::fprintf(stderr, "workspace too small for %d splits\n", plan.num_splits);
    std::exit(2);
  }
  return LaunchSplitKvVariant(a, plan, reinterpret_cast<char*>(ws) + 256, ws_bytes - 256, stream, variant);
}

// The launch arguments of a batch of `batch` sequences over a one-layer pool
// of num_blocks pages (K and V of Hkv heads per page), bf16, dense q rows
// (RunCase then sets its element type, q stride and layers).
static AttnArgs BenchArgs(void* pool, int num_blocks, int bs, int D, int H, int Hkv, void* q, void* out, int* qs,
                          int* ctx, int32_t* table, int blocks_per_seq, int* error, int batch, int tokens, int max_q,
                          int max_ctx, bool causal) {
  const Strides st = PoolStrides(bs, D, Hkv);
  AttnArgs a;
  a.elem = Elem::kBF16;
  a.q = q;
  a.q_stride = int64_t{H} * D;
  a.out = out;
  a.pool.kv = pool;
  a.pool.block_stride = st.layer;
  a.pool.kv_stride = st.kv;
  a.pool.head_stride = st.head;
  a.pool.num_blocks = num_blocks;
  a.pool.block_size = bs;
  a.pool.head_dim = D;
  a.pool.num_kv_heads = Hkv;
  a.num_heads = H;
  a.group = H / Hkv;
  a.scale = 1.0f / std::sqrt(float(D));
  a.causal = causal;
  a.num_seqs = batch;
  a.query_start = qs;
  a.context_lens = ctx;
  a.block_tables = table;
  a.max_blocks_per_seq = blocks_per_seq;
  a.error = error;
  a.num_tokens = tokens;
  a.max_q_len = max_q;
  a.max_context = max_ctx;
  a.num_sms = g_sms;
  return a;
}

// Returns true if the case passes. decode: the split-KV launcher's variant
// `variant` with splits of `kps` keys (0: planned).
static bool RunCase(const Case& c, int variant, bool decode = false, int kps = 0) {
  const int D = c.head_dim, bs = c.block_size, Hkv = c.num_kv_heads, H = Hkv * c.group;
  const int S = static_cast<int>(c.q_lens.size());
  std::vector<int> qs(S + 1, 0);
  for (int s = 0; s < S; ++s) qs[s + 1] = qs[s] + c.q_lens[s];
  const int T = qs[S];
  int max_blocks = 0, total_blocks = 0, max_q = 0, max_ctx = 0;
  for (int s = 0; s < S; ++s) {
    const int b = (c.ctx[s] + bs - 1) / bs;
    max_blocks = std::max(max_blocks, b);
    total_blocks += b;
    max_q = std::max(max_q, c.q_lens[s]);
    max_ctx = std::max(max_ctx, c.ctx[s]);
  }
  const int num_blocks = total_blocks + 3;
  const int layers = 2, layer = 1;
  const Strides st = PoolStrides(bs, D, Hkv);
  const int64_t head_stride = st.head, kv_stride = st.kv, layer_stride = st.layer, block_stride = layers * layer_stride;
  std::vector<int> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(int64_t{S} * max_blocks, -7);  // unused entries: garbage
  int next = 0;
  for (int s = 0; s < S; ++s) {
    for (int b = 0; b < (c.ctx[s] + bs - 1) / bs; ++b) table[int64_t{s} * max_blocks + b] = perm[next++];
  }
  if (c.bad_seq >= 0) table[int64_t{c.bad_seq} * max_blocks + c.bad_block] = num_blocks + 5;

  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> pool(num_blocks * block_stride);
  for (auto& x : pool) x = ToBits(nd(rng), c.elem);
  const int64_t q_stride = int64_t{H} * D + 8;
  std::vector<uint16_t> q(int64_t{T} * q_stride);
  for (auto& x : q) x = ToBits(nd(rng), c.elem);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // float64 reference.
  std::vector<double> ref(int64_t{T} * H * D, 0.0);
  auto kv_at = [&](int s, int key, int kv, int kvh, int d) {
    const int32_t blk = table[int64_t{s} * max_blocks + key / bs];
    return FromBits(pool[blk * block_stride + layer * layer_stride + kv * kv_stride + kvh * head_stride +
                         int64_t{key % bs} * D + d],
                    c.elem);
  };
  std::vector<double> sc;
  auto reaches_bad = [&](int s, int i) {
    const int last_key = c.causal ? c.ctx[s] - c.q_lens[s] + i : c.ctx[s] - 1;
    return s == c.bad_seq && last_key / bs >= c.bad_block;
  };
  for (int s = 0; s < S; ++s) {
    const int ql = c.q_lens[s], ctx = c.ctx[s];
    for (int i = 0; i < ql; ++i) {
      if (reaches_bad(s, i)) continue;
      const int n = c.causal ? ctx - ql + i + 1 : ctx;
      const int tok = qs[s] + i;
      for (int h = 0; h < H; ++h) {
        const int kvh = h / c.group;
        sc.assign(n, 0.0);
        double mx = -1e300;
        for (int k = 0; k < n; ++k) {
          double acc = 0;
          for (int d = 0; d < D; ++d)
            acc += double(FromBits(q[tok * q_stride + h * D + d], c.elem)) * kv_at(s, k, 0, kvh, d);
          sc[k] = acc * scale;
          mx = std::max(mx, sc[k]);
        }
        double sum = 0;
        for (int k = 0; k < n; ++k) sum += (sc[k] = std::exp(sc[k] - mx));
        double* o = &ref[(int64_t{tok} * H + h) * D];
        for (int k = 0; k < n; ++k) {
          const double p = sc[k] / sum;
          for (int d = 0; d < D; ++d) o[d] += p * kv_at(s, k, 1, kvh, d);
        }
      }
    }
  }

  void *d_pool, *d_q, *d_out;
  int *d_qs, *d_ctx, *d_err;
  int32_t* d_table;
  CK(cudaMalloc(&d_pool, pool.size() * 2));
  CK(cudaMalloc(&d_q, q.size() * 2));
  CK(cudaMalloc(&d_out, int64_t{T} * H * D * 2));
  CK(cudaMalloc(&d_qs, (S + 1) * 4));
  CK(cudaMalloc(&d_ctx, S * 4));
  // The error word, then split-KV partials (the public API's workspace layout).
  const int64_t ws_bytes = 256 + SplitKvWorkspaceBytes(T, H, D, 1024);
  CK(cudaMalloc(&d_err, ws_bytes));
  CK(cudaMemset(d_err, 0, ws_bytes));
  CK(cudaMalloc(&d_table, table.size() * 4));
  CK(cudaMemcpy(d_pool, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_qs, qs.data(), (S + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_ctx, c.ctx.data(), S * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_out, 0xff, int64_t{T} * H * D * 2));  // NaN in both types

  AttnArgs a = BenchArgs(static_cast<uint16_t*>(d_pool) + layer * layer_stride, num_blocks, bs, D, H, Hkv, d_q, d_out,
                         d_qs, d_ctx, d_table, max_blocks, d_err, S, T, max_q, max_ctx, c.causal);
  a.elem = c.elem;
  a.q_stride = q_stride;
  a.pool.block_stride = block_stride;  // two layers
  if (decode) {
    CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_err, ws_bytes)));
  } else {
    if (!PrefillSupports(a)) {
      std::printf("FAIL %-28s PrefillSupports false\n", c.name);
      return false;
    }
    CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
  }
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(int64_t{T} * H * D);
  int err = 0;
  CK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  bool same_again = true;
  if (decode) {
    // Again on the same workspace: the kernels leave their counters ready
    // for the next launch, and give the same bits.
    CK(cudaMemset(d_out, 0xff, int64_t{T} * H * D * 2));
    CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_err, ws_bytes)));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> again(out.size());
    CK(cudaMemcpy(again.data(), d_out, again.size() * 2, cudaMemcpyDeviceToHost));
    same_again = again == out;
  } else if (variant >= 7 && variant <= 10) {
    // The drained and the cross-item item boundary change the order of the
    // work, never a row's arithmetic: the same bits (the default picks one
    // or the other by context length, and chunked prefill must equal one
    // pass).
    CK(cudaMemset(d_out, 0xff, int64_t{T} * H * D * 2));
    CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant % 2 == 1 ? variant + 1 : variant - 1)));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> other(out.size());
    CK(cudaMemcpy(other.data(), d_out, other.size() * 2, cudaMemcpyDeviceToHost));
    same_again = other == out;
  }
  CK(cudaMemcpy(&err, d_err, 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0, maxabs = 0;
  int64_t unwritten = 0, bad_nonzero = 0;
  for (int s = 0; s < S; ++s) {
    for (int tok = qs[s]; tok < qs[s + 1]; ++tok) {
      for (int j = 0; j < H * D; ++j) {
        const float x = FromBits(out[int64_t{tok} * H * D + j], c.elem);
        if (!std::isfinite(x)) {
          ++unwritten;
          continue;
        }
        if (reaches_bad(s, tok - qs[s])) {
          if (x != 0.0f) ++bad_nonzero;
          continue;
        }
        const double r = ref[int64_t{tok} * H * D + j];
        num += (x - r) * (x - r);
        den += r * r;
        maxabs = std::max(maxabs, std::fabs(x - r));
      }
    }
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  const double tol = c.elem == Elem::kBF16 ? 1e-2 : 2e-3;
  const int want_err = c.bad_seq >= 0 ? ((kErrBlockId << 28) | c.bad_seq) : 0;
  const bool ok = unwritten == 0 && bad_nonzero == 0 && rel < tol && err == want_err;
  // The persistent kernel must leave its work counter at zero.
  unsigned sched[2] = {0, 0};
  CK(cudaMemcpy(sched, d_err + 32, sizeof(sched), cudaMemcpyDeviceToHost));
  const bool ok2 = ok && same_again && sched[0] == 0 && sched[1] == 0;
  char label[64];
  std::snprintf(label, sizeof(label), "%s%s%s", decode ? DecodeName(variant).c_str() : kVariantName[variant],
                decode ? (kps > 0 ? (":" + std::to_string(kps)).c_str() : ":plan") : "", g_sms <= 2 ? "@2sm" : "");
  std::printf("%s %-20s %-30s T=%5d rel=%.2e maxabs=%.2e unwritten=%lld badrows_nonzero=%lld err=%#x (want %#x)%s%s\n",
              ok2 ? "PASS" : "FAIL", label, c.name, T, rel, maxabs, (long long)unwritten, (long long)bad_nonzero, err,
              want_err, sched[0] || sched[1] ? " sched counters left nonzero" : "",
              same_again ? "" : " a second launch gave other bits");
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_qs);
  cudaFree(d_ctx);
  cudaFree(d_err);
  cudaFree(d_table);
  return ok2;
}

// Causal (or full) prefill of `batch` sequences of `seqlen` tokens, H heads,
// head_dim 128, bf16; returns the median ms of `iters` launches.
static  // Seconds since the epoch (wall clock), for lining runs up with samplers.
    double
    WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double Bench(int variant, int batch, int seqlen, int H, int Hkv, int D, int bs, bool causal, double* tflops) {
  const int blocks_per_seq = (seqlen + bs - 1) / bs;
  const int num_blocks = batch * blocks_per_seq;
  const int64_t block_stride = PoolStrides(bs, D, Hkv).layer;
  const int64_t T = int64_t{batch} * seqlen;
  void *d_pool, *d_q, *d_out;
  int *d_qs, *d_ctx, *d_err;
  int32_t* d_table;
  CK(cudaMalloc(&d_pool, num_blocks * block_stride * 2));
  CK(cudaMalloc(&d_q, T * H * D * 2));
  CK(cudaMalloc(&d_out, T * H * D * 2));
  CK(cudaMalloc(&d_qs, (batch + 1) * 4));
  CK(cudaMalloc(&d_ctx, batch * 4));
  CK(cudaMalloc(&d_err, 256));  // the error word and the persistent kernel's counters
  CK(cudaMalloc(&d_table, int64_t{num_blocks} * 4));
  {
    // Uniform in [-1, 1) from a xorshift (a few hundred MB a second; the
    // distributions of <random> took seconds a shape).
    uint32_t st = static_cast<uint32_t>(rng()) | 1u;
    auto ud = [&st]() {
      st ^= st << 13;
      st ^= st >> 17;
      st ^= st << 5;
      return static_cast<float>(st >> 8) * (2.0f / 16777216.0f) - 1.0f;
    };
    std::vector<uint16_t> host(num_blocks * block_stride);
    for (auto& x : host) x = ToBits(ud(), Elem::kBF16);
    CK(cudaMemcpy(d_pool, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    host.assign(T * H * D, 0);
    for (auto& x : host) x = ToBits(ud(), Elem::kBF16);
    CK(cudaMemcpy(d_q, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  }
  std::vector<int> qs(batch + 1), ctx(batch, seqlen);
  for (int s = 0; s <= batch; ++s) qs[s] = s * seqlen;
  std::vector<int32_t> table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), rng);
  CK(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_ctx, ctx.data(), ctx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_err, 0, 256));
  const AttnArgs a = BenchArgs(d_pool, num_blocks, bs, D, H, Hkv, d_q, d_out, d_qs, d_ctx, d_table, blocks_per_seq,
                               d_err, batch, static_cast<int>(T), seqlen, seqlen, causal);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
  // Every timed call starts with a cold L2 (a 256 MiB write in between, as
  // a serving step finds it after the rest of the layer).
  static void* flush = nullptr;
  constexpr size_t kFlushBytes = size_t{256} << 20;
  if (flush == nullptr) CK(cudaMalloc(&flush, kFlushBytes));
  std::vector<float> ms;
  // PF_SUSTAIN=1: back-to-back calls for about half a second, no flush in
  // between (the clocks a sustained load runs at); the mean per call.
  // PF_SUSTAIN=N > 1: for about N ms (power sampling needs seconds).
  static const int sustain_ms = std::getenv("PF_SUSTAIN") != nullptr ? std::atoi(std::getenv("PF_SUSTAIN")) : 0;
  static const bool sustain = sustain_ms != 0;
  if (sustain) {
    CK(cudaEventRecord(e0));
    CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float one;
    CK(cudaEventElapsedTime(&one, e0, e1));
    const int n = std::max(10, static_cast<int>((sustain_ms > 1 ? sustain_ms : 500) / std::max(one, 0.01f)));
    for (int i = 0; i < n / 4; ++i) CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
    CK(cudaEventRecord(e0));
    CK(cudaEventSynchronize(e0));
    const double wall0 = WallSeconds();
    for (int i = 0; i < n; ++i) CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float total;
    CK(cudaEventElapsedTime(&total, e0, e1));
    ms.push_back(total / n);
    // The window's wall-clock times, to line up with sampled power.
    if (sustain_ms > 1) std::printf("sustain-window %.3f %.3f\n", wall0, WallSeconds());
  }
  for (int i = 0; i < (sustain ? 0 : 20); ++i) {
    CK(cudaMemsetAsync(flush, i, kFlushBytes));
    CK(cudaEventRecord(e0));
    CK(static_cast<cudaError_t>(LaunchPrefillVariant(a, nullptr, variant)));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  int err = 0;
  CK(cudaMemcpy(&err, d_err, 4, cudaMemcpyDeviceToHost));
  if (err != 0) std::printf("bench: error word %#x\n", err);
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 4.0 * batch * H * double(seqlen) * seqlen * D / (causal ? 2.0 : 1.0);
  *tflops = flops / (med * 1e-3) / 1e12;
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_qs);
  cudaFree(d_ctx);
  cudaFree(d_err);
  cudaFree(d_table);
  return med;
}

// Decode: `batch` sequences of one query over `ctx` keys, H query heads over
// Hkv KV heads, bf16, page `bs`, shuffled blocks, timed for every (variant,
// kps) of `configs` on the same pool, interleaved over `rounds` rounds (the
// configurations meet the same clocks and the same physical memory; a
// configuration timed alone after a new allocation read up to 13% apart
// between runs). Per configuration: gpu_us, the median GPU time of a call
// from a cold L2 (a 256 MiB memset before each; the events bracket the
// launch only); spread, the largest round median over the smallest;
// call_us, back-to-back calls (what a host loop sees, launch overheads
// included). Returns the KV bytes read per call.
struct DTiming {
  double gpu_us = 0, spread = 0, call_us = 0;
};
static double DBench(const std::vector<std::pair<int, int>>& configs, int batch, int ctx, int H, int Hkv, int D, int bs,
                     int rounds, std::vector<DTiming>* timings) {
  const int blocks_per_seq = (ctx + bs - 1) / bs;
  const int used_blocks = batch * blocks_per_seq;
  // A block holds g_layers layers (read: the first), as the engine's pool
  // does; the pool holds at least g_pool_gib of blocks, the used ones drawn
  // from all of it (a long-running engine's free list).
  const int64_t layer_stride = PoolStrides(bs, D, Hkv).layer;
  const int64_t block_stride = layer_stride * g_layers;
  const int num_blocks =
      std::max<int64_t>(used_blocks, static_cast<int64_t>(g_pool_gib * double(1 << 30) / (block_stride * 2)));
  void *d_pool, *d_q, *d_out;
  int *d_qs, *d_ctx, *d_ws;
  int32_t* d_table;
  CK(cudaMalloc(&d_pool, num_blocks * block_stride * 2));
  CK(cudaMemset(d_pool, 0x3c, num_blocks * block_stride * 2));  // finite values; the time does not depend on them
  CK(cudaMalloc(&d_q, int64_t{batch} * H * D * 2));
  CK(cudaMemset(d_q, 0x3c, int64_t{batch} * H * D * 2));
  CK(cudaMalloc(&d_out, int64_t{batch} * H * D * 2));
  CK(cudaMalloc(&d_qs, (batch + 1) * 4));
  CK(cudaMalloc(&d_ctx, batch * 4));
  const int64_t ws_bytes = 256 + SplitKvWorkspaceBytes(batch, H, D, std::max(128, (ctx + 63) / 64));
  CK(cudaMalloc(&d_ws, ws_bytes));
  CK(cudaMemset(d_ws, 0, ws_bytes));
  CK(cudaMalloc(&d_table, int64_t{used_blocks} * 4));
  std::vector<int> qs(batch + 1), ctxs(batch, ctx);
  for (int s = 0; s <= batch; ++s) qs[s] = s;
  std::vector<int32_t> table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) table[i] = i;
  if (!g_seq_tables) std::shuffle(table.begin(), table.end(), rng);
  table.resize(used_blocks);
  if (g_seq_tables) std::sort(table.begin(), table.end());
  CK(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_ctx, ctxs.data(), ctxs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  AttnArgs a = BenchArgs(d_pool, num_blocks, bs, D, H, Hkv, d_q, d_out, d_qs, d_ctx, d_table, blocks_per_seq, d_ws,
                         batch, batch, 1, ctx, true);
  a.pool.block_stride = block_stride;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  static void* flush = nullptr;
  constexpr size_t kFlushBytes = size_t{256} << 20;
  if (flush == nullptr) CK(cudaMalloc(&flush, kFlushBytes));
  const size_t n = configs.size();
  std::vector<std::vector<float>> all(n), round_medians(n);
  for (int r = 0; r < rounds; ++r) {
    for (size_t c = 0; c < n; ++c) {
      const auto [variant, kps] = configs[c];
      for (int i = 0; i < 2; ++i) CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_ws, ws_bytes)));
      std::vector<float> ms;
      for (int i = 0; i < 7; ++i) {
        CK(cudaMemsetAsync(flush, i, kFlushBytes));
        CK(cudaEventRecord(e0));
        CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_ws, ws_bytes)));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      all[c].insert(all[c].end(), ms.begin(), ms.end());
      std::sort(ms.begin(), ms.end());
      round_medians[c].push_back(ms[ms.size() / 2]);
    }
  }
  const double kv_bytes = 2.0 * batch * double(ctx) * Hkv * D * 2;
  const int reps = std::max(3, std::min(200, static_cast<int>(2e9 / kv_bytes)));
  timings->assign(n, DTiming{});
  for (size_t c = 0; c < n; ++c) {
    std::sort(all[c].begin(), all[c].end());
    std::sort(round_medians[c].begin(), round_medians[c].end());
    (*timings)[c].gpu_us = all[c][all[c].size() / 2] * 1e3;
    (*timings)[c].spread = round_medians[c].back() / round_medians[c].front();
    const auto [variant, kps] = configs[c];
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_ws, ws_bytes)));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    (*timings)[c].call_us = t * 1e3 / reps;
  }
  for (const auto& [variant, kps] : configs) {
    if (variant != 3 && variant != 5) continue;
    // One traced call from a cold L2: when each CTA started, saw its first
    // tile and ended (ns after the earliest start), its items and its SM clock.
    CK(cudaMemsetAsync(flush, 1, kFlushBytes));
    CK(static_cast<cudaError_t>(LaunchDecode(a, variant, kps, d_ws, ws_bytes)));
    CK(cudaDeviceSynchronize());
    std::vector<unsigned long long> tr(kDecodeTraceWords * kDecodeTraceCtas);
    CK(static_cast<cudaError_t>(CopyDecodeTrace(tr.data())));
    auto word = [&](int b, DecodeTraceWord w) { return tr[b * kDecodeTraceWords + w]; };
    unsigned long long t0 = ~0ull, newest = 0;
    for (int b = 0; b < kDecodeTraceCtas; ++b) newest = std::max(newest, word(b, kTraceStartNs));
    std::vector<double> first, end, items, ghz;
    for (int b = 0; b < kDecodeTraceCtas; ++b) {
      if (word(b, kTraceStartNs) + 1000000ull < newest || word(b, kTraceEndNs) == 0) continue;  // not this launch
      t0 = std::min(t0, word(b, kTraceStartNs));
    }
    for (int b = 0; b < kDecodeTraceCtas; ++b) {
      const unsigned long long start = word(b, kTraceStartNs), stop = word(b, kTraceEndNs);
      if (start < t0 || start + 1000000ull < newest || stop < start) continue;
      first.push_back((word(b, kTraceFirstTileNs) - t0) * 1e-3);
      end.push_back((stop - t0) * 1e-3);
      items.push_back(double(word(b, kTraceItems)));
      ghz.push_back(double(word(b, kTraceEndClock) - word(b, kTraceStartClock)) / double(stop - start));
    }
    auto q = [](std::vector<double> v, double f) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[std::min(v.size() - 1, size_t(f * v.size()))];
    };
    std::printf(
        "trace %dx%d kps %d: %zu CTAs; first tile us p0 %.1f p50 %.1f p100 %.1f; end us p0 %.1f p10 %.1f "
        "p50 %.1f p90 %.1f p100 %.1f; items min %.0f max %.0f; SM GHz p0 %.3f p50 %.3f p100 %.3f\n",
        batch, ctx, kps, end.size(), q(first, 0), q(first, 0.5), q(first, 1.0), q(end, 0), q(end, 0.1), q(end, 0.5),
        q(end, 0.9), q(end, 1.0), q(items, 0), q(items, 1.0), q(ghz, 0), q(ghz, 0.5), q(ghz, 1.0));
  }
  int err = 0;
  CK(cudaMemcpy(&err, d_ws, 4, cudaMemcpyDeviceToHost));
  if (err != 0) std::printf("dbench: error word %#x\n", err);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_qs);
  cudaFree(d_ctx);
  cudaFree(d_ws);
  cudaFree(d_table);
  return kv_bytes;
}

// GB/s of a device-to-device copy of 1 GiB (bytes read plus written).
static double CopyGbps() {
  constexpr size_t kBytes = size_t{1} << 30;
  void *a, *b;
  CK(cudaMalloc(&a, kBytes));
  CK(cudaMalloc(&b, kBytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 8; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * kBytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

static std::vector<int> ParseList(const char* p) {
  std::vector<int> v;
  while (*p != 0) {
    v.push_back(std::atoi(p));
    while (*p != 0 && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

static int DecodeMain(int argc, char** argv, bool check, bool bench) {
  int failures = 0;
  if (check) {
    const Elem B = Elem::kBF16, F = Elem::kF16;
    auto ones = [](int n) { return std::vector<int>(n, 1); };
    std::vector<Case> cases = {
        {"d128 bs16 gqa4 ctx 1/15/16/17", B, 128, 16, 2, 4, true, ones(4), {1, 15, 16, 17}},
        {"d128 bs64 gqa8 ctx 1000/3000", B, 128, 64, 2, 8, true, ones(3), {1000, 3000, 64}},
        {"d128 bs32 gqa1 ragged", B, 128, 32, 3, 1, true, ones(5), {700, 33, 1, 2048, 95}},
        {"d64 bs16 gqa5 ragged", B, 64, 16, 2, 5, true, ones(4), {300, 1, 1500, 129}},
        {"f16 d128 bs16 gqa16", F, 128, 16, 1, 16, true, ones(2), {900, 4000}},
        {"f16 d64 bs64 gqa2", F, 64, 64, 4, 2, true, ones(3), {65, 640, 2000}},
        {"d128 bs16 gqa4 3 queries causal", B, 128, 16, 2, 4, true, {3, 1, 2}, {500, 77, 1300}},
        {"d128 bs16 gqa4 noncausal", B, 128, 16, 2, 4, false, {2, 1}, {600, 1500}},
        {"d128 bs16 gqa4 8k", B, 128, 16, 1, 4, true, ones(1), {8192}},
        {"d128 bs16 bad block seq1", B, 128, 16, 2, 4, true, ones(3), {300, 2000, 40}, 1, 50},
        {"d64 bs32 bad block seq0 first", F, 64, 32, 1, 8, true, ones(2), {1000, 500}, 0, 0},
    };
    const std::vector<int> variants = argc > 2 ? ParseList(argv[2]) : std::vector<int>{0, 1};
    // Each case on the device's SM count and as if it had 2 SMs (4 CTAs:
    // the units then outnumber the grid, so the plan's tail pieces run,
    // with ragged and bad-block units among them).
    const int sms = g_sms;
    for (int v : variants) {
      for (int as_sms : {sms, 2}) {
        g_sms = as_sms;
        for (int kps : {0, 64, 512}) {
          for (const Case& c : cases) failures += RunCase(c, v, true, kps) ? 0 : 1;
        }
      }
    }
    g_sms = sms;
    std::printf("%d decode case(s) failed\n", failures);
  }
  if (!bench) return failures == 0 ? 0 : 1;
  const double copy = CopyGbps();
  std::printf("\ndevice copy: %.0f GB/s (read + written)\n", copy);
  std::printf("%-20s %-5s %-6s %-7s %-5s %9s %10s %9s %8s %10s %7s\n", "variant", "model", "batch", "ctx", "kps",
              "KV MiB", "gpu us", "GB/s", "/copy", "call us", "spread");
  std::vector<int> variants = argc > 2 ? ParseList(argv[2]) : std::vector<int>{0, 1};
  std::vector<int> kpss = argc > 3 ? ParseList(argv[3]) : std::vector<int>{0};
  struct Shape {
    int batch, ctx, H;
  };
  std::vector<Shape> shapes;
  g_seq_tables = argc > 5 && std::string(argv[5]) == "seq";
  if (const char* r = std::getenv("DBENCH_ROUNDS")) g_rounds = std::max(1, std::atoi(r));
  if (const char* l = std::getenv("DBENCH_LAYERS")) g_layers = std::max(1, std::atoi(l));
  if (const char* p = std::getenv("DBENCH_POOL_GIB")) g_pool_gib = std::atof(p);
  const int page = argc > 6 ? std::atoi(argv[6]) : 16;  // `dbench V KPS SHAPES shuf|seq PAGE`
  if (argc > 4) {                                       // `8b:1x8192,70b:16x8192,...`
    for (const char* p = argv[4]; *p != 0;) {
      const int H = std::strncmp(p, "70b:", 4) == 0 ? 64 : 32;
      p = std::strchr(p, ':') + 1;
      const int batch = std::atoi(p);
      p = std::strchr(p, 'x') + 1;
      shapes.push_back({batch, std::atoi(p), H});
      while (*p != 0 && *p != ',') ++p;
      if (*p == ',') ++p;
    }
  }
  for (int H : {32, 64}) {
    if (argc > 4) break;
    for (int batch : {1, 4, 16, 64, 256}) {
      for (int ctx : {1024, 8192, 32768, 131072}) {
        if (double(batch) * ctx * 8 * 128 * 4 > 33.0 * (1 << 30)) continue;  // KV past 32 GiB
        shapes.push_back({batch, ctx, H});
      }
    }
  }
  std::vector<std::pair<int, int>> configs;
  for (int v : variants) {
    for (int kps : kpss) configs.emplace_back(v, kps);
  }
  for (const Shape& sh : shapes) {
    std::vector<DTiming> t;
    const double bytes = DBench(configs, sh.batch, sh.ctx, sh.H, 8, 128, page, g_rounds, &t);
    for (size_t c = 0; c < configs.size(); ++c) {
      const double gbps = bytes / (t[c].gpu_us * 1e-6) / 1e9;
      std::printf("%-20s %-5s %-6d %-7d %-5d %9.1f %10.1f %9.0f %8.2f %10.1f %7.3f\n",
                  DecodeName(configs[c].first).c_str(), sh.H == 32 ? "8b" : "70b", sh.batch, sh.ctx, configs[c].second,
                  bytes / (1 << 20), t[c].gpu_us, gbps, gbps / copy, t[c].call_us, t[c].spread);
    }
  }
  return failures == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("SKIP: no CUDA device\n");
    return 0;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a timeout's kill
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  g_sms = prop.multiProcessorCount;
  if (argc > 1 && std::string(argv[1]) == "dcheck") return DecodeMain(argc, argv, true, false);
  if (argc > 1 && std::string(argv[1]) == "dbench") return DecodeMain(argc, argv, false, true);
  const bool bench_only = argc > 1 && std::string(argv[1]) == "bench";
  const bool check_only = argc > 1 && std::string(argv[1]) == "check";
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";  // checks, then the default at 3 shapes
  int failures = 0;
  if (!bench_only) {
    const Elem B = Elem::kBF16, F = Elem::kF16;
    std::vector<Case> cases = {
        {"d128 bs16 mha causal", B, 128, 16, 2, 1, true, {200}, {200}},
        {"d128 bs64 gqa4 causal ragged", B, 128, 64, 2, 4, true, {1, 77, 300, 64, 129}, {1, 77, 300, 64, 129}},
        {"d128 bs32 prefix causal", B, 128, 32, 1, 8, true, {150, 3, 65, 256}, {400, 100, 65, 300}},
        {"d64 bs16 prefix causal", B, 64, 16, 2, 2, true, {100, 33, 200}, {170, 33, 456}},
        {"d64 bs64 noncausal", B, 64, 64, 2, 3, false, {100, 33, 200}, {170, 40, 456}},
        {"d128 bs16 noncausal prefix", B, 128, 16, 1, 2, false, {70, 129}, {300, 129}},
        {"f16 d128 bs32 causal prefix", F, 128, 32, 2, 2, true, {190, 20}, {250, 20}},
        {"f16 d64 bs16 noncausal", F, 64, 16, 4, 1, false, {65, 128}, {100, 500}},
        {"d64 short chunks (W=4)", B, 64, 32, 2, 2, true, {2, 64, 17}, {300, 64, 90}},
        {"d128 bad block id seq1", B, 128, 16, 2, 2, true, {90, 150, 40}, {120, 150, 40}, 1},
        {"d64 bad block id seq0 (W=4)", B, 64, 64, 1, 1, false, {30, 50}, {30, 80}, 0},
        {"d128 bad block mid causal", B, 128, 16, 2, 2, true, {60, 300, 40}, {60, 330, 40}, 1, 7},
        {"f16 d64 bad block mid causal", F, 64, 32, 1, 4, true, {250}, {250}, 0, 4},
        {"d128 bs64 long causal prefix", B, 128, 64, 2, 2, true, {1100, 700, 129}, {1100, 900, 1000}},
        {"d64 bs16 long noncausal", B, 64, 16, 1, 4, false, {600, 257}, {1300, 257}},
        {"f16 d128 bs32 long bad mid", F, 128, 32, 1, 1, true, {900}, {900}, 0, 20},
        {"d128 bs64 prefix past 2k (cross-item)", B, 128, 64, 2, 2, true, {300, 1100}, {2600, 2100}},
        {"d64 bs16 2k noncausal (cross-item)", B, 64, 16, 1, 2, false, {700}, {2300}},
        // Non-causal at head_dim 128 (176-key tiles: pieces of pages, one Q buffer).
        {"d128 bs64 noncausal ragged", B, 128, 64, 2, 2, false, {177, 300, 1, 129, 40}, {353, 700, 176, 1000, 64}},
        {"f16 d128 bs32 noncausal past 2k", F, 128, 32, 1, 4, false, {260, 90}, {2600, 2111}},
        {"d128 bs64 noncausal bad mid", B, 128, 64, 2, 1, false, {200, 50}, {900, 50}, 0, 5},
    };
    // Each case twice: on the device's SM count, and as if it had 2 SMs
    // (the persistent kernels' CTAs then run many items each: the item
    // boundaries, zero-row items and bad blocks between items).
    // `check 0,7`: only those variants.
    const std::vector<int> only = check_only && argc > 2 ? ParseList(argv[2]) : std::vector<int>{};
    const int sms = g_sms;
    for (int v = 0; v < kVariants; ++v) {
      if (!Checked(v) || (!only.empty() && std::find(only.begin(), only.end(), v) == only.end())) continue;
      for (const Case& c : cases) {
        for (int s : {sms, 2}) {
          g_sms = s;
          failures += RunCase(c, v) ? 0 : 1;
        }
      }
    }
    g_sms = sms;
    std::printf("%d case(s) failed\n", failures);
  }
  if (check_only) return failures == 0 ? 0 : 1;
  if (quick) {
    for (int seqlen : {4096, 16384}) {
      for (bool causal : {true, false}) {
        double tf;
        const double ms = Bench(0, 16384 / seqlen, seqlen, 16, 16, 128, 64, causal, &tf);
        std::printf("quick fa3 %-8d causal=%d %10.3f ms %10.1f TFLOP/s\n", seqlen, causal, ms, tf);
      }
    }
    return failures == 0 ? 0 : 1;
  }
  std::printf("\n%-9s %-8s %-6s %-5s %-8s %10s %10s\n", "variant", "seqlen", "batch", "bs", "causal", "ms", "TFLOP/s");
  // `bench 0,3,5`: only those variants.
  std::vector<int> variants;
  if (argc > 2) {
    variants = ParseList(argv[2]);
  } else {
    for (int v = 0; v < kVariants; ++v) variants.push_back(v);
  }
  // Variants interleaved shape by shape, over PF_ROUNDS rounds (default 1):
  // clocks drift over a run, so side-by-side numbers compare best.
  const char* rounds_env = std::getenv("PF_ROUNDS");
  const int rounds = rounds_env != nullptr ? std::max(1, std::atoi(rounds_env)) : 1;
  struct Shape {
    int batch, seqlen, heads, kv_heads, dim, bs;
    bool causal;
    const char* note;
  };
  std::vector<Shape> shapes;
  // PF_LONG=1: only the issue's target shapes (head_dim 128, 4k-16k).
  const bool long_only = std::getenv("PF_LONG") != nullptr && std::atoi(std::getenv("PF_LONG")) != 0;
  for (int seqlen : {1024, 2048, 4096, 8192, 16384}) {
    if (long_only && seqlen < 4096) continue;
    for (bool causal : {true, false}) shapes.push_back({16384 / seqlen, seqlen, 16, 16, 128, 64, causal, ""});
  }
  if (!long_only) shapes.push_back({4, 4096, 16, 16, 128, 16, true, ""});
  if (!long_only) shapes.push_back({4, 4096, 16, 16, 64, 64, true, "  (head_dim 64)"});
  if (!long_only) shapes.push_back({4, 4096, 32, 8, 128, 16, true, "  (32 heads, gqa 4)"});
  for (int r = 0; r < rounds; ++r) {
    for (const Shape& s : shapes) {
      for (int v : variants) {
        double tf;
        const double ms = Bench(v, s.batch, s.seqlen, s.heads, s.kv_heads, s.dim, s.bs, s.causal, &tf);
        std::printf("%-9s %-8d %-6d %-5d %-8d %10.3f %10.1f%s\n", kVariantName[v], s.seqlen, s.batch, s.bs, s.causal,
                    ms, tf, s.note);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
