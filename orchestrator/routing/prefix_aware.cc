#include "orchestrator/routing/prefix_aware.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> PrefixAwarePolicy::Create(const PolicyParams& params) {
  routing_internal::ParamReader reader("prefix_aware", params);
  Options options;
  int64_t prefix_tokens = options.prefix_tokens;
  int64_t virtual_nodes = options.virtual_nodes;
  RETURN_IF_ERROR(reader.Int64("prefix_tokens", 1, 1 << 20, &prefix_tokens));
  RETURN_IF_ERROR(reader.Int64("virtual_nodes", 1, 10000, &virtual_nodes));
  RETURN_IF_ERROR(reader.Double("load_factor", 1.0, &options.load_factor));
  RETURN_IF_ERROR(reader.Finish());
  options.prefix_tokens = static_cast<int>(prefix_tokens);
  options.virtual_nodes = static_cast<int>(virtual_nodes);
  return std::make_unique<PrefixAwarePolicy>(options);
}

std::shared_ptr<const PrefixAwarePolicy::Ring> PrefixAwarePolicy::BuildRing(std::span<const WorkerView> workers) const {
  auto ring = std::make_shared<Ring>();
  ring->ids.reserve(workers.size());
  ring->points.reserve(workers.size() * options_.virtual_nodes);
  for (size_t i = 0; i < workers.size(); ++i) {
    ring->ids.push_back(workers[i].id);
    for (int v = 0; v < options_.virtual_nodes; ++v) {
      const std::string point = absl::StrCat(workers[i].id, "#", v);
      ring->points.emplace_back(HashBytes(point.data(), point.size()), static_cast<uint32_t>(i));
    }
  }
  std::sort(ring->points.begin(), ring->points.end());
  return ring;
}

std::shared_ptr<const PrefixAwarePolicy::Ring> PrefixAwarePolicy::RingFor(std::span<const WorkerView> workers) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool same =
      ring_ != nullptr && std::equal(ring_->ids.begin(), ring_->ids.end(), workers.begin(), workers.end(),
                                     [](const std::string& id, const WorkerView& w) { return id == w.id; });
  if (!same) {
    ring_ = BuildRing(workers);
    ring_builds_.fetch_add(1, std::memory_order_relaxed);
  }
  return ring_;
}

absl::StatusOr<size_t> PrefixAwarePolicy::Pick(const RouteRequest& req, std::span<const WorkerView> workers) {
  if (routing_internal::CountHealthy(workers) == 0) {
    return routing_internal::NoHealthyWorker(name(), workers.size());
  }
  const double bound = routing_internal::LoadBound(workers, options_.load_factor);

  const std::shared_ptr<const Ring> ring = RingFor(workers);
  const size_t prefix = std::min(req.tokens.size(), static_cast<size_t>(options_.prefix_tokens));
  const uint64_t key = HashTokens(req.tokens.first(prefix));
  const auto& points = ring->points;
  const size_t start =
      std::lower_bound(points.begin(), points.end(), std::make_pair(key, std::numeric_limits<uint32_t>::min())) -
      points.begin();

  std::vector<bool> seen(workers.size(), false);
  size_t distinct = 0;
  bool passed_owner = false;
  for (size_t step = 0; step < points.size() && distinct < workers.size(); ++step) {
    const uint32_t i = points[(start + step) % points.size()].second;
    if (seen[i]) continue;
    seen[i] = true;
    ++distinct;
    if (!workers[i].healthy) continue;
    if (workers[i].in_flight <= bound) {
      if (passed_owner) spillovers_.fetch_add(1, std::memory_order_relaxed);
      return static_cast<size_t>(i);
    }
    passed_owner = true;
  }
  // Not reached: the least loaded healthy worker is at or under the average,
  // hence under the bound. Kept so a bad snapshot cannot fail the request.
  size_t least = routing_internal::NthHealthy(workers, 0);
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].healthy && workers[i].in_flight < workers[least].in_flight) least = i;
  }
  spillovers_.fetch_add(1, std::memory_order_relaxed);
  return least;
}

}  // namespace tandem::router
