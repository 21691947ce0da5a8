#include "orchestrator/openai/openai_api.h"

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rapidjson/document.h"

namespace tandem::router {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

rapidjson::Document ParseJson(std::string_view text) {
  rapidjson::Document doc;
  doc.Parse(text.data(), text.size());
  EXPECT_FALSE(doc.HasParseError()) << text;
  return doc;
}

std::string Str(const rapidjson::Value& v) { return {v.GetString(), v.GetStringLength()}; }

// The ApiError a failing parse maps to.
template <typename T>
ApiError ErrorOf(const absl::StatusOr<T>& r) {
  EXPECT_FALSE(r.ok());
  if (r.ok()) return {};
  return ApiErrorFromStatus(r.status());
}

ApiError ChatError(std::string_view body) { return ErrorOf(ParseChatCompletionRequest(body)); }
ApiError CompletionError(std::string_view body) { return ErrorOf(ParseCompletionRequest(body)); }

// A chat body with one user message and `extra` appended as more fields.
std::string ChatBody(std::string_view extra) {
  std::string body = R"({"model": "m", "messages": [{"role": "user", "content": "hi"}])";
  if (!extra.empty()) body += std::string(", ") + std::string(extra);
  return body + "}";
}

// ---------------------------------------------------------------------------
// Chat requests.

TEST(ChatRequestTest, Minimal) {
  auto r = ParseChatCompletionRequest(ChatBody(""));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "m");
  ASSERT_EQ(r->messages.size(), 1u);
  EXPECT_EQ(r->messages[0].role, Role::kUser);
  EXPECT_EQ(r->messages[0].content, "hi");
  EXPECT_FALSE(r->sampling.max_tokens.has_value());
  EXPECT_FALSE(r->sampling.temperature.has_value());
  EXPECT_EQ(r->sampling.n, 1);
  EXPECT_FALSE(r->sampling.stream);
  EXPECT_FALSE(r->logprobs);
  EXPECT_TRUE(r->add_generation_prompt);
  EXPECT_TRUE(r->chat_template_kwargs.empty());
}

TEST(ChatRequestTest, Full) {
  auto r = ParseChatCompletionRequest(R"({
    "model": "llama",
    "messages": [
      {"role": "system", "content": "be brief"},
      {"role": "developer", "content": "dev"},
      {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null, "tool_calls": []},
      {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    ],
    "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9,
    "top_k": 0, "min_p": 0.05, "stop": ["x", "y"], "seed": -7, "presence_penalty": -2,
    "frequency_penalty": 2, "repetition_penalty": 1.1, "logprobs": true, "top_logprobs": 20,
    "n": 128, "user": "u1", "stream": true, "stream_options": {"include_usage": true},
    "ignore_eos": true, "min_tokens": 3, "return_tokens_as_token_ids": true,
    "stop_token_ids": [2, 7], "tools": [], "response_format": null
  })");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 5u);
  EXPECT_EQ(r->messages[0].role, Role::kSystem);
  EXPECT_EQ(r->messages[1].role, Role::kDeveloper);
  EXPECT_EQ(r->messages[2].content, "a\nb");
  EXPECT_EQ(r->messages[2].name, "ann");
  EXPECT_EQ(r->messages[3].role, Role::kAssistant);
  EXPECT_EQ(r->messages[3].content, "");
  EXPECT_EQ(r->messages[4].tool_call_id, "call_1");
  const SamplingFields& s = r->sampling;
  EXPECT_EQ(s.max_tokens, 20);  // max_completion_tokens wins
  EXPECT_EQ(s.temperature, 0.5);
  EXPECT_EQ(s.top_p, 0.9);
  EXPECT_EQ(s.top_k, -1);  // 0 means off
  EXPECT_EQ(s.min_p, 0.05);
  EXPECT_THAT(s.stop, ElementsAre("x", "y"));
  EXPECT_EQ(s.seed, -7);
  EXPECT_EQ(s.presence_penalty, -2);
  EXPECT_EQ(s.frequency_penalty, 2);
  EXPECT_EQ(s.repetition_penalty, 1.1);
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 20);
  EXPECT_EQ(s.n, 128);
  EXPECT_EQ(s.user, "u1");
  EXPECT_TRUE(s.stream);
  EXPECT_TRUE(s.include_usage);
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_EQ(s.min_tokens, 3);
  EXPECT_TRUE(s.return_tokens_as_token_ids);
  EXPECT_THAT(s.stop_token_ids, ElementsAre(2, 7));
}

