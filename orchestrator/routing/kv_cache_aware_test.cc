#include "orchestrator/routing/kv_cache_aware.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {
namespace {

using std::chrono::seconds;
using TimePoint = std::chrono::steady_clock::time_point;

constexpr int kBlock = 16;

std::vector<WorkerView> Workers(int n) {
  std::vector<WorkerView> workers(n);
  for (int i = 0; i < n; ++i) workers[i].id = absl::StrCat("w", i);
  return workers;
}

std::vector<int32_t> Prompt(uint64_t seed, int tokens) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out(tokens);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 32000);
  return out;
}

// Makes `worker_id` exact in `index`, holding the first `blocks` blocks of `prompt`.
void HoldPrefix(KvIndex& index, const std::string& worker_id, std::span<const int32_t> prompt, int blocks) {
  const std::vector<uint64_t> hashes = HashBlocks(0, prompt, kBlock);
  tandem::v1::KvEventBatch batch;
  batch.set_instance_id("i");
  batch.mutable_snapshot()->set_seq(1);
  batch.mutable_snapshot()->set_complete(true);
  for (int b = 0; b < blocks; ++b) {
    batch.mutable_snapshot()->add_blocks()->set_block_hash(hashes[b]);
  }
  ASSERT_TRUE(index.Apply(worker_id, batch).ok());
}

struct Fixture {
  explicit Fixture(KvCacheAwarePolicy::Options options = {}) {
    policy = std::make_unique<KvCacheAwarePolicy>(options, index, [this] { return now; });
  }
  TimePoint now = TimePoint() + std::chrono::hours(1);
  std::shared_ptr<KvIndex> index = std::make_shared<KvIndex>(KvIndex::Options{});
  std::unique_ptr<KvCacheAwarePolicy> policy;
};

size_t MustPick(RoutingPolicy& policy, std::span<const WorkerView> workers, std::span<const int32_t> prompt) {
  auto picked = policy.Pick(RouteRequest{.tokens = prompt}, workers);
  EXPECT_TRUE(picked.ok()) << picked.status();
  return picked.ok() ? *picked : workers.size();
}

TEST(KvCacheAwareTest, PrefersTheWorkerWithTheLongestCachedPrefix) {
  Fixture f;
  const auto prompt = Prompt(1, 32 * kBlock + 5);
  HoldPrefix(*f.index, "w0", prompt, 4);
  HoldPrefix(*f.index, "w1", prompt, 20);
  HoldPrefix(*f.index, "w2", prompt, 12);
  auto workers = Workers(4);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
  EXPECT_EQ(f.policy->requested_blocks(), 320u);
  EXPECT_EQ(f.policy->matched_blocks(), 200u);
  // The exact worker's entries were not touched by the picks.
  EXPECT_EQ(f.index->size(), 36u);
}

TEST(KvCacheAwareTest, TellsTheCallerWhatTheChosenWorkerHolds) {
  Fixture f;
  const auto prompt = Prompt(1, 10 * kBlock + 5);
  HoldPrefix(*f.index, "w0", prompt, 7);
  HoldPrefix(*f.index, "w1", prompt, 0);
  auto workers = Workers(2);
  int64_t cached = -1;
  RouteRequest req{.tokens = prompt, .cached_tokens = &cached};
  ASSERT_EQ(*f.policy->Pick(req, workers), 0u);
  EXPECT_EQ(cached, 7 * kBlock);
  // The holder busy enough to lose: the idle worker holds nothing.
  workers[0].prefill_tokens_in_flight = 1 << 20;
  workers[0].used_blocks = workers[0].total_blocks = 10;
  ASSERT_EQ(*f.policy->Pick(req, workers), 1u);
  EXPECT_EQ(cached, 0);
}

TEST(KvCacheAwareTest, ScoresFollowTheDocumentedFormula) {
  Fixture f({.overlap_weight = 2.0, .load_weight = 0.5, .prefill_tokens_scale = 1000});
  const auto prompt = Prompt(2, 10 * kBlock);
  HoldPrefix(*f.index, "w0", prompt, 5);
  auto workers = Workers(3);
  workers[0].prefill_tokens_in_flight = 250;
  workers[0].used_blocks = 30;
  workers[0].total_blocks = 100;
  workers[1].prefill_tokens_in_flight = 5000;  // saturates at 1
  workers[1].total_blocks = 0;                 // unknown pool: usage 0
  workers[2].healthy = false;
  const auto scores = f.policy->Scores(RouteRequest{.tokens = prompt}, workers);
  EXPECT_NEAR(scores[0], 2.0 * 0.5 - 0.5 * (0.25 + 0.3) / 2, 1e-12);
  EXPECT_NEAR(scores[1], -0.5 * (1.0 + 0.0) / 2, 1e-12);
  EXPECT_EQ(scores[2], -std::numeric_limits<double>::infinity());
}

