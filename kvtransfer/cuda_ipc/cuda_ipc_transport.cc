#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/process_info.h"
#include "common/status_macros.h"
#include "kvtransfer/cuda_ipc/copy_runs.h"

namespace tandem::kvtransfer {
namespace {

constexpr absl::string_view kAddressVersion = "cuda_ipc/1";

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("cuda_ipc: ", what, ": ", cudaGetErrorString(e)));
}

// Whether this thread has a current CUDA context (the driver's
// cuCtxGetCurrent; true where it cannot be asked). A thread that never used
// CUDA reports device 0 all the same.
bool ThreadHasContext() {
  using GetCurrent = CUresult (*)(CUcontext*);
  static const GetCurrent get = []() -> GetCurrent {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<GetCurrent>(fn);
  }();
  CUcontext ctx = nullptr;
  return get == nullptr || get(&ctx) != CUDA_SUCCESS || ctx != nullptr;
}

// Makes `device` current on this thread for the guard's lifetime. Nothing
// is restored on a thread that had no context: setting its "device 0" back
// would create a context on GPU 0 (since CUDA 12), memory on another
// worker's GPU for a worker of cuda:1 called from a gRPC thread.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    const bool known = cudaGetDevice(&current) == cudaSuccess;
    if (known && current == device) return;  // already current: nothing to set or restore
    if (known && ThreadHasContext()) previous_ = current;
    cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// True where the writes behind `fence` (if any) are known to have completed;
// never blocks (a host fence's Wait may, whatever its deadline).
bool FenceDone(const WriteFence* fence) {
  if (fence == nullptr || fence->Completed()) return true;
  if (fence->memory() == MemoryType::kCuda && fence->cuda_event() != nullptr) {
    return cudaEventQuery(static_cast<cudaEvent_t>(fence->cuda_event())) == cudaSuccess;
  }
  return false;
}

// This process, among the processes of one host (pids repeat across
// containers): drawn once.
const std::string& ProcessToken() {
  static const std::string token = [] {
    std::random_device rd;
    return absl::StrFormat("%08x%08x%08x", rd(), rd(), rd());
  }();
  return token;
}

std::string Hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) absl::StrAppendFormat(&out, "%02x", c);
  return out;
}

bool Unhex(absl::string_view hex, std::string* bytes) {
  if (hex.size() % 2 != 0) return false;
  bytes->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[i + k];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    bytes->push_back(static_cast<char>(v));
  }
  return true;
}

// The start and size of the allocation holding `p` (the driver's
// cuMemGetAddressRange).
absl::StatusOr<std::pair<CUdeviceptr, size_t>> AllocationRange(const void* p) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetRange get = []() -> GetRange {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get == nullptr) return absl::InternalError("cuda_ipc: the driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (get(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("cuda_ipc: the KV pool is not device memory of this process");
  }
  return std::pair{base, size};
}

}  // namespace

std::string EncodeCudaIpcAddress(const CudaIpcAddress& a) {
  return absl::StrCat(kAddressVersion, ";handle=", Hex(a.handle), ";offset=", a.offset, ";pointer=", a.pointer,
                      ";bus=", a.pci_bus_id, ";boot=", a.boot_id, ";process=", a.process, ";pid=", a.pid,
                      ";pidns=", a.pid_namespace, ";start=", a.start_time);
}

