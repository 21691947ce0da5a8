#include "orchestrator/routing/routing_policy.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "orchestrator/routing/prefix_aware.h"
#include "orchestrator/routing/sticky_session.h"

namespace tandem::router {
namespace {

using ::testing::HasSubstr;

std::vector<WorkerView> Workers(int n) {
  std::vector<WorkerView> workers(n);
  for (int i = 0; i < n; ++i) workers[i].id = absl::StrCat("10.0.0.", i, ":7000");
  return workers;
}

std::unique_ptr<RoutingPolicy> Make(const std::string& name, const PolicyParams& params = {}) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  auto policy = registry.Create(name, params);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? *std::move(policy) : nullptr;
}

size_t MustPick(RoutingPolicy& policy, std::span<const WorkerView> workers, const RouteRequest& req = {}) {
  auto picked = policy.Pick(req, workers);
  EXPECT_TRUE(picked.ok()) << picked.status();
  return picked.ok() ? *picked : workers.size();
}

std::vector<int32_t> RandomPrompt(std::mt19937_64& rng, int length) {
  std::vector<int32_t> tokens(length);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  return tokens;
}

// ---- every policy --------------------------------------------------------

class AllPoliciesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AllPoliciesTest, EmptyWorkerListIsUnavailable) {
  auto policy = Make(GetParam());
  auto picked = policy->Pick(RouteRequest{.session_id = "s"}, {});
  EXPECT_EQ(picked.status().code(), absl::StatusCode::kUnavailable);
  picked = policy->Pick(RouteRequest{}, {});
  EXPECT_EQ(picked.status().code(), absl::StatusCode::kUnavailable);
}

TEST_P(AllPoliciesTest, AllUnhealthyIsUnavailable) {
  auto policy = Make(GetParam());
  auto workers = Workers(3);
  for (auto& w : workers) w.healthy = false;
  auto picked = policy->Pick(RouteRequest{.session_id = "s"}, workers);
  EXPECT_EQ(picked.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(picked.status().message(), HasSubstr(GetParam()));
}

TEST_P(AllPoliciesTest, NeverPicksAnUnhealthyWorker) {
  auto policy = Make(GetParam());
  auto workers = Workers(5);
  workers[0].healthy = workers[2].healthy = workers[4].healthy = false;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 500; ++i) {
    const auto prompt = RandomPrompt(rng, 20);
    const size_t picked =
        MustPick(*policy, workers, RouteRequest{.tokens = prompt, .session_id = absl::StrCat("s", i % 7)});
    ASSERT_LT(picked, workers.size());
    EXPECT_TRUE(workers[picked].healthy) << picked;
  }
}

TEST_P(AllPoliciesTest, NameMatchesRegistryName) { EXPECT_EQ(Make(GetParam())->name(), GetParam()); }

