#include "orchestrator/cluster/cluster.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/grpc_poller.h"
#include "common/logging.h"
#include "common/thread_util.h"

namespace tandem::router {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

const char* PoolRoleName(PoolRole role) { return role == PoolRole::kPrefill ? "prefill" : "decode"; }

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& name, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &result);
  if (rc == EAI_NONAME || rc == EAI_NODATA) {
    // A definite answer: the name has no addresses (a headless Service with
    // no ready pods). The pool is empty, unlike after a failed lookup.
    return std::vector<std::string>{};
  }
  if (rc != 0) {
    return absl::UnavailableError(absl::StrFormat("resolving %s: %s", name, gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (ai->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr, text, sizeof text);
      out.insert(absl::StrFormat("%s:%d", text, port));
    } else if (ai->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr, text, sizeof text);
      out.insert(absl::StrFormat("[%s]:%d", text, port));
    }
  }
  freeaddrinfo(result);
  return std::vector<std::string>(out.begin(), out.end());
}

// One worker's KV event stream, read on the process's GrpcPoller and applied
// to the indexes of its pools; with no index, the stream's status only (the
// worker's drain). Deletes itself when the call ends, after telling the
// cluster.
struct Cluster::Subscription final : GrpcReader<tandem::v1::KvEventBatch> {
  Subscription(Cluster* c, std::string addr, std::vector<std::shared_ptr<KvIndex>> idx)
      : cluster(c), address(std::move(addr)), indexes(std::move(idx)) {}

  void Start(tandem::v1::Worker::Stub& stub) {
    if (indexes.empty()) {
      request.set_status_only(true);
    } else {
      request.set_snapshot(true);
    }
    StartReading(stub.PrepareAsyncStreamKvEvents(&context, request, GrpcPoller::Shared().cq()));
  }

  // False (and the call cancelled) when an index refused the batch.
  bool OnMessage(const tandem::v1::KvEventBatch& batch) override {
    if (batch.draining()) cluster->WorkerDraining(address, batch.instance_id());
    for (const std::shared_ptr<KvIndex>& index : indexes) {
      const absl::Status s = index->Apply(address, batch);
      if (!s.ok()) {
        LOG(WARNING) << "KV events from " << address << ": " << s.ToString() << "; resubscribing with a snapshot";
        context.TryCancel();
        return false;
      }
    }
    return true;
  }

  void OnEnd(const grpc::Status& /*status*/) override {
    cluster->SubscriptionDone(address, this);
    delete this;
  }

  Cluster* const cluster;
  const std::string address;
  const std::vector<std::shared_ptr<KvIndex>> indexes;
  grpc::ClientContext context;
  tandem::v1::KvEventsRequest request;
};

Cluster::Cluster(HealthConfig health, std::shared_ptr<const tls::ChannelFactory> channels)
    : channels_(std::move(channels)), health_(health) {}

Cluster::~Cluster() { Stop(); }

void Cluster::SetPool(PoolRole role, const PoolConfig& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Pool>& p = pools_[static_cast<int>(role)];
  std::shared_ptr<KvIndex> index = p.has_value() ? p->index : nullptr;
  std::vector<std::string> addresses;
  if (!pool.discovery.has_value()) {
    addresses = pool.workers;
    std::sort(addresses.begin(), addresses.end());
  } else if (p.has_value() && p->config.discovery.has_value() && p->config.discovery->dns == pool.discovery->dns &&
             p->config.discovery->port == pool.discovery->port) {
    addresses = p->addresses;  // same name: keep what it resolved to
  }
  p = Pool{.config = pool, .addresses = std::move(addresses), .index = std::move(index)};
  resolve_now_ = true;
  SyncWorkersLocked();
  cv_.notify_all();
}

void Cluster::ClearPool(PoolRole role) {
  std::lock_guard<std::mutex> lock(mu_);
  pools_[static_cast<int>(role)].reset();
  SyncWorkersLocked();
}

void Cluster::SetKvIndex(PoolRole role, std::shared_ptr<KvIndex> index) {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Pool>& p = pools_[static_cast<int>(role)];
  if (!p.has_value() || p->index == index) return;
  p->index = std::move(index);
  // Subscriptions opened before carry the old index list: restart them.
  for (const std::string& address : p->addresses) CancelSubscription(address);
}

void Cluster::SetHealthConfig(const HealthConfig& health) {
  std::lock_guard<std::mutex> lock(mu_);
  health_ = health;
  cv_.notify_all();
}

void Cluster::SetHealthListener(HealthListener listener) {
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = std::move(listener);
}

void Cluster::SetStatusStreams(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  status_streams_ = enabled;
  if (enabled) return;
  for (const auto& [address, sub] : subscriptions_) {
    if (sub->indexes.empty()) sub->context.TryCancel();
  }
}

