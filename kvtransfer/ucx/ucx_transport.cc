#include "kvtransfer/ucx/ucx_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <span>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/process_info.h"
#include "common/status_macros.h"
#include "common/thread_util.h"

namespace tandem::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;

// ---- A small little-endian byte encoding (portable across hosts).

class Writer {
 public:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void Bytes(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool U32(uint32_t* v) {
    if (in_.size() < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(4);
    return true;
  }
  bool U64(uint64_t* v) {
    if (in_.size() < 8) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(8);
    return true;
  }
  bool Bytes(std::string* s) {
    uint32_t n;
    if (!U32(&n) || in_.size() < n) return false;
    s->assign(in_.substr(0, n));
    in_.remove_prefix(n);
    return true;
  }
  bool done() const { return in_.empty(); }

 private:
  std::string_view in_;
};

constexpr uint32_t kAddressMagic = 0x5558564b;  // "KVXU"
constexpr uint32_t kAddressVersion = 2;
constexpr uint32_t kPeerInfoMagic = 0x4950564b;  // "KVPI"

// What PeerInfo.address carries for a UCX peer.
struct UcxAddress {
  uint64_t base = 0;          // remote virtual address of block 0
  uint64_t length = 0;        // registered bytes
  uint64_t pid = 0;           // the peer process, for the same-host liveness check
  std::string boot_id;        // /proc/sys/kernel/random/boot_id of its host
  std::string pid_ns;         // its pid namespace: pids compare only within one
  std::string worker;         // ucp_worker_get_address bytes
  std::string rkey;           // ucp_rkey_pack bytes (empty in staged mode: the pool is not registered)
  uint64_t chunk_blocks = 0;  // staged mode: blocks a staging slot holds; 0 otherwise
};

std::string EncodeAddress(const UcxAddress& a) {
  Writer w;
  w.U32(kAddressMagic);
  w.U32(kAddressVersion);
  w.U64(a.base);
  w.U64(a.length);
  w.U64(a.pid);
  w.Bytes(a.boot_id);
  w.Bytes(a.pid_ns);
  w.Bytes(a.worker);
  w.Bytes(a.rkey);
  w.U64(a.chunk_blocks);
  return w.Take();
}

absl::StatusOr<UcxAddress> DecodeAddress(std::string_view bytes) {
  Reader r(bytes);
  UcxAddress a;
  uint32_t magic = 0, version = 0;
  if (!r.U32(&magic) || magic != kAddressMagic || !r.U32(&version)) {
    return absl::InvalidArgumentError("not a UCX peer address");
  }
  if (version != kAddressVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("UCX peer address version %d, this build reads %d", version, kAddressVersion));
  }
  if (!r.U64(&a.base) || !r.U64(&a.length) || !r.U64(&a.pid) || !r.Bytes(&a.boot_id) || !r.Bytes(&a.pid_ns) ||
      !r.Bytes(&a.worker) || !r.Bytes(&a.rkey) || !r.U64(&a.chunk_blocks) || !r.done() || a.worker.empty() ||
      a.rkey.empty() != (a.chunk_blocks > 0)) {
    return absl::InvalidArgumentError("truncated or malformed UCX peer address");
  }
  return a;
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string PidNamespace() {
  char buf[128];
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf));
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// False only when the process is known to be gone (no /proc entry, or a zombie).
bool ProcessAlive(uint64_t pid) {
  std::ifstream in(absl::StrFormat("/proc/%d/stat", pid));
  if (!in) return false;
  std::string stat;
  std::getline(in, stat);
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return true;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

absl::Status UcxError(std::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrFormat("%s: %s", what, ucs_status_string(status)));
}

// Staged mode's UCX tags: the transfer's tag in the high 44 bits, the chunk
// index in the low 20.
constexpr int kChunkBits = 20;
constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkBits) - 1;
constexpr uint64_t kTransferTagMask = (uint64_t{1} << (64 - kChunkBits)) - 1;
ucp_tag_t StagedTag(uint64_t tag, int64_t chunk) {
  return ((tag & kTransferTagMask) << kChunkBits) | static_cast<uint64_t>(chunk);
}
// A message no posted Receive expects is held this long (its Receive may be
// posted a moment after the sender started), then received and dropped.
constexpr auto kUnmatchedGrace = std::chrono::seconds(10);
// A Receive that ended: its tag's later messages (a failed transfer's, or
// a sender's surplus) are dropped at once for this long.
constexpr auto kDeadTagMemory = std::chrono::seconds(120);
// How often staged transfers waiting on a peer check that it still runs.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

}  // namespace

class UcxTransport::Impl {
 public:
  explicit Impl(const UcxOptions& options)
      : options_(options), agent_id_(NewAgentId("ucx")), peer_mode_(options.transports == "tcp") {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    if (event_fd_ >= 0) close(event_fd_);
  }

