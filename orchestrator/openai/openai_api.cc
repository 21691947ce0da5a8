#include "orchestrator/openai/openai_api.h"

#include <cmath>
#include <initializer_list>
#include <limits>
#include <span>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace tandem::router {
namespace {

using rapidjson::Value;
using JsonWriter = rapidjson::Writer<rapidjson::StringBuffer>;

// Status payload keys that carry ApiError.param / .code through a Status.
constexpr char kParamPayload[] = "tandem.openai/param";
constexpr char kCodePayload[] = "tandem.openai/code";

// OpenAI writes -9999.0 for a logprob of -inf (JSON has no infinities).
constexpr double kMinLogprob = -9999.0;

// Debian's Abseil has its own absl::string_view, which StrCat and Cord want.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string Path(std::string_view prefix, std::string_view key) {
  if (prefix.empty()) return std::string(key);
  return absl::StrCat(Av(prefix), ".", Av(key));
}

std::string Index(std::string_view prefix, size_t i) { return absl::StrCat(Av(prefix), "[", i, "]"); }

std::string_view TypeName(const Value& v) {
  if (v.IsNull()) return "null";
  if (v.IsBool()) return "a boolean";
  if (v.IsNumber()) return "a number";
  if (v.IsString()) return "a string";
  if (v.IsArray()) return "an array";
  return "an object";
}

absl::Status WrongType(std::string_view path, std::string_view want, const Value& got) {
  return InvalidRequest(path, absl::StrCat("'", Av(path), "' must be ", Av(want), ", got ", Av(TypeName(got))));
}

std::string_view StringOf(const Value& v) { return {v.GetString(), v.GetStringLength()}; }

// The member `key` of `obj`, or nullptr when absent or null.
const Value* Find(const Value& obj, const char* key) {
  auto it = obj.FindMember(key);
  if (it == obj.MemberEnd() || it->value.IsNull()) return nullptr;
  return &it->value;
}

// True for a value that means the same as an absent field: null, [] or {}.
// Clients send unset fields that way ("tools": [], "logit_bias": {}).
bool IsAbsentLike(const Value& v) {
  return v.IsNull() || (v.IsArray() && v.Empty()) || (v.IsObject() && v.ObjectEmpty());
}

// A 400 naming the first member of `obj` that is not in `known` and carries
// a value: a field this server does not implement is refused, never ignored.
// `also`: more known names (the fields every endpoint shares).
absl::Status RejectUnknown(const Value& obj, std::string_view prefix, std::initializer_list<std::string_view> known,
                           std::span<const std::string_view> also = {}) {
  for (auto it = obj.MemberBegin(); it != obj.MemberEnd(); ++it) {
    std::string_view name = StringOf(it->name);
    bool found = false;
    for (std::string_view k : known) found = found || k == name;
    for (std::string_view k : also) found = found || k == name;
    if (found || IsAbsentLike(it->value)) continue;
    const std::string path = Path(prefix, name);
    return InvalidRequest(path, absl::StrCat("'", Av(path), "' is not supported by this server"));
  }
  return absl::OkStatus();
}

// Typed readers: leave `out` untouched when the field is absent or null.
absl::Status ReadString(const Value& obj, const char* key, std::string_view prefix, std::optional<std::string>* out) {
  const Value* v = Find(obj, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->IsString()) return WrongType(Path(prefix, key), "a string", *v);
  *out = std::string(StringOf(*v));
  return absl::OkStatus();
}

absl::Status ReadBool(const Value& obj, const char* key, std::string_view prefix, bool* out) {
  const Value* v = Find(obj, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->IsBool()) return WrongType(Path(prefix, key), "a boolean", *v);
  *out = v->GetBool();
  return absl::OkStatus();
}

absl::Status ReadDouble(const Value& obj, const char* key, std::optional<double>* out) {
  const Value* v = Find(obj, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->IsNumber()) return WrongType(key, "a number", *v);
  *out = v->GetDouble();
  return absl::OkStatus();
}

// An integral JSON number as int64: 16, 16.0 and 1.6e1 are accepted, 1.5 and
// numbers outside int64 are not.
absl::StatusOr<int64_t> ToInt(const Value& v, std::string_view path) {
  if (!v.IsNumber()) return WrongType(path, "an integer", v);
  if (v.IsInt64()) return v.GetInt64();
  if (v.IsUint64()) return InvalidRequest(path, absl::StrCat("'", Av(path), "' is out of range"));
  double d = v.GetDouble();
  if (d != std::floor(d)) {
    return InvalidRequest(path, absl::StrCat("'", Av(path), "' must be an integer, got ", d));
  }
  // 2^63 is exactly representable; anything at or beyond it does not fit.
  if (std::fabs(d) >= 9223372036854775808.0) {
    return InvalidRequest(path, absl::StrCat("'", Av(path), "' is out of range"));
  }
  return static_cast<int64_t>(d);
}

