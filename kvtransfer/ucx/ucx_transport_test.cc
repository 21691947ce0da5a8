#include "kvtransfer/ucx/ucx_transport.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int64_t kBlockBytes = 64 * 1024;
constexpr uint32_t kParentSeed = 1, kChildSeed = 2;

PoolLayout Layout(int64_t num_blocks) {
  return PoolLayout{.model = "tiny",
                    .dtype = "float32",
                    .num_layers = 2,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .block_size = 16,
                    .num_blocks = num_blocks,
                    .block_bytes = kBlockBytes};
}

// Block b of a pool seeded `seed` holds bytes derived from (seed, b).
void FillBlock(uint8_t* base, int64_t block, uint32_t seed) {
  std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(block));
  uint8_t* p = base + block * kBlockBytes;
  for (int64_t i = 0; i < kBlockBytes; i += 4) {
    const uint32_t v = rng();
    std::memcpy(p + i, &v, 4);
  }
}
void FillPool(uint8_t* base, int64_t blocks, uint32_t seed) {
  for (int64_t b = 0; b < blocks; ++b) FillBlock(base, b, seed);
}
bool BlockHolds(const uint8_t* base, int64_t block, uint32_t seed, int64_t pattern_block) {
  std::vector<uint8_t> want(kBlockBytes);
  FillBlock(want.data() - pattern_block * kBlockBytes, pattern_block, seed);
  return std::memcmp(base + block * kBlockBytes, want.data(), kBlockBytes) == 0;
}

UcxOptions Options(const std::string& tls) {
  UcxOptions o;
  o.transports = tls;
  return o;
}

// A transport with a UCX-allocated pool filled with its seed's pattern.
struct Side {
  std::unique_ptr<UcxTransport> t;
  uint8_t* pool = nullptr;
  int64_t blocks = 0;
};

absl::StatusOr<Side> MakeSide(const std::string& tls, int64_t blocks, uint32_t seed, bool allocate = true,
                              std::vector<uint8_t>* heap = nullptr) {
  Side s;
  absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(Options(tls));
  if (!t.ok()) return t.status();
  s.t = std::move(*t);
  s.blocks = blocks;
  if (allocate) {
    absl::StatusOr<void*> mem = s.t->AllocatePool(blocks * kBlockBytes);
    if (!mem.ok()) return mem.status();
    s.pool = static_cast<uint8_t*>(*mem);
  } else {
    heap->assign(blocks * kBlockBytes, 0);
    s.pool = heap->data();
  }
  FillPool(s.pool, blocks, seed);
  absl::Status st = s.t->RegisterPool(Layout(blocks), s.pool);
  if (!st.ok()) return st;
  return s;
}

// Skips the test when UCX cannot even create a context here.
#define SKIP_WITHOUT_UCX()                                                          \
  do {                                                                              \
    absl::StatusOr<std::unique_ptr<UcxTransport>> probe = UcxTransport::Create({}); \
    if (!probe.ok()) GTEST_SKIP() << "UCX unavailable: " << probe.status();         \
  } while (0)

// Runs one transfer and waits for `done`, checking it is called exactly once.
absl::Status Transfer(Transport& t, bool push, const std::string& peer, std::vector<BlockPair> blocks,
                      milliseconds timeout = milliseconds(10000)) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto promise = std::make_shared<std::promise<absl::Status>>();
  TransferDone done = [calls, promise](absl::Status st) {
    if (calls->fetch_add(1) == 0) promise->set_value(std::move(st));
  };
  absl::StatusOr<uint64_t> id = push ? t.Push(peer, std::move(blocks), Clock::now() + timeout, done)
                                     : t.Pull(peer, std::move(blocks), Clock::now() + timeout, done);
  if (!id.ok()) return id.status();
  auto future = promise->get_future();
  if (future.wait_for(timeout + milliseconds(2000)) != std::future_status::ready) {
    return absl::InternalError("done was not called within the deadline + 2 s");
  }
  absl::Status st = future.get();
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(calls->load(), 1);
  return st;
}

// `count` scattered pairs (src i*3 mod n, dst a shuffled subset) and then
// four blocks contiguous on both sides (one merged run).
std::vector<BlockPair> Scattered(int count, int64_t src_blocks, int64_t dst_blocks, uint32_t seed) {
  std::vector<int32_t> dst(dst_blocks - 4);
  std::iota(dst.begin(), dst.end(), 0);
  std::shuffle(dst.begin(), dst.end(), std::mt19937(seed));
  std::vector<BlockPair> pairs;
  for (int i = 0; i < count; ++i) {
    pairs.push_back({static_cast<int32_t>((i * 3) % (src_blocks - 4)), dst[i]});
  }
  for (int i = 0; i < 4; ++i) {
    pairs.push_back({static_cast<int32_t>(src_blocks - 4 + i), static_cast<int32_t>(dst_blocks - 4 + i)});
  }
  return pairs;
}

class UcxInProcessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxInProcessTest, PushAndPullScatteredBlocks) {
  SKIP_WITHOUT_UCX();
  auto a = MakeSide(GetParam(), 48, kParentSeed);
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<uint8_t> heap;
  // b's pool is ordinary heap memory: RegisterPool must take any host memory.
  auto b = MakeSide(GetParam(), 40, kChildSeed, /*allocate=*/false, &heap);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  ASSERT_TRUE(b->t->AddPeer(*a->t->LocalInfo()).ok());
  const std::string b_id = b->t->LocalInfo()->agent_id;

  std::vector<BlockPair> pairs = Scattered(20, 48, 40, 7);
  ASSERT_TRUE(Transfer(*a->t, /*push=*/true, b_id, pairs).ok());
  absl::flat_hash_set<int32_t> written;
  for (const BlockPair& p : pairs) {
    EXPECT_TRUE(BlockHolds(b->pool, p.dst, kParentSeed, p.src)) << "dst " << p.dst;
    written.insert(p.dst);
  }
  for (int32_t d = 0; d < 40; ++d) {
    if (!written.contains(d)) {
      EXPECT_TRUE(BlockHolds(b->pool, d, kChildSeed, d)) << d;
    }
  }

  // Pull b's blocks (src in b) into a's blocks.
  FillPool(b->pool, 40, kChildSeed);
  std::vector<BlockPair> pull = Scattered(16, 40, 48, 9);
  ASSERT_TRUE(Transfer(*a->t, /*push=*/false, b_id, pull).ok());
  for (const BlockPair& p : pull) {
    EXPECT_TRUE(BlockHolds(a->pool, p.dst, kChildSeed, p.src)) << "dst " << p.dst;
  }
}

TEST_P(UcxInProcessTest, ConcurrentTransfersAllComplete) {
  SKIP_WITHOUT_UCX();
  auto a = MakeSide(GetParam(), 32, kParentSeed);
  auto b = MakeSide(GetParam(), 32, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  const std::string b_id = b->t->LocalInfo()->agent_id;
  std::vector<std::future<absl::Status>> results;
  for (int i = 0; i < 8; ++i) {
    results.push_back(std::async(std::launch::async, [&, i] {
      return Transfer(*a->t, true, b_id, {{i * 4, 31 - i * 4}, {i * 4 + 1, 30 - i * 4}});
    }));
  }
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(BlockHolds(b->pool, 31 - i * 4, kParentSeed, i * 4));
    EXPECT_TRUE(BlockHolds(b->pool, 30 - i * 4, kParentSeed, i * 4 + 1));
  }
}

