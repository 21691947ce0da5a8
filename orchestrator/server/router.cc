#include "orchestrator/server/router.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_poller.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/serial_executor.h"
#include "common/status_macros.h"
#include "common/thread_util.h"
#include "nlohmann/json.hpp"
#include "orchestrator/admission/api_keys.h"
#include "orchestrator/admission/fair_queue.h"
#include "orchestrator/admission/key_limiter.h"
#include "orchestrator/cluster/cluster.h"
#include "orchestrator/http/http_server.h"
#include "orchestrator/openai/openai_api.h"
#include "orchestrator/routing/kv_cache_aware.h"
#include "orchestrator/server/generation.h"
#include "orchestrator/server/latency_window.h"
#include "orchestrator/server/model_assets.h"
#include "orchestrator/server/status_page.h"
#include "orchestrator/server/redact.h"
#include "orchestrator/server/stop_strings.h"

namespace tandem::router {

using Clock = std::chrono::steady_clock;
using tandem::v1::TokenOutput;

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr char kJson[] = "application/json";
// A request header asking why it was routed where it was (x-tandem-route).
constexpr char kExplainHeader[] = "x-tandem-explain";

// Routing for one config and one model shape: the pools' policies (with the
// model's block size and hash seed) and their KV indexes.
struct RoutingState {
  std::shared_ptr<const RouterConfig> config;
  // Shared with the next state when a reload leaves a pool's policy and its
  // parameters as they were, so its state (cursor, ring, sessions, index,
  // counters) carries on.
  std::shared_ptr<RoutingPolicy> policy[kNumPoolRoles];
  PolicyParams params[kNumPoolRoles];  // as created
  PolicyContext context;                // the workers' block size and hash seed
  std::shared_ptr<KvIndex> index[kNumPoolRoles];
  int64_t max_context = 0;
  int64_t vocab_size = 0;
};

// Routing decision histograms' bounds, with 50, 75, 100 and 150 us among
// them: the decision's budget is 100 us.
std::vector<double> DecisionBuckets() {
  return {1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4,
          5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1};
}

std::string RandomHex(std::mt19937_64& rng) {
  return absl::StrFormat("%016x", rng());
}

FinishReason ToApiFinish(tandem::v1::FinishReason r) {
  switch (r) {
    case tandem::v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    case tandem::v1::FINISH_REASON_ABORT:
      return FinishReason::kAbort;
    default:
      return FinishReason::kStop;
  }
}

// The outcome label of a finished request.
std::string Outcome(const absl::Status& s) {
  if (s.ok()) return "ok";
  if (s.code() == absl::StatusCode::kCancelled) return "cancelled";
  if (s.code() == absl::StatusCode::kDeadlineExceeded) return "timeout";
  if (s.code() == absl::StatusCode::kInvalidArgument ||
      s.code() == absl::StatusCode::kOutOfRange) {
    return "invalid";
  }
  return "error";
}

// One WARNING per kind per 10 s, saying how many were not logged: a flood
// of bad keys or refused requests must not flood the log.
class ThrottledWarnings {
 public:
  void Warn(const std::string& kind, const std::string& text) {
    const Clock::time_point now = Clock::now();
    int64_t suppressed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Entry& e = entries_[kind];
      if (e.logged && now - e.last < std::chrono::seconds(10)) {
        ++e.suppressed;
        return;
      }
      suppressed = e.suppressed;
      e = Entry{true, now, 0};
    }
    LOG(WARNING) << text
                 << (suppressed > 0 ? absl::StrFormat(" (and %d more like it not logged)", suppressed)
                                    : std::string());
  }

 private:
  struct Entry {
    bool logged = false;
    Clock::time_point last;
    int64_t suppressed = 0;
  };
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

// Who sent a request: its API key (null when the router has no keys), and
// the store that key lives in.
struct Caller {
  std::shared_ptr<const ApiKeyStore> store;
  const ApiKeyIdentity* key = nullptr;
  // Key name for the limiter and the fair queue; "" without keys.
  std::string name() const { return key != nullptr ? key->name : std::string(); }
  bool admin() const { return key != nullptr && key->admin; }
};

// Which callers an endpoint admits when keys are configured.
enum class Access { kOpen, kClient, kAdmin };

// Bound on a /tokenize text, in bytes per token of the model's context. A
// byte-level BPE token covers a few bytes of English (about 4) and rarely
// more than 16, so a text past 16 x the context could not be a prompt of
// this model; refusing it before tokenizing bounds the work and the answer
// (token_strs) by the model, not by the body limit.
constexpr int64_t kTokenizeBytesPerContextToken = 16;

}  // namespace

class ApiCall;

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
  std::string echo;  // completions: the prompt text to prepend
  bool tokens_as_ids = false;  // return_tokens_as_token_ids
  std::string model;
  Caller caller;
  // Tokens the call may use: prompt + n x max_tokens (the per-key
  // tokens_per_min charge; see KeyLimitsConfig).
  int64_t token_estimate = 0;
};

class Router::Impl {
 public:
  Impl(RouterConfig config, std::string config_path, std::shared_ptr<const ModelAssets> assets,
       std::shared_ptr<const tls::ChannelFactory> channels);
  ~Impl();

  absl::Status Start();
  void Stop();
  int port() const { return http_ ? http_->port() : 0; }
  absl::Status Reload();

  // Used by ApiCall.
  absl::StatusOr<Placement> Place(const ApiCall& call, std::span<const int32_t> tokens,
                                  const std::set<std::string>& exclude);
  bool TakeRetry();
  // Frees the call's admission slot and hands it to the next queued call
  // (started on the executor). Idempotent.
  void ReleaseSlot(const std::shared_ptr<ApiCall>& call);
  // Accounts a call whose generations all ended and forgets it.
  void CallFinished(const std::shared_ptr<ApiCall>& call);
  void Dequeue(const std::shared_ptr<ApiCall>& call);
  // Runs `task` later, not under the caller's locks: on the gRPC poller's
  // thread after its current completion when called there (no thread to
  // wake), on the router's task thread otherwise.
  void Post(std::function<void()> task) {
    if (!GrpcPoller::RunAfterThisCompletion(task)) executor_.Post(std::move(task));
  }
  const ModelAssets& assets() const { return *assets_; }

  struct Metrics {
    explicit Metrics(MetricsRegistry& r);
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
    Counter& prompt_tokens;
    Counter& cached_tokens;
    Counter& expected_cached_tokens;
    Counter& generation_tokens;
    Counter& kv_bytes;
    Gauge& queue_depth;
    Gauge& in_flight;
    Gauge& in_flight_sequences;
    CounterFamily& auth_failures;
    CounterFamily& rate_limited;
    CounterFamily& refusals;
    CounterFamily& kv_full_skips;
  };
  Metrics& metrics() { return *metrics_; }
  // Attempts' first-token latency and the gaps between token messages: the
  // basis of `auto` attempt deadlines.
  LatencyWindow& first_token_latency() { return first_token_latency_; }
  LatencyWindow& token_gaps() { return token_gaps_; }
  // Worker addresses to redact from client-visible texts.
  std::vector<std::string> WorkerAddresses();
  // Whether `caller` may see worker addresses (debug.worker_details, or an
  // admin key).
  bool ShowWorkers(const Caller& caller) const {
    return caller.admin() || config()->debug.worker_details;
  }

 private:
  friend class ApiCall;

  // The routing state, built once a worker has told the model's shape.
  std::shared_ptr<RoutingState> Routing();
  // The routing state as it is (null before it was built); never builds.
  std::shared_ptr<RoutingState> CurrentRouting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return routing_;
  }
  // `prev` (may be null): the running state, whose policies are kept where
  // the config leaves them unchanged.
  std::shared_ptr<RoutingState> BuildRouting(std::shared_ptr<const RouterConfig> config,
                                             const tandem::v1::ModelInfo& info,
                                             const RoutingState* prev);
  std::shared_ptr<const RouterConfig> config() const {
    std::lock_guard<std::mutex> lock(mu_);
    return config_;
  }
  void ApplyClusterConfig(const RouterConfig& config);
  void RegisterCallbacks();
  void WatchdogLoop();

  // HTTP handlers.
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
  bool Authorize(Access access, const std::string& endpoint, const http::Request& req,
                 http::ResponseWriter& w);
  // Returns what an admitted call took from its key's limits. Idempotent.
  void ReleaseKey(const std::shared_ptr<ApiCall>& call);
  // Pops queued calls while the next one's sequences fit max_in_flight.
  void DrainQueueLocked(std::vector<std::shared_ptr<ApiCall>>* next)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string RequestId(const http::Request& req);
  // Sends an OpenAI error for `status` (counted under `endpoint`).
  // (`headers`, when given, replace the x-request-id header: they carry it;
  // a Retry-After among them replaces the default one.) Worker addresses in
  // the message are redacted unless `show_workers`.
  void SendError(const std::string& endpoint, const std::string& request_id,
                 http::ResponseWriter& w, const absl::Status& status,
                 http::HeaderList headers = {}, bool show_workers = false);
  // The error a client reads for `status`, its worker addresses redacted
  // unless `show_workers`.
  ApiError ClientError(const absl::Status& status, bool show_workers);
  // Renders a parsed chat request with the chat template and tokenizes it
  // (special-token text in the user's strings stays text unless
  // model.parse_special_tokens_in_messages).
  absl::StatusOr<std::vector<int32_t>> ChatPrompt(const ChatCompletionRequest& chat,
                                                  bool add_special_tokens) const;
  // Validates prompt length against the model; fills vocab-range errors.
  absl::Status CheckPrompt(std::span<const int32_t> prompt, std::optional<int64_t> max_tokens,
                           const std::string& param);
  // Fills what chat and completions share, then admits the call.
  void StartCall(CallKind kind, const http::Request& req,
                 std::shared_ptr<http::ResponseWriter> w, const std::string& id,
                 std::shared_ptr<const RouterConfig> cfg, CallSetup s,
                 const std::string& model, const SamplingFields& sampling,
                 std::optional<int64_t> logprobs);
  void Admit(const std::shared_ptr<ApiCall>& call);

  const std::string config_path_;
  const std::shared_ptr<const ModelAssets> assets_;
  const int64_t created_ = std::chrono::duration_cast<std::chrono::seconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
  MetricsRegistry registry_;
  std::unique_ptr<Metrics> metrics_;
  Cluster cluster_;
  std::unique_ptr<http::HttpServer> http_;

  std::mutex build_mu_;  // one BuildRouting at a time (it rewires the cluster's indexes)
  mutable std::mutex mu_;
  std::shared_ptr<const RouterConfig> config_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<RoutingState> routing_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
  double retry_tokens_ ABSL_GUARDED_BY(mu_) = 10;
  // Sequences (choices) on workers, against limits.max_in_flight, and the
  // requests they belong to.
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  RecentDecisions recent_{32};  // for /dashboard
  int64_t running_requests_ ABSL_GUARDED_BY(mu_) = 0;
  // Shared fairly between keys; FIFO without keys.
  FairQueue<std::shared_ptr<ApiCall>> queue_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const ApiKeyStore> keys_ ABSL_GUARDED_BY(mu_);
  KeyLimiter limiter_;
  ThrottledWarnings warnings_;
  std::set<std::shared_ptr<ApiCall>> active_ ABSL_GUARDED_BY(mu_);
  std::condition_variable idle_cv_;  // active_ emptied: Stop waits for it
  std::condition_variable stop_cv_;  // stopping_ set: wakes the watchdog (apart,
                                     // so finishing calls do not wake it)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ = false;
  std::thread watchdog_;
  LatencyWindow first_token_latency_;
  LatencyWindow token_gaps_;
  SerialExecutor executor_{"router_tasks"};
};

// ---------------------------------------------------------------------------
// ApiCall: one chat or completion request, from admission to the last byte.

class ApiCall : public GenerationSink, public Planner, public std::enable_shared_from_this<ApiCall> {
 public:
  ApiCall(Router::Impl* router, std::shared_ptr<http::ResponseWriter> writer, CallKind kind,
          std::string request_id, std::shared_ptr<const RouterConfig> config)
      : router_(router),
        writer_(std::move(writer)),
        kind_(kind),
        request_id_(std::move(request_id)),
        config_(std::move(config)),
        arrived_(Clock::now()) {}

