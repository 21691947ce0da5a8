#include "worker/sampling/philox.h"

#include <cmath>
#include <cstdint>
#include <set>

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

// The known-answer vectors published with Random123 (kat_vectors) for
// philox4x32 with 10 rounds. They were also recomputed here with an
// independent implementation of the paper's definition.
TEST(PhiloxTest, KnownAnswerZero) {
  EXPECT_EQ(Philox4x32({0, 0, 0, 0}, {0, 0}), (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
}

TEST(PhiloxTest, KnownAnswerAllOnes) {
  EXPECT_EQ(Philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
}

TEST(PhiloxTest, KnownAnswerPiDigits) {
  EXPECT_EQ(Philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(PhiloxTest, IsConstexpr) {
  static_assert(Philox4x32({0, 0, 0, 0}, {0, 0})[0] == 0x6627e8d5);
  static_assert(UniformDouble(0, 0) >= 0.0);
}

// Pinned values of the seed/position/draw layout; a change here changes
// every sampled token, so it must be deliberate.
TEST(UniformDoubleTest, PinnedValues) {
  EXPECT_EQ(UniformDouble(0, 0), 3594291074837816.0 * 0x1.0p-53);
  EXPECT_EQ(UniformDouble(42, 7), 3227824524431113.0 * 0x1.0p-53);
  EXPECT_EQ(UniformDouble(42, 7, 1), 2690610379771960.0 * 0x1.0p-53);
  EXPECT_EQ(UniformDouble(0xdeadbeefcafef00dULL, 123456789012ULL, 3), 8913868792295701.0 * 0x1.0p-53);
}

TEST(UniformDoubleTest, InUnitIntervalWith53Bits) {
  for (uint64_t position = 0; position < 10000; ++position) {
    const double u = UniformDouble(1234, position);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    const double scaled = u * 0x1.0p53;
    ASSERT_EQ(scaled, std::floor(scaled)) << "not a multiple of 2^-53";
  }
}

TEST(UniformDoubleTest, DependsOnEveryArgument) {
  const double base = UniformDouble(7, 100, 0);
  EXPECT_EQ(UniformDouble(7, 100, 0), base);
  EXPECT_NE(UniformDouble(8, 100, 0), base);
  EXPECT_NE(UniformDouble(7, 101, 0), base);
  EXPECT_NE(UniformDouble(7, 100, 1), base);
  // The high halves of seed and position matter too.
  EXPECT_NE(UniformDouble(7 + (uint64_t{1} << 32), 100, 0), base);
  EXPECT_NE(UniformDouble(7, 100 + (uint64_t{1} << 32), 0), base);

  std::set<double> distinct;
  for (uint64_t position = 0; position < 1000; ++position) {
    distinct.insert(UniformDouble(7, position));
  }
  EXPECT_EQ(distinct.size(), 1000u);
}

// Moments over consecutive positions: mean 1/2, variance 1/12, and no
// correlation between neighbours. With n = 200000 the standard errors are
// about 0.0006 (mean) and 0.0022 (correlation); the bounds are 8x that.
TEST(UniformDoubleTest, ConsecutivePositionsLookIndependent) {
  constexpr int kDraws = 200000;
  double sum = 0.0;
  double sum_squares = 0.0;
  double sum_neighbour_products = 0.0;
  double previous = UniformDouble(99, 0);
  for (int i = 1; i <= kDraws; ++i) {
    const double u = UniformDouble(99, static_cast<uint64_t>(i));
    sum += u;
    sum_squares += u * u;
    sum_neighbour_products += (u - 0.5) * (previous - 0.5);
    previous = u;
  }
  const double mean = sum / kDraws;
  const double variance = sum_squares / kDraws - mean * mean;
  const double correlation = (sum_neighbour_products / kDraws) / (1.0 / 12.0);
  EXPECT_NEAR(mean, 0.5, 0.005);
  EXPECT_NEAR(variance, 1.0 / 12.0, 0.003);
  EXPECT_NEAR(correlation, 0.0, 0.02);
}

}  // namespace
}  // namespace tandem::worker
