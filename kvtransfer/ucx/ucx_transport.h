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
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_
#define TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
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
};

class UcxTransport final : public Transport {
 public:
  // Creates the UCX context and worker and starts the progress thread.
  // Unavailable if UCX cannot create them here; InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const UcxOptions& options);
  // Transfers in flight finish with Cancelled.
  // REQUIRES: not called from a `done` callback (that runs on the thread it joins).
  ~UcxTransport() override;

  std::string backend() const override { return "ucx"; }
  // Shared memory only ("shm"): this host; otherwise any peer it can dial.
  std::string Domain() const override { return domain_; }
  TransportCapabilities capabilities() const override { return Capabilities(); }
  static TransportCapabilities Capabilities() {
    return {.push = true, .pull = true, .own_pool_memory = true, .memory = {MemoryType::kHost}};
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

  // Lets UCX allocate `bytes` of host memory (UCP_MEM_MAP_ALLOCATE: a shared
  // segment peers on this host can map), zero-filled, owned by this
  // transport and freed with it. Pass it (or an address inside it) to
  // RegisterPool, which then reuses this registration. At most one
  // allocation per transport.
  absl::StatusOr<void*> AllocatePool(int64_t bytes) override;

  class Impl;

 private:
  UcxTransport(std::unique_ptr<Impl> impl, std::string domain);
  std::unique_ptr<Impl> impl_;
  const std::string domain_;
};

// A byte encoding of a whole PeerInfo (layout included), for exchanges that
// have no gRPC message for it: tests and `tandem bench transfer` pipes.
std::string EncodePeerInfo(const PeerInfo& info);
absl::StatusOr<PeerInfo> DecodePeerInfo(std::string_view bytes);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_UCX_UCX_TRANSPORT_H_
