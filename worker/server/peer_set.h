// PeerSet: the peers a worker's KV transport is connected to, shared by the
// transfers that use them (the decode side's pulls and the prefill side's
// pushes). A peer is joined once per agent id (the first transfer that
// needs it), by Transport::Pair (the prefill side as the initiator, the
// decode side as the responder): AddPeer for the one-sided backends and for
// ucx_staged, whose pairing completes before Pair returns with no offer. A
// transport that pairs through an offer (NCCL's communicator id: the
// initiator's Pair gives one, the responder's takes it, both complete
// later) is joined when the caller carries the offer (the prefill worker's
// JOIN). Every later transfer to the peer carries the same offer: JOINs may
// reach the peer in any order, and whichever comes first pairs it there; a
// pairing that completes with an error later fails the peer's next
// Acquire, and the peer is joined afresh once its transfers ended. Each
// transfer in flight is counted; a peer reported lost is forgotten once its
// transfers ended, and removed from the transport by the next pairing (a
// restarted worker comes back under a new agent id); beyond `max_idle`
// peers, those idle for `idle_after` are removed when the next one is
// added. The transport is called outside the set's lock and never from
// Release, which the transport's own thread calls from `done`: a pairing
// waits on that thread.
//
// Thread-safe.
#ifndef TANDEM_WORKER_SERVER_PEER_SET_H_
#define TANDEM_WORKER_SERVER_PEER_SET_H_

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "kvtransfer/transport.h"

namespace tandem::worker {

class PeerSet {
 public:
  PeerSet(kvtransfer::Transport* transport, size_t max_idle = 64,
          std::chrono::steady_clock::duration idle_after = std::chrono::minutes(1));

  // Joins `peer` unless it is joined already, and counts a transfer with
  // it: Release must follow. The transport's Pair error otherwise (nothing
  // is counted). `offer`: the peer's offer (a responder's). `offer_out`:
  // where the initiator's offer goes for the caller to carry to the peer
  // ("" when the peer was joined already or its transport needs none);
  // null: the caller carries none, and a transport that needs one is
  // refused (Unimplemented).
  absl::Status Acquire(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role = kvtransfer::PairRole::kInitiator,
                       std::string_view offer = "", std::string* offer_out = nullptr);
  // Ends a transfer counted by Acquire; `lost`: the peer is gone (removed
  // once its last transfer ended). Unknown agents are ignored.
  void Release(const std::string& agent_id, bool lost);

  size_t size() const;
  // Transfers in flight with `agent_id` (0 for an unknown agent).
  int in_flight(const std::string& agent_id) const;

 private:
  // A pairing's outcome, set by the transport's `done` (maybe after Pair
  // returned).
  struct Pairing {
    std::mutex mu;
    bool called = false;
    absl::Status status;
  };
  struct Use {
    int transfers = 0;  // in flight
    std::chrono::steady_clock::time_point last_used;
    std::shared_ptr<Pairing> pairing;  // null: completed when it was joined
    std::string offer;                 // the initiator's pairing offer, carried by every transfer's JOIN
  };
  kvtransfer::Transport* const transport_;
  const size_t max_idle_;
  const std::chrono::steady_clock::duration idle_after_;
  std::mutex pair_mu_;  // pairings and removals, one at a time, never under mu_
  mutable std::mutex mu_;
  std::map<std::string, Use> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> removed_ ABSL_GUARDED_BY(mu_);  // lost, to be removed from the transport
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_PEER_SET_H_