TEST_P(AllPoliciesTest, ConcurrentPicksAreSafe) {
  auto policy = Make(GetParam());
  auto workers = Workers(6);
  std::vector<std::thread> threads;
  std::vector<int> bad(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 5000; ++i) {
        const auto prompt = RandomPrompt(rng, 8);
        auto picked =
            policy->Pick(RouteRequest{.tokens = prompt, .session_id = absl::StrCat("s", rng() % 100)}, workers);
        if (!picked.ok() || *picked >= workers.size()) ++bad[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

INSTANTIATE_TEST_SUITE_P(Builtin, AllPoliciesTest,
                         ::testing::Values("round_robin", "random", "least_request", "power_of_two", "prefix_aware",
                                           "sticky_session", "kv_cache_aware"),
                         [](const auto& info) { return info.param; });

// ---- registry ------------------------------------------------------------

TEST(RoutingPolicyRegistryTest, NamesAreTheBuiltinsSorted) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  EXPECT_THAT(registry.names(), ::testing::ElementsAre("kv_cache_aware", "least_request", "power_of_two",
                                                       "prefix_aware", "random", "round_robin", "sticky_session"));
}

TEST(RoutingPolicyRegistryTest, UnknownNameListsTheKnownOnes) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  auto policy = registry.Create("least_latency", {});
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(policy.status().message(), HasSubstr("least_latency"));
  EXPECT_THAT(policy.status().message(), HasSubstr("round_robin, sticky_session"));
}

TEST(RoutingPolicyRegistryTest, BadParametersNameTheParameterAndThePolicy) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  struct Case {
    std::string policy, key, value;
  };
  const Case cases[] = {
      {"round_robin", "seed", "1"},  // unknown for this policy
      {"random", "seed", "-1"},      // not unsigned
      {"random", "sed", "1"},        // typo
      {"power_of_two", "seed", "x"},
      {"least_request", "foo", "1"},
      {"prefix_aware", "prefix_tokens", "0"},  // out of range
      {"prefix_aware", "virtual_nodes", "ten"},
      {"prefix_aware", "load_factor", "0.5"},  // below 1
      {"prefix_aware", "load_factor", "nan"},
      {"sticky_session", "max_sessions", "0"},
      {"sticky_session", "ttl_s", "1.5"},
      {"kv_cache_aware", "block_size", "16"},  // the workers' to tell, not a parameter
      {"kv_cache_aware", "block_hash_seed", "1"},
      {"kv_cache_aware", "temperature", "-1"},
      {"kv_cache_aware", "max_blocks", "0"},
      {"kv_cache_aware", "ttl_s", "1.5"},
      {"kv_cache_aware", "overlap_weigth", "1"},  // typo
      {"kv_cache_aware", "load_factor", "0.9"},   // below 1
      {"kv_cache_aware", "prefill_tokens_scale", "0"},
      {"kv_cache_aware", "keep_prefix_tokens", "0"},
  };
  for (const Case& c : cases) {
    auto policy = registry.Create(c.policy, {{c.key, c.value}});
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << c.policy << c.key;
    EXPECT_THAT(policy.status().message(), HasSubstr(c.policy));
    EXPECT_THAT(policy.status().message(), HasSubstr("'" + c.key + "'"));
  }
}

TEST(RoutingPolicyRegistryTest, GoodParametersAreAccepted) {
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  EXPECT_TRUE(registry.Create("random", {{"seed", "18446744073709551615"}}).ok());
  EXPECT_TRUE(registry.Create("power_of_two", {{"seed", "0"}}).ok());
  EXPECT_TRUE(
      registry.Create("prefix_aware", {{"prefix_tokens", "64"}, {"virtual_nodes", "10"}, {"load_factor", "2"}}).ok());
  EXPECT_TRUE(registry.Create("sticky_session", {{"max_sessions", "5"}, {"ttl_s", "60"}}).ok());
  EXPECT_TRUE(registry
                  .Create("kv_cache_aware", {{"overlap_weight", "2"},
                                             {"load_weight", "0.5"},
                                             {"prefill_tokens_scale", "4096"},
                                             {"load_factor", "1.5"},
                                             {"keep_prefix_tokens", "512"},
                                             {"temperature", "0.1"},
                                             {"seed", "3"},
                                             {"max_blocks", "1000"},
                                             {"ttl_s", "30"}})
                  .ok());
}

// ---- round_robin ---------------------------------------------------------

TEST(RoundRobinTest, CyclesThroughWorkers) {
  auto policy = Make("round_robin");
  auto workers = Workers(3);
  std::vector<size_t> picks;
  for (int i = 0; i < 6; ++i) picks.push_back(MustPick(*policy, workers));
  EXPECT_THAT(picks, ::testing::ElementsAre(0, 1, 2, 0, 1, 2));
}

TEST(RoundRobinTest, SkipsUnhealthyEvenly) {
  auto policy = Make("round_robin");
  auto workers = Workers(4);
  workers[1].healthy = false;
  std::map<size_t, int> counts;
  for (int i = 0; i < 300; ++i) ++counts[MustPick(*policy, workers)];
  EXPECT_THAT(counts,
              ::testing::ElementsAre(::testing::Pair(0, 100), ::testing::Pair(2, 100), ::testing::Pair(3, 100)));
}

