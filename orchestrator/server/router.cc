// Router::Impl's wiring: construction, Start, Stop, Reload and admission's
// answer. The endpoints are in api_handlers.cc; the parts are listed in
// router_impl.h.
#include "orchestrator/server/router.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/thread_util.h"
#include "orchestrator/server/router_impl.h"

namespace tandem::router {

Router::Impl::Impl(RouterConfig config, std::string config_path, std::shared_ptr<const ModelAssets> assets,
                   std::shared_ptr<const tls::ChannelFactory> channels)
    : config_path_(std::move(config_path)),
      assets_(std::move(assets)),
      cluster_(config.health, std::move(channels)),
      config_(std::make_shared<const RouterConfig>(std::move(config))),
      keys_(std::make_shared<const ApiKeyStore>(config_->auth)),
      placer_(cluster_, metrics_, [this] { return this->config(); }),
      admission_({.limits = config_->limits,
                  .retry_budget_ratio = config_->retries.budget_ratio,
                  .post = [this](std::function<void()> task) { executor_.Post(std::move(task)); }}),
      errors_(metrics_, [this] { return WorkerAddresses(); }),
      env_{.assets = assets_.get(),
           .metrics = &metrics_,
           .admission = &admission_,
           .placer = &placer_,
           .errors = &errors_,
           .first_token_latency = &first_token_latency_,
           .token_gaps = &token_gaps_,
           .deadlines = &deadlines_,
           .post = [this](std::function<void()> task) { Post(std::move(task)); }} {
  RegisterRouterGauges(registry_, {.cluster = &cluster_, .placer = &placer_, .admission = &admission_, .http = [this] {
                                     return static_cast<const http::HttpServer*>(http_.get());
                                   }});
}

Router::Impl::~Impl() { Stop(); }

absl::Status Router::Impl::Start() {
  std::shared_ptr<const RouterConfig> cfg = config();
  ApplyClusterConfig(*cfg);
  cluster_.SetHealthListener([this](const std::string&, bool healthy) {
    if (healthy) placer_.Routing();
  });
  cluster_.SetRouterTokenizer(
      {.sha256 = assets_->tokenizer_sha256, .vocab_size = assets_->tokenizer->vocab_size(), .source = assets_->source});
  cluster_.CheckNow();
  placer_.Routing();
  cluster_.Start();

  http::HttpServer::Options o;
  o.host = cfg->listener.host;
  o.port = cfg->listener.port;
  o.threads = std::max(2u, std::min(8u, std::thread::hardware_concurrency()));
  o.max_body_bytes = static_cast<size_t>(cfg->limits.max_body_bytes);
  o.max_connections = static_cast<size_t>(cfg->limits.max_connections);
  o.idle_timeout = std::chrono::seconds(static_cast<int64_t>(std::max(cfg->timeouts.idle_stream_s, 1.0)) + 30);
  http_ = std::make_unique<http::HttpServer>(o);
  // Every route checks the caller's key first (when keys are configured).
  auto bind = [this](Access access, std::string endpoint,
                     void (Impl::*f)(const http::Request&, std::shared_ptr<http::ResponseWriter>)) {
    return [this, access, endpoint, f](const http::Request& r, std::shared_ptr<http::ResponseWriter> w) {
      if (!Authorize(access, endpoint, r, *w)) return;
      (this->*f)(r, std::move(w));
    };
  };
  http_->Route("POST", "/v1/chat/completions", bind(Access::kClient, "chat", &Impl::HandleChat));
  http_->Route("POST", "/v1/completions", bind(Access::kClient, "completions", &Impl::HandleCompletion));
  http_->Route("GET", "/v1/models", bind(Access::kClient, "models", &Impl::HandleModels));
  http_->Route("GET", "/v1/models/*", bind(Access::kClient, "models", &Impl::HandleModel));
  http_->Route("GET", "/health", bind(Access::kOpen, "health", &Impl::HandleHealth));
  http_->Route("GET", "/metrics", bind(Access::kAdmin, "metrics", &Impl::HandleMetrics));
  http_->Route("GET", "/dashboard", bind(Access::kAdmin, "dashboard", &Impl::HandleDashboard));
  http_->Route("POST", "/tokenize", bind(Access::kAdmin, "tokenize", &Impl::HandleTokenize));
  http_->Route("POST", "/detokenize", bind(Access::kAdmin, "detokenize", &Impl::HandleDetokenize));
  RETURN_IF_ERROR(http_->Start());
  // Once per tick: the attempt deadlines follow the latency observed lately.
  admission_.StartWatchdog([this] {
    const RetriesConfig retries = config()->retries;
    deadlines_ = {.first_token_s = AttemptDeadlineSeconds(retries.attempt_first_token, retries, first_token_latency_),
                  .idle_s = AttemptDeadlineSeconds(retries.attempt_idle, retries, token_gaps_)};
  });
  LOG(INFO) << "router serving " << cfg->model.served_name << " on " << cfg->listener.host << ":" << http_->port()
            << " (tokenizer " << assets_->source << ", disaggregation "
            << DisaggregationModeName(cfg->disaggregation.mode) << ", "
            << (cfg->auth.enabled() ? absl::StrCat(cfg->auth.keys.size(), " API keys")
                                    : std::string("no API keys: open to every client"))
            << ")";
  return absl::OkStatus();
}

void Router::Impl::Stop() {
  if (stopped_) return;
  stopped_ = true;
  admission_.Close();                   // new requests: 503
  if (http_ != nullptr) http_->Stop();  // lets responses finish for its grace
  admission_.Stop();                    // cancels the rest, waits for their answers
  cluster_.Stop();
}

void Router::Impl::ApplyClusterConfig(const RouterConfig& config) {
  cluster_.SetHealthConfig(config.health);
  cluster_.SetStatusStreams(config.kv_events.enabled);
  if (config.prefill.has_value()) {
    cluster_.SetPool(PoolRole::kPrefill, *config.prefill);
  } else {
    cluster_.ClearPool(PoolRole::kPrefill);
  }
  if (config.decode.has_value()) cluster_.SetPool(PoolRole::kDecode, *config.decode);
}

absl::Status Router::Impl::Reload() {
  if (config_path_.empty()) {
    return absl::FailedPreconditionError("the router was not started from a config file");
  }
  absl::StatusOr<RouterConfig> loaded = LoadRouterConfig(config_path_);
  if (!loaded.ok()) {
    LOG(ERROR) << "reload of " << config_path_ << " failed; keeping the running config: " << loaded.status().message();
    metrics_.reloads.WithLabels({"error"}).Inc();
    return loaded.status();
  }
  std::shared_ptr<const RouterConfig> prev = config();
  // What is fixed at startup stays as it runs, so the running config says
  // what is in effect: the listener, the model section (served name,
  // tokenizer, template, special-token parsing), the body and connection
  // limits, and tls.
  std::vector<std::string> deferred;
  if (loaded->listener.host != prev->listener.host || loaded->listener.port != prev->listener.port) {
    deferred.push_back("listener");
  }
  if (loaded->model.served_name != prev->model.served_name) deferred.push_back("model.served_name");
  if (loaded->model.tokenizer != prev->model.tokenizer) deferred.push_back("model.tokenizer");
  if (loaded->model.chat_template != prev->model.chat_template) {
    deferred.push_back("model.chat_template");
  }
  if (loaded->model.parse_special_tokens_in_messages != prev->model.parse_special_tokens_in_messages) {
    deferred.push_back("model.parse_special_tokens_in_messages");
  }
  if (loaded->limits.max_body_bytes != prev->limits.max_body_bytes) {
    deferred.push_back("limits.max_body_bytes");
  }
  if (loaded->limits.max_connections != prev->limits.max_connections) {
    deferred.push_back("limits.max_connections");
  }
  if (loaded->tls.mode != prev->tls.mode || loaded->tls.ca != prev->tls.ca || loaded->tls.cert != prev->tls.cert ||
      loaded->tls.key != prev->tls.key) {
    deferred.push_back("tls");
  }
  loaded->tls = prev->tls;
  loaded->listener = prev->listener;
  loaded->model = prev->model;
  loaded->limits.max_body_bytes = prev->limits.max_body_bytes;
  loaded->limits.max_connections = prev->limits.max_connections;
  if (!deferred.empty()) {
    LOG(WARNING) << "reload: changes to " << absl::StrJoin(deferred, ", ")
                 << " take effect at the next restart; the rest applies now";
    metrics_.reloads.WithLabels({"deferred"}).Inc();
  }
  auto next = std::make_shared<const RouterConfig>(*std::move(loaded));
  if (prev->auth.enabled() && !next->auth.enabled()) {
    LOG(WARNING) << "reload: the config has no API keys any more: the router is open to every "
                    "client";
  }
  auto keys = std::make_shared<const ApiKeyStore>(next->auth);
  ApplyClusterConfig(*next);
  {
    std::lock_guard<std::mutex> lock(mu_);
    config_ = next;
    keys_ = keys;
  }
  // After the config: a state built meanwhile for want of one is for `next`.
  placer_.Rebuild(next);
  admission_.SetLimits(next->limits, next->retries.budget_ratio);
  LOG(INFO) << "reloaded " << config_path_ << " (" << keys->size() << " API keys)";
  metrics_.reloads.WithLabels({"ok"}).Inc();
  return absl::OkStatus();
}

void Router::Impl::Admit(const std::shared_ptr<ApiCall>& call) {
  const Admission::Decision d = admission_.Admit(call);
  if (!d.admitted()) {
    absl::Status refused;
    http::HeaderList headers;
    switch (d.refusal) {
      case Admission::Refusal::kNone:
      case Admission::Refusal::kStopping:
        refused = absl::UnavailableError(d.message);
        break;
      case Admission::Refusal::kNOverMaxInFlight:
        // It could never start: every choice is a sequence on the workers.
        refused = InvalidRequest("n", d.message);
        metrics_.refusals.WithLabels({"n_over_max_in_flight"}).Inc();
        break;
      case Admission::Refusal::kKeyLimit: {
        const std::string limit(KeyLimitName(d.key_limit));
        const std::string& key = call->caller().name();
        refused = absl::ResourceExhaustedError(d.message);
        headers = {{"x-request-id", call->request_id()}, {"Retry-After", std::to_string(d.retry_after_s)}};
        metrics_.rate_limited.WithLabels({key, limit}).Inc();
        warnings_.Warn("rate_limited", absl::StrCat("API key '", key, "' refused by its ", limit, " limit"));
        break;
      }
      case Admission::Refusal::kQueueFull:
        refused = absl::ResourceExhaustedError(d.message);
        metrics_.refusals.WithLabels({"queue_full"}).Inc();
        break;
    }
    errors_.Send(call->endpoint(), call->request_id(), *call->writer(), refused, std::move(headers),
                 call->show_workers());
    return;
  }
  // A client that goes away cancels its work (or its place in the queue).
  std::weak_ptr<ApiCall> weak = call;
  call->writer()->OnClose([weak] {
    if (auto c = weak.lock()) c->Cancel(absl::CancelledError("the client disconnected"));
  });
}

std::vector<std::string> Router::Impl::WorkerAddresses() {
  std::vector<std::string> out;
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    for (const auto& w : cluster_.Workers(role)) out.push_back(w->address());
  }
  std::shared_ptr<const RouterConfig> cfg = config();
  for (const std::optional<PoolConfig>* p : {&cfg->prefill, &cfg->decode}) {
    if (p->has_value()) out.insert(out.end(), (*p)->workers.begin(), (*p)->workers.end());
  }
  return out;
}

// ---------------------------------------------------------------------------
// Router

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() = default;

absl::StatusOr<std::unique_ptr<Router>> Router::Create(RouterConfig config, std::string config_path) {
  RETURN_IF_ERROR(ValidateRouterConfig(config));
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelAssets> assets, LoadModelAssets(config.model));
  absl::StatusOr<std::shared_ptr<const tls::ChannelFactory>> channels = WorkerChannelsFor(config.tls);
  if (!channels.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path.empty() ? "" : config_path + ": ", channels.status().message()));
  }
  return std::unique_ptr<Router>(new Router(
      std::make_unique<Impl>(std::move(config), std::move(config_path), std::move(assets), *std::move(channels))));
}

absl::Status Router::Start() { return impl_->Start(); }
void Router::Stop() { impl_->Stop(); }
int Router::port() const { return impl_->port(); }
absl::Status Router::Reload() { return impl_->Reload(); }

}  // namespace tandem::router
