#include "worker/server/peer_set.h"

#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kvtransfer/loopback/fault_injecting_transport.h"
#include "kvtransfer/loopback/loopback_transport.h"

namespace tandem::worker {
namespace {

using kvtransfer::LoopbackFabric;
using kvtransfer::LoopbackTransport;
using kvtransfer::PoolLayout;

PoolLayout Layout() {
  return PoolLayout{.model = "tiny",
                    .dtype = "float32",
                    .num_layers = 1,
                    .num_kv_heads = 1,
                    .head_dim = 4,
                    .block_size = 16,
                    .num_blocks = 4,
                    .block_bytes = 256};
}

// A local transport and `n` peers on one fabric.
struct Fleet {
  explicit Fleet(int n) : fabric(std::make_shared<LoopbackFabric>()), local(fabric), pools(n + 1) {
    for (auto& p : pools) p.resize(4 * 256);
    EXPECT_TRUE(local.RegisterPool(Layout(), pools[0].data()).ok());
    for (int i = 0; i < n; ++i) {
      peers.push_back(std::make_unique<LoopbackTransport>(fabric));
      EXPECT_TRUE(peers.back()->RegisterPool(Layout(), pools[i + 1].data()).ok());
    }
  }
  kvtransfer::PeerInfo Info(int i) const { return *peers[i]->LocalInfo(); }
  // True when `local` can push to peer i (it is connected).
  bool Connected(int i) {
    absl::StatusOr<uint64_t> id = local.Push(
        Info(i).agent_id, {{0, 0}}, std::chrono::steady_clock::now() + std::chrono::seconds(5), [](absl::Status) {});
    return id.ok();
  }
  std::shared_ptr<LoopbackFabric> fabric;
  LoopbackTransport local;
  std::vector<std::vector<uint8_t>> pools;
  std::vector<std::unique_ptr<LoopbackTransport>> peers;
};

TEST(PeerSetTest, AddsAPeerOnceAndCountsItsTransfers) {
  Fleet f(1);
  PeerSet set(&f.local);
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  EXPECT_EQ(set.size(), 1u);
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 2);
  EXPECT_TRUE(f.Connected(0));
  set.Release(f.Info(0).agent_id, /*lost=*/false);
  set.Release(f.Info(0).agent_id, /*lost=*/false);
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 0);
  EXPECT_EQ(set.size(), 1u);  // idle peers stay connected
  EXPECT_TRUE(f.Connected(0));
  set.Release("nobody", /*lost=*/true);  // ignored
}

TEST(PeerSetTest, ALostPeerGoesOnceItsLastTransferEnded) {
  Fleet f(2);
  PeerSet set(&f.local);
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  set.Release(f.Info(0).agent_id, /*lost=*/true);
  EXPECT_EQ(set.size(), 1u);  // one transfer still in flight
  EXPECT_TRUE(f.Connected(0));
  set.Release(f.Info(0).agent_id, /*lost=*/true);
  EXPECT_EQ(set.size(), 0u);
  // Release (which runs on the transport's thread) calls nothing of the
  // transport: the next pairing removes the peer from it.
  ASSERT_TRUE(set.Acquire(f.Info(1)).ok());
  EXPECT_FALSE(f.Connected(0));
  EXPECT_TRUE(f.Connected(1));
  // Joined afresh when it comes back.
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  EXPECT_TRUE(f.Connected(0));
}

TEST(PeerSetTest, AnIncompatiblePeerIsNotCounted) {
  Fleet f(1);
  PeerSet set(&f.local);
  kvtransfer::PeerInfo other = f.Info(0);
  other.layout.head_dim = 8;
  absl::Status st = set.Acquire(other);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(set.size(), 0u);
}