// A field the server does not implement is a 400 naming it, never ignored;
// null, [] and {} mean absent, as an unset field.
TEST(ChatRequestTest, UnsupportedFieldsAreRefusedByName) {
  for (const auto& [extra, param] : std::vector<std::pair<std::string, std::string>>{
           {R"("tools": [{"type": "function", "function": {"name": "f"}}])", "tools"},
           {R"("functions": [{"name": "f"}])", "functions"},
           {R"("response_format": {"type": "json_object"})", "response_format"},
           {R"("logit_bias": {"50256": -100})", "logit_bias"},
           {R"("tool_choice": "auto")", "tool_choice"},
           {R"("best_of": 2)", "best_of"},
           {R"("stream": true, "stream_options": {"include_usage": true, "x": 1})", "stream_options.x"}}) {
    const ApiError e = ChatError(ChatBody(extra));
    EXPECT_EQ(e.http_status, 400) << extra;
    EXPECT_EQ(e.param, param) << extra;
    EXPECT_THAT(e.message, HasSubstr("not supported")) << extra;
  }
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "assistant", "content": "a",
      "tool_calls": [{"id": "c", "type": "function"}]}]})")
                .param,
            "messages[0].tool_calls");
  auto r = ParseChatCompletionRequest(ChatBody(R"("tools": [], "logit_bias": {}, "response_format": null)"));
  EXPECT_TRUE(r.ok()) << r.status();
}

TEST(ChatRequestTest, TemplateControlsAndServerOwnedVariables) {
  auto r = ParseChatCompletionRequest(ChatBody(
      R"("add_generation_prompt": false, "chat_template_kwargs": {"enable_thinking": false, "x": {"y": [1, "<|eot_id|>"]}})"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->add_generation_prompt);
  EXPECT_EQ(r->chat_template_kwargs.dump(), R"({"enable_thinking":false,"x":{"y":[1,"<|eot_id|>"]}})");
  for (std::string_view owned : kServerTemplateVariables) {
    const ApiError e =
        ChatError(ChatBody(absl::StrCat(R"("chat_template_kwargs": {")", std::string(owned), R"(": 1})")));
    EXPECT_EQ(e.http_status, 400) << owned;
    EXPECT_EQ(e.param, "chat_template_kwargs." + std::string(owned));
  }
  EXPECT_EQ(ChatError(ChatBody(R"("chat_template_kwargs": [1])")).param, "chat_template_kwargs");
  EXPECT_EQ(ChatError(ChatBody(R"("add_generation_prompt": 1)")).param, "add_generation_prompt");
}

// Nesting past kMaxJsonDepth is refused before parsing, on any field, so no
// recursive walk downstream (template kwargs serialization) sees it.
TEST(ChatRequestTest, DeepNestingIsRefusedBeforeParsing) {
  auto nested = [](int depth) { return absl::StrCat(std::string(depth, '['), std::string(depth, ']')); };
  // The body and the kwargs object are two levels.
  EXPECT_TRUE(ParseChatCompletionRequest(
                  ChatBody(absl::StrCat(R"("chat_template_kwargs": {"a": )", nested(kMaxJsonDepth - 2), "}")))
                  .ok());
  for (int depth : {kMaxJsonDepth - 1, 60000, 1000000}) {
    const ApiError e = ChatError(ChatBody(absl::StrCat(R"("chat_template_kwargs": {"a": )", nested(depth), "}")));
    EXPECT_EQ(e.http_status, 400) << depth;
    EXPECT_THAT(e.message, HasSubstr("nested more than 64 levels")) << depth;
  }
  // Brackets inside strings (escaped quotes too) do not count.
  const std::string brackets(100000, '[');
  auto user = ParseChatCompletionRequest(ChatBody(absl::StrCat(R"("user": "\")", brackets, R"(")")));
  EXPECT_TRUE(user.ok()) << user.status();
  EXPECT_TRUE(CheckJsonDepth(R"({"a": "\\", "b": [[1]]})", 3).ok());
  EXPECT_FALSE(CheckJsonDepth(R"({"a": "\\", "b": [[1]]})", 2).ok());
  EXPECT_EQ(
      ErrorOf(ParseCompletionRequest(absl::StrCat(R"({"model": "m", "prompt": )", nested(100000), "}"))).http_status,
      400);
}

TEST(ChatRequestTest, NullMeansAbsentAndStopString) {
  auto r =
      ParseChatCompletionRequest(ChatBody(R"("temperature": null, "stop": "END", "max_tokens": 16.0, "top_k": -1)"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->sampling.temperature.has_value());
  EXPECT_THAT(r->sampling.stop, ElementsAre("END"));
  EXPECT_EQ(r->sampling.max_tokens, 16);
  EXPECT_EQ(r->sampling.top_k, -1);
}

TEST(ChatRequestTest, MalformedJsonNamesOffset) {
  ApiError e = ChatError(R"({"model": "m",, })");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_THAT(e.message, HasSubstr("offset 14"));
  EXPECT_EQ(e.param, "");
  EXPECT_THAT(ChatError("").message, HasSubstr("Malformed JSON"));
  EXPECT_THAT(ChatError(ChatBody("") + "x").message, HasSubstr("Malformed JSON"));
  // Deep nesting is refused before parsing (ChatRequestTest.DeepNesting...).
  EXPECT_THAT(ChatError(std::string(100000, '[')).message, HasSubstr("nested more than"));
}

TEST(ChatRequestTest, TopLevelNotObject) {
  for (std::string_view body : {"[]", "1", "\"s\"", "null"}) {
    ApiError e = ChatError(body);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_THAT(e.message, HasSubstr("must be a JSON object")) << body;
  }
}

TEST(ChatRequestTest, MissingFields) {
  EXPECT_EQ(ChatError(R"({"messages": [{"role": "user", "content": "x"}]})").param, "model");
  EXPECT_EQ(ChatError(R"({"model": "m"})").param, "messages");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": []})").param, "messages");
  EXPECT_EQ(ChatError(R"({"model": "", "messages": [{"role": "user", "content": "x"}]})").param, "model");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"content": "x"}]})").param, "messages[0].role");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "user"}]})").param, "messages[0].content");
}

