// `tandem bench transfer`: bandwidth and latency of KV-block Pull (or Push) between two
// real processes (forked before anything of UCX exists; PeerInfo goes over a
// pipe), against a plain memcpy of the same blocks measured in the same run
// (machines are noisy; only same-run ratios are comparable).
//
// The cache is Llama-3-8B shaped: 32 layers x 8 KV heads x 128 head dim x
// (K,V) x fp16 = 128 KiB per token, 16 tokens per block = 2 MiB blocks.
// Sizes go from one block to --max-blocks (256 blocks = 4096 tokens =
// 512 MiB). Destination block ids are a random permutation, as a decode
// worker's free list gives them. Both pools are allocated by UCX
// (UCP_MEM_MAP_ALLOCATE), which is what lets shared-memory puts copy
// directly into the peer's pool.
//
// --backend loopback runs two in-process LoopbackTransports instead (no
// second process), as a baseline of the interface's own overhead.
//
// --backend cuda_ipc moves blocks between two processes' GPU pools on one
// device (CUDA IPC), against two device-to-device copies within the
// initiator's GPU in the same run (bytes counted once): the same blocks one
// cudaMemcpyAsync each (blocks_GB/s), and one copy of as many contiguous
// bytes (copy_GB/s, the bound for scattered blocks).
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "kvtransfer/transport.h"
#include "worker/cli/commands.h"
#ifdef TANDEM_HAVE_UCX
#include "kvtransfer/ucx/ucx_transport.h"
#endif
#ifdef TANDEM_HAVE_CUDA_IPC
#include <cuda_runtime_api.h>