absl::StatusOr<CudaIpcAddress> DecodeCudaIpcAddress(const std::string& text) {
  std::vector<absl::string_view> parts = absl::StrSplit(absl::string_view(text), ';');
  if (parts.empty() || parts[0] != kAddressVersion) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: the peer's address is not a ", kAddressVersion,
                                                   " address: '", text.substr(0, 40), "'"));
  }
  CudaIpcAddress a;
  bool have_handle = false, have_pointer = false, have_pid = false, have_offset = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    if (eq == absl::string_view::npos)
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: bad field '", parts[i], "'"));
    const absl::string_view key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
    bool ok = true;
    if (key == "handle") {
      ok = Unhex(value, &a.handle) && a.handle.size() == sizeof(cudaIpcMemHandle_t);
      have_handle = ok;
    } else if (key == "offset") {
      ok = absl::SimpleAtoi(value, &a.offset) && a.offset >= 0;
      have_offset = ok;
    } else if (key == "pointer") {
      ok = absl::SimpleAtoi(value, &a.pointer);
      have_pointer = ok;
    } else if (key == "bus") {
      a.pci_bus_id = std::string(value);
    } else if (key == "boot") {
      a.boot_id = std::string(value);
    } else if (key == "process") {
      a.process = std::string(value);
    } else if (key == "pid") {
      ok = absl::SimpleAtoi(value, &a.pid) && a.pid > 0;
      have_pid = ok;
    } else if (key == "pidns") {
      a.pid_namespace = std::string(value);
    } else if (key == "start") {
      ok = absl::SimpleAtoi(value, &a.start_time);
    }  // unknown keys: a newer peer's additions
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: bad value of '", key, "' in the peer's address"));
  }
  if (!have_handle || !have_offset || !have_pointer || !have_pid || a.pci_bus_id.empty() || a.process.empty()) {
    return absl::InvalidArgumentError(
        "cuda_ipc: the peer's address lacks its handle, offset, pointer, process, pid or bus id");
  }
  return a;
}

CudaIpcTransport::Mapping::~Mapping() {
  if (opened != nullptr) {
    DeviceGuard guard(device);
    cudaIpcCloseMemHandle(opened);
  }
}

absl::StatusOr<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::Create(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("cuda_ipc: no CUDA device");
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrFormat("cuda_ipc: device %d of %d", device, count));
  }
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  if (absl::Status st = Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"); !st.ok()) return st;
  std::vector<Slot> slots(kMaxInFlight);
  for (Slot& s : slots) {
    cudaEvent_t event = nullptr;
    if (absl::Status st = Cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event"); !st.ok()) {
      for (Slot& made : slots) {
        if (made.event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(made.event));
      }
      cudaStreamDestroy(stream);
      return st;
    }
    s.event = event;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 16;
  }
  return std::unique_ptr<CudaIpcTransport>(new CudaIpcTransport(device, stream, std::move(slots), 4 * sms));
}

CudaIpcTransport::CudaIpcTransport(int device, void* stream, std::vector<Slot> slots, int max_ctas)
    : device_(device),
      stream_(stream),
      agent_id_(NewAgentId("cuda_ipc")),
      max_ctas_(max_ctas),
      slots_(std::move(slots)) {
  for (Slot& s : slots_) free_slots_.push_back(&s);
  thread_ = std::thread([this] { CopyLoop(); });
}

CudaIpcTransport::~CudaIpcTransport() {
  std::deque<Transfer> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    pending.swap(queue_);
  }
  cv_.notify_all();
  thread_.join();
  DeviceGuard guard(device_);
  for (Transfer& t : pending) t.done(absl::CancelledError("the transport was destroyed"));
  // A caller's transfer issued while the copy thread was ending (Start
  // checked stop_ before it was set): waited for, then ended here.
  std::deque<Flying> flying;
  std::deque<std::pair<Transfer, absl::Status>> failed;
  {
    std::lock_guard<std::mutex> issuing(issue_mu_);
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    std::lock_guard<std::mutex> lock(mu_);
    flying.swap(flying_);
    failed.swap(failed_);
  }
  for (Flying& f : flying) f.t.done(absl::CancelledError("the transport was destroyed"));
  for (auto& [t, status] : failed) t.done(status);
  peers_.clear();
  for (Slot& s : slots_) {
    if (s.chunks_host != nullptr) cudaFreeHost(s.chunks_host);
    cudaEventDestroy(static_cast<cudaEvent_t>(s.event));
  }
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status CudaIpcTransport::RegisterPool(const PoolLayout& layout, void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ != nullptr) return absl::FailedPreconditionError("a KV pool is already registered");
  if (base == nullptr || layout.block_bytes <= 0 || layout.num_blocks <= 0) {
    return absl::InvalidArgumentError("RegisterPool: empty pool");
  }
  if (layout.memory_type != MemoryType::kCuda) {
    return absl::InvalidArgumentError("cuda_ipc moves GPU memory: the KV pool is in host memory");
  }
  DeviceGuard guard(device_);
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, base) != cudaSuccess || attr.type != cudaMemoryTypeDevice ||
      attr.device != device_) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc: the KV pool is not device memory of GPU %d (the transport's)", device_));
  }
  absl::StatusOr<std::pair<CUdeviceptr, size_t>> range = AllocationRange(base);
  if (!range.ok()) return range.status();
  const CUdeviceptr alloc = range->first;
  CudaIpcAddress a;
  cudaIpcMemHandle_t handle;
  if (absl::Status st = Cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc)), "cudaIpcGetMemHandle");
      !st.ok()) {
    return st;
  }
  a.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  a.offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(base) - alloc);
  a.pointer = reinterpret_cast<uint64_t>(base);
  char bus[32] = {};
  if (absl::Status st = Cuda(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId"); !st.ok()) {
    return st;
  }
  a.pci_bus_id = bus;
  a.boot_id = HostBootId();
  a.process = ProcessToken();
  a.pid = getpid();
  a.pid_namespace = PidNamespace();
  a.start_time = OwnStartTime();
  layout_ = layout;
  layout_.device_id = device_;
  base_ = static_cast<unsigned char*>(base);
  address_ = EncodeCudaIpcAddress(a);
  return absl::OkStatus();
}

