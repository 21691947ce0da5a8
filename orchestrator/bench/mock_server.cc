#include "orchestrator/bench/mock_server.h"

#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "orchestrator/http/http_server.h"
#include "orchestrator/openai/openai_api.h"
#include "worker/cli/commands.h"

namespace tandem::bench {
namespace {

using router::FinishReason;

constexpr char kToken[] = " tok";  // every generated token's text

struct MockServerOptions {
  std::string host = "127.0.0.1";  // numeric address to bind
  int port = 8001;                 // 0: the OS picks one
  int threads = 2;                 // HTTP I/O threads
  std::string model = "mock";      // the one model served
  std::string ready_file;          // gets http://host:port once listening
};

// The mock's token count of a text: its whitespace-separated words.
int64_t CountWords(std::string_view text) {
  int64_t n = 0;
  bool in_word = false;
  for (char c : text) {
    const bool space = absl::ascii_isspace(static_cast<unsigned char>(c));
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}

class MockServer {
 public:
  explicit MockServer(const MockServerOptions& options)
      : model_(options.model),
        models_body_(nlohmann::json{
            {"object", "list"},
            {"data", nlohmann::json::array(
                         {{{"id", options.model}, {"object", "model"}, {"created", Now()}, {"owned_by", "tandem"}}})}}
                         .dump()),
        http_(http::HttpServer::Options{.host = options.host, .port = options.port, .threads = options.threads}) {
    http_.Route("GET", "/health", [](const http::Request&, std::shared_ptr<http::ResponseWriter> w) {
      w->Send(200, http::kJsonContentType, R"({"status":"ok"})");
    });
    http_.Route("GET", "/v1/models", [this](const http::Request&, std::shared_ptr<http::ResponseWriter> w) {
      w->Send(200, http::kJsonContentType, models_body_);
    });
    http_.Route("POST", "/v1/completions",
                [this](const http::Request& r, std::shared_ptr<http::ResponseWriter> w) { HandleCompletion(r, *w); });
    http_.Route("POST", "/v1/chat/completions",
                [this](const http::Request& r, std::shared_ptr<http::ResponseWriter> w) { HandleChat(r, *w); });
  }

  absl::Status Start() { return http_.Start(); }
  int port() const { return http_.port(); }
  void Stop() { http_.Stop(); }

 private:
  static int64_t Now() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  static void SendError(http::ResponseWriter& w, const absl::Status& status) {
    const router::ApiError e = router::ApiErrorFromStatus(status);
    w.Send(e.http_status, http::kJsonContentType, router::ApiErrorJson(e));
  }

  void HandleCompletion(const http::Request& req, http::ResponseWriter& w) {
    absl::StatusOr<router::CompletionRequest> parsed = router::ParseCompletionRequest(req.body);
    if (!parsed.ok()) return SendError(w, parsed.status());
    const int64_t prompt_tokens = std::holds_alternative<std::string>(parsed->prompt)
                                      ? CountWords(std::get<std::string>(parsed->prompt))
                                      : static_cast<int64_t>(std::get<std::vector<int32_t>>(parsed->prompt).size());
    Answer(/*chat=*/false, parsed->model, parsed->sampling, prompt_tokens, w);
  }

  void HandleChat(const http::Request& req, http::ResponseWriter& w) {
    absl::StatusOr<router::ChatCompletionRequest> parsed = router::ParseChatCompletionRequest(req.body);
    if (!parsed.ok()) return SendError(w, parsed.status());
    int64_t prompt_tokens = 0;
    for (const router::ChatMessage& m : parsed->messages) prompt_tokens += CountWords(m.content);
    Answer(/*chat=*/true, parsed->model, parsed->sampling, prompt_tokens, w);
  }

  // The whole answer of a parsed request, at once.
  void Answer(bool chat, const std::string& model, const router::SamplingFields& s, int64_t prompt_tokens,
              http::ResponseWriter& w) {
    if (model != model_) return SendError(w, router::UnknownModelError(model));
    const int64_t max_tokens = s.max_tokens.value_or(router::kDefaultCompletionMaxTokens);
    const int n = static_cast<int>(s.n);
    if (max_tokens * n > kMaxMockOutputTokens) {
      return SendError(
          w, router::InvalidRequest("max_tokens", absl::StrFormat("the mock server answers at most %d tokens per "
                                                                  "request (max_tokens x n), got %d x %d",
                                                                  kMaxMockOutputTokens, max_tokens, n)));
    }
    router::ResponseHeader h;
    h.id = absl::StrCat(chat ? "chatcmpl-mock-" : "cmpl-mock-", next_id_.fetch_add(1, std::memory_order_relaxed));
    h.created = Now();
    h.model = model;
    const router::Usage usage{.prompt_tokens = prompt_tokens, .completion_tokens = max_tokens * n};

    if (!s.stream) {
      std::string text;
      text.reserve(max_tokens * (sizeof kToken - 1));
      for (int64_t t = 0; t < max_tokens; ++t) text += kToken;
      std::string body;
      if (chat) {
        std::vector<router::ChatChoice> choices(n);
        for (int i = 0; i < n; ++i) {
          choices[i] = {.index = i, .content = text, .finish_reason = FinishReason::kLength};
        }
        body = router::ChatCompletionJson(h, choices, usage);
      } else {
        std::vector<router::CompletionChoice> choices(n);
        for (int i = 0; i < n; ++i) {
          choices[i] = {.index = i, .text = text, .finish_reason = FinishReason::kLength};
        }
        body = router::CompletionJson(h, choices, usage);
      }
      w.Send(200, http::kJsonContentType, std::move(body));
      return;
    }

    h.include_usage = s.include_usage;
    auto event = [&](int index, bool first, bool last) {
      const std::optional<FinishReason> finish =
          last ? std::optional<FinishReason>(FinishReason::kLength) : std::nullopt;
      if (chat) {
        return router::ChatChunk(h, {.index = index, .first = first, .content = kToken, .finish_reason = finish});
      }
      return router::CompletionChunk(h, {.index = index, .text = kToken, .finish_reason = finish});
    };
    // A choice's events between its first (chat's carries the role) and its
    // last (finish_reason) are the same bytes: rendered once.
    std::vector<std::string> middle(n);
    for (int i = 0; i < n; ++i) middle[i] = event(i, false, false);
    w.StartStream(200);
    for (int64_t t = 0; t < max_tokens; ++t) {
      const bool first = t == 0, last = t + 1 == max_tokens;
      for (int i = 0; i < n; ++i) w.Write(first || last ? event(i, first, last) : middle[i]);
    }
    if (s.include_usage) w.Write(router::UsageChunk(h, usage, chat));
    w.Write(router::DoneChunk());
    w.End();
  }

  const std::string model_;
  const std::string models_body_;  // GET /v1/models, rendered once
  std::atomic<uint64_t> next_id_{0};
  http::HttpServer http_;  // last: stopped (and its threads joined) before the rest goes
};

absl::Status RunMockServer(const MockServerOptions& opt) {
  if (opt.threads < 1) return absl::InvalidArgumentError("--threads must be at least 1");
  if (opt.model.empty()) return absl::InvalidArgumentError("--model must not be empty");
  RETURN_IF_ERROR(InstallSignalHandlers({SIGINT, SIGTERM}));
  MockServer server(opt);
  RETURN_IF_ERROR(server.Start());
  const std::string url = http::BaseUrl(opt.host, server.port());
  LOG(INFO) << "mock-server: serving model '" << opt.model << "' on " << url << " (" << opt.threads << " threads)";
  if (!opt.ready_file.empty()) RETURN_IF_ERROR(WriteFileAtomically(opt.ready_file, url + "\n"));
  const int sig = WaitForSignal();
  LOG(INFO) << "mock-server: signal " << sig << ", stopping";
  server.Stop();
  return absl::OkStatus();
}

}  // namespace

void AddMockServerCommand(CLI::App& bench) {
  auto opt = std::make_shared<MockServerOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "mock-server", "An instant OpenAI-compatible server (no model): the baseline for proxy overhead");
  cmd->add_option("--host", opt->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", opt->port, "Port (0: pick a free one)")->check(CLI::Range(0, 65535))->capture_default_str();
  cmd->add_option("--threads", opt->threads, "HTTP I/O threads")->capture_default_str();
  cmd->add_option("--model", opt->model, "The model name served")->capture_default_str();
  cmd->add_option("--ready-file", opt->ready_file, "Write http://host:port here once listening");
  cmd->callback([opt] { worker::ExitWithStatus("bench mock-server", RunMockServer(*opt)); });
}

}  // namespace tandem::bench
