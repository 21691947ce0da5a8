// Certificates for tandem's mutual TLS (common/tls.h), made in-process with
// OpenSSL: a cluster CA and certificates issued by it that carry a role
// (kRouterIdentity or kWorkerIdentity as a DNS SAN). `tandem up` makes a
// throwaway set for its local cluster; `tandem certs` makes one for
// operators. Keys are ECDSA P-256; certificates are valid for both TLS
// client and server use.
//
// Thread safety: the functions are thread-safe.
#ifndef TANDEM_COMMON_CERTIFICATES_H_
#define TANDEM_COMMON_CERTIFICATES_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tls.h"

namespace tandem::tls {

// A certificate and its private key, PEM.
struct KeyPair {
  std::string cert_pem;
  std::string key_pem;
};

// A self-signed CA certificate named `common_name`, valid `days` days.
absl::StatusOr<KeyPair> MakeCa(absl::string_view common_name, int days);

// A certificate issued by `ca` for role `identity` (kRouterIdentity or
// kWorkerIdentity, written as a DNS SAN), named `common_name`, valid `days`.
absl::StatusOr<KeyPair> IssueCertificate(const KeyPair& ca, absl::string_view identity, absl::string_view common_name,
                                         int days);

// The files of a cluster's set in `dir`: ca.crt, ca.key, router.crt,
// router.key, worker.crt, worker.key.
struct ClusterFiles {
  TlsFiles router;  // ca + router.crt/key
  TlsFiles worker;  // ca + worker.crt/key
  std::string ca_key;
};
ClusterFiles ClusterFilesIn(const std::string& dir);

// Makes a new CA and one router and one worker certificate into `dir`
// (which must exist), keys readable by the owner only. Refuses (AlreadyExists)
// to overwrite a CA that is there.
absl::StatusOr<ClusterFiles> WriteClusterCertificates(const std::string& dir, int days);

// Issues another certificate from the CA in `dir` (ca.crt, ca.key) into
// `dir`/NAME.crt and NAME.key: e.g. one per worker, so that each caller has
// its own name (the per-caller limits of a worker count by name).
absl::StatusOr<TlsFiles> IssueFromCaDir(const std::string& dir, absl::string_view identity, const std::string& name,
                                        int days);

}  // namespace tandem::tls

#endif  // TANDEM_COMMON_CERTIFICATES_H_
