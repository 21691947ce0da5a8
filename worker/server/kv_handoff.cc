#include "worker/server/kv_handoff.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_hash.h"
#include "common/grpc_poller.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/server/proto_convert.h"

namespace tandem::worker {
namespace {

using std::chrono::steady_clock;
using std::chrono::system_clock;

// Answers after which the decode worker has finished with the caller's
// blocks for good: it answered itself, or no handler ran. Anything else
// (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ...) may come from the network
// while a pull is still running there.
bool IsDefiniteAnswer(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::DATA_LOSS:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::UNIMPLEMENTED:
      return true;
    default:
      return false;
  }
}

// `n` bytes from the kernel's CSPRNG (getrandom blocks only before the pool
// is first seeded, at boot).
std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else {
      CHECK(errno == EINTR) << "getrandom failed: " << std::strerror(errno);
    }
  }
  return out;
}

// Compares secrets in time independent of where they differ.
bool SameToken(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// KvReady PUSHED's sender_error is at most this long.
constexpr size_t kMaxSenderError = 1024;
// KvReady JOIN's pair_offer is at most this long.
constexpr size_t kMaxPairOffer = 4096;

// The latest end of work that must end before `deadline`, which arrived as
// a duration (late by the network's latency): a tenth of the time left, at
// least 100 ms, before it.
Deadline EndBefore(Deadline deadline) {
  const auto now = steady_clock::now();
  return deadline - std::max<steady_clock::duration>(std::chrono::milliseconds(100), (deadline - now) / 10);
}

// Logs the first few of a kind, then one in a thousand: a caller must not
// be able to flood the log.
bool ShouldLog(int64_t count) { return count <= 10 || count % 1000 == 0; }

}  // namespace

// ---------------------------------------------------------------------------
// KvReceiver

// One KvReady being served.
struct KvReceiver::Pull {
  uint64_t reservation_id = 0;  // on the wire (entries_' key)
  uint64_t engine_id = 0;
  std::string agent_id;
  std::vector<kvtransfer::BlockPair> pairs;
  std::vector<uint64_t> checksums;  // per pair, or empty
  bool peer_held = false;           // peers_->Acquire counted this pull
  bool pushed = false;              // the sender pushed the blocks (KvReady PUSHED)
  kvtransfer::PeerInfo source;      // JOIN over a send/receive transport: the sender's pool
  std::string pair_offer;           // and its pairing offer (KvReadyRequest.pair_offer)
  steady_clock::time_point started;
  steady_clock::duration took{};  // submit -> completion
  SampledToken first;
  tandem::v1::KvReadyResponse* response = nullptr;
  std::function<void(grpc::Status)> done;

  // The call it serves: its reservation, sender, first token and answer.
  void Bind(const tandem::v1::KvReadyRequest& req, tandem::v1::KvReadyResponse* answer,
            std::function<void(grpc::Status)> answered) {
    reservation_id = req.reservation_id();
    agent_id = req.source().agent_id();
    first = FromProto(req.first_token());
    response = answer;
    done = std::move(answered);
  }
};

KvReceiver::KvReceiver(Engine* engine, kvtransfer::Transport* transport, PeerSet* peers, std::string instance_id,
                       KvHandoffConfig config)
    : engine_(engine), transport_(transport), instance_id_(std::move(instance_id)), config_(config), peers_(peers) {}

std::chrono::milliseconds KvReceiver::ReservationTimeout(uint32_t requested_ms) {
  const std::chrono::milliseconds asked =
      requested_ms > 0 ? std::chrono::milliseconds(requested_ms) : config_.receive_timeout;
  if (asked <= config_.receive_timeout_max) return asked;
  const int64_t n = ++timeouts_capped_;
  if (ShouldLog(n)) {
    LOG(WARNING) << "a RECEIVE request asked for a " << asked.count()
                 << " ms reservation; capped to --kv-receive-timeout-max-ms " << config_.receive_timeout_max.count()
                 << " (" << n << " so far)";
  }
  return config_.receive_timeout_max;
}

absl::Status KvReceiver::Charge(const std::string& caller, int64_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t& held = charged_[caller];
  const int64_t cap = config_.max_reserved_blocks_per_caller;
  if (cap > 0 && held > 0 && held + blocks > cap) {
    const int64_t n = ++over_caller_cap_;
    if (ShouldLog(n)) {
      LOG(WARNING) << "caller " << caller << " holds " << held << " reserved KV blocks; a reservation of " << blocks
                   << " more is over --kv-reserve-max-blocks-per-caller " << cap << " (" << n << " refused so far)";
    }
    return absl::ResourceExhaustedError(
        absl::StrFormat("this caller's reservations already hold %d KV blocks; %d more would pass the worker's "
                        "per-caller cap of %d (--kv-reserve-max-blocks-per-caller)",
                        held, blocks, cap));
  }
  held += blocks;
  charged_total_ += blocks;
  return absl::OkStatus();
}

void KvReceiver::Refund(const std::string& caller, int64_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = charged_.find(caller);
  if (it == charged_.end()) return;
  it->second -= blocks;
  charged_total_ -= blocks;
  if (it->second <= 0) charged_.erase(it);
}

KvReceiver::Handle KvReceiver::Add(Waiting waiting) {
  Handle h;
  h.token = RandomBytes(16);
  std::lock_guard<std::mutex> lock(mu_);
  do {
    const std::string id = RandomBytes(8);
    std::memcpy(&h.reservation_id, id.data(), 8);
  } while (h.reservation_id == 0 || entries_.count(h.reservation_id) != 0);
  entries_[h.reservation_id] = Entry{.waiting = std::move(waiting), .token = h.token};
  return h;
}

void KvReceiver::EraseLocked(std::map<uint64_t, Entry>::iterator it) {
  // A PUSHED waiting for its Receive's end gets its answer now.
  if (std::shared_ptr<Pull> pushed = std::move(it->second.pushed)) {
    ++pull_failures_;
    verifier_.Post([pushed] {
      pushed->done(grpc::Status(grpc::StatusCode::ABORTED, "the reservation ended while its KV was moving"));
    });
  }
  const Waiting& w = it->second.waiting;
  if (w.charged_blocks > 0) {
    auto c = charged_.find(w.caller);
    if (c != charged_.end()) {
      c->second -= w.charged_blocks;
      charged_total_ -= w.charged_blocks;
      if (c->second <= 0) charged_.erase(c);
    }
  }
  entries_.erase(it);
}

void KvReceiver::EraseLocked(uint64_t reservation_id) {
  auto it = entries_.find(reservation_id);
  if (it != entries_.end()) EraseLocked(it);
}

void KvReceiver::Forget(uint64_t reservation_id) {
  uint64_t transfer = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(reservation_id);
    if (it == entries_.end()) return;
    transfer = it->second.transfer_id;
    EraseLocked(it);
  }
  if (transfer != 0) transport_->Cancel(transfer);
}

absl::Status CheckKvReadyPrompt(const tandem::v1::KvReadyRequest& req, const KvReadyExpectation& expect,
                                int vocab_size) {
  if (req.prompt_tokens() != expect.prompt_len || req.prompt_hash() != expect.prompt_hash) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KvReady describes another prompt (%d tokens, hash %016x) than reservation %d (%d tokens, "
        "hash %016x)",
        req.prompt_tokens(), req.prompt_hash(), req.reservation_id(), expect.prompt_len, expect.prompt_hash));
  }
  const int32_t first = req.first_token().token_id();
  if (first < 0 || first >= vocab_size) {
    return absl::InvalidArgumentError(absl::StrFormat("first_token %d is outside the vocabulary", first));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<kvtransfer::BlockPair>> PlanKvReadyPull(const tandem::v1::KvReadyRequest& req,
                                                                   const KvReadyExpectation& expect, int block_size) {
  const int blocks = static_cast<int>(expect.blocks.size());
  const int skip = std::min(blocks, expect.cached_tokens / block_size);
  const int sent = blocks - skip;
  if (req.block_ids_size() != blocks) {
    return absl::InvalidArgumentError(absl::StrFormat("KvReady names %d blocks; a %d-token prompt takes %d",
                                                      req.block_ids_size(), expect.prompt_len, blocks));
  }
  if (req.block_checksums_size() != 0 && req.block_checksums_size() != sent) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KvReady has %d block checksums; %d blocks are pulled (the first %d are cached here)",
                        req.block_checksums_size(), sent, skip));
  }
  std::vector<kvtransfer::BlockPair> pairs;
  pairs.reserve(sent);
  for (int i = skip; i < blocks; ++i) pairs.push_back({req.block_ids(i), expect.blocks[i]});
  return pairs;
}

