// Engine: one worker's inference engine. It owns the model, the paged KV
// cache (memory, block manager, prefix cache, event log) and the scheduler,
// and runs them on a single engine thread: each iteration drains submitted
// requests and cancellations, schedules one step (continuous batching with
// chunked prefill), runs the forward pass, samples, and delivers tokens to
// each request's OutputSink.
//
// Thread safety: Submit, Cancel, GetLoad, ClearPrefixCache and the accessors
// may be called from any thread. Sinks and ClearPrefixCache's callbacks are
// called on the engine thread.
#ifndef TANDEM_WORKER_ENGINE_ENGINE_H_
#define TANDEM_WORKER_ENGINE_ENGINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "kvtransfer/transport.h"
#include "worker/engine/output_sink.h"
#include "worker/engine/scheduler.h"
#include "worker/kv_cache/block_manager.h"
#include "worker/kv_cache/kv_event_log.h"
#include "worker/kv_cache/kv_storage.h"
#include "worker/model/model_loader.h"
#include "worker/runner/model_runner.h"

namespace tandem::worker {

struct EngineConfig {
  int block_size = 16;                   // tokens per KV block
  int64_t kv_cache_bytes = 256ll << 20;  // memory budget of the KV pool
  // A GPU runner: when > 0, the KV pool takes what is left of this worker's
  // fraction of the device's memory after its weights and the step's
  // activations at max_batched_tokens, within what the device has free
  // (vLLM's --gpu-memory-utilization: two workers on one GPU take 0.45
  // each), instead of kv_cache_bytes. In (0, 1].
  double gpu_memory_utilization = 0;
  int max_batched_tokens = 2048;  // tokens per step (prefill chunk budget)
  int max_running = 256;          // sequences decoding at once
  int max_waiting = 4096;         // queued requests before RESOURCE_EXHAUSTED
  double watermark = 0.01;        // fraction of blocks admission keeps free
  int max_model_len = 0;          // 0: the model's max_position_embeddings
  bool enable_prefix_caching = true;
  uint64_t block_hash_seed = 0;        // parent hash of a sequence's first block
  size_t kv_event_capacity = 1 << 16;  // events kept for resuming subscribers
  int threads = 0;                     // BLAS threads; 0 = all cores
  double log_stats_interval_s = 10.0;  // a stats line this often while busy; 0 = never
  // Decode side: when a reservation's KV does not arrive (deadline, or
  // Fallback() from the orchestration), prefill it here instead of failing.
  bool local_prefill_fallback = true;
  // Decode side: a reservation that ends without its KV (expired, failed,
  // cancelled) keeps the blocks a transfer was writing out of use this long,
  // because a network transport may still land bytes after reporting the
  // failure (UCX over tcp does); a fallback prefill uses fresh blocks.
  double transfer_quarantine_s = 2.0;
  // The model runner, by name (ModelRunnerRegistry::Builtin(): "cpu",
  // "sim"), and what it may need. With "sim" max_model_len may exceed the
  // model's position limit, since nothing is computed.
  std::string runner = "cpu";
  RunnerOptions runner_options;

  absl::Status Validate() const;
};

using Deadline = std::chrono::steady_clock::time_point;

// A prefill worker's hand-off: the first token it sampled and the blocks that
// hold the prompt's KV (still referenced until Engine::ReleasePrefilled).
struct Prefilled {
  uint64_t id = 0;
  SampledToken first;
  std::vector<int32_t> blocks;  // blocks of the whole prompt, in order
  int prompt_len = 0;
  // The completion of the prompt's KV writes: a transfer of `blocks` starts
  // after it (Transport::PushAfter, or a Wait before a pull is offered).
  // Never null.
  std::shared_ptr<const kvtransfer::WriteFence> written;
};

struct GenerateSpec {
  std::string request_id;
  std::vector<int32_t> prompt;
  SamplingParams params;
  // Prefill only (disaggregation): after the first token, instead of
  // decoding, call this on the engine thread and hold the blocks until
  // ReleasePrefilled or `hold_timeout` after the first token. The sink still
  // gets the first token and a finish (LENGTH, or STOP if it is a stop token).
  std::function<void(const Prefilled&)> on_prefilled;
  std::chrono::milliseconds hold_timeout{30000};
  // The last this many `prompt` tokens are output generated before (a
  // resumed generation): see GenerateRequest.resume_output_tokens.
  int resume_output_tokens = 0;
};

// A decode worker's reservation: the blocks it set aside for a prompt it will
// not compute. The prefill worker writes the prompt's KV into
// blocks[cached_tokens / block_size ...]; the first cached_tokens tokens are
// already here (prefix cache).
struct Reservation {
  uint64_t id = 0;
  int cached_tokens = 0;
  std::vector<int32_t> blocks;
};

struct LoadSnapshot {
  int running = 0;
  int waiting = 0;
  int64_t tokens_in_flight = 0;
  int64_t prefill_tokens_pending = 0;
  int64_t total_blocks = 0;
  int64_t free_blocks = 0;
  int64_t used_blocks = 0;
  int64_t cached_blocks = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t preemptions = 0;
  int64_t finished = 0;
  int reserved = 0;                     // decode side: parked until their KV arrives
  int prefilled = 0;                    // prefill side: holding blocks until sent
  int64_t quarantined_blocks = 0;       // decode side: failed transfers' blocks, briefly out of use
  int64_t expired_reservations = 0;     // reservations whose KV never came (degraded path)
  int64_t local_prefill_fallbacks = 0;  // reservations prefilled here instead (degraded path)
  int64_t reservations_refused = 0;     // decode side: no batch place (max_running) or KV room
  int64_t expired_handoffs = 0;         // prefilled blocks never released (degraded path)
  uint64_t kv_event_seq = 0;
  double hit_rate() const {
    return prefix_query_tokens > 0 ? double(prefix_hit_tokens) / double(prefix_query_tokens) : 0.0;
  }
};

class Engine {
 public:
  // Builds the KV pool from config.kv_cache_bytes, in memory from
  // `pool_allocator` when given (a KV transport's; it must outlive the
  // engine). The effective context is capped by the model,
  // config.max_model_len and the pool's capacity.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config, LoadedModel model,
                                                        const KvStorage::Allocator& pool_allocator = nullptr);
  ~Engine();  // stops the engine thread; pending requests finish with kAbort
              // and FinishInfo::worker_stopping

