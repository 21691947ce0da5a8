// LtGemm: the CUDA runner's matrix products through cuBLASLt, loaded at run
// time (dlopen), so a tandem binary starts on machines without the CUDA
// libraries and only the cuda runner needs them. The library is found as
// TANDEM_CUBLASLT (a path) when set, else as libcublasLt.so.13 on the loader's
// path (LD_LIBRARY_PATH; on machines with PyTorch, its nvidia/cu13/lib).
//
// Y[m, n] = X[m, k] . W[n, k]^T + beta * Y, row-major, W as Hugging Face
// stores a linear layer's weight; X and W bfloat16, Y bfloat16 or float32,
// accumulation in float32. The algorithm for each shape is chosen by
// cuBLASLt's heuristic once and cached. With `single_pass` only algorithms
// that reduce each dot product in one pass (no split-K) are taken, so that a
// row's result does not depend on the other rows of the product (lt_gemm_test
// checks it bit for bit): the batch-invariant mode's, which costs small
// products (decode) much of their bandwidth.
//
// Not thread-safe: one per runner, used from the engine thread.
#ifndef TANDEM_WORKER_RUNNER_CUDA_LT_GEMM_H_
#define TANDEM_WORKER_RUNNER_CUDA_LT_GEMM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/statusor.h"

namespace tandem::worker {

class LtGemm {
 public:
  enum class Out { kBF16, kF32 };

  // FailedPrecondition naming the library when it cannot be loaded.
  // `workspace` is device memory of `workspace_bytes`, owned by the caller.
  static absl::StatusOr<std::unique_ptr<LtGemm>> Create(void* workspace, int64_t workspace_bytes,
                                                        bool single_pass = false);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Enqueues the product on `stream` (a cudaStream_t). beta is 0 or 1.
  absl::Status Gemm(const void* x, int m, int k, const void* w, int n, float beta, void* y, Out out, void* stream);

  // Plans the product for every m from 1 to max_m and runs it once (beta 0,
  // into y) for each distinct algorithm among them, so that no later Gemm
  // of these shapes picks a kernel that was never launched. cuBLASLt loads a
  // kernel at its first launch, and loading waits for all of the device's
  // work, an NCCL receive posted until its peer sends included (found on an
  // H200: CudaRunnerTest.FirstUseCallsNeverWaitForOtherStreamsWork). x and y
  // hold max_m rows. Returns the number of distinct algorithms.
  absl::StatusOr<int> Preload(const void* x, int max_m, int k, const void* w, int n, void* y, Out out, void* stream);

 private:
  struct Api;
  struct Plan;
  using Key = std::tuple<int, int, int, Out>;  // m, n, k, out
  LtGemm(std::unique_ptr<Api> api, void* handle, void* workspace, int64_t workspace_bytes, bool single_pass);
  absl::StatusOr<const Plan*> PlanFor(const Key& key);

  std::unique_ptr<Api> api_;
  void* handle_;  // cublasLtHandle_t
  void* workspace_;
  int64_t workspace_bytes_;
  bool single_pass_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_RUNNER_CUDA_LT_GEMM_H_
