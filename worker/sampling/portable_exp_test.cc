#include "worker/sampling/portable_exp.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

// Distance in units in the last place between two finite non-negative doubles.
int64_t UlpDistance(double a, double b) {
  const auto bits_a = std::bit_cast<int64_t>(a);
  const auto bits_b = std::bit_cast<int64_t>(b);
  return bits_a > bits_b ? bits_a - bits_b : bits_b - bits_a;
}

TEST(PortableExpTest, WithinTwoUlpOfStdExp) {
  // 2 million points across the whole range, normal and subnormal results.
  constexpr int kPoints = 2000000;
  constexpr double kLow = -745.0;
  constexpr double kHigh = 709.0;
  int64_t worst = 0;
  for (int i = 0; i <= kPoints; ++i) {
    const double x = kLow + (kHigh - kLow) * i / kPoints;
    worst = std::max(worst, UlpDistance(PortableExp(x), std::exp(x)));
  }
  EXPECT_LE(worst, 2);
}

TEST(PortableExpTest, WithinTwoUlpNearZero) {
  // The sampler's arguments are mostly in [-30, 0].
  int64_t worst = 0;
  for (int i = 0; i <= 1000000; ++i) {
    const double x = -30.0 * i / 1000000;
    worst = std::max(worst, UlpDistance(PortableExp(x), std::exp(x)));
  }
  EXPECT_LE(worst, 2);
}

TEST(PortableExpTest, BatchGivesTheSameBitsAsScalar) {
  std::vector<double> x;
  for (int i = 0; i <= 100000; ++i) x.push_back(-750.0 + 1462.0 * i / 100000);
  x.push_back(std::numeric_limits<double>::quiet_NaN());
  x.push_back(-std::numeric_limits<double>::infinity());
  x.push_back(std::numeric_limits<double>::infinity());
  std::vector<double> batch(x.size());
  PortableExp(x, batch);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint64_t>(batch[i]), std::bit_cast<uint64_t>(PortableExp(x[i]))) << "x = " << x[i];
  }
}

// Pinned bits: a change here changes sampled tokens, so it must be
// deliberate (and is then a change for every worker at once). All are the
// correctly rounded e^x except e^-0.3, one ulp below it.
TEST(PortableExpTest, PinnedValues) {
  EXPECT_EQ(std::bit_cast<uint64_t>(PortableExp(-1.0)), 0x3fd78b56362cef38u);
  EXPECT_EQ(std::bit_cast<uint64_t>(PortableExp(-0.3)), 0x3fe7b4c869c37c04u);
  EXPECT_EQ(std::bit_cast<uint64_t>(PortableExp(-20.5)), 0x3e157a3afeed00abu);
  EXPECT_EQ(std::bit_cast<uint64_t>(PortableExp(-744.0)), 0x2u);  // subnormal
}

TEST(PortableExpTest, ExactAndSpecialValues) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  EXPECT_EQ(PortableExp(0.0), 1.0);
  EXPECT_EQ(PortableExp(-0.0), 1.0);
  EXPECT_EQ(PortableExp(-kInfinity), 0.0);
  EXPECT_EQ(PortableExp(std::numeric_limits<double>::quiet_NaN()), 0.0);
  EXPECT_EQ(PortableExp(-746.0), 0.0);
  EXPECT_EQ(PortableExp(710.0), kInfinity);
  EXPECT_GT(PortableExp(-745.0), 0.0);  // a subnormal
  EXPECT_LT(PortableExp(-745.0), std::numeric_limits<double>::min());
}

}  // namespace
}  // namespace tandem::worker
