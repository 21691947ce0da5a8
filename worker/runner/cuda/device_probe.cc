#include "worker/runner/cuda/device_probe.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/paged_attention.h"
#include "worker/runner/cuda/lt_gemm.h"

namespace tandem::worker {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("device probe: ", what, ": ", cudaGetErrorString(e)));
}

// Median seconds of `repeats` runs of `op` on `stream`, after two warm-ups.
template <typename Op>
absl::StatusOr<double> TimeMedian(cudaStream_t stream, int repeats, const Op& op) {
  cudaEvent_t start, stop;
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&start), "cudaEventCreate"));
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&stop), "cudaEventCreate"));
  std::vector<double> times;
  absl::Status status;
  for (int i = 0; i < repeats + 2 && status.ok(); ++i) {
    cudaEventRecord(start, stream);
    status = op();
    cudaEventRecord(stop, stream);
    if (status.ok()) status = Cuda(cudaEventSynchronize(stop), "time a run");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) times.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RETURN_IF_ERROR(status);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Buffer {
  void* p = nullptr;
  ~Buffer() { cudaFree(p); }
};

}  // namespace

absl::StatusOr<DeviceRates> MeasureDeviceRates(int device) {
  if (const char* why = nullptr; !kernels::cuda::Available(&why)) return absl::FailedPreconditionError(why);
  RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
  DeviceRates r;
  cudaDeviceProp prop{};
  RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  r.name = prop.name;
  r.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  cudaStream_t stream;
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  absl::Status status = [&]() -> absl::Status {
    {
      constexpr size_t kCopyBytes = size_t{1} << 30;
      Buffer a, b;
      RETURN_IF_ERROR(Cuda(cudaMalloc(&a.p, kCopyBytes), "cudaMalloc"));
      RETURN_IF_ERROR(Cuda(cudaMalloc(&b.p, kCopyBytes), "cudaMalloc"));
      RETURN_IF_ERROR(Cuda(cudaMemsetAsync(a.p, 1, kCopyBytes, stream), "cudaMemset"));
      ASSIGN_OR_RETURN(double s, TimeMedian(stream, 10, [&] {
                         return Cuda(cudaMemcpyAsync(b.p, a.p, kCopyBytes, cudaMemcpyDeviceToDevice, stream), "copy");
                       }));
      r.copy_bytes_per_s = 2.0 * double(kCopyBytes) / s;
    }
    constexpr int kN = 8192;
    constexpr int64_t kWorkspace = int64_t{32} << 20;
    Buffer x, w, y, ws;
    RETURN_IF_ERROR(Cuda(cudaMalloc(&x.p, size_t(kN) * kN * 2), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&w.p, size_t(kN) * kN * 2), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&y.p, size_t(kN) * kN * 2), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMalloc(&ws.p, kWorkspace), "cudaMalloc"));
    // Small values (bytes 0x3c3c: bf16 0.0115) so the product stays finite.
    RETURN_IF_ERROR(Cuda(cudaMemsetAsync(x.p, 0x3c, size_t(kN) * kN * 2, stream), "cudaMemset"));
    RETURN_IF_ERROR(Cuda(cudaMemsetAsync(w.p, 0x3c, size_t(kN) * kN * 2, stream), "cudaMemset"));
    ASSIGN_OR_RETURN(std::unique_ptr<LtGemm> gemm, LtGemm::Create(ws.p, kWorkspace));
    ASSIGN_OR_RETURN(double s, TimeMedian(stream, 10, [&] {
                       return gemm->Gemm(x.p, kN, kN, w.p, kN, 0.0f, y.p, LtGemm::Out::kBF16, stream);
                     }));
    r.bf16_flops = 2.0 * double(kN) * kN * kN / s;
    return absl::OkStatus();
  }();
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  RETURN_IF_ERROR(status);
  return r;
}

}  // namespace tandem::worker
