#include "worker/sampling/parallel_sampler.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace tandem::worker {
namespace {

// Rows of random logits with mixed parameters (greedy, top-k, top-p,
// min-p, penalties, logprobs): the parallel sampler's tokens and logprobs
// are SampleToken's, with any thread count, batch after batch.
TEST(ParallelSamplerTest, EveryRowIsSampleTokensWhateverTheThreads) {
  constexpr size_t kVocab = 5000;
  constexpr int kRows = 37;
  std::mt19937 rng(7);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  std::vector<std::vector<float>> logits(kRows, std::vector<float>(kVocab));
  for (auto& row : logits) {
    for (float& v : row) v = logit(rng);
  }
  std::vector<SamplingParams> params(kRows);
  for (int i = 0; i < kRows; ++i) {
    SamplingParams& p = params[i];
    p.temperature = i % 5 == 0 ? 0.0f : 0.5f + 0.1f * static_cast<float>(i % 7);
    p.top_k = i % 3 == 0 ? 40 : 0;
    p.top_p = i % 4 == 1 ? 0.9f : 1.0f;
    p.min_p = i % 6 == 2 ? 0.05f : 0.0f;
    p.repetition_penalty = i % 5 == 3 ? 1.2f : 1.0f;
    p.frequency_penalty = i % 7 == 4 ? 0.5f : 0.0f;
    p.logprobs = i % 2 == 0 ? 5 : -1;
  }
  const std::vector<int> prompt = {1, 2, 3, 40, 41};
  const std::vector<int> output = {7, 7, 9};
  const std::vector<int> eos = {0};
  std::vector<SampledToken> expected(kRows);
  for (int i = 0; i < kRows; ++i) {
    std::vector<float> copy = logits[i];
    expected[i] = SampleToken(copy, params[i], prompt, output, eos, 1000 + i);
  }
  for (int threads : {1, 3, 8}) {
    ParallelSampler sampler(threads);
    EXPECT_EQ(sampler.threads(), threads);
    for (int round = 0; round < 20; ++round) {
      const int n = round % 2 == 0 ? kRows : 1 + round % kRows;  // full batches and smaller ones
      std::vector<std::vector<float>> scratch(logits.begin(), logits.begin() + n);
      std::vector<SampledToken> got(n);
      std::vector<ParallelSampler::Row> rows;
      for (int i = 0; i < n; ++i) {
        rows.push_back({.logits = scratch[i],
                        .params = &params[i],
                        .prompt = prompt,
                        .output = output,
                        .seed = 1000u + i,
                        .out = &got[i]});
      }
      sampler.Sample(rows, eos);
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(got[i].token_id, expected[i].token_id) << threads << " threads, row " << i;
        ASSERT_EQ(got[i].logprob, expected[i].logprob) << threads << " threads, row " << i;
        ASSERT_EQ(got[i].top_logprobs.size(), expected[i].top_logprobs.size());
      }
    }
    sampler.Sample({}, eos);  // nothing to do
  }
}

}  // namespace
}  // namespace tandem::worker
