// Host-side CUDA helpers of the cuda runner: errors as absl::Status, device
// and pinned host buffers that free themselves and grow to what a step needs.
// Host C++ only (cuda_runner.cc, gpu_sampler.cc).
//
// Thread safety: a buffer is used by one thread at a time.
#ifndef TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_
#define TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace tandem::worker::cuda_util {

inline absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("cuda runner: ", what, ": ", cudaGetErrorString(e)));
}
inline absl::Status Launch(int e, const char* what) { return Cuda(static_cast<cudaError_t>(e), what); }

// n rounded up to 16 (the offsets of packed uploads).
inline size_t Align16(size_t n) { return (n + 15) & ~size_t{15}; }

// Device memory (or, `pinned`, page-locked host memory), freed with the buffer.
template <bool kPinned>
class Buffer {
 public:
  Buffer() = default;
  static absl::StatusOr<Buffer> Allocate(int64_t bytes, const char* what) {
    Buffer b;
    if (bytes == 0) return b;
    void* p = nullptr;
    const cudaError_t e =
        kPinned ? cudaMallocHost(&p, static_cast<size_t>(bytes)) : cudaMalloc(&p, static_cast<size_t>(bytes));
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (kPinned) return Cuda(e, what);
      size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      return absl::ResourceExhaustedError(
          absl::StrFormat("cuda runner: cannot allocate %d bytes of device memory for %s (%d of %d bytes free): %s",
                          bytes, what, free_bytes, total, cudaGetErrorString(e)));
    }
    b.ptr_.reset(p);
    b.bytes_ = bytes;
    return b;
  }
  void* get() const { return ptr_.get(); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }

 private:
  struct Free {
    void operator()(void* p) const {
      if (kPinned) {
        cudaFreeHost(p);
      } else {
        cudaFree(p);
      }
    }
  };
  std::unique_ptr<void, Free> ptr_;
  int64_t bytes_ = 0;
};
using DeviceBuffer = Buffer<false>;
using PinnedBuffer = Buffer<true>;

// A buffer that grows to what a step needs (contents not kept).
template <bool kPinned>
absl::Status Reserve(Buffer<kPinned>* b, int64_t bytes, const char* what) {
  if (b->bytes() >= bytes) return absl::OkStatus();
  *b = Buffer<kPinned>();
  ASSIGN_OR_RETURN(*b, Buffer<kPinned>::Allocate(std::max<int64_t>(bytes, 1 << 16), what));
  return absl::OkStatus();
}

}  // namespace tandem::worker::cuda_util

#endif  // TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_
