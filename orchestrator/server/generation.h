// Generation: one choice of one request, driven over the workers' gRPC API.
// It asks a Planner where to run (aggregated on one worker, or prefill on
// one and decode on another), runs the worker calls on gRPC's asynchronous API (GrpcPoller),
// merges their token streams into one ordered stream for a GenerationSink,
// and retries elsewhere when an attempt fails before the first token.
//
// Disaggregated attempt (the protocol of proto/tandem/v1/worker.proto):
//   1. Generate(mode RECEIVE) on the decode worker; its first message is
//      the KvReservation.
//   2. Generate(mode SEND) on the prefill worker naming the reservation; its
//      first token is the request's first token.
//   3. The decode stream carries the tokens after the first (or, when the
//      decode worker prefilled locally because the KV never came, all of
//      them: includes_first_token). Decode tokens that arrive before the
//      prefill worker's first token (the two streams race to the router)
//      wait for it; a first token already taken from the prefill stream is
//      not repeated from a local-prefill decode stream (both sampled it with
//      the same seed).
// The request finishes with the decode stream; a prefill stream still
// closing (the KvReady answer) is left to end on its own.
//
// Retries: an attempt that fails before any token reached the sink, with a
// code that says "try elsewhere" (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED,
// FAILED_PRECONDITION, INTERNAL, UNKNOWN), is cancelled whole and placed
// again without the worker that failed, up to `max_attempts` and while the
// planner's retry budget allows. UNAVAILABLE also ejects the worker at once.
// A worker once tried is passed over until its health checks admit it again
// (TriedWorkers).
//
// Attempt deadlines (CheckProgress, from the router's watchdog): an attempt
// that sent no token `first_token_s` after it started, or none for `idle_s`
// after its last, is stuck on an unresponsive worker (frozen, or its peer
// is). When the planner finds another healthy worker, the attempt is
// cancelled, the suspect worker ejected (it is readmitted by its health
// checks), and the generation moves: a retry before the first token, a
// failover after it. When none is left, the attempt keeps its chance.
//
// Waiting for a worker: when no healthy worker is left to place an attempt
// on (a pool restarting, a pod not yet past its health checks), the
// generation waits up to `wait_for_worker`, placing again on each
// CheckProgress, before it fails with the planner's UNAVAILABLE; not when
// the planner says none can come (kNoWorkerToWaitFor). The wait launches
// nothing and holds no worker.
//
// Failover (after tokens reached the sink): a decode or aggregated call that
// fails with a retryable code, or misses its deadline, is resumed on another
// decode worker, aggregated, from the prompt plus every token already sent
// (GenerateRequest.resume_output_tokens tells the worker which are output,
// so penalties, min/max_tokens and the seeded sampling position continue
// exactly). The sink sees one stream with no token lost or repeated; the
// first token's KV is recomputed there (the prefix cache may hold part).
// Up to `max_failovers` per generation; they do not draw on the retry
// budget. A generation whose last token already ended it (a stop token,
// max_tokens, the context) finishes instead.
//
// Thread safety: Start and Cancel may be called from any thread; the sink is
// called from the GrpcPoller's thread, serially for one Generation, with the
// Generation's mutex held: a sink must not call back into the Generation
// (it returns false from OnTokens to stop it instead).
#ifndef TANDEM_ORCHESTRATOR_SERVER_GENERATION_H_
#define TANDEM_ORCHESTRATOR_SERVER_GENERATION_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "orchestrator/cluster/worker_client.h"
#include "orchestrator/server/latency_window.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::router {

// Where one attempt runs.
struct Placement {
  std::shared_ptr<WorkerClient> prefill;  // null: aggregated on `decode`
  std::shared_ptr<WorkerClient> decode;   // never null
  // Prompt tokens the policy expects each worker to find cached (0 when it
  // cannot tell): the rest count as that worker's pending prefill.
  int64_t prefill_cached_tokens = 0;
  int64_t decode_cached_tokens = 0;
  // Disaggregation was wanted but the attempt runs aggregated (no healthy
  // prefill worker, or mode auto chose a local prefill).
  bool local_prefill = false;
  // For a request that asked why (x-tandem-explain): the routing decisions
  // as compact JSON, one object per pool consulted; empty otherwise.
  std::string explanation;
};

// The workers a generation already tried, by address, with when the attempt
// on each started: placement passes one over unless its health checks have
// admitted it (again) since (the same process back after an ejection, or a
// new one restarted at that address).
using TriedWorkers = std::map<std::string, std::chrono::steady_clock::time_point>;

