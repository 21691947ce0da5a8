// ApiCall: one chat or completion request, from admission to the last byte.
// It is admitted as an Admittable, runs one Generation per choice (placed by
// a RequestPlanner), and assembles what the generations send into the
// OpenAI response: one JSON body, or SSE chunks as tokens arrive (text
// detokenized incrementally, stop strings applied, logprobs, usage). It
// accounts the request in the router's metrics when its generations end.
//
// Thread safety: Start, Cancel and Watch may be called from any thread; the
// GenerationSink methods are called by the generations (see generation.h).
#ifndef TANDEM_ORCHESTRATOR_SERVER_API_CALL_H_
#define TANDEM_ORCHESTRATOR_SERVER_API_CALL_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "orchestrator/admission/admission.h"
#include "orchestrator/admission/api_keys.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/http/http_server.h"
#include "orchestrator/openai/openai_api.h"
#include "orchestrator/server/error_replies.h"
#include "orchestrator/server/generation.h"
#include "orchestrator/server/latency_window.h"
#include "orchestrator/server/model_assets.h"
#include "orchestrator/server/placement.h"
#include "orchestrator/server/router_metrics.h"
#include "orchestrator/server/stop_strings.h"
#include "orchestrator/tokenizer/tokenizer.h"

namespace tandem::router {

// Who sent a request: its API key (null when the router has no keys), and
// the store that key lives in.
struct Caller {
  std::shared_ptr<const ApiKeyStore> store;
  const ApiKeyIdentity* key = nullptr;
  // Key name for the limiter and the fair queue; "" without keys.
  std::string name() const { return key != nullptr ? key->name : std::string(); }
  bool admin() const { return key != nullptr && key->admin; }
};

enum class CallKind { kChat, kCompletion };

// Everything the generations need, set once before Start.
struct CallSetup {
  std::string session_id;
  bool explain = false;  // x-tandem-explain: answer with x-tandem-route
  std::vector<int32_t> prompt;
  tandem::v1::SamplingParams sampling;  // without the seed
  std::optional<int64_t> seed;
  int n = 1;
  std::vector<std::string> stops;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  std::string echo;            // completions: the prompt text to prepend
  bool tokens_as_ids = false;  // return_tokens_as_token_ids
  std::string model;
  Caller caller;
  // Worker addresses may reach the client (debug.worker_details, admin keys).
  bool show_workers = false;
  // Tokens the call may use: prompt + n x max_tokens (the per-key
  // tokens_per_min charge; see KeyLimitsConfig).
  int64_t token_estimate = 0;
};

// Attempt deadlines in seconds (0 = off; see RetriesConfig).
struct AttemptDeadlines {
  double first_token_s = 0;
  double idle_s = 0;
};

// What a call uses of the router, which owns all of it and outlives its calls.
struct CallEnv {
  const ModelAssets* assets = nullptr;
  RouterMetrics* metrics = nullptr;
  Admission* admission = nullptr;
  Placer* placer = nullptr;
  ErrorReplies* errors = nullptr;
  // Where attempts record their first-token latency and token gaps.
  LatencyWindow* first_token_latency = nullptr;
  LatencyWindow* token_gaps = nullptr;
  // Written by the watchdog before it watches the calls; read in Watch, on
  // its thread.
  const AttemptDeadlines* deadlines = nullptr;
  // Runs a task later, not under the caller's locks.
  std::function<void(std::function<void()>)> post;
};

class ApiCall : public GenerationSink, public Admittable, public std::enable_shared_from_this<ApiCall> {
 public:
  using Clock = std::chrono::steady_clock;

  // REQUIRES: *env outlives the call.
  ApiCall(const CallEnv* env, std::shared_ptr<http::ResponseWriter> writer, CallKind kind, std::string request_id,
          std::shared_ptr<const RouterConfig> config)
      : env_(env),
        writer_(std::move(writer)),
        kind_(kind),
        request_id_(std::move(request_id)),
        config_(std::move(config)),
        arrived_(Clock::now()) {}

