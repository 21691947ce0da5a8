// BlockManager: the paged KV cache's bookkeeping for one worker. It owns the
// ids of `num_blocks` fixed-size blocks (the memory itself is KvStorage), with
//   - reference counts (a block shared by sequences through a common prefix
//     has one reference per sequence),
//   - a prefix cache: full blocks are registered under their chained hash
//     (common/block_hash.h) and found again by later sequences,
//   - segmented LRU eviction: a cached block whose count drops to zero stays
//     cached and evictable; allocation takes never-cached free blocks first,
//     then evicts. Evictable blocks sit in one of two LRU lists: probation
//     (never found again since cached: a request's unique suffix and output)
//     and protected (found again by a later request: a shared prefix).
//     Eviction takes probation's least recently released block first, so a
//     stream of one-off blocks cannot push out a prefix that requests share.
//     Protected holds at most kProtectedFraction of the blocks: past that its
//     least recently released block moves back to probation's recent end,
//     so prefixes that went cold still age out.
// Every change to the cached set is published to the KvEventLog.
//
// Block states: free (count 0, not cached), cached (count 0, cached,
// evictable), used (count > 0, cached or not). free + cached + used = total.
//
// Not thread-safe: only the engine thread calls it.
#ifndef TANDEM_WORKER_KV_CACHE_BLOCK_MANAGER_H_
#define TANDEM_WORKER_KV_CACHE_BLOCK_MANAGER_H_

#include <cstdint>
#include <list>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "worker/kv_cache/kv_event_log.h"

namespace tandem::worker {

class BlockManager {
 public:
  // Protected's cap as a share of all blocks (as in SLRU caches such as
  // Caffeine's main space: 80% protected, 20% probation).
  static constexpr double kProtectedFraction = 0.8;

  // `events` may be null (no events published). With prefix caching off,
  // Commit does nothing and lookups never hit.
  BlockManager(int64_t num_blocks, int block_size, bool enable_prefix_caching, KvEventLog* events);

  int64_t total_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int block_size() const { return block_size_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_cached() const { return static_cast<int64_t>(probation_.size() + protected_.size()); }
  // Evictable blocks that were found again since cached (the protected list).
  int64_t num_protected() const { return static_cast<int64_t>(protected_.size()); }
  int64_t num_used() const { return total_blocks() - num_free() - num_cached(); }
  // Blocks that Allocate can hand out: free plus evictable.
  int64_t num_allocatable() const { return num_free() + num_cached(); }

  // Allocates `n` blocks with a count of one each, evicting cached blocks as
  // needed. Returns false (allocating nothing) if fewer than n are allocatable.
  bool Allocate(int n, std::vector<int32_t>* out);

  // The longest prefix of `hashes` present in the cache whose blocks also
  // hold exactly the corresponding block_size tokens of `tokens` (a 64-bit
  // hash alone could collide, and the seed is public): takes a reference on
  // each of those blocks and appends their ids to `out`. Returns how many.
  // REQUIRES: tokens.size() >= hashes.size() * block_size.
  int AcquireCachedPrefix(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, std::vector<int32_t>* out);

  // Registers `block`, which holds exactly `tokens` (block_size of them) after
  // the block hashed `parent`, under `hash`. If another block already holds
  // that hash this one stays uncached (it is freed when released).
  // REQUIRES: the block is used.
  void Commit(int32_t block, uint64_t hash, uint64_t parent, std::span<const int32_t> tokens);

  // Drops one reference from each block, in the order given. Callers release
  // a sequence's blocks last-to-first, so within each list its tail blocks
  // become the least recently used and go before the prefix they extend.
  void Release(std::span<const int32_t> blocks);
  // Releases a sequence's block table, last block first (the order above).
  void ReleaseTable(std::span<const int32_t> table);

  // Removes every block from the prefix cache (used blocks stay used, just
  // uncached). Publishes one CacheCleared event. Returns the number of
  // cached-and-unreferenced blocks that became free.
  int64_t Clear();

  int ref_count(int32_t block) const { return blocks_[block].ref_count; }
  bool is_cached(int32_t block) const { return blocks_[block].cached; }

 private:
  struct Block {
    int ref_count = 0;
    bool cached = false;
    bool reused = false;  // found by AcquireCachedPrefix since cached: protected when evictable
    uint64_t hash = 0;
    std::list<int32_t>::iterator lru;  // valid when cached and ref_count == 0
  };
  void Uncache(int32_t block);
  std::list<int32_t>& ListOf(const Block& b) { return b.reused ? protected_ : probation_; }

  const int block_size_;
  const bool prefix_caching_;
  KvEventLog* const events_;
  std::vector<Block> blocks_;
  std::vector<int32_t> tokens_;  // [block][block_size]: a cached block's tokens
  std::vector<int32_t> free_;    // stack of never-cached free blocks
  // Evictable blocks, LRU order (front goes first): probation before protected.
  std::list<int32_t> probation_;
  std::list<int32_t> protected_;
  const size_t protected_cap_;
  absl::flat_hash_map<uint64_t, int32_t> by_hash_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_KV_CACHE_BLOCK_MANAGER_H_
