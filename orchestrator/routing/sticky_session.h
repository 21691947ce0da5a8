// sticky_session: requests with the same session id go to the same worker,
// so state kept on the worker (a conversation's KV blocks) is reused.
//
// The first request of a session is placed round robin over the healthy
// workers and pins session id -> worker id. A pin expires after `ttl_s`
// seconds without a request for its session (an idle TTL, measured between
// Picks: the policy does not see when requests end). The table holds at most
// `max_sessions` pins and evicts the least recently used beyond that.
// A request without a session id is routed round robin and pins nothing.
// If the pinned worker left the snapshot or is unhealthy, the session is
// re-pinned to another worker (counted by repins()); it does not move back
// when the old worker returns.
//
// Parameters: `max_sessions` (default 100000), `ttl_s` (integer seconds,
// default 3600).
//
// Thread safety: Pick with a session id holds one mutex for a hash lookup,
// an LRU splice and a scan of the snapshot for the pinned id.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_STICKY_SESSION_H_
#define TANDEM_ORCHESTRATOR_ROUTING_STICKY_SESSION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "orchestrator/routing/round_robin.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class StickySessionPolicy : public RoutingPolicy {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  struct Options {
    int64_t max_sessions = 100000;                                    // pins kept; LRU beyond
    std::chrono::steady_clock::duration ttl = std::chrono::hours(1);  // idle expiry
  };

  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);
  // `now` is the time source (tests inject a fake one).
  StickySessionPolicy(Options options, Clock now);

  std::string name() const override { return "sticky_session"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

  // Sessions moved because their worker left or became unhealthy.
  uint64_t repins() const { return repins_.load(std::memory_order_relaxed); }
  // Pins dropped because the table was full.
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }
  // Pins held now (expired ones are dropped lazily, on the next Pick).
  size_t sessions() const;
  // "repins" and "evictions".
  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    return {{"repins", repins()}, {"evictions", evictions()}};
  }

 private:
  struct Pin {
    std::string worker_id;
    std::chrono::steady_clock::time_point last_used;
    std::list<std::string>::iterator lru;  // position in lru_
  };

  void DropExpired(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Clock now_;
  RoundRobinPolicy placement_;  // places new sessions and requests without one
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Pin> pins_ ABSL_GUARDED_BY(mu_);
  // Session ids, most recently used first. Since last_used only grows, the
  // back is also the oldest, so expiry pops from the back.
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> repins_{0};
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_STICKY_SESSION_H_
