// Scheduler: continuous batching for one worker. Each step it picks the work
// of the next forward pass under a token budget:
//   1. running sequences in arrival order: one token each while decoding, the
//      next chunk of the prompt while prefilling (chunked prefill);
//   2. then waiting sequences, first come first served, while the budget, the
//      running-sequence limit and the KV cache allow.
// Admission reserves blocks for the whole prompt at once (prefix-cache hits
// are shared, not allocated) and keeps a watermark of free blocks for the
// running sequences to grow into; decode steps allocate one block at a time.
// When a running sequence cannot get a block, the most recently arrived
// running sequence is preempted: its blocks are released (its full blocks
// stay in the prefix cache) and it goes back to the head of the queue to be
// recomputed, which gives identical results since sampling depends only on
// (seed, position).
//
// Not thread-safe: the engine thread owns it.
#ifndef TANDEM_WORKER_ENGINE_SCHEDULER_H_
#define TANDEM_WORKER_ENGINE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "worker/engine/sequence.h"
#include "worker/kv_cache/block_manager.h"

namespace tandem::worker {

struct SchedulerConfig {
  int max_batched_tokens = 2048;  // tokens per forward pass (the prefill chunk budget)
  int max_running = 256;          // sequences in the running batch
  double watermark = 0.01;        // fraction of blocks admission leaves free
  uint64_t block_hash_seed = 0;   // parent hash of every sequence's first block
};

struct ScheduledWork {
  Sequence* seq;
  int num_tokens;  // tokens [seq->num_computed, + num_tokens) run this step
};

struct SchedulerStats {
  int64_t prefix_query_tokens = 0;  // prompt tokens looked up at first admission
  int64_t prefix_hit_tokens = 0;    // of which found in the prefix cache
  int64_t preemptions = 0;
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockManager* blocks);

  void Add(std::unique_ptr<Sequence> seq);
  // Picks the work of the next step. Preempted sequences move to waiting.
  // `reserved_slots`: batch places held for reservations (hand-offs that
  // will join the running batch on commit), which admission leaves free so
  // running + reserved never exceeds max_running.
  std::vector<ScheduledWork> Schedule(int reserved_slots = 0);
  // Records that `work` ran: advances num_computed and registers the blocks
  // that became full in the prefix cache.
  void Advance(const ScheduledWork& work);
  // Removes a running or waiting sequence, releasing its blocks; returns it
  // (null if unknown).
  std::unique_ptr<Sequence> Remove(uint64_t id);

  // Disaggregation. Reserve gives `seq` (not queued) blocks for its whole
  // prompt now, reusing the cached full blocks of all but its last token (a
  // decode worker computes nothing of the prompt: the prefill worker sends
  // the rest).
  // Returns false, holding nothing, if the cache cannot spare the blocks
  // (the watermark applies). Keeps the prefix-cache statistics.
  bool Reserve(Sequence& seq);
  // Puts a sequence whose KV is complete up to num_computed into the running
  // batch (after Commit on a decode worker).
  void AddRunning(std::unique_ptr<Sequence> seq);
  // Removes a running sequence keeping its blocks (a prefill worker holds
  // them until they are sent); null if unknown.
  std::unique_ptr<Sequence> Take(uint64_t id);
  // Registers the sequence's full computed blocks in the prefix cache.
  void CommitFullBlocks(Sequence& seq);
  // Releases a sequence's blocks (last to first) and resets its progress.
  void ReleaseBlocks(Sequence& seq);

  bool empty() const { return running_.empty() && waiting_.empty(); }
  const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }
  const std::deque<std::unique_ptr<Sequence>>& waiting() const { return waiting_; }
  const SchedulerStats& stats() const { return stats_; }

 private:
  bool AdmitHead(int* budget, std::vector<ScheduledWork>* out);
  // Takes the cached prefix of `hashable` and allocates blocks up to `len`
  // tokens; false (holding nothing) below the watermark.
  bool AllocateFor(Sequence& seq, std::span<const int32_t> hashable, int len);
  void Preempt(size_t running_index);
  void InsertRunning(std::unique_ptr<Sequence> seq);

  const SchedulerConfig config_;
  BlockManager* const blocks_;
  std::vector<std::unique_ptr<Sequence>> running_;  // arrival order
  std::deque<std::unique_ptr<Sequence>> waiting_;
  SchedulerStats stats_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_SCHEDULER_H_