absl::StatusOr<PeerInfo> CudaIpcTransport::LocalInfo() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ == nullptr) return absl::FailedPreconditionError("no KV pool registered");
  return PeerInfo{.agent_id = agent_id_, .backend = "cuda_ipc", .layout = layout_, .address = address_};
}

absl::Status CudaIpcTransport::AddPeer(const PeerInfo& peer) {
  if (peer.backend != "cuda_ipc") {
    return absl::InvalidArgumentError(absl::StrFormat("peer %s speaks %s, not cuda_ipc", peer.agent_id, peer.backend));
  }
  absl::StatusOr<CudaIpcAddress> a = DecodeCudaIpcAddress(peer.address);
  if (!a.ok()) return a.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (base_ == nullptr) return absl::FailedPreconditionError("no KV pool registered");
    if (absl::Status st = CheckCompatible(layout_, peer.layout); !st.ok()) return st;
  }
  const std::string boot = HostBootId();
  if (a->boot_id != boot) {
    return absl::FailedPreconditionError(
        absl::StrFormat("cuda_ipc reaches GPUs of this host only: peer %s runs on another host (boot id %s, here %s)",
                        peer.agent_id, a->boot_id, boot));
  }
  DeviceGuard guard(device_);
  int peer_device = -1;
  if (absl::Status st = Cuda(cudaDeviceGetByPCIBusId(&peer_device, a->pci_bus_id.c_str()), "the peer's GPU");
      !st.ok()) {
    return absl::FailedPreconditionError(absl::StrFormat("cuda_ipc: peer %s's GPU %s is not visible here: %s",
                                                         peer.agent_id, a->pci_bus_id, st.message()));
  }
  if (peer_device != device_) {
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device_, peer_device);
    if (can == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "cuda_ipc: GPU %d cannot reach peer %s's GPU %d (no peer access)", device_, peer.agent_id, peer_device));
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, OpenMapping(*a, peer.agent_id, peer.layout, peer_device));
  // Watched: a process of this pid namespace (pids mean the same here), as
  // this process sees it now (a /proc of another namespace, or one that
  // hides other users' processes, makes it unwatched).
  const bool watch = a->process != ProcessToken() && !a->pid_namespace.empty() && a->pid_namespace == PidNamespace() &&
                     a->start_time != 0 && ProcessStartTime(a->pid) == std::optional<uint64_t>(a->start_time);
  std::lock_guard<std::mutex> lock(mu_);
  // An old mapping closes with its last transfer.
  peers_[peer.agent_id] = Peer{.layout = peer.layout,
                               .mapping = std::move(mapping),
                               .address = *a,
                               .device = peer_device,
                               .pid = a->pid,
                               .start_time = watch ? a->start_time : 0,
                               .last_used = std::chrono::steady_clock::now()};
  exited_.erase(peer.agent_id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<CudaIpcTransport::Mapping>> CudaIpcTransport::OpenMapping(const CudaIpcAddress& a,
                                                                                         const std::string& agent_id,
                                                                                         const PoolLayout& layout,
                                                                                         int peer_device) {
  DeviceGuard guard(device_);
  auto mapping = std::make_shared<Mapping>();
  mapping->device = device_;
  if (a.process == ProcessToken()) {
    mapping->base = reinterpret_cast<unsigned char*>(a.pointer);  // a transport of this process
    if (peer_device != device_) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) return Cuda(e, "peer access");
      cudaGetLastError();
    }
    return mapping;
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, a.handle.data(), sizeof(handle));
  void* opened = nullptr;
  if (absl::Status st = Cuda(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess),
                             "cudaIpcOpenMemHandle of the peer's pool");
      !st.ok()) {
    return absl::UnavailableError(absl::StrCat("cuda_ipc: peer ", agent_id, ": ", st.message()));
  }
  mapping->opened = opened;
  mapping->base = static_cast<unsigned char*>(opened) + a.offset;
  // The pool the peer claims must lie within what its handle maps: a copy
  // past it would fault and take this process's CUDA context with it.
  absl::StatusOr<std::pair<CUdeviceptr, size_t>> range = AllocationRange(opened);
  if (!range.ok()) return range.status();
  const uint64_t end = uint64_t(a.offset) + uint64_t(layout.num_blocks) * uint64_t(layout.block_bytes);
  if (range->first != reinterpret_cast<CUdeviceptr>(opened) || end > range->second) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda_ipc: peer %s claims a pool of %d blocks of %d bytes at offset %d, past its %d-byte allocation", agent_id,
        layout.num_blocks, layout.block_bytes, a.offset, range->second));
  }
  return mapping;
}

