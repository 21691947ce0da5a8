#include "orchestrator/server/router_metrics.h"

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "orchestrator/admission/admission.h"
#include "orchestrator/cluster/cluster.h"
#include "orchestrator/http/http_server.h"
#include "orchestrator/server/placement.h"

namespace tandem::router {
namespace {

// Routing decision histograms' bounds, with 50, 75, 100 and 150 us among
// them: the decision's budget is 100 us.
std::vector<double> DecisionBuckets() {
  return {1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4,
          5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2,   0.1,  0.5,    1};
}

}  // namespace

RouterMetrics::RouterMetrics(MetricsRegistry& r)
    : requests(r.AddCounter("tandem_router_requests_total", "Requests answered, by endpoint and HTTP status.",
                            {"endpoint", "code"})),
      ttft(r.AddHistogram("tandem_router_time_to_first_token_seconds",
                          "From arrival at the router to the first generated token.", {"mode"},
                          ExponentialBuckets(0.001, 2, 17))),
      itl(r.AddHistogram("tandem_router_inter_token_latency_seconds", "Time between consecutive tokens of one choice.",
                         {"mode"}, ExponentialBuckets(0.0005, 2, 15))),
      e2e(r.AddHistogram("tandem_router_e2e_request_latency_seconds", "From arrival to the last byte of the response.",
                         {"endpoint"}, ExponentialBuckets(0.001, 2, 20))),
      queue_time(r.AddHistogram("tandem_router_queue_time_seconds", "Time a request waited for an admission slot.", {},
                                ExponentialBuckets(0.0001, 2, 20))
                     .Get()),
      decision(r.AddHistogram("tandem_router_routing_decision_seconds",
                              "Time to choose a worker, by pool (decisions that found one).", {"pool"},
                              DecisionBuckets())),
      decision_cpu(r.AddHistogram("tandem_router_routing_decision_cpu_seconds",
                                  "CPU time of the thread choosing a worker, by pool: the decision's own cost, without "
                                  "the time the thread was preempted (which the wall-clock histogram includes).",
                                  {"pool"}, DecisionBuckets())),
      routed(r.AddCounter("tandem_router_routed_total", "Routing decisions, by pool, policy and chosen worker.",
                          {"pool", "policy", "worker"})),
      outcomes(r.AddCounter("tandem_router_worker_outcomes_total",
                            "Finished generations, by decode worker and outcome.", {"worker", "outcome"})),
      fallbacks(r.AddCounter("tandem_router_fallbacks_total",
                             "Disaggregation fallbacks: local_prefill (placed aggregated on the "
                             "decode worker), kv_transfer (the KV never reached it).",
                             {"kind"})),
      reloads(r.AddCounter("tandem_router_config_reloads_total",
                           "Config reloads (SIGHUP), by result: ok, error (the running "
                           "config stays), or deferred (also counted ok: it changed keys that "
                           "apply at the next restart, which were kept as they run).",
                           {"result"})),
      retries(r.AddCounter("tandem_router_retries_total", "Attempts repeated on another worker before the first token.")
                  .Get()),
      failovers(r.AddCounter("tandem_router_failovers_total",
                             "Generations resumed on another decode worker after tokens were "
                             "sent, by reason: error (the worker's stream failed) or stall (no "
                             "token within retries.attempt_idle_s / attempt_first_token_s).",
                             {"reason"})),
      attempt_timeouts(
          r.AddCounter("tandem_router_attempt_timeouts_total",
                       "Attempts past their deadline, by phase: first_token (retries.attempt_first_token_s) "
                       "or idle (retries.attempt_idle_s, mid-stream); moved to another worker when one was "
                       "healthy.",
                       {"phase"})),
      worker_waits(r.AddCounter("tandem_router_worker_waits_total",
                                "Generations that found no healthy worker and waited for one "
                                "(retries.wait_for_worker_s), by how the wait ended: placed, expired (the "
                                "request failed 503) or cancelled (the client left, a timeout, shutdown).",
                                {"outcome"})),
      prompt_tokens(r.AddCounter("tandem_router_prompt_tokens_total", "Prompt tokens served.").Get()),
      cached_tokens(
          r.AddCounter("tandem_router_cached_prompt_tokens_total", "Prompt tokens served from a worker's prefix cache.")
              .Get()),
      expected_cached_tokens(r.AddCounter("tandem_router_expected_cached_prompt_tokens_total",
                                          "Prompt tokens the routing policy expected the chosen worker to hold in "
                                          "its prefix cache (kv_cache_aware; 0 where a policy cannot tell). Against "
                                          "tandem_router_cached_prompt_tokens_total: how well the router's KV index "
                                          "knows the workers' caches.")
                                 .Get()),
      generation_tokens(r.AddCounter("tandem_router_generation_tokens_total", "Tokens generated.").Get()),
      kv_bytes(
          r.AddCounter("tandem_router_kv_transfer_bytes_total", "KV bytes pulled by decode workers for split requests.")
              .Get()),
      auth_failures(r.AddCounter("tandem_router_auth_failures_total",
                                 "Requests refused by API key checks, by reason: missing, "
                                 "malformed, unknown (401) and forbidden (a non-admin key on an "
                                 "admin endpoint, 403).",
                                 {"reason"})),
      rate_limited(r.AddCounter("tandem_router_rate_limited_total",
                                "Requests refused (429) by a per-key limit, by key name and "
                                "limit: requests_per_s, tokens_per_min, max_concurrent.",
                                {"key", "limit"})),
      refusals(r.AddCounter("tandem_router_admission_refusals_total",
                            "Requests refused before running, by reason: queue_full (429), "
                            "n_over_max_in_flight (400), tokenize_too_large (400).",
                            {"reason"})),
      kv_full_skips(r.AddCounter("tandem_router_kv_full_skips_total",
                                 "Routing decisions that passed over a worker whose last load "
                                 "report had every KV block in use, by pool.",
                                 {"pool"})),
      kv_domain_skips(r.AddCounter("tandem_router_kv_domain_skips_total",
                                   "Prefill workers passed over because their KV cannot reach the chosen "
                                   "decode worker's (another kv_domain: another host for cuda_ipc or UCX "
                                   "over shared memory).",
                                   {})) {}

void RegisterRouterGauges(MetricsRegistry& registry, const RouterGaugeSources& sources) {
  Cluster* cluster = sources.cluster;
  registry.AddCallbackGauge("tandem_router_worker_in_flight", "Requests the router has in flight on each worker.",
                            {"pool", "worker"}, [cluster, sources](MetricEmitter& e) {
                              for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
                                for (const auto& w : cluster->Workers(role)) {
                                  e.Emit({PoolRoleName(role), w->address()}, w->in_flight());
                                }
                              }
                            });
  registry.AddCallbackGauge("tandem_router_worker_healthy", "1 when the worker is healthy (routable).",
                            {"pool", "worker"}, [cluster, sources](MetricEmitter& e) {
                              for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
                                for (const auto& w : cluster->Workers(role)) {
                                  e.Emit({PoolRoleName(role), w->address()}, w->healthy() ? 1 : 0);
                                }
                              }
                            });
  registry.AddCallbackGauge("tandem_router_worker_incompatible",
                            "1 when the worker is refused because it cannot serve in this cluster: its tokenizer is "
                            "not the router's, or its model, KV layout, block size or block hash seed differ from the "
                            "serving workers' (the router's log and /health say why).",
                            {"pool", "worker"}, [cluster, sources](MetricEmitter& e) {
                              for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
                                for (const auto& w : cluster->Workers(role)) {
                                  e.Emit({PoolRoleName(role), w->address()}, w->incompatibility().empty() ? 0 : 1);
                                }
                              }
                            });
  // Series of each worker's last load report, one per state.
  using LoadStates = std::vector<std::pair<const char*, double>>;
  auto per_worker_load = [cluster, sources](LoadStates (*states)(const tandem::v1::LoadReport&)) {
    return [cluster, states](MetricEmitter& e) {
      for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
        for (const auto& w : cluster->Workers(role)) {
          std::optional<tandem::v1::LoadReport> l = w->last_load();
          if (!l.has_value()) continue;
          for (const auto& [state, value] : states(*l)) {
            e.Emit({PoolRoleName(role), w->address(), state}, value);
          }
        }
      }
    };
  };
  registry.AddCallbackGauge("tandem_router_worker_kv_blocks",
                            "Each worker's KV blocks by state, as its last health check's load report said: free, "
                            "used (referenced by requests), cached (evictable prefix cache), quarantined (a failed "
                            "transfer's destination, briefly out of use).",
                            {"pool", "worker", "state"}, per_worker_load([](const tandem::v1::LoadReport& l) {
                              return LoadStates{{"free", static_cast<double>(l.free_blocks())},
                                                {"used", static_cast<double>(l.used_blocks())},
                                                {"cached", static_cast<double>(l.cached_blocks())},
                                                {"quarantined", static_cast<double>(l.quarantined_blocks())}};
                            }));
  registry.AddCallbackGauge("tandem_router_worker_sequences",
                            "Each worker's sequences by state, as its last health check's load report said: running, "
                            "waiting, reserved (decode: waiting for their KV), prefilled (prefill: holding KV until "
                            "it is sent).",
                            {"pool", "worker", "state"}, per_worker_load([](const tandem::v1::LoadReport& l) {
                              return LoadStates{{"running", static_cast<double>(l.running_sequences())},
                                                {"waiting", static_cast<double>(l.waiting_sequences())},
                                                {"reserved", static_cast<double>(l.reserved_requests())},
                                                {"prefilled", static_cast<double>(l.prefilled_requests())}};
                            }));
  registry.AddCallbackGauge("tandem_router_kv_index_blocks", "Entries in a pool's KV index (kv_cache_aware).", {"pool"},
                            [cluster, sources](MetricEmitter& e) {
                              std::shared_ptr<RoutingState> rs = sources.placer->Current();
                              if (rs == nullptr) return;
                              for (int r = 0; r < kNumPoolRoles; ++r) {
                                if (rs->index[r] != nullptr) {
                                  e.Emit({PoolRoleName(static_cast<PoolRole>(r))},
                                         static_cast<double>(rs->index[r]->size()));
                                }
                              }
                            });
  registry.AddCallbackGauge(
      "tandem_router_kv_index_workers",
      "Workers in a pool's KV index by mode: exact (fed by KV events), approximate (from the "
      "router's own decisions, with a TTL) or stale (events lost, resyncing).",
      {"pool", "mode"}, [cluster, sources](MetricEmitter& e) {
        std::shared_ptr<RoutingState> rs = sources.placer->Current();
        if (rs == nullptr) return;
        for (int r = 0; r < kNumPoolRoles; ++r) {
          if (rs->index[r] == nullptr) continue;
          int count[3] = {0, 0, 0};
          for (const KvIndex::WorkerInfo& w : rs->index[r]->workers()) {
            ++count[static_cast<int>(w.mode)];
          }
          // Workers with no entry yet are approximate.
          const int known = count[0] + count[1] + count[2];
          const int pool = static_cast<int>(cluster->Workers(static_cast<PoolRole>(r)).size());
          if (pool > known) count[static_cast<int>(WorkerMode::kApproximate)] += pool - known;
          for (WorkerMode m : {WorkerMode::kApproximate, WorkerMode::kExact, WorkerMode::kStale}) {
            e.Emit({PoolRoleName(static_cast<PoolRole>(r)), WorkerModeName(m)}, count[static_cast<int>(m)]);
          }
        }
      });
  // The KV index's bookkeeping: what its workers' event streams brought.
  auto each_index = [sources](const std::function<void(const char*, const KvIndex&)>& f) {
    std::shared_ptr<RoutingState> rs = sources.placer->Current();
    if (rs == nullptr) return;
    for (int r = 0; r < kNumPoolRoles; ++r) {
      if (rs->index[r] != nullptr) f(PoolRoleName(static_cast<PoolRole>(r)), *rs->index[r]);
    }
  };
  // Counters read from each index's Stats: (label value, the Stats field).
  using StatField = std::pair<const char*, uint64_t KvIndex::Stats::*>;
  auto index_counter = [&registry, each_index](const char* name, const char* help, const char* label,
                                               std::vector<StatField> fields) {
    registry.AddCallbackCounter(name, help, {"pool", label}, [each_index, fields](MetricEmitter& e) {
      each_index([&](const char* pool, const KvIndex& index) {
        const KvIndex::Stats s = index.stats();
        for (const auto& [value, field] : fields) e.Emit({pool, value}, static_cast<double>(s.*field));
      });
    });
  };
  index_counter("tandem_router_kv_events_total",
                "KV events from the workers' streams by outcome: applied to the pool's KV index, or "
                "skipped (already applied: a replay after a resubscription).",
                "outcome",
                {{"applied", &KvIndex::Stats::events_applied}, {"skipped", &KvIndex::Stats::events_replayed}});
  index_counter("tandem_router_kv_event_batches_dropped_total",
                "KV event batches the index refused, by reason: seq_gap (events were lost), "
                "malformed, or worker_restart (a new instance: its entries dropped); the worker is "
                "stale until its snapshot arrives.",
                "reason",
                {{"seq_gap", &KvIndex::Stats::seq_gaps},
                 {"malformed", &KvIndex::Stats::bad_batches},
                 {"worker_restart", &KvIndex::Stats::restarts}});
  index_counter("tandem_router_kv_index_entries_dropped_total",
                "KV index entries dropped: evicted (the index's memory cap), expired (approximate "
                "entries past their TTL), snapshot_truncated (a snapshot beyond the cap).",
                "reason",
                {{"evicted", &KvIndex::Stats::evictions},
                 {"expired", &KvIndex::Stats::expirations},
                 {"snapshot_truncated", &KvIndex::Stats::snapshot_blocks_truncated}});
  registry.AddCallbackGauge("tandem_router_kv_index_worker_blocks",
                            "Each worker's entries in its pool's KV index, with its mode (exact, approximate, stale).",
                            {"pool", "worker", "mode"}, [each_index](MetricEmitter& e) {
                              each_index([&e](const char* pool, const KvIndex& index) {
                                for (const KvIndex::WorkerInfo& w : index.workers()) {
                                  e.Emit({pool, w.id, WorkerModeName(w.mode)}, static_cast<double>(w.blocks));
                                }
                              });
                            });
  registry.AddCallbackGauge("tandem_router_kv_index_worker_age_seconds",
                            "Seconds since the KV index applied a worker's last event batch (absent before the "
                            "first): an idle worker sends none, a growing age on a busy one means lost events.",
                            {"pool", "worker"}, [each_index](MetricEmitter& e) {
                              const auto now = std::chrono::steady_clock::now();
                              each_index([&e, now](const char* pool, const KvIndex& index) {
                                for (const KvIndex::WorkerInfo& w : index.workers()) {
                                  if (w.last_batch.has_value()) {
                                    e.Emit({pool, w.id}, std::chrono::duration<double>(now - *w.last_batch).count());
                                  }
                                }
                              });
                            });
  registry.AddCallbackCounter(
      "tandem_router_policy_events_total",
      "Events a pool's routing policy counts: sticky_session repins and evictions, prefix_aware "
      "spillovers and ring_builds, kv_cache_aware requested_blocks and matched_blocks (their "
      "ratio is the predicted prefix hit rate).",
      {"pool", "policy", "event"}, [cluster, sources](MetricEmitter& e) {
        std::shared_ptr<RoutingState> rs = sources.placer->Current();
        if (rs == nullptr) return;
        for (int r = 0; r < kNumPoolRoles; ++r) {
          if (rs->policy[r] == nullptr) continue;
          const std::string pool = PoolRoleName(static_cast<PoolRole>(r));
          for (const auto& [event, value] : rs->policy[r]->Counters()) {
            e.Emit({pool, rs->policy[r]->name(), event}, static_cast<double>(value));
          }
        }
      });
  registry.AddCallbackCounter("tandem_router_http_connections_total",
                              "Client connections accepted (one serves many requests with "
                              "keep-alive).",
                              {}, [cluster, sources](MetricEmitter& e) {
                                if (const http::HttpServer* http = sources.http(); http != nullptr) {
                                  e.Emit({}, static_cast<double>(http->connection_stats().accepted));
                                }
                              });
  registry.AddCallbackCounter("tandem_router_http_connections_refused_total",
                              "Client connections refused (503 and closed) at "
                              "limits.max_connections.",
                              {}, [cluster, sources](MetricEmitter& e) {
                                if (const http::HttpServer* http = sources.http(); http != nullptr) {
                                  e.Emit({}, static_cast<double>(http->connection_stats().refused));
                                }
                              });
  registry.AddCallbackGauge("tandem_router_http_open_connections", "Client connections open.", {},
                            [cluster, sources](MetricEmitter& e) {
                              if (const http::HttpServer* http = sources.http(); http != nullptr) {
                                e.Emit({}, static_cast<double>(http->connection_stats().open));
                              }
                            });
  registry.AddCallbackCounter("tandem_router_health_checks_total", "Active health checks, by result.", {"result"},
                              [cluster, sources](MetricEmitter& e) {
                                const Cluster::Stats s = cluster->stats();
                                e.Emit({"ok"}, static_cast<double>(s.health_checks - s.health_check_failures));
                                e.Emit({"failed"}, static_cast<double>(s.health_check_failures));
                              });
  registry.AddCallbackCounter("tandem_router_dns_lookups_total",
                              "Discovery lookups of DNS pools, by result (failed: the last members are kept; a name "
                              "with no addresses is a successful lookup that empties the pool).",
                              {"result"}, [cluster, sources](MetricEmitter& e) {
                                const Cluster::Stats s = cluster->stats();
                                e.Emit({"ok"}, static_cast<double>(s.dns_lookups - s.dns_failures));
                                e.Emit({"failed"}, static_cast<double>(s.dns_failures));
                              });
  registry.AddCallbackCounter("tandem_router_worker_ejections_total",
                              "Workers ejected by failed health checks (readmissions are counted apart).", {"kind"},
                              [cluster, sources](MetricEmitter& e) {
                                const Cluster::Stats s = cluster->stats();
                                e.Emit({"ejected"}, static_cast<double>(s.ejections));
                                e.Emit({"readmitted"}, static_cast<double>(s.readmissions));
                              });
  // Admission's state, read when scraped.
  const Admission* admission = sources.admission;
  registry.AddCallbackGauge(
      "tandem_router_queue_depth", "Requests waiting for a slot.", {},
      [admission](MetricEmitter& e) { e.Emit({}, static_cast<double>(admission->stats().queued)); });
  registry.AddCallbackGauge(
      "tandem_router_in_flight_requests", "Requests running on workers (router-wide).", {},
      [admission](MetricEmitter& e) { e.Emit({}, static_cast<double>(admission->stats().running_requests)); });
  const Placer* placer = sources.placer;
  registry.AddCallbackGauge("tandem_router_waiting_for_worker",
                            "Generations waiting now for a healthy worker to go to (retries.wait_for_worker_s).", {},
                            [placer](MetricEmitter& e) { e.Emit({}, static_cast<double>(placer->waiting())); });
  registry.AddCallbackGauge(
      "tandem_router_in_flight_sequences",
      "Sequences (choices: a request with n = 8 runs 8) running on workers, against "
      "limits.max_in_flight.",
      {}, [admission](MetricEmitter& e) { e.Emit({}, static_cast<double>(admission->stats().in_flight_sequences)); });
}

}  // namespace tandem::router
