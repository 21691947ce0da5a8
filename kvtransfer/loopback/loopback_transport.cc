#include "kvtransfer/loopback/loopback_transport.h"

#include <atomic>
#include <cstring>
#include <random>

#include "absl/strings/str_format.h"

namespace tandem::kvtransfer {
namespace {}  // namespace

void LoopbackFabric::Register(const std::string& agent_id, const Pool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  pools_[agent_id] = std::make_shared<const Pool>(pool);
}

void LoopbackFabric::Unregister(const std::string& agent_id) {
  std::lock_guard<std::mutex> lock(mu_);
  pools_.erase(agent_id);
}

std::shared_ptr<const LoopbackFabric::Pool> LoopbackFabric::Find(const std::string& agent_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pools_.find(agent_id);
  return it == pools_.end() ? nullptr : it->second;
}

LoopbackTransport::LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric)
    : fabric_(std::move(fabric)), agent_id_(NewAgentId("loopback")) {
  thread_ = std::thread([this] { CopyLoop(); });
}

LoopbackTransport::~LoopbackTransport() {
  fabric_->Unregister(agent_id_);
  std::deque<Transfer> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    pending.swap(queue_);
  }
  cv_.notify_all();
  thread_.join();
  for (Transfer& t : pending) t.done(absl::CancelledError("the transport was destroyed"));
}

absl::Status LoopbackTransport::RegisterPool(const PoolLayout& layout, void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ != nullptr) return absl::FailedPreconditionError("a KV pool is already registered");
  if (base == nullptr || layout.block_bytes <= 0 || layout.num_blocks <= 0) {
    return absl::InvalidArgumentError("RegisterPool: empty pool");
  }
  layout_ = layout;
  base_ = static_cast<uint8_t*>(base);
  fabric_->Register(agent_id_, {layout_, base_});
  return absl::OkStatus();
}

absl::StatusOr<PeerInfo> LoopbackTransport::LocalInfo() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ == nullptr) return absl::FailedPreconditionError("no KV pool registered");
  return PeerInfo{.agent_id = agent_id_, .backend = "loopback", .layout = layout_, .address = ""};
}

absl::Status LoopbackTransport::AddPeer(const PeerInfo& peer) {
  if (peer.backend != "loopback") {
    return absl::InvalidArgumentError(absl::StrFormat("peer %s speaks %s, not loopback", peer.agent_id, peer.backend));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ == nullptr) return absl::FailedPreconditionError("no KV pool registered");
  absl::Status compatible = CheckCompatible(layout_, peer.layout);
  if (!compatible.ok()) return compatible;
  if (fabric_->Find(peer.agent_id) == nullptr) {
    return absl::UnavailableError(absl::StrFormat("peer %s is not reachable", peer.agent_id));
  }
  peers_[peer.agent_id] = peer.layout;
  return absl::OkStatus();
}

void LoopbackTransport::RemovePeer(const std::string& agent_id) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.erase(agent_id);
}

absl::StatusOr<uint64_t> LoopbackTransport::Push(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                 Deadline deadline, TransferDone done) {
  return Start(agent_id, std::move(blocks), deadline, std::move(done), /*push=*/true);
}

absl::StatusOr<uint64_t> LoopbackTransport::Pull(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                 Deadline deadline, TransferDone done) {
  return Start(agent_id, std::move(blocks), deadline, std::move(done), /*push=*/false);
}

absl::StatusOr<uint64_t> LoopbackTransport::Start(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                  Deadline deadline, TransferDone done, bool push) {
  std::unique_lock<std::mutex> lock(mu_);
  auto peer = peers_.find(agent_id);
  if (peer == peers_.end()) {
    return absl::NotFoundError(absl::StrFormat("unknown KV transfer peer %s", agent_id));
  }
  const int64_t local_blocks = layout_.num_blocks, remote_blocks = peer->second.num_blocks;
  absl::StatusOr<std::vector<CopyRun>> runs =
      PlanRuns(blocks, layout_.block_bytes, push ? local_blocks : remote_blocks, push ? remote_blocks : local_blocks);
  if (!runs.ok()) return runs.status();
  const uint64_t id = next_id_++;
  queue_.push_back(Transfer{id, agent_id, push, std::move(*runs), deadline, std::move(done)});
  lock.unlock();
  cv_.notify_one();
  return id;
}

void LoopbackTransport::Cancel(uint64_t transfer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_[transfer_id] = true;
}

void LoopbackTransport::CopyLoop() {
  while (true) {
    Transfer t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      t = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status = absl::OkStatus();
    std::shared_ptr<const LoopbackFabric::Pool> peer = fabric_->Find(t.peer);
    for (const CopyRun& run : t.runs) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (cancelled_.erase(t.id) > 0)
          status = absl::CancelledError("transfer cancelled");
        else if (!peers_.contains(t.peer) || peer == nullptr) {
          status = absl::UnavailableError(absl::StrFormat("peer %s is gone", t.peer));
        }
      }
      if (status.ok() && std::chrono::steady_clock::now() > t.deadline) {
        status = absl::DeadlineExceededError("KV transfer deadline passed");
      }
      if (!status.ok()) break;
      uint8_t* local = base_;
      if (t.push) {
        std::memcpy(peer->base + run.dst_offset, local + run.src_offset, run.bytes);
      } else {
        std::memcpy(local + run.dst_offset, peer->base + run.src_offset, run.bytes);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_.erase(t.id);
    }
    t.done(status);
  }
}

}  // namespace tandem::kvtransfer