void KvReceiver::KvReady(const tandem::v1::KvReadyRequest& req, Deadline call_deadline,
                         tandem::v1::KvReadyResponse* response, std::function<void(grpc::Status)> done) {
  using grpc::StatusCode;
  using tandem::v1::KvReadyRequest;
  if (transport_ == nullptr) {
    done(grpc::Status(StatusCode::FAILED_PRECONDITION, "this worker runs without a KV transport (--kv-transport)"));
    return;
  }
  const KvReadyRequest::Phase phase = req.phase();
  if (phase != KvReadyRequest::PHASE_UNSPECIFIED && phase != KvReadyRequest::JOIN && phase != KvReadyRequest::PUSHED) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT,
                      absl::StrFormat("KvReady phase %d is not PHASE_UNSPECIFIED (0), JOIN (1) or PUSHED (2)", phase)));
    return;
  }
  // Each phase's own fields, only there.
  if (req.join_timeout_ms() != 0 && phase != KvReadyRequest::JOIN) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, "KvReady join_timeout_ms is for phase JOIN only"));
    return;
  }
  if (!req.sender_error().empty() && phase != KvReadyRequest::PUSHED) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, "KvReady sender_error is for phase PUSHED only"));
    return;
  }
  if (!req.pair_offer().empty() && phase != KvReadyRequest::JOIN) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, "KvReady pair_offer is for phase JOIN only"));
    return;
  }
  if (req.pair_offer().size() > kMaxPairOffer) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, absl::StrFormat("KvReady pair_offer holds %d bytes; at most %d",
                                                                    req.pair_offer().size(), kMaxPairOffer)));
    return;
  }
  if (phase == KvReadyRequest::JOIN && req.block_checksums_size() != 0) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, "KvReady JOIN carries no block_checksums (PUSHED does)"));
    return;
  }
  if (phase != KvReadyRequest::PHASE_UNSPECIFIED && !config_.push) {
    done(grpc::Status(StatusCode::FAILED_PRECONDITION,
                      "this worker takes KV by pull (--kv-delivery pull): it joins no pushes"));
    return;
  }
  if (req.decode_instance_id() != instance_id_) {
    done(grpc::Status(StatusCode::NOT_FOUND,
                      absl::StrFormat("reservation %d was made by worker instance '%s'; this is '%s'",
                                      req.reservation_id(), req.decode_instance_id(), instance_id_)));
    return;
  }
  if (req.sender_error().size() > kMaxSenderError) {
    done(grpc::Status(StatusCode::INVALID_ARGUMENT, absl::StrFormat("KvReady sender_error holds %d bytes; at most %d",
                                                                    req.sender_error().size(), kMaxSenderError)));
    return;
  }
  if (phase == KvReadyRequest::JOIN) {
    Join(req, call_deadline, response, std::move(done));
  } else if (phase == KvReadyRequest::PUSHED) {
    Pushed(req, response, std::move(done));
  } else {
    StartPull(req, call_deadline, response, std::move(done));
  }
}

KvReceiver::Entry* KvReceiver::FindLocked(const tandem::v1::KvReadyRequest& req, grpc::Status* refusal) {
  auto it = entries_.find(req.reservation_id());
  // A wrong token reads as no reservation: the answer tells nothing.
  if (it == entries_.end() || !SameToken(req.reservation_token(), it->second.token)) {
    *refusal =
        grpc::Status(grpc::StatusCode::NOT_FOUND,
                     absl::StrFormat("no reservation %d is waiting for KV (expired, cancelled or already filled)",
                                     req.reservation_id()));
    return nullptr;
  }
  return &it->second;
}

KvReceiver::Entry* KvReceiver::AdmitLocked(const tandem::v1::KvReadyRequest& req, const absl::Status& compatible,
                                           Pull* pull, bool* incompatible, grpc::Status* refusal) {
  using grpc::StatusCode;
  Entry* e = FindLocked(req, refusal);
  if (e == nullptr) return nullptr;
  if (e->state != State::kWaiting) {
    *refusal = grpc::Status(StatusCode::ALREADY_EXISTS,
                            absl::StrFormat("reservation %d is already receiving its KV", req.reservation_id()));
    return nullptr;
  }
  // Describing another prompt: the reservation keeps waiting for the right call.
  if (absl::Status s = CheckKvReadyPrompt(req, e->waiting.expect, engine_->model_config().vocab_size); !s.ok()) {
    *refusal = grpc::Status(StatusCode::INVALID_ARGUMENT, std::string(s.message()));
    return nullptr;
  }
  pull->engine_id = e->waiting.engine_id;
  if (!compatible.ok()) {
    EraseLocked(req.reservation_id());
    *incompatible = true;
    return nullptr;
  }
  absl::StatusOr<std::vector<kvtransfer::BlockPair>> pairs =
      PlanKvReadyPull(req, e->waiting.expect, engine_->config().block_size);
  if (!pairs.ok()) {
    *refusal = grpc::Status(StatusCode::INVALID_ARGUMENT, std::string(pairs.status().message()));
    return nullptr;
  }
  pull->pairs = *std::move(pairs);
  return e;
}

void KvReceiver::FallBackIncompatible(const std::shared_ptr<Pull>& pull, const absl::Status& compatible) {
  Fail(pull,
       grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                    absl::StrCat("cannot take KV from the prefill worker's pool: ", compatible.message())),
       /*fall_back=*/true);
}

absl::Status KvReceiver::CheckSource(const tandem::v1::KvReadyRequest& req) const {
  if (req.source().backend() != transport_->backend()) {
    return absl::FailedPreconditionError(absl::StrFormat("its KV transport is '%s', this worker's is '%s'",
                                                         req.source().backend(), transport_->backend()));
  }
  return kvtransfer::CheckCompatible(engine_->pool_layout(), FromProto(req.source()).layout);
}

