// Helpers shared by the routing policies' implementations: the health
// filter, the load bound, the "no healthy worker" error and a checked reader
// of PolicyParams. Internal to orchestrator/routing; not for other modules.
//
// Thread safety: the free functions are pure. A ParamReader belongs to one
// thread (it is used once, while a policy is created).
#ifndef TANDEM_ORCHESTRATOR_ROUTING_POLICY_INTERNAL_H_
#define TANDEM_ORCHESTRATOR_ROUTING_POLICY_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router::routing_internal {

size_t CountHealthy(std::span<const WorkerView> workers);

// Index into `workers` of the k-th healthy worker (0-based).
// REQUIRES: k < CountHealthy(workers).
size_t NthHealthy(std::span<const WorkerView> workers, size_t k);

// Bounded load (consistent hashing with bounded loads): the most requests in
// flight a worker may have and still be a candidate, load_factor x (T + 1) /
// h with T the requests in flight on the h healthy workers. The least loaded
// healthy worker is at or under the average, so always within it.
// REQUIRES: CountHealthy(workers) > 0.
double LoadBound(std::span<const WorkerView> workers, double load_factor);

// Unavailable, naming the policy and how many workers there were.
absl::Status NoHealthyWorker(absl::string_view policy, size_t num_workers);

// Reads typed parameters out of PolicyParams. Each getter leaves *out
// unchanged when the key is absent and fails with InvalidArgument naming the
// parameter and the policy when the value does not parse or is out of range.
// Finish() fails on any key no getter asked for.
class ParamReader {
 public:
  ParamReader(absl::string_view policy, const PolicyParams& params);

  absl::Status Uint64(absl::string_view key, uint64_t* out);
  // Accepts min <= value <= max.
  absl::Status Int64(absl::string_view key, int64_t min, int64_t max, int64_t* out);
  // Accepts finite values with value >= min.
  absl::Status Double(absl::string_view key, double min, double* out);
  absl::Status Finish() const;

 private:
  const std::string* Find(absl::string_view key);
  absl::Status Bad(absl::string_view key, const std::string& value, absl::string_view why) const;

  std::string policy_;
  const PolicyParams& params_;
  std::set<std::string> used_;
};

}  // namespace tandem::router::routing_internal

#endif  // TANDEM_ORCHESTRATOR_ROUTING_POLICY_INTERNAL_H_
