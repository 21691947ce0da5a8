// The GPU sampler against the host sampler (SampleToken) on the same logits:
// the same token for every row, the same top alternatives, logprobs within
// the last bits of a log, and the logits left as the host reads them. Skips
// without a Hopper GPU.
#include "worker/runner/cuda/gpu_sampler.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/paged_attention.h"
#include "worker/runner/cuda/gpu_test_support.h"
#include "worker/sampling/sampler.h"

namespace tandem::worker {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// One row's logits: normal scores with ties, signed zeros and non-finite
// values sprinkled in (shape: a peaked or a flat distribution); a +inf in
// about a quarter of the rows when `with_inf`.
std::vector<float> RandomLogits(int vocab, std::mt19937& rng, float scale, bool with_inf = true) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(vocab));
  for (float& v : x) v = nd(rng);
  std::uniform_int_distribution<int> pick(0, vocab - 1);
  for (int k = 0; k < std::max(1, vocab / 500); ++k) {
    const int a = pick(rng), b = pick(rng);
    x[static_cast<size_t>(b)] = x[static_cast<size_t>(a)];  // a tie
    x[static_cast<size_t>(pick(rng))] = (k % 2 == 0) ? 0.0f : -0.0f;
  }
  if (vocab > 100) {
    x[static_cast<size_t>(pick(rng))] = std::numeric_limits<float>::quiet_NaN();
    x[static_cast<size_t>(pick(rng))] = -kInf;
    if (with_inf && rng() % 4 == 0) x[static_cast<size_t>(pick(rng))] = kInf;  // then it takes every draw
  }
  return x;
}

struct Case {
  SamplingParams params;
  std::vector<int> prompt, output;
  uint64_t seed = 0;
};

std::vector<Case> RandomCases(int n, int vocab, std::mt19937& rng) {
  std::vector<Case> cases;
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.6f};
  const int top_ks[] = {0, 0, 1, 5, 50, 1024, 2000};
  const float top_ps[] = {1.0f, 1.0f, 0.9f, 0.5f, 0.999f};
  const float min_ps[] = {0.0f, 0.0f, 0.05f, 0.3f};
  const int logprobs[] = {-1, -1, 0, 3, 20};
  for (int i = 0; i < n; ++i) {
    Case c;
    SamplingParams& p = c.params;
    p.temperature = temps[rng() % 5];
    p.top_k = top_ks[rng() % 7];
    p.top_p = top_ps[rng() % 5];
    p.min_p = min_ps[rng() % 4];
    p.logprobs = logprobs[rng() % 5];
    if (rng() % 3 == 0) p.repetition_penalty = (rng() % 2 == 0) ? 1.3f : 0.8f;
    if (rng() % 3 == 0) p.frequency_penalty = 0.5f;
    if (rng() % 3 == 0) p.presence_penalty = -0.7f;
    c.prompt.resize(static_cast<size_t>(rng() % 300));
    for (int& t : c.prompt) t = tok(rng);
    c.output.resize(static_cast<size_t>(rng() % 40));
    for (int& t : c.output) t = (rng() % 3 == 0 && !c.prompt.empty()) ? c.prompt[rng() % c.prompt.size()] : tok(rng);
    if (rng() % 4 == 0) {
      p.min_tokens = static_cast<int>(c.output.size()) + 1;
      p.stop_token_ids = {tok(rng), tok(rng)};
    }
    p.ignore_eos = rng() % 2 == 0;
    c.seed = rng();
    cases.push_back(std::move(c));
  }
  return cases;
}

class GpuSamplerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (SkipWithoutGpu()) GTEST_SKIP();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (d_logits_ != nullptr) cudaFree(d_logits_);
  }

  // Samples every case on the GPU (the rows the first pass leaves in the
  // full pass) and checks each against SampleToken on the original row.
  // Returns how many rows took the full pass.
  int SampleAndCompare(const std::vector<std::vector<float>>& logits, const std::vector<Case>& cases, int vocab,
                       const std::vector<int>& eos) {
    const size_t rows = cases.size();
    std::vector<float> flat;
    for (const auto& row : logits) flat.insert(flat.end(), row.begin(), row.end());
    if (d_logits_ != nullptr) cudaFree(d_logits_);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_logits_), flat.size() * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d_logits_, flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<RowSampling> rs;
    std::vector<int> which;
    for (size_t i = 0; i < rows; ++i) {
      rs.push_back(
          {.params = &cases[i].params, .prompt = cases[i].prompt, .output = cases[i].output, .seed = cases[i].seed});
      which.push_back(static_cast<int>(i));
    }
    GpuSampler sampler;
    std::vector<SampledToken> got(rows);
    for (SampledToken& t : got) t.token_id = -1;
    absl::Status st = sampler.Enqueue(d_logits_, vocab, rs, which, eos, stream_);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    int full_rows = 0;
    if (sampler.Finish(rs, &got)) {
      for (const SampledToken& t : got) full_rows += t.token_id < 0 ? 1 : 0;
      st = sampler.EnqueueRest(d_logits_, vocab, stream_);
      EXPECT_TRUE(st.ok()) << st;
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      EXPECT_FALSE(sampler.Finish(rs, &got)) << "the full pass leaves no row";
    }
    std::vector<float> after(flat.size());
    EXPECT_EQ(cudaMemcpy(after.data(), d_logits_, after.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < rows; ++i) {
      SCOPED_TRACE(absl::StrCat("row ", i, " temperature ", cases[i].params.temperature, " top_k ",
                                cases[i].params.top_k, " top_p ", cases[i].params.top_p, " min_p ",
                                cases[i].params.min_p, " logprobs ", cases[i].params.logprobs));
      // The row as the host sampler reads it: NaN -> -inf, +inf -> max.
      for (int v = 0; v < vocab; ++v) {
        const float in = logits[i][static_cast<size_t>(v)];
        const float want = std::isnan(in) ? -kInf : std::min(in, FLT_MAX);
        const float have = after[i * vocab + static_cast<size_t>(v)];
        if (!(have == want && std::signbit(have) == std::signbit(want))) {
          ADD_FAILURE() << "logit " << v << " left as " << have << ", was " << in;
          break;
        }
      }
      std::vector<float> row = logits[i];
      const SampledToken want = SampleToken(row, cases[i].params, cases[i].prompt, cases[i].output, eos, cases[i].seed);
      EXPECT_EQ(got[i].token_id, want.token_id);
      EXPECT_NEAR(got[i].logprob, want.logprob, 1e-6f * std::max(1.0f, std::fabs(want.logprob)));
      EXPECT_EQ(got[i].top_logprobs.size(), want.top_logprobs.size());
      if (got[i].top_logprobs.size() != want.top_logprobs.size()) continue;
      for (size_t k = 0; k < want.top_logprobs.size(); ++k) {
        EXPECT_EQ(got[i].top_logprobs[k].token_id, want.top_logprobs[k].token_id) << "alternative " << k;
        EXPECT_NEAR(got[i].top_logprobs[k].logprob, want.top_logprobs[k].logprob,
                    1e-6f * std::max(1.0f, std::fabs(want.top_logprobs[k].logprob)));
      }
    }
    return full_rows;
  }

  cudaStream_t stream_ = nullptr;
  float* d_logits_ = nullptr;
};

TEST_F(GpuSamplerTest, PicksTheHostSamplersTokenForEveryParameterMix) {
  std::mt19937 rng(7);
  for (int vocab : {5, 13, 1000, 4099, 128256}) {
    SCOPED_TRACE(absl::StrCat("vocab ", vocab));
    const std::vector<Case> cases = RandomCases(vocab > 100000 ? 48 : 96, vocab, rng);
    std::vector<std::vector<float>> logits;
    for (size_t i = 0; i < cases.size(); ++i) logits.push_back(RandomLogits(vocab, rng, i % 3 == 0 ? 0.5f : 4.0f));
    SampleAndCompare(logits, cases, vocab, {vocab - 1, 0});
  }
}

TEST_F(GpuSamplerTest, SeededDrawsRepeatAndFollowTheSeed) {
  constexpr int kVocab = 32000;
  std::mt19937 rng(11);
  const std::vector<float> row = RandomLogits(kVocab, rng, 1.0f);
  std::vector<Case> cases(8);
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].params.temperature = 1.0f;
    cases[i].seed = i / 2;  // pairs share a seed
    cases[i].prompt = {1, 2, 3};
  }
  std::vector<std::vector<float>> logits(cases.size(), row);
  SampleAndCompare(logits, cases, kVocab, {});
}

// A flat distribution under top_p walks past the first pass's candidates:
// the full pass sorts the whole vocabulary and gets the same token.
TEST_F(GpuSamplerTest, AWalkPastTheCandidatesTakesTheFullPass) {
  constexpr int kVocab = 50000;
  std::mt19937 rng(3);
  std::vector<Case> cases(40);  // more than one launch of the full pass
  std::vector<std::vector<float>> logits;
  for (Case& c : cases) {
    c.params.temperature = 1.0f;
    c.params.top_p = 0.95f;
    c.seed = rng();
    logits.push_back(RandomLogits(kVocab, rng, 0.01f, /*with_inf=*/false));
  }
  cases[2].params.top_k = 40;     // cut within the candidates: the first pass
  cases[3].params.top_k = 30000;  // beyond them: the full pass
  cases[3].params.top_p = 1.0f;
  cases[4].params.min_p = 0.5f;  // a long min_p walk
  cases[4].params.top_p = 1.0f;
  cases[5].params.logprobs = 20;
  cases[5].params.repetition_penalty = 1.5f;
  cases[5].prompt = {1, 5, 9, 49999};
  EXPECT_EQ(SampleAndCompare(logits, cases, kVocab, {7}), 39);
}

}  // namespace
}  // namespace tandem::worker