void CudaIpcTransport::RemovePeer(const std::string& agent_id) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.erase(agent_id);
}

absl::StatusOr<uint64_t> CudaIpcTransport::Push(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                Deadline deadline, TransferDone done) {
  return Start(agent_id, std::move(blocks), nullptr, deadline, std::move(done), /*push=*/true);
}

absl::StatusOr<uint64_t> CudaIpcTransport::Pull(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                Deadline deadline, TransferDone done) {
  return Start(agent_id, std::move(blocks), nullptr, deadline, std::move(done), /*push=*/false);
}

absl::StatusOr<uint64_t> CudaIpcTransport::PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                     std::shared_ptr<const WriteFence> after, uint64_t tag,
                                                     Deadline deadline, TransferDone done) {
  (void)tag;
  if (after == nullptr) return absl::InvalidArgumentError("PushAfter: no write fence");
  return Start(agent_id, std::move(blocks), std::move(after), deadline, std::move(done), /*push=*/true);
}

absl::StatusOr<uint64_t> CudaIpcTransport::Start(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                 std::shared_ptr<const WriteFence> after, Deadline deadline,
                                                 TransferDone done, bool push) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return absl::CancelledError("the transport is being destroyed");
  if (base_ == nullptr) return absl::FailedPreconditionError("no KV pool registered");
  auto peer = peers_.find(agent_id);
  if (peer == peers_.end()) {
    if (exited_.contains(agent_id)) return ExitedError(agent_id);
    return absl::NotFoundError(absl::StrFormat("unknown KV transfer peer %s", agent_id));
  }
  if (peer->second.mapping == nullptr) {
    // Closed for idleness: reopened (outside the lock: the driver call
    // takes a while), unless someone else did meanwhile.
    const Peer closed = peer->second;
    lock.unlock();
    absl::StatusOr<std::shared_ptr<Mapping>> reopened =
        OpenMapping(closed.address, agent_id, closed.layout, closed.device);
    lock.lock();
    if (!reopened.ok()) return reopened.status();
    peer = peers_.find(agent_id);
    if (peer == peers_.end()) return absl::UnavailableError(absl::StrFormat("peer %s is gone", agent_id));
    if (peer->second.mapping == nullptr) peer->second.mapping = *std::move(reopened);
  }
  peer->second.last_used = std::chrono::steady_clock::now();
  const int64_t local_blocks = layout_.num_blocks, remote_blocks = peer->second.layout.num_blocks;
  absl::StatusOr<std::vector<CopyRun>> runs =
      PlanRuns(blocks, layout_.block_bytes, push ? local_blocks : remote_blocks, push ? remote_blocks : local_blocks);
  if (!runs.ok()) return runs.status();
  const uint64_t id = next_id_++;
  Transfer t{.id = id,
             .peer = agent_id,
             .push = push,
             .runs = std::move(*runs),
             .mapping = peer->second.mapping,
             .after = std::move(after),
             .deadline = deadline,
             .done = std::move(done)};
  // Nothing to wait for, nothing queued before it (nor taken from the queue
  // and not yet issued: transfers start in Start's order), a slot free, time
  // left: issued on this thread, without the copy thread's wake-up (a transfer's
  // fixed cost at 16 MiB was ~30 us against ~20 us of copying). A passed
  // deadline goes the copy thread's way, which moves nothing.
  if (!queue_.empty() || draining_queue_ || free_slots_.empty() || std::chrono::steady_clock::now() >= deadline ||
      !FenceDone(t.after.get())) {
    queue_.push_back(std::move(t));
    lock.unlock();
    cv_.notify_one();
    return id;
  }
  Slot* slot = free_slots_.back();
  free_slots_.pop_back();
  in_flight_.insert(id);
  lock.unlock();
  DeviceGuard guard(device_);
  Launch(std::move(t), slot);
  return id;
}

