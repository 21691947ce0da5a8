// FaultInjectingTransport: wraps any Transport and injects the failures a
// real network and a real peer produce, so every error path of the
// disaggregated lifecycle can be tested on one machine (in the spirit of
// leveldb's FaultInjectionTestEnv):
//   - drop:    the transfer never completes on its own; only its deadline
//              (DeadlineExceeded) or a Cancel ends it;
//   - delay:   the transfer starts after a pause;
//   - corrupt: the first pair's source block is replaced by another block,
//              so the destination receives wrong bytes and `done` says OK
//              (what a checksum must catch);
//   - fail_after_blocks = N: only the first N pairs are copied, then `done`
//              gets Unavailable ("peer lost mid-transfer");
//   - fail_submit: Push/Pull return Unavailable at once;
//   - fail_pair: Pair returns Unavailable at once;
//   - offer_pairing: not a fault but the shape of a transport that pairs
//              through an offer (as NCCL's communicator id): the
//              initiator's Pair gives the offer "tandem-offer:<its agent>"
//              and completes 50 ms later; the responder's Pair fails
//              (Unavailable) unless it is handed exactly that offer. Both
//              workers of a pair take it.
// PushAfter over a one-sided backend (the Transport default) waits for its
// fence, then Push; over a send/receive backend it goes to the backend's
// PushAfter (its Receive is the peer's). Every fault applies to it either
// way (fail_after_blocks sends the first N pairs, so the receiver misses
// the rest).
// Faults apply to the transfers started after SetFaults.
//
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_LOOPBACK_FAULT_INJECTING_TRANSPORT_H_
#define TANDEM_KVTRANSFER_LOOPBACK_FAULT_INJECTING_TRANSPORT_H_

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

struct Faults {
  bool drop = false;
  std::chrono::milliseconds delay{0};
  bool corrupt = false;
  int fail_after_blocks = -1;  // -1: off
  bool fail_submit = false;
  bool fail_pair = false;
  bool offer_pairing = false;
};

// Parses "drop", "corrupt", "fail_submit", "fail_pair", "offer_pairing", "delay_ms=N", "fail_after_blocks=N",
// comma-separated (e.g. "delay_ms=200,corrupt"); "" is no fault.
absl::StatusOr<Faults> ParseFaults(absl::string_view spec);

class FaultInjectingTransport final : public Transport {
 public:
  explicit FaultInjectingTransport(std::unique_ptr<Transport> inner);
  ~FaultInjectingTransport() override;  // held (dropped or delayed) transfers end Cancelled

  void SetFaults(const Faults& faults);
  // Transfers that a fault held back and that have not ended yet.
  int held_transfers() const;

  std::string backend() const override { return inner_->backend(); }
  TransportCapabilities capabilities() const override { return inner_->capabilities(); }
  std::string Domain() const override { return inner_->Domain(); }
  absl::StatusOr<void*> AllocatePool(int64_t bytes) override { return inner_->AllocatePool(bytes); }
  absl::Status RegisterPool(const PoolLayout& layout, void* base) override;
  absl::StatusOr<PeerInfo> LocalInfo() const override { return inner_->LocalInfo(); }
  absl::Status AddPeer(const PeerInfo& peer) override { return inner_->AddPeer(peer); }
  void RemovePeer(const std::string& agent_id) override { inner_->RemovePeer(agent_id); }
  absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  void Cancel(uint64_t transfer_id) override;
  absl::StatusOr<std::string> Pair(const PeerInfo& peer, PairRole role, std::string_view offer, Deadline deadline,
                                   TransferDone done) override;
  absl::StatusOr<uint64_t> PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                     std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                     TransferDone done) override;
  // fail_submit refuses it (Unavailable); the other faults act on the sender.
  absl::StatusOr<uint64_t> Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                   Deadline deadline, TransferDone done) override;
  void Decline(const std::string& agent_id, uint64_t tag) override { inner_->Decline(agent_id, tag); }

 private:
  enum class Op { kPush, kPull, kPushAfter };
  // What a transfer is, past its faults.
  struct Request {
    std::string agent_id;
    std::vector<BlockPair> blocks;
    Deadline deadline;
    TransferDone done;
    Op op = Op::kPush;
    uint64_t tag = 0;                         // kPushAfter
    std::shared_ptr<const WriteFence> after;  // kPushAfter
  };
  // A transfer the wrapper holds: dropped (until deadline/cancel) or delayed.
  struct Held {
    Request request;
    bool dropped;
    std::chrono::steady_clock::time_point release;  // delayed: when to start it
  };
  absl::StatusOr<uint64_t> Start(Request r);
  absl::StatusOr<uint64_t> Forward(Request r);
  void TimerLoop();

  const std::unique_ptr<Transport> inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Faults faults_ ABSL_GUARDED_BY(mu_);
  int64_t num_blocks_ ABSL_GUARDED_BY(mu_) = 0;         // the local pool's
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1ull << 62;  // ids of held transfers
  std::map<uint64_t, Held> held_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> inner_ids_ ABSL_GUARDED_BY(mu_);  // our id -> inner id
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread timer_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_LOOPBACK_FAULT_INJECTING_TRANSPORT_H_