void Cluster::SetRouterTokenizer(RouterTokenizer tokenizer) {
  std::lock_guard<std::mutex> lock(mu_);
  tokenizer_ = std::move(tokenizer);
}

void Cluster::SyncWorkersLocked() {
  std::set<std::string> wanted;
  for (const std::optional<Pool>& p : pools_) {
    if (p.has_value()) wanted.insert(p->addresses.begin(), p->addresses.end());
  }
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (wanted.count(it->first) == 0) {
      CancelSubscription(it->first);
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  for (const std::string& address : wanted) {
    if (workers_.count(address) == 0) {
      workers_.emplace(address, std::make_shared<WorkerClient>(address, *channels_));
    }
  }
  // Indexes forget the workers that left their pool.
  for (const std::optional<Pool>& p : pools_) {
    if (!p.has_value() || p->index == nullptr) continue;
    for (const KvIndex::WorkerInfo& w : p->index->workers()) {
      if (!std::binary_search(p->addresses.begin(), p->addresses.end(), w.id)) {
        p->index->RemoveWorker(w.id);
      }
    }
  }
}

void Cluster::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return;
  started_ = true;
  health_thread_ = std::thread([this] {
    SetThreadName("health_checks");
    HealthLoop();
  });
  discovery_thread_ = std::thread([this] {
    SetThreadName("discovery");
    DiscoveryLoop();
  });
}

void Cluster::Stop() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_ && subscriptions_.empty() && !health_thread_.joinable()) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (health_thread_.joinable()) health_thread_.join();
  if (discovery_thread_.joinable()) discovery_thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  for (auto& [address, sub] : subscriptions_) sub->context.TryCancel();
  cv_.wait(lock, [&] { return subscriptions_.empty(); });
}

void Cluster::CheckNow() {
  ResolvePools();
  HealthRound();
}

void Cluster::HealthLoop() {
  while (true) {
    HealthRound();
    std::unique_lock<std::mutex> lock(mu_);
    const auto interval = Millis(health_.interval_s);
    if (cv_.wait_for(lock, interval, [&] { return stopping_; })) return;
  }
}

void Cluster::DiscoveryLoop() {
  std::map<int, Clock::time_point> next;  // per pool role
  while (true) {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return;
    Clock::time_point wake = Clock::now() + std::chrono::seconds(60);
    bool due = resolve_now_;
    for (int r = 0; r < kNumPoolRoles; ++r) {
      if (!pools_[r].has_value() || !pools_[r]->config.discovery.has_value()) continue;
      auto it = next.find(r);
      if (it == next.end() || it->second <= Clock::now()) {
        due = true;
      } else {
        wake = std::min(wake, it->second);
      }
    }
    if (!due) {
      cv_.wait_until(lock, wake, [&] { return stopping_ || resolve_now_; });
      continue;
    }
    resolve_now_ = false;
    lock.unlock();
    ResolvePools();
    lock.lock();
    for (int r = 0; r < kNumPoolRoles; ++r) {
      if (pools_[r].has_value() && pools_[r]->config.discovery.has_value()) {
        next[r] = Clock::now() + Millis(pools_[r]->config.discovery->interval_s);
      }
    }
  }
}

void Cluster::ResolvePools() {
  std::vector<std::pair<int, DnsDiscoveryConfig>> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int r = 0; r < kNumPoolRoles; ++r) {
      if (pools_[r].has_value() && pools_[r]->config.discovery.has_value()) {
        todo.emplace_back(r, *pools_[r]->config.discovery);
      }
    }
  }
  for (const auto& [r, dns] : todo) {
    absl::StatusOr<std::vector<std::string>> addresses = ResolveAll(dns.dns, dns.port);
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<Pool>& p = pools_[r];
    if (!p.has_value() || !p->config.discovery.has_value() || p->config.discovery->dns != dns.dns ||
        p->config.discovery->port != dns.port) {
      continue;  // the pool changed meanwhile
    }
    ++stats_.dns_lookups;
    if (!addresses.ok()) {
      ++stats_.dns_failures;
      // Keep the last known members: a DNS outage should not empty the pool.
      LOG(WARNING) << PoolRoleName(static_cast<PoolRole>(r)) << " pool: " << addresses.status().message()
                   << "; keeping " << p->addresses.size() << " known workers";
      continue;
    }
    if (*addresses != p->addresses) {
      LOG(INFO) << PoolRoleName(static_cast<PoolRole>(r)) << " pool: " << dns.dns << " -> " << addresses->size()
                << " workers";
      p->addresses = *std::move(addresses);
      SyncWorkersLocked();
    }
  }
}

