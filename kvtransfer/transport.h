// kvtransfer: moving KV-cache blocks from one worker's pool to another's,
// worker to worker, never through the router.
//
// A Transport registers the local KV pool once, publishes what a peer needs
// to reach it (PeerInfo, carried over gRPC by the workers), connects to peers
// after checking that both pools have the same layout, and moves lists of
// blocks: Push writes local blocks into a peer's blocks (the default:
// the decode worker has reserved the destination), Pull reads a peer's blocks
// into local ones. Block ids are expanded to byte runs and runs contiguous on
// both sides are merged (PlanRuns), so many small blocks do not become many
// operations.
//
// Completion: `done` is called exactly once per transfer, from the
// transport's own thread, with OK only when every byte is visible at the
// destination; otherwise with the reason (DeadlineExceeded past the
// transfer's deadline, Unavailable for a lost peer, Cancelled, ...). A
// transport never waits on a peer without a deadline. After a Push ends
// with an error, bytes may still arrive in its destination blocks for a
// short while (a network backend cannot recall data in flight): the
// receiver must not reuse those blocks at once.
//
// Thread safety: every method may be called from any thread.
#ifndef TANDEM_KVTRANSFER_TRANSPORT_H_
#define TANDEM_KVTRANSFER_TRANSPORT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::kvtransfer {

enum class MemoryType { kHost, kCuda };

// The geometry both sides must agree on before the first byte moves. One
// block is one contiguous run of block_bytes at base + id * block_bytes
// (kernels::KvLayout's block-major layout).
struct PoolLayout {
  std::string model;  // served model name
  std::string dtype;  // KV element type, e.g. "float32"
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;      // tokens per block
  int64_t num_blocks = 0;  // may differ between peers
  int64_t block_bytes = 0;
  MemoryType memory_type = MemoryType::kHost;
  int device_id = -1;  // kCuda: the GPU; -1 on the host
};

// OK if blocks of `remote` can be copied into blocks of `local` and back:
// model, dtype, layers, KV heads, head dim, block size and bytes per block
// must be equal. The error names the first field that differs, with both
// values.
absl::Status CheckCompatible(const PoolLayout& local, const PoolLayout& remote);

// What a peer needs to reach a pool: exchanged over gRPC, opaque to the
// workers except for the layout.
struct PeerInfo {
  std::string agent_id;  // unique per transport instance (changes on restart)
  std::string backend;   // "ucx", "loopback", ...
  PoolLayout layout;
  std::string address;  // backend-specific: worker address, rkeys, base address
};

struct BlockPair {
  int32_t src;  // block id in the pool the bytes are read from
  int32_t dst;  // block id in the pool they are written to
};

// One contiguous copy.
struct CopyRun {
  int64_t src_offset;
  int64_t dst_offset;
  int64_t bytes;
};

// Appends a run to `runs`, merged into the last one where the two are
// contiguous on both sides.
void AppendRun(std::vector<CopyRun>& runs, const CopyRun& run);

// Expands `blocks` (in order) to byte runs of block_bytes each and merges
// neighbours that are contiguous on both sides. InvalidArgument for a block id
// outside [0, src_blocks) or [0, dst_blocks), or a destination used twice.
absl::StatusOr<std::vector<CopyRun>> PlanRuns(std::span<const BlockPair> blocks, int64_t block_bytes,
                                              int64_t src_blocks, int64_t dst_blocks);

// What a backend can do, so that callers choose by capability rather than by
// name.
struct TransportCapabilities {
  bool push = false;               // writes local blocks into a peer's
  bool pull = false;               // reads a peer's blocks into local ones
  bool needs_pairing = false;      // both sides take part in every transfer (send/receive backends)
  bool own_pool_memory = false;    // AllocatePool gives memory peers reach faster
  std::vector<MemoryType> memory;  // the pool memory it moves
  bool Moves(MemoryType m) const;
};

using TransferDone = std::function<void(absl::Status)>;
using Deadline = std::chrono::steady_clock::time_point;

// The completion of the writes a transfer reads (the prefill step that wrote
// the blocks): PushAfter starts nothing before it completed, so a transfer
// never rests on a host-side guess about when the engine's writes landed.
class WriteFence {
 public:
  virtual ~WriteFence() = default;
  // Where the writes happen (a kCuda fence is an event on the GPU's stream).
  virtual MemoryType memory() const = 0;
  // Blocks this thread until the writes completed: OK, or DeadlineExceeded
  // once `deadline` passed first (or the writes' own error).
  virtual absl::Status Wait(Deadline deadline) const = 0;
  // kCuda: the cudaEvent_t recorded after the writes, for a GPU transport to
  // order its copies after on a stream of its own (no host wait); else null.
  virtual void* cuda_event() const { return nullptr; }
  // True where the writes are known to have completed; never blocks (false:
  // not known, Wait decides).
  virtual bool Completed() const { return false; }
};

// A fence whose writes have completed (host memory; or a step that ended in
// a synchronize, as the CPU and CUDA runners' steps do today).
std::shared_ptr<const WriteFence> CompletedFence();

