// NcclApi: the fake's pairing, posting-order matching, size checks and
// aborts (the rules the NCCL backend's bookkeeping is tested against), and
// LoadNccl's answer where libnccl is or is not.
#include "kvtransfer/nccl/nccl_api.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <numeric>
#include <vector>

namespace tandem::kvtransfer {
namespace {

// Two ranks of one fake communicator, joined.
struct FakePair {
  std::shared_ptr<FakeNcclFabric> fabric = NewFakeNcclFabric();
  std::unique_ptr<NcclApi> a = NewFakeNccl(fabric), b = NewFakeNccl(fabric);
  void* ca = nullptr;
  void* cb = nullptr;
  FakePair() {
    absl::StatusOr<std::string> id = a->UniqueId();
    EXPECT_TRUE(id.ok());
    ca = *a->InitRank(*id, 0, 0);
    cb = *b->InitRank(*id, 1, 0);
  }
  ~FakePair() {
    if (ca != nullptr) a->Destroy(ca);
    if (cb != nullptr) b->Destroy(cb);
  }
};

std::vector<uint8_t> Bytes(size_t n, uint8_t first) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(FakeNcclTest, BothRanksJoinBeforeTheCommunicatorIsReady) {
  auto fabric = NewFakeNcclFabric();
  auto a = NewFakeNccl(fabric), b = NewFakeNccl(fabric);
  absl::StatusOr<std::string> id = a->UniqueId();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->size(), NcclApi::kUniqueIdBytes);
  EXPECT_NE(*a->UniqueId(), *id);
  absl::StatusOr<void*> ca = a->InitRank(*id, 0, 0);
  ASSERT_TRUE(ca.ok());
  EXPECT_EQ(*a->Ready(*ca), false);  // rank 1 has not joined
  EXPECT_EQ(a->Group(*ca, true, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->InitRank(*id, 0, 0).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(b->InitRank("short", 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->InitRank(*id, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<void*> cb = b->InitRank(*id, 1, 0);
  ASSERT_TRUE(cb.ok());
  EXPECT_EQ(*a->Ready(*ca), true);
  EXPECT_EQ(*b->Ready(*cb), true);
  a->Destroy(*ca);
  b->Destroy(*cb);
}

// Groups meet in the order each side posted them, whichever side posts
// first; every buffer lands where its receive points.
TEST(FakeNcclTest, GroupsMatchInPostingOrderEitherSideFirst) {
  FakePair p;
  std::vector<uint8_t> s1 = Bytes(16, 1), s2 = Bytes(8, 50), s3 = Bytes(32, 100);
  std::vector<uint8_t> r1(16), r2(8), r3(32);
  const NcclApi::Buffer first_send[] = {{s1.data(), 16}, {s2.data(), 8}};
  const NcclApi::Buffer first_recv[] = {{r1.data(), 16}, {r2.data(), 8}};
  // The receive of the second transfer is posted before its send.
  absl::StatusOr<uint64_t> t1 = p.a->Group(p.ca, true, first_send);
  absl::StatusOr<uint64_t> u1 = p.b->Group(p.cb, false, first_recv);
  const NcclApi::Buffer second_recv[] = {{r3.data(), 32}};
  const NcclApi::Buffer second_send[] = {{s3.data(), 32}};
  absl::StatusOr<uint64_t> u2 = p.b->Group(p.cb, false, second_recv);
  EXPECT_EQ(*p.b->Done(p.cb, *u2), false);
  absl::StatusOr<uint64_t> t2 = p.a->Group(p.ca, true, second_send);
  ASSERT_TRUE(t1.ok() && u1.ok() && u2.ok() && t2.ok());
  EXPECT_EQ(*p.a->Done(p.ca, *t1), true);
  EXPECT_EQ(*p.b->Done(p.cb, *u1), true);
  EXPECT_EQ(*p.a->Done(p.ca, *t2), true);
  EXPECT_EQ(*p.b->Done(p.cb, *u2), true);
  EXPECT_EQ(r1, s1);
  EXPECT_EQ(r2, s2);
  EXPECT_EQ(r3, s3);
  EXPECT_EQ(p.a->Done(p.ca, *t1).status().code(), absl::StatusCode::kInvalidArgument);  // spent
  // The other direction is independent.
  std::vector<uint8_t> back(16);
  const NcclApi::Buffer bs[] = {{r1.data(), 16}}, br[] = {{back.data(), 16}};
  absl::StatusOr<uint64_t> t3 = p.b->Group(p.cb, true, bs);
  absl::StatusOr<uint64_t> u3 = p.a->Group(p.ca, false, br);
  EXPECT_EQ(*p.b->Done(p.cb, *t3), true);
  EXPECT_EQ(*p.a->Done(p.ca, *u3), true);
  EXPECT_EQ(back, s1);
}

// Posting orders that disagree (what the backend must never let happen):
// a send meets a receive of another size, and the communicator fails on
// both ranks.
TEST(FakeNcclTest, MismatchedGroupsFailTheCommunicator) {
  FakePair p;
  std::vector<uint8_t> s(16, 7), r(8);
  const NcclApi::Buffer send[] = {{s.data(), 16}}, recv[] = {{r.data(), 8}};
  absl::StatusOr<uint64_t> t = p.a->Group(p.ca, true, send);
  absl::StatusOr<uint64_t> u = p.b->Group(p.cb, false, recv);
  ASSERT_TRUE(t.ok() && u.ok());
  EXPECT_EQ(p.a->Done(p.ca, *t).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(p.b->Done(p.cb, *u).status().code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(p.a->Ready(p.ca).ok());
  EXPECT_EQ(r, std::vector<uint8_t>(8, 0));
}

// An abort on one rank fails what the other has in flight.
TEST(FakeNcclTest, AnAbortFailsThePeersTransfers) {
  FakePair p;
  std::vector<uint8_t> r(8);
  const NcclApi::Buffer recv[] = {{r.data(), 8}};
  absl::StatusOr<uint64_t> u = p.b->Group(p.cb, false, recv);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(*p.b->Done(p.cb, *u), false);
  p.a->Abort(p.ca);
  p.ca = nullptr;
  absl::StatusOr<bool> done = p.b->Done(p.cb, *u);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(done.status().message().find("aborted by rank 0"), std::string::npos) << done.status();
}

TEST(LoadNcclTest, LoadsOrSaysWhatToSet) {
  setenv("TANDEM_NCCL", "/nonexistent/libnccl.so.2", 1);
  absl::StatusOr<std::unique_ptr<NcclApi>> missing = LoadNccl();
  unsetenv("TANDEM_NCCL");
  ASSERT_FALSE(missing.ok());
  if (missing.status().code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << missing.status();
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(missing.status().message().find("TANDEM_NCCL"), std::string::npos) << missing.status();
  // The installed library (the CUDA toolkit's here, torch's on the GPU machine), if the loader finds it.
  absl::StatusOr<std::unique_ptr<NcclApi>> nccl = LoadNccl();
  if (!nccl.ok()) {
    EXPECT_EQ(nccl.status().code(), absl::StatusCode::kUnavailable) << nccl.status();
  }
}

}  // namespace
}  // namespace tandem::kvtransfer