void Cluster::HealthRound() {
  std::lock_guard<std::mutex> round(round_mu_);
  struct Check {
    std::shared_ptr<WorkerClient> worker;
    grpc::ClientContext health_ctx, load_ctx, info_ctx;
    tandem::v1::HealthRequest health_req;
    tandem::v1::HealthResponse health;
    tandem::v1::LoadRequest load_req;
    tandem::v1::LoadReport load;
    tandem::v1::ModelInfoRequest info_req;
    tandem::v1::ModelInfo info;
    bool ok = false;
    bool not_serving = false;  // it answered NOT_SERVING (draining, stopping)
  };
  std::vector<std::shared_ptr<WorkerClient>> workers;
  HealthConfig health;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    for (const auto& [address, w] : workers_) workers.push_back(w);
    health = health_;
  }
  if (workers.empty()) return;

  std::mutex done_mu;
  std::condition_variable done_cv;
  size_t remaining = workers.size();
  auto finish = [&] {
    std::lock_guard<std::mutex> lock(done_mu);
    if (--remaining == 0) done_cv.notify_all();
  };
  std::vector<std::unique_ptr<Check>> checks;
  const auto deadline = std::chrono::system_clock::now() + Millis(health.timeout_s);
  for (const std::shared_ptr<WorkerClient>& w : workers) {
    checks.push_back(std::make_unique<Check>());
    Check* c = checks.back().get();
    c->worker = w;
    c->health_ctx.set_deadline(deadline);
    c->load_ctx.set_deadline(deadline);
    c->info_ctx.set_deadline(deadline);
    grpc::CompletionQueue* cq = GrpcPoller::Shared().cq();
    GrpcPoller::Unary(w->stub().PrepareAsyncHealth(&c->health_ctx, c->health_req, cq), &c->health,
                      [c, cq, &finish](const grpc::Status& s) {
                        if (!s.ok() || c->health.status() != tandem::v1::HealthResponse::SERVING) {
                          c->not_serving = s.ok();
                          finish();
                          return;
                        }
                        GrpcPoller::Unary(c->worker->stub().PrepareAsyncGetLoad(&c->load_ctx, c->load_req, cq),
                                          &c->load, [c, cq, &finish](const grpc::Status& s) {
                                            if (!s.ok()) {
                                              finish();
                                              return;
                                            }
                                            c->worker->SetLoad(c->load);
                                            const std::optional<tandem::v1::ModelInfo> known = c->worker->model_info();
                                            if (known.has_value() && known->instance_id() == c->health.instance_id()) {
                                              c->ok = true;
                                              finish();
                                              return;
                                            }
                                            // New or restarted: its model info (block size, hash seed) may differ.
                                            GrpcPoller::Unary(c->worker->stub().PrepareAsyncGetModelInfo(
                                                                  &c->info_ctx, c->info_req, cq),
                                                              &c->info, [c, &finish](const grpc::Status& s) {
                                                                if (s.ok()) {
                                                                  c->worker->SetModelInfo(c->info);
                                                                  c->ok = true;
                                                                }
                                                                finish();
                                                              });
                                          });
                      });
  }
  {
    std::unique_lock<std::mutex> lock(done_mu);
    done_cv.wait(lock, [&] { return remaining == 0; });
  }

  // A SERVING answer from an instance that has since said it drains is not
  // a success (it was sent before the drain).
  for (const std::unique_ptr<Check>& c : checks) {
    if (c->ok && c->worker->Drains(c->health.instance_id())) {
      c->ok = false;
      c->not_serving = true;
    }
  }
  // Each worker that answered must fit the router's tokenizer and a worker
  // already serving; when none serves yet, the model most of this round's
  // workers share. Checked every round, so one refused beside workers that
  // have since left is admitted once they are gone.
  RouterTokenizer tokenizer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tokenizer = tokenizer_;
  }
  std::vector<std::pair<Check*, tandem::v1::ModelInfo>> answered;
  for (const std::unique_ptr<Check>& c : checks) {
    if (!c->ok) continue;
    std::optional<tandem::v1::ModelInfo> info = c->worker->model_info();
    if (info.has_value()) answered.emplace_back(c.get(), *std::move(info));
  }
  std::optional<tandem::v1::ModelInfo> reference = AnyModelInfo();
  if (!reference.has_value()) {
    size_t most = 0;
    for (const auto& [c, info] : answered) {
      if (!Incompatibility(info, nullptr, tokenizer).empty()) continue;
      const size_t fit = std::count_if(answered.begin(), answered.end(), [&](const auto& other) {
        return Incompatibility(other.second, &info, tokenizer).empty();
      });
      if (fit > most) {
        most = fit;
        reference = info;
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> verdicts;  // (address, why) that changed
  for (auto& [c, info] : answered) {
    std::string why = Incompatibility(info, reference.has_value() ? &*reference : nullptr, tokenizer);
    if (!why.empty()) c->ok = false;
    if (c->worker->SetIncompatibility(why)) verdicts.emplace_back(c->worker->address(), std::move(why));
  }
  for (const auto& [address, why] : verdicts) {
    if (why.empty()) {
      LOG(INFO) << "worker " << address << " now fits the cluster";
    } else {
      LOG(ERROR) << "worker " << address << " cannot serve in this cluster, refused: " << why;
    }
  }

  HealthListener listener;
  std::vector<std::pair<std::string, bool>> changes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener = listener_;
    for (const std::unique_ptr<Check>& c : checks) {
      ++stats_.health_checks;
      if (!c->ok) ++stats_.health_check_failures;
      const bool was_healthy = c->worker->healthy();
      const bool admitted_before = c->worker->ever_healthy();
      // NOT_SERVING is the worker's own word that it takes no more work (it
      // drains): ejected at once, not after unhealthy_after checks.
      const bool ejected = c->not_serving && c->worker->Eject();
      if (c->worker->RecordCheck(c->ok, health) || ejected) {
        changes.emplace_back(c->worker->address(), !was_healthy);
        if (was_healthy) {
          ++stats_.ejections;
        } else if (admitted_before) {
          ++stats_.readmissions;
        }
      }
    }
  }
  for (const auto& [address, healthy] : changes) {
    LOG(INFO) << "worker " << address << (healthy ? " is healthy" : " is unhealthy: ejected");
    if (listener) listener(address, healthy);
  }
  for (const std::unique_ptr<Check>& c : checks) {
    if (c->worker->healthy()) MaybeSubscribe(c->worker);
  }
}

std::vector<std::shared_ptr<KvIndex>> Cluster::IndexesFor(const std::string& address) const {
  std::vector<std::shared_ptr<KvIndex>> out;
  for (const std::optional<Pool>& p : pools_) {
    if (p.has_value() && p->index != nullptr && std::binary_search(p->addresses.begin(), p->addresses.end(), address)) {
      out.push_back(p->index);
    }
  }
  return out;
}

void Cluster::MaybeSubscribe(const std::shared_ptr<WorkerClient>& worker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || subscriptions_.count(worker->address()) != 0 || workers_.count(worker->address()) == 0) {
    return;
  }
  // Every healthy worker: its KV events for the pools' indexes, and its drain.
  std::vector<std::shared_ptr<KvIndex>> indexes = IndexesFor(worker->address());
  if (indexes.empty() && !status_streams_) return;
  auto* sub = new Subscription(this, worker->address(), std::move(indexes));
  subscriptions_[worker->address()] = sub;
  sub->Start(worker->stub());
}

