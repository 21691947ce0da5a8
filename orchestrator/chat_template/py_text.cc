#include "orchestrator/chat_template/py_text.h"

#include <algorithm>
#include <cstdio>

#include "common/utf8.h"
#include "unicode/casemap.h"
#include "unicode/locid.h"
#include "unicode/stringoptions.h"
#include "unicode/uchar.h"
#include "unicode/unistr.h"

namespace tandem::router::jinja {
namespace {

// Decodes the code point that ends at s.size(), not before `floor`; sets
// *start to where it begins. A stray byte reads as U+FFFD.
char32_t PrevCodePoint(std::string_view s, size_t floor, size_t* start) {
  size_t lead = s.size() - 1;
  while (lead > floor && s.size() - lead < 4 && (static_cast<unsigned char>(s[lead]) & 0xC0) == 0x80) --lead;
  size_t pos = lead;
  const char32_t c = NextCodePoint(s, &pos);
  if (pos != s.size()) {
    *start = s.size() - 1;
    return 0xFFFD;
  }
  *start = lead;
  return c;
}

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

struct CodePoint {
  char32_t cp;
  size_t begin;
  size_t end;
};

std::vector<CodePoint> Decode(std::string_view s) {
  std::vector<CodePoint> out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t begin = pos;
    const char32_t cp = NextCodePoint(s, &pos);
    out.push_back({cp, begin, pos});
  }
  return out;
}

std::string IcuUpper(std::string_view s) {
  std::string out;
  icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())))
      .toUpper(icu::Locale::getRoot())
      .toUTF8String(out);
  return out;
}

std::string IcuLower(std::string_view s) {
  std::string out;
  icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())))
      .toLower(icu::Locale::getRoot())
      .toUTF8String(out);
  return out;
}

// The full titlecase mapping of one code point (e.g. "ǆ" -> "ǅ", "ß" -> "Ss").
void AppendTitleOf(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp >= 'a' && cp <= 'z' ? cp - 32 : cp));
    return;
  }
  const icu::UnicodeString src(static_cast<UChar32>(cp));
  UChar buf[16];
  UErrorCode status = U_ZERO_ERROR;
  const int32_t n =
      icu::CaseMap::toTitle("", U_TITLECASE_WHOLE_STRING | U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT,
                            nullptr, src.getBuffer(), src.length(), buf, 16, nullptr, status);
  if (U_FAILURE(status)) {
    AppendUtf8(cp, out);
    return;
  }
  icu::UnicodeString(buf, n).toUTF8String(*out);
}

void AppendLowerOf(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp));
    return;
  }
  icu::UnicodeString(static_cast<UChar32>(cp)).toLower(icu::Locale::getRoot()).toUTF8String(*out);
}

void AppendUpperOf(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp >= 'a' && cp <= 'z' ? cp - 32 : cp));
    return;
  }
  icu::UnicodeString(static_cast<UChar32>(cp)).toUpper(icu::Locale::getRoot()).toUTF8String(*out);
}

bool IsCased(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED); }
bool IsLowerCp(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_LOWERCASE); }
bool IsUpperCp(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_UPPERCASE); }
bool IsTitleCp(char32_t c) { return u_charType(static_cast<UChar32>(c)) == U_TITLECASE_LETTER; }
bool IsAlphaCp(char32_t c) { return u_isalpha(static_cast<UChar32>(c)); }
int NumericType(char32_t c) { return u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE); }

bool IsPrintable(char32_t c) {
  if (c == ' ') return true;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

bool IsLineBreak(char32_t c) {
  switch (c) {
    case '\n':
    case '\r':
    case 0x0b:
    case 0x0c:
    case 0x1c:
    case 0x1d:
    case 0x1e:
    case 0x85:
    case 0x2028:
    case 0x2029:
      return true;
    default:
      return false;
  }
}

template <typename Pred>
bool AllCodePoints(std::string_view s, Pred pred) {
  if (s.empty()) return false;
  size_t pos = 0;
  while (pos < s.size()) {
    if (!pred(NextCodePoint(s, &pos))) return false;
  }
  return true;
}

}  // namespace

char32_t NextCodePoint(std::string_view s, size_t* pos) {
  const unsigned char c0 = static_cast<unsigned char>(s[*pos]);
  if (c0 < 0x80) {
    ++*pos;
    return c0;
  }
  const int len = Utf8SequenceLength(s.substr(*pos));
  if (len <= 0) {
    ++*pos;
    return 0xFFFD;
  }
  char32_t cp = c0 & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (int i = 1; i < len; ++i) cp = (cp << 6) | (static_cast<unsigned char>(s[*pos + i]) & 0x3F);
  *pos += len;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t CodePointCount(std::string_view s) {
  if (IsAscii(s)) return s.size();
  size_t n = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    NextCodePoint(s, &pos);
    ++n;
  }
  return n;
}

