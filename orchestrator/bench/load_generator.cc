#include "orchestrator/bench/load_generator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string_view>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

template <typename T>
using Task = asio::awaitable<T>;

// What one streamed request produced.
struct Exchange {
  int status = 0;
  std::string worker;   // the x-tandem-decode-worker header (tandem's router), if any
  std::string error;    // transport or server error
  std::string content;  // the streamed text (chat: the answer, kept for the history)
  std::vector<Clock::time_point> token_times;
  std::optional<json> usage;
  Clock::time_point done;
};

// Splits an SSE stream into "data:" payloads as bytes arrive.
class SseReader {
 public:
  // Feeds bytes; calls `on_data` for each complete event's data.
  template <typename F>
  void Feed(absl::string_view bytes, F&& on_data) {
    pending_.append(bytes.data(), bytes.size());
    size_t start = 0;
    while (true) {
      size_t end = pending_.find("\n\n", start);
      size_t sep = 2;
      const size_t crlf = pending_.find("\r\n\r\n", start);
      if (crlf != std::string::npos && (end == std::string::npos || crlf < end)) {
        end = crlf;
        sep = 4;
      }
      if (end == std::string::npos) break;
      absl::string_view event(pending_.data() + start, end - start);
      std::string data;
      for (absl::string_view line : absl::StrSplit(event, '\n')) {
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (absl::ConsumePrefix(&line, "data:")) {
          absl::ConsumePrefix(&line, " ");
          if (!data.empty()) data += '\n';
          data.append(line.data(), line.size());
        }
      }
      if (!data.empty()) on_data(data);
      start = end + sep;
    }
    pending_.erase(0, start);
  }

 private:
  std::string pending_;
};

// The error text of a non-2xx body (OpenAI's error.message when present).
std::string ErrorText(int status, const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return absl::StrCat("HTTP ", status, ": ", j["error"]["message"].get<std::string>());
  }
  return absl::StrCat("HTTP ", status, ": ", body.substr(0, 200));
}

// Idle keep-alive connections to the server, on the client thread only.
class ConnectionPool {
 public:
  ConnectionPool(tcp::resolver::results_type endpoints, bool keep_alive)
      : endpoints_(std::move(endpoints)), keep_alive_(keep_alive) {}

  // An idle connection (*reused = true) or a new one; ec on connect failure.
  // `fresh`: a new one whatever is idle.
  Task<std::unique_ptr<beast::tcp_stream>> Get(std::chrono::seconds timeout, bool* reused, beast::error_code& ec,
                                               bool fresh = false) {
    *reused = !fresh && !idle_.empty();
    std::unique_ptr<beast::tcp_stream> stream;
    if (*reused) {
      stream = std::move(idle_.back());
      idle_.pop_back();
    } else {
      stream = std::make_unique<beast::tcp_stream>(co_await asio::this_coro::executor);
      stream->expires_after(timeout);
      co_await stream->async_connect(endpoints_, asio::redirect_error(asio::use_awaitable, ec));
      if (!ec) stream->socket().set_option(tcp::no_delay(true), ec);
    }
    stream->expires_after(timeout);
    co_return stream;
  }

  // Keeps a connection whose response ended cleanly; closes it otherwise.
  void Put(std::unique_ptr<beast::tcp_stream> stream, bool reusable) {
    if (keep_alive_ && reusable) {
      stream->expires_never();
      idle_.push_back(std::move(stream));
      return;
    }
    beast::error_code ignored;
    stream->socket().shutdown(tcp::socket::shutdown_both, ignored);
  }

 private:
  const tcp::resolver::results_type endpoints_;
  const bool keep_alive_;
  std::vector<std::unique_ptr<beast::tcp_stream>> idle_;
};

