// Whether a worker can serve in the router's cluster. Routing and KV
// hand-offs only work when the router and every worker agree: the router
// tokenizes prompts for workers that must read the same ids; the KV-aware
// index hashes prompt blocks the way the workers hash theirs (block size and
// hash seed); a decode worker takes KV blocks of a prefill worker's layout.
// A worker that disagrees is refused loudly (never admitted, an ERROR in the
// log, a metric, the reason in /health), not routed to with silently wrong
// results or a silently useless cache index.
#ifndef TANDEM_ORCHESTRATOR_CLUSTER_COMPATIBILITY_H_
#define TANDEM_ORCHESTRATOR_CLUSTER_COMPATIBILITY_H_

#include <string>

#include "tandem/v1/worker.pb.h"

namespace tandem::router {

// The router's own side of the agreement: its tokenizer.
struct RouterTokenizer {
  std::string sha256;  // hex SHA-256 of its tokenizer.json; empty: not checked
  int vocab_size = 0;  // the ids it produces are below this
  std::string source;  // "builtin" or the tokenizer.json path, for messages
};

// Why the worker that reported `worker` cannot serve beside `reference` (the
// ModelInfo of a worker already serving; null when none does) for a router
// with `tokenizer`; empty when it can. Compared: the tokenizer (by SHA-256,
// where the worker reports one; else the router's ids must fit the model's
// vocabulary), and against the reference the served model, architecture,
// vocabulary, KV layout (layers, KV heads, head size, dtype), block size,
// block hash seed and engine kind.
std::string Incompatibility(const tandem::v1::ModelInfo& worker, const tandem::v1::ModelInfo* reference,
                            const RouterTokenizer& tokenizer);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CLUSTER_COMPATIBILITY_H_
