#include "orchestrator/server/generation.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_poller.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace tandem::router {
namespace {

using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;
using tandem::v1::KvTransferParams;
using tandem::v1::TokenOutput;

// Codes after which another worker may well succeed. CANCELLED among them:
// the router's own cancellations end calls of a finished or abandoned
// attempt, which are never failed, so a live call ending CANCELLED was
// cancelled by the worker's side (a server shutting down cancels the streams
// it has not finished).
bool Retryable(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

// UNAVAILABLE from a call: the worker is gone (or not serving); eject it now
// rather than at its next failed health checks.
void EjectIfGone(const absl::Status& status, WorkerClient& worker) {
  if (status.code() == absl::StatusCode::kUnavailable && worker.Eject()) {
    LOG(WARNING) << "worker " << worker.address() << " ejected: " << status.message();
  }
}

}  // namespace

// One Generate call, read on the process's GrpcPoller. Keeps the Generation
// alive until the call ends, then deletes itself.
struct Generation::Call final : GrpcReader<GenerateResponse> {
  Call(std::shared_ptr<Generation> g, CallKind k, int a, std::shared_ptr<WorkerClient> w, GenerateRequest req,
       int64_t prefill_tokens)
      : gen(std::move(g)),
        kind(k),
        attempt(a),
        worker(std::move(w)),
        request(std::move(req)),
        in_flight(worker, prefill_tokens) {}

  void Start() {
    context.set_deadline(gen->options_.deadline);
    StartReading(worker->stub().PrepareAsyncGenerate(&context, request, GrpcPoller::Shared().cq()));
  }

  bool OnMessage(const GenerateResponse& msg) override {
    gen->OnMessage(this, msg);
    return true;
  }

  void OnEnd(const grpc::Status& status) override {
    gen->OnCallDone(this, status);
    delete this;
  }

  std::shared_ptr<Generation> gen;
  const CallKind kind;
  const int attempt;
  const std::shared_ptr<WorkerClient> worker;
  GenerateRequest request;
  InFlight in_flight;
  grpc::ClientContext context;
  bool reserved = false;   // RECEIVE: the reservation came
  bool finished = false;   // its final message (finish_reason set) came
  bool abandoned = false;  // its attempt was abandoned: what it still says is ignored
};

Generation::Generation(Options options, GenerateRequest request, Planner* planner, GenerationSink* sink)
    : options_(std::move(options)), request_(std::move(request)), planner_(planner), sink_(sink) {}

Generation::~Generation() = default;

void Generation::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    AttemptLocked();
  }
  StartLaunched();
}

void Generation::Cancel(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  GenerationResult r = result_;
  r.status = why;
  r.finish_reason = tandem::v1::FINISH_REASON_ABORT;
  r.completion_tokens = emitted_;
  FinishLocked(std::move(r), /*cancel_prefill=*/true);
}

void Generation::StartLaunched() {
  std::vector<Call*> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.swap(launched_);
  }
  for (Call* c : calls) c->Start();
}

void Generation::AttemptLocked() {
  absl::StatusOr<Placement> placement = PlaceLocked(tried_);
  if (placement.ok()) {
    EndWaitLocked(WaitEnd::kPlaced);
    LaunchAttemptLocked(*std::move(placement));
    return;
  }
  const absl::Status& failed = placement.status();
  const auto now = std::chrono::steady_clock::now();
  const bool may_wait = failed.code() == absl::StatusCode::kUnavailable && options_.wait_for_worker.count() > 0 &&
                        !failed.GetPayload(kNoWorkerToWaitFor).has_value();
  if (may_wait && !waiting_since_.has_value()) {
    waiting_since_ = now;
    planner_->NoteWaiting(1);
    LOG(INFO) << "request " << options_.request_id << " choice " << options_.choice << ": waiting up to "
              << std::chrono::duration<double>(options_.wait_for_worker).count()
              << " s for a worker: " << failed.message();
  }
  if (may_wait && now - *waiting_since_ < options_.wait_for_worker) return;  // CheckProgress places again
  std::string message(failed.message());
  if (waiting_since_.has_value()) {
    absl::StrAppendFormat(&message, "; waited %.3g s for one (retries.wait_for_worker_s)",
                          std::chrono::duration<double>(now - *waiting_since_).count());
    EndWaitLocked(WaitEnd::kExpired);
  }
  if (!last_error_.ok()) absl::StrAppend(&message, "; the last attempt failed: ", last_error_.message());
  GenerationResult r = result_;
  r.status = absl::Status(failed.code(), message);
  r.completion_tokens = emitted_;
  FinishLocked(std::move(r), /*cancel_prefill=*/true);
}

