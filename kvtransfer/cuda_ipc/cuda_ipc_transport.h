// CudaIpcTransport (`cuda_ipc`): KV blocks between GPU pools of workers on
// one host, device to device. The pool's allocation is exported with a CUDA
// IPC handle; a peer opens it (cudaIpcOpenMemHandle, peer access where the
// devices differ) and copies byte runs (PlanRuns) device to device on the
// transport's own stream, so no byte passes through the host. A peer in the
// same process (two transports of one test) is reached through its pointer
// directly.
//
// Completion: a transfer's runs (one kernel for all, copy_runs.h;
// cudaMemcpyAsync a run where a run is not 16-byte aligned or the kernel
// cannot run) and an event are issued on the transport's stream, up to
// kMaxInFlight transfers ahead of the oldest one's completion, which one
// copy thread polls (the stream completes them in order). A transfer with
// nothing to wait for (no fence pending, nothing queued before it, a slot
// free) is issued on the caller's thread, saving the copy thread's wake-up
// (7-13 us a transfer on an H200); the others queue for the copy thread. A copy on
// the GPU cannot be recalled: a transfer cancelled, removed or past its
// deadline while its copies run reports that error only once they
// completed, so no byte lands after `done`. PushAfter issues its copies once a kCuda fence's event completed
// (polled by the copy thread, which gives up at the transfer's deadline or
// on Cancel: writes that never finish hold nothing).
//
// The address a peer needs (LocalInfo().address) is CudaIpcAddress, encoded
// by EncodeCudaIpcAddress: the handle, the pool's offset in its allocation,
// the device's PCI bus id, the host's boot id (another host is refused) and
// a random token of the process (a peer in the same process is reached by
// pointer), and the process id, pid namespace and start time.
//
// A dead peer: its pool's memory stays allocated while this process maps
// it, so a crashed worker's GPU memory would outlive it and starve its
// restart. The copy thread checks every second whether the processes of its
// peers (those of its pid namespace) still run; a dead one's peer entry goes
// (its mapping is closed once its last transfer ended) and transfers to it
// are refused with Unavailable, naming the exit. The process of a peer in
// another pid namespace cannot be watched: its mapping is closed once no
// transfer used it for a minute and reopened by the next transfer (which
// fails, Unavailable, if the peer is gone), so a dead peer's memory is held
// for a minute at most.
//
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
#define TANDEM_KVTRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/process_info.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

// What a peer needs to reach a pool (the PeerInfo address of cuda_ipc).
struct CudaIpcAddress {
  std::string handle;    // the cudaIpcMemHandle_t's 64 bytes
  int64_t offset = 0;    // of the pool in the exported allocation
  uint64_t pointer = 0;  // the pool's device address in its own process
  std::string pci_bus_id;
  std::string boot_id;  // /proc/sys/kernel/random/boot_id
  std::string process;  // a random token of the process (pids repeat across containers)
  int64_t pid = 0;      // for logs, and the liveness check
  // The process's pid namespace (/proc/self/ns/pid) and start time (ticks
  // after boot, /proc/PID/stat): a peer of the same namespace is known dead
  // when its pid is gone or started at another time. Empty / 0: not known.
  std::string pid_namespace;
  uint64_t start_time = 0;
};
std::string EncodeCudaIpcAddress(const CudaIpcAddress& a);
// InvalidArgument naming what is malformed.
absl::StatusOr<CudaIpcAddress> DecodeCudaIpcAddress(const std::string& text);

class CudaIpcTransport final : public Transport {
 public:
  // The transport of device `device`'s pools.
  static absl::StatusOr<std::unique_ptr<CudaIpcTransport>> Create(int device);
  static TransportCapabilities Capabilities() { return {.push = true, .pull = true, .memory = {MemoryType::kCuda}}; }
  ~CudaIpcTransport() override;  // queued transfers finish with Cancelled