void KvReceiver::StartPull(const tandem::v1::KvReadyRequest& req, Deadline call_deadline,
                           tandem::v1::KvReadyResponse* response, std::function<void(grpc::Status)> done) {
  using grpc::StatusCode;
  auto pull = std::make_shared<Pull>();
  const absl::Status compatible = CheckSource(req);
  // Under mu_, in order: the reservation exists and waits; the request
  // describes its prompt (else it keeps waiting for the right one); the pool
  // can be copied from (else it falls back at once); the blocks add up.
  bool incompatible = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    grpc::Status refusal;
    Entry* e = AdmitLocked(req, compatible, pull.get(), &incompatible, &refusal);
    if (e == nullptr && !incompatible) {
      done(refusal);
      return;
    }
    if (e != nullptr) {
      pull->checksums.assign(req.block_checksums().begin(), req.block_checksums().end());
      e->state = State::kPulling;
      call_deadline = std::min(call_deadline, e->waiting.deadline);
    }
  }
  pull->Bind(req, response, std::move(done));
  if (incompatible) {
    FallBackIncompatible(pull, compatible);
    return;
  }

  // From here the reservation is this call's: every path ends in a commit or
  // a fallback.
  absl::Status peer = peers_->Acquire(FromProto(req.source()));
  if (!peer.ok()) {
    peer = absl::FailedPreconditionError(absl::StrCat("cannot pull KV from the prefill worker: ", peer.message()));
    Fail(pull, ToGrpcStatus(peer), /*fall_back=*/true);
    return;
  }
  pull->peer_held = true;
  if (pull->pairs.empty()) {
    OnPulled(pull, absl::OkStatus());
    return;
  }
  // End the pull before the caller's deadline (then it frees its blocks).
  pull->started = steady_clock::now();
  absl::StatusOr<uint64_t> transfer = transport_->Pull(pull->agent_id, pull->pairs, EndBefore(call_deadline),
                                                       [this, pull](absl::Status s) { OnPulled(pull, std::move(s)); });
  if (!transfer.ok()) {
    // A peer the transport no longer has (it exited, or was let go): lost,
    // so the next transfer with this agent joins it afresh.
    if (transfer.status().code() == absl::StatusCode::kUnavailable ||
        transfer.status().code() == absl::StatusCode::kNotFound) {
      peers_->Release(pull->agent_id, /*lost=*/true);
      pull->peer_held = false;
    }
    Fail(pull,
         grpc::Status(grpc::StatusCode::ABORTED,
                      absl::StrCat("cannot start the KV pull: ", transfer.status().message())),
         /*fall_back=*/true);
    return;
  }
  bool forgotten = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(pull->reservation_id);
    if (it == entries_.end()) {
      forgotten = true;
    } else {
      it->second.transfer_id = *transfer;
    }
  }
  // The stream went away while the pull started (or it already ended:
  // cancelling a finished transfer is a no-op).
  if (forgotten) transport_->Cancel(*transfer);
}

void KvReceiver::OnPulled(std::shared_ptr<Pull> pull, absl::Status status) {
  if (pull->started != steady_clock::time_point{}) pull->took = steady_clock::now() - pull->started;
  // Off the transport's thread: checksums take a pass over the KV.
  verifier_.Post([this, pull, status = std::move(status)] {
    peers_->Release(pull->agent_id, status.code() == absl::StatusCode::kUnavailable);
    pull->peer_held = false;
    if (!status.ok()) {
      Fail(pull, grpc::Status(grpc::StatusCode::ABORTED, absl::StrCat("pulling the KV failed: ", status.message())),
           /*fall_back=*/true);
      return;
    }
    VerifyAndCommit(pull);
  });
}

void KvReceiver::VerifyAndCommit(const std::shared_ptr<Pull>& pull) {
  std::vector<int32_t> dst;
  dst.reserve(pull->checksums.size());
  for (size_t i = 0; i < pull->checksums.size(); ++i) dst.push_back(pull->pairs[i].dst);
  const absl::StatusOr<std::vector<uint64_t>> sums = engine_->KvBlockChecksums(dst);  // none asked: none
  if (!sums.ok()) {
    Fail(pull,
         grpc::Status(grpc::StatusCode::INTERNAL,
                      absl::StrCat("cannot check the received KV blocks' checksums: ", sums.status().message())),
         /*fall_back=*/true);
    return;
  }
  for (size_t i = 0; i < pull->checksums.size(); ++i) {
    const uint64_t got = (*sums)[i];
    if (got != pull->checksums[i]) {
      ++checksum_failures_;
      Fail(pull,
           grpc::Status(grpc::StatusCode::DATA_LOSS,
                        absl::StrFormat("KV block %d of %d arrived corrupted (checksum %016x, "
                                        "expected %016x)",
                                        i, pull->pairs.size(), got, pull->checksums[i])),
           /*fall_back=*/true);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(pull->reservation_id) == 0) {
      // Cancelled or expired while the bytes moved: nothing to commit.
      ++pull_failures_;
      pull->done(grpc::Status(grpc::StatusCode::ABORTED, "the reservation ended while its KV was moving"));
      return;
    }
  }
  const int64_t bytes = static_cast<int64_t>(pull->pairs.size()) * engine_->pool_layout().block_bytes;
  engine_->Commit(pull->engine_id, pull->first, [this, pull, bytes](absl::Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      EraseLocked(pull->reservation_id);
    }
    if (!s.ok()) {
      ++pull_failures_;
      pull->done(grpc::Status(grpc::StatusCode::ABORTED,
                              absl::StrCat("the reservation ended while its KV was moving: ", s.message())));
      return;
    }
    if (pull->pushed) {
      ++pushes_received_;
    } else {
      ++pulls_;
      bytes_pulled_ += bytes;
      pull_nanos_ += std::chrono::duration_cast<std::chrono::nanoseconds>(pull->took).count();
      pull->response->set_pull_seconds(std::chrono::duration<double>(pull->took).count());
    }
    pull->response->set_blocks_pulled(static_cast<int32_t>(pull->pairs.size()));
    pull->response->set_bytes_pulled(bytes);
    pull->done(grpc::Status::OK);
  });
}

void KvReceiver::Join(const tandem::v1::KvReadyRequest& req, Deadline call_deadline,
                      tandem::v1::KvReadyResponse* response, std::function<void(grpc::Status)> done) {
  using grpc::StatusCode;
  // A JOIN the sender has given up on joins nothing (it may already have
  // told this worker so, in a PUSHED with sender_error).
  if (steady_clock::now() >= call_deadline) {
    done(grpc::Status(StatusCode::DEADLINE_EXCEEDED, "KvReady JOIN arrived past its deadline"));
    return;
  }
  auto pull = std::make_shared<Pull>();
  const absl::Status compatible = CheckSource(req);
  // Admitted as a pull is; then the blocks to be written (those past the
  // cached prefix) are pinned.
  bool incompatible = false;
  Deadline until{};
  std::vector<int32_t> blocks;
  int cached_blocks = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    grpc::Status refusal;
    Entry* e = AdmitLocked(req, compatible, pull.get(), &incompatible, &refusal);
    if (e == nullptr && !incompatible) {
      done(refusal);
      return;
    }
    if (e != nullptr) {
      // Pinned until the reservation's own deadline, or sooner if asked.
      until = e->waiting.deadline;
      if (req.join_timeout_ms() > 0) {
        until = std::min(until, steady_clock::now() + std::chrono::milliseconds(req.join_timeout_ms()));
      }
      cached_blocks = static_cast<int>(e->waiting.expect.blocks.size() - pull->pairs.size());
      for (const kvtransfer::BlockPair& pair : pull->pairs) blocks.push_back(pair.dst);
      e->state = State::kJoined;
      e->pusher = req.source().agent_id();
    }
  }
  pull->Bind(req, response, std::move(done));
  if (incompatible) {
    FallBackIncompatible(pull, compatible);
    return;
  }
  absl::StatusOr<kvtransfer::PeerInfo> local = transport_->LocalInfo();
  if (!local.ok()) {
    Fail(pull, ToGrpcStatus(local.status()), /*fall_back=*/true);
    return;
  }
  pull->source = FromProto(req.source());
  pull->pair_offer = req.pair_offer();
  // Pinned before the answer: no write is sent before it.
  engine_->PinReservation(
      pull->engine_id, until,
      [this, pull, until, cached_blocks, local = *std::move(local), blocks = std::move(blocks)](absl::Status pinned) {
        if (pinned.ok() && transport_->capabilities().needs_pairing) {
          // The receiving half goes up before the answer lets the sender start.
          if (absl::Status posted = PostReceive(pull, until); !posted.ok()) {
            // UNAVAILABLE where the pairing with the pusher's pool is gone
            // (the pusher then pairs afresh), else ABORTED.
            Fail(pull,
                 grpc::Status(posted.code() == absl::StatusCode::kUnavailable ? grpc::StatusCode::UNAVAILABLE
                                                                              : grpc::StatusCode::ABORTED,
                              absl::StrCat("cannot receive the pushed KV: ", posted.message())),
                 /*fall_back=*/true);
            return;
          }
        }
        if (!pinned.ok()) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = entries_.find(pull->reservation_id);
            if (it != entries_.end() && it->second.state == State::kJoined) EraseLocked(it);
          }
          pull->done(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                  absl::StrFormat("reservation %d ended before its blocks could be pinned: %s",
                                                  pull->reservation_id, pinned.message())));
          return;
        }
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady_clock::now());
        pull->response->set_pinned_ms(static_cast<uint32_t>(std::max<int64_t>(0, left.count())));
        ToProto(local, pull->response->mutable_destination());
        pull->response->mutable_destination_block_ids()->Assign(blocks.begin(), blocks.end());
        pull->response->set_destination_cached_blocks(cached_blocks);
        pull->done(grpc::Status::OK);
      });
}

