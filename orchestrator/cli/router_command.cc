#include "orchestrator/cli/router_command.h"

#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/server/router.h"
#include "worker/cli/commands.h"

namespace tandem::router {
namespace {

struct RouterOptions {
  std::string config;        // the YAML file to serve with
  std::string check_config;  // validate this file and exit
  std::string ready_file;    // write host:port here once serving
};

std::string DescribePool(const char* role, const std::optional<PoolConfig>& pool) {
  if (!pool.has_value()) return absl::StrFormat("no %s pool", role);
  const std::string where = pool->discovery.has_value()
                                ? absl::StrFormat("DNS %s:%d every %.0f s", pool->discovery->dns, pool->discovery->port,
                                                  pool->discovery->interval_s)
                                : absl::StrFormat("%d static workers", pool->workers.size());
  return absl::StrFormat("%s pool: %s, policy %s", role, where, pool->policy.name);
}

absl::Status CheckConfig(const std::string& path) {
  absl::StatusOr<RouterConfig> config = LoadRouterConfig(path);
  if (!config.ok()) return config.status();
  std::printf("%s: ok (listener %s:%d; disaggregation %s; %s; %s)\n", path.c_str(), config->listener.host.c_str(),
              config->listener.port, std::string(DisaggregationModeName(config->disaggregation.mode)).c_str(),
              DescribePool("prefill", config->prefill).c_str(), DescribePool("decode", config->decode).c_str());
  return absl::OkStatus();
}

// Serves until SIGINT/SIGTERM; SIGHUP reloads the file.
absl::Status Serve(const std::string& path, const std::string& ready_file) {
  absl::StatusOr<RouterConfig> config = LoadRouterConfig(path);
  if (!config.ok()) return config.status();
  const std::string config_host = config->listener.host;
  RETURN_IF_ERROR(InstallSignalHandlers({SIGINT, SIGTERM, SIGHUP}));
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Create(*std::move(config), path);
  if (!router.ok()) return router.status();
  RETURN_IF_ERROR((*router)->Start());
  if (!ready_file.empty()) {
    RETURN_IF_ERROR(WriteFileAtomically(ready_file, absl::StrFormat("%s:%d\n", config_host, (*router)->port())));
  }
  while (true) {
    const int sig = WaitForSignal();
    if (sig != SIGHUP) {
      LOG(INFO) << "router: signal " << sig << ", shutting down";
      break;
    }
    LOG(INFO) << "router: SIGHUP, reloading " << path;
    (void)(*router)->Reload();  // logs why on failure and keeps the running config
  }
  (*router)->Stop();
  return absl::OkStatus();
}

}  // namespace

void AddRouterCommand(CLI::App& app) {
  auto opt = std::make_shared<RouterOptions>();
  CLI::App* cmd = app.add_subcommand("router", "The OpenAI-compatible router in front of prefill and decode workers");
  cmd->add_option("--config", opt->config, "Router configuration (YAML)");
  cmd->add_option("--ready-file", opt->ready_file, "Write host:port here once serving");
  cmd->add_option("--check-config", opt->check_config, "Validate this router configuration and exit (0: valid)");
  cmd->callback([opt] {
    if (!opt->check_config.empty()) {
      worker::ExitWithStatus("router", CheckConfig(opt->check_config));
    }
    if (opt->config.empty()) {
      worker::ExitWithStatus("router", absl::InvalidArgumentError("give --config FILE (see "
                                                                  "orchestrator/config/router.example.yaml)"));
    }
    worker::ExitWithStatus("router", Serve(opt->config, opt->ready_file));
  });
}

}  // namespace tandem::router