TEST(ChatRequestTest, WrongTypes) {
  ApiError e = ChatError(ChatBody(R"("temperature": "hot")"));
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "temperature");
  EXPECT_THAT(e.message, HasSubstr("'temperature' must be a number"));

  EXPECT_EQ(ChatError(R"({"model": 1, "messages": []})").param, "model");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": {}})").param, "messages");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": ["hi"]})").param, "messages[0]");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "user", "content": 3}]})").param, "messages[0].content");
  EXPECT_EQ(ChatError(ChatBody(R"("stream": "yes")")).param, "stream");
  EXPECT_EQ(ChatError(ChatBody(R"("stop": 5)")).param, "stop");
  EXPECT_EQ(ChatError(ChatBody(R"("stop": ["a", 5])")).param, "stop[1]");
  EXPECT_EQ(ChatError(ChatBody(R"("user": 5)")).param, "user");
  EXPECT_EQ(ChatError(ChatBody(R"("logprobs": 1)")).param, "logprobs");
  EXPECT_EQ(ChatError(ChatBody(R"("stop_token_ids": [1, "2"])")).param, "stop_token_ids[1]");
  EXPECT_EQ(ChatError(ChatBody(R"("stream": true, "stream_options": {"include_usage": 1})")).param,
            "stream_options.include_usage");
}

TEST(ChatRequestTest, IntegersMustBeIntegral) {
  ApiError e = ChatError(ChatBody(R"("max_tokens": 1.5)"));
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_THAT(e.message, HasSubstr("must be an integer"));
  EXPECT_EQ(ChatError(ChatBody(R"("seed": 0.5)")).param, "seed");
  EXPECT_EQ(ChatError(ChatBody(R"("n": 2.5)")).param, "n");
  EXPECT_EQ(ChatError(ChatBody(R"("seed": 1e30)")).param, "seed");
  EXPECT_EQ(ChatError(ChatBody(R"("seed": 18446744073709551615)")).param, "seed");
}