void KvReceiver::Pushed(const tandem::v1::KvReadyRequest& req, tandem::v1::KvReadyResponse* response,
                        std::function<void(grpc::Status)> done) {
  using grpc::StatusCode;
  auto pull = std::make_shared<Pull>();
  pull->pushed = true;
  bool missing_checksums = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    grpc::Status refusal;
    Entry* found = FindLocked(req, &refusal);
    if (found == nullptr) {
      done(refusal);
      return;
    }
    Entry& e = *found;
    if (e.state == State::kPulling) {
      done(grpc::Status(StatusCode::ALREADY_EXISTS,
                        absl::StrFormat("reservation %d is already receiving its KV", req.reservation_id())));
      return;
    }
    // A sender's failure before its JOIN was served (the JOIN's answer
    // lost, or the JOIN still on its way): fall back now; a late JOIN then
    // finds nothing.
    const bool abandoned = e.state == State::kWaiting && !req.sender_error().empty();
    if (e.state != State::kJoined && !abandoned) {
      done(grpc::Status(StatusCode::FAILED_PRECONDITION,
                        absl::StrFormat("reservation %d joined no push (KvReady JOIN first)", req.reservation_id())));
      return;
    }
    if (!abandoned && req.source().agent_id() != e.pusher) {
      done(grpc::Status(StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("reservation %d joined a push from agent '%s', not '%s'", req.reservation_id(),
                                        e.pusher, req.source().agent_id())));
      return;
    }
    const Waiting& w = e.waiting;
    // The prompt and the first token as for the JOIN (a PUSHED that
    // describes another prompt leaves the reservation joined: its pin and
    // deadline end it).
    if (absl::Status s = CheckKvReadyPrompt(req, w.expect, engine_->model_config().vocab_size); !s.ok()) {
      done(grpc::Status(StatusCode::INVALID_ARGUMENT, std::string(s.message())));
      return;
    }
    pull->engine_id = w.engine_id;
    if (req.sender_error().empty()) {
      absl::StatusOr<std::vector<kvtransfer::BlockPair>> pairs =
          PlanKvReadyPull(req, w.expect, engine_->config().block_size);
      if (!pairs.ok()) {
        done(grpc::Status(StatusCode::INVALID_ARGUMENT, std::string(pairs.status().message())));
        return;
      }
      pull->pairs = *std::move(pairs);
      pull->checksums.assign(req.block_checksums().begin(), req.block_checksums().end());
      // Pushed blocks are committed only verified: this worker did not
      // see the transfer end, the sender's checksums are its evidence.
      missing_checksums = pull->checksums.size() != pull->pairs.size();
    }
    e.state = State::kPulling;  // verifying (a second PUSHED is ALREADY_EXISTS)
  }
  pull->Bind(req, response, std::move(done));
  // A PUSHED that delivers nothing usable falls back at once.
  grpc::Status refused = grpc::Status::OK;
  if (!req.sender_error().empty()) {
    refused = grpc::Status(StatusCode::ABORTED,
                           absl::StrCat("the prefill worker could not push the KV: ", req.sender_error()));
  } else if (missing_checksums) {
    refused = grpc::Status(StatusCode::INVALID_ARGUMENT,
                           "KvReady PUSHED carries no block_checksums: pushed KV is committed only once verified");
  }
  // A send/receive transport's Receive: still running, or how it ended.
  absl::Status received;  // a one-sided push: the sender's word is the evidence
  bool running = false;
  uint64_t receive_id = 0;
  bool ended = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(pull->reservation_id);
    ended = it == entries_.end();
    if (!ended && it->second.receiving) {
      Entry& e = it->second;
      running = !e.received;
      if (running) {
        receive_id = e.transfer_id;
        // Committed once the bytes landed (OnReceived).
        if (refused.ok()) e.pushed = pull;
      } else {
        received = e.receive_status;
      }
    }
  }
  if (!refused.ok()) {
    if (running && receive_id != 0) transport_->Cancel(receive_id);
    Fail(pull, std::move(refused), /*fall_back=*/true);
    return;
  }
  if (running) return;  // OnReceived goes on
  if (ended && transport_->capabilities().needs_pairing) {
    // Ended meanwhile (its Receive failed, a cancel): the bytes were not
    // seen to land, so nothing is verified.
    ++pull_failures_;
    pull->done(grpc::Status(StatusCode::ABORTED, "the reservation ended while its KV was moving"));
    return;
  }
  verifier_.Post([this, pull, received] { CommitPushed(pull, received); });
}

absl::Status KvReceiver::PostReceive(const std::shared_ptr<Pull>& join, Deadline until) {
  RETURN_IF_ERROR(peers_->Acquire(join->source, kvtransfer::PairRole::kResponder, join->pair_offer));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(join->reservation_id);
    if (it == entries_.end()) {
      peers_->Release(join->agent_id, /*lost=*/false);
      return absl::NotFoundError("the reservation ended before its receive was posted");
    }
    it->second.receiving = true;  // before Receive: its end may come at once
  }
  absl::StatusOr<uint64_t> receive =
      transport_->Receive(join->agent_id, join->pairs, join->reservation_id, until,
                          [this, join](absl::Status s) { OnReceived(join, std::move(s)); });
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(join->reservation_id);
    if (!receive.ok()) {
      if (it != entries_.end()) it->second.receiving = false;
    } else if (it == entries_.end()) {
      cancel = true;
    } else if (!it->second.received) {
      it->second.transfer_id = *receive;
    }
  }
  if (!receive.ok()) {
    peers_->Release(join->agent_id, receive.status().code() == absl::StatusCode::kUnavailable ||
                                        receive.status().code() == absl::StatusCode::kNotFound);
    return receive.status();
  }
  if (cancel) transport_->Cancel(*receive);
  return absl::OkStatus();
}

void KvReceiver::OnReceived(const std::shared_ptr<Pull>& join, absl::Status status) {
  peers_->Release(join->agent_id, status.code() == absl::StatusCode::kUnavailable);
  std::shared_ptr<Pull> pushed;
  bool fall_back = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(join->reservation_id);
    if (it == entries_.end()) return;  // ended meanwhile (a fallback, a cancel, its deadline)
    Entry& e = it->second;
    e.received = true;
    e.receive_status = status;
    e.transfer_id = 0;
    pushed = std::move(e.pushed);
    fall_back = !status.ok() && pushed == nullptr && e.state == State::kJoined;
    // Ours to end: a PUSHED from now on is ALREADY_EXISTS.
    if (fall_back) e.state = State::kPulling;
  }
  if (pushed != nullptr) {
    verifier_.Post([this, pushed, status] { CommitPushed(pushed, status); });
    return;
  }
  if (fall_back) {
    // The bytes will not come: prefill locally now, not at the reservation's
    // deadline (a PUSHED still on its way then finds nothing).
    auto ended = std::make_shared<Pull>(*join);
    ended->response = nullptr;
    ended->done = [](grpc::Status) {};
    Fail(ended,
         grpc::Status(grpc::StatusCode::ABORTED, absl::StrCat("receiving the pushed KV failed: ", status.message())),
         /*fall_back=*/true);
  }
}

