#include "orchestrator/chat_template/lexer.h"

#include <cerrno>
#include <cstdlib>
#include <optional>

#include "absl/strings/str_format.h"
#include "orchestrator/chat_template/py_text.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

bool IsSpaceAt(std::string_view s, size_t pos, size_t* next) {
  *next = pos;
  return IsPySpace(NextCodePoint(s, next));
}

// Skips Python whitespace (`\s*`) from pos.
size_t SkipSpace(std::string_view s, size_t pos) {
  size_t next;
  while (pos < s.size() && IsSpaceAt(s, pos, &next)) pos = next;
  return pos;
}

bool AllSpace(std::string_view s) {
  size_t pos = 0;
  size_t next;
  while (pos < s.size()) {
    if (!IsSpaceAt(s, pos, &next)) return false;
    pos = next;
  }
  return true;
}

bool StartsWith(std::string_view s, size_t pos, std::string_view prefix) {
  return s.substr(pos, prefix.size()) == prefix;
}

// `(\d+_)*\d+` at pos: the end of the match, or npos.
size_t ScanDigits(std::string_view s, size_t pos) {
  if (pos >= s.size() || !IsDigit(s[pos])) return std::string_view::npos;
  while (pos < s.size() && IsDigit(s[pos])) ++pos;
  while (pos + 1 < s.size() && s[pos] == '_' && IsDigit(s[pos + 1])) {
    pos += 2;
    while (pos < s.size() && IsDigit(s[pos])) ++pos;
  }
  return pos;
}

std::string WithoutUnderscores(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != '_') out.push_back(c);
  }
  return out;
}

// Jinja's float_re at pos: digits with a fraction, an exponent or both.
size_t ScanFloat(std::string_view s, size_t pos) {
  if (pos > 0 && s[pos - 1] == '.') return std::string_view::npos;
  const size_t whole = ScanDigits(s, pos);
  if (whole == std::string_view::npos) return whole;
  auto exponent = [&](size_t at) -> size_t {
    if (at >= s.size() || (s[at] != 'e' && s[at] != 'E')) return std::string_view::npos;
    ++at;
    if (at < s.size() && (s[at] == '+' || s[at] == '-')) ++at;
    return ScanDigits(s, at);
  };
  size_t fraction = std::string_view::npos;
  if (whole < s.size() && s[whole] == '.') fraction = ScanDigits(s, whole + 1);
  if (fraction != std::string_view::npos) {
    const size_t end = exponent(fraction);
    if (end != std::string_view::npos) return end;
  }
  const size_t end = exponent(whole);
  if (end != std::string_view::npos) return end;
  return fraction;
}

// Jinja's integer_re at pos (binary, octal, hex, decimal), or npos.
size_t ScanInteger(std::string_view s, size_t pos, int* base) {
  auto digit_in_base = [](char c, int b) {
    if (b == 2) return c == '0' || c == '1';
    if (b == 8) return c >= '0' && c <= '7';
    return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
  };
  if (pos + 1 < s.size() && s[pos] == '0') {
    const char p = static_cast<char>(s[pos + 1] | 0x20);
    const int b = p == 'b' ? 2 : p == 'o' ? 8 : p == 'x' ? 16 : 0;
    if (b != 0) {
      size_t at = pos + 2;
      size_t end = std::string_view::npos;
      while (true) {  // (_?[digit])+
        size_t next = at;
        if (next < s.size() && s[next] == '_') ++next;
        if (next >= s.size() || !digit_in_base(s[next], b)) break;
        at = next + 1;
        end = at;
      }
      if (end != std::string_view::npos) {
        *base = b;
        return end;
      }
    }
  }
  if (pos >= s.size() || !IsDigit(s[pos])) return std::string_view::npos;
  *base = 10;
  const bool zero = s[pos] == '0';
  size_t at = pos + 1;
  while (true) {  // [1-9](_?\d)* or 0(_?0)*
    size_t next = at;
    if (next < s.size() && s[next] == '_') ++next;
    if (next >= s.size() || !IsDigit(s[next]) || (zero && s[next] != '0')) break;
    at = next + 1;
  }
  return at;
}

// Identifiers: ASCII or Unicode letters, digits and '_' (Python's \w), not
// starting with a digit (digits lex as numbers first).
bool IsNameStart(char32_t c) {
  return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= 0x80 && IsPyWordChar(c));
}