TEST(ChatRequestTest, Ranges) {
  struct Case {
    const char* field;
    const char* bad;
    const char* good;
  };
  for (const Case& c : std::vector<Case>{{"temperature", "2.01", "2"},
                                         {"temperature", "-0.1", "0"},
                                         {"top_p", "0", "1"},
                                         {"top_p", "1.1", "0.01"},
                                         {"top_k", "-2", "1"},
                                         {"min_p", "1.5", "0"},
                                         {"presence_penalty", "-2.5", "-2"},
                                         {"frequency_penalty", "2.5", "2"},
                                         {"repetition_penalty", "0", "0.5"},
                                         {"n", "0", "1"},
                                         {"n", "129", "128"},
                                         {"max_tokens", "0", "1"},
                                         {"max_completion_tokens", "0", "1"},
                                         {"min_tokens", "-1", "0"},
                                         {"top_logprobs", "21", "0"},
                                         {"top_logprobs", "-1", "0"}}) {
    ApiError e = ChatError(ChatBody(std::string("\"") + c.field + "\": " + c.bad));
    EXPECT_EQ(e.http_status, 400) << c.field << "=" << c.bad;
    EXPECT_EQ(e.param, c.field) << c.field << "=" << c.bad;
    EXPECT_THAT(e.message, HasSubstr(c.field));
    auto ok = ParseChatCompletionRequest(ChatBody(std::string("\"") + c.field + "\": " + c.good));
    EXPECT_TRUE(ok.ok()) << c.field << "=" << c.good << ": " << ok.status();
  }
}

TEST(ChatRequestTest, CrossFieldRules) {
  EXPECT_EQ(ChatError(ChatBody(R"("top_logprobs": 3)")).param, "top_logprobs");
  EXPECT_TRUE(ParseChatCompletionRequest(ChatBody(R"("top_logprobs": 0)")).ok());
  EXPECT_EQ(ChatError(ChatBody(R"("stream_options": {"include_usage": true})")).param, "stream_options");
  EXPECT_TRUE(ParseChatCompletionRequest(ChatBody(R"("stream_options": null)")).ok());
}

TEST(ChatRequestTest, InvalidValues) {
  ApiError role = ChatError(R"({"model": "m", "messages": [{"role": "bot", "content": "x"}]})");
  EXPECT_EQ(role.param, "messages[0].role");
  EXPECT_THAT(role.message, HasSubstr("bot"));
  EXPECT_EQ(ChatError(ChatBody(R"("stop": ["a", ""])")).param, "stop[1]");
  EXPECT_EQ(ChatError(ChatBody(R"("stop": "")")).param, "stop");
  EXPECT_EQ(ChatError(ChatBody(R"("stop_token_ids": [-1])")).param, "stop_token_ids[0]");
  std::string many = "\"stop\": [";
  for (int i = 0; i <= kMaxStopSequences; ++i) many += (i ? ",\"s\"" : "\"s\"");
  EXPECT_EQ(ChatError(ChatBody(many + "]")).param, "stop");
}

TEST(ChatRequestTest, ContentParts) {
  ApiError e = ChatError(R"({"model": "m", "messages": [
      {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages[2].content[0].type");
  EXPECT_THAT(e.message, HasSubstr("image_url"));
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "user", "content": [{"text": "a"}]}]})").param,
            "messages[0].content[0].type");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]})").param,
            "messages[0].content[0].text");
  EXPECT_EQ(ChatError(R"({"model": "m", "messages": [{"role": "user", "content": ["a"]}]})").param,
            "messages[0].content[0]");
  auto r = ParseChatCompletionRequest(
      R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->messages[0].content, "x");
  EXPECT_EQ(
      ChatError(
          R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]})")
          .param,
      "messages[0].content[0].cache_control");
}

// ---------------------------------------------------------------------------
// Completion requests.

