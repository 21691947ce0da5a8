#include "orchestrator/cli/router_command.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "orchestrator/config/router_config.h"
#include "worker/cli/commands.h"

namespace tandem::router {
namespace {

struct RouterOptions {
  std::string config;        // the YAML file to serve with
  std::string check_config;  // validate this file and exit
};

std::string DescribePool(const char* role, const std::optional<PoolConfig>& pool) {
  if (!pool.has_value()) return absl::StrFormat("no %s pool", role);
  const std::string where =
      pool->discovery.has_value()
          ? absl::StrFormat("DNS %s:%d every %.0f s", pool->discovery->dns, pool->discovery->port,
                            pool->discovery->interval_s)
          : absl::StrFormat("%d static workers", pool->workers.size());
  return absl::StrFormat("%s pool: %s, policy %s", role, where, pool->policy.name);
}

absl::Status CheckConfig(const std::string& path) {
  absl::StatusOr<RouterConfig> config = LoadRouterConfig(path);
  if (!config.ok()) return config.status();
  std::printf("%s: ok (listener %s:%d; disaggregation %s; %s; %s)\n", path.c_str(),
              config->listener.host.c_str(), config->listener.port,
              std::string(DisaggregationModeName(config->disaggregation.mode)).c_str(),
              DescribePool("prefill", config->prefill).c_str(),
              DescribePool("decode", config->decode).c_str());
  return absl::OkStatus();
}

}  // namespace

void AddRouterCommand(CLI::App& app) {
  auto opt = std::make_shared<RouterOptions>();
  CLI::App* cmd = app.add_subcommand("router", "The OpenAI-compatible router (config checks today)");
  cmd->add_option("--config", opt->config, "Router configuration (YAML)");
  cmd->add_option("--check-config", opt->check_config,
                  "Validate this router configuration and exit (0: valid)");
  cmd->callback([opt] {
    if (!opt->check_config.empty()) {
      worker::ExitWithStatus("router", CheckConfig(opt->check_config));
    }
    worker::ExitWithStatus(
        "router", absl::UnimplementedError(
                      "the router's HTTP front is not built yet; `tandem router --check-config "
                      "FILE` validates a configuration"));
  });
}

}  // namespace tandem::router
