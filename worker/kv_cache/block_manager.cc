#include "worker/kv_cache/block_manager.h"

#include <algorithm>

#include "common/logging.h"

namespace tandem::worker {

BlockManager::BlockManager(int64_t num_blocks, int block_size, bool enable_prefix_caching, KvEventLog* events)
    : block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      events_(events),
      blocks_(num_blocks),
      tokens_(enable_prefix_caching ? num_blocks * block_size : 0),
      protected_cap_(static_cast<size_t>(static_cast<double>(num_blocks) * kProtectedFraction)) {
  free_.reserve(num_blocks);
  // Hand out low ids first (pop from the back).
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

void BlockManager::Uncache(int32_t block) {
  Block& b = blocks_[block];
  by_hash_.erase(b.hash);
  b.cached = false;
  b.reused = false;
  if (events_ != nullptr) events_->Removed(b.hash);
}

bool BlockManager::Allocate(int n, std::vector<int32_t>* out) {
  if (n < 0 || n > num_allocatable()) return false;
  for (int i = 0; i < n; ++i) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      std::list<int32_t>& from = probation_.empty() ? protected_ : probation_;
      id = from.front();
      from.pop_front();
      Uncache(id);
    }
    CHECK(blocks_[id].ref_count == 0) << "allocating block " << id << " in use";
    blocks_[id].ref_count = 1;
    out->push_back(id);
  }
  return true;
}

int BlockManager::AcquireCachedPrefix(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                                      std::vector<int32_t>* out) {
  if (!prefix_caching_) return 0;
  int hits = 0;
  for (uint64_t h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const int32_t id = it->second;
    const int32_t* stored = &tokens_[size_t(id) * block_size_];
    if (!std::equal(stored, stored + block_size_, tokens.begin() + size_t(hits) * block_size_)) {
      break;  // a hash collision: compute instead
    }
    Block& b = blocks_[id];
    if (b.ref_count++ == 0) ListOf(b).erase(b.lru);
    b.reused = true;
    out->push_back(id);
    ++hits;
  }
  return hits;
}

void BlockManager::Commit(int32_t block, uint64_t hash, uint64_t parent, std::span<const int32_t> tokens) {
  if (!prefix_caching_) return;
  Block& b = blocks_[block];
  CHECK(b.ref_count > 0) << "commit of unused block " << block;
  if (b.cached || by_hash_.contains(hash)) return;
  b.cached = true;
  b.hash = hash;
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + size_t(block) * block_size_);
  by_hash_[hash] = block;
  if (events_ != nullptr) events_->Stored(hash, parent, tokens);
}

void BlockManager::Release(std::span<const int32_t> blocks) {
  for (int32_t id : blocks) {
    Block& b = blocks_[id];
    CHECK(b.ref_count > 0) << "double release of block " << id;
    if (--b.ref_count > 0) continue;
    if (!b.cached) {
      free_.push_back(id);
      continue;
    }
    std::list<int32_t>& list = ListOf(b);
    b.lru = list.insert(list.end(), id);
    if (protected_.size() > protected_cap_) {
      // Demote protected's least recent block: it must be found again to
      // return.
      const int32_t cold = protected_.front();
      protected_.pop_front();
      blocks_[cold].reused = false;
      blocks_[cold].lru = probation_.insert(probation_.end(), cold);
    }
  }
}

void BlockManager::ReleaseTable(std::span<const int32_t> table) {
  std::vector<int32_t> reversed(table.rbegin(), table.rend());
  Release(reversed);
}

int64_t BlockManager::Clear() {
  int64_t freed = num_cached();
  for (std::list<int32_t>* list : {&probation_, &protected_}) {
    for (int32_t id : *list) free_.push_back(id);
    list->clear();
  }
  for (Block& b : blocks_) {
    b.cached = false;
    b.reused = false;
  }
  by_hash_.clear();
  if (events_ != nullptr) events_->Cleared();
  return freed;
}

}  // namespace tandem::worker
