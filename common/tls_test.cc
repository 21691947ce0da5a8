#include "common/tls.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/certificates.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::tls {
namespace {

using ::testing::HasSubstr;

const TlsFiles kNames{.ca = "--tls-ca", .cert = "--tls-cert", .key = "--tls-key"};

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem_tls_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(TlsTest, ClusterCertificatesLoadAndKeysArePrivate) {
  absl::StatusOr<ClusterFiles> files = WriteClusterCertificates(dir_, 1);
  ASSERT_TRUE(files.ok()) << files.status();
  for (const TlsFiles& f : {files->router, files->worker}) {
    absl::StatusOr<TlsMaterial> m = LoadTlsMaterial(f, kNames);
    EXPECT_TRUE(m.ok()) << m.status();
    struct stat st;
    ASSERT_EQ(stat(f.key.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f.key;
  }
  struct stat st;
  ASSERT_EQ(stat(files->ca_key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A second run does not replace the CA.
  absl::StatusOr<ClusterFiles> again = WriteClusterCertificates(dir_, 1);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(TlsTest, IssuedCertificateCarriesItsRole) {
  absl::StatusOr<ClusterFiles> files = WriteClusterCertificates(dir_, 1);
  ASSERT_TRUE(files.ok()) << files.status();
  absl::StatusOr<TlsFiles> extra = IssueFromCaDir(dir_, kWorkerIdentity, "decode-7", 1);
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_TRUE(LoadTlsMaterial(*extra, kNames).ok());
  EXPECT_FALSE(IssueFromCaDir(dir_, kWorkerIdentity, "../escape", 1).ok());
  EXPECT_FALSE(IssueFromCaDir(dir_, "tandem-admin", "x", 1).ok());
}

TEST_F(TlsTest, LoadRejectsForeignMismatchedAndMissingFiles) {
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  std::filesystem::create_directories(a);
  std::filesystem::create_directories(b);
  absl::StatusOr<ClusterFiles> fa = WriteClusterCertificates(a, 1);
  absl::StatusOr<ClusterFiles> fb = WriteClusterCertificates(b, 1);
  ASSERT_TRUE(fa.ok() && fb.ok());

  TlsFiles foreign = fa->worker;
  foreign.ca = fb->worker.ca;  // a certificate of another CA
  absl::StatusOr<TlsMaterial> m = LoadTlsMaterial(foreign, kNames);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("--tls-cert"));
  EXPECT_THAT(m.status().message(), HasSubstr("was not issued by the CA"));

  TlsFiles mismatched = fa->worker;
  mismatched.key = fa->router.key;
  m = LoadTlsMaterial(mismatched, kNames);
  EXPECT_THAT(m.status().message(), HasSubstr("--tls-key"));
  EXPECT_THAT(m.status().message(), HasSubstr("does not match"));

  TlsFiles missing = fa->worker;
  missing.ca = dir_ + "/nope.crt";
  m = LoadTlsMaterial(missing, kNames);
  EXPECT_THAT(m.status().message(), HasSubstr("--tls-ca"));
  EXPECT_THAT(m.status().message(), HasSubstr("does not exist"));

  TlsFiles garbage = fa->worker;
  garbage.cert = fa->worker.key;  // a key where a certificate belongs
  m = LoadTlsMaterial(garbage, kNames);
  EXPECT_THAT(m.status().message(), HasSubstr("not a PEM certificate"));

  TlsFiles empty = fa->worker;
  empty.key.clear();
  m = LoadTlsMaterial(empty, kNames);
  EXPECT_THAT(m.status().message(), HasSubstr("--tls-key: missing"));
}

}  // namespace
}  // namespace tandem::tls