// POSTs `body` to `target` and reads the SSE stream.
Task<Exchange> StreamPost(ConnectionPool& pool, const std::string& host, const std::string& target, std::string body,
                          std::vector<std::pair<std::string, std::string>> headers, bool chat,
                          std::chrono::seconds timeout) {
  Exchange ex;
  beast::error_code ec;
  http::request<http::string_body> req{http::verb::post, target, 11};
  req.set(http::field::host, host);
  req.set(http::field::content_type, "application/json");
  req.set(http::field::accept, "text/event-stream");
  for (const auto& [k, v] : headers) req.set(k, v);
  req.body() = std::move(body);
  req.prepare_payload();
  std::unique_ptr<beast::tcp_stream> stream;
  beast::flat_buffer buffer;
  std::optional<http::response_parser<http::buffer_body>> parser;
  // A failure before the response's body: the connection is not kept.
  auto failed = [&](const char* what) {
    ex.error = absl::StrCat(what, ": ", ec.message());
    ex.done = Clock::now();
    if (stream) pool.Put(std::move(stream), false);
    return std::move(ex);
  };
  // A reused connection the server closed while idle fails before any
  // response byte: that request goes again, once, on a new connection (not
  // another idle one: after a lull the server may have closed them all, and
  // the pool, last in first out, keeps its least used at the bottom).
  for (bool retry = true;; retry = false) {
    ec = {};
    bool reused = false;
    stream = co_await pool.Get(timeout, &reused, ec, /*fresh=*/!retry);
    if (ec) co_return failed("connect");
    co_await http::async_write(*stream, req, asio::redirect_error(asio::use_awaitable, ec));
    if (ec && reused && retry) {
      pool.Put(std::move(stream), false);
      continue;
    }
    if (ec) co_return failed("write");
    buffer.clear();
    parser.emplace();
    // Not boost::none: Boost 1.74 compares a Content-Length against the empty
    // optional as "over the limit".
    parser->body_limit(std::numeric_limits<std::uint64_t>::max());
    co_await http::async_read_header(*stream, buffer, *parser, asio::redirect_error(asio::use_awaitable, ec));
    if (ec && reused && retry && !parser->got_some()) {
      pool.Put(std::move(stream), false);
      continue;
    }
    break;
  }
  if (ec) co_return failed("read");
  ex.status = parser->get().result_int();
  if (auto it = parser->get().find("x-tandem-decode-worker"); it != parser->get().end()) {
    ex.worker = std::string(it->value());
  }
  std::string error_body;
  SseReader sse;
  char chunk[16384];
  while (!parser->is_done()) {
    parser->get().body().data = chunk;
    parser->get().body().size = sizeof chunk;
    // read_some: hand each arrival over as it comes (async_read would wait
    // for the buffer to fill).
    co_await http::async_read_some(*stream, buffer, *parser, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == http::error::need_buffer) ec = {};
    const size_t n = sizeof chunk - parser->get().body().size;
    const Clock::time_point now = Clock::now();
    if (ex.status != 200) {
      error_body.append(chunk, n);
    } else if (n > 0) {
      sse.Feed(absl::string_view(chunk, n), [&](const std::string& data) {
        if (data == "[DONE]") return;
        json e = json::parse(data, nullptr, false);
        if (e.is_discarded()) {
          ex.error = "unparsable SSE event";
          return;
        }
        if (e.contains("error")) {
          ex.error = ErrorText(ex.status, data);
          return;
        }
        if (e.contains("usage") && e["usage"].is_object()) ex.usage = e["usage"];
        if (!e.contains("choices") || !e["choices"].is_array() || e["choices"].empty()) return;
        const json& c = e["choices"][0];
        const json* piece = nullptr;
        if (chat) {
          if (c.contains("delta") && c["delta"].contains("content")) piece = &c["delta"]["content"];
        } else if (c.contains("text")) {
          piece = &c["text"];
        }
        if (piece != nullptr && piece->is_string() && !piece->get_ref<const std::string&>().empty()) {
          ex.content += piece->get_ref<const std::string&>();
          ex.token_times.push_back(now);
        }
      });
    }
    if (ec) {
      ex.error = absl::StrCat("read: ", ec.message());
      break;
    }
  }
  ex.done = Clock::now();
  if (ex.status != 200 && ex.error.empty()) ex.error = ErrorText(ex.status, error_body);
  pool.Put(std::move(stream), !ec && parser->is_done() && parser->get().keep_alive());
  co_return ex;
}