  const std::string& endpoint() const {
    static const std::string chat = "chat", completions = "completions";
    return kind_ == CallKind::kChat ? chat : completions;
  }
  const std::string& request_id() const { return request_id_; }
  const std::string& session_id() const { return session_id_; }
  bool explain() const { return explain_; }
  const RouterConfig& config() const { return *config_; }

  void Prepare(CallSetup setup, uint64_t random_seed) {
    session_id_ = setup.session_id;
    explain_ = setup.explain;
    header_.id = absl::StrCat(kind_ == CallKind::kChat ? "chatcmpl-" : "cmpl-", request_id_);
    header_.created = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
    header_.model = setup.model;
    header_.include_usage = setup.include_usage;
    header_.tokens_as_ids = setup.tokens_as_ids;
    stream_ = setup.stream;
    logprobs_ = setup.logprobs;
    echo_ = setup.echo;
    const uint64_t seed = setup.seed.has_value() ? static_cast<uint64_t>(*setup.seed) : random_seed;
    for (int i = 0; i < setup.n; ++i) {
      choices_.emplace_back(router_->assets().tokenizer.get(), setup.stops);
      tandem::v1::GenerateRequest req;
      req.mutable_prompt_token_ids()->Assign(setup.prompt.begin(), setup.prompt.end());
      *req.mutable_sampling() = setup.sampling;
      // Always a seed: a split request must sample the same first token on
      // both workers; choices differ by their index.
      req.mutable_sampling()->set_seed(seed + static_cast<uint64_t>(i));
      requests_.push_back(std::move(req));
    }
    prompt_tokens_ = static_cast<int64_t>(setup.prompt.size());
    remaining_ = setup.n;
    n_ = setup.n;
    caller_ = std::move(setup.caller);
    token_estimate_ = setup.token_estimate;
    show_workers_ = router_->ShowWorkers(caller_);
  }

  // Sequences the call runs (its n): its share of limits.max_in_flight.
  int n() const { return n_; }
  const Caller& caller() const { return caller_; }
  int64_t token_estimate() const { return token_estimate_; }
  // Prompt and generated tokens so far: what the call used of its key's
  // tokens_per_min.
  int64_t TokensUsed() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t used = prompt_tokens_;
    for (const Choice& c : choices_) used += c.tokens;
    return used;
  }

  // Runs the generations (after admission).
  void Start() {
    router_->metrics().queue_time.Observe(Seconds(Clock::now() - arrived_));
    std::vector<std::shared_ptr<Generation>> gens;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) {
        // Cancelled while queued: nothing ran.
        remaining_ = 0;
      } else {
        started_ = true;
        const auto deadline = std::chrono::system_clock::now() +
                              std::chrono::milliseconds(
                                  static_cast<int64_t>(config_->timeouts.request_s * 1000));
        for (size_t i = 0; i < requests_.size(); ++i) {
          Generation::Options o{.choice = static_cast<int>(i),
                                .request_id = request_id_,
                                .max_attempts = config_->retries.max_attempts,
                                .deadline = deadline,
                                .max_failovers = config_->retries.max_failovers,
                                .first_token_latency = &router_->first_token_latency(),
                                .token_gaps = &router_->token_gaps()};
          gens_.push_back(std::make_shared<Generation>(o, std::move(requests_[i]), this, this));
        }
        gens = gens_;
      }
    }
    if (gens.empty()) {
      router_->CallFinished(shared_from_this());
      return;
    }
    for (const std::shared_ptr<Generation>& g : gens) g->Start();
  }

  // Ends the request with `why`: queued, it is answered now; running, its
  // generations are cancelled and report `why`. Call with no lock held.
  void Cancel(const absl::Status& why) {
    std::vector<std::shared_ptr<Generation>> gens;
    bool answer_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      if (!started_) {
        finished_ = true;
        answer_now = true;
        failure_ = why;
      } else {
        gens = gens_;
      }
    }
    if (answer_now) {
      router_->Dequeue(shared_from_this());
      SendApiError(why);
      router_->metrics().outcomes.WithLabels({"none", Outcome(why)}).Inc();
      return;
    }
    for (const std::shared_ptr<Generation>& g : gens) g->Cancel(why);
  }

  // The watchdog's check of the request's timeouts, and of its generations'
  // attempt deadlines (seconds, 0 = off).
  void CheckDeadlines(Clock::time_point now, double attempt_first_token_s, double attempt_idle_s) {
    absl::Status why;
    std::vector<std::shared_ptr<Generation>> gens;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      gens = gens_;
      const TimeoutsConfig& t = config_->timeouts;
      if (now - arrived_ > std::chrono::duration<double>(t.request_s)) {
        why = absl::DeadlineExceededError(
            absl::StrFormat("the request did not finish within %g s (timeouts.request_s)",
                            t.request_s));
      } else if (!first_token_at_.has_value()) {
        if (now - arrived_ > std::chrono::duration<double>(t.first_token_s)) {
          why = absl::DeadlineExceededError(absl::StrFormat(
              "no token within %g s (timeouts.first_token_s)", t.first_token_s));
        }
      } else if (now - last_token_at_ > std::chrono::duration<double>(t.idle_stream_s)) {
        why = absl::DeadlineExceededError(absl::StrFormat(
            "no token for %g s (timeouts.idle_stream_s)", t.idle_stream_s));
      }
    }
    if (!why.ok()) {
      Cancel(why);
      return;
    }
    // (Not under mu_: a generation calls this sink under its own lock.)
    for (const std::shared_ptr<Generation>& g : gens) {
      g->CheckProgress(now, attempt_first_token_s, attempt_idle_s);
    }
  }

  // Planner.
  absl::StatusOr<Placement> Place(std::span<const int32_t> tokens,
                                  const std::set<std::string>& exclude) override {
    return router_->Place(*this, tokens, exclude);
  }
  bool TakeRetry() override { return router_->TakeRetry(); }

  // GenerationSink.
  void OnPlaced(int choice, const Placement& placement) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!placement.explanation.empty()) route_ = placement.explanation;  // the latest attempt's
    if (choice == 0) {
      // What the policy expected the worker that prefills to hold (the latest attempt's).
      expected_cached_ = placement.prefill != nullptr ? placement.prefill_cached_tokens
                                                      : placement.decode_cached_tokens;
    }
    if (prefill_worker_.empty()) {
      decode_worker_ = placement.decode->address();
      prefill_worker_ =
          placement.prefill != nullptr ? placement.prefill->address() : decode_worker_;
      disaggregated_ = placement.prefill != nullptr;
    }
    if (placement.local_prefill) {
      router_->metrics().fallbacks.WithLabels({"local_prefill"}).Inc();
    }
  }

  bool OnTokens(int index, std::span<const TokenOutput> tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return false;
    Choice& c = choices_[index];
    const Clock::time_point now = Clock::now();
    const std::string mode = disaggregated_ ? "disaggregated" : "aggregated";
    if (!first_token_at_.has_value()) {
      first_token_at_ = now;
      router_->metrics().ttft.WithLabels({mode}).Observe(Seconds(now - arrived_));
    }
    if (c.last_token_at.has_value()) {
      Histogram& itl = router_->metrics().itl.WithLabels({mode});
      const double gap = Seconds(now - *c.last_token_at) / static_cast<double>(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) itl.Observe(gap);
    }
    c.last_token_at = now;
    last_token_at_ = now;

    std::string text;
    std::vector<TokenLogprob> logprobs;
    for (const TokenOutput& t : tokens) {
      ++c.tokens;
      text += c.stops.Push(c.detok.Add(t.token_id()));
      if (logprobs_) logprobs.push_back(MakeLogprob(t));
      if (c.stops.stopped()) break;
    }
    if (stream_) {
      // The stream starts with the first token even when its text is not
      // complete yet (part of a UTF-8 character): from here on the client
      // hears of failures as an error event, and there are no retries.
      StartStreamLocked();
      if (!text.empty() || !logprobs.empty()) WriteDeltaLocked(index, text, std::move(logprobs), std::nullopt);
    } else {
      c.text += text;
      if (logprobs_) c.logprobs.insert(c.logprobs.end(), logprobs.begin(), logprobs.end());
    }
    return !c.stops.stopped();
  }

  void OnDone(int index, const GenerationResult& result) override {
    bool cancel_others = false;
    bool all_done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Choice& c = choices_[index];
      c.result = result;
      if (!finished_) {
        if (!result.status.ok()) {
          finished_ = true;
          failure_ = result.status;
          cancel_others = remaining_ > 1;
          if (!stream_started_) {
            SendApiError(result.status);
          } else {
            writer_->Write(ErrorChunk(router_->ClientError(result.status, show_workers_)));
            writer_->Write(DoneChunk());
            writer_->End();
          }
        } else {
          std::string tail;
          if (!c.stops.stopped()) tail = c.stops.Push(c.detok.Flush());
          if (!c.stops.stopped()) tail += c.stops.Flush();
          const FinishReason finish =
              c.stops.stopped() ? FinishReason::kStop : ToApiFinish(result.finish_reason);
          c.finish = finish;
          if (stream_) {
            WriteDeltaLocked(index, tail, std::nullopt, finish);
          } else {
            c.text += tail;
          }
        }
      }
      all_done = --remaining_ == 0;
      // The admission slot is free before the client sees the end, so a
      // client's next request never finds its own last one still counted.
      if (all_done) {
        router_->ReleaseSlot(shared_from_this());
        AccountLocked();
      }
      if (all_done && !finished_) {
        finished_ = true;
        CompleteLocked();
      }
    }
    if (cancel_others) {
      // Not from here: this runs under the Generation's lock, and another
      // generation's Cancel takes its own.
      auto self = shared_from_this();
      router_->Post([self] { self->Cancel(absl::CancelledError("another choice failed")); });
    }
    if (all_done) {
      auto self = shared_from_this();
      router_->Post([self] { self->router_->CallFinished(self); });
    }
  }

  // Final accounting, once every generation is done (before the response's
  // last bytes, so a client that reads /metrics next sees its request).
  void AccountLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Router::Impl::Metrics& m = router_->metrics();
    const absl::Status& s = failure_;
    if (s.ok() || stream_started_) {
      // (Errors before the response started were counted when sent.)
      m.requests.WithLabels({endpoint(), "200"}).Inc();
    }
    m.e2e.WithLabels({endpoint()}).Observe(Seconds(Clock::now() - arrived_));
    for (const Choice& c : choices_) {
      const GenerationResult& r = c.result;
      const std::string worker = r.decode_worker.empty() ? "none" : r.decode_worker;
      m.outcomes.WithLabels({worker, Outcome(r.status.ok() ? s : r.status)}).Inc();
      const int failovers = r.error_failovers + r.stall_failovers;
      if (r.attempts - 1 - failovers > 0) m.retries.Inc(r.attempts - 1 - failovers);
      if (r.error_failovers > 0) m.failovers.WithLabels({"error"}).Inc(r.error_failovers);
      if (r.stall_failovers > 0) m.failovers.WithLabels({"stall"}).Inc(r.stall_failovers);
      if (r.first_token_timeouts > 0) {
        m.attempt_timeouts.WithLabels({"first_token"}).Inc(r.first_token_timeouts);
      }
      if (r.idle_timeouts > 0) m.attempt_timeouts.WithLabels({"idle"}).Inc(r.idle_timeouts);
      if (r.kv_fallback) m.fallbacks.WithLabels({"kv_transfer"}).Inc();
      m.generation_tokens.Inc(static_cast<double>(c.tokens));
      m.kv_bytes.Inc(static_cast<double>(r.kv_bytes));
    }
    m.prompt_tokens.Inc(static_cast<double>(prompt_tokens_));
    if (!choices_.empty()) m.cached_tokens.Inc(static_cast<double>(choices_[0].result.cached_tokens));
    m.expected_cached_tokens.Inc(static_cast<double>(expected_cached_));
    LOG(DEBUG) << "request " << request_id_ << " " << endpoint() << " done: " << s.ToString();
  }

  std::shared_ptr<http::ResponseWriter> writer() const { return writer_; }

  // Holds an admission slot (Router::Impl's in_flight_). Guarded by the
  // Impl's mutex.
  bool slot = false;
  // Holds a place in its key's limits (KeyLimiter), with this charge.
  // Guarded by the Impl's mutex.
  bool key_held = false;
  int64_t charged_tokens = 0;

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

  TokenLogprob MakeLogprob(const TokenOutput& t) const {
    const Tokenizer& tok = *router_->assets().tokenizer;
    TokenLogprob out;
    out.token_id = t.token_id();
    tok.AppendTokenBytes(t.token_id(), /*skip_special_tokens=*/false, &out.token);
    out.logprob = t.logprob();
    for (const tandem::v1::TopLogprob& top : t.top_logprobs()) {
      TopLogprob tl;
      tl.token_id = top.token_id();
      tok.AppendTokenBytes(top.token_id(), false, &tl.token);
      tl.logprob = top.logprob();
      out.top_logprobs.push_back(std::move(tl));
    }
    return out;
  }

  http::HeaderList Headers() const {
    http::HeaderList h = {{"x-request-id", request_id_}};
    // Worker addresses are debug output (debug.worker_details, admin keys).
    if (show_workers_ && !prefill_worker_.empty()) {
      h.emplace_back("x-tandem-prefill-worker", prefill_worker_);
      h.emplace_back("x-tandem-decode-worker", decode_worker_);
    }
    if (explain_ && !route_.empty()) h.emplace_back("x-tandem-route", route_);
    return h;
  }

  void StartStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stream_started_) return;
    stream_started_ = true;
    http::HeaderList h = Headers();
    h.emplace_back("Cache-Control", "no-cache");
    writer_->StartStream(200, "text/event-stream", h);
  }

  void WriteDeltaLocked(int index, const std::string& text,
                        std::optional<std::vector<TokenLogprob>> logprobs,
                        std::optional<FinishReason> finish) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StartStreamLocked();
    Choice& c = choices_[index];
    if (kind_ == CallKind::kChat) {
      ChatDelta d;
      d.index = index;
      d.first = !c.role_sent;
      c.role_sent = true;
      d.content = text;
      if (logprobs_) d.logprobs = logprobs.value_or(std::vector<TokenLogprob>{});
      d.finish_reason = finish;
      writer_->Write(ChatChunk(header_, d));
    } else {
      CompletionDelta d;
      d.index = index;
      if (!c.role_sent && !echo_.empty()) {
        d.text = echo_;
      }
      c.role_sent = true;
      d.text += text;
      if (logprobs_) d.logprobs = logprobs.value_or(std::vector<TokenLogprob>{});
      d.finish_reason = finish;
      writer_->Write(CompletionChunk(header_, d));
    }
  }

  Usage UsageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Usage u;
    u.prompt_tokens = prompt_tokens_;
    for (const Choice& c : choices_) {
      u.completion_tokens += c.tokens;
      u.cached_tokens = std::max(u.cached_tokens, c.result.cached_tokens);
    }
    return u;
  }

  // Every choice ended well: the response's end.
  void CompleteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stream_) {
      StartStreamLocked();
      if (header_.include_usage) {
        writer_->Write(UsageChunk(header_, UsageLocked(), kind_ == CallKind::kChat));
      }
      writer_->Write(DoneChunk());
      writer_->End();
      return;
    }
    std::string body;
    if (kind_ == CallKind::kChat) {
      std::vector<ChatChoice> out;
      for (size_t i = 0; i < choices_.size(); ++i) {
        ChatChoice c;
        c.index = static_cast<int>(i);
        c.content = choices_[i].text;
        c.finish_reason = choices_[i].finish;
        if (logprobs_) c.logprobs = choices_[i].logprobs;
        out.push_back(std::move(c));
      }
      body = ChatCompletionJson(header_, out, UsageLocked());
    } else {
      std::vector<CompletionChoice> out;
      for (size_t i = 0; i < choices_.size(); ++i) {
        CompletionChoice c;
        c.index = static_cast<int>(i);
        c.text = echo_ + choices_[i].text;
        c.finish_reason = choices_[i].finish;
        c.text_offset_base = static_cast<int64_t>(echo_.size());
        if (logprobs_) c.logprobs = choices_[i].logprobs;
        out.push_back(std::move(c));
      }
      body = CompletionJson(header_, out, UsageLocked());
    }
    writer_->Send(200, kJson, std::move(body), Headers());
  }

  void SendApiError(const absl::Status& status) {
    router_->SendError(endpoint(), request_id_, *writer_, status, Headers(), show_workers_);
  }

  Router::Impl* const router_;
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
  int64_t token_estimate_ = 0;
  bool show_workers_ = false;
  bool explain_ = false;
  std::string route_ ABSL_GUARDED_BY(mu_);  // the placement's explanation (x-tandem-route)
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

