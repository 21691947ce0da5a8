#include "kvtransfer/transport.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

using ::testing::HasSubstr;

PoolLayout Layout() {
  return PoolLayout{.model = "tiny",
                    .dtype = "float32",
                    .num_layers = 3,
                    .num_kv_heads = 2,
                    .head_dim = 16,
                    .block_size = 16,
                    .num_blocks = 100,
                    .block_bytes = 6144};
}

TEST(TransportRegistryTest, BuiltinTransportsByNameWithTheirCapabilities) {
  const TransportRegistry& r = TransportRegistry::Builtin();
  EXPECT_EQ(r.names(), (std::vector<std::string>{"cuda_ipc", "nccl", "ucx", "ucx_staged"}));
  const TransportCapabilities* ucx = r.Capabilities("ucx");
  ASSERT_NE(ucx, nullptr);
  EXPECT_TRUE(ucx->push);
  EXPECT_TRUE(ucx->pull);
  EXPECT_FALSE(ucx->needs_pairing);
  EXPECT_TRUE(ucx->Moves(MemoryType::kHost));
  EXPECT_FALSE(ucx->Moves(MemoryType::kCuda));  // Debian's UCX has no CUDA transports
  const TransportCapabilities* cuda_ipc = r.Capabilities("cuda_ipc");
  ASSERT_NE(cuda_ipc, nullptr);
  EXPECT_TRUE(cuda_ipc->push);
  EXPECT_TRUE(cuda_ipc->pull);
  EXPECT_FALSE(cuda_ipc->needs_pairing);
  EXPECT_TRUE(cuda_ipc->Moves(MemoryType::kCuda));
  EXPECT_FALSE(cuda_ipc->Moves(MemoryType::kHost));
  // Send/receive through host staging: GPU pools across hosts.
  const TransportCapabilities* staged = r.Capabilities("ucx_staged");
  ASSERT_NE(staged, nullptr);
  EXPECT_TRUE(staged->push);
  EXPECT_FALSE(staged->pull);
  EXPECT_TRUE(staged->needs_pairing);
  EXPECT_TRUE(staged->Moves(MemoryType::kCuda));
  EXPECT_TRUE(staged->Moves(MemoryType::kHost));
  // NCCL send/receive between two GPUs (libnccl.so.2 loaded when created:
  // an error naming the flag where it is not found).
  const TransportCapabilities* nccl = r.Capabilities("nccl");
  ASSERT_NE(nccl, nullptr);
  EXPECT_TRUE(nccl->push);
  EXPECT_FALSE(nccl->pull);
  EXPECT_TRUE(nccl->needs_pairing);
  EXPECT_TRUE(nccl->Moves(MemoryType::kCuda));
  EXPECT_FALSE(nccl->Moves(MemoryType::kHost));
  absl::StatusOr<std::unique_ptr<Transport>> made = r.Create("nccl", {});
  if (made.ok()) {
    EXPECT_EQ((*made)->backend(), "nccl");
  } else {
    EXPECT_THAT(std::string(made.status().message()), ::testing::HasSubstr("--kv-transport nccl: "));
  }
  absl::StatusOr<std::unique_ptr<Transport>> bad = r.Create("gloo", {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(bad.status().message()),
      ::testing::HasSubstr("--kv-transport must be none or one of cuda_ipc, nccl, ucx, ucx_staged, got 'gloo'"));
}

TEST(TransportRegistryTest, ARegistryCreatesWhatWasRegistered) {
  TransportRegistry r;
  int made = 0;
  r.Register("fake", TransportCapabilities{.pull = true, .needs_pairing = true, .memory = {MemoryType::kCuda}},
             [&made](const TransportOptions& o) -> absl::StatusOr<std::unique_ptr<Transport>> {
               ++made;
               EXPECT_EQ(o.transports, "tcp");
               return absl::UnavailableError("no peers here");
             });
  EXPECT_EQ(r.names(), std::vector<std::string>{"fake"});
  ASSERT_NE(r.Capabilities("fake"), nullptr);
  EXPECT_TRUE(r.Capabilities("fake")->needs_pairing);
  EXPECT_TRUE(r.Capabilities("fake")->Moves(MemoryType::kCuda));
  absl::StatusOr<std::unique_ptr<Transport>> t = r.Create("fake", {.transports = "tcp"});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable);  // the factory's own error
  EXPECT_EQ(made, 1);
}

