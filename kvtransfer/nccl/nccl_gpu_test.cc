// The real NCCL (LoadNccl) between two GPUs of this process: both ranks'
// non-blocking creation polled to ready, groups of several buffers moved
// GPU 0 -> GPU 1 and back in posting order, an abort failing the peer's
// transfer. Skips with fewer than two GPUs or without libnccl.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "kvtransfer/nccl/nccl_api.h"

namespace tandem::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;

class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
      cudaGetLastError();
      GTEST_SKIP() << "needs two GPUs (" << devices << " here)";
    }
    absl::StatusOr<std::unique_ptr<NcclApi>> nccl = LoadNccl();
    if (!nccl.ok()) GTEST_SKIP() << nccl.status();
    nccl_ = *std::move(nccl);
    absl::StatusOr<std::string> id = nccl_->UniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<void*> c = nccl_->InitRank(*id, r, r);
      ASSERT_TRUE(c.ok()) << c.status();
      comm_[r] = *c;
    }
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    for (bool ready = false; !ready;) {
      ASSERT_LT(Clock::now(), give_up) << "the communicator never became ready";
      absl::StatusOr<bool> a = nccl_->Ready(comm_[0]), b = nccl_->Ready(comm_[1]);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
      ready = *a && *b;
    }
  }
  void TearDown() override {
    for (void*& c : comm_) {
      if (c != nullptr) nccl_->Destroy(c);
    }
  }
  // Polls both tickets to their end.
  void Finish(uint64_t t0, uint64_t t1, absl::Status* s0, absl::Status* s1) {
    const auto give_up = Clock::now() + std::chrono::seconds(30);
    bool d0 = false, d1 = false;
    while ((!d0 || !d1) && Clock::now() < give_up) {
      if (!d0) {
        absl::StatusOr<bool> r = nccl_->Done(comm_[0], t0);
        d0 = !r.ok() || *r;
        if (!r.ok()) *s0 = r.status();
      }
      if (!d1) {
        absl::StatusOr<bool> r = nccl_->Done(comm_[1], t1);
        d1 = !r.ok() || *r;
        if (!r.ok()) *s1 = r.status();
      }
    }
    if (!d0) *s0 = absl::DeadlineExceededError("rank 0's group did not end");
    if (!d1) *s1 = absl::DeadlineExceededError("rank 1's group did not end");
  }
  std::unique_ptr<NcclApi> nccl_;
  void* comm_[2] = {nullptr, nullptr};
};

TEST_F(NcclGpuTest, GroupsMoveBuffersBetweenTheGpusInPostingOrder) {
  constexpr size_t kSizes[] = {1 << 20, 3 << 10, 5 << 20};
  std::vector<uint8_t*> src, dst;
  std::vector<std::vector<uint8_t>> host;
  for (size_t i = 0; i < 3; ++i) {
    uint8_t *s = nullptr, *d = nullptr;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&s), kSizes[i]), cudaSuccess);
    host.emplace_back(kSizes[i]);
    std::iota(host.back().begin(), host.back().end(), static_cast<uint8_t>(17 * i));
    ASSERT_EQ(cudaMemcpy(s, host.back().data(), kSizes[i], cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), kSizes[i]), cudaSuccess);
    ASSERT_EQ(cudaMemset(d, 0, kSizes[i]), cudaSuccess);
    src.push_back(s);
    dst.push_back(d);
  }
  // Two transfers in order: buffers {0, 1}, then {2}; the receiver posts first.
  const NcclApi::Buffer r1[] = {{dst[0], int64_t(kSizes[0])}, {dst[1], int64_t(kSizes[1])}};
  const NcclApi::Buffer r2[] = {{dst[2], int64_t(kSizes[2])}};
  const NcclApi::Buffer s1[] = {{src[0], int64_t(kSizes[0])}, {src[1], int64_t(kSizes[1])}};
  const NcclApi::Buffer s2[] = {{src[2], int64_t(kSizes[2])}};
  absl::StatusOr<uint64_t> u1 = nccl_->Group(comm_[1], false, r1);
  absl::StatusOr<uint64_t> t1 = nccl_->Group(comm_[0], true, s1);
  ASSERT_TRUE(u1.ok() && t1.ok()) << u1.status() << t1.status();
  absl::Status a, b, c, d;
  Finish(*t1, *u1, &a, &b);
  absl::StatusOr<uint64_t> u2 = nccl_->Group(comm_[1], false, r2);
  absl::StatusOr<uint64_t> t2 = nccl_->Group(comm_[0], true, s2);
  ASSERT_TRUE(u2.ok() && t2.ok()) << u2.status() << t2.status();
  Finish(*t2, *u2, &c, &d);
  EXPECT_TRUE(a.ok() && b.ok() && c.ok() && d.ok()) << a << b << c << d;
  for (size_t i = 0; i < 3; ++i) {
    std::vector<uint8_t> got(kSizes[i]);
    ASSERT_EQ(cudaMemcpy(got.data(), dst[i], kSizes[i], cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, host[i]) << "buffer " << i;
    cudaFree(src[i]);
    cudaFree(dst[i]);
  }
}

