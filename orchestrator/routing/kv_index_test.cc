#include "orchestrator/routing/kv_index.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {
namespace {

using std::chrono::seconds;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using TimePoint = KvIndex::TimePoint;

const TimePoint kT0 = TimePoint() + std::chrono::hours(1);

// Builds a KvEventBatch fluently: Batch("i1").Stored(1, 100).Removed(2, 100).
class Batch {
 public:
  explicit Batch(const std::string& instance_id) { batch_.set_instance_id(instance_id); }

  Batch& Stored(uint64_t seq, uint64_t hash) {
    auto* e = batch_.add_events();
    e->set_seq(seq);
    e->mutable_stored()->set_block_hash(hash);
    return *this;
  }
  Batch& Removed(uint64_t seq, uint64_t hash) {
    auto* e = batch_.add_events();
    e->set_seq(seq);
    e->mutable_removed()->set_block_hash(hash);
    return *this;
  }
  Batch& Cleared(uint64_t seq) {
    auto* e = batch_.add_events();
    e->set_seq(seq);
    e->mutable_cleared();
    return *this;
  }
  Batch& Snapshot(uint64_t seq, std::vector<uint64_t> hashes, bool complete) {
    auto* s = batch_.mutable_snapshot();
    s->set_seq(seq);
    s->set_complete(complete);
    for (uint64_t h : hashes) s->add_blocks()->set_block_hash(h);
    return *this;
  }
  operator const tandem::v1::KvEventBatch&() const { return batch_; }

 private:
  tandem::v1::KvEventBatch batch_;
};

// Worker id -> matched blocks, for readable expectations.
std::map<std::string, int64_t> MatchMap(KvIndex& index, std::vector<uint64_t> hashes, TimePoint now = kT0) {
  std::map<std::string, int64_t> out;
  for (const auto& o : index.Match(hashes, now)) out[o.worker_id] = o.matched_blocks;
  return out;
}

using M = std::map<std::string, int64_t>;

TEST(KvIndexTest, EventsAreAppliedAndMatched) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(0, {}, true)).ok());
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11).Stored(3, 12)).ok());
  ASSERT_TRUE(index.Apply("w2", Batch("b").Snapshot(7, {10}, true).Stored(8, 11)).ok());

  EXPECT_EQ(MatchMap(index, {10, 11, 12, 13}), (M{{"w1", 3}, {"w2", 2}}));
  EXPECT_EQ(MatchMap(index, {10}), (M{{"w1", 1}, {"w2", 1}}));
  EXPECT_THAT(MatchMap(index, {99, 10}), IsEmpty());
  EXPECT_THAT(MatchMap(index, {}), IsEmpty());
  EXPECT_EQ(index.size(), 5u);
  EXPECT_EQ(index.mode("w1"), WorkerMode::kExact);
  EXPECT_EQ(index.mode("w2"), WorkerMode::kExact);
  EXPECT_EQ(index.mode("nobody"), WorkerMode::kApproximate);

  const auto workers = index.workers();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].id, "w1");
  EXPECT_EQ(workers[0].blocks, 3);
  EXPECT_EQ(workers[0].last_seq, 3u);
  EXPECT_EQ(workers[0].instance_id, "a");
  EXPECT_EQ(workers[1].last_seq, 8u);
  EXPECT_EQ(index.stats().events_applied, 4u);
}

TEST(KvIndexTest, MatchStopsAtTheFirstMissingBlock) {
  KvIndex index({});
  // w1 holds blocks 0, 1 and 3 of the request; w2 holds 1 and 2 but not 0.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11).Stored(3, 13)).ok());
  ASSERT_TRUE(index.Apply("w2", Batch("b").Stored(1, 11).Stored(2, 12)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11, 12, 13}), (M{{"w1", 2}}));
  EXPECT_EQ(MatchMap(index, {11, 12, 13}), (M{{"w1", 1}, {"w2", 2}}));
}

TEST(KvIndexTest, RemovedAndClearedEvents) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11).Stored(3, 12).Removed(4, 11)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11, 12}), (M{{"w1", 1}}));
  EXPECT_EQ(index.size(), 2u);
  // Removing a block it does not hold is harmless.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Removed(5, 77)).ok());
  ASSERT_TRUE(index.Apply("w2", Batch("b").Stored(1, 10)).ok());
  ASSERT_TRUE(index.Apply("w1", Batch("a").Cleared(6)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11, 12}), (M{{"w2", 1}}));
  EXPECT_EQ(index.size(), 1u);
  EXPECT_EQ(index.mode("w1"), WorkerMode::kExact);
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(7, 10)).ok());
  EXPECT_EQ(MatchMap(index, {10}), (M{{"w1", 1}, {"w2", 1}}));
}

