// WorkerClient: the router's handle on one worker process. It owns the gRPC
// channel and stub, the worker's health state (active checks plus passive
// ejection on transport failures), the last LoadReport and ModelInfo the
// worker sent, and the router's own accounting of what it has in flight
// there (requests, and prompt tokens not yet prefilled that the policy did
// not expect the worker to hold in its cache), which the routing
// policies read through View().
//
// Health state machine (Envoy's active health checking with outlier
// ejection, in small):
//   - a new worker starts unhealthy and is admitted after `healthy_after`
//     consecutive successful checks (1 for the first admission, so a router
//     that starts with its workers serves within one check);
//   - a healthy worker is ejected after `unhealthy_after` consecutive failed
//     checks, or at once by Eject() when a request meets a transport failure
//     (connection refused or reset: the process is gone) or a check is
//     answered NOT_SERVING (it drains);
//   - an ejected worker is readmitted after `healthy_after` consecutive
//     successful checks.
//
// Thread safety: every method is thread-safe. Counters are atomics; the
// model info and the health streak are guarded by a mutex.
#ifndef TANDEM_ORCHESTRATOR_CLUSTER_WORKER_CLIENT_H_
#define TANDEM_ORCHESTRATOR_CLUSTER_WORKER_CLIENT_H_

#include <grpcpp/support/channel_arguments.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "common/tls.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/routing/routing_policy.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::router {

class WorkerClient {
 public:
  // Creates the channel from `channels` (mutual TLS or insecure, as the
  // router's tls config says; connects lazily). Reconnection backoff is
  // capped at a second or two so a restarted worker is back quickly.
  WorkerClient(std::string address, const tls::ChannelFactory& channels);
  explicit WorkerClient(std::string address) : WorkerClient(std::move(address), *tls::ChannelFactory::Insecure()) {}
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  // The arguments of every channel to a worker.
  static grpc::ChannelArguments ChannelArgs();
  // Keepalive pings on every channel to a worker (see ChannelArgs).
  static constexpr int kKeepaliveTimeMs = 4000;
  static constexpr int kKeepaliveTimeoutMs = 3000;

  const std::string& address() const { return address_; }
  tandem::v1::Worker::Stub& stub() const { return *stub_; }

  bool healthy() const { return healthy_.load(std::memory_order_acquire); }
  // Records one active check; returns true when it changed healthy().
  bool RecordCheck(bool ok, const HealthConfig& config);
  // Ejects the worker now (a request saw it gone); true if it was healthy.
  bool Eject();
  // When its health checks last admitted it (made it healthy); the clock's
  // epoch before the first admission.
  std::chrono::steady_clock::time_point admitted_at() const {
    std::lock_guard<std::mutex> lock(mu_);
    return admitted_at_;
  }
  // True once the worker has been admitted (healthy) at least once.
  bool ever_healthy() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ever_healthy_;
  }

  // Router-side accounting; see InFlight below.
  int in_flight() const { return in_flight_.load(std::memory_order_relaxed); }
  int64_t prefill_tokens_in_flight() const { return prefill_tokens_.load(std::memory_order_relaxed); }

  // The load figures routing reads (KV blocks used and total).
  void SetLoad(const tandem::v1::LoadReport& load);
  void SetModelInfo(const tandem::v1::ModelInfo& info);
  std::optional<tandem::v1::ModelInfo> model_info() const;
  // Its ModelInfo's kv_domain ("" before the model info came): what routing
  // reads per request, without copying the whole ModelInfo.
  std::string kv_domain() const;
  // The last LoadReport of a health check; nullopt before the first.
  std::optional<tandem::v1::LoadReport> last_load() const;
  // Why the worker cannot serve in this cluster (compatibility.h), as the
  // last health check found; empty when it can.
  std::string incompatibility() const;
  // Records a health check's verdict; true when it changed.
  bool SetIncompatibility(std::string why);
  // The worker instance that said it drains (on its KV event stream). A
  // SERVING answer from that instance (sent before its drain) is not a
  // successful check (Drains); a restarted worker, a new instance, is.
  void SetDraining(std::string instance_id);
  bool Drains(const std::string& instance_id) const;

  // The worker as a routing policy sees it.
  WorkerView View() const;

 private:
  friend class InFlight;

  const std::string address_;
  std::unique_ptr<tandem::v1::Worker::Stub> stub_;
  std::atomic<bool> healthy_{false};
  std::atomic<int> in_flight_{0};
  std::atomic<int64_t> prefill_tokens_{0};
  std::atomic<int64_t> used_blocks_{0};
  std::atomic<int64_t> total_blocks_{0};
  std::atomic<int64_t> prefill_tokens_per_step_{0};  // ModelInfo.max_batched_tokens

  mutable std::mutex mu_;
  bool ever_healthy_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point admitted_at_ ABSL_GUARDED_BY(mu_);
  int streak_ ABSL_GUARDED_BY(mu_) = 0;  // > 0: successes in a row; < 0: failures
  std::optional<tandem::v1::ModelInfo> model_info_ ABSL_GUARDED_BY(mu_);
  std::optional<tandem::v1::LoadReport> last_load_ ABSL_GUARDED_BY(mu_);
  std::string incompatibility_ ABSL_GUARDED_BY(mu_);
  std::string draining_instance_ ABSL_GUARDED_BY(mu_);
};

// The channels to workers that the router's tls config asks for: mutual TLS
// with the files read and checked now (InvalidArgument "tls.cert (PATH):
// why"), or insecure (with a WARNING in the log).
absl::StatusOr<std::shared_ptr<const tls::ChannelFactory>> WorkerChannelsFor(const TlsConfig& tls);

// One request's presence on a worker, for the router's accounting: counts a
// request in flight and its prompt tokens to compute (those the policy did
// not expect cached) as pending prefill from construction; PrefillDone()
// when the first token arrives; everything is given back at destruction (so
// an error path cannot leak a count).
class InFlight {
 public:
  InFlight() = default;
  InFlight(std::shared_ptr<WorkerClient> worker, int64_t prefill_tokens);
  InFlight(InFlight&& other) noexcept;
  InFlight& operator=(InFlight&& other) noexcept;
  ~InFlight();

  void PrefillDone();
  const std::shared_ptr<WorkerClient>& worker() const { return worker_; }

 private:
  void Release();

  std::shared_ptr<WorkerClient> worker_;
  int64_t prefill_tokens_ = 0;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CLUSTER_WORKER_CLIENT_H_
