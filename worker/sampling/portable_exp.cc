#include "worker/sampling/portable_exp.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "common/logging.h"

namespace tandem::worker {
namespace {

// 2^n for n in [-1022, 1023], built from its bits.
inline double PowerOfTwo(int64_t n) { return std::bit_cast<double>(static_cast<uint64_t>(n + 1023) << 52); }

// The body of PortableExp, branch free so that loops over it vectorize.
inline double Exp(double x) {
  // Arguments outside [-745.2, 709.8] give 0 or +inf; clamping first keeps
  // the arithmetic below in range. NaN fails both comparisons: it is clamped
  // low and gives 0.
  constexpr double kLowest = -745.2;  // e^x is below half the least subnormal
  constexpr double kHighest = 709.8;  // e^x overflows
  const double clamped = std::min(std::max(kLowest, x), kHighest);
  // x = k ln2 + r with |r| <= ln2 / 2, so e^x = 2^k e^r. ln2 is split in a
  // high part with 32 significant bits (k * kLn2High is exact for |k| < 2^21)
  // and the rest, so that r carries no cancellation error.
  constexpr double kInvLn2 = 0x1.71547652b82fep+0;   // 1 / ln 2
  constexpr double kLn2High = 0x1.62e42feep-1;       // ln 2, top 32 bits
  constexpr double kLn2Low = 0x1.a39ef35793c76p-33;  // ln 2 - kLn2High
  // Adding 1.5 * 2^52 rounds to an integer (ties to even) held in the low
  // mantissa bits, whence k both as a double and as an integer, with plain
  // arithmetic: no library call, no float-to-int conversion, so the loop
  // over a vocabulary vectorizes.
  constexpr double kRoundingShift = 0x1.8p52;
  const double shifted = clamped * kInvLn2 + kRoundingShift;
  const double k = shifted - kRoundingShift;
  const int64_t exponent = std::bit_cast<int64_t>(shifted) - std::bit_cast<int64_t>(kRoundingShift);
  const double r = (clamped - k * kLn2High) - k * kLn2Low;
  // Taylor series of e^r to r^13 / 13!: the first omitted term is below
  // 0.3466^14 / 14! < 5e-18, about 2% of an ulp of 1. Evaluated by Estrin's
  // scheme (pairs, then pairs of pairs, with r^2, r^4, r^8), whose
  // dependency chain is 4 multiply-adds long instead of Horner's 13.
  constexpr double c0 = 1.0, c1 = 1.0, c2 = 1.0 / 2.0, c3 = 1.0 / 6.0;
  constexpr double c4 = 1.0 / 24.0, c5 = 1.0 / 120.0, c6 = 1.0 / 720.0, c7 = 1.0 / 5040.0;
  constexpr double c8 = 1.0 / 40320.0, c9 = 1.0 / 362880.0, c10 = 1.0 / 3628800.0;
  constexpr double c11 = 1.0 / 39916800.0, c12 = 1.0 / 479001600.0;
  constexpr double c13 = 1.0 / 6227020800.0;
  const double r2 = r * r;
  const double r4 = r2 * r2;
  const double r8 = r4 * r4;
  const double terms0to3 = (c0 + c1 * r) + (c2 + c3 * r) * r2;
  const double terms4to7 = (c4 + c5 * r) + (c6 + c7 * r) * r2;
  const double terms8to11 = (c8 + c9 * r) + (c10 + c11 * r) * r2;
  const double terms12to13 = c12 + c13 * r;
  const double sum = (terms0to3 + terms4to7 * r4) + (terms8to11 + terms12to13 * r4) * r8;
  // Times 2^k in two exact power-of-two steps, so the result is rounded
  // once, also when it is subnormal, and overflows to +inf past the largest
  // double. k is in [-1075, 1024]; half of it (by a logical shift of the
  // non-negative k + 1100, which vectorizes) and the rest are both in
  // [-538, 512], normal exponents.
  const int64_t half = static_cast<int64_t>(static_cast<uint64_t>(exponent + 1100) >> 1) - 550;
  const double result = sum * PowerOfTwo(half) * PowerOfTwo(exponent - half);
  return x >= kLowest ? result : 0.0;
}

}  // namespace

double PortableExp(double x) { return Exp(x); }

void PortableExp(std::span<const double> x, std::span<double> out) {
  CHECK(x.size() == out.size()) << "PortableExp: " << x.size() << " inputs, " << out.size() << " outputs";
  for (size_t i = 0; i < x.size(); ++i) out[i] = Exp(x[i]);
}

}  // namespace tandem::worker
