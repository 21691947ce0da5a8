#include "orchestrator/routing/routing_policy.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "orchestrator/routing/kv_cache_aware.h"
#include "orchestrator/routing/least_request.h"
#include "orchestrator/routing/power_of_two.h"
#include "orchestrator/routing/prefix_aware.h"
#include "orchestrator/routing/random.h"
#include "orchestrator/routing/round_robin.h"
#include "orchestrator/routing/sticky_session.h"

namespace tandem::router {

RoutingPolicy::~RoutingPolicy() = default;

std::vector<std::pair<std::string, uint64_t>> RoutingPolicy::Counters() const { return {}; }

void RoutingPolicyRegistry::Register(std::string name, Factory f) {
  const bool inserted = factories_.emplace(name, std::move(f)).second;
  CHECK(inserted) << "routing policy '" << name << "' registered twice";
}

absl::StatusOr<std::unique_ptr<RoutingPolicy>> RoutingPolicyRegistry::Create(
    const std::string& name, const PolicyParams& params) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown routing policy '", name,
                                                   "'; known: ", absl::StrJoin(names(), ", ")));
  }
  return it->second(params);
}

std::vector<std::string> RoutingPolicyRegistry::names() const {
  std::vector<std::string> out;
  out.reserve(factories_.size());
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

void RegisterBuiltinRoutingPolicies(RoutingPolicyRegistry& registry) {
  registry.Register("round_robin", &RoundRobinPolicy::Create);
  registry.Register("random", &RandomPolicy::Create);
  registry.Register("least_request", &LeastRequestPolicy::Create);
  registry.Register("power_of_two", &PowerOfTwoPolicy::Create);
  registry.Register("prefix_aware", &PrefixAwarePolicy::Create);
  registry.Register("sticky_session", &StickySessionPolicy::Create);
  registry.Register("kv_cache_aware", &KvCacheAwarePolicy::Create);
}

}  // namespace tandem::router