void KvReceiver::CommitPushed(const std::shared_ptr<Pull>& pull, const absl::Status& received) {
  if (!received.ok()) {
    Fail(pull,
         grpc::Status(grpc::StatusCode::ABORTED, absl::StrCat("receiving the pushed KV failed: ", received.message())),
         /*fall_back=*/true);
    return;
  }
  VerifyAndCommit(pull);
}

void KvReceiver::Fail(const std::shared_ptr<Pull>& pull, grpc::Status status, bool fall_back) {
  ++pull_failures_;
  if (pull->peer_held) peers_->Release(pull->agent_id, /*lost=*/false);
  pull->peer_held = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    EraseLocked(pull->reservation_id);
  }
  LOG(WARNING) << "KV for reservation " << pull->reservation_id << " not received: " << status.error_message();
  if (fall_back) engine_->Fallback(pull->engine_id, pull->first, status.error_message());
  pull->done(std::move(status));
}

void KvReceiver::AddStats(KvHandoffStats* stats) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : entries_) stats->pulls_in_flight += e.transfer_id != 0 ? 1 : 0;
    stats->reserved_blocks += charged_total_;
  }
  stats->timeouts_capped += timeouts_capped_.load();
  stats->over_caller_cap += over_caller_cap_.load();
  stats->pulls += pulls_.load();
  stats->pull_failures += pull_failures_.load();
  stats->checksum_failures += checksum_failures_.load();
  stats->bytes_pulled += bytes_pulled_.load();
  stats->pull_seconds += static_cast<double>(pull_nanos_.load()) * 1e-9;
  stats->pushes_received += pushes_received_.load();
}

// ---------------------------------------------------------------------------
// KvSender

KvSender::KvSender(Engine* engine, kvtransfer::Transport* transport, PeerSet* peers, KvHandoffConfig config,
                   grpc::CompletionQueue* cq, std::shared_ptr<const tls::ChannelFactory> channels, PeerAllowList allow)
    : engine_(engine),
      transport_(transport),
      config_(config),
      cq_(cq),
      channels_(std::move(channels)),
      allow_(std::move(allow)),
      peers_(peers) {}

absl::Status KvSender::CheckDecodeAddress(const std::string& address) {
  absl::StatusOr<PeerAddress> parsed = ParsePeerAddress(address, "kv_transfer.decode_address");
  absl::Status refused = parsed.status();
  if (parsed.ok() && parsed->literal && !allow_.Allows(parsed->ip)) {
    refused = absl::PermissionDeniedError(absl::StrCat(
        "kv_transfer.decode_address ", address, " is outside this worker's --kv-peer-allow (", allow_.ToString(), ")"));
  }
  if (refused.ok()) return refused;
  const int64_t n = ++peers_refused_;
  if (ShouldLog(n)) LOG(WARNING) << "SEND refused: " << refused.message() << " (" << n << " so far)";
  return refused;
}

KvSender::~KvSender() { Stop(); }

void KvSender::Stop() {
  executor_.reset();  // runs what was posted
  std::unique_lock<std::mutex> lock(calls_mu_);
  stopping_ = true;  // no call or push starts after this
  for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  const std::set<uint64_t> pushes = push_ids_;
  lock.unlock();
  for (uint64_t id : pushes) transport_->Cancel(id);
  lock.lock();
  calls_cv_.wait(lock, [&] { return calls_.empty() && pushing_ == 0; });
}

void KvSender::Send(Job job, SendDone done) {
  if (executor_ == nullptr) {  // stopped
    done("the worker is shutting down", tandem::v1::KvReadyResponse());
    return;
  }
  executor_->Post(
      [this, job = std::move(job), done = std::move(done)]() mutable { Start(std::move(job), std::move(done)); });
}

std::shared_ptr<tandem::v1::Worker::Stub> KvSender::StubFor(const std::string& target) {
  std::lock_guard<std::mutex> lock(stubs_mu_);
  auto it = stubs_.find(target);
  if (it != stubs_.end()) return it->second;
  // Decode workers come and go (autoscaling): keep the map bounded.
  if (stubs_.size() >= 1024) stubs_.clear();
  auto stub = std::shared_ptr<tandem::v1::Worker::Stub>(tandem::v1::Worker::NewStub(channels_->Create(target)));
  stubs_[target] = stub;
  return stub;
}

// A KvReady call in flight.
struct KvSender::Call {
  grpc::ClientContext ctx;
  tandem::v1::KvReadyRequest request;
  tandem::v1::KvReadyResponse response;
};

// A push delivery: JOIN, the push, PUSHED (KvSender::Send).
struct KvSender::PushJob {
  Job job;
  std::shared_ptr<SendDone> done;
  std::shared_ptr<tandem::v1::Worker::Stub> stub;
  Deadline deadline{};                   // the hold timeout's
  tandem::v1::KvReadyRequest described;  // the request as a pull would send it (with checksums)
  steady_clock::time_point join_sent, push_started;
  steady_clock::duration took{};  // the push
  std::string agent;              // the decode pool's, once joined
  bool peer_held = false;         // peers_->Acquire counted it (before the JOIN where the transport pairs)
  int32_t blocks = 0;             // pushed
  int64_t bytes = 0;
  uint64_t transfer = 0;    // guarded by calls_mu_ from the push on
  bool push_ended = false;  // guarded by calls_mu_
};

bool KvSender::CallKvReady(std::shared_ptr<tandem::v1::Worker::Stub> stub, std::shared_ptr<Call> call,
                           std::function<void(const grpc::Status&)> then, bool notice) {
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    if (stopping_) {
      if (!notice) return false;
      call->ctx.set_deadline(system_clock::now() + std::chrono::seconds(1));
    }
    calls_.insert(&call->ctx);
  }
  GrpcPoller::Unary(stub->PrepareAsyncKvReady(&call->ctx, call->request, cq_), &call->response,
                    [this, call, stub, then = std::move(then)](const grpc::Status& s) {
                      // Ends the call's registration last, after every use of
                      // `this` (and after `then` registered what it started).
                      struct Unregister {
                        KvSender* sender;
                        grpc::ClientContext* ctx;
                        ~Unregister() {
                          std::lock_guard<std::mutex> lock(sender->calls_mu_);
                          sender->calls_.erase(ctx);
                          sender->calls_cv_.notify_all();
                        }
                      } unregister{this, &call->ctx};
                      then(s);
                    });
  return true;
}

namespace {
// A call deadline `d` away on the system clock (gRPC's), at least `floor`.
system_clock::time_point CallDeadline(Deadline d, steady_clock::duration floor = {}) {
  return system_clock::now() + std::max(floor, d - steady_clock::now());
}
}  // namespace

