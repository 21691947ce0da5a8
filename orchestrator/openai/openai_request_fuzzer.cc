// libFuzzer target: an HTTP body as POST /v1/chat/completions and
// POST /v1/completions receive it. Each input goes through both parsers;
// what they accept is written back as the router would answer (response
// bodies and SSE chunks echoing the request's text), what they refuse as
// OpenAI's error JSON. Every JSON document written must parse again as valid
// UTF-8 JSON (a client would choke on anything else): the target aborts if not.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "orchestrator/openai/openai_api.h"
#include "rapidjson/document.h"

namespace tandem::router {
namespace {

void CheckJson(std::string_view text) {
  if (text.starts_with("data: ")) {
    text.remove_prefix(6);
    if (!text.ends_with("\n\n")) {
      std::fprintf(stderr, "SSE event without its blank line: %.*s\n", static_cast<int>(text.size()), text.data());
      std::abort();
    }
    text.remove_suffix(2);
    if (text == "[DONE]") return;
  }
  rapidjson::Document doc;
  doc.Parse<rapidjson::kParseIterativeFlag | rapidjson::kParseValidateEncodingFlag>(text.data(), text.size());
  if (doc.HasParseError()) {
    std::fprintf(stderr, "invalid JSON written: %.*s\n", static_cast<int>(text.size()), text.data());
    std::abort();
  }
}

void CheckError(const absl::Status& status) {
  const ApiError error = ApiErrorFromStatus(status);
  if (error.http_status != 400) {
    std::fprintf(stderr, "a parse error mapped to HTTP %d: %s\n", error.http_status, status.ToString().c_str());
    std::abort();
  }
  CheckJson(ApiErrorJson(error));
  CheckJson(ErrorChunk(error));
}

// A logprobs entry per message, so that the request's bytes reach the
// logprobs writers too (token text is raw bytes there).
std::vector<TokenLogprob> LogprobsOf(const std::vector<std::string>& texts) {
  std::vector<TokenLogprob> out;
  for (size_t i = 0; i < texts.size() && i < 8; ++i) {
    TokenLogprob t{.token_id = static_cast<int32_t>(i), .token = texts[i], .logprob = -0.5 * i};
    t.top_logprobs.push_back(TopLogprob{.token_id = 1, .token = texts[i].substr(0, 3), .logprob = -1});
    out.push_back(std::move(t));
  }
  return out;
}

void Chat(std::string_view body) {
  absl::StatusOr<ChatCompletionRequest> req = ParseChatCompletionRequest(body);
  if (!req.ok()) {
    if (req.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    CheckError(req.status());
    return;
  }
  if (req->messages.empty() || req->model.empty()) std::abort();
  ResponseHeader header{.id = "chatcmpl-fuzz",
                        .created = 1,
                        .model = req->model,
                        .tokens_as_ids = req->sampling.return_tokens_as_token_ids,
                        .include_usage = req->sampling.include_usage};
  std::vector<std::string> texts;
  for (const ChatMessage& m : req->messages)
    texts.push_back(m.content + m.name.value_or("") + m.tool_call_id.value_or(""));
  texts.insert(texts.end(), req->sampling.stop.begin(), req->sampling.stop.end());
  texts.push_back(req->sampling.user);
  std::vector<ChatChoice> choices;
  for (size_t i = 0; i < texts.size() && i < 4; ++i) {
    choices.push_back(
        ChatChoice{.index = static_cast<int>(i), .content = texts[i], .finish_reason = FinishReason::kLength});
    if (req->logprobs) choices.back().logprobs = LogprobsOf(texts);
  }
  const Usage usage{.prompt_tokens = 3, .completion_tokens = 4, .cached_tokens = 1};
  CheckJson(ChatCompletionJson(header, choices, usage));
  CheckJson(ChatLogprobsJson(LogprobsOf(texts), header.tokens_as_ids));
  ChatDelta delta{.index = 0, .first = true, .content = texts.front()};
  if (req->logprobs) delta.logprobs = LogprobsOf(texts);
  delta.finish_reason = FinishReason::kStop;
  CheckJson(ChatChunk(header, delta));
  CheckJson(UsageChunk(header, usage, /*chat=*/true));
}

void Completion(std::string_view body) {
  absl::StatusOr<CompletionRequest> req = ParseCompletionRequest(body);
  if (!req.ok()) {
    if (req.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    CheckError(req.status());
    return;
  }
  std::vector<std::string> texts;
  if (const auto* text = std::get_if<std::string>(&req->prompt)) {
    if (text->empty()) std::abort();
    texts.push_back(*text);
  } else if (std::get<std::vector<int32_t>>(req->prompt).empty()) {
    std::abort();
  } else {
    texts.push_back("ids");
  }
  texts.insert(texts.end(), req->sampling.stop.begin(), req->sampling.stop.end());
  ResponseHeader header{.id = "cmpl-fuzz",
                        .created = 1,
                        .model = req->model,
                        .tokens_as_ids = req->sampling.return_tokens_as_token_ids,
                        .include_usage = req->sampling.include_usage};
  std::vector<CompletionChoice> choices;
  choices.push_back(CompletionChoice{.index = 0, .text = texts.front(), .finish_reason = FinishReason::kAbort});
  if (req->logprobs.has_value()) {
    choices.back().logprobs = LogprobsOf(texts);
    choices.back().text_offset_base = req->echo ? static_cast<int64_t>(texts.front().size()) : 0;
  }
  CheckJson(CompletionJson(header, choices, Usage{}));
  CompletionDelta delta{.index = 0, .text = texts.front()};
  if (req->logprobs.has_value()) delta.logprobs = LogprobsOf(texts);
  CheckJson(CompletionChunk(header, delta));
  CheckJson(UsageChunk(header, Usage{}, /*chat=*/false));
}

}  // namespace
}  // namespace tandem::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  tandem::router::Chat(body);
  tandem::router::Completion(body);
  return 0;
}