#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace tandem::worker {
namespace {

using Clock = std::chrono::steady_clock;
using kvtransfer::BlockPair;
using kvtransfer::PeerInfo;
using kvtransfer::PoolLayout;
using kvtransfer::Transport;

struct TransferBenchOptions {
  std::string backend = "ucx";
  std::string tls = "shm";
  std::string op = "pull";  // pull: what the decode worker does; push
  // ucx: allocated by UCX (shareable); mmap: anonymous, registered; cuda:
  // GPU memory (ucx_staged). "": the backend's default (ucx; ucx_staged: mmap).
  std::string pool;
  bool sequential = false;  // peer block ids in order: one merged run per transfer
  int max_blocks = 256;
  int repeats = 5;
  bool json = false;
  // cuda_ipc and nccl: the target process's GPU (the initiator's is 0);
  // unset: cuda_ipc 0, nccl 1.
  int target_device = 0;
  bool target_device_set = false;
  // ucx_staged's ring; the defaults are the transport's.
  int staging_slots = kvtransfer::TransportOptions{}.staging_slots;
  int staging_slot_mib = static_cast<int>(kvtransfer::TransportOptions{}.staging_slot_bytes >> 20);
};

// The target's GPU for the send/receive backends (nccl needs two;
// ucx_staged's GPU pools share GPU 0).
int TargetDevice(const TransferBenchOptions& opt) {
  return opt.backend != "nccl" ? 0 : opt.target_device_set ? opt.target_device : 1;
}

// Llama-3-8B: 32 layers, 8 KV heads, head dim 128, fp16, K and V.
PoolLayout LlamaLayout(int64_t num_blocks) {
  PoolLayout l{.model = "llama-3-8b",
               .dtype = "float16",
               .num_layers = 32,
               .num_kv_heads = 8,
               .head_dim = 128,
               .block_size = 16,
               .num_blocks = num_blocks};
  l.block_bytes = int64_t{l.num_layers} * l.num_kv_heads * l.head_dim * 2 * 2 * l.block_size;
  return l;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Block b is filled with a byte pattern derived from b.
// Block b's contents, the same in both processes: its id, then a byte pattern.
void FillBlock(uint8_t* block, int64_t b, int64_t block_bytes) {
  std::memset(block, static_cast<int>((b * 37 + 11) & 0xff), static_cast<size_t>(block_bytes));
  std::memcpy(block, &b, sizeof(b));
}

void FillPool(uint8_t* base, const PoolLayout& l) {
  for (int64_t b = 0; b < l.num_blocks; ++b) FillBlock(base + b * l.block_bytes, b, l.block_bytes);
}

// The peer's block ids, in transfer order: a fixed random permutation (as a
// free list hands out blocks), or in order with --sequential.
std::vector<int32_t> PeerBlockOrder(const PoolLayout& layout, const TransferBenchOptions& opt) {
  std::vector<int32_t> perm(layout.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  if (!opt.sequential) std::shuffle(perm.begin(), perm.end(), std::mt19937(42));
  return perm;
}

// The block pairs of one transfer of n blocks: local block i and the peer's
// block perm[i] (a scattered destination, as a real block table is).
std::vector<BlockPair> PairsFor(int n, const std::vector<int32_t>& perm, bool pull) {
  std::vector<BlockPair> pairs;
  for (int i = 0; i < n; ++i) pairs.push_back(pull ? BlockPair{perm[i], i} : BlockPair{i, perm[i]});
  return pairs;
}

// Posts one transfer and waits for `done`; returns post -> done seconds.
absl::StatusOr<double> TimedTransfer(Transport& t, const std::string& peer, const std::vector<BlockPair>& pairs,
                                     bool pull) {
  std::promise<absl::Status> done;
  const Clock::time_point start = Clock::now();
  auto on_done = [&done](absl::Status st) { done.set_value(std::move(st)); };
  const kvtransfer::Deadline deadline = start + std::chrono::seconds(60);
  RETURN_IF_ERROR((pull ? t.Pull(peer, pairs, deadline, on_done) : t.Push(peer, pairs, deadline, on_done)).status());
  absl::Status st = done.get_future().get();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  RETURN_IF_ERROR(st);
  return seconds;
}

// One timed transfer of `pairs`: post -> every byte at the destination.
using Timed = std::function<absl::StatusOr<double>(const std::vector<BlockPair>& pairs)>;

Timed OneSided(Transport& t, const std::string& peer, const TransferBenchOptions& opt) {
  return [&t, peer, pull = opt.op == "pull"](const std::vector<BlockPair>& pairs) {
    return TimedTransfer(t, peer, pairs, pull);
  };
}

struct Row {
  int blocks;
  int64_t bytes;
  double seconds;  // median post -> done
  double min_seconds;
  double memcpy_seconds;      // median
  double blocks_seconds = 0;  // median of the second baseline (GPU: the blocks copied one by one); 0: none
};

// The same-run baseline: seconds to copy `pairs`' blocks (src -> dst) the
// plain way (memcpy on the host; a device copy for GPU pools).
using Baseline = std::function<absl::StatusOr<double>(const std::vector<BlockPair>& pairs)>;

// memcpy from the pool `src` into ordinary pre-faulted memory, which lives as
// long as the returned function.
absl::StatusOr<Baseline> HostCopyBaseline(uint8_t* src, const PoolLayout& layout) {
  const int64_t bb = layout.block_bytes;
  const size_t bytes = static_cast<size_t>(layout.num_blocks * bb);
  void* dst_mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (dst_mem == MAP_FAILED) return absl::ResourceExhaustedError("mmap of the memcpy buffer");
  std::memset(dst_mem, 1, bytes);
  std::shared_ptr<uint8_t> dst(static_cast<uint8_t*>(dst_mem), [bytes](uint8_t* p) { munmap(p, bytes); });
  return Baseline([src, dst, bb](const std::vector<BlockPair>& pairs) -> absl::StatusOr<double> {
    const Clock::time_point c0 = Clock::now();
    for (const BlockPair& p : pairs) {
      std::memcpy(dst.get() + int64_t{p.dst} * bb, src + int64_t{p.src} * bb, static_cast<size_t>(bb));
    }
    return std::chrono::duration<double>(Clock::now() - c0).count();
  });
}

// The measurement, given a connected initiator and the baseline (and a
// second one, where given).
absl::StatusOr<std::vector<Row>> Measure(const Timed& timed, const Baseline& baseline, const PoolLayout& layout,
                                         const TransferBenchOptions& opt, const Baseline* second = nullptr) {
  const int64_t bb = layout.block_bytes;

  const std::vector<int32_t> perm = PeerBlockOrder(layout, opt);

  std::vector<Row> rows;
  absl::Status status;
  const bool pull = opt.op == "pull";
  for (int n = 1; n <= opt.max_blocks; n *= 2) {
    const std::vector<BlockPair> pairs = PairsFor(n, perm, pull);
    std::vector<double> push, copy, copy2;
    absl::StatusOr<double> warm = timed(pairs);
    if (!warm.ok()) {
      status = warm.status();
      break;
    }
    for (int r = 0; r < opt.repeats; ++r) {
      absl::StatusOr<double> s = timed(pairs);
      if (!s.ok()) {
        status = s.status();
        break;
      }
      push.push_back(*s);
      absl::StatusOr<double> c = baseline(pairs);
      if (!c.ok()) {
        status = c.status();
        break;
      }
      copy.push_back(*c);
      if (second != nullptr) {
        absl::StatusOr<double> c2 = (*second)(pairs);
        if (!c2.ok()) {
          status = c2.status();
          break;
        }
        copy2.push_back(*c2);
      }
    }
    if (!status.ok()) break;
    rows.push_back(Row{n, n * bb, Median(push), *std::min_element(push.begin(), push.end()), Median(copy),
                       copy2.empty() ? 0.0 : Median(copy2)});
  }
  RETURN_IF_ERROR(status);
  return rows;
}

// Checks that the benchmark moved real bytes. Push: pulls back the peer
// block that local block 0 went to (perm[0]) and compares. Pull: local
// block 0 must now hold the peer's block perm[0] (both pools were filled the
// same way). `read_block` copies a local block to the host.
absl::Status CheckOneBlock(Transport& t, const std::string& peer,
                           const std::function<absl::Status(int32_t block, uint8_t* out)>& read_block,
                           const PoolLayout& layout, const TransferBenchOptions& opt) {
  const bool pull = opt.op == "pull";
  const std::vector<int32_t> perm = PeerBlockOrder(layout, opt);
  const size_t bytes = static_cast<size_t>(layout.block_bytes);
  std::vector<uint8_t> want(bytes);
  FillBlock(want.data(), pull ? perm[0] : 0, layout.block_bytes);
  int32_t check = 0;
  if (!pull) {
    check = static_cast<int32_t>(layout.num_blocks - 1);
    std::promise<absl::Status> done;
    RETURN_IF_ERROR(t.Pull(peer, {{perm[0], check}}, Clock::now() + std::chrono::seconds(30), [&done](absl::Status st) {
                       done.set_value(std::move(st));
                     }).status());
    RETURN_IF_ERROR(done.get_future().get());
  }
  std::vector<uint8_t> got(bytes);
  RETURN_IF_ERROR(read_block(check, got.data()));
  if (std::memcmp(got.data(), want.data(), bytes) != 0) {
    return absl::DataLossError("a transferred block differs from its source");
  }
  return absl::OkStatus();
}

std::function<absl::Status(int32_t, uint8_t*)> HostBlocks(const uint8_t* pool, const PoolLayout& layout) {
  return [pool, bb = layout.block_bytes](int32_t block, uint8_t* out) {
    std::memcpy(out, pool + int64_t{block} * bb, static_cast<size_t>(bb));
    return absl::OkStatus();
  };
}

void Print(const std::vector<Row>& rows, const TransferBenchOptions& opt) {
  const bool gpu = opt.backend == "cuda_ipc" || opt.pool == "cuda";
  const bool nccl = opt.backend == "nccl";
  const std::string name = opt.backend == "ucx" ? "ucx/" + opt.tls
                           : opt.backend == "ucx_staged"
                               ? absl::StrCat("ucx_staged/", opt.tls, gpu ? " (GPU pools)" : " (host pools)")
                           : nccl ? absl::StrFormat("nccl (GPU 0 -> GPU %d)", TargetDevice(opt))
                                  : opt.backend;
  if (!opt.json) {
    std::printf("KV %s %s, 2 MiB blocks (Llama-3-8B, 16 tokens), median of %d; GB/s = 1e9 B/s%s\n", opt.op.c_str(),
                name.c_str(), opt.repeats,
                opt.backend == "cuda_ipc"
                    ? "; baselines: the same blocks copied device to device one cudaMemcpyAsync each (blocks_), "
                      "and one copy of as many contiguous bytes (copy_)"
                : nccl ? "; baseline: cudaMemcpyPeer of as many contiguous bytes between the two GPUs (memcpy_ column)"
                : gpu  ? "; baseline: one device-to-device copy of as many contiguous bytes (memcpy_ column)"
                       : "");
    if (opt.backend == "cuda_ipc") {
      std::printf("%7s %7s %10s %10s %9s %12s %8s %12s %8s\n", "blocks", "MiB", "lat_ms", "min_ms", "GB/s",
                  "blocks_GB/s", "ratio", "copy_GB/s", "ratio");
    } else {
      std::printf("%7s %7s %10s %10s %9s %12s %8s\n", "blocks", "MiB", "lat_ms", "min_ms", "GB/s", "memcpy_GB/s",
                  "ratio");
    }
  }
  for (const Row& r : rows) {
    const double gbps = r.bytes / r.seconds / 1e9, memcpy_gbps = r.bytes / r.memcpy_seconds / 1e9;
    if (opt.json) {
      nlohmann::json j = {{"backend", name},
                          {"op", opt.op},
                          {"blocks", r.blocks},
                          {"bytes", r.bytes},
                          {"seconds", r.seconds},
                          {"min_seconds", r.min_seconds},
                          {"gbps", gbps},
                          {"baseline", nccl  ? "peer_copy"
                                       : gpu ? "device_copy"
                                             : "memcpy"},
                          {"memcpy_gbps", memcpy_gbps},
                          {"ratio_to_memcpy", gbps / memcpy_gbps}};
      if (r.blocks_seconds > 0) {
        const double blocks_gbps = r.bytes / r.blocks_seconds / 1e9;
        j["blocks_copy_gbps"] = blocks_gbps;
        j["ratio_to_blocks_copy"] = gbps / blocks_gbps;
      }
      std::printf("%s\n", j.dump().c_str());
    } else if (r.blocks_seconds > 0) {
      const double blocks_gbps = r.bytes / r.blocks_seconds / 1e9;
      std::printf("%7d %7.0f %10.3f %10.3f %9.2f %12.2f %8.2f %12.2f %8.2f\n", r.blocks, r.bytes / 1048576.0,
                  r.seconds * 1e3, r.min_seconds * 1e3, gbps, blocks_gbps, gbps / blocks_gbps, memcpy_gbps,
                  gbps / memcpy_gbps);
    } else {
      std::printf("%7d %7.0f %10.3f %10.3f %9.2f %12.2f %8.2f\n", r.blocks, r.bytes / 1048576.0, r.seconds * 1e3,
                  r.min_seconds * 1e3, gbps, memcpy_gbps, gbps / memcpy_gbps);
    }
  }
}

absl::Status RunLoopback(const TransferBenchOptions& opt) {
  const PoolLayout layout = LlamaLayout(opt.max_blocks);
  const size_t bytes = static_cast<size_t>(layout.num_blocks * layout.block_bytes);
  std::vector<uint8_t> pool_a(bytes), pool_b(bytes, 0);
  FillPool(pool_a.data(), layout);
  FillPool(pool_b.data(), layout);
  auto fabric = std::make_shared<kvtransfer::LoopbackFabric>();
  kvtransfer::LoopbackTransport a(fabric), b(fabric);
  RETURN_IF_ERROR(a.RegisterPool(layout, pool_a.data()));
  RETURN_IF_ERROR(b.RegisterPool(layout, pool_b.data()));
  ASSIGN_OR_RETURN(PeerInfo b_info, b.LocalInfo());
  RETURN_IF_ERROR(a.AddPeer(b_info));
  ASSIGN_OR_RETURN(Baseline baseline, HostCopyBaseline(pool_a.data(), layout));
  ASSIGN_OR_RETURN(std::vector<Row> rows, Measure(OneSided(a, b_info.agent_id, opt), baseline, layout, opt));
  RETURN_IF_ERROR(CheckOneBlock(a, b_info.agent_id, HostBlocks(pool_a.data(), layout), layout, opt));
  Print(rows, opt);
  return absl::OkStatus();
}

#if defined(TANDEM_HAVE_UCX) || defined(TANDEM_HAVE_CUDA_IPC)
// Length-prefixed messages over the pipes between the two processes.
absl::Status WriteMessage(int fd, const std::string& bytes) {
  uint32_t n = static_cast<uint32_t>(bytes.size());
  std::string framed(reinterpret_cast<const char*>(&n), sizeof(n));
  framed += bytes;
  size_t off = 0;
  while (off < framed.size()) {
    ssize_t w = write(fd, framed.data() + off, framed.size() - off);
    if (w <= 0) return absl::UnavailableError("pipe to the peer process closed");
    off += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadMessage(int fd) {
  auto read_all = [fd](char* p, size_t n) {
    while (n > 0) {
      ssize_t r = read(fd, p, n);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  };
  uint32_t n = 0;
  if (!read_all(reinterpret_cast<char*>(&n), sizeof(n))) {
    return absl::UnavailableError("the peer process closed its pipe");
  }
  std::string bytes(n, '\0');
  if (!read_all(bytes.data(), n)) return absl::UnavailableError("the peer process closed its pipe");
  return bytes;
}

// Runs `target(to_parent, from_parent)` in a forked process (before this
// one touches UCX or CUDA) and `initiator(from_target)` here; the target
// exits on EOF of its pipe, and a target that failed fails the run.
absl::Status WithTargetProcess(const std::function<int(int to_parent, int from_parent)>& target,
                               const std::function<absl::Status(int from_target)>& initiator,
                               int* to_target = nullptr) {
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return absl::InternalError("pipe failed");
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    _exit(target(up[1], down[0]));
  }
  close(down[0]);
  close(up[1]);
  if (to_target != nullptr) *to_target = down[1];
  absl::Status st = initiator(up[0]);
  close(down[1]);  // the target exits on EOF
  close(up[0]);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (st.ok() && !(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0)) {
    return absl::InternalError("the target process failed");
  }
  return st;
}

// A target process's exit code: a failure is printed, and told to the
// initiator (which waits for a PeerInfo) as an empty message.
int TargetExit(const absl::Status& st, int to_parent) {
  if (st.ok()) return 0;
  std::fprintf(stderr, "tandem bench transfer (target): %s\n", st.ToString().c_str());
  (void)WriteMessage(to_parent, "");
  return 1;
}
#endif

#ifdef TANDEM_HAVE_UCX
kvtransfer::UcxOptions UcxOptionsFor(const TransferBenchOptions& opt) {
  kvtransfer::UcxOptions o;
  o.transports = opt.tls;
  return o;
}

// A pool from UCX (--pool ucx: UCP_MEM_MAP_ALLOCATE, shareable) or plain
// anonymous memory (--pool mmap), which UCX then only registers. Lives until
// the process exits.
absl::StatusOr<void*> AllocateBenchPool(kvtransfer::UcxTransport& t, const PoolLayout& layout,
                                        const TransferBenchOptions& opt) {
  const int64_t bytes = layout.num_blocks * layout.block_bytes;
  if (opt.pool == "ucx") return t.AllocatePool(bytes);
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError("mmap of the pool failed");
  return p;
}

// The target process: a UCX-allocated pool, its PeerInfo up the pipe, then
// progress (on the transport's thread) until the initiator closes the pipe.
int RunTarget(const TransferBenchOptions& opt, int to_parent, int from_parent) {
  absl::Status st = [&]() -> absl::Status {
    const PoolLayout layout = LlamaLayout(opt.max_blocks);
    ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::UcxTransport> t, kvtransfer::UcxTransport::Create(UcxOptionsFor(opt)));
    ASSIGN_OR_RETURN(void* pool, AllocateBenchPool(*t, layout, opt));
    FillPool(static_cast<uint8_t*>(pool), layout);
    RETURN_IF_ERROR(t->RegisterPool(layout, pool));
    ASSIGN_OR_RETURN(PeerInfo info, t->LocalInfo());
    RETURN_IF_ERROR(WriteMessage(to_parent, kvtransfer::EncodePeerInfo(info)));
    char c;
    while (read(from_parent, &c, 1) > 0) {
    }
    return absl::OkStatus();
  }();
  return TargetExit(st, to_parent);
}

absl::Status RunUcx(const TransferBenchOptions& opt) {
  auto target = [&opt](int to_parent, int from_parent) { return RunTarget(opt, to_parent, from_parent); };
  return WithTargetProcess(target, [&](int from_target) -> absl::Status {
    const PoolLayout layout = LlamaLayout(opt.max_blocks);
    ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::UcxTransport> t, kvtransfer::UcxTransport::Create(UcxOptionsFor(opt)));
    ASSIGN_OR_RETURN(void* mem, AllocateBenchPool(*t, layout, opt));
    uint8_t* pool = static_cast<uint8_t*>(mem);
    FillPool(pool, layout);
    RETURN_IF_ERROR(t->RegisterPool(layout, pool));
    ASSIGN_OR_RETURN(std::string encoded, ReadMessage(from_target));
    if (encoded.empty()) return absl::UnavailableError("the target process failed to start");
    ASSIGN_OR_RETURN(PeerInfo peer, kvtransfer::DecodePeerInfo(encoded));
    RETURN_IF_ERROR(t->AddPeer(peer));
    ASSIGN_OR_RETURN(Baseline baseline, HostCopyBaseline(pool, layout));
    ASSIGN_OR_RETURN(std::vector<Row> rows, Measure(OneSided(*t, peer.agent_id, opt), baseline, layout, opt));
    RETURN_IF_ERROR(CheckOneBlock(*t, peer.agent_id, HostBlocks(pool, layout), layout, opt));
    Print(rows, opt);
    return absl::OkStatus();
  });
}
#endif  // TANDEM_HAVE_UCX

#ifdef TANDEM_HAVE_CUDA_IPC
PoolLayout GpuLayout(const TransferBenchOptions& opt, int device) {
  PoolLayout l = LlamaLayout(opt.max_blocks);
  l.memory_type = kvtransfer::MemoryType::kCuda;
  l.device_id = device;
  return l;
}

// A pool of `layout` on its GPU, filled as FillPool fills host pools. Lives
// until the process exits.
absl::StatusOr<uint8_t*> DevicePool(const PoolLayout& layout) {
  const size_t bytes = static_cast<size_t>(layout.num_blocks * layout.block_bytes);
  if (cudaSetDevice(layout.device_id) != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrFormat("--target-device %d: no such GPU", layout.device_id));
  }
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrFormat("cudaMalloc of a %d-byte bench pool failed", bytes));
  }
  std::vector<uint8_t> host(bytes);
  FillPool(host.data(), layout);
  if (cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError("filling the bench pool failed");
  }
  return static_cast<uint8_t*>(p);
}