enum class PairRole { kInitiator, kResponder };

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string backend() const = 0;
  virtual TransportCapabilities capabilities() const = 0;
  // Where it reaches: peers whose transports report the same non-empty
  // domain, and only those ("host:<boot id>" for transports of one host);
  // empty: any peer it can dial.
  virtual std::string Domain() const { return ""; }

  // Memory of the transport's own for the pool, `bytes` zero-filled, owned
  // by the transport and valid for its lifetime (pass it to RegisterPool), or
  // null where it has none (the caller maps its own). At most one per
  // transport.
  virtual absl::StatusOr<void*> AllocatePool(int64_t bytes) { return nullptr; }

  // Registers the local pool: `base` holds layout.num_blocks blocks of
  // layout.block_bytes and stays valid for the transport's lifetime.
  // FailedPrecondition if a pool is already registered.
  virtual absl::Status RegisterPool(const PoolLayout& layout, void* base) = 0;

  // This transport's PeerInfo. FailedPrecondition before RegisterPool.
  virtual absl::StatusOr<PeerInfo> LocalInfo() const = 0;

  // Connects to a peer, after CheckCompatible. Re-adding an agent replaces it.
  virtual absl::Status AddPeer(const PeerInfo& peer) = 0;
  // Disconnects; its transfers in flight finish with Unavailable.
  virtual void RemovePeer(const std::string& agent_id) = 0;

  // Copies local block pair.src into the peer's block pair.dst for every
  // pair (Push), or the peer's pair.src into local pair.dst (Pull). Returns
  // the transfer's id; `done` follows, exactly once. Errors found before
  // anything starts (unknown peer, bad block ids) are returned and `done` is
  // not called.
  virtual absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                        TransferDone done) = 0;
  virtual absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                        TransferDone done) = 0;

  // Cancels a transfer in flight: `done` gets Cancelled unless it already
  // completed. Unknown ids are ignored.
  virtual void Cancel(uint64_t transfer_id) = 0;

  // The two-sided contract (send/receive backends; docs/architecture.md, "Push delivery").
  //
  // Pair: joins a peer for transfers in which both sides take part. The
  // initiator passes an empty `offer` and hands the string it gets back to
  // the peer (over gRPC), whose Pair(kResponder) takes it; `done` follows
  // once on each side, OK when both joined. Errors before anything starts
  // are returned and `done` is not called. Default, for one-sided backends
  // (they need no pairing): AddPeer(peer), then done(OK) on this thread;
  // the offer is "".
  virtual absl::StatusOr<std::string> Pair(const PeerInfo& peer, PairRole role, std::string_view offer,
                                           Deadline deadline, TransferDone done);
  // Push that starts only once `after` completed; `tag` names the transfer
  // to the peer's Receive (the reservation id). Default: a kCuda fence on a
  // transport that does not move GPU memory is FailedPrecondition; otherwise
  // waits for the fence on this thread (bounded by `deadline`; its error is
  // returned and `done` not called), then Push.
  virtual absl::StatusOr<uint64_t> PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                             std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                             TransferDone done);
  // Send/receive backends: the receiving half of the peer's PushAfter(tag)
  // into local blocks pair.dst. Default: Unimplemented (one-sided backends
  // write or read the peer's memory without its taking part).
  virtual absl::StatusOr<uint64_t> Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                           Deadline deadline, TransferDone done);
  // Send/receive backends: the sender will not push `tag` after all, though
  // the peer's Receive for it is open (its JOIN was answered with a pool).
  // Tells the peer in band, so that nothing stays posted there for it; that
  // Receive ends Aborted. Best effort and unanswered (the sender also says
  // so over gRPC). Default: nothing (a backend whose open receives hold
  // nothing).
  virtual void Decline(const std::string& agent_id, uint64_t tag) {}
};

// A fresh agent id for a transport instance of `backend`: unique across
// processes and restarts ("<backend>-<pid>-<random>-<counter>").
std::string NewAgentId(std::string_view backend);

// The transports by name: `tandem worker --kv-transport NAME` and the
// benchmarks create them here, with what each can do.
struct TransportOptions {
  // ucx: which UCX transports carry the data ("shm", "tcp" or "auto") and
  // the network devices for tcp (UcxOptions).
  std::string transports = "auto";
  std::string net_devices;
  // cuda_ipc: the GPU whose pool it moves (the worker's --device cuda:N).
  int device = 0;
  // ucx_staged: the staging ring on each side (UcxOptions).
  int staging_slots = 8;
  int64_t staging_slot_bytes = int64_t{4} << 20;
};

class TransportRegistry {
 public:
  using Factory = std::function<absl::StatusOr<std::unique_ptr<Transport>>(const TransportOptions&)>;

  // REQUIRES: `name` not registered yet.
  void Register(std::string name, TransportCapabilities capabilities, Factory factory);
  // InvalidArgument naming the known transports for an unknown name; the
  // factory's error otherwise (a backend this binary was built without says
  // so).
  absl::StatusOr<std::unique_ptr<Transport>> Create(std::string_view name, const TransportOptions& options) const;
  // Null for an unknown name.
  const TransportCapabilities* Capabilities(std::string_view name) const;
  std::vector<std::string> names() const;

  // The backends a worker can use across processes: "ucx" (host pools; an
  // error naming the build option where this binary has no UCX) and
  // "cuda_ipc" (GPU pools of one host; an error where this binary was built
  // without CUDA). The in-process loopback is for tests and is not here.
  static const TransportRegistry& Builtin();

 private:
  struct Entry {
    TransportCapabilities capabilities;
    Factory factory;
  };
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_TRANSPORT_H_