// ---------------------------------------------------------------------------
// Router::Impl

Router::Impl::Metrics::Metrics(MetricsRegistry& r)
    : requests(r.AddCounter("tandem_router_requests_total",
                            "Requests answered, by endpoint and HTTP status.",
                            {"endpoint", "code"})),
      ttft(r.AddHistogram("tandem_router_time_to_first_token_seconds",
                          "From arrival at the router to the first generated token.", {"mode"},
                          ExponentialBuckets(0.001, 2, 17))),
      itl(r.AddHistogram("tandem_router_inter_token_latency_seconds",
                         "Time between consecutive tokens of one choice.", {"mode"},
                         ExponentialBuckets(0.0005, 2, 15))),
      e2e(r.AddHistogram("tandem_router_e2e_request_latency_seconds",
                         "From arrival to the last byte of the response.", {"endpoint"},
                         ExponentialBuckets(0.001, 2, 20))),
      queue_time(r.AddHistogram("tandem_router_queue_time_seconds",
                                "Time a request waited for an admission slot.", {},
                                ExponentialBuckets(0.0001, 2, 20))
                     .Get()),
      decision(r.AddHistogram("tandem_router_routing_decision_seconds",
                              "Time to choose a worker, by pool.", {"pool"}, DecisionBuckets())),
      decision_cpu(r.AddHistogram(
          "tandem_router_routing_decision_cpu_seconds",
          "CPU time of the thread choosing a worker, by pool: the decision's own cost, without "
          "the time the thread was preempted (which the wall-clock histogram includes).",
          {"pool"}, DecisionBuckets())),
      routed(r.AddCounter("tandem_router_routed_total",
                          "Routing decisions, by pool, policy and chosen worker.",
                          {"pool", "policy", "worker"})),
      outcomes(r.AddCounter("tandem_router_worker_outcomes_total",
                            "Finished generations, by decode worker and outcome.",
                            {"worker", "outcome"})),
      fallbacks(r.AddCounter("tandem_router_fallbacks_total",
                             "Disaggregation fallbacks: local_prefill (placed aggregated on the "
                             "decode worker), kv_transfer (the KV never reached it).",
                             {"kind"})),
      reloads(r.AddCounter("tandem_router_config_reloads_total",
                           "Config reloads (SIGHUP), by result: ok, error (the running "
                           "config stays), or deferred (also counted ok: it changed keys that "
                           "apply at the next restart, which were kept as they run).",
                           {"result"})),
      retries(r.AddCounter("tandem_router_retries_total",
                           "Attempts repeated on another worker before the first token.")
                  .Get()),
      failovers(r.AddCounter("tandem_router_failovers_total",
                             "Generations resumed on another decode worker after tokens were "
                             "sent, by reason: error (the worker's stream failed) or stall (no "
                             "token within retries.attempt_idle_s / attempt_first_token_s).",
                             {"reason"})),
      attempt_timeouts(r.AddCounter(
          "tandem_router_attempt_timeouts_total",
          "Attempts past their deadline, by phase: first_token (retries.attempt_first_token_s) "
          "or idle (retries.attempt_idle_s, mid-stream); moved to another worker when one was "
          "healthy.",
          {"phase"})),
      prompt_tokens(r.AddCounter("tandem_router_prompt_tokens_total", "Prompt tokens served.")
                        .Get()),
      cached_tokens(r.AddCounter("tandem_router_cached_prompt_tokens_total",
                                 "Prompt tokens served from a worker's prefix cache.")
                        .Get()),
      expected_cached_tokens(
          r.AddCounter("tandem_router_expected_cached_prompt_tokens_total",
                       "Prompt tokens the routing policy expected the chosen worker to hold in "
                       "its prefix cache (kv_cache_aware; 0 where a policy cannot tell). Against "
                       "tandem_router_cached_prompt_tokens_total: how well the router's KV index "
                       "knows the workers' caches.")
              .Get()),
      generation_tokens(
          r.AddCounter("tandem_router_generation_tokens_total", "Tokens generated.").Get()),
      kv_bytes(r.AddCounter("tandem_router_kv_transfer_bytes_total",
                            "KV bytes pulled by decode workers for split requests.")
                   .Get()),
      queue_depth(r.AddGauge("tandem_router_queue_depth", "Requests waiting for a slot.").Get()),
      in_flight(r.AddGauge("tandem_router_in_flight_requests",
                           "Requests running on workers (router-wide).")
                    .Get()),
      in_flight_sequences(r.AddGauge("tandem_router_in_flight_sequences",
                                     "Sequences (choices: a request with n = 8 runs 8) running on "
                                     "workers, against limits.max_in_flight.")
                              .Get()),
      auth_failures(r.AddCounter("tandem_router_auth_failures_total",
                                 "Requests refused by API key checks, by reason: missing, "
                                 "malformed, unknown (401) and forbidden (a non-admin key on an "
                                 "admin endpoint, 403).",
                                 {"reason"})),
      rate_limited(r.AddCounter("tandem_router_rate_limited_total",
                                "Requests refused (429) by a per-key limit, by key name and "
                                "limit: requests_per_s, tokens_per_min, max_concurrent.",
                                {"key", "limit"})),
      refusals(r.AddCounter("tandem_router_admission_refusals_total",
                            "Requests refused before running, by reason: queue_full (429), "
                            "n_over_max_in_flight (400), tokenize_too_large (400).",
                            {"reason"})),
      kv_full_skips(r.AddCounter("tandem_router_kv_full_skips_total",
                                 "Routing decisions that passed over a worker whose last load "
                                 "report had every KV block in use, by pool.",
                                 {"pool"})) {}

Router::Impl::Impl(RouterConfig config, std::string config_path,
                   std::shared_ptr<const ModelAssets> assets,
                   std::shared_ptr<const tls::ChannelFactory> channels)
    : config_path_(std::move(config_path)),
      assets_(std::move(assets)),
      metrics_(std::make_unique<Metrics>(registry_)),
      cluster_(config.health, std::move(channels)),
      config_(std::make_shared<const RouterConfig>(std::move(config))),
      keys_(std::make_shared<const ApiKeyStore>(config_->auth)) {
  RegisterCallbacks();
}

Router::Impl::~Impl() { Stop(); }

