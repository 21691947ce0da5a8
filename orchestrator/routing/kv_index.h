// KvIndex: the router's global index of which worker holds which KV blocks,
// keyed by the chained block hash of common/block_hash.h. Because a block's
// hash covers every token before it, "worker w holds the first k blocks of a
// request" is k consecutive hash-map hits; no radix tree is needed.
//
// A worker is in one of three modes (WorkerMode):
//   kApproximate  no event stream has synced it yet (unknown workers too).
//                 Its entries come from RecordRouted, the router's own
//                 decisions, and expire `ttl` after they were recorded
//                 (Dynamo's approximate mode; 120 s is Dynamo's default).
//                 Expired entries are dropped lazily, when Match meets them
//                 or when the LRU reaches them.
//   kExact        fed by the worker's StreamKvEvents: a complete snapshot (or
//                 events from seq 1) then every event in seq order. Entries
//                 never expire; RecordRouted is a no-op for the worker.
//   kStale        events were lost (a seq gap, a malformed batch) or the
//                 worker restarted (new instance_id). Match keeps answering
//                 from what the index holds -- after a gap that is the old
//                 state, mostly right; after a restart the old blocks were
//                 dropped, since a new process holds none of them --
//                 and RecordRouted adds TTL entries as in kApproximate, until
//                 a complete snapshot makes the worker exact again.
//
// Apply contract, per worker and per KvEventBatch:
//   - A batch's instance_id differing from the last one seen means the
//     worker restarted: its blocks are dropped and it is kStale until synced.
//     (The first instance_id seen for a worker is not a restart: entries
//     recorded in approximate mode stay until the worker syncs.)
//   - Snapshot chunks with the same seq accumulate off to the side; while a
//     snapshot is incomplete Match answers from the worker's previous state.
//     The chunk with complete = true replaces the worker's entries with the
//     snapshot's blocks, sets its seq and makes it kExact. A chunk with
//     another seq restarts the accumulation (a newer snapshot superseded it).
//   - Events apply in seq order, each exactly last_seq + 1; already-seen seqs
//     (replays) are skipped. A worker never synced accepts events only from
//     seq 1 (a fresh worker's whole log).
//   - Any error means: resubscribe with snapshot = true. The worker is kStale
//     and further events are refused until a snapshot completes.
//       DataLoss         a seq gap, or events with no sync point
//       InvalidArgument  empty instance_id, or events inside an incomplete snapshot
//
// Memory: at most `max_blocks` (hash, worker) entries (Dynamo's default
// 2^20). Beyond it the least recently used entry is evicted; "used" means
// stored, recorded or matched. A use moves an entry to the front only if it
// is not among the most recent quarter of entries already (a 16-bit stamp of
// the LRU clock, kept next to the block's holders, tells: the list is in
// stamp order; an entry untouched for 2^28 relinks may look recent once,
// which only delays its next move), so a hot prefix matched again and again
// costs a read of the block's holders, not a relink of three random nodes.
// An evicted exact entry only makes the index under-report that worker (a
// later BlockRemoved for it is a no-op). An incomplete snapshot is staged
// outside the cap, truncated at max_blocks. One entry costs about 40 bytes
// of node plus 8 of holder plus its share of the hash map. At most 65,535
// workers are known at once (Apply refuses more with ResourceExhausted).
//
// Match reads, per request block, one hash-map entry and its inline holders
// (worker slot, node, stamp); it reads a node only to relink it or to check
// the expiry of an entry that can expire (a worker not in kExact mode holds
// TTL entries; an exact worker's entries never expire).
//
// Thread safety: every method is thread-safe; one std::mutex guards the
// index (Match updates the LRU, so it cannot share a reader lock). Apply
// releases it between chunks of 64 events, so a prefill's long BlockStored
// batch does not hold routing decisions up (a Match may see part of a
// batch; the events of one worker still apply in order). Match is
// a hash lookup per request block plus a scan of that block's few holders.
#ifndef TANDEM_ORCHESTRATOR_ROUTING_KV_INDEX_H_
#define TANDEM_ORCHESTRATOR_ROUTING_KV_INDEX_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {

enum class WorkerMode { kApproximate, kExact, kStale };

// "approximate", "exact" or "stale".
const char* WorkerModeName(WorkerMode mode);

class KvIndex {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  struct Options {
    int64_t max_blocks = int64_t{1} << 20;                                // (hash, worker) entries kept; LRU beyond
    std::chrono::steady_clock::duration ttl = std::chrono::seconds(120);  // approximate entries
  };

  // A worker holding the first `matched_blocks` blocks of a request.
  struct Overlap {
    std::string worker_id;
    int64_t matched_blocks = 0;
    WorkerMode mode = WorkerMode::kApproximate;
  };

  struct WorkerInfo {
    std::string id;
    WorkerMode mode = WorkerMode::kApproximate;
    int64_t blocks = 0;       // entries held now (expired ones until dropped)
    std::string instance_id;  // last seen on its event stream; empty if none
    uint64_t last_seq = 0;    // last event applied (kExact)
    // When its last event batch was applied (steady clock); nullopt if none was.
    std::optional<std::chrono::steady_clock::time_point> last_batch;
  };

