// PeerSet: the peers a worker's KV transport is connected to, shared by the
// transfers that use them (the decode side's pulls and the prefill side's
// pushes). A peer is joined once per agent id (the first transfer that
// needs it), by Transport::Pair (the prefill side as the initiator, the
// decode side as the responder): AddPeer for the one-sided backends and for
// ucx_staged, whose pairing completes before Pair returns and whose offer
// is empty. A transport that completes its pairing later, through an offer
// carried to the peer (NCCL's communicator), is refused: the workers do not
// carry offers yet. Each transfer in flight is counted; a peer
// reported lost is removed once its transfers ended (a restarted worker
// comes back under a new agent id); beyond `max_idle` peers, those idle for
// `idle_after` are removed when the next one is added.
//
// Thread-safe.
#ifndef TANDEM_WORKER_SERVER_PEER_SET_H_
#define TANDEM_WORKER_SERVER_PEER_SET_H_

#include <chrono>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>

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
  // is counted).
  absl::Status Acquire(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role = kvtransfer::PairRole::kInitiator);
  // Ends a transfer counted by Acquire; `lost`: the peer is gone (removed
  // once its last transfer ended). Unknown agents are ignored.
  void Release(const std::string& agent_id, bool lost);

  size_t size() const;
  // Transfers in flight with `agent_id` (0 for an unknown agent).
  int in_flight(const std::string& agent_id) const;

 private:
  struct Use {
    int transfers = 0;  // in flight
    std::chrono::steady_clock::time_point last_used;
  };
  kvtransfer::Transport* const transport_;
  const size_t max_idle_;
  const std::chrono::steady_clock::duration idle_after_;
  mutable std::mutex mu_;
  std::map<std::string, Use> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_PEER_SET_H_
