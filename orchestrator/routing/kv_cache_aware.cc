#include "orchestrator/routing/kv_cache_aware.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_hash.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {
namespace {

constexpr double kTieEpsilon = 1e-9;

}  // namespace

absl::StatusOr<std::unique_ptr<RoutingPolicy>> KvCacheAwarePolicy::Create(const PolicyParams& params,
                                                                          const PolicyContext& context) {
  routing_internal::ParamReader reader("kv_cache_aware", params);
  Options options;
  options.seed = std::random_device{}();
  if (context.block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_cache_aware: the workers' block size ", context.block_size, " is not >= 1"));
  }
  options.block_size = context.block_size;
  options.block_hash_seed = context.block_hash_seed;
  KvIndex::Options index_options;
  int64_t ttl_s = std::chrono::duration_cast<std::chrono::seconds>(index_options.ttl).count();
  RETURN_IF_ERROR(reader.Double("overlap_weight", 0.0, &options.overlap_weight));
  RETURN_IF_ERROR(reader.Double("load_weight", 0.0, &options.load_weight));
  RETURN_IF_ERROR(reader.Int64("prefill_tokens_scale", 1, int64_t{1} << 40, &options.prefill_tokens_scale));
  RETURN_IF_ERROR(reader.Double("load_factor", 1.0, &options.load_factor));
  RETURN_IF_ERROR(reader.Int64("keep_prefix_tokens", 1, int64_t{1} << 40, &options.keep_prefix_tokens));
  RETURN_IF_ERROR(reader.Double("temperature", 0.0, &options.temperature));
  RETURN_IF_ERROR(reader.Uint64("seed", &options.seed));
  RETURN_IF_ERROR(reader.Int64("max_blocks", 1, int64_t{1} << 31, &index_options.max_blocks));
  RETURN_IF_ERROR(reader.Int64("ttl_s", 1, int64_t{365} * 24 * 3600, &ttl_s));
  RETURN_IF_ERROR(reader.Finish());
  index_options.ttl = std::chrono::seconds(ttl_s);
  return std::make_unique<KvCacheAwarePolicy>(options, std::make_shared<KvIndex>(index_options));
}

KvCacheAwarePolicy::KvCacheAwarePolicy(Options options, std::shared_ptr<KvIndex> index, Clock now)
    : options_(options), index_(std::move(index)), now_(std::move(now)), rng_(options.seed) {
  CHECK(index_ != nullptr) << "kv_cache_aware: null KvIndex";
  CHECK(options_.block_size >= 1) << "kv_cache_aware: block_size " << options_.block_size;
  CHECK(options_.prefill_tokens_scale >= 0) << "kv_cache_aware: prefill_tokens_scale";
  CHECK(options_.load_factor >= 1.0) << "kv_cache_aware: load_factor " << options_.load_factor;
  CHECK(options_.keep_prefix_tokens >= 0) << "kv_cache_aware: keep_prefix_tokens";
}

int64_t KvCacheAwarePolicy::StepBudget(const WorkerView& w) const {
  return options_.prefill_tokens_scale > 0 ? options_.prefill_tokens_scale
         : w.prefill_tokens_per_step > 0   ? w.prefill_tokens_per_step
                                           : kDefaultPrefillScale;
}

KvCacheAwarePolicy::Scored KvCacheAwarePolicy::Score(const RouteRequest& req, std::span<const WorkerView> workers,
                                                     std::chrono::steady_clock::time_point now) {
  Scored out;
  out.hashes = HashBlocks(options_.block_hash_seed, req.tokens, options_.block_size);
  out.matched.assign(workers.size(), 0);
  if (!out.hashes.empty()) {
    const std::vector<KvIndex::Overlap> overlaps = index_->Match(out.hashes, now);
    if (!overlaps.empty()) {
      absl::flat_hash_map<std::string, int64_t> by_id;
      for (const KvIndex::Overlap& o : overlaps) by_id.emplace(o.worker_id, o.matched_blocks);
      for (size_t i = 0; i < workers.size(); ++i) {
        auto it = by_id.find(workers[i].id);
        if (it != by_id.end()) out.matched[i] = it->second;
      }
    }
  }
  const double request_blocks = static_cast<double>(out.hashes.size());
  out.scores.assign(workers.size(), -std::numeric_limits<double>::infinity());
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerView& w = workers[i];
    if (!w.healthy) continue;
    const int64_t scale = StepBudget(w);
    const double overlap = request_blocks > 0 ? static_cast<double>(out.matched[i]) / request_blocks : 0.0;
    const double prefill =
        std::clamp(static_cast<double>(w.prefill_tokens_in_flight) / static_cast<double>(scale), 0.0, 1.0);
    const double usage =
        w.total_blocks > 0
            ? std::clamp(static_cast<double>(w.used_blocks) / static_cast<double>(w.total_blocks), 0.0, 1.0)
            : 0.0;
    const double load = 0.5 * (prefill + usage);
    out.scores[i] = options_.overlap_weight * overlap - options_.load_weight * load;
  }
  return out;
}

