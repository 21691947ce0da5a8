// ApiKeyStore: the router's API keys, as SHA-256 digests, and the check of
// a request's `Authorization: Bearer KEY` header against them. Built from the
// config's auth section (once at start, again at each reload); the keys
// themselves are never held, only their digests.
//
// A presented key is hashed and compared with every stored digest in
// constant time (no early exit, no lookup keyed by the digest), so the time
// taken says nothing about which stored key, or how much of one, it
// matched.
//
// Thread safety: immutable after construction; Authenticate is const and may
// run on any thread.
#ifndef TANDEM_ORCHESTRATOR_ADMISSION_API_KEYS_H_
#define TANDEM_ORCHESTRATOR_ADMISSION_API_KEYS_H_

#include <string>
#include <string_view>
#include <vector>

#include "common/sha256.h"
#include "orchestrator/config/router_config.h"

namespace tandem::router {

// Who a request authenticated as.
struct ApiKeyIdentity {
  std::string name;
  bool admin = false;
  int priority = 1;
  KeyLimitsConfig limits;  // the defaults with the key's overrides
};

class ApiKeyStore {
 public:
  explicit ApiKeyStore(const AuthConfig& config);

  // False when no key is configured: the router is open.
  bool enabled() const { return !keys_.empty(); }
  size_t size() const { return keys_.size(); }

  enum class Result {
    kOk,
    kMissing,    // no Authorization header
    kMalformed,  // not "Bearer <key>"
    kUnknown,    // a key no entry has
  };
  struct Match {
    Result result = Result::kMissing;
    const ApiKeyIdentity* key = nullptr;  // set for kOk; lives as long as the store
  };
  // Checks an Authorization header's value ("" when absent). The scheme is
  // matched case-insensitively, as RFC 9110 says.
  Match Authenticate(std::string_view authorization) const;

 private:
  struct Entry {
    Sha256Digest digest;
    ApiKeyIdentity identity;
  };
  std::vector<Entry> keys_;
};

// A reason label for metrics: "missing", "malformed", "unknown".
std::string_view AuthFailureName(ApiKeyStore::Result result);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ADMISSION_API_KEYS_H_