void Router::Impl::RegisterCallbacks() {
  registry_.AddCallbackGauge(
      "tandem_router_worker_in_flight", "Requests the router has in flight on each worker.",
      {"pool", "worker"}, [this](MetricEmitter& e) {
        for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
          for (const auto& w : cluster_.Workers(role)) {
            e.Emit({PoolRoleName(role), w->address()}, w->in_flight());
          }
        }
      });
  registry_.AddCallbackGauge(
      "tandem_router_worker_healthy", "1 when the worker is healthy (routable).",
      {"pool", "worker"}, [this](MetricEmitter& e) {
        for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
          for (const auto& w : cluster_.Workers(role)) {
            e.Emit({PoolRoleName(role), w->address()}, w->healthy() ? 1 : 0);
          }
        }
      });
  registry_.AddCallbackGauge(
      "tandem_router_worker_incompatible",
      "1 when the worker is refused because it cannot serve in this cluster: its tokenizer is "
      "not the router's, or its model, KV layout, block size or block hash seed differ from the "
      "serving workers' (the router's log and /health say why).",
      {"pool", "worker"}, [this](MetricEmitter& e) {
        for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
          for (const auto& w : cluster_.Workers(role)) {
            e.Emit({PoolRoleName(role), w->address()}, w->incompatibility().empty() ? 0 : 1);
          }
        }
      });
  // Series of each worker's last load report, one per state.
  using LoadStates = std::vector<std::pair<const char*, double>>;
  auto per_worker_load = [this](LoadStates (*states)(const tandem::v1::LoadReport&)) {
    return [this, states](MetricEmitter& e) {
      for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
        for (const auto& w : cluster_.Workers(role)) {
          std::optional<tandem::v1::LoadReport> l = w->last_load();
          if (!l.has_value()) continue;
          for (const auto& [state, value] : states(*l)) {
            e.Emit({PoolRoleName(role), w->address(), state}, value);
          }
        }
      }
    };
  };
  registry_.AddCallbackGauge(
      "tandem_router_worker_kv_blocks",
      "Each worker's KV blocks by state, as its last health check's load report said: free, "
      "used (referenced by requests), cached (evictable prefix cache), quarantined (a failed "
      "transfer's destination, briefly out of use).",
      {"pool", "worker", "state"}, per_worker_load([](const tandem::v1::LoadReport& l) {
        return LoadStates{{"free", static_cast<double>(l.free_blocks())},
                          {"used", static_cast<double>(l.used_blocks())},
                          {"cached", static_cast<double>(l.cached_blocks())},
                          {"quarantined", static_cast<double>(l.quarantined_blocks())}};
      }));
  registry_.AddCallbackGauge(
      "tandem_router_worker_sequences",
      "Each worker's sequences by state, as its last health check's load report said: running, "
      "waiting, reserved (decode: waiting for their KV), prefilled (prefill: holding KV until "
      "it is sent).",
      {"pool", "worker", "state"}, per_worker_load([](const tandem::v1::LoadReport& l) {
        return LoadStates{{"running", static_cast<double>(l.running_sequences())},
                          {"waiting", static_cast<double>(l.waiting_sequences())},
                          {"reserved", static_cast<double>(l.reserved_requests())},
                          {"prefilled", static_cast<double>(l.prefilled_requests())}};
      }));
  registry_.AddCallbackGauge(
      "tandem_router_kv_index_blocks", "Entries in a pool's KV index (kv_cache_aware).", {"pool"},
      [this](MetricEmitter& e) {
        std::shared_ptr<RoutingState> rs = CurrentRouting();
        if (rs == nullptr) return;
        for (int r = 0; r < kNumPoolRoles; ++r) {
          if (rs->index[r] != nullptr) {
            e.Emit({PoolRoleName(static_cast<PoolRole>(r))}, static_cast<double>(rs->index[r]->size()));
          }
        }
      });
  registry_.AddCallbackGauge(
      "tandem_router_kv_index_workers",
      "Workers in a pool's KV index by mode: exact (fed by KV events), approximate (from the "
      "router's own decisions, with a TTL) or stale (events lost, resyncing).",
      {"pool", "mode"}, [this](MetricEmitter& e) {
        std::shared_ptr<RoutingState> rs = CurrentRouting();
        if (rs == nullptr) return;
        for (int r = 0; r < kNumPoolRoles; ++r) {
          if (rs->index[r] == nullptr) continue;
          int count[3] = {0, 0, 0};
          for (const KvIndex::WorkerInfo& w : rs->index[r]->workers()) {
            ++count[static_cast<int>(w.mode)];
          }
          // Workers with no entry yet are approximate.
          const int known = count[0] + count[1] + count[2];
          const int pool = static_cast<int>(cluster_.Workers(static_cast<PoolRole>(r)).size());
          if (pool > known) count[static_cast<int>(WorkerMode::kApproximate)] += pool - known;
          for (WorkerMode m : {WorkerMode::kApproximate, WorkerMode::kExact, WorkerMode::kStale}) {
            e.Emit({PoolRoleName(static_cast<PoolRole>(r)), WorkerModeName(m)},
                   count[static_cast<int>(m)]);
          }
        }
      });
  // The KV index's bookkeeping: what its workers' event streams brought.
  auto each_index = [this](const std::function<void(const char*, const KvIndex&)>& f) {
    std::shared_ptr<RoutingState> rs = CurrentRouting();
    if (rs == nullptr) return;
    for (int r = 0; r < kNumPoolRoles; ++r) {
      if (rs->index[r] != nullptr) f(PoolRoleName(static_cast<PoolRole>(r)), *rs->index[r]);
    }
  };
  // Counters read from each index's Stats: (label value, the Stats field).
  using StatField = std::pair<const char*, uint64_t KvIndex::Stats::*>;
  auto index_counter = [this, each_index](const char* name, const char* help, const char* label,
                                          std::vector<StatField> fields) {
    registry_.AddCallbackCounter(name, help, {"pool", label},
                                 [each_index, fields](MetricEmitter& e) {
      each_index([&](const char* pool, const KvIndex& index) {
        const KvIndex::Stats s = index.stats();
        for (const auto& [value, field] : fields) e.Emit({pool, value}, static_cast<double>(s.*field));
      });
    });
  };
  index_counter("tandem_router_kv_events_total",
                "KV events from the workers' streams by outcome: applied to the pool's KV index, or "
                "skipped (already applied: a replay after a resubscription).",
                "outcome",
                {{"applied", &KvIndex::Stats::events_applied},
                 {"skipped", &KvIndex::Stats::events_replayed}});
  index_counter("tandem_router_kv_event_batches_dropped_total",
                "KV event batches the index refused, by reason: seq_gap (events were lost), "
                "malformed, or worker_restart (a new instance: its entries dropped); the worker is "
                "stale until its snapshot arrives.",
                "reason",
                {{"seq_gap", &KvIndex::Stats::seq_gaps},
                 {"malformed", &KvIndex::Stats::bad_batches},
                 {"worker_restart", &KvIndex::Stats::restarts}});
  index_counter("tandem_router_kv_index_entries_dropped_total",
                "KV index entries dropped: evicted (the index's memory cap), expired (approximate "
                "entries past their TTL), snapshot_truncated (a snapshot beyond the cap).",
                "reason",
                {{"evicted", &KvIndex::Stats::evictions},
                 {"expired", &KvIndex::Stats::expirations},
                 {"snapshot_truncated", &KvIndex::Stats::snapshot_blocks_truncated}});
  registry_.AddCallbackGauge(
      "tandem_router_kv_index_worker_blocks",
      "Each worker's entries in its pool's KV index, with its mode (exact, approximate, stale).",
      {"pool", "worker", "mode"}, [each_index](MetricEmitter& e) {
        each_index([&e](const char* pool, const KvIndex& index) {
          for (const KvIndex::WorkerInfo& w : index.workers()) {
            e.Emit({pool, w.id, WorkerModeName(w.mode)}, static_cast<double>(w.blocks));
          }
        });
      });
  registry_.AddCallbackGauge(
      "tandem_router_kv_index_worker_age_seconds",
      "Seconds since the KV index applied a worker's last event batch (absent before the "
      "first): an idle worker sends none, a growing age on a busy one means lost events.",
      {"pool", "worker"}, [each_index](MetricEmitter& e) {
        const auto now = std::chrono::steady_clock::now();
        each_index([&e, now](const char* pool, const KvIndex& index) {
          for (const KvIndex::WorkerInfo& w : index.workers()) {
            if (w.last_batch.has_value()) {
              e.Emit({pool, w.id}, std::chrono::duration<double>(now - *w.last_batch).count());
            }
          }
        });
      });
  registry_.AddCallbackCounter(
      "tandem_router_policy_events_total",
      "Events a pool's routing policy counts: sticky_session repins and evictions, prefix_aware "
      "spillovers and ring_builds, kv_cache_aware requested_blocks and matched_blocks (their "
      "ratio is the predicted prefix hit rate).",
      {"pool", "policy", "event"}, [this](MetricEmitter& e) {
        std::shared_ptr<RoutingState> rs = CurrentRouting();
        if (rs == nullptr) return;
        for (int r = 0; r < kNumPoolRoles; ++r) {
          if (rs->policy[r] == nullptr) continue;
          const std::string pool = PoolRoleName(static_cast<PoolRole>(r));
          for (const auto& [event, value] : rs->policy[r]->Counters()) {
            e.Emit({pool, rs->policy[r]->name(), event}, static_cast<double>(value));
          }
        }
      });
  registry_.AddCallbackCounter("tandem_router_http_connections_total",
                               "Client connections accepted (one serves many requests with "
                               "keep-alive).",
                               {}, [this](MetricEmitter& e) {
                                 if (http_ != nullptr) {
                                   e.Emit({}, static_cast<double>(http_->connection_stats().accepted));
                                 }
                               });
  registry_.AddCallbackCounter("tandem_router_http_connections_refused_total",
                               "Client connections refused (503 and closed) at "
                               "limits.max_connections.",
                               {}, [this](MetricEmitter& e) {
                                 if (http_ != nullptr) {
                                   e.Emit({}, static_cast<double>(http_->connection_stats().refused));
                                 }
                               });
  registry_.AddCallbackGauge("tandem_router_http_open_connections", "Client connections open.", {},
                             [this](MetricEmitter& e) {
                               if (http_ != nullptr) {
                                 e.Emit({}, static_cast<double>(http_->connection_stats().open));
                               }
                             });
  registry_.AddCallbackCounter(
      "tandem_router_health_checks_total", "Active health checks, by result.", {"result"},
      [this](MetricEmitter& e) {
        const Cluster::Stats s = cluster_.stats();
        e.Emit({"ok"}, static_cast<double>(s.health_checks - s.health_check_failures));
        e.Emit({"failed"}, static_cast<double>(s.health_check_failures));
      });
  registry_.AddCallbackCounter(
      "tandem_router_dns_lookups_total",
      "Discovery lookups of DNS pools, by result (failed: the last members are kept; a name "
      "with no addresses is a successful lookup that empties the pool).",
      {"result"}, [this](MetricEmitter& e) {
        const Cluster::Stats s = cluster_.stats();
        e.Emit({"ok"}, static_cast<double>(s.dns_lookups - s.dns_failures));
        e.Emit({"failed"}, static_cast<double>(s.dns_failures));
      });
  registry_.AddCallbackCounter(
      "tandem_router_worker_ejections_total",
      "Workers ejected by failed health checks (readmissions are counted apart).", {"kind"},
      [this](MetricEmitter& e) {
        const Cluster::Stats s = cluster_.stats();
        e.Emit({"ejected"}, static_cast<double>(s.ejections));
        e.Emit({"readmitted"}, static_cast<double>(s.readmissions));
      });
}

absl::Status Router::Impl::Start() {
  std::shared_ptr<const RouterConfig> cfg = config();
  ApplyClusterConfig(*cfg);
  cluster_.SetHealthListener([this](const std::string&, bool healthy) {
    if (healthy) Routing();
  });
  cluster_.SetRouterTokenizer({.sha256 = assets_->tokenizer_sha256,
                               .vocab_size = assets_->tokenizer->vocab_size(),
                               .source = assets_->source});
  cluster_.CheckNow();
  Routing();
  cluster_.Start();

  http::HttpServer::Options o;
  o.host = cfg->listener.host;
  o.port = cfg->listener.port;
  o.threads = std::max(2u, std::min(8u, std::thread::hardware_concurrency()));
  o.max_body_bytes = static_cast<size_t>(cfg->limits.max_body_bytes);
  o.max_connections = static_cast<size_t>(cfg->limits.max_connections);
  o.idle_timeout = std::chrono::seconds(
      static_cast<int64_t>(std::max(cfg->timeouts.idle_stream_s, 1.0)) + 30);
  http_ = std::make_unique<http::HttpServer>(o);
  // Every route checks the caller's key first (when keys are configured).
  auto bind = [this](Access access, std::string endpoint,
                     void (Impl::*f)(const http::Request&, std::shared_ptr<http::ResponseWriter>)) {
    return [this, access, endpoint, f](const http::Request& r,
                                       std::shared_ptr<http::ResponseWriter> w) {
      if (!Authorize(access, endpoint, r, *w)) return;
      (this->*f)(r, std::move(w));
    };
  };
  http_->Route("POST", "/v1/chat/completions", bind(Access::kClient, "chat", &Impl::HandleChat));
  http_->Route("POST", "/v1/completions",
               bind(Access::kClient, "completions", &Impl::HandleCompletion));
  http_->Route("GET", "/v1/models", bind(Access::kClient, "models", &Impl::HandleModels));
  http_->Route("GET", "/v1/models/*", bind(Access::kClient, "models", &Impl::HandleModel));
  http_->Route("GET", "/health", bind(Access::kOpen, "health", &Impl::HandleHealth));
  http_->Route("GET", "/metrics", bind(Access::kAdmin, "metrics", &Impl::HandleMetrics));
  http_->Route("GET", "/dashboard", bind(Access::kAdmin, "dashboard", &Impl::HandleDashboard));
  http_->Route("POST", "/tokenize", bind(Access::kAdmin, "tokenize", &Impl::HandleTokenize));
  http_->Route("POST", "/detokenize",
               bind(Access::kAdmin, "detokenize", &Impl::HandleDetokenize));
  RETURN_IF_ERROR(http_->Start());
  watchdog_ = std::thread([this] {
    SetThreadName("watchdog");
    WatchdogLoop();
  });
  LOG(INFO) << "router serving " << cfg->model.served_name << " on " << cfg->listener.host << ":"
            << http_->port() << " (tokenizer " << assets_->source << ", disaggregation "
            << DisaggregationModeName(cfg->disaggregation.mode) << ", "
            << (cfg->auth.enabled() ? absl::StrCat(cfg->auth.keys.size(), " API keys")
                                    : std::string("no API keys: open to every client"))
            << ")";
  return absl::OkStatus();
}

