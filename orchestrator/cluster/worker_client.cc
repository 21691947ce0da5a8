#include "orchestrator/cluster/worker_client.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "common/logging.h"

namespace tandem::router {

grpc::ChannelArguments WorkerClient::ChannelArgs() {
  grpc::ChannelArguments args;
  // gRPC's default reconnect backoff grows to 120 s: a worker restarted after
  // a crash would stay unreachable for minutes. Health checks run every few
  // seconds, so retrying the connection about as often is enough.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Token streams are many small messages; the router's own messages are
  // prompts (a few MB at most for very long contexts).
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // No bandwidth-delay probing: it answers received data with a PING (and
  // the worker with a PING ACK), a round of wake-ups on both sides for every
  // probe, to grow a flow-control window that small token messages never
  // fill.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // Keepalive: a worker that stops answering HTTP/2 pings (a frozen process,
  // a dead host whose connection never reset) fails every call on the
  // channel with UNAVAILABLE within kKeepaliveTimeMs + kKeepaliveTimeoutMs,
  // which ejects it and moves its requests elsewhere (generation.h), instead
  // of after unhealthy_after health checks. A worker's gRPC thread answers
  // pings apart from its engine, so a busy worker is not mistaken for a
  // frozen one. Workers accept pings this often (worker_command.cc).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return args;
}

absl::StatusOr<std::shared_ptr<const tls::ChannelFactory>> WorkerChannelsFor(const TlsConfig& tls) {
  if (tls.mode != TlsMode::kMutual) {
    LOG(WARNING) << "INSECURE (tls.mode: insecure): the router calls its workers over plain TCP; "
                    "nothing proves a worker is one, and the workers cannot tell the router from "
                    "any other caller";
    return tls::ChannelFactory::Insecure();
  }
  absl::StatusOr<tls::TlsMaterial> material = tls::LoadTlsMaterial(
      {.ca = tls.ca, .cert = tls.cert, .key = tls.key}, {.ca = "tls.ca", .cert = "tls.cert", .key = "tls.key"});
  if (!material.ok()) return material.status();
  return tls::ChannelFactory::Mutual(*material);
}

WorkerClient::WorkerClient(std::string address, const tls::ChannelFactory& channels) : address_(std::move(address)) {
  stub_ = tandem::v1::Worker::NewStub(channels.Create(address_, ChannelArgs()));
}

bool WorkerClient::RecordCheck(bool ok, const HealthConfig& config) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ok) {
    streak_ = streak_ > 0 ? streak_ + 1 : 1;
  } else {
    streak_ = streak_ < 0 ? streak_ - 1 : -1;
  }
  const bool was = healthy_.load(std::memory_order_relaxed);
  bool now = was;
  if (!was && ok && streak_ >= (ever_healthy_ ? config.healthy_after : 1)) now = true;
  if (was && !ok && -streak_ >= config.unhealthy_after) now = false;
  if (now) ever_healthy_ = true;
  if (now && !was) admitted_at_ = std::chrono::steady_clock::now();
  healthy_.store(now, std::memory_order_release);
  return now != was;
}

void WorkerClient::SetDraining(std::string instance_id) {
  std::lock_guard<std::mutex> lock(mu_);
  draining_instance_ = std::move(instance_id);
}

bool WorkerClient::Drains(const std::string& instance_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !draining_instance_.empty() && draining_instance_ == instance_id;
}

bool WorkerClient::Eject() {
  std::lock_guard<std::mutex> lock(mu_);
  streak_ = std::min(streak_, 0);
  return healthy_.exchange(false, std::memory_order_acq_rel);
}

void WorkerClient::SetLoad(const tandem::v1::LoadReport& load) {
  used_blocks_.store(load.used_blocks(), std::memory_order_relaxed);
  total_blocks_.store(load.total_blocks(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  last_load_ = load;
}

std::optional<tandem::v1::LoadReport> WorkerClient::last_load() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_load_;
}

void WorkerClient::SetModelInfo(const tandem::v1::ModelInfo& info) {
  prefill_tokens_per_step_.store(info.max_batched_tokens(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  model_info_ = info;
}

std::optional<tandem::v1::ModelInfo> WorkerClient::model_info() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_info_;
}

std::string WorkerClient::kv_domain() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_info_.has_value() ? model_info_->kv_domain() : std::string();
}

std::string WorkerClient::incompatibility() const {
  std::lock_guard<std::mutex> lock(mu_);
  return incompatibility_;
}

bool WorkerClient::SetIncompatibility(std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (why == incompatibility_) return false;
  incompatibility_ = std::move(why);
  return true;
}

WorkerView WorkerClient::View() const {
  return WorkerView{.id = address_,
                    .in_flight = in_flight(),
                    .prefill_tokens_in_flight = prefill_tokens_in_flight(),
                    .used_blocks = used_blocks_.load(std::memory_order_relaxed),
                    .total_blocks = total_blocks_.load(std::memory_order_relaxed),
                    .prefill_tokens_per_step = prefill_tokens_per_step_.load(std::memory_order_relaxed),
                    .healthy = healthy()};
}

InFlight::InFlight(std::shared_ptr<WorkerClient> worker, int64_t prefill_tokens)
    : worker_(std::move(worker)), prefill_tokens_(prefill_tokens) {
  if (worker_ == nullptr) return;
  worker_->in_flight_.fetch_add(1, std::memory_order_relaxed);
  worker_->prefill_tokens_.fetch_add(prefill_tokens_, std::memory_order_relaxed);
}

InFlight::InFlight(InFlight&& other) noexcept
    : worker_(std::move(other.worker_)), prefill_tokens_(std::exchange(other.prefill_tokens_, 0)) {}

InFlight& InFlight::operator=(InFlight&& other) noexcept {
  if (this != &other) {
    Release();
    worker_ = std::move(other.worker_);
    prefill_tokens_ = std::exchange(other.prefill_tokens_, 0);
  }
  return *this;
}

InFlight::~InFlight() { Release(); }

void InFlight::PrefillDone() {
  if (worker_ == nullptr || prefill_tokens_ == 0) return;
  worker_->prefill_tokens_.fetch_sub(prefill_tokens_, std::memory_order_relaxed);
  prefill_tokens_ = 0;
}

void InFlight::Release() {
  if (worker_ == nullptr) return;
  PrefillDone();
  worker_->in_flight_.fetch_sub(1, std::memory_order_relaxed);
  worker_.reset();
}

}  // namespace tandem::router
