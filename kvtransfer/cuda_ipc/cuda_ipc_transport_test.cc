// cuda_ipc: the address codec (no GPU needed), and on a GPU two transports of
// one process moving scattered blocks both ways against a host reference,
// ordering a push after a GPU fence, and refusing what they must (another
// host, unknown peers, bad block ids, a passed deadline); and a peer in
// another process (the test binary again, as CudaIpcChildTest): its pool
// opened through its IPC handle, pulled from, pushed into, and let go once
// the child exited.
#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
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
  a.pid_namespace = "pid:[4026531836]";
  a.start_time = 987654321;
  absl::StatusOr<CudaIpcAddress> b = DecodeCudaIpcAddress(EncodeCudaIpcAddress(a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->handle, a.handle);
  EXPECT_EQ(b->offset, a.offset);
  EXPECT_EQ(b->pointer, a.pointer);
  EXPECT_EQ(b->pci_bus_id, a.pci_bus_id);
  EXPECT_EQ(b->boot_id, a.boot_id);
  EXPECT_EQ(b->process, a.process);
  EXPECT_EQ(b->pid, a.pid);
  EXPECT_EQ(b->pid_namespace, a.pid_namespace);
  EXPECT_EQ(b->start_time, a.start_time);
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

PoolLayout Layout(int64_t blocks, int64_t block_bytes = 2 * 2 * 2 * 64 * 16 * 2) {
  return PoolLayout{.model = "m",
                    .dtype = "bfloat16",
                    .num_layers = 2,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .block_size = 16,
                    .num_blocks = blocks,
                    .block_bytes = block_bytes,
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
      const PoolLayout layout = Layout(k == 0 ? 12 : 9, BlockBytes());
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
  virtual int64_t BlockBytes() const { return Layout(1).block_bytes; }

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

  // Pushes and pulls scattered blocks both ways, against the host copies.
  void PushAndPullScattered() {
    const int64_t bb = BlockBytes();
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

  std::mt19937 rng_{3};
  std::unique_ptr<CudaIpcTransport> t_[2];
  void* pool_[2] = {nullptr, nullptr};
  int64_t bytes_[2] = {0, 0};
  std::vector<unsigned char> host_[2];
  PeerInfo info_[2];
};

TEST_F(CudaIpcTransportTest, PushAndPullMoveScatteredBlocks) { PushAndPullScattered(); }

// Other block sizes: runs cut into several of the copy kernel's chunks
// (300,000-byte blocks, a 900,000-byte run), blocks of a size that is no
// multiple of 16 (cudaMemcpyAsync a run instead of the kernel), and 48 MiB
// blocks (a 192 MiB push: 256 KiB chunks through the unrolled loop, more
// chunks than CTAs, so a CTA takes several descriptors in turn).
class CudaIpcBlockBytesTest : public CudaIpcTransportTest, public ::testing::WithParamInterface<int64_t> {
 protected:
  int64_t BlockBytes() const override { return GetParam(); }
};
TEST_P(CudaIpcBlockBytesTest, PushAndPullMoveScatteredBlocks) { PushAndPullScattered(); }
INSTANTIATE_TEST_SUITE_P(Sizes, CudaIpcBlockBytesTest,
                         ::testing::Values(int64_t{300000}, int64_t{16008}, int64_t{16}, int64_t{48} << 20));

// Many transfers at once (more than the copy thread keeps in flight): every
// one lands, and each reports its own outcome, a cancelled one among them.
TEST_F(CudaIpcTransportTest, ManyTransfersAtOnceAllLand) {
  const int64_t bb = Layout(1).block_bytes;
  const Deadline later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  constexpr int kTransfers = 9;  // pool 1's blocks 8..0 into pool 0's 0..8, one transfer each
  std::vector<std::promise<absl::Status>> done(kTransfers);
  std::vector<uint64_t> ids;
  for (int i = 0; i < kTransfers; ++i) {
    absl::StatusOr<uint64_t> id = t_[0]->Pull(info_[1].agent_id, {{kTransfers - 1 - i, i}}, later,
                                              [&done, i](absl::Status s) { done[i].set_value(s); });
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (int i = 0; i < kTransfers; ++i) {
    EXPECT_TRUE(done[i].get_future().get().ok()) << "transfer " << i;
    std::copy_n(host_[1].begin() + (kTransfers - 1 - i) * bb, bb, host_[0].begin() + i * bb);
  }
  EXPECT_EQ(Read(0), host_[0]);
  // A transfer cancelled before the copy thread took it ends Cancelled (the
  // first ones hold the copy thread behind a fence that is never released
  // before the cancel).
  struct HeldFence final : WriteFence {
    std::shared_future<void> open;
    MemoryType memory() const override { return MemoryType::kHost; }
    absl::Status Wait(Deadline) const override {
      open.wait();
      return absl::OkStatus();
    }
  };
  std::promise<void> release;
  auto fence = std::make_shared<HeldFence>();
  fence->open = release.get_future().share();
  std::promise<absl::Status> held, cancelled;
  ASSERT_TRUE(
      t_[0]
          ->PushAfter(info_[1].agent_id, {{0, 0}}, fence, 1, later, [&held](absl::Status s) { held.set_value(s); })
          .ok());
  absl::StatusOr<uint64_t> victim =
      t_[0]->Pull(info_[1].agent_id, {{1, 1}}, later, [&cancelled](absl::Status s) { cancelled.set_value(s); });
  ASSERT_TRUE(victim.ok());
  t_[0]->Cancel(*victim);
  release.set_value();
  EXPECT_TRUE(held.get_future().get().ok());
  EXPECT_EQ(cancelled.get_future().get().code(), absl::StatusCode::kCancelled);
  t_[0]->Cancel(*victim);    // ended: ignored
  t_[0]->Cancel(987654321);  // never was: ignored
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
  // Transfers start in the order they were asked for: a pull of the block
  // the push writes, asked for while the push waits on its fence, waits
  // behind it (it has nothing to wait for itself and a slot is free, so it
  // would otherwise be issued at once, from this thread).
  std::promise<absl::Status> pulled;
  ASSERT_TRUE(t_[0]->Pull(info_[1].agent_id, {{4, 7}}, later, [&pulled](absl::Status s) { pulled.set_value(s); }).ok());
  release = true;
  ASSERT_TRUE(pushed.get_future().get().ok());
  ASSERT_TRUE(pulled.get_future().get().ok());
  std::vector<unsigned char> got = Read(1);
  EXPECT_EQ(std::vector<unsigned char>(got.begin() + 4 * bb, got.begin() + 5 * bb),
            std::vector<unsigned char>(static_cast<size_t>(bb), 0x5a));
  std::vector<unsigned char> back = Read(0);
  EXPECT_EQ(std::vector<unsigned char>(back.begin() + 7 * bb, back.begin() + 8 * bb),
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

// The child's side of AnotherProcessesPoolOpensThroughItsHandle: runs only
// when that test starts this binary with TANDEM_CUDA_IPC_CHILD_DIR set.
// Serves a pool of 10 blocks whose byte j of block i is (i * 7 + j) & 255,
// publishes its PeerInfo in DIR/info, waits for DIR/pushed and checks what
// the parent pushed (blocks 2, 3 and 7 filled with 0xA6, 0xA7, 0xA8), then
// answers in DIR/result.
constexpr int kChildBlocks = 10;
unsigned char ChildByte(int64_t block, int64_t j) { return static_cast<unsigned char>((block * 7 + j) & 255); }

bool WaitForFile(const std::string& path, int seconds) {
  for (int i = 0; i < seconds * 100; ++i) {
    if (std::filesystem::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

void WriteFile(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path + ".tmp");
    out << text;
  }
  std::filesystem::rename(path + ".tmp", path);
}

TEST(CudaIpcChildTest, ServesAPoolToItsParent) {
  const char* dir = std::getenv("TANDEM_CUDA_IPC_CHILD_DIR");
  if (dir == nullptr) GTEST_SKIP() << "the child of AnotherProcessesPoolOpensThroughItsHandle";
  const PoolLayout layout = Layout(kChildBlocks);
  absl::StatusOr<std::unique_ptr<CudaIpcTransport>> t = CudaIpcTransport::Create(0);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<unsigned char> host(static_cast<size_t>(kChildBlocks * layout.block_bytes));
  for (int64_t i = 0; i < kChildBlocks; ++i) {
    for (int64_t j = 0; j < layout.block_bytes; ++j) host[i * layout.block_bytes + j] = ChildByte(i, j);
  }
  void* pool = nullptr;
  ASSERT_EQ(cudaMalloc(&pool, host.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(pool, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE((*t)->RegisterPool(layout, pool).ok());
  absl::StatusOr<PeerInfo> info = (*t)->LocalInfo();
  ASSERT_TRUE(info.ok());
  WriteFile(std::string(dir) + "/info", info->agent_id + "\n" + info->address + "\n");
  ASSERT_TRUE(WaitForFile(std::string(dir) + "/pushed", 60));
  std::vector<unsigned char> now(host.size());
  ASSERT_EQ(cudaMemcpy(now.data(), pool, now.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  std::string result = "ok";
  for (int64_t i = 0; i < kChildBlocks && result == "ok"; ++i) {
    const int fill = i == 2 ? 0xA6 : i == 3 ? 0xA7 : i == 7 ? 0xA8 : -1;
    for (int64_t j = 0; j < layout.block_bytes; ++j) {
      const unsigned char want = fill >= 0 ? static_cast<unsigned char>(fill) : ChildByte(i, j);
      if (now[i * layout.block_bytes + j] != want) {
        result = "block " + std::to_string(i) + " byte " + std::to_string(j) + " differs";
        break;
      }
    }
  }
  WriteFile(std::string(dir) + "/result", result);
  t->reset();
  cudaFree(pool);
}

TEST_F(CudaIpcTransportTest, AnotherProcessesPoolOpensThroughItsHandle) {
  char tmpl[] = "/tmp/tandem-cuda-ipc-test.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string env_dir = "TANDEM_CUDA_IPC_CHILD_DIR=" + dir;
  std::vector<std::string> env_strings = {env_dir};
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=CudaIpcChildTest.*";
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, self.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  ASSERT_TRUE(WaitForFile(dir + "/info", 60)) << "the child published no PeerInfo";
  std::ifstream in(dir + "/info");
  PeerInfo peer{.backend = "cuda_ipc", .layout = Layout(kChildBlocks)};
  std::getline(in, peer.agent_id);
  std::getline(in, peer.address);
  ASSERT_TRUE(t_[0]->AddPeer(peer).ok()) << t_[0]->AddPeer(peer);
  const int64_t bb = Layout(1).block_bytes;
  const Deadline later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // Pull the child's blocks 1, 4, 5 into ours 0, 1, 2.
  ASSERT_TRUE(Wait([&](TransferDone d) {
                return t_[0]->Pull(peer.agent_id, {{1, 0}, {4, 1}, {5, 2}}, later, std::move(d));
              }).ok());
  std::vector<unsigned char> got = Read(0);
  const int64_t pulled[] = {1, 4, 5};
  for (int k = 0; k < 3; ++k) {
    for (int64_t j = 0; j < bb; ++j) {
      ASSERT_EQ(got[k * bb + j], ChildByte(pulled[k], j)) << "block " << k << " byte " << j;
    }
  }
  // Push ours 6, 7, 8 (filled 0xA6, 0xA7, 0xA8) into the child's 2, 3, 7.
  for (int k = 0; k < 3; ++k) {
    ASSERT_EQ(cudaMemset(static_cast<unsigned char*>(pool_[0]) + (6 + k) * bb, 0xA6 + k, static_cast<size_t>(bb)),
              cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(Wait([&](TransferDone d) {
                return t_[0]->Push(peer.agent_id, {{6, 2}, {7, 3}, {8, 7}}, later, std::move(d));
              }).ok());
  // Past the dead-peer sweep's period the live child is still a peer.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const Deadline again = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  EXPECT_TRUE(Wait([&](TransferDone d) {
                return t_[0]->Pull(peer.agent_id, {{1, 0}}, again, std::move(d));
              }).ok())
      << "a live peer was taken for dead";
  WriteFile(dir + "/pushed", "");
  ASSERT_TRUE(WaitForFile(dir + "/result", 60)) << "the child gave no result";
  std::ifstream result_in(dir + "/result");
  std::stringstream result;
  result << result_in.rdbuf();
  EXPECT_EQ(result.str(), "ok");
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child failed";
  // The child exited: within a few seconds its pool is let go (its memory
  // would otherwise stay allocated while mapped here) and transfers to it
  // are refused, naming the exit.
  absl::Status after_exit;
  for (int i = 0; i < 50; ++i) {
    const Deadline soon = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    after_exit = Wait([&](TransferDone d) { return t_[0]->Pull(peer.agent_id, {{1, 0}}, soon, std::move(d)); });
    if (!after_exit.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(after_exit.code(), absl::StatusCode::kUnavailable) << after_exit;
  EXPECT_NE(std::string(after_exit.message()).find("exited"), std::string::npos) << after_exit;
  t_[0]->RemovePeer(peer.agent_id);  // a peer already let go: nothing to do
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tandem::kvtransfer
