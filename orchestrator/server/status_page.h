// The router's read-only status page (GET /dashboard): what an operator asks
// first — which workers serve, how loaded they are, what routing does and
// why — on one self-contained HTML page (no scripts, no external assets; it
// reloads itself every few seconds). Rendering is a pure function of a
// snapshot the router takes, so the page is testable without a cluster.
#ifndef TANDEM_ORCHESTRATOR_SERVER_STATUS_PAGE_H_
#define TANDEM_ORCHESTRATOR_SERVER_STATUS_PAGE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace tandem::router {

// One routing decision, as the page lists it.
struct RecentDecision {
  int64_t unix_ms = 0;
  std::string request_id;
  std::string decode_worker;
  std::string prefill_worker;  // empty: prefilled on the decode worker
  int64_t prompt_tokens = 0;
  int64_t expected_cached_tokens = 0;  // what the policy expected the prefilling worker to hold
};

// The last `capacity` decisions, newest first. Thread-safe.
class RecentDecisions {
 public:
  explicit RecentDecisions(size_t capacity) : capacity_(capacity) {}
  void Add(RecentDecision d);
  std::vector<RecentDecision> Snapshot() const;

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::deque<RecentDecision> decisions_ ABSL_GUARDED_BY(mu_);
};

struct StatusSnapshot {
  struct Worker {
    std::string address;
    bool healthy = false;
    std::string incompatible;  // why it is refused; empty when it fits
    int in_flight = 0;         // requests the router has there
    // From its last load report (absent before the first):
    std::optional<int64_t> running, waiting, used_blocks, total_blocks, cached_blocks;
    std::optional<double> prefix_hit_rate;
  };
  struct Pool {
    std::string name;  // "prefill", "decode"
    std::string policy;
    std::map<std::string, std::string> params;
    std::vector<Worker> workers;
    std::optional<int64_t> index_blocks;  // its KV index's entries (kv_cache_aware)
  };
  std::string model;
  std::string tokenizer;
  std::string disaggregation;
  int64_t uptime_s = 0;
  int64_t in_flight = 0;
  int64_t queued = 0;
  std::vector<Pool> pools;
  std::vector<RecentDecision> recent;  // newest first
};

// The page's HTML.
std::string RenderStatusPage(const StatusSnapshot& s);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_STATUS_PAGE_H_