std::vector<size_t> CodePointOffsets(std::string_view s) {
  std::vector<size_t> out;
  out.reserve(s.size() + 1);
  size_t pos = 0;
  while (pos < s.size()) {
    out.push_back(pos);
    NextCodePoint(s, &pos);
  }
  out.push_back(s.size());
  return out;
}

bool IsPySpace(char32_t c) {
  switch (c) {
    case ' ':
    case '\t':
    case '\n':
    case '\r':
    case 0x0b:
    case 0x0c:
    case 0x1c:
    case 0x1d:
    case 0x1e:
    case 0x1f:
    case 0x85:
    case 0xa0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202f:
    case 0x205f:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200a;
  }
}

bool IsPyWordChar(char32_t c) {
  if (c < 0x80) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  }
  return IsAlphaCp(c) || NumericType(c) != U_NT_NONE;
}

bool PyIsDigit(std::string_view s) {
  return AllCodePoints(s, [](char32_t c) {
    const int t = NumericType(c);
    return t == U_NT_DECIMAL || t == U_NT_DIGIT;
  });
}
bool PyIsAlpha(std::string_view s) { return AllCodePoints(s, IsAlphaCp); }
bool PyIsAlnum(std::string_view s) {
  return AllCodePoints(s, [](char32_t c) { return IsAlphaCp(c) || NumericType(c) != U_NT_NONE; });
}
bool PyIsDecimal(std::string_view s) {
  return AllCodePoints(s, [](char32_t c) { return NumericType(c) == U_NT_DECIMAL; });
}
bool PyIsNumeric(std::string_view s) {
  return AllCodePoints(s, [](char32_t c) { return NumericType(c) != U_NT_NONE; });
}
bool PyIsSpace(std::string_view s) { return AllCodePoints(s, IsPySpace); }

bool PyIsLower(std::string_view s) {
  bool cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (IsUpperCp(c) || IsTitleCp(c)) return false;
    if (IsLowerCp(c)) cased = true;
  }
  return cased;
}

bool PyIsUpper(std::string_view s) {
  bool cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (IsLowerCp(c) || IsTitleCp(c)) return false;
    if (IsUpperCp(c)) cased = true;
  }
  return cased;
}

std::string PyDecimalsToAscii(std::string_view s) {
  if (IsAscii(s)) return std::string(s);
  std::string out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    const char32_t c = NextCodePoint(s, &pos);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (IsPySpace(c)) {
      out.push_back(' ');
    } else if (u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER) {
      out.push_back(static_cast<char>('0' + u_charDigitValue(static_cast<UChar32>(c))));
    } else {
      out.append(s.substr(start, pos - start));  // Not a digit: the parse fails on it.
    }
  }
  return out;
}

std::string_view PyStrip(std::string_view s, std::optional<std::string_view> chars, bool left, bool right) {
  std::vector<char32_t> set;
  if (chars) {
    size_t pos = 0;
    while (pos < chars->size()) set.push_back(NextCodePoint(*chars, &pos));
  }
  auto strip = [&](char32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : IsPySpace(c); };
  size_t begin = 0;
  if (left) {
    while (begin < s.size()) {
      size_t next = begin;
      if (!strip(NextCodePoint(s, &next))) break;
      begin = next;
    }
  }
  size_t end = s.size();
  if (right && begin < end) {
    while (end > begin) {
      size_t start = end;
      const char32_t c = PrevCodePoint(s.substr(0, end), begin, &start);
      if (!strip(c)) break;
      end = start;
    }
  }
  return s.substr(begin, end - begin);
}

std::vector<std::string_view> PySplit(std::string_view s, std::optional<std::string_view> sep, int64_t maxsplit) {
  std::vector<std::string_view> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    size_t start = 0;
    while (maxsplit-- > 0) {
      const size_t hit = s.find(*sep, start);
      if (hit == std::string_view::npos) break;
      out.push_back(s.substr(start, hit - start));
      start = hit + sep->size();
    }
    out.push_back(s.substr(start));
    return out;
  }
  const std::vector<CodePoint> cps = Decode(s);
  const size_t n = cps.size();
  size_t i = 0;
  while (maxsplit-- > 0) {
    while (i < n && IsPySpace(cps[i].cp)) ++i;
    if (i == n) break;
    const size_t j = i++;
    while (i < n && !IsPySpace(cps[i].cp)) ++i;
    out.push_back(s.substr(cps[j].begin, (i < n ? cps[i].begin : s.size()) - cps[j].begin));
  }
  if (i < n) {
    while (i < n && IsPySpace(cps[i].cp)) ++i;
    if (i < n) out.push_back(s.substr(cps[i].begin));
  }
  return out;
}

