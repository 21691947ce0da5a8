#include "worker/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/sampling/philox.h"
#include "worker/sampling/portable_exp.h"

namespace tandem::worker {
namespace {

using ::testing::ElementsAre;

constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

// SampleToken on a copy of `logits` (SampleToken overwrites them).
SampledToken Sample(std::vector<float> logits, const SamplingParams& params, const std::vector<int>& prompt = {},
                    const std::vector<int>& output = {}, const std::vector<int>& eos = {}, uint64_t seed = 0) {
  return SampleToken(logits, params, prompt, output, eos, seed);
}

std::vector<float> LogitsOf(const std::vector<double>& probabilities) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p;
  for (float logit : logits) p.push_back(std::exp((logit - max_logit) / temperature));
  const double total = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x /= total;
  return p;
}

// How often each token is drawn with seeds 0..draws-1 (empty history).
std::vector<int> Histogram(const std::vector<float>& logits, const SamplingParams& params, int draws) {
  std::vector<int> counts(logits.size());
  for (int seed = 0; seed < draws; ++seed) {
    ++counts[Sample(logits, params, {}, {}, {}, static_cast<uint64_t>(seed)).token_id];
  }
  return counts;
}

// Pearson's statistic over the tokens with expected probability > 0; tokens
// with probability 0 must never be drawn.
double ChiSquare(const std::vector<int>& counts, const std::vector<double>& probabilities) {
  const double draws = std::accumulate(counts.begin(), counts.end(), 0.0);
  double statistic = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probabilities[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the support";
      continue;
    }
    const double expected = draws * probabilities[i];
    statistic += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  return statistic;
}

// The draws are a fixed function of the seeds, so these checks cannot flake;
// the bound is loose anyway: for up to 4 degrees of freedom, P(chi2 > 35) <
// 5e-7 for a correct sampler.
constexpr double kChiSquareBound = 35.0;
constexpr int kDraws = 20000;

// Keeps `probabilities` where `keep` is true, renormalized.
std::vector<double> Restrict(std::vector<double> probabilities, const std::vector<bool>& keep) {
  double total = 0.0;
  for (size_t i = 0; i < probabilities.size(); ++i) {
    if (!keep[i]) probabilities[i] = 0.0;
    total += probabilities[i];
  }
  for (double& p : probabilities) p /= total;
  return probabilities;
}

// The support of the sampling distribution, as seen over kDraws seeds.
std::vector<int> Support(const std::vector<float>& logits, const SamplingParams& params) {
  const std::vector<int> counts = Histogram(logits, params, kDraws);
  std::vector<int> support;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > 0) support.push_back(static_cast<int>(i));
  }
  return support;
}

// The sum sampler.cc takes over a whole vocabulary: eight interleaved
// partial sums in token-id order, added in lane order, then the tail.
double LaneSum(const std::vector<double>& values) {
  constexpr size_t kLanes = 8;
  double lanes[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= values.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) lanes[lane] += values[i + lane];
  }
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  for (; i < values.size(); ++i) sum += values[i];
  return sum;
}

// SampleToken for temperature > 0 and no penalties, written from
// sampler.h with a full sort, the same sums and the same exp.
int ReferenceSample(const std::vector<float>& logits, const SamplingParams& params, double u) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  auto weight = [&](int token) { return PortableExp((logits[token] - max_logit) / params.temperature); };
  std::vector<int> order;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] != kMinusInfinity) order.push_back(static_cast<int>(i));
  }
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  // sum_of_first[n]: the first n weights added in order.
  std::vector<double> sum_of_first = {0.0};
  for (int token : order) sum_of_first.push_back(sum_of_first.back() + weight(token));
  size_t keep = order.size();
  double total = 0.0;
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < keep) {
    keep = static_cast<size_t>(params.top_k);
    total = sum_of_first[keep];
  } else {
    std::vector<double> all_weights;
    for (size_t i = 0; i < logits.size(); ++i) all_weights.push_back(weight(static_cast<int>(i)));
    total = LaneSum(all_weights);
  }
  if (params.top_p < 1.0f) {
    for (size_t i = 0; i < keep; ++i) {
      if (sum_of_first[i + 1] >= params.top_p * total) {
        keep = i + 1;
        total = sum_of_first[keep];
        break;
      }
    }
  }
  if (params.min_p > 0.0f) {
    size_t survivors = 1;
    while (survivors < keep && weight(order[survivors]) >= params.min_p * weight(order[0])) {
      ++survivors;
    }
    if (survivors < keep) {
      keep = survivors;
      total = sum_of_first[keep];
    }
  }
  for (size_t i = 0; i < keep; ++i) {
    if (sum_of_first[i + 1] > u * total) return order[i];
  }
  return order[keep - 1];
}