void Router::Impl::Stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (http_ != nullptr) http_->Stop();  // lets responses finish for its grace
  std::vector<std::shared_ptr<ApiCall>> active;
  {
    std::lock_guard<std::mutex> lock(mu_);
    active.assign(active_.begin(), active_.end());
  }
  for (const auto& call : active) call->Cancel(absl::UnavailableError("the router is shutting down"));
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return active_.empty(); });
  }
  if (watchdog_.joinable()) watchdog_.join();
  cluster_.Stop();
}

void Router::Impl::WatchdogLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    stop_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; });
    std::vector<std::shared_ptr<ApiCall>> active(active_.begin(), active_.end());
    const RetriesConfig retries = config_->retries;
    lock.unlock();
    // Once per tick: the deadlines follow the latency observed lately.
    const double first_token_s =
        AttemptDeadlineSeconds(retries.attempt_first_token, retries, first_token_latency_);
    const double idle_s = AttemptDeadlineSeconds(retries.attempt_idle, retries, token_gaps_);
    const Clock::time_point now = Clock::now();
    for (const auto& call : active) call->CheckDeadlines(now, first_token_s, idle_s);
    active.clear();
    lock.lock();
  }
}

void Router::Impl::ApplyClusterConfig(const RouterConfig& config) {
  cluster_.SetHealthConfig(config.health);
  if (config.prefill.has_value()) {
    cluster_.SetPool(PoolRole::kPrefill, *config.prefill);
  } else {
    cluster_.ClearPool(PoolRole::kPrefill);
  }
  if (config.decode.has_value()) cluster_.SetPool(PoolRole::kDecode, *config.decode);
}

std::shared_ptr<RoutingState> Router::Impl::Routing() {
  if (std::shared_ptr<RoutingState> rs = CurrentRouting(); rs != nullptr) return rs;
  std::optional<tandem::v1::ModelInfo> info = cluster_.AnyModelInfo();
  if (!info.has_value()) return nullptr;
  std::lock_guard<std::mutex> build(build_mu_);
  if (std::shared_ptr<RoutingState> rs = CurrentRouting(); rs != nullptr) return rs;  // built meanwhile
  std::shared_ptr<RoutingState> rs = BuildRouting(config(), *info, nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  routing_ = rs;
  return routing_;
}

std::shared_ptr<RoutingState> Router::Impl::BuildRouting(std::shared_ptr<const RouterConfig> config,
                                                         const tandem::v1::ModelInfo& info,
                                                         const RoutingState* prev) {
  auto rs = std::make_shared<RoutingState>();
  rs->config = config;
  rs->max_context = info.max_context_length();
  rs->vocab_size = info.vocab_size();
  // A cache-aware index must hash prompts exactly as the workers hash their blocks.
  rs->context = {.block_size = std::max(1, info.block_size()), .block_hash_seed = info.block_hash_seed()};
  RoutingPolicyRegistry registry;
  RegisterBuiltinRoutingPolicies(registry);
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    const std::optional<PoolConfig>& pool =
        role == PoolRole::kPrefill ? config->prefill : config->decode;
    if (!pool.has_value()) continue;
    const PolicyParams& params = pool->policy.params;
    const int r = static_cast<int>(role);
    if (prev != nullptr && prev->policy[r] != nullptr &&
        prev->policy[r]->name() == pool->policy.name && prev->params[r] == params &&
        prev->context == rs->context) {
      rs->policy[r] = prev->policy[r];
    } else {
      absl::StatusOr<std::unique_ptr<RoutingPolicy>> p =
          registry.Create(pool->policy.name, params, rs->context);
      if (!p.ok()) {
        // Validated at load; only the workers' context could fail.
        LOG(ERROR) << PoolRoleName(role) << " pool policy: " << p.status().ToString();
        return nullptr;
      }
      rs->policy[r] = *std::move(p);
    }
    rs->params[r] = params;
    if (std::shared_ptr<KvIndex> index = rs->policy[r]->kv_index(); index != nullptr) {
      rs->index[r] = std::move(index);
      // Without events the index learns from routing decisions only (a kept
      // policy's index must stop receiving the events it got before).
      cluster_.SetKvIndex(role, config->kv_events.enabled ? rs->index[r] : nullptr);
    } else {
      cluster_.SetKvIndex(role, nullptr);
    }
  }
  return rs;
}