TEST(KvCacheAwareTest, EachWorkersStepBudgetScalesItsPrefillBacklog) {
  Fixture f;
  const auto prompt = Prompt(2, 10 * kBlock);
  auto workers = Workers(3);
  for (WorkerView& w : workers) w.prefill_tokens_in_flight = 1024;
  workers[0].prefill_tokens_per_step = 2048;  // a CPU worker: half a step behind
  workers[1].prefill_tokens_per_step = 0;     // reports none: 8192
  workers[2].prefill_tokens_per_step = 512;   // two steps behind: saturates at 1
  const auto scores = f.policy->Scores(RouteRequest{.tokens = prompt}, workers);
  EXPECT_NEAR(scores[0], -0.5 / 2, 1e-12);
  EXPECT_NEAR(scores[1], -(1024.0 / KvCacheAwarePolicy::kDefaultPrefillScale) / 2, 1e-12);
  EXPECT_NEAR(scores[2], -1.0 / 2, 1e-12);

  // An explicit prefill_tokens_scale overrides what the workers report.
  Fixture fixed({.prefill_tokens_scale = 4096});
  for (double s : fixed.policy->Scores(RouteRequest{.tokens = prompt}, workers)) {
    EXPECT_NEAR(s, -0.25 / 2, 1e-12);
  }
}

TEST(KvCacheAwareTest, LoadOutweighsATinyOverlap) {
  Fixture f;
  const auto prompt = Prompt(3, 32 * kBlock);
  HoldPrefix(*f.index, "w0", prompt, 1);  // 1/32 of the prompt
  HoldPrefix(*f.index, "w1", prompt, 0);  // exact: picks do not add to it
  auto workers = Workers(2);
  workers[0].prefill_tokens_in_flight = 4096;  // load 0.25
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
  // A large overlap still wins over the same load difference.
  HoldPrefix(*f.index, "w0", prompt, 24);
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  // But not over a fully loaded worker.
  workers[0].prefill_tokens_in_flight = 1 << 20;
  workers[0].used_blocks = workers[0].total_blocks = 1000;
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
}

// Every new session's first turn shares a system prompt that only w0 holds.
// w0 takes sessions while within the bound; past it they spill to w1.
TEST(KvCacheAwareTest, AWorkerOverTheLoadBoundLosesEvenItsCachedPrefix) {
  Fixture f;  // load_factor 1.25 by default
  const auto prompt = Prompt(4, 16 * kBlock);
  HoldPrefix(*f.index, "w0", prompt, 16);
  HoldPrefix(*f.index, "w1", prompt, 0);
  auto workers = Workers(2);
  // 1 in flight on w0, none on w1: 1 <= 1.25 * (1 + 1) / 2.
  workers[0].in_flight = 1;
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  EXPECT_EQ(f.policy->spillovers(), 0u);
  // 2 in flight: over 1.25 * 3 / 2 = 1.875.
  workers[0].in_flight = 2;
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
  EXPECT_EQ(f.policy->spillovers(), 1u);
  // With w1 busy too, the bound (1.25 * 4 / 2 = 2.5) admits w0 again.
  workers[1].in_flight = 1;
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  EXPECT_EQ(f.policy->spillovers(), 1u);
  // Sampling draws from the candidates only.
  Fixture hot({.load_factor = 1.25, .temperature = 0.01, .seed = 1});
  HoldPrefix(*hot.index, "w0", prompt, 16);
  HoldPrefix(*hot.index, "w1", prompt, 0);
  workers[1].in_flight = 0;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(MustPick(*hot.policy, workers, prompt), 1u);
  // Without a bound the holder keeps it.
  Fixture loose({.load_factor = 1e9});
  HoldPrefix(*loose.index, "w0", prompt, 16);
  EXPECT_EQ(MustPick(*loose.policy, workers, prompt), 0u);
  EXPECT_EQ(loose.policy->spillovers(), 0u);
}

