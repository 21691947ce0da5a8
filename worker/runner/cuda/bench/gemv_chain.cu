// The products of a decode step, timed as the step runs them: each
// Llama-3.1-8B product as the engine launches it (its epilogue, RoPE and the
// KV write included, and whether it norms its own input) in a chain of 32
// layers' launches (distinct weights per layer, so nothing stays in L2)
// captured in one CUDA graph, for every split of a row over warps
// (GemvFusion::split), the normed products also without their norm and with
// it in a kernel of its own, and against a plain grid-stride read of the
// same bytes. Not part of the cmake build (no absl: it builds with nvcc
// alone). Build and run on an H100/H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. \
//     worker/runner/cuda/model_kernels.cu worker/runner/cuda/bench/gemv_chain.cu -o gemv_chain
//   ./gemv_chain
//
// Prints, per product, each configuration's median time per launch over five
// interleaved rounds and its read rate. `./gemv_chain ROWS` times steps of
// ROWS tokens at the default splits (up to kMaxFusedRows) and the
// tensor-core product of a few rows (LaunchGemvMma, up to kMaxGemvMmaRows,
// with no epilogue: the engine's unfused path; add -DTANDEM_GEMV_MMA_BATCH=B
// -DTANDEM_GEMV_MMA_CTAS=C to the build to time its other shapes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/bench/dense_read.cuh"
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

struct Shape {
  const char* name;
  int n, k, layers;  // n: the launch's units (rows, or row pairs where `epi` takes two)
  tandem::worker::cuda_ops::GemvEpilogue epi;
  bool norm;     // x is the RMS norm of a float32 residual, built by every CTA
  bool lm_head;  // LaunchGemv with float32 logits, as the engine's batch-1 LM head
};

}  // namespace

