// SHA-256 digests (OpenSSL's libcrypto) and a comparison whose time does not
// depend on where two byte strings differ. For secrets the router must check
// without keeping them: API keys are stored as their digests and a presented
// key is hashed, then compared with every stored digest in constant time.
//
// Thread safety: pure functions.
#ifndef TANDEM_COMMON_SHA256_H_
#define TANDEM_COMMON_SHA256_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tandem {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest Sha256(std::string_view data);

// Lowercase hex, 64 characters.
std::string Sha256Hex(std::string_view data);
std::string DigestHex(const Sha256Digest& digest);

// Parses 64 hex digits (either case); nullopt otherwise.
std::optional<Sha256Digest> ParseDigestHex(std::string_view hex);

// True when the digests are equal; takes the same time wherever they differ.
bool ConstantTimeEquals(const Sha256Digest& a, const Sha256Digest& b);

}  // namespace tandem

#endif  // TANDEM_COMMON_SHA256_H_
