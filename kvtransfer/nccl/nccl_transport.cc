#include "kvtransfer/nccl/nccl_transport.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/process_info.h"
#include "common/status_macros.h"

namespace tandem::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;

// LocalInfo().address: "boot=<host boot id>;bus=<PCI bus id>;pid=<pid>;
// pidns=<pid namespace>;start=<start time>;wire=<header version>" (any may
// be empty or 0: not known; a wire of 0 is a build before versions). The
// process fields let a peer of the same host and pid namespace see this
// process exit.
struct NcclAddress {
  int wire = 0;
  std::string boot;
  std::string bus;
  int64_t pid = 0;
  std::string pidns;
  uint64_t start = 0;
};
NcclAddress DecodeAddress(absl::string_view text) {
  NcclAddress a;
  for (absl::string_view field : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&field, "boot=")) a.boot = std::string(field);
    if (absl::ConsumePrefix(&field, "bus=")) a.bus = std::string(field);
    if (absl::ConsumePrefix(&field, "pid=") && !absl::SimpleAtoi(field, &a.pid)) a.pid = 0;
    if (absl::ConsumePrefix(&field, "pidns=")) a.pidns = std::string(field);
    if (absl::ConsumePrefix(&field, "start=") && !absl::SimpleAtoi(field, &a.start)) a.start = 0;
    if (absl::ConsumePrefix(&field, "wire=") && !absl::SimpleAtoi(field, &a.wire)) a.wire = 0;
  }
  return a;
}

// Runs cut into pieces of at most `max` bytes (the same cut on both sides).
std::vector<CopyRun> Pieces(const std::vector<CopyRun>& runs, int64_t max) {
  std::vector<CopyRun> out;
  for (const CopyRun& r : runs) {
    for (int64_t off = 0; off < r.bytes; off += max) {
      out.push_back({r.src_offset + off, r.dst_offset + off, std::min(max, r.bytes - off)});
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(NcclOptions options) {
  std::shared_ptr<NcclApi> api = options.api;
  if (api == nullptr) {
    ASSIGN_OR_RETURN(std::unique_ptr<NcclApi> loaded, LoadNccl());
    api = std::move(loaded);
  }
  if (options.device < 0) return absl::InvalidArgumentError(absl::StrFormat("NCCL on GPU %d", options.device));
  if (options.stage_piece <= 0 || options.stage_piece % 16 != 0 || options.stage_piece > kMaxPiece) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NCCL staging pieces of %d bytes: want a multiple of 16 up to %d (a drain's scratch buffer)",
                        options.stage_piece, kMaxPiece));
  }
  return std::unique_ptr<NcclTransport>(new NcclTransport(std::move(options), std::move(api)));
}

NcclTransport::NcclTransport(NcclOptions options, std::shared_ptr<NcclApi> api)
    : options_(std::move(options)),
      api_(std::move(api)),
      agent_id_(NewAgentId("nccl")),
      bus_id_(api_->DeviceBusId(options_.device)) {
  thread_ = std::thread([this] { ProgressLoop(); });
}

NcclTransport::~NcclTransport() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, comm] : comms_) {
      FailComm(key.first, comm, absl::CancelledError("the NCCL transport was destroyed"), finished);
    }
    comms_.clear();
    if (scratch_ != nullptr) api_->Free(options_.device, scratch_);
    scratch_ = nullptr;
  }
  for (auto& [done, st] : finished) done(absl::CancelledError(st.message()));
}

TransportCapabilities NcclTransport::capabilities() const {
  TransportCapabilities c = Capabilities();
  if (options_.host_pools) c.memory = {MemoryType::kHost};
  return c;
}

absl::Status NcclTransport::RegisterPool(const PoolLayout& layout, void* base) {
  if (base == nullptr) return absl::InvalidArgumentError("RegisterPool: null pool");
  if (options_.host_pools) {
    if (layout.memory_type != MemoryType::kHost) {
      return absl::InvalidArgumentError("this NCCL transport (host pools, over a fake NCCL) takes a host pool");
    }
  } else if (layout.memory_type != MemoryType::kCuda || layout.device_id != options_.device) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-transport nccl moves a GPU pool on GPU %d; this pool is %s", options_.device,
                        layout.memory_type == MemoryType::kCuda ? absl::StrCat("on GPU ", layout.device_id)
                                                                : std::string("in host memory")));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ != nullptr) return absl::FailedPreconditionError("a pool is already registered");
  layout_ = layout;
  base_ = static_cast<unsigned char*>(base);
  return absl::OkStatus();
}

