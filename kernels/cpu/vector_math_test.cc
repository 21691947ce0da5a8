#include "kernels/cpu/vector_math.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels::cpu {
namespace {

TEST(VectorMathTest, ExpMatchesLibmWithinTwoUlpScale) {
  std::vector<float> x;
  for (float v = -90.0f; v <= 30.0f; v += 0.0137f) x.push_back(v);
  std::vector<float> y = x;
  double sum = ExpShiftSum(y.data(), 0.0f, static_cast<int>(y.size()));
  double ref_sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double ref = std::exp(static_cast<double>(x[i]));
    ref_sum += x[i] < -87.0f ? 0.0 : ref;
    if (x[i] < -87.0f) {
      EXPECT_EQ(y[i], 0.0f);
    } else {
      EXPECT_NEAR(y[i], ref, 3e-7 * ref) << "x=" << x[i];
    }
  }
  EXPECT_NEAR(sum, ref_sum, 1e-6 * ref_sum);
}

TEST(VectorMathTest, DotAxpyScaleMax) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1, 1);
  for (int n : {0, 1, 15, 16, 17, 64, 100}) {
    std::vector<float> a(n), b(n), y(n);
    for (int i = 0; i < n; ++i) a[i] = d(rng), b[i] = d(rng), y[i] = d(rng);
    double ref = 0;
    for (int i = 0; i < n; ++i) ref += double(a[i]) * b[i];
    EXPECT_NEAR(Dot(a.data(), b.data(), n), ref, 1e-5);
    std::vector<float> y2 = y;
    Axpy(0.5f, a.data(), y2.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_FLOAT_EQ(y2[i], y[i] + 0.5f * a[i]);
    if (n > 0) {
      float mx = -2;
      for (float v : a) mx = std::max(mx, v);
      EXPECT_EQ(MaxOf(a.data(), n), mx);
    }
  }
}

}  // namespace
}  // namespace tandem::kernels::cpu
