#include "worker/server/peer_set.h"

#include "absl/strings/str_cat.h"

namespace tandem::worker {

using std::chrono::steady_clock;

PeerSet::PeerSet(kvtransfer::Transport* transport, size_t max_idle, steady_clock::duration idle_after)
    : transport_(transport), max_idle_(max_idle), idle_after_(idle_after) {}

absl::Status PeerSet::Acquire(const kvtransfer::PeerInfo& peer) {
  const auto now = steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer.agent_id);
  if (it == peers_.end()) {
    if (transport_->capabilities().needs_pairing) {
      return absl::UnimplementedError(
          absl::StrCat("the ", transport_->backend(),
                       " transport sends and receives in pairs; peers are joined here for one-sided transports only"));
    }
    // One-sided backends join inline (done before Pair returns); the offer
    // is for send/receive backends, which the worker refuses at start.
    absl::StatusOr<std::string> joined = transport_->Pair(peer, kvtransfer::PairRole::kInitiator, /*offer=*/"",
                                                          now + std::chrono::seconds(10), [](absl::Status) {});
    if (!joined.ok()) return joined.status();
    it = peers_.emplace(peer.agent_id, Use{}).first;
  }
  ++it->second.transfers;
  it->second.last_used = now;
  if (peers_.size() > max_idle_) {
    for (auto p = peers_.begin(); p != peers_.end();) {
      if (p->second.transfers == 0 && now - p->second.last_used > idle_after_) {
        transport_->RemovePeer(p->first);
        p = peers_.erase(p);
      } else {
        ++p;
      }
    }
  }
  return absl::OkStatus();
}

void PeerSet::Release(const std::string& agent_id, bool lost) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(agent_id);
  if (it == peers_.end()) return;
  --it->second.transfers;
  it->second.last_used = steady_clock::now();
  if (lost) it->second.last_used = {};  // idle since forever: the first to go
  if (lost && it->second.transfers == 0) {
    transport_->RemovePeer(agent_id);
    peers_.erase(it);
  }
}

size_t PeerSet::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peers_.size();
}

int PeerSet::in_flight(const std::string& agent_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(agent_id);
  return it == peers_.end() ? 0 : it->second.transfers;
}

}  // namespace tandem::worker