// Decodes a string literal's body as Python's "unicode-escape" codec does
// after Jinja's backslashreplace: a backslash before a non-ASCII character
// yields that character's \x / \u / \U escape text.
absl::Status Unescape(std::string_view body, std::string* out) {
  auto hex = [&](size_t at, int n, char32_t* value) {
    if (at + n > body.size()) return false;
    *value = 0;
    for (int i = 0; i < n; ++i) {
      const char c = body[at + i];
      int d;
      if (IsDigit(c)) {
        d = c - '0';
      } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') {
        d = (c | 0x20) - 'a' + 10;
      } else {
        return false;
      }
      *value = *value * 16 + d;
    }
    return true;
  };
  size_t pos = 0;
  while (pos < body.size()) {
    const char c = body[pos];
    if (c != '\\') {
      out->push_back(c);
      ++pos;
      continue;
    }
    if (pos + 1 >= body.size()) return absl::InvalidArgumentError("\\ at end of string");
    const char e = body[pos + 1];
    pos += 2;
    switch (e) {
      case '\n':
        break;
      case '\\':
        out->push_back('\\');
        break;
      case '\'':
        out->push_back('\'');
        break;
      case '"':
        out->push_back('"');
        break;
      case 'a':
        out->push_back('\a');
        break;
      case 'b':
        out->push_back('\b');
        break;
      case 'f':
        out->push_back('\f');
        break;
      case 'n':
        out->push_back('\n');
        break;
      case 'r':
        out->push_back('\r');
        break;
      case 't':
        out->push_back('\t');
        break;
      case 'v':
        out->push_back('\v');
        break;
      case 'x':
      case 'u':
      case 'U': {
        const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        char32_t value;
        if (!hex(pos, n, &value)) {
          return absl::InvalidArgumentError(Cat("truncated \\", std::string(1, e), std::string(n, 'X'), " escape"));
        }
        if (value > 0x10FFFF) return absl::InvalidArgumentError("illegal Unicode character");
        // A lone surrogate cannot be UTF-8; Python would fail on output.
        if (value >= 0xD800 && value <= 0xDFFF) value = 0xFFFD;
        AppendUtf8(value, out);
        pos += n;
        break;
      }
      case 'N':
        return absl::InvalidArgumentError("\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          char32_t value = e - '0';
          for (int i = 0; i < 2 && pos < body.size() && body[pos] >= '0' && body[pos] <= '7'; ++i) {
            value = value * 8 + (body[pos++] - '0');
          }
          AppendUtf8(value, out);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          size_t at = pos - 1;
          const char32_t cp = NextCodePoint(body, &at);
          pos = at;
          out->append(cp <= 0xff     ? absl::StrFormat("\\x%02x", static_cast<unsigned>(cp))
                      : cp <= 0xffff ? absl::StrFormat("\\u%04x", static_cast<unsigned>(cp))
                                     : absl::StrFormat("\\U%08x", static_cast<unsigned>(cp)));
        } else {
          out->push_back('\\');
          out->push_back(e);
        }
    }
  }
  return absl::OkStatus();
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(source) {}

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    while (pos < src_.size()) {
      const size_t tag = FindTagStart(pos);
      if (tag == std::string_view::npos) {
        AddData(pos, src_.substr(pos));
        break;
      }
      const char kind = src_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      const size_t raw_end = kind == '%' ? MatchRawBegin(after) : std::string_view::npos;
      AddData(pos, StripBeforeTag(src_.substr(pos, tag - pos), sign, kind != '{'));
      if (raw_end != std::string_view::npos) {
        line_starting_ = src_[raw_end - 1] == '\n';
        absl::StatusOr<size_t> next = LexRaw(tag, raw_end);
        if (!next.ok()) return next.status();
        pos = *next;
      } else if (kind == '#') {
        const size_t end = MatchCommentEnd(after);
        if (end == std::string_view::npos) return SyntaxError(src_, tag, "missing end of comment tag");
        pos = end;
        line_starting_ = src_[pos - 1] == '\n';
      } else {
        absl::StatusOr<size_t> next = LexTag(tag, after, kind == '%');
        if (!next.ok()) return next.status();
        pos = *next;
      }
    }
    tokens_.push_back(Token{TokenType::kEof, src_.size(), {}});
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string_view::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string_view::npos;
  }

  // Whitespace control of the text before a tag (Jinja's OptionalLStrip).
  std::string_view StripBeforeTag(std::string_view text, char sign, bool lstrip_applies) const {
    if (sign == '-') return PyStrip(text, std::nullopt, false, true);
    if (sign == '+' || !lstrip_applies) return text;
    const size_t newline = text.rfind('\n');
    const size_t line_start = newline == std::string_view::npos ? 0 : newline + 1;
    if ((line_start > 0 || line_starting_) && line_start < text.size() && AllSpace(text.substr(line_start))) {
      return text.substr(0, line_start);
    }
    return text;
  }

  void AddData(size_t offset, std::string_view text) {
    if (text.empty()) return;
    tokens_.push_back(Token{TokenType::kData, offset, std::string(text)});
  }

  // `\s*raw\s*(-%}\s*|%})` after "{%" and its sign: the end, or npos.
  size_t MatchRawBegin(size_t pos) const {
    pos = SkipSpace(src_, pos);
    if (!StartsWith(src_, pos, "raw")) return std::string_view::npos;
    pos = SkipSpace(src_, pos + 3);
    if (StartsWith(src_, pos, "-%}")) return SkipSpace(src_, pos + 3);
    if (StartsWith(src_, pos, "%}")) return pos + 2;
    return std::string_view::npos;
  }

  absl::StatusOr<size_t> LexRaw(size_t tag, size_t body_start) {
    for (size_t at = src_.find("{%", body_start); at != std::string_view::npos; at = src_.find("{%", at + 1)) {
      size_t pos = at + 2;
      char sign = 0;
      if (pos < src_.size() && (src_[pos] == '-' || src_[pos] == '+')) sign = src_[pos++];
      pos = SkipSpace(src_, pos);
      if (!StartsWith(src_, pos, "endraw")) continue;
      pos = SkipSpace(src_, pos + 6);
      size_t end;
      if (StartsWith(src_, pos, "+%}")) {
        end = pos + 3;
      } else if (StartsWith(src_, pos, "-%}")) {
        end = SkipSpace(src_, pos + 3);
      } else if (StartsWith(src_, pos, "%}")) {
        end = pos + 2;
        if (end < src_.size() && src_[end] == '\n') ++end;
      } else {
        continue;
      }
      AddData(body_start, StripBeforeTag(src_.substr(body_start, at - body_start), sign, true));
      line_starting_ = src_[end - 1] == '\n';
      return end;
    }
    return SyntaxError(src_, tag, "missing end of raw directive");
  }

  // The end of `(.*?)(\+#}|-#}\s*|#}\n?)` from pos, or npos.
  size_t MatchCommentEnd(size_t pos) const {
    for (; pos < src_.size(); ++pos) {
      if (StartsWith(src_, pos, "+#}")) return pos + 3;
      if (StartsWith(src_, pos, "-#}")) return SkipSpace(src_, pos + 3);
      if (StartsWith(src_, pos, "#}")) {
        return pos + 2 < src_.size() && src_[pos + 2] == '\n' ? pos + 3 : pos + 2;
      }
    }
    return std::string_view::npos;
  }

  // The tag end at pos when brackets are balanced: its end, or npos.
  size_t MatchTagEnd(size_t pos, bool block) const {
    if (block) {
      if (StartsWith(src_, pos, "+%}")) return pos + 3;
      if (StartsWith(src_, pos, "-%}")) return SkipSpace(src_, pos + 3);
      if (StartsWith(src_, pos, "%}")) return pos + 2 < src_.size() && src_[pos + 2] == '\n' ? pos + 3 : pos + 2;
    } else {
      if (StartsWith(src_, pos, "-}}")) return SkipSpace(src_, pos + 3);
      if (StartsWith(src_, pos, "}}")) return pos + 2;
    }
    return std::string_view::npos;
  }

  absl::StatusOr<size_t> LexTag(size_t tag, size_t pos, bool block) {
    tokens_.push_back(Token{block ? TokenType::kBlockBegin : TokenType::kVariableBegin, tag, {}});
    std::vector<char> balance;
    while (pos < src_.size()) {
      if (balance.empty()) {
        const size_t end = MatchTagEnd(pos, block);
        if (end != std::string_view::npos) {
          tokens_.push_back(Token{block ? TokenType::kBlockEnd : TokenType::kVariableEnd, pos, {}});
          line_starting_ = src_[end - 1] == '\n';
          return end;
        }
      }
      size_t next;
      if (IsSpaceAt(src_, pos, &next)) {
        pos = SkipSpace(src_, pos);
        continue;
      }
      if (size_t end = ScanFloat(src_, pos); end != std::string_view::npos) {
        Token t{TokenType::kFloat, pos, std::string(src_.substr(pos, end - pos))};
        t.float_value = std::strtod(WithoutUnderscores(t.text).c_str(), nullptr);
        tokens_.push_back(std::move(t));
        pos = end;
        continue;
      }
      int base = 10;
      if (size_t end = ScanInteger(src_, pos, &base); end != std::string_view::npos) {
        Token t{TokenType::kInteger, pos, std::string(src_.substr(pos, end - pos))};
        std::string digits = WithoutUnderscores(t.text);
        if (base != 10) digits = digits.substr(2);
        errno = 0;
        const unsigned long long value = std::strtoull(digits.c_str(), nullptr, base);
        if (errno == ERANGE || value > static_cast<unsigned long long>(INT64_MAX)) {
          return SyntaxError(src_, pos, "integer literal too large (only 64-bit integers are supported)");
        }
        t.int_value = static_cast<int64_t>(value);
        tokens_.push_back(std::move(t));
        pos = end;
        continue;
      }
      size_t at = pos;
      const char32_t c = NextCodePoint(src_, &at);
      if (IsNameStart(c)) {
        size_t end = at;
        while (end < src_.size()) {
          size_t n = end;
          if (!IsPyWordChar(NextCodePoint(src_, &n))) break;
          end = n;
        }
        tokens_.push_back(Token{TokenType::kName, pos, std::string(src_.substr(pos, end - pos))});
        pos = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t end = pos + 1;
        while (end < src_.size() && src_[end] != static_cast<char>(c)) end += src_[end] == '\\' ? 2 : 1;
        if (end < src_.size()) {
          Token t{TokenType::kString, pos, {}};
          if (absl::Status s = Unescape(src_.substr(pos + 1, end - pos - 1), &t.text); !s.ok()) {
            return SyntaxError(src_, pos, std::string(s.message()));
          }
          tokens_.push_back(std::move(t));
          pos = end + 1;
          continue;
        }
      }
      static constexpr std::string_view kTwoCharOps[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string_view op;
      for (std::string_view candidate : kTwoCharOps) {
        if (StartsWith(src_, pos, candidate)) op = candidate;
      }
      if (op.empty() && std::string_view("+-/*%~[](){}><=.:|,;").find(static_cast<char>(c)) != std::string_view::npos &&
          c < 0x80) {
        op = src_.substr(pos, 1);
      }
      if (op.empty()) {
        std::string shown;
        AppendUtf8(c, &shown);
        return SyntaxError(src_, pos, Cat("unexpected character '", shown, "'"));
      }
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) return SyntaxError(src_, pos, Cat("unexpected '", op, "'"));
        if (balance.back() != op[0]) {
          return SyntaxError(src_, pos, Cat("unexpected '", op, "', expected '", std::string(1, balance.back()), "'"));
        }
        balance.pop_back();
      }
      tokens_.push_back(Token{TokenType::kOperator, pos, std::string(op)});
      pos += op.size();
    }
    return pos;  // The tag is not closed: the parser reports the end of the template.
  }

  std::string_view src_;
  std::vector<Token> tokens_;
  // Whether the last match ended a line: lstrip_blocks applies at the
  // start of the text that follows (Jinja's `line_starting`).
  bool line_starting_ = true;
};

}  // namespace

std::string NormalizeSource(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source) { return Lexer(source).Run(); }

int LineOf(std::string_view source, size_t offset) {
  int line = 1;
  for (size_t i = 0; i < offset && i < source.size(); ++i) line += source[i] == '\n';
  return line;
}

absl::Status SyntaxError(std::string_view source, size_t offset, std::string_view message) {
  offset = std::min(offset, source.size());
  const size_t newline = source.rfind('\n', offset == 0 ? 0 : offset - 1);
  const size_t line_start = newline == std::string_view::npos || newline >= offset ? 0 : newline + 1;
  const size_t column = CodePointCount(source.substr(line_start, offset - line_start)) + 1;
  return absl::InvalidArgumentError(
      Cat("chat template: line ", LineOf(source, offset), " col ", column, ": ", message));
}

}  // namespace tandem::router::jinja
