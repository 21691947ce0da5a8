// The one-row products of a decode step, timed as the step runs them: each
// Llama-3.1-8B product as the engine launches it (its epilogue, and whether
// it norms its own input) in a chain of 32 layers' launches (distinct
// weights per layer, so nothing stays in L2) captured in one CUDA graph, for
// every split of a row over warps (GemvFusion::split) and against a plain
// grid-stride read of the same bytes. (The QKV product's RoPE-and-KV-write
// epilogue is stood in for by SiLU-and-multiply: the same two rows a warp.) Not part of the cmake build (no absl:
// it builds with nvcc alone). Build and run on an H100/H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. \
//     worker/runner/cuda/model_kernels.cu worker/runner/cuda/bench/gemv_chain.cu -o gemv_chain
//   ./gemv_chain
//
// Prints, per product, each configuration's median time per launch over five
// interleaved rounds and its read rate.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "worker/runner/cuda/model_kernels.h"

namespace {

#define CK(x)                                                                               \
  do {                                                                                      \
    const cudaError_t ck_error = static_cast<cudaError_t>(x);                               \
    if (ck_error != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(ck_error)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// The device's read ceiling for a buffer: every 16-byte word loaded once.
__global__ void ReadKernel(const uint4* p, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

struct Shape {
  const char* name;
  int n, k, layers;  // n: the launch's units (rows, or row pairs where `epi` takes two)
  tandem::worker::cuda_ops::GemvEpilogue epi;
  bool norm;  // x is the RMS norm of a float32 residual, built by every CTA
};

}  // namespace

int main() {
  namespace ops = tandem::worker::cuda_ops;
  using E = ops::GemvEpilogue;
  const Shape shapes[] = {{"QKV 6144 x 4096, normed, row pairs", 3072, 4096, 32, E::kSiluMul, true},
                          {"output 4096 x 4096, residual", 4096, 4096, 32, E::kResidual, false},
                          {"gate/up 28672 x 4096, normed, SiLU", 14336, 4096, 32, E::kSiluMul, true},
                          {"down 4096 x 14336, residual", 4096, 14336, 32, E::kResidual, false},
                          {"LM head 128256 x 4096", 128256, 4096, 2, E::kStore, false}};
  const int configs[] = {1, 2, 4, 8, 0};  // warps a row; 0: the plain read
  constexpr int kConfigs = sizeof(configs) / sizeof(configs[0]);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s\n", prop.name);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Shape& sh : shapes) {
    const int rows = sh.epi == ops::GemvEpilogue::kSiluMul ? 2 * sh.n : sh.n;
    const int64_t per = int64_t{rows} * sh.k;
    __nv_bfloat16 *w, *x, *y, *gamma;
    float* residual;
    CK(cudaMalloc(&w, per * 2 * sh.layers));
    CK(cudaMemset(w, 0x3c, per * 2 * sh.layers));  // finite values; the time does not depend on them
    CK(cudaMalloc(&x, sh.k * 2));
    CK(cudaMemset(x, 0x3c, sh.k * 2));
    CK(cudaMalloc(&y, rows * 2));
    CK(cudaMalloc(&gamma, sh.k * 2));
    CK(cudaMemset(gamma, 0x3c, sh.k * 2));
    CK(cudaMalloc(&residual, std::max(sh.n, sh.k) * 4));
    CK(cudaMemset(residual, 0, std::max(sh.n, sh.k) * 4));
    std::vector<cudaGraphExec_t> execs(kConfigs);
    for (int c = 0; c < kConfigs; ++c) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
      for (int l = 0; l < sh.layers; ++l) {
        const __nv_bfloat16* wl = w + per * l;
        if (configs[c] == 0) {
          ReadKernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(wl), per / 8, sink);
          CK(cudaGetLastError());
        } else {
          ops::GemvFusion f{.split = configs[c]};
          if (sh.norm) {
            f.norm_x = residual;
            f.norm_weight = gamma;
            f.eps = 1e-5f;
          }
          if (sh.epi == ops::GemvEpilogue::kResidual) f.residual = residual;
          CK(ops::LaunchGemvFused(x, sh.k, wl, sh.n, y, sh.epi, f, s));
        }
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&execs[c], g, 0));
      CK(cudaGraphDestroy(g));
    }
    std::vector<std::vector<float>> us(kConfigs);
    for (int round = 0; round < 5; ++round) {
      for (int c = 0; c < kConfigs; ++c) {
        CK(cudaGraphLaunch(execs[c], s));  // warm
        CK(cudaEventRecord(e0, s));
        for (int rep = 0; rep < 5; ++rep) CK(cudaGraphLaunch(execs[c], s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        us[c].push_back(ms * 1e3f / (5 * sh.layers));
      }
    }
    std::printf("%s (%.1f MB a launch)\n", sh.name, per * 2 / 1e6);
    for (int c = 0; c < kConfigs; ++c) {
      std::sort(us[c].begin(), us[c].end());
      const float med = us[c][us[c].size() / 2];
      char label[32];
      std::snprintf(label, sizeof(label), configs[c] == 0 ? "plain read" : "%d warp(s) a row", configs[c]);
      std::printf("  %-18s %8.2f us %7.0f GB/s  (rounds %.2f-%.2f)\n", label, med, per * 2 / med / 1e3, us[c].front(),
                  us[c].back());
    }
    for (cudaGraphExec_t e : execs) CK(cudaGraphExecDestroy(e));
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(gamma));
    CK(cudaFree(residual));
  }
  return 0;
}