  const std::string& endpoint() const;
  const std::string& request_id() const { return request_id_; }
  const Caller& caller() const { return caller_; }
  bool show_workers() const { return show_workers_; }

  // Sets the call up; before admission.
  void Prepare(CallSetup setup, uint64_t random_seed);

  // Admittable.
  // Sequences the call runs (its n): its share of limits.max_in_flight.
  int n() const override { return n_; }
  const ApiKeyIdentity* key() const override { return caller_.key; }
  int64_t token_estimate() const override { return token_estimate_; }
  // Prompt and generated tokens so far: what the call used of its key's
  // tokens_per_min.
  int64_t TokensUsed() override;
  // Runs the generations (after admission).
  void Start() override;
  // Ends the request with `why`: queued, it is answered now; running, its
  // generations are cancelled and report `why`. Call with no lock held.
  void Cancel(const absl::Status& why) override;
  // The request's timeouts, and its generations' attempt deadlines
  // (env->deadlines).
  void Watch(Clock::time_point now) override;

  // GenerationSink.
  void OnPlaced(int choice, const Placement& placement) override;

  bool OnTokens(int index, std::span<const tandem::v1::TokenOutput> tokens) override;

  void OnDone(int index, const GenerationResult& result) override;

  std::shared_ptr<http::ResponseWriter> writer() const { return writer_; }

 private:
  struct Choice {
    Choice(const Tokenizer* tokenizer, std::vector<std::string> stops)
        : detok(*tokenizer, /*skip_special_tokens=*/true), stops(std::move(stops)) {}
    IncrementalDetokenizer detok;
    StopStrings stops;
    std::string text;
    std::vector<TokenLogprob> logprobs;
    int64_t tokens = 0;
    bool role_sent = false;
    FinishReason finish = FinishReason::kStop;
    GenerationResult result;
    std::optional<Clock::time_point> last_token_at;
  };

  // Final accounting, once every generation is done (before the response's
  // last bytes, so a client that reads /metrics next sees its request).
  void AccountLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prompt plus generated tokens so far (TokensUsed under the lock).
  int64_t TokensUsedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  TokenLogprob MakeLogprob(const tandem::v1::TokenOutput& t) const;

  http::HeaderList Headers() const;

  void StartStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void WriteDeltaLocked(int index, const std::string& text, std::optional<std::vector<TokenLogprob>> logprobs,
                        std::optional<FinishReason> finish) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Usage UsageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Every choice ended well: the response's end.
  void CompleteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void SendApiError(const absl::Status& status);

  const CallEnv* const env_;
  const std::shared_ptr<http::ResponseWriter> writer_;
  const CallKind kind_;
  const std::string request_id_;
  const std::shared_ptr<const RouterConfig> config_;
  const Clock::time_point arrived_;
  std::string session_id_;
  ResponseHeader header_;
  bool stream_ = false;
  bool logprobs_ = false;
  std::string echo_;
  int64_t prompt_tokens_ = 0;
  std::vector<tandem::v1::GenerateRequest> requests_;
  int n_ = 1;
  Caller caller_;
  std::unique_ptr<RequestPlanner> planner_;  // set by Prepare
  int64_t token_estimate_ = 0;
  bool show_workers_ = false;
  bool explain_ = false;
  std::string route_ ABSL_GUARDED_BY(mu_);            // the placement's explanation (x-tandem-route)
  int64_t expected_cached_ ABSL_GUARDED_BY(mu_) = 0;  // choice 0's placement's expectation

  std::mutex mu_;
  std::vector<Choice> choices_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Generation>> gens_ ABSL_GUARDED_BY(mu_);
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // the response is complete or failed
  bool stream_started_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::string prefill_worker_ ABSL_GUARDED_BY(mu_);
  std::string decode_worker_ ABSL_GUARDED_BY(mu_);
  bool disaggregated_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<Clock::time_point> first_token_at_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_token_at_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_API_CALL_H_
