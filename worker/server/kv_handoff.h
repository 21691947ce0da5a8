// The worker side of disaggregated serving: moving one request's prompt KV
// from the prefill worker to the decode worker (proto/tandem/v1/worker.proto
// has the protocol; docs/architecture.md the life of a request).
//
//   KvHandoff: the one object the gRPC calls talk to. It checks what a
//     request's KvTransferParams ask against the worker's role and transport,
//     and passes the work to the two sides below.
//   KvSender (prefill worker): once the engine hands a prefilled prompt over,
//     it calls KvReady on the decode worker, naming its own pool and the
//     blocks, with the first token and per-block checksums. The answer
//     releases the blocks; an ambiguous failure (the call may still be
//     running there) keeps them until the call's deadline has passed, since
//     the decode worker bounds its pull by that deadline.
//   KvReceiver (decode worker): knows the reservations waiting for their KV.
//     KvReady pulls the blocks the reservation lacks from the named pool,
//     verifies them, and commits (the engine decodes from the first token)
//     or falls back (local prefill, or an error as configured).
//
// Push delivery (both workers --kv-delivery push; proto KvReadyRequest.Phase):
// the sender calls KvReady JOIN; the receiver checks it as it would a pull,
// pins the reserved blocks and answers with its pool and their ids; the
// sender writes them (Transport::PushAfter the prefill step's write fence,
// ending before the pin does), releases its blocks, and calls KvReady PUSHED
// with the checksums (or with sender_error: the receiver falls back at
// once); the receiver verifies and commits or falls back.
//
// Trust: a reservation is named on the wire by a random id and filled only
// by a KvReady that carries its 128-bit random token (from the OS's CSPRNG),
// so no one fills or steals a reservation by guessing. The worker bounds
// what a caller can hold: a reservation's lifetime is capped
// (receive_timeout_max) and each caller (its certificate's name with TLS,
// its IP address without) holds at most max_reserved_blocks_per_caller
// blocks in reservations waiting for KV. The sender dials a decode worker
// only through `channels` (mTLS: the peer must prove a worker certificate of
// the cluster CA before anything is sent) and only at addresses its
// PeerAllowList admits (peer_policy.h).
//
// Safety argument: a decode worker's memory is written only by its own
// pulls, into blocks of a reservation it still holds, or by a push it
// joined: into the blocks and the pool its JOIN answer named (never where
// the router's forwarded fields point), pinned until a time the pusher's
// deadline ends before, so blocks of a reservation cancelled meanwhile stay
// out of use until then. Nothing received is committed before its
// checksums pass; a failed transfer's blocks are quarantined by the engine.
// A prefill worker's blocks are read only while it holds them: until
// KvReady answers (pull) or its push ended, or until its deadline, by
// which the decode side's pull has ended.
//
// Thread-safe; callbacks run on gRPC, transport and executor threads.
#ifndef TANDEM_WORKER_SERVER_KV_HANDOFF_H_
#define TANDEM_WORKER_SERVER_KV_HANDOFF_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/serial_executor.h"
#include "common/tls.h"
#include "kvtransfer/transport.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/server/peer_policy.h"
#include "worker/server/peer_set.h"
#include "worker/server/worker_role.h"

