// The in-process fake of NcclApi (nccl_api.h): communicators of one fabric
// by unique id, sends and receives matched one by one in posting order per
// direction (a group is done when all its buffers met theirs), host memory
// moved with memcpy. Copies run once the group they wait for is done; a
// group that waits for copies keeps its place in the matching order but
// matches only once they ran (as a stream waits for an event).
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvtransfer/nccl/nccl_api.h"

namespace tandem::kvtransfer {

class FakeNcclFabric {
 public:
  struct Group {
    std::vector<NcclApi::Buffer> buffers;
    size_t unmatched = 0;  // a copy group: 1 until its copies ran
    bool ready = true;     // false: waits for `after` before it matches
    std::shared_ptr<Group> after;
    std::vector<NcclApi::Copy> copies;
    bool copy = false;
  };
  struct Op {
    std::shared_ptr<Group> group;
    size_t index;
    const NcclApi::Buffer& buffer() const { return group->buffers[index]; }
  };
  struct Pair {
    bool joined[2] = {false, false};
    absl::Status failed;                          // set once: every ticket of the pair fails
    std::deque<Op> posted[2][2];                  // [rank][send]
    std::vector<std::shared_ptr<Group>> waiting;  // copies and groups whose `after` is not done
  };
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Pair>> pairs;

  // Runs the copies and readies the groups whose `after` is done, and moves
  // what both sides of a direction have posted, until nothing changes.
  // REQUIRES: mu held.
  static void Match(Pair& p) {
    for (bool progress = true; progress && p.failed.ok();) {
      progress = false;
      for (auto it = p.waiting.begin(); it != p.waiting.end();) {
        Group& g = **it;
        if (g.after->unmatched > 0) {
          ++it;
          continue;
        }
        Run(g);
        it = p.waiting.erase(it);
        progress = true;
      }
      progress |= MatchPosted(p);
    }
  }
  // A copy group's copies (it is done after), or a group made ready.
  static void Run(Group& g) {
    if (!g.copy) {
      g.ready = true;
      return;
    }
    for (const NcclApi::Copy& c : g.copies) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    g.unmatched = 0;
  }
  static bool MatchPosted(Pair& p) {
    bool moved = false;
    for (int from = 0; from < 2; ++from) {
      auto& sends = p.posted[from][1];
      auto& recvs = p.posted[1 - from][0];
      while (p.failed.ok() && !sends.empty() && !recvs.empty()) {
        const Op s = sends.front(), r = recvs.front();
        if (!s.group->ready || !r.group->ready) break;
        moved = true;
        sends.pop_front();
        recvs.pop_front();
        if (s.buffer().bytes != r.buffer().bytes) {
          p.failed = absl::InternalError(
              absl::StrFormat("fake NCCL: a %d-byte send met a %d-byte receive", s.buffer().bytes, r.buffer().bytes));
          return true;
        }
        std::memcpy(r.buffer().data, s.buffer().data, static_cast<size_t>(s.buffer().bytes));
        --s.group->unmatched;
        --r.group->unmatched;
      }
    }
    return moved;
  }
};

namespace {

class FakeNccl final : public NcclApi {
 public:
  explicit FakeNccl(std::shared_ptr<FakeNcclFabric> fabric) : fabric_(std::move(fabric)) {}

  absl::StatusOr<std::string> UniqueId() override {
    static std::atomic<uint64_t> counter{0};
    std::string id(kUniqueIdBytes, '\0');
    std::mt19937_64 rng(std::random_device{}() ^ counter.fetch_add(1));
    for (char& c : id) c = static_cast<char>(rng());
    return id;
  }

  absl::StatusOr<void*> InitRank(std::string_view unique_id, int rank, int device) override {
    (void)device;
    if (unique_id.size() != kUniqueIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("NCCL unique id of %d bytes, want %d", unique_id.size(), kUniqueIdBytes));
    }
    if (rank != 0 && rank != 1) return absl::InvalidArgumentError(absl::StrFormat("NCCL rank %d of 2", rank));
    std::lock_guard<std::mutex> lock(fabric_->mu);
    std::shared_ptr<FakeNcclFabric::Pair>& pair = fabric_->pairs[std::string(unique_id)];
    if (pair == nullptr) pair = std::make_shared<FakeNcclFabric::Pair>();
    if (pair->joined[rank]) return absl::AlreadyExistsError(absl::StrFormat("rank %d joined this id already", rank));
    pair->joined[rank] = true;
    return static_cast<void*>(new Comm{pair, rank, {}, 0});
  }

  absl::StatusOr<bool> Ready(void* handle) override {
    Comm& c = *static_cast<Comm*>(handle);
    std::lock_guard<std::mutex> lock(fabric_->mu);
    if (!c.pair->failed.ok()) return c.pair->failed;
    return c.pair->joined[0] && c.pair->joined[1];
  }