absl::StatusOr<PeerInfo> NcclTransport::LocalInfo() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ == nullptr) return absl::FailedPreconditionError("LocalInfo before RegisterPool");
  return PeerInfo{.agent_id = agent_id_,
                  .backend = "nccl",
                  .layout = layout_,
                  .address = absl::StrCat("boot=", HostBootId(), ";bus=", bus_id_, ";pid=", getpid(), ";pidns=",
                                          PidNamespace(), ";start=", OwnStartTime(), ";wire=", kWireVersion)};
}

absl::Status NcclTransport::AddPeer(const PeerInfo& peer) {
  if (peer.backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer.agent_id, " runs the ", peer.backend, " transport; this worker runs nccl"));
  }
  const NcclAddress there = DecodeAddress(peer.address);
  std::lock_guard<std::mutex> lock(mu_);
  if (base_ == nullptr) return absl::FailedPreconditionError("AddPeer before RegisterPool");
  RETURN_IF_ERROR(CheckCompatible(layout_, peer.layout));
  if (there.wire != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "peer %s speaks version %d of the NCCL push header (0: a build before versions), this worker %d: the two "
        "builds cannot push to each other (upgrade both)",
        peer.agent_id, there.wire, kWireVersion));
  }
  if (!bus_id_.empty() && there.bus == bus_id_ && !there.boot.empty() && there.boot == HostBootId()) {
    return absl::FailedPreconditionError(
        absl::StrCat("peer ", peer.agent_id, "'s pool is on this worker's GPU (", bus_id_,
                     "): NCCL joins two different GPUs; use --kv-transport cuda_ipc on one GPU"));
  }
  Peer& p = peers_[peer.agent_id];
  p.info = peer;
  // Watched where its exit can be seen: this host, this pid namespace.
  const bool watchable = !there.boot.empty() && there.boot == HostBootId() && !there.pidns.empty() &&
                         there.pidns == PidNamespace() && there.pid > 0 && there.start != 0;
  p.pid = watchable ? there.pid : 0;
  p.start = watchable ? there.start : 0;
  return absl::OkStatus();
}

void NcclTransport::RemovePeer(const std::string& agent_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_.erase(agent_id);
    for (auto& [key, comm] : comms_) {
      if (key.first == agent_id && comm.doomed.ok()) comm.doomed = absl::UnavailableError("the peer was removed");
    }
  }
  cv_.notify_all();
}

absl::StatusOr<uint64_t> NcclTransport::Push(const std::string&, std::vector<BlockPair>, Deadline, TransferDone) {
  return absl::FailedPreconditionError(
      "the nccl transport sends what its peer receives: PushAfter with the tag of the peer's Receive");
}

absl::StatusOr<uint64_t> NcclTransport::Pull(const std::string&, std::vector<BlockPair>, Deadline, TransferDone) {
  return absl::UnimplementedError("the nccl transport cannot pull: its peer pushes (send/receive)");
}

void NcclTransport::Cancel(uint64_t transfer_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = xfers_.find(transfer_id);
    if (it == xfers_.end() || it->second.declined) return;  // (a push that ended, its decline queued)
    it->second.cancelled = true;
  }
  cv_.notify_all();
}

