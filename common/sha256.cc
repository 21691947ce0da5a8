#include "common/sha256.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "common/logging.h"

namespace tandem {

Sha256Digest Sha256(std::string_view data) {
  Sha256Digest out{};
  unsigned int len = 0;
  // EVP_Digest fails only on allocation failure or a missing algorithm,
  // neither of which a caller could handle.
  CHECK(EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr) == 1 && len == out.size())
      << "SHA-256 failed";
  return out;
}

std::string DigestHex(const Sha256Digest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * digest.size());
  for (uint8_t b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

std::string Sha256Hex(std::string_view data) { return DigestHex(Sha256(data)); }

std::optional<Sha256Digest> ParseDigestHex(std::string_view hex) {
  if (hex.size() != 64) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Sha256Digest out{};
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

bool ConstantTimeEquals(const Sha256Digest& a, const Sha256Digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace tandem