std::vector<float> RandomLogits(int vocab_size, float scale, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(vocab_size);
  for (float& logit : logits) logit = normal(engine);
  return logits;
}

// ---------------------------------------------------------------- greedy

TEST(SampleTokenTest, GreedyTakesTheArgmax) {
  SamplingParams params;
  params.temperature = 0.0f;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    EXPECT_EQ(Sample({0.1f, 2.5f, -1.0f, 2.4f}, params, {}, {}, {}, seed).token_id, 1);
  }
}

TEST(SampleTokenTest, GreedyTiesGoToTheLowestId) {
  SamplingParams params;
  params.temperature = 0.0f;
  EXPECT_EQ(Sample({1.0f, 3.0f, 3.0f, 2.0f}, params).token_id, 1);
  EXPECT_EQ(Sample({0.0f, 0.0f, 0.0f}, params).token_id, 0);
}

TEST(SampleTokenTest, NonFiniteLogits) {
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  EXPECT_EQ(Sample({kNan, 0.5f, kNan}, greedy).token_id, 1);
  EXPECT_EQ(Sample({1.0f, kInfinity, 2.0f}, greedy).token_id, 1);
  // NaN is never sampled; +inf takes all the mass.
  EXPECT_THAT(Support({kNan, 0.5f, kNan, 0.4f}, SamplingParams{}), ElementsAre(1, 3));
  EXPECT_THAT(Support({1.0f, kInfinity, 2.0f}, SamplingParams{}), ElementsAre(1));
}

// ------------------------------------------------------------ temperature

class TemperatureTest : public ::testing::TestWithParam<float> {};

TEST_P(TemperatureTest, FrequenciesMatchTheSoftmax) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, 3.0f, -1.0f};
  SamplingParams params;
  params.temperature = GetParam();
  const std::vector<int> counts = Histogram(logits, params, kDraws);
  EXPECT_LT(ChiSquare(counts, Softmax(logits, GetParam())), kChiSquareBound);
}

INSTANTIATE_TEST_SUITE_P(Temperatures, TemperatureTest, ::testing::Values(0.5f, 1.0f, 1.7f));

TEST(SampleTokenTest, InverseCdfOverTheProbabilityOrder) {
  // p = {1/4, 3/4}: the order is token 1 then token 0, so token 1 is drawn
  // exactly when u < 3/4.
  const std::vector<float> logits = {0.0f, static_cast<float>(std::log(3.0))};
  const std::vector<int> prompt(7, 0);
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    const double u = UniformDouble(seed, prompt.size());
    if (std::abs(u - 0.75) < 1e-6) continue;  // float logits: p is 3/4 to ~1e-7
    EXPECT_EQ(Sample(logits, SamplingParams{}, prompt, {}, {}, seed).token_id, u < 0.75 ? 1 : 0);
  }
}

// ---------------------------------------------------------------- filters

const std::vector<double> kProbabilities = {0.5, 0.2, 0.15, 0.1, 0.05};

