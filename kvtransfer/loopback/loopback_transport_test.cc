#include "kvtransfer/loopback/loopback_transport.h"

#include <atomic>
#include <future>
#include <numeric>
#include <random>
#include <thread>

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

// ---- The two-sided contract's defaults (one-sided backends) ----------------

// A host fence that completes when the test says so, counting the waits.
class TestFence final : public WriteFence {
 public:
  explicit TestFence(MemoryType memory = MemoryType::kHost) : memory_(memory) {}
  MemoryType memory() const override { return memory_; }
  absl::Status Wait(Deadline deadline) const override {
    ++waits_;
    while (!done_.load()) {
      if (std::chrono::steady_clock::now() >= deadline) return absl::DeadlineExceededError("fence: not yet");
      std::this_thread::sleep_for(milliseconds(1));
    }
    return absl::OkStatus();
  }
  void Complete() { done_ = true; }
  int waits() const { return waits_.load(); }

 private:
  MemoryType memory_;
  std::atomic<bool> done_{false};
  mutable std::atomic<int> waits_{0};
};

TEST(TransportContractTest, PairConnectsAOneSidedBackendAndCallsBackOnce) {
  auto fabric = std::make_shared<LoopbackFabric>();
  LoopbackTransport a(fabric), b(fabric);
  Pool pool_a(8, 1), pool_b(8, 2);
  ASSERT_TRUE(a.RegisterPool(Layout(8), pool_a.bytes.data()).ok());
  ASSERT_TRUE(b.RegisterPool(Layout(8), pool_b.bytes.data()).ok());
  int calls = 0;
  absl::Status got = absl::UnknownError("not called");
  absl::StatusOr<std::string> offer =
      a.Pair(*b.LocalInfo(), PairRole::kInitiator, "", std::chrono::steady_clock::now() + milliseconds(1000),
             [&](absl::Status st) {
               ++calls;
               got = st;
             });
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_EQ(*offer, "");
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(got.ok()) << got;
  // Paired means connected: a push to the peer works.
  EXPECT_TRUE(RunPush(a, b.LocalInfo()->agent_id, {{1, 2}}).ok());
  EXPECT_TRUE(pool_b.BlockEquals(2, pool_a, 1));
  // An incompatible peer, or a passed deadline: returned, no callback.
  LoopbackTransport c(fabric);
  Pool pool_c(8, 3);
  PoolLayout other = Layout(8);
  other.head_dim = 8;
  ASSERT_TRUE(c.RegisterPool(other, pool_c.bytes.data()).ok());
  EXPECT_EQ(a.Pair(*c.LocalInfo(), PairRole::kInitiator, "", std::chrono::steady_clock::now() + milliseconds(1000),
                   [&](absl::Status) { ++calls; })
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.Pair(*b.LocalInfo(), PairRole::kResponder, "", std::chrono::steady_clock::now() - milliseconds(1),
                   [&](absl::Status) { ++calls; })
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(calls, 1);
}

TEST(TransportContractTest, PushAfterStartsOnlyOnceTheWritesCompleted) {
  Pair p;
  auto fence = std::make_shared<TestFence>();
  // Not completed by the deadline: returned, nothing moved, no callback.
  bool called = false;
  absl::StatusOr<uint64_t> late =
      p.a->PushAfter(p.b_id(), {{3, 4}}, fence, /*tag=*/7, std::chrono::steady_clock::now() + milliseconds(30),
                     [&](absl::Status) { called = true; });
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(called);
  EXPECT_FALSE(p.pool_b.BlockEquals(4, p.pool_a, 3));
  // Completed while PushAfter waits: the push follows, and lands.
  std::thread writer([&] {
    std::this_thread::sleep_for(milliseconds(20));
    fence->Complete();
  });
  auto promise = std::make_shared<std::promise<absl::Status>>();
  absl::StatusOr<uint64_t> id =
      p.a->PushAfter(p.b_id(), {{3, 4}}, fence, /*tag=*/7, std::chrono::steady_clock::now() + milliseconds(5000),
                     [promise](absl::Status st) { promise->set_value(st); });
  writer.join();
  ASSERT_TRUE(id.ok()) << id.status();
  auto future = promise->get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(future.get().ok());
  EXPECT_TRUE(p.pool_b.BlockEquals(4, p.pool_a, 3));
  EXPECT_EQ(fence->waits(), 2);
  // The completed fence pushes at once.
  EXPECT_TRUE(CompletedFence()->Wait(std::chrono::steady_clock::now()).ok());
}

TEST(TransportContractTest, AGpuFenceOnAHostTransportAndReceiveOnAOneSidedOneAreRefused) {
  Pair p;
  auto gpu = std::make_shared<TestFence>(MemoryType::kCuda);
  gpu->Complete();
  absl::StatusOr<uint64_t> id = p.a->PushAfter(
      p.b_id(), {{1, 1}}, gpu, 1, std::chrono::steady_clock::now() + milliseconds(1000), [](absl::Status) {});
  EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpu->waits(), 0);
  EXPECT_EQ(p.a->PushAfter(p.b_id(), {{1, 1}}, nullptr, 1, std::chrono::steady_clock::now() + milliseconds(1000),
                           [](absl::Status) {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.b->Receive(p.a->LocalInfo()->agent_id, {{1, 1}}, 1, std::chrono::steady_clock::now() + milliseconds(1000),
                         [](absl::Status) {})
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
}

TEST(FaultInjectingTransportTest, FailPairRefusesPairingAndPushAfterMeetsEveryFault) {
  ASSERT_TRUE(ParseFaults("fail_pair")->fail_pair);
  Pair p(/*faulty_a=*/true);
  p.faults->SetFaults(*ParseFaults("fail_pair"));
  bool called = false;
  EXPECT_EQ(p.a->Pair(*p.b->LocalInfo(), PairRole::kInitiator, "",
                      std::chrono::steady_clock::now() + milliseconds(1000), [&](absl::Status) { called = true; })
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(called);
  // PushAfter goes through the wrapper's Push: fail_submit applies.
  p.faults->SetFaults(*ParseFaults("fail_submit"));
  EXPECT_EQ(p.a->PushAfter(p.b_id(), {{1, 1}}, CompletedFence(), 1,
                           std::chrono::steady_clock::now() + milliseconds(1000), [](absl::Status) {})
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
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