TEST_P(UcxInProcessTest, ErrorsBeforeStartAreReturned) {
  SKIP_WITHOUT_UCX();
  auto a = MakeSide(GetParam(), 8, kParentSeed);
  auto b = MakeSide(GetParam(), 4, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  const std::string b_id = b->t->LocalInfo()->agent_id;
  auto never = [](absl::Status) { ADD_FAILURE() << "done called"; };
  EXPECT_EQ(a->t->Push("nobody", {{0, 0}}, Clock::now() + milliseconds(100), never).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(a->t->Push(b_id, {{0, 4}}, Clock::now() + milliseconds(100), never).status().code(),
            absl::StatusCode::kInvalidArgument);  // b has 4 blocks
  EXPECT_EQ(a->t->RegisterPool(Layout(8), a->pool).code(), absl::StatusCode::kFailedPrecondition);
  // A deadline already past ends with DeadlineExceeded, once.
  EXPECT_EQ(Transfer(*a->t, true, b_id, {{0, 0}}, milliseconds(0)).code(), absl::StatusCode::kDeadlineExceeded);
  // After RemovePeer the peer is unknown.
  a->t->RemovePeer(b_id);
  EXPECT_EQ(a->t->Push(b_id, {{0, 0}}, Clock::now() + milliseconds(100), never).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(UcxInProcessTest, IncompatibleLayoutIsRefused) {
  SKIP_WITHOUT_UCX();
  auto a = MakeSide(GetParam(), 8, kParentSeed);
  ASSERT_TRUE(a.ok());
  PeerInfo other = *a->t->LocalInfo();
  other.agent_id = "other";
  other.layout.head_dim = 128;
  absl::Status st = a->t->AddPeer(other);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);  // CheckCompatible's code
  EXPECT_NE(st.message().find("head_dim"), std::string::npos) << st;
  other = *a->t->LocalInfo();
  other.address = "garbage";
  EXPECT_EQ(a->t->AddPeer(other).code(), absl::StatusCode::kInvalidArgument);
  other = *a->t->LocalInfo();
  other.backend = "loopback";
  EXPECT_EQ(a->t->AddPeer(other).code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxTransportTest, CancelEndsABigTcpTransferOnceAndThePeerStillWorks) {
  SKIP_WITHOUT_UCX();
  // 64 MiB over tcp/lo takes long enough (>= 50 ms here) to be cancelled.
  auto a = MakeSide("tcp", 1024, kParentSeed);
  auto b = MakeSide("tcp", 1024, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  const std::string b_id = b->t->LocalInfo()->agent_id;
  std::vector<BlockPair> all;
  for (int i = 0; i < 1024; ++i) all.push_back({i, 1023 - i});
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto promise = std::make_shared<std::promise<absl::Status>>();
  absl::StatusOr<uint64_t> id = a->t->Push(b_id, all, Clock::now() + std::chrono::seconds(20), [=](absl::Status st) {
    if (calls->fetch_add(1) == 0) promise->set_value(st);
  });
  ASSERT_TRUE(id.ok());
  std::this_thread::sleep_for(milliseconds(5));
  const auto t0 = Clock::now();
  a->t->Cancel(*id);
  absl::Status st = promise->get_future().get();
  EXPECT_LT(Clock::now() - t0, milliseconds(1000));
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  a->t->Cancel(*id);  // late and unknown ids are ignored
  a->t->Cancel(987654);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(calls->load(), 1);
  // The endpoint was reset; a new transfer goes through.
  EXPECT_TRUE(Transfer(*a->t, true, b_id, {{3, 5}}).ok());
  EXPECT_TRUE(BlockHolds(b->pool, 5, kParentSeed, 3));
}

TEST(UcxTransportTest, RemovePeerFailsTransfersInFlightWithUnavailable) {
  SKIP_WITHOUT_UCX();
  auto a = MakeSide("tcp", 1024, kParentSeed);
  auto b = MakeSide("tcp", 1024, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  const std::string b_id = b->t->LocalInfo()->agent_id;
  std::vector<BlockPair> all;
  for (int i = 0; i < 1024; ++i) all.push_back({i, i});
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto promise = std::make_shared<std::promise<absl::Status>>();
  ASSERT_TRUE(a->t->Pull(b_id, all, Clock::now() + std::chrono::seconds(20),
                         [=](absl::Status st) {
                           if (calls->fetch_add(1) == 0) promise->set_value(st);
                         })
                  .ok());
  std::this_thread::sleep_for(milliseconds(5));
  a->t->RemovePeer(b_id);
  EXPECT_EQ(promise->get_future().get().code(), absl::StatusCode::kUnavailable);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(calls->load(), 1);
  // Re-adding it works.
  ASSERT_TRUE(a->t->AddPeer(*b->t->LocalInfo()).ok());
  EXPECT_TRUE(Transfer(*a->t, false, b_id, {{7, 9}}).ok());
  EXPECT_TRUE(BlockHolds(a->pool, 9, kChildSeed, 7));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxInProcessTest, ::testing::Values("shm", "tcp"));

// ---- Across processes. The child is this binary re-executed (nothing of
// UCX is inherited through fork) running UcxChildProcess.DISABLED_Serve,
// talking over two pipes in lines of text.

std::string Hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += absl::StrFormat("%02x", c);
  return out;
}
std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

bool ReadLine(int fd, std::string* line) {
  line->clear();
  char c;
  while (true) {
    ssize_t n = read(fd, &c, 1);
    if (n <= 0) return false;
    if (c == '\n') return true;
    line->push_back(c);
  }
}
void WriteLine(int fd, const std::string& line) {
  std::string s = line + "\n";
  ssize_t n = write(fd, s.data(), s.size());
  (void)n;
}

constexpr int64_t kChildBlocks = 40, kParentBlocks = 48;

// Child: registers a pool (seed kChildSeed), prints its PeerInfo, then
// answers "verify dst:src,..." (do dst blocks hold the parent's src
// pattern?) with "ok" or "bad <dst>", until "exit" or EOF.
TEST(UcxChildProcess, DISABLED_Serve) {
  const char* in_env = std::getenv("TANDEM_UCX_CHILD_IN");
  const char* out_env = std::getenv("TANDEM_UCX_CHILD_OUT");
  const char* tls = std::getenv("TANDEM_UCX_CHILD_TLS");
  if (in_env == nullptr || out_env == nullptr || tls == nullptr) GTEST_SKIP() << "helper only";
  const int in = std::atoi(in_env), out = std::atoi(out_env);
  auto side = MakeSide(tls, kChildBlocks, kChildSeed);
  if (!side.ok()) {
    WriteLine(out, "error " + side.status().ToString());
    return;
  }
  WriteLine(out, Hex(EncodePeerInfo(*side->t->LocalInfo())));
  std::string line;
  while (ReadLine(in, &line) && line != "exit") {
    if (line.rfind("verify ", 0) != 0) continue;
    std::string reply = "ok";
    std::vector<std::string> pairs = absl::StrSplit(line.substr(7), ',', absl::SkipEmpty());
    for (const std::string& pair : pairs) {
      std::vector<std::string> parts = absl::StrSplit(pair, ':');
      const int64_t dst = std::stoll(parts[0]), src = std::stoll(parts[1]);
      if (!BlockHolds(side->pool, dst, kParentSeed, src)) {
        reply = absl::StrFormat("bad %d", dst);
        break;
      }
    }
    WriteLine(out, reply);
  }
}

struct Child {
  pid_t pid = -1;
  int to = -1, from = -1;
  ~Child() {
    if (to >= 0) close(to);
    if (from >= 0) close(from);
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  void Kill() {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

std::unique_ptr<Child> SpawnChild(const std::string& tls) {
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return nullptr;
  auto child = std::make_unique<Child>();
  child->pid = fork();
  if (child->pid == 0) {
    close(down[1]);
    close(up[0]);
    setenv("TANDEM_UCX_CHILD_IN", std::to_string(down[0]).c_str(), 1);
    setenv("TANDEM_UCX_CHILD_OUT", std::to_string(up[1]).c_str(), 1);
    setenv("TANDEM_UCX_CHILD_TLS", tls.c_str(), 1);
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    execl("/proc/self/exe", "kvtransfer_ucx_test", "--gtest_filter=UcxChildProcess.DISABLED_Serve",
          "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(down[0]);
  close(up[1]);
  child->to = down[1];
  child->from = up[0];
  return child;
}

class UcxCrossProcessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxCrossProcessTest, PushPullThenPeerKilled) {
  SKIP_WITHOUT_UCX();
  std::unique_ptr<Child> child = SpawnChild(GetParam());
  ASSERT_NE(child, nullptr);
  auto a = MakeSide(GetParam(), kParentBlocks, kParentSeed);
  ASSERT_TRUE(a.ok()) << a.status();
  std::string line;
  ASSERT_TRUE(ReadLine(child->from, &line));
  ASSERT_EQ(line.rfind("error", 0), std::string::npos) << line;
  absl::StatusOr<PeerInfo> info = DecodePeerInfo(Unhex(line));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(a->t->AddPeer(*info).ok());

  std::vector<BlockPair> pairs = Scattered(24, kParentBlocks, kChildBlocks, 11);
  ASSERT_TRUE(Transfer(*a->t, true, info->agent_id, pairs).ok());
  std::string verify = "verify ";
  for (const BlockPair& p : pairs) verify += absl::StrFormat("%d:%d,", p.dst, p.src);
  WriteLine(child->to, verify);
  ASSERT_TRUE(ReadLine(child->from, &line));
  EXPECT_EQ(line, "ok");

  // Pull untouched child blocks (still the child's own pattern).
  absl::flat_hash_set<int32_t> pushed;
  for (const BlockPair& p : pairs) pushed.insert(p.dst);
  std::vector<BlockPair> pull;
  for (int32_t b = 0, d = kParentBlocks - 1; b < kChildBlocks; ++b) {
    if (!pushed.contains(b)) pull.push_back({b, d--});
  }
  ASSERT_FALSE(pull.empty());
  ASSERT_TRUE(Transfer(*a->t, false, info->agent_id, pull).ok());
  for (const BlockPair& p : pull) EXPECT_TRUE(BlockHolds(a->pool, p.dst, kChildSeed, p.src));

  if (GetParam() == "tcp") {
    // A frozen peer: nothing fails in UCX; our deadline ends the transfer.
    kill(child->pid, SIGSTOP);
    int wstatus = 0;  // wait until it is really stopped
    ASSERT_EQ(waitpid(child->pid, &wstatus, WUNTRACED), child->pid);
    ASSERT_TRUE(WIFSTOPPED(wstatus));
    const auto t0 = Clock::now();
    absl::Status st = Transfer(*a->t, true, info->agent_id, {{0, 0}, {1, 1}}, milliseconds(1000));
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_LT(Clock::now() - t0, milliseconds(2500));
    kill(child->pid, SIGCONT);
  }

  // A killed peer: a later transfer ends with an error within its deadline.
  child->Kill();
  const auto t0 = Clock::now();
  absl::Status st = Transfer(*a->t, true, info->agent_id, {{2, 2}}, milliseconds(2000));
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_LT(Clock::now() - t0, milliseconds(2500));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxCrossProcessTest, ::testing::Values("shm", "tcp"));

TEST(PeerInfoEncodingTest, RoundTrips) {
  PeerInfo info{.agent_id = "a", .backend = "ucx", .layout = Layout(7), .address = std::string("\0x\1", 3)};
  info.layout.device_id = -1;
  absl::StatusOr<PeerInfo> back = DecodePeerInfo(EncodePeerInfo(info));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->agent_id, "a");
  EXPECT_EQ(back->address, info.address);
  EXPECT_TRUE(CheckCompatible(info.layout, back->layout).ok());
  EXPECT_EQ(back->layout.num_blocks, 7);
  EXPECT_EQ(back->layout.device_id, -1);
  EXPECT_FALSE(DecodePeerInfo("junk").ok());
}

// ---- Staged send/receive (ucx_staged).

// Slots of two blocks, three a side: most transfers below span several
// chunks and wait for slots.
UcxOptions StagedOptions(const std::string& tls) {
  UcxOptions o = Options(tls);
  o.staged = true;
  o.staging_slot_bytes = 2 * kBlockBytes;
  o.staging_slots = 3;
  return o;
}

// A staged side over heap memory (staging needs no UCX-registered pool).
struct StagedSide {
  std::unique_ptr<UcxTransport> t;
  std::vector<uint8_t> heap;
  uint8_t* pool = nullptr;
  std::string id;
};

absl::StatusOr<std::unique_ptr<StagedSide>> MakeStagedSide(UcxOptions options, int64_t blocks, uint32_t seed) {
  auto s = std::make_unique<StagedSide>();
  absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(options);
  if (!t.ok()) return t.status();
  s->t = std::move(*t);
  s->heap.assign(static_cast<size_t>(blocks * kBlockBytes), 0);
  s->pool = s->heap.data();
  FillPool(s->pool, blocks, seed);
  if (absl::Status st = s->t->RegisterPool(Layout(blocks), s->pool); !st.ok()) return st;
  s->id = s->t->LocalInfo()->agent_id;
  return s;
}

// Pairs both sides (the default Pair: each adds the other).
void Join(StagedSide& a, StagedSide& b) {
  const auto deadline = Clock::now() + milliseconds(1000);
  ASSERT_TRUE(a.t->Pair(*b.t->LocalInfo(), PairRole::kInitiator, "", deadline, [](absl::Status) {}).ok());
  ASSERT_TRUE(b.t->Pair(*a.t->LocalInfo(), PairRole::kResponder, "", deadline, [](absl::Status) {}).ok());
}

// `done` of one transfer, checked to come exactly once.
struct Outcome {
  std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::promise<absl::Status>> promise = std::make_shared<std::promise<absl::Status>>();
  std::shared_future<absl::Status> future = promise->get_future().share();
  TransferDone Done() const {
    return [calls = calls, promise = promise](absl::Status st) {
      if (calls->fetch_add(1) == 0) promise->set_value(std::move(st));
    };
  }
  absl::Status Get(milliseconds timeout = milliseconds(15000)) const {
    if (future.wait_for(timeout) != std::future_status::ready) return absl::InternalError("done never came");
    return future.get();
  }
};

absl::StatusOr<Outcome> StartReceive(StagedSide& r, const std::string& from, std::vector<BlockPair> pairs, uint64_t tag,
                                     milliseconds timeout = milliseconds(10000)) {
  Outcome o;
  absl::StatusOr<uint64_t> id = r.t->Receive(from, std::move(pairs), tag, Clock::now() + timeout, o.Done());
  if (!id.ok()) return id.status();
  return o;
}

absl::StatusOr<Outcome> StartSend(StagedSide& s, const std::string& to, std::vector<BlockPair> pairs, uint64_t tag,
                                  milliseconds timeout = milliseconds(10000),
                                  std::shared_ptr<const WriteFence> after = CompletedFence()) {
  Outcome o;
  absl::StatusOr<uint64_t> id =
      s.t->PushAfter(to, std::move(pairs), std::move(after), tag, Clock::now() + timeout, o.Done());
  if (!id.ok()) return id.status();
  return o;
}

class UcxStagedTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxStagedTest, SendAndReceiveScatteredBlocksInManyChunks) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 48, kParentSeed);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = MakeStagedSide(StagedOptions(GetParam()), 40, kChildSeed);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->t->backend(), "ucx_staged");
  EXPECT_TRUE((*a)->t->capabilities().needs_pairing);
  EXPECT_FALSE((*a)->t->capabilities().pull);
  Join(**a, **b);
  // 24 blocks, two a chunk: 12 chunks through 3 slots a side.
  std::vector<BlockPair> pairs = Scattered(20, 48, 40, 7);
  auto recv = StartReceive(**b, (*a)->id, pairs, 77);
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = StartSend(**a, (*b)->id, pairs, 77);
  ASSERT_TRUE(send.ok()) << send.status();
  EXPECT_TRUE(send->Get().ok());
  EXPECT_TRUE(recv->Get().ok());
  absl::flat_hash_set<int32_t> written;
  for (const BlockPair& p : pairs) {
    EXPECT_TRUE(BlockHolds((*b)->pool, p.dst, kParentSeed, p.src)) << "dst " << p.dst;
    written.insert(p.dst);
  }
  for (int32_t d = 0; d < 40; ++d) {
    if (!written.contains(d)) {
      EXPECT_TRUE(BlockHolds((*b)->pool, d, kChildSeed, d)) << d;
    }
  }
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(send->calls->load(), 1);
  EXPECT_EQ(recv->calls->load(), 1);
}

// More transfers than slots, in both directions at once, receives posted
// before and after their sends started: none waits on another's slot.
TEST_P(UcxStagedTest, ManyConcurrentTransfersBothWaysAllComplete) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 64, kParentSeed);
  auto b = MakeStagedSide(StagedOptions(GetParam()), 64, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  Join(**a, **b);
  std::vector<Outcome> outcomes;
  for (int i = 0; i < 8; ++i) {
    // a -> b: a's blocks 4i..4i+3 into b's 32+4i..; b -> a: b's 4i.. into a's 32+4i...
    std::vector<BlockPair> pairs;
    for (int j = 0; j < 4; ++j) pairs.push_back({4 * i + j, 32 + 4 * i + (3 - j)});
    StagedSide& from = i % 2 == 0 ? **a : **b;
    StagedSide& to = i % 2 == 0 ? **b : **a;
    const uint64_t tag = 1000 + i;
    if (i % 4 < 2) {
      auto r = StartReceive(to, from.id, pairs, tag);
      auto s = StartSend(from, to.id, pairs, tag);
      ASSERT_TRUE(r.ok() && s.ok());
      outcomes.push_back(*r);
      outcomes.push_back(*s);
    } else {
      auto s = StartSend(from, to.id, pairs, tag);
      ASSERT_TRUE(s.ok());
      std::this_thread::sleep_for(milliseconds(5));
      auto r = StartReceive(to, from.id, pairs, tag);
      ASSERT_TRUE(r.ok());
      outcomes.push_back(*r);
      outcomes.push_back(*s);
    }
  }
  for (const Outcome& o : outcomes) {
    const absl::Status st = o.Get();
    EXPECT_TRUE(st.ok()) << st;
  }
  for (int i = 0; i < 8; ++i) {
    const uint8_t* dst = i % 2 == 0 ? (*b)->pool : (*a)->pool;
    const uint32_t seed = i % 2 == 0 ? kParentSeed : kChildSeed;
    for (int j = 0; j < 4; ++j) EXPECT_TRUE(BlockHolds(dst, 32 + 4 * i + (3 - j), seed, 4 * i + j)) << i << " " << j;
  }
}

TEST_P(UcxStagedTest, ErrorsBeforeStartAreReturned) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 8, kParentSeed);
  auto b = MakeStagedSide(StagedOptions(GetParam()), 4, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  auto never = [](absl::Status) { ADD_FAILURE() << "done called"; };
  const auto later = Clock::now() + milliseconds(1000);
  // Not paired yet.
  EXPECT_EQ((*b)->t->Receive((*a)->id, {{0, 0}}, 1, later, never).status().code(), absl::StatusCode::kNotFound);
  Join(**a, **b);
  EXPECT_EQ((*a)->t->Push((*b)->id, {{0, 0}}, later, never).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*a)->t->Pull((*b)->id, {{0, 0}}, later, never).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ((*a)->t->PushAfter((*b)->id, {{0, 4}}, CompletedFence(), 1, later, never).status().code(),
            absl::StatusCode::kInvalidArgument);  // b has 4 blocks
  EXPECT_EQ((*b)->t->Receive((*a)->id, {{9, 0}}, 1, later, never).status().code(),
            absl::StatusCode::kInvalidArgument);  // a has 8 blocks
  // A GPU fence on a host pool.
  class GpuFence final : public WriteFence {
   public:
    MemoryType memory() const override { return MemoryType::kCuda; }
    absl::Status Wait(Deadline) const override { return absl::OkStatus(); }
  };
  EXPECT_EQ((*a)->t->PushAfter((*b)->id, {{0, 0}}, std::make_shared<GpuFence>(), 1, later, never).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // One receive a tag.
  auto first = StartReceive(**b, (*a)->id, {{0, 0}}, 5, milliseconds(200));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*b)->t->Receive((*a)->id, {{1, 1}}, 5, later, never).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(first->Get().code(), absl::StatusCode::kDeadlineExceeded);
  // No blocks: both sides end at once, OK (a prompt the receiver holds cached).
  auto none_r = StartReceive(**b, (*a)->id, {}, 6);
  auto none_s = StartSend(**a, (*b)->id, {}, 6);
  ASSERT_TRUE(none_r.ok() && none_s.ok());
  EXPECT_TRUE(none_r->Get().ok());
  EXPECT_TRUE(none_s->Get().ok());
  // A one-sided peer is not a staged one.
  auto plain = MakeSide(GetParam(), 8, kParentSeed);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*a)->t->AddPeer(*plain->t->LocalInfo()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plain->t->AddPeer(*(*a)->t->LocalInfo()).code(), absl::StatusCode::kInvalidArgument);
}

// A receive that ends (deadline, cancel) gives its slots back; its sender's
// late chunks are dropped, and the next transfer under a new tag works.
TEST_P(UcxStagedTest, EndedReceivesDropLateChunksAndLeakNoSlot) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 32, kParentSeed);
  auto b = MakeStagedSide(StagedOptions(GetParam()), 32, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  Join(**a, **b);
  std::vector<BlockPair> pairs;
  for (int j = 0; j < 12; ++j) pairs.push_back({j, 31 - j});
  // Deadline: nothing is sent before it passes.
  auto late = StartReceive(**b, (*a)->id, pairs, 10, milliseconds(100));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->Get().code(), absl::StatusCode::kDeadlineExceeded);
  // Cancel.
  absl::StatusOr<Outcome> cancelled = Outcome();
  absl::StatusOr<uint64_t> id =
      (*b)->t->Receive((*a)->id, pairs, 11, Clock::now() + milliseconds(10000), cancelled->Done());
  ASSERT_TRUE(id.ok());
  (*b)->t->Cancel(*id);
  EXPECT_EQ(cancelled->Get().code(), absl::StatusCode::kCancelled);
  // The senders of both tags: their chunks are taken and dropped, so the
  // sends complete; b's blocks are untouched.
  for (uint64_t tag : {10, 11}) {
    auto s = StartSend(**a, (*b)->id, pairs, tag);
    ASSERT_TRUE(s.ok());
    EXPECT_TRUE(s->Get().ok()) << tag;
  }
  for (const BlockPair& p : pairs) EXPECT_TRUE(BlockHolds((*b)->pool, p.dst, kChildSeed, p.dst));
  // Every slot is back: a transfer needing all of them, twice over, works.
  for (uint64_t tag : {12, 13}) {
    auto r = StartReceive(**b, (*a)->id, pairs, tag);
    auto s = StartSend(**a, (*b)->id, pairs, tag);
    ASSERT_TRUE(r.ok() && s.ok());
    EXPECT_TRUE(s->Get().ok());
    EXPECT_TRUE(r->Get().ok());
  }
  for (const BlockPair& p : pairs) EXPECT_TRUE(BlockHolds((*b)->pool, p.dst, kParentSeed, p.src));
}

