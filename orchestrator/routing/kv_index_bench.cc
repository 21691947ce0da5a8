// KvIndex at scale (Google Benchmark): 1,000 workers holding 10 million
// (block, worker) entries under a 10-million-entry cap, as a large
// kv_cache_aware deployment would feed it. Measures the router-side costs:
//   - Match of an 8k-token request (512 blocks) whose document a few
//     workers hold, and of a cold one (512 misses);
//   - Apply of a 64-event BlockStored batch at the cap (each insertion
//     evicts the least recently used entry);
// and reports the index's memory per entry (process RSS growth while it was
// filled) and that the cap holds.
//
//   build/orchestrator/routing/kv_index_bench [--benchmark_filter=...]
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "orchestrator/routing/kv_index.h"

namespace tandem::router {
namespace {

constexpr int kWorkers = 1000;
constexpr int kBlocksPerWorker = 10000;  // 1,000 x 10,000 = 10M entries
constexpr int kDocBlocks = 512;          // an 8k-token document at 16 tokens per block
constexpr int kDocs = 4000;              // each held by ~5 workers (1000 x 20 docs / 4000)
constexpr size_t kCap = 10'000'000;

int64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// Block k of document d: distinct 64-bit values (a chained hash in real use).
uint64_t BlockHash(int doc, int k) {
  uint64_t x = (static_cast<uint64_t>(doc) << 20 | static_cast<uint64_t>(k)) + 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

// Worker w's id, as a router would know it.
std::string WorkerId(int w) { return absl::StrCat("10.0.", w / 250, ".", w % 250, ":50051"); }

// Worker w's next events (from *seq on): blocks 0..blocks-1 of `doc` stored.
tandem::v1::KvEventBatch StoredBatch(int w, uint64_t* seq, int doc, int blocks) {
  tandem::v1::KvEventBatch batch;
  batch.set_instance_id(WorkerId(w));
  for (int k = 0; k < blocks; ++k) {
    auto* e = batch.add_events();
    e->set_seq((*seq)++);
    e->mutable_stored()->set_block_hash(BlockHash(doc, k));
  }
  return batch;
}

struct Fixture {
  std::unique_ptr<KvIndex> index;
  std::vector<uint64_t> seq;  // next event seq per worker
  int64_t rss_growth = 0;
  double fill_seconds = 0;
  size_t entries = 0;
};

Fixture& Shared() {
  static Fixture* f = [] {
    auto* fx = new Fixture();
    fx->index = std::make_unique<KvIndex>(KvIndex::Options{.max_blocks = kCap});
    fx->seq.assign(kWorkers, 1);
    const int64_t rss0 = RssBytes();
    const auto t0 = std::chrono::steady_clock::now();
    std::mt19937_64 rng(1);
    std::uniform_int_distribution<int> pick_doc(0, kDocs - 1);
    for (int w = 0; w < kWorkers; ++w) {
      // The worker's cache: ~20 documents of 512 blocks, fed as one event
      // batch per document (seq from 1: a fresh worker's whole log).
      for (int held = 0; held < kBlocksPerWorker;) {
        const int blocks = std::min(kDocBlocks, kBlocksPerWorker - held);
        CHECK(fx->index->Apply(WorkerId(w), StoredBatch(w, &fx->seq[w], pick_doc(rng), blocks)).ok());
        held += blocks;
      }
    }
    fx->fill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fx->rss_growth = RssBytes() - rss0;
    fx->entries = fx->index->size();
    return fx;
  }();
  return *f;
}

std::vector<uint64_t> Doc(int doc) {
  std::vector<uint64_t> h(kDocBlocks);
  for (int k = 0; k < kDocBlocks; ++k) h[k] = BlockHash(doc, k);
  return h;
}

void Report(benchmark::State& state) {
  const Fixture& f = Shared();
  state.counters["entries"] = static_cast<double>(f.entries);
  state.counters["cap"] = static_cast<double>(kCap);
  state.counters["bytes_per_entry"] =
      static_cast<double>(f.rss_growth) / static_cast<double>(std::max<size_t>(1, f.entries));
  state.counters["index_MiB"] = static_cast<double>(f.rss_growth) / (1 << 20);
  state.counters["fill_s"] = f.fill_seconds;
}

// Matches the requests in turn; reports the holders found per match.
void MatchInTurn(benchmark::State& state, const std::vector<std::vector<uint64_t>>& requests) {
  Fixture& f = Shared();
  size_t i = 0;
  int64_t holders = 0;
  for (auto _ : state) {
    std::vector<KvIndex::Overlap> o = f.index->Match(requests[i++ % requests.size()], std::chrono::steady_clock::now());
    holders += static_cast<int64_t>(o.size());
    benchmark::DoNotOptimize(o);
  }
  state.counters["holders_per_match"] =
      static_cast<double>(holders) / static_cast<double>(std::max<int64_t>(1, state.iterations()));
  Report(state);
}

void BM_MatchHeldDocument(benchmark::State& state) {
  std::vector<std::vector<uint64_t>> docs;
  for (int d = 0; d < 64; ++d) docs.push_back(Doc(d * 37 % kDocs));
  MatchInTurn(state, docs);
}
BENCHMARK(BM_MatchHeldDocument);

void BM_MatchColdRequest(benchmark::State& state) {
  Fixture& f = Shared();
  std::vector<uint64_t> cold = Doc(kDocs + 12345);
  for (auto _ : state) {
    benchmark::DoNotOptimize(f.index->Match(cold, std::chrono::steady_clock::now()));
  }
  Report(state);
}
BENCHMARK(BM_MatchColdRequest);

// A 1k-token system prompt (64 blocks) that every one of the 1,000 workers
// holds, then 448 blocks of the request's own (cold): the worst case of a
// per-block holder scan, 64,000 holders read.
void BM_MatchPromptHeldByAllWorkers(benchmark::State& state) {
  Fixture& f = Shared();
  static const bool filled = [&f] {
    for (int w = 0; w < kWorkers; ++w) {
      CHECK(f.index->Apply(WorkerId(w), StoredBatch(w, &f.seq[w], kDocs + 7, 64)).ok());
    }
    return true;
  }();
  (void)filled;
  std::vector<uint64_t> request = Doc(kDocs + 7);
  for (int k = 64; k < kDocBlocks; ++k) request[k] = BlockHash(kDocs + 8, k);
  MatchInTurn(state, {request});
}
BENCHMARK(BM_MatchPromptHeldByAllWorkers);

// 64 new blocks stored on one worker: at the cap, each evicts an entry.
void BM_ApplyStoredBatchAtCap(benchmark::State& state) {
  Fixture& f = Shared();
  uint64_t next_doc = kDocs + 100000;
  int w = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const std::string id = WorkerId(w);
    const tandem::v1::KvEventBatch batch = StoredBatch(w, &f.seq[w], static_cast<int>(next_doc++), 64);
    state.ResumeTiming();
    CHECK(f.index->Apply(id, batch).ok());
    w = (w + 1) % kWorkers;
  }
  state.SetItemsProcessed(state.iterations() * 64);
  // The cap holds after every insertion.
  CHECK(f.index->size() <= kCap) << f.index->size();
  Report(state);
}
BENCHMARK(BM_ApplyStoredBatchAtCap);

}  // namespace
}  // namespace tandem::router

BENCHMARK_MAIN();