// The payload (its type URL) of a planner's UNAVAILABLE when waiting cannot
// help: every worker of the pool is healthy (or refused as incompatible) but
// already tried, so none is coming back for this generation.
inline constexpr char kNoWorkerToWaitFor[] = "type.tandem/no-worker-to-wait-for";

class Planner {
 public:
  virtual ~Planner() = default;
  // Chooses workers for `tokens`, never one `tried` passes over.
  // Unavailable when no healthy worker is left.
  virtual absl::StatusOr<Placement> Place(std::span<const int32_t> tokens, const TriedWorkers& tried) = 0;
  // Takes one retry from the budget; false when it is spent.
  virtual bool TakeRetry() = 0;
  // A generation began (+1) or ended (-1) a wait for a healthy worker.
  virtual void NoteWaiting(int delta) = 0;
};

struct GenerationResult {
  absl::Status status;  // OK, or why the generation failed / was cancelled
  tandem::v1::FinishReason finish_reason = tandem::v1::FINISH_REASON_UNSPECIFIED;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;   // served from a prefix cache (the prefill worker's when split)
  std::string prefill_worker;  // where the last attempt ran (equal when aggregated)
  std::string decode_worker;
  int attempts = 0;
  int error_failovers = 0;             // resumed elsewhere after the stream failed mid-way
  int stall_failovers = 0;             // resumed elsewhere after the idle deadline
  int first_token_timeouts = 0;        // attempts past their first-token deadline
  int idle_timeouts = 0;               // attempts past their idle deadline (mid-stream)
  int worker_waits = 0;                // waits for a healthy worker that ended placed
  bool worker_wait_expired = false;    // a wait ran out (or nothing was left to wait for): it failed
  bool worker_wait_cancelled = false;  // it ended (cancelled, timed out) while waiting
  bool kv_fallback = false;            // the decode worker prefilled locally: the KV never came
  int64_t kv_bytes = 0;                // pulled by the decode worker
};

class GenerationSink {
 public:
  virtual ~GenerationSink() = default;
  // The first token is about to reach the sink: the attempt's workers are
  // final. Called once, before the first OnTokens, or before an OnDone that
  // ends the generation without tokens (the workers last tried).
  virtual void OnPlaced(int choice, const Placement& placement) = 0;
  // New tokens, in order. Return false to stop the generation here (a stop
  // string matched): the workers are cancelled and OnDone follows with
  // finish reason STOP.
  virtual bool OnTokens(int choice, std::span<const tandem::v1::TokenOutput> tokens) = 0;
  // Exactly once, last.
  virtual void OnDone(int choice, const GenerationResult& result) = 0;
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  struct Options {
    int choice = 0;
    std::string request_id;
    int max_attempts = 3;
    // Deadline of every worker call (the request's whole deadline).
    std::chrono::system_clock::time_point deadline;
    // RECEIVE: how long the decode worker waits for the KV (0: its default).
    uint32_t kv_receive_timeout_ms = 0;
    // Mid-stream failovers allowed (see the top of this file).
    int max_failovers = 0;
    // How long a placement that finds no healthy worker waits for one (0:
    // it fails at once).
    std::chrono::milliseconds wait_for_worker{0};
    // Where attempts record the time from their start to their first token,
    // and the gaps between token messages, for `auto` deadlines (may be null).
    LatencyWindow* first_token_latency = nullptr;
    LatencyWindow* token_gaps = nullptr;
  };

  // `request` holds the prompt ids and sampling (with a seed: a split
  // request must sample the same first token on both workers).
  // REQUIRES: planner and sink outlive the Generation's last callback.
  Generation(Options options, tandem::v1::GenerateRequest request, Planner* planner, GenerationSink* sink);
  ~Generation();

  // Places and starts the first attempt.
  void Start();
  // Ends the generation with `why` (if it has not ended): worker calls are
  // cancelled, OnDone reports `why`.
  void Cancel(const absl::Status& why);
  // Checks the current attempt against its deadlines, in seconds from its
  // start (first_token_s) or its last token (idle_s), 0 = off; moves it when
  // past one (see the top of this file).
  void CheckProgress(std::chrono::steady_clock::time_point now, double first_token_s, double idle_s);

 private:
  struct Call;
  enum class CallKind { kAggregated, kReceive, kSend };

