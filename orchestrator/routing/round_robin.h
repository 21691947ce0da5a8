// round_robin: the healthy workers in turn. Unhealthy workers are skipped
// without giving their turn to their neighbour: the cursor counts picks and
// indexes the healthy workers, so each healthy worker gets 1/h of the picks.
// Each set of healthy workers has a cursor of its own (one of kCursors, by
// a hash of their ids): the router offers a prefill pick only the workers
// of the decode worker's KV domain, and with one cursor for all, picks that
// alternate between two domains of two workers each would always land on
// the same worker of each. No parameters.
//
// Thread safety: Pick is lock-free (atomic counters).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
#define TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_

#include <array>
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
  static constexpr size_t kCursors = 64;  // sets that share a slot share a cursor
  std::array<std::atomic<uint64_t>, kCursors> next_{};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
