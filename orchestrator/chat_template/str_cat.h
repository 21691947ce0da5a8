// Cat / AppendCat: string concatenation that takes std::string_view.
// Debian's Abseil (20220623) has its own absl::string_view, which
// absl::StrCat requires; this interpreter works in std::string_view.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_STR_CAT_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_STR_CAT_H_

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/string_view.h"

namespace tandem::router::jinja {

inline void AppendPiece(std::string* out, std::string_view s) { out->append(s); }
inline void AppendPiece(std::string* out, const std::string& s) { out->append(s); }
inline void AppendPiece(std::string* out, const char* s) { out->append(s); }
// Status::message() is an absl::string_view.
inline void AppendPiece(std::string* out, absl::string_view s) { out->append(s.data(), s.size()); }
inline void AppendPiece(std::string* out, char c) { out->push_back(c); }
template <typename T,
          std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char> && !std::is_same_v<T, bool>, int> = 0>
void AppendPiece(std::string* out, T v) {
  out->append(std::to_string(v));
}

template <typename... Args>
void AppendCat(std::string* out, const Args&... args) {
  (AppendPiece(out, args), ...);
}

template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  AppendCat(&out, args...);
  return out;
}

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_STR_CAT_H_
