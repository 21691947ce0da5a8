// round_robin: the healthy workers in turn. Unhealthy workers are skipped
// without giving their turn to their neighbour: the cursor counts picks and
// indexes the healthy workers, so each healthy worker gets 1/h of the picks.
// Each set of healthy workers has a cursor of its own (keyed by a 64-bit
// hash of their ids): the router offers a prefill pick only the workers of
// the decode worker's KV domain, and with one cursor for two sets, picks that
// alternate between two domains of two workers each would always land on
// the same worker of each. (A table of 64 slots indexed by the hash had two
// sets share a slot one time in 64: then exactly that.) Beyond kMaxSets sets
// the cursors start over. No parameters.
//
// Thread-safe (one mutex around the cursors).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
#define TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_

#include <cstdint>
#include <memory>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"

#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class RoundRobinPolicy : public RoutingPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);

  std::string name() const override { return "round_robin"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

 private:
  static constexpr size_t kMaxSets = 4096;
  std::mutex mu_;
  absl::flat_hash_map<size_t, uint64_t> next_ ABSL_GUARDED_BY(mu_);  // healthy set's hash -> its picks
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_ROUND_ROBIN_H_