absl::StatusOr<std::string> NcclTransport::Pair(const PeerInfo& peer, PairRole role, std::string_view offer,
                                                Deadline deadline, TransferDone done) {
  if (Clock::now() >= deadline) return absl::DeadlineExceededError("pairing: the deadline passed before it started");
  RETURN_IF_ERROR(AddPeer(peer));
  const int rank = role == PairRole::kInitiator ? 0 : 1;
  std::string id;
  if (rank == 0) {
    if (!offer.empty()) return absl::InvalidArgumentError("NCCL pairing: the initiator takes no offer");
    ASSIGN_OR_RETURN(id, api_->UniqueId());
  } else {
    if (offer.size() != NcclApi::kUniqueIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("NCCL pairing offer of %d bytes from %s; want the %d bytes of the initiator's ncclUniqueId",
                          offer.size(), peer.agent_id, NcclApi::kUniqueIdBytes));
    }
    id = std::string(offer);
    std::lock_guard<std::mutex> lock(mu_);
    // An id joins one communicator once: this side joined it before, and
    // that communicator ended (or it would not pair again).
    if (std::find(joined_offers_.begin(), joined_offers_.end(), id) != joined_offers_.end()) {
      return absl::UnavailableError(absl::StrCat("a pairing offer from ", peer.agent_id,
                                                 " that this worker joined before, whose communicator ended: the "
                                                 "initiator must pair afresh"));
    }
  }
  // The responder's scratch buffer for drains, up front (a drain is a
  // recovery: it must not fail for memory).
  bool need_scratch = false;
  if (rank == 1) {
    std::lock_guard<std::mutex> lock(mu_);
    need_scratch = scratch_ == nullptr;
  }
  if (need_scratch) {
    ASSIGN_OR_RETURN(void* scratch, api_->Alloc(options_.device, kMaxPiece));
    std::lock_guard<std::mutex> lock(mu_);
    if (scratch_ == nullptr) {
      scratch_ = scratch;
    } else {
      api_->Free(options_.device, scratch);
    }
  }
  ASSIGN_OR_RETURN(void* handle, api_->InitRank(id, rank, options_.device));
  absl::StatusOr<void*> headers =
      api_->Alloc(options_.device, rank == 0 ? kHeaderRing * sizeof(Header) : sizeof(Header));
  absl::StatusOr<void*> staging = nullptr;  // none where nothing is staged
  if (headers.ok() && options_.stage_runs_below > 0) staging = api_->Alloc(options_.device, 2 * options_.stage_piece);
  if (!headers.ok() || !staging.ok()) {
    api_->Abort(handle);
    if (headers.ok()) api_->Free(options_.device, *headers);
    return headers.ok() ? staging.status() : headers.status();
  }
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank == 1) {
      joined_offers_.push_back(id);
      if (joined_offers_.size() > 64) joined_offers_.pop_front();
    }
    const CommKey key{peer.agent_id, rank};
    if (auto old = comms_.find(key); old != comms_.end()) {
      FailComm(peer.agent_id, old->second, absl::UnavailableError("replaced by a new pairing"), finished);
      comms_.erase(old);
    }
    Comm& c = comms_[key];
    c.handle = handle;
    c.rank = rank;
    c.pair_deadline = deadline;
    c.pairing.push_back(std::move(done));
    c.headers = *headers;
    c.staging = *staging;
  }
  cv_.notify_all();
  for (auto& [d, st] : finished) d(st);
  return rank == 0 ? id : std::string();
}

absl::StatusOr<uint64_t> NcclTransport::PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                  std::shared_ptr<const WriteFence> after, uint64_t tag,
                                                  Deadline deadline, TransferDone done) {
  if (after == nullptr) return absl::InvalidArgumentError("PushAfter: no write fence");
  return Start(agent_id, std::move(blocks), std::move(after), tag, deadline, std::move(done), /*send=*/true);
}

absl::StatusOr<uint64_t> NcclTransport::Receive(const std::string& agent_id, std::vector<BlockPair> blocks,
                                                uint64_t tag, Deadline deadline, TransferDone done) {
  return Start(agent_id, std::move(blocks), nullptr, tag, deadline, std::move(done), /*send=*/false);
}

void NcclTransport::Decline(const std::string& agent_id, uint64_t tag) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto comm = comms_.find(CommKey{agent_id, 0});
    if (comm == comms_.end() || !comm->second.doomed.ok()) return;  // the pair ended: nothing is posted for it
    const uint64_t id = next_id_++;
    Xfer& x = xfers_[id];
    x.id = id;
    x.send = true;
    x.tag = tag;
    MakeDecline(x);
    comm->second.pending.push_back(id);
  }
  cv_.notify_all();
}

absl::StatusOr<uint64_t> NcclTransport::Start(const std::string& agent_id, std::vector<BlockPair> blocks,
                                              std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                              TransferDone done, bool send) {
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (base_ == nullptr) return absl::FailedPreconditionError("no pool registered");
    auto peer = peers_.find(agent_id);
    if (peer == peers_.end()) return absl::NotFoundError(absl::StrCat("unknown NCCL peer ", agent_id));
    auto comm = comms_.find(CommKey{agent_id, send ? 0 : 1});
    if (comm == comms_.end() || !comm->second.doomed.ok()) {
      // Unavailable: a pairing that ended (its communicator failed) is
      // redone by the caller's next one.
      return absl::UnavailableError(absl::StrFormat("no NCCL communicator with %s as the %s side (Pair %s)", agent_id,
                                                    send ? "sending" : "receiving",
                                                    send ? "as the initiator" : "as the responder"));
    }
    Comm& c = comm->second;
    const int64_t local_blocks = layout_.num_blocks, remote_blocks = peer->second.info.layout.num_blocks;
    ASSIGN_OR_RETURN(std::vector<CopyRun> runs,
                     PlanRuns(blocks, layout_.block_bytes, send ? local_blocks : remote_blocks,
                              send ? remote_blocks : local_blocks));
    runs = Pieces(runs, kMaxPiece);
    if (!send && c.receives.contains(tag)) {
      return absl::AlreadyExistsError(absl::StrFormat("a receive for tag %d from %s is open", tag, agent_id));
    }
    id = next_id_++;
    Xfer& x = xfers_[id];
    x.id = id;
    x.send = send;
    x.tag = tag;
    for (const CopyRun& r : runs) x.bytes += r.bytes;
    // (16-byte multiples: the copy kernel's; both sides' layouts agree)
    x.staged = runs.size() >= 2 && x.bytes / static_cast<int64_t>(runs.size()) < options_.stage_runs_below &&
               layout_.block_bytes % 16 == 0;
    x.runs = std::move(runs);
    x.after = std::move(after);
    x.deadline = deadline;
    x.done = std::move(done);
    if (send) {
      c.pending.push_back(id);
    } else {
      c.receives[tag] = id;
    }
  }
  cv_.notify_all();
  return id;
}

