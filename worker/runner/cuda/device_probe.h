// What a GPU can do, measured: the baselines `tandem bench engine --device
// cuda` reports its numbers against, taken in the same run.
#ifndef TANDEM_WORKER_RUNNER_CUDA_DEVICE_PROBE_H_
#define TANDEM_WORKER_RUNNER_CUDA_DEVICE_PROBE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::worker {

struct DeviceRates {
  std::string name;             // "NVIDIA H100 80GB HBM3"
  int64_t memory_bytes = 0;     // the device's total
  double copy_bytes_per_s = 0;  // device-to-device copy, bytes read plus written per second
  double bf16_flops = 0;        // an 8192^3 bf16 product through cuBLASLt (float32 accumulation)
};

// Measures device `device` (medians of timed repeats after a warm-up).
// FailedPrecondition without a usable GPU or cuBLASLt.
absl::StatusOr<DeviceRates> MeasureDeviceRates(int device);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CUDA_DEVICE_PROBE_H_
