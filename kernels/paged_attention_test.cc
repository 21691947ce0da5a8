#include "kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

struct Case {
  int num_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> q_lens, ctx_lens;
  bool causal = true;
};

// Straightforward float64 attention over dense K/V, the independent reference.
void ReferenceAttention(const Case& c, const std::vector<std::vector<float>>& k,
                        const std::vector<std::vector<float>>& v, const std::vector<float>& q,
                        const std::vector<int>& qs, std::vector<double>& out) {
  const int hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  out.assign(q.size(), 0.0);
  for (size_t s = 0; s < c.q_lens.size(); ++s) {
    for (int i = 0; i < c.q_lens[s]; ++i) {
      int pos = c.ctx_lens[s] - c.q_lens[s] + i;
      int tok = qs[s] + i;
      for (int h = 0; h < c.num_heads; ++h) {
        int kvh = h / group;
        const int last = c.causal ? pos : c.ctx_lens[s] - 1;
        std::vector<double> sc(last + 1);
        double mx = -1e300;
        for (int t = 0; t <= last; ++t) {
          double d = 0;
          for (int e = 0; e < hd; ++e)
            d +=
                double(q[(size_t(tok) * c.num_heads + h) * hd + e]) * k[s][(size_t(t) * c.num_kv_heads + kvh) * hd + e];
          sc[t] = d / std::sqrt(double(hd));
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - mx));
        for (int t = 0; t <= last; ++t)
          for (int e = 0; e < hd; ++e)
            out[(size_t(tok) * c.num_heads + h) * hd + e] +=
                sc[t] / sum * v[s][(size_t(t) * c.num_kv_heads + kvh) * hd + e];
      }
    }
  }
}

void RunCase(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hd = c.head_dim, num_seqs = static_cast<int>(c.q_lens.size());
  KvLayout layout{
      .num_layers = 2, .num_kv_heads = c.num_kv_heads, .head_dim = hd, .block_size = c.block_size, .num_blocks = 0};
  int max_blocks = 0, total_blocks = 0;
  for (int ctx : c.ctx_lens) {
    int b = (ctx + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, b);
    total_blocks += b;
  }
  layout.num_blocks = total_blocks + 3;
  // Scatter each sequence's blocks over the pool in a random order.
  std::vector<int32_t> perm(layout.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(num_seqs) * std::max(max_blocks, 1), -1);
  int next = 0;
  for (int s = 0; s < num_seqs; ++s)
    for (int b = 0; b < (c.ctx_lens[s] + c.block_size - 1) / c.block_size; ++b)
      tables[size_t(s) * max_blocks + b] = perm[next++];
  std::vector<float> cache(layout.total_elems(), std::nanf(""));

  std::vector<std::vector<float>> k(num_seqs), v(num_seqs);
  std::vector<int> qs(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) qs[s + 1] = qs[s] + c.q_lens[s];
  std::vector<float> q(static_cast<size_t>(qs[num_seqs]) * c.num_heads * hd);
  for (float& x : q) x = nd(rng);
  const int layer = 1;
  for (int s = 0; s < num_seqs; ++s) {
    int ctx = c.ctx_lens[s];
    k[s].resize(size_t(ctx) * c.num_kv_heads * hd);
    v[s].resize(k[s].size());
    for (float& x : k[s]) x = nd(rng);
    for (float& x : v[s]) x = nd(rng);
    std::vector<int64_t> slots(ctx);
    for (int t = 0; t < ctx; ++t)
      slots[t] = int64_t{tables[size_t(s) * max_blocks + t / c.block_size]} * c.block_size + t % c.block_size;
    WriteKvParams w{.k = k[s].data(),
                    .v = v[s].data(),
                    .src_stride_bytes = int64_t{c.num_kv_heads} * hd * 4,
                    .slot_mapping = slots.data(),
                    .num_tokens = ctx,
                    .layer = layer,
                    .layout = layout,
                    .kv_cache = cache.data()};
    ASSERT_TRUE(WriteKvCache(w).ok());
  }
  std::vector<float> out(q.size(), -1.0f);
  PagedAttentionParams p{.q = q.data(),
                         .q_stride_bytes = int64_t{c.num_heads} * hd * 4,
                         .out = out.data(),
                         .kv_cache = cache.data(),
                         .layout = layout,
                         .layer = layer,
                         .num_heads = c.num_heads,
                         .scale = 1.0f / std::sqrt(float(hd)),
                         .causal = c.causal,
                         .num_seqs = num_seqs,
                         .query_start = qs.data(),
                         .context_lens = c.ctx_lens.data(),
                         .block_tables = tables.data(),
                         .max_blocks_per_seq = max_blocks};
  ASSERT_TRUE(PagedAttention(p).ok());
  std::vector<double> ref;
  ReferenceAttention(c, k, v, q, qs, ref);
  double max_err = 0;
  for (size_t i = 0; i < out.size(); ++i) max_err = std::max(max_err, std::abs(out[i] - ref[i]));
  EXPECT_LT(max_err, 2e-5) << "seed " << seed;
}

