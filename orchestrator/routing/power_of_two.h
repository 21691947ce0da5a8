// power_of_two: draws two distinct healthy workers uniformly at random and
// takes the one with fewer requests in flight (the first drawn on a tie).
// "Power of two choices": nearly least_request's balance without every
// router replica herding onto the same least-loaded worker. With a single
// healthy worker it is that worker. Parameter `seed` (uint64), as random.
//
// Thread safety: Pick takes a mutex around the generator.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_POWER_OF_TWO_H_
#define TANDEM_ORCHESTRATOR_ROUTING_POWER_OF_TWO_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>

#include "absl/base/thread_annotations.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class PowerOfTwoPolicy : public RoutingPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);
  explicit PowerOfTwoPolicy(uint64_t seed) : rng_(seed) {}

  std::string name() const override { return "power_of_two"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

 private:
  std::mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_POWER_OF_TWO_H_