void CudaIpcTransport::Cancel(uint64_t transfer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  // Only a transfer queued or running (ids of ended ones would pile up).
  const bool live = in_flight_.contains(transfer_id) ||
                    std::any_of(queue_.begin(), queue_.end(), [&](const Transfer& t) { return t.id == transfer_id; });
  if (live) cancelled_[transfer_id] = true;
}

absl::Status CudaIpcTransport::CheckLive(const Transfer& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.contains(t.id)) return absl::CancelledError("transfer cancelled");
  auto peer = peers_.find(t.peer);
  if (peer == peers_.end() || peer->second.mapping != t.mapping) {
    if (exited_.contains(t.peer)) return ExitedError(t.peer);
    return absl::UnavailableError(absl::StrFormat("peer %s is gone", t.peer));
  }
  if (std::chrono::steady_clock::now() > t.deadline) return absl::DeadlineExceededError("KV transfer deadline passed");
  return absl::OkStatus();
}

absl::Status CudaIpcTransport::WaitFence(const Transfer& t) {
  // What stops it before anything is issued: cancelled, the peer gone, late.
  RETURN_IF_ERROR(CheckLive(t));
  if (t.after != nullptr) {
    if (t.after->memory() == MemoryType::kCuda && t.after->cuda_event() != nullptr) {
      // Polled, not queued on the stream: writes that never finish must not
      // hold this transfer (or the ones behind it) past its deadline.
      auto fence = static_cast<cudaEvent_t>(t.after->cuda_event());
      while (true) {
        const cudaError_t q = cudaEventQuery(fence);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) return Cuda(q, "the blocks' writes");
        RETURN_IF_ERROR(CheckLive(t));
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (stop_) return absl::CancelledError("the transport was destroyed");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    } else {
      RETURN_IF_ERROR(t.after->Wait(t.deadline));
    }
    RETURN_IF_ERROR(CheckLive(t));
  }
  return absl::OkStatus();
}

void CudaIpcTransport::Launch(Transfer t, Slot* slot) {
  auto stream = static_cast<cudaStream_t>(stream_);
  std::lock_guard<std::mutex> issuing(issue_mu_);
  unsigned char* local = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    local = base_;
  }
  absl::Status st = IssueCopies(t, local, *slot);
  if (st.ok()) st = Cuda(cudaEventRecord(static_cast<cudaEvent_t>(slot->event), stream), "record");
  if (!st.ok()) cudaStreamSynchronize(stream);  // what was issued lands before done
  {
    // Still under issue_mu_: flying_ keeps the stream's order.
    std::lock_guard<std::mutex> lock(mu_);
    if (st.ok()) {
      flying_.push_back(Flying{std::move(t), slot, std::chrono::steady_clock::now()});
    } else {
      free_slots_.push_back(slot);
      failed_.emplace_back(std::move(t), std::move(st));
    }
  }
  cv_.notify_one();
}