TEST(CompletionRequestTest, Minimal) {
  auto r = ParseCompletionRequest(R"({"model": "m", "prompt": "Once"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::get<std::string>(r->prompt), "Once");
  EXPECT_EQ(r->sampling.max_tokens, kDefaultCompletionMaxTokens);
  EXPECT_FALSE(r->echo);
  EXPECT_FALSE(r->logprobs.has_value());
}

TEST(CompletionRequestTest, Full) {
  auto r = ParseCompletionRequest(R"({"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 5,
      "temperature": 0, "top_p": 1, "top_k": 40, "min_p": 0.1, "stop": "\n", "seed": 1,
      "presence_penalty": 0.5, "frequency_penalty": 0.5, "logprobs": 5, "echo": true, "n": 2,
      "user": "u", "stream": true, "stream_options": {"include_usage": false},
      "ignore_eos": false, "return_tokens_as_token_ids": true, "suffix": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(std::get<std::vector<int32_t>>(r->prompt), ElementsAre(1, 2, 3));
  EXPECT_EQ(r->sampling.max_tokens, 5);
  EXPECT_EQ(r->sampling.temperature, 0);
  EXPECT_EQ(r->sampling.top_k, 40);
  EXPECT_THAT(r->sampling.stop, ElementsAre("\n"));
  EXPECT_EQ(r->logprobs, 5);
  EXPECT_TRUE(r->echo);
  EXPECT_EQ(r->sampling.n, 2);
  EXPECT_TRUE(r->sampling.stream);
  EXPECT_FALSE(r->sampling.include_usage);
  EXPECT_TRUE(r->sampling.return_tokens_as_token_ids);
  EXPECT_EQ(ErrorOf(ParseCompletionRequest(R"({"model": "m", "prompt": "a", "best_of": 2})")).param, "best_of");
  EXPECT_EQ(ErrorOf(ParseCompletionRequest(R"({"model": "m", "prompt": "a", "logit_bias": {"1": 5}})")).param,
            "logit_bias");
}

TEST(CompletionRequestTest, PromptForms) {
  auto text = ParseCompletionRequest(R"({"model": "m", "prompt": ["hello"]})");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(std::get<std::string>(text->prompt), "hello");
  auto ids = ParseCompletionRequest(R"({"model": "m", "prompt": [5, 6.0]})");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(std::get<std::vector<int32_t>>(ids->prompt), ElementsAre(5, 6));

  EXPECT_EQ(CompletionError(R"({"model": "m"})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": ""})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": []})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [[]]})").param, "prompt[0]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [""]})").param, "prompt[0]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": ["a", "b"]})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [[1], [2]]})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [1, "a"]})").param, "prompt[1]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [1, -1]})").param, "prompt[1]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [1.5]})").param, "prompt[0]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [[1, 4294967296]]})").param, "prompt[0][1]");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": {}})").param, "prompt");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": [{}]})").param, "prompt[0]");
}

TEST(CompletionRequestTest, Errors) {
  ApiError suffix = CompletionError(R"({"model": "m", "prompt": "a", "suffix": "b"})");
  EXPECT_EQ(suffix.http_status, 400);
  EXPECT_EQ(suffix.param, "suffix");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": "a", "logprobs": 6})").param, "logprobs");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": "a", "logprobs": true})").param, "logprobs");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": "a", "echo": 1})").param, "echo");
  EXPECT_EQ(CompletionError(R"({"prompt": "a"})").param, "model");
  EXPECT_EQ(CompletionError(R"({"model": "m", "prompt": "a", "max_tokens": 2.5})").param, "max_tokens");
}

// ---------------------------------------------------------------------------
// Errors.

TEST(ApiErrorTest, JsonShape) {
  ApiError e = ChatError(ChatBody(R"("temperature": "hot")"));
  rapidjson::Document doc = ParseJson(ApiErrorJson(e));
  ASSERT_TRUE(doc.IsObject());
  const rapidjson::Value& err = doc["error"];
  EXPECT_THAT(Str(err["message"]), HasSubstr("'temperature' must be a number"));
  EXPECT_EQ(Str(err["type"]), "invalid_request_error");
  EXPECT_EQ(Str(err["param"]), "temperature");
  EXPECT_TRUE(err["code"].IsNull());

  rapidjson::Document no_param = ParseJson(ApiErrorJson(ChatError("{")));
  EXPECT_TRUE(no_param["error"]["param"].IsNull());
}

TEST(ApiErrorTest, UnknownModel) {
  ApiError e = ApiErrorFromStatus(UnknownModelError("gpt-5"));
  EXPECT_EQ(e.http_status, 404);
  EXPECT_EQ(e.param, "model");
  EXPECT_EQ(e.code, "model_not_found");
  EXPECT_THAT(e.message, HasSubstr("gpt-5"));
  rapidjson::Document doc = ParseJson(ApiErrorJson(e));
  EXPECT_EQ(Str(doc["error"]["code"]), "model_not_found");
}

TEST(ApiErrorTest, StatusMapping) {
  EXPECT_EQ(ApiErrorFromStatus(absl::ResourceExhaustedError("x")).http_status, 429);
  EXPECT_EQ(ApiErrorFromStatus(absl::UnavailableError("x")).http_status, 503);
  EXPECT_EQ(ApiErrorFromStatus(absl::DeadlineExceededError("x")).http_status, 504);
  EXPECT_EQ(ApiErrorFromStatus(absl::InternalError("x")).http_status, 500);
  EXPECT_EQ(ApiErrorFromStatus(absl::InternalError("x")).type, "server_error");
}