TEST(SampleTokenTest, TopKKeepsExactlyTheKMostLikely) {
  const std::vector<float> logits = LogitsOf({0.3, 0.25, 0.2, 0.15, 0.1});
  SamplingParams params;
  params.top_k = 2;
  const std::vector<int> counts = Histogram(logits, params, kDraws);
  EXPECT_LT(ChiSquare(counts, Restrict(Softmax(logits, 1.0), {true, true, false, false, false})), kChiSquareBound);

  params.top_k = 4;
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2, 3));
  params.top_k = 1;
  EXPECT_THAT(Support(logits, params), ElementsAre(0));
  params.top_k = 100;  // more than the vocabulary
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2, 3, 4));
  params.top_k = -1;
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2, 3, 4));
}

TEST(SampleTokenTest, TopKBreaksTiesByLowerId) {
  SamplingParams params;
  params.top_k = 3;
  EXPECT_THAT(Support({0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, params), ElementsAre(0, 1, 2));
  EXPECT_THAT(Support({-1.0f, 2.0f, 0.0f, 2.0f, 0.0f}, params), ElementsAre(1, 2, 3));
}

TEST(SampleTokenTest, TopPKeepsTheSmallestSetReachingP) {
  const std::vector<float> logits = LogitsOf(kProbabilities);
  SamplingParams params;
  params.top_p = 0.6f;  // 0.5 < 0.6 <= 0.7
  const std::vector<int> counts = Histogram(logits, params, kDraws);
  EXPECT_LT(ChiSquare(counts, Restrict(kProbabilities, {true, true, false, false, false})), kChiSquareBound);

  params.top_p = 0.8f;  // 0.7 < 0.8 <= 0.85
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2));
  params.top_p = 0.4f;  // the top token alone reaches it
  EXPECT_THAT(Support(logits, params), ElementsAre(0));
  params.top_p = 1e-6f;
  EXPECT_THAT(Support(logits, params), ElementsAre(0));
  params.top_p = 0.99f;
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2, 3, 4));
}

TEST(SampleTokenTest, TopPIsReachedAtEquality) {
  // Four equal tokens: two of them hold exactly 0.5, which reaches top_p
  // 0.5 (the lower ids, by the tie rule).
  SamplingParams params;
  params.top_p = 0.5f;
  EXPECT_THAT(Support({1.0f, 1.0f, 1.0f, 1.0f}, params), ElementsAre(0, 1));
  params.top_p = 0.75f;
  EXPECT_THAT(Support({1.0f, 1.0f, 1.0f, 1.0f}, params), ElementsAre(0, 1, 2));
}

TEST(SampleTokenTest, TopPAppliesToWhatTopKKept) {
  // After top_k = 3 the probabilities are {0.588, 0.235, 0.176}: top_p 0.8 is
  // reached by two tokens, where it needs three without top_k.
  const std::vector<float> logits = LogitsOf(kProbabilities);
  SamplingParams params;
  params.top_p = 0.8f;
  params.top_k = 3;
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1));
}

TEST(SampleTokenTest, MinPKeepsTokensNearTheTop) {
  const std::vector<float> logits = LogitsOf(kProbabilities);
  SamplingParams params;
  params.min_p = 0.25f;  // p >= 0.125
  const std::vector<int> counts = Histogram(logits, params, kDraws);
  EXPECT_LT(ChiSquare(counts, Restrict(kProbabilities, {true, true, true, false, false})), kChiSquareBound);

  params.min_p = 0.35f;  // p >= 0.175
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1));
  params.min_p = 1.0f;
  EXPECT_THAT(Support(logits, params), ElementsAre(0));
  params.min_p = 0.05f;  // p >= 0.025
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2, 3, 4));
}

TEST(SampleTokenTest, MinPIsRelativeToTheTemperedDistribution) {
  // At temperature 2 the probabilities are proportional to sqrt(p):
  // {0.707, 0.447, 0.387, 0.316, 0.224} / sum; min_p 0.5 keeps >= 0.354.
  const std::vector<float> logits = LogitsOf(kProbabilities);
  SamplingParams params;
  params.temperature = 2.0f;
  params.min_p = 0.5f;
  EXPECT_THAT(Support(logits, params), ElementsAre(0, 1, 2));
}

