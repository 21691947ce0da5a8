#include "common/certificates.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace tandem::tls {
namespace {

struct Free {
  void operator()(X509* x) const { X509_free(x); }
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
  void operator()(BIO* b) const { BIO_free(b); }
  void operator()(X509_EXTENSION* e) const { X509_EXTENSION_free(e); }
  void operator()(BIGNUM* b) const { BN_free(b); }
};
template <class T>
using Ptr = std::unique_ptr<T, Free>;

absl::Status OpenSslFailure(absl::string_view what) {
  const std::string why = OpenSslError();
  return absl::InternalError(absl::StrCat(what, " failed", why.empty() ? "" : ": ", why));
}

absl::StatusOr<std::string> ToPem(X509* cert) {
  Ptr<BIO> bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) {
    return OpenSslFailure("writing a certificate");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> ToPem(EVP_PKEY* key) {
  Ptr<BIO> bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslFailure("writing a private key");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  Ptr<X509_EXTENSION> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  if (ext == nullptr || X509_add_ext(cert, ext.get(), -1) != 1) {
    return OpenSslFailure(absl::StrCat("adding extension ", OBJ_nid2sn(nid), "=", value));
  }
  return absl::OkStatus();
}

// A new certificate for `key`, named `common_name`, with a random 159-bit
// serial, valid from an hour ago (clock skew) for `days`.
absl::StatusOr<Ptr<X509>> NewCertificate(EVP_PKEY* key, absl::string_view common_name, int days) {
  if (days < 1) return absl::InvalidArgumentError("a certificate must be valid at least a day");
  Ptr<X509> cert(X509_new());
  Ptr<BIGNUM> serial(BN_new());
  if (cert == nullptr || serial == nullptr || X509_set_version(cert.get(), 2) != 1 ||
      BN_rand(serial.get(), 159, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) == nullptr ||
      X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) == nullptr ||
      X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400) == nullptr ||
      X509_set_pubkey(cert.get(), key) != 1) {
    return OpenSslFailure("making a certificate");
  }
  X509_NAME* name = X509_get_subject_name(cert.get());
  const std::string cn(common_name);
  if (X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("tandem"), -1, -1,
                                 0) != 1 ||
      X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1,
                                 0) != 1) {
    return OpenSslFailure("naming a certificate");
  }
  return cert;
}

absl::StatusOr<Ptr<EVP_PKEY>> NewKey() {
  Ptr<EVP_PKEY> key(EVP_EC_gen("P-256"));
  if (key == nullptr) return OpenSslFailure("generating an EC P-256 key");
  return key;
}

absl::StatusOr<Ptr<X509>> ParseCert(const std::string& pem) {
  Ptr<BIO> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Ptr<X509> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) return OpenSslFailure("reading the CA certificate");
  return cert;
}

absl::StatusOr<Ptr<EVP_PKEY>> ParseKey(const std::string& pem) {
  Ptr<BIO> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Ptr<EVP_PKEY> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) return OpenSslFailure("reading the CA key");
  return key;
}

