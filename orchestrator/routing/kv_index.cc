#include "orchestrator/routing/kv_index.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace tandem::router {

const char* WorkerModeName(WorkerMode mode) {
  switch (mode) {
    case WorkerMode::kApproximate:
      return "approximate";
    case WorkerMode::kExact:
      return "exact";
    case WorkerMode::kStale:
      return "stale";
  }
  return "unknown";
}

KvIndex::KvIndex(Options options) : options_(options) {
  CHECK(options_.max_blocks >= 1 && options_.max_blocks < int64_t{kNil})
      << "KvIndex: max_blocks out of range: " << options_.max_blocks;
}

// ---- lists ---------------------------------------------------------------

uint16_t KvIndex::LinkFront(uint32_t n) {
  Node& node = nodes_[n];
  ++clock_;
  node.prev = kNil;
  node.next = lru_head_;
  if (lru_head_ != kNil) nodes_[lru_head_].prev = n;
  lru_head_ = n;
  if (lru_tail_ == kNil) lru_tail_ = n;
  return static_cast<uint16_t>(clock_ >> kStampShift);
}

void KvIndex::Unlink(uint32_t n) {
  Node& node = nodes_[n];
  (node.prev != kNil ? nodes_[node.prev].next : lru_head_) = node.next;
  (node.next != kNil ? nodes_[node.next].prev : lru_tail_) = node.prev;
  node.prev = node.next = kNil;
}

void KvIndex::Relink(Holder& holder) {
  Unlink(holder.node);
  holder.stamp = LinkFront(holder.node);
}

inline void KvIndex::Touch(Holder& holder) {
  if (lru_head_ == holder.node) return;
  // Fewer than (age + 1) << kStampShift entries were linked in front of it
  // since its stamp; skip it while that is within the most recent quarter.
  const uint32_t age = static_cast<uint16_t>(static_cast<uint16_t>(clock_ >> kStampShift) - holder.stamp);
  if (((age + 1) << kStampShift) > size_ / 4) Relink(holder);
}

// ---- entries -------------------------------------------------------------

void KvIndex::Insert(uint64_t hash, uint16_t slot, TimePoint expires) {
  auto& holders = holders_[hash];
  for (Holder& h : holders) {
    if (h.worker != slot) continue;
    TimePoint& e = nodes_[h.node].expires;
    e = std::max(e, expires);  // exact (max) wins over a TTL
    Touch(h);
    return;
  }
  uint32_t n;
  if (free_nodes_ != kNil) {
    n = free_nodes_;
    free_nodes_ = nodes_[n].next;
  } else {
    n = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Worker& w = workers_[slot];
  Node& node = nodes_[n];
  node.hash = hash;
  node.expires = expires;
  node.worker = slot;
  node.wprev = kNil;
  node.wnext = w.head;
  if (w.head != kNil) nodes_[w.head].wprev = n;
  w.head = n;
  ++w.blocks;
  holders.push_back(Holder{n, slot, LinkFront(n)});
  ++size_;
  // The new node is at the head, so with max_blocks >= 1 the tail is another.
  while (size_ > static_cast<size_t>(options_.max_blocks)) {
    EraseNode(lru_tail_);
    ++stats_.evictions;
  }
}

void KvIndex::EraseNode(uint32_t n) {
  Node& node = nodes_[n];
  auto it = holders_.find(node.hash);
  CHECK(it != holders_.end()) << "KvIndex: node without holders";
  auto& holders = it->second;
  auto pos = std::find_if(holders.begin(), holders.end(), [n](const Holder& h) { return h.node == n; });
  CHECK(pos != holders.end()) << "KvIndex: node missing from its holders";
  *pos = holders.back();
  holders.pop_back();
  if (holders.empty()) holders_.erase(it);

  Worker& w = workers_[node.worker];
  (node.wprev != kNil ? nodes_[node.wprev].wnext : w.head) = node.wnext;
  if (node.wnext != kNil) nodes_[node.wnext].wprev = node.wprev;
  --w.blocks;

  Unlink(n);
  node.worker = kNil;
  node.wprev = node.wnext = kNil;
  node.next = free_nodes_;
  free_nodes_ = n;
  --size_;
}

void KvIndex::EraseBlock(uint64_t hash, uint16_t slot) {
  auto it = holders_.find(hash);
  if (it == holders_.end()) return;
  for (const Holder& h : it->second) {
    if (h.worker == slot) {
      EraseNode(h.node);  // invalidates `it`; we are done with it
      return;
    }
  }
}

void KvIndex::DropWorkerEntries(uint16_t slot) {
  while (workers_[slot].head != kNil) EraseNode(workers_[slot].head);
}

// ---- workers -------------------------------------------------------------

uint16_t KvIndex::WorkerSlot(const std::string& worker_id) {
  auto it = slot_by_id_.find(worker_id);
  if (it != slot_by_id_.end()) return it->second;
  uint16_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    if (workers_.size() >= kMaxWorkers) return kNoSlot;
    slot = static_cast<uint16_t>(workers_.size());
    workers_.emplace_back();
    match_slots_.emplace_back();
  }
  workers_[slot] = Worker{};
  SetMode(slot, WorkerMode::kApproximate);
  workers_[slot].id = worker_id;
  slot_by_id_.emplace(worker_id, slot);
  return slot;
}