  // Starts the progress thread, which creates the UCX objects.
  absl::Status Start() {
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) return absl::InternalError("eventfd failed");
    std::promise<absl::Status> ready;
    std::future<absl::Status> result = ready.get_future();
    thread_ = std::thread([this, &ready] {
      SetThreadName("ucx_progress");
      absl::Status st = InitUcx();
      const bool ok = st.ok();
      ready.set_value(std::move(st));
      if (ok) Loop();
      ShutdownUcx();
    });
    return result.get();
  }

  absl::StatusOr<void*> AllocatePool(int64_t bytes) {
    if (bytes <= 0) return absl::InvalidArgumentError("AllocatePool: no bytes");
    absl::StatusOr<void*> result = absl::InternalError("not run");
    RunSync([&] {
      if (alloc_memh_ != nullptr) {
        result = absl::FailedPreconditionError("AllocatePool: already allocated");
        return;
      }
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      mp.address = nullptr;
      mp.length = static_cast<size_t>(bytes);
      mp.flags = UCP_MEM_MAP_ALLOCATE;
      ucp_mem_h memh;
      ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
      if (st != UCS_OK) {
        result = absl::ResourceExhaustedError(
            absl::StrFormat("ucp_mem_map(ALLOCATE, %d bytes): %s", bytes, ucs_status_string(st)));
        return;
      }
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      st = ucp_mem_query(memh, &attr);
      if (st != UCS_OK) {
        ucp_mem_unmap(ctx_, memh);
        result = UcxError("ucp_mem_query", st);
        return;
      }
      alloc_memh_ = memh;
      alloc_base_ = static_cast<uint8_t*>(attr.address);
      alloc_len_ = attr.length;
      result = attr.address;
    });
    // Not every UCX allocation method zero-fills (heap); this also faults
    // the pages in, off the transfer path.
    if (result.ok()) std::memset(*result, 0, static_cast<size_t>(bytes));
    return result;
  }

  absl::Status RegisterPool(const PoolLayout& layout, void* base) {
    if (base == nullptr || layout.block_bytes <= 0 || layout.num_blocks <= 0) {
      return absl::InvalidArgumentError("RegisterPool: empty pool");
    }
    if (layout.memory_type != MemoryType::kHost && !options_.staged) {
      return absl::UnimplementedError(
          "the UCX backend moves host memory only (Debian's UCX 1.13 has no CUDA support; ucx_staged moves GPU "
          "pools through host staging)");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (registered_) return absl::FailedPreconditionError("a KV pool is already registered");
    }
    if (layout.num_blocks <= 0 || layout.block_bytes <= 0 ||
        layout.num_blocks > std::numeric_limits<int64_t>::max() / layout.block_bytes) {
      return absl::InvalidArgumentError("RegisterPool: the pool's size is empty or overflows");
    }
    const uint64_t bytes = static_cast<uint64_t>(layout.num_blocks * layout.block_bytes);
    absl::Status status;
    std::string rkey;
    RunSync([&] {
      if (pool_memh_ != nullptr || copier_ != nullptr) {  // a concurrent RegisterPool won
        status = absl::FailedPreconditionError("a KV pool is already registered");
        return;
      }
      uint8_t* p = static_cast<uint8_t*>(base);
      if (options_.staged) {
        status = RegisterStaged(layout, p);
        return;
      }
      ucp_mem_h memh = nullptr;
      if (alloc_memh_ != nullptr && p >= alloc_base_ && p + bytes <= alloc_base_ + alloc_len_) {
        memh = alloc_memh_;
      } else {
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = base;
        mp.length = bytes;
        ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
        if (st != UCS_OK) {
          status = UcxError("ucp_mem_map of the KV pool", st);
          return;
        }
        own_pool_memh_ = true;
      }
      void* buf = nullptr;
      size_t len = 0;
      ucs_status_t st = ucp_rkey_pack(ctx_, memh, &buf, &len);
      if (st != UCS_OK) {
        if (own_pool_memh_) ucp_mem_unmap(ctx_, memh);
        own_pool_memh_ = false;
        status = UcxError("ucp_rkey_pack", st);
        return;
      }
      rkey.assign(static_cast<const char*>(buf), len);
      ucp_rkey_buffer_release(buf);
      pool_memh_ = memh;
      pool_base_ = p;
    });
    RETURN_IF_ERROR(status);
    UcxAddress address{.base = reinterpret_cast<uint64_t>(base),
                       .length = bytes,
                       .pid = static_cast<uint64_t>(getpid()),
                       .boot_id = boot_id_,
                       .pid_ns = pid_ns_,
                       .worker = worker_address_,
                       .rkey = std::move(rkey),
                       .chunk_blocks = static_cast<uint64_t>(chunk_blocks_)};
    std::lock_guard<std::mutex> lock(mu_);
    registered_ = true;
    layout_ = layout;
    info_ = PeerInfo{.agent_id = agent_id_, .backend = Backend(), .layout = layout, .address = EncodeAddress(address)};
    return absl::OkStatus();
  }

  absl::StatusOr<PeerInfo> LocalInfo() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_) return absl::FailedPreconditionError("no KV pool registered");
    return info_;
  }

  absl::Status AddPeer(const PeerInfo& peer) {
    if (peer.backend != Backend()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("peer %s speaks %s, not %s", peer.agent_id, peer.backend, Backend()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!registered_) return absl::FailedPreconditionError("no KV pool registered");
      RETURN_IF_ERROR(CheckCompatible(layout_, peer.layout));
    }
    ASSIGN_OR_RETURN(UcxAddress address, DecodeAddress(peer.address));
    const uint64_t chunk_blocks = address.chunk_blocks;
    if ((chunk_blocks > 0) != options_.staged || chunk_blocks > kChunkMask) {
      return absl::InvalidArgumentError(absl::StrFormat("peer %s: a malformed staged address", peer.agent_id));
    }
    // Division, not multiplication: the peer's numbers must not overflow past the check.
    if (peer.layout.num_blocks <= 0 || peer.layout.block_bytes <= 0 ||
        (!options_.staged && static_cast<uint64_t>(peer.layout.num_blocks) >
                                 address.length / static_cast<uint64_t>(peer.layout.block_bytes))) {
      return absl::InvalidArgumentError(absl::StrFormat("peer %s: %d blocks of %d bytes exceed its registered %d bytes",
                                                        peer.agent_id, peer.layout.num_blocks, peer.layout.block_bytes,
                                                        address.length));
    }
    absl::Status status;
    RunSync([&] {
      DropConn(peer.agent_id, absl::UnavailableError(absl::StrFormat("peer %s was re-added", peer.agent_id)));
      auto conn = std::make_unique<Conn>();
      conn->agent_id = peer.agent_id;
      conn->address = std::move(address);
      conn->same_host = conn->address.boot_id == boot_id_ && conn->address.pid_ns == pid_ns_ && !boot_id_.empty();
      status = Connect(*conn);
      if (status.ok()) conns_[peer.agent_id] = std::move(conn);
    });
    RETURN_IF_ERROR(status);
    std::lock_guard<std::mutex> lock(mu_);
    peers_[peer.agent_id] = Peer{peer.layout, static_cast<int64_t>(chunk_blocks)};
    return absl::OkStatus();
  }

  void RemovePeer(const std::string& agent_id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_.erase(agent_id);
    }
    RunSync([&] { DropConn(agent_id, absl::UnavailableError(absl::StrFormat("peer %s was removed", agent_id))); });
  }

  absl::StatusOr<uint64_t> Start(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                 TransferDone done, bool push) {
    if (options_.staged) {
      if (!push) return absl::UnimplementedError("ucx_staged only pushes: the receiver takes part (Receive)");
      return absl::FailedPreconditionError(
          "ucx_staged sends and receives: push with PushAfter and the tag of the receiver's Receive");
    }
    auto xfer = std::make_shared<Xfer>();
    xfer->peer = agent_id;
    xfer->kind = push ? Kind::kPut : Kind::kGet;
    xfer->deadline = std::min(deadline, Clock::now() + options_.max_transfer_time);
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Checked with the enqueue under one lock: the loop reads stop_ and
      // takes the queue under the same lock, so a transfer queued here always
      // runs (and calls `done`), and none is queued once the loop may be gone.
      if (stop_) return absl::UnavailableError("the KV transport is shutting down");
      auto peer = peers_.find(agent_id);
      if (peer == peers_.end()) {
        return absl::NotFoundError(absl::StrFormat("unknown KV transfer peer %s", agent_id));
      }
      const int64_t local = layout_.num_blocks, remote = peer->second.layout.num_blocks;
      ASSIGN_OR_RETURN(xfer->runs, PlanRuns(blocks, layout_.block_bytes, push ? local : remote, push ? remote : local));
      id = xfer->id = next_id_++;
      xfer->done = std::move(done);
      commands_.push_back([this, xfer]() mutable { Begin(std::make_unique<Xfer>(std::move(*xfer))); });
    }
    Wake();
    return id;
  }

  // Staged mode: a send (PushAfter; `after` null or not yet complete) or a
  // receive of the peer's send under `tag`.
  absl::StatusOr<uint64_t> StartStaged(const std::string& agent_id, std::vector<BlockPair> blocks,
                                       std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                       TransferDone done, bool send) {
    const char* what = send ? "PushAfter" : "Receive";
    if (!options_.staged) {
      return absl::UnimplementedError(
          absl::StrFormat("%s: the ucx transport is one-sided (ucx_staged sends and receives)", what));
    }
    auto xfer = std::make_shared<Xfer>();
    xfer->peer = agent_id;
    xfer->kind = send ? Kind::kSend : Kind::kRecv;
    xfer->tag = tag & kTransferTagMask;
    xfer->after = std::move(after);
    xfer->deadline = std::min(deadline, Clock::now() + options_.max_transfer_time);
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return absl::UnavailableError("the KV transport is shutting down");
      if (!registered_) return absl::FailedPreconditionError("no KV pool registered");
      auto peer = peers_.find(agent_id);
      if (peer == peers_.end()) {
        return absl::NotFoundError(absl::StrFormat("unknown KV transfer peer %s (not paired)", agent_id));
      }
      if (xfer->after != nullptr && xfer->after->memory() != layout_.memory_type) {
        return absl::FailedPreconditionError(
            absl::StrFormat("PushAfter: the write fence is on the %s, the pool in %s memory",
                            xfer->after->memory() == MemoryType::kCuda ? "GPU" : "host",
                            layout_.memory_type == MemoryType::kCuda ? "GPU" : "host"));
      }
      const int64_t local = layout_.num_blocks, remote = peer->second.layout.num_blocks;
      RETURN_IF_ERROR(PlanRuns(blocks, layout_.block_bytes, send ? local : remote, send ? remote : local).status());
      xfer->chunk_blocks = std::min(chunk_blocks_, peer->second.chunk_blocks);
      xfer->num_chunks = (static_cast<int64_t>(blocks.size()) + xfer->chunk_blocks - 1) / xfer->chunk_blocks;
      if (xfer->num_chunks > static_cast<int64_t>(kChunkMask) + 1) {
        return absl::InvalidArgumentError(absl::StrFormat("%s: %d blocks make %d chunks, more than a transfer's %d",
                                                          what, blocks.size(), xfer->num_chunks, kChunkMask + 1));
      }
      if (!send && !receive_tags_.insert(xfer->tag).second) {
        return absl::AlreadyExistsError(absl::StrFormat("Receive: tag %d is already being received", tag));
      }
      xfer->pairs = std::move(blocks);
      id = xfer->id = next_id_++;
      xfer->done = std::move(done);
      commands_.push_back([this, xfer]() mutable { Begin(std::make_unique<Xfer>(std::move(*xfer))); });
    }
    Wake();
    return id;
  }

  void Cancel(uint64_t id) {
    Enqueue([this, id] {
      auto it = xfers_.find(id);
      if (it != xfers_.end()) Abort(*it->second, absl::CancelledError("transfer cancelled"));
    });
  }

 private:
  enum class Kind { kPut, kGet, kSend, kRecv };

  struct Xfer {
    uint64_t id = 0;
    std::string peer;
    Kind kind = Kind::kPut;
    bool push() const { return kind == Kind::kPut || kind == Kind::kSend; }
    std::vector<CopyRun> runs;
    size_t next = 0;      // first run not posted yet
    int outstanding = 0;  // UCX requests in flight
    bool flush_posted = false;
    bool flush_done = false;
    Deadline deadline;
    TransferDone done;
    absl::Status error;  // first operation error
    // Staged (kSend, kRecv): chunk i is pairs[i * chunk_blocks, ...).
    uint64_t tag = 0;
    std::vector<BlockPair> pairs;
    int64_t chunk_blocks = 0;
    int64_t num_chunks = 0;
    int64_t next_chunk = 0;                   // kSend: the first chunk not gathered yet
    int64_t chunks_done = 0;                  // sent (kSend) or scattered (kRecv)
    std::vector<bool> taken;                  // kRecv: chunks whose message was taken
    std::shared_ptr<const WriteFence> after;  // kSend: nothing gathered before it completed

    std::span<const BlockPair> Chunk(int64_t i) const {
      const size_t first = static_cast<size_t>(i * chunk_blocks);
      return std::span<const BlockPair>(pairs).subspan(
          first, std::min(pairs.size() - first, static_cast<size_t>(chunk_blocks)));
    }
  };

  // A staging slot's use, from the copy or UCX operation that took it until
  // the one that frees it; outlives its transfer (a slot is reused only
  // once nothing writes or reads it any more).
  struct SlotOp {
    enum class Stage { kGather, kSend, kRecv, kScatter, kDiscard };
    Impl* impl;
    Stage stage;
    int slot;
    uint64_t xfer;  // 0 for kDiscard
    int64_t chunk = 0;
    std::string peer;         // sends: the agent it goes to
    uint64_t ticket = 0;      // copier stages
    void* request = nullptr;  // UCX stages, while UCX holds it
    ucs_status_t result = UCS_OK;
  };

  // A message probed off the worker, waiting for a slot or for its Receive.
  struct Arrived {
    ucp_tag_message_h msg;
    ucp_tag_t tag;
    size_t length;
    Clock::time_point at;
  };

  struct Peer {
    PoolLayout layout;
    int64_t chunk_blocks = 0;  // staged mode: the peer's blocks a slot
  };

  struct Conn {
    std::string agent_id;
    UcxAddress address;
    bool same_host = false;
    ucp_ep_h ep = nullptr;
    ucp_rkey_h rkey = nullptr;
    absl::Status failed;                  // set when UCX reported the peer lost
    absl::flat_hash_set<uint64_t> xfers;  // transfers in flight to it
  };

  // Lives until UCX completes the request, even if its transfer is gone.
  struct OpCtx {
    Impl* impl;
    uint64_t xfer;
    bool flush;
  };

  // ---- Commands to the progress thread.

  void Enqueue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(fn));
    }
    Wake();
  }

  void RunSync(const std::function<void()>& fn) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      fn();
      return;
    }
    std::promise<void> ran;
    Enqueue([&] {
      fn();
      ran.set_value();
    });
    ran.get_future().wait();
  }

  void Wake() {
    if (event_fd_ < 0) return;
    uint64_t one = 1;
    ssize_t n = write(event_fd_, &one, sizeof(one));
    (void)n;  // EAGAIN only when the counter is already non-zero: awake anyway
  }

  // ---- Progress thread only from here on.

  absl::Status InitUcx() {
    boot_id_ = ReadFirstLine("/proc/sys/kernel/random/boot_id");
    pid_ns_ = PidNamespace();
    ucp_config_t* cfg = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
    if (st != UCS_OK) return UcxError("ucp_config_read", st);
    if (options_.transports == "shm") {
      st = ucp_config_modify(cfg, "TLS", "sm,self");
    } else if (options_.transports == "tcp") {
      st = ucp_config_modify(cfg, "TLS", "tcp");
      // The option, else UCX_NET_DEVICES from the environment, else loopback.
      const char* env = std::getenv("UCX_NET_DEVICES");
      const std::string devices = !options_.net_devices.empty()    ? options_.net_devices
                                  : env != nullptr && *env != '\0' ? std::string(env)
                                                                   : std::string("lo");
      if (st == UCS_OK) st = ucp_config_modify(cfg, "NET_DEVICES", devices.c_str());
    }
    if (st != UCS_OK) {
      ucp_config_release(cfg);
      return UcxError("ucp_config_modify", st);
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (options_.staged ? UCP_FEATURE_TAG : 0);
    st = ucp_init(&params, cfg, &ctx_);
    ucp_config_release(cfg);
    if (st != UCS_OK) return UcxError("ucp_init", st);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(ctx_, &wp, &worker_);
    if (st != UCS_OK) return UcxError("ucp_worker_create", st);
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
    worker_address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);

    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0) return absl::InternalError("epoll_create1 failed");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = event_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &ev);
    int efd = -1;
    if (ucp_worker_get_efd(worker_, &efd) == UCS_OK) {
      ev.data.fd = efd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd, &ev) == 0) worker_efd_ = efd;
    }
    return absl::OkStatus();
  }

  void Loop() {
    while (true) {
      std::deque<std::function<void()>> commands;
      bool stop;
      {
        std::lock_guard<std::mutex> lock(mu_);
        commands.swap(commands_);
        stop = stop_;
      }
      for (auto& fn : commands) fn();
      if (stop) return;
      bool busy = !commands.empty();
      for (int i = 0; i < 1024 && ucp_worker_progress(worker_) != 0; ++i) busy = true;
      busy |= AfterProgress();
      const Clock::time_point now = Clock::now();
      if (busy) last_busy_ = now;
      // Poll without sleeping while own transfers are in flight (until their
      // deadlines at worst) and for kSpin after the last event (a peer's puts
      // streaming in over TCP need this side's progress). Sleeping on the
      // wakeup fd between events halved the tcp/lo rate (0.34 vs 0.6-0.7 GB/s
      // for 2-64 MiB pushes); shm puts complete inline either way.
      // Staged mode: a receive waiting for its sender's first message spins
      // for kReceiveSpin after the last event, then sleeps a millisecond at a
      // time (shared memory does not wake the worker's fd: sleeping on it
      // alone cost 8 ms a transfer).
      constexpr auto kSpin = std::chrono::milliseconds(5);
      constexpr auto kReceiveSpin = std::chrono::milliseconds(50);
      const bool receiving = !receiving_.empty();
      const bool active = options_.staged ? StagedActive() : !xfers_.empty();
      if (active || now - last_busy_ < (receiving ? kReceiveSpin : kSpin)) continue;
      // Idle: sleep on the worker's wakeup fd and the command eventfd (staged
      // receives and held messages have deadlines: wake often enough).
      int timeout_ms = receiving ? 1 : xfers_.empty() && arrived_.empty() ? 100 : 10;
      if (worker_efd_ >= 0) {
        ucs_status_t st = ucp_worker_arm(worker_);
        if (st == UCS_ERR_BUSY) continue;
      } else {
        timeout_ms = std::min(timeout_ms, 1);
      }
      epoll_event events[4];
      int n = epoll_wait(epoll_fd_, events, 4, timeout_ms);
      for (int i = 0; i < n; ++i) {
        if (events[i].data.fd == event_fd_) {
          uint64_t v;
          ssize_t r = read(event_fd_, &v, sizeof(v));
          (void)r;
        }
      }
    }
  }

  // Work deferred out of UCX callbacks: failed endpoints, transfers whose
  // operations completed, deadlines, `done` calls. True if anything happened.
  bool AfterProgress() {
    bool busy = StagedProgress();
    std::vector<ucp_ep_h> failed;
    failed.swap(failed_eps_);
    for (ucp_ep_h ep : failed) {
      for (auto& [id, conn] : conns_) {
        if (conn->ep != ep) continue;
        busy = true;
        FailConn(*conn, conn->failed);
        CloseEp(*conn);
      }
    }
    absl::flat_hash_set<uint64_t> dirty;
    dirty.swap(dirty_);
    for (uint64_t id : dirty) {
      auto it = xfers_.find(id);
      if (it != xfers_.end()) Advance(*it->second);
      busy = true;
    }
    const Deadline now = Clock::now();
    std::vector<uint64_t> expired;
    for (const auto& [id, x] : xfers_) {
      if (now >= x->deadline) expired.push_back(id);
    }
    for (uint64_t id : expired) {
      auto it = xfers_.find(id);
      if (it != xfers_.end()) {
        Abort(*it->second, absl::DeadlineExceededError("KV transfer deadline passed"));
      }
      busy = true;
    }
    ReapClosedEndpoints();
    busy |= DeliverCompletions();
    return busy;
  }

  bool DeliverCompletions() {
    if (completions_.empty()) return false;
    std::vector<std::pair<TransferDone, absl::Status>> completions;
    completions.swap(completions_);
    for (auto& [done, status] : completions) done(std::move(status));
    return true;
  }

  absl::Status Connect(Conn& conn) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(conn.address.worker.data());
    // PEER mode finds dead peers on tcp, but with it UCX 1.13 refuses (or
    // routes around) shared memory: NONE everywhere else.
    ep.err_mode = peer_mode_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode_) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = &Impl::OnEpError;
      ep.err_handler.arg = this;
    }
    ucs_status_t st = ucp_ep_create(worker_, &ep, &conn.ep);
    if (st != UCS_OK) {
      conn.ep = nullptr;
      return UcxError(absl::StrFormat("ucp_ep_create to %s", conn.agent_id), st);
    }
    if (conn.address.rkey.empty()) {  // staged: nothing of the peer's memory is reached
      conn.failed = absl::OkStatus();
      return absl::OkStatus();
    }
    st = ucp_ep_rkey_unpack(conn.ep, conn.address.rkey.data(), &conn.rkey);
    if (st != UCS_OK) {
      conn.rkey = nullptr;
      CloseEp(conn);
      return UcxError(absl::StrFormat("ucp_ep_rkey_unpack for %s", conn.agent_id), st);
    }
    conn.failed = absl::OkStatus();
    return absl::OkStatus();
  }

  void CloseEp(Conn& conn) {
    if (conn.rkey != nullptr) ucp_rkey_destroy(conn.rkey);
    conn.rkey = nullptr;
    if (conn.ep == nullptr) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(conn.ep, &p);
    if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
    conn.ep = nullptr;
  }

  // Frees the endpoint-close requests UCX has finished. Progress thread only.
  void ReapClosedEndpoints() {
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Ends every transfer to `conn` with `status`.
  void FailConn(Conn& conn, const absl::Status& status) {
    std::vector<uint64_t> ids(conn.xfers.begin(), conn.xfers.end());
    for (uint64_t id : ids) {
      auto it = xfers_.find(id);
      if (it != xfers_.end()) Finish(*it->second, status);
    }
  }

  void DropConn(const std::string& agent_id, const absl::Status& status) {
    auto it = conns_.find(agent_id);
    if (it == conns_.end()) return;
    FailConn(*it->second, status);
    CloseEp(*it->second);
    conns_.erase(it);
  }

  Conn* FindConn(const std::string& agent_id) {
    auto it = conns_.find(agent_id);
    return it == conns_.end() ? nullptr : it->second.get();
  }

  absl::Status PeerGone(const Conn& conn) const {
    if (!conn.failed.ok()) return conn.failed;
    if (conn.ep == nullptr) {
      return absl::UnavailableError(absl::StrFormat("no endpoint to peer %s", conn.agent_id));
    }
    if (conn.same_host && !ProcessAlive(conn.address.pid)) {
      return absl::UnavailableError(absl::StrFormat("peer %s (pid %d) has exited", conn.agent_id, conn.address.pid));
    }
    return absl::OkStatus();
  }

  void Begin(std::unique_ptr<Xfer> x) {
    Conn* conn = FindConn(x->peer);
    absl::Status status;
    if (conn == nullptr) {
      status = absl::UnavailableError(absl::StrFormat("peer %s was removed", x->peer));
    } else if (Clock::now() >= x->deadline) {
      status = absl::DeadlineExceededError("KV transfer deadline passed before it started");
    } else {
      status = PeerGone(*conn);
    }
    if (!status.ok()) {
      if (x->kind == Kind::kRecv) {  // as Finish does: its tag's chunks are dropped
        dead_tags_[x->tag] = Clock::now() + kDeadTagMemory;
        std::lock_guard<std::mutex> lock(mu_);
        receive_tags_.erase(x->tag);
      }
      completions_.emplace_back(std::move(x->done), std::move(status));
      return;
    }
    Xfer& ref = *x;
    conn->xfers.insert(x->id);
    if (x->kind == Kind::kRecv) {
      x->taken.assign(static_cast<size_t>(x->num_chunks), false);
      receiving_[x->tag] = x->id;
      dead_tags_.erase(x->tag);
    }
    xfers_[x->id] = std::move(x);
    Advance(ref);
  }

  // Posts what the window allows; finishes the transfer when all is done.
  void Advance(Xfer& x) {
    if (!x.error.ok()) {
      Abort(x, x.error);
      return;
    }
    if (x.kind == Kind::kSend || x.kind == Kind::kRecv) {
      AdvanceStaged(x);
      return;
    }
    Conn* conn = FindConn(x.peer);
    if (conn == nullptr || conn->ep == nullptr) {
      Abort(x, absl::UnavailableError(absl::StrFormat("peer %s is gone", x.peer)));
      return;
    }
    while (x.next < x.runs.size() && x.outstanding < options_.max_outstanding_ops) {
      const CopyRun& run = x.runs[x.next];
      auto* op = new OpCtx{this, x.id, false};
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH |
                       UCP_OP_ATTR_FLAG_MULTI_SEND;
      p.cb.send = &Impl::OnOpDone;
      p.user_data = op;
      p.memh = pool_memh_;
      ucs_status_ptr_t r;
      if (x.push()) {
        r = ucp_put_nbx(conn->ep, pool_base_ + run.src_offset, static_cast<size_t>(run.bytes),
                        conn->address.base + static_cast<uint64_t>(run.dst_offset), conn->rkey, &p);
      } else {
        r = ucp_get_nbx(conn->ep, pool_base_ + run.dst_offset, static_cast<size_t>(run.bytes),
                        conn->address.base + static_cast<uint64_t>(run.src_offset), conn->rkey, &p);
      }
      ++x.next;
      if (UCS_PTR_IS_PTR(r)) {
        ++x.outstanding;
        continue;
      }
      delete op;
      if (UCS_PTR_IS_ERR(r)) {
        Abort(x, UcxError(x.push() ? "ucp_put_nbx" : "ucp_get_nbx", UCS_PTR_STATUS(r)));
        return;
      }
    }
    if (x.next < x.runs.size()) return;
    Complete(x, *conn);
  }

  // Every operation of `x` is posted: a push flushes the endpoint (once),
  // and `x` finishes when nothing of it is outstanding.
  void Complete(Xfer& x, Conn& conn) {
    if (x.push() && !x.flush_posted) {
      // Remote completion of every put: done(OK) may not come before it.
      x.flush_posted = true;
      auto* op = new OpCtx{this, x.id, true};
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = &Impl::OnOpDone;
      p.user_data = op;
      ucs_status_ptr_t r = ucp_ep_flush_nbx(conn.ep, &p);
      if (UCS_PTR_IS_PTR(r)) {
        ++x.outstanding;
      } else {
        delete op;
        if (UCS_PTR_IS_ERR(r)) {
          Abort(x, UcxError("ucp_ep_flush_nbx", UCS_PTR_STATUS(r)));
          return;
        }
        x.flush_done = true;
      }
    }
    if (x.outstanding > 0 || (x.push() && !x.flush_done)) return;
    absl::Status gone = PeerGone(conn);
    if (!gone.ok()) {
      Finish(x, gone);
      return;
    }
    Finish(x, absl::OkStatus());
  }

  // Ends `x` now. If UCX still has operations of it in flight, the peer's
  // endpoint is force-closed so none of them lands later, and re-created.
  void Abort(Xfer& x, absl::Status status) {
    if (x.kind == Kind::kRecv || x.kind == Kind::kSend) {
      // A staged transfer ends alone: its chunks still in UCX keep their
      // slots until UCX completes them (a receive's are cancelled where UCX
      // can; a late chunk of a send is dropped by the receiver, whose
      // Receive has ended too or fails on its checksums), and the endpoint,
      // which other transfers share, stays. Slots of sends to a peer found
      // gone are taken back by StagedProgress.
      if (x.kind == Kind::kRecv) {
        const std::vector<SlotOp*> ops(in_ucx_.begin(), in_ucx_.end());
        for (SlotOp* op : ops) {
          if (op->xfer == x.id && op->request != nullptr) ucp_request_cancel(worker_, op->request);
        }
      }
      Finish(x, std::move(status));
      return;
    }
    const bool in_flight = x.outstanding > 0;
    const std::string peer = x.peer;
    const uint64_t id = x.id;
    Finish(x, std::move(status));
    if (!in_flight) return;
    Conn* conn = FindConn(peer);
    if (conn == nullptr || conn->ep == nullptr) return;
    FailConn(*conn, absl::UnavailableError(absl::StrFormat(
                        "endpoint to %s reset: transfer %d ended with operations in flight", peer, id)));
    CloseEp(*conn);
    if (conn->failed.ok()) {
      absl::Status st = Connect(*conn);
      if (!st.ok()) conn->failed = st;
    }
  }

  void Finish(Xfer& x, absl::Status status) {
    if (Conn* conn = FindConn(x.peer)) conn->xfers.erase(x.id);
    if (x.kind == Kind::kRecv) {
      // Whatever comes under its tag from now on is surplus: dropped at once.
      receiving_.erase(x.tag);
      dead_tags_[x.tag] = Clock::now() + kDeadTagMemory;
      std::lock_guard<std::mutex> lock(mu_);
      receive_tags_.erase(x.tag);
    }
    completions_.emplace_back(std::move(x.done), std::move(status));
    xfers_.erase(x.id);  // destroys x
  }

  void OpDone(uint64_t id, bool flush, ucs_status_t status) {
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return;  // abandoned earlier
    Xfer& x = *it->second;
    --x.outstanding;
    if (flush && status == UCS_OK) x.flush_done = true;
    if (status != UCS_OK && x.error.ok()) {
      x.error = UcxError(absl::StrFormat("UCX %s with peer %s", flush ? "flush" : "transfer", x.peer), status);
    }
    dirty_.insert(id);
  }

  static void OnOpDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<OpCtx*>(user_data);
    op->impl->OpDone(op->xfer, op->flush, status);
    delete op;
    ucp_request_free(request);
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* impl = static_cast<Impl*>(arg);
    for (auto& [id, conn] : impl->conns_) {
      if (conn->ep == ep && conn->failed.ok()) {
        conn->failed = UcxError(absl::StrFormat("peer %s lost", id), status);
      }
    }
    impl->failed_eps_.push_back(ep);
  }

  // ---- Staged mode (progress thread only).

  std::string Backend() const { return options_.staged ? "ucx_staged" : "ucx"; }

  absl::Status RegisterStaged(const PoolLayout& layout, uint8_t* base) {
    std::unique_ptr<StagingCopier> copier;
    if (options_.make_copier) {
      ASSIGN_OR_RETURN(copier, options_.make_copier(layout));
    } else {
      copier = NewHostStagingCopier();
    }
    if (copier == nullptr || copier->memory() != layout.memory_type) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ucx_staged: no staging copier for a pool in %s memory",
          layout.memory_type == MemoryType::kCuda ? absl::StrFormat("GPU %d", layout.device_id) : "host"));
    }
    const int64_t bb = layout.block_bytes;
    const int64_t slot = std::max(bb, options_.staging_slot_bytes / bb * bb);
    if (slot > std::numeric_limits<int64_t>::max() / options_.staging_slots) {
      return absl::InvalidArgumentError("ucx_staged: the staging ring's size overflows");
    }
    const int64_t bytes = slot * options_.staging_slots;
    ASSIGN_OR_RETURN(void* staging, copier->AllocateStaging(bytes));
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = staging;
    mp.length = static_cast<size_t>(bytes);
    mp.flags = staging == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    if (st == UCS_OK) st = ucp_mem_query(memh, &attr);
    if (st != UCS_OK) {
      if (memh != nullptr) ucp_mem_unmap(ctx_, memh);
      if (staging != nullptr) copier->FreeStaging(staging);
      return absl::ResourceExhaustedError(
          absl::StrFormat("ucx_staged: staging ring of %d bytes: %s", bytes, ucs_status_string(st)));
    }
    copier_ = std::move(copier);
    copier_staging_ = staging;
    staging_memh_ = memh;
    staging_base_ = static_cast<uint8_t*>(attr.address);
    slot_bytes_ = slot;
    chunk_blocks_ = slot / bb;
    for (int i = options_.staging_slots - 1; i >= 0; --i) free_slots_.push_back(i);
    slot_sends_.assign(static_cast<size_t>(options_.staging_slots), false);
    pool_base_ = base;
    block_bytes_ = bb;
    return absl::OkStatus();
  }

  uint8_t* Slot(int slot) const { return staging_base_ + static_cast<int64_t>(slot) * slot_bytes_; }

  // Sends hold at most all slots but one: a slot always comes free for a
  // receive, which needs nothing of this side to complete (two sides
  // sending to each other with every slot held by a send would wait on
  // each other's receives forever).
  bool SendSlotFree() const { return !free_slots_.empty() && send_slots_ < static_cast<int>(slot_sends_.size()) - 1; }
  int TakeSlot(bool send) {
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    slot_sends_[static_cast<size_t>(slot)] = send;
    send_slots_ += send ? 1 : 0;
    return slot;
  }
  void FreeSlot(int slot) {
    if (slot_sends_[static_cast<size_t>(slot)]) --send_slots_;
    slot_sends_[static_cast<size_t>(slot)] = false;
    free_slots_.push_back(slot);
    slot_freed_ = true;
  }

  Xfer* FindXfer(uint64_t id) {
    auto it = xfers_.find(id);
    return it == xfers_.end() ? nullptr : it->second.get();
  }

  // A failure of one of `id`'s chunks (its transfer may be gone already).
  void FailXfer(uint64_t id, absl::Status status) {
    Xfer* x = FindXfer(id);
    if (x != nullptr && x->error.ok()) {
      x->error = std::move(status);
      dirty_.insert(id);
    }
  }

  void AdvanceStaged(Xfer& x) {
    if (x.kind == Kind::kSend) {
      Conn* conn = FindConn(x.peer);
      if (conn == nullptr || conn->ep == nullptr) {
        Abort(x, absl::UnavailableError(absl::StrFormat("peer %s is gone", x.peer)));
        return;
      }
      if (x.after != nullptr) {
        if (!copier_->Ready(*x.after)) return;  // polled again from AfterProgress
        x.after.reset();
      }
      while (x.next_chunk < x.num_chunks && SendSlotFree()) {
        const int slot = free_slots_.back();
        const std::vector<CopyRun> runs =
            StagingRuns(x.Chunk(x.next_chunk), block_bytes_, StagingCopier::Direction::kToStaging);
        absl::StatusOr<uint64_t> ticket =
            copier_->Start(StagingCopier::Direction::kToStaging, pool_base_, Slot(slot), runs);
        if (!ticket.ok()) {
          Abort(x, absl::InternalError(absl::StrCat("ucx_staged: copy to staging: ", ticket.status().message())));
          return;
        }
        TakeSlot(/*send=*/true);
        copying_.push_back(std::make_unique<SlotOp>(SlotOp{.impl = this,
                                                           .stage = SlotOp::Stage::kGather,
                                                           .slot = slot,
                                                           .xfer = x.id,
                                                           .chunk = x.next_chunk,
                                                           .peer = x.peer,
                                                           .ticket = *ticket}));
        ++x.next_chunk;
      }
      if (x.chunks_done == x.num_chunks) Complete(x, *conn);
      return;
    }
    // A receive is done once every chunk is in the pool, whatever became
    // of its sender since.
    if (x.chunks_done == x.num_chunks) Finish(x, absl::OkStatus());
  }

  int64_t ChunkBytes(const Xfer& x, int64_t chunk) const {
    return static_cast<int64_t>(x.Chunk(chunk).size()) * block_bytes_;
  }

  // The parameters of a slot's send or receive: its completion comes back
  // through ucx_finished_ (Posted: also when UCX completed it at once).
  ucp_request_param_t SlotParam(SlotOp* op) const {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_contig(1);
    p.memh = staging_memh_;
    p.user_data = op;
    return p;
  }

  void Posted(std::unique_ptr<SlotOp> op, ucs_status_ptr_t r) {
    SlotOp* raw = op.release();
    if (UCS_PTR_IS_PTR(r)) {
      raw->request = r;
      in_ucx_.insert(raw);
      return;
    }
    raw->result = UCS_PTR_STATUS(r);
    ucx_finished_.push_back(raw);
  }

  // A gathered chunk goes out.
  void PostSend(std::unique_ptr<SlotOp> op) {
    Xfer* x = FindXfer(op->xfer);
    Conn* conn = x == nullptr ? nullptr : FindConn(x->peer);
    if (x == nullptr || !x->error.ok() || conn == nullptr || conn->ep == nullptr) {
      FreeSlot(op->slot);
      if (x != nullptr) FailXfer(x->id, absl::UnavailableError(absl::StrFormat("peer %s is gone", x->peer)));
      return;
    }
    ++x->outstanding;
    op->stage = SlotOp::Stage::kSend;
    ucp_request_param_t p = SlotParam(op.get());
    p.cb.send = &Impl::OnSlotSent;
    ucs_status_ptr_t r = ucp_tag_send_nbx(conn->ep, Slot(op->slot), static_cast<size_t>(ChunkBytes(*x, op->chunk)),
                                          StagedTag(x->tag, op->chunk), &p);
    Posted(std::move(op), r);
  }

  // Receives `a` into a free slot: as chunk `chunk` of receive `xfer`, or
  // to drop it (xfer 0). A message longer than a slot (only a misbehaving
  // peer sends one) is consumed with MESSAGE_TRUNCATED, which drops it.
  void PostReceive(const Arrived& a, uint64_t xfer, int64_t chunk) {
    const int slot = TakeSlot(/*send=*/false);
    auto op = std::make_unique<SlotOp>(SlotOp{.impl = this,
                                              .stage = xfer == 0 ? SlotOp::Stage::kDiscard : SlotOp::Stage::kRecv,
                                              .slot = slot,
                                              .xfer = xfer,
                                              .chunk = chunk});
    ucp_request_param_t p = SlotParam(op.get());
    p.cb.recv = &Impl::OnSlotReceived;
    ucs_status_ptr_t r =
        ucp_tag_msg_recv_nbx(worker_, Slot(slot), std::min(a.length, static_cast<size_t>(slot_bytes_)), a.msg, &p);
    Posted(std::move(op), r);
  }

  static void OnSlotSent(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SlotOp*>(user_data);
    op->result = status;
    op->request = nullptr;
    op->impl->in_ucx_.erase(op);
    op->impl->ucx_finished_.push_back(op);
    ucp_request_free(request);
  }

  static void OnSlotReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
    (void)info;
    OnSlotSent(request, status, user_data);
  }

  // Takes every message that arrived off the worker, then receives those a
  // slot is free for: into their Receive, or dropped (a dead tag, a bad
  // chunk, or unmatched for kUnmatchedGrace). True if anything happened.
  bool DispatchArrived() {
    bool busy = false;
    ucp_tag_recv_info_t info{};
    while (ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, 0, 0, /*remove=*/1, &info)) {
      arrived_.push_back(Arrived{msg, info.sender_tag, info.length, Clock::now()});
      busy = true;
    }
    const Clock::time_point now = Clock::now();
    for (auto it = arrived_.begin(); it != arrived_.end() && !free_slots_.empty();) {
      const uint64_t tag = it->tag >> kChunkBits;
      const int64_t chunk = static_cast<int64_t>(it->tag & kChunkMask);
      auto r = receiving_.find(tag);
      if (r == receiving_.end()) {
        auto dead = dead_tags_.find(tag);
        if ((dead != dead_tags_.end() && now < dead->second) || now - it->at >= kUnmatchedGrace || shutting_down_) {
          PostReceive(*it, 0, 0);
          it = arrived_.erase(it);
          busy = true;
        } else {
          ++it;
        }
        continue;
      }
      Xfer& x = *xfers_.at(r->second);
      absl::Status bad;
      if (chunk >= x.num_chunks || x.taken[static_cast<size_t>(chunk)]) {
        bad = absl::DataLossError(absl::StrFormat(
            "ucx_staged: chunk %d of tag %d came twice or does not exist (%d chunks)", chunk, tag, x.num_chunks));
      } else if (static_cast<int64_t>(it->length) != ChunkBytes(x, chunk)) {
        bad = absl::DataLossError(absl::StrFormat(
            "ucx_staged: chunk %d of tag %d has %d bytes, the receiver expects %d (the two sides' block lists differ)",
            chunk, tag, it->length, ChunkBytes(x, chunk)));
      }
      if (bad.ok()) {
        x.taken[static_cast<size_t>(chunk)] = true;
        PostReceive(*it, x.id, chunk);
      } else {
        PostReceive(*it, 0, 0);
        FailXfer(x.id, std::move(bad));
      }
      it = arrived_.erase(it);
      busy = true;
    }
    for (auto it = dead_tags_.begin(); it != dead_tags_.end();) {
      if (now >= it->second) {
        dead_tags_.erase(it++);
      } else {
        ++it;
      }
    }
    return busy;
  }

  // Sends and receives UCX completed: a sent slot is free, a received one
  // is scattered into the pool.
  bool HandleFinishedSlotOps() {
    if (ucx_finished_.empty()) return false;
    std::vector<SlotOp*> finished;
    finished.swap(ucx_finished_);
    for (SlotOp* raw : finished) {
      std::unique_ptr<SlotOp> op(raw);
      Xfer* x = FindXfer(op->xfer);
      if (op->stage == SlotOp::Stage::kSend) {
        if (op->slot >= 0) FreeSlot(op->slot);  // < 0: taken back already
        if (x == nullptr) continue;
        --x->outstanding;
        if (op->result == UCS_OK) {
          ++x->chunks_done;
        } else if (x->error.ok()) {
          x->error = UcxError(absl::StrFormat("ucx_staged: send to peer %s", x->peer), op->result);
        }
        dirty_.insert(x->id);
        continue;
      }
      if (op->stage == SlotOp::Stage::kDiscard || x == nullptr || !x->error.ok()) {
        FreeSlot(op->slot);
        continue;
      }
      if (op->result != UCS_OK) {
        FreeSlot(op->slot);
        FailXfer(x->id, UcxError(absl::StrFormat("ucx_staged: receive from peer %s", x->peer), op->result));
        continue;
      }
      const std::vector<CopyRun> runs =
          StagingRuns(x->Chunk(op->chunk), block_bytes_, StagingCopier::Direction::kFromStaging);
      absl::StatusOr<uint64_t> ticket =
          copier_->Start(StagingCopier::Direction::kFromStaging, pool_base_, Slot(op->slot), runs);
      if (!ticket.ok()) {
        FreeSlot(op->slot);
        FailXfer(x->id,
                 absl::InternalError(absl::StrCat("ucx_staged: copy from staging: ", ticket.status().message())));
        continue;
      }
      op->stage = SlotOp::Stage::kScatter;
      op->ticket = *ticket;
      copying_.push_back(std::move(op));
    }
    return true;
  }

  // Gathers that completed are sent; scatters that completed count.
  bool PollCopies() {
    bool busy = false;
    for (size_t i = 0; i < copying_.size();) {
      SlotOp& op = *copying_[i];
      absl::StatusOr<bool> done = copier_->Poll(op.ticket);
      if (done.ok() && !*done) {
        ++i;
        continue;
      }
      busy = true;
      std::unique_ptr<SlotOp> owned = std::move(copying_[i]);
      copying_[i] = std::move(copying_.back());
      copying_.pop_back();
      const bool gather = owned->stage == SlotOp::Stage::kGather;
      if (!done.ok()) {
        FreeSlot(owned->slot);
        FailXfer(owned->xfer, absl::InternalError(absl::StrCat("ucx_staged: copy ", gather ? "to" : "from",
                                                               " staging: ", done.status().message())));
      } else if (gather) {
        PostSend(std::move(owned));
      } else {
        FreeSlot(owned->slot);
        if (Xfer* x = FindXfer(owned->xfer); x != nullptr && x->error.ok()) {
          ++x->chunks_done;
          dirty_.insert(x->id);
        }
      }
    }
    return busy;
  }

  // Staged work each loop turn: messages in, copies polled, UCX
  // completions handled, sends that wait for a slot or a fence advanced,
  // and (every kLivenessPeriod) peers checked. True if anything happened.
  bool StagedProgress() {
    if (copier_ == nullptr) return false;
    bool busy = DispatchArrived();
    busy |= HandleFinishedSlotOps();
    busy |= PollCopies();
    const Clock::time_point now = Clock::now();
    const bool check = now >= next_liveness_check_;
    if (check) next_liveness_check_ = now + kLivenessPeriod;
    if (check) ReclaimSendSlots();
    std::vector<uint64_t> ids;
    for (const auto& [id, x] : xfers_) {
      const bool waiting_send =
          x->kind == Kind::kSend && x->next_chunk < x->num_chunks && (slot_freed_ || x->after != nullptr);
      if (waiting_send || (check && (x->kind == Kind::kSend || x->kind == Kind::kRecv))) ids.push_back(id);
    }
    slot_freed_ = false;
    for (uint64_t id : ids) {
      Xfer* x = FindXfer(id);
      if (x == nullptr) continue;
      if (check) {
        Conn* conn = FindConn(x->peer);
        absl::Status gone =
            conn == nullptr ? absl::UnavailableError(absl::StrFormat("peer %s was removed", x->peer)) : PeerGone(*conn);
        if (!gone.ok()) {
          Abort(*x, std::move(gone));
          continue;
        }
      }
      Advance(*x);
    }
    return busy;
  }

  // A send whose transfer ended and whose peer is gone (its process exited,
  // UCX lost it, or it was removed) may never complete in UCX (a rendezvous
  // to a dead peer survives even a forced endpoint close): its slot, which
  // UCX only reads, is taken back rather than lost for good.
  void ReclaimSendSlots() {
    for (SlotOp* op : in_ucx_) {
      if (op->stage != SlotOp::Stage::kSend || op->slot < 0 || FindXfer(op->xfer) != nullptr) continue;
      Conn* conn = FindConn(op->peer);
      if (conn != nullptr && PeerGone(*conn).ok()) continue;
      FreeSlot(op->slot);
      op->slot = -1;
    }
  }

  // Whether the loop should keep polling without sleeping: staged copies or
  // operations in flight, or a staged send under way.
  bool StagedActive() const {
    if (!copying_.empty() || !in_ucx_.empty() || !ucx_finished_.empty()) return true;
    for (const auto& [id, x] : xfers_) {
      if (x->kind != Kind::kRecv) return true;
    }
    return false;
  }

  void ShutdownUcx() {
    if (worker_ != nullptr) {
      std::vector<uint64_t> ids;
      for (const auto& [id, x] : xfers_) ids.push_back(id);
      for (uint64_t id : ids) Finish(*xfers_[id], absl::CancelledError("the transport was destroyed"));
      shutting_down_ = true;  // whatever arrives now is dropped
      const std::vector<SlotOp*> ops(in_ucx_.begin(), in_ucx_.end());
      for (SlotOp* op : ops) ucp_request_cancel(worker_, op->request);
      for (auto& [id, conn] : conns_) CloseEp(*conn);
      conns_.clear();
      const auto give_up = Clock::now() + std::chrono::seconds(2);
      while ((!closing_.empty() || !in_ucx_.empty() || !copying_.empty() || !arrived_.empty()) &&
             Clock::now() < give_up) {
        ucp_worker_progress(worker_);
        ReapClosedEndpoints();
        HandleFinishedSlotOps();
        PollCopies();
        if (copier_ != nullptr) DispatchArrived();
      }
      HandleFinishedSlotOps();
      // Endpoints UCX opened by itself (to answer a peer's connection) may
      // still hold a wireup reply; UCX 1.13 aborts on an assertion when a
      // worker is destroyed with one pending. Flush them out first.
      ucp_request_param_t flush_param{};
      ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_, &flush_param);
      if (UCS_PTR_IS_PTR(flush)) {
        while (ucp_request_check_status(flush) == UCS_INPROGRESS && Clock::now() < give_up) {
          ucp_worker_progress(worker_);
        }
        ucp_request_free(flush);
      }
      DeliverCompletions();
    }
    if (ctx_ != nullptr) {
      if (own_pool_memh_ && pool_memh_ != nullptr) ucp_mem_unmap(ctx_, pool_memh_);
      if (alloc_memh_ != nullptr) ucp_mem_unmap(ctx_, alloc_memh_);
      // Staging that UCX may still touch (an operation that did not end in
      // time) is left mapped rather than freed under it.
      if (staging_memh_ != nullptr && in_ucx_.empty()) {
        ucp_mem_unmap(ctx_, staging_memh_);
        if (copier_staging_ != nullptr && copying_.empty()) copier_->FreeStaging(copier_staging_);
      }
    }
    copying_.clear();
    // UCX 1.13 aborts the process on an assertion when a worker or context
    // goes with a request still registered on staging memory (a rendezvous
    // send to a peer that stopped answering survives even a forced
    // endpoint close): those few objects are leaked instead.
    const bool stuck = !in_ucx_.empty();
    if (stuck) {
      LOG(WARNING) << "ucx_staged: " << in_ucx_.size()
                   << " operation(s) still in UCX at shutdown; its worker and context are left allocated";
    }
    if (worker_ != nullptr && !stuck) ucp_worker_destroy(worker_);
    if (ctx_ != nullptr && !stuck) ucp_cleanup(ctx_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
    worker_ = nullptr;
    ctx_ = nullptr;
  }

  const UcxOptions options_;
  const std::string agent_id_;
  const bool peer_mode_;
  int event_fd_ = -1;
  std::thread thread_;

  mutable std::mutex mu_;
  std::deque<std::function<void()>> commands_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  PoolLayout layout_ ABSL_GUARDED_BY(mu_);
  PeerInfo info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_set<uint64_t> receive_tags_ ABSL_GUARDED_BY(mu_);  // staged receives in flight

  // Written by the progress thread before Start() returns, read-only after.
  std::string worker_address_;
  std::string boot_id_;
  std::string pid_ns_;

  // Progress thread only.
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int epoll_fd_ = -1;
  int worker_efd_ = -1;
  Clock::time_point last_busy_;
  ucp_mem_h alloc_memh_ = nullptr;
  uint8_t* alloc_base_ = nullptr;
  size_t alloc_len_ = 0;
  ucp_mem_h pool_memh_ = nullptr;
  bool own_pool_memh_ = false;
  uint8_t* pool_base_ = nullptr;
  int64_t block_bytes_ = 0;  // staged mode
  absl::flat_hash_map<std::string, std::unique_ptr<Conn>> conns_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Xfer>> xfers_;
  absl::flat_hash_set<uint64_t> dirty_;
  std::vector<ucp_ep_h> failed_eps_;
  std::vector<void*> closing_;
  std::vector<std::pair<TransferDone, absl::Status>> completions_;
  // Staged mode (progress thread only, but chunk_blocks_, read under mu_
  // once RegisterPool returned).
  std::unique_ptr<StagingCopier> copier_;
  ucp_mem_h staging_memh_ = nullptr;
  uint8_t* staging_base_ = nullptr;
  void* copier_staging_ = nullptr;  // what copier_->AllocateStaging gave, freed through it
  int64_t slot_bytes_ = 0;
  int64_t chunk_blocks_ = 0;
  std::vector<int> free_slots_;
  std::vector<bool> slot_sends_;  // per slot: held by a send (gather or send)
  int send_slots_ = 0;
  std::vector<std::unique_ptr<SlotOp>> copying_;  // gathers and scatters in flight
  absl::flat_hash_set<SlotOp*> in_ucx_;           // sends and receives UCX holds
  std::vector<SlotOp*> ucx_finished_;             // completed by UCX, not handled yet
  std::deque<Arrived> arrived_;
  absl::flat_hash_map<uint64_t, uint64_t> receiving_;           // tag -> staged receive in flight
  absl::flat_hash_map<uint64_t, Clock::time_point> dead_tags_;  // tag -> until when it is dropped
  bool slot_freed_ = false;
  bool shutting_down_ = false;
  Clock::time_point next_liveness_check_;
};

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  if (options.transports != "shm" && options.transports != "tcp" && options.transports != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("UCX transports \"%s\": want shm, tcp or auto", options.transports));
  }
  if (options.max_outstanding_ops <= 0 || options.max_transfer_time.count() <= 0) {
    return absl::InvalidArgumentError("UcxOptions: max_outstanding_ops and max_transfer_time > 0");
  }
  if (options.staged && (options.staging_slots < 2 || options.staging_slot_bytes < 1)) {
    return absl::InvalidArgumentError("UcxOptions: staging_slots must be >= 2 and staging_slot_bytes >= 1");
  }
  auto impl = std::make_unique<Impl>(options);
  RETURN_IF_ERROR(impl->Start());
  const std::string boot = HostBootId();
  const std::string domain = options.transports == "shm" && !boot.empty() ? "host:" + boot : "";
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(impl), domain, options.staged));
}

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl, std::string domain, bool staged)
    : impl_(std::move(impl)), domain_(std::move(domain)), staged_(staged) {}