absl::Status ReadInt(const Value& obj, const char* key, std::optional<int64_t>* out) {
  const Value* v = Find(obj, key);
  if (v == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, ToInt(*v, key));
  return absl::OkStatus();
}

// Range checks. The message reads "'top_p' must be in (0, 1], got 0".
absl::Status CheckRange(const char* key, const std::optional<double>& v, double lo, bool lo_open, double hi,
                        bool hi_open) {
  if (!v.has_value()) return absl::OkStatus();
  bool ok = (lo_open ? *v > lo : *v >= lo) && (hi_open ? *v < hi : *v <= hi);
  if (ok) return absl::OkStatus();
  const char* hi_text = hi_open ? ")" : "]";
  std::string hi_value = std::isinf(hi) ? "inf" : absl::StrCat(hi);
  return InvalidRequest(
      key, absl::StrCat("'", key, "' must be in ", lo_open ? "(" : "[", lo, ", ", hi_value, hi_text, ", got ", *v));
}

absl::Status CheckIntRange(const char* key, const std::optional<int64_t>& v, int64_t lo, int64_t hi) {
  if (!v.has_value() || (*v >= lo && *v <= hi)) return absl::OkStatus();
  if (hi == std::numeric_limits<int64_t>::max()) {
    return InvalidRequest(key, absl::StrCat("'", key, "' must be at least ", lo, ", got ", *v));
  }
  return InvalidRequest(key, absl::StrCat("'", key, "' must be in [", lo, ", ", hi, "], got ", *v));
}

constexpr int64_t kIntMax = std::numeric_limits<int64_t>::max();

absl::StatusOr<rapidjson::Document> ParseObject(std::string_view body) {
  RETURN_IF_ERROR(CheckJsonDepth(body));
  rapidjson::Document doc;
  // Iterative: deeply nested input cannot overflow the stack. Validate
  // encoding: every string we keep is valid UTF-8.
  doc.Parse<rapidjson::kParseIterativeFlag | rapidjson::kParseValidateEncodingFlag>(body.data(), body.size());
  if (doc.HasParseError()) {
    return InvalidRequest("", absl::StrCat("Malformed JSON at offset ", doc.GetErrorOffset(), ": ",
                                           rapidjson::GetParseError_En(doc.GetParseError())));
  }
  if (!doc.IsObject()) {
    return InvalidRequest("", absl::StrCat("The request body must be a JSON object, got ", Av(TypeName(doc))));
  }
  return doc;
}

absl::StatusOr<std::string> ReadModel(const Value& obj) {
  const Value* v = Find(obj, "model");
  if (v == nullptr) return InvalidRequest("model", "Missing required field 'model'");
  if (!v->IsString()) return WrongType("model", "a string", *v);
  if (v->GetStringLength() == 0) return InvalidRequest("model", "'model' must not be empty");
  return std::string(StringOf(*v));
}

// The fields both endpoints share; `max_tokens` is handled by each caller.
constexpr std::string_view kSamplingKeys[] = {"model",
                                              "temperature",
                                              "top_p",
                                              "top_k",
                                              "min_p",
                                              "presence_penalty",
                                              "frequency_penalty",
                                              "repetition_penalty",
                                              "seed",
                                              "stop",
                                              "stop_token_ids",
                                              "n",
                                              "user",
                                              "stream",
                                              "stream_options",
                                              "ignore_eos",
                                              "min_tokens",
                                              "return_tokens_as_token_ids",
                                              "max_tokens"};

