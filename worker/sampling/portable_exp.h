// PortableExp: e^x in double precision that gives the same bits on every
// IEEE-754 machine. std::exp is only promised to be accurate, not identical
// across C libraries and CPU architectures (glibc x86-64 vs aarch64, musl, a
// vendor libm), and the sampler's softmax feeds an exact comparison against a
// random draw; with this function a token sampled on an x86 prefill worker
// and on an Arm decode worker agrees bit for bit.
//
// It uses only +, -, *, comparisons and bit operations, each exactly
// specified by IEEE-754 for round-to-nearest. The library compiles with
// -ffp-contract=off so that no compiler fuses a multiply and an add into an
// FMA on some targets only.
// Accuracy: within 2 ulp of e^x (portable_exp_test.cc measures it).
//
// Thread safety: pure functions.
#ifndef TANDEM_WORKER_SAMPLING_PORTABLE_EXP_H_
#define TANDEM_WORKER_SAMPLING_PORTABLE_EXP_H_

#include <span>

namespace tandem::worker {

// e^x. Returns 0 below the smallest subnormal's range (x < -745.2) and for
// NaN or -inf, and +inf above the largest double's range (x > 709.8).
// Defined out of line so that the library's -ffp-contract=off applies to it
// whoever calls it.
double PortableExp(double x);

// out[i] = PortableExp(x[i]) for every i: the same bits, a few times faster
// over a vocabulary because the loop vectorizes.
// REQUIRES: x.size() == out.size().
void PortableExp(std::span<const double> x, std::span<double> out);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SAMPLING_PORTABLE_EXP_H_
