#include "worker/kv_cache/kv_event_log.h"

#include <utility>

namespace tandem::worker {

KvEventLog::KvEventLog(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

void KvEventLog::Append(KvEvent event) {
  event.seq = ++seq_;
  recent_.push_back(std::move(event));
  if (recent_.size() > capacity_) recent_.pop_front();
}

void KvEventLog::Stored(uint64_t hash, uint64_t parent, std::span<const int32_t> tokens) {
  absl::MutexLock lock(&mu_);
  live_[hash] = parent;
  Append(KvEvent{.kind = KvEvent::Kind::kStored,
                 .block_hash = hash,
                 .parent_hash = parent,
                 .token_ids = std::vector<int32_t>(tokens.begin(), tokens.end())});
}

void KvEventLog::Removed(uint64_t hash) {
  absl::MutexLock lock(&mu_);
  live_.erase(hash);
  Append(KvEvent{.kind = KvEvent::Kind::kRemoved, .block_hash = hash});
}

void KvEventLog::Cleared() {
  absl::MutexLock lock(&mu_);
  live_.clear();
  Append(KvEvent{.kind = KvEvent::Kind::kCleared});
}

void KvEventLog::Publish() {
  {
    absl::MutexLock lock(&mu_);
    if (published_seq_ == seq_) return;
    published_seq_ = seq_;
  }
  WakeListeners();
}

void KvEventLog::WakeListeners() {
  absl::MutexLock lock(&listeners_mu_);
  for (auto& [id, fn] : listeners_) fn();
}

uint64_t KvEventLog::last_seq() const {
  absl::MutexLock lock(&mu_);
  return seq_;
}

bool KvEventLog::ReadSince(uint64_t after, size_t max_events, std::vector<KvEvent>* out) const {
  absl::MutexLock lock(&mu_);
  if (after >= seq_) return true;
  uint64_t oldest = recent_.empty() ? seq_ + 1 : recent_.front().seq;
  if (after + 1 < oldest) return false;
  size_t start = static_cast<size_t>(after + 1 - oldest);
  for (size_t i = start; i < recent_.size() && out->size() < max_events; ++i) {
    out->push_back(recent_[i]);
  }
  return true;
}

KvSnapshot KvEventLog::TakeSnapshot() const {
  absl::MutexLock lock(&mu_);
  KvSnapshot snap;
  snap.seq = seq_;
  snap.blocks.reserve(live_.size());
  for (const auto& [hash, parent] : live_) snap.blocks.push_back({hash, parent});
  return snap;
}

int KvEventLog::AddListener(std::function<void()> fn) {
  absl::MutexLock lock(&listeners_mu_);
  int id = next_listener_++;
  listeners_[id] = std::move(fn);
  return id;
}

void KvEventLog::RemoveListener(int id) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(id);
}

}  // namespace tandem::worker
