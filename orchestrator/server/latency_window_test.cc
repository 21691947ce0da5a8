#include "orchestrator/server/latency_window.h"

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

TEST(LatencyWindowTest, NearestRankQuantiles) {
  LatencyWindow w(100);
  EXPECT_FALSE(w.Quantile(0.5).has_value());
  for (int i = 1; i <= 100; ++i) w.Record(i);
  EXPECT_EQ(w.count(), 100u);
  EXPECT_EQ(*w.Quantile(0.99), 99);
  EXPECT_EQ(*w.Quantile(0.5), 50);
  EXPECT_EQ(*w.Quantile(1.0), 100);
  EXPECT_EQ(*w.Quantile(0.0), 1);
}

TEST(LatencyWindowTest, KeepsOnlyTheLatestSamples) {
  LatencyWindow w(10);
  for (int i = 0; i < 10; ++i) w.Record(100);  // old, slow
  for (int i = 0; i < 10; ++i) w.Record(1);    // recent, fast
  EXPECT_EQ(w.count(), 20u);
  EXPECT_EQ(*w.Quantile(0.99), 1);
}

TEST(LatencyWindowTest, MinSamples) {
  LatencyWindow w;
  for (int i = 0; i < 19; ++i) w.Record(0.1);
  EXPECT_FALSE(w.Quantile(0.99, 20).has_value());
  w.Record(0.1);
  EXPECT_TRUE(w.Quantile(0.99, 20).has_value());
}

TEST(AttemptDeadlineTest, FixedAutoAndFloor) {
  RetriesConfig r;
  r.auto_multiplier = 5;
  r.auto_floor_s = 2;
  LatencyWindow w;
  // Auto is off until enough samples.
  EXPECT_EQ(AttemptDeadlineSeconds(AttemptDeadlineConfig{.automatic = true}, r, w), 0);
  for (int i = 0; i < 50; ++i) w.Record(0.01);
  // 5 x 10 ms is under the floor.
  EXPECT_EQ(AttemptDeadlineSeconds(AttemptDeadlineConfig{.automatic = true}, r, w), 2);
  for (int i = 0; i < 50; ++i) w.Record(1.0);
  EXPECT_EQ(AttemptDeadlineSeconds(AttemptDeadlineConfig{.automatic = true}, r, w), 5);
  EXPECT_EQ(AttemptDeadlineSeconds(AttemptDeadlineConfig{.automatic = false, .seconds = 7}, r, w), 7);
  EXPECT_EQ(AttemptDeadlineSeconds(AttemptDeadlineConfig{.automatic = false, .seconds = 0}, r, w), 0);
}

}  // namespace
}  // namespace tandem::router