// Both sides must name the same blocks: a receive expecting fewer fails
// with DataLoss and writes nothing it was not asked to.
TEST_P(UcxStagedTest, DifferentBlockListsFailTheReceiveWithDataLoss) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 16, kParentSeed);
  auto b = MakeStagedSide(StagedOptions(GetParam()), 16, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok());
  Join(**a, **b);
  // Three blocks sent (chunks of 2 and 1), two expected (one chunk of 2).
  auto r = StartReceive(**b, (*a)->id, {{0, 5}, {1, 6}}, 20);
  auto s = StartSend(**a, (*b)->id, {{0, 5}, {1, 6}, {2, 7}}, 20);
  ASSERT_TRUE(r.ok() && s.ok());
  const absl::Status got = r->Get();
  // The first chunk may land before the extra one arrives.
  if (!got.ok()) {
    EXPECT_EQ(got.code(), absl::StatusCode::kDataLoss) << got;
  }
  s->Get().IgnoreError();
  EXPECT_TRUE(BlockHolds((*b)->pool, 7, kChildSeed, 7));
  // Odd sizes: one block sent where a chunk of two is expected.
  auto r2 = StartReceive(**b, (*a)->id, {{0, 8}, {1, 9}}, 21);
  auto s2 = StartSend(**a, (*b)->id, {{0, 8}}, 21);
  ASSERT_TRUE(r2.ok() && s2.ok());
  EXPECT_EQ(r2->Get().code(), absl::StatusCode::kDataLoss);
  s2->Get().IgnoreError();
}

