// Which peers a worker dials for a KV hand-off (Generate(SEND)'s
// decode_address), against server-side request forgery: a caller must not
// make a prefill worker connect wherever it likes.
//
//   - ParsePeerAddress accepts only a plain "host:port": a DNS name, an IPv4
//     address or a bracketed IPv6 address, and a port in 1..65535. gRPC
//     target syntax (URIs such as "dns:///", "unix:", "ipv4:", "http://"),
//     paths, user info, percent escapes and whitespace are refused.
//   - PeerAllowList is a list of CIDR blocks (`--kv-peer-allow`). Without
//     TLS it defaults to loopback only, so an insecure worker dials only
//     peers on its own host unless the operator lists more; with TLS it is
//     empty by default (any address: the handshake proves the peer is a
//     worker of the cluster CA before anything is sent). A listed allow list
//     applies in both modes: a DNS name is resolved and every address it
//     has must be admitted, and the worker dials the address it checked.
//
// Thread safety: immutable after construction; the functions are pure.
#ifndef TANDEM_WORKER_SERVER_PEER_POLICY_H_
#define TANDEM_WORKER_SERVER_PEER_POLICY_H_

#include <netinet/in.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace tandem::worker {

struct PeerAddress {
  std::string host;  // as written, without IPv6 brackets
  int port = 0;
  bool literal = false;          // host is an IP address
  std::array<uint8_t, 16> ip{};  // when literal: IPv4-mapped for IPv4
};

// InvalidArgument naming `field` and why, for anything but a plain host:port.
absl::StatusOr<PeerAddress> ParsePeerAddress(absl::string_view text, absl::string_view field);

class PeerAllowList {
 public:
  // Loopback only: 127.0.0.0/8 and ::1.
  static PeerAllowList Loopback();
  // Every address (no list).
  static PeerAllowList Any() { return PeerAllowList(); }
  // Comma-separated CIDR blocks ("10.0.0.0/8,fd00::/8,127.0.0.1"; a bare
  // address is one host) or "any". InvalidArgument naming `flag`.
  static absl::StatusOr<PeerAllowList> Parse(absl::string_view text, absl::string_view flag);

  bool any() const { return any_; }
  // Whether the 16-byte address (IPv4-mapped for IPv4) is admitted.
  bool Allows(const std::array<uint8_t, 16>& ip) const;
  std::string ToString() const;

  // Resolves `address` (unless literal) and checks every address found.
  // The gRPC target to dial: the checked address itself ("ipv4:a.b.c.d:p",
  // "ipv6:[..]:p"), so no later lookup can send the connection elsewhere;
  // with any(), "host:port" unchanged. PermissionDenied when an address is
  // outside the list; Unavailable when the name does not resolve.
  absl::StatusOr<std::string> CheckedTarget(const PeerAddress& address) const;

 private:
  struct Block {
    std::array<uint8_t, 16> net{};
    int prefix = 0;  // of the 128 bits
  };
  bool any_ = true;
  std::vector<Block> blocks_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_PEER_POLICY_H_
