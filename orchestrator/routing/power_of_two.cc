#include "orchestrator/routing/power_of_two.h"

#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> PowerOfTwoPolicy::Create(const PolicyParams& params) {
  routing_internal::ParamReader reader("power_of_two", params);
  uint64_t seed = std::random_device{}();
  RETURN_IF_ERROR(reader.Uint64("seed", &seed));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_unique<PowerOfTwoPolicy>(seed);
}

absl::StatusOr<size_t> PowerOfTwoPolicy::Pick(const RouteRequest& /*req*/, std::span<const WorkerView> workers) {
  const size_t healthy = routing_internal::CountHealthy(workers);
  if (healthy == 0) return routing_internal::NoHealthyWorker(name(), workers.size());
  if (healthy == 1) return routing_internal::NthHealthy(workers, 0);
  size_t a, b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = std::uniform_int_distribution<size_t>(0, healthy - 1)(rng_);
    b = std::uniform_int_distribution<size_t>(0, healthy - 2)(rng_);
  }
  if (b >= a) ++b;  // distinct from a, still uniform over the others
  const size_t first = routing_internal::NthHealthy(workers, a);
  const size_t second = routing_internal::NthHealthy(workers, b);
  return workers[second].in_flight < workers[first].in_flight ? second : first;
}

}  // namespace tandem::router