int main(int argc, char** argv) {
  namespace ops = tandem::worker::cuda_ops;
  using E = ops::GemvEpilogue;
  // `gemv_chain [ROWS]`: the tokens of the step (the fused products take up
  // to kMaxFusedRows at their default splits, LaunchGemvMma up to
  // kMaxGemvMmaRows).
  const int rows = argc > 1 ? std::atoi(argv[1]) : 1;
  if (rows < 1 || rows > ops::kMaxGemvMmaRows) {
    std::fprintf(stderr, "gemv_chain: ROWS must be 1 to %d\n", ops::kMaxGemvMmaRows);
    return 2;
  }
  const int heads = 32, kv_heads = 8, hd = 128, bs = 16;
  const Shape shapes[] = {{"QKV 6144 x 4096, normed, RoPE + KV write", 3072, 4096, 32, E::kRopeWriteKv, true, false},
                          {"output 4096 x 4096, residual", 4096, 4096, 32, E::kResidual, false, false},
                          {"gate/up 28672 x 4096, normed, SiLU", 14336, 4096, 32, E::kSiluMul, true, false},
                          {"down 4096 x 14336, residual", 4096, 14336, 32, E::kResidual, false, false},
                          {"LM head 128256 x 4096 (LaunchGemv)", 128256, 4096, 2, E::kStore, false, true}};
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d token(s)\n", prop.name, rows);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned* sink;  // DenseReadKernel's word a CTA
  CK(cudaMalloc(&sink, sizeof(unsigned) * sms * 4));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // RoPE's inputs: positions, frequencies and slots of `rows` tokens, a
  // one-block pool per token.
  std::vector<double> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.0, -2.0 * i / hd);
  std::vector<int32_t> pos(rows);
  std::vector<int64_t> slots(rows);
  for (int t = 0; t < rows; ++t) {
    pos[t] = 100 + t;
    slots[t] = int64_t{t} * bs + 5;
  }
  double* d_freq;
  int32_t* d_pos;
  int64_t* d_slots;
  int* d_err;
  __nv_bfloat16 *d_pool, *d_qkv;
  CK(cudaMalloc(&d_freq, inv_freq.size() * 8));
  CK(cudaMemcpy(d_freq, inv_freq.data(), inv_freq.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_pos, rows * 4));
  CK(cudaMemcpy(d_pos, pos.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_slots, rows * 8));
  CK(cudaMemcpy(d_slots, slots.data(), rows * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_err, 4));
  CK(cudaMemset(d_err, 0, 4));
  const int qkv = (heads + 2 * kv_heads) * hd;
  CK(cudaMalloc(&d_qkv, size_t(rows) * qkv * 2));
  CK(cudaMalloc(&d_pool, size_t(rows) * 2 * kv_heads * bs * hd * 2));
  ops::RopeWriteArgs rope{.qkv = d_qkv,
                          .num_tokens = rows,
                          .qkv_stride = qkv,
                          .positions = d_pos,
                          .inv_freq = d_freq,
                          .num_heads = heads,
                          .num_kv_heads = kv_heads,
                          .head_dim = hd,
                          .slot_mapping = d_slots,
                          .error = d_err};
  rope.pool = tandem::kernels::cuda::internal::OneLayerView(d_pool, rows, bs, hd, kv_heads);
  for (const Shape& sh : shapes) {
    // Warps a row (the defaults only at several tokens, kDefault); 0: the
    // plain read; -1: LaunchGemv. A normed product also at its default
    // split with x given (kGiven: no norm at all) and with the norm in a
    // kernel of its own before it (kApart: TANDEM_FUSED_NORM_ROWS's).
    // kMma: LaunchGemvMma (the whole weight, no epilogue).
    constexpr int kDefault = 0x100, kGiven = 0x200, kApart = 0x400, kMma = 0x800;
    std::vector<int> configs = sh.lm_head && rows == 1     ? std::vector<int>{-1, 0}
                               : sh.lm_head                ? std::vector<int>{0}
                               : rows > ops::kMaxFusedRows ? std::vector<int>{0}
                               : rows > 1                  ? std::vector<int>{kDefault, 0}
                                                           : std::vector<int>{1, 2, 4, 8, 0};
    if (sh.norm && rows <= ops::kMaxFusedRows) configs.insert(configs.end() - 1, {kGiven, kApart});
    configs.insert(configs.end() - 1, kMma);
    const int n_configs = static_cast<int>(configs.size());
    const int weight_rows = sh.epi == E::kSiluMul || sh.epi == E::kRopeWriteKv ? 2 * sh.n : sh.n;
    const int64_t per = int64_t{weight_rows} * sh.k;
    __nv_bfloat16 *w, *x, *y, *gamma;
    float* residual;
    CK(cudaMalloc(&w, per * 2 * sh.layers));
    CK(cudaMemset(w, 0x3c, per * 2 * sh.layers));  // finite values; the time does not depend on them
    CK(cudaMalloc(&x, size_t(rows) * sh.k * 2));
    CK(cudaMemset(x, 0x3c, size_t(rows) * sh.k * 2));
    CK(cudaMalloc(&y, size_t(rows) * weight_rows * 4));
    CK(cudaMalloc(&gamma, sh.k * 2));
    CK(cudaMemset(gamma, 0x3c, sh.k * 2));
    const size_t res_elems = size_t(rows) * std::max(sh.n, sh.k);
    CK(cudaMalloc(&residual, res_elems * 4));
    CK(cudaMemset(residual, 0, res_elems * 4));
    std::vector<cudaGraphExec_t> execs(n_configs);
    for (int c = 0; c < n_configs; ++c) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
      for (int l = 0; l < sh.layers; ++l) {
        const __nv_bfloat16* wl = w + per * l;
        if (configs[c] == 0) {
          tandem::kernels::cuda::bench::DenseReadKernel<<<sms * 4, 512, 0, s>>>(reinterpret_cast<const uint4*>(wl),
                                                                                per / 8, sink);
          CK(cudaGetLastError());
        } else if (configs[c] < 0) {
          CK(ops::LaunchGemv(x, 1, sh.k, wl, sh.n, y, /*f32=*/true, s));
        } else if (configs[c] == kMma) {
          CK(ops::LaunchGemvMma(x, rows, sh.k, wl, weight_rows, y, /*f32=*/sh.lm_head, s));
        } else {
          ops::GemvFusion f{.split = configs[c] >= kDefault ? 0 : configs[c], .rows = rows};
          if (configs[c] == kApart) {
            CK(ops::LaunchAddRmsNorm(residual, nullptr, rows, sh.k, nullptr, nullptr, gamma, 1e-5f, x, s));
          }
          if (sh.norm && configs[c] < kGiven) {
            f.norm_x = residual;
            f.norm_weight = gamma;
            f.eps = 1e-5f;
          }
          if (sh.epi == E::kResidual) f.residual = residual;
          if (sh.epi == E::kRopeWriteKv) f.rope = rope;
          CK(ops::LaunchGemvFused(x, sh.k, wl, sh.n, y, sh.epi, f, s));
        }
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&execs[c], g, 0));
      CK(cudaGraphDestroy(g));
    }
    std::vector<std::vector<float>> us(n_configs);
    for (int round = 0; round < 5; ++round) {
      for (int c = 0; c < n_configs; ++c) {
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
    for (int c = 0; c < n_configs; ++c) {
      std::sort(us[c].begin(), us[c].end());
      const float med = us[c][us[c].size() / 2];
      char label[32];
      if (configs[c] == 0) {
        std::snprintf(label, sizeof(label), "plain read");
      } else if (configs[c] < 0) {
        std::snprintf(label, sizeof(label), "LaunchGemv");
      } else if (configs[c] == kDefault) {
        std::snprintf(label, sizeof(label), "default split");
      } else if (configs[c] == kGiven) {
        std::snprintf(label, sizeof(label), "x given, no norm");
      } else if (configs[c] == kApart) {
        std::snprintf(label, sizeof(label), "norm kernel + x");
      } else if (configs[c] == kMma) {
        std::snprintf(label, sizeof(label), "LaunchGemvMma");
      } else {
        std::snprintf(label, sizeof(label), "%d warp(s) a row", configs[c]);
      }
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