namespace tandem::worker {

struct KvHandoffConfig {
  // Decode: how long a reservation waits for its KV when the request does
  // not say (KvTransferParams.timeout_ms).
  std::chrono::milliseconds receive_timeout{30000};
  // Decode: the longest a reservation may wait, whatever the request asks
  // (a longer timeout_ms is capped to it and counted). A minute: a prefill
  // worker's hold timeout (10 s) plus a long queue, while a reservation
  // nobody fills gives its blocks back within that.
  std::chrono::milliseconds receive_timeout_max{60000};
  // Decode: blocks one caller's reservations waiting for KV may reference
  // at once; beyond it RESOURCE_EXHAUSTED (a caller holding none may
  // always make one reservation, so a large prompt is never refused for
  // good). 0: no cap.
  int64_t max_reserved_blocks_per_caller = 0;
  // Prefill: the KvReady deadline, counted from the first token; the blocks
  // are held this long at most (plus a second, so the engine never frees
  // them before the call's deadline).
  std::chrono::milliseconds hold_timeout{10000};
  // Prefill: send an XXH3 checksum per transferred block; the decode worker
  // verifies them (a corrupted transfer falls back instead of decoding
  // garbage). Costs one pass over the KV on each side.
  bool checksums = true;
  // Both: --kv-delivery push. Decode: reservations offer this worker's pool
  // for pushes and KvReady JOIN / PUSHED are served (pulls still are).
  // Prefill: a reservation that offers a pool of this transport is pushed
  // to; others are pulled as before.
  bool push = false;
  // Where this worker's KV reaches (ModelInfo.kv_domain): --kv-domain, the
  // transport's Domain(), or both ("rack-a/host:<boot id>": a transport
  // bound to one host narrows a named domain to that host).
  std::string domain;
};

// Counters of the degraded and normal paths, for the load report.
struct KvHandoffStats {
  int64_t pulls = 0;              // decode: KV pulled, verified and committed
  int64_t pull_failures = 0;      // decode: KvReady that ended in a fallback
  int64_t checksum_failures = 0;  // decode: of which, a checksum mismatch
  int64_t bytes_pulled = 0;
  int64_t handoffs = 0;          // prefill: KvReady answered OK
  int64_t handoff_failures = 0;  // prefill: KvReady that failed
  int pulls_in_flight = 0;       // decode: submitted to the transport, not yet ended
  double pull_seconds = 0;       // decode: time the committed pulls took
  int64_t timeouts_capped = 0;   // decode: timeout_ms over receive_timeout_max
  int64_t over_caller_cap = 0;   // decode: reservations refused by the per-caller cap
  int64_t reserved_blocks = 0;   // decode: blocks charged to waiting reservations
  int64_t peers_refused = 0;     // prefill: decode addresses refused or unauthenticated
  int64_t pushes = 0;            // prefill: pushes the decode worker verified and committed
  int64_t bytes_pushed = 0;      // prefill: their bytes
  int64_t pushes_received = 0;   // decode: pushed KV verified and committed here
};

// What a reservation expects of the KvReady that fills it.
struct KvReadyExpectation {
  int prompt_len = 0;
  uint64_t prompt_hash = 0;
  int cached_tokens = 0;        // held here already: those blocks are not pulled
  std::vector<int32_t> blocks;  // the reserved blocks, one per block of the prompt
};

// The checks KvReady's request must pass, as pure functions (the gRPC layer
// converts and calls KvHandoff, whose KvReceiver applies them under its lock):
// the prompt it describes is the reservation's, and the first token is in
// the vocabulary. InvalidArgument naming the difference otherwise.
absl::Status CheckKvReadyPrompt(const tandem::v1::KvReadyRequest& req, const KvReadyExpectation& expect,
                                int vocab_size);
// The pull it asks for: (prefill block -> reserved block) for every block
// past the cached prefix, with a checksum per pulled block or none.
// InvalidArgument when the block or checksum counts do not add up.
absl::StatusOr<std::vector<kvtransfer::BlockPair>> PlanKvReadyPull(const tandem::v1::KvReadyRequest& req,
                                                                   const KvReadyExpectation& expect, int block_size);

// Decode side.
class KvReceiver {
 public:
  // `transport` may be null (then every KvReady is refused); `peers` is the
  // transport's PeerSet (shared with the worker's KvSender).
  KvReceiver(Engine* engine, kvtransfer::Transport* transport, PeerSet* peers, std::string instance_id,
             KvHandoffConfig config = {});

  // Charges `blocks` to `caller` before a reservation is asked of the
  // engine: ResourceExhausted when the caller would hold more than
  // max_reserved_blocks_per_caller (and already holds some). The charge
  // passes to the reservation (Add) or is given back (Refund).
  absl::Status Charge(const std::string& caller, int64_t blocks);
  void Refund(const std::string& caller, int64_t blocks);
  // The timeout a RECEIVE request gets: its own (0: the default), capped.
  std::chrono::milliseconds ReservationTimeout(uint32_t requested_ms);

  // A reservation the engine granted; KvReady may fill it until Forget.
  struct Waiting {
    uint64_t engine_id = 0;  // the engine's request id
    std::string caller;      // charged `charged_blocks` (Charge)
    int64_t charged_blocks = 0;
    KvReadyExpectation expect;  // what KvReady must describe
    Deadline deadline{};
  };
  // How the reservation is named on the wire: a random nonzero id and a
  // 16-byte random token that KvReady must repeat.
  struct Handle {
    uint64_t reservation_id = 0;
    std::string token;
  };
  Handle Add(Waiting waiting);
  // The reservation no longer takes KV (it committed, fell back, finished or
  // its stream closed): a pull in flight is cancelled and never committed.
  void Forget(uint64_t reservation_id);

