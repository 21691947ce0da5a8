#include "orchestrator/routing/round_robin.h"

#include "absl/hash/hash.h"
#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> RoundRobinPolicy::Create(const PolicyParams& params) {
  RETURN_IF_ERROR(routing_internal::ParamReader("round_robin", params).Finish());
  return std::make_unique<RoundRobinPolicy>();
}

absl::StatusOr<size_t> RoundRobinPolicy::Pick(const RouteRequest& /*req*/, std::span<const WorkerView> workers) {
  const size_t healthy = routing_internal::CountHealthy(workers);
  if (healthy == 0) return routing_internal::NoHealthyWorker(name(), workers.size());
  size_t set = 0;
  for (const WorkerView& w : workers) {
    if (w.healthy) set = absl::HashOf(set, w.id);
  }
  uint64_t turn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (next_.size() >= kMaxSets && !next_.contains(set)) next_.clear();
    turn = next_[set]++;
  }
  return routing_internal::NthHealthy(workers, turn % healthy);
}

}  // namespace tandem::router