void KvSender::Start(Job job, SendDone done_once) {
  const uint64_t id = job.prefilled.id;
  const auto deadline = job.handed_off + config_.hold_timeout;
  auto done = std::make_shared<SendDone>(std::move(done_once));
  auto fail_unsent = [&](std::string why) {
    ++handoff_failures_;
    engine_->ReleasePrefilled(id);  // nothing reads these blocks
    LOG(WARNING) << "KV of request " << id << " not handed off: " << why;
    (*done)(why, tandem::v1::KvReadyResponse());
  };
  if (steady_clock::now() >= deadline) {
    fail_unsent("the hold timeout passed before KvReady could be sent");
    return;
  }
  // The decode worker may pull (and this worker checksums) only what the
  // prefill step has finished writing.
  if (job.prefilled.written != nullptr) {
    if (absl::Status w = job.prefilled.written->Wait(deadline); !w.ok()) {
      fail_unsent(absl::StrCat("the prompt's KV writes did not complete: ", w.message()));
      return;
    }
  }
  absl::StatusOr<kvtransfer::PeerInfo> local = transport_ != nullptr
                                                   ? transport_->LocalInfo()
                                                   : absl::FailedPreconditionError("this worker has no KV transport");
  if (!local.ok()) {
    fail_unsent(std::string(local.status().message()));
    return;
  }
  // Where to dial: the address as checked (a name resolved here, off the
  // poller thread, when an allow list applies).
  absl::StatusOr<PeerAddress> address = ParsePeerAddress(job.target.decode_address(), "kv_transfer.decode_address");
  absl::StatusOr<std::string> target =
      address.ok() ? allow_.CheckedTarget(*address) : absl::StatusOr<std::string>(address.status());
  if (!target.ok()) {
    const int64_t n = ++peers_refused_;
    if (ShouldLog(n)) LOG(WARNING) << "KvReady not sent: " << target.status().message();
    fail_unsent(std::string(target.status().message()));
    return;
  }
  auto call = std::make_shared<Call>();
  tandem::v1::KvReadyRequest& r = call->request;
  r.set_reservation_id(job.target.reservation_id());
  r.set_reservation_token(job.target.reservation_token());
  r.set_decode_instance_id(job.target.decode_instance_id());
  ToProto(*local, r.mutable_source());
  r.mutable_block_ids()->Add(job.prefilled.blocks.begin(), job.prefilled.blocks.end());
  r.set_prompt_tokens(job.prefilled.prompt_len);
  r.set_prompt_hash(job.prompt_hash);
  ToProto(job.prefilled.first, /*logprobs=*/true, r.mutable_first_token());
  // The blocks the decode worker holds cached already: neither checksummed
  // nor sent.
  const size_t skip =
      static_cast<size_t>(job.target.decode_cached_tokens()) / static_cast<size_t>(engine_->config().block_size);
  if (config_.checksums && skip < job.prefilled.blocks.size()) {
    const std::span<const int32_t> sent(job.prefilled.blocks.data() + skip, job.prefilled.blocks.size() - skip);
    const absl::StatusOr<std::vector<uint64_t>> sums = engine_->KvBlockChecksums(sent);
    if (!sums.ok()) {
      // Sent without checksums (the receiver then checks none), said once.
      static std::once_flag warned;
      std::call_once(warned, [&] { LOG(WARNING) << "KV hand-offs go without checksums: " << sums.status(); });
    } else {
      for (uint64_t sum : *sums) r.add_block_checksums(sum);
    }
  }
  std::shared_ptr<tandem::v1::Worker::Stub> stub = StubFor(*target);

  // Push where the decode worker offers a pool of this transport (its JOIN
  // answer, not the forwarded offer, names where the bytes go).
  const tandem::v1::KvReservation& offer = job.target.reservation();
  const bool checked = static_cast<size_t>(r.block_checksums_size()) + skip == job.prefilled.blocks.size();
  if (config_.push && checked && offer.has_destination() && offer.destination().backend() == transport_->backend() &&
      transport_->capabilities().push) {
    auto p = std::make_shared<PushJob>();
    p->stub = stub;
    p->deadline = deadline;
    p->described = r;
    auto join = std::make_shared<Call>();
    join->request = r;
    join->request.clear_block_checksums();
    join->request.set_phase(tandem::v1::KvReadyRequest::JOIN);
    join->request.set_join_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - steady_clock::now()).count())));
    join->ctx.set_deadline(CallDeadline(deadline));
    p->job = std::move(job);
    p->done = done;
    if (transport_->capabilities().needs_pairing) {
      // A send/receive transport pairs before the JOIN, which carries the
      // offer to the decode worker (it pairs as the responder when it serves
      // the JOIN); the forwarded pool is only paired with: the JOIN's answer
      // must name that pool, and decides where the bytes go.
      const kvtransfer::PeerInfo dest = FromProto(offer.destination());
      std::string pair_offer;
      if (absl::Status paired = peers_->Acquire(dest, kvtransfer::PairRole::kInitiator, "", &pair_offer);
          !paired.ok()) {
        engine_->ReleasePrefilled(id);
        SendPushed(p, absl::StrFormat("KV not pushed to %s: pairing with its pool failed: %s", r.decode_instance_id(),
                                      paired.message()));
        return;
      }
      p->peer_held = true;
      p->agent = dest.agent_id;
      join->request.set_pair_offer(pair_offer);
    }
    p->join_sent = steady_clock::now();
    if (!CallKvReady(stub, join, [this, p, join](const grpc::Status& s) { OnJoined(p, join->response, s); })) {
      if (p->peer_held) peers_->Release(p->agent, /*lost=*/false);
      engine_->ReleasePrefilled(id);
      ++handoff_failures_;
      (*done)("the worker is shutting down", tandem::v1::KvReadyResponse());
    }
    return;
  }

  call->ctx.set_deadline(CallDeadline(deadline));
  if (!SendPull(stub, call, id, done)) fail_unsent("the worker is shutting down");
}

bool KvSender::SendPull(std::shared_ptr<tandem::v1::Worker::Stub> stub, std::shared_ptr<Call> call, uint64_t id,
                        std::shared_ptr<SendDone> done) {
  return CallKvReady(stub, call, [this, call, id, done](const grpc::Status& s) {
    if (IsDefiniteAnswer(s.error_code())) {
      engine_->ReleasePrefilled(id);
    } else {
      LOG(WARNING) << "KvReady for request " << id << " failed (" << s.error_message()
                   << "); its blocks stay held until the call's deadline";
    }
    if (s.ok()) {
      ++handoffs_;
      (*done)("", call->response);
      return;
    }
    ++handoff_failures_;
    // With TLS, a peer that is not a worker of the cluster CA fails the
    // handshake: the call never started. gRPC says so only in the message
    // ("Ssl handshake failed" / "Handshake failed").
    if (channels_->secure() && s.error_code() == grpc::StatusCode::UNAVAILABLE &&
        absl::StrContains(s.error_message(), "andshake")) {
      ++peers_refused_;
    }
    (*done)(absl::StrFormat("KvReady on %s failed: %s", call->request.decode_instance_id(), s.error_message()),
            call->response);
  });
}

