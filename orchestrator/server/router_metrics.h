// The router's metrics, declared in one place: RouterMetrics holds the
// series the request path updates (counters and histograms, by name in
// router_metrics.cc), and RegisterRouterGauges the series read when
// /metrics is scraped (workers, KV indexes, policies, connections,
// admission).
#ifndef TANDEM_ORCHESTRATOR_SERVER_ROUTER_METRICS_H_
#define TANDEM_ORCHESTRATOR_SERVER_ROUTER_METRICS_H_

#include <functional>

#include "common/metrics.h"

namespace tandem::http {
class HttpServer;
}  // namespace tandem::http

namespace tandem::router {

class Admission;
class Cluster;
class Placer;

struct RouterMetrics {
  explicit RouterMetrics(MetricsRegistry& r);
  CounterFamily& requests;
  HistogramFamily& ttft;
  HistogramFamily& itl;
  HistogramFamily& e2e;
  Histogram& queue_time;
  HistogramFamily& decision;
  HistogramFamily& decision_cpu;
  CounterFamily& routed;
  CounterFamily& outcomes;
  CounterFamily& fallbacks;
  CounterFamily& reloads;
  Counter& retries;
  CounterFamily& failovers;
  CounterFamily& attempt_timeouts;
  CounterFamily& worker_waits;
  Counter& prompt_tokens;
  Counter& cached_tokens;
  Counter& expected_cached_tokens;
  Counter& generation_tokens;
  Counter& kv_bytes;
  CounterFamily& auth_failures;
  CounterFamily& rate_limited;
  CounterFamily& refusals;
  CounterFamily& kv_full_skips;
  CounterFamily& kv_domain_skips;
};

struct RouterGaugeSources {
  Cluster* cluster = nullptr;
  const Placer* placer = nullptr;
  const Admission* admission = nullptr;
  // The HTTP server once started; null before.
  std::function<const http::HttpServer*()> http;
};

// Registers the gauges and counters read at scrape time. REQUIRES: the
// sources outlive `registry`'s last Render.
void RegisterRouterGauges(MetricsRegistry& registry, const RouterGaugeSources& sources);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_ROUTER_METRICS_H_