absl::Status Router::Impl::Reload() {
  if (config_path_.empty()) {
    return absl::FailedPreconditionError("the router was not started from a config file");
  }
  absl::StatusOr<RouterConfig> loaded = LoadRouterConfig(config_path_);
  if (!loaded.ok()) {
    LOG(ERROR) << "reload of " << config_path_ << " failed; keeping the running config: "
               << loaded.status().message();
    metrics_->reloads.WithLabels({"error"}).Inc();
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
  if (loaded->model.parse_special_tokens_in_messages !=
      prev->model.parse_special_tokens_in_messages) {
    deferred.push_back("model.parse_special_tokens_in_messages");
  }
  if (loaded->limits.max_body_bytes != prev->limits.max_body_bytes) {
    deferred.push_back("limits.max_body_bytes");
  }
  if (loaded->limits.max_connections != prev->limits.max_connections) {
    deferred.push_back("limits.max_connections");
  }
  if (loaded->tls.mode != prev->tls.mode || loaded->tls.ca != prev->tls.ca ||
      loaded->tls.cert != prev->tls.cert || loaded->tls.key != prev->tls.key) {
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
    metrics_->reloads.WithLabels({"deferred"}).Inc();
  }
  auto next = std::make_shared<const RouterConfig>(*std::move(loaded));
  if (prev->auth.enabled() && !next->auth.enabled()) {
    LOG(WARNING) << "reload: the config has no API keys any more: the router is open to every "
                    "client";
  }
  auto keys = std::make_shared<const ApiKeyStore>(next->auth);
  std::lock_guard<std::mutex> build(build_mu_);
  ApplyClusterConfig(*next);
  std::shared_ptr<RoutingState> rs;
  if (std::optional<tandem::v1::ModelInfo> info = cluster_.AnyModelInfo(); info.has_value()) {
    rs = BuildRouting(next, *info, CurrentRouting().get());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    config_ = next;
    keys_ = keys;
    routing_ = rs;  // null: rebuilt when a worker reports the model
  }
  LOG(INFO) << "reloaded " << config_path_ << " (" << keys->size() << " API keys)";
  metrics_->reloads.WithLabels({"ok"}).Inc();
  return absl::OkStatus();
}

namespace {

// ", N refused as incompatible: WHY" (the first one's reason, without its
// address) for the workers the cluster refuses; empty when it refuses none.
std::string RefusedWorkers(const std::vector<std::shared_ptr<WorkerClient>>& workers) {
  int refused = 0;
  std::string why;
  for (const auto& w : workers) {
    std::string reason = w->incompatibility();
    if (reason.empty()) continue;
    ++refused;
    if (why.empty()) why = std::move(reason);
  }
  return refused == 0 ? "" : absl::StrFormat(", %d refused as incompatible: %s", refused, why);
}

// One pool's routing decision as x-tandem-route and the log show it: the
// policy, its rule, the winner, and each worker with what the router knew
// (health, requests in flight, KV use, prompt tokens queued for prefill) and
// what the policy weighed (eligible, matched prefix blocks, score).
nlohmann::json ExplainDecision(const char* pool, const std::string& policy,
                               const std::vector<WorkerView>& views,
                               const std::vector<std::shared_ptr<WorkerClient>>& workers,
                               const std::set<std::string>& exclude, const RouteExplanation& why,
                               std::optional<size_t> chosen) {
  nlohmann::json candidates = nlohmann::json::array();
  for (size_t i = 0; i < views.size(); ++i) {
    const WorkerView& v = views[i];
    nlohmann::json c = {{"worker", v.id},
                        {"healthy", workers[i]->healthy()},
                        {"in_flight", v.in_flight},
                        {"kv_used_blocks", v.used_blocks},
                        {"kv_total_blocks", v.total_blocks},
                        {"prefill_tokens_queued", v.prefill_tokens_in_flight}};
    if (exclude.count(v.id) != 0) {
      c["skipped"] = "already tried by this request";
    } else if (workers[i]->healthy() && !v.healthy) {
      c["skipped"] = "no free KV block";
    }
    if (i < why.candidates.size()) {
      const RouteExplanation::Candidate& e = why.candidates[i];
      c["eligible"] = e.eligible;
      if (e.matched_blocks.has_value()) c["matched_blocks"] = *e.matched_blocks;
      if (e.score.has_value()) c["score"] = *e.score;
    }
    candidates.push_back(std::move(c));
  }
  nlohmann::json d = {{"pool", pool}, {"policy", policy}, {"candidates", std::move(candidates)}};
  d["chosen"] = chosen.has_value() ? nlohmann::json(views[*chosen].id) : nlohmann::json(nullptr);
  d["why"] = !why.why.empty() ? why.why
             : chosen.has_value() ? absl::StrCat(policy, "'s pick among the healthy workers")
                                  : "no healthy worker";
  return d;
}

}  // namespace

absl::StatusOr<Placement> Router::Impl::Place(const ApiCall& call, std::span<const int32_t> tokens,
                                              const std::set<std::string>& exclude) {
  std::shared_ptr<RoutingState> rs = Routing();
  if (rs == nullptr) {
    std::vector<std::shared_ptr<WorkerClient>> all = cluster_.Workers(PoolRole::kDecode);
    for (auto& w : cluster_.Workers(PoolRole::kPrefill)) all.push_back(std::move(w));
    const std::string refused = RefusedWorkers(all);
    return absl::UnavailableError(absl::StrCat(
        "no healthy worker: none has reported the model yet",
        refused.empty() ? "" : absl::StrCat(" (", refused.substr(2), ")")));
  }
  const RouterConfig& cfg = *rs->config;
  RouteRequest rr{.tokens = tokens, .session_id = call.session_id()};
  nlohmann::json explained = nlohmann::json::array();  // one decision per pool (x-tandem-explain)
  // The chosen worker, and the prompt tokens the policy expects it to hold.
  auto pick = [&](PoolRole role, int64_t* cached_tokens)
      -> absl::StatusOr<std::shared_ptr<WorkerClient>> {
    const Clock::time_point start = Clock::now();
    const double cpu_start = ThreadCpuSeconds();
    std::vector<std::shared_ptr<WorkerClient>> workers = cluster_.Workers(role);
    std::vector<WorkerView> views;
    views.reserve(workers.size());
    for (const auto& w : workers) {
      views.push_back(w->View());
      if (exclude.count(w->address()) != 0) views.back().healthy = false;
    }
    // KV awareness: a worker whose last load report had every KV block in
    // use (none free, none cached to evict) could only queue the request or
    // preempt another; it is passed over while a healthy peer has room.
    auto full = [](const WorkerView& v) {
      return v.healthy && v.total_blocks > 0 && v.used_blocks >= v.total_blocks;
    };
    const bool any_room = std::any_of(views.begin(), views.end(), [&](const WorkerView& v) {
      return v.healthy && !full(v);
    });
    for (WorkerView& v : views) {
      if (any_room && full(v)) {
        v.healthy = false;
        metrics_->kv_full_skips.WithLabels({PoolRoleName(role)}).Inc();
        warnings_.Warn("kv_full", absl::StrCat("worker ", v.id, " reports no free KV block: "
                                               "routing around it"));
      }
    }
    RoutingPolicy& policy = *rs->policy[static_cast<int>(role)];
    rr.cached_tokens = cached_tokens;
    RouteExplanation why;
    rr.explain = call.explain() ? &why : nullptr;
    absl::StatusOr<size_t> i = policy.Pick(rr, views);
    if (call.explain()) {
      explained.push_back(ExplainDecision(PoolRoleName(role), policy.name(), views, workers, exclude,
                                          why, i.ok() ? std::optional<size_t>(*i) : std::nullopt));
    }
    metrics_->decision.WithLabels({PoolRoleName(role)}).Observe(Seconds(Clock::now() - start));
    metrics_->decision_cpu.WithLabels({PoolRoleName(role)}).Observe(ThreadCpuSeconds() - cpu_start);
    if (!i.ok()) {
      return absl::UnavailableError(absl::StrFormat(
          "no healthy %s worker (%d in the pool%s%s)", PoolRoleName(role), workers.size(),
          exclude.empty() ? "" : absl::StrFormat(", %d already tried", exclude.size()),
          RefusedWorkers(workers)));
    }
    metrics_->routed.WithLabels({PoolRoleName(role), policy.name(), workers[*i]->address()}).Inc();
    return workers[*i];
  };
  int64_t decode_cached = 0;
  ASSIGN_OR_RETURN(std::shared_ptr<WorkerClient> decode, pick(PoolRole::kDecode, &decode_cached));
  Placement p{.decode = decode, .decode_cached_tokens = decode_cached};
  // Every return with a placement: the decision goes to /dashboard's recent
  // list; when asked, the explanation goes with the placement and into the
  // log as one line.
  auto finish = [&] {
    recent_.Add({.unix_ms = absl::ToUnixMillis(absl::Now()),
                 .request_id = call.request_id(),
                 .decode_worker = p.decode->address(),
                 .prefill_worker = p.prefill != nullptr ? p.prefill->address() : "",
                 .prompt_tokens = static_cast<int64_t>(tokens.size()),
                 .expected_cached_tokens =
                     p.prefill != nullptr ? p.prefill_cached_tokens : p.decode_cached_tokens});
    if (!call.explain()) return;
    p.explanation = explained.dump();
    LOG(INFO) << "route " << call.request_id() << " " << p.explanation;
  };
  const DisaggregationMode mode = cfg.disaggregation.mode;
  if (mode == DisaggregationMode::kNever || rs->policy[0] == nullptr) {
    finish();
    return p;
  }
  if (mode == DisaggregationMode::kAuto) {
    // The uncached part of the prompt as the decode worker holds it (the
    // decode pool's policy says, when it knows: kv_cache_aware).
    if (static_cast<int64_t>(tokens.size()) - decode_cached <
        cfg.disaggregation.auto_threshold_tokens) {
      p.local_prefill = true;
      explained.push_back({{"pool", "prefill"},
                           {"why", absl::StrFormat("disaggregation auto: %d uncached prompt tokens, under "
                                                   "auto_threshold_tokens %d: the decode worker prefills",
                                                   static_cast<int64_t>(tokens.size()) - decode_cached,
                                                   cfg.disaggregation.auto_threshold_tokens)}});
      finish();
      return p;
    }
  }
  absl::StatusOr<std::shared_ptr<WorkerClient>> prefill =
      pick(PoolRole::kPrefill, &p.prefill_cached_tokens);
  if (!prefill.ok()) {
    // No prefill worker: the decode worker prefills itself (degraded, not down).
    p.local_prefill = true;
    finish();
    return p;
  }
  if ((*prefill)->address() != decode->address()) p.prefill = *prefill;
  finish();
  return p;
}

bool Router::Impl::TakeRetry() {
  std::lock_guard<std::mutex> lock(mu_);
  if (retry_tokens_ < 1) return false;
  retry_tokens_ -= 1;
  return true;
}

void Router::Impl::Admit(const std::shared_ptr<ApiCall>& call) {
  bool start_now = false;
  absl::Status refused;
  http::HeaderList refusal_headers;
  std::vector<std::shared_ptr<ApiCall>> next;
  const Caller& caller = call->caller();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const RouterConfig& cfg = *config_;
    const int64_t n = call->n();
    if (stopping_) {
      refused = absl::UnavailableError("the router is shutting down");
    } else if (n > cfg.limits.max_in_flight) {
      // It could never start: every choice is a sequence on the workers.
      refused = InvalidRequest(
          "n", absl::StrFormat("n = %d exceeds this server's limit of %d sequences in flight "
                               "(limits.max_in_flight); ask for fewer choices",
                               n, cfg.limits.max_in_flight));
      metrics_->refusals.WithLabels({"n_over_max_in_flight"}).Inc();
    } else {
      if (caller.key != nullptr) {
        const KeyLimiter::Decision d = limiter_.TryAcquire(
            caller.key->name, caller.key->limits, call->token_estimate(), Clock::now());
        if (d.refused != KeyLimit::kNone) {
          const std::string limit(KeyLimitName(d.refused));
          const int64_t retry = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(d.retry_after_s)));
          refused = absl::ResourceExhaustedError(absl::StrFormat(
              "rate limit reached for this API key (%s); retry in %d s", limit, retry));
          refusal_headers = {{"x-request-id", call->request_id()},
                             {"Retry-After", std::to_string(retry)}};
          metrics_->rate_limited.WithLabels({caller.key->name, limit}).Inc();
          warnings_.Warn("rate_limited", absl::StrCat("API key '", caller.key->name,
                                                      "' refused by its ", limit, " limit"));
        } else {
          call->key_held = true;
          call->charged_tokens = d.charged_tokens;
        }
      }
      if (refused.ok()) {
        // The retry budget: each request adds budget_ratio retries (capped).
        retry_tokens_ = std::min(retry_tokens_ + cfg.retries.budget_ratio,
                                 std::max(10.0, 100 * cfg.retries.budget_ratio));
        if (queue_.empty() && in_flight_ + n <= cfg.limits.max_in_flight) {
          in_flight_ += n;
          ++running_requests_;
          call->slot = true;
          start_now = true;
        } else if (static_cast<int64_t>(queue_.size()) < cfg.limits.max_queue) {
          queue_.Push(caller.name(), caller.key != nullptr ? caller.key->priority : 1, n, call);
          DrainQueueLocked(&next);
        } else {
          refused = absl::ResourceExhaustedError(absl::StrFormat(
              "the router is at its limits: %d sequences in flight and %d requests queued; "
              "retry later",
              in_flight_, queue_.size()));
          metrics_->refusals.WithLabels({"queue_full"}).Inc();
        }
      }
      if (refused.ok()) active_.insert(call);
      metrics_->in_flight.Set(static_cast<double>(running_requests_));
      metrics_->in_flight_sequences.Set(static_cast<double>(in_flight_));
      metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
    }
  }
  if (!refused.ok()) {
    ReleaseKey(call);
    SendError(call->endpoint(), call->request_id(), *call->writer(), refused,
              std::move(refusal_headers), ShowWorkers(caller));
    return;
  }
  // A client that goes away cancels its work (or its place in the queue).
  std::weak_ptr<ApiCall> weak = call;
  call->writer()->OnClose([weak] {
    if (auto c = weak.lock()) c->Cancel(absl::CancelledError("the client disconnected"));
  });
  if (start_now) call->Start();
  for (auto& c : next) executor_.Post([c] { c->Start(); });
}

void Router::Impl::DrainQueueLocked(std::vector<std::shared_ptr<ApiCall>>* next) {
  // The next call in fair order waits for room for all its sequences; those
  // behind it wait too, so a large n is not starved by small ones.
  while (!queue_.empty() && in_flight_ + queue_.FrontCost() <= config_->limits.max_in_flight) {
    in_flight_ += queue_.FrontCost();
    ++running_requests_;
    next->push_back(queue_.Pop());
    next->back()->slot = true;
  }
}

void Router::Impl::ReleaseKey(const std::shared_ptr<ApiCall>& call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call->key_held) return;
    call->key_held = false;
  }
  const ApiKeyIdentity* key = call->caller().key;
  if (key == nullptr) return;
  limiter_.Release(key->name, key->limits, call->charged_tokens, call->TokensUsed(), Clock::now());
}

void Router::Impl::Dequeue(const std::shared_ptr<ApiCall>& call) {
  bool release_key = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.Remove(call);
    // A call already given a slot still runs Start, which finds it finished
    // and ends it through CallFinished.
    if (!call->slot) {
      active_.erase(call);
      release_key = true;
    }
    metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
    idle_cv_.notify_all();
  }
  if (release_key) ReleaseKey(call);
}

void Router::Impl::ReleaseSlot(const std::shared_ptr<ApiCall>& call) {
  std::vector<std::shared_ptr<ApiCall>> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call->slot) return;
    call->slot = false;
    in_flight_ -= call->n();
    --running_requests_;
    DrainQueueLocked(&next);
    metrics_->in_flight.Set(static_cast<double>(running_requests_));
    metrics_->in_flight_sequences.Set(static_cast<double>(in_flight_));
    metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
  }
  // Not inline: the caller may hold a Generation's lock. On the task
  // thread, even from the gRPC poller: a start routes (hashing, index
  // lookups), which would hold up every stream's tokens there.
  for (auto& c : next) executor_.Post([c] { c->Start(); });
}

void Router::Impl::CallFinished(const std::shared_ptr<ApiCall>& call) {
  ReleaseSlot(call);
  ReleaseKey(call);
  std::lock_guard<std::mutex> lock(mu_);
  active_.erase(call);
  idle_cv_.notify_all();
}

Caller Router::Impl::Identify(const http::Request& req) const {
  Caller c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    c.store = keys_;
  }
  if (!c.store->enabled()) return c;
  ApiKeyStore::Match m = c.store->Authenticate(req.Header("Authorization"));
  if (m.result == ApiKeyStore::Result::kOk) c.key = m.key;
  return c;
}

