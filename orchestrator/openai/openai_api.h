// The OpenAI-compatible API's wire shapes, without networking: typed requests
// for POST /v1/chat/completions and POST /v1/completions parsed from a JSON
// body, OpenAI's error JSON, and the response bodies and SSE chunks the router
// sends back. The HTTP layer owns sockets, model lookup and ids; this file only
// converts between bytes and typed values.
//
// Contract (requests): Parse*Request returns a request whose every field has
// been type- and range-checked, or an absl::Status whose canonical code is
// kInvalidArgument (HTTP 400) and which carries the JSON path of the offending
// field ("temperature", "messages[2].content[0].type") as a payload. Errors
// stay absl::Status so that they pass through Status-returning code unchanged
// (STYLE "Errors"); only ApiErrorFromStatus, at the HTTP edge, maps a Status to
// an ApiError with its HTTP status, OpenAI error type, param and code.
//   - Malformed JSON: the message names the byte offset and RapidJSON's reason.
//   - `null` for any optional field means "absent" (OpenAI SDKs send nulls).
//   - A field this server does not implement ("tools", "logit_bias",
//     "response_format", "messages[1].tool_calls", ...) is a 400 naming it,
//     never silently ignored; only a value that means the same as absent
//     (null, [] or {}) is let through.
//   - The body may nest at most kMaxJsonDepth levels (checked on the bytes,
//     before any parsing): nothing downstream recurses deeper than that.
//   - Chat: `add_generation_prompt` (default true) and `chat_template_kwargs`
//     (an object of extra template variables, vLLM's extensions). A kwarg
//     that names a variable the server owns (kServerTemplateVariables) is a
//     400 naming it.
//   - Integer fields accept integral JSON numbers (16, 16.0, 1.6e1) and reject
//     fractional ones (1.5) with "'max_tokens' must be an integer".
//   - Ranges follow OpenAI and vLLM: temperature [0,2], top_p (0,1], top_k -1
//     or >= 1 (0 also means off; both are stored as -1), min_p [0,1],
//     presence/frequency penalty [-2,2], repetition_penalty > 0, n [1,128],
//     max_tokens >= 1, min_tokens >= 0, seed any int64, top_logprobs [0,20]
//     (> 0 requires logprobs=true, as vLLM), completions logprobs [0,5].
//   - stop: a string or a list of up to kMaxStopSequences non-empty strings.
//     OpenAI documents 4 and vLLM has no limit; we follow vLLM (clients that
//     migrate from vLLM send more than 4) with a sanity cap of 64 that bounds
//     the per-token stop matching cost.
//   - max_tokens and max_completion_tokens may both be given; the latter wins,
//     as in vLLM (`max_completion_tokens or max_tokens`), since OpenAI
//     deprecated max_tokens in its favour. Chat has no default (the worker
//     caps at the context); completions default to 16, as OpenAI and vLLM.
//   - stream_options is only allowed with stream=true (vLLM's rule).
//   - Completions: `suffix` (non-null) is unsupported -> 400; batch prompts
//     (several strings or several token lists) are unsupported -> 400.
//   - The model name is only checked to be a non-empty string; whether it is
//     served is the router's question (UnknownModelError gives the 404).
//
// Contract (responses): the *Json functions return one compact JSON document;
// the *Chunk functions return one complete SSE event, "data: {...}\n\n".
// Strings are written as valid UTF-8: invalid sequences (a token that ends
// inside a multi-byte character) become U+FFFD, while `bytes` in logprobs
// keeps the token's raw bytes, as OpenAI does.
//
// Thread safety: every function here is pure and may be called concurrently.
#ifndef TANDEM_ORCHESTRATOR_OPENAI_OPENAI_API_H_
#define TANDEM_ORCHESTRATOR_OPENAI_OPENAI_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::router {

// ---------------------------------------------------------------------------
// Errors.

// OpenAI's error object. Serialized by ApiErrorJson as
// {"error": {"message", "type", "param", "code"}}; empty param and code are
// written as null, as OpenAI does.
struct ApiError {
  int http_status = 400;
  // "invalid_request_error", "not_found_error", "rate_limit_error",
  // "server_error", "timeout_error".
  std::string type = "invalid_request_error";
  std::string message;
  // JSON path of the offending field ("messages[0].role"), or empty.
  std::string param;
  // Machine-readable code ("model_not_found"), or empty.
  std::string code;
};

// An InvalidArgument Status that names the offending field: ApiErrorFromStatus
// turns it into a 400 with that param. The message should read on its own
// ("'temperature' must be a number").
absl::Status InvalidRequest(std::string_view param, std::string_view message);

