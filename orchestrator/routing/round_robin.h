// round_robin: the healthy workers in turn. Unhealthy workers are skipped
// without giving their turn to their neighbour: the cursor counts picks and
// indexes the healthy workers, so each healthy worker gets 1/h of the picks.
// No parameters.
//
// Thread safety: Pick is lock-free (one atomic counter).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
#define TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class RoundRobinPolicy : public RoutingPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);

  std::string name() const override { return "round_robin"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

 private:
  std::atomic<uint64_t> next_{0};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