  absl::StatusOr<uint64_t> Group(void* handle, bool send, std::span<const Buffer> buffers, uint64_t after) override {
    Comm& c = *static_cast<Comm*>(handle);
    std::lock_guard<std::mutex> lock(fabric_->mu);
    if (!c.pair->failed.ok()) return c.pair->failed;
    if (!(c.pair->joined[0] && c.pair->joined[1])) {
      return absl::FailedPreconditionError("NCCL group on a communicator not ready");
    }
    auto group = std::make_shared<FakeNcclFabric::Group>();
    group->buffers.assign(buffers.begin(), buffers.end());
    group->unmatched = buffers.size();
    Wait(handle, group, after);
    for (size_t i = 0; i < buffers.size(); ++i) c.pair->posted[c.rank][send ? 1 : 0].push_back({group, i});
    const uint64_t ticket = ++c.next_ticket;
    c.tickets[ticket] = group;
    FakeNcclFabric::Match(*c.pair);
    return ticket;
  }

  absl::StatusOr<uint64_t> Copies(void* handle, std::span<const Copy> copies, uint64_t after) override {
    Comm& c = *static_cast<Comm*>(handle);
    std::lock_guard<std::mutex> lock(fabric_->mu);
    if (!c.pair->failed.ok()) return c.pair->failed;
    auto group = std::make_shared<FakeNcclFabric::Group>();
    group->copy = true;
    group->copies.assign(copies.begin(), copies.end());
    group->unmatched = 1;
    if (!Wait(handle, group, after)) FakeNcclFabric::Run(*group);
    const uint64_t ticket = ++c.next_ticket;
    c.tickets[ticket] = group;
    FakeNcclFabric::Match(*c.pair);
    return ticket;
  }

  // Makes `group` wait for the group of ticket `after` where that is not
  // done yet (true). REQUIRES: mu held.
  bool Wait(void* handle, const std::shared_ptr<FakeNcclFabric::Group>& group, uint64_t after) {
    Comm& c = *static_cast<Comm*>(handle);
    auto it = after != 0 ? c.tickets.find(after) : c.tickets.end();
    if (it == c.tickets.end() || it->second->unmatched == 0) return false;
    group->after = it->second;
    group->ready = false;
    c.pair->waiting.push_back(group);
    return true;
  }

  absl::StatusOr<bool> Done(void* handle, uint64_t ticket) override {
    Comm& c = *static_cast<Comm*>(handle);
    std::lock_guard<std::mutex> lock(fabric_->mu);
    auto it = c.tickets.find(ticket);
    if (it == c.tickets.end()) return absl::InvalidArgumentError("unknown NCCL ticket");
    if (!c.pair->failed.ok()) {
      c.tickets.erase(it);
      return c.pair->failed;
    }
    if (it->second->unmatched > 0) return false;
    c.tickets.erase(it);
    return true;
  }

  void Abort(void* handle) override {
    auto* c = static_cast<Comm*>(handle);
    {
      std::lock_guard<std::mutex> lock(fabric_->mu);
      if (c->pair->failed.ok()) {
        c->pair->failed = absl::UnavailableError(absl::StrFormat("NCCL communicator aborted by rank %d", c->rank));
      }
    }
    delete c;
  }

  void Destroy(void* handle) override { delete static_cast<Comm*>(handle); }

  absl::StatusOr<bool> Idle(void* handle) override {
    Comm& c = *static_cast<Comm*>(handle);
    std::lock_guard<std::mutex> lock(fabric_->mu);
    if (!c.pair->failed.ok()) return c.pair->failed;
    return true;  // a group is matched as far as it can be when posted
  }
  absl::StatusOr<void*> Alloc(int, int64_t bytes) override { return static_cast<void*>(new uint8_t[bytes]()); }
  void Free(int, void* buffer) override { delete[] static_cast<uint8_t*>(buffer); }
  absl::Status Write(void*, void* buffer, const void* src, int64_t bytes) override {
    std::memcpy(buffer, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status Read(void*, void* dst, const void* buffer, int64_t bytes) override {
    std::memcpy(dst, buffer, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::StatusOr<bool> EventDone(void*) override { return true; }
  std::string DeviceBusId(int) override { return ""; }

 private:
  struct Comm {
    std::shared_ptr<FakeNcclFabric::Pair> pair;
    int rank;
    std::map<uint64_t, std::shared_ptr<FakeNcclFabric::Group>> tickets;
    uint64_t next_ticket;
  };
  const std::shared_ptr<FakeNcclFabric> fabric_;
};

}  // namespace

std::shared_ptr<FakeNcclFabric> NewFakeNcclFabric() { return std::make_shared<FakeNcclFabric>(); }

std::unique_ptr<NcclApi> NewFakeNccl(std::shared_ptr<FakeNcclFabric> fabric) {
  return std::make_unique<FakeNccl>(std::move(fabric));
}

}  // namespace tandem::kvtransfer