void Generation::EndWaitLocked(WaitEnd how) {
  if (!waiting_since_.has_value()) return;
  waiting_since_.reset();
  planner_->NoteWaiting(-1);
  switch (how) {
    case WaitEnd::kPlaced:
      ++result_.worker_waits;
      break;
    case WaitEnd::kExpired:
      result_.worker_wait_expired = true;
      break;
    case WaitEnd::kCancelled:
      result_.worker_wait_cancelled = true;
      break;
  }
}

absl::StatusOr<Placement> Generation::PlaceLocked(const TriedWorkers& tried) {
  const auto& prompt = request_.prompt_token_ids();
  if (sent_ids_.empty()) {
    return planner_->Place(std::span<const int32_t>(prompt.data(), prompt.size()), tried);
  }
  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  tokens.insert(tokens.end(), sent_ids_.begin(), sent_ids_.end());
  return planner_->Place(tokens, tried);
}

void Generation::LaunchAttemptLocked(Placement placement) {
  ++attempt_;
  result_.attempts = attempt_;
  attempt_started_ = last_token_at_ = std::chrono::steady_clock::now();
  attempt_has_token_ = decode_has_token_ = attempt_expired_ = false;
  placement_ = std::move(placement);
  if (!sent_ids_.empty()) {
    // A resumption: aggregated on the decode worker (the worker API resumes
    // aggregated requests only), the tokens sent as output already made.
    placement_.prefill = nullptr;
    result_.decode_worker = result_.prefill_worker = placement_.decode->address();
    GenerateRequest resume = request_;
    for (int32_t id : sent_ids_) resume.add_prompt_token_ids(id);
    resume.set_resume_output_tokens(static_cast<int32_t>(sent_ids_.size()));
    LaunchLocked(CallKind::kAggregated, placement_.decode, std::move(resume), placement_.decode_cached_tokens);
    return;
  }
  result_.decode_worker = placement_.decode->address();
  result_.prefill_worker = placement_.prefill != nullptr ? placement_.prefill->address() : placement_.decode->address();
  if (placement_.prefill == nullptr) {
    LaunchLocked(CallKind::kAggregated, placement_.decode, request_, placement_.decode_cached_tokens);
    return;
  }
  GenerateRequest receive = request_;
  KvTransferParams* kv = receive.mutable_kv_transfer();
  kv->set_mode(KvTransferParams::RECEIVE);
  kv->set_timeout_ms(options_.kv_receive_timeout_ms);
  LaunchLocked(CallKind::kReceive, placement_.decode, std::move(receive));
}

Generation::Call* Generation::LaunchLocked(CallKind kind, const std::shared_ptr<WorkerClient>& worker,
                                           GenerateRequest request, int64_t cached_tokens) {
  request.set_request_id(
      absl::StrCat(options_.request_id, "-", options_.choice, "-", attempt_, kind == CallKind::kSend ? "p" : "d"));
  const int64_t prefill_tokens =
      kind == CallKind::kReceive ? 0 : std::max<int64_t>(0, request.prompt_token_ids_size() - cached_tokens);
  auto* call = new Call(shared_from_this(), kind, attempt_, worker, std::move(request), prefill_tokens);
  calls_.push_back(call);
  launched_.push_back(call);
  return call;
}