// The lazily sorted order must pick exactly what a full sort picks, shallow
// (confident distributions, tight filters) and deep (flat distributions).
TEST(SampleTokenTest, MatchesAFullSortReference) {
  struct Case {
    float scale;  // of the random logits
    float temperature;
    int top_k;
    float top_p;
    float min_p;
  };
  const std::vector<Case> cases = {
      {3.0f, 1.0f, 0, 1.0f, 0.0f},      {3.0f, 0.8f, 40, 1.0f, 0.0f},     {2.0f, 1.2f, 0, 0.9f, 0.0f},
      {2.0f, 1.0f, 0, 1.0f, 0.05f},     {1.0f, 2.0f, 1000, 0.95f, 0.01f}, {0.5f, 5.0f, 0, 1.0f, 0.0f},
      {0.5f, 5.0f, 4999, 0.999f, 0.0f}, {4.0f, 0.3f, 0, 0.5f, 0.2f},
  };
  constexpr int kVocab = 5000;
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::vector<float> logits = RandomLogits(kVocab, cases[c].scale, c);
    SamplingParams params;
    params.temperature = cases[c].temperature;
    params.top_k = cases[c].top_k;
    params.top_p = cases[c].top_p;
    params.min_p = cases[c].min_p;
    for (uint64_t seed = 0; seed < 200; ++seed) {
      const int expected = ReferenceSample(logits, params, UniformDouble(seed, 0));
      ASSERT_EQ(Sample(logits, params, {}, {}, {}, seed).token_id, expected) << "case " << c << " seed " << seed;
    }
  }
}

TEST(SampleTokenTest, LargeVocabularyMatchesTheReference) {
  constexpr int kVocab = 128256;
  const std::vector<float> logits = RandomLogits(kVocab, 2.0f, 7);
  SamplingParams top_k;
  top_k.top_k = 50;
  top_k.temperature = 0.7f;
  SamplingParams flat;  // a walk deep into the tail
  flat.temperature = 8.0f;
  for (const SamplingParams& params : {top_k, flat}) {
    for (uint64_t seed = 0; seed < 10; ++seed) {
      EXPECT_EQ(Sample(logits, params, {}, {}, {}, seed).token_id,
                ReferenceSample(logits, params, UniformDouble(seed, 0)));
    }
  }
}

// -------------------------------------------------------------- penalties

TEST(ProcessLogitsTest, PenaltiesGiveExactValues) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, 1.0f, 0.0f};
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 0.5f;
  params.presence_penalty = 0.25f;
  const std::vector<int> prompt = {0, 0, 4, 5};
  const std::vector<int> output = {1, 1, 2};
  ProcessLogits(logits, params, prompt, output, {});
  // Repetition, once per distinct token of prompt + output: 2/2, -1*2,
  // 0.5/2, 1/2, 0*2. Frequency and presence over the output only: token 1
  // (twice) -2 - 2*0.5 - 0.25, token 2 (once) 0.25 - 0.5 - 0.25.
  EXPECT_THAT(logits, ElementsAre(1.0f, -3.25f, -0.5f, 3.0f, 0.5f, 0.0f));
}

TEST(ProcessLogitsTest, RepetitionPenaltyBelowOneRaisesPositiveLogits) {
  std::vector<float> logits = {1.5f, -1.5f, std::numeric_limits<float>::max()};
  SamplingParams params;
  params.repetition_penalty = 0.5f;
  const std::vector<int> prompt = {0, 1, 2};
  ProcessLogits(logits, params, prompt, {}, {});
  EXPECT_THAT(logits, ElementsAre(3.0f, -0.75f, std::numeric_limits<float>::max()));
}