TEST(KvIndexTest, RestartWithANewInstanceIdDropsTheWorkersBlocks) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11)).ok());
  ASSERT_TRUE(index.Apply("w2", Batch("b").Stored(1, 10)).ok());
  // The new process opens with a snapshot, still incomplete: nothing of the
  // old process is answered meanwhile.
  ASSERT_TRUE(index.Apply("w1", Batch("a2").Snapshot(3, {10}, false)).ok());
  EXPECT_EQ(index.mode("w1"), WorkerMode::kStale);
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w2", 1}}));
  EXPECT_EQ(index.stats().restarts, 1u);
  ASSERT_TRUE(index.Apply("w1", Batch("a2").Snapshot(3, {}, true).Stored(4, 20)).ok());
  EXPECT_EQ(index.mode("w1"), WorkerMode::kExact);
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w1", 1}, {"w2", 1}}));
  EXPECT_EQ(MatchMap(index, {20}), (M{{"w1", 1}}));
  EXPECT_EQ(index.size(), 3u);
}

TEST(KvIndexTest, RestartedWorkerMayReplayItsLogFromSeqOne) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11)).ok());
  ASSERT_TRUE(index.Apply("w1", Batch("a2").Stored(1, 30)).ok());
  EXPECT_EQ(index.mode("w1"), WorkerMode::kExact);
  EXPECT_THAT(MatchMap(index, {10}), IsEmpty());
  EXPECT_EQ(MatchMap(index, {30}), (M{{"w1", 1}}));
}

TEST(KvIndexTest, ChunkedSnapshotAnswersFromTheOldStateUntilComplete) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11)).ok());
  // A mid-stream snapshot (the subscriber fell behind) in three chunks.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(50, {20, 21}, false)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w1", 2}}));
  EXPECT_THAT(MatchMap(index, {20}), IsEmpty());
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(50, {22}, false)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w1", 2}}));
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(50, {23}, true).Stored(51, 24)).ok());
  EXPECT_THAT(MatchMap(index, {10}), IsEmpty());
  EXPECT_EQ(MatchMap(index, {20, 21, 22, 23, 24}), (M{{"w1", 5}}));
  EXPECT_EQ(index.size(), 5u);
  EXPECT_EQ(index.workers()[0].last_seq, 51u);
  EXPECT_EQ(index.stats().snapshots_completed, 1u);
}

TEST(KvIndexTest, ASnapshotWithANewSeqSupersedesAnIncompleteOne) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(5, {1, 2}, false)).ok());
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(9, {3}, true)).ok());
  EXPECT_THAT(MatchMap(index, {1}), IsEmpty());
  EXPECT_EQ(MatchMap(index, {3}), (M{{"w1", 1}}));
}

TEST(KvIndexTest, EventsInsideAnIncompleteSnapshotAreRejected) {
  KvIndex index({});
  auto status = index.Apply("w1", Batch("a").Snapshot(5, {1}, false).Stored(6, 2));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index.mode("w1"), WorkerMode::kStale);
  EXPECT_EQ(index.Apply("w1", Batch("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index.stats().bad_batches, 2u);
}

TEST(KvIndexTest, SeqGapIsDataLossAndMarksTheWorkerStale) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10).Stored(2, 11)).ok());
  // Replays of applied seqs are skipped.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(2, 11).Stored(3, 12)).ok());
  EXPECT_EQ(index.stats().events_replayed, 1u);

  auto status = index.Apply("w1", Batch("a").Stored(5, 14));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(index.mode("w1"), WorkerMode::kStale);
  EXPECT_EQ(index.stats().seq_gaps, 1u);
  // The old state still answers; further events are refused until a snapshot.
  EXPECT_EQ(MatchMap(index, {10, 11, 12, 14}), (M{{"w1", 3}}));
  EXPECT_EQ(index.Apply("w1", Batch("a").Stored(6, 15)).code(), absl::StatusCode::kDataLoss);

  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(6, {10, 11, 12, 13, 14, 15}, true)).ok());
  EXPECT_EQ(index.mode("w1"), WorkerMode::kExact);
  EXPECT_EQ(MatchMap(index, {10, 11, 12, 13, 14, 15}), (M{{"w1", 6}}));
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(7, 16)).ok());
}

