// KvEventLog: the prefix-cache event stream of one worker. Every block stored
// into or removed from the prefix cache, and every clear, gets the next
// sequence number (1, 2, 3, ... without gaps) so that a router can keep an
// exact index of this worker's cache and notice a lost event.
//
// The log keeps the most recent `capacity` events for subscribers that resume
// after a sequence number, and a live copy of the cached set so a subscriber
// that fell too far behind (or starts fresh) gets a consistent snapshot.
//
// Thread-safe. The engine thread appends and then calls Publish() once per
// step; listeners (gRPC streams) are called from Publish() (and from
// WakeListeners(), on the caller's thread), one at a time under the
// listeners' lock, and must not block.
#ifndef TANDEM_WORKER_KV_CACHE_KV_EVENT_LOG_H_
#define TANDEM_WORKER_KV_CACHE_KV_EVENT_LOG_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace tandem::worker {

struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  uint64_t seq = 0;
  Kind kind = Kind::kStored;
  uint64_t block_hash = 0;         // kStored, kRemoved
  uint64_t parent_hash = 0;        // kStored
  std::vector<int32_t> token_ids;  // kStored
};

struct CachedBlock {
  uint64_t hash = 0;
  uint64_t parent = 0;
};

struct KvSnapshot {
  uint64_t seq = 0;                 // reflects every event up to and including seq
  std::vector<CachedBlock> blocks;  // every cached block
};

class KvEventLog {
 public:
  explicit KvEventLog(size_t capacity = 1 << 16);

  void Stored(uint64_t hash, uint64_t parent, std::span<const int32_t> tokens);
  void Removed(uint64_t hash);
  void Cleared();
  // Wakes the listeners if events were appended since the last Publish().
  void Publish();
  // Wakes the listeners whether or not there are new events: for a change of
  // state that their streams carry beside the events (the worker's drain).
  void WakeListeners();

  uint64_t last_seq() const;

  // Appends to `out` the events with seq > after, at most `max_events`.
  // Returns false (appending nothing) if some of them are no longer held:
  // the caller must resync from TakeSnapshot().
  bool ReadSince(uint64_t after, size_t max_events, std::vector<KvEvent>* out) const;
  KvSnapshot TakeSnapshot() const;

  // Listeners are called with no lock held. RemoveListener waits for a call in
  // progress to finish, so after it returns the listener is never called again.
  int AddListener(std::function<void()> fn);
  void RemoveListener(int id);

 private:
  void Append(KvEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<KvEvent> recent_ ABSL_GUARDED_BY(mu_);
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t published_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, uint64_t> live_ ABSL_GUARDED_BY(mu_);  // hash -> parent

  absl::Mutex listeners_mu_;  // held while listeners run; never with mu_
  std::map<int, std::function<void()>> listeners_ ABSL_GUARDED_BY(listeners_mu_);
  int next_listener_ ABSL_GUARDED_BY(listeners_mu_) = 0;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_KV_CACHE_KV_EVENT_LOG_H_
