// The model runners built into every binary, registered by
// ModelRunnerRegistry::Builtin():
//   "cpu" (cpu_runner.cc): LlamaModel's forward pass (f32, OpenBLAS, the CPU
//         attention kernels) over the weights it reads as f32, and the CPU
//         sampler over its logits.
//   "sim" (sim_runner.cc, `tandem worker --engine sim`): no compute. A step
//         lasts what RunnerOptions::sim says (SimTiming) from
//         BatchInput::started, and each sequence's token is a hash of its seed
//         and position, never an end-of-sequence token (so it runs to
//         max_tokens). The real scheduler, KV pool, prefix cache and events
//         run as usual: routing experiments at scale.
//   "cuda" (cuda/cuda_runner.cc, `tandem worker --device cuda[:N]`): the
//         forward pass on one Hopper GPU in bfloat16 (cuBLASLt, the kernels/
//         attention kernels), its KV pool in device memory. In a build
//         without nvcc (cuda_runner_unavailable.cc) it fails with
//         FailedPrecondition saying so.
#ifndef TANDEM_WORKER_RUNNER_BUILTIN_RUNNERS_H_
#define TANDEM_WORKER_RUNNER_BUILTIN_RUNNERS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/runner/model_runner.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCpuRunner(ModelConfig config,
                                                          std::shared_ptr<const TensorSource> tensors,
                                                          const RunnerOptions& options);
absl::StatusOr<std::unique_ptr<ModelRunner>> NewSimRunner(ModelConfig config,
                                                          std::shared_ptr<const TensorSource> tensors,
                                                          const RunnerOptions& options);

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCudaRunner(ModelConfig config,
                                                           std::shared_ptr<const TensorSource> tensors,
                                                           const RunnerOptions& options);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_BUILTIN_RUNNERS_H_
