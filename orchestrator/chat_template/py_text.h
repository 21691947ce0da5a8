// Python `str` semantics over UTF-8 text, for the chat-template interpreter:
// Python strings are sequences of code points, so lengths, indices and slices
// count code points; whitespace is str.isspace(); case mappings are Unicode's
// full mappings (ICU, which implements the same SpecialCasing rules as
// CPython, e.g. "ß".upper() == "SS" and final sigma in lower()).
//
// Invalid UTF-8 never fails: each invalid byte reads as one U+FFFD code point
// (render contexts come from parsed JSON, so it does not occur in practice).
// Pure functions, thread-safe.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PY_TEXT_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PY_TEXT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::router::jinja {

// Decodes the code point at s[*pos] and advances *pos past it.
// REQUIRES: *pos < s.size().
char32_t NextCodePoint(std::string_view s, size_t* pos);
void AppendUtf8(char32_t cp, std::string* out);
size_t CodePointCount(std::string_view s);
// Byte offsets of each code point's start, plus s.size() at the end.
std::vector<size_t> CodePointOffsets(std::string_view s);

// str.isspace() of one code point: the separators of str.split() and strip().
bool IsPySpace(char32_t c);
// Python's `\w` (str.isalnum() or '_'), for the wordcount filter.
bool IsPyWordChar(char32_t c);
// Character classes of str.isdigit(), isalpha(), isalnum(), isdecimal(),
// isnumeric() for a whole string (false when empty).
bool PyIsDigit(std::string_view s);
bool PyIsAlpha(std::string_view s);
bool PyIsAlnum(std::string_view s);
bool PyIsDecimal(std::string_view s);
bool PyIsNumeric(std::string_view s);
bool PyIsSpace(std::string_view s);
bool PyIsLower(std::string_view s);
bool PyIsUpper(std::string_view s);

// What int() and float() parse: Unicode decimal digits become ASCII digits
// and Unicode whitespace a space, as CPython's
// _PyUnicode_TransformDecimalAndSpaceToASCII does ("٣" parses as 3).
std::string PyDecimalsToAscii(std::string_view s);

// str.strip/lstrip/rstrip: `chars` absent strips whitespace, otherwise the
// code points in `chars`.
std::string_view PyStrip(std::string_view s, std::optional<std::string_view> chars, bool left, bool right);

// str.split(sep, maxsplit) / str.rsplit: without `sep`, runs of whitespace
// separate and empty strings are dropped. REQUIRES: sep, if given, non-empty.
std::vector<std::string_view> PySplit(std::string_view s, std::optional<std::string_view> sep, int64_t maxsplit);
std::vector<std::string_view> PyRSplit(std::string_view s, std::optional<std::string_view> sep, int64_t maxsplit);
// str.splitlines(keepends): splits at \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85,
// U+2028 and U+2029.
std::vector<std::string_view> PySplitLines(std::string_view s, bool keepends);

// str.replace(old, new, count); count < 0 replaces all. An empty `old`
// inserts `new` between code points, as Python does.
std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text, int64_t count);
// str.count(sub): non-overlapping occurrences (an empty `sub` counts
// code points + 1).
int64_t PyCount(std::string_view s, std::string_view sub);

// Case mappings of str.upper(), lower(), title(), capitalize(), swapcase().
std::string PyUpper(std::string_view s);
std::string PyLower(std::string_view s);
std::string PyTitle(std::string_view s);
std::string PyCapitalize(std::string_view s);
std::string PySwapCase(std::string_view s);

// Appends repr(s): quotes chosen as Python does, escapes for backslash, the
// quote, \t \n \r and non-printable code points.
void AppendPyStrRepr(std::string_view s, std::string* out);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PY_TEXT_H_