// Picks offered alternately two disjoint sets (the prefill workers of two
// KV domains, the others marked unhealthy): each set takes its turns on its
// own, so every worker of each gets its share.
TEST(RoundRobinTest, DisjointCandidateSetsEachCycle) {
  auto policy = Make("round_robin");
  auto a = Workers(4), b = Workers(4);
  a[2].healthy = a[3].healthy = false;  // domain a: workers 0 and 1
  b[0].healthy = b[1].healthy = false;  // domain b: workers 2 and 3
  std::map<size_t, int> counts;
  for (int i = 0; i < 400; ++i) ++counts[MustPick(*policy, i % 2 == 0 ? a : b)];
  EXPECT_THAT(counts, ::testing::ElementsAre(::testing::Pair(0, 100), ::testing::Pair(1, 100), ::testing::Pair(2, 100),
                                             ::testing::Pair(3, 100)));
}

// ---- random --------------------------------------------------------------

TEST(RandomTest, UniformOverHealthyWorkers) {
  auto policy = Make("random", {{"seed", "42"}});
  auto workers = Workers(5);
  workers[3].healthy = false;
  std::vector<int> counts(5, 0);
  constexpr int kPicks = 40000;
  for (int i = 0; i < kPicks; ++i) ++counts[MustPick(*policy, workers)];
  EXPECT_EQ(counts[3], 0);
  // Each of 4 gets 10000 in expectation, sd ~87; 5% is ~6 sd.
  for (int i : {0, 1, 2, 4}) {
    EXPECT_GT(counts[i], 9500) << i;
    EXPECT_LT(counts[i], 10500) << i;
  }
}

TEST(RandomTest, SeedMakesPicksReproducible) {
  auto a = Make("random", {{"seed", "9"}});
  auto b = Make("random", {{"seed", "9"}});
  auto workers = Workers(7);
  std::vector<size_t> picks_a, picks_b;
  for (int i = 0; i < 100; ++i) {
    picks_a.push_back(MustPick(*a, workers));
    picks_b.push_back(MustPick(*b, workers));
  }
  EXPECT_EQ(picks_a, picks_b);
}

// ---- least_request -------------------------------------------------------

TEST(LeastRequestTest, PicksFewestInFlight) {
  auto policy = Make("least_request");
  auto workers = Workers(4);
  workers[0].in_flight = 5;
  workers[1].in_flight = 2;
  workers[2].in_flight = 7;
  workers[3].in_flight = 3;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(MustPick(*policy, workers), 1u);
  workers[1].healthy = false;
  EXPECT_EQ(MustPick(*policy, workers), 3u);
}

TEST(LeastRequestTest, TiesRotate) {
  auto policy = Make("least_request");
  auto workers = Workers(4);
  workers[0].in_flight = 1;
  workers[1].in_flight = 1;
  workers[2].in_flight = 4;
  workers[3].in_flight = 1;
  std::map<size_t, int> counts;
  for (int i = 0; i < 30; ++i) ++counts[MustPick(*policy, workers)];
  EXPECT_THAT(counts, ::testing::ElementsAre(::testing::Pair(0, 10), ::testing::Pair(1, 10), ::testing::Pair(3, 10)));
}

TEST(LeastRequestTest, IdleClusterFillsEvenlyWhenCountsFollowPicks) {
  auto policy = Make("least_request");
  auto workers = Workers(4);
  for (int i = 0; i < 40; ++i) ++workers[MustPick(*policy, workers)].in_flight;
  for (const auto& w : workers) EXPECT_EQ(w.in_flight, 10);
}

// ---- power_of_two --------------------------------------------------------

TEST(PowerOfTwoTest, NeverPicksTheMostLoadedAndFavoursTheLeast) {
  auto policy = Make("power_of_two", {{"seed", "1"}});
  auto workers = Workers(4);
  for (int i = 0; i < 4; ++i) workers[i].in_flight = i;
  std::vector<int> counts(4, 0);
  constexpr int kPicks = 60000;
  for (int i = 0; i < kPicks; ++i) ++counts[MustPick(*policy, workers)];
  // Worker i wins every pair it forms with a more loaded one: 3, 2, 1, 0 of
  // the 6 pairs, so 1/2, 1/3, 1/6 and 0 of the picks.
  EXPECT_EQ(counts[3], 0);
  EXPECT_NEAR(counts[0], kPicks / 2, kPicks / 50);
  EXPECT_NEAR(counts[1], kPicks / 3, kPicks / 50);
  EXPECT_NEAR(counts[2], kPicks / 6, kPicks / 50);
}

