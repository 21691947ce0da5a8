#include "orchestrator/server/api_call.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace tandem::router {
namespace {

using Clock = std::chrono::steady_clock;
using tandem::v1::TokenOutput;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

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
  if (s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kOutOfRange) {
    return "invalid";
  }
  return "error";
}

}  // namespace

const std::string& ApiCall::endpoint() const {
  static const std::string chat = "chat", completions = "completions";
  return kind_ == CallKind::kChat ? chat : completions;
}

void ApiCall::Prepare(CallSetup setup, uint64_t random_seed) {
  session_id_ = setup.session_id;
  explain_ = setup.explain;
  header_.id = absl::StrCat(kind_ == CallKind::kChat ? "chatcmpl-" : "cmpl-", request_id_);
  header_.created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  header_.model = setup.model;
  header_.include_usage = setup.include_usage;
  header_.tokens_as_ids = setup.tokens_as_ids;
  stream_ = setup.stream;
  logprobs_ = setup.logprobs;
  echo_ = setup.echo;
  const uint64_t seed = setup.seed.has_value() ? static_cast<uint64_t>(*setup.seed) : random_seed;
  for (int i = 0; i < setup.n; ++i) {
    choices_.emplace_back(env_->assets->tokenizer.get(), setup.stops);
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
  show_workers_ = setup.show_workers;
  planner_ = std::make_unique<RequestPlanner>(
      env_->placer, env_->admission,
      PlaceRequest{.request_id = request_id_, .session_id = session_id_, .explain = explain_});
}

int64_t ApiCall::TokensUsed() {
  std::lock_guard<std::mutex> lock(mu_);
  return TokensUsedLocked();
}

int64_t ApiCall::TokensUsedLocked() const {
  int64_t used = prompt_tokens_;
  for (const Choice& c : choices_) used += c.tokens;
  return used;
}

void ApiCall::Start() {
  env_->metrics->queue_time.Observe(Seconds(Clock::now() - arrived_));
  std::vector<std::shared_ptr<Generation>> gens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) {
      // Cancelled while queued: nothing ran.
      remaining_ = 0;
    } else {
      started_ = true;
      const auto deadline = std::chrono::system_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(config_->timeouts.request_s * 1000));
      for (size_t i = 0; i < requests_.size(); ++i) {
        Generation::Options o{.choice = static_cast<int>(i),
                              .request_id = request_id_,
                              .max_attempts = config_->retries.max_attempts,
                              .deadline = deadline,
                              .max_failovers = config_->retries.max_failovers,
                              .wait_for_worker = std::chrono::milliseconds(
                                  static_cast<int64_t>(config_->retries.wait_for_worker_s * 1000)),
                              .first_token_latency = env_->first_token_latency,
                              .token_gaps = env_->token_gaps};
        gens_.push_back(std::make_shared<Generation>(o, std::move(requests_[i]), planner_.get(), this));
      }
      gens = gens_;
    }
  }
  if (gens.empty()) {
    env_->admission->Finished(shared_from_this());
    return;
  }
  for (const std::shared_ptr<Generation>& g : gens) g->Start();
}

void ApiCall::Cancel(const absl::Status& why) {
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
    env_->admission->Dequeue(shared_from_this());
    SendApiError(why);
    env_->metrics->outcomes.WithLabels({"none", Outcome(why)}).Inc();
    return;
  }
  for (const std::shared_ptr<Generation>& g : gens) g->Cancel(why);
}

void ApiCall::Watch(Clock::time_point now) {
  const double attempt_first_token_s = env_->deadlines->first_token_s;
  const double attempt_idle_s = env_->deadlines->idle_s;
  absl::Status why;
  std::vector<std::shared_ptr<Generation>> gens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    gens = gens_;
    const TimeoutsConfig& t = config_->timeouts;
    if (now - arrived_ > std::chrono::duration<double>(t.request_s)) {
      why = absl::DeadlineExceededError(
          absl::StrFormat("the request did not finish within %g s (timeouts.request_s)", t.request_s));
    } else if (!first_token_at_.has_value()) {
      if (now - arrived_ > std::chrono::duration<double>(t.first_token_s)) {
        why = absl::DeadlineExceededError(
            absl::StrFormat("no token within %g s (timeouts.first_token_s)", t.first_token_s));
      }
    } else if (now - last_token_at_ > std::chrono::duration<double>(t.idle_stream_s)) {
      why = absl::DeadlineExceededError(absl::StrFormat("no token for %g s (timeouts.idle_stream_s)", t.idle_stream_s));
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

void ApiCall::OnPlaced(int choice, const Placement& placement) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!placement.explanation.empty()) route_ = placement.explanation;  // the latest attempt's
  if (choice == 0) {
    // What the policy expected the worker that prefills to hold (the latest attempt's).
    expected_cached_ = placement.prefill != nullptr ? placement.prefill_cached_tokens : placement.decode_cached_tokens;
  }
  if (prefill_worker_.empty()) {
    decode_worker_ = placement.decode->address();
    prefill_worker_ = placement.prefill != nullptr ? placement.prefill->address() : decode_worker_;
    disaggregated_ = placement.prefill != nullptr;
  }
  if (placement.local_prefill) {
    env_->metrics->fallbacks.WithLabels({"local_prefill"}).Inc();
  }
}

