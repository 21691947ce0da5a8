// The arithmetic of the sampler that the host (sampler.cc, portable_exp.cc)
// and the GPU sampler (worker/runner/cuda/sampling_kernels.cu) share, so that
// both pick the same token from the same logits bit for bit:
//  - SamplingExp: e^x in double from +, -, * and bit operations only (the
//    body of PortableExp, portable_exp.h explains it);
//  - PickInOrder: step 4 of SampleToken after the softmax's maximum (top_k,
//    top_p, min_p, the inverse-CDF pick) over a candidate order that the
//    caller provides.
// Header-only, C++17, host and device (nvcc); both sides must compile it
// without floating-point contraction (-ffp-contract=off, nvcc -fmad=false).
//
// Thread safety: pure functions.
#ifndef TANDEM_WORKER_SAMPLING_SAMPLING_MATH_H_
#define TANDEM_WORKER_SAMPLING_SAMPLING_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem::worker::sampling_math {

TANDEM_HD inline int64_t DoubleBits(double x) {
#if defined(__CUDA_ARCH__)
  return __double_as_longlong(x);
#else
  int64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

TANDEM_HD inline double BitsDouble(int64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(bits);
#else
  double x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// 2^n for n in [-1022, 1023], built from its bits.
TANDEM_HD inline double PowerOfTwo(int64_t n) {
  return BitsDouble(static_cast<int64_t>(static_cast<uint64_t>(n + 1023) << 52));
}

// e^x, within 2 ulp, the same bits on every IEEE-754 machine: 0 below
// -745.2 and for NaN or -inf, +inf above 709.8. Branch free, so that loops
// over it vectorize.
TANDEM_HD inline double SamplingExp(double x) {
  // Arguments outside [-745.2, 709.8] give 0 or +inf; clamping first keeps
  // the arithmetic below in range. NaN fails both comparisons: it is clamped
  // low and gives 0. (Written as std::max and std::min evaluate.)
  constexpr double kLowest = -745.2;  // e^x is below half the least subnormal
  constexpr double kHighest = 709.8;  // e^x overflows
  const double low_clamped = kLowest < x ? x : kLowest;
  const double clamped = kHighest < low_clamped ? kHighest : low_clamped;
  // x = k ln2 + r with |r| <= ln2 / 2, so e^x = 2^k e^r. ln2 is split in a
  // high part with 32 significant bits (k * kLn2High is exact for |k| < 2^21)
  // and the rest, so that r carries no cancellation error.
  constexpr double kInvLn2 = 0x1.71547652b82fep+0;   // 1 / ln 2
  constexpr double kLn2High = 0x1.62e42feep-1;       // ln 2, top 32 bits
  constexpr double kLn2Low = 0x1.a39ef35793c76p-33;  // ln 2 - kLn2High
  // Adding 1.5 * 2^52 rounds to an integer (ties to even) held in the low
  // mantissa bits, whence k both as a double and as an integer, with plain
  // arithmetic: no library call, no float-to-int conversion.
  constexpr double kRoundingShift = 0x1.8p52;
  const double shifted = clamped * kInvLn2 + kRoundingShift;
  const double k = shifted - kRoundingShift;
  const int64_t exponent = DoubleBits(shifted) - DoubleBits(kRoundingShift);
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

// Adds candidates' weights to *cumulative along the order from the first
// until done(*cumulative) holds after an add: returns that candidate's
// position, `end` if none, or -1 if the order ran out first. Reads eight
// weights ahead of the adds (the same adds, in the same order: a GPU
// thread walking a long order waits on its loads otherwise).
template <typename Order, typename Done>
TANDEM_HD int64_t WalkPrefix(Order& order, int64_t end, double* cumulative, Done done) {
  constexpr int kAhead = 8;
  double c = *cumulative;
  int64_t i = 0;
  for (; i + kAhead <= end && order.Has(i + kAhead - 1); i += kAhead) {
    double w[kAhead];
    for (int k = 0; k < kAhead; ++k) w[k] = order.WeightAt(i + k);
    for (int k = 0; k < kAhead; ++k) {
      c += w[k];
      if (done(c)) {
        *cumulative = c;
        return i + k;
      }
    }
  }
  for (; i < end; ++i) {
    if (!order.Has(i)) return -1;
    c += order.WeightAt(i);
    if (done(c)) {
      *cumulative = c;
      return i;
    }
  }
  *cumulative = c;
  return end;
}

// Step 4 of SampleToken (sampler.h) for temperature > 0, given the
// candidates in sampling order (larger processed logit first, ties by lower
// id) with their softmax numerators e^((logit - max) / temperature):
// returns the position in the order of the picked candidate, or -1 when the
// order cannot go as far as the walk needs (a candidate list of fixed
// length: the caller then samples the row another way).
//
// `order` provides:
//   bool KeepFirst(int64_t n)  drop all but the first n (false: cannot)
//   bool Has(int64_t i)        whether candidate i can be read
//   double WeightAt(int64_t i) candidate i's numerator (REQUIRES: Has(i))
// `size` is the vocabulary; `whole_total()` the sum of every numerator over
// it (SoftmaxTotal), asked for only when top_k does not cut the order.
// Sums over a prefix of the order add one candidate after another along it.
template <typename Order, typename WholeTotal>
TANDEM_HD int64_t PickInOrder(Order& order, int64_t size, int top_k, float top_p, float min_p, double uniform,
                              WholeTotal whole_total) {
  int64_t keep = size;
  double kept_total = 0.0;
  if (top_k > 0 && top_k < keep) {
    keep = top_k;
    if (!order.KeepFirst(keep)) return -1;
    for (int64_t i = 0; i < keep; ++i) kept_total += order.WeightAt(i);
  } else {
    kept_total = whole_total();
  }

  if (top_p < 1.0f) {
    const double target = static_cast<double>(top_p) * kept_total;
    double cumulative = 0.0;
    const int64_t last = WalkPrefix(order, keep, &cumulative, [target](double c) { return c >= target; });
    if (last < 0) return -1;
    if (last < keep) {
      keep = last + 1;
      kept_total = cumulative;
    }
  }

  if (min_p > 0.0f) {
    const double threshold = static_cast<double>(min_p) * order.WeightAt(int64_t{0});
    double cumulative = order.WeightAt(int64_t{0});
    int64_t survivors = 1;
    while (survivors < keep) {
      if (!order.Has(survivors)) return -1;
      if (!(order.WeightAt(survivors) >= threshold)) break;
      cumulative += order.WeightAt(survivors);
      ++survivors;
    }
    if (survivors < keep) {
      keep = survivors;
      kept_total = cumulative;
    }
  }

  // Inverse CDF: the first candidate whose cumulative weight exceeds
  // u * total.
  const double target = uniform * kept_total;
  double cumulative = 0.0;
  const int64_t picked = WalkPrefix(order, keep, &cumulative, [target](double c) { return c > target; });
  if (picked < keep) return picked;  // a candidate, or -1: the order ran out
  // Only rounding (a total summed in another order exceeding the in-order
  // sum) reaches here.
  return order.Has(keep - 1) ? keep - 1 : -1;
}

}  // namespace tandem::worker::sampling_math

#endif  // TANDEM_WORKER_SAMPLING_SAMPLING_MATH_H_