  void Start();
  void Stop();

  // Validates and queues a request; returns its engine id. InvalidArgument
  // for a bad request (empty prompt, ids outside the vocabulary, bad sampling
  // values, a prompt or max_tokens past the context or the whole cache),
  // ResourceExhausted when the queue is full, Unavailable when stopped.
  absl::StatusOr<uint64_t> Submit(GenerateSpec spec, std::shared_ptr<OutputSink> sink);
  // Aborts a request: its blocks are freed at the start of the next step and
  // its sink gets OnFinish(kAbort). Unknown or finished ids are ignored.
  void Cancel(uint64_t id);
  // Disaggregation, decode side. Validates `spec` as Submit does, sets aside
  // blocks for its whole prompt (sharing cached ones) without computing it,
  // and parks the request until Commit, Cancel or `deadline` (then its
  // blocks are freed and its sink finishes with an error). `done` runs on the
  // engine thread: ResourceExhausted if the cache cannot spare the blocks.
  void Reserve(GenerateSpec spec, std::shared_ptr<OutputSink> sink, Deadline deadline,
               std::function<void(absl::StatusOr<Reservation>)> done);
  // The prompt's KV is in the reserved blocks and `first` is the token the
  // prefill worker sampled: the request decodes from here (its sink gets the
  // tokens after `first`). NotFound for an unknown or expired reservation.
  void Commit(uint64_t id, SampledToken first, std::function<void(absl::Status)> done);
  // Decode side: the KV for reservation `id` will not come (`why`); prefill
  // it locally (local_prefill_fallback) or end it with an error. `first`,
  // when the prefill worker's first token is known, is kept instead of
  // sampling another. Unknown ids are ignored.
  void Fallback(uint64_t id, std::optional<SampledToken> first, std::string why);
  // Decode side, before a sender writes into reservation `id`'s blocks
  // (issue 21's push delivery): whatever ends the reservation before `until`
  // (cancel, expiry, fallback), its blocks stay out of use until then, not
  // just for the quarantine, so a late write never lands in a block given to
  // another request. `done` runs on the engine thread: NotFound if `id` is
  // not a waiting reservation (unknown, committed or ended). Pins taken in a
  // step apply before that step's cancels.
  void PinReservation(uint64_t id, Deadline until, std::function<void(absl::Status)> done);
  // Prefill side: the blocks handed over by on_prefilled were sent; free them.
  void ReleasePrefilled(uint64_t id);

  // Drops every block from the prefix cache (blocks in use stay in use,
  // uncached) at the start of the next step, then calls `done` with the
  // number of unreferenced cached blocks freed; Unavailable if the engine
  // stops first. Requests are served in order, each by its own clear.
  void ClearPrefixCache(std::function<void(absl::StatusOr<int64_t>)> done);