// The same number of bytes as `pairs` in one device-to-device copy from
// `pool` (on `pool_device`) into `scratch` (on `scratch_device`): what the
// device's copy bandwidth allows, or, across two GPUs, cudaMemcpyPeer.
absl::StatusOr<Baseline> DeviceCopyBaseline(uint8_t* pool, int pool_device, uint8_t* scratch, int scratch_device,
                                            const PoolLayout& layout) {
  if (pool_device != scratch_device) {
    // Peer access both ways, as cudaMemcpyPeer reaches the other GPU over
    // their link (without it the copy is staged through the host).
    for (auto [from, to] : {std::pair{pool_device, scratch_device}, std::pair{scratch_device, pool_device}}) {
      cudaSetDevice(from);
      const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
        return absl::FailedPreconditionError(
            absl::StrFormat("GPU %d cannot reach GPU %d (peer access): %s", from, to, cudaGetErrorString(e)));
      }
      cudaGetLastError();
    }
  }
  cudaSetDevice(pool_device);
  cudaStream_t raw = nullptr;
  if (cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) != cudaSuccess) {
    return absl::InternalError("cudaStreamCreate failed");
  }
  std::shared_ptr<CUstream_st> stream(raw, [](cudaStream_t s) { cudaStreamDestroy(s); });
  return Baseline([=, bb = layout.block_bytes](const std::vector<BlockPair>& pairs) {
    const size_t bytes = static_cast<size_t>(int64_t(pairs.size()) * bb);
    const Clock::time_point c0 = Clock::now();
    const cudaError_t issued =
        pool_device == scratch_device
            ? cudaMemcpyAsync(scratch, pool, bytes, cudaMemcpyDeviceToDevice, stream.get())
            : cudaMemcpyPeerAsync(scratch, scratch_device, pool, pool_device, bytes, stream.get());
    if (issued != cudaSuccess || cudaStreamSynchronize(stream.get()) != cudaSuccess) {
      return absl::StatusOr<double>(absl::InternalError("the baseline's device copy failed"));
    }
    return absl::StatusOr<double>(std::chrono::duration<double>(Clock::now() - c0).count());
  });
}