UcxTransport::~UcxTransport() = default;

absl::Status UcxTransport::RegisterPool(const PoolLayout& layout, void* base) {
  return impl_->RegisterPool(layout, base);
}
absl::StatusOr<PeerInfo> UcxTransport::LocalInfo() const { return impl_->LocalInfo(); }
absl::Status UcxTransport::AddPeer(const PeerInfo& peer) { return impl_->AddPeer(peer); }
void UcxTransport::RemovePeer(const std::string& agent_id) { impl_->RemovePeer(agent_id); }
absl::StatusOr<uint64_t> UcxTransport::Push(const std::string& agent_id, std::vector<BlockPair> blocks,
                                            Deadline deadline, TransferDone done) {
  return impl_->Start(agent_id, std::move(blocks), deadline, std::move(done), /*push=*/true);
}
absl::StatusOr<uint64_t> UcxTransport::Pull(const std::string& agent_id, std::vector<BlockPair> blocks,
                                            Deadline deadline, TransferDone done) {
  return impl_->Start(agent_id, std::move(blocks), deadline, std::move(done), /*push=*/false);
}
void UcxTransport::Cancel(uint64_t transfer_id) { impl_->Cancel(transfer_id); }

absl::StatusOr<uint64_t> UcxTransport::PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                 std::shared_ptr<const WriteFence> after, uint64_t tag,
                                                 Deadline deadline, TransferDone done) {
  if (!staged_)
    return Transport::PushAfter(agent_id, std::move(blocks), std::move(after), tag, deadline, std::move(done));
  if (after == nullptr) return absl::InvalidArgumentError("PushAfter: no write fence");
  // A host fence is waited for here, as the default does (its Wait may
  // block); a GPU fence is polled by the progress thread.
  if (after->memory() == MemoryType::kHost) {
    if (!after->Completed()) RETURN_IF_ERROR(after->Wait(deadline));
    after = nullptr;
  }
  return impl_->StartStaged(agent_id, std::move(blocks), std::move(after), tag, deadline, std::move(done),
                            /*send=*/true);
}

