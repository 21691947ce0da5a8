// Vectorizable float loops shared by the CPU kernels and the CPU model:
// dot products, axpy, a fast exp, softmax. Built for AVX-512, AVX2 and
// baseline x86-64 with runtime dispatch (GCC target_clones), so one binary
// runs fast on any x86-64 machine. Pure functions; thread-safe.
#ifndef TANDEM_KERNELS_CPU_VECTOR_MATH_H_
#define TANDEM_KERNELS_CPU_VECTOR_MATH_H_

#include <cstdint>

namespace tandem::kernels::cpu {

float Dot(const float* a, const float* b, int n);
// y += alpha * x
void Axpy(float alpha, const float* x, float* y, int n);
// x[i] = exp(x[i] - shift); returns the sum of the results (in double).
// exp is a degree-6 polynomial after range reduction: relative error < 2e-7.
double ExpShiftSum(float* x, float shift, int n);
// out = silu(gate) * up = gate / (1 + exp(-gate)) * up, with the fast exp.
void SiluMul(const float* gate, const float* up, float* out, int n);
// out = x / sqrt(mean(x^2) + eps) * weight (sum of squares in 16 float lanes).
void RmsNorm(const float* x, const float* weight, float eps, float* out, int n);
// x *= s
void Scale(float* x, float s, int n);
float MaxOf(const float* x, int n);

}  // namespace tandem::kernels::cpu

#endif  // TANDEM_KERNELS_CPU_VECTOR_MATH_H_