// The copier seam: a slow copier (copies complete a few polls later, as a
// GPU's do) and a failing one.
class FakeCopier final : public StagingCopier {
 public:
  FakeCopier(int polls, bool fail_starts) : polls_(polls), fail_starts_(fail_starts) {}
  MemoryType memory() const override { return MemoryType::kHost; }
  bool Ready(const WriteFence& fence) const override { return fence.Completed(); }
  absl::StatusOr<uint64_t> Start(Direction direction, uint8_t* pool, uint8_t* staging,
                                 std::span<const CopyRun> runs) override {
    if (fail_starts_ && direction == Direction::kFromStaging) return absl::InternalError("injected copy failure");
    const bool to = direction == Direction::kToStaging;
    for (const CopyRun& r : runs) {
      std::memcpy((to ? staging : pool) + r.dst_offset, (to ? pool : staging) + r.src_offset,
                  static_cast<size_t>(r.bytes));
    }
    left_[++next_] = polls_;
    return next_;
  }
  absl::StatusOr<bool> Poll(uint64_t ticket) override {
    int& left = left_.at(ticket);
    if (left-- > 0) return false;
    left_.erase(ticket);
    return true;
  }

 private:
  const int polls_;
  const bool fail_starts_;
  std::map<uint64_t, int> left_;
  uint64_t next_ = 0;
};

