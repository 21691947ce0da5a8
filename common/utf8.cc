#include "common/utf8.h"

namespace tandem {

int Utf8SequenceLength(std::string_view s) {
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (b0 < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return 0;
  }
  for (int i = 1; i < len; ++i) {
    if (static_cast<size_t>(i) >= s.size()) return -1;
    const auto b = static_cast<unsigned char>(s[i]);
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

size_t AppendValidUtf8(std::string_view in, bool final, std::string* out) {
  size_t i = 0;
  while (i < in.size()) {
    const int len = Utf8SequenceLength(in.substr(i));
    if (len > 0) {
      out->append(in.data() + i, len);
      i += len;
    } else if (len < 0 && !final) {
      break;  // wait for the rest of the character
    } else {
      // Skip the maximal invalid subpart: the lead byte plus any continuation
      // bytes that were a valid prefix.
      size_t skip = 1;
      while (i + skip < in.size() && skip < 4 && Utf8SequenceLength(in.substr(i, skip + 1)) < 0) {
        ++skip;
      }
      out->append(kUtf8Replacement);
      i += skip;
    }
  }
  return i;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    const int len = Utf8SequenceLength(s.substr(i));
    if (len <= 0) return false;
    i += len;
  }
  return true;
}

}  // namespace tandem
