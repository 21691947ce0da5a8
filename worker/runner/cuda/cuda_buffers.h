// Host-side CUDA helpers of the cuda runner: errors as absl::Status, device
// and pinned host buffers that free themselves and grow to what a step needs.
// Host C++ only (cuda_runner.cc, gpu_sampler.cc).
//
// Growing never frees synchronously. cudaFree and cudaFreeHost wait for all
// of the device's work, and that includes an NCCL receive waiting for its
// peer's send (kvtransfer/nccl keeps one posted while a hand-off is open):
// a worker's step would stall until the push came, or for ever. So a device
// buffer that grows on a stream is allocated and freed stream-ordered
// (cudaMallocAsync / cudaFreeAsync on the stream that uses it), and a pinned
// buffer keeps its earlier allocations until it is destroyed, growing at
// least twofold so that they stay smaller than it.
//
// Thread safety: a buffer is used by one thread at a time.
#ifndef TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_
#define TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

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
  // `stream` (device memory only): allocated on it, in its order (nullptr:
  // cudaMalloc). Such memory is freed by Reserve on that stream, and by the
  // buffer's end on the legacy stream, which a non-blocking stream's work
  // does not wait for (its owner synchronized its stream before its end;
  // the stream may be gone by then).
  static absl::StatusOr<Buffer> Allocate(int64_t bytes, const char* what, cudaStream_t stream = nullptr) {
    Buffer b;
    if (bytes == 0) return b;
    void* p = nullptr;
    const cudaError_t e = kPinned             ? cudaMallocHost(&p, static_cast<size_t>(bytes))
                          : stream != nullptr ? cudaMallocAsync(&p, static_cast<size_t>(bytes), stream)
                                              : cudaMalloc(&p, static_cast<size_t>(bytes));
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (kPinned) return Cuda(e, what);
      size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      return absl::ResourceExhaustedError(
          absl::StrFormat("cuda runner: cannot allocate %d bytes of device memory for %s (%d of %d bytes free): %s",
                          bytes, what, free_bytes, total, cudaGetErrorString(e)));
    }
    b.ptr_ = std::unique_ptr<void, Free>(p, Free{stream != nullptr});
    b.bytes_ = bytes;
    return b;
  }
  void* get() const { return ptr_.get(); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }

  // Frees the memory now, in `stream`'s order where it was allocated so,
  // and leaves the buffer empty.
  void FreeOn(cudaStream_t stream) {
    static_assert(!kPinned, "pinned buffers keep their earlier allocations");
    void* p = ptr_.release();
    if (p != nullptr) ptr_.get_deleter().async ? cudaFreeAsync(p, stream) : cudaFree(p);
    bytes_ = 0;
  }

  // Pinned: takes `old`'s allocations (its own and those it kept), to keep
  // until this buffer is destroyed (see the top of the file).
  void Keep(Buffer&& old) {
    static_assert(kPinned, "device buffers grow stream-ordered instead");
    if (old.ptr_ != nullptr) retired_.push_back(std::move(old.ptr_));
    for (auto& r : old.retired_) retired_.push_back(std::move(r));
    old = Buffer();
  }

 private:
  struct Free {
    bool async = false;  // from cudaMallocAsync
    void operator()(void* p) const {
      if (kPinned) {
        cudaFreeHost(p);
      } else if (async) {
        cudaFreeAsync(p, nullptr);
      } else {
        cudaFree(p);
      }
    }
  };
  std::unique_ptr<void, Free> ptr_;
  int64_t bytes_ = 0;
  std::vector<std::unique_ptr<void, Free>> retired_;  // pinned: earlier allocations
};
using DeviceBuffer = Buffer<false>;
using PinnedBuffer = Buffer<true>;

// A device buffer that grows to what a step needs (contents not kept), on
// the stream that uses it: the old allocation is freed in that stream's
// order, never with a device-wide wait.
inline absl::Status Reserve(DeviceBuffer* b, int64_t bytes, const char* what, cudaStream_t stream) {
  if (b->bytes() >= bytes) return absl::OkStatus();
  b->FreeOn(stream);
  ASSIGN_OR_RETURN(*b, DeviceBuffer::Allocate(std::max<int64_t>(bytes, 1 << 16), what, stream));
  return absl::OkStatus();
}

// A pinned buffer that grows to what a step needs (contents not kept), at
// least twofold; its earlier allocations are kept (freed with it).
inline absl::Status Reserve(PinnedBuffer* b, int64_t bytes, const char* what) {
  if (b->bytes() >= bytes) return absl::OkStatus();
  ASSIGN_OR_RETURN(PinnedBuffer grown,
                   PinnedBuffer::Allocate(std::max<int64_t>({bytes, 2 * b->bytes(), int64_t{1} << 16}), what));
  grown.Keep(std::move(*b));
  *b = std::move(grown);
  return absl::OkStatus();
}

}  // namespace tandem::worker::cuda_util

#endif  // TANDEM_WORKER_RUNNER_CUDA_CUDA_BUFFERS_H_
