// Correctness of the CUDA kernels through the public API (kernels::PagedAttention
// with Backend::kCuda, kernels::WriteKvCache, cuda::TakeError), on cudaMalloc'd
// buffers, against a float64 reference computed on the host from the same
// bf16- (or f16-) rounded inputs.
//
// The error bound is FlashAttention's rule (shared/research/kernels.md B.3):
// our max error against the f64 reference is at most 2x the max error of a
// low-precision baseline against the same reference, plus a round-off floor.
// Here the baseline is a host-side emulation of a bf16 (f16) attention: scores
// in f32, the softmax in f32 with P rounded to the element type, P.V
// accumulated in f32, the output rounded to the element type. (The faithful
// version of the rule, with PyTorch's own bf16 scaled_dot_product_attention as
// the baseline, is kernels/cuda/check_attention.py on the GPU machine.)
//
// Without a usable GPU (CI: nvcc, no device) every test skips with the reason
// cuda::Available gives. Tests named Small* are the compute-sanitizer set
// (kernels/cuda/run_gpu_checks.sh).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/paged_attention.h"

namespace tandem::kernels {
namespace {

using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPU()                           \
  do {                                               \
    const char* why = nullptr;                       \
    if (!cuda::Available(&why)) GTEST_SKIP() << why; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// ---- Element conversion (host) -------------------------------------------

uint16_t ToBits(float x, DType t) {
  if (t == DType::kF16) {
    _Float16 h = static_cast<_Float16>(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float FromBits(uint16_t b, DType t) {
  if (t == DType::kF16) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return static_cast<float>(h);
  }
  uint32_t u = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

float Round(float x, DType t) { return FromBits(ToBits(x, t), t); }

// ---- Device buffers ---------------------------------------------------------

class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : bytes_(std::max<size_t>(bytes, 16)) {
    if (cudaMalloc(&p_, bytes_) != cudaSuccess) p_ = nullptr;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DevBuf() {
    if (p_ != nullptr) cudaFree(p_);
  }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
cudaError_t Upload(const DevBuf& d, const std::vector<T>& h) {
  return cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
}

// ---- Cases ------------------------------------------------------------------

struct Seq {
  int q_len;
  int ctx;
};

struct Case {
  std::vector<Seq> seqs;
  int num_kv_heads = 2;
  int group = 4;  // query heads per kv head
  int head_dim = 128;
  int block_size = 16;
  bool causal = true;
  DType dtype = DType::kBF16;
  uint32_t seed = 1;
  bool check_cpu = false;  // also run cpu::PagedAttention on the rounded floats
  int num_heads() const { return num_kv_heads * group; }
  std::string Describe() const {
    std::string s = absl::StrFormat("%s hd=%d bs=%d kvh=%d group=%d %s seqs=", DTypeName(dtype), head_dim, block_size,
                                    num_kv_heads, group, causal ? "causal" : "non-causal");
    for (size_t i = 0; i < seqs.size() && i < 12; ++i) absl::StrAppendFormat(&s, "(%d/%d)", seqs[i].q_len, seqs[i].ctx);
    if (seqs.size() > 12) absl::StrAppendFormat(&s, "... (%d sequences)", seqs.size());
    return s;
  }
};

// The inputs of a case, rounded to its element type and held as floats.
struct HostData {
  std::vector<int> query_start;          // [num_seqs + 1]
  std::vector<int> ctx;                  // [num_seqs]
  std::vector<std::vector<float>> k, v;  // per sequence [ctx][kv_head][dim]
  std::vector<float> q;                  // [tokens][head][dim]
  int num_tokens() const { return query_start.back(); }
};

HostData MakeData(const Case& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  HostData d;
  const int n = static_cast<int>(c.seqs.size());
  d.query_start.assign(n + 1, 0);
  for (int s = 0; s < n; ++s) {
    d.query_start[s + 1] = d.query_start[s] + c.seqs[s].q_len;
    d.ctx.push_back(c.seqs[s].ctx);
  }
  d.k.resize(n);
  d.v.resize(n);
  for (int s = 0; s < n; ++s) {
    d.k[s].resize(size_t(c.seqs[s].ctx) * c.num_kv_heads * c.head_dim);
    d.v[s].resize(d.k[s].size());
    for (float& x : d.k[s]) x = Round(nd(rng), c.dtype);
    for (float& x : d.v[s]) x = Round(nd(rng), c.dtype);
  }
  d.q.resize(size_t(d.num_tokens()) * c.num_heads() * c.head_dim);
  for (float& x : d.q) x = Round(nd(rng), c.dtype);
  return d;
}

// Runs fn(token) for every token on all host cores.
template <typename Fn>
void ParallelTokens(int num_tokens, Fn fn) {
  const int threads = std::max(1, std::min<int>(std::thread::hardware_concurrency(), num_tokens));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      for (int t = w; t < num_tokens; t += threads) fn(t);
    });
  }
  for (auto& th : pool) th.join();
}

// The f64 reference (`ref`) and the low-precision baseline (`base`, see the
// file comment), [tokens][heads][dim].
void References(const Case& c, const HostData& d, std::vector<double>& ref, std::vector<float>& base) {
  const int hd = c.head_dim, H = c.num_heads(), kvh = c.num_kv_heads;
  const double scale = 1.0 / std::sqrt(double(hd));
  const float scale_f = static_cast<float>(scale);
  ref.assign(d.q.size(), 0.0);
  base.assign(d.q.size(), 0.0f);
  std::vector<int> seq_of(d.num_tokens());
  for (size_t s = 0; s < c.seqs.size(); ++s)
    for (int t = d.query_start[s]; t < d.query_start[s + 1]; ++t) seq_of[t] = static_cast<int>(s);
  ParallelTokens(d.num_tokens(), [&](int tok) {
    const int s = seq_of[tok];
    const int ctx = d.ctx[s], q_len = c.seqs[s].q_len;
    const int pos = ctx - q_len + (tok - d.query_start[s]);
    const int n = c.causal ? pos + 1 : ctx;
    std::vector<double> sd(n);
    std::vector<float> sf(n);
    std::vector<double> od(hd);
    std::vector<float> of(hd);
    for (int h = 0; h < H; ++h) {
      const int g = h / c.group;
      const float* q = &d.q[(size_t(tok) * H + h) * hd];
      double mx = -1e300;
      float mxf = -INFINITY;
      for (int t = 0; t < n; ++t) {
        const float* k = &d.k[s][(size_t(t) * kvh + g) * hd];
        double a = 0;
        float af = 0;
        for (int e = 0; e < hd; ++e) {
          a += double(q[e]) * double(k[e]);
          af += q[e] * k[e];
        }
        sd[t] = a * scale;
        sf[t] = af * scale_f;
        mx = std::max(mx, sd[t]);
        mxf = std::max(mxf, sf[t]);
      }
      double sum = 0;
      float sumf = 0;
      for (int t = 0; t < n; ++t) {
        sum += (sd[t] = std::exp(sd[t] - mx));
        sumf += (sf[t] = std::exp(sf[t] - mxf));
      }
      std::fill(od.begin(), od.end(), 0.0);
      std::fill(of.begin(), of.end(), 0.0f);
      for (int t = 0; t < n; ++t) {
        const float* v = &d.v[s][(size_t(t) * kvh + g) * hd];
        const double p = sd[t] / sum;
        const float pf = Round(sf[t] / sumf, c.dtype);
        for (int e = 0; e < hd; ++e) {
          od[e] += p * v[e];
          of[e] += pf * v[e];
        }
      }
      for (int e = 0; e < hd; ++e) {
        ref[(size_t(tok) * H + h) * hd + e] = od[e];
        base[(size_t(tok) * H + h) * hd + e] = Round(of[e], c.dtype);
      }
    }
  });
}

// A paged pool on the device holding a case's K/V (written through
// WriteKvCache), with shuffled block tables.
struct DevicePool {
  KvLayout layout;
  int layer = 1;
  int max_blocks = 0;
  std::vector<int32_t> tables;  // [num_seqs][max_blocks]
  DevBuf cache;
  DevBuf tables_dev;
};

void BuildPool(const Case& c, const HostData& d, DevicePool& pool, void* workspace) {
  std::mt19937 rng(c.seed * 7919u + 17);
  const int n = static_cast<int>(c.seqs.size());
  int total = 0;
  for (int s = 0; s < n; ++s) {
    const int b = (d.ctx[s] + c.block_size - 1) / c.block_size;
    pool.max_blocks = std::max(pool.max_blocks, b);
    total += b;
  }
  pool.max_blocks += 1;  // a spare column, filled with an id no kernel may read
  pool.layout = KvLayout{.num_layers = 2,
                         .num_kv_heads = c.num_kv_heads,
                         .head_dim = c.head_dim,
                         .block_size = c.block_size,
                         .num_blocks = total + 5,
                         .dtype = c.dtype};
  std::vector<int32_t> perm(pool.layout.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  pool.tables.assign(size_t(n) * pool.max_blocks, static_cast<int32_t>(pool.layout.num_blocks + 1000));
  int next = 0;
  for (int s = 0; s < n; ++s)
    for (int b = 0; b < (d.ctx[s] + c.block_size - 1) / c.block_size; ++b)
      pool.tables[size_t(s) * pool.max_blocks + b] = perm[next++];
  pool.cache = DevBuf(pool.layout.total_bytes());
  ASSERT_NE(pool.cache.get(), nullptr);
  // NaN everywhere: a kernel that reads a slot no token was written to (the
  // tail of a partial last page, another layer) turns its output into NaN.
  CUDA_OK(cudaMemset(pool.cache.get(), 0xFF, pool.cache.bytes()));
  pool.tables_dev = DevBuf(pool.tables.size() * 4);
  CUDA_OK(Upload(pool.tables_dev, pool.tables));

  // Every token of every sequence through WriteKvCache, plus padded rows
  // (slot -1) holding garbage, which it must skip.
  const int kvh = c.num_kv_heads, hd = c.head_dim;
  const int row = kvh * hd + 8;  // a padded source stride
  std::vector<uint16_t> k_src, v_src;
  std::vector<int64_t> slots;
  auto push = [&](const float* k, const float* v, int64_t slot) {
    for (int i = 0; i < row; ++i) {
      k_src.push_back(i < kvh * hd && k != nullptr ? ToBits(k[i], c.dtype) : 0x7BFF);
      v_src.push_back(i < kvh * hd && v != nullptr ? ToBits(v[i], c.dtype) : 0x7BFF);
    }
    slots.push_back(slot);
  };
  for (int s = 0; s < n; ++s) {
    for (int t = 0; t < d.ctx[s]; ++t) {
      if (t % 97 == 5) push(nullptr, nullptr, -1);
      const int64_t slot =
          int64_t{pool.tables[size_t(s) * pool.max_blocks + t / c.block_size]} * c.block_size + t % c.block_size;
      push(&d.k[s][size_t(t) * kvh * hd], &d.v[s][size_t(t) * kvh * hd], slot);
    }
  }
  DevBuf k_dev(k_src.size() * 2), v_dev(v_src.size() * 2), slots_dev(slots.size() * 8);
  CUDA_OK(Upload(k_dev, k_src));
  CUDA_OK(Upload(v_dev, v_src));
  CUDA_OK(Upload(slots_dev, slots));
  WriteKvParams w{.backend = Backend::kCuda,
                  .k = k_dev.get(),
                  .v = v_dev.get(),
                  .src_stride_bytes = int64_t{row} * 2,
                  .slot_mapping = slots_dev.as<int64_t>(),
                  .num_tokens = static_cast<int>(slots.size()),
                  .layer = pool.layer,
                  .layout = pool.layout,
                  .kv_cache = pool.cache.get(),
                  .workspace = workspace};
  ASSERT_TRUE(WriteKvCache(w).ok());
  absl::Status err = cuda::TakeError(workspace, nullptr);
  ASSERT_TRUE(err.ok()) << err;
}

// Device inputs of one PagedAttention call.
struct DeviceCall {
  DevBuf q, out, query_start, ctx, workspace;
  int64_t q_stride_bytes = 0;
  int64_t workspace_bytes = 0;
};

void UploadCall(const Case& c, const HostData& d, DeviceCall& call) {
  const int H = c.num_heads(), hd = c.head_dim, tokens = d.num_tokens();
  // q rows padded by 16 bytes of NaN: a kernel reading past a row's heads
  // would show it.
  const int q_row = H * hd + 8;
  call.q_stride_bytes = int64_t{q_row} * 2;
  std::vector<uint16_t> q(size_t(std::max(tokens, 1)) * q_row, 0xFFFF);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < H * hd; ++i) q[size_t(t) * q_row + i] = ToBits(d.q[size_t(t) * H * hd + i], c.dtype);
  call.q = DevBuf(q.size() * 2);
  CUDA_OK(Upload(call.q, q));
  call.out = DevBuf(size_t(std::max(tokens, 1)) * H * hd * 2);
  call.query_start = DevBuf(d.query_start.size() * 4);
  CUDA_OK(Upload(call.query_start, d.query_start));
  call.ctx = DevBuf(std::max<size_t>(d.ctx.size(), 1) * 4);
  CUDA_OK(Upload(call.ctx, d.ctx));
  call.workspace_bytes = cuda::WorkspaceBytes(tokens, H, hd);
  call.workspace = DevBuf(call.workspace_bytes);
  CUDA_OK(cudaMemset(call.workspace.get(), 0, call.workspace.bytes()));
}

PagedAttentionParams ParamsOf(const Case& c, const HostData& d, const DevicePool& pool, const DeviceCall& call) {
  return PagedAttentionParams{.backend = Backend::kCuda,
                              .q = call.q.get(),
                              .q_stride_bytes = call.q_stride_bytes,
                              .out = call.out.get(),
                              .kv_cache = pool.cache.get(),
                              .layout = pool.layout,
                              .layer = pool.layer,
                              .num_heads = c.num_heads(),
                              .scale = 1.0f / std::sqrt(float(c.head_dim)),
                              .causal = c.causal,
                              .num_seqs = static_cast<int>(c.seqs.size()),
                              .query_start = call.query_start.as<int>(),
                              .context_lens = call.ctx.as<int>(),
                              .block_tables = pool.tables_dev.as<int32_t>(),
                              .max_blocks_per_seq = pool.max_blocks,
                              .host_query_start = d.query_start.data(),
                              .host_context_lens = d.ctx.data(),
                              .workspace = call.workspace.get(),
                              .workspace_bytes = call.workspace_bytes};
}

// Runs the call with the output poisoned (NaN) first; returns the output.
void RunPoisoned(const PagedAttentionParams& p, const DeviceCall& call, const Case& c, const HostData& d,
                 std::vector<float>& out, absl::Status* device_error) {
  CUDA_OK(cudaMemset(call.out.get(), 0xFF, call.out.bytes()));
  absl::Status st = PagedAttention(p);
  ASSERT_TRUE(st.ok()) << st;
  *device_error = cuda::TakeError(call.workspace.get(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> bits(size_t(d.num_tokens()) * c.num_heads() * c.head_dim);
  CUDA_OK(cudaMemcpy(bits.data(), call.out.get(), bits.size() * 2, cudaMemcpyDeviceToHost));
  out.resize(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = FromBits(bits[i], c.dtype);
}

// FlashAttention's round-off floor: twice the largest error of representing
// (ref + 0.3) - 0.3 in the element type.
double RoundoffFloor(const std::vector<double>& ref, DType t) {
  double m = 0;
  for (double r : ref) m = std::max(m, std::abs(double(Round(float(r + 0.3), t)) - 0.3 - r));
  return 2 * m;
}

struct Errors {
  double ours = 0, base = 0, floor = 0;
  size_t bad_elems = 0;  // non-finite
  size_t worst = 0;
};

Errors Compare(const std::vector<float>& out, const std::vector<double>& ref, const std::vector<float>& base, DType t) {
  Errors e;
  e.floor = RoundoffFloor(ref, t);
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++e.bad_elems;
      continue;
    }
    const double err = std::abs(out[i] - ref[i]);
    if (err > e.ours) {
      e.ours = err;
      e.worst = i;
    }
    e.base = std::max(e.base, std::abs(double(base[i]) - ref[i]));
  }
  return e;
}

// The f32 CPU backend on the same rounded inputs (a second reference).
void RunCpu(const Case& c, const HostData& d, const DevicePool& pool, std::vector<float>& out) {
  KvLayout L = pool.layout;
  L.dtype = DType::kF32;
  std::vector<float> cache(L.total_elems(), std::nanf(""));
  const int kvh = c.num_kv_heads, hd = c.head_dim;
  for (size_t s = 0; s < c.seqs.size(); ++s)
    for (int t = 0; t < d.ctx[s]; ++t)
      for (int h = 0; h < kvh; ++h)
        for (int kv = 0; kv < 2; ++kv) {
          const float* src = &(kv ? d.v : d.k)[s][(size_t(t) * kvh + h) * hd];
          const int32_t b = pool.tables[s * pool.max_blocks + t / c.block_size];
          std::copy(src, src + hd, &cache[L.OffsetElems(b, pool.layer, kv, h, t % c.block_size)]);
        }
  out.assign(d.q.size(), std::nanf(""));
  PagedAttentionParams p{.backend = Backend::kCpu,
                         .q = d.q.data(),
                         .q_stride_bytes = int64_t{c.num_heads()} * hd * 4,
                         .out = out.data(),
                         .kv_cache = cache.data(),
                         .layout = L,
                         .layer = pool.layer,
                         .num_heads = c.num_heads(),
                         .scale = 1.0f / std::sqrt(float(hd)),
                         .causal = c.causal,
                         .num_seqs = static_cast<int>(c.seqs.size()),
                         .query_start = d.query_start.data(),
                         .context_lens = d.ctx.data(),
                         .block_tables = pool.tables.data(),
                         .max_blocks_per_seq = pool.max_blocks};
  absl::Status st = PagedAttention(p);
  ASSERT_TRUE(st.ok()) << st;
}

// The whole check of one case.
void RunCase(const Case& c) {
  SCOPED_TRACE(c.Describe());
  const HostData d = MakeData(c);
  DeviceCall call;
  ASSERT_NO_FATAL_FAILURE(UploadCall(c, d, call));
  DevicePool pool;
  ASSERT_NO_FATAL_FAILURE(BuildPool(c, d, pool, call.workspace.get()));
  std::vector<float> out;
  absl::Status device_error;
  ASSERT_NO_FATAL_FAILURE(RunPoisoned(ParamsOf(c, d, pool, call), call, c, d, out, &device_error));
  EXPECT_TRUE(device_error.ok()) << device_error;
  std::vector<double> ref;
  std::vector<float> base;
  References(c, d, ref, base);
  const Errors e = Compare(out, ref, base, c.dtype);
  EXPECT_EQ(e.bad_elems, 0u) << "non-finite outputs (NaN poison left, or a NaN pool slot read)";
  EXPECT_LE(e.ours, 2 * e.base + e.floor)
      << "max error " << e.ours << " at element " << e.worst << " (token "
      << e.worst / (size_t(c.num_heads()) * c.head_dim) << "), baseline " << e.base << ", floor " << e.floor;
  if (c.check_cpu) {
    std::vector<float> cpu_out;
    ASSERT_NO_FATAL_FAILURE(RunCpu(c, d, pool, cpu_out));
    double cpu_err = 0, vs_cpu = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      cpu_err = std::max(cpu_err, std::abs(cpu_out[i] - ref[i]));
      vs_cpu = std::max(vs_cpu, double(std::abs(out[i] - cpu_out[i])));
    }
    EXPECT_LT(cpu_err, 1e-4) << "the CPU backend against the f64 reference";
    EXPECT_LE(vs_cpu, 2 * e.base + e.floor + cpu_err) << "ours against the CPU backend";
  }
}

// A ragged batch mixing prefill, chunked prefill over a prefix and decode,
// with contexts 1, block-1, block, block+1 and ~1k, and an idle sequence.
std::vector<Seq> MixedBatch(int bs) {
  return {{1, 1},    {bs - 1, bs - 1}, {1, bs},          {3, bs + 1}, {37, 300},
          {1, 1000}, {0, 50},          {bs + 1, bs + 1}, {5, 1030},   {1, bs - 1}};
}

// ---- The matrix ---------------------------------------------------------------

using MatrixParam = std::tuple<int /*block*/, int /*group*/, int /*head_dim*/>;

class CudaAttentionMatrix : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(CudaAttentionMatrix, MixedBatchBf16) {
  SKIP_WITHOUT_GPU();
  const auto [bs, group, hd] = GetParam();
  Case c{.seqs = MixedBatch(bs),
         .group = group,
         .head_dim = hd,
         .block_size = bs,
         .seed = static_cast<uint32_t>(bs * 1000 + group * 10 + hd)};
  c.check_cpu = group == 4;
  RunCase(c);
}

INSTANTIATE_TEST_SUITE_P(All, CudaAttentionMatrix,
                         ::testing::Combine(::testing::Values(16, 32, 64), ::testing::Values(1, 3, 4, 8),
                                            ::testing::Values(64, 128, 80, 96)),
                         [](const ::testing::TestParamInfo<MatrixParam>& i) {
                           return absl::StrFormat("bs%d_g%d_hd%d", std::get<0>(i.param), std::get<1>(i.param),
                                                  std::get<2>(i.param));
                         });

TEST(CudaAttentionTest, MixedBatchF16) {
  SKIP_WITHOUT_GPU();
  for (int bs : {16, 32, 64})
    for (int hd : {64, 128}) {
      RunCase({.seqs = MixedBatch(bs),
               .group = 5,
               .head_dim = hd,
               .block_size = bs,
               .dtype = DType::kF16,
               .seed = static_cast<uint32_t>(7 + bs + hd)});
    }
}

TEST(CudaAttentionTest, NonCausalMixedBatch) {
  SKIP_WITHOUT_GPU();
  for (int hd : {128, 64, 80}) {
    RunCase({.seqs = MixedBatch(32),
             .group = 4,
             .head_dim = hd,
             .block_size = 32,
             .causal = false,
             .seed = static_cast<uint32_t>(100 + hd),
             .check_cpu = hd == 128});
  }
  RunCase({.seqs = MixedBatch(16),
           .group = 8,
           .head_dim = 128,
           .block_size = 16,
           .causal = false,
           .dtype = DType::kF16,
           .seed = 5});
}

TEST(CudaAttentionTest, LongContexts) {
  SKIP_WITHOUT_GPU();
  // 8k and 32k decode, a 64-query chunk over an 8k prefix, at Llama-3-8B's
  // head counts (8 kv heads x 4; here 4 x 8 to keep the host reference short).
  for (int bs : {16, 64}) {
    RunCase({.seqs = {{1, 8192}, {1, 32768}, {64, 8192}, {1, 8191}, {2, 1025}},
             .num_kv_heads = 4,
             .group = 8,
             .head_dim = 128,
             .block_size = bs,
             .seed = static_cast<uint32_t>(bs)});
  }
  RunCase({.seqs = {{1, 8193}, {16, 8192}},
           .num_kv_heads = 2,
           .group = 8,
           .head_dim = 64,
           .block_size = 32,
           .causal = false,
           .seed = 3});
}

TEST(CudaAttentionTest, ManyTokensInOneCall) {
  SKIP_WITHOUT_GPU();
  // More query tokens than a grid's y/z dimension holds (65535): 70000
  // decode sequences of contexts 1..3.
  Case c{.num_kv_heads = 1, .group = 2, .head_dim = 64, .block_size = 16, .seed = 9};
  for (int s = 0; s < 70000; ++s) c.seqs.push_back({1, 1 + s % 3});
  RunCase(c);
}

// ---- Small cases (also the compute-sanitizer set) --------------------------

TEST(CudaAttentionTest, SmallMixedBatch) {
  SKIP_WITHOUT_GPU();
  RunCase({.seqs = {{5, 5}, {1, 17}, {3, 40}, {0, 8}, {1, 1}},
           .group = 4,
           .head_dim = 64,
           .block_size = 16,
           .seed = 11,
           .check_cpu = true});
  RunCase({.seqs = {{4, 20}, {1, 33}}, .group = 3, .head_dim = 80, .block_size = 16, .dtype = DType::kF16, .seed = 12});
  RunCase({.seqs = {{6, 6}, {1, 70}}, .group = 1, .head_dim = 128, .block_size = 64, .causal = false, .seed = 13});
}

TEST(CudaAttentionTest, SmallPrefillTiles) {
  SKIP_WITHOUT_GPU();
  // More than one 128-row query tile and 128-key tile, a cached prefix, TMA
  // pages after the first (partial) key tile, both head dims.
  RunCase({.seqs = {{130, 300}, {200, 200}, {1, 90}},
           .group = 2,
           .head_dim = 128,
           .block_size = 16,
           .seed = 15,
           .check_cpu = true});
  RunCase({.seqs = {{70, 500}, {129, 129}}, .group = 4, .head_dim = 64, .block_size = 64, .causal = false, .seed = 16});
}

TEST(CudaAttentionTest, SmallLongKeyTiles) {
  SKIP_WITHOUT_GPU();
  // Non-causal at head_dim 128 from 8192 keys: 176-key tiles, loaded as
  // pieces of pages (16-64 keys each at pages of 64), one Q buffer; pages of
  // 16 take the lazy rescale as well.
  RunCase({.seqs = {{3, 8300}, {1, 9000}, {130, 8192}},
           .group = 2,
           .head_dim = 128,
           .block_size = 64,
           .causal = false,
           .seed = 17});
  RunCase({.seqs = {{2, 8200}, {1, 33}},
           .group = 4,
           .head_dim = 128,
           .block_size = 16,
           .causal = false,
           .dtype = DType::kF16,
           .seed = 18});
}

TEST(CudaAttentionTest, SmallSplitKv) {
  SKIP_WITHOUT_GPU();
  // Long enough for several KV splits and their merge.
  RunCase(
      {.seqs = {{1, 700}, {2, 1500}}, .num_kv_heads = 1, .group = 8, .head_dim = 128, .block_size = 32, .seed = 14});
}

TEST(CudaAttentionTest, SmallRepeatedCallsOnOneWorkspaceGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  // The persistent kernels keep a work counter (prefill, split-KV) and
  // per-row arrival counters (split-KV) in the workspace and leave them at
  // zero: every call on the same workspace, whichever kernel ran before,
  // gives the same bits, and the workspace's head is zero after.
  Case c{
      .seqs = {{130, 300}, {1, 1500}, {1, 700}, {2, 900}}, .group = 4, .head_dim = 128, .block_size = 16, .seed = 21};
  const HostData d = MakeData(c);
  DeviceCall call;
  ASSERT_NO_FATAL_FAILURE(UploadCall(c, d, call));
  DevicePool pool;
  ASSERT_NO_FATAL_FAILURE(BuildPool(c, d, pool, call.workspace.get()));
  struct Mode {
    AttentionKernel kernel;
    int keys_per_split;
  };
  for (const Mode m : {Mode{AttentionKernel::kPrefill, 0}, Mode{AttentionKernel::kSplitKv, 0},
                       Mode{AttentionKernel::kSplitKv, 512}, Mode{AttentionKernel::kPrefill, 0}}) {
    SCOPED_TRACE(absl::StrFormat("kernel %d, keys_per_split %d", static_cast<int>(m.kernel), m.keys_per_split));
    PagedAttentionParams p = ParamsOf(c, d, pool, call);
    p.kernel = m.kernel;
    p.keys_per_split = m.keys_per_split;
    if (m.keys_per_split > 0) {
      ASSERT_LE(cuda::FixedSplitWorkspaceBytes(d.num_tokens(), c.num_heads(), c.head_dim, 1500, m.keys_per_split),
                call.workspace_bytes);
    }
    std::vector<float> first;
    for (int i = 0; i < 3; ++i) {
      std::vector<float> out;
      absl::Status device_error;
      ASSERT_NO_FATAL_FAILURE(RunPoisoned(p, call, c, d, out, &device_error));
      EXPECT_TRUE(device_error.ok()) << device_error;
      if (i == 0) {
        first = out;
      } else {
        EXPECT_TRUE(std::memcmp(out.data(), first.data(), out.size() * sizeof(float)) == 0) << "call " << i;
      }
    }
    std::vector<uint8_t> head(cuda::kErrorWordBytes);
    CUDA_OK(cudaMemcpy(head.data(), call.workspace.get(), head.size(), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::all_of(head.begin(), head.end(), [](uint8_t b) { return b == 0; }));
  }
}

TEST(CudaAttentionTest, SmallWriteKvRoundTrip) {
  SKIP_WITHOUT_GPU();
  // Every written row lands in its slot, layer and K|V half, bit for bit;
  // the rest of the pool is untouched.
  KvLayout L{
      .num_layers = 2, .num_kv_heads = 3, .head_dim = 96, .block_size = 16, .num_blocks = 6, .dtype = DType::kBF16};
  const int tokens = 20, row = 3 * 96;
  std::vector<uint16_t> k(tokens * row), v(tokens * row);
  std::mt19937 rng(3);
  for (auto& x : k) x = static_cast<uint16_t>(rng() & 0x3FFF);
  for (auto& x : v) x = static_cast<uint16_t>(rng() & 0x3FFF);
  std::vector<int64_t> slots(tokens);
  for (int t = 0; t < tokens; ++t) slots[t] = (t % 3 == 2) ? -1 : (5 - t % 6) * 16 + (t * 7) % 16;
  DevBuf kd(k.size() * 2), vd(v.size() * 2), sd(slots.size() * 8), cache(L.total_bytes()), ws(cuda::kErrorWordBytes);
  CUDA_OK(Upload(kd, k));
  CUDA_OK(Upload(vd, v));
  CUDA_OK(Upload(sd, slots));
  CUDA_OK(cudaMemset(cache.get(), 0x11, cache.bytes()));
  CUDA_OK(cudaMemset(ws.get(), 0, ws.bytes()));
  WriteKvParams w{.backend = Backend::kCuda,
                  .k = kd.get(),
                  .v = vd.get(),
                  .src_stride_bytes = row * 2,
                  .slot_mapping = sd.as<int64_t>(),
                  .num_tokens = tokens,
                  .layer = 1,
                  .layout = L,
                  .kv_cache = cache.get(),
                  .workspace = ws.get()};
  ASSERT_TRUE(WriteKvCache(w).ok());
  ASSERT_TRUE(cuda::TakeError(ws.get(), nullptr).ok());
  std::vector<uint16_t> got(L.total_elems());
  CUDA_OK(cudaMemcpy(got.data(), cache.get(), cache.bytes(), cudaMemcpyDeviceToHost));
  std::vector<uint16_t> want(L.total_elems(), 0x1111);
  for (int t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int h = 0; h < 3; ++h)
      for (int e = 0; e < 96; ++e) {
        want[L.OffsetElems(slots[t] / 16, 1, 0, h, slots[t] % 16) + e] = k[t * row + h * 96 + e];
        want[L.OffsetElems(slots[t] / 16, 1, 1, h, slots[t] % 16) + e] = v[t * row + h * 96 + e];
      }
  }
  size_t diff = 0;
  for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
  EXPECT_EQ(diff, 0u);
}

// ---- Bad parameters -------------------------------------------------------------

TEST(CudaAttentionTest, SmallWriteKvSlotOutOfRange) {
  SKIP_WITHOUT_GPU();
  KvLayout L{
      .num_layers = 1, .num_kv_heads = 1, .head_dim = 64, .block_size = 16, .num_blocks = 2, .dtype = DType::kBF16};
  const int tokens = 4;
  std::vector<uint16_t> k(tokens * 64, 0x3F80), v(tokens * 64, 0x4000);  // 1.0, 2.0
  std::vector<int64_t> slots = {0, 31, 32 + 3, 1};                       // token 2 is past the pool (2 blocks of 16)
  DevBuf kd(k.size() * 2), vd(v.size() * 2), sd(slots.size() * 8), cache(L.total_bytes()), ws(cuda::kErrorWordBytes);
  CUDA_OK(Upload(kd, k));
  CUDA_OK(Upload(vd, v));
  CUDA_OK(Upload(sd, slots));
  CUDA_OK(cudaMemset(cache.get(), 0, cache.bytes()));
  CUDA_OK(cudaMemset(ws.get(), 0, ws.bytes()));
  WriteKvParams w{.backend = Backend::kCuda,
                  .k = kd.get(),
                  .v = vd.get(),
                  .src_stride_bytes = 128,
                  .slot_mapping = sd.as<int64_t>(),
                  .num_tokens = tokens,
                  .layer = 0,
                  .layout = L,
                  .kv_cache = cache.get(),
                  .workspace = ws.get()};
  ASSERT_TRUE(WriteKvCache(w).ok());
  absl::Status st = cuda::TakeError(ws.get(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("token 2"));
  EXPECT_TRUE(cuda::TakeError(ws.get(), nullptr).ok()) << "TakeError clears the word";
  std::vector<uint16_t> got(L.total_elems());
  CUDA_OK(cudaMemcpy(got.data(), cache.get(), cache.bytes(), cudaMemcpyDeviceToHost));
  for (int64_t slot : {0, 31, 1}) {
    EXPECT_EQ(got[L.OffsetElems(slot / 16, 0, 0, 0, slot % 16)], 0x3F80) << slot;
    EXPECT_EQ(got[L.OffsetElems(slot / 16, 0, 1, 0, slot % 16) + 63], 0x4000) << slot;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A block id outside the pool in one sequence's table: InvalidArgument naming
// that sequence, its rows (those that reach the bad block) all zeros, the
// other sequences' rows correct, no fault.
void RunBadBlockCase(const Case& c, int bad_seq, int bad_block_index, int32_t bad_id_offset) {
  SCOPED_TRACE(c.Describe());
  const HostData d = MakeData(c);
  DeviceCall call;
  ASSERT_NO_FATAL_FAILURE(UploadCall(c, d, call));
  DevicePool pool;
  ASSERT_NO_FATAL_FAILURE(BuildPool(c, d, pool, call.workspace.get()));
  pool.tables[size_t(bad_seq) * pool.max_blocks + bad_block_index] =
      bad_id_offset < 0 ? bad_id_offset : static_cast<int32_t>(pool.layout.num_blocks + bad_id_offset);
  CUDA_OK(Upload(pool.tables_dev, pool.tables));
  std::vector<float> out;
  absl::Status device_error;
  ASSERT_NO_FATAL_FAILURE(RunPoisoned(ParamsOf(c, d, pool, call), call, c, d, out, &device_error));
  EXPECT_EQ(device_error.code(), absl::StatusCode::kInvalidArgument) << device_error;
  EXPECT_THAT(device_error.message(), HasSubstr(absl::StrFormat("sequence %d", bad_seq)));
  std::vector<double> ref;
  std::vector<float> base;
  References(c, d, ref, base);
  const size_t row = size_t(c.num_heads()) * c.head_dim;
  std::vector<float> out_ok, base_ok;
  std::vector<double> ref_ok;
  size_t nonzero_bad = 0, bad_rows = 0;
  for (int s = 0; s < static_cast<int>(c.seqs.size()); ++s) {
    for (int t = d.query_start[s]; t < d.query_start[s + 1]; ++t) {
      const int pos = d.ctx[s] - c.seqs[s].q_len + (t - d.query_start[s]);
      const int last_key = c.causal ? pos : d.ctx[s] - 1;
      const bool reaches = s == bad_seq && last_key / c.block_size >= bad_block_index;
      for (size_t i = t * row; i < (t + 1) * row; ++i) {
        if (reaches) {
          nonzero_bad += out[i] != 0.0f;
        } else {
          out_ok.push_back(out[i]);
          ref_ok.push_back(ref[i]);
          base_ok.push_back(base[i]);
        }
      }
      bad_rows += reaches;
    }
  }
  EXPECT_GT(bad_rows, 0u);
  EXPECT_EQ(nonzero_bad, 0u) << "elements of the bad sequence's rows that are not zero";
  const Errors e = Compare(out_ok, ref_ok, base_ok, c.dtype);
  EXPECT_EQ(e.bad_elems, 0u);
  EXPECT_LE(e.ours, 2 * e.base + e.floor) << "the other sequences";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaAttentionTest, SmallBadBlockId) {
  SKIP_WITHOUT_GPU();
  // One split per row: the bad id past the pool in the middle sequence's
  // first block, then a negative id in the last sequence's last block.
  RunBadBlockCase({.seqs = {{4, 40}, {3, 60}, {1, 100}}, .group = 2, .head_dim = 64, .block_size = 16, .seed = 21}, 1,
                  0, 5);
  RunBadBlockCase({.seqs = {{4, 40}, {3, 60}, {1, 100}}, .group = 2, .head_dim = 64, .block_size = 16, .seed = 22}, 2,
                  6, -1);
  // A 150-token prefill (two query tiles) with a bad id at block 5 (keys
  // 80-95): rows 0-79 computed, the rest zero.
  RunBadBlockCase({.seqs = {{150, 150}, {20, 300}}, .group = 1, .head_dim = 128, .block_size = 16, .seed = 23}, 0, 5,
                  3);
  // Non-causal past 8192 keys (176-key tiles): every row of the sequence
  // reaches the bad block, the other sequence is right.
  RunBadBlockCase(
      {.seqs = {{2, 9000}, {3, 8500}}, .group = 2, .head_dim = 128, .block_size = 32, .causal = false, .seed = 24}, 1,
      70, 2);
}

TEST(CudaAttentionTest, BadBlockIdWithSplitKv) {
  SKIP_WITHOUT_GPU();
  // Long enough that the rows are split over several CTAs: only the split
  // holding block 0 sees the bad id; the rows must still come out zeros.
  RunBadBlockCase({.seqs = {{2, 64}, {3, 4000}, {1, 100}}, .group = 4, .head_dim = 128, .block_size = 16, .seed = 23},
                  1, 0, 1);
}

// More (token, KV head) units than the persistent decode grid's CTAs (two
// an SM): CTAs take several items each from the work counter, of ragged
// lengths (1 to 1500 keys). The bad-block run puts a bad id in the middle
// of the last unit's keys (block 60 of 88): the decode kernel checks ids
// tile by tile as it loads, so tiles before it were already read, and the
// rows must still come out zeros.
Case WiderThanTheGrid(uint32_t seed) {
  Case c{.num_kv_heads = 2, .group = 4, .head_dim = 128, .block_size = 16, .seed = seed};
  for (int s = 0; s < 300; ++s) c.seqs.push_back({1, 1 + (s * 37) % 1500});
  c.seqs.back().ctx = 1400;
  return c;
}

TEST(CudaAttentionTest, DecodeBatchWiderThanTheGrid) {
  SKIP_WITHOUT_GPU();
  RunCase(WiderThanTheGrid(41));
}

TEST(CudaAttentionTest, BadBlockIdMidItemInAWideDecodeBatch) {
  SKIP_WITHOUT_GPU();
  RunBadBlockCase(WiderThanTheGrid(42), 299, 60, 7);
}

// Host-checked parameter errors: each a clear InvalidArgument, nothing launched.
class CudaBadParams : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* why = nullptr;
    if (!cuda::Available(&why)) GTEST_SKIP() << why;
    c_ = Case{.seqs = {{2, 10}, {1, 3000}}, .group = 4, .head_dim = 64, .block_size = 16, .seed = 31};
    d_ = MakeData(c_);
    ASSERT_NO_FATAL_FAILURE(UploadCall(c_, d_, call_));
    ASSERT_NO_FATAL_FAILURE(BuildPool(c_, d_, pool_, call_.workspace.get()));
    p_ = ParamsOf(c_, d_, pool_, call_);
    ASSERT_TRUE(PagedAttention(p_).ok());
    ASSERT_TRUE(cuda::TakeError(call_.workspace.get(), nullptr).ok());
  }
  void ExpectInvalid(const PagedAttentionParams& p, const std::string& substr) {
    absl::Status st = PagedAttention(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(substr));
    EXPECT_TRUE(cuda::TakeError(call_.workspace.get(), nullptr).ok());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  Case c_;
  HostData d_;
  DeviceCall call_;
  DevicePool pool_;
  PagedAttentionParams p_;
};

TEST_F(CudaBadParams, QueriesLongerThanContext) {
  std::vector<int> ctx = {1, 3000};  // sequence 0 has 2 queries
  PagedAttentionParams p = p_;
  p.host_context_lens = ctx.data();
  ExpectInvalid(p, "sequence 0 has 2 queries but context 1");
}

TEST_F(CudaBadParams, UnsupportedHeadDim) {
  for (int hd : {100, 512, 4}) {
    PagedAttentionParams p = p_;
    p.layout.head_dim = hd;
    ExpectInvalid(p, absl::StrFormat("head_dim %d is not supported", hd));
    WriteKvParams w{.backend = Backend::kCuda,
                    .k = call_.q.get(),
                    .v = call_.q.get(),
                    .src_stride_bytes = 4096,
                    .slot_mapping = reinterpret_cast<const int64_t*>(call_.query_start.get()),
                    .num_tokens = 1,
                    .layout = p.layout,
                    .kv_cache = pool_.cache.get(),
                    .workspace = call_.workspace.get()};
    absl::Status st = WriteKvCache(w);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("not supported"));
  }
}

TEST_F(CudaBadParams, Float32) {
  PagedAttentionParams p = p_;
  p.layout.dtype = DType::kF32;
  ExpectInvalid(p, "bfloat16 or float16");
}

TEST_F(CudaBadParams, WorkspaceTooSmall) {
  // Less than the error word is refused.
  PagedAttentionParams p = p_;
  p.workspace_bytes = cuda::kErrorWordBytes - 16;
  ExpectInvalid(p, "workspace holds 240 bytes");
  // The error word alone: the 3000-token row is not split (no room for
  // partials), and the call still succeeds.
  p.workspace_bytes = cuda::kErrorWordBytes;
  EXPECT_TRUE(PagedAttention(p).ok());
  EXPECT_TRUE(cuda::TakeError(call_.workspace.get(), nullptr).ok());
}

TEST_F(CudaBadParams, MisalignedPointers) {
  PagedAttentionParams p = p_;
  p.q = call_.q.as<char>() + 2;
  ExpectInvalid(p, "16-byte aligned");
  p = p_;
  p.out = call_.out.as<char>() + 2;
  ExpectInvalid(p, "16-byte aligned");
  p = p_;
  p.kv_cache = pool_.cache.as<char>() + 8;
  ExpectInvalid(p, "16-byte aligned");
  p = p_;
  p.q_stride_bytes += 2;
  ExpectInvalid(p, "16-byte aligned");
}

TEST_F(CudaBadParams, BlockTableTooShortAndGqaMismatch) {
  PagedAttentionParams p = p_;
  p.max_blocks_per_seq = 3;
  ExpectInvalid(p, "sequence 1 needs 188 blocks");
  p = p_;
  p.num_heads = 7;
  ExpectInvalid(p, "not a multiple of 2 kv heads");
  p = p_;
  p.num_heads = 2 * 40000;  // a multiple of the 2 kv heads, past the grid's 65535
  ExpectInvalid(p, "at most 65535");
}

}  // namespace
}  // namespace tandem::kernels