absl::Status ReadSampling(const Value& obj, SamplingFields* s) {
  RETURN_IF_ERROR(ReadDouble(obj, "temperature", &s->temperature));
  RETURN_IF_ERROR(CheckRange("temperature", s->temperature, 0, false, 2, false));
  RETURN_IF_ERROR(ReadDouble(obj, "top_p", &s->top_p));
  RETURN_IF_ERROR(CheckRange("top_p", s->top_p, 0, true, 1, false));
  RETURN_IF_ERROR(ReadInt(obj, "top_k", &s->top_k));
  RETURN_IF_ERROR(CheckIntRange("top_k", s->top_k, -1, kIntMax));
  if (s->top_k == 0) s->top_k = -1;  // 0 and -1 both mean "off"
  RETURN_IF_ERROR(ReadDouble(obj, "min_p", &s->min_p));
  RETURN_IF_ERROR(CheckRange("min_p", s->min_p, 0, false, 1, false));
  RETURN_IF_ERROR(ReadDouble(obj, "presence_penalty", &s->presence_penalty));
  RETURN_IF_ERROR(CheckRange("presence_penalty", s->presence_penalty, -2, false, 2, false));
  RETURN_IF_ERROR(ReadDouble(obj, "frequency_penalty", &s->frequency_penalty));
  RETURN_IF_ERROR(CheckRange("frequency_penalty", s->frequency_penalty, -2, false, 2, false));
  RETURN_IF_ERROR(ReadDouble(obj, "repetition_penalty", &s->repetition_penalty));
  RETURN_IF_ERROR(
      CheckRange("repetition_penalty", s->repetition_penalty, 0, true, std::numeric_limits<double>::infinity(), true));
  RETURN_IF_ERROR(ReadInt(obj, "seed", &s->seed));

  if (const Value* v = Find(obj, "stop")) {
    if (v->IsString()) {
      s->stop.emplace_back(StringOf(*v));
    } else if (v->IsArray()) {
      if (v->Size() > static_cast<unsigned>(kMaxStopSequences)) {
        return InvalidRequest(
            "stop", absl::StrCat("'stop' may hold at most ", kMaxStopSequences, " sequences, got ", v->Size()));
      }
      for (unsigned i = 0; i < v->Size(); ++i) {
        const Value& e = (*v)[i];
        if (!e.IsString()) return WrongType(Index("stop", i), "a string", e);
        s->stop.emplace_back(StringOf(e));
      }
    } else {
      return WrongType("stop", "a string or an array of strings", *v);
    }
    for (size_t i = 0; i < s->stop.size(); ++i) {
      if (s->stop[i].empty()) {
        std::string path = v->IsArray() ? Index("stop", i) : "stop";
        return InvalidRequest(path, "Stop sequences must not be empty");
      }
    }
  }
  if (const Value* v = Find(obj, "stop_token_ids")) {
    if (!v->IsArray()) return WrongType("stop_token_ids", "an array of integers", *v);
    for (unsigned i = 0; i < v->Size(); ++i) {
      std::string path = Index("stop_token_ids", i);
      ASSIGN_OR_RETURN(int64_t id, ToInt((*v)[i], path));
      if (id < 0) return InvalidRequest(path, absl::StrCat("'", path, "' must be >= 0"));
      s->stop_token_ids.push_back(id);
    }
  }

  std::optional<int64_t> n;
  RETURN_IF_ERROR(ReadInt(obj, "n", &n));
  RETURN_IF_ERROR(CheckIntRange("n", n, 1, kMaxN));
  s->n = n.value_or(1);

  std::optional<std::string> user;
  RETURN_IF_ERROR(ReadString(obj, "user", "", &user));
  s->user = user.value_or("");

  RETURN_IF_ERROR(ReadBool(obj, "stream", "", &s->stream));
  if (const Value* v = Find(obj, "stream_options")) {
    if (!v->IsObject()) return WrongType("stream_options", "an object", *v);
    if (!s->stream) {
      return InvalidRequest("stream_options", "'stream_options' may only be set when 'stream' is true");
    }
    RETURN_IF_ERROR(ReadBool(*v, "include_usage", "stream_options", &s->include_usage));
    RETURN_IF_ERROR(RejectUnknown(*v, "stream_options", {"include_usage"}));
  }
  RETURN_IF_ERROR(ReadBool(obj, "ignore_eos", "", &s->ignore_eos));
  std::optional<int64_t> min_tokens;
  RETURN_IF_ERROR(ReadInt(obj, "min_tokens", &min_tokens));
  RETURN_IF_ERROR(CheckIntRange("min_tokens", min_tokens, 0, kIntMax));
  s->min_tokens = min_tokens.value_or(0);
  RETURN_IF_ERROR(ReadBool(obj, "return_tokens_as_token_ids", "", &s->return_tokens_as_token_ids));

  RETURN_IF_ERROR(ReadInt(obj, "max_tokens", &s->max_tokens));
  RETURN_IF_ERROR(CheckIntRange("max_tokens", s->max_tokens, 1, kIntMax));
  return absl::OkStatus();
}

absl::StatusOr<Role> ParseRole(const Value& msg, const std::string& prefix) {
  std::string path = Path(prefix, "role");
  const Value* v = Find(msg, "role");
  if (v == nullptr) return InvalidRequest(path, absl::StrCat("Missing required field '", path, "'"));
  if (!v->IsString()) return WrongType(path, "a string", *v);
  std::string_view r = StringOf(*v);
  if (r == "system") return Role::kSystem;
  if (r == "user") return Role::kUser;
  if (r == "assistant") return Role::kAssistant;
  if (r == "tool") return Role::kTool;
  if (r == "developer") return Role::kDeveloper;
  return InvalidRequest(path, absl::StrCat("'", path, "' must be one of system, user, assistant, ",
                                           "tool, developer; got '", Av(r), "'"));
}