// ---------------------------------------------------------------------------
// Responses.

ResponseHeader Header() { return {"chatcmpl-1", 1700000000, "llama"}; }

std::vector<TokenLogprob> SampleLogprobs() {
  return {{/*token_id=*/9, "Hi", -0.25, {{9, "Hi", -0.25}, {4, "Yo", -1.5}}},
          {/*token_id=*/3, "\xC3", -std::numeric_limits<double>::infinity(), {}}};
}

TEST(ResponseTest, ChatCompletion) {
  ChatChoice c{0, "Hello", FinishReason::kLength, SampleLogprobs()};
  ChatChoice plain{1, "x", FinishReason::kStop, std::nullopt};
  std::string json = ChatCompletionJson(Header(), {c, plain}, Usage{7, 2, 4});
  rapidjson::Document doc = ParseJson(json);
  EXPECT_EQ(Str(doc["id"]), "chatcmpl-1");
  EXPECT_EQ(Str(doc["object"]), "chat.completion");
  EXPECT_EQ(doc["created"].GetInt64(), 1700000000);
  EXPECT_EQ(Str(doc["model"]), "llama");
  const rapidjson::Value& ch = doc["choices"];
  ASSERT_EQ(ch.Size(), 2u);
  EXPECT_EQ(ch[0]["index"].GetInt(), 0);
  EXPECT_EQ(Str(ch[0]["message"]["role"]), "assistant");
  EXPECT_EQ(Str(ch[0]["message"]["content"]), "Hello");
  EXPECT_EQ(Str(ch[0]["finish_reason"]), "length");
  EXPECT_TRUE(ch[1]["logprobs"].IsNull());
  EXPECT_EQ(Str(ch[1]["finish_reason"]), "stop");

  const rapidjson::Value& content = ch[0]["logprobs"]["content"];
  ASSERT_EQ(content.Size(), 2u);
  EXPECT_EQ(Str(content[0]["token"]), "Hi");
  EXPECT_DOUBLE_EQ(content[0]["logprob"].GetDouble(), -0.25);
  ASSERT_EQ(content[0]["bytes"].Size(), 2u);
  EXPECT_EQ(content[0]["bytes"][0].GetInt(), 'H');
  ASSERT_EQ(content[0]["top_logprobs"].Size(), 2u);
  EXPECT_EQ(Str(content[0]["top_logprobs"][1]["token"]), "Yo");
  EXPECT_DOUBLE_EQ(content[0]["top_logprobs"][1]["logprob"].GetDouble(), -1.5);
  // A partial UTF-8 token: the text is repaired, the bytes are raw, -inf is -9999.
  EXPECT_EQ(Str(content[1]["token"]), "\xEF\xBF\xBD");
  EXPECT_EQ(content[1]["bytes"][0].GetInt(), 0xC3);
  EXPECT_DOUBLE_EQ(content[1]["logprob"].GetDouble(), -9999.0);

  const rapidjson::Value& usage = doc["usage"];
  EXPECT_EQ(usage["prompt_tokens"].GetInt(), 7);
  EXPECT_EQ(usage["completion_tokens"].GetInt(), 2);
  EXPECT_EQ(usage["total_tokens"].GetInt(), 9);
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"].GetInt(), 4);
}

TEST(ResponseTest, TokensAsIds) {
  rapidjson::Document doc = ParseJson(ChatLogprobsJson(SampleLogprobs(), /*tokens_as_ids=*/true));
  const rapidjson::Value& t = doc["content"][0];
  EXPECT_EQ(Str(t["token"]), "token_id:9");
  EXPECT_EQ(t["bytes"].Size(), std::string("token_id:9").size());
  EXPECT_EQ(Str(t["top_logprobs"][1]["token"]), "token_id:4");
}