bool Router::Impl::Authorize(Access access, const std::string& endpoint,
                             const http::Request& req, http::ResponseWriter& w) {
  std::shared_ptr<const ApiKeyStore> store;
  {
    std::lock_guard<std::mutex> lock(mu_);
    store = keys_;
  }
  if (!store->enabled() || access == Access::kOpen) return true;
  const ApiKeyStore::Match m = store->Authenticate(req.Header("Authorization"));
  const std::string id = RequestId(req);
  if (m.result != ApiKeyStore::Result::kOk) {
    const std::string reason(AuthFailureName(m.result));
    metrics_->auth_failures.WithLabels({reason}).Inc();
    metrics_->requests.WithLabels({endpoint, "401"}).Inc();
    warnings_.Warn("auth", absl::StrCat("refused a request to ", req.path, ": API key ", reason));
    // OpenAI's answers, word for word where it has one.
    ApiError e{.http_status = 401,
               .type = "invalid_request_error",
               .message = m.result == ApiKeyStore::Result::kUnknown
                              ? "Incorrect API key provided."
                              : "You didn't provide an API key. You need to provide your API key "
                                "in an Authorization header using Bearer auth (i.e. "
                                "Authorization: Bearer YOUR_KEY).",
               .code = "invalid_api_key"};
    w.Send(401, kJson, ApiErrorJson(e), {{"x-request-id", id}, {"WWW-Authenticate", "Bearer"}});
    return false;
  }
  if (access == Access::kAdmin && !m.key->admin) {
    metrics_->auth_failures.WithLabels({"forbidden"}).Inc();
    metrics_->requests.WithLabels({endpoint, "403"}).Inc();
    warnings_.Warn("forbidden", absl::StrCat("API key '", m.key->name, "' is not an admin key: ",
                                             req.path, " refused"));
    ApiError e{.http_status = 403,
               .type = "permission_error",
               .message = absl::StrCat(req.path, " needs an admin API key"),
               .code = "insufficient_permissions"};
    w.Send(403, kJson, ApiErrorJson(e), {{"x-request-id", id}});
    return false;
  }
  return true;
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

ApiError Router::Impl::ClientError(const absl::Status& status, bool show_workers) {
  ApiError e = ApiErrorFromStatus(status);
  if (!show_workers) e.message = RedactWorkers(e.message, WorkerAddresses());
  return e;
}

std::string Router::Impl::RequestId(const http::Request& req) {
  std::string id(req.Header("X-Request-Id"));
  // Passed through when it is a sane token; generated otherwise.
  const bool ok = !id.empty() && id.size() <= 128 &&
                  std::all_of(id.begin(), id.end(), [](char c) {
                    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                           c == '_' || c == '.';
                  });
  if (ok) return id;
  std::lock_guard<std::mutex> lock(mu_);
  return RandomHex(rng_);
}

void Router::Impl::SendError(const std::string& endpoint, const std::string& request_id,
                             http::ResponseWriter& w, const absl::Status& status,
                             http::HeaderList headers, bool show_workers) {
  const ApiError e = ClientError(status, show_workers);
  http::HeaderList h =
      headers.empty() ? http::HeaderList{{"x-request-id", request_id}} : std::move(headers);
  const bool has_retry = std::any_of(h.begin(), h.end(), [](const auto& kv) {
    return absl::AsciiStrToLower(kv.first) == "retry-after";
  });
  if ((e.http_status == 429 || e.http_status == 503) && !has_retry) h.emplace_back("Retry-After", "1");
  metrics_->requests.WithLabels({endpoint, std::to_string(e.http_status)}).Inc();
  if (e.http_status >= 500) {
    LOG(WARNING) << "request " << request_id << " " << endpoint << ": " << status.ToString();
  }
  w.Send(e.http_status, kJson, ApiErrorJson(e), h);
}

absl::StatusOr<std::vector<int32_t>> Router::Impl::ChatPrompt(const ChatCompletionRequest& chat,
                                                              bool add_special_tokens) const {
  if (assets_->chat_template == nullptr) {
    return InvalidRequest("messages",
                          "this model has no chat template: use /v1/completions, or give the "
                          "router one (model.chat_template)");
  }
  const Tokenizer& tokenizer = *assets_->tokenizer;
  // The model section is fixed at startup (Reload keeps it).
  const bool escape = !config()->model.parse_special_tokens_in_messages;
  auto user_text = [&](const std::string& s) {
    return escape ? tokenizer.EscapeSpecialTokens(s) : s;
  };
  // As transformers calls the template: insertion-ordered dicts (tojson and
  // .items() show the order), tools and documents present (None) unless given.
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (const ChatMessage& m : chat.messages) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    j["role"] = std::string(RoleName(m.role));
    j["content"] = user_text(m.content);
    if (m.name) j["name"] = user_text(*m.name);
    if (m.tool_call_id) j["tool_call_id"] = user_text(*m.tool_call_id);
    messages.push_back(std::move(j));
  }
  context["messages"] = std::move(messages);
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = chat.add_generation_prompt;
  context["bos_token"] = assets_->bos_token;
  context["eos_token"] = assets_->eos_token;
  if (!chat.chat_template_kwargs.empty()) {
    // Parsed and checked by ParseChatCompletionRequest: an object, nested at
    // most kMaxJsonDepth deep, no server-owned names.
    nlohmann::ordered_json extra = nlohmann::ordered_json::parse(chat.chat_template_kwargs);
    if (escape) {
      std::vector<nlohmann::ordered_json*> todo = {&extra};
      while (!todo.empty()) {
        nlohmann::ordered_json* v = todo.back();
        todo.pop_back();
        if (v->is_string()) {
          *v = tokenizer.EscapeSpecialTokens(v->get_ref<const std::string&>());
        } else if (v->is_structured()) {
          for (auto& child : *v) todo.push_back(&child);
        }
      }
    }
    for (auto it = extra.begin(); it != extra.end(); ++it) context[it.key()] = std::move(it.value());
  }
  absl::StatusOr<std::string> text = assets_->chat_template->Render(context);
  if (!text.ok()) {
    return InvalidRequest("messages", absl::StrCat("the chat template refused the conversation: ",
                                                   text.status().message()));
  }
  return escape ? tokenizer.EncodeEscaped(*text, add_special_tokens)
                : tokenizer.Encode(*text, add_special_tokens);
}

absl::Status Router::Impl::CheckPrompt(std::span<const int32_t> prompt,
                                       std::optional<int64_t> max_tokens,
                                       const std::string& param) {
  if (prompt.empty()) return InvalidRequest(param, "the prompt is empty after tokenization");
  std::shared_ptr<RoutingState> rs = Routing();
  if (rs == nullptr) return absl::OkStatus();  // no worker yet: placement says 503
  for (int32_t id : prompt) {
    if (id < 0 || id >= rs->vocab_size) {
      return InvalidRequest(param, absl::StrFormat("token id %d is outside the vocabulary [0, %d)",
                                                   id, rs->vocab_size));
    }
  }
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (rs->max_context > 0 && n >= rs->max_context) {
    return InvalidRequest(param, absl::StrFormat(
                                     "the prompt has %d tokens; this model's context is %d "
                                     "tokens, which leaves no room to generate",
                                     n, rs->max_context));
  }
  if (rs->max_context > 0 && max_tokens.has_value() && n + *max_tokens > rs->max_context) {
    return InvalidRequest(
        "max_tokens",
        absl::StrFormat("the prompt (%d tokens) plus max_tokens (%d) exceeds this model's "
                        "context of %d tokens",
                        n, *max_tokens, rs->max_context));
  }
  return absl::OkStatus();
}

namespace {

// A 400 naming the first member of `body` not in `known` that carries a
// value (null, [] and {} mean absent), as the OpenAI parser does.
absl::Status RejectUnknownFields(const nlohmann::json& body,
                                 std::initializer_list<std::string_view> known) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) != known.end()) continue;
    if (it.value().is_null() || (it.value().is_structured() && it.value().empty())) continue;
    return InvalidRequest(it.key(), absl::StrCat("'", it.key(), "' is not supported by this server"));
  }
  return absl::OkStatus();
}

// The SamplingParams both chat and completions send to the workers.
tandem::v1::SamplingParams ToSampling(const SamplingFields& s, std::optional<int64_t> logprobs) {
  tandem::v1::SamplingParams p;
  if (s.temperature) p.set_temperature(static_cast<float>(*s.temperature));
  if (s.top_p) p.set_top_p(static_cast<float>(*s.top_p));
  if (s.top_k) p.set_top_k(static_cast<int32_t>(*s.top_k));
  if (s.min_p) p.set_min_p(static_cast<float>(*s.min_p));
  if (s.presence_penalty) p.set_presence_penalty(static_cast<float>(*s.presence_penalty));
  if (s.frequency_penalty) p.set_frequency_penalty(static_cast<float>(*s.frequency_penalty));
  if (s.repetition_penalty) p.set_repetition_penalty(static_cast<float>(*s.repetition_penalty));
  if (s.max_tokens) {
    p.set_max_tokens(static_cast<int32_t>(std::min<int64_t>(*s.max_tokens, INT32_MAX)));
  }
  p.set_min_tokens(static_cast<int32_t>(std::min<int64_t>(s.min_tokens, INT32_MAX)));
  for (int64_t id : s.stop_token_ids) {
    p.add_stop_token_ids(static_cast<int32_t>(std::min<int64_t>(id, INT32_MAX)));
  }
  p.set_ignore_eos(s.ignore_eos);
  if (logprobs.has_value()) p.set_logprobs(static_cast<int32_t>(*logprobs));
  return p;
}

}  // namespace

void Router::Impl::HandleChat(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  std::shared_ptr<const RouterConfig> cfg = config();
  auto fail = [&](const absl::Status& s) { SendError("chat", id, *w, s); };
  absl::StatusOr<ChatCompletionRequest> parsed = ParseChatCompletionRequest(req.body);
  if (!parsed.ok()) return fail(parsed.status());
  if (parsed->model != cfg->model.served_name) return fail(UnknownModelError(parsed->model));
  CallSetup s;
  absl::StatusOr<std::vector<int32_t>> prompt = ChatPrompt(*parsed, /*add_special_tokens=*/false);
  if (!prompt.ok()) return fail(prompt.status());
  s.prompt = *std::move(prompt);
  if (absl::Status st = CheckPrompt(s.prompt, parsed->sampling.max_tokens, "messages"); !st.ok()) {
    return fail(st);
  }
  std::optional<int64_t> top;
  if (parsed->logprobs) top = parsed->top_logprobs.value_or(0);
  StartCall(CallKind::kChat, req, std::move(w), id, cfg, std::move(s), parsed->model,
            parsed->sampling, top);
}

void Router::Impl::HandleCompletion(const http::Request& req,
                                    std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  std::shared_ptr<const RouterConfig> cfg = config();
  auto fail = [&](const absl::Status& s) { SendError("completions", id, *w, s); };
  absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(req.body);
  if (!parsed.ok()) return fail(parsed.status());
  if (parsed->model != cfg->model.served_name) return fail(UnknownModelError(parsed->model));
  CallSetup s;
  if (const std::string* text = std::get_if<std::string>(&parsed->prompt)) {
    s.prompt = assets_->tokenizer->Encode(*text, /*add_special_tokens=*/true);
    if (parsed->echo) s.echo = *text;
  } else {
    s.prompt = std::get<std::vector<int32_t>>(parsed->prompt);
  }
  if (absl::Status st = CheckPrompt(s.prompt, parsed->sampling.max_tokens, "prompt"); !st.ok()) {
    return fail(st);
  }
  if (parsed->echo && s.echo.empty()) {
    s.echo = assets_->tokenizer->Decode(s.prompt, /*skip_special_tokens=*/false);
  }
  if (parsed->echo && parsed->logprobs.has_value()) {
    return fail(InvalidRequest("echo", "echo with logprobs needs prompt logprobs, which this "
                                       "server does not compute; drop one of them"));
  }
  StartCall(CallKind::kCompletion, req, std::move(w), id, cfg, std::move(s), parsed->model,
            parsed->sampling, parsed->logprobs);
}

void Router::Impl::StartCall(CallKind kind, const http::Request& req,
                             std::shared_ptr<http::ResponseWriter> w, const std::string& id,
                             std::shared_ptr<const RouterConfig> cfg, CallSetup s,
                             const std::string& model, const SamplingFields& sampling,
                             std::optional<int64_t> logprobs) {
  s.session_id = std::string(req.Header(cfg->sessions.header));
  s.caller = Identify(req);
  if (req.HasHeader(kExplainHeader)) {
    const std::string_view v = req.Header(kExplainHeader);
    const char* endpoint = kind == CallKind::kChat ? "chat" : "completions";
    if (v != "1" && v != "true") {
      return SendError(endpoint, id, *w,
                       InvalidRequest("", absl::StrCat(kExplainHeader, " must be 1 or true, got '",
                                                       std::string(v.substr(0, 32)), "'")));
    }
    if (!ShowWorkers(s.caller)) {
      return SendError(endpoint, id, *w,
                       absl::PermissionDeniedError(absl::StrCat(
                           kExplainHeader, " names workers: it needs an admin API key or "
                                           "debug.worker_details")));
    }
    s.explain = true;
  }
  s.sampling = ToSampling(sampling, logprobs);
  s.seed = sampling.seed;
  s.n = static_cast<int>(sampling.n);
  s.stops = sampling.stop;
  s.stream = sampling.stream;
  s.include_usage = sampling.include_usage;
  s.logprobs = logprobs.has_value();
  s.tokens_as_ids = sampling.return_tokens_as_token_ids;
  s.model = model;
  {
    // What the key's tokens_per_min is charged at admission: the prompt and
    // every choice's max_tokens (absent: the context the prompt leaves).
    const int64_t prompt = static_cast<int64_t>(s.prompt.size());
    int64_t per_choice = sampling.max_tokens.value_or(0);
    if (!sampling.max_tokens.has_value()) {
      std::shared_ptr<RoutingState> rs = CurrentRouting();
      per_choice = rs != nullptr ? std::max<int64_t>(0, rs->max_context - prompt) : 0;
    }
    s.token_estimate = prompt + static_cast<int64_t>(s.n) * per_choice;
  }
  auto call = std::make_shared<ApiCall>(this, std::move(w), kind, id, std::move(cfg));
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seed = rng_();
  }
  call->Prepare(std::move(s), seed);
  Admit(call);
}

