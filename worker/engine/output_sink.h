// OutputSink: where the engine delivers one request's results. The engine
// thread calls OnToken for each sampled token in order, then OnFinish exactly
// once (also after a cancellation or an error). Implementations must not
// block: they queue the output for their transport and return.
#ifndef TANDEM_WORKER_ENGINE_OUTPUT_SINK_H_
#define TANDEM_WORKER_ENGINE_OUTPUT_SINK_H_

#include <string>
#include <vector>

#include "worker/sampling/sampler.h"

namespace tandem::worker {

enum class FinishReason { kStop, kLength, kAbort, kError };

struct FinishInfo {
  FinishReason reason = FinishReason::kStop;
  int stop_token_id = -1;  // the stop or EOS id that ended generation
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_prompt_tokens = 0;
  std::string error;             // kError: what went wrong
  bool worker_stopping = false;  // kAbort because the worker shuts down (not the client)
};

class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void OnToken(const SampledToken& token) = 0;
  virtual void OnFinish(const FinishInfo& info) = 0;
  // Disaggregation, decode side: the reserved prompt's KV did not arrive and
  // is being computed here. `first_token_known`: the prefill worker's first
  // token is reused (OnToken starts after it); otherwise OnToken's next call
  // is this worker's own first token.
  virtual void OnLocalPrefill(bool first_token_known) {}
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_OUTPUT_SINK_H_
