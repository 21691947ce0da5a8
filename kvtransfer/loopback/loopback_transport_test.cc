#include "kvtransfer/loopback/loopback_transport.h"

#include <future>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "kvtransfer/loopback/fault_injecting_transport.h"

namespace tandem::kvtransfer {
namespace {

using std::chrono::milliseconds;
constexpr int64_t kBlockBytes = 256;

PoolLayout Layout(int64_t num_blocks) {
  return PoolLayout{.model = "tiny",
                    .dtype = "float32",
                    .num_layers = 1,
                    .num_kv_heads = 1,
                    .head_dim = 4,
                    .block_size = 16,
                    .num_blocks = num_blocks,
                    .block_bytes = kBlockBytes};
}

// A pool whose block b holds bytes derived from (seed, b).
struct Pool {
  Pool(int64_t blocks, uint32_t seed) : bytes(blocks * kBlockBytes) {
    for (int64_t b = 0; b < blocks; ++b) Fill(b, seed);
  }
  void Fill(int64_t block, uint32_t seed) {
    std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(block));
    for (int64_t i = 0; i < kBlockBytes; ++i) bytes[block * kBlockBytes + i] = rng() & 0xff;
  }
  bool BlockEquals(int64_t block, const Pool& other, int64_t other_block) const {
    return std::equal(bytes.begin() + block * kBlockBytes, bytes.begin() + (block + 1) * kBlockBytes,
                      other.bytes.begin() + other_block * kBlockBytes);
  }
  std::vector<uint8_t> bytes;
};

// Two transports on one fabric, each with its pool, connected both ways.
struct Pair {
  explicit Pair(bool faulty_a = false) : fabric(std::make_shared<LoopbackFabric>()), pool_a(64, 1), pool_b(32, 2) {
    auto inner = std::make_unique<LoopbackTransport>(fabric);
    if (faulty_a) {
      auto f = std::make_unique<FaultInjectingTransport>(std::move(inner));
      faults = f.get();
      a = std::move(f);
    } else {
      a = std::move(inner);
    }
    b = std::make_unique<LoopbackTransport>(fabric);
    EXPECT_TRUE(a->RegisterPool(Layout(64), pool_a.bytes.data()).ok());
    EXPECT_TRUE(b->RegisterPool(Layout(32), pool_b.bytes.data()).ok());
    EXPECT_TRUE(a->AddPeer(*b->LocalInfo()).ok());
    EXPECT_TRUE(b->AddPeer(*a->LocalInfo()).ok());
  }
  std::string b_id() const { return b->LocalInfo()->agent_id; }
  std::shared_ptr<LoopbackFabric> fabric;
  Pool pool_a, pool_b;
  std::unique_ptr<Transport> a, b;
  FaultInjectingTransport* faults = nullptr;
};

// Runs one transfer and waits for its completion (bounded).
absl::Status RunPush(Transport& t, const std::string& peer, std::vector<BlockPair> blocks,
                     milliseconds deadline = milliseconds(5000)) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  auto future = promise->get_future();
  absl::StatusOr<uint64_t> id = t.Push(peer, std::move(blocks), std::chrono::steady_clock::now() + deadline,
                                       [promise](absl::Status st) { promise->set_value(st); });
  if (!id.ok()) return id.status();
  if (future.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    return absl::InternalError("transfer never completed");
  }
  return future.get();
}

TEST(LoopbackTransportTest, PushAndPullCopyExactlyTheListedBlocks) {
  Pair p;
  std::vector<BlockPair> pairs = {{3, 0}, {4, 1}, {5, 2}, {40, 9}, {7, 31}};
  const Pool before_b = p.pool_b;
  ASSERT_TRUE(RunPush(*p.a, p.b_id(), pairs).ok());
  for (const BlockPair& bp : pairs) EXPECT_TRUE(p.pool_b.BlockEquals(bp.dst, p.pool_a, bp.src));
  for (int b : {3, 4, 5, 8, 30}) EXPECT_TRUE(p.pool_b.BlockEquals(b, before_b, b)) << b;

  auto promise = std::make_shared<std::promise<absl::Status>>();
  ASSERT_TRUE(p.a->Pull(p.b_id(), {{20, 60}, {21, 61}}, std::chrono::steady_clock::now() + milliseconds(5000),
                        [promise](absl::Status st) { promise->set_value(st); })
                  .ok());
  EXPECT_TRUE(promise->get_future().get().ok());
  EXPECT_TRUE(p.pool_a.BlockEquals(60, p.pool_b, 20));
  EXPECT_TRUE(p.pool_a.BlockEquals(61, p.pool_b, 21));
}

