// Client-side helpers for tests that drive `tandem worker` processes over
// gRPC: requests, whole-stream reads, output comparison (tokens, finish,
// logprobs within a tolerance) and load polling. They report mismatches as
// gtest failures. The model constants are builtin:tiny's (vocabulary 384:
// bytes 0-255 plus specials, EOS ids 257 and 260, context 2048, 3 layers,
// 2 KV heads of dimension 16).
#ifndef TANDEM_TESTS_TESTING_WORKER_CLIENT_H_
#define TANDEM_TESTS_TESTING_WORKER_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::testing {

constexpr int kVocabSize = 384;
constexpr int kBlockSize = 16;
constexpr int kContext = 2048;
// One KV block of builtin:tiny in float32:
// layers(3) * {K,V}(2) * kv_heads(2) * block_size(16) * head_dim(16) * 4 bytes.
constexpr int64_t kBytesPerBlock = 3 * 2 * 2 * kBlockSize * 16 * 4;
constexpr float kLogprobTolerance = 1e-5f;
// The tolerance between two runs of the same request whose steps batched it
// differently: kLogprobTolerance, except for workers on the GPU runner
// outside --batch-invariant (TANDEM_TEST_WORKER_ARGS), whose steps of one or
// two tokens, of three to eight and of more run different product kernels
// (the fused GEMV, the tensor-core products, cuBLASLt) with different bf16
// roundings: 0.05 there (the greedy tokens must still be the same; top
// alternatives within it of each other may change places).
float BatchingLogprobTolerance();
constexpr std::chrono::seconds kRpcTimeout(60);
constexpr std::chrono::milliseconds kIdleTimeout(5000);

// Whether TANDEM_TEST_WORKER_DEVICE puts the aggregated real-engine test
// workers on a GPU (tests/testing/worker_process.cc); their KV is bfloat16
// there, and their block sizes are 16, 32 or 64.
bool WorkersOnGpu();
// One KV block of an aggregated real-engine test worker: kBytesPerBlock, or
// half of it in bfloat16 on a GPU.
int64_t AggregatedBytesPerBlock();

// --kv-cache-memory for a pool of `blocks` blocks of an aggregated worker.
std::string CacheBytesFlag(int blocks);

// Deterministic pseudo-random byte tokens: different seeds give different
// prompts (no shared first block).
std::vector<int32_t> MakePrompt(uint32_t seed, int len);
std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b);

// Greedy, with the sampled token's logprob and 3 alternatives.
v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int max_tokens);
// Seeded nucleus sampling, with logprobs.
v1::GenerateRequest SampledRequest(const std::vector<int32_t>& prompt, int max_tokens, uint64_t seed);

// Everything one Generate stream returned.
struct Output {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> top;  // per token, most likely first
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  int32_t stop_token_id = 0;
  v1::Usage usage;
  std::string error_message;
  int messages = 0;
  int finish_messages = 0;         // messages that carried a finish_reason
  bool finish_before_end = false;  // a message followed the one with the finish_reason
  // Disaggregation: the reservation (RECEIVE), whether the decode worker sent
  // its own first token (includes_first_token), the hand-off's outcome (SEND).
  v1::KvReservation reservation;
  bool includes_first_token = false;
  std::string kv_transfer_error;
  std::chrono::steady_clock::time_point started;  // when the call was made
  std::chrono::steady_clock::time_point ended;    // when its status came back
};

// Adds one stream message to `out`.
void Accumulate(const v1::GenerateResponse& msg, Output* out);

Output Generate(v1::Worker::Stub& stub, const v1::GenerateRequest& req,
                std::chrono::milliseconds timeout = kRpcTimeout);

// A finished stream: OK status, exactly one finishing message, the last one.
void ExpectWellFormed(const Output& out, const std::string& what);
// Same tokens, finish and (within BatchingLogprobTolerance()) logprobs.
void ExpectSameOutput(const Output& got, const Output& want, const std::string& what);

// Sends every request at once, one thread each (released together), and
// returns their outputs in request order.
std::vector<Output> GenerateConcurrently(v1::Worker::Stub& stub, const std::vector<v1::GenerateRequest>& requests);

v1::LoadReport GetLoad(v1::Worker::Stub& stub);
v1::ModelInfo GetModelInfo(v1::Worker::Stub& stub);
// Polls Health (every 10 ms, for `timeout` at most) until it reports
// `status`; returns the last status seen (UNSPECIFIED when a call failed).
v1::HealthResponse::ServingStatus WaitForHealth(v1::Worker::Stub& stub, v1::HealthResponse::ServingStatus status,
                                                std::chrono::milliseconds timeout);

// Polls GetLoad until `done` holds or `timeout` passes; returns the last
// report, and whether `done` held, in *ok.
v1::LoadReport WaitForLoad(v1::Worker::Stub& stub, const std::function<bool(const v1::LoadReport&)>& done, bool* ok,
                           std::chrono::milliseconds timeout = kIdleTimeout);

// No sequence runs or waits, no block is referenced, nothing is reserved
// for or held back from a transfer.
bool IsIdle(const v1::LoadReport& l);
// Waits until IsIdle (a test failure if it does not come).
v1::LoadReport ExpectIdle(v1::Worker::Stub& stub, const std::string& what,
                          std::chrono::milliseconds timeout = kIdleTimeout);

// ---------------------------------------------------------------------------
// Disaggregated serving, driven as the router does (worker.proto's protocol).

// A request's two streams.
struct Split {
  Output decode;   // RECEIVE stream: reservation, then the tokens after the first
  Output prefill;  // SEND stream: the first token, then the hand-off's outcome
  // The client's view: the prefill's first token, then decode's (or decode's
  // whole output when it prefilled locally before anything came).
  Output combined;
};

// A decode stream opened with RECEIVE; the reservation arrives first.
class ReceiveStream {
 public:
  ReceiveStream(v1::Worker::Stub& decode, v1::GenerateRequest req, uint32_t timeout_ms = 0);
  // The reservation (absent if the call failed: see Finish()).
  bool reserved() const { return out_.reservation.reservation_id() != 0; }
  const v1::KvReservation& reservation() const { return out_.reservation; }
  void Cancel() { ctx_.TryCancel(); }
  // Reads the rest of the stream.
  Output Finish();

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  Output out_;
};

// `req` as a SEND request for the reservation `r` of the decode worker at
// `decode_address` (as the prefill worker reaches it).
v1::GenerateRequest SendRequest(v1::GenerateRequest req, const std::string& decode_address, const v1::KvReservation& r);
// What the client sees of a split request.
Output Combine(const Output& prefill, const Output& decode);
// Reserve on the decode worker, prefill with SEND, read both streams.
Split RunDisaggregated(v1::Worker::Stub& prefill, v1::Worker::Stub& decode, const std::string& decode_address,
                       const v1::GenerateRequest& req, uint32_t timeout_ms = 0);
// RunDisaggregated for every request at once (as GenerateConcurrently).
std::vector<Split> RunDisaggregatedConcurrently(v1::Worker::Stub& prefill, v1::Worker::Stub& decode,
                                                const std::string& decode_address,
                                                const std::vector<v1::GenerateRequest>& requests);
// Waits until the decode worker has a KV pull submitted to its transport;
// false if none starts within kIdleTimeout.
bool WaitForPullInFlight(v1::Worker::Stub& decode);

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_WORKER_CLIENT_H_
