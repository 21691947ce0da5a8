#include "worker/kv_cache/block_manager.h"

#include <numeric>
#include <vector>

#include "common/block_hash.h"
#include "gtest/gtest.h"
#include "worker/kv_cache/kv_event_log.h"

namespace tandem::worker {
namespace {

std::vector<int32_t> Tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

void ExpectAccounting(const BlockManager& m) {
  EXPECT_EQ(m.num_free() + m.num_cached() + m.num_used(), m.total_blocks());
}

TEST(BlockManagerTest, AllocateReleaseWithoutCaching) {
  KvEventLog log;
  BlockManager m(4, 4, /*enable_prefix_caching=*/true, &log);
  std::vector<int32_t> a;
  ASSERT_TRUE(m.Allocate(3, &a));
  EXPECT_EQ(m.num_used(), 3);
  std::vector<int32_t> b;
  EXPECT_FALSE(m.Allocate(2, &b));
  EXPECT_TRUE(b.empty());
  m.Release(a);
  EXPECT_EQ(m.num_free(), 4);
  EXPECT_EQ(log.last_seq(), 0u);  // nothing was cached
  ExpectAccounting(m);
}

TEST(BlockManagerTest, PrefixHitSharesBlocksAndCountsReferences) {
  KvEventLog log;
  BlockManager m(8, 4, true, &log);
  auto tokens = Tokens(8);
  auto hashes = HashBlocks(7, tokens, 4);
  std::vector<int32_t> a;
  ASSERT_TRUE(m.Allocate(2, &a));
  m.Commit(a[0], hashes[0], 7, std::span(tokens).subspan(0, 4));
  m.Commit(a[1], hashes[1], hashes[0], std::span(tokens).subspan(4, 4));
  EXPECT_EQ(log.last_seq(), 2u);

  std::vector<int32_t> b;
  EXPECT_EQ(m.AcquireCachedPrefix(hashes, tokens, &b), 2);
  EXPECT_EQ(b, a);
  EXPECT_EQ(m.ref_count(a[0]), 2);
  m.Release(a);
  EXPECT_EQ(m.num_used(), 2);
  m.Release(b);
  EXPECT_EQ(m.num_cached(), 2);
  EXPECT_EQ(m.num_used(), 0);
  ExpectAccounting(m);

  // A different second block: only the first hits.
  auto other = tokens;
  other[5] = 99;
  auto other_hashes = HashBlocks(7, other, 4);
  std::vector<int32_t> c;
  EXPECT_EQ(m.AcquireCachedPrefix(other_hashes, other, &c), 1);
  m.Release(c);
}

TEST(BlockManagerTest, EvictsLeastRecentlyReleasedAndPublishesRemoval) {
  KvEventLog log;
  BlockManager m(3, 2, true, &log);
  std::vector<int32_t> ids;
  ASSERT_TRUE(m.Allocate(3, &ids));
  std::vector<uint64_t> hashes;
  for (int i = 0; i < 3; ++i) {
    auto t = Tokens(2, 10 * i);
    hashes.push_back(HashBlock(0, t));
    m.Commit(ids[i], hashes[i], 0, t);
  }
  // Release 2, then 0, then 1: block 2 is least recently used.
  m.Release(std::vector<int32_t>{ids[2]});
  m.Release(std::vector<int32_t>{ids[0]});
  m.Release(std::vector<int32_t>{ids[1]});
  std::vector<int32_t> got;
  ASSERT_TRUE(m.Allocate(1, &got));
  EXPECT_EQ(got[0], ids[2]);
  std::vector<KvEvent> ev;
  ASSERT_TRUE(log.ReadSince(3, 10, &ev));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(ev[0].block_hash, hashes[2]);
  EXPECT_EQ(ev[0].seq, 4u);
  std::vector<int32_t> miss;
  EXPECT_EQ(m.AcquireCachedPrefix(std::vector<uint64_t>{hashes[2]}, Tokens(2, 20), &miss), 0);
  ExpectAccounting(m);
}

// Commits `n` fresh one-token-per-slot blocks (block size 2) whose tokens
// start at `start`, releases them, and returns their hashes.
std::vector<uint64_t> CacheBlocks(BlockManager& m, int n, int start, std::vector<int32_t>* ids) {
  std::vector<uint64_t> hashes;
  ids->clear();
  EXPECT_TRUE(m.Allocate(n, ids));
  for (int i = 0; i < n; ++i) {
    auto t = Tokens(2, start + 2 * i);
    hashes.push_back(HashBlock(0, t));
    m.Commit((*ids)[i], hashes.back(), 0, t);
  }
  m.Release(*ids);
  return hashes;
}

bool Holds(BlockManager& m, uint64_t hash, int start) {
  std::vector<int32_t> got;
  const int hit = m.AcquireCachedPrefix(std::vector<uint64_t>{hash}, Tokens(2, start), &got);
  m.Release(got);
  return hit == 1;
}

// A block found again (a shared prefix) outlives blocks cached later that
// nobody asked for again (unique suffixes): probation is evicted first.
TEST(BlockManagerTest, ReusedBlocksOutliveOneOffBlocks) {
  KvEventLog log;
  BlockManager m(10, 2, true, &log);
  std::vector<int32_t> prefix_ids, ids;
  const std::vector<uint64_t> prefix = CacheBlocks(m, 2, 1000, &prefix_ids);
  ASSERT_TRUE(Holds(m, prefix[0], 1000));  // found again: protected
  EXPECT_EQ(m.num_protected(), 1);
  // Eight one-off blocks fill the rest; then eight more must evict.
  CacheBlocks(m, 8, 0, &ids);
  CacheBlocks(m, 8, 100, &ids);
  EXPECT_TRUE(Holds(m, prefix[0], 1000)) << "the reused block was evicted";
  EXPECT_FALSE(Holds(m, prefix[1], 1002)) << "the block never reused outlived newer ones";
  EXPECT_EQ(m.num_cached(), 10);
  ExpectAccounting(m);
  // Without probation blocks, protected ones are evicted (least recent first).
  std::vector<int32_t> all;
  ASSERT_TRUE(m.Allocate(10, &all));
  EXPECT_EQ(m.num_cached(), 0);
  m.Release(all);
  ExpectAccounting(m);
}

// Protected holds at most kProtectedFraction of the blocks; past it, its
// least recent block goes back to probation and is evicted like a new one.
TEST(BlockManagerTest, ProtectedIsCappedAndColdPrefixesAgeOut) {
  BlockManager m(10, 2, true, nullptr);  // cap: 8 protected
  std::vector<int32_t> ids;
  const std::vector<uint64_t> hashes = CacheBlocks(m, 10, 0, &ids);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(Holds(m, hashes[i], 2 * i));
  EXPECT_EQ(m.num_protected(), 8);
  EXPECT_EQ(m.num_cached(), 10);
  // Blocks 0 and 1, the least recently found, were demoted: they go first.
  std::vector<int32_t> got;
  ASSERT_TRUE(m.Allocate(2, &got));
  EXPECT_FALSE(Holds(m, hashes[0], 0));
  EXPECT_FALSE(Holds(m, hashes[1], 2));
  for (int i = 2; i < 10; ++i) EXPECT_TRUE(Holds(m, hashes[i], 2 * i)) << i;
  m.Release(got);
  ExpectAccounting(m);
}

TEST(BlockManagerTest, HashCollisionWithOtherTokensIsAMiss) {
  BlockManager m(4, 2, true, nullptr);
  std::vector<int32_t> ids;
  ASSERT_TRUE(m.Allocate(1, &ids));
  m.Commit(ids[0], /*hash=*/42, 0, Tokens(2, 0));
  std::vector<int32_t> got;
  // Same hash, different tokens (a collision, or a crafted one): never shared.
  EXPECT_EQ(m.AcquireCachedPrefix(std::vector<uint64_t>{42}, Tokens(2, 7), &got), 0);
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(m.ref_count(ids[0]), 1);
  EXPECT_EQ(m.AcquireCachedPrefix(std::vector<uint64_t>{42}, Tokens(2, 0), &got), 1);
  m.Release(got);
  m.Release(ids);
}

TEST(BlockManagerTest, DuplicateCommitKeepsFirstBlock) {
  BlockManager m(4, 2, true, nullptr);
  std::vector<int32_t> ids;
  ASSERT_TRUE(m.Allocate(2, &ids));
  auto t = Tokens(2);
  m.Commit(ids[0], 5, 0, t);
  m.Commit(ids[1], 5, 0, t);
  EXPECT_TRUE(m.is_cached(ids[0]));
  EXPECT_FALSE(m.is_cached(ids[1]));
  m.Release(ids);
  EXPECT_EQ(m.num_cached(), 1);
  EXPECT_EQ(m.num_free(), 3);
}

TEST(BlockManagerTest, ClearUncachesEverythingAndPublishes) {
  KvEventLog log;
  BlockManager m(4, 2, true, &log);
  std::vector<int32_t> ids;
  ASSERT_TRUE(m.Allocate(2, &ids));
  m.Commit(ids[0], 1, 0, Tokens(2));
  m.Commit(ids[1], 2, 1, Tokens(2, 2));
  m.Release(std::vector<int32_t>{ids[1]});
  EXPECT_EQ(m.Clear(), 1);
  EXPECT_EQ(log.TakeSnapshot().blocks.size(), 0u);
  std::vector<KvEvent> ev;
  ASSERT_TRUE(log.ReadSince(2, 10, &ev));
  ASSERT_EQ(ev.back().kind, KvEvent::Kind::kCleared);
  m.Release(std::vector<int32_t>{ids[0]});
  EXPECT_EQ(m.num_free(), 4);
}

TEST(BlockManagerTest, PrefixCachingOff) {
  KvEventLog log;
  BlockManager m(2, 2, false, &log);
  std::vector<int32_t> ids;
  ASSERT_TRUE(m.Allocate(1, &ids));
  m.Commit(ids[0], 1, 0, Tokens(2));
  EXPECT_FALSE(m.is_cached(ids[0]));
  EXPECT_EQ(log.last_seq(), 0u);
}

TEST(KvEventLogTest, ResumeGapAndSnapshot) {
  KvEventLog log(/*capacity=*/3);
  int notified = 0;
  int id = log.AddListener([&] { ++notified; });
  for (int i = 1; i <= 5; ++i) log.Stored(i, i - 1, Tokens(2, i));
  log.Removed(2);
  log.Publish();
  log.Publish();  // nothing new: no second notification
  EXPECT_EQ(notified, 1);
  log.RemoveListener(id);
  std::vector<KvEvent> ev;
  EXPECT_FALSE(log.ReadSince(1, 100, &ev));  // 2 and 3 were dropped
  EXPECT_TRUE(ev.empty());
  ASSERT_TRUE(log.ReadSince(3, 100, &ev));
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].seq, 4u);
  EXPECT_EQ(ev[2].kind, KvEvent::Kind::kRemoved);
  KvSnapshot snap = log.TakeSnapshot();
  EXPECT_EQ(snap.seq, 6u);
  EXPECT_EQ(snap.blocks.size(), 4u);  // 1, 3, 4, 5
}

}  // namespace
}  // namespace tandem::worker