void NcclTransport::ProgressLoop() {
  while (true) {
    Finished finished;
    bool flying = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      flying = Step(finished);
      if (!flying && finished.empty()) {
        // Nothing on the wire: wake for new work, or to check the deadlines
        // of what waits (a pairing, a fence, a receive's push).
        cv_.wait_for(lock, std::chrono::milliseconds(2));
        continue;
      }
    }
    for (auto& [done, st] : finished) done(std::move(st));
    // Bytes expected: spin. A 10 us sleep took ~60 us with the timer's
    // slack, twice a push (the header's arrival, then the data's): a fixed
    // ~0.35 ms a transfer on two H200s.
    if (flying && finished.empty()) std::this_thread::yield();
  }
}

bool NcclTransport::Step(Finished& finished) {
  bool flying = false;
  if (const auto now = Clock::now(); now >= next_watch_) {
    next_watch_ = now + kWatchEvery;
    // A peer process of this host that exited: NCCL may not notice for
    // long (or ever), so its communicators end here.
    for (auto it = peers_.begin(); it != peers_.end();) {
      const Peer& p = it->second;
      const std::optional<uint64_t> start = p.start != 0 ? ProcessStartTime(p.pid) : std::nullopt;
      if (!start.has_value() || *start == p.start) {
        ++it;
        continue;
      }
      for (auto& [key, comm] : comms_) {
        if (key.first == it->first && comm.doomed.ok()) {
          comm.doomed = absl::UnavailableError(absl::StrFormat("the peer's process (pid %d) exited", p.pid));
        }
      }
      peers_.erase(it++);
    }
  }
  for (auto it = comms_.begin(); it != comms_.end();) {
    absl::Status st = Advance(it->first.first, it->second, finished, &flying);
    if (!st.ok()) {
      FailComm(it->first.first, it->second, st, finished);
      it = comms_.erase(it);
    } else {
      ++it;
    }
  }
  return flying;
}