TEST(ProcessLogitsTest, NegativePenaltiesEncourage) {
  std::vector<float> logits = {0.0f, 0.0f, 0.0f};
  SamplingParams params;
  params.frequency_penalty = -1.0f;
  params.presence_penalty = -0.5f;
  const std::vector<int> output = {2, 2, 2, 0};
  ProcessLogits(logits, params, {}, output, {});
  EXPECT_THAT(logits, ElementsAre(1.5f, 0.0f, 3.5f));
}

TEST(ProcessLogitsTest, IgnoresIdsOutsideTheVocabulary) {
  std::vector<float> logits = {1.0f, 1.0f};
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.presence_penalty = 1.0f;
  params.min_tokens = 5;
  const std::vector<int> history = {-1, 2, 100};
  const std::vector<int> eos = {7};
  ProcessLogits(logits, params, history, history, eos);
  EXPECT_THAT(logits, ElementsAre(1.0f, 1.0f));
}

TEST(SampleTokenTest, PenaltiesChangeTheGreedyChoice) {
  SamplingParams params;
  params.temperature = 0.0f;
  const std::vector<float> logits = {3.0f, 2.9f, 1.0f};
  const std::vector<int> said_zero = {0};
  EXPECT_EQ(Sample(logits, params, {}, said_zero).token_id, 0);
  params.presence_penalty = 0.2f;
  EXPECT_EQ(Sample(logits, params, {}, said_zero).token_id, 1);
  // Presence counts the output only, not the prompt.
  EXPECT_EQ(Sample(logits, params, said_zero, {}).token_id, 0);
  params.presence_penalty = 0.0f;
  params.repetition_penalty = 1.1f;  // 3.0 / 1.1 < 2.9; prompt counts too
  EXPECT_EQ(Sample(logits, params, said_zero, {}).token_id, 1);
}

// ------------------------------------------------------------- min_tokens

TEST(SampleTokenTest, MinTokensMasksEosAndStopIds) {
  const std::vector<float> logits = {0.0f, 1.0f, 5.0f, 4.0f, 2.0f};
  const std::vector<int> eos = {2};
  SamplingParams params;
  params.temperature = 0.0f;
  params.stop_token_ids = {3};
  params.min_tokens = 2;
  EXPECT_EQ(Sample(logits, params, {}, {}, eos).token_id, 4);
  EXPECT_EQ(Sample(logits, params, {}, {0}, eos).token_id, 4);
  EXPECT_EQ(Sample(logits, params, {}, {0, 0}, eos).token_id, 2);  // enough output

  // ignore_eos: EOS is not a stop token, so it is not masked; stop ids are.
  params.ignore_eos = true;
  EXPECT_EQ(Sample(logits, params, {}, {}, eos).token_id, 2);
  std::vector<float> processed = logits;
  ProcessLogits(processed, params, {}, {}, eos);
  EXPECT_THAT(processed, ElementsAre(0.0f, 1.0f, 5.0f, kMinusInfinity, 2.0f));
}

TEST(SampleTokenTest, MinTokensMaskHoldsWhenSampling) {
  const std::vector<float> logits = {0.0f, 1.0f, 5.0f, 4.0f, 2.0f};
  const std::vector<int> eos = {2};
  SamplingParams params;
  params.stop_token_ids = {3};
  params.min_tokens = 1;
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    const int token = Sample(logits, params, {}, {}, eos, seed).token_id;
    ASSERT_NE(token, 2);
    ASSERT_NE(token, 3);
  }
}

TEST(IsStopTokenTest, EosUnlessIgnoredAndStopIdsAlways) {
  const std::vector<int> eos = {2, 9};
  SamplingParams params;
  params.stop_token_ids = {5};
  EXPECT_TRUE(IsStopToken(2, params, eos));
  EXPECT_TRUE(IsStopToken(9, params, eos));
  EXPECT_TRUE(IsStopToken(5, params, eos));
  EXPECT_FALSE(IsStopToken(3, params, eos));
  params.ignore_eos = true;
  EXPECT_FALSE(IsStopToken(2, params, eos));
  EXPECT_TRUE(IsStopToken(5, params, eos));
}