// The 404 the router returns for a model it does not serve: NotFound with
// param "model" and code "model_not_found".
absl::Status UnknownModelError(std::string_view model);

// Maps a Status to the error the HTTP layer sends. Codes: InvalidArgument,
// OutOfRange, FailedPrecondition -> 400 invalid_request_error; NotFound -> 404
// (invalid_request_error, as OpenAI reports unknown models); ResourceExhausted
// -> 429 rate_limit_error; Unavailable -> 503 server_error; DeadlineExceeded
// -> 504 timeout_error; Unimplemented -> 501; anything else -> 500
// server_error. Param and code come from the Status payloads set by
// InvalidRequest / UnknownModelError.
// REQUIRES: !status.ok().
ApiError ApiErrorFromStatus(const absl::Status& status);

// {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
std::string ApiErrorJson(const ApiError& error);

// ---------------------------------------------------------------------------
// Requests.

inline constexpr int kMaxStopSequences = 64;
// Deepest nesting of objects and arrays a request body may have. OpenAI's
// own requests nest under 10 levels (a JSON schema in a tool a few more).
inline constexpr int kMaxJsonDepth = 64;
// Chat template variables the router sets itself (or the template's globals):
// chat_template_kwargs may not replace them.
inline constexpr std::string_view kServerTemplateVariables[] = {"messages",
                                                                "tools",
                                                                "documents",
                                                                "add_generation_prompt",
                                                                "bos_token",
                                                                "eos_token",
                                                                "raise_exception",
                                                                "strftime_now",
                                                                "range",
                                                                "namespace",
                                                                "dict"};

// InvalidArgument when `json` nests objects/arrays more than `max_depth`
// deep. Works on the raw bytes (strings and escapes skipped), so it can run
// before a parser that would recurse.
absl::Status CheckJsonDepth(std::string_view json, int max_depth = kMaxJsonDepth);

// True for a name in kServerTemplateVariables.
bool IsServerTemplateVariable(std::string_view name);
inline constexpr int kMaxN = 128;
inline constexpr int kMaxTopLogprobs = 20;
inline constexpr int kMaxCompletionLogprobs = 5;
inline constexpr int64_t kDefaultCompletionMaxTokens = 16;

// Sampling and output fields that chat and completions share. Absent optional
// fields mean "the worker's default".
struct SamplingFields {
  // max_completion_tokens if given, else max_tokens. >= 1.
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature;         // [0, 2]
  std::optional<double> top_p;               // (0, 1]
  std::optional<int64_t> top_k;              // -1 (off) or >= 1
  std::optional<double> min_p;               // [0, 1]
  std::optional<double> presence_penalty;    // [-2, 2]
  std::optional<double> frequency_penalty;   // [-2, 2]
  std::optional<double> repetition_penalty;  // > 0 (vLLM extension)
  std::optional<int64_t> seed;
  std::vector<std::string> stop;        // a single string becomes one entry
  std::vector<int64_t> stop_token_ids;  // vLLM extension, each >= 0
  int64_t n = 1;                        // [1, 128]
  std::string user;
  bool stream = false;
  bool include_usage = false;               // stream_options.include_usage
  bool ignore_eos = false;                  // vLLM extension
  int64_t min_tokens = 0;                   // vLLM extension, >= 0
  bool return_tokens_as_token_ids = false;  // vLLM extension
};

enum class Role { kSystem, kUser, kAssistant, kTool, kDeveloper };

// "system", "user", ...
std::string_view RoleName(Role role);

struct ChatMessage {
  Role role = Role::kUser;
  // A string content as is; an array of text parts joined with "\n" (vLLM's
  // "string" content format). Null content (an assistant turn that only
  // carried tool_calls) is empty.
  std::string content;
  std::optional<std::string> name;
  std::optional<std::string> tool_call_id;  // role "tool"
};

struct ChatCompletionRequest {
  std::string model;
  std::vector<ChatMessage> messages;  // non-empty
  SamplingFields sampling;
  bool logprobs = false;
  std::optional<int64_t> top_logprobs;  // [0, 20]
  bool add_generation_prompt = true;
  // The chat_template_kwargs object, converted from the body once (for the
  // template's context); an empty object when absent.
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
};

// A completion prompt: text, or token ids (for "prompt": [1, 2] and
// "prompt": [[1, 2]]).
using Prompt = std::variant<std::string, std::vector<int32_t>>;

struct CompletionRequest {
  std::string model;
  Prompt prompt;            // non-empty text or non-empty ids
  SamplingFields sampling;  // max_tokens defaults to 16
  bool echo = false;
  std::optional<int64_t> logprobs;  // [0, 5]: top-N per token
};

absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(std::string_view body);