TEST(KvIndexTest, EventsWithoutASyncPointAreDataLoss) {
  KvIndex index({});
  EXPECT_EQ(index.Apply("w1", Batch("a").Stored(5, 10)).code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(MatchMap(index, {10}), IsEmpty());
}

TEST(KvIndexTest, ApproximateEntriesExpireAfterTheTtl) {
  KvIndex index({.ttl = seconds(120)});
  const std::vector<uint64_t> hashes = {10, 11, 12};
  index.RecordRouted("w1", hashes, kT0);
  index.RecordRouted("w2", std::span<const uint64_t>(hashes).first(1), kT0 + seconds(60));
  EXPECT_EQ(index.mode("w1"), WorkerMode::kApproximate);
  EXPECT_EQ(MatchMap(index, hashes, kT0 + seconds(119)), (M{{"w1", 3}, {"w2", 1}}));
  EXPECT_EQ(MatchMap(index, hashes, kT0 + seconds(120)), (M{{"w2", 1}}));
  // Dropped lazily: the Match above met w1's blocks 10 and 11 (it stops at
  // 11, where no live holder is left); block 12 stays until met or evicted.
  EXPECT_EQ(index.size(), 2u);
  EXPECT_EQ(index.stats().expirations, 2u);
  // Routing again refreshes the TTL.
  index.RecordRouted("w2", hashes, kT0 + seconds(170));
  EXPECT_EQ(MatchMap(index, hashes, kT0 + seconds(250)), (M{{"w2", 3}}));
  EXPECT_EQ(index.size(), 3u);  // w1's 12 met and dropped
  EXPECT_THAT(MatchMap(index, hashes, kT0 + seconds(300)), IsEmpty());
  EXPECT_EQ(index.stats().expirations, 4u);
}

TEST(KvIndexTest, RecordRoutedIsIgnoredForExactWorkersAndDroppedWhenAWorkerSyncs) {
  KvIndex index({});
  const std::vector<uint64_t> hashes = {10, 11};
  ASSERT_TRUE(index.Apply("exact", Batch("a").Snapshot(0, {}, true)).ok());
  index.RecordRouted("exact", hashes, kT0);
  EXPECT_THAT(MatchMap(index, hashes), IsEmpty());

  // Recorded while approximate, then replaced by the first complete snapshot.
  index.RecordRouted("late", hashes, kT0);
  EXPECT_EQ(MatchMap(index, hashes), (M{{"late", 2}}));
  ASSERT_TRUE(index.Apply("late", Batch("b").Snapshot(3, {10}, false)).ok());
  EXPECT_EQ(MatchMap(index, hashes), (M{{"late", 2}}));
  ASSERT_TRUE(index.Apply("late", Batch("b").Snapshot(3, {}, true)).ok());
  EXPECT_EQ(MatchMap(index, hashes, kT0 + std::chrono::hours(100)), (M{{"late", 1}}));
}

TEST(KvIndexTest, MemoryCapEvictsTheLeastRecentlyUsedEntries) {
  KvIndex index({.max_blocks = 100});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Snapshot(0, {}, true)).ok());
  // A hot prefix, matched after every store, survives a stream of cold blocks.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 1).Stored(2, 2)).ok());
  uint64_t seq = 2;
  for (uint64_t h = 1000; h < 2000; ++h) {
    ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(++seq, h)).ok());
    ASSERT_EQ(MatchMap(index, {1, 2}), (M{{"w1", 2}}));
    ASSERT_LE(index.size(), 100u);
  }
  EXPECT_EQ(index.size(), 100u);
  EXPECT_EQ(index.stats().evictions, 902u);
  EXPECT_EQ(MatchMap(index, {1999}), (M{{"w1", 1}}));
  EXPECT_EQ(MatchMap(index, {1902}), (M{{"w1", 1}}));
  EXPECT_THAT(MatchMap(index, {1901}), IsEmpty());
  // Removing an evicted block is a no-op.
  ASSERT_TRUE(index.Apply("w1", Batch("a").Removed(++seq, 1000)).ok());
  EXPECT_EQ(index.workers()[0].blocks, 100);

  // The cap spans workers and modes; a snapshot beyond it is truncated.
  std::vector<uint64_t> many;
  for (uint64_t h = 5000; h < 5300; ++h) many.push_back(h);
  index.RecordRouted("w2", many, kT0);
  EXPECT_EQ(index.size(), 100u);
  ASSERT_TRUE(index.Apply("w3", Batch("c").Snapshot(1, many, true)).ok());
  EXPECT_EQ(index.size(), 100u);
  EXPECT_EQ(index.stats().snapshot_blocks_truncated, 200u);
}