// The shared state of a run, on the client thread only.
struct Run {
  const LoadOptions& options;
  const std::vector<Session>& sessions;
  const Tokenizer& tokenizer;
  ConnectionPool& pool;
  std::string host;
  std::string model;
  Clock::time_point t0;
  std::vector<RequestRecord> records;  // per turn, in session order
  std::vector<size_t> first_record;    // index of each session's first turn
  int in_flight = 0;
  std::deque<std::shared_ptr<asio::steady_timer>> waiting;  // for a concurrency slot
  int done = 0;
  int total = 0;

  double Since(Clock::time_point t) const { return std::chrono::duration<double>(t - t0).count(); }

  Task<void> AcquireSlot() {
    if (options.max_concurrency <= 0 || in_flight < options.max_concurrency) {
      ++in_flight;
      co_return;
    }
    auto wake = std::make_shared<asio::steady_timer>(co_await asio::this_coro::executor, Clock::time_point::max());
    waiting.push_back(wake);
    beast::error_code ec;
    co_await wake->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    // The releaser handed its slot over (in_flight unchanged).
  }
  void ReleaseSlot() {
    if (!waiting.empty()) {
      waiting.front()->cancel();
      waiting.pop_front();
      return;
    }
    --in_flight;
  }

  // The server's answer to an earlier turn: its text (chat history) and its
  // token ids (completions history, prompt length), encoded once.
  struct Answer {
    std::string text;
    std::vector<int32_t> ids;
  };

  std::string Body(const Session& s, size_t turn, const std::vector<Answer>& answers) const {
    const Turn& t = s.turns[turn];
    json body = {{"model", model},
                 {"max_tokens", t.max_tokens},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}},
                 {"temperature", 0}};
    if (options.ignore_eos) body["ignore_eos"] = true;
    if (options.endpoint == "chat") {
      json messages = json::array();
      if (!s.system.empty()) {
        messages.push_back({{"role", "system"}, {"content", tokenizer.Decode(s.system, true)}});
      }
      for (size_t k = 0; k <= turn; ++k) {
        messages.push_back({{"role", "user"}, {"content", tokenizer.Decode(s.turns[k].tokens, true)}});
        if (k < turn) messages.push_back({{"role", "assistant"}, {"content", answers[k].text}});
      }
      body["messages"] = std::move(messages);
    } else {
      // Completions carry the history as one prompt: system, then each turn
      // and the answer to it.
      std::vector<int32_t> prompt = s.system;
      for (size_t k = 0; k <= turn; ++k) {
        prompt.insert(prompt.end(), s.turns[k].tokens.begin(), s.turns[k].tokens.end());
        if (k < turn) prompt.insert(prompt.end(), answers[k].ids.begin(), answers[k].ids.end());
      }
      if (options.prompt_as_text) {
        body["prompt"] = tokenizer.Decode(prompt, true);
      } else {
        body["prompt"] = prompt;
      }
    }
    return body.dump();
  }

  int64_t PromptTokens(const Session& s, size_t turn, const std::vector<Answer>& answers) const {
    int64_t n = static_cast<int64_t>(s.system.size());
    for (size_t k = 0; k <= turn; ++k) n += static_cast<int64_t>(s.turns[k].tokens.size());
    for (size_t k = 0; k < turn; ++k) n += static_cast<int64_t>(answers[k].ids.size());
    return n;
  }

  std::vector<std::pair<std::string, std::string>> Headers(const Session& s) const {
    if (s.id.empty() || options.session_header.empty()) return {};
    return {{options.session_header, s.id}};
  }

  std::string Target() const { return options.endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions"; }

  // Runs one session's turns in order, recording each.
  Task<void> RunSession(size_t index) {
    const Session& s = sessions[index];
    std::vector<Answer> answers;
    bool failed = false;
    for (size_t turn = 0; turn < s.turns.size(); ++turn) {
      RequestRecord& rec = records[first_record[index] + turn];
      rec.session = static_cast<int64_t>(index);
      rec.turn = static_cast<int>(turn);
      if (failed) {
        rec.ok = false;
        rec.error = "an earlier turn of the session failed";
        rec.sent_s = rec.done_s = Since(Clock::now());
      } else {
        co_await AcquireSlot();
        const std::string body = Body(s, turn, answers);
        rec.prompt_tokens = PromptTokens(s, turn, answers);
        const Clock::time_point sent = Clock::now();
        Exchange ex = co_await StreamPost(pool, host, Target(), body, Headers(s), options.endpoint == "chat",
                                          options.request_timeout);
        ReleaseSlot();
        rec.sent_s = Since(sent);
        rec.done_s = Since(ex.done);
        rec.ok = ex.status == 200 && ex.error.empty();
        rec.error = ex.error;
        rec.worker = std::move(ex.worker);
        for (const Clock::time_point& t : ex.token_times) rec.token_times_s.push_back(Since(t));
        if (!rec.token_times_s.empty()) rec.first_token_s = rec.token_times_s.front();
        rec.output_tokens = static_cast<int64_t>(ex.token_times.size());
        if (ex.usage.has_value()) {
          const json& u = *ex.usage;
          if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) {
            rec.prompt_tokens = u["prompt_tokens"].get<int64_t>();
          }
          if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer()) {
            rec.output_tokens = u["completion_tokens"].get<int64_t>();
          }
          if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
              u["prompt_tokens_details"].contains("cached_tokens") &&
              u["prompt_tokens_details"]["cached_tokens"].is_number_integer()) {
            rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
          }
        }
        failed = !rec.ok;
        if (!failed && turn + 1 < s.turns.size()) {
          std::vector<int32_t> ids = tokenizer.Encode(ex.content, false);
          answers.push_back(Answer{std::move(ex.content), std::move(ids)});
        }
      }
      ++done;
      if (options.progress) options.progress(done, total);
    }
  }
};

