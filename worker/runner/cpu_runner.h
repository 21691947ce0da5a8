// The "cpu" ModelRunner: LlamaModel's forward pass (f32, OpenBLAS, the CPU
// attention kernels) and the CPU sampler over its logits.
#ifndef TANDEM_WORKER_RUNNER_CPU_RUNNER_H_
#define TANDEM_WORKER_RUNNER_CPU_RUNNER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/runner/model_runner.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCpuRunner(ModelConfig config,
                                                          std::shared_ptr<const TensorSource> tensors,
                                                          const RunnerOptions& options);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CPU_RUNNER_H_
