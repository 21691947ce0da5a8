#include "worker/sampling/sampling_params.h"

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;

constexpr int kVocab = 1000;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfinity = std::numeric_limits<float>::infinity();

TEST(ValidateSamplingParamsTest, DefaultsAreValid) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, kVocab).ok());
}

TEST(ValidateSamplingParamsTest, EdgesOfEveryRangeAreValid) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.top_k = -1;
  params.top_p = 1.0f;
  params.min_p = 1.0f;
  params.repetition_penalty = 0.01f;
  params.presence_penalty = -2.0f;
  params.frequency_penalty = 2.0f;
  params.max_tokens = 5;
  params.min_tokens = 5;
  params.stop_token_ids = {0, kVocab - 1};
  params.logprobs = kMaxLogprobs;
  params.seed = 0;
  EXPECT_TRUE(ValidateSamplingParams(params, kVocab).ok());

  params.top_k = kVocab * 10;  // more than the vocabulary: all of it
  params.logprobs = 0;
  params.max_tokens = -1;
  params.min_tokens = 100000;  // no upper bound without max_tokens
  EXPECT_TRUE(ValidateSamplingParams(params, kVocab).ok());
}

struct InvalidCase {
  std::string field;  // must appear in the message
  std::function<void(SamplingParams&)> break_it;
};

TEST(ValidateSamplingParamsTest, ErrorsNameTheField) {
  const std::vector<InvalidCase> cases = {
      {"temperature", [](SamplingParams& p) { p.temperature = -0.1f; }},
      {"temperature", [](SamplingParams& p) { p.temperature = kNan; }},
      {"temperature", [](SamplingParams& p) { p.temperature = kInfinity; }},
      {"top_k", [](SamplingParams& p) { p.top_k = -2; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 0.0f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 1.01f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = kNan; }},
      {"min_p", [](SamplingParams& p) { p.min_p = -0.01f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.5f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = kNan; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = -1.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = kInfinity; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = kNan; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.5f; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = -kInfinity; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = kNan; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = -2.5f; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = kNan; }},
      {"max_tokens", [](SamplingParams& p) { p.max_tokens = 0; }},
      {"max_tokens", [](SamplingParams& p) { p.max_tokens = -2; }},
      {"min_tokens", [](SamplingParams& p) { p.min_tokens = -1; }},
      {"min_tokens",
       [](SamplingParams& p) {
         p.max_tokens = 10;
         p.min_tokens = 11;
       }},
      {"stop_token_ids",
       [](SamplingParams& p) {
         p.stop_token_ids = {5, kVocab};
       }},
      {"stop_token_ids", [](SamplingParams& p) { p.stop_token_ids = {-1}; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = kMaxLogprobs + 1; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = -2; }},
  };
  for (const InvalidCase& c : cases) {
    SamplingParams params;
    c.break_it(params);
    const absl::Status status = ValidateSamplingParams(params, kVocab);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
  }
}

TEST(ValidateSamplingParamsTest, MessageGivesTheRangeAndTheValue) {
  SamplingParams params;
  params.top_p = 1.5f;
  const absl::Status status = ValidateSamplingParams(params, kVocab);
  EXPECT_THAT(status.message(), HasSubstr("(0, 1]"));
  EXPECT_THAT(status.message(), HasSubstr("1.5"));

  params = SamplingParams{};
  params.stop_token_ids = {3, 1000};
  EXPECT_THAT(ValidateSamplingParams(params, kVocab).message(), HasSubstr("stop_token_ids[1] must be in [0, 1000)"));
}

TEST(ValidateSamplingParamsTest, RejectsEmptyVocabulary) {
  EXPECT_EQ(ValidateSamplingParams(SamplingParams{}, 0).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::worker
