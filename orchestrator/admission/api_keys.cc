#include "orchestrator/admission/api_keys.h"

#include "absl/strings/ascii.h"

namespace tandem::router {

ApiKeyStore::ApiKeyStore(const AuthConfig& config) {
  for (const ApiKeyConfig& k : config.keys) {
    // The config was validated: every digest parses.
    std::optional<Sha256Digest> digest = ParseDigestHex(k.sha256);
    if (!digest.has_value()) continue;
    keys_.push_back(Entry{
        *digest,
        ApiKeyIdentity{
            .name = k.name, .admin = k.admin, .priority = k.priority, .limits = k.Limits(config.limits_per_key)}});
  }
}

ApiKeyStore::Match ApiKeyStore::Authenticate(std::string_view authorization) const {
  if (authorization.empty()) return {Result::kMissing, nullptr};
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() ||
      absl::AsciiStrToLower(std::string(authorization.substr(0, kScheme.size()))) != kScheme) {
    return {Result::kMalformed, nullptr};
  }
  std::string_view key = authorization.substr(kScheme.size());
  while (!key.empty() && (key.front() == ' ' || key.front() == '\t')) key.remove_prefix(1);
  while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.remove_suffix(1);
  if (key.empty()) return {Result::kMalformed, nullptr};
  const Sha256Digest presented = Sha256(key);
  // Every entry is compared, match or not.
  const ApiKeyIdentity* found = nullptr;
  for (const Entry& e : keys_) {
    const bool equal = ConstantTimeEquals(e.digest, presented);
    found = equal ? &e.identity : found;
  }
  if (found == nullptr) return {Result::kUnknown, nullptr};
  return {Result::kOk, found};
}

std::string_view AuthFailureName(ApiKeyStore::Result result) {
  switch (result) {
    case ApiKeyStore::Result::kMissing:
      return "missing";
    case ApiKeyStore::Result::kMalformed:
      return "malformed";
    case ApiKeyStore::Result::kUnknown:
      return "unknown";
    case ApiKeyStore::Result::kOk:
      break;
  }
  return "ok";
}

}  // namespace tandem::router