absl::Status CudaIpcTransport::IssueCopies(const Transfer& t, unsigned char* local, Slot& slot) {
  auto stream = static_cast<cudaStream_t>(stream_);
  auto ends = [&](const CopyRun& run) {
    unsigned char* dst = t.push ? t.mapping->base + run.dst_offset : local + run.dst_offset;
    const unsigned char* src = t.push ? local + run.src_offset : t.mapping->base + run.src_offset;
    return std::pair{src, dst};
  };
  std::vector<cuda_ipc::CopySpan> spans;
  for (const CopyRun& run : t.runs) {
    const auto [src, dst] = ends(run);
    spans.push_back({reinterpret_cast<uint64_t>(src), reinterpret_cast<uint64_t>(dst), run.bytes});
  }
  std::vector<cuda_ipc::CopyChunk> chunks;
  const bool aligned = cuda_ipc::ChunksOf(spans, max_ctas_, &chunks);
  auto copy_each_run = [&]() -> absl::Status {
    for (const CopyRun& run : t.runs) {
      const auto [src, dst] = ends(run);
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(run.bytes), cudaMemcpyDefault, stream), "copy"));
    }
    return absl::OkStatus();
  };
  if (!aligned || !kernel_ok_) return copy_each_run();
  if (chunks.empty()) return absl::OkStatus();
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n > slot.capacity) {
    // The slot is free: its last transfer completed.
    const int64_t capacity = std::max<int64_t>(n, 2 * slot.capacity);
    if (slot.chunks_host != nullptr) cudaFreeHost(slot.chunks_host);
    slot.chunks_host = slot.chunks_device = nullptr;
    slot.capacity = 0;
    const size_t bytes = static_cast<size_t>(capacity) * sizeof(cuda_ipc::CopyChunk);
    RETURN_IF_ERROR(Cuda(cudaHostAlloc(&slot.chunks_host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                         "the copy descriptors"));
    RETURN_IF_ERROR(Cuda(cudaHostGetDevicePointer(&slot.chunks_device, slot.chunks_host, 0), "the copy descriptors"));
    slot.capacity = capacity;
  }
  // The kernel reads them from host memory, once a CTA each: no upload.
  std::memcpy(slot.chunks_host, chunks.data(), chunks.size() * sizeof(cuda_ipc::CopyChunk));
  cudaGetLastError();  // an earlier call's error is not the launch's
  const cudaError_t launched = cuda_ipc::LaunchCopyChunks(static_cast<const cuda_ipc::CopyChunk*>(slot.chunks_device),
                                                          static_cast<int>(n), max_ctas_, stream);
  if (launched == cudaErrorNoKernelImageForDevice || launched == cudaErrorInvalidDeviceFunction) {
    // Built for Hopper (sm_90a) only: another GPU copies run by run.
    LOG(WARNING) << "cuda_ipc: the copy kernel does not run on GPU " << device_ << " (" << cudaGetErrorString(launched)
                 << "): copying a cudaMemcpyAsync a run";
    kernel_ok_ = false;
    return copy_each_run();
  }
  return Cuda(launched, "the copy kernel");
}

absl::Status CudaIpcTransport::ExitedError(const std::string& agent_id) const {
  return absl::UnavailableError(absl::StrFormat(
      "KV transfer peer %s: its process (pid %d) exited, and its pool was let go", agent_id, exited_.at(agent_id)));
}