TEST(ResponseTest, Completion) {
  CompletionChoice c{0, "Hi there", FinishReason::kStop, SampleLogprobs(), 10};
  rapidjson::Document doc = ParseJson(CompletionJson({"cmpl-1", 5, "m"}, {c}, Usage{3, 2, 0}));
  EXPECT_EQ(Str(doc["object"]), "text_completion");
  const rapidjson::Value& ch = doc["choices"][0];
  EXPECT_EQ(Str(ch["text"]), "Hi there");
  EXPECT_EQ(Str(ch["finish_reason"]), "stop");
  const rapidjson::Value& lp = ch["logprobs"];
  EXPECT_EQ(Str(lp["tokens"][0]), "Hi");
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][0].GetDouble(), -0.25);
  EXPECT_DOUBLE_EQ(lp["top_logprobs"][0]["Yo"].GetDouble(), -1.5);
  EXPECT_EQ(lp["text_offset"][0].GetInt(), 10);
  EXPECT_EQ(lp["text_offset"][1].GetInt(), 12);
  EXPECT_EQ(doc["usage"]["total_tokens"].GetInt(), 5);
}

// Strips the SSE framing of one event and parses its JSON.
rapidjson::Document SseJson(const std::string& event) {
  EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
  EXPECT_GE(event.size(), 8u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n") << event;
  std::string_view json(event);
  json.remove_prefix(6);
  json.remove_suffix(2);
  EXPECT_EQ(json.find('\n'), std::string_view::npos) << "one line per event";
  return ParseJson(json);
}

TEST(StreamTest, ChatChunks) {
  ResponseHeader h = Header();
  h.include_usage = true;
  ChatDelta first{0, /*first=*/true, "", std::nullopt, std::nullopt};
  ChatDelta mid{0, false, "Hel\nlo", SampleLogprobs(), std::nullopt};
  ChatDelta last{0, false, "", std::nullopt, FinishReason::kStop};

  rapidjson::Document d1 = SseJson(ChatChunk(h, first));
  EXPECT_EQ(Str(d1["object"]), "chat.completion.chunk");
  EXPECT_EQ(Str(d1["id"]), "chatcmpl-1");
  EXPECT_EQ(Str(d1["choices"][0]["delta"]["role"]), "assistant");
  EXPECT_EQ(Str(d1["choices"][0]["delta"]["content"]), "");
  EXPECT_TRUE(d1["choices"][0]["finish_reason"].IsNull());
  EXPECT_TRUE(d1["usage"].IsNull());

  rapidjson::Document d2 = SseJson(ChatChunk(h, mid));
  EXPECT_FALSE(d2["choices"][0]["delta"].HasMember("role"));
  EXPECT_EQ(Str(d2["choices"][0]["delta"]["content"]), "Hel\nlo");
  EXPECT_EQ(d2["choices"][0]["logprobs"]["content"].Size(), 2u);

  rapidjson::Document d3 = SseJson(ChatChunk(h, last));
  EXPECT_TRUE(d3["choices"][0]["delta"].ObjectEmpty());
  EXPECT_EQ(Str(d3["choices"][0]["finish_reason"]), "stop");

  rapidjson::Document u = SseJson(UsageChunk(h, Usage{5, 3, 0}, /*chat=*/true));
  EXPECT_EQ(Str(u["object"]), "chat.completion.chunk");
  EXPECT_TRUE(u["choices"].IsArray());
  EXPECT_EQ(u["choices"].Size(), 0u);
  EXPECT_EQ(u["usage"]["total_tokens"].GetInt(), 8);

  EXPECT_EQ(DoneChunk(), "data: [DONE]\n\n");
}

TEST(StreamTest, NoUsageFieldWithoutIncludeUsage) {
  rapidjson::Document d = SseJson(ChatChunk(Header(), ChatDelta{0, true, "a"}));
  EXPECT_FALSE(d.HasMember("usage"));
}

TEST(StreamTest, CompletionAndErrorChunks) {
  rapidjson::Document d =
      SseJson(CompletionChunk({"cmpl-1", 5, "m"}, CompletionDelta{1, "abc", std::nullopt, 0, FinishReason::kLength}));
  EXPECT_EQ(Str(d["object"]), "text_completion");
  EXPECT_EQ(d["choices"][0]["index"].GetInt(), 1);
  EXPECT_EQ(Str(d["choices"][0]["text"]), "abc");
  EXPECT_EQ(Str(d["choices"][0]["finish_reason"]), "length");

  rapidjson::Document u = SseJson(UsageChunk({"cmpl-1", 5, "m"}, Usage{1, 1, 0}, /*chat=*/false));
  EXPECT_EQ(Str(u["object"]), "text_completion");

  rapidjson::Document e = SseJson(ErrorChunk(ApiErrorFromStatus(absl::UnavailableError("no worker"))));
  EXPECT_EQ(Str(e["error"]["message"]), "no worker");
  EXPECT_EQ(Str(e["error"]["type"]), "server_error");
}

}  // namespace
}  // namespace tandem::router

