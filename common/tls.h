// Mutual TLS between tandem's components (docs/architecture.md, "Security").
//
// Trust model: one cluster CA issues every certificate. A certificate's role
// is a DNS subject alternative name: kRouterIdentity for routers (and
// operators' tools), kWorkerIdentity for workers; its common name is free
// (a per-process name, used to tell callers apart). Every gRPC connection
// is mutually authenticated:
//   - a worker's server requires a client certificate of the cluster CA
//     (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY), then
//     each method checks the caller's role (PeerOf);
//   - a client (the router, a prefill worker calling KvReady) verifies the
//     server's certificate against the cluster CA and requires the worker
//     role: the channel's target name is kWorkerIdentity whatever address it
//     dials, so the handshake fails before a request byte is sent unless
//     the peer holds a worker certificate of this CA.
// Certificates are read once at start; rotating them means restarting.
//
// Thread safety: functions are pure; a ChannelFactory is immutable after
// construction and may be shared between threads.
#ifndef TANDEM_COMMON_TLS_H_
#define TANDEM_COMMON_TLS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::tls {

inline constexpr char kRouterIdentity[] = "tandem-router";
inline constexpr char kWorkerIdentity[] = "tandem-worker";

// The last OpenSSL error of this thread as text ("" if none), clearing the
// thread's error queue (for the messages of tls.cc and certificates.cc).
std::string OpenSslError();

// Paths of the PEM files of one process's TLS identity.
struct TlsFiles {
  std::string ca;    // the cluster CA's certificate
  std::string cert;  // this process's certificate (chain), issued by `ca`
  std::string key;   // its private key
};

// The PEM text of TlsFiles, checked: each file is readable and parses, the
// key matches the certificate, and the certificate was signed by the CA.
struct TlsMaterial {
  std::string ca_pem;
  std::string cert_pem;
  std::string key_pem;
};

// Reads and checks `files`. `names` label the three paths in errors, e.g.
// {"--tls-ca", "--tls-cert", "--tls-key"} or {"tls.ca", "tls.cert", "tls.key"}.
// InvalidArgument "NAME (PATH): why".
absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files, const TlsFiles& names);

// Server credentials requiring and verifying a client certificate of the CA.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsMaterial& material);

// The role a caller's certificate names (server side).
enum class PeerRole { kNone, kRouter, kWorker };
const char* PeerRoleName(PeerRole role);  // "none", "router", "worker"

struct Peer {
  bool authenticated = false;  // the call came over TLS with a verified certificate
  PeerRole role = PeerRole::kNone;
  std::string name;  // the certificate's common name ("" without one)
};
// The caller of a server call, from its AuthContext: authenticated when the
// transport is TLS and a peer certificate was verified; the role from its
// DNS SANs (or, without SANs, its common name).
Peer PeerOf(const grpc::ServerContext& ctx);

// Makes the channels a process uses to call workers: insecure, or mTLS with
// this process's certificate, verifying that the server is a worker of the
// cluster CA (see the file comment).
class ChannelFactory {
 public:
  // Plain TCP: no authentication either way.
  static std::shared_ptr<const ChannelFactory> Insecure();
  static std::shared_ptr<const ChannelFactory> Mutual(const TlsMaterial& material);

  bool secure() const { return secure_; }
  // A channel to a worker at `target` ("host:port", or a gRPC target such as
  // "ipv4:10.0.0.1:50051") with `args`.
  std::shared_ptr<grpc::Channel> Create(const std::string& target, grpc::ChannelArguments args) const;
  std::shared_ptr<grpc::Channel> Create(const std::string& target) const {
    return Create(target, grpc::ChannelArguments());
  }

 private:
  ChannelFactory(bool secure, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : secure_(secure), credentials_(std::move(credentials)) {}
  const bool secure_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

}  // namespace tandem::tls

#endif  // TANDEM_COMMON_TLS_H_