TEST(PeerSetTest, APeerIsJoinedByPairAndARefusedPairingCountsNothing) {
  Fleet f(1);
  kvtransfer::FaultInjectingTransport faulty(std::make_unique<LoopbackTransport>(f.fabric));
  std::vector<uint8_t> pool(4 * 256);
  ASSERT_TRUE(faulty.RegisterPool(Layout(), pool.data()).ok());
  faulty.SetFaults({.fail_pair = true});
  PeerSet set(&faulty);
  absl::Status st = set.Acquire(f.Info(0));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(set.size(), 0u);
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 0);
  faulty.SetFaults({});
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 1);
  set.Release(f.Info(0).agent_id, /*lost=*/false);
}

// A transport that sends and receives in pairs. `inline_pairing`: its Pair
// completes before returning (as ucx_staged's); else later, through the
// offer exchange (as NCCL's will), which PeerSet does not do.
class PairedTransport final : public kvtransfer::Transport {
 public:
  PairedTransport(kvtransfer::Transport* inner, bool inline_pairing) : inner_(inner), inline_(inline_pairing) {}
  absl::StatusOr<std::string> Pair(const kvtransfer::PeerInfo& peer, kvtransfer::PairRole role, std::string_view offer,
                                   kvtransfer::Deadline deadline, kvtransfer::TransferDone done) override {
    roles.push_back(role);
    if (inline_) return kvtransfer::Transport::Pair(peer, role, offer, deadline, std::move(done));
    if (absl::Status st = AddPeer(peer); !st.ok()) return st;
    later = std::move(done);
    return std::string("an offer for the peer");
  }
  std::vector<kvtransfer::PairRole> roles;
  kvtransfer::TransferDone later;
  std::string backend() const override { return "paired"; }
  kvtransfer::TransportCapabilities capabilities() const override {
    kvtransfer::TransportCapabilities c = inner_->capabilities();
    c.needs_pairing = true;
    return c;
  }
  absl::Status RegisterPool(const PoolLayout& layout, void* base) override {
    return inner_->RegisterPool(layout, base);
  }
  absl::StatusOr<kvtransfer::PeerInfo> LocalInfo() const override { return inner_->LocalInfo(); }
  absl::Status AddPeer(const kvtransfer::PeerInfo& peer) override { return inner_->AddPeer(peer); }
  void RemovePeer(const std::string& agent_id) override { inner_->RemovePeer(agent_id); }
  absl::StatusOr<uint64_t> Push(const std::string& agent_id, std::vector<kvtransfer::BlockPair> blocks,
                                kvtransfer::Deadline deadline, kvtransfer::TransferDone done) override {
    return inner_->Push(agent_id, std::move(blocks), deadline, std::move(done));
  }
  absl::StatusOr<uint64_t> Pull(const std::string& agent_id, std::vector<kvtransfer::BlockPair> blocks,
                                kvtransfer::Deadline deadline, kvtransfer::TransferDone done) override {
    return inner_->Pull(agent_id, std::move(blocks), deadline, std::move(done));
  }
  void Cancel(uint64_t transfer_id) override { inner_->Cancel(transfer_id); }

 private:
  kvtransfer::Transport* const inner_;
  const bool inline_;
};

TEST(PeerSetTest, ATransportThatPairsLaterIsRefusedNotHalfJoined) {
  Fleet f(1);
  PairedTransport paired(&f.local, /*inline_pairing=*/false);
  PeerSet set(&paired);
  absl::Status st = set.Acquire(f.Info(0));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_EQ(set.size(), 0u);
  EXPECT_FALSE(f.Connected(0));
  paired.later(absl::OkStatus());  // a pairing that completes afterwards changes nothing
  EXPECT_EQ(set.size(), 0u);
}

