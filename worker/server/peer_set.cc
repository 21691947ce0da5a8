#include "worker/server/peer_set.h"

#include "absl/strings/str_cat.h"

namespace tandem::worker {

using std::chrono::steady_clock;

PeerSet::PeerSet(kvtransfer::Transport* transport, size_t max_idle, steady_clock::duration idle_after)
    : transport_(transport), max_idle_(max_idle), idle_after_(idle_after) {}

absl::Status PeerSet::Acquire(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role, std::string_view offer,
                              std::string* offer_out) {
  const auto now = steady_clock::now();
  if (offer_out != nullptr) offer_out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer.agent_id);
  if (it != peers_.end() && it->second.pairing != nullptr) {
    // A pairing that completed with an error since: the peer is joined
    // afresh (now, if no transfer uses it).
    absl::Status failed;
    {
      std::lock_guard<std::mutex> l(it->second.pairing->mu);
      if (it->second.pairing->called) failed = it->second.pairing->status;
    }
    if (!failed.ok()) {
      if (it->second.transfers > 0) return failed;
      transport_->RemovePeer(peer.agent_id);
      peers_.erase(it);
      it = peers_.end();
    }
  }
  if (it == peers_.end()) {
    auto pairing = std::make_shared<Pairing>();
    absl::StatusOr<std::string> given =
        transport_->Pair(peer, role, offer, now + std::chrono::seconds(10), [pairing](absl::Status st) {
          std::lock_guard<std::mutex> l(pairing->mu);
          pairing->called = true;
          pairing->status = std::move(st);
        });
    if (!given.ok()) return given.status();
    bool completed = false;
    absl::Status completed_with;
    {
      std::lock_guard<std::mutex> l(pairing->mu);
      completed = pairing->called;
      completed_with = pairing->status;
    }
    if (!completed_with.ok()) {
      transport_->RemovePeer(peer.agent_id);
      return completed_with;
    }
    // An initiator whose pairing needs its offer carried (or completes
    // later) needs a caller that carries it.
    if (role == kvtransfer::PairRole::kInitiator && offer_out == nullptr && (!given->empty() || !completed)) {
      transport_->RemovePeer(peer.agent_id);
      return absl::UnimplementedError(
          absl::StrCat("the ", transport_->backend(),
                       " transport pairs through an offer carried to the peer, and none is carried here"));
    }
    if (offer_out != nullptr) *offer_out = *std::move(given);
    it = peers_.emplace(peer.agent_id, Use{.pairing = completed ? nullptr : pairing}).first;
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