namespace tandem::router {
namespace {

ApiError TokenizeError(std::string_view body) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(body);
  EXPECT_FALSE(r.ok()) << body;
  return r.ok() ? ApiError{} : ApiErrorFromStatus(r.status());
}

TEST(TokenizeRequestTest, APromptOrAConversation) {
  absl::StatusOr<TokenizeRequest> p =
      ParseTokenizeRequest(R"({"model": "m", "prompt": "Hi", "add_special_tokens": false, "return_token_strs": true})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model, "m");
  EXPECT_EQ(p->prompt, "Hi");
  EXPECT_FALSE(p->chat.has_value());
  EXPECT_EQ(p->add_special_tokens, false);
  EXPECT_TRUE(p->return_token_strs);

  absl::StatusOr<TokenizeRequest> c = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false,)"
      R"( "chat_template_kwargs": {"z": 1, "a": [2.5, -3, 18446744073709551615, null, true, {"k": "v"}]}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->model.has_value());
  EXPECT_FALSE(c->add_special_tokens.has_value());
  ASSERT_TRUE(c->chat.has_value());
  ASSERT_EQ(c->chat->messages.size(), 1u);
  EXPECT_FALSE(c->chat->add_generation_prompt);
  // Converted once, in the body's order and with the body's number types.
  EXPECT_EQ(c->chat->chat_template_kwargs.dump(), R"({"z":1,"a":[2.5,-3,18446744073709551615,null,true,{"k":"v"}]})");
}

TEST(DetokenizeRequestTest, ModelAndTokensAndNothingElse) {
  absl::StatusOr<DetokenizeRequest> r = ParseDetokenizeRequest(R"({"model": "m", "tokens": [1, 2.0, 300]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "m");
  EXPECT_EQ(r->tokens, (std::vector<int64_t>{1, 2, 300}));
  absl::StatusOr<DetokenizeRequest> bare = ParseDetokenizeRequest(R"({"tokens": []})");
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_FALSE(bare->model.has_value());
  struct Case {
    const char* body;
    const char* param;
    const char* message;
  };
  for (const Case& c : {Case{"{}", "tokens", "'tokens' must be a list of token ids"},
                        Case{R"({"tokens": "1,2"})", "tokens", "'tokens' must be a list of token ids"},
                        Case{R"({"tokens": [1, 1.5]})", "tokens[1]", "must be an integer"},
                        Case{R"({"tokens": [1], "model": 7})", "model", "model"},
                        Case{R"({"tokens": [1], "skip_special_tokens": true})", "skip_special_tokens", "not supported"},
                        Case{"[1]", "", "object"}}) {
    absl::StatusOr<DetokenizeRequest> bad = ParseDetokenizeRequest(c.body);
    ASSERT_FALSE(bad.ok()) << c.body;
    const ApiError e = ApiErrorFromStatus(bad.status());
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_THAT(e.message, ::testing::HasSubstr(c.message)) << c.body;
  }
}

TEST(TokenizeRequestTest, BadRequestsNameTheField) {
  EXPECT_EQ(TokenizeError(R"({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})").param, "messages");
  EXPECT_EQ(TokenizeError(R"({"model": "m"})").param, "prompt");
  EXPECT_EQ(TokenizeError(R"({"prompt": 5})").param, "prompt");
  EXPECT_EQ(TokenizeError(R"({"prompt": "a", "add_special_tokens": "yes"})").param, "add_special_tokens");
  EXPECT_EQ(TokenizeError(R"({"prompt": "a", "truncate": 5})").param, "truncate");
  // The conversation's fields do not apply to a prompt: refused, not ignored.
  EXPECT_EQ(TokenizeError(R"({"prompt": "a", "chat_template_kwargs": {"x": 1}})").param, "chat_template_kwargs");
  // A conversation gets chat completions' checks.
  EXPECT_EQ(TokenizeError(R"({"messages": [{"role": "wizard", "content": "b"}]})").param, "messages[0].role");
  EXPECT_EQ(
      TokenizeError(R"({"messages": [{"role": "user", "content": "b"}], "chat_template_kwargs": {"messages": 1}})")
          .param,
      "chat_template_kwargs.messages");
  EXPECT_EQ(TokenizeError("[1]").http_status, 400);
}

}  // namespace
}  // namespace tandem::router