void Generation::OnMessage(Call* call, const GenerateResponse& msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || call->attempt != attempt_ || call->abandoned) return;
    // (RepeatedPtrField holds pointers; messages carry a few tokens each.)
    const std::vector<TokenOutput> token_list(msg.tokens().begin(), msg.tokens().end());
    const std::span<const TokenOutput> tokens(token_list);
    const bool final = msg.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED;
    if (final) {
      call->finished = true;
      // The worker is done with it: load-aware policies see that before the
      // client sees the end of its response.
      call->in_flight = InFlight();
    }
    switch (call->kind) {
      case CallKind::kAggregated:
        if (!tokens.empty()) {
          call->in_flight.PrefillDone();
          decode_has_token_ = true;
          first_emitted_ = true;
          if (!EmitLocked(tokens)) return;
        }
        if (final) FinishDecodeLocked(msg);
        break;

      case CallKind::kReceive: {
        if (msg.has_reservation() && !call->reserved) {
          call->reserved = true;
          GenerateRequest send = request_;
          KvTransferParams* kv = send.mutable_kv_transfer();
          kv->set_mode(KvTransferParams::SEND);
          kv->set_decode_address(call->worker->address());
          kv->set_reservation_id(msg.reservation().reservation_id());
          kv->set_decode_cached_tokens(msg.reservation().cached_tokens());
          kv->set_decode_instance_id(msg.reservation().instance_id());
          kv->set_reservation_token(msg.reservation().reservation_token());
          *kv->mutable_reservation() = msg.reservation();
          LaunchLocked(CallKind::kSend, placement_.prefill, std::move(send), placement_.prefill_cached_tokens);
          break;
        }
        std::span<const TokenOutput> rest = tokens;
        if (!tokens.empty()) decode_has_token_ = true;
        if (msg.includes_first_token() && !rest.empty()) {
          // The decode worker prefilled locally: the KV never came.
          result_.kv_fallback = true;
          if (first_emitted_) {
            rest = rest.subspan(1);  // the prefill worker's first token is out already
          } else {
            first_emitted_ = true;
          }
        }
        if (!first_emitted_) {
          held_.insert(held_.end(), rest.begin(), rest.end());
          if (final) {
            decode_finished_ = true;
            decode_final_ = msg;
          }
          break;
        }
        if (!rest.empty() && !EmitLocked(rest)) return;
        if (final) FinishDecodeLocked(msg);
        break;
      }

      case CallKind::kSend:
        if (!tokens.empty()) {
          call->in_flight.PrefillDone();
          if (!first_emitted_) {
            first_emitted_ = true;
            first_from_prefill_ = true;
            if (!EmitLocked(tokens.subspan(0, 1))) return;
            std::vector<TokenOutput> held;
            held.swap(held_);
            if (!held.empty() && !EmitLocked(held)) return;
            if (decode_finished_) {
              FinishDecodeLocked(decode_final_);
              break;
            }
          }
        }
        if (final) {
          result_.kv_bytes = msg.kv_transfer_bytes();
          result_.cached_tokens = msg.usage().cached_prompt_tokens();
          if (!msg.kv_transfer_error().empty()) {
            result_.kv_fallback = true;
            LOG(WARNING) << "request " << options_.request_id << ": KV from " << call->worker->address()
                         << " did not reach " << placement_.decode->address() << ": " << msg.kv_transfer_error();
          }
        }
        break;
    }
  }
  StartLaunched();
}

bool Generation::EmitLocked(std::span<const TokenOutput> tokens) {
  if (!placed_) {
    placed_ = true;
    sink_->OnPlaced(options_.choice, placement_);
  }
  const auto now = std::chrono::steady_clock::now();
  const double waited = std::chrono::duration<double>(now - last_token_at_).count();
  LatencyWindow* window = attempt_has_token_ ? options_.token_gaps : options_.first_token_latency;
  if (window != nullptr) window->Record(waited);
  attempt_has_token_ = true;
  last_token_at_ = now;
  emitted_ += static_cast<int64_t>(tokens.size());
  for (const TokenOutput& t : tokens) sent_ids_.push_back(t.token_id());
  if (sink_->OnTokens(options_.choice, tokens)) return true;
  // A stop string matched: the workers can stop.
  GenerationResult r = result_;
  r.finish_reason = tandem::v1::FINISH_REASON_STOP;
  r.prompt_tokens = request_.prompt_token_ids_size();
  r.completion_tokens = emitted_;
  FinishLocked(std::move(r), /*cancel_prefill=*/true);
  return false;
}

void Generation::FinishDecodeLocked(const GenerateResponse& msg) {
  if (msg.finish_reason() == tandem::v1::FINISH_REASON_ERROR ||
      msg.finish_reason() == tandem::v1::FINISH_REASON_ABORT) {
    FailAttemptLocked(
        absl::InternalError(absl::StrCat("worker ", placement_.decode->address(), ": ", msg.error_message())),
        placement_.decode);
    return;
  }
  GenerationResult r = result_;
  r.finish_reason = msg.finish_reason();
  r.prompt_tokens = msg.usage().prompt_tokens();
  r.completion_tokens = emitted_;
  if (placement_.prefill == nullptr || r.kv_fallback) {
    r.cached_tokens = msg.usage().cached_prompt_tokens();
  }
  FinishLocked(std::move(r), /*cancel_prefill=*/false);
}