TEST(PagedAttentionTest, DecodeBatchGqa) { RunCase({8, 2, 16, 16, {1, 1, 1}, {1, 17, 300}}, 1); }

TEST(PagedAttentionTest, PrefillFromEmptyCache) { RunCase({4, 4, 32, 16, {33, 5}, {33, 5}}, 2); }

TEST(PagedAttentionTest, ChunkedPrefillOverCachedPrefixAndMixedBatch) {
  // Ragged: a chunk over a 200-token prefix, a decode, a fresh prompt spanning
  // several query tiles, all in one call.
  RunCase({6, 2, 64, 16, {57, 1, 300}, {257, 40, 300}}, 3);
}

TEST(PagedAttentionTest, NonCausalSeesTheWholeContext) {
  Case c{4, 2, 32, 16, {40, 1, 130}, {40, 9, 200}};
  c.causal = false;
  RunCase(c, 6);
}

TEST(PagedAttentionTest, OddBlockSizes) {
  RunCase({4, 1, 8, 5, {9, 1}, {23, 11}}, 4);
  RunCase({2, 2, 16, 1, {3}, {7}}, 5);
}

TEST(PagedAttentionTest, RejectsBadBlockTable) {
  KvLayout layout{.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4, .num_blocks = 2};
  std::vector<float> cache(layout.total_elems()), q(4), out(4);
  int qs[] = {0, 1}, ctx[] = {3};
  int32_t table[] = {5};
  PagedAttentionParams p{.q = q.data(),
                         .q_stride_bytes = 16,
                         .out = out.data(),
                         .kv_cache = cache.data(),
                         .layout = layout,
                         .layer = 0,
                         .num_heads = 1,
                         .scale = 1,
                         .num_seqs = 1,
                         .query_start = qs,
                         .context_lens = ctx,
                         .block_tables = table,
                         .max_blocks_per_seq = 1};
  absl::Status st = PagedAttention(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  ctx[0] = 0;  // fewer keys than queries
  table[0] = 0;
  EXPECT_EQ(PagedAttention(p).code(), absl::StatusCode::kInvalidArgument);
  // The CPU kernels take float32 only; a bf16 pool is refused, not misread.
  ctx[0] = 3;
  ASSERT_TRUE(PagedAttention(p).ok());
  // A scale that is not finite and positive, on either backend.
  for (float scale : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    PagedAttentionParams bad = p;
    bad.scale = scale;
    absl::Status st_scale = PagedAttention(bad);
    EXPECT_EQ(st_scale.code(), absl::StatusCode::kInvalidArgument) << scale;
    EXPECT_NE(st_scale.message().find("finite and positive"), std::string::npos) << st_scale;
  }
  p.layout.dtype = DType::kBF16;
  absl::Status bf16 = PagedAttention(p);
  EXPECT_EQ(bf16.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bf16.message().find("bfloat16"), std::string::npos) << bf16;
}

// The run-time dispatch: a CUDA call where no CUDA device (or no CUDA build)
// exists is a clear FailedPrecondition, never a fault.
TEST(PagedAttentionTest, CudaBackendWithoutADeviceIsAClearError) {
  const char* why = nullptr;
  if (cuda::Available(&why)) GTEST_SKIP() << "a CUDA device is present (kernels/cuda tests cover it)";
  ASSERT_NE(why, nullptr);
  KvLayout layout{
      .num_layers = 1, .num_kv_heads = 1, .head_dim = 64, .block_size = 16, .num_blocks = 2, .dtype = DType::kBF16};
  int qs[] = {0, 1}, ctx[] = {1};
  int32_t table[] = {0};
  PagedAttentionParams p{.backend = Backend::kCuda,
                         .layout = layout,
                         .num_heads = 1,
                         .num_seqs = 1,
                         .query_start = qs,
                         .context_lens = ctx,
                         .block_tables = table,
                         .max_blocks_per_seq = 1};
  absl::Status st = PagedAttention(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(st.message(), why);
  WriteKvParams w{.backend = Backend::kCuda, .layout = layout};
  EXPECT_EQ(WriteKvCache(w).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::kernels