std::vector<double> KvCacheAwarePolicy::Scores(const RouteRequest& req, std::span<const WorkerView> workers) {
  return Score(req, workers, now_()).scores;
}

absl::StatusOr<size_t> KvCacheAwarePolicy::Pick(const RouteRequest& req, std::span<const WorkerView> workers) {
  if (routing_internal::CountHealthy(workers) == 0) {
    return routing_internal::NoHealthyWorker(name(), workers.size());
  }
  const auto now = now_();
  const Scored scored = Score(req, workers, now);

  // Candidates: healthy workers within the load bound (there is always one).
  const double bound = routing_internal::LoadBound(workers, options_.load_factor);
  std::vector<bool> candidate(workers.size());
  int64_t within_matched = 0;  // the longest prefix a worker within the bound holds
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].healthy) continue;
    candidate[i] = workers[i].in_flight <= bound;
    if (candidate[i]) within_matched = std::max(within_matched, scored.matched[i]);
  }
  // An over-bound worker stays a candidate when the prefix it caches beyond
  // every worker within the bound would take a step or more to recompute
  // there: more than the queueing the bound avoids.
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].healthy || candidate[i]) continue;
    const int64_t keep = options_.keep_prefix_tokens > 0 ? options_.keep_prefix_tokens : StepBudget(workers[i]);
    candidate[i] = (scored.matched[i] - within_matched) * options_.block_size >= keep;
  }
  double best = -std::numeric_limits<double>::infinity();
  double best_healthy = best;
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].healthy) continue;
    best_healthy = std::max(best_healthy, scored.scores[i]);
    if (candidate[i]) best = std::max(best, scored.scores[i]);
  }
  if (best < best_healthy - kTieEpsilon) spillovers_.fetch_add(1, std::memory_order_relaxed);

  size_t chosen = workers.size();
  if (options_.temperature > 0) {
    // Softmax over the candidates, shifted by the best score for stability.
    std::vector<double> weights(workers.size(), 0.0);
    for (size_t i = 0; i < workers.size(); ++i) {
      if (candidate[i]) weights[i] = std::exp((scored.scores[i] - best) / options_.temperature);
    }
    std::lock_guard<std::mutex> lock(mu_);
    chosen = std::discrete_distribution<size_t>(weights.begin(), weights.end())(rng_);
  } else {
    std::vector<size_t> tied;
    for (size_t i = 0; i < workers.size(); ++i) {
      if (candidate[i] && scored.scores[i] >= best - kTieEpsilon) tied.push_back(i);
    }
    chosen = tied[cursor_.fetch_add(1, std::memory_order_relaxed) % tied.size()];
  }

  if (req.explain != nullptr) {
    req.explain->candidates.resize(workers.size());
    for (size_t i = 0; i < workers.size(); ++i) {
      RouteExplanation::Candidate& c = req.explain->candidates[i];
      c.eligible = candidate[i];
      c.matched_blocks = scored.matched[i];
      if (workers[i].healthy) c.score = scored.scores[i];
    }
    req.explain->why = absl::StrFormat(
        "%s score (%g x matched/%d prompt blocks - %g x load) among the workers within the load "
        "bound%s%s",
        options_.temperature > 0 ? "sampled by" : "the best", options_.overlap_weight, scored.hashes.size(),
        options_.load_weight,
        options_.temperature > 0 ? absl::StrFormat(" (softmax, temperature %g)", options_.temperature) : "",
        best < best_healthy - kTieEpsilon ? "; a better-scoring worker is over the bound (spillover)" : "");
  }
  requested_blocks_.fetch_add(scored.hashes.size(), std::memory_order_relaxed);
  matched_blocks_.fetch_add(static_cast<uint64_t>(scored.matched[chosen]), std::memory_order_relaxed);
  index_->RecordRouted(workers[chosen].id, scored.hashes, now);
  if (req.cached_tokens != nullptr) {
    *req.cached_tokens =
        std::min<int64_t>(scored.matched[chosen] * options_.block_size, static_cast<int64_t>(req.tokens.size()));
  }
  return chosen;
}

}  // namespace tandem::router
