// prefix_aware: consistent hashing of the prompt prefix with bounded-load
// spillover, so requests that share a system prompt or template land on the
// worker that already holds its KV blocks, until that worker is overloaded.
//
// The key is XXH3 of the first `prefix_tokens` prompt tokens (all of them if
// the prompt is shorter). Each worker id owns `virtual_nodes` points on a
// 64-bit ring; the key's owner is the first healthy worker at or after the
// key. Adding or removing one of n workers moves only the keys that worker
// gains or loses, ~1/n of them; marking a worker unhealthy moves only its
// own keys, to their next worker on the ring.
//
// Bounded load (Mirrokni et al., "Consistent Hashing with Bounded Loads"):
// a worker takes the request only if its in_flight <= load_factor * (T + 1)
// / h, with T the requests in flight on the h healthy workers; "+ 1" counts
// the incoming request, so an idle cluster never spills. Over the bound, the
// walk goes on along the ring to the next healthy worker under it. Such a
// worker always exists (the least loaded one is at or under the average), so
// the walk visits at most n workers. load_factor 1.25 and prefix_tokens 256
// are SGLang's prefix_hash defaults.
//
// Parameters: `prefix_tokens` (default 256), `virtual_nodes` (default 100),
// `load_factor` (>= 1.0, default 1.25).
//
// The ring is rebuilt when the snapshot's list of ids changes (a reorder
// rebuilds too, but maps every key to the same id).
//
// Thread safety: Pick takes a mutex only to fetch (or rebuild) the ring; the
// lookup runs on a shared immutable copy.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_PREFIX_AWARE_H_
#define TANDEM_ORCHESTRATOR_ROUTING_PREFIX_AWARE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

class PrefixAwarePolicy : public RoutingPolicy {
 public:
  struct Options {
    int prefix_tokens = 256;    // tokens of the prompt that make the key
    int virtual_nodes = 100;    // ring points per worker; more = smoother split
    double load_factor = 1.25;  // bound on a worker's share over the average
  };

  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const PolicyParams& params);
  explicit PrefixAwarePolicy(Options options) : options_(options) {}

  std::string name() const override { return "prefix_aware"; }
  absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) override;

  // Picks that went past the key's owner because it was over the bound.
  uint64_t spillovers() const { return spillovers_.load(std::memory_order_relaxed); }
  // Times the ring was (re)built for a new list of ids.
  uint64_t ring_builds() const { return ring_builds_.load(std::memory_order_relaxed); }
  // "spillovers" and "ring_builds".
  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    return {{"spillovers", spillovers()}, {"ring_builds", ring_builds()}};
  }

 private:
  struct Ring {
    std::vector<std::string> ids;                       // the snapshot's ids, in order
    std::vector<std::pair<uint64_t, uint32_t>> points;  // (hash, index into ids), sorted
  };

  std::shared_ptr<const Ring> RingFor(std::span<const WorkerView> workers);
  std::shared_ptr<const Ring> BuildRing(std::span<const WorkerView> workers) const;

  const Options options_;
  std::mutex mu_;
  std::shared_ptr<const Ring> ring_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> spillovers_{0};
  std::atomic<uint64_t> ring_builds_{0};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_PREFIX_AWARE_H_
