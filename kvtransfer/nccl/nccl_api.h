// NcclApi: what the NCCL KV transport (issue 24; docs/plans/issue-24-nccl.md)
// needs of NCCL, behind one interface: the real library, loaded at run time
// (dlopen, as cuBLASLt is, so a tandem built here runs where libnccl is and
// says clearly where it is not), and an in-process fake that CPU tests drive
// the backend's bookkeeping with (pairing, the order of a pair's transfers,
// aborts and peer loss) on machines without GPUs.
//
// A communicator joins the two workers of one prefill/decode pair (ranks 0
// and 1), created non-blocking so that no call waits past a deadline: Ready
// polls its creation, Done a transfer's completion, and both report the
// communicator's asynchronous error. NCCL matches a pair's sends and
// receives one by one in the order they are posted (no tags; group
// boundaries need not agree): both sides must post a pair's buffers in the
// same order and sizes.
//
// Thread safety: an instance may be used from any thread; one communicator
// from one thread at a time.
#ifndef TANDEM_KVTRANSFER_NCCL_NCCL_API_H_
#define TANDEM_KVTRANSFER_NCCL_NCCL_API_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::kvtransfer {

class NcclApi {
 public:
  // NCCL_UNIQUE_ID_BYTES: the size of the id rank 0 creates and rank 1 joins with.
  static constexpr size_t kUniqueIdBytes = 128;

  // One contiguous device buffer of a transfer.
  struct Buffer {
    uint8_t* data;
    int64_t bytes;
  };
  // One device-to-device copy of a staged transfer (Copies).
  struct Copy {
    const uint8_t* src;
    uint8_t* dst;
    int64_t bytes;
  };

  virtual ~NcclApi() = default;

  // A fresh communicator id (kUniqueIdBytes), for rank 0 to hand to rank 1.
  virtual absl::StatusOr<std::string> UniqueId() = 0;
  // Starts joining the communicator of `unique_id` as `rank` (0 or 1) with
  // `device`; returns its handle at once (poll Ready). InvalidArgument for a
  // malformed id or rank.
  virtual absl::StatusOr<void*> InitRank(std::string_view unique_id, int rank, int device) = 0;
  // True once both ranks joined, false while creation runs; the error that
  // ended it otherwise.
  virtual absl::StatusOr<bool> Ready(void* comm) = 0;
  // Posts one group of sends (or receives) of `buffers`, in order, to (from)
  // the other rank; returns a ticket for Done. The comm must be Ready and
  // Idle (a non-blocking communicator takes no call while it enqueues a
  // group; the first group to a peer enqueues only once the peer posts its
  // own).
  // `after`: a ticket of Copies that the group waits for on the device (0,
  // or a ticket already Done: none).
  virtual absl::StatusOr<uint64_t> Group(void* comm, bool send, std::span<const Buffer> buffers, uint64_t after) = 0;
  absl::StatusOr<uint64_t> Group(void* comm, bool send, std::span<const Buffer> buffers) {
    return Group(comm, send, buffers, 0);
  }
  // Enqueues `copies` (one kernel; 16-byte multiples on the GPU) on the
  // comm's copy stream, after the group of ticket `after` ended on the
  // device (0, or a ticket already Done: at once); returns a ticket for Done
  // and for a later Group's `after`. How a staged transfer gathers its runs
  // into a staging buffer before a send, or scatters them after a receive.
  virtual absl::StatusOr<uint64_t> Copies(void* comm, std::span<const Copy> copies, uint64_t after) = 0;
  // True when the comm takes a call: its last group is enqueued (not
  // necessarily done); the communicator's error otherwise.
  virtual absl::StatusOr<bool> Idle(void* comm) = 0;
  // True once the group's bytes moved; false while they move; the
  // communicator's error otherwise (a failed communicator fails every
  // ticket of it).
  virtual absl::StatusOr<bool> Done(void* comm, uint64_t ticket) = 0;
  // Ends the communicator at once (its transfers in flight fail, on both
  // ranks); the handle is gone after.
  virtual void Abort(void* comm) = 0;
  // Ends a communicator with nothing in flight; the handle is gone after.
  virtual void Destroy(void* comm) = 0;

  // Small buffers on `device` that groups send and receive (transfer
  // headers): device memory (the fake: host memory).
  virtual absl::StatusOr<void*> Alloc(int device, int64_t bytes) = 0;
  virtual void Free(int device, void* buffer) = 0;
  // Host bytes into such a buffer, ordered before the comm's next group.
  virtual absl::Status Write(void* comm, void* buffer, const void* src, int64_t bytes) = 0;
  // Its bytes (landed by a group that is Done) into host memory; blocks
  // while the copy runs.
  virtual absl::Status Read(void* comm, void* dst, const void* buffer, int64_t bytes) = 0;
  // True once a cudaEvent_t (a write fence's) completed; the fake: always.
  virtual absl::StatusOr<bool> EventDone(void* event) = 0;
  // The GPU's PCI bus id ("" where not known, as in the fake): two ranks
  // must be two GPUs.
  virtual std::string DeviceBusId(int device) = 0;
};

// The real NCCL: libnccl.so.2 from $TANDEM_NCCL (a path) or the loader's
// search path, and the CUDA runtime for the streams and events behind
// Group and Done. Unavailable, naming what to set, where it cannot be loaded
// (or is older than 2.19: non-blocking communicators).
absl::StatusOr<std::unique_ptr<NcclApi>> LoadNccl();

// The fake's "network": fakes that share one reach each other's
// communicators by unique id, and move host memory with memcpy.
class FakeNcclFabric;
std::shared_ptr<FakeNcclFabric> NewFakeNcclFabric();
std::unique_ptr<NcclApi> NewFakeNccl(std::shared_ptr<FakeNcclFabric> fabric);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_NCCL_NCCL_API_H_
