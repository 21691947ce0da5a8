#include "orchestrator/tokenizer/json_steps.h"

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace tandem::router {

absl::Status InvalidTokenizerJson(absl::string_view path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json ", path, ": ", why));
}

absl::StatusOr<size_t> OptionalCount(const nlohmann::json& object, absl::string_view key, size_t fallback, size_t max,
                                     absl::string_view path) {
  const auto it = object.find(std::string(key));
  if (it == object.end()) return fallback;
  if (!it->is_number_unsigned() || it->get<uint64_t>() > max) {
    return InvalidTokenizerJson(absl::StrCat(path, ".", key), absl::StrCat("expected an integer from 0 to ", max));
  }
  return static_cast<size_t>(it->get<uint64_t>());
}

bool IsOneCharacter(std::string_view s) { return !s.empty() && Utf8SequenceLength(s) == static_cast<int>(s.size()); }

std::string ReplaceAll(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size() + text.size() / 4 * to.size());
  size_t last = 0;
  for (size_t pos = text.find(from); pos != std::string_view::npos; pos = text.find(from, last)) {
    out.append(text.substr(last, pos - last));
    out.append(to);
    last = pos + from.size();
  }
  out.append(text.substr(last));
  return out;
}

absl::StatusOr<PrependScheme> ParsePrependScheme(const nlohmann::json& metaspace, const std::string& path) {
  if (!metaspace.contains("prepend_scheme")) {
    return metaspace.value("add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
  }
  const std::string scheme = metaspace["prepend_scheme"].get<std::string>();
  if (scheme == "always") return PrependScheme::kAlways;
  if (scheme == "first") return PrependScheme::kFirst;
  if (scheme == "never") return PrependScheme::kNever;
  return InvalidTokenizerJson(path + ".prepend_scheme", absl::StrCat("unsupported prepend scheme \"", scheme, "\""));
}

}  // namespace tandem::router