absl::Status NcclTransport::Advance(const std::string& peer, Comm& c, Finished& finished, bool* flying) {
  const auto now = Clock::now();
  if (!c.doomed.ok()) return c.doomed;
  // Transfers not posted yet end here when cancelled or late (a pairing
  // still under way holds none of them).
  auto unposted_end = [&](const Xfer& x) -> absl::Status {
    if (x.cancelled) return absl::CancelledError("cancelled before its bytes moved");
    if (now >= x.deadline) {
      return absl::DeadlineExceededError(x.send ? "the push did not start by its deadline (the blocks' writes, or the "
                                                  "pairing, were not done)"
                                                : "no push for this receive came by its deadline");
    }
    return absl::OkStatus();
  };
  auto end_unposted = [&] {
    if (c.rank == 0) {
      for (auto it = c.pending.begin(); it != c.pending.end();) {
        Xfer& x = xfers_.at(*it);
        absl::Status end = x.posted ? absl::OkStatus() : unposted_end(x);  // posted: a staged push's pieces
        if (end.ok()) {
          ++it;
          continue;
        }
        if (!x.declined) {
          // Its receiver waits for the tag's header: a decline goes in its place.
          finished.emplace_back(std::move(x.done), std::move(end));
          MakeDecline(x);
          ++it;
          continue;
        }
        const uint64_t id = *it;
        it = c.pending.erase(it);
        Finish(id, std::move(end), finished);
      }
      return;
    }
    for (auto it = c.receives.begin(); it != c.receives.end();) {
      const Xfer& x = xfers_.at(it->second);
      absl::Status end = x.posted || x.id == c.awaiting ? absl::OkStatus() : unposted_end(x);
      if (end.ok()) {
        ++it;
        continue;
      }
      const uint64_t id = it->second;
      Ended e{.tag = it->first,
              .runs = static_cast<uint32_t>(x.runs.size()),
              .bytes = x.bytes,
              .piece = PieceOf(x),
              .shape = ShapeOf(x.runs)};
      if (x.staged) {
        e.sizes = PieceSizes(x);
      } else {
        for (const CopyRun& r : x.runs) e.sizes.push_back(r.bytes);
      }
      c.ended.push_back(std::move(e));
      if (c.ended.size() > kEndedTags) c.ended.pop_front();
      c.receives.erase(it++);
      Finish(id, std::move(end), finished);
    }
  };
  if (!c.ready) {
    ASSIGN_OR_RETURN(bool ready, api_->Ready(c.handle));
    if (!ready) {
      if (now >= c.pair_deadline) {
        return absl::DeadlineExceededError(
            absl::StrFormat("NCCL pairing with %s did not complete by its deadline (did the peer join?)", peer));
      }
      end_unposted();
      *flying = true;
      return absl::OkStatus();
    }
    c.ready = true;
    for (TransferDone& d : c.pairing) finished.emplace_back(std::move(d), absl::OkStatus());
    c.pairing.clear();
  }
  // Groups that ended, in stream order.
  while (!c.flights.empty()) {
    ASSIGN_OR_RETURN(bool done, api_->Done(c.handle, c.flights.front().ticket));
    if (!done) break;
    const Flight f = c.flights.front();
    c.flights.pop_front();
    if (f.xfer == 0) {
      c.header_posted = false;
      RETURN_IF_ERROR(TakeHeader(c, finished));
      continue;
    }
    if (f.xfer == kDrainFlight || f.xfer == kPieceFlight) continue;
    const Xfer& x = xfers_.at(f.xfer);
    if (!x.send) c.receives.erase(x.tag);
    Finish(f.xfer, x.cancelled ? absl::CancelledError("cancelled; its bytes had moved already") : absl::OkStatus(),
           finished);
  }
  // A transfer past its deadline on the wire: only an abort ends it.
  for (const Flight& f : c.flights) {
    if (f.xfer == kDrainFlight && now >= f.drain_deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "a drained NCCL push from %s did not end in %d s (the sender gone mid-push?)", peer, kDrainLimit.count()));
    }
    if (f.xfer != 0 && f.xfer != kDrainFlight && f.xfer != kPieceFlight && now >= xfers_.at(f.xfer).deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("an NCCL transfer with %s passed its deadline while its bytes moved", peer));
    }
  }
  for (uint64_t id : c.pending) {  // a staged push part posted
    if (const Xfer& x = xfers_.at(id); x.posted && now >= x.deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("a staged NCCL push to %s passed its deadline while its pieces moved", peer));
    }
  }
  if (c.awaiting != 0 && now >= xfers_.at(c.awaiting).deadline) {
    return absl::DeadlineExceededError(
        absl::StrFormat("an NCCL receive from %s passed its deadline as its push arrived", peer));
  }
  end_unposted();
  if (c.rank == 0) {
    RETURN_IF_ERROR(PostSends(c, finished));
  } else {
    if (c.parked) RETURN_IF_ERROR(ClaimParked(c));
    RETURN_IF_ERROR(PostReceives(c, finished));
  }
  // A header receive left posted alone (for receives that ended, whose
  // headers have not come: a JOIN answer the sender never got) ends the pair
  // past the limit; any Receive or push restarts the clock.
  if (c.rank == 1) {
    const bool alone = c.header_posted && !OwedHeader(c, /*open_only=*/true) && !c.parked && c.awaiting == 0 &&
                       !c.drain.has_value() && c.flights.size() == 1;
    if (!alone) {
      c.idle_since = now;
    } else if (now - c.idle_since >= options_.idle_receive_limit) {
      return absl::UnavailableError(absl::StrFormat(
          "the NCCL header receive from %s stayed posted %d ms with no receive open (it holds whatever waits for "
          "the whole GPU): the pair ends, and the next push pairs afresh",
          peer, options_.idle_receive_limit.count()));
    }
  }
  // Polled fast only while bytes are expected (an idle receiver's header
  // receive alone waits for the slow tick, or a new transfer's wake-up).
  const bool expecting = !c.pending.empty() || !c.receives.empty() || c.parked || c.awaiting != 0 ||
                         c.drain.has_value() ||
                         std::any_of(c.flights.begin(), c.flights.end(), [](const Flight& f) { return f.xfer != 0; });
  if (expecting) *flying = true;
  return absl::OkStatus();
}

