// The router's HTTP endpoints (Router::Impl's handlers) and their JSON
// glue: authentication, request ids, the chat prompt (template and
// tokenizer), prompt checks, and the call setup handed to admission.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"
#include "orchestrator/server/router_impl.h"
#include "orchestrator/server/status_page.h"

namespace tandem::router {
namespace {

// A request header asking why it was routed where it was (x-tandem-route).
constexpr char kExplainHeader[] = "x-tandem-explain";

// Bound on a /tokenize text, in bytes per token of the model's context. A
// byte-level BPE token covers a few bytes of English (about 4) and rarely
// more than 16, so a text past 16 x the context could not be a prompt of
// this model; refusing it before tokenizing bounds the work and the answer
// (token_strs) by the model, not by the body limit.
constexpr int64_t kTokenizeBytesPerContextToken = 16;

std::string RandomHex(std::mt19937_64& rng) { return absl::StrFormat("%016x", rng()); }

}  // namespace

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

bool Router::Impl::Authorize(Access access, const std::string& endpoint, const http::Request& req,
                             http::ResponseWriter& w) {
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
    metrics_.auth_failures.WithLabels({reason}).Inc();
    metrics_.requests.WithLabels({endpoint, "401"}).Inc();
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
    w.Send(401, http::kJsonContentType, ApiErrorJson(e), {{"x-request-id", id}, {"WWW-Authenticate", "Bearer"}});
    return false;
  }
  if (access == Access::kAdmin && !m.key->admin) {
    metrics_.auth_failures.WithLabels({"forbidden"}).Inc();
    metrics_.requests.WithLabels({endpoint, "403"}).Inc();
    warnings_.Warn("forbidden",
                   absl::StrCat("API key '", m.key->name, "' is not an admin key: ", req.path, " refused"));
    ApiError e{.http_status = 403,
               .type = "permission_error",
               .message = absl::StrCat(req.path, " needs an admin API key"),
               .code = "insufficient_permissions"};
    w.Send(403, http::kJsonContentType, ApiErrorJson(e), {{"x-request-id", id}});
    return false;
  }
  return true;
}

std::string Router::Impl::RequestId(const http::Request& req) {
  std::string id(req.Header("X-Request-Id"));
  // Passed through when it is a sane token; generated otherwise.
  const bool ok = !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
  if (ok) return id;
  std::lock_guard<std::mutex> lock(mu_);
  return RandomHex(rng_);
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
  auto user_text = [&](const std::string& s) { return escape ? tokenizer.EscapeSpecialTokens(s) : s; };
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
    // Checked by the request parser: an object, nested at most kMaxJsonDepth
    // deep, no server-owned names.
    nlohmann::ordered_json extra = chat.chat_template_kwargs;
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
    return InvalidRequest("messages",
                          absl::StrCat("the chat template refused the conversation: ", text.status().message()));
  }
  return escape ? tokenizer.EncodeEscaped(*text, add_special_tokens) : tokenizer.Encode(*text, add_special_tokens);
}

absl::Status Router::Impl::CheckPrompt(std::span<const int32_t> prompt, std::optional<int64_t> max_tokens,
                                       const std::string& param) {
  if (prompt.empty()) return InvalidRequest(param, "the prompt is empty after tokenization");
  std::shared_ptr<RoutingState> rs = placer_.Routing();
  if (rs == nullptr) return absl::OkStatus();  // no worker yet: placement says 503
  for (int32_t id : prompt) {
    if (id < 0 || id >= rs->vocab_size) {
      return InvalidRequest(param,
                            absl::StrFormat("token id %d is outside the vocabulary [0, %d)", id, rs->vocab_size));
    }
  }
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (rs->max_context > 0 && n >= rs->max_context) {
    return InvalidRequest(param, absl::StrFormat("the prompt has %d tokens; this model's context is %d "
                                                 "tokens, which leaves no room to generate",
                                                 n, rs->max_context));
  }
  if (rs->max_context > 0 && max_tokens.has_value() && n + *max_tokens > rs->max_context) {
    return InvalidRequest("max_tokens",
                          absl::StrFormat("the prompt (%d tokens) plus max_tokens (%d) exceeds this model's "
                                          "context of %d tokens",
                                          n, *max_tokens, rs->max_context));
  }
  return absl::OkStatus();
}

namespace {

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
  auto fail = [&](const absl::Status& s) { errors_.Send("chat", id, *w, s); };
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
  StartCall(CallKind::kChat, req, std::move(w), id, cfg, std::move(s), parsed->model, parsed->sampling, top);
}

