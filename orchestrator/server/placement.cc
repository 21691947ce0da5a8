#include "orchestrator/server/placement.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/thread_util.h"
#include "nlohmann/json.hpp"

namespace tandem::router {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ", N refused as incompatible: WHY" (the first one's reason, without its
// address) for the workers the cluster refuses; empty when it refuses none.
std::string RefusedWorkers(const std::vector<std::shared_ptr<WorkerClient>>& workers) {
  int refused = 0;
  std::string why;
  for (const auto& w : workers) {
    std::string reason = w->incompatibility();
    if (reason.empty()) continue;
    ++refused;
    if (why.empty()) why = std::move(reason);
  }
  return refused == 0 ? "" : absl::StrFormat(", %d refused as incompatible: %s", refused, why);
}

// `none` (UNAVAILABLE: no worker to place on) marked kNoWorkerToWaitFor
// unless waiting may help: some worker may yet be admitted (unhealthy, or
// healthy but not yet routable, and not refused as incompatible), or there
// is none at all (discovery may add one). Healthy workers all tried, or all
// refused: waiting cannot help.
absl::Status MarkIfNothingToWaitFor(absl::Status none, const std::vector<std::shared_ptr<WorkerClient>>& workers,
                                    bool healthy_ones_may_come) {
  const bool may_come = workers.empty() || std::any_of(workers.begin(), workers.end(), [&](const auto& w) {
                          return (healthy_ones_may_come || !w->healthy()) && w->incompatibility().empty();
                        });
  if (!may_come) none.SetPayload(kNoWorkerToWaitFor, absl::Cord("nothing to wait for"));
  return none;
}

// One pool's routing decision as x-tandem-route and the log show it: the
// policy, its rule, the winner, and each worker with what the router knew
// (health, requests in flight, KV use, prompt tokens queued for prefill) and
// what the policy weighed (eligible, matched prefix blocks, score).
nlohmann::json ExplainDecision(const char* pool, const std::string& policy, const std::vector<WorkerView>& views,
                               const std::vector<std::shared_ptr<WorkerClient>>& workers,
                               const std::vector<bool>& tried, const std::vector<std::string>& passed_over,
                               const RouteExplanation& why, std::optional<size_t> chosen) {
  nlohmann::json candidates = nlohmann::json::array();
  for (size_t i = 0; i < views.size(); ++i) {
    const WorkerView& v = views[i];
    nlohmann::json c = {{"worker", v.id},
                        {"healthy", workers[i]->healthy()},
                        {"in_flight", v.in_flight},
                        {"kv_used_blocks", v.used_blocks},
                        {"kv_total_blocks", v.total_blocks},
                        {"prefill_tokens_queued", v.prefill_tokens_in_flight}};
    if (tried[i]) {
      c["skipped"] = "already tried by this request";
    } else if (!passed_over[i].empty()) {
      c["skipped"] = passed_over[i];
    }
    if (i < why.candidates.size()) {
      const RouteExplanation::Candidate& e = why.candidates[i];
      c["eligible"] = e.eligible;
      if (e.matched_blocks.has_value()) c["matched_blocks"] = *e.matched_blocks;
      if (e.score.has_value()) c["score"] = *e.score;
    }
    candidates.push_back(std::move(c));
  }
  nlohmann::json d = {{"pool", pool}, {"policy", policy}, {"candidates", std::move(candidates)}};
  d["chosen"] = chosen.has_value() ? nlohmann::json(views[*chosen].id) : nlohmann::json(nullptr);
  d["why"] = !why.why.empty()     ? why.why
             : chosen.has_value() ? absl::StrCat(policy, "'s pick among the healthy workers")
                                  : "no healthy worker";
  return d;
}

}  // namespace

Placer::Placer(Cluster& cluster, RouterMetrics& metrics, std::function<std::shared_ptr<const RouterConfig>()> config)
    : cluster_(cluster), metrics_(metrics), config_(std::move(config)) {}

std::shared_ptr<RoutingState> Placer::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return routing_;
}

