// The `tandem` binary: parses the command line and dispatches to the
// subcommands each module registers. No other logic lives here.
#include <CLI/CLI.hpp>

#include "absl/synchronization/mutex.h"
#include "orchestrator/bench/bench_command.h"
#include "orchestrator/bench/grpc_floor.h"
#include "orchestrator/bench/mock_server.h"
#include "orchestrator/cli/router_command.h"
#include "worker/cli/commands.h"

int main(int argc, char** argv) {
  // Debian's Abseil is built with absl::Mutex's deadlock detection on, which
  // records every lock order in a global graph: ~1-2% of the router's and
  // workers' CPU, spent mostly under gRPC's locks. Tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"tandem: disaggregated LLM serving (router, prefill and decode workers)"};
  app.require_subcommand(1);
  tandem::router::AddRouterCommand(app);
  tandem::router::AddUpCommand(app);
  tandem::router::AddCertsCommand(app);
  tandem::worker::AddWorkerCommand(app);
  tandem::worker::AddGenerateCommand(app);
  tandem::worker::AddLogitsCommand(app);
  tandem::worker::AddExportModelCommand(app);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks: a serving benchmark against --url, or a subcommand");
  tandem::bench::AddServingBench(*bench);
  tandem::worker::AddBenchCommand(*bench);
  tandem::worker::AddTransferBenchCommand(*bench);
  tandem::worker::AddAttentionBenchCommand(*bench);
  tandem::bench::AddMockServerCommand(*bench);
  tandem::bench::AddGrpcFloorCommand(*bench);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
