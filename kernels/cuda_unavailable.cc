// cuda:: in a build without nvcc: every call says so.
#include "kernels/paged_attention.h"

namespace tandem::kernels::cuda {
namespace {
constexpr char kWhy[] = "this binary was built without CUDA (no nvcc at configure time, or TANDEM_CUDA=OFF)";
absl::Status Unavailable() { return absl::FailedPreconditionError(kWhy); }
}  // namespace

bool Available(const char** why) {
  if (why != nullptr) *why = kWhy;
  return false;
}
int DeviceCount() { return 0; }
bool CanAccessPeer(int, int) { return false; }
int64_t WorkspaceBytes(int, int, int, int) { return kErrorWordBytes; }
int64_t FixedSplitWorkspaceBytes(int, int, int, int, int) { return kErrorWordBytes; }
absl::Status WriteKvCache(const WriteKvParams&) { return Unavailable(); }
absl::Status PagedAttention(const PagedAttentionParams&) { return Unavailable(); }
absl::Status TakeError(void*, void*) { return Unavailable(); }
absl::Status ReadErrorAsync(void*, int*, void*) { return Unavailable(); }
absl::Status ErrorFromWord(int, void*, void*) { return Unavailable(); }

}  // namespace tandem::kernels::cuda
