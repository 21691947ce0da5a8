// Sequence: one request's state inside the engine. Owned by the engine
// thread; nothing here is thread-safe.
#ifndef TANDEM_WORKER_ENGINE_SEQUENCE_H_
#define TANDEM_WORKER_ENGINE_SEQUENCE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "worker/engine/output_sink.h"
#include "worker/sampling/sampling_params.h"

namespace tandem::worker {

struct Prefilled;

struct Sequence {
  uint64_t id = 0;              // engine-assigned, increasing with arrival
  std::string request_id;       // the caller's id
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int prompt_len = 0;
  int resumed_output = 0;  // leading output tokens made elsewhere (a resumption)
  SamplingParams params;
  uint64_t seed = 0;   // params.seed or one drawn at submission
  int max_tokens = 0;  // resolved: never past the context
  std::shared_ptr<OutputSink> sink;

  std::vector<int32_t> blocks;   // block table: block i holds tokens [i*bs, (i+1)*bs)
  int num_computed = 0;          // leading tokens whose K/V is in the cache
  int num_hashed = 0;            // leading full blocks registered in the prefix cache
  uint64_t last_hash = 0;        // hash of block num_hashed - 1 (the seed when 0)
  int cached_prompt_tokens = 0;  // prompt tokens found in the prefix cache at admission
  bool admitted_before = false;  // a preempted sequence re-enters the queue
  int preemptions = 0;
  // Decode side: a reservation's blocks stay out of use at least until then
  // once it ends (Engine::PinReservation).
  std::chrono::steady_clock::time_point pinned_until{};

  // Disaggregation, prefill side: when set, the sequence stops after its
  // first token and the engine hands its blocks over (Engine::Prefilled).
  std::function<void(const struct Prefilled&)> on_prefilled;
  std::chrono::milliseconds hold_timeout{30000};  // blocks held this long after the first token
  // Decode side, local prefill after a failed transfer: the first token the
  // prefill worker already sampled (and the caller already has). It is used
  // instead of sampling and not sent to the sink again.
  std::optional<SampledToken> forced_first;

  int output_len() const { return static_cast<int>(tokens.size()) - prompt_len; }
  std::span<const int32_t> prompt() const { return {tokens.data(), size_t(prompt_len)}; }
  std::span<const int32_t> output() const { return {tokens.data() + prompt_len, size_t(output_len())}; }
  // Tokens still to be computed before the next sample (1 while decoding).
  int pending() const { return static_cast<int>(tokens.size()) - num_computed; }
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_SEQUENCE_H_
