#include "kvtransfer/loopback/fault_injecting_transport.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace tandem::kvtransfer {

absl::StatusOr<Faults> ParseFaults(absl::string_view spec) {
  Faults f;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    int value = 0;
    const bool has_value = !kv.second.empty() && absl::SimpleAtoi(kv.second, &value) && value >= 0;
    if (kv.first == "drop" && kv.second.empty()) {
      f.drop = true;
    } else if (kv.first == "corrupt" && kv.second.empty()) {
      f.corrupt = true;
    } else if (kv.first == "fail_submit" && kv.second.empty()) {
      f.fail_submit = true;
    } else if (kv.first == "fail_pair" && kv.second.empty()) {
      f.fail_pair = true;
    } else if (kv.first == "offer_pairing" && kv.second.empty()) {
      f.offer_pairing = true;
    } else if (kv.first == "delay_ms" && has_value) {
      f.delay = std::chrono::milliseconds(value);
    } else if (kv.first == "fail_after_blocks" && has_value) {
      f.fail_after_blocks = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("bad fault '", item,
                                                     "': expected drop, corrupt, fail_submit, fail_pair, "
                                                     "offer_pairing, delay_ms=N or fail_after_blocks=N"));
    }
  }
  return f;
}

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {
  timer_ = std::thread([this] { TimerLoop(); });
}

FaultInjectingTransport::~FaultInjectingTransport() {
  std::map<uint64_t, Held> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    held.swap(held_);
  }
  cv_.notify_all();
  timer_.join();
  for (auto& [id, h] : held) h.request.done(absl::CancelledError("the transport was destroyed"));
}

void FaultInjectingTransport::SetFaults(const Faults& faults) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_ = faults;
}

int FaultInjectingTransport::held_transfers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(held_.size());
}

absl::Status FaultInjectingTransport::RegisterPool(const PoolLayout& layout, void* base) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    num_blocks_ = layout.num_blocks;
  }
  return inner_->RegisterPool(layout, base);
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Push(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                       Deadline deadline, TransferDone done) {
  return Start(Request{agent_id, std::move(blocks), deadline, std::move(done), Op::kPush});
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Pull(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                       Deadline deadline, TransferDone done) {
  return Start(Request{agent_id, std::move(blocks), deadline, std::move(done), Op::kPull});
}

absl::StatusOr<uint64_t> FaultInjectingTransport::PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                            std::shared_ptr<const WriteFence> after, uint64_t tag,
                                                            Deadline deadline, TransferDone done) {
  if (!inner_->capabilities().needs_pairing) {
    return Transport::PushAfter(agent_id, std::move(blocks), std::move(after), tag, deadline, std::move(done));
  }
  if (after == nullptr) return absl::InvalidArgumentError("PushAfter: no write fence");
  return Start(Request{agent_id, std::move(blocks), deadline, std::move(done), Op::kPushAfter, tag, std::move(after)});
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Receive(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                          uint64_t tag, Deadline deadline, TransferDone done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (faults_.fail_submit) return absl::UnavailableError("injected: peer unreachable");
  }
  return inner_->Receive(agent_id, std::move(blocks), tag, deadline, std::move(done));
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Forward(Request r) {
  switch (r.op) {
    case Op::kPush:
      return inner_->Push(r.agent_id, std::move(r.blocks), r.deadline, std::move(r.done));
    case Op::kPull:
      return inner_->Pull(r.agent_id, std::move(r.blocks), r.deadline, std::move(r.done));
    case Op::kPushAfter:
      break;
  }
  return inner_->PushAfter(r.agent_id, std::move(r.blocks), std::move(r.after), r.tag, r.deadline, std::move(r.done));
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Start(Request r) {
  std::vector<BlockPair>& blocks = r.blocks;
  TransferDone& done = r.done;
  Faults f;
  int64_t num_blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    f = faults_;
    num_blocks = num_blocks_;
  }
  if (f.fail_submit) return absl::UnavailableError("injected: peer unreachable");
  if (f.corrupt && !blocks.empty() && num_blocks > 1) {
    // Read the wrong block: a neighbour, which exists in any pool of two
    // blocks or more (push: the local pool; pull: the peer's).
    blocks[0].src = blocks[0].src > 0 ? blocks[0].src - 1 : blocks[0].src + 1;
  }
  if (f.fail_after_blocks >= 0 && f.fail_after_blocks < static_cast<int>(blocks.size())) {
    blocks.resize(f.fail_after_blocks);
    done = [inner = std::move(done)](absl::Status st) {
      inner(st.ok() ? absl::UnavailableError("injected: peer lost mid-transfer") : st);
    };
  }
  if (!f.drop && f.delay.count() == 0) return Forward(std::move(r));
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  held_[id] = Held{std::move(r), f.drop, std::chrono::steady_clock::now() + f.delay};
  cv_.notify_all();
  return id;
}

void FaultInjectingTransport::Cancel(uint64_t transfer_id) {
  TransferDone done;
  uint64_t inner_id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = held_.find(transfer_id);
    if (h != held_.end()) {
      done = std::move(h->second.request.done);
      held_.erase(h);
    } else {
      auto i = inner_ids_.find(transfer_id);
      inner_id = i != inner_ids_.end() ? i->second : transfer_id;
    }
  }
  if (done) {
    done(absl::CancelledError("transfer cancelled"));
  } else {
    inner_->Cancel(inner_id);
  }
}

