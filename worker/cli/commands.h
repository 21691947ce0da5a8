// The worker-side subcommands of the `tandem` binary. Each Add*Command
// registers a CLI11 subcommand with its flags; the subcommand's callback runs
// it and exits the process with its status.
#ifndef TANDEM_WORKER_CLI_COMMANDS_H_
#define TANDEM_WORKER_CLI_COMMANDS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace CLI {
class App;
}

namespace tandem::worker {

// `tandem worker`: serve the worker gRPC API.
void AddWorkerCommand(CLI::App& app);
// `tandem logits`: full-vocabulary logits of token sequences (a debugging and
// verification tool; the reference test drives it).
void AddLogitsCommand(CLI::App& app);
// `tandem export-model`: write a built-in model as a Hugging Face checkpoint.
void AddExportModelCommand(CLI::App& app);
// `tandem generate`: a small client that generates from a prompt over gRPC.
void AddGenerateCommand(CLI::App& app);
// `tandem bench engine`: CPU prefill and decode throughput against OpenBLAS
// sgemm. Registers under `bench`, the `tandem bench` parent command.
void AddBenchCommand(CLI::App& bench);
// `tandem bench transfer`: KV-block Push between two processes (UCX shm/tcp,
// or the loopback backend) against memcpy. Registers under `bench`.
void AddTransferBenchCommand(CLI::App& bench);
// `tandem bench attention`: the CUDA paged-attention kernels (prefill TFLOP/s,
// decode GB/s of KV read) against torch SDPA (scripts/bench_attention_torch.py)
// and a device-to-device copy, measured in the same run. Exits 2 without a
// usable GPU. Registers under `bench`.
void AddAttentionBenchCommand(CLI::App& bench);

// Ends a subcommand: exit 0 if `status` is OK, else prints
// "tandem <command>: <message>" to stderr and exits 1.
[[noreturn]] void ExitWithStatus(const char* command, const absl::Status& status);

// "256MiB", "1.5GiB", "4096", "2GB" -> bytes. InvalidArgument otherwise.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_CLI_COMMANDS_H_
