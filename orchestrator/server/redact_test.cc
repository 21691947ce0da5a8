#include "orchestrator/server/redact.h"

#include <gtest/gtest.h>

namespace tandem::router {
namespace {

TEST(RedactWorkersTest, KnownAddressesAndHostNames) {
  EXPECT_EQ(RedactWorkers("worker decode-0.svc:50051: stream ended", {"decode-0.svc:50051"}),
            "worker <worker>: stream ended");
  EXPECT_EQ(RedactWorkers("worker 127.0.0.1:5000 and 127.0.0.1:500", {"127.0.0.1:500", "127.0.0.1:5000"}),
            "worker <worker> and <worker>");
}

TEST(RedactWorkersTest, GrpcPeerFormats) {
  EXPECT_EQ(RedactWorkers("failed to connect to all addresses; last error: UNKNOWN: "
                          "ipv4:10.1.2.3:41234: Connection refused",
                          {}),
            "failed to connect to all addresses; last error: UNKNOWN: <worker>: Connection refused");
  EXPECT_EQ(RedactWorkers("peer ipv6:[::1]:5000 gone", {}), "peer <worker> gone");
  EXPECT_EQ(RedactWorkers("peer ipv6:%5B::1%5D:5000 gone", {}), "peer <worker> gone");
  EXPECT_EQ(RedactWorkers("at [fe80::1%eth0]:7", {}), "at <worker>");
  EXPECT_EQ(RedactWorkers("10.0.0.7", {}), "<worker>");
}

TEST(RedactWorkersTest, OrdinaryTextStays) {
  const std::string plain = "the prompt (12 tokens) plus max_tokens (4096) exceeds this model's context of 2048 tokens";
  EXPECT_EQ(RedactWorkers(plain, {}), plain);
  EXPECT_EQ(RedactWorkers("messages[0] [a] v1.2.3.4", {}), "messages[0] [a] v1.2.3.4");
  EXPECT_EQ(RedactWorkers("no token within 1.5 s", {}), "no token within 1.5 s");
}

}  // namespace
}  // namespace tandem::router