// With a caller that carries the offer (the prefill worker's JOIN), a
// pairing that completes later is joined at once; one that then fails is
// joined afresh by the next Acquire once no transfer uses it.
TEST(PeerSetTest, AnOfferCarriedByTheCallerJoinsAndAFailedPairingIsRedone) {
  Fleet f(1);
  PairedTransport paired(&f.local, /*inline_pairing=*/false);
  PeerSet set(&paired);
  std::string offer = "stale";
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kInitiator, "", &offer).ok());
  EXPECT_EQ(offer, "an offer for the peer");
  EXPECT_TRUE(f.Connected(0));
  // Joined: the next transfer carries the same offer (its JOIN may reach
  // the peer before the first one's does), and pairs nothing anew.
  offer = "stale";
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kInitiator, "", &offer).ok());
  EXPECT_EQ(offer, "an offer for the peer");
  EXPECT_EQ(paired.roles.size(), 1u);
  // The pairing fails afterwards: refused while transfers use the peer ...
  paired.later(absl::UnavailableError("the peer never joined"));
  EXPECT_EQ(set.Acquire(f.Info(0), kvtransfer::PairRole::kInitiator, "", &offer).code(),
            absl::StatusCode::kUnavailable);
  set.Release(f.Info(0).agent_id, false);
  set.Release(f.Info(0).agent_id, false);
  // ... and paired afresh once none does.
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kInitiator, "", &offer).ok());
  EXPECT_EQ(offer, "an offer for the peer");
  EXPECT_EQ(paired.roles.size(), 2u);
  set.Release(f.Info(0).agent_id, false);
}

// A responder handed an offer other than the one it joined (the initiator
// paired afresh) joins the new one; the same offer again joins nothing.
TEST(PeerSetTest, AResponderJoinsANewOfferAndKeepsItsTransfersCounted) {
  Fleet f(1);
  PairedTransport paired(&f.local, /*inline_pairing=*/true);
  PeerSet set(&paired);
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kResponder, "offer A").ok());
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kResponder, "offer A").ok());
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kResponder, "").ok());
  EXPECT_EQ(paired.roles.size(), 1u);
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kResponder, "offer B").ok());
  EXPECT_EQ(paired.roles.size(), 2u);
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 4);
  EXPECT_EQ(set.size(), 1u);
  ASSERT_TRUE(set.Acquire(f.Info(0), kvtransfer::PairRole::kResponder, "offer B").ok());
  EXPECT_EQ(paired.roles.size(), 2u);
  for (int i = 0; i < 5; ++i) set.Release(f.Info(0).agent_id, false);
  EXPECT_EQ(set.in_flight(f.Info(0).agent_id), 0);
}

TEST(PeerSetTest, ATransportThatPairsInlineJoinsInTheGivenRole) {
  Fleet f(2);
  PairedTransport paired(&f.local, /*inline_pairing=*/true);
  PeerSet set(&paired);
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());
  ASSERT_TRUE(set.Acquire(f.Info(1), kvtransfer::PairRole::kResponder).ok());
  ASSERT_TRUE(set.Acquire(f.Info(1), kvtransfer::PairRole::kResponder).ok());  // joined once
  EXPECT_EQ(paired.roles,
            (std::vector<kvtransfer::PairRole>{kvtransfer::PairRole::kInitiator, kvtransfer::PairRole::kResponder}));
  EXPECT_TRUE(f.Connected(0));
  EXPECT_TRUE(f.Connected(1));
  EXPECT_EQ(set.in_flight(f.Info(1).agent_id), 2);
  set.Release(f.Info(0).agent_id, false);
  set.Release(f.Info(1).agent_id, false);
  set.Release(f.Info(1).agent_id, false);
}

TEST(PeerSetTest, BeyondTheLimitIdlePeersAreRemoved) {
  Fleet f(3);
  PeerSet set(&f.local, /*max_idle=*/2, /*idle_after=*/std::chrono::milliseconds(20));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(set.Acquire(f.Info(i)).ok());
    set.Release(f.Info(i).agent_id, /*lost=*/false);
  }
  ASSERT_TRUE(set.Acquire(f.Info(0)).ok());  // peer 0 busy
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  // A third peer goes past the limit: idle peer 1 goes, busy peer 0 stays.
  ASSERT_TRUE(set.Acquire(f.Info(2)).ok());
  EXPECT_EQ(set.size(), 2u);
  EXPECT_TRUE(f.Connected(0));
  EXPECT_FALSE(f.Connected(1));
  EXPECT_TRUE(f.Connected(2));
}

}  // namespace
}  // namespace tandem::worker
