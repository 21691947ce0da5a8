// StagingCopier: the copies between a KV pool and host staging slots that a
// staged send/receive transport (`ucx_staged`) makes on each side of the
// network: the sender gathers a chunk's blocks from its pool into a slot
// and sends the slot; the receiver receives into a slot and scatters it
// into its pool's blocks. The host copier is memcpy (host pools: the same
// protocol on machines without a GPU, which is how CI drives it); the CUDA
// copier (kvtransfer/cuda_ipc/cuda_staging_copier.h) is cudaMemcpyAsync
// between device blocks and pinned slots on streams of its own, so a chunk's
// copy overlaps the network carrying the chunks before it.
//
// Called from the transport's progress thread only (one caller at a time).
#ifndef TANDEM_KVTRANSFER_STAGING_STAGING_COPIER_H_
#define TANDEM_KVTRANSFER_STAGING_STAGING_COPIER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

class StagingCopier {
 public:
  enum class Direction {
    kToStaging,    // pool + run.src_offset -> staging + run.dst_offset
    kFromStaging,  // staging + run.src_offset -> pool + run.dst_offset
  };

  virtual ~StagingCopier() = default;

  // The pool memory it reads and writes.
  virtual MemoryType memory() const = 0;

  // Host memory for `bytes` of staging that this copier copies to and from
  // at full speed (pinned, for a GPU), owned by the caller until
  // FreeStaging; or null where any host memory does (the transport then
  // allocates its own).
  virtual absl::StatusOr<void*> AllocateStaging(int64_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual void FreeStaging(void* staging) { (void)staging; }

  // True once the writes behind `fence` completed (never blocks).
  virtual bool Ready(const WriteFence& fence) const = 0;

  // Starts copying `runs` in `direction`; returns a ticket for Poll.
  virtual absl::StatusOr<uint64_t> Start(Direction direction, uint8_t* pool, uint8_t* staging,
                                         std::span<const CopyRun> runs) = 0;
  // True once the ticket's copies completed (the ticket is then spent),
  // false while they run, or their error (spent too).
  virtual absl::StatusOr<bool> Poll(uint64_t ticket) = 0;
};

// memcpy on the calling thread: Start completes the copies, Poll says so.
std::unique_ptr<StagingCopier> NewHostStagingCopier();

// The copies of one chunk of a staged transfer: `pairs` (the chunk's block
// pairs, in order) packed back to back in a slot. kToStaging (the sender):
// pool offsets pair.src * block_bytes -> slot offsets; kFromStaging (the
// receiver): slot offsets -> pool offsets pair.dst * block_bytes. Runs
// contiguous on both sides are merged.
std::vector<CopyRun> StagingRuns(std::span<const BlockPair> pairs, int64_t block_bytes,
                                 StagingCopier::Direction direction);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_STAGING_STAGING_COPIER_H_