void KvIndex::RemoveWorker(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slot_by_id_.find(worker_id);
  if (it == slot_by_id_.end()) return;
  const uint16_t slot = it->second;
  DropWorkerEntries(slot);
  workers_[slot] = Worker{};
  SetMode(slot, WorkerMode::kApproximate);
  free_slots_.push_back(slot);
  slot_by_id_.erase(it);
}

void KvIndex::SetMode(uint16_t slot, WorkerMode mode) {
  workers_[slot].mode = mode;
  match_slots_[slot].exact = mode == WorkerMode::kExact;
}

void KvIndex::MarkStale(uint16_t slot) {
  SetMode(slot, WorkerMode::kStale);
  Worker& w = workers_[slot];
  w.synced = false;
  w.snapshot_open = false;
  w.staged.clear();
  w.staged.shrink_to_fit();
}

// ---- events --------------------------------------------------------------

absl::Status KvIndex::Apply(const std::string& worker_id, const tandem::v1::KvEventBatch& batch) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint16_t slot = WorkerSlot(worker_id);
  if (slot == kNoSlot) {
    ++stats_.bad_batches;
    return absl::ResourceExhaustedError(
        absl::StrCat("KV index knows ", kMaxWorkers, " workers already; ", worker_id, " is not indexed"));
  }
  absl::Status status = ApplyLocked(lock, worker_id, slot, batch);
  if (status.ok()) workers_[slot].last_batch = std::chrono::steady_clock::now();
  if (!status.ok()) {
    MarkStale(slot);
    ++(absl::IsDataLoss(status) ? stats_.seq_gaps : stats_.bad_batches);
    LOG(WARNING) << "KV events from " << worker_id << " lost or malformed; index marks it stale "
                 << "until a snapshot: " << status.message();
  }
  return status;
}

absl::Status KvIndex::ApplyLocked(std::unique_lock<std::mutex>& lock, const std::string& worker_id, uint16_t slot,
                                  const tandem::v1::KvEventBatch& batch) {
  Worker& w = workers_[slot];
  if (batch.instance_id().empty()) {
    return absl::InvalidArgumentError("KV event batch without instance_id");
  }
  if (batch.instance_id() != w.instance_id) {
    if (!w.instance_id.empty()) {
      // A new process holds none of the old one's blocks.
      ++stats_.restarts;
      LOG(WARNING) << "worker " << w.id << " restarted (instance " << w.instance_id << " -> " << batch.instance_id()
                   << "); dropping its " << w.blocks << " KV index entries";
      DropWorkerEntries(slot);
      MarkStale(slot);
    }
    w.instance_id = batch.instance_id();
    w.synced = false;
    w.last_seq = 0;
  }

  if (batch.has_snapshot()) {
    const tandem::v1::KvSnapshot& snapshot = batch.snapshot();
    if (!w.snapshot_open || w.snapshot_seq != snapshot.seq()) {
      w.staged.clear();
      w.snapshot_open = true;
      w.snapshot_seq = snapshot.seq();
    }
    for (const tandem::v1::CachedBlock& block : snapshot.blocks()) {
      if (w.staged.size() >= static_cast<size_t>(options_.max_blocks)) {
        ++stats_.snapshot_blocks_truncated;
        continue;
      }
      w.staged.push_back(block.block_hash());
    }
    if (snapshot.complete()) {
      std::vector<uint64_t> staged = std::move(w.staged);
      w.staged = {};
      w.snapshot_open = false;
      DropWorkerEntries(slot);
      for (uint64_t hash : staged) Insert(hash, slot, TimePoint::max());
      w.synced = true;
      w.last_seq = snapshot.seq();
      SetMode(slot, WorkerMode::kExact);
      ++stats_.snapshots_completed;
    }
  }

  if (batch.events().empty()) return absl::OkStatus();
  if (w.snapshot_open) {
    return absl::InvalidArgumentError(absl::StrCat("KV events inside the incomplete snapshot at seq ", w.snapshot_seq));
  }
  if (!w.synced) {
    if (batch.events(0).seq() != 1) {
      return absl::DataLossError(
          absl::StrCat("KV events from seq ", batch.events(0).seq(), " with no snapshot to follow"));
    }
    // A fresh worker's whole log: it replaces whatever was recorded.
    DropWorkerEntries(slot);
    w.synced = true;
    w.last_seq = 0;
    SetMode(slot, WorkerMode::kExact);
  }
  int since_unlock = 0;
  for (const tandem::v1::KvEvent& event : batch.events()) {
    if (++since_unlock == kEventsPerLock) {
      // A long batch (a prefill stores a block per 16 tokens) lets matches
      // in between chunks instead of holding them up for all of it.
      since_unlock = 0;
      lock.unlock();
      lock.lock();
      // Removed, restarted or resynced meanwhile: the rest is moot.
      auto it = slot_by_id_.find(worker_id);
      if (it == slot_by_id_.end() || it->second != slot || workers_[slot].instance_id != batch.instance_id() ||
          !workers_[slot].synced) {
        return absl::OkStatus();
      }
    }
    Worker& cur = workers_[slot];  // not `w`: workers_ may have grown while unlocked
    if (event.seq() <= cur.last_seq) {
      ++stats_.events_replayed;
      continue;
    }
    if (event.seq() != cur.last_seq + 1) {
      return absl::DataLossError(absl::StrCat("KV event seq gap: expected ", cur.last_seq + 1, ", got ", event.seq()));
    }
    switch (event.event_case()) {
      case tandem::v1::KvEvent::kStored:
        Insert(event.stored().block_hash(), slot, TimePoint::max());
        break;
      case tandem::v1::KvEvent::kRemoved:
        EraseBlock(event.removed().block_hash(), slot);
        break;
      case tandem::v1::KvEvent::kCleared:
        DropWorkerEntries(slot);
        break;
      case tandem::v1::KvEvent::EVENT_NOT_SET:
        break;  // a newer event kind: only its seq matters here
    }
    cur.last_seq = event.seq();
    ++stats_.events_applied;
  }
  return absl::OkStatus();
}

