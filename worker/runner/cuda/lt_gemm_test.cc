// LtGemm on the GPU: products against a float64 reference, and a row's bits
// independent of how many rows the product has (what makes the engine's
// batching invisible to each sequence); the decode GEMV and the greedy
// argmax kernels beside them. Skips without a GPU or cuBLASLt.
#include "worker/runner/cuda/lt_gemm.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/paged_attention.h"
#include "worker/runner/cuda/model_kernels.h"
#include "worker/sampling/sampler.h"

namespace tandem::worker {
namespace {

struct Device {
  void* p = nullptr;
  explicit Device(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~Device() { cudaFree(p); }
};

// `bytes` from host memory at `src` into d.
void Up(Device& d, const void* src, size_t bytes) {
  ASSERT_EQ(cudaMemcpy(d.p, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// d's first `bytes`, for comparisons bit for bit.
std::vector<unsigned char> Raw(const Device& d, size_t bytes) {
  std::vector<unsigned char> v(bytes);
  EXPECT_EQ(cudaMemcpy(v.data(), d.p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

std::vector<__nv_bfloat16> RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<__nv_bfloat16> v(n);
  for (auto& x : v) x = __float2bfloat16(d(rng));
  return v;
}

// A test's RoPE and KV-write arguments: heads, KV heads and head_dim; a
// one-layer pool of `blocks` pages of `bs` tokens; and the device arrays of
// the frequencies and of every token's position and slot.
struct RopeCase {
  int heads, kv_heads, hd, bs, blocks;
  const Device &freq, &pos, &slot;
  // Tokens t .. t + n - 1, whose QKV rows (qkv_stride apart) start at qkv:
  // rotated there and written to `pool`, errors into `err`.
  cuda_ops::RopeWriteArgs Args(void* qkv, int t, int n, Device& pool, Device& err) const {
    const int qkv_stride = (heads + 2 * kv_heads) * hd;
    cuda_ops::RopeWriteArgs a{.qkv = static_cast<char*>(qkv) + size_t(t) * qkv_stride * 2,
                              .num_tokens = n,
                              .qkv_stride = qkv_stride,
                              .positions = static_cast<const int32_t*>(pos.p) + t,
                              .inv_freq = static_cast<const double*>(freq.p),
                              .num_heads = heads,
                              .num_kv_heads = kv_heads,
                              .head_dim = hd,
                              .slot_mapping = static_cast<const int64_t*>(slot.p) + t,
                              .error = static_cast<int*>(err.p)};
    a.pool = kernels::cuda::internal::OneLayerView(pool.p, blocks, bs, hd, kv_heads);
    return a;
  }
};

class LtGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* why = nullptr;
    if (!kernels::cuda::Available(&why)) GTEST_SKIP() << why;
    ASSERT_EQ(cudaMalloc(&workspace_, kWorkspace), cudaSuccess);
    absl::StatusOr<std::unique_ptr<LtGemm>> g = LtGemm::Create(workspace_, kWorkspace, /*single_pass=*/true);
    if (!g.ok()) GTEST_SKIP() << g.status();
    gemm_ = *std::move(g);
  }
  void TearDown() override {
    gemm_.reset();
    cudaFree(workspace_);
  }
  static constexpr int64_t kWorkspace = int64_t{32} << 20;
  void* workspace_ = nullptr;
  std::unique_ptr<LtGemm> gemm_;
};

TEST_F(LtGemmTest, RowsAreExactAndIndependentOfTheBatch) {
  struct Shape {
    int n, k;
  };
  // The QKV, gate/up and down shapes of an 8B model, and a small one.
  for (const Shape& sh : {Shape{6144, 4096}, Shape{28672, 4096}, Shape{4096, 14336}, Shape{1536, 512}}) {
    SCOPED_TRACE(::testing::Message() << sh.n << "x" << sh.k);
    const int max_m = 300;
    const std::vector<__nv_bfloat16> x = RandomBf16(size_t(max_m) * sh.k, 1), w = RandomBf16(size_t(sh.n) * sh.k, 2);
    Device dx(x.size() * 2), dw(w.size() * 2), dy(size_t(max_m) * sh.n * 4);
    ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<float> first_rows;  // rows 0..3 from the m = 4 product
    for (int m : {4, 1, 2, 7, 64, 128, 300}) {
      SCOPED_TRACE(m);
      ASSERT_TRUE(gemm_->Gemm(dx.p, m, sh.k, dw.p, sh.n, 0.0f, dy.p, LtGemm::Out::kF32, nullptr).ok());
      std::vector<float> y(size_t(m) * sh.n);
      ASSERT_EQ(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const int rows = std::min(m, 4);
      if (first_rows.empty()) {
        first_rows.assign(y.begin(), y.begin() + size_t(rows) * sh.n);
        // Against float64 on a sample of entries.
        double worst = 0;
        for (int r = 0; r < rows; ++r) {
          for (int j = 0; j < sh.n; j += 97) {
            double ref = 0;
            for (int i = 0; i < sh.k; ++i) {
              ref += double(__bfloat162float(x[size_t(r) * sh.k + i])) * __bfloat162float(w[size_t(j) * sh.k + i]);
            }
            worst = std::max(worst, std::fabs(ref - y[size_t(r) * sh.n + j]) / std::sqrt(double(sh.k)));
          }
        }
        EXPECT_LT(worst, 1e-3);
        continue;
      }
      int differ = 0;
      for (size_t i = 0; i < size_t(rows) * sh.n; ++i) differ += std::memcmp(&y[i], &first_rows[i], 4) != 0;
      EXPECT_EQ(differ, 0) << differ << " of " << rows * sh.n << " entries of the first rows changed with m = " << m;
    }
  }
}

// The decode GEMV kernel (cuda_ops::LaunchGemv), bf16 and f32 outputs,
// against float64 and against cuBLASLt on the same inputs.
TEST_F(LtGemmTest, GemvMatchesTheReferenceAtDecodeRows) {
  struct Shape {
    int n, k;
  };
  // (k = 3584: the last batch of a lane's loads is partial; 1001 x 1000: the
  // last CTA has a row past n and 125 chunks split unevenly; k = 40: five
  // chunks over four warps, one with none.)
  for (const Shape& sh :
       {Shape{6144, 4096}, Shape{4096, 14336}, Shape{512, 3584}, Shape{1000, 64}, Shape{1001, 1000}, Shape{77, 40}}) {
    const std::vector<__nv_bfloat16> x = RandomBf16(size_t(cuda_ops::kMaxGemvRows) * sh.k, 3),
                                     w = RandomBf16(size_t(sh.n) * sh.k, 4);
    Device dx(x.size() * 2), dw(w.size() * 2), dy(size_t(cuda_ops::kMaxGemvRows) * sh.n * 4),
        dref(size_t(cuda_ops::kMaxGemvRows) * sh.n * 4);
    ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    for (int m = 1; m <= cuda_ops::kMaxGemvRows; ++m) {
      SCOPED_TRACE(::testing::Message() << sh.n << "x" << sh.k << ", m = " << m);
      ASSERT_EQ(cuda_ops::LaunchGemv(dx.p, m, sh.k, dw.p, sh.n, dy.p, /*f32=*/true, nullptr), 0);
      ASSERT_TRUE(gemm_->Gemm(dx.p, m, sh.k, dw.p, sh.n, 0.0f, dref.p, LtGemm::Out::kF32, nullptr).ok());
      std::vector<float> y(size_t(m) * sh.n), ref(size_t(m) * sh.n);
      ASSERT_EQ(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ref.data(), dref.p, ref.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      double worst = 0, worst_lt = 0;
      std::vector<int> columns;
      for (int j = 0; j < sh.n; j += 37) columns.push_back(j);
      columns.push_back(sh.n - 1);
      for (int r = 0; r < m; ++r) {
        for (const int j : columns) {
          double exact = 0;
          for (int i = 0; i < sh.k; ++i) {
            exact += double(__bfloat162float(x[size_t(r) * sh.k + i])) * __bfloat162float(w[size_t(j) * sh.k + i]);
          }
          const double scale = std::sqrt(double(sh.k));
          worst = std::max(worst, std::fabs(exact - y[size_t(r) * sh.n + j]) / scale);
          worst_lt = std::max(worst_lt, std::fabs(exact - ref[size_t(r) * sh.n + j]) / scale);
        }
      }
      EXPECT_LT(worst, 1e-4) << "cuBLASLt's error: " << worst_lt;
      // bf16 output: the same values rounded.
      ASSERT_EQ(cuda_ops::LaunchGemv(dx.p, m, sh.k, dw.p, sh.n, dy.p, /*f32=*/false, nullptr), 0);
      std::vector<__nv_bfloat16> yb(size_t(m) * sh.n);
      ASSERT_EQ(cudaMemcpy(yb.data(), dy.p, yb.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < yb.size(); i += 101) {
        EXPECT_EQ(__bfloat162float(yb[i]), __bfloat162float(__float2bfloat16(y[i]))) << i;
      }
    }
  }
}

// The tensor-core product of a few rows (cuda_ops::LaunchGemvMma) at every
// m from 1 to kMaxGemvMmaRows: float32 output against float64, bf16 output
// the same values rounded, and each row's bits those of the 16-row product
// (a row does not depend on the others). Shapes: the 8B model's QKV and
// down products (64 and 224 slices of k over eight warps, two a warp at a
// time), a last round of one slice a warp (k = 1536: 24 slices), fewer
// slices than warps (k = 256), a single CTA (n = 16, k = 576: nine
// slices); then what it refuses.
TEST_F(LtGemmTest, GemvMmaMatchesTheReferenceAndKeepsEachRowsBits) {
  struct Shape {
    int n, k;
  };
  constexpr int kRows = cuda_ops::kMaxGemvMmaRows;
  for (const Shape& sh : {Shape{6144, 4096}, Shape{4096, 14336}, Shape{512, 1536}, Shape{1024, 256}, Shape{16, 576}}) {
    const std::vector<__nv_bfloat16> x = RandomBf16(size_t(kRows) * sh.k, 5), w = RandomBf16(size_t(sh.n) * sh.k, 6);
    Device dx(x.size() * 2), dw(w.size() * 2), dy(size_t(kRows) * sh.n * 4);
    Up(dx, x.data(), x.size() * 2);
    Up(dw, w.data(), w.size() * 2);
    ASSERT_TRUE(cuda_ops::GemvMmaSupports(dx.p, kRows, sh.k, dw.p, sh.n));
    ASSERT_EQ(cuda_ops::LaunchGemvMma(dx.p, kRows, sh.k, dw.p, sh.n, dy.p, /*f32=*/true, nullptr), 0);
    const std::vector<unsigned char> all_rows = Raw(dy, size_t(kRows) * sh.n * 4);
    std::vector<int> columns;
    for (int j = 0; j < sh.n; j += 37) columns.push_back(j);
    columns.push_back(sh.n - 1);
    for (int m = 1; m <= kRows; ++m) {
      SCOPED_TRACE(::testing::Message() << sh.n << "x" << sh.k << ", m = " << m);
      ASSERT_EQ(cudaMemset(dy.p, 0xff, size_t(kRows) * sh.n * 4), cudaSuccess);
      ASSERT_EQ(cuda_ops::LaunchGemvMma(dx.p, m, sh.k, dw.p, sh.n, dy.p, /*f32=*/true, nullptr), 0);
      const std::vector<unsigned char> raw = Raw(dy, size_t(kRows) * sh.n * 4);
      EXPECT_EQ(std::memcmp(raw.data(), all_rows.data(), size_t(m) * sh.n * 4), 0)
          << "a row's bits changed with the number of rows";
      for (size_t i = size_t(m) * sh.n * 4; i < raw.size(); ++i) {
        ASSERT_EQ(raw[i], 0xff) << "written past row m - 1, at byte " << i;
      }
      std::vector<float> y(size_t(m) * sh.n);
      std::memcpy(y.data(), raw.data(), y.size() * 4);
      double worst = 0;
      for (int r = 0; r < m; ++r) {
        for (const int j : columns) {
          double exact = 0;
          for (int i = 0; i < sh.k; ++i) {
            exact += double(__bfloat162float(x[size_t(r) * sh.k + i])) * __bfloat162float(w[size_t(j) * sh.k + i]);
          }
          worst = std::max(worst, std::fabs(exact - y[size_t(r) * sh.n + j]) / std::sqrt(double(sh.k)));
        }
      }
      EXPECT_LT(worst, 1e-4);
      ASSERT_EQ(cuda_ops::LaunchGemvMma(dx.p, m, sh.k, dw.p, sh.n, dy.p, /*f32=*/false, nullptr), 0);
      std::vector<__nv_bfloat16> yb(size_t(m) * sh.n);
      ASSERT_EQ(cudaMemcpy(yb.data(), dy.p, yb.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < yb.size(); i += 53) {
        EXPECT_EQ(__bfloat162float(yb[i]), __bfloat162float(__float2bfloat16(y[i]))) << i;
      }
    }
  }
  // Refused: too many rows, k not a multiple of 64, n not of 16, x or w
  // not 16-byte aligned; nothing launched.
  Device dx(size_t(kRows + 1) * 4096 * 2 + 16), dw(size_t(64) * 4096 * 2 + 16), dy(size_t(kRows + 1) * 64 * 4);
  const auto* x8 = static_cast<const char*>(dx.p);
  const auto* w8 = static_cast<const char*>(dw.p);
  EXPECT_FALSE(cuda_ops::GemvMmaSupports(dx.p, kRows + 1, 4096, dw.p, 64));
  EXPECT_FALSE(cuda_ops::GemvMmaSupports(dx.p, 4, 4000, dw.p, 64));
  EXPECT_FALSE(cuda_ops::GemvMmaSupports(dx.p, 4, 4096, dw.p, 56));
  EXPECT_FALSE(cuda_ops::GemvMmaSupports(x8 + 8, 4, 4096, dw.p, 64));
  EXPECT_FALSE(cuda_ops::GemvMmaSupports(dx.p, 4, 4096, w8 + 8, 64));
  EXPECT_EQ(cuda_ops::LaunchGemvMma(dx.p, kRows + 1, 4096, dw.p, 64, dy.p, false, nullptr),
            static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(cuda_ops::LaunchGemvMma(dx.p, 4, 4000, dw.p, 64, dy.p, false, nullptr),
            static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(cuda_ops::LaunchGemvMma(x8 + 8, 4, 4096, dw.p, 64, dy.p, false, nullptr),
            static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The tensor-core products with the fused epilogues (LaunchGemvMmaFused)
// give the bits of LaunchGemvMma followed by the kernels they replace: the
// gate/up product with and without its bias, then SiLU-and-multiply; the
// QKV product with its bias, then RoPE and the KV write (a token's slot past
// the pool recorded, one with none skipped); at 3, 8, 11 and 16 tokens.
// Then what it refuses.
TEST_F(LtGemmTest, MmaFusedEpiloguesGiveTheBitsOfTheKernelsTheyReplace) {
  const int heads = 8, kv_heads = 2, hd = 128, H = 2048, I = 2816, bs = 16, blocks = 4;
  const int qkv = (heads + 2 * kv_heads) * hd;
  constexpr int M = cuda_ops::kMaxGemvMmaRows;
  const std::vector<__nv_bfloat16> x = RandomBf16(size_t(M) * H, 41), wqkv = RandomBf16(size_t(qkv) * H, 42),
                                   bqkv = RandomBf16(qkv, 43), wgu = RandomBf16(size_t(2 * I) * H, 44),
                                   bgu = RandomBf16(2 * I, 45);
  std::vector<double> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.0, -2.0 * i / hd);
  std::vector<int32_t> pos(M);
  std::vector<int64_t> slots(M);
  for (int t = 0; t < M; ++t) {
    pos[t] = 37 * t + (t == 5 ? 70000 : 0);
    slots[t] = t % blocks * bs + t;  // token t in block t % 4
  }
  slots[1] = int64_t{blocks} * bs + 3;  // past the pool
  slots[2] = -1;                        // no slot
  const size_t pool_elems = size_t(blocks) * 2 * kv_heads * bs * hd;
  Device dx(x.size() * 2), dwqkv(wqkv.size() * 2), dbqkv(qkv * 2), dwgu(wgu.size() * 2), dbgu(bgu.size() * 2),
      dfreq(inv_freq.size() * 8), dpos(M * 4), dslot(M * 8), dgu(size_t(M) * 2 * I * 2), dact(size_t(M) * I * 2),
      dact2(size_t(M) * I * 2), dqkv(size_t(M) * qkv * 2), dqkv2(size_t(M) * qkv * 2), dpool(pool_elems * 2),
      dpool2(pool_elems * 2), derr(4), derr2(4);
  Up(dx, x.data(), x.size() * 2);
  Up(dwqkv, wqkv.data(), wqkv.size() * 2);
  Up(dbqkv, bqkv.data(), qkv * 2);
  Up(dwgu, wgu.data(), wgu.size() * 2);
  Up(dbgu, bgu.data(), bgu.size() * 2);
  Up(dfreq, inv_freq.data(), inv_freq.size() * 8);
  Up(dpos, pos.data(), M * 4);
  Up(dslot, slots.data(), M * 8);
  const RopeCase rc{heads, kv_heads, hd, bs, blocks, dfreq, dpos, dslot};
  auto rope = [&](Device& q, Device& pool, Device& err, int n) { return rc.Args(q.p, 0, n, pool, err); };
  // Token t's Q columns of a QKV buffer, for comparison.
  auto q_rows = [&](const Device& d, int m) {
    const std::vector<unsigned char> all = Raw(d, size_t(m) * qkv * 2);
    std::vector<unsigned char> q;
    for (int t = 0; t < m; ++t) {
      q.insert(q.end(), all.begin() + size_t(t) * qkv * 2, all.begin() + (size_t(t) * qkv + heads * hd) * 2);
    }
    return q;
  };
  for (const int m : {3, 8, 11, M}) {
    SCOPED_TRACE(testing::Message() << m << " tokens");
    for (const void* bias : {static_cast<const void*>(dbgu.p), static_cast<const void*>(nullptr)}) {
      SCOPED_TRACE(bias != nullptr ? "with the gate/up bias" : "no bias");
      ASSERT_EQ(cuda_ops::LaunchGemvMma(dx.p, m, H, dwgu.p, 2 * I, dgu.p, /*f32=*/false, nullptr), 0);
      if (bias != nullptr) {
        ASSERT_EQ(cuda_ops::LaunchAddBias(dgu.p, m, 2 * I, bias, nullptr), 0);
      }
      ASSERT_EQ(cuda_ops::LaunchSiluMul(dgu.p, m, I, dact.p, nullptr), 0);
      ASSERT_EQ(cudaMemset(dact2.p, 0xff, size_t(M) * I * 2), cudaSuccess);
      ASSERT_TRUE(cuda_ops::GemvMmaFusedSupports(dx.p, m, H, dwgu.p, I, cuda_ops::GemvEpilogue::kSiluMul));
      ASSERT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, m, H, dwgu.p, I, dact2.p, cuda_ops::GemvEpilogue::kSiluMul,
                                             {.bias = bias}, nullptr),
                0);
      const std::vector<unsigned char> fused = Raw(dact2, size_t(M) * I * 2);
      EXPECT_EQ(Raw(dact, size_t(m) * I * 2),
                std::vector<unsigned char>(fused.begin(), fused.begin() + size_t(m) * I * 2))
          << "silu(gate) * up";
      EXPECT_EQ(std::count(fused.begin() + size_t(m) * I * 2, fused.end(), 0xff), int64_t(M - m) * I * 2)
          << "written past token m - 1";
    }
    for (Device* d : {&dpool, &dpool2, &derr, &derr2, &dqkv2}) {
      ASSERT_EQ(cudaMemset(d->p, 0,
                           d == &derr || d == &derr2 ? 4
                           : d == &dqkv2             ? size_t(M) * qkv * 2
                                                     : pool_elems * 2),
                cudaSuccess);
    }
    ASSERT_EQ(cuda_ops::LaunchGemvMma(dx.p, m, H, dwqkv.p, qkv, dqkv.p, /*f32=*/false, nullptr), 0);
    cuda_ops::RopeWriteArgs unfused = rope(dqkv, dpool, derr, m);
    unfused.bias = dbqkv.p;
    ASSERT_EQ(cuda_ops::LaunchRopeWriteKv(unfused, nullptr), 0);
    ASSERT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, m, H, dwqkv.p, qkv / 2, nullptr, cuda_ops::GemvEpilogue::kRopeWriteKv,
                                           {.bias = dbqkv.p, .rope = rope(dqkv2, dpool2, derr2, m)}, nullptr),
              0);
    EXPECT_EQ(q_rows(dqkv, m), q_rows(dqkv2, m)) << "the rotated Q rows";
    const std::vector<unsigned char> pool = Raw(dpool, pool_elems * 2);
    EXPECT_EQ(pool, Raw(dpool2, pool_elems * 2)) << "the pool";
    EXPECT_NE(pool, std::vector<unsigned char>(pool.size(), 0)) << "nothing written to the pool";
    int err = 0, err2 = 0;
    ASSERT_EQ(cudaMemcpy(&err, derr.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&err2, derr2.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(err2, (kernels::cuda::internal::kErrSlot << 28) | 1) << "token 1's slot is past the pool";
    EXPECT_EQ(err2, err);
  }
  // Refused: another epilogue, units not a multiple of 8, a norm or a
  // residual asked for, fewer RoPE tokens than rows.
  const auto invalid = static_cast<int>(cudaErrorInvalidValue);
  EXPECT_FALSE(cuda_ops::GemvMmaFusedSupports(dx.p, 4, H, dwgu.p, I, cuda_ops::GemvEpilogue::kStore));
  EXPECT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, 4, H, dwgu.p, I, dact.p, cuda_ops::GemvEpilogue::kResidual, {}, nullptr),
            invalid);
  EXPECT_EQ(
      cuda_ops::LaunchGemvMmaFused(dx.p, 4, H, dwgu.p, I - 4, dact.p, cuda_ops::GemvEpilogue::kSiluMul, {}, nullptr),
      invalid);
  float* some = static_cast<float*>(dpool.p);
  EXPECT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, 4, H, dwgu.p, I, dact.p, cuda_ops::GemvEpilogue::kSiluMul,
                                         {.norm_x = some}, nullptr),
            invalid);
  EXPECT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, 4, H, dwgu.p, I, dact.p, cuda_ops::GemvEpilogue::kSiluMul,
                                         {.residual = some}, nullptr),
            invalid);
  EXPECT_EQ(cuda_ops::LaunchGemvMmaFused(dx.p, 4, H, dwqkv.p, qkv / 2, nullptr, cuda_ops::GemvEpilogue::kRopeWriteKv,
                                         {.rope = rope(dqkv2, dpool2, derr2, 3)}, nullptr),
            invalid);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The fused product at every split of a row over warps, against a float64
// reference, on shapes whose rows and chunks do not divide evenly.
TEST_F(LtGemmTest, FusedProductsAtEverySplitMatchTheReference) {
  struct Shape {
    int n, k;
  };
  for (const Shape& sh : {Shape{1001, 1000}, Shape{77, 40}, Shape{30, 4096}}) {
    const std::vector<__nv_bfloat16> x = RandomBf16(sh.k, 41), w = RandomBf16(size_t(sh.n) * sh.k, 42);
    Device dx(x.size() * 2), dw(w.size() * 2), dy(size_t(sh.n) * 2);
    ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    for (const int split : {1, 2, 4, 8}) {
      SCOPED_TRACE(::testing::Message() << sh.n << "x" << sh.k << ", split " << split);
      ASSERT_EQ(cudaMemset(dy.p, 0xff, size_t(sh.n) * 2), cudaSuccess);  // NaNs where nothing is written
      const cuda_ops::GemvFusion f{.split = split};
      ASSERT_EQ(cuda_ops::LaunchGemvFused(dx.p, sh.k, dw.p, sh.n, dy.p, cuda_ops::GemvEpilogue::kStore, f, nullptr), 0);
      std::vector<__nv_bfloat16> y(sh.n);
      ASSERT_EQ(cudaMemcpy(y.data(), dy.p, y.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int j = 0; j < sh.n; ++j) {
        double exact = 0;
        for (int i = 0; i < sh.k; ++i) {
          exact += double(__bfloat162float(x[i])) * __bfloat162float(w[size_t(j) * sh.k + i]);
        }
        // One bf16 rounding of a float32 sum.
        ASSERT_NEAR(__bfloat162float(y[j]), exact, std::fabs(exact) / 128 + 1e-4 * std::sqrt(double(sh.k))) << j;
      }
    }
  }
}

// The fused one-row products (cuda_ops::LaunchGemvFused) against the
// kernels they stand for, run one by one on the same inputs: AddRmsNorm
// then the GEMV (the norm built in the product), the GEMV then AddRmsNorm's
// residual add (with and without a bias), and the gate/up GEMV, its bias,
// then SiluMul. The roundings are the same, so the values agree but for
// the norm's sum order (a few bf16 steps at most).
TEST_F(LtGemmTest, FusedOneRowProductsMatchTheKernelsTheyReplace) {
  const int H = 4096, I = 1408, n = 1000;  // hidden, intermediate (k % 8 == 0), a product's rows
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> residual(H);
  for (float& v : residual) v = 3.0f * nd(rng);
  const std::vector<__nv_bfloat16> gamma = RandomBf16(H, 11), w = RandomBf16(size_t(2 * I) * H, 12),
                                   wd = RandomBf16(size_t(H) * I, 13), xin = RandomBf16(I, 14),
                                   bias = RandomBf16(2 * I, 15);
  Device dres(H * 4), dres2(H * 4), dgamma(H * 2), dw(w.size() * 2), dwd(wd.size() * 2), dxin(I * 2),
      dbias(bias.size() * 2), dh(H * 2), dy(size_t(2 * I) * 2), dy2(size_t(2 * I) * 2), dact(I * 2);
  Up(dres, residual.data(), H * 4);
  Up(dgamma, gamma.data(), H * 2);
  Up(dw, w.data(), w.size() * 2);
  Up(dwd, wd.data(), wd.size() * 2);
  Up(dxin, xin.data(), I * 2);
  Up(dbias, bias.data(), bias.size() * 2);
  auto bf16s = [](Device& d, size_t count) {
    std::vector<__nv_bfloat16> v(count);
    EXPECT_EQ(cudaMemcpy(v.data(), d.p, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> f(count);
    for (size_t i = 0; i < count; ++i) f[i] = __bfloat162float(v[i]);
    return f;
  };
  auto floats = [](Device& d, size_t count) {
    std::vector<float> f(count);
    EXPECT_EQ(cudaMemcpy(f.data(), d.p, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return f;
  };
  // Agreement: all within a few bf16 steps, and most values identical.
  auto expect_close = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    size_t same = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      same += got[i] == want[i];
      ASSERT_NEAR(got[i], want[i], 0.02 * std::fabs(want[i]) + 1e-3) << what << " at " << i;
    }
    EXPECT_GE(same, got.size() * 9 / 10) << what;
  };
  const float eps = 1e-5f;
  // Every split of a row over warps (0: the kernel's default).
  for (const int split : {0, 1, 2, 4, 8}) {
    SCOPED_TRACE(testing::Message() << "split " << split);
    Up(dres, residual.data(), H * 4);
    ASSERT_EQ(cudaMemset(dy2.p, 0xff, size_t(2 * I) * 2), cudaSuccess);  // no split sees the last one's output
    {                                                                    // norm prologue, plain store
      ASSERT_EQ(cuda_ops::LaunchAddRmsNorm(static_cast<float*>(dres.p), nullptr, 1, H, nullptr, nullptr, dgamma.p, eps,
                                           dh.p, nullptr),
                0);
      ASSERT_EQ(cuda_ops::LaunchGemv(dh.p, 1, H, dw.p, n, dy.p, false, nullptr), 0);
      cuda_ops::GemvFusion f{
          .norm_x = static_cast<const float*>(dres.p), .norm_weight = dgamma.p, .eps = eps, .split = split};
      ASSERT_EQ(cuda_ops::LaunchGemvFused(nullptr, H, dw.p, n, dy2.p, cuda_ops::GemvEpilogue::kStore, f, nullptr), 0);
      expect_close(bf16s(dy2, n), bf16s(dy, n), "norm + product");
    }
    {  // norm prologue, the gate/up pair with its bias, SiLU-and-multiply
      ASSERT_EQ(cuda_ops::LaunchGemv(dh.p, 1, H, dw.p, 2 * I, dy.p, false, nullptr), 0);
      ASSERT_EQ(cuda_ops::LaunchAddBias(dy.p, 1, 2 * I, dbias.p, nullptr), 0);
      ASSERT_EQ(cuda_ops::LaunchSiluMul(dy.p, 1, I, dact.p, nullptr), 0);
      cuda_ops::GemvFusion f{.norm_x = static_cast<const float*>(dres.p),
                             .norm_weight = dgamma.p,
                             .eps = eps,
                             .bias = dbias.p,
                             .split = split};
      ASSERT_EQ(cuda_ops::LaunchGemvFused(nullptr, H, dw.p, I, dy2.p, cuda_ops::GemvEpilogue::kSiluMul, f, nullptr), 0);
      expect_close(bf16s(dy2, I), bf16s(dact, I), "norm + gate/up + bias + silu");
    }
    for (const bool with_bias : {false, true}) {  // the residual's update from a bf16 x (the down product)
      SCOPED_TRACE(with_bias ? "with a bias" : "no bias");
      Up(dres, residual.data(), H * 4);
      Up(dres2, residual.data(), H * 4);
      ASSERT_EQ(cuda_ops::LaunchGemv(dxin.p, 1, I, dwd.p, H, dh.p, false, nullptr), 0);
      ASSERT_EQ(cuda_ops::LaunchAddRmsNorm(static_cast<float*>(dres.p), nullptr, 1, H, dh.p,
                                           with_bias ? dbias.p : nullptr, nullptr, eps, nullptr, nullptr),
                0);
      cuda_ops::GemvFusion f{
          .residual = static_cast<float*>(dres2.p), .bias = with_bias ? dbias.p : nullptr, .split = split};
      ASSERT_EQ(cuda_ops::LaunchGemvFused(dxin.p, I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, f, nullptr),
                0);
      if (split == 0 || split == 4) {
        // No norm and LaunchGemv's split: the same sums in the same order, so the same bits.
        EXPECT_EQ(floats(dres2, H), floats(dres, H));
      } else {
        expect_close(floats(dres2, H), floats(dres, H), "the residual's update");
      }
    }
  }
  // Refused: norming the residual the same launch updates, a norm past 48 KB of shared memory.
  const cuda_ops::GemvFusion racy{.norm_x = static_cast<const float*>(dres.p),
                                  .norm_weight = dgamma.p,
                                  .eps = eps,
                                  .residual = static_cast<float*>(dres.p)};
  EXPECT_EQ(cuda_ops::LaunchGemvFused(nullptr, H, dw.p, n, nullptr, cuda_ops::GemvEpilogue::kResidual, racy, nullptr),
            cudaErrorInvalidValue);
  const cuda_ops::GemvFusion wide{.norm_x = static_cast<const float*>(dres.p), .norm_weight = dgamma.p, .eps = eps};
  EXPECT_EQ(cuda_ops::LaunchGemvFused(nullptr, cuda_ops::kMaxGemvNormWidth + 8, dw.p, 1, dy.p,
                                      cuda_ops::GemvEpilogue::kStore, wide, nullptr),
            cudaErrorInvalidValue);
  {  // ... and the widest norm it takes launches (its shared memory fits).
    std::vector<float> big(cuda_ops::kMaxGemvNormWidth, 0.5f);
    Device dbig(big.size() * 4), dgbig(big.size() * 2);
    Up(dbig, big.data(), big.size() * 4);
    ASSERT_EQ(cudaMemset(dgbig.p, 0, big.size() * 2), cudaSuccess);
    const cuda_ops::GemvFusion widest{.norm_x = static_cast<const float*>(dbig.p), .norm_weight = dgbig.p, .eps = eps};
    EXPECT_EQ(cuda_ops::LaunchGemvFused(nullptr, cuda_ops::kMaxGemvNormWidth, dw.p, 1, dy.p,
                                        cuda_ops::GemvEpilogue::kStore, widest, nullptr),
              0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const cuda_ops::GemvFusion three_warps{.residual = static_cast<float*>(dres.p), .split = 3};
  EXPECT_EQ(
      cuda_ops::LaunchGemvFused(dxin.p, I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, three_warps, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda_ops::LaunchGemvFused(dxin.p, I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, {}, nullptr),
            cudaErrorInvalidValue)
      << "the residual's update without a residual";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The fused products of a step of several tokens (GemvFusion::rows) give
// each token the bits a launch of that token alone gives: the normed QKV
// product with RoPE and the KV write (tokens at their own positions and
// slots, one past the pool), the normed QKV product stored plainly, the
// normed gate/up product with its bias, and the residual's update with a
// bias. (H and I give each lane several chunks, so the loads in flight,
// which differ with the token count, would show in the sum order.)
TEST_F(LtGemmTest, FusedProductsOfSeveralTokensGiveEachItsOwnBits) {
  const int heads = 8, kv_heads = 2, hd = 128, H = 2048, I = 2816, bs = 16, blocks = 4;
  const int qkv = (heads + 2 * kv_heads) * hd;
  const int M = cuda_ops::kMaxFusedRows;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> residual(size_t(M) * H);
  for (float& v : residual) v = nd(rng);
  const std::vector<__nv_bfloat16> gamma = RandomBf16(H, 31), wqkv = RandomBf16(size_t(qkv) * H, 32),
                                   bqkv = RandomBf16(qkv, 33), wgu = RandomBf16(size_t(2 * I) * H, 34),
                                   bgu = RandomBf16(2 * I, 35), wd = RandomBf16(size_t(H) * I, 36),
                                   bd = RandomBf16(H, 37), act = RandomBf16(size_t(M) * I, 38);
  std::vector<double> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.0, -2.0 * i / hd);
  const std::vector<int32_t> pos = {7, 1234, 0, 65000};
  const std::vector<int64_t> slots = {2 * bs + 5, int64_t{blocks} * bs + 3, -1, 5};  // the second past the pool
  const size_t pool_elems = size_t(blocks) * 2 * kv_heads * bs * hd;
  Device dres(residual.size() * 4), dres2(residual.size() * 4), dgamma(H * 2), dwqkv(wqkv.size() * 2), dbqkv(qkv * 2),
      dwgu(wgu.size() * 2), dbgu(bgu.size() * 2), dwd(wd.size() * 2), dbd(H * 2), dact(act.size() * 2),
      dfreq(inv_freq.size() * 8), dpos(pos.size() * 4), dslot(slots.size() * 8), dqkv(size_t(M) * qkv * 2),
      dqkv2(size_t(M) * qkv * 2), dpool(pool_elems * 2), dpool2(pool_elems * 2), derr(4), derr2(4),
      dy(size_t(M) * std::max(I, qkv) * 2), dy2(size_t(M) * std::max(I, qkv) * 2);
  Up(dgamma, gamma.data(), H * 2);
  Up(dwqkv, wqkv.data(), wqkv.size() * 2);
  Up(dbqkv, bqkv.data(), qkv * 2);
  Up(dwgu, wgu.data(), wgu.size() * 2);
  Up(dbgu, bgu.data(), bgu.size() * 2);
  Up(dwd, wd.data(), wd.size() * 2);
  Up(dbd, bd.data(), H * 2);
  Up(dact, act.data(), act.size() * 2);
  Up(dfreq, inv_freq.data(), inv_freq.size() * 8);
  Up(dpos, pos.data(), pos.size() * 4);
  Up(dslot, slots.data(), slots.size() * 8);
  const auto* res_p = static_cast<const float*>(dres.p);
  // Token t's view of a buffer of rows `width` elements of `elem` bytes wide.
  auto row = [](Device& d, int t, size_t width, size_t elem) { return static_cast<char*>(d.p) + t * width * elem; };
  const RopeCase rc{heads, kv_heads, hd, bs, blocks, dfreq, dpos, dslot};
  auto rope = [&](Device& q, Device& pool, Device& err, int t, int n) { return rc.Args(q.p, t, n, pool, err); };
  for (int rows = 2; rows <= M; ++rows) {
    SCOPED_TRACE(testing::Message() << rows << " tokens");
    for (Device* d : {&dpool, &dpool2, &derr, &derr2, &dqkv, &dqkv2}) {
      ASSERT_EQ(cudaMemset(d->p, 0,
                           d == &derr || d == &derr2   ? 4
                           : d == &dqkv || d == &dqkv2 ? M * qkv * 2
                                                       : pool_elems * 2),
                cudaSuccess);
    }
    Up(dres, residual.data(), residual.size() * 4);
    Up(dres2, residual.data(), residual.size() * 4);
    // Each product twice: `launch(alone, t, n)` for tokens t..t+n-1, all
    // tokens in one launch into the first buffers (dqkv, dpool, derr, dy,
    // dres), then each token alone into the second (dqkv2, ...).
    auto all_then_each = [&](auto&& launch) {
      ASSERT_EQ(launch(false, 0, rows), 0);
      for (int t = 0; t < rows; ++t) ASSERT_EQ(launch(true, t, 1), 0);
    };
    // The QKV product with RoPE and the KV write.
    all_then_each([&](bool alone, int t, int n) {
      cuda_ops::GemvFusion f{.norm_x = res_p + int64_t{t} * H,
                             .norm_weight = dgamma.p,
                             .eps = 1e-5f,
                             .bias = dbqkv.p,
                             .rope = alone ? rope(dqkv2, dpool2, derr2, t, n) : rope(dqkv, dpool, derr, t, n),
                             .rows = n};
      return cuda_ops::LaunchGemvFused(nullptr, H, dwqkv.p, qkv / 2, nullptr, cuda_ops::GemvEpilogue::kRopeWriteKv, f,
                                       nullptr);
    });
    EXPECT_EQ(Raw(dqkv, size_t(rows) * qkv * 2), Raw(dqkv2, size_t(rows) * qkv * 2)) << "the rotated Q rows";
    EXPECT_EQ(Raw(dpool, pool_elems * 2), Raw(dpool2, pool_elems * 2)) << "the pool";
    // Token 1's slot is past the pool: the error names it (index 1) in the
    // launch of all tokens, and token 0 of its own launch.
    int err = 0, err2 = 0;
    ASSERT_EQ(cudaMemcpy(&err, derr.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&err2, derr2.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(err, (kernels::cuda::internal::kErrSlot << 28) | 1);
    EXPECT_EQ(err2, (kernels::cuda::internal::kErrSlot << 28) | 0);
    // The QKV product stored plainly (TANDEM_FUSED_ROPE=0's).
    all_then_each([&](bool alone, int t, int n) {
      cuda_ops::GemvFusion f{.norm_x = res_p + int64_t{t} * H, .norm_weight = dgamma.p, .eps = 1e-5f, .rows = n};
      return cuda_ops::LaunchGemvFused(nullptr, H, dwqkv.p, qkv, row(alone ? dy2 : dy, t, qkv, 2),
                                       cuda_ops::GemvEpilogue::kStore, f, nullptr);
    });
    EXPECT_EQ(Raw(dy, size_t(rows) * qkv * 2), Raw(dy2, size_t(rows) * qkv * 2)) << "the stored QKV rows";
    // The gate/up product with its bias and SiLU-and-multiply.
    all_then_each([&](bool alone, int t, int n) {
      cuda_ops::GemvFusion f{
          .norm_x = res_p + int64_t{t} * H, .norm_weight = dgamma.p, .eps = 1e-5f, .bias = dbgu.p, .rows = n};
      return cuda_ops::LaunchGemvFused(nullptr, H, dwgu.p, I, row(alone ? dy2 : dy, t, I, 2),
                                       cuda_ops::GemvEpilogue::kSiluMul, f, nullptr);
    });
    EXPECT_EQ(Raw(dy, size_t(rows) * I * 2), Raw(dy2, size_t(rows) * I * 2)) << "silu(gate) * up";
    // The down product's update of the residual, with a bias.
    all_then_each([&](bool alone, int t, int n) {
      cuda_ops::GemvFusion f{
          .residual = reinterpret_cast<float*>(row(alone ? dres2 : dres, t, H, 4)), .bias = dbd.p, .rows = n};
      return cuda_ops::LaunchGemvFused(row(dact, t, I, 2), I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, f,
                                       nullptr);
    });
    const std::vector<unsigned char> after = Raw(dres, size_t(rows) * H * 4);
    EXPECT_EQ(after, Raw(dres2, size_t(rows) * H * 4)) << "the residual";
    EXPECT_NE(std::memcmp(after.data(), residual.data(), after.size()), 0) << "the update changed nothing";
  }
  // Refused: more rows than kMaxFusedRows, a split at several rows, normed rows past 48 KB.
  const cuda_ops::GemvFusion five{.residual = static_cast<float*>(dres.p), .rows = M + 1};
  EXPECT_EQ(cuda_ops::LaunchGemvFused(dact.p, I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, five, nullptr),
            cudaErrorInvalidValue);
  const cuda_ops::GemvFusion split{.residual = static_cast<float*>(dres.p), .split = 4, .rows = 2};
  EXPECT_EQ(cuda_ops::LaunchGemvFused(dact.p, I, dwd.p, H, nullptr, cuda_ops::GemvEpilogue::kResidual, split, nullptr),
            cudaErrorInvalidValue);
  // At four tokens the widest norm is a quarter as wide; the SiLU product
  // there has the most shared memory of its own.
  const int widest = cuda_ops::kMaxGemvNormWidth / M;
  std::vector<float> big(size_t(M) * (widest + 8), 0.5f);
  Device dbig(big.size() * 4), dgbig((widest + 8) * 2);
  Up(dbig, big.data(), big.size() * 4);
  ASSERT_EQ(cudaMemset(dgbig.p, 0, (widest + 8) * 2), cudaSuccess);
  const cuda_ops::GemvFusion wide{
      .norm_x = static_cast<const float*>(dbig.p), .norm_weight = dgbig.p, .eps = 1e-5f, .rows = M};
  EXPECT_EQ(
      cuda_ops::LaunchGemvFused(nullptr, widest, dwgu.p, 1, dy.p, cuda_ops::GemvEpilogue::kSiluMul, wide, nullptr), 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the widest norm at four tokens";
  EXPECT_EQ(
      cuda_ops::LaunchGemvFused(nullptr, widest + 8, dwgu.p, 1, dy.p, cuda_ops::GemvEpilogue::kSiluMul, wide, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The QKV product with RoPE and the KV write in its epilogue (kRopeWriteKv)
// against the product then RopeWriteKvKernel, with a QKV bias: the same Q
// row and the same pool, bit for bit; a slot past the pool writes nothing
// and sets the slot error.
TEST_F(LtGemmTest, FusedRopeAndKvWriteMatchTheirKernel) {
  const int heads = 8, kv_heads = 2, hd = 128, k = 512, bs = 16, blocks = 4;
  const int qkv = (heads + 2 * kv_heads) * hd;
  const std::vector<__nv_bfloat16> x = RandomBf16(k, 21), w = RandomBf16(size_t(qkv) * k, 22),
                                   bias = RandomBf16(qkv, 23);
  std::vector<double> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.0, -2.0 * i / hd);
  const size_t pool_elems = size_t(blocks) * 2 * kv_heads * bs * hd;
  Device dx(k * 2), dw(w.size() * 2), dbias(qkv * 2), dfreq(inv_freq.size() * 8), dpos(4), dslot(8), dqkv(qkv * 2),
      dqkv2(qkv * 2), dpool(pool_elems * 2), dpool2(pool_elems * 2), derr(4), derr2(4);
  Up(dx, x.data(), k * 2);
  Up(dw, w.data(), w.size() * 2);
  Up(dbias, bias.data(), qkv * 2);
  Up(dfreq, inv_freq.data(), inv_freq.size() * 8);
  const int32_t pos = 1234;
  Up(dpos, &pos, 4);
  const RopeCase rc{heads, kv_heads, hd, bs, blocks, dfreq, dpos, dslot};
  auto args = [&](Device& row, Device& pool, Device& err) {
    cuda_ops::RopeWriteArgs a = rc.Args(row.p, 0, 1, pool, err);
    a.bias = dbias.p;
    return a;
  };
  for (const int64_t slot : {int64_t{2 * bs + 5}, int64_t{blocks * bs + 3}}) {
    SCOPED_TRACE(::testing::Message() << "slot " << slot);
    Up(dslot, &slot, 8);
    for (Device* d : {&dpool, &dpool2, &derr, &derr2})
      ASSERT_EQ(cudaMemset(d->p, 0, d == &derr || d == &derr2 ? 4 : pool_elems * 2), cudaSuccess);
    ASSERT_EQ(cuda_ops::LaunchGemv(dx.p, 1, k, dw.p, qkv, dqkv.p, false, nullptr), 0);
    ASSERT_EQ(cuda_ops::LaunchRopeWriteKv(args(dqkv, dpool, derr), nullptr), 0);
    cuda_ops::GemvFusion f{.bias = dbias.p, .rope = args(dqkv2, dpool2, derr2)};
    ASSERT_EQ(
        cuda_ops::LaunchGemvFused(dx.p, k, dw.p, qkv / 2, nullptr, cuda_ops::GemvEpilogue::kRopeWriteKv, f, nullptr),
        0);
    EXPECT_EQ(Raw(dqkv2, size_t(heads) * hd * 2), Raw(dqkv, size_t(heads) * hd * 2)) << "the rotated Q";
    EXPECT_EQ(Raw(dpool2, pool_elems * 2), Raw(dpool, pool_elems * 2)) << "the pool";
    int err = 0, err2 = 0;
    ASSERT_EQ(cudaMemcpy(&err, derr.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&err2, derr2.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(err2, err);
    EXPECT_EQ(err != 0, slot >= blocks * bs);
  }
}

// The greedy argmax (cuda_ops::LaunchArgmax) against the host sampler's
// greedy pick (SampleToken at temperature 0): NaN never chosen, +inf the
// largest, ties to the lowest id, a row of -inf or NaN gives 0; maxima
// planted at the edges of the CTAs' slices.
TEST_F(LtGemmTest, ArgmaxFollowsTheHostSamplersRule) {
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  auto host = [&](std::vector<float> row) { return SampleToken(row, greedy, {}, {}, {}, 0).token_id; };
  for (const int vocab : {128256, 1001, 31, 1}) {
    SCOPED_TRACE(::testing::Message() << "vocab " << vocab);
    const int slice = (vocab + cuda_ops::kArgmaxParts - 1) / cuda_ops::kArgmaxParts;
    std::mt19937 rng(vocab);
    std::normal_distribution<float> d(0.0f, 3.0f);
    std::vector<std::vector<float>> rows;
    auto random_row = [&] {
      std::vector<float> r(vocab);
      for (float& x : r) x = d(rng);
      return r;
    };
    for (int edge : {0, slice - 1, slice, vocab - 1, vocab / 2}) {  // a planted maximum
      std::vector<float> r = random_row();
      r[std::min(std::max(edge, 0), vocab - 1)] = 100.0f;
      rows.push_back(r);
    }
    {  // a tie across two slices: the lower id
      std::vector<float> r = random_row();
      r[std::min(vocab - 1, slice + 3)] = 50.0f;
      r[vocab - 1] = 50.0f;
      rows.push_back(r);
    }
    {  // NaN everywhere but one value, then +inf twice, then +inf after the largest float (they tie)
      std::vector<float> r(vocab, NAN);
      r[vocab / 3] = -5.0f;
      rows.push_back(r);
      r = random_row();
      r[vocab - 1] = INFINITY;
      r[vocab / 2] = INFINITY;
      rows.push_back(r);
      r = random_row();
      r[vocab - 1] = INFINITY;
      r[vocab / 2] = FLT_MAX;
      rows.push_back(r);
    }
    rows.push_back(std::vector<float>(vocab, -INFINITY));
    rows.push_back(std::vector<float>(vocab, NAN));
    {  // -0 and 0 tie
      std::vector<float> r(vocab, -1.0f);
      r[vocab - 1] = 0.0f;
      r[0] = -0.0f;
      rows.push_back(r);
    }
    for (int i = 0; i < 40; ++i) rows.push_back(random_row());
    const int n = static_cast<int>(rows.size());
    std::vector<float> flat;
    for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
    // Every row, asked for in reverse.
    std::vector<int> pick;
    for (int i = n - 1; i >= 0; --i) pick.push_back(i);
    const int m = static_cast<int>(pick.size());
    Device dl(flat.size() * 4), drows(pick.size() * 4), dws(cuda_ops::ArgmaxWorkspaceBytes(m)), dout(pick.size() * 4);
    ASSERT_EQ(cudaMemcpy(dl.p, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(drows.p, pick.data(), pick.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cuda_ops::LaunchArgmax(static_cast<const float*>(dl.p), static_cast<const int*>(drows.p), m, vocab, dws.p,
                                     static_cast<int32_t*>(dout.p), nullptr),
              0);
    std::vector<int32_t> got(pick.size());
    ASSERT_EQ(cudaMemcpy(got.data(), dout.p, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < m; ++i) EXPECT_EQ(got[i], host(rows[pick[i]])) << "row " << pick[i];
  }
}

}  // namespace
}  // namespace tandem::worker