// Intervals between session starts: gamma(shape = burstiness, mean = 1 / rate).
std::vector<double> StartTimes(const LoadOptions& o, const std::vector<Session>& sessions) {
  std::vector<double> at(sessions.size(), 0.0);
  std::mt19937_64 rng(o.seed ^ 0xB0057ull);
  const bool finite = std::isfinite(o.request_rate);
  std::gamma_distribution<double> gap(o.burstiness, finite ? 1.0 / (o.request_rate * o.burstiness) : 1.0);
  double t = 0;
  for (size_t i = 0; i < sessions.size(); ++i) {
    if (sessions[i].arrival_s >= 0) {
      at[i] = sessions[i].arrival_s;
      continue;
    }
    at[i] = finite ? t : 0.0;
    if (finite) t += gap(rng);
  }
  return at;
}

}  // namespace

absl::StatusOr<Endpoint> ParseUrl(const std::string& url) {
  absl::string_view rest = url;
  if (absl::StartsWith(rest, "https://")) {
    return absl::InvalidArgumentError("--url: https is not supported; use http://host:port");
  }
  absl::ConsumePrefix(&rest, "http://");
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  if (rest.empty() || rest.find('/') != absl::string_view::npos || colon == absl::string_view::npos ||
      colon + 1 == rest.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("--url must be http://host:port, got '%s'", url));
  }
  Endpoint ep{.host = std::string(rest.substr(0, colon)), .port = std::string(rest.substr(colon + 1))};
  int port = 0;
  if (!absl::SimpleAtoi(ep.port, &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat("--url: bad port in '%s'", url));
  }
  if (absl::StartsWith(ep.host, "[") && absl::EndsWith(ep.host, "]")) {
    ep.host = ep.host.substr(1, ep.host.size() - 2);
  }
  return ep;
}

