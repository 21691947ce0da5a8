#include "orchestrator/tokenizer/byte_level.h"

#include <array>
#include <cstdint>

#include "common/utf8.h"

namespace tandem::router {
namespace {

struct Tables {
  std::array<std::string, 256> byte_to_utf8;  // encoded character per byte
  std::array<int16_t, 324> char_to_byte;      // code point -> byte, or -1
};

void AppendCodePoint(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else {  // the alphabet stays below U+0800
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

const Tables& GetTables() {
  static const Tables* tables = [] {
    auto* t = new Tables;
    t->char_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next++;
      AppendCodePoint(cp, &t->byte_to_utf8[b]);
      t->char_to_byte[cp] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return *tables;
}

}  // namespace

void ByteLevelEncode(std::string_view bytes, std::string* out) {
  const Tables& t = GetTables();
  for (unsigned char b : bytes) out->append(t.byte_to_utf8[b]);
}

void ByteLevelDecode(std::string_view text, std::string* out) {
  const Tables& t = GetTables();
  size_t i = 0;
  while (i < text.size()) {
    const auto b0 = static_cast<unsigned char>(text[i]);
    int len = Utf8SequenceLength(text.substr(i));
    if (len <= 0) {  // not UTF-8: pass the byte through
      out->push_back(static_cast<char>(b0));
      ++i;
      continue;
    }
    uint32_t cp = 0;
    if (len == 1) {
      cp = b0;
    } else if (len == 2) {
      cp = ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
    } else {
      cp = 0xFFFFFFFF;
    }
    if (cp < t.char_to_byte.size() && t.char_to_byte[cp] >= 0) {
      out->push_back(static_cast<char>(t.char_to_byte[cp]));
    } else {
      out->append(text.data() + i, len);
    }
    i += len;
  }
}

}  // namespace tandem::router
