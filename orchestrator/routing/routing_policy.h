// Routing policies: which worker should serve a request.
//
// A policy only decides; another component (the router) sends. Pick is a
// function of the request and a snapshot of the cluster (WorkerView per
// worker, built by the router from its own bookkeeping and the workers'
// reports), so every policy is testable with a fake snapshot and no network.
// Some policies keep state between calls (a round-robin cursor, a random
// generator, a consistent-hash ring, a session table); that state never
// outlives the meaning of the snapshot it was built from.
//
// Contract: Pick returns an index into `workers` of a healthy worker, or
// Unavailable when there is none (empty list or all unhealthy). It never
// returns any other error.
//
// Policies are created by name from a RoutingPolicyRegistry, filled by
// RegisterBuiltinRoutingPolicies (an explicit list: static self-registration
// silently drops out of static archives).
//
// Thread safety: RoutingPolicy::Pick may be called concurrently from any
// thread. RoutingPolicyRegistry::Register is not thread-safe; its const
// methods are, once registration is done.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_ROUTING_POLICY_H_
#define TANDEM_ORCHESTRATOR_ROUTING_ROUTING_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::router {

class KvIndex;

// What the cluster tells a policy at its creation: how the workers hash
// their KV blocks (their ModelInfo's block size and hash seed), so that a
// cache-aware policy hashes prompts the same way. Not a YAML parameter: a
// value that disagreed with the workers would make the index useless.
struct PolicyContext {
  int block_size = 16;
  uint64_t block_hash_seed = 0;

  friend bool operator==(const PolicyContext&, const PolicyContext&) = default;
};

// One worker as the router sees it at the moment of the decision.
struct WorkerView {
  std::string id;                        // the worker's address; unique in a snapshot
  int in_flight = 0;                     // requests the router has in flight there
  int64_t prefill_tokens_in_flight = 0;  // prompt tokens to compute there (not expected cached)
  int64_t used_blocks = 0;               // KV blocks in use, as last reported
  int64_t total_blocks = 0;              // KV pool size in blocks
  int64_t prefill_tokens_per_step = 0;   // the worker's step budget (ModelInfo); 0 if unknown
  bool healthy = true;                   // false: never picked
};

// Why a policy chose what it chose, for a request that asks (opt-in: it
// costs a little). Per worker of the snapshot, in its order, what the policy
// weighed; a policy fills what it uses and leaves the rest unset.
struct RouteExplanation {
  struct Candidate {
    bool eligible = false;                  // the policy would have picked it
    std::optional<int64_t> matched_blocks;  // prompt blocks it holds (cache-aware)
    std::optional<double> score;            // the policy's score (higher wins)
  };
  std::vector<Candidate> candidates;  // empty: the policy explains nothing per worker
  std::string why;                    // the rule that picked the winner, in a line
};

struct RouteRequest {
  std::span<const int32_t> tokens;  // prompt token ids; the caller keeps them alive
  std::string session_id;           // empty if the client sent none
  // Out, when set: a policy that knows how many leading prompt tokens the
  // chosen worker holds in its cache writes them here (kv_cache_aware);
  // others leave it alone.
  int64_t* cached_tokens = nullptr;
  // Out, when set: the policy says why (RouteExplanation).
  RouteExplanation* explain = nullptr;
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy();

  // The config name, e.g. "round_robin".
  virtual std::string name() const = 0;

  // Index into `workers` of the chosen worker; Unavailable if no healthy
  // worker. Thread-safe.
  virtual absl::StatusOr<size_t> Pick(const RouteRequest& req, std::span<const WorkerView> workers) = 0;

  // Named event counts the policy keeps (sticky_session's "repins",
  // prefix_aware's "spillovers", ...), monotonic over the policy's life, for
  // the router's metrics. Default: none. Thread-safe.
  virtual std::vector<std::pair<std::string, uint64_t>> Counters() const;

  // The KV index the policy routes by, for the router to feed with the
  // workers' KV events; null (the default) for a policy without one.
  virtual std::shared_ptr<KvIndex> kv_index() const;
};

// Policy parameters by name, as strings (the YAML layer fills them). Each
// policy rejects names it does not know and values it cannot parse.
using PolicyParams = std::map<std::string, std::string>;

class RoutingPolicyRegistry {
 public:
  using Factory =
      std::function<absl::StatusOr<std::unique_ptr<RoutingPolicy>>(const PolicyParams&, const PolicyContext&)>;

  // REQUIRES: `name` is not registered yet.
  void Register(std::string name, Factory f);

  // InvalidArgument for an unknown name (the message lists the known ones)
  // or for a parameter the policy rejects (the message names the parameter
  // and the policy).
  absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(const std::string& name, const PolicyParams& params,
                                                        const PolicyContext& context = {}) const;

  // Registered names, sorted.
  std::vector<std::string> names() const;

 private:
  std::map<std::string, Factory> factories_;
};

// Registers round_robin, random, least_request, power_of_two, prefix_aware,
// sticky_session and kv_cache_aware.
void RegisterBuiltinRoutingPolicies(RoutingPolicyRegistry& registry);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_ROUTING_POLICY_H_