SimpleResponse HttpGetOnce(const Endpoint& ep, const std::string& target, std::chrono::seconds timeout) {
  SimpleResponse out;
  try {
    asio::io_context io;
    tcp::resolver resolver(io);
    beast::tcp_stream stream(io);
    stream.expires_after(timeout);
    stream.connect(resolver.resolve(ep.host, ep.port));
    http::request<http::empty_body> req{http::verb::get, target, 11};
    req.set(http::field::host, ep.host);
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    out.status = res.result_int();
    out.body = std::move(res.body());
  } catch (const std::exception& e) {
    out.status = 0;
    out.body = e.what();
  }
  return out;
}

std::map<std::string, double> ParseCounters(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    const std::string name(series.substr(0, brace));
    double v = 0;
    if (absl::SimpleAtod(line.substr(space + 1), &v)) out[name] += v;
  }
  return out;
}

absl::StatusOr<std::string> ResolveModel(const LoadOptions& options) {
  if (!options.model.empty()) return options.model;
  ASSIGN_OR_RETURN(const Endpoint ep, ParseUrl(options.url));
  const SimpleResponse r = HttpGetOnce(ep, "/v1/models");
  if (r.status != 200) {
    return absl::UnavailableError(
        absl::StrFormat("GET %s/v1/models: %s", options.url, r.status == 0 ? r.body : ErrorText(r.status, r.body)));
  }
  const json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string()) {
    return absl::UnavailableError(absl::StrCat("GET /v1/models listed no model: ", r.body));
  }
  return j["data"][0]["id"].get<std::string>();
}

absl::StatusOr<std::vector<RequestRecord>> RunLoad(const LoadOptions& options, const std::vector<Session>& sessions,
                                                   const Tokenizer& tokenizer) {
  if (options.endpoint != "chat" && options.endpoint != "completions") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--endpoint must be chat or completions, got '%s'", options.endpoint));
  }
  if (!(options.request_rate > 0)) return absl::InvalidArgumentError("--request-rate must be > 0");
  if (!(options.burstiness > 0)) return absl::InvalidArgumentError("--burstiness must be > 0");
  if (options.max_concurrency < 0) return absl::InvalidArgumentError("--max-concurrency must be >= 0");
  ASSIGN_OR_RETURN(const Endpoint ep, ParseUrl(options.url));
  ASSIGN_OR_RETURN(const std::string model, ResolveModel(options));

  asio::io_context io(1);
  tcp::resolver resolver(io);
  beast::error_code ec;
  tcp::resolver::results_type endpoints = resolver.resolve(ep.host, ep.port, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("resolving ", ep.host, ": ", ec.message()));

  ConnectionPool pool(endpoints, options.keep_alive);
  Run run{
      .options = options, .sessions = sessions, .tokenizer = tokenizer, .pool = pool, .host = ep.host, .model = model};
  for (const Session& s : sessions) {
    run.first_record.push_back(run.records.size());
    run.records.resize(run.records.size() + s.turns.size());
  }
  run.total = static_cast<int>(run.records.size());

  // Warm-up: the first sessions' first turns, not recorded.
  if (options.num_warmups > 0 && !sessions.empty()) {
    std::vector<Session> warm;
    for (int i = 0; i < options.num_warmups; ++i) {
      Session s = sessions[i % sessions.size()];
      s.turns.resize(1);
      s.id.clear();
      warm.push_back(std::move(s));
    }
    LoadOptions wo = options;
    wo.num_warmups = 0;
    wo.request_rate = std::numeric_limits<double>::infinity();
    wo.progress = nullptr;
    wo.model = model;
    for (Session& s : warm) s.arrival_s = -1;
    ASSIGN_OR_RETURN(std::vector<RequestRecord> ignored, RunLoad(wo, warm, tokenizer));
  }

  const std::vector<double> start = StartTimes(options, sessions);
  run.t0 = Clock::now();
  for (size_t i = 0; i < sessions.size(); ++i) {
    asio::co_spawn(
        io,
        [&run, i, at = start[i]]() -> Task<void> {
          if (at > 0) {
            asio::steady_timer timer(
                co_await asio::this_coro::executor,
                run.t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at)));
            beast::error_code ignored;
            co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
          }
          co_await run.RunSession(i);
        },
        asio::detached);
  }
  io.run();
  return std::move(run.records);
}

}  // namespace tandem::bench
