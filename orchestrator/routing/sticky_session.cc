#include "orchestrator/routing/sticky_session.h"

#include <utility>

#include "common/status_macros.h"
#include "orchestrator/routing/policy_internal.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RoutingPolicy>> StickySessionPolicy::Create(const PolicyParams& params) {
  routing_internal::ParamReader reader("sticky_session", params);
  Options options;
  int64_t ttl_s = std::chrono::duration_cast<std::chrono::seconds>(options.ttl).count();
  RETURN_IF_ERROR(reader.Int64("max_sessions", 1, int64_t{1} << 32, &options.max_sessions));
  RETURN_IF_ERROR(reader.Int64("ttl_s", 1, int64_t{10} * 365 * 24 * 3600, &ttl_s));
  RETURN_IF_ERROR(reader.Finish());
  options.ttl = std::chrono::seconds(ttl_s);
  return std::make_unique<StickySessionPolicy>(options, [] { return std::chrono::steady_clock::now(); });
}

StickySessionPolicy::StickySessionPolicy(Options options, Clock now) : options_(options), now_(std::move(now)) {}

size_t StickySessionPolicy::sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pins_.size();
}

void StickySessionPolicy::DropExpired(std::chrono::steady_clock::time_point now) {
  while (!lru_.empty()) {
    auto it = pins_.find(lru_.back());
    if (now - it->second.last_used <= options_.ttl) return;
    pins_.erase(it);
    lru_.pop_back();
  }
}

absl::StatusOr<size_t> StickySessionPolicy::Pick(const RouteRequest& req, std::span<const WorkerView> workers) {
  if (req.session_id.empty()) return placement_.Pick(req, workers);
  if (routing_internal::CountHealthy(workers) == 0) {
    return routing_internal::NoHealthyWorker(name(), workers.size());
  }
  const auto now = now_();

  std::lock_guard<std::mutex> lock(mu_);
  DropExpired(now);
  auto it = pins_.find(req.session_id);
  if (it == pins_.end()) {
    ASSIGN_OR_RETURN(const size_t chosen, placement_.Pick(req, workers));
    lru_.push_front(req.session_id);
    pins_.emplace(req.session_id, Pin{workers[chosen].id, now, lru_.begin()});
    if (pins_.size() > static_cast<size_t>(options_.max_sessions)) {
      pins_.erase(lru_.back());
      lru_.pop_back();
      evictions_.fetch_add(1, std::memory_order_relaxed);
    }
    return chosen;
  }

  Pin& pin = it->second;
  pin.last_used = now;
  lru_.splice(lru_.begin(), lru_, pin.lru);
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].healthy && workers[i].id == pin.worker_id) return i;
  }
  ASSIGN_OR_RETURN(const size_t chosen, placement_.Pick(req, workers));
  pin.worker_id = workers[chosen].id;
  repins_.fetch_add(1, std::memory_order_relaxed);
  return chosen;
}

}  // namespace tandem::router