absl::StatusOr<ChatMessage> ParseMessage(const Value& msg, const std::string& prefix) {
  if (!msg.IsObject()) return WrongType(prefix, "an object", msg);
  ChatMessage out;
  ASSIGN_OR_RETURN(out.role, ParseRole(msg, prefix));
  std::string content_path = Path(prefix, "content");
  const Value* content = Find(msg, "content");
  if (content == nullptr) {
    // Only an assistant turn (one that carried tool_calls) may omit content.
    if (out.role != Role::kAssistant) {
      return InvalidRequest(content_path, absl::StrCat("Missing required field '", content_path, "'"));
    }
  } else if (content->IsString()) {
    out.content = std::string(StringOf(*content));
  } else if (content->IsArray()) {
    for (unsigned j = 0; j < content->Size(); ++j) {
      const Value& part = (*content)[j];
      std::string part_path = Index(content_path, j);
      if (!part.IsObject()) return WrongType(part_path, "an object", part);
      std::string type_path = Path(part_path, "type");
      const Value* type = Find(part, "type");
      if (type == nullptr) {
        return InvalidRequest(type_path, absl::StrCat("Missing required field '", type_path, "'"));
      }
      if (!type->IsString()) return WrongType(type_path, "a string", *type);
      if (StringOf(*type) != "text") {
        return InvalidRequest(type_path, absl::StrCat("Unsupported content part type '", Av(StringOf(*type)), "' at '",
                                                      type_path, "'; only 'text' is supported"));
      }
      std::string text_path = Path(part_path, "text");
      const Value* text = Find(part, "text");
      if (text == nullptr) {
        return InvalidRequest(text_path, absl::StrCat("Missing required field '", text_path, "'"));
      }
      if (!text->IsString()) return WrongType(text_path, "a string", *text);
      if (j > 0) out.content += "\n";
      out.content.append(StringOf(*text));
      RETURN_IF_ERROR(RejectUnknown(part, part_path, {"type", "text"}));
    }
  } else {
    return WrongType(content_path, "a string or an array of content parts", *content);
  }
  RETURN_IF_ERROR(ReadString(msg, "name", prefix, &out.name));
  RETURN_IF_ERROR(ReadString(msg, "tool_call_id", prefix, &out.tool_call_id));
  RETURN_IF_ERROR(RejectUnknown(msg, prefix, {"role", "content", "name", "tool_call_id"}));
  return out;
}

// Prompt forms: "text", ["text"], [1, 2], [[1, 2]].
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const Value& arr, const std::string& path) {
  std::vector<int32_t> ids;
  ids.reserve(arr.Size());
  for (unsigned i = 0; i < arr.Size(); ++i) {
    std::string p = Index(path, i);
    ASSIGN_OR_RETURN(int64_t id, ToInt(arr[i], p));
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return InvalidRequest(p, absl::StrCat("'", p, "' is not a valid token id: ", id));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  if (ids.empty()) return InvalidRequest(path, absl::StrCat("'", path, "' must not be empty"));
  return ids;
}

absl::StatusOr<Prompt> ParsePrompt(const Value& obj) {
  const Value* v = Find(obj, "prompt");
  if (v == nullptr) return InvalidRequest("prompt", "Missing required field 'prompt'");
  if (v->IsString()) {
    if (v->GetStringLength() == 0) return InvalidRequest("prompt", "'prompt' must not be empty");
    return Prompt(std::string(StringOf(*v)));
  }
  if (!v->IsArray()) {
    return WrongType("prompt", "a string, an array of token ids, or an array of one of those", *v);
  }
  if (v->Empty()) return InvalidRequest("prompt", "'prompt' must not be empty");
  const Value& first = (*v)[0];
  if (first.IsNumber()) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, ParseTokenIds(*v, "prompt"));
    return Prompt(std::move(ids));
  }
  if (v->Size() > 1) {
    return InvalidRequest("prompt", "Batched prompts are not supported; send one prompt per request");
  }
  if (first.IsString()) {
    if (first.GetStringLength() == 0) {
      return InvalidRequest("prompt[0]", "'prompt[0]' must not be empty");
    }
    return Prompt(std::string(StringOf(first)));
  }
  if (first.IsArray()) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, ParseTokenIds(first, "prompt[0]"));
    return Prompt(std::move(ids));
  }
  return WrongType("prompt[0]", "a string, a token id or an array of token ids", first);
}

// ---------------------------------------------------------------------------
// Writing.

void WriteString(JsonWriter& w, std::string_view s) {
  if (IsValidUtf8(s)) {
    w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
    return;
  }
  std::string fixed;
  AppendValidUtf8(s, /*final=*/true, &fixed);
  w.String(fixed.data(), static_cast<rapidjson::SizeType>(fixed.size()));
}

void WriteKey(JsonWriter& w, std::string_view key) { w.Key(key.data(), static_cast<rapidjson::SizeType>(key.size())); }

void WriteNullableString(JsonWriter& w, std::string_view s) {
  if (s.empty()) {
    w.Null();
  } else {
    WriteString(w, s);
  }
}

void WriteLogprob(JsonWriter& w, double lp) { w.Double(std::isnan(lp) || lp < kMinLogprob ? kMinLogprob : lp); }