  LoadSnapshot GetLoad() const;
  KvEventLog& events() { return events_; }
  const ModelConfig& model_config() const { return runner_->config(); }
  const std::string& model_name() const { return model_name_; }
  const std::string& tokenizer_sha256() const { return tokenizer_sha256_; }  // LoadedModel's
  const EngineConfig& config() const { return config_; }
  int max_model_len() const { return max_model_len_; }
  // True for the simulated runner ("sim").
  bool simulated() const { return runner_->simulated(); }
  const ModelRunner& runner() const { return *runner_; }
  int64_t total_blocks() const { return total_blocks_; }
  // The KV pool's memory and geometry, for registering it with a KV
  // transport. Transports write only into blocks this engine reserved.
  void* kv_data() { return storage_->data(); }
  // KvStorage::BlockChecksums of the pool. Any thread: the bytes of blocks
  // the caller holds (a hand-off's) do not change under it.
  absl::StatusOr<std::vector<uint64_t>> KvBlockChecksums(std::span<const int32_t> blocks) const {
    return storage_->BlockChecksums(blocks);
  }
  const kernels::KvLayout& kv_layout() const { return storage_->layout(); }
  // The pool as a KV transport registers it (its dtype is the layout's, part
  // of the check between workers).
  kvtransfer::PoolLayout pool_layout() const;
  bool running() const { return running_.load(); }

 private:
  Engine(const EngineConfig& config, const LoadedModel& model, std::unique_ptr<ModelRunner> runner,
         std::unique_ptr<KvStorage> storage, int max_model_len);
  void Loop();
  bool HasWorkLocked() const;  // REQUIRES: mu_ held
  bool EnqueueIfRunning(const std::function<void()>& enqueue);
  void DrainCommands();
  void Step();
  void Finish(std::unique_ptr<Sequence> seq, FinishInfo info);
  void PublishLoad();
  void MaybeLogStats();
  absl::StatusOr<std::unique_ptr<Sequence>> MakeSequence(GenerateSpec spec, std::shared_ptr<OutputSink> sink);
  void ExpireParked();
  Deadline NextDeadline() const;
  void HandOff(uint64_t id);
  // Whether the token just appended ends `seq`: a stop token, max_tokens or
  // the context. nullopt while it continues.
  std::optional<FinishInfo> FinishAfterLastToken(const Sequence& seq) const;
  void FallBackLocally(std::unique_ptr<Sequence> seq, std::optional<SampledToken> first, const std::string& why);
  // Releases a reservation's shared prefix blocks and quarantines the blocks
  // a transfer was writing; the sequence keeps no block.
  void DropReservationBlocks(Sequence& seq);

  const EngineConfig config_;
  const std::string model_name_;
  const std::string tokenizer_sha256_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<KvStorage> storage_;
  const int max_model_len_;
  const int64_t total_blocks_;
  KvEventLog events_;
  BlockManager blocks_;                // engine thread only
  Scheduler scheduler_;                // engine thread only
  BatchInput batch_;                   // engine thread only
  std::vector<RowSampling> rows_;      // engine thread only: batch_'s logits rows
  std::vector<SampledToken> sampled_;  // engine thread only: their tokens

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> submitted_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(absl::StatusOr<int64_t>)>> clears_ ABSL_GUARDED_BY(mu_);
  struct ReserveCommand {
    std::unique_ptr<Sequence> seq;
    Deadline deadline;
    std::function<void(absl::StatusOr<Reservation>)> done;
  };
  struct CommitCommand {
    uint64_t id;
    SampledToken first;
    std::function<void(absl::Status)> done;
  };
  std::vector<ReserveCommand> reserves_ ABSL_GUARDED_BY(mu_);
  std::vector<CommitCommand> commits_ ABSL_GUARDED_BY(mu_);
  struct PinCommand {
    uint64_t id;
    Deadline until;
    std::function<void(absl::Status)> done;
  };
  std::vector<PinCommand> pins_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> releases_ ABSL_GUARDED_BY(mu_);
  struct FallbackCommand {
    uint64_t id;
    std::optional<SampledToken> first;
    std::string why;
  };
  std::vector<FallbackCommand> fallbacks_ ABSL_GUARDED_BY(mu_);
  // Engine thread only: sequences parked with their blocks until a deadline:
  // reserved on a decode worker, or prefilled and awaiting transfer.
  struct Parked {
    std::unique_ptr<Sequence> seq;
    Deadline deadline;
  };
  std::map<uint64_t, Parked> reserved_;
  std::map<uint64_t, Parked> prefilled_;
  struct Quarantined {
    std::vector<int32_t> blocks;
    Deadline until;
  };
  std::vector<Quarantined> quarantine_;
  int64_t expired_reservations_ = 0;
  int64_t local_prefill_fallbacks_ = 0;
  int64_t reservations_refused_ = 0;
  int64_t expired_handoffs_ = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> running_{false};
  std::atomic<uint64_t> next_id_{1};
  std::atomic<int> waiting_{0};  // the scheduler's queue length, for the overload check
  bool cache_limited_ = false;   // the context was capped by the KV cache's size
  std::thread thread_;

  mutable std::mutex load_mu_;  // taken after mu_ where both are held
  LoadSnapshot load_ ABSL_GUARDED_BY(load_mu_);
  int64_t finished_ = 0;
  // Engine thread only: throughput since the last stats line.
  int64_t prompt_tokens_computed_ = 0;
  int64_t tokens_generated_ = 0;
  std::chrono::steady_clock::time_point last_stats_ = std::chrono::steady_clock::now();
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_ENGINE_H_