// A staged transfer's steps on the real library: rank 0 gathers scattered
// blocks into a staging buffer (Copies) and sends it after the gather
// (Group after its ticket); rank 1 receives into its staging buffer and
// scatters after the receive (Copies after the group's ticket).
TEST_F(NcclGpuTest, StagedCopiesGatherSendReceiveAndScatter) {
  constexpr int64_t kBlock = 64 << 10;
  constexpr int kBlocks = 8;
  uint8_t *pool[2] = {nullptr, nullptr}, *staging[2] = {nullptr, nullptr};
  std::vector<uint8_t> host(kBlocks * kBlock);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&pool[r]), host.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&staging[r]), 4 * kBlock), cudaSuccess);
    if (r == 0) {
      ASSERT_EQ(cudaMemcpy(pool[r], host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      ASSERT_EQ(cudaMemset(pool[r], 0, host.size()), cudaSuccess);
    }
  }
  // The pair's connection first (a group's first use waits for the peer's).
  {
    const NcclApi::Buffer r[] = {{staging[1], 4096}}, s[] = {{staging[0], 4096}};
    absl::StatusOr<uint64_t> u = nccl_->Group(comm_[1], false, r), t = nccl_->Group(comm_[0], true, s);
    ASSERT_TRUE(u.ok() && t.ok()) << u.status() << t.status();
    absl::Status a, b;
    Finish(*t, *u, &a, &b);
    ASSERT_TRUE(a.ok() && b.ok()) << a << b;
  }
  const int from[] = {5, 1, 6, 2}, to[] = {0, 7, 3, 4};
  std::vector<NcclApi::Copy> gather, scatter;
  for (int i = 0; i < 4; ++i) {
    gather.push_back({pool[0] + from[i] * kBlock, staging[0] + i * kBlock, kBlock});
    scatter.push_back({staging[1] + i * kBlock, pool[1] + to[i] * kBlock, kBlock});
  }
  const NcclApi::Buffer sent[] = {{staging[0], 4 * kBlock}}, received[] = {{staging[1], 4 * kBlock}};
  absl::StatusOr<uint64_t> recv = nccl_->Group(comm_[1], false, received, 0);
  ASSERT_TRUE(recv.ok()) << recv.status();
  absl::StatusOr<uint64_t> scattered = nccl_->Copies(comm_[1], scatter, *recv);
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  absl::StatusOr<uint64_t> gathered = nccl_->Copies(comm_[0], gather, 0);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  absl::StatusOr<uint64_t> send = nccl_->Group(comm_[0], true, sent, *gathered);
  ASSERT_TRUE(send.ok()) << send.status();
  absl::Status a, b;
  Finish(*send, *scattered, &a, &b);
  EXPECT_TRUE(a.ok() && b.ok()) << a << b;
  std::vector<uint8_t> got(host.size());
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), pool[1], got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(
        std::equal(got.begin() + to[i] * kBlock, got.begin() + (to[i] + 1) * kBlock, host.begin() + from[i] * kBlock))
        << "block " << to[i];
  }
  EXPECT_EQ(std::count(got.begin() + 5 * kBlock, got.begin() + 6 * kBlock, 0), kBlock) << "block 5: not a destination";
  for (int r = 0; r < 2; ++r) {
    cudaFree(pool[r]);
    cudaFree(staging[r]);
  }
}

TEST_F(NcclGpuTest, AnAbortFailsThePeersReceive) {
  uint8_t* d = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 1 << 20), cudaSuccess);
  const NcclApi::Buffer r[] = {{d, 1 << 20}};
  absl::StatusOr<uint64_t> u = nccl_->Group(comm_[1], false, r);
  ASSERT_TRUE(u.ok()) << u.status();
  absl::StatusOr<bool> pending = nccl_->Done(comm_[1], *u);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_FALSE(*pending);
  // Rank 1 gives up on a receive rank 0 never sends: its abort ends it.
  nccl_->Abort(comm_[1]);
  comm_[1] = nullptr;
  cudaFree(d);
  SUCCEED();
}

}  // namespace
}  // namespace tandem::kvtransfer