// ---- approximate mode and queries ----------------------------------------

void KvIndex::RecordRouted(const std::string& worker_id, std::span<const uint64_t> block_hashes, TimePoint now) {
  if (block_hashes.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  const uint16_t slot = WorkerSlot(worker_id);
  if (slot == kNoSlot || workers_[slot].mode == WorkerMode::kExact) return;
  const TimePoint expires = now + options_.ttl;
  // Insert in reverse so the request's first block ends up most recent: under
  // the cap, a prefix survives longer than its tail (a tail is useless alone).
  for (auto it = block_hashes.rbegin(); it != block_hashes.rend(); ++it) {
    Insert(*it, slot, expires);
  }
}

std::vector<KvIndex::Overlap> KvIndex::Match(std::span<const uint64_t> block_hashes, TimePoint now) {
  std::vector<uint16_t> candidates;  // slots that matched block 0
  std::vector<uint32_t> expired;
  std::lock_guard<std::mutex> lock(mu_);
  // Block i extends only candidates that matched all of blocks 0..i-1.
  // The blocks are random reads in a large map: ask for the map entry of
  // block i + kAhead while reading block i, and for its holder array once
  // found, so their cache misses overlap (a cold request wastes a few).
  constexpr size_t kAhead = 8;
  const size_t n = block_hashes.size();
  for (size_t i = 0; i < std::min(n, kAhead); ++i) holders_.prefetch(block_hashes[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) holders_.prefetch(block_hashes[i + kAhead]);
    if (i + kAhead / 2 < n) {
      auto next = holders_.find(block_hashes[i + kAhead / 2]);
      if (next != holders_.end()) __builtin_prefetch(next->second.data());
    }
    auto it = holders_.find(block_hashes[i]);
    if (it == holders_.end()) break;
    bool extended = false;
    for (Holder& h : it->second) {
      MatchSlot& slot = match_slots_[h.worker];
      if (!slot.exact && nodes_[h.node].expires <= now) {
        expired.push_back(h.node);
        continue;
      }
      if (slot.matched != i) continue;
      if (i == 0) candidates.push_back(h.worker);
      ++slot.matched;
      Touch(h);
      extended = true;
    }
    if (!extended) break;
  }
  std::vector<Overlap> out;
  out.reserve(candidates.size());
  for (uint16_t slot : candidates) {
    const Worker& w = workers_[slot];
    out.push_back(Overlap{w.id, match_slots_[slot].matched, w.mode});
    match_slots_[slot].matched = 0;
  }
  // A request could repeat a hash; erase each expired node once.
  std::sort(expired.begin(), expired.end());
  expired.erase(std::unique(expired.begin(), expired.end()), expired.end());
  for (uint32_t n : expired) EraseNode(n);
  stats_.expirations += expired.size();
  return out;
}

size_t KvIndex::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

WorkerMode KvIndex::mode(const std::string& worker_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slot_by_id_.find(worker_id);
  return it == slot_by_id_.end() ? WorkerMode::kApproximate : workers_[it->second].mode;
}

std::vector<KvIndex::WorkerInfo> KvIndex::workers() const {
  std::vector<WorkerInfo> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.reserve(slot_by_id_.size());
    for (const auto& [id, slot] : slot_by_id_) {
      const Worker& w = workers_[slot];
      out.push_back(WorkerInfo{w.id, w.mode, w.blocks, w.instance_id, w.last_seq, w.last_batch});
    }
  }
  std::sort(out.begin(), out.end(), [](const WorkerInfo& a, const WorkerInfo& b) { return a.id < b.id; });
  return out;
}

KvIndex::Stats KvIndex::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace tandem::router
