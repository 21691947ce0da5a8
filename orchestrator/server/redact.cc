#include "orchestrator/server/redact.h"

#include <algorithm>
#include <cctype>

namespace tandem::router {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

bool StartsWithIgnoreCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(s[i])) != std::tolower(static_cast<unsigned char>(prefix[i]))) {
      return false;
    }
  }
  return true;
}

// `s` with every `from` replaced by `to`.
std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s.substr(pos));
  return out;
}

// The length of ":digits" at `s`, or 0.
size_t PortLength(std::string_view s) {
  if (s.size() < 2 || s[0] != ':' || !IsDigit(s[1])) return 0;
  size_t n = 1;
  while (n < s.size() && IsDigit(s[n]) && n <= 6) ++n;
  return n;
}

// The length of a dotted quad at `s` (four runs of 1-3 digits), or 0.
size_t Ipv4Length(std::string_view s) {
  size_t i = 0;
  for (int part = 0; part < 4; ++part) {
    if (part > 0) {
      if (i >= s.size() || s[i] != '.') return 0;
      ++i;
    }
    size_t digits = 0;
    while (i < s.size() && IsDigit(s[i]) && digits < 3) ++i, ++digits;
    if (digits == 0) return 0;
  }
  if (i < s.size() && IsDigit(s[i])) return 0;
  return i;
}

// The length of "[v6]" or "%5Bv6%5D" at `s`, or 0.
size_t BracketedLength(std::string_view s) {
  std::string_view open, close;
  if (s.starts_with("[")) {
    open = "[", close = "]";
  } else if (StartsWithIgnoreCase(s, "%5B")) {
    open = "%5B", close = "%5D";
  } else {
    return 0;
  }
  size_t i = open.size();
  bool colon = false;
  while (i < s.size() &&
         (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == ':' || s[i] == '.' || s[i] == '%')) {
    if (StartsWithIgnoreCase(s.substr(i), close)) break;
    colon = colon || s[i] == ':';
    ++i;
  }
  if (!colon || !StartsWithIgnoreCase(s.substr(i), close)) return 0;
  return i + close.size();
}

}  // namespace

std::string RedactWorkers(std::string_view text, const std::vector<std::string>& known) {
  // Longest first, so "host:5000" goes before a "host:500" prefix of it.
  std::vector<std::string> names(known.begin(), known.end());
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  std::string s(text);
  for (const std::string& name : names) {
    if (!name.empty()) s = ReplaceAll(s, name, kRedactedWorker);
  }
  std::string out;
  out.reserve(s.size());
  std::string_view rest = s;
  while (!rest.empty()) {
    std::string_view scheme;
    for (std::string_view p : {"ipv4:", "ipv6:"}) {
      if (rest.starts_with(p)) scheme = p;
    }
    std::string_view body = rest.substr(scheme.size());
    size_t n = Ipv4Length(body);
    if (n == 0) n = BracketedLength(body);
    // An IPv4 address must start a word: "v1.2.3.4" is left alone (as a
    // whole it is not an address).
    const bool word_start = out.empty() || !(std::isalnum(static_cast<unsigned char>(out.back())) || out.back() == '.');
    if (n > 0 && (word_start || !scheme.empty() || body[0] == '[' || body[0] == '%')) {
      n += PortLength(body.substr(n));
      out += kRedactedWorker;
      rest.remove_prefix(scheme.size() + n);
      continue;
    }
    out.push_back(rest.front());
    rest.remove_prefix(1);
  }
  return out;
}

}  // namespace tandem::router