void Router::Impl::HandleDashboard(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  std::shared_ptr<const RouterConfig> cfg = config();
  StatusSnapshot s;
  s.model = cfg->model.served_name;
  s.tokenizer = assets_->source;
  s.disaggregation = DisaggregationModeName(cfg->disaggregation.mode);
  s.uptime_s = std::chrono::duration_cast<std::chrono::seconds>(
                   std::chrono::system_clock::now().time_since_epoch()).count() - created_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.in_flight = in_flight_;
    s.queued = static_cast<int64_t>(queue_.size());
  }
  std::shared_ptr<RoutingState> rs = CurrentRouting();
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    const std::optional<PoolConfig>& pool = role == PoolRole::kPrefill ? cfg->prefill : cfg->decode;
    if (!pool.has_value()) continue;
    StatusSnapshot::Pool p{.name = PoolRoleName(role), .policy = pool->policy.name,
                           .params = pool->policy.params};
    const int r = static_cast<int>(role);
    if (rs != nullptr && rs->index[r] != nullptr) p.index_blocks = static_cast<int64_t>(rs->index[r]->size());
    for (const auto& worker : cluster_.Workers(role)) {
      StatusSnapshot::Worker sw{.address = worker->address(), .healthy = worker->healthy(),
                                .incompatible = worker->incompatibility(),
                                .in_flight = worker->in_flight()};
      if (std::optional<tandem::v1::LoadReport> l = worker->last_load(); l.has_value()) {
        sw.running = l->running_sequences();
        sw.waiting = l->waiting_sequences();
        sw.used_blocks = l->used_blocks();
        sw.total_blocks = l->total_blocks();
        sw.cached_blocks = l->cached_blocks();
        if (l->prefix_query_tokens() > 0) sw.prefix_hit_rate = l->prefix_hit_rate();
      }
      p.workers.push_back(std::move(sw));
    }
    s.pools.push_back(std::move(p));
  }
  s.recent = recent_.Snapshot();
  w->Send(200, "text/html; charset=utf-8", RenderStatusPage(s));
}

nlohmann::json Router::Impl::ModelObject() {
  std::shared_ptr<const RouterConfig> cfg = config();
  nlohmann::json model = {{"id", cfg->model.served_name},
                          {"object", "model"},
                          {"created", created_},
                          {"owned_by", "tandem"}};
  if (std::shared_ptr<RoutingState> rs = Routing(); rs != nullptr) {
    model["max_model_len"] = rs->max_context;
  }
  return model;
}

void Router::Impl::HandleModels(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  nlohmann::json body = {{"object", "list"}, {"data", nlohmann::json::array({ModelObject()})}};
  w->Send(200, kJson, body.dump());
}

// GET /v1/models/{id}: the model object, or 404 model_not_found. An id with
// a slash ("org/name") may come raw or percent-encoded.
void Router::Impl::HandleModel(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  constexpr std::string_view kPrefix = "/v1/models/";
  const std::string id = http::PercentDecode(std::string_view(req.path).substr(kPrefix.size()));
  if (id != config()->model.served_name) {
    w->Send(404, kJson, ApiErrorJson(ApiErrorFromStatus(UnknownModelError(id))));
    return;
  }
  w->Send(200, kJson, ModelObject().dump());
}

void Router::Impl::HandleHealth(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  int healthy[kNumPoolRoles] = {0, 0};
  int total[kNumPoolRoles] = {0, 0};
  nlohmann::json incompatible[kNumPoolRoles] = {nlohmann::json::array(), nlohmann::json::array()};
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    for (const auto& worker : cluster_.Workers(role)) {
      ++total[static_cast<int>(role)];
      if (worker->healthy()) ++healthy[static_cast<int>(role)];
      if (std::string why = worker->incompatibility(); !why.empty()) {
        incompatible[static_cast<int>(role)].push_back({{"worker", worker->address()}, {"why", why}});
      }
    }
  }
  const int d = static_cast<int>(PoolRole::kDecode), p = static_cast<int>(PoolRole::kPrefill);
  nlohmann::json pools = {{"decode", {{"healthy", healthy[d]}, {"workers", total[d]}}}};
  if (cluster_.HasPool(PoolRole::kPrefill)) {
    pools["prefill"] = {{"healthy", healthy[p]}, {"workers", total[p]}};
  }
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    const int r = static_cast<int>(role);
    if (pools.contains(PoolRoleName(role)) && !incompatible[r].empty()) {
      pools[PoolRoleName(role)]["incompatible"] = incompatible[r];
    }
  }
  // Ready when a decode-capable worker can take requests: without prefill
  // workers the decode workers prefill themselves (degraded, not down).
  // With API keys, the pools' make-up is for admin keys only: a probe
  // learns ready or not.
  const Caller caller = Identify(req);
  const bool details = !caller.store->enabled() || caller.admin();
  if (healthy[d] > 0) {
    nlohmann::json body = {{"status", "ok"}};
    if (details) body["pools"] = pools;
    w->Send(200, kJson, body.dump());
    return;
  }
  if (!details) {
    nlohmann::json body = nlohmann::json::parse(
        ApiErrorJson(ApiErrorFromStatus(absl::UnavailableError("no healthy decode worker"))));
    body["status"] = "unavailable";
    w->Send(503, kJson, body.dump(), {{"Retry-After", "1"}});
    return;
  }
  ApiError e = ApiErrorFromStatus(absl::UnavailableError(
      absl::StrFormat("no healthy decode worker (%d in the pool)", total[d])));
  nlohmann::json body = nlohmann::json::parse(ApiErrorJson(e));
  body["status"] = "unavailable";
  body["pools"] = pools;
  w->Send(503, kJson, body.dump(), {{"Retry-After", "1"}});
}

void Router::Impl::HandleMetrics(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  w->Send(200, kPrometheusTextContentType, registry_.Render());
}

void Router::Impl::HandleTokenize(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  auto fail = [&](const absl::Status& s) { SendError("tokenize", id, *w, s); };
  if (absl::Status depth = CheckJsonDepth(req.body); !depth.ok()) return fail(depth);
  nlohmann::json body = nlohmann::json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    return fail(InvalidRequest("", "the body is not a JSON object"));
  }
  if (absl::Status s = RejectUnknownFields(body, {"model", "prompt", "messages",
                                                  "add_special_tokens", "add_generation_prompt",
                                                  "chat_template_kwargs", "return_token_strs"});
      !s.ok()) {
    return fail(s);
  }
  std::shared_ptr<const RouterConfig> cfg = config();
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) return fail(InvalidRequest("model", "'model' must be a string"));
    if (body["model"].get<std::string>() != cfg->model.served_name) {
      return fail(UnknownModelError(body["model"].get<std::string>()));
    }
  }
  auto flag = [&](const char* key, bool def) -> absl::StatusOr<bool> {
    if (!body.contains(key) || body[key].is_null()) return def;
    if (!body[key].is_boolean()) return InvalidRequest(key, absl::StrCat("'", key, "' must be a boolean"));
    return body[key].get<bool>();
  };
  const bool has_prompt = body.contains("prompt") && !body["prompt"].is_null();
  const bool has_messages = body.contains("messages") && !body["messages"].is_null();
  if (has_prompt == has_messages) {
    return fail(InvalidRequest(has_prompt ? "messages" : "prompt",
                               "give exactly one of 'prompt' and 'messages'"));
  }
  // Bounded before any work: the answer (ids, and token_strs) grows with the
  // text, so the text (of which the body is an upper bound, up to its JSON
  // escapes) is bounded by what the model could take.
  const std::shared_ptr<RoutingState> rs = Routing();
  if (rs != nullptr && rs->max_context > 0) {
    const std::string_view text = has_prompt && body["prompt"].is_string()
                                      ? std::string_view(body["prompt"].get_ref<const std::string&>())
                                      : std::string_view(req.body);
    if (static_cast<int64_t>(text.size()) > rs->max_context * kTokenizeBytesPerContextToken) {
      metrics_->refusals.WithLabels({"tokenize_too_large"}).Inc();
      return fail(InvalidRequest(
          has_prompt ? "prompt" : "messages",
          absl::StrFormat("the text is %d bytes, more than %d x this model's context of %d "
                          "tokens could hold",
                          text.size(), kTokenizeBytesPerContextToken, rs->max_context)));
    }
  }
  std::vector<int32_t> tokens;
  if (has_prompt) {
    if (!body["prompt"].is_string()) return fail(InvalidRequest("prompt", "'prompt' must be a string"));
    absl::StatusOr<bool> a = flag("add_special_tokens", true);
    if (!a.ok()) return fail(a.status());
    tokens = assets_->tokenizer->Encode(body["prompt"].get_ref<const std::string&>(), *a);
  } else {
    // Messages go through the chat completions parser, so they get its checks.
    nlohmann::json chat = {{"model", cfg->model.served_name}, {"messages", body["messages"]}};
    for (const char* key : {"add_generation_prompt", "chat_template_kwargs"}) {
      if (body.contains(key)) chat[key] = body[key];
    }
    absl::StatusOr<ChatCompletionRequest> parsed = ParseChatCompletionRequest(chat.dump());
    if (!parsed.ok()) return fail(parsed.status());
    absl::StatusOr<bool> a = flag("add_special_tokens", false);
    if (!a.ok()) return fail(a.status());
    absl::StatusOr<std::vector<int32_t>> prompt = ChatPrompt(*parsed, *a);
    if (!prompt.ok()) return fail(prompt.status());
    tokens = *std::move(prompt);
  }
  absl::StatusOr<bool> strs = flag("return_token_strs", false);
  if (!strs.ok()) return fail(strs.status());
  // Written straight into one string: a JSON tree of the ids and strings
  // costs tens of bytes per token more.
  std::string out = "{\"tokens\":[";
  out.reserve(tokens.size() * (*strs ? 16 : 7) + 64);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) out.push_back(',');
    absl::StrAppend(&out, tokens[i]);
  }
  absl::StrAppend(&out, "],\"count\":", tokens.size());
  if (rs != nullptr) absl::StrAppend(&out, ",\"max_model_len\":", rs->max_context);
  if (*strs) {
    out += ",\"token_strs\":[";
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out.push_back(',');
      out += nlohmann::json(assets_->tokenizer->IdToToken(tokens[i]).value_or(""))
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    out.push_back(']');
  }
  out.push_back('}');
  w->Send(200, kJson, std::move(out), {{"x-request-id", id}});
}

void Router::Impl::HandleDetokenize(const http::Request& req,
                                    std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  auto fail = [&](const absl::Status& s) { SendError("detokenize", id, *w, s); };
  if (absl::Status depth = CheckJsonDepth(req.body); !depth.ok()) return fail(depth);
  nlohmann::json body = nlohmann::json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    return fail(InvalidRequest("", "the body is not a JSON object"));
  }
  if (absl::Status s = RejectUnknownFields(body, {"model", "tokens"}); !s.ok()) return fail(s);
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return fail(InvalidRequest("tokens", "'tokens' must be a list of token ids"));
  }
  std::vector<int32_t> tokens;
  const int vocab = assets_->tokenizer->vocab_size();
  for (size_t i = 0; i < body["tokens"].size(); ++i) {
    const nlohmann::json& t = body["tokens"][i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return fail(InvalidRequest(absl::StrFormat("tokens[%d]", i),
                                 absl::StrFormat("token ids must be integers in [0, %d)", vocab)));
    }
    tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  nlohmann::json out = {{"prompt", assets_->tokenizer->Decode(tokens, /*skip_special_tokens=*/false)}};
  w->Send(200, kJson, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
          {{"x-request-id", id}});
}

// ---------------------------------------------------------------------------
// Router

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() = default;

absl::StatusOr<std::unique_ptr<Router>> Router::Create(RouterConfig config,
                                                       std::string config_path) {
  RETURN_IF_ERROR(ValidateRouterConfig(config));
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelAssets> assets, LoadModelAssets(config.model));
  absl::StatusOr<std::shared_ptr<const tls::ChannelFactory>> channels = WorkerChannelsFor(config.tls);
  if (!channels.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path.empty() ? "" : config_path + ": ",
                                                   channels.status().message()));
  }
  return std::unique_ptr<Router>(new Router(std::make_unique<Impl>(
      std::move(config), std::move(config_path), std::move(assets), *std::move(channels))));
}

absl::Status Router::Start() { return impl_->Start(); }
void Router::Stop() { impl_->Stop(); }
int Router::port() const { return impl_->port(); }
absl::Status Router::Reload() { return impl_->Reload(); }

}  // namespace tandem::router
