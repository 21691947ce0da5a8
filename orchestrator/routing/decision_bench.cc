// The routing decision's own cost (Google Benchmark): kv_cache_aware's Pick
// for an 8k-token prompt (512 blocks of 16 tokens) on a small cluster whose
// workers feed the index exact KV events, as `tandem up` runs it. This is
// the CPU the decision takes with nothing else on the core; the router's
// tandem_router_routing_decision_seconds histogram adds whatever the
// machine's scheduling adds (scripts/bench_overhead.sh reads that one).
//
//   build/orchestrator/routing/decision_bench
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "common/logging.h"
#include "orchestrator/routing/kv_cache_aware.h"

namespace tandem::router {
namespace {

constexpr int kPromptTokens = 8192;
constexpr int kBlock = 16;

std::vector<int32_t> RandomTokens(std::mt19937& rng, int n) {
  std::uniform_int_distribution<int32_t> tok(0, 32000);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = tok(rng);
  return t;
}

// `workers` workers, each holding `docs_per_worker` 8k-token prompts (exact,
// from its event stream); the requests are prompts some worker holds.
struct Cluster {
  std::shared_ptr<KvIndex> index = std::make_shared<KvIndex>(KvIndex::Options{});
  std::unique_ptr<KvCacheAwarePolicy> policy;
  std::vector<WorkerView> views;
  std::vector<std::vector<int32_t>> prompts;

  Cluster(int workers, int docs_per_worker) {
    policy = std::make_unique<KvCacheAwarePolicy>(KvCacheAwarePolicy::Options{.block_size = kBlock}, index);
    std::mt19937 rng(1);
    for (int w = 0; w < workers; ++w) {
      const std::string id = absl::StrCat("10.0.0.", w, ":50051");
      views.push_back(WorkerView{.id = id, .total_blocks = 1 << 16, .healthy = true});
      tandem::v1::KvEventBatch batch;
      batch.set_instance_id(id);
      uint64_t seq = 1;
      for (int d = 0; d < docs_per_worker; ++d) {
        prompts.push_back(RandomTokens(rng, kPromptTokens));
        for (uint64_t h : HashBlocks(0, prompts.back(), kBlock)) {
          auto* e = batch.add_events();
          e->set_seq(seq++);
          e->mutable_stored()->set_block_hash(h);
        }
      }
      CHECK(index->Apply(id, batch).ok());
    }
  }
};

void PickInTurn(benchmark::State& state, Cluster& c) {
  size_t i = 0;
  for (auto _ : state) {
    RouteRequest rr{.tokens = c.prompts[i++ % c.prompts.size()]};
    benchmark::DoNotOptimize(c.policy->Pick(rr, c.views));
  }
}

// The pieces of a decision: hashing the prompt, then the index lookup.
void BM_HashBlocks8k(benchmark::State& state) {
  std::mt19937 rng(2);
  const std::vector<int32_t> prompt = RandomTokens(rng, kPromptTokens);
  for (auto _ : state) benchmark::DoNotOptimize(HashBlocks(0, prompt, kBlock));
}
BENCHMARK(BM_HashBlocks8k);

void BM_Match8kHeld(benchmark::State& state) {
  static Cluster c(8, 16);
  std::vector<std::vector<uint64_t>> hashes;
  for (const auto& p : c.prompts) hashes.push_back(HashBlocks(0, p, kBlock));
  size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(c.index->Match(hashes[i++ % hashes.size()], std::chrono::steady_clock::now()));
  }
}
BENCHMARK(BM_Match8kHeld);

// Whole decisions: 1 worker (tandem up --aggregated 1) and 8 workers.
void BM_Pick8k_1Worker(benchmark::State& state) {
  static Cluster c(1, 64);
  PickInTurn(state, c);
}
BENCHMARK(BM_Pick8k_1Worker);

void BM_Pick8k_8Workers(benchmark::State& state) {
  static Cluster c(8, 16);
  PickInTurn(state, c);
}
BENCHMARK(BM_Pick8k_8Workers);

}  // namespace
}  // namespace tandem::router

BENCHMARK_MAIN();
