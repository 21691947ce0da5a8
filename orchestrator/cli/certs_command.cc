// `tandem certs`: the cluster CA and certificates for mutual TLS between the
// router and the workers (common/tls.h has the trust model).
//
//   tandem certs --out DIR                       a new CA, one router and one
//                                                worker certificate
//   tandem certs --out DIR --issue worker:NAME   one more certificate from
//                                                the CA in DIR (e.g. one per
//                                                worker or router)
// Keys are written readable by the owner only; an existing CA is never
// overwritten.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/certificates.h"
#include "orchestrator/cli/router_command.h"
#include "worker/cli/commands.h"

namespace tandem::router {
namespace {

struct CertsOptions {
  std::string out;
  std::vector<std::string> issue;  // ROLE:NAME
  int days = 365;
};

absl::Status Certs(const CertsOptions& opt) {
  if (opt.out.empty()) return absl::InvalidArgumentError("--out DIR is required");
  if (opt.days < 1 || opt.days > 3650) {
    return absl::InvalidArgumentError("--days must be in [1, 3650]");
  }
  std::error_code ec;
  std::filesystem::create_directories(opt.out, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("--out ", opt.out, ": ", ec.message()));
  }
  if (opt.issue.empty()) {
    absl::StatusOr<tls::ClusterFiles> files = tls::WriteClusterCertificates(opt.out, opt.days);
    if (!files.ok()) return files.status();
    std::printf(
        "wrote a CA and certificates to %s (valid %d days):\n"
        "  router: tls: {ca: %s, cert: %s, key: %s}\n"
        "  worker: --tls-ca %s --tls-cert %s --tls-key %s\n"
        "keep %s safe: whoever holds it can make certificates this cluster trusts\n",
        opt.out.c_str(), opt.days, files->router.ca.c_str(), files->router.cert.c_str(), files->router.key.c_str(),
        files->worker.ca.c_str(), files->worker.cert.c_str(), files->worker.key.c_str(), files->ca_key.c_str());
    return absl::OkStatus();
  }
  for (const std::string& item : opt.issue) {
    const size_t colon = item.find(':');
    const std::string role = item.substr(0, colon);
    const std::string name = colon == std::string::npos ? "" : item.substr(colon + 1);
    const char* identity = role == "router" ? tls::kRouterIdentity : role == "worker" ? tls::kWorkerIdentity : nullptr;
    if (identity == nullptr || name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--issue '", item, "': expected router:NAME or worker:NAME"));
    }
    absl::StatusOr<tls::TlsFiles> f = tls::IssueFromCaDir(opt.out, identity, name, opt.days);
    if (!f.ok()) return absl::Status(f.status().code(), absl::StrCat("--issue ", item, ": ", f.status().message()));
    std::printf("%s certificate %s: %s, key %s\n", role.c_str(), name.c_str(), f->cert.c_str(), f->key.c_str());
  }
  return absl::OkStatus();
}

}  // namespace

void AddCertsCommand(CLI::App& app) {
  auto opt = std::make_shared<CertsOptions>();
  CLI::App* cmd = app.add_subcommand("certs", "Make a cluster CA and router/worker certificates for mutual TLS");
  cmd->add_option("--out", opt->out, "Directory for ca.crt/key, router.crt/key, worker.crt/key");
  cmd->add_option("--issue", opt->issue,
                  "Issue one more certificate from the CA in --out: router:NAME or worker:NAME "
                  "(repeatable)");
  cmd->add_option("--days", opt->days, "Validity in days")->capture_default_str();
  cmd->callback([opt] { worker::ExitWithStatus("certs", Certs(*opt)); });
}

}  // namespace tandem::router