bool ApiCall::OnTokens(int index, std::span<const TokenOutput> tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return false;
  Choice& c = choices_[index];
  const Clock::time_point now = Clock::now();
  const std::string mode = disaggregated_ ? "disaggregated" : "aggregated";
  if (!first_token_at_.has_value()) {
    first_token_at_ = now;
    env_->metrics->ttft.WithLabels({mode}).Observe(Seconds(now - arrived_));
  }
  if (c.last_token_at.has_value()) {
    Histogram& itl = env_->metrics->itl.WithLabels({mode});
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

void ApiCall::OnDone(int index, const GenerationResult& result) {
  bool cancel_others = false;
  bool all_done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Choice& c = choices_[index];
    c.result = result;
    all_done = --remaining_ == 0;
    const bool fails = !finished_ && !result.status.ok();
    if (fails) {
      finished_ = true;
      failure_ = result.status;
      cancel_others = remaining_ > 0;
    }
    // The admission slot is free, and the request accounted in the metrics,
    // before the client sees the end: a client's next request never finds
    // its own last one still counted, and a scrape after the reply sees it.
    if (all_done) {
      env_->admission->ReleaseSlot(shared_from_this());
      env_->admission->ReleaseKey(shared_from_this(), TokensUsedLocked());
      AccountLocked();
    }
    if (fails) {
      if (!stream_started_) {
        SendApiError(result.status);
      } else {
        writer_->Write(ErrorChunk(env_->errors->ForClient(result.status, show_workers_)));
        writer_->Write(DoneChunk());
        writer_->End();
      }
    } else if (!finished_) {
      std::string tail;
      if (!c.stops.stopped()) tail = c.stops.Push(c.detok.Flush());
      if (!c.stops.stopped()) tail += c.stops.Flush();
      const FinishReason finish = c.stops.stopped() ? FinishReason::kStop : ToApiFinish(result.finish_reason);
      c.finish = finish;
      if (stream_) {
        WriteDeltaLocked(index, tail, std::nullopt, finish);
      } else {
        c.text += tail;
      }
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
    env_->post([self] { self->Cancel(absl::CancelledError("another choice failed")); });
  }
  if (all_done) {
    auto self = shared_from_this();
    env_->post([self] { self->env_->admission->Finished(self); });
  }
}

void ApiCall::AccountLocked() {
  RouterMetrics& m = *env_->metrics;
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
    if (r.worker_waits > 0) m.worker_waits.WithLabels({"placed"}).Inc(r.worker_waits);
    if (r.worker_wait_expired) m.worker_waits.WithLabels({"expired"}).Inc();
    if (r.worker_wait_cancelled) m.worker_waits.WithLabels({"cancelled"}).Inc();
    if (r.kv_fallback) m.fallbacks.WithLabels({"kv_transfer"}).Inc();
    m.generation_tokens.Inc(static_cast<double>(c.tokens));
    m.kv_bytes.Inc(static_cast<double>(r.kv_bytes));
  }
  m.prompt_tokens.Inc(static_cast<double>(prompt_tokens_));
  if (!choices_.empty()) m.cached_tokens.Inc(static_cast<double>(choices_[0].result.cached_tokens));
  m.expected_cached_tokens.Inc(static_cast<double>(expected_cached_));
  LOG(DEBUG) << "request " << request_id_ << " " << endpoint() << " done: " << s.ToString();
}

TokenLogprob ApiCall::MakeLogprob(const TokenOutput& t) const {
  const Tokenizer& tok = *env_->assets->tokenizer;
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

http::HeaderList ApiCall::Headers() const {
  http::HeaderList h = {{"x-request-id", request_id_}};
  // Worker addresses are debug output (debug.worker_details, admin keys).
  if (show_workers_ && !prefill_worker_.empty()) {
    h.emplace_back("x-tandem-prefill-worker", prefill_worker_);
    h.emplace_back("x-tandem-decode-worker", decode_worker_);
  }
  if (explain_ && !route_.empty()) h.emplace_back("x-tandem-route", route_);
  return h;
}

void ApiCall::StartStreamLocked() {
  if (stream_started_) return;
  stream_started_ = true;
  http::HeaderList h = Headers();
  h.emplace_back("Cache-Control", "no-cache");
  writer_->StartStream(200, "text/event-stream", h);
}

void ApiCall::WriteDeltaLocked(int index, const std::string& text, std::optional<std::vector<TokenLogprob>> logprobs,
                               std::optional<FinishReason> finish) {
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

Usage ApiCall::UsageLocked() const {
  Usage u;
  u.prompt_tokens = prompt_tokens_;
  for (const Choice& c : choices_) {
    u.completion_tokens += c.tokens;
    u.cached_tokens = std::max(u.cached_tokens, c.result.cached_tokens);
  }
  return u;
}

void ApiCall::CompleteLocked() {
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
  writer_->Send(200, http::kJsonContentType, std::move(body), Headers());
}

void ApiCall::SendApiError(const absl::Status& status) {
  env_->errors->Send(endpoint(), request_id_, *writer_, status, Headers(), show_workers_);
}

}  // namespace tandem::router
