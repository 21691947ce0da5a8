// NcclTransport over the fake NCCL (host pools): pairing, pushes matched to
// receives by their headers whatever order either side starts them in,
// fences, deadlines, cancels, peer removal, the aborts that end a pair, and
// the refusals. The real library between two GPUs: docs/plans/issue-24-nccl.md.
#include "kvtransfer/nccl/nccl_transport.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/process_info.h"

namespace tandem::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kBlocks = 32;
constexpr int64_t kBlockBytes = 256;

PoolLayout Layout() {
  return PoolLayout{.model = "m",
                    .dtype = "bfloat16",
                    .num_layers = 1,
                    .num_kv_heads = 1,
                    .head_dim = 64,
                    .block_size = 2,
                    .num_blocks = kBlocks,
                    .block_bytes = kBlockBytes,
                    .memory_type = MemoryType::kHost};
}

// A `done` to wait for.
class Waiter {
 public:
  TransferDone Callback() {
    return [this](absl::Status st) { promise_.set_value(std::move(st)); };
  }
  absl::Status Wait(milliseconds limit = milliseconds(5000)) {
    if (future_.wait_for(limit) != std::future_status::ready) return absl::DeadlineExceededError("done never came");
    return future_.get();
  }
  bool Called() { return future_.wait_for(milliseconds(0)) == std::future_status::ready; }

 private:
  std::promise<absl::Status> promise_;
  std::future<absl::Status> future_ = promise_.get_future();
};

// A write fence the test completes.
class ManualFence final : public WriteFence {
 public:
  MemoryType memory() const override { return MemoryType::kHost; }
  absl::Status Wait(Deadline deadline) const override {
    while (!done.load()) {
      if (Clock::now() >= deadline) return absl::DeadlineExceededError("writes not done");
      std::this_thread::sleep_for(milliseconds(1));
    }
    return absl::OkStatus();
  }
  bool Completed() const override { return done.load(); }
  std::atomic<bool> done{false};
};

class NcclTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fabric_ = NewFakeNcclFabric();
    for (int i = 0; i < 2; ++i) {
      pool_[i].resize(kBlocks * kBlockBytes);
      // Side 0: seeded random bytes (every block its own, so a block that
      // lands in the wrong place shows); side 1: zeros.
      std::mt19937 rng(7);
      for (uint8_t& b : pool_[i]) b = i == 0 ? static_cast<uint8_t>(rng()) : 0;
      t_[i] = MakeTransport();
      ASSERT_TRUE(t_[i]->RegisterPool(Layout(), pool_[i].data()).ok());
    }
  }
  // Pushes of two or more runs go through staging pieces of two blocks
  // (unless `stage_runs_below` is 0).
  std::unique_ptr<NcclTransport> MakeTransport(int64_t stage_runs_below = int64_t{16} << 20,
                                               milliseconds idle_receive_limit = milliseconds(5000)) {
    absl::StatusOr<std::unique_ptr<NcclTransport>> t =
        NcclTransport::Create({.device = 0,
                               .api = std::shared_ptr<NcclApi>(NewFakeNccl(fabric_)),
                               .host_pools = true,
                               .stage_piece = 2 * kBlockBytes,
                               .stage_runs_below = stage_runs_below,
                               .idle_receive_limit = idle_receive_limit});
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  PeerInfo Info(int i) { return *t_[i]->LocalInfo(); }
  static Deadline In(int ms) { return Clock::now() + milliseconds(ms); }
  // Transport 0 pairs as the initiator (the pushing side), 1 as the responder.
  void PairUp() {
    Waiter a, b;
    absl::StatusOr<std::string> offer = t_[0]->Pair(Info(1), PairRole::kInitiator, "", In(5000), a.Callback());
    ASSERT_TRUE(offer.ok()) << offer.status();
    EXPECT_EQ(offer->size(), NcclApi::kUniqueIdBytes);
    offer_ = *offer;
    absl::StatusOr<std::string> answer = t_[1]->Pair(Info(0), PairRole::kResponder, *offer, In(5000), b.Callback());
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_TRUE(a.Wait().ok());
    EXPECT_TRUE(b.Wait().ok());
  }
  std::vector<uint8_t> Block(int side, int id) {
    return {pool_[side].begin() + id * kBlockBytes, pool_[side].begin() + (id + 1) * kBlockBytes};
  }
  absl::StatusOr<uint64_t> Push(std::vector<BlockPair> pairs, uint64_t tag, Waiter& w,
                                std::shared_ptr<const WriteFence> fence = CompletedFence(), int ms = 5000) {
    return t_[0]->PushAfter(Info(1).agent_id, std::move(pairs), std::move(fence), tag, In(ms), w.Callback());
  }
  absl::StatusOr<uint64_t> Receive(std::vector<BlockPair> pairs, uint64_t tag, Waiter& w, int ms = 5000) {
    return t_[1]->Receive(Info(0).agent_id, std::move(pairs), tag, In(ms), w.Callback());
  }
  // A receive, then its push: both end OK and every destination holds its source.
  void ExpectMoved(const std::vector<BlockPair>& pairs, uint64_t tag) {
    Waiter r, p;
    ASSERT_TRUE(Receive(pairs, tag, r).ok());
    ASSERT_TRUE(Push(pairs, tag, p).ok());
    EXPECT_TRUE(p.Wait().ok());
    EXPECT_TRUE(r.Wait().ok());
    for (const BlockPair& b : pairs) EXPECT_EQ(Block(1, b.dst), Block(0, b.src)) << "block " << b.dst;
  }
  // A receive of `received` and a push of `pushed` for one tag that the
  // receiver's header check refuses before a byte lands: the receive ends
  // Unavailable saying `why`, the push fails, the receive's blocks stay zero.
  void ExpectRefusedBeforeAnyByte(const std::vector<BlockPair>& received, const std::vector<BlockPair>& pushed,
                                  uint64_t tag, const std::string& why) {
    Waiter r, p;
    ASSERT_TRUE(Receive(received, tag, r).ok());
    ASSERT_TRUE(Push(pushed, tag, p).ok());
    const absl::Status st = r.Wait();
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
    EXPECT_NE(st.message().find(why), std::string::npos) << st;
    EXPECT_FALSE(p.Wait().ok());
    for (const BlockPair& b : received) EXPECT_EQ(Block(1, b.dst), std::vector<uint8_t>(kBlockBytes, 0)) << b.dst;
  }

  std::shared_ptr<FakeNcclFabric> fabric_;
  std::string offer_;  // the last pairing's
  std::vector<uint8_t> pool_[2];
  std::unique_ptr<NcclTransport> t_[2];
};

TEST_F(NcclTransportTest, PushesBlocksIntoTheReceiversBlocks) {
  PairUp();
  ExpectMoved({{1, 5}, {2, 6}, {3, 7}, {9, 0}}, 7);
  EXPECT_EQ(Block(1, 1), std::vector<uint8_t>(kBlockBytes, 0));  // not a destination
}

// The receives are posted in one order, the pushes start in the reverse:
// each push's header finds its own receive.
TEST_F(NcclTransportTest, ConcurrentPushesFindTheirReceivesInAnyOrder) {
  PairUp();
  constexpr int kN = 8;
  Waiter r[kN], p[kN];
  auto pairs = [](int i) { return std::vector<BlockPair>{{i, 2 * i}, {i + 8, 2 * i + 1}}; };
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(Receive(pairs(i), 100 + i, r[i]).ok());
  for (int i = kN - 1; i >= 0; --i) ASSERT_TRUE(Push(pairs(i), 100 + i, p[i]).ok());
  for (int i = 0; i < kN; ++i) {
    EXPECT_TRUE(p[i].Wait().ok()) << i;
    EXPECT_TRUE(r[i].Wait().ok()) << i;
    for (const BlockPair& b : pairs(i)) EXPECT_EQ(Block(1, b.dst), Block(0, b.src)) << "transfer " << i;
  }
}

// A push posted before its receive waits for it (the header lands when the
// receiver's header receive is up; the receive then finds it).
TEST_F(NcclTransportTest, APushBeforeItsReceiveWaitsForIt) {
  PairUp();
  Waiter r, p;
  ASSERT_TRUE(Push({{4, 4}}, 3, p).ok());
  std::this_thread::sleep_for(milliseconds(30));
  ASSERT_TRUE(Receive({{4, 4}}, 3, r).ok());
  EXPECT_TRUE(p.Wait().ok());
  EXPECT_TRUE(r.Wait().ok());
  EXPECT_EQ(Block(1, 4), Block(0, 4));
}