absl::Status NcclTransport::PostSends(Comm& c, Finished& finished) {
  if (c.staging_xfer != 0) {
    // A staged push's pieces go before anything else (the receiver posts
    // them after its header).
    ASSIGN_OR_RETURN(bool all, PostPieces(c, xfers_.at(c.staging_xfer)));
    if (!all) return absl::OkStatus();
    c.pending.erase(std::find(c.pending.begin(), c.pending.end(), c.staging_xfer));
    c.staging_xfer = 0;
  }
  for (auto it = c.pending.begin(); it != c.pending.end() && c.flights.size() < kMaxInFlight;) {
    Xfer& x = xfers_.at(*it);
    if (x.after != nullptr) {
      absl::StatusOr<bool> written = true;
      if (!x.after->Completed()) {
        if (x.after->memory() == MemoryType::kCuda && x.after->cuda_event() != nullptr) {
          written = api_->EventDone(x.after->cuda_event());
        } else {
          const absl::Status waited = x.after->Wait(Clock::now());
          if (waited.ok() || waited.code() == absl::StatusCode::kDeadlineExceeded) {
            written = waited.ok();
          } else {
            written = waited;  // the writes' own error
          }
        }
      }
      if (!written.ok()) {
        // (its receiver still gets the tag's header: a decline)
        finished.emplace_back(std::move(x.done), written.status());
        MakeDecline(x);
        continue;
      }
      if (!*written) {
        ++it;
        continue;
      }
      x.after = nullptr;
    }
    ASSIGN_OR_RETURN(bool idle, api_->Idle(c.handle));
    if (!idle) return absl::OkStatus();
    const Header h{.magic = x.declined ? kDeclined : kMagic,
                   .runs = static_cast<uint32_t>(x.runs.size()),
                   .tag = x.tag,
                   .bytes = x.bytes,
                   .piece = PieceOf(x),
                   .shape = ShapeOf(x.runs)};
    auto* slot = static_cast<unsigned char*>(c.headers) + (c.headers_sent % kHeaderRing) * sizeof(Header);
    RETURN_IF_ERROR(api_->Write(c.handle, slot, &h, sizeof(h)));
    ++c.headers_sent;
    std::vector<NcclApi::Buffer> buffers{{slot, static_cast<int64_t>(sizeof(Header))}};
    if (!x.staged) {
      for (const CopyRun& r : x.runs) buffers.push_back({base_ + r.src_offset, r.bytes});
    }
    ASSIGN_OR_RETURN(uint64_t ticket, api_->Group(c.handle, /*send=*/true, buffers));
    x.posted = true;
    if (x.staged) {
      c.flights.push_back({ticket, kPieceFlight});
      c.staging_xfer = x.id;
      return PostSends(c, finished);
    }
    c.flights.push_back({ticket, x.id});
    it = c.pending.erase(it);
  }
  return absl::OkStatus();
}

std::vector<int64_t> NcclTransport::PieceSizes(const Xfer& x) const {
  std::vector<int64_t> sizes;
  for (int64_t off = 0; off < x.bytes; off += options_.stage_piece) {
    sizes.push_back(std::min(options_.stage_piece, x.bytes - off));
  }
  return sizes;
}

std::vector<NcclApi::Copy> NcclTransport::PieceCopies(const Xfer& x, size_t i, uint8_t* half) const {
  const int64_t begin = static_cast<int64_t>(i) * options_.stage_piece;
  const int64_t end = std::min(x.bytes, begin + options_.stage_piece);
  std::vector<NcclApi::Copy> copies;
  int64_t at = 0;  // the stream offset of run r
  for (const CopyRun& r : x.runs) {
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + r.bytes);
    if (lo < hi) {
      uint8_t* pool = base_ + (x.send ? r.src_offset : r.dst_offset) + (lo - at);
      uint8_t* staged = half + (lo - begin);
      copies.push_back(x.send ? NcclApi::Copy{pool, staged, hi - lo} : NcclApi::Copy{staged, pool, hi - lo});
    }
    at += r.bytes;
    if (at >= end) break;
  }
  return copies;
}

absl::StatusOr<bool> NcclTransport::PostPieces(Comm& c, Xfer& x) {
  const std::vector<int64_t> sizes = PieceSizes(x);
  while (x.next_piece < sizes.size()) {
    // A few pieces ahead at most (two halves; each piece's chunk list goes
    // up on the copy stream under the lock).
    if (c.flights.size() >= kMaxInFlight) return false;
    ASSIGN_OR_RETURN(bool idle, api_->Idle(c.handle));
    if (!idle) return false;
    const size_t i = x.next_piece;
    const int h = c.next_half;
    uint8_t* half = static_cast<uint8_t*>(c.staging) + h * options_.stage_piece;
    // The half's last use (any push's piece before this one) ends first.
    const uint64_t reuse = c.half_done[h];
    const bool last = i + 1 == sizes.size();
    const NcclApi::Buffer buffer[] = {{half, sizes[i]}};
    const std::vector<NcclApi::Copy> copies = PieceCopies(x, i, half);
    if (x.send) {
      ASSIGN_OR_RETURN(uint64_t gathered, api_->Copies(c.handle, copies, reuse));
      c.flights.push_back({gathered, kPieceFlight});
      ASSIGN_OR_RETURN(uint64_t sent, api_->Group(c.handle, /*send=*/true, buffer, gathered));
      c.flights.push_back({sent, last ? x.id : kPieceFlight});
      c.half_done[h] = sent;
    } else {
      ASSIGN_OR_RETURN(uint64_t received, api_->Group(c.handle, /*send=*/false, buffer, reuse));
      c.flights.push_back({received, kPieceFlight});
      ASSIGN_OR_RETURN(uint64_t scattered, api_->Copies(c.handle, copies, received));
      c.flights.push_back({scattered, last ? x.id : kPieceFlight});
      c.half_done[h] = scattered;
    }
    c.next_half = 1 - h;
    x.posted = true;
    ++x.next_piece;
  }
  return true;
}

