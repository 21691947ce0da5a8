#include "orchestrator/routing/least_request.h"

#include <limits>

#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> LeastRequestPolicy::Create(const PolicyParams& params) {
  RETURN_IF_ERROR(routing_internal::ParamReader("least_request", params).Finish());
  return std::make_unique<LeastRequestPolicy>();
}

absl::StatusOr<size_t> LeastRequestPolicy::Pick(const RouteRequest& /*req*/, std::span<const WorkerView> workers) {
  int least = std::numeric_limits<int>::max();
  size_t ties = 0;
  for (const WorkerView& w : workers) {
    if (!w.healthy) continue;
    if (w.in_flight < least) {
      least = w.in_flight;
      ties = 1;
    } else if (w.in_flight == least) {
      ++ties;
    }
  }
  if (ties == 0) return routing_internal::NoHealthyWorker(name(), workers.size());
  size_t k = next_tie_.fetch_add(1, std::memory_order_relaxed) % ties;
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].healthy || workers[i].in_flight != least) continue;
    if (k == 0) return i;
    --k;
  }
  return routing_internal::NoHealthyWorker(name(), workers.size());  // not reached
}

}  // namespace tandem::router