// The text a token is shown as.
std::string TokenText(int32_t id, const std::string& token, bool as_ids) {
  return as_ids ? absl::StrCat("token_id:", id) : token;
}

// {token, logprob, bytes}; the caller closes the object.
void WriteTokenFields(JsonWriter& w, int32_t id, const std::string& token, double lp, bool as_ids) {
  std::string text = TokenText(id, token, as_ids);
  WriteKey(w, "token");
  WriteString(w, text);
  WriteKey(w, "logprob");
  WriteLogprob(w, lp);
  WriteKey(w, "bytes");
  w.StartArray();
  for (unsigned char c : text) w.Uint(c);
  w.EndArray();
}

void WriteChatLogprobs(JsonWriter& w, const std::vector<TokenLogprob>& tokens, bool as_ids) {
  w.StartObject();
  WriteKey(w, "content");
  w.StartArray();
  for (const TokenLogprob& t : tokens) {
    w.StartObject();
    WriteTokenFields(w, t.token_id, t.token, t.logprob, as_ids);
    WriteKey(w, "top_logprobs");
    w.StartArray();
    for (const TopLogprob& top : t.top_logprobs) {
      w.StartObject();
      WriteTokenFields(w, top.token_id, top.token, top.logprob, as_ids);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
}

// The legacy completions shape: {tokens, token_logprobs, top_logprobs: [{tok:
// lp}], text_offset}.
void WriteCompletionLogprobs(JsonWriter& w, const std::vector<TokenLogprob>& tokens, int64_t offset_base, bool as_ids) {
  w.StartObject();
  WriteKey(w, "tokens");
  w.StartArray();
  for (const TokenLogprob& t : tokens) WriteString(w, TokenText(t.token_id, t.token, as_ids));
  w.EndArray();
  WriteKey(w, "token_logprobs");
  w.StartArray();
  for (const TokenLogprob& t : tokens) WriteLogprob(w, t.logprob);
  w.EndArray();
  WriteKey(w, "top_logprobs");
  w.StartArray();
  for (const TokenLogprob& t : tokens) {
    w.StartObject();
    for (const TopLogprob& top : t.top_logprobs) {
      std::string text = TokenText(top.token_id, top.token, as_ids);
      std::string key;
      AppendValidUtf8(text, /*final=*/true, &key);
      WriteKey(w, key);
      WriteLogprob(w, top.logprob);
    }
    w.EndObject();
  }
  w.EndArray();
  WriteKey(w, "text_offset");
  w.StartArray();
  int64_t offset = offset_base;
  for (const TokenLogprob& t : tokens) {
    w.Int64(offset);
    offset += static_cast<int64_t>(t.token.size());
  }
  w.EndArray();
  w.EndObject();
}

void WriteUsage(JsonWriter& w, const Usage& u) {
  w.StartObject();
  WriteKey(w, "prompt_tokens");
  w.Int64(u.prompt_tokens);
  WriteKey(w, "completion_tokens");
  w.Int64(u.completion_tokens);
  WriteKey(w, "total_tokens");
  w.Int64(u.prompt_tokens + u.completion_tokens);
  WriteKey(w, "prompt_tokens_details");
  w.StartObject();
  WriteKey(w, "cached_tokens");
  w.Int64(u.cached_tokens);
  w.EndObject();
  w.EndObject();
}

void WriteHeader(JsonWriter& w, const ResponseHeader& h, std::string_view object) {
  WriteKey(w, "id");
  WriteString(w, h.id);
  WriteKey(w, "object");
  WriteString(w, object);
  WriteKey(w, "created");
  w.Int64(h.created);
  WriteKey(w, "model");
  WriteString(w, h.model);
}

void WriteFinishReason(JsonWriter& w, const std::optional<FinishReason>& reason) {
  if (reason.has_value()) {
    WriteString(w, FinishReasonName(*reason));
  } else {
    w.Null();
  }
}

std::string Sse(const rapidjson::StringBuffer& buf) {
  return absl::StrCat("data: ", absl::string_view(buf.GetString(), buf.GetSize()), "\n\n");
}

std::string ToString(const rapidjson::StringBuffer& buf) { return std::string(buf.GetString(), buf.GetSize()); }

}  // namespace

absl::Status InvalidRequest(std::string_view param, std::string_view message) {
  absl::Status status(absl::StatusCode::kInvalidArgument, Av(message));
  if (!param.empty()) status.SetPayload(kParamPayload, absl::Cord(Av(param)));
  return status;
}

absl::Status UnknownModelError(std::string_view model) {
  absl::Status status(absl::StatusCode::kNotFound, absl::StrCat("The model '", Av(model), "' does not exist"));
  status.SetPayload(kParamPayload, absl::Cord("model"));
  status.SetPayload(kCodePayload, absl::Cord("model_not_found"));
  return status;
}

absl::Status CheckJsonDepth(std::string_view json, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) {
        return InvalidRequest(
            "", absl::StrCat("The JSON body is nested more than ", max_depth, " levels deep (at offset ", i, ")"));
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return absl::OkStatus();
}

bool IsServerTemplateVariable(std::string_view name) {
  for (std::string_view owned : kServerTemplateVariables) {
    if (owned == name) return true;
  }
  return false;
}

ApiError ApiErrorFromStatus(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout_error";
      break;
    case absl::StatusCode::kUnimplemented:
      e.http_status = 501;
      e.type = "invalid_request_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  if (auto p = status.GetPayload(kParamPayload)) e.param = std::string(*p);
  if (auto c = status.GetPayload(kCodePayload)) e.code = std::string(*c);
  return e;
}

std::string ApiErrorJson(const ApiError& error) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteKey(w, "error");
  w.StartObject();
  WriteKey(w, "message");
  WriteString(w, error.message);
  WriteKey(w, "type");
  WriteString(w, error.type);
  WriteKey(w, "param");
  WriteNullableString(w, error.param);
  WriteKey(w, "code");
  WriteNullableString(w, error.code);
  w.EndObject();
  w.EndObject();
  return ToString(buf);
}

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kSystem:
      return "system";
    case Role::kUser:
      return "user";
    case Role::kAssistant:
      return "assistant";
    case Role::kTool:
      return "tool";
    case Role::kDeveloper:
      return "developer";
  }
  return "user";
}

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
  }
  return "stop";
}

