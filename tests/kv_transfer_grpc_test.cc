// KV transfer metadata over gRPC, across processes: a `tandem worker
// --kv-transport ucx` publishes its pool (GetKvTransferInfo); a transport in
// this test process connects to it with that information alone and moves
// blocks out of the worker's KV cache.
#include <grpcpp/grpcpp.h>

#include <future>
#include <vector>

#include "common/grpc_status.h"
#include "gtest/gtest.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "tests/testing/worker_process.h"
#include "worker/server/proto_convert.h"
#include "worker/server/worker_service.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::WorkerProcess;

absl::StatusOr<v1::KvTransferInfo> GetInfo(v1::Worker::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::KvTransferInfo info;
  grpc::Status st = stub.GetKvTransferInfo(&ctx, v1::KvTransferInfoRequest(), &info);
  if (!st.ok()) return FromGrpcStatus(st);
  return info;
}

absl::Status Wait(kvtransfer::Transport& t, const std::string& peer, std::vector<kvtransfer::BlockPair> pairs,
                  bool pull) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto done = [promise](absl::Status s) { promise->set_value(s); };
  absl::StatusOr<uint64_t> id =
      pull ? t.Pull(peer, std::move(pairs), deadline, done) : t.Push(peer, std::move(pairs), deadline, done);
  if (!id.ok()) return id.status();
  return promise->get_future().get();
}

TEST(KvTransferGrpcTest, PeerConnectsWithTheWorkersPublishedInfo) {
  absl::StatusOr<std::unique_ptr<WorkerProcess>> w = WorkerProcess::Start(
      {"--model", "builtin:tiny", "--kv-cache-memory", "4MiB", "--kv-transport", "ucx", "--kv-transport-tls", "shm"});
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<v1::KvTransferInfo> info = GetInfo((*w)->stub());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "ucx");
  EXPECT_EQ(info->layout().model(), "tiny");
  EXPECT_EQ(info->layout().block_size(), 16);
  EXPECT_EQ(info->layout().block_bytes(), 3 * 2 * 2 * 16 * 16 * 4);
  const kvtransfer::PeerInfo peer = worker::FromProto(*info);

  // A pool of the same layout here (declared first: it must outlive the
  // transport that registers it); connect with nothing but the gRPC answer.
  kvtransfer::PoolLayout layout = peer.layout;
  layout.num_blocks = 8;
  std::vector<uint8_t> pool(layout.num_blocks * layout.block_bytes, 0xAB);
  kvtransfer::UcxOptions options;
  options.transports = "shm";
  absl::StatusOr<std::unique_ptr<kvtransfer::UcxTransport>> local = kvtransfer::UcxTransport::Create(options);
  if (!local.ok()) GTEST_SKIP() << "UCX unavailable here: " << local.status();
  ASSERT_TRUE((*local)->RegisterPool(layout, pool.data()).ok());
  ASSERT_TRUE((*local)->AddPeer(peer).ok());

  // Generate on the worker so its cache holds computed KV, then pull blocks.
  v1::GenerateRequest req;
  for (int i = 0; i < 64; ++i) req.add_prompt_token_ids((i * 13) % 256);
  req.mutable_sampling()->set_max_tokens(4);
  req.mutable_sampling()->set_temperature(0.0f);
  grpc::ClientContext ctx;
  auto reader = (*w)->stub().Generate(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_TRUE(Wait(**local, peer.agent_id, {{0, 0}, {1, 1}, {2, 2}, {3, 3}}, /*pull=*/true).ok());
  // The worker's first blocks hold real f32 K/V now, not the fill pattern.
  const float* values = reinterpret_cast<const float*>(pool.data());
  int nonzero = 0;
  for (int i = 0; i < 4 * layout.block_bytes / 4; ++i) nonzero += values[i] != 0.0f;
  EXPECT_GT(nonzero, 0);
  EXPECT_NE(pool[0], 0xAB);

  // Block ids outside the worker's pool are refused before anything moves.
  EXPECT_EQ(Wait(**local, peer.agent_id, {{static_cast<int32_t>(peer.layout.num_blocks), 0}}, true).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvTransferGrpcTest, MismatchedLayoutIsRefusedAndAWorkerWithoutTransportSaysSo) {
  absl::StatusOr<std::unique_ptr<WorkerProcess>> w =
      WorkerProcess::Start({"--model", "builtin:tiny", "--kv-cache-memory", "4MiB", "--kv-transport", "ucx",
                            "--kv-transport-tls", "shm", "--block-size", "8"});
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<v1::KvTransferInfo> info = GetInfo((*w)->stub());
  ASSERT_TRUE(info.ok()) << info.status();
  kvtransfer::PoolLayout layout = worker::FromProto(*info).layout;
  layout.block_size = 16;  // this side's blocks are twice as long
  layout.block_bytes *= 2;
  layout.num_blocks = 4;
  std::vector<uint8_t> pool(4 * layout.block_bytes);  // outlives `local`
  kvtransfer::UcxOptions options;
  options.transports = "shm";
  absl::StatusOr<std::unique_ptr<kvtransfer::UcxTransport>> local = kvtransfer::UcxTransport::Create(options);
  if (!local.ok()) GTEST_SKIP() << "UCX unavailable here: " << local.status();
  ASSERT_TRUE((*local)->RegisterPool(layout, pool.data()).ok());
  absl::Status st = (*local)->AddPeer(worker::FromProto(*info));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(st.message()).find("block_size"), std::string::npos) << st;

  absl::StatusOr<std::unique_ptr<WorkerProcess>> plain =
      WorkerProcess::Start({"--model", "builtin:tiny", "--kv-cache-memory", "4MiB"});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(GetInfo((*plain)->stub()).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem
