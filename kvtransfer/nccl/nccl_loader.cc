// LoadNccl (nccl_api.h): the real NCCL, dlopen'd, over the CUDA runtime's
// streams and events. Built where nccl.h is (the CUDA toolkit's); elsewhere
// LoadNccl says so.
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kvtransfer/nccl/nccl_api.h"

#ifdef TANDEM_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "kvtransfer/cuda_ipc/copy_runs.h"
#endif

namespace tandem::kvtransfer {

#ifdef TANDEM_HAVE_NCCL
namespace {

struct Syms {
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  const char* (*GetErrorString)(ncclResult_t);
};

class RealNccl final : public NcclApi {
 public:
  explicit RealNccl(Syms s) : s_(s) {}

  absl::StatusOr<std::string> UniqueId() override {
    ncclUniqueId id;
    if (ncclResult_t r = s_.GetUniqueId(&id); r != ncclSuccess) return Error("ncclGetUniqueId", r);
    return std::string(id.internal, sizeof(id.internal));
  }

  absl::StatusOr<void*> InitRank(std::string_view unique_id, int rank, int device) override {
    if (unique_id.size() != kUniqueIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("NCCL unique id of %d bytes, want %d", unique_id.size(), kUniqueIdBytes));
    }
    if (rank != 0 && rank != 1) return absl::InvalidArgumentError(absl::StrFormat("NCCL rank %d of 2", rank));
    if (cudaSetDevice(device) != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrFormat("NCCL on GPU %d: no such device", device));
    }
    auto comm = std::make_unique<Comm>();
    comm->rank = rank;
    comm->device = device;
    if (cudaStreamCreateWithFlags(&comm->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&comm->copy_stream, cudaStreamNonBlocking) != cudaSuccess) {
      cudaGetLastError();
      if (comm->stream != nullptr) cudaStreamDestroy(comm->stream);
      return absl::InternalError("cudaStreamCreate for NCCL failed");
    }
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), kUniqueIdBytes);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; Ready and Done poll
    const ncclResult_t r = s_.CommInitRankConfig(&comm->comm, 2, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      cudaStreamDestroy(comm->stream);
      cudaStreamDestroy(comm->copy_stream);
      return Error("ncclCommInitRankConfig", r);
    }
    return static_cast<void*>(comm.release());
  }

  absl::StatusOr<bool> Ready(void* handle) override {
    Comm& c = *static_cast<Comm*>(handle);
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = s_.CommGetAsyncError(c.comm, &state); r != ncclSuccess) {
      return Error("ncclCommGetAsyncError", r);
    }
    if (state == ncclInProgress) return false;
    if (state != ncclSuccess) return Error("the NCCL communicator", state);
    return true;
  }

  absl::StatusOr<uint64_t> Group(void* handle, bool send, std::span<const Buffer> buffers, uint64_t after) override {
    Comm& c = *static_cast<Comm*>(handle);
    cudaSetDevice(c.device);
    ASSIGN_OR_RETURN(cudaEvent_t wait, EventOf(handle, after));
    if (wait != nullptr && cudaStreamWaitEvent(c.stream, wait, 0) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("ordering an NCCL group after its copies failed");
    }
    if (ncclResult_t r = s_.GroupStart(); r != ncclSuccess) return Error("ncclGroupStart", r);
    const int peer = 1 - c.rank;
    for (const Buffer& b : buffers) {
      const ncclResult_t r = send ? s_.Send(b.data, static_cast<size_t>(b.bytes), ncclInt8, peer, c.comm, c.stream)
                                  : s_.Recv(b.data, static_cast<size_t>(b.bytes), ncclInt8, peer, c.comm, c.stream);
      if (r != ncclSuccess && r != ncclInProgress) {
        s_.GroupEnd();
        return Error(send ? "ncclSend" : "ncclRecv", r);
      }
    }
    const ncclResult_t r = s_.GroupEnd();
    if (r != ncclSuccess && r != ncclInProgress) return Error("ncclGroupEnd", r);
    // A non-blocking communicator may still be enqueueing the group (its
    // first use of a peer connects to it, which needs the peer's group):
    // Done records the completion event once the state says enqueued.
    c.events[++c.next_ticket] = nullptr;
    if (r == ncclSuccess) {
      if (absl::Status st = Record(c, c.next_ticket); !st.ok()) return st;
    }
    return c.next_ticket;
  }

  // One kernel of the copies' chunks (cuda_ipc's), on the copy stream; the
  // chunk list goes up first into a device buffer of the comm's, which the
  // copy stream's order keeps from the next call until this kernel read it.
  absl::StatusOr<uint64_t> Copies(void* handle, std::span<const Copy> copies, uint64_t after) override {
    Comm& c = *static_cast<Comm*>(handle);
    cudaSetDevice(c.device);
    std::vector<cuda_ipc::CopySpan> spans;
    for (const Copy& cp : copies) {
      spans.push_back({reinterpret_cast<uint64_t>(cp.src), reinterpret_cast<uint64_t>(cp.dst), cp.bytes});
    }
    std::vector<cuda_ipc::CopyChunk> chunks;
    if (!cuda_ipc::ChunksOf(spans, kCopyCtas, &chunks)) {
      return absl::InvalidArgumentError("a staged NCCL copy not of 16-byte multiples");
    }
    auto fail = [](const char* what) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("a staged NCCL copy: ", what));
    };
    ASSIGN_OR_RETURN(cudaEvent_t wait, EventOf(handle, after));
    if (wait != nullptr && cudaStreamWaitEvent(c.copy_stream, wait, 0) != cudaSuccess) {
      return fail("ordering after the group");
    }
    const int64_t bytes = static_cast<int64_t>(chunks.size() * sizeof(cuda_ipc::CopyChunk));
    if (bytes > c.chunk_bytes) {
      if (c.chunks != nullptr) cudaFreeAsync(c.chunks, c.copy_stream);
      c.chunks = nullptr;
      c.chunk_bytes = 0;
      if (cudaMallocAsync(&c.chunks, static_cast<size_t>(bytes) * 2, c.copy_stream) != cudaSuccess) {
        c.chunks = nullptr;
        return fail("cudaMallocAsync of its chunk list");
      }
      c.chunk_bytes = bytes * 2;
    }
    if (!chunks.empty()) {
      if (cudaMemcpyAsync(c.chunks, chunks.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice, c.copy_stream) !=
          cudaSuccess) {
        return fail("uploading its chunk list");
      }
      if (cuda_ipc::LaunchCopyChunks(static_cast<const cuda_ipc::CopyChunk*>(c.chunks), static_cast<int>(chunks.size()),
                                     kCopyCtas, c.copy_stream) != cudaSuccess) {
        return fail("the copy kernel's launch");
      }
    }
    RETURN_IF_ERROR(Record(c, ++c.next_ticket, c.copy_stream));
    return c.next_ticket;
  }

  // The completion event of `ticket` to wait for: null where there is
  // nothing to wait for (0, or a ticket Done already). A group still being
  // enqueued (a non-blocking communicator's GroupEnd said in progress) has
  // no event yet: waits here, briefly, for the communicator to settle (a
  // staged transfer orders its copies right after its groups).
  absl::StatusOr<cudaEvent_t> EventOf(void* handle, uint64_t ticket) {
    Comm& c = *static_cast<Comm*>(handle);
    auto it = ticket != 0 ? c.events.find(ticket) : c.events.end();
    if (it == c.events.end()) return nullptr;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (it->second == nullptr) {
      ASSIGN_OR_RETURN(bool idle, Idle(handle));  // records the settled groups' events
      if (idle) break;
      if (std::chrono::steady_clock::now() >= give_up) {
        return absl::DeadlineExceededError("an NCCL group stayed in progress for 10 s");
      }
      std::this_thread::yield();
    }
    return it->second;
  }

  absl::StatusOr<bool> Done(void* handle, uint64_t ticket) override {
    Comm& c = *static_cast<Comm*>(handle);
    auto it = c.events.find(ticket);
    if (it == c.events.end()) return absl::InvalidArgumentError("unknown NCCL ticket");
    ncclResult_t state = ncclSuccess;
    if (s_.CommGetAsyncError(c.comm, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      if (it->second != nullptr) cudaEventDestroy(it->second);
      c.events.erase(it);
      return Error("the NCCL communicator", state);
    }
    if (it->second == nullptr) {  // still being enqueued
      if (state == ncclInProgress) return false;
      if (absl::Status st = Record(c, ticket); !st.ok()) return st;
    }
    const cudaError_t e = cudaEventQuery(it->second);
    if (e == cudaErrorNotReady) return false;
    cudaEventDestroy(it->second);
    c.events.erase(it);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("an NCCL group failed on the GPU: ", cudaGetErrorString(e)));
    }
    return true;
  }

  // The same state as Ready's (nothing in progress: created, and every
  // group enqueued), then the enqueued groups' events go on the stream.
  absl::StatusOr<bool> Idle(void* handle) override {
    absl::StatusOr<bool> settled = Ready(handle);
    if (!settled.ok() || !*settled) return settled;
    Comm& c = *static_cast<Comm*>(handle);
    std::vector<uint64_t> pending;
    for (const auto& [ticket, event] : c.events) {
      if (event == nullptr) pending.push_back(ticket);
    }
    for (uint64_t ticket : pending) {
      if (absl::Status st = Record(c, ticket); !st.ok()) return st;
    }
    return true;
  }

  // Stream-ordered on the legacy stream, which none of the worker's streams
  // (all non-blocking) waits for: cudaFree would wait for all of the
  // device's work, another communicator's posted receive included, which
  // waits for its peer.
  absl::StatusOr<void*> Alloc(int device, int64_t bytes) override {
    void* p = nullptr;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaMallocAsync(&p, static_cast<size_t>(bytes), nullptr) != cudaSuccess ||
        cudaStreamSynchronize(nullptr) != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrFormat("cudaMalloc of %d bytes on GPU %d failed", bytes, device));
    }
    return p;
  }
  // Called once nothing uses the buffer (its communicator ended).
  void Free(int device, void* buffer) override {
    cudaSetDevice(device);
    cudaFreeAsync(buffer, nullptr);
  }
  absl::Status Write(void* handle, void* buffer, const void* src, int64_t bytes) override {
    Comm& c = *static_cast<Comm*>(handle);
    cudaSetDevice(c.device);
    // Pageable source: the call returns once the bytes are staged.
    if (cudaMemcpyAsync(buffer, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, c.stream) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("copying an NCCL header to the GPU failed");
    }
    return absl::OkStatus();
  }
  absl::Status Read(void* handle, void* dst, const void* buffer, int64_t bytes) override {
    Comm& c = *static_cast<Comm*>(handle);
    cudaSetDevice(c.device);
    if (cudaMemcpyAsync(dst, buffer, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, c.stream) != cudaSuccess ||
        cudaStreamSynchronize(c.stream) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("reading an NCCL header from the GPU failed");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> EventDone(void* event) override {
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (q == cudaErrorNotReady) return false;
    if (q != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("the blocks' writes failed on the GPU: ", cudaGetErrorString(q)));
    }
    return true;
  }
  std::string DeviceBusId(int device) override {
    char id[32] = {0};
    if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) {
      cudaGetLastError();
      return "";
    }
    return id;
  }

  void Abort(void* handle) override { End(static_cast<Comm*>(handle)); }
  // Abort frees a non-blocking communicator at once, whatever it was doing.
  void Destroy(void* handle) override { End(static_cast<Comm*>(handle)); }

 private:
  // CTAs of a staged transfer's copy kernel: enough to gather a piece faster
  // than NVLink sends it, few enough to leave the SMs to the engine.
  static constexpr int kCopyCtas = 32;

  struct Comm {
    ncclComm_t comm = nullptr;
    int rank = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
    cudaStream_t copy_stream = nullptr;  // a staged transfer's gathers and scatters
    void* chunks = nullptr;              // their chunk lists (device memory, stream-ordered)
    int64_t chunk_bytes = 0;
    std::map<uint64_t, cudaEvent_t> events;
    uint64_t next_ticket = 0;
  };

  // The completion event of `ticket`'s work, now on `stream` (the comm's
  // NCCL stream, or its copy stream for Copies).
  absl::Status Record(Comm& c, uint64_t ticket, cudaStream_t stream = nullptr) {
    cudaSetDevice(c.device);
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(event, stream != nullptr ? stream : c.stream) != cudaSuccess) {
      cudaGetLastError();
      if (event != nullptr) cudaEventDestroy(event);
      c.events.erase(ticket);
      return absl::InternalError("recording an NCCL ticket's event failed");
    }
    c.events[ticket] = event;
    return absl::OkStatus();
  }

  void End(Comm* c) {
    cudaSetDevice(c->device);
    if (c->comm != nullptr) s_.CommAbort(c->comm);
    // The aborted groups' events have fired: what the copy stream queued
    // behind them (a staged transfer's scatters into the pool, its gathers
    // into staging) runs out now, before the caller reports the transfers
    // ended and frees the staging buffer.
    if (c->copy_stream != nullptr) cudaStreamSynchronize(c->copy_stream);
    if (c->stream != nullptr) cudaStreamSynchronize(c->stream);
    for (auto& [ticket, event] : c->events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (c->chunks != nullptr) cudaFreeAsync(c->chunks, c->copy_stream);
    if (c->copy_stream != nullptr) cudaStreamDestroy(c->copy_stream);
    if (c->stream != nullptr) cudaStreamDestroy(c->stream);
    delete c;
  }

  absl::Status Error(const char* what, ncclResult_t r) const {
    return absl::UnavailableError(absl::StrCat(what, ": ", s_.GetErrorString(r)));
  }

  const Syms s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclApi>> LoadNccl() {
  const char* env = std::getenv("TANDEM_NCCL");
  const std::string path = env != nullptr && *env != '\0' ? env : "libnccl.so.2";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot load NCCL (", path, ": ", dlerror(),
                                               "); put libnccl.so.2's directory on LD_LIBRARY_PATH or set "
                                               "TANDEM_NCCL to its path"));
  }
  Syms s{};
  auto sym = [&](const char* name, auto* fn) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
    return *fn != nullptr;
  };
  if (!sym("ncclGetVersion", &s.GetVersion) || !sym("ncclGetUniqueId", &s.GetUniqueId) ||
      !sym("ncclCommInitRankConfig", &s.CommInitRankConfig) || !sym("ncclCommGetAsyncError", &s.CommGetAsyncError) ||
      !sym("ncclGroupStart", &s.GroupStart) || !sym("ncclGroupEnd", &s.GroupEnd) || !sym("ncclSend", &s.Send) ||
      !sym("ncclRecv", &s.Recv) || !sym("ncclCommAbort", &s.CommAbort) ||
      !sym("ncclGetErrorString", &s.GetErrorString)) {
    return absl::UnavailableError(absl::StrCat(path, " lacks a function tandem needs (NCCL 2.19 or later)"));
  }
  int version = 0;
  s.GetVersion(&version);
  if (version < 21900) {
    return absl::UnavailableError(
        absl::StrFormat("%s is NCCL %d; tandem needs 2.19 or later (non-blocking communicators)", path, version));
  }
  return std::unique_ptr<NcclApi>(new RealNccl(s));
}

#else

absl::StatusOr<std::unique_ptr<NcclApi>> LoadNccl() {
  return absl::UnimplementedError("this tandem was built without the CUDA toolkit's nccl.h (no NCCL)");
}

#endif

}  // namespace tandem::kvtransfer