TEST_F(NcclTransportTest, APushStartsOnlyOnceItsFenceCompleted) {
  PairUp();
  auto fence = std::make_shared<ManualFence>();
  Waiter r, p;
  ASSERT_TRUE(Receive({{2, 3}}, 1, r).ok());
  ASSERT_TRUE(Push({{2, 3}}, 1, p, fence).ok());
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(p.Called());
  EXPECT_FALSE(r.Called());
  EXPECT_EQ(Block(1, 3), std::vector<uint8_t>(kBlockBytes, 0));
  fence->done = true;
  EXPECT_TRUE(p.Wait().ok());
  EXPECT_TRUE(r.Wait().ok());
  EXPECT_EQ(Block(1, 3), Block(0, 2));
}

// A receive whose push never comes ends at its deadline; the pair goes on.
TEST_F(NcclTransportTest, AReceiveWithoutItsPushEndsAtItsDeadline) {
  PairUp();
  Waiter lonely;
  ASSERT_TRUE(Receive({{1, 1}}, 50, lonely, /*ms=*/80).ok());
  EXPECT_EQ(lonely.Wait().code(), absl::StatusCode::kDeadlineExceeded);
  ExpectMoved({{6, 6}}, 51);
}

// A fence that never completes holds its push to its deadline only; a
// cancel ends a push not yet started at once. Each still sends its tag's
// header, a decline: their receives end then (Aborted), long before their
// own deadlines, and nothing stays posted past the idle limit.
TEST_F(NcclTransportTest, PushesNotStartedEndAtTheirDeadlineOrCancelAndDeclineTheirReceives) {
  t_[1] = MakeTransport(int64_t{16} << 20, /*idle_receive_limit=*/milliseconds(150));
  ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
  PairUp();
  auto never = std::make_shared<ManualFence>();
  Waiter late, cancelled, late_receive, cancelled_receive;
  ASSERT_TRUE(Receive({{1, 1}}, 8, late_receive, /*ms=*/20000).ok());
  ASSERT_TRUE(Receive({{2, 2}, {3, 3}}, 9, cancelled_receive, /*ms=*/20000).ok());
  const auto start = Clock::now();
  ASSERT_TRUE(Push({{1, 1}}, 8, late, never, /*ms=*/80).ok());
  absl::StatusOr<uint64_t> id = Push({{2, 2}, {3, 3}}, 9, cancelled, never);
  ASSERT_TRUE(id.ok());
  t_[0]->Cancel(*id);
  EXPECT_EQ(cancelled.Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(late.Wait().code(), absl::StatusCode::kDeadlineExceeded);
  t_[0]->Cancel(*id);  // again: its decline still goes
  EXPECT_EQ(cancelled_receive.Wait().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(late_receive.Wait().code(), absl::StatusCode::kAborted);
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  std::this_thread::sleep_for(milliseconds(500));  // past the idle limit
  ExpectMoved({{4, 4}}, 10);
  EXPECT_EQ(Block(1, 1), std::vector<uint8_t>(kBlockBytes, 0));
  EXPECT_EQ(Block(1, 2), std::vector<uint8_t>(kBlockBytes, 0));
}

// Scattered blocks (every pair its own run) go through the staging buffer,
// gathered and scattered a piece of two blocks at a time, a piece cut
// inside a run too; concurrent staged pushes whose receives were posted in
// the other order each land in their own blocks; a staged push for a
// receive that ended is drained piece by piece, and the pair goes on.
TEST_F(NcclTransportTest, ScatteredRunsMoveThroughStagingPieces) {
  PairUp();
  constexpr int kN = 2;
  auto pairs = [](int i) {
    // Six runs (one of two blocks, which a piece boundary cuts), 1792 bytes:
    // four pieces.
    std::vector<BlockPair> v;
    for (int k = 0; k < 5; ++k) {
      v.push_back({i * 10 + 2 * k, 31 - (i * 10 + 2 * k)});
      if (k == 0) {
        v.push_back({24 + 2 * i, 2 * i});
        v.push_back({25 + 2 * i, 2 * i + 1});
      }
    }
    return v;
  };
  Waiter r[kN], p[kN];
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(Receive(pairs(i), 300 + i, r[i]).ok());
  for (int i = kN - 1; i >= 0; --i) ASSERT_TRUE(Push(pairs(i), 300 + i, p[i]).ok());
  std::vector<bool> written(kBlocks, false);
  for (int i = 0; i < kN; ++i) {
    EXPECT_TRUE(p[i].Wait().ok()) << i;
    EXPECT_TRUE(r[i].Wait().ok()) << i;
    for (const BlockPair& b : pairs(i)) {
      EXPECT_EQ(Block(1, b.dst), Block(0, b.src)) << "transfer " << i << " block " << b.dst;
      written[b.dst] = true;
    }
  }
  for (int b = 0; b < kBlocks; ++b) {
    if (!written[b]) {
      EXPECT_EQ(Block(1, b), std::vector<uint8_t>(kBlockBytes, 0)) << "block " << b;
    }
  }
  // Drained: a cancelled receive's staged push lands nowhere.
  std::fill(pool_[1].begin(), pool_[1].end(), 0);
  Waiter gone, drained, r2, p2;
  absl::StatusOr<uint64_t> id = Receive(pairs(0), 400, gone);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(Receive(pairs(1), 401, r2).ok());
  t_[1]->Cancel(*id);
  EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(Push(pairs(0), 400, drained).ok());
  EXPECT_TRUE(drained.Wait().ok());
  ASSERT_TRUE(Push(pairs(1), 401, p2).ok());
  EXPECT_TRUE(p2.Wait().ok());
  EXPECT_TRUE(r2.Wait().ok());
  for (const BlockPair& b : pairs(0)) EXPECT_EQ(Block(1, b.dst), std::vector<uint8_t>(kBlockBytes, 0)) << b.dst;
  for (const BlockPair& b : pairs(1)) EXPECT_EQ(Block(1, b.dst), Block(0, b.src)) << b.dst;
}

// A receive that ended without its push leaves the header receive posted
// alone: past the limit the receiver ends the pair (a posted NCCL receive
// holds whatever waits for the whole GPU), its next receive is refused
// until the pair is made afresh, and then pushes go on. A receive open
// longer than the limit keeps the pair.
TEST_F(NcclTransportTest, AHeaderReceiveLeftAloneEndsThePairPastTheLimit) {
  t_[1] = MakeTransport(int64_t{16} << 20, /*idle_receive_limit=*/milliseconds(150));
  ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
  PairUp();
  Waiter waited, p0;
  ASSERT_TRUE(Receive({{2, 2}}, 60, waited).ok());
  std::this_thread::sleep_for(milliseconds(400));  // open past the limit: the pair stays
  ASSERT_TRUE(Push({{2, 2}}, 60, p0).ok());
  EXPECT_TRUE(p0.Wait().ok());
  EXPECT_TRUE(waited.Wait().ok());
  Waiter gone;
  absl::StatusOr<uint64_t> id = Receive({{1, 1}}, 61, gone);
  ASSERT_TRUE(id.ok());
  t_[1]->Cancel(*id);
  EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
  std::this_thread::sleep_for(milliseconds(500));
  Waiter refused;
  EXPECT_EQ(Receive({{3, 3}}, 62, refused).status().code(), absl::StatusCode::kUnavailable);
  PairUp();
  ExpectMoved({{4, 4}}, 63);
}

// A push the sender declines (Decline: its JOIN's answer did not suit it)
// ends its open Receive at once, Aborted; one for a receive that ended
// already completes the header receive that waited for it. Either way no
// header receive is left posted alone, so the pair outlives the idle limit.
TEST_F(NcclTransportTest, ADeclinedPushEndsItsReceiveAndLeavesNothingPosted) {
  t_[1] = MakeTransport(int64_t{16} << 20, /*idle_receive_limit=*/milliseconds(150));
  ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
  PairUp();
  Waiter declined;
  ASSERT_TRUE(Receive({{1, 1}, {4, 7}}, 70, declined).ok());
  t_[0]->Decline(Info(1).agent_id, 70);
  const absl::Status st = declined.Wait();
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_NE(st.message().find("declined"), std::string::npos) << st;
  Waiter gone;
  absl::StatusOr<uint64_t> id = Receive({{2, 2}}, 71, gone);
  ASSERT_TRUE(id.ok());
  t_[1]->Cancel(*id);
  EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
  t_[0]->Decline(Info(1).agent_id, 71);
  t_[0]->Decline("nccl-no-such-peer", 72);         // no pair: nothing to tell
  std::this_thread::sleep_for(milliseconds(500));  // past the idle limit
  ExpectMoved({{3, 3}}, 73);
  EXPECT_EQ(Block(1, 1), std::vector<uint8_t>(kBlockBytes, 0));
}

// A pair whose pushes all landed posts no header receive (none is owed), so
// a quiet spell past the idle limit leaves it paired: the next push needs no
// new communicator.
TEST_F(NcclTransportTest, AQuietPairStaysPairedPastTheIdleLimit) {
  t_[1] = MakeTransport(int64_t{16} << 20, /*idle_receive_limit=*/milliseconds(150));
  ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
  PairUp();
  ExpectMoved({{1, 1}}, 100);
  ExpectMoved({{2, 2}, {5, 9}}, 101);
  std::this_thread::sleep_for(milliseconds(500));
  ExpectMoved({{3, 3}}, 102);
}

// A receive that ended keeps a header receive posted for its tag's header
// (its push, drained, or its decline) even once another push took the one
// posted before: the sender's header then never waits unmatched on its GPU.
// Its decline clears it; without one, the header receive left alone ends
// the pair at the idle limit.
TEST_F(NcclTransportTest, AnEndedReceiveStillTakesItsTagsHeader) {
  for (const bool declined : {true, false}) {
    SCOPED_TRACE(declined ? "declined" : "never told");
    t_[1] = MakeTransport(int64_t{16} << 20, /*idle_receive_limit=*/milliseconds(150));
    ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
    PairUp();
    Waiter gone, other, p;
    absl::StatusOr<uint64_t> id = Receive({{1, 1}}, 90, gone);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE(Receive({{2, 2}}, 91, other).ok());
    t_[1]->Cancel(*id);
    EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
    ASSERT_TRUE(Push({{2, 2}}, 91, p).ok());  // takes the header receive posted for both
    EXPECT_TRUE(p.Wait().ok());
    EXPECT_TRUE(other.Wait().ok());
    if (declined) {
      Waiter late;
      absl::StatusOr<uint64_t> push = Push({{1, 1}}, 90, late, std::make_shared<ManualFence>());
      ASSERT_TRUE(push.ok());
      t_[0]->Cancel(*push);
      EXPECT_EQ(late.Wait().code(), absl::StatusCode::kCancelled);
    }
    std::this_thread::sleep_for(milliseconds(500));  // past the idle limit
    if (declined) {
      ExpectMoved({{3, 3}}, 92);
    } else {
      Waiter refused;
      EXPECT_EQ(Receive({{3, 3}}, 92, refused).status().code(), absl::StatusCode::kUnavailable);
    }
    EXPECT_EQ(Block(1, 1), std::vector<uint8_t>(kBlockBytes, 0));
  }
}

// Without staging, the runs go as one group's sends.
TEST_F(NcclTransportTest, ScatteredRunsMoveAsOneGroupWithoutStaging) {
  for (int i = 0; i < 2; ++i) {
    t_[i] = MakeTransport(/*stage_runs_below=*/0);
    ASSERT_TRUE(t_[i]->RegisterPool(Layout(), pool_[i].data()).ok());
  }
  PairUp();
  std::vector<BlockPair> pairs;
  for (int k = 0; k < 8; ++k) pairs.push_back({3 * k, 31 - 3 * k});
  ExpectMoved(pairs, 9);
}

// A push for a receive that ended before it came (cancelled here) is
// drained into scratch memory: nothing lands in the receive's blocks, and
// the pair goes on.
TEST_F(NcclTransportTest, APushForAnEndedReceiveIsDrainedAndThePairGoesOn) {
  PairUp();
  Waiter gone, other, p;
  absl::StatusOr<uint64_t> id = Receive({{1, 1}, {5, 9}}, 20, gone);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(Receive({{2, 2}}, 21, other).ok());
  t_[1]->Cancel(*id);
  EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(Push({{1, 1}, {5, 9}}, 20, p).ok());
  EXPECT_TRUE(p.Wait().ok());  // the sender cannot know; the decode worker commits nothing
  EXPECT_EQ(Block(1, 1), std::vector<uint8_t>(kBlockBytes, 0));
  EXPECT_EQ(Block(1, 9), std::vector<uint8_t>(kBlockBytes, 0));
  Waiter p2;
  ASSERT_TRUE(Push({{2, 2}}, 21, p2).ok());
  EXPECT_TRUE(p2.Wait().ok());
  EXPECT_TRUE(other.Wait().ok());
  EXPECT_EQ(Block(1, 2), Block(0, 2));
}

// A header no receive claims (it lands while another receive is open):
// the pair's later pushes cannot pass it, so past the grace the
// communicator is aborted. (With no receive open no header receive is
// posted at all: such a push ends at its own deadline.)
TEST_F(NcclTransportTest, APushNoReceiveClaimsAbortsThePairAfterTheGrace) {
  PairUp();
  Waiter open, p;
  ASSERT_TRUE(Receive({{1, 1}}, 76, open, /*ms=*/10000).ok());  // a header receive is up while one is open
  const auto start = Clock::now();
  ASSERT_TRUE(Push({{1, 1}}, 77, p, CompletedFence(), /*ms=*/10000).ok());
  const absl::Status st = p.Wait(milliseconds(8000));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;  // the receiver aborted the communicator
  const absl::Status other = open.Wait();
  EXPECT_EQ(other.code(), absl::StatusCode::kUnavailable) << other;
  EXPECT_NE(other.message().find("no receive here claimed"), std::string::npos) << other;
  EXPECT_GE(Clock::now() - start, milliseconds(1900));
  // Afterwards: transfers are refused as Unavailable (the caller pairs
  // afresh), and the responder will not join the old offer again.
  Waiter refused, stale;
  EXPECT_EQ(Push({{2, 2}}, 78, refused).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Receive({{2, 2}}, 78, refused).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(t_[1]->Pair(Info(0), PairRole::kResponder, offer_, In(1000), stale.Callback()).status().code(),
            absl::StatusCode::kUnavailable);
  PairUp();
  ExpectMoved({{3, 3}}, 79);
}

// Two workers whose staging settings differ (a rolling upgrade, say): the
// header says how the push is staged, and the receiver refuses it before a
// byte lands.
TEST_F(NcclTransportTest, StagingSettingsThatDifferAbortBeforeAnyByteLands) {
  t_[1] = MakeTransport(/*stage_runs_below=*/0);  // the receiver stages nothing
  ASSERT_TRUE(t_[1]->RegisterPool(Layout(), pool_[1].data()).ok());
  PairUp();
  ExpectRefusedBeforeAnyByte({{1, 1}, {3, 3}}, {{1, 1}, {3, 3}}, 6, "staging settings differ");
}

// Block lists that differ between the sides (a bug on one of them) are
// caught by the header before a byte is received.
TEST_F(NcclTransportTest, BlockListsThatDifferAbortBeforeAnyByteLands) {
  PairUp();
  ExpectRefusedBeforeAnyByte({{1, 1}, {2, 2}}, {{1, 1}, {2, 2}, {3, 3}}, 5, "block lists differ");
  // As many runs and bytes, runs of other sizes (two blocks then one,
  // against one then two): the run sizes' hash differs.
  PairUp();
  ExpectRefusedBeforeAnyByte({{1, 1}, {2, 2}, {5, 5}}, {{1, 1}, {3, 3}, {4, 4}}, 6, "block lists differ");
}

// Runs longer than 64 MiB go as pieces of at most 64 MiB (the cut both
// sides make; drains land in a 64 MiB scratch buffer): 144 MiB in one run,
// pushed, then the same pushed for a cancelled receive and drained.
TEST(NcclTransportPiecesTest, LongRunsGoInPiecesAndDrainIntoScratch) {
  constexpr int64_t kBig = int64_t{24} << 20;
  constexpr int kN = 8;
  auto fabric = NewFakeNcclFabric();
  std::unique_ptr<NcclTransport> t[2];
  std::vector<uint8_t> pool[2];
  PoolLayout layout = Layout();
  layout.block_bytes = kBig;
  layout.num_blocks = kN;
  for (int i = 0; i < 2; ++i) {
    pool[i].assign(kN * kBig, 0);
    if (i == 0) std::iota(pool[i].begin(), pool[i].end(), static_cast<uint8_t>(3));
    absl::StatusOr<std::unique_ptr<NcclTransport>> made =
        NcclTransport::Create({.device = 0, .api = std::shared_ptr<NcclApi>(NewFakeNccl(fabric)), .host_pools = true});
    ASSERT_TRUE(made.ok()) << made.status();
    t[i] = *std::move(made);
    ASSERT_TRUE(t[i]->RegisterPool(layout, pool[i].data()).ok());
  }
  const PeerInfo a = *t[0]->LocalInfo(), b = *t[1]->LocalInfo();
  Waiter pa, pb;
  absl::StatusOr<std::string> offer =
      t[0]->Pair(b, PairRole::kInitiator, "", Clock::now() + milliseconds(5000), pa.Callback());
  ASSERT_TRUE(offer.ok());
  ASSERT_TRUE(t[1]->Pair(a, PairRole::kResponder, *offer, Clock::now() + milliseconds(5000), pb.Callback()).ok());
  ASSERT_TRUE(pa.Wait().ok() && pb.Wait().ok());
  const std::vector<BlockPair> run = {{0, 2}, {1, 3}, {2, 4}, {3, 5}, {4, 6}, {5, 7}};  // one 144 MiB run
  auto deadline = [] { return Clock::now() + milliseconds(20000); };
  Waiter r, p;
  ASSERT_TRUE(t[1]->Receive(a.agent_id, run, 1, deadline(), r.Callback()).ok());
  ASSERT_TRUE(t[0]->PushAfter(b.agent_id, run, CompletedFence(), 1, deadline(), p.Callback()).ok());
  ASSERT_TRUE(p.Wait(milliseconds(20000)).ok());
  ASSERT_TRUE(r.Wait(milliseconds(20000)).ok());
  EXPECT_TRUE(std::equal(pool[0].begin(), pool[0].begin() + 6 * kBig, pool[1].begin() + 2 * kBig));
  EXPECT_TRUE(std::all_of(pool[1].begin(), pool[1].begin() + 2 * kBig, [](uint8_t x) { return x == 0; }));
  // The same push for a receive cancelled first: drained, the pool untouched.
  std::fill(pool[1].begin(), pool[1].end(), 0);
  Waiter gone, p2;
  absl::StatusOr<uint64_t> id = t[1]->Receive(a.agent_id, run, 2, deadline(), gone.Callback());
  ASSERT_TRUE(id.ok());
  t[1]->Cancel(*id);
  EXPECT_EQ(gone.Wait().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(t[0]->PushAfter(b.agent_id, run, CompletedFence(), 2, deadline(), p2.Callback()).ok());
  EXPECT_TRUE(p2.Wait(milliseconds(20000)).ok());
  EXPECT_TRUE(std::all_of(pool[1].begin(), pool[1].end(), [](uint8_t x) { return x == 0; }));
}

TEST_F(NcclTransportTest, RemovingThePeerFailsItsOpenTransfers) {
  PairUp();
  Waiter r;
  ASSERT_TRUE(Receive({{1, 1}}, 1, r).ok());
  t_[1]->RemovePeer(Info(0).agent_id);
  EXPECT_EQ(r.Wait().code(), absl::StatusCode::kUnavailable);
  Waiter again;
  EXPECT_EQ(Receive({{1, 1}}, 2, again).status().code(), absl::StatusCode::kNotFound);
}

// A peer process of this host that exits ends its communicators at once
// (NCCL itself may never say): here a pairing with a process killed while
// it waited.
TEST_F(NcclTransportTest, APeerProcessThatExitsEndsItsCommunicators) {
  if (PidNamespace().empty() || OwnStartTime() == 0 || HostBootId().empty()) GTEST_SKIP() << "/proc does not say";
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_GT(child, 0);
  struct Reaper {  // (an early return must not leave the child paused forever)
    pid_t pid;
    ~Reaper() {
      if (pid <= 0) return;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reaper{child};
  std::optional<uint64_t> start = ProcessStartTime(child);
  ASSERT_TRUE(start.has_value() && *start != 0);
  PeerInfo peer = Info(0);
  peer.agent_id = "nccl-peer-that-exits";
  peer.address = absl::StrCat("boot=", HostBootId(), ";bus=;pid=", child, ";pidns=", PidNamespace(), ";start=", *start,
                              ";wire=", NcclTransport::kWireVersion);
  std::shared_ptr<NcclApi> ids(NewFakeNccl(fabric_));
  Waiter w;
  ASSERT_TRUE(t_[1]->Pair(peer, PairRole::kResponder, *ids->UniqueId(), In(20000), w.Callback()).ok());
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_FALSE(w.Called());  // alive: still pairing
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  reaper.pid = 0;
  const absl::Status st = w.Wait(milliseconds(3000));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("exited"), std::string::npos) << st;
}

TEST_F(NcclTransportTest, APairingThePeerNeverJoinsEndsAtItsDeadline) {
  Waiter a;
  ASSERT_TRUE(t_[0]->Pair(Info(1), PairRole::kInitiator, "", In(80), a.Callback()).ok());
  const absl::Status st = a.Wait();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
}

TEST_F(NcclTransportTest, DestroyingTheTransportEndsItsTransfers) {
  PairUp();
  Waiter r;
  ASSERT_TRUE(Receive({{1, 1}}, 1, r).ok());
  t_[1].reset();
  EXPECT_EQ(r.Wait().code(), absl::StatusCode::kCancelled);
}

TEST_F(NcclTransportTest, Refusals) {
  Waiter w;
  // Before any pairing.
  EXPECT_EQ(Push({{1, 1}}, 1, w).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t_[0]->Push(Info(1).agent_id, {{1, 1}}, In(100), w.Callback()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t_[0]->Pull(Info(1).agent_id, {{1, 1}}, In(100), w.Callback()).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(t_[0]->Pair(Info(1), PairRole::kInitiator, "offer", In(100), w.Callback()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_[1]->Pair(Info(0), PairRole::kResponder, "short", In(100), w.Callback()).status().code(),
            absl::StatusCode::kInvalidArgument);
  PeerInfo other = Info(1);
  other.backend = "ucx";
  EXPECT_EQ(t_[0]->AddPeer(other).code(), absl::StatusCode::kInvalidArgument);
  other = Info(1);
  other.layout.block_bytes = 512;
  EXPECT_FALSE(t_[0]->AddPeer(other).ok());
  // A build of another header version (or of none: before versions).
  for (const std::string wire : {";wire=1", ""}) {
    other = Info(1);
    const size_t at = other.address.find(";wire=");
    ASSERT_NE(at, std::string::npos) << other.address;
    other.address = other.address.substr(0, at) + wire;
    const absl::Status refused = t_[0]->AddPeer(other);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("version"), std::string::npos) << refused;
  }
  PoolLayout gpu = Layout();
  gpu.memory_type = MemoryType::kCuda;
  std::vector<uint8_t> spare(16);
  EXPECT_EQ(MakeTransport()->RegisterPool(gpu, spare.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_[0]->RegisterPool(Layout(), pool_[0].data()).code(), absl::StatusCode::kFailedPrecondition);
  // Paired: the wrong side, bad blocks, a tag twice.
  PairUp();
  EXPECT_EQ(t_[1]->PushAfter(Info(0).agent_id, {{1, 1}}, CompletedFence(), 1, In(100), w.Callback()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Push({{kBlocks, 1}}, 1, w).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Push({{1, 1}}, 1, w, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  Waiter first, second;
  ASSERT_TRUE(Receive({{1, 1}}, 4, first, /*ms=*/50).ok());
  EXPECT_EQ(Receive({{2, 2}}, 4, second).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(first.Wait().code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace tandem::kvtransfer