  // Places and launches the next attempt. When no worker is healthy it
  // waits (returns, with waiting_since_ set) while `wait_for_worker` allows,
  // else finishes the generation.
  void AttemptLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places on a worker `tried` does not pass over: the prompt, plus the
  // tokens sent when resuming.
  absl::StatusOr<Placement> PlaceLocked(const TriedWorkers& tried) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Launches an attempt at `placement`: aggregated with the tokens sent as
  // resumed output when some were, else as placed.
  void LaunchAttemptLocked(Placement placement) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  enum class WaitEnd { kPlaced, kExpired, kCancelled };
  // Ends the wait for a worker, if one runs, counting how it ended.
  void EndWaitLocked(WaitEnd how) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The watchdog's look at a running attempt: one past its deadline is moved
  // to another worker when the planner finds one (see the top of this file).
  void MoveIfPastDeadlineLocked(std::chrono::steady_clock::time_point now, double first_token_s, double idle_s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Resumes on another worker after tokens were sent; false when no
  // failover is left. `worker` is tried from then on (TriedWorkers).
  bool FailoverLocked(const absl::Status& why, const std::shared_ptr<WorkerClient>& worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Set when the tokens already sent ended the generation (the stream broke
  // before its final message): what it finished with.
  std::optional<tandem::v1::FinishReason> EndedBySentLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes with `reason`: the tokens sent ended the generation.
  void FinishSentLocked(tandem::v1::FinishReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cancels the current attempt's calls (marked abandoned) and forgets what
  // they held back.
  void AbandonAttemptLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the calls launched under the lock (gRPC may run a reaction
  // inline, so calls start with mu_ released).
  void StartLaunched() ABSL_LOCKS_EXCLUDED(mu_);
  // `cached_tokens`: of the prompt, expected cached on `worker` (not counted
  // as its pending prefill).
  Call* LaunchLocked(CallKind kind, const std::shared_ptr<WorkerClient>& worker, tandem::v1::GenerateRequest request,
                     int64_t cached_tokens = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnMessage(Call* call, const tandem::v1::GenerateResponse& msg);
  void OnCallDone(Call* call, const grpc::Status& status);
  // Sends tokens to the sink (flushing the decode tokens that waited for the
  // first one). False if the sink stopped the generation.
  bool EmitLocked(std::span<const tandem::v1::TokenOutput> tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishDecodeLocked(const tandem::v1::GenerateResponse& msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the current attempt: retries when allowed, else finishes.
  void FailAttemptLocked(const absl::Status& status, const std::shared_ptr<WorkerClient>& worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLocked(GenerationResult result, bool cancel_prefill) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelCallsLocked(bool include_send) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const tandem::v1::GenerateRequest request_;
  Planner* const planner_;
  GenerationSink* const sink_;

  std::mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  int attempt_ ABSL_GUARDED_BY(mu_) = 0;
  TriedWorkers tried_ ABSL_GUARDED_BY(mu_);
  Placement placement_ ABSL_GUARDED_BY(mu_);
  std::vector<Call*> calls_ ABSL_GUARDED_BY(mu_);     // open calls (any attempt)
  std::vector<Call*> launched_ ABSL_GUARDED_BY(mu_);  // not yet started
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);      // of the last failed attempt
  bool placed_ ABSL_GUARDED_BY(mu_) = false;          // OnPlaced sent
  bool first_emitted_ ABSL_GUARDED_BY(mu_) = false;   // a token reached the sink
  bool first_from_prefill_ ABSL_GUARDED_BY(mu_) = false;
  // Decode tokens that arrived before the prefill worker's first token.
  std::vector<tandem::v1::TokenOutput> held_ ABSL_GUARDED_BY(mu_);
  bool decode_finished_ ABSL_GUARDED_BY(mu_) = false;  // its final message is held
  tandem::v1::GenerateResponse decode_final_ ABSL_GUARDED_BY(mu_);
  GenerationResult result_ ABSL_GUARDED_BY(mu_);
  int64_t emitted_ ABSL_GUARDED_BY(mu_) = 0;
  // Token ids the sink accepted, in order (a failover resumes after them).
  std::vector<int32_t> sent_ids_ ABSL_GUARDED_BY(mu_);
  int failovers_ ABSL_GUARDED_BY(mu_) = 0;
  // The current attempt's progress, for its deadlines.
  std::chrono::steady_clock::time_point attempt_started_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point last_token_at_ ABSL_GUARDED_BY(mu_);
  bool attempt_has_token_ ABSL_GUARDED_BY(mu_) = false;  // it sent a token to the sink
  bool decode_has_token_ ABSL_GUARDED_BY(mu_) = false;   // its decode stream delivered one
  bool attempt_expired_ ABSL_GUARDED_BY(mu_) = false;    // past a deadline, nowhere to go
  // Set while no healthy worker could be placed on: since when it waits.
  // No attempt is live then (the last one's calls are abandoned).
  std::optional<std::chrono::steady_clock::time_point> waiting_since_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_GENERATION_H_
