// `tandem bench --url URL ...`: the serving benchmark (load generator and
// report) on the `bench` command itself; its subcommands (`bench engine`,
// `bench transfer`) are other benchmarks, and `bench mock-server` a server
// to measure against.
#ifndef TANDEM_ORCHESTRATOR_BENCH_BENCH_COMMAND_H_
#define TANDEM_ORCHESTRATOR_BENCH_BENCH_COMMAND_H_

namespace CLI {
class App;
}

namespace tandem::bench {

// Adds the serving benchmark's options to `bench` and runs it when `bench`
// is given no subcommand.
void AddServingBench(CLI::App& bench);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_BENCH_COMMAND_H_