TEST_P(UcxStagedTest, SlowAndFailingCopiers) {
  SKIP_WITHOUT_UCX();
  UcxOptions slow = StagedOptions(GetParam());
  slow.make_copier = [](const PoolLayout&) -> absl::StatusOr<std::unique_ptr<StagingCopier>> {
    return std::make_unique<FakeCopier>(3, false);
  };
  UcxOptions failing = StagedOptions(GetParam());
  failing.make_copier = [](const PoolLayout&) -> absl::StatusOr<std::unique_ptr<StagingCopier>> {
    return std::make_unique<FakeCopier>(0, true);
  };
  auto a = MakeStagedSide(slow, 32, kParentSeed);
  auto b = MakeStagedSide(slow, 32, kChildSeed);
  auto c = MakeStagedSide(failing, 32, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  Join(**a, **b);
  Join(**a, **c);
  std::vector<BlockPair> pairs;
  for (int j = 0; j < 9; ++j) pairs.push_back({j, 20 - 2 * j});
  auto r = StartReceive(**b, (*a)->id, pairs, 30);
  auto s = StartSend(**a, (*b)->id, pairs, 30);
  ASSERT_TRUE(r.ok() && s.ok());
  EXPECT_TRUE(s->Get().ok());
  EXPECT_TRUE(r->Get().ok());
  for (const BlockPair& p : pairs) EXPECT_TRUE(BlockHolds((*b)->pool, p.dst, kParentSeed, p.src));
  // c's scatters fail: its receive fails with the copier's error, twice (slots come back).
  for (uint64_t tag : {31, 32}) {
    auto rc = StartReceive(**c, (*a)->id, pairs, tag);
    auto sc = StartSend(**a, (*c)->id, pairs, tag);
    ASSERT_TRUE(rc.ok() && sc.ok());
    const absl::Status st = rc->Get();
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    EXPECT_NE(st.message().find("injected copy failure"), std::string::npos) << st;
    sc->Get().IgnoreError();
  }
  // A copier for the wrong memory is refused at RegisterPool.
  UcxOptions wrong = StagedOptions(GetParam());
  wrong.make_copier = [](const PoolLayout&) -> absl::StatusOr<std::unique_ptr<StagingCopier>> {
    return absl::UnimplementedError("no copier for this pool");
  };
  absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(wrong);
  ASSERT_TRUE(t.ok());
  std::vector<uint8_t> heap(4 * kBlockBytes);
  EXPECT_EQ((*t)->RegisterPool(Layout(4), heap.data()).code(), absl::StatusCode::kUnimplemented);
}

// A send whose transfer ended while its chunks wait at a peer that never
// takes them keeps its slots only while that peer is joined: once the peer
// is removed, the slots come back and other transfers use them.
TEST_P(UcxStagedTest, SlotsOfSendsToARemovedPeerComeBack) {
  SKIP_WITHOUT_UCX();
  auto a = MakeStagedSide(StagedOptions(GetParam()), 32, kParentSeed);
  auto b = MakeStagedSide(StagedOptions(GetParam()), 32, kChildSeed);
  auto c = MakeStagedSide(StagedOptions(GetParam()), 32, kChildSeed);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  Join(**a, **b);
  Join(**a, **c);
  std::vector<BlockPair> pairs;
  for (int j = 0; j < 8; ++j) pairs.push_back({j, j});
  // b posts no Receive: a's chunks wait there (held as unmatched) and a's
  // push ends at its deadline with both send slots in UCX.
  auto stuck = StartSend(**a, (*b)->id, pairs, 40, milliseconds(300));
  ASSERT_TRUE(stuck.ok());
  EXPECT_EQ(stuck->Get().code(), absl::StatusCode::kDeadlineExceeded);
  (*a)->t->RemovePeer((*b)->id);
  auto r = StartReceive(**c, (*a)->id, pairs, 41, milliseconds(3000));
  auto s = StartSend(**a, (*c)->id, pairs, 41, milliseconds(3000));
  ASSERT_TRUE(r.ok() && s.ok());
  EXPECT_TRUE(s->Get().ok());
  EXPECT_TRUE(r->Get().ok());
  for (const BlockPair& p : pairs) EXPECT_TRUE(BlockHolds((*c)->pool, p.dst, kParentSeed, p.src));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxStagedTest, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace tandem::kvtransfer