  // Serves one KvReady call (any phase); `done` gets the status to answer
  // with (`response` is filled when OK). `call_deadline` is the caller's
  // deadline: the pull ends before it.
  void KvReady(const tandem::v1::KvReadyRequest& request, Deadline call_deadline, tandem::v1::KvReadyResponse* response,
               std::function<void(grpc::Status)> done);

  void AddStats(KvHandoffStats* stats);
  const std::string& instance_id() const { return instance_id_; }

 private:
  // kJoined: a push was joined (the blocks pinned); kPulling: a pull is in
  // flight, or pushed KV is being verified.
  enum class State { kWaiting, kPulling, kJoined };
  struct Pull;
  struct Entry {
    Waiting waiting;
    std::string token;
    State state = State::kWaiting;
    uint64_t transfer_id = 0;  // kPulling, once started; a send/receive transport's Receive while it runs
    std::string pusher;        // kJoined: the agent that joined
    // A send/receive transport (ucx_staged): the JOIN posted a Receive,
    // which has ended once `received` (with `receive_status`); a PUSHED
    // that came before that waits here.
    bool receiving = false;
    bool received = false;
    absl::Status receive_status;
    std::shared_ptr<Pull> pushed;
  };
  // The phases (KvReady dispatches).
  void StartPull(const tandem::v1::KvReadyRequest& req, Deadline call_deadline, tandem::v1::KvReadyResponse* response,
                 std::function<void(grpc::Status)> done);
  void Join(const tandem::v1::KvReadyRequest& req, Deadline call_deadline, tandem::v1::KvReadyResponse* response,
            std::function<void(grpc::Status)> done);
  void Pushed(const tandem::v1::KvReadyRequest& req, tandem::v1::KvReadyResponse* response,
              std::function<void(grpc::Status)> done);
  // The entry `req` names (its id and token), or null with NOT_FOUND in
  // *refusal. REQUIRES: mu_ held.
  Entry* FindLocked(const tandem::v1::KvReadyRequest& req, grpc::Status* refusal);
  // A pull's or a JOIN's admission: the entry waits and `req` describes its
  // prompt, and the blocks add up (the pairs go to pull->pairs; the entry
  // is returned for the caller to move on). A pool it cannot take from
  // (`compatible` not OK) ends the reservation: null and *incompatible.
  // Else null with the status to answer in *refusal (the reservation keeps
  // waiting). REQUIRES: mu_ held.
  Entry* AdmitLocked(const tandem::v1::KvReadyRequest& req, const absl::Status& compatible, Pull* pull,
                     bool* incompatible, grpc::Status* refusal);
  // The fallback after AdmitLocked found the sender's pool incompatible.
  void FallBackIncompatible(const std::shared_ptr<Pull>& pull, const absl::Status& compatible);
  // Checks KvReady's source pool against this worker's: OK, or why the KV
  // cannot come from there (FailedPrecondition).
  absl::Status CheckSource(const tandem::v1::KvReadyRequest& req) const;
  void OnPulled(std::shared_ptr<Pull> pull, absl::Status status);
  // A send/receive transport: the JOIN's Receive, posted before its answer
  // (the peer joined as the responder). Its end: OnReceived.
  absl::Status PostReceive(const std::shared_ptr<Pull>& join, Deadline until);
  void OnReceived(const std::shared_ptr<Pull>& join, absl::Status status);
  // Verifies and commits pushed KV once its bytes are known to have landed
  // (`received`: OK for a one-sided push, the Receive's end otherwise).
  void CommitPushed(const std::shared_ptr<Pull>& pull, const absl::Status& received);
  // Verifies the received blocks' checksums and commits, or falls back
  // (the verifier's thread).
  void VerifyAndCommit(const std::shared_ptr<Pull>& pull);
  void Fail(const std::shared_ptr<Pull>& pull, grpc::Status status, bool fall_back);
  // Erases an entry and gives its caller's charge back. REQUIRES: mu_ held.
  void EraseLocked(std::map<uint64_t, Entry>::iterator it);
  void EraseLocked(uint64_t reservation_id);

  Engine* const engine_;
  kvtransfer::Transport* const transport_;
  const std::string instance_id_;
  const KvHandoffConfig config_;
  SerialExecutor verifier_{"kv_verifier"};  // checksums and commits, off the transport's thread

