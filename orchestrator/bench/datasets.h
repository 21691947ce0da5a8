// Workloads of the serving benchmark (`tandem bench --url --dataset NAME`).
//
// A workload is a list of sessions; a session is one or more turns sent in
// order, each after the previous one's response (multi-turn resends the
// growing history, with the server's own answers, so a prefix cache sees the
// conversation grow). Sessions start at `arrival_s` when set (trace replay),
// otherwise by the benchmark's request-rate process.
//
//   random        input and output lengths uniform in [len * (1 - range),
//                 len * (1 + range)] (vLLM's --random-range-ratio), random
//                 tokens, one turn per session;
//   shared-prefix G groups, each a random prefix of P tokens; every request
//                 is its group's prefix plus S unique tokens (requests cycle
//                 through the groups in a shuffled order);
//   multi-turn    sessions of T turns; each turn adds a user message of U
//                 tokens to the history (the first after a system prompt of
//                 P tokens); session id header per session;
//   sharegpt      a ShareGPT-format JSON file: the first human turn is the
//                 prompt; the output length is the reference answer's token
//                 count (or --output-len); prompts under 4 tokens or with an
//                 answer under 4 tokens are skipped, as vLLM does;
//   trace         a Mooncake-format trace (jsonl: timestamp in ms,
//                 input_length, output_length, hash_ids): each hash id is a
//                 block of `trace_block_tokens` tokens drawn from a generator
//                 seeded by the id, so requests sharing hash ids share
//                 prefixes; sent at their timestamps (scaled by
//                 1 / trace_speedup).
//
// Tokens are drawn from the tokenizer's "text-safe" ids (each decodes alone
// to valid, printable UTF-8 that encodes back to it, and is no special
// token), so a prompt can be sent as ids (completions) or as its decoded text
// (chat).
//
// Thread safety: plain functions over values.
#ifndef TANDEM_ORCHESTRATOR_BENCH_DATASETS_H_
#define TANDEM_ORCHESTRATOR_BENCH_DATASETS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "orchestrator/tokenizer/tokenizer.h"

namespace tandem::bench {

using router::Tokenizer;

struct Turn {
  std::vector<int32_t> tokens;  // this turn's new input (the user message, or the whole prompt)
  int max_tokens = 0;           // output length asked for
};

struct Session {
  std::string id;               // sent as the session header (multi-turn); empty: none
  std::vector<int32_t> system;  // multi-turn: the system prompt's tokens (empty: none)
  std::vector<Turn> turns;
  double arrival_s = -1;  // trace: when to start; < 0: by the request-rate process
};

struct DatasetOptions {
  std::string name = "random";  // random | shared-prefix | multi-turn | sharegpt | trace
  std::string path;             // sharegpt / trace file
  int num_prompts = 100;        // requests (multi-turn: sessions x turns, rounded up to whole sessions)
  uint64_t seed = 0;
  // random
  int input_len = 1024;
  int output_len = 128;
  double range_ratio = 0.0;
  // shared-prefix
  int num_groups = 8;
  int prefix_len = 2048;
  int suffix_len = 128;
  // multi-turn
  int turns = 5;
  int system_len = 512;
  int user_len = 128;
  // Tokens every session's system prompt starts with (one application's
  // system prompt), ahead of its own system_len tokens.
  int common_prefix_len = 0;
  // sharegpt: 0 keeps the reference answer's length
  int sharegpt_output_len = 0;
  // trace
  int trace_block_tokens = 512;
  double trace_speedup = 1.0;
};

// The sessions of a workload. InvalidArgument for a bad option or file
// content (naming the line or entry), NotFound for a missing file.
absl::StatusOr<std::vector<Session>> BuildDataset(const DatasetOptions& options, const Tokenizer& tokenizer);

// Ids of `tokenizer` that decode alone to printable, valid UTF-8 text which
// encodes back to that one id, and are no special token (the datasets'
// alphabet). Never empty for a usable tokenizer; InvalidArgument if it is.
absl::StatusOr<std::vector<int32_t>> TextSafeIds(const Tokenizer& tokenizer);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_DATASETS_H_