absl::Status NcclTransport::PostReceives(Comm& c, Finished& finished) {
  // The receives of the push whose header landed, then the next header's:
  // the order the sender's buffers come in.
  // A header receive is posted only while a header is owed: a receive's
  // whose header has not landed, or one that ended (every PushAfter sends
  // one, a push or a decline: unmatched, the sender's send would spin on
  // its GPU instead):
  // an NCCL receive in flight spins on the GPU until its bytes come, and
  // would hold anything that waits for the whole device (cudaFree) that
  // long; one left alone ends the pair at idle_receive_limit.
  while (c.awaiting != 0 || c.drain.has_value() || (!c.header_posted && !c.parked && OwedHeader(c))) {
    ASSIGN_OR_RETURN(bool idle, api_->Idle(c.handle));
    if (!idle) return absl::OkStatus();
    if (c.drain.has_value()) {
      // An ended receive's push: every piece into the scratch buffer (the
      // responder's Pair allocated it).
      std::vector<NcclApi::Buffer> buffers;
      for (int64_t bytes : *c.drain) buffers.push_back({static_cast<uint8_t*>(scratch_), bytes});
      c.drain.reset();
      if (buffers.empty()) continue;
      ASSIGN_OR_RETURN(uint64_t ticket, api_->Group(c.handle, /*send=*/false, buffers));
      c.flights.push_back({ticket, kDrainFlight, Clock::now() + kDrainLimit});
      continue;
    }
    if (c.awaiting != 0) {
      Xfer& x = xfers_.at(c.awaiting);
      if (x.staged) {
        // Its pieces, all of them before the next header's receive.
        ASSIGN_OR_RETURN(bool all, PostPieces(c, x));
        if (!all) return absl::OkStatus();
        c.awaiting = 0;
        continue;
      }
      c.awaiting = 0;
      if (x.runs.empty()) {
        c.receives.erase(x.tag);
        Finish(x.id, x.cancelled ? absl::CancelledError("cancelled") : absl::OkStatus(), finished);
        continue;
      }
      std::vector<NcclApi::Buffer> buffers;
      for (const CopyRun& r : x.runs) buffers.push_back({base_ + r.dst_offset, r.bytes});
      ASSIGN_OR_RETURN(uint64_t ticket, api_->Group(c.handle, /*send=*/false, buffers));
      x.posted = true;
      c.flights.push_back({ticket, x.id});
      continue;
    }
    const NcclApi::Buffer header[] = {{static_cast<uint8_t*>(c.headers), static_cast<int64_t>(sizeof(Header))}};
    ASSIGN_OR_RETURN(uint64_t ticket, api_->Group(c.handle, /*send=*/false, header));
    c.header_posted = true;
    c.flights.push_back({ticket, 0});
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::TakeHeader(Comm& c, Finished& finished) {
  Header h{};
  RETURN_IF_ERROR(api_->Read(c.handle, &h, c.headers, sizeof(h)));
  if (h.magic == kDeclined) {
    // No push for the tag: its Receive ends now (an ended one's entry goes:
    // nothing is to drain).
    if (auto it = c.receives.find(h.tag);
        it != c.receives.end() && it->second != c.awaiting && !xfers_.at(it->second).posted) {
      const uint64_t id = it->second;
      const bool cancelled = xfers_.at(id).cancelled;
      c.receives.erase(it);
      Finish(id,
             cancelled ? absl::CancelledError("cancelled")
                       : absl::AbortedError(absl::StrFormat("the sender declined to push tag %d", h.tag)),
             finished);
    }
    std::erase_if(c.ended, [&](const Ended& e) { return e.tag == h.tag; });
    return absl::OkStatus();
  }
  if (h.magic != kMagic) return absl::InternalError("a malformed NCCL push header");
  c.parked = h;
  c.parked_at = Clock::now();
  return ClaimParked(c);
}

absl::Status NcclTransport::ClaimParked(Comm& c) {
  const Header h = *c.parked;
  auto ended = std::find_if(c.ended.begin(), c.ended.end(), [&](const Ended& e) { return e.tag == h.tag; });
  if (ended != c.ended.end()) {
    // Its receive ended before the push came: drained.
    if (h.runs != ended->runs || h.bytes != ended->bytes || h.piece != ended->piece || h.shape != ended->shape) {
      return absl::InternalError(absl::StrFormat(
          "a push of %d runs (%d bytes, staged in pieces of %d, shape %016x) for tag %d, whose ended receive expected "
          "%d runs (%d bytes, pieces of %d, shape %016x)",
          h.runs, h.bytes, h.piece, h.shape, h.tag, ended->runs, ended->bytes, ended->piece, ended->shape));
    }
    c.drain = std::move(ended->sizes);
    c.ended.erase(ended);
    c.parked.reset();
    return absl::OkStatus();
  }
  auto it = c.receives.find(h.tag);
  if (it == c.receives.end() || xfers_.at(it->second).posted) {
    if (Clock::now() - c.parked_at < kUnmatchedGrace) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrFormat("a push for tag %d, which no receive here claimed in %d s", h.tag, kUnmatchedGrace.count()));
  }
  c.parked.reset();
  const Xfer& x = xfers_.at(it->second);
  if (const uint64_t shape = ShapeOf(x.runs); h.runs != x.runs.size() || h.bytes != x.bytes || h.shape != shape) {
    return absl::InternalError(
        absl::StrFormat("a push of %d runs (%d bytes, run sizes' hash %016x) for tag %d, whose receive expects %d runs "
                        "(%d bytes, %016x): the two sides' block lists differ",
                        h.runs, h.bytes, h.shape, h.tag, x.runs.size(), x.bytes, shape));
  }
  if (const uint64_t piece = PieceOf(x); h.piece != piece) {
    return absl::InternalError(absl::StrFormat(
        "a push for tag %d staged in pieces of %d bytes (0: not staged), whose receive stages in pieces of %d: the "
        "two workers' NCCL staging settings differ",
        h.tag, h.piece, piece));
  }
  c.awaiting = x.id;
  return absl::OkStatus();
}

void NcclTransport::FailComm(const std::string& peer, Comm& c, const absl::Status& why, Finished& finished) {
  const auto now = Clock::now();
  for (TransferDone& d : c.pairing) finished.emplace_back(std::move(d), why);
  c.pairing.clear();
  std::vector<uint64_t> ids(c.pending.begin(), c.pending.end());
  for (const auto& [tag, id] : c.receives) ids.push_back(id);
  for (const Flight& f : c.flights) {
    if (f.xfer != 0 && f.xfer != kDrainFlight && f.xfer != kPieceFlight) ids.push_back(f.xfer);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (uint64_t id : ids) {
    const Xfer& x = xfers_.at(id);
    absl::Status st;
    if (x.cancelled) {
      st = absl::CancelledError(absl::StrCat("cancelled; the NCCL communicator ended: ", why.message()));
    } else if (why.code() == absl::StatusCode::kDeadlineExceeded && now >= x.deadline) {
      st = why;
    } else if (why.code() == absl::StatusCode::kCancelled) {
      st = why;
    } else {
      st = absl::UnavailableError(absl::StrCat("the NCCL communicator with ", peer, " ended: ", why.message()));
    }
    Finish(id, std::move(st), finished);
  }
  c.pending.clear();
  c.receives.clear();
  c.flights.clear();
  if (c.handle != nullptr) api_->Abort(c.handle);
  if (c.headers != nullptr) api_->Free(options_.device, c.headers);
  if (c.staging != nullptr) api_->Free(options_.device, c.staging);
  c.handle = nullptr;
  c.headers = nullptr;
  c.staging = nullptr;
}

uint64_t NcclTransport::ShapeOf(const std::vector<CopyRun>& runs) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over each size's bytes
  for (const CopyRun& r : runs) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(r.bytes) >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

bool NcclTransport::OwedHeader(const Comm& c, bool open_only) const {
  if (!open_only && !c.ended.empty()) return true;
  return std::any_of(c.receives.begin(), c.receives.end(),
                     [&](const auto& r) { return r.second != c.awaiting && !xfers_.at(r.second).posted; });
}

void NcclTransport::MakeDecline(Xfer& x) {
  x.declined = true;
  x.runs.clear();
  x.bytes = 0;
  x.staged = false;
  x.after = nullptr;
  x.cancelled = false;
  x.deadline = Clock::now() + kDeclineLimit;
  x.done = [](absl::Status) {};
}

void NcclTransport::Finish(uint64_t id, absl::Status st, Finished& finished) {
  auto it = xfers_.find(id);
  if (it == xfers_.end()) return;
  finished.emplace_back(std::move(it->second.done), std::move(st));
  xfers_.erase(it);
}

}  // namespace tandem::kvtransfer