TEST(PowerOfTwoTest, EqualLoadIsUniformAndSingleWorkerIsPicked) {
  auto policy = Make("power_of_two", {{"seed", "2"}});
  auto workers = Workers(4);
  std::vector<int> counts(4, 0);
  for (int i = 0; i < 40000; ++i) ++counts[MustPick(*policy, workers)];
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);

  workers[0].healthy = workers[1].healthy = workers[3].healthy = false;
  EXPECT_EQ(MustPick(*policy, workers), 2u);
}

// ---- prefix_aware --------------------------------------------------------

TEST(PrefixAwareTest, SamePrefixSameWorker) {
  auto policy = Make("prefix_aware", {{"prefix_tokens", "16"}});
  auto workers = Workers(8);
  std::mt19937_64 rng(3);
  std::vector<int> hits(8, 0);
  for (int i = 0; i < 200; ++i) {
    auto prompt = RandomPrompt(rng, 40);
    const size_t first = MustPick(*policy, workers, RouteRequest{.tokens = prompt});
    ++hits[first];
    // Same first 16 tokens, different tail: same worker.
    for (size_t t = 16; t < prompt.size(); ++t) prompt[t] = static_cast<int32_t>(rng() % 100);
    EXPECT_EQ(MustPick(*policy, workers, RouteRequest{.tokens = prompt}), first);
  }
  // Different prefixes spread out: every worker owns some keys.
  for (int h : hits) EXPECT_GT(h, 0);
  auto* prefix = dynamic_cast<PrefixAwarePolicy*>(policy.get());
  ASSERT_NE(prefix, nullptr);
  EXPECT_EQ(prefix->spillovers(), 0u);
  EXPECT_EQ(prefix->ring_builds(), 1u);
}

TEST(PrefixAwareTest, SpillsOverWhenOwnerIsOverTheBound) {
  PrefixAwarePolicy policy(PrefixAwarePolicy::Options{});
  auto workers = Workers(4);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  const RouteRequest req{.tokens = prompt};
  const size_t owner = MustPick(policy, workers, req);

  // 4 in flight in total, on the owner: bound 1.25 * 5 / 4 = 1.56 < 4.
  workers[owner].in_flight = 4;
  const size_t spilled = MustPick(policy, workers, req);
  EXPECT_NE(spilled, owner);
  EXPECT_EQ(policy.spillovers(), 1u);
  // The spill target is stable: the next worker along the ring.
  EXPECT_EQ(MustPick(policy, workers, req), spilled);

  // Under the bound again (load spread evenly: 2 each, bound 2.8): back to the owner.
  for (auto& w : workers) w.in_flight = 2;
  EXPECT_EQ(MustPick(policy, workers, req), owner);
  EXPECT_EQ(policy.spillovers(), 2u);
}

TEST(PrefixAwareTest, FillingWithOnePrefixStaysWithinTheBound) {
  PrefixAwarePolicy policy(PrefixAwarePolicy::Options{});
  auto workers = Workers(4);
  const std::vector<int32_t> prompt = {9, 9, 9};
  for (int i = 0; i < 400; ++i) {
    ++workers[MustPick(policy, workers, RouteRequest{.tokens = prompt})].in_flight;
  }
  // With 400 in flight the bound is 1.25 * 100 = 125 per worker.
  for (const auto& w : workers) EXPECT_LE(w.in_flight, 126) << w.id;
}

