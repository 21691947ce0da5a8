// One kernel for a transfer's byte runs: the cuda_ipc backend's copies.
//
// A cudaMemcpyAsync a run costs a launch per block of a scattered block table,
// and between an IPC-mapped pool and a local one the copies reached 310 GB/s
// where the same copies within one process reached 520 (H200, 2 MiB blocks).
// Instead the runs are cut into chunks of at most kCopyChunkBytes and copied
// by one kernel, every CTA taking chunks in turn with 16-byte loads.
#ifndef TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_
#define TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

namespace tandem::kvtransfer::cuda_ipc {

// One chunk: `bytes` from `src` to `dst`, all three multiples of 16.
struct CopyChunk {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(CopyChunk) == 24);

inline constexpr int64_t kCopyChunkBytes = int64_t{256} << 10;

// Appends the chunks of copying `bytes` from `src` to `dst` to `out`; false
// (nothing appended) where src, dst or bytes is not a multiple of 16.
bool AppendChunks(uint64_t src, uint64_t dst, int64_t bytes, std::vector<CopyChunk>* out);

// Copies the `n` chunks at `chunks` (device memory) on `stream` with one
// kernel of at most `max_ctas` CTAs. The launch's error.
cudaError_t LaunchCopyChunks(const CopyChunk* chunks, int n, int max_ctas, cudaStream_t stream);

}  // namespace tandem::kvtransfer::cuda_ipc

#endif  // TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_
