// UcxTransport: the UCX (1.13) backend of Transport. One-sided RMA: Push is
// ucp_put_nbx into the peer's registered pool followed by ucp_ep_flush_nbx
// (done(OK) only once the flush says the bytes are visible at the target),
// Pull is ucp_get_nbx (complete when the bytes are local).
//
// Threading: one ucp_context and one ucp_worker, created with
// UCS_THREAD_MODE_SINGLE and touched only by the transport's progress thread.
// Public methods enqueue commands to that thread (RegisterPool, AddPeer,
// RemovePeer and AllocatePool wait for theirs); `done` callbacks run on it.
// The thread keeps progressing the worker for the transport's lifetime, so
// peers writing into this pool over TCP (which needs target progress) are
// served; it sleeps on the worker's wakeup fd when idle.
//
// Failure handling: UCX detects neither a frozen peer nor, on shared memory,
// a dead one, so every transfer has a deadline (capped by
// UcxOptions::max_transfer_time). At the deadline, on Cancel, or when the
// peer is removed, the transfer ends at once with DeadlineExceeded /
// Cancelled / Unavailable. If it still had UCX operations in flight, the
// peer's endpoint is force-closed and re-created for later transfers; the
// other transfers in flight on that endpoint end with Unavailable.
// A failed or abandoned Push does NOT guarantee that no byte lands later:
// over tcp, data already sent is still applied by the target after `done`
// (measured). The receiver must keep a failed push's destination blocks out
// of use for a while (the engine quarantines them: transfer_quarantine_s).
// A failed Pull writes nothing after `done`. On the same
// host, a peer whose process is gone (checked through /proc) fails its
// transfers with Unavailable.
//
// Memory: puts over shared memory reach memcpy speed only into memory that
// UCX itself allocated (it then maps the peer's pool into the initiator and
// copies directly); AllocatePool gives such memory. RegisterPool also takes
// any host memory (slower over shared memory: copies go through the peer).
// Host memory only: Debian's UCX has no CUDA support.
//
// Staged mode (UcxOptions::staged, backend "ucx_staged"): two-sided, for
// pools UCX cannot register (GPU memory, where UCX has no CUDA transports).
// The pool itself is never registered: each side owns a ring of host
// staging slots (StagingCopier::AllocateStaging, pinned for a GPU, else
// UCX-allocated). The sender (PushAfter, once the write fence completed)
// gathers a chunk of blocks into a free slot through the copier and sends
// the slot with ucp_tag_send_nbx, tag = (the receiver's tag, chunk index),
// while the next chunk's gather runs; the slot is free again once the send
// completed. The receiver's progress thread probes arrived messages
// (ucp_tag_probe_nb), receives each one that a posted Receive expects into
// a free slot, scatters it into the pool's blocks through the copier, and
// frees the slot. Receiving by probe means a slot is never held waiting for
// a message, so any number of concurrent transfers in either direction
// progress with a fixed number of slots. A message whose Receive is not
// posted is held (UCX keeps a rendezvous message's data at the sender) for
// kUnmatchedGrace, then received and dropped, as are those of a Receive that
// ended in an error. Both sides compute the same chunks: pairs
// [i * k, (i + 1) * k) for k = the smaller of the two sides' blocks a slot.
// Pull and plain Push are refused (the receiver must take part).
//
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_
#define TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvtransfer/staging/staging_copier.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

struct UcxOptions {
  // Which UCX transports carry the data:
  //   "shm":  shared memory (UCX_TLS=sm,self), peers on this host only;
  //           no UCX failure detection (UCX cannot offer it on shm).
  //   "tcp":  TCP over `net_devices`, UCX peer-failure
  //           detection on (a killed peer fails transfers in about 1 s).
  //   "auto": whatever the UCX_* environment selects (default: all).
  std::string transports = "auto";
  // The network devices for "tcp", e.g. "eth0" (empty: $UCX_NET_DEVICES if
  // set, else "lo"); ignored otherwise.
  std::string net_devices;
  // Every transfer ends within this time even if its deadline is later: a
  // transport never waits on a peer without a deadline.
  std::chrono::milliseconds max_transfer_time{60000};
  // UCX operations one transfer keeps posted at once.
  int max_outstanding_ops = 64;

  // Staged send/receive ("ucx_staged"): pools of any memory `make_copier`
  // moves, through `staging_slots` host slots of `staging_slot_bytes`
  // (rounded down to whole blocks, at least one block) on each side.
  bool staged = false;
  int64_t staging_slot_bytes = int64_t{4} << 20;
  int staging_slots = 8;
  // The copier for a pool of `layout` (called once, by RegisterPool, on the
  // progress thread). Null: host pools only, with memcpy.
  std::function<absl::StatusOr<std::unique_ptr<StagingCopier>>(const PoolLayout&)> make_copier;
};

class UcxTransport final : public Transport {
 public:
  // Creates the UCX context and worker and starts the progress thread.
  // Unavailable if UCX cannot create them here; InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const UcxOptions& options);
  // Transfers in flight finish with Cancelled.
  // REQUIRES: not called from a `done` callback (that runs on the thread it joins).
  ~UcxTransport() override;

  std::string backend() const override { return staged_ ? "ucx_staged" : "ucx"; }
  // Shared memory only ("shm"): this host; otherwise any peer it can dial.
  std::string Domain() const override { return domain_; }
  TransportCapabilities capabilities() const override { return staged_ ? StagedCapabilities() : Capabilities(); }
  static TransportCapabilities Capabilities() {
    return {.push = true, .pull = true, .own_pool_memory = true, .memory = {MemoryType::kHost}};
  }
  // Host pools always; GPU pools where the copier factory makes a CUDA copier.
  static TransportCapabilities StagedCapabilities() {
    return {.push = true, .needs_pairing = true, .memory = {MemoryType::kHost, MemoryType::kCuda}};
  }
  absl::Status RegisterPool(const PoolLayout& layout, void* base) override;
  absl::StatusOr<PeerInfo> LocalInfo() const override;
  absl::Status AddPeer(const PeerInfo& peer) override;
  void RemovePeer(const std::string& agent_id) override;
  absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  void Cancel(uint64_t transfer_id) override;
  // Staged mode only (elsewhere the defaults: wait, then Push; Unimplemented).
  absl::StatusOr<uint64_t> PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                     std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                     TransferDone done) override;
  absl::StatusOr<uint64_t> Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                   Deadline deadline, TransferDone done) override;

  // Lets UCX allocate `bytes` of host memory (UCP_MEM_MAP_ALLOCATE: a shared
  // segment peers on this host can map), zero-filled, owned by this
  // transport and freed with it. Pass it (or an address inside it) to
  // RegisterPool, which then reuses this registration. At most one
  // allocation per transport.
  absl::StatusOr<void*> AllocatePool(int64_t bytes) override;

  class Impl;

 private:
  UcxTransport(std::unique_ptr<Impl> impl, std::string domain, bool staged);
  std::unique_ptr<Impl> impl_;
  const std::string domain_;
  const bool staged_;
};

// A byte encoding of a whole PeerInfo (layout included), for exchanges that
// have no gRPC message for it: tests and `tandem bench transfer` pipes.
std::string EncodePeerInfo(const PeerInfo& info);
absl::StatusOr<PeerInfo> DecodePeerInfo(std::string_view bytes);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_
