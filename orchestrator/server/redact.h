// RedactWorkers: takes worker addresses out of a text a client will read (an
// error message), unless the router's debug switch or an admin key lets the
// client see them. Status messages from the request path name workers
// ("worker 10.0.0.7:50051: ...") and gRPC's own messages name peers in its
// formats ("ipv4:10.0.0.7:50051", "ipv6:[::1]:50051", "ipv6:%5B::1%5D:50051");
// both are replaced by "<worker>":
//   - each of `known` (the pools' worker addresses, host names included);
//   - any IPv4 address with or without a port;
//   - any bracketed IPv6 address ([...] or %5B...%5D) with or without a
//     port, and an "ipv4:" / "ipv6:" scheme before either.
// Text that only looks like an address (a version "1.2.3.4") is redacted
// too: a neutral message is the aim, not a faithful one.
//
// Thread safety: a pure function.
#ifndef TANDEM_ORCHESTRATOR_SERVER_REDACT_H_
#define TANDEM_ORCHESTRATOR_SERVER_REDACT_H_

#include <string>
#include <string_view>
#include <vector>

namespace tandem::router {

inline constexpr std::string_view kRedactedWorker = "<worker>";

std::string RedactWorkers(std::string_view text, const std::vector<std::string>& known);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_REDACT_H_