void Generation::OnCallDone(Call* call, const grpc::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.erase(std::find(calls_.begin(), calls_.end(), call));
    if (done_ || call->attempt != attempt_ || call->finished || call->abandoned) return;
    absl::Status s = status.ok() ? absl::InternalError(absl::StrCat("worker ", call->worker->address(),
                                                                    " ended the stream without a finish reason"))
                                 : FromGrpcStatus(status);
    if (call->kind == CallKind::kSend && first_emitted_) {
      // The prefill worker failed after its first token: the decode worker
      // falls back to a local prefill; the stream goes on.
      result_.kv_fallback = true;
      LOG(WARNING) << "request " << options_.request_id << ": prefill worker " << call->worker->address()
                   << " failed after the first token: " << s.ToString();
      EjectIfGone(s, *call->worker);
      return;
    }
    if (!s.ok() && s.message().find(call->worker->address()) == std::string_view::npos) {
      s = absl::Status(s.code(), absl::StrCat("worker ", call->worker->address(), ": ", s.message()));
    }
    FailAttemptLocked(s, call->worker);
  }
  StartLaunched();
}

void Generation::FailAttemptLocked(const absl::Status& status, const std::shared_ptr<WorkerClient>& worker) {
  EjectIfGone(status, *worker);
  last_error_ = status;
  if (!first_emitted_ && Retryable(status.code()) && attempt_ < options_.max_attempts && planner_->TakeRetry()) {
    LOG(INFO) << "request " << options_.request_id << ": retrying after " << status.ToString();
    AbandonAttemptLocked();
    tried_[worker->address()] = attempt_started_;
    result_.kv_fallback = false;
    AttemptLocked();
    return;
  }
  if (first_emitted_ && Retryable(status.code()) && FailoverLocked(status, worker)) return;
  GenerationResult r = result_;
  r.status = status;
  r.completion_tokens = emitted_;
  FinishLocked(std::move(r), /*cancel_prefill=*/true);
}

std::optional<tandem::v1::FinishReason> Generation::EndedBySentLocked() const {
  if (sent_ids_.empty()) return std::nullopt;
  const tandem::v1::SamplingParams& p = request_.sampling();
  const int32_t last = sent_ids_.back();
  const auto& stops = p.stop_token_ids();
  if (std::find(stops.begin(), stops.end(), last) != stops.end()) {
    return tandem::v1::FINISH_REASON_STOP;
  }
  const std::optional<tandem::v1::ModelInfo> info = placement_.decode->model_info();
  if (info.has_value()) {
    const auto& eos = info->eos_token_ids();
    if (!p.ignore_eos() && std::find(eos.begin(), eos.end(), last) != eos.end()) {
      return tandem::v1::FINISH_REASON_STOP;
    }
    if (request_.prompt_token_ids_size() + static_cast<int64_t>(sent_ids_.size()) >= info->max_context_length()) {
      return tandem::v1::FINISH_REASON_LENGTH;
    }
  }
  if (p.has_max_tokens() && static_cast<int64_t>(sent_ids_.size()) >= p.max_tokens()) {
    return tandem::v1::FINISH_REASON_LENGTH;
  }
  return std::nullopt;
}

bool Generation::FailoverLocked(const absl::Status& why, const std::shared_ptr<WorkerClient>& worker) {
  if (failovers_ >= options_.max_failovers) return false;
  if (std::optional<tandem::v1::FinishReason> end = EndedBySentLocked()) {
    FinishSentLocked(*end);
    return true;
  }
  ++failovers_;
  ++result_.error_failovers;
  LOG(WARNING) << "request " << options_.request_id << " choice " << options_.choice << ": failing over after "
               << sent_ids_.size() << " tokens (failover " << failovers_ << " of " << options_.max_failovers
               << "): " << why.ToString();
  AbandonAttemptLocked();
  tried_[worker->address()] = attempt_started_;
  AttemptLocked();
  return true;
}

void Generation::FinishSentLocked(tandem::v1::FinishReason reason) {
  // Only the final message was lost: the generation is complete.
  GenerationResult r = result_;
  r.finish_reason = reason;
  r.prompt_tokens = request_.prompt_token_ids_size();
  r.completion_tokens = emitted_;
  FinishLocked(std::move(r), /*cancel_prefill=*/true);
}

void Generation::AbandonAttemptLocked() {
  // (Marked, not only cancelled: the next attempt may not start at once, a
  // wait for a worker coming first, and the attempt number alone would not
  // tell these calls from live ones meanwhile.)
  for (Call* c : calls_) c->abandoned = true;
  CancelCallsLocked(/*include_send=*/true);
  held_.clear();
  decode_finished_ = false;
}

