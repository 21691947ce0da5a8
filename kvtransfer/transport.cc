#include "kvtransfer/transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace tandem::kvtransfer {
namespace {

template <typename T>
absl::Status Mismatch(const char* field, const T& local, const T& remote) {
  return absl::FailedPreconditionError(
      absl::StrCat("KV pool layouts differ in ", field, ": local ", local, ", peer ", remote));
}

}  // namespace

absl::Status CheckCompatible(const PoolLayout& local, const PoolLayout& remote) {
  if (local.model != remote.model) return Mismatch("model", local.model, remote.model);
  if (local.dtype != remote.dtype) return Mismatch("dtype", local.dtype, remote.dtype);
  if (local.num_layers != remote.num_layers) {
    return Mismatch("num_layers", local.num_layers, remote.num_layers);
  }
  if (local.num_kv_heads != remote.num_kv_heads) {
    return Mismatch("num_kv_heads", local.num_kv_heads, remote.num_kv_heads);
  }
  if (local.head_dim != remote.head_dim) return Mismatch("head_dim", local.head_dim, remote.head_dim);
  if (local.block_size != remote.block_size) {
    return Mismatch("block_size", local.block_size, remote.block_size);
  }
  if (local.block_bytes != remote.block_bytes) {
    return Mismatch("block_bytes", local.block_bytes, remote.block_bytes);
  }
  if (local.block_bytes <= 0) {
    return absl::InvalidArgumentError("KV pool layout has no bytes per block");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CopyRun>> PlanRuns(std::span<const BlockPair> blocks, int64_t block_bytes,
                                              int64_t src_blocks, int64_t dst_blocks) {
  std::vector<CopyRun> runs;
  absl::flat_hash_set<int32_t> seen_dst;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockPair& b = blocks[i];
    if (b.src < 0 || b.src >= src_blocks) {
      return absl::InvalidArgumentError(
          absl::StrFormat("block pair %d: source block %d outside [0, %d)", i, b.src, src_blocks));
    }
    if (b.dst < 0 || b.dst >= dst_blocks) {
      return absl::InvalidArgumentError(
          absl::StrFormat("block pair %d: destination block %d outside [0, %d)", i, b.dst, dst_blocks));
    }
    if (!seen_dst.insert(b.dst).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("block pair %d: destination block %d is written twice", i, b.dst));
    }
    AppendRun(runs, {int64_t{b.src} * block_bytes, int64_t{b.dst} * block_bytes, block_bytes});
  }
  return runs;
}

void AppendRun(std::vector<CopyRun>& runs, const CopyRun& run) {
  if (!runs.empty() && runs.back().src_offset + runs.back().bytes == run.src_offset &&
      runs.back().dst_offset + runs.back().bytes == run.dst_offset) {
    runs.back().bytes += run.bytes;
  } else {
    runs.push_back(run);
  }
}

std::string NewAgentId(std::string_view backend) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrFormat("%s-%d-%08x%08x-%d", backend, getpid(), rd(), rd(), counter.fetch_add(1));
}

bool TransportCapabilities::Moves(MemoryType m) const {
  return std::find(memory.begin(), memory.end(), m) != memory.end();
}

void TransportRegistry::Register(std::string name, TransportCapabilities capabilities, Factory factory) {
  CHECK(entries_.count(name) == 0) << "transport " << name << " registered twice";
  entries_.emplace(std::move(name), Entry{std::move(capabilities), std::move(factory)});
}

absl::StatusOr<std::unique_ptr<Transport>> TransportRegistry::Create(std::string_view name,
                                                                     const TransportOptions& options) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-transport must be none or one of ",
                                                   absl::StrJoin(names(), ", "), ", got '", std::string(name), "'"));
  }
  return it->second.factory(options);
}

const TransportCapabilities* TransportRegistry::Capabilities(std::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second.capabilities;
}

std::vector<std::string> TransportRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

namespace {
class CompletedWrites final : public WriteFence {
 public:
  MemoryType memory() const override { return MemoryType::kHost; }
  absl::Status Wait(Deadline) const override { return absl::OkStatus(); }
  bool Completed() const override { return true; }
};
}  // namespace

std::shared_ptr<const WriteFence> CompletedFence() {
  static const std::shared_ptr<const WriteFence> fence = std::make_shared<CompletedWrites>();
  return fence;
}

absl::StatusOr<std::string> Transport::Pair(const PeerInfo& peer, PairRole role, std::string_view offer,
                                            Deadline deadline, TransferDone done) {
  (void)role;
  (void)offer;
  if (std::chrono::steady_clock::now() >= deadline) {
    return absl::DeadlineExceededError("pairing: the deadline passed before it started");
  }
  if (absl::Status st = AddPeer(peer); !st.ok()) return st;
  done(absl::OkStatus());
  return std::string();
}

absl::StatusOr<uint64_t> Transport::PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                              std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                              TransferDone done) {
  (void)tag;
  if (after == nullptr) return absl::InvalidArgumentError("PushAfter: no write fence");
  if (after->memory() == MemoryType::kCuda && !capabilities().Moves(MemoryType::kCuda)) {
    return absl::FailedPreconditionError(absl::StrCat("PushAfter: the ", backend(),
                                                      " transport does not move GPU memory, and the blocks' writes are "
                                                      "a GPU fence"));
  }
  if (absl::Status st = after->Wait(deadline); !st.ok()) return st;
  return Push(agent_id, std::move(blocks), deadline, std::move(done));
}

absl::StatusOr<uint64_t> Transport::Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                            Deadline deadline, TransferDone done) {
  (void)agent_id;
  (void)blocks;
  (void)tag;
  (void)deadline;
  (void)done;
  return absl::UnimplementedError(absl::StrCat("the ", backend(),
                                               " transport is one-sided: it reads or writes the peer's pool without "
                                               "a matching Receive"));
}

}  // namespace tandem::kvtransfer
