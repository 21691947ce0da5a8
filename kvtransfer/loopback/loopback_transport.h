// LoopbackTransport: a real in-process Transport. Transports that share a
// LoopbackFabric reach each other's registered pools directly and copy with
// memcpy on their own copy thread, honouring deadlines, cancellation and peer
// removal exactly as a network backend must. Used by unit and integration
// tests, and under FaultInjectingTransport to exercise every failure path.
//
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_LOOPBACK_LOOPBACK_TRANSPORT_H_
#define TANDEM_KVTRANSFER_LOOPBACK_LOOPBACK_TRANSPORT_H_

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

// The "network" of loopback transports: agent id -> registered pool.
class LoopbackFabric {
 public:
  struct Pool {
    PoolLayout layout;
    uint8_t* base = nullptr;
  };
  void Register(const std::string& agent_id, const Pool& pool);
  void Unregister(const std::string& agent_id);
  // Null if the agent is gone.
  std::shared_ptr<const Pool> Find(const std::string& agent_id) const;

 private:
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Pool>> pools_;
};

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric);
  ~LoopbackTransport() override;  // pending transfers finish with Cancelled

  std::string backend() const override { return "loopback"; }
  TransportCapabilities capabilities() const override {
    return {.push = true, .pull = true, .memory = {MemoryType::kHost}};
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

 private:
  struct Transfer {
    uint64_t id;
    std::string peer;
    bool push;
    std::vector<CopyRun> runs;
    Deadline deadline;
    TransferDone done;
  };
  absl::StatusOr<uint64_t> Start(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                 TransferDone done, bool push);
  void CopyLoop();

  const std::shared_ptr<LoopbackFabric> fabric_;
  const std::string agent_id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  PoolLayout layout_ ABSL_GUARDED_BY(mu_);
  uint8_t* base_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::flat_hash_map<std::string, PoolLayout> peers_ ABSL_GUARDED_BY(mu_);
  std::deque<Transfer> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, bool> cancelled_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_LOOPBACK_LOOPBACK_TRANSPORT_H_
