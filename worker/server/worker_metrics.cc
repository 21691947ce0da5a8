#include "worker/server/worker_metrics.h"

namespace tandem::worker {

void RegisterWorkerMetrics(MetricsRegistry& r, const Engine& engine, const WorkerService& service) {
  const auto load = [&engine] { return engine.GetLoad(); };
  r.AddCallbackGauge("tandem_worker_sequences",
                     "Sequences by state: running (in the batch), "
                     "waiting (queued), reserved (decode: waiting for their KV), prefilled "
                     "(prefill: holding KV for a decode worker).",
                     {"state"}, [load](MetricEmitter& e) {
                       const LoadSnapshot l = load();
                       e.Emit({"running"}, l.running);
                       e.Emit({"waiting"}, l.waiting);
                       e.Emit({"reserved"}, l.reserved);
                       e.Emit({"prefilled"}, l.prefilled);
                     });
  r.AddCallbackGauge("tandem_worker_kv_blocks",
                     "KV cache blocks by state (cached: free but holding a reusable prefix; "
                     "quarantined: a failed transfer's, briefly unused).",
                     {"state"}, [load](MetricEmitter& e) {
                       const LoadSnapshot l = load();
                       e.Emit({"used"}, static_cast<double>(l.used_blocks));
                       e.Emit({"free"}, static_cast<double>(l.free_blocks));
                       e.Emit({"cached"}, static_cast<double>(l.cached_blocks));
                       e.Emit({"quarantined"}, static_cast<double>(l.quarantined_blocks));
                       e.Emit({"total"}, static_cast<double>(l.total_blocks));
                     });
  r.AddCallbackGauge("tandem_worker_tokens_in_flight",
                     "Prompt and generated tokens of the "
                     "sequences in the engine.",
                     {}, [load](MetricEmitter& e) { e.Emit({}, static_cast<double>(load().tokens_in_flight)); });
  r.AddCallbackCounter("tandem_worker_prefix_tokens_total",
                       "Prompt tokens looked up in the "
                       "prefix cache (queried) and found there (hit).",
                       {"kind"}, [load](MetricEmitter& e) {
                         const LoadSnapshot l = load();
                         e.Emit({"queried"}, static_cast<double>(l.prefix_query_tokens));
                         e.Emit({"hit"}, static_cast<double>(l.prefix_hit_tokens));
                       });
  r.AddCallbackCounter("tandem_worker_events_total",
                       "Engine events: finished requests, "
                       "preemptions, and the degraded disaggregation paths (expired_reservation: "
                       "the KV never came; local_prefill: prefilled here instead; "
                       "reservation_refused; expired_handoff: prefilled KV never taken).",
                       {"event"}, [load](MetricEmitter& e) {
                         const LoadSnapshot l = load();
                         e.Emit({"finished"}, static_cast<double>(l.finished));
                         e.Emit({"preemption"}, static_cast<double>(l.preemptions));
                         e.Emit({"expired_reservation"}, static_cast<double>(l.expired_reservations));
                         e.Emit({"local_prefill"}, static_cast<double>(l.local_prefill_fallbacks));
                         e.Emit({"reservation_refused"}, static_cast<double>(l.reservations_refused));
                         e.Emit({"expired_handoff"}, static_cast<double>(l.expired_handoffs));
                       });
  const auto kv = [&service] { return service.kv_stats(); };
  r.AddCallbackCounter("tandem_worker_kv_transfer_bytes_total",
                       "KV bytes pulled from prefill workers, verified and committed (decode).", {},
                       [kv](MetricEmitter& e) { e.Emit({}, static_cast<double>(kv().bytes_pulled)); });
  r.AddCallbackCounter("tandem_worker_kv_transfer_seconds_total",
                       "Time the committed KV pulls took (decode): over "
                       "tandem_worker_kv_transfers_total{outcome=\"pulled\"}, the mean latency.",
                       {}, [kv](MetricEmitter& e) { e.Emit({}, kv().pull_seconds); });
  r.AddCallbackCounter("tandem_worker_kv_transfers_total",
                       "KV hand-offs by outcome: pulled and pull_failed (decode; checksum_failed "
                       "among the failures), sent and send_failed (prefill).",
                       {"outcome"}, [kv](MetricEmitter& e) {
                         const KvHandoffStats k = kv();
                         e.Emit({"pulled"}, static_cast<double>(k.pulls));
                         e.Emit({"pull_failed"}, static_cast<double>(k.pull_failures));
                         e.Emit({"checksum_failed"}, static_cast<double>(k.checksum_failures));
                         e.Emit({"sent"}, static_cast<double>(k.handoffs));
                         e.Emit({"send_failed"}, static_cast<double>(k.handoff_failures));
                       });
  r.AddCallbackGauge("tandem_worker_serving",
                     "1 while the worker takes new requests (0 while "
                     "loading or draining).",
                     {}, [&service](MetricEmitter& e) { e.Emit({}, service.serving() ? 1 : 0); });
}

}  // namespace tandem::worker
