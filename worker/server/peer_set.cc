#include "worker/server/peer_set.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::worker {

using std::chrono::steady_clock;

PeerSet::PeerSet(kvtransfer::Transport* transport, size_t max_idle, steady_clock::duration idle_after)
    : transport_(transport), max_idle_(max_idle), idle_after_(idle_after) {}

absl::Status PeerSet::Acquire(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role, std::string_view offer,
                              std::string* offer_out) {
  const auto now = steady_clock::now();
  if (offer_out != nullptr) offer_out->clear();
  // The common case: joined, and its pairing (if it completes later) has
  // not failed.
  auto healthy = [&](const Use& use) {
    if (use.pairing == nullptr) return true;
    std::lock_guard<std::mutex> l(use.pairing->mu);
    return !use.pairing->called || use.pairing->status.ok();
  };
  // A responder handed an offer other than the one it joined: the
  // initiator paired afresh (its side of the old pairing ended, which the
  // old communicator here may never learn): join the new one.
  auto new_offer = [&](const Use& use) {
    return role == kvtransfer::PairRole::kResponder && !offer.empty() && offer != use.offer;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer.agent_id);
    if (it != peers_.end() && healthy(it->second) && !new_offer(it->second)) {
      ++it->second.transfers;
      it->second.last_used = now;
      if (offer_out != nullptr) *offer_out = it->second.offer;
      return absl::OkStatus();
    }
  }
  // Pairing and removals call the transport, which may wait on its own
  // thread; that thread calls Release from transfers' `done`: never under
  // mu_, and one at a time (pair_mu_, which Release does not take).
  std::lock_guard<std::mutex> pairing_lock(pair_mu_);
  std::vector<std::string> remove;
  bool replace = false;  // the transport replaces its pairing with the peer; the transfers' count goes on
  {
    std::lock_guard<std::mutex> lock(mu_);
    remove.swap(removed_);
    auto it = peers_.find(peer.agent_id);
    if (it != peers_.end() && new_offer(it->second)) {
      replace = true;
    } else if (it != peers_.end()) {
      if (healthy(it->second)) {  // joined meanwhile by another caller
        ++it->second.transfers;
        it->second.last_used = now;
        if (offer_out != nullptr) *offer_out = it->second.offer;
        return absl::OkStatus();
      }
      // A pairing that completed with an error since: joined afresh, once
      // no transfer uses it.
      if (it->second.transfers > 0) {
        std::lock_guard<std::mutex> l(it->second.pairing->mu);
        return it->second.pairing->status;
      }
      peers_.erase(it);
      remove.push_back(peer.agent_id);
    }
  }
  for (const std::string& agent : remove) transport_->RemovePeer(agent);
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
    if (!replace) transport_->RemovePeer(peer.agent_id);
    return completed_with;
  }
  // An initiator whose pairing needs its offer carried (or completes later)
  // needs a caller that carries it.
  if (role == kvtransfer::PairRole::kInitiator && offer_out == nullptr && (!given->empty() || !completed)) {
    transport_->RemovePeer(peer.agent_id);
    return absl::UnimplementedError(
        absl::StrCat("the ", transport_->backend(),
                     " transport pairs through an offer carried to the peer, and none is carried here"));
  }
  if (offer_out != nullptr) *offer_out = *given;
  remove.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Use& use = peers_[peer.agent_id];
    // The offer this pairing rode on: the one given to the responder, the
    // one the initiator's Pair made.
    std::string joined = role == kvtransfer::PairRole::kResponder ? std::string(offer) : *std::move(given);
    use = Use{.transfers = (replace ? use.transfers : 0) + 1,
              .last_used = now,
              .pairing = completed ? nullptr : pairing,
              .offer = std::move(joined)};
    if (peers_.size() > max_idle_) {
      for (auto p = peers_.begin(); p != peers_.end();) {
        if (p->second.transfers == 0 && now - p->second.last_used > idle_after_) {
          remove.push_back(p->first);
          p = peers_.erase(p);
        } else {
          ++p;
        }
      }
    }
  }
  for (const std::string& agent : remove) transport_->RemovePeer(agent);
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
    // Removed from the transport by the next Acquire that pairs (Release
    // runs on the transport's own thread too, and calls nothing of it).
    removed_.push_back(agent_id);
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