  std::mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);       // by wire reservation id
  std::map<std::string, int64_t> charged_ ABSL_GUARDED_BY(mu_);  // blocks per caller
  int64_t charged_total_ ABSL_GUARDED_BY(mu_) = 0;
  // The prefill workers pulled from (each restart is a new agent id).
  PeerSet* const peers_;

  std::atomic<int64_t> pulls_{0}, pull_failures_{0}, checksum_failures_{0}, bytes_pulled_{0}, pushes_received_{0};
  std::atomic<int64_t> pull_nanos_{0};
  std::atomic<int64_t> timeouts_capped_{0}, over_caller_cap_{0};
};

// Prefill side.
class KvSender {
 public:
  // KvReady calls run on `cq` (the worker's GrpcPoller drains it), over
  // channels from `channels`, to addresses `allow` admits; pushes go to
  // peers joined through `peers` (the transport's, shared with KvReceiver).
  KvSender(Engine* engine, kvtransfer::Transport* transport, PeerSet* peers, KvHandoffConfig config,
           grpc::CompletionQueue* cq,
           std::shared_ptr<const tls::ChannelFactory> channels = tls::ChannelFactory::Insecure(),
           PeerAllowList allow = PeerAllowList::Loopback());
  // Stop()s.
  ~KvSender();
  // Starts no more calls or pushes, cancels those in flight and waits for
  // them to end (the poller must still run). Idempotent.
  void Stop();

  struct Job {
    tandem::v1::KvTransferParams target;  // decode worker and reservation
    uint64_t prompt_hash = 0;
    Prefilled prefilled;
    std::chrono::steady_clock::time_point handed_off;  // the first token's time
  };
  // The hand-off's outcome: `error` is "" when the decode worker took the
  // KV (then `answer` says how much moved and how long the pull or the
  // push took).
  using SendDone = std::function<void(const std::string& error, const tandem::v1::KvReadyResponse& answer)>;
  // Hands `job`'s KV over (from the executor thread): KvReady for the
  // decode worker to pull, or, where both push, JOIN, the push and PUSHED;
  // releases the blocks as the answer or the push allows.
  void Send(Job job, SendDone done);

  // The engine's hold for a hand-off: the call's deadline plus a margin.
  std::chrono::milliseconds engine_hold_timeout() const { return config_.hold_timeout + std::chrono::seconds(1); }

  void AddStats(KvHandoffStats* stats) const;

  // Checks a SEND request's decode_address before anything runs:
  // InvalidArgument unless a plain host:port; PermissionDenied for an IP
  // address outside the allow list (a name is checked when dialled).
  absl::Status CheckDecodeAddress(const std::string& address);

 private:
  void Start(Job job, SendDone done);
  struct PushJob;
  // Push delivery: JOIN answered, the push ended, PUSHED sent.
  void OnJoined(const std::shared_ptr<PushJob>& p, const tandem::v1::KvReadyResponse& joined,
                const grpc::Status& status);
  void OnPushed(const std::shared_ptr<PushJob>& p, absl::Status status);
  void SendPushed(const std::shared_ptr<PushJob>& p, std::string sender_error);
  // A push counted in pushing_ has ended (Stop may go on).
  void EndPush();
  // One KvReady call on the poller, registered for Stop; `then` gets the
  // answer on the poller's thread. False (nothing sent) once stopping.
  struct Call;
  // The pull's KvReady (`call` described, its deadline set): releases the
  // blocks of request `id` on a definite answer. False once stopping.
  bool SendPull(std::shared_ptr<tandem::v1::Worker::Stub> stub, std::shared_ptr<Call> call, uint64_t id,
                std::shared_ptr<SendDone> done);
  // A `notice` (PUSHED with sender_error) is sent while stopping too, with
  // a deadline of a second then (Stop waits for it): a decode worker that
  // joined a push hears that none comes instead of waiting for its pin.
  bool CallKvReady(std::shared_ptr<tandem::v1::Worker::Stub> stub, std::shared_ptr<Call> call,
                   std::function<void(const grpc::Status&)> then, bool notice = false);
  std::shared_ptr<tandem::v1::Worker::Stub> StubFor(const std::string& target);

