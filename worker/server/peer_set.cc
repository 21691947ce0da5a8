#include "worker/server/peer_set.h"

#include "absl/strings/str_cat.h"

namespace tandem::worker {

using std::chrono::steady_clock;

PeerSet::PeerSet(kvtransfer::Transport* transport, size_t max_idle, steady_clock::duration idle_after)
    : transport_(transport), max_idle_(max_idle), idle_after_(idle_after) {}

absl::Status PeerSet::Acquire(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role) {
  const auto now = steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer.agent_id);
  if (it == peers_.end()) {
    // Joined inline: `done` before Pair returns (it may run later, on
    // another thread, for a transport that pairs through the offer).
    struct Joined {
      std::mutex mu;
      bool called = false;
      absl::Status status;
    };
    auto joined = std::make_shared<Joined>();
    absl::StatusOr<std::string> offer =
        transport_->Pair(peer, role, /*offer=*/"", now + std::chrono::seconds(10), [joined](absl::Status st) {
          std::lock_guard<std::mutex> l(joined->mu);
          joined->called = true;
          joined->status = std::move(st);
        });
    if (!offer.ok()) return offer.status();
    std::lock_guard<std::mutex> l(joined->mu);
    if (!joined->called || !offer->empty()) {
      transport_->RemovePeer(peer.agent_id);
      return absl::UnimplementedError(
          absl::StrCat("the ", transport_->backend(),
                       " transport pairs through an offer carried to the peer, which the workers do not do yet"));
    }
    if (!joined->status.ok()) return joined->status;
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