void KvSender::OnJoined(const std::shared_ptr<PushJob>& p, const tandem::v1::KvReadyResponse& joined,
                        const grpc::Status& status) {
  const uint64_t id = p->job.prefilled.id;
  const std::string& instance = p->described.decode_instance_id();
  if (!status.ok() && p->peer_held) {
    // UNAVAILABLE: the decode worker cannot pair with this pool (for NCCL,
    // a communicator that ended on its side): the next push pairs afresh.
    peers_->Release(p->agent, /*lost=*/status.error_code() == grpc::StatusCode::UNAVAILABLE);
    p->peer_held = false;
  }
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    // The decode worker takes no push (or not from this pool): offer the
    // pull instead; it answers that as it would have without the JOIN.
    LOG(WARNING) << "KvReady JOIN on " << instance << " refused (" << status.error_message() << "); pulling instead";
    auto call = std::make_shared<Call>();
    call->request = p->described;
    call->ctx.set_deadline(CallDeadline(p->deadline));
    if (!SendPull(p->stub, call, id, p->done)) {
      engine_->ReleasePrefilled(id);
      ++handoff_failures_;
      (*p->done)("the worker is shutting down", tandem::v1::KvReadyResponse());
    }
    return;
  }
  if (!status.ok()) {
    engine_->ReleasePrefilled(id);  // nothing was written
    const std::string why = absl::StrFormat("KvReady JOIN on %s failed: %s", instance, status.error_message());
    if (IsDefiniteAnswer(status.error_code())) {
      ++handoff_failures_;
      LOG(WARNING) << "KV of request " << id << " not pushed: " << why;
      (*p->done)(why, tandem::v1::KvReadyResponse());
    } else {
      SendPushed(p, why);  // the decode worker may have joined: it falls back now
    }
    return;
  }
  // The decode worker's word on where the bytes go.
  const int bs = engine_->config().block_size;
  const int skip = p->job.target.decode_cached_tokens() / bs;
  // A two-sided backend's receive is open there for this pool: a push not
  // made is declined in band (Transport::Decline), so nothing stays posted.
  const bool receive_open = p->peer_held && joined.has_destination() && joined.destination().agent_id() == p->agent;
  const uint64_t tag = p->job.target.reservation_id();
  const auto& prefilled = p->job.prefilled.blocks;
  std::string bad;
  if (!joined.has_destination() || joined.destination().backend() != transport_->backend()) {
    bad = "its JOIN answer names no pool of this worker's transport";
  } else if (p->peer_held && joined.destination().agent_id() != p->agent) {
    bad = absl::StrFormat("its JOIN answer names pool %s, not the one paired with (%s)",
                          joined.destination().agent_id(), p->agent);
  } else if (joined.destination_cached_blocks() != skip) {
    // The checksums cover what the forwarded reservation said was missing.
    bad = absl::StrFormat("its JOIN answer holds %d of the prompt's blocks cached; the reservation said %d",
                          joined.destination_cached_blocks(), skip);
  } else if (joined.destination_block_ids_size() + skip != static_cast<int>(prefilled.size())) {
    bad = absl::StrFormat("its JOIN answer names %d blocks past %d cached ones for a %d-block prompt",
                          joined.destination_block_ids_size(), skip, prefilled.size());
  } else if (joined.pinned_ms() == 0) {
    bad = "its JOIN answer pins the blocks for 0 ms";
  }
  kvtransfer::PeerInfo dest;
  if (bad.empty()) {
    dest = FromProto(joined.destination());
    if (absl::Status c = kvtransfer::CheckCompatible(engine_->pool_layout(), dest.layout); !c.ok()) {
      bad = absl::StrCat("its pool cannot take this worker's blocks: ", c.message());
    }
  }
  std::vector<kvtransfer::BlockPair> pairs;
  for (int i = skip; bad.empty() && i < static_cast<int>(prefilled.size()); ++i) {
    const int32_t dst = joined.destination_block_ids(i - skip);
    if (dst < 0 || dst >= dest.layout.num_blocks) {
      bad = absl::StrFormat("its JOIN answer names block %d of a %d-block pool", dst, dest.layout.num_blocks);
    }
    pairs.push_back({prefilled[i], dst});
  }
  // The writes end before the pin does (measured from the JOIN's sending:
  // the pin ran from before its answer) and before the hold timeout, with
  // the margin a pull keeps for the network's latency.
  const Deadline push_deadline =
      EndBefore(std::min(p->deadline, p->join_sent + std::chrono::milliseconds(joined.pinned_ms())));
  if (bad.empty() && push_deadline <= steady_clock::now()) {
    bad = absl::StrFormat("its pin (%d ms) leaves no time to push", joined.pinned_ms());
  }
  if (bad.empty() && !p->peer_held) {
    if (absl::Status joined_peer = peers_->Acquire(dest); !joined_peer.ok()) {
      bad = absl::StrCat("cannot join the decode worker's pool: ", joined_peer.message());
    } else {
      p->peer_held = true;
      p->agent = dest.agent_id;
    }
  }
  if (!bad.empty()) {
    if (receive_open) transport_->Decline(p->agent, tag);
    if (p->peer_held) peers_->Release(p->agent, /*lost=*/false);
    p->peer_held = false;
    engine_->ReleasePrefilled(id);
    SendPushed(p, absl::StrFormat("KV not pushed to %s: %s", instance, bad));
    return;
  }
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    if (!stopping_) ++pushing_;
    stopping = stopping_;
  }
  if (stopping) {
    if (receive_open) transport_->Decline(p->agent, tag);
    peers_->Release(p->agent, /*lost=*/false);
    engine_->ReleasePrefilled(id);
    SendPushed(p, "the prefill worker is shutting down");
    return;
  }
  p->blocks = static_cast<int32_t>(pairs.size());
  p->bytes = static_cast<int64_t>(pairs.size()) * engine_->pool_layout().block_bytes;
  p->push_started = steady_clock::now();
  std::shared_ptr<const kvtransfer::WriteFence> written =
      p->job.prefilled.written != nullptr ? p->job.prefilled.written : kvtransfer::CompletedFence();
  absl::StatusOr<uint64_t> transfer =
      transport_->PushAfter(p->agent, std::move(pairs), std::move(written), tag, push_deadline,
                            [this, p](absl::Status s) { OnPushed(p, std::move(s)); });
  if (!transfer.ok()) {
    if (receive_open) transport_->Decline(p->agent, tag);
    peers_->Release(p->agent, transfer.status().code() == absl::StatusCode::kUnavailable ||
                                  transfer.status().code() == absl::StatusCode::kNotFound);
    engine_->ReleasePrefilled(id);
    SendPushed(p, absl::StrCat("cannot start the push: ", transfer.status().message()));
    EndPush();
    return;
  }
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    if (!p->push_ended) {
      p->transfer = *transfer;
      push_ids_.insert(*transfer);
      cancel = stopping_;
    }
  }
  if (cancel) transport_->Cancel(*transfer);
}

void KvSender::OnPushed(const std::shared_ptr<PushJob>& p, absl::Status status) {
  p->took = steady_clock::now() - p->push_started;
  peers_->Release(p->agent, status.code() == absl::StatusCode::kUnavailable);
  engine_->ReleasePrefilled(p->job.prefilled.id);  // the push has read them
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    p->push_ended = true;
    if (p->transfer != 0) push_ids_.erase(p->transfer);
  }
  SendPushed(p, status.ok() ? std::string()
                            : absl::StrFormat("pushing the KV to %s failed: %s", p->described.decode_instance_id(),
                                              status.message()));
  EndPush();  // after SendPushed registered its call, so Stop waits for it too
}

void KvSender::EndPush() {
  std::lock_guard<std::mutex> lock(calls_mu_);
  --pushing_;
  calls_cv_.notify_all();
}

void KvSender::SendPushed(const std::shared_ptr<PushJob>& p, std::string sender_error) {
  auto call = std::make_shared<Call>();
  call->request = p->described;
  call->request.set_phase(tandem::v1::KvReadyRequest::PUSHED);
  if (!sender_error.empty()) {
    call->request.clear_block_checksums();
    call->request.set_sender_error(sender_error);
    LOG(WARNING) << "KV of request " << p->job.prefilled.id << " not pushed: " << sender_error;
  }
  // A failure is told even past the hold timeout (the decode worker then
  // falls back at once instead of at its deadline).
  call->ctx.set_deadline(CallDeadline(p->deadline, std::chrono::seconds(1)));
  const bool sent = CallKvReady(
      p->stub, call,
      [this, p, call, sender_error](const grpc::Status& s) {
        if (sender_error.empty() && s.ok()) {
          ++handoffs_;
          ++pushes_;
          bytes_pushed_ += p->bytes;
          tandem::v1::KvReadyResponse answer;
          answer.set_blocks_pulled(p->blocks);
          answer.set_bytes_pulled(p->bytes);
          answer.set_pull_seconds(std::chrono::duration<double>(p->took).count());
          (*p->done)("", answer);
          return;
        }
        ++handoff_failures_;
        (*p->done)(sender_error.empty() ? absl::StrFormat("KvReady PUSHED on %s failed: %s",
                                                          call->request.decode_instance_id(), s.error_message())
                                        : sender_error,
                   tandem::v1::KvReadyResponse());
      },
      /*notice=*/!sender_error.empty());
  if (!sent) {
    ++handoff_failures_;
    (*p->done)(sender_error.empty() ? "the worker is shutting down" : sender_error, tandem::v1::KvReadyResponse());
  }
}