TEST(LoopbackTransportTest, ErrorsBeforeStartAreReturnedNotCalledBack) {
  Pair p;
  bool called = false;
  auto done = [&](absl::Status) { called = true; };
  auto far = std::chrono::steady_clock::now() + milliseconds(1000);
  EXPECT_EQ(p.a->Push("nobody", {{0, 0}}, far, done).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p.a->Push(p.b_id(), {{0, 32}}, far, done).status().code(),
            absl::StatusCode::kInvalidArgument);  // b has 32 blocks
  EXPECT_FALSE(called);
  LoopbackTransport unregistered(p.fabric);
  EXPECT_EQ(unregistered.LocalInfo().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LoopbackTransportTest, IncompatiblePeerIsRefused) {
  auto fabric = std::make_shared<LoopbackFabric>();
  Pool pa(4, 1), pb(4, 2);
  LoopbackTransport a(fabric), b(fabric);
  PoolLayout other = Layout(4);
  other.head_dim = 8;
  ASSERT_TRUE(a.RegisterPool(Layout(4), pa.bytes.data()).ok());
  ASSERT_TRUE(b.RegisterPool(other, pb.bytes.data()).ok());
  absl::Status st = a.AddPeer(*b.LocalInfo());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(st.message()).find("head_dim"), std::string::npos) << st;
}

TEST(LoopbackTransportTest, RemovedPeerFailsWithUnavailable) {
  Pair p;
  p.a->RemovePeer(p.b_id());
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{0, 0}}).code(), absl::StatusCode::kNotFound);
}

TEST(LoopbackTransportTest, PassedDeadlineFails) {
  Pair p;
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{0, 0}}, milliseconds(-1)).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(FaultInjectingTransportTest, DropEndsAtTheDeadlineAndCancelEndsItSooner) {
  Pair p(/*faulty_a=*/true);
  p.faults->SetFaults({.drop = true});
  const Pool before_b = p.pool_b;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{1, 1}}, milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(50));
  EXPECT_TRUE(p.pool_b.BlockEquals(1, before_b, 1));  // nothing arrived
  EXPECT_EQ(p.faults->held_transfers(), 0);

  auto promise = std::make_shared<std::promise<absl::Status>>();
  absl::StatusOr<uint64_t> id = p.a->Push(p.b_id(), {{1, 1}}, std::chrono::steady_clock::now() + std::chrono::hours(1),
                                          [promise](absl::Status st) { promise->set_value(st); });
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(p.faults->held_transfers(), 1);
  p.a->Cancel(*id);
  EXPECT_EQ(promise->get_future().get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(p.faults->held_transfers(), 0);
}

TEST(FaultInjectingTransportTest, DelayedTransferStillArrives) {
  Pair p(true);
  p.faults->SetFaults({.delay = milliseconds(30)});
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(RunPush(*p.a, p.b_id(), {{2, 3}}).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(30));
  EXPECT_TRUE(p.pool_b.BlockEquals(3, p.pool_a, 2));
  // A delay longer than the deadline ends with DeadlineExceeded.
  p.faults->SetFaults({.delay = milliseconds(200)});
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{2, 4}}, milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(FaultInjectingTransportTest, CorruptDeliversWrongBytesWithOk) {
  Pair p(true);
  p.faults->SetFaults({.corrupt = true});
  ASSERT_TRUE(RunPush(*p.a, p.b_id(), {{10, 5}, {11, 6}}).ok());
  EXPECT_FALSE(p.pool_b.BlockEquals(5, p.pool_a, 10));
  EXPECT_TRUE(p.pool_b.BlockEquals(6, p.pool_a, 11));
}

TEST(FaultInjectingTransportTest, FailAfterBlocksCopiesOnlyThePrefix) {
  Pair p(true);
  p.faults->SetFaults({.fail_after_blocks = 2});
  const Pool before_b = p.pool_b;
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{1, 1}, {2, 2}, {3, 3}, {4, 4}}).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(p.pool_b.BlockEquals(1, p.pool_a, 1));
  EXPECT_TRUE(p.pool_b.BlockEquals(2, p.pool_a, 2));
  EXPECT_TRUE(p.pool_b.BlockEquals(3, before_b, 3));
  EXPECT_TRUE(p.pool_b.BlockEquals(4, before_b, 4));
}

TEST(FaultInjectingTransportTest, FailSubmitRefusesAtOnce) {
  Pair p(true);
  p.faults->SetFaults({.fail_submit = true});
  EXPECT_EQ(RunPush(*p.a, p.b_id(), {{1, 1}}).code(), absl::StatusCode::kUnavailable);
  p.faults->SetFaults({});
  EXPECT_TRUE(RunPush(*p.a, p.b_id(), {{1, 1}}).ok());
}

TEST(FaultInjectingTransportTest, ManyConcurrentTransfersAllComplete) {
  Pair p(true);
  p.faults->SetFaults({.delay = milliseconds(2)});
  std::vector<std::future<absl::Status>> results;
  for (int i = 0; i < 32; ++i) {
    results.push_back(std::async(std::launch::async, [&p, i] { return RunPush(*p.a, p.b_id(), {{i, i}}); }));
  }
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  for (int i = 0; i < 32; ++i) EXPECT_TRUE(p.pool_b.BlockEquals(i, p.pool_a, i));
}

}  // namespace
}  // namespace tandem::kvtransfer
