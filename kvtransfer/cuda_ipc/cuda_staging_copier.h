// The CUDA StagingCopier: KV blocks in GPU memory to and from pinned host
// staging slots (cudaHostAlloc), for `ucx_staged` between GPU pools on hosts
// whose UCX has no CUDA transports. Each direction has a stream of its own
// (a sender's gathers do not wait behind its receives' scatters); a Start
// issues one cudaMemcpyAsync a run and records an event, which Poll queries,
// so the progress thread never blocks on the GPU and a chunk's copy runs
// while the network carries the chunks before it.
#ifndef TANDEM_KVTRANSFER_CUDA_IPC_CUDA_STAGING_COPIER_H_
#define TANDEM_KVTRANSFER_CUDA_IPC_CUDA_STAGING_COPIER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvtransfer/staging/staging_copier.h"

namespace tandem::kvtransfer {

// For a pool on GPU `device`. Unavailable where the device cannot be used.
absl::StatusOr<std::unique_ptr<StagingCopier>> NewCudaStagingCopier(int device);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_CUDA_IPC_CUDA_STAGING_COPIER_H_