void Cluster::WorkerDraining(const std::string& address, const std::string& instance_id) {
  HealthListener listener;
  bool ejected = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = workers_.find(address);
    if (it == workers_.end()) return;
    it->second->SetDraining(instance_id);
    ejected = it->second->Eject();
    if (ejected) ++stats_.ejections;
    listener = listener_;
  }
  if (!ejected) return;
  LOG(INFO) << "worker " << address << " is draining (its KV event stream says so): ejected";
  if (listener) listener(address, false);
}

void Cluster::CancelSubscription(const std::string& address) {
  auto it = subscriptions_.find(address);
  if (it != subscriptions_.end()) it->second->context.TryCancel();
}

void Cluster::SubscriptionDone(const std::string& address, Subscription* sub) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = subscriptions_.find(address);
  if (it != subscriptions_.end() && it->second == sub) subscriptions_.erase(it);
  cv_.notify_all();
}

std::vector<std::shared_ptr<WorkerClient>> Cluster::Workers(PoolRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<WorkerClient>> out;
  const std::optional<Pool>& p = pools_[static_cast<int>(role)];
  if (!p.has_value()) return out;
  for (const std::string& address : p->addresses) {
    auto it = workers_.find(address);
    if (it != workers_.end()) out.push_back(it->second);
  }
  return out;
}

bool Cluster::HasPool(PoolRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pools_[static_cast<int>(role)].has_value();
}

std::optional<tandem::v1::ModelInfo> Cluster::AnyModelInfo() const {
  for (PoolRole role : {PoolRole::kDecode, PoolRole::kPrefill}) {
    for (const std::shared_ptr<WorkerClient>& w : Workers(role)) {
      if (!w->healthy()) continue;
      std::optional<tandem::v1::ModelInfo> info = w->model_info();
      if (info.has_value()) return info;
    }
  }
  return std::nullopt;
}

Cluster::Stats Cluster::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace tandem::router