// --------------------------------------------------------------- logprobs

std::vector<double> LogSoftmax(const std::vector<float>& logits) {
  const std::vector<double> p = Softmax(logits, 1.0);
  std::vector<double> result;
  for (double x : p) result.push_back(std::log(x));
  return result;
}

TEST(SampleTokenTest, LogprobsComeFromTheRawDistribution) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -2.0f, 0.5f};
  const std::vector<double> expected = LogSoftmax(logits);
  SamplingParams params;
  params.logprobs = 3;
  // Processing that changes the sampling distribution but not the logprobs.
  params.temperature = 0.5f;
  params.repetition_penalty = 1.3f;
  params.presence_penalty = 1.0f;
  params.min_tokens = 10;
  params.stop_token_ids = {1};
  const std::vector<int> output = {3, 5};
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const SampledToken sampled = Sample(logits, params, {}, output, {}, seed);
    EXPECT_NEAR(sampled.logprob, expected[sampled.token_id], 1e-6);
    ASSERT_EQ(sampled.top_logprobs.size(), 3u);
    // Most likely first; the tie between 1 and 3 goes to 1. Token 1 is masked
    // for sampling but still reported.
    EXPECT_EQ(sampled.top_logprobs[0].token_id, 1);
    EXPECT_EQ(sampled.top_logprobs[1].token_id, 3);
    EXPECT_EQ(sampled.top_logprobs[2].token_id, 2);
    for (const TokenLogprob& top : sampled.top_logprobs) {
      EXPECT_NEAR(top.logprob, expected[top.token_id], 1e-6);
    }
  }
}

TEST(SampleTokenTest, LogprobsCountsAndAbsence) {
  const std::vector<float> logits = {0.5f, 0.1f, 0.3f};
  SamplingParams params;
  params.temperature = 0.0f;

  SampledToken sampled = Sample(logits, params);  // logprobs = -1
  EXPECT_EQ(sampled.logprob, 0.0f);
  EXPECT_TRUE(sampled.top_logprobs.empty());

  params.logprobs = 0;  // the sampled token's logprob only
  sampled = Sample(logits, params);
  EXPECT_NEAR(sampled.logprob, LogSoftmax(logits)[0], 1e-6);
  EXPECT_TRUE(sampled.top_logprobs.empty());

  params.logprobs = 20;  // more than the vocabulary: all of it
  sampled = Sample(logits, params);
  ASSERT_EQ(sampled.top_logprobs.size(), 3u);
  EXPECT_EQ(sampled.top_logprobs[0].token_id, 0);
  EXPECT_EQ(sampled.top_logprobs[1].token_id, 2);
  EXPECT_EQ(sampled.top_logprobs[2].token_id, 1);
}

TEST(SampleTokenTest, LogprobsAreAccurateOnALargeVocabulary) {
  const std::vector<float> logits = RandomLogits(128256, 3.0f, 11);
  const std::vector<double> expected = LogSoftmax(logits);
  std::vector<int> by_likelihood(logits.size());
  std::iota(by_likelihood.begin(), by_likelihood.end(), 0);
  std::stable_sort(by_likelihood.begin(), by_likelihood.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  SamplingParams params;
  params.logprobs = 5;
  const SampledToken sampled = Sample(logits, params, {}, {}, {}, 3);
  EXPECT_NEAR(sampled.logprob, expected[sampled.token_id], 1e-5);
  ASSERT_EQ(sampled.top_logprobs.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(sampled.top_logprobs[i].token_id, by_likelihood[i]);
    EXPECT_NEAR(sampled.top_logprobs[i].logprob, expected[by_likelihood[i]], 1e-5);
  }
}

// ---------------------------------------------------------- reproducibility

TEST(SampleTokenTest, SameInputsGiveTheSameToken) {
  const std::vector<float> logits = RandomLogits(1000, 1.0f, 5);
  SamplingParams params;
  params.top_p = 0.95f;
  const std::vector<int> prompt = {1, 2, 3};
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const int first = Sample(logits, params, prompt, {}, {}, seed).token_id;
    for (int repeat = 0; repeat < 3; ++repeat) {
      ASSERT_EQ(Sample(logits, params, prompt, {}, {}, seed).token_id, first);
    }
  }
}