absl::Status ReadDeviceBlock(const uint8_t* pool, const PoolLayout& layout, int32_t block, uint8_t* out) {
  const int64_t bb = layout.block_bytes;
  return cudaMemcpy(out, pool + int64_t{block} * bb, static_cast<size_t>(bb), cudaMemcpyDeviceToHost) == cudaSuccess
             ? absl::OkStatus()
             : absl::InternalError("reading a block back failed");
}

// The target: its GPU pool's agent id and address up the pipe ("!" and the
// reason if it cannot), then waits for EOF.
int RunCudaIpcTarget(const TransferBenchOptions& opt, int to_parent, int from_parent) {
  std::unique_ptr<kvtransfer::CudaIpcTransport> keep;
  absl::Status st = [&]() -> absl::Status {
    const PoolLayout layout = GpuLayout(opt, opt.target_device);
    ASSIGN_OR_RETURN(keep, kvtransfer::CudaIpcTransport::Create(opt.target_device));
    ASSIGN_OR_RETURN(uint8_t * pool, DevicePool(layout));
    RETURN_IF_ERROR(keep->RegisterPool(layout, pool));
    ASSIGN_OR_RETURN(PeerInfo info, keep->LocalInfo());
    return WriteMessage(to_parent, info.agent_id + "\n" + info.address);
  }();
  if (!st.ok()) {
    (void)WriteMessage(to_parent, "!" + std::string(st.message()));
    return 1;
  }
  char c;
  while (read(from_parent, &c, 1) > 0) {
  }
  return 0;
}

absl::Status RunCudaIpc(const TransferBenchOptions& opt) {
  auto target = [&opt](int to_parent, int from_parent) { return RunCudaIpcTarget(opt, to_parent, from_parent); };
  return WithTargetProcess(target, [&](int from_target) -> absl::Status {
    ASSIGN_OR_RETURN(std::string message, ReadMessage(from_target));
    if (!message.empty() && message[0] == '!') {
      return absl::FailedPreconditionError(absl::StrCat("--backend cuda_ipc: ", message.substr(1)));
    }
    const size_t nl = message.find('\n');
    if (nl == std::string::npos) return absl::UnavailableError("the target process sent no address");
    const PoolLayout layout = GpuLayout(opt, 0);
    const PeerInfo peer{.agent_id = message.substr(0, nl),
                        .backend = "cuda_ipc",
                        .layout = GpuLayout(opt, opt.target_device),
                        .address = message.substr(nl + 1)};
    ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::CudaIpcTransport> t, kvtransfer::CudaIpcTransport::Create(0));
    ASSIGN_OR_RETURN(uint8_t * pool, DevicePool(layout));
    RETURN_IF_ERROR(t->RegisterPool(layout, pool));
    RETURN_IF_ERROR(t->AddPeer(peer));
    // The baseline: the same number of bytes in one device-to-device copy
    // within this GPU (what the device's copy bandwidth allows).
    ASSIGN_OR_RETURN(uint8_t * scratch, DevicePool(layout));
    ASSIGN_OR_RETURN(Baseline baseline, DeviceCopyBaseline(pool, 0, scratch, 0, layout));
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      return absl::InternalError("cudaStreamCreate failed");
    }
    const int64_t bb = layout.block_bytes;
    // And the baseline: the same blocks copied one cudaMemcpyAsync each.
    Baseline blocks = [&](const std::vector<BlockPair>& pairs) -> absl::StatusOr<double> {
      const Clock::time_point c0 = Clock::now();
      for (const BlockPair& p : pairs) {
        if (cudaMemcpyAsync(scratch + int64_t{p.dst} * bb, pool + int64_t{p.src} * bb, static_cast<size_t>(bb),
                            cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
          return absl::InternalError("the baseline's device copy failed");
        }
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) return absl::InternalError("the baseline's copy failed");
      return std::chrono::duration<double>(Clock::now() - c0).count();
    };
    auto read_block = [&](int32_t block, uint8_t* out) { return ReadDeviceBlock(pool, layout, block, out); };
    ASSIGN_OR_RETURN(std::vector<Row> rows, Measure(OneSided(*t, peer.agent_id, opt), baseline, layout, opt, &blocks));
    RETURN_IF_ERROR(CheckOneBlock(*t, peer.agent_id, read_block, layout, opt));
    Print(rows, opt);
    return absl::OkStatus();
  });
}
#endif  // TANDEM_HAVE_CUDA_IPC

