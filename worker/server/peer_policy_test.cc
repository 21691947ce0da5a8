#include "worker/server/peer_policy.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;

TEST(PeerPolicyTest, PlainHostPortsParse) {
  for (const char* ok :
       {"127.0.0.1:50051", "decode-0.tandem.svc.cluster.local:50051", "[::1]:1", "localhost:65535", "10.0.0.7:8000"}) {
    absl::StatusOr<PeerAddress> a = ParsePeerAddress(ok, "decode_address");
    EXPECT_TRUE(a.ok()) << ok << ": " << a.status();
  }
  absl::StatusOr<PeerAddress> a = ParsePeerAddress("[::1]:50051", "decode_address");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->literal);
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 50051);
}

TEST(PeerPolicyTest, UrisSocketsAndOddFormsAreRefused) {
  for (const char* bad : {"unix:/tmp/sock",
                          "unix:///tmp/sock",
                          "dns:///evil.example:80",
                          "ipv4:127.0.0.1:80",
                          "http://127.0.0.1:80/",
                          "127.0.0.1",
                          "127.0.0.1:0",
                          "127.0.0.1:65536",
                          "127.0.0.1:+80",
                          "user@host:80",
                          "host/path:80",
                          "ho st:80",
                          "::1:80",
                          "[127.0.0.1]:80",
                          "",
                          ":80",
                          "host:80 ",
                          "h%41:80",
                          "-bad-.example:80",
                          "vsock:3:80"}) {
    absl::StatusOr<PeerAddress> a = ParsePeerAddress(bad, "kv_transfer.decode_address");
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(a.status().message(), HasSubstr("kv_transfer.decode_address")) << bad;
  }
}

TEST(PeerPolicyTest, AllowListMatchesCidrBlocks) {
  absl::StatusOr<PeerAllowList> l = PeerAllowList::Parse("10.1.0.0/16, 192.168.1.5,fd00::/8", "--kv-peer-allow");
  ASSERT_TRUE(l.ok()) << l.status();
  auto ip = [](const char* text) { return ParsePeerAddress(std::string(text) + ":1", "a")->ip; };
  auto ip6 = [](const char* text) { return ParsePeerAddress(std::string("[") + text + "]:1", "a")->ip; };
  EXPECT_TRUE(l->Allows(ip("10.1.200.3")));
  EXPECT_FALSE(l->Allows(ip("10.2.0.1")));
  EXPECT_TRUE(l->Allows(ip("192.168.1.5")));
  EXPECT_FALSE(l->Allows(ip("192.168.1.6")));
  EXPECT_TRUE(l->Allows(ip6("fd12::1")));
  EXPECT_FALSE(l->Allows(ip6("fe80::1")));
  EXPECT_EQ(l->ToString(), "10.1.0.0/16,192.168.1.5/32,fd00::/8");

  const PeerAllowList loopback = PeerAllowList::Loopback();
  EXPECT_TRUE(loopback.Allows(ip("127.0.0.1")));
  EXPECT_TRUE(loopback.Allows(ip("127.9.9.9")));
  EXPECT_TRUE(loopback.Allows(ip6("::1")));
  EXPECT_FALSE(loopback.Allows(ip("169.254.169.254")));  // a cloud metadata service
  EXPECT_FALSE(loopback.Allows(ip("10.0.0.1")));

  EXPECT_TRUE(PeerAllowList::Parse("any", "--kv-peer-allow")->any());
  for (const char* bad : {"10.0.0.0/33", "nonsense", "10.0.0.0/x", ""}) {
    absl::StatusOr<PeerAllowList> b = PeerAllowList::Parse(bad, "--kv-peer-allow");
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_THAT(b.status().message(), HasSubstr("--kv-peer-allow"));
  }
}

TEST(PeerPolicyTest, CheckedTargetDialsTheAddressItChecked) {
  const PeerAllowList loopback = PeerAllowList::Loopback();
  absl::StatusOr<std::string> t = loopback.CheckedTarget(*ParsePeerAddress("localhost:50051", "a"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(*t == "ipv4:127.0.0.1:50051" || *t == "ipv6:[::1]:50051") << *t;
  absl::StatusOr<std::string> refused = loopback.CheckedTarget(*ParsePeerAddress("10.0.0.1:50051", "a"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), HasSubstr("--kv-peer-allow"));
  EXPECT_EQ(*PeerAllowList::Any().CheckedTarget(*ParsePeerAddress("a.example:7", "a")), "a.example:7");
}

}  // namespace
}  // namespace tandem::worker
