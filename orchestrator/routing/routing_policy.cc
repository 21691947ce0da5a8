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

absl::StatusOr<std::unique_ptr<RoutingPolicy>> RoutingPolicyRegistry::Create(const std::string& name,
                                                                             const PolicyParams& params,
                                                                             const PolicyContext& context) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown routing policy '", name, "'; known: ", absl::StrJoin(names(), ", ")));
  }
  return it->second(params, context);
}

std::vector<std::string> RoutingPolicyRegistry::names() const {
  std::vector<std::string> out;
  out.reserve(factories_.size());
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

void RegisterBuiltinRoutingPolicies(RoutingPolicyRegistry& registry) {
  // Policies that need nothing from the cluster.
  auto plain = [](auto create) {
    return [create](const PolicyParams& params, const PolicyContext&) { return create(params); };
  };
  registry.Register("round_robin", plain(&RoundRobinPolicy::Create));
  registry.Register("random", plain(&RandomPolicy::Create));
  registry.Register("least_request", plain(&LeastRequestPolicy::Create));
  registry.Register("power_of_two", plain(&PowerOfTwoPolicy::Create));
  registry.Register("prefix_aware", plain(&PrefixAwarePolicy::Create));
  registry.Register("sticky_session", plain(&StickySessionPolicy::Create));
  registry.Register("kv_cache_aware", &KvCacheAwarePolicy::Create);
}

std::shared_ptr<KvIndex> RoutingPolicy::kv_index() const { return nullptr; }

}  // namespace tandem::router
