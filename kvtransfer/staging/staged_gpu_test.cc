// ucx_staged between GPU pools (the CUDA staging copier): two transports of
// one process over shared memory and over tcp, scattered blocks in several
// chunks against a host model, and a push ordered after a GPU fence whose
// writes are held back until the test lets them run. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// 1 MiB blocks: four a 4 MiB staging slot, so 13 blocks are four chunks.
constexpr int64_t kBlockBytes = int64_t{1} << 20;

PoolLayout GpuLayout(int64_t blocks) {
  return PoolLayout{.model = "m",
                    .dtype = "bfloat16",
                    .num_layers = 4,
                    .num_kv_heads = 8,
                    .head_dim = 128,
                    .block_size = 64,
                    .num_blocks = blocks,
                    .block_bytes = kBlockBytes,
                    .memory_type = MemoryType::kCuda,
                    .device_id = 0};
}

// A GPU fence: the event recorded after the writes.
class EventFence final : public WriteFence {
 public:
  explicit EventFence(cudaEvent_t e) : event_(e) {}
  MemoryType memory() const override { return MemoryType::kCuda; }
  absl::Status Wait(Deadline) const override {
    return cudaEventSynchronize(event_) == cudaSuccess ? absl::OkStatus() : absl::InternalError("event");
  }
  void* cuda_event() const override { return event_; }

 private:
  cudaEvent_t event_;
};

class StagedGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    std::mt19937 rng(5);
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<std::unique_ptr<Transport>> t =
          TransportRegistry::Builtin().Create("ucx_staged", {.transports = GetParam()});
      ASSERT_TRUE(t.ok()) << t.status();
      t_[k] = *std::move(t);
      const PoolLayout layout = GpuLayout(k == 0 ? 24 : 20);
      host_[k].resize(static_cast<size_t>(layout.num_blocks * kBlockBytes));
      for (unsigned char& b : host_[k]) b = static_cast<unsigned char>(rng());
      ASSERT_EQ(cudaMalloc(&pool_[k], host_[k].size()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(pool_[k], host_[k].data(), host_[k].size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(t_[k]->RegisterPool(layout, pool_[k]).ok());
    }
    const Deadline later = steady_clock::now() + std::chrono::seconds(5);
    ASSERT_TRUE(t_[0]->Pair(*t_[1]->LocalInfo(), PairRole::kInitiator, "", later, [](absl::Status) {}).ok());
    ASSERT_TRUE(t_[1]->Pair(*t_[0]->LocalInfo(), PairRole::kResponder, "", later, [](absl::Status) {}).ok());
  }
  void TearDown() override {
    for (auto& t : t_) t.reset();
    for (void* p : pool_) cudaFree(p);
  }
  std::vector<unsigned char> Read(int k) {
    std::vector<unsigned char> out(host_[k].size());
    EXPECT_EQ(cudaMemcpy(out.data(), pool_[k], out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  // Receive on 1, push from 0 after `fence`; both outcomes.
  struct Outcomes {
    std::future<absl::Status> sent, received;
  };
  Outcomes Start(const std::vector<BlockPair>& pairs, uint64_t tag, std::shared_ptr<const WriteFence> fence) {
    auto s = std::make_shared<std::promise<absl::Status>>();
    auto r = std::make_shared<std::promise<absl::Status>>();
    Outcomes o{s->get_future(), r->get_future()};
    const Deadline later = steady_clock::now() + std::chrono::seconds(10);
    absl::StatusOr<uint64_t> rid =
        t_[1]->Receive(t_[0]->LocalInfo()->agent_id, pairs, tag, later, [r](absl::Status st) { r->set_value(st); });
    EXPECT_TRUE(rid.ok()) << rid.status();
    absl::StatusOr<uint64_t> sid = t_[0]->PushAfter(t_[1]->LocalInfo()->agent_id, pairs, std::move(fence), tag, later,
                                                    [s](absl::Status st) { s->set_value(st); });
    EXPECT_TRUE(sid.ok()) << sid.status();
    return o;
  }
  void Apply(const std::vector<BlockPair>& pairs) {
    for (const BlockPair& p : pairs) {
      std::copy_n(host_[0].begin() + p.src * kBlockBytes, kBlockBytes, host_[1].begin() + p.dst * kBlockBytes);
    }
  }

  std::unique_ptr<Transport> t_[2];
  void* pool_[2] = {nullptr, nullptr};
  std::vector<unsigned char> host_[2];
};

TEST_P(StagedGpuTest, ScatteredBlocksInSeveralChunksLandOnTheGpu) {
  const std::vector<BlockPair> pairs = {{0, 19}, {1, 3},  {2, 4},   {3, 5},  {7, 0},  {8, 1},  {9, 2},
                                        {23, 7}, {22, 8}, {21, 12}, {5, 13}, {6, 14}, {10, 15}};
  Outcomes o = Start(pairs, 1, CompletedFence());
  EXPECT_TRUE(o.sent.get().ok());
  EXPECT_TRUE(o.received.get().ok());
  Apply(pairs);
  EXPECT_EQ(Read(1), host_[1]);
  EXPECT_EQ(Read(0), host_[0]);  // the source untouched
}

// The push waits for the GPU writes behind its fence: a stream held by a
// host callback, then a memset of source block 4, then the event.
TEST_P(StagedGpuTest, APushWaitsForItsGpuFence) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto gate = std::make_shared<std::promise<void>>();
  std::shared_future<void> open = gate->get_future().share();
  auto* held = new std::shared_future<void>(open);
  ASSERT_EQ(cudaLaunchHostFunc(
                stream,
                [](void* p) {
                  auto* f = static_cast<std::shared_future<void>*>(p);
                  f->wait();
                  delete f;
                },
                held),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(static_cast<unsigned char*>(pool_[0]) + 4 * kBlockBytes, 0x5a, kBlockBytes, stream),
            cudaSuccess);
  cudaEvent_t written;
  ASSERT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(written, stream), cudaSuccess);
  const std::vector<BlockPair> pairs = {{4, 6}, {11, 9}};
  Outcomes o = Start(pairs, 2, std::make_shared<EventFence>(written));
  EXPECT_EQ(o.received.wait_for(milliseconds(200)), std::future_status::timeout) << "pushed before its writes";
  gate->set_value();
  EXPECT_TRUE(o.sent.get().ok());
  EXPECT_TRUE(o.received.get().ok());
  std::fill_n(host_[0].begin() + 4 * kBlockBytes, kBlockBytes, 0x5a);
  Apply(pairs);
  EXPECT_EQ(Read(1), host_[1]);
  cudaStreamSynchronize(stream);
  cudaEventDestroy(written);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Tls, StagedGpuTest, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace tandem::kvtransfer
