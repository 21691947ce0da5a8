// Cluster: the workers the router knows, by pool (prefill, decode), kept
// current in the background:
//   - membership: a static list, or a DNS name resolved every interval to
//     all its addresses (a Kubernetes headless Service); a worker that
//     leaves every pool is dropped (and forgotten by the KV indexes);
//   - health: every `health.interval_s` each worker gets Health, GetLoad
//     and (when new or restarted) GetModelInfo, in parallel, each bounded by
//     `health.timeout_s`; a worker that cannot serve beside the healthy ones
//     or with the router's tokenizer (compatibility.h) fails its check, with
//     an ERROR logged once per verdict; WorkerClient applies the
//     eject/readmit rules;
//   - KV events: each healthy worker's StreamKvEvents is subscribed: for a
//     pool with a KvIndex with a snapshot, its events applied to the index;
//     otherwise status only (unless SetStatusStreams(false)). A stream that
//     ends or sends a batch the index refuses is resubscribed at the next
//     check. A batch that says the worker drains ejects it at once
//     (WorkerDraining), ahead of its next health check.
// A worker listed in both pools (role both) is one WorkerClient, so its
// in-flight counts are shared.
//
// Thread safety: every public method is thread-safe. The background work
// runs on one health thread, one discovery thread (only when a pool uses
// DNS) and the GrpcPoller thread (KV event streams, health checks).
#ifndef TANDEM_ORCHESTRATOR_CLUSTER_CLUSTER_H_
#define TANDEM_ORCHESTRATOR_CLUSTER_CLUSTER_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "orchestrator/cluster/compatibility.h"
#include "orchestrator/cluster/worker_client.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/routing/kv_index.h"

namespace tandem::router {

enum class PoolRole { kPrefill = 0, kDecode = 1 };
inline constexpr int kNumPoolRoles = 2;
const char* PoolRoleName(PoolRole role);  // "prefill", "decode"

// Resolves `name` to every address it has (A and AAAA records), as
// "host:port" strings ("[v6]:port"), sorted, without duplicates; empty when
// the name definitely has none (no such name, or no address records).
// Unavailable naming the name when resolution fails (e.g. no answer).
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& name, int port);

class Cluster {
 public:
  struct Stats {
    uint64_t health_checks = 0;
    uint64_t health_check_failures = 0;
    uint64_t ejections = 0;     // healthy -> unhealthy, by health checks or a drain notice
    uint64_t readmissions = 0;  // unhealthy -> healthy after an ejection
    uint64_t dns_lookups = 0;   // discovery lookups of DNS pools
    uint64_t dns_failures = 0;  // of which failed (the last members kept)
  };

  // Called on the health thread whenever a worker's health changes
  // (address, healthy), e.g. for logs.
  using HealthListener = std::function<void(const std::string&, bool)>;

  // Workers are called over channels from `channels` (default: insecure).
  explicit Cluster(HealthConfig health,
                   std::shared_ptr<const tls::ChannelFactory> channels = tls::ChannelFactory::Insecure());
  ~Cluster();  // Stop()
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // Sets a pool's source of workers. A static list takes effect at once;
  // DNS at the discovery thread's next resolution (at once after Start).
  void SetPool(PoolRole role, const PoolConfig& pool);
  // Removes a pool (mode never has no prefill pool).
  void ClearPool(PoolRole role);
  // The index that the pool's workers' KV events feed; nullptr: none.
  void SetKvIndex(PoolRole role, std::shared_ptr<KvIndex> index);
  void SetHealthConfig(const HealthConfig& health);
  void SetHealthListener(HealthListener listener);
  // Whether workers of pools without a KvIndex get a status-only stream
  // (their drain; default true). false closes those streams.
  void SetStatusStreams(bool enabled);
  // The router's tokenizer, which every worker's must be (compatibility.h).
  void SetRouterTokenizer(RouterTokenizer tokenizer);

  // Starts the background threads; the first health round runs at once.
  void Start();
  // Stops the threads and cancels subscriptions, waiting for them. Idempotent.
  void Stop();
  // Runs one health round (and one DNS resolution) now and returns when it
  // is done. For startup and tests.
  void CheckNow();

  // The pool's workers, sorted by address.
  std::vector<std::shared_ptr<WorkerClient>> Workers(PoolRole role) const;
  bool HasPool(PoolRole role) const;
  // The ModelInfo of some healthy worker (decode pool first); nullopt if none.
  std::optional<tandem::v1::ModelInfo> AnyModelInfo() const;
  Stats stats() const;

 private:
  struct Pool {
    PoolConfig config;
    std::vector<std::string> addresses;  // current members
    std::shared_ptr<KvIndex> index;
  };
  struct Subscription;

  void HealthLoop();
  void DiscoveryLoop();
  void ResolvePools();
  void HealthRound();
  // Rebuilds workers_ from the pools' addresses. REQUIRES: mu_ held.
  void SyncWorkersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Indexes fed by `address`'s events.
  std::vector<std::shared_ptr<KvIndex>> IndexesFor(const std::string& address) const;
  void MaybeSubscribe(const std::shared_ptr<WorkerClient>& worker);
  // A worker's KV event stream said it drains: ejected at once (its health
  // checks, answered NOT_SERVING from now on, keep it out; a SERVING answer
  // from the same instance, sent before the drain, counts as failed).
  void WorkerDraining(const std::string& address, const std::string& instance_id);
  void CancelSubscription(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SubscriptionDone(const std::string& address, Subscription* sub);

  const std::shared_ptr<const tls::ChannelFactory> channels_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  HealthConfig health_ ABSL_GUARDED_BY(mu_);
  std::optional<Pool> pools_[kNumPoolRoles] ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<WorkerClient>> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Subscription*> subscriptions_ ABSL_GUARDED_BY(mu_);
  HealthListener listener_ ABSL_GUARDED_BY(mu_);
  bool status_streams_ ABSL_GUARDED_BY(mu_) = true;
  RouterTokenizer tokenizer_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool resolve_now_ ABSL_GUARDED_BY(mu_) = false;
  std::thread health_thread_;
  std::thread discovery_thread_;
  std::mutex round_mu_;  // one health round at a time
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CLUSTER_CLUSTER_H_
