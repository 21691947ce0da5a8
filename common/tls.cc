#include "common/tls.h"

#include <grpc/grpc_security_constants.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace tandem::tls {

std::string OpenSslError() {
  std::string out;
  unsigned long e;
  while ((e = ERR_get_error()) != 0) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    out = buf;
  }
  return out;
}

namespace {

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyDeleter>;

X509Ptr ParseCert(const std::string& pem) {
  std::unique_ptr<BIO, BioDeleter> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  return X509Ptr(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

KeyPtr ParseKey(const std::string& pem) {
  std::unique_ptr<BIO, BioDeleter> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  return KeyPtr(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
}

PeerRole RoleOf(std::string_view identity) {
  if (identity == kRouterIdentity) return PeerRole::kRouter;
  if (identity == kWorkerIdentity) return PeerRole::kWorker;
  return PeerRole::kNone;
}

}  // namespace

absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files, const TlsFiles& names) {
  auto bad = [](const std::string& name, const std::string& path, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(name, " (", path, "): ", why));
  };
  TlsMaterial m;
  const std::pair<const std::string*, const std::string*> paths[] = {
      {&files.ca, &names.ca}, {&files.cert, &names.cert}, {&files.key, &names.key}};
  std::string* texts[] = {&m.ca_pem, &m.cert_pem, &m.key_pem};
  for (int i = 0; i < 3; ++i) {
    if (paths[i].first->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(*paths[i].second, ": missing"));
    }
    absl::StatusOr<std::string> text = ReadFile(*paths[i].first);
    if (!text.ok()) return bad(*paths[i].second, *paths[i].first, text.status().message());
    *texts[i] = *std::move(text);
  }
  ERR_clear_error();
  X509Ptr ca = ParseCert(m.ca_pem);
  if (ca == nullptr) {
    return bad(names.ca, files.ca, "not a PEM certificate: " + OpenSslError());
  }
  X509Ptr cert = ParseCert(m.cert_pem);
  if (cert == nullptr) {
    return bad(names.cert, files.cert, "not a PEM certificate: " + OpenSslError());
  }
  KeyPtr key = ParseKey(m.key_pem);
  if (key == nullptr) {
    return bad(names.key, files.key, "not a PEM private key: " + OpenSslError());
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    OpenSslError();
    return bad(names.key, files.key, absl::StrCat("does not match the certificate ", files.cert));
  }
  EVP_PKEY* ca_key = X509_get0_pubkey(ca.get());
  if (ca_key == nullptr || X509_verify(cert.get(), ca_key) != 1) {
    OpenSslError();
    return bad(names.cert, files.cert, absl::StrCat("was not issued by the CA in ", files.ca, " (", names.ca, ")"));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return bad(names.cert, files.cert, "has expired");
  }
  return m;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsMaterial& material) {
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = material.ca_pem;
  options.pem_key_cert_pairs.push_back({material.key_pem, material.cert_pem});
  return grpc::SslServerCredentials(options);
}

const char* PeerRoleName(PeerRole role) {
  switch (role) {
    case PeerRole::kRouter:
      return "router";
    case PeerRole::kWorker:
      return "worker";
    case PeerRole::kNone:
      break;
  }
  return "none";
}

Peer PeerOf(const grpc::ServerContext& ctx) {
  Peer peer;
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return peer;
  const std::vector<grpc::string_ref> type = auth->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME);
  const bool tls =
      !type.empty() && (type[0] == GRPC_SSL_TRANSPORT_SECURITY_TYPE || type[0] == GRPC_TLS_TRANSPORT_SECURITY_TYPE);
  // A verified client certificate gives the connection a peer identity.
  if (!tls || !auth->IsPeerAuthenticated()) return peer;
  peer.authenticated = true;
  for (const grpc::string_ref& cn : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    peer.name.assign(cn.data(), cn.size());
  }
  const std::vector<grpc::string_ref> sans = auth->FindPropertyValues(GRPC_X509_SAN_PROPERTY_NAME);
  for (const grpc::string_ref& san : sans) {
    const PeerRole r = RoleOf(std::string_view(san.data(), san.size()));
    // A certificate naming both roles is ambiguous: it gets neither.
    if (r != PeerRole::kNone && peer.role != PeerRole::kNone && r != peer.role) {
      peer.role = PeerRole::kNone;
      return peer;
    }
    if (r != PeerRole::kNone) peer.role = r;
  }
  if (sans.empty()) peer.role = RoleOf(peer.name);
  return peer;
}

std::shared_ptr<const ChannelFactory> ChannelFactory::Insecure() {
  return std::shared_ptr<const ChannelFactory>(new ChannelFactory(false, grpc::InsecureChannelCredentials()));
}

std::shared_ptr<const ChannelFactory> ChannelFactory::Mutual(const TlsMaterial& material) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = material.ca_pem;
  options.pem_private_key = material.key_pem;
  options.pem_cert_chain = material.cert_pem;
  return std::shared_ptr<const ChannelFactory>(new ChannelFactory(true, grpc::SslCredentials(options)));
}

std::shared_ptr<grpc::Channel> ChannelFactory::Create(const std::string& target, grpc::ChannelArguments args) const {
  // Identity, not address: whatever host the target names, the server must
  // prove the worker role (its certificate's DNS SAN) under the cluster CA.
  if (secure_) args.SetSslTargetNameOverride(kWorkerIdentity);
  return grpc::CreateCustomChannel(target, credentials_, args);
}

}  // namespace tandem::tls