void Router::Impl::HandleCompletion(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  std::shared_ptr<const RouterConfig> cfg = config();
  auto fail = [&](const absl::Status& s) { errors_.Send("completions", id, *w, s); };
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
    return fail(InvalidRequest("echo",
                               "echo with logprobs needs prompt logprobs, which this "
                               "server does not compute; drop one of them"));
  }
  StartCall(CallKind::kCompletion, req, std::move(w), id, cfg, std::move(s), parsed->model, parsed->sampling,
            parsed->logprobs);
}

void Router::Impl::StartCall(CallKind kind, const http::Request& req, std::shared_ptr<http::ResponseWriter> w,
                             const std::string& id, std::shared_ptr<const RouterConfig> cfg, CallSetup s,
                             const std::string& model, const SamplingFields& sampling,
                             std::optional<int64_t> logprobs) {
  s.session_id = std::string(req.Header(cfg->sessions.header));
  s.caller = Identify(req);
  if (req.HasHeader(kExplainHeader)) {
    const std::string_view v = req.Header(kExplainHeader);
    const char* endpoint = kind == CallKind::kChat ? "chat" : "completions";
    if (v != "1" && v != "true") {
      return errors_.Send(endpoint, id, *w,
                          InvalidRequest("", absl::StrCat(kExplainHeader, " must be 1 or true, got '",
                                                          std::string(v.substr(0, 32)), "'")));
    }
    if (!ShowWorkers(s.caller)) {
      return errors_.Send(endpoint, id, *w,
                          absl::PermissionDeniedError(absl::StrCat(kExplainHeader,
                                                                   " names workers: it needs an admin API key or "
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
      std::shared_ptr<RoutingState> rs = placer_.Current();
      per_choice = rs != nullptr ? std::max<int64_t>(0, rs->max_context - prompt) : 0;
    }
    s.token_estimate = prompt + static_cast<int64_t>(s.n) * per_choice;
  }
  s.show_workers = ShowWorkers(s.caller);
  auto call = std::make_shared<ApiCall>(&env_, std::move(w), kind, id, std::move(cfg));
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
  s.uptime_s =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count() -
      created_;
  const Admission::Stats admitted = admission_.stats();
  s.in_flight = admitted.in_flight_sequences;
  s.queued = admitted.queued;
  std::shared_ptr<RoutingState> rs = placer_.Current();
  for (PoolRole role : {PoolRole::kPrefill, PoolRole::kDecode}) {
    const std::optional<PoolConfig>& pool = role == PoolRole::kPrefill ? cfg->prefill : cfg->decode;
    if (!pool.has_value()) continue;
    StatusSnapshot::Pool p{.name = PoolRoleName(role), .policy = pool->policy.name, .params = pool->policy.params};
    const int r = static_cast<int>(role);
    if (rs != nullptr && rs->index[r] != nullptr) p.index_blocks = static_cast<int64_t>(rs->index[r]->size());
    for (const auto& worker : cluster_.Workers(role)) {
      StatusSnapshot::Worker sw{.address = worker->address(),
                                .healthy = worker->healthy(),
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
  s.recent = placer_.Recent();
  w->Send(200, "text/html; charset=utf-8", RenderStatusPage(s));
}

nlohmann::json Router::Impl::ModelObject() {
  std::shared_ptr<const RouterConfig> cfg = config();
  nlohmann::json model = {
      {"id", cfg->model.served_name}, {"object", "model"}, {"created", created_}, {"owned_by", "tandem"}};
  if (std::shared_ptr<RoutingState> rs = placer_.Routing(); rs != nullptr) {
    model["max_model_len"] = rs->max_context;
  }
  return model;
}

void Router::Impl::HandleModels(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  nlohmann::json body = {{"object", "list"}, {"data", nlohmann::json::array({ModelObject()})}};
  w->Send(200, http::kJsonContentType, body.dump());
}

// GET /v1/models/{id}: the model object, or 404 model_not_found. An id with
// a slash ("org/name") may come raw or percent-encoded.
void Router::Impl::HandleModel(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  constexpr std::string_view kPrefix = "/v1/models/";
  const std::string id = http::PercentDecode(std::string_view(req.path).substr(kPrefix.size()));
  if (id != config()->model.served_name) {
    w->Send(404, http::kJsonContentType, ApiErrorJson(ApiErrorFromStatus(UnknownModelError(id))));
    return;
  }
  w->Send(200, http::kJsonContentType, ModelObject().dump());
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
    w->Send(200, http::kJsonContentType, body.dump());
    return;
  }
  if (!details) {
    nlohmann::json body =
        nlohmann::json::parse(ApiErrorJson(ApiErrorFromStatus(absl::UnavailableError("no healthy decode worker"))));
    body["status"] = "unavailable";
    w->Send(503, http::kJsonContentType, body.dump(), {{"Retry-After", "1"}});
    return;
  }
  ApiError e = ApiErrorFromStatus(
      absl::UnavailableError(absl::StrFormat("no healthy decode worker (%d in the pool)", total[d])));
  nlohmann::json body = nlohmann::json::parse(ApiErrorJson(e));
  body["status"] = "unavailable";
  body["pools"] = pools;
  w->Send(503, http::kJsonContentType, body.dump(), {{"Retry-After", "1"}});
}

void Router::Impl::HandleMetrics(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  w->Send(200, kPrometheusTextContentType, registry_.Render());
}

void Router::Impl::HandleTokenize(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  auto fail = [&](const absl::Status& s) { errors_.Send("tokenize", id, *w, s); };
  absl::StatusOr<TokenizeRequest> parsed = ParseTokenizeRequest(req.body);
  if (!parsed.ok()) return fail(parsed.status());
  std::shared_ptr<const RouterConfig> cfg = config();
  if (parsed->model.has_value() && *parsed->model != cfg->model.served_name) {
    return fail(UnknownModelError(*parsed->model));
  }
  // Bounded before any work: the answer (ids, and token_strs) grows with the
  // text, so the text (of which the body is an upper bound, up to its JSON
  // escapes) is bounded by what the model could take.
  const std::shared_ptr<RoutingState> rs = placer_.Routing();
  if (rs != nullptr && rs->max_context > 0) {
    const std::string_view text =
        parsed->prompt.has_value() ? std::string_view(*parsed->prompt) : std::string_view(req.body);
    if (static_cast<int64_t>(text.size()) > rs->max_context * kTokenizeBytesPerContextToken) {
      metrics_.refusals.WithLabels({"tokenize_too_large"}).Inc();
      return fail(InvalidRequest(parsed->prompt.has_value() ? "prompt" : "messages",
                                 absl::StrFormat("the text is %d bytes, more than %d x this model's context of %d "
                                                 "tokens could hold",
                                                 text.size(), kTokenizeBytesPerContextToken, rs->max_context)));
    }
  }
  std::vector<int32_t> tokens;
  if (parsed->prompt.has_value()) {
    tokens = assets_->tokenizer->Encode(*parsed->prompt, parsed->add_special_tokens.value_or(true));
  } else {
    absl::StatusOr<std::vector<int32_t>> prompt = ChatPrompt(*parsed->chat, parsed->add_special_tokens.value_or(false));
    if (!prompt.ok()) return fail(prompt.status());
    tokens = *std::move(prompt);
  }
  const bool strs = parsed->return_token_strs;
  // Written straight into one string: a JSON tree of the ids and strings
  // costs tens of bytes per token more.
  std::string out = "{\"tokens\":[";
  out.reserve(tokens.size() * (strs ? 16 : 7) + 64);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) out.push_back(',');
    absl::StrAppend(&out, tokens[i]);
  }
  absl::StrAppend(&out, "],\"count\":", tokens.size());
  if (rs != nullptr) absl::StrAppend(&out, ",\"max_model_len\":", rs->max_context);
  if (strs) {
    out += ",\"token_strs\":[";
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out.push_back(',');
      out += nlohmann::json(assets_->tokenizer->IdToToken(tokens[i]).value_or(""))
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    out.push_back(']');
  }
  out.push_back('}');
  w->Send(200, http::kJsonContentType, std::move(out), {{"x-request-id", id}});
}

void Router::Impl::HandleDetokenize(const http::Request& req, std::shared_ptr<http::ResponseWriter> w) {
  const std::string id = RequestId(req);
  auto fail = [&](const absl::Status& s) { errors_.Send("detokenize", id, *w, s); };
  absl::StatusOr<DetokenizeRequest> parsed = ParseDetokenizeRequest(req.body);
  if (!parsed.ok()) return fail(parsed.status());
  if (parsed->model.has_value() && *parsed->model != config()->model.served_name) {
    return fail(UnknownModelError(*parsed->model));
  }
  std::vector<int32_t> tokens;
  tokens.reserve(parsed->tokens.size());
  const int vocab = assets_->tokenizer->vocab_size();
  for (size_t i = 0; i < parsed->tokens.size(); ++i) {
    if (parsed->tokens[i] < 0 || parsed->tokens[i] >= vocab) {
      return fail(InvalidRequest(absl::StrFormat("tokens[%d]", i),
                                 absl::StrFormat("token ids must be integers in [0, %d)", vocab)));
    }
    tokens.push_back(static_cast<int32_t>(parsed->tokens[i]));
  }
  nlohmann::json out = {{"prompt", assets_->tokenizer->Decode(tokens, /*skip_special_tokens=*/false)}};
  w->Send(200, http::kJsonContentType, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
          {{"x-request-id", id}});
}

}  // namespace tandem::router
