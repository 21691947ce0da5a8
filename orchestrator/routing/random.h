// random: a worker drawn uniformly from the healthy ones. For benchmarking
// and for exposing latency variability, not for production traffic.
// Parameter `seed` (uint64): makes the sequence of picks reproducible;
// without it the generator is seeded from std::random_device.
//
// Thread safety: Pick takes a mutex around the generator (a few ns).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_RANDOM_H_
#define TANDEM_ORCHESTRATOR_ROUTING_RANDOM_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>

#include "absl/base/thread_annotations.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class RandomPolicy : public RoutingPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);
  explicit RandomPolicy(uint64_t seed) : rng_(seed) {}

  std::string name() const override { return "random"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

 private:
  std::mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_RANDOM_H_
