// The router-side subcommands of the `tandem` binary.
//
// `tandem router --config FILE` serves the OpenAI-compatible API
// (orchestrator/server/router.h) until SIGINT/SIGTERM; SIGHUP reloads FILE.
// `tandem router --check-config FILE` validates a router configuration
// (orchestrator/config/router_config.h) and exits: 0 and a summary when it
// is valid, 1 and "FILE:LINE:COL: key: why" when not.
// `tandem up` starts a local cluster (workers and a router as children).
// `tandem certs` makes a cluster CA and certificates for mutual TLS.
#ifndef TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_
#define TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_

namespace CLI {
class App;
}

namespace tandem::router {

void AddRouterCommand(CLI::App& app);
void AddUpCommand(CLI::App& app);
void AddCertsCommand(CLI::App& app);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_