// A worker over the bound keeps a request whose cached prefix, beyond what
// any worker within the bound holds, is at least one step of its prefill.
TEST(KvCacheAwareTest, APrefixLongerThanAStepOutweighsTheLoadBound) {
  const auto prompt = Prompt(5, 40 * kBlock);
  auto workers = Workers(2);
  for (WorkerView& w : workers) w.prefill_tokens_per_step = 16 * kBlock;
  workers[0].in_flight = 2;  // over 1.25 * 3 / 2
  {
    Fixture f;
    HoldPrefix(*f.index, "w0", prompt, 16);  // a step's worth: kept
    HoldPrefix(*f.index, "w1", prompt, 0);
    EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
    EXPECT_EQ(f.policy->spillovers(), 0u);
  }
  {
    Fixture f;
    HoldPrefix(*f.index, "w0", prompt, 15);  // a block short of it: spills
    HoldPrefix(*f.index, "w1", prompt, 0);
    EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
    EXPECT_EQ(f.policy->spillovers(), 1u);
  }
  {
    Fixture f;
    // What counts is the lead over the workers within the bound: 20 - 8.
    HoldPrefix(*f.index, "w0", prompt, 20);
    HoldPrefix(*f.index, "w1", prompt, 8);
    EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
  }
  {
    // keep_prefix_tokens sets the length for every worker.
    Fixture f({.keep_prefix_tokens = 12 * kBlock});
    HoldPrefix(*f.index, "w0", prompt, 20);
    HoldPrefix(*f.index, "w1", prompt, 8);
    EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  }
  {
    // prefill_tokens_scale stands in for every worker's step budget.
    Fixture f({.prefill_tokens_scale = 8 * kBlock});
    HoldPrefix(*f.index, "w0", prompt, 10);
    HoldPrefix(*f.index, "w1", prompt, 0);
    EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  }
}

TEST(KvCacheAwareTest, ColdRequestsOnAnIdleClusterTakeTurns) {
  Fixture f;
  auto workers = Workers(3);
  std::map<size_t, int> counts;
  for (int i = 0; i < 30; ++i) {
    const auto prompt = Prompt(100 + i, 4 * kBlock);
    ++counts[MustPick(*f.policy, workers, prompt)];
  }
  EXPECT_EQ(counts, (std::map<size_t, int>{{0, 10}, {1, 10}, {2, 10}}));
}

TEST(KvCacheAwareTest, ApproximateModeSendsARepeatedPrefixBackToTheSameWorker) {
  Fixture f;
  auto workers = Workers(4);
  const auto prompt = Prompt(4, 8 * kBlock);
  const size_t first = MustPick(*f.policy, workers, prompt);
  EXPECT_EQ(f.index->size(), 8u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(MustPick(*f.policy, workers, prompt), first);
  // After the TTL (120 s by default) the prediction is gone: turns again.
  f.now += seconds(121);
  EXPECT_NE(MustPick(*f.policy, workers, prompt), first);
}

TEST(KvCacheAwareTest, PicksAreNotRecordedForExactWorkers) {
  Fixture f;
  tandem::v1::KvEventBatch snapshot;
  snapshot.set_instance_id("i");
  snapshot.mutable_snapshot()->set_complete(true);
  ASSERT_TRUE(f.index->Apply("w0", snapshot).ok());
  auto workers = Workers(1);
  const auto prompt = Prompt(5, 8 * kBlock);
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 0u);
  EXPECT_EQ(f.index->size(), 0u);
}

TEST(KvCacheAwareTest, TemperatureSpreadsPicks) {
  const auto prompt = Prompt(6, 16 * kBlock);
  auto workers = Workers(3);
  // w0 holds half the prompt: score 0.5 against 0 for the others.
  auto count_picks = [&](double temperature) {
    Fixture f({.temperature = temperature, .seed = 11});
    HoldPrefix(*f.index, "w0", prompt, 8);
    HoldPrefix(*f.index, "w1", prompt, 0);  // exact: picks do not add to them
    HoldPrefix(*f.index, "w2", prompt, 0);
    std::map<size_t, int> counts;
    for (int i = 0; i < 3000; ++i) ++counts[MustPick(*f.policy, workers, prompt)];
    return counts;
  };
  EXPECT_EQ(count_picks(0.0), (std::map<size_t, int>{{0, 3000}}));
  // T = 0.5: weights e^1 : 1 : 1, so w0 gets ~57.6% and each other ~21.2%.
  auto counts = count_picks(0.5);
  EXPECT_NEAR(counts[0], 1727, 120);
  EXPECT_NEAR(counts[1], 636, 100);
  EXPECT_NEAR(counts[2], 636, 100);
}