void FaultInjectingTransport::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    auto next = now + std::chrono::hours(1);
    for (auto it = held_.begin(); it != held_.end();) {
      Held& h = it->second;
      const Deadline deadline = h.request.deadline;
      const bool expired = now >= deadline;
      const bool released = !h.dropped && now >= h.release;
      if (!expired && !released) {
        next = std::min(next, h.dropped ? deadline : std::min(deadline, h.release));
        ++it;
        continue;
      }
      const uint64_t id = it->first;
      Held taken = std::move(h);
      it = held_.erase(it);
      lock.unlock();
      Request& r = taken.request;
      if (expired) {
        r.done(absl::DeadlineExceededError("KV transfer deadline passed"));
      } else {
        // The caller cancels by our id: map it to the inner id until done.
        TransferDone done = r.done;
        r.done = [this, id, done](absl::Status st) {
          {
            std::lock_guard<std::mutex> l(mu_);
            inner_ids_.erase(id);
          }
          done(std::move(st));
        };
        absl::Status refused;
        {
          std::lock_guard<std::mutex> l(mu_);  // `r.done` cannot run before the id is mapped
          absl::StatusOr<uint64_t> inner = Forward(std::move(r));
          if (inner.ok())
            inner_ids_[id] = *inner;
          else
            refused = inner.status();
        }
        if (!refused.ok()) done(refused);
      }
      lock.lock();
      it = held_.begin();  // the map may have changed while unlocked
    }
    // stop_ may have been set (and notified) while the lock was released above.
    if (!stop_) cv_.wait_until(lock, next);
  }
}

absl::StatusOr<std::string> FaultInjectingTransport::Pair(const PeerInfo& peer, PairRole role, std::string_view offer,
                                                          Deadline deadline, TransferDone done) {
  bool offers = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (faults_.fail_pair) return absl::UnavailableError("injected: pairing with the peer failed");
    offers = faults_.offer_pairing;
  }
  if (!offers) return inner_->Pair(peer, role, offer, deadline, std::move(done));
  const std::string kOffer = "tandem-offer:";
  if (role == PairRole::kResponder) {
    if (offer != kOffer + peer.agent_id) {
      return absl::UnavailableError(
          absl::StrCat("injected: pairing without the initiator's offer (got '", std::string(offer), "')"));
    }
    return inner_->Pair(peer, role, "", deadline, std::move(done));
  }
  ASSIGN_OR_RETURN(PeerInfo local, inner_->LocalInfo());
  absl::StatusOr<std::string> joined = inner_->Pair(peer, role, "", deadline, [](absl::Status) {});
  if (!joined.ok()) return joined.status();
  // Completes later, as a communicator does once both sides joined.
  std::thread([done = std::move(done)] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    done(absl::OkStatus());
  }).detach();
  return kOffer + local.agent_id;
}

}  // namespace tandem::kvtransfer