std::shared_ptr<RoutingState> Placer::Routing() {
  if (std::shared_ptr<RoutingState> rs = Current(); rs != nullptr) return rs;
  std::optional<tandem::v1::ModelInfo> info = cluster_.AnyModelInfo();
  if (!info.has_value()) return nullptr;
  std::lock_guard<std::mutex> build(build_mu_);
  if (std::shared_ptr<RoutingState> rs = Current(); rs != nullptr) return rs;  // built meanwhile
  std::shared_ptr<RoutingState> rs = Build(config_(), *info, nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  routing_ = rs;
  return routing_;
}

std::shared_ptr<RoutingState> Placer::Build(std::shared_ptr<const RouterConfig> config,
                                            const tandem::v1::ModelInfo& info, const RoutingState* prev) {
  auto rs = std::make_shared<RoutingState>();
  rs->config = config;
  rs->max_context = info.max_context_length();
  rs->vocab_size = info.vocab_size();
  // A cache-aware index must hash prompts exactly as the workers hash their blocks.
  rs->context = {.block_size = std::max(1, info.block_size()), .block_hash_seed = info.block_hash_seed()};
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    const std::optional<PoolConfig>& pool = role == PoolRole::kPrefill ? config->prefill : config->decode;
    if (!pool.has_value()) continue;
    const PolicyParams& params = pool->policy.params;
    const int r = static_cast<int>(role);
    if (prev != nullptr && prev->policy[r] != nullptr && prev->policy[r]->name() == pool->policy.name &&
        prev->params[r] == params && prev->context == rs->context) {
      rs->policy[r] = prev->policy[r];
    } else {
      absl::StatusOr<std::unique_ptr<RoutingPolicy>> p = registry.Create(pool->policy.name, params, rs->context);
      if (!p.ok()) {
        // Validated at load; only the workers' context could fail.
        LOG(ERROR) << PoolRoleName(role) << " pool policy: " << p.status().ToString();
        return nullptr;
      }
      rs->policy[r] = *std::move(p);
    }
    rs->params[r] = params;
    if (std::shared_ptr<KvIndex> index = rs->policy[r]->kv_index(); index != nullptr) {
      rs->index[r] = std::move(index);
      // Without events the index learns from routing decisions only (a kept
      // policy's index must stop receiving the events it got before).
      cluster_.SetKvIndex(role, config->kv_events.enabled ? rs->index[r] : nullptr);
    } else {
      cluster_.SetKvIndex(role, nullptr);
    }
  }
  return rs;
}

void Placer::Rebuild(std::shared_ptr<const RouterConfig> config) {
  std::lock_guard<std::mutex> build(build_mu_);
  std::shared_ptr<RoutingState> rs;
  if (std::optional<tandem::v1::ModelInfo> info = cluster_.AnyModelInfo(); info.has_value()) {
    rs = Build(std::move(config), *info, Current().get());
  }
  std::lock_guard<std::mutex> lock(mu_);
  routing_ = std::move(rs);  // null: built when a worker reports the model
}