#if defined(TANDEM_HAVE_UCX) || defined(TANDEM_HAVE_CUDA_IPC)
// The send/receive backends (needs_pairing): --backend ucx_staged (through
// host staging; pools in host memory, --pool mmap, or GPU memory, --pool
// cuda, GPU 0 on both sides) and --backend nccl (GPU pools: the initiator's
// on GPU 0, the target's on --target-device, 1 by default). The initiator
// pairs first and hands the target its offer with its PeerInfo. Per
// transfer it asks the target to post its Receive ("N TAG" down the pipe,
// "ok" back), then pushes; the time runs from the push to the target's word
// that its Receive ended ("done", or "!" and the error), so it covers every
// byte landing in the target's pool.
struct TwoSidedPool {
  PoolLayout layout;
  uint8_t* base = nullptr;
};

absl::StatusOr<TwoSidedPool> MakeTwoSidedPool(const TransferBenchOptions& opt, int device) {
  TwoSidedPool p{LlamaLayout(opt.max_blocks)};
  if (opt.pool == "cuda") {
#ifdef TANDEM_HAVE_CUDA_IPC
    p.layout.memory_type = kvtransfer::MemoryType::kCuda;
    p.layout.device_id = device;
    ASSIGN_OR_RETURN(p.base, DevicePool(p.layout));
    return p;
#else
    (void)device;
    return absl::UnimplementedError("--pool cuda: this tandem was built without CUDA");
#endif
  }
  const size_t bytes = static_cast<size_t>(p.layout.num_blocks * p.layout.block_bytes);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return absl::ResourceExhaustedError("mmap of the pool failed");
  p.base = static_cast<uint8_t*>(mem);
  FillPool(p.base, p.layout);
  return p;
}

absl::StatusOr<std::unique_ptr<Transport>> TwoSidedTransport(const TransferBenchOptions& opt,
                                                             const TwoSidedPool& pool) {
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> t,
                   kvtransfer::TransportRegistry::Builtin().Create(
                       opt.backend, {.transports = opt.tls,
                                     .device = std::max(pool.layout.device_id, 0),
                                     .staging_slots = opt.staging_slots,
                                     .staging_slot_bytes = int64_t{opt.staging_slot_mib} << 20}));
  RETURN_IF_ERROR(t->RegisterPool(pool.layout, pool.base));
  return t;
}

absl::Status ReadTwoSidedBlock(const TwoSidedPool& pool, int32_t block, uint8_t* out) {
#ifdef TANDEM_HAVE_CUDA_IPC
  if (pool.layout.memory_type == kvtransfer::MemoryType::kCuda)
    return ReadDeviceBlock(pool.base, pool.layout, block, out);
#endif
  return HostBlocks(pool.base, pool.layout)(block, out);
}