TEST(PrefixAwareTest, UnhealthyOwnerMovesOnlyItsKeys) {
  PrefixAwarePolicy policy(PrefixAwarePolicy::Options{});
  auto workers = Workers(5);
  std::mt19937_64 rng(11);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<size_t> before;
  for (int i = 0; i < 1000; ++i) {
    prompts.push_back(RandomPrompt(rng, 30));
    before.push_back(MustPick(policy, workers, RouteRequest{.tokens = prompts.back()}));
  }
  workers[2].healthy = false;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const size_t after = MustPick(policy, workers, RouteRequest{.tokens = prompts[i]});
    if (before[i] != 2) {
      EXPECT_EQ(after, before[i]);
    }
    EXPECT_NE(after, 2u);
  }
}

TEST(PrefixAwareTest, AddingOrRemovingAWorkerMovesAboutOneNth) {
  PrefixAwarePolicy policy(PrefixAwarePolicy::Options{});
  auto workers = Workers(10);
  std::mt19937_64 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> before;
  constexpr int kPrompts = 2000;
  for (int i = 0; i < kPrompts; ++i) {
    prompts.push_back(RandomPrompt(rng, 300));
    before.push_back(workers[MustPick(policy, workers, RouteRequest{.tokens = prompts.back()})].id);
  }

  // Add an 11th worker: only keys it takes move, ~1/11 = 9%.
  auto grown = workers;
  grown.push_back(WorkerView{.id = "10.0.0.10:7000"});
  int moved = 0;
  for (int i = 0; i < kPrompts; ++i) {
    const std::string& after = grown[MustPick(policy, grown, RouteRequest{.tokens = prompts[i]})].id;
    if (after != before[i]) {
      ++moved;
      EXPECT_EQ(after, grown.back().id);
    }
  }
  EXPECT_GT(moved, kPrompts * 4 / 100);
  EXPECT_LT(moved, kPrompts * 16 / 100);

  // Remove worker 3 of the original 10: only its keys move, ~1/10.
  auto shrunk = workers;
  shrunk.erase(shrunk.begin() + 3);
  moved = 0;
  for (int i = 0; i < kPrompts; ++i) {
    const std::string& after = shrunk[MustPick(policy, shrunk, RouteRequest{.tokens = prompts[i]})].id;
    if (after != before[i]) {
      ++moved;
      EXPECT_EQ(before[i], workers[3].id);
    }
  }
  EXPECT_GT(moved, kPrompts * 4 / 100);
  EXPECT_LT(moved, kPrompts * 16 / 100);
  EXPECT_EQ(policy.ring_builds(), 3u);
}

TEST(PrefixAwareTest, ReorderedSnapshotMapsKeysToTheSameIds) {
  PrefixAwarePolicy policy(PrefixAwarePolicy::Options{});
  auto workers = Workers(6);
  auto reversed = std::vector<WorkerView>(workers.rbegin(), workers.rend());
  std::mt19937_64 rng(8);
  for (int i = 0; i < 200; ++i) {
    const auto prompt = RandomPrompt(rng, 10);
    const RouteRequest req{.tokens = prompt};
    EXPECT_EQ(workers[MustPick(policy, workers, req)].id, reversed[MustPick(policy, reversed, req)].id);
  }
}

// ---- sticky_session ------------------------------------------------------

struct FakeClock {
  std::chrono::steady_clock::time_point now{};
  StickySessionPolicy::Clock fn() {
    return [this] { return now; };
  }
};

TEST(StickySessionTest, SessionsStayPinnedAndSpread) {
  FakeClock clock;
  StickySessionPolicy policy(StickySessionPolicy::Options{}, clock.fn());
  auto workers = Workers(3);
  std::map<std::string, size_t> pinned;
  std::vector<int> per_worker(3, 0);
  for (int s = 0; s < 9; ++s) {
    const std::string id = absl::StrCat("session-", s);
    pinned[id] = MustPick(policy, workers, RouteRequest{.session_id = id});
    ++per_worker[pinned[id]];
  }
  for (int n : per_worker) EXPECT_EQ(n, 3);
  for (int round = 0; round < 3; ++round) {
    for (const auto& [id, worker] : pinned) {
      EXPECT_EQ(MustPick(policy, workers, RouteRequest{.session_id = id}), worker);
    }
  }
  EXPECT_EQ(policy.sessions(), 9u);
  EXPECT_EQ(policy.repins(), 0u);
}

