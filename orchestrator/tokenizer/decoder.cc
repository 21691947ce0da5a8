#include "orchestrator/tokenizer/decoder.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/bpe_model.h"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {
namespace {

using nlohmann::json;

// Removes up to `start` leading and `stop` trailing copies of `c`.
void StripToken(std::string_view c, size_t start, size_t stop, std::string* token) {
  size_t begin = 0;
  for (size_t i = 0; i < start && token->compare(begin, c.size(), c) == 0; ++i) begin += c.size();
  size_t end = token->size();
  for (size_t i = 0; i < stop && end >= begin + c.size() && token->compare(end - c.size(), c.size(), c) == 0; ++i) {
    end -= c.size();
  }
  *token = token->substr(begin, end - begin);
}

}  // namespace

absl::Status Decoder::AddSteps(const json& config, const std::string& path, Decoder* out) {
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return InvalidTokenizerJson(path, "expected an object with a \"type\"");
  }
  const std::string type = config["type"].get<std::string>();
  if (out->fused_ && type != "Strip") {
    return InvalidTokenizerJson(path + ".type", absl::StrCat("\"", type, "\" after Fuse is not supported"));
  }
  if (type == "Sequence") {
    const auto it = config.find("decoders");
    if (it == config.end() || !it->is_array()) return InvalidTokenizerJson(path + ".decoders", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(AddSteps((*it)[i], absl::StrCat(path, ".decoders[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  if (type == "Replace") {
    const auto pattern = config.find("pattern");
    if (pattern == config.end() || !pattern->is_object() || !pattern->contains("String") ||
        !(*pattern)["String"].is_string() || (*pattern)["String"].get<std::string>().empty()) {
      return InvalidTokenizerJson(path + ".pattern",
                                  "expected {\"String\": non-empty} (Regex is not supported in decoders)");
    }
    const auto content = config.find("content");
    if (content == config.end() || !content->is_string())
      return InvalidTokenizerJson(path + ".content", "expected a string");
    out->steps_.push_back(Replace{(*pattern)["String"].get<std::string>(), content->get<std::string>()});
    return absl::OkStatus();
  }
  if (type == "ByteFallback") {
    out->steps_.push_back(ByteFallback{});
    return absl::OkStatus();
  }
  if (type == "Fuse") {
    out->fused_ = true;
    return absl::OkStatus();
  }
  if (type == "Strip") {
    // Real files strip one character; the bound keeps a fused stream's
    // accumulated count far from overflowing.
    constexpr size_t kMaxStrip = 1 << 16;
    ASSIGN_OR_RETURN(const size_t start, OptionalCount(config, "start", 0, kMaxStrip, path));
    ASSIGN_OR_RETURN(const size_t stop, OptionalCount(config, "stop", 0, kMaxStrip, path));
    Strip strip{config.value("content", " "), start, stop};
    if (!IsOneCharacter(strip.content)) return InvalidTokenizerJson(path + ".content", "expected one character");
    if (!out->fused_) {
      out->steps_.push_back(std::move(strip));
      return absl::OkStatus();
    }
    if (strip.stop != 0)
      return InvalidTokenizerJson(path + ".stop", "stripping the end of the fused text is not supported");
    if (out->stream_strip_.count > 0 && out->stream_strip_.content != strip.content) {
      return InvalidTokenizerJson(path, "a second Strip of another character after Fuse is not supported");
    }
    out->stream_strip_.content = strip.content;
    out->stream_strip_.count += strip.start;
    return absl::OkStatus();
  }
  if (type == "Metaspace") {
    Metaspace ms{config.value("replacement", "\xE2\x96\x81"), true};
    if (!IsOneCharacter(ms.replacement)) return InvalidTokenizerJson(path + ".replacement", "expected one character");
    ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(config, path));
    ms.drop_in_first = scheme != PrependScheme::kNever;
    out->first_token_differs_ = out->first_token_differs_ || ms.drop_in_first;
    out->steps_.push_back(std::move(ms));
    return absl::OkStatus();
  }
  return InvalidTokenizerJson(path + ".type", absl::StrCat("unsupported decoder \"", type, "\""));
}

absl::StatusOr<Decoder> Decoder::Create(const json& config) {
  Decoder d;
  RETURN_IF_ERROR(AddSteps(config, "decoder", &d));
  return d;
}

std::string Decoder::Decode(std::vector<std::string> tokens) const {
  for (const Step& step : steps_) {
    if (const auto* replace = std::get_if<Replace>(&step)) {
      for (std::string& t : tokens) t = ReplaceAll(t, replace->pattern, replace->content);
    } else if (std::holds_alternative<ByteFallback>(step)) {
      std::vector<std::string> out;
      out.reserve(tokens.size());
      std::string run;  // bytes of consecutive <0xXX> tokens
      size_t run_tokens = 0;
      auto flush = [&] {
        if (run_tokens == 0) return;
        if (IsValidUtf8(run)) {
          out.push_back(std::move(run));
        } else {
          for (size_t i = 0; i < run_tokens; ++i) out.emplace_back(kUtf8Replacement);
        }
        run.clear();
        run_tokens = 0;
      };
      for (std::string& t : tokens) {
        if (auto byte = ParseByteFallbackToken(t)) {
          run.push_back(static_cast<char>(*byte));
          ++run_tokens;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      tokens.swap(out);
    } else if (const auto* strip = std::get_if<Strip>(&step)) {
      for (std::string& t : tokens) StripToken(strip->content, strip->start, strip->stop, &t);
    } else {
      const auto& ms = std::get<Metaspace>(step);
      for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = ReplaceAll(tokens[i], ms.replacement, i == 0 && ms.drop_in_first ? "" : " ");
      }
    }
  }
  std::string text;
  for (const std::string& t : tokens) text += t;
  StripToken(stream_strip_.content, stream_strip_.count, 0, &text);
  return text;
}

std::string Decoder::TokenBytes(std::string_view token, bool first) const {
  std::string t(token);
  for (const Step& step : steps_) {
    if (const auto* replace = std::get_if<Replace>(&step)) {
      t = ReplaceAll(t, replace->pattern, replace->content);
    } else if (std::holds_alternative<ByteFallback>(step)) {
      if (auto byte = ParseByteFallbackToken(t)) t.assign(1, static_cast<char>(*byte));
    } else if (const auto* strip = std::get_if<Strip>(&step)) {
      StripToken(strip->content, strip->start, strip->stop, &t);
    } else {
      const auto& ms = std::get<Metaspace>(step);
      t = ReplaceAll(t, ms.replacement, first && ms.drop_in_first ? "" : " ");
    }
  }
  return t;
}

}  // namespace tandem::router