TEST(KvIndexTest, RemoveWorkerForgetsItsEntries) {
  KvIndex index({});
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10)).ok());
  index.RecordRouted("w2", std::vector<uint64_t>{10, 11}, kT0);
  index.RemoveWorker("w1");
  index.RemoveWorker("never-seen");
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w2", 2}}));
  EXPECT_EQ(index.size(), 2u);
  ASSERT_EQ(index.workers().size(), 1u);
  // The id can come back, as a new worker.
  EXPECT_EQ(index.mode("w1"), WorkerMode::kApproximate);
  ASSERT_TRUE(index.Apply("w1", Batch("a").Stored(1, 10)).ok());
  EXPECT_EQ(MatchMap(index, {10, 11}), (M{{"w1", 1}, {"w2", 2}}));
}

TEST(KvIndexTest, ConcurrentApplyAndMatch) {
  KvIndex index({.max_blocks = 5000});
  constexpr int kWriters = 4;
  constexpr int kReaders = 4;
  constexpr uint64_t kEvents = 3000;
  std::atomic<bool> done{false};
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      const std::string id = absl::StrCat("w", w);
      for (uint64_t seq = 1; seq <= kEvents; ++seq) {
        // Blocks 0..499 shared by all, stored and removed in turn.
        Batch batch("i");
        if (seq % 3 == 0) {
          batch.Removed(seq, seq % 500);
        } else {
          batch.Stored(seq, seq % 500);
        }
        if (!index.Apply(id, batch).ok()) errors.fetch_add(1);
        if (seq % 100 == 0) {
          index.RecordRouted(absl::StrCat("approx", w), std::vector<uint64_t>{1, 2, 3}, kT0);
        }
      }
    });
  }
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&] {
      std::vector<uint64_t> hashes(32);
      for (size_t i = 0; i < hashes.size(); ++i) hashes[i] = i;
      while (!done.load()) {
        for (const auto& o : index.Match(hashes, kT0)) {
          if (o.matched_blocks < 1 || o.matched_blocks > 32) errors.fetch_add(1);
        }
        if (index.size() > 5000) errors.fetch_add(1);
      }
    });
  }
  for (int w = 0; w < kWriters; ++w) threads[w].join();
  done.store(true);
  for (size_t i = kWriters; i < threads.size(); ++i) threads[i].join();
  EXPECT_EQ(errors.load(), 0);
  for (const auto& info : index.workers()) {
    if (info.id.starts_with("approx")) continue;
    EXPECT_EQ(info.mode, WorkerMode::kExact) << info.id;
    EXPECT_EQ(info.last_seq, kEvents) << info.id;
  }
}

// A batch longer than the index applies in one go (a prefill stores a block
// per 16 tokens) releases the lock between chunks: matches run meanwhile and
// see a growing prefix; a worker removed mid-batch stays removed.
TEST(KvIndexTest, LongBatchesLetMatchesInAndStopWhenTheWorkerIsRemoved) {
  KvIndex index({});
  constexpr uint64_t kBlocks = 5000;
  std::vector<uint64_t> hashes(kBlocks);
  for (uint64_t i = 0; i < kBlocks; ++i) hashes[i] = 1000 + i;
  Batch batch("a");
  for (uint64_t i = 0; i < kBlocks; ++i) batch.Stored(i + 1, hashes[i]);

  std::atomic<bool> done{false};
  std::atomic<int64_t> last_seen{0};
  std::atomic<int> errors{0};
  std::thread reader([&] {
    while (!done.load()) {
      for (const auto& o : index.Match(hashes, kT0)) {
        // A prefix only ever grows while the batch applies.
        if (o.matched_blocks < last_seen.load()) errors.fetch_add(1);
        last_seen.store(o.matched_blocks);
      }
    }
  });
  ASSERT_TRUE(index.Apply("w1", batch).ok());
  done.store(true);
  reader.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(MatchMap(index, hashes), (M{{"w1", static_cast<int64_t>(kBlocks)}}));
  EXPECT_EQ(index.size(), kBlocks);

  // Removed while a long batch applies: nothing of it is left afterwards.
  Batch more("b");
  for (uint64_t i = 0; i < kBlocks; ++i) more.Stored(i + 1, hashes[i] + kBlocks);
  std::thread remover([&] {
    while (index.size() == kBlocks) std::this_thread::yield();  // "b" started
    index.RemoveWorker("w2");
  });
  ASSERT_TRUE(index.Apply("w2", more).ok());
  remover.join();
  EXPECT_EQ(index.mode("w2"), WorkerMode::kApproximate);  // unknown again
  EXPECT_EQ(index.size(), kBlocks);                       // w1's only
  EXPECT_EQ(MatchMap(index, hashes), (M{{"w1", static_cast<int64_t>(kBlocks)}}));
}

}  // namespace
}  // namespace tandem::router