TEST(StickySessionTest, NoSessionIdIsRoundRobinAndPinsNothing) {
  FakeClock clock;
  StickySessionPolicy policy(StickySessionPolicy::Options{}, clock.fn());
  auto workers = Workers(3);
  std::vector<size_t> picks;
  for (int i = 0; i < 6; ++i) picks.push_back(MustPick(policy, workers));
  EXPECT_THAT(picks, ::testing::ElementsAre(0, 1, 2, 0, 1, 2));
  EXPECT_EQ(policy.sessions(), 0u);
}

TEST(StickySessionTest, IdlePinExpiresAfterTtl) {
  FakeClock clock;
  StickySessionPolicy policy(StickySessionPolicy::Options{.ttl = std::chrono::seconds(60)}, clock.fn());
  auto workers = Workers(2);
  const RouteRequest a{.session_id = "a"};
  const size_t first = MustPick(policy, workers, a);  // round robin: worker 0

  // Used within the TTL: the idle clock restarts each time.
  for (int i = 0; i < 5; ++i) {
    clock.now += std::chrono::seconds(50);
    EXPECT_EQ(MustPick(policy, workers, a), first);
  }
  // Idle past the TTL: the pin is gone, the session is placed anew (round
  // robin's next turn, the other worker) and that is not a re-pin.
  clock.now += std::chrono::seconds(61);
  EXPECT_EQ(MustPick(policy, workers, RouteRequest{.session_id = "b"}), 1 - first);
  EXPECT_EQ(policy.sessions(), 1u);  // "a" expired, "b" pinned
  EXPECT_EQ(MustPick(policy, workers, a), first);
  EXPECT_EQ(policy.repins(), 0u);
}

TEST(StickySessionTest, TableIsBoundedWithLruEviction) {
  FakeClock clock;
  StickySessionPolicy policy(StickySessionPolicy::Options{.max_sessions = 3}, clock.fn());
  auto workers = Workers(3);
  auto pick = [&](const std::string& s) {
    clock.now += std::chrono::seconds(1);
    return MustPick(policy, workers, RouteRequest{.session_id = s});
  };
  const size_t a = pick("a");  // worker 0
  pick("b");                   // worker 1
  pick("c");                   // worker 2
  EXPECT_EQ(pick("a"), a);     // "a" is now the most recent; "b" the least
  pick("d");                   // evicts "b"; placed on worker 0
  EXPECT_EQ(policy.sessions(), 3u);
  EXPECT_EQ(policy.evictions(), 1u);
  EXPECT_EQ(pick("a"), a);
  // "b" was forgotten: placed anew, round robin's next turn (worker 1),
  // evicting "c", the least recently used now.
  EXPECT_EQ(pick("b"), 1u);
  EXPECT_EQ(policy.evictions(), 2u);
  EXPECT_EQ(pick("c"), 2u);  // placed anew too
  EXPECT_EQ(policy.repins(), 0u);
}

TEST(StickySessionTest, RepinsWhenPinnedWorkerIsLostOrUnhealthy) {
  FakeClock clock;
  StickySessionPolicy policy(StickySessionPolicy::Options{}, clock.fn());
  auto workers = Workers(3);
  const RouteRequest req{.session_id = "chat-1"};
  const size_t first = MustPick(policy, workers, req);

  workers[first].healthy = false;
  const size_t second = MustPick(policy, workers, req);
  EXPECT_NE(second, first);
  EXPECT_EQ(policy.repins(), 1u);
  // Stays on the new worker, even after the old one recovers.
  workers[first].healthy = true;
  EXPECT_EQ(MustPick(policy, workers, req), second);
  EXPECT_EQ(policy.repins(), 1u);

  // The new worker leaves the snapshot altogether.
  const std::string gone = workers[second].id;
  workers.erase(workers.begin() + second);
  const size_t third = MustPick(policy, workers, req);
  EXPECT_NE(workers[third].id, gone);
  EXPECT_EQ(policy.repins(), 2u);
  EXPECT_EQ(MustPick(policy, workers, req), third);
}

}  // namespace
}  // namespace tandem::router