TEST(CheckCompatibleTest, SameGeometryWithDifferentPoolSizesIsCompatible) {
  PoolLayout a = Layout(), b = Layout();
  b.num_blocks = 7;
  b.memory_type = MemoryType::kCuda;
  b.device_id = 0;
  EXPECT_TRUE(CheckCompatible(a, b).ok());
}

TEST(CheckCompatibleTest, EveryMustMatchFieldIsNamedWithBothValues) {
  struct Case {
    const char* field;
    void (*mutate)(PoolLayout&);
    const char* values;
  };
  const Case cases[] = {
      {"model", [](PoolLayout& l) { l.model = "small"; }, "local tiny, peer small"},
      {"dtype", [](PoolLayout& l) { l.dtype = "bfloat16"; }, "local float32, peer bfloat16"},
      {"num_layers", [](PoolLayout& l) { l.num_layers = 4; }, "local 3, peer 4"},
      {"num_kv_heads", [](PoolLayout& l) { l.num_kv_heads = 1; }, "local 2, peer 1"},
      {"head_dim", [](PoolLayout& l) { l.head_dim = 8; }, "local 16, peer 8"},
      {"block_size", [](PoolLayout& l) { l.block_size = 32; }, "local 16, peer 32"},
      {"block_bytes", [](PoolLayout& l) { l.block_bytes = 1; }, "local 6144, peer 1"},
  };
  for (const Case& c : cases) {
    PoolLayout remote = Layout();
    c.mutate(remote);
    absl::Status st = CheckCompatible(Layout(), remote);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.field;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.field));
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.values));
  }
}

TEST(PlanRunsTest, MergesRunsContiguousOnBothSides) {
  // 3,4,5 -> 10,11,12 is one run; 6 -> 20 breaks the destination; 9 -> 21
  // breaks the source.
  std::vector<BlockPair> pairs = {{3, 10}, {4, 11}, {5, 12}, {6, 20}, {9, 21}};
  absl::StatusOr<std::vector<CopyRun>> runs = PlanRuns(pairs, 100, 50, 50);
  ASSERT_TRUE(runs.ok()) << runs.status();
  ASSERT_EQ(runs->size(), 3u);
  EXPECT_EQ((*runs)[0].src_offset, 300);
  EXPECT_EQ((*runs)[0].dst_offset, 1000);
  EXPECT_EQ((*runs)[0].bytes, 300);
  EXPECT_EQ((*runs)[1].src_offset, 600);
  EXPECT_EQ((*runs)[1].dst_offset, 2000);
  EXPECT_EQ((*runs)[1].bytes, 100);
  EXPECT_EQ((*runs)[2].src_offset, 900);
  EXPECT_EQ((*runs)[2].bytes, 100);
  EXPECT_TRUE(PlanRuns({}, 100, 1, 1)->empty());
}

TEST(PlanRunsTest, RejectsOutOfRangeAndDuplicateDestinations) {
  std::vector<BlockPair> bad_src = {{5, 0}};
  EXPECT_EQ(PlanRuns(bad_src, 8, 5, 10).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<BlockPair> bad_dst = {{0, -1}};
  EXPECT_EQ(PlanRuns(bad_dst, 8, 5, 10).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<BlockPair> twice = {{0, 3}, {1, 3}};
  absl::Status st = PlanRuns(twice, 8, 5, 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("written twice"));
}

}  // namespace
}  // namespace tandem::kvtransfer
