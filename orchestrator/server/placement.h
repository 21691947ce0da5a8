// Placement: where a request's attempt runs. The Placer holds the routing
// state (the pools' policies, created with the workers' block size and hash
// seed, and their KV indexes), builds it once a worker has told the model's
// shape, rebuilds it on reload (keeping a pool's policy, and so its state,
// when its parameters did not change), and places attempts: the decode
// worker, then, as the disaggregation mode says, a prefill worker. Every
// decision is timed, counted, kept for /dashboard and, when the request
// asked (x-tandem-explain), explained as JSON.
//
// RequestPlanner is one request's Planner (generation.h) over the Placer,
// with retries from admission's budget.
//
// Thread safety: Placer's methods may be called from any thread.
#ifndef TANDEM_ORCHESTRATOR_SERVER_PLACEMENT_H_
#define TANDEM_ORCHESTRATOR_SERVER_PLACEMENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "orchestrator/admission/admission.h"
#include "orchestrator/cluster/cluster.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/routing/routing_policy.h"
#include "orchestrator/server/generation.h"
#include "orchestrator/server/router_metrics.h"
#include "orchestrator/server/status_page.h"
#include "orchestrator/server/throttled_warnings.h"

namespace tandem::router {

// Routing for one config and one model shape: the pools' policies (with the
// model's block size and hash seed) and their KV indexes.
struct RoutingState {
  std::shared_ptr<const RouterConfig> config;
  // Shared with the next state when a reload leaves a pool's policy and its
  // parameters as they were, so its state (cursor, ring, sessions, index,
  // counters) carries on.
  std::shared_ptr<RoutingPolicy> policy[kNumPoolRoles];
  PolicyParams params[kNumPoolRoles];  // as created
  PolicyContext context;               // the workers' block size and hash seed
  std::shared_ptr<KvIndex> index[kNumPoolRoles];
  int64_t max_context = 0;
  int64_t vocab_size = 0;
};

// Who is placed: what policies and the decision log need of a request.
struct PlaceRequest {
  std::string request_id;
  std::string session_id;  // the sessions header's value (sticky_session)
  bool explain = false;    // x-tandem-explain: fill Placement::explanation
};

class Placer {
 public:
  // `config` gives the running config (a state is built for it).
  Placer(Cluster& cluster, RouterMetrics& metrics, std::function<std::shared_ptr<const RouterConfig>()> config);

  // The routing state, built once a worker has told the model's shape; null
  // before.
  std::shared_ptr<RoutingState> Routing();
  // The routing state as it is (null before it was built); never builds.
  std::shared_ptr<RoutingState> Current() const;
  // A reload: the state for `config`, keeping the policies it leaves as they
  // were; null (built later) while no worker has told the model's shape.
  void Rebuild(std::shared_ptr<const RouterConfig> config);

  // Chooses workers for `tokens`, never one `tried` passes over.
  // Unavailable when no healthy worker is left.
  absl::StatusOr<Placement> Place(const PlaceRequest& request, std::span<const int32_t> tokens,
                                  const TriedWorkers& tried);

  // The latest decisions, for /dashboard.
  std::vector<RecentDecision> Recent() const { return recent_.Snapshot(); }

  // Generations waiting now for a healthy worker (retries.wait_for_worker_s).
  void NoteWaiting(int delta) { waiting_.fetch_add(delta, std::memory_order_relaxed); }
  int64_t waiting() const { return waiting_.load(std::memory_order_relaxed); }

 private:
  // `prev` (may be null): the running state, whose policies are kept where
  // the config leaves them unchanged.
  std::shared_ptr<RoutingState> Build(std::shared_ptr<const RouterConfig> config, const tandem::v1::ModelInfo& info,
                                      const RoutingState* prev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(build_mu_);

  Cluster& cluster_;
  RouterMetrics& metrics_;
  const std::function<std::shared_ptr<const RouterConfig>()> config_;
  ThrottledWarnings warnings_;
  RecentDecisions recent_{32};
  std::atomic<int64_t> waiting_{0};
  std::mutex build_mu_;  // one Build at a time (it rewires the cluster's indexes)
  mutable std::mutex mu_;
  std::shared_ptr<RoutingState> routing_ ABSL_GUARDED_BY(mu_);
};

// One request's Planner: placed by the Placer as `request`, retries from
// admission's budget.
class RequestPlanner final : public Planner {
 public:
  RequestPlanner(Placer* placer, Admission* admission, PlaceRequest request)
      : placer_(placer), admission_(admission), request_(std::move(request)) {}
  absl::StatusOr<Placement> Place(std::span<const int32_t> tokens, const TriedWorkers& tried) override {
    return placer_->Place(request_, tokens, tried);
  }
  bool TakeRetry() override { return admission_->TakeRetry(); }
  void NoteWaiting(int delta) override { placer_->NoteWaiting(delta); }

 private:
  Placer* const placer_;
  Admission* const admission_;
  const PlaceRequest request_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_PLACEMENT_H_
