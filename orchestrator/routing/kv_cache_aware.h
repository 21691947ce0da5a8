// kv_cache_aware: routes a request to the worker that already holds the
// longest prefix of its KV blocks, weighed against that worker's load.
//
// The policy hashes the prompt into chained block hashes (HashBlocks with
// `block_hash_seed` and `block_size`, which the router sets from ModelInfo),
// asks a KvIndex how many leading blocks each worker holds, and scores each
// healthy worker i:
//
//   overlap_i = matched_blocks_i / request_blocks       (0 if the prompt has no full block)
//   prefill_i = min(1, prefill_tokens_in_flight_i / scale_i)
//   usage_i   = clamp(used_blocks_i / total_blocks_i, 0, 1)  (0 if total_blocks_i <= 0)
//   load_i    = (prefill_i + usage_i) / 2                 (in [0, 1])
//   score_i   = overlap_weight * overlap_i - load_weight * load_i
//
// scale_i is the worker's own step budget, the prompt tokens one engine step
// computes (ModelInfo.max_batched_tokens, vLLM's max_num_batched_tokens): a
// worker that far behind adds about one step of queueing, whatever its
// speed. `prefill_tokens_scale` sets one scale for every worker instead; a
// worker that reports no budget gets 8192 (a GPU engine's usual one). One
// constant does not fit every worker: a CPU worker's 2048-token step takes
// ~2 s, and at 8192 a backlog of 2048 tokens counted as a quarter of a load
// that an overlap outweighed, so sessions piled onto one worker.
//
// Defaults: overlap_weight 1, load_weight 1. With equal weights a worker
// holding the whole prompt (+1) beats an idle worker unless it is fully
// loaded on both terms; one holding half of it ties with an idle worker at
// load 0.5; a 1-in-32 block hit (+0.031) loses to a worker with more than
// scale / 16 fewer prefill tokens in flight (128 of 2048). llm-d's scorers
// have the same shape (prefix-cache-scorer = matched/total plus weighted load
// scorers); Dynamo's cost instead credits matched blocks against prefill.
//
// prefill_tokens_in_flight counts what the router expects each worker to
// compute: the prompts it sent there, less the prefix this policy expected
// the worker to hold (RouteRequest::cached_tokens), until their first
// token. A fully cached history does not count as a backlog.
//
// Bounded load (`load_factor`, default 1.25, as in prefix_aware): a worker
// is a candidate only if its in_flight <= load_factor * (T + 1) / h, with T
// the requests in flight on the h healthy workers (the least loaded worker
// always is), or if it caches at least `keep_prefix_tokens` more of the
// prompt than every worker within the bound (default: its step budget).
// Without a bound, a prefix every session shares (one application's system
// prompt) that only one worker holds scores there as a large overlap against
// an idle worker: that worker takes new sessions until its load term
// outweighs the overlap, their later turns stay for their histories, and on
// two CPU workers four sessions piled onto one while the other idled (TTFT
// p90 1.1 s). On two workers the bound lets one take a second request while
// the other has none, not a third. The exemption keeps what the bound would
// waste: recomputing a prefix shorter than one step elsewhere costs at most
// about one engine step, about what waiting behind one more request costs;
// a longer one costs more than the queueing the bound avoids. With ~1
// request in flight per worker (8 simulated workers, 4k-token shared
// prefixes), the bound alone sent a holder's second concurrent request
// elsewhere (hit rate 88% -> 71%); with the exemption it keeps it. A large
// load_factor (1e9) turns the bound off.
//
// temperature 0 (default): the highest score wins, ties (within 1e-9) taken
// in turn, so cold requests to an idle cluster spread round robin.
// temperature T > 0: worker i is drawn with probability proportional to
// exp(score_i / T) (Dynamo's --router-temperature); scores lie in about
// [-1, 1], so T = 0.1 is still sharp and T = 1 is close to uniform.
//
// After a pick the request's blocks are recorded for the chosen worker
// (KvIndex::RecordRouted, which ignores workers in exact mode), so workers
// without a KV event stream are tracked approximately, with a TTL.
//
// The index is shared with the router, which feeds it the workers' KV event
// streams: construct the policy with the router's index. Created from the
// registry, the policy makes its own index from `max_blocks` and `ttl_s`.
//
// Parameters: `block_hash_seed` (uint64, default 0), `block_size` (default
// 16), `overlap_weight` (>= 0, default 1), `load_weight` (>= 0, default 1),
// `prefill_tokens_scale` (>= 1; default: each worker's step budget),
// `load_factor` (>= 1, default 1.25), `keep_prefix_tokens` (>= 1; default:
// each worker's step budget), `temperature` (>= 0, default 0),
// `seed` (uint64, the sampling generator's;
// random if absent), `max_blocks` (default 2^20) and `ttl_s` (integer
// seconds, default 120) for the index.
//
// Thread safety: Pick hashes the prompt and scores without a lock; it takes
// the index's mutex for Match and RecordRouted, and a mutex around the
// generator when temperature > 0.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_KV_CACHE_AWARE_H_
#define TANDEM_ORCHESTRATOR_ROUTING_KV_CACHE_AWARE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "orchestrator/routing/kv_index.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class KvCacheAwarePolicy : public RoutingPolicy {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  struct Options {
    uint64_t block_hash_seed = 0;  // ModelInfo.block_hash_seed
    int block_size = 16;           // ModelInfo.block_size
    double overlap_weight = 1.0;   // weight of the cached fraction of the prompt
    double load_weight = 1.0;      // weight of the normalized load
    // Prefill backlog that counts as fully loaded; 0: each worker's step
    // budget (WorkerView::prefill_tokens_per_step), else kDefaultPrefillScale.
    int64_t prefill_tokens_scale = 0;
    double load_factor = 1.25;  // in_flight bound (inf: none)
    // A worker over the bound still takes a request whose prompt it caches
    // this many tokens beyond every worker within the bound; 0: its step
    // budget (StepBudget: prefill_tokens_scale when set).
    int64_t keep_prefix_tokens = 0;
    double temperature = 0.0;  // 0: argmax; > 0: softmax sampling
    uint64_t seed = 0;         // sampling generator's seed
  };

  // The scale for a worker that reports no step budget.
  static constexpr int64_t kDefaultPrefillScale = 8192;

  // Block size and hash seed from `context` (the workers'); the rest from
  // `params`.
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params,
                                                               const PolicyContext& context);
  // `now` is the time source for the index's TTLs (tests inject a fake one).
  // REQUIRES: index != nullptr, options.block_size >= 1,
  // options.prefill_tokens_scale >= 0, options.load_factor >= 1.
  KvCacheAwarePolicy(Options options, std::shared_ptr<KvIndex> index, Clock now = SteadyNow);

  std::string name() const override { return "kv_cache_aware"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

  // Each healthy worker's score for this request as Pick computes it
  // (unhealthy ones: -infinity). Does not record anything. For tests and
  // debugging endpoints.
  std::vector<double> Scores(const RouteRequest& req, std::span<const WorkerView> workers);

  const std::shared_ptr<KvIndex>& index() const { return index_; }
  std::shared_ptr<KvIndex> kv_index() const override { return index_; }

  // Full prompt blocks seen, and how many of them the chosen worker held:
  // their ratio is the predicted prefix hit rate.
  uint64_t requested_blocks() const { return requested_blocks_.load(std::memory_order_relaxed); }
  uint64_t matched_blocks() const { return matched_blocks_.load(std::memory_order_relaxed); }
  // Picks that passed over the best-scoring worker because it was over the
  // load bound.
  uint64_t spillovers() const { return spillovers_.load(std::memory_order_relaxed); }
  // "requested_blocks", "matched_blocks" and "spillovers".
  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    return {
        {"requested_blocks", requested_blocks()}, {"matched_blocks", matched_blocks()}, {"spillovers", spillovers()}};
  }

 private:
  static std::chrono::steady_clock::time_point SteadyNow() { return std::chrono::steady_clock::now(); }

  struct Scored {
    std::vector<double> scores;    // per worker; -inf for unhealthy
    std::vector<int64_t> matched;  // per worker
    std::vector<uint64_t> hashes;  // the request's block hashes
  };
  // The prompt tokens one engine step of `w` computes (prefill_tokens_scale
  // overrides; kDefaultPrefillScale when it reports none).
  int64_t StepBudget(const WorkerView& w) const;
  Scored Score(const RouteRequest& req, std::span<const WorkerView> workers, std::chrono::steady_clock::time_point now);

  const Options options_;
  const std::shared_ptr<KvIndex> index_;
  const Clock now_;
  std::atomic<uint64_t> cursor_{0};  // turn among tied workers
  std::mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> requested_blocks_{0};
  std::atomic<uint64_t> matched_blocks_{0};
  std::atomic<uint64_t> spillovers_{0};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_KV_CACHE_AWARE_H_