  // Counters since construction.
  struct Stats {
    uint64_t evictions = 0;    // entries dropped by the memory cap
    uint64_t expirations = 0;  // approximate entries dropped after their TTL
    uint64_t seq_gaps = 0;     // batches refused with DataLoss
    uint64_t bad_batches = 0;  // batches refused with InvalidArgument
    uint64_t restarts = 0;     // instance_id changes
    uint64_t snapshots_completed = 0;
    uint64_t snapshot_blocks_truncated = 0;  // staged blocks beyond max_blocks
    uint64_t events_applied = 0;
    uint64_t events_replayed = 0;  // seq already applied: skipped
  };

  // REQUIRES: 1 <= options.max_blocks < 2^32 - 1.
  static constexpr size_t kMaxWorkers = 65535;
  explicit KvIndex(Options options);
  KvIndex(const KvIndex&) = delete;
  KvIndex& operator=(const KvIndex&) = delete;

  // Applies one batch of `worker_id`'s event stream (see the contract above).
  // Any error: resubscribe with snapshot = true.
  absl::Status Apply(const std::string& worker_id, const tandem::v1::KvEventBatch& batch);

  // Forgets the worker and every entry it holds.
  void RemoveWorker(const std::string& worker_id);

  // Records that the request with these block hashes was routed to
  // `worker_id`: entries that expire at now + ttl. No-op for a kExact worker.
  void RecordRouted(const std::string& worker_id, std::span<const uint64_t> block_hashes, TimePoint now);

  // Every worker holding at least the first block, with how many leading
  // blocks it holds (the match stops at its first missing block). Workers
  // with no match are absent. Order unspecified.
  std::vector<Overlap> Match(std::span<const uint64_t> block_hashes, TimePoint now);

  // Entries held, all workers together; at most max_blocks.
  size_t size() const;
  // kApproximate for a worker the index does not know.
  WorkerMode mode(const std::string& worker_id) const;
  // Every known worker, sorted by id.
  std::vector<WorkerInfo> workers() const;
  Stats stats() const;

 private:
  static constexpr uint32_t kNil = UINT32_MAX;
  static constexpr uint16_t kNoSlot = UINT16_MAX;
  static constexpr int kEventsPerLock = 64;
  // A stamp counts LRU relinks in units of 2^kStampShift (wraps at 2^28).
  static constexpr int kStampShift = 12;

  // One (hash, worker) entry, in two intrusive lists: the global LRU (most
  // recent at lru_head_) and its worker's list (no order).
  struct Node {
    uint64_t hash = 0;
    TimePoint expires;  // TimePoint::max() for exact entries
    uint32_t worker = kNil;
    uint32_t prev = kNil, next = kNil;    // global LRU; `next` links the free list
    uint32_t wprev = kNil, wnext = kNil;  // the worker's list
  };

  // A block's holder, inline in the hash map: what Match needs without
  // reading the node.
  struct Holder {
    uint32_t node;
    uint16_t worker;  // slot
    uint16_t stamp;   // clock_ >> kStampShift when last linked at the LRU front
  };

  struct Worker {
    std::string id;
    WorkerMode mode = WorkerMode::kApproximate;
    std::string instance_id;
    bool synced = false;  // events apply (kExact)
    uint64_t last_seq = 0;
    bool snapshot_open = false;  // chunks of snapshot_seq are being staged
    uint64_t snapshot_seq = 0;
    std::vector<uint64_t> staged;
    uint32_t head = kNil;  // first node of its list
    int64_t blocks = 0;
    std::optional<std::chrono::steady_clock::time_point> last_batch;  // last applied
  };

  // kNoSlot when kMaxWorkers are known already.
  uint16_t WorkerSlot(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unlocks and relocks every kEventsPerLock events (see Apply).
  absl::Status ApplyLocked(std::unique_lock<std::mutex>& lock, const std::string& worker_id, uint16_t slot,
                           const tandem::v1::KvEventBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place a worker's mode changes (match_slots_ mirrors it).
  void SetMode(uint16_t slot, WorkerMode mode) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkStale(uint16_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Insert(uint64_t hash, uint16_t slot, TimePoint expires) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseBlock(uint64_t hash, uint16_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseNode(uint32_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropWorkerEntries(uint16_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the entry to the LRU front unless it is among the most recent quarter.
  void Touch(Holder& holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ABSL_ATTRIBUTE_NOINLINE void Relink(Holder& holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Links node n at the LRU front; returns its stamp.
  uint16_t LinkFront(uint32_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unlink(uint32_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable std::mutex mu_;
  // Block hash -> nodes of the workers holding it (rarely more than a few).
  absl::flat_hash_map<uint64_t, absl::InlinedVector<Holder, 2>> holders_ ABSL_GUARDED_BY(mu_);
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint32_t free_nodes_ ABSL_GUARDED_BY(mu_) = kNil;
  uint32_t lru_head_ ABSL_GUARDED_BY(mu_) = kNil;
  uint32_t lru_tail_ ABSL_GUARDED_BY(mu_) = kNil;
  size_t size_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t clock_ ABSL_GUARDED_BY(mu_) = 0;  // LinkFronts so far (the LRU is in stamp order)
  // What Match reads per holder, by worker slot, in one small array (the
  // holder scan touches nothing else unless an entry can expire or must move).
  struct MatchSlot {
    uint32_t matched = 0;  // leading blocks; zero between calls
    bool exact = false;    // workers_[slot].mode == kExact (SetMode): no entry can expire
  };
  std::vector<MatchSlot> match_slots_ ABSL_GUARDED_BY(mu_);
  // Slots are reused after RemoveWorker; a free slot has an empty id.
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<uint16_t> free_slots_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint16_t> slot_by_id_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ROUTING_KV_INDEX_H_