absl::StatusOr<uint64_t> UcxTransport::Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                               Deadline deadline, TransferDone done) {
  if (!staged_) return Transport::Receive(agent_id, std::move(blocks), tag, deadline, std::move(done));
  return impl_->StartStaged(agent_id, std::move(blocks), nullptr, tag, deadline, std::move(done), /*send=*/false);
}
absl::StatusOr<void*> UcxTransport::AllocatePool(int64_t bytes) { return impl_->AllocatePool(bytes); }

std::string EncodePeerInfo(const PeerInfo& info) {
  Writer w;
  w.U32(kPeerInfoMagic);
  w.Bytes(info.agent_id);
  w.Bytes(info.backend);
  const PoolLayout& l = info.layout;
  w.Bytes(l.model);
  w.Bytes(l.dtype);
  w.U32(static_cast<uint32_t>(l.num_layers));
  w.U32(static_cast<uint32_t>(l.num_kv_heads));
  w.U32(static_cast<uint32_t>(l.head_dim));
  w.U32(static_cast<uint32_t>(l.block_size));
  w.U64(static_cast<uint64_t>(l.num_blocks));
  w.U64(static_cast<uint64_t>(l.block_bytes));
  w.U32(l.memory_type == MemoryType::kCuda ? 1 : 0);
  w.U32(static_cast<uint32_t>(l.device_id));
  w.Bytes(info.address);
  return w.Take();
}

