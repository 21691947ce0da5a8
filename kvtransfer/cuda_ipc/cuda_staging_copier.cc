#include "kvtransfer/cuda_ipc/cuda_staging_copier.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("ucx_staged: ", what, ": ", cudaGetErrorString(e)));
}

class CudaStagingCopier final : public StagingCopier {
 public:
  explicit CudaStagingCopier(int device) : device_(device) {}
  ~CudaStagingCopier() override {
    cudaSetDevice(device_);
    for (cudaStream_t s : streams_) {
      if (s != nullptr) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
    }
    for (auto& [ticket, event] : events_) cudaEventDestroy(event);
    for (cudaEvent_t e : spare_) cudaEventDestroy(e);
  }

  absl::Status Init() {
    if (absl::Status st = Cuda(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
    for (cudaStream_t& s : streams_) {
      if (absl::Status st = Cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }

  MemoryType memory() const override { return MemoryType::kCuda; }

  absl::StatusOr<void*> AllocateStaging(int64_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    if (absl::Status st = Cuda(cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable),
                               "cudaHostAlloc of the staging ring");
        !st.ok()) {
      return absl::ResourceExhaustedError(st.message());
    }
    return p;
  }
  void FreeStaging(void* staging) override {
    cudaSetDevice(device_);
    cudaFreeHost(staging);
  }

  bool Ready(const WriteFence& fence) const override {
    if (fence.Completed()) return true;
    if (fence.memory() != MemoryType::kCuda || fence.cuda_event() == nullptr) return false;
    return cudaEventQuery(static_cast<cudaEvent_t>(fence.cuda_event())) == cudaSuccess;
  }

  absl::StatusOr<uint64_t> Start(Direction direction, uint8_t* pool, uint8_t* staging,
                                 std::span<const CopyRun> runs) override {
    cudaSetDevice(device_);
    const bool to = direction == Direction::kToStaging;
    cudaStream_t stream = streams_[to ? 0 : 1];
    for (const CopyRun& r : runs) {
      uint8_t* dst = (to ? staging : pool) + r.dst_offset;
      const uint8_t* src = (to ? pool : staging) + r.src_offset;
      if (absl::Status st = Cuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(r.bytes),
                                                 to ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, stream),
                                 "cudaMemcpyAsync");
          !st.ok()) {
        cudaStreamSynchronize(stream);  // nothing of it runs on after the error
        return st;
      }
    }
    cudaEvent_t event = nullptr;
    if (!spare_.empty()) {
      event = spare_.back();
      spare_.pop_back();
    } else if (absl::Status st = Cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
               !st.ok()) {
      return st;
    }
    if (absl::Status st = Cuda(cudaEventRecord(event, stream), "cudaEventRecord"); !st.ok()) {
      spare_.push_back(event);
      return st;
    }
    events_[++next_ticket_] = event;
    return next_ticket_;
  }

  absl::StatusOr<bool> Poll(uint64_t ticket) override {
    auto it = events_.find(ticket);
    if (it == events_.end()) return absl::InternalError("ucx_staged: unknown copy ticket");
    const cudaError_t e = cudaEventQuery(it->second);
    if (e == cudaErrorNotReady) return false;
    spare_.push_back(it->second);
    events_.erase(it);
    if (absl::Status st = Cuda(e, "the staging copy"); !st.ok()) return st;
    return true;
  }

 private:
  const int device_;
  cudaStream_t streams_[2] = {nullptr, nullptr};  // to staging, from staging
  absl::flat_hash_map<uint64_t, cudaEvent_t> events_;
  std::vector<cudaEvent_t> spare_;
  uint64_t next_ticket_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StagingCopier>> NewCudaStagingCopier(int device) {
  auto copier = std::make_unique<CudaStagingCopier>(device);
  if (absl::Status st = copier->Init(); !st.ok()) return absl::UnavailableError(st.message());
  return copier;
}

}  // namespace tandem::kvtransfer