// Writes `contents` to a new file readable by the owner only (`private_file`)
// or by everyone.
absl::Status WriteNew(const std::string& path, absl::string_view contents, bool private_file) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, private_file ? 0600 : 0644);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  if (private_file) fchmod(fd, 0600);  // an existing file keeps its mode otherwise
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n <= 0) {
      close(fd);
      return absl::DataLossError(absl::StrCat("error writing ", path, ": ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  close(fd);
  return absl::OkStatus();
}

absl::Status WritePair(const std::string& dir, const std::string& name, const KeyPair& pair) {
  if (absl::Status s = WriteNew(absl::StrCat(dir, "/", name, ".key"), pair.key_pem, true); !s.ok()) {
    return s;
  }
  return WriteNew(absl::StrCat(dir, "/", name, ".crt"), pair.cert_pem, false);
}

// A signed certificate and its key as PEM.
absl::StatusOr<KeyPair> ToKeyPair(X509* cert, EVP_PKEY* key) {
  absl::StatusOr<std::string> cert_pem = ToPem(cert);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ToPem(key);
  if (!key_pem.ok()) return key_pem.status();
  return KeyPair{.cert_pem = *std::move(cert_pem), .key_pem = *std::move(key_pem)};
}

}  // namespace

absl::StatusOr<KeyPair> MakeCa(absl::string_view common_name, int days) {
  absl::StatusOr<Ptr<EVP_PKEY>> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<Ptr<X509>> cert = NewCertificate(key->get(), common_name, days);
  if (!cert.ok()) return cert.status();
  X509* c = cert->get();
  if (X509_set_issuer_name(c, X509_get_subject_name(c)) != 1) return OpenSslFailure("naming the CA");
  const std::pair<int, std::string> extensions[] = {{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                                                    {NID_key_usage, "critical,keyCertSign,cRLSign"},
                                                    {NID_subject_key_identifier, "hash"}};
  for (const auto& [nid, value] : extensions) {
    if (absl::Status s = AddExtension(c, c, nid, value); !s.ok()) return s;
  }
  if (X509_sign(c, key->get(), EVP_sha256()) == 0) return OpenSslFailure("signing the CA");
  return ToKeyPair(c, key->get());
}

absl::StatusOr<KeyPair> IssueCertificate(const KeyPair& ca, absl::string_view identity, absl::string_view common_name,
                                         int days) {
  if (identity != kRouterIdentity && identity != kWorkerIdentity) {
    return absl::InvalidArgumentError(absl::StrCat("unknown role identity '", identity, "'"));
  }
  absl::StatusOr<Ptr<X509>> ca_cert = ParseCert(ca.cert_pem);
  if (!ca_cert.ok()) return ca_cert.status();
  absl::StatusOr<Ptr<EVP_PKEY>> ca_key = ParseKey(ca.key_pem);
  if (!ca_key.ok()) return ca_key.status();
  if (X509_check_private_key(ca_cert->get(), ca_key->get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the CA key does not match the CA certificate");
  }
  absl::StatusOr<Ptr<EVP_PKEY>> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<Ptr<X509>> cert = NewCertificate(key->get(), common_name, days);
  if (!cert.ok()) return cert.status();
  X509* c = cert->get();
  if (X509_set_issuer_name(c, X509_get_subject_name(ca_cert->get())) != 1) {
    return OpenSslFailure("naming the issuer");
  }
  const std::pair<int, std::string> extensions[] = {
      {NID_basic_constraints, "critical,CA:FALSE"}, {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
      {NID_ext_key_usage, "serverAuth,clientAuth"}, {NID_subject_alt_name, absl::StrCat("DNS:", identity)},
      {NID_subject_key_identifier, "hash"},         {NID_authority_key_identifier, "keyid"}};
  for (const auto& [nid, value] : extensions) {
    if (absl::Status s = AddExtension(c, ca_cert->get(), nid, value); !s.ok()) return s;
  }
  if (X509_sign(c, ca_key->get(), EVP_sha256()) == 0) return OpenSslFailure("signing a certificate");
  return ToKeyPair(c, key->get());
}

ClusterFiles ClusterFilesIn(const std::string& dir) {
  const std::string ca = absl::StrCat(dir, "/ca.crt");
  return ClusterFiles{
      .router = {.ca = ca, .cert = absl::StrCat(dir, "/router.crt"), .key = absl::StrCat(dir, "/router.key")},
      .worker = {.ca = ca, .cert = absl::StrCat(dir, "/worker.crt"), .key = absl::StrCat(dir, "/worker.key")},
      .ca_key = absl::StrCat(dir, "/ca.key")};
}

absl::StatusOr<ClusterFiles> WriteClusterCertificates(const std::string& dir, int days) {
  const ClusterFiles files = ClusterFilesIn(dir);
  std::error_code ec;
  if (std::filesystem::exists(files.router.ca, ec) || std::filesystem::exists(files.ca_key, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(dir, " already holds a CA (ca.crt / ca.key): not overwriting it"));
  }
  absl::StatusOr<KeyPair> ca = MakeCa("tandem cluster CA", days);
  if (!ca.ok()) return ca.status();
  absl::StatusOr<KeyPair> router = IssueCertificate(*ca, kRouterIdentity, kRouterIdentity, days);
  if (!router.ok()) return router.status();
  absl::StatusOr<KeyPair> worker = IssueCertificate(*ca, kWorkerIdentity, kWorkerIdentity, days);
  if (!worker.ok()) return worker.status();
  const std::pair<const char*, const KeyPair*> pairs[] = {{"ca", &*ca}, {"router", &*router}, {"worker", &*worker}};
  for (const auto& [name, pair] : pairs) {
    if (absl::Status s = WritePair(dir, name, *pair); !s.ok()) return s;
  }
  return files;
}

absl::StatusOr<TlsFiles> IssueFromCaDir(const std::string& dir, absl::string_view identity, const std::string& name,
                                        int days) {
  if (name.empty() || name.find_first_of("/\\") != std::string::npos || name[0] == '.' || name == "ca") {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a certificate name"));
  }
  const ClusterFiles files = ClusterFilesIn(dir);
  KeyPair ca;
  absl::StatusOr<std::string> ca_cert = ReadFile(files.router.ca);
  if (!ca_cert.ok()) return ca_cert.status();
  absl::StatusOr<std::string> ca_key = ReadFile(files.ca_key);
  if (!ca_key.ok()) return ca_key.status();
  ca.cert_pem = *std::move(ca_cert);
  ca.key_pem = *std::move(ca_key);
  absl::StatusOr<KeyPair> pair = IssueCertificate(ca, identity, name, days);
  if (!pair.ok()) return pair.status();
  if (absl::Status s = WritePair(dir, name, *pair); !s.ok()) return s;
  return TlsFiles{
      .ca = files.router.ca, .cert = absl::StrCat(dir, "/", name, ".crt"), .key = absl::StrCat(dir, "/", name, ".key")};
}

}  // namespace tandem::tls
