// `tandem bench grpc-floor`: what one streamed gRPC call costs on this
// machine with nothing else in it -- the floor under any router that drives
// its workers over gRPC, measured beside the router-overhead benchmark
// (scripts/bench_overhead.sh) so that "tandem adds X ms" can be read
// against "a bare gRPC hop adds Y ms" on the same cores.
//
// Two processes, both `tandem bench grpc-floor`:
//  - `--serve`: a server of tandem's Worker API that answers Generate and
//    nothing else, without a model, engine or KV cache: on a call it writes
//    a first message with one token, then, once that write completes, the
//    other max_tokens - 1 tokens with the finish reason and usage, and ends
//    the stream -- the two messages a sim worker with zero timings sends.
//    All on one GrpcPoller thread (the completion-queue poller tandem's
//    router and worker use), or with `--handoff` the call is handed to a
//    second thread (mutex and condition variable) that writes, the shape of
//    a worker's poller and engine threads. Serves until SIGINT or SIGTERM.
//  - the client (`--target host:port`): `--num-prompts` Generate calls of
//    `--input-len` token ids at `--request-rate` (a Poisson process, --seed)
//    started from a thread of their own that sleeps until each arrival (the
//    router's HTTP thread), read on a GrpcPoller thread (the router's). For
//    each call: time to the first message and to the stream's end, from the
//    moment it was started. Prints p50/p90/p99 of both, and with `--json`
//    writes them (ms) to a file.
//
// It is a measuring tool, not part of serving: the server's answers carry
// no model output.
#ifndef TANDEM_ORCHESTRATOR_BENCH_GRPC_FLOOR_H_
#define TANDEM_ORCHESTRATOR_BENCH_GRPC_FLOOR_H_

namespace CLI {
class App;
}

namespace tandem::bench {

// Registers `grpc-floor` under `bench`, the `tandem bench` parent command.
void AddGrpcFloorCommand(CLI::App& bench);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_GRPC_FLOOR_H_
