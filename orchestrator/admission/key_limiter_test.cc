#include "orchestrator/admission/key_limiter.h"

#include <gtest/gtest.h>

namespace tandem::router {
namespace {

using std::chrono::milliseconds;
using Clock = KeyLimiter::Clock;

TEST(KeyLimiterTest, NoLimitsAdmitEverything) {
  KeyLimiter l;
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < 1000; ++i) {
    EXPECT_EQ(l.TryAcquire("a", KeyLimitsConfig{}, 1 << 20, t0).refused, KeyLimit::kNone);
  }
  EXPECT_EQ(l.concurrent("a"), 1000);
}

TEST(KeyLimiterTest, RequestsPerSecondBurstThenRate) {
  KeyLimiter l;
  const KeyLimitsConfig lim{.requests_per_s = 2};
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
  KeyLimiter::Decision d = l.TryAcquire("a", lim, 0, t0);
  EXPECT_EQ(d.refused, KeyLimit::kRequestsPerSecond);
  EXPECT_NEAR(d.retry_after_s, 0.5, 1e-9);
  // Another key has its own bucket.
  EXPECT_EQ(l.TryAcquire("b", lim, 0, t0).refused, KeyLimit::kNone);
  // Half a second later one more fits, then none.
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0 + milliseconds(500)).refused, KeyLimit::kNone);
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0 + milliseconds(500)).refused, KeyLimit::kRequestsPerSecond);
  // A refusal took nothing: the concurrency count is of admitted requests.
  EXPECT_EQ(l.concurrent("a"), 3);
}

TEST(KeyLimiterTest, FractionalRateHoldsOneRequest) {
  KeyLimiter l;
  const KeyLimitsConfig lim{.requests_per_s = 0.1};
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
  KeyLimiter::Decision d = l.TryAcquire("a", lim, 0, t0 + milliseconds(1000));
  EXPECT_EQ(d.refused, KeyLimit::kRequestsPerSecond);
  EXPECT_NEAR(d.retry_after_s, 9.0, 1e-6);
}

TEST(KeyLimiterTest, ConcurrencyFreesOnRelease) {
  KeyLimiter l;
  const KeyLimitsConfig lim{.max_concurrent = 2};
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
  KeyLimiter::Decision d = l.TryAcquire("a", lim, 0, t0);
  EXPECT_EQ(d.refused, KeyLimit::kConcurrent);
  EXPECT_GT(d.retry_after_s, 0);
  l.Release("a", lim, 0, 0, t0);
  EXPECT_EQ(l.TryAcquire("a", lim, 0, t0).refused, KeyLimit::kNone);
}

TEST(KeyLimiterTest, TokensPerMinuteChargesSettlesAndRefills) {
  KeyLimiter l;
  const KeyLimitsConfig lim{.tokens_per_min = 600};  // 10 tokens a second
  const Clock::time_point t0 = Clock::now();
  KeyLimiter::Decision a = l.TryAcquire("a", lim, 400, t0);
  ASSERT_EQ(a.refused, KeyLimit::kNone);
  EXPECT_EQ(a.charged_tokens, 400);
  KeyLimiter::Decision b = l.TryAcquire("a", lim, 300, t0);
  EXPECT_EQ(b.refused, KeyLimit::kTokensPerMinute);
  EXPECT_NEAR(b.retry_after_s, 10.0, 1e-6);  // 100 tokens short at 10 a second
  // The first request used only 100: 300 return.
  l.Release("a", lim, a.charged_tokens, 100, t0);
  EXPECT_EQ(l.TryAcquire("a", lim, 300, t0).refused, KeyLimit::kNone);
  // 200 left; 5 s later 250.
  EXPECT_EQ(l.TryAcquire("a", lim, 260, t0 + milliseconds(5000)).refused, KeyLimit::kTokensPerMinute);
  EXPECT_EQ(l.TryAcquire("a", lim, 250, t0 + milliseconds(5000)).refused, KeyLimit::kNone);
}

TEST(KeyLimiterTest, OversizedRequestIsCappedAtAFullBucketAndExcessIsTaken) {
  KeyLimiter l;
  const KeyLimitsConfig lim{.tokens_per_min = 600};
  const Clock::time_point t0 = Clock::now();
  KeyLimiter::Decision a = l.TryAcquire("a", lim, 5000, t0);
  ASSERT_EQ(a.refused, KeyLimit::kNone);
  EXPECT_EQ(a.charged_tokens, 600);
  // It used 1200: the bucket owes 600, so a minute passes before 1 token.
  l.Release("a", lim, a.charged_tokens, 1200, t0);
  KeyLimiter::Decision b = l.TryAcquire("a", lim, 1, t0 + milliseconds(30000));
  EXPECT_EQ(b.refused, KeyLimit::kTokensPerMinute);
  EXPECT_NEAR(b.retry_after_s, 30.1, 1e-6);
  EXPECT_EQ(KeyLimitName(b.refused), "tokens_per_min");
}

}  // namespace
}  // namespace tandem::router