void KvSender::AddStats(KvHandoffStats* stats) const {
  stats->pushes += pushes_.load();
  stats->bytes_pushed += bytes_pushed_.load();
  stats->peers_refused += peers_refused_.load();
  stats->handoffs += handoffs_.load();
  stats->handoff_failures += handoff_failures_.load();
}

// ---------------------------------------------------------------------------
// KvHandoff

KvHandoff::KvHandoff(Engine* engine, WorkerRole role, kvtransfer::Transport* transport, const std::string& instance_id,
                     KvHandoffConfig config, grpc::CompletionQueue* cq,
                     std::shared_ptr<const tls::ChannelFactory> channels, PeerAllowList allow)
    : engine_(engine), role_(role), transport_(transport), push_(config.push) {
  if (transport_ != nullptr) {
    peers_ = std::make_unique<PeerSet>(transport_);
    receiver_ = std::make_unique<KvReceiver>(engine_, transport_, peers_.get(), instance_id, config);
    sender_ = std::make_unique<KvSender>(engine_, transport_, peers_.get(), config, cq, std::move(channels),
                                         std::move(allow));
  }
}

KvHandoff::~KvHandoff() = default;

absl::Status KvHandoff::CheckTransfer(const tandem::v1::KvTransferParams& kv, int prompt_len) {
  using tandem::v1::KvTransferParams;
  if (kv.mode() == KvTransferParams::MODE_UNSPECIFIED) return absl::OkStatus();
  if (kv.mode() != KvTransferParams::RECEIVE && kv.mode() != KvTransferParams::SEND) {
    return absl::InvalidArgumentError(absl::StrFormat("kv_transfer.mode %d is not RECEIVE (1) or SEND (2)", kv.mode()));
  }
  const bool receive = kv.mode() == KvTransferParams::RECEIVE;
  if (receiver_ == nullptr) {
    return absl::FailedPreconditionError(
        "this worker runs without a KV transport (--kv-transport): it cannot take part in "
        "disaggregated serving");
  }
  if (role_ == (receive ? WorkerRole::kPrefill : WorkerRole::kDecode)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("this worker's role is %s: it does not %s", WorkerRoleName(role_),
                        receive ? "receive KV (mode RECEIVE)" : "prefill for other workers (mode SEND)"));
  }
  // RECEIVE: the timeout is capped, not refused (KvReceiver::ReservationTimeout).
  if (receive) return absl::OkStatus();
  if (kv.decode_address().empty() || kv.decode_instance_id().empty() || kv.reservation_id() == 0) {
    return absl::InvalidArgumentError(
        "kv_transfer mode SEND needs decode_address, decode_instance_id and reservation_id from "
        "the decode worker's KvReservation");
  }
  // Where this worker would connect, checked before anything runs (SSRF).
  RETURN_IF_ERROR(sender_->CheckDecodeAddress(kv.decode_address()));
  const int bs = engine_->config().block_size;
  if (kv.has_reservation()) {
    // The reservation forwarded whole must say what the fields above say.
    const tandem::v1::KvReservation& r = kv.reservation();
    if (r.reservation_id() != kv.reservation_id() || r.cached_tokens() != kv.decode_cached_tokens() ||
        r.instance_id() != kv.decode_instance_id() || r.reservation_token() != kv.reservation_token()) {
      return absl::InvalidArgumentError(
          "kv_transfer.reservation does not match kv_transfer's reservation_id, decode_cached_tokens, "
          "decode_instance_id and reservation_token: forward the decode worker's KvReservation unchanged");
    }
    // The ids are the decode worker's blocks (its block size, which may
    // differ: that is refused later, by the layout check, with its reason).
    for (int32_t id : r.block_ids()) {
      if (id < 0) {
        return absl::InvalidArgumentError(absl::StrFormat("kv_transfer.reservation.block_ids holds %d", id));
      }
    }
  }
  if (kv.decode_cached_tokens() < 0 || kv.decode_cached_tokens() % bs != 0 ||
      (prompt_len > 0 && kv.decode_cached_tokens() >= prompt_len)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv_transfer.decode_cached_tokens = %d must be a multiple of the block size (%d) below "
                        "the prompt length (%d)",
                        kv.decode_cached_tokens(), bs, prompt_len));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvHandoff::Receiving> KvHandoff::StartReceive(std::string caller, const std::vector<int32_t>& prompt,
                                                             uint32_t requested_timeout_ms) {
  // The worker, not the caller, bounds what a reservation holds: its
  // lifetime (capped) and the caller's blocks in waiting reservations.
  const std::chrono::milliseconds timeout = receiver_->ReservationTimeout(requested_timeout_ms);
  const int bs = engine_->config().block_size;
  const int64_t blocks = (static_cast<int64_t>(prompt.size()) + bs - 1) / bs;
  RETURN_IF_ERROR(receiver_->Charge(caller, blocks));
  return Receiving{
      .waiting = {.caller = std::move(caller),
                  .charged_blocks = blocks,
                  .expect = {.prompt_len = static_cast<int>(prompt.size()), .prompt_hash = HashTokens(prompt)},
                  .deadline = steady_clock::now() + timeout},
      .timeout_ms = static_cast<uint32_t>(timeout.count())};
}

KvReceiver::Handle KvHandoff::Reserved(const absl::StatusOr<Reservation>& reservation,
                                       const KvReceiver::Waiting& waiting) {
  if (receiver_ == nullptr) return {};
  if (!reservation.ok()) {
    receiver_->Refund(waiting.caller, waiting.charged_blocks);
    return {};
  }
  KvReceiver::Waiting w = waiting;
  w.engine_id = reservation->id;
  w.expect.blocks = reservation->blocks;
  w.expect.cached_tokens = reservation->cached_tokens;
  return receiver_->Add(std::move(w));
}

void KvHandoff::Forget(uint64_t reservation_id) { receiver_->Forget(reservation_id); }

std::chrono::milliseconds KvHandoff::engine_hold_timeout() const { return sender_->engine_hold_timeout(); }

void KvHandoff::Send(const tandem::v1::KvTransferParams& target, uint64_t prompt_hash, const Prefilled& prefilled,
                     KvSender::SendDone done) {
  sender_->Send(
      KvSender::Job{
          .target = target, .prompt_hash = prompt_hash, .prefilled = prefilled, .handed_off = steady_clock::now()},
      std::move(done));
}

void KvHandoff::KvReady(const tandem::v1::KvReadyRequest& request, Deadline call_deadline,
                        tandem::v1::KvReadyResponse* response, std::function<void(grpc::Status)> done) {
  if (receiver_ == nullptr || role_ == WorkerRole::kPrefill) {
    done(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      receiver_ == nullptr ? "this worker runs without a KV transport (--kv-transport)"
                                           : "this worker's role is prefill: it does not receive KV"));
    return;
  }
  receiver_->KvReady(request, call_deadline, response, std::move(done));
}

absl::StatusOr<kvtransfer::PeerInfo> KvHandoff::LocalInfo() const {
  if (transport_ == nullptr) {
    return absl::FailedPreconditionError("this worker runs without a KV transport (--kv-transport)");
  }
  return transport_->LocalInfo();
}

absl::StatusOr<kvtransfer::PeerInfo> KvHandoff::PushDestination() const {
  if (!push_ || transport_ == nullptr || !transport_->capabilities().push) {
    return absl::NotFoundError("this worker takes KV by pull");
  }
  return transport_->LocalInfo();
}

void KvHandoff::Stop() {
  if (sender_ != nullptr) sender_->Stop();
}

KvHandoffStats KvHandoff::stats() const {
  KvHandoffStats kv;
  if (receiver_ != nullptr) receiver_->AddStats(&kv);
  if (sender_ != nullptr) sender_->AddStats(&kv);
  return kv;
}

}  // namespace tandem::worker
