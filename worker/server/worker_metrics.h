// The worker's metrics, declared in one place: read from the engine and the
// KV hand-off at each scrape (the router's per-worker view is a sample of the
// same; these are exact), served by `tandem worker --metrics-port`.
#ifndef TANDEM_WORKER_SERVER_WORKER_METRICS_H_
#define TANDEM_WORKER_SERVER_WORKER_METRICS_H_

#include "common/metrics.h"
#include "worker/engine/engine.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {

// Registers every worker metric. REQUIRES: engine and service outlive the
// registry's last Render.
void RegisterWorkerMetrics(MetricsRegistry& r, const Engine& engine, const WorkerService& service);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_WORKER_METRICS_H_