  Engine* const engine_;
  kvtransfer::Transport* const transport_;
  const KvHandoffConfig config_;
  grpc::CompletionQueue* const cq_;
  const std::shared_ptr<const tls::ChannelFactory> channels_;
  const PeerAllowList allow_;
  std::atomic<int64_t> peers_refused_{0};
  std::mutex stubs_mu_;
  std::map<std::string, std::shared_ptr<tandem::v1::Worker::Stub>> stubs_ ABSL_GUARDED_BY(stubs_mu_);
  PeerSet* const peers_;
  std::atomic<int64_t> handoffs_{0}, handoff_failures_{0}, pushes_{0}, bytes_pushed_{0};
  std::mutex calls_mu_;
  std::condition_variable calls_cv_;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(calls_mu_);  // KvReady calls in flight
  std::set<uint64_t> push_ids_ ABSL_GUARDED_BY(calls_mu_);           // pushes started (for Stop to cancel)
  int pushing_ ABSL_GUARDED_BY(calls_mu_) = 0;                       // pushes not yet ended (Stop waits)
  bool stopping_ ABSL_GUARDED_BY(calls_mu_) = false;
  std::unique_ptr<SerialExecutor> executor_ = std::make_unique<SerialExecutor>("kv_sender");
};

// Both sides behind one face, as the worker's role allows. Without a KV
// transport every hand-off is refused (FailedPrecondition) and the counters
// stay zero.
class KvHandoff {
 public:
  // `transport` (may be null) has the engine's pool registered and outlives
  // this; KvReady calls to decode workers run on `cq`, over channels from
  // `channels`, to addresses `allow` admits.
  KvHandoff(Engine* engine, WorkerRole role, kvtransfer::Transport* transport, const std::string& instance_id,
            KvHandoffConfig config, grpc::CompletionQueue* cq, std::shared_ptr<const tls::ChannelFactory> channels,
            PeerAllowList allow);
  ~KvHandoff();

  // Generate: what a request's KvTransferParams ask of this worker, checked
  // before anything runs. OK when none; FailedPrecondition when this worker
  // cannot (no transport, or its role); InvalidArgument or PermissionDenied
  // for a SEND target it will not serve.
  absl::Status CheckTransfer(const tandem::v1::KvTransferParams& kv, int prompt_len);

  // RECEIVE, before the engine reserves: the reservation's lifetime (the
  // request's, capped) and the blocks charged to `caller` for it.
  // ResourceExhausted over the per-caller cap. REQUIRES: CheckTransfer OK for
  // a RECEIVE request.
  struct Receiving {
    KvReceiver::Waiting waiting;
    uint32_t timeout_ms = 0;  // the lifetime granted, for the reservation message
  };
  absl::StatusOr<Receiving> StartReceive(std::string caller, const std::vector<int32_t>& prompt,
                                         uint32_t requested_timeout_ms);
  // The engine's answer to the reservation: the caller's charge passes to the
  // reservation, named by the handle it returns, or back to the caller when
  // there is none (then the handle's id is 0).
  KvReceiver::Handle Reserved(const absl::StatusOr<Reservation>& reservation, const KvReceiver::Waiting& waiting);
  // The reservation no longer takes KV (KvReceiver::Forget).
  void Forget(uint64_t reservation_id);

  // SEND: how long the engine holds the prefilled blocks, and the hand-off
  // once it has (KvSender::Send; `done` gets its outcome).
  std::chrono::milliseconds engine_hold_timeout() const;
  void Send(const tandem::v1::KvTransferParams& target, uint64_t prompt_hash, const Prefilled& prefilled,
            KvSender::SendDone done);

  // KvReady from a prefill worker: FailedPrecondition unless this worker
  // receives KV, else KvReceiver::KvReady.
  void KvReady(const tandem::v1::KvReadyRequest& request, Deadline call_deadline, tandem::v1::KvReadyResponse* response,
               std::function<void(grpc::Status)> done);
  // GetKvTransferInfo: this worker's transport and pool, for the router.
  absl::StatusOr<kvtransfer::PeerInfo> LocalInfo() const;
  // RECEIVE: the pool a reservation offers for pushes (--kv-delivery push
  // and a transport that pushes), else NotFound (the reservation carries
  // none and the prefill worker pulls).
  absl::StatusOr<kvtransfer::PeerInfo> PushDestination() const;

  // Stops the KvReady calls this worker makes (KvSender::Stop).
  void Stop();
  // Both sides' counters.
  KvHandoffStats stats() const;

 private:
  Engine* const engine_;
  const WorkerRole role_;
  kvtransfer::Transport* const transport_;
  const bool push_;
  std::unique_ptr<PeerSet> peers_;        // with a transport: both sides' peers
  std::unique_ptr<KvReceiver> receiver_;  // with a transport
  std::unique_ptr<KvSender> sender_;      // with a transport
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_KV_HANDOFF_H_