absl::StatusOr<PeerInfo> DecodePeerInfo(std::string_view bytes) {
  Reader r(bytes);
  PeerInfo info;
  PoolLayout& l = info.layout;
  uint32_t magic = 0, layers, heads, head_dim, block_size, mem, device;
  uint64_t blocks, block_bytes;
  if (!r.U32(&magic) || magic != kPeerInfoMagic || !r.Bytes(&info.agent_id) || !r.Bytes(&info.backend) ||
      !r.Bytes(&l.model) || !r.Bytes(&l.dtype) || !r.U32(&layers) || !r.U32(&heads) || !r.U32(&head_dim) ||
      !r.U32(&block_size) || !r.U64(&blocks) || !r.U64(&block_bytes) || !r.U32(&mem) || !r.U32(&device) ||
      !r.Bytes(&info.address) || !r.done()) {
    return absl::InvalidArgumentError("malformed encoded PeerInfo");
  }
  l.num_layers = static_cast<int>(layers);
  l.num_kv_heads = static_cast<int>(heads);
  l.head_dim = static_cast<int>(head_dim);
  l.block_size = static_cast<int>(block_size);
  l.num_blocks = static_cast<int64_t>(blocks);
  l.block_bytes = static_cast<int64_t>(block_bytes);
  l.memory_type = mem == 1 ? MemoryType::kCuda : MemoryType::kHost;
  l.device_id = static_cast<int>(device);
  return info;
}

}  // namespace tandem::kvtransfer

// LeakSanitizer (sanitizer builds only; otherwise nothing calls this): UCX
// 1.13 leaks a few hundred bytes inside libuct/libucs when an endpoint to a
// peer that just died fails to connect over shared memory. Not ours to free.
extern "C" const char* __lsan_default_suppressions() { return "leak:libuct.so\nleak:libucs.so\n"; }
