// The router-side subcommands of the `tandem` binary.
//
// `tandem router --check-config FILE` validates a router configuration
// (orchestrator/config/router_config.h) and exits: 0 and a summary when it
// is valid, 1 and "FILE:LINE:COL: key: why" when not. Serving (the
// OpenAI-compatible HTTP front) arrives with the rest of the router; until
// then `tandem router` without --check-config exits with an error saying so.
#ifndef TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_
#define TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_

namespace CLI {
class App;
}

namespace tandem::router {

void AddRouterCommand(CLI::App& app);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CLI_ROUTER_COMMAND_H_