int RunTwoSidedTarget(const TransferBenchOptions& opt, int to_parent, int from_parent) {
  std::unique_ptr<Transport> t;
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(TwoSidedPool pool, MakeTwoSidedPool(opt, TargetDevice(opt)));
    ASSIGN_OR_RETURN(t, TwoSidedTransport(opt, pool));
    ASSIGN_OR_RETURN(PeerInfo info, t->LocalInfo());
    RETURN_IF_ERROR(WriteMessage(to_parent, kvtransfer::EncodePeerInfo(info)));
    ASSIGN_OR_RETURN(std::string encoded, ReadMessage(from_parent));
    ASSIGN_OR_RETURN(PeerInfo initiator, kvtransfer::DecodePeerInfo(encoded));
    ASSIGN_OR_RETURN(std::string offer, ReadMessage(from_parent));
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    RETURN_IF_ERROR(
        t->Pair(initiator, kvtransfer::PairRole::kResponder, offer, deadline, [](absl::Status) {}).status());
    const std::vector<int32_t> perm = PeerBlockOrder(pool.layout, opt);
    while (true) {
      absl::StatusOr<std::string> ask = ReadMessage(from_parent);
      if (!ask.ok()) return absl::OkStatus();  // the initiator is done
      if (*ask == "check") {
        // Push: the initiator's block 0 went to perm[0].
        std::vector<uint8_t> want(static_cast<size_t>(pool.layout.block_bytes)), got(want.size());
        FillBlock(want.data(), 0, pool.layout.block_bytes);
        RETURN_IF_ERROR(ReadTwoSidedBlock(pool, perm[0], got.data()));
        RETURN_IF_ERROR(WriteMessage(to_parent, want == got ? "ok" : "!a pushed block differs from its source"));
        continue;
      }
      int n = 0;
      unsigned long long tag = 0;
      if (std::sscanf(ask->c_str(), "%d %llu", &n, &tag) != 2) return absl::InternalError("a malformed request");
      absl::StatusOr<uint64_t> id =
          t->Receive(initiator.agent_id, PairsFor(n, perm, /*pull=*/false), tag,
                     Clock::now() + std::chrono::seconds(60), [to_parent](absl::Status done) {
                       (void)WriteMessage(to_parent, done.ok() ? "done" : "!" + std::string(done.message()));
                     });
      RETURN_IF_ERROR(WriteMessage(to_parent, id.ok() ? "ok" : "!" + std::string(id.status().message())));
    }
  }();
  return TargetExit(st, to_parent);
}

absl::Status RunTwoSided(const TransferBenchOptions& opt) {
  auto target = [&opt](int to_parent, int from_parent) { return RunTwoSidedTarget(opt, to_parent, from_parent); };
  int to_target = -1;
  auto initiator = [&](int from_target) -> absl::Status {
    ASSIGN_OR_RETURN(TwoSidedPool pool, MakeTwoSidedPool(opt, 0));
    ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, TwoSidedTransport(opt, pool));
    ASSIGN_OR_RETURN(std::string encoded, ReadMessage(from_target));
    if (encoded.empty()) return absl::UnavailableError("the target process failed to start");
    ASSIGN_OR_RETURN(PeerInfo peer, kvtransfer::DecodePeerInfo(encoded));
    std::promise<absl::Status> paired;
    ASSIGN_OR_RETURN(std::string offer,
                     t->Pair(peer, kvtransfer::PairRole::kInitiator, "", Clock::now() + std::chrono::seconds(30),
                             [&paired](absl::Status st) { paired.set_value(std::move(st)); }));
    ASSIGN_OR_RETURN(PeerInfo local, t->LocalInfo());
    RETURN_IF_ERROR(WriteMessage(to_target, kvtransfer::EncodePeerInfo(local)));
    RETURN_IF_ERROR(WriteMessage(to_target, offer));
    RETURN_IF_ERROR(paired.get_future().get());  // both sides joined (NCCL: the communicator is up)
    uint64_t tag = 0;
    Timed timed = [&](const std::vector<BlockPair>& pairs) -> absl::StatusOr<double> {
      RETURN_IF_ERROR(WriteMessage(to_target, absl::StrFormat("%d %d", pairs.size(), ++tag)));
      ASSIGN_OR_RETURN(std::string posted, ReadMessage(from_target));
      if (posted != "ok") return absl::InternalError(absl::StrCat("the target's Receive: ", posted));
      std::promise<absl::Status> sent;
      const Clock::time_point start = Clock::now();
      RETURN_IF_ERROR(t->PushAfter(peer.agent_id, pairs, kvtransfer::CompletedFence(), tag,
                                   start + std::chrono::seconds(60),
                                   [&sent](absl::Status st) { sent.set_value(std::move(st)); })
                          .status());
      RETURN_IF_ERROR(sent.get_future().get());
      ASSIGN_OR_RETURN(std::string received, ReadMessage(from_target));
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (received != "done") return absl::InternalError(absl::StrCat("the target's Receive: ", received));
      return seconds;
    };
    Baseline baseline;
    if (pool.layout.memory_type == kvtransfer::MemoryType::kCuda) {
#ifdef TANDEM_HAVE_CUDA_IPC
      // The same bytes copied by the GPUs themselves: within GPU 0
      // (ucx_staged), or from GPU 0 into the target's GPU (nccl: what
      // cudaMemcpyPeer reaches over their link).
      PoolLayout scratch_layout = pool.layout;
      scratch_layout.device_id = TargetDevice(opt);
      ASSIGN_OR_RETURN(uint8_t * scratch, DevicePool(scratch_layout));
      ASSIGN_OR_RETURN(baseline, DeviceCopyBaseline(pool.base, 0, scratch, scratch_layout.device_id, pool.layout));
#endif
    } else {
      ASSIGN_OR_RETURN(baseline, HostCopyBaseline(pool.base, pool.layout));
    }
    ASSIGN_OR_RETURN(std::vector<Row> rows, Measure(timed, baseline, pool.layout, opt));
    RETURN_IF_ERROR(WriteMessage(to_target, "check"));
    ASSIGN_OR_RETURN(std::string checked, ReadMessage(from_target));
    if (checked != "ok") return absl::DataLossError(absl::StrCat(opt.backend, ": ", checked));
    Print(rows, opt);
    return absl::OkStatus();
  };
  return WithTargetProcess(target, initiator, &to_target);
}
#endif

