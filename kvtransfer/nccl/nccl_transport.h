// NcclTransport (`nccl`, issue 24): KV blocks between the GPU pools of
// workers on two different GPUs, by NCCL send/receive, never through the
// host. A send/receive backend (needs_pairing): the decode worker posts
// Receive(tag = reservation) while it serves the JOIN, the prefill worker
// PushAfter(tag) once the JOIN's answer came and the prefill's writes are
// done.
//
// Pairing: one communicator per peer and direction, of two ranks: 0 the
// pushing side (Pair(kInitiator): its offer is a fresh ncclUniqueId, which
// the JOIN carries) and 1 the receiving side (Pair(kResponder) with that
// offer). Created non-blocking; each side polls it to its pairing deadline
// (past it: aborted, DeadlineExceeded). Reused by every transfer until the
// peer is removed or the communicator fails; the next Pair then builds a
// new one. Both pools on one GPU: refused (NCCL's ranks are two devices;
// cuda_ipc serves one GPU).
//
// Order: NCCL matches a pair's sends and receives one by one in posting
// order, but two workers see concurrent hand-offs in different orders. So
// a push is one group of a 40-byte header (its tag, run count, bytes,
// staging piece size and a hash of its run sizes) followed by its runs
// (PlanRuns of its block pairs),
// posted as soon as its fence completed, in any order; the receiver keeps
// one header receive posted, reads each header that lands, posts the
// receives of the Receive(tag) it names (the same runs: both sides expand
// the same block pairs), then the next header receive. A header whose
// Receive is not posted yet waits for it up to kUnmatchedGrace (the pair's
// later pushes queue behind it). A push for a Receive that ended unposted
// (its deadline, a cancel: the last kEndedTags are remembered) is drained
// into a scratch buffer, which runs are cut to fit (pieces of at most
// kMaxPiece). One unclaimed past the grace, or whose sizes differ, cannot
// be, so the communicator is aborted: every transfer on it fails
// (Unavailable), the next transfer to the peer is refused (Unavailable:
// pair afresh), and the responder refuses an offer it joined before.
// A sender that will not push after all (its JOIN's answer did not suit
// it) sends a header alone that says so (Decline), as does a push that ends
// before it was posted (cancelled, late, its writes failed): the receiver's
// header receive completes and that Receive ends Aborted, instead of the
// header receive staying posted, which holds whatever waits for the whole
// GPU, until the next push or idle_receive_limit.
//
// Staging: NCCL moves a group of many small sends at a third of one large
// send's rate (256 blocks of 2 MiB: ~120 GB/s against ~310 on two H200s),
// so a push of two or more runs averaging under stage_runs_below goes as
// its header, then pieces of the runs' byte stream: each gathered on a copy
// stream into one half of a staging buffer and sent as one buffer; the
// receiver receives each into a half and scatters it (NcclApi::Copies,
// ordered by tickets: a piece's send after its gather, a half's next gather
// after its last send, a receive after the half's last scatter). Both sides
// decide from the run count and bytes that the header carries, and a staged
// push's pieces go before any other push's header.
//
// Completion: one progress thread polls the communicators (their groups'
// events and asynchronous errors, NcclApi::Done). A transfer past its
// deadline before it was posted ends with DeadlineExceeded; one in flight
// aborts its communicator (bytes on the wire cannot be recalled: the abort
// ends them). Cancel of a posted transfer reports Cancelled once its group
// ended. So no byte lands after `done`. The progress thread makes every
// NCCL call but creation (a header's read blocks it for one small copy).
//
// A dead peer: NCCL may not report a peer process's death for long, so a
// peer of this host and pid namespace is watched (/proc, every 200 ms) and
// its communicators end (Unavailable, naming the exit) when it is gone;
// elsewhere transfers end at their deadlines.
//
// Thread-safe.
#ifndef TANDEM_KVTRANSFER_NCCL_NCCL_TRANSPORT_H_
#define TANDEM_KVTRANSFER_NCCL_NCCL_TRANSPORT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kvtransfer/nccl/nccl_api.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

struct NcclOptions {
  int device = 0;                // the GPU of the pool (the worker's --device cuda:N)
  std::shared_ptr<NcclApi> api;  // null: LoadNccl()
  bool host_pools = false;       // pools in host memory (the fake NCCL moves those; tests)
  // A push whose runs average fewer bytes than `stage_runs_below` (and has
  // two or more) goes through a staging buffer of two `stage_piece` halves:
  // gathered into a half and sent as one buffer a piece, scattered out of
  // one on the other side (NCCL moves a group of many small sends at a
  // third of one large send's rate). Both sides must agree.
  int64_t stage_piece = int64_t{32} << 20;
  int64_t stage_runs_below = int64_t{16} << 20;
  // A receiver whose header receive stays posted this long for receives
  // that ended only (their headers never came: a JOIN answer the sender
  // did not get) aborts the communicator: a posted NCCL receive holds
  // whatever waits for the whole GPU. The next push pairs afresh. (A header
  // receive is posted only while a header is owed: a pair whose pushes all
  // landed posts none, however long it stays quiet.)
  std::chrono::milliseconds idle_receive_limit{5000};
};

class NcclTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(NcclOptions options);
  static TransportCapabilities Capabilities() {
    return {.push = true, .needs_pairing = true, .memory = {MemoryType::kCuda}};
  }
  ~NcclTransport() override;  // transfers still open finish with Cancelled; communicators are aborted

  std::string backend() const override { return "nccl"; }
  TransportCapabilities capabilities() const override;
  absl::Status RegisterPool(const PoolLayout& layout, void* base) override;
  absl::StatusOr<PeerInfo> LocalInfo() const override;
  absl::Status AddPeer(const PeerInfo& peer) override;
  // Aborts its communicators: their transfers finish with Unavailable.
  void RemovePeer(const std::string& agent_id) override;
  // FailedPrecondition: a push needs the peer's Receive (PushAfter with its tag).
  absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  // Unimplemented: NCCL moves what the sender sends.
  absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<BlockPair> blocks, Deadline deadline,
                                TransferDone done) override;
  void Cancel(uint64_t transfer_id) override;
  absl::StatusOr<std::string> Pair(const PeerInfo& peer, PairRole role, std::string_view offer, Deadline deadline,
                                   TransferDone done) override;
  absl::StatusOr<uint64_t> PushAfter(const std::string& agent_id, std::vector<BlockPair> blocks,
                                     std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                     TransferDone done) override;
  absl::StatusOr<uint64_t> Receive(const std::string& agent_id, std::vector<BlockPair> blocks, uint64_t tag,
                                   Deadline deadline, TransferDone done) override;
  // A header alone (magic kDeclined), queued as a push is: the receiver's
  // header receive completes, and the Receive it names ends (or the ended
  // one is forgotten) instead of its header receive staying posted. A push
  // that ends before it is posted (cancelled, late, its writes failed)
  // sends one in its place: every PushAfter(tag) sends the tag's header.
  void Decline(const std::string& agent_id, uint64_t tag) override;

  // The header's layout and meanings: LocalInfo carries it, and AddPeer
  // refuses a peer of another (a rolling upgrade's mixed pair would
  // mismatch its sizes on the wire).
  static constexpr int kWireVersion = 2;

  // The header a push sends before its runs.
  struct Header {
    uint32_t magic;  // kMagic, or kDeclined: no push for `tag` (no runs follow)
    uint32_t runs;
    uint64_t tag;
    int64_t bytes;
    uint64_t piece;  // staged: the pieces' size; 0: the runs as they are
    uint64_t shape;  // ShapeOf the runs: the receiver's must match (the same block list)
  };
  static_assert(sizeof(Header) == 40);
  // A hash of the runs' sizes in order: two block lists of one run count
  // and byte total whose runs differ differ here (NCCL needs each send to
  // match its receive's size; staged, a shifted run would land misplaced).
  static uint64_t ShapeOf(const std::vector<CopyRun>& runs);

 private:
  struct Xfer {
    uint64_t id = 0;
    bool send = false;
    uint64_t tag = 0;
    std::vector<CopyRun> runs;
    int64_t bytes = 0;
    std::shared_ptr<const WriteFence> after;  // send: null once it completed
    Deadline deadline;
    TransferDone done;
    bool posted = false;
    bool cancelled = false;
    bool declined = false;  // send: Decline's header alone
    bool staged = false;    // through the staging buffer, a piece at a time
    size_t next_piece = 0;  // staged: the pieces posted so far
  };
  struct Flight {
    uint64_t ticket = 0;
    uint64_t xfer = 0;  // 0: the receiver's header receive; kPieceFlight: a staged piece's not last step
    std::chrono::steady_clock::time_point drain_deadline;  // kDrainFlight: when it aborts the pair
  };
  // A receive that ended before its push came: what its push's header
  // will say, and the sizes of the buffers it sends.
  struct Ended {
    uint64_t tag = 0;
    uint32_t runs = 0;
    int64_t bytes = 0;
    uint64_t piece = 0;
    uint64_t shape = 0;
    std::vector<int64_t> sizes;
  };
  // The communicator with one peer in one direction (rank 0 sends).
  struct Comm {
    void* handle = nullptr;
    int rank = 0;
    bool ready = false;
    Deadline pair_deadline;
    std::vector<TransferDone> pairing;                 // Pair's dones, until ready
    absl::Status doomed;                               // set: the progress thread aborts it with this
    std::deque<uint64_t> pending;                      // rank 0: pushes not yet posted, in PushAfter order
    absl::flat_hash_map<uint64_t, uint64_t> receives;  // rank 1: tag -> transfer, until it ends
    std::deque<Flight> flights;                        // posted groups, in stream order
    void* headers = nullptr;                           // rank 0: kHeaderRing headers; rank 1: one
    uint64_t headers_sent = 0;                         // rank 0: ring position
    bool header_posted = false;                        // rank 1: a header receive is posted
    std::chrono::steady_clock::time_point idle_since;  // rank 1: when it became the only posted receive
    uint64_t awaiting = 0;                             // rank 1: its header landed, its receives are to post
    std::optional<Header> parked;                      // rank 1: a landed header whose Receive is not posted yet
    std::chrono::steady_clock::time_point parked_at;
    // rank 1: receives that ended unposted (the last kEndedTags), to drain
    // their pushes.
    std::deque<Ended> ended;
    void* staging = nullptr;                    // two stage_piece halves on the device, used in turn
    int next_half = 0;                          // the half the next piece goes through
    uint64_t half_done[2] = {};                 // each half's last use: a send (rank 0) or a scatter (rank 1)
    uint64_t staging_xfer = 0;                  // rank 0: a staged push whose header went, its pieces posting
    std::optional<std::vector<int64_t>> drain;  // rank 1: a push to drain, its receives to post
  };
  using CommKey = std::pair<std::string, int>;  // peer agent id, this side's rank
  using Finished = std::vector<std::pair<TransferDone, absl::Status>>;

  static constexpr int kHeaderRing = 64;
  static constexpr size_t kMaxInFlight = 16;  // a pair's pushes posted and not yet done
  static constexpr std::chrono::seconds kUnmatchedGrace{2};
  static constexpr size_t kEndedTags = 256;
  static constexpr int64_t kMaxPiece = int64_t{64} << 20;
  static constexpr uint64_t kDrainFlight = ~uint64_t{0};      // Flight::xfer of a drained push
  static constexpr uint64_t kPieceFlight = ~uint64_t{0} - 1;  // Flight::xfer of a staged step
  static constexpr std::chrono::seconds kDrainLimit{30};
  static constexpr uint32_t kMagic = 0x4b564e43;            // "CNVK"
  static constexpr uint32_t kDeclined = 0x44564e43;         // "CNVD"
  static constexpr std::chrono::seconds kDeclineLimit{10};  // a Decline's header posts and lands by then

  NcclTransport(NcclOptions options, std::shared_ptr<NcclApi> api);
  void ProgressLoop();
  // One pass over every communicator; true while any has work in flight.
  bool Step(Finished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Advance(const std::string& peer, Comm& c, Finished& finished, bool* flying)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PostSends(Comm& c, Finished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PostReceives(Comm& c, Finished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A landed header: parks it for its Receive (one that ended, or other
  // sizes: the error that aborts the communicator); a declined one ends its
  // Receive.
  absl::Status TakeHeader(Comm& c, Finished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The parked header's Receive, if posted now (or the error past the grace).
  absl::Status ClaimParked(Comm& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `c` (aborted): its pairing and transfers finish (DeadlineExceeded
  // for those past their deadline, else Unavailable naming `why`).
  void FailComm(const std::string& peer, Comm& c, const absl::Status& why, Finished& finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(uint64_t id, absl::Status st, Finished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the peer still owes a header: an open receive's that has not
  // landed, or (unless `open_only`) one that ended unposted.
  bool OwedHeader(const Comm& c, bool open_only = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Turns send `x` (new, or a push that ended before it was posted, its
  // `done` called) into a decline of its tag, queued where it is.
  void MakeDecline(Xfer& x) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A staged transfer's pieces: their sizes, and piece `i`'s copies between
  // the pool and the staging half `half` (send: gathers; receive: scatters).
  std::vector<int64_t> PieceSizes(const Xfer& x) const;
  // What its header says of staging: the pieces' size, 0 where not staged.
  uint64_t PieceOf(const Xfer& x) const { return x.staged ? static_cast<uint64_t>(options_.stage_piece) : 0; }
  std::vector<NcclApi::Copy> PieceCopies(const Xfer& x, size_t i, uint8_t* half) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts what it can of staged `x` (send: the pieces' gathers and sends;
  // receive: their receives and scatters); true once every piece is posted.
  absl::StatusOr<bool> PostPieces(Comm& c, Xfer& x) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks blocks and peer for a PushAfter or Receive and registers it.
  absl::StatusOr<uint64_t> Start(const std::string& agent_id, std::vector<BlockPair> blocks,
                                 std::shared_ptr<const WriteFence> after, uint64_t tag, Deadline deadline,
                                 TransferDone done, bool send);

  const NcclOptions options_;
  const std::shared_ptr<NcclApi> api_;
  const std::string agent_id_;
  const std::string bus_id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  PoolLayout layout_ ABSL_GUARDED_BY(mu_);
  unsigned char* base_ ABSL_GUARDED_BY(mu_) = nullptr;
  struct Peer {
    PeerInfo info;
    int64_t pid = 0;     // watched for its exit where start != 0
    uint64_t start = 0;  // the process's start time
  };
  static constexpr std::chrono::milliseconds kWatchEvery{200};
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point next_watch_ ABSL_GUARDED_BY(mu_);
  void* scratch_ ABSL_GUARDED_BY(mu_) = nullptr;                // kMaxPiece bytes on the device, for drains
  std::deque<std::string> joined_offers_ ABSL_GUARDED_BY(mu_);  // offers this side joined as the responder
  std::map<CommKey, Comm> comms_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Xfer> xfers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_NCCL_NCCL_TRANSPORT_H_
