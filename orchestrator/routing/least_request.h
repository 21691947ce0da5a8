// least_request: the healthy worker with the fewest requests in flight
// (WorkerView::in_flight, counted by the router). Ties are broken in turn:
// a rotating cursor picks among the tied workers, so an idle cluster is
// filled evenly instead of always from the first worker. No parameters.
//
// Thread safety: Pick is lock-free (one atomic counter).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_LEAST_REQUEST_H_
#define TANDEM_ORCHESTRATOR_ROUTING_LEAST_REQUEST_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class LeastRequestPolicy : public RoutingPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);

  std::string name() const override { return "least_request"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

 private:
  std::atomic<uint64_t> next_tie_{0};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_LEAST_REQUEST_H_
