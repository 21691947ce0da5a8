// The "cuda" runner of a build without nvcc (TANDEM_CUDA=OFF, or AUTO where
// no CUDA compiler was found): registered so that `--device cuda` says why it
// cannot run rather than that no such runner exists.
#include "absl/status/status.h"
#include "worker/runner/builtin_runners.h"
#include "worker/runner/cuda/device_probe.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCudaRunner(ModelConfig /*config*/,
                                                           std::shared_ptr<const TensorSource> /*tensors*/,
                                                           const RunnerOptions& /*options*/) {
  return absl::FailedPreconditionError(
      "--device cuda: this tandem was built without CUDA (no nvcc at build time, or TANDEM_CUDA=OFF); rebuild on a "
      "machine with the CUDA toolkit");
}

absl::StatusOr<DeviceRates> MeasureDeviceRates(int /*device*/) {
  return absl::FailedPreconditionError("this tandem was built without CUDA");
}

}  // namespace tandem::worker