TEST(SampleTokenTest, TheCounterIsTheSequencePosition) {
  // Without penalties only prompt.size() + output.size() matters.
  const std::vector<float> logits = RandomLogits(1000, 1.0f, 6);
  const SamplingParams params;
  const std::vector<int> five(5, 0);
  const std::vector<int> three(3, 0);
  const std::vector<int> two(2, 0);
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const int expected = ReferenceSample(logits, params, UniformDouble(seed, 5));
    EXPECT_EQ(Sample(logits, params, five, {}, {}, seed).token_id, expected);
    EXPECT_EQ(Sample(logits, params, three, two, {}, seed).token_id, expected);
    EXPECT_EQ(Sample(logits, params, {}, five, {}, seed).token_id, expected);
  }
}

TEST(SampleTokenTest, PositionsGiveIndependentDraws) {
  // Uniform over 16 tokens, one seed, consecutive positions: frequencies are
  // uniform and consecutive draws repeat 1/16 of the time.
  constexpr int kTokens = 16;
  const std::vector<float> logits(kTokens, 0.0f);
  const std::vector<int> history(kDraws, 0);
  std::vector<int> counts(kTokens);
  int repeats = 0;
  int previous = -1;
  for (int position = 0; position < kDraws; ++position) {
    const std::span<const int> prompt(history.data(), static_cast<size_t>(position));
    std::vector<float> scratch = logits;
    const int token = SampleToken(scratch, SamplingParams{}, prompt, {}, {}, 42).token_id;
    ++counts[token];
    repeats += token == previous;
    previous = token;
  }
  // 15 degrees of freedom: P(chi2 > 60) < 1e-6.
  EXPECT_LT(ChiSquare(counts, std::vector<double>(kTokens, 1.0 / kTokens)), 60.0);
  // Expected 1250, standard deviation 34.
  EXPECT_NEAR(repeats, kDraws / kTokens, 250);
}

// A sequence sampled partly on one worker and partly on another gets the
// same tokens as on one worker: the sampler keeps no state.
TEST(SampleTokenTest, HandingASequenceToAnotherWorkerChangesNothing) {
  constexpr int kVocab = 300;
  // A toy model: the next logits depend on the last token.
  auto model = [](int last_token) {
    std::vector<float> logits(kVocab);
    for (int i = 0; i < kVocab; ++i) {
      logits[i] = 3.0f * static_cast<float>(std::sin(0.37 * i + 1.3 * last_token));
    }
    return logits;
  };
  SamplingParams params;
  params.temperature = 0.9f;
  params.top_p = 0.9f;
  params.repetition_penalty = 1.2f;
  params.frequency_penalty = 0.3f;
  params.min_tokens = 8;
  const std::vector<int> prompt = {4, 8, 15, 16, 23, 42};
  const std::vector<int> eos = {0};
  constexpr uint64_t kSeed = 1234;
  auto generate = [&](std::vector<int> output, int steps) {
    for (int step = 0; step < steps; ++step) {
      std::vector<float> logits = model(output.empty() ? prompt.back() : output.back());
      output.push_back(SampleToken(logits, params, prompt, output, eos, kSeed).token_id);
    }
    return output;
  };
  const std::vector<int> one_worker = generate({}, 40);
  const std::vector<int> first_worker = generate({}, 15);
  const std::vector<int> second_worker = generate(first_worker, 25);
  EXPECT_EQ(second_worker, one_worker);
  // And the draws do vary along the sequence.
  EXPECT_GT(std::set<int>(one_worker.begin(), one_worker.end()).size(), 5u);
}

}  // namespace
}  // namespace tandem::worker
