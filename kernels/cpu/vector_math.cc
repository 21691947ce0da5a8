#include "kernels/cpu/vector_math.h"

#include <cmath>
#include <cstring>

// Each function is compiled for AVX-512, AVX2 and baseline x86-64; the loader
// picks the best at run time. Sums use 16 independent lanes, combined in a
// fixed order, so the result does not depend on which clone ran.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TANDEM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TANDEM_CLONES
#endif

namespace tandem::kernels::cpu {

namespace {
constexpr int kLanes = 16;

inline float Combine(const float* lanes) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}
}  // namespace

TANDEM_CLONES float Dot(const float* a, const float* b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float s = Combine(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

TANDEM_CLONES void Axpy(float alpha, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

TANDEM_CLONES void Scale(float* x, float s, int n) {
  for (int i = 0; i < n; ++i) x[i] *= s;
}

TANDEM_CLONES float MaxOf(const float* x, int n) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

namespace {
// exp(y) = 2^k * exp(r), k = round(y / ln2), r = y - k*ln2 in [-ln2/2, ln2/2];
// exp(r) by its Taylor series to r^6 (truncation < 1.2e-7 relative).
// Below -87 the result is 0; above 88 it saturates at exp(88).
inline float FastExp(float y) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  bool underflow = y < -87.0f;
  y = y < -87.0f ? -87.0f : (y > 88.0f ? 88.0f : y);
  float kf = __builtin_floorf(y * kLog2e + 0.5f);
  float r = y - kf * kLn2Hi - kf * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}
}  // namespace

TANDEM_CLONES double ExpShiftSum(float* x, float shift, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      float e = FastExp(x[i + l] - shift);
      x[i + l] = e;
      acc[l] += e;
    }
  }
  double s = Combine(acc);
  for (; i < n; ++i) {
    x[i] = FastExp(x[i] - shift);
    s += x[i];
  }
  return s;
}

TANDEM_CLONES void SiluMul(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + FastExp(-gate[i])) * up[i];
}

TANDEM_CLONES void RmsNorm(const float* x, const float* weight, float eps, float* out, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  }
  double ss = Combine(acc);
  for (; i < n; ++i) ss += double(x[i]) * x[i];
  float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int j = 0; j < n; ++j) out[j] = x[j] * inv * weight[j];
}

}  // namespace tandem::kernels::cpu