TEST(KvCacheAwareTest, UnhealthyWorkersAreNeverPickedAndNoneIsUnavailable) {
  Fixture f({.temperature = 1.0, .seed = 3});
  const auto prompt = Prompt(7, 8 * kBlock);
  HoldPrefix(*f.index, "w1", prompt, 8);
  auto workers = Workers(4);
  workers[1].healthy = workers[3].healthy = false;
  for (int i = 0; i < 300; ++i) {
    const size_t picked = MustPick(*f.policy, workers, prompt);
    ASSERT_TRUE(picked == 0 || picked == 2) << picked;
  }
  for (auto& w : workers) w.healthy = false;
  auto picked = f.policy->Pick(RouteRequest{.tokens = prompt}, workers);
  EXPECT_EQ(picked.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(picked.status().message(), ::testing::HasSubstr("kv_cache_aware"));
  EXPECT_EQ(f.policy->Pick(RouteRequest{.tokens = prompt}, {}).status().code(), absl::StatusCode::kUnavailable);
}

TEST(KvCacheAwareTest, BlockHashSeedAndSizeMustMatchTheWorkers) {
  // The index holds blocks hashed with seed 0 and 16-token blocks.
  const auto prompt = Prompt(8, 8 * kBlock);
  Fixture other_seed({.block_hash_seed = 99});
  HoldPrefix(*other_seed.index, "w1", prompt, 8);
  auto workers = Workers(2);
  other_seed.policy->Pick(RouteRequest{.tokens = prompt}, workers).IgnoreError();
  EXPECT_EQ(other_seed.policy->matched_blocks(), 0u);
  Fixture same;
  HoldPrefix(*same.index, "w1", prompt, 8);
  EXPECT_EQ(MustPick(*same.policy, workers, prompt), 1u);
  EXPECT_EQ(same.policy->matched_blocks(), 8u);
}

TEST(KvCacheAwareTest, ShortPromptsRouteOnLoadAlone) {
  Fixture f;
  auto workers = Workers(2);
  workers[0].prefill_tokens_in_flight = 100;
  const auto prompt = Prompt(9, kBlock - 1);
  EXPECT_EQ(MustPick(*f.policy, workers, prompt), 1u);
  EXPECT_EQ(f.index->size(), 0u);
}

// Block size and hash seed come from the cluster (the workers' ModelInfo),
// not from YAML: the policy hashes prompts as the context says, and exposes
// its index through kv_index() (other policies have none).
TEST(KvCacheAwareTest, BlockSizeAndSeedComeFromThePolicyContext) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  auto created = registry.Create("kv_cache_aware", {}, {.block_size = 4, .block_hash_seed = 7});
  ASSERT_TRUE(created.ok()) << created.status();
  std::shared_ptr<KvIndex> index = (*created)->kv_index();
  ASSERT_NE(index, nullptr);
  auto workers = Workers(2);
  const auto prompt = Prompt(11, 12);  // three blocks of 4
  absl::StatusOr<size_t> chosen = (*created)->Pick(RouteRequest{.tokens = prompt}, workers);
  ASSERT_TRUE(chosen.ok());
  // The routed entries are the prompt's blocks as the workers hash them.
  const std::vector<KvIndex::Overlap> overlaps =
      index->Match(HashBlocks(7, prompt, 4), std::chrono::steady_clock::now());
  ASSERT_EQ(overlaps.size(), 1u);
  EXPECT_EQ(overlaps[0].worker_id, workers[*chosen].id);
  EXPECT_EQ(overlaps[0].matched_blocks, 3);
  EXPECT_TRUE(index->Match(HashBlocks(0, prompt, 4), std::chrono::steady_clock::now()).empty());
  EXPECT_EQ((*registry.Create("round_robin", {}))->kv_index(), nullptr);
  EXPECT_EQ(registry.Create("kv_cache_aware", {}, {.block_size = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvCacheAwareTest, RegistryPolicyOwnsAnIndexBuiltFromItsParameters) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  auto created = registry.Create("kv_cache_aware", {{"max_blocks", "10"}, {"ttl_s", "5"}});
  ASSERT_TRUE(created.ok()) << created.status();
  auto* policy = dynamic_cast<KvCacheAwarePolicy*>(created->get());
  ASSERT_NE(policy, nullptr);
  ASSERT_NE(policy->index(), nullptr);
  auto workers = Workers(2);
  const auto prompt = Prompt(10, 40 * kBlock);
  EXPECT_TRUE(policy->Pick(RouteRequest{.tokens = prompt}, workers).ok());
  EXPECT_EQ(policy->index()->size(), 10u);  // capped
}

}  // namespace
}  // namespace tandem::router
