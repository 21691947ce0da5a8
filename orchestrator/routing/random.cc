#include "orchestrator/routing/random.h"

#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> RandomPolicy::Create(const PolicyParams& params) {
  routing_internal::ParamReader reader("random", params);
  uint64_t seed = std::random_device{}();
  RETURN_IF_ERROR(reader.Uint64("seed", &seed));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_unique<RandomPolicy>(seed);
}

absl::StatusOr<size_t> RandomPolicy::Pick(const RouteRequest& /*req*/, std::span<const WorkerView> workers) {
  const size_t healthy = routing_internal::CountHealthy(workers);
  if (healthy == 0) return routing_internal::NoHealthyWorker(name(), workers.size());
  size_t k;
  {
    std::lock_guard<std::mutex> lock(mu_);
    k = std::uniform_int_distribution<size_t>(0, healthy - 1)(rng_);
  }
  return routing_internal::NthHealthy(workers, k);
}

}  // namespace tandem::router
