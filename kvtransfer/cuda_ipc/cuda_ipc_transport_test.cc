// cuda_ipc: the address codec (no GPU needed), and on a GPU two transports of
// one process moving scattered blocks both ways against a host reference,
// ordering a push after a GPU fence, and refusing what they must (another
// host, unknown peers, bad block ids, a passed deadline). Not covered yet:
// a peer in another process (cudaIpcOpenMemHandle, the offset, closing the
// mapping): a child-process case is next, then the disaggregation tests.
#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <thread>
#include <vector>

namespace tandem::kvtransfer {
namespace {

TEST(CudaIpcAddressTest, RoundTripsAndRefusesMalformedAddresses) {
  CudaIpcAddress a;
  a.handle = std::string(64, '\x07');
  a.handle[3] = '\xff';
  a.offset = 4096;
  a.pointer = 0x7f0012345600ull;
  a.pci_bus_id = "00000000:1B:00.0";
  a.boot_id = "4f1c8a5e-7d1e-4b3a-9c1b-0a1b2c3d4e5f";
  a.process = "0123456789abcdef01234567";
  a.pid = 4242;
  absl::StatusOr<CudaIpcAddress> b = DecodeCudaIpcAddress(EncodeCudaIpcAddress(a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->handle, a.handle);
  EXPECT_EQ(b->offset, a.offset);
  EXPECT_EQ(b->pointer, a.pointer);
  EXPECT_EQ(b->pci_bus_id, a.pci_bus_id);
  EXPECT_EQ(b->boot_id, a.boot_id);
  EXPECT_EQ(b->process, a.process);
  EXPECT_EQ(b->pid, a.pid);
  const std::string good = EncodeCudaIpcAddress(a);
  for (const std::string& bad :
       {std::string(""), std::string("ucx/1;handle=00"), good.substr(0, 30),
        std::string("cuda_ipc/1;handle=zz;pointer=1;pid=1;bus=x"), std::string("cuda_ipc/1;pointer=1;pid=1;bus=x"),
        good + ";offset=-4",
        std::string("cuda_ipc/1;handle=") + std::string(128, '0') + ";pointer=1;pid=1;bus=x;process=p"}) {  // no offset
    EXPECT_EQ(DecodeCudaIpcAddress(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(HostBootId().empty());
}

PoolLayout Layout(int64_t blocks) {
  return PoolLayout{.model = "m",
                    .dtype = "bfloat16",
                    .num_layers = 2,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .block_size = 16,
                    .num_blocks = blocks,
                    .block_bytes = 2 * 2 * 2 * 64 * 16 * 2,
                    .memory_type = MemoryType::kCuda,
                    .device_id = 0};
}

class CudaIpcTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<std::unique_ptr<CudaIpcTransport>> t = CudaIpcTransport::Create(0);
      ASSERT_TRUE(t.ok()) << t.status();
      t_[k] = *std::move(t);
      const PoolLayout layout = Layout(k == 0 ? 12 : 9);
      bytes_[k] = layout.num_blocks * layout.block_bytes;
      ASSERT_EQ(cudaMalloc(&pool_[k], static_cast<size_t>(bytes_[k])), cudaSuccess);
      host_[k].resize(static_cast<size_t>(bytes_[k]));
      for (unsigned char& b : host_[k]) b = static_cast<unsigned char>(rng_());
      ASSERT_EQ(cudaMemcpy(pool_[k], host_[k].data(), host_[k].size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(t_[k]->RegisterPool(layout, pool_[k]).ok());
    }
    // The uploads went through the legacy stream, which the transport's
    // non-blocking stream does not wait for.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<PeerInfo> other = t_[1 - k]->LocalInfo();
      ASSERT_TRUE(other.ok()) << other.status();
      info_[1 - k] = *other;
      ASSERT_TRUE(t_[k]->AddPeer(*other).ok());
    }
  }
  void TearDown() override {
    for (auto& t : t_) t.reset();
    for (void* p : pool_) cudaFree(p);
  }

  // Runs a transfer to its end; its status.
  static absl::Status Wait(const std::function<absl::StatusOr<uint64_t>(TransferDone)>& start) {
    std::promise<absl::Status> p;
    absl::StatusOr<uint64_t> id = start([&p](absl::Status s) { p.set_value(s); });
    if (!id.ok()) return id.status();
    return p.get_future().get();
  }
  std::vector<unsigned char> Read(int k) {
    std::vector<unsigned char> out(static_cast<size_t>(bytes_[k]));
    EXPECT_EQ(cudaMemcpy(out.data(), pool_[k], out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  std::mt19937 rng_{3};
  std::unique_ptr<CudaIpcTransport> t_[2];
  void* pool_[2] = {nullptr, nullptr};
  int64_t bytes_[2] = {0, 0};
  std::vector<unsigned char> host_[2];
  PeerInfo info_[2];
};

TEST_F(CudaIpcTransportTest, PushAndPullMoveScatteredBlocks) {
  const int64_t bb = Layout(1).block_bytes;
  const Deadline later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // Push 0's blocks {3, 4, 5, 11} into 1's {0, 1, 2, 8} (one merged run and one single).
  const std::vector<BlockPair> push = {{3, 0}, {4, 1}, {5, 2}, {11, 8}};
  ASSERT_TRUE(Wait([&](TransferDone d) { return t_[0]->Push(info_[1].agent_id, push, later, std::move(d)); }).ok());
  for (const BlockPair& p : push) {
    std::copy_n(host_[0].begin() + p.src * bb, bb, host_[1].begin() + p.dst * bb);
  }
  EXPECT_EQ(Read(1), host_[1]);
  // Pull 1's {8, 2} into 0's {0, 7}.
  const std::vector<BlockPair> pull = {{8, 0}, {2, 7}};
  ASSERT_TRUE(Wait([&](TransferDone d) { return t_[0]->Pull(info_[1].agent_id, pull, later, std::move(d)); }).ok());
  for (const BlockPair& p : pull) {
    std::copy_n(host_[1].begin() + p.src * bb, bb, host_[0].begin() + p.dst * bb);
  }
  EXPECT_EQ(Read(0), host_[0]);
}

// A fence of GPU writes on another stream: the push's copies wait on it.
TEST_F(CudaIpcTransportTest, PushAfterAGpuFenceCopiesTheWrittenBytes) {
  struct EventFence final : WriteFence {
    cudaEvent_t event = nullptr;
    MemoryType memory() const override { return MemoryType::kCuda; }
    absl::Status Wait(Deadline) const override {
      return cudaEventSynchronize(event) == cudaSuccess ? absl::OkStatus() : absl::InternalError("event");
    }
    void* cuda_event() const override { return event; }
  };
  auto fence = std::make_shared<EventFence>();
  cudaStream_t writer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&fence->event, cudaEventDisableTiming), cudaSuccess);
  const int64_t bb = Layout(1).block_bytes;
  // The "prefill": block 6 of pool 0 becomes 0x5a bytes, held back on its
  // stream until PushAfter has returned (so the copy must wait for it).
  static std::atomic<bool> release{false};
  release = false;
  ASSERT_EQ(cudaLaunchHostFunc(
                writer,
                [](void*) {
                  while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                },
                nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(static_cast<unsigned char*>(pool_[0]) + 6 * bb, 0x5a, static_cast<size_t>(bb), writer),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(fence->event, writer), cudaSuccess);
  const Deadline later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::promise<absl::Status> pushed;
  ASSERT_TRUE(
      t_[0]
          ->PushAfter(info_[1].agent_id, {{6, 4}}, fence, 1, later, [&pushed](absl::Status s) { pushed.set_value(s); })
          .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the copy thread sees the fence pending
  release = true;
  ASSERT_TRUE(pushed.get_future().get().ok());
  std::vector<unsigned char> got = Read(1);
  EXPECT_EQ(std::vector<unsigned char>(got.begin() + 4 * bb, got.begin() + 5 * bb),
            std::vector<unsigned char>(static_cast<size_t>(bb), 0x5a));
  cudaEventDestroy(fence->event);
  cudaStreamDestroy(writer);
}

TEST_F(CudaIpcTransportTest, RefusesWhatItMust) {
  const Deadline later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // Another host's pool.
  PeerInfo far = info_[1];
  absl::StatusOr<CudaIpcAddress> a = DecodeCudaIpcAddress(far.address);
  ASSERT_TRUE(a.ok());
  a->boot_id = "another-host";
  far.address = EncodeCudaIpcAddress(*a);
  far.agent_id = "far";
  EXPECT_EQ(t_[0]->AddPeer(far).code(), absl::StatusCode::kFailedPrecondition);
  // Another layout.
  PeerInfo other = info_[1];
  other.layout.head_dim = 128;
  EXPECT_EQ(t_[0]->AddPeer(other).code(), absl::StatusCode::kFailedPrecondition);
  // Unknown peer, block ids outside either pool.
  EXPECT_EQ(t_[0]->Push("nobody", {{0, 0}}, later, [](absl::Status) {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t_[0]->Push(info_[1].agent_id, {{0, 9}}, later, [](absl::Status) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A passed deadline: nothing moves.
  const Deadline past = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  EXPECT_EQ(Wait([&](TransferDone d) {
              return t_[0]->Push(info_[1].agent_id, {{1, 1}}, past, std::move(d));
            }).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Read(1), host_[1]);
  // A removed peer: unknown from then on.
  t_[0]->RemovePeer(info_[1].agent_id);
  EXPECT_EQ(t_[0]->Push(info_[1].agent_id, {{0, 0}}, later, [](absl::Status) {}).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tandem::kvtransfer
