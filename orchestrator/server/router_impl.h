// Router::Impl, shared by the router's files: router.cc wires the parts
// together (construction, Start, Stop, Reload) and api_handlers.cc serves
// the HTTP endpoints. The parts, each in its own file: Admission (slots,
// queue, retry budget, watchdog), Placer (routing state and placement),
// ApiCall (one request's generations and response), ErrorReplies, and the
// metrics (router_metrics.h).
#ifndef TANDEM_ORCHESTRATOR_SERVER_ROUTER_IMPL_H_
#define TANDEM_ORCHESTRATOR_SERVER_ROUTER_IMPL_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/grpc_poller.h"
#include "common/metrics.h"
#include "common/serial_executor.h"
#include "common/tls.h"
#include "nlohmann/json.hpp"
#include "orchestrator/admission/admission.h"
#include "orchestrator/admission/api_keys.h"
#include "orchestrator/cluster/cluster.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/http/http_server.h"
#include "orchestrator/openai/openai_api.h"
#include "orchestrator/server/api_call.h"
#include "orchestrator/server/error_replies.h"
#include "orchestrator/server/latency_window.h"
#include "orchestrator/server/model_assets.h"
#include "orchestrator/server/placement.h"
#include "orchestrator/server/router.h"
#include "orchestrator/server/router_metrics.h"
#include "orchestrator/server/throttled_warnings.h"

namespace tandem::router {

// Which callers an endpoint admits when keys are configured.
enum class Access { kOpen, kClient, kAdmin };

class Router::Impl {
 public:
  Impl(RouterConfig config, std::string config_path, std::shared_ptr<const ModelAssets> assets,
       std::shared_ptr<const tls::ChannelFactory> channels);
  ~Impl();

  absl::Status Start();
  void Stop();
  int port() const { return http_ ? http_->port() : 0; }
  absl::Status Reload();

 private:
  std::shared_ptr<const RouterConfig> config() const {
    std::lock_guard<std::mutex> lock(mu_);
    return config_;
  }
  void ApplyClusterConfig(const RouterConfig& config);
  // Runs `task` later, not under the caller's locks: on the gRPC poller's
  // thread after its current completion when called there (no thread to
  // wake), on the router's task thread otherwise.
  void Post(std::function<void()> task) {
    if (!GrpcPoller::RunAfterThisCompletion(task)) executor_.Post(std::move(task));
  }
  // Worker addresses to redact from client-visible texts.
  std::vector<std::string> WorkerAddresses();
  // Whether `caller` may see worker addresses (debug.worker_details, or an
  // admin key).
  bool ShowWorkers(const Caller& caller) const { return caller.admin() || config()->debug.worker_details; }

  // HTTP handlers (api_handlers.cc).
  void HandleChat(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleCompletion(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleModels(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleDashboard(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleModel(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  nlohmann::json ModelObject();  // the served model as /v1/models lists it
  void HandleHealth(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleMetrics(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleTokenize(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);
  void HandleDetokenize(const http::Request& req, std::shared_ptr<http::ResponseWriter> w);

  // The request's API key; an empty Caller when the router has no keys.
  Caller Identify(const http::Request& req) const;
  // Checks the request's key for an endpoint of `access`; false when it
  // answered the request (401, or 403 for a non-admin key on an admin
  // endpoint).
  bool Authorize(Access access, const std::string& endpoint, const http::Request& req, http::ResponseWriter& w);
  std::string RequestId(const http::Request& req);
  // Renders a parsed chat request with the chat template and tokenizes it
  // (special-token text in the user's strings stays text unless
  // model.parse_special_tokens_in_messages).
  absl::StatusOr<std::vector<int32_t>> ChatPrompt(const ChatCompletionRequest& chat, bool add_special_tokens) const;
  // Validates prompt length against the model; fills vocab-range errors.
  absl::Status CheckPrompt(std::span<const int32_t> prompt, std::optional<int64_t> max_tokens,
                           const std::string& param);
  // Fills what chat and completions share, then admits the call.
  void StartCall(CallKind kind, const http::Request& req, std::shared_ptr<http::ResponseWriter> w,
                 const std::string& id, std::shared_ptr<const RouterConfig> cfg, CallSetup s, const std::string& model,
                 const SamplingFields& sampling, std::optional<int64_t> logprobs);
  // Admits the call (admission_), answering a refusal.
  void Admit(const std::shared_ptr<ApiCall>& call);

  const std::string config_path_;
  const std::shared_ptr<const ModelAssets> assets_;
  const int64_t created_ =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  MetricsRegistry registry_;
  RouterMetrics metrics_{registry_};
  Cluster cluster_;
  std::unique_ptr<http::HttpServer> http_;

  mutable std::mutex mu_;
  std::shared_ptr<const RouterConfig> config_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const ApiKeyStore> keys_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_){std::random_device{}()};

  ThrottledWarnings warnings_;
  Placer placer_;
  Admission admission_;
  ErrorReplies errors_;
  LatencyWindow first_token_latency_;
  LatencyWindow token_gaps_;
  AttemptDeadlines deadlines_;  // the watchdog's (CallEnv::deadlines)
  CallEnv env_;
  bool stopped_ = false;
  // Last: destroyed first, so the tasks it still runs find the rest alive.
  SerialExecutor executor_{"router_tasks"};
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_ROUTER_IMPL_H_
