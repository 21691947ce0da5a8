#include "orchestrator/admission/api_keys.h"

#include <gtest/gtest.h>

#include "common/sha256.h"

namespace tandem::router {
namespace {

AuthConfig TwoKeys() {
  AuthConfig a;
  a.limits_per_key.requests_per_s = 5;
  a.keys.push_back(ApiKeyConfig{.name = "alice", .sha256 = Sha256Hex("key-alice")});
  a.keys.push_back(
      ApiKeyConfig{.name = "ops", .sha256 = Sha256Hex("key-ops"), .admin = true, .priority = 3, .max_concurrent = 2});
  return a;
}

TEST(Sha256Test, KnownDigests) {
  // FIPS 180-2 test vectors.
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  auto d = ParseDigestHex("BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD");
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(ConstantTimeEquals(*d, Sha256("abc")));
  EXPECT_FALSE(ConstantTimeEquals(*d, Sha256("abd")));
  EXPECT_FALSE(ParseDigestHex("abc").has_value());
  EXPECT_FALSE(ParseDigestHex(std::string(64, 'g')).has_value());
}

TEST(ApiKeyStoreTest, EmptyStoreIsOpen) {
  ApiKeyStore store{AuthConfig{}};
  EXPECT_FALSE(store.enabled());
}

TEST(ApiKeyStoreTest, BearerKeysAuthenticate) {
  ApiKeyStore store(TwoKeys());
  ASSERT_TRUE(store.enabled());
  ApiKeyStore::Match m = store.Authenticate("Bearer key-alice");
  ASSERT_EQ(m.result, ApiKeyStore::Result::kOk);
  EXPECT_EQ(m.key->name, "alice");
  EXPECT_FALSE(m.key->admin);
  EXPECT_EQ(m.key->limits.requests_per_s, 5);   // the default
  m = store.Authenticate("bearer   key-ops ");  // scheme case-insensitive, spaces trimmed
  ASSERT_EQ(m.result, ApiKeyStore::Result::kOk);
  EXPECT_EQ(m.key->name, "ops");
  EXPECT_TRUE(m.key->admin);
  EXPECT_EQ(m.key->priority, 3);
  EXPECT_EQ(m.key->limits.max_concurrent, 2);  // the override
  EXPECT_EQ(m.key->limits.requests_per_s, 5);
}

TEST(ApiKeyStoreTest, BadHeadersAreRefusedWithTheirReason) {
  ApiKeyStore store(TwoKeys());
  EXPECT_EQ(store.Authenticate("").result, ApiKeyStore::Result::kMissing);
  EXPECT_EQ(store.Authenticate("key-alice").result, ApiKeyStore::Result::kMalformed);
  EXPECT_EQ(store.Authenticate("Basic a2V5LWFsaWNl").result, ApiKeyStore::Result::kMalformed);
  EXPECT_EQ(store.Authenticate("Bearer ").result, ApiKeyStore::Result::kMalformed);
  EXPECT_EQ(store.Authenticate("Bearer key-alicf").result, ApiKeyStore::Result::kUnknown);
  EXPECT_EQ(store.Authenticate("Bearer key-alice2").result, ApiKeyStore::Result::kUnknown);
  // The digest itself is not a key.
  EXPECT_EQ(store.Authenticate("Bearer " + Sha256Hex("key-alice")).result, ApiKeyStore::Result::kUnknown);
  EXPECT_EQ(AuthFailureName(ApiKeyStore::Result::kUnknown), "unknown");
}

}  // namespace
}  // namespace tandem::router