void Generation::CheckProgress(std::chrono::steady_clock::time_point now, double first_token_s, double idle_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (waiting_since_.has_value()) {
      // No attempt runs: place again (a worker may be healthy by now).
      AttemptLocked();
    } else if (!attempt_expired_ && placement_.decode != nullptr) {
      MoveIfPastDeadlineLocked(now, first_token_s, idle_s);
    }
  }
  StartLaunched();
}

void Generation::MoveIfPastDeadlineLocked(std::chrono::steady_clock::time_point now, double first_token_s,
                                          double idle_s) {
  const double deadline = attempt_has_token_ ? idle_s : first_token_s;
  const auto since = attempt_has_token_ ? last_token_at_ : attempt_started_;
  if (deadline <= 0 || now - since < std::chrono::duration<double>(deadline)) return;
  attempt_expired_ = true;
  if (attempt_has_token_) {
    ++result_.idle_timeouts;
  } else {
    ++result_.first_token_timeouts;
  }
  // The worker to suspect: the decode worker, unless this is a split
  // attempt whose decode side is waiting on the prefill worker (the
  // reservation is made, or the first token came, and the hand-off has not
  // ended).
  std::shared_ptr<WorkerClient> suspect = placement_.decode;
  if (placement_.prefill != nullptr && !decode_has_token_) {
    bool reserved = false, send_open = false;
    for (const Call* c : calls_) {
      if (c->attempt != attempt_) continue;
      if (c->kind == CallKind::kReceive && c->reserved) reserved = true;
      if (c->kind == CallKind::kSend && !c->finished) send_open = true;
    }
    if (attempt_has_token_ ? send_open : reserved) suspect = placement_.prefill;
  }
  const absl::Status why = absl::DeadlineExceededError(
      absl::StrFormat("worker %s sent no token for %.3g s (retries.%s)", suspect->address(), deadline,
                      attempt_has_token_ ? "attempt_idle_s" : "attempt_first_token_s"));
  last_error_ = why;
  const bool failover = first_emitted_;
  if (failover ? failovers_ >= options_.max_failovers : attempt_ >= options_.max_attempts || !planner_->TakeRetry()) {
    LOG(WARNING) << "request " << options_.request_id << ": " << why.message() << "; no "
                 << (failover ? "failover" : "retry") << " left, waiting on it";
    return;
  }
  if (std::optional<tandem::v1::FinishReason> end = EndedBySentLocked(); failover && end) {
    FinishSentLocked(*end);
    return;
  }
  TriedWorkers tried = tried_;
  tried[suspect->address()] = attempt_started_;
  absl::StatusOr<Placement> placement = PlaceLocked(tried);
  if (!placement.ok()) {
    LOG(WARNING) << "request " << options_.request_id << ": " << why.message() << "; no other worker to move to ("
                 << placement.status().message() << "), waiting on it";
    return;
  }
  if (suspect->Eject()) {
    LOG(WARNING) << "worker " << suspect->address() << " ejected: " << why.message();
  }
  if (failover) {
    ++failovers_;
    ++result_.stall_failovers;
    LOG(WARNING) << "request " << options_.request_id << " choice " << options_.choice << ": failing over after "
                 << sent_ids_.size() << " tokens (failover " << failovers_ << " of " << options_.max_failovers
                 << "): " << why.message();
  } else {
    LOG(WARNING) << "request " << options_.request_id << ": retrying elsewhere: " << why.message();
  }
  AbandonAttemptLocked();
  tried_ = std::move(tried);
  result_.kv_fallback = false;
  LaunchAttemptLocked(*std::move(placement));
}

void Generation::FinishLocked(GenerationResult result, bool cancel_prefill) {
  if (done_) return;
  done_ = true;
  if (waiting_since_.has_value()) {
    EndWaitLocked(WaitEnd::kCancelled);
    result.worker_wait_cancelled = true;
  }
  CancelCallsLocked(cancel_prefill);
  // A failure before any token still names the workers last tried.
  if (!placed_ && placement_.decode != nullptr) {
    placed_ = true;
    sink_->OnPlaced(options_.choice, placement_);
  }
  sink_->OnDone(options_.choice, result);
}

void Generation::CancelCallsLocked(bool include_send) {
  for (Call* c : calls_) {
    if (include_send || c->kind != CallKind::kSend) c->context.TryCancel();
  }
}

}  // namespace tandem::router