namespace {

// `v` as the chat template's JSON, without recursion (its depth was bounded
// by ParseObject, but no recursion's depth is the client's to choose).
nlohmann::ordered_json ToTemplateJson(const Value& v) {
  nlohmann::ordered_json root;
  std::vector<std::pair<const Value*, nlohmann::ordered_json*>> todo = {{&v, &root}};
  while (!todo.empty()) {
    auto [from, to] = todo.back();
    todo.pop_back();
    if (from->IsObject()) {
      // Every key first: an insertion moves the members before it. Walked
      // back to front, so a repeated key ends with its last value.
      *to = nlohmann::ordered_json::object();
      for (auto it = from->MemberBegin(); it != from->MemberEnd(); ++it) (*to)[std::string(StringOf(it->name))];
      for (auto it = from->MemberEnd(); it != from->MemberBegin();) {
        --it;
        todo.emplace_back(&it->value, &(*to)[std::string(StringOf(it->name))]);
      }
    } else if (from->IsArray()) {
      *to = nlohmann::ordered_json::array();
      for (unsigned i = 0; i < from->Size(); ++i) to->push_back(nullptr);
      for (unsigned i = 0; i < from->Size(); ++i) todo.emplace_back(&(*from)[i], &(*to)[i]);
    } else if (from->IsString()) {
      *to = std::string(StringOf(*from));
    } else if (from->IsBool()) {
      *to = from->GetBool();
    } else if (from->IsInt64()) {
      *to = from->GetInt64();
    } else if (from->IsUint64()) {
      *to = from->GetUint64();
    } else if (from->IsNumber()) {
      *to = from->GetDouble();
    } else {
      *to = nullptr;
    }
  }
  return root;
}

// The conversation fields of a chat request (chat completions and
// /tokenize's messages form): messages, add_generation_prompt and
// chat_template_kwargs.
absl::Status ReadConversation(const Value& doc, ChatCompletionRequest* req) {
  const Value* messages = Find(doc, "messages");
  if (messages == nullptr) return InvalidRequest("messages", "Missing required field 'messages'");
  if (!messages->IsArray()) return WrongType("messages", "an array", *messages);
  if (messages->Empty()) return InvalidRequest("messages", "'messages' must not be empty");
  for (unsigned i = 0; i < messages->Size(); ++i) {
    ASSIGN_OR_RETURN(ChatMessage m, ParseMessage((*messages)[i], Index("messages", i)));
    req->messages.push_back(std::move(m));
  }
  RETURN_IF_ERROR(ReadBool(doc, "add_generation_prompt", "", &req->add_generation_prompt));
  if (const Value* v = Find(doc, "chat_template_kwargs")) {
    if (!v->IsObject()) return WrongType("chat_template_kwargs", "an object", *v);
    for (auto it = v->MemberBegin(); it != v->MemberEnd(); ++it) {
      std::string_view name = StringOf(it->name);
      if (!IsServerTemplateVariable(name)) continue;
      const std::string path = Path("chat_template_kwargs", name);
      return InvalidRequest(
          path, absl::StrCat("'", Av(path), "' sets a template variable the server owns; ",
                             name == "add_generation_prompt" ? "use the request's 'add_generation_prompt' field"
                                                             : "it cannot be overridden"));
    }
    req->chat_template_kwargs = ToTemplateJson(*v);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(std::string_view body) {
  ASSIGN_OR_RETURN(rapidjson::Document doc, ParseObject(body));
  ChatCompletionRequest req;
  ASSIGN_OR_RETURN(req.model, ReadModel(doc));
  RETURN_IF_ERROR(ReadConversation(doc, &req));

  RETURN_IF_ERROR(ReadSampling(doc, &req.sampling));
  std::optional<int64_t> max_completion_tokens;
  RETURN_IF_ERROR(ReadInt(doc, "max_completion_tokens", &max_completion_tokens));
  RETURN_IF_ERROR(CheckIntRange("max_completion_tokens", max_completion_tokens, 1, kIntMax));
  if (max_completion_tokens.has_value()) req.sampling.max_tokens = max_completion_tokens;

  RETURN_IF_ERROR(ReadBool(doc, "logprobs", "", &req.logprobs));
  RETURN_IF_ERROR(ReadInt(doc, "top_logprobs", &req.top_logprobs));
  RETURN_IF_ERROR(CheckIntRange("top_logprobs", req.top_logprobs, 0, kMaxTopLogprobs));
  if (req.top_logprobs.value_or(0) > 0 && !req.logprobs) {
    return InvalidRequest("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
  }

  RETURN_IF_ERROR(RejectUnknown(doc, "",
                                {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                 "add_generation_prompt", "chat_template_kwargs"},
                                kSamplingKeys));
  return req;
}

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(std::string_view body) {
  ASSIGN_OR_RETURN(rapidjson::Document doc, ParseObject(body));
  RETURN_IF_ERROR(RejectUnknown(doc, "",
                                {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                 "chat_template_kwargs", "return_token_strs"}));
  TokenizeRequest req;
  RETURN_IF_ERROR(ReadString(doc, "model", "", &req.model));
  const bool has_prompt = Find(doc, "prompt") != nullptr;
  const bool has_messages = Find(doc, "messages") != nullptr;
  if (has_prompt == has_messages) {
    return InvalidRequest(has_prompt ? "messages" : "prompt", "give exactly one of 'prompt' and 'messages'");
  }
  if (has_prompt) {
    RETURN_IF_ERROR(ReadString(doc, "prompt", "", &req.prompt));
    for (const char* key : {"add_generation_prompt", "chat_template_kwargs"}) {
      if (Find(doc, key) != nullptr) {
        return InvalidRequest(key, absl::StrCat("'", key, "' applies to 'messages', not to 'prompt'"));
      }
    }
  } else {
    req.chat.emplace();
    RETURN_IF_ERROR(ReadConversation(doc, &*req.chat));
  }
  bool flag = false;
  if (Find(doc, "add_special_tokens") != nullptr) {
    RETURN_IF_ERROR(ReadBool(doc, "add_special_tokens", "", &flag));
    req.add_special_tokens = flag;
  }
  RETURN_IF_ERROR(ReadBool(doc, "return_token_strs", "", &req.return_token_strs));
  return req;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(std::string_view body) {
  ASSIGN_OR_RETURN(rapidjson::Document doc, ParseObject(body));
  RETURN_IF_ERROR(RejectUnknown(doc, "", {"model", "tokens"}));
  DetokenizeRequest req;
  RETURN_IF_ERROR(ReadString(doc, "model", "", &req.model));
  const Value* tokens = Find(doc, "tokens");
  if (tokens == nullptr || !tokens->IsArray()) {
    return InvalidRequest("tokens", "'tokens' must be a list of token ids");
  }
  req.tokens.reserve(tokens->Size());
  for (rapidjson::SizeType i = 0; i < tokens->Size(); ++i) {
    ASSIGN_OR_RETURN(int64_t id, ToInt((*tokens)[i], absl::StrCat("tokens[", i, "]")));
    req.tokens.push_back(id);
  }
  return req;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body) {
  ASSIGN_OR_RETURN(rapidjson::Document doc, ParseObject(body));
  CompletionRequest req;
  ASSIGN_OR_RETURN(req.model, ReadModel(doc));
  ASSIGN_OR_RETURN(req.prompt, ParsePrompt(doc));
  if (Find(doc, "suffix") != nullptr) {
    return InvalidRequest("suffix", "'suffix' is not supported");
  }
  RETURN_IF_ERROR(ReadSampling(doc, &req.sampling));
  if (!req.sampling.max_tokens.has_value()) req.sampling.max_tokens = kDefaultCompletionMaxTokens;
  RETURN_IF_ERROR(ReadBool(doc, "echo", "", &req.echo));
  if (const Value* v = Find(doc, "logprobs")) {
    // Chat's boolean form is a common mistake: say which form is wanted.
    if (v->IsBool()) return WrongType("logprobs", "an integer", *v);
  }
  RETURN_IF_ERROR(ReadInt(doc, "logprobs", &req.logprobs));
  RETURN_IF_ERROR(CheckIntRange("logprobs", req.logprobs, 0, kMaxCompletionLogprobs));

  RETURN_IF_ERROR(RejectUnknown(doc, "", {"prompt", "suffix", "echo", "logprobs"}, kSamplingKeys));
  return req;
}

std::string ChatCompletionJson(const ResponseHeader& header, const std::vector<ChatChoice>& choices,
                               const Usage& usage) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteHeader(w, header, "chat.completion");
  WriteKey(w, "choices");
  w.StartArray();
  for (const ChatChoice& c : choices) {
    w.StartObject();
    WriteKey(w, "index");
    w.Int(c.index);
    WriteKey(w, "message");
    w.StartObject();
    WriteKey(w, "role");
    WriteString(w, "assistant");
    WriteKey(w, "content");
    WriteString(w, c.content);
    w.EndObject();
    WriteKey(w, "logprobs");
    if (c.logprobs.has_value()) {
      WriteChatLogprobs(w, *c.logprobs, header.tokens_as_ids);
    } else {
      w.Null();
    }
    WriteKey(w, "finish_reason");
    WriteFinishReason(w, c.finish_reason);
    w.EndObject();
  }
  w.EndArray();
  WriteKey(w, "usage");
  WriteUsage(w, usage);
  w.EndObject();
  return ToString(buf);
}

std::string CompletionJson(const ResponseHeader& header, const std::vector<CompletionChoice>& choices,
                           const Usage& usage) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteHeader(w, header, "text_completion");
  WriteKey(w, "choices");
  w.StartArray();
  for (const CompletionChoice& c : choices) {
    w.StartObject();
    WriteKey(w, "index");
    w.Int(c.index);
    WriteKey(w, "text");
    WriteString(w, c.text);
    WriteKey(w, "logprobs");
    if (c.logprobs.has_value()) {
      WriteCompletionLogprobs(w, *c.logprobs, c.text_offset_base, header.tokens_as_ids);
    } else {
      w.Null();
    }
    WriteKey(w, "finish_reason");
    WriteFinishReason(w, c.finish_reason);
    w.EndObject();
  }
  w.EndArray();
  WriteKey(w, "usage");
  WriteUsage(w, usage);
  w.EndObject();
  return ToString(buf);
}

std::string ChatLogprobsJson(const std::vector<TokenLogprob>& tokens, bool tokens_as_ids) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  WriteChatLogprobs(w, tokens, tokens_as_ids);
  return ToString(buf);
}

std::string ChatChunk(const ResponseHeader& header, const ChatDelta& delta) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteHeader(w, header, "chat.completion.chunk");
  WriteKey(w, "choices");
  w.StartArray();
  w.StartObject();
  WriteKey(w, "index");
  w.Int(delta.index);
  WriteKey(w, "delta");
  w.StartObject();
  if (delta.first) {
    WriteKey(w, "role");
    WriteString(w, "assistant");
  }
  // The closing chunk of OpenAI's streams has an empty delta.
  if (delta.first || !delta.content.empty()) {
    WriteKey(w, "content");
    WriteString(w, delta.content);
  }
  w.EndObject();
  WriteKey(w, "logprobs");
  if (delta.logprobs.has_value()) {
    WriteChatLogprobs(w, *delta.logprobs, header.tokens_as_ids);
  } else {
    w.Null();
  }
  WriteKey(w, "finish_reason");
  WriteFinishReason(w, delta.finish_reason);
  w.EndObject();
  w.EndArray();
  if (header.include_usage) {
    WriteKey(w, "usage");
    w.Null();
  }
  w.EndObject();
  return Sse(buf);
}

std::string CompletionChunk(const ResponseHeader& header, const CompletionDelta& delta) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteHeader(w, header, "text_completion");
  WriteKey(w, "choices");
  w.StartArray();
  w.StartObject();
  WriteKey(w, "index");
  w.Int(delta.index);
  WriteKey(w, "text");
  WriteString(w, delta.text);
  WriteKey(w, "logprobs");
  if (delta.logprobs.has_value()) {
    WriteCompletionLogprobs(w, *delta.logprobs, delta.text_offset_base, header.tokens_as_ids);
  } else {
    w.Null();
  }
  WriteKey(w, "finish_reason");
  WriteFinishReason(w, delta.finish_reason);
  w.EndObject();
  w.EndArray();
  if (header.include_usage) {
    WriteKey(w, "usage");
    w.Null();
  }
  w.EndObject();
  return Sse(buf);
}

std::string UsageChunk(const ResponseHeader& header, const Usage& usage, bool chat) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.StartObject();
  WriteHeader(w, header, chat ? "chat.completion.chunk" : "text_completion");
  WriteKey(w, "choices");
  w.StartArray();
  w.EndArray();
  WriteKey(w, "usage");
  WriteUsage(w, usage);
  w.EndObject();
  return Sse(buf);
}

std::string ErrorChunk(const ApiError& error) { return absl::StrCat("data: ", ApiErrorJson(error), "\n\n"); }

std::string DoneChunk() { return "data: [DONE]\n\n"; }

}  // namespace tandem::router