std::vector<std::string_view> PyRSplit(std::string_view s, std::optional<std::string_view> sep, int64_t maxsplit) {
  std::vector<std::string_view> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    size_t end = s.size();
    while (maxsplit-- > 0) {
      if (end < sep->size()) break;
      const size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      out.push_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    out.push_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  const std::vector<CodePoint> cps = Decode(s);
  int64_t i = static_cast<int64_t>(cps.size()) - 1;
  while (maxsplit-- > 0) {
    while (i >= 0 && IsPySpace(cps[i].cp)) --i;
    if (i < 0) break;
    const int64_t j = i--;
    while (i >= 0 && !IsPySpace(cps[i].cp)) --i;
    const size_t begin = cps[i + 1].begin;
    out.push_back(s.substr(begin, cps[j].end - begin));
  }
  if (i >= 0) {
    while (i >= 0 && IsPySpace(cps[i].cp)) --i;
    if (i >= 0) out.push_back(s.substr(0, cps[i].end));
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string_view> PySplitLines(std::string_view s, bool keepends) {
  std::vector<std::string_view> out;
  size_t line_start = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t cp_start = pos;
    const char32_t c = NextCodePoint(s, &pos);
    if (!IsLineBreak(c)) continue;
    if (c == '\r' && pos < s.size() && s[pos] == '\n') ++pos;
    out.push_back(s.substr(line_start, (keepends ? pos : cp_start) - line_start));
    line_start = pos;
  }
  if (line_start < s.size()) out.push_back(s.substr(line_start));
  return out;
}

std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text, int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old_text.empty()) {
    size_t pos = 0;
    while (pos < s.size()) {
      if (count > 0) {
        out.append(new_text);
        --count;
      }
      const size_t start = pos;
      NextCodePoint(s, &pos);
      out.append(s.substr(start, pos - start));
    }
    if (count > 0) out.append(new_text);
    return out;
  }
  size_t start = 0;
  while (count-- > 0) {
    const size_t hit = s.find(old_text, start);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(start, hit - start));
    out.append(new_text);
    start = hit + old_text.size();
  }
  out.append(s.substr(start));
  return out;
}

int64_t PyCount(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(CodePointCount(s)) + 1;
  int64_t n = 0;
  for (size_t hit = s.find(sub); hit != std::string_view::npos; hit = s.find(sub, hit + sub.size())) ++n;
  return n;
}

std::string PyUpper(std::string_view s) {
  if (!IsAscii(s)) return IcuUpper(s);
  std::string out(s);
  for (char& c : out) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  }
  return out;
}

std::string PyLower(std::string_view s) {
  if (!IsAscii(s)) return IcuLower(s);
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  }
  return out;
}

std::string PyTitle(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool previous_is_cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (previous_is_cased) {
      AppendLowerOf(c, &out);
    } else {
      AppendTitleOf(c, &out);
    }
    previous_is_cased = c < 0x80 ? ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') : IsCased(c);
  }
  return out;
}

std::string PyCapitalize(std::string_view s) {
  if (s.empty()) return std::string();
  size_t pos = 0;
  const char32_t first = NextCodePoint(s, &pos);
  std::string out;
  AppendTitleOf(first, &out);
  // Lower the whole string (final sigma needs context), then drop the part
  // that the first code point became.
  std::string first_lower;
  AppendLowerOf(first, &first_lower);
  const std::string lower = PyLower(s);
  out.append(lower, std::min(first_lower.size(), lower.size()), std::string::npos);
  return out;
}

std::string PySwapCase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (IsUpperCp(c)) {
      AppendLowerOf(c, &out);
    } else if (IsLowerCp(c)) {
      AppendUpperOf(c, &out);
    } else {
      AppendUtf8(c, &out);
    }
  }
  return out;
}

void AppendPyStrRepr(std::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out->push_back(quote);
  size_t pos = 0;
  char buf[12];
  while (pos < s.size()) {
    const size_t start = pos;
    const char32_t c = NextCodePoint(s, &pos);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out->append("\\t");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '\r') {
      out->append("\\r");
    } else if (c < ' ' || c == 0x7f) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out->append(buf);
    } else if (c < 0x7f || IsPrintable(c)) {
      out->append(s.substr(start, pos - start));
    } else if (c <= 0xff) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out->append(buf);
    } else if (c <= 0xffff) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out->append(buf);
    } else {
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      out->append(buf);
    }
  }
  out->push_back(quote);
}

}  // namespace tandem::router::jinja
