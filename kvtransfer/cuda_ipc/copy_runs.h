// One kernel for a transfer's byte runs: the cuda_ipc backend's copies.
//
// A cudaMemcpyAsync a run costs a launch per block of a scattered block table
// (H100, 256 scattered 2 MiB blocks: 1.36 ms as 256 copies, 0.42 ms as one
// kernel). The runs are cut into chunks (ChunkBytesFor: enough of them to
// keep every CTA busy, at most kMaxChunkBytes) and copied by one kernel,
// every CTA taking chunks in turn with 16-byte loads. The kernel reads the
// chunk descriptors where the caller put them: mapped pinned host memory
// spares a copy to the device before the launch.
#ifndef TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_
#define TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tandem::kvtransfer::cuda_ipc {

// One chunk: `bytes` from `src` to `dst`, all three multiples of 16.
struct CopyChunk {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(CopyChunk) == 24);

inline constexpr int64_t kMinChunkBytes = int64_t{8} << 10;
inline constexpr int64_t kMaxChunkBytes = int64_t{256} << 10;

// The chunk size for a transfer of `total_bytes` on `max_ctas` CTAs: about
// one chunk a CTA, a multiple of 16 in [kMinChunkBytes, kMaxChunkBytes].
int64_t ChunkBytesFor(int64_t total_bytes, int max_ctas);

// Appends the chunks of copying `bytes` from `src` to `dst` (at most
// `chunk_bytes` each) to `out`; false (nothing appended) where src, dst or
// bytes is not a multiple of 16.
bool AppendChunks(uint64_t src, uint64_t dst, int64_t bytes, int64_t chunk_bytes, std::vector<CopyChunk>* out);

// One copy of a transfer: `bytes` from `src` to `dst` (device addresses).
struct CopySpan {
  uint64_t src = 0;
  uint64_t dst = 0;
  int64_t bytes = 0;
};

// The chunks of `spans`, in order, cut for `max_ctas` CTAs (ChunkBytesFor
// their total); false where one is not of 16-byte multiples (`out` then
// holds the chunks before it).
bool ChunksOf(const std::vector<CopySpan>& spans, int max_ctas, std::vector<CopyChunk>* out);

// Copies the `n` chunks at `chunks` (memory the device reads: device memory
// or mapped pinned host memory, unchanged until the kernel ends) on
// `stream` with one kernel of at most `max_ctas` CTAs. The launch's error.
cudaError_t LaunchCopyChunks(const CopyChunk* chunks, int n, int max_ctas, cudaStream_t stream);

}  // namespace tandem::kvtransfer::cuda_ipc

#endif  // TANDEM_KVTRANSFER_CUDA_IPC_COPY_RUNS_H_