// POST /tokenize (vLLM's): a text, or a conversation rendered as chat
// completions would render it, tokenized as the model sees it.
struct TokenizeRequest {
  std::optional<std::string> model;  // absent: the served model
  // Exactly one of the two. `chat` holds messages, add_generation_prompt and
  // chat_template_kwargs, checked as chat completions checks them.
  std::optional<std::string> prompt;
  std::optional<ChatCompletionRequest> chat;
  std::optional<bool> add_special_tokens;  // absent: true for a prompt, false for messages
  bool return_token_strs = false;
};

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(std::string_view body);

// POST /detokenize (vLLM's): token ids back to text.
struct DetokenizeRequest {
  std::optional<std::string> model;  // absent: the served model
  std::vector<int64_t> tokens;       // as sent: the caller checks them against its vocabulary
};

// InvalidArgument naming the field for anything but {"model": string,
// "tokens": [integers]} ("tokens" required).
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(std::string_view body);
absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body);

// ---------------------------------------------------------------------------
// Responses.

enum class FinishReason { kStop, kLength, kAbort };

// "stop", "length", "abort" (vLLM's value for a cancelled request).
std::string_view FinishReasonName(FinishReason reason);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Prompt tokens served from the prefix cache; written as
  // usage.prompt_tokens_details.cached_tokens.
  int64_t cached_tokens = 0;
};

struct TopLogprob {
  int32_t token_id = 0;
  std::string token;  // raw bytes of the token's text
  double logprob = 0;
};

// One sampled token with its alternatives.
struct TokenLogprob {
  int32_t token_id = 0;
  std::string token;  // raw bytes of the token's text
  double logprob = 0;
  std::vector<TopLogprob> top_logprobs;
};

// Fields every response object of one request shares.
struct ResponseHeader {
  std::string id;       // "chatcmpl-..." or "cmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
  // Write tokens as "token_id:N" (vLLM's return_tokens_as_token_ids).
  bool tokens_as_ids = false;
  // Streams only: the request set stream_options.include_usage, so every
  // chunk carries "usage": null before the final usage chunk (OpenAI's shape).
  bool include_usage = false;
};

struct ChatChoice {
  int index = 0;
  std::string content;
  FinishReason finish_reason = FinishReason::kStop;
  // Present when the request asked for logprobs.
  std::optional<std::vector<TokenLogprob>> logprobs;
};

struct CompletionChoice {
  int index = 0;
  std::string text;
  FinishReason finish_reason = FinishReason::kStop;
  // Present when the request asked for logprobs; written in the legacy
  // completions shape {tokens, token_logprobs, top_logprobs, text_offset}.
  std::optional<std::vector<TokenLogprob>> logprobs;
  // Offset in `text` of the first logprobs token (non-zero with echo).
  int64_t text_offset_base = 0;
};

// The non-streaming bodies: object "chat.completion" / "text_completion".
std::string ChatCompletionJson(const ResponseHeader& header, const std::vector<ChatChoice>& choices,
                               const Usage& usage);
std::string CompletionJson(const ResponseHeader& header, const std::vector<CompletionChoice>& choices,
                           const Usage& usage);

// The chat "logprobs" object alone: {"content": [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]}]}.
std::string ChatLogprobsJson(const std::vector<TokenLogprob>& tokens, bool tokens_as_ids);

// One streamed piece of one choice.
struct ChatDelta {
  int index = 0;
  // Set on a choice's first chunk: the delta carries "role": "assistant".
  bool first = false;
  std::string content;
  std::optional<std::vector<TokenLogprob>> logprobs;
  // Set on a choice's last chunk.
  std::optional<FinishReason> finish_reason;
};

struct CompletionDelta {
  int index = 0;
  std::string text;
  std::optional<std::vector<TokenLogprob>> logprobs;
  int64_t text_offset_base = 0;
  std::optional<FinishReason> finish_reason;
};

// "data: {object: chat.completion.chunk, choices: [{index, delta: {role?,
// content}, logprobs, finish_reason}]}\n\n".
std::string ChatChunk(const ResponseHeader& header, const ChatDelta& delta);
// "data: {object: text_completion, choices: [{index, text, logprobs,
// finish_reason}]}\n\n".
std::string CompletionChunk(const ResponseHeader& header, const CompletionDelta& delta);
// The final usage chunk sent when stream_options.include_usage: "choices": []
// and "usage". `chat` selects the object name.
std::string UsageChunk(const ResponseHeader& header, const Usage& usage, bool chat);
// An error inside a started stream: "data: {"error": {...}}\n\n" (vLLM's shape).
std::string ErrorChunk(const ApiError& error);
// "data: [DONE]\n\n"
std::string DoneChunk();

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_OPENAI_OPENAI_API_H_