absl::Status RunTransferBench(TransferBenchOptions opt) {
  const bool staged = opt.backend == "ucx_staged";
  const bool nccl = opt.backend == "nccl";
  if (opt.pool.empty()) opt.pool = staged ? "mmap" : nccl ? "cuda" : "ucx";
  if (opt.max_blocks < 1 || opt.repeats < 1) {
    return absl::InvalidArgumentError("--max-blocks and --repeats must be >= 1");
  }
  if (nccl     ? opt.pool != "cuda"
      : staged ? opt.pool != "mmap" && opt.pool != "cuda"
               : opt.pool != "ucx" && opt.pool != "mmap") {
    return absl::InvalidArgumentError(absl::StrFormat("--pool %s: want %s", opt.pool,
                                                      nccl     ? "cuda (nccl moves GPU pools)"
                                                      : staged ? "mmap or cuda (ucx_staged pools)"
                                                               : "ucx or mmap"));
  }
  if (opt.staging_slots < 2 || opt.staging_slot_mib < 2) {
    return absl::InvalidArgumentError("--staging-slots and --staging-slot-mib must be >= 2");
  }
  const TransferBenchOptions defaults;
  if (!staged && (opt.staging_slots != defaults.staging_slots || opt.staging_slot_mib != defaults.staging_slot_mib)) {
    return absl::InvalidArgumentError("--staging-slots and --staging-slot-mib are for --backend ucx_staged");
  }
  if ((staged || nccl) && opt.op != "push") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend ", opt.backend, " only pushes (the receiver takes part): --op push"));
  }
  if (opt.op != "pull" && opt.op != "push") {
    return absl::InvalidArgumentError(absl::StrFormat("--op %s: want pull or push", opt.op));
  }
  if (opt.target_device_set && opt.backend != "cuda_ipc" && !nccl) {
    return absl::InvalidArgumentError("--target-device is for --backend cuda_ipc or nccl");
  }
  if (opt.target_device < 0) return absl::InvalidArgumentError("--target-device must be >= 0");
  if (nccl && TargetDevice(opt) == 0) {
    return absl::InvalidArgumentError("--backend nccl joins two GPUs: --target-device must not be 0 (the initiator's)");
  }
  if (opt.backend == "loopback") return RunLoopback(opt);
  if (opt.backend == "cuda_ipc") {
#ifdef TANDEM_HAVE_CUDA_IPC
    return RunCudaIpc(opt);
#else
    return absl::UnimplementedError("--backend cuda_ipc: this tandem was built without CUDA");
#endif
  }
  if (nccl) {
#ifdef TANDEM_HAVE_CUDA_IPC
    return RunTwoSided(opt);
#else
    return absl::UnimplementedError("--backend nccl: this tandem was built without CUDA");
#endif
  }
  if (opt.backend != "ucx" && !staged) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend %s: want ucx, ucx_staged, cuda_ipc, nccl or loopback", opt.backend));
  }
#ifdef TANDEM_HAVE_UCX
  if (opt.tls != "shm" && opt.tls != "tcp") {
    return absl::InvalidArgumentError(absl::StrFormat("--tls %s: want shm or tcp", opt.tls));
  }
  return staged ? RunTwoSided(opt) : RunUcx(opt);
#else
  return absl::UnimplementedError("this tandem was built without UCX (TANDEM_WITH_UCX=OFF)");
#endif
}

}  // namespace

void AddTransferBenchCommand(CLI::App& bench) {
  auto opt = std::make_shared<TransferBenchOptions>();
  CLI::App* cmd =
      bench.add_subcommand("transfer", "KV-block transfer bandwidth/latency between two processes vs memcpy");
  cmd->add_option("--op", opt->op, "pull (what a decode worker does in disaggregation) or push")->capture_default_str();
  cmd->add_option("--backend", opt->backend,
                  "ucx, ucx_staged (send/receive through host staging; push), cuda_ipc (GPU pools, one host), nccl "
                  "(GPU pools on two GPUs; push) or loopback")
      ->capture_default_str();
  cmd->add_option("--tls", opt->tls, "UCX transports: shm or tcp (tcp over lo)")->capture_default_str();
  cmd->add_option("--pool", opt->pool,
                  "UCX pools: ucx (allocated by UCX, shareable) or mmap (anonymous, registered); ucx_staged: mmap "
                  "(host) or cuda (GPU 0); nccl: cuda")
      ->capture_default_str();
  cmd->add_flag("--sequential", opt->sequential,
                "Peer block ids in order (one merged run) instead of a random permutation");
  cmd->add_option("--max-blocks", opt->max_blocks, "Largest transfer in 2 MiB blocks (sizes double from 1)")
      ->capture_default_str();
  cmd->add_option("--repeats", opt->repeats, "Timed repeats per size (median)")->capture_default_str();
  cmd->add_flag("--json", opt->json, "One JSON object per size");
  cmd->add_option("--staging-slots", opt->staging_slots, "ucx_staged: staging slots on each side")
      ->capture_default_str();
  cmd->add_option("--staging-slot-mib", opt->staging_slot_mib, "ucx_staged: MiB a staging slot (whole 2 MiB blocks)")
      ->capture_default_str();
  cmd->add_option_function<int>(
      "--target-device",
      [opt](const int& device) {
        opt->target_device = device;
        opt->target_device_set = true;
      },
      "cuda_ipc and nccl: the GPU of the target process's pool (the initiator's is GPU 0; cuda_ipc reaches "
      "another GPU by peer access). Default: 0 for cuda_ipc, 1 for nccl");
  cmd->callback([opt] { ExitWithStatus("bench transfer", RunTransferBench(*opt)); });
}

}  // namespace tandem::worker