void CudaIpcTransport::SweepPeers() {
  struct Watched {
    std::string agent;
    int64_t pid;
    uint64_t start;
    std::shared_ptr<Mapping> mapping;
  };
  std::vector<Watched> watched;
  std::vector<std::shared_ptr<Mapping>> idle;  // closed here, outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (auto& [agent, peer] : peers_) {
      if (peer.start_time != 0) {
        watched.push_back({agent, peer.pid, peer.start_time, peer.mapping});
      } else if (peer.mapping != nullptr && peer.mapping->opened != nullptr && peer.mapping.use_count() == 1 &&
                 now - peer.last_used > kIdleClose) {
        // Unwatched and unused: let its memory go should the peer be dead.
        idle.push_back(std::move(peer.mapping));
      }
    }
  }
  idle.clear();
  std::vector<Watched> dead;
  for (Watched& w : watched) {
    // Gone, or its pid reused by another process; unknown is not dead.
    const std::optional<uint64_t> now = ProcessStartTime(w.pid);
    if (now.has_value() && *now != w.start) dead.push_back(std::move(w));
  }
  if (dead.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (exited_.size() > 4096) exited_.clear();  // only for the error's wording
  for (const Watched& w : dead) {
    auto it = peers_.find(w.agent);
    if (it == peers_.end() || it->second.mapping != w.mapping) continue;  // removed or re-added meanwhile
    peers_.erase(it);
    exited_[w.agent] = w.pid;
    LOG(WARNING) << "cuda_ipc: KV transfer peer " << w.agent << " (pid " << w.pid
                 << ") exited: its pool is unmapped once its transfers end";
  }
}

void CudaIpcTransport::CopyLoop() {
  cudaSetDevice(device_);
  constexpr auto kSweepEvery = std::chrono::seconds(1);
  auto last_sweep = std::chrono::steady_clock::now();
  // Ends `t`: its id forgotten, its mapping let go (the last transfer of a
  // removed peer closes it), `done` called.
  auto finish = [this](Transfer& t, const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_.erase(t.id);
      in_flight_.erase(t.id);
    }
    t.mapping.reset();
    t.done(status);
  };
  while (true) {
    std::optional<Transfer> next;
    Slot* slot = nullptr;
    std::deque<std::pair<Transfer, absl::Status>> failed;
    bool stopping = false, idle = false;
    void* oldest = nullptr;  // the oldest issued transfer's event
    std::chrono::steady_clock::time_point issued;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Nothing in flight: sleep until work comes (or the sweep is due).
      if (flying_.empty() && failed_.empty()) {
        cv_.wait_for(lock, kSweepEvery, [&] {
          return stop_ || (!queue_.empty() && !free_slots_.empty()) || !flying_.empty() || !failed_.empty();
        });
      }
      stopping = stop_;
      failed.swap(failed_);
      if (!stopping && !queue_.empty() && !free_slots_.empty()) {
        next = std::move(queue_.front());
        queue_.pop_front();
        slot = free_slots_.back();
        free_slots_.pop_back();
        in_flight_.insert(next->id);
        draining_queue_ = true;
      }
      idle = flying_.empty();
      if (!idle) {
        oldest = flying_.front().slot->event;
        issued = flying_.front().issued;
      }
    }
    for (auto& [t, status] : failed) finish(t, status);
    if (stopping && idle && !next.has_value()) return;  // the queue's transfers end in the destructor
    if (std::chrono::steady_clock::now() - last_sweep >= kSweepEvery) {
      SweepPeers();
      last_sweep = std::chrono::steady_clock::now();
    }
    if (next.has_value()) {
      if (absl::Status st = WaitFence(*next); !st.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          free_slots_.push_back(slot);
          draining_queue_ = false;
        }
        finish(*next, st);
      } else {
        Launch(std::move(*next), slot);
        std::lock_guard<std::mutex> lock(mu_);
        draining_queue_ = false;
      }
      continue;  // more to issue before polling
    }
    if (idle) continue;
    // Poll the oldest: the copies cannot be recalled, so whatever happens
    // meanwhile is reported once they completed. Yielding between polls for
    // the first 2 ms (a 4k-token prompt's copy takes 0.5 ms on one GPU, 1.6
    // ms across NVLink; a 20 us sleep oversleeps by tens of microseconds,
    // which cost 40% at 128 MiB on an H100), then sleeping between polls.
    // Only this thread takes from flying_, so its front stays the same.
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(oldest));
    if (q == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - issued < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      continue;
    }
    if (q != cudaSuccess) {
      std::lock_guard<std::mutex> issuing(issue_mu_);
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));  // nothing of it may land after done
    }
    Flying done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done = std::move(flying_.front());
      flying_.pop_front();
      free_slots_.push_back(done.slot);
    }
    finish(done.t, q != cudaSuccess ? Cuda(q, "the copies") : CheckLive(done.t));
  }
}

}  // namespace tandem::kvtransfer
