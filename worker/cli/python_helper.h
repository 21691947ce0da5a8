// The benchmarks' Python helpers (torch and transformers baselines, run as a
// subprocess on the GPU machine): where their scripts live, and running one
// for its JSON answer.
#ifndef TANDEM_WORKER_CLI_PYTHON_HELPER_H_
#define TANDEM_WORKER_CLI_PYTHON_HELPER_H_

#include <nlohmann/json.hpp>
#include <string>

namespace tandem::worker {

// Where helper script `name` lives: `flag` when given, else the first of
// scripts/NAME under the working directory, NAME beside the binary (a bundle
// puts it next to `tandem`) and scripts/NAME in the binary's directory or any
// directory above it that exists; "scripts/NAME" when none does.
std::string FindHelperScript(const std::string& flag, const std::string& name);

// `s` single-quoted for sh.
std::string ShellQuote(const std::string& s);

// Runs `command` (its stderr passes through: progress) and returns the last
// line of its stdout that parses as a JSON object, or {"available": false,
// "why": ...} naming the command and its exit status when there is none.
nlohmann::json RunJsonHelper(const std::string& command);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_CLI_PYTHON_HELPER_H_