  std::string backend() const override { return "cuda_ipc"; }
  std::string Domain() const override {
    const std::string boot = HostBootId();
    return boot.empty() ? "" : "host:" + boot;
  }
  TransportCapabilities capabilities() const override { return Capabilities(); }
  // `base`: device memory of this transport's device (from cudaMalloc).
  absl::Status RegisterPool(const PoolLayout& layout, void* base) override;
  absl::StatusOr<PeerInfo> LocalInfo() const override;
  absl::Status AddPeer(const PeerInfo& peer) override;
  void RemovePeer(const std::string& agent_id) override;
  absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  void Cancel(uint64_t transfer_id) override;
  absl::StatusOr<uint64_t> PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                     std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                     TransferDone done) override;

 private:
  // A peer's pool as this process reaches it; an opened IPC mapping is
  // closed when the last transfer holding it ends.
  struct Mapping {
    unsigned char* base = nullptr;  // the peer's pool here
    void* opened = nullptr;         // cudaIpcOpenMemHandle's pointer, to close; null in-process
    int device = 0;
    ~Mapping();
  };
  struct Peer {
    PoolLayout layout;
    std::shared_ptr<Mapping> mapping;  // null while closed for idleness (reopened by the next transfer)
    CudaIpcAddress address;
    int device = 0;           // the peer's GPU, as this process numbers them
    int64_t pid = 0;          // watched where start_time != 0
    uint64_t start_time = 0;  // of a process of this pid namespace, else 0
    std::chrono::steady_clock::time_point last_used;
  };
  struct Transfer {
    uint64_t id = 0;
    std::string peer;
    bool push = false;
    std::vector<CopyRun> runs;
    std::shared_ptr<Mapping> mapping;
    std::shared_ptr<const WriteFence> after;  // null, or a fence to order the copies after
    Deadline deadline;
    TransferDone done;
  };

  // A transfer issued and not yet complete: its event and the descriptors
  // its kernel reads (mapped pinned memory), reused by later transfers.
  struct Slot {
    void* event = nullptr;  // cudaEvent_t
    void* chunks_host = nullptr;
    void* chunks_device = nullptr;
    int64_t capacity = 0;  // descriptors it holds
  };
  static constexpr int kMaxInFlight = 4;
  struct Flying {
    Transfer t;
    Slot* slot = nullptr;
    std::chrono::steady_clock::time_point issued;
  };

  CudaIpcTransport(int device, void* stream, std::vector<Slot> slots, int max_ctas);
  absl::StatusOr<uint64_t> Start(const std::string& agent_id, std::vector<BlockPair> blocks,
                                 std::shared_ptr<const WriteFence> after, Deadline deadline, TransferDone done,
                                 bool push);
  void CopyLoop();
  // Drops the peers whose processes are known to have exited, and closes
  // the mappings of unwatched peers idle for kIdleClose.
  void SweepPeers();
  // Opens (or, in this process, points at) the pool of the peer at `a`.
  absl::StatusOr<std::shared_ptr<Mapping>> OpenMapping(const CudaIpcAddress& a, const std::string& agent_id,
                                                       const PoolLayout& layout, int peer_device);
  // Unavailable, naming the exit of `agent_id` (in exited_).
  absl::Status ExitedError(const std::string& agent_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK while `t` may still proceed: not cancelled, its peer's mapping the
  // same, its deadline ahead.
  absl::Status CheckLive(const Transfer& t);
  // Waits for t's fence (polled: writes that never finish must not hold it
  // past its deadline), checking that t may still proceed.
  absl::Status WaitFence(const Transfer& t);
  // Issues t's copies into `slot` and records its event (on this thread:
  // the copy thread's, or a caller's whose transfer had nothing to wait
  // for), then hands it to the copy thread's polling, or, failed, to its
  // finishing. Without mu_ held; this thread's current device is device_.
  void Launch(Transfer t, Slot* slot);
  // Issues t's runs on the stream (kernel or cudaMemcpyAsync).
  absl::Status IssueCopies(const Transfer& t, unsigned char* local, Slot& slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(issue_mu_);

  const int device_;
  void* const stream_;  // cudaStream_t
  const std::string agent_id_;
  const int max_ctas_;  // of the copy kernel
  // An unwatched peer's mapping unused this long is closed (SweepPeers).
  static constexpr std::chrono::seconds kIdleClose{60};
  std::vector<Slot> slots_;  // handed out through free_slots_ (the destructor's, after the copy thread ended)
  // Issuing (the stream's order, a slot's descriptors, kernel_ok_): one
  // thread at a time. Taken before mu_, never while holding it.
  std::mutex issue_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  PoolLayout layout_ ABSL_GUARDED_BY(mu_);
  unsigned char* base_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string address_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  std::deque<Transfer> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, bool> cancelled_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> exited_ ABSL_GUARDED_BY(mu_);  // dead peers' pids, by agent id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_set<uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);  // issued, not yet done
  std::vector<Slot*> free_slots_ ABSL_GUARDED_BY(mu_);
  std::deque<Flying> flying_ ABSL_GUARDED_BY(mu_);  // issued, in stream order (the copy thread polls the front)
  std::deque<std::pair<Transfer, absl::Status>> failed_ ABSL_GUARDED_BY(mu_);  // for the copy thread to finish
  // The copy thread holds a transfer taken from queue_ (waiting for its
  // fence, or issuing it): callers queue behind it.
  bool draining_queue_ ABSL_GUARDED_BY(mu_) = false;
  bool kernel_ok_ ABSL_GUARDED_BY(issue_mu_) = true;  // false once the copy kernel cannot run on this GPU
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