absl::StatusOr<Placement> Placer::Place(const PlaceRequest& call, std::span<const int32_t> tokens,
                                        const TriedWorkers& tried) {
  std::shared_ptr<RoutingState> rs = Routing();
  if (rs == nullptr) {
    std::vector<std::shared_ptr<WorkerClient>> all = cluster_.Workers(PoolRole::kDecode);
    for (auto& w : cluster_.Workers(PoolRole::kPrefill)) all.push_back(std::move(w));
    const std::string refused = RefusedWorkers(all);
    // (A healthy worker here has not yet built the routing state: it may.)
    return MarkIfNothingToWaitFor(
        absl::UnavailableError(absl::StrCat("no healthy worker: none has reported the model yet",
                                            refused.empty() ? "" : absl::StrCat(" (", refused.substr(2), ")"))),
        all, /*healthy_ones_may_come=*/true);
  }
  const RouterConfig& cfg = *rs->config;
  RouteRequest rr{.tokens = tokens, .session_id = call.session_id};
  nlohmann::json explained = nlohmann::json::array();  // one decision per pool (x-tandem-explain)
  // The decode worker's KV domain once it is chosen: prefill workers of
  // another domain cannot hand it their KV and are passed over.
  std::string pair_domain, pair_address;
  // The chosen worker, and the prompt tokens the policy expects it to hold.
  auto pick = [&](PoolRole role, int64_t* cached_tokens) -> absl::StatusOr<std::shared_ptr<WorkerClient>> {
    const Clock::time_point start = Clock::now();
    const double cpu_start = ThreadCpuSeconds();
    std::vector<std::shared_ptr<WorkerClient>> workers = cluster_.Workers(role);
    std::vector<WorkerView> views;
    views.reserve(workers.size());
    // Tried by this request, and not admitted again since.
    std::vector<bool> passed_tried(workers.size(), false);
    for (size_t i = 0; i < workers.size(); ++i) {
      views.push_back(workers[i]->View());
      auto t = tried.find(workers[i]->address());
      if (t != tried.end() && workers[i]->admitted_at() <= t->second) {
        passed_tried[i] = true;
        views.back().healthy = false;
      }
    }
    const int64_t tried_here = std::count(passed_tried.begin(), passed_tried.end(), true);
    // Why a healthy worker was passed over (x-tandem-explain), by index.
    std::vector<std::string> passed_over(workers.size());
    // Domains first: a full worker is passed over only while a peer the
    // request could use has room.
    if (role == PoolRole::kPrefill && !pair_domain.empty()) {
      nlohmann::json skipped = nlohmann::json::array();
      bool any_left = false;
      for (size_t i = 0; i < workers.size(); ++i) {
        if (!views[i].healthy) continue;
        const std::string domain = workers[i]->kv_domain();
        if (domain.empty() || domain == pair_domain) {
          any_left = true;
          continue;
        }
        views[i].healthy = false;
        metrics_.kv_domain_skips.WithLabels({}).Inc();
        skipped.push_back(workers[i]->address());
        passed_over[i] =
            absl::StrFormat("kv_domain %s: its KV cannot reach the decode worker's (%s)", domain, pair_domain);
      }
      if (!skipped.empty() && !any_left) {
        warnings_.Warn("kv_domain_unpaired",
                       absl::StrFormat("no healthy prefill worker shares kv_domain %s with decode worker %s: its "
                                       "requests are prefilled locally",
                                       pair_domain, pair_address));
      }
      if (call.explain && !skipped.empty()) {
        explained.push_back(
            {{"pool", "prefill"},
             {"why", absl::StrFormat("kv_domain: the decode worker's is %s; these prefill workers' "
                                     "KV cannot reach it%s",
                                     pair_domain, any_left ? "" : " (none left: the decode worker prefills)")},
             {"skipped", skipped}});
      }
    }
    // KV awareness: a worker whose last load report had every KV block in
    // use (none free, none cached to evict) could only queue the request or
    // preempt another; it is passed over while a healthy peer has room.
    auto full = [](const WorkerView& v) { return v.healthy && v.total_blocks > 0 && v.used_blocks >= v.total_blocks; };
    const bool any_room =
        std::any_of(views.begin(), views.end(), [&](const WorkerView& v) { return v.healthy && !full(v); });
    for (size_t i = 0; i < views.size(); ++i) {
      WorkerView& v = views[i];
      if (any_room && full(v)) {
        v.healthy = false;
        passed_over[i] = "no free KV block";
        metrics_.kv_full_skips.WithLabels({PoolRoleName(role)}).Inc();
        warnings_.Warn("kv_full", absl::StrCat("worker ", v.id,
                                               " reports no free KV block: "
                                               "routing around it"));
      }
    }
    RoutingPolicy& policy = *rs->policy[static_cast<int>(role)];
    rr.cached_tokens = cached_tokens;
    RouteExplanation why;
    rr.explain = call.explain ? &why : nullptr;
    absl::StatusOr<size_t> i = policy.Pick(rr, views);
    if (call.explain) {
      explained.push_back(ExplainDecision(PoolRoleName(role), policy.name(), views, workers, passed_tried, passed_over,
                                          why, i.ok() ? std::optional<size_t>(*i) : std::nullopt));
    }
    if (!i.ok()) {
      // (Not a decision's time: a request waiting for a worker asks every tick.)
      return MarkIfNothingToWaitFor(
          absl::UnavailableError(absl::StrFormat(
              "no healthy %s worker (%d in the pool%s%s)", PoolRoleName(role), workers.size(),
              tried_here == 0 ? "" : absl::StrFormat(", %d already tried", tried_here), RefusedWorkers(workers))),
          workers, /*healthy_ones_may_come=*/false);
    }
    metrics_.decision.WithLabels({PoolRoleName(role)}).Observe(Seconds(Clock::now() - start));
    metrics_.decision_cpu.WithLabels({PoolRoleName(role)}).Observe(ThreadCpuSeconds() - cpu_start);
    metrics_.routed.WithLabels({PoolRoleName(role), policy.name(), workers[*i]->address()}).Inc();
    return workers[*i];
  };
  int64_t decode_cached = 0;
  ASSIGN_OR_RETURN(std::shared_ptr<WorkerClient> decode, pick(PoolRole::kDecode, &decode_cached));
  Placement p{.decode = decode, .decode_cached_tokens = decode_cached};
  pair_domain = decode->kv_domain();
  pair_address = decode->address();
  // Every return with a placement: the decision goes to /dashboard's recent
  // list; when asked, the explanation goes with the placement and into the
  // log as one line.
  auto finish = [&] {
    recent_.Add({.unix_ms = absl::ToUnixMillis(absl::Now()),
                 .request_id = call.request_id,
                 .decode_worker = p.decode->address(),
                 .prefill_worker = p.prefill != nullptr ? p.prefill->address() : "",
                 .prompt_tokens = static_cast<int64_t>(tokens.size()),
                 .expected_cached_tokens = p.prefill != nullptr ? p.prefill_cached_tokens : p.decode_cached_tokens});
    if (!call.explain) return;
    p.explanation = explained.dump();
    LOG(INFO) << "route " << call.request_id << " " << p.explanation;
  };
  const DisaggregationMode mode = cfg.disaggregation.mode;
  if (mode == DisaggregationMode::kNever || rs->policy[0] == nullptr) {
    finish();
    return p;
  }
  if (mode == DisaggregationMode::kAuto) {
    // The uncached part of the prompt as the decode worker holds it (the
    // decode pool's policy says, when it knows: kv_cache_aware).
    if (static_cast<int64_t>(tokens.size()) - decode_cached < cfg.disaggregation.auto_threshold_tokens) {
      p.local_prefill = true;
      explained.push_back({{"pool", "prefill"},
                           {"why", absl::StrFormat("disaggregation auto: %d uncached prompt tokens, under "
                                                   "auto_threshold_tokens %d: the decode worker prefills",
                                                   static_cast<int64_t>(tokens.size()) - decode_cached,
                                                   cfg.disaggregation.auto_threshold_tokens)}});
      finish();
      return p;
    }
  }
  absl::StatusOr<std::shared_ptr<WorkerClient>> prefill = pick(PoolRole::kPrefill, &p.prefill_cached_tokens);
  if (!prefill.ok()) {
    // No prefill worker: the decode worker prefills itself (degraded, not down).
    p.local_prefill = true;
    finish();
    return p;
  }
  if ((*prefill)->address() != decode->address()) p.prefill = *prefill;
  finish();
  return p;
}

}  // namespace tandem::router
